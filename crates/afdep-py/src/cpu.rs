//! The layer on CPU tensors: afdep-core's oracle ([`forward_t`], [`train_step_t`]) in f32.
//!
//! Inputs are read from the borrowed tensors into the oracle's f32 vectors (exact for bf16),
//! results are written into the caller's output tensors with one cast to their dtype: for bf16
//! tensors this is bit for bit the oracle's bf16 entry points ([`afdep_core::oracle::layer::forward`]
//! and friends), for f32 tensors the unrounded f32 results.

use afdep_core::oracle::layer::{ParamsT, Routing, forward_t, train_step_t};
use afdep_core::{LayerShape, Routes};
use pyo3::prelude::*;

use crate::dlpack::View;
use crate::errors::layer_error;
use crate::step::Step;

/// Runs `step` on the oracle.
///
/// Every view of `step` is read or written through its raw pointer: the caller (the Python
/// entry point) holds their DLPack capsules for the whole call, and torch does not touch the
/// tensors while the GIL is held.
pub fn run(py: Python<'_>, shape: LayerShape, step: &Step) -> PyResult<()> {
    let tokens = step.x.shape[0];
    // SAFETY (this and every read/write below): the step's capsules are alive for the call
    // and nothing else accesses the tensors during it (see the function's documentation).
    let read = |v: &View| unsafe { v.read_f32() };
    let [wr, w1, w3, w2, s1, s3, s2] = step.params.each_ref().map(read);
    let p = ParamsT::<f32>::from_tensors(shape, [wr?, w1?, w3?, w2?, s1?, s3?, s2?]);
    let x = read(&step.x)?;
    let given = if step.given {
        Some(Routes {
            tokens,
            top_k: shape.top_k,
            idx: unsafe { step.idx.read_i32() }?,
            weights: read(&step.weights)?,
        })
    } else {
        None
    };
    let routing = match &given {
        Some(r) => Routing::Given(r),
        None => Routing::Router,
    };
    let f = match &step.train {
        None => forward_t(&p, &x, tokens, routing).map_err(|e| layer_error(py, &e))?,
        Some(t) => {
            let dy = read(&t.dy)?;
            let (f, g) =
                train_step_t(&p, &x, tokens, &dy, routing).map_err(|e| layer_error(py, &e))?;
            unsafe { t.dx.write_f32(&g.dx) }?;
            for (dst, src) in t.grads.iter().zip(g.params()) {
                unsafe { dst.write_f32(src) }?;
            }
            f
        }
    };
    unsafe { step.out.write_f32(&f.out) }?;
    if !step.given {
        unsafe { step.idx.write_i32(&f.idx) }?;
        unsafe { step.weights.write_f32(&f.weights) }?;
    }
    Ok(())
}
