//! The grouped GEMM's weight-gradient (k-sum), scatter, SwiGLU up-projection and data-gradient
//! paths against a host f64 GEMM on
//! fresh random bf16 inputs of odd sizes: M and N multiples of 8 but not of the 128-wide tile,
//! groups of 0, 1, 37, 129 and 300 rows (the empty ones must come out as exact zeros), rows
//! gathered through an index with a divisor, the `[dW1 | dW3]` column split, one chunk (the
//! direct bf16 store) and several chunks (f32 partials and the reduce). Outputs are poisoned
//! (NaN) first; NaN never passes.
//!
//! Tolerance per element: the bf16 rounding of the output (half an ulp, 2^-9 relative, taken as
//! 2^-8) plus the f32 accumulation (K terms, each rounding 2^-24 relative of the running sum:
//! bounded by 2^-16 · Σ|a·b| for the group sizes here).

mod common;

use afdep_kernels::KernelError;
use afdep_kernels::ops::gemm::{
    self, Engine, Gather, Groups, KOperand, Pairing, RowWeights, RowsOut, Schedule,
};
use afdep_kernels::ops::{download, poison, zeros};
use common::{gpu, rng};
use cudarc::driver::CudaSlice;
use half::bf16;
use rand::Rng;
use rand_chacha::ChaCha8Rng;

fn rand_bf16(r: &mut ChaCha8Rng, n: usize) -> Vec<bf16> {
    (0..n)
        .map(|_| bf16::from_f32(r.gen_range(-1.0f32..1.0)))
        .collect()
}

fn up<T: cudarc::driver::DeviceRepr>(ctx: &afdep_kernels::GpuContext, v: &[T]) -> CudaSlice<T> {
    ctx.stream()
        .clone_htod(v)
        .map_err(KernelError::driver("uploading"))
        .unwrap()
}

/// Checks `got` against `want` within `2^-8 |want| + 2^-16 mag` per element.
fn check(what: &str, got: &[f32], want: &[f64], mag: &[f64]) {
    assert_eq!(got.len(), want.len());
    let mut worst = 0.0f64;
    for (i, ((&g, &w), &m)) in got.iter().zip(want).zip(mag).enumerate() {
        let tol = w.abs() / 256.0 + m / 65536.0;
        let d = (f64::from(g) - w).abs();
        assert!(
            d <= tol,
            "{what}: element {i}: got {g}, want {w} (|diff| {d:.3e} > tol {tol:.3e})"
        );
        if m == 0.0 {
            assert!(
                g == 0.0,
                "{what}: element {i} of an empty sum is {g}, not 0"
            );
        }
        worst = worst.max(d / (w.abs() + 1e-30).max(m / 256.0));
    }
    println!(
        "{what}: {} elements, worst scaled error {worst:.2e}",
        got.len()
    );
}

/// Weight gradients C_g = Σ_{r in g} A[r]ᵀ B[row_b(r)] over expert groups with empty groups,
/// B rows gathered (slot → slot / div), the column split at n1, for 1 and 3 chunks.
#[test]
fn wgrad_matches_a_host_gemm() {
    let Some(ctx) = gpu() else { return };
    let mut r = rng(17);
    // (m, n, n1, group sizes, div)
    let cases: [(usize, usize, usize, &[usize], usize); 3] = [
        (72, 264, 136, &[0, 37, 300, 0, 129], 2),
        (136, 40, 24, &[1, 0, 257], 1),
        (256, 256, 128, &[0, 0], 3),
    ];
    for (m, n, n1, sizes, div) in cases {
        let (od, offsets, g, rows) = groups_of(&ctx, sizes);
        let lda = m + 8;
        let ldb = n + 16;
        let brows = rows.div_ceil(div).max(1) + 3;
        let a = rand_bf16(&mut r, rows.max(1) * lda);
        let b = rand_bf16(&mut r, brows * ldb);
        // B row of sum row j: index[j] / div, a permutation of 0..rows scaled into range.
        let index = permutation(&mut r, rows);
        let index = if index.is_empty() { vec![0] } else { index };

        let (want, mag) = host_wgrad(
            &offsets,
            (m, n),
            |row, i| f64::from(a[row * lda + i].to_f32()),
            |row, j| f64::from(b[(index[row] as usize / div) * ldb + j].to_f32()),
        );
        let (ad, bd, idd) = (up(&ctx, &a), up(&ctx, &b), up(&ctx, &index));
        for splits in [1usize, 3] {
            let mut ws =
                zeros::<f32>(&ctx, if splits > 1 { g * splits * m * n } else { 0 }).unwrap();
            let a_op = k_operand(&ad, lda, None);
            let b_op = k_operand(&bd, ldb, Some(Gather { index: &idd, div }));
            let dims = (g, m, n, n1);
            let outs = wgrad_split(
                &ctx,
                experts(&od, g, rows),
                (a_op, b_op),
                dims,
                splits,
                &mut ws,
            );
            let got = joined(&ctx, &outs, dims);
            check(
                &format!("wgrad m {m} n {n} n1 {n1} groups {sizes:?} splits {splits}"),
                &got,
                &want,
                &mag,
            );
        }
    }
}

