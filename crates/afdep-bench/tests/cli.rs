//! The CLI round trip: inputs written with safetensors, `afdep moe` / `afdep exchange` run as a
//! process, outputs read back and compared with the oracle called directly.

use std::collections::HashMap;
use std::path::Path;
use std::process::Command;

use afdep_core::oracle::exchange::{self as reference, SourceInput};
use afdep_core::oracle::params::{PARAM_NAMES, random_tokens};
use afdep_core::oracle::{LayerParams, layer};
use afdep_core::route::route;
use afdep_core::tensor::uniform_bf16;
use afdep_core::{ExchangeConfig, LayerShape, bf16};
use safetensors::{Dtype, SafeTensors, tensor::TensorView};

mod common;
use common::{fails, rows_of, run};

fn afdep(args: &[&str]) -> String {
    let out = run(args);
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        out.status.success(),
        "afdep {args:?} failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

fn bytes_bf16(v: &[bf16]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn write(
    path: &Path,
    tensors: Vec<(String, Dtype, Vec<usize>, Vec<u8>)>,
    meta: HashMap<String, String>,
) {
    let views: Vec<(String, TensorView)> = tensors
        .iter()
        .map(|(n, d, s, b)| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap()))
        .collect();
    safetensors::serialize_to_file(views, &Some(meta), path).unwrap();
}

fn read_bf16(buf: &[u8], name: &str) -> Vec<bf16> {
    let st = SafeTensors::deserialize(buf).unwrap();
    let t = st
        .tensor(name)
        .unwrap_or_else(|_| panic!("output has no `{name}`"));
    assert_eq!(t.dtype(), Dtype::BF16);
    t.data()
        .chunks_exact(2)
        .map(|c| bf16::from_le_bytes([c[0], c[1]]))
        .collect()
}

#[test]
fn moe_round_trip_matches_the_oracle() {
    let dir = tempfile::tempdir().unwrap();
    let shape = LayerShape {
        d_model: 24,
        width: 8,
        experts: 6,
        top_k: 2,
        shared: 16,
        renormalize: true,
    };
    let tokens = 37;
    let p = LayerParams::random(shape, 11);
    let x = random_tokens(tokens, shape.d_model, 12);
    let dy = uniform_bf16(tokens * shape.d_model, 1.0, 13, 0);
    let mut t = vec![
        (
            "x".to_string(),
            Dtype::BF16,
            vec![tokens, shape.d_model],
            bytes_bf16(&x),
        ),
        (
            "dy".to_string(),
            Dtype::BF16,
            vec![tokens, shape.d_model],
            bytes_bf16(&dy),
        ),
    ];
    for ((name, v), dims) in PARAM_NAMES
        .iter()
        .zip(p.tensors())
        .zip(LayerParams::dims(&shape))
    {
        t.push((name.to_string(), Dtype::BF16, dims, bytes_bf16(v)));
    }
    let input = dir.path().join("in.safetensors");
    let output = dir.path().join("out.safetensors");
    write(
        &input,
        t,
        HashMap::from([("top_k".to_string(), "2".to_string())]),
    );
    let stdout = afdep(&[
        "moe",
        "--backend",
        "cpu",
        "--input",
        input.to_str().unwrap(),
        "--output",
        output.to_str().unwrap(),
    ]);
    let row: serde_json::Value = serde_json::from_str(stdout.lines().last().unwrap()).unwrap();
    assert_eq!(row["tokens"], tokens);
    assert_eq!(row["status"], "ok");
    for f in [
        "d_model", "width", "experts", "top_k", "shared", "impl", "dispatch", "fwd_ms", "train_ms",
        "out_err", "gx_err", "gw_err",
    ] {
        assert!(row.get(f).is_some(), "row lacks {f}");
    }
    let buf = std::fs::read(&output).unwrap();
    let (y, g) = layer::train_step(&p, &x, tokens, &dy).unwrap();
    assert_eq!(read_bf16(&buf, "y"), y);
    assert_eq!(read_bf16(&buf, "dx"), g.dx);
    for (name, want) in PARAM_NAMES.iter().zip(g.params()) {
        assert_eq!(&read_bf16(&buf, &format!("d{name}")), want, "d{name}");
    }
}

fn exchange_round_trip(transport: &str) {
    let dir = tempfile::tempdir().unwrap();
    let cfg = ExchangeConfig::new("2A:2F".parse().unwrap(), 16, 8, 2, 64).unwrap();
    let shape = LayerShape {
        d_model: 16,
        width: 4,
        experts: 8,
        top_k: 2,
        shared: 0,
        renormalize: true,
    };
    let p = LayerParams::random(shape, 3);
    let mut t = Vec::new();
    let mut inputs = Vec::new();
    for (s, n) in [5usize, 0].into_iter().enumerate() {
        let x = random_tokens(n, 16, 40 + s as u64);
        let r = route(&x, &p.wr, n, &shape);
        t.push((format!("x.{s}"), Dtype::BF16, vec![n, 16], bytes_bf16(&x)));
        t.push((
            format!("topk_idx.{s}"),
            Dtype::I32,
            vec![n, 2],
            r.idx.iter().flat_map(|v| v.to_le_bytes()).collect(),
        ));
        t.push((
            format!("topk_weights.{s}"),
            Dtype::F32,
            vec![n, 2],
            r.weights.iter().flat_map(|v| v.to_le_bytes()).collect(),
        ));
        inputs.push(SourceInput { x, routes: r });
    }
    for (name, v, dims) in [
        ("w1", &p.w1, vec![8, 16, 4]),
        ("w3", &p.w3, vec![8, 16, 4]),
        ("w2", &p.w2, vec![8, 4, 16]),
    ] {
        t.push((name.to_string(), Dtype::BF16, dims, bytes_bf16(v)));
    }
    let input = dir.path().join("in.safetensors");
    let output = dir.path().join("out.safetensors");
    write(&input, t, HashMap::new());
    let stdout = afdep(&[
        "exchange",
        "--transport",
        transport,
        "--backend",
        "cpu",
        "--topology",
        "2A:2F",
        "--hidden",
        "16",
        "--experts",
        "8",
        "--top-k",
        "2",
        "--capacity",
        "64",
        "--rounds",
        "2",
        "--input",
        input.to_str().unwrap(),
        "--output",
        output.to_str().unwrap(),
    ]);
    let row: serde_json::Value = serde_json::from_str(stdout.lines().last().unwrap()).unwrap();
    assert_eq!(row["status"], "ok");
    assert_eq!(
        row["transport"], transport,
        "the row names the transport it ran over"
    );
    let want = reference::exchange(&cfg, &inputs, |e, rows: &[bf16], n| {
        layer::expert_rows(&p, e, rows, n).unwrap()
    })
    .unwrap();
    let buf = std::fs::read(&output).unwrap();
    for (s, w) in want.iter().enumerate() {
        assert_eq!(&read_bf16(&buf, &format!("y.{s}")), w, "y.{s}");
    }
}

#[test]
fn exchange_round_trip_over_loopback_matches_the_oracle() {
    exchange_round_trip("loopback");
}

#[test]
fn exchange_round_trip_over_tcp_matches_the_oracle() {
    exchange_round_trip("tcp");
}

#[test]
fn bad_input_gives_an_error_not_a_panic() {
    let err = afdep_fails(&["exchange", "--backend", "cpu", "--topology", "3A:0F"]);
    assert!(err.contains("3A:0F"), "{err}");
}

fn afdep_fails(args: &[&str]) -> String {
    let err = fails(args);
    assert!(!err.contains("panicked"), "afdep {args:?} panicked:\n{err}");
    err
}

const SMALL: [&str; 10] = [
    "--d-model",
    "32",
    "--width",
    "32",
    "--experts",
    "8",
    "--top-k",
    "2",
    "--shared",
    "32",
];

/// One expert per token, no shared expert, no renormalization, wider than [`SMALL`].
const NARROW: [&str; 11] = [
    "--d-model",
    "64",
    "--width",
    "32",
    "--experts",
    "16",
    "--top-k",
    "1",
    "--shared",
    "0",
    "--no-renormalize",
];

fn small_shape() -> LayerShape {
    LayerShape {
        d_model: 32,
        width: 32,
        experts: 8,
        top_k: 2,
        shared: 32,
        renormalize: true,
    }
}

#[test]
fn moe_writes_the_seeded_inputs_and_outputs_per_token_count() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_str().unwrap();
    let jsonl = dir.path().join("rows").join("a.jsonl");
    let mut args = vec![
        "moe",
        "--backend",
        "cpu",
        "--tokens",
        "37,50",
        "--seed",
        "3",
    ];
    args.extend(SMALL);
    args.extend([
        "--write-inputs",
        d,
        "--write-outputs",
        d,
        "--json-out",
        jsonl.to_str().unwrap(),
    ]);
    let stdout = afdep(&args);
    let rows = rows_of(&stdout);
    assert_eq!(rows.len(), 2);
    for (r, t) in rows.iter().zip([37, 50]) {
        assert_eq!(r["tokens"], t);
        assert_eq!(r["status"], "ok");
        assert_eq!(r["seed"], 3);
        for f in [
            "peak_gib", "digest", "fwd_ms", "train_ms", "impl", "dispatch",
        ] {
            assert!(r.get(f).is_some(), "row lacks {f}");
        }
    }
    // --json-out appends: a second run adds its rows
    assert_eq!(rows_of(&std::fs::read_to_string(&jsonl).unwrap()), rows);
    afdep(&args);
    assert_eq!(rows_of(&std::fs::read_to_string(&jsonl).unwrap()).len(), 4);

    let shape = small_shape();
    let p = LayerParams::random(shape, 3);
    for t in [37usize, 50] {
        let buf = std::fs::read(dir.path().join(format!("moe-inputs-{t}.safetensors"))).unwrap();
        let x = random_tokens(t, shape.d_model, 3);
        let dy = uniform_bf16(t * shape.d_model, 1.0, 3, 200);
        assert_eq!(read_bf16(&buf, "x"), x);
        assert_eq!(read_bf16(&buf, "dy"), dy);
        for (name, want) in PARAM_NAMES.iter().zip(p.tensors()) {
            assert_eq!(&read_bf16(&buf, name), want, "{name}");
        }
        let (_, meta) = SafeTensors::read_metadata(&buf).unwrap();
        let meta = meta.metadata().clone().unwrap();
        assert_eq!(meta["seed"], "3");
        assert_eq!(meta["top_k"], "2");
        assert_eq!(meta["renormalize"], "true");
        let out = std::fs::read(dir.path().join(format!("moe-outputs-{t}.safetensors"))).unwrap();
        let (y, g) = layer::train_step(&p, &x, t, &dy).unwrap();
        assert_eq!(read_bf16(&out, "y"), y);
        assert_eq!(read_bf16(&out, "dx"), g.dx);
        let st = SafeTensors::deserialize(&out).unwrap();
        let idx = st.tensor("topk_idx").unwrap();
        assert_eq!(idx.shape(), &[t, 2]);
        let want = route(&x, &p.wr, t, &shape).idx;
        let got: Vec<i32> = idx
            .data()
            .chunks_exact(4)
            .map(|c| i32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        assert_eq!(got, want);
    }
    // the files read back as --input
    let input = dir.path().join("moe-inputs-37.safetensors");
    let again = rows_of(&afdep(&[
        "moe",
        "--backend",
        "cpu",
        "--input",
        input.to_str().unwrap(),
    ]));
    assert_eq!(again[0]["tokens"], 37);
}

/// Rewrites every bf16 tensor of a safetensors file as `to` (F32 or F16); `keep` stays bf16.
fn convert_file(src: &Path, dst: &Path, to: Dtype, keep: &[&str]) {
    let buf = std::fs::read(src).unwrap();
    let st = SafeTensors::deserialize(&buf).unwrap();
    let (_, meta) = SafeTensors::read_metadata(&buf).unwrap();
    let mut t = Vec::new();
    for (name, v) in st.tensors() {
        let vals: Vec<f32> = v
            .data()
            .chunks_exact(2)
            .map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect();
        let bytes: Vec<u8> = match to {
            _ if keep.contains(&name.as_str()) => v.data().to_vec(),
            Dtype::F32 => vals.iter().flat_map(|x| x.to_le_bytes()).collect(),
            Dtype::F16 => vals
                .iter()
                .flat_map(|&x| half::f16::from_f32(x).to_le_bytes())
                .collect(),
            _ => unreachable!(),
        };
        let dt = if keep.contains(&name.as_str()) {
            Dtype::BF16
        } else {
            to
        };
        t.push((name.clone(), dt, v.shape().to_vec(), bytes));
    }
    write(dst, t, meta.metadata().clone().unwrap_or_default());
}

#[test]
fn f32_and_f16_inputs_are_converted_other_dtypes_are_errors() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_str().unwrap();
    let mut args = vec![
        "moe",
        "--tokens",
        "21",
        "--inputs-only",
        "--write-inputs",
        d,
    ];
    args.extend(SMALL);
    afdep(&args);
    let src = dir.path().join("moe-inputs-21.safetensors");
    let run = |input: &Path, out: &Path| {
        let o = Command::new(env!("CARGO_BIN_EXE_afdep"))
            .args(["moe", "--backend", "cpu", "--input"])
            .arg(input)
            .arg("--output")
            .arg(out)
            .env("RUST_LOG", "afdep=info")
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        (
            std::fs::read(out).unwrap(),
            String::from_utf8_lossy(&o.stderr).to_string(),
        )
    };
    let (want, log) = run(&src, &dir.path().join("o-bf16.safetensors"));
    assert!(!log.contains("converting"), "{log}");
    // bf16 values are exact in f32 and (these, small) in f16: the same outputs, bit for bit
    for (dt, name) in [(Dtype::F32, "f32"), (Dtype::F16, "f16")] {
        let conv = dir.path().join(format!("in-{name}.safetensors"));
        convert_file(&src, &conv, dt, &["w2"]);
        let (got, log) = run(&conv, &dir.path().join(format!("o-{name}.safetensors")));
        for t in ["y", "dx", "dw1", "dwr"] {
            assert_eq!(read_bf16(&got, t), read_bf16(&want, t), "{name}: {t}");
        }
        assert_eq!(
            log.matches("converting f32 / f16 tensors").count(),
            1,
            "{log}"
        );
    }
    // another dtype: a typed error naming the tensor and the dtype
    let bad = dir.path().join("bad.safetensors");
    let buf = std::fs::read(&src).unwrap();
    let st = SafeTensors::deserialize(&buf).unwrap();
    let mut t = Vec::new();
    for (name, v) in st.tensors() {
        if name == "w3" {
            let n: usize = v.shape().iter().product();
            t.push((
                name.clone(),
                Dtype::F64,
                v.shape().to_vec(),
                vec![0u8; 8 * n],
            ));
        } else {
            t.push((
                name.clone(),
                v.dtype(),
                v.shape().to_vec(),
                v.data().to_vec(),
            ));
        }
    }
    write(&bad, t, HashMap::new());
    let err = afdep_fails(&["moe", "--backend", "cpu", "--input", bad.to_str().unwrap()]);
    assert!(err.contains("tensor `w3` is F64"), "{err}");
}

