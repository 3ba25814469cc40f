// 32x128 strips (and 4-CTA thread block clusters per 128x128 tile, reducing the tile's
// amaxes through distributed shared memory) against the shipped 128x128-tile kernels for
// the FP8 block and cast-transpose quantizers (not shipped: the experiment lost). Build:
//   nvcc -O3 -arch=sm_90 -std=c++17 -I crates/quant/kernels [-DTQ_MINB_STRIP=4] \
//        bench/cuda/strip_variants.cu -o sv
// Run at QV_M x QV_K (multiples of 128; default 4096x4096). Each line prints the time,
// the ratio to cudaMemcpy and FNV-1a hashes of every output: a strip kernel's hashes must
// equal its tile kernel's (they did, at every shape run).
// The idea: at 4096x4096 the tile kernels' 1024 CTAs are 2.6 waves of 3 CTAs per SM, and
// a CTA a quarter the size would shorten the partial last wave. Measured on the H200
// (2026-12-04, BENCHMARKS.md): the cluster kernels ran at 0.47-0.63 of a copy at every
// shape against 0.82-1.00 for the tiles, and the cluster-free cast-transpose strips at
// 0.88-0.92 against 0.91-0.92 at 4096x4096 and 0.82-0.90 against 0.92 at 16384x8192.
#include <cstdio>
#include <vector>

#include "block.cu"
#include "fp8.cu"

#include "harness.cuh"
#include "sm90.cuh"

// Launch bound of the strip kernels (minimum CTAs per SM).
#ifndef TQ_MINB_STRIP
#define TQ_MINB_STRIP 1
#endif

// ---- 32x128 strips and thread block clusters ------------------------------------------
//
// A CTA of 256 threads holds a 32-row x 128-column strip of the input: warp w owns rows
// 4w .. 4w+3, lane l columns 4l .. 4l+3 of each (one 8-byte load per row for 2-byte
// inputs, 16 bytes for f32; a warp reads 256 or 512 contiguous bytes per instruction).
// The 4 strips of a 128x128 tile run as one thread block cluster (rank r rows 32r ..
// 32r+31), so per-tile and per-column amaxes reduce across the cluster through
// distributed shared memory: a CTA is a quarter of a tile kernel's, so at small shapes
// the last wave costs a quarter as long (see block.cu).

