//! `afdep exchange`: AFD dispatch + experts + combine rounds.
//!
//! Two modes. By default every rank is a thread of this process (`--transport loopback`, or
//! `tcp` / `ucx` / `nccl` with each thread joining a bootstrap over 127.0.0.1). With
//! `--multi-process`, this process is one rank of a group started by `afdep launch -n N`
//! (rank, world size and rendezvous address from the environment): every process builds the
//! same seeded problem (or reads the same `--input`), runs its rank's part of every round,
//! checks its own results against the oracle bit for bit, and rank 0 prints the rows (phase
//! times of the slowest rank, status `ok` only when every rank matched).

use std::cell::Cell;
use std::io::Write;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use afdep_core::oracle::LayerParams;
use afdep_core::oracle::exchange::{self as reference, SourceInput};
use afdep_core::oracle::layer;
use afdep_core::oracle::params::random_tokens;
use afdep_core::route::{Routes, route};
use afdep_core::tensor::uniform_bf16;
use afdep_core::{ExchangeConfig, LayerShape, Topology, bf16};
use afdep_moe::{ExchangeError, RoundOutput, StagedEngine};
use afdep_transport::{
    AnyTransport, Bootstrap, Loopback, RendezvousEnv, Transport, TransportError, TransportKind,
    TransportOptions,
};
use anyhow::{Context, Result, bail};
use clap::{Args, ValueEnum};
use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;

use crate::Backend;
use crate::tensor_file::TensorFile;

/// Which transport moves the rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum TransportArg {
    /// In-process ranks as threads, host memory.
    Loopback,
    /// TCP through the bootstrap (`HostTcp`), relayed by rank 0: always available.
    Tcp,
    /// NVLink-IPC (CUDA IPC / peer access): not built yet, says so.
    #[value(alias = "nvlink-ipc")]
    Nvlink,
    /// NCCL grouped send/recv on device memory (cargo feature `nccl`, libnccl, one GPU per rank).
    Nccl,
    /// UCX tagged messages on host memory (cargo feature `ucx`; `--ucx-tls` picks tcp or shm).
    Ucx,
}

impl TransportArg {
    /// The transport kind this names.
    pub fn kind(self) -> TransportKind {
        match self {
            TransportArg::Loopback => TransportKind::Loopback,
            TransportArg::Tcp => TransportKind::HostTcp,
            TransportArg::Nvlink => TransportKind::NvlinkIpc,
            TransportArg::Nccl => TransportKind::Nccl,
            TransportArg::Ucx => TransportKind::Ucx,
        }
    }
}

/// A fault injected for tests of the failure paths: `reject@R:N` (attention rank R's routes of
/// timed round N get an expert id past the last expert: every rank must report that rank's
/// rejection and the next round must run) or `abort@R:N` (rank R aborts its process in timed
/// round N: inside its experts when it is an FFN rank, so mid-round; before the round
/// otherwise; `--multi-process` only).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// A rejected route on one rank.
    Reject {
        /// The (attention) rank.
        rank: usize,
        /// The timed round.
        round: usize,
    },
    /// A process that dies mid-round.
    Abort {
        /// The rank.
        rank: usize,
        /// The timed round.
        round: usize,
    },
}

impl FromStr for Fault {
    type Err = String;

    fn from_str(s: &str) -> Result<Fault, String> {
        let bad = || format!("bad fault {s:?}: expected reject@RANK:ROUND or abort@RANK:ROUND");
        let (what, at) = s.split_once('@').ok_or_else(bad)?;
        let (r, n) = at.split_once(':').ok_or_else(bad)?;
        let rank = r.trim().parse().map_err(|_| bad())?;
        let round = n.trim().parse().map_err(|_| bad())?;
        match what.trim() {
            "reject" => Ok(Fault::Reject { rank, round }),
            "abort" => Ok(Fault::Abort { rank, round }),
            _ => Err(bad()),
        }
    }
}

/// What the FFN ranks compute.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ExpertArg {
    /// The layer's SwiGLU experts (random parameters from the seed, or `w1`, `w3`, `w2` from `--input`).
    Swiglu,
    /// Each expert returns its rows unchanged (measures the exchange alone).
    Identity,
}

