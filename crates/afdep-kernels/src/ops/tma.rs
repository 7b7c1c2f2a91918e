//! TMA tensor maps (`CUtensorMap`) for the GEMMs' dense operands.
//!
//! A tensor map describes a dense tensor in global memory (address, sizes, byte strides) and
//! the box one TMA load copies into shared memory, with the shared-memory swizzle the consumer
//! (wgmma) reads. The host encodes it (`cuTensorMapEncodeTiled`, a pure host call, no stream
//! work) and passes it to the kernel by value, as a `__grid_constant__` parameter. Elements
//! of a box outside the tensor are filled with zeros.
//!
//! [`encode_bf16`] answers `Ok(None)` where the hardware cannot describe the operand (a
//! misaligned address or stride): the GEMM then loads that operand with cp.async, as it does
//! for gathered rows. TMA can be turned off for every GEMM with `AFDEP_GEMM_TMA=0` (to compare
//! the two loaders in one build); [`enabled`] reads it once.

use std::sync::OnceLock;

use cudarc::driver::{DeviceRepr, sys as cu};

use crate::error::KernelError;

/// A `CUtensorMap`: 128 opaque bytes, 64-byte aligned (the device side's `TmaMap`).
#[repr(C, align(64))]
#[derive(Clone, Copy, Default)]
pub struct TmaMap {
    opaque: [u64; 16],
}

impl std::fmt::Debug for TmaMap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TmaMap(..)")
    }
}

// SAFETY: 128 bytes of plain data with the alignment the kernel parameter declares; the
// kernel takes it by value.
unsafe impl DeviceRepr for TmaMap {}

/// The shared-memory swizzle a box is written with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Swizzle {
    /// 64-byte swizzle (box rows of 64 bytes).
    B64,
    /// 128-byte swizzle (box rows of 128 bytes).
    B128,
}

impl Swizzle {
    /// The swizzle of K-major tiles whose rows are `bytes` long (32 or 64 bf16).
    pub fn for_row_bytes(bytes: usize) -> Swizzle {
        if bytes >= 128 {
            Swizzle::B128
        } else {
            Swizzle::B64
        }
    }
    fn span(self) -> usize {
        match self {
            Swizzle::B64 => 64,
            Swizzle::B128 => 128,
        }
    }
    fn cu(self) -> cu::CUtensorMapSwizzle {
        match self {
            Swizzle::B64 => cu::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_64B,
            Swizzle::B128 => cu::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
        }
    }
}

/// Whether the GEMMs may load dense operands by TMA (`AFDEP_GEMM_TMA` unset, or anything but
/// `0` / `off` / `false`). Read once per process.
pub fn enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| {
        !matches!(
            std::env::var("AFDEP_GEMM_TMA").as_deref().map(str::trim),
            Ok("0") | Ok("off") | Ok("false")
        )
    })
}

/// Why a tensor cannot be described by a map, or `None` when it can: TMA needs a 16-byte
/// aligned address, byte strides that are multiples of 16 (below 2^40), sizes in 1..=2^32 and
/// box sizes in 1..=256 whose rows fit the swizzle span.
pub fn unsupported_reason(
    addr: u64,
    dims: &[u64],
    strides: &[u64],
    boxd: &[u32],
    swizzle: Swizzle,
) -> Option<String> {
    if dims.is_empty()
        || dims.len() > 5
        || strides.len() + 1 != dims.len()
        || boxd.len() != dims.len()
    {
        return Some(format!(
            "rank {} with {} strides and {} box sizes",
            dims.len(),
            strides.len(),
            boxd.len()
        ));
    }
    if addr % 16 != 0 {
        return Some(format!("address {addr:#x} is not 16-byte aligned"));
    }
    if let Some(s) = strides.iter().find(|&&s| s % 16 != 0 || s >= 1 << 40) {
        return Some(format!(
            "byte stride {s} is not a multiple of 16 below 2^40"
        ));
    }
    if let Some(d) = dims.iter().find(|&&d| d == 0 || d > 1 << 32) {
        return Some(format!("size {d} outside 1..=2^32"));
    }
    if let Some(b) = boxd.iter().find(|&&b| b == 0 || b > 256) {
        return Some(format!("box size {b} outside 1..=256"));
    }
    if boxd[0] as usize * 2 > swizzle.span() {
        return Some(format!(
            "box rows of {} bytes exceed the {}-byte swizzle",
            boxd[0] * 2,
            swizzle.span()
        ));
    }
    None
}

