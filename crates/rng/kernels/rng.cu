// tessera-rng kernels: Philox4x32-10 streams (spec/rng.md), bit-identical to the CPU
// reference in crates/rng/src/stream.rs.
//
// Fill kernels loop over their work with a grid stride, one Philox block (four 32-bit
// words) per step; dropout runs one thread per step of G blocks (4G elements, 16 bytes
// of input). Element e of a request uses word e of the request,
// i.e. block offset/4 + e/4, word e%4, whatever the launch shape.
//
// Each kernel comes in two forms: by value (seed and offset as arguments, for eager
// use) and graph-safe (`_gs`, reading seed and offset from a device buffer
// `state = {seed, offset}`, so a captured CUDA graph draws fresh numbers on each replay;
// `tessera_rng_advance` then moves the device offset on).
//
// Built with: nvcc -ptx -arch=sm_90 (cargo xtask ptx). No fast-math: every float
// operation below is IEEE round-to-nearest, and the products and sums that must match
// the CPU bit for bit are written with __fmul_rn / __fadd_rn so they cannot contract.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

typedef unsigned long long u64;

// ---------------------------------------------------------------------------------
// Philox4x32-10
// ---------------------------------------------------------------------------------

__device__ __forceinline__ uint4 philox4x32_10(uint4 c, uint2 k) {
#pragma unroll
    for (int round = 0; round < 10; ++round) {
        if (round > 0) {
            k.x += 0x9E3779B9u;
            k.y += 0xBB67AE85u;
        }
        const uint32_t hi0 = __umulhi(0xD2511F53u, c.x);
        const uint32_t lo0 = 0xD2511F53u * c.x;
        const uint32_t hi1 = __umulhi(0xCD9E8D57u, c.z);
        const uint32_t lo1 = 0xCD9E8D57u * c.z;
        c = make_uint4(hi1 ^ c.y ^ k.x, lo1, hi0 ^ c.w ^ k.y, lo0);
    }
    return c;
}

// Block `block` of the stream keyed by `seed`.
__device__ __forceinline__ uint4 stream_block(u64 seed, u64 block) {
    return philox4x32_10(make_uint4((uint32_t)block, (uint32_t)(block >> 32), 0u, 0u),
                         make_uint2((uint32_t)seed, (uint32_t)(seed >> 32)));
}

// (word >> 8) * 2^-24: exact.
__device__ __forceinline__ float uniform_from_word(uint32_t w) {
    return __fmul_rn((float)(w >> 8), 5.9604644775390625e-8f);
}

__device__ __forceinline__ uint32_t word_at(uint4 w, int i) {
    return i == 0 ? w.x : i == 1 ? w.y : i == 2 ? w.z : w.w;
}

// ---------------------------------------------------------------------------------
// Words, uniforms, normals: one Philox block -> four 32-bit outputs per step.
// ---------------------------------------------------------------------------------

struct WordsOp {
    __device__ __forceinline__ uint4 operator()(uint4 w) const { return w; }
};

struct UniformOp {
    __device__ __forceinline__ uint4 operator()(uint4 w) const {
        return make_uint4(__float_as_uint(uniform_from_word(w.x)),
                          __float_as_uint(uniform_from_word(w.y)),
                          __float_as_uint(uniform_from_word(w.z)),
                          __float_as_uint(uniform_from_word(w.w)));
    }
};

// Box-Muller on a word pair, in float: logf/sqrtf/sincospif are accurate to a couple of
// ulp; the CPU evaluates the same formula in double (see NORMAL_TOLERANCE).
__device__ __forceinline__ float2 normal_pair(uint32_t a, uint32_t b) {
    const float u1 = __fmul_rn((float)((a >> 8) + 1u), 5.9604644775390625e-8f);
    const float u2 = __fmul_rn((float)(b >> 8), 5.9604644775390625e-8f);
    const float r = sqrtf(-2.0f * logf(u1));
    float s, c;
    sincospif(2.0f * u2, &s, &c);
    return make_float2(__fmul_rn(r, c), __fmul_rn(r, s));
}

