//! Traced device rounds of the fused engine (`FusedEngine::set_trace`), in-process NvlinkIpc
//! ranks on GPU 0: eager device rounds and graph replays of every arm on 3A:1F, 2A:2F and EP1.
//!
//! - Tracing changes no result: every traced round is bit-identical to the oracle.
//! - Every rank's timeline has exactly the phases its role launches, in round order, with
//!   increasing stamps; replays of a graph captured with tracing on have timelines, replays of
//!   one captured without have none.
//! - The timelines obey the protocol's causality on the one device timer all ranks share: an
//!   FFN rank's epilogue (which waits for every source's rows) ends after every source's rows
//!   began, and a source's combine (which waits for every FFN rank's partial sums) ends after
//!   every FFN rank's experts began.
//!
//! Without a GPU the tests print `SKIP` and pass (`AFDEP_REQUIRE_GPU=1` fails them).

mod exchange_common;

use std::time::Duration;

use afdep_core::oracle::exchange::SourceInput;
use afdep_core::{ExchangeConfig, PayloadKind};
use afdep_moe::{DispatchArm, RoundArm, RoundTrace, TracePhase};
use exchange_common::*;

const ARMS: [DispatchArm; 3] = [
    DispatchArm::PayloadFirst,
    DispatchArm::CountFirst,
    DispatchArm::CountFirstSource,
];

/// What one rank got from one run: the round's result and its timeline.
type Traced = (RankResult, Option<RoundTrace>);

/// Runs each round of `rounds` as, in order: an eager traced device round of every arm, a
/// replay of a graph of every arm captured with tracing on, and a replay of one graph captured
/// with tracing off (payload-first). Returns `[round][run][rank]`.
fn traced_runs(c: &ExchangeConfig, rounds: &[Vec<SourceInput>]) -> Option<Vec<Vec<Vec<Traced>>>> {
    let world = c.topology.world_size();
    let g = fused_group(world, c, 16 << 20, Duration::from_secs(20))?;
    let (per_rank, keep): (Vec<Vec<Vec<Traced>>>, _) = on_fused_ranks(g, c, true, |rank, eng| {
        let untraced = eng.capture(DispatchArm::PayloadFirst).expect("capture");
        eng.set_trace(true).expect("tracing");
        let graphs: Vec<_> = ARMS
            .iter()
            .map(|&a| eng.capture(a).expect("capture"))
            .collect();
        let mut out = Vec::new();
        for inp in rounds {
            let mine = c.topology.attention_index(rank).map(|s| &inp[s]);
            let mut runs = Vec::new();
            for &a in &ARMS {
                let r = eng.device_round(RoundArm::Fixed(a), mine);
                runs.push((r, eng.last_trace().cloned()));
            }
            for gr in &graphs {
                let r = eng.replay(gr, mine);
                runs.push((r, eng.last_trace().cloned()));
            }
            let r = eng.replay(&untraced, mine);
            runs.push((r, eng.last_trace().cloned()));
            out.push(runs);
        }
        (out, (graphs, untraced))
    });
    for (eng, (graphs, untraced)) in keep {
        drop(graphs);
        drop(untraced);
        drop(eng);
    }
    // [rank][round][run] -> [round][run][rank]
    let runs = ARMS.len() * 2 + 1;
    let mut out: Vec<Vec<Vec<Traced>>> = (0..rounds.len())
        .map(|_| (0..runs).map(|_| Vec::new()).collect())
        .collect();
    for rank_runs in per_rank {
        for (i, per_run) in rank_runs.into_iter().enumerate() {
            for (m, r) in per_run.into_iter().enumerate() {
                out[i][m].push(r);
            }
        }
    }
    Some(out)
}

/// The phases a rank of `c` launches in a device round of `arm` (`arm` `None`: a graph of one
/// arm is launched the same way as its eager round).
fn expected_phases(c: &ExchangeConfig, rank: usize, arm: DispatchArm) -> Vec<TracePhase> {
    let src = c.topology.attention_index(rank).is_some();
    let ffn = c.topology.ffn_index(rank).is_some();
    let mut v = Vec::new();
    if src && c.payload == PayloadKind::Fp8E4m3 {
        v.push(TracePhase::PayloadCheck);
    }
    v.push(TracePhase::Begin);
    if src {
        v.push(TracePhase::Counts);
    }
    if ffn && arm != DispatchArm::PayloadFirst {
        v.push(TracePhase::Plan);
    }
    if src {
        v.push(TracePhase::Rows);
    }
    if ffn {
        v.push(TracePhase::Epilogue);
        v.push(TracePhase::Experts);
    }
    if src {
        v.push(TracePhase::Combine);
    }
    v
}

