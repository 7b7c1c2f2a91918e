//! The vocabulary of one exchange round, shared by every engine.
//!
//! - [`ExpertFn`]: an FFN rank's experts on the host; [`PhaseTimes`] and [`DevicePhaseTimes`]:
//!   the host and device spans of a round; [`RoundOutput`]: what a rank gets from a round.
//! - [`DispatchArm`] and [`RoundArm`] (`arm`): how a round's dispatch runs.
//! - The set-up agreement of every engine (`agree`), the host status + counts phase of the
//!   staged and NCCL device engines (`counts`; the fused engine's runs on the device), and the
//!   host experts of one FFN rank (`experts`).
//! - [`ExchangeEngine`] (`engine`): one rank's engine behind one interface, implemented by
//!   [`StagedEngine`](crate::StagedEngine) and [`FusedEngine`](crate::FusedEngine); and
//!   [`run_group`] (`group`): one engine per rank of an in-process group, one thread each.
//! - [`RoundTrace`] (`trace`): a rank's round as phases on the device timer.
//!
//! This module depends on no engine: the engines depend on it.

use std::time::Duration;

use afdep_core::bf16;
use afdep_core::oracle::exchange::FfnReceived;

use crate::ExchangeError;

mod agree;
mod arm;
mod counts;
mod engine;
mod experts;
mod group;
pub mod trace;

pub(crate) use agree::agree;
pub use arm::{DispatchArm, RoundArm};
pub(crate) use counts::count_phase;
pub use engine::ExchangeEngine;
pub(crate) use experts::apply_experts;
pub use group::{RankOutcome, run_group};
pub use trace::{PhaseSpan, RoundTrace, TracePhase};

/// `Closed` (naming `rank` and why) once an error closed an engine, `Ok` while it is open.
pub(crate) fn check_open(closed: &Option<String>, rank: usize) -> Result<(), ExchangeError> {
    match closed {
        Some(why) => Err(ExchangeError::Closed {
            rank,
            why: why.clone(),
        }),
        None => Ok(()),
    }
}

/// An FFN rank's experts: `expert(global_expert_id, rows, n) -> n × hidden` bf16 rows. Each
/// call gets one local expert's whole group of expanded rows.
pub trait ExpertFn: Fn(usize, &[bf16], usize) -> Vec<bf16> {}
impl<F: Fn(usize, &[bf16], usize) -> Vec<bf16>> ExpertFn for F {}

/// Wall time of each phase of one round on one rank. The field docs are the staged engine's
/// phases; [`FusedEngine::round`](crate::FusedEngine::round) says what each holds there (its
/// status and counts run on the device, inside `dispatch`).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct PhaseTimes {
    /// Validation, counting and the status+count all-gather.
    pub counts: Duration,
    /// Packing, the dispatch all-to-all-v and expansion.
    pub dispatch: Duration,
    /// Expert application (FFN ranks).
    pub experts: Duration,
    /// The combine all-to-all-v and the weighted sums.
    pub combine: Duration,
}

/// Device time of the two exchange phases of one round on one rank, from CUDA events on the
/// rank's stream ([`FusedEngine::set_phase_timing`](crate::FusedEngine::set_phase_timing)),
/// taken by [`FusedEngine::round`](crate::FusedEngine::round): the device round's two halves on
/// either side of the host experts.
///
/// With timing on, each phase starts with a control-plane barrier of every rank, after the rank's
/// host work before it (the input's copy to the device; an FFN rank's read-back, host experts
/// and their upload), and the first event is recorded right after it; the second follows the
/// phase's last kernel. So a span holds only this rank's kernels of the phase and their waits
/// for peers that started the phase at the same barrier, not the host work of another rank:
///
/// - **dispatch**: the front half: the start (validation, the status exchange, the verdict and
///   the arm), a source's counts and rows, an FFN rank's plan and epilogue, which waits for
///   every source's rows; both on a rank that is both (EP).
/// - **combine**: an FFN rank's partial sums into the sources' return areas and signal; a source's
///   combine, which waits for every FFN rank's flag and then sums; both on a rank that is both.
///
/// The latency of a phase is the largest span over the ranks; a round's is the sum of its two
/// phases' latencies. The barrier's own skew between ranks (the time one rank's kernels wait
/// for a peer that left the barrier later) counts, as it would in any host-launched round.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct DevicePhaseTimes {
    /// The dispatch phase on this rank.
    pub dispatch: Duration,
    /// The combine phase on this rank.
    pub combine: Duration,
}

/// What one rank gets from a round.
#[derive(Debug, Clone, PartialEq)]
pub struct RoundOutput {
    /// Attention ranks: the combined rows of their tokens, T × hidden.
    pub combined: Option<Vec<bf16>>,
    /// FFN ranks: what they received (expanded layout and compact view).
    pub received: Option<FfnReceived>,
    /// Phase times.
    pub times: PhaseTimes,
}
