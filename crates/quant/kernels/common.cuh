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
