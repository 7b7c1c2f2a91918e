// The device round of the NCCL exchange (afdep_moe::nccl_device): packing, expansion, the
// combine's two halves, all on the device, around two grouped ncclSend/ncclRecv exchanges of
// capacity-padded slabs (so that every launch and every NCCL call of a round has sizes fixed at
// set-up: capturable in a CUDA graph).
//
// Slabs (layout in afdep_kernels::ops::nccl_round::NcclGeometry, mirrored here by arguments):
//   dispatch slab (one per (source, FFN rank)): a 16-byte header {u32 rows, 0, 0, 0}, then
//   `cap` rows of `row_bytes`: {u32 token, i32 local ids[K] (-1: slot not on this FFN rank or
//   masked), f32 weights[K] (0 where the id is -1)}, the bf16 payload at byte `pay_off`.
//   return slab (one per (FFN rank, source)): `cap` rows of hidden f32 partials, by the
//   source's compact row (its tokens bound for that FFN rank, ascending).
//
// afdep_nccl_pack (source, grid = FFN ranks): each block scans this source's tokens in order and
//   writes its FFN rank's slab header and row metadata, and pos[f][t] (the token's row in slab
//   f, AFDEP_NO_ROW when no slot of t is on f). afdep_nccl_pack_rows (source): the payload rows.
// afdep_nccl_count (FFN, grid = sources × local experts): rows of slab s with local expert l,
//   into the plan's counts[l][s]. afdep_nccl_plan (FFN, one thread): the plan's block starts
//   (expert-major, source-minor exclusive prefix) and expert offsets, the layout of
//   afdep_core::layout::FfnPlan and of layout/fused.cuh's plan area (afdep_round_experts reads
//   it). afdep_nccl_expand (FFN, grid = sources × local experts): each slot's expanded row
//   (slot map) and each expanded row's compact row (row map), in compact-row order within the
//   (expert, source) block. afdep_nccl_expand_rows (FFN): the payload rows into the expanded
//   area.
// afdep_nccl_reduce (FFN): per compact row, the f32 partial over its slots on this FFN rank in
//   ascending slot order (each product and sum rounded; no FMA) into the return slab of its
//   source. afdep_nccl_combine (source): per token, the sum of its FFN ranks' partials in
//   ascending FFN rank order, starting from +0, cast to bf16 once: the oracle's arithmetic
//   (afdep_core::oracle::exchange), bit for bit.
// Specialised by AFDEP_TOP_K.

#include "common/ptx.cuh"
#include "common/types.cuh"

#ifndef AFDEP_TOP_K
#error "nccl_round.cu needs AFDEP_TOP_K"
#endif
#define K AFDEP_TOP_K

#define AFDEP_NCCL_HEADER 16

// A block-wide exclusive prefix of a 0/1 flag; *total gets the block's count. Every thread of
// the block must call it.
static __device__ __forceinline__ u32 afdep_nccl_scan(bool flag, u32* total) {
    __shared__ u32 warp_count[AFDEP_WARPS];
    const u32 lane = afdep_lane(), warp = threadIdx.x / 32;
    const u32 b = __ballot_sync(0xffffffffu, flag);
    if (lane == 0) warp_count[warp] = __popc(b);
    __syncthreads();
    u32 before = 0, all = 0;
#pragma unroll
    for (u32 i = 0; i < AFDEP_WARPS; i++) {
        before += i < warp ? warp_count[i] : 0u;
        all += warp_count[i];
    }
    __syncthreads();  // warp_count is reused by the next call
    *total = all;
    return before + __popc(b & afdep_lanemask_lt());
}

static __device__ __forceinline__ u8* afdep_nccl_row(u8* slab, u64 row_bytes, u64 r) {
    return slab + AFDEP_NCCL_HEADER + r * row_bytes;
}

