//! Dispatch layout: counts, 64-bit prefix sums, the expanded layout, the compact collect view,
//! and the payload-first and count-first plans (docs/design.md, "Specification: AFD exchange").
//!
//! **Expanded layout** of FFN rank `f`: one row per (token, local expert), grouped by local
//! expert ascending; within an expert, by source attention rank ascending; within a source, by
//! token ascending. Expert `l` occupies rows `expert_offsets[l] .. expert_offsets[l + 1]`, and
//! the rows of source `s` for expert `l` form one contiguous *block* starting at
//! `block_start(l, s)`.
//!
//! **Compact collect view** of FFN rank `f`: each token that has at least one expert on `f`,
//! once, ordered by source rank then token, with its K slots rewritten to local expert ids
//! (`-1` where the slot's expert lives elsewhere or is masked) and its weights.
//!
//! **Count-first** plan: sources publish per-expert counts ([`SourceCounts`]), the FFN rank
//! computes [`FfnPlan`] and publishes each source's block starts, and the source then knows the
//! final expanded row of every slot ([`count_first_destinations`]).
//!
//! **Payload-first** plan: sources store each token once into a per-source slab on the FFN rank
//! (the rows of the compact view, [`payload_first_slabs`]); a copy epilogue then expands them
//! ([`copy_plan`]). Both plans produce the same expanded layout.
//!
//! All offsets are `u64`: at 1M tokens × top-8 × hidden 512, element offsets reach 2^32.

use crate::route::{MASKED, Routes};
use crate::topology::ExpertPlacement;

/// Exclusive prefix sum with the total appended: `out[i] = Σ_{j<i} v[j]`, `out.len() == v.len() + 1`.
pub fn exclusive_prefix(v: &[u64]) -> Vec<u64> {
    let mut out = Vec::with_capacity(v.len() + 1);
    let mut s = 0u64;
    out.push(0);
    for &x in v {
        s += x;
        out.push(s);
    }
    out
}

/// What one attention rank publishes first: how many rows it sends to each owned expert, and
/// how many rows and distinct tokens it sends to each FFN rank. Routes must be validated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SourceCounts {
    /// Rows per owned expert (global id order), length `placement.owned()`.
    pub expert_rows: Vec<u64>,
    /// Rows (token, expert pairs) per FFN rank.
    pub ffn_rows: Vec<u64>,
    /// Distinct tokens per FFN rank (rows of its payload-first slab and compact view).
    pub ffn_tokens: Vec<u64>,
}

impl SourceCounts {
    /// Counts the routes of one source.
    pub fn build(routes: &Routes, p: &ExpertPlacement) -> Self {
        let mut expert_rows = vec![0u64; p.owned()];
        let mut ffn_rows = vec![0u64; p.ffn_ranks];
        let mut ffn_tokens = vec![0u64; p.ffn_ranks];
        let mut seen = vec![usize::MAX; p.ffn_ranks];
        for t in 0..routes.tokens {
            for (e, _) in routes.slots(t) {
                if e == MASKED {
                    continue;
                }
                let e = e as usize;
                let f = p.owner(e).expect("routes must be validated before layout");
                expert_rows[e] += 1;
                ffn_rows[f] += 1;
                if seen[f] != t {
                    seen[f] = t;
                    ffn_tokens[f] += 1;
                }
            }
        }
        SourceCounts {
            expert_rows,
            ffn_rows,
            ffn_tokens,
        }
    }

    /// The counts of FFN rank `f`'s local experts.
    pub fn local(&self, f: usize, p: &ExpertPlacement) -> &[u64] {
        &self.expert_rows[p.experts_of(f)]
    }

    /// Encodes the counts as little-endian u64 words (the wire form of the count phase).
    pub fn to_words(&self) -> Vec<u64> {
        let mut w = self.expert_rows.clone();
        w.extend_from_slice(&self.ffn_rows);
        w.extend_from_slice(&self.ffn_tokens);
        w
    }

    /// Decodes [`SourceCounts::to_words`]; `None` if the length does not fit the placement.
    pub fn from_words(w: &[u64], p: &ExpertPlacement) -> Option<Self> {
        let (o, f) = (p.owned(), p.ffn_ranks);
        (w.len() == o + 2 * f).then(|| SourceCounts {
            expert_rows: w[..o].to_vec(),
            ffn_rows: w[o..o + f].to_vec(),
            ffn_tokens: w[o + f..].to_vec(),
        })
    }
}

