//! The AFD exchange reference (brief section 4): dispatch into the expanded layout and the
//! compact collect view, expert application per FFN rank, and combine in the fixed order
//! `Σ_{FFN rank ascending} ( Σ_{slot ascending, expert on that rank} w_k · y_k )`.
//!
//! Arithmetic of combine, which every engine reproduces bit for bit: per source token and
//! FFN rank, `partial = 0; partial = partial + w_k * y_k` for the slots on that rank in
//! ascending order (the product and the sum each rounded to f32; no fused multiply-add);
//! then `acc = 0; acc = acc + partial_r` over the FFN ranks that hold at least one slot of
//! the token, ascending; then one cast to bf16. `y_k` is the bf16 row the FFN rank returned.
//! A token with no unmasked slot combines to +0.

use half::bf16;

use crate::config::ExchangeConfig;
use crate::error::RouteError;
use crate::layout::{FfnPlan, SourceCounts, block_positions, compact_slots, payload_first_slabs};
use crate::route::{MASKED, RouteRules, Routes, validate};

/// One attention rank's input to a round.
#[derive(Debug, Clone, PartialEq)]
pub struct SourceInput {
    /// Token rows, T × hidden.
    pub x: Vec<bf16>,
    /// The routes of those tokens.
    pub routes: Routes,
}

/// What one FFN rank holds after dispatch.
#[derive(Debug, Clone, PartialEq)]
pub struct FfnReceived {
    /// The layout plan (counts, expert offsets, block starts, slab offsets).
    pub plan: FfnPlan,
    /// Expanded rows, `plan.total_rows()` × hidden, grouped by local expert.
    pub expanded: Vec<bf16>,
    /// Compact view: `(source, token)` of each row, source then token ascending.
    pub compact_tokens: Vec<(u32, u32)>,
    /// Compact view rows, one per token, × hidden.
    pub compact_x: Vec<bf16>,
    /// Compact view local expert ids, K per row (`-1` elsewhere or masked).
    pub compact_ids: Vec<i32>,
    /// Compact view weights, K per row (0 where the id is -1).
    pub compact_weights: Vec<f32>,
}

/// Validates every source's routes (and row counts); the error is that of the lowest-numbered
/// rejecting source, which is what every rank of an exchange reports.
pub fn validate_sources(cfg: &ExchangeConfig, inputs: &[SourceInput]) -> Result<(), RouteError> {
    let rules = RouteRules::exchange(cfg);
    if inputs.len() != cfg.topology.attention_count() {
        return Err(RouteError::Malformed {
            rank: 0,
            what: format!(
                "{} sources given, the topology has {}",
                inputs.len(),
                cfg.topology.attention_count()
            ),
        });
    }
    for (s, inp) in inputs.iter().enumerate() {
        check_rows(cfg, s, inp)?;
        validate(&inp.routes, &rules, s)?;
    }
    Ok(())
}

/// Checks that `x` holds one row of `hidden` per routed token.
pub fn check_rows(cfg: &ExchangeConfig, rank: usize, inp: &SourceInput) -> Result<(), RouteError> {
    if inp.x.len() != inp.routes.tokens * cfg.hidden {
        return Err(RouteError::Malformed {
            rank,
            what: format!(
                "x has {} elements, {} tokens × hidden {} need {}",
                inp.x.len(),
                inp.routes.tokens,
                cfg.hidden,
                inp.routes.tokens * cfg.hidden
            ),
        });
    }
    Ok(())
}

/// Dispatch: what every FFN rank receives, in FFN-index order.
pub fn dispatch(
    cfg: &ExchangeConfig,
    inputs: &[SourceInput],
) -> Result<Vec<FfnReceived>, RouteError> {
    validate_sources(cfg, inputs)?;
    let p = cfg.placement();
    let h = cfg.hidden;
    let counts: Vec<SourceCounts> = inputs
        .iter()
        .map(|i| SourceCounts::build(&i.routes, &p))
        .collect();
    let positions: Vec<Vec<Option<u64>>> = inputs
        .iter()
        .map(|i| block_positions(&i.routes, &p))
        .collect();
    let mut out = Vec::with_capacity(p.ffn_ranks);
    for f in 0..p.ffn_ranks {
        let plan = FfnPlan::build(f, &p, &counts);
        let mut expanded = vec![bf16::ZERO; plan.total_rows() as usize * h];
        for (s, inp) in inputs.iter().enumerate() {
            for (i, &e) in inp.routes.idx.iter().enumerate() {
                if e == MASKED || p.owner(e as usize) != Some(f) {
                    continue;
                }
                let row =
                    plan.block_start(p.local(e as usize), s) + positions[s][i].expect("unmasked");
                let t = i / inp.routes.top_k;
                expanded[row as usize * h..(row as usize + 1) * h]
                    .copy_from_slice(&inp.x[t * h..(t + 1) * h]);
            }
        }
        let mut compact_tokens = Vec::new();
        let mut compact_x = Vec::new();
        let mut compact_ids = Vec::new();
        let mut compact_weights = Vec::new();
        for (s, inp) in inputs.iter().enumerate() {
            let slab = &payload_first_slabs(&inp.routes, &p)[f];
            let (ids, ws) = compact_slots(&inp.routes, &p, f, slab);
            compact_ids.extend(ids);
            compact_weights.extend(ws);
            for &t in slab {
                compact_tokens.push((s as u32, t));
                compact_x.extend_from_slice(&inp.x[t as usize * h..(t as usize + 1) * h]);
            }
        }
        out.push(FfnReceived {
            plan,
            expanded,
            compact_tokens,
            compact_x,
            compact_ids,
            compact_weights,
        });
    }
    Ok(out)
}

