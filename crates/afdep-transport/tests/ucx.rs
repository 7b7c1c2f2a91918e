//! The UCX transport (feature `ucx`) on 127.0.0.1: ranks as threads, each with its own UCX context
//! and worker, over UCX's TCP and shared-memory transports. Results are compared byte for byte
//! with Loopback's; the failure modes mirror HostTcp's.

#![cfg(feature = "ucx")]

mod common;

use std::time::{Duration, Instant};

use afdep_transport::{
    Loopback, Span, Transport, TransportBuffer, TransportError, TransportKind, Ucx, UcxOptions,
};
use common::{
    LONG, a2a_round, assert_timeouts_naming, assert_within, bad_rounds, bootstrap_ranks, byte,
    check_bad_rounds, free_port, gather_round, on_ranks, size,
};

/// The UCX transports the tests run over.
const TLS: [&str; 2] = ["tcp", "shm"];

fn opts(tls: &str) -> UcxOptions {
    let o = UcxOptions::with_tls(tls);
    assert_eq!(o.detect_peer_failure, tls != "shm");
    o
}

/// Forms a UCX group of `world` ranks (threads) and runs `f(rank, transport)` on each.
fn group<R: Send>(
    world: usize,
    timeout: Duration,
    tls: &str,
    f: impl Fn(usize, Result<Ucx, TransportError>) -> R + Sync,
) -> Vec<R> {
    let o = opts(tls);
    bootstrap_ranks(world, world, timeout, |r, boot| {
        f(r, boot.and_then(|b| Ucx::new(b, &o)))
    })
}

/// The sizes of round `round`: `common::size`, except that rank `zero` (if any) sends and
/// receives nothing at all.
fn sizes(round: u64, src: usize, dst: usize, zero: Option<usize>) -> u64 {
    if Some(src) == zero || Some(dst) == zero {
        0
    } else {
        size(round, src, dst)
    }
}

/// One all-to-all-v (packed spans, sizes above) and one all-gather; returns the whole receive
/// buffer and the gathered bytes, to compare across transports.
fn round_bytes<T: Transport>(
    t: &mut T,
    round: u64,
    zero: Option<usize>,
) -> Result<(Vec<u8>, Vec<u8>), TransportError> {
    let (me, world) = (t.rank(), t.world_size());
    let (send_spans, send_total) = Span::packed(
        &(0..world)
            .map(|d| sizes(round, me, d, zero))
            .collect::<Vec<_>>(),
    );
    let (recv_spans, recv_total) = Span::packed(
        &(0..world)
            .map(|s| sizes(round, s, me, zero))
            .collect::<Vec<_>>(),
    );
    let mut send = t.alloc(send_total as usize)?;
    for (d, s) in send_spans.iter().enumerate() {
        let b: Vec<u8> = (0..s.len).map(|i| byte(round, me, d, i)).collect();
        send.write(s.offset as usize, &b)?;
    }
    let mut recv = t.alloc(recv_total as usize)?;
    t.all_to_all_v(&send, &send_spans, &mut recv, &recv_spans)?;
    let mut got = vec![0u8; recv_total as usize];
    recv.read(0, &mut got)?;
    let mine: Vec<u8> = (0..(round % 7) * 3)
        .map(|i| byte(round, me, 99, i))
        .collect();
    let gathered = t.all_gather(&mine)?;
    t.barrier()?;
    Ok((got, gathered))
}

type Rounds = Vec<(Vec<u8>, Vec<u8>)>;

fn rounds<T: Transport>(t: &mut T, zero: Option<usize>) -> Result<Rounds, TransportError> {
    (0..12).map(|round| round_bytes(t, round, zero)).collect()
}

#[test]
fn collectives_match_loopback_bit_for_bit() {
    for tls in TLS {
        for world in [1, 2, 4] {
            for zero in [None, Some(world - 1)] {
                let want = on_ranks(Loopback::group(world, LONG), |_, mut t| {
                    rounds(&mut t, zero).unwrap()
                });
                let got = group(world, LONG, tls, |r, t| {
                    let mut t = t.unwrap_or_else(|e| panic!("{tls} rank {r}: {e}"));
                    assert_eq!(t.kind(), TransportKind::Ucx);
                    rounds(&mut t, zero).unwrap_or_else(|e| panic!("{tls} rank {r}: {e}"))
                });
                assert_eq!(got, want, "{tls}, world {world}, zero-size rank {zero:?}");
            }
        }
    }
}

