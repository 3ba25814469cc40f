// Access-pattern experiments for the FP8 dequantizers (not shipped): per-tensor E4M3 to
// bf16, rowwise ([m, k] bytes to [m, k]) and columnwise (the [k, m] transpose to
// [m, k]), the shipped kernels against variants that change what one thread loads and
// stores (among them the kernels shipped before 2026-12-04). Every output is hashed; all of one orientation must agree byte for byte. Build:
//   nvcc -O3 -arch=sm_90 -std=c++17 -Xptxas -v -I crates/quant/kernels \
//        bench/cuda/dequant_variants.cu -o dq && ./dq
// GB/s counts the FP8 bytes read and the bf16 bytes written once; the ratio is to a
// cudaMemcpy of the bf16 output's size measured in the same run.
#include <cstdint>
#include <cstdio>
#include <vector>

#include "fp8.cu"
#include "harness.cuh"
#include "nvfp4.cu"

using bf16 = __nv_bfloat16;

// Two FP8 bytes (lo in bits 0-7, hi in 8-15) times s, as a bf16 pair (lo first).
__device__ __forceinline__ uint32_t pair_bf16(uint32_t two, float s) {
    uint32_t h;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h) : "h"((uint16_t)two));
    const float lo = __half2float(__ushort_as_half((unsigned short)(h & 0xFFFF))) * s;
    const float hi = __half2float(__ushort_as_half((unsigned short)(h >> 16))) * s;
    const __nv_bfloat162 p = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&p);
}

// Byte b of each of 8 words (one stored column of 8 stored rows), times s, as 8 bf16:
// 8 consecutive outputs of one output row.
__device__ __forceinline__ uint4 gather_bf16(const uint32_t* w, int b, float s) {
    const uint32_t sel = b | ((4 + b) << 4);
    return uint4{pair_bf16(__byte_perm(w[0], w[1], sel), s), pair_bf16(__byte_perm(w[2], w[3], sel), s),
                 pair_bf16(__byte_perm(w[4], w[5], sel), s), pair_bf16(__byte_perm(w[6], w[7], sel), s)};
}

// ---- rowwise -----------------------------------------------------------------------------

// U units of N values a thread in flight, grid-stride (the shipped loop until 2026-12-04
// had N = 16, U = 4): the thread loads all U before it stores any.
template <int N, int U>
__global__ void __launch_bounds__(256) row_u(const uint8_t* __restrict__ q, bf16* __restrict__ y, u64 n,
                                             const float* __restrict__ sp) {
    const float s = *sp;
    const u64 units = n / N, stride = (u64)gridDim.x * blockDim.x;
    for (u64 g = (u64)blockIdx.x * blockDim.x + threadIdx.x; g < units; g += U * stride) {
        Bytes<8> raw[U][N / 8];
#pragma unroll
        for (int u = 0; u < U; ++u)
#pragma unroll
            for (int h = 0; h < N / 8; ++h)
                if (g + u * stride < units) raw[u][h] = load_bytes<8>(q + N * (g + u * stride) + 8 * h);
#pragma unroll
        for (int u = 0; u < U; ++u) {
            if (g + u * stride >= units) break;
            float v[N];
#pragma unroll
            for (int h = 0; h < N / 8; ++h) fp8_bytes_to_f32<true>(raw[u][h], v + 8 * h);
#pragma unroll
            for (int j = 0; j < N; ++j) v[j] = v[j] * s;
            store_vec<N>(y + N * (g + u * stride), v);
        }
    }
}

// ---- columnwise ----------------------------------------------------------------------------

// A thread per 16 bytes of a stored row, written down one output column (neighbouring
// lanes on neighbouring columns: a warp stores 64 contiguous bytes per instruction), four
// waves of CTAs striding: the shipped kernel until 2026-12-04.
__global__ void __launch_bounds__(256) col_down(const uint8_t* __restrict__ q, bf16* __restrict__ y, u64 m, u64 k,
                                                const float* __restrict__ sp) {
    const float s = *sp;
    const u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 g = (u64)blockIdx.x * blockDim.x + threadIdx.x; g < m * k / 16; g += stride) {
        const u64 c = g % k, r = 16 * (g / k);
        const uint4 raw = reinterpret_cast<const uint4*>(q + c * m + r)[0];
        const Bytes<8> lo{{raw.x, raw.y}}, hi{{raw.z, raw.w}};
        float v[16];
        fp8_bytes_to_f32<true>(lo, v);
        fp8_bytes_to_f32<true>(hi, v + 8);
#pragma unroll
        for (int j = 0; j < 16; ++j) y[(r + j) * k + c] = __float2bfloat16_rn(v[j] * s);
    }
}

