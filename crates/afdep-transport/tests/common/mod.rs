//! Helpers shared by the transport tests: run one closure per rank on its own thread, and
//! deterministic uneven all-to-all-v rounds checked byte for byte.

#![allow(dead_code)]

use std::fmt::Debug;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use afdep_transport::{Bootstrap, Span, Transport, TransportBuffer, TransportError};

/// A timeout long enough never to fire in a passing test.
pub const LONG: Duration = Duration::from_secs(10);

/// Runs `f(rank, transport)` for every rank of `group` on its own thread; results in rank order.
pub fn on_ranks<T, R, F>(group: Vec<T>, f: F) -> Vec<R>
where
    T: Send,
    R: Send,
    F: Fn(usize, T) -> R + Sync,
{
    std::thread::scope(|sc| {
        let f = &f;
        let hs: Vec<_> = group
            .into_iter()
            .enumerate()
            .map(|(r, t)| sc.spawn(move || f(r, t)))
            .collect();
        hs.into_iter()
            .map(|h| h.join().expect("rank thread panicked"))
            .collect()
    })
}

/// 127.0.0.1 on a port the system picks.
pub fn localhost0() -> SocketAddr {
    "127.0.0.1:0".parse().unwrap()
}

/// A port of 127.0.0.1 that was free a moment ago (the system picked it for a listener that is
/// closed again): for a rank 0 that binds it later.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind(localhost0())
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Listens for a bootstrap group of `world` ranks on an ephemeral port and runs
/// `f(rank, bootstrap)` on the threads of ranks `0..started` (the others are never started);
/// `f` gets the accept/connect error of its rank if forming failed. Results in rank order.
pub fn bootstrap_ranks<R: Send>(
    world: usize,
    started: usize,
    timeout: Duration,
    f: impl Fn(usize, Result<Bootstrap, TransportError>) -> R + Sync,
) -> Vec<R> {
    let listener = Bootstrap::listen(localhost0(), world, timeout).unwrap();
    let addr = listener.local_addr();
    assert_ne!(addr.port(), 0);
    let mut listener = Some(listener);
    let slots: Vec<_> = (0..started)
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

/// Asserts that less than `limit` has passed since `t0`.
pub fn assert_within(t0: Instant, limit: Duration) {
    assert!(t0.elapsed() < limit, "took {:?}", t0.elapsed());
}

/// Asserts that every rank's result is a timeout of that rank naming rank `peer`.
pub fn assert_timeouts_naming<T: Debug>(out: Vec<Result<T, TransportError>>, peer: usize) {
    for (r, res) in out.into_iter().enumerate() {
        match res {
            Err(TransportError::Timeout {
                rank,
                peer: Some(p),
                ..
            }) if p == peer => assert_eq!(rank, r),
            other => panic!("rank {r}: expected a timeout naming rank {peer}, got {other:?}"),
        }
    }
}

/// The byte at `i` of what `src` sends `dst` in round `round`.
pub fn byte(round: u64, src: usize, dst: usize, i: u64) -> u8 {
    let x = round
        .wrapping_mul(0x9E37_79B9)
        .wrapping_add((src as u64) << 20)
        .wrapping_add((dst as u64) << 12)
        .wrapping_add(i.wrapping_mul(31));
    (x ^ (x >> 7) ^ (x >> 13)) as u8
}

/// How many bytes `src` sends `dst` in round `round`: uneven, often zero.
pub fn size(round: u64, src: usize, dst: usize) -> u64 {
    let n = (round * 31 + src as u64 * 17 + dst as u64 * 7) % 9;
    if n % 4 == 0 {
        0
    } else {
        n * (1 + src as u64) * 5 + round % 3
    }
}

const POISON: u8 = 0xEE;

/// One all-to-all-v round of the pattern above on this rank, with gaps between spans and the send
/// spans laid out in reverse rank order; checks every received byte and that the gaps of the
/// receive buffer are untouched.
pub fn a2a_round<T: Transport>(t: &mut T, round: u64) -> Result<(), TransportError> {
    let (me, world) = (t.rank(), t.world_size());
    let mut send_spans = vec![Span::EMPTY; world];
    let mut at = 2u64;
    for dst in (0..world).rev() {
        send_spans[dst] = Span::new(at, size(round, me, dst));
        at += send_spans[dst].len + 3;
    }
    let mut send = t.alloc(at as usize)?;
    for (dst, &s) in send_spans.iter().enumerate() {
        let bytes: Vec<u8> = (0..s.len).map(|i| byte(round, me, dst, i)).collect();
        send.write(s.offset as usize, &bytes)?;
    }
    let mut recv_spans = vec![Span::EMPTY; world];
    let mut at = 5u64;
    for (src, span) in recv_spans.iter_mut().enumerate() {
        *span = Span::new(at, size(round, src, me));
        at += span.len + 1;
    }
    let mut recv = t.alloc(at as usize)?;
    recv.write(0, &vec![POISON; at as usize])?;
    t.all_to_all_v(&send, &send_spans, &mut recv, &recv_spans)?;
    let mut got = vec![0u8; at as usize];
    recv.read(0, &mut got)?;
    let mut covered = vec![false; at as usize];
    for (src, s) in recv_spans.iter().enumerate() {
        for i in 0..s.len {
            let at = (s.offset + i) as usize;
            assert_eq!(
                got[at],
                byte(round, src, me, i),
                "round {round}: rank {me} byte {i} from {src}"
            );
            covered[at] = true;
        }
    }
    for (i, (&g, &c)) in got.iter().zip(&covered).enumerate() {
        if !c {
            assert_eq!(g, POISON, "round {round}: rank {me} wrote gap byte {i}");
        }
    }
    Ok(())
}

/// One all-gather round: every rank contributes `len` bytes of its own pattern; checks the result.
pub fn gather_round<T: Transport>(t: &mut T, round: u64, len: u64) -> Result<(), TransportError> {
    let (me, world) = (t.rank(), t.world_size());
    let mine: Vec<u8> = (0..len).map(|i| byte(round, me, usize::MAX, i)).collect();
    let all = t.all_gather(&mine)?;
    assert_eq!(all.len() as u64, len * world as u64);
    for (p, chunk) in all
        .chunks(len.max(1) as usize)
        .enumerate()
        .take(if len == 0 { 0 } else { world })
    {
        let want: Vec<u8> = (0..len).map(|i| byte(round, p, usize::MAX, i)).collect();
        assert_eq!(
            chunk,
            &want[..],
            "round {round}: rank {me}, block of rank {p}"
        );
    }
    Ok(())
}

/// Results of [`bad_rounds`].
pub type BadRounds = (Result<(), TransportError>, Result<(), TransportError>);

/// Two bad all-to-all-v on rank `r` of three: in the first, rank 2 expects a byte from rank 0
/// that rank 0 does not send; in the second, rank 1 passes two send spans for three ranks.
pub fn bad_rounds<T: Transport>(t: &mut T, r: usize) -> BadRounds {
    let send = t.alloc(8).unwrap();
    let mut recv = t.alloc(8).unwrap();
    let e = [Span::EMPTY; 3];
    let mut recv_spans = e;
    if r == 2 {
        recv_spans[0] = Span::new(0, 1);
    }
    let mismatch = t.all_to_all_v(&send, &e, &mut recv, &recv_spans);
    let invalid = if r == 1 {
        t.all_to_all_v(&send, &e[..2], &mut recv, &e)
    } else {
        t.all_to_all_v(&send, &e, &mut recv, &e)
    };
    (mismatch, invalid)
}

/// Checks rank `r`'s [`bad_rounds`]: the mismatch fails rank 2 only, naming rank 0; the invalid
/// arguments fail rank 1 and, as a peer failure naming rank 1, the others. `what` prefixes the
/// panic messages.
pub fn check_bad_rounds(what: &str, r: usize, (mismatch, invalid): BadRounds) {
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
        (_, other) => panic!("{what}rank {r}: {other:?}"),
    }
    match (r, invalid) {
        (1, Err(TransportError::InvalidArgument { rank: 1, .. })) => {}
        (0 | 2, Err(TransportError::PeerFailed { peer: 1, rank, .. })) => assert_eq!(rank, r),
        (_, other) => panic!("{what}rank {r}: {other:?}"),
    }
}
