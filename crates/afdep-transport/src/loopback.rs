//! [`Loopback`]: N ranks as threads of one process, host memory.
//!
//! The ranks of a group share a hub: a set of mailboxes behind one mutex, and one condition
//! variable per rank that rings when a letter for that rank arrives or a peer leaves.
//!
//! # Waiting
//!
//! A rank whose letters are not all there first spins for a short while ([`SPIN`]) on its own
//! ring counter, outside the lock, and only then sleeps on its condition variable. Waking a
//! sleeping thread costs tens of µs and wakes the ranks one after another, so without the spin
//! the ranks leave a barrier tens of µs apart (the skew a benchmark of GPU rounds started after
//! a barrier would measure as round time). The spin is on only when the machine has a core for
//! every rank of the group and one more ([`Loopback::group`]; `AFDEP_LOOPBACK_SPIN` sets it in
//! µs); with fewer cores a spinning rank would take the core the rank it waits for needs.
//!
//! # Operation numbers
//!
//! Every collective call on a rank takes the next number of that rank's own counter, whether the
//! call succeeds or fails, so the k-th call of every rank forms operation k of the group. A
//! letter is keyed by `(k, source, destination)` and carries the name of the operation, so
//! consecutive operations cannot mix and two ranks calling different collectives at the same `k`
//! get a [`Protocol`](TransportError::Protocol) error instead of each other's bytes.
//!
//! An operation on one rank first posts one letter to every peer (data, or an abort marker when
//! its own arguments are invalid), then collects one letter from every peer. When operation k
//! ends on rank r, successfully or not, r removes whatever is still addressed to it for k and
//! records that it is past k; a letter for an operation its destination is past is dropped on
//! arrival. So the leftovers of a failed operation never reach the next one, and every rank's
//! operation k+1 starts clean.
//!
//! A rank that times out on operation k also replaces its letters that peers have not collected
//! yet with abort markers. A late rank that reaches operation k afterwards therefore fails it too
//! ([`PeerFailed`](TransportError::PeerFailed), naming the rank that gave up) instead of
//! completing it with data the others abandoned; from operation k+1 on the group is aligned
//! again. (A rank that fails for another reason, a size mismatch say, leaves its letters in place:
//! what it sent was valid, and its peers complete the operation.)
//!
//! # Failures
//!
//! Letters are judged in rank order, so the peer an error names does not depend on the order in
//! which letters happened to arrive: a rank reports the lowest-numbered peer whose letter is
//! wrong, once every lower-numbered peer's letter has arrived and is right.
//!
//! - **Timeout**: a rank waits at most its timeout for its letters, then returns
//!   [`Timeout`](TransportError::Timeout) naming the lowest-numbered peer whose letter is missing.
//! - **Peer gone**: dropping a `Loopback` (its thread returned, or panicked and unwound) marks the
//!   rank as gone in the hub and rings every rank. A rank waiting for a letter from a gone rank
//!   gets [`PeerGone`](TransportError::PeerGone) at once. Letters a rank posted before leaving are
//!   still delivered, so an operation it completed its part of still succeeds.
//! - **Size mismatch**: sizes travel with the letters; the receiving rank reports
//!   [`SizeMismatch`](TransportError::SizeMismatch) naming the sender. Senders never wait for
//!   their letters to be collected, so they cannot hang on a mismatch.
//! - **Invalid arguments** on one rank (span lists of the wrong length, spans out of bounds): that
//!   rank returns the error, and posts abort markers, so its peers fail the same operation with
//!   `PeerFailed` right away rather than waiting for the timeout.

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tracing::debug;

use crate::{
    DEFAULT_TIMEOUT, HostBuffer, Span, Transport, TransportError, TransportKind, check_transfer,
};

/// One rank of an in-process group; see the [module docs](self). Each is `Send`, to be moved
/// into the thread that plays that rank.
pub struct Loopback {
    hub: Arc<Hub>,
    rank: usize,
    /// Number of the next operation (= operations started so far).
    seq: u64,
    timeout: Duration,
}

/// How long a waiting rank spins before it sleeps ([module docs](self#waiting)).
pub const SPIN: Duration = Duration::from_micros(200);

/// `AFDEP_LOOPBACK_SPIN` (µs), read once; a value that is not a number is warned about and
/// ignored.
fn spin_from_env() -> Option<Duration> {
    static SPIN_ENV: std::sync::OnceLock<Option<Duration>> = std::sync::OnceLock::new();
    *SPIN_ENV.get_or_init(|| {
        let v = std::env::var("AFDEP_LOOPBACK_SPIN").ok()?;
        match v.trim().parse::<u64>() {
            Ok(us) => Some(Duration::from_micros(us)),
            Err(_) => {
                tracing::warn!(value = %v, "AFDEP_LOOPBACK_SPIN is not a number of µs: ignored");
                None
            }
        }
    })
}