template <class T> struct Strip {
    static constexpr int W = (int)sizeof(T);  // 32-bit words per row and thread
    union {
        uint32_t w[4][W];  // 2-byte T: word p holds columns 4l + 2p, 4l + 2p + 1
        T e[4][4];
    } d;

    __device__ float at(int i, int j) const {
        if constexpr (sizeof(T) == 2) return j % 2 ? hi_f32<T>(d.w[i][j / 2]) : lo_f32<T>(d.w[i][j / 2]);
        else return d.e[i][j];
    }

    // Rows r0 + 4w .. +3 of x [m, k] from column k0 + 4l; zeros outside the matrix.
    __device__ void load(const T* __restrict__ x, u64 m, u64 k, u64 r0, u64 k0, int w, int l) {
        const u64 c = k0 + 4 * l;
        const bool vec = (k % 4) == 0 && c + 4 <= k;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const u64 r = r0 + 4 * w + i;
            if (vec && r < m) {
                const T* p = x + r * k + c;
                if constexpr (sizeof(T) == 2) {
                    const uint2 v = *reinterpret_cast<const uint2*>(p);
                    d.w[i][0] = v.x;
                    d.w[i][1] = v.y;
                } else {
                    const uint4 v = *reinterpret_cast<const uint4*>(p);
                    d.w[i][0] = v.x;
                    d.w[i][1] = v.y;
                    d.w[i][2] = v.z;
                    d.w[i][3] = v.w;
                }
            } else {
#pragma unroll
                for (int j = 0; j < 4; ++j) d.e[i][j] = (r < m && c + j < k) ? x[r * k + c + j] : In<T>::from(0.0f);
            }
        }
    }

    // NaN-ignoring max |x| of each of the thread's 4 rows over the strip's 128 columns
    // (all 32 lanes), in every lane. 2-byte inputs reduce packed, two rows a shuffle.
    __device__ void row_amax(float* ra) const {
        if constexpr (sizeof(T) == 2) {
#pragma unroll
            for (int q = 0; q < 2; ++q) {
                const uint32_t a = hmax2w<T>(d.w[2 * q][0] & 0x7FFF7FFFu, d.w[2 * q][1] & 0x7FFF7FFFu);
                const uint32_t b = hmax2w<T>(d.w[2 * q + 1][0] & 0x7FFF7FFFu, d.w[2 * q + 1][1] & 0x7FFF7FFFu);
                hmax2_lanes<T, 1, 2, 4, 8, 16>(hmax2_rows<T>(a, b), ra[2 * q], ra[2 * q + 1]);
            }
        } else {
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                float a = 0.0f;
#pragma unroll
                for (int j = 0; j < 4; ++j) a = fmaxf(a, fabsf(at(i, j)));
                ra[i] = fmax_lanes<1, 2, 4, 8, 16>(a);
            }
        }
    }

    // NaN-ignoring max |x| of each of the thread's 4 columns over its 4 rows.
    __device__ void col_amax(float* ca) const {
        if constexpr (sizeof(T) == 2) {
#pragma unroll
            for (int p = 0; p < 2; ++p) {
                uint32_t a = d.w[0][p] & 0x7FFF7FFFu;
#pragma unroll
                for (int i = 1; i < 4; ++i) a = hmax2w<T>(a, d.w[i][p] & 0x7FFF7FFFu);
                ca[2 * p] = fmaxf(0.0f, lo_f32<T>(a));
                ca[2 * p + 1] = fmaxf(0.0f, hi_f32<T>(a));
            }
        } else {
#pragma unroll
            for (int j = 0; j < 4; ++j)
                ca[j] = fmaxf(fmaxf(fabsf(at(0, j)), fabsf(at(1, j))), fmaxf(fabsf(at(2, j)), fabsf(at(3, j))));
        }
    }
};

// Shared staging of a strip's transposed bytes: column c of the strip (a row of the
// transposed output) holds 8 words, word w packing strip rows 4w .. 4w+3 (from warp w).
// Column c lives in row prow(c), which rotates the low two bits of c by c / 4, with its
// words at w ^ s(c), s(c) = (c / 16) % 8: the 32 lanes of a warp writing word w of
// columns 4l + b then hit 32 different banks, and a quarter-warp reading 16-byte halves
// of 4 neighbouring columns hits 8 different bank quads.
struct StripT {
    uint32_t w[128][8];
    __device__ static int prow(int c) { return (c & ~3) | (((c & 3) + (c >> 2)) & 3); }
    __device__ static int swz(int c) { return (c >> 4) & 7; }
    __device__ void put(int c, int word, uint32_t v) { w[prow(c)][word ^ swz(c)] = v; }
    // Writes the 32 staged bytes of each column to qt [k, m] at (k0 + c, m0): 16 bytes a
    // thread (column t / 2, half t % 2).
    __device__ void store(uint8_t* __restrict__ qt, u64 m, u64 k, u64 m0, u64 k0) const {
        const int c = threadIdx.x >> 1, h = threadIdx.x & 1, s = swz(c);
        const u64 gk = k0 + c, gm = m0 + 16 * h;
        if (gk >= k || gm >= m) return;
        const uint4 v = *reinterpret_cast<const uint4*>(&w[prow(c)][4 * (h ^ (s >> 2))]);
        // Word j of the half sits at position j ^ (s % 4) of the 16 bytes read.
        const uint32_t r[4] = {v.x, v.y, v.z, v.w};
        uint32_t o[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const uint32_t a = (s & 1) ? r[j ^ 1] : r[j];
            const uint32_t b = (s & 1) ? r[(j ^ 2) ^ 1] : r[j ^ 2];
            o[j] = (s & 2) ? b : a;
        }
        if ((m % 16) == 0) {
            store_global16(qt + gk * m + gm, make_uint4(o[0], o[1], o[2], o[3]));
        } else {
#pragma unroll
            for (int b = 0; b < 16; ++b)
                if (gm + b < m) qt[gk * m + gm + b] = (uint8_t)(o[b / 4] >> (8 * (b % 4)));
        }
    }
};

