// Where the NVFP4 2-D both kernel's time goes (not shipped). On an H100 the 2-D kernel
// (64 encodes a lane) took longer than the 1-D both kernel (128), as the 1-D kernel with
// its encoders removed did (BENCHMARKS, 2026-12-05): with little compute between a
// tile's loads and its stores, all 16 stores of a lane leave in one burst. The variants
// order the stores differently (same bytes: their hashes must equal the shipped 2-D
// kernel's), drop the scale flush, or drop one orientation's data; the library's two
// steps for compact scales (block scratch, then tessera_nvfp4_scales_2d) must hash as its
// one step does, as must the 2-D tile kernel built for 5 CTAs per SM; the 1-D kernels
// run alongside for reference, in one step and in the library's two steps (what an
// H100 takes from 2^26 values). bf16 normal inputs (the fast path everywhere).
// N2_CROSSOVER=1 adds 8192x8192, 8192x4096 and 4096x8192 (where two steps start to win).
// Build on the GPU machine:
//   nvcc -O3 -arch=sm_90 -std=c++17 -Xptxas -v -I crates/quant/kernels \
//        bench/cuda/nvfp4_2d.cu -o n2 && ./n2
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "fp8.cu"
#include "sm90.cuh"
#include "harness.cuh"
#include "nvfp4.cu"
#include "nvfp4_buffers.cuh"

// Store orders: 0 the shipped one (rows, then the transposed columns), 1 each row word
// stored as soon as it is encoded, 2 columns first, 3 columns and rows interleaved, 4 no
// scale flush (the shipped order; scale grids differ on purpose). The fast path only
// (the inputs take it everywhere).
template <int Order>
__device__ __forceinline__ void tile2d(const BothTile<__nv_bfloat16>& d, const BothLane& l, u64 R0, u64 C0,
                                       bool valid, const Nvfp4Args& a, BothShared& sh) {
    using T = __nv_bfloat16;
    const u64 r0 = R0 + l.rt, col = C0 + l.ct;
    const float b = block_amax_2d<T, true>(d);
    __syncthreads();
    const uint32_t e = fp8<true>(__fmul_rn(b, __fmul_rn(sh.se[0], 0.16666667163372040f)));
    const float2 t = sh.tab[0][e];
    uint8_t* qr = a.q_row + r0 * (a.k / 2) + col / 2;
    uint8_t* qc = a.q_col + col * (a.m / 2) + r0 / 2;
    uint32_t w[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        float v[8];
        row_values<T>(d.w[i], v);
        w[i] = e2m1x8_magnitudes(v, t.x) | row_signs(d.w[i]);
        if (Order == 1 && valid) *reinterpret_cast<uint32_t*>(qr + i * (a.k / 2)) = w[i];
    }
    stage_block_2d(sh.stage, l, (uint8_t)e);
    if (valid) {
        uint32_t c[8];
        transpose_nibbles8(w, c);
        if (Order == 0 || Order == 4) {
            store_rows_2d(a, r0, col, w);
            store_cols_2d(a, r0, col, c);
        } else if (Order == 1) {
            store_cols_2d(a, r0, col, c);
        } else if (Order == 2) {
            store_cols_2d(a, r0, col, c);
            store_rows_2d(a, r0, col, w);
        } else {
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                *reinterpret_cast<uint32_t*>(qc + j * (a.m / 2)) = c[j];
                *reinterpret_cast<uint32_t*>(qr + j * (a.k / 2)) = w[j];
            }
        }
    }
    __syncthreads();
    if (Order != 4) flush_both_scales(sh.stage, a, R0, C0);
}

// The library's 2-D kernel with one-step scales (its blk null), at the library's CTAs
// per SM (NVFP4_2D_MINB), as the store-order variants below.
__global__ void __launch_bounds__(256, NVFP4_2D_MINB) one_step_2d(const __nv_bfloat16* __restrict__ x,
                                                                   const Nvfp4Args a) {
    nvfp4_both_impl<__nv_bfloat16, false, false, BothParts, TwoDTiles>(x, a, TwoDTiles{nullptr});
}

// The library's 2-D kernel (two-step scales into blk) built for 5 CTAs per SM instead of
// the 4 it had then (NVFP4_2D_MINB, 3 since session 51): 48 registers, and ptxas spills
// 44 bytes (14 local accesses before the warp vote, 4 after it, sm_90, CUDA 13.0). The
// 2-D kernel's warps mostly wait (BENCHMARKS, session 35); a fifth CTA gives each SM 40
// warps to wait with instead of 32. It took 0.2277 ms against 0.1825 at 16384x8192 on an
// H100 (BENCHMARKS, session 50).
__global__ void __launch_bounds__(256, 5) two_d_5_ctas(const __nv_bfloat16* __restrict__ x, const Nvfp4Args a,
                                                       uint8_t* blk) {
    nvfp4_both_impl<__nv_bfloat16, false, false, BothParts, TwoDTiles>(x, a, TwoDTiles{blk});
}

