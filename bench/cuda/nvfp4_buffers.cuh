// The NVFP4 harnesses' device buffers for a bf16 [M, K] input (not shipped; include
// after nvfp4.cu and harness.cuh): the input (bf16_input, `normal` or wide-range), a
// same-size scratch for the copy, rowwise and columnwise data and scale grids padded as
// the library pads them (rows to 128, columns to 4, so that the both kernel's 4-byte
// scale stores stay aligned on ragged shapes), and the global amax, filled once by the
// amax pass. Construction times a device copy of the input (copy_gbs, bytes read +
// written) and prints the shape's header line. Freed on destruction.
#pragma once

struct Nvfp4Buffers {
    u64 M, K, n, sr_cols, sc_cols, s_bytes;
    double copy_gbs = 0;
    // The library's grid for the amax pass (grid_1d: 4 waves of 8 CTAs per SM at most).
    unsigned amax_grid;
    __nv_bfloat16* x;
    uint8_t *q, *qt, *sr, *sc, *tmp;
    float* amax;

    Nvfp4Buffers(u64 M_, u64 K_, bool normal) : M(M_), K(K_), n(M_ * K_) {
        sr_cols = (K / 16 + 3) / 4 * 4;
        sc_cols = (M / 16 + 3) / 4 * 4;
        s_bytes = std::max((M + 127) / 128 * 128 * sr_cols, (K + 127) / 128 * 128 * sc_cols);
        amax_grid = (unsigned)std::min<u64>((n / 8 + 255) / 256, 4ull * 132 * 8);
        CK(cudaMalloc(&x, n * 2));
        CK(cudaMalloc(&tmp, n * 2));
        CK(cudaMalloc(&q, n / 2));
        CK(cudaMalloc(&qt, n / 2));
        CK(cudaMalloc(&sr, s_bytes));
        CK(cudaMalloc(&sc, s_bytes));
        CK(cudaMalloc(&amax, 4));
        const std::vector<uint16_t> h = bf16_input(n, normal);
        CK(cudaMemcpy(x, h.data(), n * 2, cudaMemcpyHostToDevice));
        const float ms = time_ms([&] { CK(cudaMemcpyAsync(tmp, x, n * 2, cudaMemcpyDeviceToDevice)); });
        copy_gbs = 4.0 * n / ms / 1e6;
        std::printf("\n[%llu, %llu] %s inputs; cudaMemcpy d2d %.4f ms %.1f GB/s\n", (unsigned long long)M,
                    (unsigned long long)K, normal ? "normal" : "wide-range + NaN/Inf/0", ms, copy_gbs);
        CK(cudaMemset(amax, 0, 4));
        tessera_amax_bf16<<<amax_grid, 256>>>(x, n, amax);
        CK(cudaDeviceSynchronize());
    }
    Nvfp4Buffers(const Nvfp4Buffers&) = delete;
    Nvfp4Buffers& operator=(const Nvfp4Buffers&) = delete;
    ~Nvfp4Buffers() {
        cudaFree(x);
        cudaFree(tmp);
        cudaFree(q);
        cudaFree(qt);
        cudaFree(sr);
        cudaFree(sc);
        cudaFree(amax);
    }

    // Poisons the data outputs (an unwritten byte changes the hash) and clears the
    // scale grids' padding, as the library clears it (the both kernel writes it).
    void clear() const {
        CK(cudaMemset(q, 0xA5, n / 2));
        CK(cudaMemset(qt, 0xA5, n / 2));
        CK(cudaMemset(sr, 0, s_bytes));
        CK(cudaMemset(sc, 0, s_bytes));
    }

    // The four outputs as report_hashes takes them: both orientations' data, and the scale
    // grids' first n / 16 bytes.
    std::vector<std::pair<const void*, size_t>> outputs() const {
        return {{q, n / 2}, {qt, n / 2}, {sr, n / 16}, {sc, n / 16}};
    }

    // The kernels' arguments for these buffers (the columnwise ones when `both`).
    Nvfp4Args args(const float* amax_col, bool both) const {
        Nvfp4Args a{};
        a.m = M;
        a.k = K;
        a.amax_row = amax;
        a.amax_col = amax_col;
        a.q_row = q;
        a.s_row = sr;
        a.s_row_cols = sr_cols;
        a.q_col = both ? qt : nullptr;
        a.s_col = both ? sc : nullptr;
        a.s_col_cols = sc_cols;
        return a;
    }

    // The both kernel's grid: 128x128 tiles in bands (banded_grid in
    // crates/quant/src/cuda/mod.rs); band_rows gets the band's height in tiles.
    dim3 both_grid(u64* band_rows = nullptr) const {
        const u64 gx = (M + 127) / 128, gy = (K + 127) / 128;
        u64 h = 1;
        while (h < gx && h < (1u << TQ_BAND_ROWS_LOG2)) h *= 2;
        if (band_rows != nullptr) *band_rows = h;
        return dim3((unsigned)(h * gy), (unsigned)((gx + h - 1) / h));
    }
};
