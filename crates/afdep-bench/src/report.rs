//! `afdep report moe`: the same-run comparison of afdep's MoE layer with the peers.
//!
//! Input: JSONL files of rows with the reference record's (docs/design.md, "The reference record")
//! fields (`tokens`, `impl`, `dispatch`, `fwd_ms`, `train_ms`, `out_err`, `gx_err`, `gw_err`,
//! `status`, `peak_gib`, `digest`, `device`), as printed by `afdep moe --backend cuda` (`impl` =
//! `afdep`) and the peer scripts `peers/moe_torch.py` and `peers/moe_jax.py` (any other `impl`).
//! Lines that are not JSON objects with at least `tokens` and `impl` (log lines, the GPU stage
//! rows) are skipped and counted; rows of the CPU oracle (`impl` starting with `afdep-`) are
//! skipped too. When one (impl, dispatch, tokens) appears more than once, the last row wins (JSONL
//! files are appended to).
//!
//! Rows are grouped into cells: (shape, tokens), the shape being the row's `shape` name
//! (`afdep moe --suite` / `--shape`, and the peers' rows of its input files) or else its
//! dimensions `H/W/E/K/S`; cells are listed in the order their shapes first appear, tokens
//! ascending. The block opens with the suite table: per cell, afdep's best strategy and the
//! best peer (the faster of the peers whose row is `ok`) in the forward and the train step,
//! afdep's achieved TFLOP/s and percent of 790 ([`crate::shapes`]), the speed-up (best peer
//! ms / afdep ms), the peak memories and afdep's statuses against the GPU reference.
//!
//! Output: a markdown block (printed, and written into a document between the marker comments
//! [`BEGIN`] and [`END`], replacing the previous block and leaving the rest of the document as
//! it is) and a PNG chart ([`crate::report_png`]). Every ratio is `peer_ms / afdep_ms`: above
//! 1 means afdep is faster. "Best" is afdep's fastest strategy among the rows whose status is
//! `ok` (errors within tolerance), per token count and separately for forward and train step.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use clap::Args;
use serde::Deserialize;
use thiserror::Error;

/// The first line of the generated block (the rest of that line is a note to editors).
pub const BEGIN: &str = "<!-- afdep report moe: begin";
/// The last line of the generated block.
pub const END: &str = "<!-- afdep report moe: end -->";
/// The `impl` of afdep's GPU rows.
pub const AFDEP_IMPL: &str = "afdep";

/// Arguments of `afdep report moe`.
#[derive(Debug, Args)]
pub struct ReportMoeArgs {
    /// JSONL files of rows (afdep's and the peers'), read in order.
    #[arg(long, num_args = 1.., required = true)]
    pub rows: Vec<PathBuf>,
    /// Write the generated block into this markdown file, between the marker comments
    /// (replacing the previous block; appended when the file has none; created when missing).
    #[arg(long)]
    pub md: Option<PathBuf>,
    /// Draw the chart into this PNG file.
    #[arg(long)]
    pub png: Option<PathBuf>,
    /// The commit the binaries were built from (the bundle's `commit.txt`).
    #[arg(long, default_value = "unknown")]
    pub commit: String,
    /// The date of the run (default: today, UTC).
    #[arg(long)]
    pub date: Option<String>,
}

/// Why a report could not be made.
#[derive(Debug, Error)]
pub enum ReportError {
    /// A rows file or the markdown file could not be read.
    #[error("reading {}: {source}", path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// An output could not be written.
    #[error("writing {}: {source}", path.display())]
    Write {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// None of the rows is afdep's.
    #[error(
        "no afdep rows (impl \"afdep\" with a token count) in {files}: give the JSONL of \
         `afdep moe --backend cuda` to --rows"
    )]
    NoAfdepRows {
        /// The files read.
        files: String,
    },
    /// The markdown file's markers are not one begin line followed by one end line.
    #[error("{}: {source}", path.display())]
    Markers {
        /// The markdown file.
        path: PathBuf,
        /// What is wrong with the markers.
        source: MarkerError,
    },
    /// The chart could not be drawn.
    #[error("drawing the chart {}: {why}", path.display())]
    Chart {
        /// The PNG file.
        path: PathBuf,
        /// What failed.
        why: String,
    },
}

/// What is wrong with the generated block's markers in a document.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum MarkerError {
    /// More than one begin or end marker.
    #[error(
        "found {begins} begin and {ends} end markers of the generated block; expected one \
         `{BEGIN} ... -->` line followed by one `{END}` line (or neither)"
    )]
    Count {
        /// Begin lines found.
        begins: usize,
        /// End lines found.
        ends: usize,
    },
    /// The end marker comes before the begin marker.
    #[error("the end marker `{END}` (line {end}) comes before the begin marker (line {begin})")]
    Order {
        /// Line of the begin marker (1-based).
        begin: usize,
        /// Line of the end marker (1-based).
        end: usize,
    },
}

