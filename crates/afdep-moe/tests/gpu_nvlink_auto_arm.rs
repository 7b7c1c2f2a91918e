//! One CUDA graph for every dispatch arm, the arm chosen on the device each replay
//! (`FusedEngine::capture(RoundArm::Auto)`), over NvlinkIpc in-process ranks on one GPU.
//!
//! Every rank captures one auto graph and replays it with token counts that cross the
//! `min_token_bucket` both ways (uneven ranks where one source alone reaches the bucket, a
//! zero-token rank, no token anywhere, ranks at capacity), then with an arm forced by
//! `set_arm` (below and above the bucket) and back to the rule. After each replay the same
//! round runs as an eager auto device round and as the eager device round of the arm the host
//! rule gives; each run is bit-identical to the oracle (combine, expanded layout, compact
//! view, device plan) and to the others, outputs poisoned before each, and the arm every rank
//! took (`last_arm`) is the host rule's. Rejected routes in auto replays (wide, duplicate, over
//! capacity) fail every rank with the lowest rejecting rank's typed error, and the next replay
//! is exact. Ranks that ask for different arms (an auto graph with different `set_arm`, eager
//! rounds of different arms) all get `ExchangeError::ArmsDiffer`, and the next round is exact.
//! Ratios 3A:1F, 2A:2F, 1A:3F, EP4 (bf16; 3A:1F and EP4 also with fp8 payloads), and EP1 (for
//! `compute-sanitizer --tool racecheck`).
//!
//! Without a GPU every test prints `SKIP: <reason>` and passes; with `AFDEP_REQUIRE_GPU=1` a
//! missing GPU fails.

mod exchange_common;

use std::time::{Duration, Instant};

use afdep_core::oracle::exchange::SourceInput;
use afdep_core::route::{RouteRules, validate};
use afdep_core::{ExchangeConfig, PayloadKind};
use afdep_moe::{
    DeviceExperts, DeviceRoundOptions, DispatchArm, ExchangeError, FusedEngine, FusedGraph,
    RoundArm,
};
use exchange_common::*;

const TIMEOUT: Duration = Duration::from_secs(20);
/// The bucket of these tests: rounds of 15 tokens at most run payload-first, from 16 count-first.
const BUCKET: usize = 16;

fn config(topo: &str) -> ExchangeConfig {
    config_with(topo, PayloadKind::Bf16)
}

/// `config` with `payload` (fp8: hidden 128, one whole scale group).
fn config_with(topo: &str, payload: PayloadKind) -> ExchangeConfig {
    let mut c = payload_cfg(topo, payload, 40, 3, 48);
    c.knobs.min_token_bucket = BUCKET;
    c.validate().unwrap();
    c
}

/// Runs `f(rank, engine)` on every rank of a group of `c` (engines with device rounds
/// prepared, scale experts, received views kept). Graphs `f` returns are dropped, then the
/// engines, only after every rank's thread is done. `None` when there is no GPU.
fn on_group<T: Send>(
    c: &ExchangeConfig,
    f: impl Fn(usize, &mut FusedEngine) -> (T, Vec<FusedGraph>) + Sync,
) -> Option<Vec<T>> {
    let world = c.topology.world_size();
    let g = fused_group(world, c, 16 << 20, TIMEOUT)?;
    let opts = DeviceRoundOptions {
        experts: DeviceExperts::index_scale(c.experts),
        keep_received: true,
    };
    // the graphs are dropped before their engine (a tuple drops in field order), every
    // engine only after every rank's thread is done (run_group)
    let outcomes = afdep_moe::run_group(
        g,
        |_, t| -> Result<(Vec<FusedGraph>, FusedEngine), ExchangeError> {
            let mut eng = FusedEngine::new(c.clone(), t)?;
            eng.prepare_device(opts.clone())?;
            Ok((Vec::new(), eng))
        },
        |rank, (graphs, eng)| {
            let (r, g) = f(rank, eng);
            *graphs = g;
            Ok(r)
        },
    );
    let out: Vec<T> = per_rank(outcomes);
    Some(out)
}

/// One round of the sequence: the inputs, the arm forced on every rank (`None`: the rule), and
/// the error every rank must report (`None`: the round runs).
struct Step {
    inputs: Vec<SourceInput>,
    force: Option<DispatchArm>,
    reject: Option<afdep_core::RouteError>,
}

