//! `MoeLayer`: the dropless MoE layer (docs/design.md, "Specification: Layer and train step") on
//! one GPU, forward and train step.
//!
//! A layer is built for one shape, one token count and one [`Dispatch`] strategy; every buffer
//! it needs (inputs, outputs, intermediates, gradients, GEMM workspaces) is allocated once in
//! [`MoeLayer::new`] and reused by every step. A step only queues kernels on the context's
//! stream ([`MoeLayer::enqueue_forward`], [`MoeLayer::enqueue_train_step`]): no host sync, no
//! allocation, so a whole step can be captured in a CUDA graph and replayed after writing new
//! inputs (and new routes) into the layer's input buffers. [`MoeLayer::finish`] waits for the
//! stream and reports a rejected route table as a typed error; on rejection the outputs are
//! poisoned (all bits set: NaN), never left looking valid.
//!
//! # Dispatch strategies (all compute the same function)
//! - [`Dispatch::Sorted`]: the (token, slot) pairs are sorted by expert, x is permuted into an
//!   expert-sorted copy, the grouped GEMMs read contiguous rows; the down-projection stores the
//!   unweighted `y` rows and the combine gathers each token's K rows with their weights.
//! - [`Dispatch::Gather`]: no permuted copy: the up-projection and the `dW1 | dW3` product read
//!   x rows through the sort index; the down-projection's epilogue applies the router weight
//!   (`w·y` stored in bf16) and the combine sums each token's K rows.
//! - [`Dispatch::Fused`]: gather into the up-projection (SwiGLU in its epilogue); the
//!   down-projection's epilogue multiplies by the router weight and adds straight into the
//!   token-order f32 accumulator with atomics (the order of the adds is not fixed); the data
//!   gradient is scattered the same way.
//! - [`Dispatch::FusedGsum`]: gather into the up-projection; the down-projection writes
//!   expert-sorted rows; a combine kernel gathers each token's K rows and sums them with their
//!   weights in slot order (no atomics, deterministic).
//!
//! In the train step every strategy but `Fused` first permutes dy into the experts' row order
//! (into the expert-sorted rows buffer, free between the forward's combine and the dx GEMM)
//! when the expert width is at least [`DY_PERMUTE_MIN_WIDTH`], so that `dy·W2ᵀ` and `dW2` load
//! contiguous rows; otherwise (and always with `Fused`, which has no such buffer) they gather
//! dy rows through the sort index. Either way the GEMMs see the same values in the same order.
//!
//! # Numerics (what differs from the f32 oracle)
//! Storage between kernels is bf16 where the oracle keeps f32: `a`, `b`, `h` and `y` rows of
//! the forward; `[da | db]`, `w·h`, the per-row data gradients and the router's `dlogits` in
//! the train step. Sums are f32 (tensor-core accumulation in ascending k-tiles; the combine in
//! slot order; the weight gradients in fixed row chunks summed in chunk order). The router is
//! as documented in `afdep_kernels::ops::router`. The tests derive their tolerances from the
//! number of these roundings on each path.
//!
//! # Requirements
//! `d_model`, `width` and `shared` multiples of 8 (16-byte bf16 rows: the only shape the layer
//! refuses, [`LayerGpuError::Unsupported`] saying so), any number of experts up to the
//! kernels' limit (`afdep_kernels::sources::MAX_EXPERTS`), any `top_k ≤ experts` up to
//! `MAX_TOP_K`, any token count including 0 (a step of zero tokens writes nothing but zero
//! weight gradients). With an expert count that is not a multiple of 8 the router's two
//! GEMMs of the train step run on copies padded to 16-byte rows (`dlogits`, `Wr` and `dWr`
//! with zero columns; the padding adds exact zeros only). The GEMM kernels may add their own
//! limits (their launchers return [`KernelError::Unsupported`]).
//!
//! # Non-finite values
//! A NaN or infinite router logit (from `x` or `Wr`) is refused before any expert reads the
//! token: the router's top-k masks that token's slots and [`MoeLayer::finish`] returns
//! [`LayerGpuError::Route`] with [`RouteError::NonFiniteLogit`] naming the first such token,
//! exactly as the CPU oracle does (outputs poisoned). Non-finite values anywhere else (expert
//! weights, `dy`) are not checked: they propagate as in PyTorch.

use std::fmt;
use std::str::FromStr;

use afdep_core::route::RouteRules;
use afdep_core::{LayerShape, RouteError, Routes, bf16};
use afdep_kernels::cudarc::driver::CudaSlice;
use afdep_kernels::ops::gemm::{
    self, DswigluIo, Gather, Groups, KOperand, RowWeights, RowsOut, SavedAb, TILE_M, TILE_N,
};
use afdep_kernels::ops::{moe, poison, zeros};
use afdep_kernels::{
    DeviceRoutes, ExpertLayout, GpuContext, KernelError, LogitsDims, LogitsKernel, RouteValidator,
    TopkDims, permute, router_logits, router_topk,
};
use thiserror::Error;

