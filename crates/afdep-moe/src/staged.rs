//! The staged exchange engine: host-driven AFD dispatch and combine over any [`Transport`].
//!
//! One round, on every rank of the topology (each rank calls [`StagedEngine::round`]):
//!
//! 1. **status + counts** (one all-gather): each attention rank validates its routes and
//!    publishes its error word ([`RouteError::to_word`](afdep_core::RouteError::to_word), zero when valid) and its
//!    [`SourceCounts`]. If any word is non-zero, every rank returns
//!    [`ExchangeError::Route`] with the error of the lowest-numbered rejecting rank, before any
//!    row moves; the next round starts clean.
//! 2. **plans**: every rank computes every FFN rank's [`FfnPlan`] from the gathered counts, so
//!    sources and FFN ranks agree on all sizes without another message.
//! 3. **dispatch** (all-to-all-v): each source sends each FFN rank its payload-first slab —
//!    each token once, in token order, with its K local expert ids and weights. The FFN rank
//!    expands the rows into the expanded layout with the copy epilogue ([`copy_plan`]).
//! 4. **experts**: each FFN rank applies its experts to each local expert's group of rows.
//! 5. **combine** (all-to-all-v): each FFN rank returns to each source its blocks for that
//!    source, in local-expert order; the source combines them in the fixed order of
//!    [`afdep_core::oracle::exchange`], so results are bit-identical to the oracle. With bf16
//!    partials ([`afdep_core::CombinePartials::Bf16`]) the source rounds each FFN rank's
//!    partial to bf16 before it adds it, as the oracle does: the same result as the fused
//!    engine's bf16 partials, but no bytes saved (the staged engine returns rows, not partials).
//!
//! Wire formats are native-endian (afdep runs on little-endian hosts). A dispatch message of
//! `n` tokens is `[n × hidden bf16][n u32 token indices][n × K i32 local ids][n × K f32
//! weights]` with bf16 payloads, and `[n × hidden e4m3 codes][n × hidden/128 f32 scales][n u32
//! token indices][n × K i32 local ids][n × K f32 weights]` with fp8 payloads (the source
//! quantises each row it sends, [`afdep_core::fp8`]; the FFN rank expands codes and scales
//! and dequantises the rows for its experts: bit-identical to the oracle's fp8 dispatch); a
//! combine message of `m` rows is `m × hidden bf16`.

use std::time::Instant;

use afdep_core::fp8::{self, QuantisedRows};
use afdep_core::layout::{
    FfnPlan, SourceCounts, compact_slots, copy_plan, payload_first_slabs, return_positions,
};
use afdep_core::oracle::exchange::{FfnReceived, Fp8Received, SourceInput, combine_source};
use afdep_core::{ExchangeConfig, PayloadKind, bf16};
use afdep_transport::{Span, Transport, TransportBuffer, TransportError};

use crate::error::ExchangeError;
use crate::round::{
    ExchangeEngine, ExpertFn, PhaseTimes, RoundOutput, agree, apply_experts, count_phase,
};

/// The staged engine of one rank.
pub struct StagedEngine<T: Transport> {
    cfg: ExchangeConfig,
    transport: T,
    send: Option<T::Buffer>,
    recv: Option<T::Buffer>,
}

fn u8s_of<P: bytemuck::Pod>(v: &[P]) -> &[u8] {
    bytemuck::cast_slice(v)
}

/// Bytes of one token of a dispatch message: payload (bf16 row, or e4m3 codes and f32 scales),
/// token index, K local ids and K weights.
pub(crate) fn dispatch_row_bytes(cfg: &ExchangeConfig) -> usize {
    let (h, k) = (cfg.hidden, cfg.top_k);
    let payload = match cfg.payload {
        PayloadKind::Bf16 => 2 * h,
        PayloadKind::Fp8E4m3 => h + 4 * fp8::scales_per_row(h),
    };
    payload + 4 + 8 * k
}

