// What the parts of the NVFP4 both kernel cost (not shipped): the kernel with one of
// both_tile's Parts replaced. The fast path's E2M1 encoder, per orientation, by one that
// does one operation per value, or none: how the time moves with the instruction count
// (if removing a fifth of the instructions buys little time, they do not bound it). The
// flush of compact scale bytes by none, by one grid's, by a thread per scale row, with
// cache hints or prefetched lines, or in the wrong places but contiguously. Outputs that
// differ from the shipped kernel's differ on purpose. bf16 inputs that take the fast
// path everywhere, compact and swizzled scales. NC_ORDER=1 runs the shipped kernel
// between the flush variants instead (whether one leaves the next kernel faster);
// NC_ENC=1 times only the encoder variants (the fused lines and per-tensor tables among
// them) and the former shifted-add packing, three rounds; NC_CROSS=1 the encoders with
// each compact flush; NC_CLUSTER=1 compact scale bytes gathered over thread block
// clusters of tiles; NC_TWO_STEP=1 compact scales written through a per-tile scratch
// and a second kernel, whose bytes must hash as the shipped kernel's; NC_PLACE=1 the
// shipped flush launched in clusters of 16 and 8 tiles; NC_LEAN=1 leaner prologues (one
// encode-scale table filled by warps 0-3, loads behind a branch), same bytes; NC_GROUP=1
// compact scales written by the last CTA of each group of 16 tiles sharing their lines,
// from a per-tile scratch, same bytes.
// Build on the GPU machine:
//   nvcc -O3 -arch=sm_90 -std=c++17 -Xptxas -v -I crates/quant/kernels \
//        bench/cuda/nvfp4_cost.cu -o nc && ./nc
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "fp8.cu"
#include "sm90.cuh"
#include "harness.cuh"
#include "nvfp4.cu"
#include "nvfp4_buffers.cuh"

// One integer operation per value (its float bits, shifted into its nibble), the scale
// folded in once: the conversion from bf16 stays, the multiply and rounding go.
__device__ __forceinline__ uint32_t one_op(const float* v, float g) {
    uint32_t w = __float_as_uint(g);
#pragma unroll
    for (int j = 0; j < 8; ++j) w ^= __float_as_uint(v[j]) >> (4 * j);
    return w & 0x77777777u;
}
// No operation per value: the conversions become dead code too.
__device__ __forceinline__ uint32_t no_op(const float*, float g) { return __float_as_uint(g) & 0x77777777u; }

struct ColsOneOp : BothParts {
    static __device__ __forceinline__ uint32_t col_magnitudes(const float* v, float g) { return one_op(v, g); }
};
struct RowsOneOp : BothParts {
    static __device__ __forceinline__ uint32_t row_magnitudes(const float* v, float g) { return one_op(v, g); }
};
struct BothOneOp : ColsOneOp {
    static __device__ __forceinline__ uint32_t row_magnitudes(const float* v, float g) { return one_op(v, g); }
};
struct NoOp : BothParts {
    static __device__ __forceinline__ uint32_t col_magnitudes(const float* v, float g) { return no_op(v, g); }
    static __device__ __forceinline__ uint32_t row_magnitudes(const float* v, float g) { return no_op(v, g); }
};

// The encoder's magnitudes packed as before 2026-12-06 (session 37): each code shifted
// into its nibble by a shifted add, the bias taken off once (8 operations for 8 values,
// where the shipped byte permutes take 7). Same bytes as shipped.
__device__ __forceinline__ uint32_t magnitudes_shifted(const float* v, float g) {
    uint32_t w = 0;
#pragma unroll
    for (int j = 0; j < 8; ++j) w += e2m1_magnitude_biased(v[j], g) << (4 * j);
    return w - 0x4B000000u * 0x11111111u;
}
struct ShiftPack : BothParts {
    static __device__ __forceinline__ uint32_t col_magnitudes(const float* v, float g) { return magnitudes_shifted(v, g); }
    static __device__ __forceinline__ uint32_t row_magnitudes(const float* v, float g) { return magnitudes_shifted(v, g); }
};

// The encoder's lines fused with the product: min(rne(2|v|g), rne(|v|g + 2), rne(|v|g/2
// + 4)) from three fused multiply-adds of |v| by 2g, g and g/2, without the rounded
// product fl(v g) between (96 fewer instructions a lane: 128 multiplies less, 32 for 2g
// and g/2 more). Not exact: it differs from the shipped encoder where fl(v g) is one of
// the thresholds (0.25, 0.75, .., 5) and v g is not, and that is common (at the
// harness's global amax 68 of the 126 table entries have such a bf16 value;
// bench/cuda/e2m1_fused_check.cpp), so its hashes differ. Timed to see what 96
// instructions buy; it spills 12 more bytes than the shipped kernel, in the fast path.
__device__ __forceinline__ uint32_t magnitudes_fused(const float* v, float g) {
    const float k = 8388608.0f;  // 2^23
    const float g2 = 2.0f * g, gh = 0.5f * g;
    uint32_t c[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        const float a = fabsf(v[j]);
        const uint32_t f0 = __float_as_uint(__fmaf_rn(a, g2, k));
        const uint32_t f1 = __float_as_uint(__fmaf_rn(a, g, k + 2.0f));
        const uint32_t f2 = __float_as_uint(__fmaf_rn(a, gh, k + 4.0f));
        c[j] = min(min(f0, f1), f2);
    }
    return pack_code_bytes8(c);
}
struct Fused : BothParts {
    static __device__ __forceinline__ uint32_t col_magnitudes(const float* v, float g) { return magnitudes_fused(v, g); }
    static __device__ __forceinline__ uint32_t row_magnitudes(const float* v, float g) { return magnitudes_fused(v, g); }
};

