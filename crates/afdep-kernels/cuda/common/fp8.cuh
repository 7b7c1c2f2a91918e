// afdep kernels: fp8 e4m3 payloads on the device, bit for bit afdep_core::fp8 (its module docs
// are the specification):
//   encode   q = cvt.rn.satfinite.e4m3x2.f32 (round to nearest even, ±448 saturation,
//            NaN to a NaN code, the sign of zero kept);
//   decode   exact, by the bits;
//   scale    amax / 448 (IEEE division) per 128-channel group of a token, 1.0 for amax = 0;
//   quantise q_c = encode(x_c / scale) (IEEE division);
//   dequant  bf16(f32(q) * scale): __fmul_rn, then one rounding to bf16.
// The explicit _rn intrinsics keep NVRTC from contracting or approximating anything.
#pragma once

#include "common/ptx.cuh"
#include "common/types.cuh"

// Channels per scale (afdep_core::fp8::GROUP).
#define AFDEP_FP8_GROUP 128
// The largest finite e4m3 magnitude.
#define AFDEP_E4M3_MAX 448.0f

// Two f32 values to two e4m3 codes: lo in bits 0..7, hi in bits 8..15 (the instruction puts
// its first source operand in the upper byte).
static __device__ __forceinline__ u32 afdep_e4m3x2(float lo, float hi) {
    unsigned short d;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(d) : "f"(hi), "f"(lo));
    return (u32)d;
}

// The value of an e4m3 code (exact; NaN for 0x7f and 0xff).
static __device__ __forceinline__ float afdep_e4m3_to_f32(u32 code) {
    const u32 e = (code >> 3) & 15u;
    const u32 m = code & 7u;
    float mag;
    if (e == 0) {
        mag = __fmul_rn(__uint2float_rn(m), 0.001953125f);  // m * 2^-9
    } else if (e == 15u && m == 7u) {
        mag = __uint_as_float(0x7fc00000u);
    } else {
        mag = __uint_as_float(((e + 120u) << 23) | (m << 20));  // (1 + m/8) * 2^(e-7)
    }
    return (code & 0x80u) ? -mag : mag;
}

// The scale of a group whose largest magnitude is amax (finite, >= 0).
static __device__ __forceinline__ float afdep_fp8_scale(float amax) {
    return amax == 0.0f ? 1.0f : __fdiv_rn(amax, AFDEP_E4M3_MAX);
}

// The dequantised bf16 bits of a code with its group's scale.
static __device__ __forceinline__ u16 afdep_fp8_dequant(u32 code, float scale) {
    return afdep_f32_to_bf16(__fmul_rn(afdep_e4m3_to_f32(code), scale));
}

// Four codes of eight packed bf16 values (uint4: 8 bf16), quantised with `scale`: returns
// the low four codes in .x, the high four in .y.
static __device__ __forceinline__ uint2 afdep_fp8_quantise8(uint4 v, float scale) {
    const u32 w[4] = {v.x, v.y, v.z, v.w};
    u32 out[2];
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const u32 a = w[2 * h], b = w[2 * h + 1];
        const float f0 = __fdiv_rn(afdep_bf16_to_f32((u16)(a & 0xffffu)), scale);
        const float f1 = __fdiv_rn(afdep_bf16_to_f32((u16)(a >> 16)), scale);
        const float f2 = __fdiv_rn(afdep_bf16_to_f32((u16)(b & 0xffffu)), scale);
        const float f3 = __fdiv_rn(afdep_bf16_to_f32((u16)(b >> 16)), scale);
        out[h] = afdep_e4m3x2(f0, f1) | (afdep_e4m3x2(f2, f3) << 16);
    }
    return make_uint2(out[0], out[1]);
}

// The largest magnitude of eight packed bf16 values, in f32.
static __device__ __forceinline__ float afdep_bf16x8_amax(uint4 v) {
    const u32 w[4] = {v.x, v.y, v.z, v.w};
    float m = 0.0f;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        m = fmaxf(m, fabsf(afdep_bf16_to_f32((u16)(w[i] & 0xffffu))));
        m = fmaxf(m, fabsf(afdep_bf16_to_f32((u16)(w[i] >> 16))));
    }
    return m;
}

// One step of the warp row quantiser (below) for one lane: half-warp `lane >> 4` takes group
// g = g0 + (lane >> 4) of the row x (hidden / 128 = `groups` groups; 16 lanes × 8 channels,
// the lane's from channel c), its amax reduced over the half-warp. Every lane of the warp must
// take the same step (the same g0). `live`: the lane's group exists; then `codes` holds the
// codes of channels c .. c + 8 and `scale` the group's scale.
struct Fp8Step {
    uint2 codes;
    float scale;
    u32 g;
    u32 c;
    bool live;
};

static __device__ __forceinline__ Fp8Step afdep_fp8_quantise_step(const u16* x, u32 groups,
                                                                  u32 g0, u32 lane) {
    Fp8Step st;
    st.g = g0 + (lane >> 4);
    st.live = st.g < groups;
    st.c = st.g * AFDEP_FP8_GROUP + (lane & 15u) * 8u;
    uint4 v = make_uint4(0u, 0u, 0u, 0u);
    if (st.live) v = *(const uint4*)(x + st.c);
    float amax = afdep_bf16x8_amax(v);
#pragma unroll
    for (int o = 8; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    st.scale = afdep_fp8_scale(amax);
    st.codes = st.live ? afdep_fp8_quantise8(v, st.scale) : make_uint2(0u, 0u);
    return st;
}

// Quantises one row of `hidden` bf16 (a multiple of 128; x 16-byte aligned) with one warp:
// codes to q[0 .. hidden) (8-byte stores), scales to scales[0 .. hidden / 128). Each half-warp
// takes one group per step (afdep_fp8_quantise_step).
// q and scales may be a peer's memory (the dispatch stores straight into the slab).
static __device__ __forceinline__ void afdep_fp8_quantise_row_warp(u8* q, float* scales,
                                                                   const u16* x, u32 hidden,
                                                                   u32 lane) {
    const u32 groups = hidden / AFDEP_FP8_GROUP;
#pragma unroll 1
    for (u32 g0 = 0; g0 < groups; g0 += 2) {
        const Fp8Step st = afdep_fp8_quantise_step(x, groups, g0, lane);
        if (st.live) {
            *(uint2*)(q + st.c) = st.codes;
            if ((lane & 15u) == 0) scales[st.g] = st.scale;
        }
    }
}

// Dequantises 16 codes (uint4) with one scale into 16 bf16 (two uint4: lo = first 8).
static __device__ __forceinline__ void afdep_fp8_dequant16(uint4 codes, float scale, uint4* lo,
                                                           uint4* hi) {
    const u32 w[4] = {codes.x, codes.y, codes.z, codes.w};
    u32 out[8];
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const u32 b0 = afdep_fp8_dequant(w[i] & 0xffu, scale);
        const u32 b1 = afdep_fp8_dequant((w[i] >> 8) & 0xffu, scale);
        const u32 b2 = afdep_fp8_dequant((w[i] >> 16) & 0xffu, scale);
        const u32 b3 = afdep_fp8_dequant(w[i] >> 24, scale);
        out[2 * i] = b0 | (b1 << 16);
        out[2 * i + 1] = b2 | (b3 << 16);
    }
    *lo = make_uint4(out[0], out[1], out[2], out[3]);
    *hi = make_uint4(out[4], out[5], out[6], out[7]);
}
