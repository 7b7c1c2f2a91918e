//! `afdep moe`: the MoE layer, forward and train step, one JSON row per (tokens, dispatch).
//!
//! - On the GPU (`--backend cuda`, or `auto` with a usable GPU): [`afdep_moe::MoeLayer`] for
//!   every dispatch strategy of `--dispatch` at every token count of `--tokens`, timed with
//!   CUDA events and checked against the GPU reference path ([`crate::moe_gpu`]).
//! - On the CPU (`--backend cpu`, or `auto` without a GPU): the CPU oracle of afdep-core, timed
//!   by the wall clock (`impl` = `afdep-cpu-oracle`, `dispatch` = `reference`).
//!
//! Inputs are afdep-core's seeded random parameters (`LayerParams::random(shape, seed)`),
//! tokens (`random_tokens(T, H, seed)`) and upstream gradient (`uniform_bf16(T·H, 1, seed,
//! 200)`), or one `--input` file. `--write-inputs DIR` writes them, one safetensors file per
//! token count ([`inputs_path`]), for the peer scripts; `--write-outputs DIR` writes the
//! outputs of the first strategy of `--dispatch` that runs (or of the oracle) per token count
//! ([`outputs_path`]), for the peers' error columns.
//!
//! `--suite models|record` and `--shape NAME` run named shapes ([`crate::shapes`]), each at
//! its own token counts (or `--tokens`) and timed runs (or `--iters`); their rows carry the
//! shape's name, and their files go to `DIR/NAME/`. In a suite, a configuration that fails is
//! a row with status `error` and the error in `note` (a shape the layer refuses is
//! `unsupported`, as everywhere), the sweep goes on, and the command fails at the end.
//! Every row has the achieved TFLOP/s and percent of 790 TFLOP/s of its forward and train
//! step ([`crate::shapes`] documents the FLOP count).

use std::fs::File;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use afdep_core::oracle::layer;
use afdep_core::oracle::params::{PARAM_NAMES, random_tokens};
use afdep_core::oracle::{LayerGrads, LayerParams};
use afdep_core::route::route;
use afdep_core::tensor::uniform_bf16;
use afdep_core::{LayerShape, bf16};
use afdep_moe::Dispatch;
use anyhow::{Context, Result, bail};
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;
use tracing::{info, warn};

use crate::Backend;
use crate::shapes::{self, NamedShape, Suite};
use crate::tensor_file::TensorFile;

/// Token counts of the GPU sweep by default (the reference record's, docs/design.md, "The reference
/// record").
pub const GPU_TOKENS: [usize; 3] = [16_384, 131_072, 1_048_576];
/// Token count of the CPU oracle by default.
pub const CPU_TOKENS: usize = 16_384;
/// Timed runs per GPU measurement by default.
pub const GPU_ITERS: usize = 10;

/// A comma-separated list of dispatch strategies (`sorted,gather,fused,fused_gsum`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DispatchList(pub Vec<Dispatch>);

impl std::str::FromStr for DispatchList {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let mut v: Vec<Dispatch> = Vec::new();
        for p in s.split(',').map(str::trim) {
            let d: Dispatch = p.parse()?;
            if v.contains(&d) {
                return Err(format!("dispatch `{p}` is listed twice"));
            }
            v.push(d);
        }
        Ok(DispatchList(v))
    }
}

/// The flags a named shape (`--suite`, `--shape`) replaces.
const SHAPE_FLAGS: [&str; 7] = [
    "input",
    "d_model",
    "width",
    "experts",
    "top_k",
    "shared",
    "no_renormalize",
];

