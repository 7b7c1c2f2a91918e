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
//! Partials ([`ExchangeConfig::partials`]): with [`CombinePartials::F32`] (the default) the
//! source adds `partial_r` as computed, which is the arithmetic above. With
//! [`CombinePartials::Bf16`] it adds `f32(bf16(partial_r))` instead (each partial rounded to
//! bf16, nearest even, then widened exactly: [`CombinePartials::as_received`]), and everything
//! else is unchanged: engines with bf16 partials are bit-identical to this oracle with bf16
//! partials, and [`partials_bound`] / [`bf16_partials_error_bound`] bound their distance from
//! the exact result (zero where a token's slots sit on one FFN rank).
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

use crate::config::{CombinePartials, ExchangeConfig, PayloadKind};
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

/// The f32 partials of a source's tokens, in the combine's order: for token `t`,
/// [`Partials::token`] hands each FFN rank's partial `Σ_{slot k ascending, expert on f} w_k ·
/// y_k` (from 0, each product and sum rounded to f32, no FMA) to its callback, FFN ranks
/// ascending, skipping the ranks that hold no slot of `t`. The combine and the error bound of
/// bf16 partials both read the partials from here, so they are the same numbers.
struct Partials<'a, O, R> {
    routes: &'a Routes,
    hidden: usize,
    owner: O,
    row_of: R,
    ffn_rows: &'a [&'a [bf16]],
    slots_of: Vec<Vec<usize>>,
    partial: Vec<f32>,
}

impl<'a, O, R> Partials<'a, O, R>
where
    O: Fn(usize) -> usize,
    R: Fn(usize) -> u64,
{
    fn new(
        routes: &'a Routes,
        hidden: usize,
        owner: O,
        row_of: R,
        ffn_rows: &'a [&'a [bf16]],
    ) -> Self {
        Partials {
            routes,
            hidden,
            owner,
            row_of,
            ffn_rows,
            slots_of: vec![Vec::new(); ffn_rows.len()],
            partial: vec![0f32; hidden],
        }
    }

    /// Calls `each(partial)` for every FFN rank holding a slot of token `t`, ascending.
    fn token(&mut self, t: usize, mut each: impl FnMut(&[f32])) {
        let (k, h) = (self.routes.top_k, self.hidden);
        for s in self.slots_of.iter_mut() {
            s.clear();
        }
        for j in 0..k {
            let e = self.routes.idx[t * k + j];
            if e != MASKED {
                self.slots_of[(self.owner)(e as usize)].push(j);
            }
        }
        for (f, slots) in self.slots_of.iter().enumerate() {
            if slots.is_empty() {
                continue;
            }
            self.partial.iter_mut().for_each(|a| *a = 0.0);
            for &j in slots {
                let w = self.routes.weights[t * k + j];
                let row = (self.row_of)(t * k + j) as usize;
                let y = &self.ffn_rows[f][row * h..(row + 1) * h];
                for (p, v) in self.partial.iter_mut().zip(y) {
                    *p += w * v.to_f32();
                }
            }
            each(&self.partial);
        }
    }
}

/// Combine one source's tokens from the rows each FFN rank returns: `owner(expert)` is the FFN
/// index holding an expert and `row_of(slot index)` the slot's row in `ffn_rows[owner]`; the
/// arithmetic is the module's, with the partials travelling as `partials` says: each FFN rank's
/// f32 partial is replaced by [`CombinePartials::as_received`] of it before the source adds it
/// (for [`CombinePartials::Bf16`], rounded to bf16 and widened back), then summed as ever.
pub fn combine_source<R>(
    routes: &Routes,
    hidden: usize,
    partials: CombinePartials,
    owner: impl Fn(usize) -> usize,
    row_of: R,
    ffn_rows: &[&[bf16]],
) -> Vec<bf16>
where
    R: Fn(usize) -> u64,
{
    let mut sums = Partials::new(routes, hidden, owner, row_of, ffn_rows);
    combine_tokens(&mut sums, |p| partials.as_received(p))
}