// A thread takes 8 stored rows (output columns c0 .. c0 + 7) by 16 * R stored columns
// (output rows): 8 * R 16-byte loads, 16 * R 16-byte stores, the transpose in registers
// (byte i of each stored row gathered pairwise with PRMT). Neighbouring lanes take
// neighbouring column groups, so a warp stores 512 contiguous bytes of an output row per
// instruction. Needs k % 8 == 0, m % (16 R) == 0.
template <int R>
__global__ void __launch_bounds__(256) col_reg(const uint8_t* __restrict__ q, bf16* __restrict__ y, u64 m, u64 k,
                                               const float* __restrict__ sp) {
    const float s = *sp;
    const u64 groups = k / 8, chunks = m / (16 * R);
    const u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 g = (u64)blockIdx.x * blockDim.x + threadIdx.x; g < groups * chunks; g += stride) {
        const u64 cg = g % groups, mc = g / groups;
        uint4 raw[8][R];
#pragma unroll
        for (int j = 0; j < 8; ++j)
#pragma unroll
            for (int r = 0; r < R; ++r)
                raw[j][r] = reinterpret_cast<const uint4*>(q + (8 * cg + j) * m)[mc * R + r];
#pragma unroll
        for (int r = 0; r < R; ++r) {
#pragma unroll
            for (int i = 0; i < 16; ++i) {
                uint32_t w[8];
#pragma unroll
                for (int j = 0; j < 8; ++j) {
                    const uint4 v = raw[j][r];
                    w[j] = i < 4 ? v.x : i < 8 ? v.y : i < 12 ? v.z : v.w;
                }
                reinterpret_cast<uint4*>(y + (16 * (mc * R + r) + i) * k)[cg] = gather_bf16(w, i % 4, s);
            }
        }
    }
}

// The first shared-memory transpose: a CTA copies a tile of 64 stored rows x 256 stored
// columns (16 KiB, each lane four coalesced 16-byte loads) into shared memory, then each
// lane reads 4 stored columns of 8 stored rows (8 4-byte reads) and writes 4 output rows x
// 8 output columns (4 16-byte stores; 8 lanes make 128 contiguous bytes of a row). Rows
// padded by 16 bytes put the rows 8 apart that a warp reads at once in one bank (8-way
// conflicts); the shipped kernel swizzles instead. Needs m % 256 == 0, k % 64 == 0.
__global__ void __launch_bounds__(256) col_smem(const uint8_t* __restrict__ q, bf16* __restrict__ y, u64 m, u64 k,
                                                const float* __restrict__ sp) {
    constexpr int P = 256 + 16;  // row pitch in bytes (16-byte aligned; shifts banks by 4)
    __shared__ __align__(16) uint8_t t[64 * P];
    const float s = *sp;
    const u64 tiles_m = m / 256, tiles = tiles_m * (k / 64);
    const int tid = threadIdx.x;
    for (u64 tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
        const u64 tm = tile % tiles_m, tk = tile / tiles_m;
        __syncthreads();
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int row = tid / 16 + 16 * i, ch = tid % 16;
            *reinterpret_cast<uint4*>(t + row * P + 16 * ch) =
                reinterpret_cast<const uint4*>(q + (64 * tk + row) * m + 256 * tm)[ch];
        }
        __syncthreads();
        // lane -> (kg: 8 output columns, mq: 4 output rows); 8 kg x 64 mq per CTA.
#pragma unroll
        for (int pass = 0; pass < 2; ++pass) {
            const int idx = tid + 256 * pass, kg = idx % 8, mq = idx / 8;
            uint32_t w[8];
#pragma unroll
            for (int j = 0; j < 8; ++j) w[j] = *reinterpret_cast<const uint32_t*>(t + (8 * kg + j) * P + 4 * mq);
#pragma unroll
            for (int b = 0; b < 4; ++b) {
                const uint4 o = gather_bf16(w, b, s);
                reinterpret_cast<uint4*>(y + (256 * tm + 4 * mq + b) * k + 64 * tk)[kg] = o;
            }
        }
    }
}

