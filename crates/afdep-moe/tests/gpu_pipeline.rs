//! The microbatch pipeline (`afdep_moe::pipeline`, issue 19 item 3) on in-process NvlinkIpc
//! ranks on GPU 0 (single-GPU rank emulation), two slots (two fused engines, two groups) per
//! rank:
//!
//! - for M = 1, 2, 3 and 4 microbatches (uneven splits: tokens % M != 0, ranks with fewer
//!   tokens than M, a zero-token rank), 3A:1F and 2A:2F, fixed arms and the device's auto
//!   rule (whose arm changes from microbatch to microbatch here): the pipelined run (two slots),
//!   the sequential run (one slot) and one eager device round per microbatch
//!   (`FusedEngine::device_round`) give bit-identical outputs, outputs poisoned before every
//!   round; with the scale experts the concatenated microbatches are bit-identical to the
//!   oracle's exchange of each microbatch, with the SwiGLU experts (the grouped GEMM) within
//!   the layer output's bf16 tolerance (`accuracy::OUT_TOL`) of it; no NaN passes;
//! - a rejected route in one microbatch fails the run on every rank with that microbatch's
//!   error, and the next run works;
//! - traced and timed runs: every microbatch has a timeline of its role's phases on every rank,
//!   the layer time is positive, and the FFN ranks' busy fraction lies in (0, 1].
//!
//! Without a GPU the tests print `SKIP` and pass (`AFDEP_REQUIRE_GPU=1` fails them).

mod exchange_common;

use std::sync::Arc;
use std::time::Duration;

use afdep_core::oracle::exchange::{self as reference, SourceInput};
use afdep_core::{ExchangeConfig, bf16};
use afdep_moe::pipeline::{busy_fraction, microbatch, split_tokens};
use afdep_moe::{
    DeviceExperts, DeviceRoundOptions, DispatchArm, ExchangeError, ExpertFn, FusedEngine,
    PipelineConfig, PipelineError, PipelineOutput, PipelineRank, RoundArm, TracePhase,
};
use afdep_transport::NvlinkIpc;
use exchange_common::*;

/// Microbatch counts of the equivalence tests.
const MS: [usize; 4] = [1, 2, 3, 4];

/// Builds a pipeline rank of `slots` slots on every rank of `c` (each slot its own in-process
/// NvlinkIpc group on GPU 0) and runs `work` on each, on its own thread. `None` without a GPU.
fn with_pipeline<R: Send>(
    c: &ExchangeConfig,
    experts: &DeviceExperts,
    slots: usize,
    work: impl Fn(usize, &mut PipelineRank) -> R + Sync,
) -> Option<Vec<R>> {
    let world = c.topology.world_size();
    let mut per_rank: Vec<Vec<NvlinkIpc>> = (0..world).map(|_| Vec::new()).collect();
    for _ in 0..slots {
        for (r, t) in fused_group(world, c, 1 << 20, Duration::from_secs(20))?
            .into_iter()
            .enumerate()
        {
            per_rank[r].push(t);
        }
    }
    let out = afdep_moe::run_group(
        per_rank,
        |_rank, ts| {
            // every rank sets its slots up in the same order (each set-up is collective in its
            // slot's group)
            let mut engines = Vec::new();
            for t in ts {
                let mut e = FusedEngine::new(c.clone(), t)?;
                e.prepare_device(DeviceRoundOptions {
                    experts: experts.clone(),
                    keep_received: false,
                })?;
                engines.push(e);
            }
            PipelineRank::new(engines, *MS.iter().max().unwrap())
        },
        |rank, pr| Ok::<_, PipelineError>(work(rank, pr)),
    );
    Some(
        out.into_iter()
            .enumerate()
            .map(|(rank, o)| match o {
                Ok(Ok(r)) => r,
                Ok(Err(e)) => panic!("rank {rank}: set-up failed: {e}"),
                Err(_) => panic!("rank {rank} panicked"),
            })
            .collect(),
    )
}

/// One configuration's runs on one rank: the pipelined run, the sequential run, and one eager
/// device round per microbatch (their combined rows concatenated).
struct Runs {
    input: usize,
    m: usize,
    arm: RoundArm,
    piped: Result<PipelineOutput, PipelineError>,
    seq: Result<PipelineOutput, PipelineError>,
    eager: Result<Option<Vec<bf16>>, ExchangeError>,
}

