//! [`Ucx`]: a [`Transport`] over UCX tagged messages, host memory (cargo feature `ucx`).
//!
//! # Set-up
//!
//! Every rank creates a UCX context (feature `TAG`) and one worker (single-thread mode), packs the
//! worker's address and all-gathers the addresses through the [`Bootstrap`] blob exchange; it
//! then creates one endpoint per peer from that peer's address, with peer error handling (so a
//! broken connection fails the requests on that endpoint instead of hanging them). The bootstrap
//! is kept (see [`Ucx::bootstrap_mut`]); after set-up no byte of the collectives goes through it.
//!
//! # Operations
//!
//! Every collective takes the next operation number `k` of the rank (whether it succeeds or
//! fails, as on every transport) and is one exchange: the rank sends one tagged message to every
//! peer and receives one from every peer. The tag is `k << 24 | source rank`; a receive probes
//! for the tag bits of `k` only and reads the source from the sender's tag, so a message of
//! another operation can never be taken for this one. Every message starts with a status byte
//! (ok, or failed with the rank's reason) and a byte naming the collective, exactly like
//! [`HostTcp`](crate::HostTcp)'s contributions, so:
//!
//! - a rank with **invalid arguments** still sends every peer a (failed) message; it returns its
//!   own error, its peers [`PeerFailed`](TransportError::PeerFailed) naming it, at once;
//! - a **size mismatch** is found by the receiver after a complete exchange
//!   ([`SizeMismatch`](TransportError::SizeMismatch) naming the sender; a failed peer takes
//!   precedence, lowest rank first, as on `HostTcp`);
//! - two ranks calling **different collectives** at the same `k` get a
//!   [`Protocol`](TransportError::Protocol) error;
//!
//! and all three leave the group usable for the next operation, since every message of the
//! operation was consumed.
//!
//! Messages are received into buffers of their actual size (probe, then receive), and sent from
//! and received into staging copies owned by the transport: the exchange never writes outside
//! `recv_spans`, and an operation abandoned on a timeout cannot touch the caller's memory
//! afterwards (the staging buffers of unfinished requests are kept until the worker is
//! destroyed).
//!
//! # Time bounds and failures
//!
//! The progress loop of every operation checks the deadline (the transport's
//! [timeout](Transport::timeout)) on every turn:
//!
//! - **Timeout**: [`Timeout`](TransportError::Timeout) naming the lowest-numbered peer whose
//!   message has not arrived (or, if all arrived, whose send has not completed);
//! - **Peer gone**: an endpoint error reported by UCX (`UCS_ERR_CONNECTION_RESET`,
//!   `UCS_ERR_ENDPOINT_TIMEOUT`, `UCS_ERR_UNREACHABLE`, ...) for a peer this rank still needs is
//!   [`PeerGone`](TransportError::PeerGone) naming it. UCX notices a dead peer on the TCP
//!   transport as soon as the connection is reset; on shared memory only through its keepalive
//!   (`UCX_KEEPALIVE_INTERVAL`), so there a vanished peer may surface as a `Timeout` instead.
//!   Either way the error is typed and comes within the timeout.
//!
//! As on `HostTcp`, a timeout or a gone peer **closes** the transport: its requests are
//! cancelled and later calls return [`Closed`](TransportError::Closed).
//!
//! # Memory, and device buffers
//!
//! Host memory only: [`Transport::Buffer`] is [`HostBuffer`]; no device pointer is ever given to
//! UCX. Device buffers are staged through host memory by wrapping the transport in
//! `DeviceStaged` (module `device`, cargo feature `cuda`; `afdep exchange --transport ucx
//! --device-buffers`), which copies every send span device→host before the exchange and every
//! receive span host→device after it. Passing device pointers directly needs a
//! CUDA-aware UCX (UCX configured `--with-cuda=/usr/local/cuda`, plus `--with-gdrcopy` for
//! GPUDirect RDMA) with the `cuda_copy`/`cuda_ipc` transports in `UCX_TLS`; the bundled build of
//! `ucx-rs` is configured `--without-cuda`. `ucx-rs` links a preinstalled UCX instead when
//! `UCX_DIR=/path/to/ucx` is set at build time, so a CUDA-aware one is a `UCX_DIR` away.
//!
//! # Transports on one machine
//!
//! The bundled UCX is built without InfiniBand/RDMA-CM (`ucx-rs` with default features off: no
//! rdma-core headers needed), so on one machine UCX moves the bytes over shared memory (`posix`,
//! `sysv`) and TCP (`tcp`, on `lo`). Which ones is UCX's own choice, restricted by the `UCX_TLS`
//! environment variable or by [`UcxOptions::tls`] (`"tcp"`, `"shm"`, `"tcp,shm"`); the tests
//! run both `tcp` and `shm`.
//!
//! # Build
//!
//! `cargo build -p afdep-transport --features ucx` builds UCX 1.22.0 from the release tarball
//! that `ucx-rs` ships (its `configure` + `make`, static, `--with-pic`; it needs only a C
//! compiler and `make`, no libclang, no rdma-core, no network). Measured on this project's 2-core
//! machine while other builds shared it: extracting, configuring and compiling UCX took 4.0 min
//! of wall time the first time (`cargo build`/`cargo test`) and 2.3 min the second (`cargo
//! clippy`, whose wrapper makes cargo build the build script again); the whole crate from an
//! empty target directory, every dependency included, took 9.0 min of wall time (8.7 CPU-min). A
//! later build of the same target directory reuses it. Enabling the feature in CI (clippy and
//! tests) thus costs about 5 to 8 minutes of the 90 on a 2-core runner: reasonable.
//! `UCX_DIR=/path/to/ucx` links an installed UCX (1.17 or newer) instead and skips the build.

