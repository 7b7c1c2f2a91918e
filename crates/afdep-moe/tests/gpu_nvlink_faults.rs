//! Fault injection into the fused engine's kernels (cargo feature `fault-injection`; the
//! reference record's fault suite (docs/design.md, "The reference record"), done with typed faults
//! instead of patched sources): `FusedEngine::set_fault` on in-process NvlinkIpc ranks on GPU 0,
//! 3A:1F and 2A:2F, hidden 2048, capacity 256, top-8 of 32 experts, a few hundred uneven tokens per
//! source (a rank at capacity, a zero-token rank, hot experts, masked slots; new data every round).
//!
//! - The delays ([`Fault::must_pass`]: late rows P1, deferred row flags P2, late counts P3,
//!   late offset flags P4, late prefix sums P4b, deferred dispatch and combine flags, late return
//!   rows, late device-round status): every round of every mode (rounds with host experts,
//!   `FusedEngine::round`, of the three arms, device rounds of the three arms) bit-identical to the oracle (combine, expanded
//!   layout, compact view, the device plan; fp8 codes and scales too), the fault's points fired
//!   (its hit counter), and a round after the fault is turned off exact too; bf16 on both
//!   ratios, and fp8 payloads on 3A:1F. A control without a fault runs first on the same
//!   engines (host-expert and device rounds mixed on one engine), and every fault's outcome
//!   is printed before the test fails.
//! - The skipped waits (N2: the streaming epilogue skips its row waits, with late rows; N3: the
//!   source arm skips its offsets wait, with late prefix sums; the combine skips its flag wait,
//!   with late return rows; the FFN rank skips its dispatch flag wait, with late rows): run in
//!   the modes where the wait they skip is the one that protects the data, and the oracle
//!   comparison must report mismatching rows (or a typed error) in at least one of the rounds
//!   for each ratio: the checks can fail. Every mismatching row count is printed.
//!
//! - A start gate that never opens (`StartGate::set_never_open`): every rank's gated replay is
//!   a typed device timeout of the phase `start gate` within the bound, on every rank.
//!
//! Without a GPU every test prints `SKIP: <reason>` and passes; with `AFDEP_REQUIRE_GPU=1` a
//! missing GPU fails.

mod exchange_common;

use std::time::{Duration, Instant};

use afdep_core::oracle::exchange::{self as reference, FfnReceived, SourceInput};
use afdep_core::{ExchangeConfig, PayloadKind, bf16};
use afdep_moe::{
    DeviceExperts, DeviceRoundOptions, DispatchArm, ExchangeError, Fault, FusedEngine, FusedGraph,
    RoundOutput, StartGate,
};
use afdep_transport::Transport;
use exchange_common::*;

/// Every wait of the engines (device and control plane): a hang would be a typed timeout.
const TIMEOUT: Duration = Duration::from_secs(10);
const HIDDEN: usize = 2048;
const CAPACITY: usize = 256;
const EXPERTS: usize = 32;
const TOP_K: usize = 8;

/// How one run of a round goes: a round with host experts (`FusedEngine::round`: a device round
/// split around the host's experts) or a device round (`FusedEngine::device_round`), of one arm.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Host(DispatchArm),
    Device(DispatchArm),
}

impl std::fmt::Display for Mode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Mode::Host(a) => write!(f, "host {a}"),
            Mode::Device(a) => write!(f, "device {a}"),
        }
    }
}

const ALL_MODES: [Mode; 6] = [
    Mode::Host(DispatchArm::PayloadFirst),
    Mode::Host(DispatchArm::CountFirst),
    Mode::Host(DispatchArm::CountFirstSource),
    Mode::Device(DispatchArm::PayloadFirst),
    Mode::Device(DispatchArm::CountFirst),
    Mode::Device(DispatchArm::CountFirstSource),
];

/// The modes in which a skipping fault's wait is the one that protects the data (elsewhere a
/// later wait covers it: e.g. a device round's payload-first epilogue waits for every dispatch
/// flag before its row waits, so skipping the row waits changes nothing there). A host-expert
/// round runs the device round's kernels of its arm, so its exposed arms are the device round's.
fn exposed_modes(fault: Fault) -> Vec<Mode> {
    use DispatchArm::*;
    match fault {
        Fault::SkipRowWait => vec![Mode::Host(CountFirst), Mode::Device(CountFirst)],
        Fault::SkipOffsetWait => vec![Mode::Host(CountFirstSource), Mode::Device(CountFirstSource)],
        Fault::SkipCombineWait => ALL_MODES.to_vec(),
        Fault::SkipDispatchWait => {
            vec![Mode::Host(CountFirstSource), Mode::Device(CountFirstSource)]
        }
        f => panic!("{f} skips no wait"),
    }
}

