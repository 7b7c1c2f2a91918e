//! The layer on CUDA tensors: afdep-moe's [`MoeLayer`] through
//! [`afdep_moe::external`], reading and writing the caller's tensors in place, ordered on the
//! caller's stream (PyTorch's current stream).
//!
//! One [`GpuContext`] per device is built on first use and kept for the life of the process,
//! with cudarc's per-buffer event tracking off: every buffer of the context lives on its one
//! stream, and the caller's stream is ordered against it by explicit events, which is also
//! what lets a step be captured in a CUDA graph. Layers (one per shape, token count, dispatch
//! and train flag) are kept in a cache of at most [`MAX_LAYERS`] per device, the least
//! recently used dropped first, so a model whose batch sizes vary does not hold device memory
//! for every size it ever saw. Dropping a layer is safe between eager calls: each eager call
//! waits for its step before it returns.
//!
//! Under CUDA graph capture (the caller's stream is capturing) a step is only queued
//! ([`enqueue_on_stream`]): no host wait, no allocation, no kernel compile. It is refused with
//! `afdep.CaptureError` when the layer has not run an eager step with the layer's router yet
//! (that step compiles and loads its kernels and allocates the layer), and for given routes
//! (their check is read on the host). A layer used by a capture is pinned: never dropped from
//! the cache (and not counted against [`MAX_LAYERS`]), since the graph refers to its buffers,
//! until [`unpin_layers`] says the graphs are gone.

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

use afdep_core::LayerShape;
use afdep_kernels::GpuContext;
use afdep_kernels::KernelError;
use afdep_kernels::cudarc::driver::sys as cu;
use afdep_moe::external::{
    BorrowedGrads, BorrowedStep, enqueue_on_stream, is_capturing, run_on_stream,
};
use afdep_moe::{Dispatch, LayerGpuError, MoeLayer};
use pyo3::prelude::*;

use crate::errors::{CaptureError, GpuError, gpu_error};
use crate::step::Step;

type LayerKey = (LayerShape, usize, Dispatch, bool);

/// Unpinned layers kept per device (see the module).
pub const MAX_LAYERS: usize = 8;

/// One cached layer.
struct Entry {
    key: LayerKey,
    layer: MoeLayer,
    /// An eager step with the layer's router ran (kernels loaded: capturable).
    warm: bool,
    /// Used by a CUDA graph capture: never dropped until [`unpin_layers`].
    pinned: bool,
}

struct Device {
    ctx: GpuContext,
    /// The cached layers, most recently used last.
    layers: Vec<Entry>,
}

fn devices() -> &'static Mutex<HashMap<usize, Device>> {
    static D: OnceLock<Mutex<HashMap<usize, Device>>> = OnceLock::new();
    D.get_or_init(|| Mutex::new(HashMap::new()))
}

fn lock() -> PyResult<std::sync::MutexGuard<'static, HashMap<usize, Device>>> {
    devices()
        .lock()
        .map_err(|_| GpuError::new_err("the GPU state is poisoned by an earlier panic"))
}

fn kernel_error(py: Python<'_>, e: KernelError) -> PyErr {
    gpu_error(py, &LayerGpuError::Kernel(e))
}