/// One row as the report reads it (fields other than `tokens` and `impl` may be missing).
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct Row {
    /// Tokens.
    pub tokens: usize,
    /// The named shape (`afdep moe --suite`, `--shape`).
    #[serde(default)]
    pub shape: Option<String>,
    /// Hidden size.
    #[serde(default)]
    pub d_model: Option<usize>,
    /// Expert width.
    #[serde(default)]
    pub width: Option<usize>,
    /// Experts.
    #[serde(default)]
    pub experts: Option<usize>,
    /// Top-k.
    #[serde(default)]
    pub top_k: Option<usize>,
    /// Shared width.
    #[serde(default)]
    pub shared: Option<usize>,
    /// What happened, where the status needs explaining.
    #[serde(default)]
    pub note: Option<String>,
    /// Implementation (`afdep`, `torch_grouped_mm`, `jax_ragged_dot`, ...).
    #[serde(rename = "impl")]
    pub implementation: String,
    /// Dispatch strategy.
    #[serde(default)]
    pub dispatch: Option<String>,
    /// Forward, ms.
    #[serde(default)]
    pub fwd_ms: Option<f64>,
    /// Train step, ms.
    #[serde(default)]
    pub train_ms: Option<f64>,
    /// Output error.
    #[serde(default)]
    pub out_err: Option<f64>,
    /// Input-gradient error.
    #[serde(default)]
    pub gx_err: Option<f64>,
    /// Weight-gradient error.
    #[serde(default)]
    pub gw_err: Option<f64>,
    /// `ok`, `error_too_large`, `oom`, `unsupported`, ...
    #[serde(default)]
    pub status: Option<String>,
    /// Peak device memory, GiB.
    #[serde(default)]
    pub peak_gib: Option<f64>,
    /// The peer's output error against its own f32 oracle (peer rows).
    #[serde(default)]
    pub oracle_out_err: Option<f64>,
    /// The peer's dx error against its own f32 oracle.
    #[serde(default)]
    pub oracle_gx_err: Option<f64>,
    /// The peer's weight-gradient error against its own f32 oracle.
    #[serde(default)]
    pub oracle_gw_err: Option<f64>,
    /// Kernel digest (afdep rows).
    #[serde(default)]
    pub digest: Option<String>,
    /// GPU name.
    #[serde(default)]
    pub device: Option<String>,
}

impl Row {
    fn status(&self) -> &str {
        self.status.as_deref().unwrap_or("unknown")
    }
    fn ok(&self) -> bool {
        self.status() == "ok"
    }

    /// The row's shape: its name, else `H/W/E/K/S`, else `?`.
    pub fn shape_label(&self) -> String {
        if let Some(n) = &self.shape {
            return n.clone();
        }
        match (self.d_model, self.width, self.experts, self.top_k) {
            (Some(h), Some(w), Some(e), Some(k)) => {
                format!("{h}/{w}/{e}/{k}/{}", self.shared.unwrap_or(0))
            }
            _ => "?".into(),
        }
    }

    /// The layer shape, when the row has its dimensions.
    pub fn layer_shape(&self) -> Option<afdep_core::LayerShape> {
        Some(afdep_core::LayerShape {
            d_model: self.d_model?,
            width: self.width?,
            experts: self.experts?,
            top_k: self.top_k?,
            shared: self.shared.unwrap_or(0),
            renormalize: true,
        })
    }

    /// The cell of the row.
    pub fn cell(&self) -> Cell {
        Cell {
            shape: self.shape_label(),
            tokens: self.tokens,
        }
    }
}

/// One cell of the comparison: a shape at a token count.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Cell {
    /// [`Row::shape_label`].
    pub shape: String,
    /// Tokens.
    pub tokens: usize,
}

#[cfg(test)]
impl Cell {
    /// A cell (for tests and lookups).
    pub fn new(shape: &str, tokens: usize) -> Self {
        Cell {
            shape: shape.into(),
            tokens,
        }
    }
}

/// Rows parsed from JSONL text, and how many lines were skipped (not a row; blank lines are
/// not counted).
pub fn parse_rows(text: &str) -> (Vec<Row>, usize) {
    let mut rows = Vec::new();
    let mut skipped = 0;
    for line in text.lines().map(str::trim).filter(|l| !l.is_empty()) {
        match serde_json::from_str::<Row>(line) {
            Ok(r) => rows.push(r),
            Err(_) => skipped += 1,
        }
    }
    (rows, skipped)
}

/// `peer_ms / afdep_ms` when both are finite and positive.
pub fn ratio(peer_ms: Option<f64>, afdep_ms: Option<f64>) -> Option<f64> {
    match (peer_ms, afdep_ms) {
        (Some(p), Some(a)) if p.is_finite() && a.is_finite() && p > 0.0 && a > 0.0 => Some(p / a),
        _ => None,
    }
}

/// Forward or train step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// The forward pass.
    Forward,
    /// The train step (forward and backward).
    Train,
}

/// FLOP of a phase at a row's shape, when the row has its dimensions.
fn phase_flops(phase: Phase, r: &Row) -> Option<f64> {
    let s = r.layer_shape()?;
    Some(match phase {
        Phase::Forward => crate::shapes::forward_flops(&s, r.tokens),
        Phase::Train => crate::shapes::train_flops(&s, r.tokens),
    })
}

impl Phase {
    /// Both, in table order.
    pub const BOTH: [Phase; 2] = [Phase::Forward, Phase::Train];

    /// The row's time of this phase.
    pub fn ms(self, r: &Row) -> Option<f64> {
        match self {
            Phase::Forward => r.fwd_ms,
            Phase::Train => r.train_ms,
        }
        .filter(|v| v.is_finite())
    }

    /// A title.
    pub fn title(self) -> &'static str {
        match self {
            Phase::Forward => "forward",
            Phase::Train => "train step",
        }
    }
}

