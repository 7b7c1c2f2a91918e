//! Matrix products of the oracle: row-major `C (+)= op(A) · op(B)` through `matrixmultiply`,
//! generic over f32 (the spec's precision) and f64 (gradient checks).
//!
//! Summation order: each element of C is one dot product accumulated in the element type;
//! `matrixmultiply` blocks the inner dimension, so the order within a dot product is the
//! library's, fixed for a given inner size and independent of how many rows are computed.

/// A real type the oracle computes in.
pub trait Real:
    Copy
    + Send
    + Sync
    + Default
    + PartialOrd
    + std::fmt::Debug
    + std::ops::Add<Output = Self>
    + std::ops::Sub<Output = Self>
    + std::ops::Mul<Output = Self>
    + std::ops::Div<Output = Self>
    + std::ops::AddAssign
    + std::ops::Neg<Output = Self>
    + 'static
{
    /// Zero.
    const ZERO: Self;
    /// One.
    const ONE: Self;
    /// From f32.
    fn from_f32(v: f32) -> Self;
    /// To f32 (rounding for f64).
    fn to_f32(self) -> f32;
    /// e^self.
    fn exp(self) -> Self;
    /// `C = alpha·op(A)·op(B) + beta·C` for `[m, k, n]` = `dims` (A `m × k`, B `k × n`, C
    /// `m × n`), each matrix with its strides given explicitly.
    ///
    /// # Safety contract (checked)
    /// Slices must hold the addressed elements; this is asserted before the call.
    fn gemm_raw(
        dims: [usize; 3],
        alpha: Self,
        a: Strided<'_, Self>,
        b: Strided<'_, Self>,
        beta: Self,
        c: StridedMut<'_, Self>,
    );
}

/// A matrix operand of [`Real::gemm_raw`]: element (i, j) at `data[i·rs + j·cs]`.
#[derive(Debug, Clone, Copy)]
pub struct Strided<'a, T> {
    /// The elements.
    pub data: &'a [T],
    /// Row stride.
    pub rs: isize,
    /// Column stride.
    pub cs: isize,
}

/// The output operand of [`Real::gemm_raw`]: element (i, j) at `data[i·rs + j·cs]`.
#[derive(Debug)]
pub struct StridedMut<'a, T> {
    /// The elements.
    pub data: &'a mut [T],
    /// Row stride.
    pub rs: isize,
    /// Column stride.
    pub cs: isize,
}

/// `data` row-major with `ld` elements per row.
pub fn rows<T>(data: &[T], ld: usize) -> Strided<'_, T> {
    let (rs, cs) = (ld as isize, 1);
    Strided { data, rs, cs }
}

/// `data` stored row-major with `ld` elements per row, read transposed.
pub fn cols<T>(data: &[T], ld: usize) -> Strided<'_, T> {
    let (rs, cs) = (1, ld as isize);
    Strided { data, rs, cs }
}

/// `data` row-major with `ld` elements per row, written.
pub fn rows_mut<T>(data: &mut [T], ld: usize) -> StridedMut<'_, T> {
    let (rs, cs) = (ld as isize, 1);
    StridedMut { data, rs, cs }
}

pub(crate) fn extent(rows: usize, cols: usize, rs: isize, cs: isize) -> usize {
    if rows == 0 || cols == 0 {
        return 0;
    }
    ((rows - 1) as isize * rs + (cols - 1) as isize * cs) as usize + 1
}

macro_rules! real_impl {
    ($t:ty, $f:ident) => {
        impl Real for $t {
            const ZERO: Self = 0.0;
            const ONE: Self = 1.0;
            fn from_f32(v: f32) -> Self {
                v as $t
            }
            fn to_f32(self) -> f32 {
                self as f32
            }
            fn exp(self) -> Self {
                <$t>::exp(self)
            }
            fn gemm_raw(
                [m, k, n]: [usize; 3],
                alpha: Self,
                a: Strided<'_, Self>,
                b: Strided<'_, Self>,
                beta: Self,
                c: StridedMut<'_, Self>,
            ) {
                let (
                    Strided {
                        data: a,
                        rs: rsa,
                        cs: csa,
                    },
                    Strided {
                        data: b,
                        rs: rsb,
                        cs: csb,
                    },
                ) = (a, b);
                let StridedMut {
                    data: c,
                    rs: rsc,
                    cs: csc,
                } = c;
                assert!(rsa >= 0 && csa >= 0 && rsb >= 0 && csb >= 0 && rsc >= 0 && csc >= 0);
                assert!(a.len() >= extent(m, k, rsa, csa), "gemm: A too short");
                assert!(b.len() >= extent(k, n, rsb, csb), "gemm: B too short");
                assert!(c.len() >= extent(m, n, rsc, csc), "gemm: C too short");
                if m == 0 || n == 0 {
                    return;
                }
                // SAFETY: the asserts above prove that every element addressed through the
                // given dimensions and non-negative strides lies inside the slices, and `c`
                // is borrowed mutably, so it aliases neither `a` nor `b`.
                unsafe {
                    matrixmultiply::$f(
                        m,
                        k,
                        n,
                        alpha,
                        a.as_ptr(),
                        rsa,
                        csa,
                        b.as_ptr(),
                        rsb,
                        csb,
                        beta,
                        c.as_mut_ptr(),
                        rsc,
                        csc,
                    )
                }
            }
        }
    };
}

