//! The simple GPU reference path (issue 4): [`ReferenceLayer`] computes the MoE layer's forward
//! pass and train step (output, dx and all seven parameter gradients, in the
//! [`DeviceParams`] layouts) with untuned, obviously correct kernels
//! ([`afdep_kernels::ops::reference`]), at sizes the CPU oracle cannot reach (16k, 131k, 1M
//! tokens at the record shape, docs/design.md, "The reference record"). [`compare`] gives the
//! benchmark's error columns: the metric of [`crate::accuracy::max_rel_err`] of the fast
//! [`MoeLayer`] against the reference, computed on the device.
//!
//! # What it computes
//! The layer of docs/design.md, "Specification: Layer and train step" with the arithmetic of
//! `afdep_core::oracle::layer`: bf16 inputs widened exactly, every intermediate (logits,
//! probabilities, weights, `a`, `b`, `h`, `y`, the shared expert's values, `g`, `dlogits`, `da`,
//! `db`, every partial sum) kept in f32, each output cast to bf16 once. One thread per output
//! element; each sum a plain loop in ascending order (the table in
//! [`afdep_kernels::ops::reference`]); the combine's and dx's slot sums in slot order with each
//! product and sum rounded, as the oracle; no atomics where the order matters (the per-expert
//! weight gradients walk the expert's rows in order: token ascending, then slot). Any E, K, H, W, S
//! works (nothing is specialised or tiled), and 0 tokens.
//!
//! Where it differs from the oracle, all in f32 and far below one bf16 rounding: the order of
//! the dot products (ascending FMA here, `matrixmultiply`'s blocked kernels there), `expf`
//! against Rust's `exp` (a few f32 ulps), and two reassociations, `dh = w·(dy·W2ᵀ)` instead of
//! `(w·dy)·W2ᵀ` and `g = <h, dy·W2ᵀ>` instead of `<dy, h·W2>` (equal in exact arithmetic).
//!
//! # Routing
//! The expert choice is taken from the caller's routes (with [`ReferenceLayer::run_like`]: the
//! fast layer's [`MoeLayer::routes`]), so that a near-tie in top-k cannot make two router
//! implementations pick different experts and produce a huge spurious error. With router
//! semantics the choice itself is checked independently ([`ReferenceLayer::topk_check`],
//! `afdep_kernels::ops::reference::topk_check`): from the reference's own f32 logits, every
//! chosen expert must not be provably below an unchosen one, with the rounding radius of two
//! f32 dot products of length H and of the softmax as the margin; near ties are counted. Everything
//! else is recomputed: with [`LayerRouting::Router`] the logits `x·Wr`, the softmax and the weights
//! `p_k / Σ_k p_k` (the routes' weights are ignored) and, in the train step, the router gradient
//! through the weights (`dWr` and the router's term of dx), as the oracle's router mode; with
//! [`LayerRouting::Given`] the routes' weights are constants (masked slots allowed, `dWr = 0`, no
//! router term), as `train_step_with_routes`. The ids are checked first (the rules of
//! `RouteRules::layer`, plus non-finite weights for given routes): a rejected table is
//! [`LayerGpuError::Route`] with the oracle's error, and nothing is computed.
//!
//! # Device memory
//! [`ReferenceLayer::device_bytes`] counts every buffer (all allocated in
//! [`ReferenceLayer::new`]). With `T` tokens, slots `T·K`, train `t ∈ {0, 1}`:
//! `2·T·H·(1 + t)` (out, dx) `+ 4·T·E·(1 + t)` (probabilities, dlogits) `+ 4·T·K·(1 + t)`
//! (weights, g) `+ 4·T·K·W·(1 + 3t)` (h; a, b, dy·W2ᵀ) `+ 4·T·S·(1 + 2t)` (shared h; a, b)
//! `+ t·(16·T·K + 8·E·⌈T·K/1024⌉)` (row lists) `+ t·2·P` (gradients and transposed weights,
//! `P` the parameter bytes). At the record shape (H 512, W 128, E 64, K 8, S 1024) and 1M
//! tokens that is about 30.7 GiB for the train step and 9.3 GiB for the forward pass (the
//! fast train layer holds about 40 GiB there, so both fit a 139 GiB H200 together), 3.8 / 1.2
//! GiB at 131k tokens, 0.5 / 0.15 GiB at 16k.
//!
//! # Time
//! Untuned: about 10¹³ f32 FMAs for a 1M-token train step at the record shape, each kernel a
//! naive loop with coalesced weight reads (through the transposed copies); seconds, not
//! milliseconds. [`ReferenceLayer::run`] waits for the device before it returns.

use afdep_core::oracle::LayerParams;
use afdep_core::oracle::params::PARAM_NAMES;
use afdep_core::route::{RouteRules, validate};
use afdep_core::{LayerShape, RouteError, Routes, bf16};
use afdep_kernels::cudarc::driver::CudaSlice;
use afdep_kernels::ops::reference::{
    self as ops, DxExperts, DxRouter, DxShared, RefDims, Rows, TopkStats,
};
use afdep_kernels::ops::{download, poison, zeros};
use afdep_kernels::{DeviceRoutes, GpuContext, KernelError};