/// How tokens reach the experts and come back (see the module documentation).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Dispatch {
    /// Permuted copy of x, contiguous groups, weighted combine.
    Sorted,
    /// Rows gathered through the sort index, weight in the down-projection, plain combine.
    Gather,
    /// Gather in, weighted atomic scatter out.
    Fused,
    /// Gather in, expert-sorted rows out, weighted gathered sum (deterministic).
    FusedGsum,
}

impl Dispatch {
    /// Every strategy, in the reference record's order (docs/design.md, "The reference record").
    pub const ALL: [Dispatch; 4] = [
        Dispatch::Sorted,
        Dispatch::Gather,
        Dispatch::Fused,
        Dispatch::FusedGsum,
    ];

    /// The record's name (`sorted`, `gather`, `fused`, `fused_gsum`).
    pub fn name(self) -> &'static str {
        match self {
            Dispatch::Sorted => "sorted",
            Dispatch::Gather => "gather",
            Dispatch::Fused => "fused",
            Dispatch::FusedGsum => "fused_gsum",
        }
    }
}

impl fmt::Display for Dispatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Dispatch {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Dispatch::ALL
            .into_iter()
            .find(|d| d.name() == s)
            .ok_or_else(|| {
                format!("unknown dispatch `{s}`: expected sorted, gather, fused or fused_gsum")
            })
    }
}

/// Where a step's routes come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LayerRouting {
    /// The layer's own router (differentiated in the train step).
    Router,
    /// The routes in [`MoeLayer::routes_mut`], written by the caller before the step; they
    /// are validated on the device ([`RouteRules::layer`], rank 0) and their weights are
    /// constants (the router weight gradient is zero).
    Given,
}

/// Why a GPU layer could not be built or a step failed.
#[derive(Debug, Error)]
pub enum LayerGpuError {
    /// A kernel launch, copy or allocation failed.
    #[error(transparent)]
    Kernel(#[from] KernelError),
    /// The shape cannot run on these kernels.
    #[error("unsupported layer: {0}")]
    Unsupported(String),
    /// The routes of the step were rejected (outputs are poisoned).
    #[error("routes rejected: {0}")]
    Route(RouteError),
    /// Host data of the wrong size.
    #[error("`{what}` has {got} elements, the layer needs {want}")]
    Size {
        /// The input.
        what: &'static str,
        /// Given.
        got: usize,
        /// Needed.
        want: usize,
    },
}

/// The layer's parameters (or their gradients) on the device, layouts of
/// [`afdep_core::oracle::LayerParams`].
#[derive(Debug)]
pub struct DeviceParams {
    /// Router, H × E.
    pub wr: CudaSlice<bf16>,
    /// E × H × W.
    pub w1: CudaSlice<bf16>,
    /// E × H × W.
    pub w3: CudaSlice<bf16>,
    /// E × W × H.
    pub w2: CudaSlice<bf16>,
    /// H × S.
    pub s1: CudaSlice<bf16>,
    /// H × S.
    pub s3: CudaSlice<bf16>,
    /// S × H.
    pub s2: CudaSlice<bf16>,
}

impl DeviceParams {
    /// Zeroed parameters (or gradients) of `shape`.
    pub(crate) fn zeros(ctx: &GpuContext, shape: &LayerShape) -> Result<Self, KernelError> {
        let [wr, w1, w3, w2, s1, s3, s2] = afdep_core::oracle::LayerParams::sizes(shape);
        Ok(DeviceParams {
            wr: zeros(ctx, wr)?,
            w1: zeros(ctx, w1)?,
            w3: zeros(ctx, w3)?,
            w2: zeros(ctx, w2)?,
            s1: zeros(ctx, s1)?,
            s3: zeros(ctx, s3)?,
            s2: zeros(ctx, s2)?,
        })
    }

    /// The tensors in `PARAM_NAMES` order.
    pub fn tensors(&self) -> [&CudaSlice<bf16>; 7] {
        [
            &self.wr, &self.w1, &self.w3, &self.w2, &self.s1, &self.s3, &self.s2,
        ]
    }

    /// The tensors in `PARAM_NAMES` order, writable.
    pub fn tensors_mut(&mut self) -> [&mut CudaSlice<bf16>; 7] {
        afdep_core::param_tensors!(mut self)
    }

    /// Bytes on the device.
    pub fn bytes(&self) -> usize {
        self.tensors().iter().map(|t| t.len() * 2).sum()
    }
}

/// Row chunks of one weight-gradient product (see [`splits_for`]).
#[derive(Debug, Clone, Copy)]
struct Splits {
    w2: usize,
    w13: usize,
    s2: usize,
    s13: usize,
    wr: usize,
}

/// The smallest expert width at which the train step permutes dy into the experts' row order
/// (module docs). `dy·W2ᵀ` loads each dy row once per 256-column tile of the width and `dW2`
/// once per 128-row tile of it, so from 1,024 a gathered row is loaded at least four times and
/// one permuting pass (a read and a write of `slots × hidden`) pays for itself. Measured on the
/// H100 (2026-12-07, `docs/perf/moe.md`): width 14,336 (Mixtral-like, 16K tokens) train step
/// 74.9 → 65.2 ms; width 128 (the record's shape, 131K tokens) 13.9 → 14.5 ms, where each row
/// is loaded once and the permute's 2 GB round trip is pure cost; width 2,880 (GPT-OSS-like,
/// 4K) unchanged.
pub const DY_PERMUTE_MIN_WIDTH: usize = 1024;

/// How a train step's `dy·W2ᵀ` and `dW2` read dy (module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DyOrder {
    /// dy permuted into the experts' row order first (contiguous rows, TMA).
    Permuted,
    /// dy rows gathered through the sort index.
    Gathered,
}

