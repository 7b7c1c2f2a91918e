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
// the grid's last block raises this FFN rank's combine flag there). One f32 row per (token, FFN
// rank) travels back instead of one bf16 row per slot: at top-8 with every expert on one FFN
// rank, a quarter of the bytes.
// Source side, afdep_fused_combine: waits (bounded) for every FFN rank's flag of this round,
// then adds the partials of the FFN ranks that own a slot of the token, ascending, and casts to
// bf16 once. Both halves do exactly the operations of the one-kernel sum, in its order, so the
// result is bit-identical to the oracle's. Specialised by AFDEP_TOP_K.
//
// bf16 partials (afdep_core::CombinePartials::Bf16, opt-in; the layout's partials field): the
// FFN rank rounds P_f[t] to bf16 (nearest even) and stores hidden bf16, half the bytes; the source
// widens each back to f32 (exact) and sums as above: bit-identical to the oracle with bf16
// partials, not to the f32 path (within afdep_core's bf16_partials_error_bound of it). The return
// row is L.ret_row_bytes either way. Each half has one entry per kind of partials (the `_bf16`
// entries; the launcher picks one by the layout), like the payload kinds' entries: the f32 entries
// are the template's <false> instances, the same code as before the option.

#include "common/probe.cuh"
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

// One return row's channels, as this rank stores (FFN rank) or reads (source) them: hidden f32
// (BF16P false) or hidden bf16 (BF16P true, rounded to nearest even on the way in, widened
// exactly on the way out). The 8-channel forms need 16-byte aligned rows.
template <bool BF16P>
static __device__ __forceinline__ void afdep_ret_store8(u8* row, u32 c0, const float* p) {
    if (BF16P) {
        u32 o[4];
#pragma unroll
        for (int i = 0; i < 4; i++)
            o[i] = (u32)afdep_f32_to_bf16(p[2 * i]) | ((u32)afdep_f32_to_bf16(p[2 * i + 1]) << 16);
        afdep_st_v4((u16*)row + c0, make_uint4(o[0], o[1], o[2], o[3]));
    } else {
        float* dst = (float*)row + c0;
        afdep_st_v4(dst, make_uint4(__float_as_uint(p[0]), __float_as_uint(p[1]),
                                    __float_as_uint(p[2]), __float_as_uint(p[3])));
        afdep_st_v4(dst + 4, make_uint4(__float_as_uint(p[4]), __float_as_uint(p[5]),
                                        __float_as_uint(p[6]), __float_as_uint(p[7])));
    }
}

template <bool BF16P>
static __device__ __forceinline__ void afdep_ret_load8(const u8* row, u32 c0, float* v) {
    if (BF16P) {
        afdep_bf16x8_to_f32(*(const uint4*)((const u16*)row + c0), v);
    } else {
        const float4* p = (const float4*)((const float*)row + c0);
        const float4 a = p[0], b = p[1];
        v[0] = a.x;
        v[1] = a.y;
        v[2] = a.z;
        v[3] = a.w;
        v[4] = b.x;
        v[5] = b.y;
        v[6] = b.z;
        v[7] = b.w;
    }
}

template <bool BF16P>
static __device__ __forceinline__ void afdep_ret_store1(u8* row, u32 c, float p) {
    if (BF16P) {
        ((u16*)row)[c] = afdep_f32_to_bf16(p);
    } else {
        ((float*)row)[c] = p;
    }
}

template <bool BF16P>
static __device__ __forceinline__ float afdep_ret_load1(const u8* row, u32 c) {
    if (BF16P) return afdep_bf16_to_f32(((const u16*)row)[c]);
    return ((const float*)row)[c];
}

// The FFN half's loop over its compact rows (afdep_fused_combine_reduce below), its partials
// stored as BF16P says.
template <bool BF16P>
static __device__ __forceinline__ void afdep_combine_reduce_rows(
    const u8* ws, const u64* __restrict__ peers, const u32* __restrict__ src_rank, u32 ns,
    const u64* __restrict__ so, const u64* __restrict__ bs, u32 rel, const afdep_fused_layout L,
    const u16* __restrict__ y, u64 y_rows, u32 f) {
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
        u8* dst = (u8*)peers[src_rank[s]] + L.ret_off + ((u64)f * L.cap + t) * L.ret_row_bytes;
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
                afdep_ret_store8<BF16P>(dst, c0, p);
            }
        } else {
            for (u32 c = lane; c < L.hidden; c += 32) {
                float p = 0.0f;
#pragma unroll
                for (int k = 0; k < K; k++)
                    if (rows[k] != AFDEP_FUSED_NO_ROW)
                        p = __fadd_rn(p, __fmul_rn(w[k], afdep_bf16_to_f32(y[rows[k] * L.hidden + c])));
                afdep_ret_store1<BF16P>(dst, c, p);
            }
        }
    }
}

