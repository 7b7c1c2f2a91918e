//! NVRTC compilation of the embedded sources to cubins, through the disk cache.
//!
//! A module ([`ModuleSpec`]) is one `.cu` file with its compile-time constants. [`Jit`] turns
//! it into a cubin for an [`Arch`] with the options
//! `--gpu-architecture=<arch> --std=c++17 --ptxas-options=-v -D... -I...` (plus
//! `-lineinfo` and any extra options of [`JitOptions`]), and keeps the cubin and the program
//! log (with its ptxas resource report) in the [`KernelCache`].
//!
//! NVRTC is loaded at run time (cudarc's `dynamic-loading`); its presence is checked before
//! the first call, so a missing library is [`KernelError::NoNvrtc`], never a panic.

use std::ffi::{CStr, CString, c_char, c_int};
use std::path::{Path, PathBuf};

use cudarc::nvrtc::sys as nv;

use crate::cache::{CacheEntry, CacheSetting, KernelCache, KeyParts, cache_key};
use crate::error::KernelError;
use crate::resources::{KernelResources, parse_ptxas_log};
use crate::sources::{HEADERS, ModuleSpec};

/// A GPU architecture NVRTC compiles for, e.g. `sm_90a`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Arch(String);

impl Arch {
    /// Hopper with its architecture-specific features (wgmma, TMA): the H200's target.
    pub fn hopper() -> Arch {
        Arch("sm_90a".into())
    }

    /// The architecture of a device of compute capability `major.minor`: the `a` variant
    /// (architecture-specific features) from compute capability 9.0 on, e.g. `sm_90a` for
    /// Hopper, plain `sm_XY` before.
    pub fn from_compute_capability(major: i32, minor: i32) -> Arch {
        if major >= 9 {
            Arch(format!("sm_{major}{minor}a"))
        } else {
            Arch(format!("sm_{major}{minor}"))
        }
    }

    /// An architecture by name (`sm_90a`, `sm_80`, ...); `None` unless it is `sm_` + digits
    /// with an optional `a` or `f` suffix.
    pub fn parse(name: &str) -> Option<Arch> {
        let rest = name.strip_prefix("sm_")?;
        let digits = rest.trim_end_matches(['a', 'f']);
        let ok = !digits.is_empty()
            && digits.chars().all(|c| c.is_ascii_digit())
            && rest.len() - digits.len() <= 1;
        ok.then(|| Arch(name.to_string()))
    }

    /// The name, e.g. `sm_90a`.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The version number, e.g. 90 for `sm_90a`.
    pub fn version(&self) -> Option<u32> {
        self.0
            .strip_prefix("sm_")?
            .trim_end_matches(['a', 'f'])
            .parse()
            .ok()
    }

    /// Whether kernels compiled for it hold `griddepcontrol` (programmatic dependent launch,
    /// sm_90 on; `AFDEP_GRID_DEPENDENCY_SYNC` compiles to nothing before).
    pub fn has_grid_dependency_control(&self) -> bool {
        self.version().is_some_and(|v| v >= 90)
    }
}

impl std::fmt::Display for Arch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// Settings of the JIT.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JitOptions {
    /// Directories with the CUDA headers (`cuda_bf16.h`); empty: found by
    /// [`find_cuda_include_dirs`].
    pub include_dirs: Vec<PathBuf>,
    /// The disk cache.
    pub cache: CacheSetting,
    /// Emit line information (`-lineinfo`) for profilers.
    pub line_info: bool,
    /// Further NVRTC options, appended last.
    pub extra_options: Vec<String>,
}

impl Default for JitOptions {
    fn default() -> Self {
        JitOptions {
            include_dirs: Vec::new(),
            cache: CacheSetting::Default,
            line_info: true,
            extra_options: Vec::new(),
        }
    }
}

