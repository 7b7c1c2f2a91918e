//! `--load gemm[:M,N,K]`: the exchange under a concurrent compute load.
//!
//! One worker thread per GPU the ranks use (with emulated ranks: the one GPU) owns a
//! [`GpuContext`] of its own on that device (the device's primary CUDA context, as the ranks',
//! so its kernels run concurrently with theirs; its own stream, fault word and module table)
//! and a dense bf16 GEMM `C[M×N] = A[M×K]·B[K×N]`: afdep's grouped GEMM
//! ([`gemm::down`] with one [`Groups::Dense`] group, f32 accumulation, stored as bf16), its
//! operands seeded values in `[-1, 1]`. Everything it needs (allocations, the kernel's module,
//! the occupancy query) is set up and run once before any round, so nothing is loaded lazily
//! while a rank's kernel spins on the GPU.
//!
//! Per problem (token count), the rank threads run the rounds twice on the same engines: alone,
//! then under load. Between the two, rank 0 (the other ranks wait at a barrier):
//! - times the GEMM alone ([`LoadSet::alone`]: launches back to back, at least
//!   [`ALONE_LAUNCHES`] and [`ALONE_MIN`] of them);
//! - starts the load ([`LoadSet::run`]): every worker poisons `C` (NaN), launches the GEMM back
//!   to back (at most [`DEPTH`] launches queued), and reports once its first launch is
//!   running on the device; then the ranks run the same rounds again;
//! - stops it after the rounds ([`Running::stop`]): the workers drain their queue, and each
//!   checks `C` (the last launch's output, made while the rounds ran) against a host reference
//!   on a slice of rows and columns ([`check_slice`]): a load stream that computed nothing or
//!   garbage fails the run ([`LoadError::Mismatch`]) instead of reporting a speed.
//!
//! Each launch is timed by CUDA events on the worker's stream around it. The loaded times are
//! those of the launches that had begun on the device when the stop came (launches still
//! queued then run after the rounds and are left out). Every device wait is a poll with a
//! bound ([`LoadError::Timeout`]); every reply from a worker is awaited with a bound
//! ([`LoadError::Gone`]); a [`Running`] guard stops the load on every exit path, and dropping
//! the [`LoadSet`] stops and joins its workers.

use std::collections::VecDeque;
use std::str::FromStr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use afdep_core::bf16;
use afdep_kernels::cudarc::driver::sys::{CUevent_flags, cuMemsetD16Async};
use afdep_kernels::cudarc::driver::{CudaEvent, CudaSlice, DevicePtrMut};
use afdep_kernels::ops::gemm::{self, Groups, RowsOut};
use afdep_kernels::{GpuContext, KernelError};
use serde::{Deserialize, Serialize};

use super::ranks::LoadRuns;
use super::rounds::{RoundTimes, slowest};
use super::rows::{LoadRow, median};

/// GEMM launches queued on a worker's stream at most (one running, two ready: the GPU never
/// waits for the worker's poll of the events).
pub(super) const DEPTH: usize = 3;
/// Fewest launches of a GEMM-alone measurement.
pub(super) const ALONE_LAUNCHES: usize = 10;
/// Shortest host time of a GEMM-alone measurement.
pub(super) const ALONE_MIN: Duration = Duration::from_millis(20);
/// Most launches of a GEMM-alone measurement.
const ALONE_MAX_LAUNCHES: usize = 10_000;
/// Rows and columns of `C` checked against the host reference after each loaded phase.
const CHECK_ROWS: usize = 4;
const CHECK_COLS: usize = 64;
/// The bound on a worker's set-up (the GEMM module may be compiled on first use).
const SETUP_WAIT: Duration = Duration::from_secs(600);
/// Seeds of the operands.
const SEED_A: u64 = 0x0a0a_0a0a;
const SEED_B: u64 = 0x0b0b_0b0b;

/// The load of `--load`: a dense bf16 GEMM of `m × k` by `k × n`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct LoadSpec {
    /// Rows of A and C.
    pub m: usize,
    /// Columns of B and C.
    pub n: usize,
    /// The reduction size.
    pub k: usize,
}

impl Default for LoadSpec {
    fn default() -> LoadSpec {
        LoadSpec {
            m: 8192,
            n: 8192,
            k: 8192,
        }
    }
}