// The shared-memory transpose with its choices as parameters: MAP 0 maps a warp to 4
// column groups x 8 row quads, MAP 1 to 8 column groups x 4 row quads (128 contiguous
// bytes a row); SW 0 leaves the tile's words in place, SW 1 XORs word w of row j with
// 8 * ((j / 8) % 4) (conflict-free reads for MAP 0), SW 2 with 4 * ((j / 8) % 8)
// (conflict-free for MAP 1); PW is the row pitch in words (64, or 68: padded by 16 bytes).
template <int MAP, int SW, int PW>
__global__ void __launch_bounds__(256) col_exp(const uint8_t* __restrict__ q, bf16* __restrict__ y, u64 m, u64 k,
                                               const float* __restrict__ sp) {
    const float s = *sp;
    __shared__ __align__(16) uint32_t tile[64 * PW];
    auto swz = [](int j) { return SW == 0 ? 0 : SW == 1 ? 8 * ((j / 8) % 4) : 4 * ((j / 8) % 8); };
    const uint32_t tm = (uint32_t)(m / 256);
    const u64 k0 = (u64)(blockIdx.x / tm) * 64, m0 = (u64)(blockIdx.x % tm) * 256;
    const int tid = threadIdx.x;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int j = tid / 16 + 16 * i, ch = tid % 16;
        *reinterpret_cast<uint4*>(&tile[j * PW + ((4 * ch) ^ swz(j))]) =
            *reinterpret_cast<const uint4*>(q + (k0 + j) * m + m0 + 16 * ch);
    }
    __syncthreads();
#pragma unroll
    for (int pass = 0; pass < 2; ++pass) {
        const int idx = tid + 256 * pass;
        const int kg = MAP == 0 ? (idx / 8) % 8 : idx % 8, mq = MAP == 0 ? idx % 8 + 8 * (idx / 64) : idx / 8;
        const u64 r0 = m0 + 4 * mq, c0 = k0 + 8 * kg;
        bf16* out = y + r0 * k + c0;
        uint32_t w[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) w[j] = tile[(8 * kg + j) * PW + (mq ^ swz(8 * kg + j))];
#pragma unroll
        for (int b = 0; b < 4; ++b) {
            const uint4 o = gather_bf16(w, b, s);
            store_global16(out + b * k, o);
        }
    }
}

// The padded shared-memory transpose over TK stored rows x TM stored columns (16 KiB for
// 256 threads), its tile in dynamic shared memory so that the launch can ask for more and
// so cap the CTAs resident per SM. A thread writes 4 output rows x 8 output columns per
// pass, neighbouring lanes on neighbouring column groups (a warp writes 2 TK contiguous
// bytes of each row it touches).
template <int TK, int TM>
__global__ void __launch_bounds__(256) col_tile(const uint8_t* __restrict__ q, bf16* __restrict__ y, u64 m, u64 k,
                                                const float* __restrict__ sp) {
    constexpr int PW = TM / 4 + 4, CH = TM / 16, PASSES = TK * TM / 32 / 256;
    extern __shared__ __align__(16) uint32_t dyn[];
    const float s = *sp;
    const uint32_t tm = (uint32_t)(m / TM);
    const u64 k0 = (u64)(blockIdx.x / tm) * TK, m0 = (u64)(blockIdx.x % tm) * TM;
    const int tid = threadIdx.x;
#pragma unroll
    for (int i = 0; i < TK * CH / 256; ++i) {
        const int j = tid / CH + (256 / CH) * i, ch = tid % CH;
        *reinterpret_cast<uint4*>(&dyn[j * PW + 4 * ch]) = *reinterpret_cast<const uint4*>(q + (k0 + j) * m + m0 + 16 * ch);
    }
    __syncthreads();
#pragma unroll
    for (int pass = 0; pass < PASSES; ++pass) {
        const int idx = tid + 256 * pass, kg = idx % (TK / 8), mq = idx / (TK / 8);
        bf16* out = y + (m0 + 4 * mq) * k + k0 + 8 * kg;
        uint32_t w[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) w[j] = dyn[(8 * kg + j) * PW + mq];
#pragma unroll
        for (int b = 0; b < 4; ++b) {
            const uint4 o = gather_bf16(w, b, s);
            store_global16(out + b * k, o);
        }
    }
}

// Launches col_tile<TK, TM> with enough dynamic shared memory that at most `ctas` CTAs fit
// on an SM (228 KiB each, 1 KiB reserved per CTA).
template <int TK, int TM>
static void launch_tile(int ctas, const uint8_t* q, bf16* y, u64 m, u64 k, const float* sp) {
    const int tile = TK * (TM + 16);
    const int smem = std::max(tile, 228 * 1024 / ctas - 1024 + 16);
    CK(cudaFuncSetAttribute(col_tile<TK, TM>, cudaFuncAttributeMaxDynamicSharedMemorySize, 100 * 1024));
    col_tile<TK, TM><<<(unsigned)((m / TM) * (k / TK)), 256, smem>>>(q, y, m, k, sp);
}

