//! The MoE layer oracle: the forward pass and the train step of docs/design.md, "Specification:
//! Layer and train step", on the CPU.
//!
//! Storage is bf16; everything inside the layer is computed in the compute type `T` ([`Real`]:
//! f32 is the specification, f64 serves the gradient checks) and rounded to bf16 once, at the
//! end. No intermediate (logits, probabilities, `a`, `b`, `h`, `y`, shared-expert values,
//! gradients) is rounded to bf16.
//!
//! # Entry points
//! - bf16, f32 math: [`forward`], [`forward_with_routes`], [`train_step`],
//!   [`train_step_with_routes`], [`expert_rows`];
//! - generic over `T` on `T` copies of the inputs, unrounded results: [`forward_t`],
//!   [`train_step_t`], [`expert_rows_t`], with [`ParamsT`], [`GradsT`], [`ForwardT`].
//!
//! # Order of operations (the bit-exact contract)
//! Every matrix product is one call of the [`gemm`] module per block; each
//! element of a product is one dot product whose order depends only on the inner size, so a
//! product's rows do not depend on how many rows are computed together or how the rows are split
//! into tasks. All splits are fixed sizes (never the thread count): same inputs, same bits, on
//! any rayon pool.
//!
//! 1. **Router** (when the layer routes): `logits = x·Wr`, then per row the softmax of
//!    [`route::softmax_in_place`](crate::route::softmax_in_place) (max subtracted, exponentials
//!    summed in ascending expert order), the top-K by probability with ties to the lower expert
//!    id (slots by descending probability), and `w_k = p_k / s` with `s = Σ_k p_k` summed in slot
//!    order from 0 (or `w_k = p_k` without renormalisation). In f32 the routes are bit-identical
//!    to [`route::route`](crate::route::route). A NaN or infinite logit (from a non-finite
//!    value in `x` or `Wr`) is [`RouteError::NonFiniteLogit`] naming the first such token and
//!    expert ([`route::check_logits`](crate::route::check_logits)), returned before any expert
//!    runs. Non-finite values elsewhere (expert or shared weights, `dy`) are not checked: they
//!    propagate through the arithmetic as in PyTorch.
//! 2. **Grouping**: the (token, slot) pairs that are not masked are grouped by expert with a
//!    stable counting sort (within an expert: token ascending, then slot ascending). Offsets are
//!    `usize` (64-bit).
//! 3. **Experts** (SwiGLU) on each expert's gathered rows: `a = x·W1_e`, `b = x·W3_e`,
//!    `h = silu(a)·b` elementwise with `silu(a) = a·σ(a)`, `σ(a) = 1 / (1 + e^(−a))`, and
//!    `y = h·W2_e`, into an expert-sorted buffer. Each `y` row depends only on its input row;
//!    [`expert_rows`] computes exactly these rows. The shared expert is the same with S1, S3, S2
//!    on all tokens.
//! 4. **Combine**, per token: `acc = 0`; for slot k ascending, unless masked,
//!    `acc = acc + w_k · y_k` (a product and a sum, each rounded to `T`, no fused multiply-add);
//!    then `acc = acc + shared(x)` when S > 0 (nothing is added when S = 0); then one cast.
//!
//! # Train step
//! The gradients of `Σ(out ⊙ dy)` with respect to x and every parameter. Per expert (rows of
//! that expert, per-row weight `w`): `dy_e = w·dy`, `dh = dy_e·W2ᵀ`, `dW2 = hᵀ·dy_e`,
//! `da = dh·b·silu'(a)` with `silu'(a) = σ(a)(1 + a(1 − σ(a)))`, `db = dh·silu(a)`,
//! `dW1 = xᵀ·da`, `dW3 = xᵀ·db`, `dx_k = da·W1ᵀ + db·W3ᵀ`; each expert's weight gradients are
//! one product over all its rows (no atomics, no partial sums). The shared expert is the same
//! with weight 1; its weight gradients are products over all tokens, split by output rows.
//!
//! The router gradient flows through the weights (top-K selection is not differentiated):
//! `g_k = <dy_t, y_k>` (summed over channels ascending); with renormalisation
//! `dp_j = (g_j − Σ_k g_k w_k) / s` for selected j (sums in slot order), without it
//! `dp_j = g_j`, and 0 for experts not selected; then `dlogit_i = p_i (dp_i − Σ_j p_j dp_j)`
//! (sum over experts ascending), `dWr = xᵀ·dlogits` and the router's `dx = dlogits·Wrᵀ`.
//!
//! Per token, `dx = ((0 + Σ_{k ascending, not masked} dx_k) + dx_shared) + dx_router`, the
//! shared term only when S > 0 and the router term only when the layer routed itself.
//!
//! With routes given by the caller (`*_with_routes`, [`Routing::Given`]) the weights are
//! constants: the router is not run, `dWr` is zero and there is no router term in `dx`.

use std::cmp::Ordering;

use half::bf16;
use rayon::prelude::*;
use thiserror::Error;

use crate::config::LayerShape;
use crate::error::{ConfigError, RouteError};
use crate::oracle::gemm::{self, Real, matmul, matmul_at, matmul_bt};
use crate::oracle::params::{LayerGrads, LayerParams, PARAM_NAMES};
use crate::route::{MASKED, RouteRules, Routes, validate};

/// Tokens per task in the token-parallel stages (router, shared expert, combine).
const ROW_CHUNK: usize = 128;
/// Output rows per task in the weight-gradient products over all tokens.
const OUT_CHUNK: usize = 32;
/// Most rows of one expert per task in the forward pass.
const EXPERT_CHUNK: usize = 1024;

/// Why the layer oracle refused its inputs.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum LayerError {
    /// The shape or a parameter tensor's length is unusable.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// Routes given by the caller were rejected by [`validate`] (rank 0, [`RouteRules::layer`]).
    #[error(transparent)]
    Route(#[from] RouteError),
    /// An input has the wrong number of elements (or routes cover the wrong number of tokens).
    #[error("layer input `{what}`: got {got}, the shape needs {want}")]
    Size {
        /// The input (`x`, `dy`, `x_rows`, `routes.tokens`).
        what: &'static str,
        /// What was given.
        got: usize,
        /// What the shape and token count need (`usize::MAX` if that overflows).
        want: usize,
    },
    /// An expert index outside `0..experts`.
    #[error("expert {expert} does not exist: the layer has {experts} experts")]
    NoSuchExpert {
        /// The index given.
        expert: usize,
        /// Number of experts.
        experts: usize,
    },
}

/// Where the layer's routes come from.
#[derive(Debug, Clone, Copy)]
pub enum Routing<'a> {
    /// The layer's own router (`x·Wr`, softmax, top-K); the router is differentiated.
    Router,
    /// Routes given by the caller, validated with [`RouteRules::layer`]; masked slots contribute
    /// nothing and the weights are constants (no router gradient).
    Given(&'a Routes),
}

/// The layer's parameters in the compute type `T`, with the layouts of [`LayerParams`].
#[derive(Debug, Clone, PartialEq)]
pub struct ParamsT<T> {
    /// The layer shape.
    pub shape: LayerShape,
    /// Router, H × E.
    pub wr: Vec<T>,
    /// Expert gate projections, E × H × W.
    pub w1: Vec<T>,
    /// Expert up projections, E × H × W.
    pub w3: Vec<T>,
    /// Expert down projections, E × W × H.
    pub w2: Vec<T>,
    /// Shared gate, H × S.
    pub s1: Vec<T>,
    /// Shared up, H × S.
    pub s3: Vec<T>,
    /// Shared down, S × H.
    pub s2: Vec<T>,
}

