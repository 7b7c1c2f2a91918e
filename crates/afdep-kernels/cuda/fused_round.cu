// The device round of the fused exchange (afdep_moe::fused::device_round): everything between
// the kernels that the host computed before lives on the device, so that one round is a fixed
// sequence of launches (capturable in a CUDA graph) over capacity-sized buffers.
//
// afdep_round_begin (every rank, first): increments the round in the control block
// (layout/fused.cuh), validates this source's routes of the round (the token count from the
// control block; afdep_core::route::validate's rules, the first offending slot), publishes the
// verdict word to every rank's status area and waits (bounded) for every rank's word of this
// round; the verdict (go, or the lowest rejecting rank's route word) goes into the control
// block, and every later kernel of the round skips when it is not go. afdep_round_bump is the
// host-planned round's counterpart (routes validated on the host): round + 1, verdict go, the
// token count.
// afdep_round_experts (FFN): the reproducible device expert y = bf16(f32(x) * scale[l]) over
// the expanded rows of the plan. The combine of a device round is fused_combine.cu's (its FFN half
// reads the compact view and the device plan; its source half needs only the routes).
// Specialised by AFDEP_TOP_K.

#include "common/ptx.cuh"
#include "common/types.cuh"
#include "layout/fused.cuh"
#include "layout/route_check.cuh"

#ifndef AFDEP_TOP_K
#error "fused_round.cu needs AFDEP_TOP_K"
#endif
#define K AFDEP_TOP_K

#define AFDEP_NO_SOURCE 0xffffffffu

