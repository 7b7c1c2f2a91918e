//! The device fp8 conversions (`cuda/common/fp8.cuh`, the functions the fused exchange's
//! dispatch and epilogue use) against the host's (`afdep_core::fp8`), bit for bit: every one of
//! the 256 codes decoded; the encoder on every code's value, every midpoint between neighbours
//! (the ties) and one ulp either side, ±448 and the values that saturate, infinities, zeros of
//! both signs, f32 subnormals, and millions of random bit patterns and values; the row quantiser
//! and dequantiser on rows with zero, subnormal, huge, spiked and tied groups at hidden 128,
//! 384, 2048 and 7168.
//!
//! NaN inputs are outside the quantisation's contract (rows with one are rejected before they
//! travel); the encoder test only requires a NaN code (0x7f or 0xff) for them.

mod common;

use afdep_core::bf16;
use afdep_core::fp8::{self, QuantisedRows, e4m3_from_f32, e4m3_to_f32};
use afdep_core::tensor::{fp8_edge_groups, rng, uniform_bf16};
use afdep_kernels::GpuContext;
use afdep_kernels::ops::fp8::{Fp8Rows, decode_e4m3, encode_e4m3, quantise_rows};
use afdep_kernels::ops::{download, poison, zeros};
use rand::Rng;

fn device_codes(ctx: &GpuContext, v: &[f32]) -> Vec<u8> {
    let d = ctx.stream().clone_htod(v).unwrap();
    let mut out = zeros::<u8>(ctx, v.len()).unwrap();
    poison(ctx, &mut out).unwrap();
    encode_e4m3(ctx, &d, &mut out, v.len()).unwrap();
    download(ctx, &out).unwrap()
}

#[test]
fn every_code_decodes_like_the_host() {
    let Some(ctx) = common::gpu() else {
        return;
    };
    let codes: Vec<u8> = (0..=255).collect();
    let d = ctx.stream().clone_htod(&codes).unwrap();
    let mut out = zeros::<f32>(&ctx, 256).unwrap();
    poison(&ctx, &mut out).unwrap();
    decode_e4m3(&ctx, &d, &mut out, 256).unwrap();
    let got = download(&ctx, &out).unwrap();
    for (c, g) in codes.iter().zip(&got) {
        let want = e4m3_to_f32(*c);
        if want.is_nan() {
            assert!(g.is_nan(), "code {c:#04x}: {g}");
        } else {
            assert_eq!(g.to_bits(), want.to_bits(), "code {c:#04x}: {g} vs {want}");
        }
    }
}

/// Every value the encoder must get exactly right by construction.
fn edge_values() -> Vec<f32> {
    let mut v = Vec::new();
    for c in 0u8..=0x7e {
        let a = e4m3_to_f32(c);
        v.push(a);
        if c < 0x7e {
            let b = e4m3_to_f32(c + 1);
            let mid = (a + b) / 2.0;
            v.push(mid);
            v.push(f32::from_bits(mid.to_bits() + 1));
            if mid > 0.0 {
                v.push(f32::from_bits(mid.to_bits() - 1));
            }
        }
    }
    // saturation, overflow to the would-be next binade, infinities
    v.extend([
        448.0,
        448.5,
        463.99,
        464.0,
        464.01,
        479.0,
        480.0,
        512.0,
        1e6,
        3.0e38,
        f32::MAX,
        f32::INFINITY,
    ]);
    // zero, f32 subnormals, and values around the smallest e4m3 subnormal (2^-9) and half of it
    v.extend([
        0.0,
        f32::from_bits(1),
        f32::from_bits(0x007f_ffff),
        f32::MIN_POSITIVE,
    ]);
    for e in -12..=-8 {
        let p = 2f32.powi(e);
        v.extend([
            p,
            f32::from_bits(p.to_bits() + 1),
            f32::from_bits(p.to_bits() - 1),
        ]);
        v.push(p * 1.5);
    }
    let neg: Vec<f32> = v.iter().map(|x| -x).collect();
    v.extend(neg);
    v
}

fn check_codes(values: &[f32], got: &[u8], what: &str) {
    let mut bad = Vec::new();
    for (x, g) in values.iter().zip(got) {
        if x.is_nan() {
            if g & 0x7f != 0x7f {
                bad.push(format!("NaN ({:#010x}) -> {g:#04x}", x.to_bits()));
            }
            continue;
        }
        let want = e4m3_from_f32(*x);
        if *g != want {
            bad.push(format!(
                "{x:e} ({:#010x}): device {g:#04x} host {want:#04x}",
                x.to_bits()
            ));
        }
    }
    assert!(
        bad.is_empty(),
        "{what}: {} of {} values differ, first: {:?}",
        bad.len(),
        values.len(),
        &bad[..bad.len().min(12)]
    );
}

#[test]
fn encoder_equals_the_host_on_every_edge() {
    let Some(ctx) = common::gpu() else {
        return;
    };
    let v = edge_values();
    assert!(v.len() > 1000);
    // the values in both byte positions of the instruction (pairs shifted by one), odd n
    let got = device_codes(&ctx, &v);
    check_codes(&v, &got, "edges");
    let got = device_codes(&ctx, &v[1..]);
    check_codes(&v[1..], &got, "edges shifted");
}