struct NormalOp {
    float mean, std;
    __device__ __forceinline__ float affine(float z) const {
        return __fadd_rn(mean, __fmul_rn(std, z));
    }
    __device__ __forceinline__ uint4 operator()(uint4 w) const {
        const float2 p = normal_pair(w.x, w.y);
        const float2 q = normal_pair(w.z, w.w);
        return make_uint4(__float_as_uint(affine(p.x)), __float_as_uint(affine(p.y)),
                          __float_as_uint(affine(q.x)), __float_as_uint(affine(q.y)));
    }
};

// The main loop writes whole blocks with 16-byte stores and no branch; the last,
// partial block (n % 4 words) is written by thread 0 afterwards. (A per-iteration tail
// test cost 15% of the bandwidth on an H200.)
template <class Op>
__device__ __forceinline__ void fill4(uint32_t* __restrict__ out, u64 n, u64 seed, u64 offset,
                                      Op op) {
    const u64 full = n / 4;
    const u64 first = offset / 4;
    const u64 tid = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    const u64 stride = (u64)gridDim.x * blockDim.x;
    uint4* __restrict__ out4 = reinterpret_cast<uint4*>(out);
    for (u64 b = tid; b < full; b += stride) out4[b] = op(stream_block(seed, first + b));
    if (tid == 0 && (n & 3)) {
        const uint4 v = op(stream_block(seed, first + full));
        for (int i = 0; i < (int)(n & 3); ++i) out[4 * full + i] = word_at(v, i);
    }
}

#define FILL_KERNELS(NAME, OP_EXPR, EXTRA_PARAMS)                                              \
    extern "C" __global__ void __launch_bounds__(256)                                          \
        tessera_rng_##NAME(uint32_t* __restrict__ out, u64 n, u64 seed, u64 offset EXTRA_PARAMS) { \
        fill4(out, n, seed, offset, OP_EXPR);                                                  \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(256) tessera_rng_##NAME##_gs(                 \
        uint32_t* __restrict__ out, u64 n, const u64* __restrict__ state EXTRA_PARAMS) {       \
        fill4(out, n, state[0], state[1], OP_EXPR);                                            \
    }

#define NO_PARAMS
#define NORMAL_PARAMS , float mean, float std

FILL_KERNELS(u32, WordsOp(), NO_PARAMS)
FILL_KERNELS(uniform, UniformOp(), NO_PARAMS)
FILL_KERNELS(normal, (NormalOp{mean, std}), NORMAL_PARAMS)

// ---------------------------------------------------------------------------------
// Dropout: keep element e iff uniform(word e) >= p; out = keep ? x * scale : +0;
// mask = keep. Each step handles G Philox blocks = 4G elements = 16 bytes of input.
// NaN results are the canonical NaN of each type (what the CPU writes too).
// ---------------------------------------------------------------------------------

template <class T> struct Elem;

template <> struct Elem<float> {
    static constexpr int G = 1;  // 4 floats = 16 bytes
    __device__ static float to_f32(float x) { return x; }
    __device__ static float from_f32(float y) { return y; }
};
template <> struct Elem<__nv_bfloat16> {
    static constexpr int G = 2;  // 8 bf16 = 16 bytes
    __device__ static float to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }
    __device__ static __nv_bfloat16 from_f32(float y) { return __float2bfloat16_rn(y); }
};
template <> struct Elem<__half> {
    static constexpr int G = 2;
    __device__ static float to_f32(__half x) { return __half2float(x); }
    __device__ static __half from_f32(float y) { return __float2half_rn(y); }
};

