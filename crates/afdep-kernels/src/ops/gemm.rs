//! Grouped GEMMs of the MoE layer (`cuda/gemm.cu`): bf16 operands, f32 accumulation on tensor
//! cores, a persistent grid scheduled from the device-side group offsets (no host sync, so a
//! whole layer step can be captured in a CUDA graph), 64-bit row offsets.
//!
//! Two problem shapes:
//! - **rows** ([`Groups`] of output rows; N and K fixed; per-group weights): the forward up- and
//!   down-projections and the data gradients, each with its epilogue (SwiGLU, weighted store,
//!   scatter into token order, accumulate, SwiGLU backward);
//! - **k-sum** ([`wgrad`]): per group an `M × N` product over the group's rows (weight
//!   gradients), stored as bf16 straight from the accumulators when it is one chunk, or split
//!   in a fixed number of chunks whose f32 partials are summed in chunk order (deterministic,
//!   no atomics).
//!
//! Operand loads: the dense operands (the weights, and A where its rows are contiguous) are
//! loaded by TMA from tensor maps the launchers encode per call ([`super::tma`]); gathered
//! rows and the weight gradients' operands by cp.async (see `cuda/gemm.cu`). A bounded TMA
//! wait that runs out is recorded in the context's fault word
//! ([`GpuContext::take_fault`]).
//!
//! Two engines for the rows problems ([`Engine`]): the classic two-warpgroup kernel and a
//! warp-specialised one (a TMA/cp.async producer warpgroup, two wgmma consumer warpgroups,
//! 128 × 256 tiles); [`engine_for`] picks one per problem ([`DEFAULT_ENGINE`], the ws engine
//! by measurement, unless `AFDEP_GEMM_ENGINE` or [`force_engine`] asks for the classic one).
//! The weight gradients have the same two ([`wgrad_engine_for`]): the warp-specialised one
//! (128 × 256 tiles, TMA for the contiguous operands, cp.async for the gathered ones) by
//! default ([`DEFAULT_WGRAD_ENGINE`], by measurement), the classic k-sum kernel where
//! `AFDEP_GEMM_WGRAD=classic` or [`force_wgrad_engine`] asks for it.
//!
//! Sizes: every matrix dimension is a multiple of 8 (16-byte rows) and the K sizes of the data
//! gradients ([`dx`]'s `width`, where K switches from W1 to W3) a multiple of 8 too; the launchers return
//! [`KernelError::Unsupported`] otherwise.

use std::cell::Cell;
use std::sync::OnceLock;

use afdep_core::bf16;
use cudarc::driver::{
    CudaSlice, DevicePtr, DevicePtrMut, DeviceRepr, LaunchConfig, PushKernelArg, SyncOnDrop,
};

use super::tma::{self, Swizzle, TmaMap};
use super::{as_u32, grid, need};
use crate::context::{GpuContext, GridUnit, launch_err};
use crate::error::KernelError;
use crate::sources::{BLOCK, KernelId};

/// Output rows per tile (and M rows of a k-sum tile).
pub const TILE_M: usize = 128;
/// Output columns per tile.
pub const TILE_N: usize = 128;
/// K per pipeline stage (`AFDEP_GEMM_BK` in `cuda/gemm.cu`: 64-byte rows of the K-major
/// tiles, 64-byte swizzle).
pub const TILE_K: usize = 32;
/// Pipeline stages (`STAGES` = `AFDEP_GEMM_PREFETCH` + 2 in `cuda/gemm.cu`): 4 k-tiles load
/// ahead. Chosen by measurement (docs/perf/moe.md, 2026-12-03 (c)).
pub const STAGES: usize = 6;
/// Dynamic shared memory of a GEMM kernel: the stages of two 128 × [`TILE_K`] bf16 tiles, plus
/// 1 KiB to align them to the 1024-byte swizzle atom (`SMEM_DYN_BYTES` in `cuda/gemm.cu`):
/// 97 KiB, two blocks per SM.
pub const SMEM_BYTES: usize = STAGES * 2 * TILE_M * TILE_K * 2 + 1024;
/// Granule of a K split between two B operands (one 16-byte chunk of bf16).
const K_CHUNK: usize = 8;
/// Most groups per launch (`AFDEP_GEMM_MAX_GROUPS`).
pub const MAX_GROUPS: usize = 1024;

/// Output rows per tile of the warp-specialised engine ([`Engine::Ws`], `WS_BM`).
pub const WS_TILE_M: usize = 128;
/// Output columns per tile of [`Engine::Ws`] (`WS_BN`; the SwiGLU up-projection's tile is
/// 128 columns of W1 beside the same 128 of W3).
pub const WS_TILE_N: usize = 256;
/// K per stage of [`Engine::Ws`] (`WS_BK`: 128-byte rows, 128-byte swizzle).
pub const WS_TILE_K: usize = 64;
/// Pipeline stages of [`Engine::Ws`] (`WS_STAGES`).
pub const WS_STAGES: usize = 4;
/// Threads per block of [`Engine::Ws`] (`WS_THREADS`): a producer and two consumer
/// warpgroups.
pub const WS_BLOCK: u32 = 384;
/// Dynamic shared memory of [`Engine::Ws`] (`WS_SMEM_DYN_BYTES`): four stages of a 128 × 64
/// A tile and a 256 × 64 B tile plus the 1 KiB alignment slack, 193 KiB (one block per SM).
pub const WS_SMEM_BYTES: usize = WS_STAGES * (WS_TILE_M + WS_TILE_N) * WS_TILE_K * 2 + 1024;

/// The kernel family a GEMM runs on: rows problems by [`engine_for`], weight gradients by
/// [`wgrad_engine_for`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Engine {
    /// The two-warpgroup kernels (`gemm_rows`, `gemm_ksum`): 128 × 128 tiles, K 32 per
    /// stage, 6 stages, no warp specialisation (rows: two blocks per SM).
    Classic,
    /// The warp-specialised kernels (`gemm_rows_ws`, `gemm_ksum_ws`): a TMA/cp.async
    /// producer warpgroup and two wgmma m64n256k16 consumer warpgroups, 128 × 256 tiles, K 64
    /// per stage, 4 stages with full/empty mbarriers, one block per SM.
    Ws,
}

/// The engine every rows problem runs on unless `AFDEP_GEMM_ENGINE` or [`force_engine`]
/// asks for the other: [`Engine::Ws`], chosen by measurement (docs/perf/moe.md,
/// 2026-12-05 (b)): in one call (NVIDIA H100, merge `851a445`, kernel digest
/// `c7bedad1ce8509c3`) the ws engine was faster than the classic kernel in every one of the
/// twelve (shape, strategy) cells timed, forward and train step, from the record's shape
/// (d_model 512, width 128: K 128 for the down-projection, 2 % to 3.5 % faster) to the
/// Mixtral-like one (forward 34.6 → 19.6 ms, train step 126.1 → 85.3 ms, sorted). So there is
/// no shape threshold: a threshold would need a shape where the classic kernel wins.
pub const DEFAULT_ENGINE: Engine = Engine::Ws;

/// The engine a rows problem runs on: [`force_engine`]'s choice on this thread, else the
/// process environment `AFDEP_GEMM_ENGINE` (read once: `classic` or `ws`; `auto` or unset:
/// [`DEFAULT_ENGINE`]). A problem the ws engine cannot describe by tensor maps (B not
/// TMA-aligned, a K split not a multiple of 64) runs on the classic kernel whatever is asked.
pub fn engine_for() -> Engine {
    static ENV: OnceLock<Option<Engine>> = OnceLock::new();
    chosen(
        &FORCE,
        &ENV,
        "AFDEP_GEMM_ENGINE",
        &ENGINE_NAMES,
        DEFAULT_ENGINE,
    )
}

/// One GEMM choice: this thread's forced value, else the environment variable `var` (read
/// once into `env`: one of `names`, whose `None` means `default`; unset: `default`; anything
/// else is warned about and means `default`).
fn chosen<T: Copy + 'static>(
    force: &'static std::thread::LocalKey<Cell<Option<T>>>,
    env: &OnceLock<Option<T>>,
    var: &'static str,
    names: &[(&str, Option<T>)],
    default: T,
) -> T {
    if let Some(v) = force.with(Cell::get) {
        return v;
    }
    let from_env = *env.get_or_init(|| {
        let v = std::env::var(var).ok()?;
        match names.iter().find(|(n, _)| *n == v) {
            Some((_, value)) => *value,
            None => {
                let known: Vec<&str> = names.iter().map(|(n, _)| *n).collect();
                tracing::warn!(
                    variable = var,
                    value = %v,
                    "{var} is none of {}: the default is used",
                    known.join(", ")
                );
                None
            }
        }
    });
    from_env.unwrap_or(default)
}

