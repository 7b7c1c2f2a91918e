//! The simple GPU reference path of the MoE layer (`cuda/reference.cu`): untuned kernels that
//! are obviously correct, for the error columns of the benchmark at sizes the CPU oracle cannot
//! reach. `afdep_moe::reference` composes them into the layer's forward pass and train step.
//!
//! # Why each kernel is obviously correct
//! - One thread per output element; every sum is a plain loop in ascending order of its index,
//!   in f32 (`__fmaf_rn` for dot products; separately rounded products and sums where
//!   `afdep_core::oracle::layer` rounds them, e.g. the combine's `acc + w·y`), and each output
//!   is cast to bf16 once. No tensor cores, no tiling, no shared memory.
//! - No atomics where the order matters: the only atomics are the minimum of
//!   [`check_routes`], the counts and maximum of [`topk_check`] and the maxima / or of
//!   [`err_stats`], whose results do not depend on order. The per-expert row lists ([`expert_rows`]) are a stable counting sort built with
//!   plain per-thread loops.
//! - Shapes are run-time values ([`RefDims`]): any E, K, H, W, S, and tokens = 0. Every index
//!   on the device is 64-bit.
//!
//! # Summation orders
//! | kernel | output element | sum |
//! |---|---|---|
//! | [`logits`] | `logits[t][e]` | `h` ascending |
//! | [`topk_check`] | per token: counts only | `h` ascending (logits and absolute sums) |
//! | [`softmax`] | `p[t][·]` | exponentials, `e` ascending |
//! | [`weights`] | `w[t][k]` | renormalising sum, `k` ascending |
//! | [`expert_up`], [`shared_up`] | `a`, `b`, `h` of (slot or token, column) | `h` ascending |
//! | [`combine`] | `out[t][c]` | per slot `i` ascending; slots `k` ascending; then shared |
//! | [`expert_dh`], [`shared_dab`] | `dh` of (slot or token, column) | `c` ascending |
//! | [`router_g`] | `g[j] = <h_j, dy·W2ᵀ>` | `i` ascending |
//! | [`router_dlogits`] | `dl[t][e]` | slots ascending, then experts ascending |
//! | [`dx`] | `dx[t][c]` | per slot `i` ascending; slots ascending; shared; router |
//! | [`grad_w2`], [`grad_w13`] | one element of `dW_e` | the expert's rows (token, slot) ascending |
//! | [`grad_s2`], [`grad_s13`], [`grad_wr`] | one weight-gradient element | tokens ascending |
//!
//! Every launcher checks its buffers against the shape ([`KernelError::Shape`]), returns
//! without launching when there is nothing to compute, and launches on the context's stream
//! without waiting.

use afdep_core::{LayerShape, bf16};
use cudarc::driver::{CudaSlice, DeviceRepr, LaunchConfig, PushKernelArg};

use super::{DeviceRoutes, grid, need, poison};
use crate::context::{GpuContext, launch_err};
use crate::error::KernelError;
use crate::sources::{BLOCK, KernelId};

/// Most blocks of one launch (every kernel loops over its elements with a grid stride).
const MAX_BLOCKS: u64 = 1 << 20;

/// Slots per chunk of the row-list counting sort.
pub const ROWS_CHUNK: usize = 1024;

/// The run-time shape of the reference kernels: `struct AfdepRefDims` of `reference.cu`
/// (six `u64`, in this order). Built by [`RefDims::new`], which checks that every buffer size
/// the kernels use fits in `usize`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RefDims {
    tokens: u64,
    hidden: u64,
    width: u64,
    experts: u64,
    top_k: u64,
    shared: u64,
}

// SAFETY: `RefDims` is `repr(C)` with six `u64` fields and no padding, the layout of
// `AfdepRefDims` in reference.cu; it is passed by value and every bit pattern is valid.
unsafe impl DeviceRepr for RefDims {}

impl RefDims {
    /// The dimensions of `shape` at `tokens` tokens; [`KernelError::Unsupported`] when a buffer
    /// size of the reference (`T·K·max(H, W)`, `T·max(H, S, E)`, `E·H·W`, ...) overflows.
    pub fn new(shape: &LayerShape, tokens: usize) -> Result<RefDims, KernelError> {
        let (h, w, e, k, s) = (
            shape.d_model,
            shape.width,
            shape.experts,
            shape.top_k,
            shape.shared,
        );
        let fits = |v: &[usize]| {
            v.iter()
                .try_fold(1usize, |acc, &x| acc.checked_mul(x))
                .and_then(|p| p.checked_mul(8))
                .is_some()
        };
        let wide = h.max(w).max(s).max(e).max(1);
        let ok = fits(&[tokens, k, wide])
            && fits(&[tokens, wide])
            && fits(&[e, wide, wide])
            && fits(&[h, wide])
            && e.checked_add(1).is_some();
        if !ok {
            return Err(KernelError::Unsupported(format!(
                "{tokens} tokens of shape {shape:?}: the reference's buffer sizes overflow"
            )));
        }
        Ok(RefDims {
            tokens: tokens as u64,
            hidden: h as u64,
            width: w as u64,
            experts: e as u64,
            top_k: k as u64,
            shared: s as u64,
        })
    }

    /// Tokens.
    pub fn tokens(&self) -> usize {
        self.tokens as usize
    }
    /// Hidden size H.
    pub fn hidden(&self) -> usize {
        self.hidden as usize
    }
    /// Expert width W.
    pub fn width(&self) -> usize {
        self.width as usize
    }
    /// Experts E.
    pub fn experts(&self) -> usize {
        self.experts as usize
    }
    /// Slots per token K.
    pub fn top_k(&self) -> usize {
        self.top_k as usize
    }
    /// Shared width S.
    pub fn shared(&self) -> usize {
        self.shared as usize
    }
    /// Slots, `T·K`.
    pub fn slots(&self) -> usize {
        self.tokens() * self.top_k()
    }
    /// Chunks of [`ROWS_CHUNK`] slots (the row-list sort's workspace is `chunks × E`).
    pub fn chunks(&self) -> usize {
        self.slots().div_ceil(ROWS_CHUNK)
    }
}

/// The launch of `total` elements over a grid-stride loop.
fn cfg(total: usize) -> Result<LaunchConfig, KernelError> {
    grid((total as u64).div_ceil(u64::from(BLOCK)).min(MAX_BLOCKS))
}

