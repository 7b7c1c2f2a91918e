// The combine of the fused exchange, split at the fixed order of docs/design.md, "Specification:
// AFD exchange"
//   out[t] = bf16( sum over FFN ranks f ascending of P_f[t] ),
//   P_f[t] = sum over the slots k ascending of t whose expert is on f of w_k * y_k,
// every product and sum in f32, rounded each (p = p + w y from 0, no FMA).
//
// FFN side, afdep_fused_combine_reduce: this FFN rank computes its own partial P_f[t] of every
// token it received, from the compact view's metadata in its slabs (each row names the token,
// its slots' local experts, weights and expanded rows), and stores the f32 partial into row
// (f, t) of the return area in the token's source's workspace through the peer table (then
// afdep_fused_signal raises this FFN rank's combine flag there). One f32 row per (token, FFN
// rank) travels back instead of one bf16 row per slot: at top-8 with every expert on one FFN
// rank, a quarter of the bytes.
// Source side, afdep_fused_combine: waits (bounded) for every FFN rank's flag of this round,
// then adds the partials of the FFN ranks that own a slot of the token, ascending, and casts to
// bf16 once. Both halves do exactly the operations of the one-kernel sum, in its order, so the
// result is bit-identical to the oracle's. Specialised by AFDEP_TOP_K.

#include "common/ptx.cuh"
#include "common/types.cuh"
#include "layout/fused.cuh"

#ifndef AFDEP_TOP_K
#error "fused_combine.cu needs AFDEP_TOP_K"
#endif
#define K AFDEP_TOP_K

static_assert(K <= 32, "one lane per slot");

// Threads per block of both combine kernels: twice the other kernels' (AFDEP_BLOCK), so that a
// block of the SM budget keeps twice the loads in flight (afdep_kernels::ops::fused::
// COMBINE_BLOCK; at most 128 registers per thread).
#define AFDEP_COMBINE_BLOCK 512
#define AFDEP_COMBINE_WARPS (AFDEP_COMBINE_BLOCK / 32)

// Eight bf16 (one uint4) widened to f32.
static __device__ __forceinline__ void afdep_bf16x8_to_f32(uint4 v, float* f) {
    const u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        f[2 * i] = afdep_bf16_to_f32((u16)(w[i] & 0xffffu));
        f[2 * i + 1] = afdep_bf16_to_f32((u16)(w[i] >> 16));
    }
}