#[test]
fn named_shapes_list_run_and_write_their_own_folders() {
    // the suite's runs, for scripts
    let list = afdep(&["moe", "--suite", "models", "--list"]);
    let lines: Vec<&str> = list.lines().collect();
    assert_eq!(lines.len(), 3 + 6 * 2, "{list}");
    assert_eq!(lines[0], "record 16384 10");
    assert_eq!(lines[2], "record 1048576 10");
    assert!(lines.contains(&"qwen1.5-moe-a2.7b 4096 10"), "{list}");
    assert!(lines.contains(&"deepseek-v3 16384 5"), "{list}");
    assert_eq!(
        afdep(&[
            "moe",
            "--shape",
            "olmoe-1b-7b",
            "--tokens",
            "8",
            "--iters",
            "2",
            "--list"
        ]),
        "olmoe-1b-7b 8 2\n"
    );
    // one named shape on the CPU: its name, its dims, TFLOP/s; its files under DIR/NAME
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_str().unwrap();
    let rows = rows_of(&afdep(&[
        "moe",
        "--backend",
        "cpu",
        "--shape",
        "record",
        "--tokens",
        "16",
        "--write-inputs",
        d,
    ]));
    assert_eq!(rows.len(), 1);
    let r = &rows[0];
    assert_eq!(r["shape"], "record");
    assert_eq!(
        (r["d_model"].as_u64(), r["shared"].as_u64()),
        (Some(512), Some(1024))
    );
    let fwd = r["fwd_ms"].as_f64().unwrap();
    let flops = 2.0 * 16.0 * (512.0 * 64.0 + 3.0 * 8.0 * 512.0 * 128.0 + 3.0 * 512.0 * 1024.0);
    let tf = r["fwd_tflops"].as_f64().unwrap();
    assert!(
        (tf - flops / (fwd * 1e-3) / 1e12).abs() <= 1e-9 * tf.max(1.0),
        "{r}"
    );
    let pct = r["fwd_pct_peak"].as_f64().unwrap();
    assert!((pct - 100.0 * tf / 790.0).abs() < 1e-9, "{r}");
    assert!(r["train_tflops"].as_f64().is_some());
    let f = dir.path().join("record").join("moe-inputs-16.safetensors");
    let buf = std::fs::read(&f).unwrap();
    let (_, meta) = SafeTensors::read_metadata(&buf).unwrap();
    assert_eq!(meta.metadata().as_ref().unwrap()["shape"], "record");
    // plain runs keep their rows as they were: no shape name
    let mut args = vec!["moe", "--backend", "cpu", "--tokens", "8", "--forward-only"];
    args.extend(SMALL);
    let plain = rows_of(&afdep(&args));
    assert!(plain[0].get("shape").is_none(), "{}", plain[0]);
    assert!(plain[0]["train_tflops"].is_null());
    // bad names and conflicting flags are errors
    for (args, want) in [
        (vec!["--shape", "llama"], "unknown shape `llama`"),
        (
            vec!["--suite", "models", "--d-model", "64"],
            "cannot be used with",
        ),
        (
            vec!["--shape", "record", "--suite", "record"],
            "cannot be used with",
        ),
        (vec!["--list"], "--list needs --suite or --shape"),
        (vec!["--suite", "nope"], "nope"),
    ] {
        let mut a = vec!["moe", "--backend", "cpu"];
        a.extend(args.iter().copied());
        let err = afdep_fails(&a);
        assert!(err.contains(want), "{args:?}: {err}");
    }
}

