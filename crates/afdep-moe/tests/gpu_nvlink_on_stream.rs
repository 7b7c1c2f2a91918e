//! The fused engine's device rounds and graph replays on a caller's device buffers, ordered on
//! the caller's stream (`FusedEngine::device_round_on_stream`, `FusedEngine::replay_on_stream`:
//! the Python bindings' path, `afdep.Exchange(engine="fused")`), over NvlinkIpc in-process
//! ranks on one GPU.
//!
//! Every rank captures one graph (`RoundArm::Auto`), then runs each round four ways: an eager
//! device round from the host (`device_round`), an eager device round on its own stream and
//! buffers (`device_round_on_stream`), a graph replay on them (`replay_on_stream`), and a
//! replay queued without waiting whose verdict `finish_queued` reads after, the caller's
//! output buffer filled with NaN first. Every rank's combined rows must be
//! bit-identical to the oracle (the device expert's host twin) in each way; the rounds change
//! token counts from replay to replay (odd counts, a zero-token rank, no token anywhere, a rank
//! at capacity). A non-finite weight on one source: the typed route error on every rank in both
//! on-stream ways, the caller's output NaN, and the next round exact. Ratios 3A:1F (hidden 40),
//! 2A:2F (hidden 136), EP2 (hidden 64).
//!
//! Without a GPU every test prints `SKIP: <reason>` and passes; with `AFDEP_REQUIRE_GPU=1` a
//! missing GPU fails.

mod exchange_common;

use std::sync::Arc;
use std::time::Duration;

use afdep_core::oracle::exchange::{self as reference, SourceInput};
use afdep_core::{ExchangeConfig, RouteError, bf16};
use afdep_kernels::cudarc::driver::{
    CudaContext, CudaSlice, CudaStream, DevicePtr, DeviceRepr, ValidAsZeroBits,
};
use afdep_kernels::quiet_stream;
use afdep_moe::{BorrowedRound, DeviceExperts, ExchangeError, FusedEngine, FusedGraph, RoundArm};
use exchange_common::*;

const TIMEOUT: Duration = Duration::from_secs(20);

/// The ways a round runs.
const WAYS: [&str; 4] = [
    "host",
    "on_stream",
    "replay_on_stream",
    "replay_on_stream without waiting, then finish_queued",
];

/// What one rank got from one round in one way: its combined rows (attention ranks).
type Got = Result<Option<Vec<bf16>>, ExchangeError>;

/// A caller's device copy of `host` (one element when empty: a zero-token rank's pointer is
/// never read).
fn dev<T: DeviceRepr + ValidAsZeroBits + Clone + Copy>(
    s: &Arc<CudaStream>,
    host: &[T],
) -> CudaSlice<T> {
    if host.is_empty() {
        s.alloc_zeros::<T>(1).unwrap()
    } else {
        s.clone_htod(host).unwrap()
    }
}

fn ptr<T>(s: &Arc<CudaStream>, b: &CudaSlice<T>) -> u64 {
    let (p, _guard) = b.device_ptr(s);
    p
}

/// One round on the caller's buffers and stream `s` (`graph`: a replay), the output filled
/// with NaN first; returns the output rows.
fn on_stream(
    eng: &mut FusedEngine,
    graph: Option<&FusedGraph>,
    s: &Arc<CudaStream>,
    input: Option<&SourceInput>,
    wait: bool,
) -> Got {
    let h = eng.config().hidden;
    let bufs = input.map(|inp| {
        let t = inp.routes.tokens;
        (
            t,
            dev(s, &inp.x),
            dev(s, &inp.routes.idx),
            dev(s, &inp.routes.weights),
            dev(s, &vec![bf16::from_bits(0xFFFF); t * h]),
        )
    });
    let borrowed = bufs.as_ref().map(|(t, x, i, w, o)| BorrowedRound {
        tokens: *t,
        x: ptr(s, x),
        idx: ptr(s, i),
        weights: ptr(s, w),
        out: ptr(s, o),
    });
    // SAFETY: the buffers are live allocations of device 0's primary context holding `tokens`
    // rows each, used only on `s` until it passes the round (read back below, on `s`); `out`
    // is its own allocation; `s` is a live stream of that context, not capturing.
    let r = unsafe {
        match graph {
            Some(g) => eng.replay_on_stream(g, borrowed.as_ref(), s.cu_stream(), wait),
            None => {
                eng.device_round_on_stream(RoundArm::Auto, borrowed.as_ref(), s.cu_stream(), wait)
            }
        }
    };
    // without waiting, the verdict is read now (the rows are ready once `s` passes the round,
    // read below on `s`)
    let r = r.and_then(|()| if wait { Ok(()) } else { eng.finish_queued() });
    // the output is read even after an error: a rejected round leaves the poisoned rows
    let out = bufs.map(|(t, .., o)| {
        let mut v: Vec<bf16> = s.clone_dtoh(&o).unwrap();
        v.truncate(t * h);
        v
    });
    if r.is_err() {
        if let Some(o) = &out {
            assert!(
                o.iter().all(|v| v.is_nan()),
                "rank {}: a failed round's output is not all NaN",
                eng.rank()
            );
        }
    }
    r.map(|()| out)
}

