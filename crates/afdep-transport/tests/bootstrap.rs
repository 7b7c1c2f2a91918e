//! Bootstrap over 127.0.0.1: four ranks as threads, blobs of different lengths, and the failure
//! modes (a rank that never connects, a rank that leaves, a rank that stalls, handshake errors).
//! Also HostTcp, the Transport over the bootstrap.

mod common;

use std::net::{SocketAddr, TcpListener};
use std::time::{Duration, Instant};

use afdep_transport::{Bootstrap, HostTcp, Span, Transport, TransportError, TransportKind};
use common::{LONG, a2a_round, gather_round, on_ranks};

fn localhost0() -> SocketAddr {
    "127.0.0.1:0".parse().unwrap()
}

/// Forms a group of `world` ranks on an ephemeral port and runs `f(rank, bootstrap)` on each
/// rank's thread; `f` gets the connect/accept error of its rank if forming failed.
fn group<R: Send>(
    world: usize,
    timeout: Duration,
    f: impl Fn(usize, Result<Bootstrap, TransportError>) -> R + Sync,
) -> Vec<R> {
    let listener = Bootstrap::listen(localhost0(), world, timeout).unwrap();
    let addr = listener.local_addr();
    assert_ne!(addr.port(), 0);
    let mut listener = Some(listener);
    let slots: Vec<_> = (0..world)
        .map(|r| if r == 0 { listener.take() } else { None })
        .collect();
    on_ranks(slots, |r, l| {
        let boot = match l {
            Some(l) => l.accept(),
            None => Bootstrap::connect(addr, r, world, timeout),
        };
        f(r, boot)
    })
}

fn blob(round: usize, rank: usize) -> Vec<u8> {
    (0..(rank * 7 + round * 3) % 23)
        .map(|i| (i * 13 + rank * 5 + round) as u8)
        .collect()
}

#[test]
fn four_ranks_gather_broadcast_barrier_all_to_all() {
    let out = group(4, LONG, |r, b| -> Result<(), TransportError> {
        let mut b = b?;
        assert_eq!((b.rank(), b.world_size()), (r, 4));
        for round in 0..20 {
            let all = b.all_gather(&blob(round, r))?;
            assert_eq!(all, (0..4).map(|p| blob(round, p)).collect::<Vec<_>>());
            let mine = if r == 0 { blob(round, 9) } else { Vec::new() };
            assert_eq!(b.broadcast(&mine)?, blob(round, 9));
            b.barrier()?;
            let per_dst: Vec<Vec<u8>> = (0..4).map(|d| blob(round, r * 4 + d)).collect();
            let got = b.all_to_all(&per_dst)?;
            assert_eq!(
                got,
                (0..4).map(|s| blob(round, s * 4 + r)).collect::<Vec<_>>()
            );
        }
        Ok(())
    });
    for (r, res) in out.into_iter().enumerate() {
        res.unwrap_or_else(|e| panic!("rank {r}: {e}"));
    }
}

#[test]
fn a_world_of_one() {
    let mut b = Bootstrap::connect(localhost0(), 0, 1, LONG).unwrap();
    assert_eq!(b.all_gather(b"x").unwrap(), vec![b"x".to_vec()]);
    assert_eq!(b.broadcast(b"yz").unwrap(), b"yz");
    b.barrier().unwrap();
    assert_eq!(b.all_to_all(&[b"q"]).unwrap(), vec![b"q".to_vec()]);
}

#[test]
fn other_ranks_may_start_before_rank_0() {
    // pre-pick a free port, then let rank 0 bind it only after the others started connecting
    let port = TcpListener::bind(localhost0())
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let addr: SocketAddr = ([127, 0, 0, 1], port).into();
    let out = on_ranks(vec![(); 3], |r, ()| {
        if r == 0 {
            std::thread::sleep(Duration::from_millis(150));
        }
        let mut b = Bootstrap::connect(addr, r, 3, Duration::from_secs(5))?;
        b.all_gather(&[r as u8])
    });
    for res in out {
        assert_eq!(res.unwrap(), vec![vec![0], vec![1], vec![2]]);
    }
}

