//! Device time of each GPU stage of the MoE dispatch path: router (logits, top-k), route
//! validation, expert layout, permute and un-permute, at the given token counts.
//!
//! ```text
//! bench_stages [--tokens 16384,1048576] [--hidden 512] [--experts 64] [--top-k 8] [--iters 50]
//! ```
//! Inputs are uploaded and every buffer allocated once; each iteration of a stage is timed by
//! its own pair of CUDA events on the context's stream (5 warm-up iterations first), with no
//! allocation, compilation or host sync inside the timed region. Per stage: median and min µs,
//! and for the copy-like stages the bytes moved (read + write), the floor time at 4.3 TB/s and
//! the fraction of that ceiling reached:
//! - permute: `2·T·K·H·2` (read the rows of x through the index, write the permuted rows)
//!   `+ 4·T·K` (the row → slot index);
//! - un-permute: `T·K·H·2 + T·H·2` (read the permuted rows, write the output) `+ 8·T·K`
//!   (slot rows and weights);
//! - layout: `16·T·K` (ids read twice, slot rows and row slots written).
//!
//! One JSON row per (tokens, stage) on stdout; a table on stderr. Exit code 2 without a GPU.

use afdep_core::LayerShape;
use afdep_core::oracle::params::random_tokens;
use afdep_core::route::RouteRules;
use afdep_core::tensor::uniform_bf16;
use afdep_kernels::cudarc::driver::sys::CUevent_flags;
use afdep_kernels::ops::zeros;
use afdep_kernels::{
    CombineOrder, DeviceRoutes, ExpertLayout, GpuContext, KernelError, LogitsDims, LogitsKernel,
    RouteValidator, TopkDims, permute, router_logits, router_topk, source_digest, unpermute,
};
use half::bf16;

const CEILING: f64 = 4.3e12;

/// Device time of each GPU stage of the MoE dispatch path, per token count.
#[derive(clap::Parser, Debug)]
struct Args {
    /// Token counts, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "16384,1048576")]
    tokens: Vec<usize>,
    /// Hidden size H.
    #[arg(long, default_value_t = 512)]
    hidden: usize,
    /// Experts E.
    #[arg(long, default_value_t = 64)]
    experts: usize,
    /// Experts per token K.
    #[arg(long, default_value_t = 8)]
    top_k: usize,
    /// Timed iterations per stage.
    #[arg(long, default_value_t = 50)]
    iters: usize,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Times `iters` runs of `f` on the stream, each between its own events; µs.
fn time(
    ctx: &GpuContext,
    iters: usize,
    mut f: impl FnMut() -> Result<(), KernelError>,
) -> Result<Vec<f64>, KernelError> {
    let s = ctx.stream();
    for _ in 0..5 {
        f()?;
    }
    let ev = |what: &'static str| {
        ctx.cuda()
            .new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(KernelError::driver(what))
    };
    let starts: Vec<_> = (0..iters)
        .map(|_| ev("creating an event"))
        .collect::<Result<_, _>>()?;
    let ends: Vec<_> = (0..iters)
        .map(|_| ev("creating an event"))
        .collect::<Result<_, _>>()?;
    for i in 0..iters {
        starts[i]
            .record(s)
            .map_err(KernelError::driver("recording"))?;
        f()?;
        ends[i]
            .record(s)
            .map_err(KernelError::driver("recording"))?;
    }
    ctx.synchronize()?;
    starts
        .iter()
        .zip(&ends)
        .map(|(a, b)| {
            a.elapsed_ms(b)
                .map(|ms| ms as f64 * 1e3)
                .map_err(KernelError::driver("reading an event"))
        })
        .collect()
}

fn main() {
    if let Err(e) = run() {
        eprintln!("bench_stages: {e}");
        std::process::exit(2);
    }
}