/// The names of [`Engine`] in `AFDEP_GEMM_ENGINE` and `AFDEP_GEMM_WGRAD`.
const ENGINE_NAMES: [(&str, Option<Engine>); 3] = [
    ("classic", Some(Engine::Classic)),
    ("ws", Some(Engine::Ws)),
    ("auto", None),
];

thread_local! {
    static FORCE: Cell<Option<Engine>> = const { Cell::new(None) };
}

/// Makes the rows GEMMs launched from this thread use `engine` whatever their shape (`None`:
/// the rule of [`engine_for`] again). For tests and same-build comparisons.
pub fn force_engine(engine: Option<Engine>) {
    FORCE.with(|f| f.set(engine));
}

/// Whether the ws rows engine runs in pairs of blocks: 2-block clusters along M, each pair
/// computing two m-tiles of one group at the same columns and sharing their B stages (each
/// block loads half of every B stage by TMA multicast into both), which halves the B bytes
/// every block reads from L2 per stage (48 → 32 KiB of A and B). The price: where a group's
/// m-tiles are odd in number, the second block of its last pair computes nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pairing {
    /// One block per tile.
    Off,
    /// Every ws rows problem in pairs.
    On,
    /// Pairs where the average group has at least [`PAIR_MIN_ROWS`] rows (so at most one
    /// tile in 16 is an idle half of a pair).
    Auto,
}

/// The pairing unless `AFDEP_GEMM_PAIRS` or [`force_pairing`] asks for another: off until the
/// pairs have been measured against single blocks on a GPU (docs/perf/moe.md, 2026-12-07 (b)).
pub const DEFAULT_PAIRING: Pairing = Pairing::Off;

/// Average rows per group from which [`Pairing::Auto`] pairs: 8 m-tiles.
pub const PAIR_MIN_ROWS: usize = 8 * WS_TILE_M;

thread_local! {
    static FORCE_PAIRING: Cell<Option<Pairing>> = const { Cell::new(None) };
}

/// Makes the ws rows GEMMs launched from this thread use `pairing` (`None`: the rule of
/// [`pairing_for`] again). For tests and same-build comparisons.
pub fn force_pairing(pairing: Option<Pairing>) {
    FORCE_PAIRING.with(|f| f.set(pairing));
}

/// The pairing of the ws rows engine: [`force_pairing`]'s choice on this thread, else the
/// process environment `AFDEP_GEMM_PAIRS` (read once: `off`, `on` or `auto`; unset:
/// [`DEFAULT_PAIRING`]; anything else is warned about and means the default).
pub fn pairing_for() -> Pairing {
    static ENV: OnceLock<Option<Pairing>> = OnceLock::new();
    chosen(
        &FORCE_PAIRING,
        &ENV,
        "AFDEP_GEMM_PAIRS",
        &[
            ("off", Some(Pairing::Off)),
            ("on", Some(Pairing::On)),
            ("auto", Some(Pairing::Auto)),
        ],
        DEFAULT_PAIRING,
    )
}

thread_local! {
    /// Launches from this thread that ran in pairs of blocks (a paired request that fell back
    /// to single blocks, because not one pair fits, does not count).
    static PAIRED_LAUNCHES: Cell<u64> = const { Cell::new(0) };
}

/// How many GEMM launches from this thread ran in pairs of blocks ([`Pairing`]); for tests
/// and benchmarks that must know the pairs were used.
pub fn paired_launches() -> u64 {
    PAIRED_LAUNCHES.with(Cell::get)
}

/// The GEMM engines this thread's launches would choose, for benchmark rows: e.g.
/// `rows ws, pairs off, wgrad ws`.
pub fn describe() -> String {
    let name = |e: Engine| match e {
        Engine::Classic => "classic",
        Engine::Ws => "ws",
    };
    let pairs = match pairing_for() {
        Pairing::Off => "off",
        Pairing::On => "on",
        Pairing::Auto => "auto",
    };
    format!(
        "rows {}, pairs {pairs}, wgrad {}",
        name(engine_for()),
        name(wgrad_engine_for())
    )
}

/// Whether a ws rows problem of `rows` (its capacity) in `groups` groups runs in pairs.
fn pairs_for(pairing: Pairing, rows: u64, groups: u64) -> bool {
    match pairing {
        Pairing::Off => false,
        Pairing::On => true,
        Pairing::Auto => rows >= PAIR_MIN_ROWS as u64 * groups.max(1),
    }
}

/// The engine the weight gradients ([`wgrad`]) run on unless `AFDEP_GEMM_WGRAD` or
/// [`force_wgrad_engine`] asks for the other: [`Engine::Ws`], the warp-specialised KSUM
/// kernel (`gemm_ksum_ws`: 128 × 256 tiles, TMA for the contiguous operands, cp.async for the
/// gathered ones). Chosen by measurement (docs/perf/moe.md, 2026-12-06 (b), H200): the
/// Mixtral-like train step 82.6 → 70.8 ms, GPT-OSS-like 12.77 → 12.64 ms, every row checked.
pub const DEFAULT_WGRAD_ENGINE: Engine = Engine::Ws;

/// The engine the weight gradients run on: [`force_wgrad_engine`]'s choice on this thread,
/// else the process environment `AFDEP_GEMM_WGRAD` (read once: `classic` or `ws`; `auto` or
/// unset: [`DEFAULT_WGRAD_ENGINE`]). Independent of the rows engine ([`engine_for`]).
pub fn wgrad_engine_for() -> Engine {
    static ENV: OnceLock<Option<Engine>> = OnceLock::new();
    chosen(
        &FORCE_WGRAD,
        &ENV,
        "AFDEP_GEMM_WGRAD",
        &ENGINE_NAMES,
        DEFAULT_WGRAD_ENGINE,
    )
}

thread_local! {
    static FORCE_WGRAD: Cell<Option<Engine>> = const { Cell::new(None) };
}

/// Makes the weight gradients launched from this thread use `engine` (`None`: the rule of
/// [`wgrad_engine_for`] again). For tests and same-build comparisons.
pub fn force_wgrad_engine(engine: Option<Engine>) {
    FORCE_WGRAD.with(|f| f.set(engine));
}

/// How the blocks of a warp-specialised rows GEMM ([`Engine::Ws`]) share its tiles.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Schedule {
    /// Block b of a grid of G takes tiles b, b + G, b + 2G, … (fixed before the launch).
    Static,
    /// Each block takes the next tile from a counter in device memory (the context's
    /// [`GpuContext::schedule_word`]) when it is ready for one, so the blocks that are
    /// resident take every tile, also while other kernels hold some SMs and the rest of the
    /// grid is not resident yet (a persistent grid beside the exchange's waiting kernels:
    /// `docs/perf/exchange.md`, the microbatch pipeline). The results are the same bits as the
    /// static schedule's: a tile's arithmetic does not depend on the block that computes it.
    Dynamic,
}

/// The schedule every ws rows GEMM uses unless `AFDEP_GEMM_SCHEDULE` or [`force_schedule`]
/// asks for the other: [`Schedule::Static`] until a measurement says otherwise.
pub const DEFAULT_SCHEDULE: Schedule = Schedule::Static;

/// The schedule of the ws rows GEMMs: [`force_schedule`]'s choice on this thread, else the
/// process environment `AFDEP_GEMM_SCHEDULE` (read once: `static` or `dynamic`; unset:
/// [`DEFAULT_SCHEDULE`]; anything else is warned about and means the default). The classic
/// kernels and the weight gradients always use the static schedule.
pub fn schedule_for() -> Schedule {
    static ENV: OnceLock<Option<Schedule>> = OnceLock::new();
    chosen(
        &FORCE_SCHEDULE,
        &ENV,
        "AFDEP_GEMM_SCHEDULE",
        &[
            ("static", Some(Schedule::Static)),
            ("dynamic", Some(Schedule::Dynamic)),
        ],
        DEFAULT_SCHEDULE,
    )
}

