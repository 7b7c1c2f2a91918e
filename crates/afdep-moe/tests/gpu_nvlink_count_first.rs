//! Count-first dispatch of the fused engine over NvlinkIpc in-process ranks on one GPU: every
//! arm ([`DispatchArm`]: payload-first, count-first with the streaming epilogue, the source
//! arm) bit-identical to the oracle (combine, expanded layout, compact view, and the plan the
//! device computed) and to the staged engine, on 1, 2, 3 and 4 ranks (3A:1F, 2A:2F, 1A:3F,
//! EP4, 2A:1F, 1A:2F, EP2, EP3, EP1); hidden 2048, 7168 and 8192 with capacities 2048 and 256;
//! transport SM budgets 7, 23, 24 and every knob at a non-default value; uneven ranks, a
//! zero-token rank, a hot expert, masked slots; the arm rule of `min_token_bucket` (bf16 and
//! fp8 payloads); arms switching from round to round; repeated seeds with identical output
//! hashes; a rejected route in a count-first round; ranks that disagree on the arm skip the
//! round with a typed error, no hang; every arm with the front kernels on (`set_fronts`, off
//! by default). (fp8 in every arm: `gpu_nvlink_fp8`.)
//!
//! Every engine runs all arms in turn on the same inputs (one group per configuration), so the
//! round-numbered flags of one arm must never satisfy another arm's waits.
//!
//! Without a GPU every test prints `SKIP: <reason>` and passes; with `AFDEP_REQUIRE_GPU=1` a
//! missing GPU fails.

mod exchange_common;

use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};
use std::time::{Duration, Instant};

use afdep_core::oracle::exchange::SourceInput;
use afdep_core::{ExchangeConfig, PayloadKind};
use afdep_moe::{DispatchArm, ExchangeEngine, ExchangeError, ExpertFn, FusedEngine, RoundArm};
use afdep_transport::NvlinkIpc;
use exchange_common::*;

const TIMEOUT: Duration = Duration::from_secs(20);

/// Runs `rounds`, each once per arm of `arms` in turn (round-major), on one fused group.
/// Returns `[round][arm][rank]`.
fn run_arms(
    c: &ExchangeConfig,
    rounds: &[Vec<SourceInput>],
    arms: &[Option<DispatchArm>],
    p: Option<&afdep_core::oracle::LayerParams>,
) -> Option<Vec<Vec<Vec<RankResult>>>> {
    let g = fused_group(c.topology.world_size(), c, 128 << 20, TIMEOUT)?;
    Some(run_arms_on(g, c, rounds, arms, p))
}

fn staged_rounds(
    c: &ExchangeConfig,
    rounds: &[Vec<SourceInput>],
    p: Option<&afdep_core::oracle::LayerParams>,
) -> Option<Vec<Vec<RankResult>>> {
    let world = c.topology.world_size();
    let g = fused_group(world, c, 128 << 20, TIMEOUT)?;
    Some(
        run_group(g, &vec![c.clone(); world], rounds, p, &staged)
            .unwrap_or_else(|e| panic!("{}: staged set-up failed: {e:?}", c.topology)),
    )
}

/// A hash of everything engines must agree on in one rank's round output.
fn hash_of(r: &RankResult) -> u64 {
    let r = r.as_ref().unwrap_or_else(|e| panic!("{e}"));
    let mut h = DefaultHasher::new();
    if let Some(c) = &r.combined {
        h.write(bytemuck::cast_slice(c));
    }
    if let Some(rx) = &r.received {
        rx.plan.counts.hash(&mut h);
        rx.plan.expert_offsets.hash(&mut h);
        rx.plan.block_starts.hash(&mut h);
        rx.plan.slab_offsets.hash(&mut h);
        h.write(bytemuck::cast_slice(&rx.expanded));
        rx.compact_tokens.hash(&mut h);
        h.write(bytemuck::cast_slice(&rx.compact_x));
        rx.compact_ids.hash(&mut h);
        h.write(bytemuck::cast_slice(&rx.compact_weights));
    }
    h.finish()
}

/// Runs `rounds` with every forced arm and checks them ([`check_arms`]) against the staged
/// engine's `staged`; `false` when there is no GPU (the test returns).
fn forced_arms_match(
    what: &str,
    c: &ExchangeConfig,
    rounds: &[Vec<SourceInput>],
    staged: &[Vec<RankResult>],
    p: Option<&afdep_core::oracle::LayerParams>,
) -> bool {
    let Some(got) = run_arms(c, rounds, &FORCED, p) else {
        return false;
    };
    check_arms(what, c, rounds, &got, staged, &FORCED, p);
    true
}

