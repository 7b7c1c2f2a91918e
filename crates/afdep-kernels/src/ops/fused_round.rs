//! Launchers of the device round of the fused exchange (`fused_round.cu`): the round control
//! block, route validation with the verdict shared among ranks and the reproducible device
//! expert. (A device round's combine is [`super::fused::combine_reduce`] and
//! [`super::fused::combine`], which need no host-built list.)
//!
//! **The control block** (`layout/fused.cuh`, `u32[`[`CTL_WORDS`]`]` in each rank's own
//! workspace): the round number, the round's verdict, the route error word of the lowest
//! rejecting rank and this source's token count. Every fused kernel that raises or waits for a
//! flag takes the control block's device address (`ctl`) instead of a round number: the round
//! is incremented on the device ([`begin`]) and read there, and every kernel of a round returns
//! at once when the verdict is not go. A round's launches therefore depend on no host value that
//! changes from round to round, and can be captured in a CUDA graph whose replays run new rounds
//! with new routes and token counts (worst-case grids and buffers, sized by the capacity).
//!
//! **The status area** (`u32[2][64][`[`STATUS_WORDS`]`]` in every workspace, by round parity
//! and rank): [`begin`] stores this rank's record (its verdict word: the route error word of
//! its first offending slot, zero for none or for an FFN-only rank; its token count; its arm
//! request) into every rank's area and raises its round there; then it waits (bounded) for
//! every rank's record of the round. A rank publishes round r + 1 only after it read every
//! rank's record of round r, so the two parity slots are never overwritten before every rank
//! read them.
//!
//! **The arm** ([`arm`]): every rank reads the same records, so every rank derives the same
//! arm of the round: rank 0's request, or, for [`arm::AUTO`], the token-bucket rule over the
//! largest source's token count; ranks whose requests differ all skip the round
//! ([`verdict::ARMS_DIFFER`]). [`begin`] writes it into the control block ([`CTL_ARM`]) and
//! into the **arm gates** ([`ARM_GATES`]): per set of arms, a copy of the control block's
//! round, verdict and token count whose verdict is go only when the round's arm is in the set.
//! A kernel launched with a gate as its control block returns at once in a round of another
//! arm, so one captured graph can hold every arm's kernels and still run one arm per round,
//! chosen on the device (`afdep_moe::fused::device_round`).
//!
//! **fp8 payloads**: a row with a NaN or an infinity cannot be quantised, so a device round of
//! fp8 payloads rejects it like a route ([`afdep_core::RouteError::NonFinitePayload`], checked
//! after the routes as on the host): a source runs [`check_payload`] just before [`begin`],
//! which finds its first non-finite value in a travelling row (tokens, then channels,
//! ascending) and leaves its error word in a [`PAYLOAD_STATE_WORDS`]-word state buffer; [`begin`]
//! publishes that word as the source's verdict word when its routes pass.

use afdep_core::bf16;
use cudarc::driver::{CudaSlice, PushKernelArg};

use super::fused::{RankAddrs, fused_function};
use super::fused_layout::FusedLayout;
use super::{as_u32, need};
use crate::context::{GpuContext, launch_err};
use crate::error::KernelError;
use crate::sources::KernelId;

/// Words of the control block (`AFDEP_CTL_WORDS`).
pub const CTL_WORDS: usize = 16;
/// Index of the round number in the control block.
pub const CTL_ROUND: usize = 0;
/// Index of the verdict ([`verdict`]).
pub const CTL_VERDICT: usize = 1;
/// Index of the first of the route error word's six words.
pub const CTL_ROUTE: usize = 2;
/// Index of this source's token count of the round (written by the host before the round).
pub const CTL_TOKENS: usize = 8;
/// Index of the arm this rank asks for ([`arm`]; written by the host before the round, right
/// after the token count).
pub const CTL_ARM_REQUEST: usize = 9;
/// Index of the arm the round takes ([`arm`], written by [`begin`]: the same on every rank).
pub const CTL_ARM: usize = 10;
/// Words of one rank's record in the status area: the route error word, the rank's token
/// count, its arm request, then (last word) the round.
pub const STATUS_WORDS: usize = 16;
/// Arm gates of a rank ([`begin`]): gate `m` (`1 <= m < ARM_GATES`) is a control block of
/// `CTL_WORDS` words whose verdict is go only when the round's arm is in the set `m` (bit `a`:
/// arm code `a`); a kernel launched with [`gate_address`]`(gates, m)` as its control block runs
/// only for those arms.
pub const ARM_GATES: usize = 8;
/// Bytes of the status area (two parities of 64 ranks).
pub const STATUS_BYTES: u64 = (2 * 64 * STATUS_WORDS * 4) as u64;