fn span(t: &RoundTrace, p: TracePhase) -> (u64, u64) {
    let s = t
        .spans
        .iter()
        .find(|s| s.phase == p)
        .unwrap_or_else(|| panic!("rank {}: no {p:?} span", t.rank));
    (s.start_ns, s.end_ns)
}

fn check(c: &ExchangeConfig, what: &str, rounds: &[Vec<SourceInput>], got: &[Vec<Vec<Traced>>]) {
    let world = c.topology.world_size();
    for (i, (inp, per_run)) in rounds.iter().zip(got).enumerate() {
        for (m, ranks) in per_run.iter().enumerate() {
            let results: Vec<RankResult> = ranks
                .iter()
                .enumerate()
                .map(|(rank, (r, _))| match r {
                    Ok(o) => Ok(o.clone()),
                    Err(e) => panic!("{what} round {i} run {m} rank {rank}: {e}"),
                })
                .collect();
            check_round(c, inp, &results, None);
            let untraced = m == ARMS.len() * 2;
            let arm = ARMS[m % ARMS.len()];
            let traces: Vec<&RoundTrace> = ranks
                .iter()
                .enumerate()
                .filter_map(|(rank, (_, t))| {
                    if untraced {
                        assert!(
                            t.is_none(),
                            "{what} round {i}: an untraced graph has a trace"
                        );
                        return None;
                    }
                    let t = t.as_ref().unwrap_or_else(|| {
                        panic!("{what} round {i} run {m} rank {rank}: no trace")
                    });
                    assert_eq!(t.rank, rank);
                    let phases: Vec<TracePhase> = t.spans.iter().map(|s| s.phase).collect();
                    assert_eq!(
                        phases,
                        expected_phases(c, rank, arm),
                        "{what} round {i} run {m} rank {rank}"
                    );
                    for w in t.spans.windows(2) {
                        assert_eq!(w[0].end_ns, w[1].start_ns, "spans share boundaries");
                    }
                    assert!(t.spans.iter().all(|s| s.start_ns <= s.end_ns));
                    Some(t)
                })
                .collect();
            if untraced {
                continue;
            }
            assert_eq!(traces.len(), world);
            let srcs: Vec<_> = traces
                .iter()
                .filter(|t| c.topology.attention_index(t.rank).is_some())
                .collect();
            let ffns: Vec<_> = traces
                .iter()
                .filter(|t| c.topology.ffn_index(t.rank).is_some())
                .collect();
            for f in &ffns {
                let (_, epi_end) = span(f, TracePhase::Epilogue);
                for s in &srcs {
                    let (rows_start, _) = span(s, TracePhase::Rows);
                    assert!(
                        epi_end >= rows_start,
                        "{what} round {i} run {m}: rank {}'s epilogue ended ({epi_end}) before \
                         rank {}'s rows began ({rows_start})",
                        f.rank,
                        s.rank
                    );
                }
            }
            for s in &srcs {
                let (_, comb_end) = span(s, TracePhase::Combine);
                for f in &ffns {
                    let (exp_start, _) = span(f, TracePhase::Experts);
                    assert!(
                        comb_end >= exp_start,
                        "{what} round {i} run {m}: rank {}'s combine ended before rank {}'s \
                         experts began",
                        s.rank,
                        f.rank
                    );
                }
            }
        }
    }
}

#[test]
fn traced_rounds_are_exact_and_their_timelines_follow_the_protocol() {
    let _serial = serial();
    for (topo, payload) in [
        ("3A:1F", PayloadKind::Bf16),
        ("2A:2F", PayloadKind::Bf16),
        ("2A:2F", PayloadKind::Fp8E4m3),
        ("EP1", PayloadKind::Bf16),
    ] {
        let hidden = if payload == PayloadKind::Fp8E4m3 {
            256
        } else {
            40
        };
        let mut c = cfg(topo, hidden, 12, 3);
        c.capacity = 48;
        c.payload = payload;
        c.validate().unwrap();
        let a = c.topology.attention_count();
        let rounds = vec![
            sources(&c, &[48, 3, 0][..a], Some(2), 61),
            sources(&c, &[0, 17, 5][..a], None, 62),
        ];
        let Some(got) = traced_runs(&c, &rounds) else {
            return;
        };
        check(&c, &format!("{topo} {payload}"), &rounds, &got);
        let t = got[0][0][0].1.as_ref().expect("checked");
        println!(
            "{topo} {payload}: rank 0 eager payload-first round 0: {}",
            t.spans
                .iter()
                .map(|s| format!("{} {:.1} us", s.phase.name(), s.us()))
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
}
