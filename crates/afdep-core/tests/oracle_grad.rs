//! The layer oracle's train step against central finite differences, everything in f64, and the
//! f32 path against the f64 path.
//!
//! # Finite differences
//! The loss is `L = Σ(out ⊙ dy)` of the f64 forward. For each tensor element θ,
//! `fd = (L(θ + ε) − L(θ − ε)) / 2ε` with ε = 1e-5. Its error has two parts:
//! - truncation, `ε²/6 · |∂³L/∂θ³|`: with O(1) inputs and O(1/√fan-in) parameters (router ×4)
//!   the third derivatives are O(1–10), so ≲ 2e-10;
//! - rounding: each evaluation of L (a sum of O(100) terms of O(1)) is off by a few ulps of
//!   O(1), ≲ 1e-15, divided by 2ε: ≲ 1e-10.
//!
//! So |fd − an| ≲ 3e-10; the test asks |fd − an| ≤ 1e-8 · (1 + |an|), a margin of ~30 over the
//! estimate and of ~1000 over what is seen (the worst ratios are printed, ~5e-12). ε = 1e-5
//! balances the two parts (ε = 1e-6 would trade truncation for 10× more rounding). A wrong
//! gradient term moves elements by far more than 1e-8: the controls below require, per tensor,
//! entries above 1e-2 and a router share of dx above 1e-2, and that negating a tensor fails.
//!
//! Top-K selection is not differentiated: every perturbed forward must select the same experts
//! as the unperturbed one, or the problem is re-drawn with the next seed.

use afdep_core::config::LayerShape;
use afdep_core::oracle::LayerParams;
use afdep_core::oracle::layer::{self, GradsT, ParamsT, Routing};
use afdep_core::oracle::params::random_tokens;
use afdep_core::route::{MASKED, Routes};
use afdep_core::tensor::uniform_bf16;

const EPS: f64 = 1e-5;
const TOL: f64 = 1e-8;
const NAMES: [&str; 8] = ["x", "wr", "w1", "w3", "w2", "s1", "s3", "s2"];

fn shape(s: usize, renormalize: bool) -> LayerShape {
    LayerShape {
        d_model: 6,
        width: 3,
        experts: 5,
        top_k: 2,
        shared: s,
        renormalize,
    }
}

struct Problem<T> {
    p: ParamsT<T>,
    x: Vec<T>,
    dy: Vec<T>,
    tokens: usize,
}

fn problem<T: afdep_core::oracle::gemm::Real>(
    shape: LayerShape,
    tokens: usize,
    seed: u64,
) -> Problem<T> {
    let lp = LayerParams::random(shape, seed);
    let cvt = |v: &[half::bf16]| {
        v.iter()
            .map(|b| T::from_f32(b.to_f32()))
            .collect::<Vec<T>>()
    };
    let mut p = ParamsT::<T>::from_bf16(&lp);
    // a sharper router (logits of O(1)) so that weights and their gradients are not all alike
    for v in p.wr.iter_mut() {
        *v = *v * T::from_f32(4.0);
    }
    Problem {
        x: cvt(&random_tokens(tokens, shape.d_model, seed)),
        dy: cvt(&uniform_bf16(tokens * shape.d_model, 1.0, seed, 77)),
        p,
        tokens,
    }
}

fn analytic(g: &GradsT<f64>) -> [&Vec<f64>; 8] {
    [
        &g.dx, &g.dwr, &g.dw1, &g.dw3, &g.dw2, &g.ds1, &g.ds3, &g.ds2,
    ]
}

/// Loss and selection of the f64 forward.
fn loss(p: &ParamsT<f64>, x: &[f64], pr: &Problem<f64>, routing: Routing<'_>) -> (f64, Vec<i32>) {
    let f = layer::forward_t(p, x, pr.tokens, routing).unwrap();
    (f.out.iter().zip(&pr.dy).map(|(a, b)| a * b).sum(), f.idx)
}

/// Finite differences of every element of every tensor; `None` if a perturbation changes the
/// selection.
fn finite_differences(pr: &Problem<f64>, routing: Routing<'_>) -> Option<[Vec<f64>; 8]> {
    let (_, base) = loss(&pr.p, &pr.x, pr, routing);
    let mut out: [Vec<f64>; 8] = Default::default();
    for (ti, fd) in out.iter_mut().enumerate() {
        let n = if ti == 0 {
            pr.x.len()
        } else {
            pr.p.tensors()[ti - 1].len()
        };
        for i in 0..n {
            let at = |delta: f64| {
                let (mut p, mut x) = (pr.p.clone(), pr.x.clone());
                if ti == 0 {
                    x[i] += delta;
                } else {
                    p.tensors_mut()[ti - 1][i] += delta;
                }
                loss(&p, &x, pr, routing)
            };
            let ((lp, sp), (lm, sm)) = (at(EPS), at(-EPS));
            if sp != base || sm != base {
                return None;
            }
            fd.push((lp - lm) / (2.0 * EPS));
        }
    }
    Some(out)
}