impl<T> ParamsT<T> {
    /// Parameters of `shape` from their tensors in [`PARAM_NAMES`] order (the inverse of
    /// [`tensors`](Self::tensors)).
    pub fn from_tensors(shape: LayerShape, tensors: [Vec<T>; 7]) -> Self {
        let [wr, w1, w3, w2, s1, s3, s2] = tensors;
        ParamsT {
            shape,
            wr,
            w1,
            w3,
            w2,
            s1,
            s3,
            s2,
        }
    }
}

impl<T: Real> ParamsT<T> {
    /// Exact copies of bf16 parameters (bf16 is exactly representable in f32 and f64).
    pub fn from_bf16(p: &LayerParams) -> Self {
        Self::from_tensors(p.shape, p.tensors().map(|t| to_t(t)))
    }

    /// The tensors in [`PARAM_NAMES`] order.
    pub fn tensors(&self) -> [&Vec<T>; 7] {
        crate::param_tensors!(self)
    }

    /// Mutable tensors in [`PARAM_NAMES`] order.
    pub fn tensors_mut(&mut self) -> [&mut Vec<T>; 7] {
        crate::param_tensors!(mut self)
    }

    /// Checks the shape and every tensor's length; the error names the tensor.
    pub fn check(&self) -> Result<(), LayerError> {
        self.shape.validate()?;
        for ((name, t), n) in PARAM_NAMES
            .iter()
            .zip(self.tensors())
            .zip(LayerParams::sizes(&self.shape))
        {
            if t.len() != n {
                return Err(ConfigError::Invalid {
                    field: name,
                    value: format!("{} elements", t.len()),
                    reason: format!("the shape needs {n}"),
                }
                .into());
            }
        }
        Ok(())
    }

    /// Routed expert `e` (`e < experts`).
    fn expert(&self, e: usize) -> Ffn<'_, T> {
        let hw = self.shape.d_model * self.shape.width;
        Ffn {
            h: self.shape.d_model,
            w: self.shape.width,
            w1: &self.w1[e * hw..(e + 1) * hw],
            w3: &self.w3[e * hw..(e + 1) * hw],
            w2: &self.w2[e * hw..(e + 1) * hw],
        }
    }

    /// The shared expert (width S, possibly 0).
    fn shared(&self) -> Ffn<'_, T> {
        Ffn {
            h: self.shape.d_model,
            w: self.shape.shared,
            w1: &self.s1,
            w3: &self.s3,
            w2: &self.s2,
        }
    }
}

/// Gradients of one train step in the compute type `T`, with the layouts of [`LayerGrads`].
#[derive(Debug, Clone, PartialEq)]
pub struct GradsT<T> {
    /// Gradient with respect to the input tokens, T × H.
    pub dx: Vec<T>,
    /// Router gradient, H × E.
    pub dwr: Vec<T>,
    /// E × H × W.
    pub dw1: Vec<T>,
    /// E × H × W.
    pub dw3: Vec<T>,
    /// E × W × H.
    pub dw2: Vec<T>,
    /// H × S.
    pub ds1: Vec<T>,
    /// H × S.
    pub ds3: Vec<T>,
    /// S × H.
    pub ds2: Vec<T>,
}

impl<T: Real> GradsT<T> {
    /// The parameter gradients in [`PARAM_NAMES`] order.
    pub fn params(&self) -> [&Vec<T>; 7] {
        [
            &self.dwr, &self.dw1, &self.dw3, &self.dw2, &self.ds1, &self.ds3, &self.ds2,
        ]
    }

    /// Cast to bf16 (via [`Real::to_f32`]; for f32 this is the single rounding of the spec).
    pub fn to_bf16(&self) -> LayerGrads {
        LayerGrads {
            dx: to_bf16(&self.dx),
            dwr: to_bf16(&self.dwr),
            dw1: to_bf16(&self.dw1),
            dw3: to_bf16(&self.dw3),
            dw2: to_bf16(&self.dw2),
            ds1: to_bf16(&self.ds1),
            ds3: to_bf16(&self.ds3),
            ds2: to_bf16(&self.ds2),
        }
    }
}

/// The unrounded result of a forward pass in the compute type `T`.
#[derive(Debug, Clone, PartialEq)]
pub struct ForwardT<T> {
    /// Number of tokens.
    pub tokens: usize,
    /// Slots per token.
    pub top_k: usize,
    /// Layer output, T × H.
    pub out: Vec<T>,
    /// Expert id per slot, T × K (`-1` masked; only given routes have masked slots).
    pub idx: Vec<i32>,
    /// Weight per slot, T × K.
    pub weights: Vec<T>,
    /// Router probabilities, T × E; empty when the routes were given.
    pub probs: Vec<T>,
}

impl<T: Real> ForwardT<T> {
    /// The routes used, with weights converted to f32 (exact for f32).
    pub fn routes(&self) -> Routes {
        Routes {
            tokens: self.tokens,
            top_k: self.top_k,
            idx: self.idx.clone(),
            weights: self.weights.iter().map(|w| w.to_f32()).collect(),
        }
    }
}

/// The result of [`forward`]: the bf16 output and the routes the router chose.
#[derive(Debug, Clone, PartialEq)]
pub struct LayerForward {
    /// Layer output, T × H, bf16.
    pub out: Vec<bf16>,
    /// The routes (expert ids and f32 weights) the router chose, T × K.
    pub routes: Routes,
}

/// The layer forward with its own router: bf16 storage, f32 math, one cast at the end.
pub fn forward(
    params: &LayerParams,
    x: &[bf16],
    tokens: usize,
) -> Result<LayerForward, LayerError> {
    params.check()?;
    let p = ParamsT::<f32>::from_bf16(params);
    let f = forward_t(&p, &to_t::<f32>(x), tokens, Routing::Router)?;
    Ok(LayerForward {
        out: to_bf16(&f.out),
        routes: f.routes(),
    })
}

/// The layer forward on given routes (validated; masked slots contribute nothing).
pub fn forward_with_routes(
    params: &LayerParams,
    x: &[bf16],
    tokens: usize,
    routes: &Routes,
) -> Result<Vec<bf16>, LayerError> {
    params.check()?;
    let p = ParamsT::<f32>::from_bf16(params);
    let f = forward_t(&p, &to_t::<f32>(x), tokens, Routing::Given(routes))?;
    Ok(to_bf16(&f.out))
}

/// The train step with the layer's own router: the output and the gradients of `Σ(out ⊙ dy)`,
/// f32 math, each cast to bf16 once.
pub fn train_step(
    params: &LayerParams,
    x: &[bf16],
    tokens: usize,
    dy: &[bf16],
) -> Result<(Vec<bf16>, LayerGrads), LayerError> {
    train_bf16(params, x, tokens, dy, Routing::Router)
}

/// The train step on given routes: their weights are constants, so `dwr` is zero.
pub fn train_step_with_routes(
    params: &LayerParams,
    x: &[bf16],
    tokens: usize,
    dy: &[bf16],
    routes: &Routes,
) -> Result<(Vec<bf16>, LayerGrads), LayerError> {
    train_bf16(params, x, tokens, dy, Routing::Given(routes))
}

