// Router: logits = x·Wr (f32 accumulation), softmax in f32, top-k (ties to the lower expert
// id), optional renormalisation. Specialised by AFDEP_EXPERTS (E) and AFDEP_TOP_K (K).
//
// Numerics (afdep_core::route is the reference): the logits are f32 sums of exact bf16
// products, in the order of the tensor-core kernel (afdep_router_logits_mma: mma.sync k16
// steps, ascending k-tiles) or of the SIMT kernel (afdep_router_logits: FMAs in ascending h
// per thread, for rows that are not 16-byte aligned); the softmax is common/softmax.cuh (expf,
// per-lane ascending sums and a warp butterfly). Probabilities therefore agree with the CPU to a
// few ulps, not bit for bit. Selection and renormalisation are exact functions of the
// probabilities: given bit-identical probabilities the GPU picks the same experts in the same
// order (ties to the lower id) and computes the same weights (sum in slot order, IEEE division).
//
// A token with a NaN or infinite logit gets masked slots (id -1, weight 0: no expert reads
// it) and its (token, lowest such expert) key goes into the route validation state
// (AFDEP_ROUTE_STATE_ROUTER_WORD, smallest key wins); afdep_validate_word turns it into the
// non-finite-logit error word (afdep_core::RouteError::NonFiniteLogit). No id is ever made
// from a non-finite value.

#include "common/ptx.cuh"
#include "common/softmax.cuh"
#include "common/types.cuh"
#include "layout/route_error.cuh"

#ifndef AFDEP_EXPERTS
#error "router.cu needs AFDEP_EXPERTS"
#endif
#ifndef AFDEP_TOP_K
#error "router.cu needs AFDEP_TOP_K"
#endif

#define E AFDEP_EXPERTS
#define K AFDEP_TOP_K
// Experts per lane in the top-k kernel (lane l holds experts l, l + 32, ...).
#define EPL AFDEP_SOFTMAX_EPL

static_assert(K >= 1 && K <= E, "top-k must be in 1..=experts");
static_assert(K <= 32, "top-k above 32 is not supported");
static_assert(AFDEP_BLOCK == 256, "the logits tilings assume 256 threads");

// ---------------------------------------------------------------------------------------------
// Tensor-core logits: logits[t, e] = sum_h x[t, h] * wr[h, e] with mma.sync m16n8k16 (bf16 in,
// f32 accumulate). Block tile RM_M = 128 tokens (8 warps x 16 rows) x RM_N experts (E rounded
// up to 16, then to a power of two, at most 128: wider E takes several column blocks, adjacent
// in the grid so that they share the x tile in L2), k-step RM_K = 64. Both operands go through
// a ring of RM_S shared-memory stages filled by 16-byte cp.async copies (x needs hidden % 8 == 0
// and a 16-byte aligned x: checked by the launcher; wr too when E % 8 == 0, else it is stored
// element by element), RM_S - 1 k-steps ahead of the tensor cores, so that the loads of x (the
// kernel's bytes) and of the wr tile (from L2) overlap the math instead of waiting for it.
// Tails in tokens, hidden and E are zero-filled on load and predicated on store. The shared
// memory is dynamic (afdep_kernels::ops::router::mma_smem_bytes computes the same size).

#ifndef AFDEP_EMU  // the CPU emulator (crates/afdep-kernels/emu) has no tensor cores
#define RM_M 128
#define RM_K 64
#define RM_S 3
#define RM_E16 ((E + 15) / 16 * 16)
// Column tile: a power of two from 16 to 128 (an E in between takes the next one, its extra
// columns zero-filled and not stored): the tile shapes the register budget of two blocks per SM
// was checked for (an E of 96 as a 96-column tile spilled 8 bytes under NVRTC 13.0).
#define RM_N (RM_E16 <= 16 ? 16 : RM_E16 <= 32 ? 32 : RM_E16 <= 64 ? 64 : 128)
#define RM_NCH ((RM_E16 + RM_N - 1) / RM_N)
#define RM_AS (RM_K + 8)  // shared row stride of the x tile (elements): conflict-free ldmatrix
#define RM_BS (RM_N + 8)  // shared row stride of the wr tile
#define RM_NT (RM_N / 8)  // n-tiles of 8 per warp
#define RM_AV (RM_M * RM_K / 8 / AFDEP_BLOCK)  // 16-byte x vectors per thread per k-step
#define RM_A_STAGE (RM_M * RM_AS)  // elements of one stage's x tile
#define RM_B_STAGE (RM_K * RM_BS)  // elements of one stage's wr tile