/// The rows of one comparison, indexed.
#[derive(Debug, Clone, Default)]
pub struct Comparison {
    /// The cells of afdep's rows: shapes in the order they first appear, tokens ascending.
    pub cells: Vec<Cell>,
    /// afdep's strategies, in the order they first appear.
    pub strategies: Vec<String>,
    /// The peers' `impl` names, in the order they first appear.
    pub peers: Vec<String>,
    afdep: BTreeMap<(String, Cell), Row>,
    peer: BTreeMap<(String, Cell), Row>,
    /// Distinct kernel digests of afdep's rows.
    pub digests: Vec<String>,
    /// Distinct GPU names of afdep's rows (else the peers').
    pub devices: Vec<String>,
    /// Lines that were not rows.
    pub skipped: usize,
}

fn push_unique(v: &mut Vec<String>, s: &str) {
    if !v.iter().any(|x| x == s) {
        v.push(s.to_string());
    }
}

impl Comparison {
    /// Indexes rows (later rows replace earlier ones with the same key).
    pub fn new(rows: impl IntoIterator<Item = Row>, skipped: usize) -> Self {
        let mut c = Comparison {
            skipped,
            ..Comparison::default()
        };
        let mut peer_devices = Vec::new();
        let mut shapes: Vec<String> = Vec::new();
        for r in rows {
            if r.implementation == AFDEP_IMPL {
                let d = r.dispatch.clone().unwrap_or_else(|| "?".into());
                push_unique(&mut c.strategies, &d);
                let cell = r.cell();
                push_unique(&mut shapes, &cell.shape);
                if !c.cells.contains(&cell) {
                    c.cells.push(cell);
                }
                if let Some(g) = &r.digest {
                    push_unique(&mut c.digests, g);
                }
                if let Some(g) = &r.device {
                    push_unique(&mut c.devices, g);
                }
                c.afdep.insert((d, r.cell()), r);
            } else if r.implementation.starts_with("afdep-") {
                c.skipped += 1;
            } else {
                push_unique(&mut c.peers, &r.implementation);
                if let Some(g) = &r.device {
                    push_unique(&mut peer_devices, g);
                }
                c.peer.insert((r.implementation.clone(), r.cell()), r);
            }
        }
        let order = |s: &str| shapes.iter().position(|x| x == s).unwrap_or(usize::MAX);
        c.cells.sort_by_key(|a| (order(&a.shape), a.tokens));
        if c.devices.is_empty() {
            c.devices = peer_devices;
        }
        c
    }

    /// afdep's row of one strategy in a cell.
    pub fn afdep(&self, strategy: &str, cell: &Cell) -> Option<&Row> {
        self.afdep.get(&(strategy.to_string(), cell.clone()))
    }

    /// A peer's row in a cell.
    pub fn peer(&self, peer: &str, cell: &Cell) -> Option<&Row> {
        self.peer.get(&(peer.to_string(), cell.clone()))
    }

    /// afdep's fastest strategy with status `ok` for a phase: (strategy, ms).
    pub fn best(&self, phase: Phase, cell: &Cell) -> Option<(&str, f64)> {
        self.strategies
            .iter()
            .filter_map(|s| {
                let r = self.afdep(s, cell)?;
                let ms = phase.ms(r).filter(|_| r.ok())?;
                Some((s.as_str(), ms))
            })
            .min_by(|a, b| a.1.total_cmp(&b.1))
    }

    /// The fastest peer with status `ok` for a phase: (peer, ms).
    pub fn best_peer(&self, phase: Phase, cell: &Cell) -> Option<(&str, f64)> {
        self.peers
            .iter()
            .filter_map(|p| {
                let r = self.peer(p, cell)?;
                let ms = phase.ms(r).filter(|_| r.ok())?;
                Some((p.as_str(), ms))
            })
            .min_by(|a, b| a.1.total_cmp(&b.1))
    }

    /// afdep's statuses in a cell: `ok` when every strategy's is, else `n/m ok` and the others
    /// (`strategy: status`), or the one status all share (`unsupported`, `oom`, ...);
    /// `missing` when the cell has no afdep row at all (a run cut short).
    pub fn afdep_status(&self, cell: &Cell) -> String {
        let rows: Vec<(&String, &Row)> = self
            .strategies
            .iter()
            .filter_map(|s| Some((s, self.afdep(s, cell)?)))
            .collect();
        if rows.is_empty() {
            return "missing".into();
        }
        let ok = rows.iter().filter(|(_, r)| r.ok()).count();
        if ok == rows.len() {
            return "ok".into();
        }
        let first = rows[0].1.status();
        if ok == 0 && rows.iter().all(|(_, r)| r.status() == first) {
            return first.to_string();
        }
        let bad: Vec<String> = rows
            .iter()
            .filter(|(_, r)| !r.ok())
            .map(|(s, r)| format!("{s}: {}", r.status()))
            .collect();
        format!("{ok}/{} ok; {}", rows.len(), bad.join(", "))
    }

    /// The largest peak memory of afdep's strategies in a cell, GiB.
    pub fn afdep_peak(&self, cell: &Cell) -> Option<f64> {
        self.strategies
            .iter()
            .filter_map(|s| self.afdep(s, cell)?.peak_gib)
            .filter(|v| v.is_finite())
            .reduce(f64::max)
    }

