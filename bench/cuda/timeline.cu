// Where the time of a short tile kernel goes (not shipped): the FP8 block kernels of the
// library, and two copies built like them, each launched once more with a stamp per CTA
// (%globaltimer when its first thread starts and when its last thread is done, and its
// SM). From the stamps it prints, per kernel: the span against the CUDA-event time, how
// long the CTAs of the first, middle and last waves took, and a profile over the span of
// the CTAs in flight and the bandwidth they imply (each CTA's bytes spread evenly over
// its life). Build and run:
//   nvcc -O3 -arch=sm_90 -std=c++17 -I crates/quant/kernels bench/cuda/timeline.cu -o tl
//   QV_M=4096 QV_K=4096 ./tl
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "block.cu"

#include "harness.cuh"

static const u64 M = env_dim("QV_M", 4096);
static const u64 K = env_dim("QV_K", 4096);

// One CTA's life: first thread in, last thread out (ns of %globaltimer), and its SM.
struct Stamp {
    u64 t0, t1;
    uint32_t sm, pad;
};

__device__ __forceinline__ u64 global_ns() {
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
__device__ __forceinline__ uint32_t sm_id() {
    uint32_t s;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(s));
    return s;
}

// Stamps the CTA's start (thread 0, before `body`) and end (after every thread is through
// `body`), when st is not null. Every thread must return from body.
template <class F> __device__ __forceinline__ void stamped(Stamp* st, F body) {
    u64 t0 = 0;
    if (st != nullptr && threadIdx.x == 0) t0 = global_ns();
    body();
    if (st == nullptr) return;
    __syncthreads();
    if (threadIdx.x == 0) st[blockIdx.x] = Stamp{t0, global_ns(), sm_id(), 0};
}

// Copies built like the tile kernels: a CTA loads 32 KiB (256 threads x 8 16-byte loads,
// each row group of 8 lanes reading 128 contiguous bytes), then stores all of it
// (`half` = false) or half of it, every stored word depending on two loaded ones (the
// bytes of a rowwise-only FP8 tile kernel, with no arithmetic and no barrier).
template <bool half>
__global__ void __launch_bounds__(256, TQ_MINB_BLOCK_2D) tl_copy(const uint4* __restrict__ x, uint4* __restrict__ y, Stamp* st) {
    stamped(st, [&] {
        const u64 base = (u64)blockIdx.x * 2048;
        uint4 v[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) v[i] = x[base + i * 256 + threadIdx.x];
        if (half) {
            const u64 ob = (u64)blockIdx.x * 1024;
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const uint4 a = v[2 * i], b = v[2 * i + 1];
                y[ob + i * 256 + threadIdx.x] = make_uint4(a.x ^ b.x, a.y ^ b.y, a.z ^ b.z, a.w ^ b.w);
            }
        } else {
#pragma unroll
            for (int i = 0; i < 8; ++i) y[base + i * 256 + threadIdx.x] = v[i];
        }
    });
}

// The library's FP8 block kernels (bf16, E4M3, power-of-two scales), stamped; the
// recipe fields of their BlockArgs are filled in here.
struct TlBlock {
    const __nv_bfloat16* x;
    BlockArgs p;
};
static TlBlock tl_block(const __nv_bfloat16* x, u64 m, u64 k, uint8_t* q_row, float* s_row, u64 s_row_cols,
                        uint8_t* q_col, float* s_col, u64 s_col_cols) {
    return {x, BlockArgs{m, k, 448.0f, 1, 0.0f, 3.4e38f, q_row, s_row, s_row_cols, q_col, s_col, s_col_cols}};
}
__global__ void __launch_bounds__(256, TQ_MINB_BLOCK_ROW) tl_block_row(TlBlock a, Stamp* st) {
    stamped(st, [&] { block_row_impl<__nv_bfloat16, true>(a.x, a.p); });
}
__global__ void __launch_bounds__(256, TQ_MINB_BLOCK_1D) tl_block_1d(TlBlock a, Stamp* st) {
    stamped(st, [&] { block_impl<__nv_bfloat16, true, false>(a.x, a.p); });
}
__global__ void __launch_bounds__(256, TQ_MINB_BLOCK_2D) tl_block_2d(TlBlock a, Stamp* st) {
    stamped(st, [&] { block_impl<__nv_bfloat16, true, true>(a.x, a.p); });
}

// The 128x128 rowwise-only tile kernel with the columnwise operand absent at compile
// time (no transposed tile in shared memory), for MINB CTAs per SM.
template <int MINB> __global__ void __launch_bounds__(256, MINB) tl_block_2d_row(TlBlock a, Stamp* st) {
    stamped(st, [&] {
        BlockArgs p = a.p;
        p.q_col = nullptr;
        p.s_col = nullptr;
        p.s_col_cols = 0;
        block_impl<__nv_bfloat16, true, true>(a.x, p);
    });
}