/// The down-projection scattered into token order with the router weight: acc[token] +=
/// w_slot · h_r·W2_e, onto an accumulator that starts at random values (the add is checked,
/// not only the product), groups with 0 rows, hidden not a multiple of the tile.
#[test]
fn down_scatter_matches_a_host_gemm() {
    let Some((ctx, _classic)) = classic_gpu() else {
        return;
    };
    let mut r = rng(71);
    let (tokens, top_k, width, hidden) = (97usize, 3usize, 40usize, 136usize);
    let sizes = [0usize, 100, 1, 0, 190];
    let (od, offsets, g, rows) = groups_of(&ctx, &sizes);
    assert_eq!(rows, tokens * top_k);
    // row → slot: a permutation of the slots.
    let row_slot = permutation(&mut r, rows);
    let weights: Vec<f32> = (0..rows).map(|_| r.gen_range(0.0f32..1.0)).collect();
    let h = rand_bf16(&mut r, rows * width);
    let w2 = rand_bf16(&mut r, g * width * hidden);
    let acc0: Vec<f32> = (0..tokens * hidden)
        .map(|_| r.gen_range(-1.0f32..1.0))
        .collect();
    let (v, m) = host_rows(
        &offsets,
        hidden,
        width,
        |row, k| f64::from(h[row * width + k].to_f32()),
        |e, k, j| f64::from(w2[(e * width + k) * hidden + j].to_f32()),
    );
    let (want, mag) = host_scatter(&acc0, (&v, &m), &row_slot, &weights, top_k, hidden);
    let (hd, w2d, rsd, wd) = (
        up(&ctx, &h),
        up(&ctx, &w2),
        up(&ctx, &row_slot),
        up(&ctx, &weights),
    );
    let rw = RowWeights {
        row_slot: &rsd,
        weights: &wd,
        top_k,
    };
    let got = down_scatter(
        &ctx,
        experts(&od, g, rows),
        (&hd, &w2d),
        (width, hidden),
        &acc0,
        rw,
    );
    // f32 accumulators: the tolerance's bf16 term is far above the f32 error; keep it, the
    // magnitude term covers the order of the atomic adds.
    check("down scatter", &got, &want, &mag);
}

/// Expert groups of `sizes` rows: the device offsets, the host ones, the number of groups and
/// the rows in all.
fn groups_of(
    ctx: &afdep_kernels::GpuContext,
    sizes: &[usize],
) -> (CudaSlice<u64>, Vec<u64>, usize, usize) {
    let mut offsets = vec![0u64];
    for &s in sizes {
        offsets.push(offsets.last().unwrap() + s as u64);
    }
    (up(ctx, &offsets), offsets, sizes.len(), sizes.iter().sum())
}

/// The up-projection with SwiGLU at widths and hiddens that are multiples of 8 but not of the
/// tile (N tails inside a 64-column half, K tails inside a 32-wide k-tile): h, and the a, b
/// the train step stores, against a host f64 GEMM; groups of 0 and 1 rows; outputs poisoned.
#[test]
fn up_swiglu_odd_sizes_match_a_host_gemm() {
    let Some((ctx, _classic)) = classic_gpu() else {
        return;
    };
    let mut r = rng(23);
    for (hidden, width) in [(136usize, 40usize), (72, 24), (264, 136)] {
        let sizes = [0usize, 37, 1, 130];
        let (od, offsets, g, rows) = groups_of(&ctx, &sizes);
        let x = rand_bf16(&mut r, rows * hidden);
        let w1 = rand_bf16(&mut r, g * hidden * width);
        let w3 = rand_bf16(&mut r, g * hidden * width);
        let n = rows * width;
        let (mut wa, mut wb, mut wh) = (vec![0f64; n], vec![0f64; n], vec![0f64; n]);
        let (mut ma, mut mb, mut mh) = (vec![0f64; n], vec![0f64; n], vec![0f64; n]);
        for e in 0..g {
            for row in offsets[e] as usize..offsets[e + 1] as usize {
                for j in 0..width {
                    let (mut a, mut b, mut sa, mut sb) = (0f64, 0f64, 0f64, 0f64);
                    for k in 0..hidden {
                        let xv = f64::from(x[row * hidden + k].to_f32());
                        let pa = xv * f64::from(w1[(e * hidden + k) * width + j].to_f32());
                        let pb = xv * f64::from(w3[(e * hidden + k) * width + j].to_f32());
                        a += pa;
                        b += pb;
                        sa += pa.abs();
                        sb += pb.abs();
                    }
                    let s = 1.0 / (1.0 + (-a).exp());
                    let i = row * width + j;
                    (wa[i], wb[i], wh[i]) = (a, b, a * s * b);
                    (ma[i], mb[i]) = (sa, sb);
                    // h's error from a's and b's: |dh/da| <= 1.1 |b|, |dh/db| = |silu(a)|,
                    // plus f32 rounding of the two products.
                    mh[i] = 1.1 * b.abs() * sa + (a * s).abs() * sb + (a * s * b).abs() * 1e-3;
                }
            }
        }
        let (xd, w1d, w3d) = (up(&ctx, &x), up(&ctx, &w1), up(&ctx, &w3));
        let [a, b, h] = up_swiglu_abh(
            &ctx,
            experts(&od, g, rows),
            (&xd, None),
            (&w1d, &w3d),
            (hidden, width),
            rows,
        );
        let what = format!("up_swiglu hidden {hidden} width {width}");
        for (name, got, want, mag) in [
            ("a", &a, &wa, &ma),
            ("b", &b, &wb, &mb),
            ("h", &h, &wh, &mh),
        ] {
            check(&format!("{what} {name}"), got, want, mag);
        }
    }
}

