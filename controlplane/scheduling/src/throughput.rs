//! The project's own throughput table and training curves.
//!
//! How fast a model trains on a GPU type, how that scales with the number of
//! GPUs, and how its loss falls. The simulated trainer runs at these speeds
//! and the simulator will use the same table, so a demo, a test and a
//! simulation agree. The figures are illustrative round numbers in the
//! orders published for these models (v100 > p100 > k80), not
//! measurements; a measured table can replace them.

/// One model's speed: steps per second on one GPU of each type, and how
/// well it scales.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ModelProfile {
    pub model: &'static str,
    /// Samples in one step (per GPU).
    pub batch_size: u32,
    /// Steps per second on one GPU, by type.
    pub steps_per_s: &'static [(&'static str, f64)],
    /// Fraction of linear speed-up kept each time the GPU count doubles
    /// (1.0: perfect scaling).
    pub efficiency_per_doubling: f64,
    /// Fraction of a GPU's compute the model keeps busy when it runs alone
    /// (space sharing: two models that together need less than the whole
    /// GPU barely slow each other; see [`ModelProfile::shared_fraction`]).
    pub gpu_busy: f64,
}

/// Speed of the types a model row does not list, relative to a v100.
const RELATIVE_TO_V100: &[(&str, f64)] = &[
    ("k80", 0.22),
    ("p100", 0.58),
    ("t4", 0.45),
    ("v100", 1.0),
    ("l4", 0.8),
    ("a100", 2.1),
    ("h100", 3.3),
    ("h200", 3.6),
];

/// The default table. Unknown models use the `generic` row.
pub const PROFILES: &[ModelProfile] = &[
    ModelProfile {
        model: "resnet50",
        batch_size: 32,
        steps_per_s: &[("v100", 11.0), ("p100", 6.5), ("k80", 2.4)],
        efficiency_per_doubling: 0.92,
        gpu_busy: 0.85,
    },
    ModelProfile {
        model: "resnet18",
        batch_size: 64,
        steps_per_s: &[("v100", 14.0), ("p100", 9.0), ("k80", 3.6)],
        efficiency_per_doubling: 0.9,
        gpu_busy: 0.5,
    },
    ModelProfile {
        model: "vgg16",
        batch_size: 32,
        steps_per_s: &[("v100", 7.5), ("p100", 4.2), ("k80", 1.5)],
        efficiency_per_doubling: 0.8,
        gpu_busy: 0.9,
    },
    ModelProfile {
        model: "transformer",
        batch_size: 64,
        steps_per_s: &[("v100", 8.0), ("p100", 4.5), ("k80", 1.3)],
        efficiency_per_doubling: 0.88,
        gpu_busy: 0.8,
    },
    ModelProfile {
        model: "lstm",
        batch_size: 20,
        steps_per_s: &[("v100", 16.0), ("p100", 10.0), ("k80", 5.0)],
        efficiency_per_doubling: 0.85,
        gpu_busy: 0.45,
    },
    ModelProfile {
        model: "recommendation",
        batch_size: 512,
        steps_per_s: &[("v100", 40.0), ("p100", 30.0), ("k80", 15.0)],
        efficiency_per_doubling: 0.7,
        gpu_busy: 0.35,
    },
    ModelProfile {
        model: "cyclegan",
        batch_size: 1,
        steps_per_s: &[("v100", 6.0), ("p100", 3.5), ("k80", 1.2)],
        efficiency_per_doubling: 0.75,
        gpu_busy: 0.7,
    },
    ModelProfile {
        model: "generic",
        batch_size: 32,
        steps_per_s: &[("v100", 10.0)],
        efficiency_per_doubling: 0.9,
        gpu_busy: 0.8,
    },
];

/// The model name of a job that names none.
pub use keel_state::model::GENERIC_MODEL;

/// The profile of `model`, or the `generic` one.
pub fn profile(model: &str) -> &'static ModelProfile {
    PROFILES
        .iter()
        .find(|p| p.model == model)
        .or_else(|| PROFILES.iter().find(|p| p.model == "generic"))
        .unwrap_or(&PROFILES[0])
}

impl ModelProfile {
    /// Steps per second on one GPU of `gpu_type`. A type the table does not
    /// know runs at a k80's relative speed (the slowest known).
    pub fn single_gpu_steps_per_s(&self, gpu_type: &str) -> f64 {
        if let Some((_, s)) = self.steps_per_s.iter().find(|(t, _)| *t == gpu_type) {
            return *s;
        }
        let v100 = self
            .steps_per_s
            .iter()
            .find(|(t, _)| *t == "v100")
            .map_or(10.0, |(_, s)| *s);
        let factor = RELATIVE_TO_V100
            .iter()
            .find(|(t, _)| *t == gpu_type)
            .map_or(RELATIVE_TO_V100[0].1, |(_, f)| *f);
        v100 * factor
    }

