//! Fault injection into the fused exchange kernels (cargo feature `fault-injection`; tests
//! only): the typed faults of the reference record's fault suite (docs/design.md, "The reference
//! record") and their payload-first and combine counterparts.
//!
//! A fault is a set of **points** (`cuda/common/fault.cuh`): a point either delays a store or a
//! flag release (spinning on `%globaltimer`: the protocol must absorb it, so results stay
//! bit-identical) or skips a bounded wait (the kernel then reads what the wait protected too
//! early: the oracle comparison must see it). The points are compiled in only when a module is
//! built with `-DAFDEP_FAULT=<mask>`; without the define every point expands to nothing, so the
//! production modules are the same machine code with or without this feature, and the kernel
//! source digest does not depend on it.
//!
//! [`GpuContext::set_fault`](crate::GpuContext::set_fault) selects a fault for the context:
//! from then on [`GpuContext::function`](crate::GpuContext::function) hands out the kernels of
//! the files that hold one of its points ([`points_in`]) from modules built with the fault's
//! points of that file (`ModuleSpec::with_fault`: the define is part of the module's label,
//! NVRTC options and cache key), and the production modules for every other file. Each
//! fault-built module counts its points' firings in a device global that
//! [`GpuContext::fault_hits`](crate::GpuContext::fault_hits) reads back, so a test can tell
//! that a fault ran. The fused engine's `FusedEngine::set_fault` (afdep-moe, feature
//! `fault-injection`) sets it on every rank and loads the modules; `docs/gpu.md` has the table
//! of faults and their expected outcomes, and `gpu_nvlink_faults` the test.
//!
//! A skipping fault only removes a wait: every read and write after it stays within bounds the
//! kernel checks anyway (the streaming epilogue's and the source arm's `exp_rows`, the combine's
//! return rows of its own tokens below the capacity), so a skipped wait gives wrong data, never
//! an access out of bounds, and no skipped wait leaves another kernel spinning past the
//! transport's timeout (the flags it skipped are still raised, and only grow).

use std::fmt;

use crate::sources::SourceFile;

/// The points: bits of `AFDEP_FAULT` (`cuda/common/fault.cuh`, the same names without the
/// `AFDEP_FAULT_` prefix; a test checks they agree).
pub mod point {
    /// Every 5th row's store delayed 20 µs (its flag follows the store): `afdep_cf_dispatch`
    /// (both modes).
    pub const LATE_ROWS: u32 = 0x1;
    /// Every 7th streaming row flag released 10 µs after its row's stores: `afdep_cf_dispatch`.
    pub const LATE_ROW_FLAGS: u32 = 0x2;
    /// A source's counts stored into the FFN ranks' workspaces 30 µs late (the count flags
    /// follow): the last block of `afdep_cf_counts`.
    pub const LATE_COUNTS: u32 = 0x4;
    /// An FFN rank's offset flags released 20 µs after its offsets: `afdep_cf_plan`.
    pub const LATE_OFFSET_FLAGS: u32 = 0x8;
    /// An FFN rank's prefix sums computed 20 µs late (after its counts wait): `afdep_cf_plan`.
    pub const LATE_PREFIX: u32 = 0x10;
    /// Every flag signal released 10 µs after its fence: the last blocks of `afdep_cf_dispatch`
    /// (the device plan's payload-first and source-arm dispatch flags) and
    /// `afdep_fused_combine_reduce` (combine flags).
    pub const LATE_SIGNAL: u32 = 0x20;
    /// Every 5th compact row's partial sum stored into its source's return area 20 µs late (the
    /// combine flag follows): `afdep_fused_combine_reduce`.
    pub const LATE_RETURN_ROWS: u32 = 0x40;
    /// A device round's status flags released 20 µs after its status words:
    /// `afdep_round_begin`.
    pub const LATE_STATUS: u32 = 0x80;
    /// The streaming epilogue skips its row flag waits: `afdep_cf_stream_epilogue`.
    pub const SKIP_ROW_WAIT: u32 = 0x100;
    /// A source skips its wait for the offsets: `afdep_cf_dispatch` (the source arm, and the
    /// streaming payload gate).
    pub const SKIP_OFFSET_WAIT: u32 = 0x200;
    /// The combine skips its wait for the combine flags: `afdep_fused_combine`.
    pub const SKIP_COMBINE_WAIT: u32 = 0x400;
    /// An FFN rank skips its wait for the dispatch flags: `afdep_cf_wait`, `afdep_cf_plan` (the
    /// payload-first wait before the plan), `afdep_cf_stream_epilogue(_fp8)` (an Auto round's
    /// source-arm wait).
    pub const SKIP_DISPATCH_WAIT: u32 = 0x800;

