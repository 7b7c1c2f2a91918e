//! The NCCL device engine ([`NcclDeviceEngine`], cargo feature `nccl`): the exchange round as
//! users run it over NCCL today (packing kernels, a grouped `ncclSend`/`ncclRecv`
//! all-to-all-v, the FFN side's expansion and experts, a second all-to-all-v back, the
//! combine), everything on the device, over [`Nccl`]'s communicator. It is the fair NCCL column
//! of the exchange tables beside the fused NVLink engine, where the staged engine over NCCL
//! measures its host packing and host experts.
//!
//! # One round
//!
//! 1. **status + counts** (host, the shared count phase, one control-plane all-gather through
//!    the bootstrap): validation, so that a rejected route fails every rank with
//!    [`ExchangeError::Route`] before anything moves (the next round works); then the source's
//!    rows and routes are copied to capacity-sized device buffers with its token count.
//! 2. **pack** (source, `afdep_nccl_pack`, `afdep_nccl_pack_rows`): for every FFN rank f one
//!    **dispatch slab**: a header holding its row count, then the tokens bound for f, ascending
//!    (the compact view), each with its token index, its K local expert ids on f (-1 elsewhere)
//!    and weights, and its bf16 row.
//! 3. **dispatch exchange** (one NCCL group: a send of each FFN rank's slab, on FFN ranks a
//!    receive of each source's slab).
//! 4. **expand** (FFN, `afdep_nccl_count`, `afdep_nccl_plan`, `afdep_nccl_expand`,
//!    `afdep_nccl_expand_rows`): the [`FfnPlan`] (counts, block starts, expert offsets) from
//!    the received slabs' metadata, then the expanded layout (one row per (token, local
//!    expert), expert-major, source-minor, compact order within a block).
//! 5. **experts** (FFN): [`DeviceExperts::Scale`] by `afdep_round_experts` (the fused device
//!    round's expert kernel); [`DeviceExperts::Identity`] runs no kernel (the partials read the
//!    expanded rows); [`DeviceExperts::SwiGlu`] by the fused device round's grouped SwiGLU
//!    GEMMs over the expanded rows, groups from the device plan's expert offsets (within the
//!    bf16 tolerance of the oracle, [`crate::accuracy`], not bit-identical).
//! 6. **reduce** (FFN, `afdep_nccl_reduce`): per compact row the f32 partial
//!    `Σ_{k ascending, on f} w_k · y_k` into the **return slab** of its source.
//! 7. **return exchange** (one NCCL group, the other way).
//! 8. **combine** (source, `afdep_nccl_combine`): per token, `0 + Σ_{f ascending}` of the
//!    partials of the FFN ranks holding one of its slots, cast to bf16 once: the oracle's
//!    arithmetic (`afdep_core::oracle::exchange`), so results are bit-identical to the oracle
//!    for the identity and scale experts, and what an FFN rank received always is.
//!
//! Steps 2 to 8 are one sequence of launches and NCCL calls on the engine's stream with no host
//! work between them; with the capacity-padded sizes below they depend on no value that changes
//! between rounds, so [`NcclDeviceEngine::capture`] records them in a CUDA graph (NCCL 2.9 or
//! later captures its groups), and later rounds replay it with new inputs.
//!
//! # Slab sizes: exact in eager rounds, capacity-padded in graphs
//!
//! `ncclSend`/`ncclRecv` take their byte counts on the host, and a captured graph freezes them.
//!
//! - **Eager rounds** ([`NcclDeviceEngine::round`] without a capture): step 1's count phase
//!   already gives every rank every source's per-FFN-rank token counts, so each pair sends
//!   exactly its slab's header and rows and gets exactly its partial rows back
//!   ([`pair_bytes`]): the all-to-all-v with host-known split sizes that
//!   `torch.distributed.all_to_all_single` runs.
//! - **Graph replays** ([`NcclDeviceEngine::capture`]): sizes fixed at capture, so every
//!   (source, FFN rank) pair sends one whole slab each way, whatever the round's token count:
//!   `16 + capacity × row_bytes` dispatch bytes (`row_bytes = align16(4 + 8K) + align16(2 ×
//!   hidden)`) and `capacity × hidden × 4` return bytes ([`NcclGeometry`]), the row counts
//!   riding in the slab headers. A round of T tokens per source moves at most the fraction
//!   `T / capacity` of those bytes as payload; the rest is padding. At the tables' setting
//!   (hidden 2048, K = 8, capacity 2048) that is 8.2 MiB dispatch + 16 MiB return per pair and
//!   round (3A:1F: 24.5 + 48 MiB, at 1 token as at 2,048); at hidden 7168 and capacity 2048,
//!   28.2 + 56 MiB per pair. So a graph's capacity should be set near the largest round.
//!
//! A dispatch row carries its own metadata (token, ids, weights: 80 bytes at K = 8), so no
//! separate route exchange is needed, and the FFN rank's plan comes from the received slabs on
//! the device in both modes.
//!
//! # Ranks and GPUs
//!
//! NCCL refuses two ranks of one communicator on one GPU, so a group of n ranks needs n GPUs
//! (one process with one thread per rank, or one process per rank); a world of one rank (EP1)
//! runs on one GPU. Each rank's kernels and NCCL calls share the engine's stream (the
//! [`GpuContext`]'s), and every wait for the device polls NCCL's asynchronous error up to the
//! transport's timeout ([`Nccl::wait_stream`]).
//!
//! # Errors
//!
//! A rejected route is [`ExchangeError::Route`] on every rank and leaves the engine usable.
//! Any other failure of a round (a kernel or driver error, an NCCL error or time-out, which
//! abort the communicator) closes the engine: [`ExchangeError::Closed`] afterwards. fp8 payloads
//! and bf16 combine partials ([`afdep_core::CombinePartials::Bf16`]) are not supported by this
//! engine (an [`ExchangeError::Input`] at set-up, the same on every rank).

