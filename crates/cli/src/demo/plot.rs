//! `--plot`: the loss curves of both runs, and below them the size of their difference
//! against the tolerance (log scale), as an SVG chart drawn with plotters.

use std::path::Path;

use plotters::prelude::*;

use super::DemoError;
use super::report::DemoReport;

/// Differences of exactly 0 are drawn at this height on the log axis.
const FLOOR: f64 = 1e-12;

/// Draws `report`'s losses to `path`.
pub(crate) fn write_svg(path: &Path, report: &DemoReport) -> Result<(), DemoError> {
    draw(path, report).map_err(|e| DemoError::Plot {
        path: path.to_path_buf(),
        msg: e.to_string(),
    })
}

fn draw(path: &Path, r: &DemoReport) -> Result<(), Box<dyn std::error::Error>> {
    let root = SVGBackend::new(path, (900, 640)).into_drawing_area();
    root.fill(&WHITE)?;
    let c = &r.config;
    let title = format!(
        "tessera demo: tp {} × dp {}, {}, checkpoint {} — {}",
        c.tp,
        c.dp,
        c.format,
        c.checkpoint,
        if r.passed {
            "checks passed"
        } else {
            "CHECKS FAILED"
        }
    );
    let root = root.titled(&title, ("sans-serif", 20))?;
    let (top, bottom) = root.split_vertically(400);
    let steps = r.steps.len().max(1) as f64;
    let x_range = 1.0..steps.max(2.0);

    let (lo, hi) = r
        .steps
        .iter()
        .flat_map(|s| [s.loss, s.reference])
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), v| {
            (a.min(v), b.max(v))
        });
    let (lo, hi) = if lo.is_finite() && hi.is_finite() {
        let pad = ((hi - lo) * 0.08).max(hi.abs() * 1e-6).max(1e-12);
        (lo - pad, hi + pad)
    } else {
        (0.0, 1.0)
    };
    let mut losses = ChartBuilder::on(&top)
        .margin(12)
        .caption("training loss", ("sans-serif", 16))
        .x_label_area_size(32)
        .y_label_area_size(72)
        .build_cartesian_2d(x_range.clone(), lo..hi)?;
    losses
        .configure_mesh()
        .x_desc("step")
        .x_label_formatter(&|v| format!("{v:.0}"))
        .y_desc("loss")
        .y_label_formatter(&|v| format!("{v:.4}"))
        .draw()?;
    let reference: Vec<(f64, f64)> = r
        .steps
        .iter()
        .map(|s| (s.step as f64, s.reference))
        .collect();
    let distributed: Vec<(f64, f64)> = r.steps.iter().map(|s| (s.step as f64, s.loss)).collect();
    let grey = RGBColor(150, 150, 150);
    losses
        .draw_series(LineSeries::new(reference.clone(), grey.stroke_width(6)))?
        .label("reference (1 unsharded rank)")
        .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], grey.stroke_width(6)));
    let blue = RGBColor(31, 119, 180);
    losses
        .draw_series(LineSeries::new(distributed.clone(), blue.stroke_width(2)))?
        .label(format!("distributed (tp {} × dp {})", c.tp, c.dp))
        .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], blue.stroke_width(2)));
    losses.draw_series(
        distributed
            .iter()
            .map(|&p| Circle::new(p, 3, blue.filled())),
    )?;
    losses
        .configure_series_labels()
        .border_style(BLACK)
        .background_style(WHITE.mix(0.8))
        .draw()?;

    let diffs: Vec<(f64, f64)> = r
        .steps
        .iter()
        .map(|s| (s.step as f64, s.difference.abs().max(FLOOR)))
        .collect();
    let tol = r.tolerance_abs.max(FLOOR);
    let top_y = diffs
        .iter()
        .map(|d| d.1)
        .fold(tol, f64::max)
        .max(FLOOR * 10.0)
        * 10.0;
    let mut diff = ChartBuilder::on(&bottom)
        .margin(12)
        .caption(
            if r.max_abs_difference == 0.0 {
                "|distributed − reference|: 0 at every step, bit for bit (drawn at 1e-12)"
            } else {
                "|distributed − reference| (0 drawn at 1e-12)"
            },
            ("sans-serif", 16),
        )
        .x_label_area_size(32)
        .y_label_area_size(72)
        .build_cartesian_2d(x_range, (FLOOR / 2.0..top_y).log_scale())?;
    diff.configure_mesh()
        .x_desc("step")
        .x_label_formatter(&|v| format!("{v:.0}"))
        .y_desc("|difference|")
        .y_label_formatter(&|v| format!("{v:.0e}"))
        .draw()?;
    let red = RGBColor(214, 39, 40);
    if r.tolerance_abs > 0.0 {
        diff.draw_series(LineSeries::new(
            vec![(1.0, tol), (steps.max(2.0), tol)],
            red.stroke_width(2),
        ))?
        .label(format!("tolerance {:.2e}", r.tolerance_abs))
        .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], red.stroke_width(2)));
    }
    diff.draw_series(LineSeries::new(diffs.clone(), blue.stroke_width(2)))?
        .label("|difference|")
        .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], blue.stroke_width(2)));
    diff.draw_series(diffs.iter().map(|&p| Circle::new(p, 3, blue.filled())))?;
    diff.configure_series_labels()
        .border_style(BLACK)
        .background_style(WHITE.mix(0.8))
        .draw()?;
    root.present()?;
    Ok(())
}
