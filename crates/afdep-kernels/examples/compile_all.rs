//! Compiles every kernel variant the runtime uses with NVRTC, through the crate's own JIT path
//! (no GPU needed), prints the resources ptxas reports per kernel, and exits non-zero on any
//! compile error, or any spill or stack frame of a kernel not allowed to spill. `cargo xtask kernels` runs
//! this with the CUDA 13.0 wheels on the library and include paths.
//!
//! Usage: `compile_all [--arch sm_90a] [--jobs N] [--experts 64,96 --top-k 1,8]` (the lists
//! replace the runtime's specialisations, e.g. to check the supported limits). Built with the
//! feature `fault-injection` (as `cargo xtask kernels` does), it also compiles every fault's
//! modules (`afdep_kernels::ops::fault`) at the smallest and the largest top-k. The JIT
//! settings come from the environment (`AFDEP_CUDA_INCLUDE`, `AFDEP_KERNEL_CACHE`,
//! `AFDEP_NVRTC_OPTIONS`). With `AFDEP_EXPECT_KERNEL_CRATE` set (`cargo xtask kernels` sets it
//! to its workspace's `crates/afdep-kernels`), a binary built from another folder's sources
//! refuses to run.

use std::process::ExitCode;
use std::sync::Mutex;

use afdep_kernels::jit::{Arch, CompiledModule, Jit, JitOptions};
use afdep_kernels::sources::{
    EMBEDDED_FROM, KernelId, ModuleSpec, RUNTIME_EXPERTS, RUNTIME_TOP_K, SourceFile, source_digest,
};
use afdep_kernels::{KernelError, KernelResources};

/// Whether the library this binary links embeds the expected crate's sources
/// (`afdep_kernels::sources::EMBEDDED_FROM`). Worktrees that share one target folder can leave
/// a build of another worktree's library that cargo takes as fresh (seen on 2026-12-07: a
/// kernel check ran on the wrong sources, and rebuilding this example alone did not help).
fn built_from_this_workspace() -> Result<(), String> {
    let Some(want) = std::env::var_os("AFDEP_EXPECT_KERNEL_CRATE") else {
        return Ok(());
    };
    let canon = |p: &std::path::Path| std::fs::canonicalize(p).unwrap_or_else(|_| p.to_path_buf());
    let built = canon(std::path::Path::new(EMBEDDED_FROM));
    let want = canon(std::path::Path::new(&want));
    if built == want {
        return Ok(());
    }
    Err(format!(
        "this build embeds the kernel sources of {} but the workspace's are {}: the target \
         folder holds a stale build from another worktree; run `cargo clean -p afdep-kernels` \
         with the same CARGO_TARGET_DIR, then again",
        built.display(),
        want.display()
    ))
}