// The library's fp8_dequant_cols with tiles of TK q rows by 256 bytes, at MINB CTAs per SM
// (the library instantiates TK = 64: the "col shipped" row; 32 KiB tiles fit 6 CTAs an
// SM).
template <int TK, int MINB>
__global__ void __launch_bounds__(256, MINB) col_lib(const uint8_t* __restrict__ q, bf16* __restrict__ y, u64 m, u64 k,
                                                     const float* __restrict__ sp) {
    const float s = *sp;
    auto scale = [=](u64, u64) { return s; };
    fp8_dequant_cols<bf16, true, TK>(q, y, m, k, scale);
}

__global__ void __launch_bounds__(256) copy16(const uint4* __restrict__ a, uint4* __restrict__ b, u64 n) {
    const u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) b[i] = a[i];
}

// ---- the driver -------------------------------------------------------------------------

static double copy_gbs;

static void report(const char* name, float ms, double bytes, const void* out, size_t n) {
    const double gbs = bytes / ms / 1e6;
    std::printf("%-40s %8.4f ms %8.1f GB/s %6.3f of copy  hash %016llx\n", name, ms, gbs, gbs / copy_gbs,
                (unsigned long long)fnv(out, n));
}

// The library's grid_1d: at most 4 waves of resident 256-thread CTAs.
static unsigned grid_1d(u64 units, int sms) {
    return (unsigned)std::min<u64>((units + 255) / 256, 4ull * sms * 8);
}
static unsigned cover(u64 units) { return (unsigned)((units + 255) / 256); }

