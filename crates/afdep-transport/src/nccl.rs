//! [`Nccl`]: a [`Transport`] over NCCL on device memory (cargo feature `nccl`).
//!
//! # Loading NCCL
//!
//! NCCL is loaded at run time with `libloading`, never linked: [`probe`] tries
//! `$AFDEP_NCCL_LIB` (when set), `libnccl.so` and `libnccl.so.2`, and a missing library, driver
//! or GPU is [`Unavailable`](TransportError::Unavailable) with the reason, never a panic. The
//! function table is this module's own (a dozen entry points of the stable NCCL 2 C API:
//! `ncclGetUniqueId`, `ncclCommInitRank`, `ncclSend`, `ncclRecv`, `ncclGroupStart`/`End`,
//! `ncclCommAbort`, `ncclCommDestroy`, `ncclCommGetAsyncError`, `ncclGetErrorString`,
//! `ncclGetLastError`, `ncclGetVersion`) rather than cudarc's `nccl` module, because cudarc looks
//! NCCL up only as `libnccl.so` (and a few CUDA-versioned names) and panics when it is missing,
//! while runtime-only NCCL installs ship just `libnccl.so.2`. Device memory, streams and events
//! come from cudarc's driver API (loaded at run time too; its absence is checked first).
//!
//! # Set-up
//!
//! Over a formed [`Bootstrap`]: every rank probes NCCL and its GPU and all-gathers the verdict
//! (so a rank without NCCL makes every rank fail at once with
//! [`PeerFailed`](TransportError::PeerFailed) naming it, not wait); rank 0 creates the unique id
//! and [broadcasts](Bootstrap::broadcast) it; every rank then calls `ncclCommInitRank` on its
//! device. That call blocks until every rank has joined and has no time-out of its own, so it
//! runs on a helper thread and the caller waits at most the timeout for it
//! ([`Timeout`](TransportError::Timeout) otherwise; the helper thread is then left to finish or
//! hang on its own).
//!
//! # Operations
//!
//! - **all_to_all_v**: NCCL cannot detect a size disagreement (it would hang or truncate), so
//!   each rank first all-gathers its argument status and its send and receive span lengths
//!   through the bootstrap. Every rank thus sees every pair: a receiver whose span differs from
//!   its sender's gets [`SizeMismatch`](TransportError::SizeMismatch) naming the sender, every
//!   other rank [`PeerFailed`](TransportError::PeerFailed) naming the receiver, a rank with
//!   invalid spans its own error and the others `PeerFailed` naming it; all before NCCL is
//!   called, so the group stays usable. Then one `ncclGroupStart`, for every peer p with a
//!   non-empty span `ncclSend(send + off, len, ncclUint8, p)` / `ncclRecv(recv + off, len,
//!   ncclUint8, p)` (p may be this rank: a world of one rank is a self exchange), `ncclGroupEnd`,
//!   all on the transport's stream; completion is awaited by polling an event recorded after the
//!   group, and NCCL's asynchronous error, up to the timeout. On expiry the communicator is
//!   aborted (`ncclCommAbort`), the error is a `Timeout` with `peer: None` (NCCL cannot say who is
//!   late) and the transport is closed ([`Closed`](TransportError::Closed) from then on).
//! - **all_gather** and **barrier** go through the bootstrap (small control-plane messages).
//!
//! Errors returned by NCCL are [`Backend`](TransportError::Backend) errors with the NCCL result
//! name and code, `ncclGetErrorString` and `ncclGetLastError`.
//!
//! # Threads
//!
//! `Nccl` is `Send` but not `Sync`. An NCCL communicator is not thread-safe: calls on one
//! communicator must not run concurrently, but NCCL does not tie a communicator to the thread
//! that created it (which is why cudarc's `Comm`, holding the raw handle, is `!Send` only by
//! default, not by a documented NCCL rule). Every method of [`Transport`] that touches the
//! communicator takes `&mut self`, and `Nccl` is not `Sync`, so at most one thread uses the
//! communicator at any time: moving the whole transport to another thread is sound. Each such
//! method binds the transport's CUDA context to the calling thread first, since NCCL and the
//! driver API work on the calling thread's current context.

