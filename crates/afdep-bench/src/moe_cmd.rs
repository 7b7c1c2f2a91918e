//! `afdep moe`: the MoE layer, forward and train step.

use std::path::{Path, PathBuf};
use std::time::Instant;

use afdep_core::oracle::layer;
use afdep_core::oracle::params::{PARAM_NAMES, random_tokens};
use afdep_core::oracle::{LayerGrads, LayerParams};
use afdep_core::tensor::uniform_bf16;
use afdep_core::{LayerShape, bf16};
use anyhow::{Context, Result, bail};
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;
use tracing::{info, warn};

use crate::Backend;
use crate::tensor_file::TensorFile;

/// Arguments of `afdep moe`.
#[derive(Debug, Args)]
pub struct MoeArgs {
    /// Where to run.
    #[arg(long, value_enum, default_value = "auto")]
    pub backend: Backend,
    /// Token counts to run, comma-separated (`16k`, `1M` allowed). Ignored with `--input`.
    #[arg(long, default_value = "16384")]
    pub tokens: crate::TokenList,
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
    /// Dispatch strategy (GPU backend): sorted, gather, fused, fused_gsum.
    #[arg(long, default_value = "sorted")]
    pub dispatch: String,
    /// Seed of the random parameters, tokens and upstream gradient.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Run the forward only (no train step).
    #[arg(long)]
    pub forward_only: bool,
    /// Timed repetitions per token count (the median is reported).
    #[arg(long, default_value_t = 1)]
    pub repeats: usize,
    /// Read inputs from this safetensors file (x, wr, w1, w3, w2, s1, s3, s2, optionally dy;
    /// metadata top_k and renormalize).
    #[arg(long)]
    pub input: Option<PathBuf>,
    /// Write outputs to this safetensors file (y, and dx, dwr, dw1, dw3, dw2, ds1, ds3, ds2
    /// after a train step).
    #[arg(long)]
    pub output: Option<PathBuf>,
}

/// One JSON row, with the fields of the MoE-layer record.
#[derive(Debug, Serialize)]
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
    /// Implementation.
    #[serde(rename = "impl")]
    pub implementation: String,
    /// Dispatch strategy.
    pub dispatch: String,
    /// Forward time, ms (median).
    pub fwd_ms: f64,
    /// Train-step time, ms (median), if run.
    pub train_ms: Option<f64>,
    /// Max |a-b| / max |b| of the output against the reference (null for the reference itself).
    pub out_err: Option<f64>,
    /// Same for the input gradient.
    pub gx_err: Option<f64>,
    /// Same for the parameter gradients (max over tensors).
    pub gw_err: Option<f64>,
    /// `ok` or what went wrong.
    pub status: String,
    /// Digest of the kernel sources.
    pub kernel_digest: String,
    /// Repetitions measured.
    pub repeats: usize,
}

