// afdep kernels: fixed-width integer types and the compile-time constants every module gets.
//
// NVRTC compiles without the C++ standard library, so the integer types are spelled here.
// The JIT always defines AFDEP_BLOCK (threads per block of every kernel); modules that are
// specialised by the number of experts or by top-k get AFDEP_EXPERTS / AFDEP_TOP_K.
#pragma once

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef int i32;
typedef unsigned long long u64;
typedef long long i64;

#ifndef AFDEP_BLOCK
#error "AFDEP_BLOCK must be defined by the JIT (threads per block)"
#endif

#define AFDEP_WARPS (AFDEP_BLOCK / 32)

static_assert(AFDEP_BLOCK % 32 == 0, "AFDEP_BLOCK must be a multiple of the warp size");
static_assert(AFDEP_BLOCK <= 1024, "AFDEP_BLOCK must be at most 1024");

// -infinity as f32 (NVRTC has no <cmath> INFINITY).
#define AFDEP_NEG_INF __int_as_float(0xff800000)

// The expert id of a masked route slot (afdep_core::route::MASKED).
#define AFDEP_MASKED (-1)
// The row of a masked slot, and the filler of rows past the last one (u32::MAX).
#define AFDEP_NO_ROW 0xffffffffu
