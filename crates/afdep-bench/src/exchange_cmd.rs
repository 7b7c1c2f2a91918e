//! `afdep exchange`: AFD dispatch + experts + combine rounds.
//!
//! # Engines and transports
//!
//! - the **staged engine** (host-driven, `--backend cpu`, or `auto` with a transport other than
//!   NVLink-IPC) over any transport: `--transport loopback|tcp|nvlink|nccl|ucx`;
//! - the **fused engine** (GPU-initiated stores, `--backend cuda`, or `auto` with
//!   `--transport nvlink`) over NVLink-IPC only. Its rows time each phase on the device (CUDA
//!   events on every rank's stream, [`afdep_moe::DevicePhaseTimes`]).
//!
//! # Graph mode
//!
//! `--graph` (with `--backend cuda`) times CUDA-graph replays instead of eager rounds, as the
//! reference record did: every rank prepares the fused engine's device rounds (device experts:
//! `identity` runs no expert kernel (`DeviceExperts::Identity`: the combine reads the expanded
//! rows), bit-exact against the oracle; `swiglu` as the grouped GEMM,
//! checked within the bf16 tolerance), captures one device round of `--arm` once
//! (`FusedEngine::capture`; `--arm auto` captures every arm into one graph and the device picks
//! the arm each replay by `--min-token-bucket`), and each round replays it with the token
//! count's input. The time of a round is the slowest rank's device span from a CUDA event
//! before the graph launch to one after it (after a barrier of every rank,
//! `FusedEngine::set_round_timing`); `round_us` is its median. Graph rows have `mode: graph`
//! and no per-phase times (`dispatch_us`, `combine_us` null): those come from eager rounds
//! only. `--multi-process` works the same way (each process captures its rank's graph).
//!
//! # Where the ranks run
//!
//! By default every rank is a thread of this process (`loopback`; `nvlink` as an in-process
//! group, the ranks sharing one GPU or spread over several, see `--device` and
//! `--one-gpu-per-rank`; `tcp` / `ucx` / `nccl` with each thread joining a bootstrap over
//! 127.0.0.1). With `--multi-process`, this process is one rank of a group started by `afdep
//! launch -n N` (rank, world size and rendezvous address from the environment; `nvlink` shares
//! its buffers by CUDA IPC): every process builds the same seeded problem (or reads the same
//! `--input`), runs its rank's part of every round, checks its own results against the oracle
//! bit for bit, and rank 0 prints the rows (phase times of the slowest rank, status `ok` only
//! when every rank matched).
//!
//! # Config file and arms
//!
//! `--config FILE` reads the exchange configuration and the transport from a TOML or JSON file
//! ([`crate::exchange_config`]); flags given on the command line override it. `--arm` picks the
//! dispatch arm of the engine (`auto`: the token-bucket rule per round); an arm the engine does
//! not have is an [`Unsupported`] error
//! (exit status [`EXIT_UNSUPPORTED`]), which `afdep exchange-arms` reports as an `unsupported`
//! row.
//!
//! # Output
//!
//! One JSON row per token count on stdout ([`ExchangeRow`]), and a table of them on stderr at
//! the end (`--table FILE` also writes it as markdown).

use std::cell::Cell;
use std::fmt;
use std::io::Write;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use afdep_core::oracle::LayerParams;
use afdep_core::oracle::exchange::{self as reference, SourceInput};
use afdep_core::oracle::layer;
use afdep_core::oracle::params::random_tokens;
use afdep_core::route::{Routes, route};
use afdep_core::tensor::uniform_bf16;
use afdep_core::{ExchangeConfig, ExchangeKnobs, LayerShape, PayloadKind, Topology, bf16};
use afdep_moe::{
    DeviceExperts, DeviceRoundOptions, DispatchArm, ExchangeEngine, ExchangeError, ExpertFn,
    FusedEngine, FusedGraph, RankOutcome, RoundArm, RoundOutput, StagedEngine, run_group,
};
use afdep_transport::{
    AnyTransport, Bootstrap, RendezvousEnv, Transport, TransportConfig, TransportError,
    TransportKind, TransportOptions,
};
use anyhow::{Context, Result, bail};
use clap::{Args, ValueEnum};
use indicatif::{ProgressBar, ProgressStyle};
use serde::{Deserialize, Serialize};

use crate::Backend;
use crate::exchange_config::{ExchangeFile, KnobsFile};
use crate::tensor_file::TensorFile;

/// Which transport moves the rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum TransportArg {
    /// In-process ranks as threads, host memory.
    Loopback,
    /// TCP through the bootstrap (`HostTcp`), relayed by rank 0: always available.
    Tcp,
    /// NVLink-IPC (CUDA IPC / peer access): ranks as threads sharing one GPU or on several,
    /// or one process per rank with `--multi-process`; the fused engine's transport.
    #[value(alias = "nvlink-ipc")]
    Nvlink,
    /// NCCL grouped send/recv on device memory (cargo feature `nccl`, libnccl, one GPU per rank).
    Nccl,
    /// UCX tagged messages on host memory (cargo feature `ucx`; `--ucx-tls` picks tcp or shm).
    Ucx,
}

impl TransportArg {
    /// The transport kind this names.
    pub fn kind(self) -> TransportKind {
        match self {
            TransportArg::Loopback => TransportKind::Loopback,
            TransportArg::Tcp => TransportKind::HostTcp,
            TransportArg::Nvlink => TransportKind::NvlinkIpc,
            TransportArg::Nccl => TransportKind::Nccl,
            TransportArg::Ucx => TransportKind::Ucx,
        }
    }
}

/// A dispatch arm of the exchange (brief section 4, the reference record's arms).
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, ValueEnum, Serialize, Deserialize,
)]
#[serde(rename_all = "kebab-case")]
pub enum ArmArg {
    /// Payload-first: rows into per-source slabs, then the copy epilogue (the record's `C`).
    PayloadFirst,
    /// Count-first with the streaming epilogue (the record's `CF`).
    CountFirst,
    /// Count-first, source arm: rows stored straight to their expanded positions (`CF_src`).
    CountFirstSource,
    /// The arm of the token-bucket rule, round by round (`--min-token-bucket`: count-first
    /// when the largest source's token count reaches it, payload-first below): eager rounds
    /// choose it on the host; with `--graph`, one graph holds every arm and the device chooses.
    Auto,
}

impl ArmArg {
    /// The text form (as on the command line).
    pub fn name(self) -> &'static str {
        match self {
            ArmArg::PayloadFirst => "payload-first",
            ArmArg::CountFirst => "count-first",
            ArmArg::CountFirstSource => "count-first-source",
            ArmArg::Auto => "auto",
        }
    }
}

impl fmt::Display for ArmArg {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The exchange engine a run uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EngineKind {
    /// [`StagedEngine`]: host-driven, any transport.
    Staged,
    /// [`FusedEngine`]: GPU-initiated stores over NVLink-IPC.
    Fused,
}

impl EngineKind {
    /// The name in rows and messages.
    pub fn name(self) -> &'static str {
        match self {
            EngineKind::Staged => "staged",
            EngineKind::Fused => "fused",
        }
    }

    /// The dispatch arms this engine runs today. The staged engine's one protocol is
    /// payload-first (per-source slabs, then the copy epilogue on the FFN rank). When the fused
    /// engine gains an arm, listing it here (and passing it on in [`select_arm`]) is the change.
    pub fn arms(self) -> &'static [ArmArg] {
        match self {
            EngineKind::Staged => &[ArmArg::PayloadFirst],
            EngineKind::Fused => &[
                ArmArg::PayloadFirst,
                ArmArg::CountFirst,
                ArmArg::CountFirstSource,
                ArmArg::Auto,
            ],
        }
    }

    /// The payload formats this engine moves today.
    pub fn payloads(self) -> &'static [PayloadKind] {
        match self {
            EngineKind::Staged | EngineKind::Fused => &[PayloadKind::Bf16, PayloadKind::Fp8E4m3],
        }
    }
}