// FFN rank (FFN index `f`). ws: this rank's workspace, of layout L (by value, layout/fused.cuh;
// slab_off, cap, row_bytes, meta_off, ret_off, ret_row_bytes and hidden below are its
// fields): its slabs at slab_off (source rank r, row i at (r cap + i) row_bytes; the metadata at
// meta_off within a row: layout/fused.cuh); ctl: its control block (nothing when skipped).
// src_rank[s] for s < ns: the attention ranks; so[ns + 1]: the compact view's row offsets per
// source (FfnPlan::slab_offsets); bs[epr ns]: the plan's block starts (read only when rel != 0:
// the metadata's expanded_row[k] is then the slot's position in its (expert, source) block; else
// the expanded row itself). y: the expert outputs, y_rows expanded rows of hidden bf16 (a slot
// whose row lies past them contributes nothing: never for a consistent plan, and the poisoned
// output shows it). The partial of token t of source s goes to peers[src_rank[s]] + ret_off +
// (f cap + t) ret_row_bytes: hidden f32, or hidden bf16 with bf16 partials. One warp per compact
// row, grid-stride; 8 channels per lane, 16-byte loads and stores when hidden is a multiple of 8.
// me: this FFN rank; sig_off (AFDEP_NO_COMBINE_SIGNAL: none): the grid's last block then raises
// flag `me` at sig_off in every source's workspace (the combine flags).
#define AFDEP_COMBINE_REDUCE_PARAMS                                                               \
    const u8 *ws, const u32 *ctl, const u64 *__restrict__ peers,                                 \
        const u32 *__restrict__ src_rank, u32 ns, const u64 *__restrict__ so,                   \
        const u64 *__restrict__ bs, u32 rel, const afdep_fused_layout L,                         \
        const u16 *__restrict__ y, u64 y_rows, u32 f, u32 me, u64 sig_off
#define AFDEP_COMBINE_REDUCE_ARGS ws, peers, src_rank, ns, so, bs, rel, L, y, y_rows, f
#define AFDEP_NO_COMBINE_SIGNAL 0xffffffffffffffffull

// The rows, then (with a signal) the combine flags, raised by the grid's last block.
// rel AFDEP_REL_BY_ARM (an Auto device round's one launch for every arm; ctl the control block
// itself): the metadata's rows are final in the source arm, block positions in the others.
#define AFDEP_REL_BY_ARM 2u

template <bool BF16P>
static __device__ __forceinline__ void afdep_combine_reduce_kernel(AFDEP_COMBINE_REDUCE_PARAMS) {
    if (afdep_ctl_skip(ctl)) return;
    if (blockIdx.x == 0 && threadIdx.x == 0) AFDEP_PROBE_AT(AFDEP_PROBE_REDUCE_IN);
    if (rel == AFDEP_REL_BY_ARM) rel = afdep_ctl_arm(ctl) == AFDEP_ARM_SOURCE ? 0u : 1u;
    const bool signal = sig_off != AFDEP_NO_COMBINE_SIGNAL;
    __shared__ AfdepSignal sig;
    if (signal) afdep_signal_keep(&sig, ctl, peers, src_rank, ns, sig_off, me);
    afdep_combine_reduce_rows<BF16P>(AFDEP_COMBINE_REDUCE_ARGS);
    if (threadIdx.x % 32 == 0) AFDEP_PROBE_AT(AFDEP_PROBE_REDUCE_ROWS);
    if (signal && afdep_signal_last(&sig)) {
        AFDEP_PROBE_AT(AFDEP_PROBE_REDUCE_TICKET);
        AFDEP_FAULT_DELAY(AFDEP_FAULT_LATE_SIGNAL, true, 10000);
        afdep_signal_raise(&sig);
        if (threadIdx.x == 0) AFDEP_PROBE_AT(AFDEP_PROBE_REDUCE_OUT);
    }
}

extern "C" __global__ void __launch_bounds__(AFDEP_COMBINE_BLOCK)
    afdep_fused_combine_reduce(AFDEP_COMBINE_REDUCE_PARAMS) {
    AFDEP_GRID_DEPENDENCY_SYNC();
    afdep_combine_reduce_kernel<false>(ws, ctl, peers, src_rank, ns, so, bs, rel, L, y, y_rows,
                                       f, me, sig_off);
}

// The same with bf16 partials: each partial rounded to hidden bf16 (L.ret_row_bytes = 2 hidden).
extern "C" __global__ void __launch_bounds__(AFDEP_COMBINE_BLOCK)
    afdep_fused_combine_reduce_bf16(AFDEP_COMBINE_REDUCE_PARAMS) {
    AFDEP_GRID_DEPENDENCY_SYNC();
    afdep_combine_reduce_kernel<true>(ws, ctl, peers, src_rank, ns, so, bs, rel, L, y, y_rows,
                                      f, me, sig_off);
}

