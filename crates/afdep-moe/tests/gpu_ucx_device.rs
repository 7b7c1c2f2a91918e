//! UCX with device buffers (features `ucx` and `cuda`): two processes on one GPU run the staged
//! engine (1A:1F) over `DeviceStaged<Ucx>` (device buffers staged through pinned host memory, since the
//! bundled UCX is not CUDA-aware), over UCX's tcp and its shared memory, bit-identical to the
//! oracle, a rejected round included. The test starts itself twice as the two ranks (the
//! environment of `afdep launch`), waits for both with a bound and fails if either does.
//! Without a driver or a GPU it prints `SKIP: <reason>` and passes, unless `AFDEP_REQUIRE_GPU=1`.

mod exchange_common;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use afdep_core::oracle::exchange::{self as reference, SourceInput};
use afdep_core::oracle::layer;
use afdep_core::route::Routes;
use afdep_core::tensor::uniform_bf16;
use afdep_core::{ExchangeConfig, bf16};
use afdep_moe::{ExchangeError, StagedEngine};
use afdep_transport::{
    Bootstrap, DeviceStaged, ENV_RANK, ENV_RENDEZVOUS, ENV_WORLD_SIZE, TransportKind, Ucx,
    UcxOptions,
};

const TIMEOUT: Duration = Duration::from_secs(30);
const CHILD: &str = "AFDEP_TEST_UCX_DEVICE_TLS";
const TEST: &str = "two_processes_on_one_gpu_match_the_oracle";

fn routes(tokens: usize, k: usize, experts: usize, seed: usize) -> Routes {
    // expert 5 is hot; every slot with (t + 2j + seed) % 6 == 0 is masked
    let masked = |t: usize, j: usize| (t + 2 * j + seed) % 6 == 0;
    exchange_common::patterned_routes(tokens, k, experts, seed, (3, 5), masked)
}

/// One rank's part: the engine over device buffers, every round checked on the attention rank.
fn rank_main(tls: &str) {
    let boot = Bootstrap::from_env(TIMEOUT).expect("the launch environment");
    let rank = boot.rank();
    let ucx = Ucx::new(boot, &UcxOptions::with_tls(tls)).expect("UCX");
    let t = DeviceStaged::new(ucx, Some(0)).expect("device buffers on GPU 0");
    let cfg = ExchangeConfig::new("1A:1F".parse().unwrap(), 64, 8, 3, 1024).unwrap();
    let p = exchange_common::params(&cfg, 16, 11);
    let mut eng = StagedEngine::new(cfg.clone(), t).expect("engine");
    let expert = |e: usize, rows: &[bf16], n: usize| layer::expert_rows(&p, e, rows, n).unwrap();
    for (i, tokens) in [1usize, 0, 9, 1024].into_iter().enumerate() {
        let input = SourceInput {
            x: uniform_bf16(tokens * 64, 1.0, 3, i as u64),
            routes: routes(tokens, 3, 8, i),
        };
        let mine = (rank == 0).then_some(&input);
        let out = eng.round(mine, &expert).expect("round");
        if rank == 0 {
            let want = reference::exchange(&cfg, std::slice::from_ref(&input), expert).unwrap();
            assert!(
                out.combined.as_ref() == Some(&want[0]),
                "{tls}, {tokens} tokens: staged over UCX with device buffers differs from the oracle"
            );
        }
        if tokens > 0 {
            let mut bad = input.clone();
            bad.routes.idx[0] = 8;
            let e = eng.round((rank == 0).then_some(&bad), &expert).unwrap_err();
            assert!(matches!(e, ExchangeError::Route { .. }), "{e}");
        }
    }
    assert!(
        eng.transport_mut().pinned(),
        "rank {rank}: the staging buffers were not page-locked"
    );
    println!("rank {rank} over {tls}: every round matched, staged through pinned memory");
}

#[test]
fn two_processes_on_one_gpu_match_the_oracle() {
    if let Ok(tls) = std::env::var(CHILD) {
        rank_main(&tls);
        return;
    }
    if let Err(e) = afdep_transport::device::probe_devices(TransportKind::Ucx) {
        afdep_core::testing::skip_unavailable("a GPU", e);
        return;
    }
    let exe = std::env::current_exe().unwrap();
    for tls in ["tcp", "shm"] {
        let addr = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap();
        let mut kids: Vec<_> = (0..2)
            .map(|r| {
                Command::new(&exe)
                    .args(["--exact", TEST, "--nocapture", "--test-threads=1"])
                    .env(CHILD, tls)
                    .env(ENV_RANK, r.to_string())
                    .env(ENV_WORLD_SIZE, "2")
                    .env(ENV_RENDEZVOUS, addr.to_string())
                    .stdout(Stdio::piped())
                    .stderr(Stdio::piped())
                    .spawn()
                    .unwrap()
            })
            .collect();
        let start = Instant::now();
        while kids.iter_mut().any(|k| k.try_wait().unwrap().is_none()) {
            if start.elapsed() > Duration::from_secs(120) {
                for k in &mut kids {
                    let _ = k.kill();
                }
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        for (r, k) in kids.into_iter().enumerate() {
            let out = k.wait_with_output().unwrap();
            let text = format!(
                "{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
            println!("--- rank {r} over {tls}:\n{text}");
            assert!(out.status.success(), "rank {r} over {tls} failed");
            assert!(
                text.contains(&format!("rank {r} over {tls}: every round matched")),
                "rank {r} over {tls} did not run its rounds"
            );
        }
    }
}