static void run_shape(u64 M, u64 K, int sms, bool sweep = false) {
    const u64 n = M * K;
    std::printf("== [%llu, %llu] e4m3 -> bf16\n", (unsigned long long)M, (unsigned long long)K);
    std::vector<uint8_t> h(n);
    uint64_t st = 0x9E3779B97F4A7C15ull ^ n;
    for (auto& b : h) {
        st = st * 6364136223846793005ull + 1442695040888963407ull;
        b = (uint8_t)(st >> 56);
        if ((b & 0x7F) == 0x7F) b = 0x3C;  // keep NaNs out: hashes stay comparable
    }
    uint8_t* q;
    bf16 *y, *y2;
    float* sp;
    CK(cudaMalloc(&q, n));
    CK(cudaMalloc(&y, 2 * n));
    CK(cudaMalloc(&y2, 2 * n));
    CK(cudaMalloc(&sp, 4));
    const float sv = 0.37f;
    CK(cudaMemcpy(q, h.data(), n, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(sp, &sv, 4, cudaMemcpyHostToDevice));
    const double bytes = 3.0 * n;
    float ms = time_ms([&] { CK(cudaMemcpyAsync(y2, y, 2 * n, cudaMemcpyDeviceToDevice)); });
    copy_gbs = 4.0 * n / ms / 1e6;
    std::printf("%-40s %8.4f ms %8.1f GB/s\n", "cudaMemcpy of the output size", ms, copy_gbs);
    ms = time_ms([&] { copy16<<<grid_1d(n / 8, sms), 256>>>((const uint4*)y, (uint4*)y2, n / 8); });
    std::printf("%-40s %8.4f ms %8.1f GB/s %6.3f of copy\n", "copy kernel, 16 B per lane, grid_1d", ms,
                4.0 * n / ms / 1e6, 4.0 * n / ms / 1e6 / copy_gbs);

    auto release = [&] {
        CK(cudaFree(q));
        CK(cudaFree(y));
        CK(cudaFree(y2));
        CK(cudaFree(sp));
    };
    auto row = [&](const char* name, auto launch) {
        CK(cudaMemset(y, 0xFF, 2 * n));
        report(name, time_ms(launch), bytes, y, 2 * n);
    };
    if (!sweep) {
        row("row shipped (8/unit, cover)", [&] { tessera_fp8_dequant_bf16_e4m3<<<cover(n / 8), 256>>>(q, y, n, sp); });
        row("row 16/unit U=4 grid_1d (until 12-04)", [&] { row_u<16, 4><<<grid_1d(n / 16, sms), 256>>>(q, y, n, sp); });
        row("row 16/unit U=1 grid_1d", [&] { row_u<16, 1><<<grid_1d(n / 16, sms), 256>>>(q, y, n, sp); });
        row("row 16/unit U=1 cover", [&] { row_u<16, 1><<<cover(n / 16), 256>>>(q, y, n, sp); });
        row("row 8/unit U=1 cover", [&] { row_u<8, 1><<<cover(n / 8), 256>>>(q, y, n, sp); });
        row("row 8/unit U=1 grid_1d", [&] { row_u<8, 1><<<grid_1d(n / 8, sms), 256>>>(q, y, n, sp); });
        row("row 8/unit U=2 grid_1d", [&] { row_u<8, 2><<<grid_1d(n / 8, sms), 256>>>(q, y, n, sp); });
        row("row 8/unit U=4 grid_1d", [&] { row_u<8, 4><<<grid_1d(n / 8, sms), 256>>>(q, y, n, sp); });
        row("row 8/unit U=2 cover/2", [&] { row_u<8, 2><<<cover(n / 16), 256>>>(q, y, n, sp); });
    }

    // columnwise: q holds the [K, M] transpose
    const unsigned tiles = (unsigned)(((K + 63) / 64) * ((M + 255) / 256));
    row("col shipped (shared-memory tiles)", [&] { tessera_fp8_dequant_t_bf16_e4m3<<<tiles, 256>>>(q, y, M, K, sp); });
    const unsigned tall_tiles = (unsigned)(((K + 127) / 128) * ((M + 255) / 256));
    row("col library 128x256, 6 CTAs/SM", [&] { col_lib<128, 6><<<tall_tiles, 256>>>(q, y, M, K, sp); });
    row("col library 128x256, 4 CTAs/SM", [&] { col_lib<128, 4><<<tall_tiles, 256>>>(q, y, M, K, sp); });
    if (sweep) {
        row("col library 128x256, 8 CTAs/SM", [&] { col_lib<128, 8><<<tall_tiles, 256>>>(q, y, M, K, sp); });
        release();
        return;
    }
    row("col exp map0 sw1 pw64", [&] { col_exp<0, 1, 64><<<tiles, 256>>>(q, y, M, K, sp); });
    row("col exp map0 sw0 pw68", [&] { col_exp<0, 0, 68><<<tiles, 256>>>(q, y, M, K, sp); });
    row("col exp map1 sw0 pw68", [&] { col_exp<1, 0, 68><<<tiles, 256>>>(q, y, M, K, sp); });
    row("col exp map1 sw2 pw64", [&] { col_exp<1, 2, 64><<<tiles, 256>>>(q, y, M, K, sp); });
    for (int ctas : {8, 4}) {
        char name[64];
        std::snprintf(name, sizeof name, "col tile 64x256, %d CTAs/SM", ctas);
        row(name, [&] { launch_tile<64, 256>(ctas, q, y, M, K, sp); });
        std::snprintf(name, sizeof name, "col tile 128x128, %d CTAs/SM", ctas);
        row(name, [&] { launch_tile<128, 128>(ctas, q, y, M, K, sp); });
        std::snprintf(name, sizeof name, "col tile 256x64, %d CTAs/SM", ctas);
        row(name, [&] { launch_tile<256, 64>(ctas, q, y, M, K, sp); });
        std::snprintf(name, sizeof name, "col tile 128x256, %d CTAs/SM", ctas);
        row(name, [&] { launch_tile<128, 256>(ctas, q, y, M, K, sp); });
    }
    row("col 16 down a column (until 12-04)", [&] { col_down<<<grid_1d(n / 16, sms), 256>>>(q, y, M, K, sp); });
    row("col reg 8x16 cover", [&] { col_reg<1><<<cover(n / 128), 256>>>(q, y, M, K, sp); });
    row("col reg 8x16 grid_1d", [&] { col_reg<1><<<grid_1d(n / 128, sms), 256>>>(q, y, M, K, sp); });
    row("col reg 8x32 cover", [&] { col_reg<2><<<cover(n / 256), 256>>>(q, y, M, K, sp); });
    row("col smem padded, cover", [&] { col_smem<<<(unsigned)(n / (64 * 256)), 256>>>(q, y, M, K, sp); });
    row("col smem padded, 4 waves", [&] {
        col_smem<<<(unsigned)std::min<u64>(n / (64 * 256), 4ull * sms * 8), 256>>>(q, y, M, K, sp);
    });
    release();
}

// ---- NVFP4 rowwise -------------------------------------------------------------------------

// The shipped NVFP4 rowwise body with U units per thread, a warp's units interleaved (lane
// l takes units base + l, base + 32 + l, ...), so each store instruction still writes
// 512 contiguous bytes; the amax load and the index arithmetic are shared by the U.
template <int U>
__global__ void __launch_bounds__(256) nv_rows(const uint8_t* __restrict__ q, const uint8_t* __restrict__ s,
                                               const float* __restrict__ amax, bf16* __restrict__ y, u64 m, u64 k,
                                               u64 s_cols) {
    const u64 lane = threadIdx.x % 32, warp = ((u64)blockIdx.x * blockDim.x + threadIdx.x) / 32;
    const float A = amax[0];
    uint32_t w[U];
    uint8_t e[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
        const u64 g = warp * 32 * U + 32 * u + lane;
        if (g < m * k / 8) {
            const DivMod p = divmod(8 * g, k);
            w[u] = reinterpret_cast<const uint32_t*>(q)[g];
            e[u] = s[p.q * s_cols + p.r / 16];
        }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
        const u64 g = warp * 32 * U + 32 * u + lane;
        if (g >= m * k / 8) break;
        const float sc = nvfp4_decode_scale(e[u], A);
        float v[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) v[j] = __fmul_rn(e2m1_value((w[u] >> (4 * j)) & 0xFu), sc);
        store_vec<8>(y + 8 * g, v);
    }
}

// An NVFP4 dequantization bench: random packed data (n / 2 bytes) and positive finite
// E4M3 scales (s_bytes) on the device, amax 37.5, a bf16 output of n elements, and
// copy_gbs set to a cudaMemcpy of that output's size.
struct Nvfp4Dequant {
    uint8_t *q, *sd;
    float* amax;
    bf16* y;
    u64 n;
    double bytes;
    Nvfp4Dequant(u64 n_, u64 s_bytes, uint64_t seed) : n(n_), bytes(n_ / 2 + s_bytes + 2.0 * n_) {
        std::vector<uint8_t> hq(n / 2), hs(s_bytes);
        uint64_t st = seed ^ n;
        auto next = [&] {
            st = st * 6364136223846793005ull + 1442695040888963407ull;
            return (uint8_t)(st >> 56);
        };
        for (auto& b : hq) b = next();
        for (auto& b : hs) b = next() & 0x7E;
        CK(cudaMalloc(&q, n / 2));
        CK(cudaMalloc(&sd, s_bytes));
        CK(cudaMalloc(&y, 2 * n));
        CK(cudaMalloc(&amax, 4));
        const float a = 37.5f;
        CK(cudaMemcpy(q, hq.data(), n / 2, cudaMemcpyHostToDevice));
        CK(cudaMemcpy(sd, hs.data(), s_bytes, cudaMemcpyHostToDevice));
        CK(cudaMemcpy(amax, &a, 4, cudaMemcpyHostToDevice));
        bf16* y2;
        CK(cudaMalloc(&y2, 2 * n));
        const float copy_ms = time_ms([&] { CK(cudaMemcpyAsync(y2, y, 2 * n, cudaMemcpyDeviceToDevice)); });
        copy_gbs = 4.0 * n / copy_ms / 1e6;
        CK(cudaFree(y2));
    }
    ~Nvfp4Dequant() {
        CK(cudaFree(q));
        CK(cudaFree(sd));
        CK(cudaFree(y));
        CK(cudaFree(amax));
    }
    // Times `launch` over a poisoned output and prints its line.
    template <class L> void row(const char* name, L launch) {
        CK(cudaMemset(y, 0xFF, 2 * n));
        report(name, time_ms(launch), bytes, y, 2 * n);
    }
};

static void run_nvfp4(u64 M, u64 K) {
    std::printf("== [%llu, %llu] nvfp4 rowwise -> bf16 (compact scales)\n", (unsigned long long)M,
                (unsigned long long)K);
    const u64 n = M * K, s_cols = K / 16;
    Nvfp4Dequant d(n, M * s_cols, 0x2545F4914F6CDD1Dull);
    const auto q = d.q, sd = d.sd;
    const auto amax = d.amax;
    const auto y = d.y;
    // The library's launch: DEQ_UNITS (2) units of 8 values a thread (dequant_units_grid).
    d.row("nvfp4 rows shipped", [&] { tessera_nvfp4_dequant_bf16<<<cover(n / 16), 256>>>(q, sd, amax, y, M, K, s_cols, 0); });
    d.row("nvfp4 rows, 1 unit a thread", [&] { nv_rows<1><<<cover(n / 8), 256>>>(q, sd, amax, y, M, K, s_cols); });
    d.row("nvfp4 rows, 2 units a thread", [&] { nv_rows<2><<<cover(n / 16), 256>>>(q, sd, amax, y, M, K, s_cols); });
    d.row("nvfp4 rows, 4 units a thread", [&] { nv_rows<4><<<cover(n / 32), 256>>>(q, sd, amax, y, M, K, s_cols); });
}

// ---- NVFP4 columnwise --------------------------------------------------------------------

// The NVFP4 columnwise dequantizer before 2026-12-06 (nvfp4_dequant_cols_rht's map
// without the RHT) with the tile TK q rows (output columns) by TM values: a thread decodes
// one 16-block of each of 4 q rows (4 output columns) and stores its 16 output rows 8
// bytes each; TK / 4 lanes share a block row, so a warp stores 8 * TK / 4 contiguous
// bytes of an output row (TK = 128: 256 bytes, 1 row; TK = 64: 128 bytes of each of 2
// rows). bf16 output, no RHT, compact scales. Measured on the H200 (2026-12-04; the
// shipped kernel then also held the inverse RHT, at 64 registers, against this copy's
// 40): 16384x8192 shipped 0.596 of a copy, 64 x 256 0.677, 128 x 128 0.653, 256 x 64
// 0.629, 32 x 512 0.711; 4096x4096 0.677, 0.778, 0.678, 0.628, 0.759. On an H100
// (2026-12-06, dequant-variants-h100-2026-12-06.txt) 64 x 256 0.820 / 0.831.
template <int TK, int TM>
__global__ void __launch_bounds__(256) nv_cols(const uint8_t* __restrict__ q, const uint8_t* __restrict__ s,
                                               const float* __restrict__ amax, bf16* __restrict__ y, u64 m, u64 k,
                                               u64 s_cols) {
    constexpr int ROW_WORDS = TM / 8, LK = TK / 4;  // words a q row; lanes along k
    static_assert(LK * (TM / 16) == 256, "a thread per (4 q rows, 16-block)");
    __shared__ __align__(16) uint32_t tile[TK][ROW_WORDS];
    auto swz = [](int j) { return 2 * ((j / 4) % (TM / 16)); };
    const DeqTile t = nvfp4_dequant_tile<TK, TM>(m);
    DeqTileChunks<TK, TM>(q, m, k, t).stage(tile, swz);
    __syncthreads();
    const u64 k0 = t.k0, m0 = t.m0;
    const int tid = threadIdx.x;
    const int kg = tid % LK, mb = tid / LK;
    const u64 c0 = k0 + 4 * kg, r0 = m0 + 16 * mb;
    if (c0 >= k || r0 >= m) return;
    const float A = amax[0];
    union {
        bf16 e[4];
        uint2 u2;
    } out_v[16];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const uint2 w = *reinterpret_cast<const uint2*>(&tile[4 * kg + j][(2 * mb) ^ swz(4 * kg + j)]);
        float v[16];
        e2m1x16_values(w, nvfp4_decode_scale(s[(c0 + j) * s_cols + r0 / 16], A), v);
#pragma unroll
        for (int i = 0; i < 16; ++i) out_v[i].e[j] = __float2bfloat16_rn(v[i]);
    }
    bf16* out = y + r0 * k + c0;
#pragma unroll
    for (int i = 0; i < 16; ++i) store_global8(out + i * k, out_v[i].u2);
}

