//! MXFP8 on the device.

use tessera_core::{Result, Tensor};

use super::{
    MXFP8_PTX, Order, Outputs, Params, dequant_addrs, dequant_units_grid, dequant_vals,
    device_addr, device_of, dtype_suffix, format_suffix, launch_params, tile_grid,
};
use crate::values::check_input;
use crate::{Fp8Format, QuantizedTensor};

/// Quantizes `x` into `out` (MXFP8, its usage's buffers), both orientations from one
/// read of the input.
pub(crate) fn quantize_into(
    x: &Tensor,
    format: Fp8Format,
    two_d: bool,
    swizzled: bool,
    out: &mut QuantizedTensor,
) -> Result<()> {
    const OP: &str = "cuda mxfp8 quantize";
    let (m, k) = check_input(OP, x)?;
    let dev = device_of(x)?;
    // One kernel per mode (kernels/mxfp8.cu): rowwise-only 1-D on 32x128 CTA tiles, 1-D
    // with a columnwise operand and 32x32 tiles on warp tiles (64x256 per CTA).
    let (mode, tm, tk) = match (two_d, out.usage().columnwise()) {
        (true, _) => ("2d_", 64, 256),
        (false, true) => ("", 64, 256),
        (false, false) => ("row_", 32, 128),
    };
    let f = dev.function(
        &MXFP8_PTX,
        &format!(
            "tessera_mxfp8_{mode}{}_{}",
            dtype_suffix(OP, x.dtype())?,
            format_suffix(format)
        ),
    )?;
    let o = Outputs::take(&dev, out, OP, [[m, k / 32], [m / 32, k]])?;
    let s_row_cols = Outputs::dims(&o.s_row)[1];
    let [s_col_rows, s_col_cols] = Outputs::dims(&o.s_col);
    let cfg = tile_grid(OP, m, k, tm, tk)?;
    let (mu, ku) = (m as u64, k as u64);
    let (two_d, swz) = (i32::from(two_d), i32::from(swizzled));
    let max_rcp = format.max_rcp();
    // An empty input has nothing to write: every buffer, the scale grids too, is empty
    // (mxfp8.rs `scale_shapes`).
    o.launch_and_put_back(&dev, out, m == 0 || k == 0, |[qr, sr, qc, sc]| {
        let xa = device_addr(&dev, x)?;
        let mut params = Params::default();
        params.arg(&xa).arg(&mu).arg(&ku).arg(&max_rcp);
        params.arg(&qr).arg(&sr).arg(&s_row_cols);
        params.arg(&qc).arg(&sc).arg(&s_col_rows).arg(&s_col_cols);
        params.arg(&two_d).arg(&swz);
        // SAFETY: (const T* x, u64 m, u64 k, float max_rcp, u8* q_row, u8* s_row, u64
        // s_row_cols, u8* q_col, u8* s_col, u64 s_col_rows, u64 s_col_cols, int two_d,
        // int swizzled): x is [m, k] with m, k multiples of 32 (checked by the
        // quantizer), the data buffers [m, k] bytes, the scale buffers their padded
        // grids, or null (0); the kernels call pdl_first() before any memory access.
        unsafe { launch_params(&dev, &f, cfg, OP, Order::WaitFirst, &mut params) }
    })?;
    out.source_dtype = x.dtype();
    Ok(())
}

/// Dequantizes one orientation of an MXFP8 CUDA tensor into `dtype`.
pub(crate) fn dequantize(
    qt: &QuantizedTensor,
    format: Fp8Format,
    swizzled: bool,
    columnwise: bool,
    y: &mut Tensor,
) -> Result<()> {
    let dtype = y.dtype();
    const OP: &str = "cuda mxfp8 dequantize";
    let (m, k) = qt.shape().flat_2d();
    let (q, s) = qt.data_and_scales(columnwise)?;
    let dev = device_of(q)?;
    let f = dev.function(
        &MXFP8_PTX,
        &format!(
            "tessera_mxfp8_dequant_{}_{}",
            dtype_suffix(OP, dtype)?,
            format_suffix(format)
        ),
    )?;
    let a = [
        m as u64,
        k as u64,
        s.shape().dims()[0] as u64,
        s.shape().dims()[1] as u64,
    ];
    let (col, swz) = (i32::from(columnwise), i32::from(swizzled));
    // Units of 16 bytes of output, two a thread (k % 32 == 0: whole units).
    let cfg = dequant_units_grid(m * k / dequant_vals(dtype))?;
    let [qa, sa, ya] = dequant_addrs(&dev, q, s, y)?;
    let mut p = Params::default();
    p.arg(&qa).arg(&sa).arg(&ya);
    p.arg(&a[0]).arg(&a[1]).arg(&a[2]).arg(&a[3]);
    p.arg(&col).arg(&swz);
    // SAFETY: (const u8* q, const u8* s, T* y, u64 m, u64 k, u64 s_rows, u64 s_cols, int
    // col, int swizzled): q [m, k], s its padded grid, y [m, k] of T; the kernel calls
    // pdl_first() before any memory access.
    unsafe { launch_params(&dev, &f, cfg, OP, Order::WaitFirst, &mut p) }
}