impl LoadSpec {
    /// Floating-point operations of one launch (`2·M·N·K`).
    pub fn flops(&self) -> f64 {
        2.0 * self.m as f64 * self.n as f64 * self.k as f64
    }

    /// The text form, `gemm:M,N,K`.
    pub fn label(&self) -> String {
        format!("gemm:{},{},{}", self.m, self.n, self.k)
    }
}

impl FromStr for LoadSpec {
    type Err = String;

    /// `gemm` (8192 × 8192 × 8192) or `gemm:M,N,K`; N and K multiples of 8 (the GEMM's
    /// 16-byte rows), every operand below 2^31 elements.
    fn from_str(s: &str) -> Result<LoadSpec, String> {
        let bad = |why: &str| format!("bad --load {s:?}: {why} (expected gemm or gemm:M,N,K)");
        let (kind, dims) = match s.trim().split_once(':') {
            Some((k, d)) => (k.trim(), Some(d)),
            None => (s.trim(), None),
        };
        if kind != "gemm" {
            return Err(bad("the one load is gemm"));
        }
        let Some(dims) = dims else {
            return Ok(LoadSpec::default());
        };
        let v: Vec<usize> = dims
            .split(',')
            .map(|d| d.trim().parse::<usize>())
            .collect::<Result<_, _>>()
            .map_err(|_| bad("M, N and K are positive integers"))?;
        let [m, n, k] = v[..] else {
            return Err(bad("three sizes"));
        };
        if m == 0 || n == 0 || k == 0 {
            return Err(bad("M, N and K are positive"));
        }
        if n % 8 != 0 || k % 8 != 0 {
            return Err(bad("N and K are multiples of 8"));
        }
        let limit = 1usize << 31;
        for (what, e) in [
            ("M·K", m.checked_mul(k)),
            ("K·N", k.checked_mul(n)),
            ("M·N", m.checked_mul(n)),
        ] {
            if e.is_none_or(|e| e >= limit) {
                return Err(bad(&format!("{what} must stay below 2^31 elements")));
            }
        }
        Ok(LoadSpec { m, n, k })
    }
}

/// What goes wrong with the load.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// A CUDA call or the GEMM failed (a launch, an event, a recorded device fault).
    #[error("the load on device {device}: {source}")]
    Kernel {
        /// The device.
        device: usize,
        /// What failed.
        #[source]
        source: Box<KernelError>,
    },
    /// A device wait of the load ran past its bound.
    #[error("the load on device {device}: {what} did not finish within {ms} ms")]
    Timeout {
        /// The device.
        device: usize,
        /// What was waited for.
        what: &'static str,
        /// The bound.
        ms: u128,
    },
    /// A worker did not answer within its bound, or is gone.
    #[error("the load worker of device {device}: {why}")]
    Gone {
        /// The device.
        device: usize,
        /// Why.
        why: String,
    },
    /// The GEMM's output under load differs from the host reference.
    #[error(
        "the load's GEMM on device {device} is wrong: C[{row}, {col}] = {got}, the host \
         reference {want} (tolerance {tol})"
    )]
    Mismatch {
        /// The device.
        device: usize,
        /// The row.
        row: usize,
        /// The column.
        col: usize,
        /// The device's value.
        got: f32,
        /// The reference.
        want: f64,
        /// The tolerance.
        tol: f64,
    },
}

/// [`LoadError::Kernel`] on `device`.
fn kernel_err(device: usize) -> impl Fn(KernelError) -> LoadError + Copy {
    move |source| LoadError::Kernel {
        device,
        source: Box::new(source),
    }
}

/// What one worker measured while the rounds ran.
#[derive(Debug, Clone)]
pub(super) struct LoadedGemm {
    /// The device.
    pub(super) device: usize,
    /// Device time of each launch that had begun when the stop came, µs.
    pub(super) launch_us: Vec<f64>,
    /// Host time from the first launch running to the stop, µs.
    pub(super) window_us: f64,
    /// Elements of `C` checked against the host reference.
    pub(super) checked: usize,
}

/// The GEMM-alone launch times of one device, µs.
#[derive(Debug, Clone)]
pub(super) struct AloneGemm {
    /// The device.
    pub(super) device: usize,
    /// Device time of each launch, µs.
    pub(super) launch_us: Vec<f64>,
}

