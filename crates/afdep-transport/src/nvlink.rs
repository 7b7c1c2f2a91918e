//! [`NvlinkIpc`]: device memory, symmetric windows and a table of peer device pointers (behind
//! the cargo feature `nvlink`).
//!
//! # Two ways to run
//!
//! - **in-process** ([`NvlinkIpc::group`], [`NvlinkIpc::group_on_device`]): N ranks as threads of
//!   one process. Every rank has its own CUDA stream on its device's primary context; ranks on
//!   the same device share it (the test setting: 2, 3 or 4 ranks on one GPU), ranks on different
//!   devices get peer access enabled between their contexts. The windows of all ranks are owned
//!   by the group and freed when its last rank is dropped, so a rank never stores into freed
//!   memory. The control plane (span sizes, [`Transport::all_gather`], [`Transport::barrier`]) is
//!   a [`Loopback`] group: host memory, operation numbers, bounded waits.
//! - **multi-process** ([`NvlinkIpc::from_bootstrap`]): one process per rank (normally one GPU
//!   each). Each rank allocates its window with `cuMemAlloc`, exports it with
//!   `cuIpcGetMemHandle`, all-gathers the handles through the [`Bootstrap`] and opens every
//!   peer's with `cuIpcOpenMemHandle`; the control plane is a [`HostTcp`] over the same
//!   bootstrap. (CUDA IPC cannot open a handle in the process that exported it, which is why the
//!   in-process mode shares pointers directly.)
//!
//! Both modes produce the same struct: a stream, a window per rank, and the peer table.
//!
//! # The window
//!
//! Every rank allocates one symmetric window of the same size (`cuMemAlloc`, so it can be
//! exported for IPC), laid out as
//!
//! ```text
//! [ flags: u32 × world, padded to 256 B ][ staging: NvlinkOptions::staging_bytes, padded to 256 B ][ workspace: NvlinkOptions::workspace_bytes ]
//! ```
//!
//! (`cuMemAlloc` returns 256-byte aligned windows, so every workspace base is 256-byte aligned
//! whatever the staging size: the fused kernels' 16-byte accesses rely on it.)
//!
//! - the **flags** and the **staging** area belong to [`Transport::all_to_all_v`];
//! - the **workspace** belongs to the fused kernels of the exchange engine: it is never touched
//!   by the transport. [`NvlinkIpc::workspace_peers`] gives the workspace base of every rank as a
//!   device pointer valid in this rank's context, [`NvlinkIpc::workspace_peer_table`] the device
//!   address of a `u64[world]` copy of that table (what a kernel takes). Neither is part of the
//!   [`Transport`] trait: no other transport has them.
//!
//! # `all_to_all_v`
//!
//! 1. **sizes** (one control-plane all-gather): each rank checks its arguments and publishes a
//!    status word and, for every peer, its send length, its receive length, and where in its own
//!    staging area that peer's bytes go (receive spans packed in rank order). A rank whose receive
//!    total does not fit the staging area fails its arguments ([`InvalidArgument`]). If any rank's
//!    arguments are invalid, every other rank returns [`PeerFailed`] naming the lowest such rank
//!    and no byte moves. Otherwise a pair (source, destination) transfers iff the source's send
//!    length equals the destination's receive length; a receiver with a disagreeing source returns
//!    [`SizeMismatch`] naming the lowest such source, without writing `recv` (like [`Loopback`]),
//!    and that source sends it nothing (and itself succeeds).
//! 2. **stores**: for every transferring peer p with bytes to send, `cuMemcpyDtoDAsync` from
//!    `send` into p's staging area (through the peer pointer), then a `cuMemsetD32Async` of the
//!    operation's flag value into p's flag of this source, on this rank's stream: stream order
//!    puts the flag after the data. The local span is copied `send` → `recv` directly.
//! 3. **completion**: the rank waits (bounded) for its own stream, then polls its flags (bounded)
//!    until every transferring source with bytes has raised this operation's value; the timeout
//!    is a [`Timeout`] naming the lowest source whose flag is missing. Then it copies its staging
//!    area into `recv` and waits for that copy (bounded) before returning.
//!
//! The staging area is reused by the next operation safely: a source stores into a peer's
//! staging area only after the next size all-gather, which the peer joins only after it has
//! copied out of its staging area. Flag values are the operation number plus one, so a flag left
//! from an earlier operation never satisfies a later one. A wait on this rank's own stream that
//! runs out leaves device work in flight that may still write: the transport then closes
//! ([`Closed`] on every later call).
//!
//! `alloc` gives device memory of this rank (`cuMemAlloc`, zeroed); host
//! [`write`](TransportBuffer::write) / [`read`](TransportBuffer::read) go through copies on the
//! rank's stream, each preceded and followed by a bounded wait for the stream.
//!
//! # SM budget
//!
//! The transport's own data plane uses copy engines and memsets only, no kernel, and its waits
//! are on the host; it cannot deadlock against kernels of other ranks sharing the GPU. Kernels
//! that spin on flags in the workspace (the fused engine) must keep their grids small enough that
//! every rank's kernels are resident at once, or bound their spins (see the fused engine).
//!
//! [`InvalidArgument`]: TransportError::InvalidArgument
//! [`PeerFailed`]: TransportError::PeerFailed
//! [`SizeMismatch`]: TransportError::SizeMismatch
//! [`Timeout`]: TransportError::Timeout
//! [`Closed`]: TransportError::Closed

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use cudarc::driver::{CudaContext, CudaStream, sys as cu};
use tracing::debug;

