//! Helpers shared by the GPU tests of afdep-moe: the serialised GPU context (with the skip
//! convention of every `gpu_*` test), small layer shapes, and routes with a hot expert,
//! zero-token experts and masked slots.
#![allow(dead_code)] // each test binary uses its own subset

use std::sync::Mutex;

use afdep_core::oracle::LayerParams;
use afdep_core::route::{MASKED, Routes};
use afdep_core::{LayerShape, bf16};
use afdep_kernels::{GpuContext, KernelError};
use afdep_moe::{Dispatch, LayerRouting, MoeLayer};
use rand::Rng;
use rand::seq::SliceRandom;

/// One GPU test at a time per binary (they share the device's memory).
pub static SERIAL: Mutex<()> = Mutex::new(());

/// The GPU context, or `None` (after printing `SKIP: <reason>`) without a usable driver;
/// `AFDEP_REQUIRE_GPU=1` turns the skip into a failure.
pub fn gpu() -> Option<(std::sync::MutexGuard<'static, ()>, GpuContext)> {
    let guard = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    match GpuContext::new(0) {
        Ok(c) => Some((guard, c)),
        Err(KernelError::NoDriver { why }) => {
            afdep_core::testing::skip_unavailable("the GPU driver", why);
            None
        }
        Err(e) => panic!("creating the GPU context failed: {e}"),
    }
}

/// `AFDEP_TEST_MAX_TOKENS`: the largest token count a sweep tests (default: all), for the
/// sanitizer runs of the bundle, which slow every kernel by orders of magnitude. A sweep
/// prints how many cases it left out.
pub fn max_tokens() -> usize {
    std::env::var("AFDEP_TEST_MAX_TOKENS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(usize::MAX)
}

/// `AFDEP_TEST_SHARD=i/n`: a sweep runs only its cases whose index (in the sweep's loop
/// order, counting every case, also those `AFDEP_TEST_MAX_TOKENS` leaves out) is `i` modulo
/// `n`; unset, every case. It splits a sweep over processes, for the sanitizers: a whole
/// `gpu_layer` sweep under racecheck does not finish in one. A malformed value panics with
/// what it expected, so a typo cannot turn a sweep into a no-op.
pub fn in_shard(case: usize) -> bool {
    let Ok(v) = std::env::var("AFDEP_TEST_SHARD") else {
        return true;
    };
    let parsed = v
        .split_once('/')
        .and_then(|(i, n)| {
            Some((
                i.trim().parse::<usize>().ok()?,
                n.trim().parse::<usize>().ok()?,
            ))
        })
        .filter(|&(i, n)| n > 0 && i < n);
    let Some((i, n)) = parsed else {
        panic!("AFDEP_TEST_SHARD={v:?}: expected i/n with 0 <= i < n");
    };
    case % n == i
}

/// Fails a sweep that compared no case (`AFDEP_TEST_MAX_TOKENS` below all of its token counts):
/// a test that checked nothing must not pass. `left_out` is how many the limit removed.
pub fn assert_sweep_ran(what: &str, cases: usize, left_out: usize) {
    assert!(
        cases > 0,
        "{what}: no case ran ({left_out} left out by AFDEP_TEST_MAX_TOKENS = {}): a sweep that \
         runs no case cannot pass (AFDEP_TEST_SHARD {:?})",
        max_tokens(),
        std::env::var("AFDEP_TEST_SHARD").ok()
    );
}

/// Fails a test with every failure it collected, one a line.
pub fn assert_no_failures(bad: &[String]) {
    assert!(
        bad.is_empty(),
        "{} failures:\n{}",
        bad.len(),
        bad.join("\n")
    );
}

/// Ends a sweep: [`assert_sweep_ran`], then [`assert_no_failures`].
pub fn finish_sweep(what: &str, cases: usize, left_out: usize, bad: &[String]) {
    assert_sweep_ran(what, cases, left_out);
    assert_no_failures(bad);
}

/// A training layer of `sh` for `t` tokens with dispatch `d`, holding `params`, `x` and `dy`.
pub fn train_layer(
    ctx: &GpuContext,
    sh: LayerShape,
    t: usize,
    d: Dispatch,
    params: &LayerParams,
    x: &[bf16],
    dy: &[bf16],
) -> MoeLayer {
    let mut layer = MoeLayer::new(ctx, sh, t, d, true).unwrap();
    layer.upload_params(ctx, params).unwrap();
    layer.upload_x(ctx, x).unwrap();
    layer.upload_dy(ctx, dy).unwrap();
    layer
}

/// A train step of `layer` by `routing` on poisoned outputs; given routes are `given`, uploaded
/// first.
pub fn poisoned_train_step(
    ctx: &GpuContext,
    layer: &mut MoeLayer,
    routing: LayerRouting,
    given: &Routes,
) {
    if routing == LayerRouting::Given {
        layer.upload_routes(ctx, given).unwrap();
    }
    layer.poison_outputs(ctx).unwrap();
    layer.train_step(ctx, routing).unwrap();
}

/// The cases of the small-shape sweeps, in loop order: every `(h, w, s)` of `hws` (d_model,
/// width, shared width) with 8 and 64 experts, top-k 1, 2 and 8, and 1, 33 and 1000 tokens.
/// Returns `(h, w, s, e, k, t)`.
pub fn layer_sweep(
    hws: &[(usize, usize, usize)],
) -> Vec<(usize, usize, usize, usize, usize, usize)> {
    let mut v = Vec::new();
    for &(h, w, s) in hws {
        for e in [8, 64] {
            for k in [1, 2, 8] {
                for t in [1, 33, 1000] {
                    v.push((h, w, s, e, k, t));
                }
            }
        }
    }
    v
}

/// A layer shape with renormalised top-k weights.
pub fn shape(h: usize, w: usize, e: usize, k: usize, s: usize) -> LayerShape {
    LayerShape {
        d_model: h,
        width: w,
        experts: e,
        top_k: k,
        shared: s,
        renormalize: true,
    }
}

/// Routes with a hot expert (expert 0 in 90% of the tokens), experts that get no token
/// (only the lower half is used) and masked slots (about 15%, junk weights).
pub fn hot_routes(rng: &mut impl Rng, tokens: usize, k: usize, experts: usize) -> Routes {
    let used = (experts / 2).max(k + 1).min(experts);
    let mut idx = Vec::with_capacity(tokens * k);
    let mut weights = Vec::with_capacity(tokens * k);
    for _ in 0..tokens {
        let mut pool: Vec<i32> = (1..used as i32).collect();
        pool.shuffle(rng);
        let mut pick: Vec<i32> = pool[..k - 1].to_vec();
        pick.push(if rng.gen_bool(0.9) || pool.len() < k {
            0
        } else {
            pool[k - 1]
        });
        pick.shuffle(rng);
        for e in pick {
            if rng.gen_bool(0.15) {
                idx.push(MASKED);
                weights.push(f32::NAN);
            } else {
                idx.push(e);
                weights.push(rng.gen_range(0.05f32..1.0));
            }
        }
    }
    Routes {
        tokens,
        top_k: k,
        idx,
        weights,
    }
}
