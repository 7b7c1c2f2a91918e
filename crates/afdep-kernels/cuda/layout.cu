// Dispatch layout of one source on one GPU: per-expert counts, 64-bit exclusive offsets, and
// the stable counting sort of (token, slot) pairs by expert (afdep_core::layout: within an
// expert, token ascending then slot ascending, i.e. flat slot index i = t * K + k ascending).
// Specialised by AFDEP_EXPERTS (E). Works on flat slot indices, so K is a runtime value.
//
// Design (deterministic, no global atomics):
//  1. afdep_layout_count: block b counts the slots of its chunk (AFDEP_LAYOUT_CHUNK slots) per
//     expert; block_counts[e * nblocks + b].
//  2. afdep_layout_scan_blocks: one block per expert scans its nblocks counts in place
//     (exclusive) and writes the expert's total (u64).
//  3. afdep_layout_scan_experts: one block turns the totals into offsets[0..=E] (u64).
//  4. afdep_layout_scatter: block b walks its chunk in tiles of AFDEP_BLOCK slots; a slot's
//     row is offsets[e] + block_offset[e, b] + (slots of e earlier in the chunk), the last
//     term from a running per-expert cursor, per-warp counts and __match_any_sync ranks.
//     Writes slot_row[i] (AFDEP_NO_ROW for masked slots) and row_slot[row] = i; entries
//     row_slot[total ..] are set to AFDEP_NO_ROW.
// Ids outside 0..E are treated as masked (validated routes never have them), so an invalid
// table cannot make the kernels write out of bounds. Slot indices are u32 (T * K < 2^32).

#include "common/ptx.cuh"
#include "common/types.cuh"

#ifndef AFDEP_EXPERTS
#error "layout.cu needs AFDEP_EXPERTS"
#endif
#define E AFDEP_EXPERTS

#ifndef AFDEP_LAYOUT_CHUNK
#error "layout.cu needs AFDEP_LAYOUT_CHUNK"
#endif
#define CHUNK AFDEP_LAYOUT_CHUNK

static_assert(E >= 1 && E <= 1024, "1..=1024 experts");
static_assert(CHUNK % AFDEP_BLOCK == 0, "the chunk is a whole number of tiles");

static __device__ __forceinline__ bool afdep_valid_expert(i32 e) { return e >= 0 && e < E; }

extern "C" __global__ void __launch_bounds__(AFDEP_BLOCK)
    afdep_layout_count(const i32* __restrict__ idx, u32* __restrict__ block_counts, u64 slots,
                       u32 nblocks) {
    __shared__ u32 hist[E];
    for (u32 e = threadIdx.x; e < E; e += AFDEP_BLOCK) hist[e] = 0;
    __syncthreads();
    const u64 begin = (u64)blockIdx.x * CHUNK;
    const u64 end = begin + CHUNK < slots ? begin + CHUNK : slots;
    for (u64 i = begin + threadIdx.x; i < end; i += AFDEP_BLOCK) {
        const i32 e = idx[i];
        if (afdep_valid_expert(e)) atomicAdd(&hist[e], 1u);
    }
    __syncthreads();
    for (u32 e = threadIdx.x; e < E; e += AFDEP_BLOCK)
        block_counts[(u64)e * nblocks + blockIdx.x] = hist[e];
}

// Exclusive scan of AFDEP_BLOCK values held one per thread; returns this thread's exclusive
// prefix and sets *total to the sum of all.
static __device__ __forceinline__ u64 afdep_block_exclusive_scan(u64 v, u64* total) {
    __shared__ u64 warp_sums[AFDEP_WARPS];
    const u32 lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    u64 x = v;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const u64 y = __shfl_up_sync(0xffffffffu, x, o);
        if (lane >= (u32)o) x += y;
    }
    if (lane == 31) warp_sums[warp] = x;
    __syncthreads();
    u64 before = 0, all = 0;
#pragma unroll
    for (int w = 0; w < AFDEP_WARPS; w++) {
        const u64 s = warp_sums[w];
        if ((u32)w < warp) before += s;
        all += s;
    }
    __syncthreads();  // warp_sums is reused by the next call
    *total = all;
    return before + x - v;
}

