//! Permute and un-permute against afdep-core: rows copied bit for bit, and the weighted sum
//! bit-identical to `oracle::exchange::combine_source` (slot order, and grouped by owner).

mod common;

use afdep_core::CombinePartials;
use afdep_core::oracle::exchange::combine_source;
use afdep_core::route::Routes;
use afdep_kernels::ops::{download, poison, zeros};
use afdep_kernels::{CombineOrder, DeviceRoutes, ExpertLayout, GpuContext, permute, unpermute};
use common::{EXPERTS, TOP_K, bf16_bits, gpu, random_bf16, rng, tokens, valid_routes};
use half::bf16;

/// Hidden sizes per token count: multiples of 8 (vector path) and odd ones (scalar path);
/// small at a million tokens to keep the host reference quick.
fn hiddens(t: usize) -> &'static [usize] {
    if t >= 1 << 20 {
        &[16]
    } else if t >= 16384 {
        &[64, 7]
    } else {
        &[8, 1, 100, 512]
    }
}

fn layout(ctx: &GpuContext, d: &DeviceRoutes, e: usize) -> ExpertLayout {
    let mut l = ExpertLayout::new(ctx, d.tokens, d.top_k, e).unwrap();
    l.build(ctx, &d.idx).unwrap();
    l
}

#[test]
fn permute_gathers_rows_in_expert_order() {
    let Some(ctx) = gpu() else { return };
    let mut r = rng(31);
    for &t in &tokens() {
        for &k in &TOP_K {
            let e = EXPERTS[(t + k) % EXPERTS.len()];
            let routes = valid_routes(&mut r, t, k, e, 0.1);
            let d = DeviceRoutes::upload(&ctx, &routes).unwrap();
            let l = layout(&ctx, &d, e);
            let row_slot = download(&ctx, &l.row_slot).unwrap();
            let total = *download(&ctx, &l.offsets).unwrap().last().unwrap() as usize;
            for &h in hiddens(t) {
                let x = random_bf16(&mut r, t * h, 2.0);
                let xd = ctx.stream().clone_htod(&x).unwrap();
                let mut xs = zeros::<bf16>(&ctx, t * k * h).unwrap();
                poison(&ctx, &mut xs).unwrap();
                permute(&ctx, &xd, h, &l, &mut xs).unwrap();
                let got = bf16_bits(&download(&ctx, &xs).unwrap());
                let xb = bf16_bits(&x);
                for row in 0..t * k {
                    let g = &got[row * h..(row + 1) * h];
                    if row < total {
                        let tok = row_slot[row] as usize / k;
                        assert_eq!(
                            g,
                            &xb[tok * h..(tok + 1) * h],
                            "T={t} K={k} H={h} row {row}"
                        );
                    } else {
                        assert!(
                            g.iter().all(|&b| b == 0xFFFF),
                            "T={t} K={k} H={h}: row {row} past the total was written"
                        );
                    }
                }
            }
        }
    }
}

fn check_unpermute(
    ctx: &GpuContext,
    routes: &Routes,
    e: usize,
    h: usize,
    order: CombineOrder,
    y: &[bf16],
    what: &str,
) {
    let d = DeviceRoutes::upload(ctx, routes).unwrap();
    let l = layout(ctx, &d, e);
    let slot_row = download(ctx, &l.slot_row).unwrap();
    let yd = ctx.stream().clone_htod(y).unwrap();
    let mut out = zeros::<bf16>(ctx, routes.tokens * h).unwrap();
    poison(ctx, &mut out).unwrap();
    unpermute(ctx, &yd, h, &l, &d, order, &mut out).unwrap();
    let got = download(ctx, &out).unwrap();
    let (owner, ranks): (Box<dyn Fn(usize) -> usize>, usize) = match order {
        CombineOrder::Slots => (Box::new(|_| 0), 1),
        CombineOrder::ByOwner { experts_per_rank } => (
            Box::new(move |x| x / experts_per_rank),
            e.div_ceil(experts_per_rank),
        ),
    };
    let rows: Vec<&[bf16]> = vec![y; ranks];
    let want = combine_source(
        routes,
        h,
        CombinePartials::F32,
        owner,
        |i| u64::from(slot_row[i]),
        &rows,
    );
    assert_eq!(bf16_bits(&got), bf16_bits(&want), "{what}");
}

#[test]
fn unpermute_is_bit_identical_to_core() {
    let Some(ctx) = gpu() else { return };
    let mut r = rng(32);
    for &t in &tokens() {
        for &k in &TOP_K {
            for &e in &EXPERTS {
                // The full matrix at the smaller sizes; one expert count per K beyond.
                if t >= 16384 && e != EXPERTS[k % EXPERTS.len()] {
                    continue;
                }
                let routes = valid_routes(&mut r, t, k, e, 0.15);
                for &h in hiddens(t) {
                    let y = random_bf16(&mut r, t * k * h, 3.0);
                    check_unpermute(
                        &ctx,
                        &routes,
                        e,
                        h,
                        CombineOrder::Slots,
                        &y,
                        &format!("T={t} K={k} E={e} H={h}"),
                    );
                    let by_owner = CombineOrder::ByOwner {
                        experts_per_rank: e / 4,
                    };
                    check_unpermute(
                        &ctx,
                        &routes,
                        e,
                        h,
                        by_owner,
                        &y,
                        &format!("by owner T={t} K={k} E={e} H={h}"),
                    );
                }
            }
        }
    }
}

#[test]
fn unpermute_of_fully_masked_tokens_is_zero() {
    let Some(ctx) = gpu() else { return };
    let mut r = rng(33);
    let routes = valid_routes(&mut r, 7, 8, 64, 1.0);
    let y = random_bf16(&mut r, 7 * 8 * 64, 1.0);
    check_unpermute(&ctx, &routes, 64, 64, CombineOrder::Slots, &y, "all masked");
}
