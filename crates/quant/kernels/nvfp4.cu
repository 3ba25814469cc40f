// NVFP4 (spec/formats.md 5): E2M1 values, E4M3 scales per 1x16 block (16x1 columnwise,
// on the transposed operand) or 16x16 tile, float32 global amaxes, the random Hadamard
// transform on the columnwise operand, and stochastic rounding from the tessera-rng
// Philox stream. Checked byte for byte against crates/quant/src/nvfp4.rs.
#include "common.cuh"

// ---- Philox (tessera-rng's stream, spec/rng.md) ---------------------------------------

__device__ __forceinline__ uint4 philox(uint4 c, uint2 k) {
#pragma unroll
    for (int round = 0; round < 10; ++round) {
        if (round > 0) {
            k.x += 0x9E3779B9u;
            k.y += 0xBB67AE85u;
        }
        const uint32_t hi0 = __umulhi(0xD2511F53u, c.x), lo0 = 0xD2511F53u * c.x;
        const uint32_t hi1 = __umulhi(0xCD9E8D57u, c.z), lo1 = 0xCD9E8D57u * c.z;
        c = make_uint4(hi1 ^ c.y ^ k.x, lo1, hi0 ^ c.w ^ k.y, lo0);
    }
    return c;
}

// The random bytes of 16 consecutive elements el0 .. el0+15 (el0 a multiple of 16) of an
// operand whose stream starts at (seed, offset): element e rounds with byte e % 4 of word
// e / 4, so the 16 elements use exactly the 4 words of one Philox block.
__device__ __forceinline__ uint4 random16(u64 seed, u64 offset, u64 el0) {
    const u64 b = offset / 4 + el0 / 16;
    return philox(make_uint4((uint32_t)b, (uint32_t)(b >> 32), 0u, 0u),
                  make_uint2((uint32_t)seed, (uint32_t)(seed >> 32)));
}

// prmt.b32 (default mode): byte n of the result is the byte of {b, a} chosen by nibble n
// of s, or that byte's sign bit replicated when the nibble's bit 3 is set.
__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t s) {
    uint32_t r;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(s));
    return r;
}

// The random byte of element j (0 .. 15) of a Philox block: byte j % 4 of word j / 4,
// alone in the low byte (one byte permute, the other bytes from zero's).
__device__ __forceinline__ uint32_t sr_byte(uint32_t w, int j) { return prmt(w, 0u, 0x4440u | (uint32_t)(j % 4)); }
__device__ __forceinline__ uint32_t sr_byte(uint4 r, int j) {
    return sr_byte((j / 4) == 0 ? r.x : (j / 4) == 1 ? r.y : (j / 4) == 2 ? r.z : r.w, j);
}

// ---- E2M1 -----------------------------------------------------------------------------

// E2M1 on the GPU's FMA pipe (the integer/compare pipe runs at half the issue rate and
// bounds these kernels). The code of a = |x| (0 .. 7, RNE, satfinite to 6, NaN -> 7) is the
// least of three roundings, each one exact float32 operation that leaves rne(.) in the
// low bits of a number in [2^23, 2^24): 2a (the 0.5-step grid below 2), a + 2 (the 1-step
// grid of [2, 4) shifted to codes 4 .. 6), a/2 + 4 (the 2-step grid from 4 shifted to
// codes 6, 7), and 7 (saturation; also what min.f32 returns when the others are NaN).
// The lines 2a, a + 2 and a/2 + 4 meet where the grids do, so their minimum is the
// concave code curve, and each grid's ties fall on even codes. Returns the float bits of
// the minimum: 2^23's bits (0x4B000000) plus the code. Checked against the threshold
// count (> 0.25, >= 0.75, > 1.25, >= 1.75, > 2.5, >= 3.5, > 5) on all 2^32 inputs
// (bench/cuda/e2m1_check.cpp).
__device__ __forceinline__ uint32_t e2m1_biased(float x) {
    const float a = fabsf(x);
    const float k = 8388608.0f;  // 2^23
    const float f0 = __fmaf_rn(a, 2.0f, k);
    const float f1 = __fadd_rn(a, k + 2.0f);
    const float f2 = __fmaf_rn(a, 0.5f, k + 4.0f);
    return __float_as_uint(fminf(fminf(f0, f1), fminf(f2, k + 7.0f)));
}

// Whether x takes the sign bit: negative, zero included, and not NaN (NaN -> +6). As
// signed integers, exactly the float bits from -0 (INT_MIN) to -Inf (0xFF800000) are at
// most 0xFF800000; negative NaNs are above it and non-negative floats far above.
__device__ __forceinline__ bool e2m1_negative(float x) {
    return (int32_t)__float_as_uint(x) <= (int32_t)0xFF800000u;
}

// RNE, satfinite to +-6, NaN -> 7 (+6), sign of zero kept.
__device__ __forceinline__ uint32_t e2m1(float x) { return (e2m1_biased(x) - 0x4B000000u) | (e2m1_negative(x) ? 8u : 0u); }

// 8 values times g to 8 E2M1 codes, element j in bits 4j .. 4j+3 (round to nearest). The
// biased codes are summed shifted (multiply-adds, modulo 2^32) and the bias of all eight
// taken off once: no field carries, as a code plus its sign is at most 15.
__device__ __forceinline__ uint32_t e2m1x8(const float* v, float g) {
    uint32_t w = 0;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        const float y = __fmul_rn(v[j], g);
        w += e2m1_biased(y) << (4 * j);
        w += e2m1_negative(y) ? 8u << (4 * j) : 0u;
    }
    return w - 0x4B000000u * 0x11111111u;
}

// The magnitude code of x with stochastic rounding by the random byte r8 (spec/formats.md
// 2.4; cast.rs encode_e2m1_stochastic): t = |x| + (r8 / 256) s(|x|), summed exactly, step
// s 0.5 below 2, 1 below 4, else 2, then the code of min(floor(t / s(t)) s(t), 6).
// - |x| 2^-126 rounded toward zero (z) puts E2M1's grid at bit 22 of z's bits: below 1
//   z is subnormal and its bits are floor(|x| 2^23) (step 0.5 = 2^22 units); in [1, 8)
//   the exponent field is 1 .. 3 and a step is 2^22 units of that binade. Bits 22 up
//   are the code (2 .. 7 from 1.0 up, 0, 1 below).
// - r8 s / 256 is r8 2^14 units in every binade, so t is the integer sum of z's bits and
//   r8 << 14, floor(t / s) is that sum's bits 22 up (floor((floor(A) + R) / N) =
//   floor((A + R) / N) for integers R, N), and a carry into the next binade leaves its
//   first grid point, as the definition does (t < that point + s(|x|)).
// - min(., 7) saturates t >= 8, and Inf and NaN: their bits (0x7F800000 up) plus at most
//   255 << 14 stay below 2^32 and give more than 7.
// Checked against the definition on every float x with every byte
// (bench/cuda/e2m1_check.cpp).
__device__ __forceinline__ uint32_t e2m1_sr_magnitude(float x, uint32_t r8) {
    const uint32_t z = __float_as_uint(__fmul_rz(fabsf(x), 1.17549435082228751e-38f));  // 2^-126
    return min((z + (r8 << 14)) >> 22, 7u);
}

// Stochastic rounding of x (e2m1_sr_magnitude), with e2m1_negative's sign.
__device__ __forceinline__ uint32_t e2m1_sr(float x, uint32_t r8) {
    return e2m1_sr_magnitude(x, r8) | (e2m1_negative(x) ? 8u : 0u);
}

// The value of an E2M1 code, exactly: the code's bits placed at float32 bit 22 read as a
// float (exponent field = code's exponent, top mantissa bit = its mantissa; code 1 is the
// subnormal 2^-127) are the value times 2^-126.
__device__ __forceinline__ float e2m1_value(uint32_t code) {
    return __fmul_rn(__uint_as_float(((code & 7u) << 22) | ((code & 8u) << 28)), __uint_as_float(0x7E800000u));
}

// N packed E2M1 values (element j in bits 4j .. 4j+3 of the words w[0], w[1], ...) times
// sc.
template <int N> __device__ __forceinline__ void e2m1_values(const uint32_t* w, float sc, float* v) {
#pragma unroll
    for (int j = 0; j < N; ++j) v[j] = __fmul_rn(e2m1_value((w[j / 8] >> (4 * (j % 8))) & 0xFu), sc);
}

// The 16 values of a packed block (w.x, then w.y) times sc.
__device__ __forceinline__ void e2m1x16_values(uint2 w, float sc, float* v) {
    const uint32_t words[2] = {w.x, w.y};
    e2m1_values<16>(words, sc, v);
}

// ---- scales ---------------------------------------------------------------------------

__device__ __forceinline__ float global_encode_scale(float a) {
    if (a == 0.0f) return 1.0f;
    const float s = __fdiv_rn(2688.0f, a);
    return s == 0.0f ? 1.0f : fminf(s, 3.402823466e38f);
}

// E4M3 byte of a block's decode scale.
__device__ __forceinline__ uint8_t block_scale(float b, float s_enc) {
    return fp8<true>(fminf(__fmul_rn(b, __fmul_rn(s_enc, 0.16666667163372040f)), 3.402823466e38f));
}

// The multiplier of a block's values when dequantizing: (e4m3 * A) * fp32(1/2688), A the
// tensor's amax.
__device__ __forceinline__ float nvfp4_decode_scale(uint8_t e, float A) {
    return __fmul_rn(__fmul_rn(fp8_to_f32<true>(e), A), 1.0f / 2688.0f);
}

__device__ __forceinline__ float block_encode_scale(uint8_t e, float s_dec) {
    return fminf(__frcp_rn(__fmul_rn(fp8_to_f32<true>(e), s_dec)), 3.402823466e38f);
}

// ---- RHT -------------------------------------------------------------------------------

// The RHT's sign vector s (TE's fixed one: +1 +1 +1 -1 +1 -1 -1 -1 -1 -1 -1 +1 -1 +1 -1 -1),
// bit t set where s_t = -1: a compile-time constant, so that each s_t * H[t][j] / 4 in
// the unrolled sums folds to an immediate (from __constant__ memory it cost a multiply
// per term).
constexpr uint32_t RHT_NEGATIVE = 0xD7E8u;
__device__ __forceinline__ float rht_sign(int t) { return (RHT_NEGATIVE >> t) & 1u ? -1.0f : 1.0f; }

// The unnormalised Walsh-Hadamard transform of u in place (nvfp4.rs: fwht16): butterflies
// (u_i, u_i+h) -> (u_i + u_i+h, u_i - u_i+h) in stages h = 1, 2, 4, 8 (from h = First).
template <int First = 1> __device__ __forceinline__ void fwht16(float* u) {
#pragma unroll
    for (int h = First; h < 16; h *= 2)
#pragma unroll
        for (int i = 0; i < 16; ++i)
            if ((i & h) == 0) {
                const float a = u[i], b = u[i + h];
                u[i] = __fadd_rn(a, b);
                u[i + h] = __fsub_rn(a, b);
            }
}

// y = v (diag(s) H) / 4 (nvfp4.rs: rht16): u_t = v_t * (s_t / 4), then the butterflies.
// v and y may be the same array.
__device__ __forceinline__ void rht16(const float* v, float* y) {
#pragma unroll
    for (int t = 0; t < 16; ++t) y[t] = __fmul_rn(v[t], 0.25f * rht_sign(t));
    fwht16(y);
}

// v = y (H diag(s)) / 4 (nvfp4.rs: inverse_rht16): u_j = y_j / 4, the butterflies, then
// v_t = u_t * s_t.
__device__ __forceinline__ void inverse_rht16(const float* y, float* v) {
#pragma unroll
    for (int j = 0; j < 16; ++j) v[j] = __fmul_rn(y[j], 0.25f);
    fwht16(v);
#pragma unroll
    for (int t = 0; t < 16; ++t) v[t] = __fmul_rn(v[t], rht_sign(t));
}

// The 8 values of a lane's row of 2-byte T (4 raw words, element 2p in the low half of
// word p) as floats.
template <class T> __device__ __forceinline__ void row_values(const uint32_t* w, float* v) {
#pragma unroll
    for (int p = 0; p < 4; ++p) {
        v[2 * p] = lo_f32<T>(w[p]);
        v[2 * p + 1] = hi_f32<T>(w[p]);
    }
}

// Packed |.| of a raw word of 2-byte T.
template <class T> __device__ __forceinline__ uint32_t habs2w(uint32_t a) {
    const auto r = abs2<T>(a);
    return *reinterpret_cast<const uint32_t*>(&r);
}

