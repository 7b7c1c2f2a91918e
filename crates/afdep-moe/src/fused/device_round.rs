//! Device rounds of the fused engine: a whole dispatch + combine round with no host work between
//! its kernels, eager ([`FusedEngine::device_round`]) or captured once in a CUDA graph and
//! replayed ([`FusedEngine::capture`], [`FusedEngine::replay`]). Every round of the engine is
//! one: [`FusedEngine::round`] (the [`ExchangeEngine`](crate::ExchangeEngine) API, experts an
//! [`ExpertFn`](crate::ExpertFn) on the host) runs the same launches in two halves,
//! `launch_round` with `Part::Front` (steps 1 and 2 below) and `Part::Back` (3 and 4), with the
//! host's experts between them instead of the device experts (`device_round/host_experts.rs`).
//!
//! A device round reads its inputs from fixed device buffers sized by the capacity (the
//! worst case): the caller's rows, routes and token count are copied there before the round
//! (the token count into the control block, `afdep_kernels::ops::fused_round`), and the
//! kernels find everything else on the device:
//!
//! 1. every rank, `afdep_round_begin`: round + 1 in the control block; a source validates its
//!    routes (`afdep_core::route::validate`'s rules on the device, over the control block's
//!    token count) and, with fp8 payloads, then its rows (`afdep_round_check_payload`, launched
//!    just before: the first NaN or infinity in a row that travels is
//!    [`RouteError::NonFinitePayload`], as `afdep_core::oracle::exchange::check_payload` finds
//!    it on the host); every rank publishes its verdict word, its token count and its arm
//!    request to every rank's status area and reads all of them (bounded). A rejection anywhere
//!    makes every rank skip the data phases (every later kernel of the round returns at once),
//!    and every rank returns [`ExchangeError::Route`] with the lowest rejecting rank's error:
//!    the same error as the staged engine's. The round number still advanced on every
//!    rank, so the next round works. From the same records every rank derives the same arm of
//!    the round ([One graph for every arm](self#one-graph-for-every-arm)); ranks that asked for
//!    different arms all skip the round with [`ExchangeError::ArmsDiffer`].
//! 2. the count-first counts, plan and offsets on the device (`fused/count_first.rs`) and
//!    the rows: [`DispatchArm::CountFirst`] (streaming epilogue), [`DispatchArm::CountFirstSource`]
//!    (the source arm), or [`DispatchArm::PayloadFirst`]: every row with its metadata into the
//!    per-source slabs first (slab rows carry each slot's position in its (expert, source)
//!    block), the source's dispatch flag after its last row, and on the FFN rank, after every
//!    source's flag, the plan from the published counts and the copy epilogue (the streaming
//!    epilogue's kernel, whose row flags are all raised by then) into the expanded layout.
//! 3. FFN rank: the device experts ([`DeviceExperts`]) over the expanded rows, then the
//!    combine's FFN half (`afdep_fused_combine_reduce`): for each compact row (its slab
//!    metadata, rows found through the device plan's block starts: no host list) the f32
//!    partial sum of the token's slots on this rank into its source's return area, then the
//!    combine flag.
//! 4. source: the combine's source half, which adds the partials of the FFN ranks that own a
//!    slot of each token (from the routes alone) in the fixed order.
//!
//! With [`DeviceRoundOptions::keep_received`], the FFN rank also copies its slabs (the compact
//! view) into a snapshot buffer before it raises its combine flag (after that flag a source may
//! start the next round's stores into them), so that [`RoundOutput::received`] can be read
//! back after the round, as [`FusedEngine::round`] reads it from the slabs themselves before
//! its host experts run (no snapshot there).
//!
//! # Graphs
//!
//! [`FusedEngine::capture`] records the launches of one device round on the rank's stream into
//! a CUDA graph (collective: a barrier before and after). Every launch argument is fixed: the
//! buffers, the workspace offsets, the grids (worst case, from the capacity); the round number
//! and the token count are read from the control block, which the graph's first kernel
//! increments. [`FusedEngine::replay`] refills the input buffers, the token count and the arm
//! request, poisons the outputs (unless [`FusedEngine::set_poison`] turned that off), launches
//! the graph and reads the results. The engine's GPU context runs with cudarc's per-buffer event tracking off
//! (set in [`FusedEngine::new`], before any buffer exists; everything runs on the one stream),
//! so a capture holds kernel and copy nodes only; the capture is thread-local, nothing in it
//! synchronises, and every kernel is loaded at set-up. A graph belongs to the engine that
//! captured it (replaying it on another engine is an [`ExchangeError::Input`]) and must be
//! dropped only once every rank finished its last round, like the engines.
//!
//! [`FusedEngine::device_round_on_stream`] and [`FusedEngine::replay_on_stream`] do the same
//! from a caller's device buffers ([`BorrowedRound`]) ordered on the caller's stream (the Python
//! bindings: torch tensors on PyTorch's current stream): an event joins the caller's stream
//! into this rank's stream, the inputs are copied device to device into the fixed buffers, the
//! combined rows device to device into the caller's output after the round, and an event joins
//! the rank's stream back; only the verdict is read on the host.
//!
//! [`FusedEngine::set_round_timing`] times whole rounds on the device: a barrier of every rank
//! after the input is loaded, then CUDA events on the rank's stream around the round's launches
//! (a replay: around the graph launch); [`FusedEngine::last_round_time`] (`afdep exchange
//! --graph`). A gated round ([`FusedEngine::set_start_gate`]) is timed from the gate's opening
//! instead ([`start_gate`](super::start_gate)).
//!
//! # One graph for every arm
//!
//! [`RoundArm::Auto`] (`eng.capture(RoundArm::Auto)`, or an eager
//! `eng.device_round(RoundArm::Auto, input)`) launches every arm's kernels in one round: the
//! payload-first, streaming and source-arm row stores, the count-first plan before the rows
//! and the payload-first plan after them, the dispatch flags of payload-first and the source
//! arm, their waits (and the source arm's fp8 dequantisation), the epilogue of payload-first
//! and streaming, and the combine's FFN half in its two kinds (compact rows holding block
//! positions, or the source arm's final rows). The arm is chosen on the
//! device, the same on every rank: each rank's host writes its arm request next to its token
//! count in the control block before the round (the arm forced by [`FusedEngine::set_arm`] at
//! that time, else "auto"), `afdep_round_begin` shares requests and token counts through the
//! status records, and every rank takes rank 0's request, or for "auto" the rule: count-first
//! (the source arm) when the largest source's token count of the round reaches
//! `knobs.min_token_bucket`, payload-first below it ([`DispatchArm::select`]; payload-first
//! always when the configuration's rule never picks count-first). It writes the arm into the
//! control block (`CTL_ARM`, read back after the round: [`FusedEngine::last_arm`]) and into
//! the **arm gates**, one control-block copy per set of arms whose verdict is go only when the
//! round's arm is in the set; a kernel of some arms only is launched with its set's gate
//! instead of the control block, and, like every fused kernel, returns at once when its
//! verdict is not go. A kernel that runs in every arm gets the control block itself. Filtered
//! to the kernels that do not return at once, an auto round is the launch sequence of the fixed
//! round of the arm taken (in the same stream order), so its results are bit-identical to it
//! and its ordering arguments are that round's. The gates are written by the round's first
//! kernel and read only by later kernels of the same rank's stream (ordered by the kernel
//! boundary); the requests and token counts travel in the status records, whose round word is
//! stored with release after them and read with acquire (system scope) before them.
//!
//! The cost over a fixed-arm graph: no host synchronisation and no host decision (the request is
//! written by the same copy as the token count), a status record of 16 words instead of 8, and the
//! launches of the arms not taken, each a kernel that reads one word and returns (per round at most
//! three on a source-only rank, four on an FFN-only rank (five with fp8), seven on a rank that is
//! both (eight)).
//!
//! # Experts
//!
//! [`DeviceExperts::Scale`] (bf16(f32(x) · s_e), bit-reproducible: its host twin
//! [`DeviceExperts::host`] makes the oracle's results bit-identical) or
//! [`DeviceExperts::SwiGlu`], the layer's expert FFN through afdep-kernels' grouped GEMM
//! (`ops::gemm::up_swiglu`, `ops::gemm::down`, as `MoeLayer` uses them): the device plan's
//! expert offsets and the expanded rows are copied on the device into the GEMM's buffers, the
//! groups are the local experts; within the bf16 tolerances of [`crate::accuracy`]. The GEMM
//! kernels are loaded and warmed up in [`FusedEngine::prepare_device`] (their occupancy and
//! fault word are set up there, not during a capture). Or [`DeviceExperts::Identity`]: no
//! expert kernel, the combine's FFN half reads the expanded area itself (the latency runs').
//!
//! # fp8 payloads
//!
//! Every arm carries fp8 rows as documented in `fused/count_first.rs` ("fp8 payloads"): each row quantised on the device while it is stored, codes and scales
//! expanded beside the dequantised bf16 rows, which are what the device experts consume (the
//! oracle's fp8 exchange: experts on `bf16(f32(q) · scale)`); [`RoundOutput::received`] holds
//! the codes and scales of both views. Combine is bf16 out, f32 sums.

use afdep_core::ExchangeConfig;
use afdep_core::oracle::exchange::SourceInput;
use afdep_core::{PayloadKind, RouteError, bf16};
use afdep_kernels::cudarc::driver::{CudaSlice, result as cures, sys};

use super::round_graph::RoundGraph;
use afdep_kernels::ops::fused::{self as fk, RankAddrs};
use afdep_kernels::ops::fused_cf::{self as cf, CfMode, CfSource, FfnRanks};
use afdep_kernels::ops::fused_front::{self as ff, FrontStart};
use afdep_kernels::ops::fused_layout::FusedLayout;
use afdep_kernels::ops::fused_round::{
    self as fr, ARM_GATES, CTL_ARM, CTL_ROUTE, CTL_TOKENS, CTL_VERDICT, CTL_WORDS, DeviceRules,
    PayloadRows, PlanView, RoundSource,
};
use afdep_kernels::ops::{download, poison, zeros};
use afdep_kernels::{GpuContext, KernelError};
use afdep_transport::Transport;
use std::time::Instant;

use super::start_gate::{Held, StartGate};
use super::trace::{self, Tracer};
use super::{CONTROL, DISPATCH_FLAGS, FusedEngine, upload};
use crate::error::ExchangeError;
use crate::round::{DispatchArm, PhaseTimes, RoundArm, RoundOutput, RoundTrace, TracePhase};

mod host_experts;
mod pipelined;

/// The experts an FFN rank applies on the device in a device round.
#[derive(Debug, Clone)]
pub enum DeviceExperts {
    /// Expert e maps a row x to `bf16(f32(x) * scales[e])` (one rounding, bit-reproducible):
    /// the exchange tests' and latency runs' expert. `scales` holds one f32 per global expert.
    Scale(Vec<f32>),
    /// The layer's SwiGLU expert FFN (`W1`, `W3`, `W2` of the parameters, whose shape must have
    /// the configuration's hidden size and experts) through afdep-kernels' grouped GEMM over the
    /// expanded layout, groups from the device plan's expert offsets: `h = bf16(silu(x·W1) ·
    /// x·W3)`, `y = bf16(h·W2)`; within bf16 tolerances of the oracle's `expert_rows`
    /// ([`crate::accuracy`]), not bit-identical. Hidden size and width must be multiples of 8.
    SwiGlu(std::sync::Arc<afdep_core::oracle::LayerParams>),
    /// Every expert returns its rows unchanged. No expert kernel runs: the combine reads the
    /// expanded rows themselves, so a round is the exchange alone (the latency runs' expert;
    /// `afdep exchange --expert identity --graph`). Bit-identical to the oracle with
    /// [`DeviceExperts::host`].
    Identity,
}

impl DeviceExperts {
    /// [`DeviceExperts::Scale`] with `scales[e] = e + 1` for `experts` experts.
    pub fn index_scale(experts: usize) -> DeviceExperts {
        DeviceExperts::Scale((0..experts).map(|e| e as f32 + 1.0).collect())
    }

    /// The same experts on the host, as an [`crate::ExpertFn`] for the oracle and the staged
    /// engine: bit-identical results for [`DeviceExperts::Scale`], the oracle's SwiGLU
    /// (`afdep_core::oracle::layer::expert_rows`) for [`DeviceExperts::SwiGlu`].
    pub fn host(&self) -> impl Fn(usize, &[bf16], usize) -> Vec<bf16> + '_ {
        move |e: usize, rows: &[bf16], n: usize| match self {
            DeviceExperts::Scale(s) => {
                let k = s[e];
                rows.iter()
                    .map(|v| bf16::from_f32(v.to_f32() * k))
                    .collect()
            }
            DeviceExperts::SwiGlu(p) => afdep_core::oracle::layer::expert_rows(p, e, rows, n)
                .unwrap_or_else(|_| vec![bf16::from_bits(0xFFFF); rows.len()]),
            DeviceExperts::Identity => rows.to_vec(),
        }
    }
}

/// A source's input and output of a device round in the caller's device memory
/// ([`FusedEngine::device_round_on_stream`], [`FusedEngine::replay_on_stream`]): device
/// pointers (`CUdeviceptr`) of contiguous buffers.
#[derive(Debug, Clone, Copy)]
pub struct BorrowedRound {
    /// The round's token count T on this rank (above the capacity: the round is rejected,
    /// over capacity, on every rank).
    pub tokens: usize,
    /// The rows, T × hidden bf16.
    pub x: u64,
    /// The routes' expert ids, T × top-k i32.
    pub idx: u64,
    /// The routes' weights, T × top-k f32.
    pub weights: u64,
    /// The combined rows, T × hidden bf16 (written).
    pub out: u64,
}