use crate::{
    Bootstrap, DEFAULT_TIMEOUT, HostTcp, Loopback, Span, Transport, TransportBuffer,
    TransportError, TransportKind, check_transfer,
};

const KIND: TransportKind = TransportKind::NvlinkIpc;

/// Sizes of the symmetric window of every rank (the same on every rank).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NvlinkOptions {
    /// Bytes of the staging area of [`Transport::all_to_all_v`]: the most bytes one rank can
    /// receive from its peers in one operation.
    pub staging_bytes: usize,
    /// Bytes of the workspace the fused kernels use (see [`NvlinkIpc::workspace_peers`]).
    pub workspace_bytes: usize,
    /// The bound of every wait.
    pub timeout: Duration,
}

impl Default for NvlinkOptions {
    /// 64 MiB of staging, 64 MiB of workspace, [`DEFAULT_TIMEOUT`].
    fn default() -> Self {
        NvlinkOptions {
            staging_bytes: 64 << 20,
            workspace_bytes: 64 << 20,
            timeout: DEFAULT_TIMEOUT,
        }
    }
}

/// Bytes of the flag area at the start of every window for `world` ranks.
fn flag_bytes(world: usize) -> usize {
    (4 * world).div_ceil(256) * 256
}

fn backend(rank: usize, op: &'static str) -> impl Fn(cu::CUresult) -> TransportError {
    move |r| TransportError::Backend {
        kind: KIND,
        op,
        rank,
        why: format!("{r:?}"),
    }
}

fn check(rank: usize, op: &'static str, r: cu::CUresult) -> Result<(), TransportError> {
    if r == cu::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(backend(rank, op)(r))
    }
}

/// Checks that the driver library loads, initialises and sees a device; returns the device
/// count, or [`TransportError::Unavailable`] (never a panic: cudarc panics on a missing library,
/// so this runs before any other CUDA call).
pub fn probe_driver() -> Result<usize, TransportError> {
    let unavailable = |why: String| TransportError::Unavailable { kind: KIND, why };
    // SAFETY: loading libcuda runs its initialisers, as any CUDA program does.
    if !unsafe { cu::is_culib_present() } {
        return Err(unavailable(
            "libcuda.so (the NVIDIA driver library) cannot be loaded".into(),
        ));
    }
    cudarc::driver::result::init()
        .map_err(|e| unavailable(format!("the NVIDIA driver failed to initialise: {e}")))?;
    let n = CudaContext::device_count()
        .map_err(|e| unavailable(format!("the NVIDIA driver cannot count devices: {e}")))?;
    if n <= 0 {
        return Err(unavailable("the NVIDIA driver sees no CUDA device".into()));
    }
    Ok(n as usize)
}

/// A `cuMemAlloc` allocation, freed on drop.
struct DeviceMem {
    ptr: u64,
    bytes: usize,
    ctx: Arc<CudaContext>,
}

impl DeviceMem {
    /// `bytes` bytes (at least 1) on `ctx`, zeroed on `stream` and waited for (bounded).
    fn zeroed(
        rank: usize,
        ctx: &Arc<CudaContext>,
        stream: &RankStream,
        bytes: usize,
        op: &'static str,
    ) -> Result<DeviceMem, TransportError> {
        ctx.bind_to_thread().map_err(|e| driver_err(rank, op, e))?;
        let mut ptr: cu::CUdeviceptr = 0;
        // SAFETY: ptr is a valid out-pointer; the context is current on this thread.
        check(rank, op, unsafe {
            cu::cuMemAlloc_v2(&mut ptr, bytes.max(1))
        })?;
        let mem = DeviceMem {
            ptr,
            bytes,
            ctx: ctx.clone(),
        };
        // SAFETY: [ptr, ptr + bytes) is the allocation just made.
        check(rank, op, unsafe {
            cu::cuMemsetD8Async(ptr, 0, bytes.max(1), stream.stream.cu_stream())
        })?;
        stream.wait_idle(rank, op)?;
        Ok(mem)
    }
}

impl Drop for DeviceMem {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: ptr came from cuMemAlloc on this context and is freed once; cuMemFree
            // synchronises with work using it.
            let r = unsafe { cu::cuMemFree_v2(self.ptr) };
            if r != cu::CUresult::CUDA_SUCCESS {
                debug!(?r, "cuMemFree failed");
            }
        }
    }
}

