// Shared by the CPU checks e2m1_check.cpp and e2m1_fused_check.cpp (not shipped): float
// bit casts and the both kernel's fast-path E2M1 encoder (kernels/nvfp4.cu,
// e2m1_magnitude_biased) as host code. float32 arithmetic and fmaf round to nearest even
// on the host as on the GPU.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

static inline uint32_t B(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    return u;
}
static inline float F(uint32_t u) {
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
static const float K0 = 8388608.0f;  // 2^23

// The E2M1 magnitude of y, |y| < 7 and not NaN (the fast path's domain): the least of
// rne(2|y|), rne(|y| + 2), rne(|y| / 2 + 4), each in the low bits of a float in
// [2^23, 2^24), taken on the float bits as unsigned integers, less 2^23's bits.
static inline uint32_t fast_magnitude(float y) {
    const float a = std::fabs(y);
    const uint32_t f0 = B(std::fmaf(a, 2.0f, K0));
    const uint32_t f1 = B(a + (K0 + 2.0f));
    const uint32_t f2 = B(std::fmaf(a, 0.5f, K0 + 4.0f));
    return std::min(std::min(f0, f1), f2) - B(K0);
}