/// A null device pointer for an absent optional buffer.
const NULL: u64 = 0;

fn routes_fit(routes: &DeviceRoutes, d: &RefDims) -> Result<(), KernelError> {
    if routes.tokens != d.tokens() || routes.top_k != d.top_k() {
        return Err(KernelError::Shape(format!(
            "routes are {} × {}, the reference needs {} × {}",
            routes.tokens,
            routes.top_k,
            d.tokens(),
            d.top_k()
        )));
    }
    need("route ids", &routes.idx, d.slots())?;
    need("route weights", &routes.weights, d.slots())
}

/// `dst[b][c][r] = src[b][r][c]` for `batch` matrices of `rows × cols` bf16 (an exact copy).
pub fn transpose(
    ctx: &GpuContext,
    src: &CudaSlice<bf16>,
    batch: usize,
    rows: usize,
    cols: usize,
    dst: &mut CudaSlice<bf16>,
) -> Result<(), KernelError> {
    let n = batch
        .checked_mul(rows)
        .and_then(|v| v.checked_mul(cols))
        .ok_or_else(|| KernelError::Unsupported("transpose size overflows".into()))?;
    if n == 0 {
        return Ok(());
    }
    need("transpose source", src, n)?;
    need("transpose destination", dst, n)?;
    let (b64, r64, c64) = (batch as u64, rows as u64, cols as u64);
    let f = ctx.function(KernelId::RefTranspose, 0, 0)?;
    let mut b = ctx.stream().launch_builder(&f);
    b.arg(src).arg(dst).arg(&b64).arg(&r64).arg(&c64);
    // SAFETY: afdep_ref_transpose(const u16* src, u16* dst, u64 batch, u64 rows, u64 cols):
    // element n < batch·rows·cols reads src[n'] with n' < batch·rows·cols and writes dst[n];
    // both hold at least that many elements (checked).
    unsafe { b.launch(cfg(n)?) }.map_err(launch_err(KernelId::RefTranspose))?;
    Ok(())
}

/// Finds the first slot (lowest `t·K + k`) that `afdep_core::route::validate` with
/// `RouteRules::layer` would reject (negative, wide, duplicate and, with `given`, a non-finite
/// weight on an unmasked slot): `first[0]` is its index, or `u64::MAX` when every slot is valid.
/// Sets `first[0]` to `u64::MAX` itself before the search.
pub fn check_routes(
    ctx: &GpuContext,
    d: &RefDims,
    routes: &DeviceRoutes,
    given: bool,
    first: &mut CudaSlice<u64>,
) -> Result<(), KernelError> {
    routes_fit(routes, d)?;
    need("first offending slot", first, 1)?;
    poison(ctx, first)?;
    if d.slots() == 0 {
        return Ok(());
    }
    let given = u32::from(given);
    let f = ctx.function(KernelId::RefCheckRoutes, 0, 0)?;
    let mut b = ctx.stream().launch_builder(&f);
    b.arg(&routes.idx)
        .arg(&routes.weights)
        .arg(d)
        .arg(&given)
        .arg(first);
    // SAFETY: afdep_ref_check_routes(const i32* idx, const float* weights, AfdepRefDims d,
    // u32 given, u64* first): slot j < T·K reads idx and weights at j and at the earlier slots
    // of its token (both hold T·K, checked) and may atomically lower first[0] (1 element).
    unsafe { b.launch(cfg(d.slots())?) }.map_err(launch_err(KernelId::RefCheckRoutes))?;
    Ok(())
}

/// `probs[t][e] = Σ_h x[t][h]·wr[h][e]` (the logits, f32; [`softmax`] turns them into
/// probabilities in place). `x` is T × H, `wr` H × E, `probs` T × E.
pub fn logits(
    ctx: &GpuContext,
    d: &RefDims,
    x: &CudaSlice<bf16>,
    wr: &CudaSlice<bf16>,
    probs: &mut CudaSlice<f32>,
) -> Result<(), KernelError> {
    let n = d.tokens() * d.experts();
    if n == 0 {
        return Ok(());
    }
    need("x", x, d.tokens() * d.hidden())?;
    need("wr", wr, d.hidden() * d.experts())?;
    need("probs", probs, n)?;
    let f = ctx.function(KernelId::RefLogits, 0, 0)?;
    let mut b = ctx.stream().launch_builder(&f);
    b.arg(x).arg(wr).arg(probs).arg(d);
    // SAFETY: afdep_ref_logits(const u16* x, const u16* wr, float* probs, AfdepRefDims d):
    // element (t, e) reads x[t][0..H] and wr[0..H][e] and writes probs[t][e]; the buffers hold
    // T·H, H·E and T·E elements (checked).
    unsafe { b.launch(cfg(n)?) }.map_err(launch_err(KernelId::RefLogits))?;
    Ok(())
}

/// The independent check of a router's expert choice (`afdep_ref_topk_check`): for every
/// token, the logits `x·Wr` are recomputed with their absolute sums, and the chosen ids of
/// `routes` are compared with every other expert within the rounding radius of two f32
/// evaluations and of the softmax (the kernel's comment derives it). `stats` (3 elements,
/// zeroed here) gets the number of tokens whose choice is wrong beyond that radius (or that
/// hold a masked slot), the number of near-tie tokens (where two correct routers may differ),
/// and `u64::MAX - t` for the first wrong token `t` (see [`TopkStats::from_raw`]).
pub fn topk_check(
    ctx: &GpuContext,
    d: &RefDims,
    x: &CudaSlice<bf16>,
    wr: &CudaSlice<bf16>,
    routes: &DeviceRoutes,
    stats: &mut CudaSlice<u64>,
) -> Result<(), KernelError> {
    routes_fit(routes, d)?;
    need("top-k check statistics", stats, 3)?;
    ctx.stream()
        .memset_zeros(stats)
        .map_err(KernelError::driver("zeroing the top-k check statistics"))?;
    if d.tokens() == 0 {
        return Ok(());
    }
    need("x", x, d.tokens() * d.hidden())?;
    need("wr", wr, d.hidden() * d.experts())?;
    let f = ctx.function(KernelId::RefTopkCheck, 0, 0)?;
    let mut b = ctx.stream().launch_builder(&f);
    b.arg(x).arg(wr).arg(&routes.idx).arg(d).arg(stats);
    // SAFETY: afdep_ref_topk_check(const u16* x, const u16* wr, const i32* idx, AfdepRefDims d,
    // u64* stats): token t reads x[t][0..H], wr[0..H][0..E] and idx[t][0..K] and atomically
    // updates stats[0..3]; the buffers hold T·H, H·E, T·K and 3 elements (checked).
    unsafe { b.launch(cfg(d.tokens())?) }.map_err(launch_err(KernelId::RefTopkCheck))?;
    Ok(())
}

