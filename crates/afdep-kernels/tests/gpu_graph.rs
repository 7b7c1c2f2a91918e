//! Route validation and the expert layout inside a captured CUDA graph.
//!
//! One graph holds the six launches of a layer step's routing prologue on the context's
//! stream: the validation scan and word writer ([`RouteValidator::launch`]) and the layout's
//! count, block scan, expert scan and scatter ([`ExpertLayout::build`]), over device route
//! buffers of a fixed size (`T × K`). Between replays only the buffers' contents change (a
//! host-to-device copy outside the graph), and the outputs are poisoned: the error word with
//! [`RouteValidator::poison_word`], the layout with [`poison`]. After every replay the word
//! must equal `afdep_core::route::validate`'s error exactly (rank, token, slot, value, extra)
//! and the layout afdep-core's; a rejected replay is followed by a valid one, so a rejection
//! leaves the context, the validator and the graph usable (nothing traps).
//!
//! The token count and the rules (experts, owned experts, capacity) are kernel arguments,
//! baked into a graph at capture: the main graph is captured with capacity `T` (at the limit,
//! valid), and over-capacity is tested with a second graph over the same buffers, captured
//! with capacity `T - 1`, which rejects every table with `OverCapacity`.
//!
//! cudarc tracks reads and writes of every buffer with events when a context has several
//! streams (a `GpuContext` creates one, so it has); inside a capture those waits and records
//! would join events recorded outside the graph, or add event nodes. Everything here runs on
//! the context's one stream, so event tracking is switched off right after the context is
//! created, before any buffer exists, and each capture is checked to hold exactly the six
//! kernel nodes (no memcpy, memset, alloc or event node).

mod common;

use std::sync::Mutex;

use afdep_core::ExpertPlacement;
use afdep_core::RouteError;
use afdep_core::error::{ROUTE_ERROR_WORDS, route_class};
use afdep_core::layout::{SourceCounts, block_positions, exclusive_prefix};
use afdep_core::route::{MASKED, RouteRules, Routes, validate};
use afdep_kernels::cudarc::driver::{CudaGraph, sys};
use afdep_kernels::ops::layout::NO_ROW;
use afdep_kernels::ops::validate::RouteValidator;
use afdep_kernels::ops::{download, poison};
use afdep_kernels::{DeviceRoutes, ExpertLayout, GpuContext, KernelError};
use common::{gpu, plant, rng, size_allowed, valid_routes};
use rand::Rng;
use rand_chacha::ChaCha8Rng;

/// The slot classes (over-capacity is the second graph's).
const SLOT_CLASSES: [u32; 5] = [
    route_class::DUPLICATE,
    route_class::NEGATIVE,
    route_class::WIDE,
    route_class::DUMMY,
    route_class::NON_FINITE_WEIGHT,
];

/// Kernel nodes of one capture: validation scan and word, layout count, block scan, expert
/// scan, scatter.
const GRAPH_KERNELS: usize = 6;

/// The tests of this binary run one at a time: they share the device's primary context, and
/// a capture should not overlap another test's work on it.
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

/// The GPU context with cudarc's per-buffer event tracking off (see the module), or `None`
/// after `SKIP: <reason>`.
fn graph_gpu() -> Option<GpuContext> {
    let ctx = gpu()?;
    // SAFETY: every buffer of these tests is allocated, used and freed on the context's one
    // stream, whose order is all the synchronisation they need; no buffer exists yet.
    unsafe { ctx.cuda().disable_event_tracking() };
    assert!(!ctx.cuda().is_managing_stream_synchronization());
    Some(ctx)
}

/// How a replay runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Run {
    /// The main graph (capacity `T`).
    Graph,
    /// The over-capacity graph (capacity `T - 1`).
    OverGraph,
    /// The same launches as the main graph, eagerly.
    Eager,
    /// The same launches as the over-capacity graph, eagerly.
    EagerOver,
}

impl Run {
    fn over(self) -> bool {
        matches!(self, Run::OverGraph | Run::EagerOver)
    }
}

/// afdep-core's layout of a table, as the device's four output buffers.
struct WantLayout {
    counts: Vec<u64>,
    offsets: Vec<u64>,
    slot_row: Vec<u32>,
    row_slot: Vec<u32>,
}

