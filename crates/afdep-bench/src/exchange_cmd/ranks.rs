//! The ranks of a run: the engines of a threaded run (one thread per rank through
//! [`afdep_moe::run_group`]; staged over any transport, fused over NvlinkIpc, eager or graph
//! replays) and of a `--multi-process` rank.

use std::net::SocketAddr;
use std::sync::Mutex;
use std::time::Duration;

use afdep_core::ExchangeConfig;
use afdep_core::oracle::LayerParams;
use afdep_core::oracle::exchange::SourceInput;
use afdep_kernels::ops::probe;
use afdep_moe::{
    DeviceExperts, DeviceRoundOptions, DispatchArm, ExchangeEngine, ExchangeError, ExpertFn,
    FusedEngine, FusedGraph, RankOutcome, RoundArm, RoundOutput, RoundTrace, StagedEngine,
    StartGate, run_group,
};
use afdep_transport::{
    AnyTransport, Bootstrap, BootstrapListener, Transport, TransportError, TransportKind,
    TransportOptions,
};
use anyhow::{Context, Result, bail};
use indicatif::ProgressBar;

use super::args::*;
use super::load::{AloneGemm, LoadSet, LoadSpec, LoadedGemm, Running};
use super::problem::*;
use super::rounds::*;

/// The fused engine's arm of `arm` (`None`: the rule).
pub(super) fn dispatch_arm(arm: ArmArg) -> Option<DispatchArm> {
    match arm {
        ArmArg::PayloadFirst => Some(DispatchArm::PayloadFirst),
        ArmArg::CountFirst => Some(DispatchArm::CountFirst),
        ArmArg::CountFirstSource => Some(DispatchArm::CountFirstSource),
        ArmArg::Auto => None,
    }
}

/// Tells the fused engine which arm to run (every round, on every rank; `auto`: the rule);
/// only arms in [`EngineKind::arms`] reach it.
pub(super) fn select_arm(eng: &mut FusedEngine, arm: ArmArg) -> Result<()> {
    eng.set_arm(dispatch_arm(arm));
    Ok(())
}

/// The arm of a captured graph for `arm` (`auto`: every arm, chosen on the device).
pub(super) fn round_arm(arm: ArmArg) -> RoundArm {
    dispatch_arm(arm).map_or(RoundArm::Auto, RoundArm::Fixed)
}

/// Runs the rounds of `prob` with one thread per rank, each building its transport with
/// `make(rank)` inside its thread; returns each rank's run (staged engine).
pub(super) fn run_threads(
    a: &ExchangeArgs,
    prob: &Problem,
    make: impl Fn(usize) -> Result<AnyTransport> + Sync,
) -> Result<Vec<RankRun>> {
    let world = prob.cfg.topology.world_size();
    let outcomes = run_group(
        (0..world).collect(),
        |rank, _| -> Result<StagedEngine<AnyTransport>> {
            Ok(StagedEngine::new(prob.cfg.clone(), make(rank)?)?)
        },
        |_, eng| rank_rounds(eng, prob, a.expert, a.warmup, a.rounds, a.fault),
    );
    by_rank(outcomes)
}

/// Each rank's result of a [`run_group`], in rank order: the first rank's error (with its
/// rank) or panic fails the run; the later failed ranks' errors are logged (a rank's timeout
/// often follows another rank's fault, which only its own error names).
pub(super) fn by_rank<R>(outcomes: Vec<RankOutcome<R, anyhow::Error>>) -> Result<Vec<R>> {
    let first_failed = outcomes.iter().position(|r| !matches!(r, Ok(Ok(_))));
    for (rank, r) in outcomes.iter().enumerate() {
        if Some(rank) == first_failed {
            continue; // returned below
        }
        match r {
            Err(_) => tracing::error!(rank, "the rank's thread panicked"),
            Ok(Err(e)) => tracing::error!(rank, error = format!("{e:#}"), "the rank failed"),
            Ok(Ok(_)) => {}
        }
    }
    outcomes
        .into_iter()
        .enumerate()
        .map(|(rank, r)| {
            r.map_err(|_| anyhow::anyhow!("a rank thread panicked"))?
                .with_context(|| format!("rank {rank}"))
        })
        .collect()
}

/// The transports of a threaded run, each taken once by its rank's thread: an in-process
/// group's (Loopback, NvlinkIpc), or one bootstrap per thread over 127.0.0.1 and the kind's
/// transport over it.
pub(super) enum RankTransports {
    /// An in-process group, by rank.
    Group(Vec<Mutex<Option<AnyTransport>>>),
    /// Rank 0's listener (taken by rank 0), the others connect to `addr`.
    Boot {
        listener: Mutex<Option<BootstrapListener>>,
        addr: SocketAddr,
        kind: TransportKind,
        opts: TransportOptions,
        world: usize,
    },
}

