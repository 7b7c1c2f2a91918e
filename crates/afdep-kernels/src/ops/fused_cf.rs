//! Launchers of the count-first exchange kernels: `fused_counts.cu`, `fused_cf_dispatch.cu`,
//! `fused_stream_epilogue.cu` (the count-first area of `layout/fused.cuh`).
//!
//! Like [`super::fused`], these kernels store into other ranks' workspaces through a peer table
//! (the device address of a `u64[world]` array of workspace bases) and take byte offsets that
//! are the same in every workspace ([`FusedLayout`]). Every wait is bounded by `timeout_ns`
//! (`%globaltimer`); a wait that runs out records a fault in the error word (`u32[4]`:
//! `{code, peer rank, round, 0}`, codes in [`fault`]) and the kernel leaves.
//!
//! Payloads ([`FusedLayout::payload`]): bf16 rows, or fp8 e4m3 rows (one f32 scale per 128
//! channels, `cuda/common/fp8.cuh`, bit for bit [`afdep_core::fp8`]). With fp8, [`dispatch`]
//! quantises each row once while it stores it: streaming, codes and scales into the slab row
//! (the payload-first fp8 row format); source arm, codes and scales into the final expanded
//! rows' code and scale areas ([`FusedLayout::exp_q`], [`FusedLayout::exp_scales`]), which [`dequant`]
//! turns into the bf16 expanded rows on the FFN rank. [`stream_epilogue`] expands codes,
//! scales and the dequantised bf16 rows. The payload kind is a compile-time constant of the
//! kernels (one entry per kind).

use afdep_core::{PayloadKind, bf16};
use cudarc::driver::{CudaSlice, PushKernelArg};

use super::fused::{RankAddrs, SlabGeometry, fused_function};
use super::fused_layout::FusedLayout;
use super::{as_u32, need};
use crate::context::{GpuContext, launch_err};
use crate::error::KernelError;
use crate::sources::{BLOCK, KernelId};

/// Fault codes of the count-first waits (`layout/fused.cuh`).
pub mod fault {
    /// An FFN rank's wait for a source's counts ran out (peer = that source).
    pub const COUNTS_WAIT: u32 = 16;
    /// A source's wait for an FFN rank's offsets ran out (peer = that FFN rank).
    pub const OFFSETS_WAIT: u32 = 17;
    /// The streaming epilogue's wait for a row ran out (peer = the row's source).
    pub const ROW_WAIT: u32 = 18;
    /// An FFN rank's wait for a source's dispatch flag (source arm) ran out (peer = that
    /// source).
    pub const SOURCE_WAIT: u32 = 19;
}

/// The kernels of this module, for [`super::fused::preload`].
pub const KERNELS: [KernelId; 8] = [
    KernelId::CfCounts,
    KernelId::CfPlan,
    KernelId::CfWait,
    KernelId::CfDispatch,
    KernelId::CfStreamEpilogue,
    KernelId::CfDispatchFp8,
    KernelId::CfStreamEpilogueFp8,
    KernelId::CfDequant,
];

use super::fused::blocks_for as grid;

/// `sig_off` of a dispatch that raises no dispatch flags (`AFDEP_CF_NO_SIGNAL`).
const NO_SIGNAL: u64 = u64::MAX;

/// The rows, routes and device scratch of one source's round.
#[derive(Debug)]
pub struct CfSource<'a> {
    /// Tokens the buffers hold (the grid's size); the round's count, at most that, is the
    /// control block's ([`super::fused_round`]).
    pub tokens: usize,
    /// `tokens × hidden` rows (what [`dispatch`] sends).
    pub x: &'a CudaSlice<bf16>,
    /// `tokens × top_k` expert ids (validated).
    pub idx: &'a CudaSlice<i32>,
    /// `tokens × top_k` weights.
    pub weight: &'a CudaSlice<f32>,
    /// `tokens × top_k`: each slot's position in its (expert, source) block.
    pub slot_pos: &'a CudaSlice<u32>,
    /// `tokens × ffns`: each (token, FFN rank)'s slab row, `u32::MAX` for none.
    pub tok_row: &'a CudaSlice<u32>,
    /// `ffns × epr + ffns`: rows per owned expert, then distinct tokens per FFN rank.
    pub counts: &'a CudaSlice<u64>,
}