// The q-th quantile (0..1) of v (sorted here).
static double quantile(std::vector<double> v, double q) {
    if (v.empty()) return 0.0;
    std::sort(v.begin(), v.end());
    return v[std::min(v.size() - 1, (size_t)(q * (double)v.size()))];
}

// Prints what the stamps of one launch say (see the file's head). `slots` is how many
// CTAs the GPU holds at once, `bytes` what one CTA moves.
static void analyse(const char* name, const std::vector<Stamp>& s, int slots, double bytes, float event_ms,
                    float plain_ms, double copy_gbs) {
    const size_t n = s.size();
    u64 t_min = ~0ull, t_max = 0;
    for (const Stamp& x : s) {
        t_min = std::min(t_min, x.t0);
        t_max = std::max(t_max, x.t1);
    }
    const double span = (double)(t_max - t_min);
    // CTAs by start time; wave w = the w-th `slots` of them.
    std::vector<size_t> order(n);
    for (size_t i = 0; i < n; ++i) order[i] = i;
    std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return s[a].t0 < s[b].t0; });
    const size_t waves = (n + slots - 1) / slots;
    u64 step = ~0ull;  // the timer's resolution, as far as the start stamps show it
    for (size_t j = 1; j < n; ++j) {
        const u64 d = s[order[j]].t0 - s[order[j - 1]].t0;
        if (d > 0) step = std::min(step, d);
    }
    std::printf("\n%s: %zu CTAs, %d at once (%.2f waves), %.0f bytes each\n", name, n, slots, (double)n / slots, bytes);
    std::printf("  event time %.2f us (stamped launch %.2f us); stamped span %.2f us (timer step %llu ns); %.3f of "
                "copy over the span\n",
                plain_ms * 1e3, event_ms * 1e3, span / 1e3, (unsigned long long)step, bytes * n / span / copy_gbs);
    for (size_t w = 0; w < waves; ++w) {
        std::vector<double> d, st, en;
        for (size_t j = w * slots; j < std::min(n, (w + 1) * (size_t)slots); ++j) {
            const Stamp& x = s[order[j]];
            d.push_back((double)(x.t1 - x.t0) / 1e3);
            st.push_back((double)(x.t0 - t_min) / 1e3);
            en.push_back((double)(x.t1 - t_min) / 1e3);
        }
        std::printf("  wave %zu (%zu CTAs): starts %.2f..%.2f us, ends %.2f..%.2f us, life p10/p50/p90 %.2f/%.2f/%.2f us\n",
                    w, d.size(), quantile(st, 0.0), quantile(st, 1.0), quantile(en, 0.0), quantile(en, 1.0),
                    quantile(d, 0.1), quantile(d, 0.5), quantile(d, 0.9));
    }
    // Profile: 24 bins over the span; CTAs in flight (mean) and implied TB/s.
    constexpr int B = 24;
    double act[B] = {}, bw[B] = {};
    const double bin = span / B;
    for (const Stamp& x : s) {
        const double a = (double)(x.t0 - t_min), e = (double)(x.t1 - t_min), life = std::max(1.0, e - a);
        for (int i = 0; i < B; ++i) {
            const double lo = std::max(a, i * bin), hi = std::min(e, (i + 1) * bin);
            if (hi <= lo) continue;
            act[i] += (hi - lo) / bin;
            bw[i] += bytes * (hi - lo) / life;
        }
    }
    std::printf("  in flight:");
    for (int i = 0; i < B; ++i) std::printf(" %4.0f", act[i]);
    std::printf("\n  TB/s:     ");
    for (int i = 0; i < B; ++i) std::printf(" %4.2f", bw[i] / bin / 1e3);
    std::printf("\n");
    // Per-SM balance.
    std::vector<int> per_sm(1024, 0);
    for (const Stamp& x : s) per_sm[std::min<uint32_t>(x.sm, 1023)]++;
    int lo = 1 << 30, hi = 0;
    for (int c : per_sm)
        if (c > 0) lo = std::min(lo, c), hi = std::max(hi, c);
    std::printf("  CTAs per SM: %d..%d\n", lo, hi);
}

