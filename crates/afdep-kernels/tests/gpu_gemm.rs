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
use afdep_kernels::ops::gemm::{self, Engine, Gather, Groups, KOperand, RowWeights, RowsOut};
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
        let g = sizes.len();
        let rows: usize = sizes.iter().sum();
        let mut offsets = vec![0u64];
        for &s in sizes {
            offsets.push(offsets.last().unwrap() + s as u64);
        }
        let lda = m + 8;
        let ldb = n + 16;
        let brows = rows.div_ceil(div).max(1) + 3;
        let a = rand_bf16(&mut r, rows.max(1) * lda);
        let b = rand_bf16(&mut r, brows * ldb);
        // B row of sum row j: index[j] / div, a permutation of 0..rows scaled into range.
        let mut index: Vec<u32> = (0..rows as u32).collect();
        for i in (1..index.len()).rev() {
            let j = r.gen_range(0..=i);
            index.swap(i, j);
        }
        let index = if index.is_empty() { vec![0] } else { index };

        let mut want = vec![0f64; g * m * n];
        let mut mag = vec![0f64; g * m * n];
        for e in 0..g {
            for row in offsets[e] as usize..offsets[e + 1] as usize {
                let brow = index[row] as usize / div;
                for i in 0..m {
                    let av = f64::from(a[row * lda + i].to_f32());
                    for j in 0..n {
                        let p = av * f64::from(b[brow * ldb + j].to_f32());
                        want[(e * m + i) * n + j] += p;
                        mag[(e * m + i) * n + j] += p.abs();
                    }
                }
            }
        }
        let (ad, bd, idd, od) = (
            up(&ctx, &a),
            up(&ctx, &b),
            up(&ctx, &index),
            up(&ctx, &offsets),
        );
        for splits in [1usize, 3] {
            let mut ws =
                zeros::<f32>(&ctx, if splits > 1 { g * splits * m * n } else { 0 }).unwrap();
            let mut out = zeros::<bf16>(&ctx, g * m * n1).unwrap();
            let mut out2 = zeros::<bf16>(&ctx, g * m * (n - n1)).unwrap();
            poison(&ctx, &mut out).unwrap();
            poison(&ctx, &mut out2).unwrap();
            gemm::wgrad(
                &ctx,
                Groups::Experts {
                    offsets: &od,
                    experts: g,
                    capacity: rows,
                },
                KOperand {
                    buf: &ad,
                    ld: lda,
                    gather: None,
                },
                KOperand {
                    buf: &bd,
                    ld: ldb,
                    gather: Some(Gather { index: &idd, div }),
                },
                m,
                n,
                splits,
                &mut ws,
                &mut out,
                Some((&mut out2, n1)),
            )
            .unwrap();
            let o1 = download(&ctx, &out).unwrap();
            let o2 = download(&ctx, &out2).unwrap();
            let mut got = vec![0f32; g * m * n];
            for e in 0..g {
                for i in 0..m {
                    for j in 0..n {
                        got[(e * m + i) * n + j] = if j < n1 {
                            o1[(e * m + i) * n1 + j].to_f32()
                        } else {
                            o2[(e * m + i) * (n - n1) + j - n1].to_f32()
                        };
                    }
                }
            }
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
    let Some(ctx) = gpu() else { return };
    // The classic rows kernel (the default engine, ws, has its own test below).
    let _classic = ForcedEngine::new(Engine::Classic);
    let mut r = rng(71);
    let (tokens, top_k, width, hidden) = (97usize, 3usize, 40usize, 136usize);
    let sizes = [0usize, 100, 1, 0, 190];
    let g = sizes.len();
    let rows: usize = sizes.iter().sum();
    assert_eq!(rows, tokens * top_k);
    let mut offsets = vec![0u64];
    for s in sizes {
        offsets.push(offsets.last().unwrap() + s as u64);
    }
    // row → slot: a permutation of the slots.
    let mut row_slot: Vec<u32> = (0..rows as u32).collect();
    for i in (1..rows).rev() {
        let j = r.gen_range(0..=i);
        row_slot.swap(i, j);
    }
    let weights: Vec<f32> = (0..rows).map(|_| r.gen_range(0.0f32..1.0)).collect();
    let h = rand_bf16(&mut r, rows * width);
    let w2 = rand_bf16(&mut r, g * width * hidden);
    let acc0: Vec<f32> = (0..tokens * hidden)
        .map(|_| r.gen_range(-1.0f32..1.0))
        .collect();
    let mut want: Vec<f64> = acc0.iter().map(|&v| f64::from(v)).collect();
    let mut mag: Vec<f64> = acc0.iter().map(|&v| f64::from(v).abs()).collect();
    for e in 0..g {
        for row in offsets[e] as usize..offsets[e + 1] as usize {
            let slot = row_slot[row] as usize;
            let (t, w) = (slot / top_k, f64::from(weights[slot]));
            for j in 0..hidden {
                let mut s = 0f64;
                let mut sm = 0f64;
                for k in 0..width {
                    let p = f64::from(h[row * width + k].to_f32())
                        * f64::from(w2[(e * width + k) * hidden + j].to_f32());
                    s += p;
                    sm += p.abs();
                }
                want[t * hidden + j] += w * s;
                mag[t * hidden + j] += w * sm;
            }
        }
    }
    let (hd, w2d, od, rsd, wd) = (
        up(&ctx, &h),
        up(&ctx, &w2),
        up(&ctx, &offsets),
        up(&ctx, &row_slot),
        up(&ctx, &weights),
    );
    let mut acc = up(&ctx, &acc0);
    gemm::down(
        &ctx,
        Groups::Experts {
            offsets: &od,
            experts: g,
            capacity: rows,
        },
        &hd,
        &w2d,
        width,
        hidden,
        RowsOut::Scatter {
            acc: &mut acc,
            weights: RowWeights {
                row_slot: &rsd,
                weights: &wd,
                top_k,
            },
            weighted: true,
        },
    )
    .unwrap();
    let got = download(&ctx, &acc).unwrap();
    // f32 accumulators: the tolerance's bf16 term is far above the f32 error; keep it, the
    // magnitude term covers the order of the atomic adds.
    check("down scatter", &got, &want, &mag);
}

