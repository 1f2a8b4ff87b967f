//! Durations the stores measure for the server's `/metrics` (issue 24):
//! how long the WAL's syncs and the snapshots take. A fixed-bucket
//! histogram on atomics: an observation takes no lock and allocates
//! nothing, so the flush worker's callback stays as short as it was.
//! The server reads it at each scrape ([`Latency::read`]); this crate
//! knows nothing of Prometheus.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Upper bounds, in seconds: 50 µs doubling to about 3.3 s (what a
/// `fdatasync` takes, from a fast SSD to a stalled disk), then +∞.
const BOUNDS_S: [f64; 17] = [
    0.000_05, 0.000_1, 0.000_2, 0.000_4, 0.000_8, 0.001_6, 0.003_2, 0.006_4, 0.012_8, 0.025_6,
    0.051_2, 0.102_4, 0.204_8, 0.409_6, 0.819_2, 1.638_4, 3.276_8,
];

/// A histogram of durations.
#[derive(Debug)]
pub struct Latency {
    /// Observations per bucket (not cumulative): `BOUNDS_S`, then +∞.
    buckets: [AtomicU64; BOUNDS_S.len() + 1],
    sum_ns: AtomicU64,
    count: AtomicU64,
}

/// What a [`Latency`] held when read.
#[derive(Debug, Clone, PartialEq)]
pub struct LatencyReading {
    /// The sum of the observations, in seconds.
    pub sum_s: f64,
    pub count: u64,
    /// (upper bound in seconds, observations in that bucket alone); the
    /// last bound is `f64::MAX` (+∞).
    pub buckets: Vec<(f64, u64)>,
}

impl Default for Latency {
    fn default() -> Latency {
        Latency {
            buckets: std::array::from_fn(|_| AtomicU64::new(0)),
            sum_ns: AtomicU64::new(0),
            count: AtomicU64::new(0),
        }
    }
}

impl Latency {
    /// Counts one duration.
    pub fn observe(&self, took: Duration) {
        let s = took.as_secs_f64();
        let i = BOUNDS_S
            .iter()
            .position(|b| s <= *b)
            .unwrap_or(BOUNDS_S.len());
        self.buckets[i].fetch_add(1, Ordering::Relaxed);
        let ns = u64::try_from(took.as_nanos()).unwrap_or(u64::MAX);
        self.sum_ns.fetch_add(ns, Ordering::Relaxed);
        self.count.fetch_add(1, Ordering::Relaxed);
    }

    /// What it holds now (each field read on its own: a scrape during an
    /// observation may see it in the count and not yet in a bucket).
    pub fn read(&self) -> LatencyReading {
        let buckets = BOUNDS_S
            .iter()
            .copied()
            .chain(std::iter::once(f64::MAX))
            .zip(self.buckets.iter().map(|b| b.load(Ordering::Relaxed)))
            .collect();
        LatencyReading {
            sum_s: self.sum_ns.load(Ordering::Relaxed) as f64 / 1e9,
            count: self.count.load(Ordering::Relaxed),
            buckets,
        }
    }
}

/// How long a snapshot build took, in all and by part.
#[derive(Debug, Default)]
pub struct SnapshotLatency {
    /// The whole build.
    pub total: Latency,
    /// The state read under its lock (applies wait meanwhile).
    pub read: Latency,
    /// The snapshot encoded, after the lock.
    pub encode: Latency,
    /// The snapshot saved and the store flushed.
    pub save: Latency,
    /// The journal's pages behind the snapshot merged.
    pub compact: Latency,
}

impl SnapshotLatency {
    /// Each part with its name, in the order a build runs them.
    pub fn phases(&self) -> [(&'static str, &Latency); 4] {
        [
            ("read", &self.read),
            ("encode", &self.encode),
            ("save", &self.save),
            ("compact", &self.compact),
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_duration_lands_in_the_first_bucket_that_holds_it() {
        let l = Latency::default();
        l.observe(Duration::from_micros(30));
        l.observe(Duration::from_micros(50));
        l.observe(Duration::from_millis(3));
        l.observe(Duration::from_secs(10));
        let r = l.read();
        assert_eq!(r.count, 4);
        assert!((r.sum_s - 10.00308).abs() < 1e-9, "{}", r.sum_s);
        let count_at = |bound: f64| {
            r.buckets
                .iter()
                .find(|(b, _)| *b == bound)
                .map(|(_, n)| *n)
                .expect("a bucket")
        };
        assert_eq!(count_at(0.000_05), 2);
        assert_eq!(count_at(0.003_2), 1);
        assert_eq!(count_at(f64::MAX), 1);
        assert_eq!(r.buckets.iter().map(|(_, n)| n).sum::<u64>(), 4);
    }
}
