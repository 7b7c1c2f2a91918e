//! `afdep exchange-arms [--arms A,B,..] [--repeats R] -- <afdep exchange flags>`: the paired,
//! rotated-order comparison of dispatch arms that the reference record uses (docs/design.md,
//! "Specification: Measurement").
//!
//! Repeat r (0-based) runs every arm once, each in its own child process (`afdep exchange
//! <flags> --arm A`, this same binary; with `--launch N`, N processes, one per rank, through
//! `afdep launch`), in the order of `--arms` rotated left by r: with arms
//! `P,C,S`, repeat 0 runs `P C S`, repeat 1 `C S P`, repeat 2 `S P C`. So every arm runs in
//! every position, and a drift of the machine over time (clocks, temperature, other load) falls
//! on every arm alike. Each child reports one row per token count (its median over its timed
//! rounds, [`ExchangeRow::round_us`]).
//!
//! Per token count (and topology) and arm, the summary row holds:
//! - `median_us`: the median over the repeats of the child's median;
//! - `paired_change_pct`: per repeat, `100 · (arm / payload-first − 1)` of the two children
//!   of that repeat; `change_pct`: `100 · (median of the per-repeat ratios − 1)`;
//!   `repeats_faster`: the repeats in which the arm beat payload-first.
//!
//! An arm whose engine does not have it (the child exits with
//! [`crate::exchange_cmd::EXIT_UNSUPPORTED`]) gets one summary row per token
//! count with status `unsupported` and the child's reason, and is not started again; any other
//! failure of a child stops the runner with the child's error.
//!
//! Output: the children's rows, each tagged with its repeat, position and order
//! (`"kind": "repeat"`), then the summary rows (`"kind": "arms"`), as JSON lines on stdout (and
//! `--json-out`); the summary as a markdown table on stderr (and `--table`).

use std::collections::BTreeMap;
use std::io::Write;
use std::path::PathBuf;
use std::process::Command;

use anyhow::{Context, Result, bail};
use clap::Args;
use serde::Serialize;

use crate::exchange_cmd::{ArmArg, EXIT_UNSUPPORTED, ExchangeRow};

/// Arguments of `afdep exchange-arms`.
#[derive(Debug, Args)]
pub struct ArmsArgs {
    /// The arms, comma-separated; payload-first (the baseline of the paired change) must be
    /// among them.
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "payload-first,count-first,count-first-source"
    )]
    pub arms: Vec<ArmArg>,
    /// Repeats (each runs every arm once, in a rotated order).
    #[arg(long, default_value_t = 3)]
    pub repeats: usize,
    /// Also append every row to this JSONL file.
    #[arg(long)]
    pub json_out: Option<PathBuf>,
    /// Also write the summary table to this markdown file.
    #[arg(long)]
    pub table: Option<PathBuf>,
    /// Runs every child as N processes, one per rank (`afdep launch -n N -- afdep exchange
    /// --multi-process <flags> --arm A`: the multi-GPU run, one process per GPU); the child's
    /// rows are rank 0's. Without it, a child is one process with its ranks as threads.
    #[arg(long, value_name = "N")]
    pub launch: Option<usize>,
    /// The flags of every child `afdep exchange` (after `--`), without `--arm`.
    #[arg(last = true)]
    pub exchange: Vec<String>,
}

/// A child's row, tagged with where it ran.
#[derive(Debug, Clone, Serialize)]
pub struct RepeatRow {
    /// `repeat`.
    pub kind: &'static str,
    /// The repeat (0-based).
    pub repeat: usize,
    /// The arm's position in this repeat's order (0-based).
    pub position: usize,
    /// This repeat's order.
    pub order: Vec<ArmArg>,
    /// The child's row.
    #[serde(flatten)]
    pub row: ExchangeRow,
}

/// One arm at one token count, over the repeats.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ArmSummary {
    /// `arms`.
    pub kind: &'static str,
    /// Topology.
    pub topology: String,
    /// Tokens on each attention rank.
    pub tokens: Vec<usize>,
    /// The arm.
    pub arm: ArmArg,
    /// `ok`, or `unsupported` (the engine does not have the arm).
    pub status: String,
    /// Why the arm did not run, when it did not.
    pub why: Option<String>,
    /// Median over the repeats of the children's `round_us`.
    pub median_us: Option<f64>,
    /// Each repeat's `round_us`, in repeat order.
    pub repeats_us: Vec<f64>,
    /// Per repeat: `100 · (arm / payload-first − 1)`.
    pub paired_change_pct: Vec<f64>,
    /// `100 · (median of the per-repeat ratios − 1)`.
    pub change_pct: Option<f64>,
    /// Repeats in which the arm was faster than payload-first.
    pub repeats_faster: usize,
    /// The child processes that measured it, in repeat order.
    pub pids: Vec<u32>,
    /// How the times were taken (`device` or `host`, see [`ExchangeRow::timing`]).
    pub timing: String,
}

