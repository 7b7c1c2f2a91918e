//! Launchers of the fused exchange kernels of payload-first rounds (`fused_dispatch.cu`,
//! `fused_epilogue.cu`) and of the combine of every arm and of device rounds
//! (`fused_combine.cu`: [`combine_reduce`], [`combine`]).
//!
//! These kernels store into other ranks' memory through a **peer table**: the device address of
//! a `u64[world]` array whose entry r is rank r's workspace base, valid in this context (what
//! `afdep_transport::NvlinkIpc::workspace_peer_table` gives). Kernels know nothing else about
//! the transport. Workspace offsets (`slab_off`, flag offsets, `ret_off`) are bytes from a
//! workspace base and are the same on every rank (symmetric workspace); the layout is the fused
//! engine's (`afdep_moe::fused`).
//!
//! With hidden a multiple of 8 the combine uses 16-byte loads and stores, which need 16-byte
//! aligned bases: the callers' buffers come from the device allocator, and the workspace's areas
//! sit at 256-byte aligned offsets of a 256-byte aligned workspace (`FusedEngine::new` checks
//! it). With any other hidden size its element path runs.
//!
//! Waiting kernels ([`copy_epilogue`], [`combine`]) spin on flags at system scope for at most
//! `timeout_ns` (`%globaltimer`), then record a fault in the error word (`u32[4]`:
//! `{code, peer rank, round, 0}`, codes in [`fault`]) and leave: no trap, no hang. Their grid is
//! capped by the caller (`blocks`): ranks that share a GPU must leave SMs for each other's
//! kernels while they wait.
//!
//! Payloads: one launcher per step for both kinds. [`dispatch`] and [`copy_epilogue`] move
//! bf16 rows; with fp8 payloads [`dispatch`] quantises each row while it stores it into the slab
//! (e4m3 codes and one f32 scale per 128 channels, `cuda/common/fp8.cuh`, bit for bit
//! [`afdep_core::fp8`]) and [`copy_epilogue`] expands codes and scales into the expanded layout
//! along with the dequantised bf16 rows ([`Expanded::Fp8`]). The payload kind is a compile-time
//! constant of the kernels (one entry per kind); the slab row layout of each is
//! [`slab_payload_bytes`] + the metadata.
//!
//! # Safety of the launchers
//!
//! The launchers of this module, [`super::fused_cf`] and [`super::fused_round`] take device
//! addresses (`u64`) the kernels read and write, in this rank's workspace and, through the peer
//! table, in other ranks' workspaces. What the buffers passed as `CudaSlice`s need is checked;
//! what the addresses need only the caller can promise, so these launchers are `unsafe fn`. Their
//! `# Safety` sections use these terms, each valid in `ctx`'s context and not freed or reused
//! until the launched work has finished on `ctx`'s stream:
//!
//! - a **live workspace** `ws`: the base of this rank's workspace, 256-byte aligned, large
//!   enough for every area the geometry arguments name (the slabs of a [`SlabGeometry`], the
//!   count-first areas of a [`super::fused_layout::FusedLayout`], flag areas of one `u32` per rank at the
//!   flag offsets, return areas at `ret_off`), laid out the same in every rank's workspace;
//! - a **live peer table** `peers`: a `u64[world]` whose entry r is the base of rank r's
//!   workspace mapped into this context, each a live workspace of the same layout; every rank a
//!   launcher is given (a rank list, `me`) is below `world`;
//! - a **live control block** `ctl`: a round control block of `CTL_WORDS` `u32`
//!   ([`super::fused_round`]: the control block in the workspace or one of its arm gates);
//! - a **live error word** `err`: a writable `u32[4]`.
//!
//! [`RankAddrs`] bundles the four addresses of one rank (with its rank and wait bound) for the
//! launchers that take them together.

use afdep_core::{CombinePartials, PayloadKind, bf16};
use cudarc::driver::{CudaSlice, PushKernelArg};

use super::fused_layout::{COMBINE_FLAGS, DISPATCH_FLAGS, FusedLayout};
use super::{as_u32, need};
use crate::context::{GpuContext, launch_err};
use crate::error::KernelError;
use crate::sources::{BLOCK, KernelId};

/// Fault codes of the fused kernels' error word (`layout/fused.cuh`).
pub mod fault {
    /// A copy epilogue's wait for a source's dispatch flag ran out (peer = that source).
    pub const DISPATCH_WAIT: u32 = 1;
    /// A combine's wait for an FFN rank's combine flag ran out (peer = that FFN rank).
    pub const COMBINE_WAIT: u32 = 2;
}

/// `u32` words of a slab row's metadata for top-k `k` (`AFDEP_FUSED_META_WORDS`): token, 0,
/// `k` local ids (i32), `k` weights (f32), `k` expanded rows (u64).
pub const fn meta_words(k: usize) -> usize {
    2 + 4 * k
}

/// An expanded row that does not exist (`AFDEP_FUSED_NO_ROW`).
pub const NO_ROW: u64 = u64::MAX;

/// Bytes of one slab row: the payload (`hidden` bf16) and the metadata, each rounded up to 16.
pub const fn slab_row_bytes(hidden: usize, k: usize) -> usize {
    (2 * hidden).div_ceil(16) * 16 + (4 * meta_words(k)).div_ceil(16) * 16
}

