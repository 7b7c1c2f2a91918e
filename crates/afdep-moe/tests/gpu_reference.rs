//! The simple GPU reference path (`afdep_moe::reference`) against the CPU oracle, and the fast
//! layer against the reference.
//!
//! - The reference against `afdep_core::oracle::layer` (out, dx and all seven gradients), with
//!   router semantics and with given routes (a hot expert, experts with no token, masked
//!   slots), at small odd shapes: T = 1, 33, 1000; E = 8, 13, 64; K = 1, 2, 8; shared on and
//!   off; H, W, S not multiples of 32 (H = 40, W = 24, S = 56: shapes the fast layer cannot
//!   take, so the routes are the oracle's); and 0 tokens.
//! - The device metric ([`reference::device_max_rel_err`], [`reference::compare_tensors`])
//!   against `accuracy::max_rel_err` on the same data, bit for bit (NaN, infinity and zero
//!   cases included).
//! - The fast layer against the reference at the record shape (docs/design.md, "The reference
//!   record") at 16,384 tokens, every dispatch strategy, within `accuracy::{OUT_TOL, DX_TOL,
//!   GRAD_TOL}`.
//! - The reference's independent check of the router's top-k choice: the oracle's choice
//!   passes, a swapped or masked slot is caught (and the fast layer's choice passes at the
//!   record shape).
//! - Typed errors for shapes that do not match, rejected routes, and a reference that was not
//!   run.
//!
//! The reference poisons (NaN-fills) its outputs before every run, so an element a run fails
//! to write is NaN and fails every comparison (the metric is +∞ for NaN in the tensor under
//! test).
//!
//! # Tolerance of the reference against the oracle
//! Both keep every intermediate in f32 and cast each output to bf16 once; they differ only in
//! the order of f32 sums (and `expf` against Rust's `exp`, a few f32 ulps). Let `a`, `b` be an
//! element's f32 values on the two sides and `A`, `B` their bf16 casts. Where `|a − b|` is far
//! below a bf16 ulp, `A` and `B` are equal or neighbours, so `|A − B| ≤ ulp(|b|) ≤ ulp(M)`
//! with `M = max |B|`: the two casts together contribute at most one bf16 ulp of the largest
//! element, `ulp(M) / M`, which is between 2^-8 and 2^-7 of `M` depending on where `M` lies in
//! its binade (each cast alone is within half an ulp: 2^-9 .. 2^-8 relative). f32
//! reassociation adds about `√n · 2^-24` relative for a sum of `n` random-sign terms (n ≤ 4096
//! here), allowed for with a margin of 2^-12. So the test's tolerance for a tensor is
//! `ulp(M) / M + 2^-12` (≈ 0.004 to 0.008; 0 for an all-zero oracle tensor, which the
//! reference must reproduce exactly).
//!
//! Without a usable driver every test prints `SKIP: <reason>` and passes, unless
//! `AFDEP_REQUIRE_GPU=1` (the GPU bundle sets it), which turns the skip into a failure.

mod common;

use afdep_core::oracle::layer::{forward, forward_with_routes, train_step, train_step_with_routes};
use afdep_core::oracle::params::{PARAM_NAMES, random_tokens};
use afdep_core::oracle::{LayerGrads, LayerParams};
use afdep_core::route::{MASKED, RouteRules, Routes, validate};
use afdep_core::{LayerShape, RouteError, bf16};
use afdep_kernels::cudarc::driver::{CudaSlice, DeviceRepr, ValidAsZeroBits};
use afdep_kernels::ops::{download, zeros};
use afdep_kernels::{DeviceRoutes, GpuContext};
use afdep_moe::accuracy::{DX_TOL, GRAD_TOL, OUT_TOL, max_rel_err};
use afdep_moe::reference::{
    self, ReferenceInputs, ReferenceLayer, compare, compare_tensors, device_max_rel_err,
    upload_params,
};
use afdep_moe::{DeviceParams, Dispatch, LayerGpuError, LayerRouting, MoeLayer};
use common::{gpu, hot_routes, layer_sweep, poisoned_train_step, shape, train_layer};
use rand::{Rng, SeedableRng};

