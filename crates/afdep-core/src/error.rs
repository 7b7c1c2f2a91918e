//! Typed errors of afdep-core.
//!
//! [`RouteError`] is the error of a rejected route. It names the rank, token, slot and the
//! offending value, and it has a fixed-size binary form, the *error word* ([`RouteError::to_word`]),
//! which is what a device kernel or a remote rank publishes; every rank turns the same word back
//! into the same typed error.

use thiserror::Error;

/// A configuration that cannot be used, or two ranks that disagree on one.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum ConfigError {
    /// A field holds a value outside its allowed range.
    #[error("invalid config: {field} = {value}: {reason}")]
    Invalid {
        /// The field's name, as in the serialized config.
        field: &'static str,
        /// The offending value, as text.
        value: String,
        /// Why it is rejected.
        reason: String,
    },
    /// A topology string could not be parsed.
    #[error("cannot parse topology {text:?}: {reason} (expected forms: `3A:1F`, `EP4`)")]
    Topology {
        /// The text given.
        text: String,
        /// Why it was rejected.
        reason: String,
    },
    /// Two ranks hold different exchange configurations.
    #[error(
        "rank {remote_rank} disagrees with rank {local_rank} on the exchange configuration: \
         field `{field}` is {remote} there and {local} here"
    )]
    Mismatch {
        /// The first field (in fingerprint order) that differs.
        field: String,
        /// This rank's value.
        local: String,
        /// The other rank's value.
        remote: String,
        /// This rank.
        local_rank: usize,
        /// The rank that differs.
        remote_rank: usize,
    },
}

/// A route rejected before anything is sent. Every variant names the attention rank that
/// routed the token; token and slot index into that rank's route table.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum RouteError {
    /// The same expert appears twice for one token.
    #[error(
        "duplicate route: rank {rank} token {token} slot {slot} repeats expert {expert} of slot {first_slot}"
    )]
    Duplicate {
        /// Attention rank.
        rank: usize,
        /// Token index on that rank.
        token: usize,
        /// The later slot.
        slot: usize,
        /// The repeated expert id.
        expert: i32,
        /// The earlier slot holding the same expert.
        first_slot: usize,
    },
    /// An expert id below -1 (-1 is the masked slot).
    #[error(
        "negative route: rank {rank} token {token} slot {slot} has expert id {value} (only -1, a masked slot, may be negative)"
    )]
    Negative {
        /// Attention rank.
        rank: usize,
        /// Token index.
        token: usize,
        /// Slot index.
        slot: usize,
        /// The id.
        value: i32,
    },
    /// An expert id at or above the number of experts.
    #[error(
        "wide route: rank {rank} token {token} slot {slot} has expert id {value}, but there are {experts} experts"
    )]
    Wide {
        /// Attention rank.
        rank: usize,
        /// Token index.
        token: usize,
        /// Slot index.
        slot: usize,
        /// The id.
        value: i32,
        /// Number of experts.
        experts: usize,
    },
    /// An expert id that no FFN rank owns.
    #[error(
        "dummy route: rank {rank} token {token} slot {slot} has expert id {value}, which no FFN rank owns (experts 0..{owned} are placed)"
    )]
    Dummy {
        /// Attention rank.
        rank: usize,
        /// Token index.
        token: usize,
        /// Slot index.
        slot: usize,
        /// The id.
        value: i32,
        /// Experts `0..owned` are owned by some FFN rank.
        owned: usize,
    },
    /// A weight that is NaN or infinite on a slot that is not masked.
    #[error("non-finite route weight: rank {rank} token {token} slot {slot} has weight {value}")]
    NonFiniteWeight {
        /// Attention rank.
        rank: usize,
        /// Token index.
        token: usize,
        /// Slot index.
        slot: usize,
        /// The weight.
        value: f32,
    },
    /// More tokens than the exchange capacity.
    #[error("over capacity: rank {rank} has {tokens} tokens, the capacity is {capacity}")]
    OverCapacity {
        /// Attention rank.
        rank: usize,
        /// Tokens given.
        tokens: usize,
        /// The configured capacity per attention rank.
        capacity: usize,
    },
    /// A NaN or infinite value in a token row that travels as an fp8 payload (see
    /// [`crate::fp8`]: such a row has no scale).
    #[error(
        "non-finite fp8 payload: rank {rank} token {token} channel {channel} is {value} (fp8 \
         payloads quantise finite rows only)"
    )]
    NonFinitePayload {
        /// Attention rank.
        rank: usize,
        /// Token index on that rank.
        token: usize,
        /// The first non-finite channel of the row.
        channel: usize,
        /// The value there.
        value: f32,
    },
    /// A NaN or infinite router logit (`x·Wr` of a token with a non-finite value in its `x`
    /// row or in the router weights): the router cannot rank the experts of that token, so
    /// the step is refused before any expert runs, on every backend.
    #[error(
        "non-finite router logit: rank {rank} token {token} expert {expert} has logit {value} \
         (a NaN or infinity in this token's x row or in the router weights)"
    )]
    NonFiniteLogit {
        /// Attention rank.
        rank: usize,
        /// The first token (lowest index) with a non-finite logit.
        token: usize,
        /// The lowest expert id whose logit is non-finite for that token.
        expert: usize,
        /// The logit.
        value: f32,
    },
    /// The route table's arrays do not have the sizes the shape requires.
    #[error("malformed routes on rank {rank}: {what}")]
    Malformed {
        /// Attention rank.
        rank: usize,
        /// What is wrong.
        what: String,
    },
}

