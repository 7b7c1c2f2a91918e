// Grouped GEMM for the MoE layer: bf16 operands, f32 accumulation, tensor cores (mma.sync
// m16n8k16, operands staged through shared memory by a cp.async pipeline), a persistent grid
// whose tile schedule is derived from the group offsets on the device (no host sync), 64-bit
// row offsets, and one epilogue per layer step.
//
// Two shapes of problem (see layout/gemm_problem.cuh for the descriptor):
// - ROWS: group g owns output rows offsets[g] .. offsets[g+1] (M varies per group); N and K are
//   fixed; B is per group (b + g * b_gs). Forward up/down projections and data gradients.
// - KSUM: group g owns the K-rows offsets[g] .. offsets[g+1]; its output is an M x N matrix
//   C_g = sum_r A(r, :)^T B(r, :) (weight gradients). The K range of a group is split in
//   `splits` chunks; each chunk writes an f32 partial, summed in split order by
//   afdep_gemm_reduce (deterministic, no atomics).
//
// Summation order: each output is one f32 accumulator per thread fed by the tensor-core
// products in ascending k-tile order (the order inside one mma is the hardware's). This is not
// the CPU oracle's order; results agree within the bf16 tolerance documented in afdep-moe.

#include "common/ptx.cuh"
#include "common/types.cuh"
#include "layout/gemm_problem.cuh"

static_assert(AFDEP_BLOCK == 256, "the GEMM tiling assumes 8 warps");

#define BM 128
#define BN 128
#define BK 32
#define STAGES 4
#define WARPS_M 2
#define WARPS_N 4
#define WM (BM / WARPS_M)  // 64
#define WN (BN / WARPS_N)  // 32
#define MI (WM / 16)       // 4 m16 tiles per warp
#define NI (WN / 8)        // 4 n8 tiles per warp

// Shared memory per stage: an A tile and a B tile of 4096 bf16 each (8 KiB).
#define TILE_ELEMS (BM * BK)
#define STAGE_ELEMS (2 * TILE_ELEMS)
// Dynamic shared memory of every GEMM kernel: the stages plus the per-group tile prefix.
// Must equal afdep_kernels::ops::gemm::SMEM_BYTES.
#define SMEM_STAGE_BYTES (STAGES * STAGE_ELEMS * 2)

static_assert(BM == BN, "square tiles: both operand tiles have the same shape");

// ---------------------------------------------------------------------------------------------
// Shared-memory tile layouts (16-byte chunks, XOR-swizzled so that ldmatrix is conflict free).
// K-major tile: 128 rows (m or n) x 32 k = 4 chunks per row.
static __device__ __forceinline__ u32 kmaj_off(u32 r, u32 c) {
    return (r * 4 + (c ^ ((r >> 1) & 3))) * 8;  // in elements
}
// MN-major tile: 32 rows (k) x 128 m/n = 16 chunks per row.
static __device__ __forceinline__ u32 mnmaj_off(u32 r, u32 c) {
    return (r * 16 + (c ^ (r & 7))) * 8;
}

static __device__ __forceinline__ u32 smem_u32(const void* p) {
    return (u32)__cvta_generic_to_shared(p);
}

// 16-byte cp.async with zero fill when !pred (src is not read then).
static __device__ __forceinline__ void cp_async16(u32 dst, const void* src, bool pred) {
    const u32 n = pred ? 16u : 0u;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(n)
                 : "memory");
}
static __device__ __forceinline__ void cp_async_commit() {
    asm volatile("cp.async.commit_group;" ::: "memory");
}
template <int N>
static __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

static __device__ __forceinline__ void ldsm_x4(u32 addr, u32& r0, u32& r1, u32& r2, u32& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr));
}
static __device__ __forceinline__ void ldsm_x4_t(u32 addr, u32& r0, u32& r1, u32& r2, u32& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr));
}

static __device__ __forceinline__ void mma_bf16(float* d, const u32* a, const u32* b) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