#[test]
fn inputs_only_writes_and_runs_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().join("in");
    let mut args = vec!["moe", "--tokens", "5,8", "--inputs-only"];
    args.extend(SMALL);
    args.extend(["--write-inputs", d.to_str().unwrap()]);
    assert_eq!(afdep(&args).trim(), "");
    for t in [5, 8] {
        assert!(d.join(format!("moe-inputs-{t}.safetensors")).exists());
    }
}

#[test]
fn bad_moe_flags_are_errors_not_panics() {
    for (args, want) in [
        (vec!["--iters", "0"], "--iters"),
        (vec!["--dispatch", "sorted,nope"], "nope"),
        (vec!["--dispatch", "fused,fused"], "twice"),
        (vec!["--tokens", "0"], "at least 1"),
        (vec!["--tokens", "4,x"], "bad token count"),
        (vec!["--inputs-only"], "--write-inputs"),
        (
            vec!["--tokens", "4,5", "--output", "o.safetensors"],
            "one token count",
        ),
        (
            vec!["--input", "/nonexistent/in.safetensors"],
            "/nonexistent",
        ),
        (vec!["--experts", "0"], "experts"),
    ] {
        let mut a = vec!["moe", "--backend", "cpu"];
        a.extend(args.iter().copied());
        let err = afdep_fails(&a);
        assert!(err.contains(want), "{args:?}: {err}");
    }
}

