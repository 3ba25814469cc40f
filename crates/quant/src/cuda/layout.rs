//! Layout helpers on CUDA tensors: byte transpose, `swap_first_dims`, and scale padding
//! strip/restore — the device twins of [`crate::layout`].

use tessera_core::cuda::grid_1d;
use tessera_core::{Error, Result, Shape, Tensor};

use super::{
    BLOCK, FP8_PTX, Order, Params, device_addr, device_addr_mut, device_of, launch_params, tiles_64,
};

/// The transpose of a CUDA tensor viewed as a `[rows, cols]` matrix of elements, as a
/// `[cols, rows]` tensor of the same dtype (1-byte dtypes).
pub fn transpose_bytes(t: &Tensor, rows: usize, cols: usize) -> Result<Tensor> {
    const OP: &str = "cuda transpose";
    if t.dtype().size_in_bytes() != 1 || rows * cols != t.numel() {
        return Err(Error::shape(
            OP,
            format!(
                "a {} tensor of shape {} is not a [{rows}, {cols}] byte matrix",
                t.dtype(),
                t.shape()
            ),
        ));
    }
    let dev = device_of(t)?;
    let mut out = Tensor::empty([cols, rows], t.dtype(), t.device())?;
    let f = dev.function(&FP8_PTX, "tessera_transpose_u8")?;
    let (r, c) = (rows as u64, cols as u64);
    let cfg = tiles_64(rows, cols)?;
    let (src, dst) = (device_addr(&dev, t)?, device_addr_mut(&dev, &mut out)?);
    let mut p = Params::default();
    p.arg(&src).arg(&dst).arg(&r).arg(&c);
    // SAFETY: (const u8* src, u8* dst, u64 rows, u64 cols): both rows*cols bytes; the
    // kernel calls pdl_first() before any memory access.
    unsafe { launch_params(&dev, &f, cfg, OP, Order::WaitFirst, &mut p) }?;
    Ok(out)
}

/// `swap_first_dims` on a CUDA tensor (see [`crate::layout::swap_first_dims`]): `[world·R,
/// c...]` to `[R, world·C]`.
pub fn swap_first_dims(t: &Tensor, world: usize) -> Result<Tensor> {
    const OP: &str = "cuda swap_first_dims";
    let (rows, trailing) = crate::layout::swap_first_dims_geometry(OP, t.shape(), world)?;
    let inner = (trailing * t.dtype().size_in_bytes()) as u64;
    let dev = device_of(t)?;
    let mut out = Tensor::empty(Shape::new([rows, world * trailing]), t.dtype(), t.device())?;
    let f = dev.function(&FP8_PTX, "tessera_swap_first_dims")?;
    let (a, bb) = (world as u64, rows as u64);
    let cfg = grid_1d(&dev, t.size_in_bytes(), BLOCK)?;
    let (src, dst) = (device_addr(&dev, t)?, device_addr_mut(&dev, &mut out)?);
    let mut p = Params::default();
    p.arg(&src).arg(&dst).arg(&a).arg(&bb).arg(&inner);
    // SAFETY: (const u8* src, u8* dst, u64 d0, u64 d1, u64 inner): both d0*d1*inner
    // bytes; the kernel calls pdl_first() before any memory access.
    unsafe { launch_params(&dev, &f, cfg, OP, Order::WaitFirst, &mut p) }?;
    Ok(out)
}

/// Re-pads a CUDA matrix: the valid top-left `[rows, cols]` elements of `t` (viewed as
/// `[*, t_cols]`) copied into a zero-padded `[out_rows, out_cols]` tensor. Strips
/// padding when the output is smaller, restores it (with zeros) when larger.
pub fn repad(
    t: &Tensor,
    rows: usize,
    cols: usize,
    out_rows: usize,
    out_cols: usize,
) -> Result<Tensor> {
    const OP: &str = "cuda repad";
    let dims = t.shape().dims();
    let elem = t.dtype().size_in_bytes();
    let t_cols = if dims.len() == 2 { dims[1] } else { t.numel() };
    if rows > out_rows || cols > out_cols || cols > t_cols || rows * t_cols > t.numel() {
        return Err(Error::shape(
            OP,
            format!(
                "cannot take [{rows}, {cols}] from {} into [{out_rows}, {out_cols}]",
                t.shape()
            ),
        ));
    }
    let dev = device_of(t)?;
    let mut out = Tensor::empty([out_rows, out_cols], t.dtype(), t.device())?;
    let f = dev.function(&FP8_PTX, "tessera_repad")?;
    let args = [
        rows as u64,
        (cols * elem) as u64,
        (t_cols * elem) as u64,
        out_rows as u64,
        (out_cols * elem) as u64,
    ];
    let cfg = grid_1d(&dev, out.size_in_bytes(), BLOCK)?;
    let (src, dst) = (device_addr(&dev, t)?, device_addr_mut(&dev, &mut out)?);
    let mut p = Params::default();
    p.arg(&src).arg(&dst);
    for a in &args {
        p.arg(a);
    }
    // SAFETY: (const u8* src, u8* dst, u64 rows, u64 cols, u64 src_cols, u64 dst_rows,
    // u64 dst_cols) in bytes; src holds rows*src_cols bytes (checked above), dst
    // dst_rows*dst_cols; the kernel calls pdl_first() before any memory access.
    unsafe { launch_params(&dev, &f, cfg, OP, Order::WaitFirst, &mut p) }?;
    Ok(out)
}