// A 128x128 tile quantized by a cluster of 4 CTAs, one 32x128 strip each (Strip below): rowwise bytes and 1-D row scales from the strip alone; the tile amax (2-D)
// or each column's amax over the tile's 128 rows (1-D columnwise) reduced across the
// cluster through distributed shared memory. ceil(m/128) x ceil(k/128) tiles, 4 CTAs
// each, tiles row-major on a 1-D grid. A CTA is a quarter of block_impl's: at 4096x4096
// the last wave of 1024 tiles on 132 SMs costs a quarter as long.
template <class T, bool E4M3, bool two_d>
__device__ void block_strip_impl(const T* __restrict__ x, u64 m, u64 k, float fp8_max, int pow2, float eps,
                                 float value_for_inf, uint8_t* __restrict__ q_row, float* __restrict__ s_row,
                                 u64 s_row_cols, uint8_t* __restrict__ q_col, float* __restrict__ s_col,
                                 u64 s_col_cols) {
    __shared__ StripT tr;
    __shared__ float colpart[8][128];
    __shared__ float part[128];  // the strip's column amaxes (1-D) or its amax in [0] (2-D)
    __shared__ float colscale[128];
    const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
    const uint32_t rank = cluster_rank(), tile = blockIdx.x >> 2;
    const uint32_t gy = (uint32_t)((k + 127) / 128);
    const u64 mb = tile / gy, kb = tile % gy, M0 = mb * 128, k0 = kb * 128, r0 = M0 + 32 * rank;
    Strip<T> x4;
    x4.load(x, m, k, r0, k0, warp, lane);
    uint32_t wr[4];  // row i: the bytes of columns 4 lane .. +3
    auto quantize_rows = [&](const float* rs) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const uint32_t lo = fp8x2<E4M3>(__fmul_rn(x4.at(i, 0), rs[i]), __fmul_rn(x4.at(i, 1), rs[i]));
            const uint32_t hi = fp8x2<E4M3>(__fmul_rn(x4.at(i, 2), rs[i]), __fmul_rn(x4.at(i, 3), rs[i]));
            wr[i] = lo | (hi << 16);
        }
        if (q_row != nullptr) {
#pragma unroll
            for (int i = 0; i < 4; ++i) store_run<4>(q_row, m, k, r0 + 4 * warp + i, k0 + 4 * lane, &wr[i]);
        }
    };
    if constexpr (two_d) {
        float a;
        {
            float ra[4];
            x4.row_amax(ra);  // every lane: its rows' maxima over the strip's columns
            a = fmaxf(fmaxf(ra[0], ra[1]), fmaxf(ra[2], ra[3]));
        }
        if (lane == 0) colpart[0][warp] = a;
        __syncthreads();
        if (t == 0) {
            float b = colpart[0][0];
#pragma unroll
            for (int w = 1; w < 8; ++w) b = fmaxf(b, colpart[0][w]);
            part[0] = b;
        }
        cluster_arrive();
        cluster_wait();
        // Lanes 0-3 read the strips' amaxes, the warp takes their max.
        a = lane < 4 ? ld_cluster_f32(&part[0], lane) : 0.0f;
        cluster_arrive();  // done with the peers' shared memory
        a = fmax_lanes<1, 2>(a);
        a = __shfl_sync(0xFFFFFFFFu, a, 0);
        const float s = scale_from_amax(a, fp8_max, pow2, eps, value_for_inf);
        const float rs[4] = {s, s, s, s};
        quantize_rows(rs);
        if (rank == 0 && t == 0) {
            const float si = __frcp_rn(s);
            if (s_row != nullptr) s_row[mb * s_row_cols + kb] = si;
            if (s_col != nullptr) s_col[kb * s_col_cols + mb] = si;
        }
        if (q_col != nullptr) {
            uint32_t out[4];
            transpose4x4(wr, out);
#pragma unroll
            for (int b = 0; b < 4; ++b) tr.put(4 * lane + b, warp, out[b]);
        }
    } else {
        // Rowwise: lane i of a warp computes the scale of its row i, the warp shares them.
        {
            float ra[4];
            x4.row_amax(ra);
            const int h = lane & 3;
            const float a = h == 0 ? ra[0] : h == 1 ? ra[1] : h == 2 ? ra[2] : ra[3];
            const float s = scale_from_amax(a, fp8_max, pow2, eps, value_for_inf);
            float rs[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) rs[i] = __shfl_sync(0xFFFFFFFFu, s, i);
            quantize_rows(rs);
            const u64 r = r0 + 4 * warp + lane;
            if (q_row != nullptr && lane < 4 && r < m) s_row[kb * s_row_cols + r] = __frcp_rn(s);
        }
        if (q_col == nullptr) return;
        // Columnwise: the strip's column amaxes, then the tile's across the cluster.
        float ca[4];
        x4.col_amax(ca);
#pragma unroll
        for (int b = 0; b < 4; ++b) colpart[warp][4 * lane + b] = ca[b];
        __syncthreads();
        if (t < 128) {
            float a = colpart[0][t];
#pragma unroll
            for (int w = 1; w < 8; ++w) a = fmaxf(a, colpart[w][t]);
            part[t] = a;
        }
        cluster_arrive();
        cluster_wait();
        if (t < 128) {
            float a = ld_cluster_f32(&part[t], 0);
#pragma unroll
            for (uint32_t r = 1; r < 4; ++r) a = fmaxf(a, ld_cluster_f32(&part[t], r));
            const float s = scale_from_amax(a, fp8_max, pow2, eps, value_for_inf);
            colscale[t] = s;
            if (rank == 0 && k0 + t < k) s_col[mb * s_col_cols + k0 + t] = __frcp_rn(s);
        }
        cluster_arrive();  // done with the peers' shared memory
        __syncthreads();
#pragma unroll
        for (int b = 0; b < 4; ++b) {
            const float s = colscale[4 * lane + b];
            const uint32_t lo = fp8x2<E4M3>(__fmul_rn(x4.at(0, b), s), __fmul_rn(x4.at(1, b), s));
            const uint32_t hi = fp8x2<E4M3>(__fmul_rn(x4.at(2, b), s), __fmul_rn(x4.at(3, b), s));
            tr.put(4 * lane + b, warp, lo | (hi << 16));
        }
    }
    if (q_col != nullptr) {
        __syncthreads();
        tr.store(q_col, m, k, r0, k0);
    }
    cluster_wait();  // no peer reads this CTA's shared memory any more
}