/// The configuration of a ratio: 3A:1F with the knobs' defaults (payload gate on), 2A:2F with
/// the payload gate off (streaming rows then race the offsets too); bf16 or fp8 payloads.
fn config(topo: &str, payload: PayloadKind) -> ExchangeConfig {
    let mut c =
        ExchangeConfig::new(topo.parse().unwrap(), HIDDEN, EXPERTS, TOP_K, CAPACITY).unwrap();
    if topo == "2A:2F" {
        c.knobs.payload_gate = false;
    }
    c.payload = payload;
    c.validate().unwrap();
    c
}

/// `n` rounds of new data: uneven sources, one at capacity, a zero-token one, hot experts.
fn rounds(c: &ExchangeConfig, n: usize) -> Vec<Vec<SourceInput>> {
    let ns = c.topology.attention_count();
    let sets: [(&[usize], Option<i32>); 4] = [
        (&[256, 131, 200], Some(3)),
        (&[97, 256, 0], None),
        (&[177, 45, 233], Some(17)),
        (&[211, 0, 150], Some(5)),
    ];
    sets.iter()
        .take(n)
        .enumerate()
        .map(|(i, (t, hot))| sources(c, &t[..ns], *hot, 100 + i as u64))
        .collect()
}

/// What the oracle says about one round: each source's combine and each FFN rank's views.
struct Want {
    combined: Vec<Vec<bf16>>,
    received: Vec<FfnReceived>,
}

fn oracle(c: &ExchangeConfig, inp: &[SourceInput]) -> Want {
    let expert = expert_of(None);
    Want {
        combined: reference::exchange(c, inp, expert).expect("the oracle accepts the round"),
        received: reference::dispatch(c, inp).expect("the oracle accepts the round"),
    }
}

/// Rows that differ between `got` and `want` (rows of `h` values, bit for bit; a missing or
/// extra row counts), with the first one's index.
fn row_diff<T: bytemuck::Pod>(got: &[T], want: &[T], h: usize) -> (usize, Option<usize>) {
    let (g, w) = (got.chunks(h), want.chunks(h));
    let extra = g.len().abs_diff(w.len());
    let mut n = extra;
    let mut first = (extra > 0).then(|| got.len().min(want.len()) / h.max(1));
    for (i, (a, b)) in got.chunks(h).zip(want.chunks(h)).enumerate() {
        if bytemuck::cast_slice::<T, u8>(a) != bytemuck::cast_slice::<T, u8>(b) {
            n += 1;
            first = Some(first.map_or(i, |f| f.min(i)));
        }
    }
    (n, first)
}