/// Applies `expert(global_expert, rows, n) -> n × hidden` to each local expert's group of
/// the expanded rows of every FFN rank, giving the rows that travel back.
pub fn apply_experts<F>(cfg: &ExchangeConfig, received: &[FfnReceived], expert: F) -> Vec<Vec<bf16>>
where
    F: Fn(usize, &[bf16], usize) -> Vec<bf16>,
{
    let p = cfg.placement();
    let h = cfg.hidden;
    received
        .iter()
        .enumerate()
        .map(|(f, r)| {
            let mut y = Vec::with_capacity(r.expanded.len());
            for l in 0..p.experts_per_rank {
                let (a, b) = (
                    r.plan.expert_offsets[l] as usize,
                    r.plan.expert_offsets[l + 1] as usize,
                );
                let ye = expert(p.experts_of(f).start + l, &r.expanded[a * h..b * h], b - a);
                assert_eq!(ye.len(), (b - a) * h, "expert output must be rows × hidden");
                y.extend(ye);
            }
            y
        })
        .collect()
}

/// Combine one source's tokens from the rows each FFN rank returns: `owner(expert)` is the FFN
/// index holding an expert and `row_of(slot index)` the slot's row in `ffn_rows[owner]`; the
/// arithmetic is the module's.
pub fn combine_source<R>(
    routes: &Routes,
    hidden: usize,
    owner: impl Fn(usize) -> usize,
    row_of: R,
    ffn_rows: &[&[bf16]],
) -> Vec<bf16>
where
    R: Fn(usize) -> u64,
{
    let k = routes.top_k;
    let nf = ffn_rows.len();
    let mut out = vec![bf16::ZERO; routes.tokens * hidden];
    let mut acc = vec![0f32; hidden];
    let mut partial = vec![0f32; hidden];
    let mut slots_of = vec![Vec::new(); nf];
    for t in 0..routes.tokens {
        for s in slots_of.iter_mut() {
            s.clear();
        }
        for j in 0..k {
            let e = routes.idx[t * k + j];
            if e != MASKED {
                slots_of[owner(e as usize)].push(j);
            }
        }
        acc.iter_mut().for_each(|a| *a = 0.0);
        for (f, slots) in slots_of.iter().enumerate() {
            if slots.is_empty() {
                continue;
            }
            partial.iter_mut().for_each(|a| *a = 0.0);
            for &j in slots {
                let w = routes.weights[t * k + j];
                let row = row_of(t * k + j) as usize;
                let y = &ffn_rows[f][row * hidden..(row + 1) * hidden];
                for (p, v) in partial.iter_mut().zip(y) {
                    *p += w * v.to_f32();
                }
            }
            for (a, p) in acc.iter_mut().zip(&partial) {
                *a += *p;
            }
        }
        for (o, a) in out[t * hidden..(t + 1) * hidden].iter_mut().zip(&acc) {
            *o = bf16::from_f32(*a);
        }
    }
    out
}

/// Combine: the output of every source, from the expanded rows `y[f]` of every FFN rank.
pub fn combine(
    cfg: &ExchangeConfig,
    inputs: &[SourceInput],
    received: &[FfnReceived],
    y: &[Vec<bf16>],
) -> Vec<Vec<bf16>> {
    let p = cfg.placement();
    let rows: Vec<&[bf16]> = y.iter().map(|v| v.as_slice()).collect();
    inputs
        .iter()
        .enumerate()
        .map(|(s, inp)| {
            let pos = block_positions(&inp.routes, &p);
            let row_of = |i: usize| {
                let e = inp.routes.idx[i] as usize;
                let f = p.owner(e).expect("validated");
                received[f].plan.block_start(p.local(e), s) + pos[i].expect("unmasked")
            };
            combine_source(
                &inp.routes,
                cfg.hidden,
                |e| p.owner(e).expect("validated"),
                row_of,
                &rows,
            )
        })
        .collect()
}

