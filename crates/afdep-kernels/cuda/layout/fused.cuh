// The fused (payload-first) exchange: the layout of one slab row and the device error word.
// The host side is afdep_kernels::ops::fused (SLAB_META_WORDS, fault codes) and
// afdep_moe::fused (the workspace offsets); a host test checks the constants agree.
//
// A slab row, in the FFN rank's workspace (per-source slabs): the payload, then the metadata,
// each part 16-byte aligned:
//   [ hidden bf16 payload | pad to 16 B ][ meta: u32 token, u32 0, i32 local_id[K],
//     f32 weight[K], u64 expanded_row[K] | pad to 16 B ]
// local_id is -1 for a slot masked or owned by another FFN rank (weight 0, row ~0).
// With fp8 payloads (AFDEP_PAYLOAD_FP8) the payload part is the e4m3 codes and the scales:
//   [ hidden u8 codes | pad to 16 B ][ hidden/128 f32 scales | pad to 16 B ][ meta ... ]
// (afdep_kernels::ops::fused::slab_payload_bytes; the quantisation is common/fp8.cuh).
#pragma once

#include "common/fault.cuh"
#include "common/ptx.cuh"
#include "common/types.cuh"

// u32 words of the metadata of a row for top-k K: 2 + K + K + 2K.
#define AFDEP_FUSED_META_WORDS(K) (2 + 4 * (K))
// An expanded row that does not exist (u64::MAX).
#define AFDEP_FUSED_NO_ROW 0xffffffffffffffffull

// Fault codes of the error word u32[4] = {code, peer rank, round, 0} (first fault wins). A wait
// for the dispatch flags takes its code as an argument: the host passes
// AFDEP_FUSED_FAULT_DISPATCH_WAIT (afdep_kernels::ops::fused::fault::DISPATCH_WAIT) for the
// plan's payload-first wait (phase/counts.cuh).
#define AFDEP_FUSED_FAULT_DISPATCH_WAIT 1u
#define AFDEP_FUSED_FAULT_COMBINE_WAIT 2u

static __device__ __forceinline__ u64 afdep_align16(u64 v) { return (v + 15) & ~15ull; }

// ---------------------------------------------------------------------------------------------
// The workspace layout, by value: afdep_kernels::ops::fused_layout::FusedLayout (#[repr(C)],
// computed once on the host from the exchange config). The fields in the same order with the
// same types; the asserts pin the size (no padding: every offset follows from the order) and
// the alignment, and the host test `the_device_struct_matches` compares the fields, their
// offsets and the asserted size with Rust's (NVRTC has no offsetof).
struct afdep_fused_layout {
    u64 slab_off;
    u64 row_bytes;
    u64 meta_off;
    u64 ret_off;
    u64 ret_row_bytes;
    u64 count_flags;
    u64 offset_flags;
    u64 counts;
    u64 offsets;
    u64 plan;
    u64 row_flags;
    u64 expanded;
    u64 exp_q;
    u64 exp_scales;
    u64 exp_rows;
    u64 status;
    u64 bytes;
    u32 cap;
    u32 hidden;
    u32 top_k;
    u32 payload;
    u32 partials;
    u32 reserved;
};
static_assert(sizeof(afdep_fused_layout) == 160, "FusedLayout's size: no padding");
static_assert(alignof(afdep_fused_layout) == 8, "FusedLayout's alignment");

// Payload kinds, a compile-time constant of the dispatch and epilogue kernels
// (afdep_core::PayloadKind).
#define AFDEP_PAYLOAD_BF16 0
#define AFDEP_PAYLOAD_FP8 1

// How the combine's partials travel (afdep_core::CombinePartials; the layout's partials field,
// by which the launchers pick the combine's entries, fused_combine.cu): hidden f32 per return
// row, or hidden bf16 (rounded to nearest even on the FFN rank, widened exactly on the source).
// L.ret_row_bytes is the row's size either way.
#define AFDEP_PARTIALS_F32 0
#define AFDEP_PARTIALS_BF16 1

