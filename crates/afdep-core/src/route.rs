//! The reference router and route validation.
//!
//! Router (docs/design.md, "Specification: Router"): `logits = x·Wr` in f32, `p = softmax(logits)`
//! in f32 (max subtracted, exponentials summed in ascending expert order), the top-K experts by `p`
//! with ties going to the lower expert id, and weights `w_k = p_k / Σ_k p_k` (sum in slot order)
//! when renormalisation is on, `w_k = p_k` otherwise. Slots are ordered by descending `p`.
//!
//! Validation scans tokens in ascending order and, within a token, slots in ascending order;
//! the first offending slot is reported. Within a slot the checks run in the order negative,
//! wide, dummy, non-finite weight, duplicate. A masked slot (`-1`) is skipped entirely: it sends
//! nothing and its weight is ignored. Capacity is checked before any slot.

use half::bf16;

use crate::config::LayerShape;
use crate::error::RouteError;
use crate::oracle::gemm::matmul;
use crate::tensor::to_f32;

/// The expert id of a masked slot.
pub const MASKED: i32 = -1;

/// The routes of one rank's tokens: `top_k` slots per token, row-major (T × K).
#[derive(Debug, Clone, PartialEq)]
pub struct Routes {
    /// Number of tokens.
    pub tokens: usize,
    /// Slots per token.
    pub top_k: usize,
    /// Expert id per slot (`-1` masked).
    pub idx: Vec<i32>,
    /// Weight per slot.
    pub weights: Vec<f32>,
}

impl Routes {
    /// Routes from arrays, checking their sizes.
    pub fn new(
        tokens: usize,
        top_k: usize,
        idx: Vec<i32>,
        weights: Vec<f32>,
    ) -> Result<Self, RouteError> {
        let r = Routes {
            tokens,
            top_k,
            idx,
            weights,
        };
        r.check_sizes(0)?;
        Ok(r)
    }

    /// No tokens.
    pub fn empty(top_k: usize) -> Self {
        Routes {
            tokens: 0,
            top_k,
            idx: Vec::new(),
            weights: Vec::new(),
        }
    }

    fn check_sizes(&self, rank: usize) -> Result<(), RouteError> {
        let Some(n) = self.tokens.checked_mul(self.top_k) else {
            return Err(RouteError::Malformed {
                rank,
                what: format!(
                    "{} tokens × {} slots overflow the address space",
                    self.tokens, self.top_k
                ),
            });
        };
        if self.idx.len() != n || self.weights.len() != n {
            return Err(RouteError::Malformed {
                rank,
                what: format!(
                    "{} tokens × {} slots need {n} ids and weights, got {} and {}",
                    self.tokens,
                    self.top_k,
                    self.idx.len(),
                    self.weights.len()
                ),
            });
        }
        Ok(())
    }

    /// The (expert, weight) pairs of token `t`.
    pub fn slots(&self, t: usize) -> impl Iterator<Item = (i32, f32)> + '_ {
        let k = self.top_k;
        self.idx[t * k..(t + 1) * k]
            .iter()
            .copied()
            .zip(self.weights[t * k..(t + 1) * k].iter().copied())
    }
}

/// What a route must satisfy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RouteRules {
    /// Expert ids must be below this.
    pub experts: usize,
    /// Expert ids must be below this to be owned by an FFN rank (`<= experts`).
    pub owned: usize,
    /// Most tokens per rank.
    pub capacity: usize,
    /// Slots per token.
    pub top_k: usize,
}

impl RouteRules {
    /// The rules of one GPU's layer: every expert owned, no capacity limit.
    pub fn layer(shape: &LayerShape) -> Self {
        RouteRules {
            experts: shape.experts,
            owned: shape.experts,
            capacity: usize::MAX,
            top_k: shape.top_k,
        }
    }

    /// The rules of an exchange configuration.
    pub fn exchange(cfg: &crate::config::ExchangeConfig) -> Self {
        RouteRules {
            experts: cfg.experts,
            owned: cfg.placement().owned(),
            capacity: cfg.capacity,
            top_k: cfg.top_k,
        }
    }
}

