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
//! With a gate set, a device round starts with one more kernel: it holds the round's launches
//! until the gate's device word reaches this rank's next ticket (`afdep_round_start_gate`, a
//! bounded wait; the rank counts its tickets on the device, so a graph holds the kernel as its
//! first node and every replay waits for the next ticket). A graph captured with the gate set
//! holds the gate itself; an eager round, or a replay of a graph captured without a gate,
//! queues the kernel on the rank's stream before the round. Once every rank has queued its
//! round (a control-plane barrier), rank 0 writes the ticket into the word on a stream of its
//! own, and every rank's round starts within one device poll of the others. The round's device
//! time ([`FusedEngine::set_round_timing`]) of a gated round runs from the gate's opening (an
//! event recorded on the gate's stream just before the ticket is written) to the rank's last
//! launch: it leaves out the host's launch skew and holds the gate's release, each rank's
//! restart and the round itself.
//!
//! Every wait stays bounded: a gate that does not open within the transport's timeout records
//! a fault, and the round returns [`ExchangeError::DeviceTimeout`] with the phase `start gate`,
//! the opener (rank 0) as the peer and, as its `round`, the gate's ticket (the count of gated
//! rounds since [`FusedEngine::set_start_gate`]); the round itself runs after the gate gives
//! up, its own waits bounded as always. Ranks on different contexts (separate GPUs or
//! processes) cannot share a gate: [`FusedEngine::set_start_gate`] refuses it. A graph captured
//! with a gate replays only behind that same gate ([`FusedEngine::replay`] refuses it
//! otherwise with [`ExchangeError::Input`]): it keeps a clone of the gate, so the word and the
//! ticket counters its gate node reads stay alive.

use std::sync::{Arc, Mutex};

use afdep_kernels::KernelError;
use afdep_kernels::cudarc::driver::{CudaEvent, CudaSlice, CudaStream, result, sys};
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

/// The gate's device word, the stream its opener writes it on, the event recorded there as it
/// opens, each rank's ticket counter, and the context all of them live in.
struct GateState {
    /// The context's handle, as an address (compared, never dereferenced).
    ctx: usize,
    /// The word itself, kept alive for `addr`.
    _word: CudaSlice<u32>,
    addr: u64,
    stream: Arc<CudaStream>,
    /// Recorded on `stream` just before each opening: the start of a gated round's time.
    open: CudaEvent,
    /// Each rank's ticket counter (the last ticket its gate kernel passed), by rank, made when
    /// the rank first ties the gate and zeroed at every tie; kept as long as the gate is, since
    /// a graph captured with the gate reads and writes it at every replay.
    seen: Vec<Option<CudaSlice<u32>>>,
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

/// An engine's use of a gate: the gate, its word's device address, the device address of this
/// rank's ticket counter and the ticket of the last gated round.
pub(super) struct GateUse {
    gate: StartGate,
    word: u64,
    seen: u64,
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

