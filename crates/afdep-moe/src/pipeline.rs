//! The microbatch pipeline (issue 19 item 3): attention ranks split their tokens into M
//! microbatches and send microbatch i+1 while the FFN ranks run their experts on microbatch i.
//!
//! # How it runs
//!
//! Each rank holds K **slots**: K fused engines ([`FusedEngine`]) of the same configuration,
//! each over its own NvlinkIpc group (its own symmetric workspace, flags and control block)
//! and with its own CUDA stream, all prepared for device rounds
//! ([`FusedEngine::prepare_device`]). Microbatch `i` runs as one device round on slot
//! `i % K`. A [`PipelineRank::run`]:
//!
//! 1. splits this rank's tokens into M microbatches ([`split_tokens`]: contiguous, the first
//!    `tokens % M` one token larger; an attention rank with fewer tokens than M, or none, has
//!    empty microbatches, which still take part in their rounds) and loads every microbatch's
//!    input into its slot's staging area (host copies, before anything is launched);
//! 2. with timing on, waits at a barrier of every rank and records a CUDA event on slot 0's
//!    stream, which every other slot's stream waits for;
//! 3. queues the microbatches in order, each on its slot's stream: copies from the staging into
//!    the round's buffers, the device round's launches (validation, counts, rows, epilogue,
//!    experts, combine: [`crate::fused::device_round`]), copies of the output out. **No host
//!    wait between them**: the host issues everything, and the GPU overlaps microbatch i+1's
//!    dispatch on one slot's stream with microbatch i's experts on the other's;
//! 4. with timing on, joins every slot's stream into slot 0's (events) and records the stop
//!    event: [`PipelineOutput::layer_time`] is this rank's span from the start to the end of
//!    its last combine, its waits for its peers included; the layer's time is the largest over
//!    the ranks;
//! 5. waits for every slot, checks faults, and concatenates the microbatches' combined rows.
//!
//! The only dependencies are the true ones: within a slot, round i+K follows round i on the
//! slot's stream (it reuses the slot's buffers, workspace and flags); across slots nothing
//! waits, since microbatches share no data. Every device wait is the fused engine's bounded
//! flag wait with its fault word; a fault fails the run with the engine's
//! [`ExchangeError::DeviceTimeout`].
//!
//! **Sequential rounds** are the same run with one slot ([`PipelineConfig::sequential`]): the M
//! rounds back to back on one stream, no host wait between them either; so the pipeline's gain
//! is measured against the same launches, and its results are bit-identical to them: a
//! microbatch's round is the same device round whichever slot runs it (the rows of one round
//! are computed by the same kernels over the same inputs; slots share no state).
//!
//! # Results
//!
//! An attention rank's [`PipelineOutput::combined`] is the concatenation of its microbatches'
//! combined rows, in token order: bit-identical to one device round per microbatch
//! ([`FusedEngine::device_round`]) and, for [`crate::DeviceExperts::Scale`] and
//! [`crate::DeviceExperts::Identity`], to the oracle's exchange of each microbatch. A rejected
//! route in any microbatch fails the run on every rank with that microbatch's error (the lowest
//! rejected microbatch, [`PipelineError::Round`]); the engines stay usable.
//!
//! # FFN busy fraction
//!
//! With tracing on ([`PipelineRank::set_trace`]), each microbatch's round stamps its phases on
//! the device timer ([`RoundTrace`]); [`busy_fraction`] gives, per FFN rank, the union of its
//! experts spans ([`TracePhase::Experts`]: the expert GEMMs, the combine's partial sums and the
//! combine flags) over the layer's window (first stamp of any rank to last stamp of any rank,
//! on the `%globaltimer` every rank of one GPU shares).

use std::ops::Range;
use std::time::Duration;

use afdep_core::bf16;
use afdep_core::oracle::exchange::SourceInput;
use afdep_core::route::Routes;
use afdep_kernels::KernelError;
use afdep_kernels::cudarc::driver::{CudaEvent, sys};
use afdep_transport::Transport;
use thiserror::Error;

use crate::error::ExchangeError;
use crate::fused::FusedEngine;
use crate::round::{RoundArm, RoundTrace, TracePhase};

/// The most microbatches of one run.
pub const MAX_MICROBATCHES: usize = 256;

/// How a pipeline run splits and places its rounds: M microbatches over K slots (microbatch i
/// on slot i % K). One slot is sequential rounds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PipelineConfig {
    microbatches: usize,
    slots: usize,
}

