// fp8 e4m3 conversions on their own, with the device functions the fused exchange uses
// (common/fp8.cuh): the device side of the host encoder's GPU test (gpu_fp8), and a
// stand-alone row quantiser / dequantiser. Not specialised.

#include "common/fp8.cuh"
#include "common/ptx.cuh"
#include "common/types.cuh"

// out[i] = encode(v[i]) for i < n, two values per thread through the dispatch's instruction
// (v[i] in the low byte, v[i + 1] in the high byte of one cvt).
extern "C" __global__ void __launch_bounds__(AFDEP_BLOCK)
    afdep_fp8_encode(const float* __restrict__ v, u8* __restrict__ out, u64 n) {
    const u64 pairs = (n + 1) / 2;
    for (u64 p = (u64)blockIdx.x * AFDEP_BLOCK + threadIdx.x; p < pairs;
         p += (u64)gridDim.x * AFDEP_BLOCK) {
        const u64 i = 2 * p;
        const bool two = i + 1 < n;
        const u32 c = afdep_e4m3x2(v[i], two ? v[i + 1] : 0.0f);
        out[i] = (u8)(c & 0xffu);
        if (two) out[i + 1] = (u8)(c >> 8);
    }
}

// out[i] = decode(codes[i]) for i < n.
extern "C" __global__ void __launch_bounds__(AFDEP_BLOCK)
    afdep_fp8_decode(const u8* __restrict__ codes, float* __restrict__ out, u64 n) {
    for (u64 i = (u64)blockIdx.x * AFDEP_BLOCK + threadIdx.x; i < n;
         i += (u64)gridDim.x * AFDEP_BLOCK)
        out[i] = afdep_e4m3_to_f32(codes[i]);
}

// One warp per row r < rows of x (hidden bf16, a multiple of 128; 16-byte aligned buffers):
// the dispatch's warp quantiser into q (rows × hidden codes) and scales (rows × hidden / 128),
// then the epilogue's dequantiser of those codes into dequant (rows × hidden bf16).
extern "C" __global__ void __launch_bounds__(AFDEP_BLOCK)
    afdep_fp8_quantise_rows(const u16* __restrict__ x, u64 rows, u32 hidden, u8* __restrict__ q,
                            float* __restrict__ scales, u16* __restrict__ dequant) {
    const u32 lane = afdep_lane();
    const u64 warps = (u64)gridDim.x * AFDEP_WARPS;
    const u32 groups = hidden / AFDEP_FP8_GROUP;
    for (u64 r = (u64)blockIdx.x * AFDEP_WARPS + threadIdx.x / 32; r < rows; r += warps) {
        u8* qr = q + r * hidden;
        float* sr = scales + r * groups;
        afdep_fp8_quantise_row_warp(qr, sr, x + r * hidden, hidden, lane);
        __syncwarp();  // the codes and scales of other lanes, read below
#pragma unroll 1
        for (u32 v = lane; v < hidden / 16u; v += 32) {
            uint4 lo, hi;
            afdep_fp8_dequant16(*(const uint4*)(qr + 16ull * v), sr[v / 8u], &lo, &hi);
            uint4* d = (uint4*)(dequant + r * hidden + 16ull * v);
            d[0] = lo;
            d[1] = hi;
        }
    }
}
