//! The device round of the NCCL exchange (`nccl_round.cu`): [`NcclGeometry`] (the slab sizes of
//! a configuration) and [`NcclRoundBuffers`] (one rank's device buffers and the launchers of its
//! kernels, which own every buffer they touch, so the launchers are safe).
//!
//! A round on the device (`afdep_moe::nccl_device` puts the two NCCL exchanges between them):
//!
//! 1. source: [`NcclRoundBuffers::pack`]: each FFN rank's **dispatch slab**, capacity-padded: a
//!    16-byte header holding its row count, then one row per token of this source bound for that
//!    FFN rank (tokens ascending: the compact view), each `{u32 token, i32 local ids[K], f32
//!    weights[K]}` and the bf16 payload at [`NcclGeometry::pay_off`];
//! 2. the dispatch exchange (NCCL): every slab travels whole ([`NcclGeometry::slab_bytes`]);
//! 3. FFN: [`NcclRoundBuffers::expand`]: the plan ([`afdep_core::layout::FfnPlan`]'s counts,
//!    block starts and expert offsets, in `layout/fused.cuh`'s plan-area layout), the slot and
//!    row maps, the expanded rows; then [`NcclRoundBuffers::experts`] (none for the identity
//!    expert: the partials read the expanded rows) and [`NcclRoundBuffers::reduce`]: each
//!    compact row's f32 partial into the **return slab** of its source ([`NcclGeometry::
//!    ret_slab_bytes`], by compact row);
//! 4. the return exchange (NCCL);
//! 5. source: [`NcclRoundBuffers::combine`]: the fixed-order sum of the partials, cast to bf16.
//!
//! The round's token count is a device word ([`NcclRoundBuffers::set_tokens`]) written before
//! the round, so the launches depend on no host value that changes between rounds.

use afdep_core::bf16;
use cudarc::driver::{CudaSlice, DevicePtr, LaunchConfig, PushKernelArg};

use super::fused_layout::FusedLayout;
use super::fused_round::{self as fr, PlanView};
use super::{as_u32, grid, zeros};
use crate::context::{GpuContext, launch_err};
use crate::error::KernelError;
use crate::sources::{KernelId, SourceFile};

/// Bytes of a dispatch slab's header (`AFDEP_NCCL_HEADER`).
pub const HEADER_BYTES: usize = 16;

fn round_up(v: usize, to: usize) -> usize {
    v.div_ceil(to) * to
}

/// The sizes of one configuration's NCCL device round.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NcclGeometry {
    /// Attention ranks (sources).
    pub sources: usize,
    /// FFN ranks.
    pub ffn_ranks: usize,
    /// Experts per FFN rank.
    pub epr: usize,
    /// Slots per token.
    pub top_k: usize,
    /// Channels per row.
    pub hidden: usize,
    /// Most tokens of one source in a round.
    pub cap: usize,
}

impl NcclGeometry {
    /// Byte offset of a dispatch row's payload: after its metadata `{token, ids[K],
    /// weights[K]}`, 16-byte aligned.
    pub fn pay_off(&self) -> usize {
        round_up(4 * (1 + 2 * self.top_k), 16)
    }

    /// Bytes of a dispatch row (16-byte multiple).
    pub fn row_bytes(&self) -> usize {
        self.pay_off() + round_up(2 * self.hidden, 16)
    }

    /// Bytes of one dispatch slab: the header and `cap` rows. Every (source, FFN rank) pair
    /// sends one whole slab per round, whatever the round's token count.
    pub fn slab_bytes(&self) -> usize {
        HEADER_BYTES + self.cap * self.row_bytes()
    }

    /// Bytes of one return slab: `cap` rows of `hidden` f32.
    pub fn ret_slab_bytes(&self) -> usize {
        self.cap * self.hidden * 4
    }

    /// Most expanded rows of an FFN rank: every source's `cap` tokens with
    /// `min(top_k, epr)` slots on it.
    pub fn exp_rows(&self) -> usize {
        self.sources * self.cap * self.top_k.min(self.epr)
    }