/// Where a device round's source input comes from: the host ([`SourceInput`], copied host to
/// device) or the caller's device buffers ([`BorrowedRound`], copied device to device).
#[derive(Debug, Clone, Copy)]
enum Feed<'a> {
    Host(Option<&'a SourceInput>),
    Device(Option<&'a BorrowedRound>),
}

/// Copies `n` elements from the caller's device pointer `src` into `dst`, on the context's
/// stream.
///
/// # Safety
/// `src` is a live device allocation of `gpu`'s device holding `n` elements of `T`, not written
/// until the stream passes the copy; `n <= dst.len()`.
unsafe fn copy_dtod<T: afdep_kernels::cudarc::driver::DeviceRepr>(
    gpu: &GpuContext,
    dst: &mut CudaSlice<T>,
    src: u64,
    n: usize,
) -> Result<(), ExchangeError> {
    use afdep_kernels::cudarc::driver::DevicePtrMut;
    debug_assert!(n <= dst.len());
    let (d, _guard) = dst.device_ptr_mut(gpu.stream());
    // SAFETY: the caller's contract; `d` holds at least `n` elements.
    unsafe {
        copy_bytes(
            gpu,
            d,
            src,
            n * std::mem::size_of::<T>(),
            "copying the caller's input",
        )
    }
}

/// `bytes` bytes from device address `src` to `dst` on the context's stream (nothing for 0).
///
/// # Safety
/// Both addresses are live device memory of `gpu`'s device valid for `bytes` bytes, and
/// nothing else writes either range until the stream passes the copy.
unsafe fn copy_bytes(
    gpu: &GpuContext,
    dst: u64,
    src: u64,
    bytes: usize,
    what: &'static str,
) -> Result<(), ExchangeError> {
    if bytes == 0 {
        return Ok(());
    }
    let stream = gpu.stream();
    // SAFETY: the caller's contract.
    unsafe { sys::cuMemcpyDtoDAsync_v2(dst, src, bytes, stream.cu_stream()) }
        .result()
        .map_err(KernelError::driver(what))?;
    Ok(())
}

/// Makes `later` wait (on the device) for everything queued so far on `first`: an event
/// recorded on `first`, waited for by `later`, released by the driver once passed.
///
/// # Safety
/// Both are live streams of the bound context (or null, the legacy default stream).
unsafe fn order_streams(first: sys::CUstream, later: sys::CUstream) -> Result<(), ExchangeError> {
    let drv = KernelError::driver;
    let mut ev: sys::CUevent = std::ptr::null_mut();
    // SAFETY: plain driver calls on an event created here and streams of the bound context.
    unsafe {
        sys::cuEventCreate(&mut ev, sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32)
            .result()
            .map_err(drv("creating an event"))?;
        let r = sys::cuEventRecord(ev, first)
            .result()
            .map_err(drv("recording an event"))
            .and_then(|()| {
                sys::cuStreamWaitEvent(later, ev, 0)
                    .result()
                    .map_err(drv("waiting on an event"))
            });
        let d = sys::cuEventDestroy_v2(ev)
            .result()
            .map_err(drv("destroying an event"));
        r.and(d)?;
    }
    Ok(())
}

/// Options of device rounds ([`FusedEngine::prepare_device`]).
#[derive(Debug, Clone)]
pub struct DeviceRoundOptions {
    /// The FFN ranks' device experts.
    pub experts: DeviceExperts,
    /// Snapshot the compact view on the device and read [`RoundOutput::received`] back after
    /// each round (tests; costs a copy of the slabs per round).
    pub keep_received: bool,
}

/// The control block's code of an arm (`AFDEP_ARM_*`).
fn arm_code(a: DispatchArm) -> u32 {
    match a {
        DispatchArm::PayloadFirst => fr::arm::PAYLOAD_FIRST,
        DispatchArm::CountFirst => fr::arm::COUNT_FIRST,
        DispatchArm::CountFirstSource => fr::arm::SOURCE,
    }
}

/// The arm of a control-block code; `None` for [`fr::arm::AUTO`] and unknown codes.
fn arm_of_code(c: u32) -> Option<DispatchArm> {
    DispatchArm::ALL.into_iter().find(|&a| arm_code(a) == c)
}

/// A request code as a [`RoundArm`] (for errors).
fn request_of_code(c: u32) -> RoundArm {
    arm_of_code(c).map_or(RoundArm::Auto, RoundArm::Fixed)
}

/// The bucket of the arm rule of `cfg` for the device ([`DeviceRules::bucket`]): the smallest
/// largest-source token count for which [`super::count_first::rule`] picks count-first, or
/// `u64::MAX` when it never does (the rule is a threshold on that count).
fn rule_bucket(cfg: &afdep_core::ExchangeConfig) -> u64 {
    match super::count_first::rule(cfg, &[u64::MAX]) {
        DispatchArm::PayloadFirst => u64::MAX,
        _ => cfg.knobs.min_token_bucket as u64,
    }
}

/// An arm's bit in a set of arms (bit `a` for control-block code `a`).
fn arm_bit(a: DispatchArm) -> u32 {
    1 << arm_code(a)
}

/// The sets of arms of a round's kernels.
const PF: u32 = 1 << fr::arm::PAYLOAD_FIRST;
const CF: u32 = 1 << fr::arm::COUNT_FIRST;
const SRC: u32 = 1 << fr::arm::SOURCE;
const ALL_ARMS: u32 = PF | CF | SRC;

/// The control block a kernel of the arms `arms` is launched with in a round that may take the
/// arms `round` (one arm: a fixed round; every arm: [`RoundArm::Auto`]): none (not launched)
/// when the sets are disjoint, the control block `ctl` when the kernel runs in every arm the
/// round may take, else the gate (at `gates`) of the arms it has in common with the round, so
/// that it returns at once when the round takes another arm.
fn arm_gate(ctl: u64, gates: u64, round: u32, arms: u32) -> Option<u64> {
    match arms & round {
        0 => None,
        m if m == round => Some(ctl),
        m => Some(fr::gate_address(gates, m)),
    }
}

/// The events of round timing: before and after a device round's launches, and the span of
/// the last round that completed.
struct RoundTimer {
    start: afdep_kernels::cudarc::driver::CudaEvent,
    stop: afdep_kernels::cudarc::driver::CudaEvent,
    last: Option<std::time::Duration>,
}

impl std::fmt::Debug for RoundTimer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RoundTimer")
            .field("last", &self.last)
            .finish()
    }
}

/// The capacity-sized device buffers of a source's device rounds.
#[derive(Debug)]
struct SourceBufs {
    x: CudaSlice<bf16>,
    idx: CudaSlice<i32>,
    w: CudaSlice<f32>,
    out: CudaSlice<bf16>,
    /// fp8 payloads: the state of the payload check (`ops::fused_round::check_payload`).
    payload: Option<CudaSlice<u32>>,
}

/// The device buffers of an FFN rank's device rounds.
#[derive(Debug)]
struct FfnBufs {
    scale: CudaSlice<f32>,
    /// The expert outputs (one element with [`DeviceExperts::Identity`]: the combine reads the
    /// expanded area).
    y: CudaSlice<bf16>,
    /// [`DeviceExperts::Identity`].
    identity: bool,
    snapshot: Option<CudaSlice<u8>>,
    swiglu: Option<SwigluBufs>,
}

/// An FFN rank's SwiGLU experts: its local experts' weights, the GEMM groups (a copy of the
/// device plan's expert offsets), the GEMM's input rows (a copy of the expanded area: the GEMM
/// takes device buffers) and the SwiGLU activations.
#[derive(Debug)]
pub(crate) struct SwigluBufs {
    w1: CudaSlice<bf16>,
    w3: CudaSlice<bf16>,
    w2: CudaSlice<bf16>,
    width: usize,
    offsets: CudaSlice<u64>,
    x: CudaSlice<bf16>,
    h: CudaSlice<bf16>,
}

/// A rank's device-round state.
#[derive(Debug)]
pub(super) struct DeviceRound {
    id: u64,
    /// Made by [`FusedEngine::round`] without [`FusedEngine::prepare_device`]: buffers for
    /// rounds whose experts run on the host only (no device experts: the FFN rank's expert
    /// output buffer is one element), which device rounds, graphs and staged rounds refuse.
    host_only: bool,
    keep_received: bool,
    /// The arm gates (`fr::ARM_GATES` control blocks, written by `afdep_round_begin`).
    gates: CudaSlice<u32>,
    /// Round timing ([`FusedEngine::set_round_timing`]).
    timer: Option<RoundTimer>,
    /// Phase stamps ([`FusedEngine::set_trace`]).
    trace: Option<Tracer>,
    /// The staging of staged rounds (the microbatch pipeline, `pipelined`).
    staging: Option<pipelined::StagedBufs>,
    src: Option<SourceBufs>,
    ffn: Option<FfnBufs>,
    /// A round queued on the caller's stream whose verdict is not read yet
    /// ([`FusedEngine::device_round_on_stream`] with `wait` false).
    queued: Option<Queued>,
}

/// A queued round's state until its verdict is read ([`FusedEngine::finish_queued`]).
#[derive(Debug)]
struct Queued {
    arm: RoundArm,
    local: Option<ExchangeError>,
    t0: Instant,
}

/// A round's output without rows (the on-stream rounds write theirs into the caller's buffer).
fn no_output() -> RoundOutput {
    RoundOutput {
        combined: None,
        received: None,
        times: PhaseTimes::default(),
    }
}

/// A dispatch + combine round of one rank captured in a CUDA graph ([`FusedEngine::capture`]);
/// replay it with [`FusedEngine::replay`].
pub struct FusedGraph {
    graph: RoundGraph,
    arm: RoundArm,
    engine: u64,
    /// The phase order of the stamps the graph holds (captured with tracing on), else `None`.
    trace_order: Option<Vec<TracePhase>>,
    /// The start gate whose kernel is the graph's first node (captured with a gate set): kept
    /// alive with the graph, and the only gate it replays behind.
    gate: Option<StartGate>,
}

// SAFETY: the graph and its executable are driver handles that any thread may use with the
// context bound (replay binds it); the driver does not allow concurrent use of one executable,
// which `FusedGraph` being `Send` but not `Sync` rules out (one thread at a time owns it).
unsafe impl Send for FusedGraph {}

impl std::fmt::Debug for FusedGraph {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FusedGraph")
            .field("arm", &self.arm)
            .field("engine", &self.engine)
            .field("gated", &self.gate.is_some())
            .finish()
    }
}

impl FusedGraph {
    /// The arm the graph was captured for ([`RoundArm::Auto`]: every arm's kernels, one arm
    /// chosen on the device per replay; [`FusedEngine::last_arm`] after a replay).
    pub fn arm(&self) -> RoundArm {
        self.arm
    }

    /// How many of the graph's edges are programmatic ([`FusedEngine::set_programmatic_graphs`]
    /// at capture; 0 without).
    pub fn programmatic_edges(&self) -> usize {
        self.graph.programmatic_edges()
    }

    /// Kernel, copy and other nodes of the captured graph, by the driver's node type.
    pub fn node_types(&self) -> Result<Vec<u32>, ExchangeError> {
        let g = self.graph.cu_graph();
        let mut n = 0usize;
        // SAFETY: g is the live graph this object owns; a null array asks for the count.
        unsafe { sys::cuGraphGetNodes(g, std::ptr::null_mut(), &mut n) }
            .result()
            .map_err(KernelError::driver("counting graph nodes"))?;
        let mut nodes = vec![std::ptr::null_mut(); n];
        // SAFETY: `nodes` holds n entries, the count the driver gave for this graph.
        unsafe { sys::cuGraphGetNodes(g, nodes.as_mut_ptr(), &mut n) }
            .result()
            .map_err(KernelError::driver("listing graph nodes"))?;
        let mut out = Vec::with_capacity(n);
        for node in nodes.into_iter().take(n) {
            let mut t = sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_EMPTY;
            // SAFETY: node is a node of the live graph.
            unsafe { sys::cuGraphNodeGetType(node, &mut t) }
                .result()
                .map_err(KernelError::driver("reading a graph node's type"))?;
            out.push(t as u32);
        }
        Ok(out)
    }
}

/// The bound of [`FusedEngine::prepare_device`]'s closing barrier when the transport's own
/// timeout is shorter: a rank whose on-disk kernel cache is cold compiles the expert GEMM's
/// modules before it arrives, which takes tens of seconds, while its peers wait.
pub const SETUP_BARRIER_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(300);

static NEXT_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

fn bind(gpu: &GpuContext) -> Result<(), ExchangeError> {
    gpu.cuda()
        .bind_to_thread()
        .map_err(KernelError::driver("binding the context"))?;
    Ok(())
}

