//! The fused exchange engine (first version: payload-first, bf16 and fp8 payloads): GPU-initiated
//! stores into the
//! symmetric workspaces of an [`NvlinkIpc`] group, one kernel per phase, flags with release /
//! acquire semantics and bounded device waits.
//!
//! One round, on every rank (each calls [`FusedEngine::round`], the same API as
//! [`StagedEngine`](crate::StagedEngine)):
//!
//! 1. **status + counts** (host, one control-plane all-gather; the staged engine's phase): a
//!    rejected route fails every rank with [`ExchangeError::Route`] before anything moves, and
//!    every rank computes every FFN rank's [`FfnPlan`].
//! 2. **dispatch** (source, `afdep_fused_dispatch`): each token row bound for FFN rank f is
//!    stored, with its metadata (token, local ids, weights, expanded rows), into this source's
//!    slab in f's workspace through the peer table; then `afdep_fused_signal` raises this
//!    source's dispatch flag in every FFN rank to the round number (release, system scope).
//!    With fp8 payloads (`afdep_fused_dispatch_fp8`) each row is quantised while it is stored:
//!    its e4m3 codes and one f32 scale per 128 channels ([`afdep_core::fp8`], bit for bit the
//!    host encoder) take the payload's place in the slab row.
//! 3. **copy epilogue** (FFN, `afdep_fused_copy_epilogue`): waits (bounded) for every source's
//!    flag, then expands the slabs into the expanded layout (one row per (token, local expert),
//!    grouped by local expert, [`FfnPlan`]'s offsets). The slabs are the compact collect view.
//!    fp8 (`afdep_fused_copy_epilogue_fp8`): codes and scales are expanded, and the dequantised
//!    bf16 rows (`bf16(f32(q) · scale)`) written beside them for the experts;
//!    [`FfnReceived::fp8`] carries codes and scales of both views.
//! 4. **experts** (FFN, host in this version: the expanded rows are read back, the
//!    [`ExpertFn`] applied per local expert, the outputs uploaded).
//! 5. **combine** (FFN, `afdep_fused_combine_store`): each expert output row is stored into this
//!    FFN rank's return area in its source's workspace (per source, local experts in order, the
//!    staged engine's return order), then the FFN rank's combine flag is raised in every source.
//!    The source's `afdep_fused_combine` waits (bounded) for every FFN rank's flag and sums in the
//!    brief's fixed order (FFN ranks ascending, slots ascending, f32, bf16 once): bit-identical
//!    to the oracle and the staged engine.
//!
//! # Workspace (bytes from every rank's workspace base, the same on every rank)
//!
//! ```text
//! 0      dispatch flags  u32[world]  (indexed by source rank)
//! 256    combine flags   u32[world]  (indexed by FFN rank)
//! 512    error word      u32[4]      {code, peer, round, 0}
//! 1024   slabs           world × capacity rows of slab_row_bytes_for(payload, hidden, K)
//!                        (by source rank)
//! ret    return areas    world × capacity·K rows of hidden bf16                (by FFN rank)
//! ```
//!
//! [`FusedEngine::workspace_bytes`] gives the size an [`NvlinkOptions`](afdep_transport::NvlinkOptions) must provide.
//!
//! # Ordering, waits and the SM budget
//!
//! Flags hold the round number and only grow, so a flag from an earlier round never satisfies a
//! later wait. A slab is rewritten in round r+1 only after its FFN rank's combine flag of round
//! r reached the source, which that FFN rank raised after its epilogue of round r had read the
//! slab; a return area likewise. The waiting kernels (epilogue, combine) spin at most the
//! transport's timeout, then record a fault and exit: the round fails with
//! [`ExchangeError::DeviceTimeout`] naming the phase, the rank and the late peer, and the engine
//! closes ([`ExchangeError::Closed`] afterwards: flags and slabs are then in an unknown state).
//! Ranks that share one GPU (the in-process tests) run concurrently on their own streams; the
//! waiting kernels' grids are capped (`knobs.epilogue_sm_cap` for the epilogue,
//! `knobs.transport_sms` for the others) so that every rank's kernels stay resident together.
//!
//! Because ranks may share one GPU, nothing that can synchronise the context runs while a round
//! is in flight: the fused kernels are loaded at set-up ([`FusedEngine::new`] ends with a
//! barrier), per-round buffers come from cudarc's stream-ordered allocator, and callers should
//! drop the engines only once every rank has finished its last round (freeing device memory may
//! wait for the whole device; the tests join every rank's thread first).
//!
//! Not in this version: count-first, experts on the device, CUDA-graph capture.