    /// u64 words of the plan: counts and block starts (`epr × sources` each), expert offsets
    /// (`epr + 1`).
    pub fn plan_words(&self) -> usize {
        2 * self.epr * self.sources + self.epr + 1
    }

    /// Byte offset of the expanded rows in an FFN rank's workspace (after the plan, 256-byte
    /// aligned).
    pub fn exp_off(&self) -> usize {
        round_up(self.plan_words() * 8, 256)
    }

    /// Bytes one round moves through NCCL in all (both exchanges, every pair, padding
    /// included): `sources × ffn_ranks × (slab_bytes + ret_slab_bytes)`.
    pub fn round_bytes(&self) -> usize {
        self.sources * self.ffn_ranks * (self.slab_bytes() + self.ret_slab_bytes())
    }

    /// Bytes a round with `rows[s][f]` compact rows per pair would move without the padding:
    /// the rows and the headers, both ways.
    pub fn payload_bytes(&self, rows: impl IntoIterator<Item = usize>) -> usize {
        rows.into_iter()
            .map(|n| HEADER_BYTES + n * (self.row_bytes() + 4 * self.hidden))
            .sum()
    }
}

/// The experts an FFN rank's [`NcclRoundBuffers`] are made for.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum NcclExperts<'a> {
    /// Every expert returns its rows: no expert kernel, the partials read the expanded rows.
    Identity,
    /// `y = bf16(f32(x) · scales[l])` for local expert l (`afdep_round_experts`): one f32 per
    /// local expert.
    Scale(&'a [f32]),
    /// The caller's experts write the output rows ([`NcclRoundBuffers::expert_io`]).
    External,
}

/// A source's buffers.
struct SourceBufs {
    x: CudaSlice<bf16>,
    idx: CudaSlice<i32>,
    w: CudaSlice<f32>,
    pos: CudaSlice<u32>,
    send: CudaSlice<u8>,
    ret_recv: CudaSlice<f32>,
    out: CudaSlice<bf16>,
}

/// An FFN rank's buffers.
struct FfnBufs {
    index: usize,
    recv: CudaSlice<u8>,
    /// The plan at 0, the expanded rows at `exp_off`.
    ws: CudaSlice<u8>,
    slot_map: CudaSlice<u32>,
    row_map: CudaSlice<u32>,
    /// The scale expert's scales (`None`: the identity expert or the caller's experts).
    scales: Option<CudaSlice<f32>>,
    /// The experts' output rows (`None`: the identity expert, whose partials read the
    /// expanded rows).
    y: Option<CudaSlice<bf16>>,
    ret_send: CudaSlice<f32>,
    /// A control block whose verdict is go (zeros), for `afdep_round_experts`.
    ctl: CudaSlice<u32>,
}

/// One rank's device buffers of the NCCL round and the launchers of its kernels; see the
/// [module docs](self).
pub struct NcclRoundBuffers {
    geo: NcclGeometry,
    tokens: CudaSlice<u32>,
    source: Option<SourceBufs>,
    ffn: Option<FfnBufs>,
    blocks: u32,
}

impl std::fmt::Debug for NcclRoundBuffers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclRoundBuffers")
            .field("geo", &self.geo)
            .field("source", &self.source.is_some())
            .field("ffn", &self.ffn.as_ref().map(|b| b.index))
            .finish()
    }
}

fn addr<T>(ctx: &GpuContext, s: &CudaSlice<T>) -> u64 {
    let (p, _record) = s.device_ptr(ctx.stream());
    p
}

fn one_block() -> LaunchConfig {
    LaunchConfig {
        grid_dim: (1, 1, 1),
        block_dim: (1, 1, 1),
        shared_mem_bytes: 0,
    }
}

