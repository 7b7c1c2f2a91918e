//! Values with their magnitude of terms: a first-order bound on what roundings can change.
//!
//! [`Scaled`] carries a value `v` (f64) and a scale `s ≥ 0`: the sum, over every input the
//! value was computed from, of `|∂v/∂input|·|input|` with each partial derivative's chain
//! taken in absolute value (a sum's scale is the sum of its terms' scales, a product's
//! `s_a·|b| + |a|·s_b`, and so on). Running the oracle's layer in `Scaled`
//! ([`layer::train_step_t`](super::layer::train_step_t) with
//! [`ParamsT::<Scaled>`](super::layer::ParamsT)) gives every output element its scale next to
//! its value.
//!
//! # What the scale bounds
//! Perturb a set of intermediates that together separate the inputs from an output (one
//! "stage": every `h` row, say) each by a relative error of at most `u`. To first order the
//! output moves by at most `Σ |∂out/∂v_i|·|v_i|·u`, and because the scale of `out` sums the
//! absolute chains through every `v_i`, and `s(v_i) ≥ |v_i|`, that sum is at most `u·s(out)`.
//! So a path with `r` rounding stages changes an output by at most `r·u·s(out)` (first order),
//! whatever the signs, however much the output's own sum cancels. Reordering an f32 sum of `k`
//! terms changes it by at most `k·2^-24` times the sum of its terms' magnitudes, which is again
//! bounded by its scale. This is the elementwise bound the GPU tests apply
//! (`afdep_moe::accuracy::check_elementwise`): unlike a tolerance relative to the largest
//! element of a tensor, row or column, it holds for an element whose sum cancels (the router
//! gradient of a renormalised top-k, a shared-expert row at one token), and it is a bound,
//! not a statistical estimate.
//!
//! Constants of the formulas (the `1` of a sigmoid) have scale 0; inputs (`from_f32`) have
//! their magnitude. Comparisons (top-k selection, softmax's maximum) look at the value only.
//! The scale of a nonlinear function is its derivative's magnitude times the argument's scale
//! (`exp`: `e^v·s`), so the bound stays first-order.

use super::gemm::{Real, Strided, StridedMut, extent};

/// A value and the magnitude of the terms it was computed from (see the module).
#[derive(Debug, Clone, Copy, Default)]
pub struct Scaled {
    /// The value, in f64.
    pub v: f64,
    /// Its scale: `Σ |∂v/∂input|·|input|` along absolute chains; never negative.
    pub s: f64,
}

impl Scaled {
    /// An input value: its scale is its magnitude.
    pub fn input(v: f64) -> Scaled {
        Scaled { v, s: v.abs() }
    }
}

impl PartialEq for Scaled {
    fn eq(&self, other: &Self) -> bool {
        self.v == other.v
    }
}

impl PartialOrd for Scaled {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        self.v.partial_cmp(&other.v)
    }
}

impl std::ops::Add for Scaled {
    type Output = Scaled;
    fn add(self, o: Scaled) -> Scaled {
        Scaled {
            v: self.v + o.v,
            s: self.s + o.s,
        }
    }
}

impl std::ops::Sub for Scaled {
    type Output = Scaled;
    fn sub(self, o: Scaled) -> Scaled {
        Scaled {
            v: self.v - o.v,
            s: self.s + o.s,
        }
    }
}

impl std::ops::Mul for Scaled {
    type Output = Scaled;
    fn mul(self, o: Scaled) -> Scaled {
        Scaled {
            v: self.v * o.v,
            s: self.s * o.v.abs() + self.v.abs() * o.s,
        }
    }
}

impl std::ops::Div for Scaled {
    type Output = Scaled;
    fn div(self, o: Scaled) -> Scaled {
        let q = self.v / o.v;
        Scaled {
            v: q,
            s: (self.s + q.abs() * o.s) / o.v.abs(),
        }
    }
}

impl std::ops::AddAssign for Scaled {
    fn add_assign(&mut self, o: Scaled) {
        *self = *self + o;
    }
}

