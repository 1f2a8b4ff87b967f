//! `keel sim --plot DIR`: SVG figures of simulation runs, drawn with
//! plotters. One line per policy in each figure:
//! - `jct_cdf.svg`: the CDF of job completion times (measured jobs);
//! - `utilisation.svg`: busy GPUs over all GPUs, over simulated time;
//! - `queue.svg`: jobs waiting for GPUs, over simulated time.

use std::path::Path;

use anyhow::Context;
use keel_sim::SimReport;
use plotters::prelude::*;

const SIZE: (u32, u32) = (900, 540);

/// Writes the three figures for `runs` into `dir` (created if missing).
pub fn write_all(
    dir: &Path,
    runs: &[&SimReport],
    window: Option<(u64, u64)>,
) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let cdfs: Vec<(String, Vec<(f64, f64)>)> = runs
        .iter()
        .map(|r| (r.policy.clone(), jct_cdf(r, window)))
        .collect();
    line_chart(
        &dir.join("jct_cdf.svg"),
        "Job completion time CDF",
        "JCT (hours, log10)",
        "fraction of jobs",
        &cdfs,
    )?;
    let util: Vec<(String, Vec<(f64, f64)>)> = runs
        .iter()
        .map(|r| {
            let total = f64::from(r.total_gpus.max(1));
            let start = r.samples.first().map_or(0.0, |s| s.at_s);
            let points = r
                .samples
                .iter()
                .map(|s| ((s.at_s - start) / 3600.0, f64::from(s.busy_gpus) / total))
                .collect();
            (r.policy.clone(), points)
        })
        .collect();
    line_chart(
        &dir.join("utilisation.svg"),
        "GPU utilisation",
        "simulated time (hours)",
        "busy GPUs / GPUs",
        &util,
    )?;
    let queue: Vec<(String, Vec<(f64, f64)>)> = runs
        .iter()
        .map(|r| {
            let start = r.samples.first().map_or(0.0, |s| s.at_s);
            let points = r
                .samples
                .iter()
                .map(|s| ((s.at_s - start) / 3600.0, f64::from(s.queued_jobs)))
                .collect();
            (r.policy.clone(), points)
        })
        .collect();
    line_chart(
        &dir.join("queue.svg"),
        "Jobs waiting for GPUs",
        "simulated time (hours)",
        "jobs queued",
        &queue,
    )
}

/// `(log10 JCT in hours, fraction of jobs finished by then)`.
fn jct_cdf(report: &SimReport, window: Option<(u64, u64)>) -> Vec<(f64, f64)> {
    let mut jcts: Vec<f64> = report
        .jobs
        .iter()
        .filter(|j| window.is_none_or(|(a, b)| (a..=b).contains(&j.id)))
        .filter_map(|j| j.jct_s())
        .map(|s| (s / 3600.0).max(1e-4).log10())
        .collect();
    jcts.sort_by(f64::total_cmp);
    let n = jcts.len().max(1) as f64;
    jcts.into_iter()
        .enumerate()
        .map(|(i, x)| (x, (i + 1) as f64 / n))
        .collect()
}

fn line_chart(
    path: &Path,
    title: &str,
    x_label: &str,
    y_label: &str,
    series: &[(String, Vec<(f64, f64)>)],
) -> anyhow::Result<()> {
    let points = series.iter().flat_map(|(_, p)| p.iter());
    let (mut x0, mut x1, mut y1) = (f64::INFINITY, f64::NEG_INFINITY, 0.0f64);
    for (x, y) in points {
        x0 = x0.min(*x);
        x1 = x1.max(*x);
        y1 = y1.max(*y);
    }
    if !x0.is_finite() || !x1.is_finite() {
        (x0, x1) = (0.0, 1.0);
    }
    if x1 <= x0 {
        x1 = x0 + 1.0;
    }
    let y1 = if y1 > 0.0 { y1 * 1.05 } else { 1.0 };
    let root = SVGBackend::new(path, SIZE).into_drawing_area();
    let draw = |e: String| anyhow::anyhow!("drawing {}: {e}", path.display());
    root.fill(&WHITE).map_err(|e| draw(e.to_string()))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 22))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(x0..x1, 0.0..y1)
        .map_err(|e| draw(e.to_string()))?;
    chart
        .configure_mesh()
        .x_desc(x_label)
        .y_desc(y_label)
        .draw()
        .map_err(|e| draw(e.to_string()))?;
    for (i, (name, pts)) in series.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        chart
            .draw_series(LineSeries::new(pts.iter().copied(), color.stroke_width(2)))
            .map_err(|e| draw(e.to_string()))?
            .label(name.clone())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color));
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(|e| draw(e.to_string()))?;
    root.present().map_err(|e| draw(e.to_string()))?;
    Ok(())
}