/// Runs `step` on device `ordinal`, queued on `stream` (a `cudaStream_t` as an integer).
pub fn run(
    py: Python<'_>,
    shape: LayerShape,
    ordinal: usize,
    dispatch: Dispatch,
    stream: usize,
    step: &Step,
) -> PyResult<()> {
    let tokens = step.x.shape[0];
    let train = step.train.is_some();
    let mut devs = lock()?;
    let cu_stream = stream as cu::CUstream;
    if let Some(dev) = devs.get(&ordinal) {
        dev.ctx
            .cuda()
            .bind_to_thread()
            .map_err(|e| kernel_error(py, KernelError::driver("binding the context")(e)))?;
    }
    // Asked before anything else: creating the context synchronises, which a capture cannot
    // hold. The legacy default stream (0) is never captured (PyTorch captures on a side
    // stream) and needs a current context to be asked about.
    let capturing = if cu_stream.is_null() {
        false
    } else {
        // SAFETY: `stream` is PyTorch's current stream on this device, a live stream (it
        // carries its context).
        unsafe { is_capturing(cu_stream) }.map_err(|e| kernel_error(py, e))?
    };
    let dev = match devs.entry(ordinal) {
        std::collections::hash_map::Entry::Occupied(o) => o.into_mut(),
        std::collections::hash_map::Entry::Vacant(_) if capturing => {
            return Err(CaptureError::new_err(format!(
                "afdep.MoE: no step ran on CUDA device {ordinal} outside CUDA graph capture \
                 yet; the first one compiles kernels and allocates device memory, which a \
                 capture cannot hold: run one eager forward and backward step with the same \
                 shapes (and no given routes) before torch.cuda.graph"
            )));
        }
        std::collections::hash_map::Entry::Vacant(v) => {
            let ctx = GpuContext::new(ordinal).map_err(|e| kernel_error(py, e))?;
            // SAFETY: no buffer of this context exists yet; every buffer it will have (the
            // layers', the fault word) is allocated, used and freed on the context's one
            // stream, whose order is all the synchronisation they need, and the caller's
            // buffers are ordered against that stream by explicit events (external.rs).
            unsafe { ctx.cuda().disable_event_tracking() };
            ctx.cuda()
                .bind_to_thread()
                .map_err(|e| kernel_error(py, KernelError::driver("binding the context")(e)))?;
            v.insert(Device {
                ctx,
                layers: Vec::new(),
            })
        }
    };
    let key = (shape, tokens, dispatch, train);
    let pos = dev.layers.iter().position(|e| e.key == key);
    let what = || {
        format!(
            "the {} of shape (d_model {}, width {}, experts {}, top_k {}, shared {}) on {tokens} \
             tokens, dispatch {}",
            if train {
                "train step (backward)"
            } else {
                "forward"
            },
            shape.d_model,
            shape.width,
            shape.experts,
            shape.top_k,
            shape.shared,
            dispatch.name()
        )
    };
    if capturing {
        if step.given {
            return Err(CaptureError::new_err(format!(
                "afdep.MoE under CUDA graph capture takes no given routes (topk_idx, \
                 topk_weights): their check is read on the host after each step, which a \
                 capture cannot do; route with the layer's router under capture, or run {} \
                 eagerly",
                what()
            )));
        }
        let Some(i) = pos.filter(|&i| dev.layers[i].warm) else {
            return Err(CaptureError::new_err(format!(
                "afdep.MoE: {} has not run outside CUDA graph capture yet; its first step \
                 compiles kernels and allocates device memory, which a capture cannot hold: \
                 run one eager forward and backward step with the same shapes (and no given \
                 routes) before torch.cuda.graph",
                what()
            )));
        };
        let mut entry = dev.layers.remove(i);
        entry.pinned = true;
        dev.layers.push(entry);
    } else {
        match pos {
            Some(i) => {
                let entry = dev.layers.remove(i);
                dev.layers.push(entry);
            }
            None => {
                let unpinned = dev.layers.iter().filter(|e| !e.pinned).count();
                if unpinned >= MAX_LAYERS {
                    // the least recently used unpinned layer (it exists: unpinned > 0)
                    if let Some(old) = dev.layers.iter().position(|e| !e.pinned) {
                        dev.layers.remove(old);
                    }
                }
                let layer = MoeLayer::new(&dev.ctx, shape, tokens, dispatch, train)
                    .map_err(|e| gpu_error(py, &e))?;
                dev.layers.push(Entry {
                    key,
                    layer,
                    warm: false,
                    pinned: false,
                });
            }
        }
    }
    let entry = dev.layers.last_mut().expect("the layer was just pushed");
    let ptr = |v: &crate::dlpack::View| v.ptr as u64;
    let borrowed = BorrowedStep {
        x: ptr(&step.x),
        params: step.params.each_ref().map(ptr),
        out: ptr(&step.out),
        idx: ptr(&step.idx),
        weights: ptr(&step.weights),
        given: step.given,
        train: step.train.as_ref().map(|t| BorrowedGrads {
            dy: ptr(&t.dy),
            dx: ptr(&t.dx),
            grads: t.grads.each_ref().map(ptr),
        }),
    };
    // SAFETY: every view was checked (device, dtype, shape, contiguity, no output overlapping
    // another tensor) against the layer's shape and token count by `Step::new`; the caller
    // (afdep's autograd function) keeps the tensors alive and untouched until PyTorch's
    // stream passes the step, and `stream` is PyTorch's current stream on that device. Under
    // capture the layer is warm (no compile, no allocation) and pinned (it outlives the graph).
    if capturing {
        unsafe { enqueue_on_stream(&mut entry.layer, &dev.ctx, cu_stream, &borrowed) }
            .map_err(|e| gpu_error(py, &e))
    } else {
        unsafe { run_on_stream(&mut entry.layer, &dev.ctx, cu_stream, &borrowed) }
            .map_err(|e| gpu_error(py, &e))?;
        if !step.given {
            entry.warm = true;
        }
        Ok(())
    }
}

/// Unpins every layer of device `ordinal` (all devices when `None`) that a CUDA graph capture
/// pinned: they become ordinary cache entries again, dropped when least recently used (the
/// cache is trimmed to [`MAX_LAYERS`] here). A device with pinned layers is waited for first
/// (all its streams), so that no replay launched before the call still uses a layer that a
/// later step drops. Call it once the graphs that captured afdep steps are destroyed;
/// returns how many were pinned.
pub fn unpin_layers(py: Python<'_>, ordinal: Option<usize>) -> PyResult<usize> {
    let mut devs = lock()?;
    let mut n = 0;
    for (o, dev) in devs.iter_mut() {
        if ordinal.is_some_and(|want| want != *o) {
            continue;
        }
        let pinned = dev.layers.iter().filter(|e| e.pinned).count();
        if pinned == 0 {
            continue;
        }
        dev.ctx
            .cuda()
            .synchronize()
            .map_err(|e| kernel_error(py, KernelError::driver("waiting for the device")(e)))?;
        for e in dev.layers.iter_mut() {
            e.pinned = false;
        }
        n += pinned;
        let excess = dev.layers.len().saturating_sub(MAX_LAYERS);
        dev.layers.drain(..excess);
    }
    Ok(n)
}

/// The cached layers of device `ordinal`, least recently used first: (shape tuple, tokens,
/// dispatch, train, warm, pinned).
pub type CacheRow = (
    (usize, usize, usize, usize, usize, bool),
    usize,
    String,
    bool,
    bool,
    bool,
);

/// The layer cache of device `ordinal` (empty before its first step), see [`CacheRow`].
pub fn layer_cache(ordinal: usize) -> PyResult<Vec<CacheRow>> {
    let devs = lock()?;
    Ok(devs.get(&ordinal).map_or_else(Vec::new, |dev| {
        dev.layers
            .iter()
            .map(|e| {
                let (s, t, d, train) = e.key;
                (
                    (
                        s.d_model,
                        s.width,
                        s.experts,
                        s.top_k,
                        s.shared,
                        s.renormalize,
                    ),
                    t,
                    d.name().to_string(),
                    train,
                    e.warm,
                    e.pinned,
                )
            })
            .collect()
    }))
}
