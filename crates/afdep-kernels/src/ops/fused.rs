//! Launchers of the combine of the fused exchange, every arm (`fused_combine.cu`:
//! [`combine_reduce`], [`combine`]), and what every fused launcher shares: the slab row format
//! ([`slab_row_bytes_for`]), the error word's fault codes ([`fault`]), the rank addresses
//! ([`RankAddrs`]), the preload of every fused kernel ([`preload`]). The rows themselves are
//! stored and expanded by the count-first kernels of every arm ([`super::fused_cf`],
//! [`super::fused_front`]).
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
//! Waiting kernels ([`combine`], and those of `fused_cf`, `fused_round` and `fused_front`) spin
//! on flags at system scope for at most `timeout_ns` (`%globaltimer`), then record a fault in
//! the error word (`u32[4]`: `{code, peer rank, round, 0}`, codes in [`fault`]) and leave: no
//! trap, no hang. Their grid is capped by the caller (`blocks`): ranks that share a GPU must
//! leave SMs for each other's kernels while they wait.
//!
//! Payloads: a slab row holds bf16 rows, or with fp8 payloads e4m3 codes and one f32 scale per
//! 128 channels (`cuda/common/fp8.cuh`, bit for bit [`afdep_core::fp8`]); the slab row layout of
//! each kind is [`slab_payload_bytes`] + the metadata.
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
//!   count-first areas of a [`super::fused_layout::FusedLayout`], flag areas of one `u32` per
//!   rank at the flag offsets, return areas at `ret_off`), laid out the same in every rank's
//!   workspace;
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

use super::fused_layout::{COMBINE_FLAGS, FusedLayout};
use super::{as_u32, need};
use crate::context::{GpuContext, launch_err};
use crate::error::KernelError;
use crate::sources::{BLOCK, KernelId};

/// Fault codes of the fused kernels' error word (`layout/fused.cuh`).
pub mod fault {
    /// A wait for a source's dispatch flag ran out (peer = that source): the code the device
    /// round passes to the plan's payload-first wait (`fused_cf::PlanWait`).
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

/// Bytes of the payload part of a slab row (where its metadata starts: the layout's
/// `meta_off`): `hidden` bf16, or `hidden` e4m3 codes and `hidden / 128` f32 scales, each part
/// rounded up to 16 (the slab row of `layout/fused.cuh`).
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

/// Loads every fused kernel (the combine, count-first ([`super::fused_cf`]), the device round
/// ([`super::fused_round`]) and the fronts ([`super::fused_front`])) for `top_k` now (module
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

/// The kernels of this module that [`preload`] loads (with those of `fused_cf`, `fused_round`
/// and `fused_front`): every kernel a fused round may launch. A test checks the four lists
/// against the registry: a kernel missing here is loaded lazily in the middle of a round.
const PRELOADED: [KernelId; 4] = [
    KernelId::FusedCombineReduce,
    KernelId::FusedCombine,
    KernelId::FusedCombineReduceBf16,
    KernelId::FusedCombineBf16,
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
            | KernelId::RoundExperts
            | KernelId::RoundStamp
            | KernelId::RoundStartGate
    );
    ctx.function(id, 0, if at_one { 1 } else { k })
}

/// Warps per block of every fused kernel but the combine (`fused_cf`, `fused_round`,
/// `fused_front`).
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
    /// The expanded row itself (the source arm).
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
