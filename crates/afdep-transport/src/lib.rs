//! afdep-transport: how bytes move between the ranks of one exchange.
//!
//! One trait, [`Transport`], is what the exchange engines program against. It has three parts:
//!
//! - **memory**: [`Transport::alloc`] returns a [`TransportBuffer`] of the kind the transport moves
//!   (host memory for [`Loopback`] and [`HostTcp`], device memory for NCCL and NVLink), with
//!   bounds-checked host [`write`](TransportBuffer::write) and [`read`](TransportBuffer::read);
//! - **control plane**: [`Transport::all_gather`] (equal-length blobs, concatenated in rank order)
//!   and [`Transport::barrier`];
//! - **data plane**: [`Transport::all_to_all_v`], an all-to-all with per-peer byte ranges
//!   ([`Span`], 64-bit offsets) on both sides.
//!
//! Every collective is called by every rank of the group, in the same order. The k-th collective
//! call of each rank forms the k-th operation of the group (the implementations number them, see
//! [`loopback`]). Every wait is bounded by the transport's timeout ([`Transport::timeout`],
//! [`DEFAULT_TIMEOUT`] unless set), and every error ([`TransportError`]) names the rank that
//! reports it and, where known, the peer at fault.
//!
//! # Implementations
//!
//! | kind | where | memory | status |
//! |------|-------|--------|--------|
//! | [`Loopback`] | ranks are threads of one process | host | here: tests, no-GPU default |
//! | [`HostTcp`] | ranks are processes | host | here: star through rank 0 over [`Bootstrap`] |
//! | `NvlinkIpc` | GPUs of one NVLink domain | device | here behind the cargo feature `nvlink` (module `nvlink`: in-process ranks on one or several GPUs, or one process per GPU over CUDA IPC) |
//! | `Nccl` | GPUs, any NCCL topology | device | here behind the cargo feature `nccl` (module `nccl`), maps as below |
//! | `Ucx` | processes or machines (scale-out) | host | here behind the cargo feature `ucx` (module `ucx`: tagged messages) |
//!
//! Multi-process transports rendezvous through [`Bootstrap`] (rank 0 listens on
//! `AFDEP_RENDEZVOUS`, every other rank connects; [`Bootstrap::from_env`]) and exchange their
//! variable-length set-up blobs (CUDA IPC handles, the NCCL unique id, UCX worker addresses) with
//! [`Bootstrap::all_gather`] and [`Bootstrap::broadcast`].
//!
//! ## How the GPU transports map onto the trait
//!
//! - **NvlinkIpc** (CUDA IPC / peer access, GPU-initiated stores). `Buffer` is a device
//!   allocation of this process; `alloc` is local, like on every transport. At construction each
//!   rank allocates a *symmetric* receive window (same size on every rank), exports its
//!   `cudaIpcMemHandle` and all-gathers the handles through the bootstrap, opens every peer's
//!   handle and keeps the **table of peer device pointers**. `all_to_all_v` is count-first: the
//!   ranks exchange the lengths of their spans (a small control-plane gather, which is also where a
//!   [`SizeMismatch`](TransportError::SizeMismatch) is detected), then one copy kernel per rank
//!   stores `send.range(send_spans[p])` straight into rank p's window through the peer table and
//!   raises a per-(op, source) flag there; each rank waits on its flags (bounded spin, then
//!   [`Timeout`](TransportError::Timeout) naming the source whose flag is missing) and copies its
//!   window into `recv.range(recv_spans[p])` (or uses the window as `recv` directly). `all_gather`
//!   and `barrier` use flags in the window or the bootstrap. The fused engine, which issues its own
//!   stores from its own kernels, gets the peer table from an NvlinkIpc-specific accessor of the
//!   symmetric workspace; it is deliberately not part of this trait, since no other transport has
//!   one.
//! - **Nccl** (through cudarc). `Buffer` is device memory; the communicator is created from a
//!   unique id that rank 0 [broadcasts](Bootstrap::broadcast). `all_to_all_v` is one
//!   `ncclGroupStart`; for each peer p `ncclSend(send + send_spans[p].offset,
//!   send_spans[p].len, ncclUint8, p)` and `ncclRecv(recv + recv_spans[p].offset,
//!   recv_spans[p].len, ncclUint8, p)`; `ncclGroupEnd` on the transport's CUDA stream. NCCL cannot
//!   detect a size disagreement (it hangs or truncates), so the lengths are first compared through
//!   a small host all-gather, as for NvlinkIpc. Completion is awaited by polling an event up to
//!   the timeout; on expiry the communicator is aborted (`ncclCommAbort`) and the error is a
//!   `Timeout` with `peer: None` (NCCL cannot say who is late). `all_gather` is `ncclAllGather`
//!   over a staging buffer and `barrier` a one-element all-reduce, or both go through the
//!   bootstrap.
//! - **Ucx** (tagged messages / RMA). `Buffer` is host memory, or CUDA memory registered with
//!   `ucp_mem_map` when UCX is CUDA-aware. Endpoints are created from worker addresses all-gathered
//!   through the bootstrap. `all_to_all_v` posts, for every peer, a tagged send of
//!   `send.range(send_spans[p])` and a tagged receive into `recv.range(recv_spans[p])`, with the tag
//!   built from (operation number, source rank), exactly the key [`Loopback`] uses for its
//!   mailboxes; a received length different from the posted receive is a `SizeMismatch`. With RMA,
//!   each rank publishes its recv offsets and remote keys and peers `ucp_put` into them, then
//!   flush and a flag. The progress loop is bounded by the timeout; an endpoint error
//!   (`UCS_ERR_ENDPOINT_TIMEOUT`, `UCS_ERR_CONNECTION_RESET`) is a
//!   [`PeerGone`](TransportError::PeerGone) naming that endpoint's rank.
//!
//! On return from `all_to_all_v` the data is in `recv`: visible to [`TransportBuffer::read`] and to
//! any later work the caller orders after the transport (for device transports: later work on the
//! transport's stream).

