//! Loopback: collectives with 1–4 ranks and uneven spans, many rounds, and every failure mode
//! (timeout, peer gone, size mismatch, invalid arguments, mixed-up operations), each followed by
//! a check that the group still works.

mod common;

use std::sync::mpsc;
use std::time::{Duration, Instant};

use afdep_transport::{Loopback, Span, Transport, TransportBuffer, TransportError, TransportKind};
use common::{LONG, a2a_round, assert_within, gather_round, on_ranks};

#[test]
fn collectives_with_one_to_four_ranks() {
    for world in 1..=4 {
        let out = on_ranks(Loopback::group(world, LONG), |r, mut t| {
            assert_eq!(
                (t.rank(), t.world_size(), t.kind()),
                (r, world, TransportKind::Loopback)
            );
            t.barrier()?;
            gather_round(&mut t, 0, 0)?;
            gather_round(&mut t, 1, 1)?;
            gather_round(&mut t, 2, 37)?;
            for round in 0..8 {
                a2a_round(&mut t, round)?;
            }
            t.barrier()
        });
        for (r, res) in out.into_iter().enumerate() {
            res.unwrap_or_else(|e| panic!("world {world}, rank {r}: {e}"));
        }
    }
}

#[test]
fn all_to_all_v_all_zero_spans() {
    let out = on_ranks(Loopback::group(3, LONG), |_, mut t| {
        let send = t.alloc(0)?;
        let mut recv = t.alloc(0)?;
        t.all_to_all_v(&send, &[Span::EMPTY; 3], &mut recv, &[Span::EMPTY; 3])
    });
    assert!(out.iter().all(Result::is_ok), "{out:?}");
}

#[test]
fn hundred_rounds_of_changing_sizes() {
    let out = on_ranks(Loopback::group(4, LONG), |_, mut t| {
        for round in 0..100 {
            a2a_round(&mut t, round)?;
            gather_round(&mut t, round, round % 17)?;
            if round % 10 == 0 {
                t.barrier()?;
            }
        }
        Ok::<_, TransportError>(t.ops_started())
    });
    for res in out {
        assert_eq!(res.unwrap(), 210);
    }
}

#[test]
fn timeout_names_the_missing_rank_and_a_late_rank_does_not_complete_the_abandoned_op() {
    let timeout = Duration::from_millis(200);
    let (go_tx, go_rx) = mpsc::channel::<()>();
    let go_rx = std::sync::Mutex::new(go_rx);
    let out = on_ranks(Loopback::group(4, timeout), |r, mut t| {
        let mut log = Vec::new();
        if r == 3 {
            // joins only after everyone else gave up on operation 0
            for _ in 0..3 {
                go_rx.lock().unwrap().recv().unwrap();
            }
            log.push((t.all_gather(&[3; 4]).map(|_| ()), Duration::ZERO));
        } else {
            let t0 = Instant::now();
            let res = t.all_gather(&[r as u8; 4]).map(|_| ());
            log.push((res, t0.elapsed()));
            go_tx.send(()).unwrap();
        }
        // operation 1 is clean for everyone
        t.set_timeout(LONG);
        log.push((gather_round(&mut t, 7, 9), Duration::ZERO));
        log.push((a2a_round(&mut t, 3), Duration::ZERO));
        log
    });
    for (r, log) in out.iter().enumerate() {
        let (first, waited) = &log[0];
        if r < 3 {
            match first {
                Err(TransportError::Timeout {
                    op: "all_gather",
                    rank,
                    peer: Some(3),
                    waited: w,
                }) => {
                    assert_eq!(*rank, r);
                    assert!(*w >= timeout, "{w:?}");
                }
                other => panic!("rank {r}: expected a timeout naming rank 3, got {other:?}"),
            }
            assert!(
                *waited < Duration::from_secs(2),
                "rank {r} returned after {waited:?}"
            );
        } else {
            match first {
                Err(
                    e @ TransportError::PeerFailed {
                        rank: 3, peer, why, ..
                    },
                ) => {
                    assert!(*peer < 3);
                    assert!(why.contains("gave up"), "{e}");
                }
                other => panic!("late rank: expected PeerFailed, got {other:?}"),
            }
        }
        for (res, _) in &log[1..] {
            res.as_ref()
                .unwrap_or_else(|e| panic!("rank {r} after the timeout: {e}"));
        }
    }
}