    /// Every point with its name in `common/fault.cuh` (without the `AFDEP_FAULT_` prefix).
    pub const ALL: [(&str, u32); 12] = [
        ("LATE_ROWS", LATE_ROWS),
        ("LATE_ROW_FLAGS", LATE_ROW_FLAGS),
        ("LATE_COUNTS", LATE_COUNTS),
        ("LATE_OFFSET_FLAGS", LATE_OFFSET_FLAGS),
        ("LATE_PREFIX", LATE_PREFIX),
        ("LATE_SIGNAL", LATE_SIGNAL),
        ("LATE_RETURN_ROWS", LATE_RETURN_ROWS),
        ("LATE_STATUS", LATE_STATUS),
        ("SKIP_ROW_WAIT", SKIP_ROW_WAIT),
        ("SKIP_OFFSET_WAIT", SKIP_OFFSET_WAIT),
        ("SKIP_COMBINE_WAIT", SKIP_COMBINE_WAIT),
        ("SKIP_DISPATCH_WAIT", SKIP_DISPATCH_WAIT),
    ];
}

/// The points compiled into the modules of `file` (0 for a file without any).
pub fn points_in(file: SourceFile) -> u32 {
    use point::*;
    match file {
        SourceFile::FusedCombine => LATE_RETURN_ROWS | LATE_SIGNAL | SKIP_COMBINE_WAIT,
        SourceFile::FusedCounts => {
            LATE_COUNTS | LATE_OFFSET_FLAGS | LATE_PREFIX | SKIP_DISPATCH_WAIT
        }
        SourceFile::FusedCfDispatch => LATE_ROWS | LATE_ROW_FLAGS | LATE_SIGNAL | SKIP_OFFSET_WAIT,
        SourceFile::FusedStreamEpilogue => SKIP_ROW_WAIT | SKIP_DISPATCH_WAIT,
        SourceFile::FusedRound => LATE_STATUS,
        // the phases of fused_round.cu, fused_counts.cu, fused_cf_dispatch.cu and
        // fused_stream_epilogue.cu (phase/*.cuh)
        SourceFile::FusedFront => {
            LATE_STATUS
                | LATE_COUNTS
                | LATE_OFFSET_FLAGS
                | LATE_PREFIX
                | SKIP_DISPATCH_WAIT
                | LATE_ROWS
                | LATE_ROW_FLAGS
                | LATE_SIGNAL
                | SKIP_OFFSET_WAIT
                | SKIP_ROW_WAIT
        }
        SourceFile::Router
        | SourceFile::Validate
        | SourceFile::Layout
        | SourceFile::Permute
        | SourceFile::Gemm
        | SourceFile::Moe
        | SourceFile::Reference
        | SourceFile::Fp8
        | SourceFile::NcclRound => 0,
    }
}

/// A fault of the fused exchange. The first eight must leave every result bit-identical to the
/// oracle ([`Fault::must_pass`]); the last four skip a wait (together with a delay that makes
/// the race they open likely) and must be caught by the oracle comparison. Names of the
/// reference record's suite in [`Fault::record_name`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Fault {
    /// Late rows (the record's P1): every 5th row's store is delayed 20 µs, its flag follows
    /// the store (count-first streaming row flags; the dispatch flags of payload-first and the
    /// source arm).
    LateRows,
    /// Deferred row flags (P2): every 7th streaming row flag is released 10 µs after its row's
    /// stores completed.
    LateRowFlags,
    /// Late counts (P3): a source's count publication 30 µs late.
    LateCounts,
    /// Late offset flags (P4): an FFN rank publishes its offset flags 20 µs after its offsets.
    LateOffsetFlags,
    /// Late prefix sums (P4b): an FFN rank computes its plan 20 µs late, after its counts
    /// arrived.
    LatePrefix,
    /// Deferred dispatch and combine flags: every dispatch and combine flag (the last blocks of
    /// `afdep_cf_dispatch` and `afdep_fused_combine_reduce`) is released 10 µs after its fence.
    LateSignals,
    /// Late return rows: every 5th compact row's partial sum (the FFN rank's share of a token's
    /// combine) is stored into its source's return area 20 µs late (the combine flag follows).
    LateReturnRows,
    /// Late status: a device round's status flags (its verdict words' readiness) are released
    /// 20 µs after the words.
    LateStatus,
    /// The streaming epilogue skips its row waits, with [`Fault::LateRows`] (the record's N2):
    /// it expands rows before they land.
    SkipRowWait,
    /// The source arm skips its wait for the offsets, with [`Fault::LatePrefix`] (the record's
    /// N3, corrected as its N3b): it stores rows at stale offsets.
    SkipOffsetWait,
    /// The combine skips its wait for the combine flags, with [`Fault::LateReturnRows`]: it
    /// adds the FFN ranks' partial sums before they land.
    SkipCombineWait,
    /// The FFN rank skips its wait for the dispatch flags (the source arm's wait, the plan's
    /// payload-first wait), with [`Fault::LateRows`]: it reads rows before they land.
    SkipDispatchWait,
}