/// Checks every arm's rounds against the oracle and the staged engine's rounds.
fn check_arms(
    what: &str,
    c: &ExchangeConfig,
    rounds: &[Vec<SourceInput>],
    got: &[Vec<Vec<RankResult>>],
    staged: &[Vec<RankResult>],
    arms: &[Option<DispatchArm>],
    p: Option<&afdep_core::oracle::LayerParams>,
) {
    for (i, ((inp, per_arm), st)) in rounds.iter().zip(got).zip(staged).enumerate() {
        for (arm, g) in arms.iter().zip(per_arm) {
            check_round(c, inp, g, p);
            for (rank, (a, b)) in g.iter().zip(st).enumerate() {
                let (a, b) = (a.as_ref().unwrap(), b.as_ref().unwrap());
                assert!(
                    a.combined == b.combined && a.received == b.received,
                    "{what} round {i} arm {arm:?} rank {rank}: fused != staged"
                );
            }
        }
    }
}

#[test]
fn every_arm_is_bit_identical_to_the_oracle_and_the_staged_engine_for_every_ratio() {
    let _serial = serial();
    for topo in [
        "3A:1F", "2A:2F", "1A:3F", "EP4", "2A:1F", "1A:2F", "EP2", "EP3", "EP1",
    ] {
        let c = cfg(topo, 24, 12, 3);
        let p = params(&c, 8, 5);
        let rounds = every_ratio_rounds(&c);
        let Some(st) = staged_rounds(&c, &rounds, Some(&p)) else {
            return;
        };
        if !forced_arms_match(topo, &c, &rounds, &st, Some(&p)) {
            return;
        }
    }
}

/// One rank that is both source and FFN rank (EP1), every arm: every flag is raised and awaited
/// on the same stream, so this test also runs under compute-sanitizer (which serialises kernels,
/// so the multi-rank tests' cross-stream waits would run out there).
#[test]
fn every_arm_on_a_single_rank_ep1() {
    let _serial = serial();
    // 12 experts: every_ratio_rounds' hot experts are 5 and 11
    let c = cfg("EP1", 40, 12, 2);
    let rounds = every_ratio_rounds(&c);
    let Some(got) = run_arms(&c, &rounds, &FORCED, None) else {
        return;
    };
    for (inp, per_arm) in rounds.iter().zip(&got) {
        for g in per_arm {
            check_round(&c, inp, g, None);
        }
    }
}

/// `FusedEngine::round` with the front kernels on (`set_fronts(true)`): off by default since
/// 2026-12-07, so no other test runs `Part::Front` with them. Every forced arm and the rule's
/// (`None`), switching from round to round on the same engines, on ratios whose ranks are
/// single-role (3A:1F, 2A:2F, 1A:3F: a front per rank) and on EP2 (both roles: per phase), each
/// round bit-identical to the oracle.
#[test]
fn host_expert_rounds_with_the_fronts_match_the_oracle() {
    let _serial = serial();
    let arms = [
        None,
        Some(DispatchArm::PayloadFirst),
        Some(DispatchArm::CountFirst),
        Some(DispatchArm::CountFirstSource),
    ];
    for topo in ["3A:1F", "2A:2F", "1A:3F", "EP2"] {
        let c = cfg(topo, 40, 12, 3);
        let rounds = every_ratio_rounds(&c);
        let world = c.topology.world_size();
        let Some(g) = fused_group(world, &c, 128 << 20, TIMEOUT) else {
            return;
        };
        let expanded: Vec<Vec<SourceInput>> = rounds
            .iter()
            .flat_map(|r| std::iter::repeat_n(r.clone(), arms.len()))
            .collect();
        let make = |_rank: usize, cfg: ExchangeConfig, t: NvlinkIpc| {
            let mut eng = FusedEngine::new(cfg, t)?;
            eng.set_fronts(true);
            Ok(Cycling {
                eng,
                arms: arms.to_vec(),
                ran: Vec::new(),
            })
        };
        let got = run_group(g, &vec![c.clone(); world], &expanded, None, &make)
            .unwrap_or_else(|e| panic!("{topo}: set-up failed: {e:?}"));
        for (i, (inp, g)) in expanded.iter().zip(&got).enumerate() {
            println!("{topo} round {i} (arm {:?})", arms[i % arms.len()]);
            check_round(&c, inp, g, None);
        }
    }
}

