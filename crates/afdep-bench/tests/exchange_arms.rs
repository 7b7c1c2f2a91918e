//! `afdep exchange` arms, config file and engine choice, and the paired, rotated-order runner
//! `afdep exchange-arms`, on the CPU: the staged engine over loopback and TCP stands in for
//! the fused engine (payload-first and both count-first arms; the staged engine has payload-first only, so its count-first rows are `unsupported`).

mod common;

use common::{fails, rows_of, run, text};

const SMALL: [&str; 14] = [
    "--hidden",
    "16",
    "--experts",
    "6",
    "--top-k",
    "2",
    "--capacity",
    "8",
    "--rounds",
    "2",
    "--warmup",
    "1",
    "--expert",
    "identity",
];

/// The CPU backend, one attention and one FFN rank, two tokens.
const CPU_1A1F: [&str; 6] = ["--backend", "cpu", "--topology", "1A:1F", "--tokens", "2"];

fn ok(args: &[&str]) -> (Vec<serde_json::Value>, String) {
    let out = run(args);
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert!(out.status.success(), "afdep {args:?}:\n{stdout}\n{stderr}");
    (rows_of(&stdout), stderr)
}

/// The runner over `transport`: payload-first runs in a child process per repeat, in rotated
/// order with count-first; count-first is reported `unsupported` by the staged engine.
fn arms_over(transport: &str, launch: Option<&str>) {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("rows.jsonl");
    let table = dir.path().join("table.md");
    let mut args = vec!["exchange-arms"];
    if let Some(n) = launch {
        args.extend(["--launch", n]);
    }
    args.extend([
        "--arms",
        "payload-first,count-first",
        "--repeats",
        "3",
        "--json-out",
        json.to_str().unwrap(),
        "--table",
        table.to_str().unwrap(),
        "--",
        "--backend",
        "cpu",
        "--transport",
        transport,
        "--topology",
        "2A:1F",
        "--tokens",
        "3,5",
    ]);
    args.extend(SMALL);
    let (rows, stderr) = ok(&args);
    let ranks_as = if launch.is_some() {
        "processes"
    } else {
        "threads"
    };
    assert!(!stderr.contains("panicked"), "{stderr}");
    let repeats: Vec<&serde_json::Value> = rows.iter().filter(|r| r["kind"] == "repeat").collect();
    // 3 repeats × 2 token counts of payload-first; count-first never produced a row
    assert_eq!(repeats.len(), 6, "{rows:?}");
    let mut pids = Vec::new();
    for r in &repeats {
        assert_eq!(r["arm"], "payload-first");
        assert_eq!(r["status"], "ok", "{r}");
        assert_eq!(r["engine"], "staged");
        assert_eq!(r["timing"], "host");
        assert_eq!(r["mode"], "eager");
        assert!(r["dispatch_us"].is_f64(), "{r}");
        assert_eq!(r["ranks_as"], ranks_as, "{r}");
        let repeat = r["repeat"].as_u64().unwrap();
        // rotated orders: repeat 0 and 2 start with payload-first, repeat 1 with count-first
        let want = if repeat == 1 {
            serde_json::json!(["count-first", "payload-first"])
        } else {
            serde_json::json!(["payload-first", "count-first"])
        };
        assert_eq!(r["order"], want, "{r}");
        let pos = r["position"].as_u64().unwrap();
        assert_eq!(pos, if repeat == 1 { 1 } else { 0 });
        pids.push(r["pid"].as_u64().unwrap());
    }
    // one process per repeat (both token counts of a repeat in one child), none of them this one
    pids.sort();
    pids.dedup();
    assert_eq!(pids.len(), 3, "separate child processes: {pids:?}");
    let summary: Vec<&serde_json::Value> = rows.iter().filter(|r| r["kind"] == "arms").collect();
    assert_eq!(summary.len(), 4, "2 token counts × 2 arms: {summary:?}");
    for s in &summary {
        match s["arm"].as_str().unwrap() {
            "payload-first" => {
                assert_eq!(s["status"], "ok");
                assert_eq!(s["change_pct"], 0.0);
                let us: Vec<f64> = s["repeats_us"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|v| v.as_f64().unwrap())
                    .collect();
                assert_eq!(us.len(), 3);
                let mut sorted = us.clone();
                sorted.sort_by(f64::total_cmp);
                assert_eq!(s["median_us"].as_f64().unwrap(), sorted[1]);
                assert_eq!(s["pids"].as_array().unwrap().len(), 3);
            }
            "count-first" => {
                assert_eq!(s["status"], "unsupported", "{s}");
                assert!(
                    s["why"].as_str().unwrap().contains("no arm count-first"),
                    "{s}"
                );
                assert!(s["median_us"].is_null());
            }
            other => panic!("arm {other}"),
        }
    }
    let written = std::fs::read_to_string(&json).unwrap();
    assert_eq!(written.lines().count(), rows.len());
    let md = std::fs::read_to_string(&table).unwrap();
    assert!(md.contains("| 2A:1F | 3 |"), "{md}");
    assert!(md.contains("| unsupported |"), "{md}");
}