impl NcclRoundBuffers {
    /// Zeroed buffers of one rank: a source's when `source`, an FFN rank's (FFN index `ffn`)
    /// when `ffn` is some, for `experts`. Loads the kernels for `geo.top_k`.
    pub fn new(
        ctx: &GpuContext,
        geo: NcclGeometry,
        source: bool,
        ffn: Option<usize>,
        experts: NcclExperts<'_>,
    ) -> Result<NcclRoundBuffers, KernelError> {
        let (h, cap, k) = (geo.hidden, geo.cap, geo.top_k);
        if cap == 0 || h == 0 || k == 0 || geo.epr == 0 || geo.sources == 0 || geo.ffn_ranks == 0 {
            return Err(KernelError::Shape(format!(
                "an NCCL round needs every size non-zero: {geo:?}"
            )));
        }
        as_u32("rows of a slab", geo.sources * cap)?;
        as_u32("expanded rows", geo.exp_rows())?;
        // every kernel of the round, loaded now (a load inside a round could synchronise)
        for id in SourceFile::NcclRound.kernels() {
            ctx.function(id, 0, as_u32("top_k", k)?)?;
        }
        if matches!(experts, NcclExperts::Scale(_)) {
            // fr::experts runs the K = 1 module's kernel (it does not depend on top-k), as
            // ops::fused::preload loads it
            ctx.function(KernelId::RoundExperts, 0, 1)?;
        }
        let source = if source {
            Some(SourceBufs {
                x: zeros(ctx, cap * h)?,
                idx: zeros(ctx, cap * k)?,
                w: zeros(ctx, cap * k)?,
                pos: zeros(ctx, geo.ffn_ranks * cap)?,
                send: zeros(ctx, geo.ffn_ranks * geo.slab_bytes())?,
                ret_recv: zeros(ctx, geo.ffn_ranks * cap * h)?,
                out: zeros(ctx, cap * h)?,
            })
        } else {
            None
        };
        let ffn = match ffn {
            Some(index) => {
                let scales = match experts {
                    NcclExperts::Scale(s) => {
                        if s.len() != geo.epr {
                            return Err(KernelError::Shape(format!(
                                "{} expert scales for {} local experts",
                                s.len(),
                                geo.epr
                            )));
                        }
                        Some(
                            ctx.stream()
                                .clone_htod(s)
                                .map_err(KernelError::driver("uploading the expert scales"))?,
                        )
                    }
                    NcclExperts::Identity | NcclExperts::External => None,
                };
                let y = match experts {
                    NcclExperts::Identity => None,
                    NcclExperts::Scale(_) | NcclExperts::External => {
                        Some(zeros(ctx, geo.exp_rows() * h)?)
                    }
                };
                Some(FfnBufs {
                    index,
                    recv: zeros(ctx, geo.sources * geo.slab_bytes())?,
                    ws: zeros(ctx, geo.exp_off() + geo.exp_rows() * h * 2)?,
                    slot_map: zeros(ctx, geo.sources * cap * k)?,
                    row_map: zeros(ctx, geo.exp_rows())?,
                    scales,
                    y,
                    ret_send: zeros(ctx, geo.sources * cap * h)?,
                    ctl: zeros(ctx, fr::CTL_WORDS)?,
                })
            }
            None => None,
        };
        Ok(NcclRoundBuffers {
            geo,
            tokens: zeros(ctx, 1)?,
            source,
            ffn,
            blocks: ctx.sm_count().max(1) * 4,
        })
    }

    /// The geometry.
    pub fn geometry(&self) -> &NcclGeometry {
        &self.geo
    }

    fn src(&self) -> Result<&SourceBufs, KernelError> {
        self.source
            .as_ref()
            .ok_or_else(|| KernelError::Shape("this rank has no source buffers".into()))
    }

    fn src_mut(&mut self) -> Result<&mut SourceBufs, KernelError> {
        source_of(&mut self.source)
    }

    fn ffn(&self) -> Result<&FfnBufs, KernelError> {
        self.ffn
            .as_ref()
            .ok_or_else(|| KernelError::Shape("this rank has no FFN buffers".into()))
    }

