//! The arguments of `afdep exchange`: the flags, the arms, payloads, faults and experts they
//! name, and what a run uses once the config file, the flags and the defaults are merged.

use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;
use std::time::Duration;

use afdep_core::{CombinePartials, ExchangeConfig, ExchangeKnobs, PayloadKind, Topology};
use afdep_moe::FusedEngine;
use afdep_transport::{TransportConfig, TransportKind, TransportOptions};
use anyhow::{Result, bail};
use clap::{Args, ValueEnum};
use serde::{Deserialize, Serialize};

use crate::Backend;
use crate::exchange_config::{ExchangeFile, KnobsFile};

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

/// A dispatch arm of the exchange (docs/design.md, "Specification: AFD exchange"; the reference
/// record's arms, docs/design.md, "The reference record").
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
    /// The arm of the token-bucket rule, round by round (`--min-token-bucket`: count-first, the
    /// source arm, when the largest source's token count reaches it, payload-first below):
    /// eager rounds choose it on the host; with `--graph`, one graph holds every arm and the
    /// device chooses.
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
    /// [`StagedEngine`](afdep_moe::StagedEngine): host-driven, any transport.
    Staged,
    /// [`FusedEngine`]: GPU-initiated stores over NVLink-IPC.
    Fused,
    /// The NCCL device engine (`afdep_moe::nccl_device`, cargo feature `nccl`): packing,
    /// expansion, experts and combine on the GPU around grouped `ncclSend`/`ncclRecv` of
    /// capacity-padded slabs; every round is a device round (`--graph`: replays of one capture).
    NcclDevice,
}

impl EngineKind {
    /// The name in rows and messages.
    pub fn name(self) -> &'static str {
        match self {
            EngineKind::Staged => "staged",
            EngineKind::Fused => "fused",
            EngineKind::NcclDevice => "nccl_device",
        }
    }

    /// The dispatch arms this engine runs today. The staged engine's one protocol is
    /// payload-first (per-source slabs, then the copy epilogue on the FFN rank). When the fused
    /// engine gains an arm, listing it here (and passing it on in [`select_arm`](super::ranks::select_arm)) is the change.
    pub fn arms(self) -> &'static [ArmArg] {
        match self {
            // the NCCL device engine's slabs are per-source slabs expanded on the FFN rank
            EngineKind::Staged | EngineKind::NcclDevice => &[ArmArg::PayloadFirst],
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
            EngineKind::NcclDevice => &[PayloadKind::Bf16],
        }
    }

    /// The combine partials this engine has: the fused engine stores bf16 partials (half the
    /// return bytes), the staged engine rounds the partials the same way on the source (same
    /// results, no bytes saved), the NCCL device engine has f32 partials only.
    pub fn partials(self) -> &'static [CombinePartials] {
        match self {
            EngineKind::Staged | EngineKind::Fused => {
                &[CombinePartials::F32, CombinePartials::Bf16]
            }
            EngineKind::NcclDevice => &[CombinePartials::F32],
        }
    }
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

/// Combine partials on the command line.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum PartialsArg {
    /// f32 partials: the exact path, bit-identical to the oracle's f32 combine.
    F32,
    /// bf16 partials: half the combine's return bytes, within the derived bound of the f32 path
    /// (bit-identical to the oracle with bf16 partials).
    Bf16,
}

