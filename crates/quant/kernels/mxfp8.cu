// MXFP8 quantization (spec/formats.md 4): 1x32 rowwise and 32x1 columnwise blocks, or
// 32x32 tiles, both orientations from one read of the input, compact or GEMM-swizzled
// E8M0 scales. Checked byte for byte against crates/quant/src/mxfp8.rs.
#include "common.cuh"

// Rowwise-only 1-D: one CTA per 32-row x 128-column tile (grid: m/32 x ceil(k/128), 256
// threads); thread t owns row t/8 and the 16 columns (t%8)*16 .. +16, loaded as two
// 16-byte vectors; the partner lane (xor 1) holds the other half of its 32-element block.
// Few registers, no shared memory, no barrier.
template <class T, bool E4M3>
__device__ void mxfp8_row_impl(const T* __restrict__ x, u64 m, u64 k, float max_rcp,
                               uint8_t* __restrict__ q_row, uint8_t* __restrict__ s_row,
                               u64 s_row_cols, int swizzled) {
    const int t = threadIdx.x;
    const int c0 = (t % 8) * 16;
    const u64 row = (u64)blockIdx.x * 32 + t / 8, k0 = (u64)blockIdx.y * 128;
    const bool valid = k0 + c0 < k;  // k % 32 == 0: a thread's 16 columns are all in or out
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
    a = fmaxf(a, __shfl_xor_sync(0xFFFFFFFFu, a, 1));
    if (!valid) return;
    const uint8_t e = float_to_e8m0(__fmul_rn(a, max_rcp));
    reinterpret_cast<uint4*>(q_row + row * k + k0 + c0)[0] = fp8x16<E4M3>(v, e8m0_reciprocal(e));
    if ((t % 2) == 0) {
        const u64 j = (k0 + c0) / 32;
        s_row[swizzled ? swizzled_index(row, j, s_row_cols) : row * s_row_cols + j] = e;
    }
}