fn train_bf16(
    params: &LayerParams,
    x: &[bf16],
    tokens: usize,
    dy: &[bf16],
    routing: Routing<'_>,
) -> Result<(Vec<bf16>, LayerGrads), LayerError> {
    params.check()?;
    let p = ParamsT::<f32>::from_bf16(params);
    let (f, g) = train_step_t(&p, &to_t::<f32>(x), tokens, &to_t::<f32>(dy), routing)?;
    Ok((to_bf16(&f.out), g.to_bf16()))
}

/// `y_e` of routed expert `e` for `n` rows (`x_rows` is n × H), f32 math, bf16 out. Each output
/// row depends only on its input row, bit for bit, whatever `n` is; the rows equal the layer's
/// own `y` rows before their cast.
pub fn expert_rows(
    params: &LayerParams,
    e: usize,
    x_rows: &[bf16],
    n: usize,
) -> Result<Vec<bf16>, LayerError> {
    params.check()?;
    let sh = params.shape;
    check_expert_rows(sh, e, x_rows.len(), n)?;
    let hw = sh.d_model * sh.width;
    let (w1, w3, w2) = (
        to_t::<f32>(&params.w1[e * hw..(e + 1) * hw]),
        to_t::<f32>(&params.w3[e * hw..(e + 1) * hw]),
        to_t::<f32>(&params.w2[e * hw..(e + 1) * hw]),
    );
    let f = Ffn {
        h: sh.d_model,
        w: sh.width,
        w1: &w1,
        w3: &w3,
        w2: &w2,
    };
    Ok(to_bf16(&ffn_rows(&f, &to_t::<f32>(x_rows), n)))
}

/// The arguments of [`expert_rows`]: expert `e` exists and `x_rows` (`len` values) is n × H.
fn check_expert_rows(sh: LayerShape, e: usize, len: usize, n: usize) -> Result<(), LayerError> {
    if e >= sh.experts {
        return Err(LayerError::NoSuchExpert {
            expert: e,
            experts: sh.experts,
        });
    }
    check_len("x_rows", len, n, sh.d_model)
}

/// [`expert_rows`] in the compute type `T`, unrounded.
pub fn expert_rows_t<T: Real>(
    params: &ParamsT<T>,
    e: usize,
    x_rows: &[T],
    n: usize,
) -> Result<Vec<T>, LayerError> {
    params.check()?;
    let sh = params.shape;
    check_expert_rows(sh, e, x_rows.len(), n)?;
    Ok(ffn_rows(&params.expert(e), x_rows, n))
}

/// The layer forward in `T` on `T` inputs (`x` is T × H), unrounded.
pub fn forward_t<T: Real>(
    params: &ParamsT<T>,
    x: &[T],
    tokens: usize,
    routing: Routing<'_>,
) -> Result<ForwardT<T>, LayerError> {
    run(params, x, tokens, None, routing).map(|(f, _)| f)
}

/// The train step in `T` on `T` inputs: the forward result and the gradients of `Σ(out ⊙ dy)`
/// (`dy` is T × H), unrounded. The forward output is bit-identical to [`forward_t`]'s.
pub fn train_step_t<T: Real>(
    params: &ParamsT<T>,
    x: &[T],
    tokens: usize,
    dy: &[T],
    routing: Routing<'_>,
) -> Result<(ForwardT<T>, GradsT<T>), LayerError> {
    let (f, g) = run(params, x, tokens, Some(dy), routing)?;
    Ok((f, g.expect("gradients were asked for")))
}

// ---------------------------------------------------------------------------------------------
// Internals.

/// One SwiGLU FFN: W1, W3 are H × W, W2 is W × H.
struct Ffn<'a, T> {
    h: usize,
    w: usize,
    w1: &'a [T],
    w3: &'a [T],
    w2: &'a [T],
}

fn to_t<T: Real>(v: &[bf16]) -> Vec<T> {
    v.par_iter()
        .with_min_len(4096)
        .map(|x| T::from_f32(x.to_f32()))
        .collect()
}

fn to_bf16<T: Real>(v: &[T]) -> Vec<bf16> {
    v.par_iter()
        .with_min_len(4096)
        .map(|x| bf16::from_f32(x.to_f32()))
        .collect()
}

fn check_len(what: &'static str, got: usize, rows: usize, cols: usize) -> Result<(), LayerError> {
    let want = rows.saturating_mul(cols);
    if got != want {
        Err(LayerError::Size { what, got, want })
    } else {
        Ok(())
    }
}

fn sigmoid<T: Real>(a: T) -> T {
    T::ONE / (T::ONE + (-a).exp())
}

fn dot<T: Real>(a: &[T], b: &[T]) -> T {
    a.iter().zip(b).fold(T::ZERO, |s, (&p, &q)| s + p * q)
}

/// `a = x·W1`, `b = x·W3`, `h = silu(a)·b` (n × W each) and `y = h·W2` (n × H).
fn ffn_forward<T: Real>(
    f: &Ffn<'_, T>,
    x: &[T],
    n: usize,
    a: &mut [T],
    b: &mut [T],
    hh: &mut [T],
    y: &mut [T],
) {
    matmul(n, f.h, f.w, x, f.w1, a, false);
    matmul(n, f.h, f.w, x, f.w3, b, false);
    for ((h, &a), &b) in hh.iter_mut().zip(a.iter()).zip(b.iter()) {
        *h = a * sigmoid(a) * b;
    }
    matmul(n, f.w, f.h, hh, f.w2, y, false);
}

/// `y` for n rows, split into fixed row blocks (rows are independent).
fn ffn_rows<T: Real>(f: &Ffn<'_, T>, x: &[T], n: usize) -> Vec<T> {
    let mut y = vec![T::ZERO; n * f.h];
    if n == 0 {
        return y;
    }
    y.par_chunks_mut(ROW_CHUNK * f.h)
        .zip(x.par_chunks(ROW_CHUNK * f.h))
        .for_each(|(yc, xc)| {
            let m = xc.len() / f.h;
            let mut a = vec![T::ZERO; m * f.w];
            let mut b = vec![T::ZERO; m * f.w];
            let mut hh = vec![T::ZERO; m * f.w];
            ffn_forward(f, xc, m, &mut a, &mut b, &mut hh, yc);
        });
    y
}

/// From `a`, `b` and the weighted upstream gradient `dyw` (n × H): `da`, `db` (n × W) and
/// `dx = da·W1ᵀ + db·W3ᵀ` (n × H).
#[allow(clippy::too_many_arguments)]
fn ffn_backward<T: Real>(
    f: &Ffn<'_, T>,
    n: usize,
    a: &[T],
    b: &[T],
    dyw: &[T],
    da: &mut [T],
    db: &mut [T],
    dx: &mut [T],
) {
    let mut dh = vec![T::ZERO; n * f.w];
    matmul_bt(n, f.h, f.w, dyw, f.w2, &mut dh, false);
    for ((((da, db), &dh), &a), &b) in da
        .iter_mut()
        .zip(db.iter_mut())
        .zip(dh.iter())
        .zip(a)
        .zip(b)
    {
        let s = sigmoid(a);
        *da = dh * b * (s * (T::ONE + a * (T::ONE - s)));
        *db = dh * (a * s);
    }
    matmul_bt(n, f.w, f.h, da, f.w1, dx, false);
    matmul_bt(n, f.w, f.h, db, f.w3, dx, true);
}

