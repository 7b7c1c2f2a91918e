//! The soak: many graph replays of the fused engine's auto-arm device round on 3A:1F (four
//! in-process NvlinkIpc ranks emulated on GPU 0), bf16 and fp8 payloads, with new routing and
//! token counts on every replay (0 to the capacity per source, a zero-token source and a
//! full one from time to time, a hot expert every other replay, masked slots; the auto arm's
//! bucket at 64 tokens, so both arms are taken). Every 1,000th replay is checked bit for bit
//! against the oracle (the device expert's host twin), every replay's combined output is
//! hashed. Memory is judged at three quiescent points (every rank thread waits on a barrier at
//! the top of a replay, so no replay's buffers are alive): after a warm-up of 1,000 replays,
//! half way, and at the end.
//!
//! - The Rust heap, counted exactly by this binary's global allocator: the live allocations
//!   (allocations minus frees, every thread of the process, the library's included) must not
//!   grow by more than [`HEAP_SLACK_ALLOCS`] nor the live bytes by more than
//!   [`HEAP_SLACK_BYTES`]. A leak of one allocation per replay grows the count by 49,000.
//! - The host's resident memory (`/proc/self/statm`, after `malloc_trim(0)` gives freed pages
//!   back): it covers the CUDA driver's own host allocations, which the counter cannot see,
//!   but it also moves with the allocator's arenas (four threads allocating inputs of random
//!   sizes: 3.5–18 MiB of growth were seen over the first 49,000 replays with a flat heap).
//!   So it is judged as a plateau: growth over the second half at most [`RSS_SLACK`], which a
//!   leak of about 170 bytes per replay would exceed.
//! - The device's free memory (`cuMemGetInfo`): at most [`DEVICE_SLACK`] less at the end.
//!
//! The summary line `SOAK ...` gives replays, checked replays, mismatches (must be 0), the
//! hash, the arms taken, the heap, the resident memory and the device's free memory at the
//! three points, and the time per replay.
//!
//! `AFDEP_SOAK_REPLAYS` sets the replays per payload (default 50,000: 100,000 in all). Expected
//! time on an H200: about 0.3–0.9 ms per replay (the replay, its input upload and output
//! read-back, the host's input generation), so 15–45 s per payload and under two minutes for
//! both. Without a GPU every test prints `SKIP: <reason>` and passes; with
//! `AFDEP_REQUIRE_GPU=1` a missing GPU fails.

mod exchange_common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::Barrier;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::{Duration, Instant};

use afdep_core::oracle::exchange::{self as reference, SourceInput};
use afdep_core::route::{MASKED, Routes};
use afdep_core::tensor::{rng, uniform_bf16};
use afdep_core::{ExchangeConfig, PayloadKind, bf16};
use afdep_moe::{DeviceExperts, DispatchArm, FusedEngine, RoundArm};
use exchange_common::{fused_group, on_fused_ranks, serial};
use rand::Rng;

const TIMEOUT: Duration = Duration::from_secs(20);
/// Every this many replays: a check against the oracle.
const CHECK_EVERY: usize = 1000;
/// Replays before the memory baseline (one-time allocations: module loads, allocator growth).
const WARM_UP: usize = 1000;
/// Live Rust allocations the process may gain between the warm-up and the end (lazily built
/// one-time state such as a tracing callsite); a per-replay leak gains one per replay.
const HEAP_SLACK_ALLOCS: i64 = 64;
/// Live Rust heap bytes the process may gain between the warm-up and the end.
const HEAP_SLACK_BYTES: i64 = 256 << 10;
/// Resident-memory growth allowed over the second half (24,500 replays at the default).
const RSS_SLACK: u64 = 4 << 20;
/// Device memory that may go between the warm-up and the end.
const DEVICE_SLACK: u64 = 2 << 20;

/// The process's live Rust allocations and bytes, counted by [`Counting`].
static LIVE_ALLOCS: AtomicI64 = AtomicI64::new(0);
static LIVE_BYTES: AtomicI64 = AtomicI64::new(0);