// The source half's loop over its tokens (afdep_fused_combine below), the partials read as
// BF16P says.
template <bool BF16P>
static __device__ __forceinline__ void afdep_combine_tokens(const u8* ws, u32 ffns,
                                                            const afdep_fused_layout L,
                                                            const i32* __restrict__ idx, u32 epr,
                                                            u64 tokens, u16* __restrict__ out) {
    const u32 lane = afdep_lane();
    const u64 warps = (u64)gridDim.x * AFDEP_COMBINE_WARPS;
    // written by the FFN ranks before their flags (acquired by the caller): coherent loads only
    const u8* ret = ws + L.ret_off;
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
                    float p[8];
                    afdep_ret_load8<BF16P>(ret + ((u64)f * L.cap + t) * L.ret_row_bytes, c0, p);
#pragma unroll
                    for (int c = 0; c < 8; c++) acc[c] = __fadd_rn(acc[c], p[c]);
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
                    if ((mask >> f) & 1ull)
                        acc = __fadd_rn(acc, afdep_ret_load1<BF16P>(ret + ((u64)f * L.cap + t) * L.ret_row_bytes, c));
                out[t * L.hidden + c] = afdep_f32_to_bf16(acc);
            }
        }
    }
}

// Thread 0 of each block waits (at most timeout_ns) for every FFN rank's combine flag of the
// round; whether all came (a block whose wait runs out records the fault). Every thread calls it.
static __device__ __forceinline__ bool afdep_combine_wait(const u8* ws, const u32* __restrict__ ffn_rank,
                                                          u32 ffns, u64 flag_off, u32 round,
                                                          u64 timeout_ns, u32* err) {
    __shared__ u32 ok;
    if (threadIdx.x == 0) {
        if (blockIdx.x == 0) AFDEP_PROBE_AT(AFDEP_PROBE_COMBINE_IN);
        ok = 1;
        AFDEP_FAULT_SKIP(AFDEP_FAULT_SKIP_COMBINE_WAIT)
        for (u32 f = 0; f < ffns && ok; f++) {
            const u32* flag = (const u32*)(ws + flag_off + 4ull * ffn_rank[f]);
            if (!afdep_wait_ge(flag, round, timeout_ns)) {
                afdep_fused_fault(err, AFDEP_FUSED_FAULT_COMBINE_WAIT, ffn_rank[f], round);
                ok = 0;
            }
        }
        AFDEP_PROBE_AT(AFDEP_PROBE_COMBINE_WAIT);
    }
    __syncthreads();
    return ok != 0;
}

// Source. ws: this rank's workspace, of layout L (ret_off, ret_row_bytes, cap, hidden;
// the combine flags at flag_off by FFN rank, the return area at ret_off: ffns × cap rows of
// ret_row_bytes (hidden f32, or hidden bf16 with bf16 partials), by FFN index); ffn_rank[f] for
// f < ffns: the FFN ranks, ascending; ctl: the control block (round, verdict, tokens: nothing when
// skipped); idx: the routes (tokens × K, validated: expert e >= 0 is on FFN index e / epr, masked
// < 0). One warp per token, grid-stride, 8 channels per lane; every block first waits for every
// flag (thread 0, at most timeout_ns) and a block whose wait runs out records the fault and leaves.
#define AFDEP_COMBINE_PARAMS                                                                      \
    const u8 *ws, const u32 *__restrict__ ffn_rank, u32 ffns, u64 flag_off,                      \
        const afdep_fused_layout L, const i32 *__restrict__ idx, u32 epr, const u32 *ctl,        \
        u64 timeout_ns, u32 *err, u16 *__restrict__ out

extern "C" __global__ void __launch_bounds__(AFDEP_COMBINE_BLOCK)
    afdep_fused_combine(AFDEP_COMBINE_PARAMS) {
    AFDEP_GRID_DEPENDENCY_SYNC();
    if (afdep_ctl_skip(ctl)) return;
    if (!afdep_combine_wait(ws, ffn_rank, ffns, flag_off, afdep_ctl_round(ctl), timeout_ns, err)) return;
    afdep_combine_tokens<false>(ws, ffns, L, idx, epr, afdep_ctl_tokens(ctl), out);
#ifdef AFDEP_PROBE
    __syncthreads();
    if (threadIdx.x == 0) AFDEP_PROBE_AT(AFDEP_PROBE_COMBINE_OUT);
#endif
}

// The same with bf16 partials: return rows of hidden bf16 (L.ret_row_bytes = 2 hidden).
extern "C" __global__ void __launch_bounds__(AFDEP_COMBINE_BLOCK)
    afdep_fused_combine_bf16(AFDEP_COMBINE_PARAMS) {
    AFDEP_GRID_DEPENDENCY_SYNC();
    if (afdep_ctl_skip(ctl)) return;
    if (!afdep_combine_wait(ws, ffn_rank, ffns, flag_off, afdep_ctl_round(ctl), timeout_ns, err)) return;
    afdep_combine_tokens<true>(ws, ffns, L, idx, epr, afdep_ctl_tokens(ctl), out);
#ifdef AFDEP_PROBE
    __syncthreads();
    if (threadIdx.x == 0) AFDEP_PROBE_AT(AFDEP_PROBE_COMBINE_OUT);
#endif
}
