//! The NCCL transport on a GPU (feature `nccl`): a world of one rank (the self exchange) with
//! odd spans against the expected bytes, a size mismatch and a span out of bounds (typed errors,
//! the communicator still usable), and the staged engine (classic EP on one rank) over NCCL
//! bit-identical to the oracle, a rejected round included. Without NCCL, a driver or a GPU each
//! test prints `SKIP: <reason>` and passes, unless `AFDEP_REQUIRE_GPU=1` (the GPU machine's run
//! script sets it), which makes the missing piece a failure.

use std::time::Duration;

use afdep_core::oracle::LayerParams;
use afdep_core::oracle::exchange::{self as reference, SourceInput};
use afdep_core::oracle::layer;
use afdep_core::route::{MASKED, Routes};
use afdep_core::tensor::uniform_bf16;
use afdep_core::{ExchangeConfig, LayerShape, RouteError, bf16};
use afdep_moe::{ExchangeError, StagedEngine};
use afdep_transport::{
    AnyTransport, Bootstrap, Nccl, Span, Transport, TransportBuffer, TransportError, TransportKind,
};

const TIMEOUT: Duration = Duration::from_secs(20);

fn require_gpu() -> bool {
    std::env::var("AFDEP_REQUIRE_GPU").is_ok_and(|v| !v.is_empty() && v != "0")
}

/// A world of one rank over NCCL, or `None` after `SKIP: <reason>`.
fn world_of_one() -> Option<Nccl> {
    if let Err(e) = TransportKind::Nccl.check_available(1) {
        if require_gpu() {
            panic!("AFDEP_REQUIRE_GPU is set, but NCCL is unavailable: {e}");
        }
        println!("SKIP: {e}");
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
    if world_of_one().is_none() {
        return;
    }
    let n = afdep_transport::nccl::probe(1).unwrap().devices;
    let e = TransportKind::Nccl.check_available(n + 1).unwrap_err();
    assert!(e.to_string().contains("GPUs"), "{e}");
}

fn routes(tokens: usize, k: usize, experts: usize, seed: usize) -> Routes {
    let mut idx = Vec::with_capacity(tokens * k);
    let mut weights = Vec::with_capacity(tokens * k);
    for t in 0..tokens {
        // expert 2 is hot; every slot with (t + j + seed) % 5 == 0 is masked
        let base = if t % 4 != 0 {
            2
        } else {
            (t * 7 + seed) % experts
        };
        for j in 0..k {
            idx.push(if (t + j + seed) % 5 == 0 {
                MASKED
            } else {
                ((base + j * 3) % experts) as i32
            });
            weights.push(0.05 + ((t * 11 + j * 5) % 19) as f32 / 19.0);
        }
    }
    Routes {
        tokens,
        top_k: k,
        idx,
        weights,
    }
}

#[test]
fn staged_engine_over_nccl_matches_the_oracle() {
    let Some(t) = world_of_one() else { return };
    let cfg = ExchangeConfig::new("EP1".parse().unwrap(), 64, 8, 3, 4096).unwrap();
    let p = LayerParams::random(
        LayerShape {
            d_model: 64,
            width: 16,
            experts: 8,
            top_k: 3,
            shared: 0,
            renormalize: true,
        },
        5,
    );
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
