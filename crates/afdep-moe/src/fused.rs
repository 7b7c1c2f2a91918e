//! The fused exchange engine (payload-first and count-first dispatch; bf16 and fp8 payloads in
//! every arm, host-planned or in device rounds): GPU-initiated stores into the symmetric
//! workspaces of an [`NvlinkIpc`] group, one kernel per phase, flags with release / acquire
//! semantics and bounded device waits.
//!
//! One round, on every rank (each calls [`FusedEngine::round`], the same API as
//! [`StagedEngine`](crate::StagedEngine)):
//!
//! 1. **status + counts** (host, one control-plane all-gather; the staged engine's phase): a
//!    rejected route fails every rank with [`ExchangeError::Route`] before anything moves, and
//!    every rank computes every FFN rank's [`FfnPlan`]. The round then runs one
//!    [`DispatchArm`], the same on every rank: payload-first (steps 2 and 3 below) or
//!    count-first (device counts, prefix sums and offsets, then the streaming epilogue or the
//!    source arm: [Count-first](self#count-first) below), chosen by `knobs.min_token_bucket`
//!    ([`DispatchArm::select`]) unless [`FusedEngine::set_arm`] forces one.
//! 2. **dispatch** (source, `afdep_fused_dispatch`): each token row bound for FFN rank f is
//!    stored, with its metadata (token, local ids, weights, expanded rows), into this source's
//!    slab in f's workspace through the peer table; then `afdep_fused_signal` raises this
//!    source's dispatch flag in every FFN rank to the round number (release, system scope).
//!    With fp8 payloads (`afdep_fused_dispatch_fp8`) each row is quantised while it is stored:
//!    its e4m3 codes and one f32 scale per 128 channels ([`afdep_core::fp8`], bit for bit the
//!    host encoder) take the payload's place in the slab row.
//! 3. **copy epilogue** (FFN, `afdep_fused_copy_epilogue`): waits (bounded) for every source's
//!    flag, then expands the slabs into the expanded layout (one row per (token, local expert),
//!    grouped by local expert, [`FfnPlan`]'s offsets). The slabs are the compact collect view.
//!    fp8 (`afdep_fused_copy_epilogue_fp8`): codes and scales are expanded, and the dequantised
//!    bf16 rows (`bf16(f32(q) · scale)`) written beside them for the experts;
//!    [`FfnReceived::fp8`] carries codes and scales of both views.
//! 4. **experts** (FFN, host in a host-planned round: the expanded rows are read back, the
//!    [`ExpertFn`] applied per local expert, the outputs uploaded; on the device in a device
//!    round, below).
//! 5. **combine**, split at the fixed order (docs/design.md, "Specification: AFD exchange"). FFN
//!    rank f (`afdep_fused_combine_reduce`): for every compact row of the round (source s, token t;
//!    its slab metadata names the token's slots on f, their weights and expanded rows) the partial
//!    `P_f[t] = Σ_{k ascending, expert on f} w_k · y_k` in f32 (each product and sum rounded),
//!    stored as `hidden` f32 into row (f, t) of the return area in s's workspace; then f's combine
//!    flag is raised in every source. The source (`afdep_fused_combine`) waits (bounded) for every
//!    FFN rank's flag and adds the partials of the FFN ranks that own a slot of the token,
//!    ascending, in f32, cast to bf16 once: the same operations in the same order as one sum, so
//!    bit-identical to the oracle and the staged engine. One f32 row per (token, FFN rank) travels
//!    back instead of one bf16 row per slot: a quarter of the bytes when all 8 slots of a token are
//!    on one FFN rank (3A:1F), about the same at 2 slots per rank.
//!    With bf16 partials ([`afdep_core::CombinePartials::Bf16`], opt-in, fingerprinted) the FFN
//!    rank rounds each partial to bf16 (nearest even) and stores `hidden` bf16, half the return
//!    bytes; the source widens them back and sums as before: bit-identical to the oracle with
//!    bf16 partials, within [`afdep_core::oracle::exchange::bf16_partials_error_bound`] of the
//!    f32 path (and the same bits as it where a token's slots sit on one FFN rank). The setting
//!    is a run-time field of the workspace layout both combine kernels read, in every arm, in
//!    host-planned and device rounds and in graphs.
//!
//! # Workspace (bytes from every rank's workspace base, the same on every rank)
//!
//! ```text
//! 0      dispatch flags  u32[world]  (indexed by source rank)
//! 256    combine flags   u32[world]  (indexed by FFN rank)
//! 512    error word      u32[4]      {code, peer, round, 0}
//! 768    control block   u32[16]     {round, verdict, route word[6], tokens, arm request,
//!                                     arm, ...}
//! 1024   slabs           world × capacity rows of slab_row_bytes_for(payload, hidden, K)
//!                        (by source rank)
//! ret    return areas    ffn_ranks × capacity rows of hidden f32 (bf16 partials: hidden bf16)
//!                        (by FFN index; token t of the round's partial of FFN index f at row
//!                        f·capacity + t)
//! cf     count-first     count flags, offset flags, counts, offsets, plan, row flags,
//!                        expanded area (bf16; fp8: dequantised, then the rows' codes and
//!                        scales) (`layout/fused.cuh`; 256-byte aligned after ret)
//! status device rounds'  u32[2][64][16] by (round parity, rank): verdict word, tokens, arm
//!                        request, round (after cf)
//! ```
//!
//! Every fused kernel that raises or waits for a flag reads the round number (and a source's
//! token count) from the rank's control block ([`afdep_kernels::ops::fused_round`]) and does
//! nothing when the round's verdict is not go; a host-planned round starts with
//! `afdep_round_bump` (round + 1, its token count), a device round with `afdep_round_begin`.
//!
//! [`FusedEngine::workspace_bytes`] gives the size an
//! [`NvlinkOptions`](afdep_transport::NvlinkOptions) must provide.
//!
//! # Ordering, waits and the SM budget
//!
//! Flags hold the round number and only grow, so a flag from an earlier round never satisfies a
//! later wait. A slab is rewritten in round r+1 only after its FFN rank's combine flag of round
//! r reached the source, which that FFN rank raised after its epilogue of round r had read the
//! slab; a return area likewise. The waiting kernels (epilogue, combine) spin at most the
//! transport's timeout, then record a fault and exit: the round fails with
//! [`ExchangeError::DeviceTimeout`] naming the phase, the rank and the late peer, and the engine
//! closes ([`ExchangeError::Closed`] afterwards: flags and slabs are then in an unknown state).
//! Ranks that share one GPU (the in-process tests) run concurrently on their own streams; the
//! waiting kernels' grids are capped (`knobs.epilogue_sm_cap` for the epilogue,
//! `knobs.transport_sms` for the others) so that every rank's kernels stay resident together.
//!
//! Because ranks may share one GPU, nothing that can synchronise the context runs while a round
//! is in flight: the fused kernels are loaded at set-up ([`FusedEngine::new`] ends with a
//! barrier), per-round buffers come from cudarc's stream-ordered allocator, and callers should
//! drop the engines only once every rank has finished its last round (freeing device memory may
//! wait for the whole device; [`run_group`](crate::run_group) does so).
//!
//! Each phase's host preparation (send lists, the combine's plan numbers, their uploads, the
//! poisoned output buffers) is done before the phase's first kernel, so that the phase's kernels
//! run back to back on the rank's stream.
//!
//! # Phase timing
//!
//! [`FusedEngine::set_phase_timing`] adds CUDA events around each phase's kernels on the rank's
//! stream and a control-plane barrier before each phase, so that a phase's device time holds
//! only the exchange, not another rank's host work; [`FusedEngine::last_device_times`] gives
//! the spans of the last round ([`DevicePhaseTimes`] says exactly what they hold). `afdep
//! exchange --backend cuda` reports them.
//!
//! # Count-first
//!
//! Sources compute their per-expert counts on the device from their routes and store each FFN
//! rank's share into its counts area, then raise a count flag; the FFN rank waits (bounded) for
//! every source's counts, computes [`FfnPlan`]'s prefix sums (64-bit) into its plan area and
//! publishes each source's block starts into the source's offsets area with an offset flag.
//! Source arm: the source waits (bounded) for its offsets and stores each row straight to its
//! final expanded rows in the FFN rank's expanded area (plus the compact view's metadata in its
//! slab rows), then raises its dispatch flag. Streaming: rows land in the slabs, each with a
//! row flag holding the round number, and the FFN rank's streaming epilogue expands each row as
//! soon as its flag arrives. The FFN rank's [`FfnReceived::plan`] is then the plan its device
//! computed. fp8 payloads are quantised on the device while they are stored (into the slab
//! rows, or the source arm's final expanded rows' codes and scales, dequantised on the FFN rank
//! after the dispatch flags); the FFN rank receives what a payload-first fp8 round delivers
//! ([`FfnReceived::fp8`]). Stream order, fp8, the knobs and the arm rule (the same for every
//! payload) are documented in `fused/count_first.rs` and `docs/design.md`.
//!
//! The host status + counts phase still runs in a count-first round: it validates the routes
//! (rejection on every rank before anything moves), carries the token counts of the arm rule,
//! and its plans drive the combine and the poisoned extents of the expanded area; the dispatch
//! itself uses only the device's counts and offsets.
//!
//! # Device rounds and CUDA graphs
//!
//! [`FusedEngine::device_round`], [`FusedEngine::capture`] and [`FusedEngine::replay`] run a whole
//! round with no host work between its kernels: route validation on the device with the verdict
//! shared among ranks through the workspace (a rejection, also of a non-finite fp8 row, is the same
//! typed [`ExchangeError::Route`] on every rank, and the next round works), device counts and plan,
//! device experts ([`DeviceExperts`]), the combine from the compact view and the routes, over
//! capacity-sized buffers, eagerly or replayed from a CUDA graph, of one arm or of every arm with
//! the arm chosen on the device each round ([`RoundArm::Auto`](crate::RoundArm::Auto)):
//! `fused/device_round.rs`.

