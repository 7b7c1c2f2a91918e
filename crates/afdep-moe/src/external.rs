//! A [`MoeLayer`] step on buffers owned by the caller and ordered on the caller's CUDA stream
//! (the Python bindings: PyTorch's tensors and its current stream).
//!
//! The step reads and writes the caller's buffers in place: each caller buffer whose address
//! is [`LEND_ALIGN`]-aligned (every allocation of the CUDA and PyTorch allocators is) is lent
//! to the layer for the step, swapped in for the layer's own buffer of the same size and
//! swapped back afterwards, so the kernels read x, the parameters, given routes and dy and
//! write out, the router's routes, dx and the seven gradients where the caller keeps them
//! (zero copies). A caller buffer at another address (a view at an odd offset) is copied
//! device to device into the layer's own buffer (inputs) or out of it (outputs) instead. The
//! layer's stream waits for an event recorded on the caller's stream before the first read,
//! and the caller's stream waits for an event recorded after the last write: nothing between
//! the two events waits on the host.
//!
//! [`run_on_stream`] then ends with [`MoeLayer::finish`], which reads the layer's route-check
//! word: one host wait per step, the price of reporting a rejected route as a typed error.
//! [`enqueue_on_stream`] stops before it: that part is what a CUDA graph captures on the
//! caller's stream (the event pair is the fork and join of the capture onto the layer's
//! stream); see its documentation for what the capture needs.
//!
//! Every pointer is a device pointer of the layer's CUDA context (the device's primary
//! context, which PyTorch uses too) to a contiguous buffer of the documented size. The
//! context should have cudarc's per-buffer event tracking off
//! (`CudaContext::disable_event_tracking`, as the Python bindings do): every buffer of the
//! layer lives on the context's one stream, and a capture must not wait on events recorded
//! outside it.

use afdep_core::bf16;
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

/// The alignment a caller buffer needs to be lent to the layer (see the module): that of the
/// layer's own allocations, so the kernels see the same address classes they were built and
/// tested for. Other addresses are copied.
pub const LEND_ALIGN: u64 = 256;

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
/// [`LayerGpuError::Route`], the caller's outputs then hold NaN).
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
    // SAFETY: the caller's contract; the poisoning in `finish` writes only buffers the step
    // writes anyway, still lent until `lent` drops.
    let lent = unsafe { queue(layer, ctx, stream, step)? };
    lent.layer.finish(ctx)
}

/// Queues one step of `layer` ordered on the caller's `stream` and returns without waiting
/// and without reading the route check: the outputs are ready once `stream` passes the step.
///
/// Everything it queues can be captured in a CUDA graph on `stream`, provided the layer has
/// already run one step of the same kind (forward or train step, same routing) outside
/// capture, which loaded every kernel module and the context's fault word (a first use
/// compiles and allocates); the graph then refers to the caller's buffers (lent) and to the
/// layer's own, so the layer must outlive the graph and its replays must be ordered with any
/// other step of the same layer. A rejected route or a kernel's device fault is not reported
/// by this call: the route-check word stays on the device (the router masks a token with a
/// non-finite logit: its ids come back as -1), and a fault stays in the context's fault word
/// until the next [`MoeLayer::finish`] or [`GpuContext::take_fault`].
///
/// # Safety
/// Every pointer of `step` must be a live device allocation of `ctx`'s device of at least the
/// size the layer needs, not written (outputs: not read or written) by anyone else until
/// `stream` passes the step; no output may overlap another buffer of the step; `stream` must
/// be a live stream of the same context (or null, the legacy default stream).
pub unsafe fn enqueue_on_stream(
    layer: &mut MoeLayer,
    ctx: &GpuContext,
    stream: cu::CUstream,
    step: &BorrowedStep,
) -> Result<(), LayerGpuError> {
    // SAFETY: the caller's contract.
    unsafe { queue(layer, ctx, stream, step) }.map(drop)
}