/// Arguments of `afdep exchange`.
#[derive(Debug, Args)]
pub struct ExchangeArgs {
    /// Where to run.
    #[arg(long, value_enum, default_value = "auto")]
    pub backend: Backend,
    /// The transport.
    #[arg(long, value_enum, default_value = "loopback")]
    pub transport: TransportArg,
    /// Ranks: `3A:1F`, `2A:2F`, `1A:3F`, or `EP4` (classic expert parallelism).
    #[arg(long, default_value = "3A:1F")]
    pub topology: Topology,
    /// Tokens per attention rank, comma-separated; one row per count. Ignored with `--input`.
    #[arg(long, default_value = "1,8,32,128,512,1024,2048")]
    pub tokens: crate::TokenList,
    /// Hidden size.
    #[arg(long, default_value_t = 2048)]
    pub hidden: usize,
    /// Number of experts.
    #[arg(long, default_value_t = 128)]
    pub experts: usize,
    /// Experts per FFN rank (default: experts / FFN ranks, rounded down; ids beyond the
    /// placed experts are "dummy" and rejected).
    #[arg(long)]
    pub experts_per_rank: Option<usize>,
    /// Slots per token.
    #[arg(long, default_value_t = 8)]
    pub top_k: usize,
    /// Width of the SwiGLU experts.
    #[arg(long, default_value_t = 128)]
    pub width: usize,
    /// Most tokens per attention rank.
    #[arg(long, default_value_t = 2048)]
    pub capacity: usize,
    /// The FFN computation.
    #[arg(long, value_enum, default_value = "swiglu")]
    pub expert: ExpertArg,
    /// Timed rounds per token count (the median is reported).
    #[arg(long, default_value_t = 5)]
    pub rounds: usize,
    /// Untimed rounds before the timed ones, per token count.
    #[arg(long, default_value_t = 1)]
    pub warmup: usize,
    /// Run as one rank of a group started by `afdep launch` (rank, world size and rendezvous
    /// from the environment); rank 0 prints the rows.
    #[arg(long)]
    pub multi_process: bool,
    /// UCX: the UCX transports (`tcp`, `shm`, `tcp,shm`; default: UCX's choice / `UCX_TLS`).
    #[arg(long)]
    pub ucx_tls: Option<String>,
    /// NCCL: this rank's CUDA device (default: rank modulo the device count).
    #[arg(long)]
    pub device: Option<usize>,
    /// tcp, ucx: device buffers (CUDA device `--device`) staged through host memory
    /// (cargo feature `cuda`, implied by `nccl`).
    #[arg(long)]
    pub device_buffers: bool,
    /// Inject a fault (tests): `reject@RANK:ROUND` or `abort@RANK:ROUND`.
    #[arg(long)]
    pub fault: Option<Fault>,
    /// Also append the rows to this JSONL file.
    #[arg(long)]
    pub json_out: Option<PathBuf>,
    /// Seed of tokens, router and experts.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Bound on every transport wait, in milliseconds.
    #[arg(long, default_value_t = 30_000)]
    pub timeout_ms: u64,
    /// Read per-rank `x.r`, `topk_idx.r`, `topk_weights.r` (and optionally `w1`, `w3`, `w2`).
    #[arg(long)]
    pub input: Option<PathBuf>,
    /// Write per-rank outputs `y.r`.
    #[arg(long)]
    pub output: Option<PathBuf>,
    /// Skip the comparison with the oracle's exchange reference.
    #[arg(long)]
    pub no_verify: bool,
}

/// One JSON row.
#[derive(Debug, Serialize)]
pub struct ExchangeRow {
    /// Topology.
    pub topology: String,
    /// Engine.
    pub engine: &'static str,
    /// Transport.
    pub transport: &'static str,
    /// `threads` (ranks as threads of one process) or `processes` (`--multi-process`).
    pub ranks_as: &'static str,
    /// UCX transports asked for (`--ucx-tls`), if any.
    pub ucx_tls: Option<String>,
    /// Whether the engine's buffers were device memory (`nccl`, or `--device-buffers`).
    pub device_buffers: bool,
    /// Hidden size.
    pub hidden: usize,
    /// Experts.
    pub experts: usize,
    /// Top-k.
    pub top_k: usize,
    /// Tokens on each attention rank.
    pub tokens: Vec<usize>,
    /// FFN computation.
    pub expert: String,
    /// Rounds timed (rejected rounds included).
    pub rounds: usize,
    /// Untimed warm-up rounds before them.
    pub warmup: usize,
    /// Timed rounds rejected as injected (`--fault reject@..`), left out of the times.
    pub rejected_rounds: usize,
    /// Median wall time of a whole round (slowest rank), µs.
    pub round_us: f64,
    /// Median phase times, µs (slowest rank per phase).
    pub counts_us: f64,
    /// Dispatch phase.
    pub dispatch_us: f64,
    /// Expert phase.
    pub experts_us: f64,
    /// Combine phase.
    pub combine_us: f64,
    /// `ok`, `mismatch` (against the oracle), or `unverified`.
    pub status: String,
    /// Digest of the kernel sources.
    pub kernel_digest: String,
}

