//! A problem of a run: the sources' inputs (seeded or read from `--input`), the expert
//! parameters, the expert function and the oracle's answer, and which faults it can take.

use std::path::Path;

use afdep_core::oracle::LayerParams;
use afdep_core::oracle::exchange::{self as reference, SourceInput};
use afdep_core::oracle::layer;
use afdep_core::oracle::params::random_tokens;
use afdep_core::route::{Routes, route};
use afdep_core::tensor::uniform_bf16;
use afdep_core::{ExchangeConfig, LayerShape, bf16};
use anyhow::{Result, bail};

use crate::tensor_file::TensorFile;

use super::args::*;

pub(super) struct Problem {
    pub(super) cfg: ExchangeConfig,
    pub(super) inputs: Vec<SourceInput>,
    pub(super) params: Option<LayerParams>,
}

/// The expert parameters a fused rank is built with: the first problem's. A `--graph` run
/// captures its device experts once, so there every problem must carry the same parameters
/// (or none); eager rounds take each problem's own experts.
pub(super) fn rank_params(probs: &[Problem], graph: bool) -> Result<Option<&LayerParams>> {
    let first = probs.first().and_then(|p| p.params.as_ref());
    if graph && probs.iter().any(|p| p.params.as_ref() != first) {
        bail!(
            "--graph and --device-rounds prepare the device experts once: every --input must \
             carry the same SwiGLU parameters (w1, w3, w2), or none"
        );
    }
    Ok(first)
}

pub(super) fn generate(
    a: &ExchangeArgs,
    cfg: &ExchangeConfig,
    tokens: usize,
) -> Result<Vec<SourceInput>> {
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

pub(super) fn read_problem(
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

/// The expert function of `prob`.
pub(super) fn expert_of(
    prob: &Problem,
    expert: ExpertArg,
    e: usize,
    rows: &[bf16],
    n: usize,
) -> Vec<bf16> {
    match (expert, &prob.params) {
        (ExpertArg::Swiglu, Some(p)) => {
            layer::expert_rows(p, e, rows, n).expect("validated expert input")
        }
        _ => rows.to_vec(),
    }
}

/// Checks that `fault` can happen in `prob` under this mode.
pub(super) fn check_fault(fault: Option<Fault>, prob: &Problem, multi_process: bool) -> Result<()> {
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

/// Whether a rank's combined rows match the oracle's: bit for bit, except the device SwiGLU
/// experts of device rounds (`--graph`, `--device-rounds`: the grouped GEMM), which must be within the layer output's bf16
/// tolerance ([`afdep_moe::accuracy::OUT_TOL`]).
pub(super) fn matches_reference(a: &ExchangeArgs, got: &[bf16], want: &[bf16]) -> bool {
    match (a.device_experts(), a.expert) {
        (true, ExpertArg::Swiglu) => {
            got.len() == want.len()
                && afdep_moe::accuracy::max_rel_err(got, want) <= afdep_moe::accuracy::OUT_TOL
        }
        _ => got == want,
    }
}

/// The oracle's combined rows of every attention rank.
pub(super) fn reference_of(prob: &Problem, expert: ExpertArg) -> Result<Vec<Vec<bf16>>> {
    Ok(reference::exchange(
        &prob.cfg,
        &prob.inputs,
        |e, rows: &[bf16], n| expert_of(prob, expert, e, rows, n),
    )?)
}