/// The step's queueing; the returned guard holds the caller's lent buffers in the layer until
/// it drops.
///
/// # Safety
/// As [`enqueue_on_stream`].
unsafe fn queue<'l>(
    layer: &'l mut MoeLayer,
    ctx: &GpuContext,
    stream: cu::CUstream,
    step: &BorrowedStep,
) -> Result<Lent<'l>, LayerGpuError> {
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
    let mut lent = Lent {
        layer,
        aside: Vec::new(),
        aside_routes: (None, None),
        copies: Vec::new(),
    };
    // SAFETY: the caller's contract.
    let queued = unsafe { lend_and_queue(&mut lent, ctx, step) };
    // The join, also after an error: whatever was queued is ordered before the caller's later
    // work (under capture: the capture stays joined).
    // SAFETY: as above, the other way round.
    let joined = unsafe { order(own, stream) };
    queued?;
    joined?;
    Ok(lent)
}

/// Lends (or copies in) the step's buffers and queues the step and the copies out.
///
/// # Safety
/// As [`enqueue_on_stream`].
unsafe fn lend_and_queue(
    lent: &mut Lent<'_>,
    ctx: &GpuContext,
    step: &BorrowedStep,
) -> Result<(), LayerGpuError> {
    // SAFETY (every `input`/`output` below): each pointer holds the buffer's size and nobody
    // else touches it until `stream` passes the step (caller's contract); the layer only
    // reads its inputs, and the outputs overlap nothing else of the step.
    unsafe {
        lent.input(ctx, Slot::X, step.x)?;
        for (i, p) in step.params.into_iter().enumerate() {
            lent.input(ctx, Slot::Param(i), p)?;
        }
        lent.routes(ctx, step.idx, step.weights, step.given)?;
        lent.output(ctx, Slot::Out, step.out);
        if let Some(t) = &step.train {
            lent.input(ctx, Slot::Dy, t.dy)?;
            lent.output(ctx, Slot::Dx, t.dx);
            for (i, g) in t.grads.into_iter().enumerate() {
                lent.output(ctx, Slot::Grad(i), g);
            }
        }
    }
    let routing = if step.given {
        LayerRouting::Given
    } else {
        LayerRouting::Router
    };
    match &step.train {
        None => lent.layer.enqueue_forward(ctx, routing)?,
        Some(_) => lent.layer.enqueue_train_step(ctx, routing)?,
    }
    lent.copy_back(ctx)?;
    Ok(())
}

/// A bf16 buffer of the layer that a step may lend.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Slot {
    X,
    Dy,
    Out,
    Dx,
    /// A parameter, `PARAM_NAMES` order.
    Param(usize),
    /// A parameter gradient, `PARAM_NAMES` order.
    Grad(usize),
}

/// The layer's buffer of `slot`.
fn slot(layer: &mut MoeLayer, slot: Slot) -> &mut CudaSlice<bf16> {
    match slot {
        Slot::X => layer.x_mut(),
        Slot::Dy => layer.dy_mut(),
        Slot::Out => layer.out_mut(),
        Slot::Dx => layer.dx_mut(),
        Slot::Param(i) => nth(layer.params_mut().tensors_mut(), i),
        Slot::Grad(i) => nth(
            layer
                .grads_mut()
                .expect("only train steps lend gradients, to train layers")
                .tensors_mut(),
            i,
        ),
    }
}

fn nth<T>(a: [T; 7], i: usize) -> T {
    a.into_iter().nth(i).expect("seven parameters")
}

/// The caller's buffers lent to `layer` for one step (see the module). Dropping it swaps the
/// layer's own buffers back in, so that the layer never frees (or keeps) a caller's buffer,
/// also on an error or a panic between the swaps.
struct Lent<'l> {
    layer: &'l mut MoeLayer,
    /// The layer's own bf16 buffers, set aside while the caller's are lent.
    aside: Vec<(Slot, CudaSlice<bf16>)>,
    /// The layer's own route buffers (ids, weights), set aside likewise.
    aside_routes: (Option<CudaSlice<i32>>, Option<CudaSlice<f32>>),
    /// Outputs that were not lent: copied out of the layer after the step.
    copies: Vec<(Back, DevPtr)>,
}

/// An output copied out of the layer after the step.
#[derive(Debug, Clone, Copy)]
enum Back {
    Bf16(Slot),
    Idx,
    Weights,
}

