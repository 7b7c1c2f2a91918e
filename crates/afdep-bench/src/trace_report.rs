//! `afdep report trace`: a PNG timeline of one round from a Chrome-trace file written by
//! `afdep exchange --trace`, and the round's phases as text.
//!
//! Every trace process (one token count of the run) becomes a panel; every track (rank) a
//! lane; every phase of the chosen round a bar on the device-time axis, in µs from the round's
//! first stamp on any rank, coloured by phase.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use plotters::prelude::*;
use serde_json::Value;

/// `afdep report trace`.
#[derive(clap::Args, Debug)]
pub struct ReportTraceArgs {
    /// The trace file (`afdep exchange --trace FILE`).
    #[arg(long)]
    pub trace: PathBuf,
    /// The PNG to write.
    #[arg(long)]
    pub png: PathBuf,
    /// The round to draw, by index among each token count's timed rounds [default: the last].
    #[arg(long)]
    pub round: Option<usize>,
}

/// One phase bar.
#[derive(Debug, Clone, PartialEq)]
struct Bar {
    rank: usize,
    phase: String,
    ts: f64,
    dur: f64,
}

/// One panel: a trace process's name, its track names and the bars of the chosen round.
#[derive(Debug, Default)]
struct Panel {
    name: String,
    tracks: BTreeMap<usize, String>,
    bars: Vec<Bar>,
}

/// The panels of `v` (Chrome-trace JSON) for `round` (`None`: each process's last).
fn panels(v: &Value, round: Option<usize>) -> Result<Vec<Panel>> {
    let ev = v["traceEvents"]
        .as_array()
        .context("not a Chrome-trace file: no traceEvents array")?;
    let mut by_pid: BTreeMap<u64, Panel> = BTreeMap::new();
    let mut rounds: BTreeMap<u64, Vec<(usize, Bar)>> = BTreeMap::new();
    for e in ev {
        let pid = e["pid"].as_u64().unwrap_or(0);
        let p = by_pid.entry(pid).or_default();
        match (e["ph"].as_str(), e["name"].as_str()) {
            (Some("M"), Some("process_name")) => {
                p.name = e["args"]["name"].as_str().unwrap_or("").to_string();
            }
            (Some("M"), Some("thread_name")) => {
                let tid = e["tid"].as_u64().context("a thread_name without tid")? as usize;
                p.tracks
                    .insert(tid, e["args"]["name"].as_str().unwrap_or("").to_string());
            }
            (Some("X"), Some(name)) => {
                let bar = Bar {
                    rank: e["tid"].as_u64().context("an event without tid")? as usize,
                    phase: name.to_string(),
                    ts: e["ts"].as_f64().context("an event without ts")?,
                    dur: e["dur"].as_f64().context("an event without dur")?,
                };
                let r = e["args"]["round"].as_u64().unwrap_or(0) as usize;
                rounds.entry(pid).or_default().push((r, bar));
            }
            _ => {}
        }
    }
    let mut out = Vec::new();
    for (pid, mut p) in by_pid {
        let bars = rounds.remove(&pid).unwrap_or_default();
        let Some(last) = bars.iter().map(|(r, _)| *r).max() else {
            continue;
        };
        let want = round.unwrap_or(last);
        if want > last {
            bail!(
                "{}: round {want} asked, the trace has rounds 0..={last}",
                p.name
            );
        }
        let mut chosen: Vec<Bar> = bars
            .into_iter()
            .filter(|(r, _)| *r == want)
            .map(|(_, b)| b)
            .collect();
        let t0 = chosen.iter().map(|b| b.ts).fold(f64::INFINITY, f64::min);
        for b in &mut chosen {
            b.ts -= t0;
        }
        p.name = format!("{} — round {want}", p.name);
        p.bars = chosen;
        out.push(p);
    }
    if out.is_empty() {
        bail!("the trace holds no phase events");
    }
    Ok(out)
}

/// A fixed colour per phase name (the round's order), grey for others.
fn colour(phase: &str) -> RGBColor {
    match phase {
        "payload_check" => RGBColor(140, 140, 140),
        "begin" => RGBColor(31, 119, 180),
        "counts" => RGBColor(255, 127, 14),
        "plan" => RGBColor(148, 103, 189),
        "rows" => RGBColor(44, 160, 44),
        "epilogue" => RGBColor(214, 39, 40),
        "experts" => RGBColor(140, 86, 75),
        "combine" => RGBColor(23, 190, 207),
        _ => RGBColor(200, 200, 200),
    }
}

