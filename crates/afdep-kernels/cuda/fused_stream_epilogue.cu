// Count-first streaming epilogue, FFN side (layout/fused.cuh, count-first area): after
// afdep_cf_plan wrote this rank's plan (same stream), expands every compact row (sources in
// order, slab rows in order) as soon as its row flag holds this round: for each slot k with a
// local id l, the payload goes to expanded row block_starts[l][s] + expanded_row[k] (the
// slot's block position). Rows are dealt to work units: a unit is `warps_per_unit` warps
// (capped by the grid's warps), units take contiguous runs of max(min_rows, ceil(rows /
// units)) compact rows, the warps of a unit take its rows in turn. Specialised by AFDEP_TOP_K.
//
// The payload kind is a template constant: afdep_cf_stream_epilogue expands bf16 rows;
// afdep_cf_stream_epilogue_fp8 reads the slab row's codes and scales (layout/fused.cuh) and
// writes them to the expanded row's codes (exp_q_off) and scales (exp_sc_off) and their
// dequantised bf16 values (common/fp8.cuh) to the expanded row (exp_off). afdep_cf_dequant is
// the source arm's counterpart on the FFN rank: after every source's dispatch flag, the codes
// and scales the sources stored into the expanded rows are dequantised into the bf16 expanded
// rows.

#include "common/fp8.cuh"
#include "common/probe.cuh"
#include "common/ptx.cuh"
#include "common/types.cuh"
#include "layout/fused.cuh"

#ifndef AFDEP_TOP_K
#error "fused_stream_epilogue.cu needs AFDEP_TOP_K"
#endif
#define K AFDEP_TOP_K

#include "phase/stream_epilogue.cuh"

// The entries take the workspace layout by value (afdep_fused_layout, layout/fused.cuh); the
// rows function reads its fields, which stay in the parameter space (no copy).
#define AFDEP_CF_STREAM_PARAMS                                                                    \
    u8 *ws, const u32 *__restrict__ src_rank, u32 ns, u32 epr, const afdep_fused_layout L,       \
        u32 warps_per_unit, u32 min_rows, const u32 *ctl, u64 timeout_ns, u32 *err, u32 by_arm, \
        u64 src_flag_off, u32 src_code
// bf16 rows (exp_q_off and exp_sc_off unused).
extern "C" __global__ void __launch_bounds__(AFDEP_BLOCK)
    afdep_cf_stream_epilogue(AFDEP_CF_STREAM_PARAMS) {
    AFDEP_GRID_DEPENDENCY_SYNC();
    afdep_cf_stream_rows<AFDEP_PAYLOAD_BF16>(AFDEP_CF_STREAM_ARGS);
}

// fp8 rows: hidden a multiple of 128; the areas 16-byte aligned.
extern "C" __global__ void __launch_bounds__(AFDEP_BLOCK)
    afdep_cf_stream_epilogue_fp8(AFDEP_CF_STREAM_PARAMS) {
    AFDEP_GRID_DEPENDENCY_SYNC();
    afdep_cf_stream_rows<AFDEP_PAYLOAD_FP8>(AFDEP_CF_STREAM_ARGS);
}

// The source arm's dequantisation (fp8), FFN side, after every source's dispatch flag (same
// stream): for every expanded row j below min(the plan's rows, exp_rows), the bf16 row at
// exp_off gets bf16(f32(code) · scale) of its codes (exp_q_off) and scales (exp_sc_off). One
// warp per row, 16 codes per lane and step; nothing when the round is skipped.
extern "C" __global__ void __launch_bounds__(AFDEP_BLOCK)
    afdep_cf_dequant(u8* ws, const u32* ctl, const afdep_fused_layout L, u32 epr, u32 ns) {
    AFDEP_GRID_DEPENDENCY_SYNC();
    const u64 plan_off = L.plan, exp_off = L.expanded, exp_q_off = L.exp_q;
    const u64 exp_sc_off = L.exp_scales, exp_rows = L.exp_rows;
    const u32 hidden = L.hidden;
    if (afdep_ctl_skip(ctl)) return;
    const u64 n = (u64)epr * ns;
    const u64* eo = (const u64*)(ws + plan_off) + 2 * n;
    const u64 total = eo[epr] < exp_rows ? eo[epr] : exp_rows;
    const u8* q = ws + exp_q_off;
    const float* sc = (const float*)(ws + exp_sc_off);
    u16* expanded = (u16*)(ws + exp_off);
    const u32 groups = hidden / AFDEP_FP8_GROUP;
    const u32 lane = afdep_lane();
    const u64 warps = (u64)gridDim.x * AFDEP_WARPS;
    for (u64 j = (u64)blockIdx.x * AFDEP_WARPS + threadIdx.x / 32; j < total; j += warps) {
#pragma unroll 1
        for (u32 v = lane; v < hidden / 16u; v += 32) {
            uint4 lo, hi;
            afdep_fp8_dequant16(*(const uint4*)(q + j * hidden + 16ull * v),
                                sc[j * groups + v / 8u], &lo, &hi);
            uint4* b = (uint4*)(expanded + j * hidden + 16ull * v);
            b[0] = lo;
            b[1] = hi;
        }
    }
}
