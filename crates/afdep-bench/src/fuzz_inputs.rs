//! Fuzzing the CLI's input readers with proptest, bounded so that CI runs it in seconds (unit
//! tests of the binary, run by `cargo test -p afdep-bench` and `cargo xtask test`):
//!
//! - the safetensors reader ([`TensorFile::read`] and its typed accessors) on arbitrary bytes
//!   and on near-valid files (a well-formed header whose dtypes, shapes, offsets and lengths the
//!   strategy changes, data cut short or extended);
//! - the exchange config file parser ([`ExchangeFile::parse`], TOML and JSON) on arbitrary text
//!   and on valid files with one value replaced by an arbitrary token, then the values merged
//!   and checked as `afdep exchange` does ([`ExchangeConfig::validate`], the fused engine's
//!   workspace size of a valid config).
//!
//! Each must return a value or a typed error, never panic.

use std::path::Path;

use afdep_core::{ExchangeConfig, ExchangeKnobs, Topology};
use proptest::prelude::*;

use crate::exchange_config::{ExchangeFile, KnobsFile};
use crate::tensor_file::TensorFile;

/// Reads `bytes` as a safetensors file and every tensor through every accessor.
fn read_tensor_file(dir: &Path, bytes: &[u8]) {
    let p = dir.join("fuzz.safetensors");
    std::fs::write(&p, bytes).unwrap();
    if let Ok(f) = TensorFile::read(&p) {
        let names: Vec<String> = f.tensors.keys().cloned().collect();
        for n in names {
            let _ = f.bf16(&n);
            let _ = f.f32(&n);
            let _ = f.i32(&n);
        }
        let _ = f.bf16("absent");
    }
}

/// A safetensors file: `u64` header length, JSON header, data. The strategy picks the tensors'
/// dtypes, shapes and offsets (consistent or not), the declared header length and the data
/// length.
fn near_safetensors() -> impl Strategy<Value = Vec<u8>> {
    let dtype = prop_oneof![
        Just("BF16"),
        Just("F16"),
        Just("F32"),
        Just("I32"),
        Just("F64"),
        Just("U8"),
        Just("BOOL"),
        Just("F8_E4M3"),
        Just("X"),
    ];
    let dim = prop_oneof![8 => 0u64..6, 1 => Just(u64::MAX), 1 => Just(1u64 << 33)];
    let tensor = (
        dtype,
        proptest::collection::vec(dim, 0..4),
        prop_oneof![
            12 => Just(None),
            2 => (any::<u64>(), any::<u64>()).prop_map(Some),
            1 => Just(Some((0, u64::MAX))),
        ],
    );
    (
        proptest::collection::vec(tensor, 0..4),
        prop_oneof![6 => Just(None), 1 => any::<u64>().prop_map(Some)],
        -8i64..8,
        any::<bool>(),
    )
        .prop_map(|(tensors, header_lie, data_delta, meta)| {
            let size = |d: &str| match d {
                "BF16" | "F16" => 2u64,
                "F32" | "I32" => 4,
                "F64" => 8,
                _ => 1,
            };
            let mut entries = Vec::new();
            let mut at = 0u64;
            for (i, (d, shape, offsets)) in tensors.iter().enumerate() {
                let n = shape
                    .iter()
                    .try_fold(size(d), |a, &b| a.checked_mul(b))
                    .unwrap_or(u64::MAX);
                let (b, e) = offsets.unwrap_or((at, at.saturating_add(n)));
                at = e.min(1 << 12);
                let shape: Vec<String> = shape.iter().map(u64::to_string).collect();
                entries.push(format!(
                    "\"t{i}\":{{\"dtype\":\"{d}\",\"shape\":[{}],\"data_offsets\":[{b},{e}]}}",
                    shape.join(",")
                ));
            }
            if meta {
                entries.push("\"__metadata__\":{\"top_k\":\"2\"}".into());
            }
            let header = format!("{{{}}}", entries.join(","));
            let mut out = header_lie
                .unwrap_or(header.len() as u64)
                .to_le_bytes()
                .to_vec();
            out.extend_from_slice(header.as_bytes());
            let data = (at as i64 + data_delta).clamp(0, 1 << 13) as usize;
            out.extend((0..data).map(|i| (i * 37) as u8));
            out
        })
}

/// A valid config file in TOML and the same in JSON.
const TOML: &str = r#"
topology = "3A:1F"
hidden = 256
experts = 16
top_k = 4
capacity = 64
payload = "bf16"
transport = "nvlink"
[knobs]
transport_sms = 7
payload_gate = false
min_token_bucket = 32
"#;
const JSON: &str = r#"{"topology": "2A:2F", "hidden": 128, "experts": 8, "experts_per_rank": 4,
 "top_k": 2, "capacity": 32, "payload": "fp8_e4m3",
 "transport": {"kind": "ucx", "ucx_tls": "tcp"}, "knobs": {"warps_per_unit": 4}}"#;

