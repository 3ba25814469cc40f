// tessera-collectives kernels: the reductions of the symmetric-memory all-reduce
// (crates/collectives/src/symmetric/), bit-identical to the ThreadGroup's reduction.
//
// Every rank of a single-host group owns one symmetric region (a plain cuMemAlloc
// allocation) and sees every other rank's region through a peer pointer (same process,
// peer access) or a CUDA IPC mapping (another process). The kernels get those addresses
// by value in `Peers`, entry r being rank r's region as this device addresses it.
//
// - `tessera_symm_reduce_<dtype>`: out[j] = reduce over r = 0..world of
//   src_r[begin + j], j < count. One-shot: every rank reduces the whole tensor
//   (begin = 0). Two-shot, first shot: rank r reduces its chunk into its own region.
// - `tessera_symm_gather`: two-shot, second shot: out = concat over s of chunk s read
//   from rank s's region.
//
// Ranks synchronise between the phases on the host (a stream sync and a group
// barrier), so the kernels never spin on flags and cannot hang; see the module docs.
//
// The reduction is the ThreadGroup's: contributions in rank order, each step rounded to
// the element type (bf16/f16 values widen exactly to f32, are combined in f32 with
// round-to-nearest, and round back to nearest-even like the `half` crate's
// `from_f32`), Max/Min return NaN (the bits `from_f32(f32::NAN)` gives) when either
// operand is NaN, Avg divides the sum by the world size at the end, integers wrap.
// NaN *payloads* of sums and products are not specified (x86 and the GPU propagate
// different ones).
//
// Built with: nvcc -ptx -arch=sm_90 (cargo xtask ptx). No fast-math; the float
// operations are written with __fadd_rn / __fmul_rn / __fdiv_rn so they cannot contract.

#include <cuda_fp16.h>
#include <stdint.h>

typedef unsigned long long u64;

// The most ranks a symmetric group may have (one host's GPUs); the Rust side checks.
#define SYMM_MAX_RANKS 8

// Rank r's address of the symmetric region (or of the buffer a phase reads), r < world.
struct Peers {
    u64 p[SYMM_MAX_RANKS];
};

// `ReduceOp` codes, as the Rust side passes them.
#define OP_SUM 0
#define OP_PROD 1
#define OP_MAX 2
#define OP_MIN 3
#define OP_AVG 4

// f32::NAN's bits (what Rust's `from(f32::NAN)` starts from).
#define F32_NAN_BITS 0x7FC00000u

// ---------------------------------------------------------------------------------
// Element types: storage type S, exact widening to f32, rounding back like `half`.
// ---------------------------------------------------------------------------------

struct F32 {
    typedef float S;
    static constexpr bool FLOAT = true;
    __device__ static float to(float x) { return x; }
    __device__ static float from(float y) { return y; }
};