/// Validates the routes of attention rank `rank`; the error is the first offending slot.
pub fn validate(routes: &Routes, rules: &RouteRules, rank: usize) -> Result<(), RouteError> {
    if routes.top_k != rules.top_k {
        return Err(RouteError::Malformed {
            rank,
            what: format!(
                "routes have {} slots per token, the config says {}",
                routes.top_k, rules.top_k
            ),
        });
    }
    routes.check_sizes(rank)?;
    if routes.tokens > rules.capacity {
        return Err(RouteError::OverCapacity {
            rank,
            tokens: routes.tokens,
            capacity: rules.capacity,
        });
    }
    let k = routes.top_k;
    for token in 0..routes.tokens {
        let ids = &routes.idx[token * k..(token + 1) * k];
        let ws = &routes.weights[token * k..(token + 1) * k];
        for slot in 0..k {
            let value = ids[slot];
            if value == MASKED {
                continue;
            }
            if value < MASKED {
                return Err(RouteError::Negative {
                    rank,
                    token,
                    slot,
                    value,
                });
            }
            if value as usize >= rules.experts {
                return Err(RouteError::Wide {
                    rank,
                    token,
                    slot,
                    value,
                    experts: rules.experts,
                });
            }
            if value as usize >= rules.owned {
                return Err(RouteError::Dummy {
                    rank,
                    token,
                    slot,
                    value,
                    owned: rules.owned,
                });
            }
            if !ws[slot].is_finite() {
                return Err(RouteError::NonFiniteWeight {
                    rank,
                    token,
                    slot,
                    value: ws[slot],
                });
            }
            if let Some(first_slot) = ids[..slot].iter().position(|&e| e == value) {
                return Err(RouteError::Duplicate {
                    rank,
                    token,
                    slot,
                    expert: value,
                    first_slot,
                });
            }
        }
    }
    Ok(())
}

/// The first non-finite router logit of a `tokens × experts` row-major table, in (token,
/// expert) order, as [`RouteError::NonFiniteLogit`] of attention rank `rank`: the Specification's
/// one rule for NaN and infinity before routing. A token whose logits are not all finite cannot be
/// ranked (softmax and top-k have no meaning there), so every backend refuses the step before any
/// expert runs; non-finite values that enter after routing (expert weights) propagate.
pub fn check_logits<T: Copy + Into<f64>>(
    logits: &[T],
    experts: usize,
    rank: usize,
) -> Result<(), RouteError> {
    if experts == 0 {
        return Ok(());
    }
    match logits.iter().position(|&v| !v.into().is_finite()) {
        None => Ok(()),
        Some(i) => Err(RouteError::NonFiniteLogit {
            rank,
            token: i / experts,
            expert: i % experts,
            value: logits[i].into() as f32,
        }),
    }
}

/// Router probabilities `softmax(x·Wr)` in f32, T × E.
pub fn router_probs(x: &[bf16], wr: &[bf16], tokens: usize, shape: &LayerShape) -> Vec<f32> {
    let (h, e) = (shape.d_model, shape.experts);
    assert_eq!(x.len(), tokens * h, "router: x must be tokens × d_model");
    assert_eq!(wr.len(), h * e, "router: wr must be d_model × experts");
    let xf = to_f32(x);
    let wf = to_f32(wr);
    let mut p = vec![0f32; tokens * e];
    matmul(tokens, h, e, &xf, &wf, &mut p, false);
    for row in p.chunks_mut(e) {
        softmax_in_place(row);
    }
    p
}

/// Softmax of one row in f32: max subtracted, exponentials summed in ascending order.
pub fn softmax_in_place(row: &mut [f32]) {
    let m = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut s = 0f32;
    for v in row.iter_mut() {
        *v = (*v - m).exp();
        s += *v;
    }
    for v in row.iter_mut() {
        *v /= s;
    }
}

/// Top-K of one probability row: indices by descending probability, ties to the lower id.
pub fn top_k(row: &[f32], k: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..row.len()).collect();
    // total_cmp orders NaN above everything; the router never produces NaN from finite inputs.
    order.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
    order.truncate(k);
    order
}

/// Selection and weights from router probabilities (T × E).
pub fn select(p: &[f32], tokens: usize, shape: &LayerShape) -> Routes {
    let (e, k) = (shape.experts, shape.top_k);
    let mut idx = Vec::with_capacity(tokens * k);
    let mut weights = Vec::with_capacity(tokens * k);
    for t in 0..tokens {
        let row = &p[t * e..(t + 1) * e];
        let sel = top_k(row, k);
        let sum: f32 = sel.iter().fold(0f32, |s, &j| s + row[j]);
        for &j in &sel {
            idx.push(j as i32);
            weights.push(if shape.renormalize {
                row[j] / sum
            } else {
                row[j]
            });
        }
    }
    Routes {
        tokens,
        top_k: k,
        idx,
        weights,
    }
}