fn driver_err(rank: usize, op: &'static str, e: cudarc::driver::DriverError) -> TransportError {
    TransportError::Backend {
        kind: KIND,
        op,
        rank,
        why: e.to_string(),
    }
}

/// A rank's stream and the bound of its waits (shared with the rank's buffers).
struct RankStream {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    /// A second stream for polling flags, so polls never queue behind the rank's work.
    poll: Arc<CudaStream>,
    timeout_ns: AtomicU64,
}

impl RankStream {
    fn timeout(&self) -> Duration {
        Duration::from_nanos(self.timeout_ns.load(Ordering::Relaxed))
    }

    /// Waits until everything queued so far on the stream has run, at most the timeout:
    /// [`TransportError::Timeout`] with `peer: None` otherwise.
    fn wait_idle(&self, rank: usize, op: &'static str) -> Result<(), TransportError> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| driver_err(rank, op, e))?;
        let ev = self
            .ctx
            .new_event(None)
            .map_err(|e| driver_err(rank, op, e))?;
        ev.record(&self.stream)
            .map_err(|e| driver_err(rank, op, e))?;
        let start = Instant::now();
        let limit = self.timeout();
        let mut pause = Duration::from_micros(2);
        loop {
            if ev.try_is_complete().map_err(|e| driver_err(rank, op, e))? {
                return Ok(());
            }
            let waited = start.elapsed();
            if waited >= limit {
                return Err(TransportError::Timeout {
                    op,
                    rank,
                    peer: None,
                    waited,
                });
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_micros(200));
        }
    }
}

/// Device memory of one [`NvlinkIpc`] rank: the [`Transport::Buffer`] of [`NvlinkIpc`].
pub struct NvlinkBuffer {
    rank: usize,
    mem: DeviceMem,
    stream: Arc<RankStream>,
}

impl NvlinkBuffer {
    /// The device address of the first byte (valid in the rank's context).
    pub fn device_ptr(&self) -> u64 {
        self.mem.ptr
    }

    fn range(
        &self,
        op: &'static str,
        peer: Option<usize>,
        span: Span,
    ) -> Result<u64, TransportError> {
        crate::checked_range(op, self.rank, peer, span, self.mem.bytes)?;
        Ok(self.mem.ptr + span.offset)
    }

    /// A copy between host memory and the `len` bytes of this buffer at `offset`, synchronous:
    /// checks the range, waits for the rank's stream to be idle, queues `copy` (given the device
    /// address and the stream; nothing for `len` 0) and waits for it.
    fn host_copy(
        &self,
        op: &'static str,
        offset: usize,
        len: usize,
        copy: impl FnOnce(u64, cu::CUstream) -> cu::CUresult,
    ) -> Result<(), TransportError> {
        let dev = self.range(op, None, Span::new(offset as u64, len as u64))?;
        if len == 0 {
            return Ok(());
        }
        let s = &self.stream;
        s.wait_idle(self.rank, op)?;
        check(self.rank, op, copy(dev, s.stream.cu_stream()))?;
        s.wait_idle(self.rank, op)
    }
}

impl fmt::Debug for NvlinkBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NvlinkBuffer")
            .field("rank", &self.rank)
            .field("len", &self.mem.bytes)
            .finish()
    }
}

impl TransportBuffer for NvlinkBuffer {
    fn len(&self) -> usize {
        self.mem.bytes
    }

    fn write(&mut self, offset: usize, src: &[u8]) -> Result<(), TransportError> {
        self.host_copy("write", offset, src.len(), |dst, stream| {
            // SAFETY: dst..dst+len lies in this allocation (checked by `host_copy`); src outlives
            // the copy, which is waited for before returning.
            unsafe { cu::cuMemcpyHtoDAsync_v2(dst, src.as_ptr().cast(), src.len(), stream) }
        })
    }

    fn read(&self, offset: usize, dst: &mut [u8]) -> Result<(), TransportError> {
        self.host_copy("read", offset, dst.len(), |src, stream| {
            // SAFETY: src..src+len lies in this allocation (checked by `host_copy`); dst outlives
            // the copy, which is waited for before returning.
            unsafe { cu::cuMemcpyDtoHAsync_v2(dst.as_mut_ptr().cast(), src, dst.len(), stream) }
        })
    }
}