use std::time::{Duration, Instant};

use afdep_core::fp8;
use afdep_core::layout::{FfnPlan, SourceCounts, compact_slots, payload_first_slabs};
use afdep_core::oracle::exchange::{FfnReceived, Fp8Received, SourceInput};
use afdep_core::route::MASKED;
use afdep_core::{ExchangeConfig, PayloadKind, bf16};
use afdep_kernels::cudarc::driver::sys::CUevent_flags;
use afdep_kernels::cudarc::driver::{CudaEvent, CudaSlice, result as cures};
use afdep_kernels::ops::fused::{
    self as fk, EpilogueSources, Expanded, Fp8Expanded, RankAddrs, SendList,
};
use afdep_kernels::ops::fused_cf::WorkUnits;
use afdep_kernels::ops::fused_layout::FusedLayout;
use afdep_kernels::ops::{poison, zeros};
use afdep_kernels::{GpuContext, KernelError};
use afdep_transport::{NvlinkIpc, Transport, TransportError};
use tracing::debug;

use crate::error::ExchangeError;
use crate::round::{
    DevicePhaseTimes, DispatchArm, ExchangeEngine, ExpertFn, PhaseTimes, RoundOutput, agree,
    apply_experts, count_phase_with_tokens,
};

mod count_first;
pub mod device_round;
#[cfg(feature = "fault-injection")]
pub mod fault;
mod trace;
pub use device_round::{BorrowedRound, DeviceExperts, DeviceRoundOptions, FusedGraph};