/// `C[m×n] = A[m×k]·op(B)` split into fixed blocks of A's rows; `bt`: B is stored n × k.
fn par_rows<T: Real>(m: usize, k: usize, n: usize, a: &[T], b: &[T], c: &mut [T], bt: bool) {
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        c.fill(T::ZERO);
        return;
    }
    c.par_chunks_mut(ROW_CHUNK * n)
        .zip(a.par_chunks(ROW_CHUNK * k))
        .for_each(|(cc, ac)| {
            let rows = ac.len() / k;
            if bt {
                matmul_bt(rows, k, n, ac, b, cc, false)
            } else {
                matmul(rows, k, n, ac, b, cc, false)
            }
        });
}

/// `C[m×n] = Aᵀ·B` (A stored k × m, B k × n) split into fixed blocks of C's rows; each element
/// is still one dot product over all k.
fn par_at<T: Real>(m: usize, k: usize, n: usize, a: &[T], b: &[T], c: &mut [T]) {
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        c.fill(T::ZERO);
        return;
    }
    c.par_chunks_mut(OUT_CHUNK * n)
        .enumerate()
        .for_each(|(i, cc)| {
            let r0 = i * OUT_CHUNK;
            let rows = cc.len() / n;
            T::gemm_raw(
                [rows, k, n],
                T::ONE,
                gemm::cols(&a[r0..], m),
                gemm::rows(b, n),
                T::ZERO,
                gemm::rows_mut(cc, n),
            );
        });
}

/// Descending order with NaN first (as `total_cmp` puts positive NaN above everything).
fn desc<T: Real>(p: T, q: T) -> Ordering {
    match (p.partial_cmp(&p).is_none(), q.partial_cmp(&q).is_none()) {
        (true, true) => Ordering::Equal,
        (true, false) => Ordering::Less,
        (false, true) => Ordering::Greater,
        (false, false) => q.partial_cmp(&p).unwrap_or(Ordering::Equal),
    }
}

/// Router probabilities (T × E) and the selection (ids and weights, T × K), as [`crate::route`].
/// A non-finite logit is [`RouteError::NonFiniteLogit`] (rank 0) of the first such token
/// ([`crate::route::check_logits`]), before anything else runs.
#[allow(clippy::type_complexity)]
fn router<T: Real>(
    p: &ParamsT<T>,
    x: &[T],
    tokens: usize,
) -> Result<(Vec<T>, Vec<i32>, Vec<T>), RouteError> {
    let sh = &p.shape;
    let (h, e, k) = (sh.d_model, sh.experts, sh.top_k);
    let mut probs = vec![T::ZERO; tokens * e];
    par_rows(tokens, h, e, x, &p.wr, &mut probs, false);
    if let Some(i) = probs.iter().position(|v| !v.to_f32().is_finite()) {
        return Err(RouteError::NonFiniteLogit {
            rank: 0,
            token: i / e,
            expert: i % e,
            value: probs[i].to_f32(),
        });
    }
    let mut idx = vec![MASKED; tokens * k];
    let mut weights = vec![T::ZERO; tokens * k];
    probs
        .par_chunks_mut(e)
        .zip(idx.par_chunks_mut(k))
        .zip(weights.par_chunks_mut(k))
        .with_min_len(64)
        .for_each(|((row, ids), ws)| {
            // softmax: max subtracted, exponentials summed in ascending order
            let mut m = row[0];
            for &v in row.iter() {
                if v > m {
                    m = v;
                }
            }
            let mut s = T::ZERO;
            for v in row.iter_mut() {
                *v = (*v - m).exp();
                s += *v;
            }
            for v in row.iter_mut() {
                *v = *v / s;
            }
            // top-k by descending probability, ties to the lower id
            let mut order: Vec<usize> = (0..e).collect();
            order.sort_by(|&i, &j| desc(row[i], row[j]).then(i.cmp(&j)));
            let sel = &order[..k];
            let sum = sel.iter().fold(T::ZERO, |acc, &j| acc + row[j]);
            for ((id, w), &j) in ids.iter_mut().zip(ws.iter_mut()).zip(sel) {
                *id = j as i32;
                *w = if sh.renormalize { row[j] / sum } else { row[j] };
            }
        });
    Ok((probs, idx, weights))
}

/// (token, slot) pairs grouped by expert: rows `offsets[e]..offsets[e + 1]` of the
/// expert-sorted buffers belong to expert e; `order[r]` is the flat slot index `t·K + k` of row
/// r and `row_of[t·K + k]` its row (`usize::MAX` when masked).
struct Groups {
    offsets: Vec<usize>,
    order: Vec<usize>,
    row_of: Vec<usize>,
}

impl Groups {
    fn build(idx: &[i32], experts: usize) -> Self {
        let mut offsets = vec![0usize; experts + 1];
        for &e in idx {
            if e != MASKED {
                offsets[e as usize + 1] += 1;
            }
        }
        for e in 0..experts {
            offsets[e + 1] += offsets[e];
        }
        let mut next = offsets[..experts].to_vec();
        let mut order = vec![0usize; offsets[experts]];
        let mut row_of = vec![usize::MAX; idx.len()];
        for (j, &e) in idx.iter().enumerate() {
            if e != MASKED {
                let r = &mut next[e as usize];
                order[*r] = j;
                row_of[j] = *r;
                *r += 1;
            }
        }
        Groups {
            offsets,
            order,
            row_of,
        }
    }

    fn rows(&self) -> usize {
        self.order.len()
    }
}

/// Gathers the token rows of the flat slot indices `slots` (K slots per token).
fn gather<T: Real>(src: &[T], h: usize, slots: &[usize], k: usize) -> Vec<T> {
    let mut out = Vec::with_capacity(slots.len() * h);
    for &j in slots {
        let t = j / k;
        out.extend_from_slice(&src[t * h..(t + 1) * h]);
    }
    out
}

/// Splits `buf` into consecutive pieces of `sizes[i] · width` elements.
fn split_rows<T>(
    mut buf: &mut [T],
    sizes: impl Iterator<Item = usize>,
    width: usize,
) -> Vec<&mut [T]> {
    let mut out = Vec::new();
    for n in sizes {
        let (head, tail) = std::mem::take(&mut buf).split_at_mut(n * width);
        out.push(head);
        buf = tail;
    }
    out
}

/// One expert's share of the train step.
struct ExpertJob<'a, T> {
    e: usize,
    lo: usize,
    y: &'a mut [T],
    dx: &'a mut [T],
    g: &'a mut [T],
    dw1: &'a mut [T],
    dw3: &'a mut [T],
    dw2: &'a mut [T],
}

