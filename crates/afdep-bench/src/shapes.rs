//! Named layer shapes: the suite of `afdep moe --suite models|record` and `--shape NAME`.
//!
//! Each shape is the MoE layer of docs/design.md, "Specification: Layer and train step" (softmax
//! top-k router, SwiGLU experts, an optional shared SwiGLU expert) at the sizes of the model it is
//! named after: hidden size H, expert width W, experts E, top-k K and shared width S, with the
//! token counts that fit in the memory of one H200 next to the peers, and the timed runs per
//! measurement used by default (fewer at the large shapes, to bound the suite's time).
//!
//! # FLOP count
//!
//! The achieved TFLOP/s of a row divide these counts by the measured time (2 FLOP per
//! multiply-add; softmax, top-k, SwiGLU's element-wise work, dispatch and combine not counted):
//!
//! - router: `2·T·H·E` (the logits GEMM);
//! - routed experts: `2·T·K·3·H·W` (per routed row the W1 and W3 GEMMs, H → W each, and the W2
//!   GEMM, W → H);
//! - shared expert: `2·T·3·H·S`;
//! - forward = router + experts + shared; train step = 3 × forward (the forward, plus the
//!   backward's two GEMMs per forward GEMM: the input gradient and the weight gradient).
//!
//! `% of peak` is against [`PEAK_TFLOPS`], the dense bf16 tensor-core rate the issue's targets
//! are stated against.

use afdep_core::LayerShape;

/// The dense bf16 rate that `%` columns are relative to, TFLOP/s.
pub const PEAK_TFLOPS: f64 = 790.0;

/// One named shape of the suite.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NamedShape {
    /// The name `--shape` takes (and rows carry as `shape`).
    pub name: &'static str,
    /// The model whose sizes these are.
    pub model: &'static str,
    /// Hidden size H.
    pub d_model: usize,
    /// Expert width W.
    pub width: usize,
    /// Experts E.
    pub experts: usize,
    /// Experts per token K.
    pub top_k: usize,
    /// Shared expert width S (0: none).
    pub shared: usize,
    /// Token counts the suite runs.
    pub tokens: &'static [usize],
    /// Timed runs per measurement by default.
    pub iters: usize,
}

impl NamedShape {
    /// The layer shape (top-k weights renormalised, as in docs/design.md, "Specification: Router").
    pub fn layer(&self) -> LayerShape {
        LayerShape::renormalized(
            self.d_model,
            self.width,
            self.experts,
            self.top_k,
            self.shared,
        )
    }
}

const K: usize = 1024;

/// Every named shape, the reference record's (docs/design.md, "The reference record") first.
pub const SHAPES: [NamedShape; 7] = [
    NamedShape {
        name: "record",
        model: "the reference record (afdep's default shape)",
        d_model: 512,
        width: 128,
        experts: 64,
        top_k: 8,
        shared: 1024,
        tokens: &[16 * K, 128 * K, 1024 * K],
        iters: 10,
    },
    NamedShape {
        name: "qwen3-30b-a3b",
        model: "Qwen3-30B-A3B",
        d_model: 2048,
        width: 768,
        experts: 128,
        top_k: 8,
        shared: 0,
        tokens: &[4 * K, 32 * K],
        iters: 10,
    },
    NamedShape {
        name: "mixtral-8x7b",
        model: "Mixtral-8x7B",
        d_model: 4096,
        width: 14336,
        experts: 8,
        top_k: 2,
        shared: 0,
        tokens: &[4 * K, 16 * K],
        iters: 5,
    },
    NamedShape {
        name: "deepseek-v3",
        model: "DeepSeek-V3 (one MoE layer)",
        d_model: 7168,
        width: 2048,
        experts: 256,
        top_k: 8,
        shared: 2048,
        tokens: &[4 * K, 16 * K],
        iters: 5,
    },
    NamedShape {
        name: "gpt-oss-120b",
        model: "gpt-oss-120b",
        d_model: 2880,
        width: 2880,
        experts: 128,
        top_k: 4,
        shared: 0,
        tokens: &[4 * K, 16 * K],
        iters: 5,
    },
    NamedShape {
        name: "qwen1.5-moe-a2.7b",
        model: "Qwen1.5-MoE-A2.7B",
        d_model: 2048,
        width: 1408,
        experts: 60,
        top_k: 4,
        shared: 5632,
        tokens: &[4 * K, 16 * K],
        iters: 10,
    },
    NamedShape {
        name: "olmoe-1b-7b",
        model: "OLMoE-1B-7B",
        d_model: 2048,
        width: 1024,
        experts: 64,
        top_k: 8,
        shared: 0,
        tokens: &[4 * K, 32 * K],
        iters: 10,
    },
];

/// A set of named shapes (`--suite`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Suite {
    /// Every shape of [`SHAPES`].
    Models,
    /// The record's shape only.
    Record,
}

impl Suite {
    /// The shapes of the suite, in table order.
    pub fn shapes(self) -> Vec<NamedShape> {
        match self {
            Suite::Models => SHAPES.to_vec(),
            Suite::Record => vec![SHAPES[0]],
        }
    }
}

