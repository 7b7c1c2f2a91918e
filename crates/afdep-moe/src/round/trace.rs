//! The timeline of a round: its phases on the device timer, per rank (what a traced device
//! round of the fused engine gives, [`FusedEngine::set_trace`](crate::FusedEngine::set_trace)).

use serde::Serialize;

/// A phase of a device round as a timeline names it (the numbered steps of
/// [`device_round`](crate::fused::device_round)'s sequencer).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum TracePhase {
    /// Source, fp8 payloads: the non-finite row check.
    PayloadCheck,
    /// Every rank: the round number, device route validation and the verdict shared among
    /// ranks (`afdep_round_begin`, which waits for every rank's record).
    Begin,
    /// Source: per-destination counts on the device, published to the FFN ranks.
    Counts,
    /// FFN, count-first arms: the plan and the offsets (waits for every source's counts).
    Plan,
    /// Source: the token rows stored into the FFN ranks' workspaces, and the dispatch flags.
    Rows,
    /// FFN: the epilogue (waits for the rows; expands them into the expanded layout).
    Epilogue,
    /// FFN: the experts (identity, scale or the SwiGLU grouped GEMMs), the combine's partial
    /// sums and the combine flags.
    Experts,
    /// Source: the combine (waits for the FFN ranks' partials).
    Combine,
}

impl TracePhase {
    /// Every phase, in round order.
    pub const ALL: [TracePhase; 8] = [
        TracePhase::PayloadCheck,
        TracePhase::Begin,
        TracePhase::Counts,
        TracePhase::Plan,
        TracePhase::Rows,
        TracePhase::Epilogue,
        TracePhase::Experts,
        TracePhase::Combine,
    ];

    /// The phase's name in traces and rows (`payload_check`, `begin`, ...).
    pub fn name(self) -> &'static str {
        match self {
            TracePhase::PayloadCheck => "payload_check",
            TracePhase::Begin => "begin",
            TracePhase::Counts => "counts",
            TracePhase::Plan => "plan",
            TracePhase::Rows => "rows",
            TracePhase::Epilogue => "epilogue",
            TracePhase::Experts => "experts",
            TracePhase::Combine => "combine",
        }
    }
}

/// One phase of one rank's round on the device timer (ns).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct PhaseSpan {
    /// The phase.
    pub phase: TracePhase,
    /// The stamp before its launches.
    pub start_ns: u64,
    /// The stamp after them.
    pub end_ns: u64,
}

impl PhaseSpan {
    /// The span's length in µs.
    pub fn us(&self) -> f64 {
        self.end_ns.saturating_sub(self.start_ns) as f64 * 1e-3
    }
}

/// The timeline of one rank's device round: its phases in launch order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RoundTrace {
    /// The rank.
    pub rank: usize,
    /// The phases this rank launched, in order; consecutive spans share their boundary.
    pub spans: Vec<PhaseSpan>,
}

impl RoundTrace {
    /// The first stamp (the round's start on this rank), ns.
    pub fn start_ns(&self) -> Option<u64> {
        self.spans.first().map(|s| s.start_ns)
    }

    /// The last stamp (the round's end on this rank), ns.
    pub fn end_ns(&self) -> Option<u64> {
        self.spans.last().map(|s| s.end_ns)
    }
}

/// The spans of `order` between consecutive `stamps` (`stamps.len() == order.len() + 1`) of
/// `rank`.
pub fn spans_of(rank: usize, order: &[TracePhase], stamps: &[u64]) -> RoundTrace {
    debug_assert_eq!(stamps.len(), order.len() + 1);
    RoundTrace {
        rank,
        spans: order
            .iter()
            .zip(stamps.windows(2))
            .map(|(&phase, w)| PhaseSpan {
                phase,
                start_ns: w[0],
                end_ns: w[1],
            })
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spans_share_their_boundaries() {
        let order = [TracePhase::Begin, TracePhase::Counts, TracePhase::Combine];
        let t = spans_of(2, &order, &[100, 1100, 3100, 3600]);
        assert_eq!(t.rank, 2);
        assert_eq!(t.spans.len(), 3);
        assert_eq!(t.spans[1].phase, TracePhase::Counts);
        assert_eq!((t.spans[1].start_ns, t.spans[1].end_ns), (1100, 3100));
        assert_eq!(t.spans[1].us(), 2.0);
        assert_eq!((t.start_ns(), t.end_ns()), (Some(100), Some(3600)));
    }

    #[test]
    fn phase_names_are_distinct_and_in_round_order() {
        let names: std::collections::BTreeSet<_> =
            TracePhase::ALL.iter().map(|p| p.name()).collect();
        assert_eq!(names.len(), TracePhase::ALL.len());
        assert!(TracePhase::ALL.windows(2).all(|w| w[0] < w[1]));
    }
}
