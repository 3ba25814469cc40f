// Shared device helpers of the tessera-quant kernels. Every .cu file of this directory
// includes it; `cargo xtask ptx` hashes it together with each .cu file.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

typedef unsigned long long u64;

// Minimum resident CTAs per multiprocessor asked of the compiler (the second
// __launch_bounds__ argument) for the register-tile kernels with 2-byte inputs (f32
// tiles take 2: 128 registers, no spills); bench/cuda/quant_variants.cu overrides them
// to compare register budgets.
// - The 128x128 tile kernels with a transposed operand (cast-transpose, FP8 block 2-D)
//   take a tile inside the matrix with aligned rows (full_tile) without bounds checks,
//   and call a separate function for the others. The checked code had held them at 80
//   registers (3 CTAs per SM; 64 spilled); the unchecked path fits 64 without spills,
//   and 4 CTAs per SM are 1.94 waves of the 1024 tiles of a 4096x4096 input instead of
//   2.59. On an H200 at 4096x4096 that moved the cast-transpose from 0.91 to 0.98 of a
//   copy and 128x128 both from 0.89 to 0.97; at 16384x8192 128x128 both stayed equal
//   and the cast-transpose lost 0.007 (BENCHMARKS.md, "The night's kernels on an H200").
// - TQ_MINB_BLOCK_2D serves both 2-D entry points; the rowwise-only one has no
//   transposed tile at all and fits 64 registers either way (5 CTAs per SM spill and
//   lose 15%).
// - 1-D blocks with a columnwise operand keep per-column maxima next to the tile. Each
//   row's bytes are stored as soon as they are converted and the column maxima go to
//   shared memory 8 at a time, so with both paths inline they fit 64 registers without
//   spills (they had spilled 176 bytes at 64, 4 at 80): 4 CTAs per SM. (The full path
//   alone, at 3 CTAs per SM, had moved them from 0.83 to 0.91 of a copy at 4096x4096 on
//   an H200.)
// - MXFP8 with a columnwise operand or 32x32 tiles quantizes one orientation at a time
//   (amaxes, scales, bytes), so the other's 16 amaxes and multipliers are not live beside
//   the tile: 64 registers without spills (36 and 104 bytes spilled when both were
//   computed first), 4 CTAs per SM instead of 3. The |.| words are computed once per
//   orientation (3% more instructions).
#ifndef TQ_MINB_TILE
#define TQ_MINB_TILE 4
#endif
#ifndef TQ_MINB_BLOCK_ROW
#define TQ_MINB_BLOCK_ROW 1
#endif
#ifndef TQ_MINB_BLOCK_1D
#define TQ_MINB_BLOCK_1D 4
#endif
#ifndef TQ_MINB_BLOCK_2D
#define TQ_MINB_BLOCK_2D 4
#endif
#ifndef TQ_MINB_MXFP8
#define TQ_MINB_MXFP8 4
#endif

// ---- programmatic dependent launch (sm_90) -------------------------------------------

// A kernel launched with programmatic stream serialization (the host's `launch_params`)
// may start while the kernel before it in the stream still runs: once every CTA of that
// kernel has called pdl_launch_dependents() (or exited), its CTAs take the SM slots the
// earlier one frees. pdl_wait() blocks until the earlier kernel has finished and its
// writes are visible; what a kernel does before it may only read memory the earlier
// kernel does not write (the second passes of the quantizers load their tile of the
// input, which the amax pass only reads). Both are no-ops in a kernel launched the
// ordinary way.
//
// The wait sits behind a branch that is never taken (%nctaid.x is never 0): ptxas (CUDA
// 13.0) schedules a griddepcontrol.wait that shares a basic block with the loads before
// it ahead of them (delaying a load past the wait is always legal; SASS: ACQBULK before
// the first LDG), so without the branch those loads went out only after the wait. The
// block boundary keeps them first in the cast-transpose, the NVFP4 both kernels and the
// rowwise cast; ptxas still sinks nvfp4_row's conditional loads past it.
__device__ __forceinline__ void pdl_wait() {
    asm volatile(
        "{\n\t"
        ".reg .pred p;\n\t"
        ".reg .u32 n;\n\t"
        "mov.u32 n, %nctaid.x;\n\t"
        "setp.eq.u32 p, n, 0;\n\t"
        "@p bra.uni PDL_WAITED;\n\t"
        "griddepcontrol.wait;\n\t"
        "PDL_WAITED:\n\t"
        "}" ::: "memory");
}
__device__ __forceinline__ void pdl_launch_dependents() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }

// The start of a one-pass kernel launched after any kernel (the host's `Order::WaitFirst`):
// the next programmatic launch may take the slots this kernel's CTAs free, and nothing
// is read or written before the kernel before has finished. What it gains is the launch
// and the CTAs' start, overlapped with the tail of the kernel before.
__device__ __forceinline__ void pdl_first() {
    pdl_launch_dependents();
    pdl_wait();
}

// The start of an amax pass, launched after any kernel like a one-pass kernel but
// followed by a second pass that reads its input before its own pdl_wait() (the host's
// `Order::OverlapAmaxPass`). That second pass may start once every CTA of this pass has
// called pdl_launch_dependents(), so the call must come after the wait: then every
// kernel before this pass, the one that wrote the input included, has finished when the
// second pass starts reading. (pdl_first()'s order would let it read an input that the
// kernel two launches back still writes.)
__device__ __forceinline__ void pdl_amax_first() {
    pdl_wait();
    pdl_launch_dependents();
}

// ---- input element types -------------------------------------------------------------

