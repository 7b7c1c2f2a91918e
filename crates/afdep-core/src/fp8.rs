//! fp8 payloads of the AFD exchange: the e4m3 format, its bit-exact host encoder and decoder,
//! and the quantisation of token rows (docs/design.md, "fp8 payloads").
//!
//! # The e4m3 format (OCP FP8 E4M3, "fn": finite, with NaN)
//!
//! One byte `s eeee mmm`: sign, a 4-bit exponent of bias 7, a 3-bit mantissa. Codes with
//! `eeee = 0` are subnormal, `m · 2^-9`; the others are `(1 + m/8) · 2^(e-7)`. There is no
//! infinity: `s 1111 111` (0x7f, 0xff) is NaN, so the largest finite magnitude is
//! `s 1111 110` = 448 ([`E4M3_MAX`]). 0x80 is -0.
//!
//! [`e4m3_from_f32`] rounds to nearest, ties to even (the even code: its last bit is the
//! mantissa's), and saturates: every magnitude at or above 448, infinity included, gives ±448;
//! NaN gives 0x7f; the sign of a value that rounds to zero is kept (0x80). This is the PTX
//! instruction `cvt.rn.satfinite.e4m3x2.f32` value for value, which the device quantiser uses
//! (`cuda/common/fp8.cuh`; the GPU test `gpu_fp8` compares the two on every code, every
//! tie and many random values).
//!
//! # Quantisation of a row (per token, per group of [`GROUP`] = 128 channels)
//!
//! For a token row `x` (`hidden` bf16, `hidden % 128 == 0`, checked by
//! [`ExchangeConfig::validate`](crate::ExchangeConfig::validate)) and each group `g` of
//! channels `128 g .. 128 g + 128`:
//!
//! 1. `amax = max |x_c|` over the group, in f32 (every bf16 is exact in f32);
//! 2. `scale = amax / 448` (one f32 division, round to nearest even), except `scale = 1.0`
//!    when `amax = 0` (an all-zero group; its codes are then ±0 and dequantise to ±0);
//! 3. `q_c = e4m3_from_f32(x_c / scale)` (one f32 division, round to nearest even).
//!
//! A row travels as its 128-channel-aligned codes and `hidden / 128` f32 scales.
//! `scale` is never zero or subnormal-to-zero: the smallest non-zero bf16 is 2^-133 and
//! 2^-133 / 448 is still a positive f32; `|x_c / scale|` stays near 448 at most, and values
//! past 448 saturate.
//!
//! **Non-finite values** cannot be quantised (their scale would be NaN or infinite and spoil
//! the whole group), so they are rejected: a round whose source holds a NaN or an infinity in
//! a row that travels (a token with at least one unmasked slot) fails on every rank with
//! [`RouteError::NonFinitePayload`] naming the rank, the token, the first offending channel and
//! the value, as a rejected route does (before anything moves). Rows of tokens whose slots are
//! all masked do not travel and are not checked. bf16 payloads carry any value unchanged.
//!
//! # Dequantisation (what the experts consume)
//!
//! `y_c = bf16(f32(q_c) · scale_g)`: the code widened exactly to f32, one f32 multiplication
//! rounded to nearest even (no fused operation), then one rounding to bf16 (nearest even).
//! Host ([`dequantise`]) and device (`afdep_fp8_dequant` in `cuda/common/fp8.cuh`:
//! `__fmul_rn`, then `__float2bfloat16_rn`) compute the same bits.

use half::bf16;

use crate::error::RouteError;

/// Channels per scale.
pub const GROUP: usize = 128;

/// The largest finite e4m3 magnitude.
pub const E4M3_MAX: f32 = 448.0;

/// The NaN code [`e4m3_from_f32`] gives for NaN (0x7f; 0xff is NaN too).
pub const E4M3_NAN: u8 = 0x7f;

/// The code of +448.
pub const E4M3_MAX_CODE: u8 = 0x7e;

/// The value of an e4m3 code (exact in f32; NaN for 0x7f and 0xff).
pub fn e4m3_to_f32(code: u8) -> f32 {
    let e = (code >> 3) & 0xf;
    let m = code & 7;
    if e == 0xf && m == 7 {
        return f32::NAN;
    }
    let mag = if e == 0 {
        // m · 2^-9
        f32::from(m) * pow2(-9)
    } else {
        // (8 + m) · 2^(e - 10)
        f32::from(8 + m) * pow2(i32::from(e) - 10)
    };
    if code & 0x80 != 0 { -mag } else { mag }
}

/// `2^e` for `-126 <= e <= 127` (exact).
fn pow2(e: i32) -> f32 {
    debug_assert!((-126..=127).contains(&e));
    f32::from_bits(((e + 127) as u32) << 23)
}

