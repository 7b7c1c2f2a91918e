// Emulator replacement of common/ptx.cuh (same functions, plain C++).
#pragma once
#include "emu.h"
#include "common/types.cuh"
static inline float afdep_bf16_to_f32(u16 bits) { return __uint_as_float(((u32)bits) << 16); }
static inline u16 afdep_f32_to_bf16(float v) {
    u32 b = __float_as_uint(v);
    if ((b & 0x7fffffffu) > 0x7f800000u) return (u16)((b >> 16) | 0x40);
    return (u16)((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
}
static inline uint4 afdep_ld_nc_v4(const void* p) { uint4 v; std::memcpy(&v, p, 16); return v; }
static inline void afdep_st_v4(void* p, uint4 v) { std::memcpy(p, &v, 16); }
static inline bool afdep_aligned16(const void* p) { return (((u64)p) & 15u) == 0; }
static inline u32 afdep_lane() { return threadIdx.x % 32; }
static inline u32 afdep_lanemask_lt() { return (1u << afdep_lane()) - 1u; }
static inline float afdep_warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
static inline float afdep_warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v = __fadd_rn(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
