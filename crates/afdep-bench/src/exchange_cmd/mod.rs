//! `afdep exchange`: AFD dispatch + experts + combine rounds.
//!
//! # Engines and transports
//!
//! - the **staged engine** (host-driven, `--backend cpu`, or `auto` with a transport other than
//!   NVLink-IPC) over any transport: `--transport loopback|tcp|nvlink|nccl|ucx`;
//! - the **fused engine** (GPU-initiated stores, `--backend cuda`, or `auto` with
//!   `--transport nvlink`) over NVLink-IPC only. Its rows time each phase on the device (CUDA
//!   events on every rank's stream, [`afdep_moe::DevicePhaseTimes`]).
//!
//! # Graph mode
//!
//! `--graph` (with `--backend cuda`) times CUDA-graph replays instead of eager rounds, as the
//! reference record (docs/design.md, "The reference record") did: every rank prepares the fused
//! engine's device rounds (device experts: `identity` runs no expert kernel
//! (`DeviceExperts::Identity`: the combine reads the expanded rows), bit-exact against the oracle;
//! `swiglu` as the grouped GEMM, checked within the bf16 tolerance), captures one device round of
//! `--arm` once (`FusedEngine::capture`; `--arm auto` captures every arm into one graph and the
//! device picks the arm each replay by `--min-token-bucket`), and each round replays it with the
//! token count's input. The time of a round is the slowest rank's device span from a CUDA event
//! before the graph launch to one after it (after a barrier of every rank,
//! `FusedEngine::set_round_timing`); `round_us` is its median. Graph rows have `mode: graph` and no
//! per-phase times (`dispatch_us`, `combine_us` null): those come from eager rounds only.
//! `--multi-process` works the same way (each process captures its rank's graph).
//!
//! # Under load
//!
//! `--load gemm[:M,N,K]` (device rounds, ranks as threads; `load.rs`) runs every token count's
//! rounds twice on the same engines: alone, then while a bf16 GEMM of afdep's own grouped GEMM
//! (one group, default 8192 × 8192 × 8192) runs back to back on its own stream of every GPU
//! the ranks use; rows then carry `load` ([`LoadRow`]: the round alone and under load, the
//! GEMM per launch alone and under the rounds, their slowdowns), and `round_us` is the round
//! under load. The GEMM's output under load is checked against a host reference on a slice.
//!
//! # Where the ranks run
//!
//! By default every rank is a thread of this process (`loopback`; `nvlink` as an in-process
//! group, the ranks sharing one GPU or spread over several, see `--device` and
//! `--one-gpu-per-rank`; `tcp` / `ucx` / `nccl` with each thread joining a bootstrap over
//! 127.0.0.1). With `--multi-process`, this process is one rank of a group started by `afdep
//! launch -n N` (rank, world size and rendezvous address from the environment; `nvlink` shares
//! its buffers by CUDA IPC): every process builds the same seeded problem (or reads the same
//! `--input`), runs its rank's part of every round, checks its own results against the oracle
//! bit for bit, and rank 0 prints the rows (phase times of the slowest rank, status `ok` only
//! when every rank matched).
//!
//! # Config file and arms
//!
//! `--config FILE` reads the exchange configuration and the transport from a TOML or JSON file
//! ([`crate::exchange_config`]); flags given on the command line override it. `--arm` picks the
//! dispatch arm of the engine (`auto`: the token-bucket rule per round); an arm the engine does
//! not have is an [`Unsupported`] error
//! (exit status [`EXIT_UNSUPPORTED`]), which `afdep exchange-arms` reports as an `unsupported`
//! row.
//!
//! # Output
//!
//! One JSON row per token count on stdout ([`ExchangeRow`]), and a table of them on stderr at
//! the end (`--table FILE` also writes it as markdown).

mod args;
mod load;
mod pipeline;
mod probe_file;
mod problem;
mod ranks;
mod rounds;
mod rows;
#[cfg(test)]
mod tests;
mod trace_file;

use std::io::Write;

use afdep_core::oracle::LayerParams;
use afdep_core::oracle::exchange::SourceInput;
use afdep_core::{ExchangeConfig, LayerShape, bf16};
use afdep_moe::{ExchangeEngine, RoundTrace, StagedEngine};
use afdep_transport::{AnyTransport, RendezvousEnv, TransportKind};
use anyhow::{Context, Result, bail};
use indicatif::{ProgressBar, ProgressStyle};

use crate::tensor_file::TensorFile;

