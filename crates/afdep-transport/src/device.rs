//! Device memory for transports (cargo feature `cuda`, implied by `nccl`): [`DeviceBuffer`], and
//! [`DeviceStaged`], which gives a host-memory transport (UCX with the bundled, not CUDA-aware
//! UCX; TCP) device buffers by staging them through host memory.
//!
//! # Staging
//!
//! [`DeviceStaged`] keeps two host buffers of the same sizes as the device buffers of the call.
//! An `all_to_all_v` copies the bytes of every send span device→host, runs the inner transport's
//! `all_to_all_v` on the host buffers with the same spans, and copies every receive span
//! host→device; all copies are on the wrapper's stream and complete before the call returns. The
//! host buffers are ordinary (pageable) memory: simple and correct, at the price of the driver's
//! bounce copies; pinned staging is a later optimisation. Argument errors and size mismatches are
//! those of the inner transport, which sees exactly the caller's spans over buffers of the
//! caller's sizes, so it reports them as it always does (and the group stays usable).
//!
//! A CUDA-aware UCX (configured `--with-cuda`, linked through `UCX_DIR`, see the `ucx` module)
//! could take device pointers directly instead; the bundled one cannot.

use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::{CudaContext, CudaSlice, CudaStream};

use crate::{HostBuffer, Span, Transport, TransportBuffer, TransportError, TransportKind};

/// A driver error as a [`Backend`](TransportError::Backend) error of `kind`.
pub(crate) fn driver_error(
    kind: TransportKind,
    op: &'static str,
    rank: usize,
    what: &str,
) -> impl Fn(cudarc::driver::DriverError) -> TransportError {
    move |e| TransportError::Backend {
        kind,
        op,
        rank,
        why: format!("{what}: {e}"),
    }
}

/// Device memory of a device transport; host reads and writes are copies on the transport's
/// stream, completed before they return.
pub struct DeviceBuffer {
    kind: TransportKind,
    rank: usize,
    len: usize,
    stream: Arc<CudaStream>,
    /// At least one byte (a zero-byte allocation is not allowed), `len` of them in use.
    mem: CudaSlice<u8>,
}

impl std::fmt::Debug for DeviceBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceBuffer")
            .field("kind", &self.kind)
            .field("rank", &self.rank)
            .field("len", &self.len)
            .finish()
    }
}

impl DeviceBuffer {
    /// `bytes` zero bytes on `stream`'s device.
    pub(crate) fn zeroed(
        kind: TransportKind,
        op: &'static str,
        rank: usize,
        stream: &Arc<CudaStream>,
        bytes: usize,
    ) -> Result<DeviceBuffer, TransportError> {
        let mem = stream
            .alloc_zeros::<u8>(bytes.max(1))
            .map_err(driver_error(kind, op, rank, "allocating device memory"))?;
        stream
            .synchronize()
            .map_err(driver_error(kind, op, rank, "zeroing device memory"))?;
        Ok(DeviceBuffer {
            kind,
            rank,
            len: bytes,
            stream: stream.clone(),
            mem,
        })
    }

    /// The allocation.
    pub fn mem(&self) -> &CudaSlice<u8> {
        &self.mem
    }

    /// The allocation, mutably.
    pub fn mem_mut(&mut self) -> &mut CudaSlice<u8> {
        &mut self.mem
    }

    fn range(&self, op: &'static str, offset: usize, n: usize) -> Result<(), TransportError> {
        match offset.checked_add(n) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(TransportError::OutOfBounds {
                op,
                rank: self.rank,
                peer: None,
                offset: offset as u64,
                len: n as u64,
                size: self.len as u64,
            }),
        }
    }
}

impl TransportBuffer for DeviceBuffer {
    fn len(&self) -> usize {
        self.len
    }

    fn write(&mut self, offset: usize, src: &[u8]) -> Result<(), TransportError> {
        const OP: &str = "write";
        self.range(OP, offset, src.len())?;
        if src.is_empty() {
            return Ok(());
        }
        let err = driver_error(self.kind, OP, self.rank, "host-to-device copy");
        let stream = self.stream.clone();
        let mut dst = self.mem.slice_mut(offset..offset + src.len());
        stream.memcpy_htod(src, &mut dst).map_err(&err)?;
        stream.synchronize().map_err(&err)
    }

    fn read(&self, offset: usize, dst: &mut [u8]) -> Result<(), TransportError> {
        const OP: &str = "read";
        self.range(OP, offset, dst.len())?;
        if dst.is_empty() {
            return Ok(());
        }
        let err = driver_error(self.kind, OP, self.rank, "device-to-host copy");
        let src = self.mem.slice(offset..offset + dst.len());
        self.stream.memcpy_dtoh(&src, dst).map_err(&err)?;
        self.stream.synchronize().map_err(&err)
    }
}