/// The verdicts of the control block.
pub mod verdict {
    /// The round runs.
    pub const GO: u32 = 0;
    /// A source's route was rejected: every rank skips the data phases.
    pub const REJECTED: u32 = 1;
    /// A status wait ran out (the error word names the late rank).
    pub const FAULTED: u32 = 2;
    /// Ranks asked for different arms: every rank skips the round; the control block's words
    /// from [`super::CTL_ROUTE`] hold the lowest rank whose request differs from rank 0's, rank
    /// 0's request and that rank's request.
    pub const ARMS_DIFFER: u32 = 3;
    /// Only in an arm gate: the round takes an arm outside the gate's set.
    pub const ARM_OFF: u32 = 4;
}

/// The arm codes of the control block (`AFDEP_ARM_*`): the dispatch arms, and the request for
/// the rule (count-first when the largest source's token count of the round reaches the
/// bucket, payload-first below it).
pub mod arm {
    /// Payload-first.
    pub const PAYLOAD_FIRST: u32 = 0;
    /// Count-first, the streaming epilogue.
    pub const COUNT_FIRST: u32 = 1;
    /// Count-first, the source arm.
    pub const SOURCE: u32 = 2;
    /// A request only: the arm by the rule.
    pub const AUTO: u32 = 3;
}

/// The device address of gate `mask` (a set of arm codes, bit `a` for arm `a`) of the arm gates
/// at `gates` ([`ARM_GATES`]).
pub fn gate_address(gates: u64, mask: u32) -> u64 {
    debug_assert!((1..ARM_GATES as u32).contains(&mask), "gate {mask}");
    gates + u64::from(mask) * (CTL_WORDS * 4) as u64
}

/// A status wait of [`begin`] ran out (peer = the rank whose word never came); the fault code
/// of the error word (`AFDEP_FUSED_FAULT_STATUS_WAIT`).
pub const FAULT_STATUS_WAIT: u32 = 32;

/// A gated round's start gate did not open within the bound ([`start_gate`]; peer = the rank
/// that opens it, round = the ticket waited for); the fault code of the error word
/// (`AFDEP_FUSED_FAULT_START_GATE`).
pub const FAULT_START_GATE: u32 = 34;

/// Words of the state buffer of [`check_payload`] (`AFDEP_PAYLOAD_STATE_WORDS`): the error
/// word, a block count and the smallest offence's key; all zero before the first round (the
/// kernel leaves it so after each round, but for the word).
pub const PAYLOAD_STATE_WORDS: usize = 16;

/// The kernels of this module, for [`super::fused::preload`].
pub const KERNELS: [KernelId; 5] = [
    KernelId::RoundCheckPayload,
    KernelId::RoundBegin,
    KernelId::RoundExperts,
    KernelId::RoundStamp,
    KernelId::RoundStartGate,
];

use super::fused::blocks_for as grid;

/// A source's part of [`begin`]: its attention index and route tables (each at least
/// `capacity × top_k` entries), and with fp8 payloads its [`check_payload`] state of the round.
#[derive(Debug, Clone, Copy)]
pub struct RoundSource<'a> {
    /// This rank's attention index.
    pub index: usize,
    /// `capacity × top_k` expert ids.
    pub idx: &'a CudaSlice<i32>,
    /// `capacity × top_k` weights.
    pub weight: &'a CudaSlice<f32>,
    /// fp8 payloads: the payload check's state ([`PAYLOAD_STATE_WORDS`]).
    pub payload: Option<&'a CudaSlice<u32>>,
}

/// The route rules [`begin`] checks (`afdep_core::route::RouteRules::exchange`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceRules {
    /// Expert ids must be below this.
    pub experts: u64,
    /// Expert ids must be below this to be owned.
    pub owned: u64,
    /// The arm rule's bucket: an [`arm::AUTO`] round takes count-first when its largest
    /// source's token count is at least this (`u64::MAX`: never), payload-first otherwise.
    pub bucket: u64,
}