use crate::layer::{DeviceParams, LayerGpuError, LayerRouting, MoeLayer};

/// The inputs of one reference run (see [`ReferenceLayer::run`]).
#[derive(Debug, Clone, Copy)]
pub struct ReferenceInputs<'a> {
    /// The parameters, in the [`DeviceParams`] layouts.
    pub params: &'a DeviceParams,
    /// x, T × H.
    pub x: &'a CudaSlice<bf16>,
    /// dy, T × H: `Some` runs the train step, `None` the forward pass only.
    pub dy: Option<&'a CudaSlice<bf16>>,
    /// The routes: their ids are the expert choice; their weights are used only with
    /// [`LayerRouting::Given`].
    pub routes: &'a DeviceRoutes,
    /// Router semantics (weights recomputed and differentiated) or given weights.
    pub routing: LayerRouting,
}

/// Exact bf16 transposes of the weights, so that the naive kernels read them coalesced.
#[derive(Debug)]
struct Transposed {
    /// W1: E × W × H.
    w1t: CudaSlice<bf16>,
    /// W3: E × W × H.
    w3t: CudaSlice<bf16>,
    /// W2: E × H × W.
    w2t: CudaSlice<bf16>,
    /// S1: S × H.
    s1t: CudaSlice<bf16>,
    /// S3: S × H.
    s3t: CudaSlice<bf16>,
    /// S2: H × S.
    s2t: CudaSlice<bf16>,
    /// Wr: E × H.
    wrt: CudaSlice<bf16>,
}

impl Transposed {
    fn bytes(&self) -> usize {
        [
            &self.w1t, &self.w3t, &self.w2t, &self.s1t, &self.s3t, &self.s2t, &self.wrt,
        ]
        .iter()
        .map(|t| t.len() * 2)
        .sum()
    }
}

/// The buffers of the train step only.
#[derive(Debug)]
struct TrainBuffers {
    dx: CudaSlice<bf16>,
    grads: DeviceParams,
    /// a then (in place) da, slots × W.
    a: CudaSlice<f32>,
    /// b then (in place) db, slots × W.
    b: CudaSlice<f32>,
    /// dy·W2ᵀ (unweighted), slots × W.
    dhu: CudaSlice<f32>,
    /// Shared a then da, T × S.
    sa: CudaSlice<f32>,
    /// Shared b then db, T × S.
    sb: CudaSlice<f32>,
    /// g = <dy, y> per slot.
    g: CudaSlice<f32>,
    /// dlogits, T × E.
    dl: CudaSlice<f32>,
    /// Row-list workspace, chunks × E.
    counts: CudaSlice<u64>,
    /// Expert offsets, E + 1.
    offsets: CudaSlice<u64>,
    /// Flat slot of each row, T·K.
    rows: CudaSlice<u64>,
    /// Token of each row, T·K.
    toks: CudaSlice<u64>,
    t: Transposed,
}

/// The simple GPU reference of the MoE layer (see the module documentation).
#[derive(Debug)]
pub struct ReferenceLayer {
    shape: LayerShape,
    tokens: usize,
    dims: RefDims,
    out: CudaSlice<bf16>,
    /// Logits, then probabilities, T × E.
    probs: CudaSlice<f32>,
    /// The weights used, T × K.
    weights: CudaSlice<f32>,
    /// h of the routed experts, slots × W.
    h: CudaSlice<f32>,
    /// h of the shared expert, T × S.
    sh: CudaSlice<f32>,
    /// The first rejected slot.
    first: CudaSlice<u64>,
    /// The top-k check's three words, and what the last router-mode run found.
    topk: CudaSlice<u64>,
    topk_stats: Option<TopkStats>,
    train: Option<TrainBuffers>,
    /// Whether the last run was a train step (dx and gradients are valid).
    trained: bool,
}

/// Copies host parameters into new device buffers (e.g. to run the reference on a shape the
/// fast layer cannot take). Waits for nothing.
pub fn upload_params(ctx: &GpuContext, p: &LayerParams) -> Result<DeviceParams, LayerGpuError> {
    p.check()
        .map_err(|e| LayerGpuError::Unsupported(e.to_string()))?;
    let up = |v: &Vec<bf16>| -> Result<CudaSlice<bf16>, KernelError> {
        if v.is_empty() {
            zeros(ctx, 0)
        } else {
            ctx.stream()
                .clone_htod(v)
                .map_err(KernelError::driver("uploading a parameter"))
        }
    };
    Ok(DeviceParams {
        wr: up(&p.wr)?,
        w1: up(&p.w1)?,
        w3: up(&p.w3)?,
        w2: up(&p.w2)?,
        s1: up(&p.s1)?,
        s3: up(&p.s3)?,
        s2: up(&p.s2)?,
    })
}

fn check_len<T>(what: &'static str, buf: &CudaSlice<T>, want: usize) -> Result<(), LayerGpuError> {
    if buf.len() != want {
        return Err(LayerGpuError::Size {
            what,
            got: buf.len(),
            want,
        });
    }
    Ok(())
}