// The encode-scale tables computed once per tensor (by fill_tables, before the timing)
// and copied into shared memory: what the CTA's own fill costs (about 70 instructions a
// thread, the global encode scale's division among them), against a load from L2.
__device__ float2 g_tab[2][128];
__device__ float g_se[2];
__global__ void fill_tables(const Nvfp4Args a) {
    __shared__ BothShared sh;
    both_tables(sh, a);
    __syncthreads();
    g_tab[threadIdx.x >> 7][threadIdx.x & 127] = sh.tab[threadIdx.x >> 7][threadIdx.x & 127];
    if (threadIdx.x < 2) g_se[threadIdx.x] = sh.se[threadIdx.x];
}
struct GlobalTables : BothParts {
    static __device__ __forceinline__ void tables(BothShared& sh, const Nvfp4Args&) {
        sh.tab[threadIdx.x >> 7][threadIdx.x & 127] = g_tab[threadIdx.x >> 7][threadIdx.x & 127];
        if (threadIdx.x < 2) sh.se[threadIdx.x] = g_se[threadIdx.x];
    }
};
struct FusedGlobalTables : Fused {
    static __device__ __forceinline__ void tables(BothShared& sh, const Nvfp4Args& a) { GlobalTables::tables(sh, a); }
};

// Scale flushes (compact scales only; swizzled ones keep the shipped flush).
// No scale bytes at all.
struct NoScales : BothParts {
    static __device__ __forceinline__ void flush(const BothScales& s, const Nvfp4Args& a, u64 R0, u64 C0) {
        if (a.swizzled) flush_both_scales(s, a, R0, C0);
    }
};
// Only one grid's bytes: the rowwise (Rows) or the columnwise one.
template <bool Rows> struct OneGrid : BothParts {
    static __device__ __forceinline__ void flush(const BothScales& s, const Nvfp4Args& a, u64 R0, u64 C0) {
        Nvfp4Args b = a;
        if (!a.swizzled) (Rows ? b.q_col : b.q_row) = nullptr;
        flush_both_scales(s, b, R0, C0);
    }
};
// A thread per scale row, its 8 bytes in one store (threads 0-127 the rowwise grid's
// rows, 128-255 the columnwise one's): a warp instruction covers 32 rows. The shapes
// here keep both grids' pitches multiples of 8.
template <bool Streaming> struct Rows8 : BothParts {
    static __device__ __forceinline__ void flush(const BothScales& s, const Nvfp4Args& a, u64 R0, u64 C0) {
        if (a.swizzled) return flush_both_scales(s, a, R0, C0);
        const int t = threadIdx.x, r = t & 127;
        const bool rows = t < 128;
        const u64 i = (rows ? R0 : C0) + r, j = (rows ? C0 : R0) / 16;
        if (i >= (rows ? a.m : a.k) || j >= (rows ? a.k : a.m) / 16) return;
        uint2* dst = reinterpret_cast<uint2*>((rows ? a.s_row : a.s_col) + i * (rows ? a.s_row_cols : a.s_col_cols) + j);
        const uint32_t* w = reinterpret_cast<const uint32_t*>(rows ? &s.row[r][0] : &s.col[r][0]);
        const uint2 v = make_uint2(w[0], w[1]);  // the staged rows are 4-byte aligned only
        if (Streaming) __stcs(dst, v);
        else *dst = v;
    }
};

