// The fronts of a device round (afdep_moe::fused::device_round): for a rank that is a source or
// an FFN rank but not both, the launches from the round's start to its rows in one kernel each,
// the phases handed off inside the grid instead of at kernel boundaries (each kernel boundary
// of a CUDA graph costs a dependent launch on the round's critical chain).
//
// afdep_source_front (a source): block 0 runs the round's start (phase/begin.cuh: validation,
// the status all-gather, the verdict and the arm) and then raises the control block's
// AFDEP_CTL_FRONT_BEGUN word; every block waits for it and, unless the round is skipped,
// counts (phase/counts.cuh, afdep_counts_rows); the grid's last block (afdep_last_block)
// publishes the counts and raises AFDEP_CTL_FRONT_READY; every block waits for that and stores
// the rows (phase/cf_dispatch.cuh) in the mode `mode` (AFDEP_CF_AUTO: the round's arm).
// afdep_ffn_front (an FFN rank): block 0 runs the round's start and the plan (phase/counts.cuh,
// afdep_plan_block, with its `pre` wait), then raises AFDEP_CTL_FRONT_BEGUN; every block waits
// for it and runs the streaming epilogue (phase/stream_epilogue.cuh, `by_arm` as given).
// Then every block takes an exit ticket (AFDEP_CTL_FRONT_EXIT); the last one resets the three
// words, so the next launch on the stream starts from zeros.
//
// The in-grid waits are bounded: a block that waits longer than the phases before could take
// (every wait inside them is bounded by timeout_ns, fewer than 3 world of them) records
// AFDEP_FUSED_FAULT_FRONT_WAIT and does no data phase; the round's verdict reports it (its
// round word may name the round before, when block 0 had not started the round yet). The
// source front's READY needs every block's counts ticket while the blocks that took theirs
// wait, so its grid must be resident at once, as a cooperative launch's (at most the transport
// SM budget of small blocks: several fit on one SM); should it not be, the waiters' bound runs
// out into that fault, never a hang. The FFN front's waiters need only block 0.

#include "common/fp8.cuh"
#include "common/probe.cuh"
#include "common/ptx.cuh"
#include "common/types.cuh"
#include "layout/fused.cuh"
#include "layout/route_check.cuh"

#ifndef AFDEP_TOP_K
#error "fused_front.cu needs AFDEP_TOP_K"
#endif
#define K AFDEP_TOP_K

#include "phase/begin.cuh"
#include "phase/cf_dispatch.cuh"
#include "phase/counts.cuh"
#include "phase/stream_epilogue.cuh"

// Thread 0 of the calling block waits (bounded) until control word `word` is nonzero
// (acquire); every thread gets whether it came. A wait that runs out records
// AFDEP_FUSED_FAULT_FRONT_WAIT naming `me`.
static __device__ __forceinline__ bool afdep_front_wait(u32* ctl, u32 word, u64 bound_ns,
                                                        u32* err, u32 me) {
    __shared__ u32 came;
    __syncthreads();  // every thread has read the previous wait's answer
    if (threadIdx.x == 0) {
        came = afdep_wait_ge(ctl + word, 1u, bound_ns) ? 1u : 0u;
        if (!came) afdep_fused_fault(err, AFDEP_FUSED_FAULT_FRONT_WAIT, me, afdep_ctl_round(ctl));
    }
    __syncthreads();
    return came != 0u;
}

// Thread 0 of the calling block (after the block's stores): a fence, then control word `word`
// raised to 1 (release).
static __device__ __forceinline__ void afdep_front_raise(u32* ctl, u32 word) {
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence_system();
        afdep_st_release_sys(ctl + word, 1u);
    }
}

// Every block once, last: the grid's last block resets the front's words.
static __device__ __forceinline__ void afdep_front_exit(u32* ctl) {
    __syncthreads();
    if (threadIdx.x != 0) return;
    if (atomicAdd(ctl + AFDEP_CTL_FRONT_EXIT, 1u) != gridDim.x - 1) return;
    AFDEP_PROBE_AT(AFDEP_PROBE_FRONT_OUT);
    ctl[AFDEP_CTL_FRONT_BEGUN] = 0u;
    ctl[AFDEP_CTL_FRONT_READY] = 0u;
    *(volatile u32*)(ctl + AFDEP_CTL_FRONT_EXIT) = 0u;
}

