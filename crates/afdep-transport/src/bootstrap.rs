//! [`Bootstrap`]: the rendezvous of the ranks of a multi-process group over TCP.
//!
//! Multi-process transports use it to find each other and to exchange their set-up blobs (CUDA
//! IPC handles, the NCCL unique id, UCX worker addresses), which may differ in length from rank to
//! rank; [`HostTcp`](crate::HostTcp) also moves its data through it.
//!
//! # Shape
//!
//! A star: rank 0 listens, every other rank connects to it (retrying until the timeout, since
//! rank 0 may start later) and all traffic is relayed by rank 0. Every operation is one round
//! trip for a non-root rank: it sends its contribution to rank 0 and waits for rank 0's answer.
//!
//! # Wire format
//!
//! Every message is a frame: a 24-byte little-endian header (magic `AFDP`, kind `u32`,
//! operation number `u64`, payload length `u64`) and the payload. Operations are numbered from
//! 1; a frame of another kind or number than expected is a `Protocol` error.
//!
//! # Handshake, job identity, stray peers
//!
//! The handshake is operation 0: each non-root rank sends `hello(version, rank, world size,
//! job)`, where the job is a [`JobId`] shared by the ranks of one group (from
//! [`ENV_JOB_ID`], which `afdep launch` sets to a random value, or given to
//! [`connect_as`](Bootstrap::connect_as) / [`with_job`](BootstrapListener::with_job); ranks
//! started without one belong to the job [`JobId::UNNAMED`]). Rank 0 handles the connections
//! that wait for their hello side by side (a silent one does not delay the others) and reads at
//! most a header and 4 KiB (`handshake`) from each. A connection whose first bytes are not the
//! magic, whose hello is of another protocol version or job, oversized, truncated, malformed,
//! or missing after the hello wait (half the timeout, at most 5 s), or that is the oldest of 64
//! pending connections when another arrives, is a *stray*: rank 0 records
//! a [`Handshake`](TransportError::Handshake) error naming its address and what was expected
//! and received ([`Bootstrap::rejected`], and a warning in the log), sends it an `abort` saying
//! why, drops it, and keeps accepting the ranks of its group.
//!
//! A hello of this job is a rank of the group: rank 0 checks the world size
//! ([`WorldSizeMismatch`](TransportError::WorldSizeMismatch)), that the rank is in `1..world`
//! ([`Protocol`](TransportError::Protocol)) and that no rank appears twice
//! ([`DuplicateRank`](TransportError::DuplicateRank)), any of which fails the whole group;
//! once all have joined it answers `welcome(version, world size, job)`, which each rank checks
//! in turn (a non-root rank that reached another job's rank 0, or something that is not a
//! bootstrap, gets a `Handshake` error).
//!
//! Rank 0 listens on exactly the rendezvous address it is given: `afdep launch` gives
//! `127.0.0.1`, so a group is reachable from this machine only unless an address reachable from
//! other hosts is given explicitly (`--rendezvous`, [`ENV_RENDEZVOUS`]) for a multi-host group.
//!
//! # Time bounds and failures
//!
//! Every socket read and write is bounded by the operation's deadline (socket timeouts are set
//! to the time left before each system call). Rank 0 waits at most the timeout for each phase;
//! other ranks wait for rank 0's answer the timeout plus a grace of half of it (at most 5 s), so
//! that rank 0's verdict, which names the rank that is late, reaches them before their own
//! timeout fires. A closed connection (end of stream, reset, broken pipe) is
//! [`PeerGone`](TransportError::PeerGone) naming the rank at the other end.
//!
//! When an operation fails on any rank, that rank sends an `abort` frame with its verdict (rank 0
//! to every other rank, others to rank 0), so the whole group fails the operation promptly with
//! errors that name the same culprit (a rank that timed out on rank 2 makes every rank report
//! `Timeout` naming rank 2; a rank that closed its socket makes every rank report `PeerGone`
//! naming it). After a failure the stream positions can no longer be trusted: the bootstrap is
//! closed, and later calls return [`Closed`](TransportError::Closed).

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use tracing::{debug, warn};

use crate::TransportError;
use crate::error::HandshakeFault;

mod handshake;

use handshake::{Hello, Scan, Welcome, scan};
pub use handshake::{InvalidJobId, JobId, fuzz_decoders};

/// Environment variable holding this process's rank.
pub const ENV_RANK: &str = "AFDEP_RANK";
/// Environment variable holding the number of ranks.
pub const ENV_WORLD_SIZE: &str = "AFDEP_WORLD_SIZE";
/// Environment variable holding rank 0's rendezvous address, `host:port`.
pub const ENV_RENDEZVOUS: &str = "AFDEP_RENDEZVOUS";
/// Environment variable holding the job identity ([`JobId`]; optional: without it a rank
/// belongs to the job [`JobId::UNNAMED`]).
pub const ENV_JOB_ID: &str = "AFDEP_JOB_ID";

const MAGIC: u32 = u32::from_le_bytes(*b"AFDP");
/// The bootstrap protocol's version (2: the handshake carries the job identity).
const VERSION: u32 = 2;
/// How long rank 0 waits for the hello of a connection, at most (and at most half the timeout).
const HELLO_WAIT: Duration = Duration::from_secs(5);
/// The most connections rank 0 keeps waiting for their hello at once; a new one beyond it makes
/// the oldest give way.
const MAX_PENDING: usize = 64;
/// The longest reason text an abort frame carries.
const MAX_WHY: usize = 1024;
const HEADER: usize = 24;
/// Largest payload accepted (a guard against a corrupt length, not a memory reservation: payloads
/// are read in chunks as they arrive).
const MAX_PAYLOAD: u64 = 1 << 40;
const READ_CHUNK: u64 = 1 << 20;

mod kind {
    pub const HELLO: u32 = 1;
    pub const WELCOME: u32 = 2;
    pub const ABORT: u32 = 3;
    pub const GATHER: u32 = 10;
    pub const GATHER_ALL: u32 = 11;
    pub const BCAST: u32 = 12;
    pub const BARRIER: u32 = 13;
    pub const RELEASE: u32 = 14;
    pub const A2A: u32 = 15;
    pub const A2A_OUT: u32 = 16;

    pub fn name(k: u32) -> &'static str {
        match k {
            HELLO => "hello",
            WELCOME => "welcome",
            ABORT => "abort",
            GATHER => "all_gather",
            GATHER_ALL => "all_gather result",
            BCAST => "broadcast",
            BARRIER => "barrier",
            RELEASE => "barrier release",
            A2A => "all_to_all",
            A2A_OUT => "all_to_all result",
            _ => "unknown",
        }
    }
}

/// The rendezvous read from [`ENV_RANK`], [`ENV_WORLD_SIZE`], [`ENV_RENDEZVOUS`] and
/// [`ENV_JOB_ID`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RendezvousEnv {
    /// This process's rank.
    pub rank: usize,
    /// The number of ranks.
    pub world_size: usize,
    /// Rank 0's address (the first address `host:port` resolves to).
    pub addr: SocketAddr,
    /// The job ([`JobId::unnamed`] when [`ENV_JOB_ID`] is not set).
    pub job: JobId,
}