template <class T> struct In;
template <> struct In<float> {
    static constexpr bool bf16 = false;
    __device__ static float f32(float x) { return x; }
    __device__ static float from(float y) { return y; }
};
template <> struct In<__nv_bfloat16> {
    static constexpr bool bf16 = true;
    __device__ static float f32(__nv_bfloat16 x) { return __bfloat162float(x); }
    __device__ static __nv_bfloat16 from(float y) { return __float2bfloat16_rn(y); }
};
template <> struct In<__half> {
    static constexpr bool bf16 = false;
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

// Two FP8 bytes (bits 0-7 and 8-15 of `two`) to two floats, exactly (through f16x2).
template <bool E4M3> __device__ __forceinline__ void fp8x2_to_f32(uint32_t two, float* v) {
    uint32_t h;
    const uint16_t in = (uint16_t)two;
    if (E4M3) {
        asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h) : "h"(in));
    } else {
        asm("cvt.rn.f16x2.e5m2x2 %0, %1;" : "=r"(h) : "h"(in));
    }
    v[0] = __half2float(__ushort_as_half((unsigned short)(h & 0xFFFF)));
    v[1] = __half2float(__ushort_as_half((unsigned short)(h >> 16)));
}

// FP8 byte to float (exact, via f16).
template <bool E4M3> __device__ __forceinline__ float fp8_to_f32(uint8_t b) {
    float v[2];
    fp8x2_to_f32<E4M3>(b, v);
    return v[0];
}

// ---- packed pairs of 2-byte inputs ----------------------------------------------------

template <class T> struct Pair;
template <> struct Pair<__nv_bfloat16> { using type = __nv_bfloat162; };
template <> struct Pair<__half> { using type = __half2; };

// |x| of the two elements of a raw word of 2-byte T.
template <class T> __device__ __forceinline__ typename Pair<T>::type abs2(uint32_t w) {
    return __habs2(*reinterpret_cast<const typename Pair<T>::type*>(&w));
}

// The NaN-ignoring max of |x| over E consecutive elements of T given as their raw 32-bit
// words (0 when every one is NaN), equal to the fmaxf chain over the floats. For 2-byte
// types one packed |.| and max per two values (__hmax2 returns the non-NaN operand, as
// fmaxf does, and the max of exactly converted values is the converted max), which
// saves slots on the integer pipe.
template <class T, int E> __device__ __forceinline__ float amax_of(const uint32_t* w) {
    if constexpr (sizeof(T) == 4) {
        float a = 0.0f;
#pragma unroll
        for (int i = 0; i < E; ++i) a = fmaxf(a, fabsf(__uint_as_float(w[i])));
        return a;
    } else {
        auto mx = abs2<T>(w[0]);
#pragma unroll
        for (int i = 1; i < E / 2; ++i) mx = __hmax2(mx, abs2<T>(w[i]));
        return fmaxf(fmaxf(0.0f, In<T>::f32(mx.x)), In<T>::f32(mx.y));
    }
}

// Max of two raw words of 2-byte T as pairs: NaN-ignoring per half, as fmaxf, or with
// Nan = true NaN-propagating (a NaN anywhere makes that half NaN).
template <class T, bool Nan = false> __device__ __forceinline__ uint32_t hmax2w(uint32_t a, uint32_t b) {
    using P = typename Pair<T>::type;
    const P& pa = *reinterpret_cast<const P*>(&a);
    const P& pb = *reinterpret_cast<const P*>(&b);
    const P r = Nan ? __hmax2_nan(pa, pb) : __hmax2(pa, pb);
    return *reinterpret_cast<const uint32_t*>(&r);
}

// The max of a float over this lane and the lanes xor each of Masks (NaN-ignoring).
template <int... Masks> __device__ __forceinline__ float fmax_lanes(float a) {
    ((a = fmaxf(a, __shfl_xor_sync(0xFFFFFFFFu, a, Masks))), ...);
    return a;
}

// The low and the high element of a raw word of 2-byte T, as float (exact).
template <class T> __device__ __forceinline__ float lo_f32(uint32_t w) {
    if constexpr (In<T>::bf16) return __uint_as_float(w << 16);
    else return __half2float(__ushort_as_half((unsigned short)(w & 0xFFFFu)));
}
template <class T> __device__ __forceinline__ float hi_f32(uint32_t w) {
    if constexpr (In<T>::bf16) return __uint_as_float(w & 0xFFFF0000u);
    else return __half2float(__ushort_as_half((unsigned short)(w >> 16)));
}

// The max of a packed word of 2-byte T over this lane and the lanes xor each of Masks,
// then its two halves as floats, 0 for a half that stayed NaN (as the fmaxf chain from 0).
template <class T, int... Masks> __device__ __forceinline__ void hmax2_lanes(uint32_t w, float& lo, float& hi) {
    ((w = hmax2w<T>(w, __shfl_xor_sync(0xFFFFFFFFu, w, Masks))), ...);
    lo = fmaxf(0.0f, lo_f32<T>(w));
    hi = fmaxf(0.0f, hi_f32<T>(w));
}