use std::ffi::{CStr, c_char, c_int, c_void};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use cudarc::driver::{CudaContext, CudaStream, DevicePtr, DevicePtrMut};
use libloading::Library;
use tracing::{debug, warn};

use crate::device::DeviceBuffer;
use crate::{
    Bootstrap, Span, Transport, TransportError, TransportKind, check_transfer, concat_gathered,
};

const KIND: TransportKind = TransportKind::Nccl;
/// Environment variable naming the NCCL library to load before the default names.
pub const ENV_NCCL_LIB: &str = "AFDEP_NCCL_LIB";
const LIB_NAMES: [&str; 2] = ["libnccl.so", "libnccl.so.2"];

type NcclResult = c_int;
type Comm = *mut c_void;
const NCCL_SUCCESS: NcclResult = 0;
const NCCL_IN_PROGRESS: NcclResult = 7;
const NCCL_UINT8: c_int = 1;

/// `ncclUniqueId`: 128 opaque bytes, passed by value to `ncclCommInitRank`.
#[repr(C)]
#[derive(Clone, Copy)]
struct UniqueId {
    internal: [c_char; 128],
}

/// The NCCL entry points this transport uses.
struct Api {
    /// Which file was loaded.
    name: String,
    version: c_int,
    get_unique_id: unsafe extern "C" fn(*mut UniqueId) -> NcclResult,
    comm_init_rank: unsafe extern "C" fn(*mut Comm, c_int, UniqueId, c_int) -> NcclResult,
    comm_abort: unsafe extern "C" fn(Comm) -> NcclResult,
    comm_destroy: unsafe extern "C" fn(Comm) -> NcclResult,
    comm_get_async_error: unsafe extern "C" fn(Comm, *mut NcclResult) -> NcclResult,
    get_error_string: unsafe extern "C" fn(NcclResult) -> *const c_char,
    get_last_error: unsafe extern "C" fn(Comm) -> *const c_char,
    group_start: unsafe extern "C" fn() -> NcclResult,
    group_end: unsafe extern "C" fn() -> NcclResult,
    send: unsafe extern "C" fn(*const c_void, usize, c_int, c_int, Comm, *mut c_void) -> NcclResult,
    recv: unsafe extern "C" fn(*mut c_void, usize, c_int, c_int, Comm, *mut c_void) -> NcclResult,
    /// Keeps the library loaded for the function pointers above.
    _lib: Library,
}

static API: OnceLock<Result<Api, String>> = OnceLock::new();

fn load_api() -> Result<Api, String> {
    let mut names: Vec<String> = Vec::new();
    if let Ok(n) = std::env::var(ENV_NCCL_LIB) {
        if !n.is_empty() {
            names.push(n);
        }
    }
    names.extend(LIB_NAMES.iter().map(|s| s.to_string()));
    let mut tried = Vec::new();
    for name in &names {
        // SAFETY: loading NCCL runs its initialisers, as linking it would.
        match unsafe { Library::new(name) } {
            Ok(lib) => return api_of(lib, name.clone()),
            Err(e) => tried.push(format!("{name}: {e}")),
        }
    }
    Err(format!(
        "the NCCL library cannot be loaded (install NCCL 2, or set {ENV_NCCL_LIB} to its path); \
         tried {}",
        tried.join("; ")
    ))
}

fn api_of(lib: Library, name: String) -> Result<Api, String> {
    macro_rules! sym {
        ($s:literal) => {
            // SAFETY: the symbol is the NCCL 2 C API function of that name, whose signature the
            // field's type spells out (nccl.h).
            *unsafe { lib.get(concat!($s, "\0").as_bytes()) }
                .map_err(|e| format!("{name} has no {}: {e}", $s))?
        };
    }
    let get_version: unsafe extern "C" fn(*mut c_int) -> NcclResult = sym!("ncclGetVersion");
    let mut version = 0;
    // SAFETY: ncclGetVersion writes one int.
    let r = unsafe { get_version(&mut version) };
    if r != NCCL_SUCCESS {
        return Err(format!("{name}: ncclGetVersion failed with result {r}"));
    }
    Ok(Api {
        version,
        get_unique_id: sym!("ncclGetUniqueId"),
        comm_init_rank: sym!("ncclCommInitRank"),
        comm_abort: sym!("ncclCommAbort"),
        comm_destroy: sym!("ncclCommDestroy"),
        comm_get_async_error: sym!("ncclCommGetAsyncError"),
        get_error_string: sym!("ncclGetErrorString"),
        get_last_error: sym!("ncclGetLastError"),
        group_start: sym!("ncclGroupStart"),
        group_end: sym!("ncclGroupEnd"),
        send: sym!("ncclSend"),
        recv: sym!("ncclRecv"),
        name,
        _lib: lib,
    })
}