// Records a fault (the first one wins).
static __device__ __forceinline__ void afdep_fused_fault(u32* err, u32 code, u32 peer, u32 round) {
    if (atomicCAS(err, 0u, code) == 0u) {
        err[1] = peer;
        err[2] = round;
        __threadfence_system();
    }
}

// Copies `bytes` bytes (a multiple of 2, below 2^32) from src to dst with one warp: 16-byte
// vectors when both are 16-byte aligned and bytes is a multiple of 16, 2-byte elements
// otherwise.
static __device__ __forceinline__ void afdep_warp_copy(void* dst, const void* src, u32 bytes,
                                                       u32 lane) {
    if ((bytes & 15u) == 0 && afdep_aligned16(dst) && afdep_aligned16(src)) {
        const uint4* s = (const uint4*)src;
        uint4* d = (uint4*)dst;
        const u32 n = bytes >> 4;
#pragma unroll 1
        for (u32 v = lane; v < n; v += 32) d[v] = s[v];
    } else {
        const u16* s = (const u16*)src;
        u16* d = (u16*)dst;
        const u32 n = bytes >> 1;
#pragma unroll 1
        for (u32 v = lane; v < n; v += 32) d[v] = s[v];
    }
}

// ---------------------------------------------------------------------------------------------
// Count-first (fused_counts.cu, fused_cf_dispatch.cu, fused_stream_epilogue.cu). The host side
// is afdep_kernels::ops::fused_cf and afdep_moe::fused_cf (the area offsets, CfGeometry).
//
// The count-first area of every workspace (byte offsets from its start `cf`, the same on every
// rank; every count and offset a u64):
//   cf + 0      count flags   u32[64]  by source rank: its counts of this round are here
//   cf + 256    offset flags  u32[64]  by FFN rank: its offsets for this source are here
//   counts      u64[world][epr + 1]    by source rank: rows per local expert l < epr of this
//                                      FFN rank, then the source's distinct tokens for it
//   offsets     u64[world][epr]        by FFN rank: this source's block start per local expert
//   plan        u64: counts[epr][ns] (expert-major), block_starts[epr][ns], expert_offsets[epr
//               + 1], slab_offsets[ns + 1]: afdep_core::layout::FfnPlan's numbers
//   row flags   u32[world][cap]        by (source rank, slab row): streaming readiness
//   expanded    bf16[rows_max][hidden] this FFN rank's expanded layout (rows_max = sources ×
//               cap × min(K, epr)), 256-byte aligned (fp8: the dequantised rows)
//   exp codes   fp8 only: u8[rows_max][hidden], then exp scales f32[rows_max][hidden / 128],
//               each 256-byte aligned (CfAreas::exp_q, exp_scales)
// Count-first slab rows use the payload-first row format of the payload kind (fp8: codes and
// scales, then the metadata; the source arm's hold the metadata only); their expanded_row[k]
// holds the final expanded row (source arm) or the slot's position in its (expert, source)
// block (streaming: the epilogue adds the block start).

// Fault codes of the count-first waits (from 16, apart from the payload-first ones).
#define AFDEP_FUSED_FAULT_COUNTS_WAIT 16u
#define AFDEP_FUSED_FAULT_OFFSETS_WAIT 17u
#define AFDEP_FUSED_FAULT_ROW_WAIT 18u
#define AFDEP_FUSED_FAULT_SOURCE_WAIT 19u

// Whether an error word already holds a fault (a waiter's cue to leave early).
static __device__ __forceinline__ bool afdep_fused_faulted(const u32* err) {
    return *(const volatile u32*)err != 0u;
}