// The compact flush with an L2 eviction priority on its stores (createpolicy):
// Last = evict_last, else evict_first.
template <bool Last> struct HintedScales : BothParts {
    static __device__ __forceinline__ void st(uint8_t* p, uint32_t v) {
        uint64_t pol;
        if (Last) asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(pol));
        else asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));
        asm volatile("st.global.L2::cache_hint.b32 [%0], %1, %2;" ::"l"(p), "r"(v), "l"(pol) : "memory");
    }
    static __device__ __forceinline__ void flush(const BothScales& s, const Nvfp4Args& a, u64 R0, u64 C0) {
        if (a.swizzled) return flush_both_scales(s, a, R0, C0);
        const int t = threadIdx.x;
        const u64 r = R0 + t / 2, jb = C0 / 16 + 4 * (t % 2);
        if (r < a.m && jb < a.k / 16) st(a.s_row + r * a.s_row_cols + jb, *reinterpret_cast<const uint32_t*>(&s.row[t / 2][4 * (t % 2)]));
        const u64 c = C0 + t / 2, ib = R0 / 16 + 4 * (t % 2);
        if (c < a.k && ib < a.m / 16) st(a.s_col + c * a.s_col_cols + ib, *reinterpret_cast<const uint32_t*>(&s.col[t / 2][4 * (t % 2)]));
    }
};
// The same bytes in the wrong places: each CTA's 1 KiB of each grid as one contiguous
// run of 16-byte stores (threads 0-63 rowwise, 64-127 columnwise), what the cheapest
// layout would cost.
struct ContiguousScales : BothParts {
    static __device__ __forceinline__ void flush(const BothScales& s, const Nvfp4Args& a, u64, u64) {
        if (a.swizzled) return;
        const int t = threadIdx.x;
        if (t >= 128) return;
        const u64 cta = (u64)blockIdx.y * gridDim.x + blockIdx.x;
        const uint32_t* src = reinterpret_cast<const uint32_t*>(t < 64 ? &s.row[0][0] : &s.col[0][0]) + 4 * (t & 63);
        uint4* dst = reinterpret_cast<uint4*>((t < 64 ? a.s_row : a.s_col) + cta * 1024) + (t & 63);
        *dst = make_uint4(src[0], src[1], src[2], src[3]);
    }
};

// Compact scales in two steps: the both kernel writes each tile's staged scale bytes
// (1 KiB a grid) contiguously into a scratch grid indexed by tile, with 16-byte stores,
// and to_compact then writes the compact rows, 8 bytes a thread (a warp: 256
// contiguous bytes of a row). The scratch grids are set with cudaMemcpyToSymbol.
__device__ uint8_t* g_scratch_row;
__device__ uint8_t* g_scratch_col;
struct ScratchScales : BothParts {
    static __device__ __forceinline__ void flush(const BothScales& s, const Nvfp4Args& a, u64 R0, u64 C0) {
        const int t = threadIdx.x;
        if (t >= 128) return;
        const u64 tile = (R0 / 128) * ((a.k + 127) / 128) + C0 / 128;
        const uint32_t* src = reinterpret_cast<const uint32_t*>(t < 64 ? &s.row[0][0] : &s.col[0][0]) + 4 * (t & 63);
        uint4* dst = reinterpret_cast<uint4*>((t < 64 ? g_scratch_row : g_scratch_col) + tile * 1024) + (t & 63);
        *dst = make_uint4(src[0], src[1], src[2], src[3]);
    }
};
// The scratch grids of n values (n / 16 bytes each), allocated and set into
// g_scratch_row and g_scratch_col for the object's life.
struct ScratchGrids {
    uint8_t *row, *col;
    explicit ScratchGrids(u64 n) {
        CK(cudaMalloc(&row, n / 16));
        CK(cudaMalloc(&col, n / 16));
        CK(cudaMemcpyToSymbol(g_scratch_row, &row, sizeof row));
        CK(cudaMemcpyToSymbol(g_scratch_col, &col, sizeof col));
    }
    ScratchGrids(const ScratchGrids&) = delete;
    ScratchGrids& operator=(const ScratchGrids&) = delete;
    ~ScratchGrids() {
        cudaFree(row);
        cudaFree(col);
    }
};

// Scratch grids to compact ones (harness shapes: multiples of 128, pitches multiples of 8).
__global__ void __launch_bounds__(256) to_compact(const Nvfp4Args a) {
    const uint32_t gy = (uint32_t)((a.k + 127) / 128), gx = (uint32_t)((a.m + 127) / 128);
    const u64 rp = a.m * gy, cp = a.k * gx;
    u64 t = (u64)blockIdx.x * 256 + threadIdx.x;
    const uint8_t* src;
    uint8_t* dst;
    if (t < rp) {
        const uint32_t r = (uint32_t)(t / gy), c = (uint32_t)(t % gy);
        src = g_scratch_row + ((u64)(r / 128) * gy + c) * 1024 + (r % 128) * 8;
        dst = a.s_row + r * a.s_row_cols + c * 8;
    } else {
        t -= rp;
        if (t >= cp) return;
        const uint32_t c = (uint32_t)(t / gx), i = (uint32_t)(t % gx);
        src = g_scratch_col + ((u64)i * gy + c / 128) * 1024 + (c % 128) * 8;
        dst = a.s_col + c * a.s_col_cols + i * 8;
    }
    *reinterpret_cast<uint2*>(dst) = *reinterpret_cast<const uint2*>(src);
}