impl RankTransports {
    /// The transports of `world` ranks of `kind` with `opts`.
    pub(super) fn new(kind: TransportKind, world: usize, opts: &TransportOptions) -> Result<Self> {
        if matches!(kind, TransportKind::Loopback | TransportKind::NvlinkIpc) {
            let group = AnyTransport::group(kind, world, opts)?
                .into_iter()
                .map(|t| Mutex::new(Some(t)))
                .collect();
            return Ok(RankTransports::Group(group));
        }
        let any: SocketAddr = "127.0.0.1:0".parse().expect("literal address");
        let listener = Bootstrap::listen(any, world, opts.timeout)?;
        Ok(RankTransports::Boot {
            addr: listener.local_addr(),
            listener: Mutex::new(Some(listener)),
            kind,
            opts: opts.clone(),
            world,
        })
    }

    /// Rank `r`'s transport (once; in its thread: a bootstrap rank waits for the others).
    pub(super) fn take(&self, r: usize) -> Result<AnyTransport> {
        match self {
            RankTransports::Group(g) => g[r]
                .lock()
                .expect("unpoisoned")
                .take()
                .context("rank built twice"),
            RankTransports::Boot {
                listener,
                addr,
                kind,
                opts,
                world,
            } => {
                let boot = if r == 0 {
                    let l = listener
                        .lock()
                        .expect("unpoisoned")
                        .take()
                        .context("rank 0 built twice")?;
                    l.accept()?
                } else {
                    Bootstrap::connect(*addr, r, *world, opts.timeout)?
                };
                Ok(AnyTransport::connect(*kind, boot, opts)?)
            }
        }
    }

    /// The distinct devices of an in-process group's NvlinkIpc ranks not taken yet, ascending.
    fn devices(&self) -> Vec<usize> {
        let RankTransports::Group(g) = self else {
            return Vec::new();
        };
        let mut d: Vec<usize> = g
            .iter()
            .filter_map(|t| match &*t.lock().expect("unpoisoned") {
                Some(AnyTransport::Nvlink(n)) => Some(n.device()),
                _ => None,
            })
            .collect();
        d.sort_unstable();
        d.dedup();
        d
    }
}

/// The transports of a threaded staged run ([`RankTransports`]) and its rounds.
pub(super) fn run_threaded(
    a: &ExchangeArgs,
    res: &Resolved,
    prob: &Problem,
) -> Result<Vec<RankRun>> {
    let world = prob.cfg.topology.world_size();
    let transports = RankTransports::new(res.kind, world, &res.options)?;
    run_threads(a, prob, |r| transports.take(r))
}

/// A fused engine on this rank's NvlinkIpc transport, with phase timing on and `arm` selected.
pub(super) fn fused_engine(
    cfg: &ExchangeConfig,
    t: AnyTransport,
    arm: ArmArg,
) -> Result<FusedEngine> {
    let t = t
        .into_nvlink()
        .map_err(|t| anyhow::anyhow!("the fused engine needs nvlink, got {}", t.kind()))?;
    let mut eng = FusedEngine::new(cfg.clone(), t)?;
    eng.set_phase_timing(true)?;
    select_arm(&mut eng, arm)?;
    Ok(eng)
}

/// One rank of a run of device rounds: its fused engine with device rounds prepared and round
/// timing on; each round replays the graph of the run's arm, captured once (`--graph`), or
/// runs an eager device round of that arm (`--device-rounds`).
pub(super) struct DeviceRank {
    // dropped before the engine whose buffers it uses
    graph: Option<FusedGraph>,
    eng: FusedEngine,
    arm: RoundArm,
}

