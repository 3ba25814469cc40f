//! The arithmetic both runs share: GEMMs, LayerNorm, GeLU, dropout masks, row and
//! column blocks, bf16 rounding — on the CPU, or on a CUDA device for CUDA tensors.
//!
//! Every function works on `f32` tensors of rank 2 (`[rows, cols]`) and returns a typed
//! [`Error`] for shapes that do not fit. The element-wise functions are the same code in
//! the distributed run and in the reference, so the two differ only where a sum is split
//! differently (see the [module docs](super)).
//!
//! # Devices
//!
//! A function's inputs decide where it runs: host tensors on the CPU (GEMMs through the
//! `gemm` crate), CUDA tensors on their device (feature `cuda`: GEMMs through cuBLAS,
//! the rest through `kernels/demo.cu`, module `gpu`). Apart from the GEMMs the two give
//! the same bits: the kernels round every operation like this file does, `exp` is the
//! demo's own ([`exp`]) rather than either platform's, and every row sum runs in one
//! fixed order ([`warp_sum`]) that a CUDA warp computes naturally. A GEMM's sums are
//! blocked differently by the two libraries, so a CPU run and a GPU run of the demo
//! agree to f32 rounding, while two runs on one device agree to the bit.

use tessera_core::{DType, Device, Error, Result, Shape, Tensor};
use tessera_rng::stream::dropout_scale;
use tessera_rng::with_current_generator;

#[cfg(feature = "cuda")]
use super::gpu;

/// `$cuda` where the build has CUDA; otherwise an error for the CUDA tensor `$t`
/// (without the feature no CUDA tensor can exist, so this is never reached).
#[cfg(feature = "cuda")]
macro_rules! on_cuda {
    ($t:expr, $cuda:expr) => {
        $cuda
    };
}
#[cfg(not(feature = "cuda"))]
macro_rules! on_cuda {
    ($t:expr, $cuda:expr) => {
        Err(Error::device(
            "tessera demo",
            "cpu (this build has no `cuda` feature)",
            $t.device(),
        ))
    };
}

/// `(rows, cols)` of a matrix, or an error naming `op`.
pub(crate) fn dims2(op: &'static str, t: &Tensor) -> Result<(usize, usize)> {
    match t.shape().dims() {
        &[r, c] => Ok((r, c)),
        _ => Err(Error::shape(
            op,
            format!("expected a matrix, got shape {}", t.shape()),
        )),
    }
}

fn matrix(v: &[f32], rows: usize, cols: usize) -> Result<Tensor> {
    Tensor::from_slice(v, [rows, cols], Device::Cpu)
}

/// A new f32 host tensor of `shape` whose every value `fill` writes (no copy through a
/// temporary vector).
fn build(shape: impl Into<Shape>, fill: impl FnOnce(&mut [f32]) -> Result<()>) -> Result<Tensor> {
    let mut t = Tensor::empty(shape, DType::F32, Device::Cpu)?;
    fill(t.as_mut_slice::<f32>()?)?;
    Ok(t)
}

/// An error unless `t` is an f32 tensor.
fn f32_only(op: &'static str, t: &Tensor) -> Result<()> {
    t.expect_dtype(op, DType::F32)
}