const BEGIN: &str = "<!-- afdep report moe: begin";
const END: &str = "<!-- afdep report moe: end -->";

#[test]
fn report_moe_writes_the_block_and_the_chart() {
    let dir = tempfile::tempdir().unwrap();
    let a = dir.path().join("afdep.jsonl");
    let t = dir.path().join("torch.jsonl");
    std::fs::write(
        &a,
        "{\"tokens\":16384,\"impl\":\"afdep\",\"dispatch\":\"sorted\",\"fwd_ms\":1.0,\
         \"train_ms\":2.0,\"status\":\"ok\",\"digest\":\"d1\",\"device\":\"NVIDIA H200\"}\n\
         {\"tokens\":16384,\"impl\":\"afdep\",\"dispatch\":\"fused\",\"fwd_ms\":0.8,\
         \"train_ms\":2.5,\"status\":\"ok\",\"digest\":\"d1\",\"device\":\"NVIDIA H200\"}\n",
    )
    .unwrap();
    std::fs::write(
        &t,
        "some log line\n{\"tokens\":16384,\"impl\":\"torch_grouped_mm\",\"dispatch\":\"sorted\",\
         \"fwd_ms\":1.6,\"train_ms\":3.0,\"status\":\"ok\"}\n",
    )
    .unwrap();
    let md = dir.path().join("out").join("moe.md");
    std::fs::create_dir_all(md.parent().unwrap()).unwrap();
    std::fs::write(&md, "# Hand-written\n\nkeep me\n").unwrap();
    let png = dir.path().join("out").join("moe.png");
    let args = [
        "report",
        "moe",
        "--rows",
        a.to_str().unwrap(),
        t.to_str().unwrap(),
        "--md",
        md.to_str().unwrap(),
        "--png",
        png.to_str().unwrap(),
        "--commit",
        "abc1234",
        "--date",
        "2026-12-03",
    ];
    let stdout = afdep(&args);
    // best forward 0.8 (fused) vs torch 1.6: 2.00; best train 2.0 (sorted) vs 3.0: 1.50
    assert!(
        stdout.contains("| 16,384 | 0.800 (fused) | 1.600 | 2.00 |"),
        "{stdout}"
    );
    assert!(
        stdout.contains("| 16,384 | 2.000 (sorted) | 3.000 | 1.50 |"),
        "{stdout}"
    );
    assert!(stdout.contains("2026-12-03") && stdout.contains("`abc1234`"));
    assert!(stdout.contains("NVIDIA H200") && stdout.contains("`d1`"));
    let doc = std::fs::read_to_string(&md).unwrap();
    assert!(doc.starts_with("# Hand-written\n\nkeep me\n\n"), "{doc}");
    assert_eq!(doc.matches(BEGIN).count(), 1);
    assert!(doc.trim_end().ends_with(END));
    assert!(std::fs::read(&png).unwrap().starts_with(b"\x89PNG"));
    // a second run replaces the block: the document is the same
    std::fs::write(&md, format!("{doc}\nafter the block\n")).unwrap();
    afdep(&args);
    let again = std::fs::read_to_string(&md).unwrap();
    assert_eq!(again, format!("{doc}\nafter the block\n"));

    // broken markers: an error that names the file, and the document is left alone
    std::fs::write(&md, format!("x\n{BEGIN} -->\nno end\n")).unwrap();
    let err = afdep_fails(&args);
    assert!(
        err.contains("moe.md") && err.contains("1 begin and 0 end"),
        "{err}"
    );
    assert_eq!(
        std::fs::read_to_string(&md).unwrap(),
        format!("x\n{BEGIN} -->\nno end\n")
    );
    // no afdep rows
    let err = afdep_fails(&["report", "moe", "--rows", t.to_str().unwrap()]);
    assert!(err.contains("no afdep rows"), "{err}");
    let err = afdep_fails(&["report", "moe", "--rows", "/nonexistent.jsonl"]);
    assert!(err.contains("/nonexistent.jsonl"), "{err}");
}