pub use args::{
    ArmArg, EXIT_UNSUPPORTED, EngineKind, ExchangeArgs, ExpertArg, Resolved, Unsupported,
};
use args::{check_graph, check_nccl_device, names};
use problem::*;
use ranks::*;
use rounds::*;
use rows::median;
pub use rows::{ExchangeRow, LoadRow, table};

/// Runs `afdep exchange`: the request checked, the problems built, then each problem's rounds
/// (threads, or this process's rank of a `--multi-process` group), checked against the oracle,
/// one row each.
pub fn run(a: ExchangeArgs) -> Result<()> {
    if a.rounds == 0 {
        bail!("--rounds must be at least 1");
    }
    let res = a.resolve()?;
    if let Some(ms) = &a.pipeline {
        pipeline::check(&a, &res, ms)?;
    }
    check_request(&a, &res)?;
    let probs = problems(&a, &res.cfg)?;
    if let Some(ms) = &a.pipeline {
        return run_pipeline(&a, &res, &probs, ms);
    }
    let mut mp = multi_process_rank(&a, &res, &probs)?;
    let me = mp.as_ref().map_or(0, |e| e.rank());
    let bar = progress_bar(&a, &res, me, probs.len());
    let mut json_out = match (&a.json_out, me) {
        (Some(p), 0) => Some(crate::jsonl::open_append(p)?),
        _ => None,
    };
    // threaded fused runs set up once for every problem
    let mut fused_runs = match (&mp, res.engine) {
        (None, EngineKind::Fused | EngineKind::NcclDevice) => {
            Some(run_fused_threads(&a, &res, &probs, &bar)?.into_iter())
        }
        _ => None,
    };
    let mut rows = Vec::new();
    let mut timelines = Vec::new();
    let mut probe_sets = Vec::new();
    for prob in &probs {
        let outcome = match &mut mp {
            None => {
                let runs = match &mut fused_runs {
                    Some(it) => it.next().context("a run per problem")?,
                    None => ProblemRuns {
                        runs: run_threaded(&a, &res, prob)?,
                        load: None,
                    },
                };
                threaded_outcome(&a, prob, &runs)?
            }
            Some(eng) => {
                let world = res.cfg.topology.world_size();
                let (times, rejected) = multi_process_problem(&a, eng.as_mut(), prob, world)?;
                let status = if a.no_verify { "unverified" } else { "ok" };
                Outcome {
                    status,
                    per_round: times,
                    rejected,
                    combined: Vec::new(),
                    traces: Vec::new(),
                    probes: Vec::new(),
                    load: None,
                }
            }
        };
        if me == 0 {
            let row = row_of(&a, &res, prob, &outcome);
            let line = serde_json::to_string(&row).expect("row serializes");
            bar.suspend(|| println!("{line}"));
            if let Some(f) = &mut json_out {
                writeln!(f, "{line}").context("writing --json-out")?;
            }
            rows.push(row);
        }
        if let Some(p) = &a.output {
            write_output(p, prob, &outcome.combined)?;
        }
        let label = || {
            format!(
                "{} {} {} {}, tokens {:?}",
                res.cfg.topology,
                a.mode(),
                a.arm,
                res.cfg.payload,
                prob.inputs
                    .iter()
                    .map(|i| i.routes.tokens)
                    .collect::<Vec<_>>()
            )
        };
        let roles = || {
            (0..res.cfg.topology.world_size())
                .map(|r| trace_file::role_of(&res.cfg.topology, r))
                .collect::<Vec<_>>()
        };
        if a.trace.is_some() {
            timelines.push(trace_file::Timeline {
                label: label(),
                roles: roles(),
                traces: outcome.traces.clone(),
            });
        }
        if a.probe.is_some() && me == 0 {
            let set = probe_file::ProbeSet {
                label: label(),
                roles: roles(),
                probes: outcome.probes.clone(),
            };
            bar.suspend(|| eprintln!("{}", probe_file::table(&set)));
            probe_sets.push(set);
        }
        if outcome.status == "mismatch" {
            bail!(
                "the {} engine's result differs from the oracle's exchange reference",
                res.engine.name()
            );
        }
        if fused_runs.is_none() {
            bar.inc(1);
        }
    }
    bar.finish_and_clear();
    if let (Some(p), 0) = (&a.probe, me) {
        probe_file::write(p, &probe_sets)
            .with_context(|| format!("writing the probes {}", p.display()))?;
        eprintln!(
            "probes: {} ({} token counts)",
            p.display(),
            probe_sets.len()
        );
    }
    if let Some(p) = &a.trace {
        trace_file::write(p, &timelines)
            .with_context(|| format!("writing the trace {}", p.display()))?;
        eprintln!("trace: {} ({} token counts)", p.display(), timelines.len());
    }
    if me == 0 && !rows.is_empty() {
        let t = table(&rows);
        eprint!("{t}");
        if let Some(p) = &a.table {
            std::fs::write(p, &t).with_context(|| format!("writing {}", p.display()))?;
        }
    }
    // the multi-process engine is dropped after a last barrier: no rank frees its windows
    // while a peer may still read them
    if let Some(mut eng) = mp {
        eng.barrier()?;
    }
    Ok(())
}

