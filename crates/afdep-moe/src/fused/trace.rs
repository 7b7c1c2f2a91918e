//! Timelines of device rounds ([`RoundTrace`]): device-side timestamps at every phase boundary of a rank's
//! round, eager or inside a graph replay, read after the round.
//!
//! With tracing on ([`FusedEngine::set_trace`](crate::FusedEngine::set_trace)), the launches
//! of a device round are separated by one-thread stamp kernels
//! ([`afdep_kernels::ops::fused_round::stamp`]) that write the GPU's global nanosecond timer
//! (`%globaltimer`) into a small per-rank buffer: one stamp before the first phase and one after
//! each phase this rank launches. Kernels of one stream run in order, so a stamp runs after the
//! phase before it finished and before the phase after it starts: phase `i` spans stamps `i`
//! and `i + 1`. A capture records the stamps as kernel nodes, so every replay stamps too; the
//! round itself adds no host sync (the stamps are read after the round, when its results are).
//!
//! Every rank of one GPU reads the same timer, so the spans of emulated ranks line up on one
//! time axis; across GPUs of one host the timers agree to within the driver's synchronisation
//! (microseconds). The timer's resolution is the GPU's: where the driver updates it at 1 MHz
//! a span shorter than a microsecond reads as 0 or 1 µs. A stamp costs one small kernel (about
//! 1–3 µs of launch and run time on the stream), so traced rounds are slower than untraced ones:
//! tables of latency come from untraced runs, timelines from traced ones.

use crate::round::trace::{RoundTrace, TracePhase, spans_of};
use afdep_kernels::cudarc::driver::CudaSlice;
use afdep_kernels::ops::fused_round as fr;
use afdep_kernels::{GpuContext, KernelError};

/// Stamps of one round at most: one before the first phase, one after each.
pub(super) const SLOTS: usize = TracePhase::ALL.len() + 1;

/// A rank's tracing state: the stamp buffer (allocated once and kept for the engine's life,
/// since a graph captured with tracing on writes into it at every replay), whether new
/// launches stamp, and the phase order of the round being launched or replayed.
#[derive(Debug)]
pub(super) struct Tracer {
    stamps: CudaSlice<u64>,
    pub(super) on: bool,
    /// The phases of the round in flight, in stamp order (stamp `i + 1` ends phase `i`).
    pub(super) order: Vec<TracePhase>,
    pub(super) last: Option<RoundTrace>,
}

impl Tracer {
    /// A tracer with its stamp buffer on `gpu`.
    pub(super) fn new(gpu: &GpuContext) -> Result<Tracer, KernelError> {
        Ok(Tracer {
            stamps: afdep_kernels::ops::zeros(gpu, SLOTS)?,
            on: false,
            order: Vec::with_capacity(TracePhase::ALL.len()),
            last: None,
        })
    }

    /// Before a round is launched or replayed (outside any capture: a memset is not a kernel
    /// node): clears the stamps, so that a stamp that does not run reads 0 and fails the
    /// read-back, and the last trace.
    pub(super) fn clear(&mut self, gpu: &GpuContext) -> Result<(), KernelError> {
        self.last = None;
        gpu.stream()
            .memset_zeros(&mut self.stamps)
            .map_err(KernelError::driver("clearing the trace stamps"))
    }

    /// The first launch of a round (eager or captured): the round's first stamp.
    pub(super) fn start(&mut self, gpu: &GpuContext) -> Result<(), KernelError> {
        self.order.clear();
        fr::stamp(gpu, &mut self.stamps, 0)
    }

    /// After the launches of `phase`: its end stamp.
    pub(super) fn mark(&mut self, gpu: &GpuContext, phase: TracePhase) -> Result<(), KernelError> {
        self.order.push(phase);
        fr::stamp(gpu, &mut self.stamps, self.order.len())
    }

    /// After a completed round (its stream waited for): reads the stamps into
    /// [`Tracer::last`]. A missing or decreasing stamp is an error (a launch that did not run).
    pub(super) fn read(&mut self, gpu: &GpuContext, rank: usize) -> Result<(), KernelError> {
        let n = self.order.len() + 1;
        let mut host = vec![0u64; SLOTS];
        gpu.stream()
            .memcpy_dtoh(&self.stamps, &mut host)
            .map_err(KernelError::driver("reading the trace stamps"))?;
        gpu.synchronize()?;
        self.last = Some(checked(rank, &self.order, &host[..n])?);
        Ok(())
    }

    /// The device address of the stamp buffer ([`SLOTS`] u64).
    pub(super) fn stamps_address(&self, gpu: &GpuContext) -> u64 {
        let (p, _guard) =
            afdep_kernels::cudarc::driver::DevicePtr::device_ptr(&self.stamps, gpu.stream());
        p
    }
}

/// The timeline of `rank`'s round from its `stamps` (one more than `order` has phases): a
/// missing (zero) or decreasing stamp is an error (a launch that did not run).
pub(super) fn checked(
    rank: usize,
    order: &[TracePhase],
    stamps: &[u64],
) -> Result<RoundTrace, KernelError> {
    let n = stamps.len();
    if let Some(i) = stamps.iter().position(|&t| t == 0) {
        return Err(KernelError::Unsupported(format!(
            "rank {rank}: trace stamp {i} of {n} was not written"
        )));
    }
    if let Some(i) = stamps.windows(2).position(|w| w[1] < w[0]) {
        return Err(KernelError::Unsupported(format!(
            "rank {rank}: trace stamp {} runs backwards ({} after {})",
            i + 1,
            stamps[i + 1],
            stamps[i]
        )));
    }
    Ok(spans_of(rank, order, stamps))
}

/// With tracing on, the end stamp of `phase` (nothing when `t` is off or absent).
pub(super) fn mark(
    t: &mut Option<Tracer>,
    gpu: &GpuContext,
    phase: TracePhase,
) -> Result<(), KernelError> {
    match t.as_mut() {
        Some(t) if t.on => t.mark(gpu, phase),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_slot_per_phase_and_the_start() {
        assert_eq!(SLOTS, TracePhase::ALL.len() + 1);
    }
}