#[test]
fn a_rank_that_never_connects_is_named_by_everyone() {
    let timeout = Duration::from_millis(300);
    let t0 = Instant::now();
    let listener = Bootstrap::listen(localhost0(), 4, timeout).unwrap();
    let addr = listener.local_addr();
    let mut listener = Some(listener);
    // rank 3 is never started
    let slots: Vec<_> = (0..3)
        .map(|r| if r == 0 { listener.take() } else { None })
        .collect();
    let out = on_ranks(slots, |r, l| match l {
        Some(l) => l.accept().map(|_| ()),
        None => Bootstrap::connect(addr, r, 4, timeout).map(|_| ()),
    });
    assert!(
        t0.elapsed() < Duration::from_secs(3),
        "took {:?}",
        t0.elapsed()
    );
    for (r, res) in out.into_iter().enumerate() {
        match res {
            Err(TransportError::Timeout {
                rank,
                peer: Some(3),
                ..
            }) => assert_eq!(rank, r),
            other => panic!("rank {r}: expected a timeout naming rank 3, got {other:?}"),
        }
    }
}

#[test]
fn a_rank_that_leaves_is_reported_as_gone_by_everyone() {
    let t0 = Instant::now();
    let out = group(4, Duration::from_secs(5), |r, b| {
        let mut b = b.unwrap();
        b.barrier().unwrap();
        if r == 3 {
            drop(b);
            return None;
        }
        let first = b.all_gather(&[r as u8; 3]);
        let after = b.barrier();
        Some((first, after))
    });
    assert!(
        t0.elapsed() < Duration::from_secs(2),
        "took {:?}",
        t0.elapsed()
    );
    for (r, res) in out.into_iter().enumerate().take(3) {
        let (first, after) = res.unwrap();
        match first {
            Err(TransportError::PeerGone { rank, peer: 3, .. }) => assert_eq!(rank, r),
            other => panic!("rank {r}: expected PeerGone(3), got {other:?}"),
        }
        assert!(
            matches!(after, Err(TransportError::Closed { .. })),
            "rank {r}: {after:?}"
        );
    }
}

#[test]
fn rank_0_leaving_is_reported_as_gone() {
    let out = group(3, Duration::from_secs(5), |r, b| {
        let mut b = b.unwrap();
        if r == 0 {
            drop(b);
            return None;
        }
        Some(b.barrier())
    });
    for (r, res) in out.into_iter().enumerate().skip(1) {
        match res.unwrap() {
            Err(TransportError::PeerGone { rank, peer: 0, .. }) => assert_eq!(rank, r),
            other => panic!("rank {r}: {other:?}"),
        }
    }
}

#[test]
fn a_stalled_rank_is_named_in_the_timeout_of_everyone() {
    let timeout = Duration::from_millis(250);
    let out = group(4, timeout, |r, b| {
        let mut b = b.unwrap();
        b.barrier().unwrap();
        if r == 2 {
            // alive, connected, but never joins the next operation
            std::thread::sleep(timeout * 3);
            return None;
        }
        let t0 = Instant::now();
        Some((b.all_gather(b"abc"), t0.elapsed()))
    });
    for (r, res) in out.into_iter().enumerate() {
        let Some((res, took)) = res else { continue };
        assert!(took < Duration::from_secs(2));
        match res {
            Err(TransportError::Timeout {
                rank,
                peer: Some(2),
                ..
            }) => assert_eq!(rank, r),
            other => panic!("rank {r}: expected a timeout naming rank 2, got {other:?}"),
        }
    }
}

#[test]
fn world_size_disagreement_is_a_typed_error() {
    let timeout = Duration::from_secs(2);
    let listener = Bootstrap::listen(localhost0(), 3, timeout).unwrap();
    let addr = listener.local_addr();
    let (root, bad) = std::thread::scope(|sc| {
        let root = sc.spawn(move || listener.accept());
        let bad = sc.spawn(move || Bootstrap::connect(addr, 2, 5, timeout));
        (root.join().unwrap(), bad.join().unwrap())
    });
    assert!(
        matches!(
            root,
            Err(TransportError::WorldSizeMismatch {
                rank: 0,
                peer: 2,
                expected: 3,
                got: 5
            })
        ),
        "{root:?}"
    );
    assert!(
        matches!(
            bad,
            Err(TransportError::WorldSizeMismatch {
                rank: 2,
                peer: 0,
                expected: 5,
                got: 3
            })
        ),
        "{bad:?}"
    );
}

