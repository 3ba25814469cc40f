//! FP8 block scaling on the device.

use tessera_core::{Result, Tensor};

use super::{
    BLOCK_PTX, FP8_DEQ_TILES, Order, Outputs, Params, dequant_addrs, dequant_units_grid,
    dequant_vals, device_addr, device_of, dtype_suffix, format_suffix, launch_params, tile_grid,
};
use crate::block::BlockScaling;
use crate::values::check_input;
use crate::{BlockDim, QuantizedTensor};

/// Quantizes `x` into `out` (FP8 block scaling, its usage's buffers), both orientations
/// from one read of the input.
pub(crate) fn quantize_into(
    x: &Tensor,
    p: &BlockScaling,
    dim: BlockDim,
    out: &mut QuantizedTensor,
) -> Result<()> {
    const OP: &str = "cuda fp8 block quantize";
    let (m, k) = check_input(OP, x)?;
    let dev = device_of(x)?;
    // One kernel per mode (kernels/block.cu): rowwise-only 1x128 blocks on 32x128 tiles,
    // 1-D blocks with a columnwise operand and 128x128 blocks with and without one on
    // 128x128 tiles.
    let (mode, tile_rows) = match (dim, out.usage().columnwise()) {
        (BlockDim::TwoD, true) => ("2d", 128),
        (BlockDim::TwoD, false) => ("2d_row", 128),
        (BlockDim::OneD, true) => ("1d", 128),
        (BlockDim::OneD, false) => ("row", 32),
    };
    let f = dev.function(
        &BLOCK_PTX,
        &format!(
            "tessera_fp8_block_{mode}_{}_{}",
            dtype_suffix(OP, x.dtype())?,
            format_suffix(p.format)
        ),
    )?;
    let (mb, kb) = (m.div_ceil(128), k.div_ceil(128));
    let valid = match dim {
        BlockDim::OneD => [[kb, m], [mb, k]],
        BlockDim::TwoD => [[mb, kb], [kb, mb]],
    };
    let o = Outputs::take(&dev, out, OP, valid)?;
    let (s_row_cols, s_col_cols) = (Outputs::dims(&o.s_row)[1], Outputs::dims(&o.s_col)[1]);
    let cfg = tile_grid(OP, m, k, tile_rows, 128)?;
    let (mu, ku) = (m as u64, k as u64);
    let (fp8_max, pow2, eps, vfi, two_d) = (
        p.format.max(),
        i32::from(p.pow2),
        p.eps,
        p.value_for_inf,
        i32::from(dim == BlockDim::TwoD),
    );
    // An empty input has nothing to write: every buffer, the scale grids too, is empty
    // (block.rs `scale_shapes`).
    o.launch_and_put_back(&dev, out, m == 0 || k == 0, |[qr, sr, qc, sc]| {
        let xa = device_addr(&dev, x)?;
        let mut params = Params::default();
        params
            .arg(&xa)
            .arg(&mu)
            .arg(&ku)
            .arg(&fp8_max)
            .arg(&pow2)
            .arg(&eps)
            .arg(&vfi)
            .arg(&two_d);
        params.arg(&qr).arg(&sr).arg(&s_row_cols);
        params.arg(&qc).arg(&sc).arg(&s_col_cols);
        // SAFETY: (const T* x, u64 m, u64 k, float fp8_max, int pow2, float eps, float
        // value_for_inf, int two_d, u8* q_row, float* s_row, u64 s_row_cols, u8* q_col,
        // float* s_col, u64 s_col_cols): x is [m, k], q_row [m, k] bytes, q_col [k, m]
        // bytes, the scale buffers their padded grids (f32), or null (0); the kernels
        // call pdl_first() before any memory access.
        unsafe { launch_params(&dev, &f, cfg, OP, Order::WaitFirst, &mut params) }
    })?;
    out.source_dtype = x.dtype();
    Ok(())
}

/// Dequantizes one orientation of an FP8-block CUDA tensor into `dtype`.
pub(crate) fn dequantize(
    qt: &QuantizedTensor,
    format: crate::Fp8Format,
    dim: BlockDim,
    columnwise: bool,
    y: &mut Tensor,
) -> Result<()> {
    let dtype = y.dtype();
    const OP: &str = "cuda fp8 block dequantize";
    let (m, k) = qt.shape().flat_2d();
    let (q, s) = qt.data_and_scales(columnwise)?;
    let dev = device_of(q)?;
    // Columnwise a CTA per tile of the stored [k, m], 64 or 128 rows by 256 bytes by
    // shape; rowwise two units a thread (each striding per element where the stored rows
    // do not split into vectors).
    let tile = columnwise.then(|| FP8_DEQ_TILES.pick(m, k, dev.multiprocessors() as usize));
    let f = dev.function(
        &BLOCK_PTX,
        &format!(
            "tessera_fp8_block_dequant_{}{}_{}",
            tile.map_or("", |t| t.infix()),
            dtype_suffix(OP, dtype)?,
            format_suffix(format)
        ),
    )?;
    let mode: i32 = match (dim, columnwise) {
        (BlockDim::OneD, false) => 0,
        (BlockDim::OneD, true) => 1,
        (BlockDim::TwoD, false) => 2,
        (BlockDim::TwoD, true) => 3,
    };
    let a = [m as u64, k as u64, s.shape().dims()[1] as u64];
    let cfg = match tile {
        Some(tile) => FP8_DEQ_TILES.grid(m, k, tile)?,
        None => dequant_units_grid((m * k).div_ceil(dequant_vals(dtype)))?,
    };
    let [qa, sa, ya] = dequant_addrs(&dev, q, s, y)?;
    let mut p = Params::default();
    p.arg(&qa).arg(&sa).arg(&ya);
    p.arg(&a[0]).arg(&a[1]).arg(&a[2]).arg(&mode);
    // SAFETY: (const u8* q, const float* s, T* y, u64 m, u64 k, u64 s_cols, int mode): q
    // holds m*k bytes in its stored orientation, s its padded grid, y m*k elements; the
    // kernel calls pdl_first() before any memory access.
    unsafe { launch_params(&dev, &f, cfg, OP, Order::WaitFirst, &mut p) }
}