impl From<PartialsArg> for CombinePartials {
    fn from(p: PartialsArg) -> CombinePartials {
        match p {
            PartialsArg::F32 => CombinePartials::F32,
            PartialsArg::Bf16 => CombinePartials::Bf16,
        }
    }
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
    /// Where to run: `cuda` is the fused engine with `--transport nvlink` and the NCCL device
    /// engine with `--transport nccl` (every round a device round, identity experts), `cpu` the
    /// staged engine (any transport), `auto` the fused engine over nvlink and the staged one
    /// otherwise.
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
    /// Run eager *device* rounds (`--backend cuda` only): each round launches, one by one, the
    /// kernels a `--graph` capture holds (routes validated, counts and plan made on the device),
    /// with the experts on the device as with `--graph`; rows have `mode` `device` and
    /// `round_us` from CUDA events around the round's launches. (Without it, eager rounds of the
    /// fused engine are `FusedEngine::round`: the same device round with the experts on the
    /// host, between the FFN rank's epilogue and its partial sums.)
    #[arg(long, conflicts_with = "graph")]
    pub device_rounds: bool,
    /// Start every rank's device round together on the device (`--graph` or `--device-rounds`,
    /// the fused engine, ranks as threads on one GPU): each rank's round waits behind a start
    /// gate (`afdep_moe::fused::StartGate`) that rank 0 opens once every rank has queued its
    /// round, so `round_us` holds the round itself, not the skew of the ranks' launches into
    /// the one CUDA context: it runs from the gate's opening (an event recorded just before rank
    /// 0 writes the gate) to the rank's last launch. Rows carry `start: gate` (`host` without
    /// it).
    #[arg(long)]
    pub start_gate: bool,
    /// Write a timeline of every timed round to FILE as Chrome-trace / Perfetto JSON
    /// (`chrome://tracing`, ui.perfetto.dev): device timestamps (`%globaltimer`) at every
    /// phase boundary of every rank, eager (`--device-rounds`) or inside graph replays
    /// (`--graph`); one track per rank, one process per token count. Rows then also carry
    /// `phases_us`. Stamps add a small kernel per phase: take latency tables from untraced runs.
    /// `afdep report trace --trace FILE --png OUT` draws it. Ranks as threads only.
    #[arg(long, value_name = "FILE")]
    pub trace: Option<PathBuf>,
    /// Write the probe points inside the round's kernels (after each wait, after each grid-wide
    /// step: `afdep_kernels::ops::probe`) of every timed round to FILE as JSON, and print each
    /// rank's median time of each point from the round's first point. Needs kernels built with
    /// probes (`AFDEP_NVRTC_OPTIONS=-DAFDEP_PROBE`; a probe costs an atomic where it fires, so
    /// take latency tables from builds without), `--graph` or `--device-rounds`, the fused
    /// engine, ranks as threads. The front kernels run when tracing is off, so do not combine
    /// it with `--trace` to see them.
    #[arg(long, value_name = "FILE")]
    pub probe: Option<PathBuf>,
    /// Run the rounds under a compute load too (`--graph` or `--device-rounds`, ranks as
    /// threads): `gemm` (a bf16 GEMM of 8192 × 8192 × 8192) or `gemm:M,N,K`, afdep's grouped
    /// GEMM with one group, launched back to back on its own stream of every GPU the ranks use
    /// while the rounds run. Each token count's rounds run twice, alone and then under the load;
    /// rows carry `load` (the round alone and loaded, the GEMM's time per launch alone and under
    /// the rounds, both slowdowns) and `round_us` is the round under load. The GEMM's output
    /// under load is checked against a host reference on a slice of rows and columns.
    #[arg(long, value_name = "gemm[:M,N,K]")]
    pub load: Option<super::load::LoadSpec>,
    /// Run the microbatch pipeline instead of rounds (`--backend cuda --transport nvlink`, ranks
    /// as threads): for each M of the list, every token count's layer step as M microbatches
    /// over two fused engines per rank (microbatch i+1's dispatch overlapping microbatch i's
    /// experts) against the same M rounds back to back on one engine; checked bit for bit
    /// against the sequential rounds and, on a sample of tokens, against the oracle; rows report
    /// both layer times (CUDA events, medians over `--rounds` after `--warmup`) and the FFN
    /// ranks' busy fraction from device timelines (`mode: pipeline`).
    #[arg(long, value_delimiter = ',', value_name = "M,..")]
    pub pipeline: Option<Vec<usize>>,
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
    /// Combine partials: `f32` (exact) or `bf16` (each FFN rank's partial rounded to bf16: half
    /// the return bytes, not bit-identical to f32) [default: f32].
    #[arg(long, value_enum)]
    pub partials: Option<PartialsArg>,
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
    /// Knob: the smallest largest-source token count that uses count-first (the source arm)
    /// [default: 1].
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
    /// Whether the rounds are device rounds with device experts (`--graph` or
    /// `--device-rounds`).
    pub fn device_experts(&self) -> bool {
        self.graph || self.device_rounds
    }

