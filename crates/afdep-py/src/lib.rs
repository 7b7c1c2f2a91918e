//! `afdep._native`: the native part of the `afdep` Python package (PyO3, abi3 for CPython
//! 3.11 and later).
//!
//! It is kept thin: one function, `layer_step`, runs the MoE layer's forward or train step
//! on tensors borrowed through DLPack capsules (CPU tensors on afdep-core's oracle, CUDA tensors
//! on afdep-moe's `MoeLayer`, read and written in place and queued on the caller's stream,
//! capturable in a CUDA graph after one eager step), `unpin_layers` and `layer_cache` manage
//! the GPU layers a capture pinned, and afdep's typed errors become
//! Python exceptions with their fields as attributes. The torch-facing code (`afdep.MoE`, its
//! `torch.autograd.Function`) is Python, in `python/afdep/`. `exchange` is the AFD exchange
//! (one `ExchangeRank` per process over the staged engine) and its oracle, `fused` the same
//! exchange on the fused engine (one `FusedRank` per process: device rounds or CUDA-graph
//! replays on torch CUDA tensors).

mod cpu;
mod dlpack;
mod errors;
mod exchange;
mod fused;
mod gpu;
mod step;

use afdep_core::LayerShape;
use afdep_moe::Dispatch;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::dlpack::Device;
use crate::errors::config_error;
use crate::step::Step;

/// The layer shape tuple of the Python side: (d_model, width, experts, top_k, shared,
/// renormalize).
type ShapeTuple = (usize, usize, usize, usize, usize, bool);

/// One step of the MoE layer (see the Python stub `afdep/_native.pyi`).
///
/// Every tensor is a DLPack capsule of a contiguous tensor; outputs are written in place.
/// With `dy`, `dx` and `grads` this is the train step (gradients of `sum(out * dy)`), without
/// them the forward. `given` reads the routes from `topk_idx`/`topk_weights`; otherwise the
/// layer's router writes them there. `stream` is the CUDA stream (as an integer) the GPU work
/// is ordered on; `dispatch` names the GPU dispatch strategy (`auto` is `fused_gsum`).
#[pyfunction]
#[pyo3(signature = (shape, x, params, out, topk_idx, topk_weights, given, stream=0, dispatch="auto", dy=None, dx=None, grads=None))]
#[allow(clippy::too_many_arguments)]
fn layer_step(
    py: Python<'_>,
    shape: ShapeTuple,
    x: &Bound<'_, PyAny>,
    params: Vec<Bound<'_, PyAny>>,
    out: &Bound<'_, PyAny>,
    topk_idx: &Bound<'_, PyAny>,
    topk_weights: &Bound<'_, PyAny>,
    given: bool,
    stream: usize,
    dispatch: &str,
    dy: Option<Bound<'_, PyAny>>,
    dx: Option<Bound<'_, PyAny>>,
    grads: Option<Vec<Bound<'_, PyAny>>>,
) -> PyResult<()> {
    let (d_model, width, experts, top_k, shared, renormalize) = shape;
    let shape = LayerShape {
        d_model,
        width,
        experts,
        top_k,
        shared,
        renormalize,
    };
    shape.validate().map_err(|e| config_error(py, &e))?;
    let train = match (&dy, &dx, &grads) {
        (None, None, None) => None,
        (Some(dy), Some(dx), Some(g)) => Some((dy, dx, g.as_slice())),
        _ => {
            return Err(PyValueError::new_err(
                "a train step needs dy, dx and grads together",
            ));
        }
    };
    let step = Step::new(
        &shape,
        x,
        &params,
        out,
        topk_idx,
        topk_weights,
        given,
        train,
    )?;
    match step.x.device {
        Device::Cpu => cpu::run(py, shape, &step),
        Device::Cuda(ordinal) => {
            let dispatch = match dispatch {
                "auto" => Dispatch::FusedGsum,
                s => s.parse::<Dispatch>().map_err(PyValueError::new_err)?,
            };
            gpu::run(py, shape, ordinal, dispatch, stream, &step)
        }
    }
}

/// Unpins the GPU layers that CUDA graph captures pinned (see the Python stub).
#[pyfunction]
#[pyo3(signature = (device=None))]
fn unpin_layers(py: Python<'_>, device: Option<usize>) -> PyResult<usize> {
    gpu::unpin_layers(py, device)
}

/// The GPU layer cache of one device (see the Python stub).
#[pyfunction]
fn layer_cache(device: usize) -> PyResult<Vec<gpu::CacheRow>> {
    gpu::layer_cache(device)
}

/// The native module `afdep._native`.
#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(layer_step, m)?)?;
    m.add_function(wrap_pyfunction!(unpin_layers, m)?)?;
    m.add_function(wrap_pyfunction!(layer_cache, m)?)?;
    m.add("MAX_LAYERS", gpu::MAX_LAYERS)?;
    m.add_function(wrap_pyfunction!(exchange::exchange_oracle, m)?)?;
    m.add_class::<exchange::ExchangeRank>()?;
    m.add_class::<fused::FusedRank>()?;
    errors::register(m)?;
    Ok(())
}
