//! The showcase's chart: median ns/op per workload, one bar per
//! implementation, grouped by workload, on a log scale (the workloads span
//! two orders of magnitude), written as SVG with plotters.
//!
//! A thin line on each bar spans the fastest to the slowest repetition.

use std::path::Path;

use plotters::prelude::*;

use crate::bench::{Results, CONTENDERS, WORKLOADS};
use crate::verdict;

/// One colour per contender, in `CONTENDERS` order: keylock stands out, the
/// options are its lighter shades, the anchors are greys and muted hues.
const COLOURS: [RGBColor; 8] = [
    RGBColor(0xD9, 0x48, 0x01), // keylock
    RGBColor(0x4C, 0x72, 0xB0), // dashmap-leak
    RGBColor(0x55, 0xA8, 0x68), // dashmap-cleanup
    RGBColor(0x81, 0x72, 0xB2), // lockable
    RGBColor(0x93, 0x93, 0x93), // tokio::Mutex
    RGBColor(0x5A, 0x5A, 0x5A), // async_lock::Mutex
    RGBColor(0xF4, 0xA5, 0x82), // keylock+lease
    RGBColor(0xFD, 0xD0, 0xA2), // keylock+timeout
];

const WIDTH: u32 = 1100;
const HEIGHT: u32 = 560;

/// Writes the chart of `results` to `path`.
pub(crate) fn write(results: &Results, path: &Path) -> Result<(), Box<dyn std::error::Error>> {
    assert_eq!(COLOURS.len(), CONTENDERS.len());
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)?;
    }
    // (median, min, max) per [workload][contender].
    let bars: Vec<Vec<Option<(f64, f64, f64)>>> = results
        .ns
        .iter()
        .map(|per_contender| {
            per_contender
                .iter()
                .map(|ns| {
                    let median = verdict::median(&mut ns.clone())?;
                    let (min, max) = verdict::range(ns)?;
                    Some((median, min, max))
                })
                .collect()
        })
        .collect();
    let all = bars.iter().flatten().flatten();
    let lo = all.clone().map(|b| b.1).fold(f64::INFINITY, f64::min);
    let hi = all.map(|b| b.2).fold(0.0, f64::max);
    // Whole decades around the data.
    let (y_lo, y_hi) = (
        10f64.powf(lo.max(1e-3).log10().floor()),
        10f64.powf(hi.max(1e-3).log10().ceil()),
    );

    let root = SVGBackend::new(path, (WIDTH, HEIGHT)).into_drawing_area();
    root.fill(&WHITE)?;
    let caption = format!(
        "keylock and hand-written keyed locks: median ns/op of {} reps{} (lower is better; \
         thin lines: fastest to slowest rep)",
        results.reps,
        if results.quick { ", --quick" } else { "" }
    );
    let groups = WORKLOADS.len() as f64;
    let mut chart = ChartBuilder::on(&root)
        .caption(caption, ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(64)
        .build_cartesian_2d(0f64..groups, (y_lo..y_hi).log_scale())?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .disable_x_axis()
        .y_desc("ns/op (log scale)")
        .y_label_formatter(&|y| format!("{y:.0}"))
        .draw()?;

    // Each workload takes one unit of x: bars side by side in its middle 80%.
    let n = CONTENDERS.len() as f64;
    let width = 0.8 / n;
    for (ci, c) in CONTENDERS.iter().enumerate() {
        let colour = COLOURS[ci];
        let x0 = |wi: usize| wi as f64 + 0.1 + ci as f64 * width;
        chart
            .draw_series(bars.iter().enumerate().filter_map(|(wi, b)| {
                let (median, _, _) = b[ci]?;
                Some(Rectangle::new(
                    [(x0(wi), y_lo), (x0(wi) + width * 0.9, median)],
                    colour.filled(),
                ))
            }))?
            .label(c.name)
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 12, y + 5)], colour.filled()));
        chart.draw_series(bars.iter().enumerate().filter_map(|(wi, b)| {
            let (_, min, max) = b[ci]?;
            let mid = x0(wi) + width * 0.45;
            Some(PathElement::new(
                vec![(mid, min), (mid, max)],
                BLACK.stroke_width(1),
            ))
        }))?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK.mix(0.3))
        .label_font(("sans-serif", 13))
        .draw()?;

    // Workload names under each group, in pixels below the plotting area.
    let label = ("sans-serif", 14).into_font().color(&BLACK);
    for (wi, w) in WORKLOADS.iter().enumerate() {
        let (x, y) = chart.backend_coord(&(wi as f64 + 0.5, y_lo));
        let text = format!("{}: {}", w.id(), short(*w));
        let centred = x - (text.len() as i32 * 7) / 2;
        root.draw(&Text::new(text, (centred, y + 10), label.clone()))?;
    }
    root.present()?;
    Ok(())
}

/// A few words per workload, for the chart's axis.
fn short(w: crate::workloads::Workload) -> &'static str {
    use crate::workloads::Workload::*;
    match w {
        W1 => "one key, uncontended",
        W2 => "distinct keys",
        W3 => "64 tasks, handoff",
        W4 => "64 tasks, Zipf keys",
        W5 => "cancellation storm",
        W6 => "64 tasks, counter",
    }
}
