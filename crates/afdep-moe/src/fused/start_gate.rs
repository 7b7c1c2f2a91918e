//! A start gate for the device rounds of an in-process group whose ranks share one CUDA context
//! (ranks emulated on one GPU): [`StartGate`], [`FusedEngine::set_start_gate`].
//!
//! Without it, each rank's round starts on the device when that rank's host queued it. Ranks
//! emulated on one GPU are threads of one process that queue their graphs into one context,
//! and the driver serialises those launches: the quiet 1-token traces of 2026-12-07 put 30–60
//! µs between the first rank's start and the last one's, a third to a half of the round, while
//! the first ranks' kernels wait for the late ones (`docs/perf/exchange.md`, "Where the 1-token
//! round goes now"). In a serving step the host queues work ahead of the GPU, so a rank's
//! round starts when its previous kernel ends, not when its host launched it; the gate
//! reproduces that for a benchmark or a test of emulated ranks.
//!
//! With a gate set, a device round (eager or a graph replay) queues one more kernel on the
//! rank's stream before the round's launches: it holds them until the gate's device word
//! reaches this round's ticket (`afdep_round_start_gate`, a bounded wait). Once every rank has
//! queued its round (a control-plane barrier), rank 0 writes the ticket into the word on a
//! stream of its own, and every rank's round starts within one device poll of the others. The
//! round's device time ([`FusedEngine::set_round_timing`]) starts after the gate, so it leaves
//! out the host's launch skew and holds the round itself.
//!
//! Every wait stays bounded: a gate that does not open within the transport's timeout records
//! a fault, and the round returns [`ExchangeError::DeviceTimeout`] with the phase `start gate`,
//! the opener (rank 0) as the peer and, as its `round`, the gate's ticket (the count of gated
//! rounds since [`FusedEngine::set_start_gate`]); the round itself runs after the gate gives
//! up, its own waits bounded as always. Ranks on different contexts (separate GPUs or
//! processes) cannot share a gate: [`FusedEngine::set_start_gate`] refuses it.

use std::sync::{Arc, Mutex};

use afdep_kernels::KernelError;
use afdep_kernels::cudarc::driver::{CudaSlice, CudaStream, sys};
use afdep_kernels::ops::fused_round as fr;
use afdep_transport::Transport;

use super::{FusedEngine, device_address};
use crate::error::ExchangeError;

/// The start gate of the device rounds of one in-process group on one CUDA context; see the
/// [module docs](self). Make one per group and hand a clone to every rank's
/// [`FusedEngine::set_start_gate`]; its device word is made on the first rank's context there.
#[derive(Clone, Default)]
pub struct StartGate {
    inner: Arc<Mutex<Option<GateState>>>,
    #[cfg(feature = "fault-injection")]
    never_open: Arc<std::sync::atomic::AtomicBool>,
}

impl std::fmt::Debug for StartGate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let made = self.inner.lock().map(|g| g.is_some()).unwrap_or(false);
        f.debug_struct("StartGate").field("made", &made).finish()
    }
}

/// The gate's device word, the stream its opener writes it on, and the context both live in.
struct GateState {
    /// The context's handle, as an address (compared, never dereferenced).
    ctx: usize,
    /// The word itself, kept alive for `addr`.
    _word: CudaSlice<u32>,
    addr: u64,
    stream: Arc<CudaStream>,
}

impl StartGate {
    /// A gate not yet tied to a context.
    pub fn new() -> StartGate {
        StartGate::default()
    }

    /// Tests only: rank 0 never opens the gate, so every gated round's wait runs out.
    #[cfg(feature = "fault-injection")]
    pub fn set_never_open(&self, on: bool) {
        self.never_open
            .store(on, std::sync::atomic::Ordering::Relaxed);
    }

    #[cfg(feature = "fault-injection")]
    fn opens(&self) -> bool {
        !self.never_open.load(std::sync::atomic::Ordering::Relaxed)
    }

    #[cfg(not(feature = "fault-injection"))]
    fn opens(&self) -> bool {
        true
    }
}

/// An engine's use of a gate: the gate, its word's device address and the ticket of the last
/// gated round.
pub(super) struct GateUse {
    gate: StartGate,
    word: u64,
    ticket: u32,
}

/// What [`FusedEngine::gate_hold`] queued: the ticket the rank's round waits for.
#[derive(Debug, Clone, Copy)]
pub(super) struct Held(u32);

impl FusedEngine {
    /// Sets (`Some`) or removes (`None`) the start gate of this rank's device rounds (eager
    /// rounds and graph replays; [module docs](self)). Collective: every rank of the group
    /// calls it with a clone of the same gate (or `None`) between rounds, with no round queued.
    /// The first rank ties the gate to its CUDA context; a rank on another context gets
    /// [`ExchangeError::Input`]. Rank 0 resets the gate's word, so a gate may be set again.
    pub fn set_start_gate(&mut self, gate: Option<StartGate>) -> Result<(), ExchangeError> {
        self.check_open()?;
        let rank = self.rank();
        if self.has_queued() {
            return Err(ExchangeError::Input {
                rank,
                what: "a round queued without waiting is not finished: call \
                       FusedEngine::finish_queued before setting a start gate"
                    .into(),
            });
        }
        self.transport.barrier()?;
        let mine = match gate {
            None => None,
            Some(g) => Some(self.tie_gate(g)?),
        };
        self.transport.barrier()?;
        self.gate = mine;
        Ok(())
    }

