// Payload-first copy epilogue, FFN side: waits (bounded) for every source's dispatch flag of
// this round, then expands the slabs into the expanded layout: for every compact row (sources
// in order, slab rows in order) and every slot k whose expanded_row is a row of the expanded
// buffer (not AFDEP_FUSED_NO_ROW), the payload goes to expanded[expanded_row]. Specialised by
// AFDEP_TOP_K (the metadata).

#include "common/fp8.cuh"
#include "common/ptx.cuh"
#include "common/types.cuh"
#include "layout/fused.cuh"

#ifndef AFDEP_TOP_K
#error "fused_epilogue.cu needs AFDEP_TOP_K"
#endif
#define K AFDEP_TOP_K

// The copy epilogues' wait: thread 0 of the block waits (at most timeout_ns each) until every
// source's dispatch flag at flag_off of ws (by rank src_rank[s], s < sources) holds round; a
// timeout records AFDEP_FUSED_FAULT_DISPATCH_WAIT naming that source. Whether every flag came,
// for the whole block (a barrier of the block).
static __device__ __forceinline__ bool afdep_fused_wait_sources(const u8* ws,
                                                                const u32* __restrict__ src_rank,
                                                                u32 sources, u64 flag_off,
                                                                u32 round, u64 timeout_ns,
                                                                u32* err) {
    __shared__ u32 ok;
    if (threadIdx.x == 0) {
        ok = 1;
        AFDEP_FAULT_SKIP(AFDEP_FAULT_SKIP_DISPATCH_WAIT)
        for (u32 s = 0; s < sources && ok; s++) {
            const u32* flag = (const u32*)(ws + flag_off + 4ull * src_rank[s]);
            if (!afdep_wait_ge(flag, round, timeout_ns)) {
                afdep_fused_fault(err, AFDEP_FUSED_FAULT_DISPATCH_WAIT, src_rank[s], round);
                ok = 0;
            }
        }
    }
    __syncthreads();
    return ok != 0u;
}

// ws: this rank's workspace. src_rank[s] / slab_rows[s] for s < sources: the sources' ranks and
// how many rows each stored (slab_starts[s] their exclusive prefix, slab_starts[sources] the
// total). flag_off: the dispatch flags (u32 per source rank). err: the error word u32[4].
// expanded holds exp_rows rows: a slot naming a row past them (never for a consistent plan once
// the flags are raised; the poison shows it) is not copied.
// One warp per compact row, grid-stride; every block first waits for every flag (thread 0 of
// the block, at most timeout_ns), and a block whose wait runs out records the fault and leaves.
// Keep the grid small: the sources' kernels must find SMs to run on while this one waits.
extern "C" __global__ void __launch_bounds__(AFDEP_BLOCK)
    afdep_fused_copy_epilogue(const u8* ws, const u32* __restrict__ src_rank,
                              const u64* __restrict__ slab_starts, u32 sources, u64 flag_off,
                              u64 slab_off, u32 cap, u64 row_bytes, u32 hidden, u32 round,
                              u64 timeout_ns, u32* err, u16* __restrict__ expanded,
                              u64 exp_rows) {
    if (!afdep_fused_wait_sources(ws, src_rank, sources, flag_off, round, timeout_ns, err)) return;
    const u32 lane = afdep_lane();
    const u64 total = slab_starts[sources];
    const u64 warps = (u64)gridDim.x * AFDEP_WARPS;
    const u32 payload = 2u * hidden;
    for (u64 c = (u64)blockIdx.x * AFDEP_WARPS + threadIdx.x / 32; c < total; c += warps) {
        // volatile-free plain loads are fine: the acquire above orders them after the flag
        const u8* row =
            afdep_fused_compact_row(ws, src_rank, slab_starts, sources, slab_off, cap, row_bytes, c);
        const u32* meta = (const u32*)(row + afdep_align16(payload));
        const u64* dst = (const u64*)(meta + 2 + 2 * K);
#pragma unroll 1
        for (int k = 0; k < K; k++) {
            const u64 d = dst[k];
            if (d < exp_rows) afdep_warp_copy(expanded + d * hidden, row, payload, lane);
        }
    }
}

// The copy epilogue of fp8 payloads (the payload kind a compile-time constant, as in the
// dispatch): the same wait, then for every compact row and every slot k whose expanded_row d is
// below exp_rows (AFDEP_FUSED_NO_ROW is not), the row's codes go to expanded_q[d] (hidden u8),
// its scales to expanded_scales[d] (hidden / 128 f32) and its dequantised values
// (common/fp8.cuh) to expanded[d] (hidden bf16, what bf16 experts consume). hidden is a multiple of 128; the
// outputs are 16-byte aligned. Each lane takes 16 codes per step (one group has 8 steps).
extern "C" __global__ void __launch_bounds__(AFDEP_BLOCK)
    afdep_fused_copy_epilogue_fp8(const u8* ws, const u32* __restrict__ src_rank,
                                  const u64* __restrict__ slab_starts, u32 sources,
                                  u64 flag_off, u64 slab_off, u32 cap, u64 row_bytes, u32 hidden,
                                  u32 round, u64 timeout_ns, u32* err, u8* __restrict__ expanded_q,
                                  float* __restrict__ expanded_scales,
                                  u16* __restrict__ expanded, u64 exp_rows) {
    if (!afdep_fused_wait_sources(ws, src_rank, sources, flag_off, round, timeout_ns, err)) return;
    const u32 lane = afdep_lane();
    const u64 total = slab_starts[sources];
    const u64 warps = (u64)gridDim.x * AFDEP_WARPS;
    const u32 groups = hidden / AFDEP_FP8_GROUP;
    const u32 chunks = hidden / 16u;
    for (u64 c = (u64)blockIdx.x * AFDEP_WARPS + threadIdx.x / 32; c < total; c += warps) {
        const u8* row =
            afdep_fused_compact_row(ws, src_rank, slab_starts, sources, slab_off, cap, row_bytes, c);
        const float* scales = (const float*)(row + afdep_align16(hidden));
        const u32* meta = (const u32*)(row + afdep_fused_payload_bytes<AFDEP_PAYLOAD_FP8>(hidden));
        const u64* dst = (const u64*)(meta + 2 + 2 * K);
#pragma unroll 1
        for (u32 v = lane; v < chunks; v += 32) {
            const uint4 codes = *(const uint4*)(row + 16ull * v);
            uint4 lo, hi;
            afdep_fp8_dequant16(codes, scales[v / 8u], &lo, &hi);
#pragma unroll 1
            for (int k = 0; k < K; k++) {
                const u64 d = dst[k];
                if (d >= exp_rows) continue;
                *(uint4*)(expanded_q + d * hidden + 16ull * v) = codes;
                uint4* b = (uint4*)(expanded + d * hidden + 16ull * v);
                b[0] = lo;
                b[1] = hi;
            }
        }
#pragma unroll 1
        for (int k = 0; k < K; k++) {
            const u64 d = dst[k];
            if (d >= exp_rows) continue;
            for (u32 g = lane; g < groups; g += 32) expanded_scales[d * groups + g] = scales[g];
        }
    }
}