/// `loaded / alone`: how many times slower under load (`None` when either is not a positive
/// finite time).
pub(super) fn slowdown(loaded: f64, alone: f64) -> Option<f64> {
    (loaded.is_finite() && alone.is_finite() && loaded > 0.0 && alone > 0.0).then(|| loaded / alone)
}

/// TFLOP/s of `flops` in `us` µs (NaN for no time).
pub(super) fn tflops(flops: f64, us: f64) -> f64 {
    if us > 0.0 && us.is_finite() {
        flops / us * 1e-6
    } else {
        f64::NAN
    }
}

/// Element `i` of the seeded operand `seed`: uniform in `[-1, 1)`, rounded to bf16 (so in
/// `[-1, 1]`); a splitmix64 of the index, so the host reference needs no copy of the operands.
pub(super) fn operand(seed: u64, i: usize) -> bf16 {
    let mut z = seed.wrapping_add((i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15));
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^= z >> 31;
    // 24 random bits → [-1, 1)
    let u = (z >> 40) as f32 / (1u32 << 23) as f32 - 1.0;
    bf16::from_f32(u)
}

/// The rows and columns of `C` the check compares: spread over the matrix, its corners
/// included.
pub(super) fn check_points(spec: &LoadSpec) -> (Vec<usize>, Vec<usize>) {
    let spread = |len: usize, count: usize| -> Vec<usize> {
        let count = count.min(len);
        let mut v: Vec<usize> = (0..count)
            .map(|j| {
                if count == 1 {
                    0
                } else {
                    j * (len - 1) / (count - 1)
                }
            })
            .collect();
        v.dedup();
        v
    };
    (spread(spec.m, CHECK_ROWS), spread(spec.n, CHECK_COLS))
}

/// Checks `got` (row `row` of `C` on the device, at `cols`) against the host reference
/// `Σ_k A[row, k]·B[k, col]` in f64. The tolerance bounds any f32 summation order of the exact
/// bf16 products (`(K − 1)·2⁻²⁴·Σ|A·B|` < `2⁻¹¹·Σ|A·B|`) plus the bf16 rounding of the result
/// (`2⁻⁸·|ref|`): an unwritten (NaN), zero or misplaced output fails it.
pub(super) fn check_slice(
    spec: &LoadSpec,
    device: usize,
    row: usize,
    cols: &[usize],
    got: &[bf16],
) -> Result<(), LoadError> {
    for (&col, g) in cols.iter().zip(got) {
        let (mut want, mut abs) = (0f64, 0f64);
        for k in 0..spec.k {
            let p = f64::from(operand(SEED_A, row * spec.k + k).to_f32())
                * f64::from(operand(SEED_B, k * spec.n + col).to_f32());
            want += p;
            abs += p.abs();
        }
        let tol = abs / 2048.0 + want.abs() / 256.0 + 1e-6;
        let got = g.to_f32();
        if !got.is_finite() || (f64::from(got) - want).abs() > tol {
            return Err(LoadError::Mismatch {
                device,
                row,
                col,
                got,
                want,
                tol,
            });
        }
    }
    Ok(())
}

/// The load's GEMM on one device, owned by its worker thread.
struct Gemm {
    device: usize,
    spec: LoadSpec,
    gpu: GpuContext,
    a: CudaSlice<bf16>,
    b: CudaSlice<bf16>,
    c: CudaSlice<bf16>,
    /// Start and stop events per queue slot.
    events: Vec<(CudaEvent, CudaEvent)>,
    wait: Duration,
}

/// How long a measurement launches.
enum Until<'a> {
    /// At least this many launches and this much host time.
    Alone(usize, Duration),
    /// Until the flag is set.
    Stop(&'a AtomicBool),
}

impl Gemm {
    fn kernel(&self) -> impl Fn(KernelError) -> LoadError + Copy {
        kernel_err(self.device)
    }