/// Encodes a tiled map of a bf16 tensor at device address `addr`: `dims` in elements,
/// innermost first; `strides` the byte strides of dims 1.. ; `boxd` the box in elements.
/// `Ok(None)` where [`unsupported_reason`] rejects the tensor (the caller falls back to
/// cp.async); [`KernelError::TensorMap`] if the driver refuses a tensor that passed it.
pub fn encode_bf16(
    what: &str,
    addr: u64,
    dims: &[u64],
    strides: &[u64],
    boxd: &[u32],
    swizzle: Swizzle,
) -> Result<Option<TmaMap>, KernelError> {
    if let Some(why) = unsupported_reason(addr, dims, strides, boxd, swizzle) {
        tracing::debug!(what, why, "no tensor map: cp.async instead");
        return Ok(None);
    }
    let mut map = std::mem::MaybeUninit::<cu::CUtensorMap>::zeroed();
    let elem = vec![1u32; dims.len()];
    // SAFETY: the arrays have dims.len() entries (strides dims.len() - 1, as the driver reads
    // for rank > 1), checked above; `map` is a writable CUtensorMap; the driver only encodes,
    // it does not touch the device memory at `addr`.
    let r = unsafe {
        cu::cuTensorMapEncodeTiled(
            map.as_mut_ptr(),
            cu::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
            dims.len() as u32,
            addr as *mut std::ffi::c_void,
            dims.as_ptr(),
            strides.as_ptr(),
            boxd.as_ptr(),
            elem.as_ptr(),
            cu::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            swizzle.cu(),
            cu::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            cu::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
    };
    if r != cu::CUresult::CUDA_SUCCESS {
        return Err(KernelError::TensorMap {
            what: what.to_string(),
            result: format!("{r:?} (dims {dims:?}, strides {strides:?}, box {boxd:?})"),
        });
    }
    // SAFETY: the driver wrote the whole map on success.
    let map = unsafe { map.assume_init() };
    Ok(Some(TmaMap { opaque: map.opaque }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_tma_cannot_describe_is_named() {
        let ok = unsupported_reason(
            256,
            &[64, 100, 4],
            &[128, 12800],
            &[64, 32, 1],
            Swizzle::B128,
        );
        assert_eq!(ok, None);
        let r = unsupported_reason(8, &[64, 100], &[128], &[32, 128], Swizzle::B64).unwrap();
        assert!(r.contains("16-byte aligned"), "{r}");
        let r = unsupported_reason(0, &[20, 100], &[40], &[32, 128], Swizzle::B64).unwrap();
        assert!(r.contains("stride 40"), "{r}");
        let r = unsupported_reason(0, &[64, 100], &[128], &[64, 128], Swizzle::B64).unwrap();
        assert!(r.contains("exceed the 64-byte swizzle"), "{r}");
        let r = unsupported_reason(0, &[64, 100], &[128], &[32, 512], Swizzle::B64).unwrap();
        assert!(r.contains("box size 512"), "{r}");
        let r = unsupported_reason(0, &[64, 0], &[128], &[32, 128], Swizzle::B64).unwrap();
        assert!(r.contains("size 0"), "{r}");
    }

    #[test]
    fn swizzle_follows_the_row_length() {
        assert_eq!(Swizzle::for_row_bytes(64), Swizzle::B64);
        assert_eq!(Swizzle::for_row_bytes(128), Swizzle::B128);
    }
}