pub use afdep_kernels::ops::fused_layout::{
    COMBINE_FLAGS, CONTROL, DISPATCH_FLAGS, ERROR_WORD, SLABS,
};
/// Most ranks of one group (the flag areas hold 64 u32).
pub const MAX_WORLD: usize = 64;

/// The workspace layout of a config (computed in one place:
/// [`FusedLayout::new`](afdep_kernels::ops::fused_layout::FusedLayout::new)).
fn geometry(cfg: &ExchangeConfig) -> FusedLayout {
    FusedLayout::new(cfg)
}

/// Appends an fp8 slab row (codes, then scales: the fp8 slab row format) to the compact view:
/// its codes and scales, and its rows dequantised on the host (the same bits as the device's,
/// `afdep_core::fp8`).
fn push_fp8_compact(row: &[u8], h: usize, compact_x: &mut Vec<bf16>, rx: &mut Fp8Received) {
    let q = &row[..h];
    let at = h.div_ceil(16) * 16;
    let g = fp8::scales_per_row(h);
    let sc: Vec<f32> = bytemuck::pod_collect_to_vec(&row[at..at + 4 * g]);
    let mut deq = vec![bf16::ZERO; h];
    fp8::dequantise_row(q, &sc, &mut deq);
    compact_x.extend(deq);
    rx.compact_q.extend_from_slice(q);
    rx.compact_scales.extend(sc);
}

/// The fused engine of one rank; see the [module docs](self).
///
/// # Launch invariant
///
/// The `// SAFETY:` comments of the kernel launches here and in `fused/` rely on this, set up by
/// [`FusedEngine::new`] and kept for the engine's life (the terms are those of
/// `afdep_kernels::ops::fused`, "Safety of the launchers"):
/// - `ws` and `peers` are this rank's workspace and the device peer table of `transport`
///   (`workspace_peers()[rank]`, `workspace_peer_table()`), valid in `gpu`'s context (the
///   transport's device) until the transport is dropped, whose drop waits for the rank's stream;
/// - every rank's workspace holds at least `geometry(cfg).bytes` bytes (checked in `new`; the
///   transport gives every rank the same size) and is 256-byte aligned (checked), and
///   `geometry` places every area inside it, each 256-byte aligned: the flags at
///   `DISPATCH_FLAGS` and `COMBINE_FLAGS` (`MAX_WORLD` u32 each), the error word at
///   `ERROR_WORD`, the control block at `CONTROL`, the slabs, the return areas, the count-first
///   areas and the status area; so `ws + CONTROL` is a live control block and
///   `ws + ERROR_WORD` a live error word;
/// - the world is at most `MAX_WORLD`, and `src_ranks` and `ffn_ranks` hold the group's attention
///   and FFN ranks, ascending (all below the world);
/// - every launch is on `gpu`'s one stream, so a kernel sees what an earlier one wrote (the plan
///   before the epilogues that read it, the counts before their publication).
pub struct FusedEngine {
    cfg: ExchangeConfig,
    transport: NvlinkIpc,
    gpu: GpuContext,
    geo: FusedLayout,
    round: u32,
    closed: Option<String>,
    /// This rank's workspace base and the device peer table.
    ws: u64,
    peers: u64,
    /// Attention ranks and FFN ranks, ascending, on the device.
    src_ranks: CudaSlice<u32>,
    ffn_ranks: CudaSlice<u32>,
    /// The arm override ([`FusedEngine::set_arm`]) and the arm of the last round.
    arm: Option<DispatchArm>,
    last_arm: DispatchArm,
    /// Attention ranks: the count-first device scratch.
    cf_scratch: Option<count_first::CfScratch>,
    /// Phase timing, when on ([`FusedEngine::set_phase_timing`]).
    events: Option<PhaseEvents>,
    /// Device rounds' buffers ([`FusedEngine::prepare_device`]).
    device: Option<device_round::DeviceRound>,
    /// Poison outputs before every device round.
    poison: bool,
    /// Device rounds launch one front kernel per rank ([`FusedEngine::set_fronts`]).
    fronts: bool,
}

impl std::fmt::Debug for FusedEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FusedEngine")
            .field("rank", &self.transport.rank())
            .field("topology", &self.cfg.topology)
            .field("round", &self.round)
            .finish()
    }
}

fn upload<T: afdep_kernels::cudarc::driver::DeviceRepr + Copy + Default>(
    gpu: &GpuContext,
    v: &[T],
) -> Result<CudaSlice<T>, ExchangeError> {
    if v.is_empty() {
        return Ok(gpu
            .stream()
            .null()
            .map_err(KernelError::driver("allocating an empty buffer"))?);
    }
    Ok(gpu
        .stream()
        .clone_htod(v)
        .map_err(KernelError::driver("copying to the device"))?)
}

/// The device address of `buf` (the engine's buffers live on its one stream: no event to wait
/// for, tracking is off).
fn device_address<T>(gpu: &GpuContext, buf: &CudaSlice<T>) -> u64 {
    let (p, _guard) = afdep_kernels::cudarc::driver::DevicePtr::device_ptr(buf, gpu.stream());
    p
}

impl FusedEngine {
    /// Workspace bytes every rank's [`NvlinkOptions`](afdep_transport::NvlinkOptions) must
    /// provide for `cfg`.
    pub fn workspace_bytes(cfg: &ExchangeConfig) -> usize {
        geometry(cfg).bytes as usize
    }