/// The e4m3 code of `v`: round to nearest, ties to even, saturating to ±448 (infinities
/// included), NaN to [`E4M3_NAN`], the sign of zero kept. See the [module docs](self).
pub fn e4m3_from_f32(v: f32) -> u8 {
    if v.is_nan() {
        return E4M3_NAN;
    }
    let sign: u8 = if v.is_sign_negative() { 0x80 } else { 0 };
    let a = v.abs();
    if a >= E4M3_MAX {
        return sign | E4M3_MAX_CODE;
    }
    let mag = if a < pow2(-6) {
        // subnormal range (and zero): a · 2^9 is exact; 8 rounds up into the first normal
        // code, 0x08, which the plain integer gives too
        (a * pow2(9)).round_ties_even() as u8
    } else {
        // a = 2^e · f with f in [1, 2), e in -6..=8; f - 1 and (f - 1) · 8 are exact
        let e = ((a.to_bits() >> 23) & 0xff) as i32 - 127;
        let f = a * pow2(-e);
        let m = ((f - 1.0) * 8.0).round_ties_even() as u8; // 0..=8: 8 carries into e + 1
        (((e + 7) as u8) << 3) + m
    };
    sign | mag
}

/// The scale of a group whose largest magnitude is `amax` (finite, non-negative):
/// `amax / 448`, or 1.0 for an all-zero group.
pub fn group_scale(amax: f32) -> f32 {
    if amax == 0.0 { 1.0 } else { amax / E4M3_MAX }
}

/// Scales per row of `hidden` channels.
pub fn scales_per_row(hidden: usize) -> usize {
    hidden / GROUP
}

/// Quantises one row (`x.len()` a multiple of [`GROUP`], every value finite) into `q`
/// (`x.len()` codes) and `scales` (`x.len() / 128`).
pub fn quantise_row(x: &[bf16], q: &mut [u8], scales: &mut [f32]) {
    assert_eq!(
        x.len() % GROUP,
        0,
        "fp8 rows are whole groups of 128 channels"
    );
    assert_eq!(q.len(), x.len());
    assert_eq!(scales.len(), x.len() / GROUP);
    for ((xs, qs), s) in x
        .chunks(GROUP)
        .zip(q.chunks_mut(GROUP))
        .zip(scales.iter_mut())
    {
        let amax = xs.iter().fold(0f32, |m, v| m.max(v.to_f32().abs()));
        let scale = group_scale(amax);
        *s = scale;
        for (o, v) in qs.iter_mut().zip(xs) {
            *o = e4m3_from_f32(v.to_f32() / scale);
        }
    }
}

/// The dequantised value of a code with its group's scale: `bf16(f32(q) · scale)`.
pub fn dequantise(q: u8, scale: f32) -> bf16 {
    bf16::from_f32(e4m3_to_f32(q) * scale)
}

/// Dequantises one row (`q.len()` codes, `q.len() / 128` scales) into `out`.
pub fn dequantise_row(q: &[u8], scales: &[f32], out: &mut [bf16]) {
    assert_eq!(q.len() % GROUP, 0);
    assert_eq!(scales.len(), q.len() / GROUP);
    assert_eq!(out.len(), q.len());
    for ((qs, os), &s) in q.chunks(GROUP).zip(out.chunks_mut(GROUP)).zip(scales) {
        for (o, &c) in os.iter_mut().zip(qs) {
            *o = dequantise(c, s);
        }
    }
}

/// A whole input quantised: `tokens × hidden` codes, `tokens × hidden/128` scales, and the
/// dequantised rows.
#[derive(Debug, Clone, PartialEq)]
pub struct QuantisedRows {
    /// Codes, `tokens × hidden`.
    pub q: Vec<u8>,
    /// Scales, `tokens × hidden / 128`.
    pub scales: Vec<f32>,
    /// Dequantised rows, `tokens × hidden`.
    pub dequant: Vec<bf16>,
}

impl QuantisedRows {
    /// Quantises every row of `x` (`x.len()` a multiple of `hidden`, `hidden` of [`GROUP`];
    /// every value finite: check with [`first_non_finite`] first).
    pub fn of(x: &[bf16], hidden: usize) -> QuantisedRows {
        let tokens = x.len() / hidden.max(1);
        let g = scales_per_row(hidden);
        let mut q = vec![0u8; x.len()];
        let mut scales = vec![0f32; tokens * g];
        let mut dequant = vec![bf16::ZERO; x.len()];
        for t in 0..tokens {
            let r = t * hidden..(t + 1) * hidden;
            quantise_row(
                &x[r.clone()],
                &mut q[r.clone()],
                &mut scales[t * g..(t + 1) * g],
            );
            dequantise_row(&q[r.clone()], &scales[t * g..(t + 1) * g], &mut dequant[r]);
        }
        QuantisedRows { q, scales, dequant }
    }
}