// Both global amaxes of an RHT quantization in one read: NaN-ignoring max |x| into
// row[0] and max |RHT(x^T)| (the transformed columnwise operand) into col[0], both
// starting at 0 (the kernel before, tessera_clear_amaxes in fp8.cu, cleared them). Thread
// per (group of RHT_AMAX_COLS<T> columns, run of 16 rows); 2-byte types read 8 columns as
// one 16-byte vector per row (k is a multiple of 16).
template <class T> constexpr int RHT_AMAX_COLS = sizeof(T) == 2 ? 8 : 1;
template <class T>
__device__ void rht_amax_impl(const T* __restrict__ x, u64 m, u64 k, float* row, float* col) {
    __shared__ float smem[32];
    pdl_amax_first();  // then the second pass may take the slots this pass frees
    constexpr int C = RHT_AMAX_COLS<T>;
    const u64 groups = k / C, runs = (m / 16) * groups;
    float mx = 0.0f, mr = 0.0f;
    const u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < runs; i += stride) {
        const u64 c = (i % groups) * C, run = i / groups;
        union {
            uint4 u;
            uint32_t w[4];
            T e[16 / sizeof(T)];
        } raw[16];
#pragma unroll
        for (int t = 0; t < 16; ++t) {
            const T* p = x + (run * 16 + t) * k + c;
            if constexpr (C == 8) raw[t].u = *reinterpret_cast<const uint4*>(p);
            else raw[t].e[0] = *p;
        }
        if constexpr (C == 8) {
            uint32_t h[4];
#pragma unroll
            for (int p = 0; p < 4; ++p) {
                h[p] = habs2w<T>(raw[0].w[p]);
#pragma unroll
                for (int t = 1; t < 16; ++t) h[p] = hmax2w<T>(h[p], habs2w<T>(raw[t].w[p]));
            }
            mr = fmaxf(mr, amax_of<T, 8>(h));
        }
#pragma unroll
        for (int j = 0; j < C; ++j) {
            float y[16];
#pragma unroll
            for (int t = 0; t < 16; ++t) y[t] = In<T>::f32(raw[t].e[j]);
            if constexpr (C == 1)
#pragma unroll
                for (int t = 0; t < 16; ++t) mr = fmaxf(mr, fabsf(y[t]));
            rht16(y, y);
#pragma unroll
            for (int t = 0; t < 16; ++t) mx = fmaxf(mx, fabsf(y[t]));
        }
    }
    mx = block_max(mx, smem);
    if (threadIdx.x == 0) atomic_max_nonneg(col, mx);
    mr = block_max(mr, smem);  // (block_max synchronises before it reuses smem)
    if (threadIdx.x == 0) atomic_max_nonneg(row, mr);
}

// ---- quantize ---------------------------------------------------------------------------

struct Nvfp4Args {
    u64 m, k;
    const float* amax_row;  // global amaxes (device scalars)
    const float* amax_col;
    uint8_t* q_row;  // [m, k/2] or null
    uint8_t* s_row;  // [s_row_rows, s_row_cols]
    u64 s_row_cols;
    uint8_t* q_col;  // [k, m/2] or null
    uint8_t* s_col;  // [s_col_rows, s_col_cols]
    u64 s_col_cols;
    int two_d, rht, swizzled, sr;
    u64 seed, off_row, off_col;  // stochastic-rounding streams
    float* amax_copy;            // receives amax_row[0] (null: no copy), see copy_amax
};

// Both orientations without the RHT share one global amax, which the caller keeps in two
// buffers: the amax pass fills one and the kernel copies it to the other (thread 0 of
// CTA 0, after waiting for that pass), so the caller neither replaces a buffer nor
// launches a copy.
__device__ __forceinline__ void copy_amax(const Nvfp4Args& a) {
    if (a.amax_copy != nullptr && blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) {
        pdl_wait();
        *a.amax_copy = a.amax_row[0];
    }
}

// ---- 1-D round to nearest without the RHT: the common cases, one entry point each -------

// Rowwise only. A CTA of 256 threads covers 16 rows x 256*B columns, thread t row t/16 and
// the B consecutive 1x16 blocks from column (t%16)*16*B, loaded before any is quantized
// (B*32 bytes of bf16 in flight per thread); a warp reads two runs of 512*B contiguous
// bytes. 1-D grid over (m/16) x col_tiles, column tiles fastest. No shared memory, no
// barrier, no shuffle. m and k are multiples of 16, so a block is all in or all out.
template <class T, int B>
__device__ void nvfp4_row_impl(const T* __restrict__ x, u64 m, u64 k, const float* __restrict__ amax,
                               uint8_t* __restrict__ q, uint8_t* __restrict__ s, u64 s_cols, int swizzled,
                               u64 col_tiles) {
    constexpr int L = (int)sizeof(T);  // 16-byte vectors per 16 elements
    const int t = threadIdx.x;
    const uint32_t o = cta_order(true);  // after the amax pass: last first
    const u64 ct = o % col_tiles, rt = o / col_tiles;
    const u64 row = rt * 16 + t / 16;
    const u64 c0 = ct * (256 * B) + (u64)(t % 16) * (16 * B);
    union {
        uint4 u[L];
        uint32_t w[4 * L];
        T e[16];
    } raw[B];
#pragma unroll
    for (int b = 0; b < B; ++b)
        if (c0 + 16 * b < k)
#pragma unroll
            for (int l = 0; l < L; ++l) raw[b].u[l] = reinterpret_cast<const uint4*>(x + row * k + c0 + 16 * b)[l];
    pdl_wait();  // the global amax comes from the kernel before
    const float s_enc = global_encode_scale(amax[0]);
    const float s_dec = __frcp_rn(s_enc);
#pragma unroll
    for (int b = 0; b < B; ++b) {
        const u64 col = c0 + 16 * b;
        if (col >= k) return;
        const float a = amax_of<T, 16>(raw[b].w);
        float v[16];
#pragma unroll
        for (int j = 0; j < 16; ++j) v[j] = In<T>::f32(raw[b].e[j]);
        const uint8_t e = block_scale(a, s_enc);
        const float g = block_encode_scale(e, s_dec);
        reinterpret_cast<uint2*>(q + row * (k / 2) + col / 2)[0] = make_uint2(e2m1x8(v, g), e2m1x8(v + 8, g));
        const u64 j = col / 16;
        s[scale_index(row, j, s_cols, swizzled)] = e;
    }
}

// Both orientations (either may be null). Each warp quantizes a 32-row x 64-column tile
// alone: lane l owns columns 8*(l%8) .. +7 of rows 8*(l/8) .. +7, loaded as 16-byte
// vectors (one instruction covers 4 rows x 128 bytes). A 1x16 row block spans the lane
// pair (xor 1), a 16x1 column block the pair (xor 8); each lane encodes its 8 values of a
// block into one 32-bit word. A CTA of 8 warps (4 down, 2 across) covers 128 rows x 128
// columns (ceil(m/128) x ceil(k/128) tiles, tile_banded).
template <class T> union BothTile {
    static constexpr int W = 8 * (int)sizeof(T) / 16;  // 16-byte vectors per run of 8 elements
    uint4 u[8][W];
    uint32_t w[8][4 * W];
    T e[8][8];
};

// Any values: every block quantized and stored as soon as its amax is known (the E2M1
// encoder with saturation and NaN), so only the tile stays live. The scale byte of the
// lane's row block i goes to put_row(i, e), of its column block j to put_col(j, e), on
// every lane (both lanes of a pair, and lanes past the edge with e = 0).
template <class T, class PutRow, class PutCol>
__device__ void nvfp4_both_general(const BothTile<T>& d, u64 r0, u64 col, bool valid, const Nvfp4Args& a,
                                   PutRow put_row, PutCol put_col) {
    if (a.q_col != nullptr) {
        const float s_enc = global_encode_scale(a.amax_col[0]);
        const float s_dec = __frcp_rn(s_enc);
        // The lane's 8 column amaxes over its 8 rows (2-byte types: word p of a row
        // holds columns 2p and 2p + 1, reduced as pairs).
        float ca[8];
        if constexpr (sizeof(T) == 2) {
#pragma unroll
            for (int p = 0; p < 4; ++p) {
                auto mx = abs2<T>(d.w[0][p]);
#pragma unroll
                for (int i = 1; i < 8; ++i) mx = __hmax2(mx, abs2<T>(d.w[i][p]));
                ca[2 * p] = fmaxf(0.0f, In<T>::f32(mx.x));
                ca[2 * p + 1] = fmaxf(0.0f, In<T>::f32(mx.y));
            }
        } else {
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                ca[j] = 0.0f;
#pragma unroll
                for (int i = 0; i < 8; ++i) ca[j] = fmaxf(ca[j], fabsf(In<T>::f32(d.e[i][j])));
            }
        }
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            float v[8];
#pragma unroll
            for (int i = 0; i < 8; ++i) v[i] = In<T>::f32(d.e[i][j]);
            const float amax = fmaxf(ca[j], __shfl_xor_sync(0xFFFFFFFFu, ca[j], 8));
            const uint8_t e = block_scale(amax, s_enc);
            if (valid)
                *reinterpret_cast<uint32_t*>(a.q_col + (col + j) * (a.m / 2) + r0 / 2) =
                    e2m1x8(v, block_encode_scale(e, s_dec));
            put_col(j, e);
        }
    }
    if (a.q_row != nullptr) {
        const float s_enc = global_encode_scale(a.amax_row[0]);
        const float s_dec = __frcp_rn(s_enc);
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            float v[8];
#pragma unroll
            for (int j = 0; j < 8; ++j) v[j] = In<T>::f32(d.e[i][j]);
            float amax = amax_of<T, 8>(d.w[i]);
            amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, 1));
            const uint8_t e = block_scale(amax, s_enc);
            if (valid)
                *reinterpret_cast<uint32_t*>(a.q_row + (r0 + i) * (a.k / 2) + col / 2) =
                    e2m1x8(v, block_encode_scale(e, s_dec));
            put_row(i, e);
        }
    }
}

// ---- the fast path of the both kernel (2-byte inputs) ------------------------------------
//
// Most tiles hold only finite values whose blocks get normal E4M3 scales; for them the
// encoder needs neither saturation nor NaN handling, the sign can be read from the raw
// input bits, and the least of the three roundings is one 3-input integer min. A warp
// takes this path when every block of its tile passes `b <= lim[e]` (below), else the
// general path; both give the same bytes.

// The sign nibbles of 8 two-byte elements: bit 4j+3 is the sign of element j, all other
// bits 0. u holds (as 0x00/0xFF bytes) the signs of elements 0, 2, 4, 6 and v those of 1,
// 3, 5, 7.
__device__ __forceinline__ uint32_t sign_nibbles(uint32_t u, uint32_t v) {
    return (u & 0x08080808u) | (v & 0x80808080u);
}

// The sign nibbles of a row block of 8 elements, element 2p in the low and 2p + 1 in the
// high half of word p (the sign of each half is bit 7 of its byte 1 or 3).
__device__ __forceinline__ uint32_t row_signs(const uint32_t* w) {
    const uint32_t s01 = prmt(w[0], w[1], 0xFBD9u);  // signs of elements 0, 2, 1, 3
    const uint32_t s23 = prmt(w[2], w[3], 0xFBD9u);  // 4, 6, 5, 7
    return sign_nibbles(prmt(s01, s23, 0x5410u), prmt(s01, s23, 0x7632u));
}

// The sign nibbles of the column blocks 2p (lo) and 2p + 1 (hi) over rows 0 .. 7, word p
// of row i given as c[i].
__device__ __forceinline__ void col_signs(const uint32_t* c, uint32_t& lo, uint32_t& hi) {
    const uint32_t s02 = prmt(c[0], c[2], 0xFBD9u);  // rows 0, 2 of column 2p, then of 2p + 1
    const uint32_t s13 = prmt(c[1], c[3], 0xFBD9u);
    const uint32_t s46 = prmt(c[4], c[6], 0xFBD9u);
    const uint32_t s57 = prmt(c[5], c[7], 0xFBD9u);
    lo = sign_nibbles(prmt(s02, s46, 0x5410u), prmt(s13, s57, 0x5410u));
    hi = sign_nibbles(prmt(s02, s46, 0x7632u), prmt(s13, s57, 0x7632u));
}

// v times g to its E2M1 magnitude when |v g| < 7 and it is not NaN, as e2m1_biased
// leaves it (2^23's bits plus the code): e2m1_biased without its saturation term (the
// a/2 + 4 line stays at or below 7 there), the minimum taken on the float bits as
// unsigned integers (they order alike: all in [2^23, 2^24)), one 3-input min.
// e2m1x8_magnitudes: 8 of them, element j in bits 4j .. 4j+2.
__device__ __forceinline__ uint32_t e2m1_magnitude_biased(float v, float g) {
    const float k = 8388608.0f;  // 2^23
    const float a = fabsf(__fmul_rn(v, g));
    const uint32_t f0 = __float_as_uint(__fmaf_rn(a, 2.0f, k));
    const uint32_t f1 = __float_as_uint(__fadd_rn(a, k + 2.0f));
    const uint32_t f2 = __float_as_uint(__fmaf_rn(a, 0.5f, k + 4.0f));
    return min(min(f0, f1), f2);
}

// 8 magnitude codes in the low bytes of c (any high bytes) packed as nibbles, element j
// in bits 4j .. 4j+3: 3 byte permutes gather the even elements' bytes into a word, 3 the
// odd ones', and one shifted add interleaves them (7 operations, where shifted adds into
// one word and the bias took 8; an H100's both kernel 0.3-0.6% faster,
// bench/cuda/nvfp4_cost.cu). Codes at most 15.
__device__ __forceinline__ uint32_t pack_code_bytes8(const uint32_t* c) {
    const uint32_t even = prmt(prmt(c[0], c[2], 0x0040u), prmt(c[4], c[6], 0x0040u), 0x5410u);
    const uint32_t odd = prmt(prmt(c[1], c[3], 0x0040u), prmt(c[5], c[7], 0x0040u), 0x5410u);
    return even + (odd << 4);
}

__device__ __forceinline__ uint32_t e2m1x8_magnitudes(const float* v, float g) {
    uint32_t c[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) c[j] = e2m1_magnitude_biased(v[j], g);
    return pack_code_bytes8(c);  // the codes are the low bytes of the biased minima
}

// Per block-scale byte e: the encode scale g = block_encode_scale(e, s_dec), and lim, the
// largest block amax the fast path takes with it. lim = 6.5 * (e * s_dec) (at most
// FLT_MAX) keeps every |v g| <= b g <= 6.5 (1 + 2^-22) < 7; a block whose e came from its
// own amax b by rounding to a normal, unsaturated E4M3 value has b g <= 6.4 (1 + 2^-21)
// (E4M3 rounds by at most 2^-4 relative), so passes; zero blocks (e = 0, lim = 0) pass;
// NaN amaxes fail every comparison, an infinite one fails lim <= FLT_MAX, and e = 0x7F
// (NaN) gets lim = -1.
__device__ __forceinline__ float2 block_table_entry(uint32_t e, float s_dec) {
    const float d = __fmul_rn(fp8_to_f32<true>((uint8_t)e), s_dec);
    const float g = fminf(__frcp_rn(d), 3.402823466e38f);
    return make_float2(g, e >= 0x7Fu ? -1.0f : fminf(__fmul_rn(6.5f, d), 3.402823466e38f));
}

