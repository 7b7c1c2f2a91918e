//! The GPU context: creation, the architecture, lazy module loading, the cache.

mod common;

use afdep_kernels::sources::{KernelId, runtime_variants};
use afdep_kernels::{GpuContext, JitOptions, KernelError, source_digest};
use common::gpu;

#[test]
fn no_driver_is_a_typed_error_never_a_panic() {
    // On a machine without a driver this is NoDriver (a skip of the rest, or a failure with
    // AFDEP_REQUIRE_GPU=1, like every GPU test); with one, a context.
    match GpuContext::new(0) {
        Ok(ctx) => assert_eq!(ctx.ordinal(), 0),
        Err(KernelError::NoDriver { why }) => {
            assert!(
                !common::require_gpu(),
                "AFDEP_REQUIRE_GPU is set, but there is no usable driver: {why}"
            );
            println!("SKIP: {why}");
        }
        Err(e) => panic!("creating the GPU context failed with an unexpected error: {e}"),
    }
    match GpuContext::new(1 << 20) {
        Ok(_) => panic!("device 2^20 cannot exist"),
        Err(e) => assert!(
            matches!(
                e,
                KernelError::NoDriver { .. } | KernelError::Unsupported(_)
            ),
            "{e}"
        ),
    }
}

#[test]
fn hopper_gets_sm_90a_and_every_kernel_loads() {
    let Some(ctx) = gpu() else { return };
    println!(
        "device {} ({}), kernels {}",
        ctx.device_name().unwrap(),
        ctx.arch(),
        source_digest()
    );
    let (major, minor) = ctx.cuda().compute_capability().unwrap();
    if (major, minor) == (9, 0) {
        assert_eq!(ctx.arch().as_str(), "sm_90a");
    }
    for spec in runtime_variants() {
        for k in spec.file.kernels() {
            ctx.function(k, spec.experts.unwrap_or(64), spec.top_k.unwrap_or(1))
                .unwrap();
        }
    }
    // Loaded once: a second request is a map lookup.
    let t = std::time::Instant::now();
    for _ in 0..1000 {
        ctx.function(KernelId::RouterTopk, 64, 8).unwrap();
    }
    assert!(t.elapsed().as_millis() < 500);
    ctx.check().unwrap();
}

#[test]
fn cached_modules_load_in_a_fresh_context() {
    let Some(_) = gpu() else { return };
    let dir = tempfile::tempdir().unwrap();
    let opts = JitOptions {
        cache: afdep_kernels::CacheSetting::Dir(dir.path().to_path_buf()),
        ..JitOptions::from_env()
    };
    let a = GpuContext::with_options(0, opts.clone()).unwrap();
    let spec = afdep_kernels::ModuleSpec::of(KernelId::ValidateRoutes, 0, 8);
    let first = a.jit().compile(&spec, a.arch()).unwrap();
    assert!(!first.from_cache);
    let second = a.jit().compile(&spec, a.arch()).unwrap();
    assert!(second.from_cache);
    assert_eq!(first.cubin, second.cubin);
    // Corrupt the entry: rebuilt, and the module still loads and runs.
    let path = dir.path().join(format!("{}.cubin", first.key));
    std::fs::write(&path, b"AFDEPKC1garbage").unwrap();
    let b = GpuContext::with_options(0, opts).unwrap();
    let third = b.jit().compile(&spec, b.arch()).unwrap();
    assert!(!third.from_cache);
    b.function(KernelId::ValidateRoutes, 0, 8).unwrap();
}
