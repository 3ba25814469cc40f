// FP8 block scaling with a 128x128 tile split over a cluster of four CTAs (sm_90 thread
// block clusters), against the shipped one-tile-per-CTA kernels: 1x128 both, 128x128
// rowwise and 128x128 both. Build:
//   nvcc -O3 -arch=sm_90 -std=c++17 -I crates/quant/kernels bench/cuda/cluster_variants.cu -o cv
// Run at QV_M x QV_K (default 4096x4096; any shape). Each line prints the time, the ratio
// to cudaMemcpy and FNV-1a hashes of every output; a cluster kernel's hashes must equal
// its tile kernel's.
// The idea: at 4096x4096 the tile kernels (1024 CTAs of 128x128, 2.6 waves of 3 per SM
// on an H200) reach 0.83-0.89 of copy, while the rowwise 1x128 kernel, whose CTAs cover
// 32x128 (4096 CTAs, low registers, many per SM) reaches 0.98. Here each CTA of a
// cluster covers 32 rows of the tile, exactly like the rowwise kernel, and the only
// thing the tile needs across its rows (the 2-D block amax, or the 1-D column amaxes)
// is exchanged through distributed shared memory: each CTA publishes its partial amaxes,
// one cluster barrier, each reads the other three. The transposed bytes of its 32 rows
// (32 bytes of each of the tile's 128 columns) go out through a small shared tile.
// Measured 2026-12-05 (H100 only; BENCHMARKS.md): bit-equal to the tile kernels on every
// shape tried, sanitizer-clean, and slower everywhere. Pulling the partials (a cluster
// barrier, ld.shared::cluster, a second barrier before exit) cost 0.22 of copy on
// 128x128 rowwise; pushing them (st.async into every CTA's mbarrier-guarded inbox) got it
// to 0.93 against the tile kernel's 0.95 at 4096x4096; 1x128 both stays at 0.67-0.77,
// and at 0.85 (tile kernel 0.91) even with the exchange taken out (CV_DIAG=2).
#include <cstdio>
#include <vector>

#include "block.cu"

#include "sm90.cuh"
#include "harness.cuh"

#ifndef CV_MINB
#define CV_MINB 4
#endif
// Diagnostics (wrong bytes, timing only): CV_DIAG=1 keeps the clusters but skips the
// exchange (each CTA uses its own partial amaxes, no cluster barrier); CV_DIAG=2 also
// launches without clusters. Both time the pull form's code path with its exchange
// taken out (the push form sends to other CTAs, which needs clusters).
#ifndef CV_DIAG
#define CV_DIAG 0
#endif
// CV_PUSH=1 (the default without CV_DIAG): each CTA pushes its partials into every
// cluster CTA's shared memory (st.async, completing on the receiver's mbarrier), one
// cluster barrier at the start (split around the loads) so the mbarriers exist;
// CV_PUSH=0: partials published locally, a cluster barrier, then read remotely
// (ld.shared::cluster), and a second barrier before exit.
#ifndef CV_PUSH
#define CV_PUSH (CV_DIAG == 0)
#endif
#if CV_PUSH && CV_DIAG
#error "CV_DIAG times the pull form: build it with CV_PUSH=0"
#endif
#if CV_DIAG == 2
#define CV_CLUSTER
#else
#define CV_CLUSTER __cluster_dims__(4, 1, 1)
#endif

// ---- the exchange's barriers and remote loads (CTA-local stand-ins under CV_DIAG) ----------

// Every thread of the cluster arrives (releasing its shared-memory writes) and waits.
__device__ __forceinline__ void x_sync() {
    if (CV_DIAG) return __syncthreads();
    cluster_arrive();
    cluster_wait();
}
__device__ __forceinline__ void x_arrive() {
    if (!CV_DIAG) cluster_arrive();
}
__device__ __forceinline__ void x_arrive_relaxed() {
    if (!CV_DIAG) cluster_arrive_relaxed();
}
__device__ __forceinline__ void x_wait() {
    if (!CV_DIAG) cluster_wait();
}
__device__ __forceinline__ float x_load(const float* local, uint32_t rank) { return CV_DIAG ? *local : ld_cluster_f32(local, rank); }