    /// Speed-up of `gpus` GPUs over one: `gpus × efficiency^log2(gpus)`.
    pub fn speedup(&self, gpus: u32) -> f64 {
        if gpus <= 1 {
            return 1.0;
        }
        let n = f64::from(gpus);
        n * self.efficiency_per_doubling.powf(n.log2())
    }

    /// Job-wide steps per second on `gpus` GPUs of `gpu_type`. A step is a
    /// fixed amount of work (`batch_size` samples, split over the GPUs), so
    /// more GPUs finish the same steps sooner, sub-linearly.
    pub fn steps_per_s(&self, gpu_type: &str, gpus: u32) -> f64 {
        self.single_gpu_steps_per_s(gpu_type) * self.speedup(gpus)
    }

    /// Fraction of its alone speed this model keeps when it shares its GPUs
    /// with `other` (space sharing): all of it, less a 5 % context-switch
    /// cost, while the two keep less than the whole GPU busy, and its share
    /// of the GPU when they need more (`1 / (busy + other's busy)`). An
    /// illustrative model in the spirit of the table, not a measurement:
    /// measured pair speeds replace it ([`crate::perf::PerfHistory`]).
    pub fn shared_fraction(&self, other: &ModelProfile) -> f64 {
        let demand = self.gpu_busy + other.gpu_busy;
        0.95 * (1.0 / demand.max(1e-9)).min(1.0)
    }

    /// Samples per second on `gpus` GPUs of `gpu_type`.
    pub fn samples_per_s(&self, gpu_type: &str, gpus: u32) -> f64 {
        self.steps_per_s(gpu_type, gpus) * f64::from(self.batch_size)
    }
}

/// Optimus's convergence model: `loss(k) = 1 / (b0·k + b1) + b2` after `k`
/// steps.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LossCurve {
    pub b0: f64,
    pub b1: f64,
    pub b2: f64,
}

impl LossCurve {
    /// A curve that starts at `initial` and has covered 98% of the way to
    /// `floor` (`floor + (initial - floor) / 50`) after `total_steps` steps.
    pub fn for_run(initial: f64, floor: f64, total_steps: u64) -> LossCurve {
        let b1 = 1.0 / (initial - floor).max(1e-9);
        let end = (initial - floor) / 50.0;
        let b0 = (1.0 / end - b1) / (total_steps.max(1) as f64);
        LossCurve { b0, b1, b2: floor }
    }

    pub fn loss(&self, step: u64) -> f64 {
        1.0 / (self.b0 * step as f64 + self.b1) + self.b2
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn faster_types_are_faster_and_scaling_is_sublinear() {
        let p = profile("resnet50");
        assert!(p.single_gpu_steps_per_s("v100") > p.single_gpu_steps_per_s("p100"));
        assert!(p.single_gpu_steps_per_s("p100") > p.single_gpu_steps_per_s("k80"));
        assert!(p.single_gpu_steps_per_s("h100") > p.single_gpu_steps_per_s("v100"));
        let s4 = p.samples_per_s("v100", 4);
        let s1 = p.samples_per_s("v100", 1);
        assert!(s4 > 3.0 * s1 && s4 < 4.0 * s1, "{s1} {s4}");
        assert_eq!(profile("no-such-model").model, "generic");
    }

    #[test]
    fn light_models_share_a_gpu_well_and_heavy_ones_take_turns_in_effect() {
        let light = profile("resnet18");
        let heavy = profile("vgg16");
        // Two light models: each keeps most of its speed.
        assert!(light.shared_fraction(light) > 0.9);
        // Two heavy ones: together hardly more than one alone.
        let pair = 2.0 * heavy.shared_fraction(heavy);
        assert!(pair > 0.95 && pair < 1.1, "{pair}");
        // The lighter partner of a mixed pair keeps the same fraction as the
        // heavier: the GPU is shared in proportion to demand.
        assert!((light.shared_fraction(heavy) - heavy.shared_fraction(light)).abs() < 1e-12);
    }

    #[test]
    fn the_loss_curve_falls_from_initial_towards_the_floor() {
        let c = LossCurve::for_run(2.5, 0.1, 1000);
        assert!((c.loss(0) - 2.5).abs() < 1e-9);
        assert!(c.loss(500) < c.loss(100));
        assert!((c.loss(1000) - (0.1 + 2.4 / 50.0)).abs() < 1e-9);
    }
}