use std::time::Instant;

use afdep_core::fp8;
use afdep_core::layout::{FfnPlan, compact_slots, payload_first_slabs, return_positions};
use afdep_core::oracle::exchange::{FfnReceived, Fp8Received, SourceInput};
use afdep_core::route::MASKED;
use afdep_core::{ExchangeConfig, PayloadKind, bf16};
use afdep_kernels::cudarc::driver::{CudaSlice, result as cures};
use afdep_kernels::ops::fused::{
    self as fk, CombineSlots, EpilogueSources, Fp8Expanded, ReturnList, SendList, SlabGeometry,
};
use afdep_kernels::ops::{poison, zeros};
use afdep_kernels::{GpuContext, KernelError};
use afdep_transport::{NvlinkIpc, Transport};
use tracing::debug;

use crate::error::ExchangeError;
use crate::staged::{ExpertFn, PhaseTimes, RoundOutput, agree, count_phase};

/// Byte offset of the dispatch flags in every workspace.
pub const DISPATCH_FLAGS: u64 = 0;
/// Byte offset of the combine flags.
pub const COMBINE_FLAGS: u64 = 256;
/// Byte offset of the error word.
pub const ERROR_WORD: u64 = 512;
/// Byte offset of the slabs.
pub const SLABS: u64 = 1024;
/// Most ranks of one group (the flag areas hold 64 u32).
pub const MAX_WORLD: usize = 64;

/// The workspace geometry of a config.
#[derive(Debug, Clone, Copy)]
struct Geometry {
    slab: SlabGeometry,
    ret_off: u64,
    ret_cap: u64,
    bytes: u64,
}

fn geometry(cfg: &ExchangeConfig) -> Geometry {
    let world = cfg.topology.world_size() as u64;
    let row_bytes = fk::slab_row_bytes_for(cfg.payload, cfg.hidden, cfg.top_k) as u64;
    let cap = cfg.capacity as u64;
    let ret_off = (SLABS + world * cap * row_bytes).div_ceil(256) * 256;
    let ret_cap = cap * cfg.top_k as u64;
    let bytes = ret_off + world * ret_cap * 2 * cfg.hidden as u64;
    Geometry {
        slab: SlabGeometry {
            slab_off: SLABS,
            cap: cfg.capacity as u32,
            row_bytes,
            hidden: cfg.hidden as u32,
        },
        ret_off,
        ret_cap,
        bytes,
    }
}

/// The fused engine of one rank; see the [module docs](self).
pub struct FusedEngine {
    cfg: ExchangeConfig,
    transport: NvlinkIpc,
    gpu: GpuContext,
    geo: Geometry,
    round: u32,
    closed: Option<String>,
    /// This rank's workspace base and the device peer table.
    ws: u64,
    peers: u64,
    /// Attention ranks and FFN ranks, ascending, on the device.
    src_ranks: CudaSlice<u32>,
    ffn_ranks: CudaSlice<u32>,
}

impl std::fmt::Debug for FusedEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FusedEngine")
            .field("rank", &self.transport.rank())
            .field("topology", &self.cfg.topology)
            .field("round", &self.round)
            .finish()
    }
}

fn upload<T: afdep_kernels::cudarc::driver::DeviceRepr + Copy + Default>(
    gpu: &GpuContext,
    v: &[T],
) -> Result<CudaSlice<T>, ExchangeError> {
    if v.is_empty() {
        return Ok(gpu
            .stream()
            .null()
            .map_err(KernelError::driver("allocating an empty buffer"))?);
    }
    Ok(gpu
        .stream()
        .clone_htod(v)
        .map_err(KernelError::driver("copying to the device"))?)
}

impl FusedEngine {
    /// Workspace bytes every rank's [`NvlinkOptions`](afdep_transport::NvlinkOptions) must
    /// provide for `cfg`.
    pub fn workspace_bytes(cfg: &ExchangeConfig) -> usize {
        geometry(cfg).bytes as usize
    }