/// The oracle comparison of one run: mismatching rows (combine rows, expanded rows, compact
/// rows, one per differing plan) and a description of the first, or the first failing rank and
/// its error.
fn compare<'a>(
    c: &ExchangeConfig,
    want: &Want,
    got: &'a [RankResult],
) -> Result<(usize, Option<String>), (usize, &'a ExchangeError)> {
    let h = c.hidden;
    let k = c.top_k;
    let mut rows = 0;
    let mut first = None;
    let mut note = |n: usize, what: String| {
        if n > 0 && first.is_none() {
            first = Some(what);
        }
        n
    };
    for (rank, r) in got.iter().enumerate() {
        let r = r.as_ref().map_err(|e| (rank, e))?;
        if let Some(s) = c.topology.attention_index(rank) {
            let got = r.combined.as_deref().unwrap_or(&[]);
            let (n, i) = row_diff(got, &want.combined[s], h);
            rows += note(
                n,
                format!("rank {rank} (source {s}): combine of token {i:?}"),
            );
        }
        if let Some(f) = c.topology.ffn_index(rank) {
            let w = &want.received[f];
            let Some(rx) = r.received.as_ref() else {
                rows += note(1, format!("rank {rank} (FFN {f}): nothing received"));
                continue;
            };
            rows += note(
                usize::from(rx.plan != w.plan),
                format!("rank {rank} (FFN {f}): the device plan"),
            );
            let (n, i) = row_diff(&rx.expanded, &w.expanded, h);
            rows += note(n, format!("rank {rank} (FFN {f}): expanded row {i:?}"));
            let (n, i) = row_diff(&rx.compact_x, &w.compact_x, h);
            rows += note(n, format!("rank {rank} (FFN {f}): compact row {i:?}"));
            let (n, i) = row_diff(&rx.compact_ids, &w.compact_ids, k);
            rows += note(
                n,
                format!("rank {rank} (FFN {f}): compact ids of row {i:?}"),
            );
            let (n, i) = row_diff(&rx.compact_weights, &w.compact_weights, k);
            rows += note(
                n,
                format!("rank {rank} (FFN {f}): compact weights of row {i:?}"),
            );
            let tokens = |v: &[(u32, u32)]| -> Vec<u64> {
                v.iter()
                    .map(|&(s, t)| (u64::from(s) << 32) | u64::from(t))
                    .collect()
            };
            let (n, i) = row_diff(&tokens(&rx.compact_tokens), &tokens(&w.compact_tokens), 1);
            rows += note(n, format!("rank {rank} (FFN {f}): compact token {i:?}"));
            // fp8: the codes and scales of both views
            match (&rx.fp8, &w.fp8) {
                (None, None) => {}
                (Some(g), Some(w8)) => {
                    let groups = h / afdep_core::fp8::GROUP;
                    let (n, i) = row_diff(&g.expanded_q, &w8.expanded_q, h);
                    rows += note(n, format!("rank {rank} (FFN {f}): expanded codes {i:?}"));
                    let (n, i) = row_diff(&g.expanded_scales, &w8.expanded_scales, groups);
                    rows += note(n, format!("rank {rank} (FFN {f}): expanded scales {i:?}"));
                    let (n, i) = row_diff(&g.compact_q, &w8.compact_q, h);
                    rows += note(n, format!("rank {rank} (FFN {f}): compact codes {i:?}"));
                    let (n, i) = row_diff(&g.compact_scales, &w8.compact_scales, groups);
                    rows += note(n, format!("rank {rank} (FFN {f}): compact scales {i:?}"));
                }
                _ => rows += note(1, format!("rank {rank} (FFN {f}): fp8 views missing")),
            }
        }
    }
    Ok((rows, first))
}

/// One fault's runs on one group (`None`: the control, no fault): `[round][mode][rank]`, the
/// hits of its points (every rank), how long its rounds took.
struct FaultRuns {
    fault: Option<Fault>,
    got: Vec<PerMode>,
    hits: u64,
    took: Duration,
}

/// The results of every mode of one round, `[mode][rank]`.
type PerMode = Vec<Vec<RankResult>>;

