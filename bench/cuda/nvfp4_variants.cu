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
#include "sm90.cuh"
#include "harness.cuh"
#include "nvfp4.cu"
#include "nvfp4_buffers.cuh"

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

// The RHT + stochastic-rounding both kernel for MINB CTAs per SM (it ships with
// NVFP4_RS_MINB).
template <int MINB>
__global__ void __launch_bounds__(256, MINB) rs_var(const __nv_bfloat16* __restrict__ x, const Nvfp4Args a) {
    nvfp4_both_impl<__nv_bfloat16, true, true>(x, a);
}

// The RHT both kernel (round to nearest) for MINB CTAs per SM.
template <int MINB>
__global__ void __launch_bounds__(256, MINB) rht_var(const __nv_bfloat16* __restrict__ x, const Nvfp4Args a) {
    nvfp4_both_impl<__nv_bfloat16, true, false>(x, a);
}

// The general kernel (every option) for MINB CTAs per SM; it ships with 5.
template <int MINB>
__global__ void __launch_bounds__(256, MINB) general_var(const __nv_bfloat16* __restrict__ x, const Nvfp4Args a) {
    nvfp4_impl<__nv_bfloat16>(x, a);
}

// ---- the both kernel, persistent and pipelined (an experiment; slower on the H200) --------
//
// A grid of resident CTAs walks the tiles in banded order (tile t, t + gridDim.x, ...),
// and each lane copies its 128 bytes of the next tile into shared memory with cp.async
// (zero-filled past the edge) while the current one is quantized: the loads stay in
// flight across the arithmetic, and no registers hold them. A lane reads back only what
// it copied, so cp.async.wait_group alone orders the two. The tables are filled once per
// CTA. Dynamic shared memory: 2 x 32 KiB.

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool valid) {
    const uint32_t s = (uint32_t)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(s), "l"(gmem), "r"(valid ? 16 : 0) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
__device__ __forceinline__ void cp_async_wait1() { asm volatile("cp.async.wait_group 1;" ::: "memory"); }

template <class T>
__device__ void nvfp4_both_pipe_impl(const T* __restrict__ x, const Nvfp4Args a) {
    static_assert(sizeof(T) == 2, "the pipelined kernel takes 2-byte inputs");
    extern __shared__ uint4 buf[];  // [2][8][256]
    __shared__ BothShared sh;
    const BothLane l;
    const uint32_t gx = (uint32_t)((a.m + 127) / 128), gy = (uint32_t)((a.k + 127) / 128);
    const uint32_t hb = band_log2(gx), tiles = (((gx + (1u << hb) - 1u) >> hb) << hb) * gy;
    const u64 row_vectors = a.k * sizeof(T) / 16;
    auto issue = [&](uint32_t t, int b) {
        const TileRC tile = banded_tile(t, hb, gy, tiles);
        const u64 r0 = (u64)tile.row * 128 + l.rt, col = (u64)tile.col * 128 + l.ct;
        const bool valid = r0 < a.m && col < a.k;
        const uint4* src = reinterpret_cast<const uint4*>(x + (valid ? r0 * a.k + col : 0));
#pragma unroll
        for (int i = 0; i < 8; ++i) cp_async16(&buf[(b * 8 + i) * 256 + threadIdx.x], src + i * row_vectors, valid);
    };
    both_tables(sh, a);
    uint32_t t = blockIdx.x;
    if (t < tiles) issue(t, 0);
    cp_async_commit();
    for (int it = 0; t < tiles; ++it, t += gridDim.x) {
        if (t + gridDim.x < tiles) issue(t + gridDim.x, (it + 1) & 1);
        cp_async_commit();
        cp_async_wait1();
        const TileRC tile = banded_tile(t, hb, gy, tiles);
        if (tile.row >= gx) continue;  // padding of the last band (the whole CTA)
        const u64 R0 = (u64)tile.row * 128, C0 = (u64)tile.col * 128;
        const bool valid = R0 + l.rt < a.m && C0 + l.ct < a.k;
        BothTile<T> d;
#pragma unroll
        for (int i = 0; i < 8; ++i) d.u[i][0] = buf[((it & 1) * 8 + i) * 256 + threadIdx.x];
        both_tile<T>(d, l, R0, C0, valid, a, sh);
    }
}

extern "C" __global__ void __launch_bounds__(256, NVFP4_BOTH_MINB)
    tessera_nvfp4_both_pipe_bf16(const __nv_bfloat16* __restrict__ x, const Nvfp4Args a) {
    nvfp4_both_pipe_impl<__nv_bfloat16>(x, a);
}

// ---- the both kernel, persistent, with bulk copies (an experiment) ---------------------
//
// As the cp.async pipeline above, but the next tile arrives through 128 bulk
// asynchronous copies (one per row, one instruction for each of threads 0-127, completing
// on an mbarrier) into one 32 KiB stage (bulk_stage), issued once every lane holds the
// current tile in registers: no per-lane copies, no registers held by the loads in
// flight. Edge tiles load straight from global memory.
template <class T>
__device__ void nvfp4_both_bulk_impl(const T* __restrict__ x, const Nvfp4Args a) {
    static_assert(sizeof(T) == 2, "the bulk kernel takes 2-byte inputs");
    constexpr uint32_t ROW = 128 * sizeof(T);
    uint8_t* stage = bulk_stage();  // [128][ROW]
    __shared__ BothShared sh;
    __shared__ uint64_t bar;
    const BothLane l;
    const int t = threadIdx.x;
    const uint32_t gx = (uint32_t)((a.m + 127) / 128), gy = (uint32_t)((a.k + 127) / 128);
    const uint32_t hb = band_log2(gx), tiles = (((gx + (1u << hb) - 1u) >> hb) << hb) * gy;
    const u64 row_vectors = a.k * sizeof(T) / 16;
    const bool aligned = (reinterpret_cast<uintptr_t>(x) % 16) == 0;
    auto full = [&](TileRC tile) {
        return aligned && (u64)(tile.row + 1) * 128 <= a.m && (u64)(tile.col + 1) * 128 <= a.k;
    };
    auto issue = [&](uint32_t i) {
        const TileRC tile = banded_tile(i, hb, gy, tiles);
        if (!full(tile)) return;
        if (t == 0) mbar_arrive_expect(&bar, 128 * ROW);
        if (t < 128) bulk_load(stage + t * ROW, x + ((u64)tile.row * 128 + t) * a.k + (u64)tile.col * 128, ROW, &bar);
    };
    if (t == 0) mbar_init(&bar, 1);
    both_tables(sh, a);
    __syncthreads();
    uint32_t phase = 0;
    uint32_t i = blockIdx.x;
    if (i < tiles) issue(i);
    for (; i < tiles; i += gridDim.x) {
        const TileRC tile = banded_tile(i, hb, gy, tiles);
        if (tile.row >= gx) continue;  // padding of the last band (the whole CTA; nothing issued)
        const u64 R0 = (u64)tile.row * 128, C0 = (u64)tile.col * 128;
        const bool valid = R0 + l.rt < a.m && C0 + l.ct < a.k;
        BothTile<T> d;
        if (full(tile)) {
            mbar_wait(&bar, phase);
            phase ^= 1;
#pragma unroll
            for (int r = 0; r < 8; ++r) d.u[r][0] = *reinterpret_cast<const uint4*>(stage + (l.rt + r) * ROW + l.ct * sizeof(T));
        } else {
            const uint4* src = reinterpret_cast<const uint4*>(x + (R0 + l.rt) * a.k + C0 + l.ct);
#pragma unroll
            for (int r = 0; r < 8; ++r) d.u[r][0] = valid ? src[r * row_vectors] : make_uint4(0u, 0u, 0u, 0u);
        }
        __syncthreads();  // every lane holds its tile: the stage may be refilled
        if (t == 0) asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
        if (i + gridDim.x < tiles) issue(i + gridDim.x);
        both_tile<T>(d, l, R0, C0, valid, a, sh);
    }
}

template <int MINB>
__global__ void __launch_bounds__(256, MINB) both_bulk(const __nv_bfloat16* __restrict__ x, const Nvfp4Args a) {
    nvfp4_both_bulk_impl<__nv_bfloat16>(x, a);
}

// ---- the both kernel with the next tile prefetched into L2 (experiments) ----------------
//
// The both kernel's CTA loads its tile, then computes with few warps: the DRAM latency of
// the load phase is not hidden by the CTA's own work. Two ways to start the fetch early
// without registers: a CTA that walks NT tiles of its band column (tables filled once)
// and prefetches tile t + 1 into L2 before quantizing tile t (`both_multi`), and the
// shipped one-tile CTA prefetching the tile of the CTA launched W after it (`both_ahead`).

// Each of the 256 threads prefetches 128 bytes (half a row) of the 128x128 tile at (R0, C0).
__device__ __forceinline__ void prefetch_tile_l2(const __nv_bfloat16* x, const Nvfp4Args& a, u64 R0, u64 C0) {
    const u64 r = R0 + threadIdx.x / 2, c = C0 + 64 * (threadIdx.x % 2);
    if (r < a.m && c < a.k) {
        const u64 bytes = a.k - c >= 64 ? 128 : (a.k - c) * 2;
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(x + r * a.k + c), "r"((uint32_t)bytes)
                     : "memory");
    }
}

