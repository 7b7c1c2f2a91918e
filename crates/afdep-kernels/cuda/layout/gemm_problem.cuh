// The grouped-GEMM problem descriptor, passed by value to every GEMM kernel. Mirrored field
// for field by afdep_kernels::ops::gemm::GemmProblem (#[repr(C)]); the sizes are checked on
// both sides. Pointers are device addresses (0 = absent).
#pragma once

#include "common/types.cuh"

// Epilogues (afdep_kernels::ops::gemm::Epilogue).
#define AFDEP_EPI_STORE 0u
#define AFDEP_EPI_ACC_BF16 1u
#define AFDEP_EPI_ADD_F32 2u
#define AFDEP_EPI_SCATTER 3u
#define AFDEP_EPI_SWIGLU 4u
#define AFDEP_EPI_DSWIGLU 5u

// GemmProblem::tma: which ROWS operands load by TMA (tensor maps passed beside the problem).
#define AFDEP_GEMM_TMA_A 1u
#define AFDEP_GEMM_TMA_B 2u

// Most groups (experts) one launch may have.
#define AFDEP_GEMM_MAX_GROUPS 1024u

struct GemmProblem {
    u64 a;        // A operand (bf16)
    u64 b;        // B operand (bf16), per group b + g * b_gs (ROWS)
    u64 b2;       // second B: W3 beside W1 (dual N) or the second K half (dual K)
    u64 offsets;  // u64[groups + 1]: group row ranges (0: one group of m rows / k rows)
    u64 a_idx;    // u32 gather index of A rows (row -> a_idx[row] / a_div), or 0
    u64 b_idx;    // KSUM: u32 gather index of B rows, or 0
    u64 c;        // output
    u64 c2;       // second output / input (epilogue-specific)
    u64 c3;       // third output / input
    u64 c4;       // fourth output
    u64 aux;      // f32 accumulator (ACC_BF16, ADD_F32, SCATTER)
    u64 r_idx;    // u32 row -> slot (weights, scatter, gsum)
    u64 weights;  // f32 per slot (router weights), or 0
    u64 gsum;     // f32 per slot: the router's <dy, y> (DSWIGLU), or 0
    u64 lda;      // element stride between A rows
    u64 ldb;      // element stride between B rows
    u64 b_gs;     // element stride between groups of B
    u64 ldc;      // element stride between output rows
    u64 ld2;      // SWIGLU, DSWIGLU: element stride between the [a | b] rows of c2
    u64 fault;    // u32[4] fault word (bounded waits that ran out), or 0
    u64 sched;    // u32[2] tile counters {next tile, blocks done} of the dynamic schedule (ws
                  // ROWS kernels), zero between launches; 0: the static schedule
    u32 m, n, k;  // ROWS: m = rows without offsets; KSUM: per-group M x N, k = rows without offsets
    u32 groups;
    u32 a_div, b_div;  // divisors of the gather indices (slot -> token: top-k)
    u32 b_split;       // dual K: k >= b_split reads b2 at k - b_split
    u32 splits;        // KSUM: chunks per group
    u32 r_div;         // slot -> token divisor of the scatter
    u32 tma;           // AFDEP_GEMM_TMA_A | AFDEP_GEMM_TMA_B: operands loaded by TMA
    u32 wait_ms;       // bound of one TMA stage wait, milliseconds
    u32 inject_tx;     // fault injection (tests only, else 0): bytes added to every stage's
                       // expected TMA transactions, so that its wait runs out
};

static_assert(sizeof(GemmProblem) == 216, "GemmProblem layout");
