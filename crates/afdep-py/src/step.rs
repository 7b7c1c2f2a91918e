//! One layer step's arguments: DLPack views checked against the layer shape (shape, dtype,
//! device of every tensor), before anything runs.

use afdep_core::LayerShape;
use afdep_core::oracle::LayerParams;
use afdep_core::oracle::params::PARAM_NAMES;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::dlpack::{DType, Device, View};

/// The train step's extra tensors.
pub struct TrainViews {
    /// Upstream gradient, T × H.
    pub dy: View,
    /// dx, T × H (written).
    pub dx: View,
    /// Parameter gradients (written), `PARAM_NAMES` order.
    pub grads: [View; 7],
}

/// The train step's capsules: dy, dx and the seven gradients.
pub type TrainCaps<'a, 'py> = (
    &'a Bound<'py, PyAny>,
    &'a Bound<'py, PyAny>,
    &'a [Bound<'py, PyAny>],
);

/// A checked step.
pub struct Step {
    /// Input, T × H.
    pub x: View,
    /// Parameters, `PARAM_NAMES` order.
    pub params: [View; 7],
    /// Output, T × H (written).
    pub out: View,
    /// Expert ids, T × K, i32 (read when given, written otherwise).
    pub idx: View,
    /// Route weights, T × K, f32 (read when given, written otherwise).
    pub weights: View,
    /// Routes given by the caller.
    pub given: bool,
    /// Present for a train step.
    pub train: Option<TrainViews>,
}

fn seven(prefix: &str, caps: &[Bound<'_, PyAny>]) -> PyResult<[View; 7]> {
    if caps.len() != 7 {
        return Err(PyValueError::new_err(format!(
            "{} tensors: got {}, expected 7 ({})",
            prefix.trim_end_matches('_'),
            caps.len(),
            PARAM_NAMES.join(", ")
        )));
    }
    let v: Vec<View> = caps
        .iter()
        .zip(PARAM_NAMES)
        .map(|(c, n)| View::new(&format!("{prefix}{n}"), c))
        .collect::<PyResult<_>>()?;
    Ok(v.try_into().unwrap_or_else(|_| unreachable!("seven views")))
}

impl Step {
    /// Reads and checks the capsules: x is T × H of dtype f32 or bf16 (bf16 only on CUDA);
    /// every other float tensor has x's dtype, every tensor x's device.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        shape: &LayerShape,
        x: &Bound<'_, PyAny>,
        params: &[Bound<'_, PyAny>],
        out: &Bound<'_, PyAny>,
        idx: &Bound<'_, PyAny>,
        weights: &Bound<'_, PyAny>,
        given: bool,
        train: Option<TrainCaps<'_, '_>>,
    ) -> PyResult<Step> {
        let x = View::new("x", x)?;
        if x.shape.len() != 2 || x.shape[1] != shape.d_model {
            return Err(PyValueError::new_err(format!(
                "`x` has shape {:?}, the layer needs [tokens, {}]",
                x.shape, shape.d_model
            )));
        }
        let float = if x.device == Device::Cpu {
            vec![DType::F32, DType::Bf16]
        } else {
            vec![DType::Bf16]
        };
        x.expect_dtype(&float)?;
        let same = [x.dtype];
        let (t, k) = (x.shape[0], shape.top_k);
        let float_like = |v: &View, dims: &[usize]| -> PyResult<()> {
            v.expect_device(x.device)?;
            v.expect_dtype(&same)?;
            v.expect_shape(dims)
        };
        let params = seven("", params)?;
        let dims = LayerParams::dims(shape);
        for (v, d) in params.iter().zip(&dims) {
            float_like(v, d)?;
        }
        let out = View::new("out", out)?;
        float_like(&out, &x.shape)?;
        let idx = View::new("topk_idx", idx)?;
        idx.expect_device(x.device)?;
        idx.expect_dtype(&[DType::I32])?;
        idx.expect_shape(&[t, k])?;
        let weights = View::new("topk_weights", weights)?;
        weights.expect_device(x.device)?;
        weights.expect_dtype(&[DType::F32])?;
        weights.expect_shape(&[t, k])?;
        let train = match train {
            None => None,
            Some((dy, dx, grads)) => {
                let dy = View::new("dy", dy)?;
                float_like(&dy, &x.shape)?;
                let dx = View::new("dx", dx)?;
                float_like(&dx, &x.shape)?;
                let grads = seven("grad_", grads)?;
                for (v, d) in grads.iter().zip(&dims) {
                    float_like(v, d)?;
                }
                Some(TrainViews { dy, dx, grads })
            }
        };
        let step = Step {
            x,
            params,
            out,
            idx,
            weights,
            given,
            train,
        };
        step.check_overlaps()?;
        Ok(step)
    }

    /// Every tensor of the step with whether the step writes it.
    fn views(&self) -> Vec<(&View, bool)> {
        let mut v = vec![(&self.x, false), (&self.out, true)];
        v.extend(self.params.iter().map(|p| (p, false)));
        v.push((&self.idx, !self.given));
        v.push((&self.weights, !self.given));
        if let Some(t) = &self.train {
            v.push((&t.dy, false));
            v.push((&t.dx, true));
            v.extend(t.grads.iter().map(|g| (g, true)));
        }
        v
    }

    /// No tensor the step writes shares memory with another tensor of the step (the GPU
    /// layer reads and writes them in place, in an order of its own).
    fn check_overlaps(&self) -> PyResult<()> {
        let views = self.views();
        for (i, &(a, a_written)) in views.iter().enumerate() {
            for &(b, b_written) in &views[i + 1..] {
                if (a_written || b_written) && a.overlaps(b) {
                    let w = if a_written { &a.name } else { &b.name };
                    return Err(PyValueError::new_err(format!(
                        "`{}` and `{}` share memory and the step writes `{w}`: pass separate \
                         tensors",
                        a.name, b.name
                    )));
                }
            }
        }
        Ok(())
    }
}