mod any;
pub mod bootstrap;
#[cfg(feature = "cuda")]
pub mod device;
mod error;
pub mod host_tcp;
pub mod loopback;
#[cfg(feature = "nccl")]
pub mod nccl;
#[cfg(feature = "nvlink")]
pub mod nvlink;
#[cfg(feature = "nvlink")]
pub mod testing;
#[cfg(feature = "ucx")]
pub mod ucx;

/// A new non-blocking stream of `ctx` without the `cuCtxSynchronize` of cudarc's first
/// `new_stream` on a context object (`afdep_kernels::quiet_stream` says why: on a GPU whose
/// emulated ranks spin on each other, that wait stalls a peer's kernel until it times out).
#[cfg(any(feature = "nvlink", feature = "cuda"))]
pub(crate) fn quiet_stream(
    ctx: &std::sync::Arc<cudarc::driver::CudaContext>,
) -> Result<std::sync::Arc<cudarc::driver::CudaStream>, cudarc::driver::DriverError> {
    ctx.default_stream().fork()
}

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

#[cfg(feature = "nvlink")]
pub use any::nvlink_options;
pub use any::{
    AnyBuffer, AnyTransport, DEFAULT_WINDOW_BYTES, TransportConfig, TransportOptions,
    TransportTable,
};
pub use bootstrap::{
    Bootstrap, BootstrapListener, ENV_JOB_ID, ENV_RANK, ENV_RENDEZVOUS, ENV_WORLD_SIZE,
    InvalidJobId, JobId, RendezvousEnv, job_from_env,
};
#[cfg(feature = "cuda")]
pub use device::{DeviceBuffer, DeviceStaged};
pub use error::{HandshakeFault, TransportError};

/// Entry points of the fuzz tests (`tests/fuzz_bootstrap.rs`; a coverage-guided fuzzer could
/// call them too): each runs decoders on arbitrary bytes and panics only when an invariant breaks.
#[doc(hidden)]
pub mod fuzzing {
    pub use crate::bootstrap::fuzz_decoders as bootstrap_decoders;
}
pub use host_tcp::HostTcp;
pub use loopback::Loopback;
#[cfg(feature = "nccl")]
pub use nccl::{Nccl, NcclBuffer, RawPart};
#[cfg(feature = "nvlink")]
pub use nvlink::{NvlinkBuffer, NvlinkIpc, NvlinkOptions};
#[cfg(feature = "ucx")]
pub use ucx::{Ucx, UcxOptions};