impl JitOptions {
    /// The options from the environment: `AFDEP_CUDA_INCLUDE` (a path list) for the headers,
    /// the cache of [`CacheSetting::from_env`], `AFDEP_NVRTC_OPTIONS` (space-separated) for
    /// extra options.
    pub fn from_env() -> JitOptions {
        let include_dirs = std::env::var_os("AFDEP_CUDA_INCLUDE")
            .map(|v| {
                std::env::split_paths(&v)
                    .filter(|p| !p.as_os_str().is_empty())
                    .collect()
            })
            .unwrap_or_default();
        let extra_options = std::env::var("AFDEP_NVRTC_OPTIONS")
            .map(|v| v.split_whitespace().map(String::from).collect())
            .unwrap_or_default();
        JitOptions {
            include_dirs,
            cache: CacheSetting::from_env(),
            line_info: true,
            extra_options,
        }
    }
}

/// The CUDA header directories: each of `AFDEP_CUDA_INCLUDE` (a path list), else the first of
/// `$CUDA_PATH/include`, `$CUDA_HOME/include`, `$CUDA_ROOT/include`, `/usr/local/cuda/include`
/// that holds `cuda_bf16.h`; each with its `cccl` subfolder when there is one (CUDA 13 keeps
/// libcu++/CUB there). Returns the directories and the ones searched.
pub fn find_cuda_include_dirs() -> (Vec<PathBuf>, Vec<PathBuf>) {
    let mut searched = Vec::new();
    let with_cccl = |d: PathBuf| {
        let cccl = d.join("cccl");
        let mut v = vec![d];
        if cccl.is_dir() {
            v.push(cccl);
        }
        v
    };
    if let Some(v) = std::env::var_os("AFDEP_CUDA_INCLUDE") {
        let dirs: Vec<PathBuf> = std::env::split_paths(&v)
            .filter(|p| !p.as_os_str().is_empty())
            .collect();
        if !dirs.is_empty() {
            return (dirs.into_iter().flat_map(with_cccl).collect(), searched);
        }
    }
    let mut candidates: Vec<PathBuf> = ["CUDA_PATH", "CUDA_HOME", "CUDA_ROOT"]
        .iter()
        .filter_map(std::env::var_os)
        .filter(|v| !v.is_empty())
        .map(|v| PathBuf::from(v).join("include"))
        .collect();
    candidates.push(PathBuf::from("/usr/local/cuda/include"));
    for c in candidates {
        if c.join("cuda_bf16.h").is_file() {
            return (with_cccl(c), searched);
        }
        searched.push(c);
    }
    (Vec::new(), searched)
}

/// A compiled module.
#[derive(Debug, Clone)]
pub struct CompiledModule {
    /// The module.
    pub spec: ModuleSpec,
    /// The architecture it was compiled for.
    pub arch: Arch,
    /// The cubin.
    pub cubin: Vec<u8>,
    /// NVRTC's program log (warnings and the ptxas report).
    pub log: String,
    /// The cache key.
    pub key: String,
    /// Whether it came from the disk cache.
    pub from_cache: bool,
    /// The NVRTC options used.
    pub options: Vec<String>,
}

impl CompiledModule {
    /// The ptxas resource report of every function in the module.
    pub fn resources(&self) -> Vec<KernelResources> {
        parse_ptxas_log(&self.log)
    }
}

/// The NVRTC compiler with its settings and cache.
#[derive(Debug, Clone)]
pub struct Jit {
    options: JitOptions,
    include_dirs: Vec<PathBuf>,
    cache: Option<KernelCache>,
    nvrtc_version: (i32, i32),
}

