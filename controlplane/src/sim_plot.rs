//! SVG figures of simulation runs, drawn with plotters: `keel sim --plot
//! DIR`, `keel whatif --plot DIR` and the console's what-if. One line per
//! policy in each figure:
//! - `jct_cdf.svg`: the CDF of job completion times (measured jobs);
//! - `utilisation.svg`: busy GPUs over all GPUs, over simulated time;
//! - `queue.svg`: jobs waiting for GPUs, over simulated time.

use std::path::Path;

use keel_sim::SimReport;
use plotters::prelude::*;

const SIZE: (u32, u32) = (900, 540);

/// Why a figure was not made.
#[derive(Debug, thiserror::Error)]
pub enum PlotError {
    #[error("cannot write {path}: {source}")]
    Write {
        path: String,
        source: std::io::Error,
    },
    #[error("drawing {figure}: {message}")]
    Draw {
        figure: &'static str,
        message: String,
    },
}

/// One figure: its file name and its SVG.
#[derive(Debug, Clone)]
pub struct Figure {
    pub name: &'static str,
    pub svg: String,
}

/// Writes the three figures for `runs` into `dir` (created if missing).
pub fn write_all(
    dir: &Path,
    runs: &[&SimReport],
    window: Option<(u64, u64)>,
) -> Result<(), PlotError> {
    let failed = |path: &Path| {
        let path = path.display().to_string();
        move |source| PlotError::Write { path, source }
    };
    std::fs::create_dir_all(dir).map_err(failed(dir))?;
    for figure in figures(runs, window)? {
        let path = dir.join(figure.name);
        std::fs::write(&path, figure.svg).map_err(failed(&path))?;
    }
    Ok(())
}

/// The three figures for `runs`, in memory.
pub fn figures(runs: &[&SimReport], window: Option<(u64, u64)>) -> Result<Vec<Figure>, PlotError> {
    let cdfs: Vec<(String, Vec<(f64, f64)>)> = runs
        .iter()
        .map(|r| (r.policy.clone(), jct_cdf(r, window)))
        .collect();
    let jct_cdf = line_chart(
        "jct_cdf.svg",
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
    let utilisation = line_chart(
        "utilisation.svg",
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
    let queue = line_chart(
        "queue.svg",
        "Jobs waiting for GPUs",
        "simulated time (hours)",
        "jobs queued",
        &queue,
    )?;
    Ok(vec![jct_cdf, utilisation, queue])
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
    name: &'static str,
    title: &str,
    x_label: &str,
    y_label: &str,
    series: &[(String, Vec<(f64, f64)>)],
) -> Result<Figure, PlotError> {
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
    let mut svg = String::new();
    let root = SVGBackend::with_string(&mut svg, SIZE).into_drawing_area();
    let draw = |message: String| PlotError::Draw {
        figure: name,
        message,
    };
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
    drop(chart);
    drop(root);
    Ok(Figure { name, svg })
}