/// Number of 32-bit words in a [`RouteError`] error word.
pub const ROUTE_ERROR_WORDS: usize = 6;

/// The class codes of the error word (word 0). Zero means "no error".
pub mod route_class {
    /// No error.
    pub const OK: u32 = 0;
    /// [`super::RouteError::Duplicate`].
    pub const DUPLICATE: u32 = 1;
    /// [`super::RouteError::Negative`].
    pub const NEGATIVE: u32 = 2;
    /// [`super::RouteError::Wide`].
    pub const WIDE: u32 = 3;
    /// [`super::RouteError::Dummy`].
    pub const DUMMY: u32 = 4;
    /// [`super::RouteError::NonFiniteWeight`].
    pub const NON_FINITE_WEIGHT: u32 = 5;
    /// [`super::RouteError::OverCapacity`].
    pub const OVER_CAPACITY: u32 = 6;
    /// [`super::RouteError::Malformed`].
    pub const MALFORMED: u32 = 7;
    /// [`super::RouteError::NonFinitePayload`].
    pub const NON_FINITE_PAYLOAD: u32 = 8;
    /// [`super::RouteError::NonFiniteLogit`].
    pub const NON_FINITE_LOGIT: u32 = 9;
}

impl RouteError {
    /// The attention rank named by the error.
    pub fn rank(&self) -> usize {
        match self {
            RouteError::Duplicate { rank, .. }
            | RouteError::Negative { rank, .. }
            | RouteError::Wide { rank, .. }
            | RouteError::Dummy { rank, .. }
            | RouteError::NonFiniteWeight { rank, .. }
            | RouteError::OverCapacity { rank, .. }
            | RouteError::NonFinitePayload { rank, .. }
            | RouteError::NonFiniteLogit { rank, .. }
            | RouteError::Malformed { rank, .. } => *rank,
        }
    }

    /// Encodes the error as the fixed-size error word:
    /// `[class, rank, token, slot, value bits, extra]`, where `value` is the expert id
    /// (as `i32` bits) or the weight (as `f32` bits), and `extra` is the first slot
    /// (duplicate), the number of experts (wide), the owned experts (dummy), or the
    /// capacity (over capacity, whose `token` field holds the token count). A non-finite
    /// payload puts its channel in the slot field and the value's `f32` bits in `value`; a
    /// non-finite logit its expert in the slot field and the logit's `f32` bits in `value`.
    /// [`RouteError::Malformed`] loses its text in the word.
    pub fn to_word(&self) -> [u32; ROUTE_ERROR_WORDS] {
        use route_class::*;
        let c = |v: usize| u32::try_from(v).unwrap_or(u32::MAX);
        match *self {
            RouteError::Duplicate {
                rank,
                token,
                slot,
                expert,
                first_slot,
            } => [
                DUPLICATE,
                c(rank),
                c(token),
                c(slot),
                expert as u32,
                c(first_slot),
            ],
            RouteError::Negative {
                rank,
                token,
                slot,
                value,
            } => [NEGATIVE, c(rank), c(token), c(slot), value as u32, 0],
            RouteError::Wide {
                rank,
                token,
                slot,
                value,
                experts,
            } => [WIDE, c(rank), c(token), c(slot), value as u32, c(experts)],
            RouteError::Dummy {
                rank,
                token,
                slot,
                value,
                owned,
            } => [DUMMY, c(rank), c(token), c(slot), value as u32, c(owned)],
            RouteError::NonFiniteWeight {
                rank,
                token,
                slot,
                value,
            } => [
                NON_FINITE_WEIGHT,
                c(rank),
                c(token),
                c(slot),
                value.to_bits(),
                0,
            ],
            RouteError::OverCapacity {
                rank,
                tokens,
                capacity,
            } => [OVER_CAPACITY, c(rank), c(tokens), 0, 0, c(capacity)],
            RouteError::NonFinitePayload {
                rank,
                token,
                channel,
                value,
            } => [
                NON_FINITE_PAYLOAD,
                c(rank),
                c(token),
                c(channel),
                value.to_bits(),
                0,
            ],
            RouteError::NonFiniteLogit {
                rank,
                token,
                expert,
                value,
            } => [
                NON_FINITE_LOGIT,
                c(rank),
                c(token),
                c(expert),
                value.to_bits(),
                0,
            ],
            RouteError::Malformed { rank, .. } => [MALFORMED, c(rank), 0, 0, 0, 0],
        }
    }