/// A [`DeviceRank`] over this rank's NvlinkIpc transport: device experts from `--expert` (the
/// identity with no expert kernel, exact; or the SwiGLU experts of `params`), round timing on,
/// tracing on with `--trace`, the arm selected (`auto`: the rule, on the device), the start
/// gate set when given (`--start-gate`), and with `--graph` the capture (collective).
pub(super) fn device_rank(
    a: &ExchangeArgs,
    cfg: &ExchangeConfig,
    t: AnyTransport,
    params: Option<&LayerParams>,
    gate: Option<&StartGate>,
) -> Result<DeviceRank> {
    let (arm, expert, trace, graph) = (a.arm, a.expert, a.trace.is_some(), a.graph);
    let t = t
        .into_nvlink()
        .map_err(|t| anyhow::anyhow!("the fused engine needs nvlink, got {}", t.kind()))?;
    let mut eng = FusedEngine::new(cfg.clone(), t)?;
    let experts = match (expert, params) {
        (ExpertArg::Swiglu, Some(p)) => DeviceExperts::SwiGlu(std::sync::Arc::new(p.clone())),
        (ExpertArg::Swiglu, None) => bail!("--expert swiglu without expert parameters"),
        (ExpertArg::Identity, _) => DeviceExperts::Identity,
    };
    eng.prepare_device(DeviceRoundOptions {
        experts,
        keep_received: false,
    })?;
    eng.set_round_timing(true)?;
    if trace {
        eng.set_trace(true)?;
    }
    select_arm(&mut eng, arm)?;
    if let Some(g) = gate {
        eng.set_start_gate(Some(g.clone()))?;
    }
    let arm = round_arm(arm);
    let graph = match graph {
        true => Some(eng.capture(arm)?),
        false => None,
    };
    Ok(DeviceRank { graph, eng, arm })
}

impl ExchangeEngine for DeviceRank {
    fn rank(&self) -> usize {
        self.eng.rank()
    }
    fn round(
        &mut self,
        input: Option<&SourceInput>,
        _expert: &dyn ExpertFn,
    ) -> Result<RoundOutput, ExchangeError> {
        match &self.graph {
            Some(g) => self.eng.replay(g, input),
            None => self.eng.device_round(self.arm, input),
        }
    }
    fn barrier(&mut self) -> Result<(), TransportError> {
        self.eng.transport_mut().barrier()
    }
    fn all_gather(&mut self, mine: &[u8]) -> Result<Vec<u8>, TransportError> {
        self.eng.transport_mut().all_gather(mine)
    }
    fn round_time(&self) -> Option<Duration> {
        self.eng.last_round_time()
    }
    fn round_trace(&self) -> Option<RoundTrace> {
        self.eng.last_trace().cloned()
    }
    fn round_probe(&mut self) -> Result<Option<[u64; probe::SLOTS]>, ExchangeError> {
        self.eng.take_probes()
    }
}

/// This rank's fused engine of the run: eager rounds with host experts ([`fused_engine`]), or with
/// `--graph` / `--device-rounds` device rounds ([`device_rank`]; device experts from
/// `params`; behind `gate` when given, `--start-gate`).
pub(super) fn fused_rank(
    a: &ExchangeArgs,
    cfg: &ExchangeConfig,
    t: AnyTransport,
    params: Option<&LayerParams>,
    gate: Option<&StartGate>,
) -> Result<Box<dyn ExchangeEngine>> {
    Ok(if a.device_experts() {
        Box::new(device_rank(a, cfg, t, params, gate)?)
    } else {
        Box::new(fused_engine(cfg, t, a.arm)?)
    })
}

/// This rank's NCCL device engine of the run (`--backend cuda --transport nccl`): identity
/// experts on the device, round timing on, and with `--graph` the capture (collective).
#[cfg(feature = "nccl")]
pub(super) fn nccl_device_rank(
    a: &ExchangeArgs,
    cfg: &ExchangeConfig,
    t: AnyTransport,
) -> Result<Box<dyn ExchangeEngine>> {
    let AnyTransport::Nccl(t) = t else {
        bail!(
            "the NCCL device engine needs --transport nccl, got {}",
            t.kind()
        );
    };
    let experts = match a.expert {
        ExpertArg::Identity => DeviceExperts::Identity,
        ExpertArg::Swiglu => {
            return Err(Unsupported {
                engine: EngineKind::NcclDevice.name(),
                what: "expert swiglu".into(),
                have: "identity".into(),
            }
            .into());
        }
    };
    let mut eng = afdep_moe::NcclDeviceEngine::new(cfg.clone(), t, &experts)?;
    eng.set_round_timing(true)?;
    if a.graph {
        eng.capture()?;
    }
    Ok(Box::new(eng))
}

/// Without the cargo feature `nccl` there is no NCCL device engine.
#[cfg(not(feature = "nccl"))]
pub(super) fn nccl_device_rank(
    _a: &ExchangeArgs,
    _cfg: &ExchangeConfig,
    _t: AnyTransport,
) -> Result<Box<dyn ExchangeEngine>> {
    bail!("the NCCL device engine needs afdep built with the cargo feature `nccl`")
}

/// A problem's runs in a threaded run: every rank's (with `--load`, the rounds under load),
/// and with `--load` the same rounds alone and the load's measurements.
pub(super) struct ProblemRuns {
    pub(super) runs: Vec<RankRun>,
    pub(super) load: Option<LoadRuns>,
}