fn api() -> Result<&'static Api, TransportError> {
    API.get_or_init(load_api)
        .as_ref()
        .map_err(|why| TransportError::Unavailable {
            kind: KIND,
            why: why.clone(),
        })
}

/// What [`probe`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NcclProbe {
    /// The library file loaded.
    pub library: String,
    /// `ncclGetVersion`'s number (e.g. 22805 for 2.28.5).
    pub version: i32,
    /// CUDA devices visible to this process.
    pub devices: usize,
}

/// Checks, without a panic, that NCCL can run a group of `world_size` ranks on this machine:
/// the NCCL library loads, the NVIDIA driver loads and initialises, and there is one GPU per rank
/// (NCCL refuses two ranks of one communicator on one GPU). The error is
/// [`Unavailable`](TransportError::Unavailable) with the reason.
pub fn probe(world_size: usize) -> Result<NcclProbe, TransportError> {
    let api = api()?;
    let no = |why: String| TransportError::Unavailable { kind: KIND, why };
    let n = crate::device::probe_devices(KIND)?;
    if world_size > n {
        return Err(no(format!(
            "a group of {world_size} ranks on this machine needs {world_size} GPUs (NCCL refuses \
             two ranks of one communicator on one GPU); {n} visible"
        )));
    }
    Ok(NcclProbe {
        library: api.name.clone(),
        version: api.version,
        devices: n,
    })
}

/// The text of an NCCL result, with the communicator's last error when there is one.
fn nccl_error(
    api: &Api,
    op: &'static str,
    rank: usize,
    call: &str,
    r: NcclResult,
    comm: Comm,
) -> TransportError {
    let text = |p: *const c_char| {
        if p.is_null() {
            String::new()
        } else {
            // SAFETY: NCCL returns NUL-terminated static or per-thread strings.
            unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
        }
    };
    let name = match r {
        1 => "ncclUnhandledCudaError",
        2 => "ncclSystemError",
        3 => "ncclInternalError",
        4 => "ncclInvalidArgument",
        5 => "ncclInvalidUsage",
        6 => "ncclRemoteError",
        7 => "ncclInProgress",
        _ => "ncclResult",
    };
    // SAFETY: both take any result / a valid or null communicator.
    let what = text(unsafe { (api.get_error_string)(r) });
    let last = text(unsafe { (api.get_last_error)(comm) });
    TransportError::Backend {
        kind: KIND,
        op,
        rank,
        why: if last.is_empty() {
            format!("{call}: {name} ({r}): {what}")
        } else {
            format!("{call}: {name} ({r}): {what}: {last}")
        },
    }
}

fn driver_error(
    op: &'static str,
    rank: usize,
    what: &str,
) -> impl Fn(cudarc::driver::DriverError) -> TransportError {
    crate::device::driver_error(KIND, op, rank, what)
}

/// Device memory of an [`Nccl`] transport: a [`DeviceBuffer`].
pub type NcclBuffer = DeviceBuffer;

/// A [`Transport`] over NCCL; see the [module docs](self).
pub struct Nccl {
    boot: Bootstrap,
    api: &'static Api,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    device: usize,
    comm: Comm,
    /// Set when the communicator was aborted (or never formed): the reason.
    broken: Option<String>,
}

// SAFETY: see the module docs, "Threads": the communicator is used only through `&mut self`
// (never concurrently, since `Nccl` is not `Sync`), NCCL allows a communicator to be used from
// any one thread at a time, and every method binds the CUDA context to the calling thread before
// calling NCCL or the driver. The other fields are `Send`.
unsafe impl Send for Nccl {}

impl std::fmt::Debug for Nccl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Nccl")
            .field("rank", &self.boot.rank())
            .field("world_size", &self.boot.world_size())
            .field("device", &self.device)
            .field("library", &self.api.name)
            .field("version", &self.api.version)
            .field("broken", &self.broken)
            .finish()
    }
}