use std::ffi::CString;
use std::fmt;
use std::os::raw::c_void;
use std::ptr;
use std::sync::atomic::{AtomicI8, Ordering};
use std::time::{Duration, Instant};

use tracing::{debug, warn};
use ucx_rs::sys;

use crate::{
    Bootstrap, HostBuffer, Span, Transport, TransportError, TransportKind, concat_framed,
    framed_all_to_all_v, unframe_all,
};

const OK: u8 = 0;
const FAILED: u8 = 1;

/// Bits of the tag that hold the source rank.
const SRC_BITS: u32 = 24;
const SRC_MASK: u64 = (1 << SRC_BITS) - 1;

/// How long `Drop` waits for endpoints to flush before forcing them closed.
const CLOSE_GRACE: Duration = Duration::from_secs(2);

/// The collective a message belongs to (second byte of every message).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
enum Coll {
    AllGather = 1,
    AllToAllV = 2,
    Barrier = 3,
}

impl Coll {
    fn name(self) -> &'static str {
        match self {
            Coll::AllGather => "all_gather",
            Coll::AllToAllV => "all_to_all_v",
            Coll::Barrier => "barrier",
        }
    }

    fn from_byte(b: u8) -> Option<Coll> {
        match b {
            1 => Some(Coll::AllGather),
            2 => Some(Coll::AllToAllV),
            3 => Some(Coll::Barrier),
            _ => None,
        }
    }
}

/// Options of [`Ucx::new`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UcxOptions {
    /// The UCX transports to use (`UCX_TLS` syntax: `"tcp"`, `"shm"`, `"tcp,shm"`, ...); `None`
    /// leaves UCX's choice (and the `UCX_TLS` environment variable) in force.
    pub tls: Option<String>,
    /// Ask UCX for peer failure detection on every endpoint (default `true`), so that a lost
    /// peer is a [`PeerGone`](TransportError::PeerGone). UCX then only uses transports that
    /// have it (on one machine: `tcp`, not the shared-memory ones); where none is allowed (a
    /// `"shm"`-only [`tls`](UcxOptions::tls)) endpoints are created without it (UCX logs an
    /// error once per endpoint first), and a lost peer is a
    /// [`Timeout`](TransportError::Timeout). Set `false` for shared memory.
    pub detect_peer_failure: bool,
}

impl Default for UcxOptions {
    fn default() -> UcxOptions {
        UcxOptions {
            tls: None,
            detect_peer_failure: true,
        }
    }
}

