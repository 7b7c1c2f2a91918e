// afdep kernels: PTX wrappers, bf16 conversions, warp helpers and bounded waits.
#pragma once

#include <cuda_bf16.h>

#include "common/types.cuh"

// ---------------------------------------------------------------------------------------------
// bf16 <-> f32. Storage is raw u16 bits on both sides (half::bf16 on the host).

// Exact widening of bf16 bits to f32.
static __device__ __forceinline__ float afdep_bf16_to_f32(u16 bits) {
    return __uint_as_float(((u32)bits) << 16);
}

// f32 to bf16 bits, round to nearest even (the rounding of half::bf16::from_f32 for every
// non-NaN value).
static __device__ __forceinline__ u16 afdep_f32_to_bf16(float v) {
    return __bfloat16_as_ushort(__float2bfloat16_rn(v));
}

// ---------------------------------------------------------------------------------------------
// 16-byte global memory access.

// A 16-byte read through the read-only (non-coherent) path: for inputs that no kernel writes
// while this one runs.
static __device__ __forceinline__ uint4 afdep_ld_nc_v4(const void* p) {
    uint4 v;
    asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

// A 16-byte global store.
static __device__ __forceinline__ void afdep_st_v4(void* p, uint4 v) {
    asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x), "r"(v.y),
                 "r"(v.z), "r"(v.w)
                 : "memory");
}

// Whether a pointer is 16-byte aligned.
static __device__ __forceinline__ bool afdep_aligned16(const void* p) {
    return (((u64)p) & 15u) == 0;
}

// ---------------------------------------------------------------------------------------------
// Warp helpers.

static __device__ __forceinline__ u32 afdep_lane() {
    u32 l;
    asm("mov.u32 %0, %%laneid;" : "=r"(l));
    return l;
}

// Bit i set for every lane i below this one.
static __device__ __forceinline__ u32 afdep_lanemask_lt() {
    u32 m;
    asm("mov.u32 %0, %%lanemask_lt;" : "=r"(m));
    return m;
}

static __device__ __forceinline__ float afdep_warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Butterfly sum: every lane ends with the same value (the order is fixed, so it is
// deterministic, but it is a tree, not an ascending sum).
static __device__ __forceinline__ float afdep_warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = __fadd_rn(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// ---------------------------------------------------------------------------------------------
// Acquire/release flags and bounded waits (used by the exchange kernels: a wait that runs out
// of time reports it instead of hanging; there is no device trap anywhere in afdep).

static __device__ __forceinline__ u32 afdep_ld_acquire_gpu(const u32* p) {
    u32 v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

static __device__ __forceinline__ u32 afdep_ld_acquire_sys(const u32* p) {
    u32 v;
    asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

static __device__ __forceinline__ void afdep_st_release_sys(u32* p, u32 v) {
    asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// A strong (relaxed, system scope) store: after a system fence (__threadfence_system) of the
// same thread it completes a release pattern (the PTX memory model: a fence followed by a strong
// write), so a thread that raises several flags fences once instead of once per flag.
static __device__ __forceinline__ void afdep_st_relaxed_sys(u32* p, u32 v) {
    asm volatile("st.relaxed.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

static __device__ __forceinline__ u64 afdep_globaltimer_ns() {
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// Waits until *flag >= target (system-scope acquire), at most timeout_ns nanoseconds.
// Returns whether the value was reached.
static __device__ __forceinline__ bool afdep_wait_ge(const u32* flag, u32 target, u64 timeout_ns) {
    const u64 start = afdep_globaltimer_ns();
    while (afdep_ld_acquire_sys(flag) < target) {
        if (afdep_globaltimer_ns() - start > timeout_ns) return false;
        __nanosleep(64);
    }
    return true;
}

// 16-byte cp.async (global to shared, L2 only) with zero fill when !pred (src is not read
// then, but must still be a valid address).
static __device__ __forceinline__ void afdep_cp_async16(u32 dst, const void* src, bool pred) {
    const u32 n = pred ? 16u : 0u;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(n)
                 : "memory");
}
// Closes this thread's group of cp.async copies issued since the last commit.
static __device__ __forceinline__ void afdep_cp_async_commit() {
    asm volatile("cp.async.commit_group;" ::: "memory");
}
// Waits until at most N of this thread's committed cp.async groups are still in flight.
template <int N>
static __device__ __forceinline__ void afdep_cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// Programmatic dependent launch (sm_90): the first statement of every kernel of a round's chain
// (the fused_*.cu entries; afdep_moe::fused::round_graph makes the captured graph's edges into
// them programmatic). griddepcontrol.wait holds the kernel until the grids it depends on have
// completed and their memory is visible (it returns at once when the kernel was not launched
// behind a programmatic edge), so the kernel reads nothing before it; launch_dependents then
// lets the next kernel of the chain be launched and wait likewise, resident, instead of being
// launched only when this grid ends.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define AFDEP_GRID_DEPENDENCY_SYNC()                                  \
    do {                                                              \
        asm volatile("griddepcontrol.wait;" ::: "memory");            \
        asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); \
    } while (0)
#else
#define AFDEP_GRID_DEPENDENCY_SYNC() \
    do {                             \
    } while (0)
#endif