/// Hidden 2048, 7168, 8192 with capacities 2048 and 256 on the four 4-rank ratios: two rounds
/// each (uneven with a zero-token rank and a hot expert; then other counts), every arm.
#[test]
fn every_arm_at_large_hidden_and_both_capacities() {
    let _serial = serial();
    for (hidden, cap, topos) in [
        (2048, 2048, &["3A:1F", "2A:2F", "1A:3F", "EP4"][..]),
        (2048, 256, &["3A:1F", "1A:3F"][..]),
        (7168, 2048, &["3A:1F", "2A:2F", "1A:3F", "EP4"][..]),
        (7168, 256, &["2A:2F", "EP4"][..]),
        (8192, 2048, &["3A:1F", "1A:3F"][..]),
        (8192, 256, &["2A:2F"][..]),
    ] {
        for topo in topos {
            let t0 = Instant::now();
            let mut c = cfg(topo, hidden, 24, 4);
            c.capacity = cap;
            c.validate().unwrap();
            let a = c.topology.attention_count();
            let rounds = vec![
                sources(&c, &[250, 0, 131, 9][..a], Some(7), 21),
                sources(&c, &[3, 256, 0, 64][..a], Some(2), 22),
            ];
            let Some(st) = staged_rounds(&c, &rounds, None) else {
                return;
            };
            let what = format!("{topo} hidden {hidden} capacity {cap}");
            if !forced_arms_match(&what, &c, &rounds, &st, None) {
                return;
            }
            println!(
                "{topo} hidden {hidden} capacity {cap}: {:.2} s",
                t0.elapsed().as_secs_f64()
            );
        }
    }
}

/// Transport SM budgets 7, 23, 24 and every knob at non-default values, all arms.
#[test]
fn every_arm_under_sm_budgets_and_knobs() {
    let _serial = serial();
    for topo in ["3A:1F", "1A:3F", "EP3"] {
        let base = {
            let mut c = cfg(topo, 2048, 24, 6);
            c.capacity = 256;
            c
        };
        let a = base.topology.attention_count();
        let rounds = vec![
            sources(&base, &[97, 0, 200][..a], Some(3), 31),
            sources(&base, &[1, 33, 5][..a], None, 32),
        ];
        let Some(st) = staged_rounds(&base, &rounds, None) else {
            return;
        };
        type Knob = fn(&mut afdep_core::ExchangeKnobs);
        let variants: [(&str, Knob); 9] = [
            ("transport_sms 7", |k| k.transport_sms = 7),
            ("transport_sms 23", |k| k.transport_sms = 23),
            ("transport_sms 24", |k| k.transport_sms = 24),
            ("epilogue_sm_cap 1", |k| k.epilogue_sm_cap = 1),
            ("epilogue_sm_cap 3, min_rows 1", |k| {
                k.epilogue_sm_cap = 3;
                k.min_rows_per_unit = 1
            }),
            ("warps_per_unit 1", |k| k.warps_per_unit = 1),
            ("warps_per_unit 32, min_rows 1000", |k| {
                k.warps_per_unit = 32;
                k.min_rows_per_unit = 1000
            }),
            ("warps_per_unit 3, min_rows 5", |k| {
                k.warps_per_unit = 3;
                k.min_rows_per_unit = 5
            }),
            ("payload gate off, 7 SMs", |k| {
                k.payload_gate = false;
                k.transport_sms = 7
            }),
        ];
        for (what, set) in variants {
            let mut c = base.clone();
            set(&mut c.knobs);
            c.validate().unwrap();
            if !forced_arms_match(&format!("{topo} {what}"), &c, &rounds, &st, None) {
                return;
            }
        }
    }
}

