//! The chart of `afdep report moe`, forward and train step as two panels:
//! - rows of one shape: time per token count, log-log, one line per afdep strategy (solid,
//!   circles) and per peer (dashed, triangles);
//! - rows of several shapes (a suite): per cell (shape, tokens) a bar of the speed-up of afdep's
//!   best strategy over the best peer (best peer ms / afdep ms; a dashed line at 1), log scale.
//!
//! Drawn with plotters' bitmap backend; text through ab_glyph with DejaVu Sans embedded from
//! the `dejavu` crate, so no system font, fontconfig or freetype is needed.

use std::path::Path;
use std::sync::OnceLock;

use plotters::prelude::*;
use plotters::style::FontStyle;

use crate::report::{Cell, Comparison, Phase, ReportError, ratio};

/// Image size, pixels.
const SIZE: (u32, u32) = (1600, 700);
/// Image size of a suite's speed-up chart (panels stacked: room for 15 cells' labels).
const SUITE_SIZE: (u32, u32) = (2200, 1000);

/// Registers the embedded font (once): every chart of the crate calls it before drawing.
pub(crate) fn register_font() -> Result<(), String> {
    static DONE: OnceLock<Result<(), String>> = OnceLock::new();
    DONE.get_or_init(|| {
        plotters::style::register_font("sans-serif", FontStyle::Normal, dejavu::sans::regular())
            .map_err(|_| "the embedded DejaVu Sans font does not parse".to_string())
    })
    .clone()
}

/// `16k`, `128k`, `1M` for powers of two, else the number.
fn tokens_label(v: f64) -> String {
    let t = v.round();
    if t >= 1_048_576.0 && (t / 1_048_576.0).fract() == 0.0 {
        format!("{}M", t / 1_048_576.0)
    } else if t >= 1024.0 && (t / 1024.0).fract() == 0.0 {
        format!("{}k", t / 1024.0)
    } else {
        format!("{t}")
    }
}

fn ms_label(v: f64) -> String {
    if v >= 10.0 {
        format!("{v:.0}")
    } else if v >= 1.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.2}")
    }
}

/// One line of the chart.
struct Series {
    name: String,
    points: Vec<(f64, f64)>,
    peer: bool,
}

fn series(c: &Comparison, phase: Phase) -> Vec<Series> {
    let mut out = Vec::new();
    for s in &c.strategies {
        let points = c
            .cells
            .iter()
            .filter_map(|cell| {
                let r = c.afdep(s, cell)?;
                Some((cell.tokens as f64, phase.ms(r)?))
            })
            .collect();
        out.push(Series {
            name: format!("afdep {s}"),
            points,
            peer: false,
        });
    }
    for p in &c.peers {
        let points = c
            .cells
            .iter()
            .filter_map(|cell| {
                let r = c.peer(p, cell)?;
                Some((cell.tokens as f64, phase.ms(r)?))
            })
            .collect();
        out.push(Series {
            name: p.clone(),
            points,
            peer: true,
        });
    }
    out
}

const AFDEP_COLORS: [RGBColor; 4] = [
    RGBColor(31, 119, 180),
    RGBColor(44, 160, 44),
    RGBColor(148, 103, 189),
    RGBColor(23, 190, 207),
];
const PEER_COLORS: [RGBColor; 4] = [
    RGBColor(214, 39, 40),
    RGBColor(255, 127, 14),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
];

fn chart_err(path: &Path) -> impl Fn(String) -> ReportError + '_ {
    move |why| ReportError::Chart {
        path: path.to_path_buf(),
        why,
    }
}

/// `record 16k`: a cell's label under its bar.
fn cell_label(cell: &Cell) -> String {
    format!("{} {}", cell.shape, tokens_label(cell.tokens as f64))
}

/// The speed-up bars of a suite: (cell index, best peer ms / afdep best ms).
fn speedups(c: &Comparison, phase: Phase) -> Vec<(usize, f64)> {
    c.cells
        .iter()
        .enumerate()
        .filter_map(|(i, cell)| {
            let a = c.best(phase, cell).map(|b| b.1);
            let p = c.best_peer(phase, cell).map(|b| b.1);
            Some((i, ratio(p, a)?))
        })
        .collect()
}