// (max of row A, max of row B) from the packed pair maxima hA of row A and hB of row B
// (NaN policy as hmax2w).
template <class T, bool Nan = false> __device__ __forceinline__ uint32_t hmax2_rows(uint32_t hA, uint32_t hB) {
    return hmax2w<T, Nan>(__byte_perm(hA, hB, 0x5410), __byte_perm(hA, hB, 0x7632));
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

// TE's float_to_e8m0 for a non-negative value (spec/formats.md 2.3): the exponent,
// rounded up when a mantissa remains (not from 0xFE, nor for subnormals up to half the
// least normal); NaN -> 0xFF, Inf -> 0xFE. Selects only, no branch.
__device__ __forceinline__ uint8_t float_to_e8m0(float v) {
    const uint32_t bits = __float_as_uint(v) & 0x7FFFFFFFu;
    const uint32_t e = bits >> 23, m = bits & 0x7FFFFFu;
    const bool up = m != 0 && e < 0xFE && (e != 0 || m > 0x400000u);
    const uint32_t r = bits > 0x7F800000u ? 0xFFu : bits == 0x7F800000u ? 0xFEu : e + (up ? 1u : 0u);
    return (uint8_t)r;
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

// Byte (i, j) of a padded [rows, cols] scale grid, swizzled or row-major (compact).
__device__ __forceinline__ u64 scale_index(u64 i, u64 j, u64 cols, bool swizzled) {
    return swizzled ? swizzled_index(i, j, cols) : i * cols + j;
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

// ---- dequantizers --------------------------------------------------------------------------
//
// A dequantizer writes two or four output bytes per byte it reads, so its stores decide its
// speed. Measured on an H200 (bench/cuda/dequant_variants.cu, E4M3 to bf16 at 16384x8192,
// of a copy of the output's size): a thread per 16 values (one 16-byte load, two 16-byte
// stores, each warp instruction covering every other half of 1 KiB) in a grid capped at
// four waves, the loop before 2026-12-04, ran at 0.61-0.65, with four such units in
// flight per thread no better, with a thread for every unit 0.90-0.92; a thread per 8
// values (an 8-byte load and ONE 16-byte store, 512 contiguous bytes a warp) for every
// unit at 0.96. So a unit is what one 16-byte store holds (DEQ_VALS values), a thread
// takes DEQ_UNITS of them (for_units), and the grid covers every unit. The transposed
// (columnwise) FP8 data goes through shared memory (fp8_dequant_cols).

// Output elements in one 16-byte store: 8 of bf16 or f16, 4 of f32.
template <class T> constexpr int DEQ_VALS = 16 / (int)sizeof(T);

// a / b and a % b, in 32 bits when both fit (a 64-bit division is a call of about 70
// instructions).
struct DivMod {
    u64 q, r;
};
__device__ __forceinline__ DivMod divmod(u64 a, u64 b) {
    if (((a | b) >> 32) == 0) {
        const uint32_t q = (uint32_t)a / (uint32_t)b;
        return {q, (uint32_t)a - q * (uint32_t)b};
    }
    return {a / b, a % b};
}

// The N bytes at p (N = 4 or 8, p N-byte aligned) as little-endian words.
template <int N> struct Bytes {
    uint32_t w[N / 4];
};
template <int N> __device__ __forceinline__ Bytes<N> load_bytes(const uint8_t* p) {
    static_assert(N == 4 || N == 8, "a dequantizer unit reads 4 or 8 bytes");
    Bytes<N> b;
    if constexpr (N == 8) {
        const uint2 v = *reinterpret_cast<const uint2*>(p);
        b.w[0] = v.x;
        b.w[1] = v.y;
    } else {
        b.w[0] = *reinterpret_cast<const uint32_t*>(p);
    }
    return b;
}

// The N FP8 bytes of b (byte j is element j) to floats, exactly.
template <bool E4M3, int N> __device__ __forceinline__ void fp8_bytes_to_f32(const Bytes<N>& b, float* v) {
#pragma unroll
    for (int j = 0; j < N; j += 2) fp8x2_to_f32<E4M3>(b.w[j / 4] >> (8 * (j % 4)), v + j);
}

// One 16-byte store of v to global memory at p (16-byte aligned), spelled out in PTX:
// where nvcc 13.0 cannot see p's alignment it splits `*reinterpret_cast<uint4*>(p) = v`
// into four 4-byte stores (the columnwise dequantizer got 32 STG.E for its 8 STG.E.128
// that way, and ran at half the speed).
__device__ __forceinline__ void store_global16(void* p, uint4 v) {
    asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
                 : "memory");
}

// The same for 8 bytes at p (8-byte aligned).
__device__ __forceinline__ void store_global8(void* p, uint2 v) {
    asm volatile("st.global.v2.b32 [%0], {%1, %2};" ::"l"(p), "r"(v.x), "r"(v.y) : "memory");
}

// N floats rounded to T (to nearest even) and stored at p (16-byte aligned, global) in
// 16-byte vectors; N * sizeof(T) a multiple of 16.
template <int N, class T> __device__ __forceinline__ void store_vec(T* p, const float* v) {
    static_assert(N * sizeof(T) % 16 == 0, "whole 16-byte vectors");
    constexpr int L = N * sizeof(T) / 16;
    union { uint4 u[L]; T e[N]; } b;
#pragma unroll
    for (int j = 0; j < N; ++j) b.e[j] = In<T>::from(v[j]);
#pragma unroll
    for (int l = 0; l < L; ++l) store_global16(reinterpret_cast<uint4*>(p) + l, b.u[l]);
}

// The dequantizers' fallback for rows that do not split into vectors: the threads stride
// over y's m * k elements one at a time; q holds them in y's order, or transposed ([k, m])
// when `transposed`.
template <class T, bool E4M3, class Scale>
__device__ __forceinline__ void fp8_dequant_each(const uint8_t* __restrict__ q, T* __restrict__ y, u64 m, u64 k,
                                                 bool transposed, Scale scale) {
    const u64 n = m * k, stride = (u64)gridDim.x * blockDim.x;
    for (u64 e = (u64)blockIdx.x * blockDim.x + threadIdx.x; e < n; e += stride) {
        const DivMod p = divmod(e, k);
        y[e] = In<T>::from(fp8_to_f32<E4M3>(q[transposed ? p.r * m + p.q : e]) * scale(p.q, p.r));
    }
}

// Units a dequantizing thread takes. A warp takes 32 * DEQ_UNITS consecutive units, lane
// l the units l, l + 32, ..., so each of its store instructions still covers 512
// contiguous bytes, and a thread issues all its loads (data and scales) before its first
// store. Two units a thread took the NVFP4 rowwise dequantizer from 0.765 to 0.945 of a
// copy at 16384x8192 (0.855 -> 0.954 at 4096x4096); four were no better.
constexpr int DEQ_UNITS = 2;

// The loop of the dequantizers that give a thread DEQ_UNITS units of `units`: load(g)
// returns what unit g needs from memory, finish(g, loaded) converts and stores it.
// Launch: ceil(units / DEQ_UNITS) threads in CTAs of a multiple of 32.
template <class Load, class Finish>
__device__ __forceinline__ void for_units(u64 units, Load load, Finish finish) {
    const u64 t = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    const u64 first = t / 32 * 32 * DEQ_UNITS + t % 32;
    decltype(load(first)) loaded[DEQ_UNITS];
#pragma unroll
    for (int u = 0; u < DEQ_UNITS; ++u)
        if (first + 32 * u < units) loaded[u] = load(first + 32 * u);
#pragma unroll
    for (int u = 0; u < DEQ_UNITS; ++u)
        if (first + 32 * u < units) finish(first + 32 * u, loaded[u]);
}

// Rowwise-ordered FP8 dequantization: q holds y's [m, k] elements in y's order (rowwise
// FP8 data, and MXFP8's columnwise data, which is not transposed). scale(r, c) is the
// multiplier of element (r, c) and must be constant over each run of DEQ_VALS<T>
// elements of a row that starts at a multiple of DEQ_VALS<T> (per-tensor scales, and
// blocks of 16, 32 or 128). Launch: ceil(m * k / DEQ_VALS<T> / DEQ_UNITS) threads. When
// k % DEQ_VALS<T> == 0 a unit is DEQ_VALS<T> elements (one 4- or 8-byte load, one
// scale, one 16-byte store; for_units); otherwise the threads stride over single
// elements. y = fp8 * scale, rounded once to T.
template <class T, bool E4M3, class Scale>
__device__ __forceinline__ void fp8_dequant_rows(const uint8_t* __restrict__ q, T* __restrict__ y, u64 m,
                                                 u64 k, Scale scale) {
    constexpr int V = DEQ_VALS<T>;
    const u64 n = m * k;
    if (k % V == 0) {
        struct Unit {
            Bytes<V> b;
            float s;
        };
        for_units(
            n / V,
            [&](u64 g) {
                const DivMod p = divmod(V * g, k);
                return Unit{load_bytes<V>(q + V * g), scale(p.q, p.r)};
            },
            [&](u64 g, const Unit& l) {
                float v[V];
                fp8_bytes_to_f32<E4M3>(l.b, v);
#pragma unroll
                for (int j = 0; j < V; ++j) v[j] = v[j] * l.s;
                store_vec<V>(y + V * g, v);
            });
        return;
    }
    fp8_dequant_each<T, E4M3>(q, y, m, k, false, scale);
}

// The shared-memory tiles of fp8_dequant_cols: DEQ_TILE_K stored rows (output columns) by
// DEQ_TILE_M stored columns (output rows), a CTA of 256 threads; DEQ_TILE_K_TALL rows
// for the tall entry points, which the launch picks when their grid fills the card
// (`DeqColsTiles` in src/cuda/grid.rs), built for DEQ_T_TALL_MINB CTAs per SM: on an
// H100 (bf16) 4 ran at 0.88-1.06 of a copy, 6 alike from 8192x8192 up but 2-6% slower
// below, 8 at 0.77-0.99.
constexpr int DEQ_TILE_K = 64, DEQ_TILE_K_TALL = 128, DEQ_TILE_M = 256;
#ifndef DEQ_T_TALL_MINB
#define DEQ_T_TALL_MINB 4
#endif

// Columnwise FP8 dequantization: q is the [k, m] transpose of y [m, k] (FP8 per-tensor and
// block columnwise data), scale(r, c) as in fp8_dequant_rows but constant over runs of 4
// output rows. Launch: one CTA of 256 threads per TK x 256 tile of q (the library: TK =
// 64, or 128 in its tall entry points), ceil(k / TK) * ceil(m / 256) CTAs. When m % 16 == 0 a CTA copies its tile into shared
// memory (16-byte loads, coalesced along q's rows), then each thread turns 8 q rows x 4 q
// columns (eight 4-byte shared reads, gathered pairwise with PRMT) into 4 rows x 8
// columns of y: one 16-byte store a row when k % 8 == 0 (a warp writes 2 TK contiguous
// bytes of bf16 of each of 256 / TK rows). On an H200 this ran at 0.82 of a copy at 16384x8192 and 1.01
// at 4096x4096, where a thread per 16 q bytes storing down one column (the kernel before
// 2026-12-04) ran at 0.67 and 0.72, and tiles of 128x128 or 256x64 (longer y rows,
// shorter q rows) at 0.78 and 0.53 (bench/cuda/dequant_variants.cu). Tiles of 128 q rows
// (TK = 128, 4 CTAs per SM) halve the CTAs and double each one's bytes in flight: on an
// H100 (2026-12-06, bf16) 0.94-0.95 of a copy against 0.86-0.90 from 8192x8192 up and 1.06
// against 0.96 at 4096x4096 (512 CTAs, about one wave), but 0.88 against 0.90 at
// 2048x4096 (256 CTAs, half a wave). Otherwise a thread per element, striding over the
// grid.
//
// STAGED (block scaling): scale(r, c) depends on r only through r / 128, and the CTA
// stages its tile's 2 x TK scales in shared memory, loaded with its tile (one round trip
// to memory for a short tile, two for a tall one: see below), where each pass's 8 scales
// were loaded after the barrier (a second round trip a pass: 5 round trips a tall tile,
// 3 a short one). H100, 61 runs: FP8 block 1x128 columnwise -0.3% time at 16384x8192,
// -3.0% at 4096x4096. Otherwise (per-tensor scaling) scale is a constant the passes read
// directly.
template <class T, bool E4M3, int TK = DEQ_TILE_K, bool STAGED = false, class Scale>
__device__ __forceinline__ void fp8_dequant_cols(const uint8_t* __restrict__ q, T* __restrict__ y, u64 m, u64 k,
                                                 Scale scale) {
    static_assert(TK % 32 == 0 && TK <= 128, "whole loads and passes; swz inside a 64-word row");
    constexpr int LK = TK / 8;  // 8-row groups of the tile, lanes along k
    const u64 tiles_m = (m + DEQ_TILE_M - 1) / DEQ_TILE_M;
    if (m % 16 != 0) {
        fp8_dequant_each<T, E4M3>(q, y, m, k, true, scale);
        return;
    }
    // Row j of the tile holds its 256 bytes as 64 words, word w at w ^ swz(j): with
    // swz(j) = 4 * ((j / 8) % LK) the eight 8-row groups a warp reads at once (below) sit
    // in different banks when TK = 64 (with TK = 128 its 16 groups pair up: two-way
    // conflicts), and each 16-byte copy stays whole and aligned.
    __shared__ __align__(16) uint32_t tile[TK][DEQ_TILE_M / 4];
    auto swz = [](int j) { return 4 * ((j / 8) % LK); };
    // The launch has a CTA per tile, so tiles_m < 2^32.
    const uint32_t tm = (uint32_t)tiles_m;
    const u64 k0 = (u64)(blockIdx.x / tm) * TK, m0 = (u64)(blockIdx.x % tm) * DEQ_TILE_M;
    const int tid = threadIdx.x;
    // STAGED: the scale of the tile's 128-row group g (DEQ_TILE_M = 256 rows, from a
    // multiple of 256) and column k0 + c at staged[g][c], 0 past m or k (read by no pass
    // that stores); thread tid < 2 TK loads entry (sg, sc) = (tid / TK, tid % TK).
    static_assert(DEQ_TILE_M == 256, "two 128-row scale groups a tile");
    __shared__ __align__(16) float staged[STAGED ? 2 : 1][STAGED ? TK : 4];
    const bool stages = STAGED && tid < 2 * TK;
    auto scale_value = [&] {
        const int sg = tid / TK, sc = tid % TK;
        return m0 + 128 * sg < m && k0 + sc < k ? scale(m0 + 128 * sg, k0 + sc) : 0.0f;
    };
    float mine = 0.0f;
    // Loaded before the tile, the scale shares its round trip (the SASS shows it). The
    // tall tile's 8 loads fill the 64 registers: with a scale loaded first ptxas issues
    // 4, stores one, then issues the rest, so the tall tile loads its scale after them
    // (a second round trip, where the passes took one each).
    constexpr bool SCALE_FIRST = TK / 16 <= 4;
    if (SCALE_FIRST && stages) mine = scale_value();
#pragma unroll
    for (int i = 0; i < TK / 16; ++i) {
        const int j = tid / 16 + 16 * i, ch = tid % 16;
        uint4 v = {0, 0, 0, 0};
        if (k0 + j < k && m0 + 16 * ch < m) v = *reinterpret_cast<const uint4*>(q + (k0 + j) * m + m0 + 16 * ch);
        *reinterpret_cast<uint4*>(&tile[j][(4 * ch) ^ swz(j)]) = v;
    }
    if (!SCALE_FIRST && stages) mine = scale_value();
    if (stages) staged[tid / TK][tid % TK] = mine;
    __syncthreads();
    // Thread -> (kg: q rows 8 kg .. + 7, mq: q columns 4 mq .. + 3) for LK x 64 pairs in
    // TK / 32 passes; a warp takes all LK kg by 32 / LK mq (16 LK contiguous bytes of each
    // y row it writes: 128 when TK = 64), and its 8-row groups differ in swz.
#pragma unroll
    for (int pass = 0; pass < TK / 32; ++pass) {
        const int idx = tid + 256 * pass, kg = idx % LK, mq = idx / LK;
        const u64 r0 = m0 + 4 * mq, c0 = k0 + 8 * kg;
        if (r0 >= m || c0 >= k) continue;
        T* out = y + r0 * k + c0;
        uint32_t w[8];
        float s[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            w[j] = tile[8 * kg + j][mq ^ swz(8 * kg + j)];
            // In bounds; unused past k.
            s[j] = STAGED ? staged[(4 * mq) / 128][8 * kg + j] : scale(r0, c0 + j < k ? c0 + j : k - 1);
        }
#pragma unroll
        for (int b = 0; b < 4; ++b) {
            const uint32_t sel = b | ((4 + b) << 4);
            float v[8];
#pragma unroll
            for (int p = 0; p < 4; ++p) {
                fp8x2_to_f32<E4M3>(__byte_perm(w[2 * p], w[2 * p + 1], sel), v + 2 * p);
                v[2 * p] = v[2 * p] * s[2 * p];
                v[2 * p + 1] = v[2 * p + 1] * s[2 * p + 1];
            }
            T* row = out + b * k;
            if (k % 8 == 0) {
                store_vec<8>(row, v);
            } else {
#pragma unroll
                for (int j = 0; j < 8; ++j)
                    if (c0 + j < k) row[j] = In<T>::from(v[j]);
            }
        }
    }
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

// ---- 128x128 tiles held in registers ---------------------------------------------------
//
// A CTA of 256 threads holds a 128x128 tile of the input: thread t owns the 4 consecutive
// rows 4*(t/8) .. +3 and, in each of them, 16 columns made of L = 16/V runs of V elements
// (V = elements per 16-byte vector): run l covers columns l*8V + (t%8)*V .. +V. The 8
// threads of a row group load one contiguous 8V-element (128-byte) stretch per
// instruction, so every 16-byte load and every store of a row is fully coalesced.

// Tile column of element j (0..15) of column group cg, for runs of V elements (shared by
// Tile128 and the transposed staging, Transposed128::put_rows).
template <int V> __device__ __forceinline__ int tile128_col(int cg, int j) { return (j / V) * 8 * V + cg * V + j % V; }

// The tile of a thread, as described above.
template <class T> struct Tile128 {
    static constexpr int V = 16 / (int)sizeof(T);  // elements per 16-byte vector
    static constexpr int L = 16 / V;               // vectors per row and thread
    union {
        uint4 u[4][L];
        uint32_t w[4][4 * L];  // 2-byte T: word p holds elements 2p, 2p + 1
        T e[4][16];
    } d;

    // Tile column of element j (0..15) of column group cg.
    __device__ static int col(int cg, int j) { return tile128_col<V>(cg, j); }

    __device__ float at(int i, int j) const {
        if constexpr (sizeof(T) == 2) return j % 2 ? hi_f32<T>(d.w[i][j / 2]) : lo_f32<T>(d.w[i][j / 2]);
        else return d.e[i][j];
    }

    // NaN-ignoring max |x| of each of the thread's 4 rows over the 128 columns of the tile
    // (its 16 columns, then the 8 lanes of its row group), in every lane of the group.
    // 2-byte inputs reduce as packed pairs, two rows sharing each shuffle.
    __device__ void row_amax(float* ra) const {
        if constexpr (sizeof(T) == 2) {
#pragma unroll
            for (int q = 0; q < 2; ++q) {  // rows 2q, 2q + 1
                uint32_t h[2];
#pragma unroll
                for (int t = 0; t < 2; ++t) {
                    uint32_t a = d.w[2 * q + t][0] & 0x7FFF7FFFu;
#pragma unroll
                    for (int p = 1; p < 8; ++p) a = hmax2w<T>(a, d.w[2 * q + t][p] & 0x7FFF7FFFu);
                    h[t] = a;
                }
                hmax2_lanes<T, 1, 2, 4>(hmax2_rows<T>(h[0], h[1]), ra[2 * q], ra[2 * q + 1]);
            }
        } else {
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                float a = 0.0f;
#pragma unroll
                for (int j = 0; j < 16; ++j) a = fmaxf(a, fabsf(at(i, j)));
                ra[i] = fmax_lanes<1, 2, 4>(a);
            }
        }
    }

    // NaN-ignoring max |x| of the thread's columns 8*half .. 8*half + 7 (of its 16) into
    // ca[0 .. 8), each over the 16 rows of its warp (its 4 rows, then the 4 row groups of
    // the warp, lanes xor 8, 16).
    __device__ void col_amax(float* ca, int half) const {
        if constexpr (sizeof(T) == 2) {
#pragma unroll
            for (int p = 0; p < 4; ++p) {
                const int q = 4 * half + p;
                const uint32_t a = hmax2w<T>(hmax2w<T>(d.w[0][q] & 0x7FFF7FFFu, d.w[1][q] & 0x7FFF7FFFu),
                                             hmax2w<T>(d.w[2][q] & 0x7FFF7FFFu, d.w[3][q] & 0x7FFF7FFFu));
                hmax2_lanes<T, 8, 16>(a, ca[2 * p], ca[2 * p + 1]);
            }
        } else {
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                const int c = 8 * half + j;
                const float a = fmaxf(fmaxf(fabsf(at(0, c)), fabsf(at(1, c))), fmaxf(fabsf(at(2, c)), fabsf(at(3, c))));
                ca[j] = fmax_lanes<8, 16>(a);
            }
        }
    }

    // Loads rows m0 + 4*rg .. +3 of x [m, k] (columns from k0); zeros outside the matrix.
    // Full: the tile is known to lie inside the matrix with k a multiple of V (no checks).
    template <bool Full = false>
    __device__ void load(const T* __restrict__ x, u64 m, u64 k, u64 m0, u64 k0, int rg, int cg) {
        const bool vec = (k % V) == 0;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const u64 r = m0 + 4 * rg + i;
#pragma unroll
            for (int l = 0; l < L; ++l) {
                const u64 c = k0 + l * 8 * V + cg * V;
                if (Full || (vec && r < m && c + V <= k)) {
                    d.u[i][l] = *reinterpret_cast<const uint4*>(x + r * k + c);
                } else {
                    d.u[i][l] = make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
                    for (int j = 0; j < V; ++j)
                        if (r < m && c + j < k) d.e[i][l * V + j] = x[r * k + c + j];
                }
            }
        }
    }
};