    /// Writes a source's input of the next round (stream-ordered): its token count, `x`
    /// (`tokens × hidden`) and routes (`tokens × top_k`).
    pub fn upload_input(
        &mut self,
        ctx: &GpuContext,
        x: &[bf16],
        idx: &[i32],
        w: &[f32],
    ) -> Result<(), KernelError> {
        let (h, k, cap) = (self.geo.hidden, self.geo.top_k, self.geo.cap);
        let tokens = idx.len() / k;
        if tokens > cap || x.len() != tokens * h || idx.len() != tokens * k || w.len() != idx.len()
        {
            return Err(KernelError::Shape(format!(
                "a source input of {} values, {} ids and {} weights for capacity {cap}, hidden \
                 {h}, top_k {k}",
                x.len(),
                idx.len(),
                w.len()
            )));
        }
        let s = ctx.stream().clone();
        let b = self.src_mut()?;
        let copy = |what: &'static str| KernelError::driver(format!("uploading {what}"));
        if tokens > 0 {
            s.memcpy_htod(x, &mut b.x.slice_mut(..x.len()))
                .map_err(copy("rows"))?;
            s.memcpy_htod(idx, &mut b.idx.slice_mut(..idx.len()))
                .map_err(copy("expert ids"))?;
            s.memcpy_htod(w, &mut b.w.slice_mut(..w.len()))
                .map_err(copy("weights"))?;
        }
        self.set_tokens(ctx, tokens)
    }

    /// Writes the round's token count (0 on an FFN-only rank).
    pub fn set_tokens(&mut self, ctx: &GpuContext, tokens: usize) -> Result<(), KernelError> {
        let t = [as_u32("tokens", tokens)?];
        ctx.stream()
            .memcpy_htod(&t, &mut self.tokens)
            .map_err(KernelError::driver("uploading the token count"))
    }

    /// Fills the outputs of the next round with `0xFF` (NaN): a source's combined rows and
    /// received partials, an FFN rank's expanded rows, expert outputs and partials.
    pub fn poison_outputs(&mut self, ctx: &GpuContext) -> Result<(), KernelError> {
        if let Some(b) = self.source.as_mut() {
            super::poison(ctx, &mut b.out)?;
            super::poison(ctx, &mut b.ret_recv)?;
        }
        if let Some(b) = self.ffn.as_mut() {
            let mut exp = b.ws.slice_mut(self.geo.exp_off()..);
            let stream = ctx.stream();
            let bytes = exp.len();
            let (p, _r) = cudarc::driver::DevicePtrMut::device_ptr_mut(&mut exp, stream);
            // SAFETY: `p` addresses the `bytes` bytes of the expanded area of `b.ws`, borrowed
            // mutably for the call; `_r` orders later uses after the memset.
            unsafe { cudarc::driver::result::memset_d8_async(p, 0xFF, bytes, stream.cu_stream()) }
                .map_err(KernelError::driver("poisoning the expanded rows"))?;
            if let Some(y) = b.y.as_mut() {
                super::poison(ctx, y)?;
            }
            super::poison(ctx, &mut b.ret_send)?;
        }
        Ok(())
    }

    /// Source: the device address of FFN index `f`'s dispatch slab (what the dispatch
    /// exchange sends to it).
    pub fn send_slab(&self, ctx: &GpuContext, f: usize) -> Result<u64, KernelError> {
        Ok(addr(ctx, &self.src()?.send) + (f * self.geo.slab_bytes()) as u64)
    }

    /// FFN: the device address of source `s`'s dispatch slab (where the dispatch exchange
    /// receives it).
    pub fn recv_slab(&self, ctx: &GpuContext, s: usize) -> Result<u64, KernelError> {
        Ok(addr(ctx, &self.ffn()?.recv) + (s * self.geo.slab_bytes()) as u64)
    }

    /// FFN: the device address of source `s`'s return slab (what the return exchange sends).
    pub fn ret_send_slab(&self, ctx: &GpuContext, s: usize) -> Result<u64, KernelError> {
        Ok(addr(ctx, &self.ffn()?.ret_send) + (s * self.geo.ret_slab_bytes()) as u64)
    }

