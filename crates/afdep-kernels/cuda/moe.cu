// The MoE layer's elementwise and per-token kernels around the grouped GEMMs: the routed
// combine into an f32 accumulator, the final cast, and the router backward. Specialised by
// AFDEP_EXPERTS (E) and AFDEP_TOP_K (K).

#include "common/ptx.cuh"
#include "common/softmax.cuh"
#include "common/types.cuh"

#ifndef AFDEP_EXPERTS
#error "moe.cu needs AFDEP_EXPERTS"
#endif
#ifndef AFDEP_TOP_K
#error "moe.cu needs AFDEP_TOP_K"
#endif
#define E AFDEP_EXPERTS
#define K AFDEP_TOP_K
#define EPL AFDEP_SOFTMAX_EPL
static_assert(K >= 1 && K <= 32 && K <= E, "top-k in 1..=min(32, E)");

// acc[t] = sum over slots k ascending (masked skipped) of (weights ? w_k * y[row] : y[row]),
// f32, each product and sum rounded (no FMA): the order of the oracle's combine. One warp per
// token, 8 channels per lane per step (hidden % 8 == 0, checked by the launcher).
extern "C" __global__ void __launch_bounds__(AFDEP_BLOCK)
    afdep_moe_combine(const u16* __restrict__ y, const u32* __restrict__ slot_row,
                      const float* __restrict__ weights, float* __restrict__ acc, u64 tokens,
                      u32 hidden) {
    const u64 t = (u64)blockIdx.x * AFDEP_WARPS + threadIdx.x / 32;
    const u32 lane = afdep_lane();
    if (t >= tokens) return;
    // Rows and weights are re-read per channel chunk (L1 hits): keeping K of each in
    // registers spills at K = 8.
    const u32* rows = slot_row + t * K;
    const float* ws = weights ? weights + t * K : nullptr;
    float* dst = acc + t * hidden;
    for (u32 c0 = lane * 8; c0 < hidden; c0 += 256) {
        float s[8];
#pragma unroll
        for (int c = 0; c < 8; c++) s[c] = 0.0f;
#pragma unroll 2
        for (int k = 0; k < K; k++) {
            const u32 r = __ldg(rows + k);
            if (r == AFDEP_NO_ROW) continue;
            const float w = ws ? __ldg(ws + k) : 1.0f;
            const uint4 v = afdep_ld_nc_v4(y + (u64)r * hidden + c0);
            const u32 words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
            for (int c = 0; c < 8; c++) {
                const float yv = afdep_bf16_to_f32((u16)((words[c / 2] >> (16 * (c % 2))) & 0xffffu));
                s[c] = __fadd_rn(s[c], ws ? __fmul_rn(w, yv) : yv);
            }
        }
        float4* d = (float4*)(dst + c0);
        d[0] = make_float4(s[0], s[1], s[2], s[3]);
        d[1] = make_float4(s[4], s[5], s[6], s[7]);
    }
}

// out[i] = bf16(acc[i]) for i < n.
extern "C" __global__ void __launch_bounds__(AFDEP_BLOCK)
    afdep_moe_cast(const float* __restrict__ acc, u16* __restrict__ out, u64 n) {
    for (u64 i = (u64)blockIdx.x * AFDEP_BLOCK + threadIdx.x; i < n;
         i += (u64)gridDim.x * AFDEP_BLOCK)
        out[i] = afdep_f32_to_bf16(acc[i]);
}

// The router backward, one warp per token. p = softmax(logits) exactly as afdep_router_topk
// computes it; g[t, k] = <dy_t, y_k>; with renormalisation s = sum_k p_k (slot order) and
// dp_k = (g_k - sum_j g_j w_j) / s, without it dp_k = g_k; then
// dlogit_i = p_i (dp_i - sum_k p_k dp_k) (dp_i = 0 for experts not selected). Written as bf16
// (the operand of the router's weight- and data-gradient GEMMs) in rows of `ld` >= E values,
// the columns E..ld zero (16-byte rows for the GEMMs whatever E is).
extern "C" __global__ void __launch_bounds__(AFDEP_BLOCK)
    afdep_router_backward(const float* __restrict__ logits, const i32* __restrict__ idx,
                          const float* __restrict__ weights, const float* __restrict__ g,
                          u16* __restrict__ dlogits, u32 tokens, u32 renormalize, u32 ld) {
    const u32 lane = afdep_lane();
    const u64 t = (u64)blockIdx.x * AFDEP_WARPS + threadIdx.x / 32;
    if (t >= tokens) return;
    float p[EPL];
    // Tokens with a non-finite logit have masked slots (the router's top-k), so nothing reads
    // their gradient terms; the step that made them is refused anyway.
    (void)afdep_warp_softmax(logits + t * E, lane, p);
    // Selected probabilities, gradients and weights, in slot order (every lane).
    float ps[K], gs[K], wsl[K];
    i32 es[K];
#pragma unroll
    for (int k = 0; k < K; k++) {
        const i32 e = idx[t * K + k];
        es[k] = e;
        gs[k] = g[t * K + k];
        wsl[k] = weights[t * K + k];
        float mine = 0.0f;
#pragma unroll
        for (int j = 0; j < EPL; j++)
            if (e >= 0 && (u32)e == lane + 32 * j) mine = p[j];
        ps[k] = __shfl_sync(0xffffffffu, mine, e >= 0 ? (u32)e % 32 : 0);
    }
    float dp[K];
    if (renormalize) {
        float sum = 0.0f, gw = 0.0f;
#pragma unroll
        for (int k = 0; k < K; k++) {
            sum = __fadd_rn(sum, ps[k]);
            gw = __fadd_rn(gw, __fmul_rn(gs[k], wsl[k]));
        }
#pragma unroll
        for (int k = 0; k < K; k++) dp[k] = __fdiv_rn(__fsub_rn(gs[k], gw), sum);
    } else {
#pragma unroll
        for (int k = 0; k < K; k++) dp[k] = gs[k];
    }
    float pdp = 0.0f;
#pragma unroll
    for (int k = 0; k < K; k++) pdp = __fadd_rn(pdp, __fmul_rn(ps[k], dp[k]));
#pragma unroll
    for (int j = 0; j < EPL; j++) {
        const u32 e = lane + 32 * j;
        if (e >= ld) continue;
        if (e >= E) {
            dlogits[t * ld + e] = 0;
            continue;
        }
        float d = 0.0f;
#pragma unroll
        for (int k = 0; k < K; k++)
            if ((u32)es[k] == e) d = dp[k];
        dlogits[t * ld + e] = afdep_f32_to_bf16(__fmul_rn(p[j], __fsub_rn(d, pdp)));
    }
}

// dst[r, c] = c < cols ? src[r, c] : 0 for r < rows, c < dst_ld (bf16, row strides src_ld and
// dst_ld): a router matrix padded to 16-byte rows for the GEMMs, or its gradient cut back.
extern "C" __global__ void __launch_bounds__(AFDEP_BLOCK)
    afdep_moe_copy_cols(const u16* __restrict__ src, u64 src_ld, u16* __restrict__ dst,
                        u64 dst_ld, u64 rows, u64 cols) {
    const u64 n = rows * dst_ld;
    for (u64 i = (u64)blockIdx.x * AFDEP_BLOCK + threadIdx.x; i < n;
         i += (u64)gridDim.x * AFDEP_BLOCK) {
        const u64 r = i / dst_ld, c = i % dst_ld;
        dst[i] = c < cols ? src[r * src_ld + c] : (u16)0;
    }
}
