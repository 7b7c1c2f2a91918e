//! `cargo xtask kernels`: compile every kernel variant with NVRTC on a machine without a GPU
//! and report registers, shared memory and spills.
//!
//! NVRTC and the CUDA headers come from the CUDA 13.0 pip wheels (`nvidia-cuda-nvrtc`,
//! `nvidia-cuda-runtime`, `nvidia-cuda-cccl`, pinned to `13.0.*`: the GPU driver is CUDA
//! 13.0 and rejects newer PTX), installed with `python3 -m pip install --target` into
//! `target/cuda-wheels` when missing; `--cuda-dir` uses a CUDA installation instead.
//!
//! The compilation itself is afdep-kernels' own JIT path: this runs
//! `cargo run -p afdep-kernels --features fault-injection --example compile_all` with the
//! library and include paths set, so CI checks exactly what the runtime does (the feature adds
//! the fault-injection variants of the fused modules, `afdep_kernels::ops::fault`, to the
//! production ones; the production modules are the same either way). It fails on any compile error, any spill and any kernel with a stack frame or local memory.
//!
//! `--sass` then checks the machine code (see [`crate::sass`]): the run fills a fresh kernel
//! cache (`target/sass/kernel-cache`), every cubin in it is disassembled with nvdisasm, and every
//! `afdep_gemm_*` kernel but `afdep_gemm_reduce` must contain `HGMMA` and no `HMMA`. nvdisasm
//! is not published as a 13.0 wheel; the pinned [`NVDISASM_WHEEL`] (a newer nvdisasm reads
//! sm_90a cubins) is installed into `target/nvdisasm-wheel` when missing, the same way as the
//! CUDA wheels, and reused offline afterwards; `--nvdisasm FILE` (or `--cuda-dir` with a
//! `bin/nvdisasm`) uses another one.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};

/// The pinned wheels (CUDA 13.0.x).
const WHEELS: [&str; 3] = [
    "nvidia-cuda-nvrtc==13.0.*",
    "nvidia-cuda-runtime==13.0.*",
    "nvidia-cuda-cccl==13.0.*",
];

/// The pinned nvdisasm wheel of `--sass` (exact version; no 13.0 release of it exists).
const NVDISASM_VERSION: &str = "13.2.51";
/// The pip requirement of [`NVDISASM_VERSION`].
const NVDISASM_WHEEL: &str = "nvidia-cuda-nvdisasm==13.2.51";

/// Arguments of `cargo xtask kernels`.
#[derive(clap::Args)]
pub struct KernelsArgs {
    /// Use this CUDA installation (NVRTC from its lib64/ or lib/, headers from include/)
    /// instead of the pip wheels.
    #[arg(long, value_name = "DIR")]
    cuda_dir: Option<PathBuf>,
    /// Where the CUDA 13.0 wheels live (installed there when missing) [default: target/cuda-wheels].
    #[arg(long, value_name = "DIR")]
    wheels_dir: Option<PathBuf>,
    /// Target architecture.
    #[arg(long, default_value = "sm_90a")]
    arch: String,
    /// Parallel NVRTC compilations [default: all cores].
    #[arg(long)]
    jobs: Option<usize>,
    /// Read and fill the kernel cache (target/afdep-kernel-cache) instead of compiling every
    /// variant afresh.
    #[arg(long)]
    cache: bool,
    /// After compiling, disassemble every cubin with nvdisasm and check the GEMM kernels'
    /// SASS (HGMMA present, no HMMA); writes target/sass/gemm.sass. Compiles into a fresh
    /// cache (target/sass/kernel-cache), so it excludes --cache; needs --arch sm_90a.
    #[arg(long, conflicts_with = "cache")]
    sass: bool,
    /// The nvdisasm of --sass [default: DIR/bin/nvdisasm with --cuda-dir DIR, else the
    /// pinned wheel in target/nvdisasm-wheel, installed when missing].
    #[arg(long, value_name = "FILE", requires = "sass")]
    nvdisasm: Option<PathBuf>,
    /// The Python interpreter that runs pip.
    #[arg(long, default_value = "python3")]
    python: String,
}