/// `op(a) · op(b)` in f32, where `op(x)` is `xᵀ` when its flag is set: `a` is `[m, k]`
/// (`[k, m]` transposed), `b` is `[k, n]` (`[n, k]` transposed), the result `[m, n]`.
///
/// On the CPU the product runs through [`gemm::gemm`] on one thread (the ranks are
/// threads already); on a GPU through cuBLAS. Transposes are strides, never copies.
pub(crate) fn matmul(a: &Tensor, ta: bool, b: &Tensor, tb: bool) -> Result<Tensor> {
    const OP: &str = "matmul";
    let (ar, ac) = dims2(OP, a)?;
    let (br, bc) = dims2(OP, b)?;
    let (m, k) = if ta { (ac, ar) } else { (ar, ac) };
    let (k2, n) = if tb { (bc, br) } else { (br, bc) };
    if k != k2 {
        return Err(Error::shape(
            OP,
            format!(
                "cannot multiply {}{} by {}{}: inner sizes {k} and {k2} differ",
                a.shape(),
                if ta { "ᵀ" } else { "" },
                b.shape(),
                if tb { "ᵀ" } else { "" },
            ),
        ));
    }
    f32_only(OP, a)?;
    f32_only(OP, b)?;
    if a.device().is_cuda() {
        return on_cuda!(a, gpu::matmul(a, ta, b, tb, m, n, k));
    }
    let (av, bv) = (a.as_slice::<f32>()?, b.as_slice::<f32>()?);
    build([m, n], |out| {
        gemm_f32(m, n, k, av, ta, bv, tb, out);
        Ok(())
    })
}
/// `out[m, n] = op(a) · op(b)` for row-major slices whose lengths [`matmul`] checked.
#[allow(clippy::too_many_arguments)]
fn gemm_f32(
    m: usize,
    n: usize,
    k: usize,
    a: &[f32],
    ta: bool,
    b: &[f32],
    tb: bool,
    out: &mut [f32],
) {
    assert!(a.len() == m * k && b.len() == k * n && out.len() == m * n);
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        out.fill(0.0);
        return;
    }
    // Element (i, p) of op(a) lives at i·rs + p·cs.
    let (a_rs, a_cs) = if ta { (1, m) } else { (k, 1) };
    let (b_rs, b_cs) = if tb { (1, k) } else { (n, 1) };
    // SAFETY: `gemm` reads op(a) at `i·a_rs + p·a_cs` for i < m, p < k — the largest
    // offset is (m-1)·k + (k-1) < m·k = a.len() untransposed and (k-1)·m + (m-1) <
    // a.len() transposed; op(b) likewise within b.len() = k·n; it writes `out` at
    // `i·n + j` for i < m, j < n, within out.len() = m·n. The three slices are distinct
    // borrows (out is the only mutable one), so nothing aliases. `read_dst` is false, so
    // out's previous contents are not read and `alpha` is unused; `beta = 1` gives the
    // plain product. All strides fit `isize` because the slices exist.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            out.as_mut_ptr(),
            1,
            n as isize,
            false,
            a.as_ptr(),
            a_cs as isize,
            a_rs as isize,
            b.as_ptr(),
            b_cs as isize,
            b_rs as isize,
            0.0,
            1.0,
            false,
            false,
            false,
            gemm::Parallelism::None,
        );
    }
}

fn same_shape(op: &'static str, a: &Tensor, b: &Tensor) -> Result<()> {
    if a.shape() != b.shape() {
        return Err(Error::shape(
            op,
            format!("shapes {} and {} differ", a.shape(), b.shape()),
        ));
    }
    Ok(())
}

/// `out[i] = f(a[i], b[i])` for two host tensors of one shape.
fn zip_map<T: tessera_core::Element>(
    a: &Tensor,
    b: &Tensor,
    f: impl Fn(f32, T) -> f32,
) -> Result<Tensor> {
    let (av, bv) = (a.as_slice::<f32>()?, b.as_slice::<T>()?);
    build(a.shape(), |out| {
        for ((o, &x), &y) in out.iter_mut().zip(av).zip(bv) {
            *o = f(x, y);
        }
        Ok(())
    })
}

/// `a + b`.
pub(crate) fn add(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    same_shape("add", a, b)?;
    f32_only("add", a)?;
    f32_only("add", b)?;
    if a.device().is_cuda() {
        return on_cuda!(a, gpu::add(a, b));
    }
    zip_map(a, b, |x, y: f32| x + y)
}

const SQRT_2_OVER_PI: f32 = 0.797_884_6;
const GELU_C: f32 = 0.044_715;