/// The arm the host rule gives a round of `inputs` under `force`.
fn host_arm(c: &ExchangeConfig, inputs: &[SourceInput], force: Option<DispatchArm>) -> DispatchArm {
    let most = inputs.iter().map(|i| i.routes.tokens).max().unwrap_or(0);
    force.unwrap_or_else(|| DispatchArm::select(&c.knobs, most))
}

/// Token counts per round (sliced to the attention ranks) crossing the bucket both ways, then
/// forced arms, then the rule again.
fn steps(c: &ExchangeConfig) -> Vec<Step> {
    let a = c.topology.attention_count();
    let cap = c.capacity;
    let plan: [([usize; 4], Option<i32>, Option<DispatchArm>); 11] = [
        ([7, 0, 13, 2], Some(5), None),
        ([17, 0, 3, 1], None, None), // one source alone reaches the bucket, a zero-token rank
        ([0, 0, 0, 0], None, None),  // no token anywhere
        ([2, BUCKET, 0, 5], Some(2), None),
        ([cap, cap - 1, cap, 0], Some(11), None), // at capacity
        ([15, 15, 15, 15], None, None),           // just below
        ([0, 1, 0, cap], Some(3), None),
        ([3, 0, 2, 1], None, Some(DispatchArm::CountFirstSource)), // the rule's arm, forced below the bucket
        ([30, 20, 0, cap], None, Some(DispatchArm::PayloadFirst)), // forced above it
        ([1, 1, 1, 1], Some(7), Some(DispatchArm::CountFirst)),
        ([BUCKET, 0, 0, 0], None, None), // the rule again
    ];
    plan.iter()
        .enumerate()
        .map(|(i, (t, hot, force))| Step {
            inputs: sources(c, &t[..a], *hot, 300 + i as u64),
            force: *force,
            reject: None,
        })
        .collect()
}

/// What one rank got from one step: (auto replay, eager auto round, eager round of the host
/// rule's arm), each with the arm the rank took.
type StepRuns = [(RankResult, DispatchArm); 3];

/// Every step on every rank: the auto graph's replay, then an eager auto round, then the eager
/// round of the host rule's arm. Returns `[rank][step]`.
fn run_steps(c: &ExchangeConfig, steps: &[Step]) -> Option<Vec<Vec<StepRuns>>> {
    on_group(c, |rank, eng| {
        let auto = eng.capture(RoundArm::Auto).expect("capture");
        assert_eq!(auto.arm(), RoundArm::Auto);
        let mut out = Vec::new();
        for st in steps {
            let mine = c.topology.attention_index(rank).map(|s| &st.inputs[s]);
            eng.set_arm(st.force);
            let replay = eng.replay(&auto, mine);
            let r0 = (replay, eng.last_arm());
            let eager = eng.device_round(RoundArm::Auto, mine);
            let r1 = (eager, eng.last_arm());
            let want = host_arm(c, &st.inputs, st.force);
            let fixed = eng.device_round(want, mine);
            let r2 = (fixed, eng.last_arm());
            out.push([r0, r1, r2]);
        }
        (out, vec![auto])
    })
}

/// Checks every rank's runs of every step: the arm, the oracle, the runs against each other,
/// or the expected rejection on every rank.
fn check_steps(what: &str, c: &ExchangeConfig, steps: &[Step], got: &[Vec<StepRuns>]) {
    const MODES: [&str; 3] = ["auto replay", "eager auto", "eager fixed"];
    for (i, st) in steps.iter().enumerate() {
        let want_arm = host_arm(c, &st.inputs, st.force);
        if let Some(want) = &st.reject {
            for (rank, per_rank) in got.iter().enumerate() {
                for (m, (r, _)) in per_rank[i].iter().enumerate() {
                    match r {
                        Err(ExchangeError::Route { reporter, error }) => {
                            assert_eq!(*reporter, rank, "{what} step {i} {}", MODES[m]);
                            assert_eq!(error, want, "{what} step {i} {} rank {rank}", MODES[m]);
                        }
                        other => panic!(
                            "{what} step {i} {} rank {rank}: expected {want}, got {other:?}",
                            MODES[m]
                        ),
                    }
                }
            }
            continue;
        }
        for m in 0..MODES.len() {
            let runs: Vec<RankResult> = got
                .iter()
                .enumerate()
                .map(|(rank, per_rank)| {
                    let (r, arm) = &per_rank[i][m];
                    assert_eq!(
                        *arm, want_arm,
                        "{what} step {i} {} rank {rank}: took {arm}, the host rule says {want_arm}",
                        MODES[m]
                    );
                    match r {
                        Ok(o) => Ok(o.clone()),
                        Err(e) => panic!("{what} step {i} {} rank {rank}: {e}", MODES[m]),
                    }
                })
                .collect();
            check_round(c, &st.inputs, &runs, None);
        }
        for (rank, per_rank) in got.iter().enumerate() {
            let first = per_rank[i][0].0.as_ref().unwrap();
            for m in 1..MODES.len() {
                let o = per_rank[i][m].0.as_ref().unwrap();
                assert!(
                    o.combined == first.combined && o.received == first.received,
                    "{what} step {i} rank {rank}: {} differs from the auto replay",
                    MODES[m]
                );
            }
        }
    }
}

