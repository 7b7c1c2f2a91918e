//! The fused engine's refusals, eager, on in-process NvlinkIpc ranks on one GPU: every rejected
//! route class of docs/design.md, "Specification: Routes" (dummy, duplicate, negative, wide, a
//! non-finite weight, more tokens than the capacity) in every dispatch arm (payload-first,
//! count-first, the source arm) fails every rank with the same typed error naming the rejecting
//! rank, token, slot and value, and the next round of the same engines is bit-identical to the
//! oracle; a rank whose exchange configuration differs (a knob, the payload) fails set-up on every
//! rank, naming the field.
//!
//! Without a GPU every test prints `SKIP: <reason>` and passes; with `AFDEP_REQUIRE_GPU=1` a
//! missing GPU fails.

mod exchange_common;

use std::time::Duration;

use afdep_core::oracle::exchange::SourceInput;
use afdep_core::{ConfigError, ExchangeConfig, PayloadKind, RouteError};
use afdep_moe::{DispatchArm, ExchangeError, FusedEngine};
use afdep_transport::{NvlinkIpc, NvlinkOptions};
use exchange_common::*;

const TIMEOUT: Duration = Duration::from_secs(20);

const ARMS: [DispatchArm; 3] = [
    DispatchArm::PayloadFirst,
    DispatchArm::CountFirst,
    DispatchArm::CountFirstSource,
];

/// One offence: what to do to a good round, and the error every rank must report.
struct Offence {
    name: &'static str,
    spoil: fn(&mut [SourceInput], &ExchangeConfig),
    check: fn(&RouteError) -> bool,
}

fn offences() -> Vec<Offence> {
    vec![
        Offence {
            name: "dummy",
            // experts 12..18 exist but no FFN rank owns them (3 FFN ranks × 4 placed)
            spoil: |s, _| s[1].routes.idx[2 * 3 + 1] = 13,
            check: |e| {
                matches!(
                    e,
                    RouteError::Dummy {
                        rank: 1,
                        token: 2,
                        slot: 1,
                        value: 13,
                        ..
                    }
                )
            },
        },
        Offence {
            name: "duplicate",
            spoil: |s, _| {
                let r = &mut s[0].routes;
                r.idx[3 * 3] = 4;
                r.idx[3 * 3 + 2] = 4;
                r.idx[3 * 3 + 1] = 5;
            },
            check: |e| {
                matches!(
                    e,
                    RouteError::Duplicate {
                        rank: 0,
                        token: 3,
                        slot: 2,
                        expert: 4,
                        first_slot: 0
                    }
                )
            },
        },
        Offence {
            name: "negative",
            spoil: |s, _| s[2].routes.idx[0] = -7,
            check: |e| {
                matches!(
                    e,
                    RouteError::Negative {
                        rank: 2,
                        token: 0,
                        slot: 0,
                        value: -7
                    }
                )
            },
        },
        Offence {
            name: "wide",
            spoil: |s, c| s[1].routes.idx[4 * 3 + 2] = c.experts as i32,
            check: |e| {
                matches!(
                    e,
                    RouteError::Wide {
                        rank: 1,
                        token: 4,
                        slot: 2,
                        value: 18,
                        ..
                    }
                )
            },
        },
        Offence {
            name: "non-finite weight",
            spoil: |s, _| {
                let r = &mut s[0].routes;
                let i = (0..r.idx.len()).find(|&i| r.idx[i] >= 0).unwrap();
                r.weights[i] = f32::NAN;
            },
            check: |e| matches!(e, RouteError::NonFiniteWeight { rank: 0, .. }),
        },
        Offence {
            name: "over capacity",
            spoil: |s, c| {
                let t = c.capacity + 1;
                s[2] = sources(c, &[0, 0, t], None, 77).pop().unwrap();
            },
            check: |e| matches!(e, RouteError::OverCapacity { rank: 2, .. }),
        },
    ]
}

/// 3A:3F: three sources (so three ranks can offend) and three FFN ranks owning 4 experts each
/// of 18 (12..18 unplaced: dummy ids).
fn reject_cfg() -> ExchangeConfig {
    let mut c = cfg("3A:3F", 48, 18, 3);
    c.experts_per_rank = 4;
    c.validate().unwrap();
    c
}