fn draw(path: &Path, panels: &[Panel]) -> Result<()> {
    crate::report_png::register_font().map_err(|e| anyhow::anyhow!(e))?;
    let h = 120
        + 60 * panels
            .iter()
            .map(|p| p.tracks.len().max(1) + 1)
            .sum::<usize>() as u32;
    let root = BitMapBackend::new(path, (1600, h)).into_drawing_area();
    root.fill(&WHITE)?;
    let heights: Vec<u32> = panels
        .iter()
        .map(|p| 60 * (p.tracks.len().max(1) as u32 + 1) + 40)
        .collect();
    let mut area = root.clone();
    for (p, hh) in panels.iter().zip(heights) {
        let (top, rest) = area.split_vertically(hh);
        area = rest;
        let lanes = p.tracks.len().max(1);
        let end = p
            .bars
            .iter()
            .map(|b| b.ts + b.dur)
            .fold(0.0f64, f64::max)
            .max(1.0);
        let mut chart = ChartBuilder::on(&top)
            .caption(&p.name, ("sans-serif", 20))
            .margin(10)
            .x_label_area_size(30)
            .y_label_area_size(220)
            .build_cartesian_2d(0.0..end * 1.02, -0.5..lanes as f64 - 0.5)?;
        let tracks = p.tracks.clone();
        chart
            .configure_mesh()
            .x_desc("µs from the round's first stamp (device timer)")
            .y_labels(lanes)
            .y_label_formatter(&|y| {
                let r = y.round();
                if (y - r).abs() > 1e-6 || r < 0.0 {
                    return String::new();
                }
                tracks.get(&(r as usize)).cloned().unwrap_or_default()
            })
            .disable_y_mesh()
            .draw()?;
        let mut seen = std::collections::BTreeSet::new();
        for b in &p.bars {
            let c = colour(&b.phase);
            let y = b.rank as f64;
            let rect = Rectangle::new([(b.ts, y - 0.35), (b.ts + b.dur, y + 0.35)], c.filled());
            let series = chart.draw_series(std::iter::once(rect))?;
            if seen.insert(b.phase.clone()) {
                series.label(b.phase.clone()).legend(move |(x, y)| {
                    Rectangle::new([(x, y - 5), (x + 15, y + 5)], c.filled())
                });
            }
        }
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .position(SeriesLabelPosition::LowerRight)
            .draw()?;
    }
    root.present()?;
    Ok(())
}

/// `afdep report trace`: prints the chosen round's phases per rank and writes the PNG.
pub fn run(a: ReportTraceArgs) -> Result<()> {
    let text = std::fs::read_to_string(&a.trace)
        .with_context(|| format!("reading {}", a.trace.display()))?;
    let v: Value =
        serde_json::from_str(&text).with_context(|| format!("{}: not JSON", a.trace.display()))?;
    let ps = panels(&v, a.round)?;
    for p in &ps {
        println!("{}", p.name);
        for (rank, name) in &p.tracks {
            let phases: Vec<String> = p
                .bars
                .iter()
                .filter(|b| b.rank == *rank)
                .map(|b| format!("{} {:.1}", b.phase, b.dur))
                .collect();
            println!("  {name}: {} (µs)", phases.join(", "));
        }
    }
    draw(&a.png, &ps).with_context(|| format!("drawing {}", a.png.display()))?;
    eprintln!("wrote {}", a.png.display());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn sample() -> Value {
        json!({"traceEvents": [
            {"name": "process_name", "ph": "M", "pid": 1, "args": {"name": "1A:1F graph"}},
            {"name": "thread_name", "ph": "M", "pid": 1, "tid": 0, "args": {"name": "rank 0 (attention 0)"}},
            {"name": "thread_name", "ph": "M", "pid": 1, "tid": 1, "args": {"name": "rank 1 (ffn 0)"}},
            {"name": "begin", "ph": "X", "pid": 1, "tid": 0, "ts": 0.0, "dur": 2.0, "args": {"round": 0}},
            {"name": "begin", "ph": "X", "pid": 1, "tid": 1, "ts": 0.5, "dur": 1.0, "args": {"round": 0}},
            {"name": "begin", "ph": "X", "pid": 1, "tid": 0, "ts": 19.0, "dur": 1.0, "args": {"round": 1}},
            {"name": "rows", "ph": "X", "pid": 1, "tid": 0, "ts": 20.0, "dur": 3.0, "args": {"round": 1}},
            {"name": "epilogue", "ph": "X", "pid": 1, "tid": 1, "ts": 21.0, "dur": 4.0, "args": {"round": 1}}
        ]})
    }

    #[test]
    fn the_last_round_by_default_from_its_first_stamp() {
        let ps = panels(&sample(), None).unwrap();
        assert_eq!(ps.len(), 1);
        assert_eq!(ps[0].tracks.len(), 2);
        assert_eq!(ps[0].bars.len(), 3);
        assert_eq!(ps[0].bars[0].ts, 0.0);
        assert_eq!(ps[0].bars[2].ts, 2.0);
        let r0 = panels(&sample(), Some(0)).unwrap();
        assert_eq!(r0[0].bars.len(), 2);
        assert!(panels(&sample(), Some(2)).is_err());
        assert!(panels(&json!({"x": 1}), None).is_err());
    }

    #[test]
    fn a_png_is_drawn() {
        let dir = std::env::temp_dir().join(format!("afdep-trace-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("t.json");
        std::fs::write(&f, sample().to_string()).unwrap();
        let png = dir.join("t.png");
        run(ReportTraceArgs {
            trace: f,
            png: png.clone(),
            round: None,
        })
        .unwrap();
        let bytes = std::fs::read(&png).unwrap();
        assert!(bytes.starts_with(b"\x89PNG"));
        std::fs::remove_dir_all(&dir).ok();
    }
}