/// What [`topk_check`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct TopkStats {
    /// Tokens whose chosen experts are provably not the top-k (or hold a masked slot).
    pub wrong: u64,
    /// Tokens with a near tie at the top-k boundary (not an error).
    pub near_ties: u64,
    /// The first wrong token.
    pub first_wrong: Option<usize>,
}

impl TopkStats {
    /// From the three words [`topk_check`] writes.
    pub fn from_raw(raw: &[u64]) -> TopkStats {
        let at = |i: usize| raw.get(i).copied().unwrap_or(0);
        TopkStats {
            wrong: at(0),
            near_ties: at(1),
            first_wrong: (at(0) > 0).then(|| (u64::MAX - at(2)) as usize),
        }
    }
}

/// The oracle's softmax of every row of `probs` (T × E), in place, one thread per token.
pub fn softmax(
    ctx: &GpuContext,
    d: &RefDims,
    probs: &mut CudaSlice<f32>,
) -> Result<(), KernelError> {
    if d.tokens() == 0 {
        return Ok(());
    }
    need("probs", probs, d.tokens() * d.experts())?;
    let f = ctx.function(KernelId::RefSoftmax, 0, 0)?;
    let mut b = ctx.stream().launch_builder(&f);
    b.arg(probs).arg(d);
    // SAFETY: afdep_ref_softmax(float* probs, AfdepRefDims d): thread t reads and writes
    // probs[t][0..E]; probs holds T·E elements (checked).
    unsafe { b.launch(cfg(d.tokens())?) }.map_err(launch_err(KernelId::RefSoftmax))?;
    Ok(())
}

/// The weight of every slot into `weights` (T × K; 0 on masked slots). With `probs` (the
/// router): `p[e_k] / Σ_k p[e_k]` (sum in slot order) with `renormalize`, else `p[e_k]`;
/// without: the weights of `routes` (given routes). Only the ids of `routes` are read in the
/// router case. The ids must have passed [`check_routes`].
pub fn weights(
    ctx: &GpuContext,
    d: &RefDims,
    probs: Option<&CudaSlice<f32>>,
    routes: &DeviceRoutes,
    renormalize: bool,
    weights: &mut CudaSlice<f32>,
) -> Result<(), KernelError> {
    routes_fit(routes, d)?;
    if d.tokens() == 0 {
        return Ok(());
    }
    if let Some(p) = probs {
        need("probs", p, d.tokens() * d.experts())?;
    }
    need("weights", weights, d.slots())?;
    let renorm = u32::from(renormalize);
    let f = ctx.function(KernelId::RefWeights, 0, 0)?;
    let mut b = ctx.stream().launch_builder(&f);
    match probs {
        Some(p) => b.arg(p),
        None => b.arg(&NULL),
    };
    b.arg(&routes.idx)
        .arg(&routes.weights)
        .arg(weights)
        .arg(d)
        .arg(&renorm);
    // SAFETY: afdep_ref_weights(const float* probs, const i32* idx, const float* given,
    // float* weights, AfdepRefDims d, u32 renormalize): thread t reads idx, given and writes
    // weights at t·K .. t·K + K (each holds T·K, checked), and with probs (T·E, checked; may be
    // null) reads probs[t][id] for ids in 0..E (checked by check_routes).
    unsafe { b.launch(cfg(d.tokens())?) }.map_err(launch_err(KernelId::RefWeights))?;
    Ok(())
}

/// The expert row lists of `routes` (ids checked by [`check_routes`]): expert `e` owns rows
/// `offsets[e] .. offsets[e + 1]` (`offsets`: E + 1), `rows[r]` is the flat slot `t·K + k` of
/// row `r` and `toks[r]` its token (both at least T·K), in the stable order token ascending,
/// then slot ascending (the oracle's grouping). `counts` is the workspace
/// (`d.chunks() × E`).
pub fn expert_rows(
    ctx: &GpuContext,
    d: &RefDims,
    routes: &DeviceRoutes,
    counts: &mut CudaSlice<u64>,
    offsets: &mut CudaSlice<u64>,
    rows: &mut CudaSlice<u64>,
    toks: &mut CudaSlice<u64>,
) -> Result<(), KernelError> {
    routes_fit(routes, d)?;
    let (e, chunks) = (d.experts(), d.chunks());
    need("chunk counts", counts, chunks * e)?;
    need("offsets", offsets, e + 1)?;
    need("rows", rows, d.slots())?;
    need("row tokens", toks, d.slots())?;
    let chunk = ROWS_CHUNK as u64;
    let chunks64 = chunks as u64;
    let s = ctx.stream();
    if chunks > 0 {
        let f = ctx.function(KernelId::RefRowsCount, 0, 0)?;
        let mut b = s.launch_builder(&f);
        b.arg(&routes.idx).arg(&mut *counts).arg(d).arg(&chunk);
        // SAFETY: afdep_ref_rows_count(const i32* idx, u64* counts, AfdepRefDims d, u64 chunk):
        // thread (c, e) < chunks·E reads idx[j] for j of chunk c (< T·K, idx holds T·K) and
        // writes counts[c·E + e] (counts holds chunks·E, checked).
        unsafe { b.launch(cfg(chunks * e)?) }.map_err(launch_err(KernelId::RefRowsCount))?;
    }
    let f = ctx.function(KernelId::RefRowsScan, 0, 0)?;
    let mut b = s.launch_builder(&f);
    b.arg(&mut *counts).arg(&mut *offsets).arg(d).arg(&chunks64);
    // SAFETY: afdep_ref_rows_scan(u64* counts, u64* offsets, AfdepRefDims d, u64 chunks):
    // thread e < E reads and writes counts[c·E + e] for c < chunks (chunks·E, checked) and
    // writes offsets[e + 1] (E + 1, checked).
    unsafe { b.launch(cfg(e)?) }.map_err(launch_err(KernelId::RefRowsScan))?;
    let f = ctx.function(KernelId::RefRowsOffsets, 0, 0)?;
    let mut b = s.launch_builder(&f);
    b.arg(&mut *offsets).arg(d);
    // SAFETY: afdep_ref_rows_offsets(u64* offsets, AfdepRefDims d): one thread reads and
    // writes offsets[0..=E] (E + 1, checked).
    unsafe { b.launch(cfg(1)?) }.map_err(launch_err(KernelId::RefRowsOffsets))?;
    if chunks > 0 {
        let f = ctx.function(KernelId::RefRowsScatter, 0, 0)?;
        let mut b = s.launch_builder(&f);
        b.arg(&routes.idx)
            .arg(&*counts)
            .arg(&*offsets)
            .arg(rows)
            .arg(toks)
            .arg(d)
            .arg(&chunk);
        // SAFETY: afdep_ref_rows_scatter(const i32* idx, const u64* counts, const u64* offsets,
        // u64* rows, u64* toks, AfdepRefDims d, u64 chunk): thread (c, e) reads the ids of chunk
        // c, counts[c·E + e] and offsets[e], and writes rows and toks at the positions
        // offsets[e] + (earlier matches), which are distinct and below the number of unmasked
        // slots ≤ T·K (rows and toks hold T·K, checked).
        unsafe { b.launch(cfg(chunks * e)?) }.map_err(launch_err(KernelId::RefRowsScatter))?;
    }
    Ok(())
}

