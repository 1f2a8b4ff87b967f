//! What a GPU Node offers Keel: its allocatable GPUs, less what other
//! workloads' Pods request on it and what Keel's own Pods still hold while
//! they terminate; nothing new on a cordoned or tainted Node; nothing at
//! all on one that is not Ready or that evicts (a `NoExecute` taint Keel
//! does not tolerate). Pure: the executor gathers the Node, the Pods and
//! its own workers, and reports what this says.
//!
//! Keel numbers a Node's GPUs `0..capacity` for its own accounting (the
//! device plugin picks the devices a Pod gets). A Node that offers fewer
//! than it has offers the indexes Keel's running workers hold first, then
//! the lowest free ones, so a change in what others use never takes a GPU
//! from under a worker; and its report carries a note saying why it
//! offers fewer, which `keel nodes` shows.

use std::collections::BTreeSet;

use k8s_openapi::api::core::v1::{Node, Pod, Taint, Toleration};
use keel_state::liveness::NodeReport;
use keel_state::{FailedGpu, Gpu};

use crate::discovery::gpu_type_of;
use crate::executor::NodeProbe;

/// What uses a Node's GPUs besides Keel's running workers.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NodeUse {
    /// Pods that are not this Keel's (other namespaces, other workloads),
    /// not finished: `namespace/name` and the GPUs they request.
    pub others: Vec<(String, u32)>,
    /// Keel's Pods still terminating past their grace and bound: their
    /// names and the GPU indexes they held.
    pub stuck: Vec<(String, Vec<u32>)>,
    /// The indexes Keel's running workers hold (not being stopped).
    pub held: BTreeSet<u32>,
    /// Why other workloads' Pods could not be seen (so are not counted).
    pub others_unseen: Option<String>,
}

/// Where the offer's limits come from.
#[derive(Debug, Clone)]
pub struct OfferRules<'a> {
    /// The extended resource GPUs are requested as (`nvidia.com/gpu`).
    pub gpu_resource: &'a str,
    /// The Node label that names the GPU model.
    pub gpu_type_label: &'a str,
    /// Taints Keel's Pods tolerate (they also go on every Pod).
    pub tolerations: &'a [Toleration],
}

/// The GPUs `pod` requests: the larger of its containers' sum and its
/// largest init container (what the kubelet admits it by). Limits stand
/// for requests, as they do for extended resources.
pub fn pod_gpus(pod: &Pod, resource: &str) -> u32 {
    let Some(spec) = pod.spec.as_ref() else {
        return 0;
    };
    let of = |c: &k8s_openapi::api::core::v1::Container| -> u32 {
        let r = c.resources.as_ref();
        r.and_then(|r| r.requests.as_ref()?.get(resource))
            .or_else(|| r.and_then(|r| r.limits.as_ref()?.get(resource)))
            .and_then(|q| q.0.parse().ok())
            .unwrap_or(0)
    };
    let main: u32 = spec.containers.iter().map(of).sum();
    let init = spec
        .init_containers
        .iter()
        .flatten()
        .map(of)
        .max()
        .unwrap_or(0);
    main.max(init)
}

fn count(q: Option<&k8s_openapi::apimachinery::pkg::api::resource::Quantity>) -> Option<u32> {
    q.and_then(|q| q.0.parse().ok())
}

/// Whether `tolerations` tolerate `taint` (the Kubernetes matching rules:
/// an empty key with `Exists` tolerates every taint; an empty effect
/// matches every effect).
pub fn tolerated(tolerations: &[Toleration], taint: &Taint) -> bool {
    tolerations.iter().any(|t| {
        let exists = t.operator.as_deref() == Some("Exists");
        let key = t.key.as_deref().unwrap_or("");
        let key_ok = (key.is_empty() && exists) || key == taint.key;
        let value_ok =
            exists || t.value.as_deref().unwrap_or("") == taint.value.as_deref().unwrap_or("");
        let effect_ok = t
            .effect
            .as_deref()
            .is_none_or(|e| e.is_empty() || e == taint.effect);
        key_ok && value_ok && effect_ok
    })
}