impl RendezvousEnv {
    /// Reads the process environment.
    pub fn from_env() -> Result<RendezvousEnv, TransportError> {
        RendezvousEnv::from_lookup(|k| {
            std::env::var_os(k).map(|v| {
                v.into_string()
                    .unwrap_or_else(|v| v.to_string_lossy().into())
            })
        })
    }

    /// Reads the variables through `get` (a map in tests, the environment in
    /// [`from_env`](RendezvousEnv::from_env)).
    pub fn from_lookup(
        get: impl Fn(&str) -> Option<String>,
    ) -> Result<RendezvousEnv, TransportError> {
        let var = |name: &'static str| {
            get(name).ok_or_else(|| TransportError::Env {
                var: name,
                why: "not set".into(),
            })
        };
        let number = |name: &'static str| -> Result<usize, TransportError> {
            let v = var(name)?;
            v.trim().parse().map_err(|e| TransportError::Env {
                var: name,
                why: format!("{v:?} is not a non-negative integer: {e}"),
            })
        };
        let rank = number(ENV_RANK)?;
        let world_size = number(ENV_WORLD_SIZE)?;
        if world_size == 0 {
            return Err(TransportError::Env {
                var: ENV_WORLD_SIZE,
                why: "must be at least 1".into(),
            });
        }
        if rank >= world_size {
            return Err(TransportError::Env {
                var: ENV_RANK,
                why: format!("rank {rank} is outside a world of {world_size}"),
            });
        }
        let text = var(ENV_RENDEZVOUS)?;
        let addr = text
            .trim()
            .to_socket_addrs()
            .map_err(|e| TransportError::Env {
                var: ENV_RENDEZVOUS,
                why: format!("{text:?} is not a host:port address: {e}"),
            })?
            .next()
            .ok_or_else(|| TransportError::Env {
                var: ENV_RENDEZVOUS,
                why: format!("{text:?} resolves to no address"),
            })?;
        let job = job_from(get(ENV_JOB_ID))?;
        Ok(RendezvousEnv {
            rank,
            world_size,
            addr,
            job,
        })
    }
}

/// The job named by the value of [`ENV_JOB_ID`], if set.
fn job_from(v: Option<String>) -> Result<JobId, TransportError> {
    match v {
        None => Ok(JobId::unnamed()),
        Some(v) => JobId::new(v.trim()).map_err(|e| TransportError::Env {
            var: ENV_JOB_ID,
            why: e.to_string(),
        }),
    }
}

/// The job of this process: [`ENV_JOB_ID`] if set, else [`JobId::unnamed`].
pub fn job_from_env() -> Result<JobId, TransportError> {
    job_from(std::env::var_os(ENV_JOB_ID).map(|v| v.to_string_lossy().into_owned()))
}

/// The time bound of one phase.
#[derive(Debug, Clone, Copy)]
struct Deadline {
    start: Instant,
    end: Option<Instant>,
}

impl Deadline {
    fn after(d: Duration) -> Deadline {
        let start = Instant::now();
        Deadline {
            start,
            end: start.checked_add(d),
        }
    }

    /// The time left, as a socket timeout (`None`: unbounded); `TimedOut` when none is left.
    fn left(&self) -> io::Result<Option<Duration>> {
        match self.end {
            None => Ok(None),
            Some(end) => {
                let now = Instant::now();
                if now >= end {
                    Err(io::ErrorKind::TimedOut.into())
                } else {
                    Ok(Some((end - now).max(Duration::from_millis(1))))
                }
            }
        }
    }

    fn passed(&self) -> bool {
        self.end.is_some_and(|e| Instant::now() >= e)
    }

    fn waited(&self) -> Duration {
        self.start.elapsed()
    }
}

/// How long a non-root rank waits for rank 0's answer: the timeout plus a grace.
fn leaf_wait(timeout: Duration) -> Duration {
    timeout.saturating_add((timeout / 2).min(Duration::from_secs(5)))
}

fn is_transient(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::Interrupted | io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
    )
}