    /// Sets up the engine on this rank: the staged engine's agreement (config fingerprints,
    /// world size; collective), the checks that the workspace is large enough and the world at
    /// most [`MAX_WORLD`], then a [`GpuContext`] on the transport's device with every fused
    /// kernel loaded, and a barrier. Collective.
    pub fn new(cfg: ExchangeConfig, mut transport: NvlinkIpc) -> Result<Self, ExchangeError> {
        agree(&cfg, &mut transport)?;
        let rank = transport.rank();
        let geo = geometry(&cfg);
        let world = transport.world_size();
        if world > MAX_WORLD {
            return Err(ExchangeError::Input {
                rank,
                what: format!("{world} ranks: the fused engine supports at most {MAX_WORLD}"),
            });
        }
        let have = transport.options().workspace_bytes as u64;
        if have < geo.bytes {
            return Err(ExchangeError::Input {
                rank,
                what: format!(
                    "the NvlinkIpc workspace holds {have} bytes, the fused engine needs {} \
                     (FusedEngine::workspace_bytes)",
                    geo.bytes
                ),
            });
        }
        let gpu = GpuContext::new(transport.device())?;
        // no lazy kernel load during a round (it may synchronise the context while another
        // rank's kernel spins on this GPU): load everything now, then wait for every rank
        fk::preload(&gpu, cfg.top_k)?;
        transport.barrier()?;
        let topo = cfg.topology;
        let src: Vec<u32> = topo.attention_ranks().map(|r| r as u32).collect();
        let ffn: Vec<u32> = (0..cfg.placement().ffn_ranks)
            .map(|f| topo.ffn_rank(f) as u32)
            .collect();
        let src_ranks = upload(&gpu, &src)?;
        let ffn_ranks = upload(&gpu, &ffn)?;
        let ws = transport.workspace_peers()[rank];
        let peers = transport.workspace_peer_table();
        Ok(FusedEngine {
            cfg,
            transport,
            gpu,
            geo,
            round: 0,
            closed: None,
            ws,
            peers,
            src_ranks,
            ffn_ranks,
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

    /// The transport.
    pub fn transport_mut(&mut self) -> &mut NvlinkIpc {
        &mut self.transport
    }

    /// Reads `len` bytes at `offset` of this rank's workspace (waits for the stream).
    fn read_ws(&self, offset: u64, len: usize) -> Result<Vec<u8>, ExchangeError> {
        let mut out = vec![0u8; len];
        if len == 0 {
            return Ok(out);
        }
        self.gpu
            .cuda()
            .bind_to_thread()
            .map_err(KernelError::driver("binding the context"))?;
        // SAFETY: [ws + offset, + len) lies in this rank's workspace (the geometry fits it,
        // checked at set-up); `out` outlives the copy, which is waited for below.
        unsafe {
            cures::memcpy_dtoh_async(&mut out, self.ws + offset, self.gpu.stream().cu_stream())
        }
        .map_err(KernelError::driver("reading the workspace"))?;
        self.gpu.synchronize()?;
        Ok(out)
    }

    /// Waits for the stream, then checks the error word: a fault closes the engine.
    fn check_fault(&mut self) -> Result<(), ExchangeError> {
        self.gpu.synchronize()?;
        let w: Vec<u32> = bytemuck::pod_collect_to_vec(&self.read_ws(ERROR_WORD, 16)?);
        if w[0] == 0 {
            return Ok(());
        }
        let phase = match w[0] {
            fk::fault::DISPATCH_WAIT => "dispatch",
            fk::fault::COMBINE_WAIT => "combine",
            _ => "unknown phase",
        };
        let e = ExchangeError::DeviceTimeout {
            rank: self.rank(),
            phase,
            peer: w[1] as usize,
            round: w[2],
        };
        self.closed = Some(e.to_string());
        Err(e)
    }

    /// Runs one round. Attention ranks pass `Some(input)`; FFN-only ranks pass `None`.
    /// `expert` is used on FFN ranks. Collective: every rank of the topology must call it.
    pub fn round(
        &mut self,
        input: Option<&SourceInput>,
        expert: &dyn ExpertFn,
    ) -> Result<RoundOutput, ExchangeError> {
        let rank = self.rank();
        if let Some(why) = &self.closed {
            return Err(ExchangeError::Closed {
                rank,
                why: why.clone(),
            });
        }
        let r = self.round_inner(input, expert);
        if let Err(e) = &r {
            // anything but a rejected round may leave stores or waits half done
            if !matches!(e, ExchangeError::Route { .. }) && self.closed.is_none() {
                self.closed = Some(e.to_string());
            }
        }
        r
    }

    fn round_inner(
        &mut self,
        input: Option<&SourceInput>,
        expert: &dyn ExpertFn,
    ) -> Result<RoundOutput, ExchangeError> {
        let rank = self.rank();
        let cfg = self.cfg.clone();
        let topo = cfg.topology;
        let p = cfg.placement();
        let (h, k) = (cfg.hidden, cfg.top_k);
        let nf = p.ffn_ranks;
        let ns = topo.attention_count();
        let src_index = topo.attention_index(rank);
        let ffn_index = topo.ffn_index(rank);
        let geo = self.geo;
        let timeout_ns = self.transport.timeout().as_nanos().min(u64::MAX as u128) as u64;
        let knobs = cfg.knobs;
        let mut times = PhaseTimes::default();

        // 1. status + counts
        let t0 = Instant::now();
        let sources = count_phase(&cfg, &mut self.transport, input)?;
        let plans: Vec<FfnPlan> = (0..nf).map(|f| FfnPlan::build(f, &p, &sources)).collect();
        self.round += 1;
        let round = self.round;
        times.counts = t0.elapsed();
        debug!(rank, round, "fused round");

        // 2. dispatch (sources)
        let t1 = Instant::now();
        if let (Some(s), Some(inp)) = (src_index, input) {
            let mw = fk::meta_words(k);
            let (mut token, mut dst_rank, mut slab_row, mut meta) =
                (Vec::new(), Vec::new(), Vec::new(), Vec::<u32>::new());
            for (f, slab) in payload_first_slabs(&inp.routes, &p).iter().enumerate() {
                let (ids, ws) = compact_slots(&inp.routes, &p, f, slab);
                let mut next = vec![0u64; p.experts_per_rank];
                for (i, &t) in slab.iter().enumerate() {
                    token.push(t);
                    dst_rank.push(topo.ffn_rank(f) as u32);
                    slab_row.push(i as u32);
                    let start = meta.len();
                    meta.extend_from_slice(&[t, 0]);
                    meta.extend(ids[i * k..(i + 1) * k].iter().map(|&l| l as u32));
                    meta.extend(ws[i * k..(i + 1) * k].iter().map(|w| w.to_bits()));
                    for &l in &ids[i * k..(i + 1) * k] {
                        let row = if l == MASKED {
                            fk::NO_ROW
                        } else {
                            let l = l as usize;
                            let r = plans[f].block_start(l, s) + next[l];
                            next[l] += 1;
                            r
                        };
                        meta.extend_from_slice(&[row as u32, (row >> 32) as u32]);
                    }
                    debug_assert_eq!(meta.len() - start, mw);
                }
            }
            let x = upload(&self.gpu, &inp.x)?;
            let token_d = upload(&self.gpu, &token)?;
            let dst_d = upload(&self.gpu, &dst_rank)?;
            let row_d = upload(&self.gpu, &slab_row)?;
            let meta_d = upload(&self.gpu, &meta)?;
            let dispatch = match cfg.payload {
                PayloadKind::Bf16 => fk::dispatch,
                PayloadKind::Fp8E4m3 => fk::dispatch_fp8,
            };
            dispatch(
                &self.gpu,
                &x,
                inp.routes.tokens,
                &SendList {
                    token: &token_d,
                    dst_rank: &dst_d,
                    slab_row: &row_d,
                    meta: &meta_d,
                    rows: token.len(),
                },
                k,
                self.peers,
                rank,
                &geo.slab,
                knobs.transport_sms,
            )?;
            fk::signal(
                &self.gpu,
                self.peers,
                &self.ffn_ranks,
                nf,
                DISPATCH_FLAGS,
                rank,
                round,
            )?;
            // the host buffers above must live until the copies ran
            self.gpu.synchronize()?;
        }

        // 3. copy epilogue (FFN ranks)
        let mut received = None;
        let mut y_rows: Vec<bf16> = Vec::new();
        if let Some(f) = ffn_index {
            let plan = plans[f].clone();
            let total = plan.total_rows() as usize;
            let mut expanded: CudaSlice<bf16> = zeros(&self.gpu, total * h)?;
            poison(&self.gpu, &mut expanded)?;
            let starts = upload(&self.gpu, &plan.slab_offsets)?;
            let src = EpilogueSources {
                rank: &self.src_ranks,
                slab_starts: &starts,
                sources: ns,
                total: plan.total_tokens(),
            };
            let g = fp8::scales_per_row(h);
            // fp8: the codes and scales of the expanded layout beside the dequantised rows
            let mut fp8_dev: Option<(CudaSlice<u8>, CudaSlice<f32>)> = None;
            match cfg.payload {
                PayloadKind::Bf16 => fk::copy_epilogue(
                    &self.gpu,
                    self.ws,
                    &src,
                    DISPATCH_FLAGS,
                    &geo.slab,
                    k,
                    round,
                    timeout_ns,
                    self.ws + ERROR_WORD,
                    &mut expanded,
                    total,
                    knobs.epilogue_sm_cap,
                )?,
                PayloadKind::Fp8E4m3 => {
                    let mut q: CudaSlice<u8> = zeros(&self.gpu, total * h)?;
                    let mut sc: CudaSlice<f32> = zeros(&self.gpu, total * g)?;
                    poison(&self.gpu, &mut q)?;
                    poison(&self.gpu, &mut sc)?;
                    fk::copy_epilogue_fp8(
                        &self.gpu,
                        self.ws,
                        &src,
                        DISPATCH_FLAGS,
                        &geo.slab,
                        k,
                        round,
                        timeout_ns,
                        self.ws + ERROR_WORD,
                        Fp8Expanded {
                            q: &mut q,
                            scales: &mut sc,
                            dequant: &mut expanded,
                        },
                        total,
                        knobs.epilogue_sm_cap,
                    )?;
                    fp8_dev = Some((q, sc));
                }
            }
            self.check_fault()?;
            let expanded_h: Vec<bf16> = afdep_kernels::ops::download(&self.gpu, &expanded)?;
            let mut fp8_rx = match &fp8_dev {
                None => None,
                Some((q, sc)) => Some(Fp8Received {
                    expanded_q: afdep_kernels::ops::download(&self.gpu, q)?,
                    expanded_scales: afdep_kernels::ops::download(&self.gpu, sc)?,
                    compact_q: Vec::new(),
                    compact_scales: Vec::new(),
                }),
            };
            // the compact collect view: the slabs themselves (fp8: the codes and scales as
            // stored, and their dequantised rows)
            let (mut compact_tokens, mut compact_x, mut compact_ids, mut compact_weights) =
                (Vec::new(), Vec::new(), Vec::new(), Vec::new());
            let payload = fk::slab_payload_bytes(cfg.payload, h);
            for (s, c) in sources.iter().enumerate() {
                let n = c.ffn_tokens[f] as usize;
                let src_rank = topo.attention_ranks().start + s;
                let off = geo.slab.slab_off
                    + (src_rank as u64 * geo.slab.cap as u64) * geo.slab.row_bytes;
                let bytes = self.read_ws(off, n * geo.slab.row_bytes as usize)?;
                for row in bytes.chunks(geo.slab.row_bytes as usize) {
                    match fp8_rx.as_mut() {
                        None => compact_x
                            .extend(bytemuck::pod_collect_to_vec::<u8, bf16>(&row[..2 * h])),
                        Some(rx) => {
                            let q = &row[..h];
                            let at = h.div_ceil(16) * 16;
                            let sc: Vec<f32> = bytemuck::pod_collect_to_vec(&row[at..at + 4 * g]);
                            let mut deq = vec![bf16::ZERO; h];
                            fp8::dequantise_row(q, &sc, &mut deq);
                            compact_x.extend(deq);
                            rx.compact_q.extend_from_slice(q);
                            rx.compact_scales.extend(sc);
                        }
                    }
                    let m: Vec<u32> = bytemuck::pod_collect_to_vec(
                        &row[payload..payload + 4 * fk::meta_words(k)],
                    );
                    compact_tokens.push((s as u32, m[0]));
                    compact_ids.extend(m[2..2 + k].iter().map(|&v| v as i32));
                    compact_weights.extend(m[2 + k..2 + 2 * k].iter().map(|&v| f32::from_bits(v)));
                }
            }
            times.dispatch = t1.elapsed();

            // 4. experts (host)
            let t2 = Instant::now();
            y_rows.reserve(expanded_h.len());
            for l in 0..p.experts_per_rank {
                let (a, b) = (
                    plan.expert_offsets[l] as usize,
                    plan.expert_offsets[l + 1] as usize,
                );
                if a == b {
                    continue;
                }
                let e = p.experts_of(f).start + l;
                let ye = expert(e, &expanded_h[a * h..b * h], b - a);
                if ye.len() != (b - a) * h {
                    return Err(ExchangeError::Input {
                        rank,
                        what: format!("expert {e} returned {} values for {} rows", ye.len(), b - a),
                    });
                }
                y_rows.extend(ye);
            }
            times.experts = t2.elapsed();
            received = Some(FfnReceived {
                plan,
                expanded: expanded_h,
                compact_tokens,
                compact_x,
                compact_ids,
                compact_weights,
                fp8: fp8_rx,
            });
        } else {
            times.dispatch = t1.elapsed();
        }

        // 5. combine: stores back (FFN ranks), then the sums (sources)
        let t3 = Instant::now();
        if let Some(f) = ffn_index {
            let plan = &plans[f];
            let total = plan.total_rows() as usize;
            let mut dst_rank = vec![0u32; total];
            let mut dst_row = vec![0u64; total];
            for s in 0..ns {
                let mut prefix = 0u64;
                for l in 0..p.experts_per_rank {
                    let a = plan.block_start(l, s);
                    let n = plan.counts[l * ns + s];
                    for j in 0..n {
                        dst_rank[(a + j) as usize] = (topo.attention_ranks().start + s) as u32;
                        dst_row[(a + j) as usize] = prefix + j;
                    }
                    prefix += n;
                }
            }
            let y = upload(&self.gpu, &y_rows)?;
            let dr = upload(&self.gpu, &dst_rank)?;
            let dw = upload(&self.gpu, &dst_row)?;
            fk::combine_store(
                &self.gpu,
                &y,
                &ReturnList {
                    dst_rank: &dr,
                    dst_row: &dw,
                    rows: total,
                },
                self.peers,
                geo.ret_off,
                rank,
                geo.ret_cap,
                h,
                knobs.transport_sms,
            )?;
            fk::signal(
                &self.gpu,
                self.peers,
                &self.src_ranks,
                ns,
                COMBINE_FLAGS,
                rank,
                round,
            )?;
            self.gpu.synchronize()?;
        }
        let mut combined = None;
        if let (Some(s), Some(inp)) = (src_index, input) {
            let t = inp.routes.tokens;
            let pos = return_positions(&inp.routes, &p, &sources[s]);
            let mut row = vec![fk::NO_ROW; t * k];
            let mut owner = vec![0u32; t * k];
            for (i, d) in pos.iter().enumerate() {
                if let Some(d) = d {
                    row[i] = topo.ffn_rank(d.ffn) as u64 * geo.ret_cap + d.row;
                    owner[i] = d.ffn as u32;
                }
            }
            let row_d = upload(&self.gpu, &row)?;
            let own_d = upload(&self.gpu, &owner)?;
            let w_d = upload(&self.gpu, &inp.routes.weights)?;
            let mut out: CudaSlice<bf16> = zeros(&self.gpu, t * h)?;
            poison(&self.gpu, &mut out)?;
            fk::combine(
                &self.gpu,
                self.ws,
                &self.ffn_ranks,
                nf,
                COMBINE_FLAGS,
                geo.ret_off,
                &CombineSlots {
                    row: &row_d,
                    ffn: &own_d,
                    weight: &w_d,
                    tokens: t,
                },
                k,
                h,
                round,
                timeout_ns,
                self.ws + ERROR_WORD,
                &mut out,
                knobs.transport_sms,
            )?;
            self.check_fault()?;
            combined = Some(afdep_kernels::ops::download(&self.gpu, &out)?);
        }
        times.combine = t3.elapsed();
        Ok(RoundOutput {
            combined,
            received,
            times,
        })
    }
}