struct Hub {
    world: usize,
    state: Mutex<State>,
    /// `bell[r]` rings when a letter for rank r arrives or any rank leaves.
    bell: Vec<Condvar>,
    /// `rung[r]` counts the rings of `bell[r]` (incremented under the lock, before the ring):
    /// what a spinning rank watches.
    rung: Vec<AtomicU64>,
    /// How long a waiting rank spins first (zero: it sleeps at once).
    spin: Duration,
}

struct State {
    mail: HashMap<(u64, usize, usize), Letter>,
    alive: Vec<bool>,
    /// `done[r]`: rank r has ended every operation numbered below this.
    done: Vec<u64>,
}

struct Letter {
    op: &'static str,
    body: Body,
}

enum Body {
    Shared(Arc<[u8]>),
    Owned(Vec<u8>),
    Abort(Arc<str>),
}

impl Body {
    fn bytes(&self) -> &[u8] {
        match self {
            Body::Shared(b) => b,
            Body::Owned(b) => b,
            Body::Abort(_) => &[],
        }
    }
}

/// What one rank posts in one operation.
enum Outgoing {
    /// The same bytes to every peer.
    Same(Arc<[u8]>),
    /// `per_peer[p]` to rank p (this rank's own entry is ignored).
    PerPeer(Vec<Vec<u8>>),
}

impl Hub {
    fn lock(&self) -> MutexGuard<'_, State> {
        // no code panics while holding the lock; recover anyway rather than cascade
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Rings rank `r`'s bell: its counter (for a spinning waiter), then its condition variable
    /// (for a sleeping one).
    fn ring(&self, r: usize) {
        self.rung[r].fetch_add(1, Ordering::Release);
        self.bell[r].notify_all();
    }
}

impl State {
    fn post(&mut self, seq: u64, src: usize, dst: usize, letter: Letter) {
        if self.alive[dst] && seq >= self.done[dst] {
            self.mail.insert((seq, src, dst), letter);
        }
    }
}

impl Loopback {
    /// A group of `world_size` ranks; element r is rank r. Every wait of every rank is bounded by
    /// `timeout` (see [`Transport::set_timeout`] to change one rank's). `world_size == 0` gives an
    /// empty group.
    ///
    /// Waiting ranks spin for [`SPIN`] before they sleep when the machine has more cores than
    /// `world_size` ([module docs](self#waiting)).
    ///
    /// The environment variable `AFDEP_LOOPBACK_SPIN` overrides the spin: a number of µs (`0`:
    /// sleep at once), whatever the cores.
    pub fn group(world_size: usize, timeout: Duration) -> Vec<Loopback> {
        let cores = std::thread::available_parallelism().map_or(1, usize::from);
        let spin = spin_from_env().unwrap_or(if cores > world_size {
            SPIN
        } else {
            Duration::ZERO
        });
        Loopback::group_spinning(world_size, timeout, spin)
    }

    /// [`Loopback::group`] with the spin before a rank sleeps given (zero: none).
    pub fn group_spinning(world_size: usize, timeout: Duration, spin: Duration) -> Vec<Loopback> {
        let hub = Arc::new(Hub {
            world: world_size,
            state: Mutex::new(State {
                mail: HashMap::new(),
                alive: vec![true; world_size],
                done: vec![0; world_size],
            }),
            bell: (0..world_size).map(|_| Condvar::new()).collect(),
            rung: (0..world_size).map(|_| AtomicU64::new(0)).collect(),
            spin,
        });
        (0..world_size)
            .map(|rank| Loopback {
                hub: hub.clone(),
                rank,
                seq: 0,
                timeout,
            })
            .collect()
    }

    /// A group with the [`DEFAULT_TIMEOUT`].
    pub fn group_default(world_size: usize) -> Vec<Loopback> {
        Loopback::group(world_size, DEFAULT_TIMEOUT)
    }

    /// How many collective operations this rank has started (the number of the next one).
    pub fn ops_started(&self) -> u64 {
        self.seq
    }