/// Arguments of `afdep moe`.
#[derive(Debug, Args)]
pub struct MoeArgs {
    /// Where to run: `auto` takes the GPU when one is usable, else the CPU oracle.
    #[arg(long, value_enum, default_value = "auto")]
    pub backend: Backend,
    /// Run a suite of named shapes, each at its token counts (`--tokens` replaces them):
    /// `models` (every shape of `--shape`), `record` (the record's shape).
    #[arg(long, value_enum, conflicts_with_all = SHAPE_FLAGS)]
    pub suite: Option<Suite>,
    /// Run one named shape at its token counts (`--tokens` replaces them): record,
    /// qwen3-30b-a3b, mixtral-8x7b, deepseek-v3, gpt-oss-120b, qwen1.5-moe-a2.7b,
    /// olmoe-1b-7b.
    #[arg(long, value_parser = shapes::lookup, conflicts_with_all = SHAPE_FLAGS, conflicts_with = "suite")]
    pub shape: Option<NamedShape>,
    /// With --suite or --shape: print one `NAME TOKENS ITERS` line per run (the shape, a
    /// token count, the timed runs) and run nothing (for scripts: peers/run_suite.sh).
    #[arg(long)]
    pub list: bool,
    /// Token counts, comma-separated (`16k`, `1M` allowed) [default: 16384,131072,1048576 on
    /// the GPU, 16384 on the CPU]. Ignored with `--input`.
    #[arg(long)]
    pub tokens: Option<crate::TokenList>,
    /// Hidden size.
    #[arg(long, default_value_t = 512)]
    pub d_model: usize,
    /// Expert width.
    #[arg(long, default_value_t = 128)]
    pub width: usize,
    /// Number of experts.
    #[arg(long, default_value_t = 64)]
    pub experts: usize,
    /// Experts per token.
    #[arg(long, default_value_t = 8)]
    pub top_k: usize,
    /// Shared expert width (0 = none).
    #[arg(long, default_value_t = 1024)]
    pub shared: usize,
    /// Do not renormalise the top-k weights.
    #[arg(long)]
    pub no_renormalize: bool,
    /// Dispatch strategies (GPU), comma-separated: sorted, gather, fused, fused_gsum.
    #[arg(long, default_value = "sorted,gather,fused,fused_gsum")]
    pub dispatch: DispatchList,
    /// Seed of the random parameters, tokens and upstream gradient.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Run the forward only (no train step).
    #[arg(long)]
    pub forward_only: bool,
    /// Timed runs per measurement; the median is reported. GPU: after 3 warm-ups [default:
    /// 10 on the GPU, 1 on the CPU].
    #[arg(long, visible_alias = "repeats")]
    pub iters: Option<usize>,
    /// Append every row to this JSONL file too (created if missing).
    #[arg(long)]
    pub json_out: Option<PathBuf>,
    /// Read inputs from this safetensors file (x, wr, w1, w3, w2, s1, s3, s2, optionally dy;
    /// metadata top_k and renormalize).
    #[arg(long)]
    pub input: Option<PathBuf>,
    /// Write outputs to this safetensors file (y, topk_idx, and dx, dwr, dw1, dw3, dw2, ds1,
    /// ds3, ds2 after a train step): one token count only; on the GPU, of the first strategy.
    #[arg(long)]
    pub output: Option<PathBuf>,
    /// Write the inputs of each token count to DIR/moe-inputs-T.safetensors (the tensors of
    /// `--input`, plus metadata seed and tokens), for the peer scripts.
    #[arg(long, value_name = "DIR")]
    pub write_inputs: Option<PathBuf>,
    /// With --write-inputs: only write the inputs, run nothing.
    #[arg(long, requires = "write_inputs")]
    pub inputs_only: bool,
    /// Write the outputs of each token count (on the GPU those of the first strategy of
    /// --dispatch that runs, on the CPU the oracle's) to DIR/moe-outputs-T.safetensors, for
    /// the peers' error columns.
    #[arg(long, value_name = "DIR")]
    pub write_outputs: Option<PathBuf>,
    /// GPU: first run the stage check of the router, validation, layout, permute and
    /// un-permute against afdep-core (one extra row per token count; stops on a mismatch).
    #[arg(long, conflicts_with = "inputs_only")]
    pub stage_check: bool,
}