thread_local! {
    static FORCED_DY_ORDER: std::cell::Cell<Option<DyOrder>> = const { std::cell::Cell::new(None) };
}

/// Forces the dy order of the train steps queued on this thread (`None`: the width rule,
/// [`DY_PERMUTE_MIN_WIDTH`]); the `Fused` strategy always gathers (it has no rows buffer).
/// For tests that must run both paths at any shape.
pub fn force_dy_order(order: Option<DyOrder>) {
    FORCED_DY_ORDER.with(|f| f.set(order));
}

/// The dy order of a train step of `dispatch` at expert width `w`.
fn dy_order(dispatch: Dispatch, w: usize) -> DyOrder {
    if dispatch == Dispatch::Fused {
        return DyOrder::Gathered;
    }
    FORCED_DY_ORDER
        .with(|f| f.get())
        .unwrap_or(if w >= DY_PERMUTE_MIN_WIDTH {
            DyOrder::Permuted
        } else {
            DyOrder::Gathered
        })
}

/// Chunks of the row sum of a weight gradient with `tiles` output tiles over `rows` rows: enough
/// tiles to fill the GPU twice, each chunk at least 1024 rows, at most 32 chunks.
fn splits_for(tiles: usize, rows: usize, sms: usize) -> usize {
    let want = (2 * sms).div_ceil(tiles.max(1));
    want.min(rows / 1024).clamp(1, 32)
}

/// The MoE layer on one GPU (see the module documentation).
#[derive(Debug)]
pub struct MoeLayer {
    shape: LayerShape,
    tokens: usize,
    dispatch: Dispatch,
    train: bool,
    params: DeviceParams,
    grads: Option<DeviceParams>,
    x: CudaSlice<bf16>,
    dy: CudaSlice<bf16>,
    out: CudaSlice<bf16>,
    dx: CudaSlice<bf16>,
    routes: DeviceRoutes,
    logits: CudaSlice<f32>,
    layout: ExpertLayout,
    validator: RouteValidator,
    /// Permuted x (sorted only), slots × H.
    xs: CudaSlice<bf16>,
    /// h of the routed experts, slots × W. In the backward, once the down projection has read
    /// it, `h` holds w·h (the dW2 operand; the shared expert's `sh` does the same), so the
    /// train step needs no second slots × W buffer. The forward's a, b live in `dab`.
    h: CudaSlice<bf16>,
    /// Expert-sorted rows (y in the forward; in the backward dy permuted into the experts' row
    /// order when the width reaches [`DY_PERMUTE_MIN_WIDTH`] or [`force_dy_order`] asks, then
    /// the dx rows), slots × H; empty for fused.
    rows: CudaSlice<bf16>,
    /// Token-order f32 accumulator (output, then dx), T × H.
    acc: CudaSlice<f32>,
    /// Shared expert [a | b] rows (train), T × 2S, and h, T × S.
    sab: CudaSlice<bf16>,
    sh: CudaSlice<bf16>,
    /// [da | db] rows: max(slots × 2W, T × 2S) (train). A train step's forward keeps the
    /// routed experts' [a | b] rows here, and the SwiGLU backward turns them into [da | db] in
    /// place ([`SavedAb::InPlace`]): no buffer of their own (2 × slots × W bf16 less).
    dab: CudaSlice<bf16>,
    /// g[slot] = <dy_t, y_k> (train, router).
    gsum: CudaSlice<f32>,
    /// dlogits, T × `router_ld` (train, router; the columns from E on are zero).
    dlogits: CudaSlice<bf16>,
    /// E rounded up to a multiple of 8: the row length of the router's GEMM operands.
    router_ld: usize,
    /// Wr padded to H × `router_ld` (train, only when E is not a multiple of 8).
    wr_pad: CudaSlice<bf16>,
    /// dWr of H × `router_ld` before it is cut back to H × E (as `wr_pad`).
    gwr_pad: CudaSlice<bf16>,
    /// Weight-gradient f32 partials (only for products split in chunks; else empty).
    ws: CudaSlice<f32>,
    splits: Splits,
}

/// Rows of `v` bf16 values must be 16-byte aligned (the kernels' vector loads and the GEMMs'
/// operand rows): `v` a positive multiple of 8.
fn row_aligned(what: &str, v: usize) -> Result<(), LayerGpuError> {
    if v == 0 || v % 8 != 0 {
        return Err(LayerGpuError::Unsupported(format!(
            "{what} = {v}: a row of {v} bf16 values is {} bytes, not a multiple of 16 (rows \
             must be 16-byte aligned: {what} a positive multiple of 8)",
            2 * v
        )));
    }
    Ok(())
}