/// Routed experts' up-projection, one thread per (slot, column): `a`, `b` (when given) and
/// `h = silu(a)·b` of every slot (slots × W, zeros on masked slots). Ids checked by
/// [`check_routes`].
#[allow(clippy::too_many_arguments)]
pub fn expert_up(
    ctx: &GpuContext,
    d: &RefDims,
    x: &CudaSlice<bf16>,
    routes: &DeviceRoutes,
    w1: &CudaSlice<bf16>,
    w3: &CudaSlice<bf16>,
    ab: Option<(&mut CudaSlice<f32>, &mut CudaSlice<f32>)>,
    h: &mut CudaSlice<f32>,
) -> Result<(), KernelError> {
    routes_fit(routes, d)?;
    let n = d.slots() * d.width();
    if n == 0 {
        return Ok(());
    }
    let ehw = d.experts() * d.hidden() * d.width();
    need("x", x, d.tokens() * d.hidden())?;
    need("w1", w1, ehw)?;
    need("w3", w3, ehw)?;
    need("h", h, n)?;
    let f = ctx.function(KernelId::RefExpertUp, 0, 0)?;
    let mut b = ctx.stream().launch_builder(&f);
    b.arg(x).arg(&routes.idx).arg(w1).arg(w3);
    match ab {
        Some((a, bb)) => {
            need("a", a, n)?;
            need("b", bb, n)?;
            b.arg(a).arg(bb)
        }
        None => b.arg(&NULL).arg(&NULL),
    };
    b.arg(h).arg(d);
    // SAFETY: afdep_ref_expert_up(const u16* x, const i32* idx, const u16* w1, const u16* w3,
    // float* a, float* b, float* h, AfdepRefDims d): element (j, i) < T·K·W reads idx[j]
    // (T·K), x[t][0..H] (T·H), w1/w3 of expert idx[j] < E (E·H·W each) and writes a, b (may be
    // null) and h at (j, i) (T·K·W each); all checked.
    unsafe { b.launch(cfg(n)?) }.map_err(launch_err(KernelId::RefExpertUp))?;
    Ok(())
}

/// The shared expert's up-projection, one thread per (token, column): `a`, `b` (when given)
/// and `h` (T × S each).
pub fn shared_up(
    ctx: &GpuContext,
    d: &RefDims,
    x: &CudaSlice<bf16>,
    s1: &CudaSlice<bf16>,
    s3: &CudaSlice<bf16>,
    ab: Option<(&mut CudaSlice<f32>, &mut CudaSlice<f32>)>,
    h: &mut CudaSlice<f32>,
) -> Result<(), KernelError> {
    let n = d.tokens() * d.shared();
    if n == 0 {
        return Ok(());
    }
    need("x", x, d.tokens() * d.hidden())?;
    need("s1", s1, d.hidden() * d.shared())?;
    need("s3", s3, d.hidden() * d.shared())?;
    need("shared h", h, n)?;
    let f = ctx.function(KernelId::RefSharedUp, 0, 0)?;
    let mut b = ctx.stream().launch_builder(&f);
    b.arg(x).arg(s1).arg(s3);
    match ab {
        Some((a, bb)) => {
            need("shared a", a, n)?;
            need("shared b", bb, n)?;
            b.arg(a).arg(bb)
        }
        None => b.arg(&NULL).arg(&NULL),
    };
    b.arg(h).arg(d);
    // SAFETY: afdep_ref_shared_up(const u16* x, const u16* s1, const u16* s3, float* a,
    // float* b, float* h, AfdepRefDims d): element (t, i) < T·S reads x[t][0..H] (T·H),
    // s1/s3 column i (H·S each) and writes a, b (may be null) and h at (t, i) (T·S); checked.
    unsafe { b.launch(cfg(n)?) }.map_err(launch_err(KernelId::RefSharedUp))?;
    Ok(())
}

