//! Performance models (Optimus): how a job's loss falls and how its speed
//! scales, fitted online from the progress samples the state already holds.
//!
//! - **Convergence**: `loss(k) = 1/(b0·k + b1) + b2` after `k` steps, all
//!   `b ≥ 0`, fitted by non-negative least squares with later points
//!   weighted more (at least [`LOSS_POINTS_MIN`] points). A job without a
//!   declared `total_steps` is done when its fitted loss is within
//!   [`CONVERGED_FRACTION`] of the way from its starting loss to its floor.
//! - **Speed**: all-reduce jobs on `n` GPUs take `θ0/n + θ1 + θ2·n` seconds a
//!   step (compute split over the GPUs, fixed overhead, communication that
//!   grows with the ring); parameter-server jobs follow Optimus's
//!   synchronous and asynchronous forms over `(p, w)` ([`SyncPsModel`],
//!   [`AsyncPsModel`]). `θ ≥ 0`, by NNLS on measured speeds. Until a job has
//!   run at enough distinct sizes, its measured speed is scaled along the
//!   throughput table's curve.
//!
//! Speeds are kept normalised to a v100 (divided by the table's relative
//! speed of the GPU type they were measured on), so a job that moved
//! between types still has one model.
//!
//! Everything here is pure: the state records samples as entries apply
//! ([`PerfHistory::record`]); policies fit on demand.

use std::collections::BTreeMap;

use keel_state::model::Job;

use crate::throughput;

pub use keel_state::perf_history::{PerfHistory, RunningOn, SpeedStat, LOSS_POINTS_MAX};

/// Points needed before the convergence model is fitted.
pub const LOSS_POINTS_MIN: usize = 3;
/// A job is converged when `loss − b2` is down to this fraction of its
/// value at step 0.
pub const CONVERGED_FRACTION: f64 = 0.05;
/// Distinct sizes needed before the speed model is fitted.
pub const SPEED_SIZES_MIN: usize = 3;

/// Measured speed by GPU count in `history`, every type's measurements
/// normalised to a v100 by the table's relative speed of that type for
/// `model`.
pub fn speeds_v100(history: &PerfHistory, model: &str) -> BTreeMap<u32, SpeedStat> {
    let mut out: BTreeMap<u32, SpeedStat> = BTreeMap::new();
    // One factor per type: the speeds come grouped by type.
    let mut factor: Option<(&str, f64)> = None;
    for (gpu_type, n, s) in history.alone_speeds() {
        let f = match factor {
            Some((t, f)) if t == gpu_type => f,
            _ => {
                let f = type_factor(model, gpu_type);
                factor = Some((gpu_type, f));
                f
            }
        };
        if f <= 0.0 {
            continue;
        }
        out.entry(n).or_default().add(SpeedStat {
            sum_steps_per_s: s.sum_steps_per_s / f,
            count: s.count,
        });
    }
    out
}

/// A type's speed relative to a v100 for `model`, from the table.
pub fn type_factor(model: &str, gpu_type: &str) -> f64 {
    let p = throughput::profile(model);
    let v100 = p.single_gpu_steps_per_s("v100");
    if v100 > 0.0 {
        p.single_gpu_steps_per_s(gpu_type) / v100
    } else {
        0.0
    }
}

