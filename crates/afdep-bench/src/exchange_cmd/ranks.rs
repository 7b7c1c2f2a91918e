//! The ranks of a run: the engines of a threaded run (one thread per rank through
//! [`afdep_moe::run_group`]; staged over any transport, fused over NvlinkIpc, eager or graph
//! replays) and of a `--multi-process` rank.

use std::net::SocketAddr;
use std::sync::Mutex;
use std::time::Duration;

use afdep_core::ExchangeConfig;
use afdep_core::oracle::LayerParams;
use afdep_core::oracle::exchange::SourceInput;
use afdep_moe::{
    DeviceExperts, DeviceRoundOptions, DispatchArm, ExchangeEngine, ExchangeError, ExpertFn,
    FusedEngine, FusedGraph, RankOutcome, RoundArm, RoundOutput, RoundTrace, StagedEngine,
    run_group,
};
use afdep_transport::{AnyTransport, Bootstrap, Transport, TransportError, TransportKind};
use anyhow::{Context, Result, bail};
use indicatif::ProgressBar;

use super::args::*;
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
/// rank) or panic fails the run.
pub(super) fn by_rank<R>(outcomes: Vec<RankOutcome<R, anyhow::Error>>) -> Result<Vec<R>> {
    outcomes
        .into_iter()
        .enumerate()
        .map(|(rank, r)| {
            r.map_err(|_| anyhow::anyhow!("a rank thread panicked"))?
                .with_context(|| format!("rank {rank}"))
        })
        .collect()
}

/// The transports of a threaded staged run: an in-process group (Loopback, NvlinkIpc), or one
/// bootstrap per thread over 127.0.0.1 and the kind's transport over it.
pub(super) fn run_threaded(
    a: &ExchangeArgs,
    res: &Resolved,
    prob: &Problem,
) -> Result<Vec<RankRun>> {
    let world = prob.cfg.topology.world_size();
    let (kind, opts) = (res.kind, &res.options);
    if matches!(kind, TransportKind::Loopback | TransportKind::NvlinkIpc) {
        let group: Vec<Mutex<Option<AnyTransport>>> = AnyTransport::group(kind, world, opts)?
            .into_iter()
            .map(|t| Mutex::new(Some(t)))
            .collect();
        return run_threads(a, prob, |r| {
            group[r]
                .lock()
                .expect("unpoisoned")
                .take()
                .context("rank built twice")
        });
    }
    let any: SocketAddr = "127.0.0.1:0".parse().expect("literal address");
    let listener = Mutex::new(Some(Bootstrap::listen(any, world, opts.timeout)?));
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
            Bootstrap::connect(addr, r, world, opts.timeout)?
        };
        Ok(AnyTransport::connect(kind, boot, opts)?)
    })
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

/// One rank of a `--graph` run: its fused engine with device rounds prepared and round timing
/// on, and the graph of the run's arm, captured once; each round replays it.
pub(super) struct GraphRank {
    // dropped before the engine whose buffers it uses
    pub(super) graph: FusedGraph,
    pub(super) eng: FusedEngine,
}

/// One rank of a `--device-rounds` run: its fused engine with device rounds prepared and round
/// timing on; each round is an eager device round of `arm`.
pub(super) struct DeviceRank {
    pub(super) eng: FusedEngine,
    pub(super) arm: RoundArm,
}

/// This rank's fused engine over its NvlinkIpc transport with device rounds prepared (device
/// experts from `expert`: the identity with no expert kernel, exact; or the SwiGLU experts of
/// `params`), round timing on, tracing on with `trace`, and the arm selected (`auto`: the
/// rule, on the device).
fn device_engine(
    cfg: &ExchangeConfig,
    t: AnyTransport,
    arm: ArmArg,
    expert: ExpertArg,
    params: Option<&LayerParams>,
    trace: bool,
) -> Result<FusedEngine> {
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
    Ok(eng)
}

/// A [`GraphRank`]: [`device_engine`], then the capture (collective).
pub(super) fn graph_rank(
    cfg: &ExchangeConfig,
    t: AnyTransport,
    arm: ArmArg,
    expert: ExpertArg,
    params: Option<&LayerParams>,
    trace: bool,
) -> Result<GraphRank> {
    let mut eng = device_engine(cfg, t, arm, expert, params, trace)?;
    let graph = eng.capture(round_arm(arm))?;
    Ok(GraphRank { graph, eng })
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
        self.eng.device_round(self.arm, input)
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
}

impl ExchangeEngine for GraphRank {
    fn rank(&self) -> usize {
        self.eng.rank()
    }
    fn round(
        &mut self,
        input: Option<&SourceInput>,
        _expert: &dyn ExpertFn,
    ) -> Result<RoundOutput, ExchangeError> {
        self.eng.replay(&self.graph, input)
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
}

/// This rank's fused engine of the run: host-planned eager rounds ([`fused_engine`]), with
/// `--graph` graph replays ([`graph_rank`]), with `--device-rounds` eager device rounds
/// ([`DeviceRank`]); device experts from `params`.
pub(super) fn fused_rank(
    a: &ExchangeArgs,
    cfg: &ExchangeConfig,
    t: AnyTransport,
    params: Option<&LayerParams>,
) -> Result<Box<dyn ExchangeEngine>> {
    let trace = a.trace.is_some();
    Ok(if a.graph {
        Box::new(graph_rank(cfg, t, a.arm, a.expert, params, trace)?)
    } else if a.device_rounds {
        Box::new(DeviceRank {
            eng: device_engine(cfg, t, a.arm, a.expert, params, trace)?,
            arm: round_arm(a.arm),
        })
    } else {
        Box::new(fused_engine(cfg, t, a.arm)?)
    })
}

/// A threaded fused run: one in-process NvlinkIpc group and one engine per rank thread for all
/// the problems (set up once: windows, kernel loads, the graph); returns `[problem][rank]`. No
/// engine is dropped before every rank has finished (see the fused engine's docs).
pub(super) fn run_fused_threads(
    a: &ExchangeArgs,
    res: &Resolved,
    probs: &[Problem],
    bar: &ProgressBar,
) -> Result<Vec<Vec<RankRun>>> {
    let world = res.cfg.topology.world_size();
    let group = AnyTransport::group(res.kind, world, &res.options)?;
    let outcomes = run_group(
        group,
        |_, t| fused_rank(a, &res.cfg, t, rank_params(probs, a.device_experts())?),
        |rank, eng| {
            let mut out = Vec::with_capacity(probs.len());
            for prob in probs {
                out.push(rank_rounds(
                    eng.as_mut(),
                    prob,
                    a.expert,
                    a.warmup,
                    a.rounds,
                    a.fault,
                )?);
                if rank == 0 {
                    bar.inc(1);
                }
            }
            Ok(out)
        },
    );
    let per_rank: Vec<Vec<RankRun>> = by_rank(outcomes)?;
    // transpose to [problem][rank]
    let mut out: Vec<Vec<RankRun>> = (0..probs.len()).map(|_| Vec::new()).collect();
    for runs in per_rank {
        for (p, run) in runs.into_iter().enumerate() {
            out[p].push(run);
        }
    }
    Ok(out)
}