thread_local! {
    static FORCE_SCHEDULE: Cell<Option<Schedule>> = const { Cell::new(None) };
}

/// Makes the ws rows GEMMs launched from this thread use `schedule` (`None`: the rule of
/// [`schedule_for`] again). For tests and same-build comparisons.
pub fn force_schedule(schedule: Option<Schedule>) {
    FORCE_SCHEDULE.with(|f| f.set(schedule));
}

/// The device descriptor (`cuda/layout/gemm_problem.cuh`), field for field.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
struct GemmProblem {
    a: u64,
    b: u64,
    b2: u64,
    offsets: u64,
    a_idx: u64,
    b_idx: u64,
    c: u64,
    c2: u64,
    c3: u64,
    c4: u64,
    aux: u64,
    r_idx: u64,
    weights: u64,
    gsum: u64,
    lda: u64,
    ldb: u64,
    b_gs: u64,
    ldc: u64,
    ld2: u64,
    fault: u64,
    sched: u64,
    m: u32,
    n: u32,
    k: u32,
    groups: u32,
    a_div: u32,
    b_div: u32,
    b_split: u32,
    splits: u32,
    r_div: u32,
    tma: u32,
    wait_ms: u32,
    inject_tx: u32,
}

const _: () = assert!(std::mem::size_of::<GemmProblem>() == 216);

/// Bound of one TMA stage wait (a stage lands in microseconds: the bound only turns a lost
/// transaction into a [`KernelError::DeviceFault`] instead of a hang, with room for
/// compute-sanitizer's slowdown).
pub const TMA_WAIT_MS: u32 = 20_000;

/// Fault injection for tests: (extra expected bytes per TMA stage, wait bound in ms); 0 extra
/// bytes = off. Process-wide, so a test that sets it runs in a test binary of its own.
static INJECT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Makes every later TMA stage of this process expect `extra_bytes` more than its boxes
/// deliver, so that its bounded wait (`wait_ms`) runs out and the GEMM records a fault: the
/// test of the fault path (no hang, a typed error, a usable context). `inject_tma_fault(0, _)`
/// turns it off. Not for production use.
#[doc(hidden)]
pub fn inject_tma_fault(extra_bytes: u32, wait_ms: u32) {
    INJECT.store(
        (u64::from(extra_bytes) << 32) | u64::from(wait_ms),
        std::sync::atomic::Ordering::SeqCst,
    );
}

/// `GemmProblem::tma` bits (`AFDEP_GEMM_TMA_A` / `_B` in `cuda/layout/gemm_problem.cuh`).
const TMA_A: u32 = 1;
const TMA_B: u32 = 2;

// SAFETY: plain old data of u64/u32 fields with the C layout of the device struct (size
// asserted above and on the device); the kernel takes it by value.
unsafe impl DeviceRepr for GemmProblem {}

/// The groups of a rows problem: which output rows belong to which expert.
#[derive(Debug, Clone, Copy)]
pub enum Groups<'a> {
    /// One group of `rows` rows (a dense GEMM: the shared expert, the router).
    Dense {
        /// Rows.
        rows: usize,
    },
    /// `experts` groups; group `e` owns rows `offsets[e] .. offsets[e + 1]` (device values,
    /// `experts + 1` of them); `capacity` bounds the total (the buffers' row count).
    Experts {
        /// `u64[experts + 1]` offsets (an [`ExpertLayout`](super::layout::ExpertLayout)'s).
        offsets: &'a CudaSlice<u64>,
        /// Groups.
        experts: usize,
        /// Upper bound of `offsets[experts]`.
        capacity: usize,
    },
}

impl Groups<'_> {
    fn count(&self) -> usize {
        match self {
            Groups::Dense { .. } => 1,
            Groups::Experts { experts, .. } => *experts,
        }
    }
    fn capacity(&self) -> usize {
        match self {
            Groups::Dense { rows } => *rows,
            Groups::Experts { capacity, .. } => *capacity,
        }
    }
}

/// Rows of an operand read through a gather: row `r` of the problem reads row
/// `index[r] / div` (the layout's `row_slot` with `div = top_k` gives token rows).
#[derive(Debug, Clone, Copy)]
pub struct Gather<'a> {
    /// `u32` index per problem row.
    pub index: &'a CudaSlice<u32>,
    /// Divisor of the index.
    pub div: usize,
}

/// Per-row router weights of a rows problem: row `r` is slot `row_slot[r]`, weight
/// `weights[row_slot[r]]`.
#[derive(Debug, Clone, Copy)]
pub struct RowWeights<'a> {
    /// Row → slot (`t·K + k`).
    pub row_slot: &'a CudaSlice<u32>,
    /// f32 per slot.
    pub weights: &'a CudaSlice<f32>,
    /// Slots per token.
    pub top_k: usize,
}

/// Where a down-projection or data-gradient GEMM writes `v` (row `r`, column `n`).
#[derive(Debug)]
pub enum RowsOut<'a> {
    /// `out[r, n] = bf16(w_r · v)` (`w_r = 1` without weights), rows in problem order.
    Store {
        /// `capacity × n` bf16.
        out: &'a mut CudaSlice<bf16>,
        /// Optional row weights.
        weights: Option<RowWeights<'a>>,
    },
    /// `acc[token(r), n] += w_r · v` with f32 atomics (token order; the order of the adds is
    /// not fixed).
    Scatter {
        /// `tokens × n` f32.
        acc: &'a mut CudaSlice<f32>,
        /// Row weights (`weights` may be all ones by passing ones).
        weights: RowWeights<'a>,
        /// Whether to multiply by the weight.
        weighted: bool,
    },
    /// `acc[r, n] += v` in f32 (dense problems only: rows are tokens).
    Add {
        /// `rows × n` f32.
        acc: &'a mut CudaSlice<f32>,
    },
    /// `out[r, n] = bf16(acc[r, n] + v)` (dense problems: the last term of a sum).
    Finish {
        /// `rows × n` f32.
        acc: &'a CudaSlice<f32>,
        /// `rows × n` bf16.
        out: &'a mut CudaSlice<bf16>,
    },
}

/// Where the SwiGLU backward ([`dh_dswiglu`]) finds the forward's `a = x·W1` and `b = x·W3`:
/// `[a | b]` rows of `2·width` bf16, as [`up_swiglu`] keeps them.
#[derive(Debug, Clone, Copy)]
pub enum SavedAb<'a> {
    /// In a buffer of their own, `capacity × 2·width`, left unchanged.
    Separate(&'a CudaSlice<bf16>),
    /// In the output [`DswigluIo::dab`] itself: each element of `[a | b]` is read and replaced
    /// by its `[da | db]` by the same thread, so the step needs no buffer for them. The
    /// forward's values are gone afterwards.
    InPlace,
}

/// The SwiGLU backward's per-row inputs and outputs ([`dh_dswiglu`]).
#[derive(Debug)]
pub struct DswigluIo<'a> {
    /// The forward's `[a | b]` rows.
    pub ab: SavedAb<'a>,
    /// Output `[da | db]`, `capacity × 2·width` bf16.
    pub dab: &'a mut CudaSlice<bf16>,
    /// Output `w·h` (the dW2 operand), `capacity × width`, or none.
    pub hw: Option<&'a mut CudaSlice<bf16>>,
    /// Router weights of the rows (none: weight 1, the shared expert).
    pub weights: Option<RowWeights<'a>>,
    /// Output `g[slot] += <G_row, h_row>` (f32 per slot, zeroed by the caller), or none.
    pub gsum: Option<&'a mut CudaSlice<f32>>,
}

/// Collects device pointers and their stream guards for one launch.
struct Ptrs<'a> {
    stream: &'a cudarc::driver::CudaStream,
    guards: Vec<SyncOnDrop<'a>>,
}

impl<'a> Ptrs<'a> {
    fn new(stream: &'a cudarc::driver::CudaStream) -> Self {
        Ptrs {
            stream,
            guards: Vec::new(),
        }
    }
    fn r<T>(&mut self, s: &'a CudaSlice<T>) -> u64 {
        if s.is_empty() {
            return 0;
        }
        let (p, g) = s.device_ptr(self.stream);
        self.guards.push(g);
        p
    }
    fn w<T>(&mut self, s: &'a mut CudaSlice<T>) -> u64 {
        if s.is_empty() {
            return 0;
        }
        let (p, g) = s.device_ptr_mut(self.stream);
        self.guards.push(g);
        p
    }
}