/// The start of a device round (`afdep_round_begin`, one block, the workspace layout passed by
/// value) on rank `r.me` of `world`: round + 1 in the control block `r.ctl`; when `source` is
/// given (this rank's attention index and route tables), validation of the control block's
/// token count of routes (at most `layout.cap`); the verdict word, the token count and the arm
/// request ([`CTL_ARM_REQUEST`]) stored into every rank's status area (at `layout.status`)
/// through `r.peers`, then a bounded wait (`r.timeout_ns`) for every rank's record. Then, from
/// the records (the same on every rank): the verdict (the lowest rejecting rank's word, else
/// [`verdict::ARMS_DIFFER`] when the requests differ) and the arm ([`CTL_ARM`]: rank 0's
/// request, or for [`arm::AUTO`] count-first when the largest token count is at least
/// `rules.bucket`) in the control block, and the arm gates at `gates` ([`ARM_GATES`] ×
/// [`CTL_WORDS`] u32). A timeout records [`FAULT_STATUS_WAIT`] in `r.err`. `source.payload`: a
/// source's [`check_payload`] state of the round (fp8 payloads), whose word is the source's
/// verdict word when its routes pass.
///
/// # Safety
///
/// `r.ws` is a live workspace of layout `layout` whose control block is `r.ctl`, `r.peers` a live
/// peer table of `world` ranks (`r.me` below it) whose workspaces all have this layout, and
/// `r.err` a live error word ([the launchers' contract](crate::ops::fused#safety-of-the-launchers)).
pub unsafe fn begin(
    ctx: &GpuContext,
    r: &RankAddrs,
    world: usize,
    source: Option<&RoundSource<'_>>,
    rules: &DeviceRules,
    layout: &FusedLayout,
    gates: &mut CudaSlice<u32>,
) -> Result<(), KernelError> {
    need("arm gates", gates, ARM_GATES * CTL_WORDS)?;
    let world32 = as_u32("world", world)?;
    if world > 64 {
        return Err(KernelError::Shape(format!(
            "{world} ranks: the status area holds 64"
        )));
    }
    let me = as_u32("rank", r.me)?;
    let f = fused_function(ctx, KernelId::RoundBegin, layout.top_k)?;
    // an FFN-only rank passes no tables and no payload state: null pointers, never read
    let null = 0u64;
    let src = match source {
        Some(s) => {
            let n = layout.cap as usize * layout.top_k as usize;
            need("routes", s.idx, n)?;
            need("weights", s.weight, n)?;
            if let Some(st) = s.payload {
                need("payload check state", st, PAYLOAD_STATE_WORDS)?;
            }
            as_u32("attention index", s.index)?
        }
        None => NO_SOURCE,
    };
    let mut b = ctx.stream().launch_builder(&f);
    b.arg(&r.ws)
        .arg(&r.ctl)
        .arg(&r.peers)
        .arg(&world32)
        .arg(&me)
        .arg(&src);
    match source {
        Some(s) => b.arg(s.idx).arg(s.weight),
        None => b.arg(&null).arg(&null),
    };
    b.arg(layout)
        .arg(&rules.experts)
        .arg(&rules.owned)
        .arg(&r.timeout_ns)
        .arg(&r.err);
    match source.and_then(|s| s.payload) {
        Some(st) => b.arg(st),
        None => b.arg(&null),
    };
    b.arg(&rules.bucket).arg(gates);
    // SAFETY: afdep_round_begin(u8* ws, u32* ctl, const u64* peers, u32 world, u32 me, u32
    // src_index, const i32* idx, const float* w, afdep_fused_layout L (by value, asserted equal
    // in layout/fused.cuh; its cap and status), u64 experts, u64 owned, u64 timeout_ns, u32*
    // err, const u32* payload, u64 bucket, u32* gates), one block: reads and writes the
    // caller's live control block, reads at most min(tokens, cap) × K routes (the tables hold
    // cap × K, checked; a larger token count is rejected without reading; with src_index
    // AFDEP_NO_SOURCE the null tables are never dereferenced) and the first 6 words of the
    // payload state (checked) or none (null), writes one status record into each of the
    // `world` (<= 64, checked) workspaces of the live peer table and reads this rank's status
    // area; err is a live u32[4]; writes gates 1..ARM_GATES of `gates` (ARM_GATES × CTL_WORDS,
    // checked).
    unsafe { b.launch(grid(1, 1)) }.map_err(launch_err(KernelId::RoundBegin))?;
    Ok(())
}