/// The fused engine's arm of `arm` (`None`: the rule).
fn dispatch_arm(arm: ArmArg) -> Option<DispatchArm> {
    match arm {
        ArmArg::PayloadFirst => Some(DispatchArm::PayloadFirst),
        ArmArg::CountFirst => Some(DispatchArm::CountFirst),
        ArmArg::CountFirstSource => Some(DispatchArm::CountFirstSource),
        ArmArg::Auto => None,
    }
}

/// Tells the fused engine which arm to run (every round, on every rank; `auto`: the rule);
/// only arms in [`EngineKind::arms`] reach it.
fn select_arm(eng: &mut FusedEngine, arm: ArmArg) -> Result<()> {
    eng.set_arm(dispatch_arm(arm));
    Ok(())
}

/// The arm of a captured graph for `arm` (`auto`: every arm, chosen on the device).
fn round_arm(arm: ArmArg) -> RoundArm {
    dispatch_arm(arm).map_or(RoundArm::Auto, RoundArm::Fixed)
}

/// The exit status of `afdep exchange` when it was asked for an arm or a payload that its engine
/// does not support ([`Unsupported`]).
pub const EXIT_UNSUPPORTED: i32 = 3;

/// An arm or payload the engine does not support (yet).
#[derive(Debug, thiserror::Error)]
#[error("unsupported: the {engine} engine has no {what} (it runs: {have})")]
pub struct Unsupported {
    /// The engine.
    pub engine: &'static str,
    /// What was asked for (`arm count-first`, `payload fp8_e4m3`).
    pub what: String,
    /// What it supports.
    pub have: String,
}

/// Payload formats on the command line.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum PayloadArg {
    /// bf16 rows.
    Bf16,
    /// fp8 e4m3 rows, one f32 scale per 128 channels per token.
    #[value(alias = "fp8-e4m3")]
    Fp8,
}

impl From<PayloadArg> for PayloadKind {
    fn from(p: PayloadArg) -> PayloadKind {
        match p {
            PayloadArg::Bf16 => PayloadKind::Bf16,
            PayloadArg::Fp8 => PayloadKind::Fp8E4m3,
        }
    }
}

/// A fault injected for tests of the failure paths: `reject@R:N` (attention rank R's routes of
/// timed round N get an expert id past the last expert: every rank must report that rank's
/// rejection and the next round must run) or `abort@R:N` (rank R aborts its process in timed
/// round N: inside its experts when it is an FFN rank, so mid-round; before the round
/// otherwise; `--multi-process` only).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// A rejected route on one rank.
    Reject {
        /// The (attention) rank.
        rank: usize,
        /// The timed round.
        round: usize,
    },
    /// A process that dies mid-round.
    Abort {
        /// The rank.
        rank: usize,
        /// The timed round.
        round: usize,
    },
}

impl FromStr for Fault {
    type Err = String;

    fn from_str(s: &str) -> Result<Fault, String> {
        let bad = || format!("bad fault {s:?}: expected reject@RANK:ROUND or abort@RANK:ROUND");
        let (what, at) = s.split_once('@').ok_or_else(bad)?;
        let (r, n) = at.split_once(':').ok_or_else(bad)?;
        let rank = r.trim().parse().map_err(|_| bad())?;
        let round = n.trim().parse().map_err(|_| bad())?;
        match what.trim() {
            "reject" => Ok(Fault::Reject { rank, round }),
            "abort" => Ok(Fault::Abort { rank, round }),
            _ => Err(bad()),
        }
    }
}

/// What the FFN ranks compute.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ExpertArg {
    /// The layer's SwiGLU experts (random parameters from the seed, or `w1`, `w3`, `w2` from `--input`).
    Swiglu,
    /// Each expert returns its rows unchanged (measures the exchange alone).
    Identity,
}

/// Arguments of `afdep exchange`.
#[derive(Debug, Clone, Args)]
pub struct ExchangeArgs {
    /// Where to run: `cuda` is the fused engine (needs `--transport nvlink`), `cpu` the staged
    /// engine (any transport), `auto` the fused engine over nvlink and the staged one otherwise.
    #[arg(long, value_enum, default_value = "auto")]
    pub backend: Backend,
    /// A TOML or JSON file with the exchange configuration and the transport (see
    /// `exchange_config`); the flags below override it.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// The transport [default: the config file's, else loopback].
    #[arg(long, value_enum)]
    pub transport: Option<TransportArg>,
    /// The dispatch arm (an arm the engine does not have fails with exit status 3).
    #[arg(long, value_enum, default_value = "payload-first")]
    pub arm: ArmArg,
    /// Time CUDA-graph replays instead of eager rounds (`--backend cuda` only): every rank
    /// captures one device round of the arm once (`auto`: one graph of every arm, the arm
    /// chosen on the device each replay), then replays it with each token count's input; a
    /// row's `round_us` is the median over its rounds of the slowest rank's device time of the
    /// whole replay (CUDA events around the graph launch, after a barrier). Per-phase times come
    /// from eager rounds only (`dispatch_us` and `combine_us` are null in graph rows). The
    /// experts run on the device (`identity`: bit-exact; `swiglu`: the grouped GEMM, checked
    /// within the bf16 tolerance).
    #[arg(long)]
    pub graph: bool,
    /// Ranks: `3A:1F`, `2A:2F`, `1A:3F`, or `EP4` (classic expert parallelism) [default: 3A:1F].
    #[arg(long)]
    pub topology: Option<Topology>,
    /// Tokens per attention rank, comma-separated; one row per count. Ignored with `--input`.
    #[arg(long, default_value = "1,8,32,128,512,1024,2048")]
    pub tokens: crate::TokenList,
    /// Hidden size [default: 2048].
    #[arg(long)]
    pub hidden: Option<usize>,
    /// Number of experts [default: 128].
    #[arg(long)]
    pub experts: Option<usize>,
    /// Experts per FFN rank (default: experts / FFN ranks, rounded down; ids beyond the
    /// placed experts are "dummy" and rejected).
    #[arg(long)]
    pub experts_per_rank: Option<usize>,
    /// Slots per token [default: 8].
    #[arg(long)]
    pub top_k: Option<usize>,
    /// Width of the SwiGLU experts.
    #[arg(long, default_value_t = 128)]
    pub width: usize,
    /// Most tokens per attention rank [default: 2048].
    #[arg(long)]
    pub capacity: Option<usize>,
    /// Dispatch payload [default: bf16].
    #[arg(long, value_enum)]
    pub payload: Option<PayloadArg>,
    /// Knob: SMs of the dispatch and combine kernels [default: 24].
    #[arg(long)]
    pub transport_sms: Option<u32>,
    /// Knob: most SMs of the epilogue [default: 16].
    #[arg(long)]
    pub epilogue_sm_cap: Option<u32>,
    /// Knob: the epilogue's payload gate, `true` or `false` [default: true].
    #[arg(long)]
    pub payload_gate: Option<bool>,
    /// Knob: warps per epilogue work unit [default: 4].
    #[arg(long)]
    pub warps_per_unit: Option<u32>,
    /// Knob: minimum rows per epilogue work unit [default: 8].
    #[arg(long)]
    pub min_rows_per_unit: Option<u32>,
    /// Knob: the smallest largest-source token count that uses count-first [default: 2048].
    #[arg(long)]
    pub min_token_bucket: Option<usize>,
    /// The FFN computation.
    #[arg(long, value_enum, default_value = "swiglu")]
    pub expert: ExpertArg,
    /// Timed rounds per token count (the median is reported).
    #[arg(long, default_value_t = 5)]
    pub rounds: usize,
    /// Untimed rounds before the timed ones, per token count.
    #[arg(long, default_value_t = 1)]
    pub warmup: usize,
    /// Run as one rank of a group started by `afdep launch` (rank, world size and rendezvous
    /// from the environment); rank 0 prints the rows.
    #[arg(long)]
    pub multi_process: bool,
    /// UCX: the UCX transports (`tcp`, `shm`, `tcp,shm`; default: UCX's choice / `UCX_TLS`).
    #[arg(long)]
    pub ucx_tls: Option<String>,
    /// NCCL, nvlink, device buffers: the CUDA device of every rank (default: rank modulo the
    /// device count).
    #[arg(long)]
    pub device: Option<usize>,
    /// nvlink: rank r on GPU r (refused when the machine has fewer GPUs than ranks); without
    /// it, nvlink ranks may share a GPU.
    #[arg(long)]
    pub one_gpu_per_rank: bool,
    /// tcp, ucx: device buffers (CUDA device `--device`) staged through host memory
    /// (cargo feature `cuda`, implied by `nccl`).
    #[arg(long)]
    pub device_buffers: bool,
    /// Inject a fault (tests): `reject@RANK:ROUND` or `abort@RANK:ROUND`.
    #[arg(long)]
    pub fault: Option<Fault>,
    /// Also append the rows to this JSONL file.
    #[arg(long)]
    pub json_out: Option<PathBuf>,
    /// Also write the table of the rows to this markdown file.
    #[arg(long)]
    pub table: Option<PathBuf>,
    /// Seed of tokens, router and experts.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Bound on every transport wait, in milliseconds [default: the config file's, else 30000].
    #[arg(long)]
    pub timeout_ms: Option<u64>,
    /// Read per-rank `x.r`, `topk_idx.r`, `topk_weights.r` (and optionally `w1`, `w3`, `w2`).
    #[arg(long)]
    pub input: Option<PathBuf>,
    /// Write per-rank outputs `y.r`.
    #[arg(long)]
    pub output: Option<PathBuf>,
    /// Skip the comparison with the oracle's exchange reference.
    #[arg(long)]
    pub no_verify: bool,
}

