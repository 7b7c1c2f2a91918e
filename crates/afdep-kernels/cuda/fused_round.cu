// The device round of the fused exchange (afdep_moe::fused::device_round): everything between
// the kernels that the host computed before lives on the device, so that one round is a fixed
// sequence of launches (capturable in a CUDA graph) over capacity-sized buffers.
//
// afdep_round_begin (every rank, first): increments the round in the control block
// (layout/fused.cuh), validates this source's routes of the round (the token count from the
// control block; afdep_core::route::validate's rules, the first offending slot), publishes the
// verdict word, its token count and its arm request to every rank's status area and waits
// (bounded) for every rank's record of this round; the verdict (go, or the lowest rejecting
// rank's route word, or arms differ) and the arm of the round (every rank's the same: the
// requested one, or for AFDEP_ARM_AUTO the rule over the largest source's token count) go into
// the control block and its arm gates, and every later kernel of the round skips when its
// control block (or gate) is not go.
// afdep_round_stamp: a timestamp of a traced round's phase boundary.
// afdep_round_start_gate: a gated round's start, held until the gate's word reaches the ticket.
// afdep_round_experts (FFN): the reproducible device expert y = bf16(f32(x) * scale[l]) over
// the expanded rows of the plan. The combine of a device round is fused_combine.cu's (its FFN half
// reads the compact view and the device plan; its source half needs only the routes).
// Specialised by AFDEP_TOP_K.

#include "common/probe.cuh"
#include "common/ptx.cuh"
#include "common/types.cuh"
#include "layout/fused.cuh"
#include "layout/route_check.cuh"

#ifndef AFDEP_TOP_K
#error "fused_round.cu needs AFDEP_TOP_K"
#endif
#define K AFDEP_TOP_K

#include "phase/begin.cuh"

// One block: afdep_begin_block (phase/begin.cuh).
extern "C" __global__ void __launch_bounds__(AFDEP_BLOCK)
    afdep_round_begin(u8* ws, u32* ctl, const u64* __restrict__ peers, u32 world, u32 me,
                      u32 src_index, const i32* __restrict__ idx, const float* __restrict__ w,
                      const afdep_fused_layout L, u64 experts, u64 owned, u64 timeout_ns,
                      u32* err, const u32* payload, u64 bucket, u32* __restrict__ gates) {
    AFDEP_GRID_DEPENDENCY_SYNC();
    if (blockIdx.x != 0) return;
    afdep_begin_block(ws, ctl, peers, world, me, src_index, idx, w, L, experts, owned, timeout_ns,
                      err, payload, bucket, gates);
}

// One thread: the device's global nanosecond timer (%globaltimer) into stamps[slot]: a phase
// boundary of a traced round (afdep_moe::fused::trace). Launched between two kernels of the
// rank's stream, it runs after the first finished and before the second starts; inside a
// captured graph it is a kernel node like the others, so replays stamp too.
extern "C" __global__ void afdep_round_stamp(unsigned long long* stamps, u32 slot) {
    AFDEP_GRID_DEPENDENCY_SYNC();
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    stamps[slot] = t;
}

// One thread: the start gate of a gated round (afdep_moe::fused::StartGate). The first launch
// of a gated round (queued on the rank's stream before the round's launches, or the first node
// of a round's graph captured with the gate set), it holds the round until *word reaches this
// rank's next ticket, *seen + 1 (the rank `opener` writes the ticket once every rank of the
// group has queued its round), so that the ranks' rounds start together on the device instead
// of when each rank's host queued them; then *seen = the ticket. The ticket is counted on the
// device (seen, one u32 per rank, zeroed with the gate's word when the gate is set) so that
// one captured graph serves every replay. The wait is bounded: when it runs out it records
// AFDEP_FUSED_FAULT_START_GATE (peer: the opener, round: the ticket) and returns; the round
// then runs, its own waits bounded as always, and the engine reports the fault.
extern "C" __global__ void afdep_round_start_gate(const u32* word, u32* seen, u64 timeout_ns,
                                                  u32* err, u32 opener) {
    AFDEP_GRID_DEPENDENCY_SYNC();
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    const u32 ticket = *(volatile u32*)seen + 1u;
    if (!afdep_wait_ge(word, ticket, timeout_ns))
        afdep_fused_fault(err, AFDEP_FUSED_FAULT_START_GATE, opener, ticket);
    *(volatile u32*)seen = ticket;
    AFDEP_PROBE_AT(AFDEP_PROBE_GATE);
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
// exp_off of this rank's workspace ws, at most exp_rows; the plan at plan_off: the fields of its
// layout L): y[j] = bf16(f32(x[j]) * scale[l]) for row j of local expert l (one rounding:
// bit-reproducible). One warp per row, grid-stride.
extern "C" __global__ void __launch_bounds__(AFDEP_BLOCK)
    afdep_round_experts(const u8* ws, const u32* ctl, const afdep_fused_layout L, u32 epr, u32 ns,
                        const float* __restrict__ scale, u16* __restrict__ y) {
    AFDEP_GRID_DEPENDENCY_SYNC();
    if (afdep_ctl_skip(ctl)) return;
    const Plan p = afdep_plan(ws, L.plan, epr, ns);
    const u64 total = p.eo[epr] < L.exp_rows ? p.eo[epr] : L.exp_rows;
    const u16* x = (const u16*)(ws + L.expanded);
    const u32 lane = afdep_lane();
    const u64 warps = (u64)gridDim.x * AFDEP_WARPS;
    for (u64 j = (u64)blockIdx.x * AFDEP_WARPS + threadIdx.x / 32; j < total; j += warps) {
        const float s = scale[afdep_expert_of_row(p.eo, epr, j)];
        if ((L.hidden & 7u) == 0) {
            // 8 channels per lane, 16-byte loads and stores (rows of a multiple of 8 channels
            // are 16-byte aligned: both areas are 256-byte aligned)
            for (u32 c = lane * 8; c < L.hidden; c += 32 * 8) {
                const uint4 v = *(const uint4*)(x + j * L.hidden + c);
                u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    const u16 lo = afdep_f32_to_bf16(__fmul_rn(afdep_bf16_to_f32((u16)(w[i] & 0xffffu)), s));
                    const u16 hi = afdep_f32_to_bf16(__fmul_rn(afdep_bf16_to_f32((u16)(w[i] >> 16)), s));
                    w[i] = (u32)lo | ((u32)hi << 16);
                }
                *(uint4*)(y + j * L.hidden + c) = make_uint4(w[0], w[1], w[2], w[3]);
            }
        } else {
            for (u32 c = lane; c < L.hidden; c += 32)
                y[j * L.hidden + c] = afdep_f32_to_bf16(__fmul_rn(afdep_bf16_to_f32(x[j * L.hidden + c]), s));
        }
    }
}

