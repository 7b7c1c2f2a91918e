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
    /// Combine partials: `f32` (exact) or `bf16` (`--partials bf16`); rows written before the
    /// option read as `f32`.
    #[serde(default = "f32_partials")]
    pub partials: String,
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
    /// `eager` (`FusedEngine::round`: device rounds with host experts), `device` (`--device-rounds`:
    /// eager device rounds) or `graph` (`--graph`: replays of a captured device round); the
    /// last two have per-phase times only with `--trace` (`phases_us`).
    #[serde(default = "eager")]
    pub mode: String,
    /// How the ranks' device rounds started: `host` (each when its rank's host queued it) or
    /// `gate` (`--start-gate`: together, behind a start gate that opens once every rank has
    /// queued its round; `round_us` from the gate's opening); rows written before the option
    /// read as `host`.
    #[serde(default = "host_start")]
    pub start: String,
    /// Median time of a round, µs (see `timing`).
    pub round_us: f64,
    /// Median wall time of a whole round on the host (slowest rank), µs.
    pub wall_us: f64,
    /// Median host time of the status + count phase (slowest rank), µs. Fused engine, `mode`
    /// `eager` (`FusedEngine::round`, whose status and counts run on the device, inside
    /// `dispatch_us`): the round's host preparation instead (the input copied to the device,
    /// the outputs poisoned, the front half's launches, and the phase-timing barrier).
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
    /// With `--load`: the rounds alone and under the load, and the load's GEMM alone and under
    /// the rounds ([`LoadRow`]); `round_us` and the other times of the row are then the rounds
    /// under load.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub load: Option<LoadRow>,
    /// `ok`, `mismatch` (against the oracle; with `--load`: in either pass), or `unverified`.
    pub status: String,
    /// Digest of the kernel sources.
    pub kernel_digest: String,
    /// The process that printed the row (the arms runner checks its arms ran apart).
    pub pid: u32,
}

/// `--load gemm[:M,N,K]` (docs/perf/exchange.md, "Overlap under load"): the same rounds run
/// twice on the same engines, first alone, then while a bf16 GEMM runs back to back on its own
/// stream of every GPU the ranks use; and the GEMM timed alone (right before) and under the
/// rounds. Times are medians; GEMM fields come from the device where the GEMM slowed down most.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LoadRow {
    /// The load, `gemm:M,N,K` (`C[M×N] = A[M×K]·B[K×N]`, bf16, f32 accumulation).
    pub load: String,
    /// The devices that ran it (the ranks' GPUs; emulated ranks: one).
    pub devices: Vec<usize>,
    /// Median round without the load, µs (slowest rank per round, as `round_us`).
    pub round_us_alone: f64,
    /// Median round under the load, µs (the row's `round_us`).
    pub round_us_loaded: f64,
    /// `round_us_loaded / round_us_alone`.
    pub round_slowdown: Option<f64>,
    /// Median device time of one GEMM launch alone, µs (CUDA events around each launch).
    pub gemm_us_alone: f64,
    /// Median device time of one GEMM launch while the rounds ran, µs (launches that had begun
    /// when the rounds ended).
    pub gemm_us_loaded: f64,
    /// `gemm_us_loaded / gemm_us_alone`.
    pub gemm_slowdown: Option<f64>,
    /// `2·M·N·K / gemm_us_alone`, TFLOP/s.
    pub gemm_tflops_alone: f64,
    /// `2·M·N·K / gemm_us_loaded`, TFLOP/s.
    pub gemm_tflops_loaded: f64,
    /// GEMM launches timed alone.
    pub gemm_launches_alone: usize,
    /// GEMM launches timed under the rounds.
    pub gemm_launches_loaded: usize,
    /// Host time from the load's first launch running to its stop (the loaded rounds, warm-ups
    /// and barriers included), µs.
    pub window_us: f64,
    /// The timed loaded rounds' device time (slowest rank, summed) over `window_us`: the share
    /// of the load's time that a round ran beside it (the GEMM's slowdown is diluted by the
    /// rest).
    pub round_duty: f64,
    /// Elements of the GEMM's output under load checked against the host reference, every
    /// device together (a mismatch fails the run).
    pub gemm_checked: usize,
}

/// The `mode` of rows written before it existed.
pub(super) fn eager() -> String {
    "eager".into()
}

/// The `partials` of rows written before bf16 partials existed.
pub(super) fn f32_partials() -> String {
    "f32".into()
}

fn host_start() -> String {
    "host".into()
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
        "| topology | engine | arm | mode | partials | transport | tokens | round µs | dispatch µs \
         | combine µs | wall µs | timing | status |\n|---|---|---|---|---|---|---|---:|---:|---:|---:\
         |---|---|\n",
    );
    for r in rows {
        let tokens = match r.tokens.iter().min() == r.tokens.iter().max() {
            true => r.tokens.first().map_or("0".into(), |t| t.to_string()),
            false => format!("{:?}", r.tokens),
        };
        let phase = |v: Option<f64>| v.map_or("–".to_string(), |v| format!("{v:.1}"));
        // a gated row says so where the mode is (`--start-gate`)
        let mode = match r.start.as_str() {
            "host" => r.mode.clone(),
            s => format!("{} ({s} start)", r.mode),
        };
        t.push_str(&format!(
            "| {} | {} | {} | {} | {} | {} | {} | {:.1} | {} | {} | {:.1} | {} | {} |\n",
            r.topology,
            r.engine,
            r.arm,
            mode,
            r.partials,
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
    if rows.iter().any(|r| r.load.is_some()) {
        t.push_str(&load_table(rows));
    }
    t
}

/// The table of the `--load` rows: the round alone and under load, the GEMM alone and under the
/// rounds, and their slowdowns.
fn load_table(rows: &[ExchangeRow]) -> String {
    let mut t = String::from(
        "\n| topology | mode | arm | hidden | transport SMs | tokens | load | round µs alone | round \
         µs loaded | round slowdown | GEMM µs alone | GEMM µs loaded | GEMM slowdown | GEMM \
         TFLOP/s alone / loaded | duty | status |\n|---|---|---|---:|---:|---:|---|---:|---:|---:\
         |---:|---:|---:|---:|---:|---|\n",
    );
    let x = |v: Option<f64>| v.map_or("–".to_string(), |v| format!("{v:.2}×"));
    for r in rows {
        let Some(l) = &r.load else { continue };
        t.push_str(&format!(
            "| {} | {} | {} | {} | {} | {} | {} | {:.1} | {:.1} | {} | {:.1} | {:.1} | {} | {:.0} / \
             {:.0} | {:.2} | {} |\n",
            r.topology,
            r.mode,
            r.arm,
            r.hidden,
            r.transport_sms,
            r.tokens.iter().max().copied().unwrap_or(0),
            l.load,
            l.round_us_alone,
            l.round_us_loaded,
            x(l.round_slowdown),
            l.gemm_us_alone,
            l.gemm_us_loaded,
            x(l.gemm_slowdown),
            l.gemm_tflops_alone,
            l.gemm_tflops_loaded,
            l.round_duty,
            r.status
        ));
    }
    t
}