// The library's 8x8 map (nvfp4_dequant_cols, since 2026-12-06) instantiated with the
// tile TK q rows by TM values and MINB CTAs per SM: a thread takes 8 q rows by one word
// (8 values) and stores 8 output rows 16 bytes each; TK / 8 lanes share a word, so a
// warp writes 2 TK contiguous bytes of each of 32 / (TK / 8) rows per store. H100,
// 16384x8192 / 4096x4096 (dequant-variants-h100-2026-12-06.txt, from a copy of the
// kernel here that read compact scales only): 64 x 256 at 8 CTAs per SM (the library's
// tile) 0.832 / 0.988 of a copy, at 6 0.828 / 0.836, at 4 0.725 / 0.802; 64 x 512
// 0.819 / 0.937; 128 x 256 0.853 / 0.902; 32 x 512 0.765 / 0.932. Those loaded the tile a
// chunk at a time; with every load in flight together (c7f64d3), 64 x 256 0.849 / 1.090,
// 128 x 256 0.895 / 1.030 (dequant-nvfp4-cols-h100-2026-12-06-s41.txt).
template <int TK, int TM, int MINB>
__global__ void __launch_bounds__(256, MINB) nv_cols8(const uint8_t* __restrict__ q, const uint8_t* __restrict__ s,
                                                      const float* __restrict__ amax, bf16* __restrict__ y, u64 m,
                                                      u64 k, u64 s_cols) {
    nvfp4_dequant_cols<bf16, TK, TM>(q, s, amax, y, m, k, s_cols, 0);
}

