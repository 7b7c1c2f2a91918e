//! Count-first dispatch of the fused engine (docs/design.md, "Specification: AFD exchange"):
//! sources publish per-expert counts computed on the device, each FFN rank computes its plan (the
//! prefix sums of [`FfnPlan`], 64-bit) and publishes each source's block starts, and rows then land
//! either straight in their final expanded rows (the **source arm**,
//! [`DispatchArm::CountFirstSource`]) or in per-source slabs with a per-row readiness flag that a
//! **streaming epilogue** on the FFN rank waits for row by row ([`DispatchArm::CountFirst`]).
//!
//! This file holds what the device rounds' count-first arms share with the rest of the engine (the
//! arm rule, a source's scratch, the names of the fault codes, the poisoning of the expanded
//! area) and the read-back of what an FFN rank received; the launches themselves are the device
//! round's (`fused/device_round.rs`, with the fronts in `fused_front.cu`).
//!
//! One count-first dispatch, in stream order on every rank after `afdep_round_begin` (a rank
//! that is both source and FFN rank runs both columns, in this order, on its one stream, so none
//! of its kernels waits for one queued behind it):
//!
//! 1. source: `afdep_cf_counts` (block positions, compact rows, counts from the routes on the
//!    device; then its last block stores each FFN rank's share into that rank's counts area and
//!    raises the count flag);
//! 2. FFN rank (its expanded area, and in a round that may take the source arm the slab rows it
//!    will receive, poisoned before the round): `afdep_cf_plan`: waits for every source's count flag, writes the plan, and
//!    stores each source's block starts into the source's offsets area, then its offset flag;
//! 3. source: `afdep_cf_dispatch`. Source arm: waits for every FFN rank's offset flag, stores
//!    each row to its expanded rows and the compact view's metadata into its slab row, then
//!    the kernel's last block raises the dispatch flags. Streaming: with the payload gate on, waits
//!    for the offsets first; then each row (payload and metadata) into the slab, then its row
//!    flag (the round number);
//! 4. FFN rank: streaming, `afdep_cf_stream_epilogue` expands each row as its flag arrives;
//!    source arm, `afdep_cf_wait` for every source's dispatch flag.
//!
//! An FFN rank's [`FfnReceived`] (`FusedEngine::read_received`: in
//! [`FusedEngine::round`] before its host experts run, from the slabs; in a device round with
//! `keep_received`, from the snapshot) holds its device plan (the [`FfnPlan`]: the device's
//! numbers, which the tests compare with the oracle's), the expanded rows and the compact view
//! (the slab rows; in the source arm the slabs hold only the metadata and each compact row's
//! payload is read from its first expanded row).
//!
//! # fp8 payloads
//!
//! With [`PayloadKind::Fp8E4m3`] every row is quantised on the device while it is stored (e4m3
//! codes and one f32 scale per 128 channels, bit for bit the host encoder of
//! [`afdep_core::fp8`]; each row once, however many expanded rows it lands in):
//!
//! - streaming: the slab row holds the codes and scales (the payload-first fp8 row format,
//!   `[codes | pad 16][scales | pad 16][metadata]`), and the streaming epilogue writes each of
//!   the row's expanded rows as codes, scales and the dequantised bf16 values
//!   (`bf16(f32(q) · scale)`);
//! - source arm: the source stores the codes and scales straight into the final expanded rows'
//!   code and scale areas (the slab row holds the metadata only), and the FFN rank, after every
//!   source's dispatch flag, dequantises the expanded rows (`afdep_cf_dequant`).
//!
//! The expanded area holds the dequantised bf16 rows (what the experts consume, as in the
//! oracle's fp8 exchange); its codes and scales follow it in the workspace ([`areas`]). The
//! FFN rank's [`FfnReceived`] is then the payload-first fp8 round's: the expanded layout
//! dequantised, [`FfnReceived::fp8`] with the codes and scales of the expanded layout and of
//! the compact view (streaming: the slab rows' codes and scales, dequantised on the host for
//! `compact_x`; source arm: those of each token's first expanded row). A non-finite value in a
//! travelling row is rejected on the device before anything moves (`afdep_round_check_payload`,
//! [`afdep_core::RouteError::NonFinitePayload`] on every rank). Combine is bf16 out, f32 sums, as for bf16.
//!
//! # Arm selection
//!
//! [`DispatchArm::select`]: count-first ([`DispatchArm::CountFirstSource`], the source arm; the
//! record's rule took the streaming variant) when the largest source's token count of the round
//! reaches `knobs.min_token_bucket` (default 1: every round with a token), payload-first below
//! it, for bf16 and fp8 payloads alike. The token counts travel in the
//! device rounds' status records, which every rank reads, so every rank picks the same arm.
//! [`FusedEngine::set_arm`] overrides the rule (every rank must then set the same arm, like the
//! configuration; ranks that do not all skip the round with [`ExchangeError::ArmsDiffer`]).
//!
//! # Knobs
//!
//! - `transport_sms`: grid cap of the source kernels (`afdep_cf_counts`, `afdep_cf_dispatch`).
//! - `epilogue_sm_cap`: the streaming epilogue's grid (blocks of `BLOCK` threads).
//! - `warps_per_unit`, `min_rows_per_unit`: the streaming epilogue's work units (a unit is
//!   `warps_per_unit` warps, capped by the grid; units take contiguous runs of at least
//!   `min_rows_per_unit` compact rows).
//! - `payload_gate`: streaming only; when on, a source stores no row before every FFN rank's
//!   offsets arrived (the rows then never overtake the counts); off, rows stream as soon as
//!   the counts are published. The source arm always waits (it needs the offsets).
//! - `min_token_bucket`: the arm rule above.