static __device__ __forceinline__ u32 pack_bf16(float lo, float hi) {
    return (u32)afdep_f32_to_bf16(lo) | ((u32)afdep_f32_to_bf16(hi) << 16);
}
static __device__ __forceinline__ float2 unpack_bf16(u32 v) {
    return make_float2(afdep_bf16_to_f32((u16)(v & 0xffffu)), afdep_bf16_to_f32((u16)(v >> 16)));
}

static __device__ __forceinline__ float sigmoidf_(float a) { return 1.0f / (1.0f + expf(-a)); }

// ---------------------------------------------------------------------------------------------
// One tile's coordinates.
struct Tile {
    u32 group;
    u64 row0;   // ROWS: first output row of the tile; KSUM: first K-row of the chunk
    u64 rows;   // ROWS: valid output rows (<= BM); KSUM: K-rows of the chunk
    u32 m0, n0; // ROWS: n0 only (tile column); KSUM: output tile origin
    u32 split;
};

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

// ---------------------------------------------------------------------------------------------
// Loaders. Each stage loads 512 chunks of A and 512 of B: 2 + 2 per thread.

// ROWS A (K-major, rows gathered): row_ptr[] holds the element offset of each tile row (or
// ~0 for rows past the group), computed once per tile.
static __device__ __forceinline__ void load_a_rows(const GemmProblem& p, const u64* row_off,
                                                   u16* sa, u32 k0) {
    const u16* a = (const u16*)p.a;
#pragma unroll
    for (int i = 0; i < 2; i++) {
        const u32 id = threadIdx.x + i * AFDEP_BLOCK;
        const u32 r = id / 4, c = id % 4;
        const u64 off = row_off[r];
        const u32 kk = k0 + c * 8;
        const bool ok = off != ~0ull && kk < p.k;
        cp_async16(smem_u32(sa + kmaj_off(r, c)), ok ? a + off + kk : a, ok);
    }
}

// ROWS B for group g: K-major ([n][k], ldb) or N-major ([k][n], ldb).
template <bool B_KMAJ, bool DUAL_N>
static __device__ __forceinline__ void load_b_rows(const GemmProblem& p, u32 g, u16* sb, u32 n0,
                                                   u32 k0) {
    const u16* b = (const u16*)p.b;
    u32 kb = k0;
    if (!DUAL_N && p.b2 && k0 >= p.b_split) {
        b = (const u16*)p.b2;
        kb = k0 - p.b_split;
    }
    b += (u64)g * p.b_gs;
    const u32 klim = (!DUAL_N && p.b2) ? (k0 >= p.b_split ? p.k - p.b_split : p.b_split) : p.k;
#pragma unroll
    for (int i = 0; i < 2; i++) {
        const u32 id = threadIdx.x + i * AFDEP_BLOCK;
        if (B_KMAJ) {
            static_assert(!DUAL_N || !B_KMAJ, "dual-N B is N-major");
            const u32 r = id / 4, c = id % 4;  // r: n within the tile, c: k chunk
            const u32 nn = n0 + r, kk = kb + c * 8;
            const bool ok = nn < p.n && kk < klim;
            cp_async16(smem_u32(sb + kmaj_off(r, c)), ok ? b + (u64)nn * p.ldb + kk : b, ok);
        } else {
            const u32 r = id / 16, c = id % 16;  // r: k within the tile, c: n chunk
            const u32 kk = kb + r;
            u32 nn;
            const u16* src = b;
            if (DUAL_N) {
                // chunks 0..7: b columns n0 + 8c; chunks 8..15: b2 columns n0 + 8(c - 8)
                nn = n0 + (c % 8) * 8;
                if (c >= 8) src = (const u16*)p.b2 + (u64)g * p.b_gs;
            } else {
                nn = n0 + c * 8;
            }
            const bool ok = nn < p.n && kk < klim;
            cp_async16(smem_u32(sb + mnmaj_off(r, c)), ok ? src + (u64)kk * p.ldb + nn : src, ok);
        }
    }
}

