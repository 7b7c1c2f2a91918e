//! Bootstrap over 127.0.0.1: four ranks as threads, blobs of different lengths, and the failure
//! modes (a rank that never connects, a rank that leaves, a rank that stalls, handshake errors);
//! hostile and stray peers (raw sockets: wrong magic, another job, another version, oversized,
//! truncated, silent, a flood) on either side of the handshake. Also HostTcp, the Transport over
//! the bootstrap.

mod common;

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use afdep_transport::{
    Bootstrap, BootstrapListener, HandshakeFault, HostTcp, JobId, Transport, TransportError,
    TransportKind,
};
use common::{
    LONG, a2a_round, assert_timeouts_naming, assert_within, bad_rounds, bootstrap_ranks,
    check_bad_rounds, free_port, gather_round, localhost0, on_ranks,
};

/// Forms a group of `world` ranks on an ephemeral port and runs `f(rank, bootstrap)` on each
/// rank's thread; `f` gets the connect/accept error of its rank if forming failed.
fn group<R: Send>(
    world: usize,
    timeout: Duration,
    f: impl Fn(usize, Result<Bootstrap, TransportError>) -> R + Sync,
) -> Vec<R> {
    bootstrap_ranks(world, world, timeout, f)
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
    let addr: SocketAddr = ([127, 0, 0, 1], free_port()).into();
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
    // rank 3 is never started
    let out = bootstrap_ranks(4, 3, timeout, |_, b| b.map(|_| ()));
    assert_within(t0, Duration::from_secs(3));
    assert_timeouts_naming(out, 3);
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
    assert_within(t0, Duration::from_secs(2));
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
    let addr: SocketAddr = ([127, 0, 0, 1], free_port()).into();
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
        let bad = bad_rounds(&mut t, r);
        (bad, a2a_round(&mut t, 8))
    });
    for (r, (bad, next)) in out.into_iter().enumerate() {
        check_bad_rounds("", r, bad);
        next.unwrap_or_else(|e| panic!("rank {r}: {e}"));
    }
}

// ---- hostile and stray peers: raw TcpStreams speaking (or not) the bootstrap's wire format

/// The wire format of the module docs: a 24-byte header (magic `AFDP`, kind, operation number,
/// payload length, little-endian) and the payload.
const MAGIC: &[u8; 4] = b"AFDP";
const HELLO: u32 = 1;
const WELCOME: u32 = 2;
const ABORT: u32 = 3;
const VERSION: u32 = 2;

fn header(kind: u32, seq: u64, len: u64) -> Vec<u8> {
    let mut h = MAGIC.to_vec();
    h.extend_from_slice(&kind.to_le_bytes());
    h.extend_from_slice(&seq.to_le_bytes());
    h.extend_from_slice(&len.to_le_bytes());
    h
}

fn frame(kind: u32, payload: &[u8]) -> Vec<u8> {
    let mut f = header(kind, 0, payload.len() as u64);
    f.extend_from_slice(payload);
    f
}

fn hello(version: u32, rank: u64, world: u64, job: &str) -> Vec<u8> {
    let mut p = version.to_le_bytes().to_vec();
    p.extend_from_slice(&rank.to_le_bytes());
    p.extend_from_slice(&world.to_le_bytes());
    p.extend_from_slice(&(job.len() as u32).to_le_bytes());
    p.extend_from_slice(job.as_bytes());
    frame(HELLO, &p)
}

fn welcome(version: u32, world: u64, job: &str) -> Vec<u8> {
    let mut p = version.to_le_bytes().to_vec();
    p.extend_from_slice(&world.to_le_bytes());
    p.extend_from_slice(&(job.len() as u32).to_le_bytes());
    p.extend_from_slice(job.as_bytes());
    frame(WELCOME, &p)
}

fn job(s: &str) -> JobId {
    JobId::new(s).unwrap()
}

/// A rank 0 of job `name` for `world` ranks listening on an ephemeral port, and its address.
fn job_listener(world: usize, timeout: Duration, name: &str) -> (BootstrapListener, SocketAddr) {
    let listener = Bootstrap::listen(localhost0(), world, timeout)
        .unwrap()
        .with_job(job(name));
    let addr = listener.local_addr();
    (listener, addr)
}

/// Reads until the peer closes (bounded by a 5 s read timeout); the bytes.
fn read_to_close(s: &mut TcpStream) -> Vec<u8> {
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    out
}