/// The timeout of every wait unless a transport is given another one: 30 s.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30);

/// Which transport moves the bytes: a config value, so swapping transports is not a code change.
///
/// Text forms ([`Display`](fmt::Display) / [`FromStr`]): `loopback`, `tcp`, `nvlink-ipc`, `nccl`,
/// `ucx` (parsing also accepts `host-tcp`, `nvlink`, `nvlink_ipc`, and any letter case).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TransportKind {
    /// In-process ranks (threads), host memory: [`Loopback`].
    Loopback,
    /// Processes over TCP, host memory, relayed through rank 0: [`HostTcp`].
    HostTcp,
    /// CUDA IPC / peer access inside one NVLink domain, device memory.
    NvlinkIpc,
    /// NCCL grouped send/recv on a CUDA stream, device memory.
    Nccl,
    /// UCX tagged messages or RMA, host or CUDA-aware memory.
    Ucx,
}

impl TransportKind {
    /// Every kind, in declaration order.
    pub const ALL: [TransportKind; 5] = [
        TransportKind::Loopback,
        TransportKind::HostTcp,
        TransportKind::NvlinkIpc,
        TransportKind::Nccl,
        TransportKind::Ucx,
    ];

    /// The canonical text form.
    pub fn name(self) -> &'static str {
        match self {
            TransportKind::Loopback => "loopback",
            TransportKind::HostTcp => "tcp",
            TransportKind::NvlinkIpc => "nvlink-ipc",
            TransportKind::Nccl => "nccl",
            TransportKind::Ucx => "ucx",
        }
    }
}

impl fmt::Display for TransportKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A transport name that [`TransportKind::from_str`] does not know.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown transport {text:?} (expected one of: loopback, tcp, nvlink-ipc, nccl, ucx)")]
pub struct ParseTransportKindError {
    /// The text given.
    pub text: String,
}

impl FromStr for TransportKind {
    type Err = ParseTransportKindError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let t = s.trim().to_ascii_lowercase();
        Ok(match t.as_str() {
            "loopback" => TransportKind::Loopback,
            "tcp" | "host-tcp" | "host_tcp" | "hosttcp" => TransportKind::HostTcp,
            "nvlink-ipc" | "nvlink_ipc" | "nvlink" | "nvlinkipc" => TransportKind::NvlinkIpc,
            "nccl" => TransportKind::Nccl,
            "ucx" => TransportKind::Ucx,
            _ => {
                return Err(ParseTransportKindError {
                    text: s.to_string(),
                });
            }
        })
    }
}

/// A byte range of a buffer: `offset .. offset + len`. 64-bit, since expanded MoE buffers pass
/// 2^32 bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Span {
    /// First byte.
    pub offset: u64,
    /// Number of bytes.
    pub len: u64,
}

impl Span {
    /// The empty span at offset 0.
    pub const EMPTY: Span = Span { offset: 0, len: 0 };

    /// `offset .. offset + len`.
    pub const fn new(offset: u64, len: u64) -> Span {
        Span { offset, len }
    }

    /// One past the last byte, or `None` if that overflows `u64`.
    pub const fn end(&self) -> Option<u64> {
        self.offset.checked_add(self.len)
    }

    /// Whether the span holds no byte.
    pub const fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Lays `lens` out back to back from offset 0: the spans of a packed buffer, and its total.
    pub fn packed(lens: &[u64]) -> (Vec<Span>, u64) {
        let mut at = 0u64;
        let spans = lens
            .iter()
            .map(|&len| {
                let s = Span { offset: at, len };
                at += len;
                s
            })
            .collect();
        (spans, at)
    }
}

/// Memory a transport moves: host memory or device memory, accessed from the host through
/// bounds-checked copies (for device memory these are host↔device copies).
pub trait TransportBuffer: Send {
    /// Size in bytes.
    fn len(&self) -> usize;