/// What a run uses once the config file, the flags and the defaults are merged.
#[derive(Debug, Clone)]
pub struct Resolved {
    /// The exchange configuration (validated).
    pub cfg: ExchangeConfig,
    /// The transport kind.
    pub kind: TransportKind,
    /// Its options (with `--timeout-ms` and the device flags applied).
    pub options: TransportOptions,
    /// The engine.
    pub engine: EngineKind,
}

impl ExchangeArgs {
    /// Merges the config file (if any), the flags and the defaults, checks the result, and
    /// picks the engine. Errors name the file and field, or the flag.
    pub fn resolve(&self) -> Result<Resolved> {
        let file = match &self.config {
            Some(p) => ExchangeFile::read(p)?,
            None => ExchangeFile::default(),
        };
        let topology = self
            .topology
            .or(file.topology)
            .unwrap_or_else(|| "3A:1F".parse().expect("a topology"));
        let experts = self.experts.or(file.experts).unwrap_or(128);
        let mut knobs = ExchangeKnobs::default();
        file.knobs.apply(
            &KnobsFile {
                min_token_bucket: self.min_token_bucket,
                epilogue_sm_cap: self.epilogue_sm_cap,
                payload_gate: self.payload_gate,
                warps_per_unit: self.warps_per_unit,
                min_rows_per_unit: self.min_rows_per_unit,
                transport_sms: self.transport_sms,
            },
            &mut knobs,
        );
        let cfg = ExchangeConfig {
            topology,
            hidden: self.hidden.or(file.hidden).unwrap_or(2048),
            experts,
            experts_per_rank: self
                .experts_per_rank
                .or(file.experts_per_rank)
                .unwrap_or(experts / topology.ffn_count().max(1)),
            top_k: self.top_k.or(file.top_k).unwrap_or(8),
            capacity: self.capacity.or(file.capacity).unwrap_or(2048),
            payload: self
                .payload
                .map(PayloadKind::from)
                .or(file.payload)
                .unwrap_or_default(),
            knobs,
        };
        cfg.validate().map_err(|e| match &self.config {
            Some(p) => anyhow::Error::new(crate::exchange_config::ConfigFileError::Invalid {
                path: p.clone(),
                source: e,
            }),
            None => anyhow::Error::new(e),
        })?;
        let file_transport = file
            .transport
            .clone()
            .unwrap_or(TransportConfig::Kind(TransportKind::Loopback));
        let kind = self
            .transport
            .map_or(file_transport.kind(), TransportArg::kind);
        let mut options = file_transport.options();
        if let Some(ms) = self.timeout_ms {
            options.timeout = Duration::from_millis(ms);
        }
        if self.ucx_tls.is_some() {
            options.ucx_tls = self.ucx_tls.clone();
        }
        if self.device.is_some() {
            options.device = self.device;
        }
        options.device_buffers |= self.device_buffers;
        options.one_gpu_per_rank |= self.one_gpu_per_rank;
        let engine = match (self.backend, kind) {
            (Backend::Cuda, TransportKind::NvlinkIpc) => EngineKind::Fused,
            (Backend::Cuda, other) => bail!(
                "--backend cuda is the fused engine, which runs over NVLink-IPC only: use \
                 --transport nvlink (or --backend cpu for the staged engine over {other})"
            ),
            (Backend::Auto, TransportKind::NvlinkIpc) => EngineKind::Fused,
            _ => EngineKind::Staged,
        };
        let file_sets = |f: fn(&afdep_transport::TransportTable) -> bool| matches!(&file.transport, Some(TransportConfig::Table(t)) if f(t));
        if kind == TransportKind::NvlinkIpc {
            // size the windows for this config unless the file set them
            if !file_sets(|t| t.workspace_bytes.is_some()) {
                options.workspace_bytes = match engine {
                    EngineKind::Fused => FusedEngine::workspace_bytes(&cfg).div_ceil(256) * 256,
                    EngineKind::Staged => 256,
                };
            }
            if !file_sets(|t| t.staging_bytes.is_some()) {
                options.staging_bytes = match engine {
                    EngineKind::Fused => 256,
                    EngineKind::Staged => staged_recv_bytes(&cfg).div_ceil(256) * 256,
                };
            }
        }
        Ok(Resolved {
            cfg,
            kind,
            options,
            engine,
        })
    }
}

/// The most bytes one rank of the staged engine receives in one all-to-all-v of `cfg`: an FFN
/// rank's dispatch (every source's capacity of tokens with their ids and weights) or a source's
/// combine (capacity × top-k rows).
fn staged_recv_bytes(cfg: &ExchangeConfig) -> usize {
    let (h, k, cap) = (cfg.hidden, cfg.top_k, cfg.capacity);
    let sources = cfg.topology.attention_count();
    let dispatch = sources * cap * (2 * h + 4 + 8 * k);
    let combine = cap * k * 2 * h;
    dispatch.max(combine).max(1)
}

