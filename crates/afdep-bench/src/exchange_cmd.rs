//! `afdep exchange`: AFD dispatch + experts + combine rounds.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Duration;

use afdep_core::oracle::LayerParams;
use afdep_core::oracle::exchange::{self as reference, SourceInput};
use afdep_core::oracle::layer;
use afdep_core::oracle::params::random_tokens;
use afdep_core::route::{Routes, route};
use afdep_core::tensor::uniform_bf16;
use afdep_core::{ExchangeConfig, LayerShape, Topology, bf16};
use afdep_moe::{RoundOutput, StagedEngine};
use afdep_transport::{Bootstrap, HostTcp, Loopback, Transport};
use anyhow::{Context, Result, bail};
use clap::{Args, ValueEnum};
use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;

use crate::Backend;
use crate::tensor_file::TensorFile;

/// Which transport moves the rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum TransportArg {
    /// In-process ranks as threads, host memory.
    Loopback,
    /// Ranks as threads of this process, talking TCP over 127.0.0.1 through the bootstrap
    /// (`HostTcp`): the transport multi-process CPU runs use.
    Tcp,
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
#[derive(Debug, Args)]
pub struct ExchangeArgs {
    /// Where to run.
    #[arg(long, value_enum, default_value = "auto")]
    pub backend: Backend,
    /// The transport.
    #[arg(long, value_enum, default_value = "loopback")]
    pub transport: TransportArg,
    /// Ranks: `3A:1F`, `2A:2F`, `1A:3F`, or `EP4` (classic expert parallelism).
    #[arg(long, default_value = "3A:1F")]
    pub topology: Topology,
    /// Tokens per attention rank, comma-separated; one row per count. Ignored with `--input`.
    #[arg(long, default_value = "1,8,32,128,512,1024,2048")]
    pub tokens: crate::TokenList,
    /// Hidden size.
    #[arg(long, default_value_t = 2048)]
    pub hidden: usize,
    /// Number of experts.
    #[arg(long, default_value_t = 128)]
    pub experts: usize,
    /// Experts per FFN rank (default: experts / FFN ranks, rounded down; ids beyond the
    /// placed experts are "dummy" and rejected).
    #[arg(long)]
    pub experts_per_rank: Option<usize>,
    /// Slots per token.
    #[arg(long, default_value_t = 8)]
    pub top_k: usize,
    /// Width of the SwiGLU experts.
    #[arg(long, default_value_t = 128)]
    pub width: usize,
    /// Most tokens per attention rank.
    #[arg(long, default_value_t = 2048)]
    pub capacity: usize,
    /// The FFN computation.
    #[arg(long, value_enum, default_value = "swiglu")]
    pub expert: ExpertArg,
    /// Timed rounds per token count (the median is reported).
    #[arg(long, default_value_t = 5)]
    pub rounds: usize,
    /// Seed of tokens, router and experts.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Bound on every transport wait, in milliseconds.
    #[arg(long, default_value_t = 30_000)]
    pub timeout_ms: u64,
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

/// One JSON row.
#[derive(Debug, Serialize)]
pub struct ExchangeRow {
    /// Topology.
    pub topology: String,
    /// Engine.
    pub engine: &'static str,
    /// Transport.
    pub transport: &'static str,
    /// Hidden size.
    pub hidden: usize,
    /// Experts.
    pub experts: usize,
    /// Top-k.
    pub top_k: usize,
    /// Tokens on each attention rank.
    pub tokens: Vec<usize>,
    /// FFN computation.
    pub expert: String,
    /// Rounds timed.
    pub rounds: usize,
    /// Median wall time of a whole round (slowest rank), µs.
    pub round_us: f64,
    /// Median phase times, µs (slowest rank per phase).
    pub counts_us: f64,
    /// Dispatch phase.
    pub dispatch_us: f64,
    /// Expert phase.
    pub experts_us: f64,
    /// Combine phase.
    pub combine_us: f64,
    /// `ok`, `mismatch` (against the oracle), or `unverified`.
    pub status: String,
    /// Digest of the kernel sources.
    pub kernel_digest: String,
}

struct Problem {
    cfg: ExchangeConfig,
    inputs: Vec<SourceInput>,
    params: Option<LayerParams>,
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
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Runs `rounds` rounds of `prob` on a fresh Loopback group, one thread per rank; returns
/// each rank's outputs of the last round and the per-round slowest-rank phase times.
/// Runs `rounds` rounds of `prob` with one thread per rank, each building its transport with
/// `make(rank)` inside its thread; returns each rank's outputs of the last round and the
/// per-round slowest-rank phase times.
fn run_ranks<T: Transport>(
    prob: &Problem,
    expert: ExpertArg,
    rounds: usize,
    make: impl Fn(usize) -> Result<T> + Sync,
) -> Result<(Vec<RoundOutput>, Vec<[f64; 5]>)> {
    let world = prob.cfg.topology.world_size();
    let make = &make;
    let results: Vec<Result<(RoundOutput, Vec<[f64; 5]>)>> = std::thread::scope(|sc| {
        let handles: Vec<_> = (0..world)
            .map(|rank| {
                let cfg = prob.cfg.clone();
                sc.spawn(move || -> Result<(RoundOutput, Vec<[f64; 5]>)> {
                    let t = make(rank)?;
                    let mut eng = StagedEngine::new(cfg.clone(), t)?;
                    let input = cfg.topology.attention_index(rank).map(|s| &prob.inputs[s]);
                    let f = |e: usize, rows: &[bf16], n: usize| match (expert, &prob.params) {
                        (ExpertArg::Swiglu, Some(p)) => {
                            layer::expert_rows(p, e, rows, n).expect("validated expert input")
                        }
                        _ => rows.to_vec(),
                    };
                    let mut times = Vec::new();
                    let mut last = None;
                    for _ in 0..rounds {
                        eng.transport_mut().barrier()?;
                        let t0 = std::time::Instant::now();
                        let out = eng.round(input, &f)?;
                        let total = t0.elapsed().as_secs_f64() * 1e6;
                        let us = |d: Duration| d.as_secs_f64() * 1e6;
                        times.push([
                            total,
                            us(out.times.counts),
                            us(out.times.dispatch),
                            us(out.times.experts),
                            us(out.times.combine),
                        ]);
                        last = Some(out);
                    }
                    Ok((last.expect("rounds >= 1"), times))
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .map_err(|_| anyhow::anyhow!("a rank thread panicked"))?
            })
            .collect()
    });
    let mut outs = Vec::new();
    let mut per_round = vec![[0f64; 5]; rounds];
    for (rank, r) in results.into_iter().enumerate() {
        let (o, t) = r.with_context(|| format!("rank {rank}"))?;
        for (acc, t) in per_round.iter_mut().zip(t) {
            for i in 0..5 {
                acc[i] = acc[i].max(t[i]);
            }
        }
        outs.push(o);
    }
    Ok((outs, per_round))
}

/// Runs `afdep exchange`.
pub fn run(a: ExchangeArgs) -> Result<()> {
    if a.backend == Backend::Cuda {
        bail!(
            "the CUDA backend of `afdep exchange` (fused NVLink engine) does not exist yet; use --backend cpu"
        );
    }
    if a.rounds == 0 {
        bail!("--rounds must be at least 1");
    }
    let cfg = ExchangeConfig {
        topology: a.topology,
        hidden: a.hidden,
        experts: a.experts,
        experts_per_rank: a
            .experts_per_rank
            .unwrap_or(a.experts / a.topology.ffn_count()),
        top_k: a.top_k,
        capacity: a.capacity,
        payload: Default::default(),
        knobs: Default::default(),
    };
    cfg.validate()?;
    let timeout = Duration::from_millis(a.timeout_ms);
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
    let bar = ProgressBar::new(problems.len() as u64);
    bar.set_style(
        ProgressStyle::with_template("{spinner} {msg} [{bar:30}] {pos}/{len} {elapsed}")
            .expect("template"),
    );
    for (inputs, params) in problems {
        let params = match (a.expert, params) {
            (ExpertArg::Swiglu, Some(p)) => Some(p),
            (ExpertArg::Swiglu, None) => Some(random_params()),
            (ExpertArg::Identity, _) => None,
        };
        let tokens: Vec<usize> = inputs.iter().map(|i| i.routes.tokens).collect();
        bar.set_message(format!(
            "{} staged/{:?}, tokens {tokens:?}",
            cfg.topology, a.transport
        ));
        let prob = Problem {
            cfg: cfg.clone(),
            inputs,
            params,
        };
        let world = cfg.topology.world_size();
        let (outs, per_round) = match a.transport {
            TransportArg::Loopback => {
                let group: Vec<Mutex<Option<Loopback>>> = Loopback::group(world, timeout)
                    .into_iter()
                    .map(|t| Mutex::new(Some(t)))
                    .collect();
                run_ranks(&prob, a.expert, a.rounds, |r| {
                    group[r]
                        .lock()
                        .expect("unpoisoned")
                        .take()
                        .context("rank built twice")
                })?
            }
            TransportArg::Tcp => {
                let any: SocketAddr = "127.0.0.1:0".parse().expect("literal address");
                let listener = Mutex::new(Some(Bootstrap::listen(any, world, timeout)?));
                let addr = listener
                    .lock()
                    .expect("unpoisoned")
                    .as_ref()
                    .expect("bound")
                    .local_addr();
                run_ranks(&prob, a.expert, a.rounds, |r| {
                    let boot = if r == 0 {
                        let l = listener
                            .lock()
                            .expect("unpoisoned")
                            .take()
                            .context("rank 0 built twice")?;
                        l.accept()?
                    } else {
                        Bootstrap::connect(addr, r, world, timeout)?
                    };
                    Ok(HostTcp::new(boot))
                })?
            }
        };
        let combined: Vec<Vec<bf16>> = cfg
            .topology
            .attention_ranks()
            .map(|r| outs[r].combined.clone().expect("attention ranks combine"))
            .collect();
        let status = if a.no_verify {
            "unverified".to_string()
        } else {
            let want = reference::exchange(&cfg, &prob.inputs, |e, rows: &[bf16], n| match &prob
                .params
            {
                Some(p) => layer::expert_rows(p, e, rows, n).expect("validated expert input"),
                None => rows.to_vec(),
            })?;
            if want == combined {
                "ok".into()
            } else {
                "mismatch".into()
            }
        };
        let col = |i: usize| median(per_round.iter().map(|r| r[i]).collect());
        let row = ExchangeRow {
            topology: cfg.topology.to_string(),
            engine: "staged",
            transport: match a.transport {
                TransportArg::Loopback => "loopback",
                TransportArg::Tcp => "tcp",
            },
            hidden: cfg.hidden,
            experts: cfg.experts,
            top_k: cfg.top_k,
            tokens,
            expert: format!("{:?}", a.expert).to_lowercase(),
            rounds: a.rounds,
            round_us: col(0),
            counts_us: col(1),
            dispatch_us: col(2),
            experts_us: col(3),
            combine_us: col(4),
            status: status.clone(),
            kernel_digest: afdep_kernels::source_digest(),
        };
        bar.suspend(|| println!("{}", serde_json::to_string(&row).expect("row serializes")));
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
            bail!("the staged engine's result differs from the oracle's exchange reference");
        }
        bar.inc(1);
    }
    bar.finish_and_clear();
    Ok(())
}