    /// Whether the buffer has no byte.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Copies `src` into the buffer at `offset`. Fails with
    /// [`OutOfBounds`](TransportError::OutOfBounds) if it does not fit.
    fn write(&mut self, offset: usize, src: &[u8]) -> Result<(), TransportError>;

    /// Copies `dst.len()` bytes from `offset` into `dst`. Fails with
    /// [`OutOfBounds`](TransportError::OutOfBounds) if the range does not fit.
    fn read(&self, offset: usize, dst: &mut [u8]) -> Result<(), TransportError>;
}

/// How bytes move between the ranks of one exchange. See the [crate docs](crate) for how
/// Loopback, TCP, NVLink-IPC, NCCL and UCX map onto it.
///
/// Collective methods (`all_gather`, `all_to_all_v`, `barrier`) must be called by every rank of
/// the group in the same order; each call is one operation of the group, whether it succeeds or
/// fails. `alloc` is local (not collective) on every transport.
///
/// # Errors and recovery
///
/// A rank with invalid arguments still takes part in the operation (it tells its peers, which
/// fail the operation with [`PeerFailed`](TransportError::PeerFailed) instead of waiting), and a
/// size mismatch is found on the receiver after a complete exchange; on [`Loopback`] and
/// [`HostTcp`] both leave the group usable for the next operation. On [`Loopback`] a timeout does
/// too (see [`loopback`] for how operation numbers keep a failed operation from leaking into the
/// next); a transport whose streams lose their framing on a timeout ([`HostTcp`]) or that must
/// abort its communicator (NCCL) closes instead, and later calls fail with
/// [`Closed`](TransportError::Closed). A [`PeerGone`](TransportError::PeerGone) is permanent.
pub trait Transport: Send {
    /// The memory this transport moves: host memory for Loopback, TCP and UCX-host, device memory
    /// for NCCL and NVLink.
    type Buffer: TransportBuffer;

    /// This rank, `0..world_size()`.
    fn rank(&self) -> usize;

    /// The number of ranks in the group.
    fn world_size(&self) -> usize;

    /// Which transport this is.
    fn kind(&self) -> TransportKind;

    /// The bound of every wait of this transport.
    fn timeout(&self) -> Duration;

    /// Sets the bound of every later wait of this transport (this rank only).
    fn set_timeout(&mut self, timeout: Duration);

    /// A zeroed buffer of `bytes` bytes. Local: not a collective.
    fn alloc(&mut self, bytes: usize) -> Result<Self::Buffer, TransportError>;

    /// Control plane: every rank contributes `mine` (the same length on every rank); returns all
    /// contributions concatenated in rank order (`world_size() * mine.len()` bytes). A rank whose
    /// contribution has another length is reported as a
    /// [`SizeMismatch`](TransportError::SizeMismatch).
    fn all_gather(&mut self, mine: &[u8]) -> Result<Vec<u8>, TransportError>;

    /// Data plane: `send.range(send_spans[p])` goes to rank p, and what rank p sends this rank
    /// lands in `recv.range(recv_spans[p])` (both slices have `world_size()` entries; the entry of
    /// this rank is a local copy). Sizes must agree pairwise: `send_spans[q].len` on rank p equals
    /// `recv_spans[p].len` on rank q; a disagreement is a
    /// [`SizeMismatch`](TransportError::SizeMismatch) on (at least) the receiving rank, and
    /// never a hang. Receive spans must not overlap. Zero-length spans are fine.
    fn all_to_all_v(
        &mut self,
        send: &Self::Buffer,
        send_spans: &[Span],
        recv: &mut Self::Buffer,
        recv_spans: &[Span],
    ) -> Result<(), TransportError>;

    /// Returns once every rank has entered the barrier (or fails within the timeout).
    fn barrier(&mut self) -> Result<(), TransportError>;
}

/// Host memory, the [`Transport::Buffer`] of [`Loopback`] and [`HostTcp`]. It remembers the rank
/// that allocated it, so its errors name that rank.
#[derive(Clone, PartialEq, Eq)]
pub struct HostBuffer {
    rank: usize,
    data: Vec<u8>,
}

impl HostBuffer {
    /// `len` zero bytes owned by `rank`.
    pub fn zeroed(rank: usize, len: usize) -> HostBuffer {
        HostBuffer {
            rank,
            data: vec![0; len],
        }
    }