/// Eager device rounds of `mine`'s microbatches (`m` of them) on slot 0.
fn eager_rounds(
    pr: &mut PipelineRank,
    arm: RoundArm,
    m: usize,
    mine: Option<&SourceInput>,
) -> Result<Option<Vec<bf16>>, ExchangeError> {
    let eng = &mut pr.slots_mut()[0];
    let mut all: Option<Vec<bf16>> = mine.map(|_| Vec::new());
    let ranges = split_tokens(mine.map_or(0, |i| i.routes.tokens), m);
    for r in ranges {
        let part = mine.map(|i| microbatch(i, r));
        let out = eng.device_round(arm, part.as_ref())?;
        if let (Some(all), Some(c)) = (all.as_mut(), out.combined) {
            all.extend(c);
        }
    }
    Ok(all)
}

fn runs(
    c: &ExchangeConfig,
    experts: &DeviceExperts,
    inputs: &[Vec<SourceInput>],
    arms: &[RoundArm],
) -> Option<Vec<Vec<Runs>>> {
    with_pipeline(c, experts, 2, |rank, pr| {
        let s = c.topology.attention_index(rank);
        let mut out = Vec::new();
        for (i, inp) in inputs.iter().enumerate() {
            let mine = s.map(|s| &inp[s]);
            for &m in &MS {
                for &arm in arms {
                    let piped = pr.run(PipelineConfig::new(m, 2).unwrap(), arm, mine);
                    let seq = pr.run(PipelineConfig::sequential(m).unwrap(), arm, mine);
                    let eager = eager_rounds(pr, arm, m, mine);
                    out.push(Runs {
                        input: i,
                        m,
                        arm,
                        piped,
                        seq,
                        eager,
                    });
                }
            }
        }
        out
    })
}

fn bits(v: &[bf16]) -> Vec<u16> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// The oracle's combined rows of source `s` for `inp` split into `m` microbatches: each
/// microbatch's exchange (every source's microbatch of the same index), concatenated.
fn oracle_microbatches(
    c: &ExchangeConfig,
    inp: &[SourceInput],
    m: usize,
    expert: &dyn ExpertFn,
) -> Vec<Vec<bf16>> {
    let splits: Vec<_> = inp
        .iter()
        .map(|i| split_tokens(i.routes.tokens, m))
        .collect();
    let mut want: Vec<Vec<bf16>> = vec![Vec::new(); inp.len()];
    for b in 0..m {
        let part: Vec<SourceInput> = inp
            .iter()
            .zip(&splits)
            .map(|(i, r)| microbatch(i, r[b].clone()))
            .collect();
        let got = reference::exchange(c, &part, expert).expect("the oracle's exchange");
        for (w, g) in want.iter_mut().zip(got) {
            w.extend(g);
        }
    }
    want
}

/// Checks every run: pipelined = sequential = eager bit for bit on every rank, and each
/// source's output against the oracle (`tol` `None`: bit for bit; else the relative error).
fn check(
    c: &ExchangeConfig,
    inputs: &[Vec<SourceInput>],
    got: &[Vec<Runs>],
    expert: &dyn ExpertFn,
    tol: Option<f64>,
) {
    let topo = c.topology;
    let n = got[0].len();
    for j in 0..n {
        let r0 = &got[0][j];
        let (i, m, arm) = (r0.input, r0.m, r0.arm);
        let what = format!("{topo} input {i} M {m} {arm}");
        let want = oracle_microbatches(c, &inputs[i], m, expert);
        for (rank, per) in got.iter().enumerate() {
            let r = &per[j];
            assert_eq!((r.input, r.m, r.arm), (i, m, arm), "runs in the same order");
            let piped = r
                .piped
                .as_ref()
                .unwrap_or_else(|e| panic!("{what} rank {rank} pipelined: {e}"));
            let seq = r
                .seq
                .as_ref()
                .unwrap_or_else(|e| panic!("{what} rank {rank} sequential: {e}"));
            let eager = r
                .eager
                .as_ref()
                .unwrap_or_else(|e| panic!("{what} rank {rank} eager: {e}"));
            let Some(s) = topo.attention_index(rank) else {
                assert!(piped.combined.is_none() && seq.combined.is_none());
                continue;
            };
            let p = piped.combined.as_ref().expect("a source's output");
            assert_eq!(p.len(), inputs[i][s].routes.tokens * c.hidden, "{what}");
            assert_eq!(
                piped.microbatches,
                split_tokens(inputs[i][s].routes.tokens, m)
            );
            assert!(p.iter().all(|v| !v.is_nan()), "{what} source {s}: NaN");
            assert_eq!(
                bits(p),
                bits(seq.combined.as_ref().unwrap()),
                "{what} source {s}: pipelined differs from sequential rounds"
            );
            assert_eq!(
                bits(p),
                bits(eager.as_ref().unwrap()),
                "{what} source {s}: pipelined differs from eager device rounds"
            );
            match tol {
                None => assert_eq!(
                    bits(p),
                    bits(&want[s]),
                    "{what} source {s}: differs from the oracle"
                ),
                Some(t) => {
                    let err = afdep_moe::accuracy::max_rel_err(p, &want[s]);
                    assert!(err <= t, "{what} source {s}: error {err} > {t}");
                }
            }
        }
    }
}