// Whether the 128x128 tile at (m0, k0) of an [m, k] matrix of T takes the kernels' Full
// path: inside the matrix, rows in whole 16-byte vectors (k a multiple of V) and the
// transposed rows too (m a multiple of 16). The tile kernels branch on it once, so that
// the common tile runs without bounds checks (and their registers: the 128x128 kernels
// keep their tile in 64 registers only on this path).
template <class T>
__device__ __forceinline__ bool full_tile(u64 m, u64 k, u64 m0, u64 k0) {
    return m0 + 128 <= m && k0 + 128 <= k && (k % Tile128<T>::V) == 0 && (m % 16) == 0;
}

// 4x4 byte transpose: out[b] byte i = in[i] byte b.
__device__ __forceinline__ void transpose4x4(const uint32_t* in, uint32_t* out) {
    const uint32_t t0 = __byte_perm(in[0], in[1], 0x5140), t1 = __byte_perm(in[2], in[3], 0x5140);
    const uint32_t t2 = __byte_perm(in[0], in[1], 0x7362), t3 = __byte_perm(in[2], in[3], 0x7362);
    out[0] = __byte_perm(t0, t1, 0x5410);
    out[1] = __byte_perm(t0, t1, 0x7632);
    out[2] = __byte_perm(t2, t3, 0x5410);
    out[3] = __byte_perm(t2, t3, 0x7632);
}