/// Bytes of the payload part of a slab row (where its metadata starts): `hidden` bf16, or
/// `hidden` e4m3 codes and `hidden / 128` f32 scales, each part rounded up to 16
/// (`afdep_fused_payload_bytes` in `layout/fused.cuh`).
pub const fn slab_payload_bytes(payload: PayloadKind, hidden: usize) -> usize {
    match payload {
        PayloadKind::Bf16 => (2 * hidden).div_ceil(16) * 16,
        PayloadKind::Fp8E4m3 => {
            hidden.div_ceil(16) * 16 + (4 * (hidden / afdep_core::fp8::GROUP)).div_ceil(16) * 16
        }
    }
}

/// Bytes of one slab row for a payload kind: the payload part and the metadata.
pub const fn slab_row_bytes_for(payload: PayloadKind, hidden: usize, k: usize) -> usize {
    slab_payload_bytes(payload, hidden) + (4 * meta_words(k)).div_ceil(16) * 16
}

/// Loads every fused kernel (payload-first with bf16 and fp8 payloads, count-first
/// ([`super::fused_cf`]) and the device round ([`super::fused_round`])) for `top_k` now (module
/// compiled or read from the cache, and each function loaded with `cuFuncLoad`), so that no launch
/// during a round loads one lazily: with CUDA's lazy loading, loading a kernel may synchronise the
/// context, which would deadlock against a kernel of another rank on the same GPU that spins
/// waiting for this rank's stores (the CUDA programming guide's lazy-loading caveat). Call it on
/// every rank, then a barrier, before the first round.
pub fn preload(ctx: &GpuContext, top_k: usize) -> Result<(), KernelError> {
    let k = as_u32("top_k", top_k)?;
    for id in PRELOADED
        .into_iter()
        .chain(super::fused_cf::KERNELS)
        .chain(super::fused_round::KERNELS)
        .chain(super::fused_front::KERNELS)
    {
        let f = fused_function(ctx, id, k)?;
        ctx.cuda()
            .bind_to_thread()
            .map_err(KernelError::driver("binding the context"))?;
        // SAFETY: f is a live function handle of a module this context keeps loaded.
        unsafe { cudarc::driver::sys::cuFuncLoad(f.cu_function()) }
            .result()
            .map_err(KernelError::driver(format!("loading {id}")))?;
    }
    Ok(())
}

/// The kernels of this module that [`preload`] loads (with those of `fused_cf` and
/// `fused_round`): every kernel a fused round may launch. A test checks the three lists against
/// the registry: a kernel missing here is loaded lazily in the middle of a round.
const PRELOADED: [KernelId; 9] = [
    KernelId::FusedDispatch,
    KernelId::FusedSignal,
    KernelId::FusedCopyEpilogue,
    KernelId::FusedCombineReduce,
    KernelId::FusedCombine,
    KernelId::FusedCombineReduceBf16,
    KernelId::FusedCombineBf16,
    KernelId::FusedDispatchFp8,
    KernelId::FusedCopyEpilogueFp8,
];

/// The function of fused kernel `id` for a round of top-k `k`, from the module its launcher
/// and [`preload`] both use (one rule, so that the preload loads exactly what rounds launch):
/// the kernels that do not depend on the top-k come from the K = 1 module of their
/// (top-k-specialised) source file, every other kernel from the module of `k` (0 for a source
/// file that is not specialised by top-k: every value gives the same module).
pub(super) fn fused_function(
    ctx: &GpuContext,
    id: KernelId,
    k: u32,
) -> Result<cudarc::driver::CudaFunction, KernelError> {
    let at_one = matches!(
        id,
        KernelId::CfPlan
            | KernelId::CfWait
            | KernelId::RoundBump
            | KernelId::RoundExperts
            | KernelId::RoundStamp
    );
    ctx.function(id, 0, if at_one { 1 } else { k })
}

/// Warps per block of every fused kernel (here, `fused_cf`, `fused_round`).
const WARPS: u64 = (BLOCK / 32) as u64;