// bf16 as raw bits; `from` is the `half` crate's f32_to_bf16: NaN keeps its upper bits
// and sets the quiet bit, otherwise round to nearest, ties to even.
struct BF16 {
    typedef uint16_t S;
    static constexpr bool FLOAT = true;
    __device__ static float to(uint16_t x) { return __uint_as_float((uint32_t)x << 16); }
    __device__ static uint16_t from(float y) {
        const uint32_t x = __float_as_uint(y);
        if ((x & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((x >> 16) | 0x0040u);
        const uint32_t round_bit = 0x00008000u;
        if ((x & round_bit) != 0 && (x & (3u * round_bit - 1u)) != 0) {
            return (uint16_t)((x >> 16) + 1u);
        }
        return (uint16_t)(x >> 16);
    }
};

// f16 as raw bits; `from` rounds to nearest even (as the `half` crate does, in hardware
// or software), and a NaN keeps its sign and upper payload bits with the quiet bit set.
struct F16 {
    typedef uint16_t S;
    static constexpr bool FLOAT = true;
    __device__ static float to(uint16_t x) { return __half2float(__ushort_as_half(x)); }
    __device__ static uint16_t from(float y) {
        const uint32_t x = __float_as_uint(y);
        if ((x & 0x7F800000u) == 0x7F800000u && (x & 0x007FFFFFu) != 0) {
            return (uint16_t)(((x & 0x80000000u) >> 16) | 0x7C00u | 0x0200u |
                              ((x & 0x007FFFFFu) >> 13));
        }
        return __half_as_ushort(__float2half_rn(y));
    }
};

// Integers: wrapping sum and product (computed unsigned: signed overflow is undefined in
// C++), max and min.
template <class T, class U> struct Int {
    typedef T S;
    static constexpr bool FLOAT = false;
};

// ---------------------------------------------------------------------------------
// One reduction step and the final step, exactly as the ThreadGroup's reduce.
// ---------------------------------------------------------------------------------

template <class E, int OP>
__device__ __forceinline__ typename E::S combine_float(typename E::S a, typename E::S b) {
    const float x = E::to(a), y = E::to(b);
    if (OP == OP_SUM || OP == OP_AVG) return E::from(__fadd_rn(x, y));
    if (OP == OP_PROD) return E::from(__fmul_rn(x, y));
    if (isnan(x) || isnan(y)) return E::from(__uint_as_float(F32_NAN_BITS));
    return E::from(OP == OP_MAX ? fmaxf(x, y) : fminf(x, y));
}

template <class T, class U, int OP> __device__ __forceinline__ T combine_int(T a, T b) {
    if (OP == OP_SUM || OP == OP_AVG) return (T)((U)a + (U)b);
    if (OP == OP_PROD) return (T)((U)a * (U)b);
    if (OP == OP_MAX) return a > b ? a : b;
    return a < b ? a : b;
}

template <class E, int OP> struct Combine {
    __device__ static typename E::S step(typename E::S a, typename E::S b) {
        return combine_float<E, OP>(a, b);
    }
    __device__ static typename E::S finish(typename E::S a, float n) {
        return OP == OP_AVG ? E::from(__fdiv_rn(E::to(a), n)) : a;
    }
};

template <class T, class U, int OP> struct Combine<Int<T, U>, OP> {
    __device__ static T step(T a, T b) { return combine_int<T, U, OP>(a, b); }
    // Avg is rejected for integers before any launch.
    __device__ static T finish(T a, float) { return a; }
};

// ---------------------------------------------------------------------------------
// The reduction of a range over the ranks
// ---------------------------------------------------------------------------------

template <class S> union Pack {
    uint4 u;
    S e[16 / sizeof(S)];
};

// out[j] = finish(src_0[begin+j] (+) src_1[begin+j] (+) ... (+) src_{world-1}[begin+j]),
// j < count, grid-stride; 16-byte loads and stores when every address is aligned.
template <class E, int OP>
__device__ void reduce_range(const Peers& src, typename E::S* out, u64 begin, u64 count,
                             int world) {
    typedef typename E::S S;
    typedef Combine<E, OP> C;
    constexpr int V = 16 / sizeof(S);
    const float n = (float)world;
    const u64 tid = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    const u64 stride = (u64)gridDim.x * blockDim.x;
    bool aligned = ((u64)out % 16) == 0;
    for (int r = 0; r < world; ++r) aligned = aligned && ((src.p[r] + begin * sizeof(S)) % 16) == 0;
    u64 done = 0;
    if (aligned) {
        const u64 packs = count / V;
        for (u64 k = tid; k < packs; k += stride) {
            const u64 at = (begin + k * V) * sizeof(S);
            Pack<S> acc, x;
            acc.u = *reinterpret_cast<const uint4*>(src.p[0] + at);
            for (int r = 1; r < world; ++r) {
                x.u = *reinterpret_cast<const uint4*>(src.p[r] + at);
#pragma unroll
                for (int j = 0; j < V; ++j) acc.e[j] = C::step(acc.e[j], x.e[j]);
            }
#pragma unroll
            for (int j = 0; j < V; ++j) acc.e[j] = C::finish(acc.e[j], n);
            reinterpret_cast<uint4*>(out)[k] = acc.u;
        }
        done = packs * V;
    }
    for (u64 i = done + tid; i < count; i += stride) {
        const u64 at = (begin + i) * sizeof(S);
        S acc = *reinterpret_cast<const S*>(src.p[0] + at);
        for (int r = 1; r < world; ++r) acc = C::step(acc, *reinterpret_cast<const S*>(src.p[r] + at));
        out[i] = C::finish(acc, n);
    }
}

template <class E>
__device__ __forceinline__ void reduce_dispatch(const Peers& src, u64 out, u64 begin, u64 count,
                                                int world, int op) {
    typedef typename E::S S;
    S* o = reinterpret_cast<S*>(out);
    switch (op) {
        case OP_SUM: reduce_range<E, OP_SUM>(src, o, begin, count, world); break;
        case OP_PROD: reduce_range<E, OP_PROD>(src, o, begin, count, world); break;
        case OP_MAX: reduce_range<E, OP_MAX>(src, o, begin, count, world); break;
        case OP_MIN: reduce_range<E, OP_MIN>(src, o, begin, count, world); break;
        case OP_AVG: reduce_range<E, OP_AVG>(src, o, begin, count, world); break;
        default: break;
    }
}

#define SYMM_REDUCE(NAME, E)                                                                   \
    extern "C" __global__ void __launch_bounds__(256)                                         \
        tessera_symm_reduce_##NAME(Peers src, u64 out, u64 begin, u64 count, int world,      \
                                   int op) {                                                   \
        reduce_dispatch<E>(src, out, begin, count, world, op);                                 \
    }

typedef Int<uint8_t, uint32_t> U8;
typedef Int<uint32_t, uint32_t> U32;
typedef Int<int32_t, uint32_t> I32;
typedef Int<u64, u64> U64;
typedef Int<long long, u64> I64;

SYMM_REDUCE(f32, F32)
SYMM_REDUCE(bf16, BF16)
SYMM_REDUCE(f16, F16)
SYMM_REDUCE(u8, U8)
SYMM_REDUCE(u32, U32)
SYMM_REDUCE(i32, I32)
SYMM_REDUCE(u64, U64)
SYMM_REDUCE(i64, I64)

// ---------------------------------------------------------------------------------
// Two-shot, second shot: gather the reduced chunks
// ---------------------------------------------------------------------------------

// out[s * chunk_bytes + j] = src_s[j] for every byte below total_bytes. 16-byte units
// when chunk_bytes is a multiple of 16 and every address is aligned (a unit then never
// straddles two chunks), bytes otherwise.
extern "C" __global__ void __launch_bounds__(256)
    tessera_symm_gather(Peers src, u64 out, u64 chunk_bytes, u64 total_bytes, int world) {
    const u64 tid = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    const u64 stride = (u64)gridDim.x * blockDim.x;
    uint8_t* o = reinterpret_cast<uint8_t*>(out);
    if (chunk_bytes == 0) return;
    bool aligned = (chunk_bytes % 16) == 0 && (out % 16) == 0;
    for (int r = 0; r < world; ++r) aligned = aligned && (src.p[r] % 16) == 0;
    u64 done = 0;
    if (aligned) {
        const u64 units = total_bytes / 16;
        for (u64 k = tid; k < units; k += stride) {
            const u64 at = k * 16;
            const u64 s = at / chunk_bytes;
            const u64 j = at - s * chunk_bytes;
            if (s >= (u64)world) break;
            reinterpret_cast<uint4*>(o)[k] = *reinterpret_cast<const uint4*>(src.p[s] + j);
        }
        done = units * 16;
    }
    for (u64 at = done + tid; at < total_bytes; at += stride) {
        const u64 s = at / chunk_bytes;
        const u64 j = at - s * chunk_bytes;
        if (s >= (u64)world) break;
        o[at] = *reinterpret_cast<const uint8_t*>(src.p[s] + j);
    }
}