    /// Source: the device address of FFN index `f`'s return slab (where the return exchange
    /// receives it).
    pub fn ret_recv_slab(&self, ctx: &GpuContext, f: usize) -> Result<u64, KernelError> {
        Ok(addr(ctx, &self.src()?.ret_recv) + (f * self.geo.ret_slab_bytes()) as u64)
    }

    /// The kernels' scalar arguments of this rank's geometry.
    fn scalars(&self) -> Result<Scalars, KernelError> {
        let g = &self.geo;
        Ok(Scalars {
            k: as_u32("top_k", g.top_k)?,
            cap: g.cap as u64,
            sources: as_u32("sources", g.sources)?,
            ffn_ranks: as_u32("FFN ranks", g.ffn_ranks)?,
            epr: as_u32("experts per rank", g.epr)?,
            slab: g.slab_bytes() as u64,
            row: g.row_bytes() as u64,
            pay: g.pay_off() as u64,
            hidden: as_u32("hidden", g.hidden)?,
            blocks: self.blocks,
        })
    }

    /// Source: the dispatch slabs (headers, metadata, rows) and the token positions.
    pub fn pack(&mut self, ctx: &GpuContext) -> Result<(), KernelError> {
        let sc = self.scalars()?;
        let tokens = &self.tokens;
        let b = source_of(&mut self.source)?;
        let f = ctx.function(KernelId::NcclPack, 0, sc.k)?;
        let mut l = ctx.stream().launch_builder(&f);
        l.arg(tokens)
            .arg(&b.idx)
            .arg(&b.w)
            .arg(&sc.cap)
            .arg(&sc.epr)
            .arg(&mut b.send)
            .arg(&sc.slab)
            .arg(&sc.row)
            .arg(&mut b.pos);
        // SAFETY: afdep_nccl_pack(const u32* tokens, const i32* idx, const float* w, u64 cap,
        // u32 epr, u8* send, u64 slab_bytes, u64 row_bytes, u32* pos): reads at most cap tokens'
        // routes (idx, w hold cap × K), writes nf slabs of slab_bytes (send holds nf of them:
        // one block per slab) and pos (nf × cap).
        unsafe { l.launch(grid(u64::from(sc.ffn_ranks))?) }
            .map_err(launch_err(KernelId::NcclPack))?;
        let f = ctx.function(KernelId::NcclPackRows, 0, sc.k)?;
        let mut l = ctx.stream().launch_builder(&f);
        l.arg(tokens)
            .arg(&b.x)
            .arg(&sc.cap)
            .arg(&sc.ffn_ranks)
            .arg(&mut b.send)
            .arg(&sc.slab)
            .arg(&sc.row)
            .arg(&sc.pay)
            .arg(&b.pos)
            .arg(&sc.hidden);
        // SAFETY: afdep_nccl_pack_rows(const u32* tokens, const u16* x, u64 cap, u32 nf, u8*
        // send, u64 slab_bytes, u64 row_bytes, u64 pay_off, const u32* pos, u32 hidden): reads
        // at most cap rows of x (cap × hidden) and pos (nf × cap, rows below cap written by
        // afdep_nccl_pack), writes payloads inside the nf slabs.
        unsafe { l.launch(grid(u64::from(sc.blocks))?) }
            .map_err(launch_err(KernelId::NcclPackRows))?;
        Ok(())
    }