/// The counts kernel of source `r.me` (`afdep_cf_counts`): fills `src.slot_pos`, `src.tok_row`
/// and `src.counts` from `src.idx` (every expert id -1 or below `ffns.count × epr`) for the
/// token count of the control block at `r.ctl` (nothing when the round is skipped), then
/// publishes them: the grid's last block stores each FFN rank's share (its local experts'
/// counts and this source's distinct tokens for it) into row `r.me` of that rank's counts area
/// (through the peer table `r.peers`) and raises this source's count flag there to the round.
/// At most `blocks` blocks.
///
/// # Safety
///
/// `r.peers` is a live peer table and `r.ctl` a live control block ([the launchers'
/// contract](crate::ops::fused#safety-of-the-launchers)) whose token count is at most
/// `src.tokens`; the first `ffns.count` entries of `ffns.ranks` and `r.me` are below the world,
/// and every workspace holds the count-first areas of `areas` (a counts row and a flag for every
/// rank).
pub unsafe fn counts(
    ctx: &GpuContext,
    src: &CfSource<'_>,
    ffns: &FfnRanks<'_>,
    r: &RankAddrs,
    top_k: usize,
    areas: &FusedLayout,
    blocks: u32,
) -> Result<(), KernelError> {
    let (nf_us, epr) = (ffns.count, ffns.experts_per_rank);
    let n = src.tokens * top_k;
    need("idx", src.idx, n)?;
    need("slot positions", src.slot_pos, n.max(1))?;
    need("token rows", src.tok_row, (src.tokens * nf_us).max(1))?;
    need("counts", src.counts, nf_us * epr + nf_us)?;
    need("ffn ranks", ffns.ranks, nf_us)?;
    let k = as_u32("top_k", top_k)?;
    let nf = as_u32("ffns", nf_us)?;
    let e = as_u32("experts per rank", epr)?;
    let me = as_u32("rank", r.me)?;
    as_u32("owned experts", nf_us * epr)?;
    let f = fused_function(ctx, KernelId::CfCounts, k)?;
    let mut b = ctx.stream().launch_builder(&f);
    b.arg(src.idx)
        .arg(&r.ctl)
        .arg(&nf)
        .arg(&e)
        .arg(src.slot_pos)
        .arg(src.tok_row)
        .arg(src.counts)
        .arg(&r.peers)
        .arg(ffns.ranks)
        .arg(areas)
        .arg(&me);
    // SAFETY: afdep_cf_counts(const i32* idx, const u32* ctl, u32 nf, u32 epr, u32* slot_pos,
    // u32* tok_row, u64* counts, const u64* peers, const u32* ffn_rank, afdep_fused_layout L (by
    // value, asserted equal to FusedLayout), u32 me) with K compiled in: reads the caller's live
    // control block (its token count at most src.tokens; the ticket word is the kernel's own)
    // and idx (tokens × K, checked); warp w < nf epr + nf writes slot_pos entries of its
    // expert's slots (tokens × K, checked), tok_row[t nf + f] (tokens × nf, checked) and
    // counts[w] (nf epr + nf, checked); the last block reads counts and ffn_rank (nf, checked)
    // and writes epr + 1 u64 at row me of the counts area and one u32 flag of workspace
    // peers[ffn_rank[f]] for every f < nf; the caller guarantees a live peer table, ranks below
    // world and areas that hold world rows.
    unsafe { b.launch(grid((nf_us * epr + nf_us) as u64, blocks)) }
        .map_err(launch_err(KernelId::CfCounts))?;
    Ok(())
}

