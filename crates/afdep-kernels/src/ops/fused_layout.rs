//! The layout of the fused exchange's symmetric workspace: one `#[repr(C)]` struct,
//! [`FusedLayout`], computed in one place ([`FusedLayout::new`]) from the exchange config, and
//! mirrored on the device by `struct afdep_fused_layout` in `cuda/layout/fused.cuh`, whose
//! `static_assert`s pin its size and every field's offset (a test here compares them with
//! `offset_of!`). Every fused launcher takes it, and passes it by value to its kernel
//! ([`FusedLayout::slab`] is the view of its slab fields that the launchers check rows against).
//!
//! Every rank's workspace has this layout (byte offsets from its base; every area 256-byte
//! aligned):
//!
//! | offset | area |
//! | --- | --- |
//! | [`DISPATCH_FLAGS`] | dispatch flags, `u32[64]` by source rank |
//! | [`COMBINE_FLAGS`] | combine flags, `u32[64]` by FFN rank |
//! | [`ERROR_WORD`] | the error word, `u32[4]` |
//! | [`CONTROL`] | the round control block ([`super::fused_round`]) |
//! | [`SLABS`] | the slabs: `world × capacity` rows of `row_bytes` |
//! | `ret_off` | the return areas: `ffns × capacity` rows of `ret_row_bytes` (`hidden` f32, or `hidden` bf16 with bf16 partials) |
//! | `count_flags` … `exp_scales` | the count-first areas (`layout/fused.cuh`) |
//! | `status` | the status area of device rounds ([`super::fused_round::STATUS_BYTES`]) |
//! | `bytes` | the end: the workspace size the engine needs |

use afdep_core::{CombinePartials, ExchangeConfig, PayloadKind, fp8};
use cudarc::driver::DeviceRepr;

use super::fused::{SlabGeometry, slab_payload_bytes, slab_row_bytes_for};
use super::fused_round::STATUS_BYTES;

/// Byte offset of the dispatch flags in every workspace.
pub const DISPATCH_FLAGS: u64 = 0;
/// Byte offset of the combine flags.
pub const COMBINE_FLAGS: u64 = 256;
/// Byte offset of the error word.
pub const ERROR_WORD: u64 = 512;
/// Byte offset of the round control block (`u32[16]`: round, verdict, route word, token count;
/// [`super::fused_round`]).
pub const CONTROL: u64 = 768;
/// Byte offset of the slabs.
pub const SLABS: u64 = 1024;

/// The workspace layout of one exchange config, the same on every rank (see the [module
/// docs](self)). `#[repr(C)]`: the device's `struct afdep_fused_layout` has the same fields at
/// the same offsets.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct FusedLayout {
    /// The slabs (source rank r, row i at `slab_off + (r × cap + i) × row_bytes`).
    pub slab_off: u64,
    /// Bytes of one slab row ([`slab_row_bytes_for`]).
    pub row_bytes: u64,
    /// Byte offset of a slab row's metadata within the row ([`slab_payload_bytes`]).
    pub meta_off: u64,
    /// The return areas: `ffns × cap` rows of `ret_row_bytes`, by FFN index.
    pub ret_off: u64,
    /// Bytes of one return row: `hidden` f32, or `hidden` bf16 with bf16 partials
    /// ([`CombinePartials::bytes_per_channel`]).
    pub ret_row_bytes: u64,
    /// Count-first: count flags, `u32[64]` by source rank.
    pub count_flags: u64,
    /// Count-first: offset flags, `u32[64]` by FFN rank.
    pub offset_flags: u64,
    /// Count-first: counts, `u64[world][epr + 1]` by source rank.
    pub counts: u64,
    /// Count-first: offsets, `u64[world][epr]` by FFN rank.
    pub offsets: u64,
    /// Count-first: the FFN rank's plan (counts, block starts, expert offsets, slab offsets).
    pub plan: u64,
    /// Count-first: row flags, `u32[world][cap]` by (source rank, slab row).
    pub row_flags: u64,
    /// The expanded area, `exp_rows × hidden` bf16 (fp8: the dequantised rows).
    pub expanded: u64,
    /// fp8: the expanded rows' codes (bf16 payloads: the end of the expanded area, no bytes).
    pub exp_q: u64,
    /// fp8: the expanded rows' scales (bf16 payloads: as `exp_q`).
    pub exp_scales: u64,
    /// Rows of the expanded area: `sources × cap × min(top_k, epr)`.
    pub exp_rows: u64,
    /// The status area of device rounds.
    pub status: u64,
    /// Bytes of the whole workspace.
    pub bytes: u64,
    /// Rows of one source's slab (the capacity).
    pub cap: u32,
    /// Hidden size.
    pub hidden: u32,
    /// Slots per token.
    pub top_k: u32,
    /// The payload kind (`AFDEP_PAYLOAD_BF16` 0, `AFDEP_PAYLOAD_FP8` 1).
    pub payload: u32,
    /// How the combine's partials travel (`AFDEP_PARTIALS_F32` 0, `AFDEP_PARTIALS_BF16` 1): the
    /// combine launchers pick their kernels' f32 or `_bf16` entries by it.
    pub partials: u32,
    /// Always 0 (keeps the struct free of padding).
    pub reserved: u32,
}