// How long a front's block waits for its grid: longer than every bounded wait before it (the
// start's world status waits, the plan's and the counts' at most 2 (world - 1) flag waits, each
// at most timeout_ns).
static __device__ __forceinline__ u64 afdep_front_bound(u64 timeout_ns, u32 world) {
    const u64 n = 3ull * world + 4ull;
    return timeout_ns > ~0ull / n ? ~0ull : timeout_ns * n;  // saturating
}

// The begin parameters shared by both fronts (afdep_round_begin's, phase/begin.cuh).
#define AFDEP_FRONT_BEGIN_PARAMS                                                                  \
    u8 *ws, u32 *ctl, const u64 *__restrict__ peers, u32 world, u32 me,                          \
        const afdep_fused_layout L, u64 experts, u64 owned, u64 timeout_ns, u32 *err, u64 bucket, \
        u32 *__restrict__ gates

// src_index, idx, w, payload: begin's; x, slot_pos, tok_row, counts, ffn_rank, nf, epr: the
// counts' and the rows' (fused_counts.cu, fused_cf_dispatch.cu); mode, gate, sig_off: the rows'.
template <int PAYLOAD>
static __device__ __forceinline__ void afdep_source_front_grid(
    AFDEP_FRONT_BEGIN_PARAMS, u32 src_index, const u16* __restrict__ x,
    const i32* __restrict__ idx, const float* __restrict__ w, const u32* payload,
    u32* __restrict__ slot_pos, u32* __restrict__ tok_row, u64* counts,
    const u32* __restrict__ ffn_rank, u32 nf, u32 epr, u32 mode, u32 gate, u64 sig_off) {
    if (blockIdx.x == 0) {
        if (threadIdx.x == 0) AFDEP_PROBE_AT(AFDEP_PROBE_FRONT_IN);
        afdep_begin_block(ws, ctl, peers, world, me, src_index, idx, w, L, experts, owned,
                          timeout_ns, err, payload, bucket, gates);
        afdep_front_raise(ctl, AFDEP_CTL_FRONT_BEGUN);
    }
    const u64 bound = afdep_front_bound(timeout_ns, world);
    if (afdep_front_wait(ctl, AFDEP_CTL_FRONT_BEGUN, bound, err, me) && !afdep_ctl_skip(ctl)) {
        afdep_counts_rows(idx, ctl, nf, epr, slot_pos, tok_row, counts);
        if (afdep_last_block(ctl)) {
            afdep_counts_publish(ctl, nf, epr, counts, peers, ffn_rank, L, me);
            afdep_front_raise(ctl, AFDEP_CTL_FRONT_READY);
        }
        if (afdep_front_wait(ctl, AFDEP_CTL_FRONT_READY, bound, err, me)) {
            afdep_cf_dispatch_rows<PAYLOAD>(AFDEP_CF_DISPATCH_ARGS);
        }
    }
    afdep_front_exit(ctl);
}

#define AFDEP_SOURCE_FRONT_PARAMS                                                                 \
    AFDEP_FRONT_BEGIN_PARAMS, u32 src_index, const u16 *__restrict__ x,                          \
        const i32 *__restrict__ idx, const float *__restrict__ w, const u32 *payload,            \
        u32 *__restrict__ slot_pos, u32 *__restrict__ tok_row, u64 *counts,                      \
        const u32 *__restrict__ ffn_rank, u32 nf, u32 epr, u32 mode, u32 gate, u64 sig_off
#define AFDEP_SOURCE_FRONT_ARGS                                                                   \
    ws, ctl, peers, world, me, L, experts, owned, timeout_ns, err, bucket, gates, src_index, x,  \
        idx, w, payload, slot_pos, tok_row, counts, ffn_rank, nf, epr, mode, gate, sig_off