impl PipelineConfig {
    /// M microbatches over K slots: `1 ≤ M ≤` [`MAX_MICROBATCHES`], `1 ≤ K`; K above M is
    /// lowered to M (a slot without a microbatch does nothing).
    pub fn new(microbatches: usize, slots: usize) -> Result<PipelineConfig, PipelineError> {
        if microbatches == 0 || microbatches > MAX_MICROBATCHES {
            return Err(PipelineError::Config(format!(
                "{microbatches} microbatches: between 1 and {MAX_MICROBATCHES}"
            )));
        }
        if slots == 0 {
            return Err(PipelineError::Config("0 slots: at least 1".into()));
        }
        Ok(PipelineConfig {
            microbatches,
            slots: slots.min(microbatches),
        })
    }

    /// M microbatches as sequential rounds (one slot).
    pub fn sequential(microbatches: usize) -> Result<PipelineConfig, PipelineError> {
        PipelineConfig::new(microbatches, 1)
    }

    /// M.
    pub fn microbatches(&self) -> usize {
        self.microbatches
    }

    /// K.
    pub fn slots(&self) -> usize {
        self.slots
    }

    /// The slot of microbatch `i` and its index among that slot's rounds.
    pub fn place(&self, i: usize) -> (usize, usize) {
        (i % self.slots, i / self.slots)
    }

    /// The most rounds one slot runs: ⌈M / K⌉.
    pub fn rounds_per_slot(&self) -> usize {
        self.microbatches.div_ceil(self.slots)
    }
}

/// Why a pipeline run or its set-up failed.
#[derive(Debug, Error)]
pub enum PipelineError {
    /// The pipeline's configuration is invalid.
    #[error("pipeline: {0}")]
    Config(String),
    /// The slots do not form a pipeline rank (none, different ranks, configurations or
    /// devices, not prepared for device rounds).
    #[error("pipeline rank {rank}: {what}")]
    Slots {
        /// The rank.
        rank: usize,
        /// What is wrong.
        what: String,
    },
    /// A microbatch's round failed: the lowest failing microbatch (a rejected route, arms that
    /// differ, this rank's input). The same on every rank for rejections.
    #[error("microbatch {microbatch}: {source}")]
    Round {
        /// The microbatch.
        microbatch: usize,
        /// Its round's error.
        #[source]
        source: Box<ExchangeError>,
    },
    /// An engine failed outside a round's verdict (a device timeout, a driver error); the
    /// engine is closed.
    #[error(transparent)]
    Exchange(Box<ExchangeError>),
}

impl From<ExchangeError> for PipelineError {
    fn from(e: ExchangeError) -> Self {
        PipelineError::Exchange(Box::new(e))
    }
}

impl From<KernelError> for PipelineError {
    fn from(e: KernelError) -> Self {
        ExchangeError::from(e).into()
    }
}

/// The token ranges of `m` microbatches of `tokens` tokens: contiguous, in order, covering
/// every token; the first `tokens % m` ranges one token longer than the others (empty ranges
/// when `tokens < m`). `m` is at least 1.
pub fn split_tokens(tokens: usize, m: usize) -> Vec<Range<usize>> {
    let m = m.max(1);
    let (q, r) = (tokens / m, tokens % m);
    let mut at = 0;
    (0..m)
        .map(|i| {
            let n = q + usize::from(i < r);
            let range = at..at + n;
            at += n;
            range
        })
        .collect()
}

/// `input`'s tokens `range` (rows, routes and weights) as one microbatch's input.
pub fn microbatch(input: &SourceInput, range: Range<usize>) -> SourceInput {
    let (h, k) = (
        input.x.len() / input.routes.tokens.max(1),
        input.routes.top_k,
    );
    let rows = |r: &Range<usize>, w: usize| r.start * w..r.end * w;
    SourceInput {
        x: input.x[rows(&range, h)].to_vec(),
        routes: Routes {
            tokens: range.len(),
            top_k: k,
            idx: input.routes.idx[rows(&range, k)].to_vec(),
            weights: input.routes.weights[rows(&range, k)].to_vec(),
        },
    }
}

/// Whether `input`'s rows, ids and weights have its token count's lengths (hidden `hidden`).
fn well_formed(input: &SourceInput, hidden: usize) -> bool {
    let (t, k) = (input.routes.tokens, input.routes.top_k);
    input.x.len() == t * hidden
        && input.routes.idx.len() == t * k
        && input.routes.weights.len() == t * k
}