// Scale bytes of a 128x128 CTA tile, staged so that they leave as 4-byte words: row block
// (r, jb) at row[r][jb] (128 rows x 8 blocks), column block (c, ib) at col[c][ib] (128
// columns x 8 blocks of 16 rows). A word holds 4 consecutive blocks of one row of a
// scale grid, 4-byte aligned in both layouts (the grids have a multiple of 4 columns and
// the tile's first blocks are multiples of 8), so the flush after the barrier writes each
// with one store, two neighbouring threads the 8 bytes of a row; blocks past the
// tensor's edge hold 0, as the cleared padding does. (A 64x256 tile owned 4 bytes of
// each of its 256 columns' compact scale rows: 256 separate stores per CTA, which cost
// about 0.1 of a copy on an H200.)
struct BothScales {
    uint8_t row[128][8];
    uint8_t col[128][8];
};

// Thread t (threadIdx.x unless the caller reads it itself) writes its two words.
__device__ __forceinline__ void flush_both_scales(const BothScales& s, const Nvfp4Args& a, u64 R0, u64 C0,
                                                  int t = threadIdx.x) {
    if (a.q_row != nullptr) {
        const u64 r = R0 + t / 2, jb = C0 / 16 + 4 * (t % 2);
        if (r < a.m && jb < a.k / 16) {
            const u64 i = scale_index(r, jb, a.s_row_cols, a.swizzled);
            *reinterpret_cast<uint32_t*>(a.s_row + i) = *reinterpret_cast<const uint32_t*>(&s.row[t / 2][4 * (t % 2)]);
        }
    }
    if (a.q_col != nullptr) {
        const u64 c = C0 + t / 2, ib = R0 / 16 + 4 * (t % 2);
        if (c < a.k && ib < a.m / 16) {
            const u64 i = scale_index(c, ib, a.s_col_cols, a.swizzled);
            *reinterpret_cast<uint32_t*>(a.s_col + i) = *reinterpret_cast<const uint32_t*>(&s.col[t / 2][4 * (t % 2)]);
        }
    }
}

// The number of the 128x128 tile at (R0, C0) of an [m, k] tensor, tiles numbered row by
// row (rows of ceil(k / 128)): where the two-step scratches (flush_scratch's 2 KiB a
// tile, BlockScratch's 128 bytes) keep a tile's scale bytes. A macro: as an inline
// function the same expression moved ptxas's schedule of the 2-D kernels (8 more SASS
// instructions in the f16 ones, seen with cuobjdump), which their measurements predate.
#define TILE_NUMBER(R0, C0, k) (((R0) / 128) * (((k) + 127) / 128) + (C0) / 128)

// Two-step compact scales: the tile's staged bytes, its rowwise stage (1 KiB) then its
// columnwise one, into 2 KiB of `scratch` at the tile's TILE_NUMBER, threads 0-127 one
// 16-byte vector each; whole lines, which tessera_nvfp4_scales_1d then writes into the
// grids. A null grid's stage is skipped.
__device__ __forceinline__ void flush_scratch(const BothScales& s, const Nvfp4Args& a, u64 R0, u64 C0,
                                              uint8_t* scratch) {
    const int t = threadIdx.x;
    if (t >= 128 || (t < 64 ? a.q_row : a.q_col) == nullptr) return;
    const u64 tile = TILE_NUMBER(R0, C0, a.k);
    // The stage is 8-byte aligned in shared memory (BothShared puts it after se[2]).
    const uint2* src = reinterpret_cast<const uint2*>(t < 64 ? &s.row[0][0] : &s.col[0][0]) + 2 * (t & 63);
    const uint2 lo = src[0], hi = src[1];
    reinterpret_cast<uint4*>(scratch + tile * 2048 + (t < 64 ? 0 : 1024))[t & 63] = make_uint4(lo.x, lo.y, hi.x, hi.y);
}

// Where the lane's values of a 128x128 tile at (R0, C0) sit: rows r0 .. r0 + 7, columns
// col .. col + 7 (rt, ct within the tile); 8 warps, 4 down and 2 across.
struct BothLane {
    int cg, g, rt, ct;
    __device__ BothLane() : BothLane(threadIdx.x) {}
    // Thread t's place (a persistent loop passes the index it read itself).
    __device__ explicit BothLane(unsigned t) {
        const int lane = t & 31, warp = t >> 5;
        cg = lane & 7;
        g = lane >> 3;
        rt = 32 * (warp / 2) + 8 * g;
        ct = 64 * (warp % 2) + 8 * cg;
    }
};

// The CTA's shared state for 2-byte inputs: (g, lim) per scale byte, [0] rows and [1]
// columns; the global encode scales; the staged scale bytes of the tile.
struct BothShared {
    float2 tab[2][128];
    float se[2];
    BothScales stage;
};

// Fills the tables (threads 0-127 the rows', 128-255 the columns'); a barrier must follow
// before any lane reads them.
__device__ __forceinline__ void both_tables(BothShared& sh, const Nvfp4Args& a) {
    const int o = threadIdx.x >> 7;
    const uint8_t* q = o ? a.q_col : a.q_row;
    const float se = q != nullptr ? global_encode_scale((o ? a.amax_col : a.amax_row)[0]) : 1.0f;
    sh.tab[o][threadIdx.x & 127] = block_table_entry(threadIdx.x & 127, __frcp_rn(se));
    if ((threadIdx.x & 127) == 0) sh.se[o] = se;
}

// The parts of the round-to-nearest both kernel that bench/cuda/nvfp4_cost.cu replaces
// (in a type derived from this one) to measure what each costs: what a CTA does before
// its loads, the loads, the fill of the encode-scale tables, the fast path's encoders of
// 8 values times g to E2M1 magnitudes, columnwise and rowwise, and the flush of the
// staged scale bytes; the tile a CTA takes. The library instantiates only these.
struct BothParts {
    // The CTA's tile, given gx tile rows.
    static __device__ __forceinline__ TileRC tile(uint32_t gx) { return tile_banded(gx); }
    static __device__ __forceinline__ void start(const Nvfp4Args&, u64, u64) {}
    // The lane's 8 rows of 8 values from (r0, col) (zeros when !valid).
    template <class T>
    static __device__ __forceinline__ void load(BothTile<T>& d, const T* __restrict__ x, u64 r0, u64 col, bool valid,
                                                const Nvfp4Args& a) {
        const uint4* src = reinterpret_cast<const uint4*>(x + r0 * a.k + col);
        const u64 row_vectors = a.k * sizeof(T) / 16;
#pragma unroll
        for (int i = 0; i < 8; ++i)
#pragma unroll
            for (int w = 0; w < BothTile<T>::W; ++w)
                d.u[i][w] = valid ? src[i * row_vectors + w] : make_uint4(0u, 0u, 0u, 0u);
    }
    static __device__ __forceinline__ void tables(BothShared& sh, const Nvfp4Args& a) { both_tables(sh, a); }
    static __device__ __forceinline__ uint32_t col_magnitudes(const float* v, float g) { return e2m1x8_magnitudes(v, g); }
    static __device__ __forceinline__ uint32_t row_magnitudes(const float* v, float g) { return e2m1x8_magnitudes(v, g); }
    static __device__ __forceinline__ void flush(const BothScales& s, const Nvfp4Args& a, u64 R0, u64 C0) {
        flush_both_scales(s, a, R0, C0);
    }
};

// Quantizes the 128x128 tile at (R0, C0) of 2-byte inputs, the lane's values in d (zeros
// when !valid), with the tables filled; synchronises the CTA twice (before its first
// write to sh.stage, and before the flush). With a scratch (two-step compact scales,
// tessera_nvfp4_scales_1d) the staged bytes go there instead of into the scale grids;
// without one (a constant null) the flush compiles as before.
template <class T, class Parts = BothParts>
__device__ __forceinline__ void both_tile(const BothTile<T>& d, const BothLane& l, u64 R0, u64 C0, bool valid,
                                          const Nvfp4Args& a, BothShared& sh, uint8_t* scratch = nullptr) {
    const int cg = l.cg, g = l.g, rt = l.rt, ct = l.ct;
    const u64 r0 = R0 + rt, col = C0 + ct;
    auto& stage = sh.stage;
    // The tile's |.| maxima as packed words, NaN-propagating: cm[p] columns 2p, 2p + 1
    // over the lane's rows, then over the pair xor 8; rm[q] rows 2q, 2q + 1 over the
    // lane's columns, then over the pair xor 1.
    uint32_t cm[4], rm[4];
#pragma unroll
    for (int q = 0; q < 4; ++q) {
        uint32_t A[4], B[4];
#pragma unroll
        for (int p = 0; p < 4; ++p) {
            A[p] = habs2w<T>(d.w[2 * q][p]);
            B[p] = habs2w<T>(d.w[2 * q + 1][p]);
            cm[p] = q == 0 ? hmax2w<T, true>(A[p], B[p]) : hmax2w<T, true>(cm[p], hmax2w<T, true>(A[p], B[p]));
        }
        const uint32_t mA = hmax2w<T, true>(hmax2w<T, true>(A[0], A[1]), hmax2w<T, true>(A[2], A[3]));
        const uint32_t mB = hmax2w<T, true>(hmax2w<T, true>(B[0], B[1]), hmax2w<T, true>(B[2], B[3]));
        rm[q] = hmax2_rows<T, true>(mA, mB);
    }
#pragma unroll
    for (int p = 0; p < 4; ++p) {
        cm[p] = hmax2w<T, true>(cm[p], __shfl_xor_sync(0xFFFFFFFFu, cm[p], 8));
        rm[p] = hmax2w<T, true>(rm[p], __shfl_xor_sync(0xFFFFFFFFu, rm[p], 1));
    }
    __syncthreads();
    // For the general path: one lane of each pair stages a block's scale byte, the even
    // one rows 0-3 / columns 0-3, the odd one the rest (the fast path's `scales` below
    // stages the same bytes from the same lanes).
    auto put_row = [&](int i, uint8_t e) {
        if ((i >> 2) == (cg & 1)) stage.row[rt + i][ct / 16] = e;
    };
    auto put_col = [&](int j, uint8_t e) {
        if ((j >> 2) == (g & 1)) stage.col[ct + j][rt / 16] = e;
    };
    // Each block's scale byte (block_scale without its clamp, which changes only NaN
    // amaxes, and those fail lim), encode scale gs[j] and whether it takes the fast
    // path. Both lanes of a pair hold the same 8 amaxes (mx[p]: blocks 2p, 2p + 1);
    // lane half h computes blocks 4h .. 4h + 3, stages their bytes, and trades its
    // encode scales for the other half's with its partner (lane xor `pair`).
    bool fast = true;
    auto scales = [&](const uint32_t* mx, int o, int h, int pair, float* gs, uint8_t* st, int st_step) {
        const float sc = __fmul_rn(sh.se[o], 0.16666667163372040f);
        const uint32_t mine[2] = {h ? mx[2] : mx[0], h ? mx[3] : mx[1]};
        float g4[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const float b = j % 2 ? hi_f32<T>(mine[j / 2]) : lo_f32<T>(mine[j / 2]);
            const uint32_t e = fp8<true>(__fmul_rn(b, sc));
            const float2 t = sh.tab[o][e];
            fast = fast && b <= t.y;
            g4[j] = t.x;
            st[j * st_step] = (uint8_t)e;
        }
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const float other = __shfl_xor_sync(0xFFFFFFFFu, g4[j], pair);
            gs[j] = h ? other : g4[j];
            gs[4 + j] = h ? g4[j] : other;
        }
    };
    float cgs[8], rgs[8];
    if (a.q_col != nullptr)
        scales(cm, 1, g & 1, 8, cgs, &stage.col[ct + 4 * (g & 1)][rt / 16], sizeof stage.col[0]);
    if (a.q_row != nullptr)
        scales(rm, 0, cg & 1, 1, rgs, &stage.row[rt + 4 * (cg & 1)][ct / 16], sizeof stage.row[0]);
    if (!__all_sync(0xFFFFFFFFu, fast)) {
        nvfp4_both_general<T>(d, r0, col, valid, a, put_row, put_col);
    } else if (valid) {
        if (a.q_col != nullptr) {
            uint8_t* q = a.q_col + col * (a.m / 2) + r0 / 2;
#pragma unroll
            for (int p = 0; p < 4; ++p) {
                uint32_t c[8], slo, shi;
#pragma unroll
                for (int i = 0; i < 8; ++i) c[i] = d.w[i][p];
                col_signs(c, slo, shi);
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    float v[8];
#pragma unroll
                    for (int i = 0; i < 8; ++i) v[i] = h ? hi_f32<T>(c[i]) : lo_f32<T>(c[i]);
                    *reinterpret_cast<uint32_t*>(q + (2 * p + h) * (a.m / 2)) =
                        Parts::col_magnitudes(v, cgs[2 * p + h]) | (h ? shi : slo);
                }
            }
        }
        if (a.q_row != nullptr) {
            uint8_t* q = a.q_row + r0 * (a.k / 2) + col / 2;
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                float v[8];
                row_values<T>(d.w[i], v);
                *reinterpret_cast<uint32_t*>(q + i * (a.k / 2)) = Parts::row_magnitudes(v, rgs[i]) | row_signs(d.w[i]);
            }
        }
    }
    __syncthreads();
    if (scratch != nullptr) flush_scratch(stage, a, R0, C0, scratch);
    else Parts::flush(stage, a, R0, C0);
}

