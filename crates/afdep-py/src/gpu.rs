//! The layer on CUDA tensors: afdep-moe's [`MoeLayer`] through
//! [`afdep_moe::external::run_on_stream`], ordered on the caller's stream (PyTorch's current
//! stream). One [`GpuContext`] per device and one layer per (shape, tokens, dispatch, train)
//! are built on first use and kept for the life of the process.

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

struct Device {
    ctx: GpuContext,
    layers: HashMap<LayerKey, MoeLayer>,
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
                layers: HashMap::new(),
            })
        }
    };
    let key = (shape, tokens, dispatch, train);
    let layer = match dev.layers.entry(key) {
        std::collections::hash_map::Entry::Occupied(o) => o.into_mut(),
        std::collections::hash_map::Entry::Vacant(v) => v.insert(
            MoeLayer::new(&dev.ctx, shape, tokens, dispatch, train)
                .map_err(|e| gpu_error(py, &e))?,
        ),
    };
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
