//! Staged device rounds: the fused engine's half of the microbatch pipeline
//! ([`crate::pipeline`]).
//!
//! A pipeline runs several device rounds on one engine without waiting for the host between
//! them. A device round ([`FusedEngine::device_round`]) reads its input from fixed device
//! buffers and leaves its output, its control block and its trace stamps in fixed places, which
//! the next round overwrites; so a staged round goes through per-round **staging** buffers
//! allocated once ([`FusedEngine::prepare_staged`]): round `j` of a pipeline is
//!
//! 1. loaded from the host into staging area `j` before the pipeline starts
//!    ([`FusedEngine::load_staged`]: rows, routes, weights, the token count and the arm
//!    request, with [`FusedEngine::device_round`]'s checks of the input);
//! 2. queued ([`FusedEngine::enqueue_staged`]) on the engine's stream: device copies from
//!    staging area `j` into the round's fixed buffers and the control block, the poisoning of
//!    the outputs, the launches of [`FusedEngine::device_round`], then device copies of the
//!    source's output, the control block and the trace stamps into staging area `j`;
//! 3. read after the last round ([`FusedEngine::finish_staged`]): one wait for the stream, the
//!    error word, then per round the arm taken, the verdict, the output and the timeline.
//!
//! Stream order is all the ordering a staged round needs: its copies in come after the
//! previous round's kernels read the fixed buffers, its copies out before the next round's
//! poisoning. Nothing between the launches waits for the host, so the rounds of two engines on
//! one GPU (two streams) overlap on the device.

use afdep_core::bf16;
use afdep_core::oracle::exchange::SourceInput;
use afdep_kernels::KernelError;
use afdep_kernels::cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut, result as cures};
use afdep_kernels::ops::fused_round::{CTL_TOKENS, CTL_WORDS};
use afdep_kernels::ops::{download, zeros};
use afdep_transport::Transport;

use super::super::trace::{self, SLOTS};
use super::super::{CONTROL, FusedEngine};
use super::{bind, taken_arm, verdict};
use crate::error::ExchangeError;
use crate::round::{DispatchArm, RoundArm, RoundTrace, TracePhase};

/// The staging buffers of staged rounds: `rounds` areas, each of a capacity-sized round.
#[derive(Debug)]
pub(in crate::fused) struct StagedBufs {
    rounds: usize,
    /// Sources: rows, ids, weights in, combined rows out (`rounds × capacity` tokens).
    x: CudaSlice<bf16>,
    idx: CudaSlice<i32>,
    w: CudaSlice<f32>,
    out: CudaSlice<bf16>,
    /// The token count and the arm request of each round (2 words each).
    words: CudaSlice<u32>,
    /// The control block after each round (`CTL_WORDS` each).
    ctl: CudaSlice<u32>,
    /// The trace stamps of each round (`SLOTS` each).
    stamps: CudaSlice<u64>,
    /// Per loaded round: its token count, the rows copied, and the caller's input error.
    loaded: Vec<Loaded>,
    /// The phase order of the staged rounds' stamps (the same launches every round).
    order: Vec<TracePhase>,
    /// Rounds queued since the last [`FusedEngine::finish_staged`].
    queued: usize,
    traced: bool,
}

#[derive(Debug)]
struct Loaded {
    tokens: usize,
    rows: usize,
    local: Option<ExchangeError>,
}

/// One staged round's result on this rank ([`FusedEngine::finish_staged`]).
#[derive(Debug)]
pub(crate) struct StagedRound {
    /// Go (`Ok`), or the round's error (the same on every rank: a rejected route, arms that
    /// differ; or this rank's own input error).
    pub(crate) result: Result<(), ExchangeError>,
    /// The arm the device took.
    pub(crate) arm: DispatchArm,
    /// A source's combined rows (tokens × hidden) of a round that went.
    pub(crate) combined: Option<Vec<bf16>>,
    /// The round's timeline, with tracing on.
    pub(crate) trace: Option<RoundTrace>,
}

/// The device address of `buf` plus `elems` elements.
fn addr<T>(
    gpu: &afdep_kernels::GpuContext,
    buf: &CudaSlice<T>,
    elems: usize,
) -> Result<u64, ExchangeError> {
    if elems > buf.len() {
        return Err(KernelError::Unsupported(format!(
            "staging offset {elems} past a buffer of {}",
            buf.len()
        ))
        .into());
    }
    let (p, _guard) = buf.device_ptr(gpu.stream());
    Ok(p + (elems * std::mem::size_of::<T>()) as u64)
}