    /// The rows' `mode`: `graph`, `device` or `eager`.
    pub fn mode(&self) -> &'static str {
        match (self.graph, self.device_rounds) {
            (true, _) => "graph",
            (false, true) => "device",
            (false, false) => "eager",
        }
    }

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
            partials: self
                .partials
                .map(CombinePartials::from)
                .or(file.partials)
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
            (Backend::Cuda, TransportKind::Nccl) => EngineKind::NcclDevice,
            (Backend::Cuda, other) => bail!(
                "--backend cuda is the fused engine over NVLink-IPC or the NCCL device engine: \
                 use --transport nvlink or --transport nccl (or --backend cpu for the staged \
                 engine over {other})"
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
                    // (the NCCL device engine never runs over nvlink)
                    EngineKind::Staged | EngineKind::NcclDevice => 256,
                };
            }
            if !file_sets(|t| t.staging_bytes.is_some()) {
                options.staging_bytes = match engine {
                    EngineKind::Fused | EngineKind::NcclDevice => 256,
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
pub(super) fn staged_recv_bytes(cfg: &ExchangeConfig) -> usize {
    let (h, k, cap) = (cfg.hidden, cfg.top_k, cfg.capacity);
    let sources = cfg.topology.attention_count();
    let dispatch = sources * cap * (2 * h + 4 + 8 * k);
    let combine = cap * k * 2 * h;
    dispatch.max(combine).max(1)
}

/// `flag` (what it does: `why`) needs device rounds (`--graph` or `--device-rounds`) with the
/// ranks as threads of this process.
fn device_rounds_on_threads(a: &ExchangeArgs, flag: &str, why: &str) -> Result<()> {
    if !a.device_experts() {
        bail!("{flag} {why}: it needs --graph or --device-rounds");
    }
    if a.multi_process {
        bail!("{flag}: ranks as threads only (not with --multi-process)");
    }
    Ok(())
}

/// The checks of `--graph`, `--device-rounds`, `--trace`, `--probe`, `--start-gate` and
/// `--load` against the other flags (a clear error).
pub(super) fn check_graph(a: &ExchangeArgs) -> Result<()> {
    if a.load.is_some() {
        device_rounds_on_threads(
            a,
            "--load",
            "runs device rounds beside a GEMM (with --backend cuda --transport nvlink)",
        )?;
        if a.fault.is_some() {
            bail!("--load: not with --fault (the rounds run twice)");
        }
    }
    if a.start_gate {
        // a gate needs every rank in one CUDA context
        device_rounds_on_threads(a, "--start-gate", "starts device rounds together")?;
        if a.pipeline.is_some() {
            bail!("--start-gate: not with --pipeline (its layer steps are not gated)");
        }
    }
    if a.probe.is_some() {
        device_rounds_on_threads(a, "--probe", "reads the kernels of device rounds")?;
        let opts = afdep_kernels::JitOptions::from_env().extra_options;
        if !afdep_kernels::ops::probe::requested(&opts) {
            bail!(
                "--probe needs kernels built with probes: set AFDEP_NVRTC_OPTIONS=-DAFDEP_PROBE \
                 (have {opts:?})"
            );
        }
    }
    if a.trace.is_some() {
        device_rounds_on_threads(a, "--trace", "times the phases of device rounds")?;
    }
    if !a.device_experts() {
        return Ok(());
    }
    let flag = if a.graph {
        "--graph"
    } else {
        "--device-rounds"
    };
    if a.backend != Backend::Cuda {
        bail!(
            "{flag} runs device rounds: it needs --backend cuda (with --transport nvlink for \
             the fused engine, --transport nccl for the NCCL device engine)"
        );
    }
    if let Some(Fault::Abort { .. }) = a.fault {
        bail!("--fault abort@..: not with {flag} (the experts run on the device)");
    }
    Ok(())
}

/// The checks of a run of the NCCL device engine (`--backend cuda --transport nccl`): identity
/// experts only ([`Unsupported`] otherwise), no `--load`, `--trace`, `--probe` or `--fault abort@..` (its
/// experts run on the device).
pub(super) fn check_nccl_device(a: &ExchangeArgs) -> Result<()> {
    if a.expert != ExpertArg::Identity {
        return Err(Unsupported {
            engine: EngineKind::NcclDevice.name(),
            what: format!("expert {:?}", a.expert).to_lowercase(),
            have: "identity".into(),
        }
        .into());
    }
    if a.load.is_some() || a.trace.is_some() || a.probe.is_some() {
        bail!("the NCCL device engine runs without --load, --trace and --probe");
    }
    if let Some(Fault::Abort { .. }) = a.fault {
        bail!("--fault abort@..: not with the NCCL device engine (its experts run on the device)");
    }
    Ok(())
}

/// `a, b, c` of the arms' names.
pub(super) fn names(arms: &[ArmArg]) -> String {
    arms.iter().map(|a| a.name()).collect::<Vec<_>>().join(", ")
}