/// The shape called `name`; the error lists the names there are.
pub fn lookup(name: &str) -> Result<NamedShape, String> {
    SHAPES
        .iter()
        .find(|s| s.name.eq_ignore_ascii_case(name.trim()))
        .copied()
        .ok_or_else(|| {
            let names: Vec<&str> = SHAPES.iter().map(|s| s.name).collect();
            format!(
                "unknown shape `{name}`: the shapes are {}",
                names.join(", ")
            )
        })
}

/// FLOP of one forward at `tokens` tokens (see the module's formula).
pub fn forward_flops(s: &LayerShape, tokens: usize) -> f64 {
    let (t, h, w, e, k, sh) = (
        tokens as f64,
        s.d_model as f64,
        s.width as f64,
        s.experts as f64,
        s.top_k as f64,
        s.shared as f64,
    );
    2.0 * t * h * e + 6.0 * t * k * h * w + 6.0 * t * h * sh
}

/// FLOP of one train step: 3 × the forward.
pub fn train_flops(s: &LayerShape, tokens: usize) -> f64 {
    3.0 * forward_flops(s, tokens)
}

/// TFLOP/s of `flops` done in `ms` milliseconds (none for a missing or non-positive time).
pub fn tflops(flops: f64, ms: Option<f64>) -> Option<f64> {
    ms.filter(|m| m.is_finite() && *m > 0.0)
        .map(|m| flops / (m * 1e-3) / 1e12)
}

/// Percent of [`PEAK_TFLOPS`].
pub fn pct_of_peak(tflops: Option<f64>) -> Option<f64> {
    tflops.map(|t| 100.0 * t / PEAK_TFLOPS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_is_the_issues() {
        let want = [
            (
                "record",
                512,
                128,
                64,
                8,
                1024,
                vec![16_384, 131_072, 1_048_576],
            ),
            ("qwen3-30b-a3b", 2048, 768, 128, 8, 0, vec![4096, 32_768]),
            ("mixtral-8x7b", 4096, 14336, 8, 2, 0, vec![4096, 16_384]),
            ("deepseek-v3", 7168, 2048, 256, 8, 2048, vec![4096, 16_384]),
            ("gpt-oss-120b", 2880, 2880, 128, 4, 0, vec![4096, 16_384]),
            (
                "qwen1.5-moe-a2.7b",
                2048,
                1408,
                60,
                4,
                5632,
                vec![4096, 16_384],
            ),
            ("olmoe-1b-7b", 2048, 1024, 64, 8, 0, vec![4096, 32_768]),
        ];
        assert_eq!(SHAPES.len(), want.len());
        for (s, (n, h, w, e, k, sh, t)) in SHAPES.iter().zip(want) {
            assert_eq!(
                (s.name, s.d_model, s.width, s.experts, s.top_k, s.shared),
                (n, h, w, e, k, sh)
            );
            assert_eq!(s.tokens, t.as_slice(), "{n}");
            assert!(s.iters >= 3, "{n}");
            s.layer().validate().unwrap();
            // every row of the GEMMs is 16 bytes aligned (the one limit the issue allows)
            assert!(s.d_model % 8 == 0 && s.width % 8 == 0 && s.shared % 8 == 0);
        }
        assert_eq!(Suite::Record.shapes(), vec![SHAPES[0]]);
        assert_eq!(Suite::Models.shapes().len(), 7);
    }

    #[test]
    fn lookup_by_name() {
        assert_eq!(lookup("Mixtral-8x7B").unwrap().experts, 8);
        assert_eq!(lookup(" record ").unwrap().tokens.len(), 3);
        let e = lookup("llama").unwrap_err();
        assert!(e.contains("llama") && e.contains("olmoe-1b-7b"), "{e}");
    }

    #[test]
    fn flop_counts() {
        // H 4, W 2, E 3, K 2, S 5, T 10: router 2·10·4·3 = 240; experts 6·10·2·4·2 = 960;
        // shared 6·10·4·5 = 1200
        let s = LayerShape {
            d_model: 4,
            width: 2,
            experts: 3,
            top_k: 2,
            shared: 5,
            renormalize: true,
        };
        assert_eq!(forward_flops(&s, 10), 2400.0);
        assert_eq!(train_flops(&s, 10), 7200.0);
        assert_eq!(forward_flops(&s, 0), 0.0);
        // the record at 1M tokens: 2^20 · (2·512·64 + 6·8·512·128 + 6·512·1024) FLOP
        let r = SHAPES[0].layer();
        let per_token = 2.0 * 512.0 * 64.0 + 6.0 * 8.0 * 512.0 * 128.0 + 6.0 * 512.0 * 1024.0;
        assert_eq!(forward_flops(&r, 1 << 20), per_token * (1u64 << 20) as f64);
        // 1e12 FLOP in 1 ms = 1000 TFLOP/s = 126.6 % of 790
        let t = tflops(1e12, Some(1.0));
        assert_eq!(t, Some(1000.0));
        assert!((pct_of_peak(t).unwrap() - 126.582).abs() < 1e-3);
        assert_eq!(tflops(1e12, Some(0.0)), None);
        assert_eq!(tflops(1e12, None), None);
        assert_eq!(tflops(1e12, Some(f64::NAN)), None);
    }
}
