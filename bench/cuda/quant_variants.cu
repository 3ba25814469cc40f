// Register-budget and tile-shape experiments for the tessera-quant kernels (not shipped).
// Build one executable per variant, with the kernels directory on the include path:
//   nvcc -O3 -arch=sm_90 -std=c++17 -I crates/quant/kernels -DTQ_MINB_BLOCK_2D=4 \
//        bench/cuda/quant_variants.cu -o qv
// (-DOLD_KERNELS with the include path of the previous kernels launches their grids.)
// On bf16 16384x8192 it prints each kernel's time, GB/s (input read + outputs written)
// and ratio to cudaMemcpy, and an FNV-1a hash of every output, so variants (and old
// against new kernels, which must agree byte for byte) can be compared.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "block.cu"
#include "fp8.cu"
#include "mxfp8.cu"
#include "nvfp4.cu"

#include "harness.cuh"

// The input shape: 16384x8192, or QV_M x QV_K from the environment (multiples of 128).
static const u64 M = env_dim("QV_M", 16384);
static const u64 K = env_dim("QV_K", 8192);

// The launch grid of gx x gy tiles: one CTA per tile on a 1-D grid (tile_row in
// common.cuh); the previous kernels (OLD_KERNELS) take 2-D grids.
static dim3 tiles(unsigned gx, unsigned gy) {
#ifdef OLD_KERNELS
    return dim3(gx, gy);
#else
    return dim3(gx * gy);
#endif
}