impl FusedEngine {
    /// Allocates this rank's device-round buffers (capacity-sized: inputs and output of a
    /// source; expert scales or SwiGLU weights, outputs and the optional snapshot of an FFN
    /// rank). Once per engine (graphs keep the buffers' addresses). Collective (a barrier at
    /// the end, bounded by the longer of the transport's timeout and
    /// [`SETUP_BARRIER_TIMEOUT`]: a rank may be compiling kernels into a cold cache): every rank
    /// of the group calls it before its first device round.
    pub fn prepare_device(&mut self, opts: DeviceRoundOptions) -> Result<(), ExchangeError> {
        let rank = self.rank();
        if self.device.as_ref().is_some_and(|d| !d.host_only) {
            return Err(ExchangeError::Input {
                rank,
                what: "device rounds are prepared already".into(),
            });
        }
        let cfg = self.cfg.clone();
        let p = cfg.placement();
        let h = cfg.hidden;
        let ones = vec![1.0f32; cfg.experts];
        let scales: &[f32] = match &opts.experts {
            DeviceExperts::Scale(s) => s,
            DeviceExperts::Identity => &ones,
            DeviceExperts::SwiGlu(lp) => {
                let sh = &lp.shape;
                if sh.d_model != h || sh.experts != cfg.experts || h % 8 != 0 || sh.width % 8 != 0 {
                    return Err(ExchangeError::Input {
                        rank,
                        what: format!(
                            "SwiGLU experts of hidden {}, {} experts, width {} for a \
                             configuration of hidden {h}, {} experts (hidden and width must \
                             be multiples of 8)",
                            sh.d_model, sh.experts, sh.width, cfg.experts
                        ),
                    });
                }
                &ones
            }
        };
        if scales.len() < p.owned() {
            return Err(ExchangeError::Input {
                rank,
                what: format!(
                    "{} expert scales for {} owned experts",
                    scales.len(),
                    p.owned()
                ),
            });
        }
        let src = self.source_bufs()?;
        let ffn = match cfg.topology.ffn_index(rank) {
            Some(f) => {
                let local = &scales[p.experts_of(f)];
                let snap = self.geo.slab().row_bytes
                    * u64::from(self.geo.slab().cap)
                    * cfg.topology.attention_count() as u64;
                let swiglu = match &opts.experts {
                    DeviceExperts::SwiGlu(lp) => Some(self.swiglu_bufs(lp, f)?),
                    DeviceExperts::Scale(_) | DeviceExperts::Identity => None,
                };
                let identity = matches!(opts.experts, DeviceExperts::Identity);
                let y_len = if identity {
                    1
                } else {
                    (self.geo.exp_rows as usize * h).max(1)
                };
                Some(FfnBufs {
                    scale: upload(&self.gpu, local)?,
                    y: zeros(&self.gpu, y_len)?,
                    identity,
                    snapshot: if opts.keep_received {
                        Some(zeros(&self.gpu, (snap as usize).max(1))?)
                    } else {
                        None
                    },
                    swiglu,
                })
            }
            None => None,
        };
        let gates = zeros(&self.gpu, ARM_GATES * CTL_WORDS)?;
        self.gpu.synchronize()?;
        // kernels loaded (the GEMM's at its warm-up) on every rank before any round. A rank
        // whose kernel cache is cold compiles the GEMM modules here (tens of seconds), so this
        // one wait is bounded by the set-up bound, not by the rounds' timeout.
        let round_timeout = self.transport.timeout();
        self.transport
            .set_timeout(round_timeout.max(SETUP_BARRIER_TIMEOUT));
        let arrived = self.transport.barrier();
        self.transport.set_timeout(round_timeout);
        arrived?;
        // only now, with everything above done, the buffers `round` made for its host experts
        // go (their timer and tracer stay): a failed preparation leaves the engine as it was
        let (timer, trace) = match self.device.take() {
            Some(d) => (d.timer, d.trace),
            None => (None, None),
        };
        self.device = Some(DeviceRound {
            id: NEXT_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            host_only: false,
            keep_received: opts.keep_received,
            gates,
            timer,
            trace,
            staging: None,
            src,
            ffn,
            queued: None,
        });
        Ok(())
    }

    /// A source's capacity-sized input and output buffers (`None` on an FFN-only rank).
    fn source_bufs(&self) -> Result<Option<SourceBufs>, ExchangeError> {
        let cfg = &self.cfg;
        let (h, k, cap) = (cfg.hidden, cfg.top_k, cfg.capacity);
        if cfg.topology.attention_index(self.rank()).is_none() {
            return Ok(None);
        }
        Ok(Some(SourceBufs {
            x: zeros(&self.gpu, (cap * h).max(1))?,
            idx: zeros(&self.gpu, (cap * k).max(1))?,
            w: zeros(&self.gpu, (cap * k).max(1))?,
            out: zeros(&self.gpu, (cap * h).max(1))?,
            payload: match cfg.payload {
                PayloadKind::Bf16 => None,
                PayloadKind::Fp8E4m3 => Some(zeros(&self.gpu, fr::PAYLOAD_STATE_WORDS)?),
            },
        }))
    }

    /// The device-round state of [`FusedEngine::round`] on an engine without
    /// [`FusedEngine::prepare_device`] ([`DeviceRound::host_only`]): a source's buffers, an FFN
    /// rank's placeholder expert buffers (its experts run on the host, their outputs come
    /// with each round), the arm gates. Not collective: every buffer comes from the stream's
    /// allocator, no kernel is loaded (every fused kernel was at set-up), and the round that
    /// follows meets its peers on the device.
    fn prepare_host_rounds(&mut self) -> Result<(), ExchangeError> {
        let rank = self.rank();
        let src = self.source_bufs()?;
        // the scales of the device experts, which never run on these buffers (they stay
        // until the stream was waited for below)
        let ones = vec![1.0f32; self.cfg.placement().experts_per_rank.max(1)];
        let ffn = match self.cfg.topology.ffn_index(rank) {
            Some(_) => Some(FfnBufs {
                scale: upload(&self.gpu, &ones)?,
                y: zeros(&self.gpu, 1)?,
                identity: false,
                snapshot: None,
                swiglu: None,
            }),
            None => None,
        };
        let gates = zeros(&self.gpu, ARM_GATES * CTL_WORDS)?;
        self.gpu.synchronize()?;
        self.device = Some(DeviceRound {
            id: NEXT_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            host_only: true,
            keep_received: false,
            gates,
            timer: None,
            trace: None,
            staging: None,
            src,
            ffn,
            queued: None,
        });
        Ok(())
    }

    /// Whether outputs are poisoned before every device round (default on): unwritten rows then
    /// read as NaN. Latency runs may turn it off (the poisoning happens before a round's timed
    /// span, [`FusedEngine::set_round_timing`]).
    pub fn set_poison(&mut self, on: bool) {
        self.poison = on;
    }

    /// Whether device rounds launch one front kernel per rank (default off, or as the
    /// environment variable `AFDEP_FUSED_FRONTS` says: `1`/`on` turns them on): a source's
    /// start, counts and rows in one grid, an FFN rank's start, plan and epilogue in another
    /// (`fused_front.cu`), instead of a launch per phase. Only for ranks that are a source or an
    /// FFN rank but not both, and not in traced rounds (whose stamps sit between the phases'
    /// launches). The results are the same bit for bit; graphs keep what they captured.
    ///
    /// Off by default since 2026-12-07 (docs/perf/exchange.md, "Outcome of steps 1 and 1b"):
    /// on one H100 they gave no gain at 1 token and cost 3 % at 2,048, and a front holds its
    /// whole grid while its first block waits for the other ranks, which the microbatch
    /// pipeline's two slots on one GPU are suspected to trip over (a device timeout at 3A:1F).
    pub fn set_fronts(&mut self, on: bool) {
        self.fronts = on;
    }

    /// Whether [`FusedEngine::capture`] makes the captured graph's kernel-to-kernel edges
    /// programmatic (default off, or as the environment variable `AFDEP_GRAPH_PDL` says: `1`/`on`
    /// turns it on): each kernel of a rank's chain is then launched while the one before it
    /// runs and waits on the device for it ([`round_graph`](super::round_graph)), instead of
    /// being launched when it ends. The results are the same bit for bit; eager rounds and
    /// graphs captured before are unchanged.
    pub fn set_programmatic_graphs(&mut self, on: bool) {
        self.programmatic = on;
    }

    /// Whether a source's combine in device rounds first waits for the FFN ranks' combine
    /// flags in a kernel of one block, so that no grid of `transport_sms` blocks waits out the
    /// FFN ranks' experts (default off: one more dependent launch per round). The microbatch
    /// pipeline turns it on for its slots ([`crate::pipeline::PipelineRank::new`]): with two
    /// slots of emulated ranks on one GPU the sources' waiting combine grids can occupy every
    /// SM while the GEMM they wait for needs a whole one (docs/perf/exchange.md, the
    /// pipeline's 3A:1F timeout). The results are the same bit for bit; graphs keep what they
    /// captured.
    pub fn set_combine_prewait(&mut self, on: bool) {
        self.combine_prewait = on;
    }

    /// Turns timing of device rounds on or off. With timing on, every device round (eager, or a
    /// graph replay) starts with a control-plane barrier of every rank after its input was
    /// loaded, then a CUDA event on this rank's stream right before the round's launches (a
    /// replay: before the graph launch) and one right after them; [`FusedEngine::last_round_time`]
    /// gives the span of the last round: this rank's whole round on the device, its waits for
    /// its peers included (with a start gate set: from the gate's opening, an event on the
    /// gate's stream, to the event after the launches). Collective in effect (the barrier):
    /// every rank must set the same.
    /// Needs device-round state ([`FusedEngine::prepare_device`], or a first
    /// [`FusedEngine::round`]); creates the events now, outside any round.
    pub fn set_round_timing(&mut self, on: bool) -> Result<(), ExchangeError> {
        let rank = self.rank();
        let timer = if on {
            let ev = || {
                self.gpu
                    .cuda()
                    .new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
                    .map_err(KernelError::driver("creating a round event"))
            };
            Some(RoundTimer {
                start: ev()?,
                stop: ev()?,
                last: None,
            })
        } else {
            None
        };
        let d = self.device.as_mut().ok_or_else(|| ExchangeError::Input {
            rank,
            what: "round timing needs FusedEngine::prepare_device first".into(),
        })?;
        d.timer = timer;
        Ok(())
    }

    /// The device time of the last device round (eager or replayed) that completed with round
    /// timing on ([`FusedEngine::set_round_timing`]); `None` when timing is off or the last
    /// round failed.
    pub fn last_round_time(&self) -> Option<std::time::Duration> {
        self.device.as_ref()?.timer.as_ref()?.last
    }

    /// Turns phase tracing of device rounds on or off (timelines, [`RoundTrace`]): with it on,
    /// every device round launched or captured afterwards stamps the device timer at each of
    /// its phase boundaries, and [`FusedEngine::last_trace`] gives the last completed round's
    /// timeline (a replay: only of a graph captured with tracing on). The stamp buffer is
    /// allocated at the first call and kept (graphs captured with tracing on write into it).
    /// Needs device-round state ([`FusedEngine::prepare_device`], or a first
    /// [`FusedEngine::round`]); not collective.
    pub fn set_trace(&mut self, on: bool) -> Result<(), ExchangeError> {
        let rank = self.rank();
        let d = self.device.as_mut().ok_or_else(|| ExchangeError::Input {
            rank,
            what: "tracing needs FusedEngine::prepare_device first".into(),
        })?;
        if d.trace.is_none() {
            d.trace = Some(Tracer::new(&self.gpu)?);
        }
        if let Some(t) = d.trace.as_mut() {
            t.on = on;
            t.last = None;
        }
        Ok(())
    }

    /// The probe points this rank's kernels recorded since the last call (the last round's,
    /// when called after each round), by slot, zeroed for the next round: `None` unless the
    /// kernels are built with probes ([`afdep_kernels::ops::probe`], `AFDEP_NVRTC_OPTIONS=-DAFDEP_PROBE`).
    /// Waits for this rank's stream: call it between rounds.
    pub fn take_probes(
        &mut self,
    ) -> Result<Option<[u64; afdep_kernels::ops::probe::SLOTS]>, ExchangeError> {
        if !afdep_kernels::ops::probe::compiled_in(&self.gpu) {
            return Ok(None);
        }
        bind(&self.gpu)?;
        Ok(afdep_kernels::ops::probe::take(&self.gpu)?)
    }

    /// The timeline of the last device round that completed with tracing on
    /// ([`FusedEngine::set_trace`]); `None` when tracing is off, the round failed, or the
    /// replayed graph was captured without tracing.
    pub fn last_trace(&self) -> Option<&RoundTrace> {
        self.device.as_ref()?.trace.as_ref()?.last.as_ref()
    }

    /// With tracing on, before a round: clears the stamps; for a replay (`Some`), takes the
    /// graph's phase order (`None` inside: captured untraced, nothing is read after it).
    fn clear_trace(&mut self, graph: Option<Option<&[TracePhase]>>) -> Result<(), ExchangeError> {
        let Some(t) = self
            .device
            .as_mut()
            .and_then(|d| d.trace.as_mut())
            .filter(|t| t.on)
        else {
            return Ok(());
        };
        t.clear(&self.gpu)?;
        if let Some(order) = graph {
            t.order = order.map(<[_]>::to_vec).unwrap_or_default();
        }
        Ok(())
    }

    /// With tracing on, after a completed round: its timeline (none for a graph captured
    /// untraced: its order is empty).
    fn read_trace(&mut self) -> Result<(), ExchangeError> {
        let rank = self.rank();
        if let Some(t) = self
            .device
            .as_mut()
            .and_then(|d| d.trace.as_mut())
            .filter(|t| t.on && !t.order.is_empty())
        {
            t.read(&self.gpu, rank)?;
        }
        Ok(())
    }

    /// With round timing on: the barrier and the start event (`start`), or the stop event.
    fn round_event(&mut self, start: bool) -> Result<(), ExchangeError> {
        let Some(t) = self.device.as_mut().and_then(|d| d.timer.as_mut()) else {
            return Ok(());
        };
        if start {
            t.last = None;
            self.transport.barrier()?;
        }
        let t = self.device.as_ref().and_then(|d| d.timer.as_ref());
        let e = t.map(|t| if start { &t.start } else { &t.stop });
        if let Some(e) = e {
            e.record(self.gpu.stream())
                .map_err(KernelError::driver("recording a round event"))?;
        }
        Ok(())
    }