/// `--pipeline`: the rows on stdout (and `--json-out`), the table on stderr (and `--table`);
/// a row whose check failed fails the run after every row is written.
fn run_pipeline(a: &ExchangeArgs, res: &Resolved, probs: &[Problem], ms: &[usize]) -> Result<()> {
    let rows = pipeline::run(a, res, probs, ms)?;
    let mut json_out = a
        .json_out
        .as_deref()
        .map(crate::jsonl::open_append)
        .transpose()?;
    for row in &rows {
        let line = serde_json::to_string(row).expect("row serializes");
        println!("{line}");
        if let Some(f) = &mut json_out {
            writeln!(f, "{line}").context("writing --json-out")?;
        }
    }
    let t = pipeline::table(&rows);
    eprint!("{t}");
    if let Some(p) = &a.table {
        std::fs::write(p, &t).with_context(|| format!("writing {}", p.display()))?;
    }
    if rows.iter().any(|r| r.status != "ok") {
        bail!("a pipelined run differs from its sequential rounds or from the oracle");
    }
    Ok(())
}

/// The checks of a request before anything is built: `--graph`, the engine's arms and payloads
/// ([`Unsupported`]), `--multi-process` and the transport's placement.
fn check_request(a: &ExchangeArgs, res: &Resolved) -> Result<()> {
    let (cfg, kind, engine) = (&res.cfg, res.kind, res.engine);
    check_graph(a)?;
    if engine == EngineKind::NcclDevice {
        check_nccl_device(a)?;
    }
    if a.start_gate && engine != EngineKind::Fused {
        return Err(Unsupported {
            engine: engine.name(),
            what: "--start-gate".into(),
            have: "host-started rounds (the gate is the fused engine's)".into(),
        }
        .into());
    }
    if !engine.arms().contains(&a.arm) {
        return Err(Unsupported {
            engine: engine.name(),
            what: format!("arm {}", a.arm),
            have: names(engine.arms()),
        }
        .into());
    }
    if !engine.partials().contains(&cfg.partials) {
        return Err(Unsupported {
            engine: engine.name(),
            what: format!("{} combine partials", cfg.partials),
            have: engine
                .partials()
                .iter()
                .map(|p| p.to_string())
                .collect::<Vec<_>>()
                .join(", "),
        }
        .into());
    }
    if !engine.payloads().contains(&cfg.payload) {
        return Err(Unsupported {
            engine: engine.name(),
            what: format!("payload {}", cfg.payload),
            have: engine
                .payloads()
                .iter()
                .map(|p| p.to_string())
                .collect::<Vec<_>>()
                .join(", "),
        }
        .into());
    }
    let world = cfg.topology.world_size();
    if a.multi_process && kind == TransportKind::Loopback {
        bail!(
            "--multi-process needs a multi-process transport (tcp, ucx, nccl, nvlink); loopback \
             ranks are threads"
        );
    }
    kind.check_placement(world, &res.options)?;
    Ok(())
}