#[test]
fn uneven_rounds_with_gaps_and_gathers() {
    for tls in TLS {
        for world in [2, 4] {
            let out = group(world, LONG, tls, |_, t| -> Result<(), TransportError> {
                let mut t = t?;
                for round in 0..15 {
                    a2a_round(&mut t, round)?;
                    gather_round(&mut t, round, round % 5)?;
                }
                t.barrier()
            });
            for (r, res) in out.into_iter().enumerate() {
                res.unwrap_or_else(|e| panic!("{tls}, world {world}, rank {r}: {e}"));
            }
        }
    }
}

#[test]
fn large_messages_cross_the_rendezvous_threshold() {
    // 3 MiB per peer: above UCX's eager limits on both transports
    for tls in TLS {
        let n = 3 << 20;
        let out = group(2, LONG, tls, |r, t| -> Result<(), TransportError> {
            let mut t = t?;
            let mut send = t.alloc(2 * n)?;
            let data: Vec<u8> = (0..2 * n as u64).map(|i| byte(7, r, 0, i)).collect();
            send.write(0, &data)?;
            let spans = [Span::new(0, n as u64), Span::new(n as u64, n as u64)];
            let mut recv = t.alloc(2 * n)?;
            t.all_to_all_v(&send, &spans, &mut recv, &spans)?;
            let mut got = vec![0u8; 2 * n];
            recv.read(0, &mut got)?;
            let other = 1 - r;
            let from_other: Vec<u8> = (0..2 * n as u64).map(|i| byte(7, other, 0, i)).collect();
            let at = r * n;
            assert!(got[at..at + n] == data[at..at + n], "{tls}: own span");
            let at_o = other * n;
            assert!(
                got[at_o..at_o + n] == from_other[at..at + n],
                "{tls}: span from rank {other}"
            );
            Ok(())
        });
        for (r, res) in out.into_iter().enumerate() {
            res.unwrap_or_else(|e| panic!("{tls} rank {r}: {e}"));
        }
    }
}

#[test]
fn size_mismatches_and_invalid_arguments_leave_the_group_usable() {
    for tls in TLS {
        let out = group(3, LONG, tls, |r, t| {
            let mut t = t.unwrap();
            let bad = bad_rounds(&mut t, r);
            // rank 0 gathers 3 bytes, the others 2
            let gather = t.all_gather(if r == 0 { b"abc" } else { b"ab" });
            (bad, gather, a2a_round(&mut t, 8))
        });
        for (r, (bad, gather, next)) in out.into_iter().enumerate() {
            check_bad_rounds(&format!("{tls} "), r, bad);
            match (r, gather) {
                (0, Err(TransportError::SizeMismatch { peer: 1, .. })) => {}
                (1 | 2, Err(TransportError::SizeMismatch { peer: 0, .. })) => {}
                (_, other) => panic!("{tls} rank {r}: {other:?}"),
            }
            next.unwrap_or_else(|e| panic!("{tls} rank {r}: {e}"));
        }
    }
}

#[test]
fn different_collectives_at_the_same_step_are_a_protocol_error() {
    let out = group(2, LONG, "tcp", |r, t| {
        let mut t = t.unwrap();
        let first = if r == 0 {
            t.barrier()
        } else {
            t.all_gather(b"x").map(|_| ())
        };
        (first, t.barrier())
    });
    for (r, (first, next)) in out.into_iter().enumerate() {
        assert!(
            matches!(first, Err(TransportError::Protocol { peer: Some(p), .. }) if p == 1 - r),
            "rank {r}: {first:?}"
        );
        next.unwrap_or_else(|e| panic!("rank {r}: {e}"));
    }
}

#[test]
fn a_rank_that_never_joins_times_out_typed_and_bounded() {
    let timeout = Duration::from_millis(400);
    let t0 = Instant::now();
    // rank 2 is never started
    let out = bootstrap_ranks(3, 2, timeout, |_, boot| {
        boot.and_then(|b| Ucx::new(b, &opts("tcp"))).map(|_| ())
    });
    assert_within(t0, Duration::from_secs(3));
    assert_timeouts_naming(out, 2);
}