/// afdep-core's layout (`SourceCounts`, `exclusive_prefix`, `block_positions`, as
/// `tests/gpu_layout.rs` checks it) of `routes` over `experts` experts on one GPU. Ids outside
/// `0..experts` (in a rejected table) count as masked, as the layout kernels document.
fn want_layout(routes: &Routes, experts: usize) -> WantLayout {
    let mut routes = routes.clone();
    for e in &mut routes.idx {
        if *e < 0 || *e as usize >= experts {
            *e = MASKED;
        }
    }
    let p = ExpertPlacement {
        experts,
        ffn_ranks: 1,
        experts_per_rank: experts,
    };
    let counts = SourceCounts::build(&routes, &p).expert_rows;
    let offsets = exclusive_prefix(&counts);
    let slots = routes.idx.len();
    let mut slot_row = vec![NO_ROW; slots];
    let mut row_slot = vec![NO_ROW; slots];
    for (i, q) in block_positions(&routes, &p).iter().enumerate() {
        if let Some(q) = q {
            let row = offsets[routes.idx[i] as usize] + q;
            slot_row[i] = u32::try_from(row).unwrap();
            assert_eq!(row_slot[row as usize], NO_ROW, "row {row} taken twice");
            row_slot[row as usize] = i as u32;
        }
    }
    WantLayout {
        counts,
        offsets,
        slot_row,
        row_slot,
    }
}

/// Equal slices, or a panic naming the first difference (the slices can hold millions).
fn same<T: PartialEq + std::fmt::Debug>(what: &str, got: &[T], want: &[T]) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    if let Some(i) = (0..got.len()).find(|&i| got[i] != want[i]) {
        panic!(
            "{what}: first difference at {i} of {}: got {:?}, want {:?}",
            got.len(),
            got[i],
            want[i]
        );
    }
}

/// The node types of a graph, as raw values (a type newer than these bindings stays a number).
fn node_types(g: &CudaGraph) -> Vec<u32> {
    let mut n = 0usize;
    // SAFETY: the graph is alive (owned by `g`); a null array asks for the count only.
    unsafe { sys::cuGraphGetNodes(g.cu_graph(), std::ptr::null_mut(), &mut n) }
        .result()
        .expect("counting the graph's nodes");
    let mut nodes: Vec<sys::CUgraphNode> = vec![std::ptr::null_mut(); n];
    // SAFETY: `nodes` holds `n` entries, the count the driver gave for this graph.
    unsafe { sys::cuGraphGetNodes(g.cu_graph(), nodes.as_mut_ptr(), &mut n) }
        .result()
        .expect("listing the graph's nodes");
    nodes.truncate(n);
    nodes
        .iter()
        .map(|&node| {
            let mut t = u32::MAX;
            // SAFETY: `node` belongs to the live graph; CUgraphNodeType is a C enum (4 bytes),
            // written as a u32 so that no unknown value becomes a Rust enum.
            unsafe { sys::cuGraphNodeGetType(node, (&mut t as *mut u32).cast()) }
                .result()
                .expect("reading a node's type");
            t
        })
        .collect()
}

/// Captures `launches` on the context's stream into an instantiated graph. The capture is
/// ended whatever happens (the stream is never left capturing), and must hold exactly the
/// [`GRAPH_KERNELS`] kernel nodes: a host sync during the capture invalidates it, and an
/// allocation, copy, memset or event would add a node.
fn capture(
    ctx: &GpuContext,
    what: &str,
    launches: impl FnOnce() -> Result<(), KernelError>,
) -> CudaGraph {
    ctx.synchronize().unwrap();
    let s = ctx.stream();
    s.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .unwrap_or_else(|e| panic!("{what}: beginning the capture: {e}"));
    let launched = launches();
    let status = s.capture_status();
    let ended = s.end_capture(sys::CUgraphInstantiate_flags(0));
    launched.unwrap_or_else(|e| panic!("{what}: a launch failed during the capture: {e}"));
    assert_eq!(
        status.unwrap_or_else(|e| panic!("{what}: reading the capture status: {e}")),
        sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_ACTIVE,
        "{what}: the capture was invalidated before its end (a host sync or allocation?)"
    );
    let g = ended
        .unwrap_or_else(|e| panic!("{what}: ending the capture: {e}"))
        .unwrap_or_else(|| panic!("{what}: the capture is empty"));
    let types = node_types(&g);
    let kernel = sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_KERNEL as u32;
    assert!(
        types.len() == GRAPH_KERNELS && types.iter().all(|&t| t == kernel),
        "{what}: the graph should hold {GRAPH_KERNELS} kernel nodes (type {kernel}), it holds \
         node types {types:?}"
    );
    g.upload()
        .unwrap_or_else(|e| panic!("{what}: uploading the graph: {e}"));
    g
}