impl FusedEngine {
    /// Allocates the staging of up to `rounds` staged rounds (after
    /// [`FusedEngine::prepare_device`]; once: a second call with more rounds is an
    /// [`ExchangeError::Input`]). Collective (a barrier at the end, so that no rank allocates
    /// while another's kernels run).
    pub(crate) fn prepare_staged(&mut self, rounds: usize) -> Result<(), ExchangeError> {
        let rank = self.rank();
        self.check_device(RoundArm::Auto)?;
        let d = self.device.as_ref().expect("checked");
        if let Some(q) = &d.staging {
            if q.rounds >= rounds {
                self.transport.barrier()?;
                return Ok(());
            }
            return Err(ExchangeError::Input {
                rank,
                what: format!(
                    "staged rounds are prepared for {} rounds, {rounds} asked",
                    q.rounds
                ),
            });
        }
        let (h, k, cap) = (self.cfg.hidden, self.cfg.top_k, self.cfg.capacity);
        let src = d.src.is_some();
        let n = |per: usize| if src { (rounds * per).max(1) } else { 1 };
        let q = StagedBufs {
            rounds,
            x: zeros(&self.gpu, n(cap * h))?,
            idx: zeros(&self.gpu, n(cap * k))?,
            w: zeros(&self.gpu, n(cap * k))?,
            out: zeros(&self.gpu, n(cap * h))?,
            words: zeros(&self.gpu, 2 * rounds.max(1))?,
            ctl: zeros(&self.gpu, CTL_WORDS * rounds.max(1))?,
            stamps: zeros(&self.gpu, SLOTS * rounds.max(1))?,
            loaded: Vec::new(),
            order: Vec::new(),
            queued: 0,
            traced: false,
        };
        self.gpu.synchronize()?;
        self.device.as_mut().expect("checked").staging = Some(q);
        self.transport.barrier()?;
        Ok(())
    }

    /// Loads round `j`'s input into its staging area (the host copies; nothing is launched).
    /// `j` counts from 0 since the last [`FusedEngine::finish_staged`], in order. The input is
    /// checked as [`FusedEngine::device_round`] checks it: a source with input that does not
    /// fit gets its error back from [`FusedEngine::finish_staged`] and every rank's round is
    /// rejected.
    pub(crate) fn load_staged(
        &mut self,
        j: usize,
        arm: RoundArm,
        input: Option<&SourceInput>,
    ) -> Result<(), ExchangeError> {
        let rank = self.rank();
        self.check_open()?;
        self.check_device(arm)?;
        let (h, k, cap) = (self.cfg.hidden, self.cfg.top_k, self.cfg.capacity);
        let (tokens, rows, local) = self.input_tokens(input);
        let request = self.arm_request(arm);
        let d = self.device.as_mut().expect("checked");
        let q = d.staging.as_mut().ok_or_else(|| ExchangeError::Input {
            rank,
            what: "staged rounds need FusedEngine::prepare_staged first".into(),
        })?;
        if j != q.loaded.len() || j >= q.rounds {
            return Err(ExchangeError::Input {
                rank,
                what: format!(
                    "staged round {j} loaded after {} of at most {}",
                    q.loaded.len(),
                    q.rounds
                ),
            });
        }
        let s = self.gpu.stream();
        bind(&self.gpu)?;
        if rows > 0 {
            let inp = input.expect("rows to copy come from an input");
            let copies: [(&str, u64, &[u8]); 3] = [
                (
                    "the rows",
                    addr(&self.gpu, &q.x, j * cap * h)?,
                    bytemuck::cast_slice(&inp.x[..rows * h]),
                ),
                (
                    "the routes",
                    addr(&self.gpu, &q.idx, j * cap * k)?,
                    bytemuck::cast_slice(&inp.routes.idx[..rows * k]),
                ),
                (
                    "the weights",
                    addr(&self.gpu, &q.w, j * cap * k)?,
                    bytemuck::cast_slice(&inp.routes.weights[..rows * k]),
                ),
            ];
            for (what, dst, src) in copies {
                // SAFETY: `dst` is staging area j of a buffer of `rounds × capacity` tokens
                // (checked by `addr`), `src` holds at most a capacity of tokens; the host
                // buffer outlives the copy, which is waited for below.
                unsafe { cures::memcpy_htod_async(dst, src, s.cu_stream()) }
                    .map_err(KernelError::driver(format!("staging {what}")))?;
            }
        }
        let words = [tokens, request];
        let dst = addr(&self.gpu, &q.words, 2 * j)?;
        // SAFETY: round j's two words of the staging buffer (checked by `addr`); `words`
        // outlives the copy, which is waited for below.
        unsafe { cures::memcpy_htod_async(dst, &words, s.cu_stream()) }
            .map_err(KernelError::driver("staging the token count"))?;
        self.gpu.synchronize()?;
        q.loaded.push(Loaded {
            tokens: tokens as usize,
            rows,
            local,
        });
        Ok(())
    }