    /// Wraps `data`, owned by `rank`.
    pub fn from_vec(rank: usize, data: Vec<u8>) -> HostBuffer {
        HostBuffer { rank, data }
    }

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        &self.data
    }

    /// The bytes, mutably.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        &mut self.data
    }

    /// The bytes, by value.
    pub fn into_vec(self) -> Vec<u8> {
        self.data
    }

    /// The bytes of `span`, or `OutOfBounds` (naming `op` and `peer`).
    pub(crate) fn span(
        &self,
        op: &'static str,
        peer: Option<usize>,
        span: Span,
    ) -> Result<&[u8], TransportError> {
        let r = checked_range(op, self.rank, peer, span, self.data.len())?;
        Ok(&self.data[r])
    }

    /// The bytes of `span`, mutably, or `OutOfBounds` (naming `op` and `peer`).
    pub(crate) fn span_mut(
        &mut self,
        op: &'static str,
        peer: Option<usize>,
        span: Span,
    ) -> Result<&mut [u8], TransportError> {
        let r = checked_range(op, self.rank, peer, span, self.data.len())?;
        Ok(&mut self.data[r])
    }
}

impl fmt::Debug for HostBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HostBuffer")
            .field("rank", &self.rank)
            .field("len", &self.data.len())
            .finish()
    }
}

impl TransportBuffer for HostBuffer {
    fn len(&self) -> usize {
        self.data.len()
    }

    fn write(&mut self, offset: usize, src: &[u8]) -> Result<(), TransportError> {
        let dst = self.span_mut("write", None, Span::new(offset as u64, src.len() as u64))?;
        dst.copy_from_slice(src);
        Ok(())
    }

    fn read(&self, offset: usize, dst: &mut [u8]) -> Result<(), TransportError> {
        let src = self.span("read", None, Span::new(offset as u64, dst.len() as u64))?;
        dst.copy_from_slice(src);
        Ok(())
    }
}

/// `span` as a `usize` range of a `size`-byte buffer, or `OutOfBounds`.
fn checked_range(
    op: &'static str,
    rank: usize,
    peer: Option<usize>,
    span: Span,
    size: usize,
) -> Result<std::ops::Range<usize>, TransportError> {
    let oob = || TransportError::OutOfBounds {
        op,
        rank,
        peer,
        offset: span.offset,
        len: span.len,
        size: size as u64,
    };
    match span.end() {
        Some(end) if end <= size as u64 => Ok(span.offset as usize..end as usize),
        _ => Err(oob()),
    }
}

/// Concatenates the contributions of an [`all_gather`](Transport::all_gather) in rank order,
/// each checked to be as long as this rank's (`mine_len`): one of another length is a
/// [`SizeMismatch`](TransportError::SizeMismatch) on `rank` naming the lowest such peer. For
/// implementers of [`Transport`].
pub fn concat_gathered<'a>(
    op: &'static str,
    rank: usize,
    mine_len: usize,
    bodies: impl IntoIterator<Item = &'a [u8]>,
) -> Result<Vec<u8>, TransportError> {
    let mut out = Vec::new();
    for (peer, body) in bodies.into_iter().enumerate() {
        if body.len() != mine_len {
            return Err(TransportError::SizeMismatch {
                op,
                rank,
                peer,
                expected: mine_len as u64,
                got: body.len() as u64,
            });
        }
        out.extend_from_slice(body);
    }
    Ok(out)
}

/// Unframes every peer's message with `body_of` (`(peer, message)`), in rank order: the lowest
/// peer's failure is returned. For the host transports that frame their messages (TCP, UCX).
pub(crate) fn unframe_all<'m>(
    msgs: &'m [Vec<u8>],
    body_of: impl for<'a> Fn(usize, &'a [u8]) -> Result<&'a [u8], TransportError>,
) -> Result<Vec<&'m [u8]>, TransportError> {
    msgs.iter()
        .enumerate()
        .map(|(p, m)| body_of(p, m))
        .collect()
}

