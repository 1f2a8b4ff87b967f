//! Fuzz target for the job specs a client sends (issue 22, item 5): YAML
//! (the CLI's files, serde-saphyr with its input budgets) and JSON, then
//! the spec's own checks, fed arbitrary text and mutations of the
//! examples in `examples/`. Each must give a valid spec or an error: no
//! panic. `KEEL_FUZZ_CASES` sets the inputs (default 2,000).

use keel_state::fixtures::{mutate, Mutation};
use keel_state::spec::JobSpec;
use proptest::prelude::*;

fn seeds() -> Vec<String> {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples");
    let mut seeds: Vec<String> = std::fs::read_dir(&dir)
        .expect("examples/")
        .map(|e| e.expect("entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .map(|p| std::fs::read_to_string(p).expect("read"))
        .collect();
    seeds.sort();
    assert!(seeds.len() >= 3, "the example specs");
    seeds
}

fn texts() -> impl Strategy<Value = String> {
    let seeds = seeds();
    let count = seeds.len();
    prop_oneof![
        any::<String>(),
        (0..count, prop::collection::vec(any::<Mutation>(), 1..6)).prop_map(move |(i, m)| {
            String::from_utf8_lossy(&mutate(seeds[i].as_bytes(), &m)).into_owned()
        }),
    ]
}

fn config() -> ProptestConfig {
    ProptestConfig {
        cases: keel_state::fixtures::fuzz_cases(),
        max_shrink_iters: 2_000,
        ..ProptestConfig::default()
    }
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn a_spec_parses_and_is_checked_or_is_refused(text in texts()) {
        if let Ok(spec) = serde_saphyr::from_str::<JobSpec>(&text) {
            let _ = spec.validate();
            let _ = spec.warnings();
        }
        if let Ok(spec) = serde_json::from_str::<JobSpec>(&text) {
            let _ = spec.validate();
        }
    }
}

/// The seeds are valid specs.
#[test]
fn the_example_specs_parse_and_are_valid() {
    for seed in seeds() {
        let spec: JobSpec = serde_saphyr::from_str(&seed).expect("an example parses");
        assert!(spec.validate().is_ok(), "{seed}");
    }
}
