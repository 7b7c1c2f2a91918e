//! Probe points inside the device round's kernels, for measurement builds: where the time of a
//! round goes between its phase boundaries (after each wait, after each grid-wide step).
//!
//! A module compiled with `-DAFDEP_PROBE` (set `AFDEP_NVRTC_OPTIONS=-DAFDEP_PROBE`; the option
//! is part of the kernel cache's key, so probe builds never mix with production ones) holds a
//! global `afdep_probe[SLOTS]` of `%globaltimer` nanoseconds (`cuda/common/probe.cuh`): each
//! point raises its slot to the timer's value as the kernel passes it (the last block to pass
//! it, for points that several blocks pass). Each engine loads its own modules (its own
//! [`GpuContext`]), so the arrays of one rank's modules hold that rank's points only. Without
//! the define the points compile to nothing. [`take`] reads every loaded module's array after a
//! round and zeroes it for the next; `afdep exchange --probe FILE` writes them per round.
//!
//! A probe costs one atomic on a global word where it fires, so a probe build's rounds are a
//! little slower than a production build's: the latency tables come from production builds,
//! the split of a round from probe builds.

use crate::{GpuContext, KernelError};

/// Slots of a module's probe array (`AFDEP_PROBE_SLOTS`).
pub const SLOTS: usize = 32;

/// The probe points by slot, as `cuda/common/probe.cuh` numbers them (`AFDEP_PROBE_<NAME>` in
/// upper case).
pub const POINTS: [&str; 29] = [
    "gate",
    "front_in",
    "status_out",
    "status_in",
    "begun",
    "counts_last",
    "counts_out",
    "plan_in",
    "plan_out",
    "rows_plan",
    "rows_out",
    "epi_in",
    "epi_out",
    "front_out",
    "reduce_in",
    "reduce_out",
    "combine_in",
    "combine_wait",
    "combine_out",
    "begin_in",
    "begin_checked",
    "counts_in",
    "plan_enter",
    "rows_in",
    "rows_copied",
    "rows_ticket",
    "epi_enter",
    "reduce_rows",
    "reduce_ticket",
];

/// The name of the module global that holds the probes.
const GLOBAL: &str = "afdep_probe";

/// Whether NVRTC options `options` build the probe points (`-DAFDEP_PROBE`, with or without a
/// value).
pub fn requested(options: &[String]) -> bool {
    options
        .iter()
        .any(|o| o == "-DAFDEP_PROBE" || o.starts_with("-DAFDEP_PROBE="))
}

/// Whether `gpu` compiles its modules with the probe points ([`requested`] of its NVRTC
/// options).
pub fn compiled_in(gpu: &GpuContext) -> bool {
    requested(&gpu.jit().options().extra_options)
}

/// Every probe point this context's loaded modules recorded since the last call (per slot, the
/// latest of any module; 0 where no point fired), zeroing them for the next round; `None` when
/// the modules are built without probes ([`compiled_in`]). Copies on the context's stream and
/// waits for it: call it between rounds.
pub fn take(gpu: &GpuContext) -> Result<Option<[u64; SLOTS]>, KernelError> {
    if !compiled_in(gpu) {
        return Ok(None);
    }
    let stream = gpu.stream();
    // every module's array copied out and zeroed on the stream, then one wait for them all
    let mut copies: Vec<Vec<u8>> = Vec::new();
    for (spec, m) in gpu.loaded_modules() {
        // a module without probe points (the GEMMs, the layouts) has no such global
        let mut g = match m.get_global(GLOBAL, stream) {
            Ok(g) => g,
            Err(e) if e.0 == cudarc::driver::sys::CUresult::CUDA_ERROR_NOT_FOUND => continue,
            Err(e) => {
                return Err(KernelError::driver(format!("finding the probes of {spec}"))(e));
            }
        };
        if g.len() != SLOTS * 8 {
            return Err(KernelError::Unsupported(format!(
                "{spec}: {GLOBAL} has {} bytes, not {}",
                g.len(),
                SLOTS * 8
            )));
        }
        let mut b = vec![0u8; SLOTS * 8];
        stream
            .memcpy_dtoh(&g, &mut b)
            .map_err(KernelError::driver(format!("reading the probes of {spec}")))?;
        stream
            .memset_zeros(&mut g)
            .map_err(KernelError::driver(format!("zeroing the probes of {spec}")))?;
        copies.push(b);
    }
    gpu.synchronize()?;
    let mut out = [0u64; SLOTS];
    for b in &copies {
        for (o, c) in out.iter_mut().zip(b.chunks_exact(8)) {
            let v = u64::from_le_bytes(c.try_into().expect("8 bytes"));
            *o = (*o).max(v);
        }
    }
    Ok(Some(out))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The header's `AFDEP_PROBE_<NAME> <slot>` defines are [`POINTS`], slot for slot, below
    /// `AFDEP_PROBE_SLOTS` = [`SLOTS`].
    #[test]
    fn probes_are_requested_by_the_define() {
        let o = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert!(requested(&o(&["-DAFDEP_PROBE"])));
        assert!(requested(&o(&["-lineinfo", "-DAFDEP_PROBE=1"])));
        assert!(!requested(&o(&["-DAFDEP_PROBES", "-DAFDEP_FAULT=1"])));
        assert!(!requested(&[]));
    }

    #[test]
    fn points_match_the_header() {
        let text = include_str!("../../cuda/common/probe.cuh");
        let mut found: Vec<(usize, String)> = Vec::new();
        let mut slots = None;
        for l in text.lines() {
            let mut w = l.split_whitespace();
            if w.next() != Some("#define") {
                continue;
            }
            let (Some(name), Some(v)) = (w.next(), w.next()) else {
                continue;
            };
            let Some(point) = name.strip_prefix("AFDEP_PROBE_") else {
                continue;
            };
            let Ok(v) = v.parse::<usize>() else {
                continue;
            };
            if point == "SLOTS" {
                slots = Some(v);
            } else {
                found.push((v, point.to_lowercase()));
            }
        }
        assert_eq!(slots, Some(SLOTS));
        found.sort();
        let want: Vec<(usize, String)> = POINTS
            .iter()
            .enumerate()
            .map(|(i, p)| (i, p.to_string()))
            .collect();
        assert_eq!(found, want);
    }
}
