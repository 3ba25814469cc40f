// FP8 block scaling (spec/formats.md 6): float32 scales per 1x128 block (rowwise),
// 128x1 block (columnwise, quantized independently, stored transposed) or 128x128 tile,
// both orientations from one read of the input, any M and K (partial edge blocks).
// Checked byte for byte against crates/quant/src/block.rs.
#include "common.cuh"

// What every block kernel is given besides its input: the shape, the scale recipe
// (scale_from_amax's parameters) and the outputs, null where an orientation is not asked
// for (s_row_cols / s_col_cols: the columns of each scale grid).
struct BlockArgs {
    u64 m, k;
    float fp8_max;
    int pow2;
    float eps, value_for_inf;
    uint8_t* q_row;
    float* s_row;
    u64 s_row_cols;
    uint8_t* q_col;
    float* s_col;
    u64 s_col_cols;
    __device__ __forceinline__ float scale(float amax) const {
        return scale_from_amax(amax, fp8_max, pow2 != 0, eps, value_for_inf);
    }
};

// Rowwise-only 1x128 blocks: a CTA of 256 threads covers 32 rows x 128 columns (ceil(m/32)
// x ceil(k/128) tiles, tile_row); thread t owns row t/8 and 16 columns of it, laid out as in
// Tile128 (8 lanes load one contiguous 128-byte stretch per instruction); the block amax
// reduces over the 8 lanes of the row. Few registers, no shared memory, no barrier.
template <class T, bool E4M3>
__device__ void block_row_impl(const T* __restrict__ x, const BlockArgs& p) {
    const u64 m = p.m, k = p.k;
    using Tl = Tile128<T>;
    constexpr int V = Tl::V;
    const int t = threadIdx.x, cg = t & 7;
    const u64 gy = (k + 127) / 128, by = tile_col(gy);
    const u64 r = tile_row(gy) * 32 + (t >> 3), k0 = by * 128;
    Row16<T> row;
    row.load(x, m, k, r, k0, cg);
    float a = row.amax();
    a = fmaxf(a, __shfl_xor_sync(0xFFFFFFFFu, a, 1));
    a = fmaxf(a, __shfl_xor_sync(0xFFFFFFFFu, a, 2));
    a = fmaxf(a, __shfl_xor_sync(0xFFFFFFFFu, a, 4));
    if (r >= m) return;
    const float s = p.scale(a);
    uint32_t w[4];
    row.template fp8<E4M3>(s, w);
#pragma unroll
    for (int l = 0; l < Tl::L; ++l) store_run<V>(p.q_row, m, k, r, k0 + Tl::col(cg, l * V), &w[l * V / 4]);
    if (cg == 0) p.s_row[by * p.s_row_cols + r] = __frcp_rn(s);
}