/// The device side: fixed-size route buffers, the validator and layout the graphs write, and
/// the graphs (declared first: dropped before the buffers they name).
struct Rig {
    graph: CudaGraph,
    over_graph: CudaGraph,
    routes: DeviceRoutes,
    v: RouteValidator,
    l: ExpertLayout,
    rules: RouteRules,
    over_rules: RouteRules,
    rank: usize,
}

/// Exactly the launches a graph holds: validation (scan, word), then the layout.
fn launch_all(
    ctx: &GpuContext,
    v: &mut RouteValidator,
    l: &mut ExpertLayout,
    routes: &DeviceRoutes,
    rules: &RouteRules,
    rank: usize,
) -> Result<(), KernelError> {
    v.launch(ctx, routes, rules, rank)?;
    l.build(ctx, &routes.idx)
}

/// What one replay left on the device.
struct Replay {
    word: [u32; ROUTE_ERROR_WORDS],
    counts: Vec<u64>,
    offsets: Vec<u64>,
    slot_row: Vec<u32>,
    row_slot: Vec<u32>,
}

impl Rig {
    /// Writes `table` into the route buffers, poisons every output, runs, and reads back.
    fn run(&mut self, ctx: &GpuContext, how: Run, table: &Routes) -> Replay {
        assert_eq!(
            (table.tokens, table.top_k),
            (self.routes.tokens, self.routes.top_k)
        );
        let s = ctx.stream();
        s.memcpy_htod(&table.idx, &mut self.routes.idx).unwrap();
        s.memcpy_htod(&table.weights, &mut self.routes.weights)
            .unwrap();
        self.v.poison_word(ctx).unwrap();
        poison(ctx, &mut self.l.counts).unwrap();
        poison(ctx, &mut self.l.offsets).unwrap();
        poison(ctx, &mut self.l.slot_row).unwrap();
        poison(ctx, &mut self.l.row_slot).unwrap();
        match how {
            Run::Graph => self.graph.launch().unwrap(),
            Run::OverGraph => self.over_graph.launch().unwrap(),
            Run::Eager | Run::EagerOver => {
                let rules = if how.over() {
                    self.over_rules
                } else {
                    self.rules
                };
                launch_all(
                    ctx,
                    &mut self.v,
                    &mut self.l,
                    &self.routes,
                    &rules,
                    self.rank,
                )
                .unwrap();
            }
        }
        let word = self.v.word(ctx).unwrap();
        ctx.check()
            .unwrap_or_else(|e| panic!("{how:?}: the context failed: {e}"));
        // The validator's decoding agrees with the raw word.
        match self.v.result(ctx) {
            Ok(Ok(())) => assert_eq!(word, [0; ROUTE_ERROR_WORDS], "{how:?}"),
            Ok(Err(e)) => assert_eq!(e.to_word(), word, "{how:?}"),
            Err(e) => assert_ne!(word[0], route_class::OK, "{how:?}: {e}"),
        }
        Replay {
            word,
            counts: download(ctx, &self.l.counts).unwrap(),
            offsets: download(ctx, &self.l.offsets).unwrap(),
            slot_row: download(ctx, &self.l.slot_row).unwrap(),
            row_slot: download(ctx, &self.l.row_slot).unwrap(),
        }
    }
}

/// A rig with its valid table and that table's layout.
struct Case {
    rig: Rig,
    base: Routes,
    want: WantLayout,
    experts: usize,
    what: String,
    /// Replays per class of the word they gave.
    seen: [usize; 8],
}

