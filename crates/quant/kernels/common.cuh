// Shared device helpers of the tessera-quant kernels. Every .cu file of this directory
// includes it; `cargo xtask ptx` hashes it together with each .cu file.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

typedef unsigned long long u64;

// ---- input element types -------------------------------------------------------------

template <class T> struct In;
template <> struct In<float> {
    __device__ static float f32(float x) { return x; }
    __device__ static float from(float y) { return y; }
};
template <> struct In<__nv_bfloat16> {
    __device__ static float f32(__nv_bfloat16 x) { return __bfloat162float(x); }
    __device__ static __nv_bfloat16 from(float y) { return __float2bfloat16_rn(y); }
};
template <> struct In<__half> {
    __device__ static float f32(__half x) { return __half2float(x); }
    __device__ static __half from(float y) { return __float2half_rn(y); }
};

// ---- FP8 -----------------------------------------------------------------------------

// Two floats to two FP8 bytes (RNE, satfinite; NaN -> 0x7F): `lo` in the low byte.
template <bool E4M3> __device__ __forceinline__ uint16_t fp8x2(float lo, float hi) {
    uint16_t r;
    if (E4M3) {
        asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
    } else {
        asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
    }
    return r;
}

template <bool E4M3> __device__ __forceinline__ uint8_t fp8(float x) {
    return (uint8_t)(fp8x2<E4M3>(x, 0.0f) & 0xFF);
}

// FP8 byte to float (exact, via f16).
template <bool E4M3> __device__ __forceinline__ float fp8_to_f32(uint8_t b) {
    uint32_t h;
    uint16_t in = b;
    if (E4M3) {
        asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h) : "h"(in));
    } else {
        asm("cvt.rn.f16x2.e5m2x2 %0, %1;" : "=r"(h) : "h"(in));
    }
    return __half2float(__ushort_as_half((unsigned short)(h & 0xFFFF)));
}

// ---- reductions ----------------------------------------------------------------------

// NaN-ignoring max (fmaxf returns the other operand when one is NaN).
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xFFFFFFFFu, v, o));
    return v;
}

// Block-wide NaN-ignoring max; every thread gets the result. `smem` holds 32 floats.
__device__ __forceinline__ float block_max(float v, float* smem) {
    v = warp_max(v);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __syncthreads();
    if (lane == 0) smem[warp] = v;
    __syncthreads();
    const int warps = (blockDim.x + 31) >> 5;
    v = lane < warps ? smem[lane] : 0.0f;
    return warp_max(v);
}

// Atomic max of a non-negative float (its bits order like unsigned integers).
__device__ __forceinline__ void atomic_max_nonneg(float* addr, float v) {
    atomicMax(reinterpret_cast<unsigned int*>(addr), __float_as_uint(v));
}

// ---- scales --------------------------------------------------------------------------

// TE's compute_scale_from_amax (spec/formats.md 3.4).
__device__ __forceinline__ float scale_from_amax(float amax, float fp8_max, bool pow2, float eps,
                                                 float value_for_inf) {
    if (amax < eps) amax = eps;
    if (isinf(amax) || isnan(amax) || amax == 0.0f) return 1.0f;
    float scale = __fdiv_rn(fp8_max, amax);
    if (isinf(scale)) scale = value_for_inf;
    if (pow2) scale = __uint_as_float(__float_as_uint(scale) & 0xFF800000u);
    return scale;
}

// ---- E8M0 and layouts ----------------------------------------------------------------

// TE's float_to_e8m0 for a non-negative value (spec/formats.md 2.3).
__device__ __forceinline__ uint8_t float_to_e8m0(float v) {
    if (isnan(v)) return 0xFF;
    const uint32_t bits = __float_as_uint(fabsf(v));
    uint32_t e = bits >> 23;
    const uint32_t m = bits & 0x7FFFFFu;
    if (e == 0xFF) return 0xFE;
    if (m > 0 && e != 0xFE && !(e == 0 && m <= 0x400000u)) e += 1;
    return (uint8_t)e;
}

// 2^(127 - e): the multiplier of a block with E8M0 scale e (TE's exp2f_rcp).
__device__ __forceinline__ float e8m0_reciprocal(uint8_t e) {
    if (e == 255) return __uint_as_float(0x7FFFFFFFu);
    if (e == 254) return __uint_as_float(0x00400000u);
    return __uint_as_float((254u - e) << 23);
}

// 2^(e - 127) (code 0 is the subnormal 2^-127).
__device__ __forceinline__ float e8m0_value(uint8_t e) {
    if (e == 0) return __uint_as_float(0x00400000u);
    if (e == 255) return __uint_as_float(0x7FFFFFFFu);
    return __uint_as_float((uint32_t)e << 23);
}

// Byte (i, j) of a padded [rows, cols] scale grid in cuBLAS's swizzled layout.
__device__ __forceinline__ u64 swizzled_index(u64 i, u64 j, u64 cols) {
    const u64 tile = (i / 128) * (cols / 4) + j / 4;
    const u64 r = i % 128;
    return tile * 512 + (r % 32) * 16 + (r / 32) * 4 + j % 4;
}

// Loads 16 consecutive elements of T starting at p (16-byte aligned) as floats.
template <class T> __device__ __forceinline__ void load16(const T* p, float* v) {
    constexpr int V = 16 / sizeof(T);
    constexpr int L = 16 / V;
    union { uint4 u[L]; T e[16]; } b;
#pragma unroll
    for (int l = 0; l < L; ++l) b.u[l] = reinterpret_cast<const uint4*>(p)[l];
#pragma unroll
    for (int j = 0; j < 16; ++j) v[j] = In<T>::f32(b.e[j]);
}

// Loads 4 consecutive elements of T starting at p (aligned to 4 elements) as floats.
template <class T> __device__ __forceinline__ void load4(const T* p, float* v) {
    if constexpr (sizeof(T) == 4) {
        const float4 u = *reinterpret_cast<const float4*>(p);
        v[0] = u.x; v[1] = u.y; v[2] = u.z; v[3] = u.w;
    } else {
        union { uint2 u; T e[4]; } b;
        b.u = *reinterpret_cast<const uint2*>(p);
#pragma unroll
        for (int j = 0; j < 4; ++j) v[j] = In<T>::f32(b.e[j]);
    }
}

// 16 floats times s, to 16 FP8 bytes.
template <bool E4M3> __device__ __forceinline__ uint4 fp8x16(const float* v, float s) {
    union { uint4 u; uint16_t h[8]; } o;
#pragma unroll
    for (int j = 0; j < 8; ++j) o.h[j] = fp8x2<E4M3>(__fmul_rn(v[2 * j], s), __fmul_rn(v[2 * j + 1], s));
    return o.u;
}
