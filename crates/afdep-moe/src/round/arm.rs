//! How a round's dispatch runs: [`DispatchArm`] (one arm) and [`RoundArm`] (the arm of a
//! device round or a captured graph: one arm, or chosen on the device each round).

use afdep_core::ExchangeKnobs;

/// How one round's dispatch runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DispatchArm {
    /// Rows into per-source slabs, then a copy epilogue on the FFN rank.
    PayloadFirst,
    /// Count-first with the streaming epilogue: counts, offsets, rows into slabs with per-row
    /// readiness flags, expanded as they land.
    CountFirst,
    /// Count-first, the source arm: counts, offsets, rows stored straight to their final
    /// expanded rows.
    CountFirstSource,
}

impl DispatchArm {
    /// Every arm.
    pub const ALL: [DispatchArm; 3] = [
        DispatchArm::PayloadFirst,
        DispatchArm::CountFirst,
        DispatchArm::CountFirstSource,
    ];

    /// The arm of a round whose largest source has `max_tokens` tokens: count-first, the source
    /// arm, when `max_tokens >= knobs.min_token_bucket`, payload-first otherwise. (The record's
    /// rule took the streaming count-first arm; measured here, the source arm is faster than
    /// both others at every token count, on one GPU and across two: docs/perf/exchange.md,
    /// "The auto arm takes the source arm".)
    pub fn select(knobs: &ExchangeKnobs, max_tokens: usize) -> DispatchArm {
        if max_tokens >= knobs.min_token_bucket {
            DispatchArm::CountFirstSource
        } else {
            DispatchArm::PayloadFirst
        }
    }

    /// A short name: `payload_first`, `count_first`, `count_first_source`.
    pub fn name(self) -> &'static str {
        match self {
            DispatchArm::PayloadFirst => "payload_first",
            DispatchArm::CountFirst => "count_first",
            DispatchArm::CountFirstSource => "count_first_source",
        }
    }
}

impl std::fmt::Display for DispatchArm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The dispatch arm of a device round or a captured graph ([`FusedEngine::device_round`](crate::FusedEngine::device_round),
/// [`FusedEngine::capture`](crate::FusedEngine::capture)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RoundArm {
    /// This arm, on every rank (every rank must pass the same; ranks that differ all get
    /// [`ExchangeError::ArmsDiffer`](crate::ExchangeError::ArmsDiffer) and skip the round). [`FusedEngine::set_arm`](crate::FusedEngine::set_arm) plays no
    /// part.
    Fixed(DispatchArm),
    /// The arm chosen on the device each round, the same on every rank: the arm forced by
    /// [`FusedEngine::set_arm`](crate::FusedEngine::set_arm) at the time of the round (every rank must force the same one),
    /// else the token-bucket rule ([`DispatchArm::select`] over the largest source's token count
    /// of the round). The round holds every arm's kernels; those of the arms not taken return at
    /// once. [`FusedEngine::last_arm`](crate::FusedEngine::last_arm) gives the arm a round took.
    Auto,
}

impl From<DispatchArm> for RoundArm {
    fn from(a: DispatchArm) -> RoundArm {
        RoundArm::Fixed(a)
    }
}

impl std::fmt::Display for RoundArm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RoundArm::Fixed(a) => a.fmt(f),
            RoundArm::Auto => f.write_str("auto"),
        }
    }
}