    /// FFN: the plan, the slot and row maps and the expanded rows from the received slabs.
    pub fn expand(&mut self, ctx: &GpuContext) -> Result<(), KernelError> {
        let g = self.geo;
        let sc = self.scalars()?;
        let pairs = (g.sources * g.epr) as u64;
        let b = ffn_of(&mut self.ffn)?;
        let ws = addr(ctx, &b.ws);
        let eo_total = ws + 8 * (2 * g.epr * g.sources + g.epr) as u64;
        let expanded = ws + g.exp_off() as u64;
        let f = ctx.function(KernelId::NcclCount, 0, sc.k)?;
        let mut l = ctx.stream().launch_builder(&f);
        l.arg(&b.recv)
            .arg(&sc.slab)
            .arg(&sc.row)
            .arg(&sc.cap)
            .arg(&sc.sources)
            .arg(&ws);
        // SAFETY: afdep_nccl_count(const u8* recv, u64 slab_bytes, u64 row_bytes, u64 cap, u32
        // ns, u64* plan): reads the rows below each header's count (capped at cap) of the ns
        // slabs of recv, writes plan[l·ns + s] for the grid's ns · epr blocks (ws holds the plan
        // area of plan_words u64 at 0).
        unsafe { l.launch(grid(pairs)?) }.map_err(launch_err(KernelId::NcclCount))?;
        let f = ctx.function(KernelId::NcclPlan, 0, sc.k)?;
        let mut l = ctx.stream().launch_builder(&f);
        l.arg(&sc.epr).arg(&sc.sources).arg(&ws);
        // SAFETY: afdep_nccl_plan(u32 epr, u32 ns, u64* plan): one thread, inside the plan
        // area of plan_words u64.
        unsafe { l.launch(one_block()) }.map_err(launch_err(KernelId::NcclPlan))?;
        let f = ctx.function(KernelId::NcclExpand, 0, sc.k)?;
        let mut l = ctx.stream().launch_builder(&f);
        l.arg(&b.recv)
            .arg(&sc.slab)
            .arg(&sc.row)
            .arg(&sc.cap)
            .arg(&sc.sources)
            .arg(&ws)
            .arg(&sc.epr)
            .arg(&mut b.slot_map)
            .arg(&mut b.row_map);
        // SAFETY: afdep_nccl_expand(const u8* recv, u64 slab_bytes, u64 row_bytes, u64 cap, u32
        // ns, const u64* plan, u32 epr, u32* slot_map, u32* row_map): slot_map holds ns · cap ·
        // K, row_map exp_rows, and the plan's rows (at most min(K, epr) per compact row) are
        // below exp_rows.
        unsafe { l.launch(grid(pairs)?) }.map_err(launch_err(KernelId::NcclExpand))?;
        let f = ctx.function(KernelId::NcclExpandRows, 0, sc.k)?;
        let mut l = ctx.stream().launch_builder(&f);
        l.arg(&b.recv)
            .arg(&sc.slab)
            .arg(&sc.row)
            .arg(&sc.pay)
            .arg(&sc.cap)
            .arg(&eo_total)
            .arg(&b.row_map)
            .arg(&expanded)
            .arg(&sc.hidden);
        // SAFETY: afdep_nccl_expand_rows(const u8* recv, u64 slab_bytes, u64 row_bytes, u64
        // pay_off, u64 cap, const u64* eo_total, const u32* row_map, u16* expanded, u32
        // hidden): the plan's total rows (below exp_rows) of the expanded area of ws (exp_rows
        // × hidden bf16 at exp_off), from the compact rows row_map names.
        unsafe { l.launch(grid(u64::from(sc.blocks))?) }
            .map_err(launch_err(KernelId::NcclExpandRows))?;
        Ok(())
    }

    /// FFN: the scale expert over the expanded rows (`afdep_round_experts`); nothing for the
    /// identity expert or the caller's ([`NcclExperts::External`]).
    pub fn experts(&mut self, ctx: &GpuContext) -> Result<(), KernelError> {
        let g = self.geo;
        let blocks = self.blocks;
        let b = ffn_of(&mut self.ffn)?;
        let ws = addr(ctx, &b.ws);
        let ctl = addr(ctx, &b.ctl);
        let (Some(scales), Some(y)) = (b.scales.as_ref(), b.y.as_mut()) else {
            return Ok(());
        };
        let pv = plan_view(&g, ws)?;
        // SAFETY: `ws` is this rank's live workspace (owned by self) holding the plan at 0 for
        // epr experts and sources sources (written by `expand` on the same stream) and exp_rows
        // rows of hidden bf16 at exp_off; `ctl` a live zeroed control block (verdict go).
        unsafe { fr::experts(ctx, &pv, ctl, scales, y, blocks) }
    }