/// One group: every rank makes its engine (device rounds prepared), then for each fault in
/// turn (`None`: no fault) sets it (collective), runs every round in every mode (mode by mode, so
/// that consecutive runs never carry the same data), and reads its hits after a barrier; then,
/// unless some rank saw an error, turns faults off and runs the first round once more in every mode
/// (`after`, `[mode][rank]`). `None` after printing `SKIP` without a GPU.
fn run_group_faults(
    c: &ExchangeConfig,
    faults: &[Option<Fault>],
    modes: &[Mode],
    inputs: &[Vec<SourceInput>],
) -> Option<(Vec<FaultRuns>, Option<PerMode>)> {
    let world = c.topology.world_size();
    let g = fused_group(world, c, 16 << 20, TIMEOUT)?;
    type PerRank = (
        Vec<(Vec<Vec<RankResult>>, u64, Duration)>,
        Option<Vec<RankResult>>,
    );
    // engines are dropped only after every rank's thread is done (run_group)
    let outcomes = afdep_moe::run_group(
        g,
        |_, t| -> Result<FusedEngine, ExchangeError> {
            let mut eng = FusedEngine::new(c.clone(), t)?;
            eng.prepare_device(DeviceRoundOptions {
                experts: DeviceExperts::index_scale(c.experts),
                keep_received: true,
            })?;
            Ok(eng)
        },
        |rank, eng| -> Result<PerRank, ExchangeError> {
            let cfg = c;
            let expert = expert_of(None);
            let run = |eng: &mut FusedEngine, m: Mode, inp: &[SourceInput]| {
                let mine = cfg.topology.attention_index(rank).map(|s| &inp[s]);
                match m {
                    Mode::Host(a) => {
                        eng.set_arm(Some(a));
                        eng.round(mine, &expert)
                    }
                    Mode::Device(a) => eng.device_round(a, mine),
                }
            };
            let mut out = Vec::new();
            let mut saw_error = false;
            for &fault in faults {
                eng.set_fault(fault).expect("set_fault");
                let before = eng.fault_hits().expect("fault hits");
                let t0 = Instant::now();
                // mode by mode, every round in turn: no run follows one of the same
                // data, so data a skipped wait reads stale never equals the right data
                let mut by_mode: Vec<Vec<RankResult>> = modes
                    .iter()
                    .map(|&m| inputs.iter().map(|inp| run(eng, m, inp)).collect())
                    .collect();
                let mut got: Vec<Vec<RankResult>> = inputs.iter().map(|_| Vec::new()).collect();
                for per_round in by_mode.iter_mut() {
                    for (i, r) in per_round.drain(..).enumerate() {
                        got[i].push(r);
                    }
                }
                let took = t0.elapsed();
                saw_error |= got.iter().flatten().any(|r| r.is_err());
                // every rank's rounds are done (no kernel waits any more) before the read
                // (a transport that failed in a round counts as an error)
                saw_error = match eng.transport_mut().all_gather(&[u8::from(saw_error)]) {
                    Ok(all) => all.iter().any(|&e| e != 0),
                    Err(_) => true,
                };
                let hits = eng.fault_hits().expect("fault hits") - before;
                out.push((got, hits, took));
            }
            let after = if saw_error {
                None
            } else {
                eng.set_fault(None).expect("set_fault(None)");
                Some(modes.iter().map(|&m| run(eng, m, &inputs[0])).collect())
            };
            Ok((out, after))
        },
    );
    let per_rank: Vec<PerRank> = per_rank(outcomes);
    let mut runs: Vec<FaultRuns> = faults
        .iter()
        .map(|&fault| FaultRuns {
            fault,
            got: (0..inputs.len())
                .map(|_| (0..modes.len()).map(|_| Vec::new()).collect())
                .collect(),
            hits: 0,
            took: Duration::ZERO,
        })
        .collect();
    let mut after: Option<PerMode> = Some((0..modes.len()).map(|_| Vec::new()).collect());
    for (per_fault, rank_after) in per_rank {
        for (fr, (got, hits, took)) in runs.iter_mut().zip(per_fault) {
            fr.hits += hits;
            fr.took = fr.took.max(took);
            for (i, per_mode) in got.into_iter().enumerate() {
                for (m, r) in per_mode.into_iter().enumerate() {
                    fr.got[i][m].push(r);
                }
            }
        }
        match (after.as_mut(), rank_after) {
            (Some(a), Some(ra)) => {
                for (m, r) in ra.into_iter().enumerate() {
                    a[m].push(r);
                }
            }
            _ => after = None,
        }
    }
    Some((runs, after))
}

/// The delays on one ratio: every run exact, every fault fired, the round after them exact.
fn delays_pass(topo: &str, payload: PayloadKind) {
    let _serial = serial();
    let c = config(topo, payload);
    let topo = format!("{topo} {payload}");
    let inputs = rounds(&c, 3);
    // the control first: the same rounds without a fault (a failure there is not a fault's)
    let faults: Vec<Option<Fault>> = std::iter::once(None)
        .chain(Fault::ALL.into_iter().filter(|f| f.must_pass()).map(Some))
        .collect();
    let Some((runs, after)) = run_group_faults(&c, &faults, &ALL_MODES, &inputs) else {
        return;
    };
    let want: Vec<Want> = inputs.iter().map(|i| oracle(&c, i)).collect();
    // every fault's outcome is printed before the test fails, so that one run names them all
    let mut failures = Vec::new();
    for fr in &runs {
        let name = fr
            .fault
            .map_or("none (control)".to_string(), |f| f.to_string());
        let mut bad = Vec::new();
        for (i, per_mode) in fr.got.iter().enumerate() {
            for (m, got) in ALL_MODES.iter().zip(per_mode) {
                match compare(&c, &want[i], got) {
                    Ok((0, _)) => {}
                    Ok((n, first)) => bad.push(format!(
                        "round {i} {m}: {n} rows differ from the oracle (first: {})",
                        first.unwrap_or_default()
                    )),
                    Err((rank, e)) => bad.push(format!("round {i} {m}: rank {rank}: {e}")),
                }
            }
        }
        println!(
            "{topo} fault {name}: {} of {} runs ({} rounds × {} modes) bit-identical to the \
             oracle, {} point firings, {:.2} s{}",
            inputs.len() * ALL_MODES.len() - bad.len(),
            inputs.len() * ALL_MODES.len(),
            inputs.len(),
            ALL_MODES.len(),
            fr.hits,
            fr.took.as_secs_f64(),
            bad.first()
                .map(|b| format!("; first failure: {b}"))
                .unwrap_or_default()
        );
        if let Some(b) = bad.first() {
            failures.push(format!("{name}: {} runs differ, first {b}", bad.len()));
        }
        // a fault's points fired (its module was used); no fault, no firing
        if (fr.hits > 0) != fr.fault.is_some() {
            failures.push(format!("{name}: {} point firings", fr.hits));
        }
    }
    assert!(failures.is_empty(), "{topo}: {}", failures.join("; "));
    let after = after.expect("no rank saw an error, so the rounds after the faults ran");
    for (m, got) in ALL_MODES.iter().zip(&after) {
        let r = compare(&c, &want[0], got);
        assert!(
            matches!(r, Ok((0, _))),
            "{topo}: the round after the faults, {m}: {r:?}"
        );
    }
}