/// The layer output, one thread per (token, channel): the weighted sum of the routed experts'
/// `y = h·W2` in slot order, plus the shared expert's `sh·S2` when `shared` is given (S > 0),
/// cast once into `out` (T × H).
#[allow(clippy::too_many_arguments)]
pub fn combine(
    ctx: &GpuContext,
    d: &RefDims,
    routes: &DeviceRoutes,
    weights: &CudaSlice<f32>,
    h: &CudaSlice<f32>,
    w2: &CudaSlice<bf16>,
    shared: Option<(&CudaSlice<f32>, &CudaSlice<bf16>)>,
    out: &mut CudaSlice<bf16>,
) -> Result<(), KernelError> {
    routes_fit(routes, d)?;
    let n = d.tokens() * d.hidden();
    if n == 0 {
        return Ok(());
    }
    if d.shared() > 0 && shared.is_none() {
        return Err(KernelError::Shape(
            "the shape has a shared expert, its h and s2 are needed".into(),
        ));
    }
    need("weights", weights, d.slots())?;
    need("h", h, d.slots() * d.width())?;
    need("w2", w2, d.experts() * d.width() * d.hidden())?;
    need("out", out, n)?;
    let f = ctx.function(KernelId::RefCombine, 0, 0)?;
    let mut b = ctx.stream().launch_builder(&f);
    b.arg(&routes.idx).arg(weights).arg(h).arg(w2);
    match shared.filter(|_| d.shared() > 0) {
        Some((sh, s2)) => {
            need("shared h", sh, d.tokens() * d.shared())?;
            need("s2", s2, d.shared() * d.hidden())?;
            b.arg(sh).arg(s2)
        }
        None => b.arg(&NULL).arg(&NULL),
    };
    b.arg(out).arg(d);
    // SAFETY: afdep_ref_combine(const i32* idx, const float* weights, const float* h,
    // const u16* w2, const float* sh, const u16* s2, u16* out, AfdepRefDims d): element
    // (t, c) < T·H reads idx, weights (T·K), h[j][0..W] (T·K·W), w2 of expert idx[j] < E
    // (E·W·H), and when S > 0 sh[t][0..S] (T·S) and s2 column c (S·H); writes out[t][c] (T·H).
    // All checked; sh and s2 are only read when S > 0.
    unsafe { b.launch(cfg(n)?) }.map_err(launch_err(KernelId::RefCombine))?;
    Ok(())
}

/// `dhu[j][i] = Σ_c dy[t][c]·W2[e][i][c]` for every slot (the unweighted `dy·W2ᵀ`), read
/// through `w2t` (E × H × W, [`transpose`] of W2); slots × W, zeros on masked slots.
pub fn expert_dh(
    ctx: &GpuContext,
    d: &RefDims,
    dy: &CudaSlice<bf16>,
    routes: &DeviceRoutes,
    w2t: &CudaSlice<bf16>,
    dhu: &mut CudaSlice<f32>,
) -> Result<(), KernelError> {
    routes_fit(routes, d)?;
    let n = d.slots() * d.width();
    if n == 0 {
        return Ok(());
    }
    need("dy", dy, d.tokens() * d.hidden())?;
    need("w2t", w2t, d.experts() * d.hidden() * d.width())?;
    need("dhu", dhu, n)?;
    let f = ctx.function(KernelId::RefExpertDh, 0, 0)?;
    let mut b = ctx.stream().launch_builder(&f);
    b.arg(dy).arg(&routes.idx).arg(w2t).arg(dhu).arg(d);
    // SAFETY: afdep_ref_expert_dh(const u16* dy, const i32* idx, const u16* w2t, float* dhu,
    // AfdepRefDims d): element (j, i) < T·K·W reads idx[j] (T·K), dy[t][0..H] (T·H), w2t of
    // expert idx[j] < E (E·H·W) and writes dhu[j][i] (T·K·W); checked.
    unsafe { b.launch(cfg(n)?) }.map_err(launch_err(KernelId::RefExpertDh))?;
    Ok(())
}

/// The router's `g[j] = <dy_t, y_j> = Σ_i h[j][i]·dhu[j][i]` for every slot (T × K).
pub fn router_g(
    ctx: &GpuContext,
    d: &RefDims,
    routes: &DeviceRoutes,
    h: &CudaSlice<f32>,
    dhu: &CudaSlice<f32>,
    g: &mut CudaSlice<f32>,
) -> Result<(), KernelError> {
    routes_fit(routes, d)?;
    if d.slots() == 0 {
        return Ok(());
    }
    need("h", h, d.slots() * d.width())?;
    need("dhu", dhu, d.slots() * d.width())?;
    need("g", g, d.slots())?;
    let f = ctx.function(KernelId::RefRouterG, 0, 0)?;
    let mut b = ctx.stream().launch_builder(&f);
    b.arg(&routes.idx).arg(h).arg(dhu).arg(g).arg(d);
    // SAFETY: afdep_ref_router_g(const i32* idx, const float* h, const float* dhu, float* g,
    // AfdepRefDims d): slot j < T·K reads idx[j] (T·K), h and dhu row j (T·K·W each) and
    // writes g[j] (T·K); checked.
    unsafe { b.launch(cfg(d.slots())?) }.map_err(launch_err(KernelId::RefRouterG))?;
    Ok(())
}

/// Elementwise over slots × W, in place: `dh = w_j·dhu`, then `(a, b)` becomes `(da, db)`
/// (the SwiGLU backward); zeros on masked slots.
pub fn expert_dab(
    ctx: &GpuContext,
    d: &RefDims,
    routes: &DeviceRoutes,
    weights: &CudaSlice<f32>,
    dhu: &CudaSlice<f32>,
    a: &mut CudaSlice<f32>,
    b_: &mut CudaSlice<f32>,
) -> Result<(), KernelError> {
    routes_fit(routes, d)?;
    let n = d.slots() * d.width();
    if n == 0 {
        return Ok(());
    }
    need("weights", weights, d.slots())?;
    need("dhu", dhu, n)?;
    need("a", a, n)?;
    need("b", b_, n)?;
    let f = ctx.function(KernelId::RefExpertDab, 0, 0)?;
    let mut b = ctx.stream().launch_builder(&f);
    b.arg(&routes.idx)
        .arg(weights)
        .arg(dhu)
        .arg(a)
        .arg(b_)
        .arg(d);
    // SAFETY: afdep_ref_expert_dab(const i32* idx, const float* weights, const float* dhu,
    // float* a, float* b, AfdepRefDims d): element n < T·K·W reads idx and weights at n / W
    // (T·K) and dhu, a, b at n, and writes a and b at n (T·K·W each); checked.
    unsafe { b.launch(cfg(n)?) }.map_err(launch_err(KernelId::RefExpertDab))?;
    Ok(())
}

