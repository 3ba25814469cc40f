// Persistent 128x128-tile kernels whose next tile streams into shared memory through bulk
// asynchronous copies (cp.async.bulk, completing on an mbarrier) while the current tile is
// quantized from registers, against the shipped one-tile-per-CTA kernels: FP8 block 1x128
// both, 128x128 rowwise and both, and the FP8 cast-transpose. Build:
//   nvcc -O3 -arch=sm_90 -std=c++17 -I crates/quant/kernels bench/cuda/pipeline_variants.cu -o pv
// Run at QV_M x QV_K (multiples of 128; default 4096x4096). Each line prints the time, the
// ratio to cudaMemcpy and FNV-1a hashes of every output; a pipelined kernel's hashes must
// equal its tile kernel's.
// The idea: the tile kernels load a whole tile, then compute, then store; at 4096x4096
// (2.6 waves of 3 CTAs per SM) the CTAs of a wave run in step, so HBM idles while they
// compute. Here a CTA issues the next tile's loads (one bulk copy per row, issued by 128
// threads: one instruction each, no registers held) before it quantizes the current one.
// 2026-12-05: the first builds stopped with CUDA_ERROR_MISALIGNED_ADDRESS; the cause was
// Transposed128 (common.cuh), 4-byte aligned and read as uint4, which the pipeline's
// mbarrier pushed 8 bytes past a 16-byte boundary; it is 16-byte aligned now. Measured
// (H100, BENCHMARKS.md): correct, and slower than the tile kernels at every shape.
#include <cstdio>
#include <vector>

#include "block.cu"
#include "fp8.cu"

#include "sm90.cuh"
#include "harness.cuh"

// Launch bound of the pipelined kernels (minimum CTAs per SM).
#ifndef PV_MINB
#define PV_MINB 3
#endif

// ---- the persistent pipeline --------------------------------------------------------------

// Tile i of a grid with gy tile columns, row-major; `op(x4, m0, k0)` quantizes it.
// Full tiles (and rows 16-byte aligned) come through the shared stage; edge tiles load
// straight from global memory.
template <class T, class Op>
__device__ void pipeline(const T* __restrict__ x, u64 m, u64 k, Op op) {
    using Tl = Tile128<T>;
    constexpr int V = Tl::V;
    constexpr uint32_t ROW = 128 * sizeof(T);
    uint8_t* stage = bulk_stage();
    __shared__ uint64_t bar;
    const int t = threadIdx.x, rg = t >> 3, cg = t & 7;
    const u64 gy = (k + 127) / 128, gx = (m + 127) / 128;
    const uint32_t tiles = (uint32_t)(gx * gy);
    const bool aligned = (k % V) == 0 && (reinterpret_cast<uintptr_t>(x) % 16) == 0;
    auto full = [&](uint32_t i) { return aligned && (i / (uint32_t)gy + 1) * 128 <= m && (i % (uint32_t)gy + 1) * 128 <= k; };
    auto issue = [&](uint32_t i) {
        if (!full(i)) return;
        const u64 m0 = (u64)(i / (uint32_t)gy) * 128, k0 = (u64)(i % (uint32_t)gy) * 128;
        if (t == 0) mbar_arrive_expect(&bar, 128 * ROW);
        if (t < 128) bulk_load(stage + t * ROW, x + (m0 + t) * k + k0, ROW, &bar);
    };
    if (t == 0) mbar_init(&bar, 1);
    __syncthreads();
    uint32_t phase = 0;
    uint32_t i = blockIdx.x;
    if (i < tiles) issue(i);
    for (; i < tiles; i += gridDim.x) {
        const u64 m0 = (u64)(i / (uint32_t)gy) * 128, k0 = (u64)(i % (uint32_t)gy) * 128;
        Tl x4;
        if (full(i)) {
            mbar_wait(&bar, phase);
            phase ^= 1;
#pragma unroll
            for (int r = 0; r < 4; ++r)
#pragma unroll
                for (int l = 0; l < Tl::L; ++l)
                    x4.d.u[r][l] = *reinterpret_cast<const uint4*>(stage + (4 * rg + r) * ROW + (l * 8 * V + cg * V) * sizeof(T));
        } else {
            x4.load(x, m, k, m0, k0, rg, cg);
        }
        __syncthreads();  // every thread has its tile: the stage may be refilled
        if (t == 0) asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
        if (i + gridDim.x < tiles) issue(i + gridDim.x);
        op(x4, m0, k0);
    }
}

template <class T, bool E4M3, bool two_d>
__global__ void __launch_bounds__(256, PV_MINB)
    block_pipe(const T* __restrict__ x, u64 m, u64 k, float fp8_max, int pow2, float eps, float value_for_inf,
               uint8_t* q_row, float* s_row, u64 s_row_cols, uint8_t* q_col, float* s_col, u64 s_col_cols) {
    const auto sh = block_shared<T>();
    const BlockArgs p{m, k, fp8_max, pow2, eps, value_for_inf, q_row, s_row, s_row_cols, q_col, s_col, s_col_cols};
    pipeline<T>(x, m, k, [&](const Tile128<T>& x4, u64 m0, u64 k0) { block_tile<T, E4M3, two_d, false>(x4, m0, k0, p, sh); });
}

