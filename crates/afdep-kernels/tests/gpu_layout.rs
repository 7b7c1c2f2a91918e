//! The device layout against afdep-core: counts (`SourceCounts`), 64-bit offsets
//! (`exclusive_prefix`), and the stable sort (`block_positions`), bit for bit, with outputs
//! poisoned before each run.

mod common;

use afdep_core::ExpertPlacement;
use afdep_core::layout::{SourceCounts, block_positions, exclusive_prefix};
use afdep_core::route::Routes;
use afdep_kernels::ops::layout::NO_ROW;
use afdep_kernels::ops::{download, poison};
use afdep_kernels::{DeviceRoutes, ExpertLayout, GpuContext};
use common::{EXPERTS, TOP_K, gpu, rng, skewed_routes, tokens, valid_routes};

fn check(ctx: &GpuContext, routes: &Routes, experts: usize, what: &str) {
    let d = DeviceRoutes::upload(ctx, routes).unwrap();
    let mut l = ExpertLayout::new(ctx, routes.tokens, routes.top_k, experts).unwrap();
    poison(ctx, &mut l.counts).unwrap();
    poison(ctx, &mut l.offsets).unwrap();
    poison(ctx, &mut l.slot_row).unwrap();
    poison(ctx, &mut l.row_slot).unwrap();
    l.build(ctx, &d.idx).unwrap();

    let p = ExpertPlacement {
        experts,
        ffn_ranks: 1,
        experts_per_rank: experts,
    };
    let want_counts = SourceCounts::build(routes, &p).expert_rows;
    let want_offsets = exclusive_prefix(&want_counts);
    assert_eq!(
        download(ctx, &l.counts).unwrap(),
        want_counts,
        "{what}: counts"
    );
    assert_eq!(
        download(ctx, &l.offsets).unwrap(),
        want_offsets,
        "{what}: offsets"
    );
    let slot_row = download(ctx, &l.slot_row).unwrap();
    let row_slot = download(ctx, &l.row_slot).unwrap();
    let pos = block_positions(routes, &p);
    let total = want_offsets[experts] as usize;
    for (i, q) in pos.iter().enumerate() {
        match q {
            None => assert_eq!(slot_row[i], NO_ROW, "{what}: masked slot {i}"),
            Some(q) => {
                let row = want_offsets[routes.idx[i] as usize] + q;
                assert_eq!(u64::from(slot_row[i]), row, "{what}: row of slot {i}");
                assert_eq!(
                    row_slot[row as usize] as usize, i,
                    "{what}: slot of row {row}"
                );
            }
        }
    }
    assert!(
        row_slot[total..].iter().all(|&s| s == NO_ROW),
        "{what}: rows past the total"
    );

    // Building again into the same buffers (as a layer step does) gives the same result.
    l.build(ctx, &d.idx).unwrap();
    assert_eq!(
        download(ctx, &l.slot_row).unwrap(),
        slot_row,
        "{what}: rebuild"
    );
}

#[test]
fn layout_matches_core_on_random_routes() {
    let Some(ctx) = gpu() else { return };
    let mut r = rng(21);
    for &t in &tokens() {
        for &e in &EXPERTS {
            for &k in &TOP_K {
                let routes = valid_routes(&mut r, t, k, e, 0.1);
                check(&ctx, &routes, e, &format!("random T={t} E={e} K={k}"));
            }
        }
    }
}

#[test]
fn layout_matches_core_on_skewed_routes() {
    // Every token on experts 0..K: counts of a million rows per expert, spread over every
    // layout block; and a table whose slots are all masked.
    let Some(ctx) = gpu() else { return };
    let mut r = rng(22);
    for &t in &tokens() {
        for &(e, k) in &[(64usize, 8usize), (96, 1), (128, 6)] {
            let routes = skewed_routes(&mut r, t, k);
            check(&ctx, &routes, e, &format!("skewed T={t} E={e} K={k}"));
        }
    }
    let all_masked = valid_routes(&mut r, 1000, 2, 64, 1.0);
    check(&ctx, &all_masked, 64, "all masked");
    check(&ctx, &Routes::empty(8), 128, "empty");
}

/// A token limit below every count of the sweep fails it (`common::tokens`), on any machine:
/// this binary runs itself with `AFDEP_TEST_MAX_TOKENS=0` on the probe below.
#[test]
fn a_sweep_left_without_cases_fails() {
    let run = |limit: &str| {
        std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "tokens_probe", "--nocapture"])
            .env("AFDEP_TOKENS_PROBE", "1")
            .env("AFDEP_TEST_MAX_TOKENS", limit)
            .output()
            .unwrap()
    };
    let none = run("0");
    let text =
        String::from_utf8_lossy(&none.stderr).to_string() + &String::from_utf8_lossy(&none.stdout);
    assert!(!none.status.success(), "{text}");
    assert!(text.contains("leaves this sweep no token count"), "{text}");
    let seven = run("7");
    assert!(seven.status.success());
    assert!(String::from_utf8_lossy(&seven.stdout).contains("probe: [1, 7]"));
}

/// `common::tokens` is `TOKENS` up to the limit (also the probe of
/// [`a_sweep_left_without_cases_fails`], which runs it under limits of its own).
#[test]
fn tokens_probe() {
    let want: Vec<usize> = common::TOKENS
        .into_iter()
        .filter(|&t| t <= common::max_tokens())
        .collect();
    assert_eq!(tokens(), want);
    if std::env::var("AFDEP_TOKENS_PROBE").is_ok() {
        println!("probe: {want:?}");
    }
}