#[test]
fn every_kind_of_stray_is_dropped_with_a_typed_error_and_the_group_still_forms() {
    // hello wait: half the timeout
    let timeout = Duration::from_secs(2);
    let (listener, addr) = job_listener(3, timeout, "job-a");
    let t0 = Instant::now();
    let (root, strays, other_job, legit) = std::thread::scope(|sc| {
        let root = sc.spawn(move || listener.accept());
        let connect = || TcpStream::connect(addr).unwrap();
        let mut sent: Vec<(&str, TcpStream)> = Vec::new();
        let mut s = connect();
        s.write_all(b"GET / HTTP/1.1\r\n\r\n").unwrap();
        sent.push(("magic", s));
        let mut s = connect();
        s.write_all(&hello(VERSION, 1, 3, "job-b")).unwrap();
        sent.push(("job", s));
        let mut s = connect();
        s.write_all(&hello(1, 1, 3, "job-a")).unwrap();
        sent.push(("version", s));
        let mut s = connect();
        s.write_all(&header(HELLO, 0, 1 << 40)).unwrap();
        sent.push(("oversized", s));
        let mut s = connect();
        let mut part = header(HELLO, 0, 40);
        part.extend_from_slice(&[7; 10]);
        s.write_all(&part).unwrap();
        s.shutdown(Shutdown::Write).unwrap();
        sent.push(("truncated", s));
        let mut s = connect();
        s.write_all(&frame(10, b"")).unwrap();
        sent.push(("kind", s));
        sent.push(("silent", connect()));
        // a real rank of another job: refused with a typed error naming both jobs
        let other_job = sc.spawn(move || Bootstrap::connect_as(addr, 1, 3, timeout, job("job-b")));
        // the right ranks come after the silent peer's hello wait
        std::thread::sleep(timeout / 2 + Duration::from_millis(300));
        let legit: Vec<_> = (1..3)
            .map(|r| sc.spawn(move || Bootstrap::connect_as(addr, r, 3, timeout, job("job-a"))))
            .collect();
        let legit: Vec<_> = legit.into_iter().map(|h| h.join().unwrap()).collect();
        let strays: Vec<(&str, SocketAddr, Vec<u8>)> = sent
            .into_iter()
            .map(|(what, mut s)| (what, s.local_addr().unwrap(), read_to_close(&mut s)))
            .collect();
        (
            root.join().unwrap(),
            strays,
            other_job.join().unwrap(),
            legit,
        )
    });
    assert_within(t0, Duration::from_secs(4));
    let mut root = root.expect("rank 0 forms the group despite the strays");
    let mut legit: Vec<Bootstrap> = legit
        .into_iter()
        .map(|b| b.expect("the right ranks join"))
        .collect();
    // the group works
    std::thread::scope(|sc| {
        let hs: Vec<_> = legit
            .iter_mut()
            .map(|b| sc.spawn(move || b.all_gather(&[b.rank() as u8])))
            .collect();
        assert_eq!(
            root.all_gather(&[0]).unwrap(),
            vec![vec![0], vec![1], vec![2]]
        );
        for h in hs {
            assert_eq!(h.join().unwrap().unwrap(), vec![vec![0], vec![1], vec![2]]);
        }
    });
    match other_job {
        Err(TransportError::Handshake {
            rank: 1,
            addr: a,
            fault: HandshakeFault::Job { expected, got },
        }) => {
            assert_eq!(a, addr);
            assert_eq!((expected.as_str(), got.as_str()), ("job-b", "job-a"));
        }
        other => panic!("another job's rank: {other:?}"),
    }
    let rejected = root.rejected();
    assert_eq!(rejected.len(), strays.len() + 1, "{rejected:#?}");
    for (what, from, answer) in &strays {
        let fault = rejected
            .iter()
            .find_map(|e| match e {
                TransportError::Handshake {
                    rank: 0,
                    addr,
                    fault,
                } if addr == from => Some(fault.clone()),
                _ => None,
            })
            .unwrap_or_else(|| panic!("{what}: no rejection for {from}: {rejected:#?}"));
        let ok = match (*what, &fault) {
            ("magic", HandshakeFault::Magic { expected, got }) => {
                *expected == u32::from_le_bytes(*MAGIC) && *got == u32::from_le_bytes(*b"GET ")
            }
            ("job", HandshakeFault::Job { expected, got }) => expected == "job-a" && got == "job-b",
            ("version", HandshakeFault::Version { expected, got }) => {
                (*expected, *got) == (VERSION, 1)
            }
            ("oversized", HandshakeFault::Oversized { limit, got }) => {
                *limit == 4096 && *got == 1 << 40
            }
            ("truncated", HandshakeFault::Truncated { expected, got }) => {
                (*expected, *got) == (24 + 40, 24 + 10)
            }
            ("kind", HandshakeFault::Kind { got, .. }) => got.contains("all_gather"),
            ("silent", HandshakeFault::Silent { waited, got }) => {
                *waited >= timeout / 2 && *got == 0
            }
            _ => false,
        };
        assert!(ok, "{what}: {fault:?}");
        // every stray is told why (an abort frame) and closed
        assert!(
            answer.len() > 24 && answer[..4] == *MAGIC && answer[4..8] == ABORT.to_le_bytes(),
            "{what}: {answer:?}"
        );
    }
}