// ---- 2-D blocks, round to nearest, without the RHT (2-byte inputs) ----------------------
//
// TE's recipe for weights: one E4M3 scale per 16x16 block, shared by both orientations
// (which share the global amax without the RHT), so that a value has the same code in
// both and the columnwise data is the rowwise data transposed. On the both kernel's
// tiles and lanes a 16x16 block is the 4 lanes {l, l ^ 1, l ^ 8, l ^ 9}, 8x8 values each:
// each lane encodes its values once, as rows, and transposes its 8x8 nibbles for the
// columns (64 encodes a lane, where 1-D blocks take 128).

// The 8x8 transpose of nibbles: w[i] holds row i (column j in bits 4j .. 4j + 3), c[j]
// receives column j (row i in bits 4i .. 4i + 3). Byte permutes swap the 4x4 quadrants,
// then the 2x2 blocks within them; shifts and masks the nibbles within bytes: 32
// operations.
__device__ __forceinline__ void transpose_nibbles8(const uint32_t* w, uint32_t* c) {
    // h[i], i < 4: columns 0-3 of rows i and i + 4; h[4 + i]: columns 4-7 of them.
    uint32_t h[8];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        h[i] = prmt(w[i], w[i + 4], 0x5410u);
        h[4 + i] = prmt(w[i], w[i + 4], 0x7632u);
    }
#pragma unroll
    for (int q = 0; q < 2; ++q)
#pragma unroll
        for (int s = 0; s < 2; ++s) {
            // Columns j, j + 1 (one byte a row): x0 of rows 0, 2, 4, 6, x1 of rows 1, 3, 5, 7.
            const int j = 4 * q + 2 * s;
            const uint32_t sel = s ? 0x7351u : 0x6240u;
            const uint32_t x0 = prmt(h[4 * q], h[4 * q + 2], sel), x1 = prmt(h[4 * q + 1], h[4 * q + 3], sel);
            c[j] = (x0 & 0x0F0F0F0Fu) | ((x1 << 4) & 0xF0F0F0F0u);
            c[j + 1] = ((x0 >> 4) & 0x0F0F0F0Fu) | (x1 & 0xF0F0F0F0u);
        }
}

// The |.| max of the lane's 16x16 block: the lane's 64 values as packed pairs (a row's 4
// words, then a tree over the rows), then over the block's 4 lanes (xor 1, xor 8), then
// the two halves. Nan = true propagates NaN (a NaN anywhere gives NaN); false ignores it
// as __hmax2 does (NaN only when all 256 values are). Every lane of the warp must call it.
template <class T, bool Nan> __device__ __forceinline__ float block_amax_2d(const BothTile<T>& d) {
    uint32_t rm[8];
#pragma unroll
    for (int i = 0; i < 8; ++i)
        rm[i] = hmax2w<T, Nan>(hmax2w<T, Nan>(habs2w<T>(d.w[i][0]), habs2w<T>(d.w[i][1])),
                               hmax2w<T, Nan>(habs2w<T>(d.w[i][2]), habs2w<T>(d.w[i][3])));
#pragma unroll
    for (int s = 4; s > 0; s /= 2)
#pragma unroll
        for (int i = 0; i < s; ++i) rm[i] = hmax2w<T, Nan>(rm[i], rm[i + s]);
    uint32_t mx = hmax2w<T, Nan>(rm[0], __shfl_xor_sync(0xFFFFFFFFu, rm[0], 1));
    mx = hmax2w<T, Nan>(mx, __shfl_xor_sync(0xFFFFFFFFu, mx, 8));
    return lo_f32<T>(hmax2_rows<T, Nan>(mx, mx));
}

// The scale byte e of the lane's 16x16 block for its 16 rows and 16 columns: this lane's
// 4 of each (the lane pair xor 1 shares rows, xor 8 columns).
__device__ __forceinline__ void stage_block_2d(BothScales& stage, const BothLane& l, uint8_t e) {
    const int hr = l.cg & 1, hc = l.g & 1;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        stage.row[l.rt + 4 * hr + j][l.ct / 16] = e;
        stage.col[l.ct + 4 * hc + j][l.rt / 16] = e;
    }
}

// The lane's codes of rows r0 .. r0 + 7 (w[i]: row i, 8 columns from col) into the
// rowwise data, and of columns col .. col + 7 (c[j]: column j, 8 rows from r0) into the
// columnwise data.
__device__ __forceinline__ void store_rows_2d(const Nvfp4Args& a, u64 r0, u64 col, const uint32_t* w) {
    uint8_t* q = a.q_row + r0 * (a.k / 2) + col / 2;
#pragma unroll
    for (int i = 0; i < 8; ++i) *reinterpret_cast<uint32_t*>(q + i * (a.k / 2)) = w[i];
}
__device__ __forceinline__ void store_cols_2d(const Nvfp4Args& a, u64 r0, u64 col, const uint32_t* c) {
    uint8_t* q = a.q_col + col * (a.m / 2) + r0 / 2;
#pragma unroll
    for (int j = 0; j < 8; ++j) *reinterpret_cast<uint32_t*>(q + j * (a.m / 2)) = c[j];
}

// The scratch of 2-D blocks' two-step compact scales: 128 bytes a 128x128 tile, tiles
// in row-major order (tile (i, j) the i * ceil(k / 128) + j-th), each the tile's 8x8
// block scales row by row (byte 8 r + c: block row r, block column c) and then column
// by column (byte 64 + 8 c + r), so that the tile kernel writes whole sectors and a word
// of 4 neighbouring blocks of either grid row is one aligned load. Blocks past the
// tensor's edge hold bytes nobody reads. (A block grid and its transpose in the compact
// grids' own layout, one byte a block stored in place, made each CTA write 8 bytes of
// 8 rows of each, partial sectors shared with 3 other CTAs: NVFP4 2-D both took 1.6% /
// 0.7% / 0.9% longer at 16384x8192 / 8192x8192 / 8192x4096 on an H100, BENCHMARKS
// session 50.) bm, bk: the block grid's extent; pr, pc: the compact scale grids' row
// lengths, the block counts rounded up to 4.
struct BlockScratch {
    u64 bm, bk, pr, pc, tk;
    __device__ BlockScratch(u64 m, u64 k)
        : bm(m / 16), bk(k / 16), pr((k / 16 + 3) / 4 * 4), pc((m / 16 + 3) / 4 * 4), tk((k + 127) / 128) {}
    // Where a tile's byte sits in its 128 bytes: of block row `line` and block column
    // `at` in the row-by-row copy, or (cols) of block column `line` and block row `at` in
    // the column-by-column one (line, at < 8).
    template <class I> static __device__ __forceinline__ I in_tile(bool cols, I line, I at) {
        return (cols ? 64 : 0) + line * 8 + at;
    }
    // The word of blocks 4 w .. 4 w + 3 of block row i (cols: of block column i).
    __device__ u64 word_offset(bool cols, u64 i, u64 w) const {
        const u64 tile = cols ? (w / 2) * tk + i / 8 : (i / 8) * tk + w / 2;
        return tile * 128 + in_tile(cols, i % 8, 4 * (w % 2));
    }
};

// Quantizes the 128x128 tile at (R0, C0) of 2-byte inputs in 16x16 blocks, the lane's
// values in d (zeros when !valid), with the tables filled; synchronises the CTA before it
// reads the tables, and before the flush of the staged scale bytes unless blk (the
// BlockScratch, or null) takes them (two steps, see tessera_nvfp4_scales_2d).
// A warp whose blocks all pass `b <= lim[e]` (both_tile's fast path) encodes without
// saturation or NaN handling and takes the signs from the raw bits; any other warp as
// nvfp4_impl does (NaN-ignoring block amax, saturating encoder). Both give the same bytes.
template <class T>
__device__ __forceinline__ void both_tile_2d(const BothTile<T>& d, const BothLane& l, u64 R0, u64 C0, bool valid,
                                             const Nvfp4Args& a, BothShared& sh, uint8_t* blk) {
    const u64 r0 = R0 + l.rt, col = C0 + l.ct;
    const float b = block_amax_2d<T, true>(d);
    __syncthreads();
    // One global amax: the tables of both orientations are equal; take a filled one.
    const int o = a.q_row != nullptr ? 0 : 1;
    uint32_t e = fp8<true>(__fmul_rn(b, __fmul_rn(sh.se[o], 0.16666667163372040f)));
    const float2 t = sh.tab[o][e];
    uint32_t w[8];  // the lane's codes, row i in w[i]
    if (__all_sync(0xFFFFFFFFu, b <= t.y)) {
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            float v[8];
            row_values<T>(d.w[i], v);
            w[i] = e2m1x8_magnitudes(v, t.x) | row_signs(d.w[i]);
        }
    } else {
        // NaN-ignoring, and 0 for a block of NaNs, as the 1-D blocks' amax.
        const float s_enc = sh.se[o];
        e = block_scale(fmaxf(0.0f, block_amax_2d<T, false>(d)), s_enc);
        const float ge = block_encode_scale((uint8_t)e, __frcp_rn(s_enc));
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            float v[8];
            row_values<T>(d.w[i], v);
            w[i] = e2m1x8(v, ge);
        }
    }
    // Two steps: one lane of the block's 4 stores its byte twice into the tile's 128
    // bytes of scratch (BlockScratch; blocks past the edge too, never read), from which
    // tessera_nvfp4_scales_2d writes the scale grids after this kernel.
    if (blk == nullptr) {
        stage_block_2d(sh.stage, l, (uint8_t)e);
    } else if ((l.cg & 1) == 0 && (l.g & 1) == 0) {
        uint8_t* s = blk + TILE_NUMBER(R0, C0, a.k) * 128;
        const int br = l.rt / 16, bc = l.ct / 16;
        s[BlockScratch::in_tile(false, br, bc)] = (uint8_t)e;
        s[BlockScratch::in_tile(true, bc, br)] = (uint8_t)e;
    }
    if (valid) {
        if (a.q_row != nullptr) store_rows_2d(a, r0, col, w);
        if (a.q_col != nullptr) {
            uint32_t c[8];
            transpose_nibbles8(w, c);
            store_cols_2d(a, r0, col, c);
        }
    }
    if (blk != nullptr) return;
    __syncthreads();
    flush_both_scales(sh.stage, a, R0, C0);
}

// The both kernel's tile policy: 1-D blocks (both_tile or both_tile_rs), 1-D blocks with
// two-step compact scales (both_tile and a scratch), or 2-D ones (both_tile_2d, with the
// block scratch of two-step compact scales or null; the harness bench/cuda/nvfp4_2d.cu
// puts its variants in its place). own_tile: the policy quantizes the tile itself.
struct OneDTiles {
    static constexpr bool own_tile = false;
};
struct ScratchTiles {
    static constexpr bool own_tile = true;
    uint8_t* scratch;
    template <class T>
    __device__ __forceinline__ void tile(const BothTile<T>& d, const BothLane& l, u64 R0, u64 C0, bool valid,
                                         const Nvfp4Args& a, BothShared& sh) const {
        both_tile<T>(d, l, R0, C0, valid, a, sh, scratch);
    }
};
struct TwoDTiles {
    static constexpr bool own_tile = true;
    uint8_t* blk;
    template <class T>
    __device__ __forceinline__ void tile(const BothTile<T>& d, const BothLane& l, u64 R0, u64 C0, bool valid,
                                         const Nvfp4Args& a, BothShared& sh) const {
        both_tile_2d<T>(d, l, R0, C0, valid, a, sh, blk);
    }
};

// The second step of 2-D blocks' compact scales: the grids from the BlockScratch at blk.
// Grid row 16 i + v of the rowwise grid is row i of the block grid, of the columnwise
// grid row i of its transpose (v = 0 .. 15). A thread loads one word (4 blocks) of a
// block-grid row, clears the bytes past the row's end (the grids' padding is 0), and
// stores the word into `copies` (1, 2, 4, 8 or 16) of its 16 grid rows: a warp stores 32
// consecutive words of a row, whole lines. blockIdx.y picks the grid (0 rowwise, 1
// columnwise; a null grid is not written), blockIdx.z the copies. The both kernel's CTA
// owns 8 bytes of 128 rows of each grid: stored from the tile kernel they cost a quarter
// of its time (0.227 against 0.168 ms without them at 16384x8192 on an H100, 0.174
// against 0.126 on an H200; bench/cuda/nvfp4_2d.cu). (A CTA a 32x32 tile of the block
// grid through shared memory, 32-byte pieces of grid rows, took 0.0145 ms on the H200
// for 16.8 MB; a warp a grid row gathering single bytes 0.045 ms on the H100.)
__device__ void nvfp4_scales_2d_impl(const uint8_t* __restrict__ blk, u64 m, u64 k, uint8_t* __restrict__ s_row,
                                     u64 s_row_cols, uint8_t* __restrict__ s_col, u64 s_col_cols, int copies) {
    pdl_first();
    const BlockScratch g(m, k);
    const bool cols = blockIdx.y == 1;
    uint8_t* dst = cols ? s_col : s_row;
    if (dst == nullptr) return;
    const u64 rows = cols ? g.bk : g.bm, n = cols ? g.bm : g.bk, pitch = cols ? g.pc : g.pr;
    // A block-grid row's words; the scale grid's row stride in words (at least as many:
    // its columns past the block grid's are padding, cleared before).
    const u64 words = pitch / 4, stride = (cols ? s_col_cols : s_row_cols) / 4;
    const u64 t = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= rows * words) return;
    const u64 i = t / words, w = t % words;
    uint32_t word = *reinterpret_cast<const uint32_t*>(blk + g.word_offset(cols, i, w));
    if (n - 4 * w < 4) word &= (1u << (8 * (n - 4 * w))) - 1u;  // past the row's end
    uint32_t* d = reinterpret_cast<uint32_t*>(dst) + (16 * i + (u64)blockIdx.z * copies) * stride + w;