/// One JSON row.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ExchangeRow {
    /// Topology.
    pub topology: String,
    /// Engine: `staged` or `fused`.
    pub engine: String,
    /// The dispatch arm.
    pub arm: String,
    /// Transport.
    pub transport: String,
    /// `threads` (ranks as threads of one process) or `processes` (`--multi-process`).
    pub ranks_as: String,
    /// UCX transports asked for (`--ucx-tls`), if any.
    pub ucx_tls: Option<String>,
    /// Whether the engine's buffers were device memory (`nccl`, `nvlink`, or
    /// `--device-buffers`).
    pub device_buffers: bool,
    /// Hidden size.
    pub hidden: usize,
    /// Experts.
    pub experts: usize,
    /// Top-k.
    pub top_k: usize,
    /// Capacity.
    pub capacity: usize,
    /// Payload.
    pub payload: String,
    /// The transport SM budget (knob).
    pub transport_sms: u32,
    /// Tokens on each attention rank.
    pub tokens: Vec<usize>,
    /// FFN computation.
    pub expert: String,
    /// Rounds timed (rejected rounds included).
    pub rounds: usize,
    /// Untimed warm-up rounds before them.
    pub warmup: usize,
    /// Timed rounds rejected as injected (`--fault reject@..`), left out of the times.
    pub rejected_rounds: usize,
    /// How `round_us`, `dispatch_us` and `combine_us` were taken: `device` (fused engine: CUDA
    /// events on every rank's stream, each phase aligned by a barrier; per round, the slowest
    /// rank's dispatch plus the slowest rank's combine; with `mode` `graph`, the slowest rank's
    /// whole replay) or `host` (staged engine: wall time of the whole round, experts included,
    /// and of each phase, slowest rank).
    pub timing: String,
    /// `eager` (rounds launched kernel by kernel from the host) or `graph` (`--graph`: replays
    /// of a captured device round; no per-phase times).
    #[serde(default = "eager")]
    pub mode: String,
    /// Median time of a round, µs (see `timing`).
    pub round_us: f64,
    /// Median wall time of a whole round on the host (slowest rank), µs.
    pub wall_us: f64,
    /// Median host time of the status + count phase (slowest rank), µs.
    pub counts_us: f64,
    /// Median dispatch phase (slowest rank), µs; `null` in graph mode (per-phase times come from
    /// eager rounds only).
    pub dispatch_us: Option<f64>,
    /// Median host time of the experts (slowest rank), µs.
    pub experts_us: f64,
    /// Median combine phase (slowest rank), µs; `null` in graph mode.
    pub combine_us: Option<f64>,
    /// `ok`, `mismatch` (against the oracle), or `unverified`.
    pub status: String,
    /// Digest of the kernel sources.
    pub kernel_digest: String,
    /// The process that printed the row (the arms runner checks its arms ran apart).
    pub pid: u32,
}

/// The `mode` of rows written before it existed.
fn eager() -> String {
    "eager".into()
}

struct Problem {
    cfg: ExchangeConfig,
    inputs: Vec<SourceInput>,
    params: Option<LayerParams>,
}

/// The expert parameters a fused rank is built with: the first problem's. A `--graph` run
/// captures its device experts once, so there every problem must carry the same parameters
/// (or none); eager rounds take each problem's own experts.
fn rank_params(probs: &[Problem], graph: bool) -> Result<Option<&LayerParams>> {
    let first = probs.first().and_then(|p| p.params.as_ref());
    if graph && probs.iter().any(|p| p.params.as_ref() != first) {
        bail!(
            "--graph captures the device experts once: every --input must carry the same \
             SwiGLU parameters (w1, w3, w2), or none"
        );
    }
    Ok(first)
}

fn generate(a: &ExchangeArgs, cfg: &ExchangeConfig, tokens: usize) -> Result<Vec<SourceInput>> {
    let shape = LayerShape {
        d_model: cfg.hidden,
        width: 1,
        experts: cfg.experts,
        top_k: cfg.top_k,
        shared: 0,
        renormalize: true,
    };
    let wr = uniform_bf16(
        cfg.hidden * cfg.experts,
        1.0 / (cfg.hidden as f32).sqrt(),
        a.seed,
        1,
    );
    let owned = cfg.placement().owned();
    Ok((0..cfg.topology.attention_count())
        .map(|s| {
            let x = random_tokens(tokens, cfg.hidden, a.seed.wrapping_add(1000 + s as u64));
            let mut routes = route(&x, &wr, tokens, &shape);
            // the router may pick unplaced experts when experts_per_rank leaves some out:
            // mask those slots
            for e in routes.idx.iter_mut() {
                if *e as usize >= owned {
                    *e = -1;
                }
            }
            SourceInput { x, routes }
        })
        .collect())
}

fn read_problem(
    path: &Path,
    a: &ExchangeArgs,
    cfg: &ExchangeConfig,
) -> Result<(Vec<SourceInput>, Option<LayerParams>)> {
    let f = TensorFile::read(path)?;
    let mut inputs = Vec::new();
    for s in 0..cfg.topology.attention_count() {
        let (xs, x) = f.bf16(&format!("x.{s}"))?;
        let (is, idx) = f.i32(&format!("topk_idx.{s}"))?;
        let (_, weights) = f.f32(&format!("topk_weights.{s}"))?;
        if xs.len() != 2
            || xs[1] != cfg.hidden
            || is.len() != 2
            || is[1] != cfg.top_k
            || is[0] != xs[0]
        {
            bail!(
                "rank {s}: x.{s} is {xs:?} and topk_idx.{s} is {is:?}; need T × {} and T × {}",
                cfg.hidden,
                cfg.top_k
            );
        }
        let routes = Routes::new(xs[0], cfg.top_k, idx, weights)?;
        inputs.push(SourceInput { x, routes });
    }
    let params = if f.has("w1") {
        let shape = LayerShape {
            d_model: cfg.hidden,
            width: f.bf16("w1")?.0.get(2).copied().unwrap_or(a.width),
            experts: cfg.experts,
            top_k: cfg.top_k,
            shared: 0,
            renormalize: true,
        };
        let mut p = LayerParams::random(shape, 0);
        p.w1 = f.bf16("w1")?.1;
        p.w3 = f.bf16("w3")?.1;
        p.w2 = f.bf16("w2")?.1;
        p.wr = vec![bf16::ZERO; shape.d_model * shape.experts];
        p.check()?;
        Some(p)
    } else {
        None
    };
    Ok((inputs, params))
}

fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Times of one timed round on one rank, µs.
#[derive(Debug, Clone, Copy, Default)]
struct RoundTimes {
    /// Host wall time of the whole round.
    wall: f64,
    /// Host: status + counts.
    counts: f64,
    /// Dispatch (device with the fused engine, host with the staged one).
    dispatch: f64,
    /// Host: experts.
    experts: f64,
    /// Combine (device with the fused engine, host with the staged one).
    combine: f64,
    /// The whole round on the device, where the engine times it as one span (graph replays;
    /// NaN otherwise).
    round: f64,
}

impl RoundTimes {
    const N: usize = 6;

    fn to_array(self) -> [f64; Self::N] {
        [
            self.wall,
            self.counts,
            self.dispatch,
            self.experts,
            self.combine,
            self.round,
        ]
    }

    fn from_array(v: [f64; Self::N]) -> RoundTimes {
        RoundTimes {
            wall: v[0],
            counts: v[1],
            dispatch: v[2],
            experts: v[3],
            combine: v[4],
            round: v[5],
        }
    }
}

/// What one rank got from the rounds of one problem.
struct RankRun {
    /// The output of the last round that was not rejected.
    last: Option<RoundOutput>,
    /// Per timed, not rejected round.
    times: Vec<RoundTimes>,
    /// Timed rounds rejected as injected.
    rejected: usize,
}

/// The expert function of `prob`.
fn expert_of(prob: &Problem, expert: ExpertArg, e: usize, rows: &[bf16], n: usize) -> Vec<bf16> {
    match (expert, &prob.params) {
        (ExpertArg::Swiglu, Some(p)) => {
            layer::expert_rows(p, e, rows, n).expect("validated expert input")
        }
        _ => rows.to_vec(),
    }
}

/// Checks that `fault` can happen in `prob` under this mode.
fn check_fault(fault: Option<Fault>, prob: &Problem, multi_process: bool) -> Result<()> {
    let topo = prob.cfg.topology;
    match fault {
        None => {}
        Some(Fault::Reject { rank, .. }) => {
            let Some(s) = topo.attention_index(rank) else {
                bail!("--fault reject@{rank}: rank {rank} is not an attention rank of {topo}");
            };
            if prob.inputs[s].routes.tokens == 0 || prob.cfg.top_k == 0 {
                bail!("--fault reject@{rank}: rank {rank} has no token to reject");
            }
        }
        Some(Fault::Abort { rank, .. }) => {
            if !multi_process {
                bail!("--fault abort@..: only with --multi-process (it ends the process)");
            }
            if rank >= topo.world_size() {
                bail!("--fault abort@{rank}: no rank {rank} in {topo}");
            }
        }
    }
    Ok(())
}

