//! fp8 test inputs shared by `staged` and `gpu_fp8`: token rows whose 128-channel groups
//! exercise every corner of the quantisation (afdep_core::fp8): ordinary values, all-zero
//! groups with signed zeros, bf16 subnormals, values near the bf16 maximum, one spike among
//! tiny values (subnormal e4m3 codes), and exact ties (scale 1 and e4m3 midpoints).
#![allow(dead_code)] // each test binary uses its own subset

use afdep_core::bf16;
use afdep_core::fp8::{GROUP, e4m3_to_f32};
use afdep_core::tensor::rng;
use rand::Rng;

/// Rewrites the groups of `x` (rows of `hidden`, a multiple of 128): group `g` of token `t`
/// becomes kind `(t + g + seed) % 6` (0 keeps the values).
pub fn edge_groups(x: &mut [bf16], hidden: usize, seed: u64) {
    assert_eq!(hidden % GROUP, 0);
    let mut r = rng(seed, 0xf8);
    for (i, grp) in x.chunks_mut(GROUP).enumerate() {
        let (t, g) = (i / (hidden / GROUP), i % (hidden / GROUP));
        match (t as u64 + g as u64 + seed) % 6 {
            0 => {}
            1 => {
                // zeros of both signs
                for v in grp.iter_mut() {
                    *v = if r.gen_bool(0.5) {
                        bf16::ZERO
                    } else {
                        bf16::NEG_ZERO
                    };
                }
            }
            2 => {
                // bf16 subnormals (and some zeros)
                for v in grp.iter_mut() {
                    *v = bf16::from_bits((r.r#gen::<u16>() & 0x807f) as u16);
                }
            }
            3 => {
                // huge (the experts of the tests scale rows by at most 64: no overflow)
                for v in grp.iter_mut() {
                    *v = bf16::from_f32(v.to_f32() * 1e36);
                }
            }
            4 => {
                // one spike: everything else falls into e4m3 subnormals or zero
                for v in grp.iter_mut() {
                    *v = bf16::from_f32(v.to_f32() * 0.01);
                }
                let at = r.gen_range(0..GROUP);
                grp[at] = bf16::from_f32(if r.gen_bool(0.5) { 1000.0 } else { -1000.0 });
            }
            _ => {
                // scale exactly 1 (amax 448) and every other value an e4m3 midpoint or code:
                // the quantiser's ties, exactly
                for v in grp.iter_mut() {
                    let c = r.gen_range(0u8..0x7e);
                    let lo = e4m3_to_f32(c);
                    let hi = e4m3_to_f32(c + 1);
                    let m = if r.gen_bool(0.7) { (lo + hi) / 2.0 } else { lo };
                    let m = if r.gen_bool(0.5) { -m } else { m };
                    assert_eq!(bf16::from_f32(m).to_f32(), m, "midpoints are bf16");
                    *v = bf16::from_f32(m);
                }
                grp[r.gen_range(0..GROUP)] = bf16::from_f32(448.0);
            }
        }
    }
}