    /// The context, the operands uploaded, the events, and two launches waited for (the
    /// kernel loaded, its occupancy measured).
    fn new(device: usize, spec: LoadSpec, wait: Duration) -> Result<Gemm, LoadError> {
        let err = kernel_err(device);
        let gpu = GpuContext::new(device).map_err(err)?;
        // SAFETY: no buffer of this context exists yet; every buffer below is allocated, used
        // and freed on the context's one stream, whose order is all their synchronisation.
        unsafe { gpu.cuda().disable_event_tracking() };
        let upload = |seed: u64, len: usize| -> Result<CudaSlice<bf16>, LoadError> {
            let host: Vec<bf16> = (0..len).map(|i| operand(seed, i)).collect();
            gpu.stream()
                .clone_htod(&host)
                .map_err(KernelError::driver("uploading the load's operands"))
                .map_err(err)
        };
        let a = upload(SEED_A, spec.m * spec.k)?;
        let b = upload(SEED_B, spec.k * spec.n)?;
        let c = gpu
            .stream()
            .alloc_zeros::<bf16>(spec.m * spec.n)
            .map_err(KernelError::driver("allocating the load's output"))
            .map_err(err)?;
        let ev = || {
            gpu.cuda()
                .new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
                .map_err(KernelError::driver("creating a load event"))
                .map_err(err)
        };
        let events = (0..DEPTH)
            .map(|_| Ok((ev()?, ev()?)))
            .collect::<Result<_, LoadError>>()?;
        let mut g = Gemm {
            device,
            spec,
            gpu,
            a,
            b,
            c,
            events,
            wait,
        };
        g.measure(Until::Alone(2, Duration::ZERO), |_| {})?;
        Ok(g)
    }

    /// Enqueues one launch in queue slot `s`, between its events.
    fn launch(&mut self, s: usize) -> Result<(), LoadError> {
        let (start, stop) = &self.events[s];
        start
            .record(self.gpu.stream())
            .map_err(KernelError::driver("recording a load event"))
            .map_err(kernel_err(self.device))?;
        gemm::down(
            &self.gpu,
            Groups::Dense { rows: self.spec.m },
            &self.a,
            &self.b,
            self.spec.k,
            self.spec.n,
            RowsOut::Store {
                out: &mut self.c,
                weights: None,
            },
        )
        .map_err(kernel_err(self.device))?;
        stop.record(self.gpu.stream())
            .map_err(KernelError::driver("recording a load event"))
            .map_err(self.kernel())
    }

    /// Polls `ev` until it completed, within the bound.
    fn wait_for(&self, ev: &CudaEvent, what: &'static str) -> Result<(), LoadError> {
        let t0 = Instant::now();
        loop {
            if ev
                .try_is_complete()
                .map_err(KernelError::driver("querying a load event"))
                .map_err(self.kernel())?
            {
                return Ok(());
            }
            if t0.elapsed() > self.wait {
                return Err(LoadError::Timeout {
                    device: self.device,
                    what,
                    ms: self.wait.as_millis(),
                });
            }
            std::thread::sleep(Duration::from_micros(20));
        }
    }

    /// Waits for slot `s`'s launch; its device time, µs.
    fn finish(&self, s: usize) -> Result<f64, LoadError> {
        let (start, stop) = &self.events[s];
        self.wait_for(stop, "a GEMM launch")?;
        let ms = start
            .elapsed_ms(stop)
            .map_err(KernelError::driver("reading a load event"))
            .map_err(self.kernel())?;
        Ok(f64::from(ms) * 1e3)
    }

    /// Launches back to back (at most [`DEPTH`] queued) until `until`; `started` is called once
    /// the first launch runs on the device. Returns the device time of every launch that had
    /// begun by the end (with [`Until::Stop`], launches still queued then are waited for but
    /// left out), and then checks the fault word.
    fn measure(
        &mut self,
        until: Until<'_>,
        mut started: impl FnMut(Instant),
    ) -> Result<Vec<f64>, LoadError> {
        let t0 = Instant::now();
        let mut queue: VecDeque<usize> = VecDeque::with_capacity(DEPTH);
        let mut times = Vec::new();
        let mut i = 0usize;
        loop {
            let more = match &until {
                Until::Alone(n, d) => (i < *n || t0.elapsed() < *d) && i < ALONE_MAX_LAUNCHES,
                Until::Stop(flag) => !flag.load(Ordering::Acquire),
            };
            if !more {
                break;
            }
            if queue.len() == DEPTH {
                let s = queue.pop_front().expect("a full queue");
                times.push(self.finish(s)?);
            }
            let s = i % DEPTH;
            self.launch(s)?;
            queue.push_back(s);
            if i == 0 {
                self.wait_for(&self.events[s].0, "the first GEMM launch's start")?;
                started(Instant::now());
            }
            i += 1;
        }
        // which queued launches had begun when the measurement ended
        let begun: Vec<bool> = queue
            .iter()
            .map(|&s| {
                self.events[s]
                    .0
                    .try_is_complete()
                    .map_err(KernelError::driver("querying a load event"))
                    .map_err(self.kernel())
            })
            .collect::<Result<_, _>>()?;
        for (s, begun) in queue.into_iter().zip(begun) {
            let us = self.finish(s)?;
            if begun || matches!(until, Until::Alone(..)) {
                times.push(us);
            }
        }
        self.gpu.take_fault().map_err(self.kernel())?;
        Ok(times)
    }