/// The whole round: validate, dispatch, apply experts, combine. Returns each source's output.
pub fn exchange<F>(
    cfg: &ExchangeConfig,
    inputs: &[SourceInput],
    expert: F,
) -> Result<Vec<Vec<bf16>>, RouteError>
where
    F: Fn(usize, &[bf16], usize) -> Vec<bf16>,
{
    let received = dispatch(cfg, inputs)?;
    let y = apply_experts(cfg, &received, expert);
    Ok(combine(cfg, inputs, &received, &y))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor::uniform_bf16;
    use crate::topology::Topology;

    fn inputs(cfg: &ExchangeConfig, tokens: &[usize], seed: u64) -> Vec<SourceInput> {
        tokens
            .iter()
            .enumerate()
            .map(|(s, &t)| {
                let x = uniform_bf16(t * cfg.hidden, 1.0, seed, s as u64);
                let k = cfg.top_k;
                let owned = cfg.placement().owned();
                let mut idx = Vec::new();
                for i in 0..t {
                    for j in 0..k {
                        // distinct per token; every third token masks its last slot
                        let e = ((i * 7 + j * 5 + s) % owned) as i32;
                        idx.push(if j == k - 1 && i % 3 == 0 { MASKED } else { e });
                    }
                }
                let weights = (0..t * k).map(|i| 0.1 + (i % 5) as f32 * 0.2).collect();
                SourceInput {
                    x,
                    routes: Routes {
                        tokens: t,
                        top_k: k,
                        idx,
                        weights,
                    },
                }
            })
            .collect()
    }

    /// With an expert that scales rows by (expert id + 1), combine equals a direct sum.
    #[test]
    fn combine_equals_direct_sum_in_the_fixed_order() {
        for topo in ["3A:1F", "2A:2F", "1A:3F", "EP4"] {
            let t: Topology = topo.parse().unwrap();
            let cfg = ExchangeConfig::new(t, 16, 12, 3, 64).unwrap();
            let inp = inputs(&cfg, &[5, 0, 9, 3][..t.attention_count()], 1);
            let scale = |e: usize, rows: &[bf16], _n: usize| {
                rows.iter()
                    .map(|v| bf16::from_f32(v.to_f32() * (e as f32 + 1.0)))
                    .collect()
            };
            let out = exchange(&cfg, &inp, scale).unwrap();
            let p = cfg.placement();
            for (s, i) in inp.iter().enumerate() {
                for tok in 0..i.routes.tokens {
                    for c in 0..cfg.hidden {
                        let mut acc = 0f32;
                        for f in 0..p.ffn_ranks {
                            let mut part = 0f32;
                            let mut any = false;
                            for (e, w) in i.routes.slots(tok) {
                                if e != MASKED && p.owner(e as usize) == Some(f) {
                                    let y = bf16::from_f32(
                                        i.x[tok * cfg.hidden + c].to_f32() * (e as f32 + 1.0),
                                    );
                                    part += w * y.to_f32();
                                    any = true;
                                }
                            }
                            if any {
                                acc += part;
                            }
                        }
                        assert_eq!(
                            out[s][tok * cfg.hidden + c],
                            bf16::from_f32(acc),
                            "{topo} s{s} t{tok} c{c}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn compact_view_holds_each_token_once() {
        let t: Topology = "2A:2F".parse().unwrap();
        let cfg = ExchangeConfig::new(t, 8, 8, 2, 64).unwrap();
        let inp = inputs(&cfg, &[6, 4], 2);
        let rec = dispatch(&cfg, &inp).unwrap();
        for (f, r) in rec.iter().enumerate() {
            let mut seen = std::collections::HashSet::new();
            for (i, &(s, tok)) in r.compact_tokens.iter().enumerate() {
                assert!(seen.insert((s, tok)));
                let row = &r.compact_x[i * 8..(i + 1) * 8];
                assert_eq!(
                    row,
                    &inp[s as usize].x[tok as usize * 8..(tok as usize + 1) * 8]
                );
                let ids = &r.compact_ids[i * 2..(i + 1) * 2];
                assert!(
                    ids.iter().any(|&l| l >= 0),
                    "rank {f} got a token with no local expert"
                );
            }
            let mut sorted = r.compact_tokens.clone();
            sorted.sort();
            assert_eq!(sorted, r.compact_tokens);
        }
    }

    #[test]
    fn rejected_route_names_lowest_rank() {
        let t: Topology = "3A:1F".parse().unwrap();
        let cfg = ExchangeConfig::new(t, 8, 8, 2, 64).unwrap();
        let mut inp = inputs(&cfg, &[3, 3, 3], 3);
        inp[2].routes.idx[1] = 8;
        inp[1].routes.idx[4] = -3;
        assert_eq!(
            dispatch(&cfg, &inp).unwrap_err(),
            RouteError::Negative {
                rank: 1,
                token: 2,
                slot: 0,
                value: -3
            }
        );
    }
}
