//! `cargo xtask gpu-test`: the GPU test matrix.
//!
//! GPU test targets are the integration tests named `gpu_*` in the workspace crates. Without
//! `--bundle`, they are built and run here (a machine with a GPU and Rust). With `--bundle DIR`
//! they are built in release mode, stripped, and copied into `DIR/tests/` together with the
//! `afdep` binary and the benchmark programs (`DIR/bin/`) and `DIR/run.sh`, so that a GPU
//! machine without Rust runs the whole matrix with `DIR/run.sh` and gets `summary.txt` /
//! `summary.json` and one log per test binary (see docs/gpu.md). The bundle also carries the
//! peer scripts (`DIR/peers/`, with `run_moe_comparison.sh` and `run_suite.sh`, the shape
//! suite with its peers), `DIR/docs/perf/moe.md` (the
//! document the comparison's report updates), `DIR/docs/perf/exchange_gpu_run.sh` (the
//! single-GPU exchange latency table), `DIR/docs/perf/exchange_load_run.sh` (the exchange under
//! a GEMM load), `DIR/docs/perf/exchange_pipeline_run.sh` (the microbatch pipeline; the three
//! source `DIR/docs/perf/bundle_common.sh`) and `DIR/commit.txt` (the commit it was built from,
//! `-dirty` when the work tree had changes).

use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{Context, Result, bail};

/// Arguments of `cargo xtask gpu-test`.
#[derive(clap::Args)]
pub struct GpuTestArgs {
    /// Build a self-contained bundle into this folder instead of running here.
    #[arg(long)]
    pub bundle: Option<PathBuf>,
    /// Only test binaries whose name contains this.
    #[arg(long)]
    pub filter: Option<String>,
}

const RUN_SH: &str = include_str!("gpu_run.sh");

/// The scripts of `docs/perf/` a bundle carries (as `DIR/docs/perf/NAME`, executable): the
/// exchange latency tables, the overlap-under-load table, the microbatch pipeline table and the
/// start they source.
const PERF_SCRIPTS: [&str; 4] = [
    "exchange_gpu_run.sh",
    "exchange_load_run.sh",
    "exchange_pipeline_run.sh",
    "bundle_common.sh",
];

/// Cargo features of the GPU test builds: the NCCL transport (loaded at run time, so it builds
/// without CUDA) for its `gpu_nccl` tests and `afdep exchange --transport nccl`, UCX with
/// device buffers (`gpu_ucx_device`, `afdep exchange --transport ucx --device-buffers`; builds
/// the bundled UCX), and fault injection into the fused kernels (`gpu_nvlink_faults`; off in
/// every round unless a test sets a fault, and not in the bundle's `bin/afdep`, which is built
/// on its own).
const GPU_FEATURES: &str = "afdep-moe/nccl,afdep-moe/ucx,afdep-moe/cuda,afdep-moe/fault-injection,\
     afdep-bench/nccl,afdep-bench/ucx";

fn build_tests(release: bool) -> Result<Vec<(String, PathBuf)>> {
    let mut cmd = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    cmd.args([
        "test",
        "--workspace",
        "--no-run",
        "--features",
        GPU_FEATURES,
        "--message-format=json-render-diagnostics",
    ]);
    if release {
        cmd.arg("--release");
    }
    cmd.stdout(Stdio::piped());
    eprintln!(
        "xtask: building test binaries{}",
        if release { " (release)" } else { "" }
    );
    let mut child = cmd.spawn().context("starting cargo test --no-run")?;
    let mut out = Vec::new();
    for line in std::io::BufReader::new(child.stdout.take().expect("piped")).lines() {
        let line = line?;
        let Ok(v) = serde_json::from_str::<serde_json::Value>(&line) else {
            continue;
        };
        if v["reason"] != "compiler-artifact" || v["profile"]["test"] != true {
            continue;
        }
        let (Some(name), Some(exe)) = (v["target"]["name"].as_str(), v["executable"].as_str())
        else {
            continue;
        };
        if v["target"]["kind"][0] == "test" && name.starts_with("gpu_") {
            out.push((name.to_string(), PathBuf::from(exe)));
        }
    }
    if !child.wait()?.success() {
        bail!("building the test binaries failed");
    }
    out.sort();
    Ok(out)
}

