//! [`FusedEngine::round`]: a device round whose experts run on the host.
//!
//! The round is the device round of the [parent module](super) split at one point, between
//! the FFN rank's epilogue and its partial sums:
//!
//! 1. the input is copied into the fixed device buffers (its token count and arm request into
//!    the control block, the outputs poisoned), as for [`FusedEngine::device_round`];
//! 2. [`Part::Front`]: the payload check, `afdep_round_begin` (validation, the verdict and the
//!    arm shared by every rank), counts, plan, rows and epilogue, on every rank (with the
//!    fronts, [`FusedEngine::set_fronts`], one kernel per single-role rank);
//! 3. the host waits for its stream: the device's waits in those kernels are bounded by the
//!    transport's timeout, a late peer is [`ExchangeError::DeviceTimeout`]; it reads the
//!    control block: a rejected round (or ranks that asked for different arms) skips the rest
//!    on every rank alike and returns the device round's error. Otherwise an FFN rank's
//!    expanded rows are complete and nothing overwrites them or its slabs until it raises its
//!    combine flag (a source writes the next round's rows only after that flag), so the host
//!    reads what the rank received (the device plan, the expanded rows, the compact view from
//!    the slabs), runs the caller's [`ExpertFn`] per local expert exactly as the staged engine
//!    does (`apply_experts`: experts in order, each over its rows of the expanded layout), and
//!    uploads the outputs;
//! 4. [`Part::Back`] with those outputs ([`HostY`]): no expert kernel, the FFN rank's partial
//!    sums read the uploaded rows (in the device plan's expanded order, what the device
//!    experts' output buffer holds), then the source's combine. A source's combine was
//!    launched right after its own front half and waits on the device for every FFN rank's
//!    combine flag while the FFN ranks run their host experts: that wait is bounded by the
//!    transport's timeout ([`afdep_transport::NvlinkOptions::timeout`]), so host experts must
//!    take less than it, or the sources fail with [`ExchangeError::DeviceTimeout`] (phase
//!    "combine") and the group's engines close.
//!
//! The arm is [`FusedEngine::set_arm`]'s (a fixed round of that arm) or, without one, chosen on
//! the device by the rule ([`RoundArm::Auto`]), the same on every rank. A rank that is both
//! source and FFN rank runs both columns on its one stream: its front half ends with its
//! epilogue, which waits for every source's rows (its own were stored earlier on the stream),
//! and no rank's front half waits for another rank's back half, so the split cannot deadlock.
//!
//! An engine without [`FusedEngine::prepare_device`] gets its device-round buffers at its first
//! round (`prepare_host_rounds`: a source's capacity-sized input and output, no device
//! experts); device rounds still need [`FusedEngine::prepare_device`], which replaces them.

use afdep_core::bf16;
use afdep_core::oracle::exchange::{FfnReceived, SourceInput};
use afdep_kernels::cudarc::driver::CudaSlice;
use afdep_kernels::ops::fused_round::{self as fr, CTL_VERDICT, CTL_WORDS};
use std::time::{Duration, Instant};

use super::{Feed, HostY, Part, taken_arm};
use crate::error::ExchangeError;
use crate::fused::{CONTROL, FusedEngine, Phase, device_address, upload};
use crate::round::{ExpertFn, PhaseTimes, RoundArm, RoundOutput, apply_experts};

