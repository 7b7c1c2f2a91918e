//! [`GpuContext`]: one device, one stream, the JIT, and the modules loaded on it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use cudarc::driver::{
    CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, DevicePtr, DriverError, sys as cu,
};
use cudarc::nvrtc::Ptx;

use crate::error::KernelError;
use crate::jit::{Arch, Jit, JitOptions};
use crate::sources::{KernelId, ModuleSpec};

/// A CUDA device context for afdep's kernels: the cudarc context and one stream every
/// launcher uses, the [`Jit`], and the modules loaded so far (each compiled, or read from the
/// disk cache, and loaded once, at first use).
pub struct GpuContext {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    arch: Arch,
    jit: Jit,
    modules: Mutex<HashMap<ModuleSpec, Arc<CudaModule>>>,
    functions: Mutex<HashMap<(ModuleSpec, KernelId), CudaFunction>>,
    sm_count: u32,
    /// The multiprocessors the GEMMs' persistent grids may fill ([`GpuContext::set_gemm_sms`]).
    gemm_sms: std::sync::atomic::AtomicU32,
    /// Blocks of a persistent grid per (kernel, dynamic shared memory bytes), once measured.
    persistent: Mutex<HashMap<(KernelId, u32), u32>>,
    /// The fault word (`u32[4]`, see [`fault`]) and its device address, made at first use.
    fault: std::sync::OnceLock<(CudaSlice<u32>, u64)>,
    /// The GEMMs' tile counters (`u32[2]`, see [`GpuContext::schedule_word`]) and their
    /// device address, made at first use.
    schedule: std::sync::OnceLock<(CudaSlice<u32>, u64)>,
    /// The injected fault of the fused kernels ([`GpuContext::set_fault`]).
    #[cfg(feature = "fault-injection")]
    injected: Mutex<Option<crate::ops::fault::Fault>>,
}

/// Codes of the context's fault word: `{code, block, step, 0}`, written by a kernel whose
/// bounded wait ran out (the first fault wins), read and cleared by
/// [`GpuContext::take_fault`].
pub mod fault {
    /// No fault.
    pub const NONE: u32 = 0;
    /// A GEMM's TMA stage (mbarrier) wait ran out (`AFDEP_FAULT_GEMM_TMA_WAIT` in gemm.cu).
    pub const GEMM_TMA_WAIT: u32 = 1;

    /// What a code means.
    pub fn describe(code: u32) -> String {
        match code {
            GEMM_TMA_WAIT => "a GEMM's TMA stage wait ran out".into(),
            c => format!("unknown fault code {c}"),
        }
    }
}

/// What a persistent grid is made of ([`GpuContext::persistent_grid`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GridUnit {
    /// Single blocks.
    Block,
    /// 2-block clusters (`__cluster_dims__(2, 1, 1)`).
    Pair,
}

impl std::fmt::Debug for GpuContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuContext")
            .field("ordinal", &self.ctx.ordinal())
            .field("arch", &self.arch)
            .finish()
    }
}

/// Checks that the driver library can be loaded and initialised and sees at least one device;
/// [`KernelError::NoDriver`] with the reason otherwise. Returns the number of devices.
pub fn probe_driver() -> Result<usize, KernelError> {
    // SAFETY: loading libcuda runs its initialisers, which is what any CUDA program does; the
    // probe only tries the candidate names.
    if !unsafe { cu::is_culib_present() } {
        return Err(KernelError::NoDriver {
            why: "libcuda.so (the NVIDIA driver library) cannot be loaded: no NVIDIA driver is \
                  installed on this machine, or it is not on the library path"
                .into(),
        });
    }
    cudarc::driver::result::init().map_err(|e| KernelError::NoDriver {
        why: format!("the NVIDIA driver failed to initialise (cuInit): {e}"),
    })?;
    let n = CudaContext::device_count().map_err(|e| KernelError::NoDriver {
        why: format!("the NVIDIA driver cannot count devices: {e}"),
    })?;
    if n <= 0 {
        return Err(KernelError::NoDriver {
            why: "the NVIDIA driver sees no CUDA device".into(),
        });
    }
    Ok(n as usize)
}