    /// Sets up the engine on this rank: the staged engine's agreement (config fingerprints,
    /// world size; collective), the checks that the workspace is large enough and the world at
    /// most [`MAX_WORLD`], then a [`GpuContext`] on the transport's device with every fused
    /// kernel loaded, and a barrier. Collective.
    pub fn new(cfg: ExchangeConfig, mut transport: NvlinkIpc) -> Result<Self, ExchangeError> {
        agree(&cfg, &mut transport)?;
        let rank = transport.rank();
        let geo = geometry(&cfg);
        let world = transport.world_size();
        if world > MAX_WORLD {
            return Err(ExchangeError::Input {
                rank,
                what: format!("{world} ranks: the fused engine supports at most {MAX_WORLD}"),
            });
        }
        let have = transport.options().workspace_bytes as u64;
        if have < geo.bytes {
            return Err(ExchangeError::Input {
                rank,
                what: format!(
                    "the NvlinkIpc workspace holds {have} bytes, the fused engine needs {} \
                     (FusedEngine::workspace_bytes)",
                    geo.bytes
                ),
            });
        }
        // the combine's and the experts' 16-byte accesses need an aligned workspace (NvlinkIpc
        // places it 256-byte aligned; checked in case another path built the transport)
        let base = transport.workspace_peers()[rank];
        if base % 256 != 0 {
            return Err(ExchangeError::Input {
                rank,
                what: format!("the NvlinkIpc workspace base {base:#x} is not 256-byte aligned"),
            });
        }
        let gpu = GpuContext::new(transport.device())?;
        // SAFETY: no buffer of this context exists yet, and every buffer the engine allocates is
        // allocated, used and freed on the context's one stream, whose order is all the
        // synchronisation they need; without per-buffer events a graph capture of a round holds
        // kernel and copy nodes only (device_round.rs).
        unsafe { gpu.cuda().disable_event_tracking() };
        // no lazy kernel load during a round (it may synchronise the context while another
        // rank's kernel spins on this GPU): load everything now, then wait for every rank
        fk::preload(&gpu, cfg.top_k)?;
        transport.barrier()?;
        let topo = cfg.topology;
        let src: Vec<u32> = topo.attention_ranks().map(|r| r as u32).collect();
        let ffn: Vec<u32> = (0..cfg.placement().ffn_ranks)
            .map(|f| topo.ffn_rank(f) as u32)
            .collect();
        let src_ranks = upload(&gpu, &src)?;
        let ffn_ranks = upload(&gpu, &ffn)?;
        let ws = transport.workspace_peers()[rank];
        let peers = transport.workspace_peer_table();
        let cf_scratch = match topo.attention_index(rank) {
            Some(_) => Some(count_first::CfScratch::new(&gpu, &cfg)?),
            None => None,
        };
        Ok(FusedEngine {
            cfg,
            transport,
            gpu,
            geo,
            round: 0,
            closed: None,
            ws,
            peers,
            src_ranks,
            ffn_ranks,
            arm: None,
            last_arm: DispatchArm::PayloadFirst,
            cf_scratch,
            events: None,
            device: None,
            poison: true,
            fronts: device_round::fronts_from_env(),
        })
    }

    /// `Closed` once an error closed the engine (see [`FusedEngine::round`]).
    fn check_open(&self) -> Result<(), ExchangeError> {
        crate::round::check_open(&self.closed, self.rank())
    }

    /// The configuration.
    pub fn config(&self) -> &ExchangeConfig {
        &self.cfg
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.transport.rank()
    }

    /// This rank's device addresses for the kernels (its workspace, the peer table, the control
    /// block and the error word in the workspace), every wait bounded by `timeout_ns`.
    fn rank_addrs(&self, timeout_ns: u64) -> RankAddrs {
        RankAddrs {
            ws: self.ws,
            peers: self.peers,
            me: self.rank(),
            ctl: self.ws + CONTROL,
            err: self.ws + ERROR_WORD,
            timeout_ns,
        }
    }

    /// The transport.
    pub fn transport_mut(&mut self) -> &mut NvlinkIpc {
        &mut self.transport
    }

    /// Reads `len` bytes at `offset` of this rank's workspace (waits for the stream).
    fn read_ws(&self, offset: u64, len: usize) -> Result<Vec<u8>, ExchangeError> {
        let mut out = vec![0u8; len];
        if len == 0 {
            return Ok(out);
        }
        self.gpu
            .cuda()
            .bind_to_thread()
            .map_err(KernelError::driver("binding the context"))?;
        // SAFETY: [ws + offset, + len) lies in this rank's workspace (the geometry fits it,
        // checked at set-up); `out` outlives the copy, which is waited for below.
        unsafe {
            cures::memcpy_dtoh_async(&mut out, self.ws + offset, self.gpu.stream().cu_stream())
        }
        .map_err(KernelError::driver("reading the workspace"))?;
        self.gpu.synchronize()?;
        Ok(out)
    }

    /// Waits for the stream, then checks the error word: a fault closes the engine.
    fn check_fault(&mut self) -> Result<(), ExchangeError> {
        self.gpu.synchronize()?;
        let w: Vec<u32> = bytemuck::pod_collect_to_vec(&self.read_ws(ERROR_WORD, 16)?);
        if w[0] == 0 {
            return Ok(());
        }
        let phase = match w[0] {
            fk::fault::DISPATCH_WAIT => "dispatch",
            fk::fault::COMBINE_WAIT => "combine",
            c => count_first::fault_phase(c).unwrap_or("unknown phase"),
        };
        let e = ExchangeError::DeviceTimeout {
            rank: self.rank(),
            phase,
            peer: w[1] as usize,
            round: w[2],
        };
        self.closed = Some(e.to_string());
        Err(e)
    }

    /// Runs one round. Attention ranks pass `Some(input)`; FFN-only ranks pass `None`.
    /// `expert` is used on FFN ranks. Collective: every rank of the topology must call it.
    pub fn round(
        &mut self,
        input: Option<&SourceInput>,
        expert: &dyn ExpertFn,
    ) -> Result<RoundOutput, ExchangeError> {
        self.check_open()?;
        let r = self.round_inner(input, expert);
        if let Err(e) = &r {
            // anything but a rejected round may leave stores or waits half done
            if !matches!(e, ExchangeError::Route { .. }) && self.closed.is_none() {
                self.closed = Some(e.to_string());
            }
        }
        r
    }