fn write_all_by(s: &mut TcpStream, mut buf: &[u8], dl: Deadline) -> io::Result<()> {
    while !buf.is_empty() {
        s.set_write_timeout(dl.left()?)?;
        match s.write(buf) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => buf = &buf[n..],
            Err(e) if is_transient(&e) => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

fn read_exact_by(s: &mut TcpStream, mut buf: &mut [u8], dl: Deadline) -> io::Result<()> {
    while !buf.is_empty() {
        s.set_read_timeout(dl.left()?)?;
        match s.read(buf) {
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => buf = &mut buf[n..],
            Err(e) if is_transient(&e) => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

struct Frame {
    kind: u32,
    seq: u64,
    payload: Vec<u8>,
}

fn write_frame(
    s: &mut TcpStream,
    kind: u32,
    seq: u64,
    payload: &[u8],
    dl: Deadline,
) -> io::Result<()> {
    let mut head = [0u8; HEADER];
    head[0..4].copy_from_slice(&MAGIC.to_le_bytes());
    head[4..8].copy_from_slice(&kind.to_le_bytes());
    head[8..16].copy_from_slice(&seq.to_le_bytes());
    head[16..24].copy_from_slice(&(payload.len() as u64).to_le_bytes());
    if payload.len() <= 64 * 1024 {
        let mut all = Vec::with_capacity(HEADER + payload.len());
        all.extend_from_slice(&head);
        all.extend_from_slice(payload);
        write_all_by(s, &all, dl)
    } else {
        write_all_by(s, &head, dl)?;
        write_all_by(s, payload, dl)
    }
}

/// The kind, operation number and payload length of a frame header.
fn parse_header(head: &[u8; HEADER]) -> io::Result<(u32, u64, u64)> {
    let word = |at: usize| {
        let mut w = [0u8; 8];
        w.copy_from_slice(&head[at..at + 8]);
        u64::from_le_bytes(w)
    };
    let magic = u32::from_le_bytes([head[0], head[1], head[2], head[3]]);
    if magic != MAGIC {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("bad frame magic {magic:#010x}"),
        ));
    }
    let kind = u32::from_le_bytes([head[4], head[5], head[6], head[7]]);
    let (seq, len) = (word(8), word(16));
    if len > MAX_PAYLOAD {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("frame of {len} bytes"),
        ));
    }
    Ok((kind, seq, len))
}

/// Reads one frame. The payload grows in chunks as its bytes arrive (a corrupt length costs no
/// memory that the peer did not send), and every read is bounded by `dl`.
fn read_frame(s: &mut TcpStream, dl: Deadline) -> io::Result<Frame> {
    let mut head = [0u8; HEADER];
    read_exact_by(s, &mut head, dl)?;
    let (kind, seq, len) = parse_header(&head)?;
    let mut payload = Vec::new();
    let mut left = len;
    while left > 0 {
        let chunk = left.min(READ_CHUNK) as usize;
        let at = payload.len();
        payload.resize(at + chunk, 0);
        read_exact_by(s, &mut payload[at..], dl)?;
        left -= chunk as u64;
    }
    Ok(Frame { kind, seq, payload })
}

/// Checks that `f`, from `peer`, is operation `seq` of kind `want` on rank `rank` (of `world`);
/// an abort frame becomes the error it describes.
#[allow(clippy::too_many_arguments)]
fn expect_frame(
    rank: usize,
    world: usize,
    op: &'static str,
    peer: usize,
    seq: u64,
    want: u32,
    f: Frame,
    dl: &Deadline,
) -> Result<Vec<u8>, TransportError> {
    let protocol = |why: String| TransportError::Protocol {
        op,
        rank,
        peer: Some(peer),
        why,
    };
    if f.kind == kind::ABORT {
        let v = Verdict::decode(&f.payload).ok_or_else(|| protocol("malformed abort".into()))?;
        return Err(if rank == 0 {
            // a non-root rank gave up on this operation
            TransportError::PeerFailed {
                op,
                rank: 0,
                peer,
                why: v.why,
            }
        } else {
            v.into_error(op, rank, world, peer, dl.waited())
        });
    }
    if f.kind != want || f.seq != seq {
        return Err(protocol(format!(
            "expected {} #{seq}, got {} #{} (ranks called different operations)",
            kind::name(want),
            kind::name(f.kind),
            f.seq
        )));
    }
    Ok(f.payload)
}

fn io_error(
    op: &'static str,
    rank: usize,
    peer: usize,
    e: io::Error,
    dl: &Deadline,
) -> TransportError {
    use io::ErrorKind::*;
    match e.kind() {
        UnexpectedEof | ConnectionReset | ConnectionAborted | BrokenPipe | NotConnected
        | WriteZero => TransportError::PeerGone { op, rank, peer },
        TimedOut | WouldBlock => TransportError::Timeout {
            op,
            rank,
            peer: Some(peer),
            waited: dl.waited(),
        },
        InvalidData => TransportError::Protocol {
            op,
            rank,
            peer: Some(peer),
            why: e.to_string(),
        },
        _ => TransportError::Io {
            op,
            rank,
            peer: Some(peer),
            source: e,
        },
    }
}

/// `[u64 count] ([u64 len] bytes)*`
fn encode_list<B: AsRef<[u8]>>(items: &[B]) -> Vec<u8> {
    let total: usize = items.iter().map(|b| 8 + b.as_ref().len()).sum();
    let mut out = Vec::with_capacity(8 + total);
    out.extend_from_slice(&(items.len() as u64).to_le_bytes());
    for b in items {
        out.extend_from_slice(&(b.as_ref().len() as u64).to_le_bytes());
        out.extend_from_slice(b.as_ref());
    }
    out
}

fn decode_list(mut p: &[u8], count: usize) -> Result<Vec<Vec<u8>>, String> {
    fn take<'a>(p: &mut &'a [u8], n: u64) -> Result<&'a [u8], String> {
        let n = usize::try_from(n).map_err(|_| "length overflows".to_string())?;
        if p.len() < n {
            return Err(format!(
                "list truncated: {n} bytes wanted, {} left",
                p.len()
            ));
        }
        let (a, b) = p.split_at(n);
        *p = b;
        Ok(a)
    }
    let n = u64::from_le_bytes(take(&mut p, 8)?.try_into().map_err(|_| "short")?);
    if n != count as u64 {
        return Err(format!("list of {n} entries, expected {count}"));
    }
    let mut out = Vec::with_capacity(count);
    for _ in 0..count {
        let len = u64::from_le_bytes(take(&mut p, 8)?.try_into().map_err(|_| "short")?);
        out.push(take(&mut p, len)?.to_vec());
    }
    if !p.is_empty() {
        return Err(format!("{} trailing bytes after the list", p.len()));
    }
    Ok(out)
}

/// The content of an abort frame: why an operation failed, in a form every rank turns into its own
/// typed error naming the same culprit.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Verdict {
    code: u32,
    peer: u64,
    a: u64,
    b: u64,
    why: String,
}

mod code {
    pub const TIMEOUT: u32 = 1;
    pub const GONE: u32 = 2;
    pub const WORLD: u32 = 3;
    pub const DUPLICATE: u32 = 4;
    pub const FAILED: u32 = 5;
    /// A refused handshake: `a` is 1 for another job (`why` holds rank 0's job), 2 for another
    /// version (`b` is rank 0's version), 0 otherwise.
    pub const HANDSHAKE: u32 = 6;
}

const NO_PEER: u64 = u64::MAX;

impl Verdict {
    /// The verdict `reporter` sends about its own error `e`.
    fn of(e: &TransportError, reporter: usize) -> Verdict {
        let v = |code, peer: Option<usize>, a, b| Verdict {
            code,
            peer: peer.map_or(NO_PEER, |p| p as u64),
            a,
            b,
            why: e.to_string(),
        };
        match e {
            TransportError::Timeout { peer, .. } => v(code::TIMEOUT, *peer, 0, 0),
            TransportError::PeerGone { peer, .. } => v(code::GONE, Some(*peer), 0, 0),
            TransportError::WorldSizeMismatch {
                peer,
                expected,
                got,
                ..
            } => v(code::WORLD, Some(*peer), *got as u64, *expected as u64),
            TransportError::DuplicateRank { peer, .. } => v(code::DUPLICATE, Some(*peer), 0, 0),
            TransportError::PeerFailed { peer, .. } => v(code::FAILED, Some(*peer), 0, 0),
            TransportError::Handshake { fault, .. } => {
                let mut h = v(code::HANDSHAKE, None, 0, 0);
                match fault {
                    HandshakeFault::Job { expected, .. } => {
                        h.a = 1;
                        h.why = expected.clone();
                    }
                    HandshakeFault::Version { expected, .. } => {
                        h.a = 2;
                        h.b = u64::from(*expected);
                    }
                    _ => {}
                }
                h
            }
            _ => v(code::FAILED, Some(reporter), 0, 0),
        }
    }

    /// The fault a non-root rank whose hello rank 0 refused reports.
    fn handshake_fault(self, job: &JobId) -> HandshakeFault {
        match self.a {
            1 => HandshakeFault::Job {
                expected: job.to_string(),
                got: self.why,
            },
            2 => HandshakeFault::Version {
                expected: VERSION,
                got: u32::try_from(self.b).unwrap_or(u32::MAX),
            },
            _ => HandshakeFault::Refused { why: self.why },
        }
    }

    /// The payload of an abort frame; `why` is cut to [`MAX_WHY`] bytes (at a character
    /// boundary), so that it fits a handshake frame.
    fn encode(&self) -> Vec<u8> {
        let mut end = self.why.len().min(MAX_WHY);
        while !self.why.is_char_boundary(end) {
            end -= 1;
        }
        let why = &self.why.as_bytes()[..end];
        let mut out = Vec::with_capacity(28 + why.len());
        out.extend_from_slice(&self.code.to_le_bytes());
        out.extend_from_slice(&self.peer.to_le_bytes());
        out.extend_from_slice(&self.a.to_le_bytes());
        out.extend_from_slice(&self.b.to_le_bytes());
        out.extend_from_slice(why);
        out
    }

