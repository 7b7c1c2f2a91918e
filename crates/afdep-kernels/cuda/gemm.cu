// Grouped GEMM for the MoE layer: bf16 operands, f32 accumulation on Hopper's warpgroup tensor
// cores (wgmma.mma_async, SASS HGMMA), both operands read from shared memory through matrix
// descriptors; the operands are staged into the swizzled layouts wgmma reads (64- or 128-byte
// swizzle for the K-major tiles, by BK; 128-byte for the M/N-major ones) by a multi-stage
// pipeline; a persistent grid whose tile schedule is derived from the group offsets on the
// device (no host sync), 64-bit row offsets, and one epilogue per layer step.
//
// Operand loads: TMA where the operand is a dense tensor, cp.async where it is gathered.
// - TMA (cp.async.bulk.tensor, SASS UTMALDG): the weights (B of every ROWS problem: a 3-D
//   tensor map [groups][rows][cols]) and A of the ROWS problems when its rows are contiguous
//   (the sorted strategy's expert-sorted rows, the dense shared expert and router: a 2-D map
//   [rows][k]). One thread issues a stage's boxes against the stage's mbarrier with the
//   stage's byte count; the hardware writes the swizzled layout and zero-fills what lies
//   outside the tensor. Rows of a box past the group's end belong to the next group (or are
//   zero): their accumulators are discarded by the epilogue.
// - cp.async (SASS LDGSTS), 16 bytes per thread per chunk: A rows read through an index (the
//   gather strategies: slot -> token), both operands of the classic kernel's weight gradients
//   (gathered, and cut at the group's end inside a K tile, which a box cannot express; the ws
//   KSUM kernel at the end of this file loads the contiguous ones by TMA and zeroes the rows
//   past the cut in shared memory), and any dense operand the
//   host could not describe by a tensor map (alignment; a K split between W1 and W3 that is not
//   a multiple of BK). The host chooses per launch (GemmProblem::tma).
// Every mbarrier wait is bounded (GemmProblem::wait_ms): a wait that runs out records a fault in
// the context's fault word (afdep_kernels::GpuContext::take_fault) and the block stops waiting;
// the host turns the word into a typed error. There is no trap.
//
// Two shapes of problem (see layout/gemm_problem.cuh for the descriptor):
// - ROWS: group g owns output rows offsets[g] .. offsets[g+1] (M varies per group); N and K are
//   fixed; B is per group (b + g * b_gs). Forward up/down projections and data gradients.
// - KSUM: group g owns the K-rows offsets[g] .. offsets[g+1]; its output is an M x N matrix
//   C_g = sum_r A(r, :)^T B(r, :) (weight gradients). The K range of a group is split in
//   `splits` chunks; each chunk writes an f32 partial, summed in split order by
//   afdep_gemm_reduce (deterministic, no atomics). With one chunk (splits == 1, the host's
//   choice wherever the tiles alone fill the GPU) the tile's sum is final and is stored as
//   bf16 into the gradient itself (c2, and c3 from column b_split on): no partials, no reduce.
//
// Block: 256 threads = two warpgroups; a 128 x 128 output tile, warpgroup w computes rows
// 64w .. 64w + 63 with one m64n128k16 wgmma per 16 of K. Pipeline: STAGES shared-memory stages
// of a 128 x BK A tile and a 128 x BK B tile; PREFETCH k-tiles are loading while one is
// multiplied and the wgmma of the previous one may still be reading (so STAGES =
// PREFETCH + 2). BK, PREFETCH and the blocks per SM the ROWS kernels are compiled for
// (AFDEP_GEMM_MIN_BLOCKS) are set below; afdep_kernels::ops::gemm mirrors them.
//
// A second engine for the ROWS problems, warp-specialised (a producer warpgroup, two wgmma
// m64n256k16 consumer warpgroups, 128 x 256 tiles, full/empty mbarriers), is at the end of this
// file (gemm_rows_ws, the afdep_gemm_ws_* entry points); the host picks one per problem
// (afdep_kernels::ops::gemm::engine_for). After it, the same engine for the KSUM problems
// (gemm_ksum_ws, afdep_gemm_ws_wgrad), off unless asked (ops::gemm::wgrad_engine_for).
//
// Summation order: each output is one f32 accumulator fed by the tensor-core products in
// ascending k-tile order (the order inside one wgmma is the hardware's). This is not the CPU
// oracle's order; results agree within the bf16 tolerance documented in afdep-moe.

#include "common/ptx.cuh"
#include "common/types.cuh"
#include "layout/gemm_problem.cuh"

static_assert(AFDEP_BLOCK == 256, "the GEMM tiling assumes two warpgroups");

#define BM 128
#define BN 128
// Defaults chosen by measurement on the H200 (docs/perf/moe.md, 2026-12-03 (c)): K = 32 per
// stage, 4 k-tiles ahead (6 stages, 97 KiB), two blocks per SM.
#ifndef AFDEP_GEMM_BK
#define AFDEP_GEMM_BK 32
#endif
#ifndef AFDEP_GEMM_MIN_BLOCKS
#define AFDEP_GEMM_MIN_BLOCKS 2
#endif
#ifndef AFDEP_GEMM_PREFETCH
#define AFDEP_GEMM_PREFETCH 4
#endif
// K per stage: 64 (one 128-byte swizzle row of bf16) or 32 (64-byte rows, 64-byte swizzle
// for the K-major tiles).
#define BK AFDEP_GEMM_BK
#define PREFETCH AFDEP_GEMM_PREFETCH
#define STAGES (PREFETCH + 2)
static_assert(BK == 64 || BK == 32, "BK is 64 or 32");
// Bytes of one K-major tile row, its 16-byte chunks, and the K-major 8-row atom.
#define KROW_BYTES (BK * 2)
#define KROW_CHUNKS (BK / 8)
#define KATOM_BYTES (8 * KROW_BYTES)
// Bytes between the two 64-column halves of an M/N-major tile (BK rows of 128 bytes).
#define MNHALF_BYTES (BK * 128)
// Layout type of the K-major tiles in the descriptor: 1 = 128-byte, 2 = 64-byte swizzle.
#define KMAJ_SWIZZLE (BK == 64 ? 1ull : 2ull)
// One operand tile: 128 rows of BK bf16 (K-major) or BK rows of 128 bf16 (M/N-major).
#define TILE_BYTES (BM * BK * 2)
#define STAGE_BYTES (2 * TILE_BYTES)
// The swizzle atom (8 rows of 128 bytes): stages start on this alignment.
#define ATOM_BYTES 1024
// Dynamic shared memory of every GEMM kernel: the stages plus the slack to align them.
// Must equal afdep_kernels::ops::gemm::SMEM_BYTES.
#define SMEM_DYN_BYTES (STAGES * STAGE_BYTES + ATOM_BYTES)

static_assert(BM == BN, "square tiles: both operand tiles have the same shape");
static_assert(STAGES <= 32, "the mbarrier phase bits of one thread fit a u32");

// ---------------------------------------------------------------------------------------------
// Shared-memory tile layouts: wgmma's canonical swizzled layouts. With the 128-byte swizzle a
// 16-byte chunk c of a 128-byte row r lands at chunk position c ^ (r % 8) (8 rows form a
// 1024-byte atom); with the 64-byte swizzle, chunk c of a 64-byte row r lands at
// c ^ ((r / 2) % 4) (8 rows form a 512-byte atom). Both are the XOR of address bits [4, 7)
// with bits [7, 10), which is what the hardware undoes.
//
// K-major tile (rows = m or n, 128 of them; BK k per row): atoms of 8 rows follow each other
// (stride KATOM_BYTES: the descriptor's SBO; LBO is unused when swizzled).
static __device__ __forceinline__ u32 kmaj_off(u32 r, u32 c) {
    const u32 pos = BK == 64 ? (c ^ (r & 7)) : (c ^ ((r >> 1) & 3));
    return r * KROW_BYTES + (pos << 4);  // bytes
}
// M/N-major tile (rows = k, BK of them; 128 m/n per row = 16 chunks, 128-byte swizzle): two
// halves of 64 m/n (MNHALF_BYTES apart: LBO), each BK / 8 atoms of 8 k-rows (1024 bytes
// apart: SBO).
static __device__ __forceinline__ u32 mnmaj_off(u32 r, u32 c) {
    return (c >> 3) * MNHALF_BYTES + (r >> 3) * 1024 + (r & 7) * 128 +
           (((c & 7) ^ (r & 7)) << 4);
}

static __device__ __forceinline__ u32 smem_u32(const void* p) {
    return (u32)__cvta_generic_to_shared(p);
}

// Makes this thread's generic-proxy shared-memory writes (cp.async) visible to the async proxy
// that wgmma reads shared memory through.
static __device__ __forceinline__ void fence_proxy_async() {
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

// ---------------------------------------------------------------------------------------------
// TMA and mbarriers.

// A CUtensorMap (cuda.h's opaque 128-byte, 64-byte aligned object; NVRTC has no cuda.h),
// encoded by the host (cuTensorMapEncodeTiled) and passed as a __grid_constant__ parameter.
struct __align__(64) TmaMap {
    u64 opaque[16];
};

static __device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
// Makes the barrier initialisations visible to the async proxy (TMA's complete_tx).
static __device__ __forceinline__ void mbar_init_fence() {
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
// Arrives on the barrier (its one expected arrival) and announces `bytes` of transactions.
static __device__ __forceinline__ void mbar_arrive_expect_tx(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes)
                 : "memory");
}
static __device__ __forceinline__ bool mbar_try_wait(u32 bar, u32 parity) {
    u32 done;
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n"
        "}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
    return done != 0;
}

// The fault word a GEMM writes when a wait runs out (GemmProblem::fault): {code, kernel
// blockIdx.x, k-tile, 0}; the first fault wins. Codes: afdep_kernels::context::fault.
#define AFDEP_FAULT_GEMM_TMA_WAIT 1u
// Takes the fault word's address by value, not the problem: a non-inlined callee taking the
// kernel's parameter struct by reference forces a copy of it into local memory, and every read
// of a problem field in the k-loop then becomes a local load (the 1.5-1.9x slowdown measured
// at ccb1723, docs/perf/moe.md (e)).
static __device__ __noinline__ void record_fault(u64 fault, u32 code, u32 kt) {
    if (!fault) return;
    u32* w = (u32*)fault;
    if (atomicCAS(w, 0u, code) == 0u) {
        w[1] = blockIdx.x;
        w[2] = kt;
        __threadfence();
    }
}

// Waits for phase `parity` of the barrier, at most p.wait_ms; a timeout records a
// fault and sets `dead`, after which this thread waits no more (the block finishes, its output
// is void and the host reports the fault).
static __device__ __forceinline__ void mbar_wait_bounded(const GemmProblem& p, u32 bar,
                                                         u32 parity, u32 kt, bool& dead) {
    if (dead || mbar_try_wait(bar, parity)) return;
    const u64 start = afdep_globaltimer_ns();
    while (!mbar_try_wait(bar, parity)) {
        if (afdep_globaltimer_ns() - start > (u64)p.wait_ms * 1000000ull) {
            record_fault(p.fault, AFDEP_FAULT_GEMM_TMA_WAIT, kt);
            dead = true;
            return;
        }
    }
}

// One box of a 2-D / 3-D tensor map into shared memory, completing on `bar`.
static __device__ __forceinline__ void tma_load_2d(u32 dst, const TmaMap* map, i32 c0, i32 c1,
                                                   u32 bar) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
        " [%0], [%1, {%2, %3}], [%4];" ::"r"(dst),
        "l"(map), "r"(c0), "r"(c1), "r"(bar)
        : "memory");
}
static __device__ __forceinline__ void tma_load_3d(u32 dst, const TmaMap* map, i32 c0, i32 c1,
                                                   i32 c2, u32 bar) {
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes"
        " [%0], [%1, {%2, %3, %4}], [%5];" ::"r"(dst),
        "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(bar)
        : "memory");
}

// ---------------------------------------------------------------------------------------------
// wgmma.