/// The route error of token `t` of a table, re-indexed from the one-token table it was found
/// in.
fn at_token(e: RouteError, t: usize) -> RouteError {
    match e {
        RouteError::Duplicate {
            rank,
            slot,
            expert,
            first_slot,
            ..
        } => RouteError::Duplicate {
            rank,
            token: t,
            slot,
            expert,
            first_slot,
        },
        RouteError::Negative {
            rank, slot, value, ..
        } => RouteError::Negative {
            rank,
            token: t,
            slot,
            value,
        },
        RouteError::Wide {
            rank,
            slot,
            value,
            experts,
            ..
        } => RouteError::Wide {
            rank,
            token: t,
            slot,
            value,
            experts,
        },
        RouteError::Dummy {
            rank,
            slot,
            value,
            owned,
            ..
        } => RouteError::Dummy {
            rank,
            token: t,
            slot,
            value,
            owned,
        },
        RouteError::NonFiniteWeight {
            rank, slot, value, ..
        } => RouteError::NonFiniteWeight {
            rank,
            token: t,
            slot,
            value,
        },
        other => other,
    }
}

impl ReferenceLayer {
    /// A reference of `shape` for `tokens` tokens; `train` also allocates what the train step
    /// needs. Any valid shape works ([`LayerShape::validate`]; no multiple-of constraints).
    pub fn new(
        ctx: &GpuContext,
        shape: &LayerShape,
        tokens: usize,
        train: bool,
    ) -> Result<Self, LayerGpuError> {
        shape
            .validate()
            .map_err(|e| LayerGpuError::Unsupported(e.to_string()))?;
        let d = RefDims::new(shape, tokens)?;
        let (h, w, e, s) = (d.hidden(), d.width(), d.experts(), d.shared());
        let slots = d.slots();
        let train = if train {
            let sizes = LayerParams::sizes(shape);
            Some(TrainBuffers {
                dx: zeros(ctx, tokens * h)?,
                grads: DeviceParams::zeros(ctx, shape)?,
                a: zeros(ctx, slots * w)?,
                b: zeros(ctx, slots * w)?,
                dhu: zeros(ctx, slots * w)?,
                sa: zeros(ctx, tokens * s)?,
                sb: zeros(ctx, tokens * s)?,
                g: zeros(ctx, slots)?,
                dl: zeros(ctx, tokens * e)?,
                counts: zeros(ctx, d.chunks() * e)?,
                offsets: zeros(ctx, e + 1)?,
                rows: zeros(ctx, slots)?,
                toks: zeros(ctx, slots)?,
                t: Transposed {
                    w1t: zeros(ctx, sizes[1])?,
                    w3t: zeros(ctx, sizes[2])?,
                    w2t: zeros(ctx, sizes[3])?,
                    s1t: zeros(ctx, sizes[4])?,
                    s3t: zeros(ctx, sizes[5])?,
                    s2t: zeros(ctx, sizes[6])?,
                    wrt: zeros(ctx, sizes[0])?,
                },
            })
        } else {
            None
        };
        Ok(ReferenceLayer {
            shape: *shape,
            tokens,
            dims: d,
            out: zeros(ctx, tokens * h)?,
            probs: zeros(ctx, tokens * e)?,
            weights: zeros(ctx, slots)?,
            h: zeros(ctx, slots * w)?,
            sh: zeros(ctx, tokens * s)?,
            first: zeros(ctx, 1)?,
            topk: zeros(ctx, 3)?,
            topk_stats: None,
            train,
            trained: false,
        })
    }

    /// The shape.
    pub fn shape(&self) -> &LayerShape {
        &self.shape
    }

    /// Tokens per run.
    pub fn tokens(&self) -> usize {
        self.tokens
    }

    /// What the independent check of the expert choice found in the last run with router
    /// semantics ([`LayerRouting::Router`]): tokens whose chosen ids are provably not their
    /// top-k by the reference's own f32 logits (beyond the rounding radius by which two correct
    /// routers can differ), and near ties. `None` after a run with given routes or before any
    /// run.
    pub fn topk_check(&self) -> Option<TopkStats> {
        self.topk_stats
    }

    /// Whether the reference was built for the train step.
    pub fn is_train(&self) -> bool {
        self.train.is_some()
    }

    /// The output of the last run, T × H (NaN where a failed run left it poisoned).
    pub fn out(&self) -> &CudaSlice<bf16> {
        &self.out
    }

    /// dx of the last run, T × H, when it was a train step.
    pub fn dx(&self) -> Option<&CudaSlice<bf16>> {
        self.train.as_ref().filter(|_| self.trained).map(|t| &t.dx)
    }

    /// The parameter gradients of the last run, when it was a train step.
    pub fn grads(&self) -> Option<&DeviceParams> {
        self.train
            .as_ref()
            .filter(|_| self.trained)
            .map(|t| &t.grads)
    }