/// A new non-blocking stream of `ctx`, without the `cuCtxSynchronize` that cudarc's
/// `CudaContext::new_stream` issues for the first stream of a context object that tracks
/// events. That wait covers every kernel of the (primary) context, so on a GPU where emulated
/// ranks of a group run kernels that spin on each other's stores, a rank whose thread creates
/// its first stream after a peer's kernel started waiting for it blocks that kernel's wait
/// until it times out (a device timeout seen under load, 2026-12-06). Nothing was allocated on
/// a fresh context object's streams yet, so the wait protects nothing here. The stream is
/// forked from the legacy default stream (an event recorded there, waited for by the new
/// stream): its first work runs after what was queued on the legacy stream when it was made
/// (afdep queues nothing there; a caller such as PyTorch may), a one-time order, not a wait
/// of this thread.
pub fn quiet_stream(ctx: &Arc<CudaContext>) -> Result<Arc<CudaStream>, DriverError> {
    ctx.default_stream().fork()
}

impl GpuContext {
    /// A context on device `ordinal` with the JIT settings of [`JitOptions::from_env`].
    ///
    /// Without a usable driver this is [`KernelError::NoDriver`] (never a panic); without
    /// NVRTC [`KernelError::NoNvrtc`]; without CUDA headers [`KernelError::NoHeaders`].
    pub fn new(ordinal: usize) -> Result<GpuContext, KernelError> {
        GpuContext::with_options(ordinal, JitOptions::from_env())
    }

    /// A context on device `ordinal` with explicit JIT settings. The architecture comes from
    /// the device's compute capability ([`Arch::from_compute_capability`]), or from
    /// `AFDEP_KERNEL_ARCH` when set.
    pub fn with_options(ordinal: usize, options: JitOptions) -> Result<GpuContext, KernelError> {
        let devices = probe_driver()?;
        if ordinal >= devices {
            return Err(KernelError::Unsupported(format!(
                "device {ordinal} requested, the driver sees {devices}"
            )));
        }
        let ctx = CudaContext::new(ordinal).map_err(KernelError::driver(format!(
            "creating a context on device {ordinal}"
        )))?;
        let (major, minor) = ctx
            .compute_capability()
            .map_err(KernelError::driver("reading the compute capability"))?;
        let arch = match std::env::var("AFDEP_KERNEL_ARCH") {
            Ok(a) if !a.is_empty() => Arch::parse(&a).ok_or_else(|| {
                KernelError::Unsupported(format!("AFDEP_KERNEL_ARCH={a} is not sm_XY[a]"))
            })?,
            _ => Arch::from_compute_capability(major, minor),
        };
        let jit = Jit::new(options)?;
        let stream = quiet_stream(&ctx).map_err(KernelError::driver("creating a stream"))?;
        tracing::info!(
            ordinal,
            device = ctx.name().unwrap_or_default(),
            %arch,
            nvrtc = ?jit.nvrtc_version(),
            "afdep GPU context"
        );
        let sm_count = ctx
            .attribute(
                cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
            )
            .map_err(KernelError::driver("reading the SM count"))?
            .max(1) as u32;
        Ok(GpuContext {
            ctx,
            stream,
            arch,
            jit,
            modules: Mutex::new(HashMap::new()),
            functions: Mutex::new(HashMap::new()),
            sm_count,
            gemm_sms: std::sync::atomic::AtomicU32::new(gemm_sms_from_env(sm_count)),
            persistent: Mutex::new(HashMap::new()),
            fault: std::sync::OnceLock::new(),
            schedule: std::sync::OnceLock::new(),
            #[cfg(feature = "fault-injection")]
            injected: Mutex::new(None),
        })
    }

    /// The device address of the context's fault word (`u32[4]`, zeroed), allocated at first
    /// use. Kernels with bounded waits record a timeout there instead of trapping.
    pub fn fault_word(&self) -> Result<u64, KernelError> {
        self.zeroed_words(&self.fault, 4, "the fault word")
    }

