//! FFI to the emulated kernels (see Cargo.toml) and tests against afdep-core.
#![allow(clippy::all)]
use half::bf16;
unsafe extern "C" {
    pub fn emu_router_logits_e96_k6(x: *const u16, wr: *const u16, l: *mut f32, t: u32, h: u32);
    pub fn emu_router_topk_e96_k6(l: *const f32, idx: *mut i32, w: *mut f32, t: u32, r: u32);
    pub fn emu_router_logits_e64_k8(x: *const u16, wr: *const u16, l: *mut f32, t: u32, h: u32);
    pub fn emu_router_topk_e64_k8(l: *const f32, idx: *mut i32, w: *mut f32, t: u32, r: u32);
    pub fn emu_router_topk_e128_k1(l: *const f32, idx: *mut i32, w: *mut f32, t: u32, r: u32);
    pub fn emu_router_topk_e64_k2(l: *const f32, idx: *mut i32, w: *mut f32, t: u32, r: u32);
    pub fn emu_router_topk_e96_k8(l: *const f32, idx: *mut i32, w: *mut f32, t: u32, r: u32);
    pub fn emu_validate_k1(idx: *const i32, w: *const f32, st: *mut u32, t: u64, e: u64, o: u64, c: u64, rank: u32, blocks: u32);
    pub fn emu_validate_k2(idx: *const i32, w: *const f32, st: *mut u32, t: u64, e: u64, o: u64, c: u64, rank: u32, blocks: u32);
    pub fn emu_validate_k6(idx: *const i32, w: *const f32, st: *mut u32, t: u64, e: u64, o: u64, c: u64, rank: u32, blocks: u32);
    pub fn emu_validate_k8(idx: *const i32, w: *const f32, st: *mut u32, t: u64, e: u64, o: u64, c: u64, rank: u32, blocks: u32);
    pub fn emu_layout_e64(idx: *const i32, bc: *mut u32, counts: *mut u64, offs: *mut u64, sr: *mut u32, rs: *mut u32, slots: u64, nb: u32);
    pub fn emu_layout_e96(idx: *const i32, bc: *mut u32, counts: *mut u64, offs: *mut u64, sr: *mut u32, rs: *mut u32, slots: u64, nb: u32);
    pub fn emu_layout_e128(idx: *const i32, bc: *mut u32, counts: *mut u64, offs: *mut u64, sr: *mut u32, rs: *mut u32, slots: u64, nb: u32);
    pub fn emu_permute_k1(x: *const u16, rs: *const u32, tot: *const u64, xs: *mut u16, mr: u64, h: u32);
    pub fn emu_permute_k2(x: *const u16, rs: *const u32, tot: *const u64, xs: *mut u16, mr: u64, h: u32);
    pub fn emu_permute_k6(x: *const u16, rs: *const u32, tot: *const u64, xs: *mut u16, mr: u64, h: u32);
    pub fn emu_permute_k8(x: *const u16, rs: *const u32, tot: *const u64, xs: *mut u16, mr: u64, h: u32);
    pub fn emu_unpermute_k1(y: *const u16, sr: *const u32, idx: *const i32, w: *const f32, out: *mut u16, t: u64, h: u32, g: u32);
    pub fn emu_unpermute_k2(y: *const u16, sr: *const u32, idx: *const i32, w: *const f32, out: *mut u16, t: u64, h: u32, g: u32);
    pub fn emu_unpermute_k6(y: *const u16, sr: *const u32, idx: *const i32, w: *const f32, out: *mut u16, t: u64, h: u32, g: u32);
    pub fn emu_unpermute_k8(y: *const u16, sr: *const u32, idx: *const i32, w: *const f32, out: *mut u16, t: u64, h: u32, g: u32);
}

pub type ValidateFn = unsafe extern "C" fn(*const i32, *const f32, *mut u32, u64, u64, u64, u64, u32, u32);
pub type LayoutFn = unsafe extern "C" fn(*const i32, *mut u32, *mut u64, *mut u64, *mut u32, *mut u32, u64, u32);
pub type PermFn = unsafe extern "C" fn(*const u16, *const u32, *const u64, *mut u16, u64, u32);
pub type UnpermFn = unsafe extern "C" fn(*const u16, *const u32, *const i32, *const f32, *mut u16, u64, u32, u32);
pub type TopkFn = unsafe extern "C" fn(*const f32, *mut i32, *mut f32, u32, u32);