    /// Queues loaded round `j` on this rank's stream: the device copies in, the poisoning, the
    /// launches of a device round of `arm`, the device copies out ([module docs](self)). No
    /// host wait. Collective, like a round: every rank queues its rounds in the same order.
    pub(crate) fn enqueue_staged(&mut self, j: usize, arm: RoundArm) -> Result<(), ExchangeError> {
        self.guarded(|eng| eng.enqueue_inner(j, arm))
    }

    fn enqueue_inner(&mut self, j: usize, arm: RoundArm) -> Result<(), ExchangeError> {
        let rank = self.rank();
        let (h, k, cap) = (self.cfg.hidden, self.cfg.top_k, self.cfg.capacity);
        bind(&self.gpu)?;
        let cs = self.gpu.stream().cu_stream();
        let d = self.device.as_mut().expect("checked at load");
        let q = d.staging.as_mut().expect("checked at load");
        if j != q.queued || j >= q.loaded.len() {
            return Err(ExchangeError::Input {
                rank,
                what: format!(
                    "staged round {j} queued after {} of {} loaded",
                    q.queued,
                    q.loaded.len()
                ),
            });
        }
        let rows = q.loaded[j].rows;
        // 1. copies in: rows, routes, weights; the token count and the arm request
        if let Some(b) = d.src.as_mut() {
            if rows > 0 {
                let copies = [
                    (
                        b.x.device_ptr_mut(self.gpu.stream()).0,
                        addr(&self.gpu, &q.x, j * cap * h)?,
                        2 * rows * h,
                    ),
                    (
                        b.idx.device_ptr_mut(self.gpu.stream()).0,
                        addr(&self.gpu, &q.idx, j * cap * k)?,
                        4 * rows * k,
                    ),
                    (
                        b.w.device_ptr_mut(self.gpu.stream()).0,
                        addr(&self.gpu, &q.w, j * cap * k)?,
                        4 * rows * k,
                    ),
                ];
                for (dst, src, bytes) in copies {
                    // SAFETY: both are buffers of this context holding at least `bytes`
                    // (capacity-sized round buffers, staging area j checked by `addr`); the
                    // copy is ordered on this rank's stream.
                    unsafe { cures::memcpy_dtod_async(dst, src, bytes, cs) }
                        .map_err(KernelError::driver("copying a staged round's input"))?;
                }
            }
        }
        let words = addr(&self.gpu, &q.words, 2 * j)?;
        // SAFETY: the control block's token and request words lie in this rank's workspace (the
        // geometry fits it, checked at set-up); the source is round j's two staged words.
        unsafe {
            cures::memcpy_dtod_async(self.ws + CONTROL + 4 * CTL_TOKENS as u64, words, 8, cs)
        }
        .map_err(KernelError::driver("copying a staged round's token count"))?;
        // 2. poisoning, the stamps cleared, the launches
        self.poison_round(arm)?;
        let traced = match self.device.as_mut().and_then(|d| d.trace.as_mut()) {
            Some(t) if t.on => {
                t.clear(&self.gpu)?;
                true
            }
            _ => false,
        };
        self.launch_device_round(arm)?;
        // 3. copies out: the output, the control block, the stamps
        let d = self.device.as_mut().expect("checked at load");
        let q = d.staging.as_mut().expect("checked at load");
        let mut out = Vec::with_capacity(3);
        if let Some(b) = d.src.as_ref() {
            if rows > 0 {
                let (p, _g) = b.out.device_ptr(self.gpu.stream());
                out.push((addr(&self.gpu, &q.out, j * cap * h)?, p, 2 * rows * h));
            }
        }
        out.push((
            addr(&self.gpu, &q.ctl, j * CTL_WORDS)?,
            self.ws + CONTROL,
            4 * CTL_WORDS,
        ));
        if let Some(t) = d.trace.as_ref().filter(|_| traced) {
            out.push((
                addr(&self.gpu, &q.stamps, j * SLOTS)?,
                t.stamps_address(&self.gpu),
                8 * SLOTS,
            ));
            q.order.clone_from(&t.order);
        }
        for (dst, src, bytes) in out {
            // SAFETY: `src` is the round's output buffer, this rank's control block (in its
            // workspace, checked at set-up) or the stamp buffer, each holding `bytes`; `dst` is
            // staging area j (checked by `addr`); the copy is ordered on this rank's stream
            // after the round's launches.
            unsafe { cures::memcpy_dtod_async(dst, src, bytes, cs) }
                .map_err(KernelError::driver("copying a staged round's results"))?;
        }
        q.traced = traced;
        q.queued += 1;
        Ok(())
    }

