// Router: logits = x·Wr (f32 accumulation), softmax in f32, top-k (ties to the lower expert
// id), optional renormalisation. Specialised by AFDEP_EXPERTS (E) and AFDEP_TOP_K (K).
//
// Numerics (afdep_core::route is the reference): the logits kernel accumulates each dot product
// with FMAs in ascending h order per thread; the softmax uses expf (not __expf) and a per-lane
// ascending sum followed by a butterfly over the warp. Probabilities therefore agree with the
// CPU to a few ulps, not bit for bit. Selection and renormalisation are exact functions of the
// probabilities: given bit-identical probabilities the GPU picks the same experts in the same
// order (ties to the lower id) and computes the same weights (sum in slot order, IEEE division).

#include "common/ptx.cuh"
#include "common/types.cuh"

#ifndef AFDEP_EXPERTS
#error "router.cu needs AFDEP_EXPERTS"
#endif
#ifndef AFDEP_TOP_K
#error "router.cu needs AFDEP_TOP_K"
#endif

#define E AFDEP_EXPERTS
#define K AFDEP_TOP_K
// Experts per lane in the top-k kernel (lane l holds experts l, l + 32, ...).
#define EPL ((E + 31) / 32)

static_assert(K >= 1 && K <= E, "top-k must be in 1..=experts");
static_assert(K <= 32, "top-k above 32 is not supported");
static_assert(AFDEP_BLOCK == 256, "the logits tiling assumes 256 threads");

// ---------------------------------------------------------------------------------------------
// logits[t, e] = sum_h x[t, h] * wr[h, e]; x is T x H bf16, wr is H x E bf16, both row-major.
// Block tile 64 tokens x 64 experts, k-step 32; each thread computes a 4 x 4 patch
// (rows ty + 16 i, columns tx + 16 j).

#define LT_M 64
#define LT_N 64
#define LT_K 32

extern "C" __global__ void __launch_bounds__(AFDEP_BLOCK)
    afdep_router_logits(const u16* __restrict__ x, const u16* __restrict__ wr,
                        float* __restrict__ logits, u32 tokens, u32 hidden) {
    __shared__ float as[LT_K][LT_M + 1];
    __shared__ float bs[LT_K][LT_N];
    const u32 tid = threadIdx.x;
    const u32 tx = tid % 16, ty = tid / 16;
    const u32 m0 = blockIdx.x * LT_M;
    const u32 n0 = blockIdx.y * LT_N;
    float acc[4][4];
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
        for (int j = 0; j < 4; j++) acc[i][j] = 0.0f;

    for (u32 k0 = 0; k0 < hidden; k0 += LT_K) {
        // A tile: 64 x 32, read along h (coalesced), stored transposed.
#pragma unroll
        for (int r = 0; r < (LT_M * LT_K) / AFDEP_BLOCK; r++) {
            const u32 i = tid + r * AFDEP_BLOCK;
            const u32 m = i / LT_K, k = i % LT_K;
            float v = 0.0f;
            if (m0 + m < tokens && k0 + k < hidden)
                v = afdep_bf16_to_f32(x[(u64)(m0 + m) * hidden + (k0 + k)]);
            as[k][m] = v;
        }
        // B tile: 32 x 64, read along e.
#pragma unroll
        for (int r = 0; r < (LT_K * LT_N) / AFDEP_BLOCK; r++) {
            const u32 i = tid + r * AFDEP_BLOCK;
            const u32 k = i / LT_N, n = i % LT_N;
            float v = 0.0f;
            if (k0 + k < hidden && n0 + n < E) v = afdep_bf16_to_f32(wr[(u64)(k0 + k) * E + (n0 + n)]);
            bs[k][n] = v;
        }
        __syncthreads();
#pragma unroll 8
        for (int k = 0; k < LT_K; k++) {
            float a[4], b[4];
#pragma unroll
            for (int i = 0; i < 4; i++) a[i] = as[k][ty + 16 * i];
#pragma unroll
            for (int j = 0; j < 4; j++) b[j] = bs[k][tx + 16 * j];
#pragma unroll
            for (int i = 0; i < 4; i++)
#pragma unroll
                for (int j = 0; j < 4; j++) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
        }
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const u32 m = m0 + ty + 16 * i;
        if (m >= tokens) continue;
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const u32 n = n0 + tx + 16 * j;
            if (n < E) logits[(u64)m * E + n] = acc[i][j];
        }
    }
}

// ---------------------------------------------------------------------------------------------
// One warp per token: softmax over the E logits, then K rounds of warp arg-max over the
// probabilities (greater probability first, equal probabilities: lower expert id first).
// Writes idx[t, k] (i32) and weights[t, k] (f32); renormalize != 0 divides by the sum of the
// selected probabilities, accumulated in slot order starting from 0.

extern "C" __global__ void __launch_bounds__(AFDEP_BLOCK)
    afdep_router_topk(const float* __restrict__ logits, i32* __restrict__ idx,
                      float* __restrict__ weights, u32 tokens, u32 renormalize) {
    const u32 lane = afdep_lane();
    const u64 t = (u64)blockIdx.x * AFDEP_WARPS + threadIdx.x / 32;
    if (t >= tokens) return;
    const float* row = logits + t * E;

    float p[EPL];
    float m = AFDEP_NEG_INF;
#pragma unroll
    for (int j = 0; j < EPL; j++) {
        const u32 e = lane + 32 * j;
        p[j] = e < E ? row[e] : AFDEP_NEG_INF;
        m = fmaxf(m, p[j]);
    }
    m = afdep_warp_max(m);
    float s = 0.0f;
#pragma unroll
    for (int j = 0; j < EPL; j++) {
        const u32 e = lane + 32 * j;
        p[j] = e < E ? expf(p[j] - m) : 0.0f;
        s = __fadd_rn(s, p[j]);
    }
    s = afdep_warp_sum(s);
#pragma unroll
    for (int j = 0; j < EPL; j++) {
        const u32 e = lane + 32 * j;
        // Padding holds -inf: below every probability, never selected (K <= E).
        p[j] = e < E ? __fdiv_rn(p[j], s) : AFDEP_NEG_INF;
    }

    u32 taken = 0;  // bit j: this lane's expert lane + 32 j is already selected
    float sel_p[K];
    i32 sel_e[K];
#pragma unroll
    for (int k = 0; k < K; k++) {
        float bv = AFDEP_NEG_INF;
        i32 be = 0x7fffffff;
#pragma unroll
        for (int j = 0; j < EPL; j++) {
            // Within a lane, j ascending visits ids ascending: strict > keeps the lower id.
            if (!((taken >> j) & 1u) && p[j] > bv) {
                bv = p[j];
                be = (i32)(lane + 32 * j);
            }
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
            const i32 oe = __shfl_xor_sync(0xffffffffu, be, o);
            if (ov > bv || (ov == bv && oe < be)) {
                bv = ov;
                be = oe;
            }
        }
        sel_p[k] = bv;
        sel_e[k] = be;
        if ((u32)be % 32 == lane) taken |= 1u << ((u32)be / 32);
    }

    float sum = 0.0f;
#pragma unroll
    for (int k = 0; k < K; k++) sum = __fadd_rn(sum, sel_p[k]);
#pragma unroll
    for (int k = 0; k < K; k++) {
        if (lane == (u32)k) {
            idx[t * K + k] = sel_e[k];
            weights[t * K + k] = renormalize ? __fdiv_rn(sel_p[k], sum) : sel_p[k];
        }
    }
}
