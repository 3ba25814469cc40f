// FP8 per-tensor kernels (spec/formats.md 3): NaN-ignoring amax, scale from amax, the
// cast (rowwise, or rowwise + transposed columnwise in one pass), dequantization, and
// the delayed-scaling update. Checked byte for byte against crates/quant/src/fp8.rs.
#include "common.cuh"

// ---- amax ----------------------------------------------------------------------------

// Zeroes the amax scalars a[0] and, unless b is null, b[0]: the start of every amax pass,
// launched after any kernel (`Order::WaitFirst`) so that the pass after it launches early
// too. A memset in its place would end the chain of programmatic launches: the amax pass
// after a memset starts only once the memset is done, and the kernel before the memset
// runs to its end before the memset starts.
extern "C" __global__ void __launch_bounds__(32) tessera_clear_amaxes(float* a, float* b) {
    pdl_first();
    if (threadIdx.x == 0) {
        *a = 0.0f;
        if (b != nullptr) *b = 0.0f;
    }
}

// Zeroes the n bytes at p: a scale buffer with padding, before the quantizing kernel
// writes its valid entries (padding must read 0). A programmatic launch like every
// kernel here, where a memset would end the chain of early launches. Grid-stride over
// 16-byte words from the first 16-byte boundary; the bytes before it and after the last
// whole word go one per thread of the first threads.
extern "C" __global__ void __launch_bounds__(256) tessera_clear_bytes(uint8_t* p, u64 n) {
    pdl_first();
    const u64 mis = (u64)p & 15u;
    const u64 head = mis == 0 ? 0 : (16 - mis < n ? 16 - mis : n);
    const u64 words = (n - head) / 16, tail = n - head - 16 * words;
    uint4* w = reinterpret_cast<uint4*>(p + head);
    const u64 stride = (u64)gridDim.x * blockDim.x, t = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    for (u64 i = t; i < words; i += stride) w[i] = make_uint4(0u, 0u, 0u, 0u);
    if (t < head) p[t] = 0;
    if (t < tail) p[head + 16 * words + t] = 0;
}