/// The tolerance of the reference against the oracle for a tensor (see the module): one bf16
/// ulp of its largest element, relative to it, plus 2^-12 for f32 reassociation.
fn ref_tol(oracle: &[bf16]) -> f64 {
    let m = oracle
        .iter()
        .map(|v| f64::from(v.to_f32().abs()))
        .fold(0.0, f64::max);
    if m == 0.0 || !m.is_finite() {
        return 0.0;
    }
    let ulp = 2f64.powi(m.log2().floor() as i32 - 7);
    ulp / m + 2f64.powi(-12)
}

fn up<T: DeviceRepr + ValidAsZeroBits + Copy>(ctx: &GpuContext, v: &[T]) -> CudaSlice<T> {
    if v.is_empty() {
        zeros(ctx, 0).unwrap()
    } else {
        ctx.stream().clone_htod(v).unwrap()
    }
}

/// Host inputs of one reference run, uploaded.
struct Inputs {
    params: DeviceParams,
    x: CudaSlice<bf16>,
    dy: CudaSlice<bf16>,
    routes: DeviceRoutes,
}

impl Inputs {
    fn new(ctx: &GpuContext, p: &LayerParams, x: &[bf16], dy: &[bf16], r: &Routes) -> Self {
        Inputs {
            params: upload_params(ctx, p).unwrap(),
            x: up(ctx, x),
            dy: up(ctx, dy),
            routes: DeviceRoutes::upload(ctx, r).unwrap(),
        }
    }

    fn get(&self, train: bool, routing: LayerRouting) -> ReferenceInputs<'_> {
        ReferenceInputs {
            params: &self.params,
            x: &self.x,
            dy: train.then_some(&self.dy),
            routes: &self.routes,
            routing,
        }
    }
}

/// The reference's results, downloaded.
struct Got {
    out: Vec<bf16>,
    dx: Option<Vec<bf16>>,
    grads: Option<[Vec<bf16>; 7]>,
}

fn read_ref(ctx: &GpuContext, r: &ReferenceLayer) -> Got {
    Got {
        out: download(ctx, r.out()).unwrap(),
        dx: r.dx().map(|d| download(ctx, d).unwrap()),
        grads: r
            .grads()
            .map(|g| g.tensors().map(|t| download(ctx, t).unwrap())),
    }
}

/// Compares the reference with the oracle (`grads` for a train step); returns the failures.
fn check_oracle(what: &str, got: &Got, out: &[bf16], grads: Option<&LayerGrads>) -> Vec<String> {
    let mut bad = Vec::new();
    let mut line = format!("{what}:");
    let mut check = |name: &str, a: &[bf16], b: &[bf16]| {
        let tol = ref_tol(b);
        let e = if a.len() == b.len() {
            max_rel_err(a, b)
        } else {
            f64::INFINITY
        };
        line.push_str(&format!(" {name} {e:.2e}"));
        if e > tol {
            bad.push(format!("{what}: {name} error {e:.3e} above {tol:.3e}"));
        }
    };
    check("out", &got.out, out);
    match (grads, &got.dx, &got.grads) {
        (Some(g), Some(dx), Some(gg)) => {
            check("dx", dx, &g.dx);
            for ((name, a), b) in PARAM_NAMES.iter().zip(gg).zip(g.params()) {
                check(&format!("d{name}"), a, b);
            }
        }
        (Some(_), _, _) => bad.push(format!("{what}: the reference has no gradients")),
        (None, dx, gg) => {
            if dx.is_some() || gg.is_some() {
                bad.push(format!("{what}: a forward run reports gradients"));
            }
        }
    }
    println!("{line}");
    bad
}

/// The (H, W, S) of the small shapes: multiples of 32 (the fast layer's), and odd ones.
const SMALL: [(usize, usize, usize); 4] = [(96, 96, 0), (96, 96, 160), (40, 24, 56), (40, 24, 0)];