#[test]
fn arms_runner_over_loopback() {
    arms_over("loopback", None);
}

#[test]
fn arms_runner_over_tcp() {
    arms_over("tcp", None);
}

#[test]
fn arms_runner_with_one_process_per_rank() {
    // 2A:1F: three processes per child through `afdep launch`
    arms_over("tcp", Some("3"));
}

#[test]
fn arms_runner_refuses_bad_arguments() {
    for args in [
        &[
            "exchange-arms",
            "--arms",
            "count-first",
            "--",
            "--backend",
            "cpu",
        ][..],
        &["exchange-arms", "--repeats", "0", "--", "--backend", "cpu"][..],
        &["exchange-arms", "--", "--arm", "payload-first"][..],
        &["exchange-arms", "--arms", "payload-first,payload-first"][..],
    ] {
        let stderr = fails(args);
        assert!(!stderr.contains("panicked"), "{stderr}");
    }
    // a child that fails for another reason stops the runner with its error
    let stderr = fails(&[
        "exchange-arms",
        "--arms",
        "payload-first",
        "--repeats",
        "1",
        "--",
        "--backend",
        "cpu",
        "--topology",
        "1A:1F",
        "--hidden",
        "0",
    ]);
    assert!(stderr.contains("hidden"), "{stderr}");
}

#[test]
fn unsupported_arms_and_payloads_exit_3_and_say_so() {
    for (flag, value, what) in [
        ("--arm", "count-first", "no arm count-first"),
        ("--arm", "count-first-source", "no arm count-first-source"),
        ("--arm", "auto", "no arm auto"),
    ] {
        let mut args = vec!["exchange"];
        args.extend(CPU_1A1F);
        args.extend([flag, value]);
        args.extend(SMALL);
        // fp8 needs a multiple of 128 channels
        assert_eq!(args[9], "--hidden");
        args[10] = "128";
        let out = run(&args);
        let stderr = text(&out.stderr);
        assert_eq!(out.status.code(), Some(3), "{value}: {stderr}");
        assert!(
            stderr.contains("unsupported: the staged engine") && stderr.contains(what),
            "{stderr}"
        );
    }
}

#[test]
fn the_staged_engine_moves_fp8_payloads() {
    let mut args = vec![
        "exchange",
        "--backend",
        "cpu",
        "--topology",
        "2A:1F",
        "--tokens",
        "0,5",
        "--payload",
        "fp8",
    ];
    args.extend(SMALL);
    let i = args.iter().position(|a| *a == "--hidden").unwrap();
    args[i + 1] = "256";
    let out = run(&args);
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert!(out.status.success(), "{stderr}");
    let rows: Vec<serde_json::Value> = stdout
        .lines()
        .filter(|l| l.starts_with('{'))
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(rows.len(), 2, "{stdout}");
    assert!(rows.iter().all(|r| r["status"] == "ok"), "{stdout}");
}

