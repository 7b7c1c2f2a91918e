// The simple GPU reference path of the MoE layer (issue 4): untuned kernels that compute the
// forward pass and the train step of docs/design.md, "Specification: Layer and train step" at sizes
// the CPU oracle cannot reach. They exist to be obviously correct, not fast:
//
// - every intermediate is f32 (as afdep_core::oracle::layer); bf16 appears only in the inputs
//   and in the one final cast of each output;
// - every output element is computed by one thread, and every sum is a plain loop in ascending
//   order of its index (FMA `__fmaf_rn` for dot products; separately rounded `__fmul_rn` /
//   `__fadd_rn` where the oracle rounds a product and a sum, e.g. the combine `acc + w * y`);
// - no tensor cores, no shared memory tiling, no atomics on anything whose order matters (the
//   only atomics are the order-free min of the route check and the max / or of the error
//   statistics);
// - every index is 64-bit (T·K·H exceeds 2^32 at 1M tokens); shapes are run-time values, so
//   any E, K, H, W, S works and nothing is specialised.
//
// Buffers: per-slot intermediates are indexed by the flat slot j = t·K + k (token order, not
// expert order; masked slots hold zeros), per-token ones by t. The per-expert weight gradients
// walk the expert's rows `rows[offsets[e] .. offsets[e+1]]` (flat slots, a stable counting sort:
// token ascending, then slot ascending, the oracle's grouping order), built here without
// atomics. Transposed copies of the weights (exact bf16 copies) only make the naive loops
// coalesced: consecutive threads read consecutive addresses of the weight.

#include "common/ptx.cuh"
#include "common/types.cuh"

// The run-time shape (afdep_kernels::ops::reference::RefDims: six u64, repr(C)).
struct AfdepRefDims {
    u64 tokens;
    u64 hidden;
    u64 width;
    u64 experts;
    u64 top_k;
    u64 shared;
};

// Grid-stride loop over n < total (64-bit).
#define REF_FOR(n, total)                                                      \
    for (u64 n = (u64)blockIdx.x * AFDEP_BLOCK + threadIdx.x; n < (u64)(total); \
         n += (u64)gridDim.x * AFDEP_BLOCK)

static __device__ __forceinline__ float ref_bf(const u16* p, u64 i) {
    return afdep_bf16_to_f32(p[i]);
}

static __device__ __forceinline__ bool ref_finite(float v) {
    return (__float_as_uint(v) & 0x7f800000u) != 0x7f800000u;
}

// sigma(a) = 1 / (1 + e^-a), as the oracle.
static __device__ __forceinline__ float ref_sigmoid(float a) {
    return __fdiv_rn(1.0f, __fadd_rn(1.0f, expf(-a)));
}

// h = (a * sigma(a)) * b, the oracle's order.
static __device__ __forceinline__ float ref_swiglu(float a, float b) {
    return __fmul_rn(__fmul_rn(a, ref_sigmoid(a)), b);
}

// The SwiGLU backward of the oracle: da = (dh * b) * (s * (1 + a * (1 - s))), db = dh * (a * s).
static __device__ __forceinline__ void ref_dswiglu(float a, float b, float dh, float* da,
                                                  float* db) {
    const float s = ref_sigmoid(a);
    const float ds = __fmul_rn(s, __fadd_rn(1.0f, __fmul_rn(a, __fsub_rn(1.0f, s))));
    *da = __fmul_rn(__fmul_rn(dh, b), ds);
    *db = __fmul_rn(dh, __fmul_rn(a, s));
}

// ---------------------------------------------------------------------------------------------
// Weights and routes.

// dst[b][c][r] = src[b][r][c] for b < batch, r < rows, c < cols (bf16 bits, exact).
extern "C" __global__ void __launch_bounds__(AFDEP_BLOCK)
    afdep_ref_transpose(const u16* __restrict__ src, u16* __restrict__ dst, u64 batch, u64 rows,
                        u64 cols) {
    REF_FOR(n, batch * rows * cols) {
        const u64 r = n % rows;
        const u64 bc = n / rows;
        const u64 c = bc % cols;
        const u64 b = bc / cols;
        dst[n] = src[(b * rows + r) * cols + c];
    }
}