/// A wait [`plan`] does before the count flags' (what a separate [`wait`] launch did before it
/// in a payload-first round).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PlanWait {
    /// None.
    None,
    /// For every source's dispatch flag ([`DISPATCH_FLAGS`](super::fused_layout::DISPATCH_FLAGS)),
    /// a timeout recorded as `code`: the payload-first arm.
    Dispatch {
        /// The fault code of a wait that runs out.
        code: u32,
    },
    /// The same, only when the round takes the payload-first arm (an Auto round's one launch
    /// for every arm; `r.ctl` must be the control block itself, not an arm gate).
    DispatchIfPayloadFirst {
        /// The fault code of a wait that runs out.
        code: u32,
    },
}

/// The FFN rank's (`r.me`) plan (`afdep_cf_plan`): first the wait `pre` asks for (skipped when
/// `r.err` already holds a fault; its outcome does not stop the plan), then waits for every source's count flag (at
/// least the round of the control block at `r.ctl`, at most `r.timeout_ns` each; a timeout
/// records [`fault::COUNTS_WAIT`] in `r.err`; nothing when the round is skipped), writes the plan
/// into its workspace `r.ws` and publishes each source's block starts and offset flag through
/// `r.peers`. `src_ranks` holds `sources` ranks, in source order.
///
/// # Safety
///
/// `r.ws` is a live workspace, `r.peers` a live peer table, `r.ctl` a live control block and
/// `r.err` a live error word ([the launchers'
/// contract](crate::ops::fused#safety-of-the-launchers)); every workspace holds the count-first
/// areas of `areas` for `sources` sources and `epr` local experts; the first `sources` entries of
/// `src_ranks` and `r.me` are below the world.
pub unsafe fn plan(
    ctx: &GpuContext,
    r: &RankAddrs,
    src_ranks: &CudaSlice<u32>,
    sources: usize,
    epr: usize,
    areas: &FusedLayout,
    pre: PlanWait,
) -> Result<(), KernelError> {
    need("source ranks", src_ranks, sources)?;
    let ns = as_u32("sources", sources)?;
    let e = as_u32("experts per rank", epr)?;
    let me = as_u32("rank", r.me)?;
    let (pre_mode, pre_code) = plan_wait_args(pre);
    let pre_off = super::fused_layout::DISPATCH_FLAGS;
    let f = fused_function(ctx, KernelId::CfPlan, 1)?;
    let mut b = ctx.stream().launch_builder(&f);
    b.arg(&r.ws)
        .arg(&r.peers)
        .arg(src_ranks)
        .arg(&ns)
        .arg(&e)
        .arg(areas)
        .arg(&me)
        .arg(&r.ctl)
        .arg(&r.timeout_ns)
        .arg(&r.err)
        .arg(&pre_mode)
        .arg(&pre_off)
        .arg(&pre_code);
    // SAFETY: afdep_cf_plan(u8* ws, const u64* peers, const u32* src_rank, u32 ns, u32 epr,
    // afdep_fused_layout L (by value, asserted equal to FusedLayout), u32 me, const u32* ctl (the
    // caller's live control block),
    // u64 timeout_ns, u32* err, u32 pre, u64 pre_off, u32 pre_code), one block: reads the
    // dispatch flags (pre_off, MAX_WORLD flags in every workspace) and the count flags and counts rows of src_rank[s] (ns
    // entries, checked) in this rank's live workspace, writes its plan (2 epr ns + epr + ns + 2
    // u64, which the caller's geometry provides), row me of each source's offsets area (epr u64)
    // and one flag there; the caller guarantees a live peer table and ranks below world; err
    // is a live u32[4].
    unsafe { b.launch(grid(1, 1)) }.map_err(launch_err(KernelId::CfPlan))?;
    Ok(())
}