// A shared-memory matrix descriptor: start address, leading and stride byte offsets (all >> 4),
// the swizzle (layout type in bits 62-63: 1 = 128-byte, 2 = 64-byte). Stages are 1024-byte
// aligned, so the base offset field stays 0; a start inside an atom (the k16 steps of a
// K-major tile) is how the hardware is told to begin at a later 32-byte column of the
// swizzled rows.
static __device__ __forceinline__ u64 smem_desc(u32 addr, u32 lbo, u32 sbo, u64 swizzle) {
    return (u64)((addr & 0x3FFFFu) >> 4) | ((u64)((lbo >> 4) & 0x3FFFu) << 16) |
           ((u64)((sbo >> 4) & 0x3FFFu) << 32) | (swizzle << 62);
}

static __device__ __forceinline__ void wgmma_fence() {
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
}
static __device__ __forceinline__ void wgmma_commit() {
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}
template <int N>
static __device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}

// One wgmma m64n128k16 (bf16 in, f32 accumulate into d, D = A·B + D), both operands in shared
// memory. TRANS_A / TRANS_B: 0 = K-major, 1 = M- / N-major (bf16 allows both).
template <int TRANS_A, int TRANS_B>
static __device__ __forceinline__ void wgmma_m64n128k16(float (&d)[64], u64 desc_a, u64 desc_b) {
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "setp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
        "}, %64, %65, p, 1, 1, %67, %68;\n"
        "}\n"
        :
          "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "l"(desc_a), "l"(desc_b), "r"(1), "n"(TRANS_A), "n"(TRANS_B));
}

// The warpgroup's wgmmas on one stage (BK / 16 k16 steps). sa, sb: shared addresses of the A
// and B tiles; wg: the warpgroup (rows 64 wg .. of the tile).
template <bool A_KMAJ, bool B_KMAJ>
static __device__ __forceinline__ void mma_stage(u32 sa, u32 sb, float (&acc)[64], u32 wg) {
#pragma unroll
    for (int ks = 0; ks < BK / 16; ks++) {
        // K-major: the warpgroup's 64 rows start 64 rows in; a k16 step is 32 bytes.
        // M-major: the warpgroup's 64 m are the tile's half wg; a k16 step is two 8-row atoms
        // (2048 bytes).
        const u64 da =
            A_KMAJ ? smem_desc(sa + wg * 64 * KROW_BYTES + ks * 32, 16, KATOM_BYTES, KMAJ_SWIZZLE)
                   : smem_desc(sa + wg * MNHALF_BYTES + ks * 2048, MNHALF_BYTES, 1024, 1);
        const u64 db = B_KMAJ ? smem_desc(sb + ks * 32, 16, KATOM_BYTES, KMAJ_SWIZZLE)
                              : smem_desc(sb + ks * 2048, MNHALF_BYTES, 1024, 1);
        wgmma_m64n128k16<A_KMAJ ? 0 : 1, B_KMAJ ? 0 : 1>(acc, da, db);
    }
}

static __device__ __forceinline__ u32 pack_bf16(float lo, float hi) {
    return (u32)afdep_f32_to_bf16(lo) | ((u32)afdep_f32_to_bf16(hi) << 16);
}
static __device__ __forceinline__ float2 unpack_bf16(u32 v) {
    return make_float2(afdep_bf16_to_f32((u16)(v & 0xffffu)), afdep_bf16_to_f32((u16)(v >> 16)));
}

static __device__ __forceinline__ float sigmoidf_(float a) { return 1.0f / (1.0f + expf(-a)); }

// Group start of g (0 when offsets are absent).
static __device__ __forceinline__ u64 group_begin(const GemmProblem& p, u32 g) {
    return p.offsets ? ((const u64*)p.offsets)[g] : 0;
}
static __device__ __forceinline__ u64 group_end(const GemmProblem& p, u32 g, u64 whole) {
    return p.offsets ? ((const u64*)p.offsets)[g + 1] : whole;
}

// Output columns per tile: DUAL_N tiles cover BN/2 columns of each of b and b2.
template <bool DUAL_N>
static __device__ __forceinline__ u32 tile_cols() {
    return DUAL_N ? BN / 2 : BN;
}

// The shared address of the stages: the dynamic shared memory rounded up to the atom.
static __device__ __forceinline__ u32 stages_base(const void* dyn) {
    const u32 s = smem_u32(dyn);
    return (s + ATOM_BYTES - 1) & ~(u32)(ATOM_BYTES - 1);
}

// Accumulator fragment of wgmma m64nNk16 (f32): element 4 j + 2 h + e of a thread is the output
// at row 16 (warp % 4) + lane / 4 + 8 h of its warpgroup's 64 rows and column 8 j + 2 (lane % 4)
// + e.

// ---------------------------------------------------------------------------------------------
// Loaders. Each stage loads 16 BK 16-byte chunks of A and as many of B: LOADS of each per
// thread.
#define LOADS (16 * BK / AFDEP_BLOCK)

// ROWS A (K-major, rows gathered): row_off[] holds the element offset of each tile row (or
// ~0 for rows past the group), computed once per tile.
static __device__ __forceinline__ void load_a_rows(const GemmProblem& p, const u64* row_off,
                                                   u32 sa, u32 k0) {
    const u16* a = (const u16*)p.a;
#pragma unroll
    for (int i = 0; i < LOADS; i++) {
        const u32 id = threadIdx.x + i * AFDEP_BLOCK;
        const u32 r = id / KROW_CHUNKS, c = id % KROW_CHUNKS;
        const u64 off = row_off[r];
        const u32 kk = k0 + c * 8;
        const bool ok = off != ~0ull && kk < p.k;
        afdep_cp_async16(sa + kmaj_off(r, c), ok ? a + off + kk : a, ok);
    }
}

// ROWS B for group g: K-major ([n][k], ldb) or N-major ([k][n], ldb). Without DUAL_N, a second
// B (b2) holds the K rows from b_split on (the data gradient's [W1 | W3]^T); with DUAL_N the
// tile's first 64 columns are b's and the last 64 b2's (x·[W1 | W3]).
template <bool B_KMAJ, bool DUAL_N>
static __device__ __forceinline__ void load_b_rows(const GemmProblem& p, u32 g, u32 sb, u32 n0,
                                                   u32 k0) {
    static_assert(!DUAL_N || !B_KMAJ, "dual-N B is N-major");
    const u16* b1 = (const u16*)p.b + (u64)g * p.b_gs;
    const u16* b2 = p.b2 ? (const u16*)p.b2 + (u64)g * p.b_gs : b1;
#pragma unroll
    for (int i = 0; i < LOADS; i++) {
        const u32 id = threadIdx.x + i * AFDEP_BLOCK;
        if (B_KMAJ) {
            const u32 r = id / KROW_CHUNKS, c = id % KROW_CHUNKS;  // r: n, c: k chunk
            const u32 nn = n0 + r, kk = k0 + c * 8;
            const bool second = p.b2 && kk >= p.b_split;
            const u16* src = second ? b2 : b1;
            const u32 kb = second ? kk - p.b_split : kk;
            const bool ok = nn < p.n && kk < p.k;
            afdep_cp_async16(sb + kmaj_off(r, c), ok ? src + (u64)nn * p.ldb + kb : src, ok);
        } else {
            const u32 r = id / 16, c = id % 16;  // r: k within the tile, c: n chunk
            const u32 kk = k0 + r;
            const u16* src = b1;
            u32 nn, kb = kk;
            if (DUAL_N) {
                // chunks 0..7: b columns n0 + 8c; chunks 8..15: b2 columns n0 + 8(c - 8)
                nn = n0 + (c % 8) * 8;
                if (c >= 8) src = b2;
            } else {
                nn = n0 + c * 8;
                if (p.b2 && kk >= p.b_split) {
                    src = b2;
                    kb = kk - p.b_split;
                }
            }
            const bool ok = nn < p.n && kk < p.k;
            afdep_cp_async16(sb + mnmaj_off(r, c), ok ? src + (u64)kb * p.ldb + nn : src, ok);
        }
    }
}

// KSUM operand (MN-major [r][m], rows gathered through idx/div). A stage is BK K-rows r0 ..
// r0 + BK - 1 (< rend) by 128 columns c0 .. c0 + 127 (< lim); thread chunk i of a stage is
// K-row (threadIdx.x + i * AFDEP_BLOCK) / 16 of it.
//
// ksum_rows resolves the source row of each of the thread's chunks (~0: past rend); the k-loop
// resolves the rows of the next stage one stage early, so the gather index's global load is in
// flight while the current stage multiplies instead of stalling the thread right before its
// cp.async (measured: the gathered dW2 ran at half the rate of the contiguous dW13,
// docs/perf/moe.md 2026-12-04).
static __device__ __forceinline__ void ksum_rows(u64 idx, u32 div, u64 r0, u64 rend,
                                                 u64 (&rows)[LOADS]) {
#pragma unroll
    for (int i = 0; i < LOADS; i++) {
        const u64 rr = r0 + (threadIdx.x + i * AFDEP_BLOCK) / 16;
        rows[i] = rr < rend ? (idx ? (u64)(__ldg((const u32*)idx + rr) / div) : rr) : ~0ull;
    }
}
static __device__ __forceinline__ void load_ksum(const u16* base, u64 ld, const u64 (&rows)[LOADS],
                                                 u32 s, u32 c0, u32 lim) {
#pragma unroll
    for (int i = 0; i < LOADS; i++) {
        const u32 id = threadIdx.x + i * AFDEP_BLOCK;
        const u32 r = id / 16, c = id % 16;
        const u32 cc = c0 + c * 8;
        const bool ok = rows[i] != ~0ull && cc < lim;
        afdep_cp_async16(s + mnmaj_off(r, c), ok ? base + rows[i] * ld + cc : base, ok);
    }
}

// ---------------------------------------------------------------------------------------------
// Epilogues of ROWS problems. v0, v1: the accumulator pair at (row, col), (row, col + 1);
// for SWIGLU / DSWIGLU the pair from the second half (b2's columns) is u0, u1. Per row, read
// once by the caller: w, the row's router weight (1 without weights), and srow, the element
// offset of the row's token in the scatter accumulator (SCATTER).

// Adds the pair (v0, v1) to dst[0..1] with one vector reduction (sm_90: red.global.add.v2.f32;
// dst is 8-byte aligned: even column, even row stride).
static __device__ __forceinline__ void red_add_f32x2(float* dst, float v0, float v1) {
    asm volatile("red.global.add.v2.f32 [%0], {%1, %2};" ::"l"(dst), "f"(v0), "f"(v1) : "memory");
}

// What an epilogue reads from global memory at (row, col) before it writes: the raw bits of
// two values (ACC_BF16, ADD_F32: the f32 pair of aux; DSWIGLU: the bf16 pairs of a and b). A
// tile's reads are issued in batches ahead of its writes (epi_tile), so that a thread waits
// for memory once per batch, not once per column pair.
struct EpiIn {
    u32 x, y;
};
template <int EPI>
static __device__ constexpr bool epi_reads() {
    return EPI == AFDEP_EPI_ACC_BF16 || EPI == AFDEP_EPI_ADD_F32 || EPI == AFDEP_EPI_DSWIGLU;
}
template <int EPI>
static __device__ __forceinline__ EpiIn epi_load(const GemmProblem& p, u64 row, u32 col) {
    EpiIn in{0u, 0u};
    if (EPI == AFDEP_EPI_ACC_BF16 || EPI == AFDEP_EPI_ADD_F32) {
        const uint2 a = *(const uint2*)((const float*)p.aux + row * p.ldc + col);
        in.x = a.x;
        in.y = a.y;
    } else if (EPI == AFDEP_EPI_DSWIGLU) {
        // a, b: row [a | b] of c2 (row stride ld2), n columns each.
        const u16* ab = (const u16*)p.c2 + row * p.ld2;
        in.x = *(const u32*)(ab + col);
        in.y = *(const u32*)(ab + p.n + col);
    }
    return in;
}

