//! Device rounds of the fused engine over NvlinkIpc in-process ranks on one GPU: no host work
//! between the kernels (device validation and verdict, device counts and plan, device expert,
//! the combine from the compact view and the routes), eager and captured in a CUDA graph.
//!
//! Every rank prepares its device buffers (capacity-sized), captures one graph per arm
//! (payload-first, count-first streaming, the source arm), then runs every round in every
//! mode (eager and graph replay of each arm), outputs poisoned before each run. Each run must
//! be bit-identical to the oracle (combine, expanded layout, compact view, the device's plan;
//! the oracle's expert is the device expert's host twin) and to every other mode; the rounds
//! change routing and token counts from replay to replay (uneven ranks, a zero-token rank, no
//! token anywhere, a rank at capacity, a hot expert, masked slots). The four rejected route
//! classes (dummy, duplicate, negative, wide) and over-capacity, in graph replays and eager
//! device rounds: the typed route error on every rank, and the next replay correct. Ratios
//! 3A:1F, 2A:2F, 1A:3F, EP4, 2A:1F, EP2, EP1; hidden 2048, 7168 and 8192 at capacity 256 with
//! odd SM budgets and non-default knobs; identity experts (no expert kernel) on every ratio.
//!
//! fp8 payloads (e4m3, one f32 scale per 128 channels, quantised on the device while stored):
//! graph replays and eager rounds of every arm on 3A:1F, 2A:2F, 1A:3F, EP4 and EP1, and at
//! hidden 2048 and 7168 with capacity 256, with new routing and token counts on every replay
//! and edge-case groups: codes, scales and dequantised rows of both views, the device plan and
//! the combine bit-identical to the oracle's fp8 exchange and across the modes; the SwiGLU
//! device experts on the dequantised rows; a non-finite value in a travelling row rejected on
//! the device (`RouteError::NonFinitePayload` of the lowest rejecting rank, after its route
//! checks, on every rank) in graph replays and eager rounds, a masked token's row not checked,
//! and the next replay exact.
//!
//! bf16 combine partials: graph replays and eager rounds of every arm on 3A:1F, 2A:2F, 1A:3F,
//! EP4 and EP1 and at hidden 2048 with top-8, bit-identical to the oracle with bf16 partials and
//! within the bound of the exact one.
//!
//! Without a GPU every test prints `SKIP: <reason>` and passes; with `AFDEP_REQUIRE_GPU=1` a
//! missing GPU fails.

mod exchange_common;

use std::time::{Duration, Instant};

use afdep_core::RouteError;
use afdep_core::oracle::exchange::SourceInput;
use afdep_core::route::{RouteRules, validate};
use afdep_core::tensor::fp8_edge_groups;
use afdep_core::{ExchangeConfig, PayloadKind, bf16};
use afdep_moe::{
    DeviceExperts, DeviceRoundOptions, DispatchArm, ExchangeError, FusedEngine, FusedGraph,
    RoundOutput, StartGate,
};
use exchange_common::*;

const TIMEOUT: Duration = Duration::from_secs(20);

/// How one run of a round goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Eager(DispatchArm),
    Graph(DispatchArm),
}

const ARMS: [DispatchArm; 3] = [
    DispatchArm::PayloadFirst,
    DispatchArm::CountFirst,
    DispatchArm::CountFirstSource,
];

fn all_modes() -> Vec<Mode> {
    ARMS.iter()
        .flat_map(|&a| [Mode::Eager(a), Mode::Graph(a)])
        .collect()
}

/// `[round][mode][rank]` results.
type Runs = Vec<Vec<Vec<RankResult>>>;
/// Each rank's graphs' node types, `[rank][arm]`.
type Nodes = Vec<Vec<Vec<u32>>>;
/// One rank's results `[round][mode]` and its graphs' node types `[arm]`.
type RankRuns = (Vec<Vec<RankResult>>, Vec<Vec<u32>>);

/// Runs every round in every mode on one group (each rank captures one graph per arm first).
/// Returns `[round][mode][rank]`, and each rank's graphs' node types.
fn run_modes(
    c: &ExchangeConfig,
    rounds: &[Vec<SourceInput>],
    modes: &[Mode],
) -> Option<(Runs, Nodes)> {
    let opts = DeviceRoundOptions {
        experts: DeviceExperts::index_scale(c.experts),
        keep_received: true,
    };
    run_modes_with(c, rounds, modes, &opts)
}

/// [`run_modes`] with other device experts.
fn run_modes_with(
    c: &ExchangeConfig,
    rounds: &[Vec<SourceInput>],
    modes: &[Mode],
    opts: &DeviceRoundOptions,
) -> Option<(Runs, Nodes)> {
    run_modes_fronts(c, rounds, modes, opts, true, false, None)
}

