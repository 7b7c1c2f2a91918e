// The row stores of a source in count-first dispatch (afdep_cf_dispatch_rows; fused_cf_dispatch.cu,
// fused_front.cu): the modes are fused_cf_dispatch.cu's. Needs AFDEP_TOP_K as K,
// common/fp8.cuh, common/ptx.cuh and layout/fused.cuh.
#pragma once

static_assert(K <= 32, "one lane per slot");

#define AFDEP_CF_SOURCE 0u
#define AFDEP_CF_STREAM 1u
#define AFDEP_CF_AUTO 2u
// sig_off of a dispatch that raises no dispatch flags (the streaming arm: its rows have flags)
#define AFDEP_CF_NO_SIGNAL 0xffffffffffffffffull

// ctl: the control block (round, token count; nothing when skipped: layout/fused.cuh).
// x: tokens × hidden bf16; idx, w: tokens × K routes (validated); slot_pos, tok_row: from
// afdep_cf_counts. ffn_rank[f] for f < nf: the FFN ranks. ws: this source's (`me`) workspace
// (its offsets area at offs_off, offset flags at oflag_off). The destination of FFN rank f is
// workspace peers[ffn_rank[f]]: slab row (me, tok_row) at slab_off + (me cap + row) row_bytes
// (metadata at meta_off within the row), exp_rows expanded rows at exp_off (fp8: their codes
// at exp_q_off and scales at exp_sc_off; a row past them is not stored: never for a
// consistent plan, and the FFN rank's poison shows it), row flags at rflag_off.
// One warp per (token, FFN rank) pair, grid-stride; in a waiting mode every block first waits
// (thread 0) and a block whose wait runs out records AFDEP_FUSED_FAULT_OFFSETS_WAIT and leaves.
template <int PAYLOAD>
static __device__ __forceinline__ void afdep_cf_dispatch_rows(
    const u16* __restrict__ x, const i32* __restrict__ idx, const float* __restrict__ w,
    const u32* ctl, const u32* __restrict__ slot_pos, const u32* __restrict__ tok_row,
    const u32* __restrict__ ffn_rank, u32 nf, u32 epr, const u64* __restrict__ peers,
    const u8* ws, u64 offs_off, u64 oflag_off, u64 slab_off, u32 cap, u64 row_bytes,
    u64 meta_off, u64 exp_off, u64 exp_q_off, u64 exp_sc_off, u64 exp_rows, u64 rflag_off,
    u32 hidden, u32 me, u32 mode, u32 gate, u64 timeout_ns, u32* err, u64 sig_off) {
    if (afdep_ctl_skip(ctl)) return;
    if (mode == AFDEP_CF_AUTO) {
        const u32 arm = afdep_ctl_arm(ctl);
        mode = arm == AFDEP_ARM_SOURCE ? AFDEP_CF_SOURCE : AFDEP_CF_STREAM;
        if (arm != AFDEP_ARM_COUNT_FIRST) gate = 0u;
        if (arm == AFDEP_ARM_COUNT_FIRST) sig_off = AFDEP_CF_NO_SIGNAL;
    }
    const u32 round = afdep_ctl_round(ctl);
    const u64 tokens = afdep_ctl_tokens(ctl);
    const bool wait = mode == AFDEP_CF_SOURCE || gate != 0u;
    __shared__ u32 ok;
    __shared__ AfdepSignal sig;
    if (sig_off != AFDEP_CF_NO_SIGNAL) afdep_signal_keep(&sig, ctl, peers, ffn_rank, nf, sig_off, me);
    if (threadIdx.x == 0) ok = 1;
    if (blockIdx.x == 0 && threadIdx.x == 0) AFDEP_PROBE_AT(AFDEP_PROBE_ROWS_IN);
    __syncthreads();
    AFDEP_FAULT_SKIP(AFDEP_FAULT_SKIP_OFFSET_WAIT)
    if (wait) {
        if (threadIdx.x == 0) {
            for (u32 f = 0; f < nf && ok; f++) {
                const u32* flag = (const u32*)(ws + oflag_off + 4ull * ffn_rank[f]);
                if (!afdep_wait_ge(flag, round, timeout_ns)) {
                    afdep_fused_fault(err, AFDEP_FUSED_FAULT_OFFSETS_WAIT, ffn_rank[f], round);
                    ok = 0;
                }
            }
            AFDEP_PROBE_AT(AFDEP_PROBE_ROWS_PLAN);
        }
        __syncthreads();
    }
    const u32 lane = afdep_lane();
    const u64 warps = (u64)gridDim.x * AFDEP_WARPS;
    // a block whose wait ran out stores nothing (but still takes its ticket below)
    const u64 pairs = ok ? tokens * nf : 0;
    const u32 payload = 2u * hidden;
    for (u64 p = (u64)blockIdx.x * AFDEP_WARPS + threadIdx.x / 32; p < pairs; p += warps) {
        const u32 row = tok_row[p];
        if (row == AFDEP_NO_ROW) continue;
        const u64 t = p / nf;
        const u32 f = (u32)(p % nf);
        u8* dst = (u8*)peers[ffn_rank[f]];
        u8* slab = dst + slab_off + ((u64)me * cap + row) * row_bytes;
        u32* meta = (u32*)(slab + meta_off);
        // lane k < K: slot k's local id, weight and row
        u64 erow = AFDEP_FUSED_NO_ROW;
        if (lane < K) {
            const i32 e = idx[t * K + lane];
            const bool mine = e >= 0 && (u32)e >= f * epr && (u32)e < (f + 1) * epr;
            i32 l = -1;
            float wt = 0.0f;
            if (mine) {
                l = e - (i32)(f * epr);
                wt = w[t * K + lane];
                erow = slot_pos[t * K + lane];
                if (mode == AFDEP_CF_SOURCE) {
                    const u64* offs = (const u64*)(ws + offs_off) + (u64)ffn_rank[f] * epr;
                    erow += offs[l];
                }
            }
            meta[2 + lane] = (u32)l;
            meta[2 + K + lane] = __float_as_uint(wt);
            ((u64*)(meta + 2 + 2 * K))[lane] = erow;
        }
        if (lane == 0) {
            meta[0] = (u32)t;
            meta[1] = 0u;
        }
        const u16* src = x + t * hidden;
        AFDEP_FAULT_DELAY(AFDEP_FAULT_LATE_ROWS, t % 5 == 2, 20000);
        if (mode == AFDEP_CF_SOURCE) {
            if (PAYLOAD == AFDEP_PAYLOAD_FP8) {
                // each group quantised once, its codes and scale stored to every expanded row
                u8* q = dst + exp_q_off;
                float* sc = (float*)(dst + exp_sc_off);
                const u32 groups = hidden / AFDEP_FP8_GROUP;
#pragma unroll 1
                for (u32 g0 = 0; g0 < groups; g0 += 2) {
                    const Fp8Step st = afdep_fp8_quantise_step(src, groups, g0, lane);
#pragma unroll 1
                    for (int k = 0; k < K; k++) {
                        const u64 r = __shfl_sync(0xffffffffu, erow, k);
                        if (!st.live || r >= exp_rows) continue;
                        *(uint2*)(q + r * hidden + st.c) = st.codes;
                        if ((lane & 15u) == 0) sc[r * groups + st.g] = st.scale;
                    }
                }
            } else {
                u16* expanded = (u16*)(dst + exp_off);
#pragma unroll 1
                for (int k = 0; k < K; k++) {
                    const u64 r = __shfl_sync(0xffffffffu, erow, k);
                    if (r < exp_rows) afdep_warp_copy(expanded + r * hidden, src, payload, lane);
                }
            }
        } else {
            if (PAYLOAD == AFDEP_PAYLOAD_FP8) {
                afdep_fp8_quantise_row_warp(slab, (float*)(slab + afdep_align16(hidden)), src,
                                            hidden, lane);
            } else {
                afdep_warp_copy(slab, src, payload, lane);
            }
            __syncwarp();
            if (lane == 0) {
                __threadfence_system();
                AFDEP_FAULT_DELAY(AFDEP_FAULT_LATE_ROW_FLAGS, row % 7 == 3, 10000);
                afdep_st_release_sys((u32*)(dst + rflag_off + 4ull * ((u64)me * cap + row)), round);
            }
        }
        if (lane == 0) AFDEP_PROBE_AT(AFDEP_PROBE_ROWS_COPIED);
    }
    // the dispatch flags (sig_off != AFDEP_CF_NO_SIGNAL): the grid's last block raises this
    // source's flag at sig_off in every FFN rank's workspace once every block's rows are stored
    // (as the separate signal kernel did: also after a wait that ran out, whose fault the
    // round's verdict reports)
    if (sig_off != AFDEP_CF_NO_SIGNAL && afdep_signal_last(&sig)) {
        AFDEP_PROBE_AT(AFDEP_PROBE_ROWS_TICKET);
        AFDEP_FAULT_DELAY(AFDEP_FAULT_LATE_SIGNAL, true, 10000);
        afdep_signal_raise(&sig);
    }
    if (threadIdx.x == 0) AFDEP_PROBE_AT(AFDEP_PROBE_ROWS_OUT);
}

// The arguments of afdep_cf_dispatch_rows from a caller whose names are its parameters' and
// whose layout is `L` (afdep_fused_layout).
#define AFDEP_CF_DISPATCH_ARGS                                                                    \
    x, idx, w, ctl, slot_pos, tok_row, ffn_rank, nf, epr, peers, ws, L.offsets, L.offset_flags,  \
        L.slab_off, L.cap, L.row_bytes, L.meta_off, L.expanded, L.exp_q, L.exp_scales,           \
        L.exp_rows, L.row_flags, L.hidden, me, mode, gate, timeout_ns, err, sig_off
