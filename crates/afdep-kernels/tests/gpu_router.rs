//! The device router against `afdep_core::route`, within the tolerance documented in
//! `afdep_kernels::ops::router`: logits within `1e-5 · Σ|x·w|`; on tied (integer) logits the
//! selection is exact and the weights agree to 2e-6 relative; on continuous logits a
//! selection may differ only between experts whose probabilities agree within 1e-6.

mod common;

use afdep_core::LayerShape;
use afdep_core::oracle::gemm::matmul;
use afdep_core::route::{self, Routes};
use afdep_kernels::ops::router::{
    LogitsDims, LogitsKernel, TopkDims, router, router_logits, router_topk,
};
use afdep_kernels::ops::{download, poison, zeros};
use afdep_kernels::{DeviceRoutes, GpuContext};
use common::{EXPERTS, TOP_K, gpu, par_chunks, random_bf16, rng, tokens};
use half::bf16;
use rand::Rng;

fn shape(e: usize, k: usize, renormalize: bool) -> LayerShape {
    LayerShape {
        d_model: 1,
        width: 1,
        experts: e,
        top_k: k,
        shared: 0,
        renormalize,
    }
}

/// CPU probabilities and routes from logits (in parallel chunks of tokens).
fn cpu_route(logits: &[f32], t: usize, e: usize, k: usize, renorm: bool) -> (Vec<f32>, Routes) {
    let parts = par_chunks(t, 4096, |r| {
        let mut p = logits[r.start * e..r.end * e].to_vec();
        for row in p.chunks_mut(e) {
            route::softmax_in_place(row);
        }
        let sel = route::select(&p, r.len(), &shape(e, k, renorm));
        (p, sel)
    });
    let mut p = Vec::with_capacity(t * e);
    let mut out = Routes {
        tokens: t,
        top_k: k,
        idx: Vec::new(),
        weights: Vec::new(),
    };
    for (pp, s) in parts {
        p.extend(pp);
        out.idx.extend(s.idx);
        out.weights.extend(s.weights);
    }
    (p, out)
}

fn device_topk(
    ctx: &GpuContext,
    logits: &[f32],
    t: usize,
    e: usize,
    k: usize,
    renorm: bool,
) -> Routes {
    let l = ctx.stream().clone_htod(logits).unwrap();
    let mut out = DeviceRoutes::zeros(ctx, t, k).unwrap();
    poison(ctx, &mut out.idx).unwrap();
    poison(ctx, &mut out.weights).unwrap();
    router_topk(ctx, &l, TopkDims::new(t, e, k, renorm), &mut out, None).unwrap();
    out.download(ctx).unwrap()
}

fn close(a: f32, b: f32, rel: f32) -> bool {
    (a - b).abs() <= rel * b.abs().max(f32::MIN_POSITIVE)
}

/// Checks device routes against the CPU's: ids equal, except where the CPU's probabilities of
/// the two experts agree within `p_tol` (a near tie the GPU's few-ulp softmax may order
/// differently); weights within `w_tol`. Returns the number of near-tie differences.
fn compare(
    got: &Routes,
    want: &Routes,
    p: &[f32],
    e: usize,
    p_tol: f32,
    w_tol: f32,
    what: &str,
) -> usize {
    let k = want.top_k;
    let mut near_ties = 0;
    for t in 0..want.tokens {
        let g = &got.idx[t * k..(t + 1) * k];
        let w = &want.idx[t * k..(t + 1) * k];
        let mut ids = g.to_vec();
        ids.sort_unstable();
        ids.dedup();
        assert_eq!(
            ids.len(),
            k,
            "{what}: token {t} has repeated or missing ids {g:?}"
        );
        assert!(
            g.iter().all(|&x| (0..e as i32).contains(&x)),
            "{what}: token {t} ids {g:?}"
        );
        if g != w {
            for s in 0..k {
                let (pg, pw) = (p[t * e + g[s] as usize], p[t * e + w[s] as usize]);
                assert!(
                    close(pg, pw, p_tol),
                    "{what}: token {t} slot {s}: GPU picked {} (p={pg}), CPU {} (p={pw})",
                    g[s],
                    w[s]
                );
            }
            near_ties += 1;
            continue;
        }
        for s in 0..k {
            let (a, b) = (got.weights[t * k + s], want.weights[t * k + s]);
            assert!(
                close(a, b, w_tol),
                "{what}: token {t} slot {s}: weight {a} vs {b}"
            );
        }
    }
    near_ties
}

#[test]
fn topk_on_tied_logits_is_exact() {
    // Integer logits: many exact ties, resolved to the lower id on both sides; different
    // values differ by a factor e in probability, so no near ties.
    let Some(ctx) = gpu() else { return };
    let mut r = rng(41);
    for &t in &tokens() {
        for &e in &EXPERTS {
            for &k in &TOP_K {
                for renorm in [true, false] {
                    if t >= 1 << 20 && !renorm {
                        continue;
                    }
                    let logits: Vec<f32> =
                        (0..t * e).map(|_| r.gen_range(-3i32..=3) as f32).collect();
                    let (p, want) = cpu_route(&logits, t, e, k, renorm);
                    let got = device_topk(&ctx, &logits, t, e, k, renorm);
                    assert_eq!(got.idx, want.idx, "T={t} E={e} K={k}: tied selection");
                    let n = compare(
                        &got,
                        &want,
                        &p,
                        e,
                        0.0,
                        2e-6,
                        &format!("tied T={t} E={e} K={k} renorm={renorm}"),
                    );
                    assert_eq!(n, 0);
                }
            }
        }
    }
}