/// Router semantics (the oracle's routes' ids, weights recomputed and differentiated) against
/// `train_step`, and the forward pass alone against `forward`.
#[test]
fn reference_matches_the_oracle_with_router_semantics() {
    let Some((_g, ctx)) = gpu() else { return };
    let mut bad = Vec::new();
    let mut cases = 0;
    for &(h, w, s) in &SMALL {
        let experts: &[usize] = if h % 32 == 0 { &[8, 64] } else { &[8, 13, 64] };
        for &e in experts {
            for &k in &[1usize, 2, 8] {
                for &t in &[1usize, 33, 1000] {
                    let sh = shape(h, w, e, k, s);
                    let params = LayerParams::random(sh, 11 + e as u64 + k as u64);
                    let x = random_tokens(t, h, 100 + t as u64);
                    let dy = random_tokens(t, h, 200 + t as u64);
                    let routes = forward(&params, &x, t).unwrap().routes;
                    let (out, grads) = train_step(&params, &x, t, &dy).unwrap();
                    let inp = Inputs::new(&ctx, &params, &x, &dy, &routes);
                    let mut r = ReferenceLayer::new(&ctx, &sh, t, true).unwrap();
                    let what = format!("router T={t} H={h} W={w} E={e} K={k} S={s}");
                    r.run(&ctx, &inp.get(true, LayerRouting::Router)).unwrap();
                    bad.extend(check_oracle(&what, &read_ref(&ctx, &r), &out, Some(&grads)));
                    r.run(&ctx, &inp.get(false, LayerRouting::Router)).unwrap();
                    let fwd = forward(&params, &x, t).unwrap().out;
                    bad.extend(check_oracle(
                        &format!("forward {what}"),
                        &read_ref(&ctx, &r),
                        &fwd,
                        None,
                    ));
                    cases += 1;
                }
            }
        }
    }
    println!("{cases} cases compared");
    common::assert_no_failures(&bad);
}

/// Given routes (hot expert, zero-token experts, masked slots with NaN weights) against
/// `train_step_with_routes` and `forward_with_routes`: the weights are constants, `dWr` is 0.
#[test]
fn reference_matches_the_oracle_on_given_routes() {
    let Some((_g, ctx)) = gpu() else { return };
    let mut bad = Vec::new();
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(43);
    for (h, w, s, e, k, t) in
        layer_sweep(&[(96usize, 64usize, 160usize), (40, 24, 56), (40, 24, 0)])
    {
        let sh = shape(h, w, e, k, s);
        let params = LayerParams::random(sh, 5 + k as u64);
        let x = random_tokens(t, h, 31);
        let dy = random_tokens(t, h, 32);
        let routes = hot_routes(&mut rng, t, k, e);
        let (out, grads) = train_step_with_routes(&params, &x, t, &dy, &routes).unwrap();
        assert!(grads.dwr.iter().all(|v| v.to_f32() == 0.0));
        let inp = Inputs::new(&ctx, &params, &x, &dy, &routes);
        let mut r = ReferenceLayer::new(&ctx, &sh, t, true).unwrap();
        let what = format!("given T={t} H={h} W={w} E={e} K={k} S={s}");
        r.run(&ctx, &inp.get(true, LayerRouting::Given)).unwrap();
        bad.extend(check_oracle(&what, &read_ref(&ctx, &r), &out, Some(&grads)));
        r.run(&ctx, &inp.get(false, LayerRouting::Given)).unwrap();
        let fwd = forward_with_routes(&params, &x, t, &routes).unwrap();
        bad.extend(check_oracle(
            &format!("forward {what}"),
            &read_ref(&ctx, &r),
            &fwd,
            None,
        ));
    }
    common::assert_no_failures(&bad);
}

/// 0 tokens: empty outputs, weight gradients written as exact zeros (like the oracle).
#[test]
fn zero_tokens() {
    let Some((_g, ctx)) = gpu() else { return };
    for s in [0usize, 56] {
        let sh = shape(40, 24, 13, 2, s);
        let params = LayerParams::random(sh, 2);
        let mut r = ReferenceLayer::new(&ctx, &sh, 0, true).unwrap();
        for routing in [LayerRouting::Router, LayerRouting::Given] {
            let (out, grads) = match routing {
                LayerRouting::Router => train_step(&params, &[], 0, &[]).unwrap(),
                LayerRouting::Given => {
                    train_step_with_routes(&params, &[], 0, &[], &Routes::empty(2)).unwrap()
                }
            };
            let inp = Inputs::new(&ctx, &params, &[], &[], &Routes::empty(2));
            r.run(&ctx, &inp.get(true, routing)).unwrap();
            let got = read_ref(&ctx, &r);
            assert!(got.out.is_empty() && got.dx.as_ref().unwrap().is_empty());
            for (g, n) in got
                .grads
                .as_ref()
                .unwrap()
                .iter()
                .zip(LayerParams::sizes(&sh))
            {
                assert_eq!(g.len(), n);
                assert!(g.iter().all(|v| v.to_bits() == 0), "S={s}: not exact zeros");
            }
            common::assert_no_failures(&check_oracle(
                &format!("{routing:?} T=0 S={s}"),
                &got,
                &out,
                Some(&grads),
            ));
        }
    }
}

