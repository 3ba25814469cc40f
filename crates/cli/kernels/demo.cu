// The element-wise and row kernels of `tessera demo`'s CUDA backend (the GEMMs go
// through cuBLAS). Every kernel computes exactly what the CPU functions of
// `crates/cli/src/demo/ops.rs` compute, bit for bit:
//
// - arithmetic goes through the `_rn` intrinsics, which nvcc never contracts into an
//   FMA (the CPU code has none either);
// - `exp` is the demo's own (`demo_exp`, mirrored by `ops::exp`), since CUDA's `expf`
//   and the host's libm round differently;
// - a row sum runs in the order of one warp: lane `l` adds elements `l, l+32, ...` in
//   order, then the 32 partial sums meet in a butterfly (`lane ^ 16`, `^ 8`, ... `^ 1`),
//   which `ops::warp_sum` reproduces on the CPU.

#include <cstdint>

typedef unsigned long long u64;

#define LAUNCH_BOUNDS __launch_bounds__(256)

namespace {

__device__ __forceinline__ float add(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ float sub(float a, float b) { return __fsub_rn(a, b); }
__device__ __forceinline__ float mul(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ float dvd(float a, float b) { return __fdiv_rn(a, b); }

// Constants shared with ops.rs.
constexpr float SQRT_2_OVER_PI = 0.7978846f;
constexpr float GELU_C = 0.044715f;
constexpr float LOG2E = 1.44269504088896341f;
constexpr float LN2_HI = 0.693359375f;
constexpr float LN2_LO = -2.12194440e-4f;
constexpr float EXP_MAX = 88.0f;
constexpr float EXP_MIN = -87.0f;

// e^x: x = n·ln2 + r with |r| ≤ ln2/2 (Cody–Waite, ln2 in two parts), e^r by a degree-7
// polynomial (Cephes' coefficients), times 2^n built from its exponent bits. Beyond
// [EXP_MIN, EXP_MAX], +inf or 0, so 2^n stays a normal number.
__device__ float demo_exp(float x) {
    if (x != x) return x;
    if (x > EXP_MAX) return __int_as_float(0x7f800000);
    if (x < EXP_MIN) return 0.0f;
    float n = rintf(mul(x, LOG2E));
    float r = sub(sub(x, mul(n, LN2_HI)), mul(n, LN2_LO));
    float p = 1.9875691500e-4f;
    p = add(mul(p, r), 1.3981999507e-3f);
    p = add(mul(p, r), 8.3334519073e-3f);
    p = add(mul(p, r), 4.1665795894e-2f);
    p = add(mul(p, r), 1.6666665459e-1f);
    p = add(mul(p, r), 0.5f);  // Cephes' 5.0000001201e-1, which is 0.5 in f32
    p = add(add(mul(mul(p, r), r), r), 1.0f);
    float scale = __int_as_float((static_cast<int>(n) + 127) << 23);
    return mul(p, scale);
}

// tanh(u) = 1 - 2/(e^{2u} + 1).
__device__ __forceinline__ float demo_tanh(float u) {
    return sub(1.0f, dvd(2.0f, add(demo_exp(mul(2.0f, u)), 1.0f)));
}

// √(2/π)·(x + c·x³), with c·x·x·x multiplied left to right.
__device__ __forceinline__ float gelu_inner(float x) {
    return mul(SQRT_2_OVER_PI, add(x, mul(mul(mul(GELU_C, x), x), x)));
}

// The warp's butterfly over the lanes' partial sums (all lanes end with the same sum:
// each step adds two values, and a + b == b + a).
__device__ __forceinline__ float butterfly(float s) {
    for (int off = 16; off > 0; off >>= 1) {
        s = add(s, __shfl_xor_sync(0xffffffffu, s, off));
    }
    return s;
}

}  // namespace

extern "C" {

// out = a + b.
__global__ void LAUNCH_BOUNDS tessera_demo_add(float* out, const float* a, const float* b, u64 n) {
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        out[i] = add(a[i], b[i]);
    }
}

// GeLU, tanh approximation: 0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³))).
__global__ void LAUNCH_BOUNDS tessera_demo_gelu(float* out, const float* a, u64 n) {
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        float x = a[i];
        out[i] = mul(mul(0.5f, x), add(1.0f, demo_tanh(gelu_inner(x))));
    }
}

// dg · gelu'(a).
__global__ void LAUNCH_BOUNDS tessera_demo_gelu_backward(float* out, const float* a, const float* dg, u64 n) {
    const float three_c = mul(3.0f, GELU_C);
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        float x = a[i];
        float t = demo_tanh(gelu_inner(x));
        float dt = mul(mul(sub(1.0f, mul(t, t)), SQRT_2_OVER_PI), add(1.0f, mul(mul(three_c, x), x)));
        out[i] = mul(dg[i], add(mul(0.5f, add(1.0f, t)), mul(mul(0.5f, x), dt)));
    }
}

// Dropout with a given mask (1 = kept): x·scale where kept, 0 elsewhere.
__global__ void LAUNCH_BOUNDS tessera_demo_apply_mask(float* out, const float* x, const uint8_t* mask, float scale, u64 n) {
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        out[i] = mask[i] == 1 ? mul(x[i], scale) : 0.0f;
    }
}

