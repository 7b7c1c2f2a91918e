//! The exchange engines over NvlinkIpc in-process ranks on one GPU: the staged engine for every
//! ratio on 2, 3 and 4 ranks (3A:1F, 2A:2F, 1A:3F, EP4, 2A:1F, 1A:2F, EP2, EP3) with uneven
//! ranks, a zero-token rank, a hot expert and masked slots, bit-identical to the oracle; a
//! rejected route fails every rank and the next round works. The same for the fused engine
//! (`FusedEngine::round`: a device round whose experts run on the host; the arm the rule picks
//! on the device, payload-first for these small rounds), which must also equal the staged
//! engine bit for bit, also with phase timing on (device times after every round, none after a
//! rejected one). bf16 combine partials in every arm: bit-identical to the oracle with bf16
//! partials and within the bound of the exact one.
//!
//! Without a GPU every test prints `SKIP: <reason>` and passes; with `AFDEP_REQUIRE_GPU=1` a
//! missing GPU fails.

mod exchange_common;

use std::time::Duration;

use afdep_core::ExchangeConfig;
use afdep_core::RouteError;
use afdep_core::oracle::exchange::SourceInput;
use afdep_moe::{ExchangeEngine, ExchangeError, FusedEngine};
use afdep_transport::{NvlinkIpc, NvlinkOptions};
use exchange_common::*;

const TIMEOUT: Duration = Duration::from_secs(20);

/// `n` in-process NvlinkIpc ranks on device 0, or `None` after printing `SKIP: <reason>`.
fn nvlink(n: usize) -> Option<Vec<NvlinkIpc>> {
    let opts = NvlinkOptions {
        staging_bytes: 4 << 20,
        workspace_bytes: 4 << 20,
        timeout: TIMEOUT,
    };
    nvlink_group(n, opts)
}

#[test]
fn staged_over_nvlink_is_bit_identical_to_the_oracle_for_every_ratio() {
    let _serial = serial();
    for topo in [
        "3A:1F", "2A:2F", "1A:3F", "EP4", "2A:1F", "1A:2F", "EP2", "EP3",
    ] {
        let c = cfg(topo, 24, 12, 3);
        let p = params(&c, 8, 5);
        let rounds = every_ratio_rounds(&c);
        let Some(g) = nvlink(c.topology.world_size()) else {
            return;
        };
        let got = run_group(
            g,
            &vec![c.clone(); c.topology.world_size()],
            &rounds,
            Some(&p),
            &staged,
        )
        .unwrap_or_else(|e| panic!("{topo}: set-up failed: {e:?}"));
        for (inp, g) in rounds.iter().zip(&got) {
            check_round(&c, inp, g, Some(&p));
        }
    }
}

#[test]
fn staged_over_nvlink_rejects_a_route_on_every_rank_and_goes_on() {
    let _serial = serial();
    let c = cfg("3A:1F", 16, 8, 2);
    let mut bad = sources(&c, &[4, 3, 5], None, 3);
    // a duplicate expert in token 1 of source 2
    bad[2].routes.idx[2] = 3;
    bad[2].routes.idx[3] = 3;
    let want = RouteError::Duplicate {
        rank: 2,
        token: 1,
        slot: 1,
        expert: 3,
        first_slot: 0,
    };
    let good = sources(&c, &[3, 0, 5], Some(2), 12);
    let rounds: Vec<Vec<SourceInput>> = vec![bad, good.clone()];
    let Some(g) = nvlink(4) else {
        return;
    };
    let got = run_group(g, &vec![c.clone(); 4], &rounds, None, &staged).unwrap();
    check_route_errors(&got[0], "", &want, |rank, error| {
        assert_eq!(error.to_word(), want.to_word(), "rank {rank}: {error}");
    });
    check_round(&c, &good, &got[1], None);
}

