// Variants of the FP8 per-tensor rowwise cast with its amax (delayed scaling's cast;
// `tessera_fp8_cast_*` in crates/quant/kernels/fp8.cu), not shipped: steps per thread,
// input loads issued before or after the scale's, and how the CTA folds its amax before
// the one atomic. Every variant's bytes and amax
// are hashed, so each must agree with the shipped kernel. MXFP8 rowwise (no amax) runs
// beside them as the kernel of the same shape and traffic without a reduction.
// Aimed at the rowwise cast at 4096x4096, 0.91 of a copy on an H200 where MXFP8 rowwise
// (same traffic, one tile per CTA, no amax) reaches 0.97-0.99. Written on 2026-12-05;
// no device was lent after it compiled, so it has not run yet.
// Build on the GPU machine:
//   nvcc -O3 -arch=sm_90 -std=c++17 -I crates/quant/kernels bench/cuda/cast_variants.cu -o cv
//   QV_M=4096 QV_K=4096 ./cv; ./cv          (bf16, 16384x8192 unless QV_M / QV_K say)
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "fp8.cu"
#include "mxfp8.cu"

#include "harness.cuh"

static const u64 M = env_dim("QV_M", 16384);
static const u64 K = env_dim("QV_K", 8192);

// How a CTA folds its threads' maxima before thread 0's atomic.
enum Fold {
    kBlockMax = 0,  // block_max: warp shuffles, two barriers (shipped)
    kOneBarrier,    // warp shuffles, lane 0 stores, one barrier, warp 0 folds the 8
    kPerWarp,       // warp shuffles, one atomic per warp, no barrier
};

// The shipped cast with U steps of 16 elements per thread per round, every load of a
// round issued before any is converted; the maximum folded as F says. With Early, the
// first round's loads go out before pdl_wait and the scale's load: the shipped kernel
// waits for the scale (one more memory latency) before it issues any input load, where
// the cast-transpose loads its tile first. (Allowed by launch_params' contract: before
// pdl_wait a kernel after the amax pass may read the input, and an ordinary launch
// starts after the kernel before it anyway.)
template <int U, int F, bool Early>
__global__ void __launch_bounds__(256) cast_var(const __nv_bfloat16* __restrict__ x, uint8_t* __restrict__ q, u64 n,
                                                const Fp8Scale sa, float* __restrict__ scale_inv,
                                                float* __restrict__ amax) {
    using T = __nv_bfloat16;
    union In16 {
        uint4 v[2];
        T e[16];
    };
    __shared__ float smem[32];
    const u64 tid = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    const u64 steps = n / 16, threads = (u64)gridDim.x * blockDim.x;
    auto load = [&](u64 i0, In16* u) {
#pragma unroll
        for (int r = 0; r < U; ++r) {
            const u64 s = i0 + r * threads;
            if (s < steps) {
                u[r].v[0] = reinterpret_cast<const uint4*>(x)[2 * s];
                u[r].v[1] = reinterpret_cast<const uint4*>(x)[2 * s + 1];
            }
        }
    };
    In16 u[U];
    if (Early) load(tid, u);
    pdl_wait();
    const float scale = cast_scale(sa);
    if (tid == 0) scale_inv[0] = __frcp_rn(scale);
    float m = 0.0f;
    for (u64 i0 = tid; i0 < steps; i0 += U * threads) {
        if (!Early || i0 != tid) load(i0, u);
#pragma unroll
        for (int r = 0; r < U; ++r) {
            const u64 s = i0 + r * threads;
            if (s >= steps) break;
            union {
                uint4 v;
                uint16_t h[8];
            } o;
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                const float a = In<T>::f32(u[r].e[2 * j]), b = In<T>::f32(u[r].e[2 * j + 1]);
                m = fmaxf(m, fmaxf(fabsf(a), fabsf(b)));
                o.h[j] = fp8x2<true>(a * scale, b * scale);
            }
            reinterpret_cast<uint4*>(q)[s] = o.v;
        }
    }
    if (amax == nullptr) return;
    if (F == kBlockMax) {
        m = block_max(m, smem);
        if (threadIdx.x == 0) atomic_max_nonneg(amax, m);
    } else if (F == kOneBarrier) {
        m = warp_max(m);
        if ((threadIdx.x & 31) == 0) smem[threadIdx.x >> 5] = m;
        __syncthreads();
        if (threadIdx.x < 32) {
            m = warp_max(threadIdx.x < 8 ? smem[threadIdx.x] : 0.0f);
            if (threadIdx.x == 0) atomic_max_nonneg(amax, m);
        }
    } else {
        m = warp_max(m);
        if ((threadIdx.x & 31) == 0) atomic_max_nonneg(amax, m);
    }
}