pub fn bits(v: &[bf16]) -> *const u16 { v.as_ptr() as *const u16 }

#[cfg(test)]
mod tests {
    use super::*;
    use afdep_core::error::RouteError;
    use afdep_core::layout::{block_positions, exclusive_prefix, SourceCounts};
    use afdep_core::route::{self, RouteRules, Routes, MASKED};
    use afdep_core::ExpertPlacement;
    use rand::{Rng, SeedableRng};
    use rand::seq::SliceRandom;
    use rand_chacha::ChaCha8Rng;

    fn valid_routes(r: &mut ChaCha8Rng, t: usize, k: usize, e: usize, mask_p: f64) -> Routes {
        let mut idx = Vec::with_capacity(t * k);
        let mut w = Vec::with_capacity(t * k);
        let all: Vec<i32> = (0..e as i32).collect();
        for _ in 0..t {
            let sel: Vec<i32> = all.choose_multiple(r, k).copied().collect();
            for s in sel {
                if r.gen_bool(mask_p) { idx.push(MASKED); w.push(if r.gen_bool(0.5) { f32::NAN } else { 0.3 }); }
                else { idx.push(s); w.push(r.gen_range(0.0f32..1.0)); }
            }
        }
        Routes { tokens: t, top_k: k, idx, weights: w }
    }

    fn run_validate(f: ValidateFn, routes: &Routes, rules: &RouteRules, rank: usize, state: &mut [u32; 10]) -> [u32; 6] {
        let blocks = (routes.tokens.div_ceil(256)).clamp(1, 4096) as u32;
        unsafe { f(routes.idx.as_ptr(), routes.weights.as_ptr(), state.as_mut_ptr(), routes.tokens as u64, rules.experts as u64, rules.owned as u64, rules.capacity as u64, rank as u32, blocks) };
        let mut w = [0; 6];
        w.copy_from_slice(&state[..6]);
        assert_eq!(state[6], 0); assert_eq!(state[7], 0);
        w
    }

    #[test]
    fn validate_matches_core() {
        let fs: [(usize, ValidateFn); 4] = [(1, emu_validate_k1), (2, emu_validate_k2), (6, emu_validate_k6), (8, emu_validate_k8)];
        let mut r = ChaCha8Rng::seed_from_u64(1);
        let mut state = [0u32; 10];
        let mut classes = [0usize; 8];
        for (k, f) in fs {
            for &t in &[1usize, 7, 1000, 3000] {
                for trial in 0..30 {
                    let e = [64usize, 96, 128][trial % 3];
                    let owned = if trial % 2 == 0 { e } else { e - 8 };
                    let cap = if trial == 7 { t - 1 } else if trial == 8 { t } else { usize::MAX };
                    let mut routes = valid_routes(&mut r, t, k, owned, 0.2);
                    let nerr = trial % 4;
                    for _ in 0..nerr {
                        let tok = r.gen_range(0..t);
                        let s = r.gen_range(0..k);
                        let i = tok * k + s;
                        match r.gen_range(0..6) {
                            0 => routes.idx[i] = r.gen_range(i32::MIN..-1),
                            1 => routes.idx[i] = r.gen_range(e as i32..e as i32 + 1000),
                            2 => if owned < e { routes.idx[i] = r.gen_range(owned as i32..e as i32) },
                            3 => routes.weights[i] = [f32::NAN, f32::INFINITY, f32::NEG_INFINITY][r.gen_range(0..3)],
                            4 => if s > 0 { let j = r.gen_range(0..s); routes.idx[i] = routes.idx[tok * k + j]; },
                            _ => routes.idx[i] = MASKED,
                        }
                    }
                    let rules = RouteRules { experts: e, owned, capacity: cap, top_k: k };
                    let rank = trial % 5;
                    let want = match route::validate(&routes, &rules, rank) { Ok(()) => [0; 6], Err(e) => e.to_word() };
                    let got = run_validate(f, &routes, &rules, rank, &mut state);
                    assert_eq!(got, want, "k={k} t={t} trial={trial} {:?}", RouteError::from_word(want));
                    classes[want[0] as usize] += 1;
                    // a valid call afterwards on the same state
                    let ok = valid_routes(&mut r, t, k, owned, 0.1);
                    assert_eq!(run_validate(f, &ok, &RouteRules { capacity: usize::MAX, ..rules }, rank, &mut state), [0; 6]);
                }
            }
        }
        eprintln!("classes seen: {classes:?}");
        assert!(classes[1..7].iter().all(|&c| c > 0));
    }

