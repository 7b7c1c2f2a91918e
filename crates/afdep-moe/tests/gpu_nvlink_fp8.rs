//! fp8 payloads through the exchange engines over NvlinkIpc in-process ranks on one GPU: the
//! fused engine (the source quantises on the device while it stores into the slabs, the copy
//! epilogue expands codes and scales and dequantises) bit-identical to the oracle (codes,
//! scales and dequantised rows of the expanded layout and the compact view, and the combine)
//! and to the staged engine (host quantisation), for 3A:1F, 2A:2F, 1A:3F, EP4, 2A:1F, 1A:2F,
//! EP2, EP3 and EP1 at hidden 2048 and 7168, with uneven ranks, a zero-token rank, a hot
//! expert, masked slots and rows of zero, subnormal, huge, spiked and tied groups; outputs
//! poisoned; a non-finite row rejected on every rank with the next round working.
//!
//! Count-first with fp8: every arm (payload-first, count-first streaming, the source arm),
//! switching from round to round on the same engines, on 3A:1F, 2A:2F, 1A:3F and EP4 (uneven
//! ranks, a zero-token rank, a rank at capacity 256, a hot expert, masked slots, edge-case
//! groups) at hidden 2048 and 7168 (and 8192 at 3A:1F), under a small SM budget with non-default
//! knobs, with top-8, and on one rank (EP1): codes, scales and dequantised rows of both views, the
//! device plan and the combine bit-identical to the oracle, to the staged engine and across the
//! arms; the non-finite row rejected in every arm.
//!
//! Without a GPU every test prints `SKIP: <reason>` and passes; with `AFDEP_REQUIRE_GPU=1` a
//! missing GPU fails.

mod exchange_common;

use std::time::Duration;

use afdep_core::oracle::exchange::SourceInput;
use afdep_core::tensor::fp8_edge_groups;
use afdep_core::{ExchangeConfig, PayloadKind, RouteError, bf16};
use afdep_moe::FusedEngine;
use afdep_transport::{NvlinkIpc, NvlinkOptions};
use exchange_common::*;

const TIMEOUT: Duration = Duration::from_secs(20);

/// `n` in-process NvlinkIpc ranks on device 0 with `bytes` of staging and workspace each, or
/// `None` after printing `SKIP: <reason>`.
fn nvlink(n: usize, bytes: usize) -> Option<Vec<NvlinkIpc>> {
    let opts = NvlinkOptions {
        staging_bytes: bytes,
        workspace_bytes: bytes,
        timeout: TIMEOUT,
    };
    nvlink_group(n, opts)
}

fn fp8_cfg(topo: &str, hidden: usize, experts: usize, top_k: usize) -> ExchangeConfig {
    let mut c = cfg(topo, hidden, experts, top_k);
    c.payload = PayloadKind::Fp8E4m3;
    c.validate().unwrap();
    c
}

/// The every-ratio rounds with every row's groups turned into fp8 edge cases.
fn edge_rounds(c: &ExchangeConfig) -> Vec<Vec<SourceInput>> {
    let mut rounds = every_ratio_rounds(c);
    for (i, r) in rounds.iter_mut().enumerate() {
        for (s, src) in r.iter_mut().enumerate() {
            fp8_edge_groups(&mut src.x, c.hidden, (i * 5 + s) as u64);
        }
    }
    rounds
}

/// Runs `rounds` on the fused engine and on the staged engine (both over NvlinkIpc), checks
/// both against the oracle and each other; `p` the SwiGLU experts or the cheap scaling.
fn fused_and_staged(
    c: &ExchangeConfig,
    rounds: &[Vec<SourceInput>],
    p: Option<&afdep_core::oracle::LayerParams>,
    bytes: usize,
) {
    let world = c.topology.world_size();
    // at least what the engine needs (the count-first area grows it with hidden and capacity)
    let bytes = bytes.max(FusedEngine::workspace_bytes(c).next_multiple_of(1 << 20));
    let Some(g) = nvlink(world, bytes) else {
        return;
    };
    let got = run_group(g, &vec![c.clone(); world], rounds, p, &fused)
        .unwrap_or_else(|e| panic!("{}: set-up failed: {e:?}", c.topology));
    for (inp, g) in rounds.iter().zip(&got) {
        check_round(c, inp, g, p);
        for (rank, r) in g.iter().enumerate() {
            if let Some(rx) = &r.as_ref().unwrap().received {
                let f8 = rx.fp8.as_ref().expect("fp8 rows");
                assert_eq!(f8.expanded_q.len(), rx.expanded.len(), "rank {rank}");
            }
        }
    }
    let Some(g) = nvlink(world, bytes) else {
        return;
    };
    let staged_out = run_group(g, &vec![c.clone(); world], rounds, p, &staged)
        .unwrap_or_else(|e| panic!("{}: set-up failed: {e:?}", c.topology));
    for (i, (a, b)) in got.iter().zip(&staged_out).enumerate() {
        for (rank, (a, b)) in a.iter().zip(b).enumerate() {
            let (a, b) = (a.as_ref().unwrap(), b.as_ref().unwrap());
            assert!(
                parts(a) == parts(b),
                "{} hidden {} round {i} rank {rank}: fused != staged",
                c.topology,
                c.hidden
            );
        }
    }
}

