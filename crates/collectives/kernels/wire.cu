// tessera-collectives kernels: the one move of the wire layout's pack and unpack
// (crates/quant/src/wire.rs) that device copies cannot do — single bytes between a
// compact scale matrix and the GEMM-swizzled scale grid. Every other move of a plan is
// a device-to-device copy or a 2-D strided copy (crates/collectives/src/packing.rs).
//
// `tessera_wire_swizzle`: for i < rows, j < cols, with compact byte c = i * pitch + j
// and grid coordinates (a, b) = (row0 + i, col0 + j), or (col0 + j, row0 + i) when
// `transposed`, the grid byte is g = swizzled_index(a, b, grid_cols):
//   tile = (a / 128) * (grid_cols / 4) + b / 4, r = a % 128,
//   g = tile * 512 + (r % 32) * 16 + (r / 32) * 4 + b % 4
// (TE's gemm_swizzled_scale_idx; `tessera_quant::layout::swizzled_index`).
// `to_grid`: dst[g] = src[c] (unpack); else dst[c] = src[g] (pack). The Rust side
// checks every address against the buffers before launching.
//
// Built with: nvcc -ptx -arch=sm_90 (cargo xtask ptx).

typedef unsigned long long u64;

extern "C" __global__ void __launch_bounds__(256) tessera_wire_swizzle(
    u64 src_addr, u64 dst_addr, u64 rows, u64 cols, u64 pitch, u64 row0, u64 col0,
    u64 grid_cols, int transposed, int to_grid) {
    const unsigned char* __restrict__ src = (const unsigned char*)src_addr;
    unsigned char* __restrict__ dst = (unsigned char*)dst_addr;
    const u64 n = rows * cols;
    const u64 tiles_per_row = grid_cols / 4;
    for (u64 e = (u64)blockIdx.x * blockDim.x + threadIdx.x; e < n;
         e += (u64)gridDim.x * blockDim.x) {
        const u64 i = e / cols;
        const u64 j = e - i * cols;
        const u64 a = transposed ? col0 + j : row0 + i;
        const u64 b = transposed ? row0 + i : col0 + j;
        const u64 r = a % 128;
        const u64 g = ((a / 128) * tiles_per_row + b / 4) * 512 + (r % 32) * 16 + (r / 32) * 4 + b % 4;
        const u64 c = i * pitch + j;
        if (to_grid) {
            dst[g] = src[c];
        } else {
            dst[c] = src[g];
        }
    }
}
