//! The config file of `afdep exchange --config FILE`: the exchange configuration (topology,
//! hidden size, experts, top-k, capacity, payload, knobs) and the transport, in TOML (a `.toml`
//! file) or JSON (a `.json` file, or any file whose first non-blank character is `{`).
//!
//! ```toml
//! topology = "3A:1F"
//! hidden = 2048
//! experts = 128
//! # experts_per_rank = 32     # default: experts / FFN ranks
//! top_k = 8
//! capacity = 2048
//! payload = "bf16"            # bf16 | fp8_e4m3
//! partials = "f32"            # f32 (exact) | bf16 (half the combine's return bytes, not bit-identical)
//! transport = "nvlink"        # or a table: [transport] kind = "ucx", ucx_tls = "tcp", ...
//!
//! [knobs]                     # any subset; the others keep their defaults
//! transport_sms = 24
//! epilogue_sm_cap = 16
//! payload_gate = true
//! warps_per_unit = 4
//! min_rows_per_unit = 8
//! min_token_bucket = 1
//! ```
//!
//! Every field is optional: a command-line flag given overrides the file, and a field neither
//! sets keeps the command's default. Unknown fields are errors (a misspelt knob must not be
//! silently ignored); every error names the file and the field ([`ConfigFileError`]), and the
//! values are then checked by [`ExchangeConfig::validate`](afdep_core::ExchangeConfig::validate), whose errors name the field too.

use std::path::{Path, PathBuf};

use afdep_core::{CombinePartials, ConfigError, ExchangeKnobs, PayloadKind, Topology};
use afdep_transport::TransportConfig;
use serde::Deserialize;
use thiserror::Error;

/// Why a config file cannot be used.
#[derive(Debug, Error)]
pub enum ConfigFileError {
    /// The file cannot be read.
    #[error("config file {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The text is not valid TOML / JSON, or a field is unknown or of the wrong type.
    #[error("config file {path}: field `{field}`: {why}")]
    Field {
        /// The file.
        path: PathBuf,
        /// The field's path (`knobs.transport_sms`; `.` for the whole file).
        field: String,
        /// What is wrong.
        why: String,
    },
    /// A value is outside its allowed range (the field is named by the [`ConfigError`]).
    #[error("config file {path}: {source}")]
    Invalid {
        /// The file.
        path: PathBuf,
        /// The check that failed.
        source: ConfigError,
    },
}

/// The knobs of a config file: each one optional.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KnobsFile {
    /// [`ExchangeKnobs::min_token_bucket`].
    pub min_token_bucket: Option<usize>,
    /// [`ExchangeKnobs::epilogue_sm_cap`].
    pub epilogue_sm_cap: Option<u32>,
    /// [`ExchangeKnobs::payload_gate`].
    pub payload_gate: Option<bool>,
    /// [`ExchangeKnobs::warps_per_unit`].
    pub warps_per_unit: Option<u32>,
    /// [`ExchangeKnobs::min_rows_per_unit`].
    pub min_rows_per_unit: Option<u32>,
    /// [`ExchangeKnobs::transport_sms`].
    pub transport_sms: Option<u32>,
}

impl KnobsFile {
    /// Sets the knobs this names on `k`; `over` (the command line) wins over `self`.
    pub fn apply(&self, over: &KnobsFile, k: &mut ExchangeKnobs) {
        macro_rules! set {
            ($($f:ident),*) => {$(
                if let Some(v) = over.$f.or(self.$f) {
                    k.$f = v;
                }
            )*};
        }
        set!(
            min_token_bucket,
            epilogue_sm_cap,
            payload_gate,
            warps_per_unit,
            min_rows_per_unit,
            transport_sms
        );
    }
}

/// The contents of a config file; see the [module docs](self).
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExchangeFile {
    /// Ranks: `3A:1F`, `2A:2F`, `1A:3F`, `EP4`, ...
    pub topology: Option<Topology>,
    /// Hidden size.
    pub hidden: Option<usize>,
    /// Number of experts.
    pub experts: Option<usize>,
    /// Experts per FFN rank.
    pub experts_per_rank: Option<usize>,
    /// Slots per token.
    pub top_k: Option<usize>,
    /// Most tokens per attention rank.
    pub capacity: Option<usize>,
    /// Dispatch payload format.
    pub payload: Option<PayloadKind>,
    /// How the combine's partials travel (`f32`, the default, or `bf16`).
    pub partials: Option<CombinePartials>,
    /// Fused-engine knobs.
    #[serde(default)]
    pub knobs: KnobsFile,
    /// The transport: a kind, or a table with its options.
    pub transport: Option<TransportConfig>,
}

/// Whether `path` holds TOML (by its extension, else by its first non-blank character).
fn is_toml(path: &Path, text: &str) -> bool {
    match path.extension().and_then(|e| e.to_str()) {
        Some(e) if e.eq_ignore_ascii_case("toml") => true,
        Some(e) if e.eq_ignore_ascii_case("json") => false,
        _ => !text.trim_start().starts_with('{'),
    }
}

