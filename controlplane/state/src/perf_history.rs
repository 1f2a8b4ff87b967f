//! What the state records of a job's progress for the performance models:
//! loss points and measured speeds by GPU type and count, alone and beside
//! a partner ([`PerfHistory::record`], called by `apply`). The models that
//! are fitted on it are the scheduling crate's (`keel_scheduling::perf`).

use std::collections::BTreeMap;

use keel_proto::entry as pb;
use serde::{Deserialize, Serialize};

use crate::codec::DecodeError;
use crate::proto_form::{ProtoForm, Versions};

/// Loss points kept per job; when full, every other one is dropped, so the
/// history spans the whole run at a coarser grain.
pub const LOSS_POINTS_MAX: usize = 32;

/// Mean measured speed at one size.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct SpeedStat {
    /// Sum of measured steps per second.
    pub sum_steps_per_s: f64,
    pub count: u32,
}

impl SpeedStat {
    /// Counts `other`'s measurements with these.
    pub fn add(&mut self, other: SpeedStat) {
        self.sum_steps_per_s += other.sum_steps_per_s;
        self.count = self.count.saturating_add(other.count);
    }

    pub fn mean(&self) -> f64 {
        if self.count == 0 {
            0.0
        } else {
            self.sum_steps_per_s / f64::from(self.count)
        }
    }
}

/// Where a job ran when it reported a sample.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RunningOn<'a> {
    /// The allocation epoch.
    pub epoch: u64,
    /// Read only when the epoch is new to the history (callers may pass ""
    /// when [`PerfHistory::knows_epoch`]).
    pub gpu_type: &'a str,
    pub gpus: u32,
    /// Space sharing: the model of the job sharing these GPUs (`None`:
    /// alone). Samples taken while sharing never count as the job's alone
    /// speed.
    pub partner_model: Option<&'a str>,
}

/// What the state remembers of a job's progress for the models.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct PerfHistory {
    /// `(step, loss)`, ascending steps, at most [`LOSS_POINTS_MAX`].
    pub loss_points: Vec<(u64, f64)>,
    /// Measured speed by GPU type, then GPU count, of the epochs before
    /// the current one (as measured; normalised to a v100 when the models
    /// are fitted, [`Self::speeds_v100`]).
    pub speeds: BTreeMap<String, BTreeMap<u32, SpeedStat>>,
    /// The current epoch's measurements (folded into `speeds` when the
    /// epoch changes), on `epoch_gpus` GPUs of `epoch_gpu_type`.
    pub epoch_speed: SpeedStat,
    pub epoch_gpus: u32,
    /// The last sample of the current allocation: `(epoch, step, at_ms)`.
    /// Speed is measured between two samples of one epoch, so restarts
    /// never count as slow steps.
    pub last_sample: Option<(u64, u64, u64)>,
    /// The GPU type of the last sample's epoch.
    pub epoch_gpu_type: String,
    /// The partner's model while the current epoch shares its GPUs (space
    /// sharing); its measurements fold into `shared_speeds`.
    pub epoch_partner: Option<String>,
    /// Measured speed while sharing GPUs: by the partner's model, then GPU
    /// type, then GPU count.
    pub shared_speeds: BTreeMap<String, BTreeMap<String, BTreeMap<u32, SpeedStat>>>,
}