// out[0] = max(out[0], NaN-ignoring max |x|); out must start at 0 (or a previous amax),
// which the kernel before wrote (tessera_clear_amaxes): the pass reads nothing before
// pdl_amax_first.
// Grid-stride over 16-byte vectors, AMAX_UNROLL independent loads in flight per thread
// before any is reduced (packed maxima for 2-byte types, amax_of): the pass is a pure
// read, and every two-pass quantizer (current scaling, NVFP4) pays for it.
#ifndef AMAX_UNROLL
#define AMAX_UNROLL 4
#endif
template <class T>
__device__ void amax_impl(const T* __restrict__ x, u64 n, float* out) {
    __shared__ float smem[32];
    pdl_amax_first();  // then the second pass may take the slots this pass frees
    constexpr int V = 16 / sizeof(T), U = AMAX_UNROLL;
    const uint4* xv = reinterpret_cast<const uint4*>(x);
    float m = 0.0f;
    const u64 nv = n / V;
    const u64 stride = (u64)gridDim.x * blockDim.x;
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    for (; i + (U - 1) * stride < nv; i += U * stride) {
        uint4 v[U];
#pragma unroll
        for (int u = 0; u < U; ++u) v[u] = xv[i + u * stride];
#pragma unroll
        for (int u = 0; u < U; ++u) m = fmaxf(m, amax_of<T, V>(&v[u].x));
    }
    for (; i < nv; i += stride) {
        const uint4 v = xv[i];
        m = fmaxf(m, amax_of<T, V>(&v.x));
    }
    for (u64 i = nv * V + (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        m = fmaxf(m, fabsf(In<T>::f32(x[i])));
    m = block_max(m, smem);
    if (threadIdx.x == 0) atomic_max_nonneg(out, m);
}

#define AMAX(SUFFIX, T)                                                                        \
    extern "C" __global__ void __launch_bounds__(256)                                         \
        tessera_amax_##SUFFIX(const T* __restrict__ x, u64 n, float* out) {                   \
        amax_impl<T>(x, n, out);                                                               \
    }
AMAX(f32, float)
AMAX(bf16, __nv_bfloat16)
AMAX(f16, __half)

// The scale a cast multiplies by: scale[0] (delayed scaling, or a scale computed on the
// host), or, when amax is not null, compute_scale_from_amax(amax[0]) (current scaling),
// which every thread computes from the amax pass's result, so that no one-thread kernel
// runs between the two passes. Field for field the host's `Fp8Scale`.
struct Fp8Scale {
    const float* scale;
    const float* amax;
    float fp8_max, eps;
    int pow2, pad;
};

__device__ __forceinline__ float cast_scale(const Fp8Scale& s) {
    return s.amax != nullptr ? scale_from_amax(s.amax[0], s.fp8_max, s.pow2 != 0, s.eps, 3.402823466e38f)
                             : s.scale[0];
}

// ---- cast ----------------------------------------------------------------------------

// Steps of 16 elements a thread loads before it converts any (a round); the launch
// (cast_into in crates/quant/src/cuda/fp8.rs, CAST_ROUND) sizes the grid for them.
// bench/cuda/cast_variants.cu on an H100, bf16 4096x4096, of a copy: one step 1.013,
// two 1.030, four 1.003; 16384x8192 (grid capped at 4 waves): 0.997 / 0.997 / 1.000.
#ifndef TQ_CAST_ROUND
#define TQ_CAST_ROUND 2
#endif

// Rowwise cast, 16 elements per step (16 output bytes), TQ_CAST_ROUND grid-strided steps
// a round. scale_inv[0] = 1 / scale is written by thread 0; amax (if not null) collects
// NaN-ignoring max |x| (delayed scaling records it into its history). A thread's first
// round is loaded before pdl_wait and the scale's load, so that the two memory latencies
// overlap (launch_params lets a kernel after the amax pass read its input early; an
// ordinary launch starts after the kernel before it anyway).
template <class T, bool E4M3>
__device__ void cast_impl(const T* __restrict__ x, uint8_t* __restrict__ q, u64 n, const Fp8Scale sa,
                          float* __restrict__ scale_inv, float* __restrict__ amax) {
    __shared__ float smem[32];
    constexpr int V = 16 / sizeof(T);  // elements per 16-byte load
    constexpr int L = 16 / V;          // loads per step
    constexpr int U = TQ_CAST_ROUND;
    const u64 steps = n / 16;
    const u64 tid = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    const u64 stride = (u64)gridDim.x * blockDim.x;
    // After an amax pass: last first (cta_order).
    auto step_at = [&](u64 i) { return sa.amax != nullptr ? steps - 1 - i : i; };
    union Step {
        uint4 v[L];
        T e[16];
    } u[U];
    // Round i0: steps i0, i0 + stride, ... (those below steps).
    auto load = [&](u64 i0) {
#pragma unroll
        for (int r = 0; r < U; ++r) {
            const u64 i = i0 + r * stride;
            if (i < steps) {
#pragma unroll
                for (int l = 0; l < L; ++l) u[r].v[l] = reinterpret_cast<const uint4*>(x)[step_at(i) * L + l];
            }
        }
    };
    // A given scale (delayed scaling) follows any kernel: nothing is read before it ends.
    if (sa.amax == nullptr) pdl_first();
    load(tid);
    pdl_wait();  // the scale or amax comes from the kernel before
    const float scale = cast_scale(sa);
    if (tid == 0) scale_inv[0] = __frcp_rn(scale);
    float m = 0.0f;
    for (u64 i0 = tid; i0 < steps; i0 += U * stride) {
        if (i0 != tid) load(i0);
#pragma unroll
        for (int r = 0; r < U; ++r) {
            const u64 i = i0 + r * stride;
            if (i >= steps) break;
            union { uint4 v; uint16_t h[8]; } o;
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                const float a = In<T>::f32(u[r].e[2 * j]), b = In<T>::f32(u[r].e[2 * j + 1]);
                m = fmaxf(m, fmaxf(fabsf(a), fabsf(b)));
                o.h[j] = fp8x2<E4M3>(a * scale, b * scale);
            }
            reinterpret_cast<uint4*>(q)[step_at(i)] = o.v;
        }
    }
    for (u64 i = steps * 16 + tid; i < n; i += stride) {
        const float a = In<T>::f32(x[i]);
        m = fmaxf(m, fabsf(a));
        q[i] = fp8<E4M3>(a * scale);
    }
    if (amax != nullptr) {
        m = block_max(m, smem);
        if (threadIdx.x == 0) atomic_max_nonneg(amax, m);
    }
}