    /// Device bytes held by the reference (every buffer; all are allocated in
    /// [`ReferenceLayer::new`], so this is its peak). See the module documentation for the
    /// formula.
    pub fn device_bytes(&self) -> usize {
        let f32s = |v: &[&CudaSlice<f32>]| v.iter().map(|s| s.len() * 4).sum::<usize>();
        let u64s = |v: &[&CudaSlice<u64>]| v.iter().map(|s| s.len() * 8).sum::<usize>();
        let mut n = self.out.len() * 2
            + f32s(&[&self.probs, &self.weights, &self.h, &self.sh])
            + u64s(&[&self.first]);
        if let Some(t) = &self.train {
            n += t.dx.len() * 2
                + t.grads.bytes()
                + t.t.bytes()
                + f32s(&[&t.a, &t.b, &t.dhu, &t.sa, &t.sb, &t.g, &t.dl])
                + u64s(&[&t.counts, &t.offsets, &t.rows, &t.toks]);
        }
        n
    }

    /// Fills out, dx and the gradients with NaN (all bits set), without waiting. Every run
    /// does this first, so anything a run fails to write reads as NaN.
    pub fn poison_outputs(&mut self, ctx: &GpuContext) -> Result<(), LayerGpuError> {
        poison(ctx, &mut self.out)?;
        if let Some(t) = self.train.as_mut() {
            poison(ctx, &mut t.dx)?;
            let g = &mut t.grads;
            for p in [
                &mut g.wr, &mut g.w1, &mut g.w3, &mut g.w2, &mut g.s1, &mut g.s3, &mut g.s2,
            ] {
                poison(ctx, p)?;
            }
        }
        Ok(())
    }

    /// Forward (and, if `train`, the train step's gradients) of the layer with the parameters,
    /// input and expert choice of `layer` (its params, x, dy and routes), with router semantics
    /// ([`LayerRouting::Router`]: weights recomputed from the reference's own probabilities and
    /// differentiated). Waits for the device.
    pub fn run_like(
        &mut self,
        ctx: &GpuContext,
        layer: &MoeLayer,
        train: bool,
    ) -> Result<(), LayerGpuError> {
        self.run_like_with(ctx, layer, train, LayerRouting::Router)
    }

    /// [`ReferenceLayer::run_like`] with the routing semantics of the layer's step: use
    /// [`LayerRouting::Given`] after a given-routes step (the weights in `layer.routes()` are
    /// then the constants the step used).
    pub fn run_like_with(
        &mut self,
        ctx: &GpuContext,
        layer: &MoeLayer,
        train: bool,
        routing: LayerRouting,
    ) -> Result<(), LayerGpuError> {
        if layer.shape() != &self.shape {
            return Err(LayerGpuError::Unsupported(format!(
                "a reference of shape {:?} cannot run like a layer of shape {:?}",
                self.shape,
                layer.shape()
            )));
        }
        if layer.tokens() != self.tokens {
            return Err(LayerGpuError::Size {
                what: "layer tokens",
                got: layer.tokens(),
                want: self.tokens,
            });
        }
        if train && !layer.is_train() {
            return Err(LayerGpuError::Unsupported(
                "the layer was built for the forward pass only: it has no dy".into(),
            ));
        }
        self.run(
            ctx,
            &ReferenceInputs {
                params: layer.params(),
                x: layer.x(),
                dy: train.then(|| layer.dy()),
                routes: layer.routes(),
                routing,
            },
        )
    }

    fn check_inputs(&self, inp: &ReferenceInputs<'_>) -> Result<(), LayerGpuError> {
        let p = inp.params;
        for ((name, t), n) in PARAM_NAMES
            .iter()
            .zip(p.tensors())
            .zip(LayerParams::sizes(&self.shape))
        {
            if t.len() != n {
                return Err(LayerGpuError::Unsupported(format!(
                    "parameter {name} holds {} elements, the shape needs {n}",
                    t.len()
                )));
            }
        }
        let th = self.tokens * self.shape.d_model;
        check_len("x", inp.x, th)?;
        if let Some(dy) = inp.dy {
            check_len("dy", dy, th)?;
        }
        let r = inp.routes;
        if r.tokens != self.tokens || r.top_k != self.shape.top_k {
            return Err(LayerGpuError::Size {
                what: "routes",
                got: r.tokens * r.top_k,
                want: self.tokens * self.shape.top_k,
            });
        }
        let slots = self.dims.slots();
        check_len("route ids", &r.idx, slots)?;
        check_len("route weights", &r.weights, slots)
    }

    /// The route error of the slot the device check flagged (the oracle's error, found by
    /// validating that token's row on the host).
    fn route_error(
        &self,
        ctx: &GpuContext,
        routes: &DeviceRoutes,
        slot: u64,
        given: bool,
    ) -> Result<LayerGpuError, LayerGpuError> {
        let k = self.shape.top_k;
        let t = usize::try_from(slot).unwrap_or(usize::MAX) / k;
        if t >= self.tokens {
            return Ok(LayerGpuError::Unsupported(format!(
                "the route check returned slot {slot}, past the table"
            )));
        }
        let s = ctx.stream();
        let idx = s
            .clone_dtoh(&routes.idx.slice(t * k..(t + 1) * k))
            .map_err(KernelError::driver("reading a rejected route"))?;
        let weights = if given {
            s.clone_dtoh(&routes.weights.slice(t * k..(t + 1) * k))
                .map_err(KernelError::driver("reading a rejected route"))?
        } else {
            vec![1.0; k]
        };
        ctx.synchronize()?;
        let one = Routes {
            tokens: 1,
            top_k: k,
            idx,
            weights,
        };
        Ok(match validate(&one, &RouteRules::layer(&self.shape), 0) {
            Err(e) => LayerGpuError::Route(at_token(e, t)),
            Ok(()) => LayerGpuError::Unsupported(format!(
                "the route check rejected slot {slot}, which validates on the host"
            )),
        })
    }