    /// With round timing on, after a completed round (its stream waited for): the span, from
    /// the start event, or for a gated round (`held`) from the gate's opening
    /// ([`start_gate`](super::start_gate)).
    fn read_round_time(&mut self, held: Option<Held>) -> Result<(), ExchangeError> {
        let Some(t) = self.device.as_ref().and_then(|d| d.timer.as_ref()) else {
            return Ok(());
        };
        let ms = match held {
            Some(_) => self.gate_elapsed_ms(&t.stop)?,
            None => t
                .start
                .elapsed_ms(&t.stop)
                .map_err(KernelError::driver("reading a round event"))?,
        };
        let span = std::time::Duration::from_secs_f64(f64::from(ms.max(0.0)) * 1e-3);
        if let Some(t) = self.device.as_mut().and_then(|d| d.timer.as_mut()) {
            t.last = Some(span);
        }
        Ok(())
    }

    /// Runs one device round eagerly (the launches a graph captures, [module docs](self)).
    /// Attention ranks pass `Some(input)`; every rank of the group passes the same `arm`: a
    /// [`DispatchArm`] (forced) or [`RoundArm::Auto`] (chosen on the device). Collective.
    pub fn device_round(
        &mut self,
        arm: impl Into<RoundArm>,
        input: Option<&SourceInput>,
    ) -> Result<RoundOutput, ExchangeError> {
        let arm = arm.into();
        self.guarded(|eng| {
            let t0 = Instant::now();
            let local = eng.load_input(arm, Feed::Host(input), true)?;
            eng.clear_trace(None)?;
            let held = eng.gate_hold()?;
            eng.round_event(true)?;
            eng.launch_device_round(arm)?;
            eng.round_event(false)?;
            eng.gate_open(held)?;
            let out = eng.finish_device_round(arm, input, local, t0)?;
            eng.read_round_time(held)?;
            eng.read_trace()?;
            Ok(out)
        })
    }

    /// Captures one device round into a CUDA graph on this rank's stream ([module
    /// docs](self)): of one arm (a [`DispatchArm`]), or of every arm with the arm chosen on the
    /// device at each replay ([`RoundArm::Auto`], [module docs](self#one-graph-for-every-arm)).
    /// Collective (barriers before and after); no round may be in flight.
    pub fn capture(&mut self, arm: impl Into<RoundArm>) -> Result<FusedGraph, ExchangeError> {
        let arm = arm.into();
        let rank = self.rank();
        self.check_open()?;
        self.check_device(arm)?;
        self.transport.barrier()?;
        bind(&self.gpu)?;
        let s = self.gpu.stream().clone();
        s.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(KernelError::driver("beginning a graph capture"))?;
        // with a gate set, the gate's kernel is the graph's first node (`start_gate`)
        let gate = self.start_gate().cloned();
        let launched = self
            .gate_kernel()
            .and_then(|()| self.launch_device_round(arm));
        // programmatic edges only where the kernels hold the wait (sm_90 on)
        let programmatic = self.programmatic && self.gpu.arch().has_grid_dependency_control();
        if self.programmatic && !programmatic {
            tracing::warn!(
                rank,
                arch = %self.gpu.arch(),
                "programmatic graph edges need sm_90 or later; captured without"
            );
        }
        let ended = RoundGraph::end_capture(&s, programmatic);
        launched?;
        let graph = ended?.ok_or_else(|| ExchangeError::Input {
            rank,
            what: "the captured round is empty".into(),
        })?;
        if programmatic {
            tracing::info!(
                rank,
                edges = graph.programmatic_edges(),
                "captured round: programmatic kernel-to-kernel edges"
            );
        }
        graph
            .upload()
            .map_err(KernelError::driver("uploading the graph"))?;
        self.gpu.synchronize()?;
        self.transport.barrier()?;
        let engine = self.device.as_ref().map_or(0, |d| d.id);
        let trace_order = self
            .device
            .as_ref()
            .and_then(|d| d.trace.as_ref())
            .filter(|t| t.on)
            .map(|t| t.order.clone());
        Ok(FusedGraph {
            graph,
            arm,
            engine,
            trace_order,
            gate,
        })
    }

    /// `Input` unless `graph` was captured by this engine.
    fn check_graph(&self, graph: &FusedGraph) -> Result<(), ExchangeError> {
        if self.device.as_ref().map(|d| d.id) != Some(graph.engine) {
            return Err(ExchangeError::Input {
                rank: self.rank(),
                what: "the graph was captured by another engine".into(),
            });
        }
        Ok(())
    }

    /// Replays a captured round with new input: copies `input` (rows, routes, token count) into
    /// the fixed device buffers, poisons the outputs, launches the graph, reads the results.
    /// Collective, like a round.
    pub fn replay(
        &mut self,
        graph: &FusedGraph,
        input: Option<&SourceInput>,
    ) -> Result<RoundOutput, ExchangeError> {
        self.check_graph(graph)?;
        if let Some(g) = &graph.gate {
            self.check_same_gate(g)?;
        }
        self.guarded(|eng| {
            let t0 = Instant::now();
            let local = eng.load_input(graph.arm, Feed::Host(input), true)?;
            bind(&eng.gpu)?;
            eng.clear_trace(Some(graph.trace_order.as_deref()))?;
            // a graph captured with the gate holds its kernel; else, with a gate set, queue it
            let held = match graph.gate {
                Some(_) => eng.gate_ticket()?,
                None => eng.gate_hold()?,
            };
            eng.round_event(true)?;
            graph
                .graph
                .launch()
                .map_err(KernelError::driver("launching the round's graph"))?;
            eng.round_event(false)?;
            eng.gate_open(held)?;
            let out = eng.finish_device_round(graph.arm, input, local, t0)?;
            eng.read_round_time(held)?;
            eng.read_trace()?;
            Ok(out)
        })
    }

    /// Runs one device round eagerly on the caller's device buffers, ordered on the caller's
    /// `stream` ([`BorrowedRound`]; the Python bindings: torch tensors on PyTorch's current
    /// stream). Attention ranks pass `Some`, FFN-only ranks `None`; `arm` as in
    /// [`FusedEngine::device_round`]. Collective.
    ///
    /// With `wait` false the round is only queued: its verdict is read by this engine's next
    /// on-stream round before it queues anything (which then returns the earlier round's error
    /// instead, on every rank alike, without queuing its own) or by
    /// [`FusedEngine::finish_queued`]; the host never waits for the round itself, and the
    /// output is ready once `stream` passes it (NaN if the verdict turns out a rejection).
    /// Another device round, replay or capture refuses to run while a round is queued.
    ///
    /// This rank's stream waits (on the device) for the work queued so far on `stream`, copies
    /// the rows, routes and weights device to device into the round's input buffers, runs the
    /// round, copies the combined rows device to device into `out` (the poisoned rows, NaN,
    /// when the round is rejected and poisoning is on), and `stream` waits (on the device) for
    /// all of it: nothing on the host waits for `stream`, and no row crosses the host. Then
    /// the host waits once for this rank's stream, to read the round's verdict and faults, so
    /// that a rejected route is [`ExchangeError::Route`] (as in [`FusedEngine::device_round`])
    /// and a late peer [`ExchangeError::DeviceTimeout`]. The rows are copied, not lent: the
    /// round's buffers are capacity-sized and a captured graph keeps their addresses.
    ///
    /// # Safety
    /// The pointers of `input` must be live device allocations of this rank's device, in the
    /// primary context (PyTorch's), holding `tokens` rows each ([`BorrowedRound`]); nobody may
    /// write the inputs, or read or write `out`, until `stream` passes the round, and `out`
    /// overlaps no input. `stream` must be a live stream of that context, or null (the legacy
    /// default stream), and must not be capturing a CUDA graph.
    pub unsafe fn device_round_on_stream(
        &mut self,
        arm: impl Into<RoundArm>,
        input: Option<&BorrowedRound>,
        stream: sys::CUstream,
        wait: bool,
    ) -> Result<(), ExchangeError> {
        let arm = arm.into();
        self.guarded(|eng| {
            // SAFETY: the caller's contract.
            unsafe { eng.on_stream(arm, None, input, stream, wait) }
        })
        .map(drop)
    }

    /// [`FusedEngine::replay`] on the caller's device buffers, ordered on the caller's
    /// `stream`: the graph's fixed input buffers are refilled device to device from `input`
    /// (new rows and routes every replay), the graph is launched on this rank's stream, the
    /// combined rows are copied into `input.out`, with the stream ordering and the one host
    /// wait for the verdict of [`FusedEngine::device_round_on_stream`] (or, with `wait` false,
    /// its deferred verdict). Collective. On-stream rounds take no start gate: a graph captured
    /// with one ([`FusedEngine::set_start_gate`]) is refused with [`ExchangeError::Input`].
    ///
    /// # Safety
    /// As [`FusedEngine::device_round_on_stream`].
    pub unsafe fn replay_on_stream(
        &mut self,
        graph: &FusedGraph,
        input: Option<&BorrowedRound>,
        stream: sys::CUstream,
        wait: bool,
    ) -> Result<(), ExchangeError> {
        self.check_graph(graph)?;
        if graph.gate.is_some() {
            // its gate kernel would wait for a ticket that no on-stream round opens
            return Err(ExchangeError::Input {
                rank: self.rank(),
                what: "the graph was captured with a start gate: replay it with \
                       FusedEngine::replay (an on-stream replay has no gate to open)"
                    .into(),
            });
        }
        self.guarded(|eng| {
            // SAFETY: the caller's contract.
            unsafe { eng.on_stream(graph.arm, Some(graph), input, stream, wait) }
        })
        .map(drop)
    }

    /// The body of [`FusedEngine::device_round_on_stream`] (`graph` `None`) and
    /// [`FusedEngine::replay_on_stream`].
    ///
    /// # Safety
    /// As [`FusedEngine::device_round_on_stream`].
    unsafe fn on_stream(
        &mut self,
        arm: RoundArm,
        graph: Option<&FusedGraph>,
        input: Option<&BorrowedRound>,
        stream: sys::CUstream,
        wait: bool,
    ) -> Result<RoundOutput, ExchangeError> {
        // the verdict of a round queued before, first
        self.read_queued()?;
        let t0 = Instant::now();
        bind(&self.gpu)?;
        let own = self.gpu.stream().cu_stream();
        // SAFETY: both are live streams of the bound context (the caller's contract).
        unsafe { order_streams(stream, own)? };
        let queued = (|| -> Result<Option<ExchangeError>, ExchangeError> {
            let local = self.load_input(arm, Feed::Device(input), true)?;
            self.clear_trace(graph.map(|g| g.trace_order.as_deref()))?;
            self.round_event(true)?;
            match graph {
                Some(g) => g
                    .graph
                    .launch()
                    .map_err(KernelError::driver("launching the round's graph"))?,
                None => self.launch_device_round(arm)?,
            }
            self.round_event(false)?;
            if let (Some(b), Some(s)) = (input, self.device.as_ref().and_then(|d| d.src.as_ref())) {
                use afdep_kernels::cudarc::driver::DevicePtr;
                let n = b.tokens.min(self.cfg.capacity) * self.cfg.hidden;
                let (src, _guard) = s.out.device_ptr(self.gpu.stream());
                let bytes = n * std::mem::size_of::<bf16>();
                // SAFETY: `out` holds `tokens` rows (the caller's contract); the source is the
                // round's output buffer of the capacity's rows (n elements at most).
                unsafe {
                    copy_bytes(
                        &self.gpu,
                        b.out,
                        src,
                        bytes,
                        "copying the combined rows out",
                    )?
                };
            }
            Ok(local)
        })();
        // the join, also after an error: whatever was queued is ordered before the caller's
        // later work
        // SAFETY: as above, the other way round.
        let joined = unsafe { order_streams(own, stream) };
        let local = queued?;
        joined?;
        if !wait {
            let d = self.device.as_mut().expect("checked by load_input");
            d.queued = Some(Queued { arm, local, t0 });
            return Ok(no_output());
        }
        let out = self.finish_device_round(arm, None, local, t0)?;
        self.read_round_time(None)?;
        self.read_trace()?;
        Ok(out)
    }

    /// Whether a round queued without waiting is not finished yet.
    pub(super) fn has_queued(&self) -> bool {
        self.device.as_ref().is_some_and(|d| d.queued.is_some())
    }

    /// Reads the verdict of the round queued by an on-stream round with `wait` false, if any
    /// (one host wait for this rank's stream): its error, as the round would have returned it
    /// with `wait` true. Not collective (every rank reads its own).
    pub fn finish_queued(&mut self) -> Result<(), ExchangeError> {
        self.guarded(|eng| eng.read_queued().map(|()| no_output()))
            .map(drop)
    }

    /// [`FusedEngine::finish_queued`]'s body.
    fn read_queued(&mut self) -> Result<(), ExchangeError> {
        let Some(q) = self.device.as_mut().and_then(|d| d.queued.take()) else {
            return Ok(());
        };
        self.finish_device_round(q.arm, None, q.local, q.t0)?;
        self.read_round_time(None)?;
        self.read_trace()?;
        Ok(())
    }