#[test]
fn a_stalled_rank_is_named_in_a_bounded_timeout_and_the_transport_closes() {
    for tls in TLS {
        let timeout = Duration::from_millis(300);
        let out = group(4, LONG, tls, |r, t| {
            let mut t = t.unwrap();
            t.barrier().unwrap();
            t.set_timeout(timeout);
            if r == 2 {
                // alive, connected, but never joins the next operation
                std::thread::sleep(timeout * 4);
                return None;
            }
            let t0 = Instant::now();
            let res = round_bytes(&mut t, 3, None).map(|_| ());
            let took = t0.elapsed();
            Some((res, took, t.barrier()))
        });
        for (r, res) in out.into_iter().enumerate() {
            let Some((res, took, after)) = res else {
                continue;
            };
            assert!(
                took < Duration::from_secs(2),
                "{tls} rank {r}: took {took:?}"
            );
            match res {
                Err(TransportError::Timeout {
                    rank,
                    peer: Some(2),
                    ..
                }) => assert_eq!(rank, r),
                other => panic!("{tls} rank {r}: expected a timeout naming rank 2, got {other:?}"),
            }
            assert!(
                matches!(after, Err(TransportError::Closed { .. })),
                "{tls} rank {r}: {after:?}"
            );
        }
    }
}

#[test]
fn a_rank_that_leaves_fails_the_others_typed_and_bounded() {
    for tls in TLS {
        let timeout = Duration::from_secs(2);
        let out = group(3, LONG, tls, |r, t| {
            let mut t = t.unwrap();
            t.barrier().unwrap();
            t.set_timeout(timeout);
            if r == 1 {
                drop(t);
                return None;
            }
            let t0 = Instant::now();
            Some((t.all_gather(&[r as u8; 5]), t0.elapsed()))
        });
        for (r, res) in out.into_iter().enumerate() {
            let Some((res, took)) = res else { continue };
            assert!(
                took < timeout + Duration::from_secs(1),
                "{tls} rank {r}: took {took:?}"
            );
            // tcp reports the closed endpoint at once; shared memory, without peer failure
            // detection, times out
            match (tls, res) {
                ("tcp", Err(TransportError::PeerGone { rank, peer: 1, .. }))
                | (
                    "shm",
                    Err(TransportError::Timeout {
                        rank,
                        peer: Some(1),
                        ..
                    }),
                ) => assert_eq!(rank, r),
                (_, other) => panic!(
                    "{tls} rank {r}: expected PeerGone (tcp) or Timeout (shm) naming 1, got {other:?}"
                ),
            }
        }
    }
}

// ---- ranks as processes: this test binary re-runs itself as the ranks ----

const CHILD: &str = "AFDEP_UCX_TEST_CHILD";
const CHILD_OUT: &str = "AFDEP_UCX_TEST_OUT";
const CHILD_TLS: &str = "AFDEP_UCX_TEST_TLS";

/// One rank process (does nothing unless started by [`spawn_ranks`]): `rounds` writes its
/// results to the file `AFDEP_UCX_TEST_OUT`; `stall` joins, passes a barrier, then sleeps (to be
/// killed); `survive` passes the same barrier and writes the error of the next all-gather.
#[test]
fn ucx_rank_process() {
    let Ok(mode) = std::env::var(CHILD) else {
        return;
    };
    let out = std::env::var(CHILD_OUT).unwrap();
    let tls = std::env::var(CHILD_TLS).unwrap();
    let mut t = Ucx::from_env(LONG, &opts(&tls)).unwrap();
    match mode.as_str() {
        "rounds" => {
            let zero = Some(t.world_size() - 1);
            let res = rounds(&mut t, zero).unwrap();
            let mut bytes = Vec::new();
            for (a, b) in res {
                for v in [a, b] {
                    bytes.extend_from_slice(&(v.len() as u64).to_le_bytes());
                    bytes.extend_from_slice(&v);
                }
            }
            std::fs::write(out, bytes).unwrap();
        }
        "stall" => {
            t.barrier().unwrap();
            std::fs::write(out, b"joined").unwrap();
            std::thread::sleep(Duration::from_secs(60));
        }
        "survive" => {
            t.barrier().unwrap();
            t.set_timeout(Duration::from_secs(3));
            let t0 = Instant::now();
            let e = t.all_gather(b"abcd").unwrap_err();
            let verdict = match e {
                TransportError::PeerGone { peer, .. } => format!("gone {peer}"),
                TransportError::Timeout { peer: Some(p), .. } => format!("timeout {p}"),
                other => format!("other {other}"),
            };
            std::fs::write(out, format!("{verdict} {}", t0.elapsed().as_millis())).unwrap();
        }
        m => panic!("unknown mode {m}"),
    }
}