// Copies one row of `hidden` bf16 with one warp (16-byte chunks when both ends allow).
static __device__ __forceinline__ void afdep_nccl_copy_row(u16* dst, const u16* src, u32 hidden) {
    const u32 lane = afdep_lane();
    if ((hidden & 7u) == 0 && afdep_aligned16(dst) && afdep_aligned16(src)) {
        for (u32 c = lane * 8; c < hidden; c += 32 * 8)
            *(uint4*)(dst + c) = *(const uint4*)(src + c);
    } else {
        for (u32 c = lane; c < hidden; c += 32) dst[c] = src[c];
    }
}

// Source. tokens: this round's token count (a device word, at most cap); idx / w: cap × K
// routes; send: nf slabs of slab_bytes; pos: nf × cap. FFN rank f owns experts
// [f·epr, (f+1)·epr).
extern "C" __global__ void __launch_bounds__(AFDEP_BLOCK)
    afdep_nccl_pack(const u32* tokens, const i32* __restrict__ idx, const float* __restrict__ w,
                    u64 cap, u32 epr, u8* send, u64 slab_bytes, u64 row_bytes,
                    u32* __restrict__ pos) {
    const u32 f = blockIdx.x;
    const i32 lo = (i32)(f * epr), hi = (i32)((f + 1) * epr);
    const u64 n = *tokens < cap ? *tokens : cap;
    u8* slab = send + (u64)f * slab_bytes;
    u32 base = 0;
    for (u64 t0 = 0; t0 < n; t0 += AFDEP_BLOCK) {
        const u64 t = t0 + threadIdx.x;
        bool on = false;
        if (t < n) {
#pragma unroll
            for (int k = 0; k < K; k++) {
                const i32 e = idx[t * K + k];
                on = on || (e >= lo && e < hi);
            }
        }
        u32 total;
        const u32 r = base + afdep_nccl_scan(on, &total);
        if (t < n) pos[(u64)f * cap + t] = on ? r : AFDEP_NO_ROW;
        if (on) {
            u32* m = (u32*)afdep_nccl_row(slab, row_bytes, r);
            m[0] = (u32)t;
#pragma unroll
            for (int k = 0; k < K; k++) {
                const i32 e = idx[t * K + k];
                const bool mine = e >= lo && e < hi;
                ((i32*)m)[1 + k] = mine ? e - lo : AFDEP_MASKED;
                ((float*)m)[1 + K + k] = mine ? w[t * K + k] : 0.0f;
            }
        }
        base += total;
    }
    if (threadIdx.x == 0) {
        u32* h = (u32*)slab;
        h[0] = base;
        h[1] = 0;
        h[2] = 0;
        h[3] = 0;
    }
}

// Source: the payload of every token into its row of each slab that holds it (one warp per
// token, grid-stride). x: cap × hidden bf16.
extern "C" __global__ void __launch_bounds__(AFDEP_BLOCK)
    afdep_nccl_pack_rows(const u32* tokens, const u16* __restrict__ x, u64 cap, u32 nf,
                         u8* send, u64 slab_bytes, u64 row_bytes, u64 pay_off,
                         const u32* __restrict__ pos, u32 hidden) {
    const u64 n = *tokens < cap ? *tokens : cap;
    const u64 warps = (u64)gridDim.x * AFDEP_WARPS;
    for (u64 t = (u64)blockIdx.x * AFDEP_WARPS + threadIdx.x / 32; t < n; t += warps) {
        for (u32 f = 0; f < nf; f++) {
            const u32 r = pos[(u64)f * cap + t];
            if (r == AFDEP_NO_ROW) continue;
            u8* row = afdep_nccl_row(send + (u64)f * slab_bytes, row_bytes, r);
            afdep_nccl_copy_row((u16*)(row + pay_off), x + t * hidden, hidden);
        }
    }
}

