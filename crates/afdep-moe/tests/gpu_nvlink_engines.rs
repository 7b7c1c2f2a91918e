//! The exchange engines over NvlinkIpc in-process ranks on one GPU: the staged engine for every
//! ratio on 2, 3 and 4 ranks (3A:1F, 2A:2F, 1A:3F, EP4, 2A:1F, 1A:2F, EP2, EP3) with uneven
//! ranks, a zero-token rank, a hot expert and masked slots, bit-identical to the oracle; a
//! rejected route fails every rank and the next round works.
//!
//! Without a GPU every test prints `SKIP: <reason>` and passes; with `AFDEP_REQUIRE_GPU=1` a
//! missing GPU fails.

mod exchange_common;

use std::time::Duration;

use afdep_core::ExchangeConfig;
use afdep_core::RouteError;
use afdep_core::oracle::exchange::SourceInput;
use afdep_moe::{ExchangeError, StagedEngine};
use afdep_transport::{NvlinkIpc, NvlinkOptions, TransportError};
use exchange_common::*;

const TIMEOUT: Duration = Duration::from_secs(20);

/// `n` in-process NvlinkIpc ranks on device 0, or `None` after printing `SKIP: <reason>`.
fn nvlink(n: usize) -> Option<Vec<NvlinkIpc>> {
    let opts = NvlinkOptions {
        staging_bytes: 4 << 20,
        workspace_bytes: 4 << 20,
        timeout: TIMEOUT,
    };
    match NvlinkIpc::group_on_device(n, 0, opts) {
        Ok(g) => Some(g),
        Err(TransportError::Unavailable { why, .. }) => {
            if std::env::var("AFDEP_REQUIRE_GPU").is_ok_and(|v| !v.is_empty() && v != "0") {
                panic!("AFDEP_REQUIRE_GPU is set, but NvlinkIpc is unavailable: {why}");
            }
            println!("SKIP: {why}");
            None
        }
        Err(e) => panic!("creating the NvlinkIpc group failed: {e}"),
    }
}

fn staged(
    _rank: usize,
    cfg: ExchangeConfig,
    t: NvlinkIpc,
) -> Result<StagedEngine<NvlinkIpc>, ExchangeError> {
    StagedEngine::new(cfg, t)
}

#[test]
fn staged_over_nvlink_is_bit_identical_to_the_oracle_for_every_ratio() {
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
    for (rank, r) in got[0].iter().enumerate() {
        match r {
            Err(ExchangeError::Route { reporter, error }) => {
                assert_eq!(*reporter, rank);
                assert_eq!(error.to_word(), want.to_word(), "rank {rank}: {error}");
            }
            other => panic!("rank {rank}: expected {want}, got {other:?}"),
        }
    }
    check_round(&c, &good, &got[1], None);
}
