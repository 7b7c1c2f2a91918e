//! The rounds of one rank: warm-ups and timed rounds with faults applied, their times, the
//! slowest rank's per round, and a `--multi-process` rank's share of a problem.

use std::cell::Cell;
use std::time::{Duration, Instant};

use afdep_core::bf16;
use afdep_kernels::ops::probe;
use afdep_moe::{ExchangeEngine, ExchangeError, RoundOutput, RoundTrace};
use afdep_transport::TransportError;
use anyhow::{Context, Result, bail};

use super::args::*;
use super::problem::*;

/// Times of one timed round on one rank, µs.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct RoundTimes {
    /// Host wall time of the whole round.
    pub(super) wall: f64,
    /// Host: status + counts (fused eager rounds: the host preparation, `ExchangeRow::counts_us`).
    pub(super) counts: f64,
    /// Dispatch (device with the fused engine, host with the staged one).
    pub(super) dispatch: f64,
    /// Host: experts.
    pub(super) experts: f64,
    /// Combine (device with the fused engine, host with the staged one).
    pub(super) combine: f64,
    /// The whole round on the device, where the engine times it as one span (graph replays;
    /// NaN otherwise).
    pub(super) round: f64,
}

impl RoundTimes {
    const N: usize = 6;

    fn to_array(self) -> [f64; Self::N] {
        [
            self.wall,
            self.counts,
            self.dispatch,
            self.experts,
            self.combine,
            self.round,
        ]
    }

    fn from_array(v: [f64; Self::N]) -> RoundTimes {
        RoundTimes {
            wall: v[0],
            counts: v[1],
            dispatch: v[2],
            experts: v[3],
            combine: v[4],
            round: v[5],
        }
    }
}

/// What one rank got from the rounds of one problem.
pub(super) struct RankRun {
    /// The output of the last round that was not rejected.
    pub(super) last: Option<RoundOutput>,
    /// Per timed, not rejected round.
    pub(super) times: Vec<RoundTimes>,
    /// Timed rounds rejected as injected.
    pub(super) rejected: usize,
    /// The timeline of each timed, not rejected round, where the engine traces
    /// ([`ExchangeEngine::round_trace`]; `--trace`).
    pub(super) traces: Vec<RoundTrace>,
    /// The probe points of each timed, not rejected round, where the kernels are built with
    /// probes ([`ExchangeEngine::round_probe`]; `--probe`).
    pub(super) probes: Vec<[u64; probe::SLOTS]>,
}

/// Runs `warmup + rounds` rounds of `prob` on this rank's engine (faults applied), a barrier
/// before each.
pub(super) fn rank_rounds(
    eng: &mut dyn ExchangeEngine,
    prob: &Problem,
    expert: ExpertArg,
    warmup: usize,
    rounds: usize,
    fault: Option<Fault>,
) -> Result<RankRun> {
    let rank = eng.rank();
    let topo = prob.cfg.topology;
    let input = topo.attention_index(rank).map(|s| &prob.inputs[s]);
    let abort_in_experts = Cell::new(false);
    let f = |e: usize, rows: &[bf16], n: usize| {
        if abort_in_experts.get() {
            eprintln!("rank {rank}: aborting mid-round as injected (--fault)");
            std::process::abort();
        }
        expert_of(prob, expert, e, rows, n)
    };
    let mut run = RankRun {
        last: None,
        times: Vec::with_capacity(rounds),
        rejected: 0,
        traces: Vec::new(),
        probes: Vec::new(),
    };
    for i in 0..warmup + rounds {
        let timed = i.checked_sub(warmup);
        let mut rejecting = None;
        let mut bad_input;
        let mut this_input = input;
        match fault {
            Some(Fault::Abort { rank: r, round }) if r == rank && timed == Some(round) => {
                if topo.ffn_index(rank).is_some() {
                    abort_in_experts.set(true);
                } else {
                    eprintln!("rank {rank}: aborting before round {round} as injected (--fault)");
                    std::process::abort();
                }
            }
            Some(Fault::Reject { rank: r, round }) if timed == Some(round) => {
                let s = topo
                    .attention_index(r)
                    .context("checked: an attention rank")?;
                rejecting = Some(s);
                if r == rank {
                    bad_input = input.cloned().context("an attention rank has input")?;
                    bad_input.routes.idx[0] = prob.cfg.experts as i32;
                    this_input = Some(&bad_input);
                }
            }
            _ => {}
        }
        eng.barrier()?;
        let t0 = Instant::now();
        let res = eng.round(this_input, &f);
        let total = t0.elapsed().as_secs_f64() * 1e6;
        // read (and zeroed) after every round, a failed one too, so that each timed round's
        // are its own
        let probed = eng.round_probe()?;
        if let Some(s) = rejecting {
            match res {
                Err(ExchangeError::Route { error, .. }) if error.rank() == s => {
                    eprintln!("rank {rank}: round {i} rejected as injected: {error}");
                    run.rejected += 1;
                    continue;
                }
                Err(e) => {
                    return Err(e).context(format!(
                        "rank {rank}: the injected rejection of rank {s} gave another error"
                    ));
                }
                Ok(_) => bail!("rank {rank}: the injected bad route of rank {s} was accepted"),
            }
        }
        let out = res?;
        if abort_in_experts.get() {
            // an FFN rank whose experts had no row this round: end here instead
            eprintln!("rank {rank}: aborting after round {i} as injected (--fault)");
            std::process::abort();
        }
        if timed.is_some() {
            let us = |d: Duration| d.as_secs_f64() * 1e6;
            let (dispatch, combine) = eng
                .device_times()
                .map_or((us(out.times.dispatch), us(out.times.combine)), |t| {
                    (us(t.dispatch), us(t.combine))
                });
            run.times.push(RoundTimes {
                wall: total,
                counts: us(out.times.counts),
                dispatch,
                experts: us(out.times.experts),
                combine,
                round: eng.round_time().map_or(f64::NAN, us),
            });
            run.traces.extend(eng.round_trace());
            run.probes.extend(probed);
        }
        run.last = Some(out);
    }
    Ok(run)
}