/// The order of repeat `r`: `arms` rotated left by `r`.
pub fn order(arms: &[ArmArg], r: usize) -> Vec<ArmArg> {
    let mut o = arms.to_vec();
    if !o.is_empty() {
        let n = o.len();
        o.rotate_left(r % n);
    }
    o
}

/// The upper median (as everywhere in afdep); `None` when empty.
fn median(v: &[f64]) -> Option<f64> {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    s.get(s.len() / 2).copied()
}

/// The summary rows of `runs` (every child's rows, with its repeat and arm) and of the
/// `unsupported` arms (with the reason), for `arms` in their given order, token counts and
/// topologies in the order they first appear.
pub fn summarize(
    arms: &[ArmArg],
    runs: &[RepeatRow],
    unsupported: &BTreeMap<ArmArg, String>,
) -> Vec<ArmSummary> {
    type Key = (String, Vec<usize>);
    /// One child's time: (repeat, round_us, pid, timing).
    type Sample = (usize, f64, u32, String);
    let mut keys: Vec<Key> = Vec::new();
    let mut by: BTreeMap<(Key, ArmArg), Vec<Sample>> = BTreeMap::new();
    for r in runs {
        let key = (r.row.topology.clone(), r.row.tokens.clone());
        if !keys.contains(&key) {
            keys.push(key.clone());
        }
        let arm = r.order[r.position];
        by.entry((key, arm)).or_default().push((
            r.repeat,
            r.row.round_us,
            r.row.pid,
            r.row.timing.clone(),
        ));
    }
    let mut out = Vec::new();
    for key in &keys {
        let base: BTreeMap<usize, f64> = by
            .get(&(key.clone(), ArmArg::PayloadFirst))
            .map(|v| v.iter().map(|(r, us, _, _)| (*r, *us)).collect())
            .unwrap_or_default();
        for &arm in arms {
            let unrun = ArmSummary {
                kind: "arms",
                topology: key.0.clone(),
                tokens: key.1.clone(),
                arm,
                status: "unsupported".into(),
                why: None,
                median_us: None,
                repeats_us: Vec::new(),
                paired_change_pct: Vec::new(),
                change_pct: None,
                repeats_faster: 0,
                pids: Vec::new(),
                timing: String::new(),
            };
            if let Some(why) = unsupported.get(&arm) {
                out.push(ArmSummary {
                    why: Some(why.clone()),
                    ..unrun
                });
                continue;
            }
            let mut v = by.get(&(key.clone(), arm)).cloned().unwrap_or_default();
            v.sort_by_key(|(r, ..)| *r);
            let us: Vec<f64> = v.iter().map(|(_, us, _, _)| *us).collect();
            let ratios: Vec<f64> = v
                .iter()
                .filter_map(|(r, us, _, _)| base.get(r).map(|b| us / b))
                .collect();
            out.push(ArmSummary {
                status: "ok".into(),
                median_us: median(&us),
                repeats_us: us,
                paired_change_pct: ratios.iter().map(|q| 100.0 * (q - 1.0)).collect(),
                change_pct: median(&ratios).map(|q| 100.0 * (q - 1.0)),
                repeats_faster: ratios.iter().filter(|&&q| q < 1.0).count(),
                pids: v.iter().map(|(_, _, p, _)| *p).collect(),
                timing: v.first().map(|(.., t)| t.clone()).unwrap_or_default(),
                ..unrun
            });
        }
    }
    out
}