/// Folders and files where NVRTC is looked for when it is not on the library path:
/// `AFDEP_NVRTC_LIB` (the library file, or its folder), then `lib64/` and `lib/` of
/// `$CUDA_PATH`, `$CUDA_HOME`, `$CUDA_ROOT`, then `/usr/local/cuda/lib64`.
pub fn nvrtc_search_paths() -> Vec<PathBuf> {
    let mut v = Vec::new();
    if let Some(p) = std::env::var_os("AFDEP_NVRTC_LIB").filter(|p| !p.is_empty()) {
        v.push(PathBuf::from(p));
    }
    for k in ["CUDA_PATH", "CUDA_HOME", "CUDA_ROOT"] {
        if let Some(d) = std::env::var_os(k).filter(|d| !d.is_empty()) {
            v.push(PathBuf::from(&d).join("lib64"));
            v.push(PathBuf::from(&d).join("lib"));
        }
    }
    v.push(PathBuf::from("/usr/local/cuda/lib64"));
    v
}

/// The library files named `prefix*` in `dir` (or `dir` itself when it is such a file),
/// excluding the `.alt` variants.
fn libs_in(dir: &Path, prefix: &str) -> Vec<PathBuf> {
    let is_lib = |p: &Path| {
        p.file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| n.starts_with(prefix) && !n.contains(".alt."))
    };
    if dir.is_file() {
        return if is_lib(dir) {
            vec![dir.to_path_buf()]
        } else {
            Vec::new()
        };
    }
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .map(|rd| {
            rd.filter_map(|e| e.ok())
                .map(|e| e.path())
                .filter(|p| is_lib(p))
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

/// Loads libnvrtc (and its builtins library, which NVRTC opens by name at compile time) by
/// full path from [`nvrtc_search_paths`], so that later loads by name find them by soname.
/// The handles are kept for the life of the process.
fn preload_nvrtc() -> Vec<PathBuf> {
    let mut tried = Vec::new();
    for place in nvrtc_search_paths() {
        let dir = if place.is_file() {
            place.parent().map(Path::to_path_buf).unwrap_or_default()
        } else {
            place.clone()
        };
        let Some(lib) = libs_in(&place, "libnvrtc.so").into_iter().next() else {
            tried.push(place);
            continue;
        };
        for b in libs_in(&dir, "libnvrtc-builtins.so").into_iter().take(1) {
            // SAFETY: loading NVRTC's builtins library runs its initialisers, as NVRTC itself
            // would when it opens it; the handle is leaked, so it is never unloaded.
            if let Ok(h) = unsafe { libloading::Library::new(&b) } {
                std::mem::forget(h);
            }
        }
        // SAFETY: as above, for libnvrtc itself.
        match unsafe { libloading::Library::new(&lib) } {
            Ok(h) => {
                std::mem::forget(h);
                tracing::debug!(path = %lib.display(), "preloaded NVRTC");
                // SAFETY: cudarc's probe only tries to open libraries by name.
                if unsafe { nv::is_culib_present() } {
                    return tried;
                }
            }
            Err(e) => tracing::debug!(path = %lib.display(), error = %e, "cannot load NVRTC"),
        }
        tried.push(lib);
    }
    tried
}

/// Checks that libnvrtc can be loaded (from the library path, else from
/// [`nvrtc_search_paths`]); the reason when it cannot.
pub fn probe_nvrtc() -> Result<(), KernelError> {
    static PROBE: std::sync::OnceLock<Result<(), String>> = std::sync::OnceLock::new();
    let r = PROBE.get_or_init(|| {
        // SAFETY: loading a shared library runs its initialisers; libnvrtc's are benign. The
        // probe only tries cudarc's candidate names.
        if unsafe { nv::is_culib_present() } {
            return Ok(());
        }
        let tried = preload_nvrtc();
        // SAFETY: as above.
        if unsafe { nv::is_culib_present() } {
            return Ok(());
        }
        Err(format!(
            "no libnvrtc.so on the library path (cudarc tried libnvrtc.so, libnvrtc.so.13 and \
             its other names), nor in {}; add a CUDA 13.0 lib dir (/usr/local/cuda/lib64, or \
             the nvidia-cuda-nvrtc wheel's nvidia/cu13/lib) to LD_LIBRARY_PATH or set \
             AFDEP_NVRTC_LIB",
            tried
                .iter()
                .map(|p| p.display().to_string())
                .collect::<Vec<_>>()
                .join(", ")
        ))
    });
    r.clone().map_err(|why| KernelError::NoNvrtc { why })
}

fn nvrtc_result(call: &'static str, r: nv::nvrtcResult) -> Result<(), KernelError> {
    if r == nv::nvrtcResult::NVRTC_SUCCESS {
        Ok(())
    } else {
        Err(KernelError::Nvrtc {
            call,
            result: format!("{r:?}"),
        })
    }
}

/// NVRTC's `(major, minor)` version.
pub fn nvrtc_version() -> Result<(i32, i32), KernelError> {
    probe_nvrtc()?;
    let (mut major, mut minor): (c_int, c_int) = (0, 0);
    // SAFETY: the library is present (probed above); both pointers are valid for writes.
    let r = unsafe { nv::nvrtcVersion(&mut major, &mut minor) };
    nvrtc_result("nvrtcVersion", r)?;
    Ok((major, minor))
}

/// Destroys an NVRTC program on drop.
struct Program(nv::nvrtcProgram);

impl Drop for Program {
    fn drop(&mut self) {
        // SAFETY: the program was created by nvrtcCreateProgram and is destroyed once.
        unsafe {
            let _ = nv::nvrtcDestroyProgram(&mut self.0);
        }
    }
}

fn cstring(s: &str) -> Result<CString, KernelError> {
    CString::new(s).map_err(|_| KernelError::Unsupported(format!("NUL byte in {s:?}")))
}

/// Compiles `src` (program name `name`, in-memory headers `headers`) to a cubin with
/// `options`. Returns the cubin and the log, or [`KernelError::Compile`] with the log.
fn nvrtc_compile_cubin(
    module: &ModuleSpec,
    src: &str,
    headers: &[(&str, &str)],
    options: &[String],
) -> Result<CacheEntry, KernelError> {
    probe_nvrtc()?;
    let c_src = cstring(src)?;
    let c_name = cstring(module.file.name())?;
    let c_hdr: Vec<CString> = headers
        .iter()
        .map(|(_, t)| cstring(t))
        .collect::<Result<_, _>>()?;
    let c_inc: Vec<CString> = headers
        .iter()
        .map(|(n, _)| cstring(n))
        .collect::<Result<_, _>>()?;
    let hdr_ptrs: Vec<*const c_char> = c_hdr.iter().map(|c| c.as_ptr()).collect();
    let inc_ptrs: Vec<*const c_char> = c_inc.iter().map(|c| c.as_ptr()).collect();
    let c_opts: Vec<CString> = options
        .iter()
        .map(|o| cstring(o))
        .collect::<Result<_, _>>()?;
    let opt_ptrs: Vec<*const c_char> = c_opts.iter().map(|c| c.as_ptr()).collect();

    let mut prog: nv::nvrtcProgram = std::ptr::null_mut();
    // SAFETY: every pointer refers to a NUL-terminated string that outlives the call; the
    // header and include-name arrays have `headers.len()` entries each.
    let r = unsafe {
        nv::nvrtcCreateProgram(
            &mut prog,
            c_src.as_ptr(),
            c_name.as_ptr(),
            headers.len() as c_int,
            hdr_ptrs.as_ptr(),
            inc_ptrs.as_ptr(),
        )
    };
    nvrtc_result("nvrtcCreateProgram", r)?;
    let prog = Program(prog);
    // SAFETY: `prog` is a live program; the option array has `options.len()` valid strings.
    let compiled =
        unsafe { nv::nvrtcCompileProgram(prog.0, opt_ptrs.len() as c_int, opt_ptrs.as_ptr()) };
    let log = program_log(&prog)?;
    if compiled != nv::nvrtcResult::NVRTC_SUCCESS {
        return Err(KernelError::Compile {
            module: module.label(),
            kernels: module
                .file
                .kernels()
                .map(|k| k.entry().to_string())
                .collect(),
            result: format!("{compiled:?}"),
            options: options.to_vec(),
            log,
        });
    }
    let mut size = 0usize;
    // SAFETY: `prog` compiled successfully; `size` is valid for writes.
    nvrtc_result("nvrtcGetCUBINSize", unsafe {
        nv::nvrtcGetCUBINSize(prog.0, &mut size)
    })?;
    let mut cubin = vec![0u8; size];
    // SAFETY: `cubin` has the size NVRTC reported.
    nvrtc_result("nvrtcGetCUBIN", unsafe {
        nv::nvrtcGetCUBIN(prog.0, cubin.as_mut_ptr() as *mut c_char)
    })?;
    if cubin.len() < 4 || &cubin[..4] != b"\x7fELF" {
        return Err(KernelError::Nvrtc {
            call: "nvrtcGetCUBIN",
            result: "the result is not an ELF cubin".into(),
        });
    }
    Ok(CacheEntry { cubin, log })
}

fn program_log(prog: &Program) -> Result<String, KernelError> {
    let mut size = 0usize;
    // SAFETY: `prog` is a live program; `size` is valid for writes.
    nvrtc_result("nvrtcGetProgramLogSize", unsafe {
        nv::nvrtcGetProgramLogSize(prog.0, &mut size)
    })?;
    let mut buf = vec![0u8; size.max(1)];
    // SAFETY: `buf` holds at least the size NVRTC reported (which includes the NUL).
    nvrtc_result("nvrtcGetProgramLog", unsafe {
        nv::nvrtcGetProgramLog(prog.0, buf.as_mut_ptr() as *mut c_char)
    })?;
    let s = CStr::from_bytes_until_nul(&buf)
        .map(|c| c.to_string_lossy().into_owned())
        .unwrap_or_default();
    Ok(s)
}

impl Jit {
    /// A JIT with `options`: loads NVRTC ([`KernelError::NoNvrtc`] when absent) and finds the
    /// CUDA headers ([`KernelError::NoHeaders`] when none are found).
    pub fn new(options: JitOptions) -> Result<Jit, KernelError> {
        let nvrtc_version = nvrtc_version()?;
        let include_dirs = if options.include_dirs.is_empty() {
            let (found, searched) = find_cuda_include_dirs();
            if found.is_empty() {
                return Err(KernelError::NoHeaders { searched });
            }
            found
        } else {
            options.include_dirs.clone()
        };
        let cache = KernelCache::from_setting(&options.cache);
        tracing::debug!(
            nvrtc = ?nvrtc_version,
            include = ?include_dirs,
            cache = ?cache.as_ref().map(|c| c.dir().to_path_buf()),
            "afdep-kernels JIT ready"
        );
        Ok(Jit {
            options,
            include_dirs,
            cache,
            nvrtc_version,
        })
    }

    /// NVRTC's `(major, minor)` version.
    pub fn nvrtc_version(&self) -> (i32, i32) {
        self.nvrtc_version
    }

    /// The CUDA header directories in use.
    pub fn include_dirs(&self) -> &[PathBuf] {
        &self.include_dirs
    }

    /// The cache folder, if the cache is on.
    pub fn cache_dir(&self) -> Option<&Path> {
        self.cache.as_ref().map(|c| c.dir())
    }

    /// The settings.
    pub fn options(&self) -> &JitOptions {
        &self.options
    }

    /// The NVRTC options of a module for an architecture.
    pub fn nvrtc_options(&self, spec: &ModuleSpec, arch: &Arch) -> Vec<String> {
        let mut o = vec![
            format!("--gpu-architecture={arch}"),
            "--std=c++17".to_string(),
            "--ptxas-options=-v".to_string(),
        ];
        if self.options.line_info {
            o.push("-lineinfo".into());
        }
        for (name, value) in spec.defines() {
            o.push(format!("-D{name}={value}"));
        }
        for d in &self.include_dirs {
            o.push(format!("-I{}", d.display()));
        }
        o.extend(self.options.extra_options.iter().cloned());
        o
    }

    /// Compiles a module for `arch`, or takes it from the cache.
    pub fn compile(&self, spec: &ModuleSpec, arch: &Arch) -> Result<CompiledModule, KernelError> {
        spec.check()
            .map_err(|why| KernelError::Unsupported(format!("{spec}: {why}")))?;
        let options = self.nvrtc_options(spec, arch);
        let label = spec.label();
        let mut sources: Vec<(&str, &str)> = vec![(spec.file.name(), spec.file.text())];
        sources.extend_from_slice(HEADERS);
        let key = cache_key(&KeyParts {
            module: &label,
            sources: &sources,
            options: &options,
            nvrtc_version: self.nvrtc_version,
            arch: arch.as_str(),
        });
        let build = || {
            let t = std::time::Instant::now();
            let e = nvrtc_compile_cubin(spec, spec.file.text(), HEADERS, &options)?;
            tracing::info!(module = %label, %arch, ms = t.elapsed().as_millis() as u64, "compiled kernel module");
            Ok::<_, KernelError>(e)
        };
        let (entry, from_cache) = match &self.cache {
            Some(c) => c.get_or_build(&key, build)?,
            None => (build()?, false),
        };
        Ok(CompiledModule {
            spec: *spec,
            arch: arch.clone(),
            cubin: entry.cubin,
            log: entry.log,
            key,
            from_cache,
            options,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grid_dependency_control_from_sm_90() {
        for (name, v, pdl) in [
            ("sm_90a", Some(90), true),
            ("sm_100f", Some(100), true),
            ("sm_89", Some(89), false),
            ("sm_80", Some(80), false),
        ] {
            let a = Arch::parse(name).unwrap();
            assert_eq!(a.version(), v, "{name}");
            assert_eq!(a.has_grid_dependency_control(), pdl, "{name}");
        }
    }

    #[test]
    fn arch_from_compute_capability() {
        assert_eq!(Arch::from_compute_capability(9, 0), Arch::hopper());
        assert_eq!(Arch::from_compute_capability(9, 0).as_str(), "sm_90a");
        assert_eq!(Arch::from_compute_capability(8, 0).as_str(), "sm_80");
        assert_eq!(Arch::from_compute_capability(10, 0).as_str(), "sm_100a");
        assert_eq!(Arch::parse("sm_90a"), Some(Arch::hopper()));
        assert_eq!(
            Arch::parse("sm_86").map(|a| a.to_string()),
            Some("sm_86".into())
        );
        for bad in ["90a", "sm_", "sm_9x", "sm_90aa", "compute_90"] {
            assert_eq!(Arch::parse(bad), None, "{bad}");
        }
    }

    #[test]
    fn options_carry_arch_defines_and_includes() {
        let jit = Jit {
            options: JitOptions {
                extra_options: vec!["--extra".into()],
                ..JitOptions::default()
            },
            include_dirs: vec![PathBuf::from("/cuda/include")],
            cache: None,
            nvrtc_version: (13, 0),
        };
        let spec = ModuleSpec::new(crate::sources::SourceFile::Router, 64, 8);
        let o = jit.nvrtc_options(&spec, &Arch::hopper());
        assert_eq!(o[0], "--gpu-architecture=sm_90a");
        for want in [
            "--std=c++17",
            "--ptxas-options=-v",
            "-DAFDEP_EXPERTS=64",
            "-DAFDEP_TOP_K=8",
            "-DAFDEP_BLOCK=256",
            "-I/cuda/include",
        ] {
            assert!(o.iter().any(|x| x == want), "{want} missing from {o:?}");
        }
        assert_eq!(o.last().unwrap(), "--extra");
    }
}