fn draw_speedups(path: &Path, c: &Comparison, title: &str) -> Result<(), ReportError> {
    let err = chart_err(path);
    let e = |x: &dyn std::fmt::Display| err(x.to_string());
    let root = BitMapBackend::new(path, SUITE_SIZE).into_drawing_area();
    root.fill(&WHITE).map_err(|x| e(&x))?;
    let root = root.titled(title, ("sans-serif", 22)).map_err(|x| e(&x))?;
    let panels = root.split_evenly((2, 1));
    let n = c.cells.len();
    for (area, phase) in panels.iter().zip(Phase::BOTH) {
        let bars = speedups(c, phase);
        let (lo, hi) = bars
            .iter()
            .fold((1.0f64, 1.0f64), |(a, b), &(_, v)| (a.min(v), b.max(v)));
        let mut chart = ChartBuilder::on(area)
            .caption(
                format!("{}: best peer ms / afdep ms", phase.title()),
                ("sans-serif", 20),
            )
            .margin(16)
            .x_label_area_size(40)
            .y_label_area_size(64)
            .build_cartesian_2d(-0.5f64..n as f64 - 0.5, (lo / 1.5..hi * 1.5).log_scale())
            .map_err(|x| e(&x))?;
        let labels: Vec<String> = c.cells.iter().map(cell_label).collect();
        chart
            .configure_mesh()
            .disable_x_mesh()
            .x_labels(n.max(1))
            .x_label_formatter(&|v| {
                let i = v.round();
                if (v - i).abs() < 1e-6 && i >= 0.0 && (i as usize) < labels.len() {
                    labels[i as usize].clone()
                } else {
                    String::new()
                }
            })
            .x_label_style(("sans-serif", 12))
            .y_desc("speed-up (×)")
            .y_label_formatter(&|v| format!("{v:.2}"))
            .label_style(("sans-serif", 14))
            .draw()
            .map_err(|x| e(&x))?;
        chart
            .draw_series(bars.iter().map(|&(i, v)| {
                let color = if v >= 1.0 {
                    AFDEP_COLORS[1]
                } else {
                    PEER_COLORS[0]
                };
                Rectangle::new(
                    [(i as f64 - 0.35, lo / 1.5), (i as f64 + 0.35, v)],
                    color.filled(),
                )
            }))
            .map_err(|x| e(&x))?;
        // the value on each bar; a cell without a ratio (no ok row on one side) says so
        chart
            .draw_series((0..n).map(|i| {
                let (text, y) = match bars.iter().find(|b| b.0 == i) {
                    Some(&(_, v)) => (format!("{v:.2}×"), v),
                    None => ("no ratio".to_string(), 1.0),
                };
                Text::new(text, (i as f64 - 0.3, y), ("sans-serif", 13))
            }))
            .map_err(|x| e(&x))?;
        chart
            .draw_series(DashedLineSeries::new(
                vec![(-0.5, 1.0), (n as f64 - 0.5, 1.0)],
                8,
                5,
                BLACK.stroke_width(1),
            ))
            .map_err(|x| e(&x))?;
    }
    root.present().map_err(|x| e(&x))?;
    Ok(())
}

/// Draws the chart of `c` into `path` (PNG) with `title` above both panels: the times per
/// token count for one shape, the speed-ups per cell for several.
pub fn draw(path: &Path, c: &Comparison, title: &str) -> Result<(), ReportError> {
    let err = chart_err(path);
    register_font().map_err(&err)?;
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(|source| ReportError::Write {
            path: path.to_path_buf(),
            source,
        })?;
    }
    if c.many_shapes() {
        return draw_speedups(path, c, title);
    }
    draw_times(path, c, title)
}