impl UcxOptions {
    /// The options for `tls` (`UCX_TLS` syntax), with peer failure detection on unless `tls`
    /// names shared memory only (`shm`, `posix`, `sysv`, `cma`).
    pub fn with_tls(tls: &str) -> UcxOptions {
        let shm_only = tls
            .split(',')
            .all(|t| matches!(t.trim(), "shm" | "posix" | "sysv" | "cma" | "self"));
        UcxOptions {
            tls: Some(tls.to_string()),
            detect_peer_failure: !shm_only,
        }
    }
}

/// One rank of a UCX group; see the [module docs](self).
pub struct Ucx {
    boot: Bootstrap,
    rank: usize,
    world: usize,
    timeout: Duration,
    /// Number of the next operation.
    seq: u64,
    ctx: sys::ucp_context_h,
    worker: sys::ucp_worker_h,
    /// `eps[p]`: the endpoint to rank p (null at this rank).
    eps: Vec<sys::ucp_ep_h>,
    /// `ep_status[p]`: the error UCX reported on the endpoint to rank p (0 while none). Written by
    /// the error callback, which runs inside `ucp_worker_progress` on the calling thread; boxed so
    /// its address, given to UCX, is stable.
    ep_status: Box<[AtomicI8]>,
    /// Requests of abandoned operations, with the staging buffers they may still use; released
    /// (buffers freed) only after the worker is destroyed.
    abandoned: Vec<(sys::ucs_status_ptr_t, Vec<u8>)>,
    /// Set by the first timeout or lost peer: the transport is closed from then on.
    broken: Option<String>,
}

// SAFETY: the UCX handles are used by one thread at a time (every method takes `&mut self` or
// `&self` without touching UCX concurrently); a single-thread-mode worker may move between
// threads as long as calls on it are not concurrent.
unsafe impl Send for Ucx {}

impl fmt::Debug for Ucx {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Ucx")
            .field("rank", &self.rank)
            .field("world_size", &self.world)
            .field("timeout", &self.timeout)
            .field("ops", &self.seq)
            .field("closed", &self.broken)
            .finish()
    }
}

fn backend(op: &'static str, rank: usize, what: &str, st: sys::ucs_status_t) -> TransportError {
    TransportError::Backend {
        kind: TransportKind::Ucx,
        op,
        rank,
        why: format!("{what}: {}", ucx_rs::status_string(st)),
    }
}

unsafe extern "C" fn on_ep_error(arg: *mut c_void, _ep: sys::ucp_ep_h, status: sys::ucs_status_t) {
    // SAFETY: `arg` is the address of an element of `Ucx::ep_status`, which outlives the
    // endpoints (they are closed before it is dropped).
    let slot = unsafe { &*(arg as *const AtomicI8) };
    let _ = slot.compare_exchange(0, status, Ordering::Relaxed, Ordering::Relaxed);
}

fn param() -> sys::ucp_request_param_t {
    // SAFETY: an all-zero `ucp_request_param_t` is the documented "no attributes" value.
    unsafe { std::mem::zeroed() }
}

/// One in-flight request: `Ok(None)` done at once, `Ok(Some(req))` in progress.
fn decode(ptr: sys::ucs_status_ptr_t) -> Result<Option<sys::ucs_status_ptr_t>, sys::ucs_status_t> {
    ucx_rs::decode_status_ptr(ptr)
}

fn tag(seq: u64, src: usize) -> sys::ucp_tag_t {
    (seq << SRC_BITS) | src as u64
}

/// What one peer's slot of an exchange is doing.
struct Slot {
    /// The message from this peer, once probed (its receive may still be in flight).
    recv: Option<Vec<u8>>,
    recv_req: Option<sys::ucs_status_ptr_t>,
    recv_done: bool,
    send: Vec<u8>,
    send_req: Option<sys::ucs_status_ptr_t>,
    send_done: bool,
}