    /// Sets every element of `C` to NaN (stream-ordered before the next launch).
    fn poison(&mut self) -> Result<(), LoadError> {
        let stream = self.gpu.stream().clone();
        // event tracking is off: the guard records nothing
        let p = self.c.device_ptr_mut(&stream).0;
        // SAFETY: p is the start of this worker's live `m·n` bf16 output; the memset is ordered
        // on its stream before the next launch.
        unsafe { cuMemsetD16Async(p, 0xffff, self.spec.m * self.spec.n, stream.cu_stream()) }
            .result()
            .map_err(KernelError::driver("poisoning the load's output"))
            .map_err(self.kernel())
    }

    /// Checks the slice of `C` ([`check_points`]) against the host reference; elements checked.
    fn check(&self) -> Result<usize, LoadError> {
        let (rows, cols) = check_points(&self.spec);
        for &r in &rows {
            let row = self.c.slice(r * self.spec.n..(r + 1) * self.spec.n);
            let host = self
                .gpu
                .stream()
                .clone_dtoh(&row)
                .map_err(KernelError::driver("reading the load's output"))
                .map_err(self.kernel())?;
            let got: Vec<bf16> = cols.iter().map(|&c| host[c]).collect();
            check_slice(&self.spec, self.device, r, &cols, &got)?;
        }
        Ok(rows.len() * cols.len())
    }
}

/// A command to a worker.
enum Cmd {
    Alone,
    Run,
}

/// A worker's answer.
enum Reply {
    Ready,
    Alone(Vec<f64>),
    Started,
    Ran(LoadedGemm),
}

/// The worker of one device.
struct Worker {
    device: usize,
    cmd: Option<Sender<Cmd>>,
    reply: Mutex<Receiver<Result<Reply, LoadError>>>,
    stop: Arc<AtomicBool>,
    handle: Option<JoinHandle<()>>,
}

impl Worker {
    fn spawn(device: usize, spec: LoadSpec, wait: Duration) -> Result<Worker, LoadError> {
        let (cmd_tx, cmd_rx) = mpsc::channel::<Cmd>();
        let (tx, rx) = mpsc::channel();
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let handle = std::thread::Builder::new()
            .name(format!("afdep-load-{device}"))
            .spawn(move || worker(device, spec, wait, &cmd_rx, &tx, &flag))
            .map_err(|e| LoadError::Gone {
                device,
                why: format!("cannot start its thread: {e}"),
            })?;
        Ok(Worker {
            device,
            cmd: Some(cmd_tx),
            reply: Mutex::new(rx),
            stop,
            handle: Some(handle),
        })
    }

    fn send(&self, c: Cmd) -> Result<(), LoadError> {
        self.cmd
            .as_ref()
            .and_then(|s| s.send(c).ok())
            .ok_or_else(|| LoadError::Gone {
                device: self.device,
                why: "its thread has ended".into(),
            })
    }