fn run() -> Result<(), KernelError> {
    let Args {
        tokens,
        hidden: h,
        experts: e,
        top_k: k,
        iters,
    } = <Args as clap::Parser>::parse();
    let ctx = GpuContext::new(0)?;
    // SAFETY: this program uses one stream and never shares buffers across streams, so
    // cudarc's per-buffer event tracking (which would add records and waits to every launch)
    // is not needed for correctness.
    unsafe { ctx.cuda().disable_event_tracking() };
    let digest = source_digest();
    eprintln!(
        "bench_stages: {} ({}), kernels {digest}, hidden {h}, experts {e}, top-{k}, {iters} iterations",
        ctx.device_name()?,
        ctx.arch()
    );
    let shape = LayerShape {
        d_model: h,
        width: 1,
        experts: e,
        top_k: k,
        shared: 0,
        renormalize: true,
    };
    let rules = RouteRules::layer(&shape);
    eprintln!(
        "{:>9} {:>10} {:>10} {:>10} {:>10} {:>9} {:>7}",
        "tokens", "stage", "median_us", "min_us", "GB moved", "floor_us", "ceiling"
    );
    for &t in &tokens {
        let s = ctx.stream();
        let x = s
            .clone_htod(&random_tokens(t, h, 1))
            .map_err(KernelError::driver("uploading x"))?;
        let wr = s
            .clone_htod(&uniform_bf16(h * e, 1.0 / (h as f32).sqrt(), 1, 2))
            .map_err(KernelError::driver("uploading wr"))?;
        let mut logits = zeros::<f32>(&ctx, t * e)?;
        let mut routes = DeviceRoutes::zeros(&ctx, t, k)?;
        let mut validator = RouteValidator::new(&ctx)?;
        let mut layout = ExpertLayout::new(&ctx, t, k, e)?;
        let mut xs = zeros::<bf16>(&ctx, t * k * h)?;
        let mut out = zeros::<bf16>(&ctx, t * h)?;
        // one untimed pass so every later stage sees real routes and layout
        let ld = LogitsDims::new(t, h, e, k);
        router_logits(&ctx, &x, &wr, ld, &mut logits, LogitsKernel::Auto)?;
        let td = TopkDims::new(t, e, k, true);
        router_topk(&ctx, &logits, td, &mut routes, None)?;
        layout.build(&ctx, &routes.idx)?;
        ctx.synchronize()?;
        let (tk, th) = ((t * k) as f64, (t * h) as f64);
        let stages: Vec<(&str, Vec<f64>, Option<f64>)> = vec![
            (
                "router",
                time(&ctx, iters, || {
                    let ld = LogitsDims::new(t, h, e, k);
                    router_logits(&ctx, &x, &wr, ld, &mut logits, LogitsKernel::Auto)?;
                    let td = TopkDims::new(t, e, k, true);
                    router_topk(&ctx, &logits, td, &mut routes, None)
                })?,
                None,
            ),
            (
                "validate",
                time(&ctx, iters, || validator.launch(&ctx, &routes, &rules, 0))?,
                None,
            ),
            (
                "layout",
                time(&ctx, iters, || layout.build(&ctx, &routes.idx))?,
                Some(16.0 * tk),
            ),
            (
                "permute",
                time(&ctx, iters, || permute(&ctx, &x, h, &layout, &mut xs))?,
                Some(2.0 * tk * h as f64 * 2.0 + 4.0 * tk),
            ),
            (
                "unpermute",
                time(&ctx, iters, || {
                    unpermute(
                        &ctx,
                        &xs,
                        h,
                        &layout,
                        &routes,
                        CombineOrder::Slots,
                        &mut out,
                    )
                })?,
                Some(tk * h as f64 * 2.0 + th * 2.0 + 8.0 * tk),
            ),
        ];
        validator.result(&ctx)?.map_err(KernelError::Route)?;
        for (stage, us, bytes) in stages {
            let min = us.iter().copied().fold(f64::INFINITY, f64::min);
            let med = median(us);
            let floor = bytes.map(|b| b / CEILING * 1e6);
            let ratio = floor.map(|f| f / med);
            let row = serde_json::json!({
                "stage": stage, "tokens": t, "hidden": h, "experts": e, "top_k": k,
                "median_us": med, "min_us": min, "iters": iters, "bytes": bytes,
                "gbps": bytes.map(|b| b / med / 1e3), "floor_us": floor,
                "ratio_to_ceiling": ratio, "kernel_digest": digest,
                "device": ctx.device_name()?,
            });
            println!("{row}");
            eprintln!(
                "{t:>9} {stage:>10} {med:>10.1} {min:>10.1} {:>10} {:>9} {:>7}",
                bytes.map_or("-".into(), |b| format!("{:.2}", b / 1e9)),
                floor.map_or("-".into(), |f| format!("{f:.1}")),
                ratio.map_or("-".into(), |r| format!("{:.0}%", r * 100.0)),
            );
        }
    }
    Ok(())
}
