//! `--trace FILE`: the timelines of a run's traced device rounds as Chrome-trace / Perfetto
//! JSON (the "JSON object format": `traceEvents` with complete events, `ph: "X"`).
//!
//! One trace process per problem (token count), named by the row's settings; one track
//! (thread) per rank, named by its role; one complete event per phase of every timed round,
//! `ts` and `dur` in µs on the device timer, relative to the problem's earliest stamp (so the
//! rounds follow each other with the host's time between them), with the round's index in
//! `args`. `afdep report trace` draws the file.

use std::collections::BTreeMap;
use std::path::Path;

use afdep_core::Topology;
use afdep_moe::{RoundTrace, TracePhase};
use anyhow::Result;
use serde_json::{Value, json};

use super::rows::median;

/// The timelines of one problem: every rank's traced timed rounds, `[rank][round]`.
pub(super) struct Timeline {
    /// The trace process's name.
    pub(super) label: String,
    /// Each rank's role (`attention 0`, `ffn 1`, `attention 0 + ffn 0`).
    pub(super) roles: Vec<String>,
    pub(super) traces: Vec<Vec<RoundTrace>>,
}

/// The role of `rank` in `topo`, for a track's name.
pub(super) fn role_of(topo: &Topology, rank: usize) -> String {
    match (topo.attention_index(rank), topo.ffn_index(rank)) {
        (Some(s), Some(f)) => format!("attention {s} + ffn {f}"),
        (Some(s), None) => format!("attention {s}"),
        (None, Some(f)) => format!("ffn {f}"),
        (None, None) => "idle".into(),
    }
}

/// Per phase, the median over rounds of the slowest rank's span, µs (`[rank][round]` traces;
/// rounds that every rank traced).
pub(super) fn phase_medians(traces: &[Vec<RoundTrace>]) -> BTreeMap<String, f64> {
    let rounds = traces.iter().map(Vec::len).min().unwrap_or(0);
    let mut out = BTreeMap::new();
    for p in TracePhase::ALL {
        let per_round: Vec<f64> = (0..rounds)
            .filter_map(|i| {
                traces
                    .iter()
                    .flat_map(|t| t[i].spans.iter().filter(|s| s.phase == p))
                    .map(|s| s.us())
                    .reduce(f64::max)
            })
            .collect();
        if !per_round.is_empty() {
            out.insert(p.name().to_string(), median(per_round));
        }
    }
    out
}

/// The Chrome-trace JSON of `timelines`.
pub(super) fn to_json(timelines: &[Timeline]) -> Value {
    let mut ev = Vec::new();
    for (p, tl) in timelines.iter().enumerate() {
        let pid = p + 1;
        ev.push(json!({"name": "process_name", "ph": "M", "pid": pid, "args": {"name": tl.label}}));
        ev.push(json!({"name": "process_sort_index", "ph": "M", "pid": pid, "args": {"sort_index": pid}}));
        for (rank, role) in tl.roles.iter().enumerate() {
            ev.push(
                json!({"name": "thread_name", "ph": "M", "pid": pid, "tid": rank,
                           "args": {"name": format!("rank {rank} ({role})")}}),
            );
            ev.push(
                json!({"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": rank,
                           "args": {"sort_index": rank}}),
            );
        }
        let t0 = tl
            .traces
            .iter()
            .flatten()
            .filter_map(RoundTrace::start_ns)
            .min()
            .unwrap_or(0);
        for (rank, rounds) in tl.traces.iter().enumerate() {
            for (i, t) in rounds.iter().enumerate() {
                for s in &t.spans {
                    ev.push(json!({
                        "name": s.phase.name(),
                        "cat": "device",
                        "ph": "X",
                        "pid": pid,
                        "tid": rank,
                        "ts": (s.start_ns - t0) as f64 * 1e-3,
                        "dur": s.us(),
                        "args": {"round": i},
                    }));
                }
            }
        }
    }
    json!({
        "traceEvents": ev,
        "displayTimeUnit": "ns",
        "otherData": {
            "tool": "afdep exchange --trace",
            "clock": "%globaltimer of each rank's GPU (ranks of one GPU share it), µs from the problem's first stamp",
            "kernel_digest": afdep_kernels::source_digest(),
        },
    })
}

/// Writes `timelines` to `path` as Chrome-trace JSON.
pub(super) fn write(path: &Path, timelines: &[Timeline]) -> Result<()> {
    let text = serde_json::to_string(&to_json(timelines))?;
    std::fs::write(path, text)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use afdep_moe::round::trace::spans_of;

    fn two_ranks() -> Vec<Vec<RoundTrace>> {
        let src = [TracePhase::Begin, TracePhase::Rows, TracePhase::Combine];
        let ffn = [TracePhase::Begin, TracePhase::Epilogue, TracePhase::Experts];
        vec![
            vec![
                spans_of(0, &src, &[1000, 3000, 5000, 9000]),
                spans_of(0, &src, &[20_000, 21_000, 22_000, 30_000]),
            ],
            vec![
                spans_of(1, &ffn, &[1500, 2500, 6000, 7000]),
                spans_of(1, &ffn, &[20_500, 24_500, 25_000, 26_000]),
            ],
        ]
    }

    #[test]
    fn phase_medians_take_the_slowest_rank_per_round() {
        let m = phase_medians(&two_ranks());
        // begin: round 0 max(2.0, 1.0) = 2.0, round 1 max(1.0, 4.0) = 4.0; upper median 4.0
        assert_eq!(m["begin"], 4.0);
        assert_eq!(m["rows"], 2.0);
        assert_eq!(m["combine"], 8.0);
        assert_eq!(m["experts"], 1.0);
        assert!(!m.contains_key("plan"));
    }

    #[test]
    fn the_json_has_a_track_per_rank_and_an_event_per_span() {
        let topo: Topology = "1A:1F".parse().unwrap();
        let tl = Timeline {
            label: "test".into(),
            roles: (0..2).map(|r| role_of(&topo, r)).collect(),
            traces: two_ranks(),
        };
        let v = to_json(&[tl]);
        let ev = v["traceEvents"].as_array().unwrap();
        let x: Vec<&Value> = ev.iter().filter(|e| e["ph"] == "X").collect();
        assert_eq!(x.len(), 12);
        assert!(x.iter().all(|e| e["dur"].as_f64().unwrap() >= 0.0));
        let first = x
            .iter()
            .find(|e| e["tid"] == 0 && e["name"] == "begin")
            .unwrap();
        assert_eq!(first["ts"].as_f64(), Some(0.0));
        assert_eq!(first["dur"].as_f64(), Some(2.0));
        let names: Vec<&str> = ev
            .iter()
            .filter(|e| e["name"] == "thread_name")
            .map(|e| e["args"]["name"].as_str().unwrap())
            .collect();
        assert_eq!(names, ["rank 0 (attention 0)", "rank 1 (ffn 0)"]);
    }
}
