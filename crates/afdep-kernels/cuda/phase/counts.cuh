// The count and plan phases of count-first dispatch (fused_counts.cu, fused_front.cu): a
// source's counts and their publication, an FFN rank's plan. Needs AFDEP_TOP_K as K and
// layout/fused.cuh.
#pragma once

// ctl: the control block (layout/fused.cuh: the token count; nothing when the round is skipped).
// idx: tokens × K expert ids (validated routes: -1 or an owned id < nf * epr).
// Warp w < nf * epr (grid-stride) scans the tokens in order for expert w: slot_pos[t*K+k] = the
// number of earlier tokens routed to w (masked slots are not written), counts[w] = its rows.
// Warp nf * epr + f does the same for FFN rank f (experts [f epr, (f+1) epr)): tok_row[t*nf+f] =
// the number of earlier tokens with a slot there, or AFDEP_NO_ROW; counts[nf epr + f] = its
// distinct tokens.
// Then the publication (what afdep_cf_publish_counts did as a kernel of its own): the grid's
// last block (afdep_last_block) stores, for every FFN rank f < nf, counts[f epr .. (f+1) epr)
// and counts[nf epr + f] into row `me` of the counts area of workspace peers[ffn_rank[f]], and
// then raises this source's count flag `me` there to the round (release, system scope).
// afdep_counts_rows: the counting (every block of the grid, a round that is not skipped);
// afdep_counts_publish: the publication (the grid's last block, afdep_last_block).
static __device__ __forceinline__ void afdep_counts_rows(const i32* __restrict__ idx,
                                                         const u32* ctl, u32 nf, u32 epr,
                                                         u32* __restrict__ slot_pos,
                                                         u32* __restrict__ tok_row, u64* counts) {
    const u64 tokens = afdep_ctl_tokens(ctl);
    const u32 lane = afdep_lane();
    const u32 lt = afdep_lanemask_lt();
    const u64 owned = (u64)nf * epr;
    const u64 jobs = owned + nf;
    const u64 warps = (u64)gridDim.x * AFDEP_WARPS;
    for (u64 w = (u64)blockIdx.x * AFDEP_WARPS + threadIdx.x / 32; w < jobs; w += warps) {
        u64 run = 0;
        if (w < owned) {
            const i32 e = (i32)w;
#pragma unroll 1
            for (u64 base = 0; base < tokens; base += 32) {
                const u64 t = base + lane;
                int hit = -1;
                if (t < tokens) {
#pragma unroll
                    for (int k = 0; k < K; k++)
                        if (idx[t * K + k] == e) hit = k;
                }
                const u32 m = __ballot_sync(0xffffffffu, hit >= 0);
                if (hit >= 0) slot_pos[t * K + hit] = (u32)(run + __popc(m & lt));
                run += __popc(m);
            }
        } else {
            const u32 f = (u32)(w - owned);
            const i32 lo = (i32)(f * epr), hi = (i32)((f + 1) * epr);
#pragma unroll 1
            for (u64 base = 0; base < tokens; base += 32) {
                const u64 t = base + lane;
                bool has = false;
                if (t < tokens) {
#pragma unroll
                    for (int k = 0; k < K; k++) {
                        const i32 e = idx[t * K + k];
                        has = has || (e >= lo && e < hi);
                    }
                }
                const u32 m = __ballot_sync(0xffffffffu, has);
                if (t < tokens) tok_row[t * nf + f] = has ? (u32)(run + __popc(m & lt)) : AFDEP_NO_ROW;
                run += __popc(m);
            }
        }
        if (lane == 0) counts[w] = run;
    }
}