/// A bounded wait (`afdep_cf_wait`): for every rank `ranks[i]`, `i < n`, waits until its flag
/// at `flag_off` of this rank's workspace `r.ws` is `>=` the round of the control block at
/// `r.ctl` (at most `r.timeout_ns` each; nothing when the round is skipped); a timeout records
/// `code` naming that rank in `r.err`.
///
/// # Safety
///
/// `r.ws` is a live workspace, `r.ctl` a live control block and `r.err` a live error word
/// ([the launchers' contract](crate::ops::fused#safety-of-the-launchers)); the first `n` entries of
/// `ranks` are below the world and the workspace holds `world` u32 flags at `flag_off`.
pub unsafe fn wait(
    ctx: &GpuContext,
    r: &RankAddrs,
    ranks: &CudaSlice<u32>,
    n: usize,
    flag_off: u64,
    code: u32,
) -> Result<(), KernelError> {
    if n == 0 {
        return Ok(());
    }
    need("ranks", ranks, n)?;
    let n = as_u32("ranks", n)?;
    let f = fused_function(ctx, KernelId::CfWait, 1)?;
    let mut b = ctx.stream().launch_builder(&f);
    b.arg(&r.ws)
        .arg(ranks)
        .arg(&n)
        .arg(&flag_off)
        .arg(&r.ctl)
        .arg(&r.timeout_ns)
        .arg(&r.err)
        .arg(&code);
    // SAFETY: afdep_cf_wait(const u8* ws, const u32* ranks, u32 n, u64 flag_off, const u32* ctl
    // (the caller's live control block), u64
    // timeout_ns, u32* err, u32 code): one thread reads n ranks (checked) and their u32 flags
    // in this rank's live workspace (the caller's flag area holds world u32); err is a live
    // u32[4].
    unsafe { b.launch(grid(1, 1)) }.map_err(launch_err(KernelId::CfWait))?;
    Ok(())
}

/// Which rows a [`dispatch`] stores.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CfMode {
    /// The source arm: waits for the offsets, then stores rows to their final expanded rows
    /// and the compact view's metadata into the slabs, then raises the dispatch flags.
    Source,
    /// Rows (payload and metadata with block positions) into the slabs, each followed by its
    /// row flag (the streaming epilogue's cue).
    Stream {
        /// Wait for every FFN rank's offsets before the first store (the payload gate).
        gate: bool,
        /// Then raise the dispatch flags (the payload-first arm of a device round, whose
        /// epilogue waits for them instead of the row flags).
        signal: bool,
    },
    /// An Auto round's one launch for every arm: the mode of the arm the round takes (read from
    /// the control block `r.ctl`, which must be the control block itself, not an arm gate):
    /// [`CfMode::Source`], count-first as `Stream { gate, signal: false }`, payload-first as
    /// `Stream { gate: false, signal: true }`.
    Auto {
        /// The count-first arm's payload gate.
        gate: bool,
    },
}

/// The kernel arguments `(mode, gate, sig_off)` of the row stores in `mode`
/// (`fused_cf_dispatch.cu`'s `AFDEP_CF_*`, the dispatch flags or `AFDEP_CF_NO_SIGNAL`).
pub(super) fn dispatch_mode(mode: CfMode) -> (u32, u32, u64) {
    let (m, gate, signal) = match mode {
        CfMode::Source => (0u32, 0u32, true),
        CfMode::Stream { gate, signal } => (1, u32::from(gate), signal),
        // the kernel drops the flags for the count-first arm
        CfMode::Auto { gate } => (2, u32::from(gate), true),
    };
    let sig_off = if signal {
        super::fused_layout::DISPATCH_FLAGS
    } else {
        NO_SIGNAL
    };
    (m, gate, sig_off)
}

/// The kernel arguments `(pre, pre_code)` of the plan's wait `pre` (`fused_counts.cu`'s
/// `AFDEP_PLAN_PRE_*`).
pub(super) fn plan_wait_args(pre: PlanWait) -> (u32, u32) {
    match pre {
        PlanWait::None => (0, 0),
        PlanWait::Dispatch { code } => (1, code),
        PlanWait::DispatchIfPayloadFirst { code } => (2, code),
    }
}

/// The sources an FFN rank receives from: their ranks (at least `count`, in source order) and
/// the FFN rank's local experts.
#[derive(Debug, Clone, Copy)]
pub struct SourceRanks<'a> {
    /// The attention ranks, in source order.
    pub ranks: &'a CudaSlice<u32>,
    /// Sources.
    pub count: usize,
    /// Local experts of the FFN rank.
    pub experts_per_rank: usize,
}