/// Lends the caller's buffer at `ptr` to `buf` when it is [`LEND_ALIGN`]-aligned and not
/// empty: returns the layer's own buffer, set aside.
///
/// # Safety
/// `ptr` is a live device allocation of the stream's context holding `buf.len()` elements,
/// used by nobody else until the step has passed.
unsafe fn lend<T: DeviceRepr>(
    ctx: &GpuContext,
    buf: &mut CudaSlice<T>,
    ptr: DevPtr,
) -> Option<CudaSlice<T>> {
    if buf.is_empty() || ptr % LEND_ALIGN != 0 {
        return None;
    }
    // SAFETY: the caller's contract; the slice is never dropped (`give_back` leaks it).
    let foreign = unsafe { ctx.stream().upgrade_device_ptr::<T>(ptr, buf.len()) };
    Some(std::mem::replace(buf, foreign))
}

/// Puts the layer's own buffer back and forgets the lent one (the caller owns it).
fn give_back<T>(buf: &mut CudaSlice<T>, own: CudaSlice<T>) {
    let foreign = std::mem::replace(buf, own);
    let _ = foreign.leak();
}

impl Lent<'_> {
    /// An input: lent, or copied into the layer's buffer now.
    ///
    /// # Safety
    /// As [`lend`], `ptr` holding the slot's size.
    unsafe fn input(&mut self, ctx: &GpuContext, s: Slot, ptr: DevPtr) -> Result<(), KernelError> {
        let buf = slot(self.layer, s);
        // SAFETY: the caller's contract.
        match unsafe { lend(ctx, buf, ptr) } {
            Some(own) => self.aside.push((s, own)),
            None => copy_in(ctx, buf, ptr)?,
        }
        Ok(())
    }

    /// An output: lent, or copied out of the layer's buffer after the step.
    ///
    /// # Safety
    /// As [`lend`], `ptr` holding the slot's size.
    unsafe fn output(&mut self, ctx: &GpuContext, s: Slot, ptr: DevPtr) {
        let buf = slot(self.layer, s);
        // SAFETY: the caller's contract.
        match unsafe { lend(ctx, buf, ptr) } {
            Some(own) => self.aside.push((s, own)),
            None => self.copies.push((Back::Bf16(s), ptr)),
        }
    }

    /// The routes: inputs when `given`, the router's outputs otherwise.
    ///
    /// # Safety
    /// As [`lend`], `idx` and `weights` holding tokens × top_k elements.
    unsafe fn routes(
        &mut self,
        ctx: &GpuContext,
        idx: DevPtr,
        weights: DevPtr,
        given: bool,
    ) -> Result<(), KernelError> {
        let r = self.layer.routes_mut();
        // SAFETY: the caller's contract.
        match unsafe { lend(ctx, &mut r.idx, idx) } {
            Some(own) => self.aside_routes.0 = Some(own),
            None if given => copy_in(ctx, &mut r.idx, idx)?,
            None => self.copies.push((Back::Idx, idx)),
        }
        // SAFETY: as above.
        match unsafe { lend(ctx, &mut r.weights, weights) } {
            Some(own) => self.aside_routes.1 = Some(own),
            None if given => copy_in(ctx, &mut r.weights, weights)?,
            None => self.copies.push((Back::Weights, weights)),
        }
        Ok(())
    }

    /// Queues the copies of the outputs that were not lent.
    fn copy_back(&mut self, ctx: &GpuContext) -> Result<(), KernelError> {
        for (c, dst) in std::mem::take(&mut self.copies) {
            match c {
                Back::Bf16(s) => copy_out(ctx, slot(self.layer, s), dst)?,
                Back::Idx => copy_out(ctx, &self.layer.routes().idx, dst)?,
                Back::Weights => copy_out(ctx, &self.layer.routes().weights, dst)?,
            }
        }
        Ok(())
    }
}

impl Drop for Lent<'_> {
    fn drop(&mut self) {
        for (s, own) in self.aside.drain(..) {
            give_back(slot(self.layer, s), own);
        }
        let r = self.layer.routes_mut();
        if let Some(own) = self.aside_routes.0.take() {
            give_back(&mut r.idx, own);
        }
        if let Some(own) = self.aside_routes.1.take() {
            give_back(&mut r.weights, own);
        }
    }
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