#[test]
fn every_wait_respects_a_short_timeout_in_barrier_and_all_to_all() {
    let timeout = Duration::from_millis(150);
    let mut group = Loopback::group(2, timeout);
    let _idle = group.pop().unwrap(); // rank 1 stays alive and never calls
    let mut t = group.pop().unwrap();
    let t0 = Instant::now();
    let e = t.barrier().unwrap_err();
    assert!(
        matches!(
            e,
            TransportError::Timeout {
                op: "barrier",
                rank: 0,
                peer: Some(1),
                ..
            }
        ),
        "{e}"
    );
    let send = t.alloc(4).unwrap();
    let mut recv = t.alloc(4).unwrap();
    let spans = [Span::new(0, 2), Span::new(2, 2)];
    let e = t
        .all_to_all_v(&send, &spans, &mut recv, &spans)
        .unwrap_err();
    assert!(
        matches!(
            e,
            TransportError::Timeout {
                op: "all_to_all_v",
                peer: Some(1),
                ..
            }
        ),
        "{e}"
    );
    assert!(t0.elapsed() < Duration::from_secs(2));
    assert!(e.to_string().contains("rank 1"), "{e}");
}

#[test]
fn a_dropped_rank_is_reported_promptly() {
    let mut group = Loopback::group(3, LONG);
    drop(group.pop()); // rank 2 leaves before doing anything
    let t0 = Instant::now();
    let out = on_ranks(group, |_, mut t| t.all_gather(&[1, 2]));
    assert_within(t0, Duration::from_secs(1));
    for (r, res) in out.into_iter().enumerate() {
        match res {
            Err(TransportError::PeerGone {
                rank,
                peer: 2,
                op: "all_gather",
            }) => assert_eq!(rank, r),
            other => panic!("rank {r}: expected PeerGone(2), got {other:?}"),
        }
    }
}

#[test]
fn a_rank_that_returns_or_panics_mid_run_is_reported_promptly() {
    for panics in [false, true] {
        let t0 = Instant::now();
        let out: Vec<std::thread::Result<Vec<Result<(), TransportError>>>> =
            std::thread::scope(|sc| {
                let hs: Vec<_> = Loopback::group(4, LONG)
                    .into_iter()
                    .enumerate()
                    .map(|(r, mut t)| {
                        sc.spawn(move || {
                            let mut log = vec![a2a_round(&mut t, 0)];
                            if r == 1 {
                                if panics {
                                    panic!("rank 1 fails on purpose (expected in this test)");
                                }
                                return log;
                            }
                            log.push(a2a_round(&mut t, 1));
                            log.push(t.barrier());
                            log
                        })
                    })
                    .collect();
                hs.into_iter().map(|h| h.join()).collect()
            });
        assert_within(t0, Duration::from_secs(2));
        for (r, res) in out.into_iter().enumerate() {
            if r == 1 {
                assert_eq!(res.is_err(), panics);
                continue;
            }
            let log = res.unwrap();
            log[0].as_ref().unwrap();
            for e in &log[1..] {
                assert!(
                    matches!(e, Err(TransportError::PeerGone { peer: 1, .. })),
                    "rank {r}: {e:?}"
                );
            }
        }
    }
}