/// What keeps the peers' windows mapped: the group's windows (in-process) or this process's
/// window and the IPC mappings of the others (multi-process).
enum Windows {
    /// The windows of the whole group, kept alive until its last rank is dropped (never read:
    /// holding them is the point).
    InProcess(#[allow(dead_code)] Arc<Vec<DeviceMem>>),
    Ipc {
        own: DeviceMem,
        /// Opened peer pointers (not this rank's), closed on drop.
        opened: Vec<u64>,
    },
}

/// The control plane: sizes, all-gather, barrier.
enum Control {
    Local(Loopback),
    Tcp(HostTcp),
}

impl Control {
    fn t(&mut self) -> &mut dyn ControlPlane {
        match self {
            Control::Local(l) => l,
            Control::Tcp(t) => t,
        }
    }
}

/// The control-plane operations [`NvlinkIpc`] borrows from a host transport.
trait ControlPlane {
    fn all_gather(&mut self, mine: &[u8]) -> Result<Vec<u8>, TransportError>;
    fn barrier(&mut self) -> Result<(), TransportError>;
    fn set_timeout(&mut self, t: Duration);
}

impl<T: Transport> ControlPlane for T {
    fn all_gather(&mut self, mine: &[u8]) -> Result<Vec<u8>, TransportError> {
        Transport::all_gather(self, mine)
    }
    fn barrier(&mut self) -> Result<(), TransportError> {
        Transport::barrier(self)
    }
    fn set_timeout(&mut self, t: Duration) {
        Transport::set_timeout(self, t)
    }
}

/// One rank of an NVLink-IPC group; see the [module docs](self).
pub struct NvlinkIpc {
    rank: usize,
    world: usize,
    opts: NvlinkOptions,
    control: Control,
    stream: Arc<RankStream>,
    /// Window base of every rank, valid in this rank's context.
    peers: Vec<u64>,
    /// Workspace base of every rank (`peers[r] + workspace offset`), and its device copy.
    workspace: Vec<u64>,
    workspace_table: DeviceMem,
    /// `all_to_all_v` calls so far (the flag value of the next is this plus one).
    ops: u64,
    closed: Option<String>,
    // declared last: dropped after the table, and after the peers stop being used
    _windows: Windows,
}

impl fmt::Debug for NvlinkIpc {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NvlinkIpc")
            .field("rank", &self.rank)
            .field("world_size", &self.world)
            .field("device", &self.stream.ctx.ordinal())
            .field("opts", &self.opts)
            .finish()
    }
}

/// Byte offset of the workspace in every window: after the flags and the staging area, rounded
/// up to 256 so that the workspace base is 256-byte aligned.
fn workspace_offset(world: usize, opts: &NvlinkOptions) -> usize {
    (flag_bytes(world) + opts.staging_bytes).div_ceil(256) * 256
}

fn window_bytes(world: usize, opts: &NvlinkOptions) -> usize {
    workspace_offset(world, opts) + opts.workspace_bytes
}

fn rank_stream(
    rank: usize,
    ordinal: usize,
    timeout: Duration,
) -> Result<Arc<RankStream>, TransportError> {
    const OP: &str = "init";
    let ctx = CudaContext::new(ordinal).map_err(|e| driver_err(rank, OP, e))?;
    let stream = crate::quiet_stream(&ctx).map_err(|e| driver_err(rank, OP, e))?;
    let poll = crate::quiet_stream(&ctx).map_err(|e| driver_err(rank, OP, e))?;
    Ok(Arc::new(RankStream {
        ctx,
        stream,
        poll,
        timeout_ns: AtomicU64::new(timeout.as_nanos().min(u64::MAX as u128) as u64),
    }))
}

impl NvlinkIpc {
    /// An in-process group of `n` ranks on device `ordinal` (they share its primary context,
    /// one stream each). See [`NvlinkIpc::group`].
    pub fn group_on_device(
        n: usize,
        ordinal: usize,
        opts: NvlinkOptions,
    ) -> Result<Vec<NvlinkIpc>, TransportError> {
        NvlinkIpc::group(&vec![ordinal; n], opts)
    }

    /// An in-process group: rank r on device `ordinals[r]`, one stream each, a window of the
    /// same size each, peer access enabled between distinct devices. Element r is rank r, to be
    /// moved into the thread that plays it. [`TransportError::Unavailable`] without a driver, a
    /// device, or peer access between two of the devices.
    pub fn group(
        ordinals: &[usize],
        opts: NvlinkOptions,
    ) -> Result<Vec<NvlinkIpc>, TransportError> {
        let devices = probe_driver()?;
        let world = ordinals.len();
        if let Some(&o) = ordinals.iter().find(|&&o| o >= devices) {
            return Err(TransportError::Unavailable {
                kind: KIND,
                why: format!("device {o} requested, the driver sees {devices}"),
            });
        }
        let streams = ordinals
            .iter()
            .enumerate()
            .map(|(r, &o)| rank_stream(r, o, opts.timeout))
            .collect::<Result<Vec<_>, _>>()?;
        enable_peer_access(&streams)?;
        let bytes = window_bytes(world, &opts);
        let windows = streams
            .iter()
            .enumerate()
            .map(|(r, s)| DeviceMem::zeroed(r, &s.ctx, s, bytes, "init.window"))
            .collect::<Result<Vec<_>, _>>()?;
        let peers: Vec<u64> = windows.iter().map(|w| w.ptr).collect();
        let shared = Arc::new(windows);
        let controls = Loopback::group(world, opts.timeout);
        let mut out = Vec::with_capacity(world);
        for (rank, (stream, control)) in streams.into_iter().zip(controls).enumerate() {
            out.push(NvlinkIpc::assemble(
                rank,
                world,
                opts,
                Control::Local(control),
                stream,
                peers.clone(),
                Windows::InProcess(shared.clone()),
            )?);
        }
        debug!(world, ?ordinals, bytes, "nvlink-ipc in-process group");
        Ok(out)
    }