/// Elements of `an` outside the FD tolerance, and the largest |fd − an| / (1 + |an|).
fn mismatches(fd: &[f64], an: &[f64]) -> (usize, f64) {
    assert_eq!(fd.len(), an.len());
    let mut bad = 0;
    let mut worst = 0f64;
    for (f, a) in fd.iter().zip(an) {
        let r = (f - a).abs() / (1.0 + a.abs());
        worst = worst.max(r);
        if r.is_nan() || r > TOL {
            bad += 1;
        }
    }
    (bad, worst)
}

/// Checks analytic against FD for every element; returns the problem's seed.
fn check(shape: LayerShape, tokens: usize, routes: Option<&dyn Fn(u64) -> Routes>) -> u64 {
    for seed in 1..=20u64 {
        let pr = problem::<f64>(shape, tokens, seed);
        let given = routes.map(|f| f(seed));
        let routing = match &given {
            Some(r) => Routing::Given(r),
            None => Routing::Router,
        };
        let Some(fd) = finite_differences(&pr, routing) else {
            eprintln!(
                "{shape:?} seed {seed}: a perturbation flips the top-k selection, re-drawing"
            );
            continue;
        };
        let (_, g) = layer::train_step_t(&pr.p, &pr.x, pr.tokens, &pr.dy, routing).unwrap();
        let an = analytic(&g);
        for ((name, fd), an) in NAMES.iter().zip(&fd).zip(an) {
            let (bad, worst) = mismatches(fd, an);
            eprintln!(
                "{shape:?} seed {seed} {name}: {} elements, worst |fd-an|/(1+|an|) = {worst:.2e}",
                an.len()
            );
            assert_eq!(
                bad,
                0,
                "{name}: {bad} of {} elements disagree with finite differences\nfd {fd:?}\nan {an:?}",
                an.len()
            );
            if an.is_empty() {
                continue;
            }
            // controls: the tensor's gradient is large enough that the tolerance means something,
            // and a sign flip of the whole tensor would be caught
            let big = an.iter().fold(0f64, |m, v| m.max(v.abs()));
            let router_free = given.is_some() && *name == "wr";
            if !router_free {
                assert!(
                    big > 1e-2,
                    "{name}: gradient too small ({big:e}) for the check to bite"
                );
                let flipped: Vec<f64> = an.iter().map(|v| -v).collect();
                assert!(
                    mismatches(fd, &flipped).0 > 0,
                    "{name}: a sign flip would pass"
                );
            } else {
                assert!(big == 0.0, "given routes: the router gets no gradient");
            }
        }
        if given.is_none() {
            // the router's share of dx (the train step with the same weights held constant has
            // none): large enough that a sign error in the router backward cannot pass
            let f = layer::forward_t(&pr.p, &pr.x, pr.tokens, Routing::Router).unwrap();
            let r = f.routes();
            let (_, g0) =
                layer::train_step_t(&pr.p, &pr.x, pr.tokens, &pr.dy, Routing::Given(&r)).unwrap();
            // the f32 weights of `r` differ from the f64 ones by ~1e-8: negligible here
            let router_dx =
                g.dx.iter()
                    .zip(&g0.dx)
                    .fold(0f64, |m, (a, b)| m.max((a - b).abs()));
            assert!(
                router_dx > 1e-2,
                "router share of dx too small: {router_dx:e}"
            );
        }
        return seed;
    }
    panic!("{shape:?}: no seed in 1..=20 without a selection flip");
}

#[test]
fn gradients_match_finite_differences() {
    for s in [4, 0] {
        for renormalize in [true, false] {
            check(shape(s, renormalize), 5, None);
        }
    }
}