/// The FFN ranks a source sends to: their ranks (at least `count`) and experts per rank.
#[derive(Debug, Clone, Copy)]
pub struct FfnRanks<'a> {
    /// The FFN ranks, ascending.
    pub ranks: &'a CudaSlice<u32>,
    /// FFN ranks.
    pub count: usize,
    /// Local experts of each.
    pub experts_per_rank: usize,
}

/// The count-first row stores of source `r.me` (`afdep_cf_dispatch`, the workspace layout
/// passed by value): rows of `src.x` (`tokens × hidden`) by `src` (after [`counts`]), to the FFN
/// ranks `ffns` through `r.peers`; `r.ws` is this rank's workspace (offsets and offset flags).
/// A timeout of the offsets wait records [`fault::OFFSETS_WAIT`] in `r.err`. In the source
/// arm, and in a streaming mode with `signal`, the grid's last block then raises this source's
/// dispatch flag ([`DISPATCH_FLAGS`](super::fused_layout::DISPATCH_FLAGS)) in every FFN rank's
/// workspace to the round. At most `blocks` blocks.
///
/// # Safety
///
/// `r.ws` is a live workspace, `r.peers` a live peer table, `r.ctl` a live control block (its
/// token count at most `src.tokens`) and `r.err` a live error word ([the launchers'
/// contract](crate::ops::fused#safety-of-the-launchers)); every workspace has the layout `layout`
/// (its slabs and count-first areas; fp8: 16-byte aligned) and `MAX_WORLD` flags at
/// `DISPATCH_FLAGS`; the first `ffns.count` entries of `ffns.ranks` and `r.me` are below the
/// world; `src` holds what [`counts`] wrote for this round (slab rows below `layout.cap`).
pub unsafe fn dispatch(
    ctx: &GpuContext,
    src: &CfSource<'_>,
    ffns: &FfnRanks<'_>,
    r: &RankAddrs,
    layout: &FusedLayout,
    mode: CfMode,
    blocks: u32,
) -> Result<(), KernelError> {
    let (x, top_k) = (src.x, layout.top_k as usize);
    let (ffn_ranks, epr) = (ffns.ranks, ffns.experts_per_rank);
    let ffns = ffns.count;
    let (slab, areas) = (&layout.slab(), layout);
    let hidden = slab.hidden as usize;
    let n = src.tokens * top_k;
    need("x", x, src.tokens * hidden)?;
    need("idx", src.idx, n)?;
    need("weights", src.weight, n)?;
    need("slot positions", src.slot_pos, n)?;
    need("token rows", src.tok_row, src.tokens * ffns)?;
    need("ffn ranks", ffn_ranks, ffns)?;
    check_rows(slab, areas, top_k)?;
    let k = as_u32("top_k", top_k)?;
    let nf = as_u32("ffns", ffns)?;
    let e = as_u32("experts per rank", epr)?;
    let me = as_u32("rank", r.me)?;
    let (m, gate, sig_off) = dispatch_mode(mode);
    let id = match areas.payload_kind() {
        PayloadKind::Bf16 => KernelId::CfDispatch,
        PayloadKind::Fp8E4m3 => KernelId::CfDispatchFp8,
    };
    let f = fused_function(ctx, id, k)?;
    let mut b = ctx.stream().launch_builder(&f);
    b.arg(x)
        .arg(src.idx)
        .arg(src.weight)
        .arg(&r.ctl)
        .arg(src.slot_pos)
        .arg(src.tok_row)
        .arg(ffn_ranks)
        .arg(&nf)
        .arg(&e)
        .arg(&r.peers)
        .arg(&r.ws)
        .arg(layout)
        .arg(&me)
        .arg(&m)
        .arg(&gate)
        .arg(&r.timeout_ns)
        .arg(&r.err)
        .arg(&sig_off);
    // SAFETY: afdep_cf_dispatch{,_fp8}(const u16* x, const i32* idx, const float* w, const u32*
    // ctl (the caller's live control block, its token count at most src.tokens), const
    // u32* slot_pos, const u32* tok_row, const u32* ffn_rank, u32 nf, u32 epr, const u64* peers,
    // const u8* ws, afdep_fused_layout L (by value: FusedLayout, #[repr(C)], asserted equal in
    // layout/fused.cuh), u32 me, u32 mode, u32 gate, u64 timeout_ns, u32* err, u64 sig_off)
    // with K compiled in: reads
    // the route tables (tokens × K and tokens × nf, checked), x rows (tokens × hidden, checked;
    // fp8: hidden a multiple of 128, checked, so the 16-byte reads stay in the row of a
    // cudaMalloc'd buffer), this rank's offsets and flags; writes, in workspace
    // peers[ffn_rank[f]], slab row (me, tok_row) (< cap: the caller's counts; row_bytes holds
    // this payload and the metadata, checked), expanded rows (fp8: their codes and scales)
    // below exp_rows (the kernel skips others) and row flags; the caller guarantees a live peer
    // table, ranks below world and areas that fit every workspace (fp8: 16-byte aligned);
    // err is a live u32[4]; with sig_off = DISPATCH_FLAGS the last block writes one u32 flag
    // (index me < MAX_WORLD) there in each FFN rank's workspace; the ticket word is the
    // control block's own.
    unsafe { b.launch(grid((src.tokens * ffns) as u64, blocks)) }.map_err(launch_err(id))?;
    Ok(())
}