struct Problem {
    cfg: ExchangeConfig,
    inputs: Vec<SourceInput>,
    params: Option<LayerParams>,
}

fn generate(a: &ExchangeArgs, cfg: &ExchangeConfig, tokens: usize) -> Result<Vec<SourceInput>> {
    let shape = LayerShape {
        d_model: cfg.hidden,
        width: 1,
        experts: cfg.experts,
        top_k: cfg.top_k,
        shared: 0,
        renormalize: true,
    };
    let wr = uniform_bf16(
        cfg.hidden * cfg.experts,
        1.0 / (cfg.hidden as f32).sqrt(),
        a.seed,
        1,
    );
    let owned = cfg.placement().owned();
    Ok((0..cfg.topology.attention_count())
        .map(|s| {
            let x = random_tokens(tokens, cfg.hidden, a.seed.wrapping_add(1000 + s as u64));
            let mut routes = route(&x, &wr, tokens, &shape);
            // the router may pick unplaced experts when experts_per_rank leaves some out:
            // mask those slots
            for e in routes.idx.iter_mut() {
                if *e as usize >= owned {
                    *e = -1;
                }
            }
            SourceInput { x, routes }
        })
        .collect())
}

fn read_problem(
    path: &Path,
    a: &ExchangeArgs,
    cfg: &ExchangeConfig,
) -> Result<(Vec<SourceInput>, Option<LayerParams>)> {
    let f = TensorFile::read(path)?;
    let mut inputs = Vec::new();
    for s in 0..cfg.topology.attention_count() {
        let (xs, x) = f.bf16(&format!("x.{s}"))?;
        let (is, idx) = f.i32(&format!("topk_idx.{s}"))?;
        let (_, weights) = f.f32(&format!("topk_weights.{s}"))?;
        if xs.len() != 2
            || xs[1] != cfg.hidden
            || is.len() != 2
            || is[1] != cfg.top_k
            || is[0] != xs[0]
        {
            bail!(
                "rank {s}: x.{s} is {xs:?} and topk_idx.{s} is {is:?}; need T × {} and T × {}",
                cfg.hidden,
                cfg.top_k
            );
        }
        let routes = Routes::new(xs[0], cfg.top_k, idx, weights)?;
        inputs.push(SourceInput { x, routes });
    }
    let params = if f.has("w1") {
        let shape = LayerShape {
            d_model: cfg.hidden,
            width: f.bf16("w1")?.0.get(2).copied().unwrap_or(a.width),
            experts: cfg.experts,
            top_k: cfg.top_k,
            shared: 0,
            renormalize: true,
        };
        let mut p = LayerParams::random(shape, 0);
        p.w1 = f.bf16("w1")?.1;
        p.w3 = f.bf16("w3")?.1;
        p.w2 = f.bf16("w2")?.1;
        p.wr = vec![bf16::ZERO; shape.d_model * shape.experts];
        p.check()?;
        Some(p)
    } else {
        None
    };
    Ok((inputs, params))
}

fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// What one rank got from the rounds of one problem.
struct RankRun {
    /// The output of the last round that was not rejected.
    last: Option<RoundOutput>,
    /// Per timed, not rejected round: `[round, counts, dispatch, experts, combine]` in µs.
    times: Vec<[f64; 5]>,
    /// Timed rounds rejected as injected.
    rejected: usize,
}

/// The expert function of `prob`.
fn expert_of(prob: &Problem, expert: ExpertArg, e: usize, rows: &[bf16], n: usize) -> Vec<bf16> {
    match (expert, &prob.params) {
        (ExpertArg::Swiglu, Some(p)) => {
            layer::expert_rows(p, e, rows, n).expect("validated expert input")
        }
        _ => rows.to_vec(),
    }
}

