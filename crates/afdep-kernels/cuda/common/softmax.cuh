// The router's softmax over one token's E logits, one warp per token: the single definition
// shared by the router's top-k (router.cu) and the router backward (moe.cu), so that both see
// bit-identical probabilities. Needs AFDEP_EXPERTS (E).
//
// Lane l holds experts l, l + 32, ... (AFDEP_SOFTMAX_EPL of them). The maximum is a warp
// butterfly; the exponentials use expf (not __expf); each lane sums its own in ascending j,
// then a butterfly sums the lanes; every probability is one IEEE division by that sum.
// Padding (ids >= E) holds probability 0.
#pragma once

#include "common/ptx.cuh"
#include "common/types.cuh"

#ifndef AFDEP_EXPERTS
#error "common/softmax.cuh needs AFDEP_EXPERTS"
#endif

#define AFDEP_SOFTMAX_EPL ((AFDEP_EXPERTS + 31) / 32)

// No expert: every logit of the row is finite.
#define AFDEP_ALL_FINITE 0xffffffffu

// Reads row[0..E) into p and turns it into probabilities in place. Returns the lowest expert id
// whose logit is NaN or infinite (the same on every lane), or AFDEP_ALL_FINITE; p is
// meaningless for such a row (the router refuses the token, see afdep_core::route::check_logits).
static __device__ __forceinline__ u32 afdep_warp_softmax(const float* __restrict__ row, u32 lane,
                                                         float (&p)[AFDEP_SOFTMAX_EPL]) {
    float m = AFDEP_NEG_INF;
    u32 bad = AFDEP_ALL_FINITE;
#pragma unroll
    for (int j = 0; j < AFDEP_SOFTMAX_EPL; j++) {
        const u32 e = lane + 32 * j;
        p[j] = e < AFDEP_EXPERTS ? row[e] : AFDEP_NEG_INF;
        // Within a lane, j ascending visits ids ascending: keep the first.
        if (e < AFDEP_EXPERTS && bad == AFDEP_ALL_FINITE &&
            (__float_as_uint(p[j]) & 0x7f800000u) == 0x7f800000u)
            bad = e;
        m = fmaxf(m, p[j]);
    }
    bad = __reduce_min_sync(0xffffffffu, bad);
    m = afdep_warp_max(m);
    float s = 0.0f;
#pragma unroll
    for (int j = 0; j < AFDEP_SOFTMAX_EPL; j++) {
        const u32 e = lane + 32 * j;
        p[j] = e < AFDEP_EXPERTS ? expf(p[j] - m) : 0.0f;
        s = __fadd_rn(s, p[j]);
    }
    s = afdep_warp_sum(s);
#pragma unroll
    for (int j = 0; j < AFDEP_SOFTMAX_EPL; j++) {
        const u32 e = lane + 32 * j;
        p[j] = e < AFDEP_EXPERTS ? __fdiv_rn(p[j], s) : 0.0f;
    }
    return bad;
}