template <int NT, bool PF>
__global__ void __launch_bounds__(256, NVFP4_BOTH_MINB) both_multi(const __nv_bfloat16* __restrict__ x, const Nvfp4Args a) {
    using T = __nv_bfloat16;
    const BothLane l;
    const uint32_t hb = band_log2((uint32_t)((a.m + 127) / 128));
    const uint32_t band = gridDim.y - 1u - blockIdx.y, X = (gridDim.x - 1u - blockIdx.x) * NT;
    __shared__ BothShared sh;
    const u64 row_vectors = a.k * sizeof(T) / 16;
    bool first = true;
#pragma unroll 1
    for (int t = NT - 1; t >= 0; --t) {
        const TileRC tile = band_tile(band, X + t, hb);
        const u64 R0 = (u64)tile.row * 128, C0 = (u64)tile.col * 128;
        if (R0 >= a.m) continue;
        const u64 r0 = R0 + l.rt, col = C0 + l.ct;
        const bool valid = r0 < a.m && col < a.k;
        BothTile<T> d;
        const uint4* src = reinterpret_cast<const uint4*>(x + r0 * a.k + col);
#pragma unroll
        for (int i = 0; i < 8; ++i) d.u[i][0] = valid ? src[i * row_vectors] : make_uint4(0u, 0u, 0u, 0u);
        if (PF && t > 0) {
            const TileRC n = band_tile(band, X + t - 1, hb);
            prefetch_tile_l2(x, a, (u64)n.row * 128, (u64)n.col * 128);
        }
        if (first) {
            pdl_wait();
            both_tables(sh, a);
            first = false;
        }
        both_tile<T>(d, l, R0, C0, valid, a, sh);
    }
}