impl Ucx {
    /// Forms a UCX group over a formed bootstrap (collective: every rank calls it): creates the
    /// worker, all-gathers the worker addresses and creates the endpoints. The transport's
    /// timeout is the bootstrap's.
    pub fn new(boot: Bootstrap, options: &UcxOptions) -> Result<Ucx, TransportError> {
        const OP: &str = "ucx.new";
        let (rank, world) = (boot.rank(), boot.world_size());
        if world > SRC_MASK as usize {
            return Err(TransportError::InvalidArgument {
                op: OP,
                rank,
                why: format!("a world of {world} ranks exceeds the tag's {SRC_BITS} source bits"),
            });
        }
        // SAFETY: plain UCX set-up calls on handles this function creates; every error path
        // releases what was created (through `Ucx::drop` once the struct exists).
        unsafe {
            let mut cfg: *mut sys::ucp_config_t = ptr::null_mut();
            let st = sys::ucp_config_read(ptr::null(), ptr::null(), &mut cfg);
            if st != sys::ucs_status_t_UCS_OK {
                return Err(backend(OP, rank, "ucp_config_read", st));
            }
            if let Some(tls) = &options.tls {
                let value =
                    CString::new(tls.as_str()).map_err(|_| TransportError::InvalidArgument {
                        op: OP,
                        rank,
                        why: format!("UCX_TLS value {tls:?} contains a NUL byte"),
                    })?;
                let st = sys::ucp_config_modify(cfg, c"TLS".as_ptr(), value.as_ptr());
                if st != sys::ucs_status_t_UCS_OK {
                    sys::ucp_config_release(cfg);
                    return Err(backend(OP, rank, &format!("TLS={tls}"), st));
                }
            }
            let mut params: sys::ucp_params_t = std::mem::zeroed();
            params.field_mask = sys::ucp_params_field_UCP_PARAM_FIELD_FEATURES as u64;
            params.features = sys::ucp_feature_UCP_FEATURE_TAG as u64;
            let mut ctx: sys::ucp_context_h = ptr::null_mut();
            let st = sys::ucp_init_version(
                sys::UCP_API_MAJOR,
                sys::UCP_API_MINOR,
                &params,
                cfg,
                &mut ctx,
            );
            sys::ucp_config_release(cfg);
            if st != sys::ucs_status_t_UCS_OK {
                return Err(backend(OP, rank, "ucp_init", st));
            }
            let mut wparams: sys::ucp_worker_params_t = std::mem::zeroed();
            wparams.field_mask =
                sys::ucp_worker_params_field_UCP_WORKER_PARAM_FIELD_THREAD_MODE as u64;
            wparams.thread_mode = sys::ucs_thread_mode_t_UCS_THREAD_MODE_SINGLE;
            let mut worker: sys::ucp_worker_h = ptr::null_mut();
            let st = sys::ucp_worker_create(ctx, &wparams, &mut worker);
            if st != sys::ucs_status_t_UCS_OK {
                sys::ucp_cleanup(ctx);
                return Err(backend(OP, rank, "ucp_worker_create", st));
            }
            let timeout = boot.timeout();
            let mut me = Ucx {
                boot,
                rank,
                world,
                timeout,
                seq: 0,
                ctx,
                worker,
                eps: vec![ptr::null_mut(); world],
                ep_status: (0..world).map(|_| AtomicI8::new(0)).collect(),
                abandoned: Vec::new(),
                broken: None,
            };
            let mut addr: *mut sys::ucp_address_t = ptr::null_mut();
            let mut len = 0usize;
            let st = sys::ucp_worker_get_address(worker, &mut addr, &mut len);
            if st != sys::ucs_status_t_UCS_OK {
                return Err(backend(OP, rank, "ucp_worker_get_address", st));
            }
            let mine = std::slice::from_raw_parts(addr as *const u8, len).to_vec();
            sys::ucp_worker_release_address(worker, addr);
            debug!(rank, world, address_bytes = mine.len(), "ucx: worker up");
            let all = me.boot.all_gather(&mine)?;
            for (p, remote) in all.iter().enumerate() {
                if p == rank {
                    continue;
                }
                let mut ep_params: sys::ucp_ep_params_t = std::mem::zeroed();
                ep_params.field_mask =
                    sys::ucp_ep_params_field_UCP_EP_PARAM_FIELD_REMOTE_ADDRESS as u64;
                if options.detect_peer_failure {
                    ep_params.field_mask |=
                        (sys::ucp_ep_params_field_UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE
                            | sys::ucp_ep_params_field_UCP_EP_PARAM_FIELD_ERR_HANDLER)
                            as u64;
                }
                ep_params.address = remote.as_ptr() as *const sys::ucp_address_t;
                ep_params.err_mode = sys::ucp_err_handling_mode_t_UCP_ERR_HANDLING_MODE_PEER;
                ep_params.err_handler.cb = Some(on_ep_error);
                ep_params.err_handler.arg = &me.ep_status[p] as *const AtomicI8 as *mut c_void;
                let mut ep: sys::ucp_ep_h = ptr::null_mut();
                let mut st = sys::ucp_ep_create(worker, &ep_params, &mut ep);
                if st == sys::ucs_status_t_UCS_ERR_UNREACHABLE && options.detect_peer_failure {
                    // the allowed transports have no peer failure handler (shared memory):
                    // connect without one; a lost peer then surfaces as a timeout
                    warn!(
                        rank,
                        peer = p,
                        "ucx: no transport with peer failure detection; a lost peer will be a timeout"
                    );
                    ep_params.field_mask =
                        sys::ucp_ep_params_field_UCP_EP_PARAM_FIELD_REMOTE_ADDRESS as u64;
                    st = sys::ucp_ep_create(worker, &ep_params, &mut ep);
                }
                if st != sys::ucs_status_t_UCS_OK {
                    return Err(backend(OP, rank, &format!("ucp_ep_create to rank {p}"), st));
                }
                me.eps[p] = ep;
            }
            debug!(rank, world, "ucx: endpoints created");
            Ok(me)
        }
    }