/// Checks that `fault` can happen in `prob` under this mode.
fn check_fault(fault: Option<Fault>, prob: &Problem, multi_process: bool) -> Result<()> {
    let topo = prob.cfg.topology;
    match fault {
        None => {}
        Some(Fault::Reject { rank, .. }) => {
            let Some(s) = topo.attention_index(rank) else {
                bail!("--fault reject@{rank}: rank {rank} is not an attention rank of {topo}");
            };
            if prob.inputs[s].routes.tokens == 0 || prob.cfg.top_k == 0 {
                bail!("--fault reject@{rank}: rank {rank} has no token to reject");
            }
        }
        Some(Fault::Abort { rank, .. }) => {
            if !multi_process {
                bail!("--fault abort@..: only with --multi-process (it ends the process)");
            }
            if rank >= topo.world_size() {
                bail!("--fault abort@{rank}: no rank {rank} in {topo}");
            }
        }
    }
    Ok(())
}

/// Runs `warmup + rounds` rounds of `prob` on this rank's engine (faults applied), a barrier
/// before each.
fn rank_rounds<T: Transport>(
    eng: &mut StagedEngine<T>,
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
        eng.transport_mut().barrier()?;
        let t0 = Instant::now();
        let res = eng.round(this_input, &f);
        let total = t0.elapsed().as_secs_f64() * 1e6;
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
            run.times.push([
                total,
                us(out.times.counts),
                us(out.times.dispatch),
                us(out.times.experts),
                us(out.times.combine),
            ]);
        }
        run.last = Some(out);
    }
    Ok(run)
}

/// Per-round slowest-rank times of every rank's runs (rounds align: rejected rounds are left
/// out on every rank alike).
fn slowest(per_rank: &[Vec<[f64; 5]>]) -> Vec<[f64; 5]> {
    let n = per_rank.iter().map(Vec::len).min().unwrap_or(0);
    (0..n)
        .map(|i| {
            let mut acc = [0f64; 5];
            for t in per_rank {
                for (a, v) in acc.iter_mut().zip(t[i]) {
                    *a = a.max(v);
                }
            }
            acc
        })
        .collect()
}