__device__ __forceinline__ uint32_t sel4(const uint32_t* w, int i) {
    return i == 0 ? w[0] : i == 1 ? w[1] : i == 2 ? w[2] : w[3];
}

// ---- the kernel ------------------------------------------------------------------------------

// CTA rank (blockIdx.x % 4) of tile blockIdx.x / 4 (row-major over ceil(m/128) x
// ceil(k/128) tiles) covers rows 32*rank .. +31 of it; thread t holds row t/8, 16 columns
// as Tile128 lays them out (col(cg, j)).
template <class T, bool E4M3, bool two_d, bool both>
__global__ void CV_CLUSTER __launch_bounds__(256, CV_MINB)
    block_cluster(const T* __restrict__ x, u64 m, u64 k, float fp8_max, int pow2, float eps, float value_for_inf,
                  uint8_t* __restrict__ q_row, float* __restrict__ s_row, u64 s_row_cols, uint8_t* __restrict__ q_col,
                  float* __restrict__ s_col, u64 s_col_cols) {
    using Tl = Tile128<T>;
    constexpr int V = Tl::V;
    __shared__ float part[128];  // this CTA's partial amaxes: the 128 columns' (1-D), [0] the tile's (2-D)
    __shared__ float colpart[both && !two_d ? 8 : 1][128];
    __shared__ float colscale[both && !two_d ? 128 : 1];
    __shared__ float warpmax[8];
    __shared__ __align__(16) uint32_t trc[both ? 128 : 1][8];  // column c, word w (rows 4w..4w+3) at w ^ swz(c)
    __shared__ float inbox[CV_PUSH ? 4 : 1][two_d ? 1 : 128];  // push: rank q's partials in inbox[q]
    __shared__ uint64_t bar;
    const int t = threadIdx.x, lane = t & 31, warp = t >> 5, cg = t & 7, j4 = lane >> 3;
    if constexpr (CV_PUSH && (two_d || both)) {
        if (t == 0) mbar_init(&bar, 1);
        x_arrive_relaxed();  // waited for just before the first push
    }
    const uint32_t rank = blockIdx.x & 3;  // == %cluster_ctarank: clusters are 4 consecutive CTAs along x
    // The max over the cluster's 4 CTAs of partial i: from the inbox (push) or read from
    // the peers' `part` (pull).
    auto peers_max = [&](int i) {
        if constexpr (CV_PUSH) {
            return fmaxf(fmaxf(inbox[0][i], inbox[1][i]), fmaxf(inbox[2][i], inbox[3][i]));
        } else {
            float v = x_load(&part[i], 0);
#pragma unroll
            for (uint32_t q = 1; q < 4; ++q) v = fmaxf(v, x_load(&part[i], q));
            return v;
        }
    };
    const uint32_t gy = (uint32_t)((k + 127) / 128), tile = blockIdx.x >> 2;
    const u64 mb = tile / gy, kb = tile % gy, m0 = mb * 128, k0 = kb * 128;
    const u64 r = m0 + 32 * rank + (t >> 3);
    Row16<T> row;
    row.load(x, m, k, r, k0, cg);
    float a = row.amax();
    a = fmaxf(a, __shfl_xor_sync(0xFFFFFFFFu, a, 1));
    a = fmaxf(a, __shfl_xor_sync(0xFFFFFFFFu, a, 2));
    a = fmaxf(a, __shfl_xor_sync(0xFFFFFFFFu, a, 4));  // the row's amax
    float s;
    if constexpr (two_d) {
        a = fmaxf(a, __shfl_xor_sync(0xFFFFFFFFu, a, 8));
        a = fmaxf(a, __shfl_xor_sync(0xFFFFFFFFu, a, 16));
        if (lane == 0) warpmax[warp] = a;
        __syncthreads();
        float c = warpmax[0];  // this CTA's partial
#pragma unroll
        for (int w = 1; w < 8; ++w) c = fmaxf(c, warpmax[w]);
        if constexpr (CV_PUSH) {
            x_wait();  // every cluster CTA's mbarrier is initialised
            if (t < 4) st_async_f32(&inbox[rank][0], (uint32_t)t, c, &bar);
            if (t == 0) mbar_arrive_expect(&bar, 4 * 4);
            mbar_wait(&bar, 0);
        } else {
            if (t == 0) part[0] = c;
            x_sync();
        }
        const float ta = peers_max(0);
        if (!CV_PUSH) x_arrive();  // done reading the others' shared memory
        s = scale_from_amax(ta, fp8_max, pow2, eps, value_for_inf);
        if (rank == 0 && t == 0) {
            const float si = __frcp_rn(s);
            s_row[mb * s_row_cols + kb] = si;
            if (both) s_col[kb * s_col_cols + mb] = si;
        }
    } else {
        s = scale_from_amax(a, fp8_max, pow2, eps, value_for_inf);
        if (cg == 0 && r < m) s_row[kb * s_row_cols + r] = __frcp_rn(s);
    }
    uint32_t wr[4];
    row.template fp8<E4M3>(s, wr);
#pragma unroll
    for (int l = 0; l < Tl::L; ++l) store_run<V>(q_row, m, k, r, k0 + Tl::col(cg, l * V), &wr[l * V / 4]);
    if constexpr (both) {
        uint32_t wc[4];
        if constexpr (two_d) {
#pragma unroll
            for (int q = 0; q < 4; ++q) wc[q] = wr[q];
        } else {
            // Column amaxes over the warp's 4 rows, then its 8 warps, then the cluster.
#pragma unroll
            for (int j = 0; j < 16; ++j) {
                float c = fabsf(row.at(j));
                c = fmaxf(c, __shfl_xor_sync(0xFFFFFFFFu, c, 8));
                c = fmaxf(c, __shfl_xor_sync(0xFFFFFFFFu, c, 16));
                if (j4 == 0) colpart[warp][Tl::col(cg, j)] = c;
            }
            __syncthreads();
            float c = 0.0f;  // this CTA's partial of column t
            if (t < 128) {
                c = colpart[0][t];
#pragma unroll
                for (int w = 1; w < 8; ++w) c = fmaxf(c, colpart[w][t]);
            }
            if constexpr (CV_PUSH) {
                x_wait();  // every cluster CTA's mbarrier is initialised
                if (t < 128) {
#pragma unroll
                    for (uint32_t q = 0; q < 4; ++q) st_async_f32(&inbox[rank][t], q, c, &bar);
                }
                if (t == 0) mbar_arrive_expect(&bar, 4 * 128 * 4);
                mbar_wait(&bar, 0);
            } else {
                if (t < 128) part[t] = c;
                x_sync();
            }
            if (t < 128) {
                c = peers_max(t);
                const float cs = scale_from_amax(c, fp8_max, pow2, eps, value_for_inf);
                colscale[t] = cs;
                if (rank == 0 && k0 + t < k) s_col[mb * s_col_cols + k0 + t] = __frcp_rn(cs);
            }
            if (!CV_PUSH) x_arrive();
            __syncthreads();
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                const int c0 = Tl::col(cg, 4 * q);  // columns c0 .. c0 + 3 (runs of V >= 4)
                const uint32_t lo = fp8x2<E4M3>(__fmul_rn(row.at(4 * q), colscale[c0]),
                                                __fmul_rn(row.at(4 * q + 1), colscale[c0 + 1]));
                const uint32_t hi = fp8x2<E4M3>(__fmul_rn(row.at(4 * q + 2), colscale[c0 + 2]),
                                                __fmul_rn(row.at(4 * q + 3), colscale[c0 + 3]));
                wc[q] = lo | (hi << 16);
            }
        }
        // The warp's 4 rows: lanes cg + 8i hold row 4*warp + i. Lane j4 gathers word j4
        // (columns 4*j4 .. +3 of its 16) of the four rows, then transposes the 4x4 bytes.
        uint32_t in[4];
#pragma unroll
        for (int sft = 0; sft < 4; ++sft) {
            const uint32_t v = __shfl_sync(0xFFFFFFFFu, sel4(wc, (j4 + sft) & 3), cg + 8 * ((j4 - sft) & 3));
            const int i = (j4 - sft) & 3;
#pragma unroll
            for (int z = 0; z < 4; ++z)
                if (z == i) in[z] = v;
        }
        uint32_t out[4];
        transpose4x4(in, out);
#pragma unroll
        for (int b = 0; b < 4; ++b) {
            const int c = Tl::col(cg, 4 * j4 + b);
            trc[c][warp ^ ((c >> 2) & 7)] = out[b];
        }
        __syncthreads();
        {
            const int c = t >> 1, h = t & 1, sw = (c >> 2) & 7;
            uint4 v = *reinterpret_cast<const uint4*>(&trc[c][4 * (h ^ (sw >> 2))]);
            if (sw & 1) {
                const uint32_t x0 = v.x, x2 = v.z;
                v.x = v.y, v.y = x0, v.z = v.w, v.w = x2;
            }
            if (sw & 2) {
                const uint32_t x0 = v.x, x1 = v.y;
                v.x = v.z, v.y = v.w, v.z = x0, v.w = x1;
            }
            const u64 gk = k0 + c, gm = m0 + 32 * rank + 16 * h;
            if (gk < k && gm < m) store16_t(q_col, m, gk, gm, v);
        }
    }
    // Pull: the others are done with this CTA's shared memory. (Push: every write into it
    // completed before its mbarrier wait returned.)
    if constexpr (!CV_PUSH && (two_d || both)) x_wait();
}