#[test]
fn fused_fp8_is_bit_identical_to_the_oracle_and_the_staged_engine_for_every_ratio() {
    let _serial = serial();
    for topo in [
        "3A:1F", "2A:2F", "1A:3F", "EP4", "2A:1F", "1A:2F", "EP2", "EP3", "EP1",
    ] {
        let c = fp8_cfg(topo, 2048, 12, 3);
        // edge groups with the scaling experts (SwiGLU would overflow on the huge groups) ...
        fused_and_staged(&c, &edge_rounds(&c), None, 16 << 20);
        // ... and ordinary rows through the SwiGLU experts
        let p = params(&c, 8, 5);
        fused_and_staged(&c, &every_ratio_rounds(&c), Some(&p), 16 << 20);
    }
}

#[test]
fn fused_fp8_hidden_7168_and_top_8() {
    let _serial = serial();
    for topo in ["3A:1F", "2A:2F", "1A:3F", "EP4"] {
        let c = fp8_cfg(topo, 7168, 12, 3);
        fused_and_staged(&c, &edge_rounds(&c), None, 32 << 20);
    }
    // the reference record's top-8 (docs/design.md, "The reference record") (64 experts here) at
    // both hidden sizes
    for (topo, hidden) in [("3A:1F", 7168), ("2A:2F", 2048), ("1A:3F", 2048)] {
        let c = fp8_cfg(topo, hidden, 48, 8);
        fused_and_staged(&c, &edge_rounds(&c), None, 48 << 20);
    }
}

/// A NaN in a travelling row fails every rank with the typed error, in every arm (the device
/// round's payload check, `afdep_round_check_payload`, rejects it before anything moves), and
/// the next round of each arm is exact.
#[test]
fn fused_fp8_rejects_a_non_finite_row_on_every_rank_and_goes_on() {
    let _serial = serial();
    let c = fp8_cfg("2A:2F", 2048, 8, 2);
    let good = sources(&c, &[3, 0], Some(2), 12);
    let mut bad = sources(&c, &[4, 3], None, 3);
    // token 2 of source 1: NaN at channel 1500, with slot 0 unmasked so that it travels
    bad[1].routes.idx[2 * 2] = 1;
    bad[1].x[2 * 2048 + 1500] = bf16::NAN;
    let rounds: Vec<Vec<SourceInput>> = vec![good.clone(), bad, good.clone()];
    let Some(g) = nvlink(4, FusedEngine::workspace_bytes(&c).max(16 << 20)) else {
        return;
    };
    let got = run_arms_on(g, &c, &rounds, &FORCED, None);
    for g in &got[0] {
        check_round(&c, &good, g, None);
    }
    for (arm, g) in FORCED.iter().zip(&got[1]) {
        let what = format!("{arm:?} ");
        check_route_errors(
            g,
            &what,
            &"a non-finite payload",
            |rank, error| match error {
                RouteError::NonFinitePayload {
                    rank: 1,
                    token: 2,
                    channel: 1500,
                    value,
                } if value.is_nan() => {}
                other => panic!("{arm:?} rank {rank}: {other}"),
            },
        );
    }
    for g in &got[2] {
        check_round(&c, &good, g, None);
    }
}

/// One rank that is both source and FFN rank (EP1), fp8 at hidden 2048 with edge groups, every
/// arm: every flag is raised and awaited on the same stream, so this one also runs under
/// compute-sanitizer (memcheck, racecheck).
#[test]
fn fused_fp8_single_rank_ep1() {
    let _serial = serial();
    let c = fp8_cfg("EP1", 2048, 12, 3);
    let rounds = edge_rounds(&c);
    let Some(g) = nvlink(1, 16 << 20) else {
        return;
    };
    let got = run_arms_on(g, &c, &rounds, &FORCED, None);
    for (i, (inp, per_arm)) in rounds.iter().zip(&got).enumerate() {
        for g in per_arm {
            check_round(&c, inp, g, None);
        }
        check_arms_agree(&format!("EP1 round {i}"), per_arm);
    }
}

