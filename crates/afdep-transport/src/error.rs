//! The error of every transport and of the bootstrap.

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