/// What FFN rank `f` computes from every source's counts: its expanded layout and slabs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FfnPlan {
    /// FFN index.
    pub ffn: usize,
    /// Number of sources.
    pub sources: usize,
    /// Local experts.
    pub local_experts: usize,
    /// `counts[l * sources + s]`: rows of source `s` for local expert `l`.
    pub counts: Vec<u64>,
    /// Row offsets of each local expert, length `local_experts + 1`.
    pub expert_offsets: Vec<u64>,
    /// `block_starts[l * sources + s]`: first expanded row of source `s` for expert `l`.
    pub block_starts: Vec<u64>,
    /// Compact-view (slab) row offset of each source, length `sources + 1`.
    pub slab_offsets: Vec<u64>,
}

impl FfnPlan {
    /// Builds FFN rank `f`'s plan from the counts of every source, in source order.
    pub fn build(f: usize, p: &ExpertPlacement, sources: &[SourceCounts]) -> Self {
        let ns = sources.len();
        let nl = p.experts_per_rank;
        let mut counts = vec![0u64; nl * ns];
        for (s, c) in sources.iter().enumerate() {
            for (l, &n) in c.local(f, p).iter().enumerate() {
                counts[l * ns + s] = n;
            }
        }
        // Blocks are laid out expert-major, source-minor: one prefix sum over `counts`
        // gives every block start, and every ns-th entry an expert offset.
        let starts = exclusive_prefix(&counts);
        let expert_offsets = (0..=nl).map(|l| starts[l * ns]).collect();
        let block_starts = starts[..nl * ns].to_vec();
        let slab_offsets =
            exclusive_prefix(&sources.iter().map(|c| c.ffn_tokens[f]).collect::<Vec<_>>());
        FfnPlan {
            ffn: f,
            sources: ns,
            local_experts: nl,
            counts,
            expert_offsets,
            block_starts,
            slab_offsets,
        }
    }

    /// Total expanded rows.
    pub fn total_rows(&self) -> u64 {
        *self.expert_offsets.last().unwrap_or(&0)
    }

    /// Total compact-view rows.
    pub fn total_tokens(&self) -> u64 {
        *self.slab_offsets.last().unwrap_or(&0)
    }

    /// First expanded row of source `s`'s block for local expert `l`.
    pub fn block_start(&self, l: usize, s: usize) -> u64 {
        self.block_starts[l * self.sources + s]
    }

    /// The block starts that source `s` needs for count-first, one per local expert.
    pub fn offsets_for_source(&self, s: usize) -> Vec<u64> {
        (0..self.local_experts)
            .map(|l| self.block_start(l, s))
            .collect()
    }
}

/// Where a slot's row goes: FFN index and row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Dest {
    /// FFN index.
    pub ffn: usize,
    /// Row in the destination's layout.
    pub row: u64,
}

/// Position of every slot inside its (expert, source) block: the number of earlier tokens of
/// this source routed to the same expert. `None` for masked slots. Length T × K.
pub fn block_positions(routes: &Routes, p: &ExpertPlacement) -> Vec<Option<u64>> {
    let mut next = vec![0u64; p.owned()];
    routes
        .idx
        .iter()
        .map(|&e| {
            (e != MASKED).then(|| {
                let n = &mut next[e as usize];
                *n += 1;
                *n - 1
            })
        })
        .collect()
}

/// Count-first: the final expanded row of every slot of source `s`, given each FFN rank's
/// published block starts for `s` (`offsets[f][l]`, from [`FfnPlan::offsets_for_source`]).
pub fn count_first_destinations(
    routes: &Routes,
    p: &ExpertPlacement,
    offsets: &[Vec<u64>],
) -> Vec<Option<Dest>> {
    block_destinations(routes, p, offsets)
}

/// Where the rows of source `s` come back in combine: FFN rank `f` returns to `s` its blocks
/// for `s` concatenated in local-expert order, so the slot's row in that return buffer is the
/// source's own prefix over `f`'s experts plus the block position.
pub fn return_positions(
    routes: &Routes,
    p: &ExpertPlacement,
    counts: &SourceCounts,
) -> Vec<Option<Dest>> {
    let starts: Vec<Vec<u64>> = (0..p.ffn_ranks)
        .map(|f| exclusive_prefix(counts.local(f, p)))
        .collect();
    block_destinations(routes, p, &starts)
}