    /// After the last staged round: waits for this rank's stream, checks the error word (a
    /// fault closes the engine, as in a round) and reads every staged round's result, in
    /// order; the staging is then free for the next pipeline.
    pub(crate) fn finish_staged(&mut self) -> Result<Vec<StagedRound>, ExchangeError> {
        let rank = self.rank();
        let r = self.guarded(|eng| {
            eng.check_fault()?;
            eng.gpu.take_fault()?;
            let (h, cap) = (eng.cfg.hidden, eng.cfg.capacity);
            let d = eng.device.as_mut().expect("checked at load");
            let is_src = d.src.is_some();
            let q = d.staging.as_mut().ok_or_else(|| ExchangeError::Input {
                rank,
                what: "staged rounds need FusedEngine::prepare_staged first".into(),
            })?;
            let n = q.queued;
            let loaded = std::mem::take(&mut q.loaded);
            if n == 0 {
                return Ok(Vec::new());
            }
            let ctl: Vec<u32> = download(&eng.gpu, &q.ctl)?;
            let stamps: Vec<u64> = match q.traced {
                true => download(&eng.gpu, &q.stamps)?,
                false => Vec::new(),
            };
            let mut rounds = Vec::with_capacity(n);
            for (j, l) in loaded.into_iter().take(n).enumerate() {
                let c = &ctl[j * CTL_WORDS..(j + 1) * CTL_WORDS];
                let arm = taken_arm(rank, c)?;
                let result = match l.local {
                    Some(e) => Err(e),
                    None => verdict(rank, c),
                };
                let combined = match (&result, is_src) {
                    (Ok(()), true) => {
                        // only the round's rows of its staging area
                        let (at, n) = (j * cap * h, l.tokens.min(cap) * h);
                        let mut rows = vec![bf16::ZERO; n];
                        if n > 0 {
                            eng.gpu
                                .stream()
                                .memcpy_dtoh(&q.out.slice(at..at + n), &mut rows)
                                .map_err(KernelError::driver("reading a staged round's output"))?;
                            eng.gpu.synchronize()?;
                        }
                        Some(rows)
                    }
                    _ => None,
                };
                let trace = match q.traced {
                    true => Some(trace::checked(
                        rank,
                        &q.order,
                        &stamps[j * SLOTS..j * SLOTS + q.order.len() + 1],
                    )?),
                    false => None,
                };
                rounds.push(StagedRound {
                    result,
                    arm,
                    combined,
                    trace,
                });
            }
            eng.round = eng.round.wrapping_add(n as u32);
            if let Some(last) = rounds.last() {
                eng.last_arm = last.arm;
            }
            Ok(rounds)
        });
        // the staging is free again, whatever happened
        self.clear_staged();
        r
    }

    /// Forgets the loaded and staged rounds (after [`FusedEngine::finish_staged`], or instead
    /// of it when nothing was queued).
    pub(crate) fn clear_staged(&mut self) {
        if let Some(q) = self.device.as_mut().and_then(|d| d.staging.as_mut()) {
            q.loaded.clear();
            q.queued = 0;
            q.traced = false;
        }
    }

    /// The engine's GPU context (its one stream: the pipeline orders its slots' streams).
    pub(crate) fn gpu(&self) -> &afdep_kernels::GpuContext {
        &self.gpu
    }
}
