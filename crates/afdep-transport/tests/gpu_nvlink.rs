//! NvlinkIpc in-process ranks on one GPU (feature `nvlink`): `all_to_all_v` with odd, uneven and
//! zero-length spans bit for bit against Loopback, several operations in a row; a size mismatch
//! is a typed error on the receiver and the group stays usable; a missing peer is a Timeout
//! naming it within the bound; host write/read bounds; the workspace peer table.
//!
//! Without a GPU every test prints `SKIP: <reason>` and passes; with `AFDEP_REQUIRE_GPU=1` a
//! missing GPU fails.
#![cfg(feature = "nvlink")]

mod common;

use std::time::{Duration, Instant};

use afdep_transport::{
    Loopback, NvlinkIpc, NvlinkOptions, Span, Transport, TransportBuffer, TransportError,
};

fn opts(timeout: Duration) -> NvlinkOptions {
    NvlinkOptions {
        staging_bytes: 1 << 20,
        workspace_bytes: 4096,
        timeout,
    }
}

/// `n` in-process ranks on device 0, or `None` after printing `SKIP: <reason>`.
fn group(n: usize, timeout: Duration) -> Option<Vec<NvlinkIpc>> {
    afdep_transport::testing::nvlink_group(n, opts(timeout))
}

/// Deterministic bytes of (rank, op).
fn bytes(rank: usize, op: usize, len: usize) -> Vec<u8> {
    let mut x =
        ((rank as u64 + 1) * 0x9E37_79B9_7F4A_7C15) ^ ((op as u64 + 7) * 0xBF58_476D_1CE4_E5B9);
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect()
}

/// Bytes rank `src` sends rank `dst` in operation `op`: odd and uneven, zero for some pairs.
fn pair_len(src: usize, dst: usize, op: usize) -> u64 {
    if (src + 2 * dst + op) % 4 == 1 {
        0
    } else {
        ((src * 37 + dst * 11 + op * 5) % 53 + 1) as u64 * 3
    }
}

/// Spans with gaps of `gap` bytes, laid out in the order `order`; and the total.
fn spans_in(order: &[usize], lens: &[u64], gap: u64) -> (Vec<Span>, u64) {
    let mut spans = vec![Span::EMPTY; lens.len()];
    let mut at = gap;
    for &p in order {
        spans[p] = Span::new(at, lens[p]);
        at += lens[p] + gap;
    }
    (spans, at)
}

struct Plan {
    send: Vec<u8>,
    send_spans: Vec<Span>,
    recv_len: usize,
    recv_spans: Vec<Span>,
}

fn plan(rank: usize, world: usize, op: usize) -> Plan {
    let send_lens: Vec<u64> = (0..world).map(|p| pair_len(rank, p, op)).collect();
    let recv_lens: Vec<u64> = (0..world).map(|p| pair_len(p, rank, op)).collect();
    let fwd: Vec<usize> = (0..world).collect();
    let rev: Vec<usize> = (0..world).rev().collect();
    let (send_spans, send_total) = spans_in(&fwd, &send_lens, 3);
    let (recv_spans, recv_total) = spans_in(&rev, &recv_lens, 5);
    Plan {
        send: bytes(rank, op, send_total as usize),
        send_spans,
        recv_len: recv_total as usize,
        recv_spans,
    }
}

const POISON: u8 = 0xA7;

/// Runs operation `op` of the plan on `t`, rank `rank` of `world` (the receive buffer poisoned
/// first); returns the plan and the bytes received.
fn run_op<T: Transport>(t: &mut T, rank: usize, world: usize, op: usize) -> (Plan, Vec<u8>) {
    let p = plan(rank, world, op);
    let mut send = t.alloc(p.send.len()).unwrap();
    send.write(0, &p.send).unwrap();
    let mut recv = t.alloc(p.recv_len).unwrap();
    recv.write(0, &vec![POISON; p.recv_len]).unwrap();
    t.all_to_all_v(&send, &p.send_spans, &mut recv, &p.recv_spans)
        .unwrap_or_else(|e| panic!("rank {rank} op {op}: {e}"));
    let mut out = vec![0u8; p.recv_len];
    recv.read(0, &mut out).unwrap();
    (p, out)
}