/// The streaming epilogue (`afdep_cf_stream_epilogue`) of this FFN rank (workspace `r.ws`,
/// after its [`plan`] on the same stream): expands each compact row into the expanded area as
/// soon as its row flag holds the round of the control block at `r.ctl` (a timeout records
/// [`fault::ROW_WAIT`] in `r.err`; nothing when the round is skipped), split into `units`.
/// With `source_wait` `Some(code)` (an Auto round's one launch for every arm; `r.ctl` must be
/// the control block itself), a round that takes the source arm (no rows to expand) instead
/// waits for every source's dispatch flag, a timeout recorded as `code` (what a separate
/// [`wait`] did).
///
/// # Safety
///
/// `r.ws` is a live workspace, `r.ctl` a live control block and `r.err` a live error word
/// ([the launchers' contract](crate::ops::fused#safety-of-the-launchers)); the workspace has the
/// layout `layout` (its slabs and count-first areas; fp8: 16-byte aligned), and its plan was
/// written by this rank's [`plan`] earlier on the same stream; the first `srcs.count` entries of
/// `srcs.ranks` are below the world.
pub unsafe fn stream_epilogue(
    ctx: &GpuContext,
    r: &RankAddrs,
    srcs: &SourceRanks<'_>,
    layout: &FusedLayout,
    units: &WorkUnits,
    source_wait: Option<u32>,
) -> Result<(), KernelError> {
    let (src_ranks, sources, epr) = (srcs.ranks, srcs.count, srcs.experts_per_rank);
    if sources == 0 {
        return Ok(());
    }
    let (by_arm, src_code) = match source_wait {
        Some(code) => (1u32, code),
        None => (0u32, 0u32),
    };
    let src_flag_off = super::fused_layout::DISPATCH_FLAGS;
    let top_k = layout.top_k as usize;
    let (slab, areas) = (&layout.slab(), layout);
    need("source ranks", src_ranks, sources)?;
    check_rows(slab, areas, top_k)?;
    let k = as_u32("top_k", top_k)?;
    let ns = as_u32("sources", sources)?;
    let e = as_u32("experts per rank", epr)?;
    let id = match areas.payload_kind() {
        PayloadKind::Bf16 => KernelId::CfStreamEpilogue,
        PayloadKind::Fp8E4m3 => KernelId::CfStreamEpilogueFp8,
    };
    let f = fused_function(ctx, id, k)?;
    let mut b = ctx.stream().launch_builder(&f);
    b.arg(&r.ws)
        .arg(src_ranks)
        .arg(&ns)
        .arg(&e)
        .arg(layout)
        .arg(&units.warps_per_unit)
        .arg(&units.min_rows)
        .arg(&r.ctl)
        .arg(&r.timeout_ns)
        .arg(&r.err)
        .arg(&by_arm)
        .arg(&src_flag_off)
        .arg(&src_code);
    let cfg = units.launch_config();
    // SAFETY: afdep_cf_stream_epilogue{,_fp8}(u8* ws, const u32* src_rank, u32 ns, u32 epr,
    // afdep_fused_layout L (by value: FusedLayout, asserted equal in layout/fused.cuh), u32
    // warps_per_unit, u32 min_rows, const u32* ctl (the caller's live control block), u64
    // timeout_ns, u32* err, u32 by_arm, u64 src_flag_off, u32 src_code: with by_arm, in a
    // source-arm round only the dispatch flags of src_rank[s] are read, MAX_WORLD in every workspace)
    // with K compiled in: reads the plan this rank's afdep_cf_plan wrote (stream order), the
    // row flags and slab rows of src_rank[s] (ns entries, checked; rows below the plan's slab
    // counts, < cap; row_bytes holds this payload and the metadata, checked) in this rank's
    // live workspace, and writes expanded rows (fp8: their codes and scales too, 16-byte
    // aligned areas, hidden a multiple of 128, checked) below exp_rows (the kernel skips
    // others); err is a live u32[4].
    unsafe { b.launch(cfg) }.map_err(launch_err(id))?;
    Ok(())
}