/// Expert groups of `sizes` rows: the device offsets and the host ones.
fn groups_of(ctx: &afdep_kernels::GpuContext, sizes: &[usize]) -> (CudaSlice<u64>, Vec<u64>) {
    let mut offsets = vec![0u64];
    for &s in sizes {
        offsets.push(offsets.last().unwrap() + s as u64);
    }
    (up(ctx, &offsets), offsets)
}

/// The up-projection with SwiGLU at widths and hiddens that are multiples of 8 but not of the
/// tile (N tails inside a 64-column half, K tails inside a 32-wide k-tile): h, and the a, b
/// the train step stores, against a host f64 GEMM; groups of 0 and 1 rows; outputs poisoned.
#[test]
fn up_swiglu_odd_sizes_match_a_host_gemm() {
    let Some(ctx) = gpu() else { return };
    // The classic rows kernel (the default engine, ws, has its own test below).
    let _classic = ForcedEngine::new(Engine::Classic);
    let mut r = rng(23);
    for (hidden, width) in [(136usize, 40usize), (72, 24), (264, 136)] {
        let sizes = [0usize, 37, 1, 130];
        let g = sizes.len();
        let rows: usize = sizes.iter().sum();
        let (od, offsets) = groups_of(&ctx, &sizes);
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
        let mut h = zeros::<bf16>(&ctx, n).unwrap();
        let mut a = zeros::<bf16>(&ctx, n).unwrap();
        let mut b = zeros::<bf16>(&ctx, n).unwrap();
        poison(&ctx, &mut h).unwrap();
        poison(&ctx, &mut a).unwrap();
        poison(&ctx, &mut b).unwrap();
        gemm::up_swiglu(
            &ctx,
            Groups::Experts {
                offsets: &od,
                experts: g,
                capacity: rows,
            },
            &xd,
            None,
            &w1d,
            &w3d,
            hidden,
            width,
            &mut h,
            Some(&mut a),
            Some(&mut b),
        )
        .unwrap();
        let f = |v: Vec<bf16>| v.iter().map(|x| x.to_f32()).collect::<Vec<f32>>();
        let what = format!("up_swiglu hidden {hidden} width {width}");
        check(
            &format!("{what} a"),
            &f(download(&ctx, &a).unwrap()),
            &wa,
            &ma,
        );
        check(
            &format!("{what} b"),
            &f(download(&ctx, &b).unwrap()),
            &wb,
            &mb,
        );
        check(
            &format!("{what} h"),
            &f(download(&ctx, &h).unwrap()),
            &wh,
            &mh,
        );
    }
}