/// `min_token_bucket`: a round whose largest source has fewer tokens runs payload-first, one
/// that reaches it runs count-first (the source arm); both correct. The same rule for bf16 and fp8
/// payloads.
#[test]
fn the_token_bucket_selects_the_arm() {
    let _serial = serial();
    for payload in [PayloadKind::Bf16, PayloadKind::Fp8E4m3] {
        let mut c = cfg("2A:2F", 128, 8, 2);
        c.knobs.min_token_bucket = 10;
        c.payload = payload;
        c.validate().unwrap();
        let rounds = vec![
            sources(&c, &[9, 3], Some(1), 41),
            sources(&c, &[2, 10], None, 42),
            sources(&c, &[0, 0], None, 43),
            sources(&c, &[40, 11], Some(4), 44),
        ];
        assert_eq!(DispatchArm::select(&c.knobs, 9), DispatchArm::PayloadFirst);
        assert_eq!(
            DispatchArm::select(&c.knobs, 10),
            DispatchArm::CountFirstSource
        );
        let world = c.topology.world_size();
        let Some(g) = fused_group(world, &c, 128 << 20, TIMEOUT) else {
            return;
        };
        let ran = std::sync::Mutex::new(Vec::new());
        let make = |rank: usize, cfg: ExchangeConfig, t: NvlinkIpc| {
            Ok(Recording {
                eng: FusedEngine::new(cfg, t)?,
                rank,
                ran: &ran,
            })
        };
        let got = run_group(g, &vec![c.clone(); world], &rounds, None, &make).unwrap();
        for (inp, g) in rounds.iter().zip(&got) {
            check_round(&c, inp, g, None);
            for (rank, r) in g.iter().enumerate() {
                let rx = r.as_ref().unwrap().received.as_ref();
                assert_eq!(
                    rx.map(|rx| rx.fp8.is_some()),
                    c.topology
                        .ffn_index(rank)
                        .map(|_| payload == PayloadKind::Fp8E4m3),
                    "{payload} rank {rank}"
                );
            }
        }
        let ran = ran.into_inner().unwrap();
        for rank in 0..world {
            let arms: Vec<DispatchArm> = ran
                .iter()
                .filter(|(r, _)| *r == rank)
                .map(|(_, a)| *a)
                .collect();
            assert_eq!(
                arms,
                [
                    DispatchArm::PayloadFirst,
                    DispatchArm::CountFirstSource,
                    DispatchArm::PayloadFirst,
                    DispatchArm::CountFirstSource
                ],
                "{payload} rank {rank}"
            );
        }
    }
}

/// A fused engine with the knob's rule that records (rank, arm) per round.
struct Recording<'a> {
    eng: FusedEngine,
    rank: usize,
    ran: &'a std::sync::Mutex<Vec<(usize, DispatchArm)>>,
}

impl ExchangeEngine for Recording<'_> {
    fn rank(&self) -> usize {
        self.rank
    }
    fn barrier(&mut self) -> Result<(), afdep_transport::TransportError> {
        afdep_transport::Transport::barrier(self.eng.transport_mut())
    }
    fn all_gather(&mut self, mine: &[u8]) -> Result<Vec<u8>, afdep_transport::TransportError> {
        afdep_transport::Transport::all_gather(self.eng.transport_mut(), mine)
    }
    fn round(&mut self, input: Option<&SourceInput>, expert: &dyn ExpertFn) -> RankResult {
        let r = self.eng.round(input, expert);
        self.ran
            .lock()
            .unwrap()
            .push((self.rank, self.eng.last_arm()));
        r
    }
}

/// One seed rerun many times, every arm, in one group and in a second group: identical hashes
/// everywhere (and equal to the oracle).
#[test]
fn repeated_seeds_give_identical_hashes() {
    let _serial = serial();
    for topo in ["3A:1F", "EP4"] {
        let mut c = cfg(topo, 2048, 24, 6);
        c.capacity = 256;
        let a = c.topology.attention_count();
        let inp = sources(&c, &[120, 0, 77, 5][..a], Some(9), 51);
        let rounds: Vec<Vec<SourceInput>> = vec![inp.clone(); 6];
        let mut hashes: Vec<Vec<u64>> = Vec::new();
        for _group in 0..2 {
            let Some(got) = run_arms(&c, &rounds, &FORCED, None) else {
                return;
            };
            for per_arm in &got {
                for g in per_arm {
                    hashes.push(g.iter().map(hash_of).collect());
                }
            }
            check_round(&c, &inp, &got[0][1], None);
        }
        assert!(
            hashes.iter().all(|h| h == &hashes[0]),
            "{topo}: output hashes differ across repeats and arms: {hashes:?}"
        );
    }
}

