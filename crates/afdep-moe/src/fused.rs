//! The fused exchange engine (payload-first and count-first dispatch; bf16 and fp8 payloads in
//! every arm): GPU-initiated stores into the symmetric workspaces of an [`NvlinkIpc`] group,
//! flags with release / acquire semantics and bounded device waits.
//!
//! Every round is a **device round** (`fused/device_round.rs`): route validation, the verdict,
//! the arm, counts, plan, rows, epilogue and combine all run on the device, over capacity-sized
//! buffers, with no host work between the kernels. The FFN ranks' experts run
//!
//! - on the device ([`DeviceExperts`]): [`FusedEngine::device_round`], [`FusedEngine::capture`]
//!   and [`FusedEngine::replay`] (CUDA graphs), the on-stream rounds of the Python bindings,
//!   the microbatch pipeline; or
//! - on the host ([`ExpertFn`]): [`FusedEngine::round`], the same API as
//!   [`StagedEngine`](crate::StagedEngine). The same launches, split once between the FFN
//!   rank's epilogue and its partial sums: the host waits for its rank's expanded rows, reads
//!   them back, applies the caller's experts and uploads their outputs, which the partial sums
//!   read instead of the device experts' (`fused/device_round/host_experts.rs`).
//!
//! One round, on every rank:
//!
//! 1. **start** (`afdep_round_begin`, every rank): round + 1 in the control block; a source
//!    validates its routes (and, with fp8 payloads, that its travelling rows are finite) on the
//!    device; every rank publishes its verdict word, token count and arm request to every rank's
//!    status area and reads them all (bounded). A rejection anywhere makes every rank skip the
//!    round with the same [`ExchangeError::Route`] (the lowest rejecting rank's error), and the
//!    engine goes on. The round's [`DispatchArm`] is derived there, the same on every rank:
//!    [`FusedEngine::set_arm`]'s, or the rule of `knobs.min_token_bucket`
//!    ([`DispatchArm::select`] on the largest source's token count).
//! 2. **counts, plan, rows and epilogue** (the [Count-first](self#count-first) section below,
//!    and payload-first: every row with its metadata into the per-source slabs first, the
//!    source's dispatch flag after its last row, then on the FFN rank, after every source's
//!    flag, the plan from the published counts and a copy epilogue into the expanded layout, one
//!    row per (token, local expert), grouped by local expert, the device plan's offsets). The
//!    slabs are the compact collect view. fp8: each row quantised on the device while it is
//!    stored (e4m3 codes and one f32 scale per 128 channels, [`afdep_core::fp8`], bit for bit
//!    the host encoder); the expanded area holds the dequantised bf16 rows
//!    (`bf16(f32(q) · scale)`) the experts consume, beside the codes and scales;
//!    [`FfnReceived::fp8`](afdep_core::oracle::exchange::FfnReceived::fp8) carries the codes and scales of both views.
//! 3. **experts** (FFN rank): device experts, or the host's ([`FusedEngine::round`]).
//! 4. **combine**, split at the fixed order (docs/design.md, "Specification: AFD exchange"). FFN
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
//!    is a run-time field of the workspace layout both combine kernels read, in every arm, with
//!    host or device experts and in graphs.
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
//! nothing when the round's verdict is not go; every round starts with `afdep_round_begin`.
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
//! barrier), per-round buffers (the host experts' outputs) come from cudarc's stream-ordered
//! allocator, and callers should drop the engines only once every rank has finished its last
//! round (freeing device memory may wait for the whole device; [`run_group`](crate::run_group)
//! does so).
//!
//! In a round with host experts the sources' combine waits on the device while the FFN ranks'
//! hosts run their experts: that wait, like every other, is bounded by the transport's timeout
//! (`NvlinkOptions::timeout`), which must therefore exceed the host experts' time.
//!
//! # Phase timing
//!
//! [`FusedEngine::set_phase_timing`] adds CUDA events around the two halves of a
//! [`FusedEngine::round`] on the rank's stream (the start to the epilogue, then the partial sums
//! and the combine) and a control-plane barrier before each, so that a phase's device time holds
//! only the exchange, not another rank's host experts; [`FusedEngine::last_device_times`] gives
//! the spans of the last round ([`DevicePhaseTimes`] says exactly what they hold). `afdep
//! exchange --backend cuda` reports them. Whole device rounds are timed by
//! [`FusedEngine::set_round_timing`] instead.
//!
//! # Count-first
//!
//! Sources compute their per-expert counts on the device from their routes and store each FFN
//! rank's share into its counts area, then raise a count flag; the FFN rank waits (bounded) for
//! every source's counts, computes [`FfnPlan`](afdep_core::layout::FfnPlan)'s prefix sums (64-bit) into its plan area and
//! publishes each source's block starts into the source's offsets area with an offset flag.
//! Source arm: the source waits (bounded) for its offsets and stores each row straight to its
//! final expanded rows in the FFN rank's expanded area (plus the compact view's metadata in its
//! slab rows), then raises its dispatch flag. Streaming: rows land in the slabs, each with a
//! row flag holding the round number, and the FFN rank's streaming epilogue expands each row as
//! soon as its flag arrives. The FFN rank's [`FfnReceived::plan`](afdep_core::oracle::exchange::FfnReceived::plan) is the plan its device
//! computed (in every arm). fp8 payloads are quantised on the device while they are stored (into the slab
//! rows, or the source arm's final expanded rows' codes and scales, dequantised on the FFN rank
//! after the dispatch flags); the FFN rank receives what a payload-first fp8 round delivers
//! ([`FfnReceived::fp8`](afdep_core::oracle::exchange::FfnReceived::fp8)). Stream order, fp8, the knobs and the arm rule (the same for every
//! payload) are documented in `fused/count_first.rs` and `docs/design.md`.
//!
//! # Device rounds and CUDA graphs
//!
//! `fused/device_round.rs`: the launches, the verdict, device experts ([`DeviceExperts`]),
//! eager rounds and graphs, of one arm or of every arm with the arm chosen on the device each
//! round ([`RoundArm::Auto`](crate::RoundArm::Auto)); `fused/device_round/host_experts.rs`:
//! [`FusedEngine::round`].