/// Runs `warmup + rounds` rounds of `prob` on this rank's engine (faults applied), a barrier
/// before each.
fn rank_rounds(
    eng: &mut dyn ExchangeEngine,
    prob: &Problem,
    expert: ExpertArg,
    warmup: usize,
    rounds: usize,
    fault: Option<Fault>,
) -> Result<RankRun> {
    let rank = eng.rank();
    let topo = prob.cfg.topology;
    let input = topo.attention_index(rank).map(|s| &prob.inputs[s]);
    let abort_in_experts = Cell::new(false);
    let f = |e: usize, rows: &[bf16], n: usize| {
        if abort_in_experts.get() {
            eprintln!("rank {rank}: aborting mid-round as injected (--fault)");
            std::process::abort();
        }
        expert_of(prob, expert, e, rows, n)
    };
    let mut run = RankRun {
        last: None,
        times: Vec::with_capacity(rounds),
        rejected: 0,
    };
    for i in 0..warmup + rounds {
        let timed = i.checked_sub(warmup);
        let mut rejecting = None;
        let mut bad_input;
        let mut this_input = input;
        match fault {
            Some(Fault::Abort { rank: r, round }) if r == rank && timed == Some(round) => {
                if topo.ffn_index(rank).is_some() {
                    abort_in_experts.set(true);
                } else {
                    eprintln!("rank {rank}: aborting before round {round} as injected (--fault)");
                    std::process::abort();
                }
            }
            Some(Fault::Reject { rank: r, round }) if timed == Some(round) => {
                let s = topo
                    .attention_index(r)
                    .context("checked: an attention rank")?;
                rejecting = Some(s);
                if r == rank {
                    bad_input = input.cloned().context("an attention rank has input")?;
                    bad_input.routes.idx[0] = prob.cfg.experts as i32;
                    this_input = Some(&bad_input);
                }
            }
            _ => {}
        }
        eng.barrier()?;
        let t0 = Instant::now();
        let res = eng.round(this_input, &f);
        let total = t0.elapsed().as_secs_f64() * 1e6;
        if let Some(s) = rejecting {
            match res {
                Err(ExchangeError::Route { error, .. }) if error.rank() == s => {
                    eprintln!("rank {rank}: round {i} rejected as injected: {error}");
                    run.rejected += 1;
                    continue;
                }
                Err(e) => {
                    return Err(e).context(format!(
                        "rank {rank}: the injected rejection of rank {s} gave another error"
                    ));
                }
                Ok(_) => bail!("rank {rank}: the injected bad route of rank {s} was accepted"),
            }
        }
        let out = res?;
        if abort_in_experts.get() {
            // an FFN rank whose experts had no row this round: end here instead
            eprintln!("rank {rank}: aborting after round {i} as injected (--fault)");
            std::process::abort();
        }
        if timed.is_some() {
            let us = |d: Duration| d.as_secs_f64() * 1e6;
            let (dispatch, combine) = eng
                .device_times()
                .map_or((us(out.times.dispatch), us(out.times.combine)), |t| {
                    (us(t.dispatch), us(t.combine))
                });
            run.times.push(RoundTimes {
                wall: total,
                counts: us(out.times.counts),
                dispatch,
                experts: us(out.times.experts),
                combine,
                round: eng.round_time().map_or(f64::NAN, us),
            });
        }
        run.last = Some(out);
    }
    Ok(run)
}

/// Per-round slowest-rank times of every rank's runs (rounds align: rejected rounds are left
/// out on every rank alike), each column on its own.
fn slowest(per_rank: &[Vec<RoundTimes>]) -> Vec<RoundTimes> {
    let n = per_rank.iter().map(Vec::len).min().unwrap_or(0);
    (0..n)
        .map(|i| {
            let mut acc = [0f64; RoundTimes::N];
            for t in per_rank {
                for (a, v) in acc.iter_mut().zip(t[i].to_array()) {
                    *a = a.max(v);
                }
            }
            RoundTimes::from_array(acc)
        })
        .collect()
}

/// Runs the rounds of `prob` with one thread per rank, each building its transport with
/// `make(rank)` inside its thread; returns each rank's run (staged engine).
fn run_threads(
    a: &ExchangeArgs,
    prob: &Problem,
    make: impl Fn(usize) -> Result<AnyTransport> + Sync,
) -> Result<Vec<RankRun>> {
    let world = prob.cfg.topology.world_size();
    let outcomes = run_group(
        (0..world).collect(),
        |rank, _| -> Result<StagedEngine<AnyTransport>> {
            Ok(StagedEngine::new(prob.cfg.clone(), make(rank)?)?)
        },
        |_, eng| rank_rounds(eng, prob, a.expert, a.warmup, a.rounds, a.fault),
    );
    by_rank(outcomes)
}

/// Each rank's result of a [`run_group`], in rank order: the first rank's error (with its
/// rank) or panic fails the run.
fn by_rank<R>(outcomes: Vec<RankOutcome<R, anyhow::Error>>) -> Result<Vec<R>> {
    outcomes
        .into_iter()
        .enumerate()
        .map(|(rank, r)| {
            r.map_err(|_| anyhow::anyhow!("a rank thread panicked"))?
                .with_context(|| format!("rank {rank}"))
        })
        .collect()
}

/// The transports of a threaded staged run: an in-process group (Loopback, NvlinkIpc), or one
/// bootstrap per thread over 127.0.0.1 and the kind's transport over it.
fn run_threaded(a: &ExchangeArgs, res: &Resolved, prob: &Problem) -> Result<Vec<RankRun>> {
    let world = prob.cfg.topology.world_size();
    let (kind, opts) = (res.kind, &res.options);
    if matches!(kind, TransportKind::Loopback | TransportKind::NvlinkIpc) {
        let group: Vec<Mutex<Option<AnyTransport>>> = AnyTransport::group(kind, world, opts)?
            .into_iter()
            .map(|t| Mutex::new(Some(t)))
            .collect();
        return run_threads(a, prob, |r| {
            group[r]
                .lock()
                .expect("unpoisoned")
                .take()
                .context("rank built twice")
        });
    }
    let any: SocketAddr = "127.0.0.1:0".parse().expect("literal address");
    let listener = Mutex::new(Some(Bootstrap::listen(any, world, opts.timeout)?));
    let addr = listener
        .lock()
        .expect("unpoisoned")
        .as_ref()
        .expect("bound")
        .local_addr();
    run_threads(a, prob, |r| {
        let boot = if r == 0 {
            let l = listener
                .lock()
                .expect("unpoisoned")
                .take()
                .context("rank 0 built twice")?;
            l.accept()?
        } else {
            Bootstrap::connect(addr, r, world, opts.timeout)?
        };
        Ok(AnyTransport::connect(kind, boot, opts)?)
    })
}

/// A fused engine on this rank's NvlinkIpc transport, with phase timing on and `arm` selected.
fn fused_engine(cfg: &ExchangeConfig, t: AnyTransport, arm: ArmArg) -> Result<FusedEngine> {
    let t = t
        .into_nvlink()
        .map_err(|t| anyhow::anyhow!("the fused engine needs nvlink, got {}", t.kind()))?;
    let mut eng = FusedEngine::new(cfg.clone(), t)?;
    eng.set_phase_timing(true)?;
    select_arm(&mut eng, arm)?;
    Ok(eng)
}

/// One rank of a `--graph` run: its fused engine with device rounds prepared and round timing
/// on, and the graph of the run's arm, captured once; each round replays it.
struct GraphRank {
    // dropped before the engine whose buffers it uses
    graph: FusedGraph,
    eng: FusedEngine,
}

