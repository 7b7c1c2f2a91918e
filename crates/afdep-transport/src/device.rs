//! Device memory for transports (cargo feature `cuda`, implied by `nccl`): [`DeviceBuffer`], and
//! [`DeviceStaged`], which gives a host-memory transport (UCX with the bundled, not CUDA-aware
//! UCX; TCP) device buffers by staging them through host memory.
//!
//! # Staging
//!
//! [`DeviceStaged`] keeps two host buffers of the same sizes as the device buffers of the call.
//! An `all_to_all_v` copies the bytes of every send span device→host, runs the inner transport's
//! `all_to_all_v` on the host buffers with the same spans, and copies every receive span
//! host→device; the copies of one direction are queued together on the device buffer's stream and
//! waited for once, and all complete before the call returns. The host buffers are **pinned**:
//! ordinary vectors page-locked with `cuMemHostRegister` for as long as they are the staging
//! buffers (unregistered before they are freed or replaced), so the copies are direct DMA, not the
//! driver's bounce through its own pinned buffer, and the inner transport (UCX, TCP) reads and
//! writes the same memory. If the driver refuses to page-lock them (a locked-memory limit), the
//! staging goes on in pageable memory, correct but slower, with a `tracing` warning;
//! [`DeviceStaged::pinned`] says which. Argument errors and size mismatches are
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

    /// Queues the copy of `dst.len()` bytes at `offset` into `dst` on the buffer's stream and
    /// returns without waiting.
    ///
    /// # Safety
    /// `dst` must not be read, written or freed until [`sync`](Self::sync) returned: with
    /// page-locked `dst` the copy runs after this call returns.
    pub(crate) unsafe fn read_queued(
        &self,
        offset: usize,
        dst: &mut [u8],
    ) -> Result<(), TransportError> {
        const OP: &str = "read";
        self.range(OP, offset, dst.len())?;
        if dst.is_empty() {
            return Ok(());
        }
        let src = self.mem.slice(offset..offset + dst.len());
        self.stream.memcpy_dtoh(&src, dst).map_err(driver_error(
            self.kind,
            OP,
            self.rank,
            "device-to-host copy",
        ))
    }

    /// Queues the copy of `src` to `offset` on the buffer's stream and returns without waiting.
    ///
    /// # Safety
    /// `src` must not be written or freed until [`sync`](Self::sync) returned: with page-locked
    /// `src` the copy runs after this call returns.
    pub(crate) unsafe fn write_queued(
        &mut self,
        offset: usize,
        src: &[u8],
    ) -> Result<(), TransportError> {
        const OP: &str = "write";
        self.range(OP, offset, src.len())?;
        if src.is_empty() {
            return Ok(());
        }
        let stream = self.stream.clone();
        let mut dst = self.mem.slice_mut(offset..offset + src.len());
        stream.memcpy_htod(src, &mut dst).map_err(driver_error(
            self.kind,
            OP,
            self.rank,
            "host-to-device copy",
        ))
    }

    /// Waits for every copy queued on the buffer's stream.
    pub(crate) fn sync(&self, op: &'static str) -> Result<(), TransportError> {
        self.stream.synchronize().map_err(driver_error(
            self.kind,
            op,
            self.rank,
            "waiting for the copies",
        ))
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
        // SAFETY: the stream is waited for before `src`'s borrow ends.
        unsafe { self.write_queued(offset, src)? };
        self.sync(OP)
    }

    fn read(&self, offset: usize, dst: &mut [u8]) -> Result<(), TransportError> {
        // SAFETY: the stream is waited for before `dst`'s borrow ends.
        unsafe { self.read_queued(offset, dst)? };
        self.sync("read")
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

/// A staging buffer: host memory page-locked with `cuMemHostRegister` while this value lives
/// (when the driver allows it), unregistered on drop before the memory is freed.
struct Staging {
    buf: HostBuffer,
    ctx: Arc<CudaContext>,
    pinned: bool,
}

impl Staging {
    /// `len` zero bytes of `rank`, page-locked if the driver allows it.
    fn new(ctx: &Arc<CudaContext>, rank: usize, len: usize) -> Staging {
        let mut buf = HostBuffer::zeroed(rank, len);
        let mut pinned = false;
        if len > 0 {
            let ptr = buf.as_mut_slice().as_mut_ptr().cast();
            let done = ctx.bind_to_thread().and_then(|()| {
                // SAFETY: [ptr, ptr + len) is the vector's live heap allocation, which does not
                // move or shrink while this `Staging` owns it and is unregistered in `drop`
                // before it is freed.
                unsafe { cudarc::driver::sys::cuMemHostRegister_v2(ptr, len, 0) }.result()
            });
            match done {
                Ok(()) => pinned = true,
                Err(e) => tracing::warn!(
                    rank,
                    len,
                    "cannot page-lock {len} staging bytes ({e}); staging through pageable memory"
                ),
            }
        }
        Staging {
            buf,
            ctx: ctx.clone(),
            pinned,
        }
    }

    fn len(&self) -> usize {
        self.buf.len()
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        if self.pinned {
            let ptr = self.buf.as_mut_slice().as_mut_ptr().cast();
            let done = self.ctx.bind_to_thread().and_then(|()| {
                // SAFETY: ptr was registered in `new` and is still allocated (the vector is
                // freed after this).
                unsafe { cudarc::driver::sys::cuMemHostUnregister(ptr) }.result()
            });
            if let Err(e) = done {
                tracing::warn!("unregistering a staging buffer failed: {e}");
            }
        }
    }
}

/// A host-memory transport with device buffers staged through pinned host memory; see the
/// [module docs](self).
pub struct DeviceStaged<T: Transport<Buffer = HostBuffer>> {
    inner: T,
    device: usize,
    stream: Arc<CudaStream>,
    host_send: Staging,
    host_recv: Staging,
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
        let stream =
            crate::quiet_stream(&ctx).map_err(driver_error(kind, OP, rank, "creating a stream"))?;
        Ok(DeviceStaged {
            inner,
            device,
            host_send: Staging::new(&ctx, rank, 0),
            host_recv: Staging::new(&ctx, rank, 0),
            stream,
        })
    }

    /// Whether both staging buffers of the last call were page-locked (`true` before the first
    /// call: empty buffers need no locking).
    pub fn pinned(&self) -> bool {
        [&self.host_send, &self.host_recv]
            .iter()
            .all(|b| b.pinned || b.len() == 0)
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
        const OP: &str = "all_to_all_v";
        let rank = self.rank();
        let ctx = self.stream.context().clone();
        if self.host_send.len() != send.len {
            self.host_send = Staging::new(&ctx, rank, send.len);
        }
        if self.host_recv.len() != recv.len {
            self.host_recv = Staging::new(&ctx, rank, recv.len);
        }
        let queued = in_bounds(send_spans, send.len).try_for_each(|r| {
            // SAFETY: host_send is neither touched nor freed before the sync below.
            unsafe { send.read_queued(r.start, &mut self.host_send.buf.as_mut_slice()[r]) }
        });
        // wait even after a failed queueing: no copy may outlive this call
        let synced = send.sync(OP);
        queued.and(synced)?;
        self.inner.all_to_all_v(
            &self.host_send.buf,
            send_spans,
            &mut self.host_recv.buf,
            recv_spans,
        )?;
        let queued = in_bounds(recv_spans, recv.len).try_for_each(|r| {
            // SAFETY: host_recv is neither touched nor freed before the sync below.
            unsafe { recv.write_queued(r.start, &self.host_recv.buf.as_slice()[r]) }
        });
        let synced = recv.sync(OP);
        queued.and(synced)
    }

    fn barrier(&mut self) -> Result<(), TransportError> {
        self.inner.barrier()
    }
}