const OK: u8 = 0;
const FAILED: u8 = 1;

/// A status byte and a body, as [`HostTcp`](crate::HostTcp) sends its contributions.
fn with_status(status: u8, body: &[u8]) -> Vec<u8> {
    let mut v = Vec::with_capacity(1 + body.len());
    v.push(status);
    v.extend_from_slice(body);
    v
}

/// The body of every rank's contribution, or the first (lowest-rank) peer failure.
fn bodies(op: &'static str, rank: usize, all: &[Vec<u8>]) -> Result<Vec<Vec<u8>>, TransportError> {
    all.iter()
        .enumerate()
        .map(|(p, b)| match b.split_first() {
            Some((&OK, body)) => Ok(body.to_vec()),
            Some((&FAILED, why)) => Err(TransportError::PeerFailed {
                op,
                rank,
                peer: p,
                why: String::from_utf8_lossy(why).into_owned(),
            }),
            _ => Err(TransportError::Protocol {
                op,
                rank,
                peer: Some(p),
                why: "contribution without a status byte".into(),
            }),
        })
        .collect()
}

impl Nccl {
    /// Forms the communicator over `boot` on CUDA device `device` (`None`: this rank modulo the
    /// number of devices). Collective over the bootstrap; see the [module docs](self).
    pub fn new(mut boot: Bootstrap, device: Option<usize>) -> Result<Nccl, TransportError> {
        const OP: &str = "nccl.init";
        let (rank, world) = (boot.rank(), boot.world_size());
        // 1. every rank's verdict on NCCL and its GPU, so that one missing library fails all
        let local = probe(world).and_then(|p| {
            let dev = device.unwrap_or(rank % p.devices);
            if dev >= p.devices {
                return Err(TransportError::InvalidArgument {
                    op: OP,
                    rank,
                    why: format!("device {dev} does not exist ({} visible)", p.devices),
                });
            }
            let ctx =
                CudaContext::new(dev).map_err(driver_error(OP, rank, "creating a context"))?;
            let stream =
                crate::quiet_stream(&ctx).map_err(driver_error(OP, rank, "creating a stream"))?;
            Ok((dev, ctx, stream))
        });
        let mine = match &local {
            Ok(_) => with_status(OK, &[]),
            Err(e) => with_status(FAILED, e.to_string().as_bytes()),
        };
        let all = boot.all_gather(&mine)?;
        let (device, ctx, stream) = local?;
        bodies(OP, rank, &all)?;
        let api = api()?;
        // 2. the unique id from rank 0
        let mut id = UniqueId { internal: [0; 128] };
        let made = if rank == 0 {
            // SAFETY: writes one ncclUniqueId.
            let r = unsafe { (api.get_unique_id)(&mut id) };
            if r == NCCL_SUCCESS {
                Ok(())
            } else {
                Err(nccl_error(
                    api,
                    OP,
                    rank,
                    "ncclGetUniqueId",
                    r,
                    std::ptr::null_mut(),
                ))
            }
        } else {
            Ok(())
        };
        let bytes: Vec<u8> = match &made {
            Ok(()) => with_status(OK, &id.internal.map(|c| c as u8)),
            Err(e) => with_status(FAILED, e.to_string().as_bytes()),
        };
        let got = boot.broadcast(if rank == 0 { &bytes } else { &[] })?;
        made?;
        let body = bodies(OP, rank, &[got])
            .map_err(|e| match e {
                TransportError::PeerFailed { why, .. } => TransportError::PeerFailed {
                    op: OP,
                    rank,
                    peer: 0,
                    why,
                },
                e => e,
            })?
            .remove(0);
        if body.len() != 128 {
            return Err(TransportError::Protocol {
                op: OP,
                rank,
                peer: Some(0),
                why: format!("the NCCL unique id has {} bytes, not 128", body.len()),
            });
        }
        for (d, s) in id.internal.iter_mut().zip(&body) {
            *d = *s as c_char;
        }
        // 3. ncclCommInitRank blocks until all ranks join: on a helper thread, waited with the
        // timeout
        let timeout = boot.timeout();
        let (tx, rx) = std::sync::mpsc::channel::<Result<usize, TransportError>>();
        let init_ctx = ctx.clone();
        let spawned = std::thread::Builder::new()
            .name(format!("nccl-init-{rank}"))
            .spawn(move || {
                let res = init_ctx
                    .bind_to_thread()
                    .map_err(driver_error(OP, rank, "binding the context"))
                    .and_then(|()| {
                        let mut comm: Comm = std::ptr::null_mut();
                        // SAFETY: writes one communicator handle; `id` is the group's unique id.
                        let r = unsafe {
                            (api.comm_init_rank)(&mut comm, world as c_int, id, rank as c_int)
                        };
                        if r == NCCL_SUCCESS {
                            Ok(comm as usize)
                        } else {
                            Err(nccl_error(api, OP, rank, "ncclCommInitRank", r, comm))
                        }
                    });
                let _ = tx.send(res);
            });
        if let Err(e) = spawned {
            return Err(TransportError::Io {
                op: OP,
                rank,
                peer: None,
                source: e,
            });
        }
        let started = Instant::now();
        let comm = match rx.recv_timeout(timeout) {
            Ok(r) => r? as Comm,
            Err(_) => {
                warn!(
                    rank,
                    ?timeout,
                    "nccl: ncclCommInitRank did not return in time"
                );
                return Err(TransportError::Timeout {
                    op: OP,
                    rank,
                    peer: None,
                    waited: started.elapsed(),
                });
            }
        };
        debug!(rank, world, device, library = %api.name, version = api.version, "nccl: communicator formed");
        Ok(Nccl {
            boot,
            api,
            ctx,
            stream,
            device,
            comm,
            broken: None,
        })
    }