static void run_nvfp4_cols(u64 M, u64 K, bool sweep = false) {
    std::printf("== [%llu, %llu] nvfp4 columnwise -> bf16 (compact scales, no RHT)\n", (unsigned long long)M,
                (unsigned long long)K);
    const u64 n = M * K, s_cols = M / 16;  // q is [K, M/2], scales [K, M/16]
    Nvfp4Dequant d(n, K * s_cols, 0x9E3779B97F4A7C15ull);
    const auto q = d.q, sd = d.sd;
    const auto amax = d.amax;
    const auto y = d.y;
    auto tiles = [&](u64 tk, u64 tm) { return (unsigned)(((K + tk - 1) / tk) * ((M + tm - 1) / tm)); };
    d.row("nvfp4 cols shipped (8x8 map, 64 x 256)",
          [&] { tessera_nvfp4_dequant_t_bf16<<<tiles(64, 256), 256>>>(q, sd, amax, y, M, K, s_cols, 0); });
    if (sweep) {
        d.row("8x8 map 128 x 256, 8 CTAs/SM",
              [&] { nv_cols8<128, 256, 8><<<tiles(128, 256), 256>>>(q, sd, amax, y, M, K, s_cols); });
        d.row("8x8 map 128 x 256, 6 CTAs/SM",
              [&] { nv_cols8<128, 256, 6><<<tiles(128, 256), 256>>>(q, sd, amax, y, M, K, s_cols); });
        return;
    }
    d.row("nvfp4 cols 64 x 256 (harness copy)",
          [&] { nv_cols<64, 256><<<tiles(64, 256), 256>>>(q, sd, amax, y, M, K, s_cols); });
    d.row("nvfp4 cols 128 x 128", [&] { nv_cols<128, 128><<<tiles(128, 128), 256>>>(q, sd, amax, y, M, K, s_cols); });
    d.row("nvfp4 cols 256 x 64", [&] { nv_cols<256, 64><<<tiles(256, 64), 256>>>(q, sd, amax, y, M, K, s_cols); });
    d.row("nvfp4 cols 32 x 512", [&] { nv_cols<32, 512><<<tiles(32, 512), 256>>>(q, sd, amax, y, M, K, s_cols); });
    d.row("8x8 map 64 x 256, 8 CTAs/SM", [&] { nv_cols8<64, 256, 8><<<tiles(64, 256), 256>>>(q, sd, amax, y, M, K, s_cols); });
    d.row("8x8 map 64 x 256, 6 CTAs/SM", [&] { nv_cols8<64, 256, 6><<<tiles(64, 256), 256>>>(q, sd, amax, y, M, K, s_cols); });
    d.row("8x8 map 64 x 256, 4 CTAs/SM", [&] { nv_cols8<64, 256, 4><<<tiles(64, 256), 256>>>(q, sd, amax, y, M, K, s_cols); });
    d.row("8x8 map 64 x 512, 8 CTAs/SM", [&] { nv_cols8<64, 512, 8><<<tiles(64, 512), 256>>>(q, sd, amax, y, M, K, s_cols); });
    d.row("8x8 map 128 x 256, 8 CTAs/SM", [&] { nv_cols8<128, 256, 8><<<tiles(128, 256), 256>>>(q, sd, amax, y, M, K, s_cols); });
    d.row("8x8 map 32 x 512, 8 CTAs/SM", [&] { nv_cols8<32, 512, 8><<<tiles(32, 512), 256>>>(q, sd, amax, y, M, K, s_cols); });
}

