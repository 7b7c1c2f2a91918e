//! The tensor-core router logits (`afdep_router_logits_mma`) at odd shapes against the CPU
//! (expert counts 5, 12, 60, 256: column tails and several column blocks; hidden sizes 8, 40,
//! 2056: k tails; token counts 1, 127, 129, 3000: row tails), the non-finite path of the top-k
//! (masked slots and `RouteError::NonFiniteLogit` from the validator, as the CPU oracle's
//! `route::check_logits`), and the logits' time at a million tokens beside the SIMT kernel and
//! the memory floor (printed, for docs/perf; the test asserts only correctness).
//!
//! Without a usable driver every test prints `SKIP: <reason>` and passes, unless
//! `AFDEP_REQUIRE_GPU=1`.

mod common;

use std::time::Instant;

use afdep_core::RouteError;
use afdep_core::oracle::gemm::matmul;
use afdep_core::route::{self, MASKED, RouteRules};
use afdep_kernels::ops::router::{LogitsDims, LogitsKernel, TopkDims, router_logits, router_topk};
use afdep_kernels::ops::{download, poison, zeros};
use afdep_kernels::{DeviceRoutes, GpuContext, RouteValidator};
use common::{gpu, random_bf16, rng, size_allowed};
use half::bf16;

/// The CPU logits and the first logit outside `1e-5 · Σ_h |x·w|` (the documented tolerance).
fn check_logits(
    got: &[f32],
    x: &[bf16],
    wr: &[bf16],
    t: usize,
    h: usize,
    e: usize,
) -> Option<String> {
    let xf: Vec<f32> = x.iter().map(|v| v.to_f32()).collect();
    let wf: Vec<f32> = wr.iter().map(|v| v.to_f32()).collect();
    let mut want = vec![0f32; t * e];
    matmul(t, h, e, &xf, &wf, &mut want, false);
    for i in 0..t {
        for j in 0..e {
            let bound = (0..h)
                .map(|q| (xf[i * h + q] * wf[q * e + j]).abs())
                .sum::<f32>()
                * 1e-5;
            let (a, b) = (got[i * e + j], want[i * e + j]);
            if (a - b).abs() > bound.max(1e-30) || !a.is_finite() {
                return Some(format!(
                    "T={t} H={h} E={e} ({i},{j}): {a} vs {b} (bound {bound})"
                ));
            }
        }
    }
    None
}

fn logits_of(
    ctx: &GpuContext,
    x: &[bf16],
    wr: &[bf16],
    t: usize,
    h: usize,
    e: usize,
    k: usize,
) -> Vec<f32> {
    let xd = ctx.stream().clone_htod(x).unwrap();
    let wd = ctx.stream().clone_htod(wr).unwrap();
    let mut l = zeros::<f32>(ctx, t * e).unwrap();
    poison(ctx, &mut l).unwrap();
    let ld = LogitsDims::new(t, h, e, k);
    router_logits(ctx, &xd, &wd, ld, &mut l, LogitsKernel::Auto).unwrap();
    download(ctx, &l).unwrap()
}

#[test]
fn mma_logits_at_odd_shapes() {
    let Some(ctx) = gpu() else { return };
    let mut r = rng(71);
    let mut cases = 0;
    for &(h, e, k) in &[
        (8usize, 5usize, 1usize),
        (40, 12, 3),
        (2056, 60, 4),
        (512, 256, 8),
        (96, 129, 2),
    ] {
        for &t in &[1usize, 127, 129, 3000] {
            let x = random_bf16(&mut r, t * h, 1.0);
            let wr = random_bf16(&mut r, h * e, 1.0);
            let got = logits_of(&ctx, &x, &wr, t, h, e, k);
            if let Some(m) = check_logits(&got, &x, &wr, t, h, e) {
                panic!("{m}");
            }
            cases += 1;
        }
    }
    println!("{cases} shapes within 1e-5·Σ|x·w|");
}