fn mult(what: &str, v: usize, m: usize) -> Result<u32, KernelError> {
    if v == 0 || v % m != 0 {
        return Err(KernelError::Unsupported(format!(
            "{what} = {v}: the grouped GEMM needs a positive multiple of {m}"
        )));
    }
    as_u32(what, v)
}

/// The tensor maps of a rows problem's TMA operands (none: that operand loads by cp.async).
#[derive(Debug, Default)]
struct RowMaps {
    a: Option<TmaMap>,
    b: Option<TmaMap>,
    b2: Option<TmaMap>,
}

/// The box sizes of an engine's tensor maps: K per stage, and the n rows of a K-major B box
/// (N-major B boxes are 64 n wide for both engines).
#[derive(Debug, Clone, Copy)]
struct Boxes {
    k: usize,
    kmaj_n: usize,
}

impl Boxes {
    fn of(engine: Engine) -> Boxes {
        match engine {
            Engine::Classic => Boxes {
                k: TILE_K,
                kmaj_n: TILE_N,
            },
            Engine::Ws => Boxes {
                k: WS_TILE_K,
                kmaj_n: WS_TILE_N,
            },
        }
    }

    /// The ws engine in pairs: each block of a pair loads half of a K-major B tile's columns.
    fn paired() -> Boxes {
        Boxes {
            k: WS_TILE_K,
            kmaj_n: WS_TILE_N / 2,
        }
    }
}

/// The map of a K-major A operand with contiguous rows: `rows × k` bf16, `lda` elements
/// between rows; boxes of 128 rows × the engine's K.
fn map_a(
    bx: Boxes,
    addr: u64,
    k: usize,
    rows: usize,
    lda: usize,
) -> Result<Option<TmaMap>, KernelError> {
    if !tma::enabled() {
        return Ok(None);
    }
    tma::encode_bf16(
        "A",
        addr,
        &[k as u64, rows as u64],
        &[(lda * 2) as u64],
        &[bx.k as u32, TILE_M as u32],
        Swizzle::for_row_bytes(bx.k * 2),
    )
}

/// The map of an N-major B (`groups × k × n`, `ldb` between k rows, `b_gs` between groups);
/// boxes of 64 n × the engine's K (a 64-column block of a tile), 128-byte swizzle.
fn map_b_nmajor(
    bx: Boxes,
    addr: u64,
    n: usize,
    k: usize,
    groups: usize,
    ldb: usize,
    b_gs: usize,
) -> Result<Option<TmaMap>, KernelError> {
    if !tma::enabled() {
        return Ok(None);
    }
    tma::encode_bf16(
        "B (N-major)",
        addr,
        &[n as u64, k as u64, groups as u64],
        &[(ldb * 2) as u64, (b_gs * 2) as u64],
        &[64, bx.k as u32, 1],
        Swizzle::B128,
    )
}

/// The map of a K-major B (`groups × n × k`, `ldb` between n rows, `b_gs` between groups);
/// boxes of the engine's K × its tile's n.
fn map_b_kmajor(
    bx: Boxes,
    addr: u64,
    k: usize,
    n: usize,
    groups: usize,
    ldb: usize,
    b_gs: usize,
) -> Result<Option<TmaMap>, KernelError> {
    if !tma::enabled() {
        return Ok(None);
    }
    tma::encode_bf16(
        "B (K-major)",
        addr,
        &[k as u64, n as u64, groups as u64],
        &[(ldb * 2) as u64, (b_gs * 2) as u64],
        &[bx.k as u32, bx.kmaj_n as u32, 1],
        Swizzle::for_row_bytes(bx.k * 2),
    )
}

/// A rows problem's two kernels (classic, ws), its output columns per engine tile count
/// (`n_tile`: the columns one tile covers is what differs).
struct RowsKernels {
    classic: KernelId,
    ws: KernelId,
    /// The ws kernel in 2-block clusters ([`Pairing`]).
    ws2: KernelId,
    /// Output columns (the up-projection: its width, each tile covering half of its columns
    /// from W1 and half from W3).
    n: usize,
    /// Whether the tiles hold two B halves (the SwiGLU up-projection).
    dual: bool,
}

/// Chooses the engine of a rows problem (the rule of [`engine_for`], then whether its maps
/// exist), builds its maps and launches it. `maps(boxes)` encodes the problem's maps for an
/// engine's boxes; `row_tiles` bounds the 128-row tiles.
fn launch_rows_auto(
    ctx: &GpuContext,
    ks: RowsKernels,
    p: &mut GemmProblem,
    row_tiles: u64,
    maps: impl Fn(Boxes) -> Result<RowMaps, KernelError>,
) -> Result<(), KernelError> {
    if engine_for() == Engine::Ws {
        let cols = if ks.dual { WS_TILE_N / 2 } else { WS_TILE_N };
        let ntiles_n = ks.n.div_ceil(cols) as u64;
        let groups = u64::from(p.groups);
        // row_tiles = ceil(capacity / 128) + groups (set_groups)
        let rows = row_tiles.saturating_sub(groups) * WS_TILE_M as u64;
        let pair_blocks = if pairs_for(pairing_for(), rows, groups) {
            let resident =
                ctx.persistent_grid(ks.ws2, WS_BLOCK, WS_SMEM_BYTES as u32, GridUnit::Pair)?;
            if resident >= 2 {
                ctx.gemm_grid(resident, 2)
            } else {
                0
            }
        } else {
            0
        };
        let (boxes, kernel, grid) = if pair_blocks >= 2 {
            // a pair's unit is two m-tiles of one group: at most ceil(tiles of a group / 2)
            let units = (row_tiles + groups).div_ceil(2) * ntiles_n;
            (
                Boxes::paired(),
                ks.ws2,
                Grid::Pairs(units.min(u64::from(pair_blocks / 2))),
            )
        } else {
            (
                Boxes::of(Engine::Ws),
                ks.ws,
                Grid::Blocks(row_tiles * ntiles_n),
            )
        };
        let m = maps(boxes)?;
        // The ws engine loads B by TMA only (b and b2 both mapped where b2 exists; a K split
        // between them at a multiple of its K per stage).
        let b_ok = m.b.is_some()
            && (p.b2 == 0 || m.b2.is_some())
            && (ks.dual || p.b2 == 0 || p.b_split as usize % WS_TILE_K == 0);
        if b_ok {
            return launch_rows(ctx, kernel, Engine::Ws, p, m, grid);
        }
    }
    let cols = if ks.dual { TILE_N / 2 } else { TILE_N };
    let tiles = row_tiles * ks.n.div_ceil(cols) as u64;
    let m = maps(Boxes::of(Engine::Classic))?;
    launch_rows(ctx, ks.classic, Engine::Classic, p, m, Grid::Blocks(tiles))
}

/// The grid of a persistent GEMM launch.
#[derive(Debug, Clone, Copy)]
enum Grid {
    /// At most this many blocks (as many as are resident at once).
    Blocks(u64),
    /// Exactly this many 2-block clusters (a kernel compiled with `__cluster_dims__(2, 1, 1)`;
    /// the caller has bounded it by the resident pairs).
    Pairs(u64),
}

/// Launches a rows `kernel` with its tensor maps: the operands with a map load by TMA (a pair
/// b / b2 only when both have one).
fn launch_rows(
    ctx: &GpuContext,
    kernel: KernelId,
    engine: Engine,
    p: &mut GemmProblem,
    maps: RowMaps,
    grid: Grid,
) -> Result<(), KernelError> {
    let a = maps.a;
    let (b, b2) = match (maps.b, maps.b2, p.b2 != 0) {
        (Some(b), _, false) => (Some(b), None),
        (Some(b), Some(b2), true) => (Some(b), Some(b2)),
        _ => (None, None),
    };
    p.tma = if a.is_some() { TMA_A } else { 0 } | if b.is_some() { TMA_B } else { 0 };
    // The dynamic schedule is for single blocks (the paired kernels ignore `sched`).
    p.sched = match (engine, schedule_for(), grid) {
        (Engine::Ws, Schedule::Dynamic, Grid::Blocks(_)) => ctx.schedule_word()?,
        _ => 0,
    };
    let (ta, tb, tb2) = (
        a.unwrap_or_default(),
        b.unwrap_or_default(),
        b2.unwrap_or_default(),
    );
    launch(ctx, kernel, engine, p, grid, &[&ta, &tb, &tb2])
}

