// Route validation on the device (afdep_core::route::validate, bit for bit in the error word).
// Specialised by AFDEP_TOP_K (K).
//
// Pass 1 (afdep_validate_scan): one thread per token finds the token's first offending slot,
// checking slots in ascending order and, within a slot, negative, wide, dummy, non-finite
// weight, duplicate (masked -1 slots are skipped). The offence with the smallest key
// 1 + token * K + slot wins through a 64-bit atomicMax on the inverted key; key 0 (checked
// before any slot) is over-capacity. Pass 2 (afdep_validate_word, one thread) rebuilds the
// winning offence and writes the error word, then clears the key, so the state is ready for
// the next validation without a memset. When the router's top-k left a non-finite-logit key
// (layout/route_error.cuh), pass 2 reports that instead (the logit re-read from `logits`, a
// row of `logit_experts`), and clears both keys. No trap, no assert: a bad route never breaks the
// context.

#include "common/types.cuh"
#include "layout/route_error.cuh"
#include "layout/route_check.cuh"

#ifndef AFDEP_TOP_K
#error "validate.cu needs AFDEP_TOP_K"
#endif
#define K AFDEP_TOP_K

// state: AFDEP_ROUTE_STATE_WORDS u32 (see layout/route_error.cuh). Grid-stride over tokens.
extern "C" __global__ void __launch_bounds__(AFDEP_BLOCK)
    afdep_validate_scan(const i32* __restrict__ idx, const float* __restrict__ w, u32* state,
                        u64 tokens, u64 experts, u64 owned, u64 capacity) {
    u64* key = (u64*)(state + AFDEP_ROUTE_STATE_KEY_WORD);
    if (tokens > capacity) {
        if (blockIdx.x == 0 && threadIdx.x == 0) atomicMax(key, ~0ull);  // ~(key 0)
        return;
    }
    const u64 stride = (u64)gridDim.x * AFDEP_BLOCK;
    for (u64 t = (u64)blockIdx.x * AFDEP_BLOCK + threadIdx.x; t < tokens; t += stride) {
        // An offence before this token is already known: no later token can win.
        if (*(volatile u64*)key > ~(1ull + t * K)) break;
        const Offence o = afdep_check_token(idx, w, t, experts, owned);
        if (o.cls != AFDEP_ROUTE_OK) {
            atomicMax(key, ~(1ull + t * K + o.slot));
            break;
        }
    }
}

// One thread: turns the winning key into the error word (all zero: no error) and clears it.
extern "C" __global__ void afdep_validate_word(const i32* __restrict__ idx,
                                               const float* __restrict__ w, u32* state,
                                               u64 tokens, u64 experts, u64 owned, u64 capacity,
                                               u32 rank, const float* __restrict__ logits,
                                               u64 logit_experts) {
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    u64* keyp = (u64*)(state + AFDEP_ROUTE_STATE_KEY_WORD);
    u64* routerp = (u64*)(state + AFDEP_ROUTE_STATE_ROUTER_WORD);
    const u64 inv = *keyp;
    const u64 rinv = *routerp;
    u32 word[AFDEP_ROUTE_ERROR_WORDS] = {0, 0, 0, 0, 0, 0};
    if (rinv != 0) {
        const u64 key = ~rinv;
        const u64 t = key >> 32, e = key & 0xffffffffull;
        word[0] = AFDEP_ROUTE_NON_FINITE_LOGIT;
        word[1] = rank;
        word[2] = afdep_sat_u32(t);
        word[3] = (u32)e;
        word[4] = logits != nullptr ? __float_as_uint(logits[t * logit_experts + e]) : 0x7fc00000u;
        *routerp = 0;
    } else if (inv != 0) {
        afdep_route_word(word, ~inv, rank, tokens, capacity, idx, w, experts, owned);
    }
#pragma unroll
    for (int i = 0; i < AFDEP_ROUTE_ERROR_WORDS; i++) state[i] = word[i];
    *keyp = 0;
}
