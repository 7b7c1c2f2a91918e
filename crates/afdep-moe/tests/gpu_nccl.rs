//! The NCCL transport on a GPU (feature `nccl`): a world of one rank (the self exchange) with
//! odd spans against the expected bytes, a size mismatch and a span out of bounds (typed errors,
//! the communicator still usable), and the staged engine (classic EP on one rank) over NCCL
//! bit-identical to the oracle, a rejected round included. Without NCCL, a driver or a GPU each
//! test prints `SKIP: <reason>` and passes, unless `AFDEP_REQUIRE_GPU=1` (the GPU machine's run
//! script sets it), which makes the missing piece a failure. One test at a time (the exchange
//! tests' lock): a graph capture must not overlap another test's synchronising calls.

use std::time::Duration;

use afdep_core::oracle::exchange::{self as reference, SourceInput};
use afdep_core::oracle::layer;
use afdep_core::route::Routes;
use afdep_core::tensor::uniform_bf16;
use afdep_core::{ExchangeConfig, RouteError, bf16};
use afdep_moe::{ExchangeError, StagedEngine};
use afdep_transport::{
    AnyTransport, Bootstrap, Nccl, Span, Transport, TransportBuffer, TransportError, TransportKind,
};

const TIMEOUT: Duration = Duration::from_secs(20);

/// A world of one rank over NCCL, or `None` after `SKIP: <reason>`.
fn world_of_one() -> Option<Nccl> {
    if let Err(e) = TransportKind::Nccl.check_available(1) {
        afdep_core::testing::skip_unavailable("NCCL", e);
        return None;
    }
    let l = Bootstrap::listen("127.0.0.1:0".parse().unwrap(), 1, TIMEOUT).unwrap();
    Some(Nccl::new(l.accept().unwrap(), Some(0)).expect("an NCCL world of one rank"))
}