/// A generator of random test values.
type ValueGen = dyn FnMut(&mut rand_chacha::ChaCha8Rng) -> f32;

#[test]
fn encoder_equals_the_host_on_random_values() {
    let Some(ctx) = common::gpu() else {
        return;
    };
    let mut r = rng(11, 0);
    let n = 1 << 22;
    // any bit pattern (NaNs and infinities included), then values in e4m3's range, then near 0
    let sets: [(&str, Box<ValueGen>); 4] = [
        ("bits", Box::new(|r| f32::from_bits(r.r#gen::<u32>()))),
        ("range", Box::new(|r| r.gen_range(-470.0f32..470.0))),
        ("small", Box::new(|r| r.gen_range(-0.02f32..0.02))),
        (
            "binades",
            Box::new(|r| {
                let e = r.gen_range(-12i32..10);
                let m = r.gen_range(1.0f32..2.0);
                let s = if r.gen_bool(0.5) { -1.0 } else { 1.0 };
                s * m * 2f32.powi(e)
            }),
        ),
    ];
    for (what, mut gen_value) in sets {
        let v: Vec<f32> = (0..n + 1).map(|_| gen_value(&mut r)).collect();
        let got = device_codes(&ctx, &v);
        check_codes(&v, &got, what);
    }
}

/// The row-quantiser cases: `(hidden, rows, seed, x)` with edge groups, at 1 to 56 groups per
/// row (odd counts too: a half-warp without a group).
fn row_cases() -> Vec<(usize, usize, u64, Vec<bf16>)> {
    let mut cases = Vec::new();
    for (hidden, rows) in [
        (128usize, 1usize),
        (128, 37),
        (384, 29),
        (2048, 61),
        (7168, 23),
    ] {
        for seed in 0..3u64 {
            let mut x = uniform_bf16(rows * hidden, 2.0, seed, hidden as u64);
            fp8_edge_groups(&mut x, hidden, seed);
            if seed == 2 {
                // values near the largest bf16 too (the host test of the exchange avoids
                // them); only where they stay finite (a huge group times 1e37 would not)
                for v in x.iter_mut().step_by(7) {
                    if v.to_f32().abs() <= 16.0 {
                        *v = bf16::from_f32(v.to_f32() * 1e37);
                    }
                }
            }
            cases.push((hidden, rows, seed, x));
        }
    }
    cases
}

/// The cases reach what they are for (no GPU needed): finite rows, negative zero codes, unit
/// scales (zero or tied groups), subnormal codes, saturated codes.
#[test]
fn row_cases_cover_the_edges() {
    let mut covered = [false; 4];
    for (hidden, _, _, x) in row_cases() {
        assert!(x.iter().all(|v| v.is_finite()));
        let q = QuantisedRows::of(&x, hidden);
        covered[0] |= q.q.contains(&0x80);
        covered[1] |= q.scales.contains(&1.0);
        covered[2] |= q.q.iter().any(|&c| c & 0x78 == 0 && c & 7 != 0);
        covered[3] |= q.q.contains(&0xfe);
    }
    assert_eq!(covered, [true; 4]);
}

#[test]
fn row_quantiser_equals_the_host() {
    let Some(ctx) = common::gpu() else {
        return;
    };
    for (hidden, rows, seed, x) in row_cases() {
        let want = QuantisedRows::of(&x, hidden);
        let g = fp8::scales_per_row(hidden);
        let xd = ctx.stream().clone_htod(&x).unwrap();
        let mut q = zeros::<u8>(&ctx, rows * hidden).unwrap();
        let mut sc = zeros::<f32>(&ctx, rows * g).unwrap();
        let mut dq = zeros::<bf16>(&ctx, rows * hidden).unwrap();
        poison(&ctx, &mut q).unwrap();
        poison(&ctx, &mut sc).unwrap();
        poison(&ctx, &mut dq).unwrap();
        quantise_rows(
            &ctx,
            &xd,
            rows,
            hidden,
            Fp8Rows {
                q: &mut q,
                scales: &mut sc,
                dequant: &mut dq,
            },
        )
        .unwrap();
        let (q, sc, dq) = (
            download(&ctx, &q).unwrap(),
            download(&ctx, &sc).unwrap(),
            download(&ctx, &dq).unwrap(),
        );
        let sbits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        let bbits = |v: &[bf16]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        if let Some(i) = q.iter().zip(&want.q).position(|(a, b)| a != b) {
            panic!(
                "hidden {hidden} seed {seed}: code {i} (row {}, ch {}) device {:#04x} host \
                 {:#04x}, x {} scale {}",
                i / hidden,
                i % hidden,
                q[i],
                want.q[i],
                x[i],
                want.scales[i / 128]
            );
        }
        assert_eq!(
            sbits(&sc),
            sbits(&want.scales),
            "hidden {hidden} seed {seed}: scales"
        );
        assert_eq!(
            bbits(&dq),
            bbits(&want.dequant),
            "hidden {hidden} seed {seed}: dequant"
        );
    }
}