// The 16 values a thread holds of row r in the 128 columns from k0, laid out as one row of
// Tile128 (lane cg of the row's 8: columns col(cg, 0 .. 15), 16-byte loads); zeros outside
// the matrix.
template <class T> struct Row16 {
    using Tl = Tile128<T>;
    union {
        uint4 u[Tl::L];
        uint32_t w[4 * Tl::L];
        T e[16];
    } d;

    __device__ void load(const T* __restrict__ x, u64 m, u64 k, u64 r, u64 k0, int cg) {
        constexpr int V = Tl::V;
        const bool vec = (k % V) == 0;
#pragma unroll
        for (int l = 0; l < Tl::L; ++l) {
            const u64 c = k0 + l * 8 * V + cg * V;
            if (vec && r < m && c + V <= k) {
                d.u[l] = *reinterpret_cast<const uint4*>(x + r * k + c);
            } else {
                d.u[l] = make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
                for (int j = 0; j < V; ++j)
                    if (r < m && c + j < k) d.e[l * V + j] = x[r * k + c + j];
            }
        }
    }

    __device__ float at(int j) const { return In<T>::f32(d.e[j]); }

    // NaN-ignoring max |x| of the 16 values.
    __device__ float amax() const { return amax_of<T, 16>(d.w); }

    // The 16 values times s as FP8 bytes, four to a word (word q: values 4q .. 4q+3).
    template <bool E4M3> __device__ void fp8(float s, uint32_t* w) const {
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            const uint32_t lo = fp8x2<E4M3>(__fmul_rn(at(4 * q), s), __fmul_rn(at(4 * q + 1), s));
            const uint32_t hi = fp8x2<E4M3>(__fmul_rn(at(4 * q + 2), s), __fmul_rn(at(4 * q + 3), s));
            w[q] = lo | (hi << 16);
        }
    }
};