    /// One run on explicit inputs (any shape, e.g. where the fast layer cannot run): the
    /// forward pass, and the train step when `inputs.dy` is given. Poisons the outputs first,
    /// checks the routes (a rejected table is [`LayerGpuError::Route`], outputs left NaN),
    /// then queues every kernel and waits for the device. `ctx` must be the context the
    /// reference and the inputs were allocated on (for [`ReferenceLayer::run_like`]: the
    /// layer's).
    pub fn run(
        &mut self,
        ctx: &GpuContext,
        inputs: &ReferenceInputs<'_>,
    ) -> Result<(), LayerGpuError> {
        let inp = *inputs;
        if inp.dy.is_some() && self.train.is_none() {
            return Err(LayerGpuError::Unsupported(
                "this reference was built for the forward pass only".into(),
            ));
        }
        self.check_inputs(&inp)?;
        self.trained = false;
        self.poison_outputs(ctx)?;
        let d = self.dims;
        let p = inp.params;
        let routes = inp.routes;
        let given = inp.routing == LayerRouting::Given;
        let s = d.shared();

        ops::check_routes(ctx, &d, routes, given, &mut self.first)?;
        let first = download(ctx, &self.first)?.first().copied().unwrap_or(0);
        if first != u64::MAX {
            return Err(self.route_error(ctx, routes, first, given)?);
        }

        // Router (recomputed) or given weights. The routes' ids are the expert choice; with
        // the router they are checked independently against the reference's own logits.
        self.topk_stats = None;
        if !given {
            ops::topk_check(ctx, &d, inp.x, &p.wr, routes, &mut self.topk)?;
            ops::logits(ctx, &d, inp.x, &p.wr, &mut self.probs)?;
            ops::softmax(ctx, &d, &mut self.probs)?;
        }
        ops::weights(
            ctx,
            &d,
            (!given).then_some(&self.probs),
            routes,
            self.shape.renormalize,
            &mut self.weights,
        )?;

        // Forward: up-projections (keeping a, b for the train step), then the output.
        let (ab, sab) = match self.train.as_mut().filter(|_| inp.dy.is_some()) {
            Some(t) => (Some((&mut t.a, &mut t.b)), Some((&mut t.sa, &mut t.sb))),
            None => (None, None),
        };
        ops::expert_up(ctx, &d, inp.x, routes, &p.w1, &p.w3, ab, &mut self.h)?;
        if s > 0 {
            ops::shared_up(ctx, &d, inp.x, &p.s1, &p.s3, sab, &mut self.sh)?;
        }
        ops::combine(
            ctx,
            &d,
            routes,
            &self.weights,
            &self.h,
            &p.w2,
            Some((&self.sh, &p.s2)),
            &mut self.out,
        )?;

        if let (Some(dy), Some(t)) = (inp.dy, self.train.as_mut()) {
            let (hd, w, e) = (d.hidden(), d.width(), d.experts());
            let tw = &mut t.t;
            ops::transpose(ctx, &p.w1, e, hd, w, &mut tw.w1t)?;
            ops::transpose(ctx, &p.w3, e, hd, w, &mut tw.w3t)?;
            ops::transpose(ctx, &p.w2, e, w, hd, &mut tw.w2t)?;
            ops::transpose(ctx, &p.s1, 1, hd, s, &mut tw.s1t)?;
            ops::transpose(ctx, &p.s3, 1, hd, s, &mut tw.s3t)?;
            ops::transpose(ctx, &p.s2, 1, s, hd, &mut tw.s2t)?;
            ops::transpose(ctx, &p.wr, 1, hd, e, &mut tw.wrt)?;
            ops::expert_rows(
                ctx,
                &d,
                routes,
                &mut t.counts,
                &mut t.offsets,
                &mut t.rows,
                &mut t.toks,
            )?;
            let rows = Rows {
                offsets: &t.offsets,
                rows: &t.rows,
                toks: &t.toks,
            };
            // Routed experts: dy·W2ᵀ, the router's g and dlogits, dW2, then (a, b) → (da, db)
            // and dW1, dW3.
            ops::expert_dh(ctx, &d, dy, routes, &tw.w2t, &mut t.dhu)?;
            if !given {
                ops::router_g(ctx, &d, routes, &self.h, &t.dhu, &mut t.g)?;
                ops::router_dlogits(
                    ctx,
                    &d,
                    routes,
                    &self.weights,
                    &self.probs,
                    &t.g,
                    self.shape.renormalize,
                    &mut t.dl,
                )?;
            }
            let g = &mut t.grads;
            ops::grad_w2(ctx, &d, rows, &self.h, &self.weights, dy, &mut g.w2)?;
            ops::expert_dab(ctx, &d, routes, &self.weights, &t.dhu, &mut t.a, &mut t.b)?;
            ops::grad_w13(ctx, &d, rows, inp.x, &t.a, &t.b, &mut g.w1, &mut g.w3)?;
            // The shared expert: dS2, then (a, b) → (da, db) and dS1, dS3.
            if s > 0 {
                ops::grad_s2(ctx, &d, &self.sh, dy, &mut g.s2)?;
                ops::shared_dab(ctx, &d, dy, &tw.s2t, &mut t.sa, &mut t.sb)?;
                ops::grad_s13(ctx, &d, inp.x, &t.sa, &t.sb, &mut g.s1, &mut g.s3)?;
            }
            // The router: dWr (zero for given weights), then dx.
            ops::grad_wr(ctx, &d, inp.x, (!given).then_some(&t.dl), &mut g.wr)?;
            ops::dx(
                ctx,
                &d,
                DxExperts {
                    routes,
                    da: &t.a,
                    db: &t.b,
                    w1t: &tw.w1t,
                    w3t: &tw.w3t,
                },
                Some(DxShared {
                    da: &t.sa,
                    db: &t.sb,
                    s1t: &tw.s1t,
                    s3t: &tw.s3t,
                }),
                (!given).then_some(DxRouter {
                    dl: &t.dl,
                    wrt: &tw.wrt,
                }),
                &mut t.dx,
            )?;
        }
        ctx.synchronize()?;
        ctx.check()?;
        if !given {
            self.topk_stats = Some(TopkStats::from_raw(&download(ctx, &self.topk)?));
        }
        self.trained = inp.dy.is_some();
        Ok(())
    }
}

