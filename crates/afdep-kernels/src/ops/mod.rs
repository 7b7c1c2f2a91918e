//! Typed launchers, one per kernel, and the device-side containers they share.
//!
//! Every launcher checks the sizes of its buffers against the shape before it launches
//! ([`KernelError::Shape`]), launches on the context's stream, and returns without waiting:
//! results are read with the stream's copies, which order after the launches.

#[cfg(test)]
mod device_struct;
#[cfg(feature = "fault-injection")]
pub mod fault;
pub mod fp8;
pub mod fused;
pub mod fused_cf;
pub mod fused_front;
pub mod fused_layout;
pub mod fused_round;
pub mod gemm;
pub mod layout;
pub mod moe;
pub mod nccl_round;
pub mod permute;
pub mod probe;
pub mod reference;
pub mod router;
pub mod tma;
pub mod validate;

use afdep_core::Routes;
use cudarc::driver::{CudaSlice, DevicePtrMut, DeviceRepr, LaunchConfig, ValidAsZeroBits};

use crate::context::GpuContext;
use crate::error::KernelError;
use crate::sources::BLOCK;

/// A route table on the device: `tokens × top_k` expert ids (`-1` masked) and weights,
/// row-major (the device form of [`afdep_core::Routes`]).
#[derive(Debug)]
pub struct DeviceRoutes {
    /// Number of tokens.
    pub tokens: usize,
    /// Slots per token.
    pub top_k: usize,
    /// Expert id per slot.
    pub idx: CudaSlice<i32>,
    /// Weight per slot.
    pub weights: CudaSlice<f32>,
}

impl DeviceRoutes {
    /// Bytes on the device (the id and weight tables).
    pub fn device_bytes(&self) -> usize {
        self.idx.len() * 4 + self.weights.len() * 4
    }

    /// A zeroed table for `tokens × top_k` slots.
    pub fn zeros(
        ctx: &GpuContext,
        tokens: usize,
        top_k: usize,
    ) -> Result<DeviceRoutes, KernelError> {
        let n = tokens * top_k;
        Ok(DeviceRoutes {
            tokens,
            top_k,
            idx: zeros(ctx, n)?,
            weights: zeros(ctx, n)?,
        })
    }

    /// Copies a host table to the device.
    pub fn upload(ctx: &GpuContext, routes: &Routes) -> Result<DeviceRoutes, KernelError> {
        let s = ctx.stream();
        let n = routes.tokens * routes.top_k;
        if routes.idx.len() != n || routes.weights.len() != n {
            return Err(KernelError::Shape(format!(
                "{} tokens × {} slots need {n} ids and weights, got {} and {}",
                routes.tokens,
                routes.top_k,
                routes.idx.len(),
                routes.weights.len()
            )));
        }
        let (idx, weights) = if n == 0 {
            (zeros(ctx, 0)?, zeros(ctx, 0)?)
        } else {
            (
                s.clone_htod(&routes.idx)
                    .map_err(KernelError::driver("uploading route ids"))?,
                s.clone_htod(&routes.weights)
                    .map_err(KernelError::driver("uploading route weights"))?,
            )
        };
        Ok(DeviceRoutes {
            tokens: routes.tokens,
            top_k: routes.top_k,
            idx,
            weights,
        })
    }

    /// Copies the table back to the host (waits for the stream).
    pub fn download(&self, ctx: &GpuContext) -> Result<Routes, KernelError> {
        Ok(Routes {
            tokens: self.tokens,
            top_k: self.top_k,
            idx: download(ctx, &self.idx)?,
            weights: download(ctx, &self.weights)?,
        })
    }
}

/// A zeroed device buffer of `n` elements (an empty one for `n == 0`).
pub fn zeros<T: DeviceRepr + ValidAsZeroBits>(
    ctx: &GpuContext,
    n: usize,
) -> Result<CudaSlice<T>, KernelError> {
    let s = ctx.stream();
    if n == 0 {
        s.null()
            .map_err(KernelError::driver("allocating an empty buffer"))
    } else {
        s.alloc_zeros(n)
            .map_err(KernelError::driver(format!("allocating {n} elements")))
    }
}

/// Copies a device buffer to a new host vector (waits for the stream).
pub fn download<T: DeviceRepr + Default + Clone>(
    ctx: &GpuContext,
    buf: &CudaSlice<T>,
) -> Result<Vec<T>, KernelError> {
    if buf.is_empty() {
        return Ok(Vec::new());
    }
    ctx.stream()
        .clone_dtoh(buf)
        .map_err(KernelError::driver("copying to the host"))
}

/// Fills a device buffer with `0xFF` bytes (NaN for floats and bf16, `-1` for signed and
/// `MAX` for unsigned integers): poison outputs before a correctness run.
pub fn poison<T: DeviceRepr + bytemuck::Pod>(
    ctx: &GpuContext,
    buf: &mut CudaSlice<T>,
) -> Result<(), KernelError> {
    if buf.is_empty() {
        return Ok(());
    }
    let stream = ctx.stream();
    let bytes = buf.num_bytes();
    let (ptr, _record) = buf.device_ptr_mut(stream);
    // SAFETY: `ptr` addresses `bytes` bytes of a live allocation owned by `buf`, which is
    // borrowed mutably for the call; `_record` orders later uses after the memset. Every bit
    // pattern is a valid `T` (`Pod`).
    unsafe { cudarc::driver::result::memset_d8_async(ptr, 0xFF, bytes, stream.cu_stream()) }
        .map_err(KernelError::driver("poisoning a buffer"))
}

/// A one-dimensional launch of `blocks` blocks of [`BLOCK`] threads.
pub(crate) fn grid(blocks: u64) -> Result<LaunchConfig, KernelError> {
    let blocks = u32::try_from(blocks.max(1))
        .ok()
        .filter(|&b| b < i32::MAX as u32)
        .ok_or_else(|| {
            KernelError::Unsupported(format!("{blocks} blocks exceed the grid limit"))
        })?;
    Ok(LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (BLOCK, 1, 1),
        shared_mem_bytes: 0,
    })
}

/// Checks that `buf` holds at least `need` elements.
pub(crate) fn need<T>(what: &str, buf: &CudaSlice<T>, need: usize) -> Result<(), KernelError> {
    if buf.len() < need {
        return Err(KernelError::Shape(format!(
            "{what} holds {} elements, {need} are needed",
            buf.len()
        )));
    }
    Ok(())
}

/// A count as the kernels' `u32`, or the reason it does not fit.
pub(crate) fn as_u32(what: &str, v: usize) -> Result<u32, KernelError> {
    u32::try_from(v)
        .map_err(|_| KernelError::Unsupported(format!("{what} = {v} does not fit in 32 bits")))
}
