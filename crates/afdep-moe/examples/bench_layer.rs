//! Times the GPU MoE layer: forward and train step (router mode) of every dispatch strategy at
//! the reference record's shape (docs/design.md, "The reference record"), one JSON row per
//! (dispatch, tokens) on stdout.
//!
//! Each measurement is the median of `--iters` runs, each between its own pair of CUDA events
//! (created before any run) on the layer's stream, after 3 warm-up runs (which also load every
//! kernel module); a step is only queued (no host sync inside), as in a training loop. The
//! timing is `afdep_moe::timing`, which `afdep moe --backend cuda` uses too. Inputs are
//! afdep-core's seeded random parameters and tokens. The accuracy of these kernels is checked by
//! the `gpu_layer` tests against the CPU oracle; this program only times. `peak_gib` is every
//! buffer the layer allocates (inputs, outputs, parameters, gradients, intermediates, workspaces):
//! nothing else is allocated during a step.
//!
//! `bench_layer [--tokens 16384,131072,1048576] [--dispatch sorted,gather,fused,fused_gsum]
//! [--iters 10] [--shape H,W,E,K,S]` (`--shape`: d_model, expert width, experts, top-k and
//! shared width instead of the record's, e.g. `4096,14336,8,2,0` for the Mixtral-like row of
//! `afdep moe --suite models`; a small program to run under `ncu` at a model's size).

use afdep_core::LayerShape;
use afdep_core::oracle::LayerParams;
use afdep_core::oracle::params::random_tokens;
use afdep_kernels::GpuContext;
use afdep_moe::timing::{EventTimer, WARMUPS};
use afdep_moe::{Dispatch, LayerGpuError, LayerRouting, MoeLayer};

/// Times the GPU MoE layer (forward and train step) per dispatch strategy and token count.
#[derive(clap::Parser, Debug)]
struct Args {
    /// Token counts, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "16384,131072,1048576")]
    tokens: Vec<usize>,
    /// Dispatch strategies, comma-separated.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "sorted,gather,fused,fused_gsum"
    )]
    dispatch: Vec<Dispatch>,
    /// Timed runs per measurement.
    #[arg(long, default_value_t = 10)]
    iters: usize,
    /// The layer's sizes `H,W,E,K,S` (default: the record's, 512,128,64,8,1024).
    #[arg(long, value_delimiter = ',')]
    shape: Option<Vec<usize>>,
}

fn main() {
    if let Err(e) = run() {
        eprintln!("bench_layer: {e}");
        std::process::exit(2);
    }
}

fn run() -> Result<(), LayerGpuError> {
    let Args {
        tokens,
        dispatch: dispatches,
        iters,
        shape,
    } = <Args as clap::Parser>::parse();
    let ctx = GpuContext::new(0)?;
    // SAFETY: every buffer lives on the context's one stream, whose order is all the
    // synchronisation needed; no buffer exists yet. Without this, cudarc records and waits on
    // events around every launch.
    unsafe { ctx.cuda().disable_event_tracking() };
    let shape = match shape.as_deref() {
        Some(&[d_model, width, experts, top_k, shared]) => {
            LayerShape::renormalized(d_model, width, experts, top_k, shared)
        }
        Some(other) => {
            return Err(LayerGpuError::Unsupported(format!(
                "--shape takes five sizes H,W,E,K,S, not {other:?}"
            )));
        }
        None => LayerShape::RECORD,
    };
    let params = LayerParams::random(shape, 0);
    let device = ctx.device_name()?;
    let timer = EventTimer::new(&ctx, iters)?;
    for &t in &tokens {
        let x = random_tokens(t, shape.d_model, 1);
        let dy = random_tokens(t, shape.d_model, 2);
        for &d in &dispatches {
            let mut layer = MoeLayer::new(&ctx, shape, t, d, true)?;
            layer.upload_params(&ctx, &params)?;
            layer.upload_x(&ctx, &x)?;
            layer.upload_dy(&ctx, &dy)?;
            let fwd = timer
                .time(&ctx, WARMUPS, || {
                    layer.enqueue_forward(&ctx, LayerRouting::Router)
                })?
                .median_ms;
            let train = timer
                .time(&ctx, WARMUPS, || {
                    layer.enqueue_train_step(&ctx, LayerRouting::Router)
                })?
                .median_ms;
            layer.finish(&ctx)?;
            let row = serde_json::json!({
                "d_model": shape.d_model, "width": shape.width, "experts": shape.experts,
                "top_k": shape.top_k, "shared": shape.shared, "tokens": t,
                "impl": "afdep-cuda", "dispatch": d.name(),
                "fwd_ms": fwd, "train_ms": train,
                "peak_gib": layer.device_bytes() as f64 / (1u64 << 30) as f64,
                "iters": iters, "device": device,
                "kernel_digest": afdep_kernels::source_digest(),
                "status": "ok",
            });
            println!("{row}");
        }
    }
    Ok(())
}
