// Shared by the kernel-variant harnesses in this folder (not shipped): error checks, a
// CUDA-event timer (median of 15 samples of 10 back-to-back launches after 3 warm-ups)
// and an FNV-1a hash of device bytes, to compare variants' outputs byte for byte.
#pragma once
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CK(x)                                                                          \
    do {                                                                               \
        cudaError_t e = (x);                                                           \
        if (e != cudaSuccess) {                                                        \
            std::printf("CUDA error %s at line %d\n", cudaGetErrorString(e), __LINE__); \
            std::exit(1);                                                              \
        }                                                                              \
    } while (0)

// With QV_ONCE set in the environment every kernel is launched once and not timed (for
// profilers: `QV_ONCE=1 ncu -k regex:... ./qv`).
template <class F> static float time_ms(F launch) {
    if (std::getenv("QV_ONCE") != nullptr) {
        launch();
        CK(cudaDeviceSynchronize());
        return 1.0f;
    }
    cudaEvent_t a, b;
    CK(cudaEventCreate(&a));
    CK(cudaEventCreate(&b));
    for (int i = 0; i < 3; ++i) launch();
    std::vector<float> t;
    for (int s = 0; s < 15; ++s) {
        CK(cudaEventRecord(a));
        for (int i = 0; i < 10; ++i) launch();
        CK(cudaEventRecord(b));
        CK(cudaEventSynchronize(b));
        float ms;
        CK(cudaEventElapsedTime(&ms, a, b));
        t.push_back(ms / 10);
    }
    CK(cudaGetLastError());
    std::sort(t.begin(), t.end());
    return t[t.size() / 2];
}

// The current device's properties.
static cudaDeviceProp device_props() {
    int dev;
    CK(cudaGetDevice(&dev));
    cudaDeviceProp p;
    CK(cudaGetDeviceProperties(&p, dev));
    return p;
}

// Prints the header line of a harness's output: the card and its SM count.
static void print_device() {
    const cudaDeviceProp p = device_props();
    std::printf("%s, %d SMs\n", p.name, p.multiProcessorCount);
}

static uint64_t fnv(const void* d, size_t n) {
    std::vector<uint8_t> h(n);
    CK(cudaMemcpy(h.data(), d, n, cudaMemcpyDeviceToHost));
    uint64_t x = 1469598103934665603ull;
    for (uint8_t b : h) x = (x ^ b) * 1099511628211ull;
    return x;
}

// Launches kernel k with programmatic stream serialization (the library's `launch_after`):
// it may start before the kernel ahead of it in the stream ends, and waits for it in
// pdl_wait() (common.cuh).
template <class... Params, class... Args>
static void launch_pdl(void (*k)(Params...), dim3 grid, dim3 block, Args... args) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = block;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    CK(cudaLaunchKernelEx(&cfg, k, args...));
}

// The harnesses' bf16 input of n elements (raw bits): magnitudes from 2^-20 to 2^20,
// changing every 64 elements, with NaN, -Inf and zeros sprinkled in; or, with `normal`,
// magnitudes 2^-4 .. 2^2 only (every NVFP4 tile takes the fast path).
static std::vector<uint16_t> bf16_input(uint64_t n, bool normal = false) {
    std::vector<uint16_t> h(n);
    uint64_t s = 12345;
    for (uint64_t i = 0; i < n; ++i) {
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        const uint32_t r = (uint32_t)(s >> 32);
        uint16_t b;
        if (normal) {
            b = (uint16_t)((r & 0x8000) | ((123 + (r >> 20) % 7) << 7) | (r & 0x7F));
        } else {
            const uint16_t exp = (uint16_t)(127 - 20 + ((i / 64) * 7 % 41));
            b = (uint16_t)((r & 0x8000) | (exp << 7) | (r & 0x7F));
            if (r % 997 == 0) b = (r & 0x10000) ? 0x7FC0 : 0xFF80;  // NaN, -Inf
            if (r % 1009 == 0) b = 0;
        }
        h[i] = b;
    }
    return h;
}

