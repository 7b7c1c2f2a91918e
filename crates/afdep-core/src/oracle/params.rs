//! Parameters and gradients of one MoE layer.

use half::bf16;
use serde::{Deserialize, Serialize};

use crate::config::LayerShape;
use crate::tensor::uniform_bf16;

/// Parameters of one MoE layer, bf16, row-major:
///
/// | tensor | shape | meaning |
/// |---|---|---|
/// | `wr` | H × E | router |
/// | `w1`, `w3` | E × H × W | gate and up projections of each expert |
/// | `w2` | E × W × H | down projection of each expert |
/// | `s1`, `s3` | H × S | shared expert gate and up (empty when S = 0) |
/// | `s2` | S × H | shared expert down |
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LayerParams {
    /// The layer shape.
    pub shape: LayerShape,
    /// Router, H × E.
    pub wr: Vec<bf16>,
    /// Expert gate projections, E × H × W.
    pub w1: Vec<bf16>,
    /// Expert up projections, E × H × W.
    pub w3: Vec<bf16>,
    /// Expert down projections, E × W × H.
    pub w2: Vec<bf16>,
    /// Shared gate, H × S.
    pub s1: Vec<bf16>,
    /// Shared up, H × S.
    pub s3: Vec<bf16>,
    /// Shared down, S × H.
    pub s2: Vec<bf16>,
}

/// The names of the parameter tensors, in a fixed order (also the safetensors names).
pub const PARAM_NAMES: [&str; 7] = ["wr", "w1", "w3", "w2", "s1", "s3", "s2"];

/// The seven parameter tensors of `$params`, any value with the tensor fields of
/// [`LayerParams`](crate::oracle::LayerParams) (`wr` … `s2`), as an array of references in
/// [`PARAM_NAMES`](crate::oracle::params::PARAM_NAMES) order;
/// `param_tensors!(mut $params)` gives mutable references.
#[macro_export]
macro_rules! param_tensors {
    (mut $p:expr) => {
        [
            &mut $p.wr, &mut $p.w1, &mut $p.w3, &mut $p.w2, &mut $p.s1, &mut $p.s3, &mut $p.s2,
        ]
    };
    ($p:expr) => {
        [&$p.wr, &$p.w1, &$p.w3, &$p.w2, &$p.s1, &$p.s3, &$p.s2]
    };
}

impl LayerParams {
    /// Expected element count of each tensor, in [`PARAM_NAMES`] order.
    pub fn sizes(shape: &LayerShape) -> [usize; 7] {
        let (h, w, e, s) = (shape.d_model, shape.width, shape.experts, shape.shared);
        [h * e, e * h * w, e * h * w, e * w * h, h * s, h * s, s * h]
    }

    /// Shapes of each tensor, in [`PARAM_NAMES`] order.
    pub fn dims(shape: &LayerShape) -> [Vec<usize>; 7] {
        let (h, w, e, s) = (shape.d_model, shape.width, shape.experts, shape.shared);
        [
            vec![h, e],
            vec![e, h, w],
            vec![e, h, w],
            vec![e, w, h],
            vec![h, s],
            vec![h, s],
            vec![s, h],
        ]
    }

    /// Random parameters, uniform with scale 1/sqrt(fan-in), from `seed`.
    pub fn random(shape: LayerShape, seed: u64) -> Self {
        let sz = Self::sizes(&shape);
        let fan = |n: usize| 1.0 / (n.max(1) as f32).sqrt();
        let (h, w, s) = (shape.d_model, shape.width, shape.shared);
        LayerParams {
            shape,
            wr: uniform_bf16(sz[0], fan(h), seed, 1),
            w1: uniform_bf16(sz[1], fan(h), seed, 2),
            w3: uniform_bf16(sz[2], fan(h), seed, 3),
            w2: uniform_bf16(sz[3], fan(w), seed, 4),
            s1: uniform_bf16(sz[4], fan(h), seed, 5),
            s3: uniform_bf16(sz[5], fan(h), seed, 6),
            s2: uniform_bf16(sz[6], fan(s), seed, 7),
        }
    }

    /// The tensors in [`PARAM_NAMES`] order.
    pub fn tensors(&self) -> [&Vec<bf16>; 7] {
        crate::param_tensors!(self)
    }

    /// Mutable tensors in [`PARAM_NAMES`] order.
    pub fn tensors_mut(&mut self) -> [&mut Vec<bf16>; 7] {
        crate::param_tensors!(mut self)
    }

    /// Checks every tensor's length against the shape; the error names the tensor.
    pub fn check(&self) -> Result<(), crate::error::ConfigError> {
        self.shape.validate()?;
        for ((name, t), n) in PARAM_NAMES
            .iter()
            .zip(self.tensors())
            .zip(Self::sizes(&self.shape))
        {
            if t.len() != n {
                return Err(crate::error::ConfigError::Invalid {
                    field: name,
                    value: format!("{} elements", t.len()),
                    reason: format!("the shape needs {n}"),
                });
            }
        }
        Ok(())
    }
}

/// Random tokens, T × H, uniform in [-1, 1), from `seed`.
pub fn random_tokens(tokens: usize, d_model: usize, seed: u64) -> Vec<bf16> {
    uniform_bf16(tokens * d_model, 1.0, seed, 100)
}

/// Gradients of one train step, bf16, with the shapes of [`LayerParams`] plus `dx` (T × H).
#[derive(Debug, Clone, PartialEq)]
pub struct LayerGrads {
    /// Gradient with respect to the input tokens, T × H.
    pub dx: Vec<bf16>,
    /// Router gradient, H × E.
    pub dwr: Vec<bf16>,
    /// E × H × W.
    pub dw1: Vec<bf16>,
    /// E × H × W.
    pub dw3: Vec<bf16>,
    /// E × W × H.
    pub dw2: Vec<bf16>,
    /// H × S.
    pub ds1: Vec<bf16>,
    /// H × S.
    pub ds3: Vec<bf16>,
    /// S × H.
    pub ds2: Vec<bf16>,
}

impl LayerGrads {
    /// The parameter gradients in [`PARAM_NAMES`] order.
    pub fn params(&self) -> [&Vec<bf16>; 7] {
        [
            &self.dwr, &self.dw1, &self.dw3, &self.dw2, &self.ds1, &self.ds3, &self.ds2,
        ]
    }
}