#[test]
fn a_silent_peer_does_not_delay_the_right_ranks() {
    let timeout = Duration::from_secs(10);
    let (listener, addr) = job_listener(3, timeout, "quiet");
    let silent: Vec<TcpStream> = (0..3).map(|_| TcpStream::connect(addr).unwrap()).collect();
    let t0 = Instant::now();
    let out = on_ranks(vec![Some(listener), None, None], |r, l| match l {
        Some(l) => l.accept().map(|b| b.rejected().len()),
        None => Bootstrap::connect_as(addr, r, 3, timeout, job("quiet")).map(|_| 0),
    });
    assert_within(t0, Duration::from_secs(2));
    for (r, res) in out.into_iter().enumerate() {
        // the silent connections were still waiting for their hello: not judged yet
        assert_eq!(res.unwrap_or_else(|e| panic!("rank {r}: {e}")), 0);
    }
    drop(silent);
}

#[test]
fn a_flood_of_connections_is_refused_beyond_the_pending_limit() {
    let timeout = Duration::from_secs(5);
    let (listener, addr) = job_listener(2, timeout, "busy");
    let (root, leaf, flood) = std::thread::scope(|sc| {
        let root = sc.spawn(move || listener.accept());
        let flood: Vec<TcpStream> = (0..80).map(|_| TcpStream::connect(addr).unwrap()).collect();
        std::thread::sleep(Duration::from_millis(200));
        let leaf = Bootstrap::connect_as(addr, 1, 2, timeout, job("busy"));
        (root.join().unwrap(), leaf, flood)
    });
    let root = root.unwrap();
    leaf.unwrap();
    let crowded = root
        .rejected()
        .iter()
        .filter(|e| {
            matches!(
                e,
                TransportError::Handshake {
                    fault: HandshakeFault::Crowded { limit: 64 },
                    ..
                }
            )
        })
        .count();
    assert!(crowded >= 80 - 64, "{:#?}", root.rejected());
    drop(flood);
}

/// A fake rank 0 at a raw listener: reads the hello, then answers `answer` (and closes, unless
/// `hold`); returns the non-root rank's result and how long it took.
fn against_fake_root(
    answer: Vec<u8>,
    hold: bool,
    timeout: Duration,
) -> (Result<Bootstrap, TransportError>, SocketAddr, Duration) {
    let l = TcpListener::bind(localhost0()).unwrap();
    let addr = l.local_addr().unwrap();
    std::thread::scope(|sc| {
        let fake = sc.spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            // the whole hello: closing with unread bytes would reset the connection
            let mut head = [0u8; 24];
            s.read_exact(&mut head).unwrap();
            let len = u64::from_le_bytes(head[16..24].try_into().unwrap());
            s.read_exact(&mut vec![0; len as usize]).unwrap();
            s.write_all(&answer).unwrap();
            if hold {
                std::thread::sleep(timeout * 3);
            }
        });
        let t0 = Instant::now();
        let res = Bootstrap::connect_as(addr, 1, 2, timeout, job("mine"));
        let took = t0.elapsed();
        fake.join().unwrap();
        (res, addr, took)
    })
}