// The first (lowest flat index) slot that afdep_core::route::validate would reject: an id below
// -1, an id >= E, with `given` an unmasked non-finite weight, or an id repeated from an earlier
// slot of the token. atomicMin of the slot index into *first (set to u64::MAX before).
extern "C" __global__ void __launch_bounds__(AFDEP_BLOCK)
    afdep_ref_check_routes(const i32* __restrict__ idx, const float* __restrict__ weights,
                           AfdepRefDims d, u32 given, u64* __restrict__ first) {
    REF_FOR(j, d.tokens * d.top_k) {
        const i32 id = idx[j];
        if (id == AFDEP_MASKED) continue;
        bool bad = id < AFDEP_MASKED || (u64)id >= d.experts || (given && !ref_finite(weights[j]));
        const u64 t0 = j - j % d.top_k;
        for (u64 q = t0; q < j && !bad; q++) bad = idx[q] == id;
        if (bad) atomicMin(first, j);
    }
}

// logits[t][e] = sum_{h ascending} x[t][h] * wr[h][e] (f32, FMA), into probs.
extern "C" __global__ void __launch_bounds__(AFDEP_BLOCK)
    afdep_ref_logits(const u16* __restrict__ x, const u16* __restrict__ wr,
                     float* __restrict__ probs, AfdepRefDims d) {
    const u64 E = d.experts, H = d.hidden;
    REF_FOR(n, d.tokens * E) {
        const u64 t = n / E, e = n % E;
        float acc = 0.0f;
        for (u64 h = 0; h < H; h++) acc = __fmaf_rn(ref_bf(x, t * H + h), ref_bf(wr, h * E + e), acc);
        probs[n] = acc;
    }
}

// An independent check of the router's expert choice, one thread per token: the logits
// l_e = sum_h x[t][h] * wr[h][e] are recomputed with their absolute sums a_e = sum_h |x * wr|,
// and the K chosen ids of the routes are compared with every other expert. Two f32 evaluations
// of one logit in any order differ from the exact value by at most gamma_H * a_e each
// (gamma_H = H u / (1 - H u), u = 2^-24; the bf16 products are exact in f32), and the router's
// softmax may move a logit's rank by its own roundings (l - max, expf within 2 ulp), at most
// u * (|l_e| + |max| + 4) in logit units. With r_e = 2 gamma_H a_e + 2 u (|l_e| + |max| + 4):
// - a **violation** is an unchosen u and a chosen c with l_u - r_u > l_c + r_c: whatever the
//   order of the sums, u had the larger probability, so the selection is wrong (also: a masked
//   slot, which a router never writes);
// - a **near tie** is a token where some unchosen u has l_u + r_u >= l_c - r_c for a chosen c:
//   two correct routers may choose differently there (counted, not an error); so is a token
//   with a chosen expert whose probability may have underflowed (l_c + r_c - max < -80).
// stats[0] += violating tokens, stats[1] += near-tie tokens, stats[2] = max(u64::MAX - t) over
// violating tokens t (so the first one is u64::MAX - stats[2]); stats must be zeroed before.
extern "C" __global__ void __launch_bounds__(AFDEP_BLOCK)
    afdep_ref_topk_check(const u16* __restrict__ x, const u16* __restrict__ wr,
                         const i32* __restrict__ idx, AfdepRefDims d, u64* __restrict__ stats) {
    const u64 E = d.experts, H = d.hidden, K = d.top_k;
    const float u = 5.9604645e-8f;  // 2^-24
    const float gamma = (float)H * u / (1.0f - (float)H * u);
    REF_FOR(t, d.tokens) {
        const u16* xt = x + t * H;
        const i32* it = idx + t * K;
        // Pass 1: the largest logit (the softmax's shift).
        float m = AFDEP_NEG_INF;
        for (u64 e = 0; e < E; e++) {
            float l = 0.0f;
            for (u64 h = 0; h < H; h++) l = __fmaf_rn(ref_bf(xt, h), ref_bf(wr, h * E + e), l);
            m = fmaxf(m, l);
        }
        // Pass 2: per expert, the logit and its radius; over the chosen ids c the lowest
        // l_c + r_c (c_up) and l_c - r_c (c_down), over the others the highest l_u - r_u
        // (o_down) and l_u + r_u (o_up).
        float c_up = -AFDEP_NEG_INF, c_down = -AFDEP_NEG_INF;
        float o_down = AFDEP_NEG_INF, o_up = AFDEP_NEG_INF;
        bool masked = false, tiny = false;
        for (u64 k = 0; k < K; k++) masked |= it[k] < 0;
        for (u64 e = 0; e < E; e++) {
            float l = 0.0f, a = 0.0f;
            for (u64 h = 0; h < H; h++) {
                const float xv = ref_bf(xt, h), wv = ref_bf(wr, h * E + e);
                l = __fmaf_rn(xv, wv, l);
                a = __fadd_rn(a, fabsf(__fmul_rn(xv, wv)));
            }
            // 1 % on top: a and |l| are rounded themselves.
            const float r = 1.01f * (2.0f * gamma * a + 2.0f * u * (fabsf(l) + fabsf(m) + 4.0f));
            bool chosen = false;
            for (u64 k = 0; k < K; k++) chosen |= it[k] >= 0 && (u64)it[k] == e;
            if (chosen && l + r - m < -80.0f) {
                // Its probability is at most e^-80 and may have underflowed with others to the
                // same value, where the lower id wins: no verdict from logits.
                tiny = true;
            } else if (chosen) {
                c_up = fminf(c_up, l + r);
                c_down = fminf(c_down, l - r);
            } else {
                o_down = fmaxf(o_down, l - r);
                o_up = fmaxf(o_up, l + r);
            }
        }
        const bool violation = masked || o_down > c_up;
        const bool near_tie = !violation && (tiny || o_up >= c_down);
        if (violation) {
            atomicAdd(stats + 0, 1ull);
            atomicMax(stats + 2, ~(u64)t);
        }
        if (near_tie) atomicAdd(stats + 1, 1ull);
    }
}

