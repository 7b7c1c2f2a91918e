//! A [`MoeLayer`] step on buffers owned by the caller and ordered on the caller's CUDA stream
//! (the Python bindings: PyTorch's tensors and its current stream).
//!
//! The layer owns its buffers, so a step here is: the layer's stream waits for an event
//! recorded on the caller's stream; the caller's inputs (x, the seven parameters, given routes,
//! dy) are copied device to device into the layer; the step is queued; the outputs (out, the
//! router's routes, dx, the seven gradients) are copied device to device into the caller's
//! buffers; the caller's stream waits for an event recorded after the last copy. Nothing
//! between the two events waits on the host.
//!
//! [`run_on_stream`] then ends with [`MoeLayer::finish`], which reads the layer's route-check
//! word: one host wait per step, the price of reporting a rejected route as a typed error.
//! [`enqueue_on_stream`] stops before it: that part is what a CUDA graph captures on the
//! caller's stream (the event pair is the fork and join of the capture onto the layer's
//! stream); see its documentation for what the capture needs. The context should have
//! cudarc's per-buffer event tracking off (`CudaContext::disable_event_tracking`, as the
//! Python bindings do): every buffer of the layer lives on the context's one stream, and a
//! capture must not wait on events recorded outside it.
//!
//! Every pointer is a device pointer of the layer's CUDA context (the device's primary
//! context, which PyTorch uses too) to a contiguous buffer of the documented size.

use afdep_kernels::cudarc::driver::sys as cu;
use afdep_kernels::cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut, DeviceRepr};
use afdep_kernels::{GpuContext, KernelError};

use crate::layer::{LayerGpuError, LayerRouting, MoeLayer};

/// A device pointer owned by the caller (`CUdeviceptr`).
pub type DevPtr = u64;

/// The caller's buffers of one step; sizes follow the layer's shape and token count.
#[derive(Debug, Clone, Copy)]
pub struct BorrowedStep {
    /// Input tokens, T × H bf16.
    pub x: DevPtr,
    /// The parameters in `PARAM_NAMES` order (wr, w1, w3, w2, s1, s3, s2), bf16.
    pub params: [DevPtr; 7],
    /// Output, T × H bf16.
    pub out: DevPtr,
    /// Expert ids, T × K i32: read when `given`, written by the router otherwise.
    pub idx: DevPtr,
    /// Route weights, T × K f32: read when `given`, written by the router otherwise.
    pub weights: DevPtr,
    /// Routes given by the caller ([`LayerRouting::Given`]) instead of the layer's router.
    pub given: bool,
    /// The train step's buffers; `None` runs the forward only.
    pub train: Option<BorrowedGrads>,
}

/// The caller's buffers of a train step.
#[derive(Debug, Clone, Copy)]
pub struct BorrowedGrads {
    /// Upstream gradient, T × H bf16.
    pub dy: DevPtr,
    /// Gradient with respect to x, T × H bf16.
    pub dx: DevPtr,
    /// Parameter gradients in `PARAM_NAMES` order, bf16.
    pub grads: [DevPtr; 7],
}

