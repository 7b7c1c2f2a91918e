//! bf16 helpers and seeded random inputs.
//!
//! Every tensor in afdep is a flat, row-major `Vec<bf16>` (storage), with computation in f32.
//! Random inputs come from ChaCha8 seeded by a `u64`, so every backend and every peer script
//! can regenerate the same values.

use half::bf16;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// Converts bf16 storage to f32 for computation.
pub fn to_f32(v: &[bf16]) -> Vec<f32> {
    v.iter().map(|x| x.to_f32()).collect()
}

/// Rounds f32 values to bf16 storage (round to nearest even).
pub fn to_bf16(v: &[f32]) -> Vec<bf16> {
    v.iter().map(|&x| bf16::from_f32(x)).collect()
}

/// A deterministic random generator for stream `stream` of seed `seed`.
pub fn rng(seed: u64, stream: u64) -> ChaCha8Rng {
    let mut r = ChaCha8Rng::seed_from_u64(seed);
    r.set_stream(stream);
    r
}

/// Values drawn per task of [`uniform_bf16`] (each task seeks its generator to its first one).
const DRAW_CHUNK: usize = 1 << 20;

/// `n` bf16 values uniform in `[-scale, scale)`.
///
/// Value `i` is drawn from the 32-bit word `i` of the generator [`rng`]`(seed, stream)` (one
/// word per value: `gen_range` over `-1.0..1.0` in f32 never rejects), so chunks of
/// `DRAW_CHUNK` values are drawn in parallel, each generator seeked to its chunk's first
/// word, and the result is the sequential draw's, bit for bit (a test checks it).
pub fn uniform_bf16(n: usize, scale: f32, seed: u64, stream: u64) -> Vec<bf16> {
    use rayon::prelude::*;
    let mut out = vec![bf16::ZERO; n];
    out.par_chunks_mut(DRAW_CHUNK)
        .enumerate()
        .for_each(|(c, chunk)| {
            let mut r = rng(seed, stream);
            r.set_word_pos((c * DRAW_CHUNK) as u128);
            for v in chunk {
                *v = bf16::from_f32(r.gen_range(-1.0f32..1.0) * scale);
            }
        });
    out
}