/// One JSON row, with the fields of the MoE-layer record plus `peak_gib`, `digest` and the
/// run's context.
#[derive(Debug, Clone, Serialize)]
pub struct MoeRow {
    /// Hidden size.
    pub d_model: usize,
    /// Expert width.
    pub width: usize,
    /// Experts.
    pub experts: usize,
    /// Top-k.
    pub top_k: usize,
    /// Shared width.
    pub shared: usize,
    /// Tokens.
    pub tokens: usize,
    /// The named shape (`--suite`, `--shape`); absent otherwise.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub shape: Option<String>,
    /// Implementation: `afdep` (the GPU layer) or `afdep-cpu-oracle`.
    #[serde(rename = "impl")]
    pub implementation: String,
    /// Dispatch strategy (`reference` for the oracle).
    pub dispatch: String,
    /// Forward time, ms (median); null when it did not run.
    pub fwd_ms: Option<f64>,
    /// Train-step time, ms (median); null when it did not run.
    pub train_ms: Option<f64>,
    /// Achieved TFLOP/s of the forward ([`shapes::forward_flops`] / `fwd_ms`).
    pub fwd_tflops: Option<f64>,
    /// Achieved TFLOP/s of the train step ([`shapes::train_flops`] / `train_ms`).
    pub train_tflops: Option<f64>,
    /// `fwd_tflops` in percent of [`shapes::PEAK_TFLOPS`].
    pub fwd_pct_peak: Option<f64>,
    /// `train_tflops` in percent of [`shapes::PEAK_TFLOPS`].
    pub train_pct_peak: Option<f64>,
    /// Max |a-b| / max |b| of the output against the reference path (null where not
    /// computed: the oracle's own rows, or a failed configuration).
    pub out_err: Option<f64>,
    /// Same for the input gradient.
    pub gx_err: Option<f64>,
    /// Same for the parameter gradients (max over tensors).
    pub gw_err: Option<f64>,
    /// `ok`, `error_too_large`, `oom`, `unsupported`, or what went wrong.
    pub status: String,
    /// Peak device memory of the configuration, GiB (every buffer the layer allocates);
    /// null on the CPU.
    pub peak_gib: Option<f64>,
    /// Device memory in use by the configuration by `cuMemGetInfo`, GiB (GPU).
    pub mem_used_gib: Option<f64>,
    /// Digest of the kernel sources.
    pub digest: String,
    /// GPU name (null on the CPU).
    pub device: Option<String>,
    /// Timed runs per measurement.
    pub iters: usize,
    /// The GEMM engines the layer chose (`afdep_kernels::ops::gemm::describe`: rows engine,
    /// pairing, weight-gradient engine), as the environment asked.
    pub gemm: String,
    /// Seed of the inputs (null for `--input`).
    pub seed: Option<u64>,
    /// What happened, where the status needs explaining.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
}

impl MoeRow {
    /// A row with no results yet (status `not run`).
    pub fn new(
        s: &LayerShape,
        tokens: usize,
        implementation: &str,
        dispatch: &str,
        iters: usize,
    ) -> Self {
        MoeRow {
            d_model: s.d_model,
            width: s.width,
            experts: s.experts,
            top_k: s.top_k,
            shared: s.shared,
            tokens,
            shape: None,
            implementation: implementation.into(),
            dispatch: dispatch.into(),
            fwd_ms: None,
            train_ms: None,
            fwd_tflops: None,
            train_tflops: None,
            fwd_pct_peak: None,
            train_pct_peak: None,
            out_err: None,
            gx_err: None,
            gw_err: None,
            status: "not run".into(),
            peak_gib: None,
            mem_used_gib: None,
            digest: afdep_kernels::source_digest(),
            device: None,
            iters,
            gemm: afdep_kernels::ops::gemm::describe(),
            seed: None,
            note: None,
        }
    }

    /// Fills the shape's name and the TFLOP/s columns from the times.
    pub fn finish(&mut self, shape: Option<&str>) {
        let s = LayerShape::renormalized(
            self.d_model,
            self.width,
            self.experts,
            self.top_k,
            self.shared,
        );
        self.shape = shape.map(str::to_string);
        self.fwd_tflops = shapes::tflops(shapes::forward_flops(&s, self.tokens), self.fwd_ms);
        self.train_tflops = shapes::tflops(shapes::train_flops(&s, self.tokens), self.train_ms);
        self.fwd_pct_peak = shapes::pct_of_peak(self.fwd_tflops);
        self.train_pct_peak = shapes::pct_of_peak(self.train_tflops);
    }
}

/// The inputs of one token count.
#[derive(Debug, Clone)]
pub struct Inputs {
    /// Parameters (and the shape), shared by the token counts of one shape.
    pub params: Arc<LayerParams>,
    /// Tokens, T × H.
    pub x: Vec<bf16>,
    /// Upstream gradient, T × H.
    pub dy: Vec<bf16>,
    /// T.
    pub tokens: usize,
    /// The seed they were made from (none when read from a file).
    pub seed: Option<u64>,
}

