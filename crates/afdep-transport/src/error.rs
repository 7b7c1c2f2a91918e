//! The error of every transport and of the bootstrap.

use std::net::SocketAddr;
use std::time::Duration;

use thiserror::Error;

use crate::TransportKind;

/// Why a transport operation failed. Every variant names the rank that reports it (`rank`) and,
/// where known, the peer at fault (`peer`); `op` is the operation (`all_gather`,
/// `all_to_all_v`, `barrier`, `bootstrap.connect`, ...).
#[derive(Debug, Error)]
pub enum TransportError {
    /// A wait ran past the transport's timeout. `peer` is the (lowest-numbered) rank that had not
    /// answered, where the transport can tell.
    #[error("rank {rank}: {op}: timed out after {waited:?} waiting for {}", peer_text(*peer))]
    Timeout {
        /// The operation.
        op: &'static str,
        /// The rank reporting.
        rank: usize,
        /// The rank that is late, if known.
        peer: Option<usize>,
        /// How long this rank waited.
        waited: Duration,
    },
    /// A peer left the group (its transport was dropped, its thread or process ended, its
    /// socket closed).
    #[error("rank {rank}: {op}: rank {peer} is gone")]
    PeerGone {
        /// The operation.
        op: &'static str,
        /// The rank reporting.
        rank: usize,
        /// The rank that left.
        peer: usize,
    },
    /// A peer gave up on this operation (its arguments were invalid, or it timed out) and told
    /// this rank so instead of letting it wait.
    #[error("rank {rank}: {op}: rank {peer} failed this operation: {why}")]
    PeerFailed {
        /// The operation.
        op: &'static str,
        /// The rank reporting.
        rank: usize,
        /// The rank that failed.
        peer: usize,
        /// The peer's reason.
        why: String,
    },
    /// What `peer` sent and what this rank expected from it differ in size.
    #[error("rank {rank}: {op}: expected {expected} bytes from rank {peer}, got {got}")]
    SizeMismatch {
        /// The operation.
        op: &'static str,
        /// The rank reporting (the receiver).
        rank: usize,
        /// The sender.
        peer: usize,
        /// Bytes this rank expected.
        expected: u64,
        /// Bytes the peer sent.
        got: u64,
    },
    /// A byte range does not fit its buffer. `peer` is the rank whose span it is, for span lists.
    #[error(
        "rank {rank}: {op}: {len} bytes at offset {offset}{} exceed the {size}-byte buffer",
        peer.map(|p| format!(" (span of rank {p})")).unwrap_or_default()
    )]
    OutOfBounds {
        /// The operation.
        op: &'static str,
        /// The rank reporting.
        rank: usize,
        /// The rank the span belongs to, if any.
        peer: Option<usize>,
        /// First byte of the range.
        offset: u64,
        /// Length of the range.
        len: u64,
        /// Size of the buffer.
        size: u64,
    },
    /// The arguments of a call are invalid on this rank (wrong number of spans, overlapping
    /// receive spans, a rank outside the world).
    #[error("rank {rank}: {op}: invalid argument: {why}")]
    InvalidArgument {
        /// The operation.
        op: &'static str,
        /// The rank reporting.
        rank: usize,
        /// What is wrong.
        why: String,
    },
    /// A peer spoke out of turn: another operation than this rank's, a malformed frame, a rank
    /// number outside the world.
    #[error("rank {rank}: {op}: protocol error{}: {why}", peer.map(|p| format!(" with rank {p}")).unwrap_or_default())]
    Protocol {
        /// The operation.
        op: &'static str,
        /// The rank reporting.
        rank: usize,
        /// The peer concerned, if known.
        peer: Option<usize>,
        /// What went wrong.
        why: String,
    },
    /// An I/O error that is neither a timeout nor a closed connection.
    #[error("rank {rank}: {op}: I/O error{}: {source}", peer.map(|p| format!(" with rank {p}")).unwrap_or_default())]
    Io {
        /// The operation.
        op: &'static str,
        /// The rank reporting.
        rank: usize,
        /// The peer of the connection, if any.
        peer: Option<usize>,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// Bootstrap handshake: a rank was started with another world size than this one.
    #[error("rank {rank}: bootstrap: rank {peer} has world size {got}, this rank {expected}")]
    WorldSizeMismatch {
        /// The rank reporting.
        rank: usize,
        /// The rank that differs.
        peer: usize,
        /// This rank's world size.
        expected: usize,
        /// The peer's world size.
        got: usize,
    },
    /// Bootstrap handshake: two processes claim the same rank.
    #[error("rank {rank}: bootstrap: two processes claim rank {peer}")]
    DuplicateRank {
        /// The rank reporting.
        rank: usize,
        /// The rank claimed twice.
        peer: usize,
    },
    /// Bootstrap handshake: the connection with `addr` did not come from (or, for a non-root
    /// rank, lead to) a rank of this group (another job, another protocol version, not a
    /// bootstrap at all, a malformed, oversized, truncated or missing hello) and was dropped.
    /// Rank 0 keeps accepting the right peers after such a drop; see
    /// [`Bootstrap::rejected`](crate::Bootstrap::rejected).
    #[error("rank {rank}: bootstrap: dropped the connection with {addr}: {fault}")]
    Handshake {
        /// The rank reporting.
        rank: usize,
        /// The other end of the connection.
        addr: SocketAddr,
        /// What was expected and what was received.
        fault: HandshakeFault,
    },
    /// A rendezvous environment variable is missing or malformed.
    #[error("rendezvous environment: {var}: {why}")]
    Env {
        /// The variable.
        var: &'static str,
        /// What is wrong with it.
        why: String,
    },
    /// The bootstrap (or a transport over it) failed earlier and cannot be used any more.
    #[error("rank {rank}: {op}: closed after an earlier error: {why}")]
    Closed {
        /// The operation attempted.
        op: &'static str,
        /// The rank reporting.
        rank: usize,
        /// The earlier error.
        why: String,
    },
    /// The underlying library (CUDA, NCCL, UCX) reported an error.
    #[error("rank {rank}: {kind} {op}: {why}")]
    Backend {
        /// The transport.
        kind: TransportKind,
        /// The operation.
        op: &'static str,
        /// The rank reporting.
        rank: usize,
        /// The library's message.
        why: String,
    },
    /// This transport cannot be used here (no driver, no library, not built in).
    #[error("transport {kind} is unavailable: {why}")]
    Unavailable {
        /// The transport.
        kind: TransportKind,
        /// Why.
        why: String,
    },
}