#pragma unroll 4
    for (int v = 0; v < copies; ++v) d[v * stride] = word;
}

// Grid (ceil(max(rowwise, columnwise grid words a copy) / 256), 2, 16 / copies).
extern "C" __global__ void __launch_bounds__(256) tessera_nvfp4_scales_2d(const uint8_t* __restrict__ blk, u64 m, u64 k,
                                                                         uint8_t* s_row, u64 s_row_cols, uint8_t* s_col,
                                                                         u64 s_col_cols, int copies) {
    nvfp4_scales_2d_impl(blk, m, k, s_row, s_row_cols, s_col, s_col_cols, copies);
}

// The second step of 1-D blocks' compact scales: the grids from the tiles' staged bytes
// in `scratch` (flush_scratch). A thread takes one tile's 32 bytes of 4 grid rows (a
// sector: 8 blocks a row; of rows, 16 columns each; of columns, 16 rows each) and
// stores, for each row, the words the one-step flush would: the first always, the second
// where its first block is inside the tensor (a grid row's bytes past that are padding,
// cleared before), as one 8-byte store where the grid and its rows are 8-byte aligned. A
// warp covers 32 tiles of 4 grid rows: whole sectors read, 4 runs of 256 bytes written.
// (A thread per 8 bytes of one row read a quarter of each sector it touched: 0.0156 ms
// at 16384x8192 on an H100 in the harness's form.) blockIdx.y picks the grid (0
// rowwise, 1 columnwise; a null grid is not written). The grids' rows are multiples of
// 16, so of 4; `quads` is the grid's rows / 4 times its tiles a row, and the host checks
// that both grids' counts fit 32 bits.
__device__ void nvfp4_scales_1d_impl(const uint8_t* __restrict__ scratch, u64 m, u64 k, uint8_t* __restrict__ s_row,
                                     u64 s_row_cols, uint8_t* __restrict__ s_col, u64 s_col_cols) {
    pdl_first();
    const bool cols = blockIdx.y == 1;
    uint8_t* dst = cols ? s_col : s_row;
    if (dst == nullptr) return;
    const uint32_t tr = (uint32_t)((m + 127) / 128), tc = (uint32_t)((k + 127) / 128);
    const uint32_t quads = (uint32_t)((cols ? k : m) / 4), per_row = cols ? tr : tc;
    const u64 blocks = (cols ? m : k) / 16, stride = cols ? s_col_cols : s_row_cols;
    const uint32_t t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= quads * per_row) return;
    const uint32_t r = 4 * (t / per_row), p = t % per_row;
    const u64 tile = cols ? (u64)p * tc + r / 128 : (u64)(r / 128) * tc + p;
    const uint4* src = reinterpret_cast<const uint4*>(scratch + tile * 2048 + (cols ? 1024 : 0) + (r % 128) * 8);
    const uint4 lo = src[0], hi = src[1];
    const uint2 v[4] = {make_uint2(lo.x, lo.y), make_uint2(lo.z, lo.w), make_uint2(hi.x, hi.y), make_uint2(hi.z, hi.w)};
    const bool second = 8 * (u64)p + 4 < blocks;
    const bool wide = second && stride % 8 == 0 && reinterpret_cast<uintptr_t>(dst) % 8 == 0;
#pragma unroll
    for (int q = 0; q < 4; ++q) {
        uint8_t* d = dst + (u64)(r + q) * stride + 8 * (u64)p;
        if (wide) {
            *reinterpret_cast<uint2*>(d) = v[q];
        } else {
            *reinterpret_cast<uint32_t*>(d) = v[q].x;
            if (second) *reinterpret_cast<uint32_t*>(d + 4) = v[q].y;
        }
    }
}

// Grid (ceil(max(rowwise, columnwise quads) / 256), 2).
extern "C" __global__ void __launch_bounds__(256) tessera_nvfp4_scales_1d(const uint8_t* __restrict__ scratch, u64 m,
                                                                         u64 k, uint8_t* s_row, u64 s_row_cols,
                                                                         uint8_t* s_col, u64 s_col_cols) {
    nvfp4_scales_1d_impl(scratch, m, k, s_row, s_row_cols, s_col, s_col_cols);
}

// ---- 1-D blocks with the RHT and/or stochastic rounding (2-byte inputs) ------------------
//
// The recipes of gradients (RHT on the columnwise operand, stochastic rounding) and of
// inputs (RHT, round to nearest) on the both kernel's tiles, lanes, loads and staged
// scale bytes. There is no fast path to leave: every block is taken as it comes. Block
// amaxes ignore NaN (as the CPU's do), the encoders saturate, and a NaN product codes 7
// (+6): NaN results of the GPU's float arithmetic are canonical (0x7FFFFFFF), so a
// product's sign bit is its code's sign for every value, -0 and NaN included.
//
// Columnwise, the two lanes of a pair (xor 8) hold 8 rows each of the same 8 columns.
// They trade raw words so that each holds all 16 rows of 4 columns (the even lane columns
// 0-3, the odd one 4-7): a column block's RHT, amax, scale and random bits are then the
// lane's own. Rowwise, a 1x16 block spans a pair (xor 1) as in the both kernel; each lane
// draws the Philox block of 4 of the pair's 8 row blocks and trades the partner's half.

// The sign nibbles of 8 floats: bit 4j + 3 is the sign bit of y[j], all others 0 (prmt
// selector nibble 0xB is byte 3 of the first word with its sign replicated, 0xF byte 3
// of the second).
__device__ __forceinline__ uint32_t float_signs(const float* y) {
    const uint32_t s02 = prmt(__float_as_uint(y[0]), __float_as_uint(y[2]), 0xFBu);
    const uint32_t s46 = prmt(__float_as_uint(y[4]), __float_as_uint(y[6]), 0xFBu);
    const uint32_t s13 = prmt(__float_as_uint(y[1]), __float_as_uint(y[3]), 0xFBu);
    const uint32_t s57 = prmt(__float_as_uint(y[5]), __float_as_uint(y[7]), 0xFBu);
    return sign_nibbles(prmt(s02, s46, 0x5410u), prmt(s13, s57, 0x5410u));
}

// 8 products to E2M1 codes, round to nearest, any value: e2m1_biased's minimum taken on
// the bits as unsigned integers (they order alike from 2^23 up; NaN's and Inf's bits
// exceed 7's, so both saturate to 7), signs from the products' sign bits.
__device__ __forceinline__ uint32_t e2m1x8_rn(const float* y) {
    const float k = 8388608.0f;  // 2^23
    uint32_t w = 0;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        const float a = fabsf(y[j]);
        const uint32_t f0 = __float_as_uint(__fmaf_rn(a, 2.0f, k));
        const uint32_t f1 = __float_as_uint(__fadd_rn(a, k + 2.0f));
        const uint32_t f2 = __float_as_uint(__fmaf_rn(a, 0.5f, k + 4.0f));
        w += min(min(f0, f1), min(f2, 0x4B000007u)) << (4 * j);
    }
    return (w - 0x4B000000u * 0x11111111u) | float_signs(y);
}

// 8 products to E2M1 codes with stochastic rounding (e2m1_sr_magnitude), element j with
// byte j % 4 of r.x (j < 4) or r.y; signs from the products' sign bits. The codes are
// added in place (one multiply-add each; the fields do not overlap).
__device__ __forceinline__ uint32_t e2m1x8_sr(const float* y, uint2 r) {
    uint32_t w = 0;
#pragma unroll
    for (int j = 0; j < 8; ++j) w += e2m1_sr_magnitude(y[j], sr_byte(j < 4 ? r.x : r.y, j)) << (4 * j);
    return w | float_signs(y);
}

// rht16 of values of a 2-byte type in place: their products v_t * (+-1/4) are exact, so
// the first stage's sum and difference are fmas of one product with the other (the
// same roundings; 3 operations per pair instead of 4).
__device__ __forceinline__ void rht16_exact(float* y) {
#pragma unroll
    for (int t = 0; t < 16; t += 2) {
        const float p = __fmul_rn(y[t + 1], 0.25f * rht_sign(t + 1)), c = 0.25f * rht_sign(t);
        const float s = __fmaf_rn(y[t], c, p), d = __fmaf_rn(y[t], c, -p);
        y[t] = s;
        y[t + 1] = d;
    }
    fwht16<2>(y);
}

// Whether both halves of a word of packed |.| maxima of 2-byte T are below 2^126 (NaN
// and Inf are not): a block of such values keeps every RHT partial sum finite (each is
// at most 4 times the block's amax), so its transformed values are finite too.
template <class T> __device__ __forceinline__ bool tame2(uint32_t w) {
    return lo_f32<T>(w) < 0x1p126f && hi_f32<T>(w) < 0x1p126f;
}

// The pair's 8 row block amaxes of a tile's lane (NaN policy as hmax2w): rm[q] rows 2q,
// 2q + 1 over the lane's columns, then over the pair xor 1.
template <class T, bool Nan>
__device__ __forceinline__ void row_block_maxima(const BothTile<T>& d, uint32_t* rm) {
#pragma unroll
    for (int q = 0; q < 4; ++q) {
        uint32_t mA = habs2w<T>(d.w[2 * q][0]), mB = habs2w<T>(d.w[2 * q + 1][0]);
#pragma unroll
        for (int p = 1; p < 4; ++p) {
            mA = hmax2w<T, Nan>(mA, habs2w<T>(d.w[2 * q][p]));
            mB = hmax2w<T, Nan>(mB, habs2w<T>(d.w[2 * q + 1][p]));
        }
        rm[q] = hmax2_rows<T, Nan>(mA, mB);
        rm[q] = hmax2w<T, Nan>(rm[q], __shfl_xor_sync(0xFFFFFFFFu, rm[q], 1));
    }
}

// Quantizes the 128x128 tile at (R0, C0) of 2-byte inputs with the RHT on the columnwise
// operand (Rht) and/or stochastic rounding (Sr), the lane's values in d (zeros when
// !valid), with the tables filled; synchronises the CTA twice (before its first write to
// sh.stage, and before the flush).
//
// Round to nearest (Rht without Sr) has both_tile's fast path: a block whose amax b is at
// most its table entry's lim (block_table_entry) has every |y g| < 7, so its values take
// e2m1x8_magnitudes (no saturation, codes packed by byte permutes) instead of
// e2m1x8_rn. It needs a tame warp (tame2: every input of the warp's 32x64 values finite
// and below 2^126, from NaN-propagating maxima), where the NaN-propagating row amaxes are
// the NaN-ignoring ones the scale bytes come from and no RHT value is NaN or infinite;
// otherwise the warp recomputes its row amaxes NaN-ignoring and takes e2m1x8_rn
// throughout. The rows take the fast path when every row block of the warp may (one
// branch for the warp), each column block when it may.
template <class T, bool Rht, bool Sr>
__device__ __forceinline__ void both_tile_rs(const BothTile<T>& d, const BothLane& l, u64 R0, u64 C0, bool valid,
                                             const Nvfp4Args& a, BothShared& sh) {
    constexpr bool Fast = Rht && !Sr;
    const int cg = l.cg, g = l.g, rt = l.rt, ct = l.ct;
    const u64 r0 = R0 + rt, col = C0 + ct;
    auto& stage = sh.stage;
    __syncthreads();
    bool tame = false;  // Fast: the warp's inputs are tame (set with the row amaxes)
    if (a.q_row != nullptr) {
        // The pair's 8 row block amaxes, rm[q] rows 2q, 2q + 1 (NaN-ignoring); lane half
        // h computes the scales of rows 4h .. 4h + 3 and trades encode scales.
        const int h = cg & 1;
        uint32_t rm[4];
        if constexpr (Fast) {
            row_block_maxima<T, true>(d, rm);
            bool t = true;
#pragma unroll
            for (int q = 0; q < 4; ++q) t = t && tame2<T>(rm[q]);
            tame = __all_sync(0xFFFFFFFFu, t);
            if (!tame) row_block_maxima<T, false>(d, rm);
        } else {
            row_block_maxima<T, false>(d, rm);
        }
        bool fast = tame;
        const float s_enc = sh.se[0];
        float g4[4], rgs[8];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const uint32_t w = h ? rm[2 + j / 2] : rm[j / 2];
            const float b = fmaxf(0.0f, j % 2 ? hi_f32<T>(w) : lo_f32<T>(w));
            const uint8_t e = block_scale(b, s_enc);
            const float2 t = sh.tab[0][e];
            if constexpr (Fast) fast = fast && b <= t.y;
            g4[j] = t.x;
            stage.row[rt + 4 * h + j][ct / 16] = e;
        }
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const float other = __shfl_xor_sync(0xFFFFFFFFu, g4[j], 1);
            rgs[j] = h ? other : g4[j];
            rgs[4 + j] = h ? g4[j] : other;
        }
        // The lane's two random words of each row block: elements 8h .. 8h + 7.
        uint2 rw[8];
        if constexpr (Sr) {
            const u64 c16 = col - 8 * h;  // the pair's first column
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const uint4 r = random16(a.seed, a.off_row, (r0 + 4 * h + j) * a.k + c16);
                const uint2 own = h ? make_uint2(r.z, r.w) : make_uint2(r.x, r.y);
                const uint2 give = h ? make_uint2(r.x, r.y) : make_uint2(r.z, r.w);
                const uint2 got = make_uint2(__shfl_xor_sync(0xFFFFFFFFu, give.x, 1),
                                             __shfl_xor_sync(0xFFFFFFFFu, give.y, 1));
                rw[j] = h ? got : own;
                rw[4 + j] = h ? own : got;
            }
        }
        if constexpr (Fast) fast = __all_sync(0xFFFFFFFFu, fast);
        if (valid) {
            uint8_t* q = a.q_row + r0 * (a.k / 2) + col / 2;
            if (Fast && fast) {
#pragma unroll
                for (int i = 0; i < 8; ++i) {
                    float v[8];
                    row_values<T>(d.w[i], v);
                    *reinterpret_cast<uint32_t*>(q + i * (a.k / 2)) =
                        e2m1x8_magnitudes(v, rgs[i]) | row_signs(d.w[i]);
                }
            } else {
#pragma unroll
                for (int i = 0; i < 8; ++i) {
                    float y[8];
                    row_values<T>(d.w[i], y);
#pragma unroll
                    for (int j = 0; j < 8; ++j) y[j] = __fmul_rn(y[j], rgs[i]);
                    uint32_t code;
                    if constexpr (Sr) code = e2m1x8_sr(y, rw[i]);
                    else code = e2m1x8_rn(y);
                    *reinterpret_cast<uint32_t*>(q + i * (a.k / 2)) = code;
                }
            }
        }
    }
    if (a.q_col != nullptr) {
        if (Fast && a.q_row == nullptr) {
            // Columnwise only: the warp's tameness from its lanes' own maxima.
            uint32_t m = habs2w<T>(d.w[0][0]);
#pragma unroll
            for (int i = 0; i < 8; ++i)
#pragma unroll
                for (int p = 0; p < 4; ++p) m = hmax2w<T, true>(m, habs2w<T>(d.w[i][p]));
            tame = __all_sync(0xFFFFFFFFu, tame2<T>(m));
        }
        // Lane half h keeps words 2h, 2h + 1 (columns 4h .. 4h + 3) of its 8 rows and gets
        // the partner's 8 rows of them: top[i] rows 0-7 of the pair, bot[i] rows 8-15.
        const int h = g & 1;
        uint32_t top[8][2], bot[8][2];
#pragma unroll
        for (int i = 0; i < 8; ++i)
#pragma unroll
            for (int p = 0; p < 2; ++p) {
                const uint32_t mine = h ? d.w[i][2 + p] : d.w[i][p];
                const uint32_t got = __shfl_xor_sync(0xFFFFFFFFu, h ? d.w[i][p] : d.w[i][2 + p], 8);
                top[i][p] = h ? got : mine;
                bot[i][p] = h ? mine : got;
            }
        const u64 R16 = r0 - 8 * h, c4 = col + 4 * h;  // the block's first row, first column
        const float s_enc = sh.se[1];
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            float y[16];
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                y[i] = c % 2 ? hi_f32<T>(top[i][c / 2]) : lo_f32<T>(top[i][c / 2]);
                y[8 + i] = c % 2 ? hi_f32<T>(bot[i][c / 2]) : lo_f32<T>(bot[i][c / 2]);
            }
            if constexpr (Rht) rht16_exact(y);
            float b = 0.0f;