/// The shared expert's backward to its SwiGLU input, in place, one thread per (token,
/// column): `dh = Σ_c dy[t][c]·S2[i][c]` (read through `s2t`, H × S), then `(a, b)` becomes
/// `(da, db)` (T × S each).
pub fn shared_dab(
    ctx: &GpuContext,
    d: &RefDims,
    dy: &CudaSlice<bf16>,
    s2t: &CudaSlice<bf16>,
    a: &mut CudaSlice<f32>,
    b_: &mut CudaSlice<f32>,
) -> Result<(), KernelError> {
    let n = d.tokens() * d.shared();
    if n == 0 {
        return Ok(());
    }
    need("dy", dy, d.tokens() * d.hidden())?;
    need("s2t", s2t, d.hidden() * d.shared())?;
    need("shared a", a, n)?;
    need("shared b", b_, n)?;
    let f = ctx.function(KernelId::RefSharedDab, 0, 0)?;
    let mut b = ctx.stream().launch_builder(&f);
    b.arg(dy).arg(s2t).arg(a).arg(b_).arg(d);
    // SAFETY: afdep_ref_shared_dab(const u16* dy, const u16* s2t, float* a, float* b,
    // AfdepRefDims d): element (t, i) < T·S reads dy[t][0..H] (T·H) and s2t column i (H·S),
    // and reads and writes a and b at (t, i) (T·S each); checked.
    unsafe { b.launch(cfg(n)?) }.map_err(launch_err(KernelId::RefSharedDab))?;
    Ok(())
}

/// The router backward, one thread per token: `dl` (T × E) from the probabilities, the
/// routes' ids, the weights and `g` (the oracle's arithmetic).
#[allow(clippy::too_many_arguments)]
pub fn router_dlogits(
    ctx: &GpuContext,
    d: &RefDims,
    routes: &DeviceRoutes,
    weights: &CudaSlice<f32>,
    probs: &CudaSlice<f32>,
    g: &CudaSlice<f32>,
    renormalize: bool,
    dl: &mut CudaSlice<f32>,
) -> Result<(), KernelError> {
    routes_fit(routes, d)?;
    if d.tokens() == 0 {
        return Ok(());
    }
    need("weights", weights, d.slots())?;
    need("probs", probs, d.tokens() * d.experts())?;
    need("g", g, d.slots())?;
    need("dlogits", dl, d.tokens() * d.experts())?;
    let renorm = u32::from(renormalize);
    let f = ctx.function(KernelId::RefRouterDlogits, 0, 0)?;
    let mut b = ctx.stream().launch_builder(&f);
    b.arg(&routes.idx)
        .arg(weights)
        .arg(probs)
        .arg(g)
        .arg(dl)
        .arg(d)
        .arg(&renorm);
    // SAFETY: afdep_ref_router_dlogits(const i32* idx, const float* weights,
    // const float* probs, const float* g, float* dl, AfdepRefDims d, u32 renormalize):
    // thread t reads idx, weights, g at t·K .. t·K + K (T·K each), probs[t][0..E] (T·E) and
    // writes dl[t][0..E] (T·E); checked; ids index probs only when in 0..E (check_routes).
    unsafe { b.launch(cfg(d.tokens())?) }.map_err(launch_err(KernelId::RefRouterDlogits))?;
    Ok(())
}

/// The routed experts' data inputs of [`dx`]: `da`, `db` (slots × W) and the transposed
/// `w1t`, `w3t` (E × W × H).
#[derive(Debug, Clone, Copy)]
pub struct DxExperts<'a> {
    /// The routes (ids).
    pub routes: &'a DeviceRoutes,
    /// da, slots × W.
    pub da: &'a CudaSlice<f32>,
    /// db, slots × W.
    pub db: &'a CudaSlice<f32>,
    /// W1 transposed, E × W × H.
    pub w1t: &'a CudaSlice<bf16>,
    /// W3 transposed, E × W × H.
    pub w3t: &'a CudaSlice<bf16>,
}

/// The shared expert's inputs of [`dx`]: `da`, `db` (T × S) and `s1t`, `s3t` (S × H).
#[derive(Debug, Clone, Copy)]
pub struct DxShared<'a> {
    /// Shared da, T × S.
    pub da: &'a CudaSlice<f32>,
    /// Shared db, T × S.
    pub db: &'a CudaSlice<f32>,
    /// S1 transposed, S × H.
    pub s1t: &'a CudaSlice<bf16>,
    /// S3 transposed, S × H.
    pub s3t: &'a CudaSlice<bf16>,
}

/// The router's inputs of [`dx`]: `dl` (T × E) and `wrt` (E × H).
#[derive(Debug, Clone, Copy)]
pub struct DxRouter<'a> {
    /// dlogits, T × E.
    pub dl: &'a CudaSlice<f32>,
    /// Wr transposed, E × H.
    pub wrt: &'a CudaSlice<bf16>,
}

