// FP8 block scaling (spec/formats.md 6): float32 scales per 1x128 block (rowwise),
// 128x1 block (columnwise, quantized independently, stored transposed) or 128x128 tile,
// both orientations from one read of the input, any M and K (partial edge blocks).
// Checked byte for byte against crates/quant/src/block.rs.
#include "common.cuh"

// One CTA per 128x128 tile (grid: ceil(m/128) x ceil(k/128), 256 threads = 8 warps).
// Warp w owns rows 16w .. 16w+15 of the tile; lane l owns columns 4l .. 4l+3. Each
// thread keeps its 64 values in registers.
template <class T, bool E4M3>
__device__ void block_impl(const T* __restrict__ x, u64 m, u64 k, float fp8_max, int pow2,
                           float eps, float value_for_inf, int two_d, uint8_t* __restrict__ q_row,
                           float* __restrict__ s_row, u64 s_row_cols, uint8_t* __restrict__ q_col,
                           float* __restrict__ s_col, u64 s_col_cols) {
    __shared__ float colpart[8][128];
    __shared__ float colscale[128];
    __shared__ float tilescale;
    __shared__ float tileamax[4];
    // Row pitch 129 bytes: lane l writes row 4l + j, and a pitch of an odd number of
    // 4-byte words (4 * 129 bytes apart) puts the 32 lanes in 32 different banks; a
    // multiple of 16 (the first version) put them all in 2 banks.
    __shared__ uint8_t tr[128][129];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const u64 m0 = (u64)blockIdx.x * 128, k0 = (u64)blockIdx.y * 128;
    const int c0 = lane * 4;
    float v[16][4];
    float rowamax[16];
    float cpart[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int i = 0; i < 16; ++i) {
        const u64 r = m0 + warp * 16 + i;
        float a = 0.0f;
        if (r < m && k0 + c0 + 4 <= k && (k % 4) == 0) {
            load4<T>(x + r * k + k0 + c0, v[i]);
        } else {
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const u64 c = k0 + c0 + j;
                v[i][j] = (r < m && c < k) ? In<T>::f32(x[r * k + c]) : 0.0f;
            }
        }
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            a = fmaxf(a, fabsf(v[i][j]));
            cpart[j] = fmaxf(cpart[j], fabsf(v[i][j]));
        }
        rowamax[i] = warp_max(a);
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) colpart[warp][c0 + j] = cpart[j];
    __syncthreads();
    if (threadIdx.x < 128) {
        float a = 0.0f;
#pragma unroll
        for (int w = 0; w < 8; ++w) a = fmaxf(a, colpart[w][threadIdx.x]);
        colscale[threadIdx.x] = scale_from_amax(a, fp8_max, pow2, eps, value_for_inf);
        if (two_d) {
            // Tile amax: reduce the 128 column amaxes (warps 0-3) through shared memory.
            a = warp_max(a);
            if (lane == 0) tileamax[warp] = a;
        }
    }
    __syncthreads();
    if (two_d && threadIdx.x == 0) {
        const float a = fmaxf(fmaxf(tileamax[0], tileamax[1]), fmaxf(tileamax[2], tileamax[3]));
        tilescale = scale_from_amax(a, fp8_max, pow2, eps, value_for_inf);
    }
    __syncthreads();
    const u64 mb = blockIdx.x, kb = blockIdx.y;
    if (two_d && threadIdx.x == 0) {
        const float si = __frcp_rn(tilescale);
        if (s_row != nullptr) s_row[mb * s_row_cols + kb] = si;
        if (s_col != nullptr) s_col[kb * s_col_cols + mb] = si;
    }
    // Rowwise bytes (and, in 2-D mode, the transposed tile from the same bytes).