/// The device metric equals `max_rel_err` bit for bit, over a grid-stride loop (more than one
/// launch's threads) and every convention: NaN or infinity in `a`, NaN or infinity in `b`,
/// all-zero tensors, a nonzero `a` against an all-zero `b`, empty tensors.
#[test]
fn device_metric_equals_max_rel_err() {
    let Some((_g, ctx)) = gpu() else { return };
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(9);
    for &n in &[0usize, 1, 7, 1000, 70_001, 1_500_000] {
        let base: Vec<bf16> = (0..n)
            .map(|_| bf16::from_f32(rng.gen_range(-3.0f32..3.0)))
            .collect();
        let near: Vec<bf16> = base
            .iter()
            .map(|v| bf16::from_f32(v.to_f32() * (1.0 + rng.gen_range(-0.01f32..0.01))))
            .collect();
        let mut cases: Vec<(&str, Vec<bf16>, Vec<bf16>)> = vec![
            ("equal", base.clone(), base.clone()),
            ("near", near.clone(), base.clone()),
            ("zeros", vec![bf16::ZERO; n], vec![bf16::ZERO; n]),
            ("against zeros", near.clone(), vec![bf16::ZERO; n]),
            (
                "negative zeros",
                vec![bf16::NEG_ZERO; n],
                vec![bf16::ZERO; n],
            ),
        ];
        if n > 0 {
            let at = n / 2;
            for (name, v) in [
                ("nan", bf16::NAN),
                ("inf", bf16::INFINITY),
                ("-inf", bf16::NEG_INFINITY),
            ] {
                let mut a = near.clone();
                a[at] = v;
                cases.push((name, a, base.clone()));
                let mut b = base.clone();
                b[at] = v;
                cases.push((name, near.clone(), b));
            }
        }
        for (name, a, b) in &cases {
            let (da, db) = (up(&ctx, a), up(&ctx, b));
            let dev = device_max_rel_err(&ctx, &da, &db).unwrap();
            let host = max_rel_err(a, b);
            assert!(
                dev.to_bits() == host.to_bits() || (dev.is_nan() && host.is_nan()),
                "n={n} {name}: device {dev:e}, host {host:e}"
            );
            let st = reference::err_stats(&ctx, &[(&da, &db)]).unwrap()[0];
            assert_eq!(
                st.got_non_finite,
                a.iter().any(|v| !v.is_finite()),
                "{name}"
            );
            assert_eq!(
                st.ref_non_finite,
                b.iter().any(|v| !v.is_finite()),
                "{name}"
            );
        }
    }
    let (a, b) = (up(&ctx, &[bf16::ONE; 3]), up(&ctx, &[bf16::ONE; 4]));
    assert!(matches!(
        device_max_rel_err(&ctx, &a, &b),
        Err(LayerGpuError::Size { .. })
    ));
}