/// `--graph` (CUDA-graph replays of the fused engine's device rounds) without `--backend cuda`
/// is a clear error before anything runs (exit status 1, not 3), also under the arms runner.
#[test]
fn graph_mode_needs_the_cuda_backend() {
    for extra in [
        &["--backend", "cpu"][..],
        &[][..],
        &["--backend", "auto", "--transport", "nvlink"][..],
        &["--backend", "cpu", "--arm", "auto"][..],
    ] {
        let mut args = vec![
            "exchange",
            "--graph",
            "--topology",
            "1A:1F",
            "--tokens",
            "2",
        ];
        args.extend(extra);
        args.extend(SMALL);
        let out = run(&args);
        let stderr = text(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {stderr}");
        assert!(
            stderr.contains("--graph") && stderr.contains("needs --backend cuda"),
            "{args:?}: {stderr}"
        );
        assert!(!stderr.contains("panicked"), "{stderr}");
    }
    let mut args = vec![
        "exchange-arms",
        "--arms",
        "payload-first,auto",
        "--repeats",
        "1",
        "--",
        "--graph",
    ];
    args.extend(CPU_1A1F);
    args.extend(SMALL);
    let stderr = fails(&args);
    assert!(stderr.contains("needs --backend cuda"), "{stderr}");
}

/// `--load` is refused with the reason before anything runs (exit status 1, no panic): a bad
/// spec, eager rounds with host experts, or `--graph` without the CUDA backend.
#[test]
fn load_needs_device_rounds_and_a_good_spec() {
    for (extra, why) in [
        (&["--load", "gemm:8,12,8"][..], "multiples of 8"),
        (&["--load", "conv"][..], "the one load is gemm"),
        (&["--load", "gemm"][..], "--graph or --device-rounds"),
        (
            &["--load", "gemm", "--graph", "--backend", "cpu"][..],
            "needs --backend cuda",
        ),
    ] {
        let mut args = vec!["exchange", "--topology", "1A:1F", "--tokens", "2"];
        args.extend(extra);
        args.extend(SMALL);
        let stderr = fails(&args);
        assert!(stderr.contains(why), "{args:?}: {stderr}");
        assert!(!stderr.contains("panicked"), "{stderr}");
    }
}

/// The CLI has no fp8 rule of its own: fused + fp8 + a count-first arm goes to the engine (which
/// carries fp8 in every arm). Without a GPU the run stops at the NVLink-IPC transport, never
/// with `unsupported`; with one, every row is `ok` against the oracle.
#[test]
fn fused_fp8_count_first_arms_are_passed_to_the_engine() {
    for arm in ["count-first", "count-first-source"] {
        let mut args = vec![
            "exchange",
            "--backend",
            "cuda",
            "--transport",
            "nvlink",
            "--device",
            "0",
            "--topology",
            "1A:1F",
            "--tokens",
            "0,5",
            "--payload",
            "fp8",
            "--arm",
            arm,
        ];
        args.extend(SMALL);
        let i = args.iter().position(|a| *a == "--hidden").unwrap();
        args[i + 1] = "128";
        let out = run(&args);
        let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
        assert_ne!(out.status.code(), Some(3), "{arm}: {stderr}");
        assert!(!stderr.contains("unsupported"), "{arm}: {stderr}");
        if out.status.success() {
            let rows = rows_of(&stdout);
            assert_eq!(rows.len(), 2, "{arm}: {stdout}");
            assert!(rows.iter().all(|r| r["status"] == "ok"), "{arm}: {stdout}");
        } else {
            assert!(
                stderr.contains("unavailable") || stderr.contains("driver"),
                "{arm}: expected the transport to be unavailable without a GPU: {stderr}"
            );
        }
    }
}

#[test]
fn the_fused_backend_needs_nvlink() {
    let stderr = fails(&[
        "exchange",
        "--backend",
        "cuda",
        "--transport",
        "tcp",
        "--topology",
        "1A:1F",
    ]);
    assert!(
        stderr.contains("fused engine") && stderr.contains("--transport nvlink"),
        "{stderr}"
    );
}

#[test]
fn the_config_file_sets_the_exchange_and_the_transport_and_flags_override_it() {
    let dir = tempfile::tempdir().unwrap();
    let toml_path = dir.path().join("x.toml");
    std::fs::write(
        &toml_path,
        r#"
topology = "2A:2F"
hidden = 24
experts = 8
top_k = 2
capacity = 16
payload = "bf16"

[knobs]
transport_sms = 7

[transport]
kind = "tcp"
timeout_ms = 20000
"#,
    )
    .unwrap();
    let cfg = toml_path.to_str().unwrap();
    let common = ["--tokens", "3", "--rounds", "1", "--expert", "identity"];
    let mut args = vec!["exchange", "--backend", "cpu", "--config", cfg];
    args.extend(common);
    let (r, _) = ok(&args);
    assert_eq!(r.len(), 1);
    let r = &r[0];
    assert_eq!(r["status"], "ok", "{r}");
    assert_eq!(r["topology"], "2A:2F");
    assert_eq!(r["hidden"], 24);
    assert_eq!(r["experts"], 8);
    assert_eq!(r["top_k"], 2);
    assert_eq!(r["capacity"], 16);
    assert_eq!(r["transport_sms"], 7);
    assert_eq!(r["transport"], "tcp");
    // flags win over the file
    let mut args = vec![
        "exchange",
        "--backend",
        "cpu",
        "--config",
        cfg,
        "--transport",
        "loopback",
        "--hidden",
        "32",
        "--transport-sms",
        "23",
        "--topology",
        "EP2",
    ];
    args.extend(common);
    let (r, _) = ok(&args);
    let r = &r[0];
    assert_eq!(r["status"], "ok", "{r}");
    assert_eq!(r["topology"], "EP2");
    assert_eq!(r["hidden"], 32);
    assert_eq!(r["experts"], 8);
    assert_eq!(r["transport_sms"], 23);
    assert_eq!(r["transport"], "loopback");
    // JSON works the same
    let json_path = dir.path().join("x.json");
    std::fs::write(
        &json_path,
        r#"{"topology": "1A:1F", "hidden": 16, "experts": 4, "top_k": 2, "capacity": 8,
            "transport": "loopback"}"#,
    )
    .unwrap();
    let mut args = vec![
        "exchange",
        "--backend",
        "cpu",
        "--config",
        json_path.to_str().unwrap(),
    ];
    args.extend(common);
    let (r, _) = ok(&args);
    assert_eq!(r[0]["topology"], "1A:1F");
    assert_eq!(r[0]["status"], "ok");
}