// LayerNorm over rows of h: one warp per row (8 rows per 256-thread block).
__global__ void LAUNCH_BOUNDS tessera_demo_layernorm(
    float* z, float* mean, float* rstd, const float* x, const float* gamma, const float* beta,
    u64 rows, u64 h, float inv_h, float eps) {
    const u64 row = blockIdx.x * (u64)(blockDim.x / 32) + threadIdx.x / 32;
    const unsigned lane = threadIdx.x % 32;
    if (row >= rows) return;
    const float* xr = x + row * h;
    float s = 0.0f;
    for (u64 j = lane; j < h; j += 32) s = add(s, xr[j]);
    const float mu = mul(butterfly(s), inv_h);
    float v = 0.0f;
    for (u64 j = lane; j < h; j += 32) {
        float d = sub(xr[j], mu);
        v = add(v, mul(d, d));
    }
    const float var = mul(butterfly(v), inv_h);
    const float r = dvd(1.0f, __fsqrt_rn(add(var, eps)));
    float* zr = z + row * h;
    for (u64 j = lane; j < h; j += 32) {
        zr[j] = add(mul(mul(sub(xr[j], mu), r), gamma[j]), beta[j]);
    }
    if (lane == 0) {
        mean[row] = mu;
        rstd[row] = r;
    }
}

// LayerNorm's input gradient: one warp per row.
__global__ void LAUNCH_BOUNDS tessera_demo_layernorm_backward_dx(
    float* dx, const float* dz, const float* x, const float* mean, const float* rstd,
    const float* gamma, u64 rows, u64 h, float inv_h) {
    const u64 row = blockIdx.x * (u64)(blockDim.x / 32) + threadIdx.x / 32;
    const unsigned lane = threadIdx.x % 32;
    if (row >= rows) return;
    const float mu = mean[row], r = rstd[row];
    const float* xr = x + row * h;
    const float* dr = dz + row * h;
    float c1 = 0.0f, c2 = 0.0f;
    for (u64 j = lane; j < h; j += 32) {
        float xhat = mul(sub(xr[j], mu), r);
        float dxhat = mul(dr[j], gamma[j]);
        c1 = add(c1, mul(dxhat, xhat));
        c2 = add(c2, dxhat);
    }
    c1 = mul(butterfly(c1), inv_h);
    c2 = mul(butterfly(c2), inv_h);
    float* out = dx + row * h;
    for (u64 j = lane; j < h; j += 32) {
        float xhat = mul(sub(xr[j], mu), r);
        float dxhat = mul(dr[j], gamma[j]);
        out[j] = mul(r, sub(sub(dxhat, c2), mul(xhat, c1)));
    }
}

// LayerNorm's γ and β gradients: one thread per column, rows added in order.
__global__ void LAUNCH_BOUNDS tessera_demo_layernorm_backward_params(
    float* dgamma, float* dbeta, const float* dz, const float* x, const float* mean,
    const float* rstd, u64 rows, u64 h) {
    for (u64 j = blockIdx.x * (u64)blockDim.x + threadIdx.x; j < h; j += (u64)gridDim.x * blockDim.x) {
        float g = 0.0f, b = 0.0f;
        for (u64 i = 0; i < rows; ++i) {
            float d = dz[i * h + j];
            float xhat = mul(sub(x[i * h + j], mean[i]), rstd[i]);
            g = add(g, mul(d, xhat));
            b = add(b, d);
        }
        dgamma[j] = g;
        dbeta[j] = b;
    }
}

// f32 → bf16, round to nearest even; a NaN keeps its sign and top payload bits and is
// made quiet (the `half` crate's conversion).
__global__ void LAUNCH_BOUNDS tessera_demo_to_bf16(uint16_t* out, const float* x, u64 n) {
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        uint32_t b = __float_as_uint(x[i]);
        uint16_t hi = static_cast<uint16_t>(b >> 16);
        if ((b & 0x7fffffffu) > 0x7f800000u) {
            out[i] = hi | 0x0040u;
        } else if ((b & 0x8000u) != 0 && (b & 0x17fffu) != 0) {
            out[i] = static_cast<uint16_t>(hi + 1);
        } else {
            out[i] = hi;
        }
    }
}

// bf16 → f32 (exact).
__global__ void LAUNCH_BOUNDS tessera_demo_bf16_to_f32(float* out, const uint16_t* x, u64 n) {
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        out[i] = __uint_as_float(static_cast<uint32_t>(x[i]) << 16);
    }
}

// `rows` rows of `width` elements from src (row pitch `src_pitch` elements) to dst (row
// pitch `dst_pitch`), as 4-byte words (`_u32`) or bytes (`_u8`).
#define TESSERA_DEMO_COPY2D(NAME, T)                                                      \
    __global__ void LAUNCH_BOUNDS NAME(T* dst, u64 dst_pitch, const T* src, u64 src_pitch, \
                                       u64 rows, u64 width) {                            \
        const u64 n = rows * width;                                                      \
        for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n;                  \
             i += (u64)gridDim.x * blockDim.x) {                                         \
            u64 r = i / width, c = i % width;                                            \
            dst[r * dst_pitch + c] = src[r * src_pitch + c];                             \
        }                                                                                \
    }

TESSERA_DEMO_COPY2D(tessera_demo_copy2d_u32, uint32_t)
TESSERA_DEMO_COPY2D(tessera_demo_copy2d_u8, uint8_t)

}  // extern "C"