    fn round_inner(
        &mut self,
        input: Option<&SourceInput>,
        expert: &dyn ExpertFn,
    ) -> Result<RoundOutput, ExchangeError> {
        let rank = self.rank();
        let cfg = self.cfg.clone();
        let topo = cfg.topology;
        let p = cfg.placement();
        let nf = p.ffn_ranks;
        let src_index = topo.attention_index(rank);
        let ffn_index = topo.ffn_index(rank);
        let timeout_ns = self.transport.timeout().as_nanos().min(u64::MAX as u128) as u64;
        let mut times = PhaseTimes::default();
        if let Some(ev) = &mut self.events {
            ev.last = None;
        }

        // 1. status + counts
        let t0 = Instant::now();
        let (sources, tokens) = count_phase_with_tokens(&cfg, &mut self.transport, input)?;
        let plans: Vec<FfnPlan> = (0..nf).map(|f| FfnPlan::build(f, &p, &sources)).collect();
        self.round += 1;
        let round = self.round;
        let arm = self.arm_for(&tokens);
        self.last_arm = arm;
        // the device's round (every kernel reads it from the control block) follows the host's
        // SAFETY: the engine's launch invariant (`FusedEngine`): `self.ws + CONTROL` is this
        // workspace's live control block.
        unsafe {
            afdep_kernels::ops::fused_round::bump(
                &self.gpu,
                self.ws + CONTROL,
                input.map_or(0, |i| i.routes.tokens),
            )
        }?;
        times.counts = t0.elapsed();
        debug!(rank, round, %arm, "fused round");

        // 2. dispatch. Count-first: the whole dispatch (count_first.rs). Payload-first: host
        // preparation first (send lists, uploads, the poisoned expanded buffer), then the
        // kernels of the phase.
        let t1 = Instant::now();
        let cf_received = match arm {
            DispatchArm::PayloadFirst => None,
            _ => self.count_first_dispatch(arm, input, &plans, timeout_ns)?,
        };
        let mut expand = None;
        if arm == DispatchArm::PayloadFirst {
            let send = match (src_index, input) {
                (Some(s), Some(inp)) => Some(self.pf_send_list(s, inp, &plans)?),
                _ => None,
            };
            expand = match ffn_index {
                Some(f) => Some(self.pf_expand_buffers(f, &plans[f])?),
                None => None,
            };
            self.phase_start(Phase::Dispatch)?;
            if let Some(send) = &send {
                self.pf_dispatch(send)?;
            }
            if let Some(ex) = &mut expand {
                self.pf_copy_epilogue(ex, &plans[ex.f], round, timeout_ns)?;
            }
            self.phase_end(Phase::Dispatch)?;
            if expand.is_some() {
                self.check_fault()?;
            } else {
                self.gpu.synchronize()?;
            }
            drop(send);
        }

        // 3. the FFN rank's view of what arrived, and 4. experts (host in this version)
        let mut received = None;
        let mut y_rows: Vec<bf16> = Vec::new();
        let rx = match (ffn_index, cf_received, expand) {
            (Some(_), Some(rx), _) => Some(rx),
            (Some(_), None, Some(ex)) => Some(self.pf_received(&ex, &plans[ex.f], &sources)?),
            _ => None,
        };
        times.dispatch = t1.elapsed();
        if let (Some(f), Some(rx)) = (ffn_index, rx) {
            let t2 = Instant::now();
            y_rows = apply_experts(&cfg, rank, f, &rx.plan, &rx.expanded, expert)?;
            times.experts = t2.elapsed();
            received = Some(rx);
        }

        // 5. combine: host preparation (the plan numbers, the routes, the poisoned output), then
        // the partial sums (FFN ranks) and the sums of the partials (sources)
        let t3 = Instant::now();
        let combined = self.host_planned_combine(arm, input, &plans, &y_rows, timeout_ns)?;
        times.combine = t3.elapsed();
        if let Some(ev) = &mut self.events {
            ev.last = Some(ev.read()?);
        }
        Ok(RoundOutput {
            combined,
            received,
            times,
        })
    }

