// Tile-shape experiments for the NVFP4 quantizer (not shipped): the 1-D round-to-nearest
// entry points (`tessera_nvfp4_row_*`, `tessera_nvfp4_both_*`) and variants of their
// parameters, timed against the general kernel (`tessera_nvfp4_bf16`, every option) on
// the same input, every output hashed so each must agree with it byte for byte. Build on the GPU machine:
//   nvcc -O3 -arch=sm_90 -std=c++17 -Xptxas -v -I crates/quant/kernels \
//        bench/cuda/nvfp4_variants.cu -o nv && ./nv
// bf16 16384x8192 and 4096x4096; GB/s counts the input read once and every output byte
// written once; the ratio is to a cudaMemcpy of the input measured in the same run.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "fp8.cu"
#include "harness.cuh"
#include "nvfp4.cu"

// ---- variants of the shipped kernels' parameters -------------------------------------

template <int B>
__global__ void __launch_bounds__(256) row_var(const __nv_bfloat16* __restrict__ x, u64 m, u64 k, const float* amax,
                                               uint8_t* q, uint8_t* s, u64 s_cols, int swizzled, u64 col_tiles) {
    nvfp4_row_impl<__nv_bfloat16, B>(x, m, k, amax, q, s, s_cols, swizzled, col_tiles);
}

template <int MINB>
__global__ void __launch_bounds__(256, MINB) both_var(const __nv_bfloat16* __restrict__ x, const Nvfp4Args a) {
    nvfp4_both_impl<__nv_bfloat16>(x, a);
}