    /// One operation: posts `out` (or, if it is an error, abort markers) to every peer, then
    /// collects one letter from every peer, checking its operation and that its size is
    /// `expect(peer)`. Returns the letters indexed by source (`None` at this rank).
    fn exchange(
        &mut self,
        op: &'static str,
        out: Result<Outgoing, TransportError>,
        expect: &dyn Fn(usize) -> u64,
    ) -> Result<Vec<Option<Body>>, TransportError> {
        let me = self.rank;
        let world = self.hub.world;
        let seq = self.seq;
        self.seq += 1;
        debug!(rank = me, seq, op, "loopback op");

        let letter = |body| Letter { op, body };
        let mut st = self.hub.lock();
        let local_err = match out {
            Ok(Outgoing::Same(bytes)) => {
                for p in (0..world).filter(|&p| p != me) {
                    st.post(seq, me, p, letter(Body::Shared(bytes.clone())));
                }
                None
            }
            Ok(Outgoing::PerPeer(per)) => {
                for (p, bytes) in per.into_iter().enumerate().filter(|&(p, _)| p != me) {
                    st.post(seq, me, p, letter(Body::Owned(bytes)));
                }
                None
            }
            Err(e) => {
                let why: Arc<str> = Arc::from(e.to_string());
                for p in (0..world).filter(|&p| p != me) {
                    st.post(seq, me, p, letter(Body::Abort(why.clone())));
                }
                Some(e)
            }
        };
        for p in (0..world).filter(|&p| p != me) {
            self.hub.ring(p);
        }

        let result = match local_err {
            Some(e) => Err(e),
            None => {
                let (g, r) = self.collect(st, op, seq, expect);
                st = g;
                r
            }
        };

        // operation `seq` is over on this rank: nothing addressed to it for `seq` may linger
        st.done[me] = seq + 1;
        for p in 0..world {
            st.mail.remove(&(seq, p, me));
        }
        drop(st);
        if let Err(e) = &result {
            debug!(rank = me, seq, op, error = %e, "loopback op failed");
        }
        result
    }

    /// The collecting half of [`Loopback::exchange`]; hands the lock back with the result.
    ///
    /// Letters are judged in rank order, so the peer an error names does not depend on arrival
    /// order: the lowest-numbered peer whose letter is wrong (another operation, an abort marker,
    /// a wrong size) is reported once every lower-numbered letter has arrived and is right. A
    /// missing letter from a gone peer fails the operation at once; otherwise the rank waits up to
    /// its timeout and then names the lowest-numbered peer whose letter is missing.
    fn collect<'a>(
        &'a self,
        mut st: MutexGuard<'a, State>,
        op: &'static str,
        seq: u64,
        expect: &dyn Fn(usize) -> u64,
    ) -> (
        MutexGuard<'a, State>,
        Result<Vec<Option<Body>>, TransportError>,
    ) {
        let me = self.rank;
        let world = self.hub.world;
        let start = Instant::now();
        let deadline = start.checked_add(self.timeout);
        // spin (outside the lock) until this, then sleep
        let spin_until = start.checked_add(self.hub.spin.min(self.timeout));
        let mut got: Vec<Option<Letter>> = (0..world).map(|_| None).collect();
        loop {
            for (p, slot) in got.iter_mut().enumerate() {
                if p != me && slot.is_none() {
                    *slot = st.mail.remove(&(seq, p, me));
                }
            }
            let mut complete = true;
            for (p, slot) in got.iter().enumerate().filter(|&(p, _)| p != me) {
                let Some(letter) = slot else {
                    complete = false;
                    break;
                };
                if let Err(e) = judge(op, me, seq, p, letter, expect(p)) {
                    return (st, Err(e));
                }
            }
            if complete {
                return (st, Ok(got.into_iter().map(|l| l.map(|l| l.body)).collect()));
            }
            let missing = |gone: bool| {
                (0..world).find(|&p| p != me && got[p].is_none() && (!gone || !st.alive[p]))
            };
            if let Some(peer) = missing(true) {
                return (st, Err(TransportError::PeerGone { op, rank: me, peer }));
            }
            let now = Instant::now();
            if let Some(until) = spin_until.filter(|&u| now < u) {
                // a ring after this load (a letter posted, a rank gone) changes the count
                let seen = self.hub.rung[me].load(Ordering::Acquire);
                drop(st);
                while self.hub.rung[me].load(Ordering::Acquire) == seen && Instant::now() < until {
                    std::hint::spin_loop();
                }
                st = self.hub.lock();
                continue;
            }
            match deadline {
                Some(d) if now >= d => {
                    let waited = now - start;
                    let late = missing(false);
                    self.retract(&mut st, op, seq, waited, late);
                    let e = TransportError::Timeout {
                        op,
                        rank: me,
                        peer: late,
                        waited,
                    };
                    return (st, Err(e));
                }
                Some(d) => {
                    st = self.hub.bell[me]
                        .wait_timeout(st, d - now)
                        .unwrap_or_else(|e| e.into_inner())
                        .0;
                }
                None => {
                    st = self.hub.bell[me]
                        .wait(st)
                        .unwrap_or_else(|e| e.into_inner())
                }
            }
        }
    }

    /// After a timeout: turns this rank's uncollected letters of `seq` into abort markers.
    fn retract(
        &self,
        st: &mut State,
        op: &'static str,
        seq: u64,
        waited: Duration,
        late: Option<usize>,
    ) {
        let me = self.rank;
        let why: Arc<str> = Arc::from(format!(
            "rank {me} gave up on {op} #{seq} after waiting {waited:?} for {}",
            late.map_or_else(|| "a peer".to_string(), |p| format!("rank {p}"))
        ));
        for p in (0..self.hub.world).filter(|&p| p != me) {
            if let Some(l) = st.mail.get_mut(&(seq, me, p)) {
                l.body = Body::Abort(why.clone());
            }
        }
    }
}