    /// Decodes an error word; `None` for class [`route_class::OK`] or an unknown class.
    pub fn from_word(w: [u32; ROUTE_ERROR_WORDS]) -> Option<RouteError> {
        use route_class::*;
        let (rank, token, slot) = (w[1] as usize, w[2] as usize, w[3] as usize);
        Some(match w[0] {
            DUPLICATE => RouteError::Duplicate {
                rank,
                token,
                slot,
                expert: w[4] as i32,
                first_slot: w[5] as usize,
            },
            NEGATIVE => RouteError::Negative {
                rank,
                token,
                slot,
                value: w[4] as i32,
            },
            WIDE => RouteError::Wide {
                rank,
                token,
                slot,
                value: w[4] as i32,
                experts: w[5] as usize,
            },
            DUMMY => RouteError::Dummy {
                rank,
                token,
                slot,
                value: w[4] as i32,
                owned: w[5] as usize,
            },
            NON_FINITE_WEIGHT => RouteError::NonFiniteWeight {
                rank,
                token,
                slot,
                value: f32::from_bits(w[4]),
            },
            OVER_CAPACITY => RouteError::OverCapacity {
                rank,
                tokens: token,
                capacity: w[5] as usize,
            },
            NON_FINITE_PAYLOAD => RouteError::NonFinitePayload {
                rank,
                token,
                channel: slot,
                value: f32::from_bits(w[4]),
            },
            NON_FINITE_LOGIT => RouteError::NonFiniteLogit {
                rank,
                token,
                expert: slot,
                value: f32::from_bits(w[4]),
            },
            MALFORMED => RouteError::Malformed {
                rank,
                what: "reported by a peer".into(),
            },
            _ => return None,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_word_round_trips() {
        let cases = vec![
            RouteError::Duplicate {
                rank: 2,
                token: 7,
                slot: 3,
                expert: 11,
                first_slot: 1,
            },
            RouteError::Negative {
                rank: 0,
                token: 1,
                slot: 0,
                value: -5,
            },
            RouteError::Wide {
                rank: 1,
                token: 9,
                slot: 7,
                value: 128,
                experts: 128,
            },
            RouteError::Dummy {
                rank: 3,
                token: 0,
                slot: 2,
                value: 100,
                owned: 96,
            },
            RouteError::NonFiniteWeight {
                rank: 1,
                token: 4,
                slot: 5,
                value: f32::INFINITY,
            },
            RouteError::OverCapacity {
                rank: 2,
                tokens: 3000,
                capacity: 2048,
            },
            RouteError::NonFinitePayload {
                rank: 1,
                token: 17,
                channel: 300,
                value: f32::NEG_INFINITY,
            },
            RouteError::NonFiniteLogit {
                rank: 0,
                token: 70_000,
                expert: 59,
                value: f32::INFINITY,
            },
        ];
        for e in cases {
            assert_eq!(RouteError::from_word(e.to_word()), Some(e.clone()), "{e}");
        }
        let nan = RouteError::NonFiniteWeight {
            rank: 0,
            token: 0,
            slot: 0,
            value: f32::NAN,
        };
        match RouteError::from_word(nan.to_word()) {
            Some(RouteError::NonFiniteWeight { value, .. }) => assert!(value.is_nan()),
            other => panic!("{other:?}"),
        }
        assert_eq!(RouteError::from_word([0; ROUTE_ERROR_WORDS]), None);
    }
}