/// A [`GraphRank`] on this rank's NvlinkIpc transport: device experts from `expert` (the
/// identity with no expert kernel, exact; or the SwiGLU experts of `params`), the arm selected
/// (`auto`: the rule, on the device), then the capture (collective).
fn graph_rank(
    cfg: &ExchangeConfig,
    t: AnyTransport,
    arm: ArmArg,
    expert: ExpertArg,
    params: Option<&LayerParams>,
) -> Result<GraphRank> {
    let t = t
        .into_nvlink()
        .map_err(|t| anyhow::anyhow!("the fused engine needs nvlink, got {}", t.kind()))?;
    let mut eng = FusedEngine::new(cfg.clone(), t)?;
    let experts = match (expert, params) {
        (ExpertArg::Swiglu, Some(p)) => DeviceExperts::SwiGlu(std::sync::Arc::new(p.clone())),
        (ExpertArg::Swiglu, None) => bail!("--expert swiglu without expert parameters"),
        (ExpertArg::Identity, _) => DeviceExperts::Identity,
    };
    eng.prepare_device(DeviceRoundOptions {
        experts,
        keep_received: false,
    })?;
    eng.set_round_timing(true)?;
    select_arm(&mut eng, arm)?;
    let graph = eng.capture(round_arm(arm))?;
    Ok(GraphRank { graph, eng })
}

impl ExchangeEngine for GraphRank {
    fn rank(&self) -> usize {
        self.eng.rank()
    }
    fn round(
        &mut self,
        input: Option<&SourceInput>,
        _expert: &dyn ExpertFn,
    ) -> Result<RoundOutput, ExchangeError> {
        self.eng.replay(&self.graph, input)
    }
    fn barrier(&mut self) -> Result<(), TransportError> {
        self.eng.transport_mut().barrier()
    }
    fn all_gather(&mut self, mine: &[u8]) -> Result<Vec<u8>, TransportError> {
        self.eng.transport_mut().all_gather(mine)
    }
    fn round_time(&self) -> Option<Duration> {
        self.eng.last_round_time()
    }
}

/// This rank's fused engine of the run: eager rounds ([`fused_engine`]), or with `--graph`
/// graph replays ([`graph_rank`], device experts from `params`).
fn fused_rank(
    a: &ExchangeArgs,
    cfg: &ExchangeConfig,
    t: AnyTransport,
    params: Option<&LayerParams>,
) -> Result<Box<dyn ExchangeEngine>> {
    Ok(match a.graph {
        true => Box::new(graph_rank(cfg, t, a.arm, a.expert, params)?),
        false => Box::new(fused_engine(cfg, t, a.arm)?),
    })
}

/// Whether a rank's combined rows match the oracle's: bit for bit, except the device SwiGLU
/// experts of graph mode (the grouped GEMM), which must be within the layer output's bf16
/// tolerance ([`afdep_moe::accuracy::OUT_TOL`]).
fn matches_reference(a: &ExchangeArgs, got: &[bf16], want: &[bf16]) -> bool {
    match (a.graph, a.expert) {
        (true, ExpertArg::Swiglu) => {
            got.len() == want.len()
                && afdep_moe::accuracy::max_rel_err(got, want) <= afdep_moe::accuracy::OUT_TOL
        }
        _ => got == want,
    }
}

/// The checks of `--graph` against the other flags (a clear error).
fn check_graph(a: &ExchangeArgs) -> Result<()> {
    if !a.graph {
        return Ok(());
    }
    if a.backend != Backend::Cuda {
        bail!(
            "--graph replays CUDA graphs of the fused engine's device rounds: it needs \
             --backend cuda (with --transport nvlink)"
        );
    }
    if let Some(Fault::Abort { .. }) = a.fault {
        bail!("--fault abort@..: not with --graph (the experts run on the device)");
    }
    Ok(())
}

/// A threaded fused run: one in-process NvlinkIpc group and one engine per rank thread for all
/// the problems (set up once: windows, kernel loads, the graph); returns `[problem][rank]`. No
/// engine is dropped before every rank has finished (see the fused engine's docs).
fn run_fused_threads(
    a: &ExchangeArgs,
    res: &Resolved,
    probs: &[Problem],
    bar: &ProgressBar,
) -> Result<Vec<Vec<RankRun>>> {
    let world = res.cfg.topology.world_size();
    let group = AnyTransport::group(res.kind, world, &res.options)?;
    let outcomes = run_group(
        group,
        |_, t| fused_rank(a, &res.cfg, t, rank_params(probs, a.graph)?),
        |rank, eng| {
            let mut out = Vec::with_capacity(probs.len());
            for prob in probs {
                out.push(rank_rounds(
                    eng.as_mut(),
                    prob,
                    a.expert,
                    a.warmup,
                    a.rounds,
                    a.fault,
                )?);
                if rank == 0 {
                    bar.inc(1);
                }
            }
            Ok(out)
        },
    );
    let per_rank: Vec<Vec<RankRun>> = by_rank(outcomes)?;
    // transpose to [problem][rank]
    let mut out: Vec<Vec<RankRun>> = (0..probs.len()).map(|_| Vec::new()).collect();
    for runs in per_rank {
        for (p, run) in runs.into_iter().enumerate() {
            out[p].push(run);
        }
    }
    Ok(out)
}

/// The oracle's combined rows of every attention rank.
fn reference_of(prob: &Problem, expert: ExpertArg) -> Result<Vec<Vec<bf16>>> {
    Ok(reference::exchange(
        &prob.cfg,
        &prob.inputs,
        |e, rows: &[bf16], n| expert_of(prob, expert, e, rows, n),
    )?)
}

/// A short name of a failed round's error, for the log: the transport error's kind when it is
/// one (`Timeout`, `PeerGone`, ...).
fn error_class(e: &anyhow::Error) -> &'static str {
    for c in e.chain() {
        let t = c.downcast_ref::<TransportError>().or_else(|| {
            match c.downcast_ref::<ExchangeError>() {
                Some(ExchangeError::Transport(t)) => Some(t),
                _ => None,
            }
        });
        if let Some(t) = t {
            return match t {
                TransportError::Timeout { .. } => "Timeout",
                TransportError::PeerGone { .. } => "PeerGone",
                TransportError::PeerFailed { .. } => "PeerFailed",
                TransportError::SizeMismatch { .. } => "SizeMismatch",
                TransportError::Closed { .. } => "Closed",
                TransportError::Unavailable { .. } => "Unavailable",
                _ => "TransportError",
            };
        }
    }
    "error"
}

/// One rank's part of a problem in a multi-process group: its rounds, its own check against
/// the oracle, and every rank's times gathered (the slowest rank's per round).
fn multi_process_problem(
    a: &ExchangeArgs,
    eng: &mut dyn ExchangeEngine,
    prob: &Problem,
    world: usize,
) -> Result<(Vec<RoundTimes>, usize)> {
    let me = eng.rank();
    let run = rank_rounds(eng, prob, a.expert, a.warmup, a.rounds, a.fault).map_err(|e| {
        let class = error_class(&e);
        e.context(format!("rank {me}: round failed ({class})"))
    })?;
    // 0: unverified, 1: ok, 2: mismatch
    let verdict: u8 = match prob.cfg.topology.attention_index(me) {
        _ if a.no_verify => 0,
        None => 1,
        Some(s) => {
            let got = run.last.as_ref().and_then(|o| o.combined.as_ref());
            let want = &reference_of(prob, a.expert)?[s];
            if got.is_some_and(|g| matches_reference(a, g, want)) {
                1
            } else {
                2
            }
        }
    };
    let mut blob = vec![verdict];
    blob.extend((run.times.len() as u64).to_ne_bytes());
    for t in &run.times {
        for v in t.to_array() {
            blob.extend(v.to_ne_bytes());
        }
    }
    let lens = eng.all_gather(&(blob.len() as u64).to_ne_bytes())?;
    let max = lens
        .chunks_exact(8)
        .map(|c| u64::from_ne_bytes(c.try_into().expect("8 bytes")))
        .max()
        .unwrap_or(0) as usize;
    blob.resize(max, 0);
    let all = eng.all_gather(&blob)?;
    let mut times = Vec::with_capacity(world);
    let mut bad = Vec::new();
    let w = 8 * RoundTimes::N;
    for (r, b) in all.chunks_exact(max).enumerate() {
        if b[0] == 2 {
            bad.push(r);
        }
        let n = u64::from_ne_bytes(b[1..9].try_into().expect("8 bytes")) as usize;
        let rounds: Vec<RoundTimes> = b[9..9 + n * w]
            .chunks_exact(w)
            .map(|c| {
                let mut v = [0f64; RoundTimes::N];
                for (d, x) in v.iter_mut().zip(c.chunks_exact(8)) {
                    *d = f64::from_ne_bytes(x.try_into().expect("8 bytes"));
                }
                RoundTimes::from_array(v)
            })
            .collect();
        times.push(rounds);
    }
    if !bad.is_empty() {
        bail!("rank {me}: the engine's result differs from the oracle's on ranks {bad:?}");
    }
    Ok((slowest(&times), run.rejected))
}

