// Count-first streaming epilogue, FFN side (layout/fused.cuh, count-first area): after
// afdep_cf_plan wrote this rank's plan (same stream), expands every compact row (sources in
// order, slab rows in order) as soon as its row flag holds this round: for each slot k with a
// local id l, the payload goes to expanded row block_starts[l][s] + expanded_row[k] (the
// slot's block position). Rows are dealt to work units: a unit is `warps_per_unit` warps
// (capped by the grid's warps), units take contiguous runs of max(min_rows, ceil(rows /
// units)) compact rows, the warps of a unit take its rows in turn. Specialised by AFDEP_TOP_K.

#include "common/ptx.cuh"
#include "common/types.cuh"
#include "layout/fused.cuh"

#ifndef AFDEP_TOP_K
#error "fused_stream_epilogue.cu needs AFDEP_TOP_K"
#endif
#define K AFDEP_TOP_K

// ws: this rank's workspace; src_rank[s] for s < ns; epr local experts; the plan at plan_off
// (counts, block starts, expert offsets, slab offsets: layout/fused.cuh); the expanded area at
// exp_off holds exp_rows rows; ctl: the control block (the round; nothing when skipped). A row
// flag wait runs
// at most timeout_ns, then records AFDEP_FUSED_FAULT_ROW_WAIT naming the source; every warp
// leaves at its next row once the error word holds a fault.
extern "C" __global__ void __launch_bounds__(AFDEP_BLOCK)
    afdep_cf_stream_epilogue(u8* ws, const u32* __restrict__ src_rank, u32 ns, u32 epr,
                             u64 plan_off, u64 rflag_off, u64 slab_off, u32 cap, u64 row_bytes,
                             u64 meta_off, u64 exp_off, u64 exp_rows, u32 hidden, u32 warps_per_unit,
                             u32 min_rows, const u32* ctl, u64 timeout_ns, u32* err) {
    if (afdep_ctl_skip(ctl)) return;
    const u32 round = afdep_ctl_round(ctl);
    const u64 n = (u64)epr * ns;
    const u64* bs = (const u64*)(ws + plan_off) + n;
    const u64* so = bs + n + epr + 1;
    const u64 total = so[ns];
    const u32 lane = afdep_lane();
    const u64 warps = (u64)gridDim.x * AFDEP_WARPS;
    const u64 g = (u64)blockIdx.x * AFDEP_WARPS + threadIdx.x / 32;
    const u64 wpu = warps_per_unit == 0 ? 1 : (warps_per_unit < warps ? warps_per_unit : warps);
    const u64 units = warps / wpu;
    const u64 unit = g / wpu;
    if (unit >= units) return;
    u64 chunk = (total + units - 1) / units;
    if (chunk < min_rows) chunk = min_rows;
    const u64 begin = unit * chunk;
    const u64 end = begin + chunk < total ? begin + chunk : total;
    u16* expanded = (u16*)(ws + exp_off);
    const u32 payload = 2u * hidden;
    for (u64 c = begin + g % wpu; c < end; c += wpu) {
        if (afdep_fused_faulted(err)) return;
        u32 s = 0;
        while (s + 1 < ns && so[s + 1] <= c) s++;
        const u64 i = c - so[s];
        const u64 slot = (u64)src_rank[s] * cap + i;
        u32 ok = 1;
        if (lane == 0) {
            const u32* flag = (const u32*)(ws + rflag_off + 4ull * slot);
            if (!afdep_wait_ge(flag, round, timeout_ns)) {
                afdep_fused_fault(err, AFDEP_FUSED_FAULT_ROW_WAIT, src_rank[s], round);
                ok = 0;
            }
        }
        ok = __shfl_sync(0xffffffffu, ok, 0);
        __syncwarp();  // orders the other lanes' reads of the row after lane 0's acquire
        if (!ok) return;
        const u8* row = ws + slab_off + slot * row_bytes;
        const u32* meta = (const u32*)(row + meta_off);
        const i32* ids = (const i32*)(meta + 2);
        const u64* pos = (const u64*)(meta + 2 + 2 * K);
#pragma unroll 1
        for (int k = 0; k < K; k++) {
            const i32 l = ids[k];
            if (l < 0 || (u32)l >= epr) continue;
            const u64 d = bs[(u64)l * ns + s] + pos[k];
            if (d >= exp_rows) continue;  // never for a consistent plan; poison shows it
            afdep_warp_copy(expanded + d * hidden, row, payload, lane);
        }
    }
}
