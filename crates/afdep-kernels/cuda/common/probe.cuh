// Probe points inside the device round's kernels (measurement builds only). The host side is
// afdep_kernels::ops::probe; `afdep exchange --probe FILE` writes them per round.
//
// A module compiled with -DAFDEP_PROBE (AFDEP_NVRTC_OPTIONS="-DAFDEP_PROBE": the option is part
// of the kernel cache's key) holds a global afdep_probe[AFDEP_PROBE_SLOTS] of %globaltimer
// nanoseconds: AFDEP_PROBE_AT(slot) raises slot `slot` to the timer's value (atomicMax, so a
// point that several blocks pass keeps the last of them; the host zeroes the array before each
// round). Each rank's engine loads its own modules (its own GpuContext), so the array of a
// rank's module holds that rank's points only. Without the define every point expands to
// nothing, so production modules are the same machine code as without this header. The slots
// below are the host's `probe::POINTS` (a host test compares the two lists); a point is hit by
// one thread of its block or of its warp (the caller's guard), and the points after a bounded
// wait fire also when the wait ran out (the round then reports the fault).
#pragma once

#include "common/ptx.cuh"
#include "common/types.cuh"

#define AFDEP_PROBE_SLOTS 32

// The gate kernel passed its gate (afdep_round_start_gate).
#define AFDEP_PROBE_GATE 0
// A front kernel's block 0 started (afdep_source_front, afdep_ffn_front).
#define AFDEP_PROBE_FRONT_IN 1
// The round's start: this rank's status stored into every rank's status area (phase/begin.cuh).
#define AFDEP_PROBE_STATUS_OUT 2
// The round's start: every rank's status of this round arrived (phase/begin.cuh).
#define AFDEP_PROBE_STATUS_IN 3
// The round's start done: verdict and arm in the control block (phase/begin.cuh).
#define AFDEP_PROBE_BEGUN 4
// Source: the counts' last block (phase/counts.cuh, before the publish).
#define AFDEP_PROBE_COUNTS_LAST 5
// Source: the counts published to the FFN ranks, their flags raised (phase/counts.cuh).
#define AFDEP_PROBE_COUNTS_OUT 6
// FFN: every source's counts arrived at the plan (phase/counts.cuh).
#define AFDEP_PROBE_PLAN_IN 7
// FFN: the plan written and its offsets published (phase/counts.cuh).
#define AFDEP_PROBE_PLAN_OUT 8
// Source: the rows' wait for the FFN ranks' plan passed (phase/cf_dispatch.cuh; the last block).
#define AFDEP_PROBE_ROWS_PLAN 9
// Source: a block's rows stored and flagged (phase/cf_dispatch.cuh; the last block).
#define AFDEP_PROBE_ROWS_OUT 10
// FFN: the epilogue's wait for a source's rows passed (phase/stream_epilogue.cuh; the last).
#define AFDEP_PROBE_EPI_IN 11
// FFN: a block's epilogue done (phase/stream_epilogue.cuh; the last block).
#define AFDEP_PROBE_EPI_OUT 12
// A front kernel's last block left (afdep_front_exit).
#define AFDEP_PROBE_FRONT_OUT 13
// FFN: the combine's partial sums started (fused_combine.cu, block 0).
#define AFDEP_PROBE_REDUCE_IN 14
// FFN: the partial sums stored and the combine flags raised (fused_combine.cu, last block).
#define AFDEP_PROBE_REDUCE_OUT 15
// Source: the combine started (fused_combine.cu, block 0).
#define AFDEP_PROBE_COMBINE_IN 16
// Source: the combine's wait for every FFN rank's flag passed (fused_combine.cu; the last).
#define AFDEP_PROBE_COMBINE_WAIT 17
// Source: a block's combined rows stored (fused_combine.cu; the last block).
#define AFDEP_PROBE_COMBINE_OUT 18
// The round's start entered (phase/begin.cuh, thread 0: the kernel or the front's block 0).
#define AFDEP_PROBE_BEGIN_IN 19
// The round's start: the routes checked (phase/begin.cuh, after the block's check).
#define AFDEP_PROBE_BEGIN_CHECKED 20
// Source: the counts kernel's block 0 started (fused_counts.cu).
#define AFDEP_PROBE_COUNTS_IN 21
// FFN: the plan entered (phase/counts.cuh, thread 0, before its waits).
#define AFDEP_PROBE_PLAN_ENTER 22
// Source: the rows kernel's block 0 started (phase/cf_dispatch.cuh).
#define AFDEP_PROBE_ROWS_IN 23
// Source: a warp's rows copied (phase/cf_dispatch.cuh; the last warp that stored a row).
#define AFDEP_PROBE_ROWS_COPIED 24
// Source: the rows' last block took its ticket (phase/cf_dispatch.cuh, before the flags).
#define AFDEP_PROBE_ROWS_TICKET 25
// FFN: the epilogue's block 0 started (phase/stream_epilogue.cuh).
#define AFDEP_PROBE_EPI_ENTER 26
// FFN: a block's partial sums stored (fused_combine.cu; the last block, before its ticket).
#define AFDEP_PROBE_REDUCE_ROWS 27
// FFN: the partial sums' last block took its ticket (fused_combine.cu, before the flags).
#define AFDEP_PROBE_REDUCE_TICKET 28

#ifdef AFDEP_PROBE
// this module's probes (read back by the host; a global's name is not mangled)
__device__ unsigned long long afdep_probe[AFDEP_PROBE_SLOTS];
static __device__ __forceinline__ void afdep_probe_at(u32 slot) {
    if (slot < AFDEP_PROBE_SLOTS)
        atomicMax(afdep_probe + slot, (unsigned long long)afdep_globaltimer_ns());
}
#define AFDEP_PROBE_AT(slot) afdep_probe_at((u32)(slot))
#else
#define AFDEP_PROBE_AT(slot) ((void)0)
#endif