// FFN rank (FFN index `f`). ws: this rank's workspace, of layout L (by value, layout/fused.cuh;
// slab_off, cap, row_bytes, meta_off, ret_off and hidden below are its fields): its slabs at
// slab_off (source rank r, row i at (r cap + i) row_bytes; the metadata at meta_off within a row:
// layout/fused.cuh); ctl: its control block (nothing when skipped). src_rank[s] for s < ns: the
// attention ranks; so[ns + 1]: the compact view's row offsets per source (FfnPlan::slab_offsets);
// bs[epr ns]: the plan's block starts (read only when rel != 0: the metadata's expanded_row[k] is
// then the slot's position in its (expert, source) block; else the expanded row itself). y: the
// expert outputs, y_rows expanded rows of hidden bf16 (a slot whose row lies past them contributes
// nothing: never for a consistent plan, and the poisoned output shows it). The partial of token t
// of source s goes to peers[src_rank[s]] + ret_off + (f cap + t) 4 hidden. One warp per compact
// row, grid-stride; 8 channels per lane, 16-byte loads and stores when hidden is a multiple of 8.
extern "C" __global__ void __launch_bounds__(AFDEP_COMBINE_BLOCK)
    afdep_fused_combine_reduce(const u8* ws, const u32* ctl, const u64* __restrict__ peers,
                               const u32* __restrict__ src_rank, u32 ns,
                               const u64* __restrict__ so, const u64* __restrict__ bs, u32 rel,
                               const afdep_fused_layout L, const u16* __restrict__ y, u64 y_rows,
                               u32 f) {
    if (afdep_ctl_skip(ctl)) return;
    const u32 lane = afdep_lane();
    const u64 warps = (u64)gridDim.x * AFDEP_COMBINE_WARPS;
    const u64 items = so[ns];
    const bool vec = (L.hidden & 7u) == 0;
    for (u64 j = (u64)blockIdx.x * AFDEP_COMBINE_WARPS + threadIdx.x / 32; j < items; j += warps) {
        u32 s = 0;
        while (s + 1 < ns && so[s + 1] <= j) s++;
        const u64 i = j - so[s];
        const u32* meta =
            (const u32*)(ws + L.slab_off + ((u64)src_rank[s] * L.cap + i) * L.row_bytes + L.meta_off);
        // lane k < K: slot k's expanded row (AFDEP_FUSED_NO_ROW: not on this rank) and weight
        u64 row = AFDEP_FUSED_NO_ROW;
        float wt = 0.0f;
        if (lane < K) {
            const i32 l = (i32)meta[2 + lane];
            if (l >= 0) {
                u64 r = ((const u64*)(meta + 2 + 2 * K))[lane];
                if (rel != 0u) r += bs[(u64)l * ns + s];
                if (r < y_rows) {
                    row = r;
                    wt = __uint_as_float(meta[2 + K + lane]);
                }
            }
        }
        const u32 t = meta[0];
        if (t >= L.cap) continue;  // never for a consistent compact view
        u64 rows[K];
        float w[K];
#pragma unroll
        for (int k = 0; k < K; k++) {
            rows[k] = __shfl_sync(0xffffffffu, row, k);
            w[k] = __shfl_sync(0xffffffffu, wt, k);
        }
        AFDEP_FAULT_DELAY(AFDEP_FAULT_LATE_RETURN_ROWS, j % 5 == 2, 20000);
        float* dst = (float*)((u8*)peers[src_rank[s]] + L.ret_off + ((u64)f * L.cap + t) * 4ull * L.hidden);
        if (vec) {
            for (u32 c0 = lane * 8; c0 < L.hidden; c0 += 32 * 8) {
                uint4 v[K];
#pragma unroll
                for (int k = 0; k < K; k++)
                    v[k] = rows[k] != AFDEP_FUSED_NO_ROW ? afdep_ld_nc_v4(y + rows[k] * L.hidden + c0)
                                                         : make_uint4(0u, 0u, 0u, 0u);
                float p[8];
#pragma unroll
                for (int c = 0; c < 8; c++) p[c] = 0.0f;
#pragma unroll
                for (int k = 0; k < K; k++) {
                    if (rows[k] == AFDEP_FUSED_NO_ROW) continue;
                    float x[8];
                    afdep_bf16x8_to_f32(v[k], x);
#pragma unroll
                    for (int c = 0; c < 8; c++) p[c] = __fadd_rn(p[c], __fmul_rn(w[k], x[c]));
                }
                afdep_st_v4(dst + c0, make_uint4(__float_as_uint(p[0]), __float_as_uint(p[1]),
                                                 __float_as_uint(p[2]), __float_as_uint(p[3])));
                afdep_st_v4(dst + c0 + 4, make_uint4(__float_as_uint(p[4]), __float_as_uint(p[5]),
                                                     __float_as_uint(p[6]), __float_as_uint(p[7])));
            }
        } else {
            for (u32 c = lane; c < L.hidden; c += 32) {
                float p = 0.0f;
#pragma unroll
                for (int k = 0; k < K; k++)
                    if (rows[k] != AFDEP_FUSED_NO_ROW)
                        p = __fadd_rn(p, __fmul_rn(w[k], afdep_bf16_to_f32(y[rows[k] * L.hidden + c])));
                dst[c] = p;
            }
        }
    }
}