    /// FFN: each compact row's partial into its source's return slab.
    pub fn reduce(&mut self, ctx: &GpuContext) -> Result<(), KernelError> {
        let g = self.geo;
        let sc = self.scalars()?;
        let b = ffn_of(&mut self.ffn)?;
        let y = match &b.y {
            Some(y) => addr(ctx, y),
            None => addr(ctx, &b.ws) + g.exp_off() as u64,
        };
        let f = ctx.function(KernelId::NcclReduce, 0, sc.k)?;
        let mut l = ctx.stream().launch_builder(&f);
        l.arg(&b.recv)
            .arg(&sc.slab)
            .arg(&sc.row)
            .arg(&sc.cap)
            .arg(&sc.sources)
            .arg(&b.slot_map)
            .arg(&y)
            .arg(&mut b.ret_send)
            .arg(&sc.hidden);
        // SAFETY: afdep_nccl_reduce(const u8* recv, u64 slab_bytes, u64 row_bytes, u64 cap, u32
        // ns, const u32* slot_map, const u16* y, float* ret, u32 hidden): the rows below each
        // header's count, their slots' expanded rows (written by `expand`, below exp_rows; y
        // holds exp_rows × hidden: the scale expert's output or the expanded area), ret holds
        // ns × cap × hidden.
        unsafe { l.launch(grid(u64::from(sc.blocks))?) }
            .map_err(launch_err(KernelId::NcclReduce))?;
        Ok(())
    }

    /// FFN, [`NcclExperts::External`]: where the plan and the expanded rows are (written by
    /// [`expand`](NcclRoundBuffers::expand) in stream order: the plan at 0, expert offsets
    /// included, `exp_rows` rows at `exp_off`) and the output rows (`exp_rows × hidden`, in
    /// expanded order) that [`reduce`](NcclRoundBuffers::reduce) reads.
    pub fn expert_io(
        &mut self,
        ctx: &GpuContext,
    ) -> Result<(PlanView, &mut CudaSlice<bf16>), KernelError> {
        let g = self.geo;
        let b = ffn_of(&mut self.ffn)?;
        let pv = plan_view(&g, addr(ctx, &b.ws))?;
        let y = b
            .y
            .as_mut()
            .ok_or_else(|| KernelError::Shape("the identity expert has no output rows".into()))?;
        Ok((pv, y))
    }

    /// Source: the combined rows of the round's tokens from the received partials.
    pub fn combine(&mut self, ctx: &GpuContext) -> Result<(), KernelError> {
        let sc = self.scalars()?;
        let tokens = &self.tokens;
        let b = source_of(&mut self.source)?;
        let f = ctx.function(KernelId::NcclCombine, 0, sc.k)?;
        let mut l = ctx.stream().launch_builder(&f);
        l.arg(tokens)
            .arg(&sc.cap)
            .arg(&sc.ffn_ranks)
            .arg(&b.pos)
            .arg(&b.ret_recv)
            .arg(&mut b.out)
            .arg(&sc.hidden);
        // SAFETY: afdep_nccl_combine(const u32* tokens, u64 cap, u32 nf, const u32* pos, const
        // float* ret, u16* out, u32 hidden): at most cap tokens; pos (nf × cap) names rows below
        // cap of ret (nf × cap × hidden); out holds cap × hidden.
        unsafe { l.launch(grid(u64::from(sc.blocks))?) }
            .map_err(launch_err(KernelId::NcclCombine))?;
        Ok(())
    }