/// Launches `kernel` on a persistent grid (`Grid::Blocks(tiles)`: at most `tiles` blocks); the
/// kernel's tensor maps follow the problem (rows kernels: A, B, b2; the ws weight gradient:
/// A, B; the classic weight gradient: none).
fn launch(
    ctx: &GpuContext,
    kernel: KernelId,
    engine: Engine,
    p: &mut GemmProblem,
    grid: Grid,
    maps: &[&TmaMap],
) -> Result<(), KernelError> {
    p.fault = ctx.fault_word()?;
    let inject = INJECT.load(std::sync::atomic::Ordering::SeqCst);
    p.inject_tx = (inject >> 32) as u32;
    p.wait_ms = if p.inject_tx != 0 {
        inject as u32
    } else {
        TMA_WAIT_MS
    };
    let (block, smem) = match engine {
        Engine::Classic => (BLOCK, SMEM_BYTES as u32),
        Engine::Ws => (WS_BLOCK, WS_SMEM_BYTES as u32),
    };
    let f = ctx.function(kernel, 0, 0)?;
    let blocks = match grid {
        Grid::Blocks(tiles) => {
            let resident = ctx.persistent_grid(kernel, block, smem, GridUnit::Block)?;
            tiles.clamp(1, u64::from(ctx.gemm_grid(resident, 1)))
        }
        Grid::Pairs(pairs) => {
            PAIRED_LAUNCHES.with(|c| c.set(c.get() + 1));
            2 * pairs.max(1)
        }
    };
    let cfg = LaunchConfig {
        grid_dim: (blocks as u32, 1, 1),
        block_dim: (block, 1, 1),
        shared_mem_bytes: smem,
    };
    let p = &*p;
    let mut b = ctx.stream().launch_builder(&f);
    b.arg(p);
    for m in maps {
        b.arg(*m);
    }
    // SAFETY: every kernel of gemm.cu takes one GemmProblem by value (layout asserted on both
    // sides), the rows kernels then three TmaMaps by value, afdep_gemm_ws_wgrad two and
    // afdep_gemm_wgrad none (the callers pass exactly those; only the maps whose `tma` bit is
    // set are read; each was encoded for a live buffer of the problem with the sizes checked
    // below, and TMA never reads outside the sizes it encodes). The fault word is the
    // context's live 16-byte buffer; the schedule word (ws rows kernels, where `sched` is
    // set) its live 8-byte counter pair, zero before the launch (kernels on the context's one
    // stream do not overlap, and each dynamic launch's last block zeroes it). The callers below fill it with pointers to live buffers whose sizes they checked
    // against the problem: the kernel reads A rows `< capacity` (or gathered rows the index
    // names, checked `< rows of the operand` by construction of the layout), B for `groups`
    // groups, and writes outputs only for rows below the device total (`offsets[groups]` ≤
    // capacity) and columns below n. The guards in `Ptrs` outlive the launch call.
    unsafe { b.launch(cfg) }.map_err(launch_err(kernel))?;
    Ok(())
}

/// Fills the group fields; returns the upper bound of row tiles.
fn set_groups<'a>(
    pr: &mut GemmProblem,
    ptrs: &mut Ptrs<'a>,
    groups: &Groups<'a>,
) -> Result<u64, KernelError> {
    let count = groups.count();
    if count == 0 || count > MAX_GROUPS {
        return Err(KernelError::Unsupported(format!(
            "{count} groups: supported are 1..={MAX_GROUPS}"
        )));
    }
    pr.groups = count as u32;
    match groups {
        Groups::Dense { rows } => {
            pr.m = as_u32("rows", *rows)?;
            pr.offsets = 0;
        }
        Groups::Experts { offsets, .. } => {
            need("group offsets", offsets, count + 1)?;
            // SAFETY of the reborrow: offsets outlives the launch (a shared borrow).
            let (p, g) = offsets.device_ptr(ptrs.stream);
            ptrs.guards.push(g);
            pr.offsets = p;
        }
    }
    Ok((groups.capacity().div_ceil(TILE_M) + count) as u64)
}

/// The forward up-projection with SwiGLU: for every row `r` of `groups` (expert `e`),
/// `a = x_r·W1_e`, `b = x_r·W3_e` (f32), `h[r] = bf16(silu(a)·b)`, and, for the train step,
/// `ab_out[r] = [bf16(a) | bf16(b)]` (rows of `2·width`: the layout of the backward's
/// `[da | db]`, so that [`SavedAb::InPlace`] can use one buffer for both). `x` is read at row
/// `r` or through `gather`.
/// `w1`, `w3` are `groups × hidden × width` (the shared expert: one group, `hidden × S`).
#[allow(clippy::too_many_arguments)]
pub fn up_swiglu(
    ctx: &GpuContext,
    groups: Groups<'_>,
    x: &CudaSlice<bf16>,
    gather: Option<Gather<'_>>,
    w1: &CudaSlice<bf16>,
    w3: &CudaSlice<bf16>,
    hidden: usize,
    width: usize,
    h: &mut CudaSlice<bf16>,
    ab_out: Option<&mut CudaSlice<bf16>>,
) -> Result<(), KernelError> {
    let cap = groups.capacity();
    if cap == 0 {
        return Ok(());
    }
    let hk = mult("hidden", hidden, 8)?;
    let wn = mult("width", width, 8)?;
    let g = groups.count();
    need("W1", w1, g * hidden * width)?;
    need("W3", w3, g * hidden * width)?;
    need("h", h, cap * width)?;
    if gather.is_none() {
        need("x", x, cap * hidden)?;
    }
    let stream = ctx.stream();
    let mut ptrs = Ptrs::new(stream);
    let mut p = GemmProblem {
        a: ptrs.r(x),
        b: ptrs.r(w1),
        b2: ptrs.r(w3),
        lda: hidden as u64,
        ldb: width as u64,
        b_gs: (hidden * width) as u64,
        ldc: width as u64,
        n: wn,
        k: hk,
        ..Default::default()
    };
    let tiles = set_groups(&mut p, &mut ptrs, &groups)?;
    if let Some(gt) = gather {
        p.a_idx = ptrs.r(gt.index);
        p.a_div = as_u32("gather divisor", gt.div.max(1))?;
        need("gather index", gt.index, cap)?;
    }
    if let Some(ab) = ab_out {
        need("[a | b]", ab, cap * 2 * width)?;
        p.c2 = ptrs.w(ab);
        p.ld2 = 2 * width as u64;
    }
    p.c = ptrs.w(h);
    let (pa, pb, pb2) = (p.a, p.b, p.b2);
    let ks = RowsKernels {
        classic: KernelId::GemmUpSwiglu,
        ws: KernelId::GemmWsUpSwiglu,
        ws2: KernelId::GemmWs2UpSwiglu,
        n: width,
        dual: true,
    };
    launch_rows_auto(ctx, ks, &mut p, tiles, |bx| {
        Ok(RowMaps {
            a: if gather.is_none() {
                map_a(bx, pa, hidden, cap, hidden)?
            } else {
                None
            },
            b: map_b_nmajor(bx, pb, width, hidden, g, width, hidden * width)?,
            b2: map_b_nmajor(bx, pb2, width, hidden, g, width, hidden * width)?,
        })
    })
}