impl Fault {
    /// Every fault, the must-pass ones first.
    pub const ALL: [Fault; 12] = [
        Fault::LateRows,
        Fault::LateRowFlags,
        Fault::LateCounts,
        Fault::LateOffsetFlags,
        Fault::LatePrefix,
        Fault::LateSignals,
        Fault::LateReturnRows,
        Fault::LateStatus,
        Fault::SkipRowWait,
        Fault::SkipOffsetWait,
        Fault::SkipCombineWait,
        Fault::SkipDispatchWait,
    ];

    /// The points of the fault (bits of `AFDEP_FAULT`).
    pub fn mask(self) -> u32 {
        use point::*;
        match self {
            Fault::LateRows => LATE_ROWS,
            Fault::LateRowFlags => LATE_ROW_FLAGS,
            Fault::LateCounts => LATE_COUNTS,
            Fault::LateOffsetFlags => LATE_OFFSET_FLAGS,
            Fault::LatePrefix => LATE_PREFIX,
            Fault::LateSignals => LATE_SIGNAL,
            Fault::LateReturnRows => LATE_RETURN_ROWS,
            Fault::LateStatus => LATE_STATUS,
            Fault::SkipRowWait => SKIP_ROW_WAIT | LATE_ROWS,
            Fault::SkipOffsetWait => SKIP_OFFSET_WAIT | LATE_PREFIX,
            Fault::SkipCombineWait => SKIP_COMBINE_WAIT | LATE_RETURN_ROWS,
            Fault::SkipDispatchWait => SKIP_DISPATCH_WAIT | LATE_ROWS,
        }
    }

    /// Whether results must stay bit-identical to the oracle under the fault (a delay the
    /// protocol absorbs); `false` for the faults that skip a wait, which the checks must catch.
    pub fn must_pass(self) -> bool {
        self.mask()
            & (point::SKIP_ROW_WAIT
                | point::SKIP_OFFSET_WAIT
                | point::SKIP_COMBINE_WAIT
                | point::SKIP_DISPATCH_WAIT)
            == 0
    }

    /// The fault's name in the reference record's suite (`P1` … `P4b`, `N2`, `N3`), if it has
    /// one.
    pub fn record_name(self) -> Option<&'static str> {
        match self {
            Fault::LateRows => Some("P1"),
            Fault::LateRowFlags => Some("P2"),
            Fault::LateCounts => Some("P3"),
            Fault::LateOffsetFlags => Some("P4"),
            Fault::LatePrefix => Some("P4b"),
            Fault::SkipRowWait => Some("N2"),
            Fault::SkipOffsetWait => Some("N3"),
            _ => None,
        }
    }

    /// A short name: `late_rows`, …, `skip_dispatch_wait`.
    pub fn name(self) -> &'static str {
        match self {
            Fault::LateRows => "late_rows",
            Fault::LateRowFlags => "late_row_flags",
            Fault::LateCounts => "late_counts",
            Fault::LateOffsetFlags => "late_offset_flags",
            Fault::LatePrefix => "late_prefix",
            Fault::LateSignals => "late_signals",
            Fault::LateReturnRows => "late_return_rows",
            Fault::LateStatus => "late_status",
            Fault::SkipRowWait => "skip_row_wait",
            Fault::SkipOffsetWait => "skip_offset_wait",
            Fault::SkipCombineWait => "skip_combine_wait",
            Fault::SkipDispatchWait => "skip_dispatch_wait",
        }
    }

    /// The fault's mask within `file`: the `AFDEP_FAULT` of that file's modules under the
    /// fault (0: the production module).
    pub fn mask_in(self, file: SourceFile) -> u32 {
        self.mask() & points_in(file)
    }

    /// The source files whose modules the fault rebuilds.
    pub fn files(self) -> impl Iterator<Item = SourceFile> {
        SourceFile::ALL
            .into_iter()
            .filter(move |&f| self.mask_in(f) != 0)
    }
}

