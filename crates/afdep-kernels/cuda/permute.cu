// Permute (gather token rows into expert order) and un-permute (weighted sum back into token
// order). Specialised by AFDEP_TOP_K (K). Element offsets are 64-bit; rows move as 16-byte
// vectors (8 bf16) when the hidden size is a multiple of 8 and the buffers are 16-byte
// aligned, element by element otherwise (the choice is uniform per launch).

#include "common/ptx.cuh"
#include "common/types.cuh"

#ifndef AFDEP_TOP_K
#error "permute.cu needs AFDEP_TOP_K"
#endif
#define K AFDEP_TOP_K
static_assert(K >= 1 && K <= 32, "top-k in 1..=32");

// xs[row] = x[row_slot[row] / K] for row < *total_rows; one warp per row. Rows at or past
// *total_rows are not written.
extern "C" __global__ void __launch_bounds__(AFDEP_BLOCK)
    afdep_permute(const u16* __restrict__ x, const u32* __restrict__ row_slot,
                  const u64* __restrict__ total_rows, u16* __restrict__ xs, u64 max_rows,
                  u32 hidden) {
    const u64 row = (u64)blockIdx.x * AFDEP_WARPS + threadIdx.x / 32;
    const u32 lane = afdep_lane();
    if (row >= max_rows || row >= *total_rows) return;
    const u64 token = row_slot[row] / K;
    const u16* src = x + token * hidden;
    u16* dst = xs + row * hidden;
    if (hidden % 8 == 0 && afdep_aligned16(x) && afdep_aligned16(xs)) {
        const u32 vecs = hidden / 8;
        for (u32 v = lane; v < vecs; v += 32) afdep_st_v4(dst + 8 * (u64)v, afdep_ld_nc_v4(src + 8 * (u64)v));
    } else {
        for (u32 c = lane; c < hidden; c += 32) dst[c] = src[c];
    }
}

// out[t] = sum over slots k ascending (skipping masked slots) of w[t, k] * y[slot_row[t, k]],
// in f32 as acc = __fadd_rn(acc, __fmul_rn(w, y)) (no FMA contraction), cast to bf16 once.
// With experts_per_group G < E the slots are first grouped by owner e / G (ascending) and each
// group's partial sum is added to the total in that order: afdep_core's combine order over
// FFN ranks. G >= E (one group) gives the plain slot-order sum, bit for bit.
// One warp per token; each lane handles 8 channels at a time.

#define VEC 8

extern "C" __global__ void __launch_bounds__(AFDEP_BLOCK)
    afdep_unpermute(const u16* __restrict__ y, const u32* __restrict__ slot_row,
                    const i32* __restrict__ idx, const float* __restrict__ weights,
                    u16* __restrict__ out, u64 tokens, u32 hidden, u32 experts_per_group) {
    const u64 t = (u64)blockIdx.x * AFDEP_WARPS + threadIdx.x / 32;
    const u32 lane = afdep_lane();
    if (t >= tokens) return;

    // The token's slots: rows, weights, groups; then the groups' slot masks in ascending
    // group order (at most K groups).
    u64 rows[K];
    float ws[K];
    u32 group[K];
    u32 live = 0;
#pragma unroll
    for (int k = 0; k < K; k++) {
        const u32 r = slot_row[t * K + k];
        const i32 e = idx[t * K + k];
        rows[k] = r;
        ws[k] = weights[t * K + k];
        group[k] = experts_per_group ? (u32)e / experts_per_group : 0;
        if (r != AFDEP_NO_ROW && e != AFDEP_MASKED) live |= 1u << k;
    }
    u32 gmask[K];
    u32 ngroups = 0;
    {
        u32 left = live;
#pragma unroll
        for (int gi = 0; gi < K; gi++) {
            gmask[gi] = 0;
            if (left) {
                u32 g = 0xffffffffu;
#pragma unroll
                for (int k = 0; k < K; k++)
                    if (((left >> k) & 1u) && group[k] < g) g = group[k];
#pragma unroll
                for (int k = 0; k < K; k++)
                    if (((left >> k) & 1u) && group[k] == g) gmask[gi] |= 1u << k;
                left &= ~gmask[gi];
                ngroups++;
            }
        }
    }

    u16* dst = out + t * hidden;
    const bool vec = hidden % 8 == 0 && afdep_aligned16(y) && afdep_aligned16(out);
    const u32 step = vec ? VEC : 1;
    for (u32 c0 = lane * step; c0 < hidden; c0 += 32 * step) {
        float acc[VEC];
#pragma unroll
        for (int c = 0; c < VEC; c++) acc[c] = 0.0f;
#pragma unroll
        for (int gi = 0; gi < K; gi++) {
            if ((u32)gi >= ngroups) break;
            float part[VEC];
#pragma unroll
            for (int c = 0; c < VEC; c++) part[c] = 0.0f;
#pragma unroll
            for (int k = 0; k < K; k++) {
                if (!((gmask[gi] >> k) & 1u)) continue;
                const u16* src = y + rows[k] * hidden + c0;
                if (vec) {
                    const uint4 v = afdep_ld_nc_v4(src);
                    const u32 u[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
                    for (int c = 0; c < VEC; c++) {
                        const float yv = afdep_bf16_to_f32((u16)(u[c / 2] >> (16 * (c % 2))));
                        part[c] = __fadd_rn(part[c], __fmul_rn(ws[k], yv));
                    }
                } else {
                    part[0] = __fadd_rn(part[0], __fmul_rn(ws[k], afdep_bf16_to_f32(src[0])));
                }
            }
#pragma unroll
            for (int c = 0; c < VEC; c++) acc[c] = __fadd_rn(acc[c], part[c]);
        }
        if (vec) {
            u32 u[4];
#pragma unroll
            for (int c = 0; c < 4; c++)
                u[c] = (u32)afdep_f32_to_bf16(acc[2 * c]) | ((u32)afdep_f32_to_bf16(acc[2 * c + 1]) << 16);
            afdep_st_v4(dst + c0, make_uint4(u[0], u[1], u[2], u[3]));
        } else {
            dst[c0] = afdep_f32_to_bf16(acc[0]);
        }
    }
}