/// The statistics of the error metric of one pair of tensors, computed on the device
/// ([`err_stats`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ErrStats {
    /// `max |a − b|` over the elements where `a` is finite (NaN differences ignored).
    pub max_diff: f64,
    /// `max |b|` (NaN ignored).
    pub max_ref: f64,
    /// Some element of `a` (the tensor under test) is NaN or infinite.
    pub got_non_finite: bool,
    /// Some element of `b` (the reference) is NaN or infinite.
    pub ref_non_finite: bool,
}

impl ErrStats {
    /// The metric of [`crate::accuracy::max_rel_err`] from these statistics: `+∞` when `a` holds a
    /// non-finite value, 0 when every difference is 0, `+∞` for a nonzero difference against an
    /// all-zero reference, else `max_diff / max_ref`. Equal to `max_rel_err` on the same data,
    /// bit for bit.
    pub fn metric(&self) -> f64 {
        if self.got_non_finite {
            f64::INFINITY
        } else if self.max_diff == 0.0 {
            0.0
        } else if self.max_ref == 0.0 {
            f64::INFINITY
        } else {
            self.max_diff / self.max_ref
        }
    }
}

/// The error statistics of every pair `(a, b)` (each pair of equal length), computed on the
/// device; only four numbers per pair come back. Waits for the device.
pub fn err_stats(
    ctx: &GpuContext,
    pairs: &[(&CudaSlice<bf16>, &CudaSlice<bf16>)],
) -> Result<Vec<ErrStats>, LayerGpuError> {
    for (a, b) in pairs {
        if a.len() != b.len() {
            return Err(LayerGpuError::Size {
                what: "compared tensor",
                got: a.len(),
                want: b.len(),
            });
        }
    }
    if pairs.is_empty() {
        return Ok(Vec::new());
    }
    let mut stats = zeros::<u64>(ctx, pairs.len() * 4)?;
    for (i, (a, b)) in pairs.iter().enumerate() {
        ops::err_stats(ctx, a, b, &mut stats, i)?;
    }
    let host = download(ctx, &stats)?;
    Ok(host
        .chunks_exact(4)
        .map(|s| ErrStats {
            max_diff: f64::from_bits(s[0]),
            max_ref: f64::from_bits(s[1]),
            got_non_finite: s[2] != 0,
            ref_non_finite: s[3] != 0,
        })
        .collect())
}

/// [`crate::accuracy::max_rel_err`]`(a, b)` computed on the device (the same value, bit for bit,
/// including its NaN and zero conventions). Waits for the device.
pub fn device_max_rel_err(
    ctx: &GpuContext,
    a: &CudaSlice<bf16>,
    b: &CudaSlice<bf16>,
) -> Result<f64, LayerGpuError> {
    Ok(err_stats(ctx, &[(a, b)])?[0].metric())
}

/// Errors (the metric of [`crate::accuracy::max_rel_err`]: `max|a−b| / max|b|`, NaN → +∞) of the
/// fast layer against the reference.
#[derive(Debug, Clone, Copy, serde::Serialize)]
pub struct LayerErrors {
    /// The output.
    pub out: f64,
    /// dx (train steps).
    pub gx: Option<f64>,
    /// The largest error of the seven weight gradients (train steps).
    pub gw: Option<f64>,
}

