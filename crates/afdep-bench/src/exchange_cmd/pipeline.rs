//! `afdep exchange --pipeline M1,M2,..`: the microbatch pipeline (`afdep_moe::pipeline`, issue 19
//! item 3) against sequential rounds, with the FFN ranks' busy fraction.
//!
//! Ranks are threads (an in-process NvlinkIpc group per slot: two groups, two fused engines per
//! rank; on one GPU with `--device D`, the single-GPU rank emulation, or rank r on GPU
//! `r % GPUs`). For every token count and every M of the list, on the same engines:
//!
//! 1. **check**: one pipelined run (M microbatches over 2 slots) and one sequential run (the
//!    same M rounds on one slot) with outputs poisoned before every round; every source's
//!    pipelined output must be bit-identical to the sequential one, and its first
//!    [`SAMPLE_TOKENS`] tokens must match the oracle's exchange of those tokens (bit for bit
//!    with `--expert identity`; within `accuracy::OUT_TOL` with `swiglu`, the grouped GEMM):
//!    a token's combined row depends only on its own row and routes, so a sample of tokens is
//!    checked exactly without the whole layer on the host;
//! 2. **timing** (poisoning off): `--warmup` then `--rounds` runs of each, alternating
//!    sequential and pipelined; a run's layer time is the slowest rank's span between CUDA
//!    events (after a barrier of every rank: `PipelineRank::set_timing`); `layer_ms` and
//!    `sequential_ms` are the medians;
//! 3. **busy fraction** (tracing on, [`TRACE_RUNS`] runs of each): the FFN ranks' union of
//!    experts-phase spans over the layer's window on the device timer
//!    (`afdep_moe::pipeline::busy_fraction`), the median over runs of the mean over FFN ranks.
//!    Traced runs add stamp kernels, so the layer time comes from the untraced runs.
//!
//! One JSON row per (token count, M) on stdout ([`PipelineRow`]), a markdown table on stderr
//! and in `--table`.

use std::sync::Arc;

use afdep_core::bf16;
use afdep_core::oracle::exchange::{self as reference, SourceInput};
use afdep_moe::pipeline::{busy_fraction, microbatch};
use afdep_moe::{
    DeviceExperts, DeviceRoundOptions, FusedEngine, PipelineConfig, PipelineOutput, PipelineRank,
    RoundArm, RoundTrace, TracePhase, run_group,
};
use afdep_transport::{AnyTransport, Transport};
use anyhow::{Context, Result, bail};
use serde::Serialize;

use super::args::*;
use super::problem::{Problem, expert_of};
use super::ranks::{by_rank, round_arm};
use super::rows::median;

/// Slots per rank: microbatch i on slot i % 2 (ping-pong).
pub(super) const SLOTS: usize = 2;

/// Tokens per source checked against the oracle (the first ones).
pub(super) const SAMPLE_TOKENS: usize = 8;

/// Traced runs per configuration (the busy fraction).
pub(super) const TRACE_RUNS: usize = 3;

/// One row of `afdep exchange --pipeline`.
#[derive(Debug, Clone, Serialize)]
pub struct PipelineRow {
    /// `pipeline`.
    pub mode: &'static str,
    /// The ranks, e.g. `3A:1F`.
    pub topology: String,
    /// Hidden size.
    pub hidden: usize,
    /// Experts, top-k and the SwiGLU width.
    pub experts: usize,
    /// Slots per token.
    pub top_k: usize,
    /// The experts' width (`swiglu`).
    pub width: usize,
    /// `swiglu` or `identity`.
    pub expert: &'static str,
    /// The dispatch arm of every round.
    pub arm: String,
    /// Tokens per attention rank (the layer's batch on each).
    pub tokens: usize,
    /// Microbatches M.
    pub microbatches: usize,
    /// Slots K of the pipelined runs.
    pub slots: usize,
    /// The median layer time of the pipelined runs (M microbatches over K slots), ms.
    pub layer_ms: f64,
    /// The median layer time of sequential rounds (the same M rounds on one slot), ms.
    pub sequential_ms: f64,
    /// `sequential_ms / layer_ms`.
    pub speedup: f64,
    /// The FFN ranks' busy fraction in pipelined runs (median over traced runs of the mean
    /// over FFN ranks of the experts phase's share of the layer's window).
    pub ffn_busy: f64,
    /// The same in sequential rounds.
    pub ffn_busy_sequential: f64,
    /// The median layer time of the traced pipelined runs, ms (stamps included).
    pub layer_ms_traced: f64,
    /// Whether ranks share a GPU (single-GPU rank emulation: protocol and compute contend for
    /// one GPU; not NVLink).
    pub emulated: bool,
    /// The devices of the ranks.
    pub devices: Vec<usize>,
    /// Timed runs (each) and warm-ups.
    pub rounds: usize,
    /// Untimed runs before them.
    pub warmup: usize,
    /// `ok` when every check passed, else `mismatch`.
    pub status: &'static str,
    /// The largest relative error of the sampled tokens against the oracle.
    pub max_rel_err: f64,
}