#[test]
fn fused_is_bit_identical_to_the_oracle_and_the_staged_engine_for_every_ratio() {
    let _serial = serial();
    for topo in [
        "3A:1F", "2A:2F", "1A:3F", "EP4", "2A:1F", "1A:2F", "EP2", "EP3",
    ] {
        let c = cfg(topo, 24, 12, 3);
        assert!(FusedEngine::workspace_bytes(&c) <= 4 << 20);
        let p = params(&c, 8, 5);
        let rounds = every_ratio_rounds(&c);
        let world = c.topology.world_size();
        let Some(g) = nvlink(world) else {
            return;
        };
        let got = run_group(g, &vec![c.clone(); world], &rounds, Some(&p), &fused)
            .unwrap_or_else(|e| panic!("{topo}: set-up failed: {e:?}"));
        for (inp, g) in rounds.iter().zip(&got) {
            check_round(&c, inp, g, Some(&p));
        }
        let Some(g) = nvlink(world) else {
            return;
        };
        let staged_out = run_group(g, &vec![c.clone(); world], &rounds, Some(&p), &staged)
            .unwrap_or_else(|e| panic!("{topo}: set-up failed: {e:?}"));
        for (i, (a, b)) in got.iter().zip(&staged_out).enumerate() {
            for (rank, (a, b)) in a.iter().zip(b).enumerate() {
                let (a, b) = (a.as_ref().unwrap(), b.as_ref().unwrap());
                assert!(
                    parts(a) == parts(b),
                    "{topo} round {i} rank {rank}: fused != staged"
                );
            }
        }
    }
}

#[test]
fn fused_unplaced_experts_and_odd_hidden() {
    let _serial = serial();
    // hidden 20 (not a multiple of 8: the element-wise copy path), 2 of 3 experts per rank placed
    let mut c = cfg("1A:3F", 20, 9, 2);
    c.experts_per_rank = 2;
    c.validate().unwrap();
    let inp = sources(&c, &[9], Some(1), 3);
    let Some(g) = nvlink(4) else {
        return;
    };
    let got = run_group(
        g,
        &vec![c.clone(); 4],
        std::slice::from_ref(&inp),
        None,
        &fused,
    )
    .unwrap();
    check_round(&c, &inp, &got[0], None);
}

#[test]
fn fused_rejects_a_route_on_every_rank_and_goes_on() {
    let _serial = serial();
    let c = cfg("2A:2F", 16, 8, 2);
    let mut bad = sources(&c, &[4, 3], None, 3);
    bad[0].routes.idx[0] = 8; // wide
    let good = sources(&c, &[3, 0], Some(2), 12);
    let rounds: Vec<Vec<SourceInput>> = vec![good.clone(), bad, good.clone()];
    let Some(g) = nvlink(4) else {
        return;
    };
    let got = run_group(g, &vec![c.clone(); 4], &rounds, None, &fused).unwrap();
    check_round(&c, &good, &got[0], None);
    check_route_errors(&got[1], "", &"a wide-id rejection", |rank, error| {
        assert!(
            matches!(
                error,
                RouteError::Wide {
                    rank: 0,
                    token: 0,
                    slot: 0,
                    ..
                }
            ),
            "rank {rank}: {error}"
        );
    });
    check_round(&c, &good, &got[2], None);
}

#[test]
fn fused_rejects_a_too_small_workspace_on_every_rank() {
    let _serial = serial();
    let c = cfg("2A:2F", 64, 8, 2);
    let opts = NvlinkOptions {
        staging_bytes: 1 << 16,
        workspace_bytes: FusedEngine::workspace_bytes(&c) - 1,
        timeout: TIMEOUT,
    };
    let Some(g) = nvlink_group(4, opts) else {
        return;
    };
    let errs = run_group(g, &vec![c.clone(); 4], &[], None, &fused).unwrap_err();
    for (rank, e) in errs.iter().enumerate() {
        match e {
            ExchangeError::Input { rank: r, what } => {
                assert_eq!(*r, rank);
                assert!(what.contains("workspace"), "{what}");
            }
            other => panic!("rank {rank}: {other:?}"),
        }
    }
}

/// bf16 combine partials in rounds with host experts (`FusedEngine::round`) of every arm
/// (payload-first, count-first streaming, the source arm, switching from round to round on the same engines): every round
/// bit-identical to the oracle with bf16 partials (combine and received views), within the
/// bound of the exact (f32-partials) oracle, the same bits as it on one FFN rank and different
/// on several. Uneven ranks, a zero-token rank, one token each, no token at all, a hot expert;
/// the element path (hidden 20) and the 16-byte path at top-8 (hidden 2048); SwiGLU experts on
/// the host.
#[test]
fn fused_bf16_partials_match_the_bf16_oracle_in_every_arm_within_the_bound() {
    let _serial = serial();
    for (topo, hidden, experts, k) in [
        ("3A:1F", 24, 12, 3),
        ("2A:2F", 24, 12, 3),
        ("1A:3F", 24, 12, 3),
        ("EP4", 24, 12, 3),
        ("2A:2F", 20, 12, 2),
        ("3A:1F", 2048, 16, 8),
        ("2A:2F", 2048, 16, 8),
    ] {
        let c = bf16_partials(cfg(topo, hidden, experts, k));
        let p = params(&c, 8, 5);
        let rounds = every_ratio_rounds(&c);
        let Some(g) = fused_group(c.topology.world_size(), &c, 16 << 20, TIMEOUT) else {
            return;
        };
        let got = run_arms_on(g, &c, &rounds, &FORCED, Some(&p));
        let mut differing = 0;
        for (i, (inp, per_arm)) in rounds.iter().zip(&got).enumerate() {
            for (arm, g) in FORCED.iter().zip(per_arm) {
                for (rank, r) in g.iter().enumerate() {
                    if let Err(e) = r {
                        panic!("{topo} hidden {hidden} round {i} {arm:?} rank {rank}: {e}");
                    }
                }
                check_round(&c, inp, g, Some(&p));
                differing += check_partials_bound(&c, inp, g, expert_of(Some(&p)));
            }
        }
        check_partials_took_effect(&c, differing);
    }
}

