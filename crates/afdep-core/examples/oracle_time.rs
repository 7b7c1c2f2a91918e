//! Times the CPU layer oracle at the record shape (docs/design.md, "The reference record"):
//! `forward` and `train_step` on 16,384 tokens of `LayerShape::RECORD`, random parameters, tokens
//! and upstream gradient from fixed seeds; prints the median of 3 runs of each (after one untimed
//! warm-up run).
//!
//! `cargo run --release -p afdep-core --example oracle_time [-- TOKENS]`

use std::time::Instant;

use afdep_core::LayerShape;
use afdep_core::oracle::LayerParams;
use afdep_core::oracle::layer;
use afdep_core::oracle::params::random_tokens;
use afdep_core::tensor::uniform_bf16;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn time<R>(mut f: impl FnMut() -> R) -> (f64, Vec<f64>) {
    std::hint::black_box(f());
    let runs: Vec<f64> = (0..3)
        .map(|_| {
            let t = Instant::now();
            std::hint::black_box(f());
            t.elapsed().as_secs_f64()
        })
        .collect();
    (median(runs.clone()), runs)
}

fn main() {
    let tokens: usize = std::env::args()
        .nth(1)
        .map_or(16_384, |s| s.parse().expect("TOKENS"));
    let shape = LayerShape::RECORD;
    let params = LayerParams::random(shape, 1);
    let x = random_tokens(tokens, shape.d_model, 2);
    let dy = uniform_bf16(tokens * shape.d_model, 1.0, 3, 0);
    println!(
        "shape {shape:?}, {tokens} tokens, {} rayon threads",
        rayon::current_num_threads()
    );
    let (fwd, runs) = time(|| layer::forward(&params, &x, tokens).expect("forward"));
    println!("forward:    median {fwd:.3} s  (runs {runs:.3?})");
    let (train, runs) = time(|| layer::train_step(&params, &x, tokens, &dy).expect("train step"));
    println!("train step: median {train:.3} s  (runs {runs:.3?})");
}