    /// The device address of the context's GEMM tile counters (`u32[2]`: the next tile, the
    /// blocks done; zeroed), allocated at first use. A GEMM launched with the dynamic schedule
    /// (`ops::gemm::Schedule::Dynamic`) hands out its tiles from the first counter and its
    /// last block to finish puts both back to zero, so the next GEMM on this context's stream
    /// (which starts after it) finds them zeroed. Kernels on the one stream never overlap, so
    /// one pair serves every GEMM of the context. A CUDA graph that captured such a GEMM
    /// replays it with this pair on the stream the graph is launched on: a replay must not
    /// overlap another dynamic GEMM of the context (another graph's, or an eager one), or both
    /// may skip or repeat tiles and leave the counters non-zero for every later launch.
    pub fn schedule_word(&self) -> Result<u64, KernelError> {
        self.zeroed_words(&self.schedule, 2, "the GEMM tile counters")
    }

    /// A zeroed `u32[n]` on the device, made once into `cell` (and its address).
    fn zeroed_words(
        &self,
        cell: &std::sync::OnceLock<(CudaSlice<u32>, u64)>,
        n: usize,
        what: &'static str,
    ) -> Result<u64, KernelError> {
        if let Some((_, p)) = cell.get() {
            return Ok(*p);
        }
        let buf = self
            .stream
            .alloc_zeros::<u32>(n)
            .map_err(KernelError::driver(format!("allocating {what}")))?;
        let p = {
            let (p, _guard) = buf.device_ptr(&self.stream);
            p
        };
        self.stream
            .synchronize()
            .map_err(KernelError::driver(format!("zeroing {what}")))?;
        // Another thread may have won the race: its buffer is the one kept (ours is dropped).
        let _ = cell.set((buf, p));
        Ok(cell.get().map(|(_, p)| *p).unwrap_or(p))
    }

    /// Waits for the stream, then reads and clears the fault word:
    /// [`KernelError::DeviceFault`] if a kernel recorded one since the last call.
    pub fn take_fault(&self) -> Result<(), KernelError> {
        let Some((buf, _)) = self.fault.get() else {
            return Ok(());
        };
        let w = self
            .stream
            .clone_dtoh(buf)
            .map_err(KernelError::driver("reading the fault word"))?;
        if w[0] == fault::NONE {
            return Ok(());
        }
        let (p, _guard) = buf.device_ptr(&self.stream);
        // SAFETY: p is the address of the context's live 16-byte fault word; the memset is
        // ordered on the stream after the read above and before any later launch.
        unsafe { cu::cuMemsetD32Async(p, 0, 4, self.stream.cu_stream()) }
            .result()
            .map_err(KernelError::driver("clearing the fault word"))?;
        Err(KernelError::DeviceFault {
            what: fault::describe(w[0]),
            block: w[1],
            step: w[2],
        })
    }