impl Case {
    /// `T × K` routes over `E` experts of which `E - 16` are owned (so dummy ids exist).
    fn new(ctx: &GpuContext, r: &mut ChaCha8Rng, t: usize, e: usize, k: usize) -> Case {
        assert!(t >= 1 && e > 16);
        let what = format!("T={t} E={e} K={k}");
        let owned = e - 16;
        let base = valid_routes(r, t, k, owned, 0.1);
        let rank = r.gen_range(0..8);
        let rules = RouteRules {
            experts: e,
            owned,
            capacity: t,
            top_k: k,
        };
        let over_rules = RouteRules {
            capacity: t - 1,
            ..rules
        };
        // Everything is allocated before the captures.
        let mut routes = DeviceRoutes::zeros(ctx, t, k).unwrap();
        let mut v = RouteValidator::new(ctx).unwrap();
        let mut l = ExpertLayout::new(ctx, t, k, e).unwrap();

        // A poisoned word reads as undecodable, never as valid (and leaves the key alone).
        v.poison_word(ctx).unwrap();
        assert_eq!(v.word(ctx).unwrap(), [u32::MAX; ROUTE_ERROR_WORDS]);
        assert!(
            matches!(v.result(ctx), Err(KernelError::BadErrorWord(_))),
            "{what}: a poisoned word must not decode"
        );

        // One eager run loads every module and function the graphs use, so that the captures
        // compile and load nothing.
        let s = ctx.stream();
        s.memcpy_htod(&base.idx, &mut routes.idx).unwrap();
        s.memcpy_htod(&base.weights, &mut routes.weights).unwrap();
        launch_all(ctx, &mut v, &mut l, &routes, &rules, rank).unwrap();
        assert_eq!(
            v.word(ctx).unwrap(),
            [0; ROUTE_ERROR_WORDS],
            "{what}: warm-up"
        );

        let graph = capture(ctx, &format!("{what} graph"), || {
            launch_all(ctx, &mut v, &mut l, &routes, &rules, rank)
        });
        let over_graph = capture(ctx, &format!("{what} over-capacity graph"), || {
            launch_all(ctx, &mut v, &mut l, &routes, &over_rules, rank)
        });
        let want = want_layout(&base, e);
        Case {
            rig: Rig {
                graph,
                over_graph,
                routes,
                v,
                l,
                rules,
                over_rules,
                rank,
            },
            base,
            want,
            experts: e,
            what,
            seen: [0; 8],
        }
    }

    fn rules(&self, how: Run) -> RouteRules {
        if how.over() {
            self.rig.over_rules
        } else {
            self.rig.rules
        }
    }

    fn check_layout(&self, how: Run, got: &Replay, want: &WantLayout, what: &str) {
        let what = format!("{} {how:?} {what}", self.what);
        same(&format!("{what}: counts"), &got.counts, &want.counts);
        same(&format!("{what}: offsets"), &got.offsets, &want.offsets);
        same(&format!("{what}: slot_row"), &got.slot_row, &want.slot_row);
        same(&format!("{what}: row_slot"), &got.row_slot, &want.row_slot);
    }

    /// Runs the valid table: a clean word and afdep-core's layout.
    fn valid(&mut self, ctx: &GpuContext, how: Run) {
        assert!(!how.over());
        validate(&self.base, &self.rules(how), self.rig.rank)
            .unwrap_or_else(|e| panic!("{}: the base table is invalid: {e}", self.what));
        let got = self.rig.run(ctx, how, &self.base);
        assert_eq!(
            got.word,
            [0; ROUTE_ERROR_WORDS],
            "{} {how:?}: the valid table was rejected: {:?}",
            self.what,
            RouteError::from_word(got.word)
        );
        self.check_layout(how, &got, &self.want, "valid table");
        self.seen[route_class::OK as usize] += 1;
    }