/// The whole layer: forward, and the train step when `dy` is given.
fn run<T: Real>(
    p: &ParamsT<T>,
    x: &[T],
    tokens: usize,
    dy: Option<&[T]>,
    routing: Routing<'_>,
) -> Result<(ForwardT<T>, Option<GradsT<T>>), LayerError> {
    p.check()?;
    let sh = p.shape;
    let (h, w, ne, k, s) = (sh.d_model, sh.width, sh.experts, sh.top_k, sh.shared);
    check_len("x", x.len(), tokens, h)?;
    if let Some(dy) = dy {
        check_len("dy", dy.len(), tokens, h)?;
    }

    // 1. routes
    let routed = matches!(routing, Routing::Router);
    let (probs, idx, weights) = match routing {
        Routing::Router => router(p, x, tokens)?,
        Routing::Given(r) => {
            validate(r, &RouteRules::layer(&sh), 0)?;
            if r.tokens != tokens {
                return Err(LayerError::Size {
                    what: "routes.tokens",
                    got: r.tokens,
                    want: tokens,
                });
            }
            (
                Vec::new(),
                r.idx.clone(),
                r.weights.iter().map(|&v| T::from_f32(v)).collect(),
            )
        }
    };

    // 2. grouping
    let groups = Groups::build(&idx, ne);
    let counts = || (0..ne).map(|e| groups.offsets[e + 1] - groups.offsets[e]);
    let mut y_sorted = vec![T::ZERO; groups.rows() * h];

    // 3. routed experts (and their backward), then the shared expert
    let mut grads = None;
    let mut dx_sorted = Vec::new();
    let mut g_sorted = Vec::new();
    let mut shared_y = Vec::new();
    let mut shared_dx = Vec::new();
    match dy {
        None => {
            let mut jobs = Vec::new();
            let mut rest: &mut [T] = &mut y_sorted;
            for e in 0..ne {
                let (mut r, hi) = (groups.offsets[e], groups.offsets[e + 1]);
                while r < hi {
                    let n = (hi - r).min(EXPERT_CHUNK);
                    let (head, tail) = std::mem::take(&mut rest).split_at_mut(n * h);
                    jobs.push((e, r, n, head));
                    rest = tail;
                    r += n;
                }
            }
            jobs.into_par_iter().for_each(|(e, r0, n, y)| {
                let xe = gather(x, h, &groups.order[r0..r0 + n], k);
                let mut a = vec![T::ZERO; n * w];
                let mut b = vec![T::ZERO; n * w];
                let mut hh = vec![T::ZERO; n * w];
                ffn_forward(&p.expert(e), &xe, n, &mut a, &mut b, &mut hh, y);
            });
            if s > 0 {
                shared_y = ffn_rows(&p.shared(), x, tokens);
            }
        }
        Some(dy) => {
            dx_sorted = vec![T::ZERO; groups.rows() * h];
            g_sorted = vec![T::ZERO; groups.rows()];
            let mut dw1 = vec![T::ZERO; ne * h * w];
            let mut dw3 = vec![T::ZERO; ne * h * w];
            let mut dw2 = vec![T::ZERO; ne * w * h];
            let jobs: Vec<ExpertJob<'_, T>> = split_rows(&mut y_sorted, counts(), h)
                .into_iter()
                .zip(split_rows(&mut dx_sorted, counts(), h))
                .zip(split_rows(&mut g_sorted, counts(), 1))
                .zip(
                    dw1.chunks_mut(h * w)
                        .zip(dw3.chunks_mut(h * w))
                        .zip(dw2.chunks_mut(w * h)),
                )
                .enumerate()
                .map(|(e, (((y, dx), g), ((dw1, dw3), dw2)))| ExpertJob {
                    e,
                    lo: groups.offsets[e],
                    y,
                    dx,
                    g,
                    dw1,
                    dw3,
                    dw2,
                })
                .collect();
            jobs.into_par_iter().for_each(|job| {
                let n = job.g.len();
                let slots = &groups.order[job.lo..job.lo + n];
                let f = p.expert(job.e);
                let xe = gather(x, h, slots, k);
                let mut a = vec![T::ZERO; n * w];
                let mut b = vec![T::ZERO; n * w];
                let mut hh = vec![T::ZERO; n * w];
                ffn_forward(&f, &xe, n, &mut a, &mut b, &mut hh, job.y);
                let mut dyw = vec![T::ZERO; n * h];
                for (((dr, g), yr), &j) in dyw
                    .chunks_mut(h)
                    .zip(job.g.iter_mut())
                    .zip(job.y.chunks(h))
                    .zip(slots)
                {
                    let t = j / k;
                    let dyt = &dy[t * h..(t + 1) * h];
                    let wj = weights[j];
                    for (d, &v) in dr.iter_mut().zip(dyt) {
                        *d = wj * v;
                    }
                    *g = dot(dyt, yr);
                }
                let mut da = vec![T::ZERO; n * w];
                let mut db = vec![T::ZERO; n * w];
                ffn_backward(&f, n, &a, &b, &dyw, &mut da, &mut db, job.dx);
                matmul_at(w, n, h, &hh, &dyw, job.dw2, false);
                matmul_at(h, n, w, &xe, &da, job.dw1, false);
                matmul_at(h, n, w, &xe, &db, job.dw3, false);
            });

            let (mut ds1, mut ds3, mut ds2) = (
                vec![T::ZERO; h * s],
                vec![T::ZERO; h * s],
                vec![T::ZERO; s * h],
            );
            if s > 0 {
                let f = p.shared();
                shared_y = vec![T::ZERO; tokens * h];
                shared_dx = vec![T::ZERO; tokens * h];
                let mut hh_s = vec![T::ZERO; tokens * s];
                let mut da_s = vec![T::ZERO; tokens * s];
                let mut db_s = vec![T::ZERO; tokens * s];
                (
                    shared_y.par_chunks_mut(ROW_CHUNK * h),
                    shared_dx.par_chunks_mut(ROW_CHUNK * h),
                    hh_s.par_chunks_mut(ROW_CHUNK * s),
                    da_s.par_chunks_mut(ROW_CHUNK * s),
                    db_s.par_chunks_mut(ROW_CHUNK * s),
                    x.par_chunks(ROW_CHUNK * h),
                    dy.par_chunks(ROW_CHUNK * h),
                )
                    .into_par_iter()
                    .for_each(|(yc, dxc, hc, dac, dbc, xc, dyc)| {
                        let m = xc.len() / h;
                        let mut a = vec![T::ZERO; m * s];
                        let mut b = vec![T::ZERO; m * s];
                        ffn_forward(&f, xc, m, &mut a, &mut b, hc, yc);
                        ffn_backward(&f, m, &a, &b, dyc, dac, dbc, dxc);
                    });
                par_at(s, tokens, h, &hh_s, dy, &mut ds2);
                par_at(h, tokens, s, x, &da_s, &mut ds1);
                par_at(h, tokens, s, x, &db_s, &mut ds3);
            }
            grads = Some(GradsT {
                dx: Vec::new(),
                dwr: vec![T::ZERO; h * ne],
                dw1,
                dw3,
                dw2,
                ds1,
                ds3,
                ds2,
            });
        }
    }

    // 4. combine, per token in slot order
    let mut out = vec![T::ZERO; tokens * h];
    out.par_chunks_mut(h)
        .enumerate()
        .with_min_len(16)
        .for_each(|(t, acc)| {
            let slots = t * k..(t + 1) * k;
            for (&r, &wj) in groups.row_of[slots.clone()].iter().zip(&weights[slots]) {
                if r == usize::MAX {
                    continue;
                }
                for (a, &v) in acc.iter_mut().zip(&y_sorted[r * h..(r + 1) * h]) {
                    *a += wj * v;
                }
            }
            if s > 0 {
                for (a, &v) in acc.iter_mut().zip(&shared_y[t * h..(t + 1) * h]) {
                    *a += v;
                }
            }
        });

    // 5. router backward and dx
    if let Some(g) = grads.as_mut() {
        let mut dx_router = Vec::new();
        if routed && tokens > 0 {
            let mut dl = vec![T::ZERO; tokens * ne];
            dl.par_chunks_mut(ne)
                .enumerate()
                .with_min_len(64)
                .for_each(|(t, dl)| {
                    let pr = &probs[t * ne..(t + 1) * ne];
                    let sl = t * k..(t + 1) * k;
                    // dl holds dp first
                    if sh.renormalize {
                        let ssum = idx[sl.clone()]
                            .iter()
                            .fold(T::ZERO, |acc, &e| acc + pr[e as usize]);
                        let gw = sl.clone().fold(T::ZERO, |acc, j| {
                            acc + g_sorted[groups.row_of[j]] * weights[j]
                        });
                        for j in sl {
                            dl[idx[j] as usize] = (g_sorted[groups.row_of[j]] - gw) / ssum;
                        }
                    } else {
                        for j in sl {
                            dl[idx[j] as usize] = g_sorted[groups.row_of[j]];
                        }
                    }
                    let pd = pr
                        .iter()
                        .zip(dl.iter())
                        .fold(T::ZERO, |acc, (&p, &d)| acc + p * d);
                    for (d, &p) in dl.iter_mut().zip(pr) {
                        *d = p * (*d - pd);
                    }
                });
            par_at(h, tokens, ne, x, &dl, &mut g.dwr);
            dx_router = vec![T::ZERO; tokens * h];
            par_rows(tokens, ne, h, &dl, &p.wr, &mut dx_router, true);
        }
        let mut dx = vec![T::ZERO; tokens * h];
        dx.par_chunks_mut(h)
            .enumerate()
            .with_min_len(16)
            .for_each(|(t, acc)| {
                for &r in &groups.row_of[t * k..(t + 1) * k] {
                    if r == usize::MAX {
                        continue;
                    }
                    for (a, &v) in acc.iter_mut().zip(&dx_sorted[r * h..(r + 1) * h]) {
                        *a += v;
                    }
                }
                for extra in [&shared_dx, &dx_router] {
                    if !extra.is_empty() {
                        for (a, &v) in acc.iter_mut().zip(&extra[t * h..(t + 1) * h]) {
                            *a += v;
                        }
                    }
                }
            });
        g.dx = dx;
    }

    let f = ForwardT {
        tokens,
        top_k: k,
        out,
        idx,
        weights,
        probs,
    };
    Ok((f, grads))
}