/// The scale experts (bit-exact): 3A:1F (odd token counts, a zero-token rank) and 2A:2F (a rank
/// with fewer tokens than microbatches), fixed arms and the auto rule with a bucket of 8 tokens,
/// so that microbatches of one run take different arms.
#[test]
fn pipeline_matches_sequential_rounds_and_the_oracle_with_scale_experts() {
    let _serial = serial();
    for (topo, tokens) in [
        ("3A:1F", [&[37usize, 0, 11][..], &[3, 40, 1][..]]),
        ("2A:2F", [&[2usize, 37][..], &[0, 0][..]]),
    ] {
        let mut c = cfg(topo, 64, 12, 3);
        c.capacity = 40;
        c.knobs.min_token_bucket = 8;
        c.validate().unwrap();
        let inputs = vec![
            sources(&c, tokens[0], Some(2), 11),
            sources(&c, tokens[1], None, 12),
        ];
        let experts = DeviceExperts::index_scale(c.experts);
        let arms = [
            RoundArm::Fixed(DispatchArm::PayloadFirst),
            RoundArm::Fixed(DispatchArm::CountFirstSource),
            RoundArm::Auto,
        ];
        let Some(got) = runs(&c, &experts, &inputs, &arms) else {
            return;
        };
        check(&c, &inputs, &got, &experts.host(), None);
        println!("{topo}: {} runs per rank, all bit-identical", got[0].len());
    }
}

/// The SwiGLU experts (the grouped GEMM): pipelined, sequential and eager rounds bit-identical,
/// within the bf16 tolerance of the oracle.
#[test]
fn pipeline_matches_sequential_rounds_with_swiglu_experts() {
    let _serial = serial();
    for (topo, tokens) in [
        ("3A:1F", &[37usize, 0, 11][..]),
        ("2A:2F", &[3usize, 40][..]),
    ] {
        let mut c = cfg(topo, 64, 12, 2);
        c.capacity = 40;
        c.validate().unwrap();
        let p = params(&c, 32, 7);
        let experts = DeviceExperts::SwiGlu(Arc::new(p.clone()));
        let inputs = vec![sources(&c, tokens, Some(3), 21)];
        let arms = [RoundArm::Fixed(DispatchArm::CountFirstSource)];
        let Some(got) = runs(&c, &experts, &inputs, &arms) else {
            return;
        };
        check(
            &c,
            &inputs,
            &got,
            &experts.host(),
            Some(afdep_moe::accuracy::OUT_TOL),
        );
        println!("{topo}: SwiGLU pipeline = sequential = eager, within OUT_TOL of the oracle");
    }
}