/// What one rank measured for one (token count, M).
struct RankMeasure {
    /// Pipelined output equal to sequential, bit for bit (sources; true elsewhere).
    same: bool,
    /// The sampled tokens' rows of the pipelined output (sources).
    sample: Option<Vec<bf16>>,
    /// Layer times of the timed runs, pipelined and sequential, s.
    piped_s: Vec<f64>,
    seq_s: Vec<f64>,
    /// Traced runs, pipelined and sequential.
    traced_piped: Vec<Traced>,
    traced_seq: Vec<Traced>,
}

/// A traced run on one rank: its layer time (s) and its timelines.
type Traced = (f64, Vec<RoundTrace>);

/// The checks of `--pipeline` against the other flags.
pub(super) fn check(a: &ExchangeArgs, res: &Resolved, ms: &[usize]) -> Result<()> {
    if res.engine != EngineKind::Fused {
        bail!("--pipeline runs the fused engine: use --backend cuda --transport nvlink");
    }
    if a.graph || a.device_rounds || a.load.is_some() || a.trace.is_some() || a.fault.is_some() {
        bail!("--pipeline: not with --graph, --device-rounds, --load, --trace or --fault");
    }
    if a.multi_process || a.input.is_some() || a.output.is_some() {
        bail!(
            "--pipeline: ranks as threads with seeded inputs (no --multi-process, --input, --output)"
        );
    }
    if ms.is_empty() {
        bail!("--pipeline needs at least one microbatch count");
    }
    for &m in ms {
        PipelineConfig::new(m, SLOTS)?;
    }
    Ok(())
}

/// Runs `--pipeline`: returns the rows (one per token count and M).
pub(super) fn run(
    a: &ExchangeArgs,
    res: &Resolved,
    probs: &[Problem],
    ms: &[usize],
) -> Result<Vec<PipelineRow>> {
    check(a, res, ms)?;
    let cfg = &res.cfg;
    let world = cfg.topology.world_size();
    let max_m = ms.iter().copied().max().unwrap_or(1);
    let params = probs.first().and_then(|p| p.params.clone()).map(Arc::new);
    let experts = match (a.expert, params) {
        (ExpertArg::Swiglu, Some(p)) => DeviceExperts::SwiGlu(p),
        (ExpertArg::Swiglu, None) => bail!("--expert swiglu without expert parameters"),
        (ExpertArg::Identity, _) => DeviceExperts::Identity,
    };
    let arm = round_arm(a.arm);
    // one in-process group per slot; rank r's transports, by slot
    let mut per_rank: Vec<Vec<AnyTransport>> = (0..world).map(|_| Vec::new()).collect();
    let mut devices = Vec::new();
    for _ in 0..SLOTS {
        for (r, t) in AnyTransport::group(res.kind, world, &res.options)?
            .into_iter()
            .enumerate()
        {
            if let AnyTransport::Nvlink(n) = &t {
                if devices.len() < world {
                    devices.push(n.device());
                }
            }
            per_rank[r].push(t);
        }
    }
    let outcomes = run_group(
        per_rank,
        |_, ts| -> Result<PipelineRank> {
            let mut engines = Vec::with_capacity(ts.len());
            for t in ts {
                let t = t
                    .into_nvlink()
                    .map_err(|t| anyhow::anyhow!("the pipeline needs nvlink, got {}", t.kind()))?;
                let mut e = FusedEngine::new(cfg.clone(), t)?;
                e.prepare_device(DeviceRoundOptions {
                    experts: experts.clone(),
                    keep_received: false,
                })?;
                engines.push(e);
            }
            Ok(PipelineRank::new(engines, max_m)?)
        },
        |rank, pr| {
            let s = cfg.topology.attention_index(rank);
            let mut out = Vec::new();
            for prob in probs {
                let mine = s.map(|s| &prob.inputs[s]);
                for &m in ms {
                    out.push(measure(a, pr, arm, m, mine)?);
                }
            }
            Ok(out)
        },
    );
    let per_rank: Vec<Vec<RankMeasure>> = by_rank(outcomes)?;
    let mut distinct = devices.clone();
    distinct.sort_unstable();
    distinct.dedup();
    let emulated = distinct.len() < world;
    let mut rows = Vec::new();
    let mut at = 0;
    for prob in probs {
        let tokens = prob.inputs.first().map_or(0, |i| i.routes.tokens);
        let (status, err) = check_sample(a, prob, &per_rank, at, ms.len())?;
        for (i, &m) in ms.iter().enumerate() {
            let ranks: Vec<&RankMeasure> = per_rank.iter().map(|r| &r[at + i]).collect();
            let same = ranks.iter().all(|r| r.same);
            let slowest = |f: fn(&RankMeasure) -> &Vec<f64>| -> Vec<f64> {
                (0..f(ranks[0]).len())
                    .map(|j| ranks.iter().map(|r| f(r)[j]).fold(0.0, f64::max))
                    .collect()
            };
            let piped = median(slowest(|r| &r.piped_s)) * 1e3;
            let seq = median(slowest(|r| &r.seq_s)) * 1e3;
            let busy = |f: fn(&RankMeasure) -> &Vec<Traced>| -> Result<(f64, f64)> {
                let n = f(ranks[0]).len();
                let mut fr = Vec::with_capacity(n);
                let mut layer = Vec::with_capacity(n);
                for j in 0..n {
                    let all: Vec<RoundTrace> = ranks
                        .iter()
                        .flat_map(|r| f(r)[j].1.iter().cloned())
                        .collect();
                    let ffn: Vec<usize> = cfg.topology.ffn_ranks().collect();
                    let b = busy_fraction(&all, &ffn, TracePhase::Experts)
                        .context("a traced run without timelines")?;
                    fr.push(b.mean());
                    layer.push(ranks.iter().map(|r| f(r)[j].0).fold(0.0, f64::max));
                }
                Ok((median(fr), median(layer) * 1e3))
            };
            let (ffn_busy, traced_ms) = busy(|r| &r.traced_piped)?;
            let (ffn_busy_seq, _) = busy(|r| &r.traced_seq)?;
            rows.push(PipelineRow {
                mode: "pipeline",
                topology: cfg.topology.to_string(),
                hidden: cfg.hidden,
                experts: cfg.experts,
                top_k: cfg.top_k,
                width: a.width,
                expert: match a.expert {
                    ExpertArg::Swiglu => "swiglu",
                    ExpertArg::Identity => "identity",
                },
                arm: a.arm.name().to_string(),
                tokens,
                microbatches: m,
                slots: SLOTS,
                layer_ms: piped,
                sequential_ms: seq,
                speedup: seq / piped,
                ffn_busy,
                ffn_busy_sequential: ffn_busy_seq,
                layer_ms_traced: traced_ms,
                emulated,
                devices: devices.clone(),
                rounds: a.rounds,
                warmup: a.warmup,
                status: if same && status { "ok" } else { "mismatch" },
                max_rel_err: err,
            });
        }
        at += ms.len();
    }
    Ok(rows)
}