#[cfg(test)]
#[allow(clippy::needless_range_loop)]
mod tests {
    use super::*;
    use crate::oracle::params::random_tokens;
    use crate::route;
    use crate::tensor::uniform_bf16;

    fn shape(h: usize, w: usize, e: usize, k: usize, s: usize, renormalize: bool) -> LayerShape {
        LayerShape {
            d_model: h,
            width: w,
            experts: e,
            top_k: k,
            shared: s,
            renormalize,
        }
    }

    fn f64s(v: &[bf16]) -> Vec<f64> {
        v.iter().map(|x| x.to_f64()).collect()
    }

    /// The naive scalar layer in f64: loops only. Routes from its own f64 router unless given.
    fn naive(
        p: &LayerParams,
        x: &[bf16],
        tokens: usize,
        routes: Option<&Routes>,
    ) -> (Vec<f64>, Vec<i32>) {
        let sh = p.shape;
        let (h, w, ne, k, s) = (sh.d_model, sh.width, sh.experts, sh.top_k, sh.shared);
        let (x, wr, w1, w3, w2) = (f64s(x), f64s(&p.wr), f64s(&p.w1), f64s(&p.w3), f64s(&p.w2));
        let (s1, s3, s2) = (f64s(&p.s1), f64s(&p.s3), f64s(&p.s2));
        let silu = |a: f64| a / (1.0 + (-a).exp());
        let ffn = |xr: &[f64], w1: &[f64], w3: &[f64], w2: &[f64], width: usize| {
            let mut y = vec![0.0; h];
            for i in 0..width {
                let (mut a, mut b) = (0.0, 0.0);
                for c in 0..h {
                    a += xr[c] * w1[c * width + i];
                    b += xr[c] * w3[c * width + i];
                }
                let hv = silu(a) * b;
                for c in 0..h {
                    y[c] += hv * w2[i * h + c];
                }
            }
            y
        };
        let mut out = vec![0.0; tokens * h];
        let mut ids = Vec::new();
        for t in 0..tokens {
            let xr = &x[t * h..(t + 1) * h];
            let slots: Vec<(i32, f64)> = match routes {
                Some(r) => r.slots(t).map(|(e, w)| (e, w as f64)).collect(),
                None => {
                    let mut l = vec![0.0; ne];
                    for e in 0..ne {
                        for c in 0..h {
                            l[e] += xr[c] * wr[c * ne + e];
                        }
                    }
                    let m = l.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    let z: f64 = l.iter().map(|v| (v - m).exp()).sum();
                    let pr: Vec<f64> = l.iter().map(|v| (v - m).exp() / z).collect();
                    let mut order: Vec<usize> = (0..ne).collect();
                    order.sort_by(|&a, &b| pr[b].partial_cmp(&pr[a]).unwrap().then(a.cmp(&b)));
                    let sum: f64 = order[..k].iter().map(|&e| pr[e]).sum();
                    order[..k]
                        .iter()
                        .map(|&e| (e as i32, if sh.renormalize { pr[e] / sum } else { pr[e] }))
                        .collect()
                }
            };
            let o = &mut out[t * h..(t + 1) * h];
            for &(e, wt) in &slots {
                ids.push(e);
                if e == MASKED {
                    continue;
                }
                let e = e as usize;
                let hw = h * w;
                let y = ffn(
                    xr,
                    &w1[e * hw..(e + 1) * hw],
                    &w3[e * hw..(e + 1) * hw],
                    &w2[e * hw..(e + 1) * hw],
                    w,
                );
                for c in 0..h {
                    o[c] += wt * y[c];
                }
            }
            if s > 0 {
                let y = ffn(xr, &s1, &s3, &s2, s);
                for c in 0..h {
                    o[c] += y[c];
                }
            }
        }
        (out, ids)
    }