// One thread: waits (bounded: at most timeout_ns each) for flag ranks[i] at flag_off of
// workspace ws to reach `round`, for every i < n in order; a wait that runs out records `code`
// naming that rank and returns false.
static __device__ __forceinline__ bool afdep_wait_flags(const u8* ws, u64 flag_off,
                                                        const u32* __restrict__ ranks, u32 n,
                                                        u32 round, u64 timeout_ns, u32* err,
                                                        u32 code) {
    for (u32 i = 0; i < n; i++) {
        const u32* flag = (const u32*)(ws + flag_off + 4ull * ranks[i]);
        if (!afdep_wait_ge(flag, round, timeout_ns)) {
            afdep_fused_fault(err, code, ranks[i], round);
            return false;
        }
    }
    return true;
}

// The waits of afdep_wait_flags by the 32 lanes of one warp at once (every lane calls it; lane
// j waits for ranks[j], ranks[j + 32], ...): the flags are awaited concurrently, so the wait
// costs one handoff's latency instead of n in a row. Every lane gets whether all were reached;
// when some ran out, lane 0 records `code` naming the lowest i among them (the rank
// afdep_wait_flags names when the earlier flags arrive).
static __device__ __forceinline__ bool afdep_wait_flags_warp(const u8* ws, u64 flag_off,
                                                             const u32* __restrict__ ranks,
                                                             u32 n, u32 round, u64 timeout_ns,
                                                             u32* err, u32 code) {
    const u32 lane = afdep_lane();
    u32 bad = n;
    for (u32 i = lane; i < n; i += 32) {
        const u32* flag = (const u32*)(ws + flag_off + 4ull * ranks[i]);
        if (!afdep_wait_ge(flag, round, timeout_ns)) {
            bad = i;
            break;
        }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const u32 other = __shfl_xor_sync(0xffffffffu, bad, o);
        bad = other < bad ? other : bad;
    }
    if (bad < n && lane == 0) afdep_fused_fault(err, code, ranks[bad], round);
    return bad >= n;
}