// Whether compact row m (its metadata) has a slot of local expert l.
static __device__ __forceinline__ bool afdep_nccl_has(const u32* m, i32 l) {
    bool on = false;
#pragma unroll
    for (int k = 0; k < K; k++) on = on || ((const i32*)m)[1 + k] == l;
    return on;
}

// FFN. recv: ns slabs (one per source); plan: counts u64[epr][ns], block starts u64[epr][ns],
// expert offsets u64[epr + 1]. Block (s, l) = blockIdx.x = l · ns + s.
extern "C" __global__ void __launch_bounds__(AFDEP_BLOCK)
    afdep_nccl_count(const u8* recv, u64 slab_bytes, u64 row_bytes, u64 cap, u32 ns,
                     u64* __restrict__ plan) {
    const u32 s = blockIdx.x % ns, l = blockIdx.x / ns;
    const u8* slab = recv + (u64)s * slab_bytes;
    const u64 rows = min((u64)((const u32*)slab)[0], cap);
    u32 count = 0;
    for (u64 r0 = 0; r0 < rows; r0 += AFDEP_BLOCK) {
        const u64 r = r0 + threadIdx.x;
        const bool on =
            r < rows && afdep_nccl_has((const u32*)afdep_nccl_row((u8*)slab, row_bytes, r), (i32)l);
        u32 total;
        afdep_nccl_scan(on, &total);
        count += total;
    }
    if (threadIdx.x == 0) plan[(u64)l * ns + s] = count;
}

// FFN, one thread: block starts and expert offsets from the counts (see afdep_nccl_count).
extern "C" __global__ void afdep_nccl_plan(u32 epr, u32 ns, u64* plan) {
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    const u64 n = (u64)epr * ns;
    u64* bs = plan + n;
    u64* eo = bs + n;
    u64 acc = 0;
    for (u64 i = 0; i < n; i++) {
        if (i % ns == 0) eo[i / ns] = acc;
        bs[i] = acc;
        acc += plan[i];
    }
    eo[epr] = acc;
}

// FFN, block (s, l) as in afdep_nccl_count: slot_map[(s·cap + r)·K + k] = the expanded row of
// slot k of compact row r of source s (written for the slots of l only), row_map[j] = s·cap + r
// for each expanded row j of the block.
extern "C" __global__ void __launch_bounds__(AFDEP_BLOCK)
    afdep_nccl_expand(const u8* recv, u64 slab_bytes, u64 row_bytes, u64 cap, u32 ns,
                      const u64* __restrict__ plan, u32 epr, u32* __restrict__ slot_map,
                      u32* __restrict__ row_map) {
    const u32 s = blockIdx.x % ns, l = blockIdx.x / ns;
    const u8* slab = recv + (u64)s * slab_bytes;
    const u64 rows = min((u64)((const u32*)slab)[0], cap);
    const u64 start = plan[(u64)epr * ns + (u64)l * ns + s];
    u64 base = start;
    for (u64 r0 = 0; r0 < rows; r0 += AFDEP_BLOCK) {
        const u64 r = r0 + threadIdx.x;
        const u32* m = r < rows ? (const u32*)afdep_nccl_row((u8*)slab, row_bytes, r) : nullptr;
        const bool on = m != nullptr && afdep_nccl_has(m, (i32)l);
        u32 total;
        const u64 j = base + afdep_nccl_scan(on, &total);
        if (on) {
            row_map[j] = (u32)((u64)s * cap + r);
#pragma unroll
            for (int k = 0; k < K; k++)
                if (((const i32*)m)[1 + k] == (i32)l) slot_map[((u64)s * cap + r) * K + k] = (u32)j;
        }
        base += total;
    }
}

