//! A million tokens, top-8, hidden 640: the permuted buffer holds 2^23 rows × 640 =
//! 5.4·10^9 elements, past 2^32, so a 32-bit element offset anywhere in permute or un-permute
//! would land rows in the wrong place. Rows near the end and rows at random are checked bit for
//! bit against the layout's own slot order, and so are tokens near the end and at random after
//! un-permute; outputs are poisoned first.

mod common;

use afdep_kernels::ops::{download, poison, zeros};
use afdep_kernels::{CombineOrder, DeviceRoutes, KernelError, expert_layout, permute, unpermute};
use common::{bf16_bits, gpu, rng, size_allowed, valid_routes};
use half::bf16;
use rand::Rng;

/// x[token][c], a cheap deterministic function (the same on both sides).
fn xval(token: usize, c: usize) -> bf16 {
    bf16::from_f32(((token * 131 + c * 7) % 251) as f32 / 125.0 - 1.0)
}

#[test]
fn a_million_tokens_cross_2_32_elements() {
    if !size_allowed(1 << 20) {
        return;
    }
    let Some(ctx) = gpu() else { return };
    let (t, k, e, h) = (1usize << 20, 8usize, 64usize, 640usize);
    let mut r = rng(64);
    let routes = valid_routes(&mut r, t, k, e, 0.0);
    let slots = t * k;
    assert!(
        (slots as u64 - 1) * h as u64 > u32::MAX as u64,
        "the test must cross 2^32 elements"
    );
    let x: Vec<bf16> = (0..t * h).map(|i| xval(i / h, i % h)).collect();
    let s = ctx.stream();
    let xd = s
        .clone_htod(&x)
        .map_err(KernelError::driver("uploading x"))
        .unwrap();
    let rd = DeviceRoutes::upload(&ctx, &routes).unwrap();
    let layout = expert_layout(&ctx, &rd, e).unwrap();
    let mut xs = zeros::<bf16>(&ctx, slots * h).unwrap();
    poison(&ctx, &mut xs).unwrap();
    permute(&ctx, &xd, h, &layout, &mut xs).unwrap();
    let row_slot = download(&ctx, &layout.row_slot).unwrap();

    // the last 2048 rows, in one copy, and 2048 rows at random
    let mut rows: Vec<usize> = (slots - 2048..slots).collect();
    rows.extend((0..2048).map(|_| r.gen_range(0..slots)));
    let tail = s
        .clone_dtoh(&xs.slice((slots - 2048) * h..slots * h))
        .unwrap();
    for (i, &row) in rows.iter().enumerate() {
        let got: Vec<bf16> = if i < 2048 {
            tail[i * h..(i + 1) * h].to_vec()
        } else {
            s.clone_dtoh(&xs.slice(row * h..(row + 1) * h)).unwrap()
        };
        let slot = row_slot[row] as usize;
        assert!(slot < slots, "row {row} has no slot");
        let tok = slot / k;
        let want: Vec<bf16> = (0..h).map(|c| xval(tok, c)).collect();
        assert_eq!(
            bf16_bits(&got),
            bf16_bits(&want),
            "row {row} (slot {slot}) holds the wrong token"
        );
    }

    // un-permute with identity experts: out[t] = Σ_k w_k · x[t], slots ascending, unfused
    let mut out = zeros::<bf16>(&ctx, t * h).unwrap();
    poison(&ctx, &mut out).unwrap();
    unpermute(&ctx, &xs, h, &layout, &rd, CombineOrder::Slots, &mut out).unwrap();
    let mut toks: Vec<usize> = (t - 1024..t).collect();
    toks.extend((0..1024).map(|_| r.gen_range(0..t)));
    for &tok in &toks {
        let got = s.clone_dtoh(&out.slice(tok * h..(tok + 1) * h)).unwrap();
        let want: Vec<bf16> = (0..h)
            .map(|c| {
                let mut acc = 0f32;
                for j in 0..k {
                    let w = routes.weights[tok * k + j];
                    acc += w * xval(tok, c).to_f32();
                }
                bf16::from_f32(acc)
            })
            .collect();
        assert_eq!(
            bf16_bits(&got),
            bf16_bits(&want),
            "token {tok} un-permuted wrongly"
        );
    }
}
