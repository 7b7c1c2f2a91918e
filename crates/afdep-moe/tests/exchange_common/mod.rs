//! Helpers shared by the exchange-engine GPU tests (`gpu_nvlink`): configs, random sources with
//! a hot expert and masked slots, one round per rank on threads over any engine, and the check
//! against the oracle. Also used by `tests/staged.rs`.
#![allow(dead_code)] // each test binary uses its own subset

use afdep_core::oracle::LayerParams;
use afdep_core::oracle::exchange::{self as reference, SourceInput};
use afdep_core::oracle::layer;
use afdep_core::route::{MASKED, Routes};
use afdep_core::tensor::{rng, uniform_bf16};
use afdep_core::{ExchangeConfig, LayerShape, PayloadKind, RouteError, bf16};
use afdep_moe::{
    DeviceExperts, DeviceRoundOptions, DispatchArm, ExchangeEngine, ExchangeError, ExpertFn,
    FusedEngine, RankOutcome, RoundOutput, StagedEngine,
};
use afdep_transport::Transport;
use afdep_transport::{NvlinkIpc, NvlinkOptions, TransportError};
use rand::Rng;
use rand::seq::SliceRandom;
use std::time::Duration;

/// One test at a time within a test binary: the fused engine's waiting kernels spin on the
/// shared GPU while they wait for their peers, so two groups must not run at once, and another
/// test's module loads or frees could synchronise the context.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Holds the test lock (a panicked test's lock is taken over).
pub fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

pub use afdep_transport::testing::nvlink_group;

/// [`nvlink_group`] of `n` ranks for fused engines of `cfg`: `staging_bytes` of staging, the
/// workspace [`FusedEngine::workspace_bytes`] asks for, and `timeout`.
pub fn fused_group(
    n: usize,
    cfg: &ExchangeConfig,
    staging_bytes: usize,
    timeout: Duration,
) -> Option<Vec<NvlinkIpc>> {
    let opts = NvlinkOptions {
        staging_bytes,
        workspace_bytes: FusedEngine::workspace_bytes(cfg),
        timeout,
    };
    nvlink_group(n, opts)
}