/// The workspace root (xtask lives in `<root>/xtask`): from `CARGO_MANIFEST_DIR` as `cargo
/// run` sets it for this run, else as it was when this binary was built. (Worktrees that share
/// one target folder share one `target/debug/xtask`; the build-time path alone would send a
/// stale binary to the sources of the worktree that built it.)
fn workspace_root() -> PathBuf {
    let manifest = std::env::var_os("CARGO_MANIFEST_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")));
    manifest
        .parent()
        .expect("xtask is inside the workspace")
        .to_path_buf()
}

fn target_dir(root: &Path) -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| root.join("target"))
}

/// The first file named `name` (or starting with `name` when `prefix`) under `dir`, depth first.
fn find_file(dir: &Path, name: &str, prefix: bool) -> Option<PathBuf> {
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(rd) = std::fs::read_dir(&d) else {
            continue;
        };
        let mut entries: Vec<_> = rd.filter_map(|e| e.ok()).map(|e| e.path()).collect();
        entries.sort();
        for p in entries {
            if p.is_dir() {
                stack.push(p);
            } else {
                let n = p.file_name().and_then(|n| n.to_str()).unwrap_or("");
                if n == name || (prefix && n.starts_with(name)) {
                    return Some(p);
                }
            }
        }
    }
    None
}

/// NVRTC's library folder and the header folder of an installed wheel set, if complete.
fn wheel_paths(dir: &Path) -> Option<(PathBuf, PathBuf)> {
    let lib = find_file(dir, "libnvrtc.so", true)?.parent()?.to_path_buf();
    find_file(&lib, "libnvrtc-builtins.so", true)?;
    let inc = find_file(dir, "cuda_bf16.h", false)?
        .parent()?
        .to_path_buf();
    inc.join("cuda_runtime.h").is_file().then_some(())?;
    // The pinned release line: every wheel's dist-info must say 13.0.
    let names: Vec<String> = std::fs::read_dir(dir)
        .ok()?
        .filter_map(|e| e.ok())
        .filter_map(|e| e.file_name().into_string().ok())
        .filter(|n| n.ends_with(".dist-info"))
        .collect();
    for w in [
        "nvidia_cuda_nvrtc-",
        "nvidia_cuda_runtime-",
        "nvidia_cuda_cccl-",
    ] {
        if !names
            .iter()
            .any(|n| n.starts_with(w) && n[w.len()..].starts_with("13.0."))
        {
            return None;
        }
    }
    Some((lib, inc))
}

/// The nvdisasm of an installed [`NVDISASM_WHEEL`], if complete and of the pinned version.
fn nvdisasm_wheel_path(dir: &Path) -> Option<PathBuf> {
    let bin = find_file(dir, "nvdisasm", false)?;
    dir.join(format!("nvidia_cuda_nvdisasm-{NVDISASM_VERSION}.dist-info"))
        .is_dir()
        .then_some(bin)
}

