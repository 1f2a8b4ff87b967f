//! `keel sim` as a user runs it: files in, a summary out, clear errors.

mod support;

use std::path::Path;
use std::process::Command;

use support::{json_of, KEEL};

fn sim(args: &[&str]) -> std::process::Output {
    Command::new(KEEL)
        .arg("sim")
        .args(args)
        .output()
        .expect("run keel sim")
}

/// `keel policy eval --input INPUT EXTRA...`, which must succeed: its JSON.
fn policy_eval(input: &Path, extra: &[&str]) -> serde_json::Value {
    json_of(
        Command::new(KEEL)
            .args(["policy", "eval", "--input"])
            .arg(input)
            .args(extra),
    )
}

#[test]
fn a_trace_runs_to_a_json_summary_and_per_job_csv() {
    let dir = tempfile::tempdir().expect("tempdir");
    let trace = dir.path().join("trace.jsonl");
    std::fs::write(
        &trace,
        "{\"arrival_s\": 0, \"model\": \"resnet50\", \"total_steps\": 11000}\n\
         {\"arrival_s\": 60, \"model\": \"vgg16\", \"workers\": 2, \"total_steps\": 5000}\n\
         {\"arrival_s\": 120, \"model\": \"lstm\", \"workers\": {\"min\": 1, \"max\": 2}, \"total_steps\": 8000}\n",
    )
    .expect("trace");
    let csv = dir.path().join("jobs.csv");
    let out = sim(&[
        "--trace",
        trace.to_str().expect("utf-8"),
        "--cluster",
        "2:1:1",
        "--jobs-csv",
        csv.to_str().expect("utf-8"),
        "-o",
        "json",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let summary: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!(summary["finished"], 3, "{summary}");
    assert_eq!(summary["unfinished"], 0, "{summary}");
    assert!(summary["avg_jct_h"].as_f64().is_some_and(|h| h > 0.0));
    let rows = std::fs::read_to_string(&csv).expect("csv");
    assert_eq!(rows.lines().count(), 4, "{rows}");
    // The same inputs, the same history.
    let again = sim(&[
        "--trace",
        trace.to_str().expect("utf-8"),
        "--cluster",
        "2:1:1",
        "-o",
        "json",
    ]);
    let again: serde_json::Value = serde_json::from_slice(&again.stdout).expect("json");
    assert_eq!(again["state_hash"], summary["state_hash"]);
}

#[test]
fn bad_inputs_are_refused_naming_the_line_or_flag() {
    let dir = tempfile::tempdir().expect("tempdir");
    let trace = dir.path().join("bad.jsonl");
    std::fs::write(
        &trace,
        "{\"arrival_s\": 0, \"model\": \"resnet50\", \"total_steps\": 10}\n\
         {\"arrival_s\": 1, \"model\": \"resnet50\", \"workers\": {\"min\": 3, \"max\": 2}, \"total_steps\": 10}\n",
    )
    .expect("trace");
    let out = sim(&["--trace", trace.to_str().expect("utf-8")]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("line 2") && err.contains("min"), "{err}");
    let out = sim(&["--generate", "10", "--cluster", "1:2"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("v100:p100:k80"));
    let out = sim(&["--generate", "10", "--policy", "nope"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("optimus"));
    let out = sim(&[
        "--generate",
        "10",
        "--policy",
        "tiresias",
        "--tiresias-thresholds-gpu-s",
        "3600,60",
    ]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--tiresias-thresholds-gpu-s") && err.contains("ascend"),
        "{err}"
    );
    // Retention (issue 23): a negative age, no finished job kept.
    for (flags, expected) in [
        (
            ["--retain-finished-s=-5", "--seed=0"],
            "--retain-finished-s",
        ),
        (["--retain-finished-s", "NaN"], "--retain-finished-s"),
        (
            ["--retain-finished-max", "0"],
            "--retain-finished-max must be at least 1",
        ),
    ] {
        let mut args = vec!["--generate", "10"];
        args.extend(flags);
        let out = sim(&args);
        assert!(!out.status.success(), "{flags:?} was taken");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(expected), "{flags:?}: {err}");
    }
}

/// Issue 23: queues in the simulator, from a cluster file and
/// `--generate-queues`, and every bad queue input refused naming what is
/// wrong.
#[test]
fn queues_in_the_simulator_run_and_bad_ones_name_what_is_wrong() {
    let dir = tempfile::tempdir().expect("tempdir");
    let file = |name: &str, text: &str| {
        let path = dir.path().join(name);
        std::fs::write(&path, text).expect("file");
        path.to_str().expect("utf-8").to_string()
    };
    let nodes = "nodes:\n  - {gpu_type: v100, gpus: 4, count: 2}\n";
    let cluster = file(
        "two.yaml",
        &format!(
            "{nodes}queues:\n  - {{name: a, quota: {{v100: 4}}, cohort: c}}\n  - {{name: b, quota: {{v100: 4}}, cohort: c}}\n"
        ),
    );
    let summary = json_of(Command::new(KEEL).args([
        "sim",
        "--generate",
        "40",
        "--cluster-file",
        &cluster,
        "--generate-queues",
        "a=3,b=1",
        "-o",
        "json",
    ]));
    let rows = summary["queues"].as_array().expect("queue rows");
    let jobs: Vec<(String, u64)> = rows
        .iter()
        .map(|r| {
            (
                r["queue"].as_str().unwrap_or_default().to_string(),
                r["jobs"].as_u64().unwrap_or(0),
            )
        })
        .collect();
    assert_eq!(jobs.iter().map(|(_, n)| n).sum::<u64>(), 40, "{summary}");
    assert!(jobs.iter().any(|(q, n)| q == "a" && *n > 20), "{summary}");
    let unknown_type = file(
        "h100.yaml",
        &format!("{nodes}queues:\n  - {{name: a, quota: {{h100: 4}}}}\n"),
    );
    let twice = file(
        "twice.yaml",
        &format!("{nodes}queues:\n  - {{name: a}}\n  - {{name: a}}\n"),
    );
    let bad_name_trace = file(
        "bad-queue.jsonl",
        "{\"arrival_s\": 0, \"model\": \"resnet50\", \"total_steps\": 10, \"queue\": \"Team A\"}\n",
    );
    let generated = |queues: &'static str| -> Vec<&str> {
        vec![
            "--generate",
            "10",
            "--cluster-file",
            cluster.as_str(),
            "--generate-queues",
            queues,
        ]
    };
    for (args, expected) in [
        (generated("a"), "is not QUEUE=SHARE"),
        (generated("a=x"), "the share"),
        (generated("A=1"), "not a queue name"),
        (generated("a=0"), "a share above 0"),
        (generated("z=1"), "does not define"),
        (
            vec!["--generate", "10", "--cluster-file", &unknown_type],
            "quota",
        ),
        (
            vec!["--generate", "10", "--cluster-file", &twice],
            "listed twice",
        ),
        (vec!["--trace", &bad_name_trace], "line 1"),
        (
            vec![
                "--generate",
                "10",
                "--cluster-file",
                &cluster,
                "--policy",
                "max_min_fairness",
            ],
            "round-based simulator",
        ),
    ] {
        let out = sim(&args);
        assert!(!out.status.success(), "{args:?} was taken");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(expected), "{args:?}: {err}");
    }
}

#[test]
fn a_gavel_trace_runs_with_gavel_throughputs() {
    let dir = tempfile::tempdir().expect("tempdir");
    let trace = dir.path().join("jobs.trace");
    std::fs::write(
        &trace,
        "ResNet-50 (batch size 64)\tpython3 main.py\tdir\t--num_steps\t1\t7200\t1\t1\t-1\t0\n",
    )
    .expect("trace");
    let table = dir.path().join("throughputs.json");
    std::fs::write(
        &table,
        r#"{"v100": {"('ResNet-50 (batch size 64)', 1)": {"null": 2.0}}}"#,
    )
    .expect("table");
    let out = sim(&[
        "--gavel-trace",
        trace.to_str().expect("utf-8"),
        "--throughputs",
        table.to_str().expect("utf-8"),
        "--cluster",
        "1:0:0",
        "-o",
        "json",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let summary: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    // 7,200 steps at Gavel's 2 steps/s: one hour.
    let jct = summary["avg_jct_h"].as_f64().expect("jct");
    assert!((jct - 1.0).abs() < 1e-3, "{summary}");
    std::fs::write(&table, "{\"v100\": 3}").expect("table");
    let out = sim(&[
        "--gavel-trace",
        trace.to_str().expect("utf-8"),
        "--throughputs",
        table.to_str().expect("utf-8"),
    ]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("throughput table"));
}

#[test]
fn compare_with_plots_writes_one_svg_per_figure_with_every_policy() {
    let dir = tempfile::tempdir().expect("tempdir");
    let plots = dir.path().join("plots");
    let out = sim(&[
        "--generate",
        "60",
        "--rate",
        "30",
        "--multi-gpu",
        "--elastic",
        "--cluster",
        "4:4:4",
        "--gpus-per-server",
        "4",
        "--restart-s",
        "30",
        "--compare",
        "fifo,elastic_fifo,optimus",
        "--plot",
        plots.to_str().expect("utf-8"),
        "-o",
        "json",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let summaries: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    let rows = summaries.as_array().expect("one summary per policy");
    assert_eq!(rows.len(), 3);
    for row in rows {
        assert_eq!(row["finished"], 60, "{row}");
    }
    // Elastic policies resize jobs; FIFO never does.
    assert_eq!(rows[0]["resizes"], 0);
    assert!(rows[1]["resizes"].as_u64() > Some(0), "{}", rows[1]);
    for figure in ["jct_cdf.svg", "utilisation.svg", "queue.svg"] {
        let svg = std::fs::read_to_string(plots.join(figure)).expect(figure);
        assert!(svg.starts_with("<svg"), "{figure}");
        for policy in ["fifo", "elastic_fifo", "optimus"] {
            assert!(
                svg.contains(&format!(">\n{policy}\n<")),
                "{figure} lacks {policy}"
            );
        }
    }
}

#[test]
fn policy_eval_prints_gavel_shaped_allocations_and_names_bad_fields() {
    let golden: serde_json::Value = serde_json::from_str(include_str!(
        "../scheduling/tests/fixtures/gavel_golden_small.json"
    ))
    .expect("fixture");
    let dir = tempfile::tempdir().expect("tempdir");
    let input = dir.path().join("case.json");
    std::fs::write(&input, golden["cases"][1].to_string()).expect("write");
    let results = policy_eval(&input, &[]);
    let expected = &golden["cases"][1]["expected_effective_throughput"]["max_min_fairness_perf"];
    for job in 0..6 {
        let ours = results["max_min_fairness_perf"]["effective_throughput"][job.to_string()]
            .as_f64()
            .expect("a throughput");
        let gavel = expected[job.to_string()].as_f64().expect("expected");
        assert!((ours - gavel).abs() < 1e-3, "job {job}: {ours} vs {gavel}");
    }
    assert!(results["isolated"]["allocation"]["5"]["v100"].is_number());
    // A multi-GPU job: AlloX (single-GPU jobs only) says why in its entry;
    // the other policies still answer.
    let mut multi = golden["cases"][1].clone();
    multi["scale_factors"]["0"] = serde_json::json!(2);
    std::fs::write(&input, multi.to_string()).expect("write");
    let results = policy_eval(&input, &[]);
    let error = results["allox"]["error"].as_str().unwrap_or_default();
    assert!(error.contains("scale_factors"), "{results}");
    assert!(results["max_min_fairness_perf"]["allocation"]["0"]["v100"].is_number());
    // A negative throughput is refused, naming the field.
    let mut bad = golden["cases"][0].clone();
    bad["throughputs"]["0"]["v100"] = serde_json::json!(-1.0);
    std::fs::write(&input, bad.to_string()).expect("write");
    let out = Command::new(KEEL)
        .args(["policy", "eval", "--input", input.to_str().expect("utf-8")])
        .output()
        .expect("run keel");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("throughputs") && err.contains("job 0"),
        "{err}"
    );
}

/// Space sharing through `keel policy eval`: two jobs of one type on one
/// GPU, each at 80 % of its speed beside the other, share it all the time
/// (listed as a pair); a negative pair figure is refused, naming the field.
#[test]
fn policy_eval_lists_the_pairs_that_share_gpus() {
    let case = serde_json::json!({
        "cluster_spec": {"v100": 1},
        "throughputs": {"0": {"v100": 2.0}, "1": {"v100": 2.0}},
        "scale_factors": {"0": 1, "1": 1},
        "job_types": {"0": "resnet", "1": "resnet"},
        "pair_throughputs": {"resnet": {"resnet": {"v100": [1.6, 1.6]}}}
    });
    let dir = tempfile::tempdir().expect("tempdir");
    let input = dir.path().join("case.json");
    std::fs::write(&input, case.to_string()).expect("write");
    let results = policy_eval(&input, &["--policy", "max_min_fairness_packed"]);
    let packed = &results["max_min_fairness_packed"];
    assert_eq!(
        packed["pair_allocation"][0]["jobs"],
        serde_json::json!([0, 1])
    );
    let shared = packed["pair_allocation"][0]["allocation"]["v100"]
        .as_f64()
        .expect("a fraction");
    assert!((shared - 1.0).abs() < 1e-4, "{packed}");
    let e = packed["effective_throughput"]["0"]
        .as_f64()
        .expect("a throughput");
    assert!((e - 1.6).abs() < 1e-4, "{packed}");

    let mut bad = case.clone();
    bad["pair_throughputs"]["resnet"]["resnet"]["v100"] = serde_json::json!([1.6, -1.0]);
    std::fs::write(&input, bad.to_string()).expect("write");
    let out = Command::new(KEEL)
        .args(["policy", "eval", "--input", input.to_str().expect("utf-8")])
        .output()
        .expect("run keel");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("pair_throughputs"), "{err}");
}

/// `--gavel-compat` on Gavel's generated-stream CSV: a lone job of 720
/// steps at Gavel's 2 steps/s on the v100 runs one 360 s round (0.1 h)
/// under both heterogeneity-aware policies (the agnostic one may pick the
/// k80 instead). Keel's own policies are refused in this mode, naming the
/// heterogeneity-aware ones, and a rate of 0 cannot convert arrivals.
#[test]
fn gavel_compat_runs_the_generated_stream_through_the_round_mechanism() {
    let dir = tempfile::tempdir().expect("tempdir");
    let csv = dir.path().join("jobs.csv");
    std::fs::write(
        &csv,
        "job_id,model,scale_factor,duration_s_on_v100,total_steps,unit_arrival\n\
         0,ResNet-50 (batch size 64),1,360.0,720.0,0.0\n",
    )
    .expect("csv");
    let table = dir.path().join("throughputs.json");
    std::fs::write(
        &table,
        r#"{"v100": {"('ResNet-50 (batch size 64)', 1)": {"null": 2.0}},
            "k80": {"('ResNet-50 (batch size 64)', 1)": {"null": 0.5}}}"#,
    )
    .expect("table");
    let args = |extra: &[&str]| {
        let mut a = vec![
            "--generated-csv",
            csv.to_str().expect("utf-8"),
            "--rate",
            "3.2",
            "--throughputs",
            table.to_str().expect("utf-8"),
            "--cluster",
            "1:0:1",
            "--gavel-compat",
            "-o",
            "json",
        ];
        a.extend_from_slice(extra);
        a.into_iter().map(String::from).collect::<Vec<_>>()
    };
    let run = |extra: &[&str]| {
        let a = args(extra);
        sim(&a.iter().map(String::as_str).collect::<Vec<_>>())
    };
    let out = run(&[
        "--compare",
        "fifo_perf,max_min_fairness_perf,max_min_fairness",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let summaries: Vec<serde_json::Value> = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!(summaries.len(), 3);
    for s in &summaries[..2] {
        assert_eq!(s["finished"], 1, "{s}");
        let jct = s["avg_jct_h"].as_f64().expect("jct");
        assert!((jct - 0.1).abs() < 1e-9, "{s}");
        assert!(s["solves"].as_u64() >= Some(1), "{s}");
    }
    assert_eq!(summaries[2]["finished"], 1, "{}", summaries[2]);

    let refused = run(&["--policy", "drf"]);
    assert!(!refused.status.success());
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(stderr.contains("max_min_fairness_perf"), "{stderr}");

    let mut zero = args(&["--policy", "fifo_perf"]);
    zero[3] = "0".into();
    let out = sim(&zero.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--rate"));
}

/// `--gavel-generate N` draws Gavel's own stream (steps from the table's
/// v100 figures): every job is one of Gavel's templates, arrivals rise,
/// the space-sharing policies run on it and place pairs, and a table
/// without a drawn job type is refused, naming `--throughputs`.
#[test]
fn gavel_generate_draws_gavels_stream_for_the_round_simulator() {
    let dir = tempfile::tempdir().expect("tempdir");
    let table = dir.path().join("throughputs.json");
    let templates = keel_sim::gavel_generator::GAVEL_JOB_TABLE;
    let mut v100 = serde_json::Map::new();
    for (model, _) in templates {
        let mut figures = serde_json::Map::new();
        figures.insert("null".into(), serde_json::json!(10.0));
        for (other, _) in templates {
            figures.insert(format!("('{other}', 1)"), serde_json::json!([8.0, 8.0]));
        }
        v100.insert(
            format!("('{model}', 1)"),
            serde_json::Value::Object(figures),
        );
    }
    std::fs::write(&table, serde_json::json!({ "v100": v100 }).to_string()).expect("table");
    let run = |policy: &str, table: &std::path::Path| {
        sim(&[
            "--gavel-generate",
            "40",
            "--rate",
            "20",
            "--throughputs",
            table.to_str().expect("utf-8"),
            "--cluster",
            "4:0:0",
            "--gavel-compat",
            "--policy",
            policy,
            "-o",
            "json",
        ])
    };
    for policy in [
        "max_min_fairness_perf",
        "max_min_fairness_packed",
        "gandiva",
    ] {
        let out = run(policy, &table);
        assert!(
            out.status.success(),
            "{policy}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let s: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
        assert_eq!(s["jobs"], 40, "{s}");
        assert_eq!(s["finished"], 40, "{s}");
        if policy != "max_min_fairness_perf" {
            assert!(s["pairs_placed"].as_u64() > Some(0), "{policy}: {s}");
        }
    }
    let small = dir.path().join("small.json");
    std::fs::write(&small, r#"{"v100": {"('A3C', 1)": {"null": 1.0}}}"#).expect("table");
    let out = run("max_min_fairness_perf", &small);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--throughputs"));
}

/// The README's `keel policy eval --input examples/policy-case.json` runs:
/// every policy answers the shipped example with an allocation for each of
/// its jobs, none over a whole GPU's time.
#[test]
fn the_shipped_policy_case_is_evaluated_by_every_policy() {
    let input = concat!(env!("CARGO_MANIFEST_DIR"), "/../examples/policy-case.json");
    let results = policy_eval(Path::new(input), &[]);
    let policies = results.as_object().expect("one entry per policy");
    assert!(policies.len() >= 5, "{results}");
    for (policy, result) in policies {
        assert!(result.get("error").is_none(), "{policy}: {result}");
        for job in 0..4 {
            let shares = result["allocation"][job.to_string()]
                .as_object()
                .unwrap_or_else(|| panic!("{policy}: no allocation for job {job}: {result}"));
            let time: f64 = shares.values().filter_map(serde_json::Value::as_f64).sum();
            assert!(time <= 1.0 + 1e-6, "{policy}: job {job} gets {time}");
        }
    }
}

/// A reader that closed the pipe ends the output quietly: no error, no
/// panic, status 0 (`keel ... | head`).
#[test]
fn a_closed_pipe_ends_the_output_quietly() {
    let (reader, writer) = std::io::pipe().expect("pipe");
    drop(reader);
    let input = concat!(env!("CARGO_MANIFEST_DIR"), "/../examples/policy-case.json");
    let out = Command::new(KEEL)
        .args(["policy", "eval", "--input", input])
        .stdout(writer)
        .stderr(std::process::Stdio::piped())
        .output()
        .expect("run keel");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{:?}: {stderr}", out.status);
    assert!(!stderr.contains("Broken pipe"), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
}