impl MoeLayer {
    /// A layer of `shape` for `tokens` tokens; `train` also allocates what the train step
    /// needs. Parameters, inputs and outputs start zeroed.
    pub fn new(
        ctx: &GpuContext,
        shape: LayerShape,
        tokens: usize,
        dispatch: Dispatch,
        train: bool,
    ) -> Result<Self, LayerGpuError> {
        shape
            .validate()
            .map_err(|e| LayerGpuError::Unsupported(e.to_string()))?;
        let (h, w, e, k, s) = (
            shape.d_model,
            shape.width,
            shape.experts,
            shape.top_k,
            shape.shared,
        );
        row_aligned("d_model", h)?;
        row_aligned("width", w)?;
        if s > 0 {
            row_aligned("shared", s)?;
        }
        let router_ld = e.next_multiple_of(8);
        if e > gemm::MAX_GROUPS {
            return Err(LayerGpuError::Unsupported(format!(
                "{e} experts: the grouped GEMM takes at most {}",
                gemm::MAX_GROUPS
            )));
        }
        let slots = tokens
            .checked_mul(k)
            .ok_or_else(|| LayerGpuError::Unsupported("tokens × top_k overflows".into()))?;
        let t = |n: bool, len: usize| if n { len } else { 0 };
        let sorted = dispatch == Dispatch::Sorted;
        let fused = dispatch == Dispatch::Fused;
        let sms = ctx.sm_count() as usize;
        let tiles = |m: usize, n: usize| m.div_ceil(TILE_M) * n.div_ceil(TILE_N);
        let per_expert = slots / e;
        let splits = Splits {
            w2: splits_for(e * tiles(w, h), per_expert, sms),
            w13: splits_for(e * tiles(h, 2 * w), per_expert, sms),
            s2: splits_for(tiles(s, h), tokens, sms),
            s13: splits_for(tiles(h, 2 * s), tokens, sms),
            wr: splits_for(tiles(h, router_ld), tokens, sms),
        };
        // f32 partials only for the products split in chunks (one chunk stores bf16 directly).
        let part = |n: usize, len: usize| if n > 1 { n * len } else { 0 };
        let ws_len = if train {
            [
                part(splits.w2, e * w * h),
                part(splits.w13, e * h * 2 * w),
                part(splits.s2, s * h),
                part(splits.s13, h * 2 * s),
                part(splits.wr, h * router_ld),
            ]
            .into_iter()
            .max()
            .unwrap_or(0)
        } else {
            0
        };
        let layout = ExpertLayout::new(ctx, tokens, k, e)?;
        Ok(MoeLayer {
            shape,
            tokens,
            dispatch,
            train,
            params: DeviceParams::zeros(ctx, &shape)?,
            grads: if train {
                Some(DeviceParams::zeros(ctx, &shape)?)
            } else {
                None
            },
            x: zeros(ctx, tokens * h)?,
            dy: zeros(ctx, t(train, tokens * h))?,
            out: zeros(ctx, tokens * h)?,
            dx: zeros(ctx, t(train, tokens * h))?,
            routes: DeviceRoutes::zeros(ctx, tokens, k)?,
            logits: zeros(ctx, tokens * e)?,
            layout,
            validator: RouteValidator::new(ctx)?,
            xs: zeros(ctx, t(sorted, slots * h))?,
            h: zeros(ctx, slots * w)?,
            rows: zeros(ctx, t(!fused, slots * h))?,
            acc: zeros(ctx, tokens * h)?,
            sab: zeros(ctx, t(train, tokens * 2 * s))?,
            sh: zeros(ctx, tokens * s)?,
            dab: zeros(ctx, t(train, (slots * 2 * w).max(tokens * 2 * s)))?,
            gsum: zeros(ctx, t(train, slots))?,
            dlogits: zeros(ctx, t(train, tokens * router_ld))?,
            router_ld,
            wr_pad: zeros(ctx, t(train && router_ld != e, h * router_ld))?,
            gwr_pad: zeros(ctx, t(train && router_ld != e, h * router_ld))?,
            ws: zeros(ctx, ws_len)?,
            splits,
        })
    }