/// What one rank gets from a pipeline run.
#[derive(Debug, Clone, PartialEq)]
pub struct PipelineOutput {
    /// Attention ranks: the combined rows of all their tokens (tokens × hidden), the
    /// microbatches' outputs concatenated in token order.
    pub combined: Option<Vec<bf16>>,
    /// This rank's token ranges, by microbatch (empty for FFN-only ranks).
    pub microbatches: Vec<Range<usize>>,
    /// With timing on: this rank's span from the start event (after the barrier) to the end of
    /// its last microbatch on every slot.
    pub layer_time: Option<Duration>,
    /// With tracing on: every microbatch's timeline on this rank, by microbatch.
    pub traces: Vec<RoundTrace>,
}

/// One rank of the pipeline: its slots ([module docs](self)).
pub struct PipelineRank {
    slots: Vec<FusedEngine>,
    max_microbatches: usize,
    /// Timing events (on slot 0's context): start, stop, and one join per other slot.
    timer: Option<Timer>,
}

struct Timer {
    start: CudaEvent,
    stop: CudaEvent,
    joins: Vec<CudaEvent>,
}

impl std::fmt::Debug for PipelineRank {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PipelineRank")
            .field("slots", &self.slots)
            .field("max_microbatches", &self.max_microbatches)
            .field("timing", &self.timer.is_some())
            .finish()
    }
}

impl PipelineRank {
    /// A pipeline rank of `slots` (at least one; the same rank, configuration and device, each
    /// prepared for device rounds with the same experts) for runs of up to `max_microbatches`.
    /// Allocates every slot's staging for that many rounds. Collective: every rank calls it
    /// with as many slots.
    pub fn new(
        slots: Vec<FusedEngine>,
        max_microbatches: usize,
    ) -> Result<PipelineRank, PipelineError> {
        let Some(first) = slots.first() else {
            return Err(PipelineError::Slots {
                rank: 0,
                what: "no slot".into(),
            });
        };
        let rank = first.rank();
        PipelineConfig::new(max_microbatches, 1)?;
        for (s, e) in slots.iter().enumerate().skip(1) {
            let why = if e.rank() != rank {
                Some(format!("slot {s} is rank {}", e.rank()))
            } else if e.config() != first.config() {
                Some(format!("slot {s}'s configuration differs from slot 0's"))
            } else if e.gpu().ordinal() != first.gpu().ordinal() {
                Some(format!(
                    "slot {s} is on device {}, slot 0 on {}",
                    e.gpu().ordinal(),
                    first.gpu().ordinal()
                ))
            } else {
                None
            };
            if let Some(what) = why {
                return Err(PipelineError::Slots { rank, what });
            }
        }
        let mut slots = slots;
        let several = slots.len() > 1;
        for e in &mut slots {
            // every slot may run every microbatch (one slot: sequential rounds)
            e.prepare_staged(max_microbatches)?;
            // with several slots, the sources' combines wait in one block
            // (`FusedEngine::set_combine_prewait`: the slots' waiting grids beside the FFN
            // ranks' GEMMs on one GPU)
            e.set_combine_prewait(several);
        }
        Ok(PipelineRank {
            slots,
            max_microbatches,
            timer: None,
        })
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.slots[0].rank()
    }

    /// The slots' engines.
    pub fn slots(&self) -> &[FusedEngine] {
        &self.slots
    }

    /// The slots' engines, mutable (settings: [`FusedEngine::set_poison`],
    /// [`FusedEngine::set_arm`]).
    pub fn slots_mut(&mut self) -> &mut [FusedEngine] {
        &mut self.slots
    }

    /// Gives the engines back.
    pub fn into_slots(self) -> Vec<FusedEngine> {
        self.slots
    }

    /// Turns timing of runs on or off ([`PipelineOutput::layer_time`]): a barrier of every
    /// rank before each run, CUDA events around it. Collective in effect (the barrier): every
    /// rank must set the same. Creates the events now, outside any run.
    pub fn set_timing(&mut self, on: bool) -> Result<(), PipelineError> {
        self.timer = None;
        if !on {
            return Ok(());
        }
        let gpu = self.slots[0].gpu();
        let ev = || {
            gpu.cuda()
                .new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
                .map_err(KernelError::driver("creating a pipeline event"))
        };
        self.timer = Some(Timer {
            start: ev()?,
            stop: ev()?,
            joins: (1..self.slots.len())
                .map(|_| ev())
                .collect::<Result<_, _>>()?,
        });
        Ok(())
    }