    /// Whether the rows hold more than one shape.
    pub fn many_shapes(&self) -> bool {
        self.cells.iter().any(|c| c.shape != self.cells[0].shape)
    }

    /// Any afdep row of a cell (for its dimensions).
    fn any_afdep(&self, cell: &Cell) -> Option<&Row> {
        self.strategies.iter().find_map(|s| self.afdep(s, cell))
    }

    /// Whether any afdep row was read.
    pub fn has_afdep(&self) -> bool {
        !self.afdep.is_empty()
    }
}

/// A time in ms with 3–4 significant digits.
pub fn fmt_ms(v: f64) -> String {
    if v < 10.0 {
        format!("{v:.3}")
    } else if v < 100.0 {
        format!("{v:.2}")
    } else {
        format!("{v:.1}")
    }
}

/// A token count with thousands separators.
pub fn fmt_tokens(t: usize) -> String {
    let s = t.to_string();
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    out
}

fn fmt_opt(v: Option<f64>, f: impl Fn(f64) -> String) -> String {
    v.filter(|x| x.is_finite()).map_or_else(|| "—".into(), f)
}

fn fmt_err(v: Option<f64>) -> String {
    fmt_opt(v, |x| format!("{x:.1e}"))
}

/// The time cell of a row: the time, or the status when there is none.
fn time_cell(r: Option<&Row>, phase: Phase) -> String {
    match r {
        None => "not run".into(),
        Some(r) => match phase.ms(r) {
            Some(ms) if r.ok() => fmt_ms(ms),
            Some(ms) => format!("{} ({})", fmt_ms(ms), r.status()),
            None => r.status().to_string(),
        },
    }
}

fn ratio_cell(peer: Option<&Row>, afdep_ms: Option<f64>, phase: Phase) -> String {
    let p = peer.filter(|r| r.ok()).and_then(|r| phase.ms(r));
    match ratio(p, afdep_ms) {
        Some(x) => format!("{x:.2}"),
        None => "—".into(),
    }
}

/// What the header of the block says about the run.
#[derive(Debug, Clone)]
pub struct RunInfo {
    /// Date of the run.
    pub date: String,
    /// Commit of the binaries.
    pub commit: String,
    /// The rows files and how many rows each gave.
    pub sources: Vec<(String, usize)>,
}

/// The generated markdown block, markers included.
pub fn markdown(c: &Comparison, info: &RunInfo) -> String {
    let mut m = String::new();
    let join = |v: &[String]| {
        if v.is_empty() {
            "unknown".to_string()
        } else {
            v.join(", ")
        }
    };
    let _ = writeln!(
        m,
        "{BEGIN} (written by `afdep report moe`: edits inside are replaced) -->"
    );
    let _ = writeln!(m, "### {}: afdep and the peers in one run\n", info.date);
    let _ = writeln!(
        m,
        "- Date: {}; GPU: {}; commit: `{}`; kernel digest: `{}`.",
        info.date,
        join(&c.devices),
        info.commit,
        join(&c.digests)
    );
    let src: Vec<String> = info
        .sources
        .iter()
        .map(|(f, n)| format!("`{f}` ({n} rows)"))
        .collect();
    let _ = writeln!(m, "- Rows: {}.", src.join(", "));
    let _ = writeln!(
        m,
        "- Ratio = peer ms / afdep ms: above 1 means afdep is faster. \"Best\" is afdep's fastest \
         strategy whose errors are within tolerance (status `ok`); a peer's time counts only with \
         status `ok`. Times are medians of CUDA-event timings (JAX: wall clock after \
         `block_until_ready`)."
    );
    m.push('\n');
    suite_table(&mut m, c);
    for phase in Phase::BOTH {
        let _ = writeln!(m, "#### Best afdep strategy, {}\n", phase.title());
        let mut head = "| shape | tokens | afdep best ms |".to_string();
        let mut rule = "|---|---|---|".to_string();
        for p in &c.peers {
            let _ = write!(head, " {p} ms | ratio |");
            rule.push_str("---|---|");
        }
        let _ = writeln!(m, "{head}\n{rule}");
        for cell in &c.cells {
            let best = c.best(phase, cell);
            let mut line = format!(
                "| {} | {} | {} |",
                cell.shape,
                fmt_tokens(cell.tokens),
                best.map_or_else(
                    || "no ok row".into(),
                    |(s, ms)| format!("{} ({s})", fmt_ms(ms))
                )
            );
            for p in &c.peers {
                let r = c.peer(p, cell);
                let _ = write!(
                    line,
                    " {} | {} |",
                    time_cell(r, phase),
                    ratio_cell(r, best.map(|b| b.1), phase)
                );
            }
            let _ = writeln!(m, "{line}");
        }
        m.push('\n');
    }

    let _ = writeln!(m, "#### Every afdep strategy\n");
    let mut head = "| shape | tokens | dispatch | fwd ms | train ms |".to_string();
    let mut rule = "|---|---|---|---|---|".to_string();
    for p in &c.peers {
        let _ = write!(head, " fwd vs {p} | train vs {p} |");
        rule.push_str("---|---|");
    }
    head.push_str(" out_err | gx_err | gw_err | peak GiB | status |");
    rule.push_str("---|---|---|---|---|");
    let _ = writeln!(m, "{head}\n{rule}");
    for cell in &c.cells {
        for s in &c.strategies {
            let Some(r) = c.afdep(s, cell) else { continue };
            let mut line = format!(
                "| {} | {} | {s} | {} | {} |",
                cell.shape,
                fmt_tokens(cell.tokens),
                fmt_opt(Phase::Forward.ms(r), fmt_ms),
                fmt_opt(Phase::Train.ms(r), fmt_ms)
            );
            for p in &c.peers {
                let pr = c.peer(p, cell);
                for phase in Phase::BOTH {
                    let _ = write!(line, " {} |", ratio_cell(pr, phase.ms(r), phase));
                }
            }
            let _ = writeln!(
                m,
                "{line} {} | {} | {} | {} | {} |",
                fmt_err(r.out_err),
                fmt_err(r.gx_err),
                fmt_err(r.gw_err),
                fmt_opt(r.peak_gib, |x| format!("{x:.2}")),
                r.status()
            );
        }
    }
    m.push('\n');

    if !c.peers.is_empty() {
        let _ = writeln!(m, "#### Peers\n");
        let _ = writeln!(
            m,
            "A peer's errors are against the f32 function of docs/design.md (Specification) computed by the peer \
             script itself (`oracle_*`, when present) and against afdep's outputs on the same \
             inputs (`out_err`, `gx_err`, `gw_err`; null when they were not given).\n"
        );
        let _ = writeln!(
            m,
            "| shape | tokens | impl | fwd ms | train ms | oracle out / dx / dw | out_err | gx_err | gw_err | peak GiB | status |\n\
             |---|---|---|---|---|---|---|---|---|---|---|"
        );
        let mut cells: Vec<Cell> = c.cells.clone();
        for (_, cell) in c.peer.keys() {
            if !cells.contains(cell) {
                cells.push(cell.clone());
            }
        }
        for cell in &cells {
            for p in &c.peers {
                let Some(r) = c.peer(p, cell) else { continue };
                let oracle = format!(
                    "{} / {} / {}",
                    fmt_err(r.oracle_out_err),
                    fmt_err(r.oracle_gx_err),
                    fmt_err(r.oracle_gw_err)
                );
                let _ = writeln!(
                    m,
                    "| {} | {} | {p} | {} | {} | {oracle} | {} | {} | {} | {} | {} |",
                    cell.shape,
                    fmt_tokens(cell.tokens),
                    fmt_opt(Phase::Forward.ms(r), fmt_ms),
                    fmt_opt(Phase::Train.ms(r), fmt_ms),
                    fmt_err(r.out_err),
                    fmt_err(r.gx_err),
                    fmt_err(r.gw_err),
                    fmt_opt(r.peak_gib, |x| format!("{x:.2}")),
                    r.status()
                );
            }
        }
        m.push('\n');
    }
    if c.skipped > 0 {
        let _ = writeln!(
            m,
            "{} input lines were not rows of this comparison and were skipped.\n",
            c.skipped
        );
    }
    let _ = writeln!(m, "![fwd and train step per token count](moe.png)");
    m.push_str(END);
    m.push('\n');
    m
}