/// The problems of a run: `--input`'s one, or one seeded problem per token count; the expert
/// parameters (`--input`'s, or random from the seed for SwiGLU experts); every fault checked
/// against every problem.
fn problems(a: &ExchangeArgs, cfg: &ExchangeConfig) -> Result<Vec<Problem>> {
    let problems: Vec<(Vec<SourceInput>, Option<LayerParams>)> = match &a.input {
        Some(p) => vec![read_problem(p, a, cfg)?],
        None => a
            .tokens
            .0
            .iter()
            .map(|&t| Ok((generate(a, cfg, t)?, None)))
            .collect::<Result<_>>()?,
    };
    if a.output.is_some() && problems.len() != 1 {
        bail!("--output needs exactly one token count");
    }
    if a.output.is_some() && a.multi_process {
        bail!("--output is for threaded runs; with --multi-process every rank checks itself");
    }
    let random_params = || {
        LayerParams::random(
            LayerShape {
                d_model: cfg.hidden,
                width: a.width,
                experts: cfg.experts,
                top_k: cfg.top_k,
                shared: 0,
                renormalize: true,
            },
            a.seed,
        )
    };
    let probs: Vec<Problem> = problems
        .into_iter()
        .map(|(inputs, params)| {
            let params = match (a.expert, params) {
                (ExpertArg::Swiglu, Some(p)) => Some(p),
                (ExpertArg::Swiglu, None) => Some(random_params()),
                (ExpertArg::Identity, _) => None,
            };
            Problem {
                cfg: cfg.clone(),
                inputs,
                params,
            }
        })
        .collect();
    for prob in &probs {
        check_fault(a.fault, prob, a.multi_process)?;
    }
    Ok(probs)
}

/// With `--multi-process`: this process's rank of the launch's group, its engine built (set-up
/// is collective); `None` for a threaded run.
fn multi_process_rank(
    a: &ExchangeArgs,
    res: &Resolved,
    probs: &[Problem],
) -> Result<Option<Box<dyn ExchangeEngine>>> {
    if !a.multi_process {
        return Ok(None);
    }
    let (cfg, kind) = (&res.cfg, res.kind);
    let world = cfg.topology.world_size();
    let env = RendezvousEnv::from_env()
        .context("--multi-process: run under `afdep launch -n N -- afdep exchange ...`")?;
    if env.world_size != world {
        bail!(
            "rank {}: the launch has {} processes, topology {} needs {world}",
            env.rank,
            env.world_size,
            cfg.topology
        );
    }
    let t = AnyTransport::from_env(kind, &res.options)
        .with_context(|| format!("rank {}: setting up {kind}", env.rank))?;
    Ok(Some(match res.engine {
        EngineKind::Staged => Box::new(StagedEngine::new(cfg.clone(), t)?),
        EngineKind::Fused => fused_rank(a, cfg, t, rank_params(probs, a.device_experts())?, None)?,
        EngineKind::NcclDevice => nccl_device_rank(a, cfg, t)?,
    }))
}

/// The progress bar of the run (hidden on ranks other than 0).
fn progress_bar(a: &ExchangeArgs, res: &Resolved, me: usize, problems: usize) -> ProgressBar {
    let bar = if me == 0 {
        ProgressBar::new(problems as u64)
    } else {
        ProgressBar::hidden()
    };
    bar.set_style(
        ProgressStyle::with_template("{spinner} {msg} [{bar:30}] {pos}/{len} {elapsed}")
            .expect("template"),
    );
    bar.set_message(format!(
        "{} {}/{} {}{}",
        res.cfg.topology,
        res.engine.name(),
        res.kind,
        a.arm,
        match a.mode() {
            "eager" => String::new(),
            m => format!(" ({m})"),
        }
    ));
    bar
}

/// What a problem's rounds gave: the verdict against the oracle, the slowest rank's times per
/// round, the rounds rejected as injected, and (threaded runs) every source's combined rows.
struct Outcome {
    status: &'static str,
    per_round: Vec<RoundTimes>,
    rejected: usize,
    combined: Vec<Vec<bf16>>,
    /// Every rank's timelines of its timed rounds (`--trace`), `[rank][round]`.
    traces: Vec<Vec<RoundTrace>>,
    /// Every rank's probe points of its timed rounds (`--probe`), `[rank][round]`.
    probes: Vec<Vec<[u64; afdep_kernels::ops::probe::SLOTS]>>,
    /// `--load`: the rounds alone and the load's measurements.
    load: Option<LoadRow>,
}

/// The outcome of a threaded problem from every rank's run: the attention ranks' last combined
/// rows checked against the oracle (with `--load`, those of both passes).
fn threaded_outcome(a: &ExchangeArgs, prob: &Problem, pr: &ProblemRuns) -> Result<Outcome> {
    let mut out = ranks_outcome(a, prob, &pr.runs)?;
    if let Some(l) = &pr.load {
        let alone = ranks_outcome(a, prob, &l.alone)?;
        if alone.status == "mismatch" {
            out.status = "mismatch";
        }
        out.load = Some(load::load_row(l, &out.per_round));
    }
    Ok(out)
}