impl PerfHistory {
    /// Records the sample `(step, loss, at_ms)` taken while the job ran
    /// `on` an allocation.
    pub fn record(&mut self, on: &RunningOn<'_>, step: u64, loss: Option<f64>, at_ms: u64) {
        let RunningOn {
            epoch,
            gpu_type,
            gpus,
            partner_model,
        } = *on;
        if !self.knows_epoch(epoch) {
            self.fold_epoch();
            gpu_type.clone_into(&mut self.epoch_gpu_type);
            self.epoch_gpus = gpus;
            self.epoch_partner = partner_model.map(str::to_string);
        } else if self.epoch_partner.as_deref() != partner_model {
            // The partner left mid-epoch: what follows is a new
            // measurement, and the gap across the change is no speed.
            self.fold_epoch();
            self.epoch_partner = partner_model.map(str::to_string);
            self.last_sample = None;
        }
        if let Some(loss) = loss.filter(|l| l.is_finite() && *l >= 0.0) {
            let newer = self.loss_points.last().is_none_or(|(s, _)| step > *s);
            if newer {
                if self.loss_points.len() >= LOSS_POINTS_MAX {
                    let mut i = 0;
                    self.loss_points.retain(|_| {
                        i += 1;
                        i % 2 == 1
                    });
                }
                self.loss_points.push((step, loss));
            }
        }
        if let Some((e, s0, t0)) = self.last_sample {
            if e == epoch && at_ms > t0 && step > s0 && gpus > 0 {
                let speed = (step - s0) as f64 / ((at_ms - t0) as f64 / 1000.0);
                if speed.is_finite() {
                    self.epoch_speed.sum_steps_per_s += speed;
                    self.epoch_speed.count = self.epoch_speed.count.saturating_add(1);
                }
            }
        }
        if self
            .last_sample
            .is_none_or(|(e, s0, _)| e != epoch || step >= s0)
        {
            self.last_sample = Some((epoch, step, at_ms));
        }
    }
}

impl PerfHistory {
    /// Moves the current epoch's measurements into `speeds`.
    fn fold_epoch(&mut self) {
        let stat = std::mem::take(&mut self.epoch_speed);
        if stat.count == 0 || self.epoch_gpus == 0 {
            return;
        }
        let gpu_type = self.epoch_gpu_type.as_str();
        let by_type = match &self.epoch_partner {
            None => &mut self.speeds,
            Some(partner) => self.shared_speeds.entry(partner.clone()).or_default(),
        };
        let by_size = match by_type.get_mut(gpu_type) {
            Some(m) => m,
            None => by_type.entry(gpu_type.to_string()).or_default(),
        };
        by_size.entry(self.epoch_gpus).or_default().add(stat);
    }

    /// Whether the last sample recorded was of allocation `epoch`.
    pub fn knows_epoch(&self, epoch: u64) -> bool {
        self.last_sample.is_some_and(|(e, _, _)| e == epoch)
    }

    /// The speeds measured alone (not sharing GPUs): `(GPU type, GPUs,
    /// measurements)` from `speeds` in order, then the current epoch's
    /// when it runs alone and has any (not yet folded in, so a type and
    /// size may come twice: callers add them up).
    pub fn alone_speeds(&self) -> impl Iterator<Item = (&str, u32, SpeedStat)> + '_ {
        let current =
            (self.epoch_speed.count > 0 && self.epoch_gpus > 0 && self.epoch_partner.is_none())
                .then_some((
                    self.epoch_gpu_type.as_str(),
                    self.epoch_gpus,
                    self.epoch_speed,
                ));
        self.speeds
            .iter()
            .flat_map(|(gpu_type, by_size)| {
                by_size
                    .iter()
                    .map(move |(gpus, stat)| (gpu_type.as_str(), *gpus, *stat))
            })
            .chain(current)
    }
}

impl PerfHistory {
    /// Whether the current epoch's samples are taken beside `partner_model`
    /// (`None`: alone).
    pub fn knows_partner(&self, partner_model: Option<&str>) -> bool {
        self.epoch_partner.as_deref() == partner_model
    }

    /// Measured steps per second while sharing `gpus` GPUs of `gpu_type`
    /// with a job of `partner_model`, the current epoch included; `None`
    /// before any measurement.
    pub fn shared_steps_per_s(
        &self,
        partner_model: &str,
        gpu_type: &str,
        gpus: u32,
    ) -> Option<f64> {
        let mut stat = self
            .shared_speeds
            .get(partner_model)
            .and_then(|m| m.get(gpu_type))
            .and_then(|m| m.get(&gpus))
            .copied()
            .unwrap_or_default();
        if self.epoch_partner.as_deref() == Some(partner_model)
            && self.epoch_gpu_type == gpu_type
            && self.epoch_gpus == gpus
        {
            stat.add(self.epoch_speed);
        }
        (stat.count > 0).then(|| stat.mean())
    }
}

