// The NVFP4 both kernel, persistent, with its next tile streamed into shared memory while
// it quantizes the current one (not shipped; an experiment). The shipped kernel is one
// 128x128 tile per CTA at 4 CTAs per SM (64 registers): a CTA loads, then computes, then
// stores, and on an H200 neither the issue slots nor the memory are busy all the time
// (BENCHMARKS.md). The earlier persistent and pipelined forms (nvfp4_variants.cu,
// nvfp4_persist.cu) spilled at 64 registers (the bulk-copy one 284 bytes) or ran at 2-3
// CTAs per SM. Here nothing but the tile crosses the fast path in registers: the
// iteration count sits in shared memory, the grid's shape comes from the host, the
// thread index is read anew where used (7 spill loads remain in the fast path), the next
// tile's bytes arrive without registers (bulk copies completing on an mbarrier), and the
// encode-scale tables are filled once per CTA. Variants (Pipe<...>): row copies by
// threads 0-127 (cp.async.bulk, 256 bytes each) or one 128x128 box by thread 0 through
// a tensor map (cp.async.bulk.tensor.2d); with or without a proxy fence before each copy;
// no copies (the loop alone); the copy waited for late; %globaltimer stamps. Then the
// quantizer's sequence (amax pass + kernel, plain and programmatic launches) of the
// shipped kernel and the unfenced copies.
// NP_BLOCKED=1 times instead the blocks of tiles whose compact scales leave in whole
// sectors (both_blocked). Shapes that are multiples of 128 only (every tile full); bf16
// inputs that take the fast path everywhere; outputs hashed against the shipped kernel's.
// Build on the GPU machine:
//   nvcc -O3 -arch=sm_90 -std=c++17 -Xptxas -v -I crates/quant/kernels \
//        bench/cuda/nvfp4_pipe.cu -o np && ./np
// With -DDIAG_COUNT and, ahead of crates/quant/kernels on the include path, a copy of
// nvfp4.cu whose both_tile adds 1 to `__device__ unsigned long long g_general_warps`
// (lane 0 of each warp that takes the general path), each line also counts those warps.
#include <cuda.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "fp8.cu"
#include "sm90.cuh"
#include "harness.cuh"
#include "nvfp4.cu"
#include "nvfp4_buffers.cuh"

#ifndef PIPE_MINB
#define PIPE_MINB 4
#endif

// The 2-D box copy of a tile: 128 columns x 128 rows of bf16 at (C0, R0) into dst.
__device__ __forceinline__ void tensor_load(void* dst, const CUtensorMap* map, uint32_t C0, uint32_t R0, uint64_t* b) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];" ::"r"(
            smem_u32(dst)),
        "l"(reinterpret_cast<uint64_t>(map)), "r"(C0), "r"(R0), "r"(smem_u32(b))
        : "memory");
}

// The banded grid's shape, computed on the host (so that the loop carries none of it):
// gx tile rows, gy tile columns, `total` CTAs in all (bands of h tile rows, the last
// padded), hb = log2 h.
struct PipeGrid {
    uint32_t gx, gy, total, hb;
};

// threadIdx.x read anew where it is used: a persistent loop would otherwise keep the
// values derived from it (the lane's place, the flush's addresses) in registers from one
// tile to the next, and at 64 registers those spill.
__device__ __forceinline__ unsigned opaque_tid() {
    unsigned t;
    asm volatile("mov.u32 %0, %%tid.x;" : "=r"(t));
    return t;
}

// flush_both_scales with the thread index read anew.
struct PipeParts : BothParts {
    static __device__ __forceinline__ void flush(const BothScales& s, const Nvfp4Args& a, u64 R0, u64 C0) {
        flush_both_scales(s, a, R0, C0, opaque_tid());
    }
};