/// Whether `stream` is being captured into a CUDA graph (`cuStreamIsCapturing`). An
/// invalidated capture counts as capturing: work queued on it fails anyway.
///
/// # Safety
/// `stream` must be a live stream, or null (the legacy default stream; then a context must be
/// current).
pub unsafe fn is_capturing(stream: cu::CUstream) -> Result<bool, KernelError> {
    let mut status = cu::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
    // SAFETY: a plain query of a live stream (caller's contract) into a local.
    unsafe { cu::cuStreamIsCapturing(stream, &mut status) }
        .result()
        .map_err(KernelError::driver(
            "asking whether the stream is capturing",
        ))?;
    Ok(status != cu::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
}

/// Runs one step of `layer` ordered on the caller's `stream` (see the module documentation):
/// [`enqueue_on_stream`], then [`MoeLayer::finish`] (one host wait; a rejected route is
/// [`LayerGpuError::Route`]).
///
/// # Safety
/// As [`enqueue_on_stream`]; in addition `stream` must not be capturing (the host wait would
/// invalidate the capture).
pub unsafe fn run_on_stream(
    layer: &mut MoeLayer,
    ctx: &GpuContext,
    stream: cu::CUstream,
    step: &BorrowedStep,
) -> Result<(), LayerGpuError> {
    // SAFETY: the caller's contract.
    unsafe { enqueue_on_stream(layer, ctx, stream, step)? };
    layer.finish(ctx)
}

/// Queues one step of `layer` ordered on the caller's `stream` and returns without waiting
/// and without reading the route check: the outputs are ready once `stream` passes the step.
///
/// Everything it queues can be captured in a CUDA graph on `stream`, provided the layer has
/// already run one step of the same kind (forward or train step, same routing) outside
/// capture, which loaded every kernel module and the context's fault word (a first use
/// compiles and allocates); the graph then refers to the caller's buffers and to the layer's
/// own, so the layer must outlive the graph and its replays must be ordered with any other
/// step of the same layer. A rejected route or a kernel's device fault is not reported by
/// this call: the route-check word stays on the device (the router masks a token with a
/// non-finite logit: its ids come back as -1), and a fault stays in the context's fault word
/// until the next [`MoeLayer::finish`] or [`GpuContext::take_fault`].
///
/// # Safety
/// Every pointer of `step` must be a live device allocation of `ctx`'s device of at least the
/// size the layer needs, not written by anyone else until `stream` passes the step, and
/// `stream` must be a live stream of the same context (or null, the legacy default stream).
pub unsafe fn enqueue_on_stream(
    layer: &mut MoeLayer,
    ctx: &GpuContext,
    stream: cu::CUstream,
    step: &BorrowedStep,
) -> Result<(), LayerGpuError> {
    ctx.cuda()
        .bind_to_thread()
        .map_err(KernelError::driver("binding the context"))?;
    if step.train.is_some() && !layer.is_train() {
        return Err(LayerGpuError::Unsupported(
            "a train step on a forward-only layer".into(),
        ));
    }
    let own = ctx.stream().cu_stream();
    // SAFETY: both streams are live streams of this context (caller's contract).
    unsafe { order(stream, own)? };
    let (tokens, k) = (layer.tokens(), layer.shape().top_k);
    copy_in(ctx, layer.x_mut(), step.x)?;
    let p = layer.params_mut();
    let dsts = [
        &mut p.wr, &mut p.w1, &mut p.w3, &mut p.w2, &mut p.s1, &mut p.s3, &mut p.s2,
    ];
    for (dst, src) in dsts.into_iter().zip(step.params) {
        copy_in(ctx, dst, src)?;
    }
    if step.given {
        let r = layer.routes_mut();
        debug_assert_eq!(r.idx.len(), tokens * k);
        copy_in(ctx, &mut r.idx, step.idx)?;
        copy_in(ctx, &mut r.weights, step.weights)?;
    }
    let routing = if step.given {
        LayerRouting::Given
    } else {
        LayerRouting::Router
    };
    match &step.train {
        None => layer.enqueue_forward(ctx, routing)?,
        Some(t) => {
            copy_in(ctx, layer.dy_mut(), t.dy)?;
            layer.enqueue_train_step(ctx, routing)?;
        }
    }
    copy_out(ctx, layer.out(), step.out)?;
    if !step.given {
        copy_out(ctx, &layer.routes().idx, step.idx)?;
        copy_out(ctx, &layer.routes().weights, step.weights)?;
    }
    if let Some(t) = &step.train {
        copy_out(ctx, layer.dx(), t.dx)?;
        let grads = layer.grads().expect("train layers have gradients");
        for (src, dst) in grads.tensors().into_iter().zip(t.grads) {
            copy_out(ctx, src, dst)?;
        }
    }
    // SAFETY: as above, the other way round.
    unsafe { order(own, stream)? };
    Ok(())
}

/// Makes `later` wait (on the device) for everything queued so far on `first`.
unsafe fn order(first: cu::CUstream, later: cu::CUstream) -> Result<(), KernelError> {
    let drv = |what: &'static str| KernelError::driver(what);
    let mut ev: cu::CUevent = std::ptr::null_mut();
    // SAFETY: plain driver calls on an event created here and streams of the bound context.
    unsafe {
        cu::cuEventCreate(&mut ev, cu::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32)
            .result()
            .map_err(drv("creating an event"))?;
        let r = cu::cuEventRecord(ev, first)
            .result()
            .map_err(drv("recording an event"))
            .and_then(|()| {
                cu::cuStreamWaitEvent(later, ev, 0)
                    .result()
                    .map_err(drv("waiting on an event"))
            });
        // The driver releases the event once the recorded work has passed it.
        let d = cu::cuEventDestroy_v2(ev)
            .result()
            .map_err(drv("destroying an event"));
        r.and(d)
    }
}

fn copy_in<T: DeviceRepr>(
    ctx: &GpuContext,
    dst: &mut CudaSlice<T>,
    src: DevPtr,
) -> Result<(), KernelError> {
    let bytes = dst.len() * std::mem::size_of::<T>();
    if bytes == 0 {
        return Ok(());
    }
    let stream = ctx.stream();
    let (d, _guard) = dst.device_ptr_mut(stream);
    // SAFETY: `src` holds `bytes` bytes (caller's contract of `run_on_stream`), `d` is the
    // layer's buffer of that size; the copy is ordered on the layer's stream.
    unsafe { cu::cuMemcpyDtoDAsync_v2(d, src, bytes, stream.cu_stream()) }
        .result()
        .map_err(KernelError::driver("copying an input into the layer"))
}

fn copy_out<T: DeviceRepr>(
    ctx: &GpuContext,
    src: &CudaSlice<T>,
    dst: DevPtr,
) -> Result<(), KernelError> {
    let bytes = src.len() * std::mem::size_of::<T>();
    if bytes == 0 {
        return Ok(());
    }
    let stream = ctx.stream();
    let (s, _guard) = src.device_ptr(stream);
    // SAFETY: as in `copy_in`, the other way round.
    unsafe { cu::cuMemcpyDtoDAsync_v2(dst, s, bytes, stream.cu_stream()) }
        .result()
        .map_err(KernelError::driver("copying an output out of the layer"))
}
