// Minimal CUDA execution emulator: one persistent pool of blockDim threads runs the blocks of a
// grid one after another; warps synchronise through per-warp barriers.
#pragma once
#include <atomic>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <thread>
#include <vector>
#include <memory>

struct dim3 { unsigned x = 1, y = 1, z = 1; };
struct uint4 { unsigned x, y, z, w; };
static inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return {a, b, c, d}; }

extern thread_local dim3 threadIdx, blockIdx;
extern dim3 gridDim, blockDim;

#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static
#define __launch_bounds__(...)
// The emulator has no tensor cores: router.cu leaves its mma kernel out.
#define AFDEP_EMU 1

struct EmuBlock {
    std::barrier<>* block_bar;
    std::vector<std::unique_ptr<std::barrier<>>> warp_bars;
    std::vector<uint64_t> xchg;  // one slot per thread
};
extern EmuBlock* emu_block;

static inline void __syncthreads() { emu_block->block_bar->arrive_and_wait(); }
static inline unsigned emu_lane() { return threadIdx.x % 32; }
static inline unsigned emu_warp() { return threadIdx.x / 32; }
static inline void emu_warp_sync() { emu_block->warp_bars[emu_warp()]->arrive_and_wait(); }

template <class T> static inline T emu_shfl(T v, unsigned src_lane) {
    uint64_t u = 0;
    std::memcpy(&u, &v, sizeof(T));
    emu_block->xchg[threadIdx.x] = u;
    emu_warp_sync();
    uint64_t r = emu_block->xchg[emu_warp() * 32 + src_lane];
    emu_warp_sync();
    T out;
    std::memcpy(&out, &r, sizeof(T));
    return out;
}
template <class T> static inline T __shfl_xor_sync(unsigned, T v, int o) { return emu_shfl(v, emu_lane() ^ (unsigned)o); }
template <class T> static inline T __shfl_up_sync(unsigned, T v, int o) {
    unsigned l = emu_lane();
    return emu_shfl(v, l >= (unsigned)o ? l - o : l);
}
static inline unsigned __match_any_sync(unsigned, int v) {
    emu_block->xchg[threadIdx.x] = (uint64_t)(uint32_t)v;
    emu_warp_sync();
    unsigned m = 0;
    for (unsigned l = 0; l < 32; l++)
        if (emu_block->xchg[emu_warp() * 32 + l] == (uint64_t)(uint32_t)v) m |= 1u << l;
    emu_warp_sync();
    return m;
}
static inline unsigned __reduce_min_sync(unsigned, unsigned v) {
    for (int o = 16; o > 0; o >>= 1) {
        unsigned w = __shfl_xor_sync(0xffffffffu, v, o);
        v = w < v ? w : v;
    }
    return v;
}
static inline int __popc(unsigned v) { return __builtin_popcount(v); }
static inline unsigned __float_as_uint(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }
static inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
static inline float __int_as_float(int u) { float f; std::memcpy(&f, &u, 4); return f; }
static inline float __fadd_rn(float a, float b) { volatile float r = a + b; return r; }
static inline float __fmul_rn(float a, float b) { volatile float r = a * b; return r; }
static inline float __fdiv_rn(float a, float b) { volatile float r = a / b; return r; }
static inline unsigned atomicAdd(unsigned* p, unsigned v) { return std::atomic_ref<unsigned>(*p).fetch_add(v); }
static inline unsigned long long atomicMax(unsigned long long* p, unsigned long long v) {
    std::atomic_ref<unsigned long long> a(*p);
    unsigned long long cur = a.load();
    while (cur < v && !a.compare_exchange_weak(cur, v)) {}
    return cur;
}
#include <math.h>

void emu_launch(dim3 grid, dim3 block, const std::function<void()>& kernel);