/// The auto graph follows the rule across the bucket both ways and a forced arm, bit-identical
/// to the oracle and to the eager rounds, on every ratio.
#[test]
fn one_auto_graph_takes_the_rules_arm_every_replay_on_every_ratio() {
    let _serial = serial();
    use PayloadKind::{Bf16, Fp8E4m3};
    let topos = [
        ("3A:1F", Bf16),
        ("2A:2F", Bf16),
        ("1A:3F", Bf16),
        ("EP4", Bf16),
        ("3A:1F", Fp8E4m3),
        ("EP4", Fp8E4m3),
    ];
    // first, on the host: the inputs cross the bucket both ways under the rule on every ratio
    // (a check of the test's input, also without a GPU)
    for (topo, payload) in topos {
        let c = config_with(topo, payload);
        let arms: Vec<DispatchArm> = steps(&c)
            .iter()
            .filter(|s| s.force.is_none())
            .map(|s| host_arm(&c, &s.inputs, None))
            .collect();
        let up = arms
            .windows(2)
            .any(|w| w[0] == DispatchArm::PayloadFirst && w[1] == DispatchArm::CountFirstSource);
        let down = arms
            .windows(2)
            .any(|w| w[0] == DispatchArm::CountFirstSource && w[1] == DispatchArm::PayloadFirst);
        assert!(
            up && down,
            "{topo}: the rounds do not cross the bucket both ways: {arms:?}"
        );
    }
    for (topo, payload) in topos {
        let t0 = Instant::now();
        let c = config_with(topo, payload);
        let st = steps(&c);
        let Some(got) = run_steps(&c, &st) else {
            return;
        };
        let what = format!("{topo} {payload}");
        check_steps(&what, &c, &st, &got);
        println!(
            "{what}: {} steps, {:.2} s",
            st.len(),
            t0.elapsed().as_secs_f64()
        );
    }
}

/// One rank that is both source and FFN rank (EP1), a few auto replays across the bucket and a
/// forced arm: every flag is raised and awaited on the same stream, so this test also runs
/// under `compute-sanitizer --tool racecheck` (which serialises kernels).
#[test]
fn auto_graph_on_a_single_rank_ep1() {
    let _serial = serial();
    let c = config("EP1");
    let mut st: Vec<Step> = steps(&c).into_iter().take(4).collect();
    st.push(Step {
        inputs: sources(&c, &[5], Some(2), 350),
        // the streaming arm, which the rule no longer takes: forced, so every arm runs
        force: Some(DispatchArm::CountFirst),
        reject: None,
    });
    let arms: Vec<DispatchArm> = st
        .iter()
        .map(|s| host_arm(&c, &s.inputs, s.force))
        .collect();
    for a in DispatchArm::ALL {
        assert!(arms.contains(&a), "EP1 steps miss {a}: {arms:?}");
    }
    let Some(got) = run_steps(&c, &st) else {
        return;
    };
    check_steps("EP1", &c, &st, &got);
}

