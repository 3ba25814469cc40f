// MXFP8 quantization (spec/formats.md 4): 1x32 rowwise and 32x1 columnwise blocks, or
// 32x32 tiles, both orientations from one read of the input, compact or GEMM-swizzled
// E8M0 scales. Checked byte for byte against crates/quant/src/mxfp8.rs.
#include "common.cuh"

// Rowwise-only 1-D: one CTA per 32-row x 128-column tile (m/32 x ceil(k/128) tiles, tile_row; 256
// threads); thread t owns row t/8 and the 16 columns (t%8)*16 .. +16, loaded as two
// 16-byte vectors; the partner lane (xor 1) holds the other half of its 32-element block.
// Few registers, no shared memory, no barrier.
template <class T, bool E4M3>
__device__ void mxfp8_row_impl(const T* __restrict__ x, u64 m, u64 k, float max_rcp,
                               uint8_t* __restrict__ q_row, uint8_t* __restrict__ s_row,
                               u64 s_row_cols, int swizzled) {
    const int t = threadIdx.x;
    const int c0 = (t % 8) * 16;
    const u64 gy = (k + 127) / 128;
    const u64 row = tile_row(gy) * 32 + t / 8, k0 = tile_col(gy) * 128;
    const bool valid = k0 + c0 < k;  // k % 32 == 0: a thread's 16 columns are all in or out
    constexpr int L = (int)sizeof(T);  // 16-byte vectors per 16 elements
    union {
        uint4 u[L];
        uint32_t w[4 * L];
        T e[16];
    } raw;
#pragma unroll
    for (int l = 0; l < L; ++l)
        raw.u[l] = valid ? reinterpret_cast<const uint4*>(x + row * k + k0 + c0)[l] : make_uint4(0u, 0u, 0u, 0u);
    float a = amax_of<T, 16>(raw.w);
    a = fmaxf(a, __shfl_xor_sync(0xFFFFFFFFu, a, 1));
    if (!valid) return;
    const uint8_t e = float_to_e8m0(__fmul_rn(a, max_rcp));
    float v[16];
#pragma unroll
    for (int j = 0; j < 16; ++j) v[j] = In<T>::f32(raw.e[j]);
    reinterpret_cast<uint4*>(q_row + row * k + k0 + c0)[0] = fp8x16<E4M3>(v, e8m0_reciprocal(e));
    if ((t % 2) == 0) {
        const u64 j = (k0 + c0) / 32;
        s_row[scale_index(row, j, s_row_cols, swizzled)] = e;
    }
}

// The amaxes of a Warp32x64 tile's MXFP8 blocks, NaN-ignoring (0 when all NaN), as every
// lane needs them: row[i] of row 8*(lane/8) + i over its 1x32 block (the 4 lanes xor 1,
// 2), col[j] of column 8*(lane%8) + j over the tile's 32 rows (the 4 lanes xor 8, 16).
// One orientation at a time, so that the other's amaxes and multipliers are not live
// beside the tile. 2-byte inputs reduce as packed pairs (one |.| per two values, one
// max per two values per step; two rows share each row shuffle), which keeps the kernel
// off the integer pipe's limit; the max of exactly converted values is the converted max.
template <class T>
__device__ __forceinline__ void mxfp8_col_amax(const Warp32x64<T>& x8, float* col) {
    if constexpr (sizeof(T) == 2) {
#pragma unroll
        for (int p = 0; p < 4; ++p) {  // columns 2p, 2p + 1
            uint32_t c = x8.d.w[0][p] & 0x7FFF7FFFu;
#pragma unroll
            for (int i = 1; i < 8; ++i) c = hmax2w<T>(c, x8.d.w[i][p] & 0x7FFF7FFFu);
            hmax2_lanes<T, 8, 16>(c, col[2 * p], col[2 * p + 1]);
        }
    } else {
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            float c = 0.0f;
#pragma unroll
            for (int i = 0; i < 8; ++i) c = fmaxf(c, fabsf(x8.at(i, j)));
            col[j] = fmax_lanes<8, 16>(c);
        }
    }
}