use afdep_core::layout::FfnPlan;
use afdep_core::oracle::exchange::{FfnReceived, Fp8Received};
use afdep_core::{ExchangeConfig, PayloadKind, bf16, fp8};
use afdep_kernels::cudarc::driver::{CudaSlice, result as cures};
use afdep_kernels::ops::fused as fk;
use afdep_kernels::ops::fused_cf as cf;
use afdep_kernels::ops::zeros;
use afdep_kernels::{GpuContext, KernelError};

use super::FusedEngine;
use crate::error::ExchangeError;
use crate::round::DispatchArm;

/// A source's device scratch of count-first, sized by the capacity.
#[derive(Debug)]
pub(super) struct CfScratch {
    pub(super) slot_pos: CudaSlice<u32>,
    pub(super) tok_row: CudaSlice<u32>,
    pub(super) counts: CudaSlice<u64>,
}

impl CfScratch {
    pub(super) fn new(gpu: &GpuContext, cfg: &ExchangeConfig) -> Result<Self, KernelError> {
        let p = cfg.placement();
        Ok(CfScratch {
            slot_pos: zeros(gpu, (cfg.capacity * cfg.top_k).max(1))?,
            tok_row: zeros(gpu, (cfg.capacity * p.ffn_ranks).max(1))?,
            counts: zeros(gpu, p.owned() + p.ffn_ranks)?,
        })
    }
}

/// The phase a count-first fault code names.
pub(super) fn fault_phase(code: u32) -> Option<&'static str> {
    match code {
        cf::fault::COUNTS_WAIT => Some("count-first counts"),
        cf::fault::OFFSETS_WAIT => Some("count-first offsets"),
        cf::fault::ROW_WAIT => Some("count-first streaming rows"),
        cf::fault::SOURCE_WAIT => Some("count-first source-arm dispatch"),
        afdep_kernels::ops::fused_round::FAULT_STATUS_WAIT => Some("device round status"),
        afdep_kernels::ops::fused_front::FAULT_FRONT_WAIT => Some("device round front (in-grid)"),
        afdep_kernels::ops::fused_round::FAULT_START_GATE => Some("start gate"),
        _ => None,
    }
}

