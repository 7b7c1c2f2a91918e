// Count-first dispatch, the row stores of a source (layout/fused.cuh, count-first area), after
// afdep_cf_counts computed slot_pos / tok_row on the device.
//
// Mode AFDEP_CF_SOURCE (the source arm): waits (bounded) for every FFN rank's offset flag, then
// stores each row straight to its final expanded row(s) in the FFN rank's expanded area (one
// per (token, local expert): block start + slot position), and the compact view's metadata
// (the payload-first format, expanded_row[k] the final row) into its slab row there; then the
// grid's last block raises the dispatch flags (sig_off).
// Mode AFDEP_CF_STREAM (the streaming variant): with `gate` set, the same wait first; then each
// row (payload and metadata, expanded_row[k] the slot's block position) goes into this source's
// slab, and its row flag is raised to the round (release, system scope) as soon as the row is
// stored, for the streaming epilogue. Specialised by AFDEP_TOP_K.
//
// Mode AFDEP_CF_AUTO (an Auto device round's one launch for every arm; ctl must be the control
// block itself, not an arm gate): the mode follows the arm the round takes (ctl[AFDEP_CTL_ARM],
// set by afdep_round_begin): the source arm as AFDEP_CF_SOURCE, count-first as AFDEP_CF_STREAM
// with `gate` and no dispatch flags, payload-first as AFDEP_CF_STREAM without the wait and with
// the dispatch flags at sig_off.
//
// The payload kind is a template constant: afdep_cf_dispatch stores bf16 rows,
// afdep_cf_dispatch_fp8 quantises each row once while it stores it (common/fp8.cuh, bit for
// bit afdep_core::fp8): streaming, codes and scales into the slab row
// (the fp8 slab row format of layout/fused.cuh); source arm, the codes to every final expanded
// row's codes (exp_q_off, hidden u8 per row) and the scales to its scales (exp_sc_off,
// hidden / 128 f32 per row), which the FFN rank dequantises after the dispatch flags
// (afdep_cf_dequant).

#include "common/fp8.cuh"
#include "common/probe.cuh"
#include "common/ptx.cuh"
#include "common/types.cuh"
#include "layout/fused.cuh"

#ifndef AFDEP_TOP_K
#error "fused_cf_dispatch.cu needs AFDEP_TOP_K"
#endif
#define K AFDEP_TOP_K

#include "phase/cf_dispatch.cuh"

// The entries take the workspace layout by value (afdep_fused_layout, layout/fused.cuh); the
// rows function reads its fields, which stay in the parameter space (no copy). At most one block
// per SM is asked for (`__launch_bounds__(AFDEP_BLOCK, 1)`): the grid is the transport's SM
// budget, and without the bound ptxas held some variants to 32 registers and spilled.
#define AFDEP_CF_DISPATCH_PARAMS                                                                  \
    const u16 *__restrict__ x, const i32 *__restrict__ idx, const float *__restrict__ w,         \
        const u32 *ctl, const u32 *__restrict__ slot_pos, const u32 *__restrict__ tok_row,       \
        const u32 *__restrict__ ffn_rank, u32 nf, u32 epr, const u64 *__restrict__ peers,        \
        const u8 *ws, const afdep_fused_layout L, u32 me, u32 mode, u32 gate, u64 timeout_ns,    \
        u32 *err, u64 sig_off
// bf16 rows (exp_q_off and exp_sc_off unused).
extern "C" __global__ void __launch_bounds__(AFDEP_BLOCK, 1)
    afdep_cf_dispatch(AFDEP_CF_DISPATCH_PARAMS) {
    AFDEP_GRID_DEPENDENCY_SYNC();
    afdep_cf_dispatch_rows<AFDEP_PAYLOAD_BF16>(AFDEP_CF_DISPATCH_ARGS);
}

// fp8 rows: hidden a multiple of 128, x and the destinations 16-byte aligned.
extern "C" __global__ void __launch_bounds__(AFDEP_BLOCK, 1)
    afdep_cf_dispatch_fp8(AFDEP_CF_DISPATCH_PARAMS) {
    AFDEP_GRID_DEPENDENCY_SYNC();
    afdep_cf_dispatch_rows<AFDEP_PAYLOAD_FP8>(AFDEP_CF_DISPATCH_ARGS);
}