    /// Runs `f` unless the engine is closed; any error but a rejected route or a caller's input
    /// error (found before the launches, or returned after a completed round) closes it.
    pub(super) fn guarded<R>(
        &mut self,
        f: impl FnOnce(&mut Self) -> Result<R, ExchangeError>,
    ) -> Result<R, ExchangeError> {
        self.check_open()?;
        let r = f(self);
        if let Err(e) = &r {
            let keeps = matches!(
                e,
                ExchangeError::Route { .. }
                    | ExchangeError::ArmsDiffer { .. }
                    | ExchangeError::Input { .. }
            );
            if !keeps && self.closed.is_none() {
                self.closed = Some(e.to_string());
            }
        }
        r
    }

    /// `Input` unless device rounds are prepared ([`FusedEngine::prepare_device`]) and no round
    /// queued without waiting is unfinished.
    pub(super) fn check_device(&self, _arm: RoundArm) -> Result<(), ExchangeError> {
        self.check_ready(true)
    }

    /// `Input` unless this rank has device-round state (with `device_experts`: from
    /// [`FusedEngine::prepare_device`], not only [`FusedEngine::round`]'s) and no round queued
    /// without waiting is unfinished.
    fn check_ready(&self, device_experts: bool) -> Result<(), ExchangeError> {
        match &self.device {
            Some(d) if device_experts && d.host_only => Err(ExchangeError::Input {
                rank: self.rank(),
                what: "device rounds need FusedEngine::prepare_device first (FusedEngine::round \
                       prepared buffers for host experts only)"
                    .into(),
            }),
            None => Err(ExchangeError::Input {
                rank: self.rank(),
                what: "device rounds need FusedEngine::prepare_device first".into(),
            }),
            Some(d) if d.queued.is_some() => Err(ExchangeError::Input {
                rank: self.rank(),
                what: "a round queued without waiting is not finished: call \
                       FusedEngine::finish_queued first"
                    .into(),
            }),
            Some(_) => Ok(()),
        }
    }

    /// Copies a source's input into the device buffers and its token count and arm request
    /// (the fixed arm, or under [`RoundArm::Auto`] the arm of [`FusedEngine::set_arm`], else the
    /// rule) into the control block, and poisons the outputs. A source whose input does not fit
    /// its shape gets its error back after the round (`Some`), and its token count is set above
    /// the capacity, so that every rank rejects the round (over capacity) instead of waiting
    /// for it. `device_experts`: the round's FFN ranks run device experts (every round but
    /// [`FusedEngine::round`]'s), which needs [`FusedEngine::prepare_device`].
    fn load_input(
        &mut self,
        arm: RoundArm,
        input: Feed<'_>,
        device_experts: bool,
    ) -> Result<Option<ExchangeError>, ExchangeError> {
        self.check_ready(device_experts)?;
        let rank = self.rank();
        let (h, k, cap) = (self.cfg.hidden, self.cfg.top_k, self.cfg.capacity);
        let is_src = self.cfg.topology.attention_index(rank).is_some();
        let (tokens, local) = match input {
            Feed::Device(Some(b)) if is_src => {
                // rows beyond the capacity are not copied (the round is rejected anyway)
                let n = b.tokens.min(cap);
                let d = self.device.as_mut().expect("checked");
                let s = d.src.as_mut().expect("a source has source buffers");
                // SAFETY: the caller's contract (`device_round_on_stream`): the three buffers
                // hold `b.tokens` rows of their element type and are not written until the
                // stream passes the round; the destinations are capacity-sized.
                unsafe {
                    copy_dtod(&self.gpu, &mut s.x, b.x, n * h)?;
                    copy_dtod(&self.gpu, &mut s.idx, b.idx, n * k)?;
                    copy_dtod(&self.gpu, &mut s.w, b.weights, n * k)?;
                }
                (u32::try_from(b.tokens).unwrap_or(u32::MAX), None)
            }
            Feed::Device(Some(_)) => {
                let e = ExchangeError::Input {
                    rank,
                    what: "an FFN-only rank was given input".into(),
                };
                (0, Some(e))
            }
            Feed::Device(None) => {
                let (t, _, l) = self.input_tokens(None);
                (t, l)
            }
            Feed::Host(inp) => {
                let (t, n, l) = self.input_tokens(inp);
                if n > 0 {
                    let inp = inp.expect("rows to copy come from an input");
                    let d = self.device.as_mut().expect("checked");
                    let s = d.src.as_mut().expect("a source has source buffers");
                    let stream = self.gpu.stream();
                    stream
                        .memcpy_htod(&inp.x[..n * h], &mut s.x)
                        .map_err(KernelError::driver("copying the rows"))?;
                    stream
                        .memcpy_htod(&inp.routes.idx[..n * k], &mut s.idx)
                        .map_err(KernelError::driver("copying the routes"))?;
                    stream
                        .memcpy_htod(&inp.routes.weights[..n * k], &mut s.w)
                        .map_err(KernelError::driver("copying the weights"))?;
                }
                (t, l)
            }
        };
        let request = self.arm_request(arm);
        // the token count and the request are adjacent words (CTL_ARM_REQUEST = CTL_TOKENS + 1),
        // each written by a memset of its value (no host buffer: nothing to wait for)
        bind(&self.gpu)?;
        let stream = self.gpu.stream().cu_stream();
        for (i, word) in [tokens, request].into_iter().enumerate() {
            let at = self.ws + CONTROL + 4 * (CTL_TOKENS + i) as u64;
            // SAFETY: the control block's token and request words lie in this rank's workspace
            // (the geometry fits it, checked at set-up); the memset is ordered on the stream.
            unsafe { sys::cuMemsetD32Async(at, word, 1, stream) }
                .result()
                .map_err(KernelError::driver("writing the token count"))?;
        }
        self.poison_round(arm)?;
        // a host feed's pageable copies complete here; a device feed is only queued (round
        // timing's barrier, which follows, needs no wait: the events are on the stream)
        if matches!(input, Feed::Host(_)) {
            self.gpu.synchronize()?;
        }
        Ok(local)
    }

    /// The control block's token count of a round with `input` on this rank, the number of
    /// rows (and their routes) to copy to the device, and the caller's error to return after
    /// the round: a source whose input does not fit its shape (or that has none) gets its
    /// error back and a token count above the capacity, so that every rank rejects the round
    /// (over capacity) instead of waiting for it; an FFN-only rank given input gets its error
    /// and takes part with no tokens. Rows beyond the capacity are not copied (the round is
    /// rejected anyway).
    pub(super) fn input_tokens(
        &self,
        input: Option<&SourceInput>,
    ) -> (u32, usize, Option<ExchangeError>) {
        let rank = self.rank();
        let cfg = &self.cfg;
        let (h, k, cap) = (cfg.hidden, cfg.top_k, cfg.capacity);
        let is_src = cfg.topology.attention_index(rank).is_some();
        match (is_src, input) {
            (true, Some(inp)) => {
                let t = inp.routes.tokens;
                let shaped = inp.routes.top_k == k
                    && inp.routes.idx.len() == t * k
                    && inp.routes.weights.len() == t * k
                    && inp.x.len() == t * h;
                if shaped {
                    (u32::try_from(t).unwrap_or(u32::MAX), t.min(cap), None)
                } else {
                    let e = ExchangeError::Input {
                        rank,
                        what: format!(
                            "input of {t} tokens: {} rows values, {} ids, {} weights, top-k {} \
                             (hidden {h}, top-k {k})",
                            inp.x.len(),
                            inp.routes.idx.len(),
                            inp.routes.weights.len(),
                            inp.routes.top_k
                        ),
                    };
                    (u32::MAX, 0, Some(e))
                }
            }
            (true, None) => {
                let e = ExchangeError::Input {
                    rank,
                    what: "an attention rank was given no input".into(),
                };
                (u32::MAX, 0, Some(e))
            }
            (false, Some(_)) => {
                let e = ExchangeError::Input {
                    rank,
                    what: "an FFN-only rank was given input".into(),
                };
                (0, 0, Some(e))
            }
            (false, None) => (0, 0, None),
        }
    }

    /// The control block's arm request of a round of `arm`: the fixed arm, or under
    /// [`RoundArm::Auto`] the arm of [`FusedEngine::set_arm`], else "auto".
    pub(super) fn arm_request(&self, arm: RoundArm) -> u32 {
        match arm {
            RoundArm::Fixed(a) => arm_code(a),
            RoundArm::Auto => self.arm.map_or(fr::arm::AUTO, arm_code),
        }
    }

    /// With poisoning on ([`FusedEngine::set_poison`]), queues on this rank's stream the
    /// poisoning of a device round's outputs: the source's output, the FFN rank's expert
    /// outputs, snapshot and whole expanded area (fp8: and its codes and scales), and, in a
    /// round that may take the source arm, the sources' slab rows (metadata only in that arm).
    /// Every store into them follows this rank's status record of the round
    /// (`afdep_round_begin`, later on this stream), so the poisoning races with nothing.
    pub(super) fn poison_round(&mut self, arm: RoundArm) -> Result<(), ExchangeError> {
        if !self.poison {
            return Ok(());
        }
        let rank = self.rank();
        let cfg = &self.cfg;
        let d = self.device.as_mut().expect("checked by the caller");
        if let Some(s) = d.src.as_mut() {
            poison(&self.gpu, &mut s.out)?;
        }
        if let Some(f) = d.ffn.as_mut() {
            poison(&self.gpu, &mut f.y)?;
            if let Some(snap) = f.snapshot.as_mut() {
                poison(&self.gpu, snap)?;
            }
        }
        if cfg.topology.ffn_index(rank).is_some() {
            self.poison_expanded(self.geo.exp_rows)?;
            if matches!(
                arm,
                RoundArm::Fixed(DispatchArm::CountFirstSource) | RoundArm::Auto
            ) {
                let slab = self.geo.slab();
                let first = cfg.topology.attention_ranks().start as u64;
                let n = cfg.topology.attention_count() as u64;
                let off = slab.slab_off + first * u64::from(slab.cap) * slab.row_bytes;
                self.poison_ws(off, n * u64::from(slab.cap) * slab.row_bytes)?;
            }
        }
        Ok(())
    }

    /// The launches of one device round on this rank's stream ([module docs](self)): no host
    /// value that changes from round to round, no allocation, no synchronisation. A kernel
    /// that belongs to some arms only is launched when the round may take one of them, with the
    /// control block when the round takes no other arm, else with the gate of its arms among
    /// the round's ([`arm_gate`]).
    pub(super) fn launch_device_round(&mut self, arm: RoundArm) -> Result<(), ExchangeError> {
        self.launch_round(arm, Part::Whole)
    }