#pragma unroll
            for (int i = 0; i < 16; ++i) b = fmaxf(b, fabsf(y[i]));
            const uint8_t e = block_scale(b, s_enc);
            const float2 t = sh.tab[1][e];
            const float gs = t.x;
            stage.col[ct + 4 * h + c][rt / 16] = e;
            uint2 out;
            if (Fast && tame && b <= t.y) {
                out = make_uint2(e2m1x8_magnitudes(y, gs) | float_signs(y),
                                 e2m1x8_magnitudes(y + 8, gs) | float_signs(y + 8));
                if (valid) *reinterpret_cast<uint2*>(a.q_col + (c4 + c) * (a.m / 2) + R16 / 2) = out;
                continue;
            }
#pragma unroll
            for (int i = 0; i < 16; ++i) y[i] = __fmul_rn(y[i], gs);
            if constexpr (Sr) {
                const uint4 r = random16(a.seed, a.off_col, (c4 + c) * a.m + R16);
                out = make_uint2(e2m1x8_sr(y, make_uint2(r.x, r.y)),
                                 e2m1x8_sr(y + 8, make_uint2(r.z, r.w)));
            } else {
                out = make_uint2(e2m1x8_rn(y), e2m1x8_rn(y + 8));
            }
            if (valid) *reinterpret_cast<uint2*>(a.q_col + (c4 + c) * (a.m / 2) + R16 / 2) = out;
        }
    }
    __syncthreads();
    flush_both_scales(stage, a, R0, C0);
}

// The both kernel: round to nearest without the RHT (Rht = Sr = false; f32 inputs too),
// or, for 2-byte inputs, both_tile_rs's recipes, or 2-D blocks (Tiles = TwoDTiles, round
// to nearest without the RHT). Parts: both_tile's.
template <class T, bool Rht = false, bool Sr = false, class Parts = BothParts, class Tiles = OneDTiles>
__device__ void nvfp4_both_impl(const T* __restrict__ x, const Nvfp4Args a, const Tiles tiles = Tiles{}) {
    copy_amax(a);
    const BothLane l;
    const TileRC tile = Parts::tile((uint32_t)((a.m + 127) / 128));
    const u64 R0 = (u64)tile.row * 128, C0 = (u64)tile.col * 128;  // the CTA's tile
    if (R0 >= a.m) return;  // past the last band's rows (the whole CTA)
    Parts::start(a, R0, C0);
    const u64 r0 = R0 + l.rt, col = C0 + l.ct;  // the lane's first row and column
    // m, k multiples of 16: both lanes of a pair are in or out together, so the
    // shuffles below pair valid lanes with valid lanes.
    const bool valid = r0 < a.m && col < a.k;
    BothTile<T> d;
    Parts::load(d, x, r0, col, valid, a);
    pdl_wait();  // the global amaxes come from the kernel before
    if constexpr (sizeof(T) == 4) {
        // f32 inputs: the general path, scale bytes stored directly by one lane of a pair.
        const u64 ib = r0 / 16, jb = col / 16;
        nvfp4_both_general<T>(
            d, r0, col, valid, a,
            [&](int i, uint8_t e) {
                const u64 r = r0 + i;
                if (valid && (l.cg & 1) == 0)
                    a.s_row[scale_index(r, jb, a.s_row_cols, a.swizzled)] = e;
            },
            [&](int j, uint8_t e) {
                const u64 c = col + j;
                if (valid && (l.g & 1) == 0)
                    a.s_col[scale_index(c, ib, a.s_col_cols, a.swizzled)] = e;
            });
    } else {
        __shared__ BothShared sh;
        Parts::tables(sh, a);
        if constexpr (Tiles::own_tile) tiles.template tile<T>(d, l, R0, C0, valid, a, sh);
        else if constexpr (Rht || Sr) both_tile_rs<T, Rht, Sr>(d, l, R0, C0, valid, a, sh);
        else both_tile<T, Parts>(d, l, R0, C0, valid, a, sh);
    }
}

#ifndef NVFP4_ROW_BLOCKS
#define NVFP4_ROW_BLOCKS 2
#endif
// CTAs per SM the both kernel is compiled for with 2-byte inputs (f32 inputs: 2, whose
// 64-value tile needs about 128 registers). 4 caps it at 64 registers: the fast path
// fits without spilling (the general path, taken by tiles with NaN, Inf or extreme
// scales, spills a few words). On an H200 at 16384x8192 the kernel alone took 0.139 ms
// against 0.155 ms with 3 CTAs per SM (80 registers), 0.133 against 0.141 with swizzled
// scales, and no longer on inputs that take the general path.
#ifndef NVFP4_BOTH_MINB
#define NVFP4_BOTH_MINB 4
#endif

// ---- every option: 2-D tiles, the RHT, stochastic rounding ------------------------------

// One 1x16 block of the general kernel: its scale byte (returned) from its amax b and the
// global amax A, and its 16 values v times the block's encode scale as E2M1 codes in
// packed (to nearest, or stochastically with the Philox bytes of element `el` of the
// stream at `offset`).
__device__ __forceinline__ uint8_t encode_block16(const float* v, float b, float A, const Nvfp4Args& a, u64 offset,
                                                  u64 el, uint32_t* packed) {
    const float s_enc = global_encode_scale(A);
    const float s_dec = __frcp_rn(s_enc);
    const uint8_t e = block_scale(b, s_enc);
    const float g = block_encode_scale(e, s_dec);
    packed[0] = packed[1] = 0u;
    const uint4 rnd = a.sr ? random16(a.seed, offset, el) : make_uint4(0, 0, 0, 0);
#pragma unroll
    for (int j = 0; j < 16; ++j) {
        const float y = __fmul_rn(v[j], g);
        const uint32_t code = a.sr ? e2m1_sr(y, sr_byte(rnd, j)) : e2m1(y);
        packed[j / 8] |= code << (4 * (j % 8));
    }
    return e;
}

// One CTA per 64x64 tile (ceil(m/64) x ceil(k/64) tiles, column-major; 256 threads). Rowwise: thread t
// owns row t/4 and columns (t%4)*16 .. +16 (one 1x16 block). Columnwise: thread t owns
// column t/4 and rows (t%4)*16 .. +16 of the tile (one block of the transposed operand).
template <class T>
__device__ void nvfp4_impl(const T* __restrict__ x, const Nvfp4Args a) {
    __shared__ float tile[64][64 + 1];
    __shared__ float blk[64][4];       // 1x16 block amaxes (rowwise) / transformed (columnwise)
    __shared__ float tmax[4][4];       // 16x16 tile amaxes
    copy_amax(a);
    const int t = threadIdx.x;
    // Tile rows fastest (column-major, the order of its former 2-D grid), unlike the other
    // tile kernels. The division made the compiler take 63 registers instead of 48 (4
    // CTAs per SM instead of 5; rowwise alone on an H200 0.547 of a copy instead of
    // 0.599); the launch bound of 5 CTAs gives the 48 back without spills.
    const uint32_t gx = (uint32_t)((a.m + 63) / 64);  // 32-bit: see tile_row
    const u64 m0 = (u64)(blockIdx.x % gx) * 64, k0 = (u64)(blockIdx.x / gx) * 64;
    // Rowwise view.
    const int r = t / 4, c0 = (t % 4) * 16;
    const bool rvalid = m0 + r < a.m && k0 + c0 < a.k;
    float v[16];
    if (rvalid) {
        load16<T>(x + (m0 + r) * a.k + k0 + c0, v);
    } else {
#pragma unroll
        for (int j = 0; j < 16; ++j) v[j] = 0.0f;
    }
    pdl_wait();  // the global amaxes come from the kernel before
    float bamax = 0.0f;
#pragma unroll
    for (int j = 0; j < 16; ++j) bamax = fmaxf(bamax, fabsf(v[j]));
    // The shared tile serves the columnwise view, the block amaxes the 16x16 tiles; a
    // rowwise 1-D quantization needs neither (and no barrier).
    if (a.q_col != nullptr) {
#pragma unroll
        for (int j = 0; j < 16; ++j) tile[r][c0 + j] = v[j];
    }
    if (a.two_d) blk[r][t % 4] = bamax;
    if (a.q_col != nullptr || a.two_d) __syncthreads();
    if (a.two_d && t < 16) {
        const int ti = t / 4, tj = t % 4;
        float mx = 0.0f;
        for (int rr = ti * 16; rr < ti * 16 + 16; ++rr) mx = fmaxf(mx, blk[rr][tj]);
        tmax[ti][tj] = mx;
    }
    if (a.two_d) __syncthreads();
    if (a.q_row != nullptr && rvalid) {
        const u64 row = m0 + r, col = k0 + c0;
        uint32_t packed[2];
        const uint8_t e =
            encode_block16(v, a.two_d ? tmax[r / 16][t % 4] : bamax, a.amax_row[0], a, a.off_row, row * a.k + col, packed);
        reinterpret_cast<uint2*>(a.q_row + row * (a.k / 2) + col / 2)[0] = make_uint2(packed[0], packed[1]);
        a.s_row[scale_index(row, col / 16, a.s_row_cols, a.swizzled)] = e;
    }
    if (a.q_col == nullptr) return;
    // Columnwise view: column cc of the tile, rows 16*run .. +16.
    const int cc = t / 4, run = t % 4;
    const bool cvalid = k0 + cc < a.k && m0 + run * 16 < a.m;
    float w[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) w[i] = tile[run * 16 + i][cc];
    if (a.rht) {
        float y[16];
        rht16(w, y);
#pragma unroll
        for (int i = 0; i < 16; ++i) w[i] = y[i];
    }
    float camax = 0.0f;
#pragma unroll
    for (int i = 0; i < 16; ++i) camax = fmaxf(camax, fabsf(w[i]));
    float b = camax;
    if (a.two_d) {
        if (a.rht) {
            // 16x16 tiles of the transformed operand: max over the 16 columns of the group.
            __syncthreads();
            blk[cc][run] = cvalid ? camax : 0.0f;
            __syncthreads();
            b = 0.0f;
            for (int c2 = (cc / 16) * 16; c2 < (cc / 16) * 16 + 16; ++c2) b = fmaxf(b, blk[c2][run]);
        } else {
            b = tmax[run][cc / 16];
        }
    }
    if (!cvalid) return;
    const u64 kk = k0 + cc, mm = m0 + run * 16;
    uint32_t packed[2];
    const uint8_t e = encode_block16(w, b, a.amax_col[0], a, a.off_col, kk * a.m + mm, packed);
    reinterpret_cast<uint2*>(a.q_col + kk * (a.m / 2) + mm / 2)[0] = make_uint2(packed[0], packed[1]);
    a.s_col[scale_index(kk, mm / 16, a.s_col_cols, a.swizzled)] = e;
}