use std::time::{Duration, Instant};

use afdep_core::layout::{FfnPlan, SourceCounts};
use afdep_core::oracle::exchange::{FfnReceived, SourceInput};
use afdep_core::{CombinePartials, ExchangeConfig, PayloadKind, bf16};
use afdep_kernels::cudarc::driver::{CudaEvent, CudaGraph, sys};
use afdep_kernels::ops::nccl_round::{HEADER_BYTES, NcclExperts, NcclGeometry, NcclRoundBuffers};
use afdep_kernels::{GpuContext, KernelError};
use afdep_transport::{Nccl, RawPart, Transport, TransportError};
use tracing::debug;

use crate::error::ExchangeError;
use crate::fused::DeviceExperts;
use crate::fused::device_round::{SwigluBufs, swiglu, swiglu_bufs};
use crate::round::{ExchangeEngine, ExpertFn, PhaseTimes, RoundOutput, agree, count_phase};

/// The geometry of a config's NCCL device round.
pub fn geometry(cfg: &ExchangeConfig) -> NcclGeometry {
    let p = cfg.placement();
    NcclGeometry {
        sources: cfg.topology.attention_count(),
        ffn_ranks: p.ffn_ranks,
        epr: p.experts_per_rank,
        top_k: cfg.top_k,
        hidden: cfg.hidden,
        cap: cfg.capacity,
    }
}

/// The NCCL device engine of one rank; see the [module docs](self).
pub struct NcclDeviceEngine {
    // dropped first: it holds the communicator's captured groups
    graph: Option<CudaGraph>,
    cfg: ExchangeConfig,
    transport: Nccl,
    gpu: GpuContext,
    bufs: NcclRoundBuffers,
    /// An FFN rank's SwiGLU experts (the fused device round's grouped GEMMs).
    swiglu: Option<SwigluBufs>,
    src_index: Option<usize>,
    ffn_index: Option<usize>,
    timer: Option<(CudaEvent, CudaEvent)>,
    last_time: Option<Duration>,
    poison: bool,
    keep_received: bool,
    closed: Option<String>,
}

impl std::fmt::Debug for NcclDeviceEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclDeviceEngine")
            .field("rank", &self.rank())
            .field("bufs", &self.bufs)
            .field("graph", &self.graph.is_some())
            .field("closed", &self.closed)
            .finish()
    }
}

fn bind(gpu: &GpuContext) -> Result<(), KernelError> {
    gpu.cuda()
        .bind_to_thread()
        .map_err(KernelError::driver("binding the context"))
}