/// The data gradient `[da | db]·[W1 | W3]ᵀ` with K switching from W1 to W3 at a width that is
/// not a multiple of the k-tile (the cp.async split) and at one that is (the TMA boxes), hidden
/// not a multiple of the tile; groups of 0 rows; output poisoned.
#[test]
fn dx_odd_sizes_match_a_host_gemm() {
    let Some((ctx, _classic)) = classic_gpu() else {
        return;
    };
    let mut r = rng(29);
    for (hidden, width) in [(136usize, 40usize), (72, 64), (40, 24)] {
        let sizes = [5usize, 0, 129, 0];
        let (od, offsets, g, rows) = groups_of(&ctx, &sizes);
        let dab = rand_bf16(&mut r, rows * 2 * width);
        let w1 = rand_bf16(&mut r, g * hidden * width);
        let w3 = rand_bf16(&mut r, g * hidden * width);
        let mut want = vec![0f64; rows * hidden];
        let mut mag = vec![0f64; rows * hidden];
        for e in 0..g {
            for row in offsets[e] as usize..offsets[e + 1] as usize {
                for j in 0..hidden {
                    for k in 0..width {
                        let p1 = f64::from(dab[row * 2 * width + k].to_f32())
                            * f64::from(w1[(e * hidden + j) * width + k].to_f32());
                        let p3 = f64::from(dab[row * 2 * width + width + k].to_f32())
                            * f64::from(w3[(e * hidden + j) * width + k].to_f32());
                        want[row * hidden + j] += p1 + p3;
                        mag[row * hidden + j] += p1.abs() + p3.abs();
                    }
                }
            }
        }
        let (dd, w1d, w3d) = (up(&ctx, &dab), up(&ctx, &w1), up(&ctx, &w3));
        let groups = experts(&od, g, rows);
        let got = dx_stored(&ctx, groups, (&dd, &w1d, &w3d), (width, hidden), rows);
        check(
            &format!("dx hidden {hidden} width {width}"),
            &got,
            &want,
            &mag,
        );
    }
}

/// Forces a GEMM choice on this thread through `force` (`gemm::force_engine`,
/// `force_wgrad_engine`, `force_pairing` or `force_schedule`); the default comes back when
/// dropped.
struct Forced<T: 'static>(fn(Option<T>));

impl<T: 'static> Forced<T> {
    fn new(force: fn(Option<T>), value: T) -> Self {
        force(Some(value));
        Forced(force)
    }
}

impl<T: 'static> Drop for Forced<T> {
    fn drop(&mut self) {
        (self.0)(None);
    }
}

/// The GPU with the classic rows kernel forced on this thread (the default engine, ws, has its
/// own test), or `None` (skip).
fn classic_gpu() -> Option<(afdep_kernels::GpuContext, Forced<Engine>)> {
    let ctx = gpu()?;
    Some((ctx, Forced::new(gemm::force_engine, Engine::Classic)))
}

/// A random permutation of `0..n`.
fn permutation(r: &mut ChaCha8Rng, n: usize) -> Vec<u32> {
    let mut v: Vec<u32> = (0..n as u32).collect();
    for i in (1..n).rev() {
        let j = r.gen_range(0..=i);
        v.swap(i, j);
    }
    v
}

/// Host `v[row][j] = Σ_k a(row, k)·b(e, k, j)` over the groups of `offsets`, with `Σ|·|`.
fn host_rows(
    offsets: &[u64],
    n: usize,
    k: usize,
    a: impl Fn(usize, usize) -> f64,
    b: impl Fn(usize, usize, usize) -> f64,
) -> (Vec<f64>, Vec<f64>) {
    let rows = *offsets.last().unwrap() as usize;
    let (mut v, mut m) = (vec![0f64; rows * n], vec![0f64; rows * n]);
    for e in 0..offsets.len() - 1 {
        for row in offsets[e] as usize..offsets[e + 1] as usize {
            let arow: Vec<f64> = (0..k).map(|kk| a(row, kk)).collect();
            for j in 0..n {
                let (mut s, mut sm) = (0f64, 0f64);
                for (kk, &x) in arow.iter().enumerate() {
                    let p = x * b(e, kk, j);
                    s += p;
                    sm += p.abs();
                }
                v[row * n + j] = s;
                m[row * n + j] = sm;
            }
        }
    }
    (v, m)
}

fn f32s(ctx: &afdep_kernels::GpuContext, d: &CudaSlice<bf16>) -> Vec<f32> {
    download(ctx, d)
        .unwrap()
        .iter()
        .map(|x| x.to_f32())
        .collect()
}

/// Host token accumulators: `acc0` plus, for every problem row, its row of `v` (`Σ|·|`: `m`)
/// times the router weight of its slot, added onto the slot's token (rows in order).
fn host_scatter(
    acc0: &[f32],
    (v, m): (&[f64], &[f64]),
    row_slot: &[u32],
    weights: &[f32],
    top_k: usize,
    hidden: usize,
) -> (Vec<f64>, Vec<f64>) {
    let mut want: Vec<f64> = acc0.iter().map(|&x| f64::from(x)).collect();
    let mut mag: Vec<f64> = acc0.iter().map(|&x| f64::from(x).abs()).collect();
    for (row, &slot) in row_slot.iter().enumerate() {
        let slot = slot as usize;
        let (t, w) = (slot / top_k, f64::from(weights[slot]));
        for j in 0..hidden {
            want[t * hidden + j] += w * v[row * hidden + j];
            mag[t * hidden + j] += w * m[row * hidden + j];
        }
    }
    (want, mag)
}

/// The down-projection of `h` by `w2` over `groups` (K = `width`, N = `hidden`), scattered with
/// the router weights `rw` onto token accumulators that start at `acc0`; returns them.
fn down_scatter(
    ctx: &afdep_kernels::GpuContext,
    groups: Groups<'_>,
    (h, w2): (&CudaSlice<bf16>, &CudaSlice<bf16>),
    (width, hidden): (usize, usize),
    acc0: &[f32],
    rw: RowWeights<'_>,
) -> Vec<f32> {
    let mut acc = up(ctx, acc0);
    gemm::down(
        ctx,
        groups,
        h,
        w2,
        width,
        hidden,
        RowsOut::Scatter {
            acc: &mut acc,
            weights: rw,
            weighted: true,
        },
    )
    .unwrap();
    download(ctx, &acc).unwrap()
}

