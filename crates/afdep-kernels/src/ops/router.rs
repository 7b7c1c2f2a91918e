//! The router: logits, softmax, top-k and weights (docs/design.md, "Specification: Router",
//! `afdep_core::route`).
//!
//! **Logits.** `hidden` a multiple of 8 (16-byte rows): the tensor-core kernel
//! (`afdep_router_logits_mma`, mma.sync bf16 → f32, 128 tokens per block, tails predicated);
//! otherwise the SIMT kernel (`afdep_router_logits`). Both read x once and write the f32
//! logits (the train step's router backward reads them).
//!
//! **Non-finite logits.** [`router_topk`] masks every slot of a token whose logits are
//! not all finite and leaves its key in a [`RouteValidator`]'s state, whose next
//! [`RouteValidator::launch_routed`] reports [`afdep_core::RouteError::NonFiniteLogit`] (the
//! first such token, its lowest such expert), as the CPU oracle does; no expert id is ever made
//! from a NaN.
//!
//! **Tolerance.** The GPU is not bit-exact with the CPU reference in the logits and the
//! probabilities: the logits kernels accumulate in their own order, and the softmax
//! uses `expf` and a tree sum (the CPU sums in ascending order). Logits agree within
//! `1e-5 · Σ_h |x_h·w_h|`; probabilities within a few ulps (relative `1e-6`). Selection and
//! weights are exact functions of the probabilities: ties go to the lower expert id, the
//! renormalising sum runs in slot order, and equal logits give bit-identical probabilities on
//! both sides, so tied inputs select identically. Only experts whose probabilities differ by
//! less than the tolerance may come out in a different order. Logits must be finite.

use afdep_core::{LayerShape, bf16};
use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};

use super::validate::RouteValidator;
use super::{DeviceRoutes, as_u32, grid, need, zeros};
use crate::context::{GpuContext, launch_err};
use crate::error::KernelError;
use crate::sources::{BLOCK, KernelId, ModuleSpec, SourceFile};

/// Tokens and experts per block of the SIMT logits kernel.
const LOGITS_TILE: u32 = 64;
/// Tokens per block of the tensor-core logits kernel (`RM_M`).
const MMA_TOKENS: u32 = 128;
/// Most experts per block of the tensor-core logits kernel (`RM_N`): wider routers take
/// `ceil(round_up(E, 16) / 128)` column blocks per token block (the kernel's column tile is 128
/// wide whenever E is above 64, so the count is the same).
const MMA_EXPERTS: u32 = 128;
/// k-step of the tensor-core logits kernel (`RM_K`).
const MMA_K: u32 = 64;
/// Shared-memory stages of its cp.async ring (`RM_S`).
const MMA_STAGES: u32 = 3;

/// The tensor-core logits kernel's column tile for `experts` (`RM_N`): E rounded up to 16, then
/// to a power of two, at most 128.
fn mma_col_tile(experts: u32) -> u32 {
    experts
        .next_multiple_of(16)
        .next_power_of_two()
        .clamp(16, MMA_EXPERTS)
}

/// Dynamic shared memory of the tensor-core logits kernel for `experts`, bytes: `RM_S` stages
/// of a `RM_M × (RM_K + 8)` x tile and a `RM_K × (RM_N + 8)` wr tile, bf16 (the kernel's
/// `RM_A_STAGE` and `RM_B_STAGE`; the 8-element pads make its ldmatrix reads conflict-free).
pub fn mma_smem_bytes(experts: u32) -> u32 {
    MMA_STAGES * (MMA_TOKENS * (MMA_K + 8) + MMA_K * (mma_col_tile(experts) + 8)) * 2
}

fn check_spec(experts: usize, top_k: usize) -> Result<(u32, u32), KernelError> {
    let e = as_u32("experts", experts)?;
    let k = as_u32("top_k", top_k)?;
    ModuleSpec::new(SourceFile::Router, e, k)
        .check()
        .map_err(KernelError::Unsupported)?;
    Ok((e, k))
}