/// `e^x`, computed the same way on the CPU and in `kernels/demo.cu` (`demo_exp`), so
/// GeLU gives the same bits on both: `x = n·ln 2 + r` with `|r| ≤ ln 2 / 2` (Cody and
/// Waite's two-part `ln 2`), `e^r` by a degree-7 polynomial (Cephes' `expf`
/// coefficients, relative error below 2 ulp), scaled by `2^n` through its exponent
/// bits. Below −87 the result is 0 and above 88 it is +∞, which keeps `2^n` normal.
pub(crate) fn exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    if x.is_nan() {
        return x;
    }
    if x > 88.0 {
        return f32::INFINITY;
    }
    if x < -87.0 {
        return 0.0;
    }
    let n = (x * LOG2E).round_ties_even();
    let r = x - n * LN2_HI - n * LN2_LO;
    let mut p = 1.987_569_1e-4_f32;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    // Cephes' last coefficient, 5.0000001201e-1, is 0.5 in f32.
    p = p * r + 0.5;
    p = p * r * r + r + 1.0;
    // n is an integer in [-126, 127] here, so the biased exponent is in [1, 254].
    p * f32::from_bits(((n as i32 + 127) as u32) << 23)
}

/// `tanh(u) = 1 - 2/(e^{2u} + 1)`: one [`exp`], saturating to ±1.
#[inline]
fn tanh(u: f32) -> f32 {
    1.0 - 2.0 / (exp(2.0 * u) + 1.0)
}

/// The sum of `values` in the order of one 32-lane CUDA warp: lane `l` adds the values
/// at `l, l + 32, ...` in order, then a butterfly adds lane `i`'s sum to lane
/// `i ^ 16`'s, then `i ^ 8`'s, down to `i ^ 1`'s (every lane ends with one and the same
/// value, since `a + b == b + a`). `kernels/demo.cu` sums a row this way.
pub(crate) fn warp_sum(values: impl IntoIterator<Item = f32>) -> f32 {
    let mut lanes = [0.0f32; 32];
    for (j, v) in values.into_iter().enumerate() {
        lanes[j % 32] += v;
    }
    let mut off = 16;
    while off > 0 {
        let prev = lanes;
        for (i, lane) in lanes.iter_mut().enumerate() {
            *lane = prev[i] + prev[i ^ off];
        }
        off /= 2;
    }
    lanes[0]
}

/// GeLU, tanh approximation (TE's `gelu`): `0.5·a·(1 + tanh(√(2/π)·(a + 0.044715·a³)))`.
pub(crate) fn gelu(a: &Tensor) -> Result<Tensor> {
    f32_only("gelu", a)?;
    if a.device().is_cuda() {
        return on_cuda!(a, gpu::gelu(a));
    }
    let av = a.as_slice::<f32>()?;
    build(a.shape(), |out| {
        for (o, &x) in out.iter_mut().zip(av) {
            *o = 0.5 * x * (1.0 + tanh(SQRT_2_OVER_PI * (x + GELU_C * x * x * x)));
        }
        Ok(())
    })
}

/// `dg · gelu'(a)`.
pub(crate) fn gelu_backward(a: &Tensor, dg: &Tensor) -> Result<Tensor> {
    same_shape("gelu_backward", dg, a)?;
    f32_only("gelu_backward", a)?;
    f32_only("gelu_backward", dg)?;
    if a.device().is_cuda() {
        return on_cuda!(a, gpu::gelu_backward(a, dg));
    }
    zip_map(dg, a, |d, x: f32| {
        let t = tanh(SQRT_2_OVER_PI * (x + GELU_C * x * x * x));
        let dt = (1.0 - t * t) * SQRT_2_OVER_PI * (1.0 + 3.0 * GELU_C * x * x);
        d * (0.5 * (1.0 + t) + 0.5 * x * dt)
    })
}

/// LayerNorm's epsilon (TE's default).
pub(crate) const LN_EPS: f32 = 1e-5;

/// What LayerNorm's backward needs besides its input: per-row mean and `1/σ`.
#[derive(Debug, Clone)]
pub(crate) struct LnStats {
    /// `[rows]` means.
    pub(crate) mean: Tensor,
    /// `[rows]` reciprocal standard deviations.
    pub(crate) rstd: Tensor,
}