// One result line: the name, the time, GB/s of `bytes` and its ratio to `copy_gbs`, and
// the FNV-1a hash of each output (device pointer, bytes).
static void report_hashes(const char* name, float ms, double bytes, double copy_gbs,
                          const std::vector<std::pair<const void*, size_t>>& outs) {
    const double gbs = bytes / ms / 1e6;
    std::printf("%-40s %8.4f ms %8.1f GB/s %6.3f of copy  hash", name, ms, gbs, gbs / copy_gbs);
    for (auto& o : outs) std::printf(" %016llx", (unsigned long long)fnv(o.first, o.second));
    std::printf("\n");
}

// A dimension from the environment variable `name`, else `fallback`.
static uint64_t env_dim(const char* name, uint64_t fallback) {
    const char* v = std::getenv(name);
    return v != nullptr ? std::strtoull(v, nullptr, 10) : fallback;
}

// The grid of a persistent kernel of 256-thread CTAs with `smem` bytes of dynamic shared
// memory (its limit raised to that first): every CTA that fits at once, at most one per
// tile, and at most QV_CTAS per SM when that is set. The CTAs per SM go to *per_sm_out.
template <class K> static unsigned persistent_grid(K kern, size_t smem, uint64_t tiles, int* per_sm_out = nullptr) {
    CK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    int per_sm = 0, sms = 0;
    CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kern, 256, smem));
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    if (std::getenv("QV_CTAS")) per_sm = std::min(per_sm, std::atoi(std::getenv("QV_CTAS")));
    if (per_sm_out != nullptr) *per_sm_out = per_sm;
    return (unsigned)std::min<uint64_t>(tiles, (uint64_t)per_sm * sms);
}

// The FP8 harnesses' device buffers for an n-element bf16 input (filled from `h`): the
// input and a same-size scratch (for the copy), rowwise and transposed bytes, scale
// grids of n / 32 floats each, and a scale (set to `scale_value`), its inverse and an
// amax, one float each. Freed at exit.
struct Fp8Buffers {
    uint64_t n;
    double copy_gbs = 0;  // set by time_copy
    __nv_bfloat16* x;
    uint8_t *q, *qt, *tmp;
    float *sr, *sc, *scale, *sinv, *amax;
    Fp8Buffers(uint64_t n, const std::vector<uint16_t>& h, float scale_value) : n(n) {
        CK(cudaMalloc(&x, n * 2));
        CK(cudaMalloc(&tmp, n * 2));
        CK(cudaMalloc(&q, n));
        CK(cudaMalloc(&qt, n));
        CK(cudaMalloc(&sr, n / 8));
        CK(cudaMalloc(&sc, n / 8));
        CK(cudaMalloc(&scale, 4));
        CK(cudaMalloc(&sinv, 4));
        CK(cudaMalloc(&amax, 4));
        CK(cudaMemcpy(x, h.data(), n * 2, cudaMemcpyHostToDevice));
        CK(cudaMemcpy(scale, &scale_value, 4, cudaMemcpyHostToDevice));
    }
    // Times a device-to-device copy of the input and prints it; its GB/s (bytes read +
    // written) become copy_gbs, the harnesses' yardstick.
    void time_copy() {
        const float ms = time_ms([&] { CK(cudaMemcpyAsync(tmp, x, n * 2, cudaMemcpyDeviceToDevice)); });
        copy_gbs = 4.0 * n / ms / 1e6;
        std::printf("%-40s %8.4f ms %8.1f GB/s\n", "cudaMemcpy d2d", ms, copy_gbs);
    }
    // report_hashes against copy_gbs.
    void report(const char* name, float ms, double bytes, const std::vector<std::pair<const void*, size_t>>& outs) const {
        report_hashes(name, ms, bytes, copy_gbs, outs);
    }
    // Poisons the data outputs (an unwritten byte changes the hash) and zeroes the scale
    // grids (the harnesses' shapes have no padding).
    void clear() const {
        CK(cudaMemset(q, 0x5A, n));
        CK(cudaMemset(qt, 0x5A, n));
        CK(cudaMemset(sr, 0, n / 8));
        CK(cudaMemset(sc, 0, n / 8));
    }
};