    /// [`Bootstrap::from_env`] then [`Ucx::new`]: the rank, world size and rendezvous from the
    /// launcher's environment.
    pub fn from_env(timeout: Duration, options: &UcxOptions) -> Result<Ucx, TransportError> {
        Ucx::new(Bootstrap::from_env(timeout)?, options)
    }

    /// The bootstrap underneath (for set-up blobs of other kinds).
    pub fn bootstrap_mut(&mut self) -> &mut Bootstrap {
        &mut self.boot
    }

    /// How many collective operations this rank has started (the number of the next one).
    pub fn ops_started(&self) -> u64 {
        self.seq
    }

    /// Whether an earlier timeout or lost peer closed this transport.
    pub fn is_closed(&self) -> bool {
        self.broken.is_some()
    }

    fn progress(&mut self) -> u32 {
        // SAFETY: the worker is live; progress runs the error callback, which only touches
        // `ep_status`.
        unsafe { sys::ucp_worker_progress(self.worker) }
    }

    /// One exchange: sends `out[p]` (header included) to every peer p, receives one message from
    /// every peer. Returns the messages indexed by source (this rank's own entry is `own`).
    fn exchange(
        &mut self,
        op: &'static str,
        out: Vec<Vec<u8>>,
        own: Vec<u8>,
    ) -> Result<Vec<Vec<u8>>, TransportError> {
        let me = self.rank;
        if let Some(why) = &self.broken {
            return Err(TransportError::Closed {
                op,
                rank: me,
                why: why.clone(),
            });
        }
        let seq = self.seq;
        self.seq += 1;
        debug!(rank = me, seq, op, "ucx op");
        let start = Instant::now();
        let mut slots: Vec<Slot> = out
            .into_iter()
            .enumerate()
            .map(|(p, send)| Slot {
                recv: None,
                recv_req: None,
                recv_done: p == me,
                send,
                send_req: None,
                send_done: p == me,
            })
            .collect();
        let res = self.drive(op, seq, start, &mut slots);
        match res {
            Ok(()) => {
                let mut own = Some(own);
                Ok(slots
                    .into_iter()
                    .enumerate()
                    .map(|(p, s)| {
                        if p == me {
                            own.take().unwrap_or_default()
                        } else {
                            s.recv.unwrap_or_default()
                        }
                    })
                    .collect())
            }
            Err(e) => {
                self.abandon(slots);
                warn!(rank = me, seq, op, error = %e, "ucx: operation failed, closing");
                self.broken = Some(e.to_string());
                Err(e)
            }
        }
    }