/// Every arm's output equal to the first arm's (bit for bit: combine and received views).
fn check_arms_agree(what: &str, per_arm: &[Vec<RankResult>]) {
    for (arm, g) in FORCED.iter().zip(per_arm).skip(1) {
        for (rank, (a, b)) in g.iter().zip(&per_arm[0]).enumerate() {
            let (a, b) = (a.as_ref().unwrap(), b.as_ref().unwrap());
            assert!(
                parts(a) == parts(b),
                "{what} rank {rank}: {arm:?} differs from {:?}",
                FORCED[0]
            );
        }
    }
}

/// Every arm of fp8 rounds against the oracle (every view, bit for bit: check_round), the
/// staged engine and each other; `rounds` run with every arm in turn on one fused group.
fn arms_and_staged(what: &str, c: &ExchangeConfig, rounds: &[Vec<SourceInput>]) {
    let world = c.topology.world_size();
    // the fused workspace, and room for the staged engine's all-to-all at capacity
    let bytes = FusedEngine::workspace_bytes(c)
        .next_multiple_of(1 << 20)
        .max(64 << 20);
    let Some(g) = nvlink(world, bytes) else {
        return;
    };
    let got = run_arms_on(g, c, rounds, &FORCED, None);
    let Some(g) = nvlink(world, bytes) else {
        return;
    };
    let st = run_group(g, &vec![c.clone(); world], rounds, None, &staged)
        .unwrap_or_else(|e| panic!("{what}: staged set-up failed: {e:?}"));
    for (i, ((inp, per_arm), st)) in rounds.iter().zip(&got).zip(&st).enumerate() {
        for (arm, g) in FORCED.iter().zip(per_arm) {
            check_round(c, inp, g, None);
            for (rank, (a, b)) in g.iter().zip(st).enumerate() {
                let (a, b) = (a.as_ref().unwrap(), b.as_ref().unwrap());
                if let Some(rx) = &a.received {
                    let f8 = rx.fp8.as_ref().expect("fp8 views");
                    assert_eq!(f8.expanded_q.len(), rx.expanded.len(), "{what} rank {rank}");
                    assert_eq!(f8.compact_q.len(), rx.compact_x.len(), "{what} rank {rank}");
                }
                assert!(
                    parts(a) == parts(b),
                    "{what} round {i} {arm:?} rank {rank}: fused != staged"
                );
            }
        }
        check_arms_agree(&format!("{what} round {i}"), per_arm);
    }
}

/// Rounds of `c` (capacity 256) for the count-first arms: uneven ranks with a zero-token rank
/// and a hot expert, edge-case groups; then a rank at capacity and others.
fn cf_rounds(c: &ExchangeConfig, seed: u64) -> Vec<Vec<SourceInput>> {
    let a = c.topology.attention_count();
    let mut first = sources(c, &[250, 0, 131, 9][..a], Some(7), seed);
    for (s, src) in first.iter_mut().enumerate() {
        fp8_edge_groups(&mut src.x, c.hidden, seed + s as u64);
    }
    vec![first, sources(c, &[3, 256, 0, 64][..a], Some(2), seed + 1)]
}

#[test]
fn fp8_count_first_arms_match_the_oracle_and_the_staged_engine() {
    let _serial = serial();
    for (hidden, topos) in [
        (2048, &["3A:1F", "2A:2F", "1A:3F", "EP4"][..]),
        (7168, &["3A:1F", "2A:2F", "1A:3F", "EP4"][..]),
        (8192, &["3A:1F"][..]),
    ] {
        for topo in topos {
            let t0 = std::time::Instant::now();
            let mut c = fp8_cfg(topo, hidden, 24, 4);
            c.capacity = 256;
            c.validate().unwrap();
            arms_and_staged(&format!("{topo} hidden {hidden}"), &c, &cf_rounds(&c, 21));
            println!(
                "fp8 {topo} hidden {hidden} capacity 256, every arm: {:.2} s",
                t0.elapsed().as_secs_f64()
            );
        }
    }
}

/// A small SM budget with every count-first knob at a non-default value (payload gate off,
/// work units of 3 warps and at least 5 rows, one epilogue block), and the record's top-8.
#[test]
fn fp8_count_first_arms_under_knobs_and_top_8() {
    let _serial = serial();
    let mut c = fp8_cfg("1A:3F", 2048, 24, 6);
    c.capacity = 256;
    c.knobs.transport_sms = 7;
    c.knobs.epilogue_sm_cap = 1;
    c.knobs.payload_gate = false;
    c.knobs.warps_per_unit = 3;
    c.knobs.min_rows_per_unit = 5;
    c.validate().unwrap();
    arms_and_staged("1A:3F knobs", &c, &cf_rounds(&c, 31));
    let mut c = fp8_cfg("3A:1F", 2048, 48, 8);
    c.capacity = 256;
    c.knobs.transport_sms = 23;
    c.validate().unwrap();
    arms_and_staged("3A:1F top-8", &c, &cf_rounds(&c, 41));
}