    fn assert_close(got: &[f64], want: &[f64], rel: f64, abs: f64, what: &str) {
        assert_eq!(got.len(), want.len(), "{what}: lengths");
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            assert!(
                (g - w).abs() <= rel * w.abs() + abs,
                "{what}[{i}]: got {g}, want {w}"
            );
        }
    }

    #[test]
    fn forward_matches_naive() {
        for (sh, tokens, seed) in [
            (shape(8, 4, 6, 2, 5, true), 9, 1),
            (shape(7, 3, 5, 3, 0, false), 11, 2),
            (shape(16, 8, 8, 1, 4, true), 5, 3),
        ] {
            let p = LayerParams::random(sh, seed);
            let x = random_tokens(tokens, sh.d_model, seed);
            let (want, want_ids) = naive(&p, &x, tokens, None);
            let fwd = forward(&p, &x, tokens).unwrap();
            assert_eq!(fwd.routes.idx, want_ids, "selection");
            // one bf16 rounding (≤ 2^-8 relative) on top of the f32 error
            assert_close(&f64s(&fwd.out), &want, 1.0 / 256.0, 1e-5, "bf16 out");
            let p32 = ParamsT::<f32>::from_bf16(&p);
            let f32_out = forward_t(&p32, &to_t::<f32>(&x), tokens, Routing::Router)
                .unwrap()
                .out;
            let f32_out: Vec<f64> = f32_out.iter().map(|&v| v as f64).collect();
            assert_close(&f32_out, &want, 1e-5, 1e-5, "f32 out");
            let p64 = ParamsT::<f64>::from_bf16(&p);
            let f64_out = forward_t(&p64, &to_t::<f64>(&x), tokens, Routing::Router)
                .unwrap()
                .out;
            assert_close(&f64_out, &want, 1e-12, 1e-12, "f64 out");
        }
    }

    #[test]
    fn routes_are_the_route_modules() {
        let sh = shape(32, 4, 16, 4, 0, true);
        let tokens = 300; // several row blocks
        let p = LayerParams::random(sh, 5);
        let x = random_tokens(tokens, 32, 6);
        assert_eq!(
            forward(&p, &x, tokens).unwrap().routes,
            route::route(&x, &p.wr, tokens, &sh)
        );
        let sh = LayerShape {
            renormalize: false,
            ..sh
        };
        let p = LayerParams { shape: sh, ..p };
        assert_eq!(
            forward(&p, &x, tokens).unwrap().routes,
            route::route(&x, &p.wr, tokens, &sh)
        );
    }

    #[test]
    fn masked_slots_contribute_nothing() {
        for s in [0, 6] {
            let sh = shape(8, 4, 5, 3, s, true);
            let tokens = 4;
            let p = LayerParams::random(sh, 9);
            let x = random_tokens(tokens, 8, 9);
            let dy = uniform_bf16(tokens * 8, 1.0, 9, 7);
            let idx = vec![-1, -1, -1, 2, -1, 0, 4, 3, 1, -1, 1, -1];
            let mut wa = vec![0.2f32; 12];
            let mut wb = wa.clone();
            for (j, &e) in idx.iter().enumerate() {
                if e == MASKED {
                    wa[j] = f32::NAN;
                    wb[j] = 1e30;
                }
            }
            let ra = Routes::new(tokens, 3, idx.clone(), wa).unwrap();
            let rb = Routes::new(tokens, 3, idx, wb).unwrap();
            let oa = forward_with_routes(&p, &x, tokens, &ra).unwrap();
            assert_eq!(oa, forward_with_routes(&p, &x, tokens, &rb).unwrap());
            let (want, _) = naive(&p, &x, tokens, Some(&ra));
            assert_close(&f64s(&oa), &want, 1.0 / 256.0, 1e-5, "masked out");
            if s == 0 {
                assert!(
                    oa[..8].iter().all(|v| v.to_f32() == 0.0),
                    "a fully masked token is zero"
                );
            }
            let (ya, ga) = train_step_with_routes(&p, &x, tokens, &dy, &ra).unwrap();
            let (yb, gb) = train_step_with_routes(&p, &x, tokens, &dy, &rb).unwrap();
            assert_eq!((&ya, &ga), (&yb, &gb));
            assert_eq!(ya, oa);
            assert!(
                ga.dwr.iter().all(|v| v.to_f32() == 0.0),
                "given weights are constants"
            );
            for t in [&ga.dx, &ga.dw1, &ga.dw3, &ga.dw2, &ga.ds1, &ga.ds3, &ga.ds2] {
                assert!(t.iter().all(|v| v.is_finite()));
            }
            // expert 2 only gets token 1 slot 0 with weight 0.2: dW2_2 = 0.2 · h_2(x_1)ᵀ dy_1 ≠ 0
            assert!(ga.dw2[2 * 32..3 * 32].iter().any(|v| v.to_f32() != 0.0));
        }
    }

    #[test]
    fn zero_tokens() {
        let sh = shape(8, 4, 5, 2, 3, true);
        let p = LayerParams::random(sh, 1);
        let f = forward(&p, &[], 0).unwrap();
        assert!(f.out.is_empty());
        assert_eq!(f.routes, Routes::empty(2));
        assert!(
            forward_with_routes(&p, &[], 0, &Routes::empty(2))
                .unwrap()
                .is_empty()
        );
        let (y, g) = train_step(&p, &[], 0, &[]).unwrap();
        assert!(y.is_empty() && g.dx.is_empty());
        for (t, n) in g.params().into_iter().zip(LayerParams::sizes(&sh)) {
            assert_eq!(t.len(), n);
            assert!(t.iter().all(|v| v.to_f32() == 0.0));
        }
        assert!(expert_rows(&p, 3, &[], 0).unwrap().is_empty());
    }

    /// The bf16 value of `v` (NaN and the infinities are exact in bf16).
    fn b(v: f32) -> bf16 {
        bf16::from_f32(v)
    }

    #[test]
    fn non_finite_logits_are_a_route_error_before_the_experts() {
        let sh = shape(8, 4, 5, 2, 3, true);
        let tokens = 6;
        let p = LayerParams::random(sh, 11);
        let clean = random_tokens(tokens, 8, 11);
        let dy = uniform_bf16(tokens * 8, 1.0, 11, 2);
        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            // in x (token 4, channel 5): every logit of token 4 is non-finite, expert 0 first
            let mut x = clean.clone();
            x[4 * 8 + 5] = b(bad);
            for r in [
                forward(&p, &x, tokens).map(|_| ()),
                train_step(&p, &x, tokens, &dy).map(|_| ()),
            ] {
                match r {
                    Err(LayerError::Route(RouteError::NonFiniteLogit {
                        rank: 0,
                        token: 4,
                        expert: 0,
                        value,
                    })) => assert!(!value.is_finite()),
                    other => panic!("{bad} in x: {other:?}"),
                }
            }
            // in the router weights (channel 2, expert 3): every token's logit 3
            let mut q = p.clone();
            q.wr[2 * 5 + 3] = b(bad);
            match forward(&q, &clean, tokens) {
                Err(LayerError::Route(RouteError::NonFiniteLogit {
                    token: 0,
                    expert: 3,
                    ..
                })) => {}
                other => panic!("{bad} in wr: {other:?}"),
            }
            // with given routes there is no router: nothing is refused, the value propagates
            let f = forward(&p, &clean, tokens).unwrap();
            let out = forward_with_routes(&p, &x, tokens, &f.routes).unwrap();
            assert!(out[4 * 8..5 * 8].iter().any(|v| !v.to_f32().is_finite()));
        }
    }

    #[test]
    fn non_finite_expert_weights_propagate() {
        let sh = shape(8, 4, 5, 2, 0, true);
        let tokens = 7;
        let mut p = LayerParams::random(sh, 12);
        let x = random_tokens(tokens, 8, 12);
        let f = forward(&p, &x, tokens).unwrap();
        // expert e's W1 column 0 gets a NaN: the rows routed to e become NaN, the others not
        let e = f.routes.idx[0] as usize;
        p.w1[e * 8 * 4] = b(f32::NAN);
        let g = forward(&p, &x, tokens).unwrap();
        assert_eq!(
            g.routes, f.routes,
            "routing does not read the expert weights"
        );
        for t in 0..tokens {
            let routed = f.routes.idx[t * 2..t * 2 + 2].contains(&(e as i32));
            let row = &g.out[t * 8..(t + 1) * 8];
            assert_eq!(
                row.iter().any(|v| v.to_f32().is_nan()),
                routed,
                "token {t} (routed to {e}: {routed})"
            );
        }
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(32))]
        #[test]
        fn the_first_non_finite_token_is_named(
            tokens in 1usize..40,
            picks in proptest::collection::vec((0usize..40, 0usize..8, 0usize..3), 1..4),
            seed in 0u64..1000,
        ) {
            let sh = shape(8, 4, 6, 3, 0, true);
            let p = LayerParams::random(sh, seed);
            let mut x = random_tokens(tokens, 8, seed);
            let vals = [f32::NAN, f32::INFINITY, f32::NEG_INFINITY];
            let mut first = usize::MAX;
            for &(t, c, v) in &picks {
                let t = t % tokens;
                x[t * 8 + c] = b(vals[v]);
                first = first.min(t);
            }
            match forward(&p, &x, tokens) {
                Err(LayerError::Route(RouteError::NonFiniteLogit { token, expert, .. })) => {
                    proptest::prop_assert_eq!(token, first);
                    proptest::prop_assert_eq!(expert, 0);
                }
                other => proptest::prop_assert!(false, "{:?}", other),
            }
        }
    }

    #[test]
    fn no_shared_expert() {
        let sh = shape(8, 4, 5, 2, 0, true);
        let p = LayerParams::random(sh, 3);
        let x = random_tokens(6, 8, 3);
        let dy = uniform_bf16(6 * 8, 1.0, 3, 1);
        let (y, g) = train_step(&p, &x, 6, &dy).unwrap();
        assert_eq!(y, forward(&p, &x, 6).unwrap().out);
        assert!(g.ds1.is_empty() && g.ds3.is_empty() && g.ds2.is_empty());
        assert!(g.dwr.iter().any(|v| v.to_f32() != 0.0));
    }

    #[test]
    fn expert_rows_are_row_independent() {
        let sh = shape(24, 12, 4, 2, 0, true);
        let p = LayerParams::random(sh, 4);
        let n = 300; // crosses row blocks
        let x = random_tokens(n, 24, 4);
        let all = expert_rows(&p, 1, &x, n).unwrap();
        let group = expert_rows(&p, 1, &x[100 * 24..137 * 24], 37).unwrap();
        assert_eq!(group, all[100 * 24..137 * 24]);
        for r in (0..n).step_by(7).chain(100..137) {
            let one = expert_rows(&p, 1, &x[r * 24..(r + 1) * 24], 1).unwrap();
            assert_eq!(one, all[r * 24..(r + 1) * 24], "row {r}");
        }
    }

    #[test]
    fn expert_rows_are_the_layers_rows() {
        // K = 1 with renormalisation: w = p / p = 1 exactly, so out = bf16(0 + 1·y) = bf16(y)
        let sh = shape(16, 8, 6, 1, 0, true);
        let tokens = 200;
        let p = LayerParams::random(sh, 8);
        let x = random_tokens(tokens, 16, 8);
        let f = forward(&p, &x, tokens).unwrap();
        assert!(f.routes.weights.iter().all(|&w| w == 1.0));
        for t in 0..tokens {
            let e = f.routes.idx[t] as usize;
            let y = expert_rows(&p, e, &x[t * 16..(t + 1) * 16], 1).unwrap();
            assert_eq!(y, f.out[t * 16..(t + 1) * 16], "token {t}");
        }
    }

    #[test]
    fn deterministic_across_pool_sizes() {
        let sh = shape(16, 8, 8, 3, 12, true);
        let tokens = 1100;
        let p = LayerParams::random(sh, 11);
        let x = random_tokens(tokens, 16, 11);
        let dy = uniform_bf16(tokens * 16, 1.0, 11, 3);
        // slot 0 of every token on expert 0: more rows than one forward task takes
        let idx: Vec<i32> = (0..tokens * 3)
            .map(|j| {
                if j % 3 == 0 {
                    0
                } else {
                    (1 + (j / 3 + j % 3) % 7) as i32
                }
            })
            .collect();
        let mut idx = idx;
        for t in 0..tokens {
            if idx[t * 3 + 1] == idx[t * 3 + 2] {
                idx[t * 3 + 2] = MASKED;
            }
        }
        let routes = Routes::new(
            tokens,
            3,
            idx,
            uniform_bf16(tokens * 3, 1.0, 11, 4)
                .iter()
                .map(|v| v.to_f32())
                .collect(),
        )
        .unwrap();
        let runs: Vec<_> = [1, 2, 3]
            .into_iter()
            .map(|threads| {
                rayon::ThreadPoolBuilder::new()
                    .num_threads(threads)
                    .build()
                    .unwrap()
                    .install(|| {
                        (
                            forward(&p, &x, tokens).unwrap(),
                            train_step(&p, &x, tokens, &dy).unwrap(),
                            forward_with_routes(&p, &x, tokens, &routes).unwrap(),
                            train_step_with_routes(&p, &x, tokens, &dy, &routes).unwrap(),
                        )
                    })
            })
            .collect();
        for r in &runs[1..] {
            assert!(r == &runs[0], "results differ across pool sizes");
        }
        let (f, (y, _), fr, (yr, _)) = &runs[0];
        assert_eq!(&f.out, y, "train step forward = forward");
        assert_eq!(
            fr, yr,
            "train step forward = forward (given routes, expert 0 split in forward)"
        );
    }

    #[test]
    fn bad_inputs_are_typed_errors() {
        let sh = shape(8, 4, 5, 2, 3, true);
        let p = LayerParams::random(sh, 1);
        let x = random_tokens(3, 8, 1);
        assert_eq!(
            forward(&p, &x[..20], 3).unwrap_err(),
            LayerError::Size {
                what: "x",
                got: 20,
                want: 24
            }
        );
        assert_eq!(
            train_step(&p, &x, 3, &x[..8]).unwrap_err(),
            LayerError::Size {
                what: "dy",
                got: 8,
                want: 24
            }
        );
        let bad = Routes::new(3, 2, vec![0, 1, 2, 5, 3, 4], vec![0.5; 6]).unwrap();
        assert_eq!(
            forward_with_routes(&p, &x, 3, &bad).unwrap_err(),
            LayerError::Route(RouteError::Wide {
                rank: 0,
                token: 1,
                slot: 1,
                value: 5,
                experts: 5
            })
        );
        let short = Routes::new(2, 2, vec![0, 1, 2, 3], vec![0.5; 4]).unwrap();
        assert_eq!(
            forward_with_routes(&p, &x, 3, &short).unwrap_err(),
            LayerError::Size {
                what: "routes.tokens",
                got: 2,
                want: 3
            }
        );
        assert_eq!(
            expert_rows(&p, 5, &x, 3).unwrap_err(),
            LayerError::NoSuchExpert {
                expert: 5,
                experts: 5
            }
        );
        assert!(matches!(
            expert_rows(&p, 0, &x, 2),
            Err(LayerError::Size { what: "x_rows", .. })
        ));
        let mut broken = p.clone();
        broken.w2.pop();
        assert!(matches!(
            forward(&broken, &x, 3),
            Err(LayerError::Config(ConfigError::Invalid { field: "w2", .. }))
        ));
    }
}