/// Release builds of the benchmark programs (examples named `bench_*`), for `DIR/bin/`.
fn build_benches() -> Result<Vec<(String, PathBuf)>> {
    let mut cmd = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    cmd.args([
        "build",
        "--release",
        "--workspace",
        "--examples",
        "--message-format=json-render-diagnostics",
    ]);
    cmd.stdout(Stdio::piped());
    eprintln!("xtask: building benchmark programs (release)");
    let mut child = cmd.spawn().context("starting cargo build --examples")?;
    let mut out = Vec::new();
    for line in std::io::BufReader::new(child.stdout.take().expect("piped")).lines() {
        let line = line?;
        let Ok(v) = serde_json::from_str::<serde_json::Value>(&line) else {
            continue;
        };
        if v["reason"] != "compiler-artifact" || v["target"]["kind"][0] != "example" {
            continue;
        }
        let (Some(name), Some(exe)) = (v["target"]["name"].as_str(), v["executable"].as_str())
        else {
            continue;
        };
        if name.starts_with("bench_") {
            out.push((name.to_string(), PathBuf::from(exe)));
        }
    }
    if !child.wait()?.success() {
        bail!("building the benchmark programs failed");
    }
    Ok(out)
}

fn build_afdep() -> Result<PathBuf> {
    crate::run(
        {
            let mut c = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
            c.args([
                "build",
                "--release",
                "-p",
                "afdep-bench",
                "--features",
                "nccl,ucx",
                "--bin",
                "afdep",
            ]);
            c
        },
        "cargo build --release afdep",
    )?;
    let target = std::env::var("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|_| PathBuf::from("target"));
    Ok(target.join("release").join("afdep"))
}

fn copy_stripped(src: &Path, dst: &Path) -> Result<()> {
    std::fs::copy(src, dst).with_context(|| format!("copying {}", src.display()))?;
    // strip debug info to keep the bundle small; a missing `strip` only costs size
    let _ = Command::new("strip").arg("--strip-debug").arg(dst).status();
    Ok(())
}

/// Copies the peer scripts (`peers/*.py`, `peers/*.sh`) into `dst`.
fn copy_peers(src: &Path, dst: &Path) -> Result<()> {
    std::fs::create_dir_all(dst)?;
    let entries = std::fs::read_dir(src).with_context(|| format!("reading {}", src.display()))?;
    for e in entries {
        let p = e?.path();
        let keep = matches!(p.extension().and_then(|x| x.to_str()), Some("py" | "sh"));
        if keep && p.is_file() {
            let to = dst.join(p.file_name().expect("a file has a name"));
            std::fs::copy(&p, &to).with_context(|| format!("copying {}", p.display()))?;
        }
    }
    Ok(())
}

/// `git describe`-like name of the work tree's commit: the short hash, `-dirty` with changes.
fn commit_name() -> String {
    let git = |args: &[&str]| {
        Command::new("git")
            .args(args)
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
    };
    match git(&["rev-parse", "--short", "HEAD"]) {
        Some(h) => {
            let dirty = git(&["status", "--porcelain", "--untracked-files=no"])
                .is_some_and(|s| !s.is_empty());
            if dirty { format!("{h}-dirty") } else { h }
        }
        None => "unknown".into(),
    }
}

/// Runs `cargo xtask gpu-test`.
pub fn run(a: GpuTestArgs) -> Result<()> {
    let release = a.bundle.is_some();
    let mut tests = build_tests(release)?;
    if let Some(f) = &a.filter {
        tests.retain(|(n, _)| n.contains(f.as_str()));
    }
    if tests.is_empty() {
        bail!("no gpu_* test targets found");
    }
    let dir = match &a.bundle {
        Some(d) => d.clone(),
        None => PathBuf::from("target/gpu-test"),
    };
    if dir.exists() {
        std::fs::remove_dir_all(&dir).with_context(|| format!("clearing {}", dir.display()))?;
    }
    std::fs::create_dir_all(dir.join("tests"))?;
    std::fs::create_dir_all(dir.join("bin"))?;
    for (name, exe) in &tests {
        copy_stripped(exe, &dir.join("tests").join(name))?;
    }
    let afdep = build_afdep()?;
    copy_stripped(&afdep, &dir.join("bin").join("afdep"))?;
    for (name, exe) in build_benches()? {
        copy_stripped(&exe, &dir.join("bin").join(name))?;
    }
    copy_peers(Path::new("peers"), &dir.join("peers"))?;
    let perf = dir.join("docs").join("perf");
    std::fs::create_dir_all(&perf)?;
    std::fs::copy("docs/perf/moe.md", perf.join("moe.md")).context("copying docs/perf/moe.md")?;
    for script in PERF_SCRIPTS {
        std::fs::copy(format!("docs/perf/{script}"), perf.join(script))
            .with_context(|| format!("copying docs/perf/{script}"))?;
    }
    std::fs::write(dir.join("commit.txt"), format!("{}\n", commit_name()))?;
    let script = dir.join("run.sh");
    std::fs::write(&script, RUN_SH)?;
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755))?;
        for script in ["run_moe_comparison.sh", "run_suite.sh"] {
            std::fs::set_permissions(
                dir.join("peers").join(script),
                std::fs::Permissions::from_mode(0o755),
            )?;
        }
        for script in PERF_SCRIPTS {
            std::fs::set_permissions(perf.join(script), std::fs::Permissions::from_mode(0o755))?;
        }
    }
    let names: Vec<&str> = tests.iter().map(|(n, _)| n.as_str()).collect();
    eprintln!(
        "xtask: bundle at {} with {}",
        dir.display(),
        names.join(", ")
    );
    if a.bundle.is_none() {
        crate::run(
            {
                let mut c = Command::new("bash");
                c.arg(&script);
                c
            },
            "the GPU test matrix",
        )?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::RUN_SH;
    use std::process::Command;

    /// `run.sh --count-results LOG`: "passed failed ignored" of the binary's own closing line.
    fn counts(log: &str) -> String {
        script_on(log, "--count-results")
    }

    /// `run.sh FLAG LOG`'s output for a log holding `log`.
    fn script_on(log: &str, flag: &str) -> String {
        // one directory per call: the tests run in parallel threads of one process
        static CALLS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let call = CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("afdep-xtask-{}-{call}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (script, file) = (dir.join("run.sh"), dir.join("t.log"));
        std::fs::write(&script, RUN_SH).unwrap();
        std::fs::write(&file, log).unwrap();
        let o = Command::new("bash")
            .arg(&script)
            .arg(flag)
            .arg(&file)
            .output()
            .unwrap();
        let _ = std::fs::remove_dir_all(&dir);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        String::from_utf8_lossy(&o.stdout).trim().to_string()
    }

    #[test]
    fn every_test_is_counted_once() {
        // a 5-test binary whose tests start child test processes: only its own last line counts
        let log = "running 5 tests\n\
                   test result: ok. 2 passed; 0 failed; 0 ignored; 0 measured; 4 filtered out\n\
                   test a ... SKIP: no GPU\n\
                   test result: ok. 1 passed; 0 failed; 0 ignored; 0 measured; 4 filtered out\n\
                   test result: FAILED. 4 passed; 1 failed; 1 ignored; 0 measured; 0 filtered out; \
                   finished in 3.2s\n";
        assert_eq!(counts(log), "4 1 1");
        assert_eq!(
            counts("test result: ok. 0 passed; 0 failed; 0 ignored; 0 measured\n"),
            "0 0 0"
        );
        // no closing line (a crash, a kill): one failure, nothing passed
        assert_eq!(counts("thread 'main' panicked\n"), "0 1 0");
    }

    #[test]
    fn only_the_binarys_own_skips_count() {
        // two children (one per rank) relayed into the parent's log, one of them skipping, and
        // one skipped test of the parent itself (on libtest's line, as under --nocapture)
        let log = "running 3 tests\n\
                   test parent_spawns ... \n\
                   running 1 test\n\
                   running 1 test\n\
                   test child ... SKIP: child without a GPU\n\
                   test result: ok. 1 passed; 0 failed; 0 ignored\n\
                   test child ... ok\n\
                   test result: ok. 1 passed; 0 failed; 0 ignored\n\
                   ok\n\
                   test no_device ... SKIP: no GPU\n\
                   ok\n\
                   test result: ok. 3 passed; 0 failed; 0 ignored\n";
        assert_eq!(script_on(log, "--skip-lines"), "SKIP: no GPU");
        assert_eq!(counts(log), "3 0 0");
    }

    #[test]
    fn ignored_tests_run_unless_left_out() {
        assert!(RUN_SH.contains("ignored=--include-ignored"));
        assert!(RUN_SH.contains("--skip-ignored) ignored=\"\""));
        assert!(RUN_SH.contains("ignored tests were left out"));
    }
}