// Times `launch(nullptr)`, then launches it once with stamps and analyses them.
// `smem`: the dynamic shared memory `launch` asks for (to cap the CTAs per SM).
template <class Kern, class L>
static void run(const char* name, Kern kern, unsigned grid, double bytes_per_cta, double copy_gbs, L launch,
                size_t smem = 0) {
    int per_sm = 0, sms = 0;
    CK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kern, 256, smem));
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    cudaFuncAttributes fa;
    CK(cudaFuncGetAttributes(&fa, kern));
    Stamp* st;
    CK(cudaMalloc(&st, grid * sizeof(Stamp)));
    const float plain = time_ms([&] { launch(nullptr); });
    const float with = time_ms([&] { launch(st); });
    launch(st);
    CK(cudaDeviceSynchronize());
    std::vector<Stamp> h(grid);
    CK(cudaMemcpy(h.data(), st, grid * sizeof(Stamp), cudaMemcpyDeviceToHost));
    CK(cudaFree(st));
    char full[128];
    std::snprintf(full, sizeof full, "%s [%d registers, %zu B shared]", name, fa.numRegs, fa.sharedSizeBytes);
    analyse(full, h, per_sm * sms, bytes_per_cta, with, plain, copy_gbs);
}

int main() {
    const u64 n = M * K;
    const std::vector<uint16_t> h = bf16_input(n);
    Fp8Buffers b(n, h, 3.0f);
    cudaDeviceProp p;
    CK(cudaGetDeviceProperties(&p, 0));
    std::printf("%s, %d SMs, %llux%llu bf16\n", p.name, p.multiProcessorCount, (unsigned long long)M,
                (unsigned long long)K);
    b.time_copy();
    const double c = b.copy_gbs;
    // The copies at the occupancy their registers allow, then capped at 3 CTAs per SM (the
    // 128x128 tile kernels') and 4 by a dynamic shared-memory request.
    const unsigned tiles = (unsigned)(n * 2 / 32768);
    const auto* xv = reinterpret_cast<const uint4*>(b.x);
    auto* yv = reinterpret_cast<uint4*>(b.tmp);
    for (int per_sm : {0, 3, 4}) {
        const size_t smem = per_sm == 3 ? 70 * 1024 : per_sm == 4 ? 52 * 1024 : 0;
        char cap[32] = "";
        if (per_sm) std::snprintf(cap, sizeof cap, ", %d CTAs/SM", per_sm);
        char nm[96];
        std::snprintf(nm, sizeof nm, "copy, tile-shaped%s", cap);
        run(nm, tl_copy<false>, tiles, 65536.0, c, [&](Stamp* st) { tl_copy<false><<<tiles, 256, smem>>>(xv, yv, st); },
            smem);
        std::snprintf(nm, sizeof nm, "copy of half, tile-shaped%s", cap);
        run(nm, tl_copy<true>, tiles, 49152.0, c, [&](Stamp* st) { tl_copy<true><<<tiles, 256, smem>>>(xv, yv, st); },
            smem);
    }
    const unsigned t128 = (unsigned)((M / 128) * (K / 128)), t32 = (unsigned)((M / 32) * (K / 128));
    const double tile_in = 128.0 * 128 * 2, tile_out = 128.0 * 128;
    const TlBlock row = tl_block(b.x, M, K, b.q, b.sr, M, nullptr, nullptr, 0);
    run("fp8 block 1x128 rowwise", tl_block_row, t32, (tile_in + tile_out) / 4 + 32 * 4, c,
        [&](Stamp* st) { tl_block_row<<<t32, 256>>>(row, st); });
    const TlBlock r2 = tl_block(b.x, M, K, b.q, b.sr, K / 128, nullptr, nullptr, M / 128);
    run("fp8 block 128x128 rowwise", tl_block_2d, t128, tile_in + tile_out + 4, c,
        [&](Stamp* st) { tl_block_2d<<<t128, 256>>>(r2, st); });
    run("fp8 block 128x128 rowwise, no columnwise code, 3", tl_block_2d_row<3>, t128, tile_in + tile_out + 4, c,
        [&](Stamp* st) { tl_block_2d_row<3><<<t128, 256>>>(r2, st); });
    run("fp8 block 128x128 rowwise, no columnwise code, 4", tl_block_2d_row<4>, t128, tile_in + tile_out + 4, c,
        [&](Stamp* st) { tl_block_2d_row<4><<<t128, 256>>>(r2, st); });
    run("fp8 block 128x128 rowwise, no columnwise code, 5", tl_block_2d_row<5>, t128, tile_in + tile_out + 4, c,
        [&](Stamp* st) { tl_block_2d_row<5><<<t128, 256>>>(r2, st); });
    const TlBlock b2 = tl_block(b.x, M, K, b.q, b.sr, K / 128, b.qt, b.sc, M / 128);
    run("fp8 block 128x128 both", tl_block_2d, t128, tile_in + 2 * tile_out + 8, c,
        [&](Stamp* st) { tl_block_2d<<<t128, 256>>>(b2, st); });
    const TlBlock b1 = tl_block(b.x, M, K, b.q, b.sr, M, b.qt, b.sc, K);
    run("fp8 block 1x128 both", tl_block_1d, t128, tile_in + 2 * tile_out + 1024, c,
        [&](Stamp* st) { tl_block_1d<<<t128, 256>>>(b1, st); });
    return 0;
}
