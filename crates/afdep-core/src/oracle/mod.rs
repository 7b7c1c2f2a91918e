//! The CPU oracle: the reference of every computation in docs/design.md, "Specification".
//!
//! - [`layer`]: the MoE layer forward and train step (bf16 storage, f32 sums, cast once).
//! - [`exchange`]: the AFD exchange reference (expanded and compact layouts, combine in the
//!   fixed order of FFN rank ascending, then slot ascending).
//! - [`gemm`]: the blocked f32/f64 matrix products the oracle is built on.
//! - [`scaled`]: values with the magnitude of their terms (the elementwise error bound).

pub mod exchange;
pub mod gemm;
pub mod layer;
pub mod params;
pub mod scaled;

pub use params::{LayerGrads, LayerParams};