int main() {
    const u64 n = M * K;
    const std::vector<uint16_t> h = bf16_input(n);
    Fp8Buffers b(n, h, 3.0f);
    __nv_bfloat16* x = b.x;
    uint8_t *q = b.q, *qt = b.qt;
    float *sr = b.sr, *sc = b.sc, *scale = b.scale, *sinv = b.sinv, *amax = b.amax;
    const cudaDeviceProp p = device_props();
#ifdef OLD_KERNELS
    std::printf("%s, %d SMs; previous kernels\n", p.name, p.multiProcessorCount);
#else
    std::printf("%s, %d SMs; TQ_MINB_TILE=%d BLOCK_ROW=%d BLOCK_1D=%d BLOCK_2D=%d MXFP8=%d\n", p.name,
                p.multiProcessorCount, TQ_MINB_TILE, TQ_MINB_BLOCK_ROW, TQ_MINB_BLOCK_1D, TQ_MINB_BLOCK_2D,
                TQ_MINB_MXFP8);
#endif
    b.time_copy();
    const double in = 2.0 * n;

    // FP8 block scaling.
#ifdef OLD_KERNELS
    const dim3 gb(M / 128, K / 128);
#else
    const dim3 gb = tiles(M / 128, K / 128);
#endif
    for (int two_d = 0; two_d < 2; ++two_d) {
        for (int both = 0; both < 2; ++both) {
            b.clear();
            const u64 src = two_d ? K / 128 : M, scc = two_d ? M / 128 : K;
            const float ms = time_ms([&] {
#ifdef OLD_KERNELS
                tessera_fp8_block_bf16_e4m3<<<gb, 256>>>(x, M, K, 448.0f, 1, 0.0f, 3.4e38f, two_d, q, sr, src,
                                                         both ? qt : nullptr, both ? sc : nullptr, scc);
#else
                if (two_d && both)
                    tessera_fp8_block_2d_bf16_e4m3<<<gb, 256>>>(x, M, K, 448.0f, 1, 0.0f, 3.4e38f, two_d, q, sr, src, qt,
                                                                sc, scc);
                else if (two_d)
                    tessera_fp8_block_2d_row_bf16_e4m3<<<gb, 256>>>(x, M, K, 448.0f, 1, 0.0f, 3.4e38f, two_d, q, sr,
                                                                    src, nullptr, nullptr, scc);
                else if (both)
                    tessera_fp8_block_1d_bf16_e4m3<<<gb, 256>>>(x, M, K, 448.0f, 1, 0.0f, 3.4e38f, two_d, q, sr, src,
                                                                qt, sc, scc);
                else
                    tessera_fp8_block_row_bf16_e4m3<<<tiles(M / 32, K / 128), 256>>>(
                        x, M, K, 448.0f, 1, 0.0f, 3.4e38f, two_d, q, sr, src, nullptr, nullptr, scc);
#endif
            });
            const double sb = two_d ? (M / 128) * (K / 128) * 4.0 : n / 128 * 4.0;
            char name[64];
            std::snprintf(name, sizeof name, "fp8 block %s %s", two_d ? "128x128" : "1x128", both ? "both" : "rowwise");
            b.report(name, ms, in + (both ? 2 : 1) * (n + sb),
                   {{q, n}, {sr, (size_t)sb}, {qt, both ? n : 0}, {sc, both ? (size_t)sb : 0}});
        }
    }

    // FP8 per-tensor cast-transpose.
    {
        b.clear();
#ifdef OLD_KERNELS
        const dim3 g(M / 64, K / 64);
        const float* sa = scale;
#else
        const dim3 g = tiles(M / 128, K / 128);
        const Fp8Scale sa{scale, nullptr, 448.0f, 0.0f, 0, 0};
#endif
        const float ms = time_ms([&] {
            tessera_fp8_cast_transpose_bf16_e4m3<<<g, 256>>>(x, q, qt, M, K, sa, sinv, nullptr);
        });
        b.report("fp8 cast both", ms, in + 2.0 * n, {{q, n}, {qt, n}});
        CK(cudaMemset(amax, 0, 4));
        const float ms2 = time_ms([&] {
            tessera_fp8_cast_transpose_bf16_e4m3<<<g, 256>>>(x, q, qt, M, K, sa, sinv, amax);
        });
        b.report("fp8 cast both + amax", ms2, in + 2.0 * n, {{q, n}, {qt, n}, {amax, 4}});
        const int blocks = (int)std::min<u64>(n / 16 / 256, 4ull * p.multiProcessorCount * 8);
        const float ms3 = time_ms([&] { tessera_fp8_cast_bf16_e4m3<<<blocks, 256>>>(x, q, n, sa, sinv, amax); });
        b.report("fp8 cast rowwise + amax", ms3, in + n, {{q, n}});
        // Current scaling as the library sequences it: the zeroed amax, the amax pass, and
        // the cast-transpose computing its scale from the amax; with the cast launched
        // programmatically (PDL) or not. The floor reads the input twice.
        const Fp8Scale cur{nullptr, amax, 448.0f, 0.0f, 0, 0};
        const int ablocks = (int)std::min<u64>(n / 8 / 256, 4ull * p.multiProcessorCount * 8);
        for (int pdl = 0; pdl < 2; ++pdl) {
            b.clear();
            const float t = time_ms([&] {
                CK(cudaMemsetAsync(amax, 0, 4));
                tessera_amax_bf16<<<ablocks, 256>>>(x, n, amax);
                if (pdl)
                    launch_pdl(tessera_fp8_cast_transpose_bf16_e4m3, g, dim3(256), (const __nv_bfloat16*)x, q, qt, M, K,
                               cur, sinv, (float*)nullptr);
                else
                    tessera_fp8_cast_transpose_bf16_e4m3<<<g, 256>>>(x, q, qt, M, K, cur, sinv, nullptr);
            });
            const double floor_gbs = (3.0 * in) / t / 1e6;
            std::printf("%-34s %8.4f ms  %6.3f of two-pass floor  hash %016llx %016llx\n",
                        pdl ? "current scaling both, PDL" : "current scaling both", t, floor_gbs / b.copy_gbs,
                        (unsigned long long)fnv(q, n), (unsigned long long)fnv(qt, n));
        }
    }

    // MXFP8.
    for (int two_d = 0; two_d < 2; ++two_d) {
        for (int both = 0; both < 2; ++both) {
            for (int swz = 0; swz < 2; ++swz) {
                if (two_d && swz) continue;
                b.clear();
#ifdef OLD_KERNELS
                const dim3 g(M / 32, K / 128);
                auto kern = tessera_mxfp8_bf16_e4m3;
#else
                const dim3 g = (two_d || both) ? tiles(M / 64, K / 256) : tiles(M / 32, K / 128);
                auto kern = two_d ? tessera_mxfp8_2d_bf16_e4m3 : both ? tessera_mxfp8_bf16_e4m3 : tessera_mxfp8_row_bf16_e4m3;
#endif
                const float ms = time_ms([&] {
                    kern<<<g, 256>>>(x, M, K, 1.0f / 448.0f, q, (uint8_t*)sr, K / 32, both ? qt : nullptr,
                                     both ? (uint8_t*)sc : nullptr, M / 32, K, two_d, swz);
                });
                char name[64];
                std::snprintf(name, sizeof name, "mxfp8%s %s%s", two_d ? " 2d" : "", both ? "both" : "rowwise",
                              swz ? " swizzled" : "");
                const double sb = n / 32.0;
                b.report(name, ms, in + (both ? 2 : 1) * (n + sb),
                       {{q, n}, {sr, (size_t)sb}, {qt, both ? n : 0}, {sc, both ? (size_t)sb : 0}});
            }
        }
    }
    // NVFP4 (1-D, no RHT, round to nearest), with the global amax computed first.
    {
        CK(cudaMemset(amax, 0, 4));
        const int blocks = (int)std::min<u64>(n / 8 / 256, 4ull * p.multiProcessorCount * 8);
        const float ms_a = time_ms([&] { tessera_amax_bf16<<<blocks, 256>>>(x, n, amax); });
        b.report("amax", ms_a, in, {{amax, 4}});
        for (int both = 0; both < 2; ++both) {
            for (int two_d = 0; two_d < 2; ++two_d) {
                b.clear();
                Nvfp4Args a{};
                a.m = M;
                a.k = K;
                a.amax_row = amax;
                a.amax_col = amax;
                a.q_row = q;
                a.s_row = (uint8_t*)sr;
                a.s_row_cols = K / 16;
                a.q_col = both ? qt : nullptr;
                a.s_col = both ? (uint8_t*)sc : nullptr;
                a.s_col_cols = M / 16;
                a.two_d = two_d;
                const float ms = time_ms([&] { tessera_nvfp4_bf16<<<tiles(M / 64, K / 64), 256>>>(x, a); });
                char name[64];
                std::snprintf(name, sizeof name, "nvfp4%s %s (no amax)", two_d ? " 2d" : "", both ? "both" : "rowwise");
                const double ob = n / 2.0 + n / 16.0;
                b.report(name, ms, in + (both ? 2 : 1) * ob,
                       {{q, n / 2}, {sr, n / 16}, {qt, both ? n / 2 : 0}, {sc, both ? n / 16 : 0}});
            }
        }
    }
    return 0;
}