/// The up-projection with SwiGLU of `x` (its rows through the gather when given) by `w1` and
/// `w3` over `groups` (`rows` rows, K = `hidden`, N = `width`) into poisoned outputs:
/// `[a, b, h]` (a and b split from the kept `[a | b]` rows).
fn up_swiglu_abh(
    ctx: &afdep_kernels::GpuContext,
    groups: Groups<'_>,
    (x, gather): (&CudaSlice<bf16>, Option<Gather<'_>>),
    (w1, w3): (&CudaSlice<bf16>, &CudaSlice<bf16>),
    (hidden, width): (usize, usize),
    rows: usize,
) -> [Vec<f32>; 3] {
    let n = rows * width;
    let mut h = poisoned(ctx, n);
    let mut ab = poisoned(ctx, 2 * n);
    gemm::up_swiglu(
        ctx,
        groups,
        x,
        gather,
        w1,
        w3,
        hidden,
        width,
        &mut h,
        Some(&mut ab),
    )
    .unwrap();
    let ab = f32s(ctx, &ab);
    let half = |second: usize| -> Vec<f32> {
        ab.chunks(2 * width.max(1))
            .flat_map(|row| row[second * width..(second + 1) * width].to_vec())
            .collect()
    };
    [half(0), half(1), f32s(ctx, &h)]
}

/// The data gradient `[da | db]·[W1 | W3]ᵀ` of `dab` over `groups` (`rows` rows, K split at
/// `width`, N = `hidden`), stored unweighted into a poisoned output.
fn dx_stored(
    ctx: &afdep_kernels::GpuContext,
    groups: Groups<'_>,
    (dab, w1, w3): (&CudaSlice<bf16>, &CudaSlice<bf16>, &CudaSlice<bf16>),
    (width, hidden): (usize, usize),
    rows: usize,
) -> Vec<f32> {
    let mut out = poisoned(ctx, rows * hidden);
    gemm::dx(
        ctx,
        groups,
        dab,
        w1,
        Some(w3),
        width,
        hidden,
        RowsOut::Store {
            out: &mut out,
            weights: None,
        },
    )
    .unwrap();
    f32s(ctx, &out)
}

/// A weight-gradient operand: rows of `ld` elements of `buf`, read through `gather` if given.
fn k_operand<'a>(buf: &'a CudaSlice<bf16>, ld: usize, gather: Option<Gather<'a>>) -> KOperand<'a> {
    KOperand { buf, ld, gather }
}

/// `n` bf16 elements on the device, poisoned (NaN).
fn poisoned(ctx: &afdep_kernels::GpuContext, n: usize) -> CudaSlice<bf16> {
    let mut v = zeros::<bf16>(ctx, n).unwrap();
    poison(ctx, &mut v).unwrap();
    v
}

/// The expert groups of the device `offsets`: `g` groups of at most `capacity` rows in all.
fn experts(offsets: &CudaSlice<u64>, g: usize, capacity: usize) -> Groups<'_> {
    Groups::Experts {
        offsets,
        experts: g,
        capacity,
    }
}

/// Host weight gradients over the groups of `offsets`: `want[(e·m + i)·n + j] = Σ_r a(r, i)·
/// b(r, j)` over the rows `r` of group `e`, with `Σ|·|`.
fn host_wgrad(
    offsets: &[u64],
    (m, n): (usize, usize),
    a: impl Fn(usize, usize) -> f64,
    b: impl Fn(usize, usize) -> f64,
) -> (Vec<f64>, Vec<f64>) {
    let g = offsets.len() - 1;
    let mut want = vec![0f64; g * m * n];
    let mut mag = vec![0f64; g * m * n];
    for e in 0..g {
        for row in offsets[e] as usize..offsets[e + 1] as usize {
            for i in 0..m {
                let av = a(row, i);
                for j in 0..n {
                    let p = av * b(row, j);
                    want[(e * m + i) * n + j] += p;
                    mag[(e * m + i) * n + j] += p.abs();
                }
            }
        }
    }
    (want, mag)
}

/// The weight gradient of `a` and `b` over `groups` (`g` of them) in `splits` chunks (`ws`:
/// the chunks' f32 partials), stored into poisoned outputs split at column `n1`: columns
/// `< n1` (`g × m × n1`) and the rest (`g × m × (n − n1)`).
fn wgrad_split(
    ctx: &afdep_kernels::GpuContext,
    groups: Groups<'_>,
    (a, b): (KOperand<'_>, KOperand<'_>),
    (g, m, n, n1): (usize, usize, usize, usize),
    splits: usize,
    ws: &mut CudaSlice<f32>,
) -> (CudaSlice<bf16>, CudaSlice<bf16>) {
    let mut out = poisoned(ctx, g * m * n1);
    let mut out2 = poisoned(ctx, g * m * (n - n1));
    gemm::wgrad(
        ctx,
        groups,
        a,
        b,
        m,
        n,
        splits,
        ws,
        &mut out,
        Some((&mut out2, n1)),
    )
    .unwrap();
    (out, out2)
}