/// The system allocator with two counters: live allocations and live bytes.
struct Counting;

// SAFETY: every method forwards to `System` with the caller's arguments unchanged and only
// adds relaxed atomic counter updates, which neither allocate nor touch the memory.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded under the caller's contract.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            LIVE_ALLOCS.fetch_add(1, Ordering::Relaxed);
            LIVE_BYTES.fetch_add(layout.size() as i64, Ordering::Relaxed);
        }
        p
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded under the caller's contract.
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            LIVE_ALLOCS.fetch_add(1, Ordering::Relaxed);
            LIVE_BYTES.fetch_add(layout.size() as i64, Ordering::Relaxed);
        }
        p
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: forwarded under the caller's contract.
        unsafe { System.dealloc(ptr, layout) };
        LIVE_ALLOCS.fetch_sub(1, Ordering::Relaxed);
        LIVE_BYTES.fetch_sub(layout.size() as i64, Ordering::Relaxed);
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: forwarded under the caller's contract.
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            LIVE_BYTES.fetch_add(new_size as i64 - layout.size() as i64, Ordering::Relaxed);
        }
        p
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

unsafe extern "C" {
    /// glibc: give the arenas' free pages back to the system.
    fn malloc_trim(pad: usize) -> i32;
}

/// Memory at one quiescent point of the soak.
#[derive(Debug, Clone, Copy, Default)]
struct Memory {
    allocs: i64,
    heap_bytes: i64,
    rss: u64,
    device_free: u64,
}

impl Memory {
    /// Read at a point where no replay's buffers are alive (the caller's barrier), with this
    /// thread's context current.
    fn now() -> Memory {
        // SAFETY: malloc_trim only releases free memory of glibc's arenas; no Rust object
        // is touched.
        unsafe { malloc_trim(0) };
        Memory {
            allocs: LIVE_ALLOCS.load(Ordering::SeqCst),
            heap_bytes: LIVE_BYTES.load(Ordering::SeqCst),
            rss: rss(),
            device_free: device_free(),
        }
    }
}