// The cast-transpose on 32x128 strips (Strip above), one CTA each (ceil(m/32) x
// ceil(k/128) strips, row-major on a 1-D grid): a quarter of cast_transpose_impl's tile,
// for shapes whose tile count leaves a partial last wave. Same arguments and outputs.
template <class T, bool E4M3>
__device__ void cast_transpose_strip_impl(const T* __restrict__ x, uint8_t* __restrict__ q,
                                          uint8_t* __restrict__ qt, u64 m, u64 k, const Fp8Scale sa,
                                          float* __restrict__ scale_inv, float* __restrict__ amax) {
    __shared__ StripT tr;
    __shared__ float smem[32];
    const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
    const bool last_first = sa.amax != nullptr;  // after an amax pass (cta_order)
    const u64 gy = (k + 127) / 128, r0 = tile_row(gy, last_first) * 32, k0 = tile_col(gy, last_first) * 128;
    Strip<T> x4;
    x4.load(x, m, k, r0, k0, warp, lane);
    pdl_wait();  // the strip is loaded; the scale or amax comes from the kernel before
    const float scale = cast_scale(sa);
    if (blockIdx.x == 0 && t == 0) scale_inv[0] = __frcp_rn(scale);
    uint32_t wr[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const uint32_t lo = fp8x2<E4M3>(x4.at(i, 0) * scale, x4.at(i, 1) * scale);
        const uint32_t hi = fp8x2<E4M3>(x4.at(i, 2) * scale, x4.at(i, 3) * scale);
        wr[i] = lo | (hi << 16);
        if (q != nullptr) store_run<4>(q, m, k, r0 + 4 * warp + i, k0 + 4 * lane, &wr[i]);
    }
    uint32_t out[4];
    transpose4x4(wr, out);
#pragma unroll
    for (int b = 0; b < 4; ++b) tr.put(4 * lane + b, warp, out[b]);
    __syncthreads();
    tr.store(qt, m, k, r0, k0);
    if (amax != nullptr) {
        float mx = amax_of<T, 16>(&x4.d.w[0][0]);
        mx = block_max(mx, smem);
        if (t == 0) atomic_max_nonneg(amax, mx);
    }
}