    /// A source's payload-first send list: per row bound for an FFN rank its token, destination
    /// rank, slab row and metadata (token, local ids, weights, expanded rows from the host
    /// plans), uploaded with the rows (the stream is waited for: the host vectors go).
    fn pf_send_list(
        &self,
        s: usize,
        inp: &SourceInput,
        plans: &[FfnPlan],
    ) -> Result<PfSend, ExchangeError> {
        let p = self.cfg.placement();
        let topo = self.cfg.topology;
        let k = self.cfg.top_k;
        let mw = fk::meta_words(k);
        let (mut token, mut dst_rank, mut slab_row, mut meta) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::<u32>::new());
        for (f, slab) in payload_first_slabs(&inp.routes, &p).iter().enumerate() {
            let (ids, ws) = compact_slots(&inp.routes, &p, f, slab);
            let mut next = vec![0u64; p.experts_per_rank];
            for (i, &t) in slab.iter().enumerate() {
                token.push(t);
                dst_rank.push(topo.ffn_rank(f) as u32);
                slab_row.push(i as u32);
                let start = meta.len();
                meta.extend_from_slice(&[t, 0]);
                meta.extend(ids[i * k..(i + 1) * k].iter().map(|&l| l as u32));
                meta.extend(ws[i * k..(i + 1) * k].iter().map(|w| w.to_bits()));
                for &l in &ids[i * k..(i + 1) * k] {
                    let row = if l == MASKED {
                        fk::NO_ROW
                    } else {
                        let l = l as usize;
                        let r = plans[f].block_start(l, s) + next[l];
                        next[l] += 1;
                        r
                    };
                    meta.extend_from_slice(&[row as u32, (row >> 32) as u32]);
                }
                debug_assert_eq!(meta.len() - start, mw);
            }
        }
        let rows = token.len();
        let x = upload(&self.gpu, &inp.x)?;
        let token_d = upload(&self.gpu, &token)?;
        let dst_d = upload(&self.gpu, &dst_rank)?;
        let row_d = upload(&self.gpu, &slab_row)?;
        let meta_d = upload(&self.gpu, &meta)?;
        // the host vectors above must live until the copies ran
        self.gpu.synchronize()?;
        Ok(PfSend {
            tokens: inp.routes.tokens,
            x,
            token: token_d,
            dst_rank: dst_d,
            slab_row: row_d,
            meta: meta_d,
            rows,
        })
    }

    /// FFN rank `f`'s payload-first expanded buffers, poisoned (fp8: also the codes and
    /// scales), and its slab starts on the device.
    fn pf_expand_buffers(&self, f: usize, plan: &FfnPlan) -> Result<PfExpand, ExchangeError> {
        let h = self.cfg.hidden;
        let total = plan.total_rows() as usize;
        let mut expanded: CudaSlice<bf16> = zeros(&self.gpu, total * h)?;
        poison(&self.gpu, &mut expanded)?;
        let mut fp8_bufs = None;
        if self.cfg.payload == PayloadKind::Fp8E4m3 {
            let mut q: CudaSlice<u8> = zeros(&self.gpu, total * h)?;
            let mut sc: CudaSlice<f32> = zeros(&self.gpu, total * fp8::scales_per_row(h))?;
            poison(&self.gpu, &mut q)?;
            poison(&self.gpu, &mut sc)?;
            fp8_bufs = Some((q, sc));
        }
        let starts = upload(&self.gpu, &plan.slab_offsets)?;
        self.gpu.synchronize()?;
        Ok(PfExpand {
            f,
            total,
            expanded,
            starts,
            fp8: fp8_bufs,
        })
    }

    /// A source's payload-first dispatch kernels: rows into their slabs in every FFN rank's
    /// workspace, then the dispatch flags.
    fn pf_dispatch(&self, send: &PfSend) -> Result<(), ExchangeError> {
        let list = SendList {
            token: &send.token,
            dst_rank: &send.dst_rank,
            slab_row: &send.slab_row,
            meta: &send.meta,
            rows: send.rows,
        };
        // the dispatch stores without waiting: no wait bound
        let addrs = self.rank_addrs(0);
        let blocks = self.cfg.knobs.transport_sms;
        // SAFETY: the engine's launch invariant (`FusedEngine`): `self.peers` is the live peer
        // table; `send` comes from the host plan of this round (`dst_rank` FFN ranks below the
        // world, slab rows below the capacity, tokens below `send.tokens`); every workspace holds
        // the slabs of `geo`.
        unsafe {
            fk::dispatch(
                &self.gpu,
                &send.x,
                send.tokens,
                &list,
                &addrs,
                &self.geo,
                blocks,
            )
        }?;
        // SAFETY: the engine's launch invariant (`FusedEngine`): `self.peers` and the control block
        // `self.ws + CONTROL` are live; `ffn_ranks` holds the FFN ranks, every workspace
        // `MAX_WORLD` flags at `DISPATCH_FLAGS`.
        unsafe {
            fk::signal(
                &self.gpu,
                self.peers,
                &self.ffn_ranks,
                self.cfg.placement().ffn_ranks,
                DISPATCH_FLAGS,
                self.rank(),
                self.ws + CONTROL,
            )
        }?;
        Ok(())
    }

    /// An FFN rank's payload-first copy epilogue: waits for every source's flag, then expands
    /// the slabs (fp8: the codes and scales of the expanded layout beside the dequantised rows).
    fn pf_copy_epilogue(
        &self,
        ex: &mut PfExpand,
        plan: &FfnPlan,
        round: u32,
        timeout_ns: u64,
    ) -> Result<(), ExchangeError> {
        let src = EpilogueSources {
            rank: &self.src_ranks,
            slab_starts: &ex.starts,
            sources: self.cfg.topology.attention_count(),
            total: plan.total_tokens(),
            expanded_rows: ex.total,
        };
        let addrs = self.rank_addrs(timeout_ns);
        let blocks = self.cfg.knobs.epilogue_sm_cap;
        let out = match self.cfg.payload {
            PayloadKind::Bf16 => Expanded::Bf16(&mut ex.expanded),
            PayloadKind::Fp8E4m3 => {
                let (q, sc) = ex.fp8.as_mut().expect("prepared with the expanded buffer");
                Expanded::Fp8(Fp8Expanded {
                    q,
                    scales: sc,
                    dequant: &mut ex.expanded,
                })
            }
        };
        // SAFETY: the engine's launch invariant (`FusedEngine`): `self.ws` and its error word are
        // live and hold the slabs of `geo` and the flags at `DISPATCH_FLAGS`; `src` is the host
        // plan's: attention ranks, slab rows below the capacity.
        unsafe { fk::copy_epilogue(&self.gpu, &addrs, &src, &self.geo, round, out, blocks) }?;
        Ok(())
    }

    /// What a payload-first round delivered to FFN rank `ex.f`: the expanded rows read back and
    /// the compact collect view, the slabs themselves (fp8: the codes and scales as stored, and
    /// their dequantised rows).
    fn pf_received(
        &self,
        ex: &PfExpand,
        plan: &FfnPlan,
        sources: &[SourceCounts],
    ) -> Result<FfnReceived, ExchangeError> {
        let (h, k) = (self.cfg.hidden, self.cfg.top_k);
        let geo = self.geo;
        let f = ex.f;
        let expanded_h: Vec<bf16> = afdep_kernels::ops::download(&self.gpu, &ex.expanded)?;
        let mut fp8_rx = match &ex.fp8 {
            None => None,
            Some((q, sc)) => Some(Fp8Received {
                expanded_q: afdep_kernels::ops::download(&self.gpu, q)?,
                expanded_scales: afdep_kernels::ops::download(&self.gpu, sc)?,
                compact_q: Vec::new(),
                compact_scales: Vec::new(),
            }),
        };
        let (mut compact_tokens, mut compact_x, mut compact_ids, mut compact_weights) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let payload = fk::slab_payload_bytes(self.cfg.payload, h);
        for (s, c) in sources.iter().enumerate() {
            let n = c.ffn_tokens[f] as usize;
            let src_rank = self.cfg.topology.attention_ranks().start + s;
            let off = geo.slab().slab_off
                + (src_rank as u64 * geo.slab().cap as u64) * geo.slab().row_bytes;
            let bytes = self.read_ws(off, n * geo.slab().row_bytes as usize)?;
            for row in bytes.chunks(geo.slab().row_bytes as usize) {
                match fp8_rx.as_mut() {
                    None => {
                        compact_x.extend(bytemuck::pod_collect_to_vec::<u8, bf16>(&row[..2 * h]))
                    }
                    Some(rx) => push_fp8_compact(row, h, &mut compact_x, rx),
                }
                let m: Vec<u32> =
                    bytemuck::pod_collect_to_vec(&row[payload..payload + 4 * fk::meta_words(k)]);
                compact_tokens.push((s as u32, m[0]));
                compact_ids.extend(m[2..2 + k].iter().map(|&v| v as i32));
                compact_weights.extend(m[2 + k..2 + 2 * k].iter().map(|&v| f32::from_bits(v)));
            }
        }
        Ok(FfnReceived {
            plan: plan.clone(),
            expanded: expanded_h,
            compact_tokens,
            compact_x,
            compact_ids,
            compact_weights,
            fp8: fp8_rx,
        })
    }

    /// The combine of a host-planned round: host preparation (an FFN rank's plan numbers and
    /// expert outputs, a source's routes and poisoned output), then the partial sums (FFN ranks)
    /// and the sums of the partials (sources). Returns a source's combined rows.
    fn host_planned_combine(
        &mut self,
        arm: DispatchArm,
        input: Option<&SourceInput>,
        plans: &[FfnPlan],
        y_rows: &[bf16],
        timeout_ns: u64,
    ) -> Result<Option<Vec<bf16>>, ExchangeError> {
        let rank = self.rank();
        let cfg = self.cfg.clone();
        let topo = cfg.topology;
        let p = cfg.placement();
        let h = cfg.hidden;
        let (nf, ns) = (p.ffn_ranks, topo.attention_count());
        let (src_index, ffn_index) = (topo.attention_index(rank), topo.ffn_index(rank));
        let (geo, knobs) = (self.geo, cfg.knobs);
        let addrs = self.rank_addrs(timeout_ns);
        let mut back = None;
        if let Some(f) = ffn_index {
            // the compact view's row offsets and (streaming: its rows are block positions) the
            // block starts, from the host plan (the device's, where it made one, is the same)
            let plan = &plans[f];
            let mut numbers = plan.slab_offsets.clone();
            numbers.extend_from_slice(&plan.block_starts);
            let y = upload(&self.gpu, y_rows)?;
            let nums = upload(&self.gpu, &numbers)?;
            self.gpu.synchronize()?;
            back = Some((y, nums, plan.total_rows() as usize, plan.slab_offsets[ns]));
        }
        let mut sums = None;
        if let (Some(_), Some(inp)) = (src_index, input) {
            let t = inp.routes.tokens;
            let idx = upload(&self.gpu, &inp.routes.idx)?;
            let mut out: CudaSlice<bf16> = zeros(&self.gpu, t * h)?;
            poison(&self.gpu, &mut out)?;
            self.gpu.synchronize()?;
            sums = Some((t, idx, out));
        }
        self.phase_start(Phase::Combine)?;
        if let (Some((y, nums, rows, compact)), Some(f)) = (&back, ffn_index) {
            let base = device_address(&self.gpu, nums);
            let view = fk::CompactView {
                layout: geo,
                sources: ns,
                slab_offsets: base,
                block_starts: if arm == DispatchArm::CountFirst {
                    fk::BlockStarts::Relative(base + 8 * (ns as u64 + 1))
                } else {
                    fk::BlockStarts::Final
                },
                max_rows: *compact,
                y: device_address(&self.gpu, y),
                y_rows: *rows,
            };
            // SAFETY: the engine's launch invariant (`FusedEngine`): `self.peers` and the control
            // block `self.ws + CONTROL` are live; `view`'s plan numbers are the host plan's in
            // `nums` (`ns + 1` slab offsets, then the block starts), whose counts keep rows below
            // the capacity, and `y` holds its `rows` expanded rows; both live in `back` until after
            // the stream is synchronised below; every workspace holds the return areas at
            // `geo.ret_off` and `MAX_WORLD` flags at `COMBINE_FLAGS` (raised by the kernel's
            // last block; `src_ranks` holds the attention ranks).
            unsafe {
                fk::combine_reduce(
                    &self.gpu,
                    &addrs,
                    &view,
                    &self.src_ranks,
                    f,
                    knobs.transport_sms,
                    true,
                )
            }?;
        }
        if let Some((t, idx, out)) = &mut sums {
            let routes = fk::CombineRoutes {
                idx,
                ffn_ranks: &self.ffn_ranks,
                ffns: nf,
                experts_per_rank: p.experts_per_rank,
                tokens: *t,
            };
            let blocks = knobs.transport_sms;
            // SAFETY: the engine's launch invariant (`FusedEngine`): `self.ws`, its control block
            // (token count `t`, set by this round's `bump`) and its error word are live; the
            // workspace holds `MAX_WORLD` flags at `COMBINE_FLAGS` and the return areas at
            // `geo.ret_off`.
            unsafe { fk::combine(&self.gpu, &addrs, &routes, &geo, out, blocks) }?;
        }
        self.phase_end(Phase::Combine)?;
        let mut combined = None;
        if let Some((_, _, out)) = sums {
            self.check_fault()?;
            combined = Some(afdep_kernels::ops::download(&self.gpu, &out)?);
        } else {
            self.gpu.synchronize()?;
        }
        drop(back);
        Ok(combined)
    }

    /// Turns phase timing on or off (see [`DevicePhaseTimes`]). Collective in effect: with
    /// timing on, every round adds two control-plane barriers, so every rank must set the
    /// same. Creates the events now, outside any round.
    pub fn set_phase_timing(&mut self, on: bool) -> Result<(), ExchangeError> {
        self.events = if on {
            Some(PhaseEvents::new(&self.gpu)?)
        } else {
            None
        };
        Ok(())
    }

    /// The device times of the last round that completed with phase timing on; `None` when
    /// timing is off or the last round failed.
    pub fn last_device_times(&self) -> Option<DevicePhaseTimes> {
        self.events.as_ref().and_then(|e| e.last)
    }

    /// Start of a timed phase: a barrier of every rank (so that no rank's host preparation
    /// or host experts fall inside another rank's device time), then the phase's first event.
    fn phase_start(&mut self, phase: Phase) -> Result<(), ExchangeError> {
        if self.events.is_none() {
            return Ok(());
        }
        self.transport.barrier()?;
        let ev = self.events.as_ref().expect("checked");
        let e = match phase {
            Phase::Dispatch => &ev.dispatch.0,
            Phase::Combine => &ev.combine.0,
        };
        e.record(self.gpu.stream())
            .map_err(KernelError::driver("recording a phase event"))?;
        Ok(())
    }

    /// End of a timed phase: its second event, after the phase's last kernel.
    fn phase_end(&mut self, phase: Phase) -> Result<(), ExchangeError> {
        let Some(ev) = &self.events else {
            return Ok(());
        };
        let e = match phase {
            Phase::Dispatch => &ev.dispatch.1,
            Phase::Combine => &ev.combine.1,
        };
        e.record(self.gpu.stream())
            .map_err(KernelError::driver("recording a phase event"))?;
        Ok(())
    }
}