    /// [`new`](Nccl::new) over [`Bootstrap::from_env`].
    pub fn from_env(timeout: Duration, device: Option<usize>) -> Result<Nccl, TransportError> {
        Nccl::new(Bootstrap::from_env(timeout)?, device)
    }

    /// This rank's CUDA device.
    pub fn device(&self) -> usize {
        self.device
    }

    /// The transport's CUDA stream: the data of an `all_to_all_v` is ordered before later work
    /// on it.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The bootstrap underneath.
    pub fn bootstrap_mut(&mut self) -> &mut Bootstrap {
        &mut self.boot
    }

    /// Whether the communicator was aborted after a timeout or an asynchronous error.
    pub fn is_closed(&self) -> bool {
        self.broken.is_some()
    }

    fn usable(&self, op: &'static str) -> Result<(), TransportError> {
        match &self.broken {
            Some(why) => Err(TransportError::Closed {
                op,
                rank: self.boot.rank(),
                why: why.clone(),
            }),
            None => Ok(()),
        }
    }

    fn abort(&mut self, why: String) {
        if self.broken.is_none() {
            warn!(rank = self.boot.rank(), %why, "nccl: aborting the communicator");
            // SAFETY: the communicator is valid and not used after this (broken is set).
            let r = unsafe { (self.api.comm_abort)(self.comm) };
            if r != NCCL_SUCCESS {
                warn!(rank = self.boot.rank(), r, "nccl: ncclCommAbort failed");
            }
            self.broken = Some(why);
        }
    }