    /// Runs a rejected table: the word decodes to exactly afdep-core's error, at `at` (token,
    /// slot) when given, and the layout in the same run is still afdep-core's.
    fn rejected(
        &mut self,
        ctx: &GpuContext,
        how: Run,
        table: &Routes,
        class: u32,
        at: Option<(usize, usize)>,
    ) {
        let rank = self.rig.rank;
        let what = format!("{} {how:?} class {class} at {at:?}", self.what);
        let Err(want) = validate(table, &self.rules(how), rank) else {
            panic!("{what}: afdep-core accepts the table");
        };
        let want_word = want.to_word();
        assert_eq!(want_word[0], class, "{what}: afdep-core says {want}");
        let got = self.rig.run(ctx, how, table);
        let decoded = RouteError::from_word(got.word).unwrap_or_else(|| {
            panic!(
                "{what}: the device word {:?} does not decode (want {want})",
                got.word
            )
        });
        assert_eq!(got.word, want_word, "{what}: device {decoded}, want {want}");
        assert_eq!(decoded.to_word(), want_word, "{what}");
        assert_eq!(decoded.to_string(), want.to_string(), "{what}");
        let (r, loc) = location(&decoded);
        assert_eq!(r, rank, "{what}: rank");
        if let Some(at) = at {
            assert_eq!(loc, Some(at), "{what}: token and slot");
        }
        if let RouteError::OverCapacity {
            tokens, capacity, ..
        } = decoded
        {
            assert_eq!(
                (tokens, capacity),
                (table.tokens, table.tokens - 1),
                "{what}"
            );
        }
        let layout = if table.idx == self.base.idx {
            // Only weights changed, or over capacity on the valid table.
            None
        } else {
            Some(want_layout(table, self.experts))
        };
        self.check_layout(
            how,
            &got,
            layout.as_ref().unwrap_or(&self.want),
            "rejected table",
        );
        self.seen[class as usize] += 1;
    }

    /// Runs the valid table on the over-capacity graph: rejected as over capacity (checked
    /// before any slot).
    fn valid_table_over_capacity(&mut self, ctx: &GpuContext) {
        let base = self.base.clone();
        self.rejected(ctx, Run::OverGraph, &base, route_class::OVER_CAPACITY, None);
    }
}

/// The rank and the (token, slot) an error names.
fn location(e: &RouteError) -> (usize, Option<(usize, usize)>) {
    match *e {
        RouteError::Duplicate {
            rank, token, slot, ..
        }
        | RouteError::Negative {
            rank, token, slot, ..
        }
        | RouteError::Wide {
            rank, token, slot, ..
        }
        | RouteError::Dummy {
            rank, token, slot, ..
        }
        | RouteError::NonFiniteWeight {
            rank, token, slot, ..
        } => (rank, Some((token, slot))),
        RouteError::OverCapacity { rank, .. }
        | RouteError::NonFinitePayload { rank, .. }
        | RouteError::NonFiniteLogit { rank, .. }
        | RouteError::Malformed { rank, .. } => (rank, None),
    }
}

/// A copy of `base` with one offence of `class` at a random place (sometimes the last token);
/// `None` when the class cannot be planted (a duplicate needs two slots, the earlier one
/// unmasked: a table of one token may have none).
fn with_offence(
    r: &mut ChaCha8Rng,
    base: &Routes,
    rules: &RouteRules,
    class: u32,
) -> Option<(Routes, (usize, usize))> {
    let (t, k) = (base.tokens, base.top_k);
    if class == route_class::DUPLICATE && k < 2 {
        return None;
    }
    for attempt in 0..200 {
        let token = if attempt == 0 && r.gen_bool(0.3) {
            t - 1
        } else {
            r.gen_range(0..t)
        };
        let slot = if class == route_class::DUPLICATE {
            r.gen_range(1..k)
        } else {
            r.gen_range(0..k)
        };
        let mut bad = base.clone();
        if plant(r, &mut bad, rules, class, token, slot) {
            return Some((bad, (token, slot)));
        }
    }
    None
}

#[test]
fn graph_replays_every_rejected_class_then_a_valid_table() {
    let _serial = serial();
    let Some(ctx) = graph_gpu() else { return };
    let mut r = rng(41);
    let mut seen = [0usize; 8];
    for &t in &[1usize, 1000, 16384] {
        for &(e, k) in &[(64usize, 8usize), (128, 2), (96, 1), (128, 6)] {
            let mut c = Case::new(&ctx, &mut r, t, e, k);
            c.valid(&ctx, Run::Graph);
            for class in SLOT_CLASSES {
                // Two different offences per class: the same graph, new buffer contents.
                for _ in 0..2 {
                    let Some((bad, at)) = with_offence(&mut r, &c.base, &c.rig.rules, class) else {
                        continue;
                    };
                    c.rejected(&ctx, Run::Graph, &bad, class, Some(at));
                    c.valid(&ctx, Run::Graph);
                }
            }
            // Over capacity (the second graph): checked before any slot, so a table with a bad
            // slot and the valid table are both rejected with it; the main graph accepts the
            // valid table right after.
            let (bad, _) =
                with_offence(&mut r, &c.base, &c.rig.rules, route_class::NEGATIVE).unwrap();
            c.rejected(&ctx, Run::OverGraph, &bad, route_class::OVER_CAPACITY, None);
            c.valid(&ctx, Run::Graph);
            c.valid_table_over_capacity(&ctx);
            c.valid(&ctx, Run::Graph);
            for (s, n) in seen.iter_mut().zip(c.seen) {
                *s += n;
            }
        }
    }
    for class in 0..=6 {
        assert!(seen[class] > 0, "class {class} never exercised: {seen:?}");
    }
}

