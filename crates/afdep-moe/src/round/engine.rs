//! [`ExchangeEngine`]: one rank's exchange engine, whatever its kind.

use std::time::Duration;

use afdep_core::oracle::exchange::SourceInput;
use afdep_transport::TransportError;

use super::{DevicePhaseTimes, ExpertFn, RoundOutput, RoundTrace};
use crate::error::ExchangeError;

/// One rank's exchange engine: what a round loop needs of the staged engine
/// ([`StagedEngine`](crate::StagedEngine)), the fused engine ([`FusedEngine`](crate::FusedEngine))
/// and wrappers around them (a graph replayer, an arm cycler), behind one interface.
pub trait ExchangeEngine {
    /// This rank.
    fn rank(&self) -> usize;

    /// Runs one round. Attention ranks pass `Some(input)`; FFN-only ranks pass `None`.
    /// `expert` is used on FFN ranks where the engine runs its experts on the host.
    /// Collective: every rank of the topology must call it.
    fn round(
        &mut self,
        input: Option<&SourceInput>,
        expert: &dyn ExpertFn,
    ) -> Result<RoundOutput, ExchangeError>;

    /// A control-plane barrier of every rank (between rounds, for timing).
    fn barrier(&mut self) -> Result<(), TransportError>;

    /// A control-plane all-gather: every rank's `mine` (all of one length), by rank.
    fn all_gather(&mut self, mine: &[u8]) -> Result<Vec<u8>, TransportError>;

    /// The device times of the last round's two exchange phases, where the engine takes them
    /// ([`FusedEngine::set_phase_timing`](crate::FusedEngine::set_phase_timing)); `None` by
    /// default.
    fn device_times(&self) -> Option<DevicePhaseTimes> {
        None
    }

    /// The device time of the last whole round, where the engine takes it as one span
    /// ([`FusedEngine::set_round_timing`](crate::FusedEngine::set_round_timing)); `None` by
    /// default.
    fn round_time(&self) -> Option<Duration> {
        None
    }

    /// The timeline of the last round, where the engine traces its rounds
    /// ([`FusedEngine::set_trace`](crate::FusedEngine::set_trace)); `None` by default.
    fn round_trace(&self) -> Option<RoundTrace> {
        None
    }

    /// The probe points the last round's kernels recorded, by slot
    /// ([`afdep_kernels::ops::probe`], device nanoseconds, 0 where none fired), zeroed for the
    /// next round, where the engine's kernels are built with probes
    /// ([`FusedEngine::take_probes`](crate::FusedEngine::take_probes)); `Ok(None)` by default.
    /// Between rounds only.
    fn round_probe(
        &mut self,
    ) -> Result<Option<[u64; afdep_kernels::ops::probe::SLOTS]>, ExchangeError> {
        Ok(None)
    }
}