/// The markdown table of `rows`.
pub fn table(rows: &[ExchangeRow]) -> String {
    let mut t = String::from(
        "| topology | engine | arm | mode | transport | tokens | round µs | dispatch µs | combine µs \
         | wall µs | timing | status |\n|---|---|---|---|---|---|---:|---:|---:|---:|---|---|\n",
    );
    for r in rows {
        let tokens = match r.tokens.iter().min() == r.tokens.iter().max() {
            true => r.tokens.first().map_or("0".into(), |t| t.to_string()),
            false => format!("{:?}", r.tokens),
        };
        let phase = |v: Option<f64>| v.map_or("–".to_string(), |v| format!("{v:.1}"));
        t.push_str(&format!(
            "| {} | {} | {} | {} | {} | {} | {:.1} | {} | {} | {:.1} | {} | {} |\n",
            r.topology,
            r.engine,
            r.arm,
            r.mode,
            r.transport,
            tokens,
            r.round_us,
            phase(r.dispatch_us),
            phase(r.combine_us),
            r.wall_us,
            r.timing,
            r.status
        ));
    }
    t
}

/// Runs `afdep exchange`.
pub fn run(a: ExchangeArgs) -> Result<()> {
    if a.rounds == 0 {
        bail!("--rounds must be at least 1");
    }
    let res = a.resolve()?;
    let cfg = res.cfg.clone();
    let kind = res.kind;
    let engine = res.engine;
    check_graph(&a)?;
    if !engine.arms().contains(&a.arm) {
        return Err(Unsupported {
            engine: engine.name(),
            what: format!("arm {}", a.arm),
            have: names(engine.arms()),
        }
        .into());
    }
    if !engine.payloads().contains(&cfg.payload) {
        return Err(Unsupported {
            engine: engine.name(),
            what: format!("payload {}", cfg.payload),
            have: engine
                .payloads()
                .iter()
                .map(|p| p.to_string())
                .collect::<Vec<_>>()
                .join(", "),
        }
        .into());
    }
    let world = cfg.topology.world_size();
    if a.multi_process && kind == TransportKind::Loopback {
        bail!(
            "--multi-process needs a multi-process transport (tcp, ucx, nccl, nvlink); loopback \
             ranks are threads"
        );
    }
    kind.check_placement(world, &res.options)?;
    let problems: Vec<(Vec<SourceInput>, Option<LayerParams>)> = match &a.input {
        Some(p) => vec![read_problem(p, &a, &cfg)?],
        None => a
            .tokens
            .0
            .iter()
            .map(|&t| Ok((generate(&a, &cfg, t)?, None)))
            .collect::<Result<_>>()?,
    };
    if a.output.is_some() && problems.len() != 1 {
        bail!("--output needs exactly one token count");
    }
    if a.output.is_some() && a.multi_process {
        bail!("--output is for threaded runs; with --multi-process every rank checks itself");
    }
    let random_params = || {
        LayerParams::random(
            LayerShape {
                d_model: cfg.hidden,
                width: a.width,
                experts: cfg.experts,
                top_k: cfg.top_k,
                shared: 0,
                renormalize: true,
            },
            a.seed,
        )
    };
    let probs: Vec<Problem> = problems
        .into_iter()
        .map(|(inputs, params)| {
            let params = match (a.expert, params) {
                (ExpertArg::Swiglu, Some(p)) => Some(p),
                (ExpertArg::Swiglu, None) => Some(random_params()),
                (ExpertArg::Identity, _) => None,
            };
            Problem {
                cfg: cfg.clone(),
                inputs,
                params,
            }
        })
        .collect();
    for prob in &probs {
        check_fault(a.fault, prob, a.multi_process)?;
    }
    let mut mp: Option<Box<dyn ExchangeEngine>> = if a.multi_process {
        let env = RendezvousEnv::from_env()
            .context("--multi-process: run under `afdep launch -n N -- afdep exchange ...`")?;
        if env.world_size != world {
            bail!(
                "rank {}: the launch has {} processes, topology {} needs {world}",
                env.rank,
                env.world_size,
                cfg.topology
            );
        }
        let t = AnyTransport::from_env(kind, &res.options)
            .with_context(|| format!("rank {}: setting up {kind}", env.rank))?;
        Some(match engine {
            EngineKind::Staged => Box::new(StagedEngine::new(cfg.clone(), t)?),
            EngineKind::Fused => fused_rank(&a, &cfg, t, rank_params(&probs, a.graph)?)?,
        })
    } else {
        None
    };
    let me = mp.as_ref().map_or(0, |e| e.rank());
    let bar = if me == 0 {
        ProgressBar::new(probs.len() as u64)
    } else {
        ProgressBar::hidden()
    };
    bar.set_style(
        ProgressStyle::with_template("{spinner} {msg} [{bar:30}] {pos}/{len} {elapsed}")
            .expect("template"),
    );
    bar.set_message(format!(
        "{} {}/{kind} {}{}",
        cfg.topology,
        engine.name(),
        a.arm,
        if a.graph { " (graph)" } else { "" }
    ));
    let mut json_out = match (&a.json_out, me) {
        (Some(p), 0) => Some(
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(p)
                .with_context(|| format!("opening {}", p.display()))?,
        ),
        _ => None,
    };
    // threaded fused runs set up once for every problem
    let mut fused_runs = match (&mp, engine) {
        (None, EngineKind::Fused) => Some(run_fused_threads(&a, &res, &probs, &bar)?.into_iter()),
        _ => None,
    };
    let mut rows = Vec::new();
    for prob in &probs {
        let tokens: Vec<usize> = prob.inputs.iter().map(|i| i.routes.tokens).collect();
        let (status, per_round, rejected, combined) = match &mut mp {
            None => {
                let runs = match &mut fused_runs {
                    Some(it) => it.next().context("a run per problem")?,
                    None => run_threaded(&a, &res, prob)?,
                };
                let combined: Vec<Vec<bf16>> = cfg
                    .topology
                    .attention_ranks()
                    .map(|r| {
                        runs[r]
                            .last
                            .as_ref()
                            .and_then(|o| o.combined.clone())
                            .context("attention ranks combine")
                    })
                    .collect::<Result<_>>()?;
                let want = reference_of(prob, a.expert)?;
                let status = if a.no_verify {
                    "unverified"
                } else if want.len() == combined.len()
                    && want
                        .iter()
                        .zip(&combined)
                        .all(|(w, g)| matches_reference(&a, g, w))
                {
                    "ok"
                } else {
                    "mismatch"
                };
                let times: Vec<Vec<RoundTimes>> = runs.iter().map(|r| r.times.clone()).collect();
                (status, slowest(&times), runs[0].rejected, combined)
            }
            Some(eng) => {
                let (times, rejected) = multi_process_problem(&a, eng.as_mut(), prob, world)?;
                let status = if a.no_verify { "unverified" } else { "ok" };
                (status, times, rejected, Vec::new())
            }
        };
        if me == 0 {
            let col = |f: fn(&RoundTimes) -> f64| median(per_round.iter().map(f).collect());
            let round_us = match (engine, a.graph) {
                (EngineKind::Fused, true) => col(|t| t.round),
                (EngineKind::Fused, false) => col(|t| t.dispatch + t.combine),
                (EngineKind::Staged, _) => col(|t| t.wall),
            };
            // graph replays have no phases (per-phase times come from eager rounds)
            let phase = |f: fn(&RoundTimes) -> f64| (!a.graph).then(|| col(f));
            let row = ExchangeRow {
                topology: cfg.topology.to_string(),
                engine: engine.name().into(),
                arm: a.arm.name().into(),
                transport: kind.name().into(),
                ranks_as: if a.multi_process {
                    "processes"
                } else {
                    "threads"
                }
                .into(),
                ucx_tls: res.options.ucx_tls.clone(),
                device_buffers: res.options.device_buffers
                    || matches!(kind, TransportKind::Nccl | TransportKind::NvlinkIpc),
                hidden: cfg.hidden,
                experts: cfg.experts,
                top_k: cfg.top_k,
                capacity: cfg.capacity,
                payload: cfg.payload.to_string(),
                transport_sms: cfg.knobs.transport_sms,
                tokens,
                expert: format!("{:?}", a.expert).to_lowercase(),
                rounds: a.rounds,
                warmup: a.warmup,
                rejected_rounds: rejected,
                timing: match engine {
                    EngineKind::Fused => "device",
                    EngineKind::Staged => "host",
                }
                .into(),
                mode: if a.graph { "graph" } else { "eager" }.into(),
                round_us,
                wall_us: col(|t| t.wall),
                counts_us: col(|t| t.counts),
                dispatch_us: phase(|t| t.dispatch),
                experts_us: col(|t| t.experts),
                combine_us: phase(|t| t.combine),
                status: status.to_string(),
                kernel_digest: afdep_kernels::source_digest(),
                pid: std::process::id(),
            };
            let line = serde_json::to_string(&row).expect("row serializes");
            bar.suspend(|| println!("{line}"));
            if let Some(f) = &mut json_out {
                writeln!(f, "{line}").context("writing --json-out")?;
            }
            rows.push(row);
        }
        if let Some(p) = &a.output {
            let mut f = TensorFile::default();
            for (s, y) in combined.iter().enumerate() {
                f.put_bf16(
                    &format!("y.{s}"),
                    &[prob.inputs[s].routes.tokens, cfg.hidden],
                    y,
                );
            }
            f.write(p)?;
        }
        if status == "mismatch" {
            bail!(
                "the {} engine's result differs from the oracle's exchange reference",
                engine.name()
            );
        }
        if fused_runs.is_none() {
            bar.inc(1);
        }
    }
    bar.finish_and_clear();
    if me == 0 && !rows.is_empty() {
        let t = table(&rows);
        eprint!("{t}");
        if let Some(p) = &a.table {
            std::fs::write(p, &t).with_context(|| format!("writing {}", p.display()))?;
        }
    }
    // the multi-process engine is dropped after a last barrier: no rank frees its windows
    // while a peer may still read them
    if let Some(mut eng) = mp {
        eng.barrier()?;
    }
    Ok(())
}