// One block. ws: this rank's (`me`) workspace (control block at ctl_off, status area at
// status_off); peers: the peer table of `world` ranks. src_index: this rank's attention index
// (AFDEP_NO_SOURCE for an FFN-only rank), whose routes idx / w hold up to `cap` tokens.
// experts / owned: the route rules. A status wait runs at most timeout_ns, then records
// AFDEP_FUSED_FAULT_STATUS_WAIT naming the late rank and sets the verdict to faulted.
extern "C" __global__ void __launch_bounds__(AFDEP_BLOCK)
    afdep_round_begin(u8* ws, const u64* __restrict__ peers, u32 world, u32 me, u32 src_index,
                      const i32* __restrict__ idx, const float* __restrict__ w, u64 cap,
                      u64 experts, u64 owned, u64 ctl_off, u64 status_off, u64 timeout_ns,
                      u32* err) {
    __shared__ unsigned long long best;  // smallest offence key (~0: none)
    __shared__ u32 round;
    u32* ctl = (u32*)(ws + ctl_off);
    const u32 tid = threadIdx.x;
    if (blockIdx.x != 0) return;
    if (tid == 0) {
        round = ctl[AFDEP_CTL_ROUND] + 1;
        best = ~0ull;
    }
    __syncthreads();
    const u64 tokens = afdep_ctl_tokens(ctl);
    if (src_index != AFDEP_NO_SOURCE) {
        if (tokens > cap) {
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
    if (tid != 0) return;
    u32 word[AFDEP_ROUTE_ERROR_WORDS] = {0, 0, 0, 0, 0, 0};
    if (src_index != AFDEP_NO_SOURCE && best != ~0ull) {
        word[1] = src_index;
        if (best == 0) {
            word[0] = AFDEP_ROUTE_OVER_CAPACITY;
            word[2] = afdep_sat_u32(tokens);
            word[5] = afdep_sat_u32(cap);
        } else {
            const u64 t = (best - 1) / K;
            const Offence o = afdep_check_token(idx, w, t, experts, owned);
            word[0] = o.cls;
            word[2] = afdep_sat_u32(t);
            word[3] = o.slot;
            word[4] = o.value;
            word[5] = o.extra;
        }
    }
    const u64 mine = ((u64)(round & 1u) * 64 + me) * AFDEP_STATUS_WORDS;
    for (u32 q = 0; q < world; q++) {
        u32* rec = (u32*)((u8*)peers[q] + status_off) + mine;
#pragma unroll
        for (int i = 0; i < AFDEP_ROUTE_ERROR_WORDS; i++) rec[i] = word[i];
        rec[AFDEP_ROUTE_ERROR_WORDS] = 0;
    }
    __threadfence_system();
    for (u32 q = 0; q < world; q++)
        afdep_st_release_sys((u32*)((u8*)peers[q] + status_off) + mine + AFDEP_STATUS_WORDS - 1,
                             round);
    // every rank's word of this round (all of them, also after a rejection: a rank publishes
    // round r + 1 only after reading every word of round r, which keeps the parity slots safe)
    u32 verdict = AFDEP_CTL_GO;
    for (u32 q = 0; q < world; q++) {
        const volatile u32* rec =
            (const volatile u32*)(ws + status_off) + ((u64)(round & 1u) * 64 + q) * AFDEP_STATUS_WORDS;
        if (!afdep_wait_ge((const u32*)(rec + AFDEP_STATUS_WORDS - 1), round, timeout_ns)) {
            afdep_fused_fault(err, AFDEP_FUSED_FAULT_STATUS_WAIT, q, round);
            verdict = AFDEP_CTL_FAULTED;
            break;
        }
        if (verdict == AFDEP_CTL_GO && rec[0] != AFDEP_ROUTE_OK) {
            verdict = AFDEP_CTL_REJECTED;
#pragma unroll
            for (int i = 0; i < AFDEP_ROUTE_ERROR_WORDS; i++) ctl[AFDEP_CTL_ROUTE + i] = rec[i];
        }
    }
    ctl[AFDEP_CTL_VERDICT] = verdict;
    ctl[AFDEP_CTL_ROUND] = round;
}

// One thread: the round of a host-planned round (its routes were validated on the host): round
// + 1, verdict go, this source's token count.
extern "C" __global__ void afdep_round_bump(u32* ctl, u32 tokens) {
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    ctl[AFDEP_CTL_ROUND] += 1;
    ctl[AFDEP_CTL_VERDICT] = AFDEP_CTL_GO;
    ctl[AFDEP_CTL_TOKENS] = tokens;
}

// The local expert of expanded row j: the last l < epr with eo[l] <= j (eo: epr + 1 offsets).
static __device__ __forceinline__ u32 afdep_expert_of_row(const u64* eo, u32 epr, u64 j) {
    u32 lo = 0, hi = epr;  // eo[lo] <= j < eo[hi]
    while (hi - lo > 1) {
        const u32 mid = (lo + hi) / 2;
        if (eo[mid] <= j) lo = mid; else hi = mid;
    }
    return lo;
}

// The plan of this FFN rank (layout/fused.cuh): counts[epr][ns], block starts[epr][ns], expert
// offsets[epr + 1], slab offsets[ns + 1].
struct Plan {
    const u64* cnt;
    const u64* bs;
    const u64* eo;
};

static __device__ __forceinline__ Plan afdep_plan(const u8* ws, u64 plan_off, u32 epr, u32 ns) {
    const u64 n = (u64)epr * ns;
    Plan p;
    p.cnt = (const u64*)(ws + plan_off);
    p.bs = p.cnt + n;
    p.eo = p.bs + n;
    return p;
}

// The device expert of the exchange tests and latency runs, over the plan's expanded rows (at
// exp_off of this rank's workspace ws, at most exp_rows): y[j] = bf16(f32(x[j]) * scale[l]) for
// row j of local expert l (one rounding: bit-reproducible). One warp per row, grid-stride.
extern "C" __global__ void __launch_bounds__(AFDEP_BLOCK)
    afdep_round_experts(const u8* ws, const u32* ctl, u64 plan_off, u32 epr, u32 ns, u64 exp_off,
                        u64 exp_rows, const float* __restrict__ scale, u16* __restrict__ y,
                        u32 hidden) {
    if (afdep_ctl_skip(ctl)) return;
    const Plan p = afdep_plan(ws, plan_off, epr, ns);
    const u64 total = p.eo[epr] < exp_rows ? p.eo[epr] : exp_rows;
    const u16* x = (const u16*)(ws + exp_off);
    const u32 lane = afdep_lane();
    const u64 warps = (u64)gridDim.x * AFDEP_WARPS;
    for (u64 j = (u64)blockIdx.x * AFDEP_WARPS + threadIdx.x / 32; j < total; j += warps) {
        const float s = scale[afdep_expert_of_row(p.eo, epr, j)];
        for (u32 c = lane; c < hidden; c += 32)
            y[j * hidden + c] = afdep_f32_to_bf16(__fmul_rn(afdep_bf16_to_f32(x[j * hidden + c]), s));
    }
}