/// Rejected routes in auto replays (below and above the bucket): the lowest rejecting rank's
/// typed error on every rank and in every mode, and the next round exact.
#[test]
fn rejected_routes_in_auto_replays_fail_every_rank_and_the_next_replay_is_exact() {
    let _serial = serial();
    type Corrupt = fn(&mut Vec<SourceInput>, &ExchangeConfig);
    let cases: [(&str, [usize; 4], Corrupt); 3] = [
        ("wide", [5, 9, 7, 3], |s, c| {
            let last = s.len() - 1;
            s[last].routes.idx[1] = c.experts as i32;
        }),
        ("duplicate", [20, 4, 18, 1], |s, c| {
            let k = c.top_k;
            s[0].routes.idx[3 * k + 2] = s[0].routes.idx[3 * k];
        }),
        ("over capacity", [2, 30, 1, 0], |s, c| {
            let last = s.len() - 1;
            s[last] = fixed_sources(c, &vec![c.capacity + 1; last + 1], 9).remove(last);
        }),
    ];
    // every ratio's steps first (the corruptions are checked against the oracle's validation
    // on the host, also without a GPU), then the rounds
    let mut all = Vec::new();
    for topo in ["3A:1F", "EP4", "1A:3F"] {
        let c = config(topo);
        let a = c.topology.attention_count();
        let mut st = Vec::new();
        for (i, (what, tokens, corrupt)) in cases.iter().enumerate() {
            let mut bad = fixed_sources(&c, &tokens[..a], 400 + i as u64);
            corrupt(&mut bad, &c);
            let err = bad
                .iter()
                .enumerate()
                .find_map(|(s, inp)| validate(&inp.routes, &RouteRules::exchange(&c), s).err())
                .unwrap_or_else(|| panic!("{topo} {what}: the corruption is not rejected"));
            st.push(Step {
                inputs: bad,
                force: None,
                reject: Some(err),
            });
            st.push(Step {
                inputs: sources(&c, &[3, 0, 17, 1][..a], Some(4), 410 + i as u64),
                force: None,
                reject: None,
            });
        }
        all.push((topo, c, st));
    }
    for (topo, c, st) in all {
        let Some(got) = run_steps(&c, &st) else {
            return;
        };
        check_steps(topo, &c, &st, &got);
    }
}

/// Ranks that ask for different arms (an auto graph replayed with different `set_arm`, eager
/// rounds of different fixed arms): every rank skips the round with `ArmsDiffer` naming rank 0's
/// request and the first rank that differs, and the next round is exact.
#[test]
fn ranks_that_ask_for_different_arms_skip_the_round_and_go_on() {
    let _serial = serial();
    let c = config("2A:2F");
    let good = sources(&c, &[9, 20], Some(1), 501);
    let Some(got) = on_group(&c, |rank, eng| {
        let auto = eng.capture(RoundArm::Auto).expect("capture");
        let mine = c.topology.attention_index(rank).map(|s| &good[s]);
        let mut out = Vec::new();
        // auto graph: rank 0 leaves the rule, ranks 2 and 3 force the source arm
        eng.set_arm((rank >= 2).then_some(DispatchArm::CountFirstSource));
        out.push(eng.replay(&auto, mine));
        eng.set_arm(None);
        out.push(eng.replay(&auto, mine));
        // eager rounds of different fixed arms: rank 1 payload-first, the others count-first
        let arm = if rank == 1 {
            DispatchArm::PayloadFirst
        } else {
            DispatchArm::CountFirst
        };
        out.push(eng.device_round(arm, mine));
        out.push(eng.device_round(DispatchArm::CountFirstSource, mine));
        (out, vec![auto])
    }) else {
        return;
    };
    let want = [
        (
            RoundArm::Auto,
            2,
            RoundArm::Fixed(DispatchArm::CountFirstSource),
        ),
        (
            RoundArm::Fixed(DispatchArm::CountFirst),
            1,
            RoundArm::Fixed(DispatchArm::PayloadFirst),
        ),
    ];
    for (step, w) in [(0usize, want[0]), (2, want[1])] {
        for (rank, per_rank) in got.iter().enumerate() {
            match &per_rank[step] {
                Err(ExchangeError::ArmsDiffer {
                    rank: r,
                    first,
                    peer,
                    other,
                }) => {
                    assert_eq!(
                        (*r, *first, *peer, *other),
                        (rank, w.0, w.1, w.2),
                        "step {step}"
                    );
                }
                other => panic!("step {step} rank {rank}: expected ArmsDiffer, got {other:?}"),
            }
        }
    }
    for step in [1usize, 3] {
        let runs: Vec<RankResult> = got
            .iter()
            .map(|per_rank| match &per_rank[step] {
                Ok(o) => Ok(o.clone()),
                Err(e) => panic!("step {step}: {e}"),
            })
            .collect();
        check_round(&c, &good, &runs, None);
    }
}
