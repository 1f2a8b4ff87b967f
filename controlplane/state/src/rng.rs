//! Seeded randomness, the only kind the core allows.

use rand_mt::Mt19937GenRand32;

/// A small seeded pseudo-random generator (SplitMix64): no I/O, no global state.
#[derive(Debug, Clone)]
pub struct SplitMix64(u64);

impl SplitMix64 {
    pub fn new(seed: u64) -> Self {
        SplitMix64(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (n > 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }

    /// Uniform in `[0, 1)`.
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// CPython's `random.Random` (Mersenne Twister seeded by `init_by_array`),
/// for the draws Gavel makes — its type shuffle, Gandiva's pairs, its job
/// generator — so Keel's runs follow Gavel's draw for draw.
///
/// It encodes (serde) as its seed and the number of 32-bit words drawn,
/// and decodes by drawing as many again: a policy's memory in the log
/// carries its random stream in a few bytes.
#[derive(Debug, Clone)]
pub struct PyRandom {
    seed: u32,
    drawn: u64,
    mt: Mt19937GenRand32,
}

/// How a [`PyRandom`] is encoded.
#[derive(serde::Serialize, serde::Deserialize)]
struct PyRandomPosition {
    seed: u32,
    drawn: u64,
}

impl serde::Serialize for PyRandom {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        PyRandomPosition {
            seed: self.seed,
            drawn: self.drawn,
        }
        .serialize(serializer)
    }
}

impl<'de> serde::Deserialize<'de> for PyRandom {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let p = PyRandomPosition::deserialize(deserializer)?;
        // A stream is drawn from a few thousand times per solve at most; a
        // position past 2³² words is not one this code wrote.
        if p.drawn > 1 << 32 {
            return Err(serde::de::Error::custom(format!(
                "random stream position {} is past 2^32 draws",
                p.drawn
            )));
        }
        let mut r = PyRandom::new(p.seed);
        for _ in 0..p.drawn {
            r.next_u32();
        }
        Ok(r)
    }
}

impl PyRandom {
    /// `random.Random(seed)` for a seed below 2³².
    pub fn new(seed: u32) -> PyRandom {
        PyRandom {
            seed,
            drawn: 0,
            mt: Mt19937GenRand32::new_with_key([seed]),
        }
    }

    /// `getrandbits(32)`.
    pub fn next_u32(&mut self) -> u32 {
        self.drawn += 1;
        self.mt.next_u32()
    }

    /// `random()`: 53 random bits from two 32-bit draws.
    pub fn random(&mut self) -> f64 {
        let a = f64::from(self.next_u32() >> 5);
        let b = f64::from(self.next_u32() >> 6);
        (a * 67_108_864.0 + b) * (1.0 / 9_007_199_254_740_992.0)
    }

    /// `uniform(a, b)`.
    pub fn uniform(&mut self, a: f64, b: f64) -> f64 {
        a + (b - a) * self.random()
    }

    /// `_randbelow(n)` for `0 < n < 2³²`: `getrandbits` of n's bit length,
    /// by rejection.
    pub fn below(&mut self, n: u32) -> u32 {
        let n = n.max(1);
        let bits = 32 - n.leading_zeros();
        loop {
            let r = self.next_u32() >> (32 - bits);
            if r < n {
                return r;
            }
        }
    }

    /// `shuffle(items)`: Fisher–Yates from the end.
    pub fn shuffle<T>(&mut self, items: &mut [T]) {
        for i in (1..items.len()).rev() {
            let j = self.below(u32::try_from(i + 1).unwrap_or(u32::MAX)) as usize;
            items.swap(i, j);
        }
    }

    /// `sample(population, 2)` (`population.len() ≥ 2`): CPython draws
    /// from a copied pool for populations of at most 21 and by rejection
    /// from a set of picked indices for larger ones.
    pub fn sample_two<T: Copy>(&mut self, population: &[T]) -> [T; 2] {
        let n = population.len();
        let below =
            |r: &mut PyRandom, k: usize| r.below(u32::try_from(k).unwrap_or(u32::MAX)) as usize;
        const SMALL_SET: usize = 21;
        if n <= SMALL_SET {
            let mut pool = population.to_vec();
            let first = below(self, n);
            let a = pool[first];
            pool[first] = pool[n - 1];
            let second = below(self, n - 1);
            [a, pool[second]]
        } else {
            let first = below(self, n);
            let mut second = below(self, n);
            while second == first {
                second = below(self, n);
            }
            [population[first], population[second]]
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_decoded_stream_goes_on_where_the_encoded_one_stopped() {
        let mut r = PyRandom::new(7);
        for _ in 0..1000 {
            r.below(13);
        }
        let bytes = postcard::to_stdvec(&r).expect("encodes");
        assert!(
            bytes.len() < 16,
            "seed and position only: {} bytes",
            bytes.len()
        );
        let mut back: PyRandom = postcard::from_bytes(&bytes).expect("decodes");
        let ahead: Vec<u32> = (0..50).map(|_| r.next_u32()).collect();
        let decoded: Vec<u32> = (0..50).map(|_| back.next_u32()).collect();
        assert_eq!(ahead, decoded);
        let far = postcard::to_stdvec(&PyRandomPosition {
            seed: 1,
            drawn: u64::MAX,
        })
        .expect("encodes");
        // postcard keeps no custom message: the error is its generic one.
        assert!(
            postcard::from_bytes::<PyRandom>(&far).is_err(),
            "a position past 2^32 draws is refused"
        );
    }

    /// Against CPython 3.11.
    #[test]
    fn py_random_follows_cpython() {
        // random.Random(5).getrandbits(32), three times.
        let mut r = PyRandom::new(5);
        assert_eq!(
            [r.next_u32(), r.next_u32(), r.next_u32()],
            [2675342405, 1097127993, 3185950873]
        );
        // r = random.Random(2); [r.random() for _ in range(3)],
        // r.uniform(1.5, 3), r.choice(range(26)).
        let mut r = PyRandom::new(2);
        let got = [r.random(), r.random(), r.random()];
        assert_eq!(
            got,
            [0.9560342718892494, 0.9478274870593494, 0.05655136772680869]
        );
        assert_eq!(r.uniform(1.5, 3.0), 1.6273079927383824);
        assert_eq!(r.below(26), 5);
        // random.Random(0).sample(list(range(10)), 2) three times, then
        // random.Random(0).sample(list(range(30)), 2) twice (30 > 21 takes
        // the set-of-indices branch).
        let mut r = PyRandom::new(0);
        let small: Vec<u64> = (0..10).collect();
        let got: Vec<[u64; 2]> = (0..3).map(|_| r.sample_two(&small)).collect();
        assert_eq!(got, vec![[6, 9], [0, 4], [8, 7]]);
        let mut r = PyRandom::new(0);
        let large: Vec<u64> = (0..30).collect();
        let got: Vec<[u64; 2]> = (0..2).map(|_| r.sample_two(&large)).collect();
        assert_eq!(got, vec![[27, 12], [24, 28]]);
    }
}