// With a columnwise operand, or 32x32 tiles: each warp quantizes a 32-row x 64-column
// tile on its own (no shared memory, no barrier): lane l owns the 8 consecutive columns
// 8*(l%8) .. +7 of the 8 rows 8*(l/8) .. +7, loaded as 16-byte vectors (one instruction
// covers 4 rows x 128 bytes). A 1x32 rowwise block spans 4 lanes (xor 1, 2), a 32x1
// columnwise block the 4 lanes of a column group (xor 8, 16). A CTA of 8 warps covers 64
// rows x 256 columns (grid: m/64 x k/256, rounded up). Column scales are found first, so
// only their 8 multipliers stay live beside the data while each row is reduced and
// quantized. Requires m and k multiples of 32. Outputs may be null (usage). Scale
// buffers hold zeros in their padding beforehand; only valid entries are written here.
template <class T, bool E4M3, bool two_d>
__device__ void mxfp8_impl(const T* __restrict__ x, u64 m, u64 k, float max_rcp,
                           uint8_t* __restrict__ q_row, uint8_t* __restrict__ s_row, u64 s_row_cols,
                           uint8_t* __restrict__ q_col, uint8_t* __restrict__ s_col, u64 s_col_rows,
                           u64 s_col_cols, int swizzled) {
    constexpr int W = 8 * (int)sizeof(T) / 16;  // 16-byte vectors per run of 8 elements
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int cg = lane & 7, g = lane >> 3;
    const u64 r0 = (u64)blockIdx.x * 64 + 32 * (warp / 4);               // the warp's first row
    const u64 col = (u64)blockIdx.y * 256 + 64 * (warp % 4) + 8 * cg;   // the lane's first column
    if (r0 >= m) return;  // uniform over the warp (m % 32 == 0)
    // k % 32 == 0: a lane's 8 columns, and the 4 lanes of its 32-column block, are all
    // inside or all outside.
    const bool valid = col < k;
    union {
        uint4 u[8][W];
        T e[8][8];
    } d;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const u64 r = r0 + 8 * g + i;
#pragma unroll
        for (int w = 0; w < W; ++w)
            d.u[i][w] = valid ? reinterpret_cast<const uint4*>(x + r * k + col)[w] : make_uint4(0u, 0u, 0u, 0u);
    }
    const u64 jb = col / 32, ib = r0 / 32;
    if (two_d) {
        // One scale for the 32x32 tile: the max over the lane's 64 values, then over the 4
        // lanes of its row blocks and the 4 of its column group. Both operands get the
        // same bytes.
        float a = 0.0f;
#pragma unroll
        for (int i = 0; i < 8; ++i)
#pragma unroll
            for (int j = 0; j < 8; ++j) a = fmaxf(a, fabsf(In<T>::f32(d.e[i][j])));
        a = fmaxf(a, __shfl_xor_sync(0xFFFFFFFFu, a, 1));
        a = fmaxf(a, __shfl_xor_sync(0xFFFFFFFFu, a, 2));
        a = fmaxf(a, __shfl_xor_sync(0xFFFFFFFFu, a, 8));
        a = fmaxf(a, __shfl_xor_sync(0xFFFFFFFFu, a, 16));
        if (!valid) return;
        const uint8_t e = float_to_e8m0(__fmul_rn(a, max_rcp));
        const float s = e8m0_reciprocal(e);
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const u64 r = r0 + 8 * g + i;
            uint32_t w[2];
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const uint32_t lo = fp8x2<E4M3>(__fmul_rn(In<T>::f32(d.e[i][4 * h]), s),
                                                __fmul_rn(In<T>::f32(d.e[i][4 * h + 1]), s));
                const uint32_t hi = fp8x2<E4M3>(__fmul_rn(In<T>::f32(d.e[i][4 * h + 2]), s),
                                                __fmul_rn(In<T>::f32(d.e[i][4 * h + 3]), s));
                w[h] = lo | (hi << 16);
            }
            if (q_row != nullptr) *reinterpret_cast<uint2*>(q_row + r * k + col) = make_uint2(w[0], w[1]);
            if (q_col != nullptr) *reinterpret_cast<uint2*>(q_col + r * k + col) = make_uint2(w[0], w[1]);
            // The 4 lanes of a block hold the same scale: lane cg%4 == i%4 writes row i.
            if (q_row != nullptr && (i & 3) == (cg & 3))
                s_row[swizzled ? swizzled_index(r, jb, s_row_cols) : r * s_row_cols + jb] = e;
        }
        if (q_col != nullptr) {
            // Lane g of a column group writes columns 2g, 2g+1.
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                if ((j >> 1) == g) {
                    const u64 c = col + j;
                    s_col[swizzled ? swizzled_index(c, ib, s_col_rows) : ib * s_col_cols + c] = e;
                }
            }
        }
        return;
    }
    // 1-D: the column scales of the 32x1 blocks first.
    float sc[8];
    uint8_t ec[8];
    if (q_col != nullptr) {
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            float a = 0.0f;
#pragma unroll
            for (int i = 0; i < 8; ++i) a = fmaxf(a, fabsf(In<T>::f32(d.e[i][j])));
            a = fmaxf(a, __shfl_xor_sync(0xFFFFFFFFu, a, 8));
            a = fmaxf(a, __shfl_xor_sync(0xFFFFFFFFu, a, 16));
            ec[j] = float_to_e8m0(__fmul_rn(a, max_rcp));
            sc[j] = e8m0_reciprocal(ec[j]);
        }
        if (valid) {
            // Lane g of a column group writes columns 2g, 2g+1 (columnwise scales swizzle
            // as the transpose of their grid).
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                if ((j >> 1) == g) {
                    const u64 c = col + j;
                    s_col[swizzled ? swizzled_index(c, ib, s_col_rows) : ib * s_col_cols + c] = ec[j];
                }
            }
        }
    }
    // Then row by row: the 1x32 block amax, rowwise and columnwise bytes.
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const u64 r = r0 + 8 * g + i;
        if (q_row != nullptr) {
            float a = 0.0f;
#pragma unroll
            for (int j = 0; j < 8; ++j) a = fmaxf(a, fabsf(In<T>::f32(d.e[i][j])));
            a = fmaxf(a, __shfl_xor_sync(0xFFFFFFFFu, a, 1));
            a = fmaxf(a, __shfl_xor_sync(0xFFFFFFFFu, a, 2));
            const uint8_t e = float_to_e8m0(__fmul_rn(a, max_rcp));
            const float s = e8m0_reciprocal(e);
            uint32_t w[2];
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const uint32_t lo = fp8x2<E4M3>(__fmul_rn(In<T>::f32(d.e[i][4 * h]), s),
                                                __fmul_rn(In<T>::f32(d.e[i][4 * h + 1]), s));
                const uint32_t hi = fp8x2<E4M3>(__fmul_rn(In<T>::f32(d.e[i][4 * h + 2]), s),
                                                __fmul_rn(In<T>::f32(d.e[i][4 * h + 3]), s));
                w[h] = lo | (hi << 16);
            }
            if (valid) {
                *reinterpret_cast<uint2*>(q_row + r * k + col) = make_uint2(w[0], w[1]);
                // The 4 lanes of a block hold the same scale: lane cg%4 == i%4 writes row i.
                if ((i & 3) == (cg & 3))
                    s_row[swizzled ? swizzled_index(r, jb, s_row_cols) : r * s_row_cols + jb] = e;
            }
        }
        if (q_col != nullptr && valid) {
            uint32_t w[2];
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int j = 4 * h;
                const uint32_t lo = fp8x2<E4M3>(__fmul_rn(In<T>::f32(d.e[i][j]), sc[j]),
                                                __fmul_rn(In<T>::f32(d.e[i][j + 1]), sc[j + 1]));
                const uint32_t hi = fp8x2<E4M3>(__fmul_rn(In<T>::f32(d.e[i][j + 2]), sc[j + 2]),
                                                __fmul_rn(In<T>::f32(d.e[i][j + 3]), sc[j + 3]));
                w[h] = lo | (hi << 16);
            }
            *reinterpret_cast<uint2*>(q_col + r * k + col) = make_uint2(w[0], w[1]);
        }
    }
}