/// The outcome of one pass of a threaded problem's rounds.
fn ranks_outcome(a: &ExchangeArgs, prob: &Problem, runs: &[RankRun]) -> Result<Outcome> {
    let combined: Vec<Vec<bf16>> = prob
        .cfg
        .topology
        .attention_ranks()
        .map(|r| {
            runs[r]
                .last
                .as_ref()
                .and_then(|o| o.combined.clone())
                .context("attention ranks combine")
        })
        .collect::<Result<_>>()?;
    let want = reference_of(prob, a.expert)?;
    let status = if a.no_verify {
        "unverified"
    } else if want.len() == combined.len()
        && want
            .iter()
            .zip(&combined)
            .all(|(w, g)| matches_reference(a, g, w))
    {
        "ok"
    } else {
        "mismatch"
    };
    let times: Vec<Vec<RoundTimes>> = runs.iter().map(|r| r.times.clone()).collect();
    Ok(Outcome {
        status,
        per_round: slowest(&times),
        rejected: runs[0].rejected,
        combined,
        traces: runs.iter().map(|r| r.traces.clone()).collect(),
        probes: runs.iter().map(|r| r.probes.clone()).collect(),
        load: None,
    })
}

/// The JSON row of a problem's outcome.
fn row_of(a: &ExchangeArgs, res: &Resolved, prob: &Problem, out: &Outcome) -> ExchangeRow {
    let (cfg, kind, engine) = (&res.cfg, res.kind, res.engine);
    let per_round = &out.per_round;
    let col = |f: fn(&RoundTimes) -> f64| median(per_round.iter().map(f).collect());
    let round_us = match (engine, a.device_experts()) {
        (EngineKind::Fused, true) => col(|t| t.round),
        (EngineKind::Fused, false) => col(|t| t.dispatch + t.combine),
        (EngineKind::NcclDevice, _) => col(|t| t.round),
        (EngineKind::Staged, _) => col(|t| t.wall),
    };
    // every round of the NCCL device engine is a device round
    let device_rounds = a.device_experts() || engine == EngineKind::NcclDevice;
    // device rounds time the whole round (per-phase times: `phases_us` from their traces)
    let phase = |f: fn(&RoundTimes) -> f64| (!device_rounds).then(|| col(f));
    ExchangeRow {
        topology: cfg.topology.to_string(),
        engine: engine.name().into(),
        arm: a.arm.name().into(),
        transport: kind.name().into(),
        ranks_as: if a.multi_process {
            "processes"
        } else {
            "threads"
        }
        .into(),
        ucx_tls: res.options.ucx_tls.clone(),
        device_buffers: res.options.device_buffers
            || matches!(kind, TransportKind::Nccl | TransportKind::NvlinkIpc),
        hidden: cfg.hidden,
        experts: cfg.experts,
        top_k: cfg.top_k,
        capacity: cfg.capacity,
        payload: cfg.payload.to_string(),
        partials: cfg.partials.to_string(),
        transport_sms: cfg.knobs.transport_sms,
        tokens: prob.inputs.iter().map(|i| i.routes.tokens).collect(),
        expert: format!("{:?}", a.expert).to_lowercase(),
        rounds: a.rounds,
        warmup: a.warmup,
        rejected_rounds: out.rejected,
        timing: match engine {
            EngineKind::Fused | EngineKind::NcclDevice => "device",
            EngineKind::Staged => "host",
        }
        .into(),
        mode: match (engine, a.graph) {
            (EngineKind::NcclDevice, false) => "device",
            _ => a.mode(),
        }
        .into(),
        start: if a.start_gate { "gate" } else { "host" }.into(),
        round_us,
        wall_us: col(|t| t.wall),
        counts_us: col(|t| t.counts),
        dispatch_us: phase(|t| t.dispatch),
        experts_us: col(|t| t.experts),
        combine_us: phase(|t| t.combine),
        phases_us: (!out.traces.is_empty()).then(|| trace_file::phase_medians(&out.traces)),
        load: out.load.clone(),
        status: out.status.to_string(),
        kernel_digest: afdep_kernels::source_digest(),
        pid: std::process::id(),
    }
}

/// `--output`: every source's combined rows as `y.<source>` in a tensor file.
fn write_output(p: &std::path::Path, prob: &Problem, combined: &[Vec<bf16>]) -> Result<()> {
    let mut f = TensorFile::default();
    for (s, y) in combined.iter().enumerate() {
        f.put_bf16(
            &format!("y.{s}"),
            &[prob.inputs[s].routes.tokens, prob.cfg.hidden],
            y,
        );
    }
    f.write(p)
}
