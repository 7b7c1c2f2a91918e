//! Ranks, their roles, and where experts live.
//!
//! Rank numbering: in an AFD topology `aA:fF`, ranks `0..a` are attention ranks and ranks
//! `a..a+f` are FFN ranks. In classic expert parallelism (`EPn`) every rank `r` is both
//! attention rank `r` and FFN rank `r`.

use std::fmt;
use std::ops::Range;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::error::ConfigError;

/// The most ranks of one kind a topology may have ([`Topology::validate`]).
pub const MAX_RANKS: usize = 1 << 16;

/// The roles of the ranks of one exchange.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Topology {
    /// Attention–FFN disaggregation: `attention` ranks route and send, `ffn` ranks own experts.
    Afd {
        /// Number of attention ranks.
        attention: usize,
        /// Number of FFN ranks.
        ffn: usize,
    },
    /// Classic expert parallelism: every one of `ranks` ranks is both.
    Classic {
        /// Number of ranks.
        ranks: usize,
    },
}

/// What one rank does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Role {
    /// Routes tokens and combines results.
    Attention {
        /// Index among attention ranks.
        index: usize,
    },
    /// Owns experts.
    Ffn {
        /// Index among FFN ranks.
        index: usize,
    },
    /// Both (classic expert parallelism).
    Both {
        /// Index among attention ranks and among FFN ranks (the same number).
        index: usize,
    },
}

impl Topology {
    /// Total number of ranks.
    pub fn world_size(&self) -> usize {
        match *self {
            // saturating: a topology is validated after it is parsed
            Topology::Afd { attention, ffn } => attention.saturating_add(ffn),
            Topology::Classic { ranks } => ranks,
        }
    }

    /// Number of attention ranks.
    pub fn attention_count(&self) -> usize {
        match *self {
            Topology::Afd { attention, .. } => attention,
            Topology::Classic { ranks } => ranks,
        }
    }

    /// Number of FFN ranks.
    pub fn ffn_count(&self) -> usize {
        match *self {
            Topology::Afd { ffn, .. } => ffn,
            Topology::Classic { ranks } => ranks,
        }
    }

    /// Global ranks of the attention ranks, in attention-index order.
    pub fn attention_ranks(&self) -> Range<usize> {
        0..self.attention_count()
    }

    /// Global ranks of the FFN ranks, in FFN-index order.
    pub fn ffn_ranks(&self) -> Range<usize> {
        match *self {
            Topology::Afd { attention, ffn } => attention..attention + ffn,
            Topology::Classic { ranks } => 0..ranks,
        }
    }

    /// The global rank of FFN rank `index`.
    pub fn ffn_rank(&self, index: usize) -> usize {
        self.ffn_ranks().start + index
    }

    /// The role of global rank `rank`, or `None` if it is outside the world.
    pub fn role(&self, rank: usize) -> Option<Role> {
        match *self {
            Topology::Afd { attention, ffn } => {
                if rank < attention {
                    Some(Role::Attention { index: rank })
                } else if rank < attention + ffn {
                    Some(Role::Ffn {
                        index: rank - attention,
                    })
                } else {
                    None
                }
            }
            Topology::Classic { ranks } => (rank < ranks).then_some(Role::Both { index: rank }),
        }
    }

    /// Index among attention ranks, if `rank` is one.
    pub fn attention_index(&self, rank: usize) -> Option<usize> {
        match self.role(rank)? {
            Role::Attention { index } | Role::Both { index } => Some(index),
            Role::Ffn { .. } => None,
        }
    }

    /// Index among FFN ranks, if `rank` is one.
    pub fn ffn_index(&self, rank: usize) -> Option<usize> {
        match self.role(rank)? {
            Role::Ffn { index } | Role::Both { index } => Some(index),
            Role::Attention { .. } => None,
        }
    }

    /// Checks that there is at least one rank of each role.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let bad = |reason: &str| ConfigError::Topology {
            text: self.to_string(),
            reason: reason.into(),
        };
        match *self {
            Topology::Afd { attention, ffn } => {
                if attention == 0 || ffn == 0 {
                    return Err(bad("needs at least one attention and one FFN rank"));
                }
                if attention > MAX_RANKS || ffn > MAX_RANKS {
                    return Err(bad("more than 65536 ranks on one side"));
                }
            }
            Topology::Classic { ranks } => {
                if ranks == 0 {
                    return Err(bad("needs at least one rank"));
                }
                if ranks > MAX_RANKS {
                    return Err(bad("more than 65536 ranks"));
                }
            }
        }
        Ok(())
    }
}

impl fmt::Display for Topology {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Topology::Afd { attention, ffn } => write!(f, "{attention}A:{ffn}F"),
            Topology::Classic { ranks } => write!(f, "EP{ranks}"),
        }
    }
}

impl FromStr for Topology {
    type Err = ConfigError;

