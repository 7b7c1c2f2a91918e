//! fp8 payloads through the exchange engines over NvlinkIpc in-process ranks on one GPU: the
//! fused engine (the source quantises on the device while it stores into the slabs, the copy
//! epilogue expands codes and scales and dequantises) bit-identical to the oracle (codes,
//! scales and dequantised rows of the expanded layout and the compact view, and the combine)
//! and to the staged engine (host quantisation), for 3A:1F, 2A:2F, 1A:3F, EP4, 2A:1F, 1A:2F,
//! EP2, EP3 and EP1 at hidden 2048 and 7168, with uneven ranks, a zero-token rank, a hot
//! expert, masked slots and rows of zero, subnormal, huge, spiked and tied groups; outputs
//! poisoned; a non-finite row rejected on every rank with the next round working.
//!
//! Without a GPU every test prints `SKIP: <reason>` and passes; with `AFDEP_REQUIRE_GPU=1` a
//! missing GPU fails.

mod exchange_common;

use std::time::Duration;

use afdep_core::oracle::exchange::SourceInput;
use afdep_core::tensor::fp8_edge_groups;
use afdep_core::{ExchangeConfig, PayloadKind, RouteError, bf16};
use afdep_moe::{ExchangeError, FusedEngine, RoundOutput, StagedEngine};
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

fn fused(_rank: usize, cfg: ExchangeConfig, t: NvlinkIpc) -> Result<FusedEngine, ExchangeError> {
    FusedEngine::new(cfg, t)
}

fn staged(
    _rank: usize,
    cfg: ExchangeConfig,
    t: NvlinkIpc,
) -> Result<StagedEngine<NvlinkIpc>, ExchangeError> {
    StagedEngine::new(cfg, t)
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

/// The parts of a round's output that engines must agree on (not the times).
fn parts(
    r: &RoundOutput,
) -> (
    Option<Vec<u16>>,
    Option<afdep_core::oracle::exchange::FfnReceived>,
) {
    (
        r.combined
            .as_ref()
            .map(|c| c.iter().map(|v| v.to_bits()).collect()),
        r.received.clone(),
    )
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
    // the record's top-8 (64 experts here) at both hidden sizes
    for (topo, hidden) in [("3A:1F", 7168), ("2A:2F", 2048), ("1A:3F", 2048)] {
        let c = fp8_cfg(topo, hidden, 48, 8);
        fused_and_staged(&c, &edge_rounds(&c), None, 48 << 20);
    }
}

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
    let Some(g) = nvlink(4, 16 << 20) else {
        return;
    };
    let got = run_group(g, &vec![c.clone(); 4], &rounds, None, &fused).unwrap();
    check_round(&c, &good, &got[0], None);
    for (rank, r) in got[1].iter().enumerate() {
        match r {
            Err(ExchangeError::Route { reporter, error }) => {
                assert_eq!(*reporter, rank);
                match error {
                    RouteError::NonFinitePayload {
                        rank: 1,
                        token: 2,
                        channel: 1500,
                        value,
                    } if value.is_nan() => {}
                    other => panic!("rank {rank}: {other}"),
                }
            }
            other => panic!("rank {rank}: expected a non-finite payload, got {other:?}"),
        }
    }
    check_round(&c, &good, &got[2], None);
}

/// One rank that is both source and FFN rank (EP1), fp8 at hidden 2048 with edge groups: every
/// flag is raised and awaited on the same stream, so this one also runs under
/// compute-sanitizer (memcheck, racecheck).
#[test]
fn fused_fp8_single_rank_ep1() {
    let _serial = serial();
    let c = fp8_cfg("EP1", 2048, 12, 3);
    let rounds = edge_rounds(&c);
    let Some(g) = nvlink(1, 16 << 20) else {
        return;
    };
    let got = run_group(g, std::slice::from_ref(&c), &rounds, None, &fused).unwrap();
    for (inp, g) in rounds.iter().zip(&got) {
        check_round(&c, inp, g, None);
    }
}
