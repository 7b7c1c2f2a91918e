//! The AFD exchange reference (docs/design.md, "Specification: AFD exchange"): dispatch into the
//! expanded layout and the compact collect view, expert application per FFN rank, and combine in
//! the fixed order `Σ_{FFN rank ascending} ( Σ_{slot ascending, expert on that rank} w_k · y_k )`.
//!
//! Arithmetic of combine, which every engine reproduces bit for bit: per source token and
//! FFN rank, `partial = 0; partial = partial + w_k * y_k` for the slots on that rank in
//! ascending order (the product and the sum each rounded to f32; no fused multiply-add);
//! then `acc = 0; acc = acc + partial_r` over the FFN ranks that hold at least one slot of
//! the token, ascending; then one cast to bf16. `y_k` is the bf16 row the FFN rank returned.
//! A token with no unmasked slot combines to +0.
//!
//! Payloads ([`ExchangeConfig::payload`]): with bf16 the FFN ranks receive the source rows bit
//! for bit. With fp8 e4m3 ([`crate::fp8`]) every row that travels is quantised on its source
//! (per token, one f32 scale per 128 channels); the FFN ranks receive the codes and scales in
//! the expanded layout and the compact view ([`Fp8Received`]), and `expanded` / `compact_x`
//! hold the dequantised bf16 rows (`bf16(f32(q) · scale)`), which is what the experts
//! consume. A non-finite value in a row that travels rejects the round
//! ([`RouteError::NonFinitePayload`], checked after the routes, [`check_payload`]). Combine is
//! the same for both payloads: bf16 rows back, f32 sums in the fixed order above.

use half::bf16;

use crate::config::{ExchangeConfig, PayloadKind};
use crate::error::RouteError;
use crate::fp8::{self, QuantisedRows};
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
    /// fp8 payloads: the codes and scales as delivered (then `expanded` and `compact_x` hold
    /// their dequantised rows); `None` for bf16 payloads.
    pub fp8: Option<Fp8Received>,
}

/// What an fp8 exchange delivers to an FFN rank besides the dequantised rows: e4m3 codes and
/// f32 scales (`hidden / 128` per row, [`crate::fp8`]) in the same row orders as
/// [`FfnReceived::expanded`] and [`FfnReceived::compact_x`].
#[derive(Debug, Clone, PartialEq)]
pub struct Fp8Received {
    /// Expanded rows' codes, `plan.total_rows()` × hidden.
    pub expanded_q: Vec<u8>,
    /// Expanded rows' scales, `plan.total_rows()` × hidden / 128.
    pub expanded_scales: Vec<f32>,
    /// Compact view codes, one row per token × hidden.
    pub compact_q: Vec<u8>,
    /// Compact view scales, one row per token × hidden / 128.
    pub compact_scales: Vec<f32>,
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
        check_payload(cfg, s, inp)?;
    }
    Ok(())
}

/// Checks that an fp8 payload can be quantised: no NaN or infinity in the row of a token with
/// at least one unmasked slot (the first in token, then channel order is the error). Nothing
/// to check for bf16 payloads. Call it after the routes are valid.
pub fn check_payload(
    cfg: &ExchangeConfig,
    rank: usize,
    inp: &SourceInput,
) -> Result<(), RouteError> {
    if cfg.payload != PayloadKind::Fp8E4m3 {
        return Ok(());
    }
    let k = inp.routes.top_k;
    fp8::first_non_finite(&inp.x, cfg.hidden, rank, |t| {
        inp.routes.idx[t * k..(t + 1) * k]
            .iter()
            .any(|&e| e != MASKED)
    })
}