/// One rank's runs of one (problem, M) ([module docs](self)).
fn measure(
    a: &ExchangeArgs,
    pr: &mut PipelineRank,
    arm: RoundArm,
    m: usize,
    mine: Option<&SourceInput>,
) -> Result<RankMeasure> {
    let piped = PipelineConfig::new(m, SLOTS)?;
    let seq = PipelineConfig::sequential(m)?;
    // 1. check: poisoned outputs, untimed, untraced
    set_poison(pr, true);
    pr.set_timing(false)?;
    pr.set_trace(false)?;
    let p = pr.run(piped, arm, mine)?;
    let s = pr.run(seq, arm, mine)?;
    let bits = |o: &PipelineOutput| {
        o.combined
            .as_ref()
            .map(|c| c.iter().map(|v| v.to_bits()).collect::<Vec<u16>>())
    };
    let same = bits(&p) == bits(&s);
    let sample = match (&p.combined, mine) {
        (Some(c), Some(inp)) => {
            let n = inp.routes.tokens.min(SAMPLE_TOKENS) * (c.len() / inp.routes.tokens.max(1));
            Some(c[..n].to_vec())
        }
        _ => None,
    };
    // 2. timing
    set_poison(pr, false);
    pr.set_timing(true)?;
    let secs = |o: PipelineOutput| o.layer_time.map_or(0.0, |t| t.as_secs_f64());
    for _ in 0..a.warmup {
        pr.run(seq, arm, mine)?;
        pr.run(piped, arm, mine)?;
    }
    let (mut piped_s, mut seq_s) = (Vec::new(), Vec::new());
    for _ in 0..a.rounds {
        seq_s.push(secs(pr.run(seq, arm, mine)?));
        piped_s.push(secs(pr.run(piped, arm, mine)?));
    }
    // 3. traced runs
    pr.set_trace(true)?;
    let (mut traced_piped, mut traced_seq) = (Vec::new(), Vec::new());
    for _ in 0..TRACE_RUNS {
        let o = pr.run(seq, arm, mine)?;
        let t = o.layer_time.map_or(0.0, |t| t.as_secs_f64());
        traced_seq.push((t, o.traces));
        let o = pr.run(piped, arm, mine)?;
        let t = o.layer_time.map_or(0.0, |t| t.as_secs_f64());
        traced_piped.push((t, o.traces));
    }
    pr.set_trace(false)?;
    Ok(RankMeasure {
        same,
        sample,
        piped_s,
        seq_s,
        traced_piped,
        traced_seq,
    })
}