// With DIAG_COUNT (and a copy of nvfp4.cu that counts them in g_general_warps), each
// line also says how many warps took the general path in one launch.
static void general_count(const char* name) {
#ifdef DIAG_COUNT
    unsigned long long c = 0;
    CK(cudaDeviceSynchronize());
    CK(cudaMemcpyFromSymbol(&c, g_general_warps, sizeof c));
    std::printf("  %s: %llu warps on the general path a launch\n", name, c);
#else
    (void)name;
#endif
}
static void general_reset() {
#ifdef DIAG_COUNT
    const unsigned long long z = 0;
    CK(cudaMemcpyToSymbol(g_general_warps, &z, sizeof z));
#endif
}

// With P::stamps, thread 0 of each CTA stamps %globaltimer (ns) at the top of each
// iteration, after its wait and after its tile: g_stamps[(cta * STAMP_IT + it) * 3 + k].
constexpr int STAMP_IT = 64;
__device__ unsigned long long* g_stamps;
__device__ __forceinline__ void stamp(uint32_t it, int k) {
    if (threadIdx.x == 0 && it < STAMP_IT) {
        unsigned long long t;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
        g_stamps[((u64)blockIdx.x * STAMP_IT + it) * 3 + k] = t;
    }
}

// How a variant gets its next tile: copied into the stage by threads 0-127 a row each
// (Rows) or by thread 0 as one box (Tensor), or not copied: loaded straight into
// registers at the top of its iteration (Direct, the loop alone).
enum class Copy { Rows, Tensor, Direct };
// A variant: its copy; whether thread 0 issues fence.proxy.async.shared::cta between the
// stage barrier and the next copy (SASS: MEMBAR.ALL.CTA + FENCE.VIEW.ASYNC.S, so it waits
// for thread 0's stores of the tile before; the first H100 run had it in every variant);
// whether the copy is waited for after the tile instead of before it (the tile then read
// from the stage unwaited: wrong bytes; whether a copy completes within a tile's work);
// whether it stamps.
template <Copy C, bool F, bool Late = false, bool Stamps = false> struct Pipe {
    static constexpr Copy copy = C;
    static constexpr bool fence = F, late = Late, stamps = Stamps;
};

template <class P>
__global__ void __launch_bounds__(256, PIPE_MINB) both_pipe(const __nv_bfloat16* __restrict__ x, const Nvfp4Args a,
                                                            const PipeGrid pg, const __grid_constant__ CUtensorMap map) {
    using T = __nv_bfloat16;
    constexpr uint32_t ROW = 128 * sizeof(T);
    constexpr bool copies = P::copy != Copy::Direct;
    __shared__ __align__(128) uint8_t stage[copies ? 128 * ROW : 16];
    __shared__ BothShared sh;
    __shared__ uint64_t bar;
    // Threads 0-127 (rows) or thread 0 (tensor) start the copy of tile n into the stage.
    auto issue = [&](uint32_t n) {
        const TileRC t = banded_tile(n, pg.hb, pg.gy, pg.total);
        if (t.row >= pg.gx) {  // padding of the last band: nothing to load, the phase still completes
            if (threadIdx.x == 0) asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_u32(&bar)) : "memory");
            return;
        }
        if (threadIdx.x == 0) mbar_arrive_expect(&bar, 128 * ROW);
        if constexpr (P::copy == Copy::Tensor) {
            if (threadIdx.x == 0) tensor_load(stage, &map, t.col * 128, t.row * 128, &bar);
        } else {
            if (threadIdx.x < 128)
                bulk_load(stage + threadIdx.x * ROW, x + ((u64)t.row * 128 + threadIdx.x) * a.k + (u64)t.col * 128, ROW,
                          &bar);
        }
    };
    // The iteration count lives in shared memory, not in a register across the tile:
    // read by every thread at the top of an iteration, advanced by thread 0 after the
    // stage barrier (when every thread has read it); both_tile's barriers order that
    // write before the next reads.
    __shared__ uint32_t s_it;
    if (threadIdx.x == 0) {
        mbar_init(&bar, 1);
        s_it = 0;
    }
    __syncthreads();
    if (copies && blockIdx.x < pg.total) issue(blockIdx.x);
    if (P::late) mbar_wait(&bar, 0);
    pdl_wait();
    both_tables(sh, a);  // both_tile's first barrier comes before any read of them