// Compact scales by groups (NC_GROUP): each CTA writes its staged bytes into the
// scratch grids as ScratchScales does, then counts itself into its rowwise group (the 16
// tiles of its tile row whose compact rows share 128-byte pieces: tile columns 16 g ..
// 16 g + 15) and its columnwise group (tile rows 16 g .. of its tile column); the CTA
// that completes a group writes the group's 128 grid rows of up to 128 bytes, whole
// lines, from the scratch (still in L2), and with Discard drops the scratch lines from L2
// unwritten (discard.global.L2). The counters (g_counters: rowwise groups, then
// columnwise) start at zero and the completing CTA puts its group's back. Release: the
// writers fence before the count; acquire: the completing CTA fences after it.
__device__ uint32_t* g_counters;
// Fence = false and Write = false are for measuring what the fences and the group's
// writes cost (without the fences the bytes are not guaranteed; without the writes the
// grids are wrong on purpose).
template <bool Discard, bool Fence = true, bool Write = true> struct GroupScales : BothParts {
    static __device__ __forceinline__ void flush(const BothScales& s, const Nvfp4Args& a, u64 R0, u64 C0) {
        __shared__ uint32_t last[2];
        const int t = threadIdx.x;
        ScratchScales::flush(s, a, R0, C0);
        if (Fence && t < 128) __threadfence();
        __syncthreads();
        const uint32_t gy = (uint32_t)((a.k + 127) / 128), gx = (uint32_t)((a.m + 127) / 128);
        const uint32_t tr = (uint32_t)(R0 / 128), tc = (uint32_t)(C0 / 128);
        if (t < 2) {
            const uint32_t idx = t == 0 ? tr * ((gy + 15) / 16) + tc / 16 : gx * ((gy + 15) / 16) + tc * ((gx + 15) / 16) + tr / 16;
            const uint32_t size = t == 0 ? min(16u, gy - tc / 16 * 16) : min(16u, gx - tr / 16 * 16);
            const bool done = atomicAdd(&g_counters[idx], 1u) == size - 1;
            if (done) g_counters[idx] = 0;
            last[t] = done;
        }
        __syncthreads();
        const bool rows = last[0] != 0, cols = last[1] != 0;
        if (!rows && !cols) return;
        if (!Write) return;
        if (Fence) __threadfence();
        // 128 grid rows x 16 tiles of 8 bytes: piece p = t + 256 i, row p / 16, tile p % 16.
        if (rows) {
            const uint32_t g0 = tc / 16 * 16, n = min(16u, gy - g0);
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                const uint32_t p = t + 256 * i, r = p / 16, j = p % 16;
                if (j < n) {
                    const uint2 v = __ldcg(reinterpret_cast<const uint2*>(g_scratch_row + ((u64)tr * gy + g0 + j) * 1024 + r * 8));
                    *reinterpret_cast<uint2*>(a.s_row + (R0 + r) * a.s_row_cols + (g0 + j) * 8) = v;
                }
            }
        }
        if (cols) {
            const uint32_t g0 = tr / 16 * 16, n = min(16u, gx - g0);
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                const uint32_t p = t + 256 * i, c = p / 16, j = p % 16;
                if (j < n) {
                    const uint2 v = __ldcg(reinterpret_cast<const uint2*>(g_scratch_col + ((u64)(g0 + j) * gy + tc) * 1024 + c * 8));
                    *reinterpret_cast<uint2*>(a.s_col + (C0 + c) * a.s_col_cols + (g0 + j) * 8) = v;
                }
            }
        }
        if (!Discard) return;
        __syncthreads();
        // 16 tiles x 8 lines a grid: thread t < 128 the line t % 8 of tile t / 8.
        if (t < 128) {
            const uint32_t j = t / 8, l = t % 8;
            if (rows && j < min(16u, gy - tc / 16 * 16)) {
                const uint8_t* p = g_scratch_row + ((u64)tr * gy + tc / 16 * 16 + j) * 1024 + l * 128;
                asm volatile("discard.global.L2 [%0], 128;" ::"l"(p) : "memory");
            }
            if (cols && j < min(16u, gx - tr / 16 * 16)) {
                const uint8_t* p = g_scratch_col + ((u64)(tr / 16 * 16 + j) * gy + tc) * 1024 + l * 128;
                asm volatile("discard.global.L2 [%0], 128;" ::"l"(p) : "memory");
            }
        }
    }
};

// The shipped flush, with the L2 lines its compact scale bytes go to prefetched when
// the CTA starts (thread t < 128: the line of rowwise scale row R0 + t, else of
// columnwise row C0 + t - 128).
// Prefetch = 0: plain; 1: with evict_last priority; 2: evict_last, and the lines set back
// to evict_normal after the flush.
__device__ __forceinline__ const uint8_t* scale_line(const Nvfp4Args& a, u64 R0, u64 C0) {
    const int t = threadIdx.x, r = t & 127;
    const bool rows = t < 128;
    const u64 i = (rows ? R0 : C0) + r, j = (rows ? C0 : R0) / 16;
    if (i >= (rows ? a.m : a.k) || j >= (rows ? a.k : a.m) / 16) return nullptr;
    return (rows ? a.s_row : a.s_col) + i * (rows ? a.s_row_cols : a.s_col_cols) + j;
}
template <int Prefetch> struct PrefetchScales : BothParts {
    static __device__ __forceinline__ void start(const Nvfp4Args& a, u64 R0, u64 C0) {
        const uint8_t* p = a.swizzled ? nullptr : scale_line(a, R0, C0);
        if (p == nullptr) return;
        if (Prefetch == 0) asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
        else asm volatile("prefetch.global.L2::evict_last [%0];" ::"l"(p));
    }
    static __device__ __forceinline__ void flush(const BothScales& s, const Nvfp4Args& a, u64 R0, u64 C0) {
        flush_both_scales(s, a, R0, C0);
        if (Prefetch != 2 || a.swizzled) return;
        const uint8_t* p = scale_line(a, R0, C0);
        if (p == nullptr) return;
        p = reinterpret_cast<const uint8_t*>(reinterpret_cast<uintptr_t>(p) & ~(uintptr_t)127);
        asm volatile("applypriority.global.L2::evict_normal [%0], 128;" ::"l"(p) : "memory");
    }
};

