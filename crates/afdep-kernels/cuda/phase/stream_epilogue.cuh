// The streaming epilogue's rows (afdep_cf_stream_rows; fused_stream_epilogue.cu,
// fused_front.cu). Needs AFDEP_TOP_K as K, common/fp8.cuh, common/ptx.cuh and layout/fused.cuh.
#pragma once

static_assert(K <= 32, "one lane per slot (the fp8 epilogue's expanded rows)");

// ws: this rank's workspace; src_rank[s] for s < ns; epr local experts; the plan at plan_off
// (counts, block starts, expert offsets, slab offsets: layout/fused.cuh); the expanded area at
// exp_off holds exp_rows rows (fp8: their codes at exp_q_off, scales at exp_sc_off); ctl: the
// control block (the round; nothing when skipped). A row flag wait runs at most timeout_ns,
// then records AFDEP_FUSED_FAULT_ROW_WAIT naming the source; every warp leaves at its next row
// once the error word holds a fault.
// by_arm (an Auto device round's one launch for every arm; ctl the control block itself):
// when the round takes the source arm, which has no rows to expand here, thread 0 of block 0
// instead waits for every source's flag at src_flag_off (the dispatch flags; what afdep_cf_wait
// did as a kernel of its own), a timeout recorded as src_code, and the grid leaves.
template <int PAYLOAD>
static __device__ __forceinline__ void afdep_cf_stream_rows(
    u8* ws, const u32* __restrict__ src_rank, u32 ns, u32 epr, u64 plan_off, u64 rflag_off,
    u64 slab_off, u32 cap, u64 row_bytes, u64 meta_off, u64 exp_off, u64 exp_q_off,
    u64 exp_sc_off, u64 exp_rows, u32 hidden, u32 warps_per_unit, u32 min_rows, const u32* ctl,
    u64 timeout_ns, u32* err, u32 by_arm, u64 src_flag_off, u32 src_code) {
    if (afdep_ctl_skip(ctl)) return;
    const u32 round = afdep_ctl_round(ctl);
    if (blockIdx.x == 0 && threadIdx.x == 0) AFDEP_PROBE_AT(AFDEP_PROBE_EPI_ENTER);
    if (by_arm != 0u && afdep_ctl_arm(ctl) == AFDEP_ARM_SOURCE) {
        if (blockIdx.x == 0 && threadIdx.x < 32) {
            // lane 0's reading of the error word for the whole warp (the warp wait needs all
            // 32 lanes)
            const bool faulted =
                __shfl_sync(0xffffffffu, afdep_fused_faulted(err) ? 1u : 0u, 0) != 0u;
            if (!faulted) {
                AFDEP_FAULT_SKIP(AFDEP_FAULT_SKIP_DISPATCH_WAIT)
                afdep_wait_flags_warp(ws, src_flag_off, src_rank, ns, round, timeout_ns, err,
                                      src_code);
            }
            if (threadIdx.x == 0) {
                AFDEP_PROBE_AT(AFDEP_PROBE_EPI_IN);
                AFDEP_PROBE_AT(AFDEP_PROBE_EPI_OUT);
            }
        }
        return;
    }
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
        // lane 0's look at the error word for the whole warp (the fp8 path's shuffles need
        // every lane)
        if (__shfl_sync(0xffffffffu, lane == 0 ? (u32)afdep_fused_faulted(err) : 0u, 0)) return;
        u32 s = 0;
        while (s + 1 < ns && so[s + 1] <= c) s++;
        const u64 i = c - so[s];
        const u64 slot = (u64)src_rank[s] * cap + i;
        u32 ok = 1;
        AFDEP_FAULT_SKIP(AFDEP_FAULT_SKIP_ROW_WAIT)
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
        if (lane == 0) AFDEP_PROBE_AT(AFDEP_PROBE_EPI_IN);
        const u8* row = ws + slab_off + slot * row_bytes;
        const u32* meta = (const u32*)(row + meta_off);
        const i32* ids = (const i32*)(meta + 2);
        const u64* pos = (const u64*)(meta + 2 + 2 * K);
        if (PAYLOAD == AFDEP_PAYLOAD_FP8) {
            // the row's expanded rows (lane k < K: slot k's, AFDEP_FUSED_NO_ROW for none), then
            // 16 codes per lane and step, dequantised once and stored to each of them
            u64 d = AFDEP_FUSED_NO_ROW;
            if (lane < K) {
                const i32 l = ids[lane];
                if (l >= 0 && (u32)l < epr) {
                    const u64 r = bs[(u64)l * ns + s] + pos[lane];
                    if (r < exp_rows) d = r;  // never past them for a consistent plan
                }
            }
            const float* scales = (const float*)(row + afdep_align16(hidden));
            u8* q = ws + exp_q_off;
            float* sc = (float*)(ws + exp_sc_off);
            const u32 groups = hidden / AFDEP_FP8_GROUP;
            const u32 chunks = hidden / 16u;
#pragma unroll 1
            for (u32 v0 = 0; v0 < chunks; v0 += 32) {  // the same trip count on every lane
                const u32 v = v0 + lane;
                const bool live = v < chunks;
                uint4 codes = make_uint4(0u, 0u, 0u, 0u), lo = codes, hi = codes;
                if (live) {
                    codes = *(const uint4*)(row + 16ull * v);
                    afdep_fp8_dequant16(codes, scales[v / 8u], &lo, &hi);
                }
#pragma unroll 1
                for (int k = 0; k < K; k++) {
                    const u64 r = __shfl_sync(0xffffffffu, d, k);
                    if (!live || r == AFDEP_FUSED_NO_ROW) continue;
                    *(uint4*)(q + r * hidden + 16ull * v) = codes;
                    uint4* b = (uint4*)(expanded + r * hidden + 16ull * v);
                    b[0] = lo;
                    b[1] = hi;
                }
            }
#pragma unroll 1
            for (int k = 0; k < K; k++) {
                const u64 r = __shfl_sync(0xffffffffu, d, k);
                if (r == AFDEP_FUSED_NO_ROW) continue;
                for (u32 gi = lane; gi < groups; gi += 32) sc[r * groups + gi] = scales[gi];
            }
        } else {
#pragma unroll 1
            for (int k = 0; k < K; k++) {
                const i32 l = ids[k];
                if (l < 0 || (u32)l >= epr) continue;
                const u64 d = bs[(u64)l * ns + s] + pos[k];
                if (d >= exp_rows) continue;  // never for a consistent plan; poison shows it
                afdep_warp_copy(expanded + d * hidden, row, payload, lane);
            }
        }
        if (lane == 0) AFDEP_PROBE_AT(AFDEP_PROBE_EPI_OUT);
    }
}

// The arguments of afdep_cf_stream_rows from a caller whose names are its parameters' and
// whose layout is `L` (afdep_fused_layout).
#define AFDEP_CF_STREAM_ARGS                                                                      \
    ws, src_rank, ns, epr, L.plan, L.row_flags, L.slab_off, L.cap, L.row_bytes, L.meta_off,      \
        L.expanded, L.exp_q, L.exp_scales, L.exp_rows, L.hidden, warps_per_unit, min_rows, ctl,  \
        timeout_ns, err, by_arm, src_flag_off, src_code