template <class T>
__device__ __forceinline__ void mxfp8_row_amax(const Warp32x64<T>& x8, float* row) {
    if constexpr (sizeof(T) == 2) {
#pragma unroll
        for (int q = 0; q < 4; ++q) {  // rows 2q, 2q + 1
            uint32_t h[2];
#pragma unroll
            for (int t = 0; t < 2; ++t) {
                const uint32_t* w = x8.d.w[2 * q + t];
                h[t] = hmax2w<T>(hmax2w<T>(w[0] & 0x7FFF7FFFu, w[1] & 0x7FFF7FFFu),
                                 hmax2w<T>(w[2] & 0x7FFF7FFFu, w[3] & 0x7FFF7FFFu));
            }
            hmax2_lanes<T, 1, 2>(hmax2_rows<T>(h[0], h[1]), row[2 * q], row[2 * q + 1]);
        }
    } else {
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            float r = 0.0f;
#pragma unroll
            for (int j = 0; j < 8; ++j) r = fmaxf(r, fabsf(x8.at(i, j)));
            row[i] = fmax_lanes<1, 2>(r);
        }
    }
}

// Eight block scales of which this lane computes two, `amax[2h]` and `amax[2h + 1]` (the
// lanes that hold the same eight amaxes split them): their E8M0 codes go to e[0..1], and
// the multipliers of all eight, gathered from lane `src(i / 2)`, to mul[0..7].
template <class Src>
__device__ __forceinline__ void mxfp8_scales(const float* amax, int h, float max_rcp, uint8_t* e,
                                             float* mul, Src src) {
    float a0 = amax[0], a1 = amax[1];
#pragma unroll
    for (int q = 1; q < 4; ++q) {
        a0 = h == q ? amax[2 * q] : a0;
        a1 = h == q ? amax[2 * q + 1] : a1;
    }
    e[0] = float_to_e8m0(__fmul_rn(a0, max_rcp));
    e[1] = float_to_e8m0(__fmul_rn(a1, max_rcp));
    const float m0 = e8m0_reciprocal(e[0]), m1 = e8m0_reciprocal(e[1]);
#pragma unroll
    for (int i = 0; i < 8; ++i) mul[i] = __shfl_sync(0xFFFFFFFFu, i % 2 ? m1 : m0, src(i / 2));
}

// Stores the scale e of row block (ri, jb): straight into s_row, or, when `stage` is
// given (compact layout), into the CTA's 64x8 shared stage that mxfp8_impl writes out in
// runs of 4 bytes per row (scattered byte stores into 32 rows per warp instruction had
// cost the compact layout 6% against the swizzled one).
__device__ __forceinline__ void put_row_scale(uint8_t* __restrict__ s_row, u64 s_row_cols, int swizzled,
                                              uint8_t* stage, u64 ri, u64 jb, uint8_t e) {
    if (stage != nullptr) stage[(ri % 64) * 8 + jb % 8] = e;
    else s_row[scale_index(ri, jb, s_row_cols, swizzled)] = e;
}

// Four FP8 bytes (one word) of x8's row i, columns 4h .. 4h + 3, each times its multiplier.
template <class T, bool E4M3>
__device__ __forceinline__ uint32_t mxfp8_word(const Warp32x64<T>& x8, int i, int h, const float* mul) {
    const uint32_t lo = fp8x2<E4M3>(__fmul_rn(x8.at(i, 4 * h), mul[0]), __fmul_rn(x8.at(i, 4 * h + 1), mul[1]));
    const uint32_t hi = fp8x2<E4M3>(__fmul_rn(x8.at(i, 4 * h + 2), mul[2]), __fmul_rn(x8.at(i, 4 * h + 3), mul[3]));
    return lo | (hi << 16);
}