// An encoder variant with a flush variant (NC_CROSS): whether the compact flush binds
// once the instructions are fewer.
template <class Enc, class Flush> struct Cross : Enc {
    static __device__ __forceinline__ void start(const Nvfp4Args& a, u64 R0, u64 C0) { Flush::start(a, R0, C0); }
    static __device__ __forceinline__ void flush(const BothScales& s, const Nvfp4Args& a, u64 R0, u64 C0) {
        Flush::flush(s, a, R0, C0);
    }
};

// A leaner prologue (NC_LEAN): fewer instructions before the encoders, same bytes.
// One table: without the RHT both orientations share one global amax (amax_row ==
// amax_col), so their encode-scale tables are equal; threads 0-127 fill both and warps
// 4-7 skip the fill (about 60 instructions a warp: the division, two reciprocals).
__device__ __forceinline__ void one_table(BothShared& sh, const Nvfp4Args& a) {
    const bool one = a.amax_row == a.amax_col;
    const int o = threadIdx.x >> 7, e = threadIdx.x & 127;
    if (one && o != 0) return;
    const uint8_t* q = o ? a.q_col : a.q_row;
    const float se = one || q != nullptr ? global_encode_scale((o ? a.amax_col : a.amax_row)[0]) : 1.0f;
    const float2 t = block_table_entry(e, __frcp_rn(se));
    sh.tab[o][e] = t;
    if (one) sh.tab[1][e] = t;
    if (e == 0) {
        sh.se[o] = se;
        if (one) sh.se[1] = se;
    }
}
struct OneTable : BothParts {
    static __device__ __forceinline__ void tables(BothShared& sh, const Nvfp4Args& a) { one_table(sh, a); }
};
// Loads behind one branch, each row's address one add from the last (the shipped form
// computes 8 addresses by wide multiplies and zeroes the tile before predicated loads).
template <class T>
__device__ __forceinline__ void lean_load(BothTile<T>& d, const T* __restrict__ x, u64 r0, u64 col, bool valid,
                                          const Nvfp4Args& a) {
    if (valid) {
        const char* p = reinterpret_cast<const char*>(x + r0 * a.k + col);
        const u64 stride = a.k * sizeof(T);
#pragma unroll
        for (int i = 0; i < 8; ++i)
#pragma unroll
            for (int w = 0; w < BothTile<T>::W; ++w)
                d.u[i][w] = __ldg(reinterpret_cast<const uint4*>(p + i * stride) + w);
    } else {
#pragma unroll
        for (int i = 0; i < 8; ++i)
#pragma unroll
            for (int w = 0; w < BothTile<T>::W; ++w) d.u[i][w] = make_uint4(0u, 0u, 0u, 0u);
    }
}
struct LeanLoads : BothParts {
    template <class T>
    static __device__ __forceinline__ void load(BothTile<T>& d, const T* __restrict__ x, u64 r0, u64 col, bool valid,
                                                const Nvfp4Args& a) {
        lean_load(d, x, r0, col, valid, a);
    }
};
struct Lean : LeanLoads {
    static __device__ __forceinline__ void tables(BothShared& sh, const Nvfp4Args& a) { one_table(sh, a); }
};

template <class Parts>
__global__ void __launch_bounds__(256, NVFP4_BOTH_MINB) cost_var(const __nv_bfloat16* __restrict__ x, const Nvfp4Args a) {
    nvfp4_both_impl<__nv_bfloat16, false, false, Parts>(x, a);
}

// Tiles by cluster (NC_CLUSTER: a 1-D grid of one CTA a tile in 1-D clusters of CR CC
// CTAs, launched with a cluster attribute; harness shapes: multiples of 8 tiles each
// way). Rank r takes tile row offset r % CR and column offset r / CR of its cluster's
// CR x CC block of tiles; the clusters run in the banded order's manner (bands of 8
// tile rows, rows fastest, last first). The shipped flush: what the cluster launch
// alone costs.
template <int CR, int CC> struct ClusterOrder : BothParts {
    static constexpr uint32_t N = CR * CC;
    static __device__ __forceinline__ TileRC tile(uint32_t gx) {
        const uint32_t r = cluster_rank(), clusters = gridDim.x / N;
        const uint32_t bh = 8 / CR, cgx = gx / CR, cgy = clusters / cgx;  // cluster rows a band
        const uint32_t n = clusters - 1u - blockIdx.x / N, band = n / (cgy * bh), x = n % (cgy * bh);
        return {(band * bh + x % bh) * CR + r % CR, (x / bh) * CC + r / CR};
    }
};