    /// The next reply, within `bound`.
    fn recv(&self, bound: Duration) -> Result<Reply, LoadError> {
        let rx = self.reply.lock().unwrap_or_else(|p| p.into_inner());
        match rx.recv_timeout(bound) {
            Ok(r) => r,
            Err(mpsc::RecvTimeoutError::Timeout) => Err(LoadError::Gone {
                device: self.device,
                why: format!("no answer within {} ms", bound.as_millis()),
            }),
            Err(mpsc::RecvTimeoutError::Disconnected) => Err(LoadError::Gone {
                device: self.device,
                why: "its thread has ended".into(),
            }),
        }
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        // closing the command channel ends the worker's loop once its command is done (every
        // device wait of it is bounded)
        self.cmd = None;
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

/// The body of a worker thread: set-up, then commands until the channel closes.
fn worker(
    device: usize,
    spec: LoadSpec,
    wait: Duration,
    cmds: &Receiver<Cmd>,
    tx: &Sender<Result<Reply, LoadError>>,
    stop: &AtomicBool,
) {
    let mut g = match Gemm::new(device, spec, wait) {
        Ok(g) => {
            let _ = tx.send(Ok(Reply::Ready));
            g
        }
        Err(e) => {
            let _ = tx.send(Err(e));
            return;
        }
    };
    while let Ok(cmd) = cmds.recv() {
        let reply = match cmd {
            Cmd::Alone => g
                .measure(Until::Alone(ALONE_LAUNCHES, ALONE_MIN), |_| {})
                .map(Reply::Alone),
            Cmd::Run => {
                let mut began = None;
                let run = g.poison().and_then(|()| {
                    g.measure(Until::Stop(stop), |t| {
                        began = Some(t);
                        let _ = tx.send(Ok(Reply::Started));
                    })
                });
                let window_us = began.map_or(0.0, |t: Instant| t.elapsed().as_secs_f64() * 1e6);
                run.and_then(|launch_us| {
                    g.check().map(|checked| {
                        Reply::Ran(LoadedGemm {
                            device,
                            launch_us,
                            window_us,
                            checked,
                        })
                    })
                })
            }
        };
        let _ = tx.send(reply);
    }
}

/// The load's workers, one per device, set up and idle until [`LoadSet::alone`] or
/// [`LoadSet::run`]. Dropping it stops and joins them.
pub(super) struct LoadSet {
    spec: LoadSpec,
    workers: Vec<Worker>,
    wait: Duration,
}

impl LoadSet {
    /// Starts a worker on each of `devices` and waits (at most [`SETUP_WAIT`]) until every one
    /// is set up; `wait` bounds each of their device waits.
    pub(super) fn new(
        spec: LoadSpec,
        devices: &[usize],
        wait: Duration,
    ) -> Result<LoadSet, LoadError> {
        let workers = devices
            .iter()
            .map(|&d| Worker::spawn(d, spec, wait))
            .collect::<Result<Vec<_>, _>>()?;
        let set = LoadSet {
            spec,
            workers,
            wait,
        };
        for w in &set.workers {
            match w.recv(SETUP_WAIT.max(wait))? {
                Reply::Ready => {}
                _ => return Err(set.unexpected(w)),
            }
        }
        Ok(set)
    }

    /// The load.
    pub(super) fn spec(&self) -> LoadSpec {
        self.spec
    }

    fn unexpected(&self, w: &Worker) -> LoadError {
        LoadError::Gone {
            device: w.device,
            why: "an answer out of order".into(),
        }
    }

    /// The bound on one measurement's answer: its launches' waits and the check.
    fn answer_bound(&self) -> Duration {
        self.wait * (DEPTH as u32 + 2) + ALONE_MIN + Duration::from_secs(60)
    }

    /// Times the GEMM alone on every device, one after the other (nothing else runs).
    pub(super) fn alone(&self) -> Result<Vec<AloneGemm>, LoadError> {
        self.workers
            .iter()
            .map(|w| {
                w.send(Cmd::Alone)?;
                let launches = (ALONE_LAUNCHES + DEPTH) as u32;
                match w.recv(self.answer_bound() + self.wait * launches)? {
                    Reply::Alone(launch_us) => Ok(AloneGemm {
                        device: w.device,
                        launch_us,
                    }),
                    _ => Err(self.unexpected(w)),
                }
            })
            .collect()
    }

    /// Starts the load on every device; returns once each one's first launch runs. The guard
    /// stops it when dropped; [`Running::stop`] stops it and returns the measurements.
    pub(super) fn run(&self) -> Result<Running<'_>, LoadError> {
        for w in &self.workers {
            w.stop.store(false, Ordering::Release);
        }
        let mut running = Running {
            set: self,
            sent: Vec::new(),
        };
        for w in &self.workers {
            w.send(Cmd::Run)?;
            running.sent.push(w.device);
            let started = w.recv(self.answer_bound());
            if !matches!(started, Ok(Reply::Started)) {
                // this worker's run ended (or hangs past the bound): nothing more to wait for
                running.sent.pop();
                return Err(match started {
                    Err(e) => e,
                    Ok(_) => self.unexpected(w),
                });
            }
        }
        Ok(running)
    }
}

/// The load running ([`LoadSet::run`]); dropped without [`Running::stop`] (an error path), it
/// stops every worker and waits, within the bound, for their answers.
pub(super) struct Running<'a> {
    set: &'a LoadSet,
    /// The devices whose worker was sent [`Cmd::Run`] and has not answered its end yet.
    sent: Vec<usize>,
}