#[test]
fn bad_config_files_name_the_field() {
    let dir = tempfile::tempdir().unwrap();
    for (i, (text_, want)) in [
        ("hiden = 16\n", "field `hiden`"),
        ("hidden = \"wide\"\n", "field `hidden`"),
        ("[knobs]\ntransport_sms = 0\n", "knobs.transport_sms"),
        ("[knobs]\nwarps_per_unit = 33\n", "knobs.warps_per_unit"),
        ("top_k = 200\n", "top_k"),
        ("transport = \"mpi\"\n", "field `transport`"),
        (
            "[transport]\nkind = \"tcp\"\ncolour = 1\n",
            "field `transport`",
        ),
        ("topology = \"3A:0F\"\n", "field `topology`"),
    ]
    .into_iter()
    .enumerate()
    {
        let p = dir.path().join(format!("bad{i}.toml"));
        std::fs::write(&p, text_).unwrap();
        let stderr = fails(&[
            "exchange",
            "--backend",
            "cpu",
            "--config",
            p.to_str().unwrap(),
            "--tokens",
            "1",
        ]);
        assert!(!stderr.contains("panicked"), "{stderr}");
        assert!(
            stderr.contains(want) && stderr.contains(p.to_str().unwrap()),
            "{text_:?}: want {want:?} in {stderr}"
        );
    }
    let stderr = fails(&["exchange", "--config", "/nonexistent/afdep.toml"]);
    assert!(stderr.contains("/nonexistent/afdep.toml"));
}