    /// The multi-process mode: this process is rank `boot.rank()` of `boot.world_size()`, on
    /// device `ordinal`. Allocates this rank's window, exports it (`cuIpcGetMemHandle`),
    /// all-gathers the handles through `boot`, opens every peer's (`cuIpcOpenMemHandle` with lazy
    /// peer access), and keeps `boot` as the control plane ([`HostTcp`]). Collective over the
    /// bootstrap; every rank must pass the same `opts`. Ranks must be distinct processes.
    pub fn from_bootstrap(
        boot: Bootstrap,
        ordinal: usize,
        opts: NvlinkOptions,
    ) -> Result<NvlinkIpc, TransportError> {
        const OP: &str = "init.ipc";
        let devices = probe_driver()?;
        let (rank, world) = (boot.rank(), boot.world_size());
        if ordinal >= devices {
            return Err(TransportError::Unavailable {
                kind: KIND,
                why: format!("device {ordinal} requested, the driver sees {devices}"),
            });
        }
        let stream = rank_stream(rank, ordinal, opts.timeout)?;
        let bytes = window_bytes(world, &opts);
        let own = DeviceMem::zeroed(rank, &stream.ctx, &stream, bytes, "init.window")?;
        let mut handle = cu::CUipcMemHandle_st { reserved: [0; 64] };
        // SAFETY: own.ptr is the base of a cuMemAlloc allocation of the current context.
        check(rank, OP, unsafe {
            cu::cuIpcGetMemHandle(&mut handle, own.ptr)
        })?;
        let mut mine: Vec<u8> = handle.reserved.iter().map(|&c| c as u8).collect();
        mine.extend_from_slice(&(bytes as u64).to_le_bytes());
        let mut control = HostTcp::new(boot);
        let all = control.bootstrap_mut().all_gather(&mine)?;
        // every blob is checked before any handle is opened
        for (p, blob) in all.iter().enumerate() {
            if blob.len() != 72 {
                return Err(TransportError::Protocol {
                    op: OP,
                    rank,
                    peer: Some(p),
                    why: format!("an IPC handle blob of {} bytes (expected 72)", blob.len()),
                });
            }
            let theirs = u64::from_le_bytes(blob[64..72].try_into().expect("8 bytes"));
            if theirs != bytes as u64 {
                return Err(TransportError::SizeMismatch {
                    op: OP,
                    rank,
                    peer: p,
                    expected: bytes as u64,
                    got: theirs,
                });
            }
        }
        let mut peers = vec![0u64; world];
        peers[rank] = own.ptr;
        // owns what is opened from here on: dropping it closes the handles and frees `own`
        let mut windows = Windows::Ipc {
            own,
            opened: Vec::new(),
        };
        for (p, blob) in all.iter().enumerate().filter(|&(p, _)| p != rank) {
            let mut h = cu::CUipcMemHandle_st { reserved: [0; 64] };
            for (d, s) in h.reserved.iter_mut().zip(&blob[..64]) {
                *d = *s as _;
            }
            let mut ptr: cu::CUdeviceptr = 0;
            // SAFETY: h is a handle another process exported; ptr is a valid out-pointer.
            let r = unsafe {
                cu::cuIpcOpenMemHandle_v2(
                    &mut ptr,
                    h,
                    cu::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
                )
            };
            if r != cu::CUresult::CUDA_SUCCESS {
                return Err(TransportError::Backend {
                    kind: KIND,
                    op: OP,
                    rank,
                    why: format!("opening the IPC handle of rank {p}: {r:?}"),
                });
            }
            if let Windows::Ipc { opened, .. } = &mut windows {
                opened.push(ptr);
            }
            peers[p] = ptr;
        }
        let mut me = NvlinkIpc::assemble(
            rank,
            world,
            opts,
            Control::Tcp(control),
            stream,
            peers,
            windows,
        )?;
        // every rank has opened every handle before anyone stores
        me.control.t().barrier()?;
        debug!(rank, world, ordinal, bytes, "nvlink-ipc multi-process rank");
        Ok(me)
    }