/// A skipping fault on each ratio: at least one round of its exposed modes is caught by the
/// oracle comparison (mismatching rows or a typed error); prints what each mode saw.
fn skip_is_caught(fault: Fault) {
    assert!(!fault.must_pass());
    let _serial = serial();
    let modes = exposed_modes(fault);
    for topo in ["3A:1F", "2A:2F"] {
        let c = config(topo, PayloadKind::Bf16);
        let inputs = rounds(&c, 4);
        let Some((runs, after)) = run_group_faults(&c, &[Some(fault)], &modes, &inputs) else {
            return;
        };
        let want: Vec<Want> = inputs.iter().map(|i| oracle(&c, i)).collect();
        let fr = &runs[0];
        let mut caught = 0;
        for (m, mode) in modes.iter().enumerate() {
            let (mut bad, mut rows, mut errors) = (0, 0, 0);
            let mut first = None;
            for (i, per_mode) in fr.got.iter().enumerate() {
                match compare(&c, &want[i], &per_mode[m]) {
                    Ok((0, _)) => {}
                    Ok((n, f)) => {
                        bad += 1;
                        rows += n;
                        first = first.or(f.map(|f| format!("round {i}: {f}")));
                    }
                    // a bounded wait that ran out is a typed catch too; any other error is not
                    // what a skipped wait does
                    Err((rank, e @ ExchangeError::DeviceTimeout { .. })) => {
                        bad += 1;
                        errors += 1;
                        first = first.or(Some(format!("round {i}: rank {rank}: {e}")));
                    }
                    Err((rank, e)) => {
                        panic!("{topo} fault {fault}, {mode}: round {i}: rank {rank}: {e}")
                    }
                }
            }
            println!(
                "{topo} fault {fault}, {mode}: {bad} of {} rounds caught ({rows} mismatching \
                 rows, {errors} typed errors){}",
                inputs.len(),
                first.map(|f| format!("; first: {f}")).unwrap_or_default()
            );
            caught += bad;
        }
        println!(
            "{topo} fault {fault}: {} point firings, {:.2} s; {}",
            fr.hits,
            fr.took.as_secs_f64(),
            match &after {
                Some(_) => "no typed error, the round after it ran",
                None => "a typed error closed the engines",
            }
        );
        // the fault-built modules ran (the points counted); the skip's effect is `caught` below
        assert!(fr.hits > 0, "{topo} fault {fault}: its points never fired");
        assert!(
            caught > 0,
            "{topo} fault {fault}: no round of {} in {modes:?} differed from the oracle: the \
             checks did not see the skipped wait",
            inputs.len()
        );
        // with the fault off again the same engines are exact (the mismatches were the fault's)
        if let Some(after) = after {
            for (m, got) in modes.iter().zip(&after) {
                let r = compare(&c, &want[0], got);
                assert!(
                    matches!(r, Ok((0, _))),
                    "{topo} fault {fault}: the round after it, {m}: {r:?}"
                );
            }
        }
    }
}

#[test]
fn delays_leave_every_round_bit_identical_3a1f() {
    delays_pass("3A:1F", PayloadKind::Bf16);
}