/// The fast layer against the reference on a small shape, every strategy: `compare_tensors`
/// equals `max_rel_err` of the downloaded tensors bit for bit, `compare` is its summary, and the
/// errors are within the layer's tolerances; a forward-only run compares the output only.
#[test]
fn compare_agrees_with_the_host_metric() {
    let Some((_g, ctx)) = gpu() else { return };
    let sh = shape(96, 96, 64, 8, 160);
    let t = 1000;
    let params = LayerParams::random(sh, 77);
    let x = random_tokens(t, 96, 78);
    let dy = random_tokens(t, 96, 79);
    let mut r = ReferenceLayer::new(&ctx, &sh, t, true).unwrap();
    let mut bad = Vec::new();
    for d in Dispatch::ALL {
        let mut layer = train_layer(&ctx, sh, t, d, &params, &x, &dy);
        layer.poison_outputs(&ctx).unwrap();
        layer.train_step(&ctx, LayerRouting::Router).unwrap();
        r.run_like(&ctx, &layer, true).unwrap();
        let te = compare_tensors(&ctx, &layer, &r).unwrap();
        let got = read_ref(&ctx, &r);
        let lg = layer.grads().unwrap();
        let host_out = max_rel_err(&download(&ctx, layer.out()).unwrap(), &got.out);
        let host_dx = max_rel_err(
            &download(&ctx, layer.dx()).unwrap(),
            got.dx.as_ref().unwrap(),
        );
        let host_g: Vec<f64> = lg
            .tensors()
            .iter()
            .zip(got.grads.as_ref().unwrap())
            .map(|(a, b)| max_rel_err(&download(&ctx, a).unwrap(), b))
            .collect();
        assert_eq!(te.out.to_bits(), host_out.to_bits(), "{d} out");
        assert_eq!(te.dx.unwrap().to_bits(), host_dx.to_bits(), "{d} dx");
        for ((name, dev), host) in PARAM_NAMES.iter().zip(te.grads.unwrap()).zip(&host_g) {
            assert_eq!(dev.to_bits(), host.to_bits(), "{d} d{name}");
        }
        let s = compare(&ctx, &layer, &r).unwrap();
        let gw = host_g.iter().copied().fold(0.0, f64::max);
        assert_eq!((s.out, s.gx, s.gw), (host_out, Some(host_dx), Some(gw)));
        println!("{d}: out {:.2e} dx {:.2e} gw {:.2e}", s.out, host_dx, gw);
        for (name, e, tol) in [
            ("out", s.out, OUT_TOL),
            ("dx", host_dx, DX_TOL),
            ("gw", gw, GRAD_TOL),
        ] {
            if e > tol {
                bad.push(format!("{d}: {name} {e:.3e} above {tol:.3e}"));
            }
        }
        // Forward only: the output is compared, the gradients are not.
        r.run_like(&ctx, &layer, false).unwrap();
        let f = compare(&ctx, &layer, &r).unwrap();
        assert_eq!((f.gx, f.gw), (None, None));
        assert_eq!(f.out, s.out, "{d}: the train step's forward is the forward");
    }
    common::assert_no_failures(&bad);
}

/// The fast layer against the reference at the record shape at 16,384 and 131,072 tokens, every
/// dispatch strategy, router and given routes, within the layer's tolerances.
#[test]
fn fast_layer_matches_the_reference_at_the_record_shape() {
    let Some((_g, ctx)) = gpu() else { return };
    let sh = LayerShape::RECORD;
    let params = LayerParams::random(sh, 2024);
    let mut bad = Vec::new();
    for t in [16_384usize, 131_072] {
        let x = random_tokens(t, sh.d_model, 1);
        let dy = random_tokens(t, sh.d_model, 2);
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(3);
        let given = hot_routes(&mut rng, t, sh.top_k, sh.experts);
        let mut r = ReferenceLayer::new(&ctx, &sh, t, true).unwrap();
        println!("reference device bytes at T={t}: {}", r.device_bytes());
        for d in Dispatch::ALL {
            let mut layer = train_layer(&ctx, sh, t, d, &params, &x, &dy);
            for routing in [LayerRouting::Router, LayerRouting::Given] {
                poisoned_train_step(&ctx, &mut layer, routing, &given);
                let started = std::time::Instant::now();
                r.run_like_with(&ctx, &layer, true, routing).unwrap();
                let secs = started.elapsed().as_secs_f64();
                match (routing, r.topk_check()) {
                    (LayerRouting::Router, Some(tk)) => {
                        println!(
                            "T={t} {d}: top-k check: {} wrong, {} near ties",
                            tk.wrong, tk.near_ties
                        );
                        if tk.wrong != 0 {
                            bad.push(format!("T={t} {d}: the router chose wrong: {tk:?}"));
                        }
                    }
                    (LayerRouting::Given, None) => {}
                    (routing, tk) => bad.push(format!("T={t} {d} {routing:?}: top-k {tk:?}")),
                }
                let te = compare_tensors(&ctx, &layer, &r).unwrap();
                let s = te.summary();
                println!(
                    "T={t} {d} {routing:?}: out {:.2e} dx {:.2e} grads {:?} (reference {secs:.2} s)",
                    s.out,
                    s.gx.unwrap(),
                    te.grads.unwrap().map(|e| format!("{e:.2e}"))
                );
                for (name, e, tol) in [
                    ("out", s.out, OUT_TOL),
                    ("dx", s.gx.unwrap(), DX_TOL),
                    ("gw", s.gw.unwrap(), GRAD_TOL),
                ] {
                    if e.is_nan() || e > tol {
                        bad.push(format!(
                            "T={t} {d} {routing:?}: {name} {e:.3e} above {tol:.3e}"
                        ));
                    }
                }
            }
        }
    }
    common::assert_no_failures(&bad);
}