    fn assemble(
        rank: usize,
        world: usize,
        opts: NvlinkOptions,
        control: Control,
        stream: Arc<RankStream>,
        peers: Vec<u64>,
        windows: Windows,
    ) -> Result<NvlinkIpc, TransportError> {
        const OP: &str = "init.table";
        let ws_off = workspace_offset(world, &opts) as u64;
        let workspace: Vec<u64> = peers.iter().map(|&p| p + ws_off).collect();
        let table = DeviceMem::zeroed(rank, &stream.ctx, &stream, 8 * world, OP)?;
        // SAFETY: the table holds 8 * world bytes; `workspace` outlives the copy, waited for
        // below.
        check(rank, OP, unsafe {
            cu::cuMemcpyHtoDAsync_v2(
                table.ptr,
                workspace.as_ptr().cast(),
                8 * world,
                stream.stream.cu_stream(),
            )
        })?;
        stream.wait_idle(rank, OP)?;
        Ok(NvlinkIpc {
            rank,
            world,
            opts,
            control,
            stream,
            peers,
            workspace,
            workspace_table: table,
            ops: 0,
            closed: None,
            _windows: windows,
        })
    }

    /// The sizes of the windows.
    pub fn options(&self) -> &NvlinkOptions {
        &self.opts
    }

    /// The device ordinal of this rank.
    pub fn device(&self) -> usize {
        self.stream.ctx.ordinal()
    }

    /// This rank's CUDA context (the device's primary context).
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.stream.ctx
    }

    /// This rank's stream: the transport's copies run on it, and work the caller orders after
    /// it sees what the transport delivered.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream.stream
    }

    /// The workspace base of every rank, as device pointers valid in this rank's context
    /// (`workspace_peers()[self.rank()]` is this rank's own). Each is
    /// [`NvlinkOptions::workspace_bytes`] long and 256-byte aligned, zeroed at creation.
    pub fn workspace_peers(&self) -> &[u64] {
        &self.workspace
    }

    /// The device address of a `u64[world]` array holding [`NvlinkIpc::workspace_peers`]: the
    /// peer table a kernel takes.
    pub fn workspace_peer_table(&self) -> u64 {
        self.workspace_table.ptr
    }

    /// Reads the device copy of the workspace peer table back (a check of what kernels see).
    pub fn read_workspace_peer_table(&self) -> Result<Vec<u64>, TransportError> {
        const OP: &str = "read_table";
        let s = &self.stream;
        s.wait_idle(self.rank, OP)?;
        let mut out = vec![0u64; self.world];
        // SAFETY: the table holds `world` u64; `out` outlives the copy, waited for below.
        check(self.rank, OP, unsafe {
            cu::cuMemcpyDtoHAsync_v2(
                out.as_mut_ptr().cast(),
                self.workspace_table.ptr,
                8 * self.world,
                s.stream.cu_stream(),
            )
        })?;
        s.wait_idle(self.rank, OP)?;
        Ok(out)
    }

    /// The base of every rank's whole window (flags, staging, workspace), valid in this rank's
    /// context.
    pub fn window_peers(&self) -> &[u64] {
        &self.peers
    }

    fn live(&self, op: &'static str) -> Result<(), TransportError> {
        match &self.closed {
            None => Ok(()),
            Some(why) => Err(TransportError::Closed {
                op,
                rank: self.rank,
                why: why.clone(),
            }),
        }
    }

    /// A wait on this rank's own stream: on a timeout the transport closes.
    fn wait_own(&mut self, op: &'static str) -> Result<(), TransportError> {
        let r = self.stream.wait_idle(self.rank, op);
        if let Err(e) = &r {
            if e.is_timeout() {
                self.closed = Some(format!("{e} (device work left in flight)"));
            }
        }
        r
    }

    /// Polls this rank's flags until every source in `from` shows `value`, bounded.
    fn wait_flags(
        &mut self,
        op: &'static str,
        from: &[usize],
        value: u32,
    ) -> Result<(), TransportError> {
        if from.is_empty() {
            return Ok(());
        }
        let s = self.stream.clone();
        s.ctx
            .bind_to_thread()
            .map_err(|e| driver_err(self.rank, op, e))?;
        let start = Instant::now();
        let limit = s.timeout();
        let mut flags = vec![0u32; self.world];
        let mut pause = Duration::from_micros(1);
        loop {
            // SAFETY: the flag area holds `world` u32 at the start of this rank's window; the
            // copy is waited for below, before `flags` is read.
            check(self.rank, op, unsafe {
                cu::cuMemcpyDtoHAsync_v2(
                    flags.as_mut_ptr().cast(),
                    self.peers[self.rank],
                    4 * self.world,
                    s.poll.cu_stream(),
                )
            })?;
            s.poll
                .synchronize()
                .map_err(|e| driver_err(self.rank, op, e))?;
            let late = from.iter().copied().find(|&p| flags[p] != value);
            let Some(late) = late else {
                return Ok(());
            };
            let waited = start.elapsed();
            if waited >= limit {
                return Err(TransportError::Timeout {
                    op,
                    rank: self.rank,
                    peer: Some(late),
                    waited,
                });
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_micros(100));
        }
    }
}