// One 128x128 tile at (m0, k0), held in registers as Tile128 lays it out (4 rows x 16
// columns per thread), by a CTA of 256 threads. Row amaxes reduce over the 8 lanes of a
// row group, column amaxes in registers over a thread's 4 rows, then over lanes and
// warps; the transposed (columnwise) bytes are packed 4 rows to a word in registers and
// staged through a swizzled shared tile for 16-byte stores. Every thread calls it; it
// synchronises the CTA. Full: the tile passed full_tile (no bounds checks). The shared
// memory is the caller's, so that both paths of block_impl use one copy.
template <int V> struct BlockShared {
    Transposed128<V>& tr;
    float (&colpart)[8][128];
    float (&colscale)[128];
    float (&warpmax)[8];
};
// The tile kernels' shared memory for inputs of T, one copy per kernel (what a kernel
// does not touch is not allocated).
template <class T> __device__ __forceinline__ BlockShared<Tile128<T>::V> block_shared() {
    __shared__ Transposed128<Tile128<T>::V> tr;
    __shared__ float colpart[8][128];
    __shared__ float colscale[128];
    __shared__ float warpmax[8];
    return {tr, colpart, colscale, warpmax};
}
template <class T, bool E4M3, bool two_d, bool Full>
__device__ void block_tile(const Tile128<T>& x4, u64 m0, u64 k0, const BlockArgs& p,
                           const BlockShared<Tile128<T>::V>& sh) {
    const u64 m = p.m, k = p.k;
    using Tl = Tile128<T>;
    constexpr int V = Tl::V;
    auto& tr = sh.tr;
    auto& colpart = sh.colpart;
    auto& colscale = sh.colscale;
    auto& warpmax = sh.warpmax;
    const int t = threadIdx.x, lane = t & 31, warp = t >> 5, rg = t >> 3, cg = t & 7;
    const u64 mb = m0 / 128, kb = k0 / 128;
    float ra[4];
    x4.row_amax(ra);
    float rs[4];  // the scale of each row (1-D) or of the tile (2-D)
    if (two_d) {
        float a = fmaxf(fmaxf(ra[0], ra[1]), fmaxf(ra[2], ra[3]));
        a = fmaxf(a, __shfl_xor_sync(0xFFFFFFFFu, a, 8));
        a = fmaxf(a, __shfl_xor_sync(0xFFFFFFFFu, a, 16));
        if (lane == 0) warpmax[warp] = a;
        __syncthreads();
        a = warpmax[0];
#pragma unroll
        for (int w = 1; w < 8; ++w) a = fmaxf(a, warpmax[w]);
        const float s = p.scale(a);
#pragma unroll
        for (int i = 0; i < 4; ++i) rs[i] = s;
        if (t == 0) {
            const float si = __frcp_rn(s);
            if (p.s_row != nullptr) p.s_row[mb * p.s_row_cols + kb] = si;
            if (p.s_col != nullptr) p.s_col[kb * p.s_col_cols + mb] = si;
        }
    } else {
        // Lane cg of a row group computes the scale of row 4*rg + cg % 4 (one division
        // instead of four) and the group shares them.
        const int h = cg & 3;
        const float a = h == 0 ? ra[0] : h == 1 ? ra[1] : h == 2 ? ra[2] : ra[3];
        const float s = p.scale(a);
#pragma unroll
        for (int i = 0; i < 4; ++i) rs[i] = __shfl_sync(0xFFFFFFFFu, s, (lane & ~7) | i);
    }
    // Rowwise bytes (in 2-D mode also the transposed tile, which has the same bytes);
    // in 1-D mode each row is stored as soon as it is converted, so that only its 4
    // words are live.
    uint32_t wr[4][4];  // row i, word w: columns col(cg, 4w .. 4w+3)
    auto row_words = [&](int i) {
#pragma unroll
        for (int w = 0; w < 4; ++w) {
            const uint32_t lo = fp8x2<E4M3>(__fmul_rn(x4.at(i, 4 * w), rs[i]), __fmul_rn(x4.at(i, 4 * w + 1), rs[i]));
            const uint32_t hi = fp8x2<E4M3>(__fmul_rn(x4.at(i, 4 * w + 2), rs[i]), __fmul_rn(x4.at(i, 4 * w + 3), rs[i]));
            wr[i][w] = lo | (hi << 16);
        }
    };
    if (two_d) {
#pragma unroll
        for (int i = 0; i < 4; ++i) row_words(i);
    }
    if (p.q_row != nullptr) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            if (!two_d) row_words(i);
            const u64 r = m0 + 4 * rg + i;
#pragma unroll
            for (int l = 0; l < Tl::L; ++l)
                store_run<V, Full>(p.q_row, m, k, r, k0 + Tl::col(cg, l * V), &wr[i][l * V / 4]);
        }
        if (!two_d) {
            // Lane cg < 4 of a row group writes the scale of row 4*rg + cg.
            const float a = cg == 0 ? rs[0] : cg == 1 ? rs[1] : cg == 2 ? rs[2] : rs[3];
            const u64 r = m0 + 4 * rg + cg;
            if (cg < 4 && (Full || r < m)) p.s_row[kb * p.s_row_cols + r] = __frcp_rn(a);
        }
    }
    if (p.q_col == nullptr) return;
    if (two_d) {
        tr.put_rows(wr, cg, rg);
    } else {
        // Columnwise 1-D: each column's own scale over the tile's 128 rows. The warp's
        // column maxima go to shared memory 8 at a time.
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            float ca[8];
            x4.col_amax(ca, half);
            if (lane < 8) {
#pragma unroll
                for (int j = 0; j < 8; ++j) colpart[warp][Tl::col(cg, 8 * half + j)] = ca[j];
            }
        }
        __syncthreads();
        if (t < 128) {
            float a = colpart[0][t];
#pragma unroll
            for (int w = 1; w < 8; ++w) a = fmaxf(a, colpart[w][t]);
            const float s = p.scale(a);
            colscale[t] = s;
            if (Full || k0 + t < k) p.s_col[mb * p.s_col_cols + k0 + t] = __frcp_rn(s);
        }
        __syncthreads();