    /// The size agreement of an all_to_all_v: every rank's status and span lengths, checked
    /// pairwise on every rank.
    fn agree(
        &mut self,
        op: &'static str,
        checked: &Result<(), TransportError>,
        send_spans: &[Span],
        recv_spans: &[Span],
    ) -> Result<(), TransportError> {
        let (me, world) = (self.boot.rank(), self.boot.world_size());
        let mine = match checked {
            Ok(()) => {
                let mut b = Vec::with_capacity(16 * world);
                for s in send_spans.iter().chain(recv_spans) {
                    b.extend_from_slice(&s.len.to_le_bytes());
                }
                with_status(OK, &b)
            }
            Err(e) => with_status(FAILED, e.to_string().as_bytes()),
        };
        let all = self.boot.all_gather(&mine)?;
        if let Err(e) = checked {
            return Err(clone_error(e));
        }
        let lens: Vec<Vec<u64>> = bodies(op, me, &all)?
            .into_iter()
            .enumerate()
            .map(|(p, b)| {
                if b.len() != 16 * world {
                    return Err(TransportError::Protocol {
                        op,
                        rank: me,
                        peer: Some(p),
                        why: format!("span lengths of {} bytes for {world} ranks", b.len()),
                    });
                }
                Ok(b.chunks_exact(8)
                    .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")))
                    .collect())
            })
            .collect::<Result<_, _>>()?;
        // lens[p][q]: what p sends q; lens[p][world + q]: what p expects from q
        // this rank's own receives first, then the first disagreement anywhere
        for q in 0..world {
            let (expected, got) = (lens[me][world + q], lens[q][me]);
            if expected != got {
                return Err(TransportError::SizeMismatch {
                    op,
                    rank: me,
                    peer: q,
                    expected,
                    got,
                });
            }
        }
        for (p, theirs) in lens.iter().enumerate() {
            for q in 0..world {
                let (expected, got) = (theirs[world + q], lens[q][p]);
                if expected != got {
                    return Err(TransportError::PeerFailed {
                        op,
                        rank: me,
                        peer: p,
                        why: format!(
                            "rank {p} expects {expected} bytes from rank {q}, which sends {got}"
                        ),
                    });
                }
            }
        }
        Ok(())
    }

    /// Waits for the work queued on the stream so far, polling an event and NCCL's asynchronous
    /// error up to the timeout; aborts the communicator on expiry or error.
    fn wait(&mut self, op: &'static str) -> Result<(), TransportError> {
        let stream = self.stream.clone();
        self.wait_stream(&stream, op)
    }

    /// Waits for the work queued on `stream` (a stream of this transport's device) so far,
    /// polling an event recorded on it and NCCL's asynchronous error up to the timeout; on
    /// expiry or an error the communicator is aborted, as after
    /// [`all_to_all_v`](Transport::all_to_all_v) (module docs, "Operations").
    pub fn wait_stream(
        &mut self,
        stream: &Arc<CudaStream>,
        op: &'static str,
    ) -> Result<(), TransportError> {
        self.usable(op)?;
        let rank = self.boot.rank();
        self.ctx
            .bind_to_thread()
            .map_err(driver_error(op, rank, "binding the context"))?;
        let event =
            stream
                .record_event(None)
                .map_err(driver_error(op, rank, "recording an event"))?;
        let timeout = self.boot.timeout();
        let start = Instant::now();
        let mut spins = 0u32;
        loop {
            match event.try_is_complete() {
                Ok(true) => return Ok(()),
                Ok(false) => {}
                Err(e) => {
                    let err = driver_error(op, rank, "waiting for the exchange")(e);
                    self.abort(err.to_string());
                    return Err(err);
                }
            }
            let mut state: NcclResult = NCCL_SUCCESS;
            // SAFETY: the communicator is valid (not broken); writes one result.
            let r = unsafe { (self.api.comm_get_async_error)(self.comm, &mut state) };
            let bad = if r != NCCL_SUCCESS {
                Some(nccl_error(
                    self.api,
                    op,
                    rank,
                    "ncclCommGetAsyncError",
                    r,
                    self.comm,
                ))
            } else if state != NCCL_SUCCESS && state != NCCL_IN_PROGRESS {
                Some(nccl_error(
                    self.api,
                    op,
                    rank,
                    "asynchronous error",
                    state,
                    self.comm,
                ))
            } else {
                None
            };
            if let Some(e) = bad {
                self.abort(e.to_string());
                return Err(e);
            }
            let waited = start.elapsed();
            if waited >= timeout {
                let e = TransportError::Timeout {
                    op,
                    rank,
                    peer: None,
                    waited,
                };
                self.abort(e.to_string());
                return Err(e);
            }
            spins += 1;
            if spins < 1000 {
                std::hint::spin_loop();
            } else {
                std::thread::sleep(Duration::from_micros(20));
            }
        }
    }
}

/// One peer's part of a grouped exchange on device addresses ([`Nccl::group_raw`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RawPart {
    /// The peer rank (may be this rank).
    pub peer: usize,
    /// The device address of the bytes sent, or of the space they are received into.
    pub addr: u64,
    /// How many bytes.
    pub bytes: usize,
}

