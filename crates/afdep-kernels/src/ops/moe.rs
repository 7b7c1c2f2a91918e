//! The MoE layer's per-token kernels around the grouped GEMMs (`cuda/moe.cu`): the routed
//! combine into an f32 accumulator, the final cast to bf16, and the router backward.

use afdep_core::bf16;
use cudarc::driver::{CudaSlice, PushKernelArg};

use super::layout::ExpertLayout;
use super::{DeviceRoutes, as_u32, grid, need};
use crate::context::{GpuContext, launch_err};
use crate::error::KernelError;
use crate::sources::{BLOCK, KernelId};

/// `acc[t] = Σ_{k ascending, unmasked} w_k · y[row(t, k)]` in f32 (each product and sum
/// rounded, the oracle's combine order), or the plain sum `Σ_k y[row(t, k)]` with
/// `weights = None`. `y` holds `layout.slots() × hidden` rows in the layout's order, `acc` is
/// `tokens × hidden` (every element written). `hidden` must be a multiple of 8.
pub fn combine(
    ctx: &GpuContext,
    y: &CudaSlice<bf16>,
    hidden: usize,
    layout: &ExpertLayout,
    weights: Option<&CudaSlice<f32>>,
    acc: &mut CudaSlice<f32>,
) -> Result<(), KernelError> {
    let tokens = layout.tokens;
    if tokens == 0 {
        return Ok(());
    }
    if hidden % 8 != 0 {
        return Err(KernelError::Unsupported(format!(
            "hidden = {hidden}: the combine needs a multiple of 8"
        )));
    }
    need("y", y, layout.slots() * hidden)?;
    need("accumulator", acc, tokens * hidden)?;
    if let Some(w) = weights {
        need("route weights", w, layout.slots())?;
    }
    let h = as_u32("hidden", hidden)?;
    let k = as_u32("top_k", layout.top_k)?;
    let e = as_u32("experts", layout.experts)?;
    let t = tokens as u64;
    let f = ctx.function(KernelId::MoeCombine, e, k)?;
    let null: u64 = 0;
    let mut b = ctx.stream().launch_builder(&f);
    b.arg(y).arg(&layout.slot_row);
    match weights {
        Some(w) => b.arg(w),
        None => b.arg(&null),
    };
    b.arg(acc).arg(&t).arg(&h);
    // SAFETY: afdep_moe_combine(const u16* y, const u32* slot_row, const float* weights,
    // float* acc, u64 tokens, u32 hidden) with K compiled in: warp t reads K entries of
    // slot_row and weights (tokens × K, checked; weights may be null), the rows they name
    // (< slots; y holds slots × hidden) and writes acc[t] (tokens × hidden, checked).
    unsafe { b.launch(grid(t.div_ceil(u64::from(BLOCK / 32)))?) }
        .map_err(launch_err(KernelId::MoeCombine))?;
    Ok(())
}

/// `out[i] = bf16(acc[i])` for the first `n` elements. `experts`/`top_k` name the module.
pub fn cast(
    ctx: &GpuContext,
    acc: &CudaSlice<f32>,
    n: usize,
    experts: usize,
    top_k: usize,
    out: &mut CudaSlice<bf16>,
) -> Result<(), KernelError> {
    if n == 0 {
        return Ok(());
    }
    need("accumulator", acc, n)?;
    need("output", out, n)?;
    let f = ctx.function(
        KernelId::MoeCast,
        as_u32("experts", experts)?,
        as_u32("top_k", top_k)?,
    )?;
    let n64 = n as u64;
    let mut b = ctx.stream().launch_builder(&f);
    b.arg(acc).arg(out).arg(&n64);
    // SAFETY: afdep_moe_cast(const float* acc, u16* out, u64 n): a grid-stride loop over
    // i < n; both buffers hold at least n elements (checked).
    unsafe { b.launch(grid(n64.div_ceil(u64::from(BLOCK)).min(1 << 16))?) }
        .map_err(launch_err(KernelId::MoeCast))?;
    Ok(())
}