/// Per-round slowest-rank times of every rank's runs (rounds align: rejected rounds are left
/// out on every rank alike), each column on its own.
pub(super) fn slowest(per_rank: &[Vec<RoundTimes>]) -> Vec<RoundTimes> {
    let n = per_rank.iter().map(Vec::len).min().unwrap_or(0);
    (0..n)
        .map(|i| {
            let mut acc = [0f64; RoundTimes::N];
            for t in per_rank {
                for (a, v) in acc.iter_mut().zip(t[i].to_array()) {
                    *a = a.max(v);
                }
            }
            RoundTimes::from_array(acc)
        })
        .collect()
}

/// A short name of a failed round's error, for the log: the transport error's kind when it is
/// one (`Timeout`, `PeerGone`, ...).
pub(super) fn error_class(e: &anyhow::Error) -> &'static str {
    for c in e.chain() {
        let t = c.downcast_ref::<TransportError>().or_else(|| {
            match c.downcast_ref::<ExchangeError>() {
                Some(ExchangeError::Transport(t)) => Some(t),
                _ => None,
            }
        });
        if let Some(t) = t {
            return match t {
                TransportError::Timeout { .. } => "Timeout",
                TransportError::PeerGone { .. } => "PeerGone",
                TransportError::PeerFailed { .. } => "PeerFailed",
                TransportError::SizeMismatch { .. } => "SizeMismatch",
                TransportError::Closed { .. } => "Closed",
                TransportError::Unavailable { .. } => "Unavailable",
                _ => "TransportError",
            };
        }
    }
    "error"
}

/// One rank's part of a problem in a multi-process group: its rounds, its own check against
/// the oracle, and every rank's times gathered (the slowest rank's per round).
pub(super) fn multi_process_problem(
    a: &ExchangeArgs,
    eng: &mut dyn ExchangeEngine,
    prob: &Problem,
    world: usize,
) -> Result<(Vec<RoundTimes>, usize)> {
    let me = eng.rank();
    let run = rank_rounds(eng, prob, a.expert, a.warmup, a.rounds, a.fault).map_err(|e| {
        let class = error_class(&e);
        e.context(format!("rank {me}: round failed ({class})"))
    })?;
    // 0: unverified, 1: ok, 2: mismatch
    let verdict: u8 = match prob.cfg.topology.attention_index(me) {
        _ if a.no_verify => 0,
        None => 1,
        Some(s) => {
            let got = run.last.as_ref().and_then(|o| o.combined.as_ref());
            let want = &reference_of(prob, a.expert)?[s];
            if got.is_some_and(|g| matches_reference(a, g, want)) {
                1
            } else {
                2
            }
        }
    };
    let mut blob = vec![verdict];
    blob.extend((run.times.len() as u64).to_ne_bytes());
    for t in &run.times {
        for v in t.to_array() {
            blob.extend(v.to_ne_bytes());
        }
    }
    let lens = eng.all_gather(&(blob.len() as u64).to_ne_bytes())?;
    let max = lens
        .chunks_exact(8)
        .map(|c| u64::from_ne_bytes(c.try_into().expect("8 bytes")))
        .max()
        .unwrap_or(0) as usize;
    blob.resize(max, 0);
    let all = eng.all_gather(&blob)?;
    let mut times = Vec::with_capacity(world);
    let mut bad = Vec::new();
    let w = 8 * RoundTimes::N;
    for (r, b) in all.chunks_exact(max).enumerate() {
        if b[0] == 2 {
            bad.push(r);
        }
        let n = u64::from_ne_bytes(b[1..9].try_into().expect("8 bytes")) as usize;
        let rounds: Vec<RoundTimes> = b[9..9 + n * w]
            .chunks_exact(w)
            .map(|c| {
                let mut v = [0f64; RoundTimes::N];
                for (d, x) in v.iter_mut().zip(c.chunks_exact(8)) {
                    *d = f64::from_ne_bytes(x.try_into().expect("8 bytes"));
                }
                RoundTimes::from_array(v)
            })
            .collect();
        times.push(rounds);
    }
    if !bad.is_empty() {
        bail!("rank {me}: the engine's result differs from the oracle's on ranks {bad:?}");
    }
    Ok((slowest(&times), run.rejected))
}