// Source. ws: this rank's workspace, of layout L (ret_off, cap, hidden; the combine flags at
// flag_off by FFN rank, the return area at ret_off: ffns × cap rows of hidden f32, by FFN index);
// ffn_rank[f] for f < ffns: the FFN ranks, ascending; ctl: the control block (round, verdict,
// tokens: nothing when skipped); idx: the routes (tokens × K, validated: expert e >= 0 is on FFN
// index e / epr, masked < 0). One warp per token, grid-stride, 8 channels per lane; every block
// first waits for every flag (thread 0, at most timeout_ns) and a block whose wait runs out records
// the fault and leaves.
extern "C" __global__ void __launch_bounds__(AFDEP_COMBINE_BLOCK)
    afdep_fused_combine(const u8* ws, const u32* __restrict__ ffn_rank, u32 ffns, u64 flag_off,
                        const afdep_fused_layout L, const i32* __restrict__ idx, u32 epr,
                        const u32* ctl, u64 timeout_ns, u32* err, u16* __restrict__ out) {
    __shared__ u32 ok;
    if (afdep_ctl_skip(ctl)) return;
    const u32 round = afdep_ctl_round(ctl);
    const u64 tokens = afdep_ctl_tokens(ctl);
    if (threadIdx.x == 0) {
        ok = 1;
        AFDEP_FAULT_SKIP(AFDEP_FAULT_SKIP_COMBINE_WAIT)
        for (u32 f = 0; f < ffns && ok; f++) {
            const u32* flag = (const u32*)(ws + flag_off + 4ull * ffn_rank[f]);
            if (!afdep_wait_ge(flag, round, timeout_ns)) {
                afdep_fused_fault(err, AFDEP_FUSED_FAULT_COMBINE_WAIT, ffn_rank[f], round);
                ok = 0;
            }
        }
    }
    __syncthreads();
    if (!ok) return;
    const u32 lane = afdep_lane();
    const u64 warps = (u64)gridDim.x * AFDEP_COMBINE_WARPS;
    // written by the FFN ranks before their flags (acquired above): coherent loads only
    const float* ret = (const float*)(ws + L.ret_off);
    const bool vec = (L.hidden & 7u) == 0;
    for (u64 t = (u64)blockIdx.x * AFDEP_COMBINE_WARPS + threadIdx.x / 32; t < tokens && t < L.cap; t += warps) {
        // the FFN ranks that own a slot of t
        u64 mask = 0;
        if (lane < K) {
            const i32 e = idx[t * K + lane];
            if (e >= 0 && (u32)e / epr < ffns) mask = 1ull << ((u32)e / epr);
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) mask |= __shfl_xor_sync(0xffffffffu, mask, o);
        if (vec) {
            for (u32 c0 = lane * 8; c0 < L.hidden; c0 += 32 * 8) {
                float acc[8];
#pragma unroll
                for (int c = 0; c < 8; c++) acc[c] = 0.0f;
                for (u32 f = 0; f < ffns; f++) {
                    if (((mask >> f) & 1ull) == 0) continue;
                    const float4* p = (const float4*)(ret + ((u64)f * L.cap + t) * L.hidden + c0);
                    const float4 a = p[0], b = p[1];
                    acc[0] = __fadd_rn(acc[0], a.x);
                    acc[1] = __fadd_rn(acc[1], a.y);
                    acc[2] = __fadd_rn(acc[2], a.z);
                    acc[3] = __fadd_rn(acc[3], a.w);
                    acc[4] = __fadd_rn(acc[4], b.x);
                    acc[5] = __fadd_rn(acc[5], b.y);
                    acc[6] = __fadd_rn(acc[6], b.z);
                    acc[7] = __fadd_rn(acc[7], b.w);
                }
                u32 o[4];
#pragma unroll
                for (int i = 0; i < 4; i++)
                    o[i] = (u32)afdep_f32_to_bf16(acc[2 * i]) |
                           ((u32)afdep_f32_to_bf16(acc[2 * i + 1]) << 16);
                afdep_st_v4(out + t * L.hidden + c0, make_uint4(o[0], o[1], o[2], o[3]));
            }
        } else {
            for (u32 c = lane; c < L.hidden; c += 32) {
                float acc = 0.0f;
                for (u32 f = 0; f < ffns; f++)
                    if ((mask >> f) & 1ull) acc = __fadd_rn(acc, ret[((u64)f * L.cap + t) * L.hidden + c]);
                out[t * L.hidden + c] = afdep_f32_to_bf16(acc);
            }
        }
    }
}