impl ExchangeEngine for FusedEngine {
    fn rank(&self) -> usize {
        FusedEngine::rank(self)
    }

    fn round(
        &mut self,
        input: Option<&SourceInput>,
        expert: &dyn ExpertFn,
    ) -> Result<RoundOutput, ExchangeError> {
        FusedEngine::round(self, input, expert)
    }

    fn barrier(&mut self) -> Result<(), TransportError> {
        self.transport.barrier()
    }

    fn all_gather(&mut self, mine: &[u8]) -> Result<Vec<u8>, TransportError> {
        self.transport.all_gather(mine)
    }

    fn device_times(&self) -> Option<DevicePhaseTimes> {
        self.last_device_times()
    }
}

/// A source's payload-first send list on the device ([`FusedEngine::pf_send_list`]).
struct PfSend {
    /// The source's token count.
    tokens: usize,
    x: CudaSlice<bf16>,
    token: CudaSlice<u32>,
    dst_rank: CudaSlice<u32>,
    slab_row: CudaSlice<u32>,
    meta: CudaSlice<u32>,
    /// Send rows.
    rows: usize,
}

/// An FFN rank's payload-first expanded buffers ([`FusedEngine::pf_expand_buffers`]).
struct PfExpand {
    /// The FFN index.
    f: usize,
    /// Expanded rows.
    total: usize,
    expanded: CudaSlice<bf16>,
    /// The slab starts (the plan's slab offsets).
    starts: CudaSlice<u64>,
    /// fp8: the expanded codes and scales.
    fp8: Option<(CudaSlice<u8>, CudaSlice<f32>)>,
}