/// The sizes of a logits problem: `x` is `tokens × hidden`, the router `hidden × experts`;
/// `top_k` only selects the module (the logits kernel shares the router module with top-k).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LogitsDims {
    /// Tokens T.
    pub tokens: usize,
    /// Hidden size H.
    pub hidden: usize,
    /// Experts E.
    pub experts: usize,
    /// Experts per token K.
    pub top_k: usize,
}

impl LogitsDims {
    /// `tokens × hidden` against `hidden × experts`, in the module of `top_k`.
    pub fn new(tokens: usize, hidden: usize, experts: usize, top_k: usize) -> Self {
        LogitsDims {
            tokens,
            hidden,
            experts,
            top_k,
        }
    }
}

/// Which kernel computes the logits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LogitsKernel {
    /// Tensor cores when `hidden` is a multiple of 8, the SIMT kernel otherwise.
    #[default]
    Auto,
    /// The SIMT kernel whatever `hidden` is (the fallback, kept callable for comparisons).
    Simt,
}

/// `logits = x·wr` in f32: `x` is `tokens × hidden` bf16, `wr` is `hidden × experts` bf16,
/// `logits` is `tokens × experts` f32, all row-major ([`LogitsDims`]), on `kernel`.
pub fn router_logits(
    ctx: &GpuContext,
    x: &CudaSlice<bf16>,
    wr: &CudaSlice<bf16>,
    dims: LogitsDims,
    logits: &mut CudaSlice<f32>,
    kernel: LogitsKernel,
) -> Result<(), KernelError> {
    let LogitsDims {
        tokens,
        hidden,
        experts,
        top_k,
    } = dims;
    let mma = kernel == LogitsKernel::Auto && hidden % 8 == 0;
    let (e, k) = check_spec(experts, top_k)?;
    if tokens == 0 {
        return Ok(());
    }
    need("x", x, tokens * hidden)?;
    need("wr", wr, hidden * experts)?;
    need("logits", logits, tokens * experts)?;
    let t = as_u32("tokens", tokens)?;
    let h = as_u32("hidden", hidden)?;
    let (id, grid_dim) = if mma {
        let col_blocks = e.next_multiple_of(16).div_ceil(MMA_EXPERTS);
        let blocks = u64::from(t.div_ceil(MMA_TOKENS)) * u64::from(col_blocks);
        let blocks = u32::try_from(blocks).map_err(|_| {
            KernelError::Unsupported(format!("{tokens} tokens: too many router blocks"))
        })?;
        (KernelId::RouterLogitsMma, (blocks, 1, 1))
    } else {
        (
            KernelId::RouterLogits,
            (t.div_ceil(LOGITS_TILE), e.div_ceil(LOGITS_TILE), 1),
        )
    };
    let f = ctx.function(id, e, k)?;
    let smem = if mma { mma_smem_bytes(e) } else { 0 };
    if mma {
        // above the 48 KiB default at every E (the ring's three stages)
        f.set_attribute(
            cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            smem as i32,
        )
        .map_err(KernelError::driver(format!(
            "setting {id}'s shared memory size to {smem} bytes"
        )))?;
    }
    let cfg = LaunchConfig {
        grid_dim,
        block_dim: (BLOCK, 1, 1),
        shared_mem_bytes: smem,
    };
    let mut b = ctx.stream().launch_builder(&f);
    b.arg(x).arg(wr).arg(logits).arg(&t).arg(&h);
    // SAFETY: afdep_router_logits and afdep_router_logits_mma both take (const u16* x,
    // const u16* wr, float* logits, u32 tokens, u32 hidden) with E = `experts` compiled in;
    // bf16 is 16-bit storage. The buffers hold tokens × hidden, hidden × experts and
    // tokens × experts elements (checked above), and the kernels bound every access by tokens,
    // hidden and E. The mma kernel's 16-byte loads of x need hidden % 8 == 0 (chosen only
    // then) and a 16-byte aligned x: a CudaSlice starts at its allocation (256-byte aligned);
    // so do its 16-byte loads of wr when E % 8 == 0 (rows of E elements, 16-byte multiples).
    // Its dynamic shared memory is `mma_smem_bytes(E)`, the size its stages index (the
    // function's limit raised to it above).
    unsafe { b.launch(cfg) }.map_err(launch_err(id))?;
    Ok(())
}