/// `src_index` of an FFN-only rank in [`begin`] (`AFDEP_NO_SOURCE` in `fused_round.cu`).
const NO_SOURCE: u32 = u32::MAX;

/// A source's fp8 payload check of a device round (`afdep_round_check_payload`, the workspace
/// layout passed by value), launched just before [`begin`] on the same stream: over the control
/// block's token count (at `ctl`; none above the capacity `layout.cap`) of rows `x` (`capacity ×
/// hidden` bf16, hidden a multiple of 128) and routes `idx` (`capacity × top_k`), the first
/// non-finite value of a token with an unmasked slot (tokens, then channels, ascending) becomes
/// the [`afdep_core::RouteError::NonFinitePayload`] word (naming attention index `source`) in
/// `state` ([`PAYLOAD_STATE_WORDS`], zero before the first round), or zeros. It reads no
/// verdict (the control block still holds the previous round's). At most `blocks` blocks.
///
/// # Safety
///
/// `ctl` is a live control block ([the launchers'
/// contract](crate::ops::fused#safety-of-the-launchers)).
pub unsafe fn check_payload(
    ctx: &GpuContext,
    rows: &PayloadRows<'_>,
    ctl: u64,
    layout: &FusedLayout,
    state: &mut CudaSlice<u32>,
    blocks: u32,
) -> Result<(), KernelError> {
    let (x, idx) = (rows.x, rows.idx);
    let (capacity, hidden) = (layout.cap as usize, layout.hidden as usize);
    let top_k = layout.top_k as usize;
    if hidden % afdep_core::fp8::GROUP != 0 {
        return Err(KernelError::Shape(format!(
            "fp8 payloads need hidden a multiple of 128, not {hidden}"
        )));
    }
    need("rows", x, capacity * hidden)?;
    need("routes", idx, capacity * top_k)?;
    need("payload check state", state, PAYLOAD_STATE_WORDS)?;
    let src = as_u32("attention index", rows.source)?;
    let cap = capacity as u64;
    let f = fused_function(ctx, KernelId::RoundCheckPayload, layout.top_k)?;
    let mut b = ctx.stream().launch_builder(&f);
    b.arg(x).arg(idx).arg(&ctl).arg(layout).arg(&src).arg(state);
    // SAFETY: afdep_round_check_payload(const u16* x, const i32* idx, const u32* ctl,
    // afdep_fused_layout L (by value, asserted equal in layout/fused.cuh; its cap and hidden),
    // u32 src_index, u32* state) with K compiled in: reads the caller's live
    // control block; for a token count at most cap, warp t reads idx[t] (cap × K, checked) and
    // row t of x (cap × hidden, checked; 16-byte loads: hidden a multiple of 128, checked, in a
    // cudaMalloc'd buffer); atomics on and the last block's stores to the 16-word state
    // (checked).
    unsafe { b.launch(grid(cap, blocks)) }.map_err(launch_err(KernelId::RoundCheckPayload))?;
    Ok(())
}

/// What [`check_payload`] reads of a source: its rows and routes, and its attention index.
#[derive(Debug, Clone, Copy)]
pub struct PayloadRows<'a> {
    /// `capacity × hidden` bf16 rows.
    pub x: &'a CudaSlice<bf16>,
    /// `capacity × top_k` expert ids.
    pub idx: &'a CudaSlice<i32>,
    /// This source's attention index.
    pub source: usize,
}

/// A phase boundary of a traced round (`afdep_round_stamp`, one thread): the device's global
/// nanosecond timer (`%globaltimer`) into `stamps[slot]`, queued on the context's stream
/// between the launches it separates (captured into a graph like any launch). The timer's
/// resolution is the GPU's (about 1 µs where the driver updates it at 1 MHz, finer under a
/// profiler).
pub fn stamp(
    ctx: &GpuContext,
    stamps: &mut CudaSlice<u64>,
    slot: usize,
) -> Result<(), KernelError> {
    need("the stamp buffer", stamps, slot + 1)?;
    let s = as_u32("slot", slot)?;
    let f = fused_function(ctx, KernelId::RoundStamp, 1)?;
    let mut b = ctx.stream().launch_builder(&f);
    b.arg(stamps).arg(&s);
    // SAFETY: afdep_round_stamp(u64* stamps, u32 slot), one thread: writes stamps[slot], which
    // lies in the buffer (checked above); the buffer is borrowed for the launch and lives on
    // the context's stream.
    unsafe { b.launch(grid(1, 1)) }.map_err(launch_err(KernelId::RoundStamp))?;
    Ok(())
}