/// A NaN or infinity in x rows or in one router column: the tokens get masked slots (weight
/// 0), the validator reports the CPU's first (token, expert) with the logit, and a clean table
/// afterwards validates (the key was cleared).
#[test]
fn non_finite_logits_are_the_cpu_error() {
    let Some(ctx) = gpu() else { return };
    let mut r = rng(72);
    let (t, h, e, k) = (300usize, 64usize, 60usize, 3usize);
    let rules = RouteRules {
        experts: e,
        owned: e,
        capacity: t,
        top_k: k,
    };
    let clean_x = random_bf16(&mut r, t * h, 1.0);
    let clean_w = random_bf16(&mut r, h * e, 1.0);
    let mut v = RouteValidator::new(&ctx).unwrap();
    for (case, xs, ws) in [
        (
            "NaN in x 200, 17",
            vec![(200 * h + 3, f32::NAN), (17 * h, f32::NAN)],
            vec![],
        ),
        ("inf in x 5", vec![(5 * h + 63, f32::INFINITY)], vec![]),
        (
            "-inf in wr column 41",
            vec![],
            vec![(9 * e + 41, f32::NEG_INFINITY)],
        ),
        ("clean", vec![], vec![]),
    ] {
        let mut x = clean_x.clone();
        let mut w = clean_w.clone();
        for (i, val) in xs {
            x[i] = bf16::from_f32(val);
        }
        for (i, val) in ws {
            w[i] = bf16::from_f32(val);
        }
        let xd = ctx.stream().clone_htod(&x).unwrap();
        let wd = ctx.stream().clone_htod(&w).unwrap();
        let mut l = zeros::<f32>(&ctx, t * e).unwrap();
        let ld = LogitsDims::new(t, h, e, k);
        router_logits(&ctx, &xd, &wd, ld, &mut l, LogitsKernel::Auto).unwrap();
        let mut out = DeviceRoutes::zeros(&ctx, t, k).unwrap();
        let td = TopkDims::new(t, e, k, true);
        router_topk(&ctx, &l, td, &mut out, Some(&mut v)).unwrap();
        v.launch_routed(&ctx, &l, &out, &rules, 0).unwrap();
        let got = v.result(&ctx).unwrap();
        let logits = download(&ctx, &l).unwrap();
        let want = route::check_logits(&logits, e, 0);
        let routes = out.download(&ctx).unwrap();
        match (&got, &want) {
            (Ok(()), Ok(())) => assert_eq!(case, "clean"),
            (
                Err(RouteError::NonFiniteLogit {
                    token: a,
                    expert: b,
                    value: va,
                    ..
                }),
                Err(RouteError::NonFiniteLogit {
                    token: c,
                    expert: d,
                    value: vb,
                    ..
                }),
            ) => {
                assert_eq!((a, b), (c, d), "{case}");
                assert!(va.to_bits() == vb.to_bits(), "{case}: {va} vs {vb}");
            }
            _ => panic!("{case}: GPU {got:?}, CPU {want:?}"),
        }
        for tok in 0..t {
            let row = &logits[tok * e..(tok + 1) * e];
            let bad = row.iter().any(|v| !v.is_finite());
            let ids = &routes.idx[tok * k..(tok + 1) * k];
            if bad {
                assert!(
                    ids.iter().all(|&i| i == MASKED),
                    "{case}: token {tok} {ids:?}"
                );
                assert!(
                    routes.weights[tok * k..(tok + 1) * k]
                        .iter()
                        .all(|&w| w == 0.0)
                );
            } else {
                assert!(
                    ids.iter().all(|&i| (0..e as i32).contains(&i)),
                    "{case}: token {tok}"
                );
            }
        }
    }
}