template <int W>
__global__ void __launch_bounds__(256, NVFP4_BOTH_MINB) both_ahead(const __nv_bfloat16* __restrict__ x, const Nvfp4Args a) {
    const uint32_t lin = blockIdx.y * gridDim.x + blockIdx.x + W;
    if (lin < gridDim.x * gridDim.y) {
        const uint32_t by = lin / gridDim.x, bx = lin - by * gridDim.x;
        const TileRC n = band_tile(gridDim.y - 1u - by, gridDim.x - 1u - bx, band_log2((uint32_t)((a.m + 127) / 128)));
        prefetch_tile_l2(x, a, (u64)n.row * 128, (u64)n.col * 128);
    }
    nvfp4_both_impl<__nv_bfloat16>(x, a);
}

static void run_shape(u64 M, u64 K, int normal) {
    const Nvfp4Buffers b(M, K, normal != 0);
    const u64 n = b.n;
    const double copy_gbs = b.copy_gbs;
    __nv_bfloat16* x = b.x;
    uint8_t *q = b.q, *qt = b.qt, *sr = b.sr, *sc = b.sc;
    float* amax = b.amax;
    const unsigned amax_grid = b.amax_grid;
    const float ms_a = time_ms([&] {
        CK(cudaMemsetAsync(amax, 0, 4));
        tessera_amax_bf16<<<amax_grid, 256>>>(x, n, amax);
    });
    std::printf("%-40s %8.4f ms %8.1f GB/s %6.3f of copy\n", "amax (memset + kernel)", ms_a, 2.0 * n / ms_a / 1e6,
                2.0 * n / ms_a / 1e6 / copy_gbs);
    auto clear = [&] { b.clear(); };
    const u64 sr_cols = b.sr_cols;
    const double in = 2.0 * n, ob = n / 2.0 + n / 16.0;
    auto args = [&](const float* amax_col, bool both) { return b.args(amax_col, both); };
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
            Nvfp4Args a = args(amax, both != 0);
            a.swizzled = swz;
            float ms = time_ms([&] { tessera_nvfp4_bf16<<<((M + 63) / 64) * ((K + 63) / 64), 256>>>(x, a); });
            std::snprintf(name, sizeof name, "shipped %s%s", both ? "both" : "rowwise", swz ? " swz" : "");
            report(name, ms);
            if (!both) {
                auto row = [&](auto kernel, int B, const char* label) {
                    clear();
                    const u64 ct = (K + 256 * B - 1) / (256 * B);
                    const float t = time_ms([&] { kernel<<<(M / 16) * ct, 256>>>(x, M, K, amax, q, sr, sr_cols, swz, ct); });
                    std::snprintf(name, sizeof name, "%s%s", label, swz ? " swz" : "");
                    report(name, t);
                };
                row(row_var<1>, 1, "row 16x256 (1 block/thread)");
                row(tessera_nvfp4_row_bf16, NVFP4_ROW_BLOCKS, "row shipped (NVFP4_ROW_BLOCKS/thread)");
                row(row_var<4>, 4, "row 16x1024 (4 blocks/thread)");
            } else {
                // 128x128 tiles in bands (banded_grid in crates/quant/src/cuda/mod.rs).
                u64 h = 1;
                const dim3 grid = b.both_grid(&h);
                auto both_run = [&](auto kernel, const char* label) {
                    clear();
                    const float t = time_ms([&] { kernel<<<grid, 256>>>(x, a); });
                    std::snprintf(name, sizeof name, "%s%s", label, swz ? " swz" : "");
                    report(name, t);
                };
                both_run(both_var<2>, "both warp 32x64, 2 CTAs/SM");
                both_run(tessera_nvfp4_both_bf16, "both shipped (NVFP4_BOTH_MINB CTAs/SM)");
                both_run(both_var<4>, "both warp 32x64, 4 CTAs/SM");
                both_run(both_var<5>, "both warp 32x64, 5 CTAs/SM");
                auto multi_run = [&](auto kernel, unsigned nt, const char* label) {
                    if (h % nt != 0) return;
                    clear();
                    const dim3 g(grid.x / nt, grid.y);
                    const float t = time_ms([&] { kernel<<<g, 256>>>(x, a); });
                    std::snprintf(name, sizeof name, "%s%s", label, swz ? " swz" : "");
                    report(name, t);
                };
                multi_run(both_multi<1, false>, 1, "both multi 1 tile/CTA");
                multi_run(both_multi<2, false>, 2, "both multi 2 tiles/CTA");
                multi_run(both_multi<2, true>, 2, "both multi 2 tiles/CTA, L2 prefetch");
                multi_run(both_multi<4, false>, 4, "both multi 4 tiles/CTA");
                multi_run(both_multi<4, true>, 4, "both multi 4 tiles/CTA, L2 prefetch");
                multi_run(both_multi<8, true>, 8, "both multi 8 tiles/CTA, L2 prefetch");
                both_run(both_ahead<264>, "both, prefetch 264 CTAs ahead");
                both_run(both_ahead<528>, "both, prefetch 528 CTAs ahead");
                both_run(both_ahead<1056>, "both, prefetch 1056 CTAs ahead");
                both_run(tessera_nvfp4_both_bf16, "both shipped, again");
                // Persistent, cp.async-pipelined: resident CTAs only, 64 KiB of
                // dynamic shared memory each.
                const int pipe_smem = 2 * 8 * 256 * 16;
                int per_sm = 0;
                const unsigned pipe_grid =
                    persistent_grid(tessera_nvfp4_both_pipe_bf16, pipe_smem, (u64)grid.x * grid.y, &per_sm);
                clear();
                const float tpk = time_ms([&] { tessera_nvfp4_both_pipe_bf16<<<pipe_grid, 256, pipe_smem>>>(x, a); });
                std::snprintf(name, sizeof name, "both pipelined (%d CTAs/SM)%s", per_sm, swz ? " swz" : "");
                report(name, tpk);
                // Persistent with bulk copies: 32 KiB of dynamic shared memory a CTA.
                auto bulk_run = [&](auto kernel, const char* label) {
                    const int smem = 128 * 256 + BULK_STAGE_SLACK;
                    int per = 0;
                    const unsigned g = persistent_grid(kernel, smem, (u64)grid.x * grid.y, &per);
                    clear();
                    const float tb = time_ms([&] { kernel<<<g, 256, smem>>>(x, a); });
                    std::snprintf(name, sizeof name, "%s (%d CTAs/SM)%s", label, per, swz ? " swz" : "");
                    report(name, tb);
                };
                bulk_run(both_bulk<4>, "both bulk-pipelined");
                bulk_run(both_bulk<3>, "both bulk-pipelined");
                bulk_run(both_bulk<2>, "both bulk-pipelined");
                // The quantizer's sequence, timed as one: the amax pass, then the kernel
                // (which may find the amax pass's last reads in L2).
                const double floor_ms = (in + in + 2 * ob) / copy_gbs / 1e6;
                for (int pipe = 0; pipe < 4; ++pipe) {
                    clear();
                    const float tp = time_ms([&] {
                        // pipe 3 leaves the amax as the last launch left it (the same input's:
                        // atomicMax gives the same value), to time the memset.
                        if (pipe != 3) CK(cudaMemsetAsync(amax, 0, 4));
                        tessera_amax_bf16<<<amax_grid, 256>>>(x, n, amax);
                        if (pipe == 1)
                            tessera_nvfp4_both_pipe_bf16<<<pipe_grid, 256, pipe_smem>>>(x, a);
                        else if (pipe >= 2)
                            launch_pdl(tessera_nvfp4_both_bf16, grid, dim3(256), (const __nv_bfloat16*)x, a);
                        else
                            tessera_nvfp4_both_bf16<<<grid, 256>>>(x, a);
                    });
                    const char* names[4] = {"pipeline: amax + both", "pipeline: amax + pipelined",
                                            "pipeline: amax + both, PDL", "pipeline: no memset, amax + both, PDL"};
                    char label[64];
                    std::snprintf(label, sizeof label, "%s%s", names[pipe], swz ? " swz" : "");
                    std::printf("%-40s %8.4f ms  %6.3f of two-pass floor  hash %016llx %016llx\n", label, tp,
                                floor_ms / tp, (unsigned long long)fnv(qt, n / 2), (unsigned long long)fnv(sc, n / 16));
                }
            }
        }
    }
    // The RHT + stochastic-rounding recipe's parts: the RHT amax pass (both amaxes; grid
    // as the library's grid_1d: 4 waves of 8 CTAs per SM at most), the general kernel
    // and the RHT / SR both kernels with both usages (all must hash alike), and the
    // quantizer's sequence.
    {
        float* amax_rht;  // [0] rowwise, [1] columnwise (transformed)
        CK(cudaMalloc(&amax_rht, 8));
        const u64 cols = 8;  // RHT_AMAX_COLS for 2-byte types
        const unsigned g_rht = (unsigned)std::min<u64>((M / 16) * (K / cols) / 256 + 1, 4ull * 132 * 8);
        const float t_rht = time_ms([&] {
            CK(cudaMemsetAsync(amax_rht, 0, 8));
            tessera_nvfp4_rht_amax_bf16<<<g_rht, 256>>>(x, M, K, amax_rht, amax_rht + 1);
        });
        std::printf("%-40s %8.4f ms %8.1f GB/s %6.3f of copy\n", "rht amax (memset + kernel)", t_rht,
                    2.0 * n / t_rht / 1e6, 2.0 * n / t_rht / 1e6 / copy_gbs);
        Nvfp4Args a = args(amax_rht + 1, true);
        a.amax_row = amax_rht;
        a.rht = 1;
        a.sr = 1;
        a.seed = 3;
        a.off_col = M * K / 4;
        clear();
        const float t_gen = time_ms([&] { tessera_nvfp4_bf16<<<((M + 63) / 64) * ((K + 63) / 64), 256>>>(x, a); });
        const double bytes = in + 2 * ob;
        std::printf("%-40s %8.4f ms %8.1f GB/s %6.3f of copy  hash %016llx %016llx %016llx %016llx\n",
                    "general kernel, rht + sr, both", t_gen, bytes / t_gen / 1e6, bytes / t_gen / 1e6 / copy_gbs,
                    (unsigned long long)fnv(q, n / 2), (unsigned long long)fnv(sr, n / 16),
                    (unsigned long long)fnv(qt, n / 2), (unsigned long long)fnv(sc, n / 16));
        auto gen = [&](auto kernel, const char* label) {
            clear();
            const float t = time_ms([&] { kernel<<<((M + 63) / 64) * ((K + 63) / 64), 256>>>(x, a); });
            std::printf("%-40s %8.4f ms %8.1f GB/s %6.3f of copy  hash %016llx %016llx %016llx %016llx\n", label, t,
                        bytes / t / 1e6, bytes / t / 1e6 / copy_gbs, (unsigned long long)fnv(q, n / 2),
                        (unsigned long long)fnv(sr, n / 16), (unsigned long long)fnv(qt, n / 2),
                        (unsigned long long)fnv(sc, n / 16));
        };
        const dim3 grid = b.both_grid();
        auto rs = [&](auto kernel, const char* label) {
            clear();
            const float t = time_ms([&] { kernel<<<grid, 256>>>(x, a); });
            std::printf("%-40s %8.4f ms %8.1f GB/s %6.3f of copy  hash %016llx %016llx %016llx %016llx\n", label, t,
                        bytes / t / 1e6, bytes / t / 1e6 / copy_gbs, (unsigned long long)fnv(q, n / 2),
                        (unsigned long long)fnv(sr, n / 16), (unsigned long long)fnv(qt, n / 2),
                        (unsigned long long)fnv(sc, n / 16));
        };
        rs(tessera_nvfp4_both_rht_sr_bf16, "both rht + sr (NVFP4_RS_MINB CTAs/SM)");
        rs(rs_var<2>, "both rht + sr, 2 CTAs/SM");
        rs(rs_var<4>, "both rht + sr, 4 CTAs/SM");
        for (int pdl = 0; pdl < 2; ++pdl) {
            clear();
            const float tp = time_ms([&] {
                CK(cudaMemsetAsync(amax_rht, 0, 8));
                tessera_nvfp4_rht_amax_bf16<<<g_rht, 256>>>(x, M, K, amax_rht, amax_rht + 1);
                if (pdl)
                    launch_pdl(tessera_nvfp4_both_rht_sr_bf16, grid, dim3(256), (const __nv_bfloat16*)x, a);
                else
                    tessera_nvfp4_both_rht_sr_bf16<<<grid, 256>>>(x, a);
            });
            std::printf("%-40s %8.4f ms  %6.3f of two-pass floor  hash %016llx %016llx\n",
                        pdl ? "pipeline: rht amax + both rht + sr, PDL" : "pipeline: rht amax + both rht + sr", tp,
                        (in + in + 2 * ob) / copy_gbs / 1e6 / tp, (unsigned long long)fnv(qt, n / 2),
                        (unsigned long long)fnv(sc, n / 16));
        }
        a.sr = 0;
        gen(tessera_nvfp4_bf16, "general kernel, rht, both");
        rs(tessera_nvfp4_both_rht_bf16, "both rht (round to nearest)");
        rs(rht_var<3>, "both rht, 3 CTAs/SM");
        rs(rht_var<4>, "both rht, 4 CTAs/SM");
        rs(tessera_nvfp4_both_rht_bf16, "both rht (round to nearest), again");
        a.sr = 1;
        a.rht = 0;
        gen(tessera_nvfp4_bf16, "general kernel, sr, both");
        rs(tessera_nvfp4_both_sr_bf16, "both sr (no rht)");
        CK(cudaFree(amax_rht));
    }
}

int main() {
    print_device();
    run_shape(16384, 8192, 1);
    run_shape(16384, 8192, 0);
    run_shape(4096, 4096, 1);
    run_shape(4096 + 16, 4096 + 48, 0);  // ragged against the tiles
    return 0;
}