    fn decode(p: &[u8]) -> Option<Verdict> {
        if p.len() < 28 {
            return None;
        }
        let w = |at: usize| {
            let mut x = [0u8; 8];
            x.copy_from_slice(&p[at..at + 8]);
            u64::from_le_bytes(x)
        };
        Some(Verdict {
            code: u32::from_le_bytes([p[0], p[1], p[2], p[3]]),
            peer: w(4),
            a: w(12),
            b: w(20),
            why: String::from_utf8_lossy(&p[28..]).into_owned(),
        })
    }

    /// The error rank `rank` (world size `world`) reports on receiving this verdict from `from`.
    fn into_error(
        self,
        op: &'static str,
        rank: usize,
        world: usize,
        from: usize,
        waited: Duration,
    ) -> TransportError {
        let peer = (self.peer != NO_PEER).then_some(self.peer as usize);
        let culprit = peer.unwrap_or(from);
        match self.code {
            code::TIMEOUT => TransportError::Timeout {
                op,
                rank,
                peer,
                waited,
            },
            code::GONE => TransportError::PeerGone {
                op,
                rank,
                peer: culprit,
            },
            // about me: my world size differs from rank 0's (`b`); about another: its size is `a`
            code::WORLD if culprit == rank => TransportError::WorldSizeMismatch {
                rank,
                peer: from,
                expected: world,
                got: self.b as usize,
            },
            code::WORLD => TransportError::WorldSizeMismatch {
                rank,
                peer: culprit,
                expected: world,
                got: self.a as usize,
            },
            code::DUPLICATE => TransportError::DuplicateRank {
                rank,
                peer: culprit,
            },
            _ => TransportError::PeerFailed {
                op,
                rank,
                peer: culprit,
                why: self.why,
            },
        }
    }
}

enum Links {
    /// Rank 0: `peers[i]` is the connection of rank `i + 1`.
    Root(Vec<TcpStream>),
    /// Every other rank: the connection to rank 0.
    Leaf(TcpStream),
}

/// A formed group of `world_size` ranks connected in a star around rank 0; see the
/// [module docs](self). Operations are collective: every rank calls them in the same order.
pub struct Bootstrap {
    rank: usize,
    world: usize,
    timeout: Duration,
    /// The job of the group.
    job: JobId,
    /// Number of the next operation (the handshake is 0).
    seq: u64,
    links: Links,
    /// Set by the first failure; the bootstrap is closed from then on.
    broken: Option<String>,
    /// Rank 0: the stray connections dropped while the group formed.
    rejected: Vec<TransportError>,
}

/// Rank 0's listening socket, bound but not yet accepting: lets a caller bind port 0 and learn the
/// port before the other ranks start. [`accept`](BootstrapListener::accept) forms the group.
pub struct BootstrapListener {
    listener: TcpListener,
    addr: SocketAddr,
    world: usize,
    timeout: Duration,
    job: JobId,
}

impl std::fmt::Debug for BootstrapListener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BootstrapListener")
            .field("addr", &self.addr)
            .field("world_size", &self.world)
            .field("timeout", &self.timeout)
            .field("job", &self.job)
            .finish()
    }
}

impl std::fmt::Debug for Bootstrap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Bootstrap")
            .field("rank", &self.rank)
            .field("world_size", &self.world)
            .field("timeout", &self.timeout)
            .field("job", &self.job)
            .field("ops", &self.seq)
            .field("closed", &self.broken)
            .field("rejected", &self.rejected.len())
            .finish()
    }
}

fn check_world(op: &'static str, rank: usize, world: usize) -> Result<(), TransportError> {
    if world == 0 || rank >= world {
        return Err(TransportError::InvalidArgument {
            op,
            rank,
            why: format!("rank {rank} is outside a world of {world}"),
        });
    }
    Ok(())
}

/// Rank 0: a connection waiting for its hello (non-blocking; at most a header and
/// [`MAX_HANDSHAKE`](handshake::MAX_HANDSHAKE) bytes are ever read into `buf`).
struct Pending {
    s: TcpStream,
    from: SocketAddr,
    since: Instant,
    buf: Vec<u8>,
}

/// What a pending connection turned out to be.
enum Outcome {
    /// Nothing new.
    Waiting,
    /// Bytes arrived, the hello is not complete yet.
    Progress,
    /// A complete, well-formed hello of this version.
    Hello(Hello),
    /// A stray: drop it.
    Stray(HandshakeFault),
    /// The socket failed.
    Failed(io::Error),
}

impl Pending {
    /// Reads what has arrived (without blocking) and judges the connection.
    fn pump(&mut self) -> Outcome {
        let mut progressed = false;
        loop {
            let want = match scan(&self.buf, "a hello", &[kind::HELLO]) {
                Scan::More(n) => n,
                Scan::Frame { payload, .. } => {
                    return match Hello::decode(payload) {
                        Ok(h) => Outcome::Hello(h),
                        Err(f) => Outcome::Stray(f),
                    };
                }
                Scan::Bad(f) => return Outcome::Stray(f),
            };
            let mut chunk = [0u8; 512];
            let n = want.min(chunk.len());
            match self.s.read(&mut chunk[..n]) {
                Ok(0) => {
                    return Outcome::Stray(HandshakeFault::Truncated {
                        expected: (self.buf.len() + want) as u64,
                        got: self.buf.len() as u64,
                    });
                }
                Ok(got) => {
                    self.buf.extend_from_slice(&chunk[..got]);
                    progressed = true;
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    return if progressed {
                        Outcome::Progress
                    } else {
                        Outcome::Waiting
                    };
                }
                Err(e) => {
                    return match e.kind() {
                        io::ErrorKind::ConnectionReset | io::ErrorKind::ConnectionAborted => {
                            Outcome::Stray(HandshakeFault::Truncated {
                                expected: (self.buf.len() + want) as u64,
                                got: self.buf.len() as u64,
                            })
                        }
                        _ => Outcome::Failed(e),
                    };
                }
            }
        }
    }
}

/// Tells a refused connection why (best effort, without blocking: the verdict is small enough
/// for any socket buffer) and closes it.
fn turn_away(mut s: TcpStream, e: &TransportError) {
    let v = Verdict::of(e, 0).encode();
    let mut frame = Vec::with_capacity(HEADER + v.len());
    frame.extend_from_slice(&MAGIC.to_le_bytes());
    frame.extend_from_slice(&kind::ABORT.to_le_bytes());
    frame.extend_from_slice(&0u64.to_le_bytes());
    frame.extend_from_slice(&(v.len() as u64).to_le_bytes());
    frame.extend_from_slice(&v);
    let _ = s.set_nonblocking(true);
    let _ = s.write(&frame);
    let _ = s.shutdown(std::net::Shutdown::Both);
}

impl BootstrapListener {
    /// The address the listener is bound to (with the actual port when bound to port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// The job whose ranks this listener accepts.
    pub fn job(&self) -> &JobId {
        &self.job
    }

    /// Accepts the ranks of `job` instead (the default is [`job_from_env`]'s).
    pub fn with_job(mut self, job: JobId) -> BootstrapListener {
        self.job = job;
        self
    }