impl LnStats {
    /// The statistics of rows `range`.
    pub(crate) fn rows(&self, range: std::ops::Range<usize>) -> Result<LnStats> {
        let column = |t: &Tensor| -> Result<Tensor> {
            let n = t.numel();
            rows(&t.reshape([n, 1])?, range.clone())?.reshape([range.len()])
        };
        Ok(LnStats {
            mean: column(&self.mean)?,
            rstd: column(&self.rstd)?,
        })
    }
}

/// `γ` and `β` of `h` elements each, or an error.
fn check_affine(op: &'static str, h: usize, gamma: &Tensor, beta: Option<&Tensor>) -> Result<()> {
    let bad = |t: &Tensor| t.numel() != h || t.dtype() != DType::F32;
    if bad(gamma) || beta.is_some_and(bad) {
        return Err(Error::shape(
            op,
            format!(
                "γ and β must be f32 vectors of {h} elements, got {} {}{}",
                gamma.dtype(),
                gamma.shape(),
                beta.map_or(String::new(), |b| format!(
                    " and {} {}",
                    b.dtype(),
                    b.shape()
                ))
            ),
        ));
    }
    Ok(())
}

/// LayerNorm over the last dimension: `z = (x - μ)/σ · γ + β`, with the row statistics
/// (each row's sums in [`warp_sum`]'s order).
pub(crate) fn layernorm(x: &Tensor, gamma: &Tensor, beta: &Tensor) -> Result<(Tensor, LnStats)> {
    const OP: &str = "layernorm";
    let (rows, h) = dims2(OP, x)?;
    f32_only(OP, x)?;
    check_affine(OP, h, gamma, Some(beta))?;
    let inv_h = 1.0 / h as f32;
    if x.device().is_cuda() {
        return on_cuda!(x, {
            let (z, mean, rstd) = gpu::layernorm(x, gamma, beta, rows, h, inv_h, LN_EPS)?;
            Ok((z, LnStats { mean, rstd }))
        });
    }
    let (g, b) = (gamma.as_slice::<f32>()?, beta.as_slice::<f32>()?);
    let xv = x.as_slice::<f32>()?;
    let mut z = vec![0.0f32; rows * h];
    let mut mean = vec![0.0f32; rows];
    let mut rstd = vec![0.0f32; rows];
    for i in 0..rows {
        let row = &xv[i * h..(i + 1) * h];
        let mu = warp_sum(row.iter().copied()) * inv_h;
        let var = warp_sum(row.iter().map(|v| (v - mu) * (v - mu))) * inv_h;
        let r = 1.0 / (var + LN_EPS).sqrt();
        for (j, (o, &v)) in z[i * h..(i + 1) * h].iter_mut().zip(row).enumerate() {
            *o = (v - mu) * r * g[j] + b[j];
        }
        mean[i] = mu;
        rstd[i] = r;
    }
    Ok((
        matrix(&z, rows, h)?,
        LnStats {
            mean: Tensor::from_slice(&mean, [rows], Device::Cpu)?,
            rstd: Tensor::from_slice(&rstd, [rows], Device::Cpu)?,
        },
    ))
}