/// The `--load` part of a problem's runs.
pub(super) struct LoadRuns {
    pub(super) spec: LoadSpec,
    /// Every rank's run of the same rounds without the load (before the loaded ones).
    pub(super) alone: Vec<RankRun>,
    /// The GEMM alone, per device (right before the loaded rounds).
    pub(super) gemm_alone: Vec<AloneGemm>,
    /// The GEMM while the rounds ran, per device, checked.
    pub(super) gemm_loaded: Vec<LoadedGemm>,
}

/// One rank's share of a problem: its run (under load with `--load`) and, with `--load`, its
/// run alone and (rank 0) the load's measurements.
type RankProblem = (
    RankRun,
    Option<RankRun>,
    Option<(Vec<AloneGemm>, Vec<LoadedGemm>)>,
);

/// One rank's rounds of `prob`; with a load, the rounds alone, then (rank 0 between barriers:
/// the GEMM alone, the load started) the same rounds under load, then (rank 0, after a
/// barrier) the load stopped and checked. The [`Running`] guard stops
/// the load on every error path.
fn rank_problem(
    a: &ExchangeArgs,
    rank: usize,
    eng: &mut dyn ExchangeEngine,
    prob: &Problem,
    load: Option<&LoadSet>,
) -> Result<RankProblem> {
    let first = rank_rounds(eng, prob, a.expert, a.warmup, a.rounds, a.fault)?;
    let Some(set) = load else {
        return Ok((first, None, None));
    };
    eng.barrier()?;
    let gemm_alone = match rank {
        0 => Some(set.alone()?),
        _ => None,
    };
    let running = match rank {
        0 => Some(set.run()?),
        _ => None,
    };
    eng.barrier()?;
    let loaded = rank_rounds(eng, prob, a.expert, a.warmup, a.rounds, a.fault)?;
    eng.barrier()?;
    let gemm_loaded = running.map(Running::stop).transpose()?;
    Ok((loaded, Some(first), gemm_alone.zip(gemm_loaded)))
}

/// A threaded fused run: one in-process NvlinkIpc group and one engine per rank thread for all
/// the problems (set up once: windows, kernel loads, the graph; with `--load`, the load's
/// workers on the group's devices before them); returns each problem's runs. No engine is
/// dropped before every rank has finished (see the fused engine's docs).
pub(super) fn run_fused_threads(
    a: &ExchangeArgs,
    res: &Resolved,
    probs: &[Problem],
    bar: &ProgressBar,
) -> Result<Vec<ProblemRuns>> {
    let world = res.cfg.topology.world_size();
    let transports = RankTransports::new(res.kind, world, &res.options)?;
    // the load's workers are set up (and dropped: stopped, joined) outside the rank threads
    let load = match a.load {
        Some(spec) => Some(LoadSet::new(
            spec,
            &transports.devices(),
            res.options.timeout,
        )?),
        None => None,
    };
    // one start gate for the group (`--start-gate`), tied to the ranks' one context
    let gate = a.start_gate.then(StartGate::new);
    let outcomes = run_group(
        (0..world).collect(),
        |rank, _| -> Result<Box<dyn ExchangeEngine>> {
            let t = transports.take(rank)?;
            match res.engine {
                EngineKind::NcclDevice => nccl_device_rank(a, &res.cfg, t),
                _ => fused_rank(
                    a,
                    &res.cfg,
                    t,
                    rank_params(probs, a.device_experts())?,
                    gate.as_ref(),
                ),
            }
        },
        |rank, eng| {
            let mut out = Vec::with_capacity(probs.len());
            for prob in probs {
                out.push(rank_problem(a, rank, eng.as_mut(), prob, load.as_ref())?);
                if rank == 0 {
                    bar.inc(1);
                }
            }
            Ok(out)
        },
    );
    let per_rank: Vec<Vec<RankProblem>> = by_rank(outcomes)?;
    // transpose to [problem][rank]
    let mut out: Vec<ProblemRuns> = (0..probs.len())
        .map(|_| ProblemRuns {
            runs: Vec::new(),
            load: load.as_ref().map(|l| LoadRuns {
                spec: l.spec(),
                alone: Vec::new(),
                gemm_alone: Vec::new(),
                gemm_loaded: Vec::new(),
            }),
        })
        .collect();
    for runs in per_rank {
        for (p, (run, alone, gemm)) in runs.into_iter().enumerate() {
            out[p].runs.push(run);
            if let Some(l) = out[p].load.as_mut() {
                l.alone.extend(alone);
                if let Some((g_alone, g_loaded)) = gemm {
                    l.gemm_alone = g_alone;
                    l.gemm_loaded = g_loaded;
                }
            }
        }
    }
    Ok(out)
}