/// The per-tensor errors behind [`LayerErrors`].
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct TensorErrors {
    /// The output.
    pub out: f64,
    /// dx (train steps).
    pub dx: Option<f64>,
    /// Each parameter gradient, in `PARAM_NAMES` order (train steps).
    pub grads: Option<[f64; 7]>,
}

impl TensorErrors {
    /// The summary: `gw` is the largest gradient error (NaN if any is NaN).
    pub fn summary(&self) -> LayerErrors {
        LayerErrors {
            out: self.out,
            gx: self.dx,
            gw: self.grads.map(|g| {
                g.into_iter()
                    .fold(0.0, |m: f64, e| if e.is_nan() || e > m { e } else { m })
            }),
        }
    }
}

/// [`compare`] per tensor. The gradients are compared when the layer is a train layer and the
/// reference's last run was a train step; the layer's last step must have been one too (the
/// layer keeps no record of it).
pub fn compare_tensors(
    ctx: &GpuContext,
    layer: &MoeLayer,
    reference: &ReferenceLayer,
) -> Result<TensorErrors, LayerGpuError> {
    if layer.shape() != reference.shape() {
        return Err(LayerGpuError::Unsupported(format!(
            "a layer of shape {:?} against a reference of shape {:?}",
            layer.shape(),
            reference.shape()
        )));
    }
    if layer.tokens() != reference.tokens() {
        return Err(LayerGpuError::Size {
            what: "layer tokens",
            got: layer.tokens(),
            want: reference.tokens(),
        });
    }
    let mut names: Vec<&'static str> = vec!["out"];
    let mut pairs = vec![(layer.out(), reference.out())];
    let grads = match (layer.grads(), reference.dx(), reference.grads()) {
        (Some(lg), Some(rdx), Some(rg)) => {
            names.push("dx");
            pairs.push((layer.dx(), rdx));
            for ((name, a), b) in PARAM_NAMES.iter().zip(lg.tensors()).zip(rg.tensors()) {
                names.push(name);
                pairs.push((a, b));
            }
            true
        }
        _ => false,
    };
    let stats = err_stats(ctx, &pairs)?;
    if let Some((name, _)) = names.iter().zip(&stats).find(|(_, s)| s.ref_non_finite) {
        return Err(LayerGpuError::Unsupported(format!(
            "the reference's `{name}` holds NaN or infinity: it was not run, or its run failed"
        )));
    }
    let m: Vec<f64> = stats.iter().map(ErrStats::metric).collect();
    Ok(TensorErrors {
        out: m[0],
        dx: grads.then(|| m[1]),
        grads: grads.then(|| [m[2], m[3], m[4], m[5], m[6], m[7], m[8]]),
    })
}

/// Errors (the metric of [`crate::accuracy::max_rel_err`]: `max|a−b| / max|b|`, NaN → +∞) of the
/// fast layer against the reference, computed on the device (four numbers per tensor come
/// back, so 1M-token tensors stay on the GPU). Equal to `max_rel_err` of the downloaded
/// tensors, except that a reference holding NaN or infinity is an error (it was not run, or
/// its run failed) where `max_rel_err` would ignore NaN in its reference. `gx` and `gw` are
/// given when the layer is a train layer and the reference's last run was a train step.
pub fn compare(
    ctx: &GpuContext,
    layer: &MoeLayer,
    reference: &ReferenceLayer,
) -> Result<LayerErrors, LayerGpuError> {
    Ok(compare_tensors(ctx, layer, reference)?.summary())
}

/// The reference's own device copies of the host inputs (parameters, x, dy): a reference
/// run from these shares no buffer with the layer under test, so a layer that corrupted its
/// inputs (or uploaded them wrongly) cannot hide it by corrupting the reference's too.
#[derive(Debug)]
pub struct HostInputs {
    params: DeviceParams,
    x: CudaSlice<bf16>,
    dy: Option<CudaSlice<bf16>>,
}

impl HostInputs {
    /// Uploads `params`, `x` (T × H) and, for a train step, `dy` (T × H). Waits for nothing.
    pub fn upload(
        ctx: &GpuContext,
        params: &LayerParams,
        x: &[bf16],
        dy: Option<&[bf16]>,
    ) -> Result<Self, LayerGpuError> {
        let up = |v: &[bf16]| -> Result<CudaSlice<bf16>, LayerGpuError> {
            if v.is_empty() {
                return Ok(zeros(ctx, 0)?);
            }
            Ok(ctx
                .stream()
                .clone_htod(v)
                .map_err(KernelError::driver("uploading a reference input"))?)
        };
        Ok(HostInputs {
            params: upload_params(ctx, params)?,
            x: up(x)?,
            dy: dy.map(up).transpose()?,
        })
    }

    /// The inputs of a [`ReferenceLayer::run`] with `routes` (e.g. the layer's own choice,
    /// which the reference's top-k check judges independently) and `routing`.
    pub fn inputs<'a>(
        &'a self,
        routes: &'a DeviceRoutes,
        routing: LayerRouting,
    ) -> ReferenceInputs<'a> {
        ReferenceInputs {
            params: &self.params,
            x: &self.x,
            dy: self.dy.as_ref(),
            routes,
            routing,
        }
    }
}

