// Whether the NVFP4 both kernel (bf16, round to nearest, the fast path) gains from
// overlapping its loads with its arithmetic by construction rather than by chance (not
// shipped). On an H200 the shipped kernel's issue floor (about 105 M warp instructions
// at 16384x8192, 0.100 ms) equals its memory floor (0.101 ms), and with one tile per
// CTA, 4 CTAs per SM, each CTA loads, then computes, then stores: the SM's memory idles
// whenever its CTAs compute together. Here a persistent CTA holds two tiles in
// registers: it quantizes one (both_tile, unchanged) while the loads of its next tile
// are in flight, so every SM always has 2 x 32 KiB of loads outstanding, and the
// encode-scale table is filled once per CTA instead of once per tile. It needs about 32
// more registers a thread: 2 CTAs per SM (at 3, 80 registers, it spills 784 bytes; not
// run). Outputs are hashed against the shipped kernel's (they must be equal).
// Build on the GPU machine:
//   nvcc -O3 -arch=sm_90 -std=c++17 -Xptxas -v -I crates/quant/kernels \
//        bench/cuda/nvfp4_persist.cu -o np && ./np
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "fp8.cu"
#include "harness.cuh"
#include "nvfp4.cu"
#include "nvfp4_buffers.cuh"

// Tile t of the banded order (tile_banded's, forward): bands of 2^hb tile rows, each
// taken tile column by tile column with its rows fastest.
struct Banded {
    uint32_t hb, per_band;
    __device__ TileRC at(uint32_t t) const {
        const uint32_t band = t / per_band, x = t - band * per_band;
        return {(band << hb) + (x & ((1u << hb) - 1u)), x >> hb};
    }
};

// The lane's 8 rows x 8 columns of tile (R0, C0), zeros past the edge.
__device__ __forceinline__ void load_both(BothTile<__nv_bfloat16>& d, const __nv_bfloat16* __restrict__ x,
                                          const Nvfp4Args& a, const BothLane& l, TileRC tile) {
    const u64 r0 = (u64)tile.row * 128 + l.rt, col = (u64)tile.col * 128 + l.ct;
    const bool valid = r0 < a.m && col < a.k;
    const uint4* src = reinterpret_cast<const uint4*>(x + r0 * a.k + col);
    const u64 row_vectors = a.k * 2 / 16;
#pragma unroll
    for (int i = 0; i < 8; ++i) d.u[i][0] = valid ? src[i * row_vectors] : make_uint4(0u, 0u, 0u, 0u);
}

template <int MINB>
__global__ void __launch_bounds__(256, MINB) both_persist(const __nv_bfloat16* __restrict__ x, const Nvfp4Args a) {
    using T = __nv_bfloat16;
    const BothLane l;
    const uint32_t gx = (uint32_t)((a.m + 127) / 128), gy = (uint32_t)((a.k + 127) / 128);
    const uint32_t hb = band_log2(gx);
    const Banded order{hb, gy << hb};
    const uint32_t tiles = ((gx + (1u << hb) - 1u) >> hb) * order.per_band;
    __shared__ BothShared sh;
    uint32_t t = blockIdx.x;
    if (t >= tiles) return;
    // One tile (a CTA-uniform branch, so both_tile's barriers are reached by every
    // thread or by none).
    auto quantize = [&](const BothTile<T>& cur) {
        const TileRC tile = order.at(t);
        const u64 R0 = (u64)tile.row * 128, C0 = (u64)tile.col * 128;
        if (R0 < a.m) {
            const bool valid = R0 + l.rt < a.m && C0 + l.ct < a.k;
            both_tile<T>(cur, l, R0, C0, valid, a, sh);
        }
    };
    if constexpr (MINB >= 4) {
        // Without the second tile: the tables once per CTA, the loads after each tile.
        pdl_wait();
        both_tables(sh, a);
        for (; t < tiles; t += gridDim.x) {
            BothTile<T> d;
            load_both(d, x, a, l, order.at(t));
            quantize(d);
        }
    } else {
        BothTile<T> d0, d1;
        load_both(d0, x, a, l, order.at(t));
        pdl_wait();
        both_tables(sh, a);  // both_tile's first barrier orders it before any read
        // The next tile's loads first, then this one.
        auto step = [&](const BothTile<T>& cur, BothTile<T>& next) {
            const uint32_t tn = t + gridDim.x;
            if (tn < tiles) load_both(next, x, a, l, order.at(tn));
            quantize(cur);
            t = tn;
            return t < tiles;
        };
        while (step(d0, d1) && step(d1, d0)) {
        }
    }
}

static void run_shape(u64 M, u64 K) {
    const Nvfp4Buffers b(M, K, true);
    const u64 n = b.n;
    const double bytes = 2.0 * n + 2 * (n / 2.0 + n / 16.0);
    const dim3 grid = b.both_grid();
    const u64 tiles = (u64)grid.x * grid.y;
    for (int swz = 0; swz < 2; ++swz) {
        Nvfp4Args a = b.args(b.amax, true);
        a.swizzled = swz;
        auto report = [&](const char* label, float t) {
            char name[96];
            std::snprintf(name, sizeof name, "%s%s", label, swz ? ", swizzled" : "");
            report_hashes(name, t, bytes, b.copy_gbs, b.outputs());
        };
        auto shipped = [&] {
            b.clear();
            report("shipped", time_ms([&] { tessera_nvfp4_both_bf16<<<grid, 256>>>(b.x, a); }));
        };
        // cap > 0: at most cap CTAs per SM.
        auto persist = [&](auto kernel, const char* label, int cap) {
            int per_sm = 0;
            unsigned g = persistent_grid(kernel, 0, tiles, &per_sm);
            if (cap > 0 && cap < per_sm) {
                g = g / (unsigned)per_sm * (unsigned)cap;
                per_sm = cap;
            }
            b.clear();
            char name[96];
            std::snprintf(name, sizeof name, "%s, %d/SM", label, per_sm);
            report(name, time_ms([&] { kernel<<<g, 256>>>(b.x, a); }));
        };
        for (int pass = 0; pass < 2; ++pass) {
            shipped();
            persist(both_persist<2>, "persistent, 2 tiles in registers", 0);
            persist(both_persist<4>, "persistent, 1 tile in registers", 0);
        }
    }
}

int main() {
    print_device();
    run_shape(16384, 8192);
    run_shape(4096, 4096);
    return 0;
}