// The fp8 payload check of a source's round (before afdep_round_begin, same stream; it reads no
// verdict: the control block still holds the previous round's). x: up to cap tokens × hidden bf16
// rows (cap and hidden: the fields of the layout L), idx their routes; the token count from the
// control block (above cap: nothing to check, the round is rejected over capacity). A token travels
// when one of its K slots is not masked (-1); its first non-finite channel is an offence with key t
// · hidden + channel. One warp per token (grid-stride), the smallest key by an atomic max on its
// inverse at state[AFDEP_PAYLOAD_KEY_WORD] (u64, 0: none); the last block to finish writes the
// route error word (layout/route_error.cuh; afdep_core::fp8::first_non_finite: rank src_index, the
// token, the channel, the value's f32 bits as half's bf16 to f32 gives them: a NaN quieted) into
// state[0 .. 6), or zeros, and resets the key and the block count for the next round.
#define AFDEP_PAYLOAD_STATE_WORDS 16
#define AFDEP_PAYLOAD_DONE_WORD 6
#define AFDEP_PAYLOAD_KEY_WORD 8
extern "C" __global__ void __launch_bounds__(AFDEP_BLOCK)
    afdep_round_check_payload(const u16* __restrict__ x, const i32* __restrict__ idx,
                              const u32* ctl, const afdep_fused_layout L, u32 src_index,
                              u32* state) {
    AFDEP_GRID_DEPENDENCY_SYNC();
    __shared__ u32 last;
    unsigned long long* key = (unsigned long long*)(state + AFDEP_PAYLOAD_KEY_WORD);
    const u64 tokens = afdep_ctl_tokens(ctl);
    const u32 lane = afdep_lane();
    const u64 warps = (u64)gridDim.x * AFDEP_WARPS;
    const u32 chunks = L.hidden / 8u;  // 8 bf16 per 16-byte load (hidden a multiple of 128)
    if (tokens <= L.cap) {
        for (u64 t = (u64)blockIdx.x * AFDEP_WARPS + threadIdx.x / 32; t < tokens; t += warps) {
            bool travels = false;
#pragma unroll
            for (int k = 0; k < K; k++) travels = travels || idx[t * K + k] != AFDEP_MASKED;
            if (!travels) continue;  // the same for every lane of the warp
            // a lower token already offends: nothing here can win (lane 0's read for the warp)
            unsigned long long inv = 0ull;
            if (lane == 0) inv = *(volatile unsigned long long*)key;
            inv = __shfl_sync(0xffffffffu, inv, 0);
            if (inv != 0ull && ~inv < t * L.hidden) break;
            u32 first = 0xffffffffu;
            for (u32 v = lane; v < chunks && first == 0xffffffffu; v += 32) {
                const uint4 c = *(const uint4*)(x + t * L.hidden + 8ull * v);
                const u32 w4[4] = {c.x, c.y, c.z, c.w};
#pragma unroll
                for (int i = 0; i < 8; i++) {
                    const u32 b = (w4[i / 2] >> (16 * (i % 2))) & 0xffffu;
                    if ((b & 0x7f80u) == 0x7f80u && first == 0xffffffffu) first = 8u * v + i;
                }
            }
#pragma unroll
            for (int o = 16; o > 0; o >>= 1)
                first = min(first, __shfl_xor_sync(0xffffffffu, first, o));
            if (lane == 0 && first != 0xffffffffu) atomicMax(key, ~(t * L.hidden + first));
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();  // this block's key before its count
        last = atomicAdd(state + AFDEP_PAYLOAD_DONE_WORD, 1u) == gridDim.x - 1;
    }
    __syncthreads();
    if (!last || threadIdx.x != 0) return;
    __threadfence();  // every block's key (counted before) before the read below
    const unsigned long long inv = atomicExch(key, 0ull);
    u32 word[AFDEP_ROUTE_ERROR_WORDS] = {0, 0, 0, 0, 0, 0};
    if (inv != 0ull) {
        const u64 k = ~inv;
        const u64 t = k / L.hidden;
        const u32 c = (u32)(k % L.hidden);
        u32 b = x[t * L.hidden + c];
        if ((b & 0x7fffu) > 0x7f80u) b |= 0x40u;  // half's bf16 to f32 quiets a NaN
        word[0] = AFDEP_ROUTE_NON_FINITE_PAYLOAD;
        word[1] = src_index;
        word[2] = afdep_sat_u32(t);
        word[3] = c;
        word[4] = b << 16;
    }
#pragma unroll
    for (int i = 0; i < AFDEP_ROUTE_ERROR_WORDS; i++) state[i] = word[i];
    state[AFDEP_PAYLOAD_DONE_WORD] = 0u;
}