/// The sizes and rule of a top-k problem: `tokens × experts` logits, `top_k` experts per
/// token, the selected probabilities divided by their sum when `renormalize`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TopkDims {
    /// Tokens T.
    pub tokens: usize,
    /// Experts E.
    pub experts: usize,
    /// Experts per token K.
    pub top_k: usize,
    /// Whether the selected probabilities are divided by their sum.
    pub renormalize: bool,
}

impl TopkDims {
    /// `top_k` of `experts` for each of `tokens` tokens.
    pub fn new(tokens: usize, experts: usize, top_k: usize, renormalize: bool) -> Self {
        TopkDims {
            tokens,
            experts,
            top_k,
            renormalize,
        }
    }
}

/// Softmax, top-k (ties to the lower id) and weights from `tokens × experts` f32 logits, into
/// `out` (`tokens × top_k`; `out.top_k` must equal `top_k`). A token with a non-finite logit
/// gets masked slots; with a `validator`, the first such token is also recorded in its state,
/// and the next [`RouteValidator::launch_routed`] with the same logits reports it as
/// [`afdep_core::RouteError::NonFiniteLogit`].
pub fn router_topk(
    ctx: &GpuContext,
    logits: &CudaSlice<f32>,
    dims: TopkDims,
    out: &mut DeviceRoutes,
    validator: Option<&mut RouteValidator>,
) -> Result<(), KernelError> {
    let TopkDims {
        tokens,
        experts,
        top_k,
        renormalize,
    } = dims;
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
    let null: u64 = 0;
    let mut b = ctx.stream().launch_builder(&f);
    b.arg(logits)
        .arg(&mut out.idx)
        .arg(&mut out.weights)
        .arg(&t)
        .arg(&renorm);
    match validator {
        Some(v) => b.arg(v.state_mut()),
        None => b.arg(&null),
    };
    // SAFETY: afdep_router_topk(const float* logits, i32* idx, float* weights, u32 tokens,
    // u32 renormalize, u32* state) with E and K compiled in; one warp per token reads E logits
    // of its row and writes K ids and weights; the buffers hold tokens × E and tokens × K
    // (checked). `state` is null or a validator's state (STATE_WORDS u32, 256-byte aligned:
    // its 64-bit router key at word 8 is aligned).
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
    let dims = LogitsDims::new(tokens, shape.d_model, shape.experts, shape.top_k);
    router_logits(ctx, x, wr, dims, &mut logits, LogitsKernel::Auto)?;
    let mut out = DeviceRoutes::zeros(ctx, tokens, shape.top_k)?;
    let dims = TopkDims::new(tokens, shape.experts, shape.top_k, shape.renormalize);
    router_topk(ctx, &logits, dims, &mut out, None)?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The launcher's tile constants are the kernel's, and its shared-memory size is what the
    /// kernel's stages index.
    #[test]
    fn mma_constants_match_the_kernel() {
        let text = include_str!("../../cuda/router.cu");
        for line in [
            format!("#define RM_M {MMA_TOKENS}"),
            format!("#define RM_K {MMA_K}"),
            format!("#define RM_S {MMA_STAGES}"),
            "#define RM_AS (RM_K + 8)".to_string(),
            "#define RM_BS (RM_N + 8)".to_string(),
        ] {
            assert!(text.contains(&line), "router.cu lacks `{line}`");
        }
        // RM_N: E rounded up to 16, then to a power of two, at most 128
        for (e, n) in [
            (1, 16),
            (5, 16),
            (16, 16),
            (24, 32),
            (48, 64),
            (64, 64),
            (96, 128),
        ] {
            assert_eq!(mma_col_tile(e), n, "E {e}");
        }
        assert_eq!(mma_col_tile(129), 128);
        assert_eq!(mma_col_tile(256), 128);
        // E 64: 3 × (128 × 72 + 64 × 72) × 2 bytes; two blocks fit the H100's 227 KiB at E 128
        assert_eq!(mma_smem_bytes(64), 3 * (128 * 72 + 64 * 72) * 2);
        assert!(2 * mma_smem_bytes(128) <= 227 * 1024);
    }
}