/// The independent top-k check: the oracle's own choice passes (wrong = 0) at odd shapes; a
/// token whose top expert is swapped for its least likely one, or that holds a masked slot,
/// is caught, and the first such token is named; given routes are not checked.
#[test]
fn topk_check_catches_a_wrong_choice() {
    let Some((_g, ctx)) = gpu() else { return };
    for &(h, e, k, t) in &[
        (96usize, 64usize, 8usize, 1000usize),
        (40, 13, 2, 33),
        (96, 8, 1, 7),
    ] {
        let sh = shape(h, 32, e, k, 0);
        let params = LayerParams::random(sh, 5 + e as u64);
        let x = random_tokens(t, h, 9 + t as u64);
        let dy = random_tokens(t, h, 10);
        let routes = forward(&params, &x, t).unwrap().routes;
        let mut r = ReferenceLayer::new(&ctx, &sh, t, false).unwrap();
        let inp = Inputs::new(&ctx, &params, &x, &dy, &routes);
        r.run(&ctx, &inp.get(false, LayerRouting::Router)).unwrap();
        let tk = r.topk_check().expect("router runs are checked");
        println!("H={h} E={e} K={k} T={t}: oracle's choice: {tk:?}");
        assert_eq!(tk.wrong, 0, "the oracle's own top-k was flagged: {tk:?}");
        assert_eq!(tk.first_wrong, None);

        // Corrupt: the top slot of two tokens gets the least likely expert (exact logits in
        // f64 on the host), and one more token gets a masked slot.
        let logit = |tok: usize, ex: usize| -> f64 {
            (0..h)
                .map(|i| {
                    f64::from(x[tok * h + i].to_f32()) * f64::from(params.wr[i * e + ex].to_f32())
                })
                .sum()
        };
        let mut bad = routes.clone();
        let (t1, t2) = (t / 2 + 1, t - 1);
        let mut expected = vec![t1, t2];
        for &tok in &[t1, t2] {
            let chosen = &routes.idx[tok * k..(tok + 1) * k];
            let least = (0..e)
                .filter(|&ex| !chosen.contains(&(ex as i32)))
                .min_by(|&a, &b| logit(tok, a).total_cmp(&logit(tok, b)))
                .unwrap();
            bad.idx[tok * k] = least as i32;
        }
        if t > 3 {
            bad.idx[3 * k + k - 1] = MASKED;
            expected.push(3);
        }
        expected.sort_unstable();
        expected.dedup();
        let inp = Inputs::new(&ctx, &params, &x, &dy, &bad);
        r.run(&ctx, &inp.get(false, LayerRouting::Router)).unwrap();
        let tk = r.topk_check().unwrap();
        println!("H={h} E={e} K={k} T={t}: corrupted: {tk:?}");
        assert_eq!(tk.wrong, expected.len() as u64, "{tk:?}");
        assert_eq!(tk.first_wrong, Some(expected[0]), "{tk:?}");

        // Given routes: the ids are the caller's choice, nothing to check.
        r.run(&ctx, &inp.get(false, LayerRouting::Given)).unwrap();
        assert_eq!(r.topk_check(), None);
    }
}

