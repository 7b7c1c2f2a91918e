//! Device route validation against `afdep_core::route::validate`: the same error word for
//! every rejected class (first offence in (token, slot) order, within-slot check order), and a
//! valid call on the same context after each rejection.

mod common;

use afdep_core::RouteError;
use afdep_core::error::route_class;
use afdep_core::route::{MASKED, RouteRules, Routes, validate};
use afdep_kernels::ops::validate::{RouteValidator, validate_routes_with};
use afdep_kernels::{DeviceRoutes, GpuContext, KernelError, validate_routes};
use common::{EXPERTS, TOP_K, gpu, plant, rng, tokens, valid_routes};
use rand::Rng;

/// The device's word for `routes` (all zero when valid).
fn device_word(
    ctx: &GpuContext,
    v: &mut RouteValidator,
    routes: &Routes,
    rules: &RouteRules,
    rank: usize,
) -> [u32; 6] {
    let d = DeviceRoutes::upload(ctx, routes).unwrap();
    match validate_routes_with(ctx, v, &d, rules, rank) {
        Ok(()) => [0; 6],
        Err(KernelError::Route(e)) => e.to_word(),
        Err(e) => panic!("validation failed on the device: {e}"),
    }
}

fn cpu_word(routes: &Routes, rules: &RouteRules, rank: usize) -> [u32; 6] {
    match validate(routes, rules, rank) {
        Ok(()) => [0; 6],
        Err(e) => e.to_word(),
    }
}

#[test]
fn every_rejected_class_then_a_valid_call() {
    let Some(ctx) = gpu() else { return };
    let mut r = rng(11);
    let mut v = RouteValidator::new(&ctx).unwrap();
    let mut seen = [0usize; 8];
    for &t in &tokens() {
        for &e in &EXPERTS {
            for &k in &TOP_K {
                // Every expert owned, and some experts owned by no FFN rank (dummy ids).
                let owned_cases = if t >= 16384 {
                    vec![e - 16]
                } else {
                    vec![e, e - 16]
                };
                for owned in owned_cases {
                    let base = valid_routes(&mut r, t, k, owned, 0.1);
                    let base_d = DeviceRoutes::upload(&ctx, &base).unwrap();
                    let rules = RouteRules {
                        experts: e,
                        owned,
                        capacity: usize::MAX,
                        top_k: k,
                    };
                    let rank = r.gen_range(0..8);
                    let valid_again = |v: &mut RouteValidator, rules: &RouteRules| {
                        validate_routes_with(&ctx, v, &base_d, rules, rank)
                    };
                    valid_again(&mut v, &rules)
                        .unwrap_or_else(|e| panic!("valid table T={t} K={k}: {e}"));
                    let classes = [
                        route_class::DUPLICATE,
                        route_class::NEGATIVE,
                        route_class::WIDE,
                        route_class::DUMMY,
                        route_class::NON_FINITE_WEIGHT,
                    ];
                    for class in classes {
                        let mut bad = base.clone();
                        // One planted offence, sometimes a second one later, sometimes on the
                        // last token (the end of the grid).
                        let mut planted = 0;
                        for attempt in 0..20 {
                            let token = if attempt == 0 && r.gen_bool(0.3) {
                                t - 1
                            } else {
                                r.gen_range(0..t)
                            };
                            let slot = r.gen_range(0..k);
                            if plant(&mut r, &mut bad, &rules, class, token, slot) {
                                planted += 1;
                                if planted == 2 || r.gen_bool(0.5) {
                                    break;
                                }
                            }
                        }
                        if planted == 0 {
                            continue;
                        }
                        let want = cpu_word(&bad, &rules, rank);
                        assert_ne!(want[0], route_class::OK);
                        let got = device_word(&ctx, &mut v, &bad, &rules, rank);
                        assert_eq!(
                            got,
                            want,
                            "T={t} E={e} K={k} owned={owned}: {:?}",
                            RouteError::from_word(want)
                        );
                        seen[want[0] as usize] += 1;
                        // The same context and validator accept a valid table right after.
                        valid_again(&mut v, &rules).unwrap();
                    }
                    // Over capacity is checked before any slot (the table also has a bad slot).
                    let mut bad = base.clone();
                    plant(&mut r, &mut bad, &rules, route_class::NEGATIVE, 0, 0);
                    for cap in [0, t - 1] {
                        let rules = RouteRules {
                            capacity: cap,
                            ..rules
                        };
                        let want = cpu_word(&bad, &rules, rank);
                        assert_eq!(want[0], route_class::OVER_CAPACITY);
                        assert_eq!(device_word(&ctx, &mut v, &bad, &rules, rank), want);
                        seen[want[0] as usize] += 1;
                    }
                    let at_cap = RouteRules {
                        capacity: t,
                        ..rules
                    };
                    valid_again(&mut v, &at_cap).unwrap();
                }
            }
        }
    }
    for c in [1, 2, 3, 4, 5, 6] {
        assert!(seen[c] > 0, "class {c} never exercised: {seen:?}");
    }
}