impl<T: Transport> StagedEngine<T> {
    /// Sets up the engine on this rank: validates the config, checks that the transport's world
    /// matches the topology, and compares config fingerprints with every rank (the error names
    /// the first field that differs and the lowest rank that differs). Collective.
    pub fn new(cfg: ExchangeConfig, mut transport: T) -> Result<Self, ExchangeError> {
        agree(&cfg, &mut transport)?;
        Ok(StagedEngine {
            cfg,
            transport,
            send: None,
            recv: None,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &ExchangeConfig {
        &self.cfg
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.transport.rank()
    }

    /// The transport (for barriers and timing between rounds).
    pub fn transport_mut(&mut self) -> &mut T {
        &mut self.transport
    }

    fn buffers(&mut self, send: usize, recv: usize) -> Result<(), ExchangeError> {
        if self.send.as_ref().is_none_or(|b| b.len() < send) {
            self.send = Some(self.transport.alloc(send.next_power_of_two().max(64))?);
        }
        if self.recv.as_ref().is_none_or(|b| b.len() < recv) {
            self.recv = Some(self.transport.alloc(recv.next_power_of_two().max(64))?);
        }
        Ok(())
    }

    /// Runs one round. Attention ranks pass `Some(input)`; FFN-only ranks pass `None`.
    /// `expert` is used on FFN ranks. Collective: every rank of the topology must call it.
    pub fn round(
        &mut self,
        input: Option<&SourceInput>,
        expert: &dyn ExpertFn,
    ) -> Result<RoundOutput, ExchangeError> {
        let rank = self.rank();
        let cfg = self.cfg.clone();
        let p = cfg.placement();
        let ffn_index = cfg.topology.ffn_index(rank);
        let mut times = PhaseTimes::default();

        // 1. status + counts
        let t0 = Instant::now();
        let sources = count_phase(&cfg, &mut self.transport, input)?;
        let plans: Vec<FfnPlan> = (0..p.ffn_ranks)
            .map(|f| FfnPlan::build(f, &p, &sources))
            .collect();
        times.counts = t0.elapsed();

        // 2-3. dispatch: compact slabs with metadata, expanded on the FFN rank
        let t1 = Instant::now();
        let bytes = self.dispatch(rank, input, &sources)?;
        let mut received = None;
        let mut y_rows: Vec<bf16> = Vec::new();
        if let (Some(f), Some(bytes)) = (ffn_index, bytes) {
            let rx = expand(&cfg, f, &plans[f], &sources, &bytes);
            times.dispatch = t1.elapsed();

            // 4. experts
            let t2 = Instant::now();
            y_rows = apply_experts(&cfg, rank, f, &rx.plan, &rx.expanded, expert)?;
            times.experts = t2.elapsed();
            received = Some(rx);
        } else {
            times.dispatch = t1.elapsed();
        }

        // 5. combine
        let t3 = Instant::now();
        let combined = self.combine(rank, input, &sources, &plans, &y_rows)?;
        times.combine = t3.elapsed();
        Ok(RoundOutput {
            combined,
            received,
            times,
        })
    }

    /// The dispatch all-to-all-v: a source sends each FFN rank its payload-first slab; an FFN
    /// rank gets every source's message, concatenated in source order (`None` elsewhere). The
    /// buffers are sized for the combine too.
    fn dispatch(
        &mut self,
        rank: usize,
        input: Option<&SourceInput>,
        sources: &[SourceCounts],
    ) -> Result<Option<Vec<u8>>, ExchangeError> {
        let cfg = &self.cfg;
        let topo = cfg.topology;
        let h = cfg.hidden;
        let world = topo.world_size();
        let (src_index, ffn_index) = (topo.attention_index(rank), topo.ffn_index(rank));
        let row_bytes = dispatch_row_bytes(cfg);
        let mut send_spans = vec![Span { offset: 0, len: 0 }; world];
        let mut recv_spans = vec![Span { offset: 0, len: 0 }; world];
        let packed = match (src_index, input) {
            (Some(s), Some(inp)) => pack_dispatch(cfg, s, inp, sources, &mut send_spans),
            _ => Vec::new(),
        };
        let mut recv_total = 0u64;
        if let Some(f) = ffn_index {
            for (s, c) in sources.iter().enumerate() {
                let len = c.ffn_tokens[f] * row_bytes as u64;
                recv_spans[topo.attention_ranks().start + s] = Span {
                    offset: recv_total,
                    len,
                };
                recv_total += len;
            }
        }
        // the combine phase reuses the buffers: size them for both phases
        let ret_send: u64 = ffn_index.map_or(0, |f| {
            sources.iter().map(|c| c.ffn_rows[f]).sum::<u64>() * h as u64 * 2
        });
        let ret_recv: u64 = src_index.map_or(0, |s| {
            sources[s].ffn_rows.iter().sum::<u64>() * h as u64 * 2
        });
        self.buffers(
            packed.len().max(ret_send as usize),
            (recv_total.max(ret_recv)) as usize,
        )?;
        let send = self.send.as_mut().expect("allocated");
        send.write(0, &packed)?;
        let recv = self.recv.as_mut().expect("allocated");
        self.transport
            .all_to_all_v(send, &send_spans, recv, &recv_spans)?;
        if ffn_index.is_none() {
            return Ok(None);
        }
        let mut bytes = vec![0u8; recv_total as usize];
        recv.read(0, &mut bytes)?;
        Ok(Some(bytes))
    }

    /// The combine all-to-all-v: an FFN rank returns each source its blocks (in local-expert
    /// order), and a source combines what every FFN rank returned in the oracle's fixed order
    /// (its combined rows; `None` on FFN-only ranks).
    fn combine(
        &mut self,
        rank: usize,
        input: Option<&SourceInput>,
        sources: &[SourceCounts],
        plans: &[FfnPlan],
        y_rows: &[bf16],
    ) -> Result<Option<Vec<bf16>>, ExchangeError> {
        let cfg = &self.cfg;
        let topo = cfg.topology;
        let p = cfg.placement();
        let h = cfg.hidden;
        let world = topo.world_size();
        let (src_index, ffn_index) = (topo.attention_index(rank), topo.ffn_index(rank));
        let mut send_spans = vec![Span { offset: 0, len: 0 }; world];
        let mut recv_spans = vec![Span { offset: 0, len: 0 }; world];
        let mut back: Vec<u8> = Vec::new();
        if let Some(f) = ffn_index {
            let plan = &plans[f];
            for s in 0..sources.len() {
                let start = back.len();
                for l in 0..p.experts_per_rank {
                    let a = plan.block_start(l, s) as usize;
                    let n = plan.counts[l * plan.sources + s] as usize;
                    back.extend_from_slice(u8s_of(&y_rows[a * h..(a + n) * h]));
                }
                send_spans[topo.attention_ranks().start + s] = Span {
                    offset: start as u64,
                    len: (back.len() - start) as u64,
                };
            }
        }
        let mut off = 0u64;
        if let Some(s) = src_index {
            for f in 0..p.ffn_ranks {
                let len = sources[s].ffn_rows[f] * h as u64 * 2;
                recv_spans[topo.ffn_rank(f)] = Span { offset: off, len };
                off += len;
            }
        }
        let send = self.send.as_mut().expect("allocated");
        send.write(0, &back)?;
        let recv = self.recv.as_mut().expect("allocated");
        self.transport
            .all_to_all_v(send, &send_spans, recv, &recv_spans)?;
        let (Some(s), Some(inp)) = (src_index, input) else {
            return Ok(None);
        };
        let mut bytes = vec![0u8; off as usize];
        recv.read(0, &mut bytes)?;
        let rows: Vec<Vec<bf16>> = (0..p.ffn_ranks)
            .map(|f| {
                let sp = recv_spans[topo.ffn_rank(f)];
                bytemuck::pod_collect_to_vec(
                    &bytes[sp.offset as usize..(sp.offset + sp.len) as usize],
                )
            })
            .collect();
        let refs: Vec<&[bf16]> = rows.iter().map(|r| r.as_slice()).collect();
        let pos = return_positions(&inp.routes, &p, &sources[s]);
        Ok(Some(combine_source(
            &inp.routes,
            h,
            self.cfg.partials,
            |e| p.owner(e).expect("validated"),
            |i| pos[i].expect("unmasked").row,
            &refs,
        )))
    }
}

/// Source `s`'s dispatch messages, one per FFN rank (its payload-first slab: each token once,
/// in token order; fp8: every row quantised once), concatenated; sets each FFN rank's span in
/// `send_spans`.
fn pack_dispatch(
    cfg: &ExchangeConfig,
    s: usize,
    inp: &SourceInput,
    sources: &[SourceCounts],
    send_spans: &mut [Span],
) -> Vec<u8> {
    let p = cfg.placement();
    let h = cfg.hidden;
    let g = fp8::scales_per_row(h);
    let row_bytes = dispatch_row_bytes(cfg);
    let mut packed: Vec<u8> = Vec::new();
    // fp8: every row is quantised once (the count phase checked that the rows that travel are
    // finite; rows of fully masked tokens never travel)
    let quantised = (cfg.payload == PayloadKind::Fp8E4m3).then(|| QuantisedRows::of(&inp.x, h));
    for (f, slab) in payload_first_slabs(&inp.routes, &p).iter().enumerate() {
        let start = packed.len();
        match &quantised {
            None => {
                for &t in slab {
                    let t = t as usize;
                    packed.extend_from_slice(u8s_of(&inp.x[t * h..(t + 1) * h]));
                }
            }
            Some(q) => {
                for &t in slab {
                    let t = t as usize;
                    packed.extend_from_slice(&q.q[t * h..(t + 1) * h]);
                }
                for &t in slab {
                    let t = t as usize;
                    packed.extend_from_slice(u8s_of(&q.scales[t * g..(t + 1) * g]));
                }
            }
        }
        packed.extend_from_slice(u8s_of(slab));
        let (ids, ws) = compact_slots(&inp.routes, &p, f, slab);
        packed.extend_from_slice(u8s_of(&ids));
        packed.extend_from_slice(u8s_of(&ws));
        debug_assert_eq!(packed.len() - start, slab.len() * row_bytes);
        debug_assert_eq!(slab.len() as u64, sources[s].ffn_tokens[f]);
        send_spans[cfg.topology.ffn_rank(f)] = Span {
            offset: start as u64,
            len: (packed.len() - start) as u64,
        };
    }
    packed
}

/// FFN rank `f`'s view of the dispatch messages `bytes` (every source's, in source order): the
/// compact view, then the expanded layout by the copy epilogue ([`copy_plan`]); fp8: codes and
/// scales of both views, and the dequantised rows.
fn expand(
    cfg: &ExchangeConfig,
    f: usize,
    plan: &FfnPlan,
    sources: &[SourceCounts],
    bytes: &[u8],
) -> FfnReceived {
    let (h, k) = (cfg.hidden, cfg.top_k);
    let g = fp8::scales_per_row(h);
    let is_fp8 = cfg.payload == PayloadKind::Fp8E4m3;
    let row_bytes = dispatch_row_bytes(cfg);
    let mut compact_tokens = Vec::new();
    let mut compact_x = Vec::new();
    let mut compact_ids = Vec::new();
    let mut compact_weights = Vec::new();
    let mut compact_q: Vec<u8> = Vec::new();
    let mut compact_scales: Vec<f32> = Vec::new();
    let mut base = 0;
    for (s, c) in sources.iter().enumerate() {
        let n = c.ffn_tokens[f] as usize;
        let msg = &bytes[base..base + n * row_bytes];
        base += n * row_bytes;
        let rest = if is_fp8 {
            let (qs, rest) = msg.split_at(n * h);
            let (scales, rest) = rest.split_at(n * g * 4);
            let scales: Vec<f32> = bytemuck::pod_collect_to_vec(scales);
            let at = compact_x.len();
            compact_x.resize(at + n * h, bf16::ZERO);
            for (i, (q, sc)) in qs.chunks(h).zip(scales.chunks(g)).enumerate() {
                let out = &mut compact_x[at + i * h..at + (i + 1) * h];
                fp8::dequantise_row(q, sc, out);
            }
            compact_q.extend_from_slice(qs);
            compact_scales.extend(scales);
            rest
        } else {
            let (xs, rest) = msg.split_at(n * h * 2);
            compact_x.extend(bytemuck::pod_collect_to_vec::<u8, bf16>(xs));
            rest
        };
        let (toks, rest) = rest.split_at(n * 4);
        let (ids, ws) = rest.split_at(n * k * 4);
        let toks: Vec<u32> = bytemuck::pod_collect_to_vec(toks);
        compact_tokens.extend(toks.into_iter().map(|t| (s as u32, t)));
        compact_ids.extend(bytemuck::pod_collect_to_vec::<u8, i32>(ids));
        compact_weights.extend(bytemuck::pod_collect_to_vec::<u8, f32>(ws));
    }
    let total = plan.total_rows() as usize;
    let mut expanded = vec![bf16::ZERO; total * h];
    let mut fp8_rx = is_fp8.then(|| Fp8Received {
        expanded_q: vec![0; total * h],
        expanded_scales: vec![0.0; total * g],
        compact_q,
        compact_scales,
    });
    for (row, dst) in copy_plan(&compact_ids, k, &plan.expert_offsets) {
        let (row, dst) = (row as usize, dst as usize);
        expanded[dst * h..(dst + 1) * h].copy_from_slice(&compact_x[row * h..(row + 1) * h]);
        if let Some(Fp8Received {
            expanded_q,
            expanded_scales,
            compact_q,
            compact_scales,
        }) = fp8_rx.as_mut()
        {
            expanded_q[dst * h..(dst + 1) * h].copy_from_slice(&compact_q[row * h..(row + 1) * h]);
            expanded_scales[dst * g..(dst + 1) * g]
                .copy_from_slice(&compact_scales[row * g..(row + 1) * g]);
        }
    }
    FfnReceived {
        plan: plan.clone(),
        expanded,
        compact_tokens,
        compact_x,
        compact_ids,
        compact_weights,
        fp8: fp8_rx,
    }
}

impl<T: Transport> ExchangeEngine for StagedEngine<T> {
    fn rank(&self) -> usize {
        StagedEngine::rank(self)
    }

    fn round(
        &mut self,
        input: Option<&SourceInput>,
        expert: &dyn ExpertFn,
    ) -> Result<RoundOutput, ExchangeError> {
        StagedEngine::round(self, input, expert)
    }

    fn barrier(&mut self) -> Result<(), TransportError> {
        self.transport.barrier()
    }

    fn all_gather(&mut self, mine: &[u8]) -> Result<Vec<u8>, TransportError> {
        self.transport.all_gather(mine)
    }
}