/// What could replace a value in a config file.
fn token() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("0".to_string()),
        Just("-1".to_string()),
        Just("18446744073709551615".to_string()),
        Just("18446744073709551616".to_string()),
        Just("4294967296".to_string()),
        Just("1e308".to_string()),
        Just("nan".to_string()),
        Just("\"\"".to_string()),
        Just("\"99A:99F\"".to_string()),
        Just("\"EP0\"".to_string()),
        Just("\"0A:1F\"".to_string()),
        Just("[1, 2]".to_string()),
        Just("{}".to_string()),
        Just("true".to_string()),
        Just("null".to_string()),
        "[ -~]{0,12}",
        any::<u64>().prop_map(|v| v.to_string()),
    ]
}

/// Replaces the value of the `nth` `key = value` (TOML) or `"key": value` (JSON) with `tok`.
fn replace_value(text: &str, nth: usize, tok: &str, json: bool) -> String {
    let sep = if json { ": " } else { " = " };
    let spots: Vec<usize> = text
        .match_indices(sep)
        .map(|(i, _)| i + sep.len())
        .collect();
    if spots.is_empty() {
        return text.to_string();
    }
    let at = spots[nth % spots.len()];
    let rest = &text[at..];
    let end = rest
        .find(if json { [',', '}'] } else { ['\n', '\n'] })
        .unwrap_or(rest.len());
    format!("{}{tok}{}", &text[..at], &rest[end..])
}

/// Parses `text` as `afdep exchange --config` does, then merges it with the defaults and checks
/// it as `ExchangeArgs::resolve` does.
fn parse_and_check(name: &str, text: &str) {
    let Ok(file) = ExchangeFile::parse(Path::new(name), text) else {
        return;
    };
    let topology: Topology = file
        .topology
        .unwrap_or_else(|| "3A:1F".parse().expect("a topology"));
    let experts = file.experts.unwrap_or(128);
    let mut knobs = ExchangeKnobs::default();
    file.knobs.apply(&KnobsFile::default(), &mut knobs);
    let cfg = ExchangeConfig {
        topology,
        hidden: file.hidden.unwrap_or(2048),
        experts,
        experts_per_rank: file
            .experts_per_rank
            .unwrap_or(experts / topology.ffn_count().max(1)),
        top_k: file.top_k.unwrap_or(8),
        capacity: file.capacity.unwrap_or(2048),
        payload: file.payload.unwrap_or_default(),
        partials: file.partials.unwrap_or_default(),
        knobs,
    };
    if cfg.validate().is_ok() {
        let _ = cfg.placement().owned();
        let _ = afdep_moe::FusedEngine::workspace_bytes(&cfg);
    }
    if let Some(t) = &file.transport {
        let _ = t.options();
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn the_safetensors_reader_survives_arbitrary_bytes(
        bytes in proptest::collection::vec(any::<u8>(), 0..400),
    ) {
        let dir = tempfile::tempdir().unwrap();
        read_tensor_file(dir.path(), &bytes);
    }

    #[test]
    fn the_safetensors_reader_survives_near_valid_files(bytes in near_safetensors()) {
        let dir = tempfile::tempdir().unwrap();
        read_tensor_file(dir.path(), &bytes);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1000, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn the_config_parser_survives_arbitrary_text(text in "(?s).{0,200}") {
        parse_and_check("c.toml", &text);
        parse_and_check("c.json", &text);
        parse_and_check("c", &text);
    }

    #[test]
    fn the_config_parser_survives_one_bad_value(
        nth in 0usize..16,
        tok in token(),
        second in proptest::option::of((0usize..16, token())),
    ) {
        for (name, base, json) in [("c.toml", TOML, false), ("c.json", JSON, true)] {
            let mut text = replace_value(base, nth, &tok, json);
            if let Some((n2, t2)) = &second {
                text = replace_value(&text, *n2, t2, json);
            }
            parse_and_check(name, &text);
        }
    }
}

#[test]
fn the_config_seeds_parse() {
    // the mutation bases are valid, so the mutations reach past the parser
    for (name, text) in [("c.toml", TOML), ("c.json", JSON)] {
        let f = ExchangeFile::parse(Path::new(name), text).unwrap();
        assert!(f.topology.is_some() && f.transport.is_some(), "{name}");
    }
}

#[test]
fn offsets_near_u64_max_are_an_error_not_a_panic() {
    // the safetensors crate (0.4) added the end offset to the header length unchecked: the
    // fuzzer's finding, now refused by `safetensors_guard`
    let header = r#"{"t0":{"dtype":"U8","shape":[18446744073709551615],"data_offsets":[0,18446744073709551615]}}"#;
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header.as_bytes());
    bytes.extend_from_slice(&[0; 16]);
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("big.safetensors");
    std::fs::write(&p, &bytes).unwrap();
    let e = TensorFile::read(&p).unwrap_err();
    assert!(format!("{e:#}").contains("beyond the file"), "{e:#}");
}