// Rowwise + columnwise (transposed) cast of the 128x128 tile at (m0, k0) of an [m, k]
// matrix, held in registers as Tile128 lays it out, by a CTA of 256 threads; the
// transposed bytes are packed 4 rows to a word and staged through a swizzled shared tile
// for 16-byte stores. `q` may be null. `amax` (if not null) collects the tile's
// NaN-ignoring max |x|: each warp's max is staged before the barrier that the transposed
// store needs anyway, and thread 0 folds the 8 after it, so the amax costs no barrier of
// its own (block_max's two cost 0.02-0.03 of a copy at 4096x4096 on an H200). Every
// thread calls it; it synchronises the CTA. Full: the tile passed full_tile (no bounds
// checks). The shared memory (`tr`, `warp_amax`) is the caller's.
template <class T, bool E4M3, bool Full>
__device__ void cast_transpose_tile(const Tile128<T>& x4, u64 m0, u64 k0, uint8_t* __restrict__ q,
                                    uint8_t* __restrict__ qt, u64 m, u64 k, float scale,
                                    float* __restrict__ amax, Transposed128<Tile128<T>::V>& tr,
                                    float (&warp_amax)[8]) {
    using Tl = Tile128<T>;
    constexpr int V = Tl::V;
    const int t = threadIdx.x, rg = t >> 3, cg = t & 7;
    if (amax != nullptr) {
        const float mx = warp_max(amax_of<T, 64>(&x4.d.w[0][0]));
        if ((t & 31) == 0) warp_amax[t >> 5] = mx;
    }
    uint32_t wr[4][4];  // row i, word w: columns col(cg, 4w .. 4w+3)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
#pragma unroll
        for (int w = 0; w < 4; ++w) {
            float v[4];
#pragma unroll
            for (int b = 0; b < 4; ++b) v[b] = x4.at(i, 4 * w + b);
            const uint32_t lo = fp8x2<E4M3>(v[0] * scale, v[1] * scale);
            const uint32_t hi = fp8x2<E4M3>(v[2] * scale, v[3] * scale);
            wr[i][w] = lo | (hi << 16);
        }
    }
    if (q != nullptr) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
#pragma unroll
            for (int l = 0; l < Tl::L; ++l)
                store_run<V, Full>(q, m, k, m0 + 4 * rg + i, k0 + Tl::col(cg, l * V), &wr[i][l * V / 4]);
        }
    }
    tr.put_rows(wr, cg, rg);
    __syncthreads();
    tr.template store<Full>(qt, m, k, m0, k0);
    if (amax != nullptr && t == 0) {
        float a = warp_amax[0];
#pragma unroll
        for (int w = 1; w < 8; ++w) a = fmaxf(a, warp_amax[w]);
        atomic_max_nonneg(amax, a);
    }
}

// What the cast-transpose is given besides its input: the rowwise (q, [m, k]) and
// transposed (qt, [k, m]) outputs, the scale, where 1 / scale goes, and the amax (null:
// none collected).
struct CastTransposeArgs {
    uint8_t* q;
    uint8_t* qt;
    u64 m, k;
    Fp8Scale sa;
    float* scale_inv;
    float* amax;
};

// The cast-transpose of one 128x128 tile, loaded straight into registers: after the load
// it waits for the kernel before (pdl_wait) and takes its scale. Thread 0 of CTA 0 writes
// scale_inv[0] = 1 / scale.
template <class T, bool E4M3, bool Full>
__device__ __forceinline__ void cast_transpose_at(const T* __restrict__ x, const CastTransposeArgs& p, u64 m0,
                                                  u64 k0, Transposed128<Tile128<T>::V>& tr,
                                                  float (&warp_amax)[8]) {
    Tile128<T> x4;
    x4.template load<Full>(x, p.m, p.k, m0, k0, threadIdx.x >> 3, threadIdx.x & 7);
    pdl_wait();  // the tile is loaded; the scale or amax comes from the kernel before
    const float scale = cast_scale(p.sa);
    if (blockIdx.x == 0 && threadIdx.x == 0) p.scale_inv[0] = __frcp_rn(scale);
    cast_transpose_tile<T, E4M3, Full>(x4, m0, k0, p.q, p.qt, p.m, p.k, scale, p.amax, tr, warp_amax);
}