    /// Posts the sends and drives the receives of operation `seq` to completion or failure.
    fn drive(
        &mut self,
        op: &'static str,
        seq: u64,
        start: Instant,
        slots: &mut [Slot],
    ) -> Result<(), TransportError> {
        let (me, world) = (self.rank, self.world);
        for (p, s) in slots.iter_mut().enumerate() {
            if p == me {
                continue;
            }
            let prm = param();
            // SAFETY: the endpoint is live; `s.send` stays alive and unmoved (a Vec's heap
            // buffer) until the request completes or is abandoned (then kept until drop).
            let r = unsafe {
                sys::ucp_tag_send_nbx(
                    self.eps[p],
                    s.send.as_ptr() as *const c_void,
                    s.send.len(),
                    tag(seq, me),
                    &prm,
                )
            };
            match decode(r) {
                Ok(None) => s.send_done = true,
                Ok(Some(req)) => s.send_req = Some(req),
                Err(st) => return Err(self.ep_failure(op, p, st)),
            }
        }
        let mut idle = 0u32;
        loop {
            let mut busy = self.progress() > 0;
            // endpoint errors for peers this rank still needs
            for (p, s) in slots.iter().enumerate() {
                let st = self.ep_status[p].load(Ordering::Relaxed);
                if st != 0 && !(s.recv_done && s.send_done) {
                    return Err(self.ep_failure(op, p, st));
                }
            }
            // new messages of this operation
            loop {
                // SAFETY: an all-zero info is a valid out-parameter.
                let mut info: sys::ucp_tag_recv_info_t = unsafe { std::mem::zeroed() };
                // SAFETY: the worker is live; `remove = 1` takes the message out of the
                // unexpected queue, and it is received below.
                let msg = unsafe {
                    sys::ucp_tag_probe_nb(self.worker, tag(seq, 0), !SRC_MASK, 1, &mut info)
                };
                if msg.is_null() {
                    break;
                }
                busy = true;
                let src = (info.sender_tag & SRC_MASK) as usize;
                if src >= world || src == me || slots[src].recv.is_some() {
                    // a rank outside the world, or a second message: take it and fail
                    let mut sink = vec![0u8; info.length];
                    let prm = param();
                    // SAFETY: as for the receives below; the request, if any, is abandoned
                    // with its buffer.
                    let r = unsafe {
                        sys::ucp_tag_msg_recv_nbx(
                            self.worker,
                            sink.as_mut_ptr() as *mut c_void,
                            sink.len(),
                            msg,
                            &prm,
                        )
                    };
                    if let Ok(Some(req)) = decode(r) {
                        self.abandoned.push((req, sink));
                    }
                    return Err(TransportError::Protocol {
                        op,
                        rank: me,
                        peer: (src < world).then_some(src),
                        why: format!("unexpected message from source {src} in operation {seq}"),
                    });
                }
                let s = &mut slots[src];
                let mut buf = vec![0u8; info.length];
                let prm = param();
                // SAFETY: `buf` has `info.length` bytes; its heap buffer does not move when the
                // Vec is moved into the slot, and lives until the request completes or is
                // abandoned.
                let r = unsafe {
                    sys::ucp_tag_msg_recv_nbx(
                        self.worker,
                        buf.as_mut_ptr() as *mut c_void,
                        buf.len(),
                        msg,
                        &prm,
                    )
                };
                s.recv = Some(buf);
                match decode(r) {
                    Ok(None) => s.recv_done = true,
                    Ok(Some(req)) => s.recv_req = Some(req),
                    Err(st) => return Err(self.ep_failure(op, src, st)),
                }
            }
            // completions
            for (p, s) in slots.iter_mut().enumerate() {
                for is_send in [false, true] {
                    let (req, done) = if is_send {
                        (&mut s.send_req, &mut s.send_done)
                    } else {
                        (&mut s.recv_req, &mut s.recv_done)
                    };
                    let Some(r) = *req else { continue };
                    // SAFETY: `r` is a live request of this worker.
                    let st = unsafe { sys::ucp_request_check_status(r) };
                    if st == sys::ucs_status_t_UCS_INPROGRESS {
                        continue;
                    }
                    // SAFETY: completed; released once.
                    unsafe { sys::ucp_request_free(r) };
                    *req = None;
                    busy = true;
                    if st != sys::ucs_status_t_UCS_OK {
                        return Err(self.ep_failure(op, p, st));
                    }
                    *done = true;
                }
            }
            if slots.iter().all(|s| s.recv_done && s.send_done) {
                return Ok(());
            }
            if start.elapsed() >= self.timeout {
                let late = (0..world)
                    .find(|&p| !slots[p].recv_done)
                    .or_else(|| (0..world).find(|&p| !slots[p].send_done));
                return Err(TransportError::Timeout {
                    op,
                    rank: me,
                    peer: late,
                    waited: start.elapsed(),
                });
            }
            if busy {
                idle = 0;
            } else {
                idle += 1;
                if idle > 64 {
                    std::thread::sleep(Duration::from_micros(50));
                } else {
                    std::thread::yield_now();
                }
            }
        }
    }