/// The router backward: from the forward's `logits` (`tokens × experts` f32), its routes and
/// `g[t·K + k] = <dy_t, y_k>` (f32), `dlogits` (`tokens × ld` bf16, `ld ≥ experts`, the
/// columns from `experts` on written as zeros) as in docs/design.md, "Specification: Router"
/// (softmax and renormalisation backward; top-k selection not differentiated).
#[allow(clippy::too_many_arguments)]
pub fn router_backward(
    ctx: &GpuContext,
    logits: &CudaSlice<f32>,
    routes: &DeviceRoutes,
    experts: usize,
    g: &CudaSlice<f32>,
    renormalize: bool,
    dlogits: &mut CudaSlice<bf16>,
    ld: usize,
) -> Result<(), KernelError> {
    let tokens = routes.tokens;
    if tokens == 0 {
        return Ok(());
    }
    if ld < experts || ld > experts.next_multiple_of(32) {
        return Err(KernelError::Shape(format!(
            "dlogits rows of {ld} values for {experts} experts (from {experts} to the next \
             multiple of 32)"
        )));
    }
    let slots = tokens * routes.top_k;
    need("logits", logits, tokens * experts)?;
    need("g", g, slots)?;
    need("dlogits", dlogits, tokens * ld)?;
    let e = as_u32("experts", experts)?;
    let k = as_u32("top_k", routes.top_k)?;
    let t = as_u32("tokens", tokens)?;
    let ld32 = as_u32("ld", ld)?;
    let renorm = u32::from(renormalize);
    let f = ctx.function(KernelId::RouterBackward, e, k)?;
    let mut b = ctx.stream().launch_builder(&f);
    b.arg(logits)
        .arg(&routes.idx)
        .arg(&routes.weights)
        .arg(g)
        .arg(dlogits)
        .arg(&t)
        .arg(&renorm)
        .arg(&ld32);
    // SAFETY: afdep_router_backward(const float* logits, const i32* idx, const float* weights,
    // const float* g, u16* dlogits, u32 tokens, u32 renormalize, u32 ld) with E and K compiled
    // in: warp t reads E logits, K ids, weights and g of its token and writes ld dlogits
    // (E <= ld <= 32 · ceil(E / 32), the lanes' reach); the buffers hold tokens × E,
    // tokens × K and tokens × ld (checked).
    unsafe { b.launch(grid(u64::from(t).div_ceil(u64::from(BLOCK / 32)))?) }
        .map_err(launch_err(KernelId::RouterBackward))?;
    Ok(())
}

/// `dst[r, c] = src[r, c]` for `c < cols`, `0` for `cols ≤ c < dst_ld`, over `rows` rows of
/// bf16 with row strides `src_ld ≥ cols` and `dst_ld ≥ cols`: pads a router matrix to 16-byte
/// rows for the GEMMs, or cuts its gradient back. `experts`/`top_k` name the module.
#[allow(clippy::too_many_arguments)]
pub fn copy_cols(
    ctx: &GpuContext,
    src: &CudaSlice<bf16>,
    src_ld: usize,
    dst: &mut CudaSlice<bf16>,
    dst_ld: usize,
    rows: usize,
    cols: usize,
    experts: usize,
    top_k: usize,
) -> Result<(), KernelError> {
    if rows == 0 || dst_ld == 0 {
        return Ok(());
    }
    if cols > src_ld || cols > dst_ld {
        return Err(KernelError::Shape(format!(
            "copy of {cols} columns between rows of {src_ld} and {dst_ld}"
        )));
    }
    need("source", src, (rows - 1) * src_ld + cols)?;
    need("destination", dst, rows * dst_ld)?;
    let f = ctx.function(
        KernelId::MoeCopyCols,
        as_u32("experts", experts)?,
        as_u32("top_k", top_k)?,
    )?;
    let (sl, dl, r, c) = (src_ld as u64, dst_ld as u64, rows as u64, cols as u64);
    let n = r * dl;
    let mut b = ctx.stream().launch_builder(&f);
    b.arg(src).arg(&sl).arg(dst).arg(&dl).arg(&r).arg(&c);
    // SAFETY: afdep_moe_copy_cols(const u16* src, u64 src_ld, u16* dst, u64 dst_ld, u64 rows,
    // u64 cols): a grid-stride loop over rows × dst_ld destination elements (held, checked),
    // reading src[r · src_ld + c] only for c < cols (the last one at (rows − 1) · src_ld +
    // cols − 1, held, checked).
    unsafe { b.launch(grid(n.div_ceil(u64::from(BLOCK)).min(1 << 16))?) }
        .map_err(launch_err(KernelId::MoeCopyCols))?;
    Ok(())
}