    /// Ties `gate` to this rank's context (made on the first rank's), zeroes this rank's ticket
    /// counter (made on the first tie) and on rank 0 resets the gate's word to 0 (both waited
    /// for).
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
            let open = self
                .gpu
                .cuda()
                .new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
                .map_err(KernelError::driver("creating the start gate's event"))?;
            stream
                .synchronize()
                .map_err(KernelError::driver("waiting for the start gate's word"))?;
            let addr = device_address(&self.gpu, &word);
            *st = Some(GateState {
                ctx,
                _word: word,
                addr,
                stream,
                open,
                seen: Vec::new(),
            });
        }
        let s = st.as_mut().expect("made above");
        if s.ctx != ctx {
            return Err(ExchangeError::Input {
                rank,
                what: "the start gate belongs to another CUDA context: a gate needs every rank \
                       of the group in one context (ranks emulated on one GPU)"
                    .into(),
            });
        }
        if s.seen.len() <= rank {
            s.seen.resize_with(rank + 1, || None);
        }
        // this rank's counter: made on the gate's stream like the word, zeroed at every tie
        if s.seen[rank].is_none() {
            let c: CudaSlice<u32> = s.stream.alloc_zeros(1).map_err(KernelError::driver(
                "allocating a start gate ticket counter",
            ))?;
            s.seen[rank] = Some(c);
        }
        let seen = device_address(&self.gpu, s.seen[rank].as_ref().expect("made above"));
        // SAFETY: `seen` is this rank's live counter (held by the gate state while the lock is),
        // in this context, bound to the thread (above); no round of this rank is in flight
        // (`set_start_gate` is called between rounds, after a barrier); the stream is live.
        unsafe { sys::cuMemsetD32Async(seen, 0, 1, s.stream.cu_stream()) }
            .result()
            .map_err(KernelError::driver("zeroing a start gate ticket counter"))?;
        if rank == 0 {
            // SAFETY: `s.addr` is the gate's live u32 (`s._word`, held while the lock is), in
            // this context, which is bound to the thread (above); the stream is a live stream
            // of that context.
            unsafe { sys::cuMemsetD32Async(s.addr, 0, 1, s.stream.cu_stream()) }
                .result()
                .map_err(KernelError::driver("resetting the start gate"))?;
        }
        s.stream
            .synchronize()
            .map_err(KernelError::driver("waiting for the start gate's reset"))?;
        let word = s.addr;
        drop(st);
        Ok(GateUse {
            gate,
            word,
            seen,
            ticket: 0,
        })
    }

    /// With a gate set, the ticket of the next gated round (counted on the host as the gate
    /// kernel counts it on the device); `None` without a gate.
    pub(super) fn gate_ticket(&mut self) -> Result<Option<Held>, ExchangeError> {
        let rank = self.rank();
        let Some(g) = self.gate.as_mut() else {
            return Ok(None);
        };
        g.ticket = g
            .ticket
            .checked_add(1)
            .ok_or_else(|| ExchangeError::Input {
                rank,
                what: "the start gate's tickets ran out after 2^32 - 1 rounds: set the gate again \
                   (FusedEngine::set_start_gate resets it)"
                    .into(),
            })?;
        Ok(Some(Held(g.ticket)))
    }

    /// With a gate set, queues (or, inside a capture, records) the gate's kernel on this rank's
    /// stream: the launches after it wait for the rank's next ticket. Nothing without a gate.
    pub(super) fn gate_kernel(&mut self) -> Result<(), ExchangeError> {
        let timeout_ns = self.transport.timeout().as_nanos().min(u64::MAX as u128) as u64;
        let err = self.rank_addrs(timeout_ns).err;
        let Some(g) = self.gate.as_ref() else {
            return Ok(());
        };
        // SAFETY: `g.word` is the gate's u32 and `g.seen` this rank's ticket counter, both on
        // this rank's context (checked by `set_start_gate`) and alive while any clone of the
        // gate is (this engine holds one, and so does a graph that captures this launch); only
        // this rank's gate kernels write `g.seen`, in stream order; `err` is this rank's error
        // word in its workspace (the launch invariant).
        unsafe { fr::start_gate(&self.gpu, g.word, g.seen, timeout_ns, err, 0) }?;
        Ok(())
    }

    /// With a gate set: the next ticket and the gate's kernel queued on this rank's stream
    /// (before an eager round's launches, or before a replay of a graph captured without the
    /// gate); `None` without a gate.
    pub(super) fn gate_hold(&mut self) -> Result<Option<Held>, ExchangeError> {
        let held = self.gate_ticket()?;
        if held.is_some() {
            self.gate_kernel()?;
        }
        Ok(held)
    }

    /// This rank's gate when it is `gate` (the same gate, not a gate of its own), else `Input`
    /// naming what a graph captured with `gate` needs: for a replay of such a graph.
    pub(super) fn check_same_gate(&self, gate: &StartGate) -> Result<(), ExchangeError> {
        match &self.gate {
            Some(g) if Arc::ptr_eq(&g.gate.inner, &gate.inner) => Ok(()),
            _ => Err(ExchangeError::Input {
                rank: self.rank(),
                what: "the graph was captured with a start gate: it replays only behind that \
                       gate (FusedEngine::set_start_gate with a clone of it)"
                    .into(),
            }),
        }
    }

    /// After the round's ticket and launches: waits until every rank has queued its round (a
    /// barrier), then rank 0 records the gate's opening event and opens the gate for the
    /// ticket, on the gate's stream. Nothing without a hold.
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
        // the event first: a rank that reads it after its round finds it recorded (its round
        // could not pass the gate before the write that follows the record on this stream)
        s.open
            .record(&s.stream)
            .map_err(KernelError::driver("recording the start gate's opening"))?;
        // SAFETY: as in `tie_gate`: the gate's live u32 and its live stream, in this rank's
        // context, bound to this thread by the round's launches.
        unsafe { sys::cuMemsetD32Async(s.addr, ticket, 1, s.stream.cu_stream()) }
            .result()
            .map_err(KernelError::driver("opening the start gate"))?;
        Ok(())
    }

    /// After a completed gated round (its stream waited for): the milliseconds from the gate's
    /// opening to `stop`, an event recorded on this rank's stream after the round's launches.
    pub(super) fn gate_elapsed_ms(&self, stop: &CudaEvent) -> Result<f32, ExchangeError> {
        let g = self.gate.as_ref().expect("a gated round has a gate");
        let st = g.gate.inner.lock().map_err(|_| ExchangeError::Input {
            rank: self.rank(),
            what: "the start gate's lock is poisoned".into(),
        })?;
        let s = st.as_ref().expect("tied by set_start_gate");
        // SAFETY: both events are live events of this context (checked by `set_start_gate`),
        // created with timing; `stop` completed (the caller waited for its stream) and the
        // opening event was recorded before the write that let this rank's round pass its gate
        // (`gate_open`), on a stream whose work before that write has completed.
        Ok(
            unsafe { result::event::elapsed(s.open.cu_event(), stop.cu_event()) }
                .map_err(KernelError::driver("reading the start gate's opening"))?,
        )
    }
}
