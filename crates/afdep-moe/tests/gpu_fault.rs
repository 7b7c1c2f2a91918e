//! The fault path of the GEMMs' bounded TMA waits: with fault injection on
//! (`afdep_kernels::ops::gemm::inject_tma_fault`: every TMA stage expects more bytes than its
//! boxes deliver), a train step neither hangs nor traps: it returns
//! [`KernelError::DeviceFault`] within a bound, its outputs read as NaN (no partial output that
//! looks valid), and the next step on the same layer and context, injection off, matches the
//! CPU oracle; on both GEMM engines, and with the warp-specialised weight-gradient kernel
//! forced (its waits run out too: the step is still bounded). A test binary of its own: the
//! injection is process-wide.
//!
//! Without a usable driver the test prints `SKIP: <reason>` and passes, unless
//! `AFDEP_REQUIRE_GPU=1` (the GPU bundle sets it).

mod common;

use std::time::{Duration, Instant};

use afdep_core::oracle::LayerParams;
use afdep_core::oracle::layer::train_step_with_routes;
use afdep_core::oracle::params::random_tokens;
use afdep_kernels::KernelError;
use afdep_kernels::ops::download;
use afdep_kernels::ops::gemm::{Engine, force_engine, force_wgrad_engine, inject_tma_fault};
use afdep_moe::accuracy::{OUT_TOL, max_rel_err};
use afdep_moe::{Dispatch, LayerGpuError, LayerRouting};
use common::{gpu, hot_routes, shape, train_layer};
use rand::SeedableRng;

#[test]
fn a_tma_wait_that_runs_out_is_a_typed_fault_and_the_layer_recovers() {
    let Some((_g, ctx)) = gpu() else { return };
    let sh = shape(96, 64, 8, 2, 64);
    let t = 300;
    let params = LayerParams::random(sh, 5);
    let x = random_tokens(t, 96, 6);
    let dy = random_tokens(t, 96, 7);
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(8);
    let routes = hot_routes(&mut rng, t, 2, 8);
    let (want, _) = train_step_with_routes(&params, &x, t, &dy, &routes).unwrap();
    // sorted: A and B by TMA; gather: B by TMA, A rows by cp.async. On the default engine
    // (the warp-specialised one, whose consumers run out on `full` and its producer then on
    // `empty`) and on the classic kernel (forced); then the default rows engine with the ws
    // weight-gradient kernel forced (sorted: both its operands by TMA; gather: one gathered),
    // then the classic weight-gradient kernel forced.
    let cases = [
        (None, None, Dispatch::Sorted),
        (None, None, Dispatch::Gather),
        (Some(Engine::Classic), None, Dispatch::Sorted),
        (Some(Engine::Classic), None, Dispatch::Gather),
        (None, Some(Engine::Ws), Dispatch::Sorted),
        (None, Some(Engine::Ws), Dispatch::Gather),
        (None, Some(Engine::Classic), Dispatch::Sorted),
        (None, Some(Engine::Classic), Dispatch::Gather),
    ];
    for (engine, wgrad, d) in cases {
        force_engine(engine);
        force_wgrad_engine(wgrad);
        let mut layer = train_layer(&ctx, sh, t, d, &params, &x, &dy);
        layer.upload_routes(&ctx, &routes).unwrap();

        inject_tma_fault(16, 50);
        let start = Instant::now();
        let r = layer.train_step(&ctx, LayerRouting::Given);
        let took = start.elapsed();
        inject_tma_fault(0, 0);
        match r {
            Err(LayerGpuError::Kernel(KernelError::DeviceFault { what, .. })) => {
                assert!(
                    what.contains("TMA"),
                    "{d} {engine:?} wgrad {wgrad:?}: {what}"
                );
            }
            other => {
                panic!("{d} {engine:?} wgrad {wgrad:?}: expected a device fault, got {other:?}")
            }
        }
        // Each GEMM's blocks give up after one 50 ms wait per thread; a step has a handful
        // of GEMM launches.
        assert!(
            took < Duration::from_secs(10),
            "{d} {engine:?} wgrad {wgrad:?}: the faulty step took {took:?}"
        );
        let out = download(&ctx, layer.out()).unwrap();
        assert!(
            out.iter().all(|v| v.to_f32().is_nan()),
            "{d} {engine:?} wgrad {wgrad:?}: the outputs of a faulted step are poisoned"
        );

        // The same layer and context work afterwards.
        layer.train_step(&ctx, LayerRouting::Given).unwrap();
        let out = download(&ctx, layer.out()).unwrap();
        let e = max_rel_err(&out, &want);
        assert!(
            e <= OUT_TOL,
            "{d} {engine:?} wgrad {wgrad:?}: after the fault, out error {e} > {OUT_TOL}"
        );
        ctx.take_fault().unwrap();
    }
    force_engine(None);
    force_wgrad_engine(None);
}