/// The suite table: per cell, afdep's best strategy against the best peer, both phases.
fn suite_table(m: &mut String, c: &Comparison) {
    let _ = writeln!(m, "#### Suite: afdep's best strategy and the best peer\n");
    let _ = writeln!(
        m,
        "Speed-up = best peer ms / afdep ms (above 1: afdep is faster). TFLOP/s count the \
         router, expert and shared GEMMs (`2·T·H·E + 6·T·K·H·W + 6·T·H·S` per forward; train \
         step = 3 × forward), % is of {} TFLOP/s. Peak GiB: afdep's largest strategy / the best \
         forward peer's process. Status: afdep's strategies against the GPU reference.\n",
        crate::shapes::PEAK_TFLOPS
    );
    let _ = writeln!(
        m,
        "| shape | tokens | fwd ms (afdep) | fwd TFLOP/s (%) | best peer fwd ms | fwd speed-up | \
         train ms (afdep) | train TFLOP/s (%) | best peer train ms | train speed-up | peak GiB \
         afdep / peer | status |\n\
         |---|---|---|---|---|---|---|---|---|---|---|---|"
    );
    for cell in &c.cells {
        let mut line = format!("| {} | {} |", cell.shape, fmt_tokens(cell.tokens));
        let dims = c.any_afdep(cell);
        for phase in Phase::BOTH {
            let best = c.best(phase, cell);
            let peer = c.best_peer(phase, cell);
            let rate = best.and_then(|(_, ms)| {
                let t = crate::shapes::tflops(phase_flops(phase, dims?)?, Some(ms))?;
                Some(format!(
                    "{t:.0} ({:.0} %)",
                    crate::shapes::pct_of_peak(Some(t))?
                ))
            });
            let _ = write!(
                line,
                " {} | {} | {} | {} |",
                best.map_or_else(
                    || "no ok row".into(),
                    |(s, ms)| format!("{} ({s})", fmt_ms(ms))
                ),
                rate.unwrap_or_else(|| "—".into()),
                peer.map_or_else(|| "—".into(), |(p, ms)| format!("{} ({p})", fmt_ms(ms))),
                match ratio(peer.map(|p| p.1), best.map(|b| b.1)) {
                    Some(x) => format!("{x:.2}×"),
                    None => "—".into(),
                }
            );
        }
        let peer_peak = c
            .best_peer(Phase::Forward, cell)
            .and_then(|(p, _)| c.peer(p, cell)?.peak_gib);
        let mut status = c.afdep_status(cell);
        if status != "ok" {
            if let Some(n) = c
                .strategies
                .iter()
                .filter_map(|s| c.afdep(s, cell))
                .find_map(|r| r.note.as_deref().filter(|_| !r.ok()))
            {
                let short: String = n.chars().take(120).collect();
                status = format!("{status}: {}", short.replace('|', "/"));
            }
        }
        let _ = writeln!(
            m,
            "{line} {} / {} | {status} |",
            fmt_opt(c.afdep_peak(cell), |x| format!("{x:.2}")),
            fmt_opt(peer_peak, |x| format!("{x:.2}")),
        );
    }
    m.push('\n');
}