    /// Parses `3A:1F` (any case, spaces allowed around the colon) or `EP4`.
    fn from_str(s: &str) -> Result<Self, ConfigError> {
        let text = s.trim();
        let err = |reason: &str| ConfigError::Topology {
            text: s.to_string(),
            reason: reason.into(),
        };
        let up = text.to_ascii_uppercase();
        let t = if let Some(n) = up.strip_prefix("EP") {
            let ranks = n
                .trim()
                .parse::<usize>()
                .map_err(|_| err("EP must be followed by a rank count"))?;
            Topology::Classic { ranks }
        } else {
            let (a, f) = up.split_once(':').ok_or_else(|| err("missing ':'"))?;
            let a = a
                .trim()
                .strip_suffix('A')
                .ok_or_else(|| err("the attention part must end in 'A'"))?;
            let f = f
                .trim()
                .strip_suffix('F')
                .ok_or_else(|| err("the FFN part must end in 'F'"))?;
            let attention = a
                .trim()
                .parse::<usize>()
                .map_err(|_| err("bad attention rank count"))?;
            let ffn = f
                .trim()
                .parse::<usize>()
                .map_err(|_| err("bad FFN rank count"))?;
            Topology::Afd { attention, ffn }
        };
        t.validate().map_err(|e| match e {
            ConfigError::Topology { reason, .. } => err(&reason),
            other => other,
        })?;
        Ok(t)
    }
}

impl Serialize for Topology {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_string())
    }
}

impl<'de> Deserialize<'de> for Topology {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// Contiguous placement of experts on FFN ranks: FFN rank `f` owns experts
/// `f * experts_per_rank .. (f + 1) * experts_per_rank`. Ids at or above
/// `ffn_ranks * experts_per_rank` (but below `experts`) are owned by nobody.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ExpertPlacement {
    /// Number of expert ids.
    pub experts: usize,
    /// Number of FFN ranks.
    pub ffn_ranks: usize,
    /// Experts per FFN rank.
    pub experts_per_rank: usize,
}

impl ExpertPlacement {
    /// Every expert placed: `experts` must be a multiple of `ffn_ranks`.
    pub fn contiguous(experts: usize, ffn_ranks: usize) -> Result<Self, ConfigError> {
        if ffn_ranks == 0 || experts == 0 || experts % ffn_ranks != 0 {
            return Err(ConfigError::Invalid {
                field: "experts",
                value: experts.to_string(),
                reason: format!("must be a positive multiple of the {ffn_ranks} FFN ranks"),
            });
        }
        Ok(ExpertPlacement {
            experts,
            ffn_ranks,
            experts_per_rank: experts / ffn_ranks,
        })
    }

    /// Number of experts owned by some FFN rank.
    pub fn owned(&self) -> usize {
        self.ffn_ranks * self.experts_per_rank
    }

    /// The FFN index owning expert `e`, or `None` for an unowned id.
    pub fn owner(&self, e: usize) -> Option<usize> {
        (e < self.owned()).then(|| e / self.experts_per_rank)
    }

    /// The index of expert `e` among its owner's experts.
    pub fn local(&self, e: usize) -> usize {
        e % self.experts_per_rank
    }

    /// The experts of FFN index `f`.
    pub fn experts_of(&self, f: usize) -> Range<usize> {
        f * self.experts_per_rank..(f + 1) * self.experts_per_rank
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_prints() {
        for (s, t) in [
            (
                "3A:1F",
                Topology::Afd {
                    attention: 3,
                    ffn: 1,
                },
            ),
            (
                "2a : 2f",
                Topology::Afd {
                    attention: 2,
                    ffn: 2,
                },
            ),
            (
                "1A:3F",
                Topology::Afd {
                    attention: 1,
                    ffn: 3,
                },
            ),
            ("EP4", Topology::Classic { ranks: 4 }),
            ("ep 2", Topology::Classic { ranks: 2 }),
        ] {
            assert_eq!(s.parse::<Topology>().unwrap(), t);
            assert_eq!(t.to_string().parse::<Topology>().unwrap(), t);
        }
        for bad in ["", "3A", "3:1", "0A:1F", "3A:0F", "xA:1F", "EP0", "EP"] {
            assert!(
                matches!(bad.parse::<Topology>(), Err(ConfigError::Topology { .. })),
                "{bad}"
            );
        }
    }

    #[test]
    fn roles() {
        let t: Topology = "3A:1F".parse().unwrap();
        assert_eq!(t.world_size(), 4);
        assert_eq!(t.role(2), Some(Role::Attention { index: 2 }));
        assert_eq!(t.role(3), Some(Role::Ffn { index: 0 }));
        assert_eq!(t.role(4), None);
        assert_eq!(t.ffn_rank(0), 3);
        let c = Topology::Classic { ranks: 4 };
        assert_eq!(c.attention_index(3), Some(3));
        assert_eq!(c.ffn_index(3), Some(3));
    }

    #[test]
    fn placement() {
        let p = ExpertPlacement::contiguous(128, 4).unwrap();
        assert_eq!(p.owner(31), Some(0));
        assert_eq!(p.owner(32), Some(1));
        assert_eq!(p.local(33), 1);
        let partial = ExpertPlacement {
            experts: 128,
            ffn_ranks: 3,
            experts_per_rank: 32,
        };
        assert_eq!(partial.owner(95), Some(2));
        assert_eq!(partial.owner(96), None);
        assert!(ExpertPlacement::contiguous(10, 3).is_err());
    }
}
