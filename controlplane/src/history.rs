//! A journal record in words: what `keel events`, `keel why` and the
//! console's job page say of an applied entry and its events. Nothing of a
//! job's command, image or environment is in these words.

use keel_proto::entry as pb;
use keel_state::proto_form::ProtoForm;

/// Who asked for an entry: its actor; `leader` for the commands only the
/// leader proposes; `None` for a client's command without an identity
/// (plaintext).
pub fn actor(record: &pb::AppliedEntry) -> Option<String> {
    const LEADERS_OWN: [&str; 7] = [
        "decide_allocation",
        "record_worker_started",
        "record_worker_exited",
        "report_progress",
        "finish_job",
        "record_node_inventory",
        "register_node",
    ];
    if !record.actor.is_empty() {
        Some(record.actor.clone())
    } else if LEADERS_OWN.contains(&record.command.as_str()) {
        Some("leader".to_string())
    } else {
        None
    }
}

/// [`actor`] as a suffix to a line (issue 22): `  (by …)`, or nothing.
pub fn by_actor(record: &pb::AppliedEntry) -> String {
    actor(record).map_or_else(String::new, |a| format!("  (by {a})"))
}

/// The job an event is about, if it is about one.
pub fn event_job_id(e: &pb::Event) -> Option<u64> {
    use pb::event::Kind as K;
    match e.kind.as_ref()? {
        K::JobSubmitted(x) => Some(x.job_id),
        K::JobCancelled(x) => Some(x.job_id),
        K::JobAllocated(x) => Some(x.job_id),
        K::JobPreempted(x) => Some(x.job_id),
        K::PlacementRefused(x) => Some(x.job_id),
        K::WorkerStarted(x) => Some(x.job_id),
        K::WorkerExited(x) => Some(x.job_id),
        K::JobProgressReported(x) => Some(x.job_id),
        K::JobFinished(x) => Some(x.job_id),
        K::JobRequeued(x) => Some(x.job_id),
        K::JobRemoved(x) => Some(x.job_id),
        K::NodeRegistered(_)
        | K::NodeInventoryChanged(_)
        | K::NodeLost(_)
        | K::NodeRecovered(_)
        | K::NodeRemoved(_)
        | K::PolicyChanged(_)
        | K::PolicyMemoryRefused(_)
        | K::RequestRepeated(_)
        | K::AclBootstrapped(_)
        | K::TokenCreated(_)
        | K::TokenRevoked(_)
        | K::MembershipChangeRecorded(_)
        | K::QueueCreated(_)
        | K::QueueUpdated(_)
        | K::QueueDeleted(_)
        | K::SecretPut(_)
        | K::SecretDeleted(_) => None,
    }
}