template <class T, bool E4M3>
__global__ void __launch_bounds__(256, PV_MINB)
    cast_transpose_pipe(const T* __restrict__ x, uint8_t* q, uint8_t* qt, u64 m, u64 k, const Fp8Scale sa,
                        float* scale_inv, float* amax) {
    const float scale = cast_scale(sa);
    if (blockIdx.x == 0 && threadIdx.x == 0) scale_inv[0] = __frcp_rn(scale);
    __shared__ Transposed128<Tile128<T>::V> tr;
    __shared__ float warp_amax[8];
    pipeline<T>(x, m, k, [&](const Tile128<T>& x4, u64 m0, u64 k0) {
        cast_transpose_tile<T, E4M3, false>(x4, m0, k0, q, qt, m, k, scale, amax, tr, warp_amax);
    });
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
    std::printf("%llu x %llu bf16\n", (unsigned long long)M, (unsigned long long)K);
    b.time_copy();
    const double in = 2.0 * n;
    const unsigned tiles = (unsigned)(((M + 127) / 128) * ((K + 127) / 128));
    const size_t stage = 128 * 128 * 2 + BULK_STAGE_SLACK;
    for (int rep = 0; rep < 2; ++rep) {
        // FP8 block scaling: (1x128 both), (128x128 rowwise), (128x128 both); tiles, then pipelined.
        for (int mode = 0; mode < 3; ++mode) {
            const bool two_d = mode > 0, both = mode != 1;
            for (int pipe = 0; pipe < 2; ++pipe) {
                b.clear();
                const u64 src = two_d ? (K + 127) / 128 : M, scc = two_d ? (M + 127) / 128 : K;
                uint8_t* qc = both ? qt : nullptr;
                float* scp = both ? sc : nullptr;
                float ms;
                if (pipe) {
                    auto kern = two_d ? block_pipe<__nv_bfloat16, true, true> : block_pipe<__nv_bfloat16, true, false>;
                    const unsigned grid = persistent_grid(kern, stage, tiles);
                    if (rep == 0 && mode == 0) std::printf("persistent grid %u CTAs for %u tiles\n", grid, tiles);
                    ms = time_ms([&] {
                        kern<<<grid, 256, stage>>>(x, M, K, 448.0f, 1, 0.0f, 3.4e38f, q, sr, src, qc, scp, scc);
                    });
                } else {
                    auto kern = !two_d ? tessera_fp8_block_1d_bf16_e4m3
                                : both ? tessera_fp8_block_2d_bf16_e4m3 : tessera_fp8_block_2d_row_bf16_e4m3;
                    ms = time_ms([&] {
                        kern<<<tiles, 256>>>(x, M, K, 448.0f, 1, 0.0f, 3.4e38f, two_d, q, sr, src, qc, scp, scc);
                    });
                }
                const double sb = two_d ? ((M + 127) / 128) * ((K + 127) / 128) * 4.0 : (double)M * ((K + 127) / 128) * 4.0;
                const double sbc = two_d ? sb : (double)K * ((M + 127) / 128) * 4.0;
                char name[64];
                std::snprintf(name, sizeof name, "fp8 block %s %s, %s", two_d ? "128x128" : "1x128",
                              both ? "both" : "rowwise", pipe ? "pipelined" : "tiles");
                b.report(name, ms, in + n + sb + (both ? n + sbc : 0),
                       {{q, n}, {sr, (size_t)sb}, {qt, both ? n : 0}, {sc, both ? (size_t)sbc : 0}});
            }
        }
        // Cast-transpose with a given scale (delayed scaling), with the amax.
        const Fp8Scale del{scale, nullptr, 448.0f, 0.0f, 0, 0};
        for (int pipe = 0; pipe < 2; ++pipe) {
            b.clear();
            CK(cudaMemset(amax, 0, 4));
            float ms;
            if (pipe) {
                auto kern = cast_transpose_pipe<__nv_bfloat16, true>;
                const unsigned grid = persistent_grid(kern, stage, tiles);
                ms = time_ms([&] { kern<<<grid, 256, stage>>>(x, q, qt, M, K, del, sinv, amax); });
            } else {
                ms = time_ms([&] { tessera_fp8_cast_transpose_bf16_e4m3<<<tiles, 256>>>(x, q, qt, M, K, del, sinv, amax); });
            }
            b.report(pipe ? "fp8 cast both + amax, pipelined" : "fp8 cast both + amax, tiles", ms, in + 2.0 * n,
                   {{q, n}, {qt, n}, {amax, 4}});
        }
    }
    return 0;
}