template <int EPI>
static __device__ __forceinline__ void epi_rows(const GemmProblem& p, u64 row, u32 col, float v0,
                                                float v1, float u0, float u1, float w, u64 srow,
                                                float& gpart, EpiIn in) {
    if (EPI == AFDEP_EPI_STORE) {
        u32* c = (u32*)((u16*)p.c + row * p.ldc + col);
        *c = pack_bf16(__fmul_rn(w, v0), __fmul_rn(w, v1));
    } else if (EPI == AFDEP_EPI_ACC_BF16) {
        // in: aux's f32 pair at (row, col).
        *(u32*)((u16*)p.c + row * p.ldc + col) = pack_bf16(
            __fadd_rn(__uint_as_float(in.x), v0), __fadd_rn(__uint_as_float(in.y), v1));
    } else if (EPI == AFDEP_EPI_ADD_F32) {
        // in: aux's f32 pair at (row, col), written back with the pair added.
        float2 o;
        o.x = __fadd_rn(__uint_as_float(in.x), v0);
        o.y = __fadd_rn(__uint_as_float(in.y), v1);
        *(float2*)((float*)p.aux + row * p.ldc + col) = o;
    } else if (EPI == AFDEP_EPI_SCATTER) {
        red_add_f32x2((float*)p.aux + srow + col, __fmul_rn(w, v0), __fmul_rn(w, v1));
    } else if (EPI == AFDEP_EPI_SWIGLU) {
        // v = a = x·W1, u = b = x·W3; h = silu(a) * b.
        const float h0 = __fmul_rn(__fmul_rn(v0, sigmoidf_(v0)), u0);
        const float h1 = __fmul_rn(__fmul_rn(v1, sigmoidf_(v1)), u1);
        *(u32*)((u16*)p.c + row * p.ldc + col) = pack_bf16(h0, h1);
        // the train step keeps a, b for the backward: row [a | b] of c2 (n columns each, row
        // stride ld2), the layout of the backward's [da | db]
        if (p.c2) {
            u16* ab = (u16*)p.c2 + row * p.ld2;
            *(u32*)(ab + col) = pack_bf16(v0, v1);
            *(u32*)(ab + p.n + col) = pack_bf16(u0, u1);
        }
    } else if (EPI == AFDEP_EPI_DSWIGLU) {
        // v = G = dy·W2^T (unweighted). With a, b stored by the forward: h = silu(a) b,
        // g += G·h (the router's <dy, y>), dh = w G, da = dh b silu'(a), db = dh silu(a).
        // in: a, b (epi_load). In place (c2 = c, ld2 = 2 ldc, ldc = n): this thread read a, b
        // at the two addresses it now writes da, db to, and no other thread touches them.
        const u64 o = row * p.ldc + col;
        const float2 a = unpack_bf16(in.x);
        const float2 b = unpack_bf16(in.y);
        float da[2], db[2], hw[2];
        const float av[2] = {a.x, a.y}, bv[2] = {b.x, b.y}, gv[2] = {v0, v1};
#pragma unroll
        for (int i = 0; i < 2; i++) {
            const float s = sigmoidf_(av[i]);
            const float silu = __fmul_rn(av[i], s);
            const float h = __fmul_rn(silu, bv[i]);
            gpart = __fadd_rn(gpart, __fmul_rn(gv[i], h));
            const float dh = __fmul_rn(w, gv[i]);
            const float dsilu = __fmul_rn(s, __fadd_rn(1.0f, __fmul_rn(av[i], __fsub_rn(1.0f, s))));
            da[i] = __fmul_rn(__fmul_rn(dh, bv[i]), dsilu);
            db[i] = __fmul_rn(dh, silu);
            hw[i] = __fmul_rn(w, h);
        }
        u16* dab = (u16*)p.c + row * (2 * p.ldc);
        *(u32*)(dab + col) = pack_bf16(da[0], da[1]);
        *(u32*)(dab + p.ldc + col) = pack_bf16(db[0], db[1]);
        if (p.c4) *(u32*)((u16*)p.c4 + o) = pack_bf16(hw[0], hw[1]);
    }
}