/// The start gate of a gated round (`afdep_round_start_gate`, one thread), queued on the
/// context's stream before the round's launches (or captured as a graph's first node): the
/// stream goes on once the u32 at device address `word` reaches this rank's next ticket, one
/// more than the u32 at `seen`, which the kernel then advances to it; or after `timeout_ns`,
/// when it records [`FAULT_START_GATE`] naming `opener` (and the ticket as the round) in the
/// error word at `err` and advances `seen` all the same (the round still runs; its waits are
/// bounded as always). Counting the tickets on the device lets one captured graph serve
/// every replay.
///
/// # Safety
///
/// `word` and `seen` are live u32s of this context's device, `err` a live error word (four
/// u32) of this context, all for as long as the launch (or the graph that captures it) may
/// run; no other launch writes `seen` meanwhile.
pub unsafe fn start_gate(
    ctx: &GpuContext,
    word: u64,
    seen: u64,
    timeout_ns: u64,
    err: u64,
    opener: usize,
) -> Result<(), KernelError> {
    let opener = as_u32("opener", opener)?;
    let f = fused_function(ctx, KernelId::RoundStartGate, 1)?;
    let mut b = ctx.stream().launch_builder(&f);
    b.arg(&word)
        .arg(&seen)
        .arg(&timeout_ns)
        .arg(&err)
        .arg(&opener);
    // SAFETY: afdep_round_start_gate(const u32* word, u32* seen, u64 timeout_ns, u32* err,
    // u32 opener), one thread: reads *word, reads and writes *seen, may write err[0..3]; all
    // live (the caller's contract); the argument types match the kernel's.
    unsafe { b.launch(grid(1, 1)) }.map_err(launch_err(KernelId::RoundStartGate))?;
    Ok(())
}

/// Where an FFN rank's plan and expanded rows are: the count-first areas of its workspace
/// (the layout's `plan`, `expanded`, `exp_rows` and `hidden`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlanView {
    /// This rank's workspace base.
    pub ws: u64,
    /// The workspace layout.
    pub layout: FusedLayout,
    /// Local experts.
    pub epr: usize,
    /// Sources.
    pub sources: usize,
}