#pragma unroll 1
    for (;;) {
        const uint32_t it = *reinterpret_cast<volatile uint32_t*>(&s_it);
        const uint32_t n = blockIdx.x + it * gridDim.x;
        if (n >= pg.total) break;
        if (P::stamps) stamp(it, 0);
        if (copies && !P::late) mbar_wait(&bar, it & 1u);
        if (P::stamps) stamp(it, 1);
        const BothLane l(opaque_tid());
        BothTile<T> d;
        if constexpr (!copies) {
            const TileRC t = banded_tile(n, pg.hb, pg.gy, pg.total);
            const uint4* src = reinterpret_cast<const uint4*>(x + ((u64)t.row * 128 + l.rt) * a.k + (u64)t.col * 128 + l.ct);
#pragma unroll
            for (int r = 0; r < 8; ++r) d.u[r][0] = src[r * (a.k / 8)];
        } else {
#pragma unroll
            for (int r = 0; r < 8; ++r)
                d.u[r][0] = *reinterpret_cast<const uint4*>(stage + (l.rt + r) * ROW + l.ct * sizeof(T));
        }
        __syncthreads();  // every lane holds its tile (and has read s_it): the stage may be refilled
        if (threadIdx.x == 0) {
            if (P::fence) asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
            *reinterpret_cast<volatile uint32_t*>(&s_it) = it + 1u;
        }
        const bool more = n + gridDim.x < pg.total;
        if (copies && more) issue(n + gridDim.x);
        const TileRC t = banded_tile(n, pg.hb, pg.gy, pg.total);
        if (t.row >= pg.gx) {
            __syncthreads();  // as both_tile would: s_it's write before the next reads
            continue;
        }
        both_tile<T, PipeParts>(d, l, (u64)t.row * 128, (u64)t.col * 128, true, a, sh);
        if (P::late && more) mbar_wait(&bar, (it + 1u) & 1u);
        if (P::stamps) stamp(it, 2);
    }
}

using StampPipe = Pipe<Copy::Tensor, false, false, true>;