int main() {
    const u64 n = M * K;
    const std::vector<uint16_t> h = bf16_input(n);
    Fp8Buffers b(n, h, 3.0f);
    const cudaDeviceProp p = device_props();
    std::printf("%s, %d SMs; bf16 [%llu, %llu]\n", p.name, p.multiProcessorCount, (unsigned long long)M,
                (unsigned long long)K);
    b.time_copy();
    const double bytes = 2.0 * n + n;
    const Fp8Scale sa{b.scale, nullptr, 448.0f, 0.0f, 0, 0};
    const u64 steps = n / 16, cap = 4ull * p.multiProcessorCount * 8;  // grid_1d's cap
    auto run = [&](const char* name, auto kern, int u, bool with_amax) {
        b.clear();
        CK(cudaMemset(b.amax, 0, 4));
        const unsigned g = (unsigned)std::min<u64>((steps + 256 * u - 1) / (256 * u), cap);
        float* am = with_amax ? b.amax : nullptr;
        const float ms = time_ms([&] { kern<<<g, 256>>>(b.x, b.q, n, sa, b.sinv, am); });
        char label[96];
        std::snprintf(label, sizeof label, "%s (%u CTAs)", name, g);
        b.report(label, ms, bytes, {{b.q, n}, {b.amax, 4}});
    };
    for (int pass = 0; pass < 2; ++pass) {
        std::printf("-- pass %d\n", pass);
        run("shipped", tessera_fp8_cast_bf16_e4m3, 1, true);
        run("shipped, no amax", tessera_fp8_cast_bf16_e4m3, 1, false);
        run("1 step, block_max", cast_var<1, kBlockMax, false>, 1, true);
        run("1 step, one barrier", cast_var<1, kOneBarrier, false>, 1, true);
        run("1 step, atomic per warp", cast_var<1, kPerWarp, false>, 1, true);
        run("1 step, early, block_max", cast_var<1, kBlockMax, true>, 1, true);
        run("1 step, early, one barrier", cast_var<1, kOneBarrier, true>, 1, true);
        run("1 step, early, no amax", cast_var<1, kOneBarrier, true>, 1, false);
        run("2 steps, block_max", cast_var<2, kBlockMax, false>, 2, true);
        run("2 steps, one barrier", cast_var<2, kOneBarrier, false>, 2, true);
        run("2 steps, early, one barrier", cast_var<2, kOneBarrier, true>, 2, true);
        run("2 steps, atomic per warp", cast_var<2, kPerWarp, false>, 2, true);
        run("4 steps, one barrier", cast_var<4, kOneBarrier, false>, 4, true);
        run("4 steps, early, one barrier", cast_var<4, kOneBarrier, true>, 4, true);
        run("4 steps, atomic per warp", cast_var<4, kPerWarp, false>, 4, true);
        // MXFP8 rowwise: 32x128 tiles, one per CTA, no amax.
        b.clear();
        const dim3 g((unsigned)((M / 32) * (K / 128)));
        const float ms = time_ms([&] {
            tessera_mxfp8_row_bf16_e4m3<<<g, 256>>>(b.x, M, K, 1.0f / 448.0f, b.q, (uint8_t*)b.sr, K / 32, nullptr,
                                                    nullptr, M / 32, K, 0, 0);
        });
        b.report("mxfp8 rowwise (reference)", ms, bytes + n / 32.0, {{b.q, n}});
    }
    return 0;
}