impl FusedEngine {
    /// Runs one round whose experts run on the host: attention ranks pass `Some(input)`,
    /// FFN-only ranks `None`; `expert` runs on FFN ranks. Collective: every rank of the topology
    /// calls it. The exchange is a [device round](super)'s, split once: every rank launches the
    /// round's start (validation, verdict, arm), counts, plan, rows and epilogue and waits for
    /// them; an FFN rank then reads back its expanded rows, applies `expert` to each local
    /// expert's rows in order (as the staged engine does) and uploads the outputs, which its
    /// partial sums read instead of device experts'; then the combine. The arm is
    /// [`FusedEngine::set_arm`]'s, else the rule's, chosen on the device
    /// ([`FusedEngine::last_arm`] after the round). A source's combine waits on the device
    /// while the FFN ranks' host experts run, bounded by the transport's timeout (as every wait
    /// of the round): experts that take longer make the sources fail with
    /// [`ExchangeError::DeviceTimeout`]. Needs no [`FusedEngine::prepare_device`]: without it
    /// the first round allocates the capacity-sized buffers it needs (no device experts), which
    /// a later [`FusedEngine::prepare_device`] replaces.
    ///
    /// A rejected route (or a non-finite fp8 row, or more tokens than the capacity) is
    /// [`ExchangeError::Route`] on every rank with the lowest rejecting rank's error, ranks that
    /// forced different arms all get [`ExchangeError::ArmsDiffer`], and the engine stays usable;
    /// so does a rank whose input does not fit its role ([`ExchangeError::Input`] there; a
    /// source's bad input rejects the round on every other rank, over capacity, an FFN-only
    /// rank given input takes part without it). Any other error (a late peer, an expert that
    /// returns the wrong number of values, which leaves the sources waiting for this rank's
    /// partials) closes the engine.
    ///
    /// [`RoundOutput::received`] holds what an FFN rank received (the plan its device computed,
    /// the expanded rows, the compact view), read from its workspace before its experts ran.
    /// [`RoundOutput::times`] are host wall times of this rank:
    /// - `counts`: the round's host preparation: the input copied to the device, the token
    ///   count and arm request written, the outputs poisoned, the front half's launches (the
    ///   status and counts phase itself runs on the device, inside `dispatch`); with phase or
    ///   round timing on also their barriers of every rank;
    /// - `dispatch`: the wait for this rank's front half (validation and status exchange,
    ///   counts, plan, rows, epilogue) and reading the verdict; on an FFN rank also reading back
    ///   what it received;
    /// - `experts`: an FFN rank's host experts and the upload of their outputs (zero elsewhere);
    /// - `combine`: the partial sums and the source's combine, launched and waited for, and the
    ///   combined rows read back; on a source this includes waiting (on the device, or with
    ///   phase timing on at its barrier) for the FFN ranks' host experts.
    ///
    /// With phase timing on ([`FusedEngine::set_phase_timing`]) the device spans are the front
    /// half (`dispatch`) and the back half (`combine`), each after a barrier of every rank.
    /// With round timing on ([`FusedEngine::set_round_timing`], possible once a first round or
    /// [`FusedEngine::prepare_device`] made the device-round state), the span of
    /// [`FusedEngine::last_round_time`] runs from the front half's first launch to the back
    /// half's last one, so it includes the host step between them (read-back, experts, upload).
    /// Likewise with tracing on ([`FusedEngine::set_trace`], possible under the same
    /// condition): the stamps are the device round's, so an FFN rank's `experts` span (from its
    /// epilogue's end stamp to its partial sums' end) holds its host step, and a source's
    /// `combine` span (from its rows' end stamp) holds its wait for the FFN ranks' host steps.
    pub fn round(
        &mut self,
        input: Option<&SourceInput>,
        expert: &dyn ExpertFn,
    ) -> Result<RoundOutput, ExchangeError> {
        self.guarded(|eng| eng.host_expert_round(input, expert))
    }