/// The CUDA driver's device count, or [`Unavailable`](TransportError::Unavailable) for `kind`
/// with the reason (no driver library, no device), never a panic.
pub fn probe_devices(kind: TransportKind) -> Result<usize, TransportError> {
    let no = |why: String| TransportError::Unavailable { kind, why };
    // SAFETY: only tries to load the driver library by its candidate names.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err(no(
            "libcuda.so (the NVIDIA driver library) cannot be loaded: no NVIDIA driver here".into(),
        ));
    }
    cudarc::driver::result::init().map_err(|e| {
        no(format!(
            "the NVIDIA driver failed to initialise (cuInit): {e}"
        ))
    })?;
    let n = CudaContext::device_count()
        .map_err(|e| no(format!("the NVIDIA driver cannot count devices: {e}")))?
        .max(0) as usize;
    if n == 0 {
        return Err(no("no CUDA device is visible".into()));
    }
    Ok(n)
}

/// A host-memory transport with device buffers staged through host memory; see the
/// [module docs](self).
pub struct DeviceStaged<T: Transport<Buffer = HostBuffer>> {
    inner: T,
    device: usize,
    stream: Arc<CudaStream>,
    host_send: HostBuffer,
    host_recv: HostBuffer,
}

impl<T: Transport<Buffer = HostBuffer> + std::fmt::Debug> std::fmt::Debug for DeviceStaged<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceStaged")
            .field("inner", &self.inner)
            .field("device", &self.device)
            .finish()
    }
}

impl<T: Transport<Buffer = HostBuffer>> DeviceStaged<T> {
    /// Wraps `inner`, with device buffers on CUDA device `device` (`None`: this rank modulo the
    /// number of devices; several ranks may share one device). Local: not a collective.
    pub fn new(inner: T, device: Option<usize>) -> Result<DeviceStaged<T>, TransportError> {
        const OP: &str = "device.init";
        let (kind, rank) = (inner.kind(), inner.rank());
        let n = probe_devices(kind)?;
        let device = device.unwrap_or(rank % n);
        if device >= n {
            return Err(TransportError::InvalidArgument {
                op: OP,
                rank,
                why: format!("device {device} does not exist ({n} visible)"),
            });
        }
        let ctx =
            CudaContext::new(device).map_err(driver_error(kind, OP, rank, "creating a context"))?;
        let stream = ctx
            .new_stream()
            .map_err(driver_error(kind, OP, rank, "creating a stream"))?;
        Ok(DeviceStaged {
            inner,
            device,
            stream,
            host_send: HostBuffer::zeroed(rank, 0),
            host_recv: HostBuffer::zeroed(rank, 0),
        })
    }

    /// The host transport underneath.
    pub fn inner_mut(&mut self) -> &mut T {
        &mut self.inner
    }

    /// This rank's CUDA device.
    pub fn device(&self) -> usize {
        self.device
    }
}

/// The non-empty spans of `spans` that lie inside a buffer of `len` bytes, as ranges (the inner
/// transport reports the others).
fn in_bounds(spans: &[Span], len: usize) -> impl Iterator<Item = std::ops::Range<usize>> + '_ {
    spans.iter().filter_map(move |s| match s.end() {
        Some(end) if s.len > 0 && end <= len as u64 => Some(s.offset as usize..end as usize),
        _ => None,
    })
}

impl<T: Transport<Buffer = HostBuffer>> Transport for DeviceStaged<T> {
    type Buffer = DeviceBuffer;

    fn rank(&self) -> usize {
        self.inner.rank()
    }

    fn world_size(&self) -> usize {
        self.inner.world_size()
    }

    fn kind(&self) -> TransportKind {
        self.inner.kind()
    }

    fn timeout(&self) -> Duration {
        self.inner.timeout()
    }

    fn set_timeout(&mut self, timeout: Duration) {
        self.inner.set_timeout(timeout);
    }

    fn alloc(&mut self, bytes: usize) -> Result<DeviceBuffer, TransportError> {
        let (kind, rank) = (self.kind(), self.rank());
        DeviceBuffer::zeroed(kind, "alloc", rank, &self.stream, bytes)
    }

    fn all_gather(&mut self, mine: &[u8]) -> Result<Vec<u8>, TransportError> {
        self.inner.all_gather(mine)
    }

    fn all_to_all_v(
        &mut self,
        send: &DeviceBuffer,
        send_spans: &[Span],
        recv: &mut DeviceBuffer,
        recv_spans: &[Span],
    ) -> Result<(), TransportError> {
        let rank = self.rank();
        if self.host_send.len() != send.len {
            self.host_send = HostBuffer::zeroed(rank, send.len);
        }
        if self.host_recv.len() != recv.len {
            self.host_recv = HostBuffer::zeroed(rank, recv.len);
        }
        for r in in_bounds(send_spans, send.len) {
            send.read(r.start, &mut self.host_send.as_mut_slice()[r])?;
        }
        self.inner
            .all_to_all_v(&self.host_send, send_spans, &mut self.host_recv, recv_spans)?;
        for r in in_bounds(recv_spans, recv.len) {
            recv.write(r.start, &self.host_recv.as_slice()[r])?;
        }
        Ok(())
    }

    fn barrier(&mut self) -> Result<(), TransportError> {
        self.inner.barrier()
    }
}
