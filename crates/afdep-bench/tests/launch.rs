//! `afdep launch` and `afdep exchange --multi-process`: the launcher's environment, output and
//! failure handling, and the staged engine with one process per rank, over TCP (always) and over
//! UCX on tcp and shared memory (feature `ucx`): every ratio, uneven ranks with a zero-token
//! rank, a hot expert, masked slots, a rejected route on one rank, and a process killed
//! mid-round. Every process checks its results against the oracle bit for bit (a mismatch fails
//! the run); rank 0 prints the rows.

use std::collections::HashMap;
use std::path::Path;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use safetensors::{Dtype, tensor::TensorView};

mod common;
use common::{fails, run, text};

fn afdep(args: &[&str]) -> (Output, Duration) {
    let t0 = Instant::now();
    let out = run(args);
    (out, t0.elapsed())
}

#[test]
fn launch_gives_every_rank_its_environment() {
    let (out, _) = afdep(&[
        "launch",
        "-n",
        "3",
        "--",
        "sh",
        "-c",
        "echo \"$AFDEP_RANK $AFDEP_WORLD_SIZE $AFDEP_RENDEZVOUS\"; echo \"to stderr $AFDEP_RANK\" >&2",
    ]);
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert!(out.status.success(), "{stdout}\n{stderr}");
    let mut lines: Vec<&str> = stdout.lines().collect();
    lines.sort();
    assert_eq!(lines.len(), 3, "{stdout}");
    let addrs: Vec<&str> = lines
        .iter()
        .enumerate()
        .map(|(r, l)| {
            let f: Vec<&str> = l.split(' ').collect();
            assert_eq!(f[0], r.to_string(), "{stdout}");
            assert_eq!(f[1], "3", "{stdout}");
            f[2]
        })
        .collect();
    assert!(
        addrs.iter().all(|a| *a == addrs[0]),
        "one rendezvous: {addrs:?}"
    );
    assert!(addrs[0].starts_with("127.0.0.1:"), "{addrs:?}");
    for r in 0..3 {
        assert!(
            stderr.contains(&format!("[{r}] to stderr {r}")),
            "stderr lines carry the rank: {stderr}"
        );
    }
}

/// The job id every rank of `afdep launch -n 2 ARGS -- echo $AFDEP_JOB_ID` sees (the same on
/// both, else a failure), with `AFDEP_JOB_ID` set to `outer` for the launcher if given.
fn launched_job_id(args: &[&str], outer: Option<&str>) -> Result<String, String> {
    let mut c = Command::new(env!("CARGO_BIN_EXE_afdep"));
    c.arg("launch").args(["-n", "2"]).args(args);
    c.args(["--", "sh", "-c", "echo \"$AFDEP_JOB_ID\""]);
    c.env_remove("AFDEP_JOB_ID");
    if let Some(o) = outer {
        c.env("AFDEP_JOB_ID", o);
    }
    let out = c.output().expect("running afdep");
    if !out.status.success() {
        return Err(text(&out.stderr));
    }
    let stdout = text(&out.stdout);
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(lines.len(), 2, "{stdout}");
    assert_eq!(lines[0], lines[1], "one job id per launch: {stdout}");
    Ok(lines[0].to_string())
}

#[test]
fn launch_gives_every_rank_one_job_id_new_for_each_launch() {
    let a = launched_job_id(&[], None).unwrap();
    let b = launched_job_id(&[], None).unwrap();
    assert_ne!(a, b, "two launches share a random job id");
    for id in [&a, &b] {
        assert!(
            id.len() == 32 && id.bytes().all(|c| c.is_ascii_hexdigit()),
            "{id:?}"
        );
    }
    assert_eq!(
        launched_job_id(&["--job-id", "train-7"], None).unwrap(),
        "train-7"
    );
    assert_eq!(launched_job_id(&[], Some("outer")).unwrap(), "outer");
    assert_eq!(
        launched_job_id(&["--job-id", "inner"], Some("outer")).unwrap(),
        "inner"
    );
    let e = launched_job_id(&["--job-id", "two words"], None).unwrap_err();
    assert!(
        e.contains("--job-id") && e.contains("invalid job id"),
        "{e}"
    );
    let e = launched_job_id(&[], Some("")).unwrap_err();
    assert!(e.contains("AFDEP_JOB_ID"), "{e}");
}

