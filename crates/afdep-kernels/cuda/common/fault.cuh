// Fault injection for the fused exchange kernels (tests only). The host side is
// afdep_kernels::ops::fault (cargo feature `fault-injection`); a host test checks that the point
// bits below agree with it and that every point sits in the files its table names.
//
// A module built with -DAFDEP_FAULT=<mask> (a union of the point bits below) has the points of
// the mask compiled in; without the define every macro expands to nothing, so production
// modules are the same machine code as without this header. Two kinds of points:
//   AFDEP_FAULT_DELAY(point, cond, ns): where `cond` holds, the thread spins `ns` nanoseconds on
//       %globaltimer (a late store, a deferred flag: the protocol must absorb it);
//   AFDEP_FAULT_SKIP(point) <statement>: a prefix of a bounded wait's statement, which the fault
//       skips (the kernel then reads what the wait protected too early: the checks must see it).
//       A skip only ever removes a wait: every read and write after it stays within the bounds
//       the kernel checks anyway.
// Every firing adds one to afdep_fault_hits (per thread: a skip point before a warp's wait
// fires once per lane), a global of the module the host reads back (GpuContext::fault_hits), so
// a test can tell that a fault ran.
#pragma once

#include "common/ptx.cuh"
#include "common/types.cuh"

// The points (bits of AFDEP_FAULT). P1 ... N3 name the faults of the reference record's suite
// (docs/design.md, "The reference record").
// Every 5th row's store delayed 20 us before it is stored (its flag follows the store):
// afdep_cf_dispatch (both modes). The record's P1.
#define AFDEP_FAULT_LATE_ROWS 0x1u
// Every 7th streaming row flag released 10 us after its row's stores completed (and were
// fenced): afdep_cf_dispatch, streaming mode. The record's P2.
#define AFDEP_FAULT_LATE_ROW_FLAGS 0x2u
// A source's counts 30 us late (thread 0 of the last block of afdep_cf_counts, before it stores
// them into the FFN ranks' counts areas; the count flags follow). The record's P3.
#define AFDEP_FAULT_LATE_COUNTS 0x4u
// An FFN rank's offset flags released 20 us after its offsets were stored and fenced:
// afdep_cf_plan. The record's P4.
#define AFDEP_FAULT_LATE_OFFSET_FLAGS 0x8u
// An FFN rank's prefix sums computed 20 us late (after its counts wait, before the plan):
// afdep_cf_plan. The record's P4b.
#define AFDEP_FAULT_LATE_PREFIX 0x10u
// Every flag signal released 10 us after its fence: the last blocks of afdep_cf_dispatch
// (dispatch flags of the device plan's payload-first and source arms) and
// afdep_fused_combine_reduce (combine flags).
#define AFDEP_FAULT_LATE_SIGNAL 0x20u
// Every 5th compact row's partial sum stored into its source's return area 20 us late (the
// combine flag follows): afdep_fused_combine_reduce.
#define AFDEP_FAULT_LATE_RETURN_ROWS 0x40u
// A device round's status flags released 20 us after its status words were stored and
// fenced: afdep_round_begin.
#define AFDEP_FAULT_LATE_STATUS 0x80u
// The streaming epilogue skips its row flag waits: afdep_cf_stream_epilogue. The record's N2.
#define AFDEP_FAULT_SKIP_ROW_WAIT 0x100u
// A source skips its wait for the FFN ranks' offsets: afdep_cf_dispatch (the source arm's
// wait, and the streaming payload gate). The record's N3.
#define AFDEP_FAULT_SKIP_OFFSET_WAIT 0x200u
// The combine skips its wait for the FFN ranks' combine flags: afdep_fused_combine.
#define AFDEP_FAULT_SKIP_COMBINE_WAIT 0x400u
// An FFN rank skips its wait for the sources' dispatch flags: afdep_cf_wait (the source arm's
// and device rounds' dispatch flag wait), afdep_cf_plan (the payload-first wait before its
// plan), afdep_cf_stream_epilogue(_fp8) (an Auto round's source arm wait).
#define AFDEP_FAULT_SKIP_DISPATCH_WAIT 0x800u

#ifdef AFDEP_FAULT

// Firings of this module's fault points (read back by the host).
__device__ unsigned long long afdep_fault_hits;

#define AFDEP_FAULT_HAS(point) ((((unsigned)(AFDEP_FAULT)) & (point)) != 0u)

// Counts one firing; true.
static __device__ __forceinline__ bool afdep_fault_fire() {
    atomicAdd(&afdep_fault_hits, 1ull);
    return true;
}

// Counts one firing, then spins ns nanoseconds on %globaltimer.
static __device__ __forceinline__ void afdep_fault_spin(u64 ns) {
    afdep_fault_fire();
    const u64 t0 = afdep_globaltimer_ns();
    while (afdep_globaltimer_ns() - t0 < ns) {
    }
}

#define AFDEP_FAULT_DELAY(point, cond, ns)                          \
    do {                                                            \
        if (AFDEP_FAULT_HAS(point) && (cond)) afdep_fault_spin(ns); \
    } while (0)
#define AFDEP_FAULT_SKIP(point) if (AFDEP_FAULT_HAS(point) && afdep_fault_fire()) {} else

#else

#define AFDEP_FAULT_DELAY(point, cond, ns)
#define AFDEP_FAULT_SKIP(point)

#endif