// ---------------------------------------------------------------------------------------------
// The round control block (fused_round.cu; host side afdep_kernels::ops::fused_round and
// afdep_moe::fused): u32[16] in every rank's own workspace. Every fused kernel that waits for or
// raises a flag reads the round number from it, and every kernel of a round returns at once when
// the verdict is not AFDEP_CTL_GO, so a round needs no round number or token count from the host
// (a captured CUDA graph replays with the values of the moment).
//   ctl[0]  round     incremented once per round on the device (afdep_round_begin), never
//                     by the host
//   ctl[1]  verdict   AFDEP_CTL_GO, AFDEP_CTL_REJECTED (some source's route was rejected: every
//                     rank skips the data phases), AFDEP_CTL_FAULTED (a status wait ran out),
//                     AFDEP_CTL_ARMS_DIFFER (ranks asked for different arms: skipped too)
//   ctl[2]  route     u32[6]: the route error word (layout/route_error.cuh) of the lowest
//                     rejecting rank when rejected
//   ctl[8]  tokens    this source's token count of the round (written by the host before the
//                     round; a graph's replays read the value of the moment)
//   ctl[9]  request   the dispatch arm this rank asks for (written by the host before the round,
//                     like tokens): AFDEP_ARM_* or AFDEP_ARM_AUTO (the token-bucket rule)
//   ctl[10] arm       the arm the round takes (afdep_round_begin: the same on every rank)
//   ctl[11] ticket    the blocks of the running kernel that are done (afdep_last_block): zero
//                     between kernels (reset by the last block, and by afdep_round_begin in
//                     the control block and every arm gate)
//   ctl[12..15)       a front's in-grid handoffs (fused_front.cu): begun, ready and the exit
//                     ticket; zero between kernels (reset by the front's last block)
// With verdict AFDEP_CTL_ARMS_DIFFER (ranks asked for different arms; every rank skips the
// round), ctl[2..5) hold {the lowest rank whose request differs from rank 0's, rank 0's
// request, that rank's request} instead of a route word.
#define AFDEP_CTL_ROUND 0
#define AFDEP_CTL_VERDICT 1
#define AFDEP_CTL_ROUTE 2
#define AFDEP_CTL_TOKENS 8
#define AFDEP_CTL_ARM_REQUEST 9
#define AFDEP_CTL_ARM 10
#define AFDEP_CTL_TICKET 11
#define AFDEP_CTL_FRONT_BEGUN 12
#define AFDEP_CTL_FRONT_READY 13
#define AFDEP_CTL_FRONT_EXIT 14
#define AFDEP_CTL_WORDS 16
#define AFDEP_CTL_GO 0u
#define AFDEP_CTL_REJECTED 1u
#define AFDEP_CTL_FAULTED 2u
#define AFDEP_CTL_ARMS_DIFFER 3u
// Only in an arm gate (below): the round runs another arm.
#define AFDEP_CTL_ARM_OFF 4u
// The dispatch arms (afdep_moe::DispatchArm) and the request for the rule: count-first
// (streaming) when the largest source's token count of the round reaches the bucket,
// payload-first below it.
#define AFDEP_ARM_PAYLOAD_FIRST 0u
#define AFDEP_ARM_COUNT_FIRST 1u
#define AFDEP_ARM_SOURCE 2u
#define AFDEP_ARM_AUTO 3u
// The arm gates of a device round (afdep_round_begin): u32[8][AFDEP_CTL_WORDS], a copy of the
// control block's round, verdict and tokens per set of arms m (bit a: arm a, 1 <= m < 8), whose
// verdict is AFDEP_CTL_ARM_OFF when the round's arm is not in m. A kernel launched with gate m
// as its control block runs only for the arms of m (afdep_ctl_skip): one graph holds every
// arm's kernels, and those of the arms not taken return at once.
#define AFDEP_ARM_GATES 8
// The status area (afdep_round_begin): u32[2][64][16] by (round parity, rank): the route error
// word (6 words), this rank's token count, its arm request, 0 ..., then the round (the flag,
// release) in the last word.
#define AFDEP_STATUS_WORDS 16
#define AFDEP_STATUS_TOKENS 6
#define AFDEP_STATUS_REQUEST 7
// A status wait ran out (peer = the rank whose status never came).
#define AFDEP_FUSED_FAULT_STATUS_WAIT 32u
// A block of a front (fused_front.cu) waited for its own grid too long (peer = this rank).
#define AFDEP_FUSED_FAULT_FRONT_WAIT 33u
// A gated round's start gate did not open in time (peer = the rank that opens it).
#define AFDEP_FUSED_FAULT_START_GATE 34u

// The round number of the round in flight.
static __device__ __forceinline__ u32 afdep_ctl_round(const u32* ctl) {
    return *(const volatile u32*)(ctl + AFDEP_CTL_ROUND);
}
// Whether this round's data phases are skipped (a rejected route somewhere, a fault, ranks that
// asked for different arms; in an arm gate also: the round takes an arm outside the gate's).
static __device__ __forceinline__ bool afdep_ctl_skip(const u32* ctl) {
    return *(const volatile u32*)(ctl + AFDEP_CTL_VERDICT) != AFDEP_CTL_GO;
}
// The arm the round takes (afdep_round_begin; only in the control block, not in an arm gate):
// what a kernel launched for every arm at once (an Auto round's one launch per phase) branches on.
static __device__ __forceinline__ u32 afdep_ctl_arm(const u32* ctl) {
    return *(const volatile u32*)(ctl + AFDEP_CTL_ARM);
}
// This source's token count of the round.
static __device__ __forceinline__ u64 afdep_ctl_tokens(const u32* ctl) {
    return *(const volatile u32*)(ctl + AFDEP_CTL_TOKENS);
}