#[test]
fn a_hostile_rank_0_gets_a_typed_error_on_the_other_ranks() {
    let timeout = Duration::from_millis(400);
    let bound = timeout * 2;
    let handshake = |answer: Vec<u8>, hold: bool| {
        let (res, addr, took) = against_fake_root(answer, hold, timeout);
        assert!(took < bound, "took {took:?}");
        match res {
            Err(TransportError::Handshake {
                rank: 1,
                addr: a,
                fault,
            }) if a == addr => fault,
            other => panic!("expected a handshake error with {addr}, got {other:?}"),
        }
    };
    assert_eq!(
        handshake(b"SSH-2.0-OpenSSH\r\n".to_vec(), false),
        HandshakeFault::Magic {
            expected: u32::from_le_bytes(*MAGIC),
            got: u32::from_le_bytes(*b"SSH-")
        }
    );
    assert_eq!(
        handshake(header(WELCOME, 0, u64::MAX), true),
        HandshakeFault::Oversized {
            limit: 4096,
            got: u64::MAX
        }
    );
    let mut part = header(WELCOME, 0, 50);
    part.extend_from_slice(&[1; 10]);
    assert_eq!(
        handshake(part, false),
        HandshakeFault::Truncated {
            expected: 74,
            got: 34
        }
    );
    assert_eq!(
        handshake(welcome(VERSION, 2, "theirs"), false),
        HandshakeFault::Job {
            expected: "mine".into(),
            got: "theirs".into()
        }
    );
    assert_eq!(
        handshake(welcome(7, 2, "mine"), false),
        HandshakeFault::Version {
            expected: VERSION,
            got: 7
        }
    );
    assert!(matches!(
        handshake(frame(HELLO, b""), false),
        HandshakeFault::Kind { .. }
    ));
    let mut junk = welcome(VERSION, 2, "mine");
    junk.truncate(24 + 6);
    junk[16..24].copy_from_slice(&6u64.to_le_bytes());
    assert!(matches!(
        handshake(junk, false),
        HandshakeFault::Malformed {
            what: "welcome",
            ..
        }
    ));
    // a silent rank 0: a bounded timeout naming it; one that closes at once: gone
    let (res, _, took) = against_fake_root(Vec::new(), true, timeout);
    assert!(took < bound, "took {took:?}");
    assert!(
        matches!(
            res,
            Err(TransportError::Timeout {
                rank: 1,
                peer: Some(0),
                ..
            })
        ),
        "{res:?}"
    );
    let (res, _, _) = against_fake_root(Vec::new(), false, timeout);
    assert!(
        matches!(
            res,
            Err(TransportError::PeerGone {
                rank: 1,
                peer: 0,
                ..
            })
        ),
        "{res:?}"
    );
    // a well-formed welcome of this job and the right world: joined
    let (res, _, _) = against_fake_root(welcome(VERSION, 2, "mine"), false, timeout);
    assert_eq!(res.unwrap().job().as_str(), "mine");
}

#[test]
fn the_job_comes_from_the_environment_by_default() {
    // this binary never sets AFDEP_JOB_ID: every rank is of the unnamed job
    assert!(std::env::var_os(afdep_transport::ENV_JOB_ID).is_none());
    let out = group(2, LONG, |_, b| b.map(|b| b.job().clone()));
    for res in out {
        assert_eq!(res.unwrap().as_str(), JobId::UNNAMED);
    }
}

#[test]
fn a_peer_that_trickles_its_hello_is_dropped_as_silent() {
    // hello wait: 1.5 s (half the timeout); the peer sends a valid hello one byte per 60 ms
    // (about 3 s in all); the real rank connects at 1.8 s, well inside the 3 s timeout even on
    // a loaded CI machine
    let timeout = Duration::from_secs(3);
    let (listener, addr) = job_listener(2, timeout, "slow");
    let (root, leaf, from) = std::thread::scope(|sc| {
        let root = sc.spawn(move || listener.accept());
        let mut s = TcpStream::connect(addr).unwrap();
        let from = s.local_addr().unwrap();
        let trickle = sc.spawn(move || {
            for b in hello(VERSION, 1, 2, "slow") {
                if s.write_all(&[b]).is_err() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(60));
            }
        });
        std::thread::sleep(Duration::from_millis(1800));
        let leaf = Bootstrap::connect_as(addr, 1, 2, timeout, job("slow"));
        let root = root.join().unwrap();
        trickle.join().unwrap();
        (root, leaf, from)
    });
    leaf.unwrap();
    let root = root.unwrap();
    match root.rejected() {
        [
            TransportError::Handshake {
                addr,
                fault: HandshakeFault::Silent { waited, got },
                ..
            },
        ] => {
            assert_eq!(*addr, from);
            assert!(*waited >= Duration::from_millis(1500), "{waited:?}");
            assert!(*got > 0 && *got < 60, "{got} bytes");
        }
        other => panic!("{other:#?}"),
    }
}