impl Inputs {
    /// The seeded inputs of `tokens` tokens (the same for every backend and the peers).
    pub fn seeded(params: &Arc<LayerParams>, tokens: usize, seed: u64) -> Self {
        let h = params.shape.d_model;
        Inputs {
            params: Arc::clone(params),
            x: random_tokens(tokens, h, seed),
            dy: uniform_bf16(tokens * h, 1.0, seed, 200),
            tokens,
            seed: Some(seed),
        }
    }
}

/// The outputs of one step, as written by `--output` / `--write-outputs`.
#[derive(Debug, Clone)]
pub struct LayerOutputs {
    /// Output, T × H.
    pub y: Vec<bf16>,
    /// dx, T × H (train step).
    pub dx: Option<Vec<bf16>>,
    /// Parameter gradients in `PARAM_NAMES` order (train step).
    pub dparams: Option<Vec<Vec<bf16>>>,
    /// The routes' expert ids, T × K.
    pub topk_idx: Option<Vec<i32>>,
    /// Who computed them.
    pub implementation: String,
    /// With which strategy.
    pub dispatch: String,
}

impl LayerOutputs {
    fn of_oracle(p: &LayerParams, x: &[bf16], y: Vec<bf16>, grads: Option<LayerGrads>) -> Self {
        let t = x.len() / p.shape.d_model.max(1);
        let (dx, dparams) = match grads {
            Some(g) => {
                let ps = g.params().into_iter().cloned().collect();
                (Some(g.dx), Some(ps))
            }
            None => (None, None),
        };
        LayerOutputs {
            y,
            dx,
            dparams,
            topk_idx: Some(route(x, &p.wr, t, &p.shape).idx),
            implementation: "afdep-cpu-oracle".into(),
            dispatch: "reference".into(),
        }
    }
}

/// `DIR/moe-inputs-T.safetensors`.
pub fn inputs_path(dir: &Path, tokens: usize) -> PathBuf {
    dir.join(format!("moe-inputs-{tokens}.safetensors"))
}

/// `DIR/moe-outputs-T.safetensors`.
pub fn outputs_path(dir: &Path, tokens: usize) -> PathBuf {
    dir.join(format!("moe-outputs-{tokens}.safetensors"))
}

fn shape_of(a: &MoeArgs) -> LayerShape {
    LayerShape {
        d_model: a.d_model,
        width: a.width,
        experts: a.experts,
        top_k: a.top_k,
        shared: a.shared,
        renormalize: !a.no_renormalize,
    }
}

/// Reads layer inputs from a safetensors file; the shape comes from the tensors, `top_k` and
/// `renormalize` from the metadata (else from the flags).
fn read_inputs(path: &Path, a: &MoeArgs) -> Result<Inputs> {
    let f = TensorFile::read(path)?;
    let (xs, x) = f.bf16("x")?;
    let (ws, _) = f.bf16("wr")?;
    let (w1s, _) = f.bf16("w1")?;
    if xs.len() != 2 || ws.len() != 2 || w1s.len() != 3 {
        bail!("x must be T × H, wr H × E, w1 E × H × W (got {xs:?}, {ws:?}, {w1s:?})");
    }
    let shared = if f.has("s1") {
        f.bf16("s1")?.0.get(1).copied().unwrap_or(0)
    } else {
        0
    };
    let top_k = match f.metadata.get("top_k") {
        Some(k) => k
            .parse()
            .with_context(|| format!("metadata top_k = {k:?}"))?,
        None => a.top_k,
    };
    let renormalize = match f.metadata.get("renormalize") {
        Some(v) => v
            .parse()
            .with_context(|| format!("metadata renormalize = {v:?}"))?,
        None => !a.no_renormalize,
    };
    let shape = LayerShape {
        d_model: xs[1],
        width: w1s[2],
        experts: ws[1],
        top_k,
        shared,
        renormalize,
    };
    shape.validate()?;
    let mut params = LayerParams::random(shape, 0);
    for (name, t) in PARAM_NAMES.iter().zip(params.tensors_mut()) {
        *t = if f.has(name) {
            f.bf16(name)?.1
        } else if shape.shared == 0 && name.starts_with('s') {
            Vec::new()
        } else {
            bail!("tensor `{name}` is missing from {}", path.display());
        };
    }
    params.check()?;
    let tokens = xs[0];
    let dy = if f.has("dy") {
        let (s, d) = f.bf16("dy")?;
        if s != xs {
            bail!("dy has shape {s:?}, x has {xs:?}");
        }
        d
    } else {
        uniform_bf16(tokens * shape.d_model, 1.0, a.seed, 200)
    };
    Ok(Inputs {
        params: Arc::new(params),
        x,
        dy,
        tokens,
        seed: None,
    })
}

