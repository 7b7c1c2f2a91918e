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
    /// `C = alpha·op(A)·op(B) + beta·C` with row-major strides given explicitly.
    ///
    /// # Safety contract (checked)
    /// Slices must hold the addressed elements; this is asserted before the call.
    #[allow(clippy::too_many_arguments)]
    fn gemm_raw(
        m: usize,
        k: usize,
        n: usize,
        alpha: Self,
        a: &[Self],
        rsa: isize,
        csa: isize,
        b: &[Self],
        rsb: isize,
        csb: isize,
        beta: Self,
        c: &mut [Self],
        rsc: isize,
        csc: isize,
    );
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
                m: usize,
                k: usize,
                n: usize,
                alpha: Self,
                a: &[Self],
                rsa: isize,
                csa: isize,
                b: &[Self],
                rsb: isize,
                csb: isize,
                beta: Self,
                c: &mut [Self],
                rsc: isize,
                csc: isize,
            ) {
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
    matmul_strided(m, k, n, a, row_major(k), b, row_major(n), c, accumulate);
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
    matmul_strided(m, k, n, a, row_major(k), b, col_major(k), c, accumulate);
}

/// The (row, column) strides of a row-major matrix of `cols` columns.
fn row_major(cols: usize) -> (isize, isize) {
    (cols as isize, 1)
}

/// The (row, column) strides of a column-major matrix of `rows` rows (a row-major one of `rows`
/// columns, transposed).
fn col_major(rows: usize) -> (isize, isize) {
    (1, rows as isize)
}

/// `C[m×n] (+)= A · B` with C row-major and contiguous, A's element (i, l) at
/// `i·a_strides.0 + l·a_strides.1` and B's (l, j) at `l·b_strides.0 + j·b_strides.1`.
#[allow(clippy::too_many_arguments)]
fn matmul_strided<T: Real>(
    m: usize,
    k: usize,
    n: usize,
    a: &[T],
    a_strides: (isize, isize),
    b: &[T],
    b_strides: (isize, isize),
    c: &mut [T],
    accumulate: bool,
) {
    let beta = if accumulate { T::ONE } else { T::ZERO };
    T::gemm_raw(
        m,
        k,
        n,
        T::ONE,
        a,
        a_strides.0,
        a_strides.1,
        b,
        b_strides.0,
        b_strides.1,
        beta,
        c,
        n as isize,
        1,
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
    matmul_strided(m, k, n, a, col_major(m), b, row_major(n), c, accumulate);
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