#[test]
fn size_mismatch_is_reported_by_the_receiver_and_the_group_recovers() {
    let out = on_ranks(Loopback::group(3, LONG), |r, mut t| {
        // rank 0 sends rank 1 five bytes, rank 1 expects six from rank 0
        let send = t.alloc(16).unwrap();
        let mut recv = t.alloc(16).unwrap();
        let mut send_spans = vec![Span::new(0, 1); 3];
        let mut recv_spans = vec![Span::new(0, 1), Span::new(4, 1), Span::new(8, 1)];
        if r == 0 {
            send_spans[1] = Span::new(2, 5);
        }
        if r == 1 {
            recv_spans[0] = Span::new(0, 6);
            recv_spans[1] = Span::new(6, 1);
        }
        let t0 = Instant::now();
        let first = t.all_to_all_v(&send, &send_spans, &mut recv, &recv_spans);
        let took = t0.elapsed();
        (
            first,
            took,
            a2a_round(&mut t, 11),
            gather_round(&mut t, 12, 3),
        )
    });
    for (r, (first, took, next, gather)) in out.into_iter().enumerate() {
        assert!(took < Duration::from_secs(1));
        if r == 1 {
            match first {
                Err(TransportError::SizeMismatch {
                    rank: 1,
                    peer: 0,
                    expected: 6,
                    got: 5,
                    ..
                }) => {}
                other => panic!("rank 1: {other:?}"),
            }
        } else {
            first.unwrap_or_else(|e| panic!("rank {r}: {e}"));
        }
        next.unwrap();
        gather.unwrap();
    }
}

#[test]
fn all_gather_length_mismatch_fails_everywhere_then_recovers() {
    let out = on_ranks(Loopback::group(3, LONG), |r, mut t| {
        let mine = vec![r as u8; if r == 2 { 3 } else { 4 }];
        (t.all_gather(&mine), gather_round(&mut t, 5, 6))
    });
    for (r, (first, next)) in out.into_iter().enumerate() {
        let e = first.unwrap_err();
        let (peer, expected, got) = if r == 2 { (0, 3, 4) } else { (2, 4, 3) };
        match e {
            TransportError::SizeMismatch {
                rank,
                peer: p,
                expected: x,
                got: g,
                ..
            } => {
                assert_eq!((rank, p, x, g), (r, peer, expected, got));
            }
            other => panic!("rank {r}: {other}"),
        }
        next.unwrap();
    }
}

#[test]
fn a_self_size_mismatch_fails_only_that_rank() {
    let out = on_ranks(Loopback::group(2, LONG), |r, mut t| {
        let send = t.alloc(8).unwrap();
        let mut recv = t.alloc(8).unwrap();
        let send_spans = [Span::new(0, 2), Span::new(2, 2)];
        let mut recv_spans = [Span::new(0, 2), Span::new(2, 2)];
        if r == 1 {
            recv_spans[1] = Span::new(2, 3);
        }
        t.all_to_all_v(&send, &send_spans, &mut recv, &recv_spans)
    });
    out[0].as_ref().unwrap();
    assert!(matches!(
        out[1],
        Err(TransportError::SizeMismatch {
            rank: 1,
            peer: 1,
            expected: 3,
            got: 2,
            ..
        })
    ));
}

#[test]
fn invalid_arguments_fail_the_caller_and_release_its_peers() {
    let out = on_ranks(Loopback::group(3, LONG), |r, mut t| {
        let send = t.alloc(8).unwrap();
        let mut recv = t.alloc(8).unwrap();
        let t0 = Instant::now();
        let first = match r {
            // too few spans
            1 => t.all_to_all_v(&send, &[Span::EMPTY; 2], &mut recv, &[Span::EMPTY; 3]),
            _ => t.all_to_all_v(&send, &[Span::EMPTY; 3], &mut recv, &[Span::EMPTY; 3]),
        };
        let took = t0.elapsed();
        // out of bounds on rank 2
        let spans = [
            Span::EMPTY,
            Span::EMPTY,
            if r == 2 { Span::new(6, 4) } else { Span::EMPTY },
        ];
        let second = t.all_to_all_v(&send, &spans, &mut recv, &[Span::EMPTY; 3]);
        (first, took, second, a2a_round(&mut t, 4))
    });
    for (r, (first, took, second, next)) in out.into_iter().enumerate() {
        assert!(took < Duration::from_secs(1), "rank {r} took {took:?}");
        match (r, first) {
            (1, Err(TransportError::InvalidArgument { rank: 1, .. })) => {}
            (_, Err(TransportError::PeerFailed { peer: 1, rank, .. })) if rank == r => {}
            (_, other) => panic!("rank {r}: {other:?}"),
        }
        match (r, second) {
            (
                2,
                Err(TransportError::OutOfBounds {
                    rank: 2,
                    peer: Some(2),
                    offset: 6,
                    len: 4,
                    size: 8,
                    ..
                }),
            ) => {}
            (_, Err(TransportError::PeerFailed { peer: 2, .. })) => {}
            (_, other) => panic!("rank {r}: {other:?}"),
        }
        next.unwrap();
    }
}