real_impl!(f32, sgemm);
real_impl!(f64, dgemm);

/// `C[m×n] = A[m×k] · B[k×n]` (+ C when `accumulate`), all row-major and contiguous.
pub fn matmul<T: Real>(
    m: usize,
    k: usize,
    n: usize,
    a: &[T],
    b: &[T],
    c: &mut [T],
    accumulate: bool,
) {
    T::gemm_raw(
        [m, k, n],
        T::ONE,
        rows(a, k),
        rows(b, n),
        beta(accumulate),
        rows_mut(c, n),
    );
}

/// `C[m×n] (+)= A[m×k] · Bᵀ` where B is stored row-major as n × k.
pub fn matmul_bt<T: Real>(
    m: usize,
    k: usize,
    n: usize,
    a: &[T],
    b: &[T],
    c: &mut [T],
    accumulate: bool,
) {
    T::gemm_raw(
        [m, k, n],
        T::ONE,
        rows(a, k),
        cols(b, k),
        beta(accumulate),
        rows_mut(c, n),
    );
}

/// `C[m×n] (+)= Aᵀ · B` where A is stored row-major as k × m and B as k × n.
pub fn matmul_at<T: Real>(
    m: usize,
    k: usize,
    n: usize,
    a: &[T],
    b: &[T],
    c: &mut [T],
    accumulate: bool,
) {
    T::gemm_raw(
        [m, k, n],
        T::ONE,
        cols(a, m),
        rows(b, n),
        beta(accumulate),
        rows_mut(c, n),
    );
}

/// The `beta` of a product that adds to C (`accumulate`) or overwrites it.
fn beta<T: Real>(accumulate: bool) -> T {
    if accumulate { T::ONE } else { T::ZERO }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn naive(m: usize, k: usize, n: usize, a: &[f64], b: &[f64]) -> Vec<f64> {
        let mut c = vec![0.0; m * n];
        for i in 0..m {
            for j in 0..n {
                for p in 0..k {
                    c[i * n + j] += a[i * k + p] * b[p * n + j];
                }
            }
        }
        c
    }

    #[test]
    fn products_match_naive() {
        let (m, k, n) = (7, 13, 5);
        let a: Vec<f64> = (0..m * k).map(|i| (i as f64 * 0.37).sin()).collect();
        let b: Vec<f64> = (0..k * n).map(|i| (i as f64 * 0.11).cos()).collect();
        let want = naive(m, k, n, &a, &b);
        let mut c = vec![0.0; m * n];
        matmul(m, k, n, &a, &b, &mut c, false);
        let close = |x: &[f64], y: &[f64]| x.iter().zip(y).all(|(p, q)| (p - q).abs() < 1e-12);
        assert!(close(&c, &want));
        // Bᵀ stored n × k.
        let bt: Vec<f64> = (0..n * k).map(|i| b[(i % k) * n + i / k]).collect();
        matmul_bt(m, k, n, &a, &bt, &mut c, false);
        assert!(close(&c, &want));
        // Aᵀ stored k × m.
        let at: Vec<f64> = (0..k * m).map(|i| a[(i % m) * k + i / m]).collect();
        matmul_at(m, k, n, &at, &b, &mut c, false);
        assert!(close(&c, &want));
        matmul(m, k, n, &a, &b, &mut c, true);
        let twice: Vec<f64> = want.iter().map(|v| 2.0 * v).collect();
        assert!(close(&c, &twice));
    }
}