extern "C" __global__ void __cluster_dims__(4, 1, 1) __launch_bounds__(256, TQ_MINB_STRIP)
    tessera_fp8_block_1d_strip_bf16_e4m3(const __nv_bfloat16* __restrict__ x, u64 m, u64 k, float fp8_max, int pow2,
                                         float eps, float value_for_inf, int two_d, uint8_t* q_row, float* s_row,
                                         u64 s_row_cols, uint8_t* q_col, float* s_col, u64 s_col_cols) {
    block_strip_impl<__nv_bfloat16, true, false>(x, m, k, fp8_max, pow2, eps, value_for_inf, q_row, s_row,
                                                 s_row_cols, q_col, s_col, s_col_cols);
}
extern "C" __global__ void __cluster_dims__(4, 1, 1) __launch_bounds__(256, TQ_MINB_STRIP)
    tessera_fp8_block_2d_strip_bf16_e4m3(const __nv_bfloat16* __restrict__ x, u64 m, u64 k, float fp8_max, int pow2,
                                         float eps, float value_for_inf, int two_d, uint8_t* q_row, float* s_row,
                                         u64 s_row_cols, uint8_t* q_col, float* s_col, u64 s_col_cols) {
    block_strip_impl<__nv_bfloat16, true, true>(x, m, k, fp8_max, pow2, eps, value_for_inf, q_row, s_row,
                                                s_row_cols, q_col, s_col, s_col_cols);
}
extern "C" __global__ void __launch_bounds__(256, TQ_MINB_STRIP)
    tessera_fp8_cast_transpose_strip_bf16_e4m3(const __nv_bfloat16* __restrict__ x, uint8_t* q, uint8_t* qt, u64 m,
                                               u64 k, const Fp8Scale scale, float* scale_inv, float* amax) {
    cast_transpose_strip_impl<__nv_bfloat16, true>(x, q, qt, m, k, scale, scale_inv, amax);
}

static const u64 M = env_dim("QV_M", 4096);
static const u64 K = env_dim("QV_K", 4096);