    fn nblocks(slots: usize) -> usize { slots.div_ceil(4096).max(1) }

    #[test]
    fn layout_matches_core() {
        let fs: [(usize, LayoutFn); 3] = [(64, emu_layout_e64), (96, emu_layout_e96), (128, emu_layout_e128)];
        let mut r = ChaCha8Rng::seed_from_u64(2);
        for (e, f) in fs {
            for &(t, k) in &[(1usize, 1usize), (7, 2), (1000, 6), (5000, 8), (3000, 1), (40000, 2)] {
                for skew in [false, true] {
                    let mut routes = valid_routes(&mut r, t, k, e, 0.15);
                    if skew { for x in routes.idx.iter_mut() { if *x != MASKED && r.gen_bool(0.7) { *x = -1; } } }
                    // skew: keep some tokens all going to a few experts
                    let slots = t * k;
                    let nb = nblocks(slots);
                    let mut bc = vec![0xFFFF_FFFFu32; e * nb];
                    let mut counts = vec![u64::MAX; e];
                    let mut offs = vec![u64::MAX; e + 1];
                    let mut sr = vec![0xFFFF_FFFEu32; slots];
                    let mut rs = vec![0xFFFF_FFFEu32; slots];
                    unsafe { f(routes.idx.as_ptr(), bc.as_mut_ptr(), counts.as_mut_ptr(), offs.as_mut_ptr(), sr.as_mut_ptr(), rs.as_mut_ptr(), slots as u64, nb as u32) };
                    let p = ExpertPlacement { experts: e, ffn_ranks: 1, experts_per_rank: e };
                    let sc = SourceCounts::build(&routes, &p);
                    assert_eq!(counts, sc.expert_rows);
                    let po = exclusive_prefix(&sc.expert_rows);
                    assert_eq!(offs, po);
                    let pos = block_positions(&routes, &p);
                    let total = po[e] as usize;
                    for i in 0..slots {
                        match pos[i] {
                            None => assert_eq!(sr[i], u32::MAX, "masked slot {i}"),
                            Some(q) => {
                                let row = po[routes.idx[i] as usize] + q;
                                assert_eq!(sr[i] as u64, row, "slot {i}");
                                assert_eq!(rs[row as usize] as usize, i);
                            }
                        }
                    }
                    for row in total..slots { assert_eq!(rs[row], u32::MAX, "row {row} past total"); }
                }
            }
        }
    }

