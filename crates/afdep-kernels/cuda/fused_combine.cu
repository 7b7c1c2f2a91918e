// Payload-first combine. FFN side, afdep_fused_combine_store: every expert output row goes
// back into the return area of its source, in the source's workspace through the peer table
// (then afdep_fused_signal raises this FFN rank's combine flag there). Source side,
// afdep_fused_combine: waits (bounded) for every FFN rank's flag of this round, then sums each
// token's slots in the brief's fixed order: FFN ranks ascending, within one the slots ascending,
// each partial sum in f32 as p = p + (w * y) (rounded each, no FMA), added to the total, cast to
// bf16 once. Specialised by AFDEP_TOP_K.

#include "common/ptx.cuh"
#include "common/types.cuh"
#include "layout/fused.cuh"

#ifndef AFDEP_TOP_K
#error "fused_combine.cu needs AFDEP_TOP_K"
#endif
#define K AFDEP_TOP_K

// One warp per row j < rows: y[j] (hidden bf16) to peers[dst_rank[j]] + ret_off +
// ((u64)me * ret_cap + dst_row[j]) * 2 * hidden.
extern "C" __global__ void __launch_bounds__(AFDEP_BLOCK)
    afdep_fused_combine_store(const u16* __restrict__ y, const u32* __restrict__ dst_rank,
                              const u64* __restrict__ dst_row, u64 rows,
                              const u64* __restrict__ peers, u64 ret_off, u32 me, u64 ret_cap,
                              u32 hidden) {
    const u32 lane = afdep_lane();
    const u64 warps = (u64)gridDim.x * AFDEP_WARPS;
    const u32 bytes = 2u * hidden;
    for (u64 j = (u64)blockIdx.x * AFDEP_WARPS + threadIdx.x / 32; j < rows; j += warps) {
        u8* dst = (u8*)peers[dst_rank[j]] + ret_off + ((u64)me * ret_cap + dst_row[j]) * (u64)bytes;
        afdep_warp_copy(dst, y + j * hidden, bytes, lane);
    }
}

// ws: this rank's workspace; ffn_rank[f] for f < ffns: the FFN ranks, ascending; ctl: the
// control block (round, verdict, tokens: layout/fused.cuh; nothing when skipped). slot_row[t*K+k]:
// the slot's row in the return area (ffn_rank * ret_cap + row), AFDEP_FUSED_NO_ROW when masked;
// slot_ffn[t*K+k]: the FFN index of its owner; w: the weights. One warp per token, grid-stride,
// each lane 8 channels at a time; every block first waits for every flag (thread 0, at most
// timeout_ns) and a block whose wait runs out records the fault and leaves.
extern "C" __global__ void __launch_bounds__(AFDEP_BLOCK)
    afdep_fused_combine(const u8* ws, const u32* __restrict__ ffn_rank, u32 ffns,
                        u64 flag_off, u64 ret_off, const u64* __restrict__ slot_row,
                        const u32* __restrict__ slot_ffn, const float* __restrict__ w,
                        const u32* ctl, u32 hidden, u64 timeout_ns, u32* err,
                        u16* __restrict__ out) {
    __shared__ u32 ok;
    if (afdep_ctl_skip(ctl)) return;
    const u32 round = afdep_ctl_round(ctl);
    const u64 tokens = afdep_ctl_tokens(ctl);
    if (threadIdx.x == 0) {
        ok = 1;
        for (u32 f = 0; f < ffns && ok; f++) {
            const u32* flag = (const u32*)(ws + flag_off + 4ull * ffn_rank[f]);
            if (!afdep_wait_ge(flag, round, timeout_ns)) {
                afdep_fused_fault(err, AFDEP_FUSED_FAULT_COMBINE_WAIT, ffn_rank[f], round);
                ok = 0;
            }
        }
    }
    __syncthreads();
    if (!ok) return;
    const u32 lane = afdep_lane();
    const u64 warps = (u64)gridDim.x * AFDEP_WARPS;
    const u16* ret = (const u16*)(ws + ret_off);
    for (u64 t = (u64)blockIdx.x * AFDEP_WARPS + threadIdx.x / 32; t < tokens; t += warps) {
        u64 rows[K];
        u32 owner[K];
        float ws_[K];
#pragma unroll
        for (int k = 0; k < K; k++) {
            rows[k] = slot_row[t * K + k];
            owner[k] = slot_ffn[t * K + k];
            ws_[k] = w[t * K + k];
        }
        for (u32 c0 = lane * 8; c0 < hidden; c0 += 32 * 8) {
            const u32 n = hidden - c0 < 8 ? hidden - c0 : 8;
            float acc[8];
#pragma unroll
            for (int v = 0; v < 8; v++) acc[v] = 0.0f;
            for (u32 f = 0; f < ffns; f++) {
                float part[8];
                bool any = false;
#pragma unroll
                for (int v = 0; v < 8; v++) part[v] = 0.0f;
#pragma unroll
                for (int k = 0; k < K; k++) {
                    if (rows[k] == AFDEP_FUSED_NO_ROW || owner[k] != f) continue;
                    any = true;
                    const u16* y = ret + rows[k] * hidden + c0;
#pragma unroll
                    for (u32 v = 0; v < 8; v++)
                        if (v < n)
                            part[v] = __fadd_rn(part[v], __fmul_rn(ws_[k], afdep_bf16_to_f32(y[v])));
                }
                if (any) {
#pragma unroll
                    for (int v = 0; v < 8; v++) acc[v] = __fadd_rn(acc[v], part[v]);
                }
            }
#pragma unroll
            for (u32 v = 0; v < 8; v++)
                if (v < n) out[t * hidden + c0 + v] = afdep_f32_to_bf16(acc[v]);
        }
    }
}
