//! `cargo xtask <command>`: the developer and CI entry points of afdep.
//!
//! - `lint`: rustfmt check and clippy with warnings as errors;
//! - `test`: the workspace tests (the README's test command runs this);
//! - `kernels`: compile every kernel variant with NVRTC on a machine without a GPU and report
//!   registers, shared memory and spills (`--sass`: also disassemble them and check the GEMM
//!   kernels' SASS);
//! - `gpu-test`: the GPU test matrix, run here or packed into a bundle for a GPU machine
//!   without Rust (`--bundle DIR`, see docs/gpu.md).

use std::process::Command;

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand};

mod gpu_test;
mod kernels;
mod sass;

#[derive(Parser)]
#[command(name = "xtask", about = "afdep developer and CI tasks")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// rustfmt --check and clippy -D warnings over the workspace.
    Lint,
    /// Run the workspace tests (CPU; no GPU needed).
    Test {
        /// Extra arguments passed to `cargo test`.
        #[arg(trailing_var_arg = true)]
        args: Vec<String>,
    },
    /// Compile every kernel variant with NVRTC (no GPU needed) and report resources.
    Kernels(kernels::KernelsArgs),
    /// Run the GPU test matrix, or build a self-contained bundle of it (`--bundle DIR`).
    GpuTest(gpu_test::GpuTestArgs),
}

fn cargo() -> Command {
    Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
}

/// Runs a command, failing with its description if it does not succeed.
pub(crate) fn run(mut cmd: Command, what: &str) -> Result<()> {
    eprintln!("xtask: {what}");
    let status = cmd.status().with_context(|| format!("starting {what}"))?;
    if !status.success() {
        bail!("{what} failed ({status})");
    }
    Ok(())
}

fn main() -> Result<()> {
    match Cli::parse().cmd {
        Cmd::Lint => {
            let mut fmt = cargo();
            fmt.args(["fmt", "--all", "--", "--check"]);
            run(fmt, "cargo fmt --check")?;
            let mut clippy = cargo();
            clippy.args([
                "clippy",
                "--workspace",
                "--all-targets",
                "--",
                "-D",
                "warnings",
            ]);
            run(clippy, "cargo clippy -D warnings")
        }
        Cmd::Test { args } => {
            let mut t = cargo();
            t.args(["test", "--workspace"]).args(args);
            run(t, "cargo test --workspace")
        }
        Cmd::Kernels(a) => kernels::run(a),
        Cmd::GpuTest(a) => gpu_test::run(a),
    }
}