// Compact scales in whole sectors (NP_BLOCKED; session 40): a CTA quantizes a block of
// B x B tiles one after another (tiles loaded straight into registers, as the loop alone
// above), collects their scale bytes in shared memory and writes each grid row's 8B
// bytes of the block at the end, 16-byte stores (B = 4: 32 bytes, one whole sector of a
// row; B = 2: half of one). The shipped kernel writes 8-byte pieces, 16 CTAs to a line,
// and on an H200 those hold the compact kernel at about 0.138 ms whatever its
// instructions (BENCHMARKS "What bounds NVFP4 both on an H200"). Swizzled scales keep
// the shipped flush per tile. Shapes: multiples of 128 B.
constexpr int BLK_MAX = 4;
__shared__ uint32_t blk_row[128 * BLK_MAX][2 * BLK_MAX];  // rowwise scale bytes: block row r, tile column tc
__shared__ uint32_t blk_col[128 * BLK_MAX][2 * BLK_MAX];  // columnwise: block column c, tile row tr
template <int B> struct BlockedParts : BothParts {
    static __device__ __forceinline__ void flush(const BothScales& s, const Nvfp4Args& a, u64 R0, u64 C0) {
        const unsigned t = opaque_tid();
        if (a.swizzled) return flush_both_scales(s, a, R0, C0, t);
        const unsigned tr = (unsigned)(R0 / 128) % B, tc = (unsigned)(C0 / 128) % B;
        blk_row[tr * 128 + t / 2][2 * tc + t % 2] = reinterpret_cast<const uint32_t*>(&s.row[t / 2][0])[t % 2];
        blk_col[tc * 128 + t / 2][2 * tr + t % 2] = reinterpret_cast<const uint32_t*>(&s.col[t / 2][0])[t % 2];
    }
};
template <int B>
__global__ void __launch_bounds__(256, 4) both_blocked(const __nv_bfloat16* __restrict__ x, const Nvfp4Args a) {
    using T = __nv_bfloat16;
    __shared__ BothShared sh;
    __shared__ uint32_t s_it;
    if (threadIdx.x == 0) s_it = 0;
    pdl_wait();
    both_tables(sh, a);  // both_tile's first barrier comes before any read of them
    __syncthreads();     // s_it's first value
#pragma unroll 1
    for (;;) {
        const uint32_t it = *reinterpret_cast<volatile uint32_t*>(&s_it);
        if (it >= B * B) break;
        const u64 R0 = ((u64)blockIdx.y * B + it / B) * 128, C0 = ((u64)blockIdx.x * B + it % B) * 128;
        const BothLane l(opaque_tid());
        BothTile<T> d;
        const uint4* src = reinterpret_cast<const uint4*>(x + (R0 + l.rt) * a.k + C0 + l.ct);
#pragma unroll
        for (int r = 0; r < 8; ++r) d.u[r][0] = src[r * (a.k / 8)];
        __syncthreads();  // every thread has read s_it
        if (threadIdx.x == 0) *reinterpret_cast<volatile uint32_t*>(&s_it) = it + 1u;
        both_tile<T, BlockedParts<B>>(d, l, R0, C0, true, a, sh);
    }
    if (a.swizzled) return;
    __syncthreads();  // every tile's bytes are in blk_row / blk_col
    // 128 B rows of 2 B words per grid, 4 words (16 bytes) a store.
    constexpr int per_row = 2 * B / 4, n = 128 * B * per_row;
    for (int i = opaque_tid(); i < 2 * n; i += 256) {
        const bool rows = i < n;
        const int j = rows ? i : i - n, r = j / per_row, q = j % per_row;
        const uint32_t* w = &(rows ? blk_row : blk_col)[r][4 * q];
        const u64 gr = (rows ? (u64)blockIdx.y : (u64)blockIdx.x) * 128 * B + r;
        const u64 gc = (rows ? (u64)blockIdx.x : (u64)blockIdx.y) * 8 * B + 16 * q;
        uint8_t* dst = (rows ? a.s_row : a.s_col) + gr * (rows ? a.s_row_cols : a.s_col_cols) + gc;
        *reinterpret_cast<uint4*>(dst) = make_uint4(w[0], w[1], w[2], w[3]);
    }
}

static CUtensorMap tile_map(const __nv_bfloat16* x, u64 M, u64 K) {
    CUtensorMap m;
    const cuuint64_t dims[2] = {K, M};
    const cuuint64_t strides[1] = {K * 2};
    const cuuint32_t box[2] = {128, 128};
    const cuuint32_t elem[2] = {1, 1};
    // The driver's entry point through the runtime (no -lcuda at link time).
    using Encode = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult q;
    CK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &q));
    if (fn == nullptr) {
        std::printf("no cuTensorMapEncodeTiled\n");
        std::exit(1);
    }
    const CUresult r = reinterpret_cast<Encode>(fn)(&m, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<__nv_bfloat16*>(x),
                                              dims, strides, box, elem, CU_TENSOR_MAP_INTERLEAVE_NONE,
                                              CU_TENSOR_MAP_SWIZZLE_NONE, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                                              CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r != CUDA_SUCCESS) {
        std::printf("cuTensorMapEncodeTiled failed: %d\n", (int)r);
        std::exit(1);
    }
    return m;
}