// The epilogue of one thread's part of an output tile, straight from its accumulators: rows
// row[0] and row[1] (~0 for a row past the group: nothing is read or written), NJ column pairs
// per row at n0 + 8 j + 2 tq (columns at or past n are skipped). Accumulator element
// 4 j + 2 hr + e is (row[hr], column pair j, e); with DUAL_N the second half's pair of j is at
// 4 (j + NJ) + 2 hr + e. Per row the router weight and scatter row are read once; where the
// epilogue reads memory (epi_reads), the reads of EPI_BATCH pairs of both rows are issued
// before any of their writes. The order of the arithmetic is the plain loop's (gpart
// ascending in j per row), so results do not depend on the batching. DSWIGLU with gsum: one
// atomic per row and tile after a quad reduction. EPI_BATCH: as large as the kernel's registers
// allow without a spill (cargo xtask kernels checks).
template <int EPI, bool DUAL_N, int EPI_BATCH, int NACC>
static __device__ __forceinline__ void epi_tile(const GemmProblem& p, const float (&acc)[NACC],
                                                const u64 (&row)[2], u32 n0, u32 tq) {
    constexpr int NJ = NACC / (DUAL_N ? 8 : 4);
    static_assert(NJ % EPI_BATCH == 0, "whole batches of column pairs");
    float w[2] = {1.0f, 1.0f}, gpart[2] = {0.0f, 0.0f};
    u64 srow[2] = {0, 0};
#pragma unroll
    for (int hr = 0; hr < 2; hr++) {
        if (row[hr] != ~0ull && p.r_idx) {
            const u32 slot = ((const u32*)p.r_idx)[row[hr]];
            if (p.weights) w[hr] = ((const float*)p.weights)[slot];
            if (EPI == AFDEP_EPI_SCATTER) srow[hr] = (u64)(slot / p.r_div) * p.ldc;
        }
    }
#pragma unroll
    for (int j0 = 0; j0 < NJ; j0 += EPI_BATCH) {
        EpiIn in[2][EPI_BATCH];
        if (epi_reads<EPI>()) {
#pragma unroll
            for (int hr = 0; hr < 2; hr++)
#pragma unroll
                for (int jj = 0; jj < EPI_BATCH; jj++) {
                    const u32 col = n0 + (j0 + jj) * 8 + 2 * tq;
                    if (row[hr] != ~0ull && col < p.n)
                        in[hr][jj] = epi_load<EPI>(p, row[hr], col);
                }
        }
#pragma unroll
        for (int hr = 0; hr < 2; hr++) {
            if (row[hr] == ~0ull) continue;
#pragma unroll
            for (int jj = 0; jj < EPI_BATCH; jj++) {
                const int j = j0 + jj;
                const u32 col = n0 + j * 8 + 2 * tq;
                if (col >= p.n) continue;
                const float v0 = acc[4 * j + 2 * hr], v1 = acc[4 * j + 2 * hr + 1];
                float u0 = 0.0f, u1 = 0.0f;
                if (DUAL_N) {
                    u0 = acc[4 * (j + NJ) + 2 * hr];
                    u1 = acc[4 * (j + NJ) + 2 * hr + 1];
                }
                epi_rows<EPI>(p, row[hr], col, v0, v1, u0, u1, w[hr], srow[hr], gpart[hr],
                              epi_reads<EPI>() ? in[hr][jj] : EpiIn{0u, 0u});
            }
        }
    }
    if (EPI == AFDEP_EPI_DSWIGLU && p.gsum) {
#pragma unroll
        for (int hr = 0; hr < 2; hr++) {
            // The quad holds the row's columns of this tile: reduce, one atomic per row.
            float g = gpart[hr];
            g = __fadd_rn(g, __shfl_xor_sync(0xffffffffu, g, 1));
            g = __fadd_rn(g, __shfl_xor_sync(0xffffffffu, g, 2));
            if (row[hr] != ~0ull && tq == 0)
                atomicAdd((float*)p.gsum + ((const u32*)p.r_idx)[row[hr]], g);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The k-loop shared by both problem shapes. LOAD(slot, k_tile) issues one stage's loads into
// stage `slot` (A tile at base + slot * STAGE_BYTES, B tile TILE_BYTES after it): cp.async by
// every thread, and, when tx_bytes > 0, TMA boxes issued by thread 0 against the slot's
// mbarrier (bars + 8 slot), after thread 0 has announced tx_bytes on it here.
//
// Synchronisation, per k-tile kt: wait for this thread's cp.async loads of kt, fence them into
// the async proxy, wait for kt's mbarrier phase (the TMA bytes), barrier (everyone's loads of kt
// are visible, and every warpgroup has retired the wgmma of kt - 2, which read the slot that is
// loaded next); issue the loads of kt + PREFETCH into the slot of kt - 2 (mod STAGES); issue
// kt's wgmmas; wait until at most one wgmma group (kt's) is in flight, i.e. kt - 1's has
// retired. `phases` holds this thread's next parity per slot (it persists across the tiles of
// a persistent block, as the barriers do).
template <bool A_KMAJ, bool B_KMAJ, typename Load>
static __device__ __forceinline__ void k_loop(const GemmProblem& p, u32 base, u32 bars,
                                              u32 tx_bytes, u32& phases, bool& dead, u32 ktiles,
                                              float (&acc)[64], u32 wg, Load load) {
    auto issue = [&](u32 slot, u32 kt) {
        // A thread whose wait ran out issues no more TMA (nothing is left in flight at exit).
        if (tx_bytes && threadIdx.x == 0 && !dead) mbar_arrive_expect_tx(bars + 8 * slot, tx_bytes);
        load(slot, kt);
    };
#pragma unroll
    for (int i = 0; i < 64; i++) acc[i] = 0.0f;
#pragma unroll
    for (int s = 0; s < PREFETCH; s++) {
        if ((u32)s < ktiles) issue((u32)s, (u32)s);
        afdep_cp_async_commit();
    }
    for (u32 kt = 0; kt < ktiles; kt++) {
        const u32 slot = kt % STAGES;
        afdep_cp_async_wait<PREFETCH - 1>();
        fence_proxy_async();
        if (tx_bytes) {
            mbar_wait_bounded(p, bars + 8 * slot, (phases >> slot) & 1u, kt, dead);
            phases ^= 1u << slot;
        }
        __syncthreads();
        const u32 nk = kt + PREFETCH;
        if (nk < ktiles) issue(nk % STAGES, nk);
        afdep_cp_async_commit();
        const u32 sa = base + slot * STAGE_BYTES;
        wgmma_fence();
        mma_stage<A_KMAJ, B_KMAJ>(sa, sa + TILE_BYTES, acc, wg);
        wgmma_commit();
        wgmma_wait<1>();
    }
    wgmma_wait<0>();
    afdep_cp_async_wait<0>();
}

// ROWS B by TMA for group g (the host set AFDEP_GEMM_TMA_B only where these boxes describe
// the operand exactly). K-major: one box of BK k x 128 n from b ([g][n][k]), or from b2 for the
// K tiles from b_split on (b_split a multiple of BK). N-major: two boxes of 64 n x BK k, the
// tile's halves: b at n0 and n0 + 64, or with DUAL_N b and b2 at n0. A half that starts past
// n is not loaded (its columns are not stored). Returns the bytes the boxes deliver.
template <bool B_KMAJ, bool DUAL_N>
static __device__ __forceinline__ u32 tma_b_bytes(const GemmProblem& p, u32 n0) {
    if (B_KMAJ || DUAL_N) return TILE_BYTES;
    return n0 + 64 < p.n ? TILE_BYTES : TILE_BYTES / 2;
}
template <bool B_KMAJ, bool DUAL_N>
static __device__ __forceinline__ void tma_load_b(const GemmProblem& p, const TmaMap* tb,
                                                  const TmaMap* tb2, u32 g, u32 sb, u32 n0,
                                                  u32 k0, u32 bar) {
    if (B_KMAJ) {
        const bool second = p.b2 && k0 >= p.b_split;
        tma_load_3d(sb, second ? tb2 : tb, (i32)(second ? k0 - p.b_split : k0), (i32)n0, (i32)g,
                    bar);
    } else if (DUAL_N) {
        tma_load_3d(sb, tb, (i32)n0, (i32)k0, (i32)g, bar);
        tma_load_3d(sb + MNHALF_BYTES, tb2, (i32)n0, (i32)k0, (i32)g, bar);
    } else {
        tma_load_3d(sb, tb, (i32)n0, (i32)k0, (i32)g, bar);
        if (n0 + 64 < p.n) tma_load_3d(sb + MNHALF_BYTES, tb, (i32)(n0 + 64), (i32)k0, (i32)g, bar);
    }
}

// ---------------------------------------------------------------------------------------------
// The ROWS kernel body.
template <bool B_KMAJ, bool DUAL_N, int EPI>
static __device__ __forceinline__ void gemm_rows(const GemmProblem& p, const TmaMap* ta,
                                                 const TmaMap* tb, const TmaMap* tb2) {
    extern __shared__ __align__(1024) u8 smem_dyn[];
    __shared__ u32 tile_prefix[AFDEP_GEMM_MAX_GROUPS + 1];
    __shared__ u64 row_off[BM];
    __shared__ u64 row_glob[BM];
    __shared__ __align__(8) u64 bars[STAGES];
    const u32 base = stages_base(smem_dyn);
    const u32 bar0 = smem_u32(bars);
    const bool tma_a = (p.tma & AFDEP_GEMM_TMA_A) != 0, tma_b = (p.tma & AFDEP_GEMM_TMA_B) != 0;
    if (threadIdx.x == 0 && p.tma) {
        for (u32 s = 0; s < STAGES; s++) mbar_init(bar0 + 8 * s, 1);
        mbar_init_fence();
    }

    const u32 cols = tile_cols<DUAL_N>();
    const u32 ntiles_n = (p.n + cols - 1) / cols;
    // Tiles per group from the device offsets: an exclusive prefix in shared memory.
    if (threadIdx.x == 0) {
        u32 acc = 0;
        for (u32 g = 0; g < p.groups; g++) {
            tile_prefix[g] = acc;
            const u64 rows = group_end(p, g, p.m) - group_begin(p, g);
            acc += (u32)((rows + BM - 1) / BM) * ntiles_n;
        }
        tile_prefix[p.groups] = acc;
    }
    __syncthreads();
    const u32 total = tile_prefix[p.groups];

    const u32 wg = threadIdx.x / 128, warp = (threadIdx.x / 32) % 4, lane = afdep_lane();
    const u32 gq = lane / 4, tq = lane % 4;
    const u32 ktiles = (p.k + BK - 1) / BK;
    u32 phases = 0;
    bool dead = false;

    for (u32 t = blockIdx.x; t < total; t += gridDim.x) {
        // The group of tile t: the last g with tile_prefix[g] <= t (binary search).
        u32 lo = 0, hi = p.groups;  // invariant: prefix[lo] <= t < prefix[hi]
        while (hi - lo > 1) {
            const u32 mid = (lo + hi) / 2;
            if (tile_prefix[mid] <= t) lo = mid; else hi = mid;
        }
        const u32 g = lo;
        const u32 local = t - tile_prefix[g];
        const u32 mt = local / ntiles_n, nt = local % ntiles_n;
        const u64 gb = group_begin(p, g), ge = group_end(p, g, p.m);
        const u64 row0 = gb + (u64)mt * BM;
        const u64 rows = ge - row0 < BM ? ge - row0 : BM;
        const u32 n0 = nt * cols;

        __syncthreads();  // the previous tile is done with row_off and the stages
        for (u32 r = threadIdx.x; r < BM; r += AFDEP_BLOCK) {
            if (r < rows) {
                const u64 row = row0 + r;
                const u64 arow = p.a_idx ? (u64)(((const u32*)p.a_idx)[row] / p.a_div) : row;
                row_off[r] = arow * p.lda;
                row_glob[r] = row;
            } else {
                row_off[r] = ~0ull;
                row_glob[r] = ~0ull;
            }
        }
        __syncthreads();

        u32 tx = (tma_a ? TILE_BYTES : 0u) + (tma_b ? tma_b_bytes<B_KMAJ, DUAL_N>(p, n0) : 0u);
        if (tx) tx += p.inject_tx;
        float acc[64];
        k_loop<true, B_KMAJ>(p, base, bar0, tx, phases, dead, ktiles, acc, wg, [&](u32 slot, u32 kt) {
            const u32 sa = base + slot * STAGE_BYTES, bar = bar0 + 8 * slot;
            if (!tma_a) load_a_rows(p, row_off, sa, kt * BK);
            else if (threadIdx.x == 0 && !dead) tma_load_2d(sa, ta, (i32)(kt * BK), (i32)row0, bar);
            if (!tma_b) load_b_rows<B_KMAJ, DUAL_N>(p, g, sa + TILE_BYTES, n0, kt * BK);
            else if (threadIdx.x == 0 && !dead)
                tma_load_b<B_KMAJ, DUAL_N>(p, tb, tb2, g, sa + TILE_BYTES, n0, kt * BK, bar);
        });

        // Epilogue straight from the accumulators.
        const u32 er = wg * 64 + warp * 16 + gq;
        const u64 erows[2] = {row_glob[er], row_glob[er + 8]};
        // 4 pairs per batch: the kernel is compiled for 128 registers (two blocks per SM).
        epi_tile<EPI, DUAL_N, 4>(p, acc, erows, n0, tq);
    }
}

// ---------------------------------------------------------------------------------------------
// The KSUM kernel body: tiles (group, m tile, n tile, split); f32 partials.
static __device__ __forceinline__ void gemm_ksum(const GemmProblem& p) {
    extern __shared__ __align__(1024) u8 smem_dyn[];
    const u32 base = stages_base(smem_dyn);
    const u32 mtiles = (p.m + BM - 1) / BM, ntiles = (p.n + BN - 1) / BN;
    const u32 total = p.groups * mtiles * ntiles * p.splits;
    const u32 wg = threadIdx.x / 128, warp = (threadIdx.x / 32) % 4, lane = afdep_lane();
    const u32 gq = lane / 4, tq = lane % 4;
    u32 phases = 0;  // unused: the weight gradients load by cp.async only
    bool dead = false;

    for (u32 t = blockIdx.x; t < total; t += gridDim.x) {
        u32 rest = t;
        const u32 s = rest % p.splits;
        rest /= p.splits;
        const u32 nt = rest % ntiles;
        rest /= ntiles;
        const u32 mt = rest % mtiles;
        const u32 g = rest / mtiles;
        const u64 gb = group_begin(p, g), ge = group_end(p, g, p.k);
        const u64 len = ge - gb;
        u64 chunk = (len + p.splits - 1) / p.splits;
        chunk = (chunk + BK - 1) / BK * BK;
        const u64 kb = gb + (u64)s * chunk < ge ? gb + (u64)s * chunk : ge;
        const u64 ke = kb + chunk < ge ? kb + chunk : ge;
        const u32 ktiles = (u32)((ke - kb + BK - 1) / BK);
        const u32 m0 = mt * BM, n0 = nt * BN;

        __syncthreads();  // the previous tile's last stage reads are done
        float acc[64];
        // Source rows of the stage loaded next (ra, rb: of k-tile `next`), resolved one call
        // ahead; the loader is called for k-tiles 0, 1, 2, ... in order.
        u64 ra[LOADS], rb[LOADS];
        ksum_rows(p.a_idx, p.a_div, kb, ke, ra);
        ksum_rows(p.b_idx, p.b_div, kb, ke, rb);
        k_loop<false, false>(p, base, 0u, 0u, phases, dead, ktiles, acc, wg, [&](u32 slot, u32 kt) {
            const u32 sa = base + slot * STAGE_BYTES;
            load_ksum((const u16*)p.a, p.lda, ra, sa, m0, p.m);
            load_ksum((const u16*)p.b, p.ldb, rb, sa + TILE_BYTES, n0, p.n);
            const u64 r1 = kb + (u64)(kt + 1) * BK;
            ksum_rows(p.a_idx, p.a_div, r1, ke, ra);
            ksum_rows(p.b_idx, p.b_div, r1, ke, rb);
        });

        if (p.splits == 1 && p.c2) {
            // One chunk: the sum is final; bf16 straight into the gradient (columns from
            // b_split on into c3 when it is given), no f32 partial and no reduce.
            const u32 n1 = p.c3 ? p.b_split : p.n;
#pragma unroll
            for (int hr = 0; hr < 2; hr++) {
                const u32 m = m0 + wg * 64 + warp * 16 + gq + hr * 8;
                if (m >= p.m) continue;
                const u64 row = (u64)g * p.m + m;
#pragma unroll
                for (int j = 0; j < 16; j++) {
                    const u32 n = n0 + j * 8 + 2 * tq;
                    if (n >= p.n) continue;
                    const u32 v = pack_bf16(acc[4 * j + 2 * hr], acc[4 * j + 2 * hr + 1]);
                    if (n < n1) *(u32*)((u16*)p.c2 + row * n1 + n) = v;
                    else *(u32*)((u16*)p.c3 + row * (p.n - n1) + (n - n1)) = v;
                }
            }
            continue;
        }
        float* ws = (float*)p.c + ((u64)g * p.splits + s) * (u64)p.m * p.n;
#pragma unroll
        for (int hr = 0; hr < 2; hr++) {
            const u32 m = m0 + wg * 64 + warp * 16 + gq + hr * 8;
            if (m >= p.m) continue;
#pragma unroll
            for (int j = 0; j < 16; j++) {
                const u32 n = n0 + j * 8 + 2 * tq;
                if (n >= p.n) continue;
                *(float2*)(ws + (u64)m * p.n + n) =
                    make_float2(acc[4 * j + 2 * hr], acc[4 * j + 2 * hr + 1]);
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Entry points: one per (operand layout, epilogue) the layer uses.

// The nine ROWS problems the layer uses (both engines' entries): at the end of this file.

// Weight gradients: f32 partials per (group, split).
extern "C" __global__ void __launch_bounds__(AFDEP_BLOCK, 1) afdep_gemm_wgrad(GemmProblem p) {
    gemm_ksum(p);
}

// out[g][m][n] = bf16(sum over s ascending of ws[g][s][m][n]); columns n >= n1 go to out2
// (at column n - n1) when out2 is given, so [dW1 | dW3] partials land in two tensors.
extern "C" __global__ void __launch_bounds__(AFDEP_BLOCK)
    afdep_gemm_reduce(const float* __restrict__ ws, u16* __restrict__ out, u16* __restrict__ out2,
                      u32 groups, u32 splits, u32 m, u32 n, u32 n1) {
    const u64 mn = (u64)m * n;
    const u64 total = (u64)groups * mn;
    for (u64 i = (u64)blockIdx.x * AFDEP_BLOCK + threadIdx.x; i < total;
         i += (u64)gridDim.x * AFDEP_BLOCK) {
        const u64 g = i / mn, e = i % mn;
        const u32 r = (u32)(e / n), c = (u32)(e % n);
        float acc = 0.0f;
        for (u32 s = 0; s < splits; s++) acc = __fadd_rn(acc, ws[(g * splits + s) * mn + e]);
        const u16 v = afdep_f32_to_bf16(acc);
        if (out2 && c >= n1) {
            out2[(g * m + r) * (u64)(n - n1) + (c - n1)] = v;
        } else {
            const u32 w = out2 ? n1 : n;
            out[(g * m + r) * (u64)w + c] = v;
        }
    }
}

// =============================================================================================
// The warp-specialised ROWS engine ("ws"): the large shapes (docs/perf/moe.md, 2026-12-05).
//
// Block: 384 threads = three warpgroups and one block per SM (its shared memory allows no
// second), persistent over the same device-side tile order as gemm_rows: block b takes tiles
// b, b + grid, ... (static schedule), or, where GemmProblem::sched is set (dynamic schedule),
// the producer's thread 0 takes the next tile from a device counter when it is ready for one
// and passes it to the consumers through a ring of mbarrier-guarded entries (WS_TRING), so
// that the resident blocks take every tile while other kernels keep SMs from the rest of the
// grid; the last block to finish zeroes the counters for the next launch on the stream.
// - Warpgroup 0, the producer, gives registers back (setmaxnreg.dec) and only loads: thread 0
//   issues the TMA boxes of a stage (B always; A where its rows are contiguous) against the
//   stage's `full` mbarrier; where A is gathered through a_idx (or has no tensor map), all 128
//   producer threads load its rows by cp.async and each arrives on `full` once its copies have
//   landed and it has fenced them into the async proxy (WS_CP_LAG). Before refilling a stage
//   the producer waits for its `empty` mbarrier.
// - Warpgroups 1 and 2, the consumers, take the registers (setmaxnreg.inc): consumer c
//   computes rows 64c .. 64c + 63 of a 128 x 256 output tile with wgmma m64n256k16 (128 f32
//   accumulators per thread), one wgmma batch in flight; when a stage's wgmmas have retired,
//   each consumer warp arrives on the stage's `empty` barrier. The epilogue (the same epi_rows
//   as gemm_rows) runs straight from the accumulators while the producer already loads the
//   next tile's stages: the overlap the two-warpgroup kernel lacked.
// - Stages: WS_STAGES of a 128 x 64 A tile (16 KiB) and a 256 x 64 B tile (32 KiB), both with
//   the 128-byte swizzle (K-major A and B: 128-byte rows; N-major B: four 64-column blocks of
//   64 k-rows, LBO 8 KiB apart).
// - Tile order inside a group: panels of WS_PANEL m-tiles, m fastest inside a panel, so the
//   SMs working at once share a few A panels and B column slabs in L2 instead of every SM
//   streaming its own weight slab from DRAM for each m-tile.
// - Every mbarrier wait is bounded (mbar_wait_bounded): a consumer whose `full` wait runs out
//   records the fault and stops waiting and arriving; the producer then runs out on `empty`,
//   records nothing new (the first fault wins) and stops issuing. No trap, no hang.
// - Pairs (CL = 2, the afdep_gemm_ws2_* entries, `__cluster_dims__(2, 1, 1)`): the two blocks
//   of a cluster compute m-tiles 2u and 2u + 1 of one group at the same columns, so they need
//   the same B stages: each producer loads half of every B stage (K-major: 128 of the 256
//   n-rows; N-major: every other 64-column block) by TMA multicast into both blocks, and a
//   stage is refilled only when the consumer warps of both blocks have released it (each
//   arrives on both blocks' `empty` barriers). Per stage a block then reads 16 KiB of A and
//   16 KiB of B from L2 instead of 16 + 32. Both blocks walk the same schedule of pairs.
// The host (ops::gemm::Engine, ops::gemm::Pairing) chooses this engine or gemm_rows per
// problem, and pairs or single blocks.

#define WS_THREADS 384
#define WS_BM 128
#define WS_BN 256
#define WS_BK 64
#define WS_STAGES 4
#define WS_PANEL 8
// cp.async A (gathered rows): a producer thread arrives on a stage's `full` barrier WS_CP_LAG
// stages after issuing it, once cp.async.wait_group says it landed and the thread has fenced
// it into the async proxy (fence.proxy.async, as the classic kernel does before its barrier).
// At most 2 with 4 stages: the consumers release stage i - 4 only after consuming i - 3, so
// the producer waiting to refill it must already have arrived on i - 3.
#define WS_CP_LAG 2
// The dynamic schedule (GemmProblem::sched): the producer's thread 0 takes the block's next tile
// from the counter and passes it to the consumers through a ring of WS_TRING entries, each with
// a `tfull` (one arrival: the producer's) and a `tempty` mbarrier (one arrival per consumer
// warp). The producer is at most WS_STAGES k-tiles ahead of the consumers, so at most
// WS_STAGES + 1 tiles; the ring is larger, and its barriers make any lead safe.
#define WS_TRING 8
// The fault step a tile-ring wait records (a stage wait records its k-tile).
#define WS_RING_STEP 0xffffffffu
#define WS_A_BYTES (WS_BM * WS_BK * 2)
#define WS_B_BYTES (WS_BN * WS_BK * 2)
#define WS_STAGE_BYTES (WS_A_BYTES + WS_B_BYTES)
// Bytes between the 64-column blocks of an N-major B tile (64 k-rows of 128 bytes).
#define WS_NBLOCK_BYTES (WS_BK * 128)
// Must equal afdep_kernels::ops::gemm::WS_SMEM_BYTES.
#define WS_SMEM_DYN_BYTES (WS_STAGES * WS_STAGE_BYTES + ATOM_BYTES)
// Registers per thread after setmaxnreg: 128 x 56 + 256 x 224 = 64,512, what the launch gives
// (384 x 168); at 40 the producer spilled.
#define WS_PRODUCER_REGS 56
#define WS_CONSUMER_REGS 224

static __device__ __forceinline__ void mbar_arrive(u32 bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}

// ---- Thread-block clusters (the ws engine's CL = 2 form) ----
// This block's rank in its cluster, the cluster's index in the grid and the number of clusters.
static __device__ __forceinline__ u32 cluster_rank() {
    u32 r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}
static __device__ __forceinline__ u32 cluster_index() {
    u32 r;
    asm volatile("mov.u32 %0, %%clusterid.x;" : "=r"(r));
    return r;
}
static __device__ __forceinline__ u32 cluster_count() {
    u32 r;
    asm volatile("mov.u32 %0, %%nclusterid.x;" : "=r"(r));
    return r;
}
// Every thread of every block of the cluster: the writes before it (shared memory, barrier
// initialisations) are visible to every thread of the cluster after it.
static __device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\n"
                 "barrier.cluster.wait.acquire.aligned;" ::: "memory");
}
// Arrives on the barrier at the same shared-memory offset as `bar` in cluster block `cta`.
// The default .release.cta, as CUTLASS's ClusterBarrier::arrive(cta_id): the arrival only
// says that this warp's wgmma reads of the stage (retired by wgmma.wait_group) are done before
// the peer's TMA overwrites it; no generic-proxy data is published through it. An explicit
// .release.cluster costs MEMBAR.ALL.CTA + MEMBAR.ALL.GPU per arrival (sm_90a SASS), in the
// k-loop, and waits for the previous tile's epilogue stores.
static __device__ __forceinline__ void mbar_arrive_in(u32 bar, u32 cta) {
    u32 remote;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(bar), "r"(cta));
    asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];" ::"r"(remote) : "memory");
}
// One box of a 3-D tensor map into the same shared-memory offset `dst` of every block in
// `mask`, each completing on its own barrier at offset `bar`.
static __device__ __forceinline__ void tma_load_3d_multicast(u32 dst, const TmaMap* map, i32 c0,
                                                             i32 c1, i32 c2, u32 bar, u16 mask) {
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes"
        ".multicast::cluster [%0], [%1, {%2, %3, %4}], [%5], %6;" ::"r"(dst),
        "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(bar), "h"(mask)
        : "memory");
}
// Barrier 1 among the producer warpgroup's 128 threads.
static __device__ __forceinline__ void producer_sync() {
    asm volatile("bar.sync 1, 128;" ::: "memory");
}
// Whether `v` holds for any of consumer warpgroup wc's 128 threads (named barrier 2 + wc). Not
// .aligned: the threads may come from divergent bounded waits. (With the barrier number as an
// immediate, chosen by wc, ptxas reserves 4 barriers instead of 16 but dx_add's consumers spill.)
static __device__ __forceinline__ bool consumer_any(u32 wc, bool v) {
    u32 r;
    asm volatile(
        "{\n"
        ".reg .pred p, q;\n"
        "setp.ne.u32 p, %1, 0;\n"
        "barrier.red.or.pred q, %2, 128, p;\n"
        "selp.u32 %0, 1, 0, q;\n"
        "}\n"
        : "=r"(r)
        : "r"((u32)v), "r"(2u + wc)
        : "memory");
    return r != 0;
}

// One wgmma m64n256k16 (bf16 in, f32 accumulate into d), both operands in shared memory.
// TRANS_A / TRANS_B: 0 = K-major, 1 = M- / N-major.
template <int TRANS_A, int TRANS_B>
static __device__ __forceinline__ void wgmma_m64n256k16(float (&d)[128], u64 desc_a, u64 desc_b) {
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "setp.ne.b32 p, %130, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
        "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
        "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "
        "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "
        "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
        "}, %128, %129, p, 1, 1, %131, %132;\n"
        "}\n"
        :
          "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
          "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
          "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),
          "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),
          "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]),
          "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),
          "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]),
          "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]),
          "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
        : "l"(desc_a), "l"(desc_b), "r"(1), "n"(TRANS_A), "n"(TRANS_B));
}

// The ws tile t of the schedule: group g, first row row0, rows (<= WS_BM; 0 for the second
// block of a cluster pair past the group's last m-tile), first column n0. With CL = 2 the
// schedule's unit is a pair of m-tiles of one group at the same columns: block `crank` of
// the cluster takes m-tile 2u + crank of pair u.
struct WsTile {
    u32 g;
    u64 row0, rows;
    u32 n0;
};
template <int CL>
static __device__ __forceinline__ WsTile ws_tile(const GemmProblem& p, const u32* prefix, u32 t,
                                                 u32 ntiles_n, u32 cols, u32 crank) {
    u32 lo = 0, hi = p.groups;  // invariant: prefix[lo] <= t < prefix[hi]
    while (hi - lo > 1) {
        const u32 mid = (lo + hi) / 2;
        if (prefix[mid] <= t) lo = mid; else hi = mid;
    }
    WsTile w;
    w.g = lo;
    const u64 gb = group_begin(p, lo), ge = group_end(p, lo, p.m);
    const u32 units = (u32)((ge - gb + (u64)CL * WS_BM - 1) / ((u64)CL * WS_BM));
    const u32 local = t - prefix[lo];
    // Panels of WS_PANEL m-tiles (WS_PANEL / CL units; the last one may be shorter), m
    // fastest inside a panel.
    const u32 pu = WS_PANEL / CL;
    const u32 panel = local / (pu * ntiles_n), inside = local % (pu * ntiles_n);
    const u32 pm = units - panel * pu < pu ? units - panel * pu : pu;
    const u32 mu = panel * pu + inside % pm, nt = inside / pm;
    w.row0 = gb + ((u64)mu * CL + crank) * WS_BM;
    w.rows = w.row0 >= ge ? 0 : (ge - w.row0 < WS_BM ? ge - w.row0 : WS_BM);
    w.n0 = nt * cols;
    return w;
}

// The producer's B boxes of one stage for group g, columns from n0, k from k0; returns their
// bytes (a 64-column block that starts at or past n is not loaded: its columns are not
// stored). K-major: one box of 64 k x 256 n (b, or b2 from b_split on, a multiple of 64).
// N-major: four boxes of 64 n x 64 k: b at n0 + 64 j, or with DUAL_N b at n0, n0 + 64 and b2
// at the same columns. The bytes are what lands in each block of a cluster: with CL = 2 each
// block issues half of the boxes (K-major: the box of 64 k x 128 n at n0 + 128 crank; N-major:
// the 64-column blocks j with j % 2 == crank) to both blocks of the pair.
template <bool B_KMAJ, bool DUAL_N>
static __device__ __forceinline__ u32 ws_b_bytes(const GemmProblem& p, u32 n0) {
    if (B_KMAJ) return WS_B_BYTES;
    u32 blocks = 0;
#pragma unroll
    for (u32 j = 0; j < (DUAL_N ? 2u : 4u); j++) blocks += n0 + 64 * j < p.n ? 1u : 0u;
    return (DUAL_N ? 2u : 1u) * blocks * WS_NBLOCK_BYTES;
}
// One B box: into this block (CL = 1) or into both blocks of the pair (CL = 2).
template <int CL>
static __device__ __forceinline__ void ws_box(u32 dst, const TmaMap* map, i32 c0, i32 c1, i32 c2,
                                              u32 bar) {
    if (CL == 1) tma_load_3d(dst, map, c0, c1, c2, bar);
    else tma_load_3d_multicast(dst, map, c0, c1, c2, bar, (u16)0x3);
}
template <bool B_KMAJ, bool DUAL_N, int CL>
static __device__ __forceinline__ void ws_load_b(const GemmProblem& p, const TmaMap* tb,
                                                 const TmaMap* tb2, u32 g, u32 sb, u32 n0,
                                                 u32 k0, u32 bar, u32 crank) {
    if (B_KMAJ) {
        const bool second = p.b2 && k0 >= p.b_split;
        const u32 half = CL == 1 ? 0u : crank * (WS_BN / 2);
        ws_box<CL>(sb + half * 128, second ? tb2 : tb, (i32)(second ? k0 - p.b_split : k0),
                   (i32)(n0 + half), (i32)g, bar);
    } else {
#pragma unroll
        for (u32 j = 0; j < (DUAL_N ? 2u : 4u); j++) {
            const u32 nn = n0 + 64 * j;
            if (nn >= p.n || (CL == 2 && j % 2 != crank)) continue;
            ws_box<CL>(sb + j * WS_NBLOCK_BYTES, tb, (i32)nn, (i32)k0, (i32)g, bar);
            if (DUAL_N)
                ws_box<CL>(sb + (j + 2) * WS_NBLOCK_BYTES, tb2, (i32)nn, (i32)k0, (i32)g, bar);
        }
    }
}

// CL: blocks per cluster (1, or 2: a pair along M sharing its B stages by multicast; see the
// engine's note above and ws_tile / ws_load_b).
template <bool B_KMAJ, bool DUAL_N, int EPI, int CL>
static __device__ __forceinline__ void gemm_rows_ws(const GemmProblem& p, const TmaMap* ta,
                                                    const TmaMap* tb, const TmaMap* tb2) {
    static_assert(!DUAL_N || !B_KMAJ, "dual-N B is N-major");
    static_assert(CL == 1 || CL == 2, "clusters of one or two blocks");
    extern __shared__ __align__(1024) u8 smem_dyn[];
    __shared__ u32 tile_prefix[AFDEP_GEMM_MAX_GROUPS + 1];
    __shared__ u64 row_off[WS_BM];
    __shared__ __align__(8) u64 bars[2 * WS_STAGES];  // full[s], then empty[s]
    // The dynamic schedule's tile ring, its barriers (tfull[i], then tempty[i]), and the tile
    // thread 0 passes to the other producer threads.
    __shared__ u32 tring[WS_TRING];
    __shared__ __align__(8) u64 tbars[2 * WS_TRING];
    __shared__ u32 ws_next;
    const u32 base = stages_base(smem_dyn);
    const u32 full0 = smem_u32(bars), empty0 = full0 + 8 * WS_STAGES;
    const u32 tfull0 = smem_u32(tbars), tempty0 = tfull0 + 8 * WS_TRING;
    const bool tma_a = (p.tma & AFDEP_GEMM_TMA_A) != 0;
    // The dynamic schedule is for single blocks; pairs always take the static one.
    u32* const sched = CL == 1 ? (u32*)p.sched : nullptr;
    if (threadIdx.x == 0) {
        for (u32 s = 0; s < WS_STAGES; s++) {
            // full: the TMA issuer's expect_tx arrival, plus one per producer thread where A
            // is loaded by cp.async; empty: one arrival per consumer warp of every block of
            // the cluster (a stage's B lands in all of them).
            mbar_init(full0 + 8 * s, tma_a ? 1u : 129u);
            mbar_init(empty0 + 8 * s, 8u * CL);
        }
        for (u32 s = 0; s < WS_TRING; s++) {
            mbar_init(tfull0 + 8 * s, 1u);
            mbar_init(tempty0 + 8 * s, 8u);
        }
        mbar_init_fence();
    }
    const u32 cols = DUAL_N ? WS_BN / 2 : WS_BN;
    const u32 ntiles_n = (p.n + cols - 1) / cols;
    if (threadIdx.x == 0) {
        u32 acc = 0;
        for (u32 g = 0; g < p.groups; g++) {
            tile_prefix[g] = acc;
            const u64 rows = group_end(p, g, p.m) - group_begin(p, g);
            acc += (u32)((rows + (u64)CL * WS_BM - 1) / ((u64)CL * WS_BM)) * ntiles_n;
        }
        tile_prefix[p.groups] = acc;
    }
    // With CL = 2 the peer's TMA and consumers use this block's barriers: they must be
    // initialised before any block of the cluster goes on.
    if (CL == 1) __syncthreads(); else cluster_sync();
    const u32 total = tile_prefix[p.groups];
    const u32 crank = CL == 1 ? 0u : cluster_rank();
    const u32 first = CL == 1 ? blockIdx.x : cluster_index();
    const u32 step = CL == 1 ? gridDim.x : cluster_count();
    const u32 ktiles = (p.k + WS_BK - 1) / WS_BK;
    const u32 role = threadIdx.x / 128;
    bool dead = false;
    u32 stage = 0, phase = 0;

    if (role == 0) {
        // ---- producer ----
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(WS_PRODUCER_REGS));
        const u32 pt = threadIdx.x;
        // With A by TMA only thread 0 loads; the other producer threads are done.
        const bool loads = !tma_a || pt == 0;
        u32 issued = 0;  // cp.async stages this thread issued
        // A thread whose wait ran out (dead) keeps walking the schedule without waiting or
        // issuing, so that every producer thread reaches every producer_sync.
        for (u32 seq = 0; loads; seq++) {
            // This block's (pair's) tile number seq: fixed (static schedule), or the counter's
            // next (dynamic, single blocks only: thread 0 takes it, hands it to the consumers
            // through the ring and to the other producer threads through ws_next). A value
            // >= total ends the block's loop; a dead thread 0 takes none and ends it.
            u32 t = first + seq * step;
            if (sched) {
                if (pt == 0) {
                    t = dead ? total : atomicAdd(sched, 1u);
                    if (t > total) t = total;
                    const u32 slot = seq % WS_TRING;
                    mbar_wait_bounded(p, tempty0 + 8 * slot, ((seq / WS_TRING) & 1u) ^ 1u,
                                      WS_RING_STEP, dead);
                    tring[slot] = t;
                    mbar_arrive(tfull0 + 8 * slot);
                    ws_next = t;
                }
                // every producer thread has issued the previous tile, and sees t
                if (!tma_a) producer_sync();
                t = ws_next;
            } else if (!tma_a) {
                producer_sync();  // every producer thread has issued the previous tile
            }
            if (t >= total) break;
            const WsTile w = ws_tile<CL>(p, tile_prefix, t, ntiles_n, cols, crank);
            if (!tma_a) {
                const u32 r = pt;
                if ((u64)r < w.rows) {
                    const u64 row = w.row0 + r;
                    const u64 arow = p.a_idx ? (u64)(((const u32*)p.a_idx)[row] / p.a_div) : row;
                    row_off[r] = arow * p.lda;
                } else {
                    row_off[r] = ~0ull;
                }
                producer_sync();
            }
            const u32 tx =
                (tma_a ? WS_A_BYTES : 0u) + ws_b_bytes<B_KMAJ, DUAL_N>(p, w.n0) + p.inject_tx;
            for (u32 kt = 0; kt < ktiles; kt++) {
                const u32 full = full0 + 8 * stage, empty = empty0 + 8 * stage;
                mbar_wait_bounded(p, empty, phase ^ 1u, kt, dead);
                const u32 sa = base + stage * WS_STAGE_BYTES, sb = sa + WS_A_BYTES;
                const u32 k0 = kt * WS_BK;
                if (pt == 0 && !dead) {
                    mbar_arrive_expect_tx(full, tx);
                    if (tma_a) tma_load_2d(sa, ta, (i32)k0, (i32)w.row0, full);
                    ws_load_b<B_KMAJ, DUAL_N, CL>(p, tb, tb2, w.g, sb, w.n0, k0, full, crank);
                }
                if (!tma_a && !dead) {
                    // 128 rows x 8 chunks of 16 bytes: thread pt loads chunk pt % 8 of rows
                    // pt / 8 + 16 i; k past K and rows past the group are zero-filled.
                    const u16* a = (const u16*)p.a;
                    const u32 c = pt % 8, kk = k0 + c * 8;
#pragma unroll
                    for (u32 i = 0; i < 8; i++) {
                        const u32 r = pt / 8 + 16 * i;
                        const u64 off = row_off[r];
                        const bool ok = off != ~0ull && kk < p.k;
                        afdep_cp_async16(sa + r * 128 + ((c ^ (r & 7)) << 4), ok ? a + off + kk : a, ok);
                    }
                    afdep_cp_async_commit();
                    // The stage issued WS_CP_LAG stages ago has landed: fence it into the async
                    // proxy (wgmma reads it) and arrive.
                    if (issued >= WS_CP_LAG) {
                        afdep_cp_async_wait<WS_CP_LAG>();
                        fence_proxy_async();
                        mbar_arrive(full0 + 8 * ((stage + WS_STAGES - WS_CP_LAG) % WS_STAGES));
                    }
                    issued++;
                }
                if (++stage == WS_STAGES) {
                    stage = 0;
                    phase ^= 1u;
                }
            }
        }
        if (!tma_a && !dead) {
            // The last stages (at most WS_CP_LAG) not yet arrived on.
            afdep_cp_async_wait<0>();
            fence_proxy_async();
            for (u32 j = issued < WS_CP_LAG ? issued : WS_CP_LAG; j > 0; j--)
                mbar_arrive(full0 + 8 * ((stage + WS_STAGES - j) % WS_STAGES));
        }
        if (sched && pt == 0) {
            // This block takes no more tiles. Every block counts itself done after its last
            // take; the last one puts both counters back to zero for the next GEMM on the
            // stream (which starts after this grid ends).
            __threadfence();
            if (atomicAdd(sched + 1, 1u) == gridDim.x - 1) {
                __threadfence();
                atomicExch(sched, 0u);
                atomicExch(sched + 1, 0u);
            }
        }
    } else {
        // ---- consumers ----
        asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(WS_CONSUMER_REGS));
        const u32 wc = role - 1;  // rows 64 wc .. of the tile
        const u32 warp = (threadIdx.x / 32) % 4, lane = afdep_lane();
        const u32 gq = lane / 4, tq = lane % 4;
        // A stage is free once every consumer warp of the cluster is done with it: with
        // CL = 2 a warp arrives on the `empty` barrier of both blocks (the producer of either
        // refills the stage in both).
        const auto release = [&](u32 bar) {
            if (CL == 1) {
                mbar_arrive(bar);
            } else {
                mbar_arrive(bar);               // this block's barrier
                mbar_arrive_in(bar, crank ^ 1u);  // the peer's
            }
        };
        for (u32 seq = 0;; seq++) {
            // The block's tile number seq: fixed, or the ring's entry (dynamic schedule); a
            // consumer whose wait ran out stops, and with it its whole warpgroup: its wgmmas
            // are warpgroup-wide (.sync.aligned), so no thread may leave the loop alone (the
            // threads' bounded waits can run out at different times, or some not at all).
            u32 t = first + seq * step;
            if (sched) {
                const u32 slot = seq % WS_TRING;
                mbar_wait_bounded(p, tfull0 + 8 * slot, (seq / WS_TRING) & 1u, WS_RING_STEP,
                                  dead);
                t = dead ? total : tring[slot];
                __syncwarp();
                // The warp's reads are done; only a lane 0 that saw the entry land frees it
                // (an arrival without the wait could complete the slot's previous phase early).
                if (lane == 0 && !dead) mbar_arrive(tempty0 + 8 * slot);
                if (consumer_any(wc, t >= total)) break;
            }
            if (t >= total) break;
            const WsTile w = ws_tile<CL>(p, tile_prefix, t, ntiles_n, cols, crank);
            // The second block of a pair past its group's last m-tile has no rows: it keeps
            // the stage protocol (its producer loads its half of B for the first block) and
            // runs its wgmmas on whatever A holds (zero-filled or other rows); the epilogue
            // stores none of it. A wgmma under a branch makes ptxas close the group inside the
            // branch and commit an empty one after it, so wgmma_wait<1> waited for the batch
            // just issued (no batch in flight across k-tiles).
            float acc[128];
#pragma unroll
            for (int i = 0; i < 128; i++) acc[i] = 0.0f;
            u32 prev = 0;
            for (u32 kt = 0; kt < ktiles; kt++) {
                const u32 full = full0 + 8 * stage;
                mbar_wait_bounded(p, full, phase, kt, dead);
                const u32 sa = base + stage * WS_STAGE_BYTES, sb = sa + WS_A_BYTES;
                wgmma_fence();
#pragma unroll
                for (int ks = 0; ks < WS_BK / 16; ks++) {
                    const u64 da = smem_desc(sa + wc * 64 * 128 + ks * 32, 16, 1024, 1);
                    const u64 db = B_KMAJ ? smem_desc(sb + ks * 32, 16, 1024, 1)
                                          : smem_desc(sb + ks * 2048, WS_NBLOCK_BYTES, 1024, 1);
                    wgmma_m64n256k16<0, B_KMAJ ? 0 : 1>(acc, da, db);
                }
                wgmma_commit();
                wgmma_wait<1>();
                // kt - 1's wgmmas have retired: its stage may be refilled.
                if (kt > 0 && lane == 0 && !dead) release(empty0 + 8 * prev);
                prev = stage;
                if (++stage == WS_STAGES) {
                    stage = 0;
                    phase ^= 1u;
                }
            }
            wgmma_wait<0>();
            if (ktiles > 0 && lane == 0 && !dead) release(empty0 + 8 * prev);

            // Epilogue straight from the accumulators (element 4 j + 2 h + e: row 16 warp + gq +
            // 8 h, column 8 j + 2 tq + e of the warpgroup's 64 x 256).
            const u32 er = wc * 64 + warp * 16 + gq;
            const u64 erows[2] = {(u64)er < w.rows ? w.row0 + er : ~0ull,
                                  (u64)(er + 8) < w.rows ? w.row0 + er + 8 : ~0ull};
            // 8 pairs per batch (4 for ACC_BF16, whose 8 spilled).
            epi_tile<EPI, DUAL_N, EPI == AFDEP_EPI_ACC_BF16 ? 4 : 8>(p, acc, erows, w.n0, tq);
        }
    }  // consumers
    // No block of a pair leaves while its peer may still write into its shared memory or
    // arrive on its barriers (every wait above is bounded, so every thread gets here).
    if (CL == 2) cluster_sync();
}