impl std::ops::Neg for Scaled {
    type Output = Scaled;
    fn neg(self) -> Scaled {
        Scaled {
            v: -self.v,
            s: self.s,
        }
    }
}

impl Real for Scaled {
    const ZERO: Self = Scaled { v: 0.0, s: 0.0 };
    const ONE: Self = Scaled { v: 1.0, s: 0.0 };

    fn from_f32(v: f32) -> Self {
        Scaled::input(f64::from(v))
    }

    fn to_f32(self) -> f32 {
        self.v as f32
    }

    fn exp(self) -> Self {
        let e = self.v.exp();
        Scaled {
            v: e,
            s: e * self.s,
        }
    }

    /// Three f64 products on split arrays: `C.v = α·A.v·B.v + β·C.v` and
    /// `C.s = |α|·(A.s·|B.v| + |A.v|·B.s) + |β|·C.s`, same strides as the caller's.
    fn gemm_raw(
        dims: [usize; 3],
        alpha: Self,
        a: Strided<'_, Self>,
        b: Strided<'_, Self>,
        beta: Self,
        c: StridedMut<'_, Self>,
    ) {
        let [m, k, n] = dims;
        if m == 0 || n == 0 {
            return;
        }
        let split = |x: &[Scaled]| -> (Vec<f64>, Vec<f64>, Vec<f64>) {
            (
                x.iter().map(|e| e.v).collect(),
                x.iter().map(|e| e.v.abs()).collect(),
                x.iter().map(|e| e.s).collect(),
            )
        };
        // only the elements the strides address (a caller may pass the rest of a larger array)
        let (ea, eb, ec) = (
            extent(m, k, a.rs, a.cs),
            extent(k, n, b.rs, b.cs),
            extent(m, n, c.rs, c.cs),
        );
        assert!(
            a.data.len() >= ea && b.data.len() >= eb && c.data.len() >= ec,
            "gemm: operand too short"
        );
        let (av, aa, as_) = split(&a.data[..ea]);
        let (bv, ba, bs) = split(&b.data[..eb]);
        let cdata = &mut c.data[..ec];
        let mut cv: Vec<f64> = cdata.iter().map(|e| e.v).collect();
        let mut cs: Vec<f64> = cdata.iter().map(|e| e.s).collect();
        let prod = |x: &[f64], y: &[f64], al: f64, be: f64, out: &mut [f64]| {
            f64::gemm_raw(
                dims,
                al,
                Strided {
                    data: x,
                    rs: a.rs,
                    cs: a.cs,
                },
                Strided {
                    data: y,
                    rs: b.rs,
                    cs: b.cs,
                },
                be,
                StridedMut {
                    data: out,
                    rs: c.rs,
                    cs: c.cs,
                },
            )
        };
        // Alpha and beta are formula constants here (1 or 0 in the oracle): their scales are
        // not propagated.
        prod(&av, &bv, alpha.v, beta.v, &mut cv);
        prod(&as_, &ba, alpha.v.abs(), beta.v.abs(), &mut cs);
        prod(&aa, &bs, alpha.v.abs(), 1.0, &mut cs);
        for ((e, v), s) in cdata.iter_mut().zip(cv).zip(cs) {
            *e = Scaled { v, s };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::LayerShape;
    use crate::oracle::LayerParams;
    use crate::oracle::layer::{ParamsT, Routing, train_step_t};
    use rand::{Rng, SeedableRng};

    fn sc(v: f64) -> Scaled {
        Scaled::input(v)
    }

    #[test]
    fn rules_of_the_elementary_operations() {
        let (a, b) = (sc(3.0), sc(-2.0));
        assert_eq!((a + b).v, 1.0);
        assert_eq!((a + b).s, 5.0); // a cancelling sum keeps its terms' magnitude
        assert_eq!((a - b).s, 5.0);
        assert_eq!((a * b).s, 12.0); // |a||b| from each factor's relative perturbation
        let q = a / b;
        assert_eq!(q.v, -1.5);
        assert_eq!(q.s, (3.0 + 1.5 * 2.0) / 2.0);
        let e = sc(0.5).exp();
        assert!((e.s - 0.5f64.exp() * 0.5).abs() < 1e-15);
        assert_eq!((-a).s, 3.0);
        assert_eq!((Scaled::ONE + a).s, 3.0); // a constant adds no scale
        assert!(sc(1.0) < sc(2.0));
    }

    #[test]
    fn gemm_matches_elementwise_rules() {
        let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(3);
        let (m, k, n) = (5, 7, 3);
        let a: Vec<Scaled> = (0..m * k).map(|_| sc(r.gen_range(-1.0..1.0))).collect();
        let b: Vec<Scaled> = (0..k * n).map(|_| sc(r.gen_range(-1.0..1.0))).collect();
        let mut c = vec![Scaled::ZERO; m * n];
        Scaled::gemm_raw(
            [m, k, n],
            Scaled::ONE,
            super::super::gemm::rows(&a, k),
            super::super::gemm::rows(&b, n),
            Scaled::ZERO,
            super::super::gemm::rows_mut(&mut c, n),
        );
        for i in 0..m {
            for j in 0..n {
                let want = (0..k).fold(Scaled::ZERO, |acc, l| acc + a[i * k + l] * b[l * n + j]);
                assert!((c[i * n + j].v - want.v).abs() < 1e-12);
                assert!((c[i * n + j].s - want.s).abs() < 1e-12);
            }
        }
    }

    /// The scale bounds first-order changes: perturbing every input (x, dy and every
    /// parameter) by a random relative amount of at most δ moves every output and gradient
    /// element by at most about δ·s, on a layer with a router (renormalised top-k, whose
    /// gradient cancels) and a shared expert.
    #[test]
    fn scale_bounds_the_effect_of_perturbed_inputs() {
        let sh = LayerShape {
            d_model: 24,
            width: 16,
            experts: 6,
            top_k: 3,
            shared: 8,
            renormalize: true,
        };
        let t = 5;
        let params = LayerParams::random(sh, 11);
        let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(12);
        let x: Vec<f64> = (0..t * 24).map(|_| r.gen_range(-1.0..1.0)).collect();
        let dy: Vec<f64> = (0..t * 24).map(|_| r.gen_range(-1.0..1.0)).collect();
        let ps = ParamsT::<Scaled>::from_bf16(&params);
        let xs: Vec<Scaled> = x.iter().map(|&v| sc(v)).collect();
        let dys: Vec<Scaled> = dy.iter().map(|&v| sc(v)).collect();
        let (fs, gs) = train_step_t(&ps, &xs, t, &dys, Routing::Router).unwrap();
        let base = ParamsT::<f64>::from_bf16(&params);
        let delta = 1e-7;
        for trial in 0..20u64 {
            let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(100 + trial);
            let mut jig = |v: &[f64]| -> Vec<f64> {
                v.iter()
                    .map(|&e| e * (1.0 + r.gen_range(-delta..delta)))
                    .collect()
            };
            let pp = ParamsT::<f64>::from_tensors(sh, base.tensors().map(|t| jig(t)));
            let (xp, dyp) = (jig(&x), jig(&dy));
            let (fp, gp) = train_step_t(&pp, &xp, t, &dyp, Routing::Router).unwrap();
            assert_eq!(fp.idx, fs.idx, "a perturbation this small keeps the routes");
            let check = |name: &str, got: &[f64], s: &[Scaled]| {
                for (i, (&g, e)) in got.iter().zip(s).enumerate() {
                    let moved = (g - e.v).abs();
                    // first order: δ·s; the slack covers second order and f64 rounding
                    let bound = delta * e.s * 1.01 + 1e-15 * e.s.max(1.0);
                    assert!(
                        moved <= bound,
                        "{name}[{i}] moved {moved:e}, bound {bound:e} (s {:e})",
                        e.s
                    );
                }
            };
            check("out", &fp.out, &fs.out);
            check("dx", &gp.dx, &gs.dx);
            check("dwr", &gp.dwr, &gs.dwr);
            check("dw1", &gp.dw1, &gs.dw1);
            check("dw2", &gp.dw2, &gs.dw2);
            check("ds2", &gp.ds2, &gs.ds2);
        }
    }
}