/// An event in words.
pub fn describe_event(e: &pb::Event) -> String {
    use pb::event::Kind as K;
    match &e.kind {
        None => "unknown event".into(),
        Some(K::NodeRegistered(x)) => {
            format!("node {} registered with {} GPUs", x.name, x.gpus.len())
        }
        Some(K::NodeInventoryChanged(x)) => {
            let mut parts: Vec<String> = x
                .gone
                .iter()
                .map(|g| format!("GPU {} ({}) gone: {}", g.index, g.gpu_type, g.reason))
                .collect();
            if !x.added.is_empty() {
                let added: Vec<String> = x
                    .added
                    .iter()
                    .map(|g| format!("{} ({})", g.index, g.gpu_type))
                    .collect();
                parts.push(format!("GPUs added: {}", added.join(", ")));
            }
            format!("node {}: {}", x.name, parts.join("; "))
        }
        Some(K::NodeLost(x)) => format!("node {} lost: {}", x.name, x.reason),
        Some(K::NodeRecovered(x)) => format!("node {} recovered", x.name),
        Some(K::NodeRemoved(x)) => format!("node {} removed", x.name),
        Some(K::RequestRepeated(x)) => format!(
            "request {} repeated (a retry): nothing changed; answered as at index {}",
            x.request_id, x.first_index
        ),
        Some(K::PolicyMemoryRefused(x)) => {
            format!(
                "{}'s memory from this decision not kept: {}",
                x.policy, x.reason
            )
        }
        Some(K::AclBootstrapped(x)) => format!("ACLs bootstrapped: admin token {}", x.name),
        Some(K::TokenCreated(x)) => format!(
            "token {} created for role {}{}",
            x.name,
            keel_state::acl::Role::from_proto(x.role, "token_created.role")
                .map(|r| r.as_str())
                .unwrap_or("unknown"),
            x.expires_at_ms
                .map(|at| format!(", expiring at {}", time(at)))
                .unwrap_or_default()
        ),
        Some(K::TokenRevoked(x)) => format!("token {} revoked", x.name),
        Some(K::MembershipChangeRecorded(x)) => format!(
            "member {} {} (membership entry {})",
            x.member, x.change, x.membership_index
        ),
        Some(K::QueueCreated(x)) => format!("queue {} created", x.name),
        Some(K::QueueUpdated(x)) => format!("queue {} changed", x.name),
        Some(K::QueueDeleted(x)) => format!("queue {} deleted", x.name),
        Some(K::SecretPut(x)) => format!(
            "secret {} put (revision {}; keys {})",
            x.name,
            x.revision,
            x.keys.join(", ")
        ),
        Some(K::SecretDeleted(x)) => format!("secret {} deleted", x.name),
        Some(K::PolicyChanged(x)) => format!(
            "policy changed from {} to {}",
            if x.from.is_empty() {
                "the server's default"
            } else {
                &x.from
            },
            x.to
        ),
        Some(K::JobSubmitted(x)) if x.user.is_empty() => {
            format!("job {} submitted: {}", x.job_id, x.name)
        }
        Some(K::JobSubmitted(x)) => format!("job {} submitted: {} by {}", x.job_id, x.name, x.user),
        Some(K::JobCancelled(x)) => format!("job {} cancelled: {}", x.job_id, x.reason),
        Some(K::JobAllocated(x)) => format!(
            "job {} allocated {}{} (epoch {}, {} round {}, based on {})",
            x.job_id,
            x.gpus.iter().map(gpu_ref).collect::<Vec<_>>().join(","),
            x.shared_with
                .map(|p| format!(" shared with job {p}"))
                .unwrap_or_default(),
            x.epoch,
            x.policy,
            x.round,
            x.based_on
        ),
        Some(K::JobPreempted(x)) => format!("job {} preempted: {}", x.job_id, x.reason),
        Some(K::PlacementRefused(x)) => {
            format!("placement of job {} refused: {}", x.job_id, x.reason)
        }
        Some(K::WorkerStarted(x)) => format!(
            "job {} worker {} (epoch {}) started on {}",
            x.job_id, x.rank, x.epoch, x.node
        ),
        Some(K::WorkerExited(x)) => {
            let how = match (&x.reason, x.exit_code) {
                (r, _) if !r.is_empty() => r.clone(),
                (_, Some(c)) => format!("exited with code {c}"),
                (_, None) => "exited".into(),
            };
            format!(
                "job {} worker {} (epoch {}): {}",
                x.job_id, x.rank, x.epoch, how
            )
        }
        Some(K::JobProgressReported(x)) => format!(
            "job {} at step {} ({} samples)",
            x.job_id,
            x.latest.as_ref().map_or(0, |s| s.step),
            x.samples
        ),
        Some(K::JobFinished(x)) => format!("job {} {} {}", x.job_id, x.state, x.reason),
        Some(K::JobRequeued(x)) => format!(
            "job {} requeued (retry {}): {}",
            x.job_id, x.retries, x.reason
        ),
        Some(K::JobRemoved(x)) => format!("job {} removed", x.job_id),
    }
}

/// A time in log milliseconds as RFC 3339 (to the second); `-` for none.
pub fn time(ms: u64) -> String {
    if ms == 0 {
        return "-".into();
    }
    let t = std::time::UNIX_EPOCH + std::time::Duration::from_millis(ms);
    humantime::format_rfc3339_seconds(t).to_string()
}

fn gpu_ref(g: &pb::GpuRef) -> String {
    format!("{}/{}", g.node, g.index)
}