fn set_out<'a>(
    p: &mut GemmProblem,
    ptrs: &mut Ptrs<'a>,
    out: RowsOut<'a>,
    cap: usize,
    dense: bool,
    n: usize,
) -> Result<u8, KernelError> {
    Ok(match out {
        RowsOut::Store { out, weights } => {
            need("output", out, cap * n)?;
            if let Some(w) = weights {
                need("row slots", w.row_slot, cap)?;
                p.r_idx = ptrs.r(w.row_slot);
                p.weights = ptrs.r(w.weights);
            }
            p.c = ptrs.w(out);
            0
        }
        RowsOut::Scatter {
            acc,
            weights,
            weighted,
        } => {
            need("row slots", weights.row_slot, cap)?;
            let tokens = weights.weights.len() / weights.top_k.max(1);
            need("accumulator", acc, tokens * n)?;
            p.r_idx = ptrs.r(weights.row_slot);
            if weighted {
                p.weights = ptrs.r(weights.weights);
            }
            p.r_div = as_u32("top_k", weights.top_k.max(1))?;
            p.aux = ptrs.w(acc);
            1
        }
        RowsOut::Add { acc } => {
            if !dense {
                return Err(KernelError::Unsupported(
                    "an in-place add needs a dense problem".into(),
                ));
            }
            need("accumulator", acc, cap * n)?;
            p.aux = ptrs.w(acc);
            2
        }
        RowsOut::Finish { acc, out } => {
            if !dense {
                return Err(KernelError::Unsupported(
                    "a finishing add needs a dense problem".into(),
                ));
            }
            need("accumulator", acc, cap * n)?;
            need("output", out, cap * n)?;
            p.aux = ptrs.r(acc);
            p.c = ptrs.w(out);
            3
        }
    })
}

/// The down-projection `v = h_r·W2_e` (`h`: `capacity × width`, `w2`: `groups × width ×
/// hidden`), written per `out`.
#[allow(clippy::too_many_arguments)]
pub fn down(
    ctx: &GpuContext,
    groups: Groups<'_>,
    h: &CudaSlice<bf16>,
    w2: &CudaSlice<bf16>,
    width: usize,
    hidden: usize,
    out: RowsOut<'_>,
) -> Result<(), KernelError> {
    let cap = groups.capacity();
    if cap == 0 {
        return Ok(());
    }
    let wk = mult("width", width, 8)?;
    let hn = mult("hidden", hidden, 8)?;
    let g = groups.count();
    need("W2", w2, g * width * hidden)?;
    need("h", h, cap * width)?;
    let dense = matches!(groups, Groups::Dense { .. });
    let stream = ctx.stream();
    let mut ptrs = Ptrs::new(stream);
    let mut p = GemmProblem {
        a: ptrs.r(h),
        b: ptrs.r(w2),
        lda: width as u64,
        ldb: hidden as u64,
        b_gs: (width * hidden) as u64,
        ldc: hidden as u64,
        n: hn,
        k: wk,
        ..Default::default()
    };
    let tiles = set_groups(&mut p, &mut ptrs, &groups)?;
    let (classic, ws, ws2) = match set_out(&mut p, &mut ptrs, out, cap, dense, hidden)? {
        0 => (
            KernelId::GemmDownStore,
            KernelId::GemmWsDownStore,
            KernelId::GemmWs2DownStore,
        ),
        1 => (
            KernelId::GemmDownScatter,
            KernelId::GemmWsDownScatter,
            KernelId::GemmWs2DownScatter,
        ),
        3 => (
            KernelId::GemmDownAcc,
            KernelId::GemmWsDownAcc,
            KernelId::GemmWs2DownAcc,
        ),
        _ => {
            return Err(KernelError::Unsupported(
                "the down-projection has no in-place add".into(),
            ));
        }
    };
    let (pa, pb) = (p.a, p.b);
    let ks = RowsKernels {
        classic,
        ws,
        ws2,
        n: hidden,
        dual: false,
    };
    launch_rows_auto(ctx, ks, &mut p, tiles, |bx| {
        Ok(RowMaps {
            a: map_a(bx, pa, width, cap, width)?,
            b: map_b_nmajor(bx, pb, hidden, width, g, hidden, width * hidden)?,
            b2: None,
        })
    })
}

/// The backward of the down-projection and of SwiGLU: `G = dy_r·W2_eᵀ` (`dy` read at row `r`
/// or through `gather`; `w2`: `groups × width × hidden`), then per element with the forward's
/// `a`, `b`: `h = silu(a)·b`, `g[slot] += G·h`, `dh = w·G`, `da = dh·b·silu'(a)`,
/// `db = dh·silu(a)`, `w·h`.
#[allow(clippy::too_many_arguments)]
pub fn dh_dswiglu(
    ctx: &GpuContext,
    groups: Groups<'_>,
    dy: &CudaSlice<bf16>,
    gather: Option<Gather<'_>>,
    w2: &CudaSlice<bf16>,
    width: usize,
    hidden: usize,
    io: DswigluIo<'_>,
) -> Result<(), KernelError> {
    let cap = groups.capacity();
    if cap == 0 {
        return Ok(());
    }
    let wn = mult("width", width, 8)?;
    let hk = mult("hidden", hidden, 8)?;
    let g = groups.count();
    need("W2", w2, g * width * hidden)?;
    if gather.is_none() {
        need("dy", dy, cap * hidden)?;
    }
    need("[da | db]", io.dab, cap * 2 * width)?;
    if let SavedAb::Separate(ab) = io.ab {
        need("[a | b]", ab, cap * 2 * width)?;
    }
    let stream = ctx.stream();
    let mut ptrs = Ptrs::new(stream);
    let mut p = GemmProblem {
        a: ptrs.r(dy),
        b: ptrs.r(w2),
        lda: hidden as u64,
        ldb: hidden as u64,
        b_gs: (width * hidden) as u64,
        ldc: width as u64,
        n: wn,
        k: hk,
        ld2: 2 * width as u64,
        ..Default::default()
    };
    if let SavedAb::Separate(ab) = io.ab {
        p.c2 = ptrs.r(ab);
    }
    let tiles = set_groups(&mut p, &mut ptrs, &groups)?;
    if let Some(gt) = gather {
        need("gather index", gt.index, cap)?;
        p.a_idx = ptrs.r(gt.index);
        p.a_div = as_u32("gather divisor", gt.div.max(1))?;
    }
    if let Some(w) = io.weights {
        need("row slots", w.row_slot, cap)?;
        p.r_idx = ptrs.r(w.row_slot);
        p.weights = ptrs.r(w.weights);
    }
    if let Some(gs) = io.gsum {
        if p.r_idx == 0 {
            return Err(KernelError::Unsupported(
                "the router gradient needs row weights".into(),
            ));
        }
        p.gsum = ptrs.w(gs);
    }
    if let Some(hw) = io.hw {
        need("w·h", hw, cap * width)?;
        p.c4 = ptrs.w(hw);
    }
    p.c = ptrs.w(io.dab);
    if matches!(io.ab, SavedAb::InPlace) {
        p.c2 = p.c;
    }
    let (pa, pb, gathered) = (p.a, p.b, p.a_idx != 0);
    let ks = RowsKernels {
        classic: KernelId::GemmDhDswiglu,
        ws: KernelId::GemmWsDhDswiglu,
        ws2: KernelId::GemmWs2DhDswiglu,
        n: width,
        dual: false,
    };
    launch_rows_auto(ctx, ks, &mut p, tiles, |bx| {
        Ok(RowMaps {
            a: if gathered {
                None
            } else {
                map_a(bx, pa, hidden, cap, hidden)?
            },
            b: map_b_kmajor(bx, pb, hidden, width, g, hidden, width * hidden)?,
            b2: None,
        })
    })
}