#[test]
fn gradients_with_given_routes_and_masked_slots() {
    let routes = |seed: u64| {
        // token t: slot 0 on expert (t + seed) % 5, slot 1 masked for even t, else (t + 2) % 5
        let mut idx = Vec::new();
        let mut weights = Vec::new();
        for t in 0..5u64 {
            let e0 = ((t + seed) % 5) as i32;
            let e1 = if t % 2 == 0 {
                MASKED
            } else {
                ((t + seed + 2) % 5) as i32
            };
            idx.extend([e0, e1]);
            weights.extend([0.75, if e1 == MASKED { f32::NAN } else { -0.5 }]);
        }
        Routes::new(5, 2, idx, weights).unwrap()
    };
    check(shape(4, true), 5, Some(&routes));
}

/// The f32 path against the f64 path on the same (bf16-exact) inputs.
///
/// Tolerance: every result is reached through a chain of dot products and elementwise
/// functions. In f32 a dot product of length n has error ≤ γ_n·Σ|terms| with γ_n ≈ n·u,
/// u = 2^-24 (Higham, Thm 3.1); exp, division and silu add ≤ 4u relative each. Errors of
/// successive stages add to first order, so a result's error is ≤ (Σ_stages n_s + c)·u·M,
/// where M is the same computation on absolute values. The longest chain, dx through the
/// router, runs x·W1/W3 (H), h·W2 (W), <dy, y> (H), the renormalisation (2K), softmax and its
/// backward (3E), dlogits·Wrᵀ (E) plus the routed and shared dx (W, S) and the sums over
/// tokens of the weight gradients (T): n_sum = 2H + 2W + 4E + 2K + S + T, c ≈ 40 elementwise
/// roundings. For random O(1) data, M ≤ κ·max|result| over the tensor with κ ≲ 16 (we measure
/// the error normwise, relative to the tensor's largest element, which absorbs cancellation in
/// single elements). Tolerance: 16·(n_sum + 40)·u per tensor.
#[test]
fn f32_path_agrees_with_f64_path() {
    for (sh, tokens) in [
        (
            LayerShape {
                d_model: 32,
                width: 16,
                experts: 8,
                top_k: 3,
                shared: 24,
                renormalize: true,
            },
            64,
        ),
        (
            LayerShape {
                d_model: 24,
                width: 8,
                experts: 6,
                top_k: 2,
                shared: 0,
                renormalize: false,
            },
            50,
        ),
    ] {
        let (h, w, e, k, s) = (sh.d_model, sh.width, sh.experts, sh.top_k, sh.shared);
        let n_sum = 2 * h + 2 * w + 4 * e + 2 * k + s + tokens;
        let tol = 16.0 * (n_sum + 40) as f64 * 2f64.powi(-24);
        let mut done = false;
        for seed in 1..=10 {
            let p64 = problem::<f64>(sh, tokens, seed);
            let p32 = problem::<f32>(sh, tokens, seed);
            let (f64r, g64) =
                layer::train_step_t(&p64.p, &p64.x, tokens, &p64.dy, Routing::Router).unwrap();
            let (f32r, g32) =
                layer::train_step_t(&p32.p, &p32.x, tokens, &p32.dy, Routing::Router).unwrap();
            if f64r.idx != f32r.idx {
                eprintln!("seed {seed}: f32 and f64 select differently (a near tie), re-drawing");
                continue;
            }
            let a32 = [
                &f32r.out, &g32.dx, &g32.dwr, &g32.dw1, &g32.dw3, &g32.dw2, &g32.ds1, &g32.ds3,
                &g32.ds2,
            ];
            let a64 = [
                &f64r.out, &g64.dx, &g64.dwr, &g64.dw1, &g64.dw3, &g64.dw2, &g64.ds1, &g64.ds3,
                &g64.ds2,
            ];
            let names = ["out", "dx", "dwr", "dw1", "dw3", "dw2", "ds1", "ds3", "ds2"];
            for ((name, a), b) in names.iter().zip(a32).zip(a64) {
                assert_eq!(a.len(), b.len());
                let scale = b.iter().fold(0f64, |m, v| m.max(v.abs()));
                let err = a
                    .iter()
                    .zip(b.iter())
                    .fold(0f64, |m, (&x, &y)| m.max((x as f64 - y).abs()));
                eprintln!(
                    "{sh:?} {name}: max|f32-f64| = {err:.2e}, scale {scale:.2e}, tol {:.2e}",
                    tol * scale
                );
                assert!(
                    err <= tol * scale,
                    "{name}: f32 and f64 differ by {err:e} (scale {scale:e}, tol {tol:e})"
                );
                if !b.is_empty() {
                    assert!(scale > 0.0, "{name} is all zero");
                }
            }
            done = true;
            break;
        }
        assert!(done, "no seed without a selection difference");
    }
}