/// `doc` with its generated block replaced by `block` (which holds its own markers); the block
/// is appended after a blank line when `doc` has none. Text outside the block is unchanged.
pub fn replace_block(doc: &str, block: &str) -> Result<String, MarkerError> {
    let lines: Vec<&str> = doc.split_inclusive('\n').collect();
    let begins: Vec<usize> = (0..lines.len())
        .filter(|&i| lines[i].trim_start().starts_with(BEGIN))
        .collect();
    let ends: Vec<usize> = (0..lines.len())
        .filter(|&i| lines[i].trim() == END)
        .collect();
    match (begins.as_slice(), ends.as_slice()) {
        ([], []) => {
            let mut out = doc.to_string();
            if !out.is_empty() {
                if !out.ends_with('\n') {
                    out.push('\n');
                }
                if !out.ends_with("\n\n") {
                    out.push('\n');
                }
            }
            out.push_str(block);
            Ok(out)
        }
        ([b], [e]) if b < e => {
            let mut out: String = lines[..*b].concat();
            out.push_str(block);
            if !block.ends_with('\n') {
                out.push('\n');
            }
            out.push_str(&lines[e + 1..].concat());
            Ok(out)
        }
        ([b], [e]) => Err(MarkerError::Order {
            begin: b + 1,
            end: e + 1,
        }),
        (b, e) => Err(MarkerError::Count {
            begins: b.len(),
            ends: e.len(),
        }),
    }
}

/// Today's date (UTC) as `YYYY-MM-DD`.
pub fn today_utc() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let (y, m, d) = civil_from_days((secs / 86_400) as i64);
    format!("{y:04}-{m:02}-{d:02}")
}

/// The proleptic Gregorian date of a day count since 1970-01-01 (H. Hinnant's algorithm).
pub fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

fn read(path: &Path) -> Result<String, ReportError> {
    std::fs::read_to_string(path).map_err(|source| ReportError::Read {
        path: path.to_path_buf(),
        source,
    })
}

fn write(path: &Path, text: &str) -> Result<(), ReportError> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(|source| ReportError::Write {
            path: path.to_path_buf(),
            source,
        })?;
    }
    std::fs::write(path, text).map_err(|source| ReportError::Write {
        path: path.to_path_buf(),
        source,
    })
}