use std::time::Duration;

use afdep_core::ExchangeConfig;
use afdep_core::oracle::exchange::SourceInput;
use afdep_kernels::cudarc::driver::sys::CUevent_flags;
use afdep_kernels::cudarc::driver::{CudaEvent, CudaSlice, result as cures};
use afdep_kernels::ops::fused::{self as fk, RankAddrs};
use afdep_kernels::ops::fused_cf::WorkUnits;
use afdep_kernels::ops::fused_layout::FusedLayout;
use afdep_kernels::{GpuContext, KernelError};
use afdep_transport::{NvlinkIpc, Transport, TransportError};

use crate::error::ExchangeError;
use crate::round::{DevicePhaseTimes, DispatchArm, ExchangeEngine, ExpertFn, RoundOutput, agree};

mod count_first;
pub mod device_round;
#[cfg(feature = "fault-injection")]
pub mod fault;
pub mod round_graph;
pub mod start_gate;
mod trace;
pub use device_round::{BorrowedRound, DeviceExperts, DeviceRoundOptions, FusedGraph};
pub use start_gate::StartGate;

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
    /// Captured graphs get programmatic edges ([`FusedEngine::set_programmatic_graphs`]).
    programmatic: bool,
    /// A source's combine waits in one block first ([`FusedEngine::set_combine_prewait`]).
    combine_prewait: bool,
    /// The start gate of device rounds ([`FusedEngine::set_start_gate`]).
    gate: Option<start_gate::GateUse>,
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
            programmatic: device_round::programmatic_from_env(),
            combine_prewait: false,
            gate: None,
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