/// Starts `modes.len()` rank processes (rank r in mode `modes[r]`); returns them with the files
/// they write.
fn spawn_ranks(
    modes: &[&str],
    tls: &str,
    dir: &std::path::Path,
) -> Vec<(std::process::Child, std::path::PathBuf)> {
    let exe = std::env::current_exe().unwrap();
    let addr = format!("127.0.0.1:{}", free_port());
    modes
        .iter()
        .enumerate()
        .map(|(r, mode)| {
            let out = dir.join(format!("rank{r}"));
            let child = std::process::Command::new(&exe)
                .args([
                    "--exact",
                    "ucx_rank_process",
                    "--nocapture",
                    "--test-threads=1",
                ])
                .env(CHILD, mode)
                .env(CHILD_OUT, &out)
                .env(CHILD_TLS, tls)
                .env(afdep_transport::ENV_RANK, r.to_string())
                .env(afdep_transport::ENV_WORLD_SIZE, modes.len().to_string())
                .env(afdep_transport::ENV_RENDEZVOUS, &addr)
                .stdout(std::process::Stdio::null())
                .spawn()
                .unwrap();
            (child, out)
        })
        .collect()
}

fn decode_rounds(bytes: &[u8]) -> Rounds {
    let mut at = 0;
    let mut next = || {
        let n = u64::from_le_bytes(bytes[at..at + 8].try_into().unwrap()) as usize;
        let v = bytes[at + 8..at + 8 + n].to_vec();
        at += 8 + n;
        v
    };
    (0..12).map(|_| (next(), next())).collect()
}

fn scratch(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("afdep-ucx-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

#[test]
fn two_and_four_processes_match_loopback_bit_for_bit() {
    for tls in TLS {
        for world in [2, 4] {
            let dir = scratch(&format!("rounds-{tls}-{world}"));
            let ranks = spawn_ranks(&vec!["rounds"; world], tls, &dir);
            let want = on_ranks(Loopback::group(world, LONG), |_, mut t| {
                rounds(&mut t, Some(world - 1)).unwrap()
            });
            for (r, (mut child, out)) in ranks.into_iter().enumerate() {
                let st = child.wait().unwrap();
                assert!(st.success(), "{tls}, world {world}: rank {r} exited {st}");
                let got = decode_rounds(&std::fs::read(&out).unwrap());
                assert_eq!(got, want[r], "{tls}, world {world}, rank {r}");
            }
            let _ = std::fs::remove_dir_all(&dir);
        }
    }
}

#[test]
fn a_process_killed_mid_round_fails_the_others_within_the_timeout() {
    for tls in TLS {
        let dir = scratch(&format!("kill-{tls}"));
        let mut ranks = spawn_ranks(&["survive", "stall", "survive"], tls, &dir);
        // wait for the staller to pass the barrier, then kill it while the others wait for it
        let t0 = Instant::now();
        while !ranks[1].1.exists() {
            assert!(
                t0.elapsed() < Duration::from_secs(20),
                "{tls}: rank 1 never joined"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        std::thread::sleep(Duration::from_millis(200));
        ranks[1].0.kill().unwrap();
        let _ = ranks[1].0.wait();
        for r in [0, 2] {
            let st = ranks[r].0.wait().unwrap();
            assert!(st.success(), "{tls}: rank {r} exited {st}");
            let text = std::fs::read_to_string(&ranks[r].1).unwrap();
            let mut it = text.split(' ');
            let (what, peer, ms) = (it.next(), it.next(), it.next());
            // tcp notices the reset connection at once; shared memory has no peer failure
            // detection (see UcxOptions::detect_peer_failure), so there it is the timeout
            let want = if tls == "tcp" { "gone" } else { "timeout" };
            assert!(
                what == Some(want) && peer == Some("1"),
                "{tls} rank {r}: {text}"
            );
            let ms: u64 = ms.unwrap().parse().unwrap();
            assert!(ms < 4000, "{tls} rank {r}: took {ms} ms");
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}
