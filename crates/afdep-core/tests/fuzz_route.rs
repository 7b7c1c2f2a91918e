//! Fuzzing route validation (`afdep_core::route::validate`) with proptest, bounded so that CI
//! runs it in seconds: arbitrary route tables (expert ids around and far outside the valid
//! range, NaN and infinite weights, sizes that do not match the shape, token counts that
//! overflow `tokens × top_k`) against arbitrary rules. `validate` must never panic, must accept
//! exactly the tables a direct restatement of its rules accepts, and its error must name the
//! first offending slot (tokens ascending, slots ascending; per slot: negative, wide, dummy,
//! non-finite weight, duplicate; capacity before any slot).

use afdep_core::RouteError;
use afdep_core::route::{MASKED, RouteRules, Routes, validate};
use proptest::prelude::*;

/// The first error of `r` under `rules`, restated slot by slot (the spec of the module docs).
fn first_error(r: &Routes, rules: &RouteRules) -> Option<&'static str> {
    if r.top_k != rules.top_k {
        return Some("malformed");
    }
    match r.tokens.checked_mul(r.top_k) {
        Some(n) if n == r.idx.len() && n == r.weights.len() => {}
        _ => return Some("malformed"),
    }
    if r.tokens > rules.capacity {
        return Some("capacity");
    }
    let k = r.top_k;
    for t in 0..r.tokens {
        for s in 0..k {
            let (e, w) = (r.idx[t * k + s], r.weights[t * k + s]);
            if e == MASKED {
                continue;
            }
            let why = if e < MASKED {
                "negative"
            } else if e as usize >= rules.experts {
                "wide"
            } else if e as usize >= rules.owned {
                "dummy"
            } else if !w.is_finite() {
                "weight"
            } else if r.idx[t * k..t * k + s].contains(&e) {
                "duplicate"
            } else {
                continue;
            };
            return Some(why);
        }
    }
    None
}

fn class(e: &RouteError) -> &'static str {
    match e {
        RouteError::Malformed { .. } => "malformed",
        RouteError::OverCapacity { .. } => "capacity",
        RouteError::Negative { .. } => "negative",
        RouteError::Wide { .. } => "wide",
        RouteError::Dummy { .. } => "dummy",
        RouteError::NonFiniteWeight { .. } => "weight",
        RouteError::Duplicate { .. } => "duplicate",
        _ => "other",
    }
}

/// The (token, slot) an error names, if any.
fn position(e: &RouteError) -> Option<(usize, usize)> {
    match *e {
        RouteError::Negative { token, slot, .. }
        | RouteError::Wide { token, slot, .. }
        | RouteError::Dummy { token, slot, .. }
        | RouteError::NonFiniteWeight { token, slot, .. }
        | RouteError::Duplicate { token, slot, .. } => Some((token, slot)),
        _ => None,
    }
}

/// Whether slot (t, s) of `r` is the first one the spec rejects.
fn is_first_bad(r: &Routes, rules: &RouteRules, t: usize, s: usize) -> bool {
    let k = r.top_k;
    let bad = |t: usize, s: usize| {
        let e = r.idx[t * k + s];
        e != MASKED
            && (e < MASKED
                || e as usize >= rules.owned
                || !r.weights[t * k + s].is_finite()
                || r.idx[t * k..t * k + s].contains(&e))
    };
    t < r.tokens && s < k && bad(t, s) && (0..t * k + s).all(|i| !bad(i / k.max(1), i % k.max(1)))
}

fn weight() -> impl Strategy<Value = f32> {
    prop_oneof![
        8 => 0.0f32..1.0,
        1 => Just(f32::NAN),
        1 => Just(f32::INFINITY),
        1 => Just(f32::NEG_INFINITY),
        1 => any::<f32>(),
    ]
}

fn expert_id() -> impl Strategy<Value = i32> {
    prop_oneof![
        10 => -1i32..12,
        1 => Just(i32::MIN),
        1 => Just(i32::MAX),
        1 => any::<i32>(),
    ]
}

/// A table of `tokens × top_k` slots, sometimes with arrays of the wrong length.
fn routes() -> impl Strategy<Value = Routes> {
    (0usize..12, 0usize..5).prop_flat_map(|(tokens, top_k)| {
        let n = tokens * top_k;
        (
            proptest::collection::vec(expert_id(), n..=n + 1),
            proptest::collection::vec(weight(), n..=n + 1),
            prop_oneof![8 => Just(tokens), 1 => Just(usize::MAX / 2), 1 => Just(usize::MAX)],
        )
            .prop_map(move |(mut idx, mut weights, t)| {
                // mostly the right sizes
                if idx.len() > n && idx[n] % 3 != 0 {
                    idx.truncate(n);
                }
                if weights.len() > n && idx.len() == n {
                    weights.truncate(n);
                }
                Routes {
                    tokens: t,
                    top_k,
                    idx,
                    weights,
                }
            })
    })
}

fn rules() -> impl Strategy<Value = RouteRules> {
    (0usize..14, 0usize..14, 0usize..14, 0usize..5).prop_map(|(experts, owned, capacity, top_k)| {
        RouteRules {
            experts,
            owned: owned.min(experts),
            capacity,
            top_k,
        }
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 3000, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn validate_never_panics_and_names_the_first_offending_slot(
        r in routes(),
        mut rules in rules(),
        same_k in any::<bool>(),
        rank in 0usize..8,
    ) {
        if same_k {
            rules.top_k = r.top_k;
        }
        let got = validate(&r, &rules, rank);
        let want = first_error(&r, &rules);
        match (&got, want) {
            (Ok(()), None) => {}
            (Err(e), Some(w)) => {
                prop_assert_eq!(class(e), w, "{}", e);
                prop_assert_eq!(e.rank(), rank);
                if let Some((t, s)) = position(e) {
                    prop_assert!(is_first_bad(&r, &rules, t, s), "{} is not the first bad slot", e);
                }
            }
            _ => prop_assert!(false, "validate: {:?}, spec: {:?}", got, want),
        }
    }
}