    /// The shape.
    pub fn shape(&self) -> &LayerShape {
        &self.shape
    }
    /// Tokens per step.
    pub fn tokens(&self) -> usize {
        self.tokens
    }
    /// The dispatch strategy.
    pub fn dispatch(&self) -> Dispatch {
        self.dispatch
    }
    /// The parameters (write them with [`MoeLayer::upload_params`] or in place).
    pub fn params_mut(&mut self) -> &mut DeviceParams {
        &mut self.params
    }
    /// The parameters, read-only (e.g. for [`crate::reference::ReferenceLayer::run_like`]).
    pub fn params(&self) -> &DeviceParams {
        &self.params
    }
    /// Whether the layer was built for the train step (it has `dy`, `dx` and gradients).
    pub fn is_train(&self) -> bool {
        self.train
    }
    /// The parameter gradients of the last train step (none for a forward-only layer).
    pub fn grads(&self) -> Option<&DeviceParams> {
        self.grads.as_ref()
    }
    /// The input x, T × H.
    pub fn x_mut(&mut self) -> &mut CudaSlice<bf16> {
        &mut self.x
    }
    /// The upstream gradient dy, T × H (train layers).
    pub fn dy_mut(&mut self) -> &mut CudaSlice<bf16> {
        &mut self.dy
    }
    /// The input x, T × H, read-only.
    pub fn x(&self) -> &CudaSlice<bf16> {
        &self.x
    }
    /// The upstream gradient dy, T × H, read-only (empty for a forward-only layer).
    pub fn dy(&self) -> &CudaSlice<bf16> {
        &self.dy
    }
    /// The output of the last step, T × H.
    pub fn out(&self) -> &CudaSlice<bf16> {
        &self.out
    }
    /// dx of the last train step, T × H.
    pub fn dx(&self) -> &CudaSlice<bf16> {
        &self.dx
    }
    /// The output buffer, T × H, writable (every step overwrites all of it; a caller may swap
    /// in a buffer of the same length, see [`crate::external`]).
    pub fn out_mut(&mut self) -> &mut CudaSlice<bf16> {
        &mut self.out
    }
    /// The dx buffer, T × H (empty for a forward-only layer), writable as [`MoeLayer::out_mut`].
    pub fn dx_mut(&mut self) -> &mut CudaSlice<bf16> {
        &mut self.dx
    }
    /// The parameter gradients' buffers (none for a forward-only layer), writable as
    /// [`MoeLayer::out_mut`]: every train step overwrites all of them.
    pub fn grads_mut(&mut self) -> Option<&mut DeviceParams> {
        self.grads.as_mut()
    }
    /// The routes of the last step (the router's), or where to write given routes.
    pub fn routes(&self) -> &DeviceRoutes {
        &self.routes
    }
    /// The route buffers, to write given routes before a [`LayerRouting::Given`] step.
    pub fn routes_mut(&mut self) -> &mut DeviceRoutes {
        &mut self.routes
    }

    /// Device bytes held by the layer (every buffer; allocated once, so this is the layer's
    /// peak).
    pub fn device_bytes(&self) -> usize {
        let g = self.grads.as_ref().map_or(0, DeviceParams::bytes);
        let b16 = [
            &self.x,
            &self.dy,
            &self.out,
            &self.dx,
            &self.xs,
            &self.h,
            &self.rows,
            &self.sab,
            &self.sh,
            &self.dab,
            &self.dlogits,
            &self.wr_pad,
            &self.gwr_pad,
        ]
        .iter()
        .map(|s| s.len() * 2)
        .sum::<usize>();
        let f32s = [&self.acc, &self.gsum, &self.ws, &self.logits]
            .iter()
            .map(|s| s.len() * 4)
            .sum::<usize>();
        let tables =
            self.routes.device_bytes() + self.layout.device_bytes() + self.validator.device_bytes();
        self.params.bytes() + g + b16 + f32s + tables
    }

    /// Copies host parameters to the device (waits for nothing).
    pub fn upload_params(
        &mut self,
        ctx: &GpuContext,
        p: &afdep_core::oracle::LayerParams,
    ) -> Result<(), LayerGpuError> {
        if p.shape != self.shape {
            return Err(LayerGpuError::Unsupported(format!(
                "parameters of shape {:?} for a layer of shape {:?}",
                p.shape, self.shape
            )));
        }
        for (dst, src) in self.params.tensors_mut().into_iter().zip(p.tensors()) {
            upload_into(ctx, "parameter", src, dst)?;
        }
        Ok(())
    }

    /// Copies host x (T × H) into the layer.
    pub fn upload_x(&mut self, ctx: &GpuContext, x: &[bf16]) -> Result<(), LayerGpuError> {
        upload_into(ctx, "x", x, &mut self.x)
    }

    /// Copies host dy (T × H) into the layer.
    pub fn upload_dy(&mut self, ctx: &GpuContext, dy: &[bf16]) -> Result<(), LayerGpuError> {
        upload_into(ctx, "dy", dy, &mut self.dy)
    }

    /// Copies host routes into the layer (for [`LayerRouting::Given`]).
    pub fn upload_routes(&mut self, ctx: &GpuContext, r: &Routes) -> Result<(), LayerGpuError> {
        if r.tokens != self.tokens || r.top_k != self.shape.top_k {
            return Err(LayerGpuError::Size {
                what: "routes",
                got: r.tokens * r.top_k,
                want: self.tokens * self.shape.top_k,
            });
        }
        upload_into(ctx, "route ids", &r.idx, &mut self.routes.idx)?;
        upload_into(ctx, "route weights", &r.weights, &mut self.routes.weights)
    }

    /// Queues the forward pass (no host sync): routes, validation, layout, experts, combine,
    /// shared expert, one cast. Call [`MoeLayer::finish`] before reading the output. This is
    /// the inference forward: it does not keep the activations a backward needs (the train
    /// step runs its own forward that does).
    pub fn enqueue_forward(
        &mut self,
        ctx: &GpuContext,
        routing: LayerRouting,
    ) -> Result<(), LayerGpuError> {
        self.queue_forward(ctx, routing, false)
    }