/// The data gradient `v = [da | db]_r·[W1_e | W3_e]ᵀ` (`dab`: `capacity × 2·width`; `w1`,
/// `w3`: `groups × hidden × width`), or with `w3 = None` the plain `v = A_r·W1_eᵀ` over K =
/// `width` (the router: `A = dlogits`, `W1 = Wr`). Written per `out`.
#[allow(clippy::too_many_arguments)]
pub fn dx(
    ctx: &GpuContext,
    groups: Groups<'_>,
    dab: &CudaSlice<bf16>,
    w1: &CudaSlice<bf16>,
    w3: Option<&CudaSlice<bf16>>,
    width: usize,
    hidden: usize,
    out: RowsOut<'_>,
) -> Result<(), KernelError> {
    let cap = groups.capacity();
    if cap == 0 {
        return Ok(());
    }
    let hn = mult("hidden", hidden, 8)?;
    let g = groups.count();
    need("W1", w1, g * hidden * width)?;
    let halves = if w3.is_some() { 2 } else { 1 };
    need("A", dab, cap * halves * width)?;
    let dense = matches!(groups, Groups::Dense { .. });
    let stream = ctx.stream();
    let mut ptrs = Ptrs::new(stream);
    let mut p = GemmProblem {
        a: ptrs.r(dab),
        b: ptrs.r(w1),
        lda: (halves * width) as u64,
        ldb: width as u64,
        b_gs: (hidden * width) as u64,
        ldc: hidden as u64,
        n: hn,
        ..Default::default()
    };
    if let Some(w3) = w3 {
        need("W3", w3, g * hidden * width)?;
        p.b2 = ptrs.r(w3);
        p.b_split = mult("width", width, K_CHUNK)?;
        p.k = mult("2·width", 2 * width, 8)?;
    } else {
        p.k = mult("width", width, 8)?;
    }
    let tiles = set_groups(&mut p, &mut ptrs, &groups)?;
    let (classic, ws, ws2) = match set_out(&mut p, &mut ptrs, out, cap, dense, hidden)? {
        0 => (
            KernelId::GemmDxStore,
            KernelId::GemmWsDxStore,
            KernelId::GemmWs2DxStore,
        ),
        1 => (
            KernelId::GemmDxScatter,
            KernelId::GemmWsDxScatter,
            KernelId::GemmWs2DxScatter,
        ),
        2 => (
            KernelId::GemmDxAdd,
            KernelId::GemmWsDxAdd,
            KernelId::GemmWs2DxAdd,
        ),
        _ => (
            KernelId::GemmDxAcc,
            KernelId::GemmWsDxAcc,
            KernelId::GemmWs2DxAcc,
        ),
    };
    let k_b = if w3.is_some() { width } else { p.k as usize };
    let (pa, pb, pb2, pk) = (p.a, p.b, p.b2, p.k as usize);
    let ks = RowsKernels {
        classic,
        ws,
        ws2,
        n: hidden,
        dual: false,
    };
    launch_rows_auto(ctx, ks, &mut p, tiles, |bx| {
        // With W3 the K tiles switch from W1 to W3 at `width`: by TMA only when no tile
        // straddles the switch (the classic cp.async loader splits at any multiple of 8).
        let b_tma = w3.is_none() || width % bx.k == 0;
        Ok(RowMaps {
            a: map_a(bx, pa, pk, cap, halves * width)?,
            b: if b_tma {
                map_b_kmajor(bx, pb, k_b, hidden, g, width, hidden * width)?
            } else {
                None
            },
            b2: if b_tma && w3.is_some() {
                map_b_kmajor(bx, pb2, k_b, hidden, g, width, hidden * width)?
            } else {
                None
            },
        })
    })
}

/// One operand of a weight gradient: row `r` of the sum reads `buf[row(r)·ld ..][..cols]`,
/// `row(r) = r` or `gather.index[r] / gather.div`.
#[derive(Debug, Clone, Copy)]
pub struct KOperand<'a> {
    /// The bf16 buffer.
    pub buf: &'a CudaSlice<bf16>,
    /// Elements between rows.
    pub ld: usize,
    /// Optional gather of rows.
    pub gather: Option<Gather<'a>>,
}

impl<'a> KOperand<'a> {
    /// Rows of `buf` in order, `ld` elements apart.
    pub fn rows(buf: &'a CudaSlice<bf16>, ld: usize) -> Self {
        KOperand {
            buf,
            ld,
            gather: None,
        }
    }

    /// Rows of `buf` through `gather`, `ld` elements apart.
    pub fn gathered(buf: &'a CudaSlice<bf16>, ld: usize, gather: Gather<'a>) -> Self {
        KOperand {
            buf,
            ld,
            gather: Some(gather),
        }
    }
}

/// Weight gradients: for each group `g` (rows `r` of `groups`), `C_g = Σ_r a_rᵀ b_r`, an `m × n`
/// matrix, cast once to bf16 into `out` (`groups × m × n`), or, with `out2 = Some((c2, n1))`,
/// columns `< n1` into `out` (`groups × m × n1`) and the rest into `c2` (`groups × m × (n −
/// n1)`). With `splits > 1` the rows of each group are summed in f32 over `splits` chunks
/// (each an f32 partial in `ws`, at least `groups × splits × m × n`), then reduced in chunk
/// order; with `splits = 1` the GEMM stores the bf16 gradient directly (`ws` is not used and
/// may be empty).
#[allow(clippy::too_many_arguments)]
pub fn wgrad(
    ctx: &GpuContext,
    groups: Groups<'_>,
    a: KOperand<'_>,
    b: KOperand<'_>,
    m: usize,
    n: usize,
    splits: usize,
    ws: &mut CudaSlice<f32>,
    out: &mut CudaSlice<bf16>,
    out2: Option<(&mut CudaSlice<bf16>, usize)>,
) -> Result<(), KernelError> {
    let gcount = groups.count();
    let mm = mult("m", m, 8)?;
    let nn = mult("n", n, 8)?;
    let splits = splits.clamp(1, 1 << 16);
    let (o2, n1) = match out2 {
        Some((o2, n1)) => {
            if n1 == 0 || n1 >= n || n1 % 8 != 0 {
                return Err(KernelError::Shape(format!(
                    "split column {n1} outside 1..{n} or not a multiple of 8"
                )));
            }
            need("second output", o2, gcount * m * (n - n1))?;
            need("output", out, gcount * m * n1)?;
            (Some(o2), n1)
        }
        None => {
            need("output", out, gcount * m * n)?;
            (None, n)
        }
    };
    let direct = splits == 1;
    if !direct {
        need("workspace", ws, gcount * splits * m * n)?;
    }
    let stream = ctx.stream();
    let engine = wgrad_engine_for();
    if direct {
        let mut ptrs = Ptrs::new(stream);
        let mut p = ksum_problem(&mut ptrs, &groups, a, b, mm, nn, 1)?;
        p.c2 = ptrs.w(out);
        if let Some(o2) = o2 {
            p.c3 = ptrs.w(o2);
            p.b_split = as_u32("split column", n1)?;
        }
        return launch_ksum(ctx, engine, &mut p, &groups, a, b);
    }
    {
        let mut ptrs = Ptrs::new(stream);
        let mut p = ksum_problem(&mut ptrs, &groups, a, b, mm, nn, splits)?;
        p.c = ptrs.w(ws);
        launch_ksum(ctx, engine, &mut p, &groups, a, b)?;
    }
    let f = ctx.function(KernelId::GemmReduce, 0, 0)?;
    let total = (gcount * m * n) as u64;
    let gr = as_u32("groups", gcount)?;
    let sp = splits as u32;
    let n1 = n1 as u32;
    let mut bld = stream.launch_builder(&f);
    bld.arg(&*ws).arg(out);
    let null: u64 = 0;
    match o2 {
        Some(o) => {
            bld.arg(o);
        }
        None => {
            bld.arg(&null);
        }
    }
    bld.arg(&gr).arg(&sp).arg(&mm).arg(&nn).arg(&n1);
    // SAFETY: afdep_gemm_reduce(const float* ws, u16* out, u16* out2, u32 groups, u32 splits,
    // u32 m, u32 n, u32 n1): reads groups × splits × m × n partials (ws checked) and writes
    // groups × m × n outputs split at column n1 between out and out2 (both checked); a null
    // out2 sends every column to out.
    unsafe { bld.launch(grid(total.div_ceil(u64::from(BLOCK)).min(1 << 16))?) }
        .map_err(launch_err(KernelId::GemmReduce))?;
    Ok(())
}

/// Launches a k-sum problem (`p` complete but for its tensor maps) on `engine`: the classic
/// kernel, or the ws kernel with a map for each operand whose rows are contiguous and
/// describable ([`map_ksum`]; the others load by cp.async).
fn launch_ksum(
    ctx: &GpuContext,
    engine: Engine,
    p: &mut GemmProblem,
    groups: &Groups<'_>,
    a: KOperand<'_>,
    b: KOperand<'_>,
) -> Result<(), KernelError> {
    let (m, n, g, splits) = (
        p.m as usize,
        p.n as usize,
        p.groups as u64,
        u64::from(p.splits),
    );
    match engine {
        Engine::Classic => {
            let tiles = g * (m.div_ceil(TILE_M) * n.div_ceil(TILE_N)) as u64 * splits;
            launch(
                ctx,
                KernelId::GemmWgrad,
                Engine::Classic,
                p,
                Grid::Blocks(tiles),
                &[],
            )
        }
        Engine::Ws => {
            let rows = groups.capacity();
            let ta = map_ksum(p.a, a, m, rows)?;
            let tb = map_ksum(p.b, b, n, rows)?;
            p.tma = if ta.is_some() { TMA_A } else { 0 } | if tb.is_some() { TMA_B } else { 0 };
            let tiles = g * (m.div_ceil(WS_TILE_M) * n.div_ceil(WS_TILE_N)) as u64 * splits;
            let (ta, tb) = (ta.unwrap_or_default(), tb.unwrap_or_default());
            launch(
                ctx,
                KernelId::GemmWsWgrad,
                Engine::Ws,
                p,
                Grid::Blocks(tiles),
                &[&ta, &tb],
            )
        }
    }
}