// ---------------------------------------------------------------------------------------------
// The nine ROWS problems the layer uses, each with an entry on both engines and one for the ws
// engine in pairs of blocks (clusters of 2 along M, `__cluster_dims__`: a plain launch makes
// the pairs): ROWS_ENTRY(classic entry, warp-specialised entry, paired entry, B K-major,
// dual N, epilogue). ROWS kernels take the tensor maps of A, B and b2 by value
// (__grid_constant__: TMA reads them in parameter space); a map whose AFDEP_GEMM_TMA_* bit is
// clear is not read. The paired entries' K-major B maps have boxes of 128 n (each block loads
// half of the 256 columns).
#define ROWS_ENTRY(name, ws_name, ws2_name, BKMAJ, DUAL, EPI)                                \
    extern "C" __global__ void __launch_bounds__(AFDEP_BLOCK, AFDEP_GEMM_MIN_BLOCKS)           \
        name(GemmProblem p, const __grid_constant__ TmaMap ta,                               \
             const __grid_constant__ TmaMap tb, const __grid_constant__ TmaMap tb2) {        \
        gemm_rows<BKMAJ, DUAL, EPI>(p, &ta, &tb, &tb2);                                      \
    }                                                                                        \
    extern "C" __global__ void __launch_bounds__(WS_THREADS, 1)                              \
        ws_name(GemmProblem p, const __grid_constant__ TmaMap ta,                            \
                const __grid_constant__ TmaMap tb, const __grid_constant__ TmaMap tb2) {     \
        gemm_rows_ws<BKMAJ, DUAL, EPI, 1>(p, &ta, &tb, &tb2);                                \
    }                                                                                        \
    extern "C" __global__ void __cluster_dims__(2, 1, 1) __launch_bounds__(WS_THREADS, 1)    \
        ws2_name(GemmProblem p, const __grid_constant__ TmaMap ta,                           \
                 const __grid_constant__ TmaMap tb, const __grid_constant__ TmaMap tb2) {    \
        gemm_rows_ws<BKMAJ, DUAL, EPI, 2>(p, &ta, &tb, &tb2);                                \
    }