/// [`run_modes_with`] with the front kernels on or off ([`FusedEngine::set_fronts`]), the
/// graphs' kernel-to-kernel edges programmatic or not
/// ([`FusedEngine::set_programmatic_graphs`]: then every graph must hold some), and every
/// rank's rounds behind `gate` when given ([`FusedEngine::set_start_gate`]).
fn run_modes_fronts(
    c: &ExchangeConfig,
    rounds: &[Vec<SourceInput>],
    modes: &[Mode],
    opts: &DeviceRoundOptions,
    fronts: bool,
    programmatic: bool,
    gate: Option<StartGate>,
) -> Option<(Runs, Nodes)> {
    let world = c.topology.world_size();
    let g = fused_group(world, c, 16 << 20, TIMEOUT)?;
    // with a gate: the second gate of `gated_graph_needs_its_gate`
    let other = StartGate::new();
    // engines and graphs are dropped after every rank's thread is done
    let mut keep: Vec<(FusedEngine, Vec<FusedGraph>)> = Vec::new();
    let per_rank: Vec<RankRuns> = std::thread::scope(|sc| {
        let hs: Vec<_> = g
            .into_iter()
            .enumerate()
            .map(|(rank, t)| {
                let cfg = c.clone();
                let opts = opts.clone();
                let gate = gate.clone();
                let other = other.clone();
                sc.spawn(move || {
                    let mut eng = FusedEngine::new(cfg.clone(), t).expect("set-up");
                    eng.set_fronts(fronts);
                    eng.set_programmatic_graphs(programmatic);
                    eng.prepare_device(opts).expect("device buffers");
                    // with a gate: the odd arms' graphs captured before it is set (a gated
                    // replay queues the gate's kernel before them), the even arms' after (the
                    // gate's kernel is their first node)
                    let mut graphs: Vec<Option<FusedGraph>> = ARMS
                        .iter()
                        .enumerate()
                        .map(|(i, &a)| {
                            (gate.is_some() && i % 2 == 1).then(|| eng.capture(a).expect("capture"))
                        })
                        .collect();
                    if gate.is_some() {
                        eng.set_start_gate(gate.clone()).expect("the start gate");
                        assert!(eng.start_gate().is_some());
                        // gated rounds are timed from the gate's opening (start_gate.rs)
                        eng.set_round_timing(true).expect("round timing");
                    }
                    for (g, &a) in graphs.iter_mut().zip(ARMS.iter()) {
                        if g.is_none() {
                            *g = Some(eng.capture(a).expect("capture"));
                        }
                    }
                    let graphs: Vec<FusedGraph> = graphs.into_iter().map(Option::unwrap).collect();
                    if programmatic {
                        for (g, a) in graphs.iter().zip(ARMS) {
                            assert!(
                                g.programmatic_edges() > 0,
                                "rank {rank} {a:?}: no programmatic edge in the graph"
                            );
                        }
                    }
                    let nodes: Vec<Vec<u32>> =
                        graphs.iter().map(|g| g.node_types().unwrap()).collect();
                    let mut out = Vec::new();
                    for inp in rounds {
                        let mine = cfg.topology.attention_index(rank).map(|s| &inp[s]);
                        let per_mode: Vec<RankResult> = modes
                            .iter()
                            .map(|m| {
                                let r = match *m {
                                    Mode::Eager(a) => eng.device_round(a, mine),
                                    Mode::Graph(a) => {
                                        let i = ARMS.iter().position(|&x| x == a).unwrap();
                                        eng.replay(&graphs[i], mine)
                                    }
                                };
                                if gate.is_some() && r.is_ok() {
                                    let t = eng.last_round_time();
                                    assert!(
                                        t.is_some_and(|t| t > Duration::ZERO && t < TIMEOUT),
                                        "rank {rank} {m:?}: a gated round's time {t:?}"
                                    );
                                }
                                r
                            })
                            .collect();
                        out.push(per_mode);
                    }
                    if gate.is_some() {
                        let mine = cfg.topology.attention_index(rank).map(|s| &rounds[0][s]);
                        gated_graph_needs_its_gate(
                            &mut eng, &graphs[0], &graphs[1], rank, mine, other,
                        );
                    }
                    (out, nodes, eng, graphs)
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| {
                let (out, nodes, eng, graphs) = h.join().expect("rank thread panicked");
                keep.push((eng, graphs));
                (out, nodes)
            })
            .collect()
    });
    // graphs before their engines' buffers
    for (eng, graphs) in keep {
        drop(graphs);
        drop(eng);
    }
    let nodes = per_rank.iter().map(|(_, n)| n.clone()).collect();
    let mut out: Runs = (0..rounds.len())
        .map(|_| (0..modes.len()).map(|_| Vec::new()).collect())
        .collect();
    for (results, _) in per_rank {
        for (i, per_mode) in results.into_iter().enumerate() {
            for (m, r) in per_mode.into_iter().enumerate() {
                out[i][m].push(r);
            }
        }
    }
    Some((out, nodes))
}

/// After gated rounds (collective, every rank alike): a graph captured with the gate (`inside`)
/// is refused with `Input` on the caller's stream (no gate opens there), once the gate is
/// removed and behind another gate, before any
/// collective step (so no rank waits); one captured without it (`outside`) still replays
/// behind `other` (a second gate shared by every rank) and returns its rows.
fn gated_graph_needs_its_gate(
    eng: &mut FusedEngine,
    inside: &FusedGraph,
    outside: &FusedGraph,
    rank: usize,
    mine: Option<&SourceInput>,
    other: StartGate,
) {
    let refused = |r: Result<RoundOutput, ExchangeError>, what: &str| match r {
        Err(ExchangeError::Input { rank: r, what: w }) => {
            assert_eq!(r, rank);
            assert!(w.contains("start gate"), "rank {rank} {what}: {w}");
        }
        other => panic!("rank {rank} {what}: {other:?} instead of Input"),
    };
    // an on-stream replay has no gate to open: refused before it touches stream or input
    // SAFETY: the refusal returns before the (default) stream or any device pointer is used
    match unsafe { eng.replay_on_stream(inside, None, std::ptr::null_mut(), true) } {
        Err(ExchangeError::Input { rank: r, what: w }) => {
            assert_eq!(r, rank);
            assert!(w.contains("start gate"), "rank {rank} on stream: {w}");
        }
        other => panic!("rank {rank} on stream: {other:?} instead of Input"),
    }
    eng.set_start_gate(None).expect("removing the gate");
    refused(eng.replay(inside, mine), "no gate");
    eng.set_start_gate(Some(other)).expect("another gate");
    refused(eng.replay(inside, mine), "another gate");
    let r = eng
        .replay(outside, mine)
        .expect("an ungated graph behind another gate");
    if let Some(inp) = mine {
        let n = r.combined.as_ref().map_or(0, Vec::len);
        assert_eq!(n, inp.x.len(), "rank {rank}: combined values");
    }
}

/// Every run against the oracle (the device expert's host twin is `expert_of(None)`: x × (e
/// + 1)) and against the first mode, bit for bit.
fn check_modes(
    what: &str,
    c: &ExchangeConfig,
    rounds: &[Vec<SourceInput>],
    got: &[Vec<Vec<RankResult>>],
    modes: &[Mode],
) {
    for (i, (inp, per_mode)) in rounds.iter().zip(got).enumerate() {
        for (m, g) in modes.iter().zip(per_mode) {
            for (rank, r) in g.iter().enumerate() {
                if let Err(e) = r {
                    panic!("{what} round {i} {m:?} rank {rank}: {e}");
                }
            }
            check_round(c, inp, g, None);
        }
        let first = &per_mode[0];
        for (m, g) in modes.iter().zip(per_mode).skip(1) {
            for (rank, (a, b)) in g.iter().zip(first).enumerate() {
                let (a, b) = (a.as_ref().unwrap(), b.as_ref().unwrap());
                assert!(
                    a.combined == b.combined && a.received == b.received,
                    "{what} round {i} rank {rank}: {m:?} != {:?}",
                    modes[0]
                );
            }
        }
    }
}

/// Each rank's output of round `i` in every mode of `modes` (`per_mode`: `[mode][rank]`):
/// `f(mode, rank, output)`; an error fails the test with `what`, the round, mode and rank.
fn each_output(
    what: &str,
    i: usize,
    per_mode: &[Vec<RankResult>],
    modes: &[Mode],
    mut f: impl FnMut(&Mode, usize, &RoundOutput),
) {
    for (m, g) in modes.iter().zip(per_mode) {
        for (rank, r) in g.iter().enumerate() {
            let r = r
                .as_ref()
                .unwrap_or_else(|e| panic!("{what} round {i} {m:?} rank {rank}: {e}"));
            f(m, rank, r);
        }
    }
}

/// Runs `rounds` in every mode of `modes` ([`run_modes`]; nothing without a GPU) and checks
/// every run against `want`: a round with `Some(error)` fails on every rank with that route
/// error (compared as error words, so a NaN value's bits count), reported by the rank itself;
/// a round with `None` is bit-identical to the oracle.
fn check_rejections(
    c: &ExchangeConfig,
    rounds: &[Vec<SourceInput>],
    want: &[Option<RouteError>],
    modes: &[Mode],
) {
    let Some((got, _)) = run_modes(c, rounds, modes) else {
        return;
    };
    for (i, ((inp, w), per_mode)) in rounds.iter().zip(want).zip(&got).enumerate() {
        for (m, g) in modes.iter().zip(per_mode) {
            match w {
                None => check_round(c, inp, g, None),
                Some(want) => {
                    check_route_errors(g, &format!("round {i} {m:?} "), want, |rank, error| {
                        assert_eq!(
                            error.to_word(),
                            want.to_word(),
                            "round {i} {m:?} rank {rank}: {error} instead of {want}"
                        );
                    });
                }
            }
        }
    }
}

fn node_check(what: &str, nodes: &[Vec<Vec<u32>>]) {
    use afdep_kernels::cudarc::driver::sys::CUgraphNodeType as T;
    let ok = [
        T::CU_GRAPH_NODE_TYPE_KERNEL as u32,
        T::CU_GRAPH_NODE_TYPE_MEMCPY as u32,
    ];
    for (rank, per_arm) in nodes.iter().enumerate() {
        for (a, n) in ARMS.iter().zip(per_arm) {
            assert!(
                n.iter().all(|t| ok.contains(t)),
                "{what} rank {rank} {a}: the graph holds nodes other than kernels and copies: {n:?}"
            );
            // at least a front and the combine (a source with the front kernels)
            assert!(
                n.iter().filter(|&&t| t == ok[0]).count() >= 2,
                "{what} rank {rank} {a}: too few kernel nodes: {n:?}"
            );
        }
    }
}

/// Rounds with new routing and token counts each time: the every-ratio rounds (uneven with a
/// hot expert, one token each, none anywhere, uneven with a zero-token rank) and a round with
/// one rank at capacity.
fn replay_rounds(c: &ExchangeConfig) -> Vec<Vec<SourceInput>> {
    let a = c.topology.attention_count();
    let cap = c.capacity;
    let mut r = every_ratio_rounds(c);
    r.push(sources(c, &[cap, 3, 0, cap - 1][..a], Some(2), 41));
    r.push(sources(c, &[0, cap, 17, 1][..a], None, 42));
    r
}

#[test]
fn graph_replays_match_the_oracle_and_eager_rounds_for_every_ratio_and_arm() {
    let _serial = serial();
    let modes = all_modes();
    for topo in ["3A:1F", "2A:2F", "1A:3F", "EP4", "2A:1F", "EP2", "EP1"] {
        let t0 = Instant::now();
        let mut c = cfg(topo, 40, 12, 3);
        c.capacity = 48;
        c.validate().unwrap();
        let rounds = replay_rounds(&c);
        let Some((got, nodes)) = run_modes(&c, &rounds, &modes) else {
            return;
        };
        node_check(topo, &nodes);
        check_modes(topo, &c, &rounds, &got, &modes);
        println!("{topo}: {:.2} s", t0.elapsed().as_secs_f64());
    }
}

/// The start gate ([`FusedEngine::set_start_gate`]): every rank's eager rounds and graph
/// replays of every arm held until rank 0 opens the gate once all have queued theirs, on
/// 3A:1F, 1A:3F and EP4: bit-identical to the oracle and across the modes, with new routing
/// and token counts on every replay; a rejected route (a dummy expert) under the gate is the
/// typed route error on every rank, and the next gated round is exact.
#[test]
fn gated_rounds_match_the_oracle_and_a_rejection_passes_the_gate() {
    let _serial = serial();
    let modes = all_modes();
    for topo in ["3A:1F", "1A:3F", "EP4"] {
        let mut c = cfg(topo, 40, 12, 3);
        c.capacity = 48;
        c.validate().unwrap();
        let mut rounds = replay_rounds(&c);
        let a = c.topology.attention_count();
        let mut bad = sources(&c, &[5, 9, 7, 2][..a], None, 91);
        bad[a - 1].routes.idx[1] = c.experts as i32; // a dummy expert
        let err = bad
            .iter()
            .enumerate()
            .find_map(|(s, inp)| validate(&inp.routes, &RouteRules::exchange(&c), s).err())
            .expect("the dummy expert is rejected");
        let bad_at = rounds.len();
        rounds.push(bad);
        rounds.push(sources(&c, &[3, 0, 16, 1][..a], Some(4), 92));
        let opts = DeviceRoundOptions {
            experts: DeviceExperts::index_scale(c.experts),
            keep_received: true,
        };
        let gate = StartGate::new();
        let Some((got, _)) =
            run_modes_fronts(&c, &rounds, &modes, &opts, true, false, Some(gate.clone()))
        else {
            return;
        };
        for (m, g) in modes.iter().zip(&got[bad_at]) {
            check_route_errors(g, &format!("{topo} gated {m:?} "), &err, |rank, e| {
                assert_eq!(e.to_word(), err.to_word(), "{topo} {m:?} rank {rank}: {e}");
            });
        }
        let (good_rounds, good): (Vec<_>, Vec<_>) = rounds
            .iter()
            .cloned()
            .zip(got)
            .enumerate()
            .filter(|(i, _)| *i != bad_at)
            .map(|(_, x)| x)
            .unzip();
        check_modes(&format!("{topo} gated"), &c, &good_rounds, &good, &modes);
        println!("{topo}: gated rounds exact ({gate:?})");
    }
}

/// The launch-per-phase path of single-role ranks (the front kernels off), every mode, at
/// 3A:1F and 2A:2F: the same results as the oracle and the eager rounds.
#[test]
fn graph_replays_without_the_front_kernels_match_the_oracle() {
    let _serial = serial();
    let modes = all_modes();
    for topo in ["3A:1F", "2A:2F"] {
        let mut c = cfg(topo, 40, 12, 3);
        c.capacity = 48;
        c.validate().unwrap();
        let rounds = replay_rounds(&c);
        let opts = DeviceRoundOptions {
            experts: DeviceExperts::index_scale(c.experts),
            keep_received: true,
        };
        let Some((got, nodes)) = run_modes_fronts(&c, &rounds, &modes, &opts, false, false, None)
        else {
            return;
        };
        node_check(topo, &nodes);
        check_modes(topo, &c, &rounds, &got, &modes);
    }
}

/// Programmatic edges in the captured rounds ([`FusedEngine::set_programmatic_graphs`]): every
/// rank's graph of every arm holds some, and every mode matches the oracle and the eager rounds
/// bit for bit, with the fronts off and on, host-started and behind the start gate, on 3A:1F,
/// 2A:2F, 1A:3F, EP4 and EP1.
#[test]
fn programmatic_graphs_match_the_oracle() {
    let _serial = serial();
    let modes = all_modes();
    for topo in ["3A:1F", "2A:2F", "1A:3F", "EP4", "EP1"] {
        for (fronts, gated) in [(false, false), (true, true), (false, true)] {
            let mut c = cfg(topo, 40, 12, 3);
            c.capacity = 48;
            c.validate().unwrap();
            let rounds = replay_rounds(&c);
            let opts = DeviceRoundOptions {
                experts: DeviceExperts::index_scale(c.experts),
                keep_received: true,
            };
            let gate = gated.then(StartGate::new);
            let Some((got, nodes)) =
                run_modes_fronts(&c, &rounds, &modes, &opts, fronts, true, gate)
            else {
                return;
            };
            let what = format!("{topo} programmatic (fronts {fronts}, gate {gated})");
            node_check(&what, &nodes);
            check_modes(&what, &c, &rounds, &got, &modes);
            println!("{what}: exact");
        }
    }
}

/// One rank that is both source and FFN rank (EP1), every mode, a few small rounds: every flag
/// is raised and awaited on the same stream, so this test also runs under compute-sanitizer
/// (which serialises kernels; the multi-rank tests' cross-stream waits would run out there).
#[test]
fn device_rounds_on_a_single_rank_ep1() {
    let _serial = serial();
    let modes = all_modes();
    let mut c = cfg("EP1", 40, 12, 2);
    c.capacity = 24;
    c.validate().unwrap();
    let rounds = vec![
        sources(&c, &[7], Some(5), 51),
        sources(&c, &[0], None, 52),
        sources(&c, &[24], Some(11), 53),
    ];
    let Some((got, nodes)) = run_modes(&c, &rounds, &modes) else {
        return;
    };
    node_check("EP1", &nodes);
    check_modes("EP1", &c, &rounds, &got, &modes);
}

/// Hidden 2048, 7168 and 8192 with capacity 256 (rounds at capacity), odd SM budgets and
/// knobs.
#[test]
fn graph_replays_at_large_hidden_with_knobs() {
    let _serial = serial();
    let modes = all_modes();
    for (topo, hidden, k, sms, gate) in [
        ("3A:1F", 2048, 6, 7, true),
        ("1A:3F", 2048, 8, 23, false),
        ("EP4", 7168, 4, 24, true),
        ("2A:2F", 7168, 4, 7, false),
        ("1A:3F", 8192, 8, 23, true),
    ] {
        let t0 = Instant::now();
        let mut c = cfg(topo, hidden, 24, k);
        c.capacity = 256;
        c.knobs.transport_sms = sms;
        c.knobs.payload_gate = gate;
        c.knobs.warps_per_unit = 3;
        c.knobs.min_rows_per_unit = 5;
        c.validate().unwrap();
        let a = c.topology.attention_count();
        let rounds = vec![
            sources(&c, &[250, 0, 131, 9][..a], Some(7), 61),
            sources(&c, &[256, 256, 0, 64][..a], Some(2), 62),
            sources(&c, &[1, 0, 256, 3][..a], None, 63),
        ];
        let Some((got, _)) = run_modes(&c, &rounds, &modes) else {
            return;
        };
        check_modes(
            &format!("{topo} hidden {hidden}"),
            &c,
            &rounds,
            &got,
            &modes,
        );
        println!(
            "{topo} hidden {hidden}: {:.2} s",
            t0.elapsed().as_secs_f64()
        );
    }
}

/// bf16 combine partials in device rounds and graph replays of every arm: every run
/// bit-identical to the oracle with bf16 partials and to every other mode, within the bound of
/// the exact (f32-partials) oracle, the same bits as it on one FFN rank and different on
/// several. The replay rounds (uneven ranks, a zero-token rank, one token each, no token
/// anywhere, a rank at capacity, a hot expert), the element path (hidden 36) and top-8 at
/// hidden 2048 (16-byte path).
#[test]
fn bf16_partials_in_graph_replays_and_device_rounds_match_the_bf16_oracle_within_the_bound() {
    let _serial = serial();
    let modes = all_modes();
    for (topo, hidden, k, capacity) in [
        ("3A:1F", 40, 3, 48),
        ("2A:2F", 40, 3, 48),
        ("1A:3F", 40, 3, 48),
        ("EP4", 40, 3, 48),
        ("EP1", 40, 2, 48),
        ("2A:2F", 36, 2, 48),
        ("3A:1F", 2048, 8, 256),
        ("2A:2F", 2048, 8, 256),
    ] {
        let t0 = Instant::now();
        let mut c = cfg(topo, hidden, if k == 8 { 24 } else { 12 }, k);
        c.capacity = capacity;
        let c = bf16_partials(c);
        let rounds = if capacity == 256 {
            let a = c.topology.attention_count();
            vec![
                sources(&c, &[250, 0, 131, 9][..a], Some(7), 71),
                sources(&c, &[256, 256, 0, 64][..a], Some(2), 72),
                sources(&c, &[1, 0, 256, 3][..a], None, 73),
            ]
        } else {
            replay_rounds(&c)
        };
        let Some((got, _)) = run_modes(&c, &rounds, &modes) else {
            return;
        };
        let what = format!("{topo} hidden {hidden} bf16 partials");
        check_modes(&what, &c, &rounds, &got, &modes);
        let mut differing = 0;
        for (inp, per_mode) in rounds.iter().zip(&got) {
            for g in per_mode {
                differing += check_partials_bound(&c, inp, g, expert_of(None));
            }
        }
        check_partials_took_effect(&c, differing);
        println!("{what}: {:.2} s", t0.elapsed().as_secs_f64());
    }
}

#[test]
fn rejected_routes_fail_every_rank_in_graph_and_eager_rounds_and_the_next_round_works() {
    let _serial = serial();
    type Corrupt = fn(&mut Vec<SourceInput>);
    // 3A:1F, 12 experts, 10 placed (ids 10 and 11 are dummies)
    let mut c = cfg("3A:1F", 24, 12, 3);
    c.capacity = 16;
    c.experts_per_rank = 10;
    c.validate().unwrap();
    let cases: [(&str, Corrupt, u32); 5] = [
        (
            "dummy",
            |s| s[1].routes.idx[2 * 3 + 1] = 11,
            afdep_core::error::route_class::DUMMY,
        ),
        (
            "duplicate",
            |s| s[2].routes.idx[3 * 3 + 2] = s[2].routes.idx[3 * 3],
            afdep_core::error::route_class::DUPLICATE,
        ),
        (
            "negative",
            |s| s[0].routes.idx[4] = -5,
            afdep_core::error::route_class::NEGATIVE,
        ),
        (
            "wide",
            |s| {
                s[1].routes.idx[0] = 12;
                s[2].routes.idx[5] = 400; // a later rank's error is not the one reported
            },
            afdep_core::error::route_class::WIDE,
        ),
        (
            "over capacity",
            |s| {
                let c = {
                    let mut c = cfg("3A:1F", 24, 12, 3);
                    c.experts_per_rank = 10;
                    c
                };
                s[2] = fixed_sources(&c, &[0, 0, 17], 9).remove(2);
            },
            afdep_core::error::route_class::OVER_CAPACITY,
        ),
    ];
    let modes = [
        Mode::Graph(DispatchArm::PayloadFirst),
        Mode::Graph(DispatchArm::CountFirst),
        Mode::Graph(DispatchArm::CountFirstSource),
        Mode::Eager(DispatchArm::PayloadFirst),
        Mode::Eager(DispatchArm::CountFirstSource),
    ];
    let mut rounds = Vec::new();
    let mut want = Vec::new();
    for (i, (what, corrupt, class)) in cases.iter().enumerate() {
        let mut bad = fixed_sources(&c, &[5, 9, 7], 70 + i as u64);
        corrupt(&mut bad);
        // the lowest rejecting rank's error, as the staged engine reports it
        let err = bad
            .iter()
            .enumerate()
            .find_map(|(s, inp)| validate(&inp.routes, &RouteRules::exchange(&c), s).err())
            .unwrap_or_else(|| panic!("{what}: the corruption is not rejected"));
        assert_eq!(err.to_word()[0], *class, "{what}: {err}");
        rounds.push(bad);
        want.push(Some(err));
        rounds.push(sources(&c, &[3, 0, 16], Some(4), 80 + i as u64));
        want.push(None);
    }
    check_rejections(&c, &rounds, &want, &modes);
}

/// Repeated replays of the same seeds give identical outputs (hash of every run's bits).
#[test]
fn repeated_replays_are_identical() {
    let _serial = serial();
    let mut c = cfg("2A:2F", 64, 8, 2);
    c.capacity = 40;
    c.validate().unwrap();
    let one = sources(&c, &[40, 13], Some(1), 90);
    let rounds: Vec<Vec<SourceInput>> = (0..6).map(|_| one.clone()).collect();
    let modes = [
        Mode::Graph(DispatchArm::PayloadFirst),
        Mode::Graph(DispatchArm::CountFirst),
    ];
    let Some((got, _)) = run_modes(&c, &rounds, &modes) else {
        return;
    };
    check_modes("2A:2F repeat", &c, &rounds, &got, &modes);
    for per_mode in &got[1..] {
        for (a, b) in per_mode.iter().zip(&got[0]) {
            for (x, y) in a.iter().zip(b) {
                let (x, y) = (x.as_ref().unwrap(), y.as_ref().unwrap());
                assert!(x.combined == y.combined && x.received == y.received);
            }
        }
    }
}

/// The SwiGLU expert FFN on the device (grouped GEMM over the expanded layout, groups from the
/// device plan): every source's combine within the layer output's bf16 tolerance of the oracle
/// with the oracle's SwiGLU experts, the received views bit-identical, and every mode (eager,
/// graph replays of each arm) bit-identical to the first; with bf16 payloads, and with fp8
/// payloads, whose experts run on the dequantised expanded rows (the oracle's fp8 exchange).
#[test]
fn swiglu_device_experts_are_within_bf16_tolerance_of_the_oracle() {
    let _serial = serial();
    let modes = [
        Mode::Eager(DispatchArm::PayloadFirst),
        Mode::Graph(DispatchArm::PayloadFirst),
        Mode::Graph(DispatchArm::CountFirst),
        Mode::Graph(DispatchArm::CountFirstSource),
    ];
    for (topo, payload) in [
        ("3A:1F", PayloadKind::Bf16),
        ("1A:3F", PayloadKind::Bf16),
        ("EP4", PayloadKind::Bf16),
        ("3A:1F", PayloadKind::Fp8E4m3),
        ("EP4", PayloadKind::Fp8E4m3),
    ] {
        let c = payload_cfg(topo, payload, 64, 2, 40);
        c.validate().unwrap();
        let p = params(&c, 32, 7);
        let opts = DeviceRoundOptions {
            experts: DeviceExperts::SwiGlu(std::sync::Arc::new(p.clone())),
            keep_received: true,
        };
        let a = c.topology.attention_count();
        let rounds = vec![
            sources(&c, &[37, 0, 11, 40][..a], Some(3), 101),
            sources(&c, &[1, 40, 0, 5][..a], None, 102),
        ];
        let Some((got, _)) = run_modes_with(&c, &rounds, &modes, &opts) else {
            return;
        };
        let expert = |e: usize, rows: &[afdep_core::bf16], n: usize| {
            afdep_core::oracle::layer::expert_rows(&p, e, rows, n).unwrap()
        };
        for (i, (inp, per_mode)) in rounds.iter().zip(&got).enumerate() {
            let want = afdep_core::oracle::exchange::exchange(&c, inp, expert).unwrap();
            let want_rx = afdep_core::oracle::exchange::dispatch(&c, inp).unwrap();
            each_output(topo, i, per_mode, &modes, |m, rank, r| {
                if let Some(s) = c.topology.attention_index(rank) {
                    let got = r.combined.as_ref().unwrap();
                    let err = afdep_moe::accuracy::max_rel_err(got, &want[s]);
                    assert!(
                        err <= afdep_moe::accuracy::OUT_TOL,
                        "{topo} round {i} {m:?} source {s}: error {err}"
                    );
                    println!("{topo} round {i} {m:?} source {s}: max rel err {err:.2e}");
                }
                if let Some(f) = c.topology.ffn_index(rank) {
                    assert_eq!(r.received.as_ref().unwrap(), &want_rx[f]);
                }
            });
            for (m, g) in modes.iter().zip(per_mode).skip(1) {
                for (rank, (x, y)) in g.iter().zip(&per_mode[0]).enumerate() {
                    let (x, y) = (x.as_ref().unwrap(), y.as_ref().unwrap());
                    assert!(
                        x.combined == y.combined,
                        "{topo} round {i} rank {rank}: {m:?} differs from {:?}",
                        modes[0]
                    );
                }
            }
        }
    }
}

fn fp8(mut c: ExchangeConfig) -> ExchangeConfig {
    c.payload = PayloadKind::Fp8E4m3;
    c.validate().unwrap();
    c
}

/// `rounds` with the groups of every other round's rows turned into fp8 edge cases (zeros,
/// subnormals, huge groups, spikes, ties).
fn with_edge_groups(
    c: &ExchangeConfig,
    mut rounds: Vec<Vec<SourceInput>>,
) -> Vec<Vec<SourceInput>> {
    for (i, r) in rounds.iter_mut().enumerate().filter(|(i, _)| i % 2 == 0) {
        for (s, src) in r.iter_mut().enumerate() {
            fp8_edge_groups(&mut src.x, c.hidden, (i * 7 + s) as u64);
        }
    }
    rounds
}

/// fp8 device rounds, eager and graph replays of every arm, with new routing and token counts
/// on every replay (the replay rounds: uneven ranks with a hot expert, one token each, none
/// anywhere, a zero-token rank, ranks at capacity), bit-identical to the oracle's fp8 exchange
/// and to each other; small shapes on every 4-rank ratio and EP1, then hidden 2048 and 7168 at
/// capacity 256 with odd SM budgets and knobs.
#[test]
fn fp8_graph_replays_match_the_oracle_and_eager_rounds_for_every_arm() {
    let _serial = serial();
    let modes = all_modes();
    for (topo, hidden, k, cap, sms, gate) in [
        ("3A:1F", 256, 3, 48, 24, true),
        ("2A:2F", 256, 3, 48, 24, true),
        ("1A:3F", 384, 3, 48, 24, true),
        ("EP4", 256, 3, 48, 24, true),
        ("EP1", 128, 2, 48, 24, true),
        ("3A:1F", 2048, 6, 256, 7, false),
        ("EP4", 7168, 4, 256, 23, true),
    ] {
        let t0 = Instant::now();
        let mut c = cfg(topo, hidden, 24, k);
        c.capacity = cap;
        c.knobs.transport_sms = sms;
        c.knobs.payload_gate = gate;
        if hidden >= 2048 {
            c.knobs.warps_per_unit = 3;
            c.knobs.min_rows_per_unit = 5;
        }
        let c = fp8(c);
        let mut rounds = replay_rounds(&c);
        if hidden >= 2048 {
            // the large shapes: uneven with a hot expert, none anywhere, the two at capacity
            rounds = [0, 2, 4, 5].iter().map(|&i| rounds[i].clone()).collect();
        }
        let rounds = with_edge_groups(&c, rounds);
        let Some((got, nodes)) = run_modes(&c, &rounds, &modes) else {
            return;
        };
        let what = format!("fp8 {topo} hidden {hidden}");
        node_check(&what, &nodes);
        check_modes(&what, &c, &rounds, &got, &modes);
        for (i, per_mode) in got.iter().enumerate() {
            for (m, g) in modes.iter().zip(per_mode) {
                for (rank, r) in g.iter().enumerate() {
                    if let Some(rx) = &r.as_ref().unwrap().received {
                        let f8 = rx.fp8.as_ref().unwrap_or_else(|| {
                            panic!("{what} round {i} {m:?} rank {rank}: no fp8 views")
                        });
                        assert_eq!(f8.compact_q.len(), rx.compact_x.len());
                    }
                }
            }
        }
        println!("{what}: {:.2} s", t0.elapsed().as_secs_f64());
    }
}

/// A non-finite value in a travelling fp8 row, found on the device in graph replays and eager
/// rounds of every arm: every rank returns the lowest rejecting rank's error (routes checked
/// first on each rank, then its rows: tokens, then channels, ascending), exactly the host's
/// (`oracle::exchange::validate_sources`; compared as error words, so a NaN's bits count); a
/// masked token's row is not checked; the next round is exact.
#[test]
fn fp8_non_finite_rows_are_rejected_on_the_device_and_the_next_round_works() {
    let _serial = serial();
    type Corrupt = fn(&mut Vec<SourceInput>);
    let c = fp8({
        let mut c = cfg("3A:1F", 256, 12, 3);
        c.capacity = 16;
        c
    });
    let cases: [(&str, Corrupt); 6] = [
        ("a NaN", |s| s[1].x[2 * 256 + 200] = bf16::NAN),
        ("the lowest rank's infinity", |s| {
            s[2].x[256 + 3] = bf16::NEG_INFINITY;
            s[0].x[3 * 256 + 255] = bf16::INFINITY;
        }),
        ("the earlier token, not the earlier channel", |s| {
            s[1].x[4 * 256] = bf16::NAN;
            s[1].x[2 * 256 + 250] = bf16::INFINITY;
        }),
        ("a signalling NaN's bits", |s| {
            s[2].x[6 * 256 + 128] = bf16::from_bits(0xff81);
        }),
        ("the route before the row", |s| {
            s[0].x[0] = bf16::NAN;
            s[0].routes.idx[4 * 3 + 1] = 12; // wide, at a later token
        }),
        ("a masked token's row does not travel", |s| {
            for j in 0..3 {
                s[1].routes.idx[3 * 3 + j] = -1;
            }
            s[1].x[3 * 256 + 7] = bf16::NAN;
        }),
    ];
    let mut rounds = Vec::new();
    let mut want = Vec::new();
    for (i, (what, corrupt)) in cases.iter().enumerate() {
        let mut bad = fixed_sources(&c, &[5, 9, 7], 170 + i as u64);
        corrupt(&mut bad);
        let err = afdep_core::oracle::exchange::validate_sources(&c, &bad).err();
        let travels = *what != "a masked token's row does not travel";
        assert_eq!(err.is_some(), travels, "{what}: {err:?}");
        rounds.push(bad);
        want.push(err);
        rounds.push(sources(&c, &[3, 0, 16], Some(4), 180 + i as u64));
        want.push(None);
    }
    let modes = all_modes();
    check_rejections(&c, &rounds, &want, &modes);
}

/// [`DeviceExperts::Identity`] (no expert kernel: the combine reads the expanded rows
/// themselves): eager device rounds and graph replays of every arm on every 4-rank ratio, with
/// new routing and token counts each round, bf16 (hidden 36: the combine's element path, and
/// 72: its 16-byte path) and fp8, bit-identical to the oracle's exchange with the identity
/// expert and to each other.
#[test]
fn identity_experts_read_the_expanded_rows() {
    let _serial = serial();
    let modes = all_modes();
    for (topo, payload, hidden) in [
        ("3A:1F", PayloadKind::Bf16, 36),
        ("2A:2F", PayloadKind::Bf16, 72),
        ("1A:3F", PayloadKind::Bf16, 36),
        ("EP4", PayloadKind::Bf16, 72),
        ("3A:1F", PayloadKind::Fp8E4m3, 256),
        ("EP4", PayloadKind::Fp8E4m3, 128),
    ] {
        let mut c = cfg(topo, hidden, 12, 3);
        c.capacity = 48;
        c.payload = payload;
        c.validate().unwrap();
        let opts = DeviceRoundOptions {
            experts: DeviceExperts::Identity,
            keep_received: false,
        };
        let rounds = replay_rounds(&c);
        let Some((got, _)) = run_modes_with(&c, &rounds, &modes, &opts) else {
            return;
        };
        let identity = |_e: usize, rows: &[bf16], _n: usize| rows.to_vec();
        let bits = |v: &[bf16]| v.iter().map(|x| x.to_bits()).collect::<Vec<u16>>();
        for (i, (inp, per_mode)) in rounds.iter().zip(&got).enumerate() {
            let want = afdep_core::oracle::exchange::exchange(&c, inp, identity).unwrap();
            each_output(topo, i, per_mode, &modes, |m, rank, r| {
                if let Some(s) = c.topology.attention_index(rank) {
                    let got = r.combined.as_ref().expect("a source's output");
                    let (g, w) = (bits(got), bits(&want[s]));
                    let bad = g.iter().zip(&w).position(|(a, b)| a != b);
                    assert!(
                        g.len() == w.len() && bad.is_none(),
                        "{topo} {payload:?} hidden {hidden} round {i} {m:?} source {s}: \
                         {} values against {}, first difference at {bad:?}",
                        g.len(),
                        w.len()
                    );
                }
            });
        }
        println!("identity experts {topo} {payload:?} hidden {hidden}: ok");
    }
}