/// The data gradient `[da | db]·[W1 | W3]ᵀ` with K switching from W1 to W3 at a width that is
/// not a multiple of the k-tile (the cp.async split) and at one that is (the TMA boxes), hidden
/// not a multiple of the tile; groups of 0 rows; output poisoned.
#[test]
fn dx_odd_sizes_match_a_host_gemm() {
    let Some(ctx) = gpu() else { return };
    // The classic rows kernel (the default engine, ws, has its own test below).
    let _classic = ForcedEngine::new(Engine::Classic);
    let mut r = rng(29);
    for (hidden, width) in [(136usize, 40usize), (72, 64), (40, 24)] {
        let sizes = [5usize, 0, 129, 0];
        let g = sizes.len();
        let rows: usize = sizes.iter().sum();
        let (od, offsets) = groups_of(&ctx, &sizes);
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
        let mut out = zeros::<bf16>(&ctx, rows * hidden).unwrap();
        poison(&ctx, &mut out).unwrap();
        gemm::dx(
            &ctx,
            Groups::Experts {
                offsets: &od,
                experts: g,
                capacity: rows,
            },
            &dd,
            &w1d,
            Some(&w3d),
            width,
            hidden,
            RowsOut::Store {
                out: &mut out,
                weights: None,
            },
        )
        .unwrap();
        let got: Vec<f32> = download(&ctx, &out)
            .unwrap()
            .iter()
            .map(|x| x.to_f32())
            .collect();
        check(
            &format!("dx hidden {hidden} width {width}"),
            &got,
            &want,
            &mag,
        );
    }
}

/// Forces an engine on this thread; the default comes back when dropped.
struct ForcedEngine;

impl ForcedEngine {
    fn new(engine: Engine) -> Self {
        gemm::force_engine(Some(engine));
        ForcedEngine
    }
}