    /// Waits (at most the timeout) until every other rank has connected and passed the
    /// handshake, then tells them the group is formed. Returns rank 0's [`Bootstrap`]. Stray
    /// connections (see the [module docs](self)) are dropped on the way and listed by
    /// [`Bootstrap::rejected`].
    pub fn accept(self) -> Result<Bootstrap, TransportError> {
        const OP: &str = "bootstrap.accept";
        let world = self.world;
        let dl = Deadline::after(self.timeout);
        let hello_wait = (self.timeout / 2).min(HELLO_WAIT);
        let mut peers: Vec<Option<TcpStream>> = (0..world).map(|_| None).collect();
        let mut pending: Vec<Pending> = Vec::new();
        let mut rejected: Vec<TransportError> = Vec::new();
        let fail = |peers: &mut [Option<TcpStream>], e: TransportError| {
            let v = Verdict::of(&e, 0).encode();
            let adl = Deadline::after(self.timeout.min(Duration::from_secs(1)));
            for s in peers.iter_mut().flatten() {
                let _ = write_frame(s, kind::ABORT, 0, &v, adl);
            }
            debug!(rank = 0, error = %e, "bootstrap: group not formed");
            e
        };
        let io = |e| TransportError::Io {
            op: OP,
            rank: 0,
            peer: None,
            source: e,
        };
        let mut reject = |s: TcpStream, from: SocketAddr, fault: HandshakeFault| {
            let e = TransportError::Handshake {
                rank: 0,
                addr: from,
                fault,
            };
            warn!(error = %e, "bootstrap: dropped a stray connection");
            turn_away(s, &e);
            rejected.push(e);
        };
        self.listener.set_nonblocking(true).map_err(io)?;
        let mut missing = world - 1;
        while missing > 0 {
            let mut busy = false;
            // new connections
            loop {
                match self.listener.accept() {
                    Ok((s, from)) => {
                        busy = true;
                        if pending.len() >= MAX_PENDING {
                            // the oldest gives way: a flood of silent connections cannot keep
                            // the right ranks out
                            let old = pending.remove(0);
                            reject(
                                old.s,
                                old.from,
                                HandshakeFault::Crowded { limit: MAX_PENDING },
                            );
                        }
                        if let Err(e) = s.set_nonblocking(true) {
                            warn!(%from, error = %e, "bootstrap: dropped a connection");
                            continue;
                        }
                        let _ = s.set_nodelay(true);
                        pending.push(Pending {
                            s,
                            from,
                            since: Instant::now(),
                            buf: Vec::new(),
                        });
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(e) => return Err(fail(&mut peers, io(e))),
                }
            }
            // the hellos that arrived
            let mut i = 0;
            while i < pending.len() {
                let out = match pending[i].pump() {
                    // a peer that trickles its bytes is as late as a silent one
                    Outcome::Waiting | Outcome::Progress
                        if pending[i].since.elapsed() >= hello_wait =>
                    {
                        Outcome::Stray(HandshakeFault::Silent {
                            waited: pending[i].since.elapsed(),
                            got: pending[i].buf.len() as u64,
                        })
                    }
                    o => o,
                };
                match out {
                    Outcome::Waiting => i += 1,
                    Outcome::Progress => {
                        busy = true;
                        i += 1;
                    }
                    Outcome::Failed(e) => {
                        busy = true;
                        let p = pending.swap_remove(i);
                        warn!(from = %p.from, error = %e, "bootstrap: dropped a connection");
                    }
                    Outcome::Stray(fault) => {
                        busy = true;
                        let p = pending.swap_remove(i);
                        reject(p.s, p.from, fault);
                    }
                    Outcome::Hello(h) => {
                        busy = true;
                        let p = pending.swap_remove(i);
                        if h.job != self.job.as_str() {
                            let fault = HandshakeFault::Job {
                                expected: self.job.to_string(),
                                got: h.job,
                            };
                            reject(p.s, p.from, fault);
                            continue;
                        }
                        let r = usize::try_from(h.rank).unwrap_or(usize::MAX);
                        let w = usize::try_from(h.world).unwrap_or(usize::MAX);
                        let err = if w != world {
                            Some(TransportError::WorldSizeMismatch {
                                rank: 0,
                                peer: r,
                                expected: world,
                                got: w,
                            })
                        } else if r == 0 || r >= world {
                            Some(TransportError::Protocol {
                                op: OP,
                                rank: 0,
                                peer: None,
                                why: format!(
                                    "a process at {} claims rank {} in a world of {world}",
                                    p.from, h.rank
                                ),
                            })
                        } else if peers[r].is_some() {
                            Some(TransportError::DuplicateRank { rank: 0, peer: r })
                        } else {
                            None
                        };
                        if let Some(e) = err {
                            turn_away(p.s, &e);
                            return Err(fail(&mut peers, e));
                        }
                        p.s.set_nonblocking(false).map_err(io)?;
                        debug!(rank = 0, peer = r, from = %p.from, "bootstrap: rank joined");
                        peers[r] = Some(p.s);
                        missing -= 1;
                    }
                }
            }
            if missing == 0 {
                break;
            }
            if dl.passed() {
                let late = (1..world).find(|&r| peers[r].is_none());
                let e = TransportError::Timeout {
                    op: OP,
                    rank: 0,
                    peer: late,
                    waited: dl.waited(),
                };
                if !rejected.is_empty() {
                    warn!(
                        strays = rejected.len(),
                        "bootstrap: timed out; stray connections were dropped meanwhile"
                    );
                }
                return Err(fail(&mut peers, e));
            }
            if !busy {
                std::thread::sleep(Duration::from_millis(2));
            }
        }
        for p in pending {
            // late connections after every rank joined belong to no one
            debug!(from = %p.from, "bootstrap: group formed; dropping a pending connection");
        }
        let welcome = Welcome::encode(world, &self.job);
        let wdl = Deadline::after(self.timeout);
        for r in 1..world {
            let res = match peers[r].as_mut() {
                Some(s) => write_frame(s, kind::WELCOME, 0, &welcome, wdl),
                None => Ok(()),
            };
            if let Err(e) = res {
                let e = io_error(OP, 0, r, e, &wdl);
                return Err(fail(&mut peers, e));
            }
        }
        debug!(rank = 0, world, job = %self.job, "bootstrap: group formed");
        Ok(Bootstrap {
            rank: 0,
            world,
            timeout: self.timeout,
            job: self.job,
            seq: 1,
            links: Links::Root(peers.into_iter().flatten().collect()),
            broken: None,
            rejected,
        })
    }
}

/// Non-root rank: reads rank 0's answer to the hello (a welcome or an abort), reading at most
/// what [`scan`] asks for, every read bounded by `dl`.
fn read_answer(
    s: &mut TcpStream,
    rank: usize,
    addr: SocketAddr,
    dl: Deadline,
) -> Result<(u32, Vec<u8>), TransportError> {
    const OP: &str = "bootstrap.connect";
    let mut buf = Vec::new();
    loop {
        let want = match scan(&buf, "a welcome or an abort", &[kind::WELCOME, kind::ABORT]) {
            Scan::More(n) => n,
            Scan::Frame { kind, payload, .. } => return Ok((kind, payload.to_vec())),
            Scan::Bad(fault) => return Err(TransportError::Handshake { rank, addr, fault }),
        };
        let mut chunk = [0u8; 512];
        let n = want.min(chunk.len());
        let res = dl
            .left()
            .and_then(|left| s.set_read_timeout(left))
            .and_then(|_| s.read(&mut chunk[..n]));
        match res {
            Ok(0) if buf.is_empty() => {
                return Err(TransportError::PeerGone {
                    op: OP,
                    rank,
                    peer: 0,
                });
            }
            Ok(0) => {
                return Err(TransportError::Handshake {
                    rank,
                    addr,
                    fault: HandshakeFault::Truncated {
                        expected: (buf.len() + want) as u64,
                        got: buf.len() as u64,
                    },
                });
            }
            Ok(got) => buf.extend_from_slice(&chunk[..got]),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(io_error(OP, rank, 0, e, &dl)),
        }
    }
}

impl Bootstrap {
    /// Binds rank 0's listener at `addr` (port 0 picks a free port; see
    /// [`BootstrapListener::local_addr`]) for a group of `world_size` ranks whose waits are
    /// bounded by `timeout`, of the job [`job_from_env`] names (see
    /// [`with_job`](BootstrapListener::with_job)).
    pub fn listen(
        addr: SocketAddr,
        world_size: usize,
        timeout: Duration,
    ) -> Result<BootstrapListener, TransportError> {
        const OP: &str = "bootstrap.listen";
        check_world(OP, 0, world_size)?;
        let job = job_from_env()?;
        let io = |e| TransportError::Io {
            op: OP,
            rank: 0,
            peer: None,
            source: e,
        };
        let listener = TcpListener::bind(addr).map_err(io)?;
        let addr = listener.local_addr().map_err(io)?;
        if !addr.ip().is_loopback() {
            debug!(rank = 0, %addr, "bootstrap: listening on an address other hosts may reach");
        }
        debug!(rank = 0, %addr, world_size, %job, "bootstrap: listening");
        Ok(BootstrapListener {
            listener,
            addr,
            world: world_size,
            timeout,
            job,
        })
    }