fn peers_dir() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../peers")
}

/// Whether a missing dependency must fail a test instead of skipping it: `AFDEP_REQUIRE_GPU`
/// (the GPU machine's flag) or `AFDEP_REQUIRE_PEERS`, set to anything but empty or `0`.
fn required() -> Option<&'static str> {
    ["AFDEP_REQUIRE_PEERS", "AFDEP_REQUIRE_GPU"]
        .into_iter()
        .find(|k| std::env::var(k).is_ok_and(|v| !v.is_empty() && v != "0"))
}

/// The Python to run the peer scripts with: `AFDEP_PEER_PYTHON`, else `python3`; `None` (the
/// test skips, printing `SKIP: <reason>`) when it cannot import `modules`, unless [`required`]
/// says so: then the test fails.
fn python_with(modules: &str) -> Option<String> {
    let py = std::env::var("AFDEP_PEER_PYTHON").unwrap_or_else(|_| "python3".into());
    let ok = Command::new(&py)
        .args(["-c", &format!("import {modules}")])
        .output()
        .is_ok_and(|o| o.status.success());
    if ok {
        return Some(py);
    }
    let why = format!("{py} cannot import {modules} (set AFDEP_PEER_PYTHON)");
    if let Some(flag) = required() {
        panic!("{flag} is set, but {why}");
    }
    println!("SKIP: {why}");
    None
}