/// Enables peer access between every two distinct devices of the group.
fn enable_peer_access(streams: &[Arc<RankStream>]) -> Result<(), TransportError> {
    const OP: &str = "init.peer_access";
    let mut devs: Vec<&Arc<RankStream>> = Vec::new();
    for s in streams {
        if !devs.iter().any(|d| d.ctx.ordinal() == s.ctx.ordinal()) {
            devs.push(s);
        }
    }
    for a in &devs {
        for b in &devs {
            if a.ctx.ordinal() == b.ctx.ordinal() {
                continue;
            }
            let mut can = 0;
            // SAFETY: can is a valid out-pointer; both devices exist.
            check(0, OP, unsafe {
                cu::cuDeviceCanAccessPeer(&mut can, a.ctx.cu_device(), b.ctx.cu_device())
            })?;
            if can == 0 {
                return Err(TransportError::Unavailable {
                    kind: KIND,
                    why: format!(
                        "device {} cannot access device {} (no peer access)",
                        a.ctx.ordinal(),
                        b.ctx.ordinal()
                    ),
                });
            }
            a.ctx.bind_to_thread().map_err(|e| driver_err(0, OP, e))?;
            // SAFETY: b's context is a live primary context.
            let r = unsafe { cu::cuCtxEnablePeerAccess(b.ctx.cu_ctx(), 0) };
            if r != cu::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED {
                check(0, OP, r)?;
            }
        }
    }
    Ok(())
}

impl Drop for NvlinkIpc {
    fn drop(&mut self) {
        // nothing of this rank may still be writing into a window when it goes away
        let _ = self.stream.wait_idle(self.rank, "drop");
    }
}

impl Drop for Windows {
    fn drop(&mut self) {
        if let Windows::Ipc { own, opened } = self {
            if own.ctx.bind_to_thread().is_ok() {
                for &p in opened.iter() {
                    // SAFETY: p was opened by cuIpcOpenMemHandle in this process, closed once.
                    let _ = unsafe { cu::cuIpcCloseMemHandle(p) };
                }
            }
        }
    }
}

/// Words per peer in the size all-gather: send length, receive length, staging offset.
const SIZE_WORDS: usize = 3;