    /// The cudarc context.
    pub fn cuda(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The stream every launcher of this context uses.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The architecture modules are compiled for.
    pub fn arch(&self) -> &Arch {
        &self.arch
    }

    /// The JIT.
    pub fn jit(&self) -> &Jit {
        &self.jit
    }

    /// The device ordinal.
    pub fn ordinal(&self) -> usize {
        self.ctx.ordinal()
    }

    /// The device's name.
    pub fn device_name(&self) -> Result<String, KernelError> {
        self.ctx
            .name()
            .map_err(KernelError::driver("reading the device name"))
    }

    /// Waits for everything queued on the stream.
    pub fn synchronize(&self) -> Result<(), KernelError> {
        self.stream
            .synchronize()
            .map_err(KernelError::driver("synchronising the stream"))
    }

    /// The module `spec`, compiled (or read from the cache) and loaded at its first use.
    pub fn module(&self, spec: &ModuleSpec) -> Result<Arc<CudaModule>, KernelError> {
        let mut modules = self.modules.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(m) = modules.get(spec) {
            return Ok(m.clone());
        }
        let compiled = self.jit.compile(spec, &self.arch)?;
        for r in compiled.resources().iter().filter(|r| r.spills()) {
            tracing::warn!(module = %spec, kernel = %r.name, stores = r.spill_stores, loads = r.spill_loads, "kernel spills registers");
        }
        let m = self
            .ctx
            .load_module(Ptx::from_binary(compiled.cubin))
            .map_err(KernelError::driver(format!(
                "loading module {spec} ({})",
                self.arch
            )))?;
        modules.insert(*spec, m.clone());
        Ok(m)
    }

    /// The modules loaded so far, each with its specialisation.
    pub fn loaded_modules(&self) -> Vec<(ModuleSpec, Arc<CudaModule>)> {
        self.modules
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .map(|(s, m)| (*s, m.clone()))
            .collect()
    }

    /// The function of `kernel` specialised for `experts` and `top_k` (values the kernel's
    /// file is not specialised by are ignored). With the feature `fault-injection` and a fault
    /// set (`GpuContext::set_fault`), from the module built with the fault's points of the
    /// kernel's file (the production module when the file holds none).
    pub fn function(
        &self,
        kernel: KernelId,
        experts: u32,
        top_k: u32,
    ) -> Result<CudaFunction, KernelError> {
        let spec = ModuleSpec::of(kernel, experts, top_k);
        #[cfg(feature = "fault-injection")]
        let spec = spec.with_fault(self.fault());
        if let Some(f) = self
            .functions
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&(spec, kernel))
        {
            return Ok(f.clone());
        }
        let m = self.module(&spec)?;
        let f = m
            .load_function(kernel.entry())
            .map_err(KernelError::driver(format!("loading {kernel} from {spec}")))?;
        self.functions
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert((spec, kernel), f.clone());
        Ok(f)
    }

    /// Selects the fault injected into the fused kernels from now on (`None`: none), see
    /// [`crate::ops::fault`]: later [`GpuContext::function`] calls hand out the kernels of the
    /// fault-built modules, compiled and loaded at their first use. Functions already handed
    /// out (and CUDA graphs captured with them) keep the kernels they had. Tests only.
    #[cfg(feature = "fault-injection")]
    pub fn set_fault(&self, fault: Option<crate::ops::fault::Fault>) {
        tracing::warn!(fault = ?fault, ordinal = self.ordinal(), "fault injection into the fused kernels");
        *self.injected.lock().unwrap_or_else(|p| p.into_inner()) = fault;
    }