fn set_poison(pr: &mut PipelineRank, on: bool) {
    for e in pr.slots_mut() {
        e.set_poison(on);
    }
}

/// The oracle check of one problem's sampled tokens (the first [`SAMPLE_TOKENS`] of every
/// source; the rows of every M's pipelined run at `at..at + n` of each rank's measures):
/// whether all match, and the largest relative error.
fn check_sample(
    a: &ExchangeArgs,
    prob: &Problem,
    per_rank: &[Vec<RankMeasure>],
    at: usize,
    n: usize,
) -> Result<(bool, f64)> {
    if a.no_verify {
        return Ok((true, 0.0));
    }
    let cfg = &prob.cfg;
    let sample: Vec<SourceInput> = prob
        .inputs
        .iter()
        .map(|i| microbatch(i, 0..i.routes.tokens.min(SAMPLE_TOKENS)))
        .collect();
    let want = reference::exchange(cfg, &sample, |e, rows: &[bf16], k| {
        expert_of(prob, a.expert, e, rows, k)
    })?;
    let (mut ok, mut worst) = (true, 0.0f64);
    for (rank, measures) in per_rank.iter().enumerate() {
        let Some(s) = cfg.topology.attention_index(rank) else {
            continue;
        };
        for r in &measures[at..at + n] {
            let got = r.sample.as_deref().unwrap_or_default();
            match a.expert {
                ExpertArg::Identity => ok &= got == want[s].as_slice(),
                ExpertArg::Swiglu => {
                    if got.len() != want[s].len() {
                        ok = false;
                        continue;
                    }
                    let e = afdep_moe::accuracy::max_rel_err(got, &want[s]);
                    worst = worst.max(if e.is_nan() { f64::INFINITY } else { e });
                    ok &= e <= afdep_moe::accuracy::OUT_TOL;
                }
            }
        }
    }
    Ok((ok, worst))
}

/// The markdown table of pipeline rows.
pub fn table(rows: &[PipelineRow]) -> String {
    let mut t = String::from(
        "| ratio | hidden | width | tokens | M | layer ms (pipelined) | sequential ms | speed-up | \
         FFN busy (pipelined) | FFN busy (sequential) | emulated | status |\n\
         |---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|\n",
    );
    for r in rows {
        t.push_str(&format!(
            "| {} | {} | {} | {} | {} | {:.3} | {:.3} | {:.2}× | {:.2} | {:.2} | {} | {} |\n",
            r.topology,
            r.hidden,
            r.width,
            r.tokens,
            r.microbatches,
            r.layer_ms,
            r.sequential_ms,
            r.speedup,
            r.ffn_busy,
            r.ffn_busy_sequential,
            if r.emulated { "yes" } else { "no" },
            r.status
        ));
    }
    t
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(m: usize, layer: f64, seq: f64) -> PipelineRow {
        PipelineRow {
            mode: "pipeline",
            topology: "3A:1F".into(),
            hidden: 2048,
            experts: 128,
            top_k: 8,
            width: 768,
            expert: "swiglu",
            arm: "count-first-source".into(),
            tokens: 2048,
            microbatches: m,
            slots: SLOTS,
            layer_ms: layer,
            sequential_ms: seq,
            speedup: seq / layer,
            ffn_busy: 0.8,
            ffn_busy_sequential: 0.6,
            layer_ms_traced: layer * 1.1,
            emulated: true,
            devices: vec![0; 4],
            rounds: 20,
            warmup: 3,
            status: "ok",
            max_rel_err: 1e-3,
        }
    }

    #[test]
    fn the_table_has_a_line_per_row_with_its_numbers() {
        let t = table(&[row(1, 2.0, 2.0), row(2, 1.5, 2.1)]);
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(lines.len(), 4);
        assert!(lines[3].starts_with("| 3A:1F | 2048 | 768 | 2048 | 2 | 1.500 | 2.100 | 1.40× |"));
        assert!(lines[3].ends_with("| 0.80 | 0.60 | yes | ok |"));
        let json = serde_json::to_value(row(4, 1.0, 2.0)).unwrap();
        assert_eq!(json["mode"], "pipeline");
        assert_eq!(json["emulated"], true);
        assert_eq!(json["speedup"], 2.0);
        assert_eq!(json["microbatches"], 4);
    }
}