impl fmt::Display for Fault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.record_name() {
            Some(r) => write!(f, "{} ({r})", self.name()),
            None => f.write_str(self.name()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sources::{HEADERS, ModuleSpec};

    fn header() -> &'static str {
        HEADERS
            .iter()
            .find(|(n, _)| *n == "common/fault.cuh")
            .map(|(_, t)| *t)
            .expect("common/fault.cuh is embedded")
    }

    /// The point bits agree with `common/fault.cuh`, and are distinct single bits.
    #[test]
    fn points_match_the_header() {
        let text = header();
        let mut seen = 0u32;
        for (name, bit) in point::ALL {
            let line = text
                .lines()
                .find(|l| l.starts_with(&format!("#define AFDEP_FAULT_{name} ")))
                .unwrap_or_else(|| panic!("AFDEP_FAULT_{name} not in common/fault.cuh"));
            let v = line[format!("#define AFDEP_FAULT_{name} ").len()..].trim();
            assert_eq!(v, format!("{bit:#x}u"), "{name}");
            assert_eq!(bit.count_ones(), 1, "{name}");
            assert_eq!(seen & bit, 0, "{name} reuses a bit");
            seen |= bit;
        }
        let defined = text
            .lines()
            .filter(|l| l.starts_with("#define AFDEP_FAULT_") && l.ends_with('u'))
            .count();
        assert_eq!(
            defined,
            point::ALL.len(),
            "a point of the header is not in point::ALL"
        );
    }

    /// A source's text with the `phase/` headers it includes appended: the phases' bodies,
    /// shared by the kernels of several files, hold their fault points.
    fn with_phase_headers(text: &str) -> String {
        let mut all = text.to_string();
        for line in text.lines() {
            let Some(name) = line
                .strip_prefix("#include \"")
                .and_then(|r| r.strip_suffix('"'))
                .filter(|n| n.starts_with("phase/"))
            else {
                continue;
            };
            let (_, header) = crate::sources::HEADERS
                .iter()
                .find(|(n, _)| *n == name)
                .expect("an embedded header");
            all.push('\n');
            all.push_str(header);
        }
        all
    }

    /// [`points_in`] names exactly the files in which each point is used (a `DELAY` or `SKIP`
    /// macro naming it), so a fault rebuilds every module that holds one of its points.
    #[test]
    fn the_table_of_files_matches_the_sources() {
        for file in SourceFile::ALL {
            let text = with_phase_headers(file.text());
            let mut used = 0u32;
            for (name, bit) in point::ALL {
                let delay = format!("AFDEP_FAULT_DELAY(AFDEP_FAULT_{name},");
                let skip = format!("AFDEP_FAULT_SKIP(AFDEP_FAULT_{name})");
                if text.contains(&delay) || text.contains(&skip) {
                    used |= bit;
                }
            }
            assert_eq!(
                used,
                points_in(file),
                "{}: points used {used:#x}, table {:#x}",
                file.name(),
                points_in(file)
            );
        }
        for (name, bit) in point::ALL {
            assert!(
                SourceFile::ALL.iter().any(|&f| points_in(f) & bit != 0),
                "point {name} is in no file"
            );
        }
    }

    /// The statement after `line` (the lines up to its closing brace when it opens a block, or
    /// the line itself).
    fn statement_after(lines: &[&str], at: usize) -> String {
        let first = lines[at + 1];
        let mut depth = 0i32;
        let mut out = String::new();
        for l in &lines[at + 1..] {
            out.push_str(l);
            out.push('\n');
            depth += l.matches('{').count() as i32 - l.matches('}').count() as i32;
            if depth <= 0 && (l.trim_end().ends_with('}') || !first.trim_end().ends_with('{')) {
                break;
            }
        }
        out
    }

