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
pub fn run(py: Python<'_>, shape: LayerShape, step: &Step) -> PyResult<()> {
    let tokens = step.x.shape[0];
    let [wr, w1, w3, w2, s1, s3, s2] = step.params.each_ref().map(View::read_f32);
    let p = ParamsT::<f32> {
        shape,
        wr,
        w1,
        w3,
        w2,
        s1,
        s3,
        s2,
    };
    let x = step.x.read_f32();
    let given = if step.given {
        Some(Routes {
            tokens,
            top_k: shape.top_k,
            idx: step.idx.read_i32(),
            weights: step.weights.read_f32(),
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
            let dy = t.dy.read_f32();
            let (f, g) =
                train_step_t(&p, &x, tokens, &dy, routing).map_err(|e| layer_error(py, &e))?;
            t.dx.write_f32(&g.dx)?;
            for (dst, src) in t.grads.iter().zip(g.params()) {
                dst.write_f32(src)?;
            }
            f
        }
    };
    step.out.write_f32(&f.out)?;
    if !step.given {
        step.idx.write_i32(&f.idx)?;
        step.weights.write_f32(&f.weights)?;
    }
    Ok(())
}