impl Nccl {
    /// The CUDA context of this transport's device.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// Enqueues one NCCL group on `stream`: `ncclGroupStart`, `ncclSend` for every part of
    /// `sends` and `ncclRecv` for every part of `recvs` (parts of zero bytes are left out; the
    /// i-th send to a peer matches that peer's i-th receive from this rank), `ncclGroupEnd`.
    /// Nothing is agreed through the bootstrap and nothing waits: the group runs when `stream`
    /// reaches it, so it can be captured in a CUDA graph (NCCL 2.9 or later), and
    /// [`wait_stream`](Nccl::wait_stream) waits for it. Every rank must enqueue matching groups
    /// in the same order. An NCCL error here aborts the communicator.
    ///
    /// # Safety
    ///
    /// `stream` belongs to this transport's device; every send part addresses `bytes` readable
    /// and every receive part `bytes` writable device bytes of that device, live until the
    /// group has run; a peer's send to this rank has the size of the matching receive here (NCCL
    /// cannot detect a disagreement: it hangs or truncates).
    pub unsafe fn group_raw(
        &mut self,
        stream: &CudaStream,
        sends: &[RawPart],
        recvs: &[RawPart],
    ) -> Result<(), TransportError> {
        const OP: &str = "group_raw";
        self.usable(OP)?;
        let (me, world) = (self.rank(), self.world_size());
        if let Some(p) = sends.iter().chain(recvs).find(|p| p.peer >= world) {
            return Err(TransportError::InvalidArgument {
                op: OP,
                rank: me,
                why: format!("peer {} in a world of {world} ranks", p.peer),
            });
        }
        self.ctx
            .bind_to_thread()
            .map_err(driver_error(OP, me, "binding the context"))?;
        let parts =
            (sends.iter().map(|&p| (Dir::Send, p))).chain(recvs.iter().map(|&p| (Dir::Recv, p)));
        // SAFETY: the caller's contract: `bytes` readable (sends) or writable (receives) device
        // bytes at each `addr`, live until the group has run.
        unsafe { self.run_group(OP, stream, parts) }
    }

    /// Runs one NCCL group on `stream`: `ncclSend` or `ncclRecv` for every part of `parts` with
    /// bytes, in order, none after the first failure. The group is always closed, even after a
    /// failed call inside it; a failure aborts the communicator and is returned. Does not wait.
    ///
    /// # Safety
    ///
    /// `stream` belongs to this transport's device; every part addresses `bytes` readable
    /// ([`Dir::Send`]) or writable ([`Dir::Recv`]) device bytes of that device, live until the
    /// group has run.
    unsafe fn run_group(
        &mut self,
        op: &'static str,
        stream: &CudaStream,
        parts: impl IntoIterator<Item = (Dir, RawPart)>,
    ) -> Result<(), TransportError> {
        let me = self.rank();
        let cu_stream = stream.cu_stream() as *mut c_void;
        let (api, comm) = (self.api, self.comm);
        let call = |name: &str, r: NcclResult| {
            if r == NCCL_SUCCESS {
                Ok(())
            } else {
                Err(nccl_error(api, op, me, name, r, comm))
            }
        };
        // SAFETY: no argument.
        call("ncclGroupStart", unsafe { (api.group_start)() })?;
        let mut queued = Ok(());
        for (dir, p) in parts.into_iter().filter(|(_, p)| p.bytes > 0) {
            if queued.is_ok() {
                let (addr, bytes, peer) = (p.addr as *mut c_void, p.bytes, p.peer as c_int);
                // SAFETY: the caller's contract: `bytes` readable (send) or writable (receive)
                // device bytes at `addr`.
                let r = unsafe {
                    match dir {
                        Dir::Send => (api.send)(addr, bytes, NCCL_UINT8, peer, comm, cu_stream),
                        Dir::Recv => (api.recv)(addr, bytes, NCCL_UINT8, peer, comm, cu_stream),
                    }
                };
                queued = call(dir.call_name(), r);
            }
        }
        // SAFETY: no argument; closes the group opened above.
        let ended = call("ncclGroupEnd", unsafe { (api.group_end)() });
        if let Err(e) = queued.and(ended) {
            self.abort(e.to_string());
            return Err(e);
        }
        Ok(())
    }
}