/// Non-negative least squares (Lawson–Hanson active set): the `x ≥ 0`
/// minimising `‖A·x − b‖`. `a` is row-major, every row as long as the
/// number of unknowns. Small dense problems only (a handful of unknowns).
pub fn nnls(a: &[Vec<f64>], b: &[f64]) -> Vec<f64> {
    let n = a.first().map_or(0, Vec::len);
    let mut x = vec![0.0; n];
    if n == 0 || a.len() != b.len() {
        return x;
    }
    let mut passive = vec![false; n];
    let gradient = |x: &[f64]| -> Vec<f64> {
        // w = Aᵀ(b − A x)
        let mut w = vec![0.0; n];
        for (row, bi) in a.iter().zip(b) {
            let r = bi - row.iter().zip(x).map(|(p, q)| p * q).sum::<f64>();
            for (wj, aij) in w.iter_mut().zip(row) {
                *wj += aij * r;
            }
        }
        w
    };
    let scale = a
        .iter()
        .flatten()
        .chain(b)
        .fold(0.0f64, |m, v| m.max(v.abs()))
        .max(1.0);
    let tol = 1e-10 * scale * scale * (a.len() as f64);
    for _ in 0..(3 * n + 10) {
        let w = gradient(&x);
        let Some((j, wj)) = (0..n)
            .filter(|j| !passive[*j])
            .map(|j| (j, w[j]))
            .max_by(|p, q| p.1.total_cmp(&q.1))
        else {
            break;
        };
        if wj <= tol {
            break;
        }
        passive[j] = true;
        loop {
            let z = least_squares_on(a, b, &passive);
            if (0..n).filter(|i| passive[*i]).all(|i| z[i] > 0.0) {
                x = z;
                break;
            }
            // Step back to the boundary and drop the variables that hit it.
            let mut alpha = 1.0f64;
            for i in (0..n).filter(|i| passive[*i] && z[*i] <= 0.0) {
                let denom = x[i] - z[i];
                if denom > 0.0 {
                    alpha = alpha.min(x[i] / denom);
                }
            }
            for i in 0..n {
                x[i] += alpha * (z[i] - x[i]);
                if passive[i] && x[i] <= 1e-15 {
                    passive[i] = false;
                    x[i] = 0.0;
                }
            }
            if !passive.iter().any(|p| *p) {
                break;
            }
        }
    }
    x
}

/// Unconstrained least squares over the `passive` columns (others 0), by
/// the normal equations and Gaussian elimination with partial pivoting.
fn least_squares_on(a: &[Vec<f64>], b: &[f64], passive: &[bool]) -> Vec<f64> {
    let cols: Vec<usize> = (0..passive.len()).filter(|j| passive[*j]).collect();
    let m = cols.len();
    let mut ata = vec![vec![0.0; m + 1]; m];
    for (row, bi) in a.iter().zip(b) {
        for (p, &cp) in cols.iter().enumerate() {
            for (q, &cq) in cols.iter().enumerate() {
                ata[p][q] += row[cp] * row[cq];
            }
            ata[p][m] += row[cp] * bi;
        }
    }
    for c in 0..m {
        let Some(pivot) = (c..m).max_by(|p, q| ata[*p][c].abs().total_cmp(&ata[*q][c].abs()))
        else {
            break;
        };
        ata.swap(c, pivot);
        let d = ata[c][c];
        if d.abs() < 1e-300 {
            continue;
        }
        for r in 0..m {
            if r != c {
                let f = ata[r][c] / d;
                if f != 0.0 {
                    let pivot_row = ata[c].clone();
                    for (v, p) in ata[r].iter_mut().zip(&pivot_row).skip(c) {
                        *v -= f * p;
                    }
                }
            }
        }
    }
    let mut x = vec![0.0; passive.len()];
    for (p, &c) in cols.iter().enumerate() {
        let d = ata[p][p];
        x[c] = if d.abs() < 1e-300 { 0.0 } else { ata[p][m] / d };
    }
    x
}

/// Optimus's convergence model: `loss(k) = 1/(b0·k + b1) + b2`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LossModel {
    pub b0: f64,
    pub b1: f64,
    pub b2: f64,
}

impl LossModel {
    pub fn loss(&self, step: f64) -> f64 {
        let d = self.b0 * step + self.b1;
        if d > 0.0 {
            1.0 / d + self.b2
        } else {
            f64::INFINITY
        }
    }

    /// The step at which the job counts as converged:
    /// `loss − b2 ≤ CONVERGED_FRACTION · (loss(0) − b2)`.
    pub fn converged_step(&self) -> Option<f64> {
        if self.b0 <= 0.0 {
            return None;
        }
        let k = self.b1 * (1.0 / CONVERGED_FRACTION - 1.0) / self.b0;
        k.is_finite().then_some(k.max(0.0))
    }

    fn weighted_sse(&self, points: &[(f64, f64)]) -> f64 {
        points
            .iter()
            .enumerate()
            .map(|(i, (k, l))| {
                let e = self.loss(*k) - l;
                weight(i, points.len()) * e * e
            })
            .sum()
    }
}

/// Later points count more: weight grows linearly with position.
fn weight(i: usize, n: usize) -> f64 {
    (i + 1) as f64 / n.max(1) as f64
}