// FFN: expanded[j] = the payload of compact row row_map[j], for j below the plan's rows (one
// warp per row, grid-stride).
extern "C" __global__ void __launch_bounds__(AFDEP_BLOCK)
    afdep_nccl_expand_rows(const u8* recv, u64 slab_bytes, u64 row_bytes, u64 pay_off, u64 cap,
                           const u64* __restrict__ eo_total, const u32* __restrict__ row_map,
                           u16* __restrict__ expanded, u32 hidden) {
    const u64 total = *eo_total;
    const u64 warps = (u64)gridDim.x * AFDEP_WARPS;
    for (u64 j = (u64)blockIdx.x * AFDEP_WARPS + threadIdx.x / 32; j < total; j += warps) {
        const u32 c = row_map[j];
        const u8* row = afdep_nccl_row((u8*)recv + (u64)(c / cap) * slab_bytes, row_bytes, c % cap);
        afdep_nccl_copy_row(expanded + j * hidden, (const u16*)(row + pay_off), hidden);
    }
}

// FFN: the partial of each compact row (s, r) over its slots on this rank into row r of the
// return slab of source s (ret: ns × cap × hidden f32), from the experts' rows y (expanded
// order). One warp per compact row, grid-stride over ns · cap.
extern "C" __global__ void __launch_bounds__(AFDEP_BLOCK)
    afdep_nccl_reduce(const u8* recv, u64 slab_bytes, u64 row_bytes, u64 cap, u32 ns,
                      const u32* __restrict__ slot_map, const u16* __restrict__ y,
                      float* __restrict__ ret, u32 hidden) {
    const u64 warps = (u64)gridDim.x * AFDEP_WARPS;
    const u32 lane = afdep_lane();
    for (u64 c = (u64)blockIdx.x * AFDEP_WARPS + threadIdx.x / 32; c < (u64)ns * cap;
         c += warps) {
        const u64 s = c / cap, r = c % cap;
        const u8* slab = recv + s * slab_bytes;
        if (r >= (u64)((const u32*)slab)[0]) continue;
        const u32* m = (const u32*)afdep_nccl_row((u8*)slab, row_bytes, r);
        u32 row[K];
        float wk[K];
#pragma unroll
        for (int k = 0; k < K; k++) {
            row[k] = ((const i32*)m)[1 + k] == AFDEP_MASKED ? AFDEP_NO_ROW : slot_map[c * K + k];
            wk[k] = ((const float*)m)[1 + K + k];
        }
        float* out = ret + c * hidden;
        for (u32 ch = lane; ch < hidden; ch += 32) {
            float p = 0.0f;
#pragma unroll
            for (int k = 0; k < K; k++)
                if (row[k] != AFDEP_NO_ROW)
                    p = __fadd_rn(p, __fmul_rn(wk[k], afdep_bf16_to_f32(y[(u64)row[k] * hidden + ch])));
            out[ch] = p;
        }
    }
}

// Source: out[t] = bf16(0 + Σ_{f ascending, pos[f][t] a row} ret[f][pos[f][t]]) for each token t
// of the round (ret: nf × cap × hidden f32, received from the FFN ranks; out: cap × hidden).
// One warp per token, grid-stride.
extern "C" __global__ void __launch_bounds__(AFDEP_BLOCK)
    afdep_nccl_combine(const u32* tokens, u64 cap, u32 nf, const u32* __restrict__ pos,
                       const float* __restrict__ ret, u16* __restrict__ out, u32 hidden) {
    const u64 n = *tokens < cap ? *tokens : cap;
    const u64 warps = (u64)gridDim.x * AFDEP_WARPS;
    const u32 lane = afdep_lane();
    for (u64 t = (u64)blockIdx.x * AFDEP_WARPS + threadIdx.x / 32; t < n; t += warps) {
        for (u32 ch = lane; ch < hidden; ch += 32) {
            float acc = 0.0f;
            for (u32 f = 0; f < nf; f++) {
                const u32 r = pos[(u64)f * cap + t];
                if (r != AFDEP_NO_ROW) acc = __fadd_rn(acc, ret[((u64)f * cap + r) * hidden + ch]);
            }
            out[t * hidden + ch] = afdep_f32_to_bf16(acc);
        }
    }
}