/// The row of every slot of a source in the buffers of its FFN ranks: the block of its expert
/// starts at `starts[f][l]` on the owning FFN rank `f` (local expert `l`), plus the slot's block
/// position.
fn block_destinations(
    routes: &Routes,
    p: &ExpertPlacement,
    starts: &[Vec<u64>],
) -> Vec<Option<Dest>> {
    block_positions(routes, p)
        .into_iter()
        .zip(&routes.idx)
        .map(|(pos, &e)| {
            pos.map(|pos| {
                let e = e as usize;
                let f = p.owner(e).expect("validated");
                Dest {
                    ffn: f,
                    row: starts[f][p.local(e)] + pos,
                }
            })
        })
        .collect()
}

/// Payload-first: the tokens of one source that go to each FFN rank, ascending (the rows of
/// its slab there, and of the compact view).
pub fn payload_first_slabs(routes: &Routes, p: &ExpertPlacement) -> Vec<Vec<u32>> {
    let mut slabs = vec![Vec::new(); p.ffn_ranks];
    for t in 0..routes.tokens {
        let mut last = usize::MAX;
        // slots are not sorted by rank: collect distinct ranks of this token
        let mut ranks: Vec<usize> = routes
            .slots(t)
            .filter(|&(e, _)| e != MASKED)
            .map(|(e, _)| p.owner(e as usize).expect("validated"))
            .collect();
        ranks.sort_unstable();
        for f in ranks {
            if f != last {
                slabs[f].push(t as u32);
                last = f;
            }
        }
    }
    slabs
}

/// The compact collect view's per-row slot metadata for FFN rank `f`: for each token of
/// `slab` (one source's slab for `f`), the K slots as local expert ids (`-1` elsewhere or
/// masked) and their weights (0 where the id is -1).
pub fn compact_slots(
    routes: &Routes,
    p: &ExpertPlacement,
    f: usize,
    slab: &[u32],
) -> (Vec<i32>, Vec<f32>) {
    let mut ids = Vec::with_capacity(slab.len() * routes.top_k);
    let mut ws = Vec::with_capacity(slab.len() * routes.top_k);
    for &t in slab {
        for (e, w) in routes.slots(t as usize) {
            if e != MASKED && p.owner(e as usize) == Some(f) {
                ids.push(p.local(e as usize) as i32);
                ws.push(w);
            } else {
                ids.push(MASKED);
                ws.push(0.0);
            }
        }
    }
    (ids, ws)
}