fn replays() -> usize {
    std::env::var("AFDEP_SOAK_REPLAYS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(50_000)
}

fn config(payload: PayloadKind) -> ExchangeConfig {
    let mut c = ExchangeConfig::new("3A:1F".parse().unwrap(), 1024, 64, 8, 128).unwrap();
    c.payload = payload;
    // the auto arm switches to count-first at 64 tokens: both arms are taken
    c.knobs.min_token_bucket = 64;
    c.validate().unwrap();
    c
}

/// Rows every source's inputs are cut from (at a new offset each replay).
struct Pool(Vec<bf16>);

impl Pool {
    fn new(c: &ExchangeConfig) -> Pool {
        Pool(uniform_bf16(4 * c.capacity * c.hidden, 1.0, 77, 1))
    }
}

/// Source `s`'s input of replay `i`, a function of (i, s) only, so that every rank thread and
/// the oracle check make the same one: the token count (0 every 7th, the capacity every 11th,
/// else random), distinct experts per token with a hot expert every other replay, a masked
/// slot one time in eight, rows cut from the pool at a random offset.
fn source_input(c: &ExchangeConfig, pool: &Pool, i: usize, s: usize) -> SourceInput {
    let mut r = rng(i as u64, 10 + s as u64);
    let cap = c.capacity;
    let tokens = match (i + 3 * s) % 77 {
        x if x % 7 == 0 => 0,
        x if x % 11 == 0 => cap,
        _ => r.gen_range(1..=cap),
    };
    let (k, owned) = (c.top_k, c.placement().owned());
    let hot = (i % 2 == 0).then(|| (i / 2 % owned) as i32);
    let mut ids: Vec<i32> = (0..owned as i32).collect();
    let mut idx = Vec::with_capacity(tokens * k);
    let mut weights = Vec::with_capacity(tokens * k);
    for _ in 0..tokens {
        // a partial shuffle: k distinct experts
        for j in 0..k {
            let p = r.gen_range(j..owned);
            ids.swap(j, p);
        }
        if let Some(h) = hot {
            if r.gen_bool(0.9) {
                let at = ids.iter().position(|&e| e == h).unwrap();
                ids.swap(0, at);
            }
        }
        for &e in &ids[..k] {
            idx.push(if r.gen_range(0..8) == 0 { MASKED } else { e });
            weights.push(r.gen_range(0.05f32..1.0));
        }
    }
    let n = tokens * c.hidden;
    let at = r.gen_range(0..=pool.0.len() - n);
    SourceInput {
        x: pool.0[at..at + n].to_vec(),
        routes: Routes {
            tokens,
            top_k: k,
            idx,
            weights,
        },
    }
}

/// Resident host memory, bytes.
fn rss() -> u64 {
    let s = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: u64 = s
        .split_whitespace()
        .nth(1)
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    pages * 4096
}

/// Free device memory, bytes (this thread's context must be current).
fn device_free() -> u64 {
    afdep_kernels::cudarc::driver::result::mem_get_info()
        .expect("cuMemGetInfo")
        .0 as u64
}

fn fnv(h: &mut u64, v: &[bf16]) {
    for x in v {
        for b in x.to_bits().to_le_bytes() {
            *h ^= u64::from(b);
            *h = h.wrapping_mul(0x100_0000_01b3);
        }
    }
}

/// What one attention rank's thread saw.
#[derive(Debug, Default)]
struct Tally {
    checked: usize,
    mismatches: usize,
    hash: u64,
    arms: [usize; 3],
    /// Memory after the warm-up, half way and at the end (rank 0 reads it).
    memory: [Memory; 3],
}

fn soak(payload: PayloadKind) {
    let _lock = serial();
    let c = config(payload);
    let world = c.topology.world_size();
    let Some(g) = fused_group(world, &c, 16 << 20, TIMEOUT) else {
        return;
    };
    let n = replays();
    assert!(
        n > WARM_UP,
        "AFDEP_SOAK_REPLAYS must exceed the {WARM_UP}-replay warm-up"
    );
    let pool = Pool::new(&c);
    let experts = DeviceExperts::index_scale(c.experts);
    let t0 = Instant::now();
    // the quiescent points: every rank thread at the top of replay WARM_UP and n / 2 and after
    // its last replay; rank 0 reads the memory between two waits
    let barrier = Barrier::new(world);
    let checkpoints = [WARM_UP, (WARM_UP + n) / 2, n];
    let (tallies, keep): (Vec<Tally>, _) = on_fused_ranks(g, &c, false, |rank, eng| {
        let (c, pool, experts, barrier) = (&c, &pool, &experts, &barrier);
        let graph = eng.capture(RoundArm::Auto).expect("capture");
        let me = c.topology.attention_index(rank);
        let mut tally = Tally {
            hash: 0xcbf2_9ce4_8422_2325,
            ..Tally::default()
        };
        let quiesce = |i: usize, tally: &mut Tally, eng: &mut FusedEngine| {
            let Some(point) = checkpoints.iter().position(|&p| p == i) else {
                return;
            };
            barrier.wait();
            if rank == 0 {
                eng.transport_mut().context().bind_to_thread().unwrap();
                tally.memory[point] = Memory::now();
            }
            barrier.wait();
        };
        for i in 0..n {
            quiesce(i, &mut tally, eng);
            let mine = me.map(|s| source_input(c, pool, i, s));
            let out = eng
                .replay(&graph, mine.as_ref())
                .unwrap_or_else(|e| panic!("replay {i} rank {rank}: {e}"));
            let arm = eng.last_arm();
            tally.arms[DispatchArm::ALL.iter().position(|&a| a == arm).unwrap()] += 1;
            let Some(s) = me else { continue };
            let got = out.combined.as_deref().expect("an attention rank combines");
            fnv(&mut tally.hash, got);
            if i % CHECK_EVERY == 0 || i == n - 1 {
                let all: Vec<SourceInput> = (0..c.topology.attention_count())
                    .map(|s| source_input(c, pool, i, s))
                    .collect();
                let want = reference::exchange(c, &all, experts.host()).unwrap();
                let bits = |v: &[bf16]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                tally.checked += 1;
                if bits(got) != bits(&want[s]) || got.iter().any(|v| v.is_nan()) {
                    tally.mismatches += 1;
                    println!("replay {i}: source {s} differs from the oracle");
                }
            }
        }
        quiesce(n, &mut tally, eng);
        (tally, graph)
    });
    let took = t0.elapsed();
    for (eng, graph) in keep {
        drop(graph);
        drop(eng);
    }
    let attention = c.topology.attention_count();
    let checked: usize = tallies[..attention].iter().map(|t| t.checked).sum();
    let mismatches: usize = tallies[..attention].iter().map(|t| t.mismatches).sum();
    let hash = tallies[..attention]
        .iter()
        .fold(0u64, |h, t| h.rotate_left(17) ^ t.hash);
    let [m0, m1, m2] = tallies[0].memory;
    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    println!(
        "SOAK 3A:1F {payload}: replays {n}, checked {checked} (every {CHECK_EVERY}th and the last, \
         per source), mismatches {mismatches}, hash {hash:#018x}, arms taken (payload-first, \
         count-first, source) {:?}; after replays {WARM_UP} / {} / {n}: live Rust allocations \
         {} / {} / {} ({} / {} / {} bytes), host RSS {:.1} / {:.1} / {:.1} MiB, device free \
         {:.1} / {:.1} / {:.1} MiB; {:.1} s ({:.0} us per replay)",
        tallies[0].arms,
        checkpoints[1],
        m0.allocs,
        m1.allocs,
        m2.allocs,
        m0.heap_bytes,
        m1.heap_bytes,
        m2.heap_bytes,
        mib(m0.rss),
        mib(m1.rss),
        mib(m2.rss),
        mib(m0.device_free),
        mib(m1.device_free),
        mib(m2.device_free),
        took.as_secs_f64(),
        took.as_secs_f64() * 1e6 / n as f64
    );
    assert_eq!(mismatches, 0, "replays that differ from the oracle");
    assert!(checked >= attention * (n / CHECK_EVERY), "{checked} checks");
    assert!(
        tallies[0].arms[0] > 0 && tallies[0].arms[2] > 0,
        "the auto arm took one arm only: {:?}",
        tallies[0].arms
    );
    let replays = n - WARM_UP;
    for (what, from, to, slack) in [
        (
            "live Rust allocations",
            m0.allocs,
            m2.allocs,
            HEAP_SLACK_ALLOCS,
        ),
        (
            "the live Rust heap (bytes)",
            m0.heap_bytes,
            m2.heap_bytes,
            HEAP_SLACK_BYTES,
        ),
    ] {
        assert!(
            to - from <= slack,
            "{what} grew from {from} to {to} over {replays} replays"
        );
    }
    assert!(
        m2.rss <= m1.rss + RSS_SLACK,
        "host memory grew from {} to {} bytes over the second half ({} replays)",
        m1.rss,
        m2.rss,
        n - checkpoints[1]
    );
    assert!(
        m2.device_free + DEVICE_SLACK >= m0.device_free,
        "free device memory fell from {} to {} bytes over {replays} replays (the GPU's free \
         memory: run the soak alone on its GPU, other processes move it too)",
        m0.device_free,
        m2.device_free,
    );
}

#[test]
fn soak_bf16_graph_replays_auto_arm_3a1f() {
    soak(PayloadKind::Bf16);
}

#[test]
fn soak_fp8_graph_replays_auto_arm_3a1f() {
    soak(PayloadKind::Fp8E4m3);
}
