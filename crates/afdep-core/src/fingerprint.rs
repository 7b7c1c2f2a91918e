//! The configuration fingerprint that ranks compare at initialisation.
//!
//! A fingerprint is the ordered list of `(field, value)` pairs of an [`ExchangeConfig`] plus
//! a sha256 digest over them. Ranks exchange fingerprints (as bytes, through the transport's
//! control plane) and compare them; the first differing field is named in the error.

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::config::ExchangeConfig;
use crate::error::ConfigError;

/// The comparable form of a configuration.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Fingerprint {
    /// `(field, value)` in a fixed order.
    pub fields: Vec<(String, String)>,
}

impl Fingerprint {
    /// The fingerprint of an exchange configuration (every field, knobs included).
    pub fn of_exchange(c: &ExchangeConfig) -> Self {
        let k = &c.knobs;
        let f = |n: &str, v: String| (n.to_string(), v);
        Fingerprint {
            fields: vec![
                f("version", env!("CARGO_PKG_VERSION").to_string()),
                f("topology", c.topology.to_string()),
                f("hidden", c.hidden.to_string()),
                f("experts", c.experts.to_string()),
                f("experts_per_rank", c.experts_per_rank.to_string()),
                f("top_k", c.top_k.to_string()),
                f("capacity", c.capacity.to_string()),
                f("payload", c.payload.to_string()),
                f("partials", c.partials.to_string()),
                f("knobs.min_token_bucket", k.min_token_bucket.to_string()),
                f("knobs.epilogue_sm_cap", k.epilogue_sm_cap.to_string()),
                f("knobs.payload_gate", k.payload_gate.to_string()),
                f("knobs.warps_per_unit", k.warps_per_unit.to_string()),
                f("knobs.min_rows_per_unit", k.min_rows_per_unit.to_string()),
                f("knobs.transport_sms", k.transport_sms.to_string()),
            ],
        }
    }

    /// sha256 over the fields, hex.
    pub fn digest(&self) -> String {
        let mut h = Sha256::new();
        for (k, v) in &self.fields {
            h.update(k.as_bytes());
            h.update([0]);
            h.update(v.as_bytes());
            h.update([0]);
        }
        h.finalize().iter().map(|b| format!("{b:02x}")).collect()
    }

    /// The wire form (JSON bytes).
    pub fn to_bytes(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("a list of strings serializes")
    }

    /// Parses the wire form.
    pub fn from_bytes(b: &[u8]) -> Result<Self, ConfigError> {
        serde_json::from_slice(b).map_err(|e| ConfigError::Invalid {
            field: "fingerprint",
            value: format!("{} bytes", b.len()),
            reason: format!("not a fingerprint: {e}"),
        })
    }

    /// Compares this rank's fingerprint with `remote`'s; the error names the first field that
    /// differs (or a field present on one side only).
    pub fn compare(
        &self,
        local_rank: usize,
        remote: &Fingerprint,
        remote_rank: usize,
    ) -> Result<(), ConfigError> {
        let n = self.fields.len().max(remote.fields.len());
        for i in 0..n {
            let a = self.fields.get(i);
            let b = remote.fields.get(i);
            if a != b {
                let name = a.or(b).map(|(k, _)| k.clone()).unwrap_or_default();
                let show = |x: Option<&(String, String)>| match x {
                    Some((k, v)) if *k == name => v.clone(),
                    Some((k, v)) => format!("{k}={v}"),
                    None => "absent".to_string(),
                };
                let (local, remote) = (show(a), show(b));
                return Err(ConfigError::Mismatch {
                    field: name,
                    local,
                    remote,
                    local_rank,
                    remote_rank,
                });
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::topology::Topology;

    #[test]
    fn names_the_field_that_differs() {
        let t: Topology = "2A:2F".parse().unwrap();
        let a = ExchangeConfig::new(t, 2048, 128, 8, 2048).unwrap();
        let mut b = a.clone();
        b.knobs.warps_per_unit = 8;
        let fa = Fingerprint::of_exchange(&a);
        let fb = Fingerprint::from_bytes(&Fingerprint::of_exchange(&b).to_bytes()).unwrap();
        assert_ne!(fa.digest(), fb.digest());
        match fa.compare(0, &fb, 3) {
            Err(ConfigError::Mismatch {
                field,
                local,
                remote,
                local_rank: 0,
                remote_rank: 3,
            }) => {
                assert_eq!(field, "knobs.warps_per_unit");
                assert_eq!((local.as_str(), remote.as_str()), ("4", "8"));
            }
            other => panic!("{other:?}"),
        }
        fa.compare(0, &Fingerprint::of_exchange(&a), 1).unwrap();
    }

    /// bf16 partials change the combine's result and its wire format: ranks that disagree on
    /// them must not talk.
    #[test]
    fn partials_are_fingerprinted() {
        let t: Topology = "2A:2F".parse().unwrap();
        let a = ExchangeConfig::new(t, 2048, 128, 8, 2048).unwrap();
        let mut b = a.clone();
        b.partials = crate::CombinePartials::Bf16;
        let (fa, fb) = (Fingerprint::of_exchange(&a), Fingerprint::of_exchange(&b));
        assert_ne!(fa.digest(), fb.digest());
        match fb.compare(1, &fa, 0) {
            Err(ConfigError::Mismatch {
                field,
                local,
                remote,
                ..
            }) => {
                assert_eq!(field, "partials");
                assert_eq!((local.as_str(), remote.as_str()), ("bf16", "f32"));
            }
            other => panic!("{other:?}"),
        }
    }
}