/// The markdown table of `rows`: one line per topology and token count, one column per arm
/// (`median µs (change %)`).
pub fn table(arms: &[ArmArg], rows: &[ArmSummary]) -> String {
    let mut t = String::from("| topology | tokens |");
    for a in arms {
        t.push_str(&format!(" {a} µs |"));
    }
    t.push_str("\n|---|---|");
    for _ in arms {
        t.push_str("---:|");
    }
    t.push('\n');
    let mut lines: Vec<(String, Vec<usize>)> = Vec::new();
    for r in rows {
        let k = (r.topology.clone(), r.tokens.clone());
        if !lines.contains(&k) {
            lines.push(k);
        }
    }
    for (topo, tokens) in lines {
        let tk = match tokens.iter().min() == tokens.iter().max() {
            true => tokens.first().map_or("0".into(), |t| t.to_string()),
            false => format!("{tokens:?}"),
        };
        t.push_str(&format!("| {topo} | {tk} |"));
        for a in arms {
            let cell = rows
                .iter()
                .find(|r| r.topology == topo && r.tokens == tokens && r.arm == *a)
                .map_or("".to_string(), |r| match (r.median_us, r.change_pct) {
                    _ if r.status == "unsupported" => "unsupported".into(),
                    (Some(m), Some(c)) if *a != ArmArg::PayloadFirst => {
                        format!("{m:.1} ({c:+.1} %)")
                    }
                    (Some(m), _) => format!("{m:.1}"),
                    _ => "".into(),
                });
            t.push_str(&format!(" {cell} |"));
        }
        t.push('\n');
    }
    t
}

/// The last line of `stderr` that says why an arm is unsupported, else its last line.
fn reason(stderr: &str) -> String {
    let lines: Vec<&str> = stderr
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect();
    lines
        .iter()
        .rev()
        .find(|l| l.contains("unsupported"))
        .or(lines.last())
        .map_or("unsupported".into(), |l| l.to_string())
}