static void run_shape(u64 M, u64 K, int normal) {
    const u64 n = M * K;
    std::vector<uint16_t> h(n);
    uint64_t s = 12345;
    for (u64 i = 0; i < n; ++i) {
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        const uint32_t r = (uint32_t)(s >> 32);
        uint16_t b;
        if (normal) {
            // Roughly normal magnitudes: exponents 2^-4 .. 2^2.
            b = (uint16_t)((r & 0x8000) | ((123 + (r >> 20) % 7) << 7) | (r & 0x7F));
        } else {
            const uint16_t exp = (uint16_t)(127 - 20 + ((i / 64) * 7 % 41));  // 2^-20 .. 2^20
            b = (uint16_t)((r & 0x8000) | (exp << 7) | (r & 0x7F));
            if (r % 997 == 0) b = (r & 0x10000) ? 0x7FC0 : 0xFF80;  // NaN, -Inf
            if (r % 1009 == 0) b = 0;
        }
        h[i] = b;
    }
    __nv_bfloat16* x;
    uint8_t *q, *qt, *sr, *sc, *tmp;
    float* amax;
    CK(cudaMalloc(&x, n * 2));
    CK(cudaMalloc(&tmp, n * 2));
    CK(cudaMalloc(&q, n / 2));
    CK(cudaMalloc(&qt, n / 2));
    CK(cudaMalloc(&sr, n / 16));
    CK(cudaMalloc(&sc, n / 16));
    CK(cudaMalloc(&amax, 4));
    CK(cudaMemcpy(x, h.data(), n * 2, cudaMemcpyHostToDevice));
    const float ms_copy = time_ms([&] { CK(cudaMemcpyAsync(tmp, x, n * 2, cudaMemcpyDeviceToDevice)); });
    const double copy_gbs = 4.0 * n / ms_copy / 1e6;
    std::printf("\n[%llu, %llu] %s inputs; cudaMemcpy d2d %.4f ms %.1f GB/s\n", (unsigned long long)M,
                (unsigned long long)K, normal ? "normal" : "wide-range + NaN/Inf/0", ms_copy, copy_gbs);
    CK(cudaMemset(amax, 0, 4));
    tessera_amax_bf16<<<1024, 256>>>(x, n, amax);
    const float ms_a = time_ms([&] {
        CK(cudaMemsetAsync(amax, 0, 4));
        tessera_amax_bf16<<<1024, 256>>>(x, n, amax);
    });
    std::printf("%-40s %8.4f ms %8.1f GB/s %6.3f of copy\n", "amax (memset + kernel)", ms_a, 2.0 * n / ms_a / 1e6,
                2.0 * n / ms_a / 1e6 / copy_gbs);
    auto clear = [&] {
        CK(cudaMemset(q, 0xA5, n / 2));
        CK(cudaMemset(qt, 0xA5, n / 2));
        CK(cudaMemset(sr, 0xA5, n / 16));
        CK(cudaMemset(sc, 0xA5, n / 16));
    };
    const double in = 2.0 * n, ob = n / 2.0 + n / 16.0;
    for (int both = 0; both < 2; ++both) {
        for (int swz = 0; swz < (M % 128 == 0 && K % 64 == 0 ? 2 : 1); ++swz) {
            auto report = [&](const char* name, float ms) {
                const double bytes = in + (both ? 2 : 1) * ob;
                const double gbs = bytes / ms / 1e6;
                const double floor_ms = ms_a + 0.0;  // amax pass measured above
                std::printf("%-40s %8.4f ms %8.1f GB/s %6.3f of copy; with amax %6.3f of two-pass floor  hash %016llx %016llx",
                            name, ms, gbs, gbs / copy_gbs,
                            (in / copy_gbs / 1e6 + bytes / copy_gbs / 1e6) / (ms + floor_ms),
                            (unsigned long long)fnv(q, n / 2), (unsigned long long)fnv(sr, n / 16));
                if (both) std::printf(" %016llx %016llx", (unsigned long long)fnv(qt, n / 2), (unsigned long long)fnv(sc, n / 16));
                std::printf("\n");
            };
            char name[96];
            // Shipped kernel.
            clear();
            Nvfp4Args a{};
            a.m = M;
            a.k = K;
            a.amax_row = amax;
            a.amax_col = amax;
            a.q_row = q;
            a.s_row = sr;
            a.s_row_cols = K / 16;
            a.q_col = both ? qt : nullptr;
            a.s_col = both ? sc : nullptr;
            a.s_col_cols = M / 16;
            a.swizzled = swz;
            float ms = time_ms([&] { tessera_nvfp4_bf16<<<((M + 63) / 64) * ((K + 63) / 64), 256>>>(x, a); });
            std::snprintf(name, sizeof name, "shipped %s%s", both ? "both" : "rowwise", swz ? " swz" : "");
            report(name, ms);
            if (!both) {
                auto row = [&](auto kernel, int B, const char* label) {
                    clear();
                    const u64 ct = (K + 256 * B - 1) / (256 * B);
                    const float t = time_ms([&] { kernel<<<(M / 16) * ct, 256>>>(x, M, K, amax, q, sr, K / 16, swz, ct); });
                    std::snprintf(name, sizeof name, "%s%s", label, swz ? " swz" : "");
                    report(name, t);
                };
                row(row_var<1>, 1, "row 16x256 (1 block/thread)");
                row(tessera_nvfp4_row_bf16, NVFP4_ROW_BLOCKS, "row shipped (NVFP4_ROW_BLOCKS/thread)");
                row(row_var<4>, 4, "row 16x1024 (4 blocks/thread)");
            } else {
                const dim3 grid(((M + 127) / 128) * ((K + 127) / 128));  // 1-D, 128x128 tiles
                auto both_run = [&](auto kernel, const char* label) {
                    clear();
                    const float t = time_ms([&] { kernel<<<grid, 256>>>(x, a); });
                    std::snprintf(name, sizeof name, "%s%s", label, swz ? " swz" : "");
                    report(name, t);
                };
                both_run(both_var<2>, "both warp 32x64, 2 CTAs/SM");
                both_run(tessera_nvfp4_both_bf16, "both shipped (NVFP4_BOTH_MINB CTAs/SM)");
                both_run(both_var<4>, "both warp 32x64, 4 CTAs/SM");
            }
        }
    }
    CK(cudaFree(x));
    CK(cudaFree(tmp));
    CK(cudaFree(q));
    CK(cudaFree(qt));
    CK(cudaFree(sr));
    CK(cudaFree(sc));
    CK(cudaFree(amax));
}

int main() {
    int dev;
    CK(cudaGetDevice(&dev));
    cudaDeviceProp p;
    CK(cudaGetDeviceProperties(&p, dev));
    std::printf("%s, %d SMs\n", p.name, p.multiProcessorCount);
    run_shape(16384, 8192, 1);
    run_shape(16384, 8192, 0);
    run_shape(4096, 4096, 1);
    run_shape(4096 + 16, 4096 + 48, 0);  // ragged against the tiles
    return 0;
}