#[test]
fn random_offences_first_one_wins() {
    let Some(ctx) = gpu() else { return };
    let mut r = rng(12);
    let mut v = RouteValidator::new(&ctx).unwrap();
    // Many offences of mixed classes in one table; a large table with K = 1 also runs the
    // scan's grid-stride loop (more tokens than 4096 blocks × 256 threads).
    let mut ran = 0;
    for &(t, k) in &[
        (1000usize, 8usize),
        (16384, 6),
        (1 << 20, 2),
        (2_100_000, 1),
    ] {
        if t > common::max_tokens() {
            continue;
        }
        ran += 1;
        let e = 96;
        let rules = RouteRules {
            experts: e,
            owned: 80,
            capacity: usize::MAX,
            top_k: k,
        };
        for trial in 0..6 {
            let mut bad = valid_routes(&mut r, t, k, 80, 0.05);
            let n = [1, 2, 5, 50, 1000, 3][trial];
            for _ in 0..n {
                let class = r.gen_range(1..=5);
                let (token, slot) = (r.gen_range(0..t), r.gen_range(0..k));
                plant(&mut r, &mut bad, &rules, class, token, slot);
            }
            let want = cpu_word(&bad, &rules, 3);
            assert_eq!(
                device_word(&ctx, &mut v, &bad, &rules, 3),
                want,
                "T={t} K={k} trial {trial}"
            );
        }
    }
    assert!(
        ran > 0,
        "AFDEP_TEST_MAX_TOKENS = {} leaves this sweep no case (the smallest is 1000 tokens)",
        common::max_tokens()
    );
}

#[test]
fn masked_slots_are_skipped_with_any_weight() {
    let Some(ctx) = gpu() else { return };
    let mut r = rng(13);
    for &k in &TOP_K {
        let mut routes = valid_routes(&mut r, 7, k, 64, 0.0);
        for t in 0..7 {
            routes.idx[t * k] = MASKED;
            routes.weights[t * k] = f32::NAN;
        }
        let rules = RouteRules {
            experts: 64,
            owned: 64,
            capacity: 7,
            top_k: k,
        };
        let d = DeviceRoutes::upload(&ctx, &routes).unwrap();
        validate_routes(&ctx, &d, &rules, 0).unwrap();
        // All slots masked, repeated -1 is not a duplicate.
        let all = Routes {
            tokens: 3,
            top_k: k,
            idx: vec![MASKED; 3 * k],
            weights: vec![f32::INFINITY; 3 * k],
        };
        let d = DeviceRoutes::upload(&ctx, &all).unwrap();
        validate_routes(
            &ctx,
            &d,
            &RouteRules {
                capacity: 3,
                ..rules
            },
            0,
        )
        .unwrap();
    }
}

#[test]
fn malformed_tables_are_rejected_on_the_host() {
    let Some(ctx) = gpu() else { return };
    let mut r = rng(14);
    let routes = valid_routes(&mut r, 5, 2, 64, 0.0);
    let d = DeviceRoutes::upload(&ctx, &routes).unwrap();
    let rules = RouteRules {
        experts: 64,
        owned: 64,
        capacity: usize::MAX,
        top_k: 4,
    };
    match validate_routes(&ctx, &d, &rules, 2) {
        Err(KernelError::Route(RouteError::Malformed { rank: 2, .. })) => {}
        other => panic!("expected Malformed, got {other:?}"),
    }
    let mut v = RouteValidator::new(&ctx).unwrap();
    // the tables of 5 tokens claimed to hold 6
    let six = DeviceRoutes {
        tokens: 6,
        top_k: 2,
        idx: d.idx.clone(),
        weights: d.weights.clone(),
    };
    let short = v.launch(&ctx, &six, &RouteRules { top_k: 2, ..rules }, 1);
    assert!(
        matches!(
            short,
            Err(KernelError::Route(RouteError::Malformed { rank: 1, .. }))
        ),
        "{short:?}"
    );
    // The context still works.
    validate_routes(&ctx, &d, &RouteRules { top_k: 2, ..rules }, 0).unwrap();
}

#[test]
fn empty_table_is_valid_and_checks_capacity() {
    let Some(ctx) = gpu() else { return };
    let d = DeviceRoutes::upload(&ctx, &Routes::empty(8)).unwrap();
    let rules = RouteRules {
        experts: 64,
        owned: 64,
        capacity: 0,
        top_k: 8,
    };
    validate_routes(&ctx, &d, &rules, 0).unwrap();
}