// 16 bytes v (little-endian words) into row gk of qt [k, m] at column gm (a multiple of
// 16, below m): one vector store when m is a multiple of 16 (known when Full), else the
// bytes below m.
template <bool Full = false>
__device__ __forceinline__ void store16_t(uint8_t* __restrict__ qt, u64 m, u64 gk, u64 gm, uint4 v) {
    if (Full || (m % 16) == 0) {
        *reinterpret_cast<uint4*>(qt + gk * m + gm) = v;
    } else {
        const uint32_t ws[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int b = 0; b < 16; ++b)
            if (gm + b < m) qt[gk * m + gm + b] = (uint8_t)(ws[b / 4] >> (8 * (b % 4)));
    }
}

// Shared staging of a transposed 128x128 byte tile: row c (a column of the input tile)
// holds 32 words, word g packing input rows 4g .. 4g+3. Word g of row c is stored at
// g ^ swz(c), which keeps each aligned group of 4 words together (16-byte reads) and
// spreads the 32 lanes of a warp's word stores over 32 banks. The 16-byte reads need the
// struct 16-byte aligned: as a plain word array it is only 4-byte aligned, and a kernel
// that declares another shared variable first (an 8-byte mbarrier) got it at 8 past a
// 16-byte boundary (CUDA_ERROR_MISALIGNED_ADDRESS, H200 and H100).
template <int V> struct __align__(16) Transposed128 {
    uint32_t w[128][32];
    __device__ static int swz(int c) { return ((c / V) & 7) << 2; }
    __device__ void put(int c, int g, uint32_t v) { w[c][g ^ swz(c)] = v; }
    // Stages the FP8 bytes of one thread of a Tile128 (the same V) transposed: wr[i][w]
    // holds row 4*rg + i at the columns Tile128::col(cg, 4w .. 4w+3).
    __device__ __forceinline__ void put_rows(const uint32_t (&wr)[4][4], int cg, int rg) {
#pragma unroll
        for (int w = 0; w < 4; ++w) {
            const uint32_t in[4] = {wr[0][w], wr[1][w], wr[2][w], wr[3][w]};
            uint32_t out[4];
            transpose4x4(in, out);
#pragma unroll
            for (int b = 0; b < 4; ++b) put(tile128_col<V>(cg, 4 * w + b), rg, out[b]);
        }
    }
    // Writes the staged tile to qt [k, m] at (k0, m0): 16 bytes per thread and step.
    // Full: the tile lies inside the matrix and m is a multiple of 16 (no checks).
    template <bool Full = false>
    __device__ void store(uint8_t* __restrict__ qt, u64 m, u64 k, u64 m0, u64 k0) const {
#pragma unroll
        for (int p = 0; p < 4; ++p) {
            const int idx = threadIdx.x + 256 * p;
            const int c = idx / 8, q = idx % 8;
            const u64 gk = k0 + c, gm = m0 + 16 * q;
            if (!Full && (gk >= k || gm >= m)) continue;
            store16_t<Full>(qt, m, gk, gm, *reinterpret_cast<const uint4*>(&w[c][(4 * q) ^ swz(c)]));
        }
    }
};