/// The [`all_gather`](Transport::all_gather) result of the host transports that frame their
/// contributions (TCP, UCX): every peer's message unframed by `body_of` ([`unframe_all`]; every
/// peer's failure takes precedence over a size mismatch, lowest rank first), then
/// [`concat_gathered`].
pub(crate) fn concat_framed(
    op: &'static str,
    rank: usize,
    mine_len: usize,
    msgs: &[Vec<u8>],
    body_of: impl for<'a> Fn(usize, &'a [u8]) -> Result<&'a [u8], TransportError>,
) -> Result<Vec<u8>, TransportError> {
    concat_gathered(op, rank, mine_len, unframe_all(msgs, body_of)?)
}

/// Checks the arguments of an [`all_to_all_v`](Transport::all_to_all_v) on `rank`: both span
/// lists have `world_size` entries, every span lies inside its buffer, and non-empty receive spans
/// do not overlap. For implementers of [`Transport`]; the error is
/// [`InvalidArgument`](TransportError::InvalidArgument) or
/// [`OutOfBounds`](TransportError::OutOfBounds) naming the peer whose span is wrong.
pub fn check_spans(
    op: &'static str,
    rank: usize,
    world_size: usize,
    send_len: usize,
    send_spans: &[Span],
    recv_len: usize,
    recv_spans: &[Span],
) -> Result<(), TransportError> {
    for (what, spans) in [("send_spans", send_spans), ("recv_spans", recv_spans)] {
        if spans.len() != world_size {
            return Err(TransportError::InvalidArgument {
                op,
                rank,
                why: format!("{what} has {} entries for {world_size} ranks", spans.len()),
            });
        }
    }
    for (p, s) in send_spans.iter().enumerate() {
        checked_range(op, rank, Some(p), *s, send_len)?;
    }
    for (p, s) in recv_spans.iter().enumerate() {
        checked_range(op, rank, Some(p), *s, recv_len)?;
    }
    let mut order: Vec<usize> = (0..world_size).filter(|&p| recv_spans[p].len > 0).collect();
    order.sort_by_key(|&p| recv_spans[p].offset);
    for w in order.windows(2) {
        let (a, b) = (recv_spans[w[0]], recv_spans[w[1]]);
        // in bounds, so `end` does not overflow
        if a.offset + a.len > b.offset {
            return Err(TransportError::InvalidArgument {
                op,
                rank,
                why: format!(
                    "recv_spans of ranks {} ({}+{}) and {} ({}+{}) overlap",
                    w[0], a.offset, a.len, w[1], b.offset, b.len
                ),
            });
        }
    }
    Ok(())
}

/// [`check_spans`] for an [`all_to_all_v`](Transport::all_to_all_v) on `t`, with the rank, world
/// size and buffer lengths taken from `t` and the buffers.
pub(crate) fn check_transfer<T: Transport + ?Sized>(
    t: &T,
    op: &'static str,
    send: &T::Buffer,
    send_spans: &[Span],
    recv: &T::Buffer,
    recv_spans: &[Span],
) -> Result<(), TransportError> {
    let (rank, world) = (t.rank(), t.world_size());
    check_spans(
        op,
        rank,
        world,
        send.len(),
        send_spans,
        recv.len(),
        recv_spans,
    )
}

