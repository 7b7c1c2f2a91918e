//! Errors of the exchange engines.

use afdep_core::{ConfigError, RouteError};
use afdep_transport::TransportError;
use thiserror::Error;

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
    /// This rank was called with input that does not fit its role.
    #[error("rank {rank}: {what}")]
    Input {
        /// The rank.
        rank: usize,
        /// What is wrong.
        what: String,
    },
}