/// Fits the convergence model to `(step, loss)` points: for a candidate
/// floor `b2`, `1/(loss − b2) = b0·k + b1` is linear, solved by weighted
/// NNLS; `b2` is chosen on a grid below the smallest loss, then refined
/// by golden-section search, minimising the weighted error in loss.
pub fn fit_loss(points: &[(f64, f64)]) -> Option<LossModel> {
    if points.len() < LOSS_POINTS_MIN {
        return None;
    }
    let min_loss = points.iter().map(|p| p.1).fold(f64::INFINITY, f64::min);
    if !min_loss.is_finite() || min_loss <= 0.0 {
        return None;
    }
    let k_scale = points.iter().map(|p| p.0).fold(1.0f64, f64::max);
    let solve = |b2: f64| -> Option<(LossModel, f64)> {
        let mut rows = Vec::with_capacity(points.len());
        let mut ys = Vec::with_capacity(points.len());
        for (i, (k, l)) in points.iter().enumerate() {
            let gap = l - b2;
            if gap <= 0.0 {
                return None;
            }
            // Weighted rows; k scaled to keep the columns comparable.
            let w = weight(i, points.len()).sqrt() * gap;
            rows.push(vec![w * k / k_scale, w]);
            ys.push(w / gap);
        }
        let x = nnls(&rows, &ys);
        let model = LossModel {
            b0: x[0] / k_scale,
            b1: x[1],
            b2,
        };
        let sse = model.weighted_sse(points);
        sse.is_finite().then_some((model, sse))
    };
    const GRID: usize = 40;
    let mut best: Option<(usize, LossModel, f64)> = None;
    for i in 0..GRID {
        let b2 = min_loss * i as f64 / GRID as f64;
        if let Some((m, e)) = solve(b2) {
            if best.as_ref().is_none_or(|b| e < b.2) {
                best = Some((i, m, e));
            }
        }
    }
    let (i, mut model, err) = best?;
    // Golden-section search between the neighbouring grid points.
    let step = min_loss / GRID as f64;
    let (mut lo, mut hi) = (
        (i as f64 - 1.0).max(0.0) * step,
        ((i as f64 + 1.0) * step).min(min_loss * (1.0 - 1e-9)),
    );
    let ratio = (5f64.sqrt() - 1.0) / 2.0;
    for _ in 0..40 {
        let c = hi - ratio * (hi - lo);
        let d = lo + ratio * (hi - lo);
        let ec = solve(c).map_or(f64::INFINITY, |s| s.1);
        let ed = solve(d).map_or(f64::INFINITY, |s| s.1);
        if ec < ed {
            hi = d;
        } else {
            lo = c;
        }
    }
    if let Some((m, e)) = solve((lo + hi) / 2.0) {
        if e < err {
            model = m;
        }
    }
    Some(model)
}

/// All-reduce speed model: `θ0/n + θ1 + θ2·n` seconds per step on `n` GPUs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SpeedModel {
    pub theta: [f64; 3],
}

impl SpeedModel {
    pub fn steps_per_s(&self, gpus: u32) -> f64 {
        let n = f64::from(gpus.max(1));
        let t = self.theta[0] / n + self.theta[1] + self.theta[2] * n;
        if t > 0.0 {
            1.0 / t
        } else {
            0.0
        }
    }
}

/// Fits [`SpeedModel`] to `(gpus, steps per second)` points at
/// [`SPEED_SIZES_MIN`] or more distinct sizes.
pub fn fit_speed(points: &[(u32, f64)]) -> Option<SpeedModel> {
    let mut sizes: Vec<u32> = points.iter().map(|p| p.0).collect();
    sizes.sort_unstable();
    sizes.dedup();
    if sizes.len() < SPEED_SIZES_MIN {
        return None;
    }
    let (rows, ys): (Vec<Vec<f64>>, Vec<f64>) = points
        .iter()
        .filter(|(n, s)| *n > 0 && *s > 0.0)
        .map(|(n, s)| {
            let n = f64::from(*n);
            // Relative error: divide each row by its target.
            let t = 1.0 / s;
            (vec![1.0 / n / t, 1.0 / t, n / t], 1.0)
        })
        .unzip();
    let x = nnls(&rows, &ys);
    let model = SpeedModel {
        theta: [x[0], x[1], x[2]],
    };
    (model.steps_per_s(1) > 0.0).then_some(model)
}

/// Optimus's synchronous parameter-server model, with global batch `M`:
/// `f(p, w) = 1 / (θ0·M/w + θ1 + θ2·w/p + θ3·w + θ4·p)`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SyncPsModel {
    pub batch: f64,
    pub theta: [f64; 5],
}