    #[test]
    fn permute_unpermute_match_core() {
        let ps: [(usize, PermFn, UnpermFn); 4] = [(1, emu_permute_k1, emu_unpermute_k1), (2, emu_permute_k2, emu_unpermute_k2), (6, emu_permute_k6, emu_unpermute_k6), (8, emu_permute_k8, emu_unpermute_k8)];
        let mut r = ChaCha8Rng::seed_from_u64(3);
        for (k, pf, uf) in ps {
            for &(t, h) in &[(1usize, 8usize), (7, 7), (300, 64), (123, 100), (50, 512)] {
                let e = 64;
                let routes = valid_routes(&mut r, t, k, e, 0.2);
                let slots = t * k;
                let nb = nblocks(slots);
                let (mut bc, mut counts, mut offs, mut sr, mut rs) = (vec![0u32; e * nb], vec![0u64; e], vec![0u64; e + 1], vec![0u32; slots], vec![0u32; slots]);
                unsafe { emu_layout_e64(routes.idx.as_ptr(), bc.as_mut_ptr(), counts.as_mut_ptr(), offs.as_mut_ptr(), sr.as_mut_ptr(), rs.as_mut_ptr(), slots as u64, nb as u32) };
                let x: Vec<bf16> = (0..t * h).map(|_| bf16::from_f32(r.gen_range(-2.0f32..2.0))).collect();
                let poison = bf16::from_bits(0xFFFF);
                let mut xs = vec![poison; slots * h];
                unsafe { pf(bits(&x), rs.as_ptr(), offs.as_ptr().add(e), xs.as_mut_ptr() as *mut u16, slots as u64, h as u32) };
                let total = offs[e] as usize;
                for row in 0..slots {
                    let got = &xs[row * h..(row + 1) * h];
                    if row < total {
                        let tok = rs[row] as usize / k;
                        assert_eq!(got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), x[tok * h..(tok + 1) * h].iter().map(|v| v.to_bits()).collect::<Vec<_>>());
                    } else { assert!(got.iter().all(|v| v.to_bits() == 0xFFFF)); }
                }
                let y: Vec<bf16> = (0..slots * h).map(|_| bf16::from_f32(r.gen_range(-3.0f32..3.0))).collect();
                for g in [0usize, 16, 5] {
                    let mut out = vec![poison; t * h];
                    unsafe { uf(bits(&y), sr.as_ptr(), routes.idx.as_ptr(), routes.weights.as_ptr(), out.as_mut_ptr() as *mut u16, t as u64, h as u32, g as u32) };
                    let nf = if g == 0 { 1 } else { e.div_ceil(g) };
                    let owner = |ex: usize| if g == 0 { 0 } else { ex / g };
                    let rows: Vec<&[bf16]> = vec![&y[..]; nf];
                    let want = afdep_core::oracle::exchange::combine_source(&routes, h, afdep_core::CombinePartials::F32, owner, |i| sr[i] as u64, &rows);
                    assert_eq!(out.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), want.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), "k={k} t={t} h={h} g={g}");
                }
            }
        }
    }

    fn cpu_select(logits: &[f32], t: usize, e: usize, k: usize, renorm: bool) -> Routes {
        let mut p = logits.to_vec();
        for row in p.chunks_mut(e) { route::softmax_in_place(row); }
        let shape = afdep_core::LayerShape { d_model: 1, width: 1, experts: e, top_k: k, shared: 0, renormalize: renorm };
        route::select(&p, t, &shape)
    }

    #[test]
    fn topk_on_tied_logits_matches_core() {
        let fs: [(usize, usize, TopkFn); 5] = [(96, 6, emu_router_topk_e96_k6), (64, 8, emu_router_topk_e64_k8), (128, 1, emu_router_topk_e128_k1), (64, 2, emu_router_topk_e64_k2), (96, 8, emu_router_topk_e96_k8)];
        let mut r = ChaCha8Rng::seed_from_u64(4);
        for (e, k, f) in fs {
            for &t in &[1usize, 7, 1000] {
                for renorm in [true, false] {
                    let logits: Vec<f32> = (0..t * e).map(|_| r.gen_range(-3i32..=3) as f32).collect();
                    let want = cpu_select(&logits, t, e, k, renorm);
                    let mut idx = vec![-7i32; t * k];
                    let mut w = vec![f32::NAN; t * k];
                    unsafe { f(logits.as_ptr(), idx.as_mut_ptr(), w.as_mut_ptr(), t as u32, renorm as u32) };
                    assert_eq!(idx, want.idx, "e={e} k={k} t={t}");
                    for (a, b) in w.iter().zip(&want.weights) { assert!((a - b).abs() <= 2e-6 * b.abs().max(1e-30), "{a} vs {b}"); }
                }
            }
        }
    }

    #[test]
    fn logits_match_core() {
        let mut r = ChaCha8Rng::seed_from_u64(5);
        for &(t, h) in &[(1usize, 1usize), (7, 33), (130, 100), (65, 64)] {
            for (e, f) in [(96usize, emu_router_logits_e96_k6 as unsafe extern "C" fn(*const u16, *const u16, *mut f32, u32, u32)), (64, emu_router_logits_e64_k8)] {
                let x: Vec<bf16> = (0..t * h).map(|_| bf16::from_f32(r.gen_range(-1.0f32..1.0))).collect();
                let wr: Vec<bf16> = (0..h * e).map(|_| bf16::from_f32(r.gen_range(-1.0f32..1.0))).collect();
                let mut l = vec![f32::NAN; t * e];
                unsafe { f(bits(&x), bits(&wr), l.as_mut_ptr(), t as u32, h as u32) };
                let xf: Vec<f32> = x.iter().map(|v| v.to_f32()).collect();
                let wf: Vec<f32> = wr.iter().map(|v| v.to_f32()).collect();
                let mut want = vec![0f32; t * e];
                afdep_core::oracle::gemm::matmul(t, h, e, &xf, &wf, &mut want, false);
                for i in 0..t { for j in 0..e {
                    let bound: f32 = (0..h).map(|q| (xf[i * h + q] * wf[q * e + j]).abs()).sum::<f32>() * 1e-5 + 1e-30;
                    assert!((l[i * e + j] - want[i * e + j]).abs() <= bound, "t={t} h={h} e={e} ({i},{j}) {} vs {}", l[i * e + j], want[i * e + j]);
                }}
            }
        }
    }
}