#[test]
fn different_collectives_at_the_same_step_are_a_protocol_error() {
    let out = on_ranks(Loopback::group(2, LONG), |r, mut t| {
        let first = if r == 0 {
            t.barrier()
        } else {
            t.all_gather(&[]).map(|_| ())
        };
        (first, gather_round(&mut t, 1, 2))
    });
    for (r, (first, next)) in out.into_iter().enumerate() {
        match first {
            Err(TransportError::Protocol {
                rank,
                peer: Some(p),
                ..
            }) => assert_eq!((rank, p), (r, 1 - r)),
            other => panic!("rank {r}: {other:?}"),
        }
        next.unwrap();
    }
}

#[test]
fn buffers_are_bounds_checked() {
    let mut t = Loopback::group(1, LONG).pop().unwrap();
    let mut b = t.alloc(4).unwrap();
    assert_eq!(b.len(), 4);
    assert!(matches!(
        b.write(2, &[0; 3]),
        Err(TransportError::OutOfBounds { rank: 0, .. })
    ));
    let mut out = [0u8; 5];
    assert!(b.read(0, &mut out).is_err());
}

/// The spin before a rank sleeps: a spin far longer than any wait here, so that every wait of
/// these operations is a spinning one. Collectives still complete with the right bytes, a letter
/// that arrives mid-spin ends the wait at once (not when the spin runs out), a rank that leaves
/// mid-spin is reported at once, and a timeout shorter than the spin still bounds the wait.
#[test]
fn spinning_waits_complete_promptly_and_keep_every_failure_mode() {
    let spin = Duration::from_secs(5);
    for world in 1..=4 {
        let out = on_ranks(Loopback::group_spinning(world, LONG, spin), |_, mut t| {
            for round in 0..20 {
                a2a_round(&mut t, round)?;
                gather_round(&mut t, round, round % 7)?;
            }
            t.barrier()
        });
        for (r, res) in out.into_iter().enumerate() {
            res.unwrap_or_else(|e| panic!("world {world}, rank {r}: {e}"));
        }
    }

    // a late letter ends the spin when it arrives
    let t0 = Instant::now();
    let out = on_ranks(Loopback::group_spinning(2, LONG, spin), |r, mut t| {
        if r == 1 {
            std::thread::sleep(Duration::from_millis(50));
        }
        t.barrier()
    });
    assert!(out.iter().all(Result::is_ok), "{out:?}");
    assert_within(t0, Duration::from_secs(2));

    // a rank that leaves mid-spin is reported at once
    let mut group = Loopback::group_spinning(2, LONG, spin);
    let gone = group.pop().unwrap();
    let mut t = group.pop().unwrap();
    let t0 = Instant::now();
    let leaver = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(50));
        drop(gone);
    });
    let e = t.barrier().unwrap_err();
    leaver.join().unwrap();
    assert!(
        matches!(
            e,
            TransportError::PeerGone {
                peer: 1,
                rank: 0,
                ..
            }
        ),
        "{e}"
    );
    assert_within(t0, Duration::from_secs(2));

    // a timeout shorter than the spin bounds the wait
    let mut group = Loopback::group_spinning(2, Duration::from_millis(100), spin);
    let _idle = group.pop().unwrap();
    let mut t = group.pop().unwrap();
    let t0 = Instant::now();
    let e = t.barrier().unwrap_err();
    assert!(
        matches!(e, TransportError::Timeout { peer: Some(1), .. }),
        "{e}"
    );
    assert_within(t0, Duration::from_secs(2));
}