impl SyncPsModel {
    fn features(batch: f64, p: f64, w: f64) -> [f64; 5] {
        [batch / w, 1.0, w / p, w, p]
    }

    pub fn steps_per_s(&self, ps: u32, workers: u32) -> f64 {
        let (p, w) = (f64::from(ps.max(1)), f64::from(workers.max(1)));
        let f = Self::features(self.batch, p, w);
        let t: f64 = f.iter().zip(&self.theta).map(|(a, b)| a * b).sum();
        if t > 0.0 {
            1.0 / t
        } else {
            0.0
        }
    }
}

/// Fits [`SyncPsModel`] to `(ps, workers, steps per second)` samples (at
/// least 5).
pub fn fit_sync_ps(batch: f64, samples: &[(u32, u32, f64)]) -> Option<SyncPsModel> {
    if samples.len() < 5 {
        return None;
    }
    let (rows, ys): (Vec<Vec<f64>>, Vec<f64>) = samples
        .iter()
        .filter(|(p, w, s)| *p > 0 && *w > 0 && *s > 0.0)
        .map(|(p, w, s)| {
            let f = SyncPsModel::features(batch, f64::from(*p), f64::from(*w));
            (f.iter().map(|v| v * s).collect(), 1.0)
        })
        .unzip();
    let x = nnls(&rows, &ys);
    Some(SyncPsModel {
        batch,
        theta: [x[0], x[1], x[2], x[3], x[4]],
    })
}

/// Optimus's asynchronous parameter-server model:
/// `f(p, w) = w / (θ0 + θ1·w/p + θ2·w + θ3·p)`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AsyncPsModel {
    pub theta: [f64; 4],
}

impl AsyncPsModel {
    fn features(p: f64, w: f64) -> [f64; 4] {
        [1.0, w / p, w, p]
    }

    pub fn steps_per_s(&self, ps: u32, workers: u32) -> f64 {
        let (p, w) = (f64::from(ps.max(1)), f64::from(workers.max(1)));
        let f = Self::features(p, w);
        let t: f64 = f.iter().zip(&self.theta).map(|(a, b)| a * b).sum();
        if t > 0.0 {
            w / t
        } else {
            0.0
        }
    }
}

/// Fits [`AsyncPsModel`] to `(ps, workers, steps per second)` samples (at
/// least 4).
pub fn fit_async_ps(samples: &[(u32, u32, f64)]) -> Option<AsyncPsModel> {
    if samples.len() < 4 {
        return None;
    }
    let (rows, ys): (Vec<Vec<f64>>, Vec<f64>) = samples
        .iter()
        .filter(|(p, w, s)| *p > 0 && *w > 0 && *s > 0.0)
        .map(|(p, w, s)| {
            let (p, w) = (f64::from(*p), f64::from(*w));
            // w/f = Σθ·x; relative error: divide by w/f.
            let t = w / s;
            (
                AsyncPsModel::features(p, w).iter().map(|v| v / t).collect(),
                1.0,
            )
        })
        .unzip();
    let x = nnls(&rows, &ys);
    Some(AsyncPsModel {
        theta: [x[0], x[1], x[2], x[3]],
    })
}

/// A job's models and what they predict, as policies and `keel job` use
/// them.
#[derive(Debug, Clone, PartialEq)]
pub struct JobPerf<'a> {
    job: &'a Job,
    /// Measured speed by GPU count, normalised to a v100.
    measured: BTreeMap<u32, SpeedStat>,
    speed: Option<SpeedModel>,
}