/// Mismatched shapes, missing buffers, rejected routes and an unrun reference are typed
/// errors; a rejected run leaves the outputs poisoned and the next run is correct.
#[test]
fn bad_inputs_are_typed_errors() {
    let Some((_g, ctx)) = gpu() else { return };
    // An invalid shape.
    assert!(matches!(
        ReferenceLayer::new(&ctx, &shape(40, 24, 2, 3, 0), 10, true),
        Err(LayerGpuError::Unsupported(_))
    ));
    let sh = shape(96, 64, 8, 2, 64);
    let t = 33;
    let params = LayerParams::random(sh, 5);
    let x = random_tokens(t, 96, 6);
    let dy = random_tokens(t, 96, 7);
    let mut layer = train_layer(&ctx, sh, t, Dispatch::Sorted, &params, &x, &dy);
    layer.train_step(&ctx, LayerRouting::Router).unwrap();
    // Other shape, other token count, forward-only reference asked for a train step,
    // forward-only layer asked for one.
    let mut other = ReferenceLayer::new(&ctx, &shape(96, 64, 8, 1, 64), t, true).unwrap();
    assert!(matches!(
        other.run_like(&ctx, &layer, true),
        Err(LayerGpuError::Unsupported(_))
    ));
    assert!(matches!(
        compare(&ctx, &layer, &other),
        Err(LayerGpuError::Unsupported(_))
    ));
    let mut fewer = ReferenceLayer::new(&ctx, &sh, t - 1, true).unwrap();
    assert!(matches!(
        fewer.run_like(&ctx, &layer, true),
        Err(LayerGpuError::Size { .. })
    ));
    let mut fwd = ReferenceLayer::new(&ctx, &sh, t, false).unwrap();
    assert!(matches!(
        fwd.run_like(&ctx, &layer, true),
        Err(LayerGpuError::Unsupported(_))
    ));
    fwd.run_like(&ctx, &layer, false).unwrap();
    assert!(fwd.dx().is_none() && fwd.grads().is_none());
    let fwd_layer = MoeLayer::new(&ctx, sh, t, Dispatch::Sorted, false).unwrap();
    let mut r = ReferenceLayer::new(&ctx, &sh, t, true).unwrap();
    assert!(matches!(
        r.run_like(&ctx, &fwd_layer, true),
        Err(LayerGpuError::Unsupported(_))
    ));
    // Inputs of the wrong size.
    let inp = Inputs::new(&ctx, &params, &x[..96 * 10], &dy, &Routes::empty(2));
    assert!(matches!(
        r.run(&ctx, &inp.get(true, LayerRouting::Given)),
        Err(LayerGpuError::Size { what: "x", .. })
    ));
    // Rejected routes: the oracle's error (token and slot named), outputs poisoned, and the
    // reference refuses to be compared against.
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(8);
    let good = hot_routes(&mut rng, t, 2, 8);
    for (i, value, routing) in [
        (17 * 2 + 1, 8, LayerRouting::Given),
        (5 * 2, -3, LayerRouting::Given),
        (20 * 2 + 1, good.idx[20 * 2].max(0), LayerRouting::Router),
    ] {
        let mut bad = good.clone();
        bad.idx[i] = value;
        bad.weights[i] = 0.5;
        if routing == LayerRouting::Router {
            // a duplicate of the token's first slot
            bad.idx[i - 1] = value;
            bad.weights[i - 1] = 0.5;
        }
        let want = validate(&bad, &RouteRules::layer(&sh), 0).unwrap_err();
        let inp = Inputs::new(&ctx, &params, &x, &dy, &bad);
        match r.run(&ctx, &inp.get(true, routing)) {
            Err(LayerGpuError::Route(e)) => assert_eq!(e, want),
            other => panic!("expected the route error {want}, got {other:?}"),
        }
        assert!(download(&ctx, r.out()).unwrap().iter().all(|v| v.is_nan()));
        assert!(r.dx().is_none(), "a rejected run reports no gradients");
        assert!(matches!(
            compare(&ctx, &layer, &r),
            Err(LayerGpuError::Unsupported(_))
        ));
    }
    // A given table with a non-finite weight on an unmasked slot.
    let mut nan = good.clone();
    let i = nan.idx.iter().position(|&e| e != MASKED).unwrap();
    nan.weights[i] = f32::INFINITY;
    let inp = Inputs::new(&ctx, &params, &x, &dy, &nan);
    assert!(matches!(
        r.run(&ctx, &inp.get(true, LayerRouting::Given)),
        Err(LayerGpuError::Route(RouteError::NonFiniteWeight { .. }))
    ));
    // Usable afterwards.
    let inp = Inputs::new(&ctx, &params, &x, &dy, &good);
    r.run(&ctx, &inp.get(true, LayerRouting::Given)).unwrap();
    let (out, grads) = train_step_with_routes(&params, &x, t, &dy, &good).unwrap();
    common::assert_no_failures(&check_oracle(
        "after rejections",
        &read_ref(&ctx, &r),
        &out,
        Some(&grads),
    ));
}