/// The arm rule of a round of `cfg` whose sources have `tokens` tokens each:
/// [`DispatchArm::select`] on the largest (for every payload kind).
pub(super) fn rule(cfg: &ExchangeConfig, tokens: &[u64]) -> DispatchArm {
    let max = tokens.iter().copied().max().unwrap_or(0);
    DispatchArm::select(&cfg.knobs, usize::try_from(max).unwrap_or(usize::MAX))
}

fn le_u64(b: &[u8]) -> Vec<u64> {
    bytemuck::pod_collect_to_vec(b)
}

/// Appends an fp8 slab row (codes, then scales: the fp8 slab row format) to the compact view:
/// its codes and scales, and its values dequantised on the host (the same bits as the
/// device's, `afdep_core::fp8`).
fn push_fp8_compact(row: &[u8], h: usize, compact_x: &mut Vec<bf16>, rx: &mut Fp8Received) {
    let q = &row[..h];
    let at = h.div_ceil(16) * 16;
    let g = fp8::scales_per_row(h);
    let sc: Vec<f32> = bytemuck::pod_collect_to_vec(&row[at..at + 4 * g]);
    let mut deq = vec![bf16::ZERO; h];
    fp8::dequantise_row(q, &sc, &mut deq);
    compact_x.extend(deq);
    rx.compact_q.extend_from_slice(q);
    rx.compact_scales.extend(sc);
}

impl FusedEngine {
    /// Overrides the arm rule for the following rounds (`None`: [`DispatchArm::select`]).
    /// Every rank must set the same arm.
    pub fn set_arm(&mut self, arm: Option<DispatchArm>) {
        self.arm = arm;
    }

    /// The arm the last round ran (payload-first before the first round).
    pub fn last_arm(&self) -> DispatchArm {
        self.last_arm
    }

    pub(super) fn poison_ws(&self, offset: u64, bytes: u64) -> Result<(), ExchangeError> {
        if bytes == 0 {
            return Ok(());
        }
        self.gpu
            .cuda()
            .bind_to_thread()
            .map_err(KernelError::driver("binding the context"))?;
        // SAFETY: [ws + offset, + bytes) lies in this rank's workspace (the caller's geometry,
        // which fits it, checked at set-up); the memset is ordered on this rank's stream.
        unsafe {
            cures::memset_d8_async(
                self.ws + offset,
                0xFF,
                bytes as usize,
                self.gpu.stream().cu_stream(),
            )
        }
        .map_err(KernelError::driver("poisoning the workspace"))?;
        Ok(())
    }

    /// Poisons the first `rows` rows of the count-first expanded area (fp8: and of its codes and
    /// scales; NaN rows, codes 0xff, NaN scales).
    pub(super) fn poison_expanded(&self, rows: u64) -> Result<(), ExchangeError> {
        let a = self.geo;
        let h = self.cfg.hidden as u64;
        self.poison_ws(a.expanded, rows * 2 * h)?;
        if a.payload_kind() == PayloadKind::Fp8E4m3 {
            self.poison_ws(a.exp_q, rows * h)?;
            self.poison_ws(a.exp_scales, rows * 4 * (h / fp8::GROUP as u64))?;
        }
        Ok(())
    }