impl<'a> JobPerf<'a> {
    /// Fits what `job`'s history allows (the speed model only; the
    /// convergence model is fitted when the job declares no step count).
    pub fn of(job: &'a Job) -> JobPerf<'a> {
        let model = job.spec.model.as_deref().unwrap_or("generic");
        let measured = speeds_v100(&job.perf, model);
        let points: Vec<(u32, f64)> = measured.iter().map(|(n, s)| (*n, s.mean())).collect();
        JobPerf {
            job,
            speed: fit_speed(&points),
            measured,
        }
    }

    fn model(&self) -> &str {
        self.job.spec.model.as_deref().unwrap_or("generic")
    }

    /// Steps per second on `gpus` GPUs of a v100's speed: the fitted model,
    /// else the measurement nearest in size scaled along the table's curve,
    /// else the table.
    pub fn steps_per_s_v100(&self, gpus: u32) -> f64 {
        if gpus == 0 {
            return 0.0;
        }
        if let Some(m) = &self.speed {
            return m.steps_per_s(gpus);
        }
        let profile = throughput::profile(self.model());
        let nearest = self
            .measured
            .iter()
            .filter(|(_, s)| s.count > 0)
            .min_by_key(|(n, _)| n.abs_diff(gpus));
        match nearest {
            Some((n, s)) => s.mean() * profile.speedup(gpus) / profile.speedup(*n),
            None => profile.steps_per_s("v100", gpus),
        }
    }

    /// Where [`Self::steps_per_s_v100`] gets its figure.
    pub fn speed_source(&self) -> SpeedSource {
        if self.speed.is_some() {
            SpeedSource::Fitted
        } else if self.measured.values().any(|s| s.count > 0) {
            SpeedSource::Measured
        } else {
            SpeedSource::Table
        }
    }

    /// Steps per second on `gpus` GPUs of `gpu_type`.
    pub fn steps_per_s(&self, gpu_type: &str, gpus: u32) -> f64 {
        self.steps_per_s_v100(gpus) * type_factor(self.model(), gpu_type)
    }

    /// Steps left: the declared total less the last reported step, or,
    /// without a declared total, until the fitted loss converges.
    pub fn remaining_steps(&self) -> Option<f64> {
        let done = self.job.progress.as_ref().map_or(0, |p| p.step) as f64;
        let total = match self.job.spec.total_steps {
            Some(t) => t as f64,
            None => {
                let points: Vec<(f64, f64)> = self
                    .job
                    .perf
                    .loss_points
                    .iter()
                    .map(|(k, l)| (*k as f64, *l))
                    .collect();
                fit_loss(&points)?.converged_step()?
            }
        };
        Some((total - done).max(0.0))
    }

    /// Seconds left on `gpus` GPUs of a v100's speed (∞ when unknown).
    pub fn remaining_s(&self, gpus: u32) -> f64 {
        let speed = self.steps_per_s_v100(gpus);
        match self.remaining_steps() {
            Some(steps) if speed > 0.0 => steps / speed,
            Some(steps) if steps <= 0.0 => 0.0,
            _ => f64::INFINITY,
        }
    }

    /// Seconds left at the job's current size (its minimum when waiting).
    pub fn remaining_s_now(&self) -> f64 {
        let gpus = match &self.job.allocation {
            Some(a) => u32::try_from(a.gpus.len()).unwrap_or(u32::MAX),
            None => self.job.spec.gpus.saturating_mul(self.job.spec.workers.min),
        };
        self.remaining_s(gpus)
    }

    /// Speed-up of `workers` workers over one, from the job's model.
    pub fn speedup(&self, workers: u32) -> f64 {
        let per = self.job.spec.gpus.max(1);
        let one = self.steps_per_s_v100(per);
        if one > 0.0 {
            self.steps_per_s_v100(per.saturating_mul(workers)) / one
        } else {
            f64::from(workers)
        }
    }
}

/// Where a speed estimate comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SpeedSource {
    /// The job's fitted speed model.
    Fitted,
    /// Its measured speed, scaled along the table's curve.
    Measured,
    /// The throughput table alone (nothing measured yet).
    Table,
}

impl SpeedSource {
    pub fn as_str(self) -> &'static str {
        match self {
            SpeedSource::Fitted => "fitted",
            SpeedSource::Measured => "measured",
            SpeedSource::Table => "table",
        }
    }
}

/// A job's remaining work and time at its current size and GPU type (at
/// its minimum size and a v100's pace while it waits), as `keel job`
/// shows it.
#[derive(Debug, Clone, PartialEq)]
pub struct Estimate {
    pub remaining_steps: f64,
    pub steps_per_s: f64,
    pub remaining_s: f64,
    pub gpus: u32,
    pub gpu_type: String,
    pub speed_source: SpeedSource,
}