/// The first non-finite value of a row that travels: tokens ascending, then channels
/// ascending, over the tokens for which `travels(token)` holds; the error names `rank`.
pub fn first_non_finite(
    x: &[bf16],
    hidden: usize,
    rank: usize,
    travels: impl Fn(usize) -> bool,
) -> Result<(), RouteError> {
    if hidden == 0 {
        return Ok(());
    }
    for (token, row) in x.chunks(hidden).enumerate() {
        if !travels(token) {
            continue;
        }
        if let Some(channel) = row.iter().position(|v| !v.is_finite()) {
            return Err(RouteError::NonFinitePayload {
                rank,
                token,
                channel,
                value: row[channel].to_f32(),
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The 127 non-negative finite magnitudes by code, from first principles.
    fn table() -> Vec<f64> {
        (0u8..=0x7e)
            .map(|c| {
                let e = i32::from(c >> 3);
                let m = f64::from(c & 7);
                if e == 0 {
                    m / 512.0
                } else {
                    (1.0 + m / 8.0) * 2f64.powi(e - 7)
                }
            })
            .collect()
    }

    /// The reference encoder: the nearest magnitude by brute force (ties to the even code),
    /// saturating at 448.
    fn brute(v: f32) -> u8 {
        if v.is_nan() {
            return E4M3_NAN;
        }
        let sign = if v.is_sign_negative() { 0x80 } else { 0 };
        let a = f64::from(v.abs());
        let t = table();
        let mut best = 0usize;
        for (c, &m) in t.iter().enumerate() {
            let d = (m - a).abs();
            let bd = (t[best] - a).abs();
            if d < bd || (d == bd && c % 2 == 0) {
                best = c;
            }
        }
        sign | best as u8
    }

    #[test]
    fn every_code_decodes_as_specified() {
        let t = table();
        for c in 0u8..=255 {
            let v = e4m3_to_f32(c);
            let mag = c & 0x7f;
            if mag == 0x7f {
                assert!(v.is_nan(), "{c:#04x}");
                continue;
            }
            assert_eq!(f64::from(v.abs()), t[mag as usize], "{c:#04x}");
            assert_eq!(v.is_sign_negative(), c & 0x80 != 0, "{c:#04x}");
        }
        assert_eq!(e4m3_to_f32(0x7e), 448.0);
        assert_eq!(e4m3_to_f32(0xfe), -448.0);
        assert_eq!(e4m3_to_f32(0x08), 2f32.powi(-6));
        assert_eq!(e4m3_to_f32(0x01), 2f32.powi(-9));
        assert_eq!(e4m3_to_f32(0x80).to_bits(), (-0f32).to_bits());
    }

    #[test]
    fn every_finite_code_round_trips() {
        for c in 0u8..=255 {
            if c & 0x7f == 0x7f {
                assert_eq!(e4m3_from_f32(e4m3_to_f32(c)), E4M3_NAN);
                continue;
            }
            assert_eq!(e4m3_from_f32(e4m3_to_f32(c)), c, "{c:#04x}");
        }
    }

    #[test]
    fn ties_go_to_the_even_code_and_large_values_saturate() {
        let t = table();
        // every midpoint between neighbours (exact in f32: 5 significant bits at most)
        for c in 0..0x7e {
            let mid = ((t[c] + t[c + 1]) / 2.0) as f32;
            assert_eq!(f64::from(mid), (t[c] + t[c + 1]) / 2.0);
            let even = if c % 2 == 0 { c } else { c + 1 } as u8;
            assert_eq!(e4m3_from_f32(mid), even, "midpoint after {c:#04x}");
            assert_eq!(e4m3_from_f32(-mid), 0x80 | even, "-midpoint after {c:#04x}");
            // just off the midpoint, either way
            let below = f32::from_bits(mid.to_bits() - 1);
            let above = f32::from_bits(mid.to_bits() + 1);
            assert_eq!(e4m3_from_f32(below), c as u8);
            assert_eq!(e4m3_from_f32(above), c as u8 + 1);
        }
        for v in [
            448.0f32,
            449.0,
            463.99,
            464.0,
            480.0,
            1e30,
            f32::MAX,
            f32::INFINITY,
        ] {
            assert_eq!(e4m3_from_f32(v), 0x7e, "{v}");
            assert_eq!(e4m3_from_f32(-v), 0xfe, "{v}");
        }
        assert_eq!(e4m3_from_f32(f32::NAN), E4M3_NAN);
        assert_eq!(e4m3_from_f32(-0.0), 0x80);
        assert_eq!(e4m3_from_f32(0.0), 0x00);
        // below half the smallest subnormal: a signed zero; exactly half: the even zero
        assert_eq!(e4m3_from_f32(2f32.powi(-10)), 0x00);
        assert_eq!(e4m3_from_f32(-2f32.powi(-10)), 0x80);
        assert_eq!(e4m3_from_f32(-1e-40), 0x80);
        assert_eq!(e4m3_from_f32(f32::from_bits(1)), 0x00);
    }

    proptest! {
        #[test]
        fn encoder_equals_brute_force(bits in any::<u32>()) {
            let v = f32::from_bits(bits);
            prop_assert_eq!(e4m3_from_f32(v), brute(v), "{}", v);
        }

        #[test]
        fn encoder_equals_brute_force_in_range(v in -500f32..500.0) {
            prop_assert_eq!(e4m3_from_f32(v), brute(v));
        }

        #[test]
        fn encoder_equals_brute_force_near_zero(v in -0.05f32..0.05) {
            prop_assert_eq!(e4m3_from_f32(v), brute(v));
        }

        /// decode(encode(v)) is the nearest code's value, within half a step.
        #[test]
        fn round_trip_error_is_half_a_step(v in -448f32..448.0) {
            let c = e4m3_from_f32(v);
            let back = e4m3_to_f32(c);
            let step = if v.abs() < 2f32.powi(-6) {
                2f32.powi(-9)
            } else {
                2f32.powi(((v.abs().to_bits() >> 23) & 0xff) as i32 - 127 - 3)
            };
            prop_assert!((back - v).abs() <= step / 2.0, "{} -> {:#04x} = {}", v, c, back);
        }

        /// Quantising a row and dequantising it stays within 1/16 of the group's amax, every
        /// scale is amax / 448 (or 1 for a zero group), and the group's largest magnitude
        /// encodes as ±448.
        #[test]
        fn rows_round_trip(vals in prop::collection::vec(-1e4f32..1e4, 256), zero_group in any::<bool>()) {
            let mut x: Vec<bf16> = vals.iter().map(|&v| bf16::from_f32(v)).collect();
            if zero_group {
                x[128..].iter_mut().for_each(|v| *v = bf16::ZERO);
            }
            let r = QuantisedRows::of(&x, 256);
            for g in 0..2 {
                let xs = &x[g * 128..(g + 1) * 128];
                let amax = xs.iter().fold(0f32, |m, v| m.max(v.to_f32().abs()));
                prop_assert_eq!(r.scales[g], group_scale(amax));
                for (c, xv) in xs.iter().enumerate() {
                    let i = g * 128 + c;
                    let err = (r.dequant[i].to_f32() - x[i].to_f32()).abs();
                    prop_assert!(err <= amax / 16.0 + 1e-30, "ch {}: {} vs {}", i, r.dequant[i], x[i]);
                    if xv.to_f32().abs() == amax && amax > 0.0 {
                        prop_assert_eq!(r.q[i] & 0x7f, E4M3_MAX_CODE);
                    }
                }
            }
        }
    }

    #[test]
    fn zero_groups_keep_the_sign_of_zero() {
        let mut x = vec![bf16::ZERO; 128];
        x[3] = bf16::NEG_ZERO;
        let r = QuantisedRows::of(&x, 128);
        assert_eq!(r.scales, vec![1.0]);
        assert_eq!(r.q[3], 0x80);
        assert_eq!(r.dequant[3].to_bits(), bf16::NEG_ZERO.to_bits());
        assert!(r.q.iter().enumerate().all(|(i, &c)| c == 0 || i == 3));
    }

    #[test]
    fn tiny_and_huge_groups_stay_finite() {
        // the smallest bf16 subnormal as the group's amax, and the largest finite bf16
        for v in [bf16::from_bits(1), bf16::MAX, bf16::MIN_POSITIVE] {
            let mut x = vec![bf16::ZERO; 128];
            x[0] = v;
            x[1] = -v;
            let r = QuantisedRows::of(&x, 128);
            assert!(r.scales[0] > 0.0 && r.scales[0].is_finite(), "{v}");
            assert_eq!(r.q[0], 0x7e, "{v}");
            assert_eq!(r.q[1], 0xfe, "{v}");
            assert!(r.dequant.iter().all(|d| d.is_finite()), "{v}");
        }
    }

    #[test]
    fn non_finite_values_are_named() {
        let mut x = vec![bf16::ONE; 3 * 128];
        x[128 + 5] = bf16::NAN;
        x[2 * 128 + 1] = bf16::INFINITY;
        match first_non_finite(&x, 128, 2, |_| true) {
            Err(RouteError::NonFinitePayload {
                rank: 2,
                token: 1,
                channel: 5,
                value,
            }) => assert!(value.is_nan()),
            other => panic!("{other:?}"),
        }
        assert_eq!(
            first_non_finite(&x, 128, 0, |t| t != 1),
            Err(RouteError::NonFinitePayload {
                rank: 0,
                token: 2,
                channel: 1,
                value: f32::INFINITY
            })
        );
        assert_eq!(first_non_finite(&x, 128, 0, |t| t == 0), Ok(()));
    }
}