// Three entry points with their own register budgets: rowwise-only 1-D (`_row_`), 1-D
// with a columnwise operand, and 32x32 tiles (`_2d_`); one parameter list (`two_d` is
// implied by the name).
#define MXFP8(SUFFIX, T, FMT, E4M3)                                                            \
    extern "C" __global__ void __launch_bounds__(256) tessera_mxfp8_row_##SUFFIX##_##FMT(      \
        const T* __restrict__ x, u64 m, u64 k, float max_rcp, uint8_t* q_row, uint8_t* s_row,  \
        u64 s_row_cols, uint8_t* q_col, uint8_t* s_col, u64 s_col_rows, u64 s_col_cols,        \
        int two_d, int swizzled) {                                                             \
        mxfp8_row_impl<T, E4M3>(x, m, k, max_rcp, q_row, s_row, s_row_cols, swizzled);         \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(256, TQ_MINB_MXFP8) tessera_mxfp8_##SUFFIX##_##FMT( \
        const T* __restrict__ x, u64 m, u64 k, float max_rcp, uint8_t* q_row, uint8_t* s_row,  \
        u64 s_row_cols, uint8_t* q_col, uint8_t* s_col, u64 s_col_rows, u64 s_col_cols,        \
        int two_d, int swizzled) {                                                             \
        mxfp8_impl<T, E4M3, false>(x, m, k, max_rcp, q_row, s_row, s_row_cols, q_col, s_col,   \
                                   s_col_rows, s_col_cols, swizzled);                          \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(256, TQ_MINB_MXFP8) tessera_mxfp8_2d_##SUFFIX##_##FMT( \
        const T* __restrict__ x, u64 m, u64 k, float max_rcp, uint8_t* q_row, uint8_t* s_row,  \
        u64 s_row_cols, uint8_t* q_col, uint8_t* s_col, u64 s_col_rows, u64 s_col_cols,        \
        int two_d, int swizzled) {                                                             \
        mxfp8_impl<T, E4M3, true>(x, m, k, max_rcp, q_row, s_row, s_row_cols, q_col, s_col,    \
                                  s_col_rows, s_col_cols, swizzled);                           \
    }
MXFP8(f32, float, e4m3, true)
MXFP8(f32, float, e5m2, false)
MXFP8(bf16, __nv_bfloat16, e4m3, true)
MXFP8(bf16, __nv_bfloat16, e5m2, false)
MXFP8(f16, __half, e4m3, true)
MXFP8(f16, __half, e5m2, false)

// Dequantization of rowwise (col = 0) or columnwise (col = 1) MXFP8 data [m, k] with a
// compact or swizzled scale buffer. Thread per run of 16 elements of a row (k % 32 == 0,
// so a run stays inside one 1x32 block): one 16-byte load, 16-byte stores; one scale
// rowwise, the 16 columns' scales columnwise.
template <class T, bool E4M3>
__device__ void mxfp8_dequant_impl(const uint8_t* __restrict__ q, const uint8_t* __restrict__ s,
                                   T* __restrict__ y, u64 m, u64 k, u64 s_rows, u64 s_cols,
                                   int col, int swizzled) {
    const u64 runs = m * k / 16;
    const u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 g = (u64)blockIdx.x * blockDim.x + threadIdx.x; g < runs; g += stride) {
        const u64 r = 16 * g / k, c = 16 * g % k;
        float v[16];
        fp8x16_to_f32<E4M3>(reinterpret_cast<const uint4*>(q)[g], v);
        if (col) {
#pragma unroll
            for (int j = 0; j < 16; ++j) {
                const u64 cj = c + j;
                const u64 si = swizzled ? swizzled_index(cj, r / 32, s_rows) : (r / 32) * s_cols + cj;
                v[j] = v[j] * e8m0_value(s[si]);
            }
        } else {
            const float sc = e8m0_value(s[swizzled ? swizzled_index(r, c / 32, s_cols) : r * s_cols + c / 32]);
#pragma unroll
            for (int j = 0; j < 16; ++j) v[j] = v[j] * sc;
        }
        store16<T>(y + 16 * g, v);
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