#[test]
fn a_missing_peer_module_skips_unless_required() {
    let exe = std::env::current_exe().unwrap();
    let run = |flag: Option<&str>| {
        let mut c = Command::new(&exe);
        c.args(["--exact", "python_with_a_missing_module", "--nocapture"])
            .env("AFDEP_RUN_PROBE", "1")
            .env_remove("AFDEP_REQUIRE_GPU")
            .env_remove("AFDEP_REQUIRE_PEERS");
        if let Some(f) = flag {
            c.env(f, "1");
        }
        c.output().unwrap()
    };
    let free = run(None);
    let text = String::from_utf8_lossy(&free.stdout);
    assert!(free.status.success() && text.contains("SKIP: "), "{text}");
    for flag in ["AFDEP_REQUIRE_GPU", "AFDEP_REQUIRE_PEERS"] {
        let o = run(Some(flag));
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        );
        assert!(!o.status.success(), "{flag}: {text}");
        assert!(text.contains(&format!("{flag} is set")), "{text}");
    }
}

/// The probe of [`a_missing_peer_module_skips_unless_required`] (does nothing unless it runs it).
#[test]
fn python_with_a_missing_module() {
    if std::env::var("AFDEP_RUN_PROBE").is_err() {
        return;
    }
    assert!(python_with("afdep_no_such_module_xyz").is_none());
}

#[test]
fn the_peers_reader_reads_what_afdep_writes() {
    let Some(py) = python_with("json") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_str().unwrap();
    let mut args = vec!["moe", "--tokens", "9", "--inputs-only", "--write-inputs", d];
    args.extend(SMALL);
    afdep(&args);
    let file = dir.path().join("moe-inputs-9.safetensors");
    let out = Command::new(&py)
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .arg(peers_dir().join("moe_inputs.py"))
        .args(["describe", file.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["metadata"]["top_k"], "2");
    assert_eq!(v["metadata"]["seed"], "0");
    let shape = small_shape();
    let p = LayerParams::random(shape, 0);
    let x = random_tokens(9, 32, 0);
    let mut want: Vec<(&str, Vec<usize>, &[bf16])> = vec![("x", vec![9, 32], &x)];
    for ((name, t), dims) in PARAM_NAMES
        .iter()
        .zip(p.tensors())
        .zip(LayerParams::dims(&shape))
    {
        want.push((name, dims, t));
    }
    for (name, dims, vals) in want {
        let t = &v["tensors"][name];
        assert_eq!(t["dtype"], "BF16", "{name}");
        assert_eq!(t["shape"], serde_json::json!(dims), "{name}");
        let first: Vec<f32> = t["first"]
            .as_array()
            .unwrap()
            .iter()
            .map(|f| f.as_f64().unwrap() as f32)
            .collect();
        let w: Vec<f32> = vals[..4].iter().map(|b| b.to_f32()).collect();
        assert_eq!(first, w, "{name}");
    }
    // a file that is not safetensors: a clear error, no traceback
    let bad = dir.path().join("bad.safetensors");
    std::fs::write(&bad, b"\xff\xff\xff\xff\xff\xff\xff\x7fjunk").unwrap();
    let out = Command::new(&py)
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .arg(peers_dir().join("moe_inputs.py"))
        .args(["describe", bad.to_str().unwrap()])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("header length"),
        "{err}"
    );
    assert!(!err.contains("Traceback"), "{err}");
}

