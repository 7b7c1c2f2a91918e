//! The layer on CUDA tensors: afdep-moe's [`MoeLayer`] through
//! [`afdep_moe::external::run_on_stream`], ordered on the caller's stream (PyTorch's current
//! stream). One [`GpuContext`] per device is built on first use and kept for the life of the
//! process; layers (one per shape, token count, dispatch and train flag) are kept in a cache of
//! at most [`MAX_LAYERS`] per device, the least recently used dropped first, so a model whose
//! batch sizes vary does not hold device memory for every size it ever saw. Dropping a layer
//! is safe at any point between calls: each call waits for its step before it returns.

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

use afdep_core::LayerShape;
use afdep_kernels::GpuContext;
use afdep_kernels::cudarc::driver::sys as cu;
use afdep_moe::external::{BorrowedGrads, BorrowedStep, run_on_stream};
use afdep_moe::{Dispatch, MoeLayer};
use pyo3::prelude::*;

use crate::errors::{GpuError, gpu_error};
use crate::step::Step;

type LayerKey = (LayerShape, usize, Dispatch, bool);

/// Layers kept per device (see the module).
pub const MAX_LAYERS: usize = 8;

struct Device {
    ctx: GpuContext,
    /// The cached layers, most recently used last.
    layers: Vec<(LayerKey, MoeLayer)>,
}

fn devices() -> &'static Mutex<HashMap<usize, Device>> {
    static D: OnceLock<Mutex<HashMap<usize, Device>>> = OnceLock::new();
    D.get_or_init(|| Mutex::new(HashMap::new()))
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
    let mut devs = devices()
        .lock()
        .map_err(|_| GpuError::new_err("the GPU state is poisoned by an earlier panic"))?;
    let dev = match devs.entry(ordinal) {
        std::collections::hash_map::Entry::Occupied(o) => o.into_mut(),
        std::collections::hash_map::Entry::Vacant(v) => {
            let ctx = GpuContext::new(ordinal)
                .map_err(|e| gpu_error(py, &afdep_moe::LayerGpuError::Kernel(e)))?;
            v.insert(Device {
                ctx,
                layers: Vec::new(),
            })
        }
    };
    let key = (shape, tokens, dispatch, train);
    let entry = match dev.layers.iter().position(|(k, _)| *k == key) {
        Some(i) => dev.layers.remove(i),
        None => {
            if dev.layers.len() >= MAX_LAYERS {
                dev.layers.remove(0);
            }
            let layer = MoeLayer::new(&dev.ctx, shape, tokens, dispatch, train)
                .map_err(|e| gpu_error(py, &e))?;
            (key, layer)
        }
    };
    dev.layers.push(entry);
    let layer = &mut dev.layers.last_mut().expect("the layer was just pushed").1;
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
    // SAFETY: every view was checked (device, dtype, shape, contiguity) against the layer's
    // shape and token count by `Step::new`, the caller keeps the tensors alive for the call,
    // and `stream` is PyTorch's current stream on that device.
    unsafe { run_on_stream(layer, &dev.ctx, stream as cu::CUstream, &borrowed) }
        .map_err(|e| gpu_error(py, &e))
}