/// One rank that is both source and FFN rank (EP1): every flag is raised and awaited on the
/// same stream, so this one also runs under compute-sanitizer (which serialises kernels, so the
/// multi-rank tests' cross-stream waits would run out there).
#[test]
fn fused_single_rank_ep1() {
    let _serial = serial();
    let c = cfg("EP1", 24, 12, 3);
    let p = params(&c, 8, 5);
    let rounds = every_ratio_rounds(&c);
    let Some(g) = nvlink(1) else {
        return;
    };
    let got = run_group(g, std::slice::from_ref(&c), &rounds, Some(&p), &fused).unwrap();
    for (inp, g) in rounds.iter().zip(&got) {
        check_round(&c, inp, g, Some(&p));
    }
}

/// A fused engine with phase timing on that checks, after every successful round, that the
/// round's device times were taken.
struct Timed(FusedEngine);

impl ExchangeEngine for Timed {
    fn rank(&self) -> usize {
        self.0.rank()
    }
    fn barrier(&mut self) -> Result<(), afdep_transport::TransportError> {
        afdep_transport::Transport::barrier(self.0.transport_mut())
    }
    fn all_gather(&mut self, mine: &[u8]) -> Result<Vec<u8>, afdep_transport::TransportError> {
        afdep_transport::Transport::all_gather(self.0.transport_mut(), mine)
    }
    fn round(
        &mut self,
        input: Option<&SourceInput>,
        expert: &dyn afdep_moe::ExpertFn,
    ) -> RankResult {
        let r = self.0.round(input, expert);
        match &r {
            Ok(_) => {
                let t = self
                    .0
                    .last_device_times()
                    .expect("phase timing on: device times after every round");
                assert!(
                    t.dispatch > Duration::ZERO && t.combine > Duration::ZERO,
                    "rank {}: {t:?}",
                    self.0.rank()
                );
            }
            Err(_) => assert!(self.0.last_device_times().is_none()),
        }
        r
    }
}

#[test]
fn fused_with_phase_timing_is_bit_identical_and_times_every_round() {
    let _serial = serial();
    for topo in ["3A:1F", "2A:2F", "EP4", "1A:2F"] {
        let c = cfg(topo, 24, 12, 3);
        let p = params(&c, 8, 5);
        let mut rounds = every_ratio_rounds(&c);
        // and a rejected round in the middle: no times, the next round timed again
        let mut bad = rounds[0].clone();
        let s = bad.iter().position(|i| i.routes.tokens > 0).unwrap();
        bad[s].routes.idx[0] = c.experts as i32;
        rounds.insert(1, bad);
        let world = c.topology.world_size();
        let Some(g) = nvlink(world) else {
            return;
        };
        let timed = |_rank: usize, cfg: ExchangeConfig, t: NvlinkIpc| {
            let mut e = FusedEngine::new(cfg, t)?;
            e.set_phase_timing(true)?;
            Ok(Timed(e))
        };
        let got = run_group(g, &vec![c.clone(); world], &rounds, Some(&p), &timed)
            .unwrap_or_else(|e| panic!("{topo}: set-up failed: {e:?}"));
        for (i, (inp, g)) in rounds.iter().zip(&got).enumerate() {
            if i == 1 {
                for (rank, r) in g.iter().enumerate() {
                    assert!(
                        matches!(r, Err(ExchangeError::Route { .. })),
                        "{topo} rank {rank}: {r:?}"
                    );
                }
                continue;
            }
            check_round(&c, inp, g, Some(&p));
        }
    }
}