// A plain 16-byte global load: dropout streams its input once, so it stays off the
// read-only (ld.global.nc) path the compiler would pick for a const __restrict__ read
// (on an H200 the two measured within 1% of each other for this kernel).
__device__ __forceinline__ uint4 load16(const uint4* p) {
    uint4 v;
    asm volatile("ld.global.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

// The E mask bytes of one step, packed into one 4- or 8-byte store.
template <int E> struct MaskVec;
template <> struct MaskVec<4> {
    typedef uint32_t type;
    __device__ static uint32_t pack(const uint8_t* m) {
        return m[0] | (m[1] << 8) | (m[2] << 16) | ((uint32_t)m[3] << 24);
    }
};
template <> struct MaskVec<8> {
    typedef uint2 type;
    __device__ static uint2 pack(const uint8_t* m) {
        return make_uint2(MaskVec<4>::pack(m), MaskVec<4>::pack(m + 4));
    }
};

template <class T>
__device__ __forceinline__ T drop_one(T x, uint32_t w, float p, float scale, uint8_t& m) {
    const bool keep = uniform_from_word(w) >= p;
    m = keep ? 1 : 0;
    return keep ? Elem<T>::from_f32(__fmul_rn(Elem<T>::to_f32(x), scale))
                : Elem<T>::from_f32(0.0f);
}

// One thread per whole step (E elements, 16 bytes of input): the launch covers every
// step (grid_1d_cover), since a grid-stride loop ran 7% slower here on an H200. The
// thread after the last whole step writes the last n % E elements.
template <class T>
__device__ __forceinline__ void dropout_impl(const T* __restrict__ in, T* __restrict__ out,
                                             uint8_t* __restrict__ mask, u64 n, u64 seed,
                                             u64 offset, float p, float scale) {
    constexpr int G = Elem<T>::G;
    constexpr int E = 4 * G;  // elements per step
    static_assert(E * sizeof(T) == 16, "one 16-byte vector per step");
    typedef typename MaskVec<E>::type MaskT;
    const u64 full = n / E;
    const u64 first = offset / 4;
    const u64 s = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (s < full) {
        union {
            uint4 v;
            T x[E];
        } src, dst;
        src.v = load16(reinterpret_cast<const uint4*>(in) + s);
        uint4 words[G];
#pragma unroll
        for (int g = 0; g < G; ++g) words[g] = stream_block(seed, first + s * G + g);
        uint8_t m[E];
#pragma unroll
        for (int i = 0; i < E; ++i)
            dst.x[i] = drop_one(src.x[i], word_at(words[i / 4], i % 4), p, scale, m[i]);
        reinterpret_cast<uint4*>(out)[s] = dst.v;
        reinterpret_cast<MaskT*>(mask)[s] = MaskVec<E>::pack(m);
    } else if (s == full) {
        for (u64 e = full * E; e < n; ++e) {
            const uint4 w = stream_block(seed, first + e / 4);
            uint8_t mi;
            out[e] = drop_one(in[e], word_at(w, (int)(e % 4)), p, scale, mi);
            mask[e] = mi;
        }
    }
}

#define DROPOUT_KERNELS(SUFFIX, T)                                                             \
    extern "C" __global__ void __launch_bounds__(256) tessera_rng_dropout_##SUFFIX(            \
        const T* __restrict__ in, T* __restrict__ out, uint8_t* __restrict__ mask, u64 n,      \
        u64 seed, u64 offset, float p, float scale) {                                          \
        dropout_impl<T>(in, out, mask, n, seed, offset, p, scale);                             \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(256) tessera_rng_dropout_##SUFFIX##_gs(       \
        const T* __restrict__ in, T* __restrict__ out, uint8_t* __restrict__ mask, u64 n,      \
        const u64* __restrict__ state, float p, float scale) {                                 \
        dropout_impl<T>(in, out, mask, n, state[0], state[1], p, scale);                       \
    }

DROPOUT_KERNELS(f32, float)
DROPOUT_KERNELS(bf16, __nv_bfloat16)
DROPOUT_KERNELS(f16, __half)

// Moves a graph-safe generator's device offset past a request (one thread).
extern "C" __global__ void tessera_rng_advance(u64* state, u64 words) { state[1] += words; }
