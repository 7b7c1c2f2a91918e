//! Errors of the exchange engines.

use afdep_core::{ConfigError, RouteError};
use afdep_kernels::KernelError;
use afdep_transport::TransportError;
use thiserror::Error;

use crate::round::RoundArm;

/// Why an exchange round or its set-up failed. A [`ExchangeError::Route`] is reported by every
/// rank of the round (the error of the lowest-numbered rejecting attention rank) and leaves the
/// engine usable for the next round.
#[derive(Debug, Error)]
pub enum ExchangeError {
    /// A route was rejected on some attention rank; nothing was sent.
    #[error("rank {reporter}: round rejected: {error}")]
    Route {
        /// The rank returning the error.
        reporter: usize,
        /// The rejection, naming the rank, token, slot and value at fault.
        error: RouteError,
    },
    /// The configuration is invalid, or ranks disagree on it.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The transport failed (timeout, peer gone, size mismatch...).
    #[error(transparent)]
    Transport(#[from] TransportError),
    /// A kernel or the CUDA driver failed (fused engine).
    #[error(transparent)]
    Kernel(#[from] KernelError),
    /// A bounded device wait of the fused engine ran out: `phase` (`dispatch`: the copy
    /// epilogue waited for a source; `combine`: the combine waited for an FFN rank), the rank
    /// that waited, the peer whose flag never came, the round.
    #[error("rank {rank}: {phase} round {round}: timed out on the device waiting for rank {peer}")]
    DeviceTimeout {
        /// The rank whose kernel waited.
        rank: usize,
        /// The phase.
        phase: &'static str,
        /// The rank whose flag is missing.
        peer: usize,
        /// The round (1-based).
        round: u32,
    },
    /// The engine failed earlier in a way that leaves its device state undefined.
    #[error("rank {rank}: the engine is closed after an earlier error: {why}")]
    Closed {
        /// The rank.
        rank: usize,
        /// The earlier error.
        why: String,
    },
    /// Ranks asked for different dispatch arms in one device round of the fused engine (the arm
    /// given to `device_round` / `capture`, or, under [`RoundArm::Auto`], the arm of
    /// `set_arm`, must be the same on every rank): every rank skipped the round and reports
    /// this; the engine stays usable.
    #[error(
        "rank {rank}: round skipped: ranks asked for different dispatch arms: rank 0 for \
         {first}, rank {peer} for {other}"
    )]
    ArmsDiffer {
        /// The rank returning the error.
        rank: usize,
        /// Rank 0's request.
        first: RoundArm,
        /// The lowest rank whose request differs from rank 0's.
        peer: usize,
        /// That rank's request.
        other: RoundArm,
    },
    /// This rank was called with input that does not fit its role.
    #[error("rank {rank}: {what}")]
    Input {
        /// The rank.
        rank: usize,
        /// What is wrong.
        what: String,
    },
}