#[test]
fn launch_uses_the_given_rendezvous_address() {
    let (out, _) = afdep(&[
        "launch",
        "-n",
        "2",
        "--rendezvous",
        "127.0.0.1:45999",
        "--tag-stdout",
        "--",
        "sh",
        "-c",
        "echo $AFDEP_RENDEZVOUS",
    ]);
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}");
    assert!(stdout.contains("[0] 127.0.0.1:45999"), "{stdout}");
    assert!(stdout.contains("[1] 127.0.0.1:45999"), "{stdout}");
}

#[test]
fn launch_stops_the_others_when_one_fails_and_names_it() {
    let (out, took) = afdep(&[
        "launch",
        "-n",
        "3",
        "--grace",
        "0.5",
        "--",
        "sh",
        "-c",
        "if [ \"$AFDEP_RANK\" = 1 ]; then exit 7; fi; exec sleep 60",
    ]);
    let stderr = text(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(took < Duration::from_secs(20), "took {took:?}");
    assert!(stderr.contains("rank 1 exited with status 7"), "{stderr}");
    assert!(
        stderr.contains("[0, 2]"),
        "ranks 0 and 2 were killed: {stderr}"
    );
    assert!(!stderr.contains("panicked"), "{stderr}");
}

#[test]
fn launch_reports_a_rank_killed_by_a_signal() {
    let (out, took) = afdep(&[
        "launch",
        "-n",
        "2",
        "--",
        "sh",
        "-c",
        "if [ \"$AFDEP_RANK\" = 0 ]; then kill -9 $$; fi; exit 0",
    ]);
    let stderr = text(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(took < Duration::from_secs(20), "took {took:?}");
    assert!(stderr.contains("rank 0 was killed by signal 9"), "{stderr}");
}

#[test]
fn launch_has_an_overall_timeout() {
    let (out, took) = afdep(&["launch", "-n", "2", "--timeout", "1", "--", "sleep", "60"]);
    let stderr = text(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(took < Duration::from_secs(20), "took {took:?}");
    assert!(stderr.contains("timed out"), "{stderr}");
    assert!(stderr.contains("[0, 1]"), "{stderr}");
}

#[test]
fn launch_refuses_bad_arguments() {
    for args in [
        &["launch", "-n", "0", "--", "true"][..],
        &["launch", "-n", "2"][..],
        &["launch", "-n", "1", "--timeout", "-1", "--", "true"][..],
        &["launch", "-n", "1", "--", "/nonexistent/afdep-test-binary"][..],
    ] {
        let stderr = fails(args);
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
    }
}

#[test]
fn multi_process_needs_the_launch_environment_and_a_process_transport() {
    let stderr = fails(&[
        "exchange",
        "--backend",
        "cpu",
        "--multi-process",
        "--transport",
        "tcp",
        "--topology",
        "1A:1F",
    ]);
    assert!(stderr.contains("afdep launch"), "{stderr}");
    let (out, _) = afdep(&[
        "exchange",
        "--backend",
        "cpu",
        "--multi-process",
        "--transport",
        "loopback",
    ]);
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("threads"),
        "{}",
        text(&out.stderr)
    );
}

#[test]
fn unavailable_transports_say_why() {
    let mut cases = vec![];
    if !cfg!(feature = "ucx") {
        cases.push(("ucx", "feature"));
    }
    if !cfg!(feature = "nccl") {
        cases.push(("nccl", "feature"));
    }
    for (t, why) in cases {
        let stderr = fails(&[
            "exchange",
            "--backend",
            "cpu",
            "--transport",
            t,
            "--topology",
            "1A:1F",
            "--tokens",
            "4",
        ]);
        assert!(
            stderr.contains("unavailable") && stderr.contains(why),
            "{t}: {stderr}"
        );
        assert!(!stderr.contains("panicked"), "{stderr}");
    }
    // nvlink is built in; without a GPU and driver it says so (on a GPU machine it runs)
    for backend in ["cpu", "cuda"] {
        let (out, _) = afdep(&[
            "exchange",
            "--backend",
            backend,
            "--transport",
            "nvlink",
            "--topology",
            "1A:1F",
            "--hidden",
            "16",
            "--experts",
            "4",
            "--top-k",
            "2",
            "--capacity",
            "8",
            "--tokens",
            "4",
            "--expert",
            "identity",
        ]);
        let stderr = text(&out.stderr);
        assert!(!stderr.contains("panicked"), "{stderr}");
        if !out.status.success() {
            assert!(
                stderr.contains("nvlink-ipc is unavailable") && stderr.contains("driver"),
                "{backend}: {stderr}"
            );
        }
    }
}

const HIDDEN: usize = 16;
const EXPERTS: usize = 12;
const TOP_K: usize = 3;
const HOT: usize = 1;

/// Routes of attention rank `s`: distinct experts per token, expert `HOT` in slot 0 of 9 tokens
/// in 10, every slot with `(t + j + s) % 4 == 0` masked.
fn write_input(path: &Path, tokens: &[usize]) {
    let mut t = Vec::new();
    for (s, &n) in tokens.iter().enumerate() {
        let mut x = Vec::with_capacity(n * HIDDEN * 2);
        let mut idx = Vec::with_capacity(n * TOP_K * 4);
        let mut w = Vec::with_capacity(n * TOP_K * 4);
        for tok in 0..n {
            for c in 0..HIDDEN {
                let v = ((tok * 31 + c * 17 + s * 7) % 23) as f32 / 11.0 - 1.0;
                x.extend_from_slice(&half::bf16::from_f32(v).to_le_bytes());
            }
            let base = if tok % 10 != 0 {
                HOT
            } else {
                (tok * 5 + s) % EXPERTS
            };
            for j in 0..TOP_K {
                let e = if (tok + j + s) % 4 == 0 {
                    -1
                } else {
                    ((base + j * 5) % EXPERTS) as i32
                };
                idx.extend_from_slice(&e.to_le_bytes());
                let wt = 0.1 + ((tok * 13 + j * 7) % 17) as f32 / 20.0;
                w.extend_from_slice(&wt.to_le_bytes());
            }
        }
        t.push((format!("x.{s}"), Dtype::BF16, vec![n, HIDDEN], x));
        t.push((format!("topk_idx.{s}"), Dtype::I32, vec![n, TOP_K], idx));
        t.push((format!("topk_weights.{s}"), Dtype::F32, vec![n, TOP_K], w));
    }
    let views: Vec<(String, TensorView)> = t
        .iter()
        .map(|(n, d, s, b)| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap()))
        .collect();
    safetensors::serialize_to_file(views, &Some(HashMap::new()), path).unwrap();
}

/// The exchange flags of the small problem.
fn exchange_args<'a>(topo: &'a str, input: &'a str, transport: &'a str) -> Vec<&'a str> {
    vec![
        "exchange",
        "--multi-process",
        "--backend",
        "cpu",
        "--transport",
        transport,
        "--topology",
        topo,
        "--hidden",
        "16",
        "--experts",
        "12",
        "--top-k",
        "3",
        "--width",
        "8",
        "--capacity",
        "64",
        "--input",
        input,
    ]
}

