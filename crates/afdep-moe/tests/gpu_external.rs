//! `afdep_moe::external` (the Python bindings' path) on a caller's buffers and stream: a train
//! step that reads and writes the caller's buffers in place (256-byte-aligned addresses, lent
//! to the layer) and one whose buffers sit at odd offsets (copied) give the bits of the
//! layer's own step; and a step captured with `enqueue_on_stream` on the caller's stream in
//! global capture mode (as `torch.cuda.graph` captures), replayed with new inputs, gives the
//! bits of an eager step each time. Outputs are poisoned (NaN) before each step.
//!
//! Without a usable driver every test prints `SKIP: <reason>` and passes, unless
//! `AFDEP_REQUIRE_GPU=1`, which turns the skip into a failure.

mod common;

use std::sync::Arc;

use afdep_core::bf16;
use afdep_core::oracle::LayerParams;
use afdep_core::oracle::params::random_tokens;
use afdep_kernels::GpuContext;
use afdep_kernels::cudarc::driver::{
    CudaSlice, CudaStream, DevicePtr, DeviceRepr, ValidAsZeroBits, sys,
};
use afdep_kernels::ops::download;
use afdep_moe::external::{
    BorrowedGrads, BorrowedStep, enqueue_on_stream, is_capturing, run_on_stream,
};
use afdep_moe::{Dispatch, LayerRouting, MoeLayer};
use common::{gpu, shape};

const T: usize = 57;

/// A caller's buffer: `pad` elements of slack before the `len` the step sees.
struct Buf<E> {
    slice: CudaSlice<E>,
    pad: usize,
}

impl<E: DeviceRepr + ValidAsZeroBits + Default + Clone + Copy> Buf<E> {
    fn new(s: &Arc<CudaStream>, host: &[E], pad: usize) -> Buf<E> {
        let mut slice = s.alloc_zeros::<E>(host.len() + pad).unwrap();
        if !host.is_empty() {
            s.memcpy_htod(host, &mut slice.slice_mut(pad..)).unwrap();
        }
        Buf { slice, pad }
    }

    fn ptr(&self, s: &Arc<CudaStream>) -> u64 {
        let (p, _guard) = self.slice.device_ptr(s);
        p + (self.pad * std::mem::size_of::<E>()) as u64
    }

    fn read(&self, s: &Arc<CudaStream>) -> Vec<E> {
        s.clone_dtoh(&self.slice).unwrap()[self.pad..].to_vec()
    }
}

fn nan(n: usize) -> Vec<bf16> {
    vec![bf16::from_bits(0xFFFF); n]
}

/// The caller's buffers of one train step with the layer's router.
struct Caller {
    x: Buf<bf16>,
    dy: Buf<bf16>,
    params: Vec<Buf<bf16>>,
    out: Buf<bf16>,
    dx: Buf<bf16>,
    grads: Vec<Buf<bf16>>,
    idx: Buf<i32>,
    weights: Buf<f32>,
}

impl Caller {
    fn new(s: &Arc<CudaStream>, p: &LayerParams, x: &[bf16], dy: &[bf16], pad: usize) -> Caller {
        let k = p.shape.top_k;
        Caller {
            x: Buf::new(s, x, pad),
            dy: Buf::new(s, dy, pad),
            params: p.tensors().iter().map(|t| Buf::new(s, t, pad)).collect(),
            out: Buf::new(s, &nan(x.len()), pad),
            dx: Buf::new(s, &nan(x.len()), pad),
            grads: p
                .tensors()
                .iter()
                .map(|t| Buf::new(s, &nan(t.len()), pad))
                .collect(),
            idx: Buf::new(s, &vec![-7; T * k], pad),
            weights: Buf::new(s, &vec![f32::NAN; T * k], pad),
        }
    }

    fn step(&self, s: &Arc<CudaStream>) -> BorrowedStep {
        let seven = |v: &[Buf<bf16>]| -> [u64; 7] { std::array::from_fn(|i| v[i].ptr(s)) };
        BorrowedStep {
            x: self.x.ptr(s),
            params: seven(&self.params),
            out: self.out.ptr(s),
            idx: self.idx.ptr(s),
            weights: self.weights.ptr(s),
            given: false,
            train: Some(BorrowedGrads {
                dy: self.dy.ptr(s),
                dx: self.dx.ptr(s),
                grads: seven(&self.grads),
            }),
        }
    }

    /// out, dx and the gradients as bits, then the routes.
    fn read(&self, s: &Arc<CudaStream>) -> (Vec<Vec<u16>>, Vec<i32>, Vec<u32>) {
        let bits = |b: &Buf<bf16>| b.read(s).iter().map(|v| v.to_bits()).collect::<Vec<u16>>();
        let mut t = vec![bits(&self.out), bits(&self.dx)];
        t.extend(self.grads.iter().map(bits));
        let w = self.weights.read(s).iter().map(|v| v.to_bits()).collect();
        (t, self.idx.read(s), w)
    }
}

/// The layer's own train step on `x`, `dy` (its buffers), read back like `Caller::read`.
fn own_step(
    ctx: &GpuContext,
    layer: &mut MoeLayer,
    x: &[bf16],
    dy: &[bf16],
) -> (Vec<Vec<u16>>, Vec<i32>, Vec<u32>) {
    layer.upload_x(ctx, x).unwrap();
    layer.upload_dy(ctx, dy).unwrap();
    layer.poison_outputs(ctx).unwrap();
    layer.train_step(ctx, LayerRouting::Router).unwrap();
    let bits = |b: &CudaSlice<bf16>| {
        download(ctx, b)
            .unwrap()
            .iter()
            .map(|v| v.to_bits())
            .collect::<Vec<u16>>()
    };
    let mut t = vec![bits(layer.out()), bits(layer.dx())];
    t.extend(layer.grads().unwrap().tensors().iter().map(|g| bits(g)));
    let r = layer.routes().download(ctx).unwrap();
    (t, r.idx, r.weights.iter().map(|v| v.to_bits()).collect())
}