/// Installs `wheels` into `dir` (through a fresh folder renamed into place, so an
/// interrupted install never looks complete). `alternative` completes the error message with
/// what to do instead.
fn install_wheels(python: &str, dir: &Path, wheels: &[&str], alternative: &str) -> Result<()> {
    let parent = dir.parent().context("wheels folder has no parent")?;
    std::fs::create_dir_all(parent).with_context(|| format!("creating {}", parent.display()))?;
    let tmp = parent.join(format!(
        ".{}.tmp-{}",
        dir.file_name()
            .and_then(|n| n.to_str())
            .unwrap_or("cuda-wheels"),
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&tmp);
    let mut pip = Command::new(python);
    pip.args([
        "-m",
        "pip",
        "install",
        "--disable-pip-version-check",
        "--no-input",
        "--quiet",
        "--no-deps",
        "--target",
    ])
    .arg(&tmp)
    .args(wheels)
    .env("PIP_NO_INPUT", "1");
    eprintln!(
        "xtask: installing {} into {}",
        wheels.join(" "),
        dir.display()
    );
    let status = pip.status().with_context(|| {
        format!("starting `{python} -m pip` (install Python 3 with pip, or {alternative})")
    })?;
    if !status.success() {
        let _ = std::fs::remove_dir_all(&tmp);
        bail!(
            "`{python} -m pip install --target {} {}` failed ({status}): is the package index \
             reachable? Once installed into {}, the wheels are reused offline; or {alternative}",
            tmp.display(),
            wheels.join(" "),
            dir.display()
        );
    }
    if dir.exists() {
        std::fs::remove_dir_all(dir)
            .with_context(|| format!("removing the old {}", dir.display()))?;
    }
    std::fs::rename(&tmp, dir)
        .with_context(|| format!("moving the wheels into {}", dir.display()))?;
    Ok(())
}

/// NVRTC's library folder and the CUDA header folder to use.
fn cuda_paths(a: &KernelsArgs, root: &Path) -> Result<(PathBuf, PathBuf)> {
    if let Some(d) = &a.cuda_dir {
        let lib = ["lib64", "lib", "targets/x86_64-linux/lib"]
            .iter()
            .map(|l| d.join(l))
            .find(|l| find_file(l, "libnvrtc.so", true).is_some())
            .with_context(|| format!("no libnvrtc.so under {}/lib64 or lib", d.display()))?;
        let inc = d.join("include");
        if !inc.join("cuda_bf16.h").is_file() {
            bail!("no cuda_bf16.h in {}", inc.display());
        }
        return Ok((lib, inc));
    }
    let dir = a
        .wheels_dir
        .clone()
        .unwrap_or_else(|| target_dir(root).join("cuda-wheels"));
    if let Some(p) = wheel_paths(&dir) {
        return Ok(p);
    }
    install_wheels(
        &a.python,
        &dir,
        &WHEELS,
        "pass --cuda-dir to use a CUDA installation",
    )?;
    wheel_paths(&dir).with_context(|| {
        format!(
            "the wheels in {} lack libnvrtc or the CUDA headers",
            dir.display()
        )
    })
}

/// The nvdisasm of `--sass`: `--nvdisasm`, else `<cuda-dir>/bin/nvdisasm`, else the pinned
/// wheel (installed when missing).
fn nvdisasm_path(a: &KernelsArgs, root: &Path) -> Result<PathBuf> {
    if let Some(p) = &a.nvdisasm {
        if !p.is_file() {
            bail!("--nvdisasm {}: no such file", p.display());
        }
        return Ok(p.clone());
    }
    if let Some(p) = a.cuda_dir.as_ref().map(|d| d.join("bin/nvdisasm")) {
        if p.is_file() {
            return Ok(p);
        }
    }
    let dir = target_dir(root).join("nvdisasm-wheel");
    if let Some(p) = nvdisasm_wheel_path(&dir) {
        return Ok(p);
    }
    install_wheels(
        &a.python,
        &dir,
        &[NVDISASM_WHEEL],
        "pass --nvdisasm FILE (any nvdisasm that reads sm_90a)",
    )
    .with_context(|| format!("--sass needs nvdisasm: cannot install {NVDISASM_WHEEL}"))?;
    nvdisasm_wheel_path(&dir).with_context(|| {
        format!(
            "--sass needs nvdisasm: {NVDISASM_WHEEL} installed into {} holds no nvdisasm",
            dir.display()
        )
    })
}

/// Compiles every kernel variant (and with `--sass`, checks their SASS).
pub fn run(a: KernelsArgs) -> Result<()> {
    let root = workspace_root();
    if a.sass && a.arch != "sm_90a" {
        bail!(
            "--sass checks Hopper wgmma code (HGMMA) and needs --arch sm_90a, not {}",
            a.arch
        );
    }
    let (lib, inc) = cuda_paths(&a, &root)?;
    eprintln!(
        "xtask: NVRTC from {}, headers from {}",
        lib.display(),
        inc.display()
    );
    // Resolved (installed) before compiling, so a missing nvdisasm fails fast.
    let nvdisasm = if a.sass {
        let p = nvdisasm_path(&a, &root)?;
        eprintln!("xtask: nvdisasm from {}", p.display());
        Some(p)
    } else {
        None
    };
    let sass_dir = target_dir(&root).join("sass");

    let mut ld = OsString::from(&lib);
    if let Some(old) = std::env::var_os("LD_LIBRARY_PATH").filter(|v| !v.is_empty()) {
        ld.push(":");
        ld.push(old);
    }
    let cache: OsString = if a.sass {
        // A fresh cache: every entry in it is a module of this run.
        let c = sass_dir.join("kernel-cache");
        if c.exists() {
            std::fs::remove_dir_all(&c).with_context(|| format!("emptying {}", c.display()))?;
        }
        c.into()
    } else if a.cache {
        target_dir(&root).join("afdep-kernel-cache").into()
    } else {
        "off".into()
    };

    let mut cmd = crate::cargo();
    cmd.current_dir(&root)
        .args([
            "run",
            "--quiet",
            "-p",
            "afdep-kernels",
            "--features",
            "fault-injection",
            "--example",
            "compile_all",
            "--",
            "--arch",
            &a.arch,
        ])
        .env("LD_LIBRARY_PATH", ld)
        .env("AFDEP_CUDA_INCLUDE", &inc)
        .env("AFDEP_KERNEL_CACHE", &cache)
        // compile_all refuses a build of another worktree's sources (a shared target folder)
        .env(
            "AFDEP_EXPECT_KERNEL_CRATE",
            root.join("crates").join("afdep-kernels"),
        );
    if let Some(j) = a.jobs {
        cmd.args(["--jobs", &j.to_string()]);
    }
    crate::run(
        cmd,
        "compile every kernel variant (afdep-kernels example compile_all)",
    )?;
    match nvdisasm {
        Some(n) => crate::sass::check(&n, Path::new(&cache), &sass_dir),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wheel_paths_need_the_pinned_release() {
        let d = std::env::temp_dir().join(format!("xtask-wheels-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        let lib = d.join("nvidia/cu13/lib");
        let inc = d.join("nvidia/cu13/include");
        std::fs::create_dir_all(&lib).unwrap();
        std::fs::create_dir_all(&inc).unwrap();
        for f in [
            lib.join("libnvrtc.so.13"),
            lib.join("libnvrtc-builtins.so.13.0"),
            inc.join("cuda_bf16.h"),
            inc.join("cuda_runtime.h"),
        ] {
            std::fs::write(f, b"").unwrap();
        }
        assert_eq!(
            wheel_paths(&d),
            None,
            "no dist-info: not a complete install"
        );
        for w in [
            "nvidia_cuda_nvrtc-13.0.88",
            "nvidia_cuda_runtime-13.0.96",
            "nvidia_cuda_cccl-13.0.85",
        ] {
            std::fs::create_dir_all(d.join(format!("{w}.dist-info"))).unwrap();
        }
        assert_eq!(wheel_paths(&d), Some((lib.clone(), inc.clone())));
        std::fs::rename(
            d.join("nvidia_cuda_cccl-13.0.85.dist-info"),
            d.join("nvidia_cuda_cccl-13.1.0.dist-info"),
        )
        .unwrap();
        assert_eq!(wheel_paths(&d), None, "13.1 is not the pinned release");
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn nvdisasm_wheel_needs_the_pinned_version() {
        let d = std::env::temp_dir().join(format!("xtask-nvdisasm-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        let bin = d.join("nvidia/cu13/bin");
        std::fs::create_dir_all(&bin).unwrap();
        std::fs::write(bin.join("nvdisasm"), b"").unwrap();
        assert_eq!(nvdisasm_wheel_path(&d), None, "no dist-info");
        std::fs::create_dir_all(d.join("nvidia_cuda_nvdisasm-13.2.50.dist-info")).unwrap();
        assert_eq!(nvdisasm_wheel_path(&d), None, "another version");
        std::fs::create_dir_all(
            d.join(format!("nvidia_cuda_nvdisasm-{NVDISASM_VERSION}.dist-info")),
        )
        .unwrap();
        assert_eq!(nvdisasm_wheel_path(&d), Some(bin.join("nvdisasm")));
        assert_eq!(
            NVDISASM_WHEEL,
            format!("nvidia-cuda-nvdisasm=={NVDISASM_VERSION}")
        );
        let _ = std::fs::remove_dir_all(&d);
    }
}