// With a columnwise operand, or 32x32 tiles: each warp quantizes a 32-row x 64-column
// tile on its own (Warp32x64: lane l holds 8 columns of 8 rows); the warp's first row is
// r0 and its first column c0 (no shared memory, no barrier). A 1x32 rowwise block spans
// 4 lanes (xor 1, 2), a 32x1 columnwise block the 4 lanes of a column group (xor 8, 16).
// Each scale is computed by one lane of the four that share it (the one that writes it)
// and its multiplier handed to the others by a shuffle. Requires m and k multiples of 32.
// Outputs may be null (usage). Scale buffers hold zeros in their padding beforehand;
// only valid entries are written here.
template <class T, bool E4M3, bool two_d>
__device__ void mxfp8_tile(const Warp32x64<T>& x8, u64 r0, u64 c0, u64 k, float max_rcp,
                           uint8_t* __restrict__ q_row, uint8_t* __restrict__ s_row, u64 s_row_cols,
                           uint8_t* __restrict__ q_col, uint8_t* __restrict__ s_col, u64 s_col_rows,
                           u64 s_col_cols, int swizzled, uint8_t* stage) {
    const int lane = threadIdx.x & 31;
    const int cg = lane & 7, g = lane >> 3, h = cg & 3;
    const u64 col = c0 + 8 * cg;  // the lane's first column
    const u64 r = r0 + 8 * g;     // and first row
    // k % 32 == 0: a lane's 8 columns, and the 4 lanes of its 32-column block, are all
    // inside or all outside.
    const bool valid = col < k;
    const u64 jb = col / 32, ib = r0 / 32;
    // Lane h of a block writes the scales of its rows 2h, 2h + 1, lane g of a column
    // group those of its columns 2g, 2g + 1.
    auto put_row_scales = [&](const uint8_t* re) {
#pragma unroll
        for (int t = 0; t < 2; ++t) put_row_scale(s_row, s_row_cols, swizzled, stage, r + 2 * h + t, jb, re[t]);
    };
    auto put_col_scales = [&](const uint8_t* ce) {
#pragma unroll
        for (int t = 0; t < 2; ++t) {
            const u64 cj = col + 2 * g + t;
            s_col[swizzled ? swizzled_index(cj, ib, s_col_rows) : ib * s_col_cols + cj] = ce[t];
        }
    };
    if (two_d) {
        // One scale for the 32x32 tile (the max over a column group's 8 column maxima
        // and the 4 lanes of the block); both operands get the same bytes.
        float ca[8];
        mxfp8_col_amax<T>(x8, ca);
        const float a = fmax_lanes<1, 2>(
            fmaxf(fmaxf(fmaxf(ca[0], ca[1]), fmaxf(ca[2], ca[3])), fmaxf(fmaxf(ca[4], ca[5]), fmaxf(ca[6], ca[7]))));
        if (!valid) return;
        const uint8_t e = float_to_e8m0(__fmul_rn(a, max_rcp));
        const float s = e8m0_reciprocal(e);
        const float mul[4] = {s, s, s, s};
        uint8_t* const qr = q_row != nullptr ? q_row + r * k + col : nullptr;
        uint8_t* const qc = q_col != nullptr ? q_col + r * k + col : nullptr;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const uint2 v = make_uint2(mxfp8_word<T, E4M3>(x8, i, 0, mul), mxfp8_word<T, E4M3>(x8, i, 1, mul));
            if (qr != nullptr) *reinterpret_cast<uint2*>(qr + i * k) = v;
            if (qc != nullptr) *reinterpret_cast<uint2*>(qc + i * k) = v;
        }
        const uint8_t es[2] = {e, e};
        if (q_row != nullptr) put_row_scales(es);
        if (q_col != nullptr) put_col_scales(es);
        return;
    }
    // One orientation at a time: amaxes, scales (computed by the writers: row scales by
    // lane h of a block, column scales by lane g of a column group), bytes, scale bytes.
    if (q_row != nullptr) {
        float ra[8], rm[8];
        uint8_t re[2];
        mxfp8_row_amax<T>(x8, ra);
        mxfp8_scales(ra, h, max_rcp, re, rm, [&](int q) { return (lane & ~3) | q; });
        if (valid) {
            uint8_t* const qr = q_row + r * k + col;
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                const float mul[4] = {rm[i], rm[i], rm[i], rm[i]};
                *reinterpret_cast<uint2*>(qr + i * k) =
                    make_uint2(mxfp8_word<T, E4M3>(x8, i, 0, mul), mxfp8_word<T, E4M3>(x8, i, 1, mul));
            }
            put_row_scales(re);
        }
    }
    if (q_col != nullptr) {
        float ca[8], cm[8];
        uint8_t ce[2];
        mxfp8_col_amax<T>(x8, ca);
        mxfp8_scales(ca, g, max_rcp, ce, cm, [&](int q) { return (lane & 7) | (q << 3); });
        if (valid) {
            uint8_t* const qc = q_col + r * k + col;
#pragma unroll
            for (int i = 0; i < 8; ++i)
                *reinterpret_cast<uint2*>(qc + i * k) =
                    make_uint2(mxfp8_word<T, E4M3>(x8, i, 0, cm), mxfp8_word<T, E4M3>(x8, i, 1, cm + 4));
            put_col_scales(ce);
        }
    }
}