static const u64 M = env_dim("QV_M", 4096);
static const u64 K = env_dim("QV_K", 4096);

int main() {
    const u64 n = M * K;
    const std::vector<uint16_t> h = bf16_input(n);
    Fp8Buffers b(n, h, 1.0f);
    std::printf("%llu x %llu bf16\n", (unsigned long long)M, (unsigned long long)K);
    b.time_copy();
    const double in = 2.0 * n;
    const u64 gx = (M + 127) / 128, gy = (K + 127) / 128;
    const unsigned tiles = (unsigned)(gx * gy);
    for (int rep = 0; rep < 2; ++rep) {
        for (int mode = 0; mode < 3; ++mode) {  // 1x128 both, 128x128 rowwise, 128x128 both
            const bool two_d = mode > 0, both = mode != 1;
            for (int cl = 0; cl < 2; ++cl) {
                b.clear();
                const u64 src = two_d ? gy : M, scc = two_d ? gx : K;
                uint8_t* qc = both ? b.qt : nullptr;
                float* scp = both ? b.sc : nullptr;
                float ms;
                if (cl) {
                    auto kern = mode == 0   ? block_cluster<__nv_bfloat16, true, false, true>
                                : mode == 1 ? block_cluster<__nv_bfloat16, true, true, false>
                                            : block_cluster<__nv_bfloat16, true, true, true>;
                    ms = time_ms([&] {
                        kern<<<4 * tiles, 256>>>(b.x, M, K, 448.0f, 1, 0.0f, 3.4e38f, b.q, b.sr, src, qc, scp, scc);
                    });
                } else {
                    auto kern = !two_d ? tessera_fp8_block_1d_bf16_e4m3
                                : both ? tessera_fp8_block_2d_bf16_e4m3 : tessera_fp8_block_2d_row_bf16_e4m3;
                    ms = time_ms([&] {
                        kern<<<tiles, 256>>>(b.x, M, K, 448.0f, 1, 0.0f, 3.4e38f, two_d, b.q, b.sr, src, qc, scp, scc);
                    });
                }
                const double sb = two_d ? gx * gy * 4.0 : (double)M * gy * 4.0;
                const double sbc = two_d ? sb : (double)K * gx * 4.0;
                char name[64];
                std::snprintf(name, sizeof name, "fp8 block %s %s, %s", two_d ? "128x128" : "1x128",
                              both ? "both" : "rowwise", cl ? "cluster of 4" : "tiles");
                b.report(name, ms, in + n + sb + (both ? n + sbc : 0),
                         {{b.q, n}, {b.sr, (size_t)sb}, {b.qt, both ? n : 0}, {b.sc, both ? (size_t)sbc : 0}});
            }
        }
    }
    return 0;
}