static void run_shape(u64 M, u64 K) {
    const Nvfp4Buffers b(M, K, true);
    const u64 n = b.n;
    const double bytes = 2.0 * n + 2 * (n / 2.0 + n / 16.0);
    const dim3 grid = b.both_grid();
    const CUtensorMap map = tile_map(b.x, M, K);
    u64 h = 0;
    const dim3 bg = b.both_grid(&h);
    uint32_t hb = 0;
    while ((1ull << hb) < h) ++hb;
    const PipeGrid pg{(uint32_t)(M / 128), (uint32_t)(K / 128), bg.x * bg.y, hb};
    for (int swz = 0; swz < 2; ++swz) {
        Nvfp4Args a = b.args(b.amax, true);
        a.swizzled = swz;
        char name[96];
        auto shipped = [&] {
            b.clear();
            const float t = time_ms([&] { tessera_nvfp4_both_bf16<<<grid, 256>>>(b.x, a); });
            std::snprintf(name, sizeof name, "shipped%s", swz ? ", swizzled" : "");
            report_hashes(name, t, bytes, b.copy_gbs, b.outputs());
            general_reset();
            tessera_nvfp4_both_bf16<<<grid, 256>>>(b.x, a);
            general_count(name);
        };
        auto pipe = [&](auto kernel, const char* label) {
            int per = 0;
            const unsigned g = persistent_grid(kernel, 0, (u64)grid.x * grid.y, &per);
            b.clear();
            const float t = time_ms([&] { kernel<<<g, 256>>>(b.x, a, pg, map); });
            std::snprintf(name, sizeof name, "%s (%d CTAs/SM)%s", label, per, swz ? ", swizzled" : "");
            report_hashes(name, t, bytes, b.copy_gbs, b.outputs());
            general_reset();
            kernel<<<g, 256>>>(b.x, a, pg, map);
            general_count(name);
        };
        auto stamped = [&] {
            int per = 0;
            const unsigned g = persistent_grid(both_pipe<StampPipe>, 0, (u64)grid.x * grid.y, &per);
            const size_t count = (size_t)g * STAMP_IT * 3;
            unsigned long long* d;
            CK(cudaMalloc(&d, count * 8));
            CK(cudaMemset(d, 0, count * 8));
            CK(cudaMemcpyToSymbol(g_stamps, &d, sizeof d));
            both_pipe<StampPipe><<<g, 256>>>(b.x, a, pg, map);  // warm
            CK(cudaMemset(d, 0, count * 8));
            both_pipe<StampPipe><<<g, 256>>>(b.x, a, pg, map);
            CK(cudaDeviceSynchronize());
            std::vector<unsigned long long> h(count);
            CK(cudaMemcpy(h.data(), d, count * 8, cudaMemcpyDeviceToHost));
            CK(cudaFree(d));
            unsigned long long t_min = ~0ull, t_max = 0;
            double wait = 0, work = 0, first_wait = 0;
            std::vector<double> waits;
            long iters = 0;
            for (unsigned c = 0; c < g; ++c)
                for (int i = 0; i < STAMP_IT; ++i) {
                    const unsigned long long* r = &h[((size_t)c * STAMP_IT + i) * 3];
                    if (r[0] == 0) break;
                    t_min = std::min(t_min, r[0]);
                    t_max = std::max(t_max, r[2]);
                    if (i == 0) first_wait += r[1] - r[0];
                    else wait += r[1] - r[0];
                    work += r[2] - r[1];
                    ++iters;
                }
            std::printf("  stamped (tensor copy): %ld iterations of %u CTAs over %.1f us; a tile's work %.2f us, "
                        "wait for a later tile %.2f us, for the first %.2f us (means)\n",
                        iters, g, (t_max - t_min) / 1e3, work / iters / 1e3, wait / std::max<long>(1, iters - g) / 1e3,
                        first_wait / g / 1e3);
        };
        // The quantizer's sequence, timed as one: the amax pass (memset + kernel), then the
        // kernel, plainly or as a programmatic launch (the library's order), whose first
        // tiles are the amax pass's last reads; of the two-pass floor (the input read
        // twice, the outputs written once, at the copy's rate).
        auto sequence = [&](auto kernel, dim3 g, bool pdl, const char* label, auto... extra) {
            b.clear();
            const float t = time_ms([&] {
                CK(cudaMemsetAsync(b.amax, 0, 4));
                tessera_amax_bf16<<<b.amax_grid, 256>>>(b.x, n, b.amax);
                if (pdl) launch_pdl(kernel, g, dim3(256), (const __nv_bfloat16*)b.x, a, extra...);
                else kernel<<<g, 256>>>(b.x, a, extra...);
            });
            const double floor_ms = (2.0 * n + bytes) / b.copy_gbs / 1e6;
            std::snprintf(name, sizeof name, "amax + %s%s", label, swz ? ", swizzled" : "");
            std::printf("%-40s %8.4f ms  %6.3f of two-pass floor  hash %016llx %016llx\n", name, t, floor_ms / t,
                        (unsigned long long)fnv(b.qt, n / 2), (unsigned long long)fnv(b.sc, n / 16));
        };
        auto sequences = [&] {
            using Rows = Pipe<Copy::Rows, false>;
            using Tensor = Pipe<Copy::Tensor, false>;
            const dim3 gr(persistent_grid(both_pipe<Rows>, 0, (u64)grid.x * grid.y));
            const dim3 gt(persistent_grid(both_pipe<Tensor>, 0, (u64)grid.x * grid.y));
            for (int pdl = 0; pdl < 2; ++pdl) {
                sequence(tessera_nvfp4_both_bf16, grid, pdl, pdl ? "shipped, PDL" : "shipped");
                sequence(both_pipe<Rows>, gr, pdl, pdl ? "row copies, PDL" : "row copies", pg, map);
                sequence(both_pipe<Tensor>, gt, pdl, pdl ? "tensor copy, PDL" : "tensor copy", pg, map);
            }
        };
        if (std::getenv("NP_BLOCKED") != nullptr) {
            // both_blocked<B>'s grid: a CTA a block of B x B tiles.
            auto blocked_grid = [&](int B) { return dim3((unsigned)(K / 128 / B), (unsigned)(M / 128 / B)); };
            auto blocked = [&](auto kernel, int B, const char* label) {
                const dim3 g = blocked_grid(B);
                b.clear();
                const float t = time_ms([&] { kernel<<<g, 256>>>(b.x, a); });
                std::snprintf(name, sizeof name, "%s (%u CTAs)%s", label, g.x * g.y, swz ? ", swizzled" : "");
                report_hashes(name, t, bytes, b.copy_gbs, b.outputs());
            };
            for (int pass = 0; pass < 3; ++pass) {
                shipped();
                pipe(both_pipe<Pipe<Copy::Direct, false>>, "no copies (the loop alone)");
                blocked(both_blocked<2>, 2, "blocks of 2x2 tiles");
                blocked(both_blocked<4>, 4, "blocks of 4x4 tiles");
            }
            for (int pdl = 0; pdl < 2; ++pdl) {
                sequence(tessera_nvfp4_both_bf16, grid, pdl, pdl ? "shipped, PDL" : "shipped");
                sequence(both_blocked<2>, blocked_grid(2), pdl, pdl ? "blocks of 2x2, PDL" : "blocks of 2x2");
                sequence(both_blocked<4>, blocked_grid(4), pdl, pdl ? "blocks of 4x4, PDL" : "blocks of 4x4");
            }
            continue;
        }
        for (int pass = 0; pass < 2; ++pass) {
            shipped();
            pipe(both_pipe<Pipe<Copy::Rows, true>>, "row copies, fence");
            pipe(both_pipe<Pipe<Copy::Tensor, true>>, "tensor copy, fence");
            pipe(both_pipe<Pipe<Copy::Rows, false>>, "row copies");
            pipe(both_pipe<Pipe<Copy::Tensor, false>>, "tensor copy");
            pipe(both_pipe<Pipe<Copy::Direct, false>>, "no copies (the loop alone)");
            pipe(both_pipe<Pipe<Copy::Tensor, false, true>>, "tensor copy waited late (wrong bytes)");
            if (pass == 0) {
                stamped();
                sequences();
            }
        }
    }
}

int main() {
    print_device();
    run_shape(env_dim("NP_M", 16384), env_dim("NP_K", 8192));
    run_shape(4096, 4096);
    return 0;
}