/// The two timed phases of a round.
#[derive(Debug, Clone, Copy)]
enum Phase {
    Dispatch,
    Combine,
}

/// The events of phase timing, created once ([`FusedEngine::set_phase_timing`]).
struct PhaseEvents {
    dispatch: (CudaEvent, CudaEvent),
    combine: (CudaEvent, CudaEvent),
    last: Option<DevicePhaseTimes>,
}

impl PhaseEvents {
    fn new(gpu: &GpuContext) -> Result<PhaseEvents, KernelError> {
        let ev = || {
            gpu.cuda()
                .new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
                .map_err(KernelError::driver("creating a phase event"))
        };
        Ok(PhaseEvents {
            dispatch: (ev()?, ev()?),
            combine: (ev()?, ev()?),
            last: None,
        })
    }

    /// The spans of the round just finished (its stream was waited for).
    fn read(&self) -> Result<DevicePhaseTimes, KernelError> {
        let span = |(a, b): &(CudaEvent, CudaEvent)| -> Result<Duration, KernelError> {
            let ms = a
                .elapsed_ms(b)
                .map_err(KernelError::driver("reading a phase event"))?;
            Ok(Duration::from_secs_f64(f64::from(ms.max(0.0)) * 1e-3))
        };
        Ok(DevicePhaseTimes {
            dispatch: span(&self.dispatch)?,
            combine: span(&self.combine)?,
        })
    }
}

/// The streaming epilogue's work split of `knobs` (`ops::fused_cf::stream_epilogue`).
fn work_units(knobs: &afdep_core::ExchangeKnobs) -> WorkUnits {
    WorkUnits {
        warps_per_unit: knobs.warps_per_unit,
        min_rows: knobs.min_rows_per_unit,
        blocks: knobs.epilogue_sm_cap,
    }
}