// Stores the bytes of row r, element run l (V bytes, packed little-endian in `w`, V/4
// words) of a 128x128 tile at q [m, k], column c (vector store when aligned). Full: the
// run is known to lie inside the matrix with k a multiple of V (no checks).
template <int V, bool Full = false>
__device__ __forceinline__ void store_run(uint8_t* __restrict__ q, u64 m, u64 k, u64 r, u64 c,
                                          const uint32_t* w) {
    if (!Full && r >= m) return;
    if (Full || ((k % V) == 0 && c + V <= k)) {
        if constexpr (V == 8) {
            *reinterpret_cast<uint2*>(q + r * k + c) = make_uint2(w[0], w[1]);
        } else if constexpr (V == 4) {
            *reinterpret_cast<uint32_t*>(q + r * k + c) = w[0];
        } else {
            *reinterpret_cast<uint16_t*>(q + r * k + c) = (uint16_t)w[0];
        }
    } else {
#pragma unroll
        for (int j = 0; j < V; ++j)
            if (c + j < k) q[r * k + c + j] = (uint8_t)(w[j / 4] >> (8 * (j % 4)));
    }
}

// ---- tile grids --------------------------------------------------------------------------

// The CTA's place on a 1-D grid, last first when `last_first`. Kernels that run right
// after an amax pass over the same input (current scaling, NVFP4) take their work last
// first: the amax pass reads the tensor front to back, so its last lines are still in
// L2 when the second pass starts from the back. On an H200 this moved FP8 current
// scaling (both orientations) at 4096x4096 from 0.82 to 0.88 of its two-pass floor, and
// NVFP4 at 16384x8192 by about 0.01 (BENCHMARKS.md, 2026-12-03, late).
__device__ __forceinline__ uint32_t cta_order(bool last_first) {
    return last_first ? gridDim.x - 1u - blockIdx.x : blockIdx.x;
}