/// Rewrites the 128-channel groups of `x` (rows of `hidden`, a multiple of 128) into inputs
/// that exercise every corner of the fp8 quantisation ([`crate::fp8`]): group `g` of token `t`
/// becomes kind `(t + g + seed) % 6`: 0 keeps its values; 1 zeros of both signs; 2 bf16
/// subnormals; 3 huge values (×1e36, so that test experts scaling rows by up to 64 stay
/// finite); 4 one ±1000 spike among values 100× smaller than the input's (e4m3 subnormals and
/// zeros); 5 scale exactly 1 (one 448) with every other value an e4m3 code or an exact
/// midpoint between two codes (the encoder's ties), signs random.
pub fn fp8_edge_groups(x: &mut [bf16], hidden: usize, seed: u64) {
    use crate::fp8::{GROUP, e4m3_to_f32};
    assert_eq!(hidden % GROUP, 0, "fp8 rows are whole groups of 128");
    let mut r = rng(seed, 0xf8);
    for (i, grp) in x.chunks_mut(GROUP).enumerate() {
        let (t, g) = ((i * GROUP / hidden) as u64, (i % (hidden / GROUP)) as u64);
        match (t + g + seed) % 6 {
            0 => {}
            1 => {
                for v in grp.iter_mut() {
                    *v = if r.gen_bool(0.5) {
                        bf16::ZERO
                    } else {
                        bf16::NEG_ZERO
                    };
                }
            }
            2 => {
                for v in grp.iter_mut() {
                    *v = bf16::from_bits(r.r#gen::<u16>() & 0x807f);
                }
            }
            3 => {
                for v in grp.iter_mut() {
                    *v = bf16::from_f32(v.to_f32() * 1e36);
                }
            }
            4 => {
                for v in grp.iter_mut() {
                    *v = bf16::from_f32(v.to_f32() * 0.01);
                }
                let at = r.gen_range(0..GROUP);
                grp[at] = bf16::from_f32(if r.gen_bool(0.5) { 1000.0 } else { -1000.0 });
            }
            _ => {
                for v in grp.iter_mut() {
                    let c = r.gen_range(0u8..0x7e);
                    let (lo, hi) = (e4m3_to_f32(c), e4m3_to_f32(c + 1));
                    // at most 5 significant bits: exact in bf16
                    let m = if r.gen_bool(0.7) { (lo + hi) / 2.0 } else { lo };
                    *v = bf16::from_f32(if r.gen_bool(0.5) { -m } else { m });
                }
                grp[r.gen_range(0..GROUP)] = bf16::from_f32(448.0);
            }
        }
    }
}

/// Max |a - b| / max |b| over all elements (the error definition of benchmark rows);
/// infinite if either side holds a NaN, 0 when both are all zero.
pub fn max_rel_err(a: &[bf16], b: &[bf16]) -> f64 {
    assert_eq!(a.len(), b.len(), "max_rel_err: length mismatch");
    let mut num = 0f64;
    let mut den = 0f64;
    for (x, y) in a.iter().zip(b) {
        let (x, y) = (x.to_f64(), y.to_f64());
        if x.is_nan() || y.is_nan() {
            return f64::INFINITY;
        }
        num = num.max((x - y).abs());
        den = den.max(y.abs());
    }
    if num == 0.0 { 0.0 } else { num / den }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parallel_draws_are_the_sequential_draw() {
        let n = 2 * DRAW_CHUNK + 12_345;
        let mut r = rng(11, 4);
        let want: Vec<bf16> = (0..n)
            .map(|_| bf16::from_f32(r.gen_range(-1.0f32..1.0) * 0.5))
            .collect();
        assert_eq!(uniform_bf16(n, 0.5, 11, 4), want);
        assert!(uniform_bf16(0, 1.0, 1, 1).is_empty());
    }

    #[test]
    fn seeded_values_repeat_and_streams_differ() {
        let a = uniform_bf16(64, 1.0, 7, 0);
        assert_eq!(a, uniform_bf16(64, 1.0, 7, 0));
        assert_ne!(a, uniform_bf16(64, 1.0, 7, 1));
        assert!(a.iter().all(|v| v.to_f32().abs() <= 1.0));
    }

    #[test]
    fn fp8_edge_groups_hit_zeros_ties_and_subnormal_codes() {
        use crate::fp8::{E4M3_MAX, QuantisedRows, e4m3_to_f32};
        let mut x = uniform_bf16(6 * 256, 1.0, 3, 0);
        fp8_edge_groups(&mut x, 256, 0);
        let q = QuantisedRows::of(&x, 256);
        assert!(q.scales.contains(&1.0), "a zero or tied group");
        assert!(q.q.contains(&0x80), "a negative zero code");
        assert!(
            q.q.iter().any(|&c| c & 0x78 == 0 && c & 7 != 0),
            "a subnormal code"
        );
        // the tied groups: scale 1, every value a code or a midpoint, encoded to nearest even
        let mut ties = 0;
        for (g, grp) in x.chunks(128).enumerate() {
            if q.scales[g] == 1.0 && grp.iter().any(|v| v.to_f32() == E4M3_MAX) {
                for (c, v) in grp.iter().enumerate() {
                    let code = q.q[g * 128 + c];
                    if e4m3_to_f32(code) != v.to_f32() {
                        ties += 1;
                        assert_eq!(code & 1, 0, "a tie goes to the even code");
                    }
                }
            }
        }
        assert!(ties > 100, "{ties} ties");
        assert!(x.iter().all(|v| v.is_finite()));
    }

    #[test]
    fn rel_err_catches_nan() {
        let a = to_bf16(&[1.0, 2.0]);
        let b = to_bf16(&[1.0, f32::NAN]);
        assert!(max_rel_err(&a, &b).is_infinite());
        assert_eq!(max_rel_err(&a, &a), 0.0);
    }
}