static_assert(RM_AV * 8 * AFDEP_BLOCK == RM_M * RM_K, "x tile split");
static_assert(RM_NT % 2 == 0, "n-tiles come in pairs (ldmatrix x4)");
static_assert(RM_S >= 2, "the ring needs two stages at least");

// Queues the copies of k-step k0 into the stage at as (x tile) and bs (wr tile): cp.async for
// every 16-byte vector (zero-filled outside tokens x hidden and E), the wr tile by plain stores
// when E % 8 != 0. The caller commits the group.
static __device__ __forceinline__ void afdep_rm_issue(const u16* __restrict__ x,
                                                      const u16* __restrict__ wr, u16* as,
                                                      u16* bs, u64 m0, u32 n0, u32 k0,
                                                      u32 tokens, u32 hidden) {
    const u32 tid = threadIdx.x;
#pragma unroll
    for (int r = 0; r < RM_AV; r++) {
        const u32 i = tid + r * AFDEP_BLOCK;
        const u32 row = i / (RM_K / 8), col = (i % (RM_K / 8)) * 8;
        const u64 m = m0 + row;
        const u32 c = k0 + col;
        const bool ok = m < tokens && c < hidden;
        afdep_cp_async16((u32)__cvta_generic_to_shared(as + row * RM_AS + col),
                         ok ? x + m * hidden + c : x, ok);
    }
#if E % 8 == 0
    for (u32 i = tid; i < RM_K * RM_N / 8; i += AFDEP_BLOCK) {
        const u32 k = i / (RM_N / 8), n = (i % (RM_N / 8)) * 8;
        const bool ok = k0 + k < hidden && n0 + n < E;
        afdep_cp_async16((u32)__cvta_generic_to_shared(bs + k * RM_BS + n),
                         ok ? wr + (u64)(k0 + k) * E + n0 + n : wr, ok);
    }
#else
    for (u32 i = tid; i < RM_K * RM_N; i += AFDEP_BLOCK) {
        const u32 k = i / RM_N, n = i % RM_N;
        bs[k * RM_BS + n] =
            k0 + k < hidden && n0 + n < E ? __ldg(wr + (u64)(k0 + k) * E + n0 + n) : (u16)0;
    }
#endif
}

static __device__ __forceinline__ void afdep_ldsm_x4(u32 addr, u32& r0, u32& r1, u32& r2,
                                                     u32& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr));
}

static __device__ __forceinline__ void afdep_ldsm_x4_t(u32 addr, u32& r0, u32& r1, u32& r2,
                                                       u32& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr));
}

