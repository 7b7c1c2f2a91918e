//! Launchers of a device round's fronts (`fused_front.cu`): for a rank that is a source or an
//! FFN rank but not both, the launches from the round's start to its rows as one kernel.
//!
//! - [`source_front`] runs [`begin`](super::fused_round::begin),
//!   [`counts`](super::fused_cf::counts) and [`dispatch`](super::fused_cf::dispatch) of a
//!   source in one grid;
//! - [`ffn_front`] runs [`begin`](super::fused_round::begin), [`plan`](super::fused_cf::plan) and
//!   [`stream_epilogue`](super::fused_cf::stream_epilogue) of an FFN rank in one grid.
//!
//! The phases are the same device code as the separate kernels' (`cuda/phase/*.cuh`); they hand
//! off inside the grid through words 12–14 of the control block instead of at kernel boundaries
//! (`layout/fused.cuh`), which a CUDA graph pays as one dependent launch each on the round's
//! critical chain. Every in-grid wait is bounded; one that runs out records
//! [`FAULT_FRONT_WAIT`].

use cudarc::driver::{CudaSlice, PushKernelArg};

use super::fused::{RankAddrs, blocks_for, fused_function};
use super::fused_cf::{CfMode, CfSource, FfnRanks, PlanWait, SourceRanks, WorkUnits};
use super::fused_layout::{DISPATCH_FLAGS, FusedLayout};
use super::fused_round::{ARM_GATES, CTL_WORDS, DeviceRules, RoundSource};
use super::{as_u32, need};
use crate::context::{GpuContext, launch_err};
use crate::error::KernelError;
use crate::sources::KernelId;
use afdep_core::PayloadKind;

/// A front's block waited for its own grid longer than the phases before could take
/// (`AFDEP_FUSED_FAULT_FRONT_WAIT`; the peer is the rank itself).
pub const FAULT_FRONT_WAIT: u32 = 33;

/// The kernels of this module, for [`super::fused::preload`].
pub const KERNELS: [KernelId; 4] = [
    KernelId::SourceFront,
    KernelId::SourceFrontFp8,
    KernelId::FfnFront,
    KernelId::FfnFrontFp8,
];

/// What both fronts pass to the round's start: the rank's addresses and the world, the route
/// rules and the arm gates.
#[derive(Debug)]
pub struct FrontStart<'a> {
    /// The rank's addresses (`r.ctl` the control block itself, never an arm gate).
    pub r: &'a RankAddrs,
    /// Ranks of the group (at most 64).
    pub world: usize,
    /// The route rules and the arm rule's bucket.
    pub rules: &'a DeviceRules,
    /// The rank's arm gates ([`ARM_GATES`] × [`CTL_WORDS`]).
    pub gates: &'a mut CudaSlice<u32>,
    /// The workspace layout (every rank's).
    pub layout: &'a FusedLayout,
}

/// Pushes the parameters both fronts start with (`AFDEP_FRONT_BEGIN_PARAMS` of
/// `fused_front.cu`: the workspace, control block and peer table, `[world, me]`, the layout, the
/// route rules, the timeout and error word, the bucket and the arm gates).
fn push_start<'a>(b: &mut cudarc::driver::LaunchArgs<'a>, st: &'a Started<'a>) {
    b.arg(&st.r.ws)
        .arg(&st.r.ctl)
        .arg(&st.r.peers)
        .arg(&st.wm[0])
        .arg(&st.wm[1])
        .arg(st.layout)
        .arg(&st.rules.experts)
        .arg(&st.rules.owned)
        .arg(&st.r.timeout_ns)
        .arg(&st.r.err)
        .arg(&st.rules.bucket)
        .arg(&*st.gates);
}

/// A [`FrontStart`] checked: its parts, with `[world, me]` as `u32`.
struct Started<'a> {
    r: &'a RankAddrs,
    rules: &'a DeviceRules,
    gates: &'a mut CudaSlice<u32>,
    layout: &'a FusedLayout,
    wm: [u32; 2],
}