/// The data gradient, one thread per (token, channel): the routed experts' `da·W1ᵀ + db·W3ᵀ`
/// summed in slot order, then the shared expert's (when `shared` is given; required when
/// S > 0), then the router's `dl·Wrᵀ` (when `router` is given), cast once into `dx` (T × H).
pub fn dx(
    ctx: &GpuContext,
    d: &RefDims,
    experts: DxExperts<'_>,
    shared: Option<DxShared<'_>>,
    router: Option<DxRouter<'_>>,
    dx: &mut CudaSlice<bf16>,
) -> Result<(), KernelError> {
    routes_fit(experts.routes, d)?;
    let n = d.tokens() * d.hidden();
    if n == 0 {
        return Ok(());
    }
    if d.shared() > 0 && shared.is_none() {
        return Err(KernelError::Shape(
            "the shape has a shared expert, its da, db, s1t and s3t are needed".into(),
        ));
    }
    let sw = d.slots() * d.width();
    let ewh = d.experts() * d.width() * d.hidden();
    need("da", experts.da, sw)?;
    need("db", experts.db, sw)?;
    need("w1t", experts.w1t, ewh)?;
    need("w3t", experts.w3t, ewh)?;
    need("dx", dx, n)?;
    let f = ctx.function(KernelId::RefDx, 0, 0)?;
    let mut b = ctx.stream().launch_builder(&f);
    b.arg(&experts.routes.idx)
        .arg(experts.da)
        .arg(experts.db)
        .arg(experts.w1t)
        .arg(experts.w3t);
    match shared.filter(|_| d.shared() > 0) {
        Some(s) => {
            let ts = d.tokens() * d.shared();
            let sh = d.shared() * d.hidden();
            need("shared da", s.da, ts)?;
            need("shared db", s.db, ts)?;
            need("s1t", s.s1t, sh)?;
            need("s3t", s.s3t, sh)?;
            b.arg(s.da).arg(s.db).arg(s.s1t).arg(s.s3t)
        }
        None => b.arg(&NULL).arg(&NULL).arg(&NULL).arg(&NULL),
    };
    match router {
        Some(r) => {
            need("dlogits", r.dl, d.tokens() * d.experts())?;
            need("wrt", r.wrt, d.experts() * d.hidden())?;
            b.arg(r.dl).arg(r.wrt)
        }
        None => b.arg(&NULL).arg(&NULL),
    };
    b.arg(dx).arg(d);
    // SAFETY: afdep_ref_dx(const i32* idx, const float* da, const float* db, const u16* w1t,
    // const u16* w3t, const float* dsa, const float* dsb, const u16* s1t, const u16* s3t,
    // const float* dl, const u16* wrt, u16* dx, AfdepRefDims d): element (t, c) < T·H reads
    // idx (T·K), da/db rows of its slots (T·K·W), w1t/w3t of experts idx < E (E·W·H); when
    // S > 0 the shared rows (T·S) and s1t/s3t (S·H); when dl is not null dl[t] (T·E) and wrt
    // (E·H); writes dx[t][c] (T·H). All checked; null pointers are only passed where unused.
    unsafe { b.launch(cfg(n)?) }.map_err(launch_err(KernelId::RefDx))?;
    Ok(())
}

/// The expert row lists of [`expert_rows`].
#[derive(Debug, Clone, Copy)]
pub struct Rows<'a> {
    /// E + 1 offsets.
    pub offsets: &'a CudaSlice<u64>,
    /// The flat slot of each row (at least T·K).
    pub rows: &'a CudaSlice<u64>,
    /// The token of each row (at least T·K).
    pub toks: &'a CudaSlice<u64>,
}

fn rows_fit(rows: &Rows<'_>, d: &RefDims) -> Result<(), KernelError> {
    need("offsets", rows.offsets, d.experts() + 1)?;
    need("rows", rows.rows, d.slots())?;
    need("row tokens", rows.toks, d.slots())
}

/// `dW2[e][i][c] = Σ_{rows r of e, in order} h[j][i]·(w_j·dy[t][c])`, one thread per element
/// (E × W × H).
pub fn grad_w2(
    ctx: &GpuContext,
    d: &RefDims,
    rows: Rows<'_>,
    h: &CudaSlice<f32>,
    weights: &CudaSlice<f32>,
    dy: &CudaSlice<bf16>,
    dw2: &mut CudaSlice<bf16>,
) -> Result<(), KernelError> {
    let n = d.experts() * d.width() * d.hidden();
    rows_fit(&rows, d)?;
    need("h", h, d.slots() * d.width())?;
    need("weights", weights, d.slots())?;
    need("dy", dy, d.tokens() * d.hidden())?;
    need("dw2", dw2, n)?;
    let f = ctx.function(KernelId::RefGradW2, 0, 0)?;
    let mut b = ctx.stream().launch_builder(&f);
    b.arg(rows.offsets)
        .arg(rows.rows)
        .arg(rows.toks)
        .arg(h)
        .arg(weights)
        .arg(dy)
        .arg(dw2)
        .arg(d);
    // SAFETY: afdep_ref_grad_w2(const u64* offsets, const u64* rows, const u64* toks,
    // const float* h, const float* weights, const u16* dy, u16* dw2, AfdepRefDims d): element
    // (e, i, c) < E·W·H reads offsets[e], offsets[e + 1] (E + 1), rows and toks in between
    // (< T·K: the lists of expert_rows), h[j][i] (T·K·W), weights[j] (T·K), dy[t][c] (T·H)
    // for the listed slots j < T·K and tokens t < T, and writes dw2 at (e, i, c); checked.
    unsafe { b.launch(cfg(n)?) }.map_err(launch_err(KernelId::RefGradW2))?;
    Ok(())
}

/// `dW1[e][h][i] = Σ_{rows r of e, in order} x[t][h]·da[j][i]` and `dW3` likewise with `db`,
/// one thread per element (E × H × W each).
#[allow(clippy::too_many_arguments)]
pub fn grad_w13(
    ctx: &GpuContext,
    d: &RefDims,
    rows: Rows<'_>,
    x: &CudaSlice<bf16>,
    da: &CudaSlice<f32>,
    db: &CudaSlice<f32>,
    dw1: &mut CudaSlice<bf16>,
    dw3: &mut CudaSlice<bf16>,
) -> Result<(), KernelError> {
    let n = d.experts() * d.hidden() * d.width();
    rows_fit(&rows, d)?;
    need("x", x, d.tokens() * d.hidden())?;
    need("da", da, d.slots() * d.width())?;
    need("db", db, d.slots() * d.width())?;
    need("dw1", dw1, n)?;
    need("dw3", dw3, n)?;
    let f = ctx.function(KernelId::RefGradW13, 0, 0)?;
    let mut b = ctx.stream().launch_builder(&f);
    b.arg(rows.offsets)
        .arg(rows.rows)
        .arg(rows.toks)
        .arg(x)
        .arg(da)
        .arg(db)
        .arg(dw1)
        .arg(dw3)
        .arg(d);
    // SAFETY: afdep_ref_grad_w13(const u64* offsets, const u64* rows, const u64* toks,
    // const u16* x, const float* da, const float* db, u16* dw1, u16* dw3, AfdepRefDims d):
    // element (e, h, i) < E·H·W reads the row list of e (as grad_w2), x[t][h] (T·H) and
    // da/db[j][i] (T·K·W) of the listed rows, and writes dw1 and dw3 at (e, h, i); checked.
    unsafe { b.launch(cfg(n)?) }.map_err(launch_err(KernelId::RefGradW13))?;
    Ok(())
}