/// The `g × m × n` weight gradient from the two column blocks of [`wgrad_split`].
fn joined(
    ctx: &afdep_kernels::GpuContext,
    (out, out2): &(CudaSlice<bf16>, CudaSlice<bf16>),
    (g, m, n, n1): (usize, usize, usize, usize),
) -> Vec<f32> {
    let (o1, o2) = (f32s(ctx, out), f32s(ctx, out2));
    let mut got = vec![0f32; g * m * n];
    for e in 0..g {
        for i in 0..m {
            for j in 0..n {
                got[(e * m + i) * n + j] = if j < n1 {
                    o1[(e * m + i) * n1 + j]
                } else {
                    o2[(e * m + i) * (n - n1) + j - n1]
                };
            }
        }
    }
    got
}

/// The warp-specialised engine (forced on this thread) on every rows problem at odd sizes:
/// groups of 0, 1, 257 and uneven sizes (more 128 × 256 tiles than SMs for the wide
/// problems, so persistent blocks take several tiles), N not a multiple of the 256-column
/// tile nor of its 64-column TMA blocks, K not a multiple of 64; A by TMA (contiguous rows)
/// and by the producer's cp.async (gathered rows); the SwiGLU, weighted store, scatter and
/// SwiGLU-backward epilogues; the data gradient's K split between W1 and W3. Outputs
/// poisoned.
#[test]
fn ws_engine_odd_sizes_match_a_host_gemm() {
    ws_odd_sizes(Pairing::Off, Schedule::Static);
}

/// The same problems on the ws engine in pairs of blocks (2-block clusters along M sharing B by
/// multicast): groups of 1, 3, 17 and 6 m-tiles, so the second block of many pairs has no rows;
/// N tails where the second block's half of a K-major B box lies wholly past N (zero-filled)
/// and where only one block of a pair loads an N-major 64-column block.
#[test]
fn ws_pairs_odd_sizes_match_a_host_gemm() {
    ws_odd_sizes(Pairing::On, Schedule::Static);
}

/// [`ws_engine_odd_sizes_match_a_host_gemm`] with the dynamic schedule forced: every block
/// takes its tiles from the context's counter. The launches run one after another on one
/// context, so each finds the counters its predecessor's last block put back to zero; a
/// counter left non-zero would make the next launch skip its first tiles, whose rows would
/// stay poisoned and fail the checks. Then pairs with the dynamic schedule asked for: the
/// paired kernels take the static schedule (and leave the counters alone), so the single-block
/// launches after them still find the counters at zero.
#[test]
fn ws_engine_dynamic_schedule_odd_sizes_match_a_host_gemm() {
    ws_odd_sizes(Pairing::Off, Schedule::Dynamic);
    ws_odd_sizes(Pairing::On, Schedule::Dynamic);
    ws_odd_sizes(Pairing::Off, Schedule::Dynamic);
}