    /// The start gate of this rank's device rounds ([`FusedEngine::set_start_gate`]).
    pub fn start_gate(&self) -> Option<&StartGate> {
        self.gate.as_ref().map(|g| &g.gate)
    }

    /// Ties `gate` to this rank's context (made on the first rank's), and on rank 0 resets its
    /// word to 0 (waited for).
    fn tie_gate(&mut self, gate: StartGate) -> Result<GateUse, ExchangeError> {
        let rank = self.rank();
        self.gpu
            .cuda()
            .bind_to_thread()
            .map_err(KernelError::driver("binding the context"))?;
        let ctx = self.gpu.cuda().cu_ctx() as usize;
        let mut st = gate.inner.lock().map_err(|_| ExchangeError::Input {
            rank,
            what: "the start gate's lock is poisoned (a rank panicked while setting it)".into(),
        })?;
        if st.is_none() {
            // the word is made and zeroed on the gate's own stream, waited for, so every rank's
            // stream may use it (and it is freed on that stream, after the last round's opening)
            let stream = afdep_kernels::quiet_stream(self.gpu.cuda())
                .map_err(KernelError::driver("creating the start gate's stream"))?;
            let word: CudaSlice<u32> = stream
                .alloc_zeros(1)
                .map_err(KernelError::driver("allocating the start gate's word"))?;
            stream
                .synchronize()
                .map_err(KernelError::driver("waiting for the start gate's word"))?;
            let addr = device_address(&self.gpu, &word);
            *st = Some(GateState {
                ctx,
                _word: word,
                addr,
                stream,
            });
        }
        let s = st.as_ref().expect("made above");
        if s.ctx != ctx {
            return Err(ExchangeError::Input {
                rank,
                what: "the start gate belongs to another CUDA context: a gate needs every rank \
                       of the group in one context (ranks emulated on one GPU)"
                    .into(),
            });
        }
        if rank == 0 {
            // SAFETY: `s.addr` is the gate's live u32 (`s._word`, held while the lock is), in
            // this context, which is bound to the thread (above); the stream is a live stream
            // of that context.
            unsafe { sys::cuMemsetD32Async(s.addr, 0, 1, s.stream.cu_stream()) }
                .result()
                .map_err(KernelError::driver("resetting the start gate"))?;
            s.stream
                .synchronize()
                .map_err(KernelError::driver("waiting for the start gate's reset"))?;
        }
        let word = s.addr;
        drop(st);
        Ok(GateUse {
            gate,
            word,
            ticket: 0,
        })
    }

    /// With a gate set, queues the gate's wait for the next ticket on this rank's stream (the
    /// round's launches follow it); `None` without a gate.
    pub(super) fn gate_hold(&mut self) -> Result<Option<Held>, ExchangeError> {
        let timeout_ns = self.transport.timeout().as_nanos().min(u64::MAX as u128) as u64;
        let err = self.rank_addrs(timeout_ns).err;
        let Some(g) = self.gate.as_mut() else {
            return Ok(None);
        };
        g.ticket = g
            .ticket
            .checked_add(1)
            .ok_or_else(|| ExchangeError::Input {
                rank: self.transport.rank(),
                what: "the start gate's tickets ran out after 2^32 - 1 rounds: set the gate again \
                   (FusedEngine::set_start_gate resets it)"
                    .into(),
            })?;
        // SAFETY: `g.word` is the gate's u32 on this rank's context (checked by
        // `set_start_gate`), alive while any clone of the gate is (this engine holds one);
        // `err` is this rank's error word in its workspace (the launch invariant).
        unsafe { fr::start_gate(&self.gpu, g.word, g.ticket, timeout_ns, err, 0) }?;
        Ok(Some(Held(g.ticket)))
    }

    /// After [`FusedEngine::gate_hold`] and the round's launches: waits until every rank has
    /// queued its round (a barrier), then rank 0 opens the gate for the ticket. Nothing without
    /// a hold.
    pub(super) fn gate_open(&mut self, held: Option<Held>) -> Result<(), ExchangeError> {
        let Some(Held(ticket)) = held else {
            return Ok(());
        };
        self.transport.barrier()?;
        let g = self.gate.as_ref().expect("a hold has a gate");
        if self.rank() != 0 || !g.gate.opens() {
            return Ok(());
        }
        let st = g.gate.inner.lock().map_err(|_| ExchangeError::Input {
            rank: 0,
            what: "the start gate's lock is poisoned".into(),
        })?;
        let s = st.as_ref().expect("tied by set_start_gate");
        // SAFETY: as in `tie_gate`: the gate's live u32 and its live stream, in this rank's
        // context, bound to this thread by the round's launches.
        unsafe { sys::cuMemsetD32Async(s.addr, ticket, 1, s.stream.cu_stream()) }
            .result()
            .map_err(KernelError::driver("opening the start gate"))?;
        Ok(())
    }
}
