//! Fuzz targets for the workload parsers `keel sim` reads files with
//! (issue 22, item 5): Keel's trace, Gavel's trace and Gavel's generated
//! CSV, fed arbitrary text and mutations of valid files. Each must answer
//! with jobs or an error naming the line: no panic. `KEEL_FUZZ_CASES` sets
//! the inputs per target (default 2,000).

use keel_sim::workload::{parse_gavel_generated_csv, parse_gavel_trace, parse_keel_trace};
use keel_state::fixtures::{mutate, Mutation};
use proptest::prelude::*;

const KEEL_TRACE: &str = "# a comment\n\
{\"arrival_s\": 0, \"model\": \"resnet50\", \"workers\": {\"min\": 1, \"max\": 4}, \"total_steps\": 20000}\n\
{\"arrival_s\": 12.5, \"model\": \"transformer\", \"workers\": {\"min\": 2, \"max\": 2}, \"total_steps\": 500}\n";
const GAVEL_TRACE: &str =
    "ResNet-50 (batch size 64)\tcmd\tdir\t--num_steps\t1\t52000\t4\t1\t-1\t3600.5\n\
Transformer (batch size 128)\tcmd\tdir\t--num_steps\t0\t1000\t1\t1\t-1\t0\n";
const GAVEL_CSV: &str = "job_id,model,scale_factor,duration_s_on_v100,total_steps,unit_arrival\n\
0,ResNet-50 (batch size 64),1,3600.0,52000.5,0.0\n\
1,LM (batch size 20),2,7200,1000,0.25\n";

/// Arbitrary text, or a seed mutated (as bytes, read back lossily).
fn texts(seed: &'static str) -> impl Strategy<Value = String> {
    prop_oneof![
        any::<String>(),
        prop::collection::vec(any::<Mutation>(), 1..6)
            .prop_map(move |m| String::from_utf8_lossy(&mutate(seed.as_bytes(), &m)).into_owned()),
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
    fn a_keel_trace_parses_or_is_refused(text in texts(KEEL_TRACE)) {
        let _ = parse_keel_trace(&text);
    }

    #[test]
    fn a_gavel_trace_parses_or_is_refused(text in texts(GAVEL_TRACE)) {
        let _ = parse_gavel_trace(&text);
    }

    #[test]
    fn a_gavel_csv_parses_or_is_refused(text in texts(GAVEL_CSV), rate in any::<f64>()) {
        let _ = parse_gavel_generated_csv(&text, rate);
    }
}

/// The seeds are valid: the mutations start from inputs that parse.
#[test]
fn the_seeds_parse() {
    assert_eq!(parse_keel_trace(KEEL_TRACE).map(|j| j.len()).ok(), Some(2));
    assert_eq!(
        parse_gavel_trace(GAVEL_TRACE).map(|j| j.len()).ok(),
        Some(2)
    );
    assert_eq!(
        parse_gavel_generated_csv(GAVEL_CSV, 2.0)
            .map(|j| j.len())
            .ok(),
        Some(2)
    );
}
