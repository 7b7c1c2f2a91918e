//! Shared helpers of the GPU tests: the context (or the reason to skip), random inputs, and
//! the CPU side of the comparisons.
#![allow(dead_code)]

use afdep_core::error::route_class;
use afdep_core::route::{MASKED, RouteRules, Routes};
use afdep_kernels::{GpuContext, KernelError};
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// The token counts every kernel is checked at.
pub const TOKENS: [usize; 5] = [1, 7, 1000, 16384, 1 << 20];
/// `AFDEP_TEST_MAX_TOKENS`: the largest token count to test (default: all). The sanitizer runs
/// of the bundle set it, since compute-sanitizer makes the million-token cases very slow.
pub fn max_tokens() -> usize {
    std::env::var("AFDEP_TEST_MAX_TOKENS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(usize::MAX)
}

/// [`TOKENS`] up to [`max_tokens`]; a sweep must run at least one case, so a limit below the
/// smallest count fails the test instead of letting it pass having checked nothing.
pub fn tokens() -> Vec<usize> {
    let v: Vec<usize> = TOKENS
        .iter()
        .copied()
        .filter(|&t| t <= max_tokens())
        .collect();
    assert!(
        !v.is_empty(),
        "AFDEP_TEST_MAX_TOKENS = {} leaves this sweep no token count (the smallest is {}): \
         a sweep that runs no case cannot pass",
        max_tokens(),
        TOKENS[0]
    );
    v
}

/// Whether `AFDEP_REQUIRE_GPU` is set (to anything but empty or `0`): a missing GPU, driver or
/// library then fails a test instead of skipping it.
pub fn require_gpu() -> bool {
    afdep_core::testing::gpu_required()
}

/// Whether a test at `t` tokens runs under [`max_tokens`]; prints `SKIP: <reason>` if not.
pub fn size_allowed(t: usize) -> bool {
    let ok = t <= max_tokens();
    if !ok {
        println!(
            "SKIP: {t} tokens is above AFDEP_TEST_MAX_TOKENS = {}",
            max_tokens()
        );
    }
    ok
}

/// The expert counts every kernel is checked at.
pub const EXPERTS: [usize; 3] = [64, 96, 128];
/// The top-k values every kernel is checked at.
pub const TOP_K: [usize; 4] = [1, 2, 6, 8];

/// The GPU context of device 0, or `None` after printing `SKIP: <reason>` when there is no
/// driver. With `AFDEP_REQUIRE_GPU=1` a missing driver fails the test instead (the GPU
/// machine's run script sets it, so a broken setup cannot pass as skipped).
pub fn gpu() -> Option<GpuContext> {
    match GpuContext::new(0) {
        Ok(c) => Some(c),
        Err(KernelError::NoDriver { why }) => {
            afdep_core::testing::skip_unavailable("the GPU driver", why);
            None
        }
        Err(e) => panic!("creating the GPU context failed: {e}"),
    }
}

/// A seeded generator.
pub fn rng(seed: u64) -> ChaCha8Rng {
    ChaCha8Rng::seed_from_u64(seed)
}

/// Valid routes: each token picks `k` distinct experts of `0..owned` in random order; a
/// fraction `masked` of the slots is masked (their weight is NaN or junk, which validation
/// must ignore).
pub fn valid_routes(
    r: &mut ChaCha8Rng,
    tokens: usize,
    k: usize,
    owned: usize,
    masked: f64,
) -> Routes {
    let all: Vec<i32> = (0..owned as i32).collect();
    let mut idx = Vec::with_capacity(tokens * k);
    let mut weights = Vec::with_capacity(tokens * k);
    for _ in 0..tokens {
        for &e in all.choose_multiple(r, k) {
            if masked > 0.0 && r.gen_bool(masked) {
                idx.push(MASKED);
                weights.push(if r.gen_bool(0.5) { f32::NAN } else { 7.0 });
            } else {
                idx.push(e);
                weights.push(r.gen_range(0.0f32..1.0));
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

/// Routes concentrated on few experts: every token uses experts `0..k` (in a random order),
/// so each of them receives up to `tokens` rows.
pub fn skewed_routes(r: &mut ChaCha8Rng, tokens: usize, k: usize) -> Routes {
    let mut idx = Vec::with_capacity(tokens * k);
    let mut base: Vec<i32> = (0..k as i32).collect();
    for _ in 0..tokens {
        base.shuffle(r);
        idx.extend_from_slice(&base);
    }
    let weights = (0..tokens * k).map(|i| (i % 7) as f32 * 0.125).collect();
    Routes {
        tokens,
        top_k: k,
        idx,
        weights,
    }
}

/// `f(chunk index, range)` over `0..n` split in chunks, on all cores; results in order.
pub fn par_chunks<T: Send>(
    n: usize,
    chunk: usize,
    f: impl Fn(std::ops::Range<usize>) -> T + Sync,
) -> Vec<T> {
    let ranges: Vec<_> = (0..n.div_ceil(chunk))
        .map(|i| i * chunk..((i + 1) * chunk).min(n))
        .collect();
    let threads = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(4)
        .min(ranges.len().max(1));
    let next = std::sync::atomic::AtomicUsize::new(0);
    let out: std::sync::Mutex<Vec<(usize, T)>> = std::sync::Mutex::new(Vec::new());
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| {
                loop {
                    let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    let Some(r) = ranges.get(i) else { break };
                    let v = f(r.clone());
                    out.lock().unwrap().push((i, v));
                }
            });
        }
    });
    let mut v = out.into_inner().unwrap();
    v.sort_by_key(|(i, _)| *i);
    v.into_iter().map(|(_, x)| x).collect()
}

/// The bits of a bf16 slice (NaN-safe equality).
pub fn bf16_bits(v: &[half::bf16]) -> Vec<u16> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Random bf16 values in `[-scale, scale)`.
pub fn random_bf16(r: &mut ChaCha8Rng, n: usize, scale: f32) -> Vec<half::bf16> {
    (0..n)
        .map(|_| half::bf16::from_f32(r.gen_range(-1.0f32..1.0) * scale))
        .collect()
}

/// Plants an offence of exactly `class` at (token, slot) of a table whose slots before it are
/// valid; false when it cannot be planted there (a duplicate needs an earlier unmasked slot,
/// a dummy unowned experts). A slot that is unmasked for the offence gets a finite weight
/// unless the offence is the weight, so that its class is the planted one.
pub fn plant(
    r: &mut ChaCha8Rng,
    routes: &mut Routes,
    rules: &RouteRules,
    class: u32,
    token: usize,
    slot: usize,
) -> bool {
    let k = routes.top_k;
    let i = token * k + slot;
    let (e, o) = (rules.experts as i32, rules.owned as i32);
    match class {
        route_class::NEGATIVE => routes.idx[i] = r.gen_range(i32::MIN..MASKED),
        route_class::WIDE => routes.idx[i] = r.gen_range(e..e.saturating_add(1000)),
        route_class::DUMMY if o < e => routes.idx[i] = r.gen_range(o..e),
        route_class::NON_FINITE_WEIGHT => {
            if routes.idx[i] == MASKED {
                routes.idx[i] = r.gen_range(0..o);
            }
            routes.weights[i] = [f32::NAN, f32::INFINITY, f32::NEG_INFINITY][r.gen_range(0..3)];
        }
        route_class::DUPLICATE if slot > 0 => {
            let earlier: Vec<usize> = (0..slot)
                .filter(|&j| routes.idx[token * k + j] != MASKED)
                .collect();
            if earlier.is_empty() {
                return false;
            }
            let j = earlier[r.gen_range(0..earlier.len())];
            routes.idx[i] = routes.idx[token * k + j];
            if !routes.weights[i].is_finite() {
                routes.weights[i] = 0.5;
            }
        }
        _ => return false,
    }
    true
}