// Both grids' compact bytes gathered over the cluster's block: after a cluster barrier
// CTA r writes words 256 r .. 256 r + 255 of the block's rowwise bytes (128 CR rows of
// 2 CC words: 8 CC consecutive bytes a row) and of its columnwise ones (128 CC columns
// of 2 CR words: 8 CR bytes), each word read from the CTA that staged it; a second
// barrier keeps every CTA's shared memory alive until the others have read it. With
// CC = 1 only the columnwise bytes are gathered (each CTA writes its own rowwise words,
// as the shipped flush does). Same bytes as the shipped flush.
template <int CR, int CC> struct Cluster2D : ClusterOrder<CR, CC> {
    static __device__ __forceinline__ void flush(const BothScales& s, const Nvfp4Args& a, u64 R0, u64 C0) {
        if (a.swizzled) return flush_both_scales(s, a, R0, C0);
        cluster_arrive();
        cluster_wait();
        const uint32_t me = cluster_rank(), n = 256 * me + threadIdx.x;
        const u64 Rb = R0 - (me % CR) * 128, Cb = C0 - (me / CR) * 128;
        {
            const uint32_t rr = n / (2 * CC), ww = n % (2 * CC);
            const uint32_t v = ld_cluster_u32(&s.row[rr % 128][4 * (ww % 2)], rr / 128 + CR * (ww / 2));
            const u64 r = Rb + rr, jb = Cb / 16 + 4 * (u64)ww;
            if (a.q_row != nullptr && r < a.m && jb < a.k / 16)
                *reinterpret_cast<uint32_t*>(a.s_row + r * a.s_row_cols + jb) = v;
        }
        {
            const uint32_t cc = n / (2 * CR), ww = n % (2 * CR);
            const uint32_t v = ld_cluster_u32(&s.col[cc % 128][4 * (ww % 2)], ww / 2 + CR * (cc / 128));
            const u64 c = Cb + cc, ib = Rb / 16 + 4 * (u64)ww;
            if (a.q_col != nullptr && c < a.k && ib < a.m / 16)
                *reinterpret_cast<uint32_t*>(a.s_col + c * a.s_col_cols + ib) = v;
        }
        cluster_arrive();
        cluster_wait();
    }
};