/// Writes the inputs (the tensors `--input` reads, plus metadata `seed`, `tokens` and, for a
/// named shape, `shape`: the peers put it in their rows).
pub fn write_inputs(path: &Path, inp: &Inputs, shape: Option<&str>) -> Result<()> {
    let s = inp.params.shape;
    let mut f = TensorFile::default();
    f.put_bf16("x", &[inp.tokens, s.d_model], &inp.x);
    f.put_bf16("dy", &[inp.tokens, s.d_model], &inp.dy);
    for ((name, t), dims) in PARAM_NAMES
        .iter()
        .zip(inp.params.tensors())
        .zip(LayerParams::dims(&s))
    {
        f.put_bf16(name, &dims, t);
    }
    f.metadata
        .insert("format".into(), "afdep-moe-inputs-1".into());
    f.metadata.insert("top_k".into(), s.top_k.to_string());
    f.metadata
        .insert("renormalize".into(), s.renormalize.to_string());
    f.metadata.insert("tokens".into(), inp.tokens.to_string());
    if let Some(seed) = inp.seed {
        f.metadata.insert("seed".into(), seed.to_string());
    }
    if let Some(n) = shape {
        f.metadata.insert("shape".into(), n.to_string());
    }
    crate::jsonl::create_parent(path)?;
    f.write(path)
}

fn write_outputs(path: &Path, inp: &Inputs, o: &LayerOutputs) -> Result<()> {
    let s = inp.params.shape;
    let mut f = TensorFile::default();
    f.put_bf16("y", &[inp.tokens, s.d_model], &o.y);
    if let Some(dx) = &o.dx {
        f.put_bf16("dx", &[inp.tokens, s.d_model], dx);
    }
    if let Some(ps) = &o.dparams {
        for ((name, t), dims) in PARAM_NAMES.iter().zip(ps).zip(LayerParams::dims(&s)) {
            f.put_bf16(&format!("d{name}"), &dims, t);
        }
    }
    if let Some(idx) = &o.topk_idx {
        f.put_i32("topk_idx", &[inp.tokens, s.top_k], idx);
    }
    f.metadata
        .insert("format".into(), "afdep-moe-outputs-1".into());
    f.metadata.insert("top_k".into(), s.top_k.to_string());
    f.metadata.insert("impl".into(), o.implementation.clone());
    f.metadata.insert("dispatch".into(), o.dispatch.clone());
    crate::jsonl::create_parent(path)?;
    f.write(path)
}

/// `DIR/NAME` for a named shape, else `DIR`: where a shape's input and output files go.
pub fn shape_dir(dir: &Path, shape: Option<&str>) -> PathBuf {
    match shape {
        Some(n) => dir.join(n),
        None => dir.to_path_buf(),
    }
}

/// One shape of a run: seeded inputs at each of its token counts.
#[derive(Debug, Clone)]
struct Case {
    /// The named shape's name.
    name: Option<&'static str>,
    shape: LayerShape,
    tokens: Vec<usize>,
    iters: usize,
}

/// Where the inputs come from.
enum Source {
    /// One `--input` file.
    File(PathBuf),
    /// Seeded, per shape and token count.
    Seeded(Vec<Case>),
}

/// The shapes of a seeded run: the named ones, or the shape flags'.
fn cases(a: &MoeArgs, gpu: bool, default_iters: usize) -> Result<Vec<Case>> {
    let named: Vec<NamedShape> = match (a.suite, a.shape) {
        (Some(s), _) => s.shapes(),
        (None, Some(s)) => vec![s],
        (None, None) => Vec::new(),
    };
    let given = a.tokens.as_ref().map(|t| t.0.clone());
    let mut out = Vec::new();
    if named.is_empty() {
        let tokens = match given {
            Some(t) => t,
            None if gpu || a.inputs_only => GPU_TOKENS.to_vec(),
            None => vec![CPU_TOKENS],
        };
        out.push(Case {
            name: None,
            shape: shape_of(a),
            tokens,
            iters: a.iters.unwrap_or(default_iters),
        });
    } else {
        for n in named {
            out.push(Case {
                name: Some(n.name),
                shape: n.layer(),
                tokens: given.clone().unwrap_or_else(|| n.tokens.to_vec()),
                iters: a.iters.unwrap_or(if gpu { n.iters } else { 1 }),
            });
        }
    }
    for c in &out {
        c.shape.validate()?;
        if c.tokens.contains(&0) {
            bail!("--tokens: every token count must be at least 1");
        }
    }
    Ok(out)
}