/// Runs `afdep report moe`: prints the block, writes it into `--md` and draws `--png`.
pub fn run(a: ReportMoeArgs) -> Result<(), ReportError> {
    let mut rows = Vec::new();
    let mut skipped = 0;
    let mut sources = Vec::new();
    for p in &a.rows {
        let (r, s) = parse_rows(&read(p)?);
        if s > 0 {
            tracing::warn!(file = %p.display(), lines = s, "skipped lines that are not rows");
        }
        let name = p
            .file_name()
            .map_or_else(|| p.display().to_string(), |n| n.to_string_lossy().into());
        sources.push((name, r.len()));
        skipped += s;
        rows.extend(r);
    }
    let c = Comparison::new(rows, skipped);
    if !c.has_afdep() {
        return Err(ReportError::NoAfdepRows {
            files: a
                .rows
                .iter()
                .map(|p| p.display().to_string())
                .collect::<Vec<_>>()
                .join(", "),
        });
    }
    let info = RunInfo {
        date: a.date.clone().unwrap_or_else(today_utc),
        commit: a.commit.clone(),
        sources,
    };
    let block = markdown(&c, &info);
    print!("{block}");
    if let Some(md) = &a.md {
        let doc = if md.exists() {
            read(md)?
        } else {
            String::new()
        };
        let new = replace_block(&doc, &block).map_err(|source| ReportError::Markers {
            path: md.clone(),
            source,
        })?;
        write(md, &new)?;
        tracing::info!(path = %md.display(), "markdown written");
    }
    if let Some(png) = &a.png {
        let title = format!(
            "afdep MoE layer vs peers: {}, {}, commit {}, kernels {}",
            info.date,
            c.devices.first().map_or("unknown GPU", String::as_str),
            info.commit,
            c.digests.first().map_or("unknown", String::as_str)
        );
        crate::report_png::draw(png, &c, &title)?;
        tracing::info!(path = %png.display(), "chart written");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(imp: &str, d: &str, t: usize, fwd: Option<f64>, train: Option<f64>, st: &str) -> Row {
        Row {
            tokens: t,
            shape: None,
            d_model: None,
            width: None,
            experts: None,
            top_k: None,
            shared: None,
            note: None,
            oracle_out_err: None,
            oracle_gx_err: None,
            oracle_gw_err: None,
            implementation: imp.into(),
            dispatch: Some(d.into()),
            fwd_ms: fwd,
            train_ms: train,
            out_err: None,
            gx_err: None,
            gw_err: None,
            status: Some(st.into()),
            peak_gib: None,
            digest: Some("abc".into()),
            device: Some("NVIDIA H200".into()),
        }
    }

    fn sample() -> Comparison {
        Comparison::new(
            vec![
                row("afdep", "sorted", 16384, Some(1.0), Some(3.0), "ok"),
                row(
                    "afdep",
                    "fused",
                    16384,
                    Some(0.5),
                    Some(4.0),
                    "error_too_large",
                ),
                row("afdep", "gather", 16384, Some(0.8), Some(3.5), "ok"),
                row("afdep", "sorted", 131072, None, None, "oom"),
                row(
                    "torch_grouped_mm",
                    "sorted",
                    16384,
                    Some(1.6),
                    Some(3.6),
                    "ok",
                ),
                row(
                    "jax_ragged_dot",
                    "sorted",
                    16384,
                    Some(10.0),
                    Some(40.0),
                    "ok",
                ),
                row("jax_ragged_dot", "sorted", 131072, None, None, "oom"),
            ],
            0,
        )
    }

    #[test]
    fn ratios_are_peer_over_afdep() {
        assert_eq!(ratio(Some(3.0), Some(1.5)), Some(2.0));
        assert_eq!(ratio(None, Some(1.0)), None);
        assert_eq!(ratio(Some(1.0), Some(0.0)), None);
        assert_eq!(ratio(Some(f64::NAN), Some(1.0)), None);
        assert_eq!(ratio(Some(1.0), Some(f64::INFINITY)), None);
    }

    #[test]
    fn best_skips_rows_that_are_not_ok() {
        let c = sample();
        // fused is faster but its errors are too large
        let (small, large) = (Cell::new("?", 16384), Cell::new("?", 131072));
        assert_eq!(c.best(Phase::Forward, &small), Some(("gather", 0.8)));
        assert_eq!(c.best(Phase::Train, &small), Some(("sorted", 3.0)));
        assert_eq!(c.best(Phase::Forward, &large), None);
        assert_eq!(c.cells, vec![small.clone(), large.clone()]);
        assert_eq!(
            c.best_peer(Phase::Forward, &small),
            Some(("torch_grouped_mm", 1.6))
        );
        assert_eq!(c.best_peer(Phase::Forward, &large), None);
        assert_eq!(c.afdep_status(&small), "2/3 ok; fused: error_too_large");
        // a cell without afdep rows (a suite cut short) is missing, not ok
        assert_eq!(c.afdep_status(&Cell::new("?", 7)), "missing");
        assert_eq!(c.afdep_status(&large), "oom");
        assert_eq!(c.strategies, vec!["sorted", "fused", "gather"]);
        assert_eq!(c.peers, vec!["torch_grouped_mm", "jax_ragged_dot"]);
    }

    #[test]
    fn markdown_holds_the_ratios_and_statuses() {
        let c = sample();
        let info = RunInfo {
            date: "2026-12-03".into(),
            commit: "0c958db".into(),
            sources: vec![("afdep.jsonl".into(), 4)],
        };
        let m = markdown(&c, &info);
        assert!(m.starts_with(BEGIN), "{m}");
        assert!(m.ends_with(&format!("{END}\n")));
        assert!(m.contains("NVIDIA H200"));
        assert!(m.contains("`0c958db`"));
        assert!(m.contains("`abc`"));
        // best forward 0.8 (gather) vs torch 1.6 -> 2.00, vs jax 10 -> 12.50
        assert!(
            m.contains("| 16,384 | 0.800 (gather) | 1.600 | 2.00 | 10.00 | 12.50 |"),
            "{m}"
        );
        // train: best 3.0 (sorted) vs torch 3.6 -> 1.20
        assert!(m.contains("| 16,384 | 3.000 (sorted) | 3.600 | 1.20 | 40.00 | 13.33 |"));
        // a peer out of memory shows its status, no ratio
        assert!(
            m.contains("| 131,072 | no ok row | not run | — | oom | — |"),
            "{m}"
        );
        // every strategy: fused forward 0.5 vs torch 1.6 -> 3.20, flagged by its status
        assert!(
            m.contains("| 16,384 | fused | 0.500 | 4.000 | 3.20 | 0.90 |"),
            "{m}"
        );
        assert!(m.contains("error_too_large |"));
    }

    #[test]
    fn rows_parse_and_skip_what_is_not_a_row() {
        let text = "\n{\"tokens\": 16, \"impl\": \"afdep\", \"dispatch\": \"sorted\", \
                    \"fwd_ms\": 1.5, \"train_ms\": null, \"status\": \"ok\"}\n\
                    W1202 a warning line\n{\"peer\": \"no impl\"}\n[1, 2]\n";
        let (rows, skipped) = parse_rows(text);
        assert_eq!(skipped, 3);
        assert_eq!(rows.len(), 1);
        assert_eq!(rows[0].fwd_ms, Some(1.5));
        assert_eq!(rows[0].train_ms, None);
        // the CPU oracle's rows are not part of the comparison; the last duplicate wins
        let mut a = rows[0].clone();
        a.fwd_ms = Some(2.5);
        let mut cpu = rows[0].clone();
        cpu.implementation = "afdep-cpu-oracle".into();
        let c = Comparison::new(vec![rows[0].clone(), a, cpu], skipped);
        assert_eq!(c.skipped, 4);
        assert_eq!(
            c.afdep("sorted", &Cell::new("?", 16)).unwrap().fwd_ms,
            Some(2.5)
        );
    }

    #[test]
    fn block_replacement_keeps_the_hand_written_text() {
        let block = format!("{BEGIN} x -->\nnew\n{END}\n");
        // no block yet: appended after a blank line
        assert_eq!(
            replace_block("# Title\ntext", &block).unwrap(),
            format!("# Title\ntext\n\n{block}")
        );
        assert_eq!(replace_block("", &block).unwrap(), block);
        // a block: replaced, text before and after kept byte for byte
        let doc = format!("# T\n\nbefore\n{BEGIN} old -->\nold\nold\n{END}\nafter\n");
        assert_eq!(
            replace_block(&doc, &block).unwrap(),
            format!("# T\n\nbefore\n{block}after\n")
        );
        // idempotent
        let once = replace_block(&doc, &block).unwrap();
        assert_eq!(replace_block(&once, &block).unwrap(), once);
        // broken markers are errors, never a guess
        assert_eq!(
            replace_block(&format!("{END}\n{BEGIN} -->\n"), &block),
            Err(MarkerError::Order { begin: 2, end: 1 })
        );
        assert_eq!(
            replace_block(&format!("{BEGIN} -->\nx\n"), &block),
            Err(MarkerError::Count { begins: 1, ends: 0 })
        );
        assert!(matches!(
            replace_block(&format!("{block}{block}"), &block),
            Err(MarkerError::Count { begins: 2, ends: 2 })
        ));
    }

    /// The committed sample of a suite run (made up numbers, the rows' real format).
    const SUITE_ROWS: &str = include_str!("../tests/fixtures/suite-rows.jsonl");

    #[test]
    fn the_suite_table_has_one_row_per_cell() {
        let (rows, skipped) = parse_rows(SUITE_ROWS);
        assert_eq!(skipped, 0);
        let c = Comparison::new(rows, skipped);
        assert!(c.many_shapes());
        let names: Vec<String> = c
            .cells
            .iter()
            .map(|c| format!("{} {}", c.shape, c.tokens))
            .collect();
        assert_eq!(
            names,
            [
                "record 16384",
                "record 131072",
                "mixtral-8x7b 4096",
                "qwen1.5-moe-a2.7b 4096"
            ]
        );
        let info = RunInfo {
            date: "2026-12-04".into(),
            commit: "abc".into(),
            sources: vec![],
        };
        let m = markdown(&c, &info);
        // record at 16k: best afdep fwd 1.0 ms (fused_gsum; sorted 1.2), 2·16384·(512·64 +
        // 3·8·512·128 + 3·512·1024) FLOP / 1 ms = 104 TFLOP/s = 13 % of 790; best peer: compile
        // 1.5 ms (eager 2.0) -> 1.50×; train 3.0 (sorted) vs eager 3.3 -> 1.10×
        assert!(
            m.contains(
                "| record | 16,384 | 1.000 (fused_gsum) | 104 (13 %) | 1.500 (torch_compile) | 1.50× | \
                 3.000 (sorted) | 104 (13 %) | 3.300 (torch_grouped_mm) | 1.10× | 0.50 / 0.90 | ok |"
            ),
            "{m}"
        );
        // a shape the layer refuses: its status and error, no times
        assert!(
            m.contains(
                "| qwen1.5-moe-a2.7b | 4,096 | no ok row | — | 2.000 (torch_grouped_mm) | — | \
                 no ok row | — | 6.000 (torch_grouped_mm) | — | — / 3.00 | unsupported: experts \
                 must be a positive multiple of 8 |"
            ),
            "{m}"
        );
        // a peer that timed out gives no best peer; afdep's times stay
        assert!(
            m.contains("| mixtral-8x7b | 4,096 | 20.00 (sorted) |"),
            "{m}"
        );
        assert!(
            m.contains("| mixtral-8x7b | 4,096 | torch_compile | — | — |"),
            "{m}"
        );
        // the peers' oracle errors are shown
        assert!(m.contains("| 1.0e-3 / 2.0e-3 / 3.0e-3 |"), "{m}");
        let dir = tempfile::tempdir().unwrap();
        let png = dir.path().join("suite.png");
        crate::report_png::draw(&png, &c, "suite").unwrap();
        assert!(std::fs::read(&png).unwrap().starts_with(b"\x89PNG"));
    }

    #[test]
    fn dates_and_numbers_format() {
        assert_eq!(civil_from_days(0), (1970, 1, 1));
        assert_eq!(civil_from_days(20_425), (2025, 12, 3));
        assert_eq!(civil_from_days(-1), (1969, 12, 31));
        assert_eq!(civil_from_days(11_016), (2000, 2, 29));
        assert_eq!(today_utc().len(), 10);
        assert_eq!(fmt_tokens(1_048_576), "1,048,576");
        assert_eq!(fmt_tokens(999), "999");
        assert_eq!(fmt_ms(0.9384), "0.938");
        assert_eq!(fmt_ms(20.584), "20.58");
        assert_eq!(fmt_ms(161.84), "161.8");
    }
}