/// LayerNorm's backward from the output gradient `dz`: `(dx, dγ, dβ)`, where `dγ` and
/// `dβ` (`[h]` each) are summed over this call's rows, in row order.
pub(crate) fn layernorm_backward(
    dz: &Tensor,
    x: &Tensor,
    stats: &LnStats,
    gamma: &Tensor,
) -> Result<(Tensor, Tensor, Tensor)> {
    const OP: &str = "layernorm_backward";
    same_shape(OP, dz, x)?;
    let (rows, h) = dims2(OP, x)?;
    f32_only(OP, x)?;
    f32_only(OP, dz)?;
    check_affine(OP, h, gamma, None)?;
    if stats.mean.numel() != rows || stats.rstd.numel() != rows {
        return Err(Error::shape(
            OP,
            format!(
                "the statistics need {rows} rows, got {} and {}",
                stats.mean.numel(),
                stats.rstd.numel()
            ),
        ));
    }
    let inv_h = 1.0 / h as f32;
    if x.device().is_cuda() {
        return on_cuda!(
            x,
            gpu::layernorm_backward(dz, x, &stats.mean, &stats.rstd, gamma, rows, h, inv_h)
        );
    }
    let (xv, dzv, g) = (
        x.as_slice::<f32>()?,
        dz.as_slice::<f32>()?,
        gamma.as_slice::<f32>()?,
    );
    let (mean, rstd) = (stats.mean.as_slice::<f32>()?, stats.rstd.as_slice::<f32>()?);
    let mut dx = vec![0.0f32; rows * h];
    let mut dgamma = vec![0.0f32; h];
    let mut dbeta = vec![0.0f32; h];
    let mut xhat = vec![0.0f32; h];
    let mut dxhat = vec![0.0f32; h];
    for i in 0..rows {
        let (mu, r) = (mean[i], rstd[i]);
        let (row, drow) = (&xv[i * h..(i + 1) * h], &dzv[i * h..(i + 1) * h]);
        for j in 0..h {
            xhat[j] = (row[j] - mu) * r;
            dgamma[j] += drow[j] * xhat[j];
            dbeta[j] += drow[j];
            dxhat[j] = drow[j] * g[j];
        }
        let c1 = warp_sum(dxhat.iter().zip(&xhat).map(|(d, x)| d * x)) * inv_h;
        let c2 = warp_sum(dxhat.iter().copied()) * inv_h;
        for j in 0..h {
            dx[i * h + j] = r * (dxhat[j] - c2 - xhat[j] * c1);
        }
    }
    Ok((
        matrix(&dx, rows, h)?,
        Tensor::from_slice(&dgamma, [h], Device::Cpu)?,
        Tensor::from_slice(&dbeta, [h], Device::Cpu)?,
    ))
}

/// A dropout mask of `shape` (u8, 1 = kept) on `device`, drawn from the calling
/// thread's current generator of that device exactly as
/// [`Generator::dropout_tensor`](tessera_rng::Generator::dropout_tensor) draws it (the
/// generator advances by the same words on either device).
pub(crate) fn draw_mask(shape: [usize; 2], p: f32, device: Device) -> Result<Tensor> {
    let zeros = Tensor::zeros(shape, DType::F32, device)?;
    let (_, mask) = with_current_generator(device, |g| g.dropout_tensor(&zeros, p))??;
    Ok(mask)
}

/// Dropout with a given mask (1 = kept): `x · 1/(1-p)` where kept, 0 elsewhere — the
/// forward, and also the backward (the same map of the output gradient).
pub(crate) fn apply_mask(x: &Tensor, mask: &Tensor, p: f32) -> Result<Tensor> {
    const OP: &str = "apply_mask";
    same_shape(OP, x, mask)?;
    f32_only(OP, x)?;
    mask.expect_dtype(OP, DType::U8)?;
    let scale = dropout_scale(p);
    if x.device().is_cuda() {
        return on_cuda!(x, gpu::apply_mask(x, mask, scale));
    }
    zip_map(x, mask, |v, m: u8| if m == 1 { v * scale } else { 0.0 })
}

/// Rows `range` of a matrix (any dtype), as a new contiguous matrix.
pub(crate) fn rows(t: &Tensor, range: std::ops::Range<usize>) -> Result<Tensor> {
    let (r, c) = dims2("rows", t)?;
    if range.start > range.end || range.end > r {
        return Err(Error::shape(
            "rows",
            format!("rows {range:?} of a matrix of shape {}", t.shape()),
        ));
    }
    if t.device().is_cuda() {
        return on_cuda!(t, {
            let mut out = Tensor::empty([range.len(), c], t.dtype(), t.device())?;
            gpu::copy2d(&mut out, 0, c, t, range.start * c, c, range.len(), c)?;
            Ok(out)
        });
    }
    let e = t.dtype().size_in_bytes();
    let bytes = &t.as_bytes()?[range.start * c * e..range.end * c * e];
    Tensor::from_bytes(bytes, [range.len(), c], t.dtype(), Device::Cpu)
}

