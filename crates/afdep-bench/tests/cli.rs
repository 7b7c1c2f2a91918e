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

fn afdep(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_afdep"))
        .args(args)
        .output()
        .expect("running afdep");
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

#[test]
fn exchange_round_trip_matches_the_oracle() {
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
fn bad_input_gives_an_error_not_a_panic() {
    let out = Command::new(env!("CARGO_BIN_EXE_afdep"))
        .args(["exchange", "--backend", "cpu", "--topology", "3A:0F"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("3A:0F"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}