#pragma unroll
        for (int j = 0; j < 16; ++j) {
            const int c = Tl::col(cg, j);
            const float s = colscale[c];
            const uint32_t lo = fp8x2<E4M3>(__fmul_rn(x4.at(0, j), s), __fmul_rn(x4.at(1, j), s));
            const uint32_t hi = fp8x2<E4M3>(__fmul_rn(x4.at(2, j), s), __fmul_rn(x4.at(3, j), s));
            tr.put(c, rg, lo | (hi << 16));
        }
    }
    __syncthreads();
    tr.template store<Full>(p.q_col, m, k, m0, k0);
}

// Loads the tile at (m0, k0) and quantizes it (block_tile), checked or (Full) not.
template <class T, bool E4M3, bool two_d, bool Full>
__device__ __forceinline__ void block_at(const T* __restrict__ x, u64 m0, u64 k0, const BlockArgs& p,
                                         const BlockShared<Tile128<T>::V>& sh) {
    Tile128<T> x4;
    x4.template load<Full>(x, p.m, p.k, m0, k0, threadIdx.x >> 3, threadIdx.x & 7);
    block_tile<T, E4M3, two_d, Full>(x4, m0, k0, p, sh);
}

// The checked path of the 2-D kernels, for tiles at a ragged edge or of unaligned rows: a
// call, so that its registers (and spills, under the kernels' register caps) do not
// weigh on the full tiles' path. (p by value: a reference would put the caller's
// arguments in local memory.)
template <class T, bool E4M3, bool two_d>
__device__ __noinline__ void block_edge(const T* __restrict__ x, u64 m0, u64 k0, const BlockArgs p,
                                        const BlockShared<Tile128<T>::V>& sh) {
    block_at<T, E4M3, two_d, false>(x, m0, k0, p, sh);
}

// One CTA per 128x128 tile (ceil(m/128) x ceil(k/128) tiles, tile_row; 256 threads), loaded
// straight into registers (16-byte loads); a full tile (full_tile) takes the unchecked
// path. 1-D blocks with a columnwise operand keep their checked path inline: with a call
// for the edges the kernel itself spilled.
template <class T, bool E4M3, bool two_d>
__device__ void block_impl(const T* __restrict__ x, const BlockArgs& p) {
    const auto sh = block_shared<T>();
    const u64 gy = (p.k + 127) / 128, m0 = tile_row(gy) * 128, k0 = tile_col(gy) * 128;
    if (full_tile<T>(p.m, p.k, m0, k0))
        block_at<T, E4M3, two_d, true>(x, m0, k0, p, sh);
    else if constexpr (two_d)
        block_edge<T, E4M3, two_d>(x, m0, k0, p, sh);
    else
        block_at<T, E4M3, two_d, false>(x, m0, k0, p, sh);
}

// Four entry points with their own register budgets: rowwise-only 1x128 blocks
// (`_row_`), 1-D blocks with a columnwise operand (`_1d_`, 128x128 tiles), 128x128
// blocks with a columnwise operand (`_2d_`) and without one (`_2d_row_`, where the
// transposed tile and its 16 KiB of shared memory compile away). They share one
// parameter list; `two_d` is implied by the name, and `_2d_row_` ignores q_col and s_col.
#define BLOCK_PARAMS(T)                                                                        \
    const T *__restrict__ x, u64 m, u64 k, float fp8_max, int pow2, float eps,                 \
        float value_for_inf, int two_d, uint8_t *q_row, float *s_row, u64 s_row_cols,          \
        uint8_t *q_col, float *s_col, u64 s_col_cols
#define BLOCK_ARGS {m, k, fp8_max, pow2, eps, value_for_inf, q_row, s_row, s_row_cols, q_col, s_col, s_col_cols}
#define BLOCK_KERNEL(SUFFIX, T, FMT, E4M3)                                                     \
    extern "C" __global__ void __launch_bounds__(256, TQ_MINB_BLOCK_ROW)                      \
        tessera_fp8_block_row_##SUFFIX##_##FMT(BLOCK_PARAMS(T)) {                              \
        pdl_first();                                                                           \
        block_row_impl<T, E4M3>(x, BlockArgs BLOCK_ARGS);                                      \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(256, sizeof(T) == 4 ? 2 : TQ_MINB_BLOCK_1D)  \
        tessera_fp8_block_1d_##SUFFIX##_##FMT(BLOCK_PARAMS(T)) {                               \
        pdl_first();                                                                           \
        block_impl<T, E4M3, false>(x, BlockArgs BLOCK_ARGS);                                   \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(256, sizeof(T) == 4 ? 2 : TQ_MINB_BLOCK_2D)  \
        tessera_fp8_block_2d_##SUFFIX##_##FMT(BLOCK_PARAMS(T)) {                               \
        pdl_first();                                                                           \
        block_impl<T, E4M3, true>(x, BlockArgs BLOCK_ARGS);                                    \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(256, sizeof(T) == 4 ? 2 : TQ_MINB_BLOCK_2D)  \
        tessera_fp8_block_2d_row_##SUFFIX##_##FMT(BLOCK_PARAMS(T)) {                           \
        pdl_first();                                                                           \
        block_impl<T, E4M3, true>(                                                             \
            x, BlockArgs{m, k, fp8_max, pow2, eps, value_for_inf, q_row, s_row, s_row_cols,    \
                         nullptr, nullptr, 0});                                                \
    }