// Forward up-projection: x·[W1 | W3] (B N-major), SwiGLU epilogue.
ROWS_ENTRY(afdep_gemm_up_swiglu, afdep_gemm_ws_up_swiglu, afdep_gemm_ws2_up_swiglu,
           false, true, AFDEP_EPI_SWIGLU)
// Forward down-projection h·W2 (B N-major) into expert-sorted rows (optionally weighted).
ROWS_ENTRY(afdep_gemm_down_store, afdep_gemm_ws_down_store, afdep_gemm_ws2_down_store,
           false, false, AFDEP_EPI_STORE)
// Forward down-projection scattered into token order with the router weight (atomic f32).
ROWS_ENTRY(afdep_gemm_down_scatter, afdep_gemm_ws_down_scatter, afdep_gemm_ws2_down_scatter,
           false, false, AFDEP_EPI_SCATTER)
// Shared-expert down-projection added to the routed sum, cast to bf16 once.
ROWS_ENTRY(afdep_gemm_down_acc, afdep_gemm_ws_down_acc, afdep_gemm_ws2_down_acc,
           false, false, AFDEP_EPI_ACC_BF16)
// Backward: G = dy·W2^T (B K-major) with the SwiGLU backward in the epilogue.
ROWS_ENTRY(afdep_gemm_dh_dswiglu, afdep_gemm_ws_dh_dswiglu, afdep_gemm_ws2_dh_dswiglu,
           true, false, AFDEP_EPI_DSWIGLU)
