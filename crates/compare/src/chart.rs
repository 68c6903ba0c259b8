//! The comparison chart: events/s against clients (left) and p99 latency
//! against clients (right), one line per system, drawn with plotters'
//! bitmap backend and a TrueType font read from disk (ab_glyph, so no
//! fontconfig is needed).

use std::path::{Path, PathBuf};

use anyhow::{anyhow, Context};
use plotters::prelude::*;
use plotters::style::FontStyle;

use crate::results::{latest, Point};

/// Fonts tried when none is given (Debian's fonts-dejavu-core first).
pub const FONT_CANDIDATES: &[&str] = &[
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
];

fn load_font(font: Option<&Path>) -> anyhow::Result<()> {
    let path: PathBuf = match font {
        Some(p) => p.to_path_buf(),
        None => FONT_CANDIDATES
            .iter()
            .map(PathBuf::from)
            .find(|p| p.exists())
            .ok_or_else(|| {
                anyhow!(
                    "no TrueType font found (tried {FONT_CANDIDATES:?}); install fonts-dejavu-core or pass --font"
                )
            })?,
    };
    let bytes = std::fs::read(&path).with_context(|| format!("reading font {}", path.display()))?;
    let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
    plotters::style::register_font("sans-serif", FontStyle::Normal, bytes)
        .map_err(|_| anyhow!("{} is not a usable TrueType font", path.display()))?;
    Ok(())
}

/// Line colours (forkless itself is always black, forkless through a peer grey), picked for contrast on white.
const PALETTE: [RGBColor; 7] = [
    RGBColor(228, 26, 28),
    RGBColor(55, 126, 184),
    RGBColor(77, 175, 74),
    RGBColor(255, 127, 0),
    RGBColor(152, 78, 163),
    RGBColor(166, 86, 40),
    RGBColor(0, 160, 160),
];

/// One system's line with its points: solid and thick when durable, dashed
/// and thin when not.
fn draw_line<DB, CT>(
    chart: &mut ChartContext<'_, DB, CT>,
    xy: Vec<(f64, f64)>,
    label: &str,
    c: RGBAColor,
    durable: bool,
) -> anyhow::Result<()>
where
    DB: DrawingBackend,
    CT: CoordTranslate<From = (f64, f64)>,
{
    let anno = if durable {
        chart.draw_series(LineSeries::new(xy.clone(), c.stroke_width(3)))
    } else {
        chart.draw_series(DashedLineSeries::new(xy.clone(), 8, 6, c.stroke_width(2)))
    }
    .map_err(|e| anyhow!("{e}"))?;
    anno.label(label).legend(move |(x, y)| {
        PathElement::new(
            vec![(x, y), (x + 24, y)],
            c.stroke_width(if durable { 3 } else { 1 }),
        )
    });
    chart
        .draw_series(xy.iter().map(|p| Circle::new(*p, 4, c.filled())))
        .map_err(|e| anyhow!("{e}"))?;
    Ok(())
}