fn context() -> Option<(std::sync::MutexGuard<'static, ()>, GpuContext)> {
    let (g, ctx) = gpu()?;
    // SAFETY: no buffer exists yet; every buffer of these tests is used on the context's
    // stream or on the caller's stream, ordered against each other by `external`'s events
    // and by the synchronisations below (as the Python bindings run it).
    unsafe { ctx.cuda().disable_event_tracking() };
    Some((g, ctx))
}

/// Lent (pad 0) and copied (pad 3: 6 or 12 bytes past an allocation) buffers give the bits
/// of the layer's own step.
#[test]
fn borrowed_buffers_in_place_and_at_odd_offsets_match_the_layers_own_step() {
    let Some((_g, ctx)) = context() else { return };
    let sh = shape(96, 40, 12, 3, 24);
    let p = LayerParams::random(sh, 5);
    let (x, dy) = (random_tokens(T, 96, 6), random_tokens(T, 96, 7));
    let mut own = MoeLayer::new(&ctx, sh, T, Dispatch::FusedGsum, true).unwrap();
    own.upload_params(&ctx, &p).unwrap();
    let want = own_step(&ctx, &mut own, &x, &dy);
    assert!(
        want.0.iter().all(|t| t.iter().all(|&b| b != 0xFFFF)),
        "the layer left NaN"
    );
    let caller = ctx.cuda().new_stream().unwrap();
    let mut layer = MoeLayer::new(&ctx, sh, T, Dispatch::FusedGsum, true).unwrap();
    for pad in [0, 3] {
        let c = Caller::new(&caller, &p, &x, &dy, pad);
        caller.synchronize().unwrap();
        assert_eq!(c.out.ptr(&caller) % 256 == 0, pad == 0);
        // SAFETY: every buffer holds the layer's sizes, lives until the end of the loop body
        // and is only touched again after `caller` passes the step (synchronised below).
        unsafe { run_on_stream(&mut layer, &ctx, caller.cu_stream(), &c.step(&caller)) }.unwrap();
        caller.synchronize().unwrap();
        assert!(
            c.x.read(&caller) == x,
            "pad {pad}: the step wrote its input x"
        );
        assert!(
            want == c.read(&caller),
            "pad {pad}: the caller's buffers differ from the layer's own step"
        );
    }
}

/// `enqueue_on_stream` captured on the caller's stream (global mode, after one eager step),
/// replayed after new x and dy are written into the caller's buffers: each replay gives the
/// bits of an eager step of the layer on the same inputs.
#[test]
fn a_captured_borrowed_step_replays_like_an_eager_step() {
    let Some((_g, ctx)) = context() else { return };
    let sh = shape(64, 24, 5, 2, 32);
    let p = LayerParams::random(sh, 9);
    let (x0, dy0) = (random_tokens(T, 64, 10), random_tokens(T, 64, 11));
    let caller = ctx.cuda().new_stream().unwrap();
    let mut layer = MoeLayer::new(&ctx, sh, T, Dispatch::FusedGsum, true).unwrap();
    let mut eager = MoeLayer::new(&ctx, sh, T, Dispatch::FusedGsum, true).unwrap();
    eager.upload_params(&ctx, &p).unwrap();
    let mut c = Caller::new(&caller, &p, &x0, &dy0, 0);
    caller.synchronize().unwrap();
    let step = c.step(&caller);
    // SAFETY (every step below): the buffers hold the layer's sizes and live to the end of
    // the test; the host touches them only after synchronising `caller`.
    unsafe { run_on_stream(&mut layer, &ctx, caller.cu_stream(), &step) }.unwrap();
    caller.synchronize().unwrap();
    // SAFETY: a live stream of the current context.
    assert!(!unsafe { is_capturing(caller.cu_stream()) }.unwrap());
    caller
        .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL)
        .unwrap();
    // SAFETY: as above.
    let capturing = unsafe { is_capturing(caller.cu_stream()) };
    let queued = unsafe { enqueue_on_stream(&mut layer, &ctx, caller.cu_stream(), &step) };
    let graph = caller.end_capture(sys::CUgraphInstantiate_flags(0));
    assert!(capturing.unwrap(), "cuStreamIsCapturing missed the capture");
    queued.unwrap();
    let graph = graph.unwrap().expect("a non-empty capture");
    for seed in 0..4u64 {
        let x = random_tokens(T, 64, 100 + seed);
        let dy = random_tokens(T, 64, 200 + seed);
        caller.memcpy_htod(&x, &mut c.x.slice).unwrap();
        caller.memcpy_htod(&dy, &mut c.dy.slice).unwrap();
        for b in [&mut c.out, &mut c.dx]
            .into_iter()
            .chain(c.grads.iter_mut())
        {
            let n = b.slice.len();
            caller.memcpy_htod(&nan(n), &mut b.slice).unwrap();
        }
        graph.launch().unwrap();
        caller.synchronize().unwrap();
        let got = c.read(&caller);
        let want = own_step(&ctx, &mut eager, &x, &dy);
        assert!(got == want, "replay {seed}: differs from the eager step");
    }
}