    /// Joins the group whose rank 0 is at `addr`, of the job [`job_from_env`] names:
    /// [`connect_as`](Bootstrap::connect_as) with that job.
    pub fn connect(
        addr: SocketAddr,
        rank: usize,
        world_size: usize,
        timeout: Duration,
    ) -> Result<Bootstrap, TransportError> {
        Bootstrap::connect_as(addr, rank, world_size, timeout, job_from_env()?)
    }

    /// Joins the group of `job` whose rank 0 is at `addr`: rank 0 listens there and accepts
    /// the others ([`listen`](Bootstrap::listen) + [`accept`](BootstrapListener::accept));
    /// every other rank connects, retrying until `timeout` (rank 0 may start later), and waits
    /// for the group to form.
    pub fn connect_as(
        addr: SocketAddr,
        rank: usize,
        world_size: usize,
        timeout: Duration,
        job: JobId,
    ) -> Result<Bootstrap, TransportError> {
        const OP: &str = "bootstrap.connect";
        check_world(OP, rank, world_size)?;
        if rank == 0 {
            return Bootstrap::listen(addr, world_size, timeout)?
                .with_job(job)
                .accept();
        }
        let dl = Deadline::after(timeout);
        let timed_out = |dl: &Deadline| TransportError::Timeout {
            op: OP,
            rank,
            peer: Some(0),
            waited: dl.waited(),
        };
        let mut pause = Duration::from_millis(5);
        let mut s = loop {
            let left = dl.left().map_err(|_| timed_out(&dl))?;
            let res = match left {
                Some(l) => TcpStream::connect_timeout(&addr, l),
                None => TcpStream::connect(addr),
            };
            match res {
                Ok(s) => break s,
                Err(e) => {
                    debug!(rank, %addr, error = %e, "bootstrap: rank 0 not reachable yet");
                    let left = dl.left().map_err(|_| timed_out(&dl))?;
                    std::thread::sleep(left.map_or(pause, |l| l.min(pause)));
                    pause = (pause * 2).min(Duration::from_millis(100));
                }
            }
        };
        let _ = s.set_nodelay(true);
        let hello = Hello::encode(rank, world_size, &job);
        write_frame(&mut s, kind::HELLO, 0, &hello, dl)
            .map_err(|e| io_error(OP, rank, 0, e, &dl))?;
        let wdl = Deadline::after(leaf_wait(timeout));
        let (k, payload) = read_answer(&mut s, rank, addr, wdl)?;
        let handshake = |fault| TransportError::Handshake { rank, addr, fault };
        if k == kind::ABORT {
            let v = Verdict::decode(&payload).ok_or_else(|| {
                handshake(HandshakeFault::Malformed {
                    what: "abort",
                    why: format!("{} bytes, at least 28 expected", payload.len()),
                })
            })?;
            if v.code == code::HANDSHAKE {
                return Err(handshake(v.handshake_fault(&job)));
            }
            return Err(v.into_error(OP, rank, world_size, 0, wdl.waited()));
        }
        let w = Welcome::decode(&payload).map_err(handshake)?;
        if w.job != job.as_str() {
            return Err(handshake(HandshakeFault::Job {
                expected: job.to_string(),
                got: w.job,
            }));
        }
        if w.world != world_size as u64 {
            return Err(TransportError::WorldSizeMismatch {
                rank,
                peer: 0,
                expected: world_size,
                got: usize::try_from(w.world).unwrap_or(usize::MAX),
            });
        }
        debug!(rank, world_size, %job, "bootstrap: joined");
        Ok(Bootstrap {
            rank,
            world: world_size,
            timeout,
            job,
            seq: 1,
            links: Links::Leaf(s),
            broken: None,
            rejected: Vec::new(),
        })
    }

    /// [`connect_as`](Bootstrap::connect_as) with the rank, world size, address and job read
    /// from [`ENV_RANK`], [`ENV_WORLD_SIZE`], [`ENV_RENDEZVOUS`] and [`ENV_JOB_ID`] (set by a
    /// launcher).
    pub fn from_env(timeout: Duration) -> Result<Bootstrap, TransportError> {
        Bootstrap::from_rendezvous(&RendezvousEnv::from_env()?, timeout)
    }

    /// [`connect_as`](Bootstrap::connect_as) with the rank, world size, address and job of
    /// `env`.
    pub fn from_rendezvous(
        env: &RendezvousEnv,
        timeout: Duration,
    ) -> Result<Bootstrap, TransportError> {
        Bootstrap::connect_as(env.addr, env.rank, env.world_size, timeout, env.job.clone())
    }

    /// The job of the group.
    pub fn job(&self) -> &JobId {
        &self.job
    }

