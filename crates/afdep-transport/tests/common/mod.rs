//! Helpers shared by the transport tests: run one closure per rank on its own thread, and
//! deterministic uneven all-to-all-v rounds checked byte for byte.

#![allow(dead_code)]

use std::time::Duration;

use afdep_transport::{Span, Transport, TransportBuffer, TransportError};

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