/// The reproducible device expert (`afdep_round_experts`, the workspace layout passed by
/// value): for every expanded row j of the plan, `y[j] = bf16(f32(x[j]) * scale[l])` with l the
/// row's local expert (`scale` holds `epr` f32). `y` holds `exp_rows × hidden`. Nothing when the
/// round is skipped.
///
/// # Safety
///
/// `pv.ws` is a live workspace and `ctl` a live control block ([the launchers'
/// contract](crate::ops::fused#safety-of-the-launchers)); the workspace holds the plan at
/// `pv.layout.plan` for `pv.epr` experts and `pv.sources` sources, written earlier on the same
/// stream, and `pv.layout.exp_rows` expanded rows of `hidden` bf16 at `pv.layout.expanded`.
pub unsafe fn experts(
    ctx: &GpuContext,
    pv: &PlanView,
    ctl: u64,
    scale: &CudaSlice<f32>,
    y: &mut CudaSlice<bf16>,
    blocks: u32,
) -> Result<(), KernelError> {
    let exp_rows = pv.layout.exp_rows;
    need("scales", scale, pv.epr)?;
    need("y", y, exp_rows as usize * pv.layout.hidden as usize)?;
    let e = as_u32("experts per rank", pv.epr)?;
    let ns = as_u32("sources", pv.sources)?;
    let f = fused_function(ctx, KernelId::RoundExperts, 1)?;
    let mut b = ctx.stream().launch_builder(&f);
    b.arg(&pv.ws)
        .arg(&ctl)
        .arg(&pv.layout)
        .arg(&e)
        .arg(&ns)
        .arg(scale)
        .arg(y);
    // SAFETY: afdep_round_experts(const u8* ws, const u32* ctl, afdep_fused_layout L (by value,
    // asserted equal in layout/fused.cuh; its plan, expanded, exp_rows, hidden), u32 epr, u32
    // ns, const float* scale, u16* y): reads the caller's
    // live control block and the plan and expanded area of this rank's live workspace (the
    // caller's geometry), rows below min(plan rows, exp_rows); scale holds epr and y
    // exp_rows × hidden (checked).
    unsafe { b.launch(grid(exp_rows, blocks)) }.map_err(launch_err(KernelId::RoundExperts))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::ops::fused::tests::{define, define_in};

    #[test]
    fn control_block_constants_match_the_header() {
        assert_eq!(define("AFDEP_CTL_ROUND"), CTL_ROUND.to_string());
        assert_eq!(define("AFDEP_CTL_VERDICT"), CTL_VERDICT.to_string());
        assert_eq!(define("AFDEP_CTL_ROUTE"), CTL_ROUTE.to_string());
        assert_eq!(define("AFDEP_CTL_TOKENS"), CTL_TOKENS.to_string());
        assert_eq!(define("AFDEP_CTL_WORDS"), CTL_WORDS.to_string());
        assert_eq!(define("AFDEP_CTL_GO"), format!("{}u", verdict::GO));
        assert_eq!(
            define("AFDEP_CTL_REJECTED"),
            format!("{}u", verdict::REJECTED)
        );
        assert_eq!(
            define("AFDEP_CTL_FAULTED"),
            format!("{}u", verdict::FAULTED)
        );
        assert_eq!(define("AFDEP_STATUS_WORDS"), STATUS_WORDS.to_string());
        assert_eq!(define("AFDEP_STATUS_TOKENS"), "6");
        assert_eq!(define("AFDEP_STATUS_REQUEST"), "7");
        assert_eq!(define("AFDEP_CTL_ARM_REQUEST"), CTL_ARM_REQUEST.to_string());
        assert_eq!(define("AFDEP_CTL_ARM"), CTL_ARM.to_string());
        assert_eq!(define("AFDEP_ARM_GATES"), ARM_GATES.to_string());
        assert_eq!(
            define("AFDEP_CTL_ARMS_DIFFER"),
            format!("{}u", verdict::ARMS_DIFFER)
        );
        assert_eq!(
            define("AFDEP_CTL_ARM_OFF"),
            format!("{}u", verdict::ARM_OFF)
        );
        for (name, code) in [
            ("AFDEP_ARM_PAYLOAD_FIRST", arm::PAYLOAD_FIRST),
            ("AFDEP_ARM_COUNT_FIRST", arm::COUNT_FIRST),
            ("AFDEP_ARM_SOURCE", arm::SOURCE),
            ("AFDEP_ARM_AUTO", arm::AUTO),
        ] {
            assert_eq!(define(name), format!("{code}u"), "{name}");
        }
        // the token count and the request are written together, by one copy
        const { assert!(CTL_ARM_REQUEST == CTL_TOKENS + 1 && CTL_ARM < CTL_WORDS) };
        // a gate holds a control block's round, verdict and tokens; every set of the 3 arms has one
        const { assert!(ARM_GATES == 1 << 3) };
        assert_eq!(gate_address(1000, 6), 1000 + 6 * 64);
        assert_eq!(
            define("AFDEP_FUSED_FAULT_STATUS_WAIT"),
            format!("{FAULT_STATUS_WAIT}u")
        );
        assert_eq!(
            define("AFDEP_FUSED_FAULT_START_GATE"),
            format!("{FAULT_START_GATE}u")
        );
        const { assert!(CTL_ROUTE + afdep_core::error::ROUTE_ERROR_WORDS <= CTL_TOKENS) };
    }

    /// The payload check's state layout (`fused_round.cu`): the error word first, then the
    /// block count, then the 8-byte aligned key, within [`PAYLOAD_STATE_WORDS`].
    #[test]
    fn payload_state_constants_match_the_kernel() {
        let text = include_str!("../../cuda/fused_round.cu");
        let def = |name: &str| -> usize { define_in(text, name).parse().unwrap() };
        assert_eq!(
            define_in(
                include_str!("../../cuda/phase/begin.cuh"),
                "AFDEP_NO_SOURCE"
            ),
            format!("{NO_SOURCE:#x}u")
        );
        assert_eq!(def("AFDEP_PAYLOAD_STATE_WORDS"), PAYLOAD_STATE_WORDS);
        let (done, key) = (
            def("AFDEP_PAYLOAD_DONE_WORD"),
            def("AFDEP_PAYLOAD_KEY_WORD"),
        );
        assert!(done >= afdep_core::error::ROUTE_ERROR_WORDS);
        assert!(key > done && key % 2 == 0 && key + 2 <= PAYLOAD_STATE_WORDS);
    }
}