static __device__ __forceinline__ void afdep_counts_publish(const u32* ctl, u32 nf, u32 epr,
                                                            const u64* counts,
                                                            const u64* __restrict__ peers,
                                                            const u32* __restrict__ ffn_rank,
                                                            const afdep_fused_layout L, u32 me) {
    // the last block: every block's counts are fenced before its ticket; read them from L2
    const u64 owned = (u64)nf * epr;
    const u32 round = afdep_ctl_round(ctl);
    if (threadIdx.x == 0) AFDEP_PROBE_AT(AFDEP_PROBE_COUNTS_LAST);
    AFDEP_FAULT_DELAY(AFDEP_FAULT_LATE_COUNTS, threadIdx.x == 0, 30000);
    __syncthreads();
    const u64 row = (u64)epr + 1;
    for (u64 i = threadIdx.x; i < (u64)nf * row; i += AFDEP_BLOCK) {
        const u32 f = (u32)(i / row);
        const u64 l = i % row;
        u64* dst = (u64*)((u8*)peers[ffn_rank[f]] + L.counts) + (u64)me * row;
        dst[l] = __ldcg(l < epr ? counts + (u64)f * epr + l : counts + owned + f);
    }
    __syncthreads();
    afdep_raise_flags(peers, ffn_rank, nf, L.count_flags, me, round);
    if (threadIdx.x == 0) AFDEP_PROBE_AT(AFDEP_PROBE_COUNTS_OUT);
}