/// Where rows go: stdout, and the `--json-out` file.
struct Sink {
    file: Option<(PathBuf, File)>,
    bar: ProgressBar,
}

impl Sink {
    fn emit<T: Serialize>(&mut self, row: &T) -> Result<()> {
        let line = serde_json::to_string(row).context("serialising a row")?;
        self.bar.suspend(|| println!("{line}"));
        if let Some((p, f)) = &mut self.file {
            writeln!(f, "{line}")
                .and_then(|()| f.flush())
                .with_context(|| format!("appending to {}", p.display()))?;
        }
        Ok(())
    }
}

/// Runs `afdep moe`.
pub fn run(a: MoeArgs) -> Result<()> {
    let gpu = match a.backend {
        Backend::Cpu => false,
        Backend::Cuda => true,
        Backend::Auto => crate::cuda_stages::gpu_available(),
    };
    if a.backend == Backend::Auto {
        info!(
            "backend auto: {}",
            if gpu {
                "the GPU layer"
            } else {
                "the CPU oracle (no usable GPU)"
            }
        );
    }
    if a.stage_check && !gpu {
        warn!("--stage-check needs the GPU: skipped on the CPU oracle");
    }
    let default_iters = if gpu { GPU_ITERS } else { 1 };
    if a.iters == Some(0) {
        bail!("--iters must be at least 1");
    }
    if a.dispatch.0.is_empty() {
        bail!("--dispatch needs at least one strategy");
    }
    let suite = a.suite.is_some() || a.shape.is_some();
    if a.list {
        if !suite {
            bail!("--list needs --suite or --shape");
        }
        for c in cases(&a, true, GPU_ITERS)? {
            for t in &c.tokens {
                println!("{} {t} {}", c.name.unwrap_or("?"), c.iters);
            }
        }
        return Ok(());
    }
    // The inputs: one file, or seeded ones per shape and token count (made when needed).
    let source = match &a.input {
        Some(p) => Source::File(p.clone()),
        None => Source::Seeded(cases(&a, gpu, default_iters)?),
    };
    let runs = match &source {
        Source::File(_) => 1,
        Source::Seeded(cases) => cases.iter().map(|c| c.tokens.len()).sum(),
    };
    if a.output.is_some() && runs != 1 {
        bail!("--output needs exactly one token count (use --write-outputs DIR for several)");
    }

    let per_run = if a.inputs_only {
        1
    } else if gpu {
        a.dispatch.0.len()
    } else {
        1
    };
    let bar = ProgressBar::new((runs * per_run) as u64);
    bar.set_style(
        ProgressStyle::with_template("{spinner} {msg} [{bar:30}] {pos}/{len} {elapsed}")
            .expect("a valid progress template"),
    );
    let file = match &a.json_out {
        Some(p) => Some((p.clone(), crate::jsonl::open_append(p)?)),
        None => None,
    };
    let mut sink = Sink {
        file,
        bar: bar.clone(),
    };

    let mut sweep = if gpu && !a.inputs_only {
        bar.set_message("opening the GPU");
        let iters = a.iters.unwrap_or(default_iters);
        let s = crate::moe_gpu::GpuSweep::open(iters)
            .context("opening GPU 0 for the MoE layer (use --backend cpu to run the CPU oracle)")?;
        info!(device = s.device(), iters, "GPU layer sweep");
        Some(s)
    } else {
        None
    };

    // every run: (its shape, which of its token counts); the file's run has none
    let work: Vec<(Option<&Case>, usize)> = match &source {
        Source::File(_) => vec![(None, 0)],
        Source::Seeded(cases) => cases
            .iter()
            .flat_map(|c| (0..c.tokens.len()).map(move |i| (Some(c), i)))
            .collect(),
    };
    let mut params: Option<(LayerShape, Arc<LayerParams>)> = None;
    let mut failed = 0usize;
    for (case, i) in work {
        let name = case.and_then(|c| c.name);
        let iters = case.map_or(a.iters.unwrap_or(default_iters), |c| c.iters);
        let (what, inp) = match (&source, case) {
            (Source::File(p), _) => {
                bar.set_message(format!("reading {}", p.display()));
                (p.display().to_string(), read_inputs(p, &a)?)
            }
            (_, Some(c)) => {
                let t = c.tokens[i];
                let what = match c.name {
                    Some(n) => format!("{n}, {t} tokens"),
                    None => format!("{t} tokens"),
                };
                if params.as_ref().is_none_or(|(s, _)| *s != c.shape) {
                    drop(params.take()); // free the previous shape's first
                    bar.set_message(format!("{what}: making parameters"));
                    let t0 = Instant::now();
                    let p = Arc::new(LayerParams::random(c.shape, a.seed));
                    info!(
                        shape = c.name,
                        secs = t0.elapsed().as_secs_f64(),
                        "seeded parameters made"
                    );
                    params = Some((c.shape, p));
                }
                let p = &params.as_ref().expect("made above").1;
                bar.set_message(format!("{what}: making inputs"));
                let t0 = Instant::now();
                let inp = Inputs::seeded(p, t, a.seed);
                info!(
                    tokens = t,
                    secs = t0.elapsed().as_secs_f64(),
                    "seeded inputs made"
                );
                (what, inp)
            }
            (Source::Seeded(_), None) => unreachable!("a seeded run has its case"),
        };
        if let Some(dir) = &a.write_inputs {
            let p = inputs_path(&shape_dir(dir, name), inp.tokens);
            bar.set_message(format!("{what}: writing {}", p.display()));
            let t0 = Instant::now();
            write_inputs(&p, &inp, name)?;
            info!(path = %p.display(), secs = t0.elapsed().as_secs_f64(), "inputs written");
        }
        if a.inputs_only {
            bar.inc(1);
            continue;
        }
        let out_path = match (&a.output, &a.write_outputs) {
            (Some(p), _) => Some(p.clone()),
            (None, Some(dir)) => Some(outputs_path(&shape_dir(dir, name), inp.tokens)),
            (None, None) => None,
        };
        match &mut sweep {
            Some(sweep) => {
                sweep.set_iters(iters)?;
                if a.stage_check {
                    bar.set_message(format!("{what}: GPU stage check"));
                    let row = crate::cuda_stages::run(&inp.params, &inp.x, inp.tokens)?;
                    let ok = row.status == "ok";
                    sink.emit(&row)?;
                    if !ok {
                        bail!(
                            "GPU stages disagree with afdep-core at {} tokens: {}",
                            inp.tokens,
                            row.status
                        );
                    }
                }
                // the outputs of the first strategy that runs
                let mut written = false;
                for &d in &a.dispatch.0 {
                    let want = !written && out_path.is_some();
                    info!(shape = name, tokens = inp.tokens, dispatch = %d, "configuration starts");
                    let msg = |step: &str| bar.set_message(format!("{what}, {d}: {step}"));
                    let o = match sweep.run(&inp, d, !a.forward_only, want, &msg) {
                        Ok(o) => o,
                        Err(e) if suite => {
                            // a suite goes on: the failure is this configuration's row
                            warn!(shape = name, tokens = inp.tokens, dispatch = %d, "failed: {e}");
                            failed += 1;
                            let mut row = MoeRow::new(
                                &inp.params.shape,
                                inp.tokens,
                                crate::moe_gpu::IMPL,
                                d.name(),
                                iters,
                            );
                            row.device = Some(sweep.device().to_string());
                            row.status = "error".into();
                            row.note = Some(e.to_string());
                            crate::moe_gpu::Outcome { row, outputs: None }
                        }
                        Err(e) => {
                            return Err(e)
                                .with_context(|| format!("the GPU layer, {what}, dispatch {d}"));
                        }
                    };
                    let mut row = o.row;
                    row.seed = inp.seed;
                    row.finish(name);
                    sink.emit(&row)?;
                    if let (Some(p), Some(outs)) = (&out_path, &o.outputs) {
                        bar.set_message(format!("{what}: writing {}", p.display()));
                        write_outputs(p, &inp, outs)?;
                        info!(path = %p.display(), dispatch = %d, "outputs written");
                        written = true;
                    }
                    bar.inc(1);
                }
            }
            None => {
                let (mut row, outs) = run_cpu(&inp, &a, iters, &bar)?;
                row.finish(name);
                sink.emit(&row)?;
                let Some(outs) = outs else {
                    bail!("the CPU oracle at {} tokens: {}", inp.tokens, row.status);
                };
                if let Some(p) = &out_path {
                    write_outputs(p, &inp, &outs)?;
                    info!(path = %p.display(), "outputs written");
                }
                if row.status != "ok" {
                    bail!("the CPU oracle at {} tokens: {}", inp.tokens, row.status);
                }
                bar.inc(1);
            }
        }
    }
    bar.finish_and_clear();
    if failed > 0 {
        bail!(
            "{failed} configurations failed: their rows have status `error` and the error in `note`"
        );
    }
    Ok(())
}