// bf16 rows. At most one block per SM is asked for, as for afdep_cf_dispatch.
extern "C" __global__ void __launch_bounds__(AFDEP_BLOCK, 1)
    afdep_source_front(AFDEP_SOURCE_FRONT_PARAMS) {
    AFDEP_GRID_DEPENDENCY_SYNC();
    afdep_source_front_grid<AFDEP_PAYLOAD_BF16>(AFDEP_SOURCE_FRONT_ARGS);
}

// fp8 rows (afdep_cf_dispatch_fp8's).
extern "C" __global__ void __launch_bounds__(AFDEP_BLOCK, 1)
    afdep_source_front_fp8(AFDEP_SOURCE_FRONT_PARAMS) {
    AFDEP_GRID_DEPENDENCY_SYNC();
    afdep_source_front_grid<AFDEP_PAYLOAD_FP8>(AFDEP_SOURCE_FRONT_ARGS);
}

// src_rank, ns: the sources; pre, pre_off, pre_code: the plan's wait (fused_counts.cu);
// warps_per_unit, min_rows, by_arm, src_flag_off, src_code: the epilogue's
// (fused_stream_epilogue.cu).
template <int PAYLOAD>
static __device__ __forceinline__ void afdep_ffn_front_grid(
    AFDEP_FRONT_BEGIN_PARAMS, const u32* __restrict__ src_rank, u32 ns, u32 epr, u32 pre,
    u64 pre_off, u32 pre_code, u32 warps_per_unit, u32 min_rows, u32 by_arm, u64 src_flag_off,
    u32 src_code) {
    if (blockIdx.x == 0) {
        if (threadIdx.x == 0) AFDEP_PROBE_AT(AFDEP_PROBE_FRONT_IN);
        afdep_begin_block(ws, ctl, peers, world, me, AFDEP_NO_SOURCE, nullptr, nullptr, L,
                          experts, owned, timeout_ns, err, nullptr, bucket, gates);
        __syncthreads();  // thread 0 wrote the control block
        afdep_plan_block(ws, peers, src_rank, ns, epr, L, me, ctl, timeout_ns, err, pre, pre_off,
                         pre_code);
        afdep_front_raise(ctl, AFDEP_CTL_FRONT_BEGUN);
    }
    const u64 bound = afdep_front_bound(timeout_ns, world);
    if (afdep_front_wait(ctl, AFDEP_CTL_FRONT_BEGUN, bound, err, me)) {
        afdep_cf_stream_rows<PAYLOAD>(AFDEP_CF_STREAM_ARGS);
    }
    afdep_front_exit(ctl);
}

#define AFDEP_FFN_FRONT_PARAMS                                                                    \
    AFDEP_FRONT_BEGIN_PARAMS, const u32 *__restrict__ src_rank, u32 ns, u32 epr, u32 pre,        \
        u64 pre_off, u32 pre_code, u32 warps_per_unit, u32 min_rows, u32 by_arm,                 \
        u64 src_flag_off, u32 src_code
#define AFDEP_FFN_FRONT_ARGS                                                                      \
    ws, ctl, peers, world, me, L, experts, owned, timeout_ns, err, bucket, gates, src_rank, ns,  \
        epr, pre, pre_off, pre_code, warps_per_unit, min_rows, by_arm, src_flag_off, src_code

// bf16 rows.
extern "C" __global__ void __launch_bounds__(AFDEP_BLOCK)
    afdep_ffn_front(AFDEP_FFN_FRONT_PARAMS) {
    AFDEP_GRID_DEPENDENCY_SYNC();
    afdep_ffn_front_grid<AFDEP_PAYLOAD_BF16>(AFDEP_FFN_FRONT_ARGS);
}

// fp8 rows (afdep_cf_stream_epilogue_fp8's).
extern "C" __global__ void __launch_bounds__(AFDEP_BLOCK)
    afdep_ffn_front_fp8(AFDEP_FFN_FRONT_PARAMS) {
    AFDEP_GRID_DEPENDENCY_SYNC();
    afdep_ffn_front_grid<AFDEP_PAYLOAD_FP8>(AFDEP_FFN_FRONT_ARGS);
}