fn main() -> ExitCode {
    let mut arch = Arch::hopper();
    let mut jobs = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    let mut experts: Vec<u32> = RUNTIME_EXPERTS.to_vec();
    let mut top_k: Vec<u32> = RUNTIME_TOP_K.to_vec();
    let list = |v: Option<String>| -> Option<Vec<u32>> {
        v?.split(',')
            .map(|x| x.trim().parse().ok())
            .collect::<Option<Vec<u32>>>()
            .filter(|l| !l.is_empty())
    };
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--arch" => match args.next().as_deref().and_then(Arch::parse) {
                Some(x) => arch = x,
                None => return usage("--arch needs sm_XY[a]"),
            },
            "--jobs" => match args
                .next()
                .and_then(|v| v.parse().ok())
                .filter(|&n: &usize| n > 0)
            {
                Some(n) => jobs = n,
                None => return usage("--jobs needs a positive number"),
            },
            "--experts" => match list(args.next()) {
                Some(l) => experts = l,
                None => return usage("--experts needs a comma-separated list"),
            },
            "--top-k" => match list(args.next()) {
                Some(l) => top_k = l,
                None => return usage("--top-k needs a comma-separated list"),
            },
            "-h" | "--help" => return usage(""),
            other => return usage(&format!("unknown argument {other}")),
        }
    }

    if let Err(e) = built_from_this_workspace() {
        eprintln!("compile_all: {e}");
        return ExitCode::FAILURE;
    }
    let jit = match Jit::new(JitOptions::from_env()) {
        Ok(j) => j,
        Err(e) => {
            eprintln!("compile_all: {e}");
            return ExitCode::FAILURE;
        }
    };
    let (major, minor) = jit.nvrtc_version();
    println!("kernel sources digest {}", source_digest());
    println!("NVRTC {major}.{minor}, target {arch}");
    println!(
        "CUDA headers: {}",
        jit.include_dirs()
            .iter()
            .map(|p| p.display().to_string())
            .collect::<Vec<_>>()
            .join(", ")
    );
    match jit.cache_dir() {
        Some(d) => println!("kernel cache: {}", d.display()),
        None => println!("kernel cache: off"),
    }

    let mut variants = Vec::new();
    for file in SourceFile::ALL {
        for &e in &experts {
            for &k in &top_k {
                let m = ModuleSpec::new(file, e, k);
                // Cross products of custom lists hold unsupported pairs (top-k above experts).
                if m.check().is_ok() && !variants.contains(&m) {
                    variants.push(m);
                }
            }
        }
    }
    // With fault injection built in: every fault's modules (the fused files that hold one of
    // its points) at the smallest and the largest top-k (the fused engine loads some fused
    // kernels at top-k 1, the others at the configuration's), so that every point compiles too.
    #[cfg(feature = "fault-injection")]
    for fault in afdep_kernels::ops::fault::Fault::ALL {
        let ks = [top_k.iter().min(), top_k.iter().max()];
        for k in ks.into_iter().flatten() {
            for file in fault.files() {
                let m = ModuleSpec::new(file, experts[0], *k).with_fault(Some(fault));
                if m.check().is_ok() && !variants.contains(&m) {
                    variants.push(m);
                }
            }
        }
    }
    let results: Mutex<Vec<(usize, Result<CompiledModule, KernelError>)>> = Mutex::new(Vec::new());
    let next = Mutex::new(0usize);
    let started = std::time::Instant::now();
    std::thread::scope(|s| {
        for _ in 0..jobs.min(variants.len()) {
            s.spawn(|| {
                loop {
                    let i = {
                        let mut n = next.lock().unwrap();
                        let i = *n;
                        *n += 1;
                        i
                    };
                    let Some(spec) = variants.get(i) else { break };
                    let r = jit.compile(spec, &arch);
                    results.lock().unwrap().push((i, r));
                }
            });
        }
    });
    let mut results = results.into_inner().unwrap();
    results.sort_by_key(|(i, _)| *i);

    let mut failures = Vec::new();
    let mut rows: Vec<(ModuleSpec, KernelId, KernelResources, bool)> = Vec::new();
    let mut cached = 0;
    for (i, r) in results {
        let spec = variants[i];
        match r {
            Err(e) => failures.push(format!("{spec}: {e}")),
            Ok(m) => {
                cached += usize::from(m.from_cache);
                // ptxas's advisory that it serialised a kernel's wgmma pipeline (a wgmma under
                // divergent control flow, across a call, short of registers): the kernel still
                // runs, at a fraction of its tensor-core rate, so it is a failure here.
                for line in m.log.lines().filter(|l| serialises_wgmma(l)) {
                    failures.push(format!("{spec}: {}", line.trim()));
                }
                let res = m.resources();
                for f in res.iter().filter(|f| !f.is_entry && f.spills()) {
                    failures.push(format!(
                        "{spec}: device function {} spills ({} B stores, {} B loads)",
                        f.name, f.spill_stores, f.spill_loads
                    ));
                }
                for k in spec.file.kernels() {
                    match res.iter().find(|f| f.is_entry && f.name == k.entry()) {
                        Some(f) => {
                            if f.spills() && !k.may_spill() {
                                failures.push(format!(
                                    "{spec}: {k} spills ({} B stores, {} B loads)",
                                    f.spill_stores, f.spill_loads
                                ));
                            }
                            // A stack frame without spills is just as slow: e.g. a non-inlined
                            // callee that takes the kernel's parameter struct by reference
                            // copies it to local memory (the GEMM slowdown of docs/perf/moe.md
                            // (e)).
                            if (f.stack_bytes > 0 || f.local_bytes > 0) && !k.may_spill() {
                                failures.push(format!(
                                    "{spec}: {k} uses local memory ({} B stack, {} B local)",
                                    f.stack_bytes, f.local_bytes
                                ));
                            }
                            rows.push((spec, k, f.clone(), m.from_cache));
                        }
                        None => {
                            failures.push(format!("{spec}: {k} is missing from the ptxas report"))
                        }
                    }
                }
            }
        }
    }

    println!();
    println!(
        "{:<22} {:<26} {:>5} {:>8} {:>6} {:>7} {:>7} {:>6} {:>4}",
        "module", "kernel", "regs", "smem B", "stack", "spill-st", "spill-ld", "lmem", "bar"
    );
    for (spec, k, r, _) in &rows {
        println!(
            "{:<22} {:<26} {:>5} {:>8} {:>6} {:>7} {:>7} {:>6} {:>4}",
            spec.label(),
            k.entry(),
            r.registers,
            r.shared_bytes,
            r.stack_bytes,
            r.spill_stores,
            r.spill_loads,
            r.local_bytes,
            r.barriers
        );
    }
    println!();
    println!(
        "{} modules, {} kernels in {:.1} s ({} from the cache)",
        variants.len(),
        rows.len(),
        started.elapsed().as_secs_f64(),
        cached
    );
    if failures.is_empty() {
        println!("OK: every variant compiled, no spills, no local memory, no serialised wgmma");
        ExitCode::SUCCESS
    } else {
        for f in &failures {
            eprintln!("FAILED: {f}");
        }
        ExitCode::FAILURE
    }
}

/// Whether a line of the ptxas report says that it serialised wgmma instructions.
fn serialises_wgmma(line: &str) -> bool {
    let l = line.to_ascii_lowercase();
    l.contains("wgmma") && l.contains("serializ")
}

fn usage(err: &str) -> ExitCode {
    if !err.is_empty() {
        eprintln!("compile_all: {err}");
    }
    eprintln!("usage: compile_all [--arch sm_90a] [--jobs N] [--experts LIST] [--top-k LIST]");
    if err.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