fn draw_times(path: &Path, c: &Comparison, title: &str) -> Result<(), ReportError> {
    let err = chart_err(path);
    let e = |x: &dyn std::fmt::Display| err(x.to_string());
    let root = BitMapBackend::new(path, SIZE).into_drawing_area();
    root.fill(&WHITE).map_err(|x| e(&x))?;
    let root = root.titled(title, ("sans-serif", 22)).map_err(|x| e(&x))?;
    let panels = root.split_evenly((1, 2));
    for (area, phase) in panels.iter().zip(Phase::BOTH) {
        let lines = series(c, phase);
        let ys: Vec<f64> = lines
            .iter()
            .flat_map(|s| s.points.iter().map(|p| p.1))
            .filter(|v| *v > 0.0)
            .collect();
        let (lo, hi) = ys
            .iter()
            .fold((f64::INFINITY, 0f64), |(a, b), &v| (a.min(v), b.max(v)));
        let (lo, hi) = if ys.is_empty() {
            (0.1, 10.0)
        } else {
            (lo / 2.0, hi * 2.0)
        };
        let tokens: Vec<f64> = c.cells.iter().map(|x| x.tokens as f64).collect();
        let tmin = tokens
            .iter()
            .copied()
            .fold(f64::INFINITY, f64::min)
            .min(1e12);
        let tmax = tokens.iter().copied().fold(1.0, f64::max);
        let tmin = if tmin.is_finite() { tmin } else { 1.0 };
        let mut chart = ChartBuilder::on(area)
            .caption(format!("{} (median ms)", phase.title()), ("sans-serif", 20))
            .margin(16)
            .x_label_area_size(44)
            .y_label_area_size(64)
            .build_cartesian_2d(
                (tmin / 1.5..tmax * 1.5)
                    .log_scale()
                    .with_key_points(tokens.clone()),
                (lo..hi).log_scale(),
            )
            .map_err(|x| e(&x))?;
        chart
            .configure_mesh()
            .x_desc("tokens")
            .y_desc("ms")
            .x_label_formatter(&|v| tokens_label(*v))
            .y_label_formatter(&|v| ms_label(*v))
            .label_style(("sans-serif", 14))
            .draw()
            .map_err(|x| e(&x))?;
        let (mut ai, mut pi) = (0, 0);
        for s in &lines {
            let color = if s.peer {
                pi += 1;
                PEER_COLORS[(pi - 1) % PEER_COLORS.len()]
            } else {
                ai += 1;
                AFDEP_COLORS[(ai - 1) % AFDEP_COLORS.len()]
            };
            let style = color.stroke_width(2);
            if s.points.is_empty() {
                continue;
            }
            let anno = if s.peer {
                chart
                    .draw_series(DashedLineSeries::new(s.points.clone(), 8, 5, style))
                    .map_err(|x| e(&x))?
            } else {
                chart
                    .draw_series(LineSeries::new(s.points.clone(), style))
                    .map_err(|x| e(&x))?
            };
            anno.label(s.name.clone()).legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 24, y)], color.stroke_width(2))
            });
            if s.peer {
                chart
                    .draw_series(
                        s.points
                            .iter()
                            .map(|&p| TriangleMarker::new(p, 6, color.filled())),
                    )
                    .map_err(|x| e(&x))?;
            } else {
                chart
                    .draw_series(s.points.iter().map(|&p| Circle::new(p, 4, color.filled())))
                    .map_err(|x| e(&x))?;
            }
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .label_font(("sans-serif", 14))
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .draw()
            .map_err(|x| e(&x))?;
    }
    root.present().map_err(|x| e(&x))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::parse_rows;

    #[test]
    fn labels() {
        assert_eq!(tokens_label(16384.0), "16k");
        assert_eq!(tokens_label(1_048_576.0), "1M");
        assert_eq!(tokens_label(1000.0), "1000");
        assert_eq!(ms_label(0.938), "0.94");
        assert_eq!(ms_label(161.8), "162");
    }

    #[test]
    fn draws_a_png_without_system_fonts() {
        let text = [
            r#"{"tokens":16384,"impl":"afdep","dispatch":"sorted","fwd_ms":1.0,"train_ms":2.9,"status":"ok"}"#,
            r#"{"tokens":131072,"impl":"afdep","dispatch":"sorted","fwd_ms":7.2,"train_ms":20.6,"status":"ok"}"#,
            r#"{"tokens":131072,"impl":"afdep","dispatch":"fused","status":"oom"}"#,
            r#"{"tokens":16384,"impl":"torch_grouped_mm","dispatch":"sorted","fwd_ms":1.6,"train_ms":3.6,"status":"ok"}"#,
        ]
        .join("\n");
        let (rows, _) = parse_rows(&text);
        let c = Comparison::new(rows, 0);
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("sub").join("moe.png");
        draw(&p, &c, "test").unwrap();
        let bytes = std::fs::read(&p).unwrap();
        assert_eq!(&bytes[1..4], b"PNG");
    }
}