/// The rows a source's tokens deliver: the source rows (bf16), or their fp8 codes, scales and
/// dequantised rows.
fn delivered_rows(cfg: &ExchangeConfig, inp: &SourceInput) -> Option<QuantisedRows> {
    (cfg.payload == PayloadKind::Fp8E4m3).then(|| QuantisedRows::of(&inp.x, cfg.hidden))
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
    let quantised: Vec<Option<QuantisedRows>> =
        inputs.iter().map(|i| delivered_rows(cfg, i)).collect();
    let g = fp8::scales_per_row(h);
    // the rows the FFN ranks see: the source rows, or their dequantised fp8 codes
    let rows_of = |s: usize| -> &[bf16] {
        quantised[s]
            .as_ref()
            .map_or(inputs[s].x.as_slice(), |q| q.dequant.as_slice())
    };
    let mut out = Vec::with_capacity(p.ffn_ranks);
    for f in 0..p.ffn_ranks {
        let plan = FfnPlan::build(f, &p, &counts);
        let total = plan.total_rows() as usize;
        let mut expanded = vec![bf16::ZERO; total * h];
        let mut fp8_rx = (cfg.payload == PayloadKind::Fp8E4m3).then(|| Fp8Received {
            expanded_q: vec![0; total * h],
            expanded_scales: vec![0.0; total * g],
            compact_q: Vec::new(),
            compact_scales: Vec::new(),
        });
        for (s, inp) in inputs.iter().enumerate() {
            for (i, &e) in inp.routes.idx.iter().enumerate() {
                if e == MASKED || p.owner(e as usize) != Some(f) {
                    continue;
                }
                let row = (plan.block_start(p.local(e as usize), s)
                    + positions[s][i].expect("unmasked")) as usize;
                let t = i / inp.routes.top_k;
                expanded[row * h..(row + 1) * h].copy_from_slice(&rows_of(s)[t * h..(t + 1) * h]);
                if let (Some(rx), Some(q)) = (fp8_rx.as_mut(), quantised[s].as_ref()) {
                    rx.expanded_q[row * h..(row + 1) * h].copy_from_slice(&q.q[t * h..(t + 1) * h]);
                    rx.expanded_scales[row * g..(row + 1) * g]
                        .copy_from_slice(&q.scales[t * g..(t + 1) * g]);
                }
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
                let t = t as usize;
                compact_tokens.push((s as u32, t as u32));
                compact_x.extend_from_slice(&rows_of(s)[t * h..(t + 1) * h]);
                if let (Some(rx), Some(q)) = (fp8_rx.as_mut(), quantised[s].as_ref()) {
                    rx.compact_q.extend_from_slice(&q.q[t * h..(t + 1) * h]);
                    rx.compact_scales
                        .extend_from_slice(&q.scales[t * g..(t + 1) * g]);
                }
            }
        }
        out.push(FfnReceived {
            plan,
            expanded,
            compact_tokens,
            compact_x,
            compact_ids,
            compact_weights,
            fp8: fp8_rx,
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

    /// Row `i` of a row-major matrix of `width` columns.
    fn matrix_row<T>(v: &[T], i: usize, width: usize) -> &[T] {
        &v[i * width..(i + 1) * width]
    }

    /// Asserts that row `i` of `a` equals row `j` of `b`, both matrices `width` elements wide.
    #[track_caller]
    fn assert_same_row<T: PartialEq + std::fmt::Debug>(
        a: &[T],
        i: usize,
        b: &[T],
        j: usize,
        width: usize,
    ) {
        assert_eq!(matrix_row(a, i, width), matrix_row(b, j, width));
    }

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

    fn fp8_cfg(topo: &str, hidden: usize) -> ExchangeConfig {
        let t: Topology = topo.parse().unwrap();
        let mut cfg = ExchangeConfig::new(t, hidden, 12, 3, 64).unwrap();
        cfg.payload = PayloadKind::Fp8E4m3;
        cfg.validate().unwrap();
        cfg
    }

    /// fp8 dispatch delivers each travelling token's codes, scales and dequantised row at
    /// every place the bf16 dispatch delivers its row, and nothing else changes.
    #[test]
    fn fp8_dispatch_delivers_codes_scales_and_dequantised_rows() {
        for topo in ["3A:1F", "2A:2F", "1A:3F", "EP4"] {
            let cfg = fp8_cfg(topo, 384);
            let mut bf = cfg.clone();
            bf.payload = PayloadKind::Bf16;
            let mut inp = inputs(&cfg, &[5, 0, 9, 3][..cfg.topology.attention_count()], 4);
            // a zero group, a tiny group and a huge one in the last source's first token
            let last = (0..inp.len())
                .max_by_key(|&s| inp[s].routes.tokens)
                .unwrap();
            let x = &mut inp[last].x;
            x[..128].iter_mut().for_each(|v| *v = bf16::ZERO);
            x[128..256]
                .iter_mut()
                .for_each(|v| *v = bf16::from_bits(v.to_bits() & 0x807f));
            x[256..384]
                .iter_mut()
                .for_each(|v| *v = bf16::from_f32(v.to_f32() * 1e30));
            let q = fp8_rx(&cfg, &inp);
            let b = dispatch(&bf, &inp).unwrap();
            let quantised: Vec<QuantisedRows> =
                inp.iter().map(|i| QuantisedRows::of(&i.x, 384)).collect();
            for (f, (q, b)) in q.iter().zip(&b).enumerate() {
                assert_eq!(q.plan, b.plan);
                assert_eq!(q.compact_tokens, b.compact_tokens);
                assert_eq!(q.compact_ids, b.compact_ids);
                assert_eq!(q.compact_weights, b.compact_weights);
                assert!(b.fp8.is_none());
                let rx = q.fp8.as_ref().expect("fp8 rows");
                for (i, &(s, t)) in q.compact_tokens.iter().enumerate() {
                    let (s, t) = (s as usize, t as usize);
                    let qs = &quantised[s];
                    assert_same_row(&rx.compact_q, i, &qs.q, t, 384);
                    assert_same_row(&rx.compact_scales, i, &qs.scales, t, 3);
                    assert_same_row(&q.compact_x, i, &qs.dequant, t, 384);
                }
                // every expanded row is some source token's row: find it through the bf16 one
                for row in 0..q.plan.total_rows() as usize {
                    let src = matrix_row(&b.expanded, row, 384);
                    let c = (0..b.compact_tokens.len())
                        .find(|&i| matrix_row(&b.compact_x, i, 384) == src)
                        .unwrap_or_else(|| panic!("{topo} rank {f} row {row}"));
                    assert_same_row(&rx.expanded_q, row, &rx.compact_q, c, 384);
                    assert_same_row(&rx.expanded_scales, row, &rx.compact_scales, c, 3);
                    assert_same_row(&q.expanded, row, &q.compact_x, c, 384);
                }
            }
            // the experts see the dequantised rows
            let scale = |e: usize, rows: &[bf16], _n: usize| {
                rows.iter()
                    .map(|v| bf16::from_f32(v.to_f32() * (e as f32 + 1.0)))
                    .collect()
            };
            let mut deq = inp.clone();
            for (d, qs) in deq.iter_mut().zip(&quantised) {
                d.x = qs.dequant.clone();
            }
            assert_eq!(
                exchange(&cfg, &inp, scale).unwrap(),
                exchange(&bf, &deq, scale).unwrap()
            );
        }
    }

    fn fp8_rx(cfg: &ExchangeConfig, inp: &[SourceInput]) -> Vec<FfnReceived> {
        dispatch(cfg, inp).unwrap()
    }

    #[test]
    fn fp8_rejects_non_finite_rows_that_travel() {
        let cfg = fp8_cfg("2A:2F", 256);
        let mut inp = inputs(&cfg, &[4, 6], 5);
        // token 0 of source 1 masks every slot: its NaN does not travel
        inp[1].routes.idx[..3].iter_mut().for_each(|e| *e = MASKED);
        inp[1].x[7] = bf16::NAN;
        dispatch(&cfg, &inp).unwrap();
        inp[1].x[3 * 256 + 200] = bf16::NEG_INFINITY;
        assert_eq!(
            dispatch(&cfg, &inp).unwrap_err(),
            RouteError::NonFinitePayload {
                rank: 1,
                token: 3,
                channel: 200,
                value: f32::NEG_INFINITY
            }
        );
        // bf16 payloads carry them
        let mut bf = cfg.clone();
        bf.payload = PayloadKind::Bf16;
        dispatch(&bf, &inp).unwrap();
        // a route error comes first
        inp[1].routes.idx[3 * 3] = 99;
        assert!(matches!(
            dispatch(&cfg, &inp).unwrap_err(),
            RouteError::Wide { rank: 1, .. }
        ));
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