/// The work split of a [`stream_epilogue`]: units of `warps_per_unit` warps take runs of at
/// least `min_rows` rows, on at most `blocks` blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WorkUnits {
    /// Warps of one work unit.
    pub warps_per_unit: u32,
    /// Fewest rows of one unit's run.
    pub min_rows: u32,
    /// Most blocks (the SM budget).
    pub blocks: u32,
}

impl WorkUnits {
    /// The grid of an epilogue over these units: `blocks` (at least one) blocks of
    /// [`BLOCK`] threads, no dynamic shared memory.
    pub fn launch_config(&self) -> cudarc::driver::LaunchConfig {
        cudarc::driver::LaunchConfig {
            grid_dim: (self.blocks.max(1), 1, 1),
            block_dim: (BLOCK, 1, 1),
            shared_mem_bytes: 0,
        }
    }
}

/// The source arm's fp8 dequantisation (`afdep_cf_dequant`) on this FFN rank (workspace
/// `r.ws`, after the wait for every source's dispatch flag on the same stream): every expanded
/// row of the plan (at most `areas.exp_rows`) gets the bf16 values of the codes and scales the
/// sources stored ([`FusedLayout::exp_q`], [`FusedLayout::exp_scales`]). Nothing when the round
/// of the control block at `r.ctl` is skipped. At most `blocks` blocks. Only for fp8 areas.
///
/// # Safety
///
/// `r.ws` is a live workspace and `r.ctl` a live control block ([the launchers'
/// contract](crate::ops::fused#safety-of-the-launchers)); the workspace holds the count-first areas
/// of `areas` (fp8, 16-byte aligned) and its plan was written by this rank's [`plan`] earlier on
/// the same stream.
pub unsafe fn dequant(
    ctx: &GpuContext,
    r: &RankAddrs,
    sources: usize,
    epr: usize,
    areas: &FusedLayout,
    blocks: u32,
) -> Result<(), KernelError> {
    let (hidden, top_k) = (areas.hidden as usize, areas.top_k as usize);
    if areas.payload_kind() != PayloadKind::Fp8E4m3 {
        return Err(KernelError::Shape(format!(
            "dequantising expanded rows of {} payloads",
            areas.payload_kind()
        )));
    }
    check_fp8(hidden, areas)?;
    let k = as_u32("top_k", top_k)?;
    let ns = as_u32("sources", sources)?;
    let e = as_u32("experts per rank", epr)?;
    let f = fused_function(ctx, KernelId::CfDequant, k)?;
    let mut b = ctx.stream().launch_builder(&f);
    b.arg(&r.ws).arg(&r.ctl).arg(areas).arg(&e).arg(&ns);
    // SAFETY: afdep_cf_dequant(u8* ws, const u32* ctl, afdep_fused_layout L (by value, asserted
    // equal to FusedLayout), u32 epr, u32 ns) (in the K-specialised
    // module, K unused): reads the caller's live control block and this rank's plan (written
    // by its afdep_cf_plan, stream order), then, for rows below min(plan rows, exp_rows), the
    // codes and scales and writes the bf16 rows of this rank's live workspace, whose areas the
    // caller's geometry sizes for exp_rows rows (16-byte aligned, hidden a multiple of 128,
    // checked).
    unsafe { b.launch(grid(areas.exp_rows, blocks)) }.map_err(launch_err(KernelId::CfDequant))?;
    Ok(())
}