#[test]
fn delays_leave_every_round_bit_identical_2a2f() {
    delays_pass("2A:2F", PayloadKind::Bf16);
}

/// fp8 payloads (quantised while stored: the same fault-built modules, their fp8 kernels).
#[test]
fn delays_leave_every_round_bit_identical_3a1f_fp8() {
    delays_pass("3A:1F", PayloadKind::Fp8E4m3);
}

#[test]
fn n2_streaming_epilogue_without_row_waits_is_caught() {
    skip_is_caught(Fault::SkipRowWait);
}

#[test]
fn n3_source_arm_without_offsets_wait_is_caught() {
    skip_is_caught(Fault::SkipOffsetWait);
}

#[test]
fn combine_without_flag_wait_is_caught() {
    skip_is_caught(Fault::SkipCombineWait);
}

#[test]
fn epilogue_without_dispatch_wait_is_caught() {
    skip_is_caught(Fault::SkipDispatchWait);
}

/// A start gate that never opens (`StartGate::set_never_open`): after gated replays that open
/// (of a graph captured without the gate, then of one that holds the gate's kernel), every
/// rank's gated replay returns [`ExchangeError::DeviceTimeout`] of the phase `start gate`
/// naming rank 0, the opener, and the ticket as the round, within the bound, and no rank hangs.
#[test]
fn a_start_gate_that_never_opens_is_a_device_timeout_on_every_rank() {
    let _serial = serial();
    let c = config("3A:1F", PayloadKind::Bf16);
    let bound = Duration::from_secs(2);
    let Some(g) = fused_group(c.topology.world_size(), &c, 16 << 20, bound) else {
        return;
    };
    let gate = StartGate::new();
    let inp = &rounds(&c, 1)[0];
    // engines and graphs are dropped after every rank's thread is done
    type Kept = (FusedEngine, FusedGraph, FusedGraph);
    type Outcome = (Result<RoundOutput, ExchangeError>, Duration);
    let (outcomes, kept): (Vec<Outcome>, Vec<Kept>) = std::thread::scope(|sc| {
        let hs: Vec<_> = g
            .into_iter()
            .enumerate()
            .map(|(rank, t)| {
                let (c, gate) = (c.clone(), gate.clone());
                sc.spawn(move || {
                    let mut eng = FusedEngine::new(c.clone(), t).expect("set-up");
                    eng.prepare_device(DeviceRoundOptions {
                        experts: DeviceExperts::Identity,
                        keep_received: false,
                    })
                    .expect("device buffers");
                    // captured without the gate: a gated replay queues the gate's kernel before it
                    let outside = eng.capture(DispatchArm::CountFirstSource).expect("capture");
                    eng.set_start_gate(Some(gate.clone())).expect("the gate");
                    // captured with the gate: its kernel is the graph's first node
                    let inside = eng.capture(DispatchArm::CountFirstSource).expect("capture");
                    let mine = c.topology.attention_index(rank).map(|s| &inp[s]);
                    // two gated replays that open (tickets 1 and 2), then one that never does
                    eng.replay(&outside, mine).expect("an opened gate");
                    eng.replay(&inside, mine).expect("an opened gate");
                    eng.transport_mut().barrier().expect("barrier");
                    if rank == 0 {
                        gate.set_never_open(true);
                    }
                    eng.transport_mut().barrier().expect("barrier");
                    // only the replay that never opens is timed
                    let t0 = Instant::now();
                    let r = eng.replay(&inside, mine);
                    ((r, t0.elapsed()), (eng, outside, inside))
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().expect("no panic")).unzip()
    });
    for (eng, outside, inside) in kept {
        drop(outside);
        drop(inside);
        drop(eng);
    }
    for (rank, (r, took)) in outcomes.iter().enumerate() {
        match r {
            Err(ExchangeError::DeviceTimeout {
                phase, peer, round, ..
            }) => {
                // the third gated round waits for ticket 3
                assert_eq!((*phase, *peer, *round), ("start gate", 0, 3), "rank {rank}");
            }
            other => panic!("rank {rank}: {other:?} instead of the start gate's timeout"),
        }
        // the gate's bound, then the round's own (bounded) waits and the host barrier
        assert!(
            *took < 4 * bound,
            "rank {rank}: the gate's timeout took {took:?}"
        );
        println!("never-open gate: rank {rank} timed out in {took:?}");
    }
}
