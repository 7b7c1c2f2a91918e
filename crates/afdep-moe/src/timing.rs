//! Device timing with CUDA events: the one helper that `afdep moe --backend cuda` and the
//! `bench_layer` program share.
//!
//! [`EventTimer::new`] creates every event it will record up front (one pair per timed run),
//! so that no event is created between the runs it times. [`EventTimer::time`] runs the step
//! `warmups` times, waits for the stream, then runs it once per pair, each run between its
//! own pair of events recorded on the context's stream, with no host sync in between (a step
//! is only queued, as in a training loop); it waits once at the end and reads every pair. The
//! result is the [`median`] of the per-run times.

use afdep_kernels::cudarc::driver::CudaEvent;
use afdep_kernels::cudarc::driver::sys::CUevent_flags;
use afdep_kernels::{GpuContext, KernelError};

/// Warm-up runs before the timed ones (the first also loads every kernel module).
pub const WARMUPS: usize = 3;

/// The median of `v`: the element at index `n / 2` of the sorted values (the upper median
/// when `n` is even, the convention of the peer scripts too); `None` when `v` is empty. NaN
/// sorts last ([`f64::total_cmp`]).
pub fn median(v: &[f64]) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    Some(s[s.len() / 2])
}

/// Times of the timed runs of one step.
#[derive(Debug, Clone, PartialEq)]
pub struct Timing {
    /// Milliseconds of each timed run, in run order.
    pub samples_ms: Vec<f64>,
    /// Their [`median`].
    pub median_ms: f64,
}

/// Pre-created CUDA event pairs for timing a step (see the module documentation).
#[derive(Debug)]
pub struct EventTimer {
    pairs: Vec<(CudaEvent, CudaEvent)>,
}

impl EventTimer {
    /// Creates `iters` pairs of timing events on `ctx` (at least one run is timed; `iters ==
    /// 0` is [`KernelError::Unsupported`]).
    pub fn new(ctx: &GpuContext, iters: usize) -> Result<Self, KernelError> {
        if iters == 0 {
            return Err(KernelError::Unsupported(
                "timing needs at least one timed run".into(),
            ));
        }
        let ev = || {
            ctx.cuda()
                .new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
                .map_err(KernelError::driver("creating a timing event"))
        };
        let mut pairs = Vec::with_capacity(iters);
        for _ in 0..iters {
            pairs.push((ev()?, ev()?));
        }
        Ok(EventTimer { pairs })
    }

    /// Timed runs per [`EventTimer::time`].
    pub fn iters(&self) -> usize {
        self.pairs.len()
    }

    /// Runs `step` `warmups` times, then once between each pair of events; returns every
    /// run's time and their median. `step` only queues work on `ctx`'s stream.
    pub fn time<E: From<KernelError>>(
        &self,
        ctx: &GpuContext,
        warmups: usize,
        mut step: impl FnMut() -> Result<(), E>,
    ) -> Result<Timing, E> {
        for _ in 0..warmups {
            step()?;
        }
        ctx.synchronize()?;
        let s = ctx.stream();
        for (a, b) in &self.pairs {
            a.record(s)
                .map_err(KernelError::driver("recording a timing event"))?;
            step()?;
            b.record(s)
                .map_err(KernelError::driver("recording a timing event"))?;
        }
        ctx.synchronize()?;
        let mut samples_ms = Vec::with_capacity(self.pairs.len());
        for (a, b) in &self.pairs {
            let ms = a
                .elapsed_ms(b)
                .map_err(KernelError::driver("reading a timing event"))?;
            samples_ms.push(f64::from(ms));
        }
        let median_ms = median(&samples_ms).expect("at least one timed run");
        Ok(Timing {
            samples_ms,
            median_ms,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_is_the_upper_middle() {
        assert_eq!(median(&[]), None);
        assert_eq!(median(&[2.0]), Some(2.0));
        assert_eq!(median(&[3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median(&[4.0, 1.0, 3.0, 2.0]), Some(3.0));
        assert_eq!(median(&[f64::NAN, 1.0, 2.0]), Some(2.0));
    }
}