/// Runs a peer script on afdep's inputs and the oracle's outputs (CPU); its errors must be
/// within the GPU layer's tolerances and its routes the oracle's.
fn peer_matches_the_oracle(
    py: &str,
    script: &str,
    extra: &[&str],
    shape_args: &[&str],
) -> serde_json::Value {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_str().unwrap();
    let mut args = vec!["moe", "--backend", "cpu", "--tokens", "200"];
    args.extend(shape_args);
    args.extend(["--write-inputs", d, "--write-outputs", d]);
    afdep(&args);
    let out = Command::new(py)
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .arg(peers_dir().join(script))
        .args([
            "--inputs",
            d,
            "--afdep-outputs",
            d,
            "--iters",
            "2",
            "--warmups",
            "1",
        ])
        .args(extra)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{script}:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rows = rows_of(&stdout);
    assert_eq!(rows.len(), 1, "{stdout}");
    let r = &rows[0];
    assert_eq!(r["status"], "ok", "{r}");
    assert_eq!(r["tokens"], 200);
    assert_eq!(r["route_mismatch_tokens"], 0, "{r}");
    for (f, tol) in [
        ("out_err", afdep_moe::accuracy::OUT_TOL),
        ("gx_err", afdep_moe::accuracy::DX_TOL),
        ("gw_err", afdep_moe::accuracy::GRAD_TOL),
    ] {
        let e = r[f].as_f64().unwrap_or(f64::INFINITY);
        assert!(e <= tol, "{script} {shape_args:?}: {f} = {e} > {tol}: {r}");
    }
    for f in ["fwd_ms", "train_ms"] {
        assert!(r[f].as_f64().is_some_and(|v| v > 0.0), "{r}");
    }
    r.clone()
}

#[test]
fn the_torch_peer_computes_the_oracles_function() {
    let Some(py) = python_with("numpy, torch") else {
        return;
    };
    // its own f32 oracle (hand-written backward) against autograd in f64
    let out = Command::new(&py)
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .arg(peers_dir().join("moe_torch.py"))
        .arg("--self-test")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    // the peer against afdep's outputs and against its oracle; no host sync when timed
    let r = peer_matches_the_oracle(
        &py,
        "moe_torch.py",
        &["--device", "cpu", "--check-syncs"],
        &SMALL,
    );
    assert_eq!(r["syncs_checked"], "error");
    for (f, tol) in [
        ("oracle_out_err", afdep_moe::accuracy::OUT_TOL),
        ("oracle_gx_err", afdep_moe::accuracy::DX_TOL),
        ("oracle_gw_err", afdep_moe::accuracy::GRAD_TOL),
    ] {
        let e = r[f].as_f64().unwrap_or(f64::INFINITY);
        assert!(e <= tol, "{f} = {e} > {tol}: {r}");
    }
    // the check can fail: a step that syncs (planted) is an error row
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_str().unwrap();
    let mut args = vec![
        "moe",
        "--tokens",
        "50",
        "--inputs-only",
        "--write-inputs",
        d,
    ];
    args.extend(SMALL);
    afdep(&args);
    // the torch peer on the CPU on those inputs, `iters` timed runs, then `extra`
    let torch_peer = |iters: &str, extra: &[&str]| {
        Command::new(&py)
            .env("PYTHONDONTWRITEBYTECODE", "1")
            .arg(peers_dir().join("moe_torch.py"))
            .args(["--inputs", d, "--device", "cpu", "--iters", iters])
            .args(["--warmups", "0"])
            .args(extra)
            .output()
            .unwrap()
    };
    let out = torch_peer(
        "1",
        &["--check-syncs", "--debug-inject-sync", "--no-oracle"],
    );
    let rows = rows_of(&String::from_utf8_lossy(&out.stdout));
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0]["status"], "error", "{}", rows[0]);
    assert!(
        rows[0]["note"]
            .as_str()
            .unwrap()
            .contains("host synchronisation inside the timed region: Tensor.item"),
        "{}",
        rows[0]
    );
    // counted instead (the suite's mode): the row keeps its times and says how many
    let out = torch_peer(
        "2",
        &[
            "--check-syncs",
            "count",
            "--debug-inject-sync",
            "--no-oracle",
        ],
    );
    let rows = rows_of(&String::from_utf8_lossy(&out.stdout));
    assert_eq!(rows[0]["status"], "ok", "{}", rows[0]);
    assert!(rows[0]["host_syncs"].as_u64().unwrap() >= 2, "{}", rows[0]);
    peer_matches_the_oracle(&py, "moe_torch.py", &["--device", "cpu"], &NARROW);
}

#[test]
fn the_jax_peer_computes_the_oracles_function() {
    let Some(py) = python_with("numpy, jax") else {
        return;
    };
    peer_matches_the_oracle(&py, "moe_jax.py", &["--platform", "cpu"], &SMALL);
    peer_matches_the_oracle(&py, "moe_jax.py", &["--platform", "cpu"], &NARROW);
}