impl Drop for ForcedEngine {
    fn drop(&mut self) {
        gemm::force_engine(None);
    }
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

/// The warp-specialised engine (forced on this thread) on every rows problem at odd sizes:
/// groups of 0, 1, 257 and uneven sizes (more 128 × 256 tiles than SMs for the wide
/// problems, so persistent blocks take several tiles), N not a multiple of the 256-column
/// tile nor of its 64-column TMA blocks, K not a multiple of 64; A by TMA (contiguous rows)
/// and by the producer's cp.async (gathered rows); the SwiGLU, weighted store, scatter and
/// SwiGLU-backward epilogues; the data gradient's K split between W1 and W3. Outputs
/// poisoned.
#[test]
fn ws_engine_odd_sizes_match_a_host_gemm() {
    let Some(ctx) = gpu() else { return };
    let _ws = ForcedEngine::new(Engine::Ws);
    let mut r = rng(97);
    let sizes = [0usize, 1, 257, 2100, 0, 45, 700, 3];
    let g = sizes.len();
    let rows: usize = sizes.iter().sum();
    let (od, offsets) = groups_of(&ctx, &sizes);
    let groups = Groups::Experts {
        offsets: &od,
        experts: g,
        capacity: rows,
    };
    let (hidden, width) = (1096usize, 328usize);
    // Gather: problem row r reads token row_slot[r] / 2 (two slots per token).
    let top_k = 2usize;
    let row_slot = permutation(&mut r, rows);
    let tokens = rows.div_ceil(top_k);
    let weights: Vec<f32> = (0..tokens * top_k)
        .map(|_| r.gen_range(0.1f32..1.0))
        .collect();
    let (rsd, wd) = (up(&ctx, &row_slot), up(&ctx, &weights));
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
        let (va, ma) = host_rows(
            &offsets,
            width,
            hidden,
            |row, kk| bf(&x, src(row) * hidden + kk),
            |e, kk, j| bw(&w1, e, kk, j),
        );
        let (vb, mb) = host_rows(
            &offsets,
            width,
            hidden,
            |row, kk| bf(&x, src(row) * hidden + kk),
            |e, kk, j| bw(&w3, e, kk, j),
        );
        let n = rows * width;
        let (mut wh, mut mh) = (vec![0f64; n], vec![0f64; n]);
        for i in 0..n {
            let s = 1.0 / (1.0 + (-va[i]).exp());
            wh[i] = va[i] * s * vb[i];
            mh[i] = 1.1 * vb[i].abs() * ma[i] + (va[i] * s).abs() * mb[i] + wh[i].abs() * 1e-3;
        }
        let mut h = zeros::<bf16>(&ctx, n).unwrap();
        let mut a = zeros::<bf16>(&ctx, n).unwrap();
        let mut b = zeros::<bf16>(&ctx, n).unwrap();
        poison(&ctx, &mut h).unwrap();
        poison(&ctx, &mut a).unwrap();
        poison(&ctx, &mut b).unwrap();
        let gather = gathered.then_some(Gather {
            index: &rsd,
            div: top_k,
        });
        gemm::up_swiglu(
            &ctx,
            groups,
            &xd,
            gather,
            &w1d,
            &w3d,
            hidden,
            width,
            &mut h,
            Some(&mut a),
            Some(&mut b),
        )
        .unwrap();
        let what = format!("ws up_swiglu gathered {gathered}");
        check(&format!("{what} a"), &f32s(&ctx, &a), &va, &ma);
        check(&format!("{what} b"), &f32s(&ctx, &b), &vb, &mb);
        check(&format!("{what} h"), &f32s(&ctx, &h), &wh, &mh);
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
        let mut out = zeros::<bf16>(&ctx, rows * hidden).unwrap();
        poison(&ctx, &mut out).unwrap();
        let rw = RowWeights {
            row_slot: &rsd,
            weights: &wd,
            top_k,
        };
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
        let mut want: Vec<f64> = acc0.iter().map(|&x| f64::from(x)).collect();
        let mut mag: Vec<f64> = acc0.iter().map(|&x| f64::from(x).abs()).collect();
        for row in 0..rows {
            let slot = row_slot[row] as usize;
            let (t, w) = (slot / top_k, f64::from(weights[slot]));
            for j in 0..hidden {
                want[t * hidden + j] += w * v[row * hidden + j];
                mag[t * hidden + j] += w * m[row * hidden + j];
            }
        }
        let mut acc = up(&ctx, &acc0);
        let rw = RowWeights {
            row_slot: &rsd,
            weights: &wd,
            top_k,
        };
        gemm::down(
            &ctx,
            groups,
            &hd,
            &w2d,
            width,
            hidden,
            RowsOut::Scatter {
                acc: &mut acc,
                weights: rw,
                weighted: true,
            },
        )
        .unwrap();
        check(
            "ws down scatter",
            &download(&ctx, &acc).unwrap(),
            &want,
            &mag,
        );
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
        let (dyd, ad, bd) = (up(&ctx, &dy), up(&ctx, &av), up(&ctx, &bv));
        let mut dab = zeros::<bf16>(&ctx, 2 * n).unwrap();
        let mut hw = zeros::<bf16>(&ctx, n).unwrap();
        let mut gsum = zeros::<f32>(&ctx, tokens * top_k).unwrap();
        poison(&ctx, &mut dab).unwrap();
        poison(&ctx, &mut hw).unwrap();
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
                a: &ad,
                b: &bd,
                dab: &mut dab,
                hw: Some(&mut hw),
                weights: Some(RowWeights {
                    row_slot: &rsd,
                    weights: &wd,
                    top_k,
                }),
                gsum: Some(&mut gsum),
            },
        )
        .unwrap();
        check("ws dh_dswiglu [da | db]", &f32s(&ctx, &dab), &wda, &mda);
        check("ws dh_dswiglu w·h", &f32s(&ctx, &hw), &whw, &mhw);
        check("ws dh_dswiglu g", &download(&ctx, &gsum).unwrap(), &wg, &mg);
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
        let mut out = zeros::<bf16>(&ctx, rows * hidden).unwrap();
        poison(&ctx, &mut out).unwrap();
        gemm::dx(
            &ctx,
            groups,
            &dd,
            &w1d,
            Some(&w3d),
            width,
            hidden,
            RowsOut::Store {
                out: &mut out,
                weights: None,
            },
        )
        .unwrap();
        check(
            &format!("ws dx width {width}"),
            &f32s(&ctx, &out),
            &want,
            &mag,
        );
    }
}