impl ExchangeFile {
    /// Parses `text`, the contents of `path` (which decides the format, see [`is_toml`]).
    pub fn parse(path: &Path, text: &str) -> Result<ExchangeFile, ConfigFileError> {
        let field = |p: String, why: String| ConfigFileError::Field {
            path: path.to_path_buf(),
            field: if p.is_empty() { ".".into() } else { p },
            why,
        };
        if is_toml(path, text) {
            let de = toml::Deserializer::new(text);
            serde_path_to_error::deserialize(de).map_err(|e| {
                let p = e.path().to_string();
                field(p, e.into_inner().message().trim().to_string())
            })
        } else {
            let mut de = serde_json::Deserializer::from_str(text);
            let v: ExchangeFile = serde_path_to_error::deserialize(&mut de).map_err(|e| {
                let p = e.path().to_string();
                field(p, e.into_inner().to_string())
            })?;
            de.end().map_err(|e| field(String::new(), e.to_string()))?;
            Ok(v)
        }
    }

    /// Reads and parses `path`.
    pub fn read(path: &Path) -> Result<ExchangeFile, ConfigFileError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigFileError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        ExchangeFile::parse(path, &text)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use afdep_transport::TransportKind;

    fn field_of(e: ConfigFileError) -> String {
        match e {
            ConfigFileError::Field { field, .. } => field,
            other => panic!("expected a field error, got {other}"),
        }
    }

    #[test]
    fn toml_and_json_read_the_same_config() {
        let toml_text = r#"
            topology = "2A:2F"
            hidden = 256
            experts = 16
            top_k = 4
            capacity = 64
            payload = "bf16"
            transport = "nvlink"
            [knobs]
            transport_sms = 7
            payload_gate = false
        "#;
        let json_text = r#"{"topology": "2A:2F", "hidden": 256, "experts": 16, "top_k": 4,
            "capacity": 64, "payload": "bf16", "transport": "nvlink",
            "knobs": {"transport_sms": 7, "payload_gate": false}}"#;
        let a = ExchangeFile::parse(Path::new("x.toml"), toml_text).unwrap();
        let b = ExchangeFile::parse(Path::new("x.json"), json_text).unwrap();
        assert_eq!(a, b);
        assert_eq!(a.topology, Some("2A:2F".parse().unwrap()));
        assert_eq!(
            a.transport.as_ref().unwrap().kind(),
            TransportKind::NvlinkIpc
        );
        let mut k = ExchangeKnobs::default();
        a.knobs.apply(&KnobsFile::default(), &mut k);
        assert_eq!(k.transport_sms, 7);
        assert!(!k.payload_gate);
        assert_eq!(k.epilogue_sm_cap, ExchangeKnobs::default().epilogue_sm_cap);
        // the command line wins
        let over = KnobsFile {
            transport_sms: Some(23),
            ..KnobsFile::default()
        };
        a.knobs.apply(&over, &mut k);
        assert_eq!(k.transport_sms, 23);
        // a file without an extension: JSON by its first character, else TOML
        assert_eq!(ExchangeFile::parse(Path::new("cfg"), json_text).unwrap(), a);
        assert_eq!(ExchangeFile::parse(Path::new("cfg"), toml_text).unwrap(), a);
    }

    #[test]
    fn a_transport_table_is_read() {
        let f = ExchangeFile::parse(
            Path::new("x.toml"),
            "[transport]\nkind = \"ucx\"\nucx_tls = \"shm\"\ntimeout_ms = 1500\n",
        )
        .unwrap();
        let t = f.transport.unwrap();
        assert_eq!(t.kind(), TransportKind::Ucx);
        assert_eq!(t.options().ucx_tls.as_deref(), Some("shm"));
        assert_eq!(t.options().timeout.as_millis(), 1500);
    }

    #[test]
    fn bad_fields_are_named() {
        let p = Path::new("x.toml");
        assert_eq!(
            field_of(ExchangeFile::parse(p, "hiden = 3").unwrap_err()),
            "hiden"
        );
        let e = ExchangeFile::parse(p, "hiden = 3").unwrap_err().to_string();
        assert!(e.contains("unknown field"), "{e}");
        assert_eq!(
            field_of(ExchangeFile::parse(p, "hidden = \"big\"").unwrap_err()),
            "hidden"
        );
        assert_eq!(
            field_of(ExchangeFile::parse(p, "[knobs]\ntransport_sms = -1\n").unwrap_err()),
            "knobs.transport_sms"
        );
        let e = ExchangeFile::parse(p, "[knobs]\ntransport_smz = 3\n").unwrap_err();
        assert!(e.to_string().contains("unknown field"), "{e}");
        assert_eq!(field_of(e), "knobs.transport_smz");
        assert_eq!(
            field_of(ExchangeFile::parse(p, "topology = \"5Q\"").unwrap_err()),
            "topology"
        );
        assert_eq!(
            field_of(ExchangeFile::parse(p, "transport = \"mpi\"").unwrap_err()),
            "transport"
        );
        let j = Path::new("x.json");
        assert_eq!(
            field_of(
                ExchangeFile::parse(j, r#"{"knobs": {"warps_per_unit": "four"}}"#).unwrap_err()
            ),
            "knobs.warps_per_unit"
        );
        assert_eq!(
            field_of(ExchangeFile::parse(j, r#"{"capacity": 3} trailing"#).unwrap_err()),
            "."
        );
    }
}