    /// Rank 0: the [`Handshake`](TransportError::Handshake) errors of the stray connections
    /// dropped while the group formed (empty on the other ranks).
    pub fn rejected(&self) -> &[TransportError] {
        &self.rejected
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The number of ranks.
    pub fn world_size(&self) -> usize {
        self.world
    }

    /// The bound of every wait.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Sets the bound of every later wait (this rank only; non-root ranks wait rank 0's answer
    /// the timeout plus a grace, so keep rank 0's no longer than the others').
    pub fn set_timeout(&mut self, timeout: Duration) {
        self.timeout = timeout;
    }

    /// Whether an earlier failure closed this bootstrap.
    pub fn is_closed(&self) -> bool {
        self.broken.is_some()
    }

    /// Every rank contributes one blob (lengths may differ); every rank gets all blobs, indexed
    /// by rank.
    pub fn all_gather(&mut self, mine: &[u8]) -> Result<Vec<Vec<u8>>, TransportError> {
        const OP: &str = "bootstrap.all_gather";
        self.run(OP, |b, seq| {
            if b.rank != 0 {
                let p = b.leaf_round_trip(OP, seq, kind::GATHER, mine, kind::GATHER_ALL)?;
                return decode_list(&p, b.world).map_err(|why| b.protocol(OP, 0, why));
            }
            let mut all = Vec::with_capacity(b.world);
            all.push(mine.to_vec());
            all.extend(b.root_collect(OP, seq, kind::GATHER)?);
            b.root_send_all(OP, seq, kind::GATHER_ALL, &encode_list(&all))?;
            Ok(all)
        })
    }

    /// Rank 0's `blob` reaches every rank (the argument of the other ranks is ignored; pass
    /// `&[]`). Returns rank 0's blob on every rank.
    pub fn broadcast(&mut self, blob: &[u8]) -> Result<Vec<u8>, TransportError> {
        const OP: &str = "bootstrap.broadcast";
        self.run(OP, |b, seq| {
            if b.rank != 0 {
                let dl = Deadline::after(leaf_wait(b.timeout));
                return b.leaf_receive(OP, seq, kind::BCAST, dl);
            }
            b.root_send_all(OP, seq, kind::BCAST, blob)?;
            Ok(blob.to_vec())
        })
    }

    /// Returns once every rank has entered the barrier.
    pub fn barrier(&mut self) -> Result<(), TransportError> {
        const OP: &str = "bootstrap.barrier";
        self.run(OP, |b, seq| {
            if b.rank != 0 {
                b.leaf_round_trip(OP, seq, kind::BARRIER, &[], kind::RELEASE)?;
                return Ok(());
            }
            b.root_collect(OP, seq, kind::BARRIER)?;
            b.root_send_all(OP, seq, kind::RELEASE, &[])
        })
    }

    /// Personalised exchange relayed through rank 0: `per_dst[p]` goes to rank p (`world_size`
    /// entries; this rank's own entry stays local); returns what each rank sent this one,
    /// indexed by source.
    pub fn all_to_all<B: AsRef<[u8]>>(
        &mut self,
        per_dst: &[B],
    ) -> Result<Vec<Vec<u8>>, TransportError> {
        const OP: &str = "bootstrap.all_to_all";
        self.run(OP, |b, seq| {
            let (me, world) = (b.rank, b.world);
            if per_dst.len() != world {
                return Err(TransportError::InvalidArgument {
                    op: OP,
                    rank: me,
                    why: format!("{} blobs for {world} ranks", per_dst.len()),
                });
            }
            if me != 0 {
                let out: Vec<&[u8]> = (0..world)
                    .map(|p| {
                        if p == me {
                            &[][..]
                        } else {
                            per_dst[p].as_ref()
                        }
                    })
                    .collect();
                let p = b.leaf_round_trip(OP, seq, kind::A2A, &encode_list(&out), kind::A2A_OUT)?;
                let mut got = decode_list(&p, world).map_err(|why| b.protocol(OP, 0, why))?;
                got[me] = per_dst[me].as_ref().to_vec();
                return Ok(got);
            }
            // rank 0: lists[s][d] is what rank s sends rank d
            let mut lists: Vec<Vec<Vec<u8>>> = Vec::with_capacity(world);
            lists.push(Vec::new());
            for (i, p) in b.root_collect(OP, seq, kind::A2A)?.into_iter().enumerate() {
                lists.push(decode_list(&p, world).map_err(|why| b.protocol(OP, i + 1, why))?);
            }
            let dl = Deadline::after(b.timeout);
            for d in 1..world {
                let out: Vec<&[u8]> = (0..world)
                    .map(|s| match s {
                        0 => per_dst[d].as_ref(),
                        s if s == d => &[][..],
                        s => &lists[s][d][..],
                    })
                    .collect();
                let enc = encode_list(&out);
                b.root_send(OP, seq, d, kind::A2A_OUT, &enc, dl)?;
            }
            Ok((0..world)
                .map(|s| {
                    if s == 0 {
                        per_dst[0].as_ref().to_vec()
                    } else {
                        std::mem::take(&mut lists[s][0])
                    }
                })
                .collect())
        })
    }

    /// Runs one operation: refuses if closed, numbers it, and on failure tells the peers and
    /// closes the bootstrap.
    fn run<T>(
        &mut self,
        op: &'static str,
        f: impl FnOnce(&mut Self, u64) -> Result<T, TransportError>,
    ) -> Result<T, TransportError> {
        if let Some(why) = &self.broken {
            return Err(TransportError::Closed {
                op,
                rank: self.rank,
                why: why.clone(),
            });
        }
        let seq = self.seq;
        self.seq += 1;
        debug!(rank = self.rank, seq, op, "bootstrap op");
        let res = f(self, seq);
        if let Err(e) = &res {
            debug!(rank = self.rank, seq, op, error = %e, "bootstrap op failed; closing");
            self.broken = Some(e.to_string());
            let v = Verdict::of(e, self.rank).encode();
            let dl = Deadline::after(self.timeout.min(Duration::from_secs(1)));
            match &mut self.links {
                Links::Root(peers) => {
                    for s in peers {
                        let _ = write_frame(s, kind::ABORT, seq, &v, dl);
                    }
                }
                Links::Leaf(s) => {
                    let _ = write_frame(s, kind::ABORT, seq, &v, dl);
                }
            }
        }
        res
    }

    fn protocol(&self, op: &'static str, peer: usize, why: String) -> TransportError {
        TransportError::Protocol {
            op,
            rank: self.rank,
            peer: Some(peer),
            why,
        }
    }

    fn leaf_stream(&mut self) -> &mut TcpStream {
        match &mut self.links {
            Links::Leaf(s) => s,
            Links::Root(_) => unreachable!("leaf operation on rank 0"),
        }
    }

    /// Non-root rank: sends `payload` to rank 0 and returns its answer of kind `answer`.
    fn leaf_round_trip(
        &mut self,
        op: &'static str,
        seq: u64,
        send: u32,
        payload: &[u8],
        answer: u32,
    ) -> Result<Vec<u8>, TransportError> {
        let rank = self.rank;
        let dl = Deadline::after(leaf_wait(self.timeout));
        write_frame(self.leaf_stream(), send, seq, payload, dl)
            .map_err(|e| io_error(op, rank, 0, e, &dl))?;
        self.leaf_receive(op, seq, answer, dl)
    }

    fn leaf_receive(
        &mut self,
        op: &'static str,
        seq: u64,
        want: u32,
        dl: Deadline,
    ) -> Result<Vec<u8>, TransportError> {
        let rank = self.rank;
        let f = read_frame(self.leaf_stream(), dl).map_err(|e| io_error(op, rank, 0, e, &dl))?;
        expect_frame(rank, self.world, op, 0, seq, want, f, &dl)
    }

    /// Rank 0: one frame of kind `want` from every other rank, in rank order (index r - 1).
    fn root_collect(
        &mut self,
        op: &'static str,
        seq: u64,
        want: u32,
    ) -> Result<Vec<Vec<u8>>, TransportError> {
        let dl = Deadline::after(self.timeout);
        let world = self.world;
        let Links::Root(peers) = &mut self.links else {
            unreachable!("root operation on a leaf")
        };
        let mut payloads = Vec::with_capacity(peers.len());
        for (i, s) in peers.iter_mut().enumerate() {
            let f = read_frame(s, dl).map_err(|e| io_error(op, 0, i + 1, e, &dl))?;
            payloads.push(expect_frame(0, world, op, i + 1, seq, want, f, &dl)?);
        }
        Ok(payloads)
    }

    fn root_send(
        &mut self,
        op: &'static str,
        seq: u64,
        to: usize,
        k: u32,
        payload: &[u8],
        dl: Deadline,
    ) -> Result<(), TransportError> {
        let Links::Root(peers) = &mut self.links else {
            unreachable!("root operation on a leaf")
        };
        write_frame(&mut peers[to - 1], k, seq, payload, dl)
            .map_err(|e| io_error(op, 0, to, e, &dl))
    }

    fn root_send_all(
        &mut self,
        op: &'static str,
        seq: u64,
        k: u32,
        payload: &[u8],
    ) -> Result<(), TransportError> {
        let dl = Deadline::after(self.timeout);
        for to in 1..self.world {
            self.root_send(op, seq, to, k, payload, dl)?;
        }
        Ok(())
    }
}

/// The frame-level part of [`fuzz_decoders`]: the header parser, the list decoder (for world
/// sizes 0 to 4) and the abort verdict decoder.
fn fuzz_frames(data: &[u8]) {
    if data.len() >= HEADER {
        let mut head = [0u8; HEADER];
        head.copy_from_slice(&data[..HEADER]);
        if let Ok((_, _, len)) = parse_header(&head) {
            assert!(len <= MAX_PAYLOAD);
        }
    }
    for count in 0..=4 {
        if let Ok(items) = decode_list(data, count) {
            assert_eq!(items.len(), count);
            assert_eq!(encode_list(&items), data, "list does not round-trip");
        }
    }
    if let Some(v) = Verdict::decode(data) {
        let enc = v.encode();
        assert!(enc.len() <= 28 + MAX_WHY);
        let again = Verdict::decode(&enc).expect("an encoded verdict decodes");
        assert_eq!(
            (again.code, again.peer, again.a, again.b),
            (v.code, v.peer, v.a, v.b)
        );
        let job = JobId::unnamed();
        let _ = v.clone().handshake_fault(&job);
        for world in [1, 4] {
            let _ = v.clone().into_error("fuzz", 0, world, 0, Duration::ZERO);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn list_round_trip() {
        let items: Vec<Vec<u8>> = vec![vec![], vec![1, 2, 3], vec![9; 100]];
        let enc = encode_list(&items);
        assert_eq!(decode_list(&enc, 3).unwrap(), items);
        assert!(decode_list(&enc, 2).is_err());
        assert!(decode_list(&enc[..enc.len() - 1], 3).is_err());
    }

    #[test]
    fn verdicts_name_the_same_culprit() {
        let e = TransportError::Timeout {
            op: "x",
            rank: 0,
            peer: Some(3),
            waited: Duration::ZERO,
        };
        let v = Verdict::decode(&Verdict::of(&e, 0).encode()).unwrap();
        let got = v.into_error("y", 1, 4, 0, Duration::ZERO);
        assert!(
            matches!(
                got,
                TransportError::Timeout {
                    rank: 1,
                    peer: Some(3),
                    ..
                }
            ),
            "{got}"
        );

        let e = TransportError::WorldSizeMismatch {
            rank: 0,
            peer: 2,
            expected: 4,
            got: 5,
        };
        let v = Verdict::of(&e, 0);
        let to_2 = v.clone().into_error("y", 2, 5, 0, Duration::ZERO);
        assert!(
            matches!(
                to_2,
                TransportError::WorldSizeMismatch {
                    rank: 2,
                    peer: 0,
                    expected: 5,
                    got: 4
                }
            ),
            "{to_2}"
        );
        let to_1 = v.into_error("y", 1, 4, 0, Duration::ZERO);
        assert!(
            matches!(
                to_1,
                TransportError::WorldSizeMismatch {
                    rank: 1,
                    peer: 2,
                    expected: 4,
                    got: 5
                }
            ),
            "{to_1}"
        );
    }

    #[test]
    fn env_parsing() {
        let env = |r: &str, w: &str, a: &str| {
            let (r, w, a) = (r.to_string(), w.to_string(), a.to_string());
            move |k: &str| match k {
                ENV_RANK => Some(r.clone()),
                ENV_WORLD_SIZE => Some(w.clone()),
                ENV_RENDEZVOUS => Some(a.clone()),
                _ => None,
            }
        };
        let ok = RendezvousEnv::from_lookup(env("2", "4", "127.0.0.1:29500")).unwrap();
        assert_eq!(
            ok,
            RendezvousEnv {
                rank: 2,
                world_size: 4,
                addr: "127.0.0.1:29500".parse().unwrap(),
                job: JobId::unnamed(),
            }
        );
        let e = RendezvousEnv::from_lookup(env("4", "4", "127.0.0.1:1")).unwrap_err();
        assert!(
            matches!(e, TransportError::Env { var: ENV_RANK, .. }),
            "{e}"
        );
        let e = RendezvousEnv::from_lookup(env("x", "4", "127.0.0.1:1")).unwrap_err();
        assert!(
            matches!(e, TransportError::Env { var: ENV_RANK, .. }),
            "{e}"
        );
        let e = RendezvousEnv::from_lookup(env("0", "1", "no-port")).unwrap_err();
        assert!(
            matches!(
                e,
                TransportError::Env {
                    var: ENV_RENDEZVOUS,
                    ..
                }
            ),
            "{e}"
        );
        let e = RendezvousEnv::from_lookup(|_| None).unwrap_err();
        assert!(e.to_string().contains("not set"), "{e}");
        let with_job = |job: &'static str| {
            let base = env("1", "2", "127.0.0.1:29500");
            move |k: &str| match k {
                ENV_JOB_ID => Some(job.to_string()),
                k => base(k),
            }
        };
        let ok = RendezvousEnv::from_lookup(with_job(" run-42 ")).unwrap();
        assert_eq!(ok.job.as_str(), "run-42");
        for bad in ["", "two words", "\u{e9}t\u{e9}"] {
            let e = RendezvousEnv::from_lookup(with_job(bad)).unwrap_err();
            assert!(
                matches!(
                    e,
                    TransportError::Env {
                        var: ENV_JOB_ID,
                        ..
                    }
                ),
                "{bad:?}: {e}"
            );
        }
    }
}