/// The grid of a kernel with one warp per item: enough blocks for `rows` warps, at least one,
/// at most `cap` (the caller's SM budget), `BLOCK` threads each. Shared by every fused launcher.
pub(super) fn blocks_for(rows: u64, cap: u32) -> cudarc::driver::LaunchConfig {
    let b = rows.div_ceil(WARPS).clamp(1, u64::from(cap.max(1))) as u32;
    cudarc::driver::LaunchConfig {
        grid_dim: (b, 1, 1),
        block_dim: (BLOCK, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Threads per block of the two combine kernels (`AFDEP_COMBINE_BLOCK` in `fused_combine.cu`):
/// twice [`BLOCK`], so that each block of the SM budget keeps twice the loads in flight.
pub const COMBINE_BLOCK: u32 = 512;

/// [`blocks_for`] for the combine kernels' [`COMBINE_BLOCK`]-thread blocks.
fn combine_blocks_for(rows: u64, cap: u32) -> cudarc::driver::LaunchConfig {
    let warps = u64::from(COMBINE_BLOCK / 32);
    let b = rows.div_ceil(warps).clamp(1, u64::from(cap.max(1))) as u32;
    cudarc::driver::LaunchConfig {
        grid_dim: (b, 1, 1),
        block_dim: (COMBINE_BLOCK, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// One rank's device addresses for the fused kernels, typed: what the launchers' `# Safety`
/// sections call a live workspace (`ws`), a live peer table (`peers`), a live control block
/// (`ctl`) and a live error word (`err`), with the rank and the bound of every wait.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RankAddrs {
    /// This rank's workspace base.
    pub ws: u64,
    /// The device address of the peer table.
    pub peers: u64,
    /// This rank.
    pub me: usize,
    /// The control block the kernels read the round from.
    pub ctl: u64,
    /// The error word.
    pub err: u64,
    /// The bound of every wait, in nanoseconds.
    pub timeout_ns: u64,
}

impl RankAddrs {
    /// The same addresses with the control block `ctl` (a device round's arm gate).
    pub fn gated(self, ctl: u64) -> RankAddrs {
        RankAddrs { ctl, ..self }
    }
}

/// Where the slabs of one round live, the same on every rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlabGeometry {
    /// Byte offset of the slabs in every workspace (slab of source rank r, row i at
    /// `slab_off + (r * cap + i) * row_bytes`).
    pub slab_off: u64,
    /// Rows of one source's slab.
    pub cap: u32,
    /// Bytes of one slab row ([`slab_row_bytes`]).
    pub row_bytes: u64,
    /// Hidden size.
    pub hidden: u32,
}

/// The send list of one source for one round: row r sends token `token[r]` to rank
/// `dst_rank[r]`, row `slab_row[r]` of this source's slab there, with metadata
/// `meta[r * meta_words ..]`.
#[derive(Debug)]
pub struct SendList<'a> {
    /// Token index per send row.
    pub token: &'a CudaSlice<u32>,
    /// Destination rank per send row.
    pub dst_rank: &'a CudaSlice<u32>,
    /// Slab row per send row.
    pub slab_row: &'a CudaSlice<u32>,
    /// Metadata, `rows × meta_words` u32.
    pub meta: &'a CudaSlice<u32>,
    /// Send rows.
    pub rows: usize,
}

/// Whether the slab rows of `geo` hold `payload` rows of its hidden size and top-k `top_k`.
fn check_row_bytes(
    geo: &SlabGeometry,
    payload: PayloadKind,
    top_k: usize,
) -> Result<(), KernelError> {
    let hidden = geo.hidden as usize;
    if geo.row_bytes < slab_row_bytes_for(payload, hidden, top_k) as u64 {
        return Err(KernelError::Shape(format!(
            "slab rows of {} bytes cannot hold {payload} payloads of hidden {hidden} and top-k \
             {top_k}",
            geo.row_bytes
        )));
    }
    Ok(())
}

fn check_fp8_hidden(hidden: usize) -> Result<(), KernelError> {
    if hidden % afdep_core::fp8::GROUP != 0 {
        return Err(KernelError::Shape(format!(
            "fp8 payloads need hidden a multiple of 128, not {hidden}"
        )));
    }
    Ok(())
}

/// Payload-first dispatch (`afdep_fused_dispatch`, `afdep_fused_dispatch_fp8`, the workspace
/// layout passed by value): stores every send row (payload of `x`, `tokens × hidden`, then
/// metadata) into this source's (`r.me`) slab of its destination, through `r.peers` (the device
/// address of the peer table). The payload kind, hidden size and top-k are `layout`'s. At most
/// `blocks` blocks. fp8 payloads are quantised while they are stored (codes, then `hidden / 128`
/// scales, then the metadata; [`slab_row_bytes_for`]): `hidden` must be a multiple of 128 and
/// every row that is sent finite (the engine checks it on the host:
/// `RouteError::NonFinitePayload`).
///
/// # Safety
///
/// `r.peers` is a live peer table ([the launchers'
/// contract](crate::ops::fused#safety-of-the-launchers)); every `send.dst_rank` entry is below its
/// world, every `send.slab_row` entry below `layout.cap`, every `send.token` entry below `tokens`,
/// and every workspace holds the slabs of `layout` for every rank (`slab_off + world × cap ×
/// row_bytes` bytes).
pub unsafe fn dispatch(
    ctx: &GpuContext,
    x: &CudaSlice<bf16>,
    tokens: usize,
    send: &SendList<'_>,
    r: &RankAddrs,
    layout: &FusedLayout,
    blocks: u32,
) -> Result<(), KernelError> {
    if send.rows == 0 {
        return Ok(());
    }
    let (payload, top_k, geo) = (layout.payload_kind(), layout.top_k as usize, layout.slab());
    let hidden = geo.hidden as usize;
    let mw = meta_words(top_k);
    need("x", x, tokens * hidden)?;
    need("token", send.token, send.rows)?;
    need("dst_rank", send.dst_rank, send.rows)?;
    need("slab_row", send.slab_row, send.rows)?;
    need("meta", send.meta, send.rows * mw)?;
    check_row_bytes(&geo, payload, top_k)?;
    let id = match payload {
        PayloadKind::Bf16 => KernelId::FusedDispatch,
        PayloadKind::Fp8E4m3 => {
            check_fp8_hidden(hidden)?;
            KernelId::FusedDispatchFp8
        }
    };
    let rows = send.rows as u64;
    let mw = as_u32("meta words", mw)?;
    let me = as_u32("rank", r.me)?;
    let f = fused_function(ctx, id, 0)?;
    let mut b = ctx.stream().launch_builder(&f);
    b.arg(x)
        .arg(send.token)
        .arg(send.dst_rank)
        .arg(send.slab_row)
        .arg(send.meta)
        .arg(&mw)
        .arg(&rows)
        .arg(&r.peers)
        .arg(layout)
        .arg(&me);
    // SAFETY: afdep_fused_dispatch{,_fp8}(const u16* x, const u32* token, const u32* dst_rank,
    // const u32* slab_row, const u32* meta, u32 meta_words, u64 rows, const u64* peers,
    // afdep_fused_layout L (by value: FusedLayout, #[repr(C)], asserted equal in
    // layout/fused.cuh; its slab_off, cap, row_bytes, hidden), u32 me): warp r < rows reads x[token[r]]
    // (the caller's tokens are < `tokens`, x holds tokens × hidden, checked; fp8: hidden a
    // multiple of 128, checked, so 16-byte reads stay in the row of a cudaMalloc'd buffer) and
    // meta[r] (checked), and writes at most row_bytes bytes (enough for this payload and the
    // metadata, checked) at slab row (me, slab_row[r]) of the workspace peers[dst_rank[r]]; the
    // caller guarantees the peer table is live, that dst_rank < world, slab_row < cap, and that
    // every workspace holds the slabs of every rank.
    unsafe { b.launch(blocks_for(rows, blocks)) }.map_err(launch_err(id))?;
    Ok(())
}

/// Raises this rank's (`me`) flag to the round of the control block at device address `ctl`
/// ([`super::fused_round`]) at `flag_off` in the workspace of every rank of `ranks`
/// (`afdep_fused_signal`, release at system scope), after everything this stream did before;
/// nothing when the round is skipped.
///
/// # Safety
///
/// `peers` is a live peer table and `ctl` a live control block ([the launchers'
/// contract](crate::ops::fused#safety-of-the-launchers)); the first `n` entries of `ranks` are
/// below the peer table's world and every workspace holds `world` u32 flags at `flag_off`.
pub unsafe fn signal(
    ctx: &GpuContext,
    peers: u64,
    ranks: &CudaSlice<u32>,
    n: usize,
    flag_off: u64,
    me: usize,
    ctl: u64,
) -> Result<(), KernelError> {
    if n == 0 {
        return Ok(());
    }
    need("ranks", ranks, n)?;
    let n32 = as_u32("ranks", n)?;
    let me = as_u32("rank", me)?;
    let f = fused_function(ctx, KernelId::FusedSignal, 0)?;
    let mut b = ctx.stream().launch_builder(&f);
    b.arg(&peers)
        .arg(ranks)
        .arg(&n32)
        .arg(&flag_off)
        .arg(&me)
        .arg(&ctl);
    // SAFETY: afdep_fused_signal(const u64* peers, const u32* ranks, u32 n, u64 flag_off, u32
    // me, const u32* ctl): reads the caller's live control block; thread i < n (ranks holds n,
    // checked) stores 4 bytes at flag_off + 4 me of workspace peers[ranks[i]]; the caller
    // guarantees the ranks are < world and the flag area holds world u32.
    unsafe { b.launch(blocks_for(n.div_ceil(32) as u64, u32::MAX)) }
        .map_err(launch_err(KernelId::FusedSignal))?;
    Ok(())
}

/// The sources of one copy epilogue: their ranks and the exclusive prefix of their slab rows.
#[derive(Debug)]
pub struct EpilogueSources<'a> {
    /// Rank of each source, in source order.
    pub rank: &'a CudaSlice<u32>,
    /// `sources + 1` entries: slab row prefix (the compact view's source offsets).
    pub slab_starts: &'a CudaSlice<u64>,
    /// Number of sources.
    pub sources: usize,
    /// Total compact rows (`slab_starts[sources]`).
    pub total: u64,
    /// Rows of the expanded outputs (each output holds this many rows; a slot whose expanded
    /// row lies past them is not written).
    pub expanded_rows: usize,
}

/// The outputs of an fp8 [`copy_epilogue`]: `rows × hidden` codes, `rows × hidden / 128` scales
/// and `rows × hidden` dequantised bf16 values of the expanded layout.
#[derive(Debug)]
pub struct Fp8Expanded<'a> {
    /// e4m3 codes.
    pub q: &'a mut CudaSlice<u8>,
    /// f32 scales, one per 128 channels.
    pub scales: &'a mut CudaSlice<f32>,
    /// Dequantised rows (`bf16(f32(q) · scale)`).
    pub dequant: &'a mut CudaSlice<bf16>,
}

/// Where a [`copy_epilogue`] writes the expanded rows; the variant is the payload kind.
#[derive(Debug)]
pub enum Expanded<'a> {
    /// bf16 payloads: the rows.
    Bf16(&'a mut CudaSlice<bf16>),
    /// fp8 payloads: the codes, scales and dequantised rows.
    Fp8(Fp8Expanded<'a>),
}

/// The copy epilogue (`afdep_fused_copy_epilogue`, `afdep_fused_copy_epilogue_fp8`, the
/// slabs of `layout`): waits for every source's dispatch flag (`>= round`, at
/// [`DISPATCH_FLAGS`] of this rank's workspace `r.ws`, at most `r.timeout_ns`), then copies
/// every slab row's payload to the expanded rows its metadata names: bf16 rows, or the codes,
/// scales and dequantised values of fp8 payloads (`out` holds `src.expanded_rows` rows of each;
/// the caller's metadata names rows below that, and a row past them is not written). A timeout
/// records [`fault::DISPATCH_WAIT`] in `r.err`.
///
/// # Safety
///
/// `r.ws` is a live workspace and `r.err` a live error word ([the launchers'
/// contract](crate::ops::fused#safety-of-the-launchers)) that hold the slabs of `layout` and
/// `world` u32 flags at [`DISPATCH_FLAGS`]; every `src.rank` entry is below the world, and the
/// slab rows that `src.slab_starts` counts for each source are below `layout.cap` and hold the
/// metadata its dispatch stored.
pub unsafe fn copy_epilogue(
    ctx: &GpuContext,
    r: &RankAddrs,
    src: &EpilogueSources<'_>,
    layout: &FusedLayout,
    round: u32,
    mut out: Expanded<'_>,
    blocks: u32,
) -> Result<(), KernelError> {
    if src.sources == 0 {
        return Ok(());
    }
    let (geo, top_k, expanded_rows) = (layout.slab(), layout.top_k as usize, src.expanded_rows);
    let hidden = geo.hidden as usize;
    need("source ranks", src.rank, src.sources)?;
    need("slab starts", src.slab_starts, src.sources + 1)?;
    let (payload, id) = match &out {
        Expanded::Bf16(e) => {
            need("expanded", *e, expanded_rows * hidden)?;
            (PayloadKind::Bf16, KernelId::FusedCopyEpilogue)
        }
        Expanded::Fp8(o) => {
            check_fp8_hidden(hidden)?;
            need("expanded codes", o.q, expanded_rows * hidden)?;
            let scales = expanded_rows * (hidden / afdep_core::fp8::GROUP);
            need("expanded scales", o.scales, scales)?;
            need("expanded rows", o.dequant, expanded_rows * hidden)?;
            (PayloadKind::Fp8E4m3, KernelId::FusedCopyEpilogueFp8)
        }
    };
    check_row_bytes(&geo, payload, top_k)?;
    let k = as_u32("top_k", top_k)?;
    let ns = as_u32("sources", src.sources)?;
    let rows = expanded_rows as u64;
    let f = fused_function(ctx, id, k)?;
    let mut b = ctx.stream().launch_builder(&f);
    b.arg(&r.ws)
        .arg(src.rank)
        .arg(src.slab_starts)
        .arg(&ns)
        .arg(&DISPATCH_FLAGS)
        .arg(&layout.slab_off)
        .arg(&layout.cap)
        .arg(&layout.row_bytes)
        .arg(&layout.hidden)
        .arg(&round)
        .arg(&r.timeout_ns)
        .arg(&r.err);
    match &mut out {
        Expanded::Bf16(e) => b.arg(&mut **e),
        Expanded::Fp8(o) => b.arg(&mut *o.q).arg(&mut *o.scales).arg(&mut *o.dequant),
    };
    b.arg(&rows);
    // (The copy epilogues take the layout's slab fields as scalars, not the struct: by value it
    // costs the fp8 entry at K = 1 an 8-byte spill under NVRTC 13.0, `cargo xtask kernels`.)
    // SAFETY: afdep_fused_copy_epilogue(const u8* ws, const u32* src_rank, const u64*
    // slab_starts, u32 sources, u64 flag_off, u64 slab_off, u32 cap, u64 row_bytes, u32 hidden,
    // u32 round, u64 timeout_ns, u32* err, u16* expanded, u64 exp_rows) with K compiled in (fp8:
    // afdep_fused_copy_epilogue_fp8 with u8* expanded_q, float* expanded_scales, u16* expanded
    // in place of expanded): thread 0 of each block reads the sources' flags of this rank's live
    // workspace; after they are raised, warp c < slab_starts[sources] reads slab row
    // (src_rank[s], c - slab_starts[s]) (< cap, the caller's counts; row_bytes holds the payload
    // and the metadata, checked) and writes the expanded rows its metadata names that are below
    // exp_rows = expanded_rows (the kernel skips any other) of the outputs, which hold
    // expanded_rows rows each (checked; cudaMalloc'd, so fp8's 16-byte stores of rows of a
    // multiple of 128 channels are aligned); err is a live u32[4].
    unsafe { b.launch(blocks_for(src.total, blocks)) }.map_err(launch_err(id))?;
    Ok(())
}

/// What an FFN rank's combine reads of its round: the compact view in its slabs (each row's
/// metadata names the token, its slots' local experts, weights and expanded rows), where to
/// find the plan's numbers on the device, and the expert outputs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CompactView {
    /// The workspace layout: the slabs (source rank r, row i at `slab_off + (r cap + i)
    /// row_bytes`, the metadata at `meta_off` within a row) and the return areas (`ret_off`).
    pub layout: FusedLayout,
    /// Attention ranks of the round, the slabs' sources in order.
    pub sources: usize,
    /// Device address of the compact view's row offsets per source, `u64[sources + 1]`
    /// ([`afdep_core::layout::FfnPlan::slab_offsets`]).
    pub slab_offsets: u64,
    /// What the metadata's expanded rows are: the rows themselves, or positions in their
    /// (expert, source) blocks of the plan's block starts.
    pub block_starts: BlockStarts,
    /// Most compact rows of the round (the grid's size; the round's number is on the device).
    pub max_rows: u64,
    /// Device address of the expert outputs, `y_rows × hidden` bf16 in expanded order (a buffer
    /// of the caller's or the expanded area of its workspace).
    pub y: u64,
    /// Rows of the expert outputs.
    pub y_rows: usize,
}

/// What a compact view's metadata names as a slot's expanded row ([`CompactView`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlockStarts {
    /// The expanded row itself (the source arm; host-planned payload-first rounds).
    Final,
    /// The slot's position in its (expert, source) block, whose start is in the plan's block
    /// starts at this device address (`u64[experts_per_rank × sources]`,
    /// [`afdep_core::layout::FfnPlan::block_starts`]): the streaming and payload-first arms of
    /// device rounds.
    Relative(u64),
    /// As the round's arm says (an Auto round's one launch for every arm; the control block of
    /// the launch must be the control block itself, not an arm gate): [`BlockStarts::Final`]
    /// in the source arm, [`BlockStarts::Relative`] with these block starts in the others.
    ByArm(u64),
}