int main() {
    cudaDeviceProp p;
    CK(cudaGetDeviceProperties(&p, 0));
    std::printf("%s (sm_%d%d), %d SMs\n", p.name, p.major, p.minor, p.multiProcessorCount);
    // DQ_COL_SWEEP: both columnwise dequantizers, the shipped 64-row tile against 128 rows,
    // over shapes from a half-filled card to a full one several times over.
    if (std::getenv("DQ_COL_SWEEP") != nullptr) {
        const u64 shapes[][2] = {{2048, 4096}, {4096, 4096}, {4096, 8192}, {8192, 4096}, {8192, 8192},
                                 {16384, 4096}, {8192, 16384}, {16384, 8192}, {32768, 8192}};
        for (const auto& s : shapes) {
            run_shape(s[0], s[1], p.multiProcessorCount, true);
            run_nvfp4_cols(s[0], s[1], true);
        }
        return 0;
    }
    if (std::getenv("DQ_NVFP4_COLS") != nullptr) {
        run_nvfp4_cols(16384, 8192);
        run_nvfp4_cols(4096, 4096);
        return 0;
    }
    run_shape(16384, 8192, p.multiProcessorCount);
    run_shape(4096, 4096, p.multiProcessorCount);
    run_shape(8192, 16384, p.multiProcessorCount);
    run_nvfp4(16384, 8192);
    run_nvfp4(4096, 4096);
    run_nvfp4_cols(16384, 8192);
    run_nvfp4_cols(4096, 4096);
}