    /// The error for a failed request or endpoint of rank `p`: a lost connection is `PeerGone`.
    fn ep_failure(&self, op: &'static str, p: usize, st: sys::ucs_status_t) -> TransportError {
        let st = match self.ep_status[p].load(Ordering::Relaxed) {
            0 => st,
            ep => ep,
        };
        let gone = [
            sys::ucs_status_t_UCS_ERR_CONNECTION_RESET,
            sys::ucs_status_t_UCS_ERR_ENDPOINT_TIMEOUT,
            sys::ucs_status_t_UCS_ERR_UNREACHABLE,
            sys::ucs_status_t_UCS_ERR_CANCELED,
            sys::ucs_status_t_UCS_ERR_IO_ERROR,
            sys::ucs_status_t_UCS_ERR_NOT_CONNECTED,
            sys::ucs_status_t_UCS_ERR_REJECTED,
            sys::ucs_status_t_UCS_ERR_TIMED_OUT,
        ];
        if gone.contains(&st) {
            debug!(
                rank = self.rank,
                peer = p,
                status = ucx_rs::status_string(st),
                "ucx: peer lost"
            );
            TransportError::PeerGone {
                op,
                rank: self.rank,
                peer: p,
            }
        } else {
            backend(op, self.rank, &format!("request with rank {p}"), st)
        }
    }

    /// Cancels the unfinished requests of a failed operation and keeps them, with their buffers,
    /// until the worker is destroyed.
    fn abandon(&mut self, slots: Vec<Slot>) {
        for s in slots {
            let Slot {
                recv,
                recv_req,
                send,
                send_req,
                ..
            } = s;
            if let Some(r) = recv_req {
                // SAFETY: a live request of this worker; cancelling completes it (callback-less).
                unsafe { sys::ucp_request_cancel(self.worker, r) };
                self.abandoned.push((r, recv.unwrap_or_default()));
            }
            if let Some(r) = send_req {
                // SAFETY: as above.
                unsafe { sys::ucp_request_cancel(self.worker, r) };
                self.abandoned.push((r, send));
            }
        }
    }
}

fn with_header(status: u8, coll: Coll, body: &[u8]) -> Vec<u8> {
    let mut v = Vec::with_capacity(2 + body.len());
    v.push(status);
    v.push(coll as u8);
    v.extend_from_slice(body);
    v
}

/// Splits a message into its body, or the peer's failure, or a protocol error.
fn body_of<'a>(
    op: &'static str,
    coll: Coll,
    rank: usize,
    peer: usize,
    msg: &'a [u8],
) -> Result<&'a [u8], TransportError> {
    let protocol = |why: String| TransportError::Protocol {
        op,
        rank,
        peer: Some(peer),
        why,
    };
    let [status, c, body @ ..] = msg else {
        return Err(protocol("message without a header".into()));
    };
    match Coll::from_byte(*c) {
        Some(k) if k == coll => {}
        Some(k) => {
            return Err(protocol(format!(
                "rank {peer} is in {} while this rank is in {}",
                k.name(),
                coll.name()
            )));
        }
        None => return Err(protocol(format!("unknown collective {c}"))),
    }
    match *status {
        OK => Ok(body),
        FAILED => Err(TransportError::PeerFailed {
            op,
            rank,
            peer,
            why: String::from_utf8_lossy(body).into_owned(),
        }),
        s => Err(protocol(format!("unknown status {s}"))),
    }
}

