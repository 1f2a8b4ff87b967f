//! Property tests over every policy: plans are deterministic, never
//! over-allocate a GPU (two jobs share one only as a declared pair on the
//! same GPUs), respect each job's shape and allowed types, are accepted
//! whole by `apply`, and are stable (a second round proposes nothing).
//! Keel's policies and the space-sharing ones run here; the other
//! heterogeneity-aware ones have their own tests.

use std::collections::BTreeSet;

use keel_scheduling::gavel;
use keel_scheduling::policy::{by_name, QueueOptions, SchedulingInput, POLICY_NAMES};
use keel_state::fixtures::job_spec;
use keel_state::*;
use proptest::prelude::*;

#[derive(Debug, Clone)]
struct JobShape {
    gpus: u32,
    min: u32,
    max: u32,
    allowed: Vec<&'static str>,
}

fn job_shape() -> impl Strategy<Value = JobShape> {
    (
        1u32..=4,
        1u32..=3,
        0u32..=2,
        prop::sample::select(vec![vec![], vec!["v100"], vec!["k80"], vec!["k80", "v100"]]),
    )
        .prop_map(|(gpus, min, extra, allowed)| JobShape {
            gpus,
            min,
            max: min + extra,
            allowed,
        })
}

fn world(nodes: &[(u32, bool)], jobs: &[JobShape]) -> (ClusterState, u64) {
    let mut state = ClusterState::new();
    let mut index = 0;
    let mut apply = |state: &mut ClusterState, command: Command| {
        index += 1;
        state
            .apply(index, &LogEntry::new(index, command))
            .expect("setup applies");
    };
    for (n, (count, v100)) in nodes.iter().enumerate() {
        apply(
            &mut state,
            Command::register_node(
                format!("n{n}"),
                "127.0.0.1",
                (0..*count)
                    .map(|index| Gpu {
                        index,
                        gpu_type: if *v100 { "v100" } else { "k80" }.into(),
                    })
                    .collect(),
            ),
        );
    }
    for (i, j) in jobs.iter().enumerate() {
        let mut spec = job_spec(&format!("j{i}"), j.gpus, j.min);
        spec.workers.max = j.max;
        spec.gpu_types.allowed = j.allowed.iter().map(|t| t.to_string()).collect();
        apply(&mut state, Command::submit_job(spec));
    }
    (state, index)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn plans_are_valid_deterministic_and_stable(
        nodes in prop::collection::vec((1u32..=8, any::<bool>()), 1..6),
        jobs in prop::collection::vec(job_shape(), 1..30),
        backfill in any::<bool>(),
    ) {
        for name in POLICY_NAMES.iter().chain(gavel::SPACE_SHARING_POLICY_NAMES) {
            let policy = by_name(name, QueueOptions { backfill }).expect("known policy");
            let (mut state, mut index) = world(&nodes, &jobs);
            let input = SchedulingInput::everyone(&state, index);
            let plan = policy.plan(&input);
            prop_assert_eq!(&plan, &policy.plan(&input), "{} is not deterministic", name);

            // What every job holds after the round, the jobs a plan that
            // only adds leaves unnamed included.
            let mut whole = plan.clone();
            whole.list_the_rest(&state);
            prop_assert_eq!(&whole.changes(&state), &plan.changes(&state), "{} listed whole means the same", name);
            let plan = whole;
            let mut seen = BTreeSet::new();
            for (job_id, gpus) in &plan.placements {
                let job = state.job(*job_id).expect("planned job exists");
                let types: BTreeSet<&String> = gpus
                    .iter()
                    .map(|g| &state.nodes()[&g.node].gpus[&g.index])
                    .collect();
                prop_assert!(types.len() <= 1, "job {} mixes types {:?}", job_id, types);
                if let Some(t) = types.first() {
                    let allowed = &job.spec.gpu_types.allowed;
                    prop_assert!(allowed.is_empty() || allowed.contains(t));
                }
                let workers = gpus.len() as u32 / job.spec.gpus;
                prop_assert_eq!(gpus.len() as u32 % job.spec.gpus, 0);
                prop_assert!(workers >= job.spec.workers.min && workers <= job.spec.workers.max);
                let partner = plan.partners.get(job_id);
                if let Some(p) = partner {
                    prop_assert_eq!(plan.partners.get(p), Some(job_id), "pairs are mutual");
                    prop_assert_eq!(plan.placements.get(p), Some(gpus), "a pair shares its GPUs");
                }
                // A pair's GPUs are counted at its smaller id.
                if partner.is_some_and(|p| p < job_id) {
                    continue;
                }
                for g in gpus.iter() {
                    prop_assert!(seen.insert(g.clone()), "GPU {} planned twice", g);
                }
            }

            let changes = plan.changes(&state);
            if !changes.is_empty() {
                index += 1;
                let events = state
                    .apply(index, &LogEntry::new(index, Command::decide_allocation(index - 1, policy.name(), 1, changes)))
                    .expect("a decision is applied per job");
                let refused: Vec<_> = events
                    .iter()
                    .filter(|e| matches!(e, Event::PlacementRefused { .. }))
                    .collect();
                prop_assert!(refused.is_empty(), "{:?}", refused);
            }
            state.check_invariants().map_err(TestCaseError::fail)?;
            let again = policy.plan(&SchedulingInput::everyone(&state, index));
            prop_assert!(again.changes(&state).is_empty(), "{} is not stable", name);
        }
    }
}