    /// The forward; `keep` stores the SwiGLU inputs [a | b] for the backward (routed: in
    /// `dab`, shared: in `sab`).
    fn queue_forward(
        &mut self,
        ctx: &GpuContext,
        routing: LayerRouting,
        keep: bool,
    ) -> Result<(), LayerGpuError> {
        let sh = self.shape;
        let (hd, w, e, k, s) = (sh.d_model, sh.width, sh.experts, sh.top_k, sh.shared);
        let tokens = self.tokens;
        let slots = tokens * k;
        if routing == LayerRouting::Router {
            router_logits(
                ctx,
                &self.x,
                &self.params.wr,
                LogitsDims::new(tokens, hd, e, k),
                &mut self.logits,
                LogitsKernel::Auto,
            )?;
            router_topk(
                ctx,
                &self.logits,
                TopkDims::new(tokens, e, k, sh.renormalize),
                &mut self.routes,
                Some(&mut self.validator),
            )?;
        }
        self.validator.poison_word(ctx)?;
        if routing == LayerRouting::Router {
            self.validator.launch_routed(
                ctx,
                &self.logits,
                &self.routes,
                &RouteRules::layer(&sh),
                0,
            )?;
        } else {
            self.validator
                .launch(ctx, &self.routes, &RouteRules::layer(&sh), 0)?;
        }
        if tokens == 0 {
            // Nothing to route, compute or combine: the outputs are empty.
            return Ok(());
        }
        self.layout.build(ctx, &self.routes.idx)?;
        let (groups, gather, rw) = expert_views(&self.layout, &self.routes.weights, e, k, slots);
        let (xin, xg) = if self.dispatch == Dispatch::Sorted {
            permute(ctx, &self.x, hd, &self.layout, &mut self.xs)?;
            (&self.xs, None)
        } else {
            (&self.x, Some(gather))
        };
        gemm::up_swiglu(
            ctx,
            groups,
            xin,
            xg,
            &self.params.w1,
            &self.params.w3,
            hd,
            w,
            &mut self.h,
            keep.then_some(&mut self.dab),
        )?;
        // the router weight applied in the GEMM's epilogue (gather, fused) or in the combine
        let fused = self.dispatch == Dispatch::Fused;
        if fused {
            ctx.stream()
                .memset_zeros(&mut self.acc)
                .map_err(KernelError::driver("zeroing the accumulator"))?;
        }
        let out = match self.dispatch {
            Dispatch::Fused => RowsOut::Scatter {
                acc: &mut self.acc,
                weights: rw,
                weighted: true,
            },
            Dispatch::Gather => RowsOut::Store {
                out: &mut self.rows,
                weights: Some(rw),
            },
            Dispatch::Sorted | Dispatch::FusedGsum => RowsOut::Store {
                out: &mut self.rows,
                weights: None,
            },
        };
        gemm::down(ctx, groups, &self.h, &self.params.w2, w, hd, out)?;
        if !fused {
            let combine_w = (self.dispatch != Dispatch::Gather).then_some(&self.routes.weights);
            moe::combine(ctx, &self.rows, hd, &self.layout, combine_w, &mut self.acc)?;
        }
        if s > 0 {
            let dense = Groups::Dense { rows: tokens };
            gemm::up_swiglu(
                ctx,
                dense,
                &self.x,
                None,
                &self.params.s1,
                &self.params.s3,
                hd,
                s,
                &mut self.sh,
                keep.then_some(&mut self.sab),
            )?;
            gemm::down(
                ctx,
                dense,
                &self.sh,
                &self.params.s2,
                s,
                hd,
                RowsOut::Finish {
                    acc: &self.acc,
                    out: &mut self.out,
                },
            )?;
        } else {
            moe::cast(ctx, &self.acc, tokens * hd, e, k, &mut self.out)?;
        }
        Ok(())
    }