#[test]
fn topk_on_continuous_logits_within_tolerance() {
    let Some(ctx) = gpu() else { return };
    let mut r = rng(42);
    for &t in &tokens() {
        for &e in &EXPERTS {
            for &k in &TOP_K {
                let logits: Vec<f32> = (0..t * e).map(|_| r.gen_range(-4.0f32..4.0)).collect();
                let (p, want) = cpu_route(&logits, t, e, k, true);
                let got = device_topk(&ctx, &logits, t, e, k, true);
                let n = compare(
                    &got,
                    &want,
                    &p,
                    e,
                    1e-6,
                    4e-6,
                    &format!("continuous T={t} E={e} K={k}"),
                );
                assert!(
                    n * 1000 <= t.max(1000),
                    "T={t} E={e} K={k}: {n} near-tie differences is too many"
                );
            }
        }
    }
}

#[test]
fn logits_within_tolerance() {
    let Some(ctx) = gpu() else { return };
    let mut r = rng(43);
    for &t in &tokens() {
        let hs: &[usize] = if t >= 1 << 20 { &[32] } else { &[1, 33, 512] };
        for &h in hs {
            for &e in &EXPERTS {
                let x = random_bf16(&mut r, t * h, 1.0);
                let wr = random_bf16(&mut r, h * e, 1.0);
                let xd = ctx.stream().clone_htod(&x).unwrap();
                let wd = ctx.stream().clone_htod(&wr).unwrap();
                let mut l = zeros::<f32>(&ctx, t * e).unwrap();
                poison(&ctx, &mut l).unwrap();
                let ld = LogitsDims::new(t, h, e, 8);
                router_logits(&ctx, &xd, &wd, ld, &mut l, LogitsKernel::Auto).unwrap();
                let got = download(&ctx, &l).unwrap();
                let xf: Vec<f32> = x.iter().map(|v| v.to_f32()).collect();
                let wf: Vec<f32> = wr.iter().map(|v| v.to_f32()).collect();
                let mut want = vec![0f32; t * e];
                matmul(t, h, e, &xf, &wf, &mut want, false);
                let bad = par_chunks(t, 8192, |rows| {
                    for i in rows {
                        for j in 0..e {
                            let bound = (0..h)
                                .map(|q| (xf[i * h + q] * wf[q * e + j]).abs())
                                .sum::<f32>()
                                * 1e-5;
                            let (a, b) = (got[i * e + j], want[i * e + j]);
                            if (a - b).abs() > bound.max(1e-30) || a.is_nan() {
                                return Some(format!(
                                    "T={t} H={h} E={e} ({i},{j}): {a} vs {b} (bound {bound})"
                                ));
                            }
                        }
                    }
                    None
                });
                if let Some(msg) = bad.into_iter().flatten().next() {
                    panic!("{msg}");
                }
            }
        }
    }
}

#[test]
fn router_end_to_end_matches_core() {
    let Some(ctx) = gpu() else { return };
    let mut r = rng(44);
    for &t in &[1usize, 7, 1000, 16384] {
        for &e in &EXPERTS {
            for &k in &TOP_K {
                for renorm in [true, false] {
                    let h = 256;
                    let s = LayerShape {
                        d_model: h,
                        width: 1,
                        experts: e,
                        top_k: k,
                        shared: 0,
                        renormalize: renorm,
                    };
                    let x = random_bf16(&mut r, t * h, 1.0);
                    let wr = random_bf16(&mut r, h * e, 0.1);
                    let xd = ctx.stream().clone_htod(&x).unwrap();
                    let wd = ctx.stream().clone_htod(&wr).unwrap();
                    let got = router(&ctx, &xd, &wd, t, &s)
                        .unwrap()
                        .download(&ctx)
                        .unwrap();
                    let p = route::router_probs(&x, &wr, t, &s);
                    let want = route::select(&p, t, &s);
                    // Logit differences of ~1e-6 move probabilities by ~1e-6 relative.
                    let n = compare(
                        &got,
                        &want,
                        &p,
                        e,
                        2e-5,
                        2e-5,
                        &format!("router T={t} E={e} K={k} renorm={renorm}"),
                    );
                    assert!(
                        n * 100 <= t.max(100),
                        "T={t} E={e} K={k}: {n} near-tie differences"
                    );
                }
            }
        }
    }
}

#[test]
fn bad_specialisations_are_typed_errors() {
    let Some(ctx) = gpu() else { return };
    let l = zeros::<f32>(&ctx, 16).unwrap();
    let mut out = DeviceRoutes::zeros(&ctx, 1, 9).unwrap();
    // Top-k above the expert count, and a short logits buffer.
    assert!(router_topk(&ctx, &l, TopkDims::new(1, 8, 9, true), &mut out, None).is_err());
    let mut out = DeviceRoutes::zeros(&ctx, 1, 2).unwrap();
    assert!(router_topk(&ctx, &l, TopkDims::new(1, 64, 2, true), &mut out, None).is_err());
    let x = zeros::<bf16>(&ctx, 4).unwrap();
    let mut logits = zeros::<f32>(&ctx, 64).unwrap();
    assert!(
        router_logits(
            &ctx,
            &x,
            &x,
            LogitsDims::new(1, 4, 64, 2),
            &mut logits,
            LogitsKernel::Auto
        )
        .is_err(),
        "wr too short"
    );
}