/// One tensor of [`compare_grouped`]: its name, its worst group and its tolerance.
#[derive(Debug, Clone, PartialEq)]
pub struct GroupCheck {
    /// `out`, `dx`, `dwr`, `dw1`, ...
    pub name: &'static str,
    /// The worst group (token, expert or row; see [`crate::accuracy`]).
    pub worst: crate::accuracy::GroupErr,
    /// The tolerance of the tensor's path.
    pub tol: f64,
    /// What a group is (`token`, `expert`, `row`).
    pub unit: &'static str,
}

impl GroupCheck {
    /// Whether the worst group is within tolerance.
    pub fn ok(&self) -> bool {
        self.worst.within(self.tol)
    }
}

/// The fast layer against the reference per group (out and dx per token, weight gradients
/// per expert: [`crate::accuracy::layer_grouping`]), on downloaded tensors. The gradients are
/// compared under the same conditions as [`compare_tensors`]. A reference holding NaN or
/// infinity is an error (it was not run, or its run failed).
pub fn compare_grouped(
    ctx: &GpuContext,
    layer: &MoeLayer,
    reference: &ReferenceLayer,
) -> Result<Vec<GroupCheck>, LayerGpuError> {
    if layer.shape() != reference.shape() || layer.tokens() != reference.tokens() {
        return Err(LayerGpuError::Unsupported(format!(
            "a layer of shape {:?} and {} tokens against a reference of shape {:?} and {}",
            layer.shape(),
            layer.tokens(),
            reference.shape(),
            reference.tokens()
        )));
    }
    let mut pairs: Vec<(&'static str, &CudaSlice<bf16>, &CudaSlice<bf16>)> =
        vec![("out", layer.out(), reference.out())];
    if let (Some(lg), Some(rdx), Some(rg)) = (layer.grads(), reference.dx(), reference.grads()) {
        pairs.push(("dx", layer.dx(), rdx));
        const NAMES: [&str; 7] = ["dwr", "dw1", "dw3", "dw2", "ds1", "ds3", "ds2"];
        for ((name, a), b) in NAMES.into_iter().zip(lg.tensors()).zip(rg.tensors()) {
            pairs.push((name, a, b));
        }
    }
    let sh = *layer.shape();
    let mut out = Vec::with_capacity(pairs.len());
    for (name, a, b) in pairs {
        let (a, b) = (download(ctx, a)?, download(ctx, b)?);
        if b.iter().any(|v| !v.is_finite()) {
            return Err(LayerGpuError::Unsupported(format!(
                "the reference's `{name}` holds NaN or infinity: it was not run, or its run failed"
            )));
        }
        let (grouping, tol) =
            crate::accuracy::layer_grouping(name, &sh).expect("every layer tensor has a grouping");
        out.push(GroupCheck {
            name,
            worst: grouping.worst(&a, &b),
            tol,
            unit: grouping.unit(name),
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metric_follows_max_rel_err_conventions() {
        let s = |d: f64, r: f64, a: bool, b: bool| ErrStats {
            max_diff: d,
            max_ref: r,
            got_non_finite: a,
            ref_non_finite: b,
        };
        assert_eq!(s(0.0, 0.0, false, false).metric(), 0.0);
        assert_eq!(s(1.0, 0.0, false, false).metric(), f64::INFINITY);
        assert_eq!(s(1.0, 4.0, false, false).metric(), 0.25);
        assert_eq!(s(0.0, 4.0, true, false).metric(), f64::INFINITY);
        let v = |x: &[f32]| x.iter().map(|&f| bf16::from_f32(f)).collect::<Vec<_>>();
        assert_eq!(
            crate::accuracy::max_rel_err(&v(&[1.5, 4.0]), &v(&[1.0, 4.0])),
            s(0.5, 4.0, false, false).metric()
        );
    }

    #[test]
    fn summary_takes_the_largest_gradient_error() {
        let t = TensorErrors {
            out: 0.1,
            dx: Some(0.2),
            grads: Some([0.0, 0.3, 0.1, 0.0, 0.0, 0.0, 0.05]),
        };
        let s = t.summary();
        assert_eq!((s.out, s.gx, s.gw), (0.1, Some(0.2), Some(0.3)));
        let n = TensorErrors {
            grads: Some([0.0, f64::NAN, 0.1, 0.0, 0.0, 0.0, 0.0]),
            ..t
        };
        assert!(n.summary().gw.unwrap().is_nan());
        let f = TensorErrors {
            dx: None,
            grads: None,
            ..t
        };
        assert_eq!(f.summary().gw, None);
    }

    #[test]
    fn route_errors_are_reindexed_to_their_token() {
        let e = RouteError::Wide {
            rank: 0,
            token: 0,
            slot: 1,
            value: 9,
            experts: 8,
        };
        assert_eq!(
            at_token(e, 17),
            RouteError::Wide {
                rank: 0,
                token: 17,
                slot: 1,
                value: 9,
                experts: 8
            }
        );
    }
}