fn stat_to_proto(s: &SpeedStat) -> pb::SpeedStat {
    pb::SpeedStat {
        sum_steps_per_s: s.sum_steps_per_s,
        count: s.count,
    }
}

fn stat_from_proto(s: Option<pb::SpeedStat>) -> SpeedStat {
    let s = s.unwrap_or_default();
    SpeedStat {
        sum_steps_per_s: s.sum_steps_per_s,
        count: s.count,
    }
}

fn speeds_to_proto(speeds: &BTreeMap<String, BTreeMap<u32, SpeedStat>>) -> Vec<pb::SpeedsOnType> {
    speeds
        .iter()
        .map(|(gpu_type, by_gpus)| pb::SpeedsOnType {
            gpu_type: gpu_type.clone(),
            by_gpus: by_gpus
                .iter()
                .map(|(gpus, stat)| pb::SpeedOnGpus {
                    gpus: *gpus,
                    stat: Some(stat_to_proto(stat)),
                })
                .collect(),
        })
        .collect()
}

fn speeds_from_proto(speeds: Vec<pb::SpeedsOnType>) -> BTreeMap<String, BTreeMap<u32, SpeedStat>> {
    speeds
        .into_iter()
        .map(|t| {
            let by_gpus = t
                .by_gpus
                .into_iter()
                .map(|g| (g.gpus, stat_from_proto(g.stat)))
                .collect();
            (t.gpu_type, by_gpus)
        })
        .collect()
}

/// A snapshot's record of a job's history; a record without one (never
/// written from format 8 on) is an empty history.
impl ProtoForm<Option<pb::PerfHistory>> for PerfHistory {
    fn to_proto(&self) -> Option<pb::PerfHistory> {
        Some(perf_to_proto(self))
    }

    fn from_proto(p: Option<pb::PerfHistory>, _field: &'static str) -> Result<Self, DecodeError> {
        Ok(perf_from_proto(p.unwrap_or_default()))
    }
}

impl Versions for PerfHistory {
    const NEWEST: u32 = crate::proto_form::FIRST;
}

fn perf_to_proto(p: &PerfHistory) -> pb::PerfHistory {
    pb::PerfHistory {
        loss_points: p
            .loss_points
            .iter()
            .map(|(step, loss)| pb::LossPoint {
                step: *step,
                loss: *loss,
            })
            .collect(),
        speeds: speeds_to_proto(&p.speeds),
        epoch_speed: Some(stat_to_proto(&p.epoch_speed)),
        epoch_gpus: p.epoch_gpus,
        last_sample: p.last_sample.map(|(epoch, step, at_ms)| pb::LastSample {
            epoch,
            step,
            at_ms,
        }),
        epoch_gpu_type: p.epoch_gpu_type.clone(),
        epoch_partner: p.epoch_partner.clone(),
        shared_speeds: p
            .shared_speeds
            .iter()
            .map(|(partner, by_type)| pb::SpeedsBesidePartner {
                partner_model: partner.clone(),
                by_type: speeds_to_proto(by_type),
            })
            .collect(),
    }
}

fn perf_from_proto(p: pb::PerfHistory) -> PerfHistory {
    PerfHistory {
        loss_points: p
            .loss_points
            .into_iter()
            .map(|l| (l.step, l.loss))
            .collect(),
        speeds: speeds_from_proto(p.speeds),
        epoch_speed: stat_from_proto(p.epoch_speed),
        epoch_gpus: p.epoch_gpus,
        last_sample: p.last_sample.map(|s| (s.epoch, s.step, s.at_ms)),
        epoch_gpu_type: p.epoch_gpu_type,
        epoch_partner: p.epoch_partner,
        shared_speeds: p
            .shared_speeds
            .into_iter()
            .map(|s| (s.partner_model, speeds_from_proto(s.by_type)))
            .collect(),
    }
}