    /// Source: the first `tokens` combined rows (waits for the stream).
    pub fn read_out(&self, ctx: &GpuContext, tokens: usize) -> Result<Vec<bf16>, KernelError> {
        let n = tokens * self.geo.hidden;
        let b = self.src()?;
        if n == 0 {
            return Ok(Vec::new());
        }
        ctx.stream()
            .clone_dtoh(&b.out.slice(..n))
            .map_err(KernelError::driver("reading the combined rows"))
    }

    /// FFN: the received dispatch slabs and the workspace (plan at 0, expanded rows at
    /// [`NcclGeometry::exp_off`]) as bytes (waits for the stream): for
    /// [`afdep_core::oracle::exchange::FfnReceived`].
    pub fn read_received(&self, ctx: &GpuContext) -> Result<(Vec<u8>, Vec<u8>), KernelError> {
        let b = self.ffn()?;
        let s = ctx.stream();
        let recv = s
            .clone_dtoh(&b.recv)
            .map_err(KernelError::driver("reading the slabs"))?;
        let ws = s
            .clone_dtoh(&b.ws)
            .map_err(KernelError::driver("reading the plan"))?;
        Ok((recv, ws))
    }
}

/// The kernels' scalar arguments of a geometry (the names of the kernels' parameters).
struct Scalars {
    k: u32,
    cap: u64,
    sources: u32,
    ffn_ranks: u32,
    epr: u32,
    slab: u64,
    row: u64,
    pay: u64,
    hidden: u32,
    blocks: u32,
}

/// A source rank's buffers, or the error of a rank that has none.
fn source_of(b: &mut Option<SourceBufs>) -> Result<&mut SourceBufs, KernelError> {
    b.as_mut()
        .ok_or_else(|| KernelError::Shape("this rank has no source buffers".into()))
}

/// An FFN rank's buffers, or the error of a rank that has none.
fn ffn_of(b: &mut Option<FfnBufs>) -> Result<&mut FfnBufs, KernelError> {
    b.as_mut()
        .ok_or_else(|| KernelError::Shape("this rank has no FFN buffers".into()))
}

/// The FFN workspace of `g` at `ws` as the fused round's plan view: the plan at 0, the
/// expanded rows at `exp_off` (the only fields of the layout the expert kernels read).
fn plan_view(g: &NcclGeometry, ws: u64) -> Result<PlanView, KernelError> {
    Ok(PlanView {
        ws,
        layout: FusedLayout {
            plan: 0,
            expanded: g.exp_off() as u64,
            exp_rows: g.exp_rows() as u64,
            hidden: as_u32("hidden", g.hidden)?,
            ..FusedLayout::default()
        },
        epr: g.epr,
        sources: g.sources,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn geometry_rows_are_aligned_and_hold_metadata_and_payload() {
        for (k, h) in [(1usize, 1usize), (3, 64), (8, 7168), (6, 129)] {
            let g = NcclGeometry {
                sources: 3,
                ffn_ranks: 2,
                epr: 4,
                top_k: k,
                hidden: h,
                cap: 17,
            };
            assert_eq!(g.pay_off() % 16, 0);
            assert!(g.pay_off() >= 4 * (1 + 2 * k));
            assert_eq!(g.row_bytes() % 16, 0);
            assert!(g.row_bytes() >= g.pay_off() + 2 * h);
            assert_eq!(g.slab_bytes(), 16 + 17 * g.row_bytes());
            assert_eq!(g.exp_rows(), 3 * 17 * k.min(4));
            assert_eq!(g.exp_off() % 256, 0);
            assert!(g.exp_off() >= 8 * (2 * 4 * 3 + 5));
            assert_eq!(
                g.round_bytes(),
                6 * (g.slab_bytes() + 17 * h * 4),
                "every pair sends a whole slab each way"
            );
            // a full round moves exactly the padded bytes
            assert_eq!(g.payload_bytes(vec![17; 6]), g.round_bytes());
        }
    }

    #[test]
    fn header_matches_the_kernel() {
        let text = include_str!("../../cuda/nccl_round.cu");
        assert!(text.contains(&format!("#define AFDEP_NCCL_HEADER {HEADER_BYTES}")));
    }
}