#pragma unroll
    for (int i = 0; i < 16; ++i) {
        const int rt = warp * 16 + i;
        const u64 r = m0 + rt;
        const float scale = two_d ? tilescale : scale_from_amax(rowamax[i], fp8_max, pow2, eps, value_for_inf);
        uint8_t b[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) b[j] = fp8<E4M3>(__fmul_rn(v[i][j], scale));
        if (q_row != nullptr && r < m) {
            if (k0 + c0 + 4 <= k && (k % 4) == 0) {
                *reinterpret_cast<uint32_t*>(q_row + r * k + k0 + c0) =
                    b[0] | (b[1] << 8) | (b[2] << 16) | ((uint32_t)b[3] << 24);
            } else {
#pragma unroll
                for (int j = 0; j < 4; ++j)
                    if (k0 + c0 + j < k) q_row[r * k + k0 + c0 + j] = b[j];
            }
            if (!two_d && lane == 0) s_row[kb * s_row_cols + r] = __frcp_rn(scale);
        }
        if (two_d) {
#pragma unroll
            for (int j = 0; j < 4; ++j) tr[c0 + j][rt] = b[j];
        }
    }
    if (q_col == nullptr) return;
    if (!two_d) {
        // Columnwise 1-D: each column's own scale over the tile's 128 rows.
#pragma unroll
        for (int i = 0; i < 16; ++i) {
            const int rt = warp * 16 + i;
#pragma unroll
            for (int j = 0; j < 4; ++j) tr[c0 + j][rt] = fp8<E4M3>(__fmul_rn(v[i][j], colscale[c0 + j]));
        }
        if (threadIdx.x < 128 && k0 + threadIdx.x < k)
            s_col[mb * s_col_cols + k0 + threadIdx.x] = __frcp_rn(colscale[threadIdx.x]);
    }
    __syncthreads();
    // Write the transposed tile: qt is [k, m]; row c of the tile covers m0 .. m0+127.
    // 16 consecutive bytes of a row per thread when m allows 16-byte stores.
    if ((m % 16) == 0) {
        for (int idx = threadIdx.x; idx < 128 * 8; idx += blockDim.x) {
            const int c = idx / 8, rt = (idx % 8) * 16;
            const u64 gk = k0 + c, gm = m0 + rt;
            if (gk >= k || gm >= m) continue;
            uint4 w;
            uint32_t* wp = reinterpret_cast<uint32_t*>(&w);
#pragma unroll
            for (int q4 = 0; q4 < 4; ++q4)
                wp[q4] = tr[c][rt + 4 * q4] | (tr[c][rt + 4 * q4 + 1] << 8) |
                         (tr[c][rt + 4 * q4 + 2] << 16) | ((uint32_t)tr[c][rt + 4 * q4 + 3] << 24);
            *reinterpret_cast<uint4*>(q_col + gk * m + gm) = w;
        }
        return;
    }
    for (int idx = threadIdx.x; idx < 128 * 128; idx += blockDim.x) {
        const int c = idx / 128, rt = idx % 128;
        const u64 gk = k0 + c, gm = m0 + rt;
        if (gk < k && gm < m) q_col[gk * m + gm] = tr[c][rt];
    }
}

#define BLOCK_KERNEL(SUFFIX, T, FMT, E4M3)                                                     \
    extern "C" __global__ void __launch_bounds__(256) tessera_fp8_block_##SUFFIX##_##FMT(      \
        const T* __restrict__ x, u64 m, u64 k, float fp8_max, int pow2, float eps,             \
        float value_for_inf, int two_d, uint8_t* q_row, float* s_row, u64 s_row_cols,          \
        uint8_t* q_col, float* s_col, u64 s_col_cols) {                                        \
        block_impl<T, E4M3>(x, m, k, fp8_max, pow2, eps, value_for_inf, two_d, q_row, s_row,   \
                            s_row_cols, q_col, s_col, s_col_cols);                             \
    }
BLOCK_KERNEL(f32, float, e4m3, true)
BLOCK_KERNEL(f32, float, e5m2, false)
BLOCK_KERNEL(bf16, __nv_bfloat16, e4m3, true)
BLOCK_KERNEL(bf16, __nv_bfloat16, e5m2, false)
BLOCK_KERNEL(f16, __half, e4m3, true)
BLOCK_KERNEL(f16, __half, e5m2, false)

// Dequantization of one orientation; q is [rows, cols] as stored (rowwise [m, k],
// columnwise [k, m]), y the logical [m, k]. mode: 0 = 1-D rowwise, 1 = 1-D columnwise,
// 2 = 2-D rowwise, 3 = 2-D columnwise (see block.rs for the scale layouts).
template <class T, bool E4M3>
__device__ void block_dequant_impl(const uint8_t* __restrict__ q, const float* __restrict__ s,
                                   T* __restrict__ y, u64 m, u64 k, u64 s_cols, int mode) {
    const u64 n = m * k;
    const u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 e = (u64)blockIdx.x * blockDim.x + threadIdx.x; e < n; e += stride) {
        const u64 r = e / k, c = e % k;  // logical row (m) and column (k)
        float si;
        uint8_t b;
        switch (mode) {
            case 0: si = s[(c / 128) * s_cols + r]; b = q[e]; break;
            case 1: si = s[(r / 128) * s_cols + c]; b = q[c * m + r]; break;
            case 2: si = s[(r / 128) * s_cols + c / 128]; b = q[e]; break;
            default: si = s[(c / 128) * s_cols + r / 128]; b = q[c * m + r]; break;
        }
        y[e] = In<T>::from(fp8_to_f32<E4M3>(b) * si);
    }
}

#define BLOCK_DEQUANT(SUFFIX, T, FMT, E4M3)                                                    \
    extern "C" __global__ void __launch_bounds__(256) tessera_fp8_block_dequant_##SUFFIX##_##FMT( \
        const uint8_t* q, const float* s, T* y, u64 m, u64 k, u64 s_cols, int mode) {          \
        block_dequant_impl<T, E4M3>(q, s, y, m, k, s_cols, mode);                              \
    }
BLOCK_DEQUANT(f32, float, e4m3, true)
BLOCK_DEQUANT(f32, float, e5m2, false)
BLOCK_DEQUANT(bf16, __nv_bfloat16, e4m3, true)
BLOCK_DEQUANT(bf16, __nv_bfloat16, e5m2, false)
BLOCK_DEQUANT(f16, __half, e4m3, true)
BLOCK_DEQUANT(f16, __half, e5m2, false)