    /// [`FusedEngine::round`]'s body.
    fn host_expert_round(
        &mut self,
        input: Option<&SourceInput>,
        expert: &dyn ExpertFn,
    ) -> Result<RoundOutput, ExchangeError> {
        if self.device.is_none() {
            self.prepare_host_rounds()?;
        }
        let rank = self.rank();
        let ffn_index = self.cfg.topology.ffn_index(rank);
        let arm = self.arm.map_or(RoundArm::Auto, RoundArm::Fixed);
        if let Some(ev) = &mut self.events {
            ev.last = None;
        }
        let mut times = PhaseTimes::default();
        tracing::debug!(rank, %arm, "fused round, host experts");

        // 1., 2. the input, then the front half
        let t0 = Instant::now();
        let local = self.load_input(arm, Feed::Host(input), false)?;
        self.clear_trace(None)?;
        self.round_event(true)?;
        self.phase_start(Phase::Dispatch)?;
        self.launch_round(arm, Part::Front)?;
        self.phase_end(Phase::Dispatch)?;
        let t1 = Instant::now();
        times.counts = t1 - t0;

        // 3. the split: the front half done (bounded device waits), the verdict, host experts
        self.check_fault()?;
        let ctl: Vec<u32> = bytemuck::pod_collect_to_vec(&self.read_ws(CONTROL, 4 * CTL_WORDS)?);
        let go = ctl[CTL_VERDICT] == fr::verdict::GO;
        let mut received = None;
        let mut outputs = None;
        if let (true, Some(f)) = (go, ffn_index) {
            // mid-round: the sources wait for this rank's partials, so any error here (an
            // expert's wrong output size among them) leaves them waiting and closes the engine
            let step = match self.host_experts(f, &ctl, expert) {
                Ok(step) => step,
                Err(e) => {
                    self.closed.get_or_insert_with(|| e.to_string());
                    return Err(e);
                }
            };
            times.dispatch = t1.elapsed().saturating_sub(step.took);
            times.experts = step.took;
            outputs = Some((step.y, step.host_y));
            received = Some(step.received);
        } else {
            times.dispatch = t1.elapsed();
        }

        // 4. the back half (every rank alike skips it in a rejected round)
        let t3 = Instant::now();
        if go {
            self.phase_start(Phase::Combine)?;
            self.launch_round(arm, Part::Back(outputs.as_ref().map(|o| o.1)))?;
            self.phase_end(Phase::Combine)?;
        }
        self.round_event(false)?;
        let done = self.finish_round(arm, input, local, t0, received);
        // freed in stream order, after the partial sums that read it
        drop(outputs);
        let mut out = done?;
        times.combine = t3.elapsed();
        self.read_round_time(None)?;
        self.read_trace()?;
        if let Some(ev) = &mut self.events {
            ev.last = Some(ev.read()?);
        }
        out.times = times;
        Ok(out)
    }

    /// FFN rank `f`'s host step of [`FusedEngine::round`], after its front half completed with
    /// the control block `ctl` (verdict go): what it received (read from its workspace: the
    /// device plan, the expanded rows, the compact view from its slabs, which no source
    /// rewrites before this rank's combine flag), the experts' outputs uploaded (the buffer,
    /// and its address and rows for the partial sums), and the time the experts and the upload
    /// took.
    fn host_experts(
        &mut self,
        f: usize,
        ctl: &[u32],
        expert: &dyn ExpertFn,
    ) -> Result<HostStep, ExchangeError> {
        let rank = self.rank();
        let taken = taken_arm(rank, ctl)?;
        let slab = self.geo.slab();
        let read_slab = |r: usize, n: usize| {
            let off = slab.slab_off + r as u64 * u64::from(slab.cap) * slab.row_bytes;
            self.read_ws(off, n * slab.row_bytes as usize)
        };
        let rx = self.read_received(f, taken, &read_slab)?;
        let t = Instant::now();
        let rows = apply_experts(&self.cfg, rank, f, &rx.plan, &rx.expanded, expert)?;
        let n = rows.len() / self.cfg.hidden.max(1);
        let y = upload(&self.gpu, &rows)?;
        // the host rows outlive the copy
        self.gpu.synchronize()?;
        drop(rows);
        let host_y = HostY {
            y: device_address(&self.gpu, &y),
            rows: n,
        };
        Ok(HostStep {
            received: rx,
            y,
            host_y,
            took: t.elapsed(),
        })
    }
}

/// An FFN rank's host step of one round ([`FusedEngine::host_experts`]).
struct HostStep {
    /// What the rank received.
    received: FfnReceived,
    /// The experts' outputs on the device (freed after the round).
    y: CudaSlice<bf16>,
    /// Their address and rows, for the partial sums.
    host_y: HostY,
    /// The experts and the upload.
    took: Duration,
}