// Backward data gradient [da | db]·[W1 | W3]^T (B K-major, split along K) into rows.
ROWS_ENTRY(afdep_gemm_dx_store, afdep_gemm_ws_dx_store, afdep_gemm_ws2_dx_store,
           true, false, AFDEP_EPI_STORE)
// ... scattered into token order (atomic f32).
ROWS_ENTRY(afdep_gemm_dx_scatter, afdep_gemm_ws_dx_scatter, afdep_gemm_ws2_dx_scatter,
           true, false, AFDEP_EPI_SCATTER)
// ... added in place to an f32 accumulator (the shared expert's dx).
ROWS_ENTRY(afdep_gemm_dx_add, afdep_gemm_ws_dx_add, afdep_gemm_ws2_dx_add,
           true, false, AFDEP_EPI_ADD_F32)
// ... added to an f32 accumulator and cast to bf16 (the router's dx = dlogits·Wr^T).
ROWS_ENTRY(afdep_gemm_dx_acc, afdep_gemm_ws_dx_acc, afdep_gemm_ws2_dx_acc,
           true, false, AFDEP_EPI_ACC_BF16)

// =============================================================================================
// The warp-specialised KSUM engine (weight gradients; docs/perf/moe.md, 2026-12-05 (c)). Off
// unless the host asks for it (ops::gemm::wgrad_engine_for).
//
// The rows engine's skeleton (384 threads, one block per SM, a producer warpgroup and two wgmma
// consumer warpgroups, WS_STAGES stages of 48 KiB with full / empty mbarriers, bounded waits)
// over the KSUM problem: tiles (group, chunk, m tile, n tile) of 128 m x 256 n, K = the
// chunk's rows, WS_BK k-rows per stage. Both operand tiles are MN-major: a stage holds 64
// k-rows of 128 A columns (two 64-column blocks) and of 256 B columns (four blocks), each
// block 64 rows x 128 bytes with the 128-byte swizzle (the TMA box layout, and what wgmma
// reads with transposed descriptors: LBO = the block stride, SBO = the 8-row atom).
// - An operand whose rows are contiguous (its AFDEP_GEMM_TMA_* bit: A = 1, B = 2) loads by TMA:
//   producer thread 0 issues one 64 x 64 box per block that starts below M / N. A box
//   delivers 64 rows whatever the chunk: in the chunk's last k-tile the rows past its end
//   (another group's, or unwritten rows of the buffer, possibly NaN) are zeroed in shared
//   memory by the consumers after the full wait, each writer runs fence.proxy.async, and the
//   256 consumer threads meet at named barrier 2 before the stage's wgmmas (reasoning in the
//   doc: once per chunk, and the producer and the stage's arrival count stay as they are).
// - A gathered operand (or one without a map) loads by cp.async from all 128 producer
//   threads, zero-filled past the chunk's end and past M / N; each thread arrives on a
//   stage's full barrier WS_CP_LAG stages after issuing it, as the rows engine's gathered A.
//   The source rows of a stage come from a double-buffered row table in shared memory that
//   producer threads fill one stage ahead (threads 0-63: A's 64 rows, 64-127: B's; the index
//   load is issued before the empty wait and consumed after the copies).
// - Tile order inside (group, chunk): the dimension with fewer tiles fastest, so the tiles in
//   flight share a few slabs of one operand and all of the other's in L2.
// - Epilogues of gemm_ksum: with one chunk and c2, bf16 straight into the gradient (columns
//   from b_split on into c3 when given); otherwise the chunk's f32 partial for
//   afdep_gemm_reduce.

// 64-column blocks of a KSUM stage's A and B tiles.
#define WSK_A_BLOCKS (WS_BM / 64)
#define WSK_B_BLOCKS (WS_BN / 64)
static_assert(WS_A_BYTES == WSK_A_BLOCKS * WS_NBLOCK_BYTES, "A tile = its 64-column blocks");
static_assert(WS_B_BYTES == WSK_B_BLOCKS * WS_NBLOCK_BYTES, "B tile = its 64-column blocks");
static_assert(WS_BK == 64, "a KSUM stage is 64 k-rows: one producer thread per row and operand");
// Registers per thread after setmaxnreg (128 x 72 + 256 x 216 = 64,512, the launch's 384 x
// 168): the producer resolves gathered rows and walks 64-bit chunk bounds (at the rows
// engine's 56 it spilled 72 bytes); the consumers' 128 accumulators fit 216.
#define WSK_PRODUCER_REGS 72
#define WSK_CONSUMER_REGS 216

// Barrier 2 among the two consumer warpgroups' 256 threads.
static __device__ __forceinline__ void consumer_sync() {
    asm volatile("bar.sync 2, 256;" ::: "memory");
}

// The KSUM ws tile t: group g, chunk s, first m / n, the chunk's rows kb .. ke.
struct WsKTile {
    u32 g, s, m0, n0;
    u64 kb, ke;
    u32 ktiles;
};
static __device__ __forceinline__ WsKTile wsk_tile(const GemmProblem& p, u32 t, u32 mtiles,
                                                   u32 ntiles) {
    const u32 per = mtiles * ntiles;
    const u32 inner = t % per, rest = t / per;
    WsKTile w;
    w.s = rest % p.splits;
    w.g = rest / p.splits;
    const u32 mt = ntiles <= mtiles ? inner / ntiles : inner % mtiles;
    const u32 nt = ntiles <= mtiles ? inner % ntiles : inner / mtiles;
    w.m0 = mt * WS_BM;
    w.n0 = nt * WS_BN;
    const u64 gb = group_begin(p, w.g), ge = group_end(p, w.g, p.k);
    u64 chunk = (ge - gb + p.splits - 1) / p.splits;
    chunk = (chunk + WS_BK - 1) / WS_BK * WS_BK;
    w.kb = gb + (u64)w.s * chunk < ge ? gb + (u64)w.s * chunk : ge;
    w.ke = w.kb + chunk < ge ? w.kb + chunk : ge;
    w.ktiles = (u32)((w.ke - w.kb + WS_BK - 1) / WS_BK);
    return w;
}

// 64-column blocks of a tile from column c0 that start below lim (at most `blocks`).
static __device__ __forceinline__ u32 wsk_blocks(u32 c0, u32 lim, u32 blocks) {
    u32 n = 0;
    for (u32 j = 0; j < blocks; j++) n += c0 + 64 * j < lim ? 1u : 0u;
    return n;
}

// Element offset of the source row of chunk row `row` (~0 at or past `end`).
static __device__ __forceinline__ u64 wsk_src(u64 idx, u32 div, u64 ld, u64 row, u64 end) {
    if (row >= end) return ~0ull;
    const u64 src = idx ? (u64)(__ldg((const u32*)idx + row) / div) : row;
    return src * ld;
}

