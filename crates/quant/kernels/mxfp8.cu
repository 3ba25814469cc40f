// MXFP8 quantization (spec/formats.md 4): 1x32 rowwise and 32x1 columnwise blocks, or
// 32x32 tiles, both orientations from one read of the input, compact or GEMM-swizzled
// E8M0 scales. Checked byte for byte against crates/quant/src/mxfp8.rs.
#include "common.cuh"

// One CTA quantizes a 32-row x 128-column tile (grid: m/32 x ceil(k/128), 256 threads).
// Thread t owns row t/8 and the 16 columns (t%8)*16 .. +16 of the tile. Requires m and k
// multiples of 32. Outputs may be null (usage). Scale buffers hold zeros in their padding
// beforehand; only valid entries are written here.
template <class T, bool E4M3>
__device__ void mxfp8_impl(const T* __restrict__ x, u64 m, u64 k, float max_rcp,
                           uint8_t* __restrict__ q_row, uint8_t* __restrict__ s_row, u64 s_row_cols,
                           uint8_t* __restrict__ q_col, uint8_t* __restrict__ s_col, u64 s_col_rows,
                           u64 s_col_cols, int two_d, int swizzled) {
    __shared__ float colabs[32][128 + 1];
    __shared__ float colmax[2][128];
    __shared__ uint8_t col_e[128];
    const int t = threadIdx.x;
    const int r = t / 8, c0 = (t % 8) * 16;
    const u64 m0 = (u64)blockIdx.x * 32, k0 = (u64)blockIdx.y * 128;
    const bool valid = k0 + c0 < k;  // k % 32 == 0, so a thread's 16 columns are all in or out
    const u64 row = m0 + r;
    float v[16];
    if (valid) {
        load16<T>(x + row * k + k0 + c0, v);
    } else {
#pragma unroll
        for (int j = 0; j < 16; ++j) v[j] = 0.0f;
    }
    float a = 0.0f;
#pragma unroll
    for (int j = 0; j < 16; ++j) a = fmaxf(a, fabsf(v[j]));
    const bool need_cols = q_col != nullptr || two_d;
    if (need_cols) {
#pragma unroll
        for (int j = 0; j < 16; ++j) colabs[r][c0 + j] = fabsf(v[j]);
        __syncthreads();
        if (t < 256) {
            const int c = t % 128, half = t / 128;
            float cm = 0.0f;
            for (int rr = half * 16; rr < half * 16 + 16; ++rr) cm = fmaxf(cm, colabs[rr][c]);
            colmax[half][c] = cm;
        }
        __syncthreads();
        if (t < 128) {
            float cm = fmaxf(colmax[0][t], colmax[1][t]);
            if (two_d) {
                // The 32x32 tile amax: the max over the 32 columns of this column's group.
                for (int cc = (t / 32) * 32; cc < (t / 32) * 32 + 32; ++cc)
                    cm = fmaxf(cm, fmaxf(colmax[0][cc], colmax[1][cc]));
            }
            col_e[t] = float_to_e8m0(__fmul_rn(cm, max_rcp));
        }
        __syncthreads();
    }
    // Rowwise: the partner lane holds the other half of this thread's 32-element block.
    const float block_amax = fmaxf(a, __shfl_xor_sync(0xFFFFFFFFu, a, 1));
    if (!valid) return;
    if (q_row != nullptr) {
        const uint8_t e = two_d ? col_e[c0] : float_to_e8m0(__fmul_rn(block_amax, max_rcp));
        reinterpret_cast<uint4*>(q_row + row * k + k0 + c0)[0] = fp8x16<E4M3>(v, e8m0_reciprocal(e));
        if ((t % 2) == 0) {
            const u64 j = (k0 + c0) / 32;
            s_row[swizzled ? swizzled_index(row, j, s_row_cols) : row * s_row_cols + j] = e;
        }
    }
    if (q_col != nullptr) {
        union { uint4 u; uint16_t h[8]; } o;
#pragma unroll
        for (int j = 0; j < 8; ++j)
            o.h[j] = fp8x2<E4M3>(__fmul_rn(v[2 * j], e8m0_reciprocal(col_e[c0 + 2 * j])),
                                 __fmul_rn(v[2 * j + 1], e8m0_reciprocal(col_e[c0 + 2 * j + 1])));
        reinterpret_cast<uint4*>(q_col + row * k + k0 + c0)[0] = o.u;
        if (r == 0) {
            const u64 i = m0 / 32;
#pragma unroll
            for (int j = 0; j < 16; ++j) {
                const u64 c = k0 + c0 + j;
                // Columnwise scales swizzle as the transpose of their grid.
                s_col[swizzled ? swizzled_index(c, i, s_col_rows) : i * s_col_cols + c] = col_e[c0 + j];
            }
        }
    }
}