/// The reference router: probabilities, top-K and weights for `tokens` rows of `x`.
pub fn route(x: &[bf16], wr: &[bf16], tokens: usize, shape: &LayerShape) -> Routes {
    let p = router_probs(x, wr, tokens, shape);
    select(&p, tokens, shape)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const RULES: RouteRules = RouteRules {
        experts: 16,
        owned: 12,
        capacity: 20,
        top_k: 3,
    };

    fn ok_routes(tokens: usize) -> Routes {
        let idx = (0..tokens * 3)
            .map(|i| ((i / 3 + i % 3 * 4) % 12) as i32)
            .collect();
        Routes::new(tokens, 3, idx, vec![0.25; tokens * 3]).unwrap()
    }

    #[test]
    fn tie_break_prefers_lower_id() {
        assert_eq!(top_k(&[0.1, 0.3, 0.3, 0.3], 2), vec![1, 2]);
        assert_eq!(top_k(&[0.5, 0.1, 0.5], 3), vec![0, 2, 1]);
    }

    #[test]
    fn renormalised_weights_sum_to_one() {
        let shape = LayerShape {
            d_model: 8,
            width: 4,
            experts: 6,
            top_k: 2,
            shared: 0,
            renormalize: true,
        };
        let x = crate::tensor::uniform_bf16(5 * 8, 1.0, 3, 0);
        let wr = crate::tensor::uniform_bf16(8 * 6, 1.0, 3, 1);
        let r = route(&x, &wr, 5, &shape);
        for t in 0..5 {
            let s: f32 = r.slots(t).map(|(_, w)| w).sum();
            assert!((s - 1.0).abs() < 1e-6);
            let ids: Vec<i32> = r.slots(t).map(|(e, _)| e).collect();
            assert_ne!(ids[0], ids[1]);
        }
        validate(&r, &RouteRules::layer(&shape), 0).unwrap();
    }

    #[test]
    fn masked_slots_pass_with_any_weight() {
        let mut r = ok_routes(4);
        r.idx[4] = MASKED;
        r.weights[4] = f32::NAN;
        r.idx[5] = MASKED;
        validate(&r, &RULES, 0).unwrap();
    }

    #[test]
    fn first_error_wins_in_token_then_slot_order() {
        let mut r = ok_routes(6);
        r.idx[3 * 3 + 2] = 99; // token 3 slot 2: wide
        r.idx[4 * 3] = -7; // token 4 slot 0: negative
        assert_eq!(
            validate(&r, &RULES, 5),
            Err(RouteError::Wide {
                rank: 5,
                token: 3,
                slot: 2,
                value: 99,
                experts: 16
            })
        );
    }

    /// Each rejected class, as a strategy placing one bad slot into a valid table.
    #[derive(Debug, Clone, Copy)]
    enum Class {
        Duplicate,
        Negative,
        Wide,
        Dummy,
        NonFinite,
    }

    fn class() -> impl Strategy<Value = Class> {
        prop_oneof![
            Just(Class::Duplicate),
            Just(Class::Negative),
            Just(Class::Wide),
            Just(Class::Dummy),
            Just(Class::NonFinite)
        ]
    }

    proptest! {
        #[test]
        fn every_class_gives_its_exact_error(
            tokens in 1usize..20,
            tok_seed in any::<u32>(),
            slot_seed in any::<u32>(),
            c in class(),
            neg in i32::MIN..-1,
            wide_off in 0i32..1000,
            dummy_off in 0i32..4,
            rank in 0usize..8,
            nonfinite in prop_oneof![Just(f32::NAN), Just(f32::INFINITY), Just(f32::NEG_INFINITY)],
        ) {
            let mut r = ok_routes(tokens);
            let token = tok_seed as usize % tokens;
            // a duplicate needs an earlier slot to repeat
            let slot = match c { Class::Duplicate => 1 + slot_seed as usize % 2, _ => slot_seed as usize % 3 };
            let at = token * 3 + slot;
            let want = match c {
                Class::Duplicate => {
                    let first_slot = slot_seed as usize % slot;
                    let expert = r.idx[token * 3 + first_slot];
                    r.idx[at] = expert;
                    // make sure no slot between repeats it earlier
                    let first = r.idx[token * 3..at].iter().position(|&e| e == expert).unwrap();
                    RouteError::Duplicate { rank, token, slot, expert, first_slot: first }
                }
                Class::Negative => { r.idx[at] = neg; RouteError::Negative { rank, token, slot, value: neg } }
                Class::Wide => {
                    let v = 16 + wide_off;
                    r.idx[at] = v;
                    RouteError::Wide { rank, token, slot, value: v, experts: 16 }
                }
                Class::Dummy => {
                    let v = 12 + dummy_off;
                    r.idx[at] = v;
                    RouteError::Dummy { rank, token, slot, value: v, owned: 12 }
                }
                Class::NonFinite => {
                    r.weights[at] = nonfinite;
                    RouteError::NonFiniteWeight { rank, token, slot, value: nonfinite }
                }
            };
            let got = validate(&r, &RULES, rank).unwrap_err();
            // NaN != NaN: compare the error words, which hold the bits.
            prop_assert_eq!(got.to_word(), want.to_word());
            prop_assert_eq!(RouteError::from_word(got.to_word()).map(|e| e.to_word()), Some(want.to_word()));
        }

        #[test]
        fn over_capacity_is_checked_first(extra in 1usize..10) {
            let mut r = ok_routes(RULES.capacity + extra);
            r.idx[0] = -5;
            prop_assert_eq!(
                validate(&r, &RULES, 1),
                Err(RouteError::OverCapacity { rank: 1, tokens: RULES.capacity + extra, capacity: RULES.capacity })
            );
        }
    }

    #[test]
    fn malformed_sizes() {
        assert!(matches!(
            Routes::new(2, 3, vec![0; 5], vec![0.0; 6]),
            Err(RouteError::Malformed { .. })
        ));
    }
}