/// A rejected route in a count-first round fails every rank with the route error (host
/// validation, before anything moves), and the next count-first round is correct.
#[test]
fn count_first_rejects_a_route_on_every_rank_and_goes_on() {
    let _serial = serial();
    let c = cfg("3A:1F", 32, 8, 2);
    let mut bad = sources(&c, &[4, 3, 5], None, 61);
    bad[1].routes.idx[1] = -2; // negative
    let good = sources(&c, &[3, 0, 5], Some(2), 62);
    let rounds = vec![good.clone(), bad, good.clone()];
    let arms = [
        Some(DispatchArm::CountFirstSource),
        Some(DispatchArm::CountFirst),
    ];
    let Some(got) = run_arms(&c, &rounds, &arms, None) else {
        return;
    };
    for per_arm in [&got[0], &got[2]] {
        for g in per_arm {
            check_round(&c, &good, g, None);
        }
    }
    for g in &got[1] {
        check_route_errors(g, "", &"a negative-id rejection", |rank, error| {
            assert!(
                matches!(
                    error,
                    afdep_core::RouteError::Negative {
                        rank: 1,
                        token: 0,
                        slot: 1,
                        ..
                    }
                ),
                "rank {rank}: {error}"
            );
        });
    }
}

/// Ranks that disagree on the arm (`set_arm`): every rank skips the round with a typed
/// `ArmsDiffer` naming rank 0's arm and the first rank that differs, at once (the device round's
/// start compares the requests), and the next round, with the arms agreeing, is exact.
#[test]
fn disagreeing_arms_skip_the_round_on_every_rank() {
    let _serial = serial();
    let c = cfg("1A:1F", 32, 4, 2);
    let good = sources(&c, &[6], None, 71);
    let inp = vec![good.clone(), good.clone()];
    // the full bound: round 1 must complete (its source's combine waits on the device while the
    // FFN rank's host experts run), and a round 0 that waited its bound out instead of skipping
    // at once would fail the elapsed check below
    let Some(g) = fused_group(2, &c, 128 << 20, TIMEOUT) else {
        return;
    };
    // round 0: rank 0 payload-first, rank 1 count-first; round 1: both count-first
    let make = |rank: usize, cfg: ExchangeConfig, t: NvlinkIpc| {
        let first = if rank == 0 {
            DispatchArm::PayloadFirst
        } else {
            DispatchArm::CountFirst
        };
        Ok(Cycling {
            eng: FusedEngine::new(cfg, t)?,
            arms: vec![Some(first), Some(DispatchArm::CountFirst)],
            ran: Vec::new(),
        })
    };
    let t0 = Instant::now();
    let got = run_group(g, &vec![c.clone(); 2], &inp, None, &make).unwrap();
    assert!(t0.elapsed() < Duration::from_secs(10), "{:?}", t0.elapsed());
    for (rank, r) in got[0].iter().enumerate() {
        match r {
            Err(ExchangeError::ArmsDiffer {
                rank: r,
                first: RoundArm::Fixed(DispatchArm::PayloadFirst),
                peer: 1,
                other: RoundArm::Fixed(DispatchArm::CountFirst),
            }) if *r == rank => {}
            other => panic!("rank {rank}: expected ArmsDiffer, got {other:?}"),
        }
    }
    check_round(&c, &good, &got[1], None);
}

/// Logs (asserts nothing about speed) the host-observed dispatch phase per arm on 3A:1F,
/// hidden 2048, top-8 of 128 experts, capacity 2048, at 1, 512 and 2048 tokens per source:
/// the median over rounds 2..6 of the slowest rank. Single-GPU rank emulation with host
/// experts and read-backs: protocol overhead, not NVLink, and not device time. Every round is
/// also checked against the oracle.
#[test]
fn log_dispatch_times_per_arm() {
    let _serial = serial();
    let mut c = cfg("3A:1F", 2048, 128, 8);
    c.capacity = 2048;
    for tokens in [1usize, 512, 2048] {
        let inp = sources(&c, &[tokens, tokens, tokens], Some(17), 81);
        let rounds: Vec<Vec<SourceInput>> = vec![inp.clone(); 6];
        let Some(got) = run_arms(&c, &rounds, &FORCED, None) else {
            return;
        };
        for per_arm in &got {
            for g in per_arm {
                check_round(&c, &inp, g, None);
            }
        }
        let mut line = format!("3A:1F hidden 2048 top-8/128, {tokens} tokens per source:");
        for (j, arm) in FORCED.iter().enumerate() {
            let mut us: Vec<f64> = got[1..]
                .iter()
                .map(|per_arm| {
                    per_arm[j]
                        .iter()
                        .map(|r| r.as_ref().unwrap().times.dispatch.as_secs_f64() * 1e6)
                        .fold(0.0, f64::max)
                })
                .collect();
            us.sort_by(f64::total_cmp);
            line.push_str(&format!(
                " {}: {:.0} us",
                arm.expect("forced"),
                us[us.len() / 2]
            ));
        }
        println!("{line}");
    }
}
