//! Shapes and configuration, serializable with serde and validated with typed errors.

use serde::{Deserialize, Serialize};

use crate::error::ConfigError;
use crate::topology::{ExpertPlacement, Topology};

/// The shape of one MoE layer (docs/design.md, "Specification" notation in brackets).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct LayerShape {
    /// Hidden size \[H\].
    pub d_model: usize,
    /// Expert width \[W\] (SwiGLU inner size of each routed expert).
    pub width: usize,
    /// Number of routed experts \[E\].
    pub experts: usize,
    /// Experts per token \[K\].
    pub top_k: usize,
    /// Shared-expert width \[S\]; 0 means no shared expert.
    pub shared: usize,
    /// Renormalise the selected top-k probabilities to sum to one (default on).
    #[serde(default = "default_true")]
    pub renormalize: bool,
}

fn default_true() -> bool {
    true
}

impl LayerShape {
    /// The shape of the MoE-layer record: d_model 512, width 128, 64 experts, top-8, shared 1024.
    pub const RECORD: LayerShape = LayerShape {
        d_model: 512,
        width: 128,
        experts: 64,
        top_k: 8,
        shared: 1024,
        renormalize: true,
    };

    /// The shape of the given sizes with the top-k weights renormalised (the router's default,
    /// docs/design.md, "Specification: Router").
    pub const fn renormalized(
        d_model: usize,
        width: usize,
        experts: usize,
        top_k: usize,
        shared: usize,
    ) -> LayerShape {
        LayerShape {
            d_model,
            width,
            experts,
            top_k,
            shared,
            renormalize: true,
        }
    }

    /// Checks that every field is usable.
    pub fn validate(&self) -> Result<(), ConfigError> {
        positive("d_model", self.d_model)?;
        positive("width", self.width)?;
        positive("experts", self.experts)?;
        positive("top_k", self.top_k)?;
        if self.top_k > self.experts {
            return Err(ConfigError::Invalid {
                field: "top_k",
                value: self.top_k.to_string(),
                reason: format!("more than the {} experts", self.experts),
            });
        }
        if self.experts > i32::MAX as usize {
            return Err(ConfigError::Invalid {
                field: "experts",
                value: self.experts.to_string(),
                reason: "expert ids are i32".into(),
            });
        }
        Ok(())
    }
}

/// The largest hidden size, expert count and capacity an [`ExchangeConfig`] may have: far
/// above any model's, and small enough that every buffer size the engines derive from them
/// (capacity × ranks × top-k × hidden × 4 bytes and the like) is computed without overflow.
pub const MAX_HIDDEN: usize = 1 << 16;
/// See [`MAX_HIDDEN`].
pub const MAX_EXPERTS: usize = 1 << 16;
/// See [`MAX_HIDDEN`].
pub const MAX_CAPACITY: usize = 1 << 24;

fn at_most(field: &'static str, v: usize, max: usize) -> Result<(), ConfigError> {
    if v > max {
        Err(ConfigError::Invalid {
            field,
            value: v.to_string(),
            reason: format!("at most {max}"),
        })
    } else {
        Ok(())
    }
}

pub(crate) fn positive(field: &'static str, v: usize) -> Result<(), ConfigError> {
    if v == 0 {
        Err(ConfigError::Invalid {
            field,
            value: "0".into(),
            reason: "must be positive".into(),
        })
    } else {
        Ok(())
    }
}

/// How token rows travel in dispatch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum PayloadKind {
    /// bf16 rows, as stored.
    #[default]
    Bf16,
    /// fp8 e4m3 rows with one f32 scale per 128 channels per token.
    Fp8E4m3,
}

impl std::fmt::Display for PayloadKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            PayloadKind::Bf16 => "bf16",
            PayloadKind::Fp8E4m3 => "fp8_e4m3",
        })
    }
}

/// How each FFN rank's partial sum travels back to the source in the combine
/// (docs/design.md, "Specification: AFD exchange", "bf16 partials"). The default is the exact
/// path; [`CombinePartials::Bf16`] is an opt-in that halves the combine's return bytes and is
/// **not** bit-identical to it: each partial is rounded to bf16 once more, and the result stays
/// within [`crate::oracle::exchange::bf16_partials_error_bound`] of the exact one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum CombinePartials {
    /// Each partial travels as `hidden` f32, as computed (4 bytes a channel): the exact path,
    /// bit-identical across engines and to the oracle.
    #[default]
    F32,
    /// Each partial is rounded to bf16 (round to nearest, ties to even: `bf16::from_f32`) on its
    /// FFN rank and travels as `hidden` bf16 (2 bytes a channel); the source widens it back to
    /// f32 exactly and sums as with [`CombinePartials::F32`].
    Bf16,
}

impl CombinePartials {
    /// A partial as the source adds it: itself ([`CombinePartials::F32`]) or rounded to bf16
    /// and widened back ([`CombinePartials::Bf16`]). This is the one place the bf16 rounding of
    /// the partials is defined; the oracle's combine applies it to every partial.
    pub fn as_received(self, partial: f32) -> f32 {
        match self {
            CombinePartials::F32 => partial,
            CombinePartials::Bf16 => half::bf16::from_f32(partial).to_f32(),
        }
    }