/// Columns `block·width .. (block+1)·width` of a matrix, as a contiguous `[rows, width]`
/// matrix (tensor-parallel rank `block`'s part of a column-split operand).
pub(crate) fn col_block(t: &Tensor, block: usize, width: usize) -> Result<Tensor> {
    const OP: &str = "col_block";
    let (r, c) = dims2(OP, t)?;
    let start = block * width;
    if width == 0 || start + width > c {
        return Err(Error::shape(
            OP,
            format!(
                "column block {block} of width {width} of a matrix of shape {}",
                t.shape()
            ),
        ));
    }
    if t.device().is_cuda() {
        return on_cuda!(t, {
            let mut out = Tensor::empty([r, width], t.dtype(), t.device())?;
            gpu::copy2d(&mut out, 0, width, t, start, c, r, width)?;
            Ok(out)
        });
    }
    let e = t.dtype().size_in_bytes();
    let v = t.as_bytes()?;
    let mut out = Vec::with_capacity(r * width * e);
    for i in 0..r {
        out.extend_from_slice(&v[(i * c + start) * e..(i * c + start + width) * e]);
    }
    Tensor::from_bytes(&out, [r, width], t.dtype(), Device::Cpu)
}

/// Checks that `blocks` are matrices of one dtype and device, with the same rows
/// (`same_rows`) or the same columns; returns each block's `(rows, cols)`.
fn check_blocks(
    op: &'static str,
    blocks: &[Tensor],
    same_rows: bool,
) -> Result<Vec<(usize, usize)>> {
    let Some(first) = blocks.first() else {
        return Err(Error::invalid(op, "nothing to concatenate"));
    };
    let (r0, c0) = dims2(op, first)?;
    let mut dims = Vec::with_capacity(blocks.len());
    for b in blocks {
        let (br, bc) = dims2(op, b)?;
        if same_rows && br != r0 {
            return Err(Error::shape(
                op,
                format!("blocks of {br} and {r0} rows cannot sit side by side"),
            ));
        }
        if !same_rows && bc != c0 {
            return Err(Error::shape(
                op,
                format!("blocks of {bc} and {c0} columns cannot be stacked"),
            ));
        }
        if b.dtype() != first.dtype() {
            return Err(Error::dtype(op, first.dtype().name(), b.dtype()));
        }
        if b.device() != first.device() {
            return Err(Error::device(op, first.device().to_string(), b.device()));
        }
        dims.push((br, bc));
    }
    Ok(dims)
}

/// The matrices side by side (the inverse of [`col_block`]); all need the same rows,
/// dtype and device.
pub(crate) fn concat_cols(blocks: &[Tensor]) -> Result<Tensor> {
    const OP: &str = "concat_cols";
    let dims = check_blocks(OP, blocks, true)?;
    let r = dims[0].0;
    let c: usize = dims.iter().map(|d| d.1).sum();
    let (dtype, device) = (blocks[0].dtype(), blocks[0].device());
    if device.is_cuda() {
        return on_cuda!(blocks[0], {
            let mut out = Tensor::empty([r, c], dtype, device)?;
            let mut at = 0;
            for (b, &(_, w)) in blocks.iter().zip(&dims) {
                gpu::copy2d(&mut out, at, c, b, 0, w, r, w)?;
                at += w;
            }
            Ok(out)
        });
    }
    let e = dtype.size_in_bytes();
    let slices = blocks
        .iter()
        .map(Tensor::as_bytes)
        .collect::<Result<Vec<_>>>()?;
    let mut out = Vec::with_capacity(r * c * e);
    for i in 0..r {
        for (s, &(_, w)) in slices.iter().zip(&dims) {
            out.extend_from_slice(&s[i * w * e..(i + 1) * w * e]);
        }
    }
    Tensor::from_bytes(&out, [r, c], dtype, Device::Cpu)
}

