// Count-first dispatch, the count and offset phases (layout/fused.cuh, count-first area).
//
// Source side: afdep_cf_counts computes, from this source's routes on the device, every slot's
// position in its (expert, source) block, every (token, FFN rank)'s row in this source's slab
// there (the compact view's row), the rows per owned expert and the distinct tokens per FFN
// rank (afdep_core::layout::SourceCounts and block_positions), and its last block stores each
// FFN rank's share into that rank's counts area and raises this source's count flag.
// FFN side: afdep_cf_plan waits (bounded) for every source's count flag, computes the plan
// (FfnPlan: expert offsets, block starts, slab offsets; 64-bit prefix sums) into its own
// workspace and publishes each source's block starts into the source's offsets area, then
// raises its offset flag there. afdep_cf_wait is a bounded wait for a set of flags.
// Specialised by AFDEP_TOP_K.

#include "common/probe.cuh"
#include "common/ptx.cuh"
#include "common/types.cuh"
#include "layout/fused.cuh"

#ifndef AFDEP_TOP_K
#error "fused_counts.cu needs AFDEP_TOP_K"
#endif
#define K AFDEP_TOP_K

#include "phase/counts.cuh"

// The counts of a source: afdep_counts_rows on every block, then the grid's last block
// (afdep_last_block) publishes them (afdep_counts_publish; phase/counts.cuh).
extern "C" __global__ void __launch_bounds__(AFDEP_BLOCK)
    afdep_cf_counts(const i32* __restrict__ idx, const u32* ctl, u32 nf, u32 epr,
                    u32* __restrict__ slot_pos, u32* __restrict__ tok_row, u64* counts,
                    const u64* __restrict__ peers, const u32* __restrict__ ffn_rank,
                    const afdep_fused_layout L, u32 me) {
    AFDEP_GRID_DEPENDENCY_SYNC();
    if (afdep_ctl_skip(ctl)) return;
    if (blockIdx.x == 0 && threadIdx.x == 0) AFDEP_PROBE_AT(AFDEP_PROBE_COUNTS_IN);
    afdep_counts_rows(idx, ctl, nf, epr, slot_pos, tok_row, counts);
    if (!afdep_last_block(ctl)) return;
    afdep_counts_publish(ctl, nf, epr, counts, peers, ffn_rank, L, me);
}

// One block: afdep_plan_block (phase/counts.cuh).
extern "C" __global__ void __launch_bounds__(AFDEP_BLOCK)
    afdep_cf_plan(u8* ws, const u64* __restrict__ peers, const u32* __restrict__ src_rank,
                  u32 ns, u32 epr, const afdep_fused_layout L, u32 me, const u32* ctl,
                  u64 timeout_ns, u32* err, u32 pre, u64 pre_off, u32 pre_code) {
    AFDEP_GRID_DEPENDENCY_SYNC();
    afdep_plan_block(ws, peers, src_rank, ns, epr, L, me, ctl, timeout_ns, err, pre, pre_off,
                     pre_code);
}

// One thread: waits for flag ranks[i] at flag_off of this rank's workspace ws (>= the round of
// the control block ctl; nothing when the round is skipped), at
// most timeout_ns each) for every i < n; a timeout records `code` naming that rank. Returns at
// once when the error word already holds a fault.
extern "C" __global__ void __launch_bounds__(AFDEP_BLOCK)
    afdep_cf_wait(const u8* ws, const u32* __restrict__ ranks, u32 n, u64 flag_off,
                  const u32* ctl, u64 timeout_ns, u32* err, u32 code) {
    AFDEP_GRID_DEPENDENCY_SYNC();
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    if (afdep_ctl_skip(ctl)) return;
    const u32 round = afdep_ctl_round(ctl);
    if (afdep_fused_faulted(err)) return;  // an earlier wait of this round already ran out
    AFDEP_FAULT_SKIP(AFDEP_FAULT_SKIP_DISPATCH_WAIT)
    afdep_wait_flags(ws, flag_off, ranks, n, round, timeout_ns, err, code);
}