/// What was wrong with a bootstrap handshake (see [`TransportError::Handshake`]): each variant
/// says what was expected and what was received.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum HandshakeFault {
    /// The first bytes are not the bootstrap's magic (`AFDP`): not a bootstrap peer.
    #[error("bad magic: expected {expected:#010x}, got {got:#010x}")]
    Magic {
        /// The bootstrap's magic.
        expected: u32,
        /// The first four bytes received (little-endian).
        got: u32,
    },
    /// The peer speaks another version of the bootstrap protocol.
    #[error("protocol version: expected {expected}, got {got}")]
    Version {
        /// This rank's version.
        expected: u32,
        /// The peer's version.
        got: u32,
    },
    /// The peer belongs to another job (`AFDEP_JOB_ID`).
    #[error("another job: expected job {expected:?}, got job {got:?}")]
    Job {
        /// This rank's job.
        expected: String,
        /// The peer's job.
        got: String,
    },
    /// A handshake message of another kind than expected (a collective before the hello, a
    /// hello sent to a non-root rank).
    #[error("unexpected message: expected {expected}, got {got}")]
    Kind {
        /// The kinds expected.
        expected: &'static str,
        /// The kind and operation number received.
        got: String,
    },
    /// The header announces a message longer than any handshake message.
    #[error("oversized message: expected at most {limit} bytes, got a length of {got}")]
    Oversized {
        /// The largest handshake payload.
        limit: u64,
        /// The announced length.
        got: u64,
    },
    /// The connection closed in the middle of the message.
    #[error("truncated message: expected {expected} bytes, got {got} before the connection closed")]
    Truncated {
        /// Bytes the message needed (as far as its header tells).
        expected: u64,
        /// Bytes received.
        got: u64,
    },
    /// No complete hello arrived in time (nothing, or too little too slowly).
    #[error("silent peer: expected a hello within {waited:?}, got {got} bytes")]
    Silent {
        /// How long it was given.
        waited: Duration,
        /// Bytes received by then.
        got: u64,
    },
    /// A message of the right kind and length whose content does not parse.
    #[error("malformed {what}: {why}")]
    Malformed {
        /// The message (`hello`, `welcome`, `abort`).
        what: &'static str,
        /// What is wrong.
        why: String,
    },
    /// Rank 0 refused this rank's hello for another reason than job or version (its verdict).
    #[error("refused by rank 0: {why}")]
    Refused {
        /// Rank 0's reason.
        why: String,
    },
    /// This was the oldest of the connections waiting for their hello when one more arrived
    /// than rank 0 keeps at once.
    #[error("crowded out: at most {limit} connections wait for their hello at once")]
    Crowded {
        /// The most pending connections kept.
        limit: usize,
    },
}

fn peer_text(peer: Option<usize>) -> String {
    match peer {
        Some(p) => format!("rank {p}"),
        None => "a peer".to_string(),
    }
}

impl TransportError {
    /// The rank that reports the error, where it has one.
    pub fn rank(&self) -> Option<usize> {
        use TransportError::*;
        match self {
            Timeout { rank, .. }
            | PeerGone { rank, .. }
            | PeerFailed { rank, .. }
            | SizeMismatch { rank, .. }
            | OutOfBounds { rank, .. }
            | InvalidArgument { rank, .. }
            | Protocol { rank, .. }
            | Io { rank, .. }
            | WorldSizeMismatch { rank, .. }
            | DuplicateRank { rank, .. }
            | Handshake { rank, .. }
            | Closed { rank, .. }
            | Backend { rank, .. } => Some(*rank),
            Env { .. } | Unavailable { .. } => None,
        }
    }

    /// The peer at fault, where known.
    pub fn peer(&self) -> Option<usize> {
        use TransportError::*;
        match self {
            PeerGone { peer, .. }
            | PeerFailed { peer, .. }
            | SizeMismatch { peer, .. }
            | WorldSizeMismatch { peer, .. }
            | DuplicateRank { peer, .. } => Some(*peer),
            Timeout { peer, .. }
            | OutOfBounds { peer, .. }
            | Protocol { peer, .. }
            | Io { peer, .. } => *peer,
            InvalidArgument { .. }
            | Handshake { .. }
            | Env { .. }
            | Closed { .. }
            | Backend { .. }
            | Unavailable { .. } => None,
        }
    }

    /// Whether this is a [`Timeout`](TransportError::Timeout).
    pub fn is_timeout(&self) -> bool {
        matches!(self, TransportError::Timeout { .. })
    }
}
