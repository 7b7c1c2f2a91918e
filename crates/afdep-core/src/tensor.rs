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

/// `n` bf16 values uniform in `[-scale, scale)`.
pub fn uniform_bf16(n: usize, scale: f32, seed: u64, stream: u64) -> Vec<bf16> {
    let mut r = rng(seed, stream);
    (0..n)
        .map(|_| bf16::from_f32(r.gen_range(-1.0f32..1.0) * scale))
        .collect()
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
    fn seeded_values_repeat_and_streams_differ() {
        let a = uniform_bf16(64, 1.0, 7, 0);
        assert_eq!(a, uniform_bf16(64, 1.0, 7, 0));
        assert_ne!(a, uniform_bf16(64, 1.0, 7, 1));
        assert!(a.iter().all(|v| v.to_f32().abs() <= 1.0));
    }

    #[test]
    fn rel_err_catches_nan() {
        let a = to_bf16(&[1.0, 2.0]);
        let b = to_bf16(&[1.0, f32::NAN]);
        assert!(max_rel_err(&a, &b).is_infinite());
        assert_eq!(max_rel_err(&a, &a), 0.0);
    }
}