// cp.async of one MN-major operand tile of BLOCKS 64-column blocks by the 128 producer threads:
// k-row r (source offset off[r], ~0 = zero) and 16-byte chunk c of the row's BLOCKS * 8.
template <u32 BLOCKS>
static __device__ __forceinline__ void wsk_copy(const u16* src, u32 s, const u64* off, u32 col0,
                                                u32 lim, u32 pt) {
    constexpr u32 CH = BLOCKS * 8;
    constexpr u32 ROWS_PER = 128 / CH;  // 8 (A) or 4 (B): a divisor of the swizzle's 8 rows
    static_assert(8 % ROWS_PER == 0, "the rows of one pass stay inside a swizzle atom");
    // Row r = r0 + ROWS_PER i with r0 < ROWS_PER, so r % 8 = r0 | (ROWS_PER i % 8) and the
    // chunk's swizzled position is (c % 8) ^ r0 ^ (ROWS_PER i % 8): one value of the thread
    // and a constant per i (written so, the compiler keeps one register, not one per i).
    const u32 r0 = pt / CH, c = pt % CH;
    const u32 cc = col0 + c * 8;
    const bool col_ok = cc < lim;
    const u32 s0 = s + (c / 8) * WS_NBLOCK_BYTES + r0 * 128 + (((c & 7) ^ r0) << 4);
#pragma unroll
    for (u32 i = 0; i < WS_BK / ROWS_PER; i++) {
        const u64 o = off[r0 + ROWS_PER * i];
        const bool ok = col_ok && o != ~0ull;
        afdep_cp_async16((s0 ^ (((ROWS_PER * i) & 7u) << 4)) + ROWS_PER * i * 128,
                   ok ? src + o + cc : src, ok);
    }
}

static __device__ __forceinline__ void gemm_ksum_ws(const GemmProblem& p, const TmaMap* ta,
                                                    const TmaMap* tb) {
    extern __shared__ __align__(1024) u8 smem_dyn[];
    // Source row offsets of the stage being issued and of the next: [buffer][A, B][k-row].
    __shared__ u64 src_off[2][2][WS_BK];
    __shared__ __align__(8) u64 bars[2 * WS_STAGES];  // full[s], then empty[s]
    const u32 base = stages_base(smem_dyn);
    const u32 full0 = smem_u32(bars), empty0 = full0 + 8 * WS_STAGES;
    const bool tma_a = (p.tma & AFDEP_GEMM_TMA_A) != 0, tma_b = (p.tma & AFDEP_GEMM_TMA_B) != 0;
    const bool tma = tma_a || tma_b, cp = !(tma_a && tma_b);
    if (threadIdx.x == 0) {
        for (u32 s = 0; s < WS_STAGES; s++) {
            // full: the TMA issuer's expect_tx arrival, plus one per producer thread where an
            // operand is loaded by cp.async; empty: one arrival per consumer warp.
            mbar_init(full0 + 8 * s, (tma ? 1u : 0u) + (cp ? 128u : 0u));
            mbar_init(empty0 + 8 * s, 8u);
        }
        mbar_init_fence();
    }
    __syncthreads();
    const u32 mtiles = (p.m + WS_BM - 1) / WS_BM, ntiles = (p.n + WS_BN - 1) / WS_BN;
    const u32 total = p.groups * mtiles * ntiles * p.splits;
    const u32 role = threadIdx.x / 128;
    bool dead = false;
    u32 stage = 0, phase = 0;

    if (role == 0) {
        // ---- producer ----
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(WSK_PRODUCER_REGS));
        const u32 pt = threadIdx.x;
        // With both operands by TMA only thread 0 loads; the other producer threads are done.
        const bool loads = cp || pt == 0;
        // The row this thread resolves: operand pt / 64 (A, B), k-row pt % 64; only for an
        // operand loaded by cp.async.
        const u32 rop = pt / WS_BK, rr = pt % WS_BK;
        const bool resolves = rop == 0 ? !tma_a : !tma_b;
        const u64 ridx = rop == 0 ? p.a_idx : p.b_idx;
        const u32 rdiv = rop == 0 ? p.a_div : p.b_div;
        const u64 rld = rop == 0 ? p.lda : p.ldb;
        u32 issued = 0;  // cp.async stages this thread issued
        // A thread whose wait ran out (dead) keeps walking the schedule without waiting or
        // issuing, so that every producer thread reaches every producer_sync.
        for (u32 t = blockIdx.x; loads && t < total; t += gridDim.x) {
            const WsKTile w = wsk_tile(p, t, mtiles, ntiles);
            const u32 tx = (tma_a ? wsk_blocks(w.m0, p.m, WSK_A_BLOCKS) : 0u) * WS_NBLOCK_BYTES +
                           (tma_b ? wsk_blocks(w.n0, p.n, WSK_B_BLOCKS) : 0u) * WS_NBLOCK_BYTES +
                           p.inject_tx;
            if (cp) {
                // The rows of k-tile 0 (every reader of buffer 0 passed the last sync).
                if (resolves) src_off[0][rop][rr] = wsk_src(ridx, rdiv, rld, w.kb + rr, w.ke);
                producer_sync();
            }
            for (u32 kt = 0; kt < w.ktiles; kt++) {
                const u32 full = full0 + 8 * stage, empty = empty0 + 8 * stage;
                const u64 k0 = w.kb + (u64)kt * WS_BK;
                // The source row of k-tile kt + 1: the index load is in flight through the
                // wait and the copies below.
                const u64 next = cp && resolves ? wsk_src(ridx, rdiv, rld, k0 + WS_BK + rr, w.ke)
                                                : ~0ull;
                mbar_wait_bounded(p, empty, phase ^ 1u, kt, dead);
                const u32 sa = base + stage * WS_STAGE_BYTES, sb = sa + WS_A_BYTES;
                if (pt == 0 && tma && !dead) {
                    mbar_arrive_expect_tx(full, tx);
                    if (tma_a) {
#pragma unroll
                        for (u32 j = 0; j < WSK_A_BLOCKS; j++)
                            if (w.m0 + 64 * j < p.m)
                                tma_load_2d(sa + j * WS_NBLOCK_BYTES, ta, (i32)(w.m0 + 64 * j),
                                            (i32)k0, full);
                    }
                    if (tma_b) {
#pragma unroll
                        for (u32 j = 0; j < WSK_B_BLOCKS; j++)
                            if (w.n0 + 64 * j < p.n)
                                tma_load_2d(sb + j * WS_NBLOCK_BYTES, tb, (i32)(w.n0 + 64 * j),
                                            (i32)k0, full);
                    }
                }
                if (cp) {
                    const u32 buf = kt & 1u;
                    if (!dead) {
                        if (!tma_a)
                            wsk_copy<WSK_A_BLOCKS>((const u16*)p.a, sa, src_off[buf][0], w.m0,
                                                   p.m, pt);
                        if (!tma_b)
                            wsk_copy<WSK_B_BLOCKS>((const u16*)p.b, sb, src_off[buf][1], w.n0,
                                                   p.n, pt);
                        afdep_cp_async_commit();
                        // The stage issued WS_CP_LAG stages ago has landed: fence it into the
                        // async proxy (wgmma reads it) and arrive.
                        if (issued >= WS_CP_LAG) {
                            afdep_cp_async_wait<WS_CP_LAG>();
                            fence_proxy_async();
                            mbar_arrive(full0 + 8 * ((stage + WS_STAGES - WS_CP_LAG) % WS_STAGES));
                        }
                        issued++;
                    }
                    if (resolves) src_off[buf ^ 1u][rop][rr] = next;
                    producer_sync();  // kt + 1's rows are written; kt's are read
                }
                if (++stage == WS_STAGES) {
                    stage = 0;
                    phase ^= 1u;
                }
            }
        }
        if (cp && !dead) {
            // The last stages (at most WS_CP_LAG) not yet arrived on.
            afdep_cp_async_wait<0>();
            fence_proxy_async();
            for (u32 j = issued < WS_CP_LAG ? issued : WS_CP_LAG; j > 0; j--)
                mbar_arrive(full0 + 8 * ((stage + WS_STAGES - j) % WS_STAGES));
        }
    } else {
        // ---- consumers ----
        asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(WSK_CONSUMER_REGS));
        const u32 wc = role - 1;  // m rows 64 wc .. of the tile: A block wc
        const u32 ct = threadIdx.x - 128;
        const u32 warp = (threadIdx.x / 32) % 4, lane = afdep_lane();
        const u32 gq = lane / 4, tq = lane % 4;
        // The TMA-loaded blocks of a stage (A's, then B's: contiguous from tma_first).
        const u32 zblocks = (tma_a ? WSK_A_BLOCKS : 0u) + (tma_b ? WSK_B_BLOCKS : 0u);
        const u32 zfirst = tma_a ? 0u : WSK_A_BLOCKS;
        for (u32 t = blockIdx.x; t < total; t += gridDim.x) {
            const WsKTile w = wsk_tile(p, t, mtiles, ntiles);
            float acc[128];
#pragma unroll
            for (int i = 0; i < 128; i++) acc[i] = 0.0f;
            u32 prev = 0;
            for (u32 kt = 0; kt < w.ktiles; kt++) {
                const u32 full = full0 + 8 * stage;
                mbar_wait_bounded(p, full, phase, kt, dead);
                const u32 sa = base + stage * WS_STAGE_BYTES, sb = sa + WS_A_BYTES;
                const u64 left = w.ke - (w.kb + (u64)kt * WS_BK);
                if (left < WS_BK && zblocks) {
                    // The chunk ends inside this k-tile: zero k-rows `valid` .. 63 of every
                    // TMA-loaded block (whole 128-byte rows: the swizzle does not matter).
                    const u32 valid = (u32)left, per = (WS_BK - valid) * 8;
                    for (u32 i = ct; i < zblocks * per; i += 256) {
                        const u32 blk = zfirst + i / per, rest = i % per;
                        const u32 addr = sa + blk * WS_NBLOCK_BYTES + (valid + rest / 8) * 128 +
                                         (rest % 8) * 16;
                        asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};" ::"r"(addr),
                                     "r"(0u)
                                     : "memory");
                    }
                    fence_proxy_async();
                    consumer_sync();
                }
                wgmma_fence();
#pragma unroll
                for (int ks = 0; ks < WS_BK / 16; ks++) {
                    const u64 da =
                        smem_desc(sa + wc * WS_NBLOCK_BYTES + ks * 2048, WS_NBLOCK_BYTES, 1024, 1);
                    const u64 db = smem_desc(sb + ks * 2048, WS_NBLOCK_BYTES, 1024, 1);
                    wgmma_m64n256k16<1, 1>(acc, da, db);
                }
                wgmma_commit();
                wgmma_wait<1>();
                // kt - 1's wgmmas have retired: its stage may be refilled.
                if (kt > 0 && lane == 0 && !dead) mbar_arrive(empty0 + 8 * prev);
                prev = stage;
                if (++stage == WS_STAGES) {
                    stage = 0;
                    phase ^= 1u;
                }
            }
            wgmma_wait<0>();
            if (w.ktiles > 0 && lane == 0 && !dead) mbar_arrive(empty0 + 8 * prev);

            // Epilogue straight from the accumulators (element 4 j + 2 h + e: m row 16 warp +
            // gq + 8 h of the consumer's 64, n column 8 j + 2 tq + e of the tile's 256).
            const bool direct = p.splits == 1 && p.c2;
            const u32 n1 = p.c3 ? p.b_split : p.n;
            float* part = (float*)p.c + ((u64)w.g * p.splits + w.s) * (u64)p.m * p.n;
#pragma unroll
            for (int hr = 0; hr < 2; hr++) {
                const u32 m = w.m0 + wc * 64 + warp * 16 + gq + hr * 8;
                if (m >= p.m) continue;
                const u64 row = (u64)w.g * p.m + m;
#pragma unroll
                for (int j = 0; j < 32; j++) {
                    const u32 n = w.n0 + j * 8 + 2 * tq;
                    if (n >= p.n) continue;
                    const float v0 = acc[4 * j + 2 * hr], v1 = acc[4 * j + 2 * hr + 1];
                    if (direct) {
                        // n is even and n1 a multiple of 8: the pair stays on one side.
                        const u32 v = pack_bf16(v0, v1);
                        if (n < n1) *(u32*)((u16*)p.c2 + row * n1 + n) = v;
                        else *(u32*)((u16*)p.c3 + row * (p.n - n1) + (n - n1)) = v;
                    } else {
                        *(float2*)(part + (u64)m * p.n + n) = make_float2(v0, v1);
                    }
                }
            }
        }
    }  // consumers
}

// Weight gradients on the ws engine: the tensor maps of A and B ([rows][cols], boxes of 64 x
// 64); a map whose AFDEP_GEMM_TMA_* bit is clear is not read.
extern "C" __global__ void __launch_bounds__(WS_THREADS, 1)
    afdep_gemm_ws_wgrad(GemmProblem p, const __grid_constant__ TmaMap ta,
                        const __grid_constant__ TmaMap tb) {
    gemm_ksum_ws(p, &ta, &tb);
}