    /// Queues a train step (no host sync): the forward pass, then the gradients of
    /// `Σ(out ⊙ dy)` with respect to x ([`MoeLayer::dx`]) and every parameter
    /// ([`MoeLayer::grads`]), dy taken from [`MoeLayer::dy_mut`].
    pub fn enqueue_train_step(
        &mut self,
        ctx: &GpuContext,
        routing: LayerRouting,
    ) -> Result<(), LayerGpuError> {
        if !self.train {
            return Err(LayerGpuError::Unsupported(
                "this layer was built for the forward pass only".into(),
            ));
        }
        self.queue_forward(ctx, routing, true)?;
        let sh = self.shape;
        let (hd, w, e, k, s) = (sh.d_model, sh.width, sh.experts, sh.top_k, sh.shared);
        let tokens = self.tokens;
        let slots = tokens * k;
        let router = routing == LayerRouting::Router;
        let grads = self.grads.as_mut().expect("train layers have gradients");
        let stream = ctx.stream();
        if tokens == 0 {
            // The gradients of an empty sum: zero (dx and out are empty).
            for g in grads.tensors_mut() {
                stream.memset_zeros(g).map_err(KernelError::driver(
                    "zeroing the gradients of an empty step",
                ))?;
            }
            return Ok(());
        }
        let (groups, gather, rw) = expert_views(&self.layout, &self.routes.weights, e, k, slots);
        if router {
            stream
                .memset_zeros(&mut self.gsum)
                .map_err(KernelError::driver("zeroing the router gradient sums"))?;
        }
        // dy in the experts' row order, into `rows` (dead between the forward's combine, which
        // read y from it, and the dx GEMM, which writes it): the two products that read dy then
        // load contiguous rows (TMA in the rows GEMM) instead of gathering each row through the
        // slot index. Only from DY_PERMUTE_MIN_WIDTH (or when forced); the fused strategy has no
        // `rows` and always gathers.
        let fused = self.dispatch == Dispatch::Fused;
        let (dyr, dyg) = if dy_order(self.dispatch, w) == DyOrder::Gathered {
            (&self.dy, Some(gather))
        } else {
            permute(ctx, &self.dy, hd, &self.layout, &mut self.rows)?;
            (&self.rows, None)
        };
        // G = dy·W2ᵀ with the SwiGLU backward: [da | db], w·h, g.
        gemm::dh_dswiglu(
            ctx,
            groups,
            dyr,
            dyg,
            &self.params.w2,
            w,
            hd,
            DswigluIo {
                // the forward's [a | b] rows, replaced by [da | db]
                ab: SavedAb::InPlace,
                dab: &mut self.dab,
                // h is dead after the forward's down projection: w·h replaces it
                hw: Some(&mut self.h),
                weights: Some(rw),
                gsum: if router { Some(&mut self.gsum) } else { None },
            },
        )?;
        // dW2_e = Σ (w·h)ᵀ dy over the expert's rows.
        let dyk = match dyg {
            None => KOperand::rows(dyr, hd),
            Some(g) => KOperand::gathered(dyr, hd, g),
        };
        gemm::wgrad(
            ctx,
            groups,
            KOperand::rows(&self.h, w),
            dyk,
            w,
            hd,
            self.splits.w2,
            &mut self.ws,
            &mut grads.w2,
            None,
        )?;
        // [dW1 | dW3]_e = Σ xᵀ [da | db].
        let xop = if self.dispatch == Dispatch::Sorted {
            KOperand::rows(&self.xs, hd)
        } else {
            KOperand::gathered(&self.x, hd, gather)
        };
        gemm::wgrad(
            ctx,
            groups,
            xop,
            KOperand::rows(&self.dab, 2 * w),
            hd,
            2 * w,
            self.splits.w13,
            &mut self.ws,
            &mut grads.w1,
            Some((&mut grads.w3, w)),
        )?;
        // dx_k = [da | db]·[W1 | W3]ᵀ, summed per token in slot order (or scattered).
        if fused {
            stream
                .memset_zeros(&mut self.acc)
                .map_err(KernelError::driver("zeroing the dx accumulator"))?;
        }
        let out = if fused {
            RowsOut::Scatter {
                acc: &mut self.acc,
                weights: rw,
                weighted: false,
            }
        } else {
            RowsOut::Store {
                out: &mut self.rows,
                weights: None,
            }
        };
        gemm::dx(
            ctx,
            groups,
            &self.dab,
            &self.params.w1,
            Some(&self.params.w3),
            w,
            hd,
            out,
        )?;
        if !fused {
            moe::combine(ctx, &self.rows, hd, &self.layout, None, &mut self.acc)?;
        }
        // The shared expert, weight 1 on every token.
        if s > 0 {
            let dense = Groups::Dense { rows: tokens };
            gemm::dh_dswiglu(
                ctx,
                dense,
                &self.dy,
                None,
                &self.params.s2,
                s,
                hd,
                DswigluIo {
                    ab: SavedAb::Separate(&self.sab),
                    dab: &mut self.dab,
                    hw: Some(&mut self.sh),
                    weights: None,
                    gsum: None,
                },
            )?;
            gemm::wgrad(
                ctx,
                dense,
                KOperand::rows(&self.sh, s),
                KOperand::rows(&self.dy, hd),
                s,
                hd,
                self.splits.s2,
                &mut self.ws,
                &mut grads.s2,
                None,
            )?;
            gemm::wgrad(
                ctx,
                dense,
                KOperand::rows(&self.x, hd),
                KOperand::rows(&self.dab, 2 * s),
                hd,
                2 * s,
                self.splits.s13,
                &mut self.ws,
                &mut grads.s1,
                Some((&mut grads.s3, s)),
            )?;
            let out = if router {
                RowsOut::Add { acc: &mut self.acc }
            } else {
                RowsOut::Finish {
                    acc: &self.acc,
                    out: &mut self.dx,
                }
            };
            // `Finish` reads acc and writes dx; `Add` updates acc in place.
            gemm::dx(
                ctx,
                dense,
                &self.dab,
                &self.params.s1,
                Some(&self.params.s3),
                s,
                hd,
                out,
            )?;
        }
        if router {
            moe::router_backward(
                ctx,
                &self.logits,
                &self.routes,
                e,
                &self.gsum,
                sh.renormalize,
                &mut self.dlogits,
                self.router_ld,
            )?;
            // E not a multiple of 8: the GEMMs see Wr and dWr with zero columns up to
            // `router_ld` (16-byte rows); the extra products are exact zeros.
            let ld = self.router_ld;
            let padded = ld != e;
            if padded {
                moe::copy_cols(ctx, &self.params.wr, e, &mut self.wr_pad, ld, hd, e, e, k)?;
            }
            let (wr_op, gwr) = if padded {
                (&self.wr_pad, &mut self.gwr_pad)
            } else {
                (&self.params.wr, &mut grads.wr)
            };
            gemm::wgrad(
                ctx,
                Groups::Dense { rows: tokens },
                KOperand::rows(&self.x, hd),
                KOperand {
                    buf: &self.dlogits,
                    ld,
                    gather: None,
                },
                hd,
                ld,
                self.splits.wr,
                &mut self.ws,
                gwr,
                None,
            )?;
            if padded {
                moe::copy_cols(ctx, &self.gwr_pad, ld, &mut grads.wr, e, hd, e, e, k)?;
            }
            gemm::dx(
                ctx,
                Groups::Dense { rows: tokens },
                &self.dlogits,
                wr_op,
                None,
                ld,
                hd,
                RowsOut::Finish {
                    acc: &self.acc,
                    out: &mut self.dx,
                },
            )?;
        } else {
            stream
                .memset_zeros(&mut grads.wr)
                .map_err(KernelError::driver("zeroing the router gradient"))?;
            if s == 0 {
                moe::cast(ctx, &self.acc, tokens * hd, e, k, &mut self.dx)?;
            }
        }
        Ok(())
    }