/// `peers/run_suite.sh` end to end on the CPU: a bundle whose `bin/afdep` runs this build (the
/// CPU oracle, its rows named as the GPU layer's so that the report takes them), the record
/// shape at 16 tokens, the torch peer when this Python has torch: rows per cell, the input file
/// deleted after its peers, the report and the chart written.
#[test]
fn the_suite_script_runs_a_cell_its_peers_and_the_report() {
    let dir = tempfile::tempdir().unwrap();
    let b = dir.path().join("bundle");
    std::fs::create_dir_all(b.join("bin")).unwrap();
    std::fs::create_dir_all(b.join("docs/perf")).unwrap();
    std::fs::create_dir_all(b.join("peers")).unwrap();
    for f in [
        "run_suite.sh",
        "bundle_setup.sh",
        "moe_torch.py",
        "moe_inputs.py",
        "moe_jax.py",
    ] {
        std::fs::copy(peers_dir().join(f), b.join("peers").join(f)).unwrap();
    }
    std::fs::write(b.join("docs/perf/moe.md"), "# MoE\n\nhand-written\n").unwrap();
    std::fs::write(b.join("commit.txt"), "test\n").unwrap();
    let stand_in = b.join("bin/afdep");
    std::fs::write(
        &stand_in,
        "#!/usr/bin/env bash\n\
         out=\"\"; prev=\"\"\n\
         for a in \"$@\"; do [ \"$prev\" = --json-out ] && out=$a; prev=$a; done\n\
         \"$AFDEP_REAL\" \"$@\"; rc=$?\n\
         [ -n \"$out\" ] && [ -f \"$out\" ] && sed -i 's/\"impl\":\"afdep-cpu-oracle\"/\"impl\":\"afdep\"/' \"$out\"\n\
         exit $rc\n",
    )
    .unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&stand_in, std::fs::Permissions::from_mode(0o755)).unwrap();
    let torch = python_with("numpy, torch");
    let py = torch
        .clone()
        .unwrap_or_else(|| std::env::var("AFDEP_PEER_PYTHON").unwrap_or("python3".into()));
    let out = dir.path().join("out");
    let work = dir.path().join("work");
    // the record shape at 16 tokens on the CPU, then `extra`
    let suite = |extra: &[&str]| {
        Command::new("bash")
            .arg(b.join("peers/run_suite.sh"))
            .arg(&b)
            .arg(&out)
            .args(["--suite", "record", "--tokens", "16", "--backend", "cpu"])
            .args(extra)
            .env("AFDEP_REAL", env!("CARGO_BIN_EXE_afdep"))
            .output()
            .unwrap()
    };
    let o = suite(&[
        "--iters",
        "1",
        "--torch-impls",
        "eager",
        "--python",
        &py,
        "--work",
        work.to_str().unwrap(),
        "--peers",
        if torch.is_some() { "torch" } else { "none" },
    ]);
    let log = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{log}");
    let afdep_rows = rows_of(&std::fs::read_to_string(out.join("afdep.jsonl")).unwrap());
    assert_eq!(afdep_rows.len(), 1, "{afdep_rows:?}");
    assert_eq!(afdep_rows[0]["shape"], "record");
    assert_eq!(afdep_rows[0]["tokens"], 16);
    let torch_rows = rows_of(&std::fs::read_to_string(out.join("torch.jsonl")).unwrap());
    if torch.is_some() {
        assert_eq!(torch_rows.len(), 1, "{torch_rows:?}");
        assert_eq!(torch_rows[0]["shape"], "record");
        assert_eq!(torch_rows[0]["status"], "ok", "{}", torch_rows[0]);
        assert_eq!(torch_rows[0]["host_syncs"], 0, "{}", torch_rows[0]);
    } else {
        assert!(torch_rows.is_empty());
    }
    // the cell's inputs are gone after its peers ran
    assert!(!work.join("record/moe-inputs-16.safetensors").exists());
    let md = std::fs::read_to_string(out.join("moe.md")).unwrap();
    assert!(md.starts_with("# MoE\n\nhand-written\n"), "{md}");
    assert!(md.contains("| record | 16 |"), "{md}");
    assert!(
        std::fs::read(out.join("moe.png"))
            .unwrap()
            .starts_with(b"\x89PNG")
    );
    assert!(log.contains("record, 16 tokens: afdep rc=0"), "{log}");

    // a spent budget: the cell is not run, its row says so, the report is still written
    let o = suite(&["--budget", "0", "--peers", "none"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let rows = rows_of(&std::fs::read_to_string(out.join("afdep.jsonl")).unwrap());
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0]["status"], "skipped");
    let md = std::fs::read_to_string(out.join("moe.md")).unwrap();
    assert!(md.contains("| record | 16 | no ok row |"), "{md}");
}
