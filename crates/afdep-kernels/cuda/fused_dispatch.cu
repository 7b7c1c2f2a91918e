// Payload-first dispatch, source side: every send row (token, destination FFN rank, slab row)
// is stored into this source's slab in the destination's workspace through the peer table,
// payload then metadata; afdep_fused_signal then raises this source's flag in every
// destination (release, system scope). Not specialised by top-k (the metadata size is an
// argument); the payload kind is a template constant: afdep_fused_dispatch stores bf16 rows,
// afdep_fused_dispatch_fp8 quantises each row while it stores it (codes, then the scales of
// each 128 channels; common/fp8.cuh, bit for bit afdep_core::fp8).

#include "common/fp8.cuh"
#include "common/ptx.cuh"
#include "common/types.cuh"
#include "layout/fused.cuh"

// One warp per send row r < rows: stores the payload of x[token[r]] (hidden bf16; fp8: its
// codes and scales) and meta[r] (meta_words u32) to peers[dst_rank[r]] + slab_off +
// ((u64)me * cap + slab_row[r]) * row_bytes.
template <int PAYLOAD>
static __device__ __forceinline__ void afdep_fused_dispatch_rows(
    const u16* __restrict__ x, const u32* __restrict__ token, const u32* __restrict__ dst_rank,
    const u32* __restrict__ slab_row, const u32* __restrict__ meta, u32 meta_words, u64 rows,
    const u64* __restrict__ peers, u64 slab_off, u32 me, u32 cap, u64 row_bytes, u32 hidden) {
    const u32 lane = afdep_lane();
    const u64 warps = (u64)gridDim.x * AFDEP_WARPS;
    for (u64 r = (u64)blockIdx.x * AFDEP_WARPS + threadIdx.x / 32; r < rows; r += warps) {
        u8* row = (u8*)peers[dst_rank[r]] + slab_off + ((u64)me * cap + slab_row[r]) * row_bytes;
        const u16* src_row = x + (u64)token[r] * hidden;
        AFDEP_FAULT_DELAY(AFDEP_FAULT_LATE_ROWS, r % 5 == 2, 20000);
        if (PAYLOAD == AFDEP_PAYLOAD_FP8) {
            afdep_fp8_quantise_row_warp(row, (float*)(row + afdep_align16(hidden)), src_row,
                                        hidden, lane);
        } else {
            afdep_warp_copy(row, src_row, 2u * hidden, lane);
        }
        u32* m = (u32*)(row + afdep_fused_payload_bytes<PAYLOAD>(hidden));
        const u32* src = meta + r * meta_words;
        for (u32 w = lane; w < meta_words; w += 32) m[w] = src[w];
    }
}

// The entries take the workspace layout by value (afdep_fused_layout, layout/fused.cuh); the
// rows function reads its slab fields.
#define AFDEP_FUSED_DISPATCH_PARAMS                                                               \
    const u16 *__restrict__ x, const u32 *__restrict__ token, const u32 *__restrict__ dst_rank,  \
        const u32 *__restrict__ slab_row, const u32 *__restrict__ meta, u32 meta_words,          \
        u64 rows, const u64 *__restrict__ peers, const afdep_fused_layout L, u32 me
#define AFDEP_FUSED_DISPATCH_ARGS                                                                 \
    x, token, dst_rank, slab_row, meta, meta_words, rows, peers, L.slab_off, me, L.cap,          \
        L.row_bytes, L.hidden

extern "C" __global__ void __launch_bounds__(AFDEP_BLOCK)
    afdep_fused_dispatch(AFDEP_FUSED_DISPATCH_PARAMS) {
    afdep_fused_dispatch_rows<AFDEP_PAYLOAD_BF16>(AFDEP_FUSED_DISPATCH_ARGS);
}

// The same with fp8 payloads: hidden is a multiple of 128 and x 16-byte aligned.
extern "C" __global__ void __launch_bounds__(AFDEP_BLOCK)
    afdep_fused_dispatch_fp8(AFDEP_FUSED_DISPATCH_PARAMS) {
    afdep_fused_dispatch_rows<AFDEP_PAYLOAD_FP8>(AFDEP_FUSED_DISPATCH_ARGS);
}

// Thread i < n stores the round (the control block ctl, layout/fused.cuh) into peers[ranks[i]] +
// flag_off + 4 * me (st.release.sys after a system fence); nothing when the round is skipped.
// Launched after the stores it publishes, on the same stream: the kernel boundary orders them
// before the fence.
extern "C" __global__ void __launch_bounds__(AFDEP_BLOCK)
    afdep_fused_signal(const u64* __restrict__ peers, const u32* __restrict__ ranks, u32 n,
                       u64 flag_off, u32 me, const u32* ctl) {
    if (afdep_ctl_skip(ctl)) return;
    const u32 value = afdep_ctl_round(ctl);
    const u32 i = blockIdx.x * AFDEP_BLOCK + threadIdx.x;
    __threadfence_system();
    AFDEP_FAULT_DELAY(AFDEP_FAULT_LATE_SIGNAL, i < n, 10000);
    if (i < n) afdep_st_release_sys((u32*)((u8*)peers[ranks[i]] + flag_off + 4ull * me), value);
}