/// The map of a k-sum operand for the ws engine, where its rows are contiguous: `rows × cols`
/// bf16 (`op.ld` elements between rows) at `addr`, boxes of 64 columns × 64 rows, 128-byte
/// swizzle (one 64-column block of a stage). `None` (the operand loads by cp.async): gathered,
/// TMA off, a buffer shorter than the rows it would describe, more rows than a box coordinate
/// reaches, or an address / stride the hardware cannot describe.
fn map_ksum(
    addr: u64,
    op: KOperand<'_>,
    cols: usize,
    rows: usize,
) -> Result<Option<TmaMap>, KernelError> {
    if op.gather.is_some() || !tma::enabled() || rows == 0 || rows > i32::MAX as usize {
        return Ok(None);
    }
    if op.buf.len() < (rows - 1) * op.ld + cols {
        return Ok(None);
    }
    tma::encode_bf16(
        "k-sum operand",
        addr,
        &[cols as u64, rows as u64],
        &[(op.ld * 2) as u64],
        &[64, WS_TILE_K as u32],
        Swizzle::B128,
    )
}

/// The k-sum problem of [`wgrad`] without its outputs: operands, sizes, groups, gathers.
fn ksum_problem<'a>(
    ptrs: &mut Ptrs<'a>,
    groups: &Groups<'a>,
    a: KOperand<'a>,
    b: KOperand<'a>,
    mm: u32,
    nn: u32,
    splits: usize,
) -> Result<GemmProblem, KernelError> {
    let mut p = GemmProblem {
        a: ptrs.r(a.buf),
        b: ptrs.r(b.buf),
        lda: a.ld as u64,
        ldb: b.ld as u64,
        m: mm,
        n: nn,
        splits: splits as u32,
        ..Default::default()
    };
    set_groups(&mut p, ptrs, groups)?;
    if let Groups::Dense { rows } = *groups {
        p.k = as_u32("rows", rows)?;
        p.m = mm;
    }
    if let Some(g) = a.gather {
        p.a_idx = ptrs.r(g.index);
        p.a_div = as_u32("gather divisor", g.div.max(1))?;
    } else if matches!(groups, Groups::Dense { .. }) {
        need(
            "A",
            a.buf,
            groups.capacity().saturating_sub(1) * a.ld + mm as usize,
        )?;
    }
    if let Some(g) = b.gather {
        p.b_idx = ptrs.r(g.index);
        p.b_div = as_u32("gather divisor", g.div.max(1))?;
    }
    Ok(p)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sources::SourceFile;

    /// `GemmProblem` has the header's fields in the same order at the same offsets (the
    /// header and the const assert check only the size: two fields swapped would pass them).
    #[test]
    fn the_device_problem_matches() {
        use super::super::device_struct::{assert_mirrors, rust_offsets};
        #[rustfmt::skip]
        let rust = rust_offsets!(GemmProblem;
            a, b, b2, offsets, a_idx, b_idx, c, c2, c3, c4, aux, r_idx, weights, gsum, lda, ldb,
            b_gs, ldc, ld2, fault, sched, m, n, k, groups, a_div, b_div, b_split, splits, r_div,
            tma, wait_ms, inject_tx
        );
        let text = include_str!("../../cuda/layout/gemm_problem.cuh");
        assert_mirrors(
            text,
            "GemmProblem",
            rust,
            std::mem::size_of::<GemmProblem>(),
        );
    }

    /// The default of `#define NAME value` in `cuda/gemm.cu`.
    fn define(name: &str) -> usize {
        let text = SourceFile::Gemm.text();
        let line = text
            .lines()
            .map(str::trim)
            .find(|l| l.starts_with("#define ") && l.split_whitespace().nth(1) == Some(name))
            .unwrap_or_else(|| panic!("gemm.cu defines no {name}"));
        line.split_whitespace()
            .nth(2)
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("{name} in gemm.cu is not a number: {line}"))
    }

    /// The launch constants here mirror the kernel's compile-time tiling: a mismatch would give
    /// the kernels too little shared memory or the wrong tile count, so it fails here first.
    #[test]
    fn constants_mirror_the_kernel_defines() {
        assert_eq!(TILE_M, define("BM"));
        assert_eq!(TILE_N, define("BN"));
        assert_eq!(TILE_K, define("AFDEP_GEMM_BK"));
        assert_eq!(STAGES, define("AFDEP_GEMM_PREFETCH") + 2);
        // SMEM_DYN_BYTES = STAGES * STAGE_BYTES + ATOM_BYTES, STAGE_BYTES = 2 * BM * BK * 2.
        assert_eq!(
            SMEM_BYTES,
            STAGES * 2 * define("BM") * define("AFDEP_GEMM_BK") * 2 + define("ATOM_BYTES")
        );
        assert_eq!(WS_TILE_M, define("WS_BM"));
        assert_eq!(WS_TILE_N, define("WS_BN"));
        assert_eq!(WS_TILE_K, define("WS_BK"));
        assert_eq!(WS_STAGES, define("WS_STAGES"));
        assert_eq!(WS_BLOCK as usize, define("WS_THREADS"));
        // WS_SMEM_DYN_BYTES = WS_STAGES * (WS_A_BYTES + WS_B_BYTES) + ATOM_BYTES.
        assert_eq!(
            WS_SMEM_BYTES,
            define("WS_STAGES") * (define("WS_BM") + define("WS_BN")) * define("WS_BK") * 2
                + define("ATOM_BYTES")
        );
        // The producer's and the consumers' registers fill what the launch gives 384 threads
        // at one block per SM (168 each, a multiple of 8 below 65,536 / 384).
        assert_eq!(
            128 * define("WS_PRODUCER_REGS") + 256 * define("WS_CONSUMER_REGS"),
            384 * 168
        );
        // The same for the ws weight-gradient kernel's split.
        assert_eq!(
            128 * define("WSK_PRODUCER_REGS") + 256 * define("WSK_CONSUMER_REGS"),
            384 * 168
        );
    }

    /// The weight gradients run on the ws kernel unless asked for the classic one;
    /// force_wgrad_engine overrides it on this thread, `None` gives the default back, and the
    /// rows engine's switch does not move it.
    #[test]
    fn wgrad_engine_is_ws_unless_forced() {
        assert_eq!(DEFAULT_WGRAD_ENGINE, Engine::Ws);
        let env = std::env::var_os("AFDEP_GEMM_WGRAD").is_none();
        if env {
            assert_eq!(wgrad_engine_for(), Engine::Ws);
        }
        force_engine(Some(Engine::Classic));
        if env {
            assert_eq!(wgrad_engine_for(), Engine::Ws);
        }
        force_engine(None);
        force_wgrad_engine(Some(Engine::Ws));
        assert_eq!(wgrad_engine_for(), Engine::Ws);
        force_wgrad_engine(Some(Engine::Classic));
        assert_eq!(wgrad_engine_for(), Engine::Classic);
        force_wgrad_engine(None);
        if env {
            assert_eq!(wgrad_engine_for(), DEFAULT_WGRAD_ENGINE);
        }
    }

    /// The default engine is ws; force_engine overrides it on this thread and `None` gives
    /// the default back.
    #[test]
    fn default_engine_and_its_override() {
        if std::env::var_os("AFDEP_GEMM_ENGINE").is_none() {
            assert_eq!(engine_for(), DEFAULT_ENGINE);
        }
        force_engine(Some(Engine::Classic));
        assert_eq!(engine_for(), Engine::Classic);
        force_engine(Some(Engine::Ws));
        assert_eq!(engine_for(), Engine::Ws);
        force_engine(None);
        if std::env::var_os("AFDEP_GEMM_ENGINE").is_none() {
            assert_eq!(engine_for(), Engine::Ws);
        }
    }
}