/// The record shape at 131k and 1M tokens beside the fast layer (sorted): device bytes of both,
/// the reference's time, and the errors within tolerance. Long (the reference's 1M-token train
/// step takes seconds and the inputs are drawn on the host): run it with `--ignored`.
#[test]
#[ignore = "large: 1M tokens at the record shape (16k and 131k run in the test above); run with --ignored on the GPU"]
fn record_shape_at_large_token_counts() {
    let Some((_g, ctx)) = gpu() else { return };
    let sh = LayerShape::RECORD;
    let params = LayerParams::random(sh, 7);
    {
        let t = 1usize << 20;
        let x = random_tokens(t, sh.d_model, 8);
        let dy = random_tokens(t, sh.d_model, 9);
        let mut layer = train_layer(&ctx, sh, t, Dispatch::Sorted, &params, &x, &dy);
        layer.train_step(&ctx, LayerRouting::Router).unwrap();
        let mut r = ReferenceLayer::new(&ctx, &sh, t, true).unwrap();
        let gib = |b: usize| b as f64 / (1u64 << 30) as f64;
        let started = std::time::Instant::now();
        r.run_like(&ctx, &layer, true).unwrap();
        let train_s = started.elapsed().as_secs_f64();
        let e = compare(&ctx, &layer, &r).unwrap();
        let started = std::time::Instant::now();
        r.run_like(&ctx, &layer, false).unwrap();
        let fwd_s = started.elapsed().as_secs_f64();
        println!(
            "T={t}: layer {:.2} GiB, reference {:.2} GiB; reference train step {train_s:.2} s, \
             forward {fwd_s:.2} s; errors {e:?}",
            gib(layer.device_bytes()),
            gib(r.device_bytes())
        );
        assert!(e.out <= OUT_TOL && e.gx.unwrap() <= DX_TOL && e.gw.unwrap() <= GRAD_TOL);
    }
}

/// The fast layer against a reference run from its own uploads of the host inputs
/// (`reference::HostInputs`, no buffer shared with the layer), judged per token and per expert
/// (`reference::compare_grouped`), every strategy, the router and given hot-expert routes, at
/// the record's shape and at an odd one (E 60, K 3, d_model and shared not multiples of 32).
#[test]
fn fast_layer_matches_a_host_input_reference_per_group() {
    let Some((_g, ctx)) = gpu() else { return };
    let mut bad = Vec::new();
    for (sh, t) in [
        (LayerShape::RECORD, 16_384usize),
        (
            LayerShape {
                d_model: 136,
                width: 64,
                experts: 60,
                top_k: 3,
                shared: 40,
                renormalize: true,
            },
            257,
        ),
    ] {
        let params = LayerParams::random(sh, 77);
        let x = random_tokens(t, sh.d_model, 78);
        let dy = random_tokens(t, sh.d_model, 79);
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(80);
        let given = hot_routes(&mut rng, t, sh.top_k, sh.experts);
        let host = reference::HostInputs::upload(&ctx, &params, &x, Some(&dy)).unwrap();
        let mut r = ReferenceLayer::new(&ctx, &sh, t, true).unwrap();
        for d in Dispatch::ALL {
            let mut layer = train_layer(&ctx, sh, t, d, &params, &x, &dy);
            for routing in [LayerRouting::Router, LayerRouting::Given] {
                poisoned_train_step(&ctx, &mut layer, routing, &given);
                r.poison_outputs(&ctx).unwrap();
                r.run(&ctx, &host.inputs(layer.routes(), routing)).unwrap();
                if routing == LayerRouting::Router {
                    let tk = r.topk_check().expect("router semantics check the choice");
                    if tk.wrong != 0 {
                        bad.push(format!("T={t} {d}: the router chose wrong: {tk:?}"));
                    }
                }
                let checks = reference::compare_grouped(&ctx, &layer, &r).unwrap();
                let line: Vec<String> = checks
                    .iter()
                    .map(|c| {
                        format!(
                            "{} {:.2e} ({} {})",
                            c.name, c.worst.err, c.unit, c.worst.group
                        )
                    })
                    .collect();
                println!(
                    "T={t} E={} {d} {routing:?}: {}",
                    sh.experts,
                    line.join(", ")
                );
                for c in checks.iter().filter(|c| !c.ok()) {
                    bad.push(format!(
                        "T={t} E={} {d} {routing:?}: {} {} {} error {:.3e} above {:.3e}",
                        sh.experts, c.name, c.unit, c.worst.group, c.worst.err, c.tol
                    ));
                }
            }
        }
    }
    common::assert_no_failures(&bad);
}