/// Runs `ops` operations on every rank of `group`; returns `[op][rank]` received bytes.
fn run_ops<T: Transport + Send>(group: Vec<T>, ops: usize) -> Vec<Vec<Vec<u8>>> {
    let world = group.len();
    let per_rank: Vec<Vec<Vec<u8>>> = std::thread::scope(|sc| {
        let hs: Vec<_> = group
            .into_iter()
            .enumerate()
            .map(|(rank, mut t)| {
                sc.spawn(move || {
                    (0..ops)
                        .map(|op| run_op(&mut t, rank, world, op).1)
                        .collect()
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().expect("rank panicked"))
            .collect()
    });
    (0..ops)
        .map(|op| per_rank.iter().map(|r| r[op].clone()).collect())
        .collect()
}

#[test]
fn all_to_all_v_matches_loopback_bit_for_bit() {
    for n in [2, 3, 4] {
        let Some(g) = group(n, Duration::from_secs(20)) else {
            return;
        };
        let ops = 4;
        let got = run_ops(g, ops);
        let want = run_ops(Loopback::group(n, Duration::from_secs(20)), ops);
        for op in 0..ops {
            for r in 0..n {
                let p = plan(r, n, op);
                // the poison between spans survives, every span holds its sender's bytes
                for (src, s) in p.recv_spans.iter().enumerate() {
                    let sent = plan(src, n, op);
                    let sp = sent.send_spans[r];
                    assert_eq!(
                        &got[op][r][s.offset as usize..(s.offset + s.len) as usize],
                        &sent.send[sp.offset as usize..(sp.offset + sp.len) as usize],
                        "{n} ranks, op {op}: rank {r}'s span from rank {src}"
                    );
                }
                assert!(got[op][r][..5].iter().all(|&b| b == POISON));
                assert_eq!(got[op][r], want[op][r], "{n} ranks, op {op}, rank {r}");
            }
        }
    }
}

#[test]
fn size_mismatch_is_typed_and_the_group_stays_usable() {
    let n = 3;
    let Some(g) = group(n, Duration::from_secs(20)) else {
        return;
    };
    let results: Vec<(Result<(), TransportError>, Vec<u8>)> = std::thread::scope(|sc| {
        let hs: Vec<_> = g
            .into_iter()
            .enumerate()
            .map(|(rank, mut t)| {
                sc.spawn(move || {
                    // op 0: rank 1 expects one byte too many from rank 0
                    let mut p = plan(rank, n, 0);
                    if rank == 1 {
                        p.recv_spans[0].len += 1;
                        p.recv_len += 1;
                    }
                    let mut send = t.alloc(p.send.len()).unwrap();
                    send.write(0, &p.send).unwrap();
                    let mut recv = t.alloc(p.recv_len).unwrap();
                    recv.write(0, &vec![POISON; p.recv_len]).unwrap();
                    let first = t.all_to_all_v(&send, &p.send_spans, &mut recv, &p.recv_spans);
                    let mut untouched = vec![0u8; p.recv_len];
                    recv.read(0, &mut untouched).unwrap();
                    if rank == 1 {
                        assert!(untouched.iter().all(|&b| b == POISON), "recv written");
                    }
                    // op 1: everyone agrees again
                    let p = plan(rank, n, 1);
                    let mut send = t.alloc(p.send.len()).unwrap();
                    send.write(0, &p.send).unwrap();
                    let mut recv = t.alloc(p.recv_len).unwrap();
                    t.all_to_all_v(&send, &p.send_spans, &mut recv, &p.recv_spans)
                        .unwrap_or_else(|e| panic!("rank {rank}, after the mismatch: {e}"));
                    let mut out = vec![0u8; p.recv_len];
                    recv.read(0, &mut out).unwrap();
                    (first, out)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (rank, (first, _)) in results.iter().enumerate() {
        match (rank, first) {
            (
                1,
                Err(TransportError::SizeMismatch {
                    rank: 1,
                    peer: 0,
                    expected,
                    got,
                    ..
                }),
            ) => assert_eq!(*expected, *got + 1),
            (1, other) => panic!("rank 1: expected a SizeMismatch from rank 0, got {other:?}"),
            (_, r) => assert!(r.is_ok(), "rank {rank}: {r:?}"),
        }
    }
    let want = run_ops(Loopback::group(n, Duration::from_secs(20)), 2);
    for (rank, (_, out)) in results.iter().enumerate() {
        // only spans carry defined bytes (recv was not poisoned in op 1): compare spans
        let p = plan(rank, n, 1);
        for s in &p.recv_spans {
            let r = s.offset as usize..(s.offset + s.len) as usize;
            assert_eq!(
                out[r.clone()],
                want[1][rank][r],
                "rank {rank} after the mismatch"
            );
        }
    }
}

#[test]
fn a_missing_peer_is_a_timeout_naming_it() {
    let n = 3;
    let bound = Duration::from_millis(400);
    let Some(g) = group(n, bound) else {
        return;
    };
    let late = n - 1;
    let (tx, rx) = std::sync::mpsc::channel::<()>();
    let results: Vec<Option<(Result<(), TransportError>, Duration)>> = std::thread::scope(|sc| {
        let mut rx = Some(rx);
        let hs: Vec<_> = g
            .into_iter()
            .enumerate()
            .map(|(rank, mut t)| {
                let tx = tx.clone();
                let rx = if rank == late { rx.take() } else { None };
                sc.spawn(move || {
                    if let Some(rx) = rx {
                        // stays alive without joining, until the others have given up
                        for _ in 0..n - 1 {
                            rx.recv().unwrap();
                        }
                        drop(t);
                        return None;
                    }
                    let p = plan(rank, n, 0);
                    let send = t.alloc(p.send.len()).unwrap();
                    let mut recv = t.alloc(p.recv_len).unwrap();
                    let t0 = Instant::now();
                    let r = t.all_to_all_v(&send, &p.send_spans, &mut recv, &p.recv_spans);
                    let waited = t0.elapsed();
                    tx.send(()).unwrap();
                    Some((r, waited))
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (rank, r) in results.into_iter().enumerate() {
        let Some((r, waited)) = r else {
            continue;
        };
        match r {
            Err(TransportError::Timeout { rank: rr, peer, .. }) => {
                assert_eq!(rr, rank);
                assert_eq!(peer, Some(late), "rank {rank} names the late rank");
            }
            other => panic!("rank {rank}: expected a Timeout, got {other:?}"),
        }
        assert!(waited >= bound, "rank {rank} gave up early: {waited:?}");
        assert!(waited < bound * 10, "rank {rank} waited {waited:?}");
    }
}

#[test]
fn gather_barrier_buffers_and_the_peer_table() {
    let n = 4;
    let Some(g) = group(n, Duration::from_secs(20)) else {
        return;
    };
    let tables: Vec<Vec<u64>> = g.iter().map(|t| t.workspace_peers().to_vec()).collect();
    for t in &tables {
        assert_eq!(
            t, &tables[0],
            "every rank of one device sees the same pointers"
        );
        let mut d = t.clone();
        d.sort();
        d.dedup();
        assert_eq!(d.len(), n, "distinct workspaces");
        assert!(t.iter().all(|p| p % 256 == 0), "aligned workspaces");
    }
    std::thread::scope(|sc| {
        for mut t in g {
            sc.spawn(move || {
                let r = t.rank();
                let all = t.all_gather(&[r as u8, 9]).unwrap();
                assert_eq!(all, (0..n).flat_map(|p| [p as u8, 9]).collect::<Vec<_>>());
                t.barrier().unwrap();
                // the device table holds the host table
                assert_eq!(t.read_workspace_peer_table().unwrap(), t.workspace_peers());
                assert_ne!(t.workspace_peer_table(), 0);
                let mut buf = t.alloc(8 * n).unwrap();
                let want: Vec<u8> = (0..8 * n as u8).collect();
                buf.write(0, &want).unwrap();
                let mut host = vec![0u8; 8 * n];
                buf.read(0, &mut host).unwrap();
                assert_eq!(host, want);
                // bounds
                let e = buf.write(8 * n - 3, &[0; 4]).unwrap_err();
                assert!(matches!(e, TransportError::OutOfBounds { .. }), "{e}");
                let e = buf.read(8 * n, &mut [0; 1]).unwrap_err();
                assert!(matches!(e, TransportError::OutOfBounds { .. }), "{e}");
            });
        }
    });
}

const CHILD_RANK: &str = "AFDEP_TEST_NVLINK_CHILD_RANK";
const CHILD_ADDR: &str = "AFDEP_TEST_NVLINK_CHILD_ADDR";
const CHILD_WORLD: &str = "AFDEP_TEST_NVLINK_CHILD_WORLD";

/// One rank of the multi-process test: `ops` operations, each rank's spans checked against
/// what its senders' plans say.
fn ipc_rank(mut t: NvlinkIpc, ops: usize) {
    let (rank, world) = (t.rank(), t.world_size());
    for op in 0..ops {
        let (p, out) = run_op(&mut t, rank, world, op);
        for (src, s) in p.recv_spans.iter().enumerate() {
            let sent = plan(src, world, op);
            let sp = sent.send_spans[rank];
            assert_eq!(
                &out[s.offset as usize..(s.offset + s.len) as usize],
                &sent.send[sp.offset as usize..(sp.offset + sp.len) as usize],
                "multi-process, op {op}: rank {rank}'s span from rank {src}"
            );
        }
    }
    // nobody unmaps a window a peer may still store into
    t.barrier().unwrap();
}

/// The multi-process mode on one GPU: this process is rank 0, it starts `world - 1` copies of
/// this test binary as the other ranks (CUDA IPC needs distinct processes), they meet through
/// the bootstrap on 127.0.0.1 and exchange IPC handles.
#[test]
fn multi_process_over_cuda_ipc() {
    const NAME: &str = "multi_process_over_cuda_ipc";
    const OPS: usize = 3;
    let timeout = Duration::from_secs(30);
    if let Ok(r) = std::env::var(CHILD_RANK) {
        let rank: usize = r.parse().unwrap();
        let world: usize = std::env::var(CHILD_WORLD).unwrap().parse().unwrap();
        let addr = std::env::var(CHILD_ADDR).unwrap().parse().unwrap();
        let boot = afdep_transport::Bootstrap::connect(addr, rank, world, timeout).unwrap();
        let t = NvlinkIpc::from_bootstrap(boot, 0, opts(timeout)).unwrap();
        ipc_rank(t, OPS);
        return;
    }
    if let Err(e) = afdep_transport::nvlink::probe_driver() {
        afdep_core::testing::skip_unavailable("NvlinkIpc", e);
        return;
    }
    for world in [2, 3] {
        let listener =
            afdep_transport::Bootstrap::listen("127.0.0.1:0".parse().unwrap(), world, timeout)
                .unwrap();
        let addr = listener.local_addr();
        let exe = std::env::current_exe().unwrap();
        let children: Vec<std::process::Child> = (1..world)
            .map(|r| {
                std::process::Command::new(&exe)
                    .args([NAME, "--exact", "--nocapture", "--test-threads=1"])
                    .env(CHILD_RANK, r.to_string())
                    .env(CHILD_WORLD, world.to_string())
                    .env(CHILD_ADDR, addr.to_string())
                    .spawn()
                    .unwrap()
            })
            .collect();
        let boot = listener.accept().unwrap();
        let t = NvlinkIpc::from_bootstrap(boot, 0, opts(timeout)).unwrap();
        ipc_rank(t, OPS);
        for (i, mut c) in children.into_iter().enumerate() {
            let st = c.wait().unwrap();
            assert!(
                st.success(),
                "{world} processes: rank {} failed: {st}",
                i + 1
            );
        }
    }
}