/// Runs `work(rank, engine)` for every rank of `group` on its own thread, on a fused engine for
/// `c` prepared for device rounds with the index-scale experts (`keep_received` as given).
/// Returns what each rank's `work` returned, in rank order: the results, and each rank's
/// engine with what `work` kept (its graphs), for the caller to drop only after every rank's
/// thread is done.
pub fn on_fused_ranks<R: Send, K: Send>(
    group: Vec<NvlinkIpc>,
    c: &ExchangeConfig,
    keep_received: bool,
    work: impl Fn(usize, &mut FusedEngine) -> (R, K) + Sync,
) -> (Vec<R>, Vec<(FusedEngine, K)>) {
    let work = &work;
    let mut keep = Vec::new();
    let out = std::thread::scope(|sc| {
        let hs: Vec<_> = group
            .into_iter()
            .enumerate()
            .map(|(rank, t)| {
                let cfg = c.clone();
                sc.spawn(move || {
                    let mut eng = FusedEngine::new(cfg.clone(), t).expect("set-up");
                    eng.prepare_device(DeviceRoundOptions {
                        experts: DeviceExperts::index_scale(cfg.experts),
                        keep_received,
                    })
                    .expect("device buffers");
                    let (out, kept) = work(rank, &mut eng);
                    (out, eng, kept)
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| {
                let (out, eng, kept) = h.join().expect("rank thread panicked");
                keep.push((eng, kept));
                out
            })
            .collect()
    });
    (out, keep)
}

/// A staged engine over NvlinkIpc (the `make` of [`run_group`]).
pub fn staged(
    _rank: usize,
    cfg: ExchangeConfig,
    t: NvlinkIpc,
) -> Result<StagedEngine<NvlinkIpc>, ExchangeError> {
    StagedEngine::new(cfg, t)
}

/// A fused engine (the `make` of [`run_group`]).
pub fn fused(
    _rank: usize,
    cfg: ExchangeConfig,
    t: NvlinkIpc,
) -> Result<FusedEngine, ExchangeError> {
    FusedEngine::new(cfg, t)
}

/// Checks a rejected round: every rank got a route error that it reports itself, and
/// `check(rank, error)` checks the error; any other result fails the test with
/// `{what}rank {rank}: expected {expected}, got {other:?}`.
pub fn check_route_errors(
    got: &[RankResult],
    what: &str,
    expected: &dyn std::fmt::Display,
    mut check: impl FnMut(usize, &RouteError),
) {
    for (rank, r) in got.iter().enumerate() {
        match r {
            Err(ExchangeError::Route { reporter, error }) => {
                assert_eq!(*reporter, rank);
                check(rank, error);
            }
            other => panic!("{what}rank {rank}: expected {expected}, got {other:?}"),
        }
    }
}

/// What one rank gets from one round.
pub type RankResult = Result<RoundOutput, ExchangeError>;

/// A fused engine that runs round i with `arms[i % arms.len()]` (`None`: the knob's rule) and
/// records the arm each round ran.
pub struct Cycling {
    pub eng: FusedEngine,
    pub arms: Vec<Option<DispatchArm>>,
    pub ran: Vec<DispatchArm>,
}

impl ExchangeEngine for Cycling {
    fn rank(&self) -> usize {
        self.eng.rank()
    }
    fn round(&mut self, input: Option<&SourceInput>, expert: &dyn ExpertFn) -> RankResult {
        let arm = self.arms[self.ran.len() % self.arms.len()];
        self.eng.set_arm(arm);
        let r = self.eng.round(input, expert);
        self.ran.push(self.eng.last_arm());
        r
    }
    fn barrier(&mut self) -> Result<(), TransportError> {
        self.eng.transport_mut().barrier()
    }
    fn all_gather(&mut self, mine: &[u8]) -> Result<Vec<u8>, TransportError> {
        self.eng.transport_mut().all_gather(mine)
    }
}

/// The three arms, forced.
pub const FORCED: [Option<DispatchArm>; 3] = [
    Some(DispatchArm::PayloadFirst),
    Some(DispatchArm::CountFirst),
    Some(DispatchArm::CountFirstSource),
];

/// Runs `rounds`, each once per arm of `arms` in turn (round-major), on one fused group `g`
/// ([`Cycling`] engines: the arms switch from round to round on the same engines). Returns
/// `[round][arm][rank]`.
pub fn run_arms_on(
    g: Vec<NvlinkIpc>,
    c: &ExchangeConfig,
    rounds: &[Vec<SourceInput>],
    arms: &[Option<DispatchArm>],
    p: Option<&LayerParams>,
) -> Vec<Vec<Vec<RankResult>>> {
    let world = c.topology.world_size();
    let expanded: Vec<Vec<SourceInput>> = rounds
        .iter()
        .flat_map(|r| std::iter::repeat_n(r.clone(), arms.len()))
        .collect();
    let arms_v = arms.to_vec();
    let make = move |_rank: usize, cfg: ExchangeConfig, t: NvlinkIpc| {
        Ok(Cycling {
            eng: FusedEngine::new(cfg, t)?,
            arms: arms_v.clone(),
            ran: Vec::new(),
        })
    };
    let got = run_group(g, &vec![c.clone(); world], &expanded, p, &make)
        .unwrap_or_else(|e| panic!("{}: set-up failed: {e:?}", c.topology));
    let mut out: Vec<Vec<Vec<RankResult>>> = Vec::new();
    let mut it = got.into_iter();
    for _ in rounds {
        out.push(
            (0..arms.len())
                .map(|_| it.next().expect("a round"))
                .collect(),
        );
    }
    out
}

/// The expert function of the tests: the layer's SwiGLU experts, or a cheap scaling.
pub fn expert_of(p: Option<&LayerParams>) -> impl Fn(usize, &[bf16], usize) -> Vec<bf16> + '_ {
    move |e: usize, rows: &[bf16], n: usize| match p {
        Some(p) => layer::expert_rows(p, e, rows, n).unwrap(),
        None => rows
            .iter()
            .map(|v| bf16::from_f32(v.to_f32() * (e as f32 + 1.0)))
            .collect(),
    }
}

/// Runs `rounds` on one group ([`afdep_moe::run_group`]): `make(rank, cfg, transport)` builds
/// each rank's engine on its own thread. Returns `[round][rank]` results, or every rank's set-up
/// error. The engines are dropped only after every rank's thread is done, so no rank frees
/// device memory (which may synchronise the device) while another rank's kernel still waits for
/// its peers.
pub fn run_group<T: Send, E: ExchangeEngine>(
    group: Vec<T>,
    cfgs: &[ExchangeConfig],
    rounds: &[Vec<SourceInput>],
    p: Option<&LayerParams>,
    make: &(dyn Fn(usize, ExchangeConfig, T) -> Result<E, ExchangeError> + Sync),
) -> Result<Vec<Vec<RankResult>>, Vec<ExchangeError>> {
    let world = cfgs[0].topology.world_size();
    let per_rank = afdep_moe::run_group(
        group,
        |rank, t| make(rank, cfgs[rank].clone(), t),
        |rank, eng| {
            let expert = expert_of(p);
            let s = cfgs[rank].topology.attention_index(rank);
            Ok(rounds
                .iter()
                .map(|inp| eng.round(s.map(|s| &inp[s]), &expert))
                .collect::<Vec<RankResult>>())
        },
    );
    let mut ok = Vec::new();
    let mut errs = Vec::new();
    for r in per_rank {
        match r.unwrap_or_else(|panic| std::panic::resume_unwind(panic)) {
            Ok(v) => ok.push(v),
            Err(e) => errs.push(e),
        }
    }
    if !errs.is_empty() {
        assert_eq!(
            errs.len(),
            world,
            "set-up failed on some ranks only: {errs:?}"
        );
        return Err(errs);
    }
    let nr = rounds.len();
    let mut out: Vec<Vec<RankResult>> = (0..nr).map(|_| Vec::new()).collect();
    for rank_results in ok {
        for (i, r) in rank_results.into_iter().enumerate() {
            out[i].push(r);
        }
    }
    Ok(out)
}

/// Each rank's result of an [`afdep_moe::run_group`], by rank: a rank's panic is raised again
/// here, a set-up error fails the test naming its rank.
pub fn per_rank<R>(outcomes: Vec<RankOutcome<R, ExchangeError>>) -> Vec<R> {
    outcomes
        .into_iter()
        .enumerate()
        .map(|(rank, o)| {
            o.unwrap_or_else(|panic| std::panic::resume_unwind(panic))
                .unwrap_or_else(|e| panic!("rank {rank}: {e}"))
        })
        .collect()
}

/// The rounds of the every-ratio test for `c`: uneven ranks with a hot expert, one token each,
/// no token anywhere, and a bigger uneven round with a zero-token rank.
pub fn every_ratio_rounds(c: &ExchangeConfig) -> Vec<Vec<SourceInput>> {
    let a = c.topology.attention_count();
    let token_sets: [&[usize]; 3] = [&[7, 0, 13, 2], &[1, 1, 1, 1], &[0, 0, 0, 0]];
    token_sets
        .iter()
        .enumerate()
        .map(|(i, t)| {
            sources(
                c,
                &t[..a],
                if i == 0 { Some(5) } else { None },
                i as u64 + 1,
            )
        })
        .chain(std::iter::once(sources(
            c,
            &[33, 5, 0, 20][..a],
            Some(11),
            9,
        )))
        .collect()
}

pub fn cfg(topo: &str, hidden: usize, experts: usize, top_k: usize) -> ExchangeConfig {
    ExchangeConfig::new(topo.parse().unwrap(), hidden, experts, top_k, 64).unwrap()
}

/// [`cfg`] with 12 experts (a multiple of 1, 3 and 4 FFN ranks), `top_k`, `capacity` and
/// `payload`: hidden `bf16_hidden` for bf16, 128 (one whole scale group) for fp8. Not yet
/// validated.
pub fn payload_cfg(
    topo: &str,
    payload: PayloadKind,
    bf16_hidden: usize,
    top_k: usize,
    capacity: usize,
) -> ExchangeConfig {
    let hidden = match payload {
        PayloadKind::Bf16 => bf16_hidden,
        PayloadKind::Fp8E4m3 => 128,
    };
    let mut c = cfg(topo, hidden, 12, top_k);
    c.capacity = capacity;
    c.payload = payload;
    c
}

pub fn params(cfg: &ExchangeConfig, width: usize, seed: u64) -> LayerParams {
    LayerParams::random(
        LayerShape {
            d_model: cfg.hidden,
            width,
            experts: cfg.experts,
            top_k: cfg.top_k,
            shared: 0,
            renormalize: true,
        },
        seed,
    )
}

/// Random routes: distinct experts per token, every 4th slot masked at random, and, when `hot`
/// is set, expert `hot` in slot 0 of 90% of the tokens.
pub fn routes(tokens: usize, k: usize, owned: usize, hot: Option<i32>, seed: u64) -> Routes {
    let mut r = rng(seed, 7);
    let mut idx = Vec::new();
    let mut weights = Vec::new();
    for _ in 0..tokens {
        let mut ids: Vec<i32> = (0..owned as i32).collect();
        ids.shuffle(&mut r);
        let mut sel: Vec<i32> = ids[..k].to_vec();
        if let Some(h) = hot {
            if r.gen_bool(0.9) {
                if let Some(p) = sel.iter().position(|&e| e == h) {
                    sel.swap(0, p);
                } else {
                    sel[0] = h;
                }
            }
        }
        for e in sel {
            idx.push(if r.gen_bool(0.25) { MASKED } else { e });
            weights.push(r.gen_range(0.05f32..1.0));
        }
    }
    Routes {
        tokens,
        top_k: k,
        idx,
        weights,
    }
}

/// Routes with no random generator: slot 0 of a token goes to expert `hot`, but on every
/// `hot_every`-th token (t = 0, `hot_every`, ...) to `(7t + seed) mod experts`; slot j to the
/// expert 3j after slot 0's; the slots (t, j) where `masked(t, j)` are masked.
pub fn patterned_routes(
    tokens: usize,
    k: usize,
    experts: usize,
    seed: usize,
    (hot_every, hot): (usize, usize),
    masked: impl Fn(usize, usize) -> bool,
) -> Routes {
    let mut idx = Vec::with_capacity(tokens * k);
    let mut weights = Vec::with_capacity(tokens * k);
    for t in 0..tokens {
        let base = if t % hot_every != 0 {
            hot
        } else {
            (t * 7 + seed) % experts
        };
        for j in 0..k {
            idx.push(if masked(t, j) {
                MASKED
            } else {
                ((base + j * 3) % experts) as i32
            });
            weights.push(0.05 + ((t * 11 + j * 5) % 19) as f32 / 19.0);
        }
    }
    Routes {
        tokens,
        top_k: k,
        idx,
        weights,
    }
}

pub fn sources(
    cfg: &ExchangeConfig,
    tokens: &[usize],
    hot: Option<i32>,
    seed: u64,
) -> Vec<SourceInput> {
    tokens
        .iter()
        .enumerate()
        .map(|(s, &t)| SourceInput {
            x: uniform_bf16(t * cfg.hidden, 1.0, seed, 50 + s as u64),
            routes: routes(
                t,
                cfg.top_k,
                cfg.placement().owned(),
                hot,
                seed * 31 + s as u64,
            ),
        })
        .collect()
}

/// Checks one round: every source's combine bit for bit, every FFN rank's received views.
pub fn check_round(
    cfg: &ExchangeConfig,
    inp: &[SourceInput],
    got: &[RankResult],
    p: Option<&LayerParams>,
) {
    check_round_with(cfg, inp, got, expert_of(p));
}

/// [`check_round`] against the oracle with the expert function `expert`.
pub fn check_round_with(
    cfg: &ExchangeConfig,
    inp: &[SourceInput],
    got: &[RankResult],
    expert: impl Fn(usize, &[bf16], usize) -> Vec<bf16>,
) {
    let want_rx = reference::dispatch(cfg, inp).unwrap();
    let want = reference::exchange(cfg, inp, expert).unwrap();
    for (rank, r) in got.iter().enumerate() {
        let r = r.as_ref().unwrap_or_else(|e| panic!("rank {rank}: {e}"));
        if let Some(s) = cfg.topology.attention_index(rank) {
            let c = r.combined.as_ref().expect("attention rank combines");
            assert!(c.iter().all(|v| !v.is_nan()), "NaN in rank {rank}'s output");
            // bitwise: compare the bits so that -0/+0 differences fail too
            let bits = |v: &[bf16]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(
                bits(c),
                bits(&want[s]),
                "{}: combine of source {s} differs",
                cfg.topology
            );
        }
        if let Some(f) = cfg.topology.ffn_index(rank) {
            let rx = r.received.as_ref().expect("FFN rank receives");
            assert_eq!(
                rx, &want_rx[f],
                "{}: dispatch to FFN rank {f} differs",
                cfg.topology
            );
        }
    }
}

/// Routes with no masked slot (slot j of token t of source i: expert (t + i + 3j) mod the owned
/// experts, distinct within a token for top-k up to the owned experts / 3) over [`sources`]'
/// rows, so that a test's corruption lands where the error it expects says.
pub fn fixed_sources(c: &ExchangeConfig, tokens: &[usize], seed: u64) -> Vec<SourceInput> {
    let mut s = sources(c, tokens, None, seed);
    let owned = c.placement().owned();
    for (i, inp) in s.iter_mut().enumerate() {
        let k = c.top_k;
        for t in 0..inp.routes.tokens {
            for j in 0..k {
                inp.routes.idx[t * k + j] = ((t + i + j * 3) % owned) as i32;
            }
        }
    }
    s
}

/// The parts of a round's output that engines must agree on (not the times): the combined
/// output's bits and what the FFN rank received.
pub fn parts(r: &RoundOutput) -> (Option<Vec<u16>>, Option<reference::FfnReceived>) {
    (
        r.combined
            .as_ref()
            .map(|c| c.iter().map(|v| v.to_bits()).collect()),
        r.received.clone(),
    )
}

/// `c` with bf16 combine partials ([`afdep_core::CombinePartials::Bf16`]), validated.
pub fn bf16_partials(mut c: ExchangeConfig) -> ExchangeConfig {
    c.partials = afdep_core::CombinePartials::Bf16;
    c.validate().unwrap();
    c
}

/// Checks a round run with bf16 partials against the exact path: every source's output lies
/// within the oracle's bound ([`reference::partials_bound`]) of the f32-partials oracle's, and
/// is the same bits where the bound is 0 (a token whose slots sit on one FFN rank). Returns how
/// many elements differ from the exact result (the caller checks that the knob took effect:
/// none on one FFN rank, some on several). [`check_round`] with `cfg` is the bit-for-bit check
/// against the oracle with bf16 partials.
pub fn check_partials_bound(
    cfg: &ExchangeConfig,
    inp: &[SourceInput],
    got: &[RankResult],
    expert: impl Fn(usize, &[bf16], usize) -> Vec<bf16>,
) -> usize {
    let b = reference::partials_bound(cfg, inp, expert).unwrap();
    let mut outs = vec![Vec::new(); inp.len()];
    for (rank, r) in got.iter().enumerate() {
        let r = r.as_ref().unwrap_or_else(|e| panic!("rank {rank}: {e}"));
        if let Some(s) = cfg.topology.attention_index(rank) {
            outs[s] = r.combined.clone().expect("attention rank combines");
        }
    }
    if let Some(v) = b.first_violation(&outs) {
        panic!("{}: outside the bf16-partials bound: {v:?}", cfg.topology);
    }
    outs.iter()
        .flatten()
        .zip(b.exact.iter().flatten())
        .filter(|(g, e)| g.to_bits() != e.to_bits())
        .count()
}

/// The checks of [`check_partials_bound`]'s count over a test's rounds: with one FFN rank
/// nothing may differ from the exact result, with several something must (else the knob was
/// ignored, or the inputs cannot tell).
pub fn check_partials_took_effect(cfg: &ExchangeConfig, differing: usize) {
    if cfg.topology.ffn_count() == 1 {
        assert_eq!(
            differing, 0,
            "{}: one FFN rank, yet bf16 partials changed the result",
            cfg.topology
        );
    } else {
        assert!(
            differing > 0,
            "{}: bf16 partials gave the exact result everywhere",
            cfg.topology
        );
    }
}