/// The FFN half of the combine (`afdep_fused_combine_reduce`, the workspace layout passed by
/// value): for every compact row of the round (source s, token t), the f32 partial sum of the
/// token's slots on this FFN rank (index `ffn`) over the expert outputs `view.y`, slots
/// ascending, each product and sum rounded, stored at `ret_off + (ffn cap + t) ret_row_bytes`
/// of workspace `r.peers[src_ranks[s]]`: as `hidden` f32, or, with the layout's bf16 partials
/// ([`afdep_core::CombinePartials::Bf16`]), rounded to `hidden` bf16 (nearest even). With
/// `signal`, the grid's last block then raises this rank's (`r.me`) combine flag
/// ([`COMBINE_FLAGS`]) in every source's workspace to the
/// round. Nothing when the control block `r.ctl`'s verdict is not go.
///
/// # Safety
///
/// `r.ws` is a live workspace, `r.peers` a live peer table and `r.ctl` a live control block
/// ([the launchers' contract](crate::ops::fused#safety-of-the-launchers)); `view.slab_offsets`
/// (and `view.block_starts` when `Some`) is the device address of a live `u64[sources + 1]`
/// (`u64[experts_per_rank × sources]`) whose counts keep every source's rows below
/// `view.layout.cap`; the metadata of those rows names expanded rows below `view.y_rows`;
/// `view.y` is the device address of `y_rows × hidden` live bf16; every `src_ranks` entry (at
/// least `view.sources`) is below the world, and every workspace holds `ffns × cap` return rows
/// of `view.layout.ret_row_bytes` at `view.layout.ret_off` with `ffn` below `ffns` (and
/// `MAX_WORLD` flags at `COMBINE_FLAGS`, `r.me` below it).
pub unsafe fn combine_reduce(
    ctx: &GpuContext,
    r: &RankAddrs,
    view: &CompactView,
    src_ranks: &CudaSlice<u32>,
    ffn: usize,
    blocks: u32,
    signal: bool,
) -> Result<(), KernelError> {
    // no rows and no flag to raise: nothing to launch (a flag to raise needs the launch even
    // for an empty round)
    if view.sources == 0 || (view.max_rows == 0 && !signal) {
        return Ok(());
    }
    need("src ranks", src_ranks, view.sources)?;
    if view.y_rows > 0 && view.y == 0 {
        return Err(KernelError::Shape(format!(
            "{} expert output rows at a null address",
            view.y_rows
        )));
    }
    let ns = as_u32("sources", view.sources)?;
    let k = view.layout.top_k;
    let ffn = as_u32("ffn index", ffn)?;
    let me = as_u32("rank", r.me)?;
    let sig_off = if signal {
        super::fused_layout::COMBINE_FLAGS
    } else {
        u64::MAX
    };
    let y_rows = view.y_rows as u64;
    // afdep_fused_combine_reduce's rel: 0 final rows, 1 block positions, 2 (AFDEP_REL_BY_ARM)
    // by the round's arm
    let (rel, bs) = match view.block_starts {
        BlockStarts::Final => (0u32, view.slab_offsets),
        BlockStarts::Relative(a) => (1, a),
        BlockStarts::ByArm(a) => (2, a),
    };
    // one entry per kind of partials
    let id = match view.layout.partials_kind() {
        CombinePartials::F32 => KernelId::FusedCombineReduce,
        CombinePartials::Bf16 => KernelId::FusedCombineReduceBf16,
    };
    let f = fused_function(ctx, id, k)?;
    let mut b = ctx.stream().launch_builder(&f);
    b.arg(&r.ws)
        .arg(&r.ctl)
        .arg(&r.peers)
        .arg(src_ranks)
        .arg(&ns)
        .arg(&view.slab_offsets)
        .arg(&bs)
        .arg(&rel)
        .arg(&view.layout)
        .arg(&view.y)
        .arg(&y_rows)
        .arg(&ffn)
        .arg(&me)
        .arg(&sig_off);
    // SAFETY: afdep_fused_combine_reduce(_bf16)(const u8* ws, const u32* ctl, const u64* peers,
    // const u32* src_rank, u32 ns, const u64* so, const u64* bs, u32 rel, afdep_fused_layout L (by
    // value, asserted equal in layout/fused.cuh; its slab_off, cap, row_bytes, meta_off,
    // ret_off, ret_row_bytes, hidden), const u16* y, u64 y_rows, u32 f, u32 me, u64 sig_off)
    // with K compiled in (sig_off: COMBINE_FLAGS or u64::MAX, AFDEP_NO_COMBINE_SIGNAL): reads the live control block, the caller's plan numbers (so: sources + 1,
    // bs: epr × sources when rel), the metadata of the slab rows they count (the caller's plan
    // keeps them within each source's cap rows of this rank's workspace), y rows below y_rows
    // (the caller's y holds y_rows × hidden: a live buffer or its workspace's expanded area),
    // and writes return row (f, t < cap) (ret_row_bytes: hidden f32, or hidden bf16 for the
    // _bf16 entry, which the layout's bf16 partials pick) of workspaces of the live peer table,
    // which hold ffns × cap such rows (the caller's geometry); with a signal, the last block
    // writes flag me (< MAX_WORLD) at COMBINE_FLAGS of each source's workspace; the ticket word
    // is the control block's own.
    unsafe { b.launch(combine_blocks_for(view.max_rows, blocks)) }.map_err(launch_err(id))?;
    Ok(())
}