/// The CPU oracle on one token count: (row, outputs of the last run). Inputs the oracle
/// refuses (a non-finite router logit: [`afdep_core::RouteError::NonFiniteLogit`]) give a row
/// whose status names the token and no outputs; a non-finite output value (from non-finite
/// expert weights, which propagate) gives a row whose status names the first one. The caller
/// emits the row and fails on any status but `ok`.
fn run_cpu(
    inp: &Inputs,
    a: &MoeArgs,
    iters: usize,
    bar: &ProgressBar,
) -> Result<(MoeRow, Option<LayerOutputs>)> {
    let s = inp.params.shape;
    bar.set_message(format!("cpu oracle, {} tokens", inp.tokens));
    let mut fwd = Vec::new();
    let mut train = Vec::new();
    let mut y = Vec::new();
    let mut grads = None;
    let mut row = MoeRow::new(&s, inp.tokens, "afdep-cpu-oracle", "reference", iters);
    row.seed = inp.seed;
    for _ in 0..iters {
        let t = Instant::now();
        y = match layer::forward(&inp.params, &inp.x, inp.tokens) {
            Ok(f) => f.out,
            Err(layer::LayerError::Route(e)) => {
                row.status = e.to_string();
                return Ok((row, None));
            }
            Err(e) => return Err(e.into()),
        };
        fwd.push(t.elapsed().as_secs_f64() * 1e3);
        if !a.forward_only {
            let t = Instant::now();
            let (_, g) = layer::train_step(&inp.params, &inp.x, inp.tokens, &inp.dy)?;
            train.push(t.elapsed().as_secs_f64() * 1e3);
            grads = Some(g);
        }
    }
    row.fwd_ms = afdep_moe::timing::median(&fwd);
    row.train_ms = afdep_moe::timing::median(&train);
    let h = s.d_model;
    row.status = match y.iter().position(|v| !v.is_finite()) {
        None => "ok".into(),
        Some(i) => format!(
            "non-finite output: token {} channel {} is {} (non-finite values in the expert \
             weights propagate)",
            i / h,
            i % h,
            y[i]
        ),
    };
    let outs = LayerOutputs::of_oracle(&inp.params, &inp.x, y, grads);
    Ok((row, Some(outs)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dispatch_lists() {
        let d: DispatchList = "sorted, fused_gsum".parse().unwrap();
        assert_eq!(d.0, vec![Dispatch::Sorted, Dispatch::FusedGsum]);
        let e = "sorted,nope".parse::<DispatchList>().unwrap_err();
        assert!(e.contains("nope"), "{e}");
        assert!("gather,gather".parse::<DispatchList>().is_err());
    }

    #[test]
    fn inputs_round_trip_through_a_file() {
        let dir = tempfile::tempdir().unwrap();
        let shape = LayerShape {
            d_model: 16,
            width: 8,
            experts: 4,
            top_k: 2,
            shared: 0,
            renormalize: false,
        };
        let p = LayerParams::random(shape, 5);
        let inp = Inputs::seeded(&Arc::new(p), 7, 5);
        let path = inputs_path(dir.path(), 7);
        write_inputs(&path, &inp, None).unwrap();
        let f = TensorFile::read(&path).unwrap();
        assert_eq!(f.metadata["seed"], "5");
        assert_eq!(f.metadata["renormalize"], "false");
        use clap::Parser;
        #[derive(Parser)]
        struct W {
            #[command(flatten)]
            a: MoeArgs,
        }
        let w = W::parse_from(["x"]);
        let back = read_inputs(&path, &w.a).unwrap();
        assert_eq!(*back.params, *inp.params);
        assert_eq!(back.x, inp.x);
        assert_eq!(back.dy, inp.dy);
        assert_eq!(back.tokens, 7);
    }
}