/// A wide expert id in source 1's token 7 (microbatch 1 of 2): every rank's run fails with
/// microbatch 1's rejection, and the next run (good input) works.
#[test]
fn a_rejected_microbatch_fails_the_run_on_every_rank() {
    let _serial = serial();
    let mut c = cfg("3A:1F", 64, 12, 2);
    c.capacity = 40;
    let good = sources(&c, &[9, 10, 5], None, 31);
    let mut bad = good.clone();
    bad[1].routes.idx[7 * c.top_k] = c.experts as i32;
    let experts = DeviceExperts::index_scale(c.experts);
    let pc = PipelineConfig::new(2, 2).unwrap();
    let arm = RoundArm::Fixed(DispatchArm::PayloadFirst);
    let Some(got) = with_pipeline(&c, &experts, 2, |rank, pr| {
        let s = c.topology.attention_index(rank);
        let rejected = pr.run(pc, arm, s.map(|s| &bad[s]));
        let next = pr.run(pc, arm, s.map(|s| &good[s]));
        (rejected, next)
    }) else {
        return;
    };
    let mut errors = Vec::new();
    for (rank, (rejected, next)) in got.iter().enumerate() {
        match rejected {
            Err(PipelineError::Round {
                microbatch: 1,
                source,
            }) if matches!(**source, ExchangeError::Route { .. }) => {
                if let ExchangeError::Route { error, .. } = &**source {
                    errors.push(error.clone());
                }
            }
            other => panic!("rank {rank}: expected microbatch 1's rejection, got {other:?}"),
        }
        let next = next
            .as_ref()
            .unwrap_or_else(|e| panic!("rank {rank}: the run after the rejection: {e}"));
        if let Some(s) = c.topology.attention_index(rank) {
            assert_eq!(
                next.combined.as_ref().unwrap().len(),
                good[s].routes.tokens * c.hidden
            );
        }
    }
    assert!(
        errors.windows(2).all(|w| w[0] == w[1]),
        "every rank reports the same error: {errors:?}"
    );
    println!("rejected on every rank: {}", errors[0]);
}

/// Traced and timed runs: a timeline per microbatch on every rank with its role's phases,
/// a positive layer time, the FFN ranks' busy fraction in (0, 1]; results unchanged.
#[test]
fn traced_pipeline_runs_give_timelines_and_a_busy_fraction() {
    let _serial = serial();
    for topo in ["3A:1F", "2A:2F"] {
        let mut c = cfg(topo, 64, 12, 2);
        c.capacity = 40;
        let a = c.topology.attention_count();
        let inputs = sources(&c, &[33, 17, 40][..a], Some(1), 41);
        let experts = DeviceExperts::index_scale(c.experts);
        let arm = RoundArm::Fixed(DispatchArm::CountFirstSource);
        let Some(got) = with_pipeline(&c, &experts, 2, |rank, pr| {
            pr.set_trace(true).expect("tracing");
            pr.set_timing(true).expect("timing");
            let s = c.topology.attention_index(rank);
            [2usize, 4]
                .map(|m| {
                    pr.run(
                        PipelineConfig::new(m, 2).unwrap(),
                        arm,
                        s.map(|s| &inputs[s]),
                    )
                    .unwrap_or_else(|e| panic!("rank {rank} M {m}: {e}"))
                })
                .to_vec()
        }) else {
            return;
        };
        let expert = experts.host();
        for (k, m) in [2usize, 4].into_iter().enumerate() {
            let want = oracle_microbatches(&c, &inputs, m, &expert);
            let mut all = Vec::new();
            for (rank, per) in got.iter().enumerate() {
                let o = &per[k];
                assert!(o.layer_time.is_some_and(|t| t > Duration::ZERO));
                assert_eq!(
                    o.traces.len(),
                    m,
                    "{topo} M {m} rank {rank}: one per microbatch"
                );
                for t in &o.traces {
                    assert_eq!(t.rank, rank);
                    let has = |p| t.spans.iter().any(|s| s.phase == p);
                    assert!(has(TracePhase::Begin));
                    assert_eq!(
                        has(TracePhase::Experts),
                        c.topology.ffn_index(rank).is_some()
                    );
                    assert_eq!(
                        has(TracePhase::Combine),
                        c.topology.attention_index(rank).is_some()
                    );
                }
                if let Some(s) = c.topology.attention_index(rank) {
                    assert_eq!(bits(o.combined.as_ref().unwrap()), bits(&want[s]));
                }
                all.extend(o.traces.iter().cloned());
            }
            let ffn: Vec<usize> = c.topology.ffn_ranks().collect();
            let b = busy_fraction(&all, &ffn, TracePhase::Experts).expect("a window");
            assert_eq!(b.per_rank.len(), ffn.len());
            for &(r, f) in &b.per_rank {
                assert!(f > 0.0 && f <= 1.0, "{topo} M {m} FFN rank {r}: busy {f}");
            }
            let layer = got
                .iter()
                .map(|per| per[k].layer_time.unwrap())
                .max()
                .unwrap();
            println!(
                "{topo} M {m}: layer {:.1} µs (traced), FFN busy {:.3}, window {:.1} µs",
                layer.as_secs_f64() * 1e6,
                b.mean(),
                b.window_ns as f64 * 1e-3
            );
        }
    }
}