// The checked path, for tiles at a ragged edge or of unaligned rows: a call, so that its
// registers do not weigh on the full tiles' path (block.cu's block_edge). `p` goes by
// value: passed by reference, its address would put it in local memory for both paths
// (with the scale alone so passed, the cast-transpose lost 0.03-0.07 of a copy on an
// H100).
template <class T, bool E4M3>
__device__ __noinline__ void cast_transpose_edge(const T* __restrict__ x, const CastTransposeArgs p, u64 m0,
                                                 u64 k0, Transposed128<Tile128<T>::V>& tr,
                                                 float (&warp_amax)[8]) {
    cast_transpose_at<T, E4M3, false>(x, p, m0, k0, tr, warp_amax);
}

// One 128x128 tile per CTA (ceil(m/128) x ceil(k/128) tiles, tile_row; 256 threads), loaded
// straight into registers; a full tile (full_tile) takes the unchecked path.
// scale_inv[0] = 1 / scale; amax (if not null) collects the NaN-ignoring max |x|.
template <class T, bool E4M3>
__device__ void cast_transpose_impl(const T* __restrict__ x, const CastTransposeArgs& p) {
    __shared__ Transposed128<Tile128<T>::V> tr;
    __shared__ float warp_amax[8];
    const bool last_first = p.sa.amax != nullptr;  // after an amax pass (cta_order)
    // A given scale (delayed scaling) follows any kernel: nothing is read before it ends.
    if (!last_first) pdl_first();
    const u64 gy = (p.k + 127) / 128, m0 = tile_row(gy, last_first) * 128, k0 = tile_col(gy, last_first) * 128;
    if (full_tile<T>(p.m, p.k, m0, k0))
        cast_transpose_at<T, E4M3, true>(x, p, m0, k0, tr, warp_amax);
    else
        cast_transpose_edge<T, E4M3>(x, p, m0, k0, tr, warp_amax);
}

#define CAST(SUFFIX, T, FMT, E4M3)                                                             \
    extern "C" __global__ void __launch_bounds__(256) tessera_fp8_cast_##SUFFIX##_##FMT(       \
        const T* __restrict__ x, uint8_t* __restrict__ q, u64 n, const Fp8Scale scale,        \
        float* scale_inv, float* amax) {                                                       \
        cast_impl<T, E4M3>(x, q, n, scale, scale_inv, amax);                                   \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(256, sizeof(T) == 4 ? 2 : TQ_MINB_TILE)    \
        tessera_fp8_cast_transpose_##SUFFIX##_##FMT(const T* __restrict__ x, uint8_t* q,      \
                                                    uint8_t* qt, u64 m, u64 k,                 \
                                                    const Fp8Scale scale, float* scale_inv,   \
                                                    float* amax) {                             \
        cast_transpose_impl<T, E4M3>(x, CastTransposeArgs{q, qt, m, k, scale, scale_inv, amax}); \
    }
CAST(f32, float, e4m3, true)
CAST(f32, float, e5m2, false)
CAST(bf16, __nv_bfloat16, e4m3, true)
CAST(bf16, __nv_bfloat16, e5m2, false)
CAST(f16, __half, e4m3, true)
CAST(f16, __half, e5m2, false)

// ---- the delayed-scaling update --------------------------------------------------------

// DelayedScalingState::update (crates/quant/src/fp8.rs; TE's fused amax-and-scale update)
// of states held on the device, one CTA of 256 threads per state. History slot 0 is
// slot0[0], where the casts' atomic maxima collect (an in-place all-reduce of it makes it
// the reduced amax); slots 1 .. len-1 are the ring ring[0 .. ring_len) (ring_len = len -
// 1), slot 1 (the oldest) at ring[head[0]]. Rolling the history is then one store: the
// newest amax replaces the oldest entry and head moves on. scaled_max = fp8_max *
// 2^-margin, computed by the host as its update does. Field for field the host's
// `DelayedDesc`.
struct DelayedDesc {
    float* slot0;
    float* ring;
    uint32_t* head;
    u64 ring_len;
    float* scale;
    float scaled_max;
    int history_max;
};

