// The route error word, shared by the device and afdep_core::error::RouteError::to_word.
//
// word[0] class, word[1] rank, word[2] token (the token count for over-capacity), word[3] slot,
// word[4] value bits (expert id as i32 bits, or the weight as f32 bits), word[5] extra (first
// slot of a duplicate, the expert count of a wide id, the owned experts of a dummy id, the
// capacity). Counts above u32::MAX saturate, as on the host.
#pragma once

#include "common/types.cuh"

#define AFDEP_ROUTE_ERROR_WORDS 6

// Class codes: afdep_core::error::route_class (a host test checks they agree).
#define AFDEP_ROUTE_OK 0u
#define AFDEP_ROUTE_DUPLICATE 1u
#define AFDEP_ROUTE_NEGATIVE 2u
#define AFDEP_ROUTE_WIDE 3u
#define AFDEP_ROUTE_DUMMY 4u
#define AFDEP_ROUTE_NON_FINITE_WEIGHT 5u
#define AFDEP_ROUTE_OVER_CAPACITY 6u
#define AFDEP_ROUTE_MALFORMED 7u
// A non-finite value in an fp8 payload row (checked on the host, and in device rounds by
// fused_round.cu's afdep_round_check_payload; word[3] the channel).
#define AFDEP_ROUTE_NON_FINITE_PAYLOAD 8u
// A NaN or infinite router logit (router.cu's top-k; word[2] the token, word[3] the expert,
// word[4] the logit's f32 bits).
#define AFDEP_ROUTE_NON_FINITE_LOGIT 9u

// The validation state: the error word, then (at word 6, 8-byte aligned) the 64-bit key of the
// first offence, stored inverted (~key) so that an all-zero state means "no offence seen".
// Key 0 is over-capacity; key 1 + token * K + slot is a slot. At word 8 the router's key of the
// first non-finite logit, (token << 32) | expert, also inverted; it wins over any route offence
// (the router ran first, and it masked that token's slots).
#define AFDEP_ROUTE_STATE_WORDS 10
#define AFDEP_ROUTE_STATE_KEY_WORD 6
#define AFDEP_ROUTE_STATE_ROUTER_WORD 8

static __device__ __forceinline__ u32 afdep_sat_u32(u64 v) {
    return v > 0xffffffffull ? 0xffffffffu : (u32)v;
}