    /// Every skip point prefixes a bounded wait (`afdep_wait_ge`, or `afdep_wait_flags` /
    /// `afdep_wait_flags_warp`, its loop over a set of flags by one thread or one warp; a
    /// warp's skip fires once per lane) and nothing else that stores: the statement it skips holds the
    /// wait, and its only stores are the wait's own bookkeeping (the block's `ok` flag and the
    /// fault record of a wait that ran out). Each source and each `phase/` header once.
    #[test]
    fn every_skip_point_skips_only_a_wait() {
        let mut seen = 0;
        let texts = SourceFile::ALL.iter().map(|f| (f.name(), f.text())).chain(
            crate::sources::HEADERS
                .iter()
                .filter(|(n, _)| n.starts_with("phase/"))
                .copied(),
        );
        for (name, text) in texts {
            let lines: Vec<&str> = text.lines().collect();
            for (i, l) in lines.iter().enumerate() {
                if !l.trim_start().starts_with("AFDEP_FAULT_SKIP(") {
                    continue;
                }
                seen += 1;
                let st = statement_after(&lines, i);
                assert!(
                    st.contains("afdep_wait_ge(")
                        || st.contains("afdep_wait_flags(")
                        || st.contains("afdep_wait_flags_warp("),
                    "{name}:{}: the statement after the skip point holds no wait:\n{st}",
                    i + 1
                );
                for s in st.lines() {
                    let t = s.trim();
                    // control lines and local declarations do not store to memory
                    let local = [
                        "for (", "if (", "while (", "const ", "u32 ", "u64 ", "bool ",
                    ]
                    .iter()
                    .any(|p| t.starts_with(p));
                    let stores = t.contains(" = ") && !local;
                    assert!(
                        !stores || t.starts_with("ok = "),
                        "{name}:{}: the skipped statement stores more than its wait's flag: {t}",
                        i + 1
                    );
                }
            }
        }
        // one per skip point and wait: the rows' offsets wait (phase/cf_dispatch.cuh), the
        // stream epilogue's row wait and its source-arm wait (phase/stream_epilogue.cuh), the
        // plan's payload-first wait (phase/counts.cuh), cf_wait, the combine
        assert_eq!(seen, 6);
    }

    #[test]
    fn faults_and_their_outcomes() {
        let pass: Vec<Fault> = Fault::ALL.into_iter().filter(|f| f.must_pass()).collect();
        assert_eq!(pass.len(), 8);
        assert_eq!(Fault::ALL[..8], pass[..], "must-pass faults come first");
        for f in Fault::ALL {
            assert_ne!(f.mask(), 0);
            assert!(f.files().next().is_some(), "{f} rebuilds no module");
            // a skipping fault carries the delay that opens its race
            if !f.must_pass() {
                assert_eq!(f.mask().count_ones(), 2, "{f}");
            }
        }
        let names: std::collections::BTreeSet<&str> = Fault::ALL.iter().map(|f| f.name()).collect();
        assert_eq!(names.len(), Fault::ALL.len());
        assert_eq!(Fault::LatePrefix.record_name(), Some("P4b"));
        assert_eq!(Fault::SkipRowWait.to_string(), "skip_row_wait (N2)");
        assert_eq!(
            Fault::SkipRowWait.mask(),
            point::SKIP_ROW_WAIT | point::LATE_ROWS
        );
        assert_eq!(
            Fault::SkipOffsetWait.files().collect::<Vec<_>>(),
            [
                SourceFile::FusedCounts,
                SourceFile::FusedCfDispatch,
                SourceFile::FusedFront
            ]
        );
    }

    /// A fault changes a module's defines, label (hence cache key) only where the file holds
    /// one of its points; `None` is the production module.
    #[test]
    fn modules_of_a_fault() {
        let prod = ModuleSpec::new(SourceFile::FusedCfDispatch, 64, 8);
        assert_eq!(prod.with_fault(None), prod);
        let f = prod.with_fault(Some(Fault::SkipOffsetWait));
        assert_ne!(f, prod);
        assert_eq!(f.fault_mask(), point::SKIP_OFFSET_WAIT);
        assert!(
            f.defines()
                .contains(&("AFDEP_FAULT", point::SKIP_OFFSET_WAIT))
        );
        assert!(!prod.defines().iter().any(|(n, _)| *n == "AFDEP_FAULT"));
        assert_eq!(f.label(), "fused_cf_dispatch K=8 fault=0x200");
        // P4b has no point in the streaming epilogue: its production module
        let e = ModuleSpec::new(SourceFile::FusedStreamEpilogue, 64, 8);
        assert_eq!(e.with_fault(Some(Fault::LatePrefix)), e);
        // nor anywhere outside the fused files
        let r = ModuleSpec::new(SourceFile::Router, 64, 8);
        for fault in Fault::ALL {
            assert_eq!(r.with_fault(Some(fault)), r);
        }
        assert!(f.check().is_ok());
    }
}