/// Runs `rounds` on a group for `c`: `[rank][round][way]`.
fn run(c: &ExchangeConfig, rounds: &[Vec<SourceInput>]) -> Option<Vec<Vec<Vec<Got>>>> {
    let world = c.topology.world_size();
    let g = fused_group(world, c, 16 << 20, TIMEOUT)?;
    // engines and graphs are dropped after every rank's thread is done
    let (per_rank, keep): (Vec<Vec<Vec<Got>>>, _) = on_fused_ranks(g, c, false, |rank, eng| {
        // the caller's stream, made before the capture (whose barrier follows every rank's)
        // and without cudarc's first-stream cuCtxSynchronize: that wait, on a rank whose peer's
        // round kernel already spins for it, held the round past its 20 s bound under load
        // (`afdep_kernels::quiet_stream`)
        let ctx = CudaContext::new(0).unwrap();
        let s = quiet_stream(&ctx).unwrap();
        let graph = eng.capture(RoundArm::Auto).expect("capture");
        let mut out = Vec::new();
        for inp in rounds {
            let mine = c.topology.attention_index(rank).map(|i| &inp[i]);
            let host = eng.device_round(RoundArm::Auto, mine).map(|o| o.combined);
            let eager = on_stream(eng, None, &s, mine, true);
            let replay = on_stream(eng, Some(&graph), &s, mine, true);
            let queued = on_stream(eng, Some(&graph), &s, mine, false);
            out.push(vec![host, eager, replay, queued]);
        }
        (out, graph)
    });
    drop(keep);
    Some(per_rank)
}

fn bits(v: &[bf16]) -> Vec<u16> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn on_stream_rounds_and_replays_match_the_oracle() {
    let _s = serial();
    for (topo, hidden) in [("3A:1F", 40), ("2A:2F", 136), ("EP2", 64)] {
        let c = cfg(topo, hidden, 8, 3);
        let a = c.topology.attention_count();
        let sets: [&[usize]; 5] = [
            &[13, 0, 29],
            &[1, 7, 0],
            &[64, 3, 0],
            &[0, 0, 0],
            &[29, 13, 1],
        ];
        let rounds: Vec<Vec<SourceInput>> = sets
            .iter()
            .enumerate()
            .map(|(i, t)| sources(&c, &t[..a], (i % 2 == 0).then_some(5), i as u64 + 3))
            .collect();
        let Some(got) = run(&c, &rounds) else {
            return;
        };
        let experts = DeviceExperts::index_scale(c.experts);
        for (r, inp) in rounds.iter().enumerate() {
            let want = reference::exchange(&c, inp, experts.host()).unwrap();
            for (w, way) in WAYS.iter().enumerate() {
                for (rank, per_rank) in got.iter().enumerate() {
                    let g = per_rank[r][w]
                        .as_ref()
                        .unwrap_or_else(|e| panic!("{topo} round {r} {way} rank {rank}: {e}"));
                    match c.topology.attention_index(rank) {
                        Some(s) => {
                            let rows = g.as_ref().expect("an attention rank's rows");
                            assert!(rows.iter().all(|v| !v.is_nan()), "{topo} {way}: NaN");
                            assert_eq!(
                                bits(rows),
                                bits(&want[s]),
                                "{topo} round {r} {way}: source {s} differs from the oracle"
                            );
                        }
                        None => assert!(g.is_none(), "{topo} {way}: an FFN rank's rows"),
                    }
                }
            }
        }
    }
}

#[test]
fn a_rejected_route_on_stream_fails_every_rank_and_the_next_round_works() {
    let _s = serial();
    let c = cfg("3A:1F", 40, 8, 3);
    let mut bad = fixed_sources(&c, &[5, 9, 4], 21);
    bad[1].routes.weights[2 * 3 + 1] = f32::NAN;
    let good = sources(&c, &[11, 0, 6], Some(2), 22);
    let rounds = vec![bad, good];
    let Some(got) = run(&c, &rounds) else {
        return;
    };
    for (w, way) in WAYS.iter().enumerate() {
        for (rank, per_rank) in got.iter().enumerate() {
            let e = per_rank[0][w]
                .as_ref()
                .expect_err("the bad round is rejected everywhere");
            let want = ExchangeError::Route {
                reporter: rank,
                error: RouteError::NonFiniteWeight {
                    rank: 1,
                    token: 2,
                    slot: 1,
                    value: f32::NAN,
                },
            };
            assert_eq!(e.to_string(), want.to_string(), "{way}, rank {rank}");
        }
    }
    let experts = DeviceExperts::index_scale(c.experts);
    let want = reference::exchange(&c, &rounds[1], experts.host()).unwrap();
    for (w, way) in WAYS.iter().enumerate() {
        for s in 0..3 {
            let rows = got[s][1][w].as_ref().unwrap().as_ref().unwrap();
            assert_eq!(
                bits(rows),
                bits(&want[s]),
                "{way}: source {s} after the rejection"
            );
        }
    }
}
