//! How GPU results are compared with a reference: the error metric of the record's error
//! columns and the tolerances of the GPU layer, derived from its bf16 roundings.
//!
//! # The metric
//! [`max_rel_err`]`(a, b) = max_i |a_i − b_i| / max_i |b_i|` over a whole tensor (normwise,
//! relative to the reference `b`'s largest magnitude), computed in f64. A NaN or infinity in
//! `a` gives `+∞` (NaN never passes); two all-zero tensors give 0; a nonzero `a` against an
//! all-zero `b` gives `+∞`.
//!
//! # The tolerances
//! The oracle keeps every intermediate in f32 and casts once; the GPU layer stores some
//! intermediates in bf16 (listed in [`crate::layer`]). One bf16 rounding changes a value by at
//! most `u = 2^-9` relative. Through a sum of many terms of random sign, independent relative
//! errors of at most `u` per term give an error whose size relative to the sum is about `u`
//! (not `u` times the number of terms), so `r` roundings on a path contribute about `r·u` in
//! the normwise metric. Both sides' final casts to bf16 add up to one bf16 ulp of the largest
//! element, `2u`. With a factor 2 for the tails of non-Gaussian data the tolerance of a path
//! with `r` roundings is `2·(r·u + 2u) = (r + 2)·2^-8`. The paths:
//!
//! | tensor | roundings on the path | tolerance |
//! |---|---|---|
//! | `out` | `h`, `y` (or `w·y`) | 4·2^-8 ≈ 0.0156 |
//! | `dx` | `a`/`b`, `[da, db]`, `dx_k`, `dlogits` | 6·2^-8 ≈ 0.0234 |
//! | weight gradients | `a`/`b`, `[da, db]` or `w·h`, `dlogits` | 5·2^-8 ≈ 0.0195 |
//!
//! f32 accumulation in a different order adds about `k·2^-24` for `k` terms, below `2^-12`
//! for every size here, and is covered by the factor 2.

use half::bf16;

/// `max |a − b| / max |b|` (see the module); NaN or infinity in `a` gives `+∞`.
pub fn max_rel_err(a: &[bf16], b: &[bf16]) -> f64 {
    assert_eq!(a.len(), b.len(), "compared tensors differ in length");
    let mut diff = 0f64;
    let mut scale = 0f64;
    for (&x, &y) in a.iter().zip(b) {
        let (x, y) = (f64::from(x.to_f32()), f64::from(y.to_f32()));
        if !x.is_finite() {
            return f64::INFINITY;
        }
        diff = diff.max((x - y).abs());
        scale = scale.max(y.abs());
    }
    if diff == 0.0 {
        0.0
    } else if scale == 0.0 {
        f64::INFINITY
    } else {
        diff / scale
    }
}

/// The tolerance of a path with `roundings` bf16 roundings the reference does not make.
pub fn tolerance(roundings: u32) -> f64 {
    f64::from(roundings + 2) / 256.0
}

/// Tolerance of the layer output.
pub const OUT_TOL: f64 = 4.0 / 256.0;
/// Tolerance of dx.
pub const DX_TOL: f64 = 6.0 / 256.0;
/// Tolerance of every weight gradient.
pub const GRAD_TOL: f64 = 5.0 / 256.0;

#[cfg(test)]
mod tests {
    use super::*;

    fn v(x: &[f32]) -> Vec<bf16> {
        x.iter().map(|&f| bf16::from_f32(f)).collect()
    }

    #[test]
    fn metric_is_normwise_and_refuses_nan() {
        assert_eq!(max_rel_err(&v(&[1.0, 2.0]), &v(&[1.0, 2.0])), 0.0);
        assert_eq!(max_rel_err(&v(&[1.5, 4.0]), &v(&[1.0, 4.0])), 0.125);
        assert_eq!(
            max_rel_err(&v(&[f32::NAN, 4.0]), &v(&[1.0, 4.0])),
            f64::INFINITY
        );
        assert_eq!(max_rel_err(&v(&[0.0, 0.0]), &v(&[0.0, 0.0])), 0.0);
        assert_eq!(
            max_rel_err(&v(&[1e-3, 0.0]), &v(&[0.0, 0.0])),
            f64::INFINITY
        );
    }

    #[test]
    fn tolerances_follow_the_table() {
        assert_eq!(tolerance(2), OUT_TOL);
        assert_eq!(tolerance(4), DX_TOL);
        assert_eq!(tolerance(3), GRAD_TOL);
    }
}