#[test]
fn eager_and_graph_runs_interleave_on_one_context() {
    // Per class: eager reject → graph valid → graph reject → eager valid, on one context, one
    // validator and one layout (the graphs and the eager launches share their buffers).
    let _serial = serial();
    let Some(ctx) = graph_gpu() else { return };
    let mut r = rng(42);
    let t = 1000;
    for &e in &[64usize, 128] {
        for &k in &[8usize, 2] {
            let mut c = Case::new(&ctx, &mut r, t, e, k);
            for class in SLOT_CLASSES {
                let mut offence = || {
                    with_offence(&mut r, &c.base, &c.rig.rules, class)
                        .unwrap_or_else(|| panic!("E={e} K={k}: class {class} not planted"))
                };
                // Two different offences: one for the eager run, one for the graph.
                let (eager_bad, eager_at) = offence();
                let (graph_bad, graph_at) = offence();
                c.rejected(&ctx, Run::Eager, &eager_bad, class, Some(eager_at));
                c.valid(&ctx, Run::Graph);
                c.rejected(&ctx, Run::Graph, &graph_bad, class, Some(graph_at));
                c.valid(&ctx, Run::Eager);
            }
            let (bad, _) = with_offence(&mut r, &c.base, &c.rig.rules, route_class::WIDE).unwrap();
            c.rejected(&ctx, Run::EagerOver, &bad, route_class::OVER_CAPACITY, None);
            c.valid(&ctx, Run::Graph);
            c.valid_table_over_capacity(&ctx);
            c.valid(&ctx, Run::Eager);
            for class in 0..=6 {
                assert!(
                    c.seen[class] > 0,
                    "E={e} K={k}: class {class}: {:?}",
                    c.seen
                );
            }
        }
    }
}

#[test]
fn graph_finds_an_offender_near_the_end_of_a_million_tokens() {
    // T = 2^20, K = 8: slot indices up to 2^23 and the scan's grid-stride loop (4096 blocks
    // of 256 threads cover 2^20 tokens exactly once; a later offence must lose to an earlier
    // one found by another block).
    if !size_allowed(1 << 20) {
        return;
    }
    let _serial = serial();
    let Some(ctx) = graph_gpu() else { return };
    let mut r = rng(43);
    let (t, e, k) = (1usize << 20, 128usize, 8usize);
    let near_end = 1_048_570;
    let mut c = Case::new(&ctx, &mut r, t, e, k);
    c.valid(&ctx, Run::Graph);
    for class in SLOT_CLASSES {
        // The offence on token 1,048,570 (or the next token that can hold it), and a second,
        // later one on the last token, which must not win.
        let mut bad = c.base.clone();
        let at = (near_end..t)
            .flat_map(|token| (0..k).map(move |slot| (token, slot)))
            .filter(|&(_, slot)| class != route_class::DUPLICATE || slot > 0)
            .find(|&(token, slot)| plant(&mut r, &mut bad, &c.rig.rules, class, token, slot))
            .unwrap_or_else(|| panic!("class {class} could not be planted near the end"));
        if at.0 < t - 1 {
            let later = SLOT_CLASSES[r.gen_range(0..SLOT_CLASSES.len())];
            for slot in 1..k {
                if plant(&mut r, &mut bad, &c.rig.rules, later, t - 1, slot) {
                    break;
                }
            }
        }
        c.rejected(&ctx, Run::Graph, &bad, class, Some(at));
        c.valid(&ctx, Run::Graph);
        if class == route_class::NEGATIVE {
            // The same table eagerly, then the graph again.
            c.rejected(&ctx, Run::Eager, &bad, class, Some(at));
            c.valid(&ctx, Run::Graph);
        }
    }
    c.valid_table_over_capacity(&ctx);
    c.valid(&ctx, Run::Graph);
    c.valid(&ctx, Run::Eager);
}
