//! Launchers of `fp8.cu`: e4m3 encode and decode, and the row quantiser, with the device
//! functions the fused exchange uses (`cuda/common/fp8.cuh`). They exist so the device
//! conversions can be compared with the host's ([`afdep_core::fp8`]) on any values, and as a
//! stand-alone quantiser.

use afdep_core::bf16;
use cudarc::driver::{CudaSlice, PushKernelArg};

use super::{grid, need};
use crate::context::{GpuContext, launch_err};
use crate::error::KernelError;
use crate::sources::{BLOCK, KernelId};

/// `out[i]` = the e4m3 code of `v[i]` (`cvt.rn.satfinite.e4m3x2.f32`), for `n` values.
pub fn encode_e4m3(
    ctx: &GpuContext,
    v: &CudaSlice<f32>,
    out: &mut CudaSlice<u8>,
    n: usize,
) -> Result<(), KernelError> {
    if n == 0 {
        return Ok(());
    }
    need("values", v, n)?;
    need("codes", out, n)?;
    let n64 = n as u64;
    let f = ctx.function(KernelId::Fp8Encode, 0, 0)?;
    let mut b = ctx.stream().launch_builder(&f);
    b.arg(v).arg(out).arg(&n64);
    // SAFETY: afdep_fp8_encode(const float* v, u8* out, u64 n): thread p reads v[2p], v[2p+1]
    // and writes out[2p], out[2p+1], only below n; both hold n elements (checked).
    unsafe {
        b.launch(grid(
            n64.div_ceil(2).div_ceil(u64::from(BLOCK)).min(65_535),
        )?)
    }
    .map_err(launch_err(KernelId::Fp8Encode))?;
    Ok(())
}

/// `out[i]` = the value of code `codes[i]`, for `n` codes.
pub fn decode_e4m3(
    ctx: &GpuContext,
    codes: &CudaSlice<u8>,
    out: &mut CudaSlice<f32>,
    n: usize,
) -> Result<(), KernelError> {
    if n == 0 {
        return Ok(());
    }
    need("codes", codes, n)?;
    need("values", out, n)?;
    let n64 = n as u64;
    let f = ctx.function(KernelId::Fp8Decode, 0, 0)?;
    let mut b = ctx.stream().launch_builder(&f);
    b.arg(codes).arg(out).arg(&n64);
    // SAFETY: afdep_fp8_decode(const u8* codes, float* out, u64 n): thread i < n reads
    // codes[i] and writes out[i]; both hold n elements (checked).
    unsafe { b.launch(grid(n64.div_ceil(u64::from(BLOCK)).min(65_535))?) }
        .map_err(launch_err(KernelId::Fp8Decode))?;
    Ok(())
}

/// The fp8 outputs of [`quantise_rows`] for `rows` rows of `hidden`.
#[derive(Debug)]
pub struct Fp8Rows<'a> {
    /// e4m3 codes, `rows × hidden`.
    pub q: &'a mut CudaSlice<u8>,
    /// Scales, `rows × hidden / 128`.
    pub scales: &'a mut CudaSlice<f32>,
    /// Dequantised rows, `rows × hidden`.
    pub dequant: &'a mut CudaSlice<bf16>,
}

/// Quantises `rows` rows of `x` (`hidden` a multiple of 128) with the fused dispatch's warp
/// quantiser and dequantises the codes with the streaming epilogue's dequantiser.
pub fn quantise_rows(
    ctx: &GpuContext,
    x: &CudaSlice<bf16>,
    rows: usize,
    hidden: usize,
    out: Fp8Rows<'_>,
) -> Result<(), KernelError> {
    if hidden % afdep_core::fp8::GROUP != 0 || hidden == 0 {
        return Err(KernelError::Shape(format!(
            "fp8 rows need hidden a positive multiple of 128, not {hidden}"
        )));
    }
    if rows == 0 {
        return Ok(());
    }
    need("x", x, rows * hidden)?;
    need("codes", out.q, rows * hidden)?;
    need("scales", out.scales, rows * hidden / afdep_core::fp8::GROUP)?;
    need("dequantised rows", out.dequant, rows * hidden)?;
    let h = super::as_u32("hidden", hidden)?;
    let r = rows as u64;
    let f = ctx.function(KernelId::Fp8QuantiseRows, 0, 0)?;
    let mut b = ctx.stream().launch_builder(&f);
    b.arg(x)
        .arg(&r)
        .arg(&h)
        .arg(out.q)
        .arg(out.scales)
        .arg(out.dequant);
    // SAFETY: afdep_fp8_quantise_rows(const u16* x, u64 rows, u32 hidden, u8* q, float*
    // scales, u16* dequant): warp r < rows reads row r of x and writes row r of q, scales and
    // dequant; each holds `rows` rows (checked); hidden is a multiple of 128 (checked), so the
    // 16-byte accesses are aligned in these cudaMalloc'd buffers.
    unsafe { b.launch(grid(r.div_ceil(u64::from(BLOCK / 32)).min(65_535))?) }
        .map_err(launch_err(KernelId::Fp8QuantiseRows))?;
    Ok(())
}