#define NVFP4(SUFFIX, T)                                                                        \
    extern "C" __global__ void __launch_bounds__(256, 5) tessera_nvfp4_##SUFFIX(const T* __restrict__ x, \
                                                                                const Nvfp4Args a) { \
        nvfp4_impl<T>(x, a);                                                                     \
    }                                                                                            \
    extern "C" __global__ void __launch_bounds__(256) tessera_nvfp4_rht_amax_##SUFFIX(           \
        const T* __restrict__ x, u64 m, u64 k, float* row, float* col) {                         \
        rht_amax_impl<T>(x, m, k, row, col);                                                     \
    }                                                                                            \
    extern "C" __global__ void __launch_bounds__(256) tessera_nvfp4_row_##SUFFIX(                \
        const T* __restrict__ x, u64 m, u64 k, const float* amax, uint8_t* q, uint8_t* s,        \
        u64 s_cols, int swizzled, u64 col_tiles) {                                               \
        nvfp4_row_impl<T, NVFP4_ROW_BLOCKS>(x, m, k, amax, q, s, s_cols, swizzled, col_tiles);   \
    }                                                                                            \
    extern "C" __global__ void __launch_bounds__(256, sizeof(T) == 4 ? 2 : NVFP4_BOTH_MINB)       \
        tessera_nvfp4_both_##SUFFIX(                                                             \
        const T* __restrict__ x, const Nvfp4Args a) {                                            \
        nvfp4_both_impl<T>(x, a);                                                                \
    }
NVFP4(f32, float)
NVFP4(bf16, __nv_bfloat16)
NVFP4(f16, __half)

// The round-to-nearest both kernel launched in thread block clusters of 16 CTAs, each
// cluster a block of 8 tile rows (a band) by 2 tile columns: the banded order (bands last
// first, clusters last first within a band), but the cluster launch puts a cluster's 16
// CTAs on the SMs of one GPC together. Its 2-D grid is the host's `banded_grid_padded`:
// grid.x = 8 x the tile columns rounded up to even, grid.y = the bands (tile rows past
// the matrix return at once; a padding column's tiles are past k, their lanes invalid,
// so they store nothing). For tensors of more than 4 tile rows (bands of 8), 2-byte
// inputs, compact scales: the compact grids' 128-byte lines are written by CTAs that run
// at once. On an H100 at 16384x8192 the kernel alone took 0.1735 ms against the banded
// launch's 0.1821, and 4% longer at 4096x4096 (BENCHMARKS.md, session 44); the host
// takes it as `Nvfp4Launch` (src/cuda/nvfp4.rs) says.
struct BothClusters : BothParts {
    static __device__ __forceinline__ TileRC tile(uint32_t) {
        const uint32_t rank = blockIdx.x & 15u, cluster = (gridDim.x - 1u - blockIdx.x) >> 4;
        return {((gridDim.y - 1u - blockIdx.y) << 3) + (rank & 7u), (cluster << 1) + (rank >> 3)};
    }
};
#define NVFP4_CLUSTERS(SUFFIX, T)                                                               \
    extern "C" __global__ void __cluster_dims__(16, 1, 1) __launch_bounds__(256, NVFP4_BOTH_MINB) \
        tessera_nvfp4_both_c8x2_##SUFFIX(const T* __restrict__ x, const Nvfp4Args a) {           \
        nvfp4_both_impl<T, false, false, BothClusters>(x, a);                                    \
    }
NVFP4_CLUSTERS(bf16, __nv_bfloat16)
NVFP4_CLUSTERS(f16, __half)

// An entry point of the round-to-nearest both kernel whose tile policy takes a buffer as
// the kernel's own parameter (ScratchTiles, TwoDTiles), named tessera_nvfp4_both_<NAME><SUFFIX>.
// First the one with two-step compact scales: each tile's staged bytes into the scratch
// (2 KiB a tile), then tessera_nvfp4_scales_1d. (The harness's ScratchScales +
// to_compact took 0.1689-0.1691 ms at 16384x8192 on an H100, against 0.1821-0.1825 for
// the one-step flush and 0.1713 in clusters; BENCHMARKS.md, session 45.)
#define NVFP4_BOTH_TILES(SUFFIX, T, NAME, TILES, MINB)                                           \
    extern "C" __global__ void __launch_bounds__(256, MINB) tessera_nvfp4_both_##NAME##SUFFIX( \
        const T* __restrict__ x, const Nvfp4Args a, uint8_t* buf) {                              \
        nvfp4_both_impl<T, false, false, BothParts, TILES>(x, a, TILES{buf});                    \
    }
NVFP4_BOTH_TILES(bf16, __nv_bfloat16, s2_, ScratchTiles, NVFP4_BOTH_MINB)
NVFP4_BOTH_TILES(f16, __half, s2_, ScratchTiles, NVFP4_BOTH_MINB)

// CTAs per SM of the stochastic-rounding both kernels (80 registers; at 64 they spill).
#ifndef NVFP4_RS_MINB
#define NVFP4_RS_MINB 3
#endif
// CTAs per SM of the RHT-only both kernel: 3 (80 registers), where its fast path fits
// without spilling (at 64 it spilled 32 bytes and took 9.2% longer at 16384x8192 on an
// H100, BENCHMARKS session 47). So built, the fast path took 0.9% / 1.5% / 0.2% off the
// RHT quantizer's time at 16384x8192 / 8192x8192 / 4096x4096 on an H100 (session 49).
// Without the fast path, 4 CTAs per SM had taken 0.1713 ms against 0.1732 with 3 at
// 16384x8192 on an H200 and 0.0262 against 0.0268-0.0270 at 4096x4096
// (nvfp4-variants-h200-2026-12-04-pf.txt).
#ifndef NVFP4_RHT_MINB
#define NVFP4_RHT_MINB 3
#endif
#define NVFP4_RS(SUFFIX, T, NAME, RHT, SR, MINB)                                                \
    extern "C" __global__ void __launch_bounds__(256, MINB) tessera_nvfp4_both_##NAME##_##SUFFIX( \
        const T* __restrict__ x, const Nvfp4Args a) {                                            \
        nvfp4_both_impl<T, RHT, SR>(x, a);                                                       \
    }
#define NVFP4_RS_ALL(SUFFIX, T)                                                                 \
    NVFP4_RS(SUFFIX, T, rht, true, false, NVFP4_RHT_MINB)                                        \
    NVFP4_RS(SUFFIX, T, sr, false, true, NVFP4_RS_MINB)                                          \
    NVFP4_RS(SUFFIX, T, rht_sr, true, true, NVFP4_RS_MINB)
NVFP4_RS_ALL(bf16, __nv_bfloat16)
NVFP4_RS_ALL(f16, __half)

// 2-D blocks of 2-byte inputs, round to nearest without the RHT (both_tile_2d; either
// orientation may be null; blk the block scratch of two-step compact scales, or null).
// blk is the kernel's own parameter so that Nvfp4Args, and with it the 1-D kernels'
// PTX, stay as they are: an 8-byte longer Nvfp4Args changed ptxas's schedule of the 1-D
// both kernel (its barrier 95 instructions earlier) and cost it 2% on an H100.
// CTAs per SM of the 2-D both kernels: 3 (80 registers, no stack). Their warps mostly
// wait on one tile's load, compute and store, yet more registers a thread hide that
// better than more CTAs: on an H100, 2-D both took 4.5-4.9% less time at 16384x8192
// and 8192x8192 and 3.1% at 8192x4096 than at 4 CTAs (64 registers), the same at
// 4096x4096 (one step); 5 CTAs (48 registers) were 8-16% slower (session 50). 2-D
// rowwise alone, which took 1.1-3.3% longer at 3 CTAs from 8192x4096 down, has its own
// entry points below (BENCHMARKS.md, sessions 51 and 52).
#ifndef NVFP4_2D_MINB
#define NVFP4_2D_MINB 3
#endif
NVFP4_BOTH_TILES(bf16, __nv_bfloat16, 2d_, TwoDTiles, NVFP4_2D_MINB)
NVFP4_BOTH_TILES(f16, __half, 2d_, TwoDTiles, NVFP4_2D_MINB)
// The same kernels for 2-D rowwise alone (the columnwise operand null), at
// NVFP4_BOTH_MINB (4) CTAs per SM: with half the stores a tile, 64 registers serve
// rowwise best. On an H100 against the 3-CTA kernel: 1.6% less time at 8192x4096, 2.8%
// at 4096x4096 (1.128 -> 1.164 of its floor), within 0.1% at the larger shapes
// (session 52).
NVFP4_BOTH_TILES(bf16, __nv_bfloat16, 2d_row_, TwoDTiles, NVFP4_BOTH_MINB)
NVFP4_BOTH_TILES(f16, __half, 2d_row_, TwoDTiles, NVFP4_BOTH_MINB)

// ---- dequantize -------------------------------------------------------------------------

// The vector type of 4 elements of T.
template <class T> struct Vec4 {
    using type = uint2;
};
template <> struct Vec4<float> {
    using type = uint4;
};

// The columnwise dequantizers' tile: NVFP4_DEQ_TILE_K q rows (output columns) by
// NVFP4_DEQ_TILE_M values along m (128 bytes of each q row); NVFP4_DEQ_TILE_K_TALL q rows
// for the tall entry point without the RHT, which the launch picks when its grid fills
// the card (`DeqColsTiles` in src/cuda/grid.rs).
constexpr int NVFP4_DEQ_TILE_K = 64, NVFP4_DEQ_TILE_K_TALL = 128, NVFP4_DEQ_TILE_M = 256;

// value = e2m1 * ((e4m3 * A) * fp32(1/2688)); m % 16 == 0 and k % 16 == 0.

// Rowwise: a unit is DEQ_VALS<T> elements of a row (inside one 1x16 block): one 4- or
// 2-byte load, one scale byte, one 16-byte store; DEQ_UNITS units a thread (for_units),
// m * k / DEQ_VALS<T> units.
template <class T>
__device__ void nvfp4_dequant_rows(const uint8_t* __restrict__ q, const uint8_t* __restrict__ s,
                                   const float* __restrict__ amax, T* __restrict__ y, u64 m, u64 k,
                                   u64 s_cols, int swizzled) {
    constexpr int V = DEQ_VALS<T>;
    struct Unit {
        uint32_t w;
        uint8_t e;
    };
    const float A = amax[0];
    for_units(
        m * k / V,
        [&](u64 g) {
            const DivMod p = divmod(V * g, k);
            const uint32_t w =
                V == 8 ? reinterpret_cast<const uint32_t*>(q)[g] : reinterpret_cast<const uint16_t*>(q)[g];
            return Unit{w, s[scale_index(p.q, p.r / 16, s_cols, swizzled)]};
        },
        [&](u64 g, const Unit& l) {
            const float sc = nvfp4_decode_scale(l.e, A);
            float v[V];
            e2m1_values<V>(&l.w, sc, v);
            store_vec<V>(y + V * g, v);
        });
}

// The q rows and values of a columnwise dequantizer's CTA: tile (k0 / TK, m0 / TM), a CTA
// per tile (so the count of tiles along m, ceil(m / TM), is below 2^32).
struct DeqTile {
    u64 k0, m0;
};

// This CTA's tile (blockIdx.x in row-major order over the tiles of q).
template <int TK, int TM> __device__ __forceinline__ DeqTile nvfp4_dequant_tile(u64 m) {
    const uint32_t tm = (uint32_t)((m + TM - 1) / TM);
    return DeqTile{(u64)(blockIdx.x / tm) * TK, (u64)(blockIdx.x % tm) * TM};
}

// The CTA's TK x TM tile t of q ([k, m / 2] bytes; m % 16 == 0) in flight: the thread's
// 8-byte chunks, loaded (zeros past q's edges) before any is stored, so that all of them
// wait on one round trip to memory. (Loaded and stored one at a time, the stores waited
// on each load in turn: 8 round trips a tall tile.) A warp reads 256 contiguous bytes of
// q, TM / 2 bytes of each q row.
template <int TK, int TM> struct DeqTileChunks {
    static constexpr int ROW_WORDS = TM / 8, N = TK * ROW_WORDS / 2 / 256;
    static_assert(TK * ROW_WORDS % 512 == 0, "whole 8-byte copies for each of 256 threads");
    uint2 v[N];
    // Chunk i of this thread: tile row j, 8-byte column w2.
    static __device__ __forceinline__ int row(int i) { return (threadIdx.x + 256 * i) / (ROW_WORDS / 2); }
    static __device__ __forceinline__ int col(int i) { return (threadIdx.x + 256 * i) % (ROW_WORDS / 2); }
    __device__ __forceinline__ DeqTileChunks(const uint8_t* __restrict__ q, u64 m, u64 k, DeqTile t) {
        const u64 half_m = m / 2;
#pragma unroll
        for (int i = 0; i < N; ++i) {
            const int j = row(i), w2 = col(i);
            // m % 16 == 0: an 8-byte chunk is wholly inside a q row or wholly past it.
            const bool in = t.k0 + j < k && t.m0 / 2 + 8 * w2 < half_m;
            v[i] = in ? *reinterpret_cast<const uint2*>(q + (t.k0 + j) * half_m + t.m0 / 2 + 8 * w2)
                      : make_uint2(0u, 0u);
        }
    }
    // Stores the chunks into the shared tile, word w of tile row j at w ^ swz(j) (swz
    // even, so that 8-byte copies stay whole and aligned), for the caller's
    // __syncthreads to publish.
    template <class Swz> __device__ __forceinline__ void stage(uint32_t (*tile)[ROW_WORDS], Swz swz) const {
#pragma unroll
        for (int i = 0; i < N; ++i) *reinterpret_cast<uint2*>(&tile[row(i)][(2 * col(i)) ^ swz(row(i))]) = v[i];
    }
};