/// `a, b, c` of the arms' names.
fn names(arms: &[ArmArg]) -> String {
    arms.iter().map(|a| a.name()).collect::<Vec<_>>().join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(mode: &str, phases: Option<f64>) -> ExchangeRow {
        ExchangeRow {
            topology: "3A:1F".into(),
            engine: "fused".into(),
            arm: "auto".into(),
            transport: "nvlink-ipc".into(),
            ranks_as: "threads".into(),
            ucx_tls: None,
            device_buffers: true,
            hidden: 2048,
            experts: 128,
            top_k: 8,
            capacity: 2048,
            payload: "bf16".into(),
            transport_sms: 24,
            tokens: vec![8, 8, 8],
            expert: "identity".into(),
            rounds: 20,
            warmup: 3,
            rejected_rounds: 0,
            timing: "device".into(),
            mode: mode.into(),
            round_us: 41.25,
            wall_us: 900.0,
            counts_us: 0.0,
            dispatch_us: phases,
            experts_us: 0.0,
            combine_us: phases,
            status: "ok".into(),
            kernel_digest: "d".into(),
            pid: 7,
        }
    }

    /// Graph rows have no phase times (null in JSON, `–` in the table) and say their mode;
    /// rows written before the mode existed read as eager.
    #[test]
    fn graph_rows_carry_their_mode_and_no_phases() {
        let g = row("graph", None);
        let v: serde_json::Value = serde_json::to_value(&g).unwrap();
        assert_eq!(v["mode"], "graph");
        assert!(
            v["dispatch_us"].is_null() && v["combine_us"].is_null(),
            "{v}"
        );
        let back: ExchangeRow = serde_json::from_value(v).unwrap();
        assert_eq!(back.dispatch_us, None);
        let t = table(&[g, row("eager", Some(12.5))]);
        assert!(
            t.contains("| 3A:1F | fused | auto | graph | nvlink-ipc | 8 | 41.2 | – | – |"),
            "{t}"
        );
        assert!(
            t.contains("| eager | nvlink-ipc | 8 | 41.2 | 12.5 | 12.5 |"),
            "{t}"
        );
        let mut old = serde_json::to_value(row("eager", Some(1.0))).unwrap();
        old.as_object_mut().unwrap().remove("mode");
        let old: ExchangeRow = serde_json::from_value(old).unwrap();
        assert_eq!(old.mode, "eager");
    }

    /// `--arm auto` is the rule in eager rounds (no forced arm) and every arm in one graph.
    #[test]
    fn the_auto_arm_is_the_rule() {
        assert_eq!(dispatch_arm(ArmArg::Auto), None);
        assert_eq!(round_arm(ArmArg::Auto), RoundArm::Auto);
        assert_eq!(
            round_arm(ArmArg::CountFirstSource),
            RoundArm::Fixed(DispatchArm::CountFirstSource)
        );
        assert!(EngineKind::Fused.arms().contains(&ArmArg::Auto));
        assert!(!EngineKind::Staged.arms().contains(&ArmArg::Auto));
    }

    #[test]
    fn a_graph_run_takes_one_parameter_set() {
        let cfg = ExchangeConfig::new("1A:1F".parse().unwrap(), 16, 4, 2, 8).unwrap();
        let shape = |seed| {
            LayerParams::random(
                LayerShape {
                    d_model: 16,
                    width: 8,
                    experts: 4,
                    top_k: 2,
                    shared: 0,
                    renormalize: true,
                },
                seed,
            )
        };
        let prob = |params: Option<LayerParams>| Problem {
            cfg: cfg.clone(),
            inputs: Vec::new(),
            params,
        };
        let same = [prob(Some(shape(1))), prob(Some(shape(1)))];
        assert_eq!(rank_params(&same, true).unwrap(), Some(&shape(1)));
        let differ = [prob(Some(shape(1))), prob(Some(shape(2)))];
        let e = rank_params(&differ, true).unwrap_err().to_string();
        assert!(e.contains("--graph"), "{e}");
        // eager rounds take each problem's own experts
        assert_eq!(rank_params(&differ, false).unwrap(), Some(&shape(1)));
        assert_eq!(rank_params(&[prob(None), prob(None)], true).unwrap(), None);
        assert_eq!(rank_params(&[], true).unwrap(), None);
    }
}