/// Runs `afdep exchange-arms`.
pub fn run(a: ArmsArgs) -> Result<()> {
    if a.repeats == 0 {
        bail!("--repeats must be at least 1");
    }
    if !a.arms.contains(&ArmArg::PayloadFirst) {
        bail!("--arms must include payload-first: it is the baseline of the paired change");
    }
    let mut seen = Vec::new();
    for arm in &a.arms {
        if seen.contains(arm) {
            bail!("--arms names {arm} twice");
        }
        seen.push(*arm);
    }
    for f in ["--arm", "--json-out", "--table", "--multi-process"] {
        if a.exchange
            .iter()
            .any(|x| x == f || x.starts_with(&format!("{f}=")))
        {
            bail!("exchange-arms sets or refuses {f} for its children; leave it out after `--`");
        }
    }
    if a.launch == Some(0) {
        bail!("--launch needs at least one process");
    }
    let exe = std::env::current_exe().context("finding this program to run its arms")?;
    let mut json_out = a
        .json_out
        .as_deref()
        .map(crate::jsonl::open_append)
        .transpose()?;
    let mut emit = |line: String| -> Result<()> {
        println!("{line}");
        if let Some(f) = &mut json_out {
            writeln!(f, "{line}").context("writing --json-out")?;
        }
        Ok(())
    };
    let mut runs: Vec<RepeatRow> = Vec::new();
    let mut unsupported: BTreeMap<ArmArg, String> = BTreeMap::new();
    for r in 0..a.repeats {
        let ord = order(&a.arms, r);
        for (position, &arm) in ord.iter().enumerate() {
            if unsupported.contains_key(&arm) {
                continue;
            }
            eprintln!(
                "exchange-arms: repeat {r}, {arm} ({}/{})",
                position + 1,
                ord.len()
            );
            let mut cmd = Command::new(&exe);
            if let Some(n) = a.launch {
                cmd.args(["launch", "-n", &n.to_string(), "--"])
                    .arg(&exe)
                    .args(["exchange", "--multi-process"]);
            } else {
                cmd.arg("exchange");
            }
            let out = cmd
                .args(&a.exchange)
                .args(["--arm", arm.name()])
                .output()
                .with_context(|| format!("starting {} exchange", exe.display()))?;
            let stderr = String::from_utf8_lossy(&out.stderr);
            // under `launch` the child's status is the launcher's; the ranks' reason is in
            // their stderr
            let unsupported_child = out.status.code() == Some(EXIT_UNSUPPORTED)
                || (a.launch.is_some() && stderr.contains("unsupported: "));
            if unsupported_child {
                let why = reason(&stderr);
                eprintln!("exchange-arms: {arm}: {why}");
                unsupported.insert(arm, why);
                continue;
            }
            if !out.status.success() {
                bail!(
                    "repeat {r}, arm {arm}: afdep exchange failed ({}):\n{stderr}",
                    out.status
                );
            }
            let stdout = String::from_utf8_lossy(&out.stdout);
            let mut n = 0;
            for line in stdout.lines().filter(|l| l.trim_start().starts_with('{')) {
                let row: ExchangeRow = serde_json::from_str(line)
                    .with_context(|| format!("repeat {r}, arm {arm}: reading the row {line}"))?;
                let rr = RepeatRow {
                    kind: "repeat",
                    repeat: r,
                    position,
                    order: ord.clone(),
                    row,
                };
                emit(serde_json::to_string(&rr).expect("row serializes"))?;
                runs.push(rr);
                n += 1;
            }
            if n == 0 {
                bail!("repeat {r}, arm {arm}: afdep exchange printed no row:\n{stderr}");
            }
        }
    }
    let summary = summarize(&a.arms, &runs, &unsupported);
    for s in &summary {
        emit(serde_json::to_string(s).expect("row serializes"))?;
    }
    let t = table(&a.arms, &summary);
    eprint!("{t}");
    if let Some(p) = &a.table {
        std::fs::write(p, &t).with_context(|| format!("writing {}", p.display()))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(topo: &str, tokens: usize, us: f64, pid: u32) -> ExchangeRow {
        serde_json::from_value(serde_json::json!({
            "topology": topo, "engine": "fused", "arm": "x", "transport": "nvlink-ipc",
            "ranks_as": "threads", "ucx_tls": null, "device_buffers": true, "hidden": 16,
            "experts": 4, "top_k": 2, "capacity": 8, "payload": "bf16", "transport_sms": 24,
            "tokens": [tokens], "expert": "identity", "rounds": 3, "warmup": 1,
            "rejected_rounds": 0, "timing": "device", "round_us": us, "wall_us": us,
            "counts_us": 0.0, "dispatch_us": 0.0, "experts_us": 0.0, "combine_us": 0.0,
            "status": "ok", "kernel_digest": "d", "pid": pid
        }))
        .unwrap()
    }

    #[test]
    fn orders_rotate_so_every_arm_takes_every_position() {
        use ArmArg::*;
        let arms = [PayloadFirst, CountFirst, CountFirstSource];
        assert_eq!(order(&arms, 0), arms);
        assert_eq!(
            order(&arms, 1),
            [CountFirst, CountFirstSource, PayloadFirst]
        );
        assert_eq!(
            order(&arms, 2),
            [CountFirstSource, PayloadFirst, CountFirst]
        );
        assert_eq!(order(&arms, 3), arms);
    }

    #[test]
    fn the_paired_change_is_the_median_of_per_repeat_ratios() {
        use ArmArg::*;
        let arms = [PayloadFirst, CountFirst, CountFirstSource];
        // payload-first: 100, 120, 80; count-first: 90, 114, 84 (ratios .9, .95, 1.05)
        let pf = [100.0, 120.0, 80.0];
        let cf = [90.0, 114.0, 84.0];
        let mut runs = Vec::new();
        for r in 0..3 {
            let ord = order(&arms[..2], r);
            for (position, arm) in ord.iter().enumerate() {
                let us = if *arm == PayloadFirst { pf[r] } else { cf[r] };
                runs.push(RepeatRow {
                    kind: "repeat",
                    repeat: r,
                    position,
                    order: ord.clone(),
                    row: row("3A:1F", 8, us, (10 * r + position) as u32),
                });
            }
        }
        let mut unsup = BTreeMap::new();
        unsup.insert(CountFirstSource, "unsupported: no source arm".to_string());
        let s = summarize(&arms, &runs, &unsup);
        assert_eq!(s.len(), 3);
        assert_eq!(s[0].arm, PayloadFirst);
        assert_eq!(s[0].median_us, Some(100.0));
        assert_eq!(s[0].change_pct, Some(0.0));
        assert_eq!(s[0].repeats_faster, 0);
        assert_eq!(s[1].arm, CountFirst);
        assert_eq!(s[1].repeats_us, vec![90.0, 114.0, 84.0]);
        assert_eq!(s[1].median_us, Some(90.0));
        let c = s[1].change_pct.unwrap();
        assert!((c - -5.0).abs() < 1e-9, "{c}");
        assert_eq!(s[1].repeats_faster, 2);
        assert_eq!(s[1].paired_change_pct.len(), 3);
        assert!((s[1].paired_change_pct[2] - 5.0).abs() < 1e-9);
        // the children of one arm are distinct processes
        assert_eq!(s[1].pids, vec![1, 10, 21]);
        assert_eq!(s[2].status, "unsupported");
        assert_eq!(s[2].median_us, None);
        let t = table(&arms, &s);
        assert!(
            t.contains("| 3A:1F | 8 | 100.0 | 90.0 (-5.0 %) | unsupported |"),
            "{t}"
        );
    }
}