#[test]
fn a_rank_claimed_twice_is_a_typed_error() {
    let timeout = Duration::from_secs(2);
    let listener = Bootstrap::listen(localhost0(), 3, timeout).unwrap();
    let addr = listener.local_addr();
    let (root, a, b) = std::thread::scope(|sc| {
        let root = sc.spawn(move || listener.accept());
        let a = sc.spawn(move || Bootstrap::connect(addr, 1, 3, timeout));
        let b = sc.spawn(move || Bootstrap::connect(addr, 1, 3, timeout));
        (root.join().unwrap(), a.join().unwrap(), b.join().unwrap())
    });
    assert!(
        matches!(
            root,
            Err(TransportError::DuplicateRank { rank: 0, peer: 1 })
        ),
        "{root:?}"
    );
    for x in [a, b] {
        assert!(
            matches!(x, Err(TransportError::DuplicateRank { rank: 1, peer: 1 })),
            "{x:?}"
        );
    }
}

#[test]
fn bad_arguments_are_rejected_before_any_io() {
    let e = Bootstrap::connect(localhost0(), 4, 4, LONG).unwrap_err();
    assert!(
        matches!(e, TransportError::InvalidArgument { rank: 4, .. }),
        "{e}"
    );
    let e = Bootstrap::listen(localhost0(), 0, LONG).unwrap_err();
    assert!(matches!(e, TransportError::InvalidArgument { .. }), "{e}");
}

#[test]
fn connecting_to_nobody_times_out_naming_rank_0() {
    let port = TcpListener::bind(localhost0())
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let addr: SocketAddr = ([127, 0, 0, 1], port).into();
    let t0 = Instant::now();
    let e = Bootstrap::connect(addr, 1, 2, Duration::from_millis(200)).unwrap_err();
    assert!(
        matches!(
            e,
            TransportError::Timeout {
                rank: 1,
                peer: Some(0),
                ..
            }
        ),
        "{e}"
    );
    assert!(t0.elapsed() < Duration::from_secs(2));
}

#[test]
fn host_tcp_collectives_byte_for_byte() {
    for world in [1, 2, 4] {
        let out = group(world, LONG, |_, b| -> Result<(), TransportError> {
            let mut t = HostTcp::new(b?);
            assert_eq!(t.kind(), TransportKind::HostTcp);
            for round in 0..15 {
                a2a_round(&mut t, round)?;
                gather_round(&mut t, round, round % 5)?;
            }
            t.barrier()
        });
        for (r, res) in out.into_iter().enumerate() {
            res.unwrap_or_else(|e| panic!("world {world}, rank {r}: {e}"));
        }
    }
}

#[test]
fn host_tcp_survives_size_mismatches_and_invalid_arguments() {
    let out = group(3, LONG, |r, b| {
        let mut t = HostTcp::new(b.unwrap());
        let send = t.alloc(8).unwrap();
        let mut recv = t.alloc(8).unwrap();
        let e = [Span::EMPTY; 3];
        // rank 2 expects a byte from rank 0 that rank 0 does not send
        let mut recv_spans = e;
        if r == 2 {
            recv_spans[0] = Span::new(0, 1);
        }
        let mismatch = t.all_to_all_v(&send, &e, &mut recv, &recv_spans);
        // rank 1 passes two spans for three ranks
        let invalid = if r == 1 {
            t.all_to_all_v(&send, &e[..2], &mut recv, &e)
        } else {
            t.all_to_all_v(&send, &e, &mut recv, &e)
        };
        (mismatch, invalid, a2a_round(&mut t, 8))
    });
    for (r, (mismatch, invalid, next)) in out.into_iter().enumerate() {
        match (r, mismatch) {
            (
                2,
                Err(TransportError::SizeMismatch {
                    rank: 2,
                    peer: 0,
                    expected: 1,
                    got: 0,
                    ..
                }),
            ) => {}
            (0 | 1, Ok(())) => {}
            (_, other) => panic!("rank {r}: {other:?}"),
        }
        match (r, invalid) {
            (1, Err(TransportError::InvalidArgument { rank: 1, .. })) => {}
            (0 | 2, Err(TransportError::PeerFailed { peer: 1, .. })) => {}
            (_, other) => panic!("rank {r}: {other:?}"),
        }
        next.unwrap_or_else(|e| panic!("rank {r}: {e}"));
    }
}