/// The matrices stacked (row blocks, in order); all need the same columns, dtype and
/// device.
pub(crate) fn concat_rows(blocks: &[Tensor]) -> Result<Tensor> {
    const OP: &str = "concat_rows";
    let dims = check_blocks(OP, blocks, false)?;
    let c = dims[0].1;
    let r: usize = dims.iter().map(|d| d.0).sum();
    let (dtype, device) = (blocks[0].dtype(), blocks[0].device());
    if device.is_cuda() {
        return on_cuda!(blocks[0], {
            let mut out = Tensor::empty([r, c], dtype, device)?;
            let mut at = 0;
            for (b, &(br, _)) in blocks.iter().zip(&dims) {
                gpu::copy2d(&mut out, at * c, c, b, 0, c, br, c)?;
                at += br;
            }
            Ok(out)
        });
    }
    let mut out = Vec::with_capacity(r * c * dtype.size_in_bytes());
    for b in blocks {
        out.extend_from_slice(b.as_bytes()?);
    }
    Tensor::from_bytes(&out, [r, c], dtype, Device::Cpu)
}

/// The values of `x` rounded to bf16 (round to nearest even), as a bf16 tensor.
pub(crate) fn to_bf16(x: &Tensor) -> Result<Tensor> {
    f32_only("to_bf16", x)?;
    if x.device().is_cuda() {
        return on_cuda!(x, gpu::to_bf16(x));
    }
    Tensor::from_f32_values(x.as_slice::<f32>()?, x.shape(), DType::BF16, Device::Cpu)
}