impl Transport for NvlinkIpc {
    type Buffer = NvlinkBuffer;

    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world
    }

    fn kind(&self) -> TransportKind {
        KIND
    }

    fn timeout(&self) -> Duration {
        self.stream.timeout()
    }

    fn set_timeout(&mut self, timeout: Duration) {
        self.stream.timeout_ns.store(
            timeout.as_nanos().min(u64::MAX as u128) as u64,
            Ordering::Relaxed,
        );
        self.control.t().set_timeout(timeout);
    }

    fn alloc(&mut self, bytes: usize) -> Result<NvlinkBuffer, TransportError> {
        self.live("alloc")?;
        let mem = DeviceMem::zeroed(self.rank, &self.stream.ctx, &self.stream, bytes, "alloc")?;
        Ok(NvlinkBuffer {
            rank: self.rank,
            mem,
            stream: self.stream.clone(),
        })
    }

    fn all_gather(&mut self, mine: &[u8]) -> Result<Vec<u8>, TransportError> {
        self.live("all_gather")?;
        self.control.t().all_gather(mine)
    }

    fn all_to_all_v(
        &mut self,
        send: &NvlinkBuffer,
        send_spans: &[Span],
        recv: &mut NvlinkBuffer,
        recv_spans: &[Span],
    ) -> Result<(), TransportError> {
        const OP: &str = "all_to_all_v";
        self.live(OP)?;
        let (me, world) = (self.rank, self.world);
        self.ops += 1;
        let flag_value = self.ops as u32;
        let staging = flag_bytes(world) as u64;

        // 1. sizes
        let local = check_transfer(self, OP, send, send_spans, recv, recv_spans).and_then(|()| {
            let total: u64 = (0..world)
                .filter(|&p| p != me)
                .map(|p| recv_spans[p].len)
                .sum();
            if total > self.opts.staging_bytes as u64 {
                return Err(TransportError::InvalidArgument {
                    op: OP,
                    rank: me,
                    why: format!(
                        "{total} bytes to receive exceed the {}-byte staging area \
                         (NvlinkOptions::staging_bytes)",
                        self.opts.staging_bytes
                    ),
                });
            }
            Ok(())
        });
        let mut msg = vec![0u64; 1 + SIZE_WORDS * world];
        match &local {
            Err(_) => msg[0] = 1,
            Ok(()) => {
                let mut at = 0u64;
                for p in 0..world {
                    let w = &mut msg[1 + SIZE_WORDS * p..1 + SIZE_WORDS * (p + 1)];
                    w[0] = send_spans[p].len;
                    w[1] = recv_spans[p].len;
                    if p != me {
                        w[2] = at;
                        at += recv_spans[p].len;
                    }
                }
            }
        }
        let bytes: Vec<u8> = msg.iter().flat_map(|w| w.to_le_bytes()).collect();
        let all = self.control.t().all_gather(&bytes)?;
        let per = bytes.len();
        let word = |r: usize, i: usize| {
            let b = &all[r * per + 8 * i..r * per + 8 * i + 8];
            u64::from_le_bytes(b.try_into().expect("8 bytes"))
        };
        local?;
        if let Some(bad) = (0..world).find(|&r| word(r, 0) != 0) {
            return Err(TransportError::PeerFailed {
                op: OP,
                rank: me,
                peer: bad,
                why: "its arguments were invalid (it reports why)".into(),
            });
        }
        // r's send length to p, p's receive length from r, p's staging offset for r
        let send_len = |r: usize, p: usize| word(r, 1 + SIZE_WORDS * p);
        let recv_len = |p: usize, r: usize| word(p, 1 + SIZE_WORDS * r + 1);
        let stage_off = |p: usize, r: usize| word(p, 1 + SIZE_WORDS * r + 2);

        // 2. stores into the peers' staging areas, then their flags
        let cs = self.stream.stream.cu_stream();
        self.stream
            .ctx
            .bind_to_thread()
            .map_err(|e| driver_err(me, OP, e))?;
        for p in (0..world).filter(|&p| p != me) {
            let len = send_len(me, p);
            if len == 0 || len != recv_len(p, me) {
                continue;
            }
            let dst = self.peers[p] + staging + stage_off(p, me);
            let src = send.range(OP, Some(p), send_spans[p])?;
            // SAFETY: src..src+len lies in `send` (checked); dst..dst+len lies in p's staging
            // area (p checked that its receive total fits); p copies out of it only after this
            // rank's flag below, and nobody else writes this range in this operation.
            check(me, OP, unsafe {
                cu::cuMemcpyDtoDAsync_v2(dst, src, len as usize, cs)
            })?;
            // SAFETY: the flag of source `me` in p's window, 4 bytes.
            check(me, OP, unsafe {
                cu::cuMemsetD32Async(self.peers[p] + 4 * me as u64, flag_value, 1, cs)
            })?;
        }
        let mismatch = (0..world)
            .find(|&p| recv_len(me, p) != send_len(p, me))
            .map(|p| TransportError::SizeMismatch {
                op: OP,
                rank: me,
                peer: p,
                expected: recv_len(me, p),
                got: send_len(p, me),
            });
        if mismatch.is_none() && recv_spans[me].len > 0 {
            let src = send.range(OP, Some(me), send_spans[me])?;
            let dst = recv.range(OP, Some(me), recv_spans[me])?;
            // SAFETY: both ranges are checked and of equal length; send and recv are distinct
            // allocations (one is borrowed mutably).
            check(me, OP, unsafe {
                cu::cuMemcpyDtoDAsync_v2(dst, src, recv_spans[me].len as usize, cs)
            })?;
        }
        self.wait_own(OP)?;
        if let Some(e) = mismatch {
            debug!(rank = me, error = %e, "nvlink-ipc size mismatch");
            return Err(e);
        }

        // 3. completion, then out of the staging area
        let from: Vec<usize> = (0..world)
            .filter(|&p| p != me && recv_spans[p].len > 0)
            .collect();
        self.wait_flags(OP, &from, flag_value)?;
        for &p in &from {
            let src = self.peers[me] + staging + stage_off(me, p);
            let dst = recv.range(OP, Some(p), recv_spans[p])?;
            // SAFETY: the source range was filled by p (flag seen); dst is checked.
            check(me, OP, unsafe {
                cu::cuMemcpyDtoDAsync_v2(dst, src, recv_spans[p].len as usize, cs)
            })?;
        }
        self.wait_own(OP)
    }

    fn barrier(&mut self) -> Result<(), TransportError> {
        self.live("barrier")?;
        self.control.t().barrier()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_workspace_starts_256_byte_aligned_for_any_staging_size() {
        for world in [1, 2, 3, 64, 65] {
            for staging in [0, 1, 16, 100, 256, 4097, 64 << 20] {
                let opts = NvlinkOptions {
                    staging_bytes: staging,
                    workspace_bytes: 1000,
                    ..NvlinkOptions::default()
                };
                let off = workspace_offset(world, &opts);
                assert_eq!(off % 256, 0, "world {world}, staging {staging}");
                assert!(off >= flag_bytes(world) + staging);
                assert!(off < flag_bytes(world) + staging + 256);
                assert_eq!(window_bytes(world, &opts), off + 1000);
            }
        }
        // sizes that were aligned already keep their layout
        let opts = NvlinkOptions {
            staging_bytes: 16 << 20,
            ..NvlinkOptions::default()
        };
        assert_eq!(workspace_offset(4, &opts), 256 + (16 << 20));
    }
}