// A CTA of 8 warps covers 64 rows x 256 columns (m/64 x k/256 tiles rounded up, tile_row), each
// warp loading its tile straight into registers.
template <class T, bool E4M3, bool two_d>
__device__ void mxfp8_impl(const T* __restrict__ x, u64 m, u64 k, float max_rcp,
                           uint8_t* __restrict__ q_row, uint8_t* __restrict__ s_row, u64 s_row_cols,
                           uint8_t* __restrict__ q_col, uint8_t* __restrict__ s_col, u64 s_col_rows,
                           u64 s_col_cols, int swizzled) {
    __shared__ uint32_t stage[64 * 8 / 4];  // compact row scales of the CTA's 64 rows
    const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
    const u64 gy = (k + 255) / 256, bx = tile_row(gy), by = tile_col(gy);
    const u64 r0 = bx * 64 + 32 * (warp / 4), c0 = by * 256 + 64 * (warp % 4);
    const bool staged = q_row != nullptr && !swizzled;
    if (r0 < m) {  // uniform over the warp (m % 32 == 0)
        Warp32x64<T> x8;
        x8.load(x, k, r0, c0 + 8 * (lane & 7), lane);
        mxfp8_tile<T, E4M3, two_d>(x8, r0, c0, k, max_rcp, q_row, s_row, s_row_cols, q_col, s_col,
                                   s_col_rows, s_col_cols, swizzled,
                                   staged ? reinterpret_cast<uint8_t*>(stage) : nullptr);
    }
    if (!staged) return;
    __syncthreads();
    // Thread t < 128 writes blocks 4*(t%2) .. +3 of the CTA's row t/2 (only valid entries:
    // the padding keeps its zeros).
    const u64 row = bx * 64 + (t >> 1), j0 = by * 8 + 4 * (t & 1), nb = k / 32;
    if (t >= 128 || row >= m || j0 >= nb) return;
    uint8_t* dst = s_row + row * s_row_cols + j0;
    const uint32_t v = stage[t];
    if (j0 + 4 <= nb && (reinterpret_cast<uintptr_t>(dst) & 3) == 0) {
        *reinterpret_cast<uint32_t*>(dst) = v;
    } else {
#pragma unroll
        for (int j = 0; j < 4; ++j)
            if (j0 + j < nb) dst[j] = (uint8_t)(v >> (8 * j));
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
        pdl_first();                                                                           \
        mxfp8_row_impl<T, E4M3>(x, m, k, max_rcp, q_row, s_row, s_row_cols, swizzled);         \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(256, sizeof(T) == 4 ? 2 : TQ_MINB_MXFP8) tessera_mxfp8_##SUFFIX##_##FMT( \
        const T* __restrict__ x, u64 m, u64 k, float max_rcp, uint8_t* q_row, uint8_t* s_row,  \
        u64 s_row_cols, uint8_t* q_col, uint8_t* s_col, u64 s_col_rows, u64 s_col_cols,        \
        int two_d, int swizzled) {                                                             \
        pdl_first();                                                                           \
        mxfp8_impl<T, E4M3, false>(x, m, k, max_rcp, q_row, s_row, s_row_cols, q_col, s_col,   \
                                   s_col_rows, s_col_cols, swizzled);                          \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(256, sizeof(T) == 4 ? 2 : TQ_MINB_MXFP8) tessera_mxfp8_2d_##SUFFIX##_##FMT( \
        const T* __restrict__ x, u64 m, u64 k, float max_rcp, uint8_t* q_row, uint8_t* s_row,  \
        u64 s_row_cols, uint8_t* q_col, uint8_t* s_col, u64 s_col_rows, u64 s_col_cols,        \
        int two_d, int swizzled) {                                                             \
        pdl_first();                                                                           \
        mxfp8_impl<T, E4M3, true>(x, m, k, max_rcp, q_row, s_row, s_row_cols, q_col, s_col,    \
                                  s_col_rows, s_col_cols, swizzled);                           \
    }
MXFP8(f32, float, e4m3, true)
MXFP8(f32, float, e5m2, false)
MXFP8(bf16, __nv_bfloat16, e4m3, true)
MXFP8(bf16, __nv_bfloat16, e5m2, false)
MXFP8(f16, __half, e4m3, true)
MXFP8(f16, __half, e5m2, false)

// Dequantization of rowwise (col = 0) or columnwise (col = 1) MXFP8 data [m, k] (the
// columnwise data is not transposed) with a compact or swizzled scale buffer. k % 32 == 0,
// so a unit of DEQ_VALS<T> elements of a row stays inside one 1x32 block: rowwise it has
// one scale (fp8_dequant_rows); columnwise each of its columns has its own, loaded as
// one 8- or 4-byte word from a compact grid (rows padded to a multiple of 128 bytes),
// else byte by byte. Launch: DEQ_UNITS units a thread (for_units), m * k / DEQ_VALS<T>
// units.
template <class T, bool E4M3>
__device__ void mxfp8_dequant_impl(const uint8_t* __restrict__ q, const uint8_t* __restrict__ s,
                                   T* __restrict__ y, u64 m, u64 k, u64 s_rows, u64 s_cols,
                                   int col, int swizzled) {
    if (!col) {
        fp8_dequant_rows<T, E4M3>(q, y, m, k, [=](u64 r, u64 c) {
            return e8m0_value(s[scale_index(r, c / 32, s_cols, swizzled)]);
        });
        return;
    }
    constexpr int V = DEQ_VALS<T>;
    union Scales {
        Bytes<V> w;
        uint8_t b[V];
    };
    struct Unit {
        Bytes<V> b;
        Scales e;
    };
    const bool vector = !swizzled && s_cols % V == 0;
    for_units(
        m * k / V,
        [&](u64 g) {
            const DivMod p = divmod(V * g, k);
            const u64 r = p.q, c = p.r;
            Unit l;
            l.b = load_bytes<V>(q + V * g);
            if (vector) {
                l.e.w = load_bytes<V>(s + (r / 32) * s_cols + c);
            } else {
#pragma unroll
                for (int j = 0; j < V; ++j)
                    l.e.b[j] = s[swizzled ? swizzled_index(c + j, r / 32, s_rows) : (r / 32) * s_cols + c + j];
            }
            return l;
        },
        [&](u64 g, const Unit& l) {
            float v[V];
            fp8_bytes_to_f32<E4M3>(l.b, v);
#pragma unroll
            for (int j = 0; j < V; ++j) v[j] = v[j] * e8m0_value(l.e.b[j]);
            store_vec<V>(y + V * g, v);
        });
}

#define MXFP8_DEQUANT(SUFFIX, T, FMT, E4M3)                                                    \
    extern "C" __global__ void __launch_bounds__(256) tessera_mxfp8_dequant_##SUFFIX##_##FMT(  \
        const uint8_t* q, const uint8_t* s, T* y, u64 m, u64 k, u64 s_rows, u64 s_cols,        \
        int col, int swizzled) {                                                               \
        pdl_first();                                                                           \
        mxfp8_dequant_impl<T, E4M3>(q, s, y, m, k, s_rows, s_cols, col, swizzled);              \
    }
MXFP8_DEQUANT(f32, float, e4m3, true)
MXFP8_DEQUANT(f32, float, e5m2, false)
MXFP8_DEQUANT(bf16, __nv_bfloat16, e4m3, true)
MXFP8_DEQUANT(bf16, __nv_bfloat16, e5m2, false)
MXFP8_DEQUANT(f16, __half, e4m3, true)
MXFP8_DEQUANT(f16, __half, e5m2, false)