// The tile kernels run on a 1-D grid over their tiles in row-major order: CTA b takes
// tile row b / gy and tile column b % gy of a grid with gy tile columns, so CTAs that
// run together read the same rows and fill the same scale rows. On an H200 this order
// moved the tile kernels 4-10% against the column-major order of a 2-D grid
// (blockIdx.x over rows): partially written sectors of the outputs and scales were
// merged in L2 instead of being evicted half-written (BENCHMARKS.md, 2026-12-03).
// In 32 bits (the launch has at most 2^31 - 1 tiles): a 64-bit division here cost the
// compute-bound NVFP4 kernels 15%.
__device__ __forceinline__ u64 tile_row(u64 gy, bool last_first = false) {
    return cta_order(last_first) / (uint32_t)gy;
}
__device__ __forceinline__ u64 tile_col(u64 gy, bool last_first = false) {
    return cta_order(last_first) % (uint32_t)gy;
}

// Banded order, for kernels whose columnwise scales are a few bytes per column and tile:
// bands of h = 2^band_log2(gx) tile rows (at most 8), each band taken tile column by
// tile column with its tile rows fastest, so that the CTAs filling one 128-byte line of
// a compact columnwise scale grid run together (HBM writes whole sectors; a line
// completed by CTAs waves apart was written back in pieces), and the neighbours in a
// rowwise scale row run within a band's width of each other. The launch is 2-D (the
// host's `banded_grid`): blockIdx.x = col * h + row within the band, blockIdx.y = band,
// so the mapping is shifts and masks (the divisions of a 1-D mapping cost the
// NVFP4 kernel about 80 instructions per thread). The only user follows an amax pass,
// so bands, and the tiles in them, run last first (see cta_order). Tiles of the last
// band past gx have row >= gx; their CTAs return at once. Bands of 8 tile rows measured
// within 0.02 of bands of 1, 2, 4 and 32 (the best by 0.003 to 0.02).
#ifndef TQ_BAND_ROWS_LOG2
#define TQ_BAND_ROWS_LOG2 3u
#endif
struct TileRC {
    uint32_t row, col;
};
// log2 of the band height for gx tile rows: the least power of two >= gx, at most
// 2^TQ_BAND_ROWS_LOG2.
__device__ __forceinline__ uint32_t band_log2(uint32_t gx) {
    return gx <= 1u ? 0u : min(TQ_BAND_ROWS_LOG2, 32u - (uint32_t)__clz(gx - 1u));
}
// The tile at index x within band `band` (bands of 2^hb tile rows, rows fastest).
__device__ __forceinline__ TileRC band_tile(uint32_t band, uint32_t x, uint32_t hb) {
    return {(band << hb) + (x & ((1u << hb) - 1u)), x >> hb};
}
__device__ __forceinline__ TileRC tile_banded(uint32_t gx) {
    const uint32_t hb = band_log2(gx);
    return band_tile(gridDim.y - 1u - blockIdx.y, cta_order(true), hb);
}
// Tile t of the same order walked as one sequence of `tiles` (the launch's CTAs, gy tile
// columns, the last band padded: row >= gx there), last first: the tile tile_banded
// gives the CTA launched t-th. For kernels whose CTAs walk several tiles.
__device__ __forceinline__ TileRC banded_tile(uint32_t t, uint32_t hb, uint32_t gy, uint32_t tiles) {
    const uint32_t r = tiles - 1u - t, band = r / (gy << hb);
    return band_tile(band, r - band * (gy << hb), hb);
}

// A warp's 32-row x 64-column tile in registers: lane l holds the 8 consecutive columns
// 8*(l%8) .. +7 of the 8 rows 8*(l/8) .. +7 as 16-byte vectors (one instruction covers 4
// rows x 128 bytes). Shapes are multiples of 32 (MXFP8), so a lane's 8 columns are all
// inside the matrix or all outside.
template <class T> struct Warp32x64 {
    static constexpr int W = 8 * (int)sizeof(T) / 16;  // 16-byte vectors per run of 8
    union {
        uint4 u[8][W];
        uint32_t w[8][4 * W];  // 2-byte T: word p holds columns 2p, 2p + 1
        T e[8][8];
    } d;

    __device__ float at(int i, int j) const {
        if constexpr (sizeof(T) == 2) return j % 2 ? hi_f32<T>(d.w[i][j / 2]) : lo_f32<T>(d.w[i][j / 2]);
        else return d.e[i][j];
    }

    // Rows r0 + 8*(lane/8) .. +7 of x [m, k] from column col (the lane's first); zeros
    // when col >= k.
    __device__ void load(const T* __restrict__ x, u64 k, u64 r0, u64 col, int lane) {
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const u64 r = r0 + 8 * (lane >> 3) + i;
#pragma unroll
            for (int w = 0; w < W; ++w)
                d.u[i][w] = col < k ? reinterpret_cast<const uint4*>(x + r * k + col)[w] : make_uint4(0u, 0u, 0u, 0u);
        }
    }
};