struct Inputs {
    params: LayerParams,
    x: Vec<bf16>,
    dy: Vec<bf16>,
    tokens: usize,
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
fn read_inputs(path: &Path, a: &MoeArgs, seed: u64) -> Result<Inputs> {
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
        uniform_bf16(tokens * shape.d_model, 1.0, seed, 200)
    };
    Ok(Inputs {
        params,
        x,
        dy,
        tokens,
    })
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn write_outputs(path: &Path, inp: &Inputs, y: &[bf16], grads: Option<&LayerGrads>) -> Result<()> {
    let s = inp.params.shape;
    let mut f = TensorFile::default();
    f.put_bf16("y", &[inp.tokens, s.d_model], y);
    if let Some(g) = grads {
        f.put_bf16("dx", &[inp.tokens, s.d_model], &g.dx);
        for ((name, t), dims) in PARAM_NAMES
            .iter()
            .zip(g.params())
            .zip(LayerParams::dims(&s))
        {
            f.put_bf16(&format!("d{name}"), &dims, t);
        }
    }
    f.metadata.insert("top_k".into(), s.top_k.to_string());
    f.write(path)
}

/// Runs `afdep moe`.
pub fn run(a: MoeArgs) -> Result<()> {
    // The GPU runs the stages it has (router, validation, layout, permute, un-permute), each
    // checked against afdep-core; the whole layer (forward and train step) runs on the CPU
    // oracle until the grouped-GEMM layer lands.
    let gpu = match a.backend {
        Backend::Cpu => false,
        Backend::Cuda => true,
        Backend::Auto => crate::cuda_stages::gpu_available(),
    };
    if a.backend == Backend::Auto {
        info!(
            gpu,
            "backend auto: GPU stages {}",
            if gpu { "on" } else { "off (no usable GPU)" }
        );
    }
    warn!(
        "the MoE layer's forward and train step run on the CPU oracle: the CUDA layer is not built yet"
    );
    if a.repeats == 0 {
        bail!("--repeats must be at least 1");
    }
    let runs: Vec<Inputs> = match &a.input {
        Some(p) => vec![read_inputs(p, &a, a.seed)?],
        None => {
            let shape = shape_of(&a);
            shape.validate()?;
            let params = LayerParams::random(shape, a.seed);
            a.tokens
                .0
                .iter()
                .map(|&t| Inputs {
                    params: params.clone(),
                    x: random_tokens(t, shape.d_model, a.seed),
                    dy: uniform_bf16(t * shape.d_model, 1.0, a.seed, 200),
                    tokens: t,
                })
                .collect()
        }
    };
    if a.output.is_some() && runs.len() != 1 {
        bail!("--output needs exactly one token count");
    }
    let steps = runs.len() * a.repeats * if a.forward_only { 1 } else { 2 };
    let bar = ProgressBar::new(steps as u64);
    bar.set_style(
        ProgressStyle::with_template("{spinner} {msg} [{bar:30}] {pos}/{len} {elapsed}")
            .expect("template"),
    );
    for inp in &runs {
        let s = inp.params.shape;
        if gpu {
            let row = crate::cuda_stages::run(&inp.params, &inp.x, inp.tokens)?;
            let ok = row.status == "ok";
            bar.suspend(|| println!("{}", serde_json::to_string(&row).expect("row serializes")));
            if !ok {
                bail!(
                    "GPU stages disagree with afdep-core at {} tokens: {}",
                    inp.tokens,
                    row.status
                );
            }
        }
        bar.set_message(format!("cpu layer, {} tokens", inp.tokens));
        let mut fwd = Vec::new();
        let mut train = Vec::new();
        let mut y = Vec::new();
        let mut grads = None;
        for _ in 0..a.repeats {
            let t = Instant::now();
            y = layer::forward(&inp.params, &inp.x, inp.tokens)?.out;
            fwd.push(t.elapsed().as_secs_f64() * 1e3);
            bar.inc(1);
            if !a.forward_only {
                let t = Instant::now();
                let (_, g) = layer::train_step(&inp.params, &inp.x, inp.tokens, &inp.dy)?;
                train.push(t.elapsed().as_secs_f64() * 1e3);
                grads = Some(g);
                bar.inc(1);
            }
        }
        let nan = y.iter().any(|v| v.is_nan());
        let row = MoeRow {
            d_model: s.d_model,
            width: s.width,
            experts: s.experts,
            top_k: s.top_k,
            shared: s.shared,
            tokens: inp.tokens,
            implementation: "afdep-cpu-oracle".into(),
            dispatch: "reference".into(),
            fwd_ms: median(fwd),
            train_ms: (!train.is_empty()).then(|| median(train)),
            out_err: None,
            gx_err: None,
            gw_err: None,
            status: if nan {
                "nan in output".into()
            } else {
                "ok".into()
            },
            kernel_digest: afdep_kernels::source_digest(),
            repeats: a.repeats,
        };
        bar.suspend(|| println!("{}", serde_json::to_string(&row).expect("row serializes")));
        if let Some(p) = &a.output {
            write_outputs(p, inp, &y, grads.as_ref())?;
            info!(path = %p.display(), "outputs written");
        }
    }
    bar.finish_and_clear();
    Ok(())
}