/// A bf16 (or f32) tensor's values as f32.
pub(crate) fn to_f32(x: &Tensor) -> Result<Tensor> {
    match x.dtype() {
        DType::F32 => Ok(x.clone()),
        DType::BF16 if x.device().is_cuda() => on_cuda!(x, gpu::bf16_to_f32(x)),
        DType::BF16 => Tensor::from_slice(&x.to_f32_vec()?, x.shape(), Device::Cpu),
        other => Err(Error::dtype("to_f32", "f32 or bf16", other)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(v: &[f32], r: usize, c: usize) -> Tensor {
        matrix(v, r, c).unwrap()
    }

    #[test]
    fn matmul_honours_transposes() {
        // a = [[1, 2, 3], [4, 5, 6]], b = [[1, 0], [0, 1], [1, 1]]
        let a = t(&[1., 2., 3., 4., 5., 6.], 2, 3);
        let b = t(&[1., 0., 0., 1., 1., 1.], 3, 2);
        let ab = [4., 5., 10., 11.];
        assert_eq!(
            matmul(&a, false, &b, false)
                .unwrap()
                .to_vec::<f32>()
                .unwrap(),
            ab
        );
        let at = t(&[1., 4., 2., 5., 3., 6.], 3, 2);
        let bt = t(&[1., 0., 1., 0., 1., 1.], 2, 3);
        assert_eq!(
            matmul(&at, true, &b, false)
                .unwrap()
                .to_vec::<f32>()
                .unwrap(),
            ab
        );
        assert_eq!(
            matmul(&a, false, &bt, true)
                .unwrap()
                .to_vec::<f32>()
                .unwrap(),
            ab
        );
        assert_eq!(
            matmul(&at, true, &bt, true)
                .unwrap()
                .to_vec::<f32>()
                .unwrap(),
            ab
        );
        let err = matmul(&a, false, &a, false).unwrap_err();
        assert!(err.to_string().contains("inner sizes 3 and 2"), "{err}");
    }

    #[test]
    fn layernorm_backward_matches_finite_differences() {
        let x = t(&[0.3, -1.2, 2.0, 0.7, 1.5, -0.4, 0.1, 0.9], 2, 4);
        let gamma = Tensor::from_slice(&[1.0f32, 0.5, -1.0, 2.0], [4], Device::Cpu).unwrap();
        let beta = Tensor::from_slice(&[0.0f32, 0.1, 0.2, 0.3], [4], Device::Cpu).unwrap();
        let w = [0.5f32, -1.0, 0.25, 2.0, 1.0, 0.3, -0.7, 0.2];
        let f = |x: &Tensor| -> f64 {
            let (z, _) = layernorm(x, &gamma, &beta).unwrap();
            z.as_slice::<f32>()
                .unwrap()
                .iter()
                .zip(&w)
                .map(|(a, b)| f64::from(a * b))
                .sum()
        };
        let (_, stats) = layernorm(&x, &gamma, &beta).unwrap();
        let dz = t(&w, 2, 4);
        let (dx, _, dbeta) = layernorm_backward(&dz, &x, &stats, &gamma).unwrap();
        assert_eq!(dbeta.to_vec::<f32>().unwrap(), [1.5, -0.7, -0.45, 2.2]);
        for i in 0..8 {
            let mut xp = x.to_vec::<f32>().unwrap();
            let h = 1e-3;
            xp[i] += h;
            let up = f(&t(&xp, 2, 4));
            xp[i] -= 2.0 * h;
            let down = f(&t(&xp, 2, 4));
            let num = (up - down) / (2.0 * f64::from(h));
            let got = f64::from(dx.as_slice::<f32>().unwrap()[i]);
            assert!((num - got).abs() < 1e-2, "element {i}: {num} vs {got}");
        }
    }

    #[test]
    fn exp_is_within_two_ulp_of_the_correctly_rounded_one() {
        let ulp = |v: f32| f64::from(f32::from_bits(v.to_bits() + 1) - v);
        let mut x = -87.0f32;
        while x <= 88.0 {
            let (got, want) = (exp(x), f64::from(x).exp());
            assert!(
                (f64::from(got) - want).abs() <= 2.0 * ulp(want as f32),
                "exp({x}) = {got}, want {want}"
            );
            x += 0.0137;
        }
        assert_eq!(exp(0.0), 1.0);
        assert_eq!(exp(88.5), f32::INFINITY);
        assert_eq!(exp(-87.5), 0.0);
        assert!(exp(f32::NAN).is_nan());
        assert_eq!(tanh(30.0), 1.0);
        assert_eq!(tanh(-30.0), -1.0);
    }

    #[test]
    fn warp_sum_adds_in_the_warp_order() {
        // Exact inputs: the order cannot matter.
        assert_eq!(warp_sum((1..=100).map(|v| v as f32)), 5050.0);
        assert_eq!(warp_sum(std::iter::empty()), 0.0);
        // Inexact ones: the order shows. One at a time, each 1 added to 2^24 is lost
        // (2^24 + 1 rounds to even); values 32 apart share a lane and meet first, so
        // the two ones make an exact 2 before reaching 2^24.
        let big = 16_777_216.0f32;
        // Values 32 apart land in one lane and are added first.
        let mut w = vec![0.0f32; 64];
        w[0] = big;
        w[1] = 1.0;
        w[33] = 1.0;
        assert_eq!(w.iter().fold(0.0f32, |a, b| a + b), big);
        assert_eq!(warp_sum(w.iter().copied()), big + 2.0);
    }

    #[test]
    fn blocks_round_trip() {
        let m = t(&(0..12).map(|v| v as f32).collect::<Vec<_>>(), 3, 4);
        let blocks = [col_block(&m, 0, 2).unwrap(), col_block(&m, 1, 2).unwrap()];
        assert_eq!(
            blocks[1].to_vec::<f32>().unwrap(),
            [2., 3., 6., 7., 10., 11.]
        );
        let back = concat_cols(&blocks).unwrap();
        assert_eq!(back.to_vec::<f32>().unwrap(), m.to_vec::<f32>().unwrap());
        let stacked = concat_rows(&[rows(&m, 0..1).unwrap(), rows(&m, 1..3).unwrap()]).unwrap();
        assert_eq!(stacked.to_vec::<f32>().unwrap(), m.to_vec::<f32>().unwrap());
        assert!(col_block(&m, 2, 2).is_err());
    }
}