static void run_shape(u64 M, u64 K) {
    const Nvfp4Buffers b(M, K, true);
    const u64 n = b.n;
    const double bytes = 2.0 * n + 2 * (n / 2.0 + n / 16.0);
    const dim3 grid = b.both_grid();
    for (int swz = 0; swz < 2; ++swz) {
        Nvfp4Args a = b.args(b.amax, true);
        a.swizzled = swz;
        fill_tables<<<1, 256>>>(a);
        CK(cudaGetLastError());
        // Times `launch` on cleared outputs and reports it with the outputs' hashes.
        auto timed = [&](const char* label, auto launch) {
            b.clear();
            const float t = time_ms(launch);
            char name[96];
            std::snprintf(name, sizeof name, "%s%s", label, swz ? ", swizzled" : "");
            report_hashes(name, t, bytes, b.copy_gbs, b.outputs());
        };
        auto run = [&](auto kernel, const char* label) {
            timed(label, [&] { kernel<<<grid, 256>>>(b.x, a); });
        };
        // A kernel of 1-D clusters of `size` CTAs over the tiles, one CTA a tile
        // (ClusterOrder's order).
        auto run_clusters = [&](auto kernel, unsigned size, const char* label) {
            if (size > 8) CK(cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
            cudaLaunchAttribute at[1];
            at[0].id = cudaLaunchAttributeClusterDimension;
            at[0].val.clusterDim.x = size;
            at[0].val.clusterDim.y = 1;
            at[0].val.clusterDim.z = 1;
            cudaLaunchConfig_t cfg = {};
            cfg.gridDim = dim3((unsigned)((M / 128) * (K / 128)));
            cfg.blockDim = dim3(256);
            cfg.attrs = at;
            cfg.numAttrs = 1;
            timed(label, [&] { CK(cudaLaunchKernelEx(&cfg, kernel, (const __nv_bfloat16*)b.x, a)); });
        };
        // The two-step compact scales, timed as one (both launches), hashed against
        // the shipped kernel's.
        auto run_two_step = [&] {
            const ScratchGrids scratch(n);
            b.clear();
            const unsigned g2 = (unsigned)((2 * (n / 128) + 255) / 256);
            const float t = time_ms([&] {
                cost_var<ScratchScales><<<grid, 256>>>(b.x, a);
                to_compact<<<g2, 256>>>(a);
            });
            report_hashes("scratch + to_compact (two launches)", t, bytes, b.copy_gbs,
                          b.outputs());
            const float t2 = time_ms([&] { to_compact<<<g2, 256>>>(a); });
            report_hashes("to_compact alone", t2, 4.0 * (n / 16), b.copy_gbs, {{b.sr, n / 16}, {b.sc, n / 16}});
        };
        // The group flush (GroupScales), hashed against the shipped kernel's.
        auto run_group = [&] {
            const ScratchGrids scratch(n);
            uint32_t* cnt;
            const u64 gx = (M + 127) / 128, gy = (K + 127) / 128;
            const u64 groups = gx * ((gy + 15) / 16) + gy * ((gx + 15) / 16);
            CK(cudaMalloc(&cnt, groups * 4));
            CK(cudaMemset(cnt, 0, groups * 4));
            CK(cudaMemcpyToSymbol(g_counters, &cnt, sizeof cnt));
            run(cost_var<GroupScales<false>>, "groups of 16 tiles, last CTA writes");
            run(cost_var<GroupScales<true>>, "groups, last CTA writes, scratch discarded");
            run(cost_var<GroupScales<true, false>>, "groups, no fences (bytes not guaranteed)");
            run(cost_var<GroupScales<false, true, false>>, "groups counted, fenced, not written");
            run(cost_var<GroupScales<false, false, false>>, "groups counted, not fenced or written");
            std::vector<uint32_t> h(groups);
            CK(cudaMemcpy(h.data(), cnt, groups * 4, cudaMemcpyDeviceToHost));
            u64 left = 0;
            for (uint32_t c : h) left += c;
            std::printf("  group counters left nonzero: %llu (expect 0)\n", (unsigned long long)left);
            CK(cudaFree(cnt));
        };
        if (std::getenv("NC_GROUP") != nullptr) {
            // The group flush against the shipped kernel, the two-step scales and the
            // bounds; three rounds (compact scales only).
            if (swz) continue;
            for (int pass = 0; pass < 3; ++pass) {
                run(tessera_nvfp4_both_bf16, "shipped");
                run_group();
                run_two_step();
                run(cost_var<ContiguousScales>, "contiguous per CTA (wrong places)");
            }
            continue;
        }
        if (std::getenv("NC_TWO_STEP") != nullptr) {
            if (swz) continue;
            run(tessera_nvfp4_both_bf16, "shipped");
            run_two_step();
            run(tessera_nvfp4_both_bf16, "shipped");
            run_two_step();
            continue;
        }
        if (std::getenv("NC_ENC") != nullptr) {
            // Whether the instruction count moves this card's time: the encoders only.
            for (int pass = 0; pass < 3; ++pass) {
                run(tessera_nvfp4_both_bf16, "shipped");
                run(cost_var<ShiftPack>, "magnitudes by shifted adds (before)");
                run(cost_var<Fused>, "lines fused with the product");
                run(cost_var<GlobalTables>, "tables from global");
                run(cost_var<FusedGlobalTables>, "fused, tables from global");
                run(cost_var<BothOneOp>, "both one op a value");
                run(cost_var<RowsOneOp>, "rows one op a value");
                run(cost_var<NoOp>, "no op a value");
            }
            continue;
        }
        if (std::getenv("NC_CROSS") != nullptr) {
            // The encoders (shipped, rows one op, both one op) with each compact flush
            // (shipped, none, contiguous per CTA, prefetched lines), three rounds;
            // swizzled: the encoders alone.
            for (int pass = 0; pass < 3; ++pass) {
                run(tessera_nvfp4_both_bf16, "shipped");
                run(cost_var<RowsOneOp>, "rows one op");
                run(cost_var<BothOneOp>, "both one op");
                if (swz) continue;
                run(cost_var<NoScales>, "no scale bytes");
                run(cost_var<Cross<RowsOneOp, NoScales>>, "rows one op, no scale bytes");
                run(cost_var<Cross<BothOneOp, NoScales>>, "both one op, no scale bytes");
                run(cost_var<ContiguousScales>, "contiguous per CTA");
                run(cost_var<Cross<RowsOneOp, ContiguousScales>>, "rows one op, contiguous per CTA");
                run(cost_var<Cross<BothOneOp, ContiguousScales>>, "both one op, contiguous per CTA");
                run(cost_var<PrefetchScales<0>>, "lines prefetched");
                run(cost_var<Cross<RowsOneOp, PrefetchScales<0>>>, "rows one op, lines prefetched");
                run(cost_var<Cross<BothOneOp, PrefetchScales<0>>>, "both one op, lines prefetched");
            }
            if (!swz) run_two_step();
            continue;
        }
        if (std::getenv("NC_CLUSTER") != nullptr) {
            // Compact columnwise bytes gathered over clusters of 4 or 8 tile rows, both
            // grids' over clusters of 4x2, 2x4 and 4x4 tiles, against the launch in
            // clusters alone and the bounds (no scale bytes, contiguous per CTA); three
            // rounds.
            for (int pass = 0; pass < 3; ++pass) {
                run(tessera_nvfp4_both_bf16, "shipped");
                run_clusters(cost_var<ClusterOrder<4, 1>>, 4, "clusters of 4x1 tiles, shipped flush");
                run_clusters(cost_var<ClusterOrder<4, 4>>, 16, "clusters of 4x4 tiles, shipped flush");
                if (swz) continue;
                run_clusters(cost_var<Cluster2D<4, 1>>, 4, "clusters of 4x1 tiles, columns gathered");
                run_clusters(cost_var<Cluster2D<8, 1>>, 8, "clusters of 8x1 tiles, columns gathered");
                run_clusters(cost_var<Cluster2D<4, 2>>, 8, "clusters of 4x2 tiles, both gathered");
                run_clusters(cost_var<Cluster2D<2, 4>>, 8, "clusters of 2x4 tiles, both gathered");
                run_clusters(cost_var<Cluster2D<4, 4>>, 16, "clusters of 4x4 tiles, both gathered");
                run(cost_var<ContiguousScales>, "contiguous per CTA (wrong places)");
                run(cost_var<NoScales>, "no scale bytes");
            }
            continue;
        }
        if (std::getenv("NC_LEAN") != nullptr) {
            // The leaner prologues against the shipped kernel; three rounds.
            for (int pass = 0; pass < 3; ++pass) {
                run(tessera_nvfp4_both_bf16, "shipped");
                run(cost_var<OneTable>, "one table, warps 4-7 skip the fill");
                run(cost_var<LeanLoads>, "loads behind a branch, addresses by adds");
                run(cost_var<Lean>, "both");
            }
            continue;
        }
        if (std::getenv("NC_PLACE") != nullptr) {
            // The shipped flush launched in clusters of 16 tiles (8x2, 4x4, 2x8) and 8
            // (4x2), against the shipped kernel and the bounds; three rounds.
            for (int pass = 0; pass < 3; ++pass) {
                run(tessera_nvfp4_both_bf16, "shipped");
                run_clusters(cost_var<ClusterOrder<8, 2>>, 16, "clusters of 8x2 tiles, shipped flush");
                run_clusters(cost_var<ClusterOrder<4, 4>>, 16, "clusters of 4x4 tiles, shipped flush");
                run_clusters(cost_var<ClusterOrder<2, 8>>, 16, "clusters of 2x8 tiles, shipped flush");
                run_clusters(cost_var<ClusterOrder<4, 2>>, 8, "clusters of 4x2 tiles, shipped flush");
                if (swz) continue;
                run(cost_var<ContiguousScales>, "contiguous per CTA (wrong places)");
                run(cost_var<NoScales>, "no scale bytes");
            }
            continue;
        }
        if (std::getenv("NC_ORDER") != nullptr) {
            // Whether a variant changes the time of the kernel after it.
            if (swz) continue;
            run(tessera_nvfp4_both_bf16, "shipped");
            run(cost_var<PrefetchScales<0>>, "scale lines prefetched to L2");
            run(tessera_nvfp4_both_bf16, "shipped");
            run(cost_var<PrefetchScales<2>>, "prefetched evict_last, reset after");
            run(tessera_nvfp4_both_bf16, "shipped");
            run(cost_var<PrefetchScales<1>>, "prefetched evict_last");
            run(tessera_nvfp4_both_bf16, "shipped");
            run(cost_var<ContiguousScales>, "scale bytes contiguous per CTA");
            run(tessera_nvfp4_both_bf16, "shipped");
            run(tessera_nvfp4_both_bf16, "shipped");
            run(cost_var<HintedScales<false>>, "scale stores L2::evict_first");
            run(tessera_nvfp4_both_bf16, "shipped");
            run(cost_var<HintedScales<true>>, "scale stores L2::evict_last");
            run(tessera_nvfp4_both_bf16, "shipped");
            run(cost_var<PrefetchScales<0>>, "scale lines prefetched to L2");
            run(tessera_nvfp4_both_bf16, "shipped");
            run(cost_var<NoScales>, "no scale bytes");
            run(tessera_nvfp4_both_bf16, "shipped");
            run(cost_var<Rows8<false>>, "a thread per scale row");
            run(tessera_nvfp4_both_bf16, "shipped");
            continue;
        }
        for (int pass = 0; pass < 2; ++pass) {
            run(tessera_nvfp4_both_bf16, "shipped");
            run(cost_var<BothParts>, "same parts");
            run(cost_var<ColsOneOp>, "columns one op a value");
            run(cost_var<RowsOneOp>, "rows one op a value");
            run(cost_var<BothOneOp>, "both one op a value");
            run(cost_var<NoOp>, "no op a value");
            if (!swz) {
                run(cost_var<NoScales>, "no scale bytes");
                run(cost_var<OneGrid<true>>, "rowwise scale bytes only");
                run(cost_var<OneGrid<false>>, "columnwise scale bytes only");
                run(cost_var<Rows8<false>>, "a thread per scale row");
                run(cost_var<Rows8<true>>, "a thread per scale row, st.cs");
                run(cost_var<HintedScales<true>>, "scale stores L2::evict_last");
                run(cost_var<HintedScales<false>>, "scale stores L2::evict_first");
                run(cost_var<ContiguousScales>, "scale bytes contiguous per CTA");
                run(cost_var<PrefetchScales<0>>, "scale lines prefetched to L2");
            }
        }
    }
}

int main() {
    print_device();
    run_shape(16384, 8192);
    run_shape(4096, 4096);
    return 0;
}