// KSUM operand (MN-major [r][m], rows gathered through idx/div): tile rows are K-rows
// r0 .. r0 + 31 (< rend), columns c0 .. c0 + 127 (< lim).
static __device__ __forceinline__ void load_ksum(const u16* base, u64 ld, u64 idx, u32 div,
                                                 u16* s, u64 r0, u64 rend, u32 c0, u32 lim) {
#pragma unroll
    for (int i = 0; i < 2; i++) {
        const u32 id = threadIdx.x + i * AFDEP_BLOCK;
        const u32 r = id / 16, c = id % 16;
        const u64 rr = r0 + r;
        const u32 cc = c0 + c * 8;
        const bool ok = rr < rend && cc < lim;
        const u16* src = base;
        if (ok) {
            const u64 row = idx ? (u64)(((const u32*)idx)[rr] / div) : rr;
            src = base + row * ld + cc;
        }
        cp_async16(smem_u32(s + mnmaj_off(r, c)), src, ok);
    }
}

// ---------------------------------------------------------------------------------------------
// The warp's MMAs on one stage.
template <bool A_KMAJ, bool B_KMAJ, bool DUAL_N>
static __device__ __forceinline__ void mma_stage(const u16* sa, const u16* sb, float (&acc)[MI][NI][4],
                                                 u32 wm, u32 wn) {
    const u32 lane = afdep_lane();
    const u32 q = lane / 8, j = lane % 8;
#pragma unroll
    for (int kk = 0; kk < BK; kk += 16) {
        u32 af[MI][4];
        u32 bfr[NI][2];
#pragma unroll
        for (int mi = 0; mi < MI; mi++) {
            const u32 m0 = wm * WM + mi * 16;
            if (A_KMAJ) {
                const u32 r = m0 + (q % 2) * 8 + j, c = (kk + (q / 2) * 8) / 8;
                ldsm_x4(smem_u32(sa + kmaj_off(r, c)), af[mi][0], af[mi][1], af[mi][2], af[mi][3]);
            } else {
                const u32 r = kk + (q / 2) * 8 + j, c = (m0 + (q % 2) * 8) / 8;
                ldsm_x4_t(smem_u32(sa + mnmaj_off(r, c)), af[mi][0], af[mi][1], af[mi][2], af[mi][3]);
            }
        }
#pragma unroll
        for (int pr = 0; pr < NI / 2; pr++) {
            // 16 columns per ldmatrix.x4: two n8 tiles.
            const u32 n0 = DUAL_N ? (pr == 0 ? wn * (WN / 2) : BN / 2 + wn * (WN / 2))
                                  : wn * WN + pr * 16;
            if (B_KMAJ) {
                const u32 r = n0 + (q / 2) * 8 + j, c = (kk + (q % 2) * 8) / 8;
                ldsm_x4(smem_u32(sb + kmaj_off(r, c)), bfr[2 * pr][0], bfr[2 * pr][1],
                        bfr[2 * pr + 1][0], bfr[2 * pr + 1][1]);
            } else {
                const u32 r = kk + (q % 2) * 8 + j, c = (n0 + (q / 2) * 8) / 8;
                ldsm_x4_t(smem_u32(sb + mnmaj_off(r, c)), bfr[2 * pr][0], bfr[2 * pr][1],
                          bfr[2 * pr + 1][0], bfr[2 * pr + 1][1]);
            }
        }
#pragma unroll
        for (int mi = 0; mi < MI; mi++)
#pragma unroll
            for (int ni = 0; ni < NI; ni++) mma_bf16(acc[mi][ni], af[mi], bfr[ni]);
    }
}

// Output column (within the problem's N) of accumulator column block ni, lane quad t.
template <bool DUAL_N>
static __device__ __forceinline__ u32 out_col(u32 n0, u32 wn, int ni, u32 t) {
    if (DUAL_N) return n0 + wn * (WN / 2) + (ni % (NI / 2)) * 8 + 2 * t;
    return n0 + wn * WN + ni * 8 + 2 * t;
}

// ---------------------------------------------------------------------------------------------
// Epilogues of ROWS problems. v0, v1: the accumulator pair at (row, col), (row, col + 1);
// for SWIGLU / DSWIGLU the pair from the second half (b2's columns) is u0, u1.