/// Logits (and the top-k) at a million tokens, tensor cores beside SIMT, against the memory
/// floor `T·H·2 + H·E·2 + T·E·4` bytes at 4.8 TB/s (the H200's HBM3e peak); a sample of rows
/// checked against the CPU. Prints one line per shape (the numbers of docs/perf/router.md).
#[test]
fn logits_at_a_million_tokens_timing() {
    let Some(ctx) = gpu() else { return };
    let t = 1usize << 20;
    if !size_allowed(t) {
        return;
    }
    let mut r = rng(73);
    for &(h, e, k) in &[
        (512usize, 64usize, 8usize),
        (2048, 128, 8),
        (2048, 60, 4),
        (7168, 256, 8),
    ] {
        // 4096 random rows, repeated on the device (a host copy of 14 GB would take longer
        // than the timing)
        let block = 4096;
        let xb = random_bf16(&mut r, block * h, 1.0);
        let wr = random_bf16(&mut r, h * e, 0.1);
        let xbd = ctx.stream().clone_htod(&xb).unwrap();
        let mut xd = zeros::<bf16>(&ctx, t * h).unwrap();
        for i in 0..t / block {
            let mut dst = xd.slice_mut(i * block * h..(i + 1) * block * h);
            ctx.stream().memcpy_dtod(&xbd, &mut dst).unwrap();
        }
        let wd = ctx.stream().clone_htod(&wr).unwrap();
        let mut l = zeros::<f32>(&ctx, t * e).unwrap();
        let mut out = DeviceRoutes::zeros(&ctx, t, k).unwrap();
        let mut v = RouteValidator::new(&ctx).unwrap();
        let time = |f: &mut dyn FnMut()| {
            f();
            ctx.synchronize().unwrap();
            let n = 10;
            let t0 = Instant::now();
            for _ in 0..n {
                f();
            }
            ctx.synchronize().unwrap();
            t0.elapsed().as_secs_f64() * 1e3 / n as f64
        };
        let simt = time(&mut || {
            let ld = LogitsDims::new(t, h, e, k);
            router_logits(&ctx, &xd, &wd, ld, &mut l, LogitsKernel::Simt).unwrap()
        });
        poison(&ctx, &mut l).unwrap();
        let mma = time(&mut || {
            let ld = LogitsDims::new(t, h, e, k);
            router_logits(&ctx, &xd, &wd, ld, &mut l, LogitsKernel::Auto).unwrap()
        });
        let got = download(&ctx, &l.slice(..block * e).to_owned_via(&ctx)).unwrap();
        if let Some(m) = check_logits(&got, &xb, &wr, block, h, e) {
            panic!("{m}");
        }
        let topk = time(&mut || {
            let td = TopkDims::new(t, e, k, true);
            router_topk(&ctx, &l, td, &mut out, Some(&mut v)).unwrap()
        });
        v.launch_routed(
            &ctx,
            &l,
            &out,
            &RouteRules {
                experts: e,
                owned: e,
                capacity: t,
                top_k: k,
            },
            0,
        )
        .unwrap();
        assert_eq!(v.result(&ctx).unwrap(), Ok(()));
        let bytes = (t * h * 2 + h * e * 2 + t * e * 4) as f64;
        let floor = bytes / 4.8e12 * 1e3;
        println!(
            "router T={t} H={h} E={e} K={k}: logits mma {mma:.3} ms ({:.2}x floor {floor:.3} ms, \
             {:.2} TB/s), simt {simt:.3} ms ({:.2}x), top-k {topk:.3} ms",
            mma / floor,
            bytes / (mma * 1e-3) / 1e12,
            simt / floor
        );
    }
}

/// Extension used above: a device slice's first elements as a new buffer.
trait ToOwnedVia {
    fn to_owned_via(&self, ctx: &GpuContext) -> afdep_kernels::cudarc::driver::CudaSlice<f32>;
}

impl ToOwnedVia for afdep_kernels::cudarc::driver::CudaView<'_, f32> {
    fn to_owned_via(&self, ctx: &GpuContext) -> afdep_kernels::cudarc::driver::CudaSlice<f32> {
        let mut d = zeros::<f32>(ctx, self.len()).unwrap();
        ctx.stream().memcpy_dtod(self, &mut d).unwrap();
        d
    }
}