/// The direction of one part of an NCCL group ([`Nccl::run_group`]).
#[derive(Debug, Clone, Copy)]
enum Dir {
    /// `ncclSend` from the part's bytes.
    Send,
    /// `ncclRecv` into the part's bytes.
    Recv,
}

impl Dir {
    /// The NCCL call of this direction, as errors name it.
    fn call_name(self) -> &'static str {
        match self {
            Dir::Send => "ncclSend",
            Dir::Recv => "ncclRecv",
        }
    }
}

/// A copy of an argument error (the variants `check_spans` returns), to return it after it was
/// also sent to the peers.
fn clone_error(e: &TransportError) -> TransportError {
    match e {
        TransportError::OutOfBounds {
            op,
            rank,
            peer,
            offset,
            len,
            size,
        } => TransportError::OutOfBounds {
            op,
            rank: *rank,
            peer: *peer,
            offset: *offset,
            len: *len,
            size: *size,
        },
        TransportError::InvalidArgument { op, rank, why } => TransportError::InvalidArgument {
            op,
            rank: *rank,
            why: why.clone(),
        },
        other => TransportError::InvalidArgument {
            op: "all_to_all_v",
            rank: other.rank().unwrap_or(0),
            why: other.to_string(),
        },
    }
}

impl Transport for Nccl {
    type Buffer = NcclBuffer;

    fn rank(&self) -> usize {
        self.boot.rank()
    }

    fn world_size(&self) -> usize {
        self.boot.world_size()
    }

    fn kind(&self) -> TransportKind {
        KIND
    }

    fn timeout(&self) -> Duration {
        self.boot.timeout()
    }

    fn set_timeout(&mut self, timeout: Duration) {
        self.boot.set_timeout(timeout);
    }

    fn alloc(&mut self, bytes: usize) -> Result<NcclBuffer, TransportError> {
        const OP: &str = "alloc";
        let rank = self.rank();
        DeviceBuffer::zeroed(KIND, OP, rank, &self.stream, bytes)
    }

    fn all_gather(&mut self, mine: &[u8]) -> Result<Vec<u8>, TransportError> {
        const OP: &str = "all_gather";
        self.usable(OP)?;
        let me = self.rank();
        let all = self.boot.all_gather(mine)?;
        concat_gathered(OP, me, mine.len(), all.iter().map(Vec::as_slice))
    }

    fn all_to_all_v(
        &mut self,
        send: &NcclBuffer,
        send_spans: &[Span],
        recv: &mut NcclBuffer,
        recv_spans: &[Span],
    ) -> Result<(), TransportError> {
        const OP: &str = "all_to_all_v";
        self.usable(OP)?;
        let (me, world) = (self.rank(), self.world_size());
        let checked = check_transfer(self, OP, send, send_spans, recv, recv_spans);
        self.agree(OP, &checked, send_spans, recv_spans)?;
        self.ctx
            .bind_to_thread()
            .map_err(driver_error(OP, me, "binding the context"))?;
        let stream = self.stream.clone();
        let (send_ptr, _s) = send.mem().device_ptr(&stream);
        let (recv_ptr, _r) = recv.mem_mut().device_ptr_mut(&stream);
        let part = |peer: usize, base: u64, span: Span| RawPart {
            peer,
            addr: base + span.offset,
            bytes: span.len as usize,
        };
        let parts = (0..world).flat_map(|p| {
            [
                (Dir::Send, part(p, send_ptr, send_spans[p])),
                (Dir::Recv, part(p, recv_ptr, recv_spans[p])),
            ]
        });
        // SAFETY: every span lies inside its buffer (checked), and both buffers outlive the
        // wait below.
        unsafe { self.run_group(OP, &stream, parts) }?;
        self.wait(OP)
    }

    fn barrier(&mut self) -> Result<(), TransportError> {
        self.usable("barrier")?;
        self.boot.barrier()
    }
}

impl Drop for Nccl {
    fn drop(&mut self) {
        if self.broken.is_none() {
            let _ = self.ctx.bind_to_thread();
            let _ = self.stream.synchronize();
            // SAFETY: the communicator is valid and not used after this.
            let r = unsafe { (self.api.comm_destroy)(self.comm) };
            if r != NCCL_SUCCESS {
                warn!(rank = self.boot.rank(), r, "nccl: ncclCommDestroy failed");
            }
        }
    }
}