// The scales of a columnwise dequantizer's tile t (rows t.k0 .. + TK - 1 of the scale
// grid, its TM / 16 columns from t.m0 / 16) in flight, as 4-byte words (4 columns,
// contiguous and aligned in both layouts: the grid is padded to whole words, and a
// swizzled 128x4 tile keeps a row's 4 bytes together), read TM / 64 lanes to a row (4 in
// the library), so a warp's load takes 4 bytes a lane from 8 rows, where each piece
// loading its own 8 scales (8 rows, one column) took a byte a lane from 8 (short tile)
// or 16 (tall) rows, 8 loads a piece. Words of rows past k or of blocks past m are not
// read: they hold 0, decoded into slots that no piece reads (its pieces write nothing).
template <int TK, int TM> struct DeqTileScales {
    static constexpr int WORDS = TM / 64, N = TK * WORDS / 256;  // 4-byte words a tile row holds
    static_assert(TK * WORDS % 256 == 0, "whole words for each of 256 threads");
    uint32_t e4[N];
    static __device__ __forceinline__ int row(int p) { return (threadIdx.x + 256 * p) / WORDS; }
    static __device__ __forceinline__ int word(int p) { return (threadIdx.x + 256 * p) % WORDS; }
    __device__ __forceinline__ DeqTileScales(const uint8_t* __restrict__ s, DeqTile t, u64 m, u64 k, u64 s_cols,
                                             int swizzled) {
#pragma unroll
        for (int p = 0; p < N; ++p) {
            const u64 r = t.k0 + row(p), c = t.m0 / 16 + 4 * word(p);
            e4[p] = r < k && c < m / 16 ? *reinterpret_cast<const uint32_t*>(s + scale_index(r, c, s_cols, swizzled))
                                        : 0u;
        }
    }
    // Decodes each scale once into sc[b][j], block column b by tile row j, for the
    // caller's __syncthreads to publish.
    template <int S> __device__ __forceinline__ void stage(float A, float (*sc)[S]) const {
#pragma unroll
        for (int p = 0; p < N; ++p)
#pragma unroll
            for (int b = 0; b < 4; ++b) sc[4 * word(p) + b][row(p)] = nvfp4_decode_scale((uint8_t)(e4[p] >> (8 * b)), A);
    }
};

// Columnwise without the RHT: q is the [k, m] transpose (m / 2 bytes a row), its
// 16-element blocks along m. A CTA of 256 threads per tile of TK q rows by TM values
// (the library: 64 by 256), ceil(k / TK) * ceil(m / TM) CTAs: the tile is copied into
// shared memory (8-byte loads, TM / 2 contiguous bytes a q row), then each thread takes
// 8 q rows (output columns) by one word of 8 values (output rows, half a block) and
// writes 8 output rows, one 16-byte store a row (bf16, f16; two of f32): a warp's TK / 8
// lanes with the same word write 2 TK contiguous bytes of bf16 (128 in the library) of
// each of 256 / TK rows per instruction. Its registers are few (the 8 words, their 8
// scales and a row's 8 values; 32 at 8 CTAs per SM), where a thread decoding whole
// blocks of 4 q rows holds 16 rows of 4 outputs until it stores them 8 bytes a time (the
// RHT kernel below, which needs whole blocks). On an H100 (bf16) it took 9.3% off the
// time of that map at 16384x8192 and 17.9% at 4096x4096. Tiles of 128 q rows (the tall
// entry point) were 1.4-7% faster from 4096x8192 up (1024 CTAs or more, a wave of 8 a SM
// or more) and 9% slower at 4096x4096 (512 CTAs, half a wave; bench/cuda/
// dequant_variants.cu instantiates other tiles; BENCHMARKS.md). The tile's scales are
// decoded into shared memory beside it (DeqTileScales), where each piece used to load
// and decode its 8 scale bytes itself: -2.1% / -1.5% time on an H100 at 16384x8192 /
// 4096x4096.
template <class T, int TK = NVFP4_DEQ_TILE_K, int TM = NVFP4_DEQ_TILE_M>
__device__ void nvfp4_dequant_cols(const uint8_t* __restrict__ q, const uint8_t* __restrict__ s,
                                   const float* __restrict__ amax, T* __restrict__ y, u64 m, u64 k,
                                   u64 s_cols, int swizzled) {
    // Row j of the tile holds its TM / 8 words, word w at w ^ swz(j): a warp reads one word
    // of each of LK eight-row groups by 32 / LK words at once (below), and with
    // swz(j) = (32 / LK) * ((j / 8) % LK) those sit in 32 different banks (rows of 32
    // words or more start in bank 0).
    constexpr int LK = TK / 8, ROW_WORDS = TM / 8, PASSES = TK * TM / 64 / 256;
    static_assert(TK % 8 == 0 && LK <= 16 && ROW_WORDS >= 32 && PASSES >= 1,
                  "swz even and inside a row, a thread per 8 x 8 values in whole passes");
    __shared__ __align__(16) uint32_t tile[TK][ROW_WORDS];
    // The tile's decoded scales, a block column's TK values contiguous (a piece reads its
    // 8 with two 16-byte loads); rows of TK + 4 floats keep those aligned and put the
    // staging stores of 4 block columns in different banks but for pairs.
    constexpr int S = TK + 4;
    __shared__ __align__(16) float scales[TM / 16][S];
    auto swz = [](int j) { return (32 / LK) * ((j / 8) % LK); };
    const DeqTile t = nvfp4_dequant_tile<TK, TM>(m);
    // Every load of the tile and its scales is issued before the first is used (one
    // round trip; the SASS shows it). The tile used to be loaded and stored a chunk at a
    // time, the scales before it: ptxas kept that order, 11 round trips a tall tile and 5
    // a short one. H100, 73 runs: 0.883 -> 0.905 of a copy at 16384x8192 (-2.4% time),
    // 1.058 -> 1.111 at 4096x4096 (-4.8%). In this order ptxas keeps the tall tile's 8 chunks
    // in 32 registers without spilling (the other order spilled 8 bytes), and in the
    // other it issues all of the short tile's chunks first (in this one its last chunk
    // waited for the scales' stores).
    if constexpr (DeqTileChunks<TK, TM>::N > 4) {
        const DeqTileScales<TK, TM> words(s, t, m, k, s_cols, swizzled);
        const DeqTileChunks<TK, TM> chunks(q, m, k, t);
        words.stage(amax[0], scales);
        chunks.stage(tile, swz);
    } else {
        const DeqTileChunks<TK, TM> chunks(q, m, k, t);
        const DeqTileScales<TK, TM> words(s, t, m, k, s_cols, swizzled);
        words.stage(amax[0], scales);
        chunks.stage(tile, swz);
    }
    __syncthreads();
    // Piece i's 8 x 8 values.
    auto piece = [&](uint32_t i) {
        const int kg = (int)(i % LK), mq = (int)(i / LK);  // q rows 8 kg .. + 7, word mq
        const u64 c0 = t.k0 + 8 * kg, r0 = t.m0 + 8 * mq;
        // k % 16 == 0 and m % 16 == 0: the 8 columns and the 8 rows are wholly in or out.
        if (c0 >= k || r0 >= m) return;
        uint32_t w[8];
        float sc[8];
        // Scale rows c0 .. c0 + 7, block column mq / 2 of the tile.
        const float4* sp = reinterpret_cast<const float4*>(&scales[mq / 2][8 * kg]);
        const float4 s0 = sp[0], s1 = sp[1];
        sc[0] = s0.x, sc[1] = s0.y, sc[2] = s0.z, sc[3] = s0.w;
        sc[4] = s1.x, sc[5] = s1.y, sc[6] = s1.z, sc[7] = s1.w;
#pragma unroll
        for (int j = 0; j < 8; ++j) w[j] = tile[8 * kg + j][mq ^ swz(8 * kg + j)];
        T* out = y + r0 * k + c0;
#pragma unroll
        for (int b = 0; b < 8; ++b) {
            float v[8];
#pragma unroll
            for (int j = 0; j < 8; ++j) v[j] = __fmul_rn(e2m1_value(w[j] >> (4 * b)), sc[j]);
            store_vec<8>(out + b * k, v);
        }
    };
#pragma unroll 1
    for (uint32_t pass = 0; pass < PASSES; ++pass) piece(threadIdx.x + 256 * pass);
}

// Columnwise with the RHT: each block inverse-transformed. The plain kernel's tiles and
// their load (DeqTileChunks); each thread decodes one block from each of 4 q
// rows (4 output columns) and writes the block's 16 output rows, one 4-column store a
// row (8 bytes of bf16 or f16, 16 of f32). Sixteen lanes take the 64 columns of a block,
// so a warp stores 128 (256) contiguous bytes of each of 2 rows per instruction. Its own
// entry point, so that the inverse RHT's registers do not cap the plain kernel's
// occupancy.
template <class T>
__device__ void nvfp4_dequant_cols_rht(const uint8_t* __restrict__ q, const uint8_t* __restrict__ s,
                                       const float* __restrict__ amax, T* __restrict__ y, u64 m, u64 k,
                                       u64 s_cols, int swizzled) {
    // Row j of the tile holds its 128 bytes as 32 words, word w at w ^ swz(j): with
    // swz(j) = 2 * ((j / 4) % 16) the 8-byte reads of a warp (16 four-row groups by 2
    // blocks) take two wavefronts, the least 256 bytes need.
    __shared__ __align__(16) uint32_t tile[NVFP4_DEQ_TILE_K][NVFP4_DEQ_TILE_M / 8];
    auto swz = [](int j) { return 2 * ((j / 4) % 16); };
    const DeqTile t = nvfp4_dequant_tile<NVFP4_DEQ_TILE_K, NVFP4_DEQ_TILE_M>(m);
    DeqTileChunks<NVFP4_DEQ_TILE_K, NVFP4_DEQ_TILE_M>(q, m, k, t).stage(tile, swz);
    __syncthreads();
    const int tid = threadIdx.x;
    const int kg = tid % 16, mb = tid / 16;  // q rows 4 kg .. + 3, the 16-block mb of the tile
    const u64 c0 = t.k0 + 4 * kg, r0 = t.m0 + 16 * mb;
    if (c0 >= k || r0 >= m) return;  // k % 16 == 0: the 4 columns are wholly in or out
    const float A = amax[0];
    // 4 outputs of a row: 8 bytes of bf16/f16 (a union with a 16-byte member would
    // double the 16 rows' registers), 16 of f32.
    union {
        T e[4];
        typename Vec4<T>::type v;
    } out_v[16];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const uint2 w = *reinterpret_cast<const uint2*>(&tile[4 * kg + j][(2 * mb) ^ swz(4 * kg + j)]);
        float v[16], o[16];
        e2m1x16_values(w, nvfp4_decode_scale(s[scale_index(c0 + j, r0 / 16, s_cols, swizzled)], A), v);
        inverse_rht16(v, o);
#pragma unroll
        for (int i = 0; i < 16; ++i) out_v[i].e[j] = In<T>::from(o[i]);
    }
    T* out = y + r0 * k + c0;
#pragma unroll
    for (int i = 0; i < 16; ++i) {
        if constexpr (sizeof(T) == 4) {
            store_global16(out + i * k, out_v[i].v);
        } else {
            store_global8(out + i * k, out_v[i].v);
        }
    }
}

// CTAs per SM the columnwise dequantizer without the RHT is built for: 8 (the most 256
// threads allow) gives it 32 registers without spills for every output type. On an H100
// (bf16, tiles of 64 q rows) 8 and 6 ran alike (0.832 and 0.830 of a copy at 16384x8192),
// 4 (63 registers) at 0.727. The kernel before it, which decoded whole blocks as the RHT
// kernel does, was built for 5 (48 registers; on an H200 0.641 / 0.713 of a copy at
// 16384x8192 / 4096x4096).
#ifndef NVFP4_DEQ_T_MINB
#define NVFP4_DEQ_T_MINB 8
#endif
#define NVFP4_DEQUANT(SUFFIX, T)                                                                 \
    extern "C" __global__ void __launch_bounds__(256) tessera_nvfp4_dequant_##SUFFIX(             \
        const uint8_t* q, const uint8_t* s, const float* amax, T* y, u64 m, u64 k, u64 s_cols,    \
        int swizzled) {                                                                           \
        pdl_first();                                                                              \
        nvfp4_dequant_rows<T>(q, s, amax, y, m, k, s_cols, swizzled);                             \
    }                                                                                             \
    extern "C" __global__ void __launch_bounds__(256, NVFP4_DEQ_T_MINB)                           \
        tessera_nvfp4_dequant_t_##SUFFIX(                                                         \
        const uint8_t* q, const uint8_t* s, const float* amax, T* y, u64 m, u64 k, u64 s_cols,    \
        int swizzled) {                                                                           \
        pdl_first();                                                                              \
        nvfp4_dequant_cols<T>(q, s, amax, y, m, k, s_cols, swizzled);                             \
    }                                                                                             \
    extern "C" __global__ void __launch_bounds__(256, NVFP4_DEQ_T_MINB)                           \
        tessera_nvfp4_dequant_t_tall_##SUFFIX(                                                    \
        const uint8_t* q, const uint8_t* s, const float* amax, T* y, u64 m, u64 k, u64 s_cols,    \
        int swizzled) {                                                                           \
        pdl_first();                                                                              \
        nvfp4_dequant_cols<T, NVFP4_DEQ_TILE_K_TALL>(q, s, amax, y, m, k, s_cols, swizzled);      \
    }                                                                                             \
    extern "C" __global__ void __launch_bounds__(256) tessera_nvfp4_dequant_t_rht_##SUFFIX(       \
        const uint8_t* q, const uint8_t* s, const float* amax, T* y, u64 m, u64 k, u64 s_cols,    \
        int swizzled) {                                                                           \
        pdl_first();                                                                              \
        nvfp4_dequant_cols_rht<T>(q, s, amax, y, m, k, s_cols, swizzled);                         \
    }
NVFP4_DEQUANT(f32, float)
NVFP4_DEQUANT(bf16, __nv_bfloat16)
NVFP4_DEQUANT(f16, __half)