/// The body of the ws rows tests, with `pairing` and `schedule` forced.
fn ws_odd_sizes(pairing: Pairing, schedule: Schedule) {
    let Some(ctx) = gpu() else { return };
    let _ws = Forced::new(gemm::force_engine, Engine::Ws);
    let _pairs = Forced::new(gemm::force_pairing, pairing);
    let _schedule = Forced::new(gemm::force_schedule, schedule);
    let paired_before = gemm::paired_launches();
    let mut r = rng(97);
    let sizes = [0usize, 1, 257, 2100, 0, 45, 700, 3];
    let (od, offsets, g, rows) = groups_of(&ctx, &sizes);
    let groups = experts(&od, g, rows);
    let (hidden, width) = (1096usize, 328usize);
    // Gather: problem row r reads token row_slot[r] / 2 (two slots per token).
    let top_k = 2usize;
    let row_slot = permutation(&mut r, rows);
    let tokens = rows.div_ceil(top_k);
    let weights: Vec<f32> = (0..tokens * top_k)
        .map(|_| r.gen_range(0.1f32..1.0))
        .collect();
    let (rsd, wd) = (up(&ctx, &row_slot), up(&ctx, &weights));
    let rw = RowWeights {
        row_slot: &rsd,
        weights: &wd,
        top_k,
    };
    let bf = |v: &[bf16], i: usize| f64::from(v[i].to_f32());

    // Up-projection with SwiGLU, A dense (TMA) and gathered (cp.async).
    let x = rand_bf16(&mut r, tokens.max(rows) * hidden);
    let w1 = rand_bf16(&mut r, g * hidden * width);
    let w3 = rand_bf16(&mut r, g * hidden * width);
    let (xd, w1d, w3d) = (up(&ctx, &x), up(&ctx, &w1), up(&ctx, &w3));
    for gathered in [false, true] {
        let src = |row: usize| {
            if gathered {
                row_slot[row] as usize / top_k
            } else {
                row
            }
        };
        let bw = |w: &[bf16], e: usize, kk: usize, j: usize| bf(w, (e * hidden + kk) * width + j);
        // a = x·W1 and b = x·W3
        let [(va, ma), (vb, mb)] = [&w1, &w3].map(|w| {
            host_rows(
                &offsets,
                width,
                hidden,
                |row, kk| bf(&x, src(row) * hidden + kk),
                |e, kk, j| bw(w, e, kk, j),
            )
        });
        let n = rows * width;
        let (mut wh, mut mh) = (vec![0f64; n], vec![0f64; n]);
        for i in 0..n {
            let s = 1.0 / (1.0 + (-va[i]).exp());
            wh[i] = va[i] * s * vb[i];
            mh[i] = 1.1 * vb[i].abs() * ma[i] + (va[i] * s).abs() * mb[i] + wh[i].abs() * 1e-3;
        }
        let gather = gathered.then_some(Gather {
            index: &rsd,
            div: top_k,
        });
        let [a, b, h] = up_swiglu_abh(
            &ctx,
            groups,
            (&xd, gather),
            (&w1d, &w3d),
            (hidden, width),
            rows,
        );
        let what = format!("ws up_swiglu gathered {gathered}");
        check(&format!("{what} a"), &a, &va, &ma);
        check(&format!("{what} b"), &b, &vb, &mb);
        check(&format!("{what} h"), &h, &wh, &mh);
    }

    // Down-projection (K = width, N = hidden): weighted store, and scatter into tokens.
    let hrows = rand_bf16(&mut r, rows * width);
    let w2 = rand_bf16(&mut r, g * width * hidden);
    let (hd, w2d) = (up(&ctx, &hrows), up(&ctx, &w2));
    let (v, m) = host_rows(
        &offsets,
        hidden,
        width,
        |row, kk| bf(&hrows, row * width + kk),
        |e, kk, j| bf(&w2, (e * width + kk) * hidden + j),
    );
    {
        let mut out = poisoned(&ctx, rows * hidden);
        gemm::down(
            &ctx,
            groups,
            &hd,
            &w2d,
            width,
            hidden,
            RowsOut::Store {
                out: &mut out,
                weights: Some(rw),
            },
        )
        .unwrap();
        let (mut want, mut mag) = (v.clone(), m.clone());
        for row in 0..rows {
            let w = f64::from(weights[row_slot[row] as usize]);
            for j in 0..hidden {
                want[row * hidden + j] *= w;
                mag[row * hidden + j] *= w;
            }
        }
        check("ws down store (weighted)", &f32s(&ctx, &out), &want, &mag);
    }
    {
        let acc0: Vec<f32> = (0..tokens * hidden)
            .map(|_| r.gen_range(-1.0f32..1.0))
            .collect();
        let (want, mag) = host_scatter(&acc0, (&v, &m), &row_slot, &weights, top_k, hidden);
        let got = down_scatter(&ctx, groups, (&hd, &w2d), (width, hidden), &acc0, rw);
        check("ws down scatter", &got, &want, &mag);
    }

    // dh_dswiglu: G = dy[token]·W2ᵀ (dy gathered, K = hidden, N = width), the SwiGLU backward
    // with weights, the router's g and w·h.
    {
        let dy = rand_bf16(&mut r, tokens * hidden);
        let av = rand_bf16(&mut r, rows * width);
        let bv = rand_bf16(&mut r, rows * width);
        let (gv, gm) = host_rows(
            &offsets,
            width,
            hidden,
            |row, kk| bf(&dy, (row_slot[row] as usize / top_k) * hidden + kk),
            |e, kk, j| bf(&w2, (e * width + j) * hidden + kk),
        );
        let n = rows * width;
        let (mut wda, mut whw) = (vec![0f64; 2 * n], vec![0f64; n]);
        let (mut mda, mut mhw) = (vec![0f64; 2 * n], vec![0f64; n]);
        let mut wg = vec![0f64; tokens * top_k];
        let mut mg = vec![0f64; tokens * top_k];
        for row in 0..rows {
            let slot = row_slot[row] as usize;
            let w = f64::from(weights[slot]);
            for j in 0..width {
                let i = row * width + j;
                let (a, b, gg) = (bf(&av, i), bf(&bv, i), gv[i]);
                let s = 1.0 / (1.0 + (-a).exp());
                let silu = a * s;
                let hh = silu * b;
                wg[slot] += gg * hh;
                mg[slot] += gm[i] * hh.abs();
                let dsilu = s * (1.0 + a * (1.0 - s));
                wda[row * 2 * width + j] = w * gg * b * dsilu;
                mda[row * 2 * width + j] = w * gm[i] * (b * dsilu).abs() + 1e-30;
                wda[row * 2 * width + width + j] = w * gg * silu;
                mda[row * 2 * width + width + j] = w * gm[i] * silu.abs() + 1e-30;
                whw[i] = w * hh;
                mhw[i] = (w * hh).abs() * 1e-3;
            }
        }
        // the forward's [a | b] rows
        let abv: Vec<bf16> = (0..rows)
            .flat_map(|row| {
                let span = row * width..(row + 1) * width;
                av[span.clone()]
                    .iter()
                    .chain(&bv[span])
                    .copied()
                    .collect::<Vec<_>>()
            })
            .collect();
        let (dyd, abd) = (up(&ctx, &dy), up(&ctx, &abv));
        // [a | b] in a buffer of their own (left unchanged), then in the output itself (each
        // element replaced by its [da | db]), on each engine: on one engine the two forms give
        // the same bits (the engines' tiles differ, so across them only the tolerance holds)
        for engine in [Engine::Ws, Engine::Classic] {
            let _e = Forced::new(gemm::force_engine, engine);
            let mut first: Option<Vec<f32>> = None;
            for in_place in [false, true] {
                let what = format!("dh_dswiglu {engine:?} in place {in_place}");
                let mut dab = if in_place {
                    up(&ctx, &abv)
                } else {
                    poisoned(&ctx, 2 * n)
                };
                let mut hw = poisoned(&ctx, n);
                let mut gsum = zeros::<f32>(&ctx, tokens * top_k).unwrap();
                gemm::dh_dswiglu(
                    &ctx,
                    groups,
                    &dyd,
                    Some(Gather {
                        index: &rsd,
                        div: top_k,
                    }),
                    &w2d,
                    width,
                    hidden,
                    gemm::DswigluIo {
                        ab: if in_place {
                            gemm::SavedAb::InPlace
                        } else {
                            gemm::SavedAb::Separate(&abd)
                        },
                        dab: &mut dab,
                        hw: Some(&mut hw),
                        weights: Some(rw),
                        gsum: Some(&mut gsum),
                    },
                )
                .unwrap();
                let got = f32s(&ctx, &dab);
                check(&format!("{what} [da | db]"), &got, &wda, &mda);
                check(&format!("{what} w·h"), &f32s(&ctx, &hw), &whw, &mhw);
                check(
                    &format!("{what} g"),
                    &download(&ctx, &gsum).unwrap(),
                    &wg,
                    &mg,
                );
                if !in_place {
                    let kept: Vec<u16> = download(&ctx, &abd)
                        .unwrap()
                        .iter()
                        .map(|v| v.to_bits())
                        .collect();
                    let want: Vec<u16> = abv.iter().map(|v| v.to_bits()).collect();
                    assert!(kept == want, "{what}: the separate [a | b] changed");
                }
                // the same engine, the same arithmetic: the two forms give identical bits
                let bits: Vec<u32> = got.iter().map(|v| v.to_bits()).collect();
                match &first {
                    None => first = Some(got),
                    Some(f) => assert!(
                        f.iter().map(|v| v.to_bits()).eq(bits),
                        "{what}: [da | db] differs from the separate form's"
                    ),
                }
            }
        }
        // each Forced<Engine> above put the default back on drop: the rest is the ws test's
        gemm::force_engine(Some(Engine::Ws));
    }

    // The data gradient [da | db]·[W1 | W3]ᵀ: K split at a width that is a multiple of 64
    // (TMA boxes of W1 then W3) and at one that is not (the rule falls back to the classic
    // kernel: still correct).
    for width in [320usize, 328] {
        let dab = rand_bf16(&mut r, rows * 2 * width);
        let w1 = rand_bf16(&mut r, g * hidden * width);
        let w3 = rand_bf16(&mut r, g * hidden * width);
        let (want, mag) = host_rows(
            &offsets,
            hidden,
            2 * width,
            |row, kk| bf(&dab, row * 2 * width + kk),
            |e, kk, j| {
                if kk < width {
                    bf(&w1, (e * hidden + j) * width + kk)
                } else {
                    bf(&w3, (e * hidden + j) * width + kk - width)
                }
            },
        );
        let (dd, w1d, w3d) = (up(&ctx, &dab), up(&ctx, &w1), up(&ctx, &w3));
        let got = dx_stored(&ctx, groups, (&dd, &w1d, &w3d), (width, hidden), rows);
        check(&format!("ws dx width {width}"), &got, &want, &mag);
    }
    // the pairs ran (not a silent fall-back to single blocks): up-projection 2, down 2,
    // dh_dswiglu on ws 2, dx at width 320 1
    let paired = gemm::paired_launches() - paired_before;
    match pairing {
        Pairing::On => assert!(paired >= 7, "{paired} launches ran in pairs, 7 expected"),
        _ => assert_eq!(paired, 0, "{paired} launches ran in pairs, none expected"),
    }
}