/// Checks the letter rank `me` got from `peer` in operation `seq` of `op`.
fn judge(
    op: &'static str,
    me: usize,
    seq: u64,
    peer: usize,
    letter: &Letter,
    expected: u64,
) -> Result<(), TransportError> {
    if letter.op != op {
        return Err(TransportError::Protocol {
            op,
            rank: me,
            peer: Some(peer),
            why: format!(
                "operation #{seq} is {op} here but {} on rank {peer}",
                letter.op
            ),
        });
    }
    if let Body::Abort(why) = &letter.body {
        return Err(TransportError::PeerFailed {
            op,
            rank: me,
            peer,
            why: why.to_string(),
        });
    }
    let got = letter.body.bytes().len() as u64;
    if got != expected {
        return Err(TransportError::SizeMismatch {
            op,
            rank: me,
            peer,
            expected,
            got,
        });
    }
    Ok(())
}

impl fmt::Debug for Loopback {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Loopback")
            .field("rank", &self.rank)
            .field("world_size", &self.hub.world)
            .field("ops_started", &self.seq)
            .field("timeout", &self.timeout)
            .finish()
    }
}

impl Drop for Loopback {
    fn drop(&mut self) {
        let me = self.rank;
        let mut st = self.hub.lock();
        st.alive[me] = false;
        st.mail.retain(|&(_, _, dst), _| dst != me);
        drop(st);
        for r in 0..self.hub.world {
            self.hub.ring(r);
        }
        debug!(rank = me, "loopback rank left");
    }
}

impl Transport for Loopback {
    type Buffer = HostBuffer;

    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.hub.world
    }

    fn kind(&self) -> TransportKind {
        TransportKind::Loopback
    }

    fn timeout(&self) -> Duration {
        self.timeout
    }

    fn set_timeout(&mut self, timeout: Duration) {
        self.timeout = timeout;
    }

    fn alloc(&mut self, bytes: usize) -> Result<HostBuffer, TransportError> {
        Ok(HostBuffer::zeroed(self.rank, bytes))
    }

    fn all_gather(&mut self, mine: &[u8]) -> Result<Vec<u8>, TransportError> {
        let n = mine.len() as u64;
        let got = self.exchange("all_gather", Ok(Outgoing::Same(Arc::from(mine))), &|_| n)?;
        let mut all = Vec::with_capacity(mine.len() * self.hub.world);
        for (p, body) in got.iter().enumerate() {
            match body {
                Some(b) => all.extend_from_slice(b.bytes()),
                None => {
                    debug_assert_eq!(p, self.rank);
                    all.extend_from_slice(mine);
                }
            }
        }
        Ok(all)
    }

    fn all_to_all_v(
        &mut self,
        send: &HostBuffer,
        send_spans: &[Span],
        recv: &mut HostBuffer,
        recv_spans: &[Span],
    ) -> Result<(), TransportError> {
        const OP: &str = "all_to_all_v";
        let me = self.rank;
        let world = self.hub.world;
        let out = check_transfer(self, OP, send, send_spans, recv, recv_spans)
            .and_then(|()| {
                (0..world)
                    .map(|p| {
                        if p == me {
                            Ok(Vec::new())
                        } else {
                            Ok(send.span(OP, Some(p), send_spans[p])?.to_vec())
                        }
                    })
                    .collect::<Result<Vec<_>, _>>()
            })
            .map(Outgoing::PerPeer);
        let expect = |p: usize| recv_spans.get(p).map_or(0, |s| s.len);
        let got = self.exchange(OP, out, &expect)?;
        // every size agrees before a byte of `recv` is written
        if send_spans[me].len != recv_spans[me].len {
            return Err(TransportError::SizeMismatch {
                op: OP,
                rank: me,
                peer: me,
                expected: recv_spans[me].len,
                got: send_spans[me].len,
            });
        }
        for (p, body) in got.iter().enumerate() {
            let dst = recv.span_mut(OP, Some(p), recv_spans[p])?;
            match body {
                Some(b) => dst.copy_from_slice(b.bytes()),
                None => dst.copy_from_slice(send.span(OP, Some(p), send_spans[p])?),
            }
        }
        Ok(())
    }

    fn barrier(&mut self) -> Result<(), TransportError> {
        self.exchange("barrier", Ok(Outgoing::Same(Arc::from(&[][..]))), &|_| 0)
            .map(|_| ())
    }
}