    /// The launches of `part` of one device round ([`FusedEngine::launch_device_round`]): the
    /// whole round, or its two halves on either side of the host experts of
    /// [`FusedEngine::round`] ([`Part`]).
    pub(super) fn launch_round(&mut self, arm: RoundArm, part: Part) -> Result<(), ExchangeError> {
        let (front, back, host_y) = match part {
            Part::Whole => (true, true, None),
            Part::Front => (true, false, None),
            Part::Back(y) => (false, true, y),
        };
        let rank = self.rank();
        let cfg = &self.cfg;
        let topo = cfg.topology;
        let p = cfg.placement();
        let (k, cap) = (cfg.top_k, cfg.capacity);
        let (nf, ns, epr) = (p.ffn_ranks, topo.attention_count(), p.experts_per_rank);
        let world = topo.world_size();
        let knobs = cfg.knobs;
        let timeout_ns = self.transport.timeout().as_nanos().min(u64::MAX as u128) as u64;
        let addrs = self.rank_addrs(timeout_ns);
        let ctl = addrs.ctl;
        let a = self.geo;
        let fronts = self.fronts;
        let src_index = topo.attention_index(rank);
        let ffn_index = topo.ffn_index(rank);
        let d = self.device.as_mut().expect("checked by the caller");
        let gpu = &self.gpu;
        let rules = DeviceRules {
            experts: cfg.experts as u64,
            owned: p.owned() as u64,
            bucket: rule_bucket(cfg),
        };
        let round_arms = match arm {
            RoundArm::Fixed(a) => arm_bit(a),
            RoundArm::Auto => ALL_ARMS,
        };
        let gates = {
            use afdep_kernels::cudarc::driver::DevicePtr;
            d.gates.device_ptr(gpu.stream()).0
        };
        // the control block of a kernel of the arms `arms` (None: not launched in this round)
        let gate = |arms: u32| arm_gate(ctl, gates, round_arms, arms);

        // with tracing on: a stamp before the first launch and after each phase
        if let Some(t) = d.trace.as_mut().filter(|t| t.on && front) {
            t.start(gpu)?;
        }
        // 0. source, fp8: the payload check (its word is the verdict word of valid routes)
        if let (true, Some(s), Some(b)) = (front, src_index, d.src.as_mut()) {
            if let Some(st) = b.payload.as_mut() {
                // SAFETY: the engine's launch invariant (`FusedEngine`): `ctl` is this workspace's
                // live control block.
                let rows = PayloadRows {
                    x: &b.x,
                    idx: &b.idx,
                    source: s,
                };
                unsafe { fr::check_payload(gpu, &rows, ctl, &a, st, knobs.transport_sms) }?;
                trace::mark(&mut d.trace, gpu, TracePhase::PayloadCheck)?;
            }
        }
        // 1.-5. the round's start, counts, plan, rows and epilogue: one front kernel per rank
        // (a rank that is a source or an FFN rank, not both; untraced), else a launch per phase
        let traced = d.trace.as_ref().is_some_and(|t| t.on);
        let use_fronts = fronts && !traced && (src_index.is_none() || ffn_index.is_none());
        let scratch = self.cf_scratch.as_ref();
        let cf_src = match (d.src.as_ref(), scratch) {
            (Some(b), Some(sc)) => Some(CfSource {
                tokens: cap,
                x: &b.x,
                idx: &b.idx,
                weight: &b.w,
                slot_pos: &sc.slot_pos,
                tok_row: &sc.tok_row,
                counts: &sc.counts,
            }),
            _ => None,
        };
        let l = Launch {
            gpu,
            cfg,
            r: addrs,
            a,
            src_ranks: &self.src_ranks,
            ffn_ranks: &self.ffn_ranks,
            round_arms,
            gates,
            one_launch: arm == RoundArm::Auto,
            planned: arm == RoundArm::Auto && src_index.is_none(),
            combine_prewait: self.combine_prewait,
        };
        let source = match (src_index, d.src.as_ref()) {
            (Some(s), Some(b)) => Some(RoundSource {
                index: s,
                idx: &b.idx,
                weight: &b.w,
                payload: b.payload.as_ref(),
            }),
            _ => None,
        };
        if !front {
            // the round's start to its rows and epilogue were launched before (`Part::Front`)
        } else if use_fronts {
            let start = FrontStart {
                r: &addrs,
                world,
                rules: &rules,
                gates: &mut d.gates,
                layout: &a,
            };
            l.front(
                start,
                arm,
                source.as_ref(),
                cf_src.as_ref(),
                ffn_index.is_some(),
            )?;
        } else {
            // 1. round, validation, verdict (every rank)
            // SAFETY: the engine's launch invariant (`FusedEngine`): `addrs` names this live
            // workspace, its control block (`CONTROL`) and error word, and the live peer table of
            // `world` ranks whose workspaces all have the layout `a` (the status area at `a.status`).
            unsafe {
                fr::begin(
                    gpu,
                    &addrs,
                    world,
                    source.as_ref(),
                    &rules,
                    &a,
                    &mut d.gates,
                )
            }?;
            trace::mark(&mut d.trace, gpu, TracePhase::Begin)?;

            // 2. source: counts on the device, published
            if let Some(src) = &cf_src {
                let ffns = FfnRanks {
                    ranks: &self.ffn_ranks,
                    count: nf,
                    experts_per_rank: epr,
                };
                // SAFETY: the engine's launch invariant (`FusedEngine`): `addrs.ctl` is the live
                // control block, whose token count `afdep_round_begin` keeps at most the capacity
                // `src` holds, `addrs.peers` the live peer table; `ffns` holds the `nf` FFN ranks;
                // every workspace holds the count-first areas `a`.
                unsafe { cf::counts(gpu, src, &ffns, &addrs, k, &a, knobs.transport_sms) }?;
                trace::mark(&mut d.trace, gpu, TracePhase::Counts)?;
            }
            // 3. FFN (count-first): plan and offsets before the rows. An Auto round on a rank that
            // is not also a source: one plan launch for every arm, which in a payload-first round
            // first waits for the rows' dispatch flags (a rank that is also a source raises its own
            // dispatch flags only at step 4, so there the payload-first plan stays after it)
            let one_launch = arm == RoundArm::Auto && src_index.is_none();
            let plan_here = if one_launch {
                let wait = cf::PlanWait::DispatchIfPayloadFirst {
                    code: fk::fault::DISPATCH_WAIT,
                };
                ffn_index.map(|_| (ctl, wait))
            } else {
                ffn_index
                    .and(gate(CF | SRC))
                    .map(|c| (c, cf::PlanWait::None))
            };
            if let Some((c, wait)) = plan_here {
                // SAFETY: the engine's launch invariant (`FusedEngine`): `ws`, `peers` and `err` are
                // live, `c` is the control block or one of the live arm gates of `d.gates`
                // (`arm_gate`; the control block itself for `DispatchIfPayloadFirst`); every
                // workspace holds the areas `a`; `src_ranks` holds the `ns` attention ranks.
                unsafe { cf::plan(gpu, &addrs.gated(c), &self.src_ranks, ns, epr, &a, wait) }?;
                trace::mark(&mut d.trace, gpu, TracePhase::Plan)?;
            }
            // 4. source: the rows (one launch per arm the round may take), then the dispatch flags
            if let Some(src) = &cf_src {
                l.dispatch_rows(src)?;
                trace::mark(&mut d.trace, gpu, TracePhase::Rows)?;
            }
            // 5. FFN: the epilogue
            if ffn_index.is_some() {
                l.epilogue()?;
                trace::mark(&mut d.trace, gpu, TracePhase::Epilogue)?;
            }
        }
        // 6. FFN: snapshot, experts, the combine's partial sums, combine flags
        if let (true, Some(f), Some(fb)) = (back, ffn_index, d.ffn.as_mut()) {
            l.ffn_combine(f, fb, host_y)?;
            trace::mark(&mut d.trace, gpu, TracePhase::Experts)?;
        }
        // 7. source: the combine
        if let (true, Some(b)) = (back, d.src.as_mut()) {
            l.source_combine(b)?;
            trace::mark(&mut d.trace, gpu, TracePhase::Combine)?;
        }
        Ok(())
    }

    /// FFN rank `f`'s SwiGLU buffers ([`swiglu_bufs`]).
    fn swiglu_bufs(
        &self,
        lp: &afdep_core::oracle::LayerParams,
        f: usize,
    ) -> Result<SwigluBufs, ExchangeError> {
        swiglu_bufs(&self.gpu, &self.cfg, lp, f, self.geo.exp_rows as usize)
    }

    /// After a device round's launches: waits, checks faults and the verdict, reads the results.
    fn finish_device_round(
        &mut self,
        arm: RoundArm,
        input: Option<&SourceInput>,
        local: Option<ExchangeError>,
        t0: Instant,
    ) -> Result<RoundOutput, ExchangeError> {
        self.finish_round(arm, input, local, t0, None)
    }

    /// [`FusedEngine::finish_device_round`]; an FFN rank's `received` when the host read it
    /// during the round ([`FusedEngine::round`]), else the snapshot's (with
    /// [`DeviceRoundOptions::keep_received`]).
    fn finish_round(
        &mut self,
        arm: RoundArm,
        input: Option<&SourceInput>,
        local: Option<ExchangeError>,
        t0: Instant,
        host_received: Option<afdep_core::oracle::exchange::FfnReceived>,
    ) -> Result<RoundOutput, ExchangeError> {
        let rank = self.rank();
        self.round += 1;
        if let RoundArm::Fixed(a) = arm {
            self.last_arm = a;
        }
        self.check_fault()?;
        // the GEMM's bounded TMA waits record their faults in the context's fault word
        self.gpu.take_fault()?;
        let ctl: Vec<u32> = bytemuck::pod_collect_to_vec(&self.read_ws(CONTROL, 4 * CTL_WORDS)?);
        // the arm the device took (every rank the same, also in a rejected round)
        let taken = taken_arm(rank, &ctl)?;
        self.last_arm = taken;
        if let Some(e) = local {
            return Err(e);
        }
        verdict(rank, &ctl)?;
        let cfg = self.cfg.clone();
        let d = self.device.as_ref().expect("checked");
        let combined = match (d.src.as_ref(), input) {
            (Some(b), Some(inp)) => {
                let n = inp.routes.tokens * cfg.hidden;
                let mut all: Vec<bf16> = download(&self.gpu, &b.out)?;
                all.truncate(n);
                Some(all)
            }
            _ => None,
        };
        let received = match (
            cfg.topology.ffn_index(rank),
            d.keep_received,
            d.ffn.as_ref(),
        ) {
            _ if host_received.is_some() => host_received,
            (Some(f), true, Some(fb)) => {
                let snap: Vec<u8> = match &fb.snapshot {
                    Some(s) => download(&self.gpu, s)?,
                    None => Vec::new(),
                };
                let slab = self.geo.slab();
                let first = cfg.topology.attention_ranks().start;
                let rb = slab.row_bytes as usize;
                let read_slab = |r: usize, n: usize| -> Result<Vec<u8>, ExchangeError> {
                    let at = (r - first) * slab.cap as usize * rb;
                    Ok(snap[at..at + n * rb].to_vec())
                };
                Some(self.read_received(f, taken, &read_slab)?)
            }
            _ => None,
        };
        let times = PhaseTimes {
            dispatch: t0.elapsed(),
            ..PhaseTimes::default()
        };
        Ok(RoundOutput {
            combined,
            received,
            times,
        })
    }
}

/// The mode of a source's row stores in a round of `arm` (`payload_gate`: the count-first
/// arm's wait for the offsets): the source and payload-first arms' dispatch flags are raised
/// by the kernel's last block, the streaming arm's rows carry flags of their own; an Auto round
/// branches on the device.
fn rows_mode(arm: RoundArm, payload_gate: bool) -> CfMode {
    match arm {
        RoundArm::Auto => CfMode::Auto { gate: payload_gate },
        RoundArm::Fixed(DispatchArm::CountFirstSource) => CfMode::Source,
        RoundArm::Fixed(DispatchArm::CountFirst) => CfMode::Stream {
            gate: payload_gate,
            signal: false,
        },
        RoundArm::Fixed(DispatchArm::PayloadFirst) => CfMode::Stream {
            gate: false,
            signal: true,
        },
    }
}

/// The default of [`FusedEngine::set_fronts`]: off unless `AFDEP_FUSED_FRONTS` is `1` or `on`.
pub(super) fn fronts_from_env() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| {
        switch_from_env(
            "AFDEP_FUSED_FRONTS",
            "device rounds launch one front kernel per rank",
        )
    })
}

/// The default of [`FusedEngine::set_programmatic_graphs`]: off unless `AFDEP_GRAPH_PDL` is
/// `1` or `on`.
pub(super) fn programmatic_from_env() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| {
        switch_from_env(
            "AFDEP_GRAPH_PDL",
            "captured rounds' kernel-to-kernel edges are programmatic",
        )
    })
}

/// An on/off environment switch: `1`/`on` is on (said in the log), `0`/`off` or unset off, and
/// anything else off with a warning.
fn switch_from_env(name: &str, what: &str) -> bool {
    match std::env::var(name).as_deref() {
        Ok("1") | Ok("on") => {
            tracing::info!("{name}: {what}");
            true
        }
        Ok("0") | Ok("off") | Err(_) => false,
        Ok(other) => {
            tracing::warn!(value = other, "{name} is not 1/on or 0/off; off");
            false
        }
    }
}

/// The arm a device round took, from its control block `ctl` after the round (every rank the
/// same, also in a rejected round); a code that names no arm without a recorded fault is an
/// [`ExchangeError::Input`].
pub(super) fn taken_arm(rank: usize, ctl: &[u32]) -> Result<DispatchArm, ExchangeError> {
    arm_of_code(ctl[CTL_ARM]).ok_or_else(|| ExchangeError::Input {
        rank,
        what: format!(
            "device round arm code {} without a recorded fault",
            ctl[CTL_ARM]
        ),
    })
}

/// The verdict of a device round from its control block `ctl` after the round: go, or the
/// error every rank returns ([`ExchangeError::Route`] with the lowest rejecting rank's error,
/// [`ExchangeError::ArmsDiffer`]).
pub(super) fn verdict(rank: usize, ctl: &[u32]) -> Result<(), ExchangeError> {
    match ctl[CTL_VERDICT] {
        fr::verdict::GO => Ok(()),
        fr::verdict::ARMS_DIFFER => Err(ExchangeError::ArmsDiffer {
            rank,
            first: request_of_code(ctl[CTL_ROUTE + 1]),
            peer: ctl[CTL_ROUTE] as usize,
            other: request_of_code(ctl[CTL_ROUTE + 2]),
        }),
        fr::verdict::REJECTED => {
            let word: [u32; afdep_core::error::ROUTE_ERROR_WORDS] = ctl
                [CTL_ROUTE..CTL_ROUTE + afdep_core::error::ROUTE_ERROR_WORDS]
                .try_into()
                .expect("sized");
            let error = RouteError::from_word(word).unwrap_or(RouteError::Malformed {
                rank: word[1] as usize,
                what: format!("unknown error class {}", word[0]),
            });
            Err(ExchangeError::Route {
                reporter: rank,
                error,
            })
        }
        v => Err(ExchangeError::Input {
            rank,
            what: format!("device round verdict {v} without a recorded fault"),
        }),
    }
}

/// Which launches of a device round [`FusedEngine::launch_round`] queues.
#[derive(Debug, Clone, Copy)]
pub(super) enum Part {
    /// The whole round, with the device experts ([`FusedEngine::launch_device_round`]).
    Whole,
    /// Steps 1 and 2 of the [module docs](self) (steps 0 to 5 of `launch_round`'s comments):
    /// the payload check, the start (validation, verdict, arm), counts, plan, rows and epilogue
    /// (one front kernel per single-role rank when [`FusedEngine::set_fronts`] turned them on,
    /// else a launch per phase); on an FFN rank the expanded rows are complete once they have
    /// run.
    Front,
    /// Steps 3 and 4 of the [module docs](self) (6 and 7 of `launch_round`'s comments): the FFN
    /// rank's expert outputs and partial sums, the source's combine.
    /// `Some`: the expert outputs were computed on the host ([`HostY`]): no snapshot and no
    /// expert kernel, the partial sums read them; `None`: the device experts.
    Back(Option<HostY>),
}

/// Expert outputs computed on the host and uploaded for one round ([`FusedEngine::round`]):
/// `rows` × hidden bf16 at device address `y`, in expanded order (the device plan's rows).
#[derive(Debug, Clone, Copy)]
pub(super) struct HostY {
    pub(super) y: u64,
    pub(super) rows: usize,
}

