//! The router: logits, softmax, top-k and weights (brief section 4, `afdep_core::route`).
//!
//! **Tolerance.** The GPU is not bit-exact with the CPU reference in the logits and the
//! probabilities: the logits kernel accumulates with FMAs in its own order, and the softmax
//! uses `expf` and a tree sum (the CPU sums in ascending order). Logits agree within
//! `1e-5 · Σ_h |x_h·w_h|`; probabilities within a few ulps (relative `1e-6`). Selection and
//! weights are exact functions of the probabilities: ties go to the lower expert id, the
//! renormalising sum runs in slot order, and equal logits give bit-identical probabilities on
//! both sides, so tied inputs select identically. Only experts whose probabilities differ by
//! less than the tolerance may come out in a different order. Logits must be finite.

use afdep_core::{LayerShape, bf16};
use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};

use super::{DeviceRoutes, as_u32, grid, need, zeros};
use crate::context::{GpuContext, launch_err};
use crate::error::KernelError;
use crate::sources::{BLOCK, KernelId, ModuleSpec, SourceFile};

/// Tokens and experts per block of the logits kernel.
const LOGITS_TILE: u32 = 64;

fn check_spec(experts: usize, top_k: usize) -> Result<(u32, u32), KernelError> {
    let e = as_u32("experts", experts)?;
    let k = as_u32("top_k", top_k)?;
    ModuleSpec::new(SourceFile::Router, e, k)
        .check()
        .map_err(KernelError::Unsupported)?;
    Ok((e, k))
}

/// `logits = x·wr` in f32: `x` is `tokens × hidden` bf16, `wr` is `hidden × experts` bf16,
/// `logits` is `tokens × experts` f32, all row-major. `top_k` only selects the module (the
/// logits kernel shares the router module with top-k).
#[allow(clippy::too_many_arguments)]
pub fn router_logits(
    ctx: &GpuContext,
    x: &CudaSlice<bf16>,
    wr: &CudaSlice<bf16>,
    tokens: usize,
    hidden: usize,
    experts: usize,
    top_k: usize,
    logits: &mut CudaSlice<f32>,
) -> Result<(), KernelError> {
    let (e, k) = check_spec(experts, top_k)?;
    if tokens == 0 {
        return Ok(());
    }
    need("x", x, tokens * hidden)?;
    need("wr", wr, hidden * experts)?;
    need("logits", logits, tokens * experts)?;
    let t = as_u32("tokens", tokens)?;
    let h = as_u32("hidden", hidden)?;
    let f = ctx.function(KernelId::RouterLogits, e, k)?;
    let cfg = LaunchConfig {
        grid_dim: (t.div_ceil(LOGITS_TILE), e.div_ceil(LOGITS_TILE), 1),
        block_dim: (BLOCK, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut b = ctx.stream().launch_builder(&f);
    b.arg(x).arg(wr).arg(logits).arg(&t).arg(&h);
    // SAFETY: afdep_router_logits(const u16* x, const u16* wr, float* logits, u32 tokens,
    // u32 hidden) with E = `experts` compiled in; bf16 is 16-bit storage. The buffers hold
    // tokens × hidden, hidden × experts and tokens × experts elements (checked above), and the
    // kernel bounds every access by tokens, hidden and E.
    unsafe { b.launch(cfg) }.map_err(launch_err(KernelId::RouterLogits))?;
    Ok(())
}

/// Softmax, top-k (ties to the lower id) and weights from `tokens × experts` f32 logits, into
/// `out` (`tokens × top_k`; `out.top_k` must equal `top_k`). `renormalize` divides the
/// selected probabilities by their sum.
pub fn router_topk(
    ctx: &GpuContext,
    logits: &CudaSlice<f32>,
    tokens: usize,
    experts: usize,
    top_k: usize,
    renormalize: bool,
    out: &mut DeviceRoutes,
) -> Result<(), KernelError> {
    let (e, k) = check_spec(experts, top_k)?;
    if out.top_k != top_k || out.tokens != tokens {
        return Err(KernelError::Shape(format!(
            "output routes are {} × {}, the router makes {tokens} × {top_k}",
            out.tokens, out.top_k
        )));
    }
    if tokens == 0 {
        return Ok(());
    }
    need("logits", logits, tokens * experts)?;
    need("route ids", &out.idx, tokens * top_k)?;
    need("route weights", &out.weights, tokens * top_k)?;
    let t = as_u32("tokens", tokens)?;
    let renorm = u32::from(renormalize);
    let f = ctx.function(KernelId::RouterTopk, e, k)?;
    let cfg = grid(u64::from(t).div_ceil(u64::from(BLOCK / 32)))?;
    let mut b = ctx.stream().launch_builder(&f);
    b.arg(logits)
        .arg(&mut out.idx)
        .arg(&mut out.weights)
        .arg(&t)
        .arg(&renorm);
    // SAFETY: afdep_router_topk(const float* logits, i32* idx, float* weights, u32 tokens,
    // u32 renormalize) with E and K compiled in; one warp per token reads E logits of its row
    // and writes K ids and weights; the buffers hold tokens × E and tokens × K (checked).
    unsafe { b.launch(cfg) }.map_err(launch_err(KernelId::RouterTopk))?;
    Ok(())
}

/// The whole router for `tokens` rows of `x` (`tokens × d_model`) with `wr`
/// (`d_model × experts`): logits, then top-k and weights per `shape`. Returns the routes.
pub fn router(
    ctx: &GpuContext,
    x: &CudaSlice<bf16>,
    wr: &CudaSlice<bf16>,
    tokens: usize,
    shape: &LayerShape,
) -> Result<DeviceRoutes, KernelError> {
    let mut logits = zeros::<f32>(ctx, tokens * shape.experts)?;
    router_logits(
        ctx,
        x,
        wr,
        tokens,
        shape.d_model,
        shape.experts,
        shape.top_k,
        &mut logits,
    )?;
    let mut out = DeviceRoutes::zeros(ctx, tokens, shape.top_k)?;
    router_topk(
        ctx,
        &logits,
        tokens,
        shape.experts,
        shape.top_k,
        shape.renormalize,
        &mut out,
    )?;
    Ok(out)
}