    /// Bytes of one channel of a partial on the way back.
    pub fn bytes_per_channel(self) -> usize {
        match self {
            CombinePartials::F32 => 4,
            CombinePartials::Bf16 => 2,
        }
    }
}

impl std::fmt::Display for CombinePartials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            CombinePartials::F32 => "f32",
            CombinePartials::Bf16 => "bf16",
        })
    }
}

/// The knobs of the fused exchange (docs/design.md, "Specification: AFD exchange"), agreed across
/// ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ExchangeKnobs {
    /// Rounds with at least this many tokens on the largest source use count-first dispatch
    /// (the source arm); below it, payload-first. Default 1: every round with a token takes the
    /// source arm, the fastest arm at every token count measured (docs/perf/exchange.md, "The
    /// auto arm takes the source arm"); the record's rule is 2048 with the streaming arm.
    pub min_token_bucket: usize,
    /// Most SMs the streaming or copy epilogue may occupy on an FFN rank.
    pub epilogue_sm_cap: u32,
    /// Whether the epilogue waits on a per-source payload gate before reading rows.
    pub payload_gate: bool,
    /// Warps per work unit of the epilogue.
    pub warps_per_unit: u32,
    /// Minimum rows a work unit takes.
    pub min_rows_per_unit: u32,
    /// SMs the dispatch and combine kernels use for transport.
    pub transport_sms: u32,
}

impl Default for ExchangeKnobs {
    fn default() -> Self {
        ExchangeKnobs {
            min_token_bucket: 1,
            epilogue_sm_cap: 16,
            payload_gate: true,
            warps_per_unit: 4,
            min_rows_per_unit: 8,
            transport_sms: 24,
        }
    }
}

impl ExchangeKnobs {
    /// Checks that every knob is usable.
    pub fn validate(&self) -> Result<(), ConfigError> {
        positive("knobs.min_token_bucket", self.min_token_bucket)?;
        positive("knobs.epilogue_sm_cap", self.epilogue_sm_cap as usize)?;
        positive("knobs.warps_per_unit", self.warps_per_unit as usize)?;
        positive("knobs.min_rows_per_unit", self.min_rows_per_unit as usize)?;
        positive("knobs.transport_sms", self.transport_sms as usize)?;
        if self.warps_per_unit > 32 {
            return Err(ConfigError::Invalid {
                field: "knobs.warps_per_unit",
                value: self.warps_per_unit.to_string(),
                reason: "a unit is at most one 1024-thread block (32 warps)".into(),
            });
        }
        Ok(())
    }
}

/// The configuration of one AFD exchange; every rank must hold the same one.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ExchangeConfig {
    /// Roles of the ranks.
    pub topology: Topology,
    /// Hidden size of a token row.
    pub hidden: usize,
    /// Number of expert ids the router may emit.
    pub experts: usize,
    /// Experts owned by each FFN rank, contiguously; `experts_per_rank * ffn_ranks <= experts`,
    /// and ids at or above the product are owned by nobody ("dummy").
    pub experts_per_rank: usize,
    /// Slots per token.
    pub top_k: usize,
    /// Most tokens an attention rank may send in one round.
    pub capacity: usize,
    /// Dispatch payload format.
    #[serde(default)]
    pub payload: PayloadKind,
    /// How the FFN ranks' partial sums travel back in the combine (default f32: exact).
    #[serde(default)]
    pub partials: CombinePartials,
    /// Fused-engine knobs.
    #[serde(default)]
    pub knobs: ExchangeKnobs,
}