/// What the launches of one device round share ([`FusedEngine::launch_device_round`]): the
/// rank's stream, workspace, peers, control block, areas and the round's arm gates.
struct Launch<'a> {
    gpu: &'a GpuContext,
    cfg: &'a ExchangeConfig,
    /// The rank's addresses, with its control block (`r.ctl`).
    r: RankAddrs,
    /// The workspace layout.
    a: FusedLayout,
    src_ranks: &'a CudaSlice<u32>,
    ffn_ranks: &'a CudaSlice<u32>,
    round_arms: u32,
    gates: u64,
    /// An Auto round: one launch per phase for every arm where the kernels branch on the arm
    /// the round takes (the source's rows, the FFN rank's partial sums), instead of one launch
    /// per arm behind its gate.
    one_launch: bool,
    /// The FFN rank's plan ran for every arm at step 3 (an Auto round on an FFN-only rank):
    /// the epilogue is one launch too.
    planned: bool,
    /// A source's combine waits in a kernel of one block first
    /// ([`FusedEngine::set_combine_prewait`]).
    combine_prewait: bool,
}

impl Launch<'_> {
    /// The control block of a kernel of the arms `arms` (`None`: not launched in this round).
    fn gate(&self, arms: u32) -> Option<u64> {
        arm_gate(self.r.ctl, self.gates, self.round_arms, arms)
    }

    /// Source: the rows (one launch per arm the round may take; the payload-first and source
    /// arms' kernels then raise the dispatch flags).
    fn dispatch_rows(&self, src: &CfSource<'_>) -> Result<(), ExchangeError> {
        let (gpu, cfg, knobs) = (self.gpu, self.cfg, self.cfg.knobs);
        let p = cfg.placement();
        let nf = p.ffn_ranks;
        let ffns = FfnRanks {
            ranks: self.ffn_ranks,
            count: nf,
            experts_per_rank: p.experts_per_rank,
        };
        if self.one_launch {
            let mode = rows_mode(RoundArm::Auto, knobs.payload_gate);
            // SAFETY: as below, with the control block itself (`self.r.ctl`), whose arm word
            // `afdep_round_begin` wrote earlier on this stream.
            unsafe { cf::dispatch(gpu, src, &ffns, &self.r, &self.a, mode, knobs.transport_sms) }?;
            return Ok(());
        }
        for row_arm in DispatchArm::ALL {
            let Some(c) = self.gate(arm_bit(row_arm)) else {
                continue;
            };
            let mode = rows_mode(RoundArm::Fixed(row_arm), knobs.payload_gate);
            let r = self.r.gated(c);
            // SAFETY: the engine's launch invariant (`FusedEngine`): `r`'s workspace, peer table
            // and error word are live, `c` is the control block or one of the live arm gates of
            // `d.gates` (`arm_gate`); every workspace holds the slabs and the areas `a` (256-byte
            // aligned) and `MAX_WORLD` flags at `DISPATCH_FLAGS`; `ffns` holds the `nf` FFN
            // ranks; `src` holds what `cf::counts` wrote earlier on this stream.
            unsafe { cf::dispatch(gpu, src, &ffns, &r, &self.a, mode, knobs.transport_sms) }?;
        }
        Ok(())
    }

    /// The round's start to its rows as one front kernel ([`FusedEngine::set_fronts`]): a
    /// source's (`source` and `src`: begin, counts, rows in the mode of `arm`) or an FFN
    /// rank's (`ffn`: begin, plan with the payload-first wait, epilogue; then the source arm's
    /// fp8 dequantisation behind its gate).
    fn front(
        &self,
        start: FrontStart<'_>,
        arm: RoundArm,
        source: Option<&RoundSource<'_>>,
        src: Option<&CfSource<'_>>,
        ffn: bool,
    ) -> Result<(), ExchangeError> {
        use DispatchArm as A;
        let (gpu, cfg, knobs) = (self.gpu, self.cfg, self.cfg.knobs);
        let p = cfg.placement();
        let (ns, epr) = (cfg.topology.attention_count(), p.experts_per_rank);
        if let (Some(source), Some(src)) = (source, src) {
            let ffns = FfnRanks {
                ranks: self.ffn_ranks,
                count: p.ffn_ranks,
                experts_per_rank: epr,
            };
            let mode = rows_mode(arm, knobs.payload_gate);
            // SAFETY: the engine's launch invariant (`FusedEngine`): `start.r` names this live
            // workspace (layout `a`), its control block itself and error word, and the live peer
            // table of the world, whose workspaces all have the layout `a`; `source` and `src`
            // are this source's capacity-sized buffers (the control block's token count at
            // most the capacity); `ffns` holds the FFN ranks.
            unsafe { ff::source_front(gpu, start, source, src, &ffns, mode, knobs.transport_sms) }?;
        } else if ffn {
            let srcs = cf::SourceRanks {
                ranks: self.src_ranks,
                count: ns,
                experts_per_rank: epr,
            };
            let dispatch_wait = fk::fault::DISPATCH_WAIT;
            let (pre, source_wait) = match arm {
                RoundArm::Auto => (
                    cf::PlanWait::DispatchIfPayloadFirst {
                        code: dispatch_wait,
                    },
                    Some(cf::fault::SOURCE_WAIT),
                ),
                RoundArm::Fixed(A::PayloadFirst) => (
                    cf::PlanWait::Dispatch {
                        code: dispatch_wait,
                    },
                    None,
                ),
                RoundArm::Fixed(A::CountFirst) => (cf::PlanWait::None, None),
                RoundArm::Fixed(A::CountFirstSource) => {
                    (cf::PlanWait::None, Some(cf::fault::SOURCE_WAIT))
                }
            };
            // SAFETY: as above for this FFN rank; every workspace holds `MAX_WORLD` flags at
            // `DISPATCH_FLAGS`; `srcs` holds the attention ranks.
            unsafe {
                ff::ffn_front(
                    gpu,
                    start,
                    &srcs,
                    pre,
                    &super::work_units(&knobs),
                    source_wait,
                )
            }?;
            self.source_arm_dequant()?;
        }
        Ok(())
    }

    /// FFN, fp8 payloads: the source arm's dequantisation behind its gate (after the wait for
    /// the dispatch flags, earlier on this stream); nothing for bf16 or a round without it.
    fn source_arm_dequant(&self) -> Result<(), ExchangeError> {
        let (cfg, knobs) = (self.cfg, self.cfg.knobs);
        if let (Some(c), PayloadKind::Fp8E4m3) = (self.gate(SRC), cfg.payload) {
            let (ns, epr) = (
                cfg.topology.attention_count(),
                cfg.placement().experts_per_rank,
            );
            // SAFETY: the engine's launch invariant (`FusedEngine`): `ws` is live, `c` is the
            // control block or one of the live arm gates of `d.gates` (`arm_gate`); the
            // workspace holds the fp8 areas `a`, whose plan this rank's `cf::plan` wrote earlier
            // on this stream.
            unsafe {
                cf::dequant(
                    self.gpu,
                    &self.r.gated(c),
                    ns,
                    epr,
                    &self.a,
                    knobs.epilogue_sm_cap,
                )
            }?;
        }
        Ok(())
    }

    /// FFN: the wait for every source's dispatch flag in a round of the control block `c`, a
    /// timeout recorded as `code`.
    fn wait_sources(&self, c: u64, code: u32) -> Result<(), ExchangeError> {
        let ns = self.cfg.topology.attention_count();
        // SAFETY: the engine's launch invariant (`FusedEngine`): the workspace and its error word
        // are live, `c` is the control block or one of the live arm gates of `d.gates`
        // (`arm_gate`); `src_ranks` holds the `ns` attention ranks, the workspace `MAX_WORLD`
        // flags at `DISPATCH_FLAGS`.
        unsafe {
            cf::wait(
                self.gpu,
                &self.r.gated(c),
                self.src_ranks,
                ns,
                DISPATCH_FLAGS,
                code,
            )
        }?;
        Ok(())
    }

    /// FFN: the epilogue (payload-first: every source's flag, then the plan; the source arm:
    /// every source's flag; streaming and payload-first: the epilogue).
    fn epilogue(&self) -> Result<(), ExchangeError> {
        let (gpu, cfg, knobs) = (self.gpu, self.cfg, self.cfg.knobs);
        let p = cfg.placement();
        let (ns, epr) = (cfg.topology.attention_count(), p.experts_per_rank);
        let (a, addrs) = (&self.a, self.r);
        if self.planned {
            // an Auto round whose plan ran at step 3 for every arm: one epilogue launch (the
            // source arm's wait for the dispatch flags, or the rows), then the source arm's fp8
            // dequantisation behind its gate
            // SAFETY: as below, with the control block itself (`addrs.ctl`), whose arm word
            // `afdep_round_begin` wrote earlier on this stream; every workspace holds
            // `MAX_WORLD` flags at `DISPATCH_FLAGS`.
            unsafe {
                cf::stream_epilogue(
                    gpu,
                    &addrs,
                    &cf::SourceRanks {
                        ranks: self.src_ranks,
                        count: ns,
                        experts_per_rank: epr,
                    },
                    a,
                    &super::work_units(&knobs),
                    Some(cf::fault::SOURCE_WAIT),
                )
            }?;
            self.source_arm_dequant()?;
            return Ok(());
        }
        if let Some(c) = self.gate(PF) {
            // the wait for the dispatch flags is the plan's first step
            let wait = cf::PlanWait::Dispatch {
                code: fk::fault::DISPATCH_WAIT,
            };
            // SAFETY: the engine's launch invariant (`FusedEngine`): `ws`, `peers` and `err` are
            // live, `c` is the control block or one of the live arm gates of `d.gates`
            // (`arm_gate`); every workspace holds the areas `a` and `MAX_WORLD` flags at
            // `DISPATCH_FLAGS`; `src_ranks` holds the `ns` attention ranks.
            unsafe { cf::plan(gpu, &addrs.gated(c), self.src_ranks, ns, epr, a, wait) }?;
        }
        if let Some(c) = self.gate(SRC) {
            self.wait_sources(c, cf::fault::SOURCE_WAIT)?;
            self.source_arm_dequant()?;
        }
        if let Some(c) = self.gate(PF | CF) {
            // SAFETY: the engine's launch invariant (`FusedEngine`): `ws` and `err` are live, `c`
            // is the control block or one of the live arm gates of `d.gates` (`arm_gate`); the
            // workspace holds the slabs and the areas `a`, whose plan this rank's `cf::plan` wrote
            // earlier on this stream; `src_ranks` holds the `ns` attention ranks.
            unsafe {
                cf::stream_epilogue(
                    gpu,
                    &addrs.gated(c),
                    &cf::SourceRanks {
                        ranks: self.src_ranks,
                        count: ns,
                        experts_per_rank: epr,
                    },
                    a,
                    &super::work_units(&knobs),
                    None,
                )
            }?;
        }
        Ok(())
    }

    /// FFN rank `f`: the snapshot of the compact view, the experts, the combine's partial sums
    /// (one launch per kind of compact view, each gated to its arms) and the combine flags (the
    /// last block of the one that runs). With `host_y` the experts ran on the host: no snapshot
    /// (the host read the compact view from the slabs before), no expert kernel, and the
    /// partial sums read `host_y`.
    fn ffn_combine(
        &self,
        f: usize,
        fb: &mut FfnBufs,
        host_y: Option<HostY>,
    ) -> Result<(), ExchangeError> {
        let (gpu, cfg, knobs) = (self.gpu, self.cfg, self.cfg.knobs);
        let p = cfg.placement();
        let cap = cfg.capacity;
        let (ns, epr) = (cfg.topology.attention_count(), p.experts_per_rank);
        let (ws, slab, a) = (self.r.ws, self.a.slab(), &self.a);
        if let (None, Some(snap)) = (host_y, fb.snapshot.as_mut()) {
            let first = cfg.topology.attention_ranks().start as u64;
            let off = slab.slab_off + first * u64::from(slab.cap) * slab.row_bytes;
            let bytes = ns * slab.cap as usize * slab.row_bytes as usize;
            if bytes > 0 {
                let (dst, _rec) =
                    afdep_kernels::cudarc::driver::DevicePtrMut::device_ptr_mut(snap, gpu.stream());
                // SAFETY: [ws + off, + bytes) is the sources' slabs in this rank's workspace
                // (the geometry fits it, checked at set-up) and the snapshot holds `bytes`
                // (allocated for them); the copy is ordered on this rank's stream.
                unsafe { cures::memcpy_dtod_async(dst, ws + off, bytes, gpu.stream().cu_stream()) }
                    .map_err(KernelError::driver("copying the slabs"))?;
            }
        }
        let pv = PlanView {
            ws,
            layout: *a,
            epr,
            sources: ns,
        };
        match (host_y, fb.identity, fb.swiglu.as_mut()) {
            (Some(_), _, _) | (None, true, _) => {}
            (None, false, None) => {
                // SAFETY: the engine's launch invariant (`FusedEngine`): `pv.ws` and `self.r.ctl`
                // are live; `pv` names the plan and expanded area of `geometry`'s count-first
                // areas, the plan written earlier on this stream.
                unsafe {
                    fr::experts(
                        gpu,
                        &pv,
                        self.r.ctl,
                        &fb.scale,
                        &mut fb.y,
                        knobs.transport_sms,
                    )
                }?
            }
            (None, false, Some(sw)) => swiglu(gpu, &pv, sw, &mut fb.y)?,
        }
        let (y, y_rows) = match host_y {
            Some(h) => (h.y, h.rows),
            None if fb.identity => (ws + a.expanded, a.exp_rows as usize),
            None => (super::device_address(gpu, &fb.y), a.exp_rows as usize),
        };
        // the compact view's rows hold block positions, except the source arm's (final
        // rows): one launch per kind, each gated to its arms
        let plan = ws + a.plan;
        let eps = (epr * ns) as u64;
        let relative = fk::BlockStarts::Relative(plan + 8 * eps);
        let launches: Vec<(Option<u64>, fk::BlockStarts)> = if self.one_launch {
            // one launch for every arm, the rows' meaning read from the control block itself
            vec![(Some(self.r.ctl), fk::BlockStarts::ByArm(plan + 8 * eps))]
        } else {
            vec![
                (self.gate(PF | CF), relative),
                (self.gate(SRC), fk::BlockStarts::Final),
            ]
        };
        for (c, block_starts) in launches {
            let Some(c) = c else {
                continue;
            };
            let view = fk::CompactView {
                layout: *a,
                sources: ns,
                slab_offsets: plan + 8 * (2 * eps + epr as u64 + 1),
                block_starts,
                max_rows: (ns * cap) as u64,
                y,
                y_rows,
            };
            let r = self.r.gated(c);
            // SAFETY: the engine's launch invariant (`FusedEngine`): `ws` (`r.ws`) and the peer
            // table are live, `c` is the control block or one of the live arm gates of `d.gates`
            // (`arm_gate`); `view`'s plan numbers are the plan's, in this workspace, whose counts
            // keep rows below the capacity; `y` is `fb.y` or the expanded area, both `a.exp_rows`
            // rows, or the host experts' outputs, which hold the `y_rows` rows of this round's
            // device plan (every row its compact view names); every workspace holds the return
            // areas at `a.ret_off`, `src_ranks` the `ns` attention ranks.
            // the combine flags: raised by the kernel's last block (every workspace holds
            // `MAX_WORLD` flags at `COMBINE_FLAGS`)
            let blocks = knobs.transport_sms;
            unsafe { fk::combine_reduce(gpu, &r, &view, self.src_ranks, f, blocks, true) }?;
        }
        Ok(())
    }

    /// Source: the combine (waits for every FFN rank's flag, then sums the partials).
    ///
    /// With [`FusedEngine::set_combine_prewait`] the wait runs first in a kernel of one block
    /// (`cf::wait` on the combine flags) and the combine's grid starts only after it, its own
    /// wait then passing at once. The wait lasts as long as the FFN ranks' experts; on a GPU
    /// shared by emulated ranks and several pipeline slots, waiting grids of `transport_sms`
    /// blocks per source (3A:1F with two slots: 6 × 24 = 144 blocks, one per SM, more than an
    /// H100's 132 SMs) can leave no SM free for a ws GEMM block (one block needs a whole SM's
    /// registers), so the GEMM the waits depend on never becomes resident until they time out.
    fn source_combine(&self, b: &mut SourceBufs) -> Result<(), ExchangeError> {
        let cfg = self.cfg;
        let p = cfg.placement();
        if self.combine_prewait {
            // SAFETY: the engine's launch invariant (`FusedEngine`): `self.r`'s workspace,
            // control block and error word are live; the workspace holds `MAX_WORLD` flags at
            // `COMBINE_FLAGS`; `ffn_ranks` holds the `p.ffn_ranks` FFN ranks.
            unsafe {
                cf::wait(
                    self.gpu,
                    &self.r,
                    self.ffn_ranks,
                    p.ffn_ranks,
                    super::COMBINE_FLAGS,
                    fk::fault::COMBINE_WAIT,
                )
            }?;
        }
        let routes = fk::CombineRoutes {
            idx: &b.idx,
            ffn_ranks: self.ffn_ranks,
            ffns: p.ffn_ranks,
            experts_per_rank: p.experts_per_rank,
            tokens: cfg.capacity,
        };
        let blocks = cfg.knobs.transport_sms;
        // SAFETY: the engine's launch invariant (`FusedEngine`): `self.r`'s workspace, control
        // block and error word are live (the token count at most the capacity `b.idx` holds);
        // the workspace holds `MAX_WORLD` flags at `COMBINE_FLAGS` and the return areas at
        // `a.ret_off`.
        unsafe { fk::combine(self.gpu, &self.r, &routes, &self.a, &mut b.out, blocks) }?;
        Ok(())
    }
}

