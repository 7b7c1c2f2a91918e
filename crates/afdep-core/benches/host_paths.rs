//! Criterion benchmarks of afdep-core's host-side hot paths: route validation, the counts,
//! layouts and plans of one exchange round, and the oracle's GEMM (`cargo bench -p afdep-core`).
//!
//! Inputs are the reference record's layer shape (docs/design.md, "The reference record": H 512,
//! W 128, E 64, K 8) routed by the reference router from seeded random parameters and tokens, so
//! that the routes have the skew of real routing; the exchange is 3A:1F with every expert owned.

use std::hint::black_box;

use afdep_core::layout::{self, FfnPlan, SourceCounts};
use afdep_core::oracle::gemm::matmul;
use afdep_core::oracle::params::{LayerParams, random_tokens};
use afdep_core::route::{self, RouteRules};
use afdep_core::{ExchangeConfig, LayerShape, Routes, Topology};
use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};

/// Token counts of one source.
const TOKENS: [usize; 2] = [256, 4096];

/// The record shape's routes of `tokens` tokens.
fn routes(tokens: usize, seed: u64) -> Routes {
    let shape = LayerShape::RECORD;
    let params = LayerParams::random(shape, 1);
    let x = random_tokens(tokens, shape.d_model, seed);
    route::route(&x, &params.wr, tokens, &shape)
}

/// A 3A:1F exchange of the record shape with room for `tokens` tokens per source.
fn exchange(tokens: usize) -> ExchangeConfig {
    let shape = LayerShape::RECORD;
    let topology: Topology = "3A:1F".parse().expect("a valid topology");
    ExchangeConfig::new(topology, shape.d_model, shape.experts, shape.top_k, tokens)
        .expect("a valid exchange")
}

fn validation(c: &mut Criterion) {
    let mut g = c.benchmark_group("route_validate");
    for tokens in TOKENS {
        let r = routes(tokens, 2);
        let rules = RouteRules::exchange(&exchange(tokens));
        g.throughput(Throughput::Elements((tokens * r.top_k) as u64));
        g.bench_with_input(BenchmarkId::from_parameter(tokens), &r, |b, r| {
            b.iter(|| route::validate(black_box(r), &rules, 0).expect("valid routes"))
        });
    }
    g.finish();
}

fn layouts(c: &mut Criterion) {
    let mut g = c.benchmark_group("layout");
    for tokens in TOKENS {
        let cfg = exchange(tokens);
        let p = cfg.placement();
        let sources: Vec<Routes> = (0..3).map(|s| routes(tokens, 10 + s)).collect();
        let counts: Vec<SourceCounts> =
            sources.iter().map(|r| SourceCounts::build(r, &p)).collect();
        g.throughput(Throughput::Elements((tokens * sources[0].top_k) as u64));
        g.bench_with_input(
            BenchmarkId::new("source_counts", tokens),
            &sources[0],
            |b, r| b.iter(|| SourceCounts::build(black_box(r), &p)),
        );
        g.bench_with_input(
            BenchmarkId::new("ffn_plan", tokens),
            &counts,
            |b, counts| b.iter(|| FfnPlan::build(0, &p, black_box(counts))),
        );
        g.bench_with_input(
            BenchmarkId::new("payload_first_slabs", tokens),
            &sources[0],
            |b, r| b.iter(|| layout::payload_first_slabs(black_box(r), &p)),
        );
        g.bench_with_input(
            BenchmarkId::new("block_positions", tokens),
            &sources[0],
            |b, r| b.iter(|| layout::block_positions(black_box(r), &p)),
        );
    }
    g.finish();
}

fn oracle_gemm(c: &mut Criterion) {
    let mut g = c.benchmark_group("oracle_gemm");
    let shape = LayerShape::RECORD;
    // the up-projection of one expert's rows: rows × H by H × W, f32
    for rows in [64usize, 512] {
        let (k, n) = (shape.d_model, shape.width);
        let a: Vec<f32> = (0..rows * k)
            .map(|i| ((i % 97) as f32 - 48.0) / 64.0)
            .collect();
        let w: Vec<f32> = (0..k * n)
            .map(|i| ((i % 89) as f32 - 44.0) / 64.0)
            .collect();
        let mut out = vec![0f32; rows * n];
        g.throughput(Throughput::Elements((2 * rows * k * n) as u64));
        g.bench_function(BenchmarkId::new("f32", format!("{rows}x{k}x{n}")), |b| {
            b.iter(|| matmul(rows, k, n, black_box(&a), black_box(&w), &mut out, false))
        });
    }
    g.finish();
}

/// The group (in a module: criterion's macro writes a public function without docs).
mod group {
    use super::*;

    criterion_group! {
        name = benches;
        // short runs: these are for comparing changes on one machine, not for absolute numbers
        config = Criterion::default()
            .sample_size(20)
            .warm_up_time(std::time::Duration::from_millis(300))
            .measurement_time(std::time::Duration::from_secs(1));
        targets = validation, layouts, oracle_gemm
    }
}
criterion_main!(group::benches);