extern "C" __global__ void __launch_bounds__(AFDEP_BLOCK)
    afdep_layout_scan_blocks(u32* __restrict__ block_counts, u64* __restrict__ counts,
                             u32 nblocks) {
    const u32 e = blockIdx.x;
    u32* row = block_counts + (u64)e * nblocks;
    u64 carry = 0;
    for (u32 base = 0; base < nblocks; base += AFDEP_BLOCK) {
        const u32 b = base + threadIdx.x;
        const u64 v = b < nblocks ? row[b] : 0;
        u64 total;
        const u64 ex = afdep_block_exclusive_scan(v, &total);
        if (b < nblocks) row[b] = (u32)(carry + ex);
        carry += total;
    }
    if (threadIdx.x == 0) counts[e] = carry;
}

extern "C" __global__ void __launch_bounds__(AFDEP_BLOCK)
    afdep_layout_scan_experts(const u64* __restrict__ counts, u64* __restrict__ offsets) {
    u64 carry = 0;
    for (u32 base = 0; base < E; base += AFDEP_BLOCK) {
        const u32 e = base + threadIdx.x;
        const u64 v = e < E ? counts[e] : 0;
        u64 total;
        const u64 ex = afdep_block_exclusive_scan(v, &total);
        if (e < E) offsets[e] = carry + ex;
        carry += total;
    }
    if (threadIdx.x == 0) offsets[E] = carry;
}

extern "C" __global__ void __launch_bounds__(AFDEP_BLOCK)
    afdep_layout_scatter(const i32* __restrict__ idx, const u32* __restrict__ block_offsets,
                         const u64* __restrict__ offsets, u32* __restrict__ slot_row,
                         u32* __restrict__ row_slot, u64 slots, u32 nblocks) {
    __shared__ u64 base[E];
    __shared__ u32 cursor[E];
    __shared__ u32 warp_counts[AFDEP_WARPS][E];
    const u32 tid = threadIdx.x, warp = tid / 32;
    for (u32 e = tid; e < E; e += AFDEP_BLOCK) {
        base[e] = offsets[e] + block_offsets[(u64)e * nblocks + blockIdx.x];
        cursor[e] = 0;
#pragma unroll
        for (int w = 0; w < AFDEP_WARPS; w++) warp_counts[w][e] = 0;
    }
    const u64 total = offsets[E];
    __syncthreads();
    const u64 chunk = (u64)blockIdx.x * CHUNK;
    for (u32 tile = 0; tile < CHUNK; tile += AFDEP_BLOCK) {
        if (chunk + tile >= slots) break;  // uniform over the block
        const u64 i = chunk + tile + tid;
        const bool in = i < slots;
        const i32 e = in ? idx[i] : AFDEP_MASKED;
        const bool valid = afdep_valid_expert(e);
        if (in && i >= total) row_slot[i] = AFDEP_NO_ROW;
        // Lanes holding the same expert; invalid and out-of-range lanes all hold -1.
        const u32 same = __match_any_sync(0xffffffffu, valid ? e : AFDEP_MASKED);
        const u32 rank = __popc(same & afdep_lanemask_lt());
        if (valid && rank == 0) warp_counts[warp][e] = __popc(same);
        __syncthreads();
        if (valid) {
            u32 r = cursor[e] + rank;
            for (u32 w = 0; w < warp; w++) r += warp_counts[w][e];
            const u64 row = base[e] + r;
            slot_row[i] = (u32)row;
            row_slot[row] = (u32)i;
        } else if (in) {
            slot_row[i] = AFDEP_NO_ROW;
        }
        __syncthreads();
        for (u32 x = tid; x < E; x += AFDEP_BLOCK) {
            u32 n = 0;
#pragma unroll
            for (int w = 0; w < AFDEP_WARPS; w++) {
                n += warp_counts[w][x];
                warp_counts[w][x] = 0;
            }
            cursor[x] += n;
        }
        __syncthreads();
    }
}