static __device__ __forceinline__ void afdep_mma_bf16(float (&c)[4], u32 a0, u32 a1, u32 a2,
                                                      u32 a3, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

extern "C" __global__ void __launch_bounds__(AFDEP_BLOCK, 2)
    afdep_router_logits_mma(const u16* __restrict__ x, const u16* __restrict__ wr,
                            float* __restrict__ logits, u32 tokens, u32 hidden) {
    extern __shared__ __align__(16) u16 rm_smem[];
    u16* as = rm_smem;                      // RM_S stages of the x tile
    u16* bs = rm_smem + RM_S * RM_A_STAGE;  // RM_S stages of the wr tile
    const u32 tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    const u64 m0 = (u64)(blockIdx.x / RM_NCH) * RM_M;
    const u32 n0 = (blockIdx.x % RM_NCH) * RM_N;
    const u32 nk = (hidden + RM_K - 1) / RM_K;
    float acc[RM_NT][4];
#pragma unroll
    for (int n = 0; n < RM_NT; n++)
#pragma unroll
        for (int i = 0; i < 4; i++) acc[n][i] = 0.0f;

    // the first RM_S - 1 k-steps in flight (a group each, empty past the last k-step)
#pragma unroll
    for (u32 s = 0; s < RM_S - 1; s++) {
        if (s < nk)
            afdep_rm_issue(x, wr, as + s * RM_A_STAGE, bs + s * RM_B_STAGE, m0, n0, s * RM_K,
                           tokens, hidden);
        afdep_cp_async_commit();
    }
    // ldmatrix row addresses of this lane: A rows warp*16 + (lane % 8) + 8 * ((lane / 8) % 2),
    // column + 8 * (lane / 16); B (transposed) k rows (lane % 8) + 8 * ((lane / 8) % 2),
    // columns + 8 * (lane / 16).
    const u32 lr = (lane % 8) + 8 * ((lane / 8) % 2), lc = 8 * (lane / 16);
    const u32 a_base = (u32)__cvta_generic_to_shared(as + (warp * 16 + lr) * RM_AS + lc);
    const u32 b_base = (u32)__cvta_generic_to_shared(bs + lr * RM_BS + lc);

    for (u32 kt = 0; kt < nk; kt++) {
        // k-step kt has landed (this thread's copies), and every thread is done with the stage
        // the next issue overwrites (read in k-step kt - 1)
        afdep_cp_async_wait<RM_S - 2>();
        __syncthreads();
        const u32 kn = kt + RM_S - 1, sn = kn % RM_S;
        if (kn < nk)
            afdep_rm_issue(x, wr, as + sn * RM_A_STAGE, bs + sn * RM_B_STAGE, m0, n0, kn * RM_K,
                           tokens, hidden);
        afdep_cp_async_commit();
        const u32 s = kt % RM_S;
        const u32 a_s = a_base + s * RM_A_STAGE * 2, b_s = b_base + s * RM_B_STAGE * 2;
#pragma unroll
        for (u32 kk = 0; kk < RM_K; kk += 16) {
            u32 a0, a1, a2, a3;
            afdep_ldsm_x4(a_s + kk * 2, a0, a1, a2, a3);
#pragma unroll
            for (int np = 0; np < RM_NT / 2; np++) {
                u32 b0, b1, b2, b3;
                afdep_ldsm_x4_t(b_s + (kk * RM_BS + np * 16) * 2, b0, b1, b2, b3);
                afdep_mma_bf16(acc[2 * np], a0, a1, a2, a3, b0, b1);
                afdep_mma_bf16(acc[2 * np + 1], a0, a1, a2, a3, b2, b3);
            }
        }
    }
    // Fragment of n-tile n: rows g and g + 8 (g = lane / 4), columns 2 (lane % 4) + {0, 1}.
    const u64 r0 = m0 + warp * 16 + lane / 4;
#pragma unroll
    for (int n = 0; n < RM_NT; n++) {
        const u32 c = n0 + n * 8 + 2 * (lane % 4);
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const u64 r = r0 + 8 * h;
            if (r >= tokens) continue;
            if (c < E) logits[r * E + c] = acc[n][2 * h];
            if (c + 1 < E) logits[r * E + c + 1] = acc[n][2 * h + 1];
        }
    }
}
#endif  // AFDEP_EMU

// ---------------------------------------------------------------------------------------------
// SIMT logits (any hidden size: the fallback when x rows are not 16-byte aligned).
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
// One warp per token: softmax over the E logits (common/softmax.cuh), then K rounds of warp
// arg-max over the probabilities (greater probability first, equal probabilities: lower expert
// id first). Writes idx[t, k] (i32) and weights[t, k] (f32); renormalize != 0 divides by the
// sum of the selected probabilities, accumulated in slot order starting from 0. A token with a
// non-finite logit gets K masked slots and, when `state` is not null, its key in the route
// validation state (see the top of this file).

extern "C" __global__ void __launch_bounds__(AFDEP_BLOCK)
    afdep_router_topk(const float* __restrict__ logits, i32* __restrict__ idx,
                      float* __restrict__ weights, u32 tokens, u32 renormalize, u32* state) {
    const u32 lane = afdep_lane();
    const u64 t = (u64)blockIdx.x * AFDEP_WARPS + threadIdx.x / 32;
    if (t >= tokens) return;

    float p[EPL];
    const u32 bad = afdep_warp_softmax(logits + t * E, lane, p);
    if (bad != AFDEP_ALL_FINITE) {
        if (lane < K) {
            idx[t * K + lane] = AFDEP_MASKED;
            weights[t * K + lane] = 0.0f;
        }
        if (lane == 0 && state != nullptr)
            atomicMax((u64*)(state + AFDEP_ROUTE_STATE_ROUTER_WORD), ~((t << 32) | bad));
        return;
    }
#pragma unroll
    for (int j = 0; j < EPL; j++) {
        // Padding holds -inf: below every probability, never selected (K <= E).
        if (lane + 32 * j >= E) p[j] = AFDEP_NEG_INF;
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