/// One line per system, at x = log2(clients), y = `value` (points where it
/// is `None` left out), and the legend.
fn draw_systems<'a, DB, CT>(
    chart: &mut ChartContext<'a, DB, CT>,
    series: &[(String, Vec<Point>)],
    color: &impl Fn(usize, &str) -> RGBAColor,
    value: impl Fn(&Point) -> Option<f64>,
) -> anyhow::Result<()>
where
    DB: DrawingBackend + 'a,
    CT: CoordTranslate<From = (f64, f64)>,
{
    for (i, (label, pts)) in series.iter().enumerate() {
        let xy: Vec<(f64, f64)> = pts
            .iter()
            .filter_map(|p| Some(((p.report.clients as f64).log2(), value(p)?)))
            .collect();
        draw_line(
            chart,
            xy,
            label,
            color(i, label),
            pts.iter().all(|p| p.durable),
        )?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .label_font(("sans-serif", 14))
        .draw()
        .map_err(|e| anyhow!("{e}"))?;
    Ok(())
}

/// Draws the chart of `points` into the PNG at `out`.
pub fn draw(points: &[Point], out: &Path, title: &str, font: Option<&Path>) -> anyhow::Result<()> {
    load_font(font)?;
    let series = latest(points);
    if series.is_empty() {
        return Err(anyhow!("no points to chart"));
    }
    let max_clients = series
        .iter()
        .flat_map(|(_, p)| p.iter().map(|p| p.report.clients))
        .max()
        .unwrap_or(1)
        .max(2);
    let x_max = (max_clients as f64).log2().ceil() + 0.3;
    let max_rate = series
        .iter()
        .flat_map(|(_, p)| p.iter().map(|p| p.report.events_per_s))
        .fold(1.0, f64::max);
    let p99s: Vec<f64> = series
        .iter()
        .flat_map(|(_, p)| p.iter().map(|p| p.report.p99_ms))
        .filter(|v| *v > 0.0)
        .collect();
    let p99_max = p99s.iter().copied().fold(1.0, f64::max) * 1.6;
    let p99_min = p99s.iter().copied().fold(f64::INFINITY, f64::min).min(1.0) / 1.6;

    let root = BitMapBackend::new(out, (1500, 680)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| anyhow!("{e}"))?;
    let root = root
        .titled(title, ("sans-serif", 24))
        .map_err(|e| anyhow!("{e}"))?;
    let (left, right) = root.split_horizontally(750);
    let x_fmt = |x: &f64| format!("{}", 2f64.powf(*x).round());
    let color = |i: usize, label: &str| {
        if label.starts_with("forkless via") {
            return RGBColor(120, 120, 120).to_rgba();
        }
        if label.starts_with("forkless (3 nodes") {
            // The replicated forkless beside the one-node line: the same
            // system, told apart at a glance.
            return RGBColor(200, 20, 20).to_rgba();
        }
        if label.starts_with("forkless") {
            return BLACK.to_rgba();
        }
        PALETTE[i % PALETTE.len()].to_rgba()
    };

    // Left: throughput.
    let mut chart = ChartBuilder::on(&left)
        .caption(
            "acknowledged durable appends per second",
            ("sans-serif", 18),
        )
        .margin(15)
        .x_label_area_size(45)
        .y_label_area_size(80)
        .build_cartesian_2d(-0.3f64..x_max, 0f64..max_rate * 1.1)
        .map_err(|e| anyhow!("{e}"))?;
    chart
        .configure_mesh()
        .x_desc("concurrent clients (log scale)")
        .y_desc("events/s")
        .x_labels(8)
        .x_label_formatter(&x_fmt)
        .y_label_formatter(&|y| format!("{:.0}", y))
        .label_style(("sans-serif", 14))
        .draw()
        .map_err(|e| anyhow!("{e}"))?;
    draw_systems(&mut chart, &series, &color, |p| Some(p.report.events_per_s))?;

    // Right: p99 latency, log scale.
    let mut chart = ChartBuilder::on(&right)
        .caption("p99 latency per append (ms, log scale)", ("sans-serif", 18))
        .margin(15)
        .x_label_area_size(45)
        .y_label_area_size(70)
        .build_cartesian_2d(-0.3f64..x_max, (p99_min..p99_max).log_scale())
        .map_err(|e| anyhow!("{e}"))?;
    chart
        .configure_mesh()
        .x_desc("concurrent clients (log scale)")
        .y_desc("p99 ms")
        .x_labels(8)
        .y_labels(12)
        .light_line_style(TRANSPARENT)
        .x_label_formatter(&x_fmt)
        .y_label_formatter(&|y| {
            if *y < 1.0 {
                format!("{y:.2}")
            } else {
                format!("{y:.0}")
            }
        })
        .label_style(("sans-serif", 14))
        .draw()
        .map_err(|e| anyhow!("{e}"))?;
    // A latency of 0 (no answer measured) has no place on a log scale.
    draw_systems(&mut chart, &series, &color, |p| {
        (p.report.p99_ms > 0.0).then_some(p.report.p99_ms)
    })?;

    root.present().map_err(|e| anyhow!("{e}"))?;
    Ok(())
}