// The library's both kernel with tile2d<Order> in place of both_tile_2d.
template <int Order> struct OrderTiles {
    static constexpr bool own_tile = true;
    template <class T>
    static __device__ __forceinline__ void tile(const BothTile<T>& d, const BothLane& l, u64 R0, u64 C0, bool valid,
                                                const Nvfp4Args& a, BothShared& sh) {
        tile2d<Order>(d, l, R0, C0, valid, a, sh);
    }
};
template <int Order>
__global__ void __launch_bounds__(256, NVFP4_2D_MINB) var2d(const __nv_bfloat16* __restrict__ x, const Nvfp4Args a) {
    nvfp4_both_impl<__nv_bfloat16, false, false, BothParts, OrderTiles<Order>>(x, a);
}

static void run_shape(u64 M, u64 K) {
    const Nvfp4Buffers b(M, K, true);
    const u64 n = b.n;
    const double bytes = 2.0 * n + 2 * (n / 2.0 + n / 16.0);
    const dim3 grid = b.both_grid();
    auto run = [&](auto kernel, const char* label, bool both = true) {
        Nvfp4Args a = b.args(b.amax, both);
        b.clear();
        const float t = time_ms([&] { kernel<<<grid, 256>>>(b.x, a); });
        report_hashes(label, t, bytes, b.copy_gbs, b.outputs());
    };
    uint8_t* blk;
    CK(cudaMalloc(&blk, (M + 127) / 128 * ((K + 127) / 128) * 128));  // BlockScratch: 128 bytes a tile
    // The scales kernel with `copies` of a grid row's 16 a thread; the library's choice:
    // all 16.
    const u64 words = std::max(M / 16 * ((K / 16 + 3) / 4 * 4), K / 16 * ((M / 16 + 3) / 4 * 4)) / 4;
    const int lib_copies = 16;
    auto scales = [&](int copies) {
        const dim3 g2((unsigned)((words + 255) / 256), 2, 16 / copies);
        tessera_nvfp4_scales_2d<<<g2, 256>>>(blk, M, K, b.sr, b.sr_cols, b.sc, b.sc_cols, copies);
    };
    auto run_two_step = [&](auto tile_kernel, const char* what, bool sweep) {
        const Nvfp4Args a = b.args(b.amax, true);
        b.clear();
        const float t = time_ms([&] {
            tile_kernel<<<grid, 256>>>(b.x, a, blk);
            scales(lib_copies);
        });
        char label[128];
        snprintf(label, sizeof label, "2-D two steps (%s + scales kernel, %d copies)", what, lib_copies);
        report_hashes(label, t, bytes, b.copy_gbs, b.outputs());
        if (!sweep) return;
        for (int copies = 16; copies >= 1; copies /= 2) {
            b.clear();
            const float t2 = time_ms([&] { scales(copies); });
            snprintf(label, sizeof label, "scales kernel alone, %d copies a thread", copies);
            report_hashes(label, t2, 2.0 * (n / 16) + n / 256, b.copy_gbs, {{b.sr, n / 16}, {b.sc, n / 16}});
        }
    };
    // The 1-D kernel's two steps as the library launches them (Nvfp4Launch::TwoStep, what
    // Auto takes on an H100 from 2^26 values): each tile's staged scale bytes into 2 KiB
    // of scratch, then tessera_nvfp4_scales_1d a thread per 32 bytes of it. Its hashes
    // must equal "1-D both shipped" (one step).
    uint8_t* scratch;
    CK(cudaMalloc(&scratch, (M + 127) / 128 * ((K + 127) / 128) * 2048));
    const u64 quads = std::max(M / 4 * ((K + 127) / 128), K / 4 * ((M + 127) / 128));
    auto run_one_d_two_step = [&] {
        const Nvfp4Args a = b.args(b.amax, true);
        b.clear();
        const float t = time_ms([&] {
            tessera_nvfp4_both_s2_bf16<<<grid, 256>>>(b.x, a, scratch);
            tessera_nvfp4_scales_1d<<<dim3((unsigned)((quads + 255) / 256), 2), 256>>>(scratch, M, K, b.sr, b.sr_cols,
                                                                                     b.sc, b.sc_cols);
        });
        report_hashes("1-D two steps (tile kernel + scales kernel)", t, bytes, b.copy_gbs, b.outputs());
    };
    for (int pass = 0; pass < 2; ++pass) {
        run_two_step(tessera_nvfp4_both_2d_bf16, "tile kernel", true);
        run_two_step(two_d_5_ctas, "tile kernel at 5 CTAs per SM", false);
        run_one_d_two_step();
        run(one_step_2d, "2-D one step");
        run(var2d<0>, "2-D harness copy, shipped order");
        run(var2d<1>, "2-D rows stored as encoded");
        run(var2d<2>, "2-D columns first");
        run(var2d<3>, "2-D columns and rows interleaved");
        run(var2d<4>, "2-D no scale flush");
        run(one_step_2d, "2-D rowwise only", false);
        run(tessera_nvfp4_both_bf16, "1-D both shipped");
        run(tessera_nvfp4_both_bf16, "1-D rowwise only (both kernel)", false);
    }
    CK(cudaFree(blk));
    CK(cudaFree(scratch));
}

int main() {
    print_device();
    run_shape(16384, 8192);
    run_shape(4096, 4096);
    // Where two steps start to win (the library's TWO_STEP_2D_MIN_VALUES).
    if (std::getenv("N2_CROSSOVER") != nullptr) {
        run_shape(8192, 8192);
        run_shape(8192, 4096);
        run_shape(4096, 8192);
    }
    return 0;
}