/// Runs the rounds of `prob` with one thread per rank, each building its transport with
/// `make(rank)` inside its thread; returns each rank's run.
fn run_threads(
    a: &ExchangeArgs,
    prob: &Problem,
    make: impl Fn(usize) -> Result<AnyTransport> + Sync,
) -> Result<Vec<RankRun>> {
    let world = prob.cfg.topology.world_size();
    let make = &make;
    let results: Vec<Result<RankRun>> = std::thread::scope(|sc| {
        let handles: Vec<_> = (0..world)
            .map(|rank| {
                let cfg = prob.cfg.clone();
                sc.spawn(move || -> Result<RankRun> {
                    let t = make(rank)?;
                    let mut eng = StagedEngine::new(cfg, t)?;
                    rank_rounds(&mut eng, prob, a.expert, a.warmup, a.rounds, a.fault)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .map_err(|_| anyhow::anyhow!("a rank thread panicked"))?
            })
            .collect()
    });
    results
        .into_iter()
        .enumerate()
        .map(|(rank, r)| r.with_context(|| format!("rank {rank}")))
        .collect()
}

/// The transports of a threaded run: a Loopback group, or one bootstrap per thread over
/// 127.0.0.1 and the kind's transport over it.
fn run_threaded(a: &ExchangeArgs, prob: &Problem, timeout: Duration) -> Result<Vec<RankRun>> {
    let world = prob.cfg.topology.world_size();
    let kind = a.transport.kind();
    if kind == TransportKind::Loopback {
        let group: Vec<Mutex<Option<Loopback>>> = Loopback::group(world, timeout)
            .into_iter()
            .map(|t| Mutex::new(Some(t)))
            .collect();
        return run_threads(a, prob, |r| {
            group[r]
                .lock()
                .expect("unpoisoned")
                .take()
                .map(AnyTransport::Loopback)
                .context("rank built twice")
        });
    }
    let opts = options(a, timeout);
    let any: SocketAddr = "127.0.0.1:0".parse().expect("literal address");
    let listener = Mutex::new(Some(Bootstrap::listen(any, world, timeout)?));
    let addr = listener
        .lock()
        .expect("unpoisoned")
        .as_ref()
        .expect("bound")
        .local_addr();
    run_threads(a, prob, |r| {
        let boot = if r == 0 {
            let l = listener
                .lock()
                .expect("unpoisoned")
                .take()
                .context("rank 0 built twice")?;
            l.accept()?
        } else {
            Bootstrap::connect(addr, r, world, timeout)?
        };
        Ok(AnyTransport::connect(kind, boot, &opts)?)
    })
}

fn options(a: &ExchangeArgs, timeout: Duration) -> TransportOptions {
    TransportOptions {
        timeout,
        ucx_tls: a.ucx_tls.clone(),
        device: a.device,
        device_buffers: a.device_buffers,
    }
}

/// The oracle's combined rows of every attention rank.
fn reference_of(prob: &Problem, expert: ExpertArg) -> Result<Vec<Vec<bf16>>> {
    Ok(reference::exchange(
        &prob.cfg,
        &prob.inputs,
        |e, rows: &[bf16], n| expert_of(prob, expert, e, rows, n),
    )?)
}

/// A short name of a failed round's error, for the log: the transport error's kind when it is
/// one (`Timeout`, `PeerGone`, ...).
fn error_class(e: &anyhow::Error) -> &'static str {
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

/// Runs `afdep exchange`.
pub fn run(a: ExchangeArgs) -> Result<()> {
    if a.backend == Backend::Cuda {
        bail!(
            "the CUDA backend of `afdep exchange` (fused NVLink engine) does not exist yet; use --backend cpu"
        );
    }
    if a.rounds == 0 {
        bail!("--rounds must be at least 1");
    }
    let cfg = ExchangeConfig {
        topology: a.topology,
        hidden: a.hidden,
        experts: a.experts,
        experts_per_rank: a
            .experts_per_rank
            .unwrap_or(a.experts / a.topology.ffn_count()),
        top_k: a.top_k,
        capacity: a.capacity,
        payload: Default::default(),
        knobs: Default::default(),
    };
    cfg.validate()?;
    let world = cfg.topology.world_size();
    let kind = a.transport.kind();
    if a.multi_process && kind == TransportKind::Loopback {
        bail!(
            "--multi-process needs a multi-process transport (tcp, ucx, nccl); loopback ranks are threads"
        );
    }
    kind.check_available(world)?;
    let timeout = Duration::from_millis(a.timeout_ms);
    let problems: Vec<(Vec<SourceInput>, Option<LayerParams>)> = match &a.input {
        Some(p) => vec![read_problem(p, &a, &cfg)?],
        None => a
            .tokens
            .0
            .iter()
            .map(|&t| Ok((generate(&a, &cfg, t)?, None)))
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
    let mut mp = if a.multi_process {
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
        let t = AnyTransport::from_env(kind, &options(&a, timeout))
            .with_context(|| format!("rank {}: setting up {kind}", env.rank))?;
        Some(StagedEngine::new(cfg.clone(), t)?)
    } else {
        None
    };
    let me = mp.as_ref().map_or(0, |e| e.rank());
    let bar = if me == 0 {
        ProgressBar::new(problems.len() as u64)
    } else {
        ProgressBar::hidden()
    };
    bar.set_style(
        ProgressStyle::with_template("{spinner} {msg} [{bar:30}] {pos}/{len} {elapsed}")
            .expect("template"),
    );
    let mut json_out = match (&a.json_out, me) {
        (Some(p), 0) => Some(
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(p)
                .with_context(|| format!("opening {}", p.display()))?,
        ),
        _ => None,
    };
    for (inputs, params) in problems {
        let params = match (a.expert, params) {
            (ExpertArg::Swiglu, Some(p)) => Some(p),
            (ExpertArg::Swiglu, None) => Some(random_params()),
            (ExpertArg::Identity, _) => None,
        };
        let tokens: Vec<usize> = inputs.iter().map(|i| i.routes.tokens).collect();
        bar.set_message(format!("{} staged/{kind}, tokens {tokens:?}", cfg.topology));
        let prob = Problem {
            cfg: cfg.clone(),
            inputs,
            params,
        };
        check_fault(a.fault, &prob, a.multi_process)?;
        let (status, per_round, rejected, combined) = match &mut mp {
            None => {
                let runs = run_threaded(&a, &prob, timeout)?;
                let combined: Vec<Vec<bf16>> = cfg
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
                let status = if a.no_verify {
                    "unverified"
                } else if reference_of(&prob, a.expert)? == combined {
                    "ok"
                } else {
                    "mismatch"
                };
                let times: Vec<Vec<[f64; 5]>> = runs.iter().map(|r| r.times.clone()).collect();
                (status, slowest(&times), runs[0].rejected, combined)
            }
            Some(eng) => {
                let run = rank_rounds(eng, &prob, a.expert, a.warmup, a.rounds, a.fault).map_err(
                    |e| {
                        let class = error_class(&e);
                        e.context(format!("rank {me}: round failed ({class})"))
                    },
                )?;
                // 0: unverified, 1: ok, 2: mismatch
                let verdict: u8 = match cfg.topology.attention_index(me) {
                    _ if a.no_verify => 0,
                    None => 1,
                    Some(s) => {
                        let got = run.last.as_ref().and_then(|o| o.combined.as_ref());
                        if got == Some(&reference_of(&prob, a.expert)?[s]) {
                            1
                        } else {
                            2
                        }
                    }
                };
                let mut blob = vec![verdict];
                blob.extend((run.times.len() as u64).to_ne_bytes());
                for t in &run.times {
                    for v in t {
                        blob.extend(v.to_ne_bytes());
                    }
                }
                let t = eng.transport_mut();
                let lens = t.all_gather(&(blob.len() as u64).to_ne_bytes())?;
                let max = lens
                    .chunks_exact(8)
                    .map(|c| u64::from_ne_bytes(c.try_into().expect("8 bytes")))
                    .max()
                    .unwrap_or(0) as usize;
                blob.resize(max, 0);
                let all = t.all_gather(&blob)?;
                let mut times = Vec::with_capacity(world);
                let mut bad = Vec::new();
                for (r, b) in all.chunks_exact(max).enumerate() {
                    if b[0] == 2 {
                        bad.push(r);
                    }
                    let n = u64::from_ne_bytes(b[1..9].try_into().expect("8 bytes")) as usize;
                    let vals: Vec<f64> = b[9..9 + n * 40]
                        .chunks_exact(8)
                        .map(|c| f64::from_ne_bytes(c.try_into().expect("8 bytes")))
                        .collect();
                    times.push(
                        vals.chunks_exact(5)
                            .map(|c| c.try_into().expect("5 values"))
                            .collect::<Vec<[f64; 5]>>(),
                    );
                }
                if !bad.is_empty() {
                    bail!(
                        "rank {me}: the staged engine's result differs from the oracle's on ranks {bad:?}"
                    );
                }
                let status = if a.no_verify { "unverified" } else { "ok" };
                (status, slowest(&times), run.rejected, Vec::new())
            }
        };
        if me == 0 {
            let col = |i: usize| median(per_round.iter().map(|r| r[i]).collect());
            let row = ExchangeRow {
                topology: cfg.topology.to_string(),
                engine: "staged",
                transport: kind.name(),
                ranks_as: if a.multi_process {
                    "processes"
                } else {
                    "threads"
                },
                ucx_tls: a.ucx_tls.clone(),
                device_buffers: a.device_buffers || kind == TransportKind::Nccl,
                hidden: cfg.hidden,
                experts: cfg.experts,
                top_k: cfg.top_k,
                tokens,
                expert: format!("{:?}", a.expert).to_lowercase(),
                rounds: a.rounds,
                warmup: a.warmup,
                rejected_rounds: rejected,
                round_us: col(0),
                counts_us: col(1),
                dispatch_us: col(2),
                experts_us: col(3),
                combine_us: col(4),
                status: status.to_string(),
                kernel_digest: afdep_kernels::source_digest(),
            };
            let line = serde_json::to_string(&row).expect("row serializes");
            bar.suspend(|| println!("{line}"));
            if let Some(f) = &mut json_out {
                writeln!(f, "{line}").context("writing --json-out")?;
            }
        }
        if let Some(p) = &a.output {
            let mut f = TensorFile::default();
            for (s, y) in combined.iter().enumerate() {
                f.put_bf16(
                    &format!("y.{s}"),
                    &[prob.inputs[s].routes.tokens, cfg.hidden],
                    y,
                );
            }
            f.write(p)?;
        }
        if status == "mismatch" {
            bail!("the staged engine's result differs from the oracle's exchange reference");
        }
        bar.inc(1);
    }
    bar.finish_and_clear();
    Ok(())
}