/// Slab rows that hold the payload of `areas` and the metadata of top-k `top_k`.
pub(super) fn check_rows(
    slab: &SlabGeometry,
    areas: &FusedLayout,
    top_k: usize,
) -> Result<(), KernelError> {
    let hidden = slab.hidden as usize;
    let payload = super::fused::slab_payload_bytes(areas.payload_kind(), hidden) as u64;
    if areas.meta_off < payload
        || slab.row_bytes < areas.meta_off + 4 * super::fused::meta_words(top_k) as u64
    {
        return Err(KernelError::Shape(format!(
            "slab rows of {} bytes (metadata at {}) cannot hold {} payloads of hidden {hidden} \
             and top-k {top_k}",
            slab.row_bytes,
            areas.meta_off,
            areas.payload_kind()
        )));
    }
    if areas.payload_kind() == PayloadKind::Fp8E4m3 {
        check_fp8(hidden, areas)?;
    }
    Ok(())
}

/// fp8 areas: hidden a multiple of 128, the code and scale areas 16-byte aligned.
fn check_fp8(hidden: usize, areas: &FusedLayout) -> Result<(), KernelError> {
    if hidden % afdep_core::fp8::GROUP != 0
        || areas.exp_q % 16 != 0
        || areas.exp_scales % 16 != 0
        || areas.expanded % 16 != 0
    {
        return Err(KernelError::Shape(format!(
            "fp8 count-first areas need hidden a multiple of 128 (not {hidden}) and 16-byte \
             aligned expanded areas (codes at {}, scales at {})",
            areas.exp_q, areas.exp_scales
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::ops::fused::tests::define;

    #[test]
    fn fault_codes_match_the_header_and_differ_from_payload_first() {
        for (name, code) in [
            ("AFDEP_FUSED_FAULT_COUNTS_WAIT", fault::COUNTS_WAIT),
            ("AFDEP_FUSED_FAULT_OFFSETS_WAIT", fault::OFFSETS_WAIT),
            ("AFDEP_FUSED_FAULT_ROW_WAIT", fault::ROW_WAIT),
            ("AFDEP_FUSED_FAULT_SOURCE_WAIT", fault::SOURCE_WAIT),
        ] {
            assert_eq!(define(name), format!("{code}u"));
            assert!(
                code != super::super::fused::fault::DISPATCH_WAIT
                    && code != super::super::fused::fault::COMBINE_WAIT
            );
        }
    }

    #[test]
    fn the_mode_constants_match_the_kernel() {
        let text = include_str!("../../cuda/phase/cf_dispatch.cuh");
        assert!(text.contains("#define AFDEP_CF_SOURCE 0u"));
        assert!(text.contains("#define AFDEP_CF_STREAM 1u"));
        assert!(text.contains("#define AFDEP_CF_AUTO 2u"));
        assert_eq!(dispatch_mode(CfMode::Auto { gate: true }).0, 2);
        let plan = include_str!("../../cuda/phase/counts.cuh");
        for (name, pre) in [
            ("AFDEP_PLAN_PRE_NONE", PlanWait::None),
            ("AFDEP_PLAN_PRE_ALWAYS", PlanWait::Dispatch { code: 1 }),
            (
                "AFDEP_PLAN_PRE_PAYLOAD_FIRST",
                PlanWait::DispatchIfPayloadFirst { code: 1 },
            ),
        ] {
            let want = format!("#define {name} {}u", plan_wait_args(pre).0);
            assert!(plan.contains(&want), "{want}");
        }
    }
}