/// The estimate for `job` in `state`; `None` for an ended job or one whose
/// remaining steps are unknown (no declared total and no converging loss).
pub fn estimate(state: &keel_state::state::ClusterState, job: &Job) -> Option<Estimate> {
    if job.state.is_terminal() {
        return None;
    }
    let perf = JobPerf::of(job);
    let remaining_steps = perf.remaining_steps()?;
    let (gpus, gpu_type) = match &job.allocation {
        Some(a) => (
            u32::try_from(a.gpus.len()).unwrap_or(u32::MAX),
            a.gpus
                .first()
                .and_then(|g| state.nodes().get(&g.node)?.gpus.get(&g.index).cloned())
                .unwrap_or_else(|| "v100".into()),
        ),
        None => (
            job.spec.gpus.saturating_mul(job.spec.workers.min),
            "v100".into(),
        ),
    };
    let steps_per_s = perf.steps_per_s(&gpu_type, gpus);
    let remaining_s = if remaining_steps == 0.0 {
        0.0
    } else if steps_per_s > 0.0 {
        remaining_steps / steps_per_s
    } else {
        f64::INFINITY
    };
    Some(Estimate {
        remaining_steps,
        steps_per_s,
        remaining_s,
        gpus,
        gpu_type,
        speed_source: perf.speed_source(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nnls_matches_unconstrained_least_squares_when_the_solution_is_positive() {
        // y = 2 + 3x, exactly.
        let rows: Vec<Vec<f64>> = (0..5).map(|x| vec![1.0, f64::from(x)]).collect();
        let ys: Vec<f64> = (0..5).map(|x| 2.0 + 3.0 * f64::from(x)).collect();
        let x = nnls(&rows, &ys);
        assert!(
            (x[0] - 2.0).abs() < 1e-9 && (x[1] - 3.0).abs() < 1e-9,
            "{x:?}"
        );
    }

    #[test]
    fn nnls_clamps_a_negative_coefficient_to_zero() {
        // y = 5 − x: the best non-negative fit has no slope.
        let rows: Vec<Vec<f64>> = (0..5).map(|x| vec![1.0, f64::from(x)]).collect();
        let ys: Vec<f64> = (0..5).map(|x| 5.0 - f64::from(x)).collect();
        let x = nnls(&rows, &ys);
        assert_eq!(x[1], 0.0);
        assert!((x[0] - 3.0).abs() < 1e-9, "mean of 5..1, {x:?}");
    }

    #[test]
    fn the_loss_fit_recovers_known_parameters() {
        let truth = LossModel {
            b0: 0.002,
            b1: 0.5,
            b2: 0.3,
        };
        let points: Vec<(f64, f64)> = (0..30)
            .map(|i| {
                let k = f64::from(i) * 100.0;
                (k, truth.loss(k))
            })
            .collect();
        let fit = fit_loss(&points).expect("fits");
        assert!((fit.b2 - truth.b2).abs() < 1e-3, "{fit:?}");
        assert!((fit.b1 - truth.b1).abs() / truth.b1 < 0.02, "{fit:?}");
        assert!((fit.b0 - truth.b0).abs() / truth.b0 < 0.02, "{fit:?}");
        let converged = fit.converged_step().expect("converges");
        let expected = truth.converged_step().expect("converges");
        assert!((converged - expected).abs() / expected < 0.03);
    }

    #[test]
    fn the_loss_fit_tolerates_noise_and_needs_three_points() {
        let truth = LossModel {
            b0: 0.01,
            b1: 1.0,
            b2: 0.1,
        };
        let mut rng = keel_state::rng::SplitMix64::new(7);
        let points: Vec<(f64, f64)> = (1..=40)
            .map(|i| {
                let k = f64::from(i) * 50.0;
                let noise = 1.0 + 0.01 * (rng.unit() - 0.5);
                (k, truth.loss(k) * noise)
            })
            .collect();
        let fit = fit_loss(&points).expect("fits");
        for k in [100.0, 1000.0, 5000.0] {
            let rel = (fit.loss(k) - truth.loss(k)).abs() / truth.loss(k);
            assert!(rel < 0.02, "at {k}: {} vs {}", fit.loss(k), truth.loss(k));
        }
        assert_eq!(fit_loss(&points[..2]), None);
    }

    #[test]
    fn the_speed_fit_recovers_known_parameters() {
        let truth = SpeedModel {
            theta: [0.4, 0.02, 0.005],
        };
        let points: Vec<(u32, f64)> = [1, 2, 4, 8, 16]
            .iter()
            .map(|n| (*n, truth.steps_per_s(*n)))
            .collect();
        let fit = fit_speed(&points).expect("fits");
        for (a, b) in fit.theta.iter().zip(truth.theta) {
            assert!((a - b).abs() < 1e-6, "{fit:?}");
        }
        assert_eq!(fit_speed(&points[..2]), None, "two sizes are not enough");
    }

    #[test]
    fn the_parameter_server_fits_recover_known_parameters() {
        let sync = SyncPsModel {
            batch: 256.0,
            theta: [0.001, 0.05, 0.02, 0.003, 0.01],
        };
        let mut samples = Vec::new();
        for p in 1..=4 {
            for w in [1, 2, 4, 8] {
                samples.push((p, w, sync.steps_per_s(p, w)));
            }
        }
        let fit = fit_sync_ps(256.0, &samples).expect("fits");
        for (a, b) in fit.theta.iter().zip(sync.theta) {
            assert!((a - b).abs() < 1e-6, "{fit:?}");
        }
        let asynchronous = AsyncPsModel {
            theta: [0.3, 0.02, 0.01, 0.05],
        };
        let samples: Vec<(u32, u32, f64)> = samples
            .iter()
            .map(|(p, w, _)| (*p, *w, asynchronous.steps_per_s(*p, *w)))
            .collect();
        let fit = fit_async_ps(&samples).expect("fits");
        for (a, b) in fit.theta.iter().zip(asynchronous.theta) {
            assert!((a - b).abs() < 1e-6, "{fit:?}");
        }
    }

    #[test]
    fn the_history_measures_speed_within_an_epoch_and_thins_loss_points() {
        let on = |epoch, gpus| RunningOn {
            epoch,
            gpu_type: "v100",
            gpus,
            partner_model: None,
        };
        let mut h = PerfHistory::default();
        // Epoch 1 on 2 v100s: 10 steps/s.
        h.record(&on(1, 2), 0, Some(2.0), 0);
        h.record(&on(1, 2), 100, Some(1.5), 10_000);
        // Epoch 2 starts: the gap across the restart is not a speed.
        h.record(&on(2, 4), 110, Some(1.4), 60_000);
        h.record(&on(2, 4), 310, Some(1.2), 70_000);
        let speeds = speeds_v100(&h, "generic");
        assert_eq!(speeds.get(&2).map(SpeedStat::mean), Some(10.0));
        assert_eq!(speeds.get(&4).map(SpeedStat::mean), Some(20.0));
        for step in 311..400 {
            h.record(&on(2, 4), step, Some(1.0), 70_000 + step);
        }
        assert!(h.loss_points.len() <= LOSS_POINTS_MAX);
        assert_eq!(
            h.loss_points.first().map(|p| p.0),
            Some(0),
            "keeps the start"
        );
        assert_eq!(
            h.loss_points.last().map(|p| p.0),
            Some(399),
            "and the latest"
        );
    }

    #[test]
    fn samples_taken_while_sharing_are_kept_apart_from_the_alone_speed() {
        let on = |epoch, partner_model| RunningOn {
            epoch,
            gpu_type: "v100",
            gpus: 1,
            partner_model,
        };
        let mut h = PerfHistory::default();
        // Epoch 1 alone: 10 steps/s.
        h.record(&on(1, None), 0, None, 0);
        h.record(&on(1, None), 100, None, 10_000);
        // Epoch 2 beside a resnet18: 4 steps/s.
        h.record(&on(2, Some("resnet18")), 100, None, 20_000);
        h.record(&on(2, Some("resnet18")), 140, None, 30_000);
        assert_eq!(h.shared_steps_per_s("resnet18", "v100", 1), Some(4.0));
        assert_eq!(h.shared_steps_per_s("vgg16", "v100", 1), None);
        // The shared epoch under way is no speed alone.
        let alone: Vec<(&str, u32, f64)> =
            h.alone_speeds().map(|(t, n, s)| (t, n, s.mean())).collect();
        assert_eq!(alone, [("v100", 1, 10.0)]);
        // The partner leaves mid-epoch: 8 steps/s alone from then on; the
        // gap across the change counts for neither.
        h.record(&on(2, None), 150, None, 40_000);
        h.record(&on(2, None), 230, None, 50_000);
        let alone = speeds_v100(&h, "generic");
        assert_eq!(alone.get(&1).map(|s| s.count), Some(2));
        assert_eq!(alone.get(&1).map(SpeedStat::mean), Some(9.0));
        assert_eq!(h.shared_steps_per_s("resnet18", "v100", 1), Some(4.0));
    }
}