/// Pairs of blocks change which block computes a tile and where B comes from, not the
/// arithmetic: the up-projection (contiguous and gathered A) and the stored data gradient give
/// the same bits with pairs as without, at a shape with real pairs (groups of 2 to 11 m-tiles,
/// odd and even, one empty) and N tails. So does a GEMM limited to a few SMs
/// (`GpuContext::set_gemm_sms`), single blocks and pairs.
#[test]
fn ws_pairs_and_sm_limits_give_the_bits_of_single_blocks() {
    let Some(ctx) = gpu() else { return };
    let _ws = Forced::new(gemm::force_engine, Engine::Ws);
    let mut r = rng(211);
    let sizes = [1300usize, 0, 256, 257, 900, 129, 1408];
    let (od, _, g, rows) = groups_of(&ctx, &sizes);
    let groups = experts(&od, g, rows);
    let (hidden, width) = (584usize, 448usize);
    let x = rand_bf16(&mut r, rows * hidden);
    let w1 = rand_bf16(&mut r, g * hidden * width);
    let w3 = rand_bf16(&mut r, g * hidden * width);
    let dab = rand_bf16(&mut r, rows * 2 * width);
    let idx = permutation(&mut r, rows);
    let (xd, w1d, w3d, dd, idxd) = (
        up(&ctx, &x),
        up(&ctx, &w1),
        up(&ctx, &w3),
        up(&ctx, &dab),
        up(&ctx, &idx),
    );
    let run = |pairing: Pairing, sms: Option<u32>| {
        let _p = Forced::new(gemm::force_pairing, pairing);
        ctx.set_gemm_sms(sms);
        let before = gemm::paired_launches();
        let mut out: Vec<Vec<f32>> = Vec::new();
        for gather in [
            None,
            Some(Gather {
                index: &idxd,
                div: 1,
            }),
        ] {
            out.extend(up_swiglu_abh(
                &ctx,
                groups,
                (&xd, gather),
                (&w1d, &w3d),
                (hidden, width),
                rows,
            ));
        }
        out.push(dx_stored(
            &ctx,
            groups,
            (&dd, &w1d, &w3d),
            (width, hidden),
            rows,
        ));
        let paired = gemm::paired_launches() - before;
        let want = if pairing == Pairing::On { 3 } else { 0 };
        ctx.set_gemm_sms(None);
        assert_eq!(
            paired, want,
            "{paired} of 3 launches ran in pairs with {pairing:?}"
        );
        out
    };
    let single = run(Pairing::Off, None);
    // Pairs, then both engines on a few SMs (the GEMM's share beside a pipeline's exchange):
    // fewer blocks take more tiles each, the same bits.
    let others = [
        ("pairs", run(Pairing::On, None)),
        ("single blocks on 7 SMs", run(Pairing::Off, Some(7))),
        ("pairs on 7 SMs", run(Pairing::On, Some(7))),
    ];
    let names = [
        "a",
        "b",
        "h",
        "gathered a",
        "gathered b",
        "gathered h",
        "dx",
    ];
    for (what, other) in &others {
        for ((s, p), name) in single.iter().zip(other).zip(names) {
            assert!(
                s.iter().all(|v| v.is_finite()),
                "{name}: single blocks left NaN"
            );
            let same = s
                .iter()
                .zip(p)
                .filter(|(a, b)| a.to_bits() == b.to_bits())
                .count();
            assert_eq!(same, s.len(), "{name}: {what} differ from single blocks");
        }
    }
}