// States per launch: their descriptors travel as one kernel parameter (48 bytes each,
// within the 4 KiB parameter space), so a captured graph holds them by value.
#define DELAYED_BULK 64
struct DelayedBulk {
    DelayedDesc d[DELAYED_BULK];
};

__device__ void delayed_update(const DelayedDesc& d) {
    __shared__ float smem[32];
    const float last = d.slot0[0];
    if (last == 0.0f) return;  // nothing recorded: the history does not roll (every thread)
    // The NaN-ignoring max of `last` and slots 1 .. (Max), or `last` (MostRecent). A NaN
    // or non-positive result leaves the scale alone, so block_max's padding with 0 (for
    // absent warps) changes nothing that is kept.
    float amax = last;
    if (d.history_max)
        for (u64 i = threadIdx.x; i < d.ring_len; i += blockDim.x) amax = fmaxf(amax, d.ring[i]);
    amax = block_max(amax, smem);  // (every thread has read the ring before any writes it)
    if (threadIdx.x != 0) return;
    if (d.ring_len > 0) {
        const uint32_t h = d.head[0];
        d.ring[h] = last;
        d.head[0] = (u64)h + 1 == d.ring_len ? 0u : h + 1;
    }
    d.slot0[0] = 0.0f;
    if (isfinite(amax) && amax > 0.0f) {
        const float s = __fdiv_rn(d.scaled_max, amax);
        d.scale[0] = isinf(s) ? 3.402823466e38f : s;
    }
}

// States b.d[0 .. n), n <= DELAYED_BULK; grid n CTAs.
extern "C" __global__ void __launch_bounds__(256)
    tessera_fp8_delayed_update(const __grid_constant__ DelayedBulk b, uint32_t n) {
    pdl_first();
    if (blockIdx.x < n) delayed_update(b.d[blockIdx.x]);
}

// ---- dequantize ----------------------------------------------------------------------

// y = decode(q) * scale_inv[0], rowwise, any n; NaN results are the canonical NaN. The
// whole units as one row (fp8_dequant_rows), then the last n % DEQ_VALS<T> elements one
// per thread. Launch: max(ceil(n / DEQ_VALS<T>), DEQ_VALS<T>) threads.
template <class T, bool E4M3>
__device__ void dequant_impl(const uint8_t* __restrict__ q, T* __restrict__ y, u64 n,
                             const float* __restrict__ scale_inv) {
    constexpr int V = DEQ_VALS<T>;
    const float s = scale_inv[0];
    const u64 whole = n / V * V;
    fp8_dequant_rows<T, E4M3>(q, y, 1, whole, [=](u64, u64) { return s; });
    const u64 i = whole + (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = In<T>::from(fp8_to_f32<E4M3>(q[i]) * s);
}

// The columnwise operand: q is the transposed [k, m] copy, y the logical [m, k], without
// a separate transpose (fp8_dequant_cols; its launch), in tiles of TK q rows: the `_t_`
// entry points 64, the `_t_tall_` ones 128 (DEQ_TILE_K_TALL).
template <class T, bool E4M3, int TK>
__device__ void dequant_transposed_impl(const uint8_t* __restrict__ q, T* __restrict__ y, u64 m, u64 k,
                                        const float* __restrict__ scale_inv) {
    const float s = scale_inv[0];
    fp8_dequant_cols<T, E4M3, TK>(q, y, m, k, [=](u64, u64) { return s; });
}

#define DEQUANT(SUFFIX, T, FMT, E4M3)                                                          \
    extern "C" __global__ void __launch_bounds__(256) tessera_fp8_dequant_##SUFFIX##_##FMT(    \
        const uint8_t* __restrict__ q, T* __restrict__ y, u64 n, const float* scale_inv) {    \
        pdl_first();                                                                          \
        dequant_impl<T, E4M3>(q, y, n, scale_inv);                                             \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(256) tessera_fp8_dequant_t_##SUFFIX##_##FMT(  \
        const uint8_t* __restrict__ q, T* __restrict__ y, u64 m, u64 k, const float* scale_inv) { \
        pdl_first();                                                                              \
        dequant_transposed_impl<T, E4M3, DEQ_TILE_K>(q, y, m, k, scale_inv);                    \
    }                                                                                             \
    extern "C" __global__ void __launch_bounds__(256, DEQ_T_TALL_MINB)                            \
        tessera_fp8_dequant_t_tall_##SUFFIX##_##FMT(const uint8_t* __restrict__ q, T* __restrict__ y, \
                                                    u64 m, u64 k, const float* scale_inv) {       \
        pdl_first();                                                                              \
        dequant_transposed_impl<T, E4M3, DEQ_TILE_K_TALL>(q, y, m, k, scale_inv);               \
    }
