//! `--probe FILE`: the probe points inside the kernels of a run's device rounds
//! ([`afdep_kernels::ops::probe`]) as JSON, and a table of each rank's median times.
//!
//! Per problem (token count): the label of the row's settings, each rank's role, the point
//! names, and per timed round and rank the time of every point that fired, µs from the round's
//! first point of any rank (`null` where it did not fire); then per rank and point the median
//! over rounds. Every rank of one GPU reads the same timer, so the ranks line up.

use std::collections::BTreeMap;
use std::path::Path;

use afdep_kernels::ops::probe::{POINTS, SLOTS};
use anyhow::Result;
use serde_json::{Value, json};

use super::rows::median;

/// The probe points of one problem's timed rounds, `[rank][round]`.
pub(super) struct ProbeSet {
    /// The problem's settings.
    pub(super) label: String,
    /// Each rank's role.
    pub(super) roles: Vec<String>,
    pub(super) probes: Vec<Vec<[u64; SLOTS]>>,
}

/// Per round `[round][rank][point]`: µs from the round's first point of any rank, `None` where
/// the point did not fire (rounds that every rank recorded).
fn relative(set: &ProbeSet) -> Vec<Vec<Vec<Option<f64>>>> {
    let rounds = set.probes.iter().map(Vec::len).min().unwrap_or(0);
    (0..rounds)
        .map(|i| {
            let t0 = set
                .probes
                .iter()
                .flat_map(|r| r[i].iter().copied())
                .filter(|&t| t != 0)
                .min()
                .unwrap_or(0);
            set.probes
                .iter()
                .map(|r| {
                    r[i][..POINTS.len()]
                        .iter()
                        .map(|&t| (t != 0).then(|| t.saturating_sub(t0) as f64 / 1e3))
                        .collect()
                })
                .collect()
        })
        .collect()
}

/// Per rank, per point that fired in some round: the median over the rounds where it fired.
fn medians(rel: &[Vec<Vec<Option<f64>>>], ranks: usize) -> Vec<BTreeMap<usize, f64>> {
    (0..ranks)
        .map(|rank| {
            (0..POINTS.len())
                .filter_map(|p| {
                    let v: Vec<f64> = rel.iter().filter_map(|r| r[rank][p]).collect();
                    (!v.is_empty()).then(|| (p, median(v)))
                })
                .collect()
        })
        .collect()
}

/// The table of `set`'s medians: a row per point that fired on some rank (in the order of its
/// earliest median on any rank), a column per rank, µs from the round's first point.
pub(super) fn table(set: &ProbeSet) -> String {
    let rel = relative(set);
    let med = medians(&rel, set.probes.len());
    let mut t = format!(
        "probes: {} ({} rounds), µs from the round's first point\n",
        set.label,
        rel.len()
    );
    t.push_str("| point |");
    for (r, role) in set.roles.iter().enumerate() {
        t.push_str(&format!(" {r} ({role}) |"));
    }
    t.push_str("\n|---|");
    t.push_str(&"---:|".repeat(set.roles.len()));
    t.push('\n');
    // the points that fired, in the order of their earliest median on any rank
    let mut order: Vec<(f64, usize)> = (0..POINTS.len())
        .filter_map(|p| {
            med.iter()
                .filter_map(|m| m.get(&p).copied())
                .reduce(f64::min)
                .map(|v| (v, p))
        })
        .collect();
    order.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
    for (_, p) in order {
        let name = POINTS[p];
        t.push_str(&format!("| {name} |"));
        for m in &med {
            match m.get(&p) {
                Some(v) => t.push_str(&format!(" {v:.1} |")),
                None => t.push_str(" – |"),
            }
        }
        t.push('\n');
    }
    t
}

/// The JSON of every problem's probes.
fn to_json(sets: &[ProbeSet]) -> Value {
    let problems: Vec<Value> = sets
        .iter()
        .map(|s| {
            let rel = relative(s);
            let med = medians(&rel, s.probes.len());
            let med: Vec<BTreeMap<&str, f64>> = med
                .iter()
                .map(|m| m.iter().map(|(&p, &v)| (POINTS[p], v)).collect())
                .collect();
            json!({
                "label": s.label,
                "roles": s.roles,
                "points": POINTS,
                "rounds_us": rel,
                "median_us": med,
            })
        })
        .collect();
    json!({ "unit": "us from the round's first point", "problems": problems })
}

/// Writes `sets` to `path`.
pub(super) fn write(path: &Path, sets: &[ProbeSet]) -> Result<()> {
    std::fs::write(path, serde_json::to_string_pretty(&to_json(sets))?)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two ranks, two rounds: times from each round's first point, points that did not fire
    /// are `None`, and the medians and the table follow.
    #[test]
    fn relative_times_and_medians() {
        let mut a = [[0u64; SLOTS]; 2];
        let mut b = [[0u64; SLOTS]; 2];
        a[0][0] = 1_000;
        a[0][1] = 3_000;
        b[0][1] = 2_000;
        a[1][0] = 10_000;
        a[1][1] = 16_000;
        b[1][1] = 12_000;
        let set = ProbeSet {
            label: "t".into(),
            roles: vec!["attention 0".into(), "ffn 0".into()],
            probes: vec![a.to_vec(), b.to_vec()],
        };
        let rel = relative(&set);
        assert_eq!(rel[0][0][0], Some(0.0));
        assert_eq!(rel[0][0][1], Some(2.0));
        assert_eq!(rel[0][1][0], None);
        assert_eq!(rel[1][1][1], Some(2.0));
        let m = medians(&rel, 2);
        // the median of an even count is the upper one (rows::median)
        assert_eq!(m[0][&1], 6.0);
        assert_eq!(m[1][&1], 2.0);
        assert!(!m[1].contains_key(&0));
        let t = table(&set);
        assert!(t.contains("| gate | 0.0 | – |"), "{t}");
        assert!(t.contains("| front_in | 6.0 | 2.0 |"), "{t}");
        assert!(!t.contains("status_out"), "{t}");
    }
}