    /// What FFN rank `f` received in a device round of arm `arm` (the plan its device
    /// computed, the expanded area, the compact view), read back after the epilogue: the slab
    /// rows of source rank r come from `read_slab(r, rows)` (the workspace, or a device round's
    /// snapshot). In the source arm the slab rows hold only the metadata, and each compact row's
    /// payload is read from its first expanded row.
    pub(super) fn read_received(
        &self,
        f: usize,
        arm: DispatchArm,
        read_slab: &dyn Fn(usize, usize) -> Result<Vec<u8>, ExchangeError>,
    ) -> Result<FfnReceived, ExchangeError> {
        let rank = self.rank();
        let cfg = &self.cfg;
        let topo = cfg.topology;
        let (h, k) = (cfg.hidden, cfg.top_k);
        let (ns, epr) = (topo.attention_count(), cfg.placement().experts_per_rank);
        let a = self.geo;
        let slab = self.geo.slab();
        let nl = epr;
        let plan_words = 2 * nl * ns + nl + 1 + ns + 1;
        let w = le_u64(&self.read_ws(a.plan, plan_words * 8)?);
        let counts = w[..nl * ns].to_vec();
        let block_starts = w[nl * ns..2 * nl * ns].to_vec();
        let expert_offsets = w[2 * nl * ns..2 * nl * ns + nl + 1].to_vec();
        let slab_offsets = w[2 * nl * ns + nl + 1..].to_vec();
        let plan = FfnPlan {
            ffn: f,
            sources: ns,
            local_experts: nl,
            counts,
            expert_offsets,
            block_starts,
            slab_offsets,
        };
        let total = plan.total_rows();
        if total > a.exp_rows {
            return Err(ExchangeError::Input {
                rank,
                what: format!(
                    "the device plan has {total} expanded rows, the area holds {}",
                    a.exp_rows
                ),
            });
        }
        let expanded: Vec<bf16> =
            bytemuck::pod_collect_to_vec(&self.read_ws(a.expanded, total as usize * 2 * h)?);
        // fp8: the expanded rows' codes and scales as delivered
        let g = fp8::scales_per_row(h);
        let mut fp8_rx = match a.payload_kind() {
            PayloadKind::Bf16 => None,
            PayloadKind::Fp8E4m3 => Some(Fp8Received {
                expanded_q: self.read_ws(a.exp_q, total as usize * h)?,
                expanded_scales: bytemuck::pod_collect_to_vec(
                    &self.read_ws(a.exp_scales, total as usize * 4 * g)?,
                ),
                compact_q: Vec::new(),
                compact_scales: Vec::new(),
            }),
        };
        let mw = fk::meta_words(k);
        let (mut compact_tokens, mut compact_x, mut compact_ids, mut compact_weights) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for (s, r) in topo.attention_ranks().enumerate() {
            let n = (plan.slab_offsets[s + 1] - plan.slab_offsets[s]) as usize;
            if n > slab.cap as usize {
                return Err(ExchangeError::Input {
                    rank,
                    what: format!("the device plan has {n} rows from rank {r}, above capacity"),
                });
            }
            let bytes = read_slab(r, n)?;
            for row in bytes.chunks(slab.row_bytes as usize) {
                let m: Vec<u32> = bytemuck::pod_collect_to_vec(
                    &row[a.meta_off as usize..a.meta_off as usize + 4 * mw],
                );
                compact_tokens.push((s as u32, m[0]));
                let ids: Vec<i32> = m[2..2 + k].iter().map(|&v| v as i32).collect();
                compact_weights.extend(m[2 + k..2 + 2 * k].iter().map(|&v| f32::from_bits(v)));
                if arm == DispatchArm::CountFirstSource {
                    // the payload is in the expanded rows: the first one this token has here
                    let first = (0..k)
                        .find(|&j| ids[j] >= 0)
                        .map(|j| {
                            u64::from(m[2 + 2 * k + 2 * j])
                                | (u64::from(m[3 + 2 * k + 2 * j]) << 32)
                        })
                        .filter(|&d| d < total)
                        .map(|d| d as usize);
                    match first {
                        Some(d) => {
                            compact_x.extend_from_slice(&expanded[d * h..(d + 1) * h]);
                            if let Some(rx) = fp8_rx.as_mut() {
                                let q = rx.expanded_q[d * h..(d + 1) * h].to_vec();
                                let sc = rx.expanded_scales[d * g..(d + 1) * g].to_vec();
                                rx.compact_q.extend(q);
                                rx.compact_scales.extend(sc);
                            }
                        }
                        // a row without a valid slot: poison, which the check sees
                        None => {
                            compact_x.extend(std::iter::repeat_n(bf16::from_bits(0xFFFF), h));
                            if let Some(rx) = fp8_rx.as_mut() {
                                rx.compact_q.extend(std::iter::repeat_n(0xFFu8, h));
                                rx.compact_scales.extend(std::iter::repeat_n(f32::NAN, g));
                            }
                        }
                    }
                } else if let Some(rx) = fp8_rx.as_mut() {
                    push_fp8_compact(row, h, &mut compact_x, rx);
                } else {
                    compact_x.extend(bytemuck::pod_collect_to_vec::<u8, bf16>(&row[..2 * h]));
                }
                compact_ids.extend(ids);
            }
        }
        Ok(FfnReceived {
            plan,
            expanded,
            compact_tokens,
            compact_x,
            compact_ids,
            compact_weights,
            fp8: fp8_rx,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use afdep_core::ExchangeKnobs;

    #[test]
    fn the_bucket_rule() {
        let k = ExchangeKnobs {
            min_token_bucket: 128,
            ..ExchangeKnobs::default()
        };
        assert_eq!(DispatchArm::select(&k, 0), DispatchArm::PayloadFirst);
        assert_eq!(DispatchArm::select(&k, 127), DispatchArm::PayloadFirst);
        assert_eq!(DispatchArm::select(&k, 128), DispatchArm::CountFirstSource);
        assert_eq!(DispatchArm::select(&k, 4096), DispatchArm::CountFirstSource);
    }

    #[test]
    fn the_rule_takes_the_largest_source_for_every_payload() {
        let mut c = ExchangeConfig::new("3A:1F".parse().unwrap(), 256, 8, 2, 64).unwrap();
        c.knobs.min_token_bucket = 10;
        for payload in [PayloadKind::Bf16, PayloadKind::Fp8E4m3] {
            c.payload = payload;
            c.validate().unwrap();
            assert_eq!(rule(&c, &[9, 0, 3]), DispatchArm::PayloadFirst, "{payload}");
            assert_eq!(
                rule(&c, &[9, 10, 3]),
                DispatchArm::CountFirstSource,
                "{payload}"
            );
            assert_eq!(rule(&c, &[]), DispatchArm::PayloadFirst, "{payload}");
        }
    }

    /// The count-first areas of `c`'s workspace layout and their end (the expanded rows, fp8:
    /// their scales), checked to lie after `start`.
    fn areas(
        c: &ExchangeConfig,
        start: u64,
    ) -> (afdep_kernels::ops::fused_layout::FusedLayout, u64) {
        let l = afdep_kernels::ops::fused_layout::FusedLayout::new(c);
        assert!(l.count_flags >= start && l.count_flags >= l.ret_off);
        let end = match c.payload {
            PayloadKind::Bf16 => l.expanded + l.exp_rows * 2 * c.hidden as u64,
            PayloadKind::Fp8E4m3 => {
                l.exp_scales + l.exp_rows * 4 * fp8::scales_per_row(c.hidden) as u64
            }
        };
        assert!(end <= l.status);
        (l, end)
    }

    /// The areas are 256-byte aligned where the header says so, in order, disjoint and sized
    /// as `layout/fused.cuh` documents, for odd shapes.
    #[test]
    fn areas_are_ordered_and_disjoint() {
        for (topo, hidden, experts, k, cap) in [
            ("3A:1F", 2048usize, 128usize, 8usize, 2048usize),
            ("1A:3F", 20, 9, 2, 3),
            ("EP4", 7168, 24, 4, 256),
            ("2A:2F", 8, 2, 2, 1),
        ] {
            let c = ExchangeConfig::new(topo.parse().unwrap(), hidden, experts, k, cap).unwrap();
            let start = 1000;
            let (a, end) = areas(&c, start);
            let world = c.topology.world_size() as u64;
            let ns = c.topology.attention_count() as u64;
            let epr = c.experts_per_rank as u64;
            assert!(a.count_flags >= start && a.count_flags % 256 == 0);
            assert_eq!(a.offset_flags, a.count_flags + 256);
            assert_eq!(a.counts, a.offset_flags + 256);
            assert!(a.offsets >= a.counts + world * (epr + 1) * 8);
            assert!(a.plan >= a.offsets + world * epr * 8);
            assert!(a.row_flags >= a.plan + (2 * epr * ns + epr + 1 + ns + 1) * 8);
            assert!(a.expanded >= a.row_flags + world * cap as u64 * 4);
            assert_eq!(a.expanded % 256, 0);
            assert_eq!(a.exp_rows, ns * cap as u64 * (k as u64).min(epr));
            assert_eq!(end, a.expanded + a.exp_rows * 2 * hidden as u64);
            assert_eq!(a.meta_off, (2 * hidden as u64).div_ceil(16) * 16);
            assert!(
                a.meta_off + 4 * fk::meta_words(k) as u64 <= fk::slab_row_bytes(hidden, k) as u64
            );
            // bf16: no code or scale areas
            assert_eq!((a.exp_q, a.exp_scales), (end, end));
            assert_eq!(a.payload_kind(), PayloadKind::Bf16);
        }
    }

    /// fp8 configurations: the same areas up to the bf16 (dequantised) expanded rows, then the
    /// codes (`hidden` bytes per row) and the scales (`hidden / 128` f32 per row), 256-byte
    /// aligned and disjoint; the metadata after the fp8 payload part of a slab row.
    #[test]
    fn fp8_areas_add_codes_and_scales_after_the_expanded_rows() {
        for (topo, hidden, experts, k, cap) in [
            ("3A:1F", 2048usize, 128usize, 8usize, 2048usize),
            ("1A:3F", 384, 9, 2, 3),
            ("EP4", 7168, 24, 4, 256),
            ("2A:2F", 128, 2, 2, 1),
        ] {
            let bf = ExchangeConfig::new(topo.parse().unwrap(), hidden, experts, k, cap).unwrap();
            let mut c = bf.clone();
            c.payload = PayloadKind::Fp8E4m3;
            c.validate().unwrap();
            let start = 1000;
            let (b, bend) = areas(&bf, start);
            let (a, end) = areas(&c, start);
            let rows = a.exp_rows;
            let h = hidden as u64;
            // the same areas relative to the count-first start (the fp8 slabs before it are
            // smaller, so the start itself moves)
            let rel = |x: &afdep_kernels::ops::fused_layout::FusedLayout| {
                let c0 = x.count_flags;
                (
                    x.counts - c0,
                    x.offsets - c0,
                    x.plan - c0,
                    x.row_flags - c0,
                    x.expanded - c0,
                )
            };
            assert_eq!(rel(&a), rel(&b));
            assert_eq!(rows, b.exp_rows);
            assert_eq!(a.payload_kind(), PayloadKind::Fp8E4m3);
            assert_eq!(a.exp_q % 256, 0);
            assert_eq!(a.exp_scales % 256, 0);
            assert!(a.exp_q >= a.expanded + rows * 2 * h);
            assert!(a.exp_scales >= a.exp_q + rows * h);
            assert_eq!(end, a.exp_scales + rows * 4 * (h / 128));
            assert!(end - a.count_flags > bend - b.count_flags);
            assert_eq!(
                a.meta_off,
                fk::slab_payload_bytes(PayloadKind::Fp8E4m3, hidden) as u64
            );
            assert_eq!(
                a.meta_off,
                h.div_ceil(16) * 16 + (4 * (h / 128)).div_ceil(16) * 16
            );
            assert!(
                a.meta_off + 4 * fk::meta_words(k) as u64
                    <= fk::slab_row_bytes_for(PayloadKind::Fp8E4m3, hidden, k) as u64
            );
        }
    }
}
