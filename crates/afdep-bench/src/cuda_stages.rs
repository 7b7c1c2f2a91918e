//! `afdep moe --backend cuda`, for the stages that exist on the GPU so far: router (logits,
//! softmax, top-k, weights), route validation, expert layout, permute, and un-permute. The
//! expert FFN is not on the GPU yet, so un-permute runs on identity experts (`y = permuted x`).
//!
//! Each stage is checked against afdep-core on the same inputs: the router within its
//! documented tolerance (expert ids must agree except where the CPU's probabilities of the two
//! swapped experts tie within 1e-5), and everything downstream of the router bit for bit,
//! computed from the GPU's own routes. Outputs are poisoned before the run.

use std::time::Instant;

use afdep_core::CombinePartials;
use afdep_core::layout::block_positions;
use afdep_core::oracle::LayerParams;
use afdep_core::oracle::exchange::combine_source;
use afdep_core::route::{MASKED, RouteRules, Routes, router_probs, select};
use afdep_core::topology::ExpertPlacement;
use afdep_core::{LayerShape, bf16};
use afdep_kernels::ops::{download, poison, zeros};
use afdep_kernels::{
    CombineOrder, DeviceRoutes, GpuContext, KernelError, expert_layout, permute, router, unpermute,
    validate_routes,
};
use anyhow::{Context, Result};
use serde::Serialize;

/// One JSON row of the GPU stages.
#[derive(Debug, Serialize)]
pub struct StagesRow {
    /// Hidden size.
    pub d_model: usize,
    /// Experts.
    pub experts: usize,
    /// Top-k.
    pub top_k: usize,
    /// Tokens.
    pub tokens: usize,
    /// Implementation.
    #[serde(rename = "impl")]
    pub implementation: &'static str,
    /// The stages run.
    pub stages: &'static str,
    /// Wall time per stage after a warm-up run, ms (each stage followed by a stream sync).
    pub router_ms: f64,
    /// Validation.
    pub validate_ms: f64,
    /// Expert layout.
    pub layout_ms: f64,
    /// Permute.
    pub permute_ms: f64,
    /// Un-permute.
    pub unpermute_ms: f64,
    /// Slots whose expert id differs from the CPU router's (all at probability ties if ok).
    pub route_id_mismatches: usize,
    /// Of those, how many are not explained by a tie.
    pub route_untied_mismatches: usize,
    /// Max relative difference of the weights against the CPU router (same ids only).
    pub route_weight_err: f64,
    /// Layout counts, offsets and slot rows equal afdep-core's.
    pub layout_exact: bool,
    /// Permuted rows equal afdep-core's.
    pub permute_exact: bool,
    /// Un-permuted output equals afdep-core's combine bit for bit.
    pub unpermute_exact: bool,
    /// `ok` or what differs.
    pub status: String,
    /// GPU name.
    pub device: String,
    /// Digest of the kernel sources.
    pub kernel_digest: String,
}

/// Whether a CUDA device can be used here (for `--backend auto`).
pub fn gpu_available() -> bool {
    afdep_kernels::context::probe_driver().is_ok()
}

struct Timed {
    router: f64,
    validate: f64,
    layout: f64,
    permute: f64,
    unpermute: f64,
}

fn ms(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e3
}