/// The offences as the oracle sees them (no GPU needed): each is rejected with exactly the
/// error the GPU test expects, so that test checks what it claims.
#[test]
fn the_offences_are_what_the_oracle_rejects() {
    let c = reject_cfg();
    for o in offences() {
        let mut bad = sources(&c, &[7, 8, 5], None, 21);
        (o.spoil)(&mut bad, &c);
        let e = afdep_core::oracle::exchange::validate_sources(&c, &bad).expect_err(o.name);
        assert!((o.check)(&e), "{}: the oracle reports {e}", o.name);
    }
}

#[test]
fn every_rejected_route_class_in_every_arm_fails_every_rank_and_the_next_round_works() {
    let _serial = serial();
    let c = reject_cfg();
    let good = sources(&c, &[9, 6, 0], Some(2), 5);
    let good2 = sources(&c, &[1, 13, 4], None, 6);
    let offs = offences();
    let mut rounds = vec![good.clone()];
    for o in &offs {
        let mut bad = sources(&c, &[7, 8, 5], None, 21);
        (o.spoil)(&mut bad, &c);
        rounds.push(bad);
        rounds.push(good2.clone());
    }
    for arm in ARMS {
        let Some(g) = fused_group(c.topology.world_size(), &c, 8 << 20, TIMEOUT) else {
            return;
        };
        let make = move |_rank: usize, cfg: ExchangeConfig, t: NvlinkIpc| {
            let mut e = FusedEngine::new(cfg, t)?;
            e.set_arm(Some(arm));
            Ok(e)
        };
        let got = run_group(g, &vec![c.clone(); 6], &rounds, None, &make)
            .unwrap_or_else(|e| panic!("{arm}: set-up failed: {e:?}"));
        check_round(&c, &good, &got[0], None);
        for (i, o) in offs.iter().enumerate() {
            for (rank, r) in got[1 + 2 * i].iter().enumerate() {
                match r {
                    Err(ExchangeError::Route { reporter, error }) => {
                        assert_eq!(*reporter, rank, "{arm}, {}", o.name);
                        assert!(
                            (o.check)(error),
                            "{arm}, {}: rank {rank} reported {error}",
                            o.name
                        );
                    }
                    other => panic!(
                        "{arm}, {}: rank {rank} expected a rejection, got {other:?}",
                        o.name
                    ),
                }
            }
            // the engines go on: the next round is exact
            check_round(&c, &good2, &got[2 + 2 * i], None);
        }
        println!(
            "{arm}: {} rejected classes, every rank, then exact rounds",
            offs.len()
        );
    }
}

#[test]
fn a_rank_whose_config_differs_fails_set_up_on_every_rank() {
    let _serial = serial();
    let c = cfg("2A:2F", 128, 8, 2);
    let mut knob = c.clone();
    knob.knobs.transport_sms = 23;
    let mut payload = c.clone();
    payload.payload = PayloadKind::Fp8E4m3;
    for (other, field) in [(knob, "knobs.transport_sms"), (payload, "payload")] {
        let mut cfgs = vec![c.clone(); 4];
        cfgs[3] = other.clone();
        let bytes = FusedEngine::workspace_bytes(&c).max(FusedEngine::workspace_bytes(&other));
        let opts = NvlinkOptions {
            staging_bytes: 1 << 20,
            workspace_bytes: bytes,
            timeout: TIMEOUT,
        };
        let Some(g) = nvlink_group(4, opts) else {
            return;
        };
        let make = |_rank: usize, cfg: ExchangeConfig, t: NvlinkIpc| FusedEngine::new(cfg, t);
        let errs = run_group(g, &cfgs, &[], None, &make).unwrap_err();
        for (rank, e) in errs.iter().enumerate() {
            match e {
                ExchangeError::Config(ConfigError::Mismatch {
                    field: f,
                    local_rank,
                    remote_rank,
                    ..
                }) => {
                    assert_eq!(f, field, "rank {rank}");
                    assert_eq!(*local_rank, rank);
                    assert_eq!(*remote_rank, if rank == 3 { 0 } else { 3 });
                }
                other => panic!("{field}: rank {rank}: {other:?}"),
            }
        }
    }
}