#define MXFP8(SUFFIX, T, FMT, E4M3)                                                            \
    extern "C" __global__ void __launch_bounds__(256) tessera_mxfp8_##SUFFIX##_##FMT(          \
        const T* __restrict__ x, u64 m, u64 k, float max_rcp, uint8_t* q_row, uint8_t* s_row,  \
        u64 s_row_cols, uint8_t* q_col, uint8_t* s_col, u64 s_col_rows, u64 s_col_cols,        \
        int two_d, int swizzled) {                                                             \
        mxfp8_impl<T, E4M3>(x, m, k, max_rcp, q_row, s_row, s_row_cols, q_col, s_col,          \
                            s_col_rows, s_col_cols, two_d, swizzled);                          \
    }
MXFP8(f32, float, e4m3, true)
MXFP8(f32, float, e5m2, false)
MXFP8(bf16, __nv_bfloat16, e4m3, true)
MXFP8(bf16, __nv_bfloat16, e5m2, false)
MXFP8(f16, __half, e4m3, true)
MXFP8(f16, __half, e5m2, false)

// Dequantization of rowwise (col = 0) or columnwise (col = 1) MXFP8 data [m, k] with a
// compact or swizzled scale buffer; one thread per element.
template <class T, bool E4M3>
__device__ void mxfp8_dequant_impl(const uint8_t* __restrict__ q, const uint8_t* __restrict__ s,
                                   T* __restrict__ y, u64 m, u64 k, u64 s_rows, u64 s_cols,
                                   int col, int swizzled) {
    const u64 n = m * k;
    const u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 e = (u64)blockIdx.x * blockDim.x + threadIdx.x; e < n; e += stride) {
        const u64 r = e / k, c = e % k;
        u64 si;
        if (col) {
            si = swizzled ? swizzled_index(c, r / 32, s_rows) : (r / 32) * s_cols + c;
        } else {
            si = swizzled ? swizzled_index(r, c / 32, s_cols) : r * s_cols + c / 32;
        }
        y[e] = In<T>::from(fp8_to_f32<E4M3>(q[e]) * e8m0_value(s[si]));
    }
}

#define MXFP8_DEQUANT(SUFFIX, T, FMT, E4M3)                                                    \
    extern "C" __global__ void __launch_bounds__(256) tessera_mxfp8_dequant_##SUFFIX##_##FMT(  \
        const uint8_t* q, const uint8_t* s, T* y, u64 m, u64 k, u64 s_rows, u64 s_cols,        \
        int col, int swizzled) {                                                               \
        mxfp8_dequant_impl<T, E4M3>(q, s, y, m, k, s_rows, s_cols, col, swizzled);              \
    }
MXFP8_DEQUANT(f32, float, e4m3, true)
MXFP8_DEQUANT(f32, float, e5m2, false)
MXFP8_DEQUANT(bf16, __nv_bfloat16, e4m3, true)
MXFP8_DEQUANT(bf16, __nv_bfloat16, e5m2, false)
MXFP8_DEQUANT(f16, __half, e4m3, true)
MXFP8_DEQUANT(f16, __half, e5m2, false)