fn pattern(n: usize, seed: u8) -> Vec<u8> {
    (0..n)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

#[test]
fn self_exchange_with_odd_spans() {
    let _serial = exchange_common::serial();
    let Some(mut t) = world_of_one() else { return };
    assert_eq!((t.rank(), t.world_size()), (0, 1));
    assert_eq!(t.kind(), TransportKind::Nccl);
    for (len, soff, roff) in [
        (517usize, 3usize, 11usize),
        (1, 0, 999),
        (0, 5, 7),
        (1 << 20, 1, 3),
    ] {
        let data = pattern(soff + len + 13, len as u8);
        let mut send = t.alloc(data.len()).unwrap();
        send.write(0, &data).unwrap();
        let rlen = roff + len + 5;
        let mut recv = t.alloc(rlen).unwrap();
        t.all_to_all_v(
            &send,
            &[Span::new(soff as u64, len as u64)],
            &mut recv,
            &[Span::new(roff as u64, len as u64)],
        )
        .unwrap();
        let mut got = vec![0xAAu8; rlen];
        recv.read(0, &mut got).unwrap();
        let mut want = vec![0u8; rlen];
        want[roff..roff + len].copy_from_slice(&data[soff..soff + len]);
        assert!(got == want, "len {len}, send at {soff}, recv at {roff}");
    }
    // the control plane of one rank
    assert_eq!(t.all_gather(&[7, 8, 9]).unwrap(), vec![7, 8, 9]);
    t.barrier().unwrap();
}

#[test]
fn size_mismatch_and_bad_spans_are_typed_and_leave_it_usable() {
    let _serial = exchange_common::serial();
    let Some(mut t) = world_of_one() else { return };
    let mut send = t.alloc(64).unwrap();
    send.write(0, &pattern(64, 1)).unwrap();
    let mut recv = t.alloc(64).unwrap();
    let e = t
        .all_to_all_v(&send, &[Span::new(0, 10)], &mut recv, &[Span::new(0, 12)])
        .unwrap_err();
    assert!(
        matches!(
            e,
            TransportError::SizeMismatch {
                rank: 0,
                peer: 0,
                expected: 12,
                got: 10,
                ..
            }
        ),
        "{e}"
    );
    let e = t
        .all_to_all_v(&send, &[Span::new(60, 10)], &mut recv, &[Span::new(0, 10)])
        .unwrap_err();
    assert!(
        matches!(e, TransportError::OutOfBounds { peer: Some(0), .. }),
        "{e}"
    );
    let e = t.all_to_all_v(&send, &[], &mut recv, &[]).unwrap_err();
    assert!(matches!(e, TransportError::InvalidArgument { .. }), "{e}");
    let e = recv.write(60, &[0; 8]).unwrap_err();
    assert!(matches!(e, TransportError::OutOfBounds { .. }), "{e}");
    // still usable
    t.all_to_all_v(&send, &[Span::new(8, 16)], &mut recv, &[Span::new(0, 16)])
        .unwrap();
    let mut got = vec![0u8; 16];
    recv.read(0, &mut got).unwrap();
    assert_eq!(got, pattern(64, 1)[8..24]);
    assert!(!t.is_closed());
}

#[test]
fn nccl_needs_a_gpu_per_rank() {
    let _serial = exchange_common::serial();
    if world_of_one().is_none() {
        return;
    }
    let n = afdep_transport::nccl::probe(1).unwrap().devices;
    let e = TransportKind::Nccl.check_available(n + 1).unwrap_err();
    assert!(e.to_string().contains("GPUs"), "{e}");
}

fn routes(tokens: usize, k: usize, experts: usize, seed: usize) -> Routes {
    // expert 2 is hot; every slot with (t + j + seed) % 5 == 0 is masked
    let masked = |t: usize, j: usize| (t + j + seed) % 5 == 0;
    exchange_common::patterned_routes(tokens, k, experts, seed, (4, 2), masked)
}

#[test]
fn staged_engine_over_nccl_matches_the_oracle() {
    let _serial = exchange_common::serial();
    let Some(t) = world_of_one() else { return };
    let cfg = ExchangeConfig::new("EP1".parse().unwrap(), 64, 8, 3, 4096).unwrap();
    let p = exchange_common::params(&cfg, 16, 5);
    // through the run-time choice of transport, as the CLI builds it
    let t = AnyTransport::Nccl(t);
    let mut eng = StagedEngine::new(cfg.clone(), t).unwrap();
    let expert = |e: usize, rows: &[bf16], n: usize| layer::expert_rows(&p, e, rows, n).unwrap();
    for (i, tokens) in [1usize, 0, 7, 1000, 4096].into_iter().enumerate() {
        let input = SourceInput {
            x: uniform_bf16(tokens * 64, 1.0, 9, i as u64),
            routes: routes(tokens, 3, 8, i),
        };
        let out = eng.round(Some(&input), &expert).unwrap();
        let want = reference::exchange(&cfg, std::slice::from_ref(&input), expert).unwrap();
        assert!(
            out.combined.as_ref() == Some(&want[0]),
            "{tokens} tokens: the staged engine over NCCL differs from the oracle"
        );
        // a rejected route, then the next round is fine
        let mut bad = input.clone();
        if tokens > 0 {
            bad.routes.idx[0] = 8;
            let e = eng.round(Some(&bad), &expert).unwrap_err();
            assert!(
                matches!(
                    e,
                    ExchangeError::Route {
                        error: RouteError::Wide { .. },
                        ..
                    }
                ),
                "{e}"
            );
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The NCCL device engine (afdep_moe::nccl_device): packing, expansion, experts and combine on
// the GPU, grouped ncclSend/ncclRecv of capacity-padded slabs, eager and replayed from a CUDA
// graph, bit-identical to the oracle (identity and scale experts; SwiGLU within the bf16
// tolerance), outputs poisoned before every round, what each FFN rank received (the device's plan, expanded rows and compact view) equal to
// the oracle's dispatch. NCCL refuses two ranks of one communicator on one GPU: a group of n
// ranks needs n GPUs, and the tests of a larger group print `SKIP` on a machine with fewer
// (even with AFDEP_REQUIRE_GPU, which still fails a machine without NCCL or a GPU).

mod exchange_common;

use afdep_moe::{DeviceExperts, ExchangeEngine, NcclDeviceEngine};
use exchange_common::{RankResult, every_ratio_rounds, fixed_sources, sources};

/// An in-process NCCL group of `n` ranks, rank r on GPU r, or `None` after `SKIP: <reason>`.
fn nccl_group(n: usize) -> Option<Vec<Nccl>> {
    world_of_one()?; // NCCL and a GPU at all (a failure with AFDEP_REQUIRE_GPU)
    if let Err(e) = TransportKind::Nccl.check_available(n) {
        println!("SKIP: {e}");
        return None;
    }
    let l = Bootstrap::listen("127.0.0.1:0".parse().unwrap(), n, TIMEOUT).unwrap();
    let addr = l.local_addr();
    let mut rest: Vec<_> = (1..n)
        .map(|r| {
            std::thread::spawn(move || {
                Nccl::new(Bootstrap::connect(addr, r, n, TIMEOUT).unwrap(), Some(r))
            })
        })
        .collect();
    let first = Nccl::new(l.accept().unwrap(), Some(0)).expect("rank 0's communicator");
    let mut group = vec![first];
    for h in rest.drain(..) {
        group.push(h.join().unwrap().expect("a rank's communicator"));
    }
    Some(group)
}

/// Runs `rounds` on NCCL device engines over `group` (poisoned outputs, received views kept,
/// captured first when `graph`): `[round][rank]`.
fn run_device(
    group: Vec<Nccl>,
    cfg: &ExchangeConfig,
    rounds: &[Vec<SourceInput>],
    experts: &DeviceExperts,
    graph: bool,
) -> Vec<Vec<RankResult>> {
    let world = cfg.topology.world_size();
    let make = |_rank: usize, c: ExchangeConfig, t: Nccl| {
        let mut e = NcclDeviceEngine::new(c, t, experts)?;
        e.set_poison(true);
        e.set_keep_received(true);
        e.set_round_timing(true)?;
        if graph {
            e.capture()?;
            assert!(e.is_captured());
        }
        Ok(e)
    };
    exchange_common::run_group(group, &vec![cfg.clone(); world], rounds, None, &make)
        .unwrap_or_else(|e| panic!("{}: set-up failed: {e:?}", cfg.topology))
}

/// One round against the oracle with `experts`: every source's combine bit for bit (no NaN from
/// the poison), every FFN rank's received views.
fn check(cfg: &ExchangeConfig, inp: &[SourceInput], got: &[RankResult], experts: &DeviceExperts) {
    exchange_common::check_round_with(cfg, inp, got, experts.host());
}

fn device_cfg(topo: &str, hidden: usize, experts: usize, top_k: usize) -> ExchangeConfig {
    ExchangeConfig::new(topo.parse().unwrap(), hidden, experts, top_k, 64).unwrap()
}

#[test]
fn device_engine_on_one_rank_matches_the_oracle() {
    let _serial = exchange_common::serial();
    // hidden 100: the scalar copies; 128: the 16-byte ones; odd token counts, none, capacity
    for (hidden, top_k) in [(100usize, 3usize), (128, 8)] {
        let cfg = device_cfg("EP1", hidden, 16, top_k);
        let rounds: Vec<Vec<SourceInput>> = [7usize, 1, 0, 33, 64]
            .iter()
            .enumerate()
            .map(|(i, &t)| sources(&cfg, &[t], (i % 2 == 0).then_some(5), i as u64 + 3))
            .collect();
        for experts in [DeviceExperts::Identity, DeviceExperts::index_scale(16)] {
            for graph in [false, true] {
                let Some(g) = nccl_group(1) else { return };
                let got = run_device(g, &cfg, &rounds, &experts, graph);
                for (inp, got) in rounds.iter().zip(&got) {
                    check(&cfg, inp, got, &experts);
                }
            }
        }
    }
}

#[test]
fn device_engine_rejects_a_route_and_runs_the_next_round() {
    let _serial = exchange_common::serial();
    let Some(mut g) = nccl_group(1) else { return };
    let cfg = device_cfg("EP1", 64, 8, 2);
    let experts = DeviceExperts::index_scale(8);
    let mut eng = NcclDeviceEngine::new(cfg.clone(), g.remove(0), &experts).unwrap();
    eng.set_poison(true);
    eng.set_keep_received(true);
    eng.set_round_timing(true).unwrap();
    eng.capture().unwrap();
    let good = fixed_sources(&cfg, &[9], 4);
    let mut bad = good[0].clone();
    bad.routes.idx[3] = 8; // wider than the 8 experts
    let e = eng.round(Some(&bad)).unwrap_err();
    assert!(
        matches!(
            e,
            ExchangeError::Route {
                error: RouteError::Wide { .. },
                ..
            }
        ),
        "{e}"
    );
    let out = eng.round(Some(&good[0]));
    check(&cfg, &good, &[out], &experts);
    let t = eng.round_time().expect("a timed round");
    assert!(t.as_nanos() > 0, "the round's device time is {t:?}");
    // over capacity: the host check rejects it on every rank, the engine stays open
    let big = sources(&cfg, &[65], None, 2);
    let e = eng.round(Some(&big[0])).unwrap_err();
    assert!(matches!(e, ExchangeError::Route { .. }), "{e}");
    let out = eng.round(Some(&good[0]));
    check(&cfg, &good, &[out], &experts);
}

#[test]
fn device_engine_rejects_what_it_does_not_support() {
    let _serial = exchange_common::serial();
    let Some(mut g) = nccl_group(1) else { return };
    let mut cfg = device_cfg("EP1", 128, 8, 2);
    cfg.payload = afdep_core::PayloadKind::Fp8E4m3;
    let e = NcclDeviceEngine::new(cfg, g.remove(0), &DeviceExperts::Identity).unwrap_err();
    assert!(matches!(e, ExchangeError::Input { .. }), "{e}");
    // bf16 combine partials: refused, never ignored
    let Some(mut g) = nccl_group(1) else { return };
    let cfg = exchange_common::bf16_partials(device_cfg("EP1", 128, 8, 2));
    let e = NcclDeviceEngine::new(cfg, g.remove(0), &DeviceExperts::Identity).unwrap_err();
    match &e {
        ExchangeError::Input { rank: 0, what } => assert!(what.contains("partials"), "{what}"),
        other => panic!("{other}"),
    }
}

/// Every ratio's rounds (a hot expert, uneven ranks, a zero-token rank, a round with no token)
/// on one group of `topo`, eager and from a graph, scale and identity experts. (The caller holds
/// the test lock: a capture must not overlap another test's synchronising calls.)
fn device_group_matches_the_oracle(topo: &str, hidden: usize, experts: usize, top_k: usize) {
    let cfg = device_cfg(topo, hidden, experts, top_k);
    let rounds = every_ratio_rounds(&cfg);
    for ex in [DeviceExperts::index_scale(experts), DeviceExperts::Identity] {
        for graph in [false, true] {
            let Some(g) = nccl_group(cfg.topology.world_size()) else {
                return;
            };
            let got = run_device(g, &cfg, &rounds, &ex, graph);
            for (inp, got) in rounds.iter().zip(&got) {
                check(&cfg, inp, got, &ex);
            }
        }
    }
}

#[test]
fn device_engine_3a1f_matches_the_oracle() {
    let _serial = exchange_common::serial();
    device_group_matches_the_oracle("3A:1F", 72, 16, 6);
}

#[test]
fn device_engine_2a2f_matches_the_oracle() {
    let _serial = exchange_common::serial();
    device_group_matches_the_oracle("2A:2F", 136, 16, 8);
}

#[test]
fn device_engine_ep2_matches_the_oracle() {
    let _serial = exchange_common::serial();
    device_group_matches_the_oracle("EP2", 64, 8, 2);
}

/// The SwiGLU experts (the fused device round's grouped GEMMs over the device plan's groups):
/// the combine within the bf16 tolerance of the oracle's `expert_rows`, what each FFN rank
/// received bit for bit, eager and graph giving the same bits; EP1 on one GPU, 2A:2F on 4.
#[test]
fn device_engine_swiglu_is_within_tolerance() {
    let _serial = exchange_common::serial();
    for topo in ["EP1", "2A:2F"] {
        let mut cfg = device_cfg(topo, 64, 12, 2);
        cfg.capacity = 40;
        let p = exchange_common::params(&cfg, 32, 7);
        let experts = DeviceExperts::SwiGlu(std::sync::Arc::new(p.clone()));
        let a = cfg.topology.attention_count();
        let rounds = vec![
            sources(&cfg, &[37, 0][..a], Some(3), 101),
            sources(&cfg, &[1, 40][..a], None, 102),
        ];
        let mut by_mode = Vec::new();
        for graph in [false, true] {
            let Some(g) = nccl_group(cfg.topology.world_size()) else {
                return;
            };
            by_mode.push(run_device(g, &cfg, &rounds, &experts, graph));
        }
        for (i, inp) in rounds.iter().enumerate() {
            let want = reference::exchange(&cfg, inp, experts.host()).unwrap();
            let want_rx = reference::dispatch(&cfg, inp).unwrap();
            for (rank, r) in by_mode[0][i].iter().enumerate() {
                let r = r
                    .as_ref()
                    .unwrap_or_else(|e| panic!("{topo} rank {rank}: {e}"));
                if let Some(s) = cfg.topology.attention_index(rank) {
                    let got = r.combined.as_ref().unwrap();
                    assert!(
                        got.iter().all(|v| !v.is_nan()),
                        "NaN in rank {rank}'s output"
                    );
                    let err = afdep_moe::accuracy::max_rel_err(got, &want[s]);
                    assert!(
                        err <= afdep_moe::accuracy::OUT_TOL,
                        "{topo} round {i} source {s}: error {err}"
                    );
                    println!("{topo} round {i} source {s}: max rel err {err:.2e}");
                }
                if let Some(f) = cfg.topology.ffn_index(rank) {
                    assert_eq!(r.received.as_ref().unwrap(), &want_rx[f]);
                }
                let replayed = by_mode[1][i][rank].as_ref().unwrap();
                assert!(
                    replayed.combined == r.combined,
                    "{topo} round {i} rank {rank}: the graph differs from the eager round"
                );
            }
        }
    }
}