/// Runs the GPU stages on `x` and checks them; returns the JSON row.
pub fn run(params: &LayerParams, x: &[bf16], tokens: usize) -> Result<StagesRow> {
    let shape: LayerShape = params.shape;
    let (h, e, k) = (shape.d_model, shape.experts, shape.top_k);
    let ctx = GpuContext::new(0).context("opening GPU 0")?;
    let s = ctx.stream();
    let xd = s
        .clone_htod(x)
        .map_err(KernelError::driver("uploading x"))?;
    let wrd = s
        .clone_htod(&params.wr)
        .map_err(KernelError::driver("uploading wr"))?;
    let slots = tokens * k;
    let mut xs = zeros::<bf16>(&ctx, slots * h)?;
    let mut out = zeros::<bf16>(&ctx, tokens * h)?;
    let once =
        |xs: &mut _, out: &mut _| -> Result<(DeviceRoutes, afdep_kernels::ExpertLayout, Timed)> {
            poison(&ctx, xs)?;
            poison(&ctx, out)?;
            ctx.synchronize()?;
            let t = Instant::now();
            let routes = router(&ctx, &xd, &wrd, tokens, &shape)?;
            ctx.synchronize()?;
            let router_t = ms(t);
            let t = Instant::now();
            validate_routes(&ctx, &routes, &RouteRules::layer(&shape), 0)?;
            let validate_t = ms(t);
            let t = Instant::now();
            let layout = expert_layout(&ctx, &routes, e)?;
            ctx.synchronize()?;
            let layout_t = ms(t);
            let t = Instant::now();
            permute(&ctx, &xd, h, &layout, xs)?;
            ctx.synchronize()?;
            let permute_t = ms(t);
            let t = Instant::now();
            unpermute(&ctx, xs, h, &layout, &routes, CombineOrder::Slots, out)?;
            ctx.synchronize()?;
            let unpermute_t = ms(t);
            let timed = Timed {
                router: router_t,
                validate: validate_t,
                layout: layout_t,
                permute: permute_t,
                unpermute: unpermute_t,
            };
            Ok((routes, layout, timed))
        };
    // the first run compiles (or loads from the cache) every module; time the second
    once(&mut xs, &mut out)?;
    let (routes_d, layout, t) = once(&mut xs, &mut out)?;

    // router against the CPU
    let gpu: Routes = routes_d.download(&ctx)?;
    let probs = router_probs(x, &params.wr, tokens, &shape);
    let cpu = select(&probs, tokens, &shape);
    let (mut mism, mut untied, mut werr) = (0usize, 0usize, 0f64);
    for i in 0..slots {
        let (a, b) = (gpu.idx[i], cpu.idx[i]);
        if a != b {
            mism += 1;
            let row = &probs[(i / k) * e..(i / k + 1) * e];
            let (pa, pb) = (row[a.max(0) as usize] as f64, row[b.max(0) as usize] as f64);
            if a < 0 || (pa - pb).abs() > 1e-5 * pa.max(pb) {
                untied += 1;
            }
        } else {
            let (wa, wb) = (gpu.weights[i] as f64, cpu.weights[i] as f64);
            werr = werr.max(if wa.is_nan() {
                f64::INFINITY
            } else {
                (wa - wb).abs() / wb.abs().max(f64::MIN_POSITIVE)
            });
        }
    }

    // layout, from the GPU's own routes
    let p = ExpertPlacement {
        experts: e,
        ffn_ranks: 1,
        experts_per_rank: e,
    };
    let pos = block_positions(&gpu, &p);
    let mut counts = vec![0u64; e];
    for &id in &gpu.idx {
        if id != MASKED {
            counts[id as usize] += 1;
        }
    }
    let offsets = afdep_core::layout::exclusive_prefix(&counts);
    let want_slot_row: Vec<u32> = gpu
        .idx
        .iter()
        .zip(&pos)
        .map(|(&id, p)| match p {
            Some(p) => (offsets[id as usize] + p) as u32,
            None => u32::MAX,
        })
        .collect();
    let layout_exact = download(&ctx, &layout.counts)? == counts
        && download(&ctx, &layout.offsets)? == offsets
        && download(&ctx, &layout.slot_row)? == want_slot_row;

    // permute and un-permute
    let total = *offsets.last().expect("non-empty") as usize;
    let xs_h = download(&ctx, &xs)?;
    let mut want_xs = vec![bf16::ZERO; total * h];
    for (i, r) in want_slot_row.iter().enumerate() {
        if *r != u32::MAX {
            let (r, tok) = (*r as usize, i / k);
            want_xs[r * h..(r + 1) * h].copy_from_slice(&x[tok * h..(tok + 1) * h]);
        }
    }
    let bits = |v: &[bf16]| v.iter().map(|b| b.to_bits()).collect::<Vec<_>>();
    let permute_exact = bits(&xs_h[..total * h]) == bits(&want_xs);
    let want_out = combine_source(
        &gpu,
        h,
        CombinePartials::F32,
        |_| 0,
        |i| want_slot_row[i] as u64,
        &[&want_xs],
    );
    let unpermute_exact = bits(&download(&ctx, &out)?) == bits(&want_out);

    let mut problems = Vec::new();
    if untied > 0 {
        problems.push(format!("{untied} router ids differ without a tie"));
    }
    if werr > 1e-5 {
        problems.push(format!("router weights differ by {werr:.2e}"));
    }
    for (ok, what) in [
        (layout_exact, "layout"),
        (permute_exact, "permute"),
        (unpermute_exact, "unpermute"),
    ] {
        if !ok {
            problems.push(format!("{what} differs from afdep-core"));
        }
    }
    Ok(StagesRow {
        d_model: h,
        experts: e,
        top_k: k,
        tokens,
        implementation: "afdep-cuda",
        stages: "router,validate,layout,permute,unpermute(identity experts)",
        router_ms: t.router,
        validate_ms: t.validate,
        layout_ms: t.layout,
        permute_ms: t.permute,
        unpermute_ms: t.unpermute,
        route_id_mismatches: mism,
        route_untied_mismatches: untied,
        route_weight_err: werr,
        layout_exact,
        permute_exact,
        unpermute_exact,
        status: if problems.is_empty() {
            "ok".into()
        } else {
            problems.join("; ")
        },
        device: ctx.device_name()?,
        kernel_digest: afdep_kernels::source_digest(),
    })
}