/// Checks the start's sizes (the gates, a world of at most 64).
fn start(s: FrontStart<'_>) -> Result<Started<'_>, KernelError> {
    need("arm gates", s.gates, ARM_GATES * CTL_WORDS)?;
    if s.world > 64 {
        return Err(KernelError::Shape(format!(
            "{} ranks: the status area holds 64",
            s.world
        )));
    }
    let wm = [as_u32("world", s.world)?, as_u32("rank", s.r.me)?];
    Ok(Started {
        r: s.r,
        rules: s.rules,
        gates: s.gates,
        layout: s.layout,
        wm,
    })
}

/// A source's front (`afdep_source_front`): the round's start with this source's routes
/// (`source`; the checks of [`begin`](super::fused_round::begin)), then, unless the round is
/// skipped, its counts and their publication ([`counts`](super::fused_cf::counts) over `src`)
/// and its rows in the mode `mode` ([`dispatch`](super::fused_cf::dispatch)), in one grid of at
/// most `blocks` blocks.
///
/// # Safety
///
/// The union of the contracts of [`begin`](super::fused_round::begin),
/// [`counts`](super::fused_cf::counts) and [`dispatch`](super::fused_cf::dispatch) for the same
/// arguments: `s.r`'s workspace (of layout `s.layout`), control block (the control block itself),
/// error word and peer table of `s.world` ranks are live, every workspace has the layout
/// `s.layout`, the first `ffns.count` entries of `ffns.ranks` and `s.r.me` are below the world,
/// and `src` holds `src.tokens` (at least the control block's token count) rows and routes.
/// The kernel reads the routes of `source` (not `src.idx` / `src.weight`, which should be the
/// same buffers) in every phase; its sizes are checked for both uses.
pub unsafe fn source_front(
    ctx: &GpuContext,
    s: FrontStart<'_>,
    source: &RoundSource<'_>,
    src: &CfSource<'_>,
    ffns: &FfnRanks<'_>,
    mode: CfMode,
    blocks: u32,
) -> Result<(), KernelError> {
    let st = start(s)?;
    let (layout, top_k) = (st.layout, st.layout.top_k as usize);
    let (nf_us, epr) = (ffns.count, ffns.experts_per_rank);
    let hidden = layout.hidden as usize;
    let cap = layout.cap as usize;
    let n = src.tokens * top_k;
    // the start validates `source`'s tables and the counts and rows read them too
    need("routes", source.idx, (cap * top_k).max(n))?;
    need("weights", source.weight, (cap * top_k).max(n))?;
    if let Some(st) = source.payload {
        need(
            "payload check state",
            st,
            super::fused_round::PAYLOAD_STATE_WORDS,
        )?;
    }
    need("x", src.x, src.tokens * hidden)?;
    need("idx", src.idx, n)?;
    need("weights", src.weight, n)?;
    need("slot positions", src.slot_pos, n.max(1))?;
    need("token rows", src.tok_row, (src.tokens * nf_us).max(1))?;
    need("counts", src.counts, nf_us * epr + nf_us)?;
    need("ffn ranks", ffns.ranks, nf_us)?;
    super::fused_cf::check_rows(&layout.slab(), layout, top_k)?;
    let src_index = as_u32("attention index", source.index)?;
    let nf = as_u32("ffns", nf_us)?;
    let e = as_u32("experts per rank", epr)?;
    as_u32("owned experts", nf_us * epr)?;
    let (m, gate, sig_off) = super::fused_cf::dispatch_mode(mode);
    let id = match layout.payload_kind() {
        PayloadKind::Bf16 => KernelId::SourceFront,
        PayloadKind::Fp8E4m3 => KernelId::SourceFrontFp8,
    };
    let f = fused_function(ctx, id, as_u32("top_k", top_k)?)?;
    let null = 0u64;
    let mut b = ctx.stream().launch_builder(&f);
    push_start(&mut b, &st);
    b.arg(&src_index)
        .arg(src.x)
        .arg(source.idx)
        .arg(source.weight);
    match source.payload {
        Some(st) => b.arg(st),
        None => b.arg(&null),
    };
    b.arg(src.slot_pos)
        .arg(src.tok_row)
        .arg(src.counts)
        .arg(ffns.ranks)
        .arg(&nf)
        .arg(&e)
        .arg(&m)
        .arg(&gate)
        .arg(&sig_off);
    let rows = ((src.tokens * nf_us).max(nf_us * epr + nf_us)) as u64;
    // SAFETY: afdep_source_front{,_fp8}(u8* ws, u32* ctl, const u64* peers, u32 world, u32 me,
    // afdep_fused_layout L (by value, asserted equal to FusedLayout), u64 experts, u64 owned,
    // u64 timeout_ns, u32* err, u64 bucket, u32* gates, u32 src_index, const u16* x, const i32*
    // idx, const float* w, const u32* payload, u32* slot_pos, u32* tok_row, u64* counts, const
    // u32* ffn_rank, u32 nf, u32 epr, u32 mode, u32 gate, u64 sig_off) with K compiled in:
    // exactly the reads and writes of afdep_round_begin (routes of at most cap tokens, checked;
    // the payload state, checked, or null; one status record per workspace of the live peer
    // table, world <= 64 checked; the gates, checked), afdep_cf_counts (slot_pos, tok_row and
    // counts, checked; a counts row and a flag per FFN rank) and afdep_cf_dispatch (x and the
    // route tables of src.tokens tokens, checked; slab rows, expanded rows below exp_rows and
    // flags of the FFN ranks' workspaces, row_bytes checked) under the caller's contract; plus
    // words 12..15 of the live control block. err is a live u32[4].
    unsafe { b.launch(blocks_for(rows, blocks)) }.map_err(launch_err(id))?;
    Ok(())
}

/// An FFN rank's front (`afdep_ffn_front`): the round's start (no routes of its own), its plan
/// with the wait `pre` ([`plan`](super::fused_cf::plan)) and its streaming epilogue
/// ([`stream_epilogue`](super::fused_cf::stream_epilogue), `source_wait` as there), in one grid
/// of `units.blocks` blocks.
///
/// # Safety
///
/// The union of the contracts of [`begin`](super::fused_round::begin),
/// [`plan`](super::fused_cf::plan) and [`stream_epilogue`](super::fused_cf::stream_epilogue)
/// for the same arguments: `s.r`'s workspace (of layout `s.layout`), control block (the control
/// block itself), error word and peer table of `s.world` ranks are live, every workspace has the
/// layout `layout` and `MAX_WORLD` flags at [`DISPATCH_FLAGS`], and the first `srcs.count`
/// entries of `srcs.ranks` and `s.r.me` are below the world.
pub unsafe fn ffn_front(
    ctx: &GpuContext,
    s: FrontStart<'_>,
    srcs: &SourceRanks<'_>,
    pre: PlanWait,
    units: &WorkUnits,
    source_wait: Option<u32>,
) -> Result<(), KernelError> {
    let st = start(s)?;
    let (layout, top_k) = (st.layout, st.layout.top_k as usize);
    need("source ranks", srcs.ranks, srcs.count)?;
    super::fused_cf::check_rows(&layout.slab(), layout, top_k)?;
    let ns = as_u32("sources", srcs.count)?;
    let e = as_u32("experts per rank", srcs.experts_per_rank)?;
    let (pre_mode, pre_code) = super::fused_cf::plan_wait_args(pre);
    let (by_arm, src_code) = match source_wait {
        Some(code) => (1u32, code),
        None => (0u32, 0u32),
    };
    let flags = DISPATCH_FLAGS;
    let id = match layout.payload_kind() {
        PayloadKind::Bf16 => KernelId::FfnFront,
        PayloadKind::Fp8E4m3 => KernelId::FfnFrontFp8,
    };
    let f = fused_function(ctx, id, as_u32("top_k", top_k)?)?;
    let mut b = ctx.stream().launch_builder(&f);
    push_start(&mut b, &st);
    b.arg(srcs.ranks)
        .arg(&ns)
        .arg(&e)
        .arg(&pre_mode)
        .arg(&flags)
        .arg(&pre_code)
        .arg(&units.warps_per_unit)
        .arg(&units.min_rows)
        .arg(&by_arm)
        .arg(&flags)
        .arg(&src_code);
    let cfg = units.launch_config();
    // SAFETY: afdep_ffn_front{,_fp8}(u8* ws, u32* ctl, const u64* peers, u32 world, u32 me,
    // afdep_fused_layout L (by value, asserted equal to FusedLayout), u64 experts, u64 owned,
    // u64 timeout_ns, u32* err, u64 bucket, u32* gates, const u32* src_rank, u32 ns, u32 epr,
    // u32 pre, u64 pre_off, u32 pre_code, u32 warps_per_unit, u32 min_rows, u32 by_arm, u64
    // src_flag_off, u32 src_code) with K compiled in: exactly the reads and writes of
    // afdep_round_begin with no routes (null tables, never read; one status record per
    // workspace of the live peer table, world <= 64 checked; the gates, checked),
    // afdep_cf_plan (src_rank of ns entries, checked; the plan in this workspace, each
    // source's offsets row and flag) and afdep_cf_stream_epilogue (slab rows and row flags of
    // this workspace, expanded rows below exp_rows, row_bytes checked) under the caller's
    // contract; plus words 12..15 of the live control block. err is a live u32[4].
    unsafe { b.launch(cfg) }.map_err(launch_err(id))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::fused::tests::define;

    #[test]
    fn constants_match_the_header() {
        assert_eq!(
            define("AFDEP_FUSED_FAULT_FRONT_WAIT"),
            format!("{FAULT_FRONT_WAIT}u")
        );
        assert_eq!(define("AFDEP_CTL_FRONT_BEGUN"), "12");
        assert_eq!(define("AFDEP_CTL_FRONT_READY"), "13");
        assert_eq!(define("AFDEP_CTL_FRONT_EXIT"), "14");
        const { assert!(14 < CTL_WORDS) };
    }
}