int main() {
    const u64 n = M * K;
    const std::vector<uint16_t> h = bf16_input(n);
    Fp8Buffers b(n, h, 1.0f);
    __nv_bfloat16* x = b.x;
    uint8_t *q = b.q, *qt = b.qt;
    float *sr = b.sr, *sc = b.sc, *scale = b.scale, *sinv = b.sinv, *amax = b.amax;
    std::printf("%llu x %llu bf16, TQ_MINB_STRIP %d\n", (unsigned long long)M, (unsigned long long)K, TQ_MINB_STRIP);
    b.time_copy();
    const double in = 2.0 * n;
    const unsigned tiles = (unsigned)((M / 128) * (K / 128)), strips = (unsigned)((M / 32) * (K / 128));

    // FP8 block scaling: (1x128 both), (128x128 rowwise), (128x128 both); tile then strip.
    for (int mode = 0; mode < 3; ++mode) {
        const bool two_d = mode > 0, both = mode != 1;
        for (int strip = 0; strip < 2; ++strip) {
            b.clear();
            const u64 src = two_d ? K / 128 : M, scc = two_d ? M / 128 : K;
            uint8_t* qc = both ? qt : nullptr;
            float* scp = both ? sc : nullptr;
            auto kern = two_d ? (strip ? tessera_fp8_block_2d_strip_bf16_e4m3 : tessera_fp8_block_2d_bf16_e4m3)
                              : (strip ? tessera_fp8_block_1d_strip_bf16_e4m3 : tessera_fp8_block_1d_bf16_e4m3);
            const unsigned grid = strip ? 4 * tiles : tiles;
            const float ms = time_ms([&] {
                kern<<<grid, 256>>>(x, M, K, 448.0f, 1, 0.0f, 3.4e38f, two_d, q, sr, src, qc, scp, scc);
            });
            const double sb = two_d ? (M / 128) * (K / 128) * 4.0 : n / 128 * 4.0;
            char name[64];
            std::snprintf(name, sizeof name, "fp8 block %s %s, %s", two_d ? "128x128" : "1x128",
                          both ? "both" : "rowwise", strip ? "strips" : "tiles");
            b.report(name, ms, in + (both ? 2 : 1) * (n + sb),
                   {{q, n}, {sr, (size_t)sb}, {qt, both ? n : 0}, {sc, both ? (size_t)sb : 0}});
        }
    }

    // Cast-transpose with a given scale (delayed scaling), then current scaling as the
    // library runs it (zeroed amax, amax pass, cast-transpose after it with PDL).
    const Fp8Scale del{scale, nullptr, 448.0f, 0.0f, 0, 0};
    const Fp8Scale cur{nullptr, amax, 448.0f, 0.0f, 0, 0};
    const int ablocks = (int)std::min<u64>(n / 8 / 256, 4ull * 132 * 8);
    for (int strip = 0; strip < 2; ++strip) {
        auto kern = strip ? tessera_fp8_cast_transpose_strip_bf16_e4m3 : tessera_fp8_cast_transpose_bf16_e4m3;
        const unsigned grid = strip ? strips : tiles;
        b.clear();
        const float ms = time_ms([&] { kern<<<grid, 256>>>(x, q, qt, M, K, del, sinv, nullptr); });
        b.report(strip ? "fp8 cast both, strips" : "fp8 cast both, tiles", ms, in + 2.0 * n, {{q, n}, {qt, n}});
        b.clear();
        CK(cudaMemset(amax, 0, 4));
        const float ms2 = time_ms([&] { kern<<<grid, 256>>>(x, q, qt, M, K, del, sinv, amax); });
        b.report(strip ? "fp8 cast both + amax, strips" : "fp8 cast both + amax, tiles", ms2, in + 2.0 * n,
               {{q, n}, {qt, n}, {amax, 4}});
        for (int memset = 1; memset >= 0; --memset) {
        b.clear();
        // Without the memset the amax keeps the last launch's (same input's) value.
        const float t = time_ms([&] {
            if (memset) CK(cudaMemsetAsync(amax, 0, 4));
            tessera_amax_bf16<<<ablocks, 256>>>(x, n, amax);
            launch_pdl(kern, dim3(grid), dim3(256), (const __nv_bfloat16*)x, q, qt, M, K, cur, sinv, (float*)nullptr);
        });
        std::printf("%-40s %8.4f ms %6.3f of two-pass floor  hash %016llx %016llx\n",
                    memset ? (strip ? "current scaling both, strips" : "current scaling both, tiles")
                           : (strip ? "current ... strips, no memset" : "current ... tiles, no memset"),
                    t, 3.0 * in / t / 1e6 / b.copy_gbs, (unsigned long long)fnv(q, n), (unsigned long long)fnv(qt, n));
        }
    }
    return 0;
}