impl Transport for Ucx {
    type Buffer = HostBuffer;

    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world
    }

    fn kind(&self) -> TransportKind {
        TransportKind::Ucx
    }

    fn timeout(&self) -> Duration {
        self.timeout
    }

    fn set_timeout(&mut self, timeout: Duration) {
        self.timeout = timeout;
        self.boot.set_timeout(timeout);
    }

    fn alloc(&mut self, bytes: usize) -> Result<HostBuffer, TransportError> {
        Ok(HostBuffer::zeroed(self.rank, bytes))
    }

    fn all_gather(&mut self, mine: &[u8]) -> Result<Vec<u8>, TransportError> {
        const OP: &str = "all_gather";
        let (me, world) = (self.rank, self.world);
        let msg = with_header(OK, Coll::AllGather, mine);
        let all = self.exchange(OP, vec![msg.clone(); world], msg)?;
        concat_framed(OP, me, mine.len(), &all, |p, m| {
            body_of(OP, Coll::AllGather, me, p, m)
        })
    }

    fn all_to_all_v(
        &mut self,
        send: &HostBuffer,
        send_spans: &[Span],
        recv: &mut HostBuffer,
        recv_spans: &[Span],
    ) -> Result<(), TransportError> {
        const OP: &str = "all_to_all_v";
        let me = self.rank;
        framed_all_to_all_v(
            self,
            send,
            send_spans,
            recv,
            recv_spans,
            |ok, b| with_header(if ok { OK } else { FAILED }, Coll::AllToAllV, b),
            |t, out| {
                let own = out[me].clone();
                t.exchange(OP, out, own)
            },
            |p, m| body_of(OP, Coll::AllToAllV, me, p, m),
        )
    }

    fn barrier(&mut self) -> Result<(), TransportError> {
        const OP: &str = "barrier";
        let (me, world) = (self.rank, self.world);
        let msg = with_header(OK, Coll::Barrier, &[]);
        let all = self.exchange(OP, vec![msg.clone(); world], msg)?;
        unframe_all(&all, |p, m| body_of(OP, Coll::Barrier, me, p, m))?;
        Ok(())
    }
}

impl Drop for Ucx {
    fn drop(&mut self) {
        // SAFETY: tear-down of the handles this transport owns, in UCX's order: endpoints
        // (flushed, so messages already sent reach their peers, then forced after a grace),
        // worker, context; the abandoned requests are released once the worker is gone.
        unsafe {
            let mut closing = Vec::new();
            for (p, &ep) in self.eps.iter().enumerate() {
                if ep.is_null() {
                    continue;
                }
                let mut prm = param();
                let gone = self.ep_status[p].load(Ordering::Relaxed) != 0 || self.broken.is_some();
                if gone {
                    prm.op_attr_mask = sys::ucp_op_attr_t_UCP_OP_ATTR_FIELD_FLAGS;
                    prm.flags = sys::ucp_ep_close_flags_t_UCP_EP_CLOSE_FLAG_FORCE;
                }
                if let Ok(Some(req)) = decode(sys::ucp_ep_close_nbx(ep, &prm)) {
                    closing.push(req);
                }
            }
            let until = Instant::now() + CLOSE_GRACE;
            while !closing.is_empty() && Instant::now() < until {
                sys::ucp_worker_progress(self.worker);
                closing.retain(|&r| {
                    if sys::ucp_request_check_status(r) == sys::ucs_status_t_UCS_INPROGRESS {
                        true
                    } else {
                        sys::ucp_request_free(r);
                        false
                    }
                });
            }
            if !closing.is_empty() {
                debug!(
                    rank = self.rank,
                    left = closing.len(),
                    "ucx: endpoints not closed in time"
                );
            }
            for r in closing {
                sys::ucp_request_free(r);
            }
            for (r, _) in &self.abandoned {
                sys::ucp_request_free(*r);
            }
            sys::ucp_worker_destroy(self.worker);
            sys::ucp_cleanup(self.ctx);
        }
        self.abandoned.clear();
        debug!(rank = self.rank, "ucx: closed");
    }
}
