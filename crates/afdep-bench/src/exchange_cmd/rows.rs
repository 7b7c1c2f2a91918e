//! The output of a run: one JSON row per problem ([`ExchangeRow`]) and their markdown table.

use serde::{Deserialize, Serialize};

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
    /// `eager` (host-planned rounds launched kernel by kernel), `device` (`--device-rounds`:
    /// eager device rounds) or `graph` (`--graph`: replays of a captured device round); the
    /// last two have per-phase times only with `--trace` (`phases_us`).
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
    /// With `--trace`: per phase of a device round (`begin`, `counts`, `plan`, `rows`,
    /// `epilogue`, `experts`, `combine`, ...), the median over the timed rounds of the slowest
    /// rank's span on the device timer, µs (traced rounds: each phase boundary is a stamp
    /// kernel).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phases_us: Option<std::collections::BTreeMap<String, f64>>,
    /// `ok`, `mismatch` (against the oracle), or `unverified`.
    pub status: String,
    /// Digest of the kernel sources.
    pub kernel_digest: String,
    /// The process that printed the row (the arms runner checks its arms ran apart).
    pub pid: u32,
}

/// The `mode` of rows written before it existed.
pub(super) fn eager() -> String {
    "eager".into()
}

pub(super) fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
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