    /// Fills the outputs (out, dx, the gradients) with all-ones bits (NaN), without waiting:
    /// before a correctness run, so that anything a step fails to write reads as NaN.
    pub fn poison_outputs(&mut self, ctx: &GpuContext) -> Result<(), LayerGpuError> {
        poison(ctx, &mut self.out)?;
        poison(ctx, &mut self.dx)?;
        if let Some(g) = self.grads.as_mut() {
            for t in g.tensors_mut() {
                poison(ctx, t)?;
            }
        }
        Ok(())
    }

    /// Waits for the queued step and checks it: a rejected route table poisons the outputs
    /// (and gradients) and is returned as [`LayerGpuError::Route`]; a kernel's bounded wait that
    /// ran out ([`GpuContext::take_fault`]) poisons them too and is returned as
    /// [`KernelError::DeviceFault`].
    pub fn finish(&mut self, ctx: &GpuContext) -> Result<(), LayerGpuError> {
        let routes = self.validator.result(ctx)?;
        if let Err(fault) = ctx.take_fault() {
            self.poison_outputs(ctx)?;
            ctx.synchronize()?;
            return Err(fault.into());
        }
        match routes {
            Ok(()) => Ok(()),
            Err(e) => {
                self.poison_outputs(ctx)?;
                ctx.synchronize()?;
                Err(LayerGpuError::Route(e))
            }
        }
    }

    /// [`MoeLayer::enqueue_forward`] then [`MoeLayer::finish`].
    pub fn forward(
        &mut self,
        ctx: &GpuContext,
        routing: LayerRouting,
    ) -> Result<(), LayerGpuError> {
        self.enqueue_forward(ctx, routing)?;
        self.finish(ctx)
    }

    /// [`MoeLayer::enqueue_train_step`] then [`MoeLayer::finish`].
    pub fn train_step(
        &mut self,
        ctx: &GpuContext,
        routing: LayerRouting,
    ) -> Result<(), LayerGpuError> {
        self.enqueue_train_step(ctx, routing)?;
        self.finish(ctx)
    }
}

fn upload_into<T: afdep_kernels::cudarc::driver::DeviceRepr + Copy>(
    ctx: &GpuContext,
    what: &'static str,
    src: &[T],
    dst: &mut CudaSlice<T>,
) -> Result<(), LayerGpuError> {
    if src.len() != dst.len() {
        return Err(LayerGpuError::Size {
            what,
            got: src.len(),
            want: dst.len(),
        });
    }
    if src.is_empty() {
        return Ok(());
    }
    ctx.stream()
        .memcpy_htod(src, dst)
        .map_err(KernelError::driver(format!("uploading {what}")))?;
    Ok(())
}

/// The GEMMs' views of the expert layout of one pass (`slots` = tokens × `top_k` rows over
/// `experts` groups): the groups, the gather of token rows by slot, and the router weight of
/// each row (`weights`, by slot).
fn expert_views<'a>(
    layout: &'a ExpertLayout,
    weights: &'a CudaSlice<f32>,
    experts: usize,
    top_k: usize,
    slots: usize,
) -> (Groups<'a>, Gather<'a>, RowWeights<'a>) {
    let groups = Groups::Experts {
        offsets: &layout.offsets,
        experts,
        capacity: slots,
    };
    let gather = Gather {
        index: &layout.row_slot,
        div: top_k,
    };
    let rw = RowWeights {
        row_slot: &layout.row_slot,
        weights,
        top_k,
    };
    (groups, gather, rw)
}