// In place, one thread per token: the oracle's softmax (m = the first largest logit, exponentials
// of l - m summed in ascending expert order from 0, each divided by the sum).
extern "C" __global__ void __launch_bounds__(AFDEP_BLOCK)
    afdep_ref_softmax(float* __restrict__ probs, AfdepRefDims d) {
    const u64 E = d.experts;
    REF_FOR(t, d.tokens) {
        float* row = probs + t * E;
        float m = row[0];
        for (u64 e = 1; e < E; e++)
            if (row[e] > m) m = row[e];
        float s = 0.0f;
        for (u64 e = 0; e < E; e++) {
            const float v = expf(__fsub_rn(row[e], m));
            row[e] = v;
            s = __fadd_rn(s, v);
        }
        for (u64 e = 0; e < E; e++) row[e] = __fdiv_rn(row[e], s);
    }
}

// The weight of every slot, one thread per token. Router (probs != null): with renormalisation
// w_k = p[e_k] / s, s = sum_{k ascending, unmasked} p[e_k] from 0, without it w_k = p[e_k].
// Given (probs == null): w_k = given[k]. Masked slots get 0 (they are never read).
extern "C" __global__ void __launch_bounds__(AFDEP_BLOCK)
    afdep_ref_weights(const float* __restrict__ probs, const i32* __restrict__ idx,
                      const float* __restrict__ given, float* __restrict__ weights, AfdepRefDims d,
                      u32 renormalize) {
    const u64 K = d.top_k, E = d.experts;
    REF_FOR(t, d.tokens) {
        const u64 j0 = t * K;
        if (probs == nullptr) {
            for (u64 k = 0; k < K; k++)
                weights[j0 + k] = idx[j0 + k] < 0 ? 0.0f : given[j0 + k];
            continue;
        }
        const float* p = probs + t * E;
        float s = 0.0f;
        for (u64 k = 0; k < K; k++)
            if (idx[j0 + k] >= 0) s = __fadd_rn(s, p[idx[j0 + k]]);
        for (u64 k = 0; k < K; k++) {
            const i32 e = idx[j0 + k];
            weights[j0 + k] = e < 0 ? 0.0f : (renormalize ? __fdiv_rn(p[e], s) : p[e]);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The expert row lists: a stable counting sort of the unmasked slots by expert, without atomics.
// Slots are cut into chunks of `chunk`; thread (c, e) counts, then writes, the slots of chunk c
// that go to expert e, in ascending order.

// counts[c][e] = number of slots j of chunk c with idx[j] == e.
extern "C" __global__ void __launch_bounds__(AFDEP_BLOCK)
    afdep_ref_rows_count(const i32* __restrict__ idx, u64* __restrict__ counts, AfdepRefDims d,
                         u64 chunk) {
    const u64 slots = d.tokens * d.top_k, E = d.experts;
    const u64 chunks = (slots + chunk - 1) / chunk;
    REF_FOR(n, chunks * E) {
        const u64 c = n / E, e = n % E;
        const u64 hi = min(slots, (c + 1) * chunk);
        u64 cnt = 0;
        for (u64 j = c * chunk; j < hi; j++) cnt += (u64)(idx[j] >= 0 && (u64)idx[j] == e);
        counts[n] = cnt;
    }
}

// Per expert e (one thread each), chunks ascending: counts[c][e] becomes the exclusive prefix
// sum over the earlier chunks, and offsets[e + 1] the expert's total.
extern "C" __global__ void __launch_bounds__(AFDEP_BLOCK)
    afdep_ref_rows_scan(u64* __restrict__ counts, u64* __restrict__ offsets, AfdepRefDims d,
                        u64 chunks) {
    const u64 E = d.experts;
    REF_FOR(e, E) {
        u64 run = 0;
        for (u64 c = 0; c < chunks; c++) {
            const u64 v = counts[c * E + e];
            counts[c * E + e] = run;
            run += v;
        }
        offsets[e + 1] = run;
    }
}

// One thread: offsets[0] = 0, offsets[e + 1] += offsets[e] for e ascending (totals to offsets).
extern "C" __global__ void __launch_bounds__(AFDEP_BLOCK)
    afdep_ref_rows_offsets(u64* __restrict__ offsets, AfdepRefDims d) {
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    offsets[0] = 0;
    for (u64 e = 0; e < d.experts; e++) offsets[e + 1] += offsets[e];
}

// Thread (c, e): the slots of chunk c that go to expert e, ascending, to rows starting at
// offsets[e] + counts[c][e]; toks[r] = rows[r] / K (the row's token).
extern "C" __global__ void __launch_bounds__(AFDEP_BLOCK)
    afdep_ref_rows_scatter(const i32* __restrict__ idx, const u64* __restrict__ counts,
                           const u64* __restrict__ offsets, u64* __restrict__ rows,
                           u64* __restrict__ toks, AfdepRefDims d, u64 chunk) {
    const u64 slots = d.tokens * d.top_k, E = d.experts;
    const u64 chunks = (slots + chunk - 1) / chunk;
    REF_FOR(n, chunks * E) {
        const u64 c = n / E, e = n % E;
        const u64 hi = min(slots, (c + 1) * chunk);
        u64 pos = offsets[e] + counts[n];
        for (u64 j = c * chunk; j < hi; j++) {
            if (idx[j] >= 0 && (u64)idx[j] == e) {
                rows[pos] = j;
                toks[pos] = j / d.top_k;
                pos++;
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Forward.

// a = sum_{h ascending} x[h] * w1[h][i], b likewise with w3 (w1, w3: H x width, row-major).
static __device__ __forceinline__ void ref_up(const u16* __restrict__ xrow,
                                              const u16* __restrict__ w1,
                                              const u16* __restrict__ w3, u64 H, u64 width, u64 i,
                                              float* a, float* b) {
    float sa = 0.0f, sb = 0.0f;
    for (u64 h = 0; h < H; h++) {
        const float xv = afdep_bf16_to_f32(xrow[h]);
        sa = __fmaf_rn(xv, ref_bf(w1, h * width + i), sa);
        sb = __fmaf_rn(xv, ref_bf(w3, h * width + i), sb);
    }
    *a = sa;
    *b = sb;
}

// Routed experts, thread (j, i): a, b (when not null) and h = swiglu(a, b) of slot j, column i;
// zeros for a masked slot.
extern "C" __global__ void __launch_bounds__(AFDEP_BLOCK)
    afdep_ref_expert_up(const u16* __restrict__ x, const i32* __restrict__ idx,
                        const u16* __restrict__ w1, const u16* __restrict__ w3,
                        float* __restrict__ a, float* __restrict__ b, float* __restrict__ h,
                        AfdepRefDims d) {
    const u64 W = d.width, H = d.hidden;
    REF_FOR(n, d.tokens * d.top_k * W) {
        const u64 j = n / W, i = n % W;
        const i32 e = idx[j];
        float va = 0.0f, vb = 0.0f, vh = 0.0f;
        if (e >= 0) {
            const u64 t = j / d.top_k;
            ref_up(x + t * H, w1 + (u64)e * H * W, w3 + (u64)e * H * W, H, W, i, &va, &vb);
            vh = ref_swiglu(va, vb);
        }
        if (a) a[n] = va;
        if (b) b[n] = vb;
        h[n] = vh;
    }
}

// Shared expert, thread (t, i): a, b (when not null) and h of token t, column i.
extern "C" __global__ void __launch_bounds__(AFDEP_BLOCK)
    afdep_ref_shared_up(const u16* __restrict__ x, const u16* __restrict__ s1,
                        const u16* __restrict__ s3, float* __restrict__ a, float* __restrict__ b,
                        float* __restrict__ h, AfdepRefDims d) {
    const u64 S = d.shared, H = d.hidden;
    REF_FOR(n, d.tokens * S) {
        const u64 t = n / S, i = n % S;
        float va, vb;
        ref_up(x + t * H, s1, s3, H, S, i, &va, &vb);
        if (a) a[n] = va;
        if (b) b[n] = vb;
        h[n] = ref_swiglu(va, vb);
    }
}

// The layer output, thread (t, c): acc = 0; for k ascending, unmasked:
// y = sum_{i ascending} h[j][i] * w2[e][i][c], acc = acc + w_k * y (product and sum rounded);
// then, with a shared expert, acc = acc + sum_{i ascending} sh[t][i] * s2[i][c]; one cast.
extern "C" __global__ void __launch_bounds__(AFDEP_BLOCK)
    afdep_ref_combine(const i32* __restrict__ idx, const float* __restrict__ weights,
                      const float* __restrict__ h, const u16* __restrict__ w2,
                      const float* __restrict__ sh, const u16* __restrict__ s2,
                      u16* __restrict__ out, AfdepRefDims d) {
    const u64 W = d.width, H = d.hidden, K = d.top_k, S = d.shared;
    REF_FOR(n, d.tokens * H) {
        const u64 t = n / H, c = n % H;
        float acc = 0.0f;
        for (u64 k = 0; k < K; k++) {
            const u64 j = t * K + k;
            const i32 e = idx[j];
            if (e < 0) continue;
            const float* hr = h + j * W;
            const u16* w = w2 + (u64)e * W * H + c;
            float y = 0.0f;
            for (u64 i = 0; i < W; i++) y = __fmaf_rn(hr[i], ref_bf(w, i * H), y);
            acc = __fadd_rn(acc, __fmul_rn(weights[j], y));
        }
        if (S > 0) {
            const float* hr = sh + t * S;
            float y = 0.0f;
            for (u64 i = 0; i < S; i++) y = __fmaf_rn(hr[i], ref_bf(s2, i * H + c), y);
            acc = __fadd_rn(acc, y);
        }
        out[n] = afdep_f32_to_bf16(acc);
    }
}

// ---------------------------------------------------------------------------------------------
// Backward: per-element data gradients.

// Routed experts, thread (j, i): dhu[j][i] = sum_{c ascending} dy[t][c] * w2[e][i][c], read
// through w2t[e][c][i] (the unweighted dy·W2ᵀ; dh = w·dhu); 0 for a masked slot.
extern "C" __global__ void __launch_bounds__(AFDEP_BLOCK)
    afdep_ref_expert_dh(const u16* __restrict__ dy, const i32* __restrict__ idx,
                        const u16* __restrict__ w2t, float* __restrict__ dhu, AfdepRefDims d) {
    const u64 W = d.width, H = d.hidden;
    REF_FOR(n, d.tokens * d.top_k * W) {
        const u64 j = n / W, i = n % W;
        const i32 e = idx[j];
        float acc = 0.0f;
        if (e >= 0) {
            const u16* g = dy + (j / d.top_k) * H;
            const u16* w = w2t + (u64)e * H * W + i;
            for (u64 c = 0; c < H; c++) acc = __fmaf_rn(afdep_bf16_to_f32(g[c]), ref_bf(w, c * W), acc);
        }
        dhu[n] = acc;
    }
}

// The router's g[j] = <dy_t, y_j> = sum_{i ascending} h[j][i] * dhu[j][i] (since y = h·W2,
// <dy, h·W2> = <h, dy·W2ᵀ>), one thread per slot; 0 for a masked slot.
extern "C" __global__ void __launch_bounds__(AFDEP_BLOCK)
    afdep_ref_router_g(const i32* __restrict__ idx, const float* __restrict__ h,
                       const float* __restrict__ dhu, float* __restrict__ g, AfdepRefDims d) {
    const u64 W = d.width;
    REF_FOR(j, d.tokens * d.top_k) {
        float acc = 0.0f;
        if (idx[j] >= 0)
            for (u64 i = 0; i < W; i++) acc = __fmaf_rn(h[j * W + i], dhu[j * W + i], acc);
        g[j] = acc;
    }
}

// Routed experts, elementwise in place: dh = w_j * dhu, then (a, b) becomes (da, db).
extern "C" __global__ void __launch_bounds__(AFDEP_BLOCK)
    afdep_ref_expert_dab(const i32* __restrict__ idx, const float* __restrict__ weights,
                         const float* __restrict__ dhu, float* __restrict__ a,
                         float* __restrict__ b, AfdepRefDims d) {
    const u64 W = d.width;
    REF_FOR(n, d.tokens * d.top_k * W) {
        const u64 j = n / W;
        float da = 0.0f, db = 0.0f;
        if (idx[j] >= 0) ref_dswiglu(a[n], b[n], __fmul_rn(weights[j], dhu[n]), &da, &db);
        a[n] = da;
        b[n] = db;
    }
}

// Shared expert, thread (t, i), in place: dh = sum_{c ascending} dy[t][c] * s2[i][c] (read
// through s2t[c][i]), then (a, b) becomes (da, db).
extern "C" __global__ void __launch_bounds__(AFDEP_BLOCK)
    afdep_ref_shared_dab(const u16* __restrict__ dy, const u16* __restrict__ s2t,
                         float* __restrict__ a, float* __restrict__ b, AfdepRefDims d) {
    const u64 S = d.shared, H = d.hidden;
    REF_FOR(n, d.tokens * S) {
        const u64 t = n / S, i = n % S;
        const u16* g = dy + t * H;
        float dh = 0.0f;
        for (u64 c = 0; c < H; c++) dh = __fmaf_rn(afdep_bf16_to_f32(g[c]), ref_bf(s2t, c * S + i), dh);
        float da, db;
        ref_dswiglu(a[n], b[n], dh, &da, &db);
        a[n] = da;
        b[n] = db;
    }
}

// dp of expert e for token row j0.. (0 when not selected): renormalised (g - gw) / s, else g.
static __device__ __forceinline__ float ref_dp(const i32* idx, const float* g, u64 j0, u64 K,
                                               u64 e, bool renorm, float gw, float s) {
    for (u64 k = 0; k < K; k++)
        if (idx[j0 + k] >= 0 && (u64)idx[j0 + k] == e)
            return renorm ? __fdiv_rn(__fsub_rn(g[j0 + k], gw), s) : g[j0 + k];
    return 0.0f;
}

// The router backward, one thread per token, the oracle's arithmetic: s = sum_k p[e_k] and
// gw = sum_k g_k * w_k (slot order); dp as ref_dp; pd = sum_{e ascending} p_e * dp_e;
// dl[t][e] = p_e * (dp_e - pd).
extern "C" __global__ void __launch_bounds__(AFDEP_BLOCK)
    afdep_ref_router_dlogits(const i32* __restrict__ idx, const float* __restrict__ weights,
                             const float* __restrict__ probs, const float* __restrict__ g,
                             float* __restrict__ dl, AfdepRefDims d, u32 renormalize) {
    const u64 K = d.top_k, E = d.experts;
    REF_FOR(t, d.tokens) {
        const u64 j0 = t * K;
        const float* p = probs + t * E;
        float s = 0.0f, gw = 0.0f;
        for (u64 k = 0; k < K; k++) {
            if (idx[j0 + k] < 0) continue;
            s = __fadd_rn(s, p[idx[j0 + k]]);
            gw = __fadd_rn(gw, __fmul_rn(g[j0 + k], weights[j0 + k]));
        }
        const bool rn = renormalize != 0;
        float pd = 0.0f;
        for (u64 e = 0; e < E; e++) pd = __fadd_rn(pd, __fmul_rn(p[e], ref_dp(idx, g, j0, K, e, rn, gw, s)));
        for (u64 e = 0; e < E; e++)
            dl[t * E + e] = __fmul_rn(p[e], __fsub_rn(ref_dp(idx, g, j0, K, e, rn, gw, s), pd));
    }
}

// The data gradient, thread (t, c): acc = 0; for k ascending, unmasked:
// acc = acc + (sum_i da[j][i] * w1[e][c][i] + sum_i db[j][i] * w3[e][c][i]) (through w1t, w3t:
// E x W x H); then the shared expert's (sum_i dsa[t][i] * s1[c][i] + sum_i dsb[t][i] * s3[c][i])
// when S > 0; then the router's sum_{e ascending} dl[t][e] * wr[c][e] when dl is not null; one
// cast. Every inner sum ascends its index.
extern "C" __global__ void __launch_bounds__(AFDEP_BLOCK)
    afdep_ref_dx(const i32* __restrict__ idx, const float* __restrict__ da,
                 const float* __restrict__ db, const u16* __restrict__ w1t,
                 const u16* __restrict__ w3t, const float* __restrict__ dsa,
                 const float* __restrict__ dsb, const u16* __restrict__ s1t,
                 const u16* __restrict__ s3t, const float* __restrict__ dl,
                 const u16* __restrict__ wrt, u16* __restrict__ dx, AfdepRefDims d) {
    const u64 W = d.width, H = d.hidden, K = d.top_k, S = d.shared, E = d.experts;
    REF_FOR(n, d.tokens * H) {
        const u64 t = n / H, c = n % H;
        float acc = 0.0f;
        for (u64 k = 0; k < K; k++) {
            const u64 j = t * K + k;
            const i32 e = idx[j];
            if (e < 0) continue;
            const float* ra = da + j * W;
            const float* rb = db + j * W;
            const u16* m1 = w1t + (u64)e * W * H + c;
            const u16* m3 = w3t + (u64)e * W * H + c;
            float p1 = 0.0f, p3 = 0.0f;
            for (u64 i = 0; i < W; i++) {
                p1 = __fmaf_rn(ra[i], ref_bf(m1, i * H), p1);
                p3 = __fmaf_rn(rb[i], ref_bf(m3, i * H), p3);
            }
            acc = __fadd_rn(acc, __fadd_rn(p1, p3));
        }
        if (S > 0) {
            const float* ra = dsa + t * S;
            const float* rb = dsb + t * S;
            float p1 = 0.0f, p3 = 0.0f;
            for (u64 i = 0; i < S; i++) {
                p1 = __fmaf_rn(ra[i], ref_bf(s1t, i * H + c), p1);
                p3 = __fmaf_rn(rb[i], ref_bf(s3t, i * H + c), p3);
            }
            acc = __fadd_rn(acc, __fadd_rn(p1, p3));
        }
        if (dl != nullptr) {
            const float* r = dl + t * E;
            float p = 0.0f;
            for (u64 e = 0; e < E; e++) p = __fmaf_rn(r[e], ref_bf(wrt, e * H + c), p);
            acc = __fadd_rn(acc, p);
        }
        dx[n] = afdep_f32_to_bf16(acc);
    }
}

// ---------------------------------------------------------------------------------------------
// Backward: weight gradients, one thread per output element, each a sum over the rows in order
// (the expert's rows for routed experts, tokens ascending for the shared expert and the router).

// dw2[e][i][c] = sum_{rows r of e} h[j][i] * (w_j * dy[t][c]).
extern "C" __global__ void __launch_bounds__(AFDEP_BLOCK)
    afdep_ref_grad_w2(const u64* __restrict__ offsets, const u64* __restrict__ rows,
                      const u64* __restrict__ toks, const float* __restrict__ h,
                      const float* __restrict__ weights, const u16* __restrict__ dy,
                      u16* __restrict__ dw2, AfdepRefDims d) {
    const u64 W = d.width, H = d.hidden;
    REF_FOR(n, d.experts * W * H) {
        const u64 e = n / (W * H), i = (n / H) % W, c = n % H;
        float acc = 0.0f;
#pragma unroll 4
        for (u64 r = offsets[e]; r < offsets[e + 1]; r++) {
            const u64 j = rows[r];
            const float dyw = __fmul_rn(weights[j], ref_bf(dy, toks[r] * H + c));
            acc = __fmaf_rn(h[j * W + i], dyw, acc);
        }
        dw2[n] = afdep_f32_to_bf16(acc);
    }
}

// dw1[e][h][i] = sum_{rows r of e} x[t][h] * da[j][i]; dw3 likewise with db.
extern "C" __global__ void __launch_bounds__(AFDEP_BLOCK)
    afdep_ref_grad_w13(const u64* __restrict__ offsets, const u64* __restrict__ rows,
                       const u64* __restrict__ toks, const u16* __restrict__ x,
                       const float* __restrict__ da, const float* __restrict__ db,
                       u16* __restrict__ dw1, u16* __restrict__ dw3, AfdepRefDims d) {
    const u64 W = d.width, H = d.hidden;
    REF_FOR(n, d.experts * H * W) {
        const u64 e = n / (H * W), hh = (n / W) % H, i = n % W;
        float a1 = 0.0f, a3 = 0.0f;
#pragma unroll 4
        for (u64 r = offsets[e]; r < offsets[e + 1]; r++) {
            const u64 j = rows[r];
            const float xv = ref_bf(x, toks[r] * H + hh);
            a1 = __fmaf_rn(xv, da[j * W + i], a1);
            a3 = __fmaf_rn(xv, db[j * W + i], a3);
        }
        dw1[n] = afdep_f32_to_bf16(a1);
        dw3[n] = afdep_f32_to_bf16(a3);
    }
}

// ds2[i][c] = sum_{t ascending} sh[t][i] * dy[t][c].
extern "C" __global__ void __launch_bounds__(AFDEP_BLOCK)
    afdep_ref_grad_s2(const float* __restrict__ sh, const u16* __restrict__ dy,
                      u16* __restrict__ ds2, AfdepRefDims d) {
    const u64 S = d.shared, H = d.hidden;
    REF_FOR(n, S * H) {
        const u64 i = n / H, c = n % H;
        float acc = 0.0f;
#pragma unroll 4
        for (u64 t = 0; t < d.tokens; t++) acc = __fmaf_rn(sh[t * S + i], ref_bf(dy, t * H + c), acc);
        ds2[n] = afdep_f32_to_bf16(acc);
    }
}

// ds1[h][i] = sum_{t ascending} x[t][h] * dsa[t][i]; ds3 likewise with dsb.
extern "C" __global__ void __launch_bounds__(AFDEP_BLOCK)
    afdep_ref_grad_s13(const u16* __restrict__ x, const float* __restrict__ dsa,
                       const float* __restrict__ dsb, u16* __restrict__ ds1,
                       u16* __restrict__ ds3, AfdepRefDims d) {
    const u64 S = d.shared, H = d.hidden;
    REF_FOR(n, H * S) {
        const u64 hh = n / S, i = n % S;
        float a1 = 0.0f, a3 = 0.0f;
#pragma unroll 4
        for (u64 t = 0; t < d.tokens; t++) {
            const float xv = ref_bf(x, t * H + hh);
            a1 = __fmaf_rn(xv, dsa[t * S + i], a1);
            a3 = __fmaf_rn(xv, dsb[t * S + i], a3);
        }
        ds1[n] = afdep_f32_to_bf16(a1);
        ds3[n] = afdep_f32_to_bf16(a3);
    }
}

// dwr[h][e] = sum_{t ascending} x[t][h] * dl[t][e]; zeros when dl is null (given routes).
extern "C" __global__ void __launch_bounds__(AFDEP_BLOCK)
    afdep_ref_grad_wr(const u16* __restrict__ x, const float* __restrict__ dl,
                      u16* __restrict__ dwr, AfdepRefDims d) {
    const u64 E = d.experts, H = d.hidden;
    REF_FOR(n, H * E) {
        const u64 hh = n / E, e = n % E;
        float acc = 0.0f;
        if (dl != nullptr) {
#pragma unroll 4
            for (u64 t = 0; t < d.tokens; t++) acc = __fmaf_rn(ref_bf(x, t * H + hh), dl[t * E + e], acc);
        }
        dwr[n] = afdep_f32_to_bf16(acc);
    }
}

// ---------------------------------------------------------------------------------------------
// The error metric of afdep_moe::accuracy::max_rel_err, on the device: over i < n, with
// x = a[i], y = b[i] widened exactly to f64, stats[0] = max |x - y| over finite x (NaN
// differences ignored, as f64::max does), stats[1] = max |y| (NaN ignored), stats[2] |= 1 if
// some x is not finite, stats[3] |= 1 if some y is not finite. Maxima of non-negative doubles are
// taken on their bits (monotonic for them), so the order of the atomics does not matter. stats
// must be zeroed before.
extern "C" __global__ void __launch_bounds__(AFDEP_BLOCK)
    afdep_ref_err_stats(const u16* __restrict__ a, const u16* __restrict__ b, u64 n,
                        u64* __restrict__ stats) {
    double dmax = 0.0, smax = 0.0;
    u32 fa = 0, fb = 0;
    REF_FOR(i, n) {
        const float x = afdep_bf16_to_f32(a[i]);
        const float y = afdep_bf16_to_f32(b[i]);
        if (!ref_finite(x)) {
            fa = 1;
        } else {
            dmax = fmax(dmax, fabs((double)x - (double)y));
        }
        if (!ref_finite(y)) fb = 1;
        smax = fmax(smax, fabs((double)y));
    }
    for (int o = 16; o > 0; o >>= 1) {
        dmax = fmax(dmax, __shfl_xor_sync(0xffffffffu, dmax, o));
        smax = fmax(smax, __shfl_xor_sync(0xffffffffu, smax, o));
        fa |= __shfl_xor_sync(0xffffffffu, fa, o);
        fb |= __shfl_xor_sync(0xffffffffu, fb, o);
    }
    if (afdep_lane() == 0) {
        atomicMax(stats + 0, (u64)__double_as_longlong(dmax));
        atomicMax(stats + 1, (u64)__double_as_longlong(smax));
        if (fa) atomicOr(stats + 2, 1ull);
        if (fb) atomicOr(stats + 3, 1ull);
    }
}