// SAFETY: FusedLayout is #[repr(C)], plain integers without padding (17 u64, then 6 u32), and
// the kernels take it by value as `struct afdep_fused_layout` of the same layout
// (static_asserts in layout/fused.cuh).
unsafe impl DeviceRepr for FusedLayout {}

fn align256(v: u64) -> u64 {
    v.div_ceil(256) * 256
}

impl FusedLayout {
    /// The layout of `cfg`'s workspace.
    pub fn new(cfg: &ExchangeConfig) -> FusedLayout {
        let world = cfg.topology.world_size() as u64;
        let ns = cfg.topology.attention_count() as u64;
        let ffns = cfg.placement().ffn_ranks as u64;
        let epr = cfg.experts_per_rank as u64;
        let cap = cfg.capacity as u64;
        let h = cfg.hidden as u64;
        let row_bytes = slab_row_bytes_for(cfg.payload, cfg.hidden, cfg.top_k) as u64;
        let ret_off = align256(SLABS + world * cap * row_bytes);
        let ret_row_bytes = cfg.partials.bytes_per_channel() as u64 * h;
        let count_flags = align256(ret_off + ffns * cap * ret_row_bytes);
        let counts = count_flags + 512;
        let offsets = align256(counts + world * (epr + 1) * 8);
        let plan = align256(offsets + world * epr * 8);
        let row_flags = align256(plan + (2 * epr * ns + epr + ns + 2) * 8);
        let expanded = align256(row_flags + world * cap * 4);
        let exp_rows = ns * cap * (cfg.top_k as u64).min(epr);
        let mut end = expanded + exp_rows * 2 * h;
        // fp8: the expanded rows' codes and scales after the (dequantised) bf16 rows; bf16
        // configs have neither (both offsets at the end, zero bytes)
        let (exp_q, exp_scales) = match cfg.payload {
            PayloadKind::Bf16 => (end, end),
            PayloadKind::Fp8E4m3 => {
                let q = align256(end);
                let sc = align256(q + exp_rows * h);
                end = sc + exp_rows * 4 * fp8::scales_per_row(cfg.hidden) as u64;
                (q, sc)
            }
        };
        let status = align256(end);
        FusedLayout {
            slab_off: SLABS,
            row_bytes,
            meta_off: slab_payload_bytes(cfg.payload, cfg.hidden) as u64,
            ret_off,
            ret_row_bytes,
            count_flags,
            offset_flags: count_flags + 256,
            counts,
            offsets,
            plan,
            row_flags,
            expanded,
            exp_q,
            exp_scales,
            exp_rows,
            status,
            bytes: status + STATUS_BYTES,
            cap: cfg.capacity as u32,
            hidden: cfg.hidden as u32,
            top_k: cfg.top_k as u32,
            payload: match cfg.payload {
                PayloadKind::Bf16 => 0,
                PayloadKind::Fp8E4m3 => 1,
            },
            partials: match cfg.partials {
                CombinePartials::F32 => 0,
                CombinePartials::Bf16 => 1,
            },
            reserved: 0,
        }
    }

    /// The payload kind.
    pub fn payload_kind(&self) -> PayloadKind {
        match self.payload {
            0 => PayloadKind::Bf16,
            _ => PayloadKind::Fp8E4m3,
        }
    }

    /// How the combine's partials travel.
    pub fn partials_kind(&self) -> CombinePartials {
        match self.partials {
            0 => CombinePartials::F32,
            _ => CombinePartials::Bf16,
        }
    }