BLOCK_KERNEL(f32, float, e4m3, true)
BLOCK_KERNEL(f32, float, e5m2, false)
BLOCK_KERNEL(bf16, __nv_bfloat16, e4m3, true)
BLOCK_KERNEL(bf16, __nv_bfloat16, e5m2, false)
BLOCK_KERNEL(f16, __half, e4m3, true)
BLOCK_KERNEL(f16, __half, e5m2, false)

// Dequantization of one orientation; q is [rows, cols] as stored (rowwise [m, k],
// columnwise [k, m]), y the logical [m, k]. mode: 0 = 1-D rowwise, 1 = 1-D columnwise,
// 2 = 2-D rowwise, 3 = 2-D columnwise (see block.rs for the scale layouts); COL (modes
// 1 and 3) picks fp8_dequant_cols, else fp8_dequant_rows, and their launch. Blocks of
// 128 along the stored rows keep a scale constant over the runs those ask for. Separate
// entry points, so that neither path's registers limit the other's occupancy; the
// columnwise one in tiles of 64 or (`_t_tall_`) 128 q rows, as the FP8 dequantizer.
template <class T, bool E4M3, bool COL, int TK = DEQ_TILE_K>
__device__ void block_dequant_impl(const uint8_t* __restrict__ q, const float* __restrict__ s,
                                   T* __restrict__ y, u64 m, u64 k, u64 s_cols, int mode) {
    const bool two_d = mode >= 2;
    if constexpr (COL) {
        fp8_dequant_cols<T, E4M3, TK, true>(q, y, m, k, [=](u64 r, u64 c) {
            return two_d ? s[(c / 128) * s_cols + r / 128] : s[(r / 128) * s_cols + c];
        });
    } else {
        fp8_dequant_rows<T, E4M3>(q, y, m, k, [=](u64 r, u64 c) {
            return two_d ? s[(r / 128) * s_cols + c / 128] : s[(c / 128) * s_cols + r];
        });
    }
}

#define BLOCK_DEQUANT(SUFFIX, T, FMT, E4M3)                                                    \
    extern "C" __global__ void __launch_bounds__(256) tessera_fp8_block_dequant_##SUFFIX##_##FMT( \
        const uint8_t* q, const float* s, T* y, u64 m, u64 k, u64 s_cols, int mode) {          \
        pdl_first();                                                                           \
        block_dequant_impl<T, E4M3, false>(q, s, y, m, k, s_cols, mode);                       \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(256) tessera_fp8_block_dequant_t_##SUFFIX##_##FMT( \
        const uint8_t* q, const float* s, T* y, u64 m, u64 k, u64 s_cols, int mode) {          \
        pdl_first();                                                                           \
        block_dequant_impl<T, E4M3, true>(q, s, y, m, k, s_cols, mode);                        \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(256, DEQ_T_TALL_MINB)                         \
        tessera_fp8_block_dequant_t_tall_##SUFFIX##_##FMT(                                     \
        const uint8_t* q, const float* s, T* y, u64 m, u64 k, u64 s_cols, int mode) {          \
        pdl_first();                                                                           \
        block_dequant_impl<T, E4M3, true, DEQ_TILE_K_TALL>(q, s, y, m, k, s_cols, mode);       \
    }
BLOCK_DEQUANT(f32, float, e4m3, true)
BLOCK_DEQUANT(f32, float, e5m2, false)
BLOCK_DEQUANT(bf16, __nv_bfloat16, e4m3, true)
BLOCK_DEQUANT(bf16, __nv_bfloat16, e5m2, false)
BLOCK_DEQUANT(f16, __half, e4m3, true)
BLOCK_DEQUANT(f16, __half, e5m2, false)