/// The [`all_to_all_v`](Transport::all_to_all_v) of the host transports that move one framed
/// message per peer (TCP, UCX): checks the spans, sends every peer its span framed by `frame`
/// (`true` for a contribution, `false` for this rank's argument error, sent to every peer so
/// that none waits for it), exchanges the frames with `exchange`, and unframes the replies with
/// `body_of` (a peer's failure comes before this rank's argument error's return, lowest rank
/// first, and before any size mismatch). Nothing is written into `recv` unless every reply has
/// the length of its receive span.
#[allow(clippy::too_many_arguments)]
pub(crate) fn framed_all_to_all_v<T: Transport<Buffer = HostBuffer> + ?Sized>(
    t: &mut T,
    send: &HostBuffer,
    send_spans: &[Span],
    recv: &mut HostBuffer,
    recv_spans: &[Span],
    frame: impl Fn(bool, &[u8]) -> Vec<u8>,
    exchange: impl FnOnce(&mut T, Vec<Vec<u8>>) -> Result<Vec<Vec<u8>>, TransportError>,
    body_of: impl for<'a> Fn(usize, &'a [u8]) -> Result<&'a [u8], TransportError>,
) -> Result<(), TransportError> {
    const OP: &str = "all_to_all_v";
    let (me, world) = (t.rank(), t.world_size());
    let checked = check_transfer(t, OP, send, send_spans, recv, recv_spans);
    let out: Vec<Vec<u8>> = match &checked {
        Ok(()) => (0..world)
            .map(|p| {
                send.span(OP, Some(p), send_spans[p])
                    .map(|b| frame(true, b))
            })
            .collect::<Result<_, _>>()?,
        Err(e) => vec![frame(false, e.to_string().as_bytes()); world],
    };
    let got = exchange(t, out)?;
    checked?;
    let bodies = unframe_all(&got, body_of)?;
    for (p, body) in bodies.iter().enumerate() {
        if body.len() as u64 != recv_spans[p].len {
            return Err(TransportError::SizeMismatch {
                op: OP,
                rank: me,
                peer: p,
                expected: recv_spans[p].len,
                got: body.len() as u64,
            });
        }
    }
    for (p, body) in bodies.into_iter().enumerate() {
        recv.span_mut(OP, Some(p), recv_spans[p])?
            .copy_from_slice(body);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kind_round_trips_through_text() {
        for k in TransportKind::ALL {
            assert_eq!(k.to_string().parse::<TransportKind>().unwrap(), k);
        }
        assert_eq!(
            "NVLink".parse::<TransportKind>().unwrap(),
            TransportKind::NvlinkIpc
        );
        assert_eq!(
            " host-tcp ".parse::<TransportKind>().unwrap(),
            TransportKind::HostTcp
        );
        let e = "mpi".parse::<TransportKind>().unwrap_err();
        assert!(e.to_string().contains("\"mpi\""), "{e}");
    }

    #[test]
    fn span_helpers() {
        let (s, total) = Span::packed(&[3, 0, 5]);
        assert_eq!(s, vec![Span::new(0, 3), Span::new(3, 0), Span::new(3, 5)]);
        assert_eq!(total, 8);
        assert_eq!(Span::new(u64::MAX, 1).end(), None);
        assert!(Span::EMPTY.is_empty());
    }

    #[test]
    fn host_buffer_bounds() {
        let mut b = HostBuffer::zeroed(2, 8);
        b.write(4, &[1, 2, 3, 4]).unwrap();
        let mut out = [0u8; 2];
        b.read(5, &mut out).unwrap();
        assert_eq!(out, [2, 3]);
        let e = b.write(6, &[0; 3]).unwrap_err();
        assert!(matches!(
            e,
            TransportError::OutOfBounds {
                rank: 2,
                offset: 6,
                len: 3,
                size: 8,
                ..
            }
        ));
        assert!(b.read(usize::MAX, &mut out).is_err());
    }

    #[test]
    fn span_checks() {
        let ok = [Span::new(0, 4), Span::new(4, 0), Span::new(4, 4)];
        check_spans("t", 0, 3, 8, &ok, 8, &ok).unwrap();
        // an empty span may sit anywhere in bounds, even inside another
        let inside = [Span::new(0, 4), Span::new(2, 0), Span::new(4, 4)];
        check_spans("t", 0, 3, 8, &ok, 8, &inside).unwrap();
        let e = check_spans("t", 1, 3, 8, &ok[..2], 8, &ok).unwrap_err();
        assert!(
            matches!(e, TransportError::InvalidArgument { rank: 1, .. }),
            "{e}"
        );
        let far = [Span::new(0, 4), Span::new(4, 0), Span::new(6, 4)];
        let e = check_spans("t", 1, 3, 8, &far, 8, &ok).unwrap_err();
        assert!(
            matches!(e, TransportError::OutOfBounds { peer: Some(2), .. }),
            "{e}"
        );
        let overlap = [Span::new(0, 5), Span::new(4, 0), Span::new(4, 4)];
        let e = check_spans("t", 1, 3, 8, &ok, 8, &overlap).unwrap_err();
        assert!(e.to_string().contains("overlap"), "{e}");
    }
}