/// Every token of `sums`' source: `acc = 0; acc = acc + received(P_f)` over its partials
/// (FFN ranks ascending, in f32), then one cast to bf16.
fn combine_tokens<O, R>(sums: &mut Partials<'_, O, R>, received: impl Fn(f32) -> f32) -> Vec<bf16>
where
    O: Fn(usize) -> usize,
    R: Fn(usize) -> u64,
{
    let (tokens, h) = (sums.routes.tokens, sums.hidden);
    let mut out = vec![bf16::ZERO; tokens * h];
    let mut acc = vec![0f32; h];
    for t in 0..tokens {
        acc.iter_mut().for_each(|a| *a = 0.0);
        sums.token(t, |partial| {
            for (a, p) in acc.iter_mut().zip(partial) {
                *a += received(*p);
            }
        });
        for (o, a) in out[t * h..(t + 1) * h].iter_mut().zip(&acc) {
            *o = bf16::from_f32(*a);
        }
    }
    out
}

/// Calls `each(source, partials)` for every source with the [`Partials`] of its tokens over
/// the expert outputs `y` of every FFN rank.
fn each_source_partials(
    cfg: &ExchangeConfig,
    inputs: &[SourceInput],
    received: &[FfnReceived],
    y: &[Vec<bf16>],
    mut each: impl FnMut(usize, &mut Partials<'_, &dyn Fn(usize) -> usize, &dyn Fn(usize) -> u64>),
) {
    let p = cfg.placement();
    let rows: Vec<&[bf16]> = y.iter().map(|v| v.as_slice()).collect();
    for (s, inp) in inputs.iter().enumerate() {
        let pos = block_positions(&inp.routes, &p);
        let row_of = |i: usize| {
            let e = inp.routes.idx[i] as usize;
            let f = p.owner(e).expect("validated");
            received[f].plan.block_start(p.local(e), s) + pos[i].expect("unmasked")
        };
        let owner = |e: usize| p.owner(e).expect("validated");
        let mut sums = Partials::new(
            &inp.routes,
            cfg.hidden,
            &owner as &dyn Fn(usize) -> usize,
            &row_of as &dyn Fn(usize) -> u64,
            &rows,
        );
        each(s, &mut sums);
    }
}

/// Combine: the output of every source, from the expanded rows `y[f]` of every FFN rank, with
/// the partials of [`ExchangeConfig::partials`].
pub fn combine(
    cfg: &ExchangeConfig,
    inputs: &[SourceInput],
    received: &[FfnReceived],
    y: &[Vec<bf16>],
) -> Vec<Vec<bf16>> {
    combine_with(cfg, inputs, received, y, |p| cfg.partials.as_received(p))
}

/// [`combine`] with `received(partial)` as what the source adds of each partial.
fn combine_with(
    cfg: &ExchangeConfig,
    inputs: &[SourceInput],
    received: &[FfnReceived],
    y: &[Vec<bf16>],
    received_partial: impl Fn(f32) -> f32,
) -> Vec<Vec<bf16>> {
    let mut out = Vec::with_capacity(inputs.len());
    each_source_partials(cfg, inputs, received, y, |_, sums| {
        out.push(combine_tokens(sums, &received_partial));
    });
    out
}

/// The error bound of bf16 partials for one output element (docs/design.md, "Specification:
/// AFD exchange", "bf16 partials and their error bound"): how far the element's result with
/// [`CombinePartials::Bf16`] may lie from its result with [`CombinePartials::F32`], `exact`,
/// given `abs_partials` = `S = Σ_f |P_f|` (the f32 partials of the FFN ranks holding a slot of
/// the token, for this channel) and `partials` = `n`, their number.
///
/// With `u = 2^-8` (bf16's unit roundoff), `η = 2^-134` (half of bf16's smallest subnormal
/// spacing: the absolute error of a rounding to bf16 below its normal range) and
/// `γ = (n−1)·2^-24 / (1 − (n−1)·2^-24)` (the f32 sum of n terms from 0), the derivation:
///
/// - each partial is rounded once more, `Q_f = bf16(P_f)`: `|Q_f − P_f| ≤ u·|P_f| + η`, so
///   `|ΣQ − ΣP| ≤ u·S + n·η`;
/// - both paths sum their n terms in f32 from 0 in the same order (the first addition is
///   exact): `|acc_e − ΣP| ≤ γ·S` and `|acc_b − ΣQ| ≤ γ·Σ|Q| ≤ γ·((1+u)·S + n·η)`, so
///   `D = |acc_b − acc_e| ≤ (u + (2+u)·γ)·S + (1+γ)·n·η`;
/// - both cast to bf16 once: `|out − acc| ≤ u·|acc| + η` each, `|acc_b| ≤ |acc_e| + D` and
///   `|acc_e| ≤ (|exact| + η)/(1−u)`; so
///
/// `|out_b − exact| ≤ (1+u)·(u + (2+u)·γ)·S + 2u/(1−u)·|exact| + (n+2)·2^-133`
///
/// (the `η` terms together stay below `(n+2)·2η`). To first order: `2^-8·S + 2^-7·|exact| +
/// 2(n−1)·2^-24·S`. With `n ≤ 1` the two results are the same bits (one partial: `0 + Q = Q`
/// exactly, and `bf16(Q) = Q = bf16(P)`), so the bound is 0: with one FFN rank (3A:1F, EP1),
/// bf16 partials change the bytes on the wire but not the result. It assumes nothing
/// overflows bf16 (no `|P_f|`, sum or output at or above bf16's largest finite value plus half
/// an ulp); a non-finite `S` or `exact` has no bound (infinity is returned).
pub fn bf16_partials_error_bound(abs_partials: f64, partials: usize, exact: f32) -> f64 {
    if partials <= 1 {
        return 0.0;
    }
    if !abs_partials.is_finite() || !exact.is_finite() {
        return f64::INFINITY;
    }
    let u = 2f64.powi(-8);
    let m = (partials - 1) as f64 * 2f64.powi(-24);
    let gamma = m / (1.0 - m);
    (1.0 + u) * (u + (2.0 + u) * gamma) * abs_partials
        + 2.0 * u / (1.0 - u) * f64::from(exact.abs())
        + (partials as f64 + 2.0) * 2f64.powi(-133)
}

/// A round's exact result (f32 partials) and, per element, the bound of its result with bf16
/// partials ([`bf16_partials_error_bound`]); see [`partials_bound`].
#[derive(Debug, Clone, PartialEq)]
pub struct PartialsBound {
    /// Every source's output with [`CombinePartials::F32`].
    pub exact: Vec<Vec<bf16>>,
    /// Every source's bound, element by element (0 where one FFN rank or none holds the
    /// token's slots: the results are then the same bits).
    pub bound: Vec<Vec<f64>>,
}

/// An element outside its bound ([`PartialsBound::first_violation`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BoundViolation {
    /// The source.
    pub source: usize,
    /// The element (`token × hidden + channel`).
    pub index: usize,
    /// The element checked.
    pub got: f32,
    /// The exact result's.
    pub exact: f32,
    /// Its bound.
    pub bound: f64,
}

impl PartialsBound {
    /// The first element (source, then element order) of `got` (every source's output with
    /// bf16 partials) whose distance from the exact result exceeds its bound, or is not a
    /// number; `None` when every element is within its bound. Outputs of the wrong size are a
    /// violation (NaN values) at the first missing or extra source or element.
    pub fn first_violation(&self, got: &[Vec<bf16>]) -> Option<BoundViolation> {
        let missing = |source: usize, index: usize| BoundViolation {
            source,
            index,
            got: f32::NAN,
            exact: f32::NAN,
            bound: 0.0,
        };
        if got.len() != self.exact.len() {
            return Some(missing(got.len().min(self.exact.len()), 0));
        }
        for (s, ((e, b), g)) in self.exact.iter().zip(&self.bound).zip(got).enumerate() {
            for (i, ((ev, bv), gv)) in e.iter().zip(b).zip(g).enumerate() {
                let (gv, ev) = (gv.to_f32(), ev.to_f32());
                let same = gv.to_bits() == ev.to_bits() || (gv.is_nan() && ev.is_nan());
                // false for a NaN distance: a violation
                let within = (f64::from(gv) - f64::from(ev)).abs() <= *bv;
                if !same && !within {
                    return Some(BoundViolation {
                        source: s,
                        index: i,
                        got: gv,
                        exact: ev,
                        bound: *bv,
                    });
                }
            }
            if g.len() != e.len() {
                return Some(missing(s, g.len().min(e.len())));
            }
        }
        None
    }

    /// The largest `|got − exact| / bound` over the elements with a positive finite bound (how
    /// much of the bound a result uses: at most 1 when [`Self::first_violation`] is `None`).
    pub fn worst_ratio(&self, got: &[Vec<bf16>]) -> f64 {
        let mut worst = 0f64;
        for ((e, b), g) in self.exact.iter().zip(&self.bound).zip(got) {
            for ((ev, bv), gv) in e.iter().zip(b).zip(g) {
                if *bv > 0.0 && bv.is_finite() {
                    let d = (f64::from(gv.to_f32()) - f64::from(ev.to_f32())).abs();
                    worst = worst.max(d / bv);
                }
            }
        }
        worst
    }
}

/// The exact result of a round and the bound of its bf16-partials result, element by element
/// ([`bf16_partials_error_bound`] of the element's f32 partials, read from the same partial
/// sums the combine adds). `cfg.partials` is ignored: this compares the two settings.
pub fn partials_bound<F>(
    cfg: &ExchangeConfig,
    inputs: &[SourceInput],
    expert: F,
) -> Result<PartialsBound, RouteError>
where
    F: Fn(usize, &[bf16], usize) -> Vec<bf16>,
{
    let received = dispatch(cfg, inputs)?;
    let y = apply_experts(cfg, &received, expert);
    let exact = combine_with(cfg, inputs, &received, &y, |p| p);
    let h = cfg.hidden;
    let mut bound = Vec::with_capacity(inputs.len());
    let mut abs = vec![0f64; h];
    each_source_partials(cfg, inputs, &received, &y, |s, sums| {
        let mut b = vec![0f64; inputs[s].routes.tokens * h];
        for t in 0..inputs[s].routes.tokens {
            abs.iter_mut().for_each(|a| *a = 0.0);
            let mut n = 0usize;
            sums.token(t, |partial| {
                n += 1;
                for (a, p) in abs.iter_mut().zip(partial) {
                    *a += f64::from(p.abs());
                }
            });
            for (c, bc) in b[t * h..(t + 1) * h].iter_mut().enumerate() {
                *bc = bf16_partials_error_bound(abs[c], n, exact[s][t * h + c].to_f32());
            }
        }
        bound.push(b);
    });
    Ok(PartialsBound { exact, bound })
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
                let routes = Routes::new(t, k, idx, weights).unwrap();
                SourceInput { x, routes }
            })
            .collect()
    }

    /// With an expert that scales rows by (expert id + 1), combine equals a direct sum, for
    /// both settings of the partials (bf16: each partial rounded to bf16 before it is added).
    #[test]
    fn combine_equals_direct_sum_in_the_fixed_order() {
        for partials in [CombinePartials::F32, CombinePartials::Bf16] {
            // written out here, not through CombinePartials::as_received
            let round = |p: f32| match partials {
                CombinePartials::F32 => p,
                CombinePartials::Bf16 => bf16::from_f32(p).to_f32(),
            };
            for topo in ["3A:1F", "2A:2F", "1A:3F", "EP4"] {
                let t: Topology = topo.parse().unwrap();
                let mut cfg = ExchangeConfig::new(t, 16, 12, 3, 64).unwrap();
                cfg.partials = partials;
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
                                    acc += round(part);
                                }
                            }
                            assert_eq!(
                                out[s][tok * cfg.hidden + c],
                                bf16::from_f32(acc),
                                "{partials} {topo} s{s} t{tok} c{c}"
                            );
                        }
                    }
                }
            }
        }
    }

    /// Inputs for the bf16-partials tests: `tokens[s]` tokens on source s, rows spread over
    /// 2^-12 .. 2^12, distinct experts per token with one slot in five masked, and signed
    /// weights, so that partials of different FFN ranks cancel.
    fn signed_inputs(cfg: &ExchangeConfig, tokens: &[usize], seed: u64) -> Vec<SourceInput> {
        use rand::Rng;
        use rand::seq::SliceRandom;
        let mut r = crate::tensor::rng(seed, 3);
        let owned = cfg.placement().owned();
        let k = cfg.top_k;
        tokens
            .iter()
            .map(|&t| {
                let x = (0..t * cfg.hidden)
                    .map(|_| {
                        let m: f32 = r.gen_range(-1.0..1.0);
                        bf16::from_f32(m * 2f32.powi(r.gen_range(-12..=12)))
                    })
                    .collect();
                let mut idx = Vec::with_capacity(t * k);
                for _ in 0..t {
                    let mut ids: Vec<i32> = (0..owned as i32).collect();
                    ids.shuffle(&mut r);
                    idx.extend(
                        ids[..k]
                            .iter()
                            .map(|&e| if r.gen_bool(0.2) { MASKED } else { e }),
                    );
                }
                let weights = (0..t * k).map(|_| r.gen_range(-2.0f32..2.0)).collect();
                let routes = Routes::new(t, k, idx, weights).unwrap();
                SourceInput { x, routes }
            })
            .collect()
    }

    /// Expert e scales its rows by a signed per-expert factor of magnitude 2^-3 .. 2^3.
    fn signed_scale(e: usize, rows: &[bf16], _n: usize) -> Vec<bf16> {
        let f = if e % 2 == 0 { 1.0 } else { -1.0 } * 2f32.powi((e % 7) as i32 - 3) * 1.37;
        rows.iter()
            .map(|v| bf16::from_f32(v.to_f32() * f))
            .collect()
    }

    fn bf16_cfg(topo: &str, hidden: usize, experts: usize, top_k: usize) -> ExchangeConfig {
        let mut cfg =
            ExchangeConfig::new(topo.parse().unwrap(), hidden, experts, top_k, 512).unwrap();
        cfg.partials = CombinePartials::Bf16;
        cfg
    }

    /// With one FFN rank every token has one partial, and `bf16(0 + bf16(P)) = bf16(P)`: bf16
    /// partials give the exact result's bits.
    #[test]
    fn bf16_partials_of_one_ffn_rank_are_bit_identical() {
        for topo in ["3A:1F", "1A:1F", "EP1"] {
            let cfg = bf16_cfg(topo, 24, 12, 4);
            let mut f32_cfg = cfg.clone();
            f32_cfg.partials = CombinePartials::F32;
            let inp = signed_inputs(&cfg, &[40, 0, 17][..cfg.topology.attention_count()], 3);
            assert_eq!(
                exchange(&cfg, &inp, signed_scale).unwrap(),
                exchange(&f32_cfg, &inp, signed_scale).unwrap(),
                "{topo}"
            );
            let b = partials_bound(&cfg, &inp, signed_scale).unwrap();
            assert!(b.bound.iter().flatten().all(|&v| v == 0.0), "{topo}");
        }
    }

    /// On several FFN ranks bf16 partials give another result than f32 partials, within the
    /// bound; the bound is not loose (the results use most of it somewhere), its `S` term is
    /// needed (cancelling partials exceed the output-rounding terms alone), and it catches an
    /// implementation that truncates the partials to bf16 instead of rounding them to nearest.
    #[test]
    fn bf16_partials_are_different_within_a_tight_bound() {
        let u = 2f64.powi(-8);
        for topo in ["2A:2F", "1A:3F", "EP4", "1A:4F"] {
            let cfg = bf16_cfg(topo, 32, 24, 6);
            let a = cfg.topology.attention_count();
            let inp = signed_inputs(&cfg, &[300, 0, 257, 64][..a], 7);
            let got = exchange(&cfg, &inp, signed_scale).unwrap();
            let b = partials_bound(&cfg, &inp, signed_scale).unwrap();
            if let Some(v) = b.first_violation(&got) {
                panic!("{topo}: outside the bound: {v:?}");
            }
            let differ = got
                .iter()
                .flatten()
                .zip(b.exact.iter().flatten())
                .filter(|(g, e)| g.to_bits() != e.to_bits())
                .count();
            assert!(differ > 0, "{topo}: bf16 partials changed nothing");
            let worst = b.worst_ratio(&got);
            assert!(
                worst > 0.5,
                "{topo}: the results use {worst} of the bound at most"
            );
            // the output-rounding terms alone do not hold the results
            let beyond = got
                .iter()
                .flatten()
                .zip(b.exact.iter().flatten())
                .any(|(g, e)| {
                    let d = (f64::from(g.to_f32()) - f64::from(e.to_f32())).abs();
                    d > 2.0 * u / (1.0 - u) * f64::from(e.to_f32().abs()) + 1e-30
                });
            assert!(beyond, "{topo}: no result needs the S term");
            // a wrong rounding of the partials (toward zero) leaves the bound
            let received = dispatch(&cfg, &inp).unwrap();
            let y = apply_experts(&cfg, &received, signed_scale);
            let truncated = combine_with(&cfg, &inp, &received, &y, |p| {
                f32::from_bits(p.to_bits() & 0xffff_0000)
            });
            assert!(
                b.first_violation(&truncated).is_some(),
                "{topo}: truncated partials stayed within the bound"
            );
            // and the oracle's combine is this module's rounding, nothing else
            let nearest = combine_with(&cfg, &inp, &received, &y, |p| bf16::from_f32(p).to_f32());
            assert_eq!(nearest, got, "{topo}");
        }
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(48))]

        /// Random rounds on several FFN ranks (any hidden size, top-k, expert count, uneven and
        /// empty sources): every element of the bf16-partials result lies within its bound of
        /// the exact result, and tokens with one partial are the same bits.
        #[test]
        fn bf16_partials_stay_within_the_bound(
            topo in proptest::sample::select(vec!["2A:2F", "1A:3F", "EP4", "3A:2F", "1A:4F", "EP2"]),
            hidden in 1usize..40,
            epr in 1usize..5,
            k_frac in 0.0f64..1.0,
            tokens in proptest::collection::vec(0usize..24, 4),
            seed in 0u64..1_000_000,
        ) {
            let t: Topology = topo.parse().unwrap();
            let experts = epr * t.ffn_count();
            let top_k = 1 + ((experts - 1) as f64 * k_frac) as usize;
            let cfg = bf16_cfg(topo, hidden, experts, top_k);
            let inp = signed_inputs(&cfg, &tokens[..t.attention_count()], seed);
            let got = exchange(&cfg, &inp, signed_scale).unwrap();
            let b = partials_bound(&cfg, &inp, signed_scale).unwrap();
            proptest::prop_assert_eq!(b.first_violation(&got), None);
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