    /// Turns tracing on every slot on or off ([`FusedEngine::set_trace`]; the timelines come
    /// back in [`PipelineOutput::traces`]).
    pub fn set_trace(&mut self, on: bool) -> Result<(), PipelineError> {
        for e in &mut self.slots {
            e.set_trace(on)?;
        }
        Ok(())
    }

    /// Runs one MoE layer step's exchange as `pc.microbatches()` microbatches over
    /// `pc.slots()` slots ([module docs](self)), every round of `arm`. Attention ranks pass
    /// `Some(input)`; FFN-only ranks `None`. Collective: every rank passes the same `pc` and
    /// `arm`.
    pub fn run(
        &mut self,
        pc: PipelineConfig,
        arm: impl Into<RoundArm>,
        input: Option<&SourceInput>,
    ) -> Result<PipelineOutput, PipelineError> {
        let arm = arm.into();
        let rank = self.rank();
        let m = pc.microbatches();
        if pc.slots() > self.slots.len() || m > self.max_microbatches {
            return Err(PipelineError::Config(format!(
                "{m} microbatches over {} slots: this rank has {} slots for up to {} microbatches",
                pc.slots(),
                self.slots.len(),
                self.max_microbatches
            )));
        }
        let hidden = self.slots[0].config().hidden;
        // 1. the microbatches, loaded into their slots' staging
        let (ranges, parts): (Vec<Range<usize>>, Vec<Option<SourceInput>>) = match input {
            Some(inp) if well_formed(inp, hidden) => {
                let r = split_tokens(inp.routes.tokens, m);
                let p = r.iter().map(|r| Some(microbatch(inp, r.clone()))).collect();
                (r, p)
            }
            // malformed: every microbatch gets it whole (every round is rejected everywhere,
            // this rank returns its input error)
            Some(inp) => (Vec::new(), vec![Some(inp.clone()); m]),
            None => (Vec::new(), vec![None; m]),
        };
        for (i, part) in parts.iter().enumerate() {
            let (s, j) = pc.place(i);
            if let Err(e) = self.slots[s].load_staged(j, arm, part.as_ref()) {
                for e in &mut self.slots {
                    e.clear_staged();
                }
                return Err(e.into());
            }
        }
        // 2. the start, 3. every microbatch queued, 4. the join
        if let Some(t) = &self.timer {
            self.slots[0]
                .transport_mut()
                .barrier()
                .map_err(ExchangeError::from)?;
            let s0 = self.slots[0].gpu().stream();
            t.start
                .record(s0)
                .map_err(KernelError::driver("recording the pipeline start"))?;
            for e in &self.slots[1..pc.slots()] {
                e.gpu()
                    .stream()
                    .wait(&t.start)
                    .map_err(KernelError::driver("waiting for the pipeline start"))?;
            }
        }
        for i in 0..m {
            let (s, j) = pc.place(i);
            self.slots[s].enqueue_staged(j, arm)?;
        }
        if let Some(t) = &self.timer {
            let s0 = self.slots[0].gpu().stream();
            for (e, join) in self.slots[1..pc.slots()].iter().zip(&t.joins) {
                join.record(e.gpu().stream())
                    .map_err(KernelError::driver("recording a slot's end"))?;
                s0.wait(join)
                    .map_err(KernelError::driver("joining a slot"))?;
            }
            t.stop
                .record(s0)
                .map_err(KernelError::driver("recording the pipeline stop"))?;
        }
        // 5. every slot waited for and read (all of them, whatever fails)
        let finished: Vec<_> = self
            .slots
            .iter_mut()
            .take(pc.slots())
            .map(|e| e.finish_staged())
            .collect();
        let mut per_slot = Vec::with_capacity(finished.len());
        for f in finished {
            per_slot.push(f?.into_iter());
        }
        let mut combined: Option<Vec<bf16>> = input.map(|_| Vec::new());
        let mut traces = Vec::new();
        let mut first_err = None;
        for i in 0..m {
            let (s, _) = pc.place(i);
            let r = per_slot[s].next().ok_or_else(|| ExchangeError::Input {
                rank,
                what: format!("microbatch {i}'s round is missing from slot {s}"),
            })?;
            if let Err(e) = r.result {
                // the first fails the run; the later ones are logged (a slot's timeout may
                // follow another microbatch's fault)
                if first_err.is_some() {
                    tracing::error!(rank, microbatch = i, slot = s, error = %e, "a later microbatch failed too");
                }
                first_err.get_or_insert(PipelineError::Round {
                    microbatch: i,
                    source: Box::new(e),
                });
                continue;
            }
            if let (Some(all), Some(rows)) = (combined.as_mut(), r.combined) {
                all.extend(rows);
            }
            traces.extend(r.trace);
        }
        if let Some(e) = first_err {
            return Err(e);
        }
        let layer_time = match &self.timer {
            Some(t) => {
                let ms = t
                    .start
                    .elapsed_ms(&t.stop)
                    .map_err(KernelError::driver("reading the pipeline events"))?;
                Some(Duration::from_secs_f64(f64::from(ms.max(0.0)) * 1e-3))
            }
            None => None,
        };
        Ok(PipelineOutput {
            combined,
            microbatches: ranges,
            layer_time,
            traces,
        })
    }
}