/// The copy epilogue of payload-first: for compact rows (all sources, in order) with local
/// expert ids `local_ids` (K per row), the `(compact row, expanded row)` pairs, in compact-row
/// then slot order. `expert_offsets` comes from [`FfnPlan`].
pub fn copy_plan(local_ids: &[i32], top_k: usize, expert_offsets: &[u64]) -> Vec<(u64, u64)> {
    let mut cursor = expert_offsets[..expert_offsets.len() - 1].to_vec();
    let mut out = Vec::new();
    for (row, ids) in local_ids.chunks(top_k).enumerate() {
        for &l in ids {
            if l != MASKED {
                let c = &mut cursor[l as usize];
                out.push((row as u64, *c));
                *c += 1;
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Random validated routes: each token picks K distinct owned experts or masked slots.
    fn routes_strategy(owned: usize, k: usize) -> impl Strategy<Value = Routes> {
        (0usize..40).prop_flat_map(move |t| {
            proptest::collection::vec(
                (
                    proptest::sample::subsequence((0..owned as i32).collect::<Vec<_>>(), k),
                    proptest::collection::vec(any::<bool>(), k),
                ),
                t,
            )
            .prop_map(move |rows| {
                let mut idx = Vec::new();
                for (mut sel, mask) in rows {
                    // shuffle deterministically: reverse half the time to avoid sorted slots
                    if mask[0] {
                        sel.reverse();
                    }
                    for (j, e) in sel.into_iter().enumerate() {
                        idx.push(if mask[j] && j % 3 == 1 { MASKED } else { e });
                    }
                }
                let n = idx.len();
                Routes {
                    tokens: n / k,
                    top_k: k,
                    idx,
                    weights: (0..n).map(|i| i as f32 * 0.01).collect(),
                }
            })
        })
    }

    /// Naive expanded layout: every (expert, source, token, slot) sorted, then numbered.
    fn naive_expanded(all: &[Routes], p: &ExpertPlacement, f: usize) -> Vec<(usize, usize, usize)> {
        let mut rows = Vec::new();
        for (s, r) in all.iter().enumerate() {
            for t in 0..r.tokens {
                for (k, (e, _)) in r.slots(t).enumerate() {
                    if e != MASKED && p.owner(e as usize) == Some(f) {
                        rows.push((p.local(e as usize), s, t, k));
                    }
                }
            }
        }
        rows.sort();
        rows.into_iter().map(|(_, s, t, k)| (s, t, k)).collect()
    }

    proptest! {
        #[test]
        fn prefix_matches_naive(v in proptest::collection::vec(0u64..1 << 40, 0..50)) {
            let p = exclusive_prefix(&v);
            prop_assert_eq!(p.len(), v.len() + 1);
            for i in 0..=v.len() {
                prop_assert_eq!(p[i], v[..i].iter().sum::<u64>());
            }
        }

        #[test]
        fn plans_match_naive_layout(
            all in proptest::collection::vec(routes_strategy(12, 3), 1..4),
            ffn in 1usize..4,
        ) {
            let p = ExpertPlacement { experts: 13, ffn_ranks: ffn, experts_per_rank: 12 / ffn };
            // routes were drawn over 12 experts; re-map ids above the owned range to masked
            let all: Vec<Routes> = all.into_iter().map(|mut r| {
                for e in r.idx.iter_mut() { if *e >= p.owned() as i32 { *e = MASKED; } }
                r
            }).collect();
            let counts: Vec<SourceCounts> = all.iter().map(|r| SourceCounts::build(r, &p)).collect();
            for c in &counts {
                prop_assert_eq!(SourceCounts::from_words(&c.to_words(), &p), Some(c.clone()));
            }
            let plans: Vec<FfnPlan> = (0..ffn).map(|f| FfnPlan::build(f, &p, &counts)).collect();
            for f in 0..ffn {
                let naive = naive_expanded(&all, &p, f);
                prop_assert_eq!(plans[f].total_rows() as usize, naive.len());
                // count-first: every slot's destination is its naive position
                for (s, r) in all.iter().enumerate() {
                    let offs: Vec<Vec<u64>> = plans.iter().map(|pl| pl.offsets_for_source(s)).collect();
                    let dest = count_first_destinations(r, &p, &offs);
                    for (i, d) in dest.iter().enumerate() {
                        if let Some(d) = d { if d.ffn == f {
                            prop_assert_eq!(naive[d.row as usize], (s, i / r.top_k, i % r.top_k));
                        }}
                    }
                }
                // payload-first: slabs + copy epilogue give the same positions
                let mut compact_rows = Vec::new();
                let mut ids = Vec::new();
                for (s, r) in all.iter().enumerate() {
                    let slab = &payload_first_slabs(r, &p)[f];
                    prop_assert_eq!(slab.len() as u64, counts[s].ffn_tokens[f]);
                    let (li, _) = compact_slots(r, &p, f, slab);
                    ids.extend(li);
                    compact_rows.extend(slab.iter().map(|&t| (s, t as usize)));
                }
                prop_assert_eq!(compact_rows.len() as u64, plans[f].total_tokens());
                let mut seen = vec![false; naive.len()];
                for (row, dst) in copy_plan(&ids, 3, &plans[f].expert_offsets) {
                    let (s, t) = compact_rows[row as usize];
                    let (ns, nt, nk) = naive[dst as usize];
                    prop_assert_eq!((s, t), (ns, nt));
                    prop_assert_eq!(ids[row as usize * 3 + nk], p.local(all[s].idx[t * 3 + nk] as usize) as i32);
                    prop_assert!(!seen[dst as usize]);
                    seen[dst as usize] = true;
                }
                prop_assert!(seen.iter().all(|&b| b));
            }
            // return positions index each source's concatenated blocks
            for (s, r) in all.iter().enumerate() {
                let ret = return_positions(r, &p, &counts[s]);
                for f in 0..ffn {
                    let n = counts[s].ffn_rows[f];
                    let mut got: Vec<u64> = ret.iter().flatten().filter(|d| d.ffn == f).map(|d| d.row).collect();
                    got.sort_unstable();
                    prop_assert_eq!(got, (0..n).collect::<Vec<_>>());
                }
            }
        }
    }

    #[test]
    fn offsets_are_64_bit() {
        let v = vec![u32::MAX as u64; 3];
        assert_eq!(*exclusive_prefix(&v).last().unwrap(), 3 * u32::MAX as u64);
    }
}