fn describe(taint: &Taint) -> String {
    match taint.value.as_deref() {
        Some(v) if !v.is_empty() => format!("{}={v}:{}", taint.key, taint.effect),
        _ => format!("{}:{}", taint.key, taint.effect),
    }
}

/// A few names, then how many more.
fn some_names<'a>(names: impl Iterator<Item = &'a str>) -> String {
    let names: Vec<&str> = names.collect();
    let mut out = names.iter().take(3).copied().collect::<Vec<_>>().join(", ");
    if names.len() > 3 {
        out.push_str(&format!(" and {} more", names.len() - 3));
    }
    out
}

/// What `node` offers Keel, or `None` when it has no GPUs (not Keel's).
pub fn offer(node: &Node, rules: &OfferRules<'_>, usage: &NodeUse) -> Option<NodeProbe> {
    let name = node.metadata.name.clone()?;
    let status = node.status.as_ref()?;
    let capacity = count(status.capacity.as_ref()?.get(rules.gpu_resource)).unwrap_or(0);
    if capacity == 0 {
        return None;
    }
    let ready = status
        .conditions
        .as_ref()
        .and_then(|c| c.iter().find(|c| c.type_ == "Ready"));
    if ready.is_none_or(|c| c.status != "True") {
        let why = ready
            .map(|c| {
                format!(
                    "not Ready ({}: {})",
                    c.reason.clone().unwrap_or_default(),
                    c.message.clone().unwrap_or_default()
                )
            })
            .unwrap_or_else(|| "no Ready condition".into());
        return Some(NodeProbe::Unreachable { name, reason: why });
    }
    let spec = node.spec.as_ref();
    let taints: Vec<&Taint> = spec
        .and_then(|s| s.taints.as_ref())
        .into_iter()
        .flatten()
        .filter(|t| !tolerated(rules.tolerations, t))
        .collect();
    if let Some(t) = taints.iter().find(|t| t.effect == "NoExecute") {
        return Some(NodeProbe::Unreachable {
            name,
            reason: format!(
                "tainted {} and Keel's pods do not tolerate it (--k8s-tolerate): they would be evicted",
                describe(t)
            ),
        });
    }
    let closed = if spec.and_then(|s| s.unschedulable) == Some(true) {
        Some("cordoned".to_string())
    } else {
        taints
            .iter()
            .find(|t| t.effect == "NoSchedule")
            .map(|t| format!("tainted {}", describe(t)))
    };
    let allocatable = count(
        status
            .allocatable
            .as_ref()
            .and_then(|a| a.get(rules.gpu_resource)),
    )
    .unwrap_or(capacity)
    .min(capacity);
    let others: u32 = usage.others.iter().map(|(_, g)| *g).sum();
    let stuck: BTreeSet<u32> = usage
        .stuck
        .iter()
        .flat_map(|(_, g)| g.iter().copied())
        .filter(|g| *g < capacity)
        .collect();
    let free_count = allocatable
        .saturating_sub(others)
        .saturating_sub(u32::try_from(stuck.len()).unwrap_or(u32::MAX));
    let usable: Vec<u32> = (0..capacity).filter(|g| !stuck.contains(g)).collect();
    let held: Vec<u32> = usable
        .iter()
        .copied()
        .filter(|g| usage.held.contains(g))
        .collect();
    let mut chosen: BTreeSet<u32> = held.iter().copied().collect();
    if closed.is_none() {
        for g in &usable {
            if chosen.len() >= free_count as usize {
                break;
            }
            chosen.insert(*g);
        }
    }
    let mut why = Vec::new();
    if allocatable < capacity {
        why.push(format!(
            "{} not allocatable (unhealthy or reserved)",
            capacity - allocatable
        ));
    }
    if others > 0 {
        why.push(format!(
            "{others} requested by other workloads ({})",
            some_names(usage.others.iter().map(|(n, _)| n.as_str()))
        ));
    }
    if let Some(e) = &usage.others_unseen {
        why.push(format!("other workloads' pods not counted ({e})"));
    }
    if !stuck.is_empty() {
        why.push(format!(
            "{} held by Keel pods still terminating ({})",
            stuck.len(),
            some_names(usage.stuck.iter().map(|(n, _)| n.as_str()))
        ));
    }
    if let Some(c) = &closed {
        why.push(format!("{c}: no new workers, running ones keep theirs"));
    } else if held.len() > free_count as usize {
        why.push(format!(
            "{} more held by Keel's running workers than are free now",
            held.len() - free_count as usize
        ));
    }
    let mut note = if why.is_empty() {
        String::new()
    } else {
        format!(
            "offers {} of {capacity} GPUs: {}",
            chosen.len(),
            why.join("; ")
        )
    };
    keel_state::state::limits::cut_to(&mut note, keel_state::state::limits::NODE_NOTE_MAX_LEN);
    let gpu_type = node
        .metadata
        .labels
        .as_ref()
        .and_then(|l| l.get(rules.gpu_type_label))
        .map_or_else(|| "gpu".to_string(), |p| gpu_type_of(p));
    let address = status
        .addresses
        .as_ref()
        .and_then(|a| a.iter().find(|a| a.type_ == "InternalIP"))
        .map_or_else(|| name.clone(), |a| a.address.clone());
    Some(NodeProbe::Answered(NodeReport {
        name,
        address,
        gpus: chosen
            .into_iter()
            .map(|index| Gpu {
                index,
                gpu_type: gpu_type.clone(),
            })
            .collect(),
        // Kubernetes says how many are allocatable, not which failed; the
        // GPUs Keel's terminating Pods still hold are known by index, and
        // a job the state put there meanwhile is told why it cannot run.
        failed: usage
            .stuck
            .iter()
            .flat_map(|(pod, gpus)| gpus.iter().map(move |g| (*g, pod)))
            .filter(|(g, _)| stuck.contains(g))
            .collect::<std::collections::BTreeMap<u32, &String>>()
            .into_iter()
            .map(|(index, pod)| FailedGpu {
                index,
                gpu_type: gpu_type.clone(),
                reason: format!("held by Keel's pod {pod}, still terminating"),
            })
            .collect(),
        note,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::{NodeCondition, NodeSpec, NodeStatus};
    use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
    use std::collections::BTreeMap;

    fn node(capacity: u32, allocatable: u32) -> Node {
        Node {
            metadata: ObjectMeta {
                name: Some("gpu-a".into()),
                ..ObjectMeta::default()
            },
            spec: Some(NodeSpec::default()),
            status: Some(NodeStatus {
                capacity: Some(BTreeMap::from([(
                    "nvidia.com/gpu".to_string(),
                    Quantity(capacity.to_string()),
                )])),
                allocatable: Some(BTreeMap::from([(
                    "nvidia.com/gpu".to_string(),
                    Quantity(allocatable.to_string()),
                )])),
                conditions: Some(vec![NodeCondition {
                    type_: "Ready".into(),
                    status: "True".into(),
                    ..NodeCondition::default()
                }]),
                ..NodeStatus::default()
            }),
        }
    }

    fn rules(tolerations: &[Toleration]) -> OfferRules<'_> {
        OfferRules {
            gpu_resource: "nvidia.com/gpu",
            gpu_type_label: "nvidia.com/gpu.product",
            tolerations,
        }
    }

    fn offered(probe: Option<NodeProbe>) -> (Vec<u32>, String) {
        match probe {
            Some(NodeProbe::Answered(r)) => (r.gpus.iter().map(|g| g.index).collect(), r.note),
            p => panic!("{p:?}"),
        }
    }

    /// Issue 33: a GPU a terminating Pod of Keel's still holds is not
    /// offered, and the report says which and why (so a job placed there
    /// meanwhile is requeued with that reason).
    #[test]
    fn a_gpu_a_terminating_pod_holds_is_reported_with_why() {
        let usage = NodeUse {
            others: vec![],
            stuck: vec![("job-4-e1-r0".into(), vec![2])],
            held: BTreeSet::new(),
            others_unseen: None,
        };
        let Some(NodeProbe::Answered(report)) = offer(&node(4, 4), &rules(&[]), &usage) else {
            panic!("an answer");
        };
        assert_eq!(
            report.gpus.iter().map(|g| g.index).collect::<Vec<_>>(),
            vec![0, 1, 3]
        );
        assert_eq!(
            report.failed,
            vec![FailedGpu {
                index: 2,
                gpu_type: report.gpus[0].gpu_type.clone(),
                reason: "held by Keel's pod job-4-e1-r0, still terminating".into()
            }]
        );
        assert!(report.validate().is_ok(), "{report:?}");
    }

    #[test]
    fn held_gpus_stay_offered_and_others_come_off_the_free_ones() {
        let usage = NodeUse {
            others: vec![("team-b/bert-0".into(), 3)],
            stuck: vec![],
            held: BTreeSet::from([5]),
            others_unseen: None,
        };
        let (gpus, note) = offered(offer(&node(8, 7), &rules(&[]), &usage));
        assert_eq!(
            gpus,
            vec![0, 1, 2, 5],
            "7 allocatable - 3 = 4, index 5 kept"
        );
        assert!(
            note.contains("offers 4 of 8")
                && note.contains("1 not allocatable")
                && note.contains("3 requested by other workloads (team-b/bert-0)"),
            "{note}"
        );
        let (gpus, note) = offered(offer(&node(4, 4), &rules(&[]), &NodeUse::default()));
        assert_eq!((gpus.len(), note.as_str()), (4, ""));
    }

    #[test]
    fn cordoned_offers_only_what_runs_and_no_execute_is_unreachable() {
        let mut n = node(4, 4);
        n.spec = Some(NodeSpec {
            unschedulable: Some(true),
            ..NodeSpec::default()
        });
        let usage = NodeUse {
            held: BTreeSet::from([2]),
            ..NodeUse::default()
        };
        let (gpus, note) = offered(offer(&n, &rules(&[]), &usage));
        assert_eq!(gpus, vec![2]);
        assert!(note.contains("cordoned"), "{note}");
        let taint = Taint {
            key: "maintenance".into(),
            value: Some("true".into()),
            effect: "NoExecute".into(),
            time_added: None,
        };
        n.spec = Some(NodeSpec {
            taints: Some(vec![taint]),
            ..NodeSpec::default()
        });
        assert!(matches!(
            offer(&n, &rules(&[]), &usage),
            Some(NodeProbe::Unreachable { reason, .. }) if reason.contains("maintenance=true:NoExecute")
        ));
        let tolerate = [Toleration {
            key: Some("maintenance".into()),
            operator: Some("Exists".into()),
            ..Toleration::default()
        }];
        let (gpus, note) = offered(offer(&n, &rules(&tolerate), &usage));
        assert_eq!((gpus.len(), note.as_str()), (4, ""));
    }

    #[test]
    fn pods_request_the_larger_of_their_containers_and_init_containers() {
        let pod: Pod = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "p"},
            "spec": {
                "containers": [
                    {"name": "a", "resources": {"limits": {"nvidia.com/gpu": "2"}}},
                    {"name": "b", "resources": {"requests": {"nvidia.com/gpu": "1"}}}
                ],
                "initContainers": [{"name": "i", "resources": {"limits": {"nvidia.com/gpu": "4"}}}]
            }
        }))
        .expect("pod");
        assert_eq!(pod_gpus(&pod, "nvidia.com/gpu"), 4);
    }
}