impl NcclDeviceEngine {
    /// Sets up one rank, collective: the config agreement of every engine, the device buffers
    /// (capacity-sized) and the kernels (compiled or read from the cache now, outside any
    /// round), on `transport`'s device, with `experts` as the FFN ranks' experts (every rank
    /// must pass the same). fp8 payloads and bf16 combine partials are [`ExchangeError::Input`]
    /// on every rank.
    pub fn new(
        cfg: ExchangeConfig,
        mut transport: Nccl,
        experts: &DeviceExperts,
    ) -> Result<Self, ExchangeError> {
        agree(&cfg, &mut transport)?;
        let rank = transport.rank();
        let unsupported = |what: &str| ExchangeError::Input {
            rank,
            what: format!("the NCCL device engine does not support {what}"),
        };
        if cfg.payload != PayloadKind::Bf16 {
            return Err(unsupported("fp8 payloads"));
        }
        if cfg.partials != CombinePartials::F32 {
            return Err(unsupported("bf16 combine partials"));
        }
        let geo = geometry(&cfg);
        let src_index = cfg.topology.attention_index(rank);
        let ffn_index = cfg.topology.ffn_index(rank);
        let scales = match (experts, ffn_index) {
            (DeviceExperts::Scale(s), Some(f)) => {
                let e = cfg.placement().experts_of(f);
                match s.get(e.clone()) {
                    Some(local) => Ok(Some(local.to_vec())),
                    None => Err(ExchangeError::Input {
                        rank,
                        what: format!("{} expert scales, experts {e:?} needed", s.len()),
                    }),
                }
            }
            _ => Ok(None),
        };
        // every rank's set-up verdict before anything that could wait for a peer
        let local = scales
            .and_then(|scales| Ok((scales, GpuContext::new(transport.device())?)))
            .and_then(|(scales, gpu)| {
                // SAFETY: no buffer of this context exists yet, and every buffer the engine
                // allocates is allocated, used and freed on the context's one stream (its
                // kernels and NCCL groups alike), whose order is all the synchronisation they
                // need; without per-buffer events a capture holds kernel and NCCL nodes only.
                unsafe { gpu.cuda().disable_event_tracking() };
                let kind = match (experts, scales.as_deref()) {
                    (DeviceExperts::SwiGlu(_), _) => NcclExperts::External,
                    (_, Some(s)) => NcclExperts::Scale(s),
                    _ => NcclExperts::Identity,
                };
                let bufs = NcclRoundBuffers::new(&gpu, geo, src_index.is_some(), ffn_index, kind)?;
                let swiglu = match (experts, ffn_index) {
                    (DeviceExperts::SwiGlu(lp), Some(f)) => {
                        Some(swiglu_bufs(&gpu, &cfg, lp, f, geo.exp_rows())?)
                    }
                    _ => None,
                };
                gpu.synchronize()?;
                Ok((gpu, bufs, swiglu))
            });
        let ok = [u8::from(local.is_ok())];
        let all = transport.all_gather(&ok)?;
        let (gpu, bufs, swiglu) = local?;
        if let Some(peer) = all.iter().position(|&b| b == 0) {
            return Err(ExchangeError::Transport(TransportError::PeerFailed {
                op: "nccl_device.new",
                rank,
                peer,
                why: "its device set-up failed".into(),
            }));
        }
        debug!(
            rank,
            slab_bytes = geo.slab_bytes(),
            ret_slab_bytes = geo.ret_slab_bytes(),
            "nccl device engine ready"
        );
        Ok(NcclDeviceEngine {
            cfg,
            transport,
            gpu,
            bufs,
            swiglu,
            src_index,
            ffn_index,
            graph: None,
            timer: None,
            last_time: None,
            poison: false,
            keep_received: false,
            closed: None,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &ExchangeConfig {
        &self.cfg
    }

    /// The slab sizes.
    pub fn geometry(&self) -> &NcclGeometry {
        self.bufs.geometry()
    }

    /// The transport.
    pub fn transport_mut(&mut self) -> &mut Nccl {
        &mut self.transport
    }

    /// Fills the round's outputs with NaN before each round (tests: a value a round fails to
    /// write shows).
    pub fn set_poison(&mut self, on: bool) {
        self.poison = on;
    }

    /// Reads what an FFN rank received back after each round into [`RoundOutput::received`]
    /// (the plan the device computed, the expanded rows, the compact view from the slabs;
    /// tests: costs a copy of the slabs per round).
    pub fn set_keep_received(&mut self, on: bool) {
        self.keep_received = on;
    }

    /// Times each round with two CUDA events on the engine's stream, the first after a
    /// control-plane barrier of every rank that follows the round's host preparation (counts,
    /// uploads), the second after the combine; [`NcclDeviceEngine::last_round_time`] gives the
    /// span. Collective in effect (the barrier): every rank must set the same.
    pub fn set_round_timing(&mut self, on: bool) -> Result<(), ExchangeError> {
        self.timer = if on {
            let ev = || {
                self.gpu
                    .cuda()
                    .new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
                    .map_err(KernelError::driver("creating a round event"))
            };
            Some((ev()?, ev()?))
        } else {
            None
        };
        self.last_time = None;
        Ok(())
    }

    /// The device time of the last round that completed with round timing on.
    pub fn last_round_time(&self) -> Option<Duration> {
        self.last_time
    }

    /// Whether rounds replay a captured graph ([`NcclDeviceEngine::capture`]).
    pub fn is_captured(&self) -> bool {
        self.graph.is_some()
    }

    /// Records steps 2 to 8 of a round (module docs) in a CUDA graph, which every later round
    /// replays. Collective (barriers before and after); every rank must capture. First one
    /// eager round of no tokens with the graph's padded sizes runs, so that NCCL sets up its
    /// connections to every peer outside the capture; the capture itself runs nothing.
    pub fn capture(&mut self) -> Result<(), ExchangeError> {
        const OP: &str = "nccl_device.capture";
        self.check_open()?;
        self.transport.barrier()?;
        bind(&self.gpu)?;
        let s = self.gpu.stream().clone();
        let warmed = self
            .bufs
            .set_tokens(&self.gpu, 0)
            .map_err(ExchangeError::from)
            .and_then(|()| self.launch_round(None))
            .and_then(|()| Ok(self.transport.wait_stream(&s, OP)?));
        if let Err(e) = warmed {
            self.closed = Some(e.to_string());
            return Err(e);
        }
        s.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(KernelError::driver("beginning a graph capture"))?;
        let launched = self.launch_round(None);
        let ended = s.end_capture(sys::CUgraphInstantiate_flags(0));
        let captured = launched.and_then(|()| {
            let g = ended
                .map_err(KernelError::driver("ending the graph capture"))?
                .ok_or_else(|| ExchangeError::Input {
                    rank: self.rank(),
                    what: "the captured round is empty".into(),
                })?;
            g.upload()
                .map_err(KernelError::driver("uploading the graph"))?;
            self.gpu.synchronize()?;
            Ok(g)
        });
        match captured {
            Ok(g) => self.graph = Some(g),
            Err(e) => {
                self.closed = Some(e.to_string());
                return Err(e);
            }
        }
        self.transport.barrier()?;
        Ok(())
    }

    fn check_open(&self) -> Result<(), ExchangeError> {
        crate::round::check_open(&self.closed, self.rank())
    }

    /// One NCCL group on the engine's stream.
    fn group(&mut self, sends: &[RawPart], recvs: &[RawPart]) -> Result<(), ExchangeError> {
        let stream = self.gpu.stream().clone();
        // SAFETY: the stream is the GpuContext's on the transport's device; every part addresses
        // a whole slab of `self.bufs` (live as long as the engine, whose stream is waited for
        // before the buffers are dropped), and the slab sizes depend only on the config, which
        // every rank agreed on, so each send has its receive's size.
        unsafe { self.transport.group_raw(&stream, sends, recvs) }?;
        Ok(())
    }

    /// This rank's parts of one of the round's two exchanges: `(as a source: one per FFN
    /// rank, as an FFN rank: one per source)`. The dispatch sends the source parts and receives
    /// the FFN parts; the return the other way round. `counts` as in `launch_round`.
    fn parts(
        &self,
        counts: Option<&[SourceCounts]>,
        exchange: Exchange,
    ) -> Result<(Vec<RawPart>, Vec<RawPart>), ExchangeError> {
        let g = *self.bufs.geometry();
        let topo = self.cfg.topology;
        let gpu = &self.gpu;
        let bytes = |s: usize, f: usize| {
            let (dispatch, ret) = pair_bytes(&g, counts.map(|c| c[s].ffn_tokens[f]));
            match exchange {
                Exchange::Dispatch => dispatch,
                Exchange::Return => ret,
            }
        };
        let mut src = Vec::new();
        if let Some(s) = self.src_index {
            for f in 0..g.ffn_ranks {
                let addr = match exchange {
                    Exchange::Dispatch => self.bufs.send_slab(gpu, f)?,
                    Exchange::Return => self.bufs.ret_recv_slab(gpu, f)?,
                };
                let (peer, bytes) = (topo.ffn_rank(f), bytes(s, f));
                src.push(RawPart { peer, addr, bytes });
            }
        }
        let mut ffn = Vec::new();
        if let Some(f) = self.ffn_index {
            for s in 0..g.sources {
                let addr = match exchange {
                    Exchange::Dispatch => self.bufs.recv_slab(gpu, s)?,
                    Exchange::Return => self.bufs.ret_send_slab(gpu, s)?,
                };
                ffn.push(RawPart {
                    peer: s,
                    addr,
                    bytes: bytes(s, f),
                });
            }
        }
        Ok((src, ffn))
    }

    /// Steps 2 to 8 of a round on the engine's stream (what a graph captures). `counts`: every
    /// source's counts of an eager round (exact slab sizes, [`pair_bytes`]); `None`: whole
    /// slabs (a capture).
    fn launch_round(&mut self, counts: Option<&[SourceCounts]>) -> Result<(), ExchangeError> {
        let gpu = &self.gpu;
        if self.src_index.is_some() {
            self.bufs.pack(gpu)?;
        }
        let (sends, recvs) = self.parts(counts, Exchange::Dispatch)?;
        self.group(&sends, &recvs)?;
        let gpu = &self.gpu;
        if self.ffn_index.is_some() {
            self.bufs.expand(gpu)?;
            match self.swiglu.as_mut() {
                Some(sw) => {
                    let (pv, y) = self.bufs.expert_io(gpu)?;
                    swiglu(gpu, &pv, sw, y)?;
                }
                None => self.bufs.experts(gpu)?,
            }
            self.bufs.reduce(gpu)?;
        }
        let (recvs, sends) = self.parts(counts, Exchange::Return)?;
        self.group(&sends, &recvs)?;
        if self.src_index.is_some() {
            self.bufs.combine(&self.gpu)?;
        }
        Ok(())
    }

    /// Runs one round (module docs). Attention ranks pass `Some(input)`, FFN-only ranks `None`.
    /// Collective.
    pub fn round(&mut self, input: Option<&SourceInput>) -> Result<RoundOutput, ExchangeError> {
        self.check_open()?;
        let t0 = Instant::now();
        // a rejected route fails every rank here, before anything moves, and leaves the engine
        // open
        let counts = count_phase(&self.cfg, &mut self.transport, input)?;
        let counted = t0.elapsed();
        let out = self.device_part(input, &counts, t0, counted);
        if let Err(e) = &out {
            self.closed = Some(e.to_string());
            self.last_time = None;
        }
        out
    }

    fn device_part(
        &mut self,
        input: Option<&SourceInput>,
        counts: &[SourceCounts],
        t0: Instant,
        counted: Duration,
    ) -> Result<RoundOutput, ExchangeError> {
        const OP: &str = "nccl_device.round";
        bind(&self.gpu)?;
        let tokens = match input {
            Some(inp) => {
                self.bufs
                    .upload_input(&self.gpu, &inp.x, &inp.routes.idx, &inp.routes.weights)?;
                inp.routes.tokens
            }
            None => {
                self.bufs.set_tokens(&self.gpu, 0)?;
                0
            }
        };
        if self.poison {
            self.bufs.poison_outputs(&self.gpu)?;
        }
        if self.timer.is_some() {
            // the host preparation of every rank is done before the first event
            self.gpu.synchronize()?;
            self.transport.barrier()?;
        }
        if let Some((start, _)) = &self.timer {
            start
                .record(self.gpu.stream())
                .map_err(KernelError::driver("recording a round event"))?;
        }
        match &self.graph {
            Some(g) => g
                .launch()
                .map_err(KernelError::driver("launching the round's graph"))?,
            None => self.launch_round(Some(counts))?,
        }
        if let Some((_, stop)) = &self.timer {
            stop.record(self.gpu.stream())
                .map_err(KernelError::driver("recording a round event"))?;
        }
        let stream = self.gpu.stream().clone();
        self.transport.wait_stream(&stream, OP)?;
        if self.swiglu.is_some() {
            // a GEMM's bounded TMA wait that ran out
            self.gpu.take_fault()?;
        }
        if let Some((start, stop)) = &self.timer {
            let ms = start
                .elapsed_ms(stop)
                .map_err(KernelError::driver("reading a round event"))?;
            self.last_time = Some(Duration::from_secs_f64(f64::from(ms.max(0.0)) * 1e-3));
        }
        let combined = match self.src_index {
            Some(_) => Some(self.bufs.read_out(&self.gpu, tokens)?),
            None => None,
        };
        let received = match (self.ffn_index, self.keep_received) {
            (Some(f), true) => {
                let (slabs, ws) = self.bufs.read_received(&self.gpu)?;
                Some(
                    received_of(self.bufs.geometry(), f, &slabs, &ws).map_err(|what| {
                        ExchangeError::Input {
                            rank: self.rank(),
                            what,
                        }
                    })?,
                )
            }
            _ => None,
        };
        let total = t0.elapsed();
        Ok(RoundOutput {
            combined,
            received,
            times: PhaseTimes {
                counts: counted,
                dispatch: total.saturating_sub(counted),
                experts: Duration::ZERO,
                combine: Duration::ZERO,
            },
        })
    }
}

/// The bytes of one (source, FFN rank) pair's dispatch and return slabs in a round: with the
/// pair's compact row count `rows` (an eager round: every rank has every source's counts from
/// the count phase) the header and those rows, and `rows` f32 partial rows back (the exact
/// all-to-all-v); `None` (a captured graph, whose sizes are frozen) the whole capacity-padded
/// slabs. Every rank computes the same sizes for a pair, so each send matches its receive.
pub fn pair_bytes(g: &NcclGeometry, rows: Option<u64>) -> (usize, usize) {
    match rows {
        Some(n) => {
            let n = (n as usize).min(g.cap);
            (HEADER_BYTES + n * g.row_bytes(), n * g.hidden * 4)
        }
        None => (g.slab_bytes(), g.ret_slab_bytes()),
    }
}

/// One of a round's two exchanges.
#[derive(Debug, Clone, Copy)]
enum Exchange {
    /// Sources to FFN ranks: the token rows.
    Dispatch,
    /// FFN ranks to sources: the partials.
    Return,
}

/// What FFN rank `f` received, from its dispatch slabs (`sources` slabs of
/// [`NcclGeometry::slab_bytes`]) and its workspace (the device plan at 0, the expanded rows at
/// [`NcclGeometry::exp_off`]): the [`FfnReceived`] of the oracle's dispatch, built from what the
/// device computed (so a test comparing it with the oracle checks the device's plan and
/// expansion). An inconsistent plan or slab is an error naming it.
pub fn received_of(
    g: &NcclGeometry,
    f: usize,
    slabs: &[u8],
    ws: &[u8],
) -> Result<FfnReceived, String> {
    let (ns, epr, k, h) = (g.sources, g.epr, g.top_k, g.hidden);
    if slabs.len() < ns * g.slab_bytes() || ws.len() < g.exp_off() {
        return Err("the slabs or the workspace are shorter than the geometry".into());
    }
    let word = |b: &[u8], i: usize| u64::from_le_bytes(b[8 * i..8 * i + 8].try_into().unwrap());
    let n = epr * ns;
    let counts: Vec<u64> = (0..n).map(|i| word(ws, i)).collect();
    let block_starts: Vec<u64> = (0..n).map(|i| word(ws, n + i)).collect();
    let expert_offsets: Vec<u64> = (0..=epr).map(|i| word(ws, 2 * n + i)).collect();
    let total = *expert_offsets.last().unwrap_or(&0) as usize;
    if total > g.exp_rows() || g.exp_off() + total * h * 2 > ws.len() {
        return Err(format!(
            "the device plan has {total} rows, the area {}",
            g.exp_rows()
        ));
    }
    let expanded: Vec<bf16> =
        bytemuck::pod_collect_to_vec::<u8, u16>(&ws[g.exp_off()..g.exp_off() + total * h * 2])
            .into_iter()
            .map(bf16::from_bits)
            .collect();
    let mut slab_offsets = vec![0u64];
    let mut compact_tokens = Vec::new();
    let mut compact_x = Vec::new();
    let mut compact_ids = Vec::new();
    let mut compact_weights = Vec::new();
    for s in 0..ns {
        let slab = &slabs[s * g.slab_bytes()..(s + 1) * g.slab_bytes()];
        let rows = u32::from_le_bytes(slab[..4].try_into().unwrap()) as usize;
        if rows > g.cap {
            return Err(format!(
                "source {s}'s slab holds {rows} rows, capacity {}",
                g.cap
            ));
        }
        slab_offsets.push(slab_offsets[s] + rows as u64);
        for r in 0..rows {
            let row = &slab[HEADER_BYTES + r * g.row_bytes()..][..g.row_bytes()];
            let w32 = |i: usize| u32::from_le_bytes(row[4 * i..4 * i + 4].try_into().unwrap());
            compact_tokens.push((s as u32, w32(0)));
            compact_ids.extend((0..k).map(|j| w32(1 + j) as i32));
            compact_weights.extend((0..k).map(|j| f32::from_bits(w32(1 + k + j))));
            compact_x.extend(
                bytemuck::pod_collect_to_vec::<u8, u16>(&row[g.pay_off()..g.pay_off() + 2 * h])
                    .into_iter()
                    .map(bf16::from_bits),
            );
        }
    }
    Ok(FfnReceived {
        plan: FfnPlan {
            ffn: f,
            sources: ns,
            local_experts: epr,
            counts,
            expert_offsets,
            block_starts,
            slab_offsets,
        },
        expanded,
        compact_tokens,
        compact_x,
        compact_ids,
        compact_weights,
        fp8: None,
    })
}

impl ExchangeEngine for NcclDeviceEngine {
    fn rank(&self) -> usize {
        self.transport.rank()
    }

    /// A round with the device experts given at set-up; `expert` is not used (the oracle's
    /// counterpart is [`DeviceExperts::host`]).
    fn round(
        &mut self,
        input: Option<&SourceInput>,
        _expert: &dyn ExpertFn,
    ) -> Result<RoundOutput, ExchangeError> {
        NcclDeviceEngine::round(self, input)
    }

    fn barrier(&mut self) -> Result<(), TransportError> {
        self.transport.barrier()
    }

    fn all_gather(&mut self, mine: &[u8]) -> Result<Vec<u8>, TransportError> {
        self.transport.all_gather(mine)
    }

    fn round_time(&self) -> Option<Duration> {
        self.last_time
    }
}

impl Drop for NcclDeviceEngine {
    fn drop(&mut self) {
        // the buffers the stream's work uses are dropped after this
        let _ = bind(&self.gpu);
        let _ = self.gpu.synchronize();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn geo() -> NcclGeometry {
        NcclGeometry {
            sources: 2,
            ffn_ranks: 1,
            epr: 3,
            top_k: 2,
            hidden: 5,
            cap: 4,
        }
    }

    /// A compact row: token, local ids, weights.
    type Row = (u32, [i32; 2], [f32; 2]);

    /// Slabs and a workspace as the device would write them for two sources.
    fn device_bytes(g: &NcclGeometry) -> (Vec<u8>, Vec<u8>) {
        let mut slabs = vec![0u8; g.sources * g.slab_bytes()];
        // source 0: tokens 1 and 3 (ids {0, -1}, {2, 1}); source 1: token 0 (ids {-1, 1})
        let rows: [&[Row]; 2] = [
            &[(1, [0, -1], [0.5, 0.0]), (3, [2, 1], [0.25, 0.75])],
            &[(0, [-1, 1], [0.0, 1.0])],
        ];
        for (s, rs) in rows.iter().enumerate() {
            let slab = &mut slabs[s * g.slab_bytes()..(s + 1) * g.slab_bytes()];
            slab[..4].copy_from_slice(&(rs.len() as u32).to_le_bytes());
            for (r, (t, ids, ws)) in rs.iter().enumerate() {
                let row = &mut slab[HEADER_BYTES + r * g.row_bytes()..][..g.row_bytes()];
                row[..4].copy_from_slice(&t.to_le_bytes());
                for j in 0..2 {
                    row[4 + 4 * j..8 + 4 * j].copy_from_slice(&ids[j].to_le_bytes());
                    row[12 + 4 * j..16 + 4 * j].copy_from_slice(&ws[j].to_bits().to_le_bytes());
                }
                for c in 0..g.hidden {
                    let v = bf16::from_f32((10 * s + r) as f32 + c as f32 / 8.0).to_bits();
                    row[g.pay_off() + 2 * c..g.pay_off() + 2 * c + 2]
                        .copy_from_slice(&v.to_le_bytes());
                }
            }
        }
        // plan: counts[l][s] = l0: {1, 0}, l1: {1, 1}, l2: {1, 0}
        let counts = [1u64, 0, 1, 1, 1, 0];
        let starts = [0u64, 1, 1, 2, 3, 4];
        let eo = [0u64, 1, 3, 4];
        let mut ws = vec![0u8; g.exp_off() + 4 * g.hidden * 2];
        for (i, v) in counts.iter().chain(&starts).chain(&eo).enumerate() {
            ws[8 * i..8 * i + 8].copy_from_slice(&v.to_le_bytes());
        }
        for (j, b) in ws[g.exp_off()..].iter_mut().enumerate() {
            *b = j as u8;
        }
        (slabs, ws)
    }

    #[test]
    fn received_reads_the_plan_and_the_compact_view() {
        let g = geo();
        let (slabs, ws) = device_bytes(&g);
        let r = received_of(&g, 0, &slabs, &ws).unwrap();
        assert_eq!(r.plan.counts, vec![1, 0, 1, 1, 1, 0]);
        assert_eq!(r.plan.block_starts, vec![0, 1, 1, 2, 3, 4]);
        assert_eq!(r.plan.expert_offsets, vec![0, 1, 3, 4]);
        assert_eq!(r.plan.slab_offsets, vec![0, 2, 3]);
        assert_eq!(r.compact_tokens, vec![(0, 1), (0, 3), (1, 0)]);
        assert_eq!(r.compact_ids, vec![0, -1, 2, 1, -1, 1]);
        assert_eq!(r.compact_weights, vec![0.5, 0.0, 0.25, 0.75, 0.0, 1.0]);
        assert_eq!(r.compact_x.len(), 3 * 5);
        assert_eq!(r.compact_x[5 + 2], bf16::from_f32(1.0 + 2.0 / 8.0));
        assert_eq!(r.expanded.len(), 4 * 5);
        assert_eq!(r.expanded[0].to_bits(), u16::from_le_bytes([0, 1]));
        assert!(r.fp8.is_none());
    }

    #[test]
    fn received_rejects_a_plan_or_slab_beyond_the_geometry() {
        let g = geo();
        let (mut slabs, mut ws) = device_bytes(&g);
        let eo_last = 8 * (2 * 6 + 3);
        let good = ws[eo_last..eo_last + 8].to_vec();
        ws[eo_last..eo_last + 8].copy_from_slice(&(g.exp_rows() as u64 + 1).to_le_bytes());
        assert!(
            received_of(&g, 0, &slabs, &ws)
                .unwrap_err()
                .contains("rows")
        );
        ws[eo_last..eo_last + 8].copy_from_slice(&good);
        slabs[..4].copy_from_slice(&5u32.to_le_bytes());
        assert!(
            received_of(&g, 0, &slabs, &ws)
                .unwrap_err()
                .contains("capacity")
        );
        assert!(received_of(&g, 0, &slabs[..10], &ws).is_err());
    }

    #[test]
    fn eager_pairs_move_their_rows_and_graphs_whole_slabs() {
        let g = geo();
        assert_eq!(pair_bytes(&g, Some(0)), (HEADER_BYTES, 0));
        assert_eq!(
            pair_bytes(&g, Some(3)),
            (HEADER_BYTES + 3 * g.row_bytes(), 3 * 5 * 4)
        );
        assert_eq!(pair_bytes(&g, None), (g.slab_bytes(), g.ret_slab_bytes()));
        assert_eq!(pair_bytes(&g, Some(4)), pair_bytes(&g, None));
    }

    #[test]
    fn geometry_follows_the_config() {
        let cfg = ExchangeConfig::new("3A:1F".parse().unwrap(), 64, 8, 3, 100).unwrap();
        let g = geometry(&cfg);
        assert_eq!((g.sources, g.ffn_ranks, g.epr), (3, 1, 8));
        assert_eq!((g.top_k, g.hidden, g.cap), (3, 64, 100));
        let cfg = ExchangeConfig::new("EP4".parse().unwrap(), 128, 16, 2, 9).unwrap();
        let g = geometry(&cfg);
        assert_eq!((g.sources, g.ffn_ranks, g.epr), (4, 4, 4));
    }
}
