// The route rules of one token on the device (afdep_core::route::validate), shared by
// validate.cu and fused_round.cu. Needs AFDEP_TOP_K (the module's specialisation).
#pragma once

#include "common/types.cuh"
#include "layout/route_error.cuh"

#ifndef AFDEP_TOP_K
#error "layout/route_check.cuh needs AFDEP_TOP_K"
#endif

struct Offence {
    u32 cls;    // AFDEP_ROUTE_* (OK: none)
    u32 slot;   // offending slot
    u32 value;  // value bits
    u32 extra;  // extra word
};

// The first offence of token t, in slot order.
static __device__ __forceinline__ Offence afdep_check_token(const i32* __restrict__ idx,
                                                           const float* __restrict__ w, u64 t,
                                                           u64 experts, u64 owned) {
    i32 ids[AFDEP_TOP_K];
#pragma unroll
    for (int s = 0; s < AFDEP_TOP_K; s++) ids[s] = idx[t * AFDEP_TOP_K + s];
    Offence o = {AFDEP_ROUTE_OK, 0, 0, 0};
#pragma unroll
    for (int s = 0; s < AFDEP_TOP_K; s++) {
        const i32 v = ids[s];
        if (v == AFDEP_MASKED) continue;
        o.slot = (u32)s;
        o.value = (u32)v;
        if (v < AFDEP_MASKED) {
            o.cls = AFDEP_ROUTE_NEGATIVE;
            return o;
        }
        if ((u64)v >= experts) {
            o.cls = AFDEP_ROUTE_WIDE;
            o.extra = afdep_sat_u32(experts);
            return o;
        }
        if ((u64)v >= owned) {
            o.cls = AFDEP_ROUTE_DUMMY;
            o.extra = afdep_sat_u32(owned);
            return o;
        }
        const u32 wb = __float_as_uint(w[t * AFDEP_TOP_K + s]);
        if ((wb & 0x7f800000u) == 0x7f800000u) {
            o.cls = AFDEP_ROUTE_NON_FINITE_WEIGHT;
            o.value = wb;
            return o;
        }
        // The earliest equal slot (earlier slots are masked or valid, or we returned there).
        for (int j = 0; j < s; j++) {
            if (ids[j] == v) {
                o.cls = AFDEP_ROUTE_DUPLICATE;
                o.extra = (u32)j;
                return o;
            }
        }
    }
    o.cls = AFDEP_ROUTE_OK;
    return o;
}

// The error word of a source's winning offence key (validate.cu and fused_round.cu): key 0 is
// over capacity (`tokens` > `capacity`), key 1 + t K + slot the first offence of token t, rebuilt
// here from the routes. word[0] is the class, word[1] the rank; the other words as in
// afdep_core::RouteError::to_word. Words the offence does not use are left as they are.
static __device__ __forceinline__ void afdep_route_word(u32 (&word)[AFDEP_ROUTE_ERROR_WORDS],
                                                        u64 key, u32 rank, u64 tokens,
                                                        u64 capacity, const i32* __restrict__ idx,
                                                        const float* __restrict__ w, u64 experts,
                                                        u64 owned) {
    word[1] = rank;
    if (key == 0) {
        word[0] = AFDEP_ROUTE_OVER_CAPACITY;
        word[2] = afdep_sat_u32(tokens);
        word[5] = afdep_sat_u32(capacity);
    } else {
        const u64 t = (key - 1) / AFDEP_TOP_K;
        const Offence o = afdep_check_token(idx, w, t, experts, owned);
        word[0] = o.cls;
        word[2] = afdep_sat_u32(t);
        word[3] = o.slot;
        word[4] = o.value;
        word[5] = o.extra;
    }
}