/// FFN rank `f`'s SwiGLU buffers for at most `rows` expanded rows, and one GEMM over empty
/// groups (loads the GEMM kernels, sets their occupancy and fault word up: nothing of that may
/// happen during a capture). Shared with the NCCL device engine.
pub(crate) fn swiglu_bufs(
    gpu: &GpuContext,
    cfg: &afdep_core::ExchangeConfig,
    lp: &afdep_core::oracle::LayerParams,
    f: usize,
    rows: usize,
) -> Result<SwigluBufs, ExchangeError> {
    let p = cfg.placement();
    let (h, wd) = (cfg.hidden, lp.shape.width);
    let e = p.experts_of(f);
    let per = h * wd;
    let mut sw = SwigluBufs {
        w1: upload(gpu, &lp.w1[e.start * per..e.end * per])?,
        w3: upload(gpu, &lp.w3[e.start * per..e.end * per])?,
        w2: upload(gpu, &lp.w2[e.start * per..e.end * per])?,
        width: wd,
        offsets: zeros(gpu, p.experts_per_rank + 1)?,
        x: zeros(gpu, rows.max(1) * h)?,
        h: zeros(gpu, rows.max(1) * wd)?,
    };
    let mut y: CudaSlice<bf16> = zeros(gpu, rows.max(1) * h)?;
    swiglu_gemms(gpu, p.experts_per_rank, rows.max(1), h, &mut sw, &mut y)?;
    gpu.synchronize()?;
    gpu.take_fault()?;
    Ok(sw)
}

/// The SwiGLU experts of a device round: the device plan's expert offsets and the expanded rows
/// copied into the GEMM's buffers (device copies, in stream order), then the grouped up- and
/// down-projection GEMMs into `y`. On a skipped round the copies read the previous plan
/// (offsets never above the expanded area's rows) and the outputs are never returned.
pub(crate) fn swiglu(
    gpu: &GpuContext,
    pv: &PlanView,
    sw: &mut SwigluBufs,
    y: &mut CudaSlice<bf16>,
) -> Result<(), ExchangeError> {
    use afdep_kernels::cudarc::driver::DevicePtrMut;
    let eo = pv.ws + pv.layout.plan + 8 * (2 * pv.epr * pv.sources) as u64;
    let rows = pv.layout.exp_rows as usize;
    let hidden = pv.layout.hidden as usize;
    let copies = [
        (
            sw.offsets.device_ptr_mut(gpu.stream()).0,
            eo,
            8 * (pv.epr + 1),
        ),
        (
            sw.x.device_ptr_mut(gpu.stream()).0,
            pv.ws + pv.layout.expanded,
            2 * rows * hidden,
        ),
    ];
    for (dst, src, bytes) in copies {
        if bytes == 0 {
            continue;
        }
        // SAFETY: `src` lies in this rank's workspace (the plan's expert offsets, or the
        // expanded area: the geometry fits them, checked at set-up); `dst` is a buffer of this
        // context allocated for `bytes` (epr + 1 offsets, exp_rows × hidden rows); the copy is
        // ordered on this rank's stream.
        unsafe { cures::memcpy_dtod_async(dst, src, bytes, gpu.stream().cu_stream()) }
            .map_err(KernelError::driver("copying the expert rows"))?;
    }
    swiglu_gemms(gpu, pv.epr, rows, hidden, sw, y)
}

/// The grouped SwiGLU GEMMs over `rows` rows of `sw.x` in `epr` groups (`sw.offsets`) into `y`.
fn swiglu_gemms(
    gpu: &GpuContext,
    epr: usize,
    rows: usize,
    hidden: usize,
    sw: &mut SwigluBufs,
    y: &mut CudaSlice<bf16>,
) -> Result<(), ExchangeError> {
    use afdep_kernels::ops::gemm::{self, Groups, RowsOut};
    let groups = Groups::Experts {
        offsets: &sw.offsets,
        experts: epr,
        capacity: rows,
    };
    gemm::up_swiglu(
        gpu, groups, &sw.x, None, &sw.w1, &sw.w3, hidden, sw.width, &mut sw.h, None,
    )?;
    gemm::down(
        gpu,
        groups,
        &sw.h,
        &sw.w2,
        sw.width,
        hidden,
        RowsOut::Store {
            out: y,
            weights: None,
        },
    )?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use afdep_core::ExchangeConfig;
    use afdep_kernels::ops::fused_round::STATUS_BYTES;

    /// The status area follows the count-first areas, 256-byte aligned, and ends the
    /// workspace; the control block lies between the error word and the slabs.
    #[test]
    fn the_status_area_and_the_control_block_fit_the_workspace() {
        for (topo, hidden, experts, k, cap) in [
            ("3A:1F", 2048usize, 128usize, 8usize, 2048usize),
            ("1A:3F", 20, 9, 2, 3),
            ("EP4", 7168, 24, 4, 256),
        ] {
            let c = ExchangeConfig::new(topo.parse().unwrap(), hidden, experts, k, cap).unwrap();
            let g = super::super::geometry(&c);
            assert_eq!(g.status % 256, 0);
            assert!(g.status >= g.expanded + g.exp_rows * 2 * hidden as u64);
            assert_eq!(g.bytes, g.status + STATUS_BYTES);
            assert_eq!(FusedEngine::workspace_bytes(&c) as u64, g.bytes);
        }
        const {
            assert!(super::super::ERROR_WORD + 16 <= CONTROL);
            assert!(CONTROL + 4 * CTL_WORDS as u64 <= super::super::SLABS);
        }
    }

    /// A fixed round launches exactly its arm's kernels, each with the control block; an auto
    /// round launches every arm's, each with the control block when it runs in every arm, else
    /// with the gate of its own arms.
    #[test]
    fn arm_gates_select_the_launches_and_their_control_blocks() {
        let (ctl, gates) = (0x1000u64, 0x8000u64);
        let g = |m: u32| fr::gate_address(gates, m);
        for a in DispatchArm::ALL {
            let round = arm_bit(a);
            for arms in 1..8u32 {
                let want = (arms & round != 0).then_some(ctl);
                assert_eq!(arm_gate(ctl, gates, round, arms), want, "{a} {arms:03b}");
            }
        }
        assert_eq!(arm_gate(ctl, gates, ALL_ARMS, ALL_ARMS), Some(ctl));
        assert_eq!(arm_gate(ctl, gates, ALL_ARMS, PF), Some(g(1)));
        assert_eq!(arm_gate(ctl, gates, ALL_ARMS, CF | SRC), Some(g(6)));
        assert_eq!(arm_gate(ctl, gates, ALL_ARMS, PF | CF), Some(g(3)));
        assert_eq!(arm_gate(ctl, gates, ALL_ARMS, PF | SRC), Some(g(5)));
        for a in DispatchArm::ALL {
            assert_eq!(arm_of_code(arm_code(a)), Some(a));
            assert_eq!(request_of_code(arm_code(a)), RoundArm::Fixed(a));
        }
        assert_eq!(arm_of_code(fr::arm::AUTO), None);
        assert_eq!(request_of_code(fr::arm::AUTO), RoundArm::Auto);
        assert_eq!(
            RoundArm::from(DispatchArm::CountFirst).to_string(),
            "count_first"
        );
        assert_eq!(RoundArm::Auto.to_string(), "auto");
    }

    /// The device's bucket is the host rule's threshold: payload-first below it, count-first (the
    /// source arm, as `afdep_round_begin` takes) from it on, for every largest-source token count around it (and never count-first when
    /// the rule never picks it).
    #[test]
    fn the_device_bucket_is_the_host_rule() {
        for bucket in [0usize, 1, 7, 2048] {
            for payload in [PayloadKind::Bf16, PayloadKind::Fp8E4m3] {
                let mut c = ExchangeConfig::new("2A:2F".parse().unwrap(), 256, 8, 2, 4096).unwrap();
                c.knobs.min_token_bucket = bucket;
                c.payload = payload;
                let b = rule_bucket(&c);
                for max in [0u64, 1, 6, 7, 8, 2047, 2048, 2049, 4096] {
                    for others in [0u64, max / 2] {
                        let host = super::super::count_first::rule(&c, &[others, max, 0]);
                        let device = if max >= b {
                            DispatchArm::CountFirstSource
                        } else {
                            DispatchArm::PayloadFirst
                        };
                        assert_eq!(device, host, "bucket {bucket} {payload} max {max}");
                    }
                }
            }
        }
    }

    /// The scale expert's host twin: one f32 product, one bf16 rounding (round to nearest
    /// even), expert e scaled by e + 1.
    #[test]
    fn the_scale_expert_on_the_host() {
        let ex = DeviceExperts::index_scale(4);
        let f = ex.host();
        let rows: Vec<bf16> = [1.0f32, -0.5, 3.25, 1.0 + 1.0 / 128.0]
            .iter()
            .map(|&v| bf16::from_f32(v))
            .collect();
        let y = f(2, &rows, 1);
        let want: Vec<bf16> = rows
            .iter()
            .map(|v| bf16::from_f32(v.to_f32() * 3.0))
            .collect();
        assert_eq!(y, want);
        // (1 + 2^-7) · 3 = 3 + 1.5 · 2^-6: halfway between the bf16 neighbours 3.015625 (odd)
        // and 3.03125 (even): to even
        assert_eq!(y[3].to_f32(), 3.03125);
    }
}