// Whether this block is the last of its grid to get here (every thread of the block gets the
// same answer; every block of the grid must call it once, after its last store of the phase).
// Each block fences its stores at system scope and takes a ticket from the control block `ctl`
// (the one the kernel was launched with: the control block or an arm gate; AFDEP_CTL_TICKET),
// so the last block sees every block's stores and may raise the flag that publishes them (the
// work of a separate signal kernel, one launch less). The last block resets the ticket.
// The ticket itself (one thread of the block, after the block's stores): a system fence, then
// a ticket from ctl's AFDEP_CTL_TICKET; true for the grid's last block, which resets it (the
// next kernel on the stream sees the reset: kernel boundaries order it).
static __device__ __forceinline__ bool afdep_take_ticket(const u32* ctl) {
    __threadfence_system();
    u32* ticket = (u32*)ctl + AFDEP_CTL_TICKET;
    if (atomicAdd(ticket, 1u) != gridDim.x - 1) return false;
    *(volatile u32*)ticket = 0u;
    return true;
}

static __device__ __forceinline__ bool afdep_last_block(const u32* ctl) {
    __shared__ u32 last;
    __syncthreads();
    if (threadIdx.x == 0) last = afdep_take_ticket(ctl) ? 1u : 0u;
    __syncthreads();
    return last != 0u;
}

// Raises flag `me` at flag_off of workspace peers[ranks[i]] to `round` for every i < n (thread
// 0 of the calling block, after a system fence: one fence, then strong stores, a release
// pattern per flag at system scope). The tail of a kernel whose last block (afdep_last_block)
// publishes the grid's stores; a fault point that delays the flags goes before it.
static __device__ __forceinline__ void afdep_raise_flags(const u64* __restrict__ peers,
                                                         const u32* __restrict__ ranks, u32 n,
                                                         u64 flag_off, u32 me, u32 round) {
    if (threadIdx.x != 0) return;
    __threadfence_system();
#pragma unroll 1
    for (u32 i = 0; i < n; i++)
        afdep_st_relaxed_sys((u32*)((u8*)peers[ranks[i]] + flag_off + 4ull * me), round);
}

// The signal of a kernel's last block: flag `me` at flag_off in the workspaces of ranks[0..n)
// raised to the round of ctl. Kept in shared memory by thread 0 at the kernel's start
// (afdep_signal_keep) and read back there by the tail (afdep_signal_last, afdep_signal_raise):
// the row loop between them keeps its registers (holding these across it made some loops
// spill).
struct AfdepSignal {
    const u32* ctl;
    const u64* peers;
    const u32* ranks;
    u64 flag_off;
    u32 n;
    u32 me;
};

// Thread 0 keeps the signal of the kernel in `sig` (shared).
static __device__ __forceinline__ void afdep_signal_keep(AfdepSignal* sig, const u32* ctl,
                                                         const u64* peers, const u32* ranks,
                                                         u32 n, u64 flag_off, u32 me) {
    if (threadIdx.x == 0) *sig = AfdepSignal{ctl, peers, ranks, flag_off, n, me};
}

// The signal tail of a kernel (every block calls it once, after its last store of the phase):
// true in thread 0 of the grid's last block, which then raises the signal kept in `sig`
// (afdep_signal_raise; the kernel's file puts the fault point AFDEP_FAULT_LATE_SIGNAL between
// the two). afdep_last_block's ticket, taken and acted on by thread 0 alone (nothing to
// broadcast to the block).
static __device__ __forceinline__ bool afdep_signal_last(const AfdepSignal* sig) {
    __syncthreads();
    if (threadIdx.x != 0) return false;
    return afdep_take_ticket(((const volatile AfdepSignal*)sig)->ctl);
}

// Raises the signal kept in `sig` (thread 0 of the last block, after afdep_signal_last).
static __device__ __forceinline__ void afdep_signal_raise(const AfdepSignal* sig) {
    const volatile AfdepSignal* v = sig;
    afdep_raise_flags(v->peers, v->ranks, v->n, v->flag_off, v->me, afdep_ctl_round(v->ctl));
}