/// One source's combine inputs: its routes (`tokens × top_k` expert ids, validated; expert e
/// is on FFN index `e / experts_per_rank`) and the FFN ranks. The buffers hold `tokens` tokens;
/// the round's count (at most that) is the control block's.
#[derive(Debug)]
pub struct CombineRoutes<'a> {
    /// `tokens × top_k` expert ids (masked slots negative).
    pub idx: &'a CudaSlice<i32>,
    /// The FFN ranks, ascending (at least `ffns`).
    pub ffn_ranks: &'a CudaSlice<u32>,
    /// FFN ranks (at most 64).
    pub ffns: usize,
    /// Experts per FFN rank.
    pub experts_per_rank: usize,
    /// Tokens the buffers hold (the grid's size; the round's count comes from the control
    /// block).
    pub tokens: usize,
}

/// The source half of the combine (`afdep_fused_combine`, the workspace layout passed by
/// value): waits for every FFN rank's combine flag (`>=` the round of the control block
/// `r.ctl`, which also gives the token count; nothing when skipped), at [`COMBINE_FLAGS`] of
/// this rank's workspace `r.ws`, at most `r.timeout_ns`), then writes `out` (`tokens × hidden`
/// bf16): the partials of the FFN ranks that own a slot of the token (return area at
/// `layout.ret_off`, by FFN index; f32, or bf16 widened to f32 with the layout's bf16
/// partials), ascending, summed in f32, cast once. A timeout records [`fault::COMBINE_WAIT`] in
/// `r.err`.
///
/// # Safety
///
/// `r.ws` is a live workspace, `r.ctl` a live control block (its token count at most
/// `routes.tokens`) and `r.err` a live error word ([the launchers'
/// contract](crate::ops::fused#safety-of-the-launchers)); the workspace holds `world` u32 flags
/// at [`COMBINE_FLAGS`] and `ffns × layout.cap` return rows of `layout.ret_row_bytes` at
/// `layout.ret_off`.
pub unsafe fn combine(
    ctx: &GpuContext,
    r: &RankAddrs,
    routes: &CombineRoutes<'_>,
    layout: &FusedLayout,
    out: &mut CudaSlice<bf16>,
    blocks: u32,
) -> Result<(), KernelError> {
    if routes.tokens == 0 {
        return Ok(());
    }
    let (ffn_ranks, ffns) = (routes.ffn_ranks, routes.ffns);
    let (top_k, hidden) = (layout.top_k as usize, layout.hidden as usize);
    if ffns > 64 {
        return Err(KernelError::Unsupported(format!(
            "{ffns} FFN ranks: the combine supports at most 64"
        )));
    }
    need("ffn ranks", ffn_ranks, ffns)?;
    need("routes", routes.idx, routes.tokens * top_k)?;
    need("out", out, routes.tokens * hidden)?;
    let nf = as_u32("ffns", ffns)?;
    let epr = as_u32("experts per rank", routes.experts_per_rank.max(1))?;
    let t = routes.tokens as u64;
    let id = match layout.partials_kind() {
        CombinePartials::F32 => KernelId::FusedCombine,
        CombinePartials::Bf16 => KernelId::FusedCombineBf16,
    };
    let f = fused_function(ctx, id, layout.top_k)?;
    let mut b = ctx.stream().launch_builder(&f);
    b.arg(&r.ws)
        .arg(ffn_ranks)
        .arg(&nf)
        .arg(&COMBINE_FLAGS)
        .arg(layout)
        .arg(routes.idx)
        .arg(&epr)
        .arg(&r.ctl)
        .arg(&r.timeout_ns)
        .arg(&r.err)
        .arg(out);
    // SAFETY: afdep_fused_combine(_bf16)(const u8* ws, const u32* ffn_rank, u32 ffns, u64
    // flag_off, afdep_fused_layout L (by value, asserted equal in layout/fused.cuh; its ret_off,
    // ret_row_bytes, cap, hidden; the _bf16 entry, which the layout's bf16 partials pick, reads
    // rows of hidden bf16), const i32* idx, u32 epr, const u32* ctl, u64 timeout_ns, u32* err, u16* out)
    // with K compiled in: reads the caller's live control
    // block, whose token count the caller keeps at most `routes.tokens` (the kernel also stops
    // at cap); thread 0 of each block reads the FFN ranks' flags of this rank's live workspace;
    // then warp t reads K route ids (the buffer holds routes.tokens × K, checked), the return
    // rows (f < ffns, t < cap) of this workspace, which holds ffns × cap of them (the caller's
    // geometry), and writes out[t] (routes.tokens × hidden, checked); err is a live u32[4].
    unsafe { b.launch(combine_blocks_for(t, blocks)) }.map_err(launch_err(id))?;
    Ok(())
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    /// Every kernel of the fused round's source files is preloaded: a round launches no kernel
    /// whose function is loaded lazily (the stamp kernel was missing until 2026-12-06, and the
    /// traced rounds on one GPU timed out on the device). The module each one comes from is
    /// [`fused_function`]'s, for the launchers and the preload alike.
    #[test]
    fn preload_covers_every_fused_kernel() {
        use crate::sources::SourceFile as S;
        let loaded: Vec<KernelId> = PRELOADED
            .into_iter()
            .chain(super::super::fused_cf::KERNELS)
            .chain(super::super::fused_round::KERNELS)
            .chain(super::super::fused_front::KERNELS)
            .collect();
        let fused = [
            S::FusedDispatch,
            S::FusedEpilogue,
            S::FusedCombine,
            S::FusedCounts,
            S::FusedCfDispatch,
            S::FusedStreamEpilogue,
            S::FusedRound,
            S::FusedFront,
        ];
        for id in KernelId::ALL {
            if fused.contains(&id.source()) {
                assert!(loaded.contains(&id), "{id:?} is not preloaded");
            }
        }
    }

    /// The value of `#define name` in `layout/fused.cuh` (the header tests of every fused
    /// launcher module compare their constants with it).
    pub(in crate::ops) fn define(name: &str) -> String {
        define_in(include_str!("../../cuda/layout/fused.cuh"), name)
    }

    /// The value of `#define name` in the CUDA source `text`.
    pub(in crate::ops) fn define_in(text: &str, name: &str) -> String {
        let line = text
            .lines()
            .find(|l| l.starts_with(&format!("#define {name} ")))
            .unwrap_or_else(|| panic!("#define {name} not found"));
        line[format!("#define {name} ").len()..].trim().to_string()
    }

    #[test]
    fn header_constants_match() {
        assert_eq!(define("AFDEP_FUSED_META_WORDS(K)"), "(2 + 4 * (K))");
        assert_eq!(meta_words(3), 14);
        assert_eq!(define("AFDEP_FUSED_NO_ROW"), "0xffffffffffffffffull");
        assert_eq!(
            define("AFDEP_FUSED_FAULT_DISPATCH_WAIT"),
            format!("{}u", fault::DISPATCH_WAIT)
        );
        assert_eq!(
            define("AFDEP_FUSED_FAULT_COMBINE_WAIT"),
            format!("{}u", fault::COMBINE_WAIT)
        );
        assert_eq!(slab_row_bytes(24, 3), 48 + 64);
        assert_eq!(slab_row_bytes(8, 1), 16 + 32);
        assert_eq!(define("AFDEP_PAYLOAD_BF16"), "0");
        let combine = include_str!("../../cuda/fused_combine.cu");
        assert!(combine.contains(&format!("#define AFDEP_COMBINE_BLOCK {COMBINE_BLOCK}\n")));
        assert_eq!(define("AFDEP_PAYLOAD_FP8"), "1");
        for (h, k) in [(24, 3), (2048, 8), (7168, 8)] {
            assert_eq!(
                slab_row_bytes_for(PayloadKind::Bf16, h, k),
                slab_row_bytes(h, k)
            );
        }
        // hidden 384: 384 codes, 3 scales (12 bytes, padded to 16), K = 3 metadata (56 → 64)
        assert_eq!(slab_payload_bytes(PayloadKind::Fp8E4m3, 384), 384 + 16);
        assert_eq!(
            slab_row_bytes_for(PayloadKind::Fp8E4m3, 384, 3),
            384 + 16 + 64
        );
        // hidden 7168: 7168 + 224 bytes against 14336 for bf16
        assert_eq!(slab_payload_bytes(PayloadKind::Fp8E4m3, 7168), 7168 + 224);
    }
}
