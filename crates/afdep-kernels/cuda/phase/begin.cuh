// The round's start (afdep_round_begin's body; fused_round.cu, fused_front.cu): validation,
// the status all-gather, the verdict and the arm. Needs AFDEP_TOP_K as K, layout/fused.cuh and
// layout/route_check.cuh.
#pragma once

#define AFDEP_NO_SOURCE 0xffffffffu

// a status record: the route error word, then the token count and the request, then the flag
static_assert(AFDEP_STATUS_TOKENS >= AFDEP_ROUTE_ERROR_WORDS &&
                  AFDEP_STATUS_REQUEST > AFDEP_STATUS_TOKENS &&
                  AFDEP_STATUS_REQUEST < AFDEP_STATUS_WORDS - 1,
              "status record layout");
// a gate holds a control block's round, verdict and tokens; one gate per set of the three arms
static_assert(AFDEP_ARM_GATES == 1 << 3 && AFDEP_ARM_AUTO == 3, "arm gates");

// One block. ws: this rank's (`me`) workspace, of layout L (by value, layout/fused.cuh: the
// status area at L.status, the capacity L.cap), ctl its control block; peers: the peer table
// of `world` ranks. src_index: this rank's attention index (AFDEP_NO_SOURCE for an FFN-only
// rank), whose routes idx / w hold up to `cap` tokens.
// experts / owned: the route rules. A status wait runs at most timeout_ns, then records
// AFDEP_FUSED_FAULT_STATUS_WAIT naming the late rank and sets the verdict to faulted.
// payload: null, or (a source with fp8 payloads) the state of afdep_round_check_payload, whose
// word is this source's verdict word when its routes pass. bucket: the arm rule's count-first
// threshold (~0: never). gates: this rank's arm gates (u32[AFDEP_ARM_GATES][AFDEP_CTL_WORDS]).
// The body of afdep_round_begin (fused_round.cu) for the block that runs it (every thread of one
// block calls it; threads other than 0 return early, so a caller that goes on in the same block
// needs a __syncthreads() before it reads the control block).
static __device__ __forceinline__ void afdep_begin_block(
    u8* ws, u32* ctl, const u64* __restrict__ peers, u32 world, u32 me, u32 src_index,
    const i32* __restrict__ idx, const float* __restrict__ w, const afdep_fused_layout L,
    u64 experts, u64 owned, u64 timeout_ns, u32* err, const u32* payload, u64 bucket,
    u32* __restrict__ gates) {
    __shared__ unsigned long long best;  // smallest offence key (~0: none)
    __shared__ u32 round;
    const u32 tid = threadIdx.x;
    if (tid == 0) {
        AFDEP_PROBE_AT(AFDEP_PROBE_BEGIN_IN);
        round = ctl[AFDEP_CTL_ROUND] + 1;
        best = ~0ull;
    }
    __syncthreads();
    const u64 tokens = afdep_ctl_tokens(ctl);
    if (src_index != AFDEP_NO_SOURCE) {
        if (tokens > L.cap) {
            if (tid == 0) best = 0;  // key 0: over capacity
        } else {
            for (u64 t = tid; t < tokens; t += AFDEP_BLOCK) {
                if (*(volatile unsigned long long*)&best < 1ull + t * K) break;
                const Offence o = afdep_check_token(idx, w, t, experts, owned);
                if (o.cls != AFDEP_ROUTE_OK) {
                    atomicMin(&best, 1ull + t * K + o.slot);
                    break;
                }
            }
        }
    }
    __syncthreads();
    // warp 0 publishes and gathers the records, a lane per rank (lane q, q + 32, ...: rank q's
    // record written, its flag raised, rank q's record awaited), so the all-gather costs one
    // handoff's latency instead of `world` in a row; thread 0 then reads the records in rank
    // order as before
    __shared__ u32 word[AFDEP_ROUTE_ERROR_WORDS];
    __shared__ u32 arrived[64];  // the status area's records per parity: world <= 64
    if (tid == 0) AFDEP_PROBE_AT(AFDEP_PROBE_BEGIN_CHECKED);
    if (tid >= 32) return;
    if (tid == 0) {
#pragma unroll
        for (int i = 0; i < AFDEP_ROUTE_ERROR_WORDS; i++) word[i] = 0u;
        if (src_index != AFDEP_NO_SOURCE && best != ~0ull) {
            u32 wd[AFDEP_ROUTE_ERROR_WORDS] = {0, 0, 0, 0, 0, 0};
            afdep_route_word(wd, best, src_index, tokens, L.cap, idx, w, experts, owned);
#pragma unroll
            for (int i = 0; i < AFDEP_ROUTE_ERROR_WORDS; i++) word[i] = wd[i];
        } else if (src_index != AFDEP_NO_SOURCE && payload != nullptr) {
            // valid routes: the payload check's word (zero when every travelling row is finite)
#pragma unroll
            for (int i = 0; i < AFDEP_ROUTE_ERROR_WORDS; i++) word[i] = payload[i];
        }
    }
    __syncwarp();
    const u32 request = ctl[AFDEP_CTL_ARM_REQUEST];
    const u64 mine = ((u64)(round & 1u) * 64 + me) * AFDEP_STATUS_WORDS;
    for (u32 q = tid; q < world; q += 32) {
        u32* rec = (u32*)((u8*)peers[q] + L.status) + mine;
#pragma unroll
        for (int i = 0; i < AFDEP_ROUTE_ERROR_WORDS; i++) rec[i] = word[i];
        rec[AFDEP_STATUS_TOKENS] = afdep_sat_u32(tokens);
        rec[AFDEP_STATUS_REQUEST] = request;
    }
    // each lane's fence orders its own records before its flags (a fence, then strong stores:
    // the release pattern of afdep_st_relaxed_sys)
    __threadfence_system();
    AFDEP_FAULT_DELAY(AFDEP_FAULT_LATE_STATUS, tid == 0, 20000);
    __syncwarp();
    for (u32 q = tid; q < world; q += 32)
        afdep_st_relaxed_sys((u32*)((u8*)peers[q] + L.status) + mine + AFDEP_STATUS_WORDS - 1,
                             round);
    if (tid == 0) AFDEP_PROBE_AT(AFDEP_PROBE_STATUS_OUT);
    for (u32 q = tid; q < world; q += 32) {
        const u32* flag = (const u32*)(ws + L.status) +
                          ((u64)(round & 1u) * 64 + q) * AFDEP_STATUS_WORDS + AFDEP_STATUS_WORDS - 1;
        arrived[q] = afdep_wait_ge(flag, round, timeout_ns) ? 1u : 0u;
    }
    // the lanes' acquires, then the warp barrier: thread 0 reads what every lane awaited
    __syncwarp();
    if (tid != 0) return;
    AFDEP_PROBE_AT(AFDEP_PROBE_STATUS_IN);
    // every rank's record of this round (all of them, also after a rejection: a rank publishes
    // round r + 1 only after reading every record of round r, which keeps the parity slots safe)
    u32 verdict = AFDEP_CTL_GO;
    u64 most = 0;                             // the largest source's token count
    u32 first = AFDEP_ARM_AUTO, odd = world;  // rank 0's request, the first rank that differs
    u32 odd_request = 0;
    for (u32 q = 0; q < world; q++) {
        const volatile u32* rec =
            (const volatile u32*)(ws + L.status) + ((u64)(round & 1u) * 64 + q) * AFDEP_STATUS_WORDS;
        if (arrived[q] == 0u) {
            afdep_fused_fault(err, AFDEP_FUSED_FAULT_STATUS_WAIT, q, round);
            verdict = AFDEP_CTL_FAULTED;
            break;
        }
        if (verdict == AFDEP_CTL_GO && rec[0] != AFDEP_ROUTE_OK) {
            verdict = AFDEP_CTL_REJECTED;
#pragma unroll
            for (int i = 0; i < AFDEP_ROUTE_ERROR_WORDS; i++) ctl[AFDEP_CTL_ROUTE + i] = rec[i];
        }
        const u32 t = rec[AFDEP_STATUS_TOKENS], r = rec[AFDEP_STATUS_REQUEST];
        most = t > most ? t : most;
        if (q == 0) {
            first = r;
        } else if (r != first && odd == world) {
            odd = q;
            odd_request = r;
        }
    }
    // the same records on every rank, so the same arm and verdict
    const u32 arm = first < AFDEP_ARM_AUTO ? first
                    : most >= bucket       ? AFDEP_ARM_SOURCE
                                           : AFDEP_ARM_PAYLOAD_FIRST;
    if (verdict == AFDEP_CTL_GO && odd != world) {
        verdict = AFDEP_CTL_ARMS_DIFFER;
        ctl[AFDEP_CTL_ROUTE] = odd;
        ctl[AFDEP_CTL_ROUTE + 1] = first;
        ctl[AFDEP_CTL_ROUTE + 2] = odd_request;
    }
    // the gates, read by the round's later kernels on this stream (after this kernel)
    for (u32 m = 1; m < AFDEP_ARM_GATES; m++) {
        u32* g = gates + (u64)m * AFDEP_CTL_WORDS;
        g[AFDEP_CTL_ROUND] = round;
        g[AFDEP_CTL_TOKENS] = ctl[AFDEP_CTL_TOKENS];
        g[AFDEP_CTL_TICKET] = 0u;
        g[AFDEP_CTL_VERDICT] = verdict != AFDEP_CTL_GO ? verdict
                               : ((m >> arm) & 1u)     ? AFDEP_CTL_GO
                                                       : AFDEP_CTL_ARM_OFF;
    }
    ctl[AFDEP_CTL_ARM] = arm;
    ctl[AFDEP_CTL_TICKET] = 0u;
    ctl[AFDEP_CTL_VERDICT] = verdict;
    ctl[AFDEP_CTL_ROUND] = round;
    AFDEP_PROBE_AT(AFDEP_PROBE_BEGUN);
}