    /// The fault injected into the fused kernels ([`GpuContext::set_fault`]).
    #[cfg(feature = "fault-injection")]
    pub fn fault(&self) -> Option<crate::ops::fault::Fault> {
        *self.injected.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// How often the fault points of every fault-built module this context loaded fired so far
    /// (each module's `afdep_fault_hits`, summed). Copies on the context's stream and waits for
    /// it: call it between rounds, when no kernel of another rank on the device waits for this
    /// one.
    #[cfg(feature = "fault-injection")]
    pub fn fault_hits(&self) -> Result<u64, KernelError> {
        let modules: Vec<(ModuleSpec, Arc<CudaModule>)> = self
            .loaded_modules()
            .into_iter()
            .filter(|(s, _)| s.fault_mask() != 0)
            .collect();
        self.ctx
            .bind_to_thread()
            .map_err(KernelError::driver("binding the context"))?;
        let mut total = 0u64;
        for (spec, m) in modules {
            let g = m
                .get_global("afdep_fault_hits", &self.stream)
                .map_err(KernelError::driver(format!(
                    "finding the fault hits of {spec}"
                )))?;
            if g.len() != 8 {
                return Err(KernelError::Unsupported(format!(
                    "{spec}: afdep_fault_hits has {} bytes, not 8",
                    g.len()
                )));
            }
            let mut b = [0u8; 8];
            self.stream
                .memcpy_dtoh(&g, &mut b)
                .map_err(KernelError::driver(format!(
                    "reading the fault hits of {spec}"
                )))?;
            self.synchronize()?;
            total += u64::from_le_bytes(b);
        }
        Ok(total)
    }

    /// The device's multiprocessor count (read once, when the context was made).
    pub fn sm_count(&self) -> u32 {
        self.sm_count
    }

    /// The multiprocessors the GEMMs' persistent grids fill: every one unless limited by
    /// [`GpuContext::set_gemm_sms`] or the environment variable `AFDEP_GEMM_SMS` (read when the
    /// context is made).
    pub fn gemm_sms(&self) -> u32 {
        self.gemm_sms.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Limits the GEMMs' persistent grids to the resident blocks of `sms` multiprocessors
    /// (`None`: every one; values are clamped to 1..=[`GpuContext::sm_count`]), so that kernels
    /// of other streams find free SMs while a GEMM runs: the exchange's kernels beside the
    /// experts of a microbatch pipeline, or beside a caller's GEMM. A persistent grid holds its
    /// SMs until its last tile is done, so without a limit a kernel launched after it waits
    /// for the whole GEMM. The GEMMs' tiles are the same either way (fewer blocks take more
    /// tiles each), so results do not change. Takes effect at the next launch.
    pub fn set_gemm_sms(&self, sms: Option<u32>) {
        let n = sms.map_or(self.sm_count, |n| n.clamp(1, self.sm_count));
        self.gemm_sms.store(n, std::sync::atomic::Ordering::Relaxed);
    }

    /// `blocks`, a persistent grid over the whole device, cut to the GEMMs' share of the
    /// multiprocessors ([`GpuContext::gemm_sms`]), keeping `multiple` (a cluster's blocks) as a
    /// factor and at least `multiple` blocks.
    pub fn gemm_grid(&self, blocks: u32, multiple: u32) -> u32 {
        grid_share(blocks, self.gemm_sms(), self.sm_count, multiple)
    }

    /// The grid of a persistent kernel, in blocks: with [`GridUnit::Block`] the blocks of
    /// `kernel` (not specialised by experts or top-k) resident at once on the whole device with
    /// `block` threads and `smem` bytes of dynamic shared memory; with [`GridUnit::Pair`]
    /// (a kernel compiled with `__cluster_dims__(2, 1, 1)`) twice the 2-block clusters resident
    /// at once (0 when not one pair fits). The first call per (kernel, smem) raises the
    /// function's dynamic shared-memory limit to `smem` and asks the driver for the occupancy;
    /// later calls answer from the context, so launches pay no driver queries.
    pub fn persistent_grid(
        &self,
        kernel: KernelId,
        block: u32,
        smem: u32,
        unit: GridUnit,
    ) -> Result<u32, KernelError> {
        self.cached_grid(kernel, smem, |f| match unit {
            GridUnit::Block => {
                let per_sm = f
                    .occupancy_max_active_blocks_per_multiprocessor(block, smem as usize, None)
                    .map_err(KernelError::driver(format!("reading {kernel}'s occupancy")))?
                    .max(1);
                let n = per_sm * self.sm_count;
                tracing::debug!(%kernel, per_sm, blocks = n, "persistent grid");
                Ok(n)
            }
            GridUnit::Pair => {
                // The cluster size comes from the kernel's compile-time attribute (none in the
                // config).
                let cfg = cudarc::driver::LaunchConfig {
                    grid_dim: (2 * self.sm_count.max(1), 1, 1),
                    block_dim: (block, 1, 1),
                    shared_mem_bytes: smem,
                };
                let clusters = f
                    .occupancy_max_active_clusters(cfg, self.stream())
                    .map_err(KernelError::driver(format!(
                        "reading {kernel}'s cluster occupancy"
                    )))?;
                let n = 2 * clusters;
                tracing::debug!(%kernel, clusters, blocks = n, "persistent grid of block pairs");
                Ok(n)
            }
        })
    }

    /// A persistent grid's size for (kernel, smem), from the context's cache or, the first
    /// time, from `measure` after the function's dynamic shared-memory limit was raised to
    /// `smem`.
    fn cached_grid(
        &self,
        kernel: KernelId,
        smem: u32,
        measure: impl FnOnce(&CudaFunction) -> Result<u32, KernelError>,
    ) -> Result<u32, KernelError> {
        let key = (kernel, smem);
        if let Some(&n) = self
            .persistent
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&key)
        {
            return Ok(n);
        }
        let f = self.function(kernel, 0, 0)?;
        f.set_attribute(
            cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            smem as i32,
        )
        .map_err(KernelError::driver(format!("setting {kernel}'s shared memory size")))?;
        let n = measure(&f)?;
        self.persistent
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(key, n);
        Ok(n)
    }

    /// Loads the given modules now (e.g. before timing), instead of at first use.
    pub fn preload(&self, specs: &[ModuleSpec]) -> Result<(), KernelError> {
        for s in specs {
            self.module(s)?;
        }
        Ok(())
    }

    /// Checks the context for an earlier asynchronous failure (a faulting kernel).
    pub fn check(&self) -> Result<(), KernelError> {
        self.ctx
            .check_err()
            .map_err(KernelError::driver("an earlier launch"))
    }
}

/// Maps a driver error of a launch.
pub(crate) fn launch_err(kernel: KernelId) -> impl FnOnce(DriverError) -> KernelError {
    KernelError::driver(format!("launching {kernel}"))
}

/// The share of a persistent grid of `blocks` (resident on all `sm_count` SMs) that fits on
/// `sms` of them: a multiple of `multiple`, at least `multiple`, at most `blocks` rounded up to
/// `multiple`.
fn grid_share(blocks: u32, sms: u32, sm_count: u32, multiple: u32) -> u32 {
    let m = multiple.max(1);
    let all = sm_count.max(1);
    let scaled = (u64::from(blocks) * u64::from(sms.min(all)) / u64::from(all)) as u32;
    (scaled / m * m).max(m).min(blocks.max(1).div_ceil(m) * m)
}

/// `AFDEP_GEMM_SMS`: the GEMMs' multiprocessor limit of a new context (every SM when unset;
/// a value that is not a positive number is warned about and ignored).
fn gemm_sms_from_env(sm_count: u32) -> u32 {
    match std::env::var("AFDEP_GEMM_SMS") {
        Err(_) => sm_count,
        Ok(v) => match v.trim().parse::<u32>() {
            Ok(n) if n > 0 => n.min(sm_count),
            _ => {
                tracing::warn!(value = %v, "AFDEP_GEMM_SMS is not a positive number; ignored");
                sm_count
            }
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_gemm_grid_keeps_its_share_of_the_sms() {
        // every SM: the whole grid
        assert_eq!(grid_share(264, 132, 132, 1), 264);
        // 108 of 132 SMs at 2 blocks per SM: 216 blocks
        assert_eq!(grid_share(264, 108, 132, 1), 216);
        // pairs stay whole: 132 pairs' blocks on 107 SMs -> 214 (even)
        assert_eq!(grid_share(264, 107, 132, 2), 214);
        // one SM of many still gets a pair
        assert_eq!(grid_share(132, 1, 132, 2), 2);
        // more SMs than the device has: the whole grid
        assert_eq!(grid_share(132, 500, 132, 1), 132);
        // never zero
        assert_eq!(grid_share(0, 10, 132, 1), 1);
    }

    fn send_sync<T: Send + Sync>() {}

    #[test]
    fn context_can_be_shared_across_threads() {
        send_sync::<GpuContext>();
        send_sync::<crate::ops::DeviceRoutes>();
        send_sync::<crate::ExpertLayout>();
    }

    #[test]
    fn no_driver_here_is_a_typed_error() {
        // On a machine without libcuda this is NoDriver (and never a panic); with a driver
        // it succeeds or fails for another reason.
        if let Err(e) = probe_driver() {
            assert!(e.is_no_driver(), "{e}");
            assert!(e.to_string().contains("no usable NVIDIA driver"));
        }
    }
}