DEQUANT(f32, float, e4m3, true)
DEQUANT(f32, float, e5m2, false)
DEQUANT(bf16, __nv_bfloat16, e4m3, true)
DEQUANT(bf16, __nv_bfloat16, e5m2, false)
DEQUANT(f16, __half, e4m3, true)
DEQUANT(f16, __half, e5m2, false)

// ---- layout helpers ------------------------------------------------------------------

// Byte transpose of a row-major [rows, cols] matrix through a 64x64 tile.
// Grid: (ceil(rows/64), ceil(cols/64)).
extern "C" __global__ void __launch_bounds__(256)
    tessera_transpose_u8(const uint8_t* __restrict__ src, uint8_t* __restrict__ dst, u64 rows, u64 cols) {
    __shared__ uint8_t tile[64][64 + 4];
    pdl_first();
    const u64 r0 = (u64)blockIdx.x * 64, c0 = (u64)blockIdx.y * 64;
    for (int idx = threadIdx.x; idx < 64 * 64; idx += blockDim.x) {
        const int r = idx / 64, c = idx % 64;
        if (r0 + r < rows && c0 + c < cols) tile[r][c] = src[(r0 + r) * cols + c0 + c];
    }
    __syncthreads();
    for (int idx = threadIdx.x; idx < 64 * 64; idx += blockDim.x) {
        const int c = idx / 64, r = idx % 64;
        if (r0 + r < rows && c0 + c < cols) dst[(c0 + c) * rows + r0 + r] = tile[r][c];
    }
}

// swap_first_dims: src [d0, d1, inner bytes] -> dst [d1, d0, inner]; one thread per byte
// of `inner` in a grid-stride loop over (i, j, byte).
extern "C" __global__ void __launch_bounds__(256)
    tessera_swap_first_dims(const uint8_t* __restrict__ src, uint8_t* __restrict__ dst, u64 d0,
                            u64 d1, u64 inner) {
    pdl_first();
    const u64 n = d0 * d1 * inner;
    const u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 o = (u64)blockIdx.x * blockDim.x + threadIdx.x; o < n; o += stride) {
        const u64 c = o % inner, ij = o / inner;
        const u64 i = ij / d0, j = ij % d0;  // output row i of d1, column j of d0
        dst[o] = src[(j * d1 + i) * inner + c];
    }
}

// Copies the valid [rows, cols] (bytes) top-left region of a [*, src_cols] matrix into a
// [*, dst_cols] matrix, writing zeros in dst's padding columns up to dst_cols and in rows
// rows..dst_rows (padding strip when dst is smaller, restore when larger).
extern "C" __global__ void __launch_bounds__(256)
    tessera_repad(const uint8_t* __restrict__ src, uint8_t* __restrict__ dst, u64 rows, u64 cols,
                  u64 src_cols, u64 dst_rows, u64 dst_cols) {
    pdl_first();
    const u64 n = dst_rows * dst_cols;
    const u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 o = (u64)blockIdx.x * blockDim.x + threadIdx.x; o < n; o += stride) {
        const u64 r = o / dst_cols, c = o % dst_cols;
        dst[o] = (r < rows && c < cols) ? src[r * src_cols + c] : 0;
    }
}