/// Every ratio with 4 processes and the 2-process ones, uneven ranks with a zero-token rank, a
/// hot expert and masked slots; a rejected route on one rank in timed round 1 of 3: every rank
/// reports that rank's rejection, and the last round matches the oracle on every rank.
fn every_ratio_over(transport: &str, extra: &[&str]) {
    let dir = tempfile::tempdir().unwrap();
    // (topology, processes, tokens per attention rank, the rank whose route is rejected)
    let cases: [(&str, usize, &[usize], usize); 6] = [
        ("3A:1F", 4, &[7, 0, 12], 2),
        ("2A:2F", 4, &[0, 9], 1),
        ("1A:3F", 4, &[11], 0),
        ("EP4", 4, &[5, 0, 3, 8], 3),
        ("1A:1F", 2, &[6], 0),
        ("EP2", 2, &[0, 4], 1),
    ];
    for (topo, n, tokens, reject) in cases {
        let input = dir.path().join(format!("{topo}.safetensors"));
        write_input(&input, tokens);
        let input = input.to_str().unwrap().to_string();
        let np = n.to_string();
        let fault = format!("reject@{reject}:1");
        let mut args = vec!["launch", "-n", &np, "--timeout", "120", "--"];
        let exe = env!("CARGO_BIN_EXE_afdep");
        args.push(exe);
        args.extend(exchange_args(topo, &input, transport));
        args.extend(["--rounds", "3", "--warmup", "1", "--fault", &fault]);
        args.extend(extra);
        let (out, _) = afdep(&args);
        let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
        assert!(
            out.status.success(),
            "{topo} over {transport} {extra:?}:\n{stdout}\n{stderr}"
        );
        let rows: Vec<serde_json::Value> = stdout
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(rows.len(), 1, "only rank 0 prints: {stdout}");
        let row = &rows[0];
        assert_eq!(row["status"], "ok", "{topo}: {row}");
        assert_eq!(row["ranks_as"], "processes");
        assert_eq!(row["transport"], transport);
        assert_eq!(row["rejected_rounds"], 1, "{row}");
        assert_eq!(row["tokens"], serde_json::json!(tokens), "{row}");
        // the attention index of the rejecting rank: attention ranks come first
        let s = reject;
        for r in 0..n {
            let want =
                format!("[{r}] rank {r}: round 2 rejected as injected: wide route: rank {s}");
            assert!(stderr.contains(&want), "{topo}: no `{want}` in\n{stderr}");
        }
    }
}