// One block. ws: this FFN rank's (`me`) workspace; src_rank[s] for s < ns: the sources' ranks.
// Thread 0 waits for every source's count flag (>= round, at most timeout_ns each; a timeout
// records AFDEP_FUSED_FAULT_COUNTS_WAIT naming the source and the block leaves). Then the plan
// (layout/fused.cuh) is written at plan_off, and source s's block starts (block_starts[l][s]
// for l < epr) go to row `me` of the offsets area of workspace peers[src_rank[s]], whose offset
// flag `me` is then raised to `round` (release, system scope). The round comes from the control
// block ctl (layout/fused.cuh); nothing runs when the round is skipped.
// pre: AFDEP_PLAN_PRE_NONE, or a wait before the count flags' (what afdep_cf_wait did as a
// kernel of its own before this one in a payload-first round): for every source's flag at
// pre_off (the dispatch flags), a timeout recorded as pre_code, skipped when the error word
// already holds a fault; always (AFDEP_PLAN_PRE_ALWAYS) or when the round takes the
// payload-first arm (AFDEP_PLAN_PRE_PAYLOAD_FIRST: an Auto round's one launch; ctl then the
// control block itself). Its outcome does not stop the plan (as with the separate wait).
#define AFDEP_PLAN_PRE_NONE 0u
#define AFDEP_PLAN_PRE_ALWAYS 1u
#define AFDEP_PLAN_PRE_PAYLOAD_FIRST 2u
static __device__ __forceinline__ void afdep_plan_block(
    u8* ws, const u64* __restrict__ peers, const u32* __restrict__ src_rank, u32 ns, u32 epr,
    const afdep_fused_layout L, u32 me, const u32* ctl, u64 timeout_ns, u32* err, u32 pre,
    u64 pre_off, u32 pre_code) {
    const u64 counts_off = L.counts, cflag_off = L.count_flags, plan_off = L.plan;
    const u64 offs_off = L.offsets, oflag_off = L.offset_flags;
    __shared__ u32 ok;
    __shared__ u64 part[AFDEP_BLOCK];
    if (afdep_ctl_skip(ctl)) return;
    const u32 round = afdep_ctl_round(ctl);
    const u32 tid = threadIdx.x;
    if (tid == 0) AFDEP_PROBE_AT(AFDEP_PROBE_PLAN_ENTER);
    // the waits by warp 0, every source's flag at once (afdep_wait_flags_warp)
    if (tid < 32) {
        const bool pre_wait = pre == AFDEP_PLAN_PRE_ALWAYS ||
                              (pre == AFDEP_PLAN_PRE_PAYLOAD_FIRST &&
                               afdep_ctl_arm(ctl) == AFDEP_ARM_PAYLOAD_FIRST);
        // lane 0's reading of the error word for the whole warp (the warp wait needs all 32 lanes)
        const bool faulted = __shfl_sync(0xffffffffu, afdep_fused_faulted(err) ? 1u : 0u, 0) != 0u;
        if (pre_wait && !faulted) {
            AFDEP_FAULT_SKIP(AFDEP_FAULT_SKIP_DISPATCH_WAIT)
            afdep_wait_flags_warp(ws, pre_off, src_rank, ns, round, timeout_ns, err, pre_code);
        }
        const bool got = afdep_wait_flags_warp(ws, cflag_off, src_rank, ns, round, timeout_ns,
                                               err, AFDEP_FUSED_FAULT_COUNTS_WAIT);
        if (tid == 0) ok = got ? 1u : 0u;
    }
    __syncthreads();
    if (!ok) return;
    if (tid == 0) AFDEP_PROBE_AT(AFDEP_PROBE_PLAN_IN);
    const u64 n = (u64)epr * ns;
    AFDEP_FAULT_DELAY(AFDEP_FAULT_LATE_PREFIX, tid == 0, 20000);
    u64* cnt = (u64*)(ws + plan_off);
    u64* bs = cnt + n;
    u64* eo = bs + n;
    u64* so = eo + epr + 1;
    const u64* in = (const u64*)(ws + counts_off);
    for (u64 i = tid; i < n; i += AFDEP_BLOCK) {
        const u64 l = i / ns, s = i % ns;
        cnt[i] = in[(u64)src_rank[s] * (epr + 1) + l];
    }
    __syncthreads();
    // exclusive prefix over cnt (expert-major, source-minor): a segment per thread, the segment
    // sums scanned by thread 0, then each segment written
    const u64 seg = (n + AFDEP_BLOCK - 1) / AFDEP_BLOCK;
    const u64 a = (u64)tid * seg;
    const u64 b = a + seg < n ? a + seg : n;
    u64 sum = 0;
    for (u64 i = a; i < b; i++) sum += cnt[i];
    part[tid] = sum;
    __syncthreads();
    // the segment sums' exclusive scan by warp 0: each lane a run of PER sums, the runs' totals
    // scanned across the warp by shuffles (a thread's serial loop over AFDEP_BLOCK shared-memory
    // words was a few µs on the round's critical path)
    static_assert(AFDEP_BLOCK % 32 == 0, "whole warps");
    constexpr u32 PER = AFDEP_BLOCK / 32;
    if (tid < 32) {
        u64 own = 0;
#pragma unroll
        for (u32 i = 0; i < PER; i++) own += part[tid * PER + i];
        u64 incl = own;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const u64 v = __shfl_up_sync(0xffffffffu, incl, o);
            if ((int)tid >= o) incl += v;
        }
        u64 run = incl - own;
#pragma unroll
        for (u32 i = 0; i < PER; i++) {
            const u64 v = part[tid * PER + i];
            part[tid * PER + i] = run;
            run += v;
        }
        if (tid == 31) eo[epr] = incl;
    }
    if (tid == 0) {
        u64 srun = 0;
        for (u32 s = 0; s < ns; s++) {
            so[s] = srun;
            srun += in[(u64)src_rank[s] * (epr + 1) + epr];
        }
        so[ns] = srun;
    }
    __syncthreads();
    u64 run = part[tid];
    for (u64 i = a; i < b; i++) {
        bs[i] = run;
        run += cnt[i];
    }
    __syncthreads();
    for (u32 l = tid; l < epr; l += AFDEP_BLOCK) eo[l] = bs[(u64)l * ns];
    for (u64 i = tid; i < n; i += AFDEP_BLOCK) {
        const u64 s = i / epr, l = i % epr;
        u64* dst = (u64*)((u8*)peers[src_rank[s]] + offs_off) + (u64)me * epr + l;
        *dst = bs[l * ns + s];
    }
    __syncthreads();
    if (tid == 0) {
        __threadfence_system();
        AFDEP_FAULT_DELAY(AFDEP_FAULT_LATE_OFFSET_FLAGS, true, 20000);
        // one fence, then strong stores: a release pattern per flag (afdep_st_relaxed_sys)
        for (u32 s = 0; s < ns; s++)
            afdep_st_relaxed_sys((u32*)((u8*)peers[src_rank[s]] + oflag_off + 4ull * me), round);
        AFDEP_PROBE_AT(AFDEP_PROBE_PLAN_OUT);
    }
}