template <int EPI>
static __device__ __forceinline__ void epi_rows(const GemmProblem& p, u64 row, u32 col, float v0,
                                                float v1, float u0, float u1, float& gpart) {
    if (EPI == AFDEP_EPI_STORE) {
        float w = 1.0f;
        if (p.weights) w = ((const float*)p.weights)[((const u32*)p.r_idx)[row]];
        u32* c = (u32*)((u16*)p.c + row * p.ldc + col);
        *c = pack_bf16(__fmul_rn(w, v0), __fmul_rn(w, v1));
    } else if (EPI == AFDEP_EPI_ACC_BF16) {
        const float2 a = *(const float2*)((const float*)p.aux + row * p.ldc + col);
        *(u32*)((u16*)p.c + row * p.ldc + col) = pack_bf16(__fadd_rn(a.x, v0), __fadd_rn(a.y, v1));
    } else if (EPI == AFDEP_EPI_ADD_F32) {
        float2* a = (float2*)((float*)p.aux + row * p.ldc + col);
        float2 o = *a;
        o.x = __fadd_rn(o.x, v0);
        o.y = __fadd_rn(o.y, v1);
        *a = o;
    } else if (EPI == AFDEP_EPI_SCATTER) {
        const u32 slot = ((const u32*)p.r_idx)[row];
        const float w = p.weights ? ((const float*)p.weights)[slot] : 1.0f;
        float* dst = (float*)p.aux + (u64)(slot / p.r_div) * p.ldc + col;
        atomicAdd(dst, __fmul_rn(w, v0));
        atomicAdd(dst + 1, __fmul_rn(w, v1));
    } else if (EPI == AFDEP_EPI_SWIGLU) {
        // v = a = x·W1, u = b = x·W3; h = silu(a) * b.
        const float h0 = __fmul_rn(__fmul_rn(v0, sigmoidf_(v0)), u0);
        const float h1 = __fmul_rn(__fmul_rn(v1, sigmoidf_(v1)), u1);
        const u64 o = row * p.ldc + col;
        *(u32*)((u16*)p.c + o) = pack_bf16(h0, h1);
        if (p.c2) *(u32*)((u16*)p.c2 + o) = pack_bf16(v0, v1);
        if (p.c3) *(u32*)((u16*)p.c3 + o) = pack_bf16(u0, u1);
    } else if (EPI == AFDEP_EPI_DSWIGLU) {
        // v = G = dy·W2^T (unweighted). With a, b stored by the forward: h = silu(a) b,
        // g += G·h (the router's <dy, y>), dh = w G, da = dh b silu'(a), db = dh silu(a).
        const u64 o = row * p.ldc + col;
        const float2 a = unpack_bf16(*(const u32*)((const u16*)p.c2 + o));
        const float2 b = unpack_bf16(*(const u32*)((const u16*)p.c3 + o));
        float w = 1.0f;
        if (p.weights) w = ((const float*)p.weights)[((const u32*)p.r_idx)[row]];
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

// ---------------------------------------------------------------------------------------------
// The ROWS kernel body.
template <bool B_KMAJ, bool DUAL_N, int EPI>
static __device__ __forceinline__ void gemm_rows(const GemmProblem& p) {
    extern __shared__ __align__(128) u16 smem[];
    __shared__ u32 tile_prefix[AFDEP_GEMM_MAX_GROUPS + 1];
    __shared__ u64 row_off[BM];
    __shared__ u64 row_glob[BM];

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

    const u32 warp = threadIdx.x / 32, lane = afdep_lane();
    const u32 wm = warp / WARPS_N, wn = warp % WARPS_N;
    const u32 gq = lane / 4, tq = lane % 4;
    const u32 ktiles = (p.k + BK - 1) / BK;

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

        __syncthreads();  // the previous tile is done with row_off
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

        float acc[MI][NI][4];
#pragma unroll
        for (int mi = 0; mi < MI; mi++)
#pragma unroll
            for (int ni = 0; ni < NI; ni++)
#pragma unroll
                for (int e = 0; e < 4; e++) acc[mi][ni][e] = 0.0f;

#pragma unroll
        for (int s = 0; s < STAGES - 1; s++) {
            if ((u32)s < ktiles) {
                u16* st = smem + s * STAGE_ELEMS;
                load_a_rows(p, row_off, st, s * BK);
                load_b_rows<B_KMAJ, DUAL_N>(p, g, st + TILE_ELEMS, n0, s * BK);
            }
            cp_async_commit();
        }
        for (u32 kt = 0; kt < ktiles; kt++) {
            cp_async_wait<STAGES - 2>();
            __syncthreads();
            const u32 nk = kt + STAGES - 1;
            if (nk < ktiles) {
                u16* st = smem + (nk % STAGES) * STAGE_ELEMS;
                load_a_rows(p, row_off, st, nk * BK);
                load_b_rows<B_KMAJ, DUAL_N>(p, g, st + TILE_ELEMS, n0, nk * BK);
            }
            cp_async_commit();
            const u16* st = smem + (kt % STAGES) * STAGE_ELEMS;
            mma_stage<true, B_KMAJ, DUAL_N>(st, st + TILE_ELEMS, acc, wm, wn);
        }
        cp_async_wait<0>();

        // Epilogue straight from the accumulators.
#pragma unroll
        for (int mi = 0; mi < MI; mi++) {
#pragma unroll
            for (int hr = 0; hr < 2; hr++) {
                const u32 r = wm * WM + mi * 16 + gq + hr * 8;
                const u64 row = row_glob[r];
                float gpart = 0.0f;
                if (row != ~0ull) {
#pragma unroll
                    for (int ni = 0; ni < (DUAL_N ? NI / 2 : NI); ni++) {
                        const u32 col = out_col<DUAL_N>(n0, wn, ni, tq);
                        if (col >= p.n) continue;
                        const float v0 = acc[mi][ni][2 * hr], v1 = acc[mi][ni][2 * hr + 1];
                        float u0 = 0.0f, u1 = 0.0f;
                        if (DUAL_N) {
                            u0 = acc[mi][ni + NI / 2][2 * hr];
                            u1 = acc[mi][ni + NI / 2][2 * hr + 1];
                        }
                        epi_rows<EPI>(p, row, col, v0, v1, u0, u1, gpart);
                    }
                }
                if (EPI == AFDEP_EPI_DSWIGLU && p.gsum) {
                    // The quad holds the row's columns of this warp: reduce, one atomic per row.
                    gpart = __fadd_rn(gpart, __shfl_xor_sync(0xffffffffu, gpart, 1));
                    gpart = __fadd_rn(gpart, __shfl_xor_sync(0xffffffffu, gpart, 2));
                    if (row != ~0ull && tq == 0)
                        atomicAdd((float*)p.gsum + ((const u32*)p.r_idx)[row], gpart);
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The KSUM kernel body: tiles (group, m tile, n tile, split); f32 partials.
static __device__ __forceinline__ void gemm_ksum(const GemmProblem& p) {
    extern __shared__ __align__(128) u16 smem[];
    const u32 mtiles = (p.m + BM - 1) / BM, ntiles = (p.n + BN - 1) / BN;
    const u32 total = p.groups * mtiles * ntiles * p.splits;
    const u32 warp = threadIdx.x / 32, lane = afdep_lane();
    const u32 wm = warp / WARPS_N, wn = warp % WARPS_N;
    const u32 gq = lane / 4, tq = lane % 4;

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

        float acc[MI][NI][4];
#pragma unroll
        for (int mi = 0; mi < MI; mi++)
#pragma unroll
            for (int ni = 0; ni < NI; ni++)
#pragma unroll
                for (int e = 0; e < 4; e++) acc[mi][ni][e] = 0.0f;

        __syncthreads();  // the previous tile's last stage reads are done
#pragma unroll
        for (int st = 0; st < STAGES - 1; st++) {
            if ((u32)st < ktiles) {
                u16* sp = smem + st * STAGE_ELEMS;
                load_ksum((const u16*)p.a, p.lda, p.a_idx, p.a_div, sp, kb + st * BK, ke, m0, p.m);
                load_ksum((const u16*)p.b, p.ldb, p.b_idx, p.b_div, sp + TILE_ELEMS, kb + st * BK,
                          ke, n0, p.n);
            }
            cp_async_commit();
        }
        for (u32 kt = 0; kt < ktiles; kt++) {
            cp_async_wait<STAGES - 2>();
            __syncthreads();
            const u32 nk = kt + STAGES - 1;
            if (nk < ktiles) {
                u16* sp = smem + (nk % STAGES) * STAGE_ELEMS;
                load_ksum((const u16*)p.a, p.lda, p.a_idx, p.a_div, sp, kb + (u64)nk * BK, ke, m0,
                          p.m);
                load_ksum((const u16*)p.b, p.ldb, p.b_idx, p.b_div, sp + TILE_ELEMS,
                          kb + (u64)nk * BK, ke, n0, p.n);
            }
            cp_async_commit();
            const u16* sp = smem + (kt % STAGES) * STAGE_ELEMS;
            mma_stage<false, false, false>(sp, sp + TILE_ELEMS, acc, wm, wn);
        }
        cp_async_wait<0>();

        float* ws = (float*)p.c + ((u64)g * p.splits + s) * (u64)p.m * p.n;
#pragma unroll
        for (int mi = 0; mi < MI; mi++)
#pragma unroll
            for (int hr = 0; hr < 2; hr++) {
                const u32 m = m0 + wm * WM + mi * 16 + gq + hr * 8;
                if (m >= p.m) continue;
#pragma unroll
                for (int ni = 0; ni < NI; ni++) {
                    const u32 n = n0 + wn * WN + ni * 8 + 2 * tq;
                    if (n >= p.n) continue;
                    *(float2*)(ws + (u64)m * p.n + n) =
                        make_float2(acc[mi][ni][2 * hr], acc[mi][ni][2 * hr + 1]);
                }
            }
    }
}

// ---------------------------------------------------------------------------------------------
// Entry points: one per (operand layout, epilogue) the layer uses.

#define ROWS_ENTRY(name, BKMAJ, DUAL, EPI)                                                   \
    extern "C" __global__ void __launch_bounds__(AFDEP_BLOCK, 1) name(GemmProblem p) {       \
        gemm_rows<BKMAJ, DUAL, EPI>(p);                                                      \
    }

// Forward up-projection: x·[W1 | W3] (B N-major), SwiGLU epilogue.
ROWS_ENTRY(afdep_gemm_up_swiglu, false, true, AFDEP_EPI_SWIGLU)
// Forward down-projection h·W2 (B N-major) into expert-sorted rows (optionally weighted).
ROWS_ENTRY(afdep_gemm_down_store, false, false, AFDEP_EPI_STORE)
// Forward down-projection scattered into token order with the router weight (atomic f32).
ROWS_ENTRY(afdep_gemm_down_scatter, false, false, AFDEP_EPI_SCATTER)
// Shared-expert down-projection added to the routed sum, cast to bf16 once.
ROWS_ENTRY(afdep_gemm_down_acc, false, false, AFDEP_EPI_ACC_BF16)
// Backward: G = dy·W2^T (B K-major) with the SwiGLU backward in the epilogue.
ROWS_ENTRY(afdep_gemm_dh_dswiglu, true, false, AFDEP_EPI_DSWIGLU)
// Backward data gradient [da | db]·[W1 | W3]^T (B K-major, split along K) into rows.
ROWS_ENTRY(afdep_gemm_dx_store, true, false, AFDEP_EPI_STORE)
// ... scattered into token order (atomic f32).
ROWS_ENTRY(afdep_gemm_dx_scatter, true, false, AFDEP_EPI_SCATTER)
// ... added in place to an f32 accumulator (the shared expert's dx).
ROWS_ENTRY(afdep_gemm_dx_add, true, false, AFDEP_EPI_ADD_F32)
// ... added to an f32 accumulator and cast to bf16 (the router's dx = dlogits·Wr^T).
ROWS_ENTRY(afdep_gemm_dx_acc, true, false, AFDEP_EPI_ACC_BF16)

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
