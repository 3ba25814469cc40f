//! The CUDA paths of the quantizers (feature `cuda`): the same bytes as the CPU
//! reference, computed on the device, with no round trip through the host.
//!
//! Quantizers whose scale depends on the whole tensor (FP8 current scaling, NVFP4's
//! global amax) run two passes: an amax pass into a device scalar, then the quantizing
//! kernel, which reads that scalar and computes its scales itself (no launch between the
//! two) and takes its tiles last first, so that it starts on the lines the amax pass
//! read last and L2 still holds (`cta_order` in kernels/common.cuh). The second pass is
//! a programmatic dependent launch (`Order::OverlapAmaxPass`): its CTAs load their tiles
//! while the amax pass finishes. The amax pass itself, and the one-thread kernel that
//! clears its scalar first (`tessera_clear_amaxes`), are programmatic launches too
//! (`Order::WaitFirst`), so nothing in the chain waits for the GPU to drain; the amax
//! pass lets its second pass launch only after its own wait (`pdl_amax_first` in
//! kernels/common.cuh), so the input is complete when the second pass reads it early.
//! An amax reduction across ranks is the one step that reads the amax back to the host
//! (and then the second pass launches the ordinary way).
//!
//! The NVFP4 kernel for 2-byte inputs with compact scales writes them in two steps where
//! that pays ([`Nvfp4Launch`]: on cards whose DRAM is slow for their SMs, for large
//! tensors): each tile's scale bytes into a scratch, whole lines, then a second kernel
//! the grids' rows, instead of 8-byte pieces of 16 CTAs in every line. A launch in thread
//! block clusters, which runs the CTAs sharing a line together, can be chosen instead.
//! With 2-D (16x16) blocks and columnwise data the tile kernel takes two steps from 2^25
//! values on every card and from 2^24 on those cards: each tile's 64 block scale bytes
//! twice (row by row, column by column) into 128 bytes of scratch, then
//! `tessera_nvfp4_scales_2d` writes both grids' whole lines.
//!
//! Dequantizers are one launch each, sized to their work rather than striding: a thread
//! per two 16-byte units of output for data in the output's order
//! (`dequant_units_grid`), a CTA per shared-memory tile for transposed columnwise data,
//! in tiles twice as tall once those fill the card (`DeqColsTiles`).
//!
//! The one-pass kernels (MXFP8 and FP8 block quantization, the FP8 casts with a given
//! scale and the delayed-scaling update, every dequantizer, the layout helpers) are
//! programmatic dependent launches too (`Order::WaitFirst`): they let the next such
//! launch take the SM slots their CTAs free, and they touch memory only after the kernel
//! before them has finished. A run of them (the quantization of several tensors, a
//! quantization and its dequantization) overlaps each launch with the tail of the kernel
//! before instead of leaving the GPU idle between them.
//!
//! Layout: `launch` (the orders and the raw launch), `grid` (launch grids), `buffers`
//! (device addresses, the outputs a quantizer writes, clearing), then a file per
//! format (`fp8`, `mxfp8`, `block`, `nvfp4`) and the layout helpers (`layout`), each
//! with its kernels in `kernels/<name>.cu`.

pub(crate) mod block;
mod buffers;
pub(crate) mod fp8;
mod grid;
mod launch;
pub mod layout;
pub(crate) mod mxfp8;
pub(crate) mod nvfp4;

pub use nvfp4::{Nvfp4Launch, nvfp4_launch, set_nvfp4_launch};

pub(crate) use buffers::{
    Outputs, amax_target, clear_amaxes, dequant_addrs, device_addr, device_addr_mut, device_of,
};
pub(crate) use grid::{
    ColsTile, FP8_DEQ_TILES, NVFP4_DEQ_TILES, banded_grid, banded_grid_padded, dequant_units_grid,
    tile_grid, tiles_64,
};
pub(crate) use launch::{Order, Params, launch_params, max_active_clusters};

use tessera_core::kernels::{PtxModule, Sass};
use tessera_core::{DType, Error, Result};

use crate::Fp8Format;

/// The compiled kernels of `kernels/fp8.cu` (per-tensor FP8, amax, layouts).
pub(crate) const FP8_PTX: PtxModule = PtxModule {
    name: "tessera_quant_fp8",
    ptx: include_str!("../../kernels/ptx/fp8.ptx"),
    sass: Some(Sass {
        cubin: include_bytes!("../../kernels/ptx/fp8.sm_90.cubin"),
        ptx_sha256: include_str!("../../kernels/ptx/fp8.sm_90.cubin.sha256"),
    }),
};

/// The compiled kernels of `kernels/mxfp8.cu`.
pub(crate) const MXFP8_PTX: PtxModule = PtxModule {
    name: "tessera_quant_mxfp8",
    ptx: include_str!("../../kernels/ptx/mxfp8.ptx"),
    sass: Some(Sass {
        cubin: include_bytes!("../../kernels/ptx/mxfp8.sm_90.cubin"),
        ptx_sha256: include_str!("../../kernels/ptx/mxfp8.sm_90.cubin.sha256"),
    }),
};

/// The compiled kernels of `kernels/block.cu`.
pub(crate) const BLOCK_PTX: PtxModule = PtxModule {
    name: "tessera_quant_block",
    ptx: include_str!("../../kernels/ptx/block.ptx"),
    sass: Some(Sass {
        cubin: include_bytes!("../../kernels/ptx/block.sm_90.cubin"),
        ptx_sha256: include_str!("../../kernels/ptx/block.sm_90.cubin.sha256"),
    }),
};

/// The compiled kernels of `kernels/nvfp4.cu`.
pub(crate) const NVFP4_PTX: PtxModule = PtxModule {
    name: "tessera_quant_nvfp4",
    ptx: include_str!("../../kernels/ptx/nvfp4.ptx"),
    sass: Some(Sass {
        cubin: include_bytes!("../../kernels/ptx/nvfp4.sm_90.cubin"),
        ptx_sha256: include_str!("../../kernels/ptx/nvfp4.sm_90.cubin.sha256"),
    }),
};

/// Threads per block of every kernel here (their `__launch_bounds__`).
pub(crate) const BLOCK: u32 = 256;

/// Fails a GPU unit test at once, with how to run it, where no CUDA GPU is present.
#[cfg(test)]
fn require_gpu() {
    assert!(
        tessera_core::cuda::is_available(),
        "this test needs a CUDA GPU; run it with `cargo xtask test-gpu`"
    );
}

/// `f32`, `bf16` or `f16`: the kernel-name suffix of an input dtype.
pub(crate) fn dtype_suffix(op: &'static str, dtype: DType) -> Result<&'static str> {
    match dtype {
        DType::F32 => Ok("f32"),
        DType::BF16 => Ok("bf16"),
        DType::F16 => Ok("f16"),
        other => Err(Error::dtype(op, "f32, bf16 or f16", other)),
    }
}

/// `e4m3` or `e5m2`.
pub(crate) fn format_suffix(f: Fp8Format) -> &'static str {
    f.name()
}

/// Output elements a dequantizing thread writes with one 16-byte store (`DEQ_VALS` in
/// `common.cuh`): 8 of bf16 or f16, 4 of f32.
pub(crate) fn dequant_vals(dtype: DType) -> usize {
    16 / dtype.size_in_bytes()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each embedded cubin was compiled from the PTX embedded beside it.
    #[test]
    fn embedded_sass_is_fresh() {
        for m in [FP8_PTX, MXFP8_PTX, BLOCK_PTX, NVFP4_PTX] {
            m.check_sass_fresh().unwrap();
        }
    }
}