impl ExchangeConfig {
    /// A configuration with every expert placed (`experts_per_rank = experts / ffn ranks`)
    /// and default knobs.
    pub fn new(
        topology: Topology,
        hidden: usize,
        experts: usize,
        top_k: usize,
        capacity: usize,
    ) -> Result<Self, ConfigError> {
        let f = topology.ffn_count();
        if f == 0 || experts % f != 0 {
            return Err(ConfigError::Invalid {
                field: "experts",
                value: experts.to_string(),
                reason: format!("must be a multiple of the {f} FFN ranks"),
            });
        }
        let cfg = ExchangeConfig {
            topology,
            hidden,
            experts,
            experts_per_rank: experts / f,
            top_k,
            capacity,
            payload: PayloadKind::Bf16,
            partials: CombinePartials::F32,
            knobs: ExchangeKnobs::default(),
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// Checks the configuration.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.topology.validate()?;
        positive("hidden", self.hidden)?;
        positive("experts", self.experts)?;
        positive("experts_per_rank", self.experts_per_rank)?;
        positive("top_k", self.top_k)?;
        positive("capacity", self.capacity)?;
        at_most("hidden", self.hidden, MAX_HIDDEN)?;
        at_most("experts", self.experts, MAX_EXPERTS)?;
        at_most("capacity", self.capacity, MAX_CAPACITY)?;
        if self.top_k > self.experts {
            return Err(ConfigError::Invalid {
                field: "top_k",
                value: self.top_k.to_string(),
                reason: format!("more than the {} experts", self.experts),
            });
        }
        let owned = self.experts_per_rank.checked_mul(self.topology.ffn_count());
        if owned.is_none_or(|n| n > self.experts) {
            return Err(ConfigError::Invalid {
                field: "experts_per_rank",
                value: self.experts_per_rank.to_string(),
                reason: format!(
                    "{} FFN ranks would own more than the {} experts",
                    self.topology.ffn_count(),
                    self.experts
                ),
            });
        }
        if self.payload == PayloadKind::Fp8E4m3 && self.hidden % 128 != 0 {
            return Err(ConfigError::Invalid {
                field: "hidden",
                value: self.hidden.to_string(),
                reason: "fp8 payloads need a multiple of 128 channels (one scale per 128)".into(),
            });
        }
        self.knobs.validate()
    }

    /// The expert placement this configuration implies.
    pub fn placement(&self) -> ExpertPlacement {
        ExpertPlacement {
            experts: self.experts,
            ffn_ranks: self.topology.ffn_count(),
            experts_per_rank: self.experts_per_rank,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn record_shape_is_valid_and_round_trips() {
        LayerShape::RECORD.validate().unwrap();
        let s = serde_json::to_string(&LayerShape::RECORD).unwrap();
        let back: LayerShape = serde_json::from_str(&s).unwrap();
        assert_eq!(back, LayerShape::RECORD);
    }

    #[test]
    fn bad_fields_are_named() {
        let mut s = LayerShape::RECORD;
        s.top_k = 65;
        match s.validate() {
            Err(ConfigError::Invalid { field: "top_k", .. }) => {}
            other => panic!("{other:?}"),
        }
        let t: Topology = "1A:3F".parse().unwrap();
        assert!(matches!(
            ExchangeConfig::new(t, 2048, 128, 8, 2048),
            Err(ConfigError::Invalid {
                field: "experts",
                ..
            })
        ));
        let t: Topology = "3A:1F".parse().unwrap();
        let mut c = ExchangeConfig::new(t, 2048, 128, 8, 2048).unwrap();
        c.knobs.transport_sms = 0;
        assert!(matches!(
            c.validate(),
            Err(ConfigError::Invalid {
                field: "knobs.transport_sms",
                ..
            })
        ));
        // sizes whose products would overflow are refused, not wrapped
        let base = ExchangeConfig::new(t, 2048, 128, 8, 2048).unwrap();
        for (field, set) in [
            (
                "hidden",
                (|c: &mut ExchangeConfig| c.hidden = usize::MAX) as fn(&mut ExchangeConfig),
            ),
            ("experts", |c| c.experts = MAX_EXPERTS + 1),
            ("capacity", |c| c.capacity = 1 << 40),
            ("experts_per_rank", |c| c.experts_per_rank = 1 << 63),
        ] {
            let mut c = base.clone();
            set(&mut c);
            match c.validate() {
                Err(ConfigError::Invalid { field: f, .. }) if f == field => {}
                other => panic!("{field}: {other:?}"),
            }
        }
        let t: Topology = "2A:2F".parse().unwrap();
        let mut c = ExchangeConfig::new(t, 2048, 128, 8, 2048).unwrap();
        c.experts_per_rank = usize::MAX / 2 + 1;
        assert!(c.validate().is_err());
    }

    /// A config written before bf16 partials existed reads as the exact path; the setting
    /// reads and prints as `f32` / `bf16`.
    #[test]
    fn partials_default_to_f32_and_read_by_name() {
        let t: Topology = "2A:2F".parse().unwrap();
        let c = ExchangeConfig::new(t, 64, 8, 2, 16).unwrap();
        assert_eq!(c.partials, CombinePartials::F32);
        let mut v = serde_json::to_value(&c).unwrap();
        v.as_object_mut().unwrap().remove("partials");
        let old: ExchangeConfig = serde_json::from_value(v.clone()).unwrap();
        assert_eq!(old, c);
        v["partials"] = "bf16".into();
        let b: ExchangeConfig = serde_json::from_value(v).unwrap();
        assert_eq!(b.partials, CombinePartials::Bf16);
        assert_eq!(b.partials.to_string(), "bf16");
        assert_eq!(CombinePartials::F32.bytes_per_channel(), 4);
        assert_eq!(CombinePartials::Bf16.bytes_per_channel(), 2);
        // nearest even: 1 + 2^-8 is a tie between 1 and 1 + 2^-7 and goes to 1
        assert_eq!(CombinePartials::Bf16.as_received(1.0 + 2f32.powi(-8)), 1.0);
        assert_eq!(
            CombinePartials::Bf16.as_received(1.0 + 3.0 * 2f32.powi(-8)),
            1.0 + 2f32.powi(-6)
        );
        assert_eq!(
            CombinePartials::F32.as_received(1.0 + 2f32.powi(-8)),
            1.0 + 2f32.powi(-8)
        );
    }
}