/// `dS2[i][c] = Σ_t sh[t][i]·dy[t][c]` (tokens ascending), one thread per element (S × H).
pub fn grad_s2(
    ctx: &GpuContext,
    d: &RefDims,
    sh: &CudaSlice<f32>,
    dy: &CudaSlice<bf16>,
    ds2: &mut CudaSlice<bf16>,
) -> Result<(), KernelError> {
    let n = d.shared() * d.hidden();
    if n == 0 {
        return Ok(());
    }
    need("shared h", sh, d.tokens() * d.shared())?;
    need("dy", dy, d.tokens() * d.hidden())?;
    need("ds2", ds2, n)?;
    let f = ctx.function(KernelId::RefGradS2, 0, 0)?;
    let mut b = ctx.stream().launch_builder(&f);
    b.arg(sh).arg(dy).arg(ds2).arg(d);
    // SAFETY: afdep_ref_grad_s2(const float* sh, const u16* dy, u16* ds2, AfdepRefDims d):
    // element (i, c) < S·H reads sh[t][i] (T·S) and dy[t][c] (T·H) for t < T and writes
    // ds2[i][c] (S·H); checked.
    unsafe { b.launch(cfg(n)?) }.map_err(launch_err(KernelId::RefGradS2))?;
    Ok(())
}

/// `dS1[h][i] = Σ_t x[t][h]·da[t][i]` and `dS3` likewise with `db` (tokens ascending), one
/// thread per element (H × S each).
pub fn grad_s13(
    ctx: &GpuContext,
    d: &RefDims,
    x: &CudaSlice<bf16>,
    da: &CudaSlice<f32>,
    db: &CudaSlice<f32>,
    ds1: &mut CudaSlice<bf16>,
    ds3: &mut CudaSlice<bf16>,
) -> Result<(), KernelError> {
    let n = d.hidden() * d.shared();
    if n == 0 {
        return Ok(());
    }
    need("x", x, d.tokens() * d.hidden())?;
    need("shared da", da, d.tokens() * d.shared())?;
    need("shared db", db, d.tokens() * d.shared())?;
    need("ds1", ds1, n)?;
    need("ds3", ds3, n)?;
    let f = ctx.function(KernelId::RefGradS13, 0, 0)?;
    let mut b = ctx.stream().launch_builder(&f);
    b.arg(x).arg(da).arg(db).arg(ds1).arg(ds3).arg(d);
    // SAFETY: afdep_ref_grad_s13(const u16* x, const float* dsa, const float* dsb, u16* ds1,
    // u16* ds3, AfdepRefDims d): element (h, i) < H·S reads x[t][h] (T·H) and dsa/dsb[t][i]
    // (T·S) for t < T and writes ds1 and ds3 at (h, i) (H·S); checked.
    unsafe { b.launch(cfg(n)?) }.map_err(launch_err(KernelId::RefGradS13))?;
    Ok(())
}

/// `dWr[h][e] = Σ_t x[t][h]·dl[t][e]` (tokens ascending), one thread per element (H × E);
/// zeros without `dl` (given routes: the weights are constants).
pub fn grad_wr(
    ctx: &GpuContext,
    d: &RefDims,
    x: &CudaSlice<bf16>,
    dl: Option<&CudaSlice<f32>>,
    dwr: &mut CudaSlice<bf16>,
) -> Result<(), KernelError> {
    let n = d.hidden() * d.experts();
    need("x", x, d.tokens() * d.hidden())?;
    if let Some(dl) = dl {
        need("dlogits", dl, d.tokens() * d.experts())?;
    }
    need("dwr", dwr, n)?;
    let f = ctx.function(KernelId::RefGradWr, 0, 0)?;
    let mut b = ctx.stream().launch_builder(&f);
    b.arg(x);
    match dl {
        Some(dl) => b.arg(dl),
        None => b.arg(&NULL),
    };
    b.arg(dwr).arg(d);
    // SAFETY: afdep_ref_grad_wr(const u16* x, const float* dl, u16* dwr, AfdepRefDims d):
    // element (h, e) < H·E writes dwr[h][e] (H·E) and, when dl is not null, reads x[t][h]
    // (T·H) and dl[t][e] (T·E) for t < T; checked.
    unsafe { b.launch(cfg(n)?) }.map_err(launch_err(KernelId::RefGradWr))?;
    Ok(())
}

/// The statistics of the error metric of two bf16 tensors of equal length, accumulated into
/// `stats[slot·4 .. slot·4 + 4]` (which must be zeroed before): the bits of the f64
/// `max |a − b|` over finite `a` (NaN differences ignored), the bits of `max |b|` (NaN
/// ignored), and flags for a non-finite element of `a` and of `b`.
pub fn err_stats(
    ctx: &GpuContext,
    a: &CudaSlice<bf16>,
    b_: &CudaSlice<bf16>,
    stats: &mut CudaSlice<u64>,
    slot: usize,
) -> Result<(), KernelError> {
    if a.len() != b_.len() {
        return Err(KernelError::Shape(format!(
            "compared tensors hold {} and {} elements",
            a.len(),
            b_.len()
        )));
    }
    need("error statistics", stats, slot * 4 + 4)?;
    let n = a.len();
    if n == 0 {
        return Ok(());
    }
    let n64 = n as u64;
    let mut out = stats.slice_mut(slot * 4..slot * 4 + 4);
    let f = ctx.function(KernelId::RefErrStats, 0, 0)?;
    let mut b = ctx.stream().launch_builder(&f);
    b.arg(a).arg(b_).arg(&n64).arg(&mut out);
    // SAFETY: afdep_ref_err_stats(const u16* a, const u16* b, u64 n, u64* stats): reads a[i]
    // and b[i] for i < n (both hold n) and atomically updates stats[0..4] (the 4-element view).
    unsafe { b.launch(grid((n64.div_ceil(u64::from(BLOCK))).min(4096))?) }
        .map_err(launch_err(KernelId::RefErrStats))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `RefDims` has `AfdepRefDims`'s fields (reference.cu) in the same order at the same
    /// offsets, and no more bytes.
    #[test]
    fn the_device_dims_match() {
        use super::super::device_struct::{assert_mirrors, rust_offsets};
        let rust = rust_offsets!(RefDims; tokens, hidden, width, experts, top_k, shared);
        let text = include_str!("../../cuda/reference.cu");
        assert_mirrors(text, "AfdepRefDims", rust, std::mem::size_of::<RefDims>());
    }
}