/// The warp-specialised weight-gradient kernel (forced on this thread) against a host f64
/// GEMM: groups of 0, 1, 257, 2100, 45, 700 and 3 rows (K not a multiple of the 64-row stage,
/// so every group's last stage ends inside it); M and N not multiples of the 128 × 256 tile
/// nor of its 64-column blocks, with more m-tiles than n-tiles and fewer (both tile orders);
/// each operand contiguous (TMA) or gathered through an index with a divisor (cp.async), all
/// four combinations; one chunk (the direct bf16 store, with the `[dW1 | dW3]` column split)
/// and three chunks (f32 partials and the reduce). Every element outside the operands (rows
/// past the groups' end up to the capacity, the padding columns of each row, the rows no
/// index names) is NaN, so a stage row that is not zeroed past a group's end, or a column
/// read past M / N, shows; outputs are poisoned first.
#[test]
fn ws_wgrad_odd_sizes_match_a_host_gemm() {
    let Some(ctx) = gpu() else { return };
    let _ws = Forced::new(gemm::force_wgrad_engine, Engine::Ws);
    let mut r = rng(131);
    let sizes = [0usize, 1, 257, 2100, 45, 700, 3];
    let (od, offsets, g, rows) = groups_of(&ctx, &sizes);
    let cap = rows + 40;
    let nan = bf16::from_f32(f32::NAN);
    // An operand of `cols` columns: `nrows` rows of `ld` elements, random inside, NaN in the
    // padding columns and in the rows from `live` on.
    let operand = |r: &mut ChaCha8Rng, nrows: usize, live: usize, cols: usize, ld: usize| {
        let mut v = rand_bf16(r, nrows * ld);
        for (i, x) in v.iter_mut().enumerate() {
            if i / ld >= live || i % ld >= cols {
                *x = nan;
            }
        }
        v
    };
    // (m, n, n1): 2 m-tiles x 2 n-tiles (the second of 72 m and of 72 n: one full and one
    // 8-column block), and 1 m-tile x 3 n-tiles (the last of 88 n).
    for (m, n, n1) in [(200usize, 328usize, 136usize), (72, 600, 264)] {
        for (a_gathered, b_gathered) in [(false, true), (true, false), (false, false), (true, true)]
        {
            let (lda, ldb) = (m + 8, n + 24);
            // Gathered: sum row j reads row index[j] / div of a buffer with NaN rows that no
            // index names; contiguous: row j of a buffer of `cap` rows, NaN from `rows` on.
            let (a_div, b_div) = (2usize, 3usize);
            let a_idx = permutation(&mut r, rows);
            let b_idx = permutation(&mut r, rows);
            let a_rows = if a_gathered {
                rows.div_ceil(a_div) + 5
            } else {
                cap
            };
            let b_rows = if b_gathered {
                rows.div_ceil(b_div) + 5
            } else {
                cap
            };
            let a_live = if a_gathered {
                rows.div_ceil(a_div)
            } else {
                rows
            };
            let b_live = if b_gathered {
                rows.div_ceil(b_div)
            } else {
                rows
            };
            let a = operand(&mut r, a_rows, a_live, m, lda);
            let b = operand(&mut r, b_rows, b_live, n, ldb);
            let arow = |j: usize| {
                if a_gathered {
                    a_idx[j] as usize / a_div
                } else {
                    j
                }
            };
            let brow = |j: usize| {
                if b_gathered {
                    b_idx[j] as usize / b_div
                } else {
                    j
                }
            };
            let (want, mag) = host_wgrad(
                &offsets,
                (m, n),
                |j, i| f64::from(a[arow(j) * lda + i].to_f32()),
                |j, jj| f64::from(b[brow(j) * ldb + jj].to_f32()),
            );
            let (ad, bd, aid, bid) = (
                up(&ctx, &a),
                up(&ctx, &b),
                up(&ctx, &a_idx),
                up(&ctx, &b_idx),
            );
            for splits in [1usize, 3] {
                let mut ws =
                    zeros::<f32>(&ctx, if splits > 1 { g * splits * m * n } else { 0 }).unwrap();
                poison(&ctx, &mut ws).unwrap();
                let a_op = k_operand(
                    &ad,
                    lda,
                    a_gathered.then_some(Gather {
                        index: &aid,
                        div: a_div,
                    }),
                );
                let b_op = k_operand(
                    &bd,
                    ldb,
                    b_gathered.then_some(Gather {
                        index: &bid,
                        div: b_div,
                    }),
                );
                let dims = (g, m, n, n1);
                let outs = wgrad_split(
                    &ctx,
                    experts(&od, g, cap),
                    (a_op, b_op),
                    dims,
                    splits,
                    &mut ws,
                );
                ctx.take_fault().unwrap();
                let got = joined(&ctx, &outs, dims);
                check(
                    &format!(
                        "ws wgrad m {m} n {n} n1 {n1} A gathered {a_gathered} B gathered \
                         {b_gathered} splits {splits}"
                    ),
                    &got,
                    &want,
                    &mag,
                );
            }
        }
    }
}