impl Running<'_> {
    /// Stops the load; every device's loaded launches and its check.
    pub(super) fn stop(mut self) -> Result<Vec<LoadedGemm>, LoadError> {
        for w in &self.set.workers {
            w.stop.store(true, Ordering::Release);
        }
        let mut out = Vec::new();
        let mut first_err = None;
        for w in &self.set.workers {
            if !self.sent.contains(&w.device) {
                continue;
            }
            match w.recv(self.set.answer_bound()) {
                Ok(Reply::Ran(g)) => out.push(g),
                Ok(_) => {
                    first_err.get_or_insert(self.set.unexpected(w));
                }
                Err(e) => {
                    first_err.get_or_insert(e);
                }
            }
        }
        self.sent.clear();
        match first_err {
            Some(e) => Err(e),
            None => Ok(out),
        }
    }
}

impl Drop for Running<'_> {
    fn drop(&mut self) {
        for w in &self.set.workers {
            w.stop.store(true, Ordering::Release);
        }
        for w in &self.set.workers {
            if self.sent.contains(&w.device) {
                let _ = w.recv(self.set.answer_bound());
            }
        }
    }
}

/// The row fields of a problem's `--load` runs: the rounds alone and under load (slowest rank
/// per round, median), and the GEMM alone and under the rounds on the device where it slowed
/// down most (median device time per launch).
pub(super) fn load_row(l: &LoadRuns, loaded_rounds: &[RoundTimes]) -> LoadRow {
    let round = |runs: &[RoundTimes]| median(runs.iter().map(|t| t.round).collect());
    let alone_rounds = slowest(&l.alone.iter().map(|r| r.times.clone()).collect::<Vec<_>>());
    let (round_alone, round_loaded) = (round(&alone_rounds), round(loaded_rounds));
    // per device: (alone µs, loaded µs, launches alone, the loaded measurement)
    let per_device: Vec<(f64, f64, usize, &LoadedGemm)> = l
        .gemm_loaded
        .iter()
        .map(|g| {
            let alone = l
                .gemm_alone
                .iter()
                .find(|a| a.device == g.device)
                .map_or(&[][..], |a| &a.launch_us[..]);
            (
                median(alone.to_vec()),
                median(g.launch_us.clone()),
                alone.len(),
                g,
            )
        })
        .collect();
    let worst = per_device.iter().max_by(|x, y| {
        let s =
            |d: &(f64, f64, usize, &LoadedGemm)| slowdown(d.1, d.0).unwrap_or(f64::NEG_INFINITY);
        s(x).total_cmp(&s(y))
    });
    let flops = l.spec.flops();
    let busy: f64 = loaded_rounds
        .iter()
        .map(|t| t.round)
        .filter(|v| v.is_finite())
        .sum();
    let (gemm_alone, gemm_loaded, launches_alone, launches_loaded, window, checked) = match worst {
        Some(&(al, lo, n, g)) => (al, lo, n, g.launch_us.len(), g.window_us, g.checked),
        None => (f64::NAN, f64::NAN, 0, 0, f64::NAN, 0),
    };
    LoadRow {
        load: l.spec.label(),
        devices: l.gemm_loaded.iter().map(|g| g.device).collect(),
        round_us_alone: round_alone,
        round_us_loaded: round_loaded,
        round_slowdown: slowdown(round_loaded, round_alone),
        gemm_us_alone: gemm_alone,
        gemm_us_loaded: gemm_loaded,
        gemm_slowdown: slowdown(gemm_loaded, gemm_alone),
        gemm_tflops_alone: tflops(flops, gemm_alone),
        gemm_tflops_loaded: tflops(flops, gemm_loaded),
        gemm_launches_alone: launches_alone,
        gemm_launches_loaded: launches_loaded,
        window_us: window,
        round_duty: if window > 0.0 {
            busy / window
        } else {
            f64::NAN
        },
        gemm_checked: l
            .gemm_loaded
            .iter()
            .map(|g| g.checked)
            .sum::<usize>()
            .max(checked),
    }
}