/// The busy fraction of some ranks in a window of timelines ([`busy_fraction`]).
#[derive(Debug, Clone, PartialEq)]
pub struct Busy {
    /// The window: the first stamp of any timeline to the last, ns.
    pub window_ns: u64,
    /// Per rank asked for: the union of its spans of the phase over the window, in [0, 1].
    pub per_rank: Vec<(usize, f64)>,
}

impl Busy {
    /// The mean over the ranks (0 for none).
    pub fn mean(&self) -> f64 {
        if self.per_rank.is_empty() {
            return 0.0;
        }
        self.per_rank.iter().map(|(_, b)| b).sum::<f64>() / self.per_rank.len() as f64
    }
}

/// The busy fraction of `ranks` in `phase` over the window of `traces` (every rank's timelines
/// of one run, on one timer): the window runs from the earliest stamp to the latest of any
/// timeline; a rank's busy time is the union of its spans of `phase` (overlapping spans of two
/// slots count once). `None` when the timelines are empty or span no time.
pub fn busy_fraction(traces: &[RoundTrace], ranks: &[usize], phase: TracePhase) -> Option<Busy> {
    let start = traces.iter().filter_map(RoundTrace::start_ns).min()?;
    let end = traces.iter().filter_map(RoundTrace::end_ns).max()?;
    let window_ns = end.checked_sub(start).filter(|&w| w > 0)?;
    let per_rank = ranks
        .iter()
        .map(|&r| {
            let mut spans: Vec<(u64, u64)> = traces
                .iter()
                .filter(|t| t.rank == r)
                .flat_map(|t| t.spans.iter())
                .filter(|s| s.phase == phase && s.end_ns > s.start_ns)
                .map(|s| (s.start_ns, s.end_ns))
                .collect();
            spans.sort_unstable();
            let (mut busy, mut cur): (u64, Option<(u64, u64)>) = (0, None);
            for (a, b) in spans {
                cur = match cur {
                    Some((ca, cb)) if a <= cb => Some((ca, cb.max(b))),
                    Some((ca, cb)) => {
                        busy += cb - ca;
                        Some((a, b))
                    }
                    None => Some((a, b)),
                };
            }
            if let Some((ca, cb)) = cur {
                busy += cb - ca;
            }
            (r, busy as f64 / window_ns as f64)
        })
        .collect();
    Some(Busy {
        window_ns,
        per_rank,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::round::PhaseSpan;

    #[test]
    fn splits_cover_every_token_in_order_larger_first() {
        for tokens in [0usize, 1, 2, 3, 7, 8, 9, 1000, 2047] {
            for m in [1usize, 2, 3, 4, 5, 8] {
                let r = split_tokens(tokens, m);
                assert_eq!(r.len(), m);
                assert_eq!(r[0].start, 0);
                assert_eq!(r[m - 1].end, tokens);
                for w in r.windows(2) {
                    assert_eq!(w[0].end, w[1].start, "contiguous");
                    assert!(w[0].len() >= w[1].len(), "larger first");
                    assert!(w[0].len() - w[1].len() <= 1, "balanced");
                }
                let longer = r.iter().filter(|x| x.len() == tokens / m + 1).count();
                assert_eq!(longer, tokens % m, "{tokens} over {m}");
            }
        }
        assert_eq!(split_tokens(7, 4), vec![0..2, 2..4, 4..6, 6..7]);
        assert_eq!(split_tokens(2, 4), vec![0..1, 1..2, 2..2, 2..2]);
        assert_eq!(
            split_tokens(5, 0),
            vec![0..5],
            "m below 1 is one microbatch"
        );
    }

    #[test]
    fn microbatches_concatenate_to_the_input() {
        let (t, h, k) = (7usize, 3usize, 2usize);
        let input = SourceInput {
            x: (0..t * h).map(|i| bf16::from_f32(i as f32)).collect(),
            routes: Routes {
                tokens: t,
                top_k: k,
                idx: (0..(t * k) as i32).collect(),
                weights: (0..t * k).map(|i| i as f32 * 0.5).collect(),
            },
        };
        for m in [1, 2, 3, 4, 7, 9] {
            let parts: Vec<SourceInput> = split_tokens(t, m)
                .into_iter()
                .map(|r| microbatch(&input, r))
                .collect();
            let x: Vec<bf16> = parts.iter().flat_map(|p| p.x.clone()).collect();
            let idx: Vec<i32> = parts.iter().flat_map(|p| p.routes.idx.clone()).collect();
            let w: Vec<f32> = parts
                .iter()
                .flat_map(|p| p.routes.weights.clone())
                .collect();
            assert_eq!(x, input.x);
            assert_eq!(idx, input.routes.idx);
            assert_eq!(w, input.routes.weights);
            for p in &parts {
                assert!(well_formed(p, h));
                assert_eq!(p.routes.top_k, k);
            }
        }
        let mut bad = input.clone();
        bad.x.pop();
        assert!(!well_formed(&bad, h));
    }

    #[test]
    fn configs_place_microbatches_round_robin() {
        let pc = PipelineConfig::new(5, 2).unwrap();
        let places: Vec<_> = (0..5).map(|i| pc.place(i)).collect();
        assert_eq!(places, vec![(0, 0), (1, 0), (0, 1), (1, 1), (0, 2)]);
        assert_eq!(pc.rounds_per_slot(), 3);
        let seq = PipelineConfig::sequential(4).unwrap();
        assert_eq!((seq.slots(), seq.rounds_per_slot()), (1, 4));
        assert_eq!(
            PipelineConfig::new(1, 2).unwrap().slots(),
            1,
            "K lowered to M"
        );
        assert!(PipelineConfig::new(0, 2).is_err());
        assert!(PipelineConfig::new(2, 0).is_err());
        assert!(PipelineConfig::new(MAX_MICROBATCHES + 1, 2).is_err());
    }

    fn tl(rank: usize, spans: &[(TracePhase, u64, u64)]) -> RoundTrace {
        RoundTrace {
            rank,
            spans: spans
                .iter()
                .map(|&(phase, start_ns, end_ns)| PhaseSpan {
                    phase,
                    start_ns,
                    end_ns,
                })
                .collect(),
        }
    }

    #[test]
    fn busy_fraction_is_the_union_of_spans_over_the_window() {
        use TracePhase::{Begin, Combine, Epilogue, Experts};
        let traces = vec![
            // source rank 0: the window's start (100) and end (1100)
            tl(0, &[(Begin, 100, 200), (Combine, 200, 1100)]),
            // FFN rank 1, two slots' rounds whose experts overlap (300..600 and 500..700)
            tl(1, &[(Epilogue, 150, 300), (Experts, 300, 600)]),
            tl(1, &[(Epilogue, 400, 500), (Experts, 500, 700)]),
            // FFN rank 2: disjoint experts spans, 100 + 200 ns
            tl(2, &[(Experts, 200, 300)]),
            tl(2, &[(Experts, 800, 1000), (Begin, 1000, 1000)]),
        ];
        let b = busy_fraction(&traces, &[1, 2], Experts).unwrap();
        assert_eq!(b.window_ns, 1000);
        assert_eq!(b.per_rank, vec![(1, 0.4), (2, 0.3)]);
        assert!((b.mean() - 0.35).abs() < 1e-12);
        let none = busy_fraction(&traces, &[0], Experts).unwrap();
        assert_eq!(none.per_rank, vec![(0, 0.0)]);
        assert!(busy_fraction(&[], &[1], Experts).is_none());
        assert!(busy_fraction(&[tl(0, &[(Begin, 5, 5)])], &[0], Begin).is_none());
        // a span contained in another counts once
        let nested = [tl(3, &[(Experts, 0, 100)]), tl(3, &[(Experts, 10, 20)])];
        assert_eq!(
            busy_fraction(&nested, &[3], Experts).unwrap().per_rank,
            vec![(3, 1.0)]
        );
    }
}
