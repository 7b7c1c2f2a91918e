//! `afdep`: run and benchmark MoE layers and AFD exchanges.
//!
//! ```text
//! afdep moe       [--backend auto|cpu|cuda] [--tokens N,..] [--dispatch D,..] [--iters N]
//!                 [shape flags | --shape NAME | --suite models|record] [--list]
//!                 [--json-out F] [--write-inputs DIR] [--write-outputs DIR] ...
//! afdep report moe --rows A.jsonl B.jsonl .. [--md FILE] [--png FILE] [--commit C]
//! afdep exchange  [--backend auto|cpu|cuda] [--config FILE] [--transport loopback|tcp|nvlink|nccl|ucx]
//!                 [--arm payload-first|count-first|count-first-source|auto] [--graph]
//!                 [--topology 3A:1F] [--tokens N,..] ...
//! afdep exchange-arms [--arms A,B,..] [--repeats R] -- <exchange flags>
//! afdep launch    -n N [--rendezvous ADDR] [--timeout S] [--grace S] -- CMD ARGS..
//! afdep kernels   --digest
//! ```
//! Every command prints one JSON row per measurement on stdout (logs go to stderr, filtered
//! by `RUST_LOG`).

use std::path::PathBuf;

use anyhow::Result;
use clap::{Parser, Subcommand, ValueEnum};

mod arms_cmd;
mod cuda_stages;
mod exchange_cmd;
mod exchange_config;
mod jsonl;
mod launch_cmd;
mod moe_cmd;
mod moe_gpu;
mod report;
mod report_png;
mod safetensors_guard;
mod shapes;
mod tensor_file;
mod trace_report;

#[cfg(test)]
mod fuzz_inputs;

/// Where a command runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Backend {
    /// CUDA if a usable GPU and driver are present, else the CPU.
    Auto,
    /// The CPU oracle / staged engine.
    Cpu,
    /// The GPU.
    Cuda,
}

#[derive(Parser)]
#[command(
    name = "afdep",
    version,
    about = "afdep: MoE layers and attention–FFN exchange on NVIDIA GPUs"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run the MoE layer (forward and train step) and print JSON rows.
    Moe(moe_cmd::MoeArgs),
    /// Run AFD exchange rounds (dispatch + experts + combine) and print JSON rows.
    Exchange(exchange_cmd::ExchangeArgs),
    /// Compare dispatch arms: each arm in its own `afdep exchange` process, in rotated orders
    /// over repeats; medians and the paired change against payload-first.
    ExchangeArms(arms_cmd::ArmsArgs),
    /// Start N processes of one multi-process group (rank, world size and rendezvous address
    /// in their environment) and stop all of them if one fails.
    Launch(launch_cmd::LaunchArgs),
    /// Reports made from the JSON rows of earlier runs.
    #[command(subcommand)]
    Report(ReportCmd),
    /// Information on the embedded kernels.
    Kernels {
        /// Print the digest of the embedded kernel sources.
        #[arg(long)]
        digest: bool,
    },
}

#[derive(Subcommand)]
enum ReportCmd {
    /// The MoE layer against the peers: a markdown table of ratios (written between marker
    /// comments of a document) and a PNG chart.
    Moe(report::ReportMoeArgs),
    /// A timeline PNG of one round of an `afdep exchange --trace` file, and its phases as text.
    Trace(trace_report::ReportTraceArgs),
}

/// A comma-separated list of token counts (`1,8,2048`; `16k` and `1M` allowed).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenList(pub Vec<usize>);

impl std::str::FromStr for TokenList {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        parse_tokens(s).map(TokenList)
    }
}

/// Parses a comma-separated list of token counts (`1,8,2048` or `16k`, `1M`).
pub fn parse_tokens(s: &str) -> Result<Vec<usize>, String> {
    s.split(',')
        .map(|p| {
            let p = p.trim();
            let (num, mul) = match p.chars().last() {
                Some('k' | 'K') => (&p[..p.len() - 1], 1024),
                Some('m' | 'M') => (&p[..p.len() - 1], 1024 * 1024),
                _ => (p, 1),
            };
            num.parse::<usize>()
                .map_err(|e| format!("bad token count {p:?}: {e}"))?
                .checked_mul(mul)
                .ok_or_else(|| format!("token count {p:?} is too large"))
        })
        .collect()
}

/// An optional path argument (documented per command).
pub type PathArg = Option<PathBuf>;

fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "afdep=info,warn".into()),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    match Cli::parse().cmd {
        Cmd::Moe(a) => moe_cmd::run(a),
        Cmd::Exchange(a) => match exchange_cmd::run(a) {
            Err(e) if e.downcast_ref::<exchange_cmd::Unsupported>().is_some() => {
                eprintln!("Error: {e}");
                std::process::exit(exchange_cmd::EXIT_UNSUPPORTED);
            }
            r => r,
        },
        Cmd::ExchangeArms(a) => arms_cmd::run(a),
        Cmd::Launch(a) => launch_cmd::run(a),
        Cmd::Report(ReportCmd::Moe(a)) => Ok(report::run(a)?),
        Cmd::Report(ReportCmd::Trace(a)) => trace_report::run(a),
        Cmd::Kernels { digest } => {
            if digest {
                println!("{}", afdep_kernels::source_digest());
            } else {
                println!("kernel source digest: {}", afdep_kernels::source_digest());
            }
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_lists() {
        assert_eq!(parse_tokens("1,8, 2048").unwrap(), vec![1, 8, 2048]);
        assert_eq!(parse_tokens("16k,1M").unwrap(), vec![16384, 1 << 20]);
        assert!(parse_tokens("x").is_err());
        assert!(parse_tokens("").is_err());
        assert!(parse_tokens("99999999999999999999M").is_err());
        assert!(parse_tokens("18014398509481984M").is_err());
    }
}