#[test]
fn every_ratio_over_tcp_processes_matches_the_oracle() {
    every_ratio_over("tcp", &[]);
}

/// A process of an FFN rank aborts inside its experts in timed round 1: the launcher names it,
/// and every other rank fails with a typed transport error within the timeout instead of
/// hanging.
fn killed_mid_round(transport: &str, extra: &[&str]) {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("in.safetensors");
    write_input(&input, &[6, 9]);
    let input = input.to_str().unwrap().to_string();
    let exe = env!("CARGO_BIN_EXE_afdep");
    // a grace longer than the timeout: the others end on their own, with their errors
    let mut args = vec![
        "launch",
        "-n",
        "4",
        "--grace",
        "30",
        "--timeout",
        "120",
        "--",
        exe,
    ];
    args.extend(exchange_args("2A:2F", &input, transport));
    args.extend([
        "--rounds",
        "3",
        "--fault",
        "abort@2:1",
        "--timeout-ms",
        "4000",
    ]);
    args.extend(extra);
    let (out, took) = afdep(&args);
    let stderr = text(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains("rank 2 was killed by signal 6"),
        "the launcher names the aborted rank: {stderr}"
    );
    assert!(
        stderr.contains("[2] rank 2: aborting mid-round"),
        "{stderr}"
    );
    assert!(
        took < Duration::from_secs(25),
        "the others must fail within the timeout, took {took:?}:\n{stderr}"
    );
    assert!(!stderr.contains("panicked"), "{stderr}");
    for r in [0, 1, 3] {
        let typed = ["PeerGone", "Timeout", "PeerFailed"]
            .iter()
            .any(|c| stderr.contains(&format!("[{r}] Error: rank {r}: round failed ({c})")));
        assert!(typed, "rank {r} has no typed transport error:\n{stderr}");
    }
}

#[test]
fn a_process_killed_mid_round_fails_the_others_over_tcp() {
    killed_mid_round("tcp", &[]);
}

#[cfg(feature = "ucx")]
mod ucx {
    #[test]
    fn every_ratio_over_ucx_tcp_processes_matches_the_oracle() {
        super::every_ratio_over("ucx", &["--ucx-tls", "tcp"]);
    }

    #[test]
    fn every_ratio_over_ucx_shm_processes_matches_the_oracle() {
        super::every_ratio_over("ucx", &["--ucx-tls", "shm"]);
    }

    /// Without `--multi-process`, the ranks are threads, each with its own UCX worker.
    #[test]
    fn ucx_ranks_as_threads_match_the_oracle() {
        let dir = tempfile::tempdir().unwrap();
        let input = dir.path().join("in.safetensors");
        super::write_input(&input, &[0, 9]);
        let input = input.to_str().unwrap().to_string();
        let mut args = super::exchange_args("2A:2F", &input, "ucx");
        args.retain(|a| *a != "--multi-process");
        args.extend(["--ucx-tls", "shm", "--rounds", "2"]);
        let (out, _) = super::afdep(&args);
        let stdout = super::text(&out.stdout);
        assert!(
            out.status.success(),
            "{stdout}\n{}",
            super::text(&out.stderr)
        );
        let row: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
        assert_eq!(row["status"], "ok", "{row}");
        assert_eq!(row["ranks_as"], "threads", "{row}");
        assert_eq!(row["transport"], "ucx", "{row}");
    }

    #[test]
    fn a_process_killed_mid_round_fails_the_others_over_ucx_tcp() {
        super::killed_mid_round("ucx", &["--ucx-tls", "tcp"]);
    }

    #[test]
    fn a_process_killed_mid_round_fails_the_others_over_ucx_shm() {
        super::killed_mid_round("ucx", &["--ucx-tls", "shm"]);
    }
}