    /// The slabs (what the count-first launchers check their rows against).
    pub fn slab(&self) -> SlabGeometry {
        SlabGeometry {
            slab_off: self.slab_off,
            cap: self.cap,
            row_bytes: self.row_bytes,
            hidden: self.hidden,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::mem::size_of;

    use afdep_core::Topology;

    use super::*;

    /// The device struct has the Rust struct's fields in the same order with the same sizes,
    /// so the same offsets (it has no padding: the header asserts its size, and so does this).
    #[test]
    fn the_device_struct_matches() {
        use super::super::device_struct::{assert_mirrors, rust_offsets};
        #[rustfmt::skip]
        let rust = rust_offsets!(FusedLayout;
            slab_off, row_bytes, meta_off, ret_off, ret_row_bytes, count_flags, offset_flags,
            counts, offsets, plan, row_flags, expanded, exp_q, exp_scales, exp_rows, status, bytes,
            cap, hidden, top_k, payload, partials, reserved
        );
        let text = include_str!("../../cuda/layout/fused.cuh");
        assert_mirrors(text, "afdep_fused_layout", rust, size_of::<FusedLayout>());
    }

    /// The layout of two configs, pinned (the numbers of the engine's layout before it moved
    /// here); every area inside the workspace and 256-byte aligned.
    #[test]
    fn layouts_are_pinned_and_aligned() {
        for (payload, want) in [
            (PayloadKind::Bf16, PINNED_BF16),
            (PayloadKind::Fp8E4m3, PINNED_FP8),
        ] {
            let mut cfg =
                ExchangeConfig::new("3A:1F".parse::<Topology>().unwrap(), 2048, 32, 8, 256)
                    .unwrap();
            cfg.payload = payload;
            let l = FusedLayout::new(&cfg);
            let got = [
                l.row_bytes,
                l.meta_off,
                l.ret_off,
                l.count_flags,
                l.counts,
                l.offsets,
                l.plan,
                l.row_flags,
                l.expanded,
                l.exp_q,
                l.exp_scales,
                l.exp_rows,
                l.status,
                l.bytes,
            ];
            assert_eq!(got, want, "{payload}");
            for a in [
                l.slab_off,
                l.ret_off,
                l.count_flags,
                l.offsets,
                l.plan,
                l.row_flags,
                l.expanded,
                l.status,
            ] {
                assert_eq!(a % 256, 0);
            }
            assert!(l.exp_scales <= l.status && l.status + STATUS_BYTES == l.bytes);
            assert_eq!(l.slab().row_bytes, l.row_bytes);
            assert_eq!(l.payload_kind(), payload);
        }
    }

    /// bf16 partials halve the return rows and nothing else: every area before them stays, every
    /// area after them moves down by the bytes saved (`ffns × cap × hidden × 2`).
    #[test]
    fn bf16_partials_halve_the_return_areas() {
        for (topo, payload) in [
            ("3A:1F", PayloadKind::Bf16),
            ("2A:2F", PayloadKind::Fp8E4m3),
            ("1A:3F", PayloadKind::Bf16),
        ] {
            let mut cfg =
                ExchangeConfig::new(topo.parse::<Topology>().unwrap(), 2048, 48, 8, 256).unwrap();
            cfg.payload = payload;
            let f = FusedLayout::new(&cfg);
            cfg.partials = CombinePartials::Bf16;
            let b = FusedLayout::new(&cfg);
            assert_eq!(f.ret_row_bytes, 4 * 2048);
            assert_eq!(b.ret_row_bytes, 2 * 2048);
            assert_eq!((f.partials, b.partials, b.reserved), (0, 1, 0));
            assert_eq!(f.partials_kind(), CombinePartials::F32);
            assert_eq!(b.partials_kind(), CombinePartials::Bf16);
            let saved = cfg.placement().ffn_ranks as u64 * 256 * 2 * 2048;
            assert_eq!(
                [b.slab_off, b.row_bytes, b.meta_off, b.ret_off],
                [f.slab_off, f.row_bytes, f.meta_off, f.ret_off]
            );
            let after = |l: &FusedLayout| {
                [
                    l.count_flags,
                    l.offset_flags,
                    l.counts,
                    l.offsets,
                    l.plan,
                    l.row_flags,
                    l.expanded,
                    l.exp_q,
                    l.exp_scales,
                    l.status,
                    l.bytes,
                ]
            };
            assert_eq!(after(&b), after(&f).map(|v| v - saved), "{topo} {payload}");
            assert_eq!(b.exp_rows, f.exp_rows);
        }
        // the codes of the partials field, as layout/fused.cuh names them
        use crate::ops::fused::tests::define;
        assert_eq!(define("AFDEP_PARTIALS_F32"), "0");
        assert_eq!(define("AFDEP_PARTIALS_BF16"), "1");
    }

    const PINNED_BF16: [u64; 14] = [
        4240, 4096, 4342784, 6439936, 6440448, 6441728, 6442752, 6444800, 6448896, 31614720,
        31614720, 6144, 31614720, 31622912,
    ];
    const PINNED_FP8: [u64; 14] = [
        2256, 2112, 2311168, 4408320, 4408832, 4410112, 4411136, 4413184, 4417280, 29583104,
        42166016, 6144, 42559232, 42567424,
    ];
}
