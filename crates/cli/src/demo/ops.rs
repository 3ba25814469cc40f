//! The arithmetic both runs share: GEMMs through the `gemm` crate, LayerNorm, dropout
//! masks, row and column blocks, bf16 rounding.
//!
//! Every function works on host `f32` tensors of rank 2 (`[rows, cols]`) and returns a
//! typed [`Error`] for shapes that do not fit. The element-wise functions are the same
//! code in the distributed run and in the reference, so the two differ only where a sum
//! is split differently (see the [module docs](super)).

use half::bf16;
use tessera_core::{DType, Device, Error, Result, Shape, Tensor};
use tessera_rng::stream::dropout_scale;
use tessera_rng::with_current_generator;

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

/// `op(a) · op(b)` in f32, where `op(x)` is `xᵀ` when its flag is set: `a` is `[m, k]`
/// (`[k, m]` transposed), `b` is `[k, n]` (`[n, k]` transposed), the result `[m, n]`.
///
/// The product runs through [`gemm::gemm`] on one thread (the ranks are threads
/// already); transposes are strides, never copies.
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

/// `out[i] = f(a[i], b[i])` for two tensors of one shape.
fn zip_map<T: tessera_core::Element>(
    op: &'static str,
    a: &Tensor,
    b: &Tensor,
    f: impl Fn(f32, T) -> f32,
) -> Result<Tensor> {
    same_shape(op, a, b)?;
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
    zip_map("add", a, b, |x, y: f32| x + y)
}

const SQRT_2_OVER_PI: f32 = 0.797_884_6;
const GELU_C: f32 = 0.044_715;

/// `tanh(u) = 1 - 2/(e^{2u} + 1)`: one `exp`, saturating to ±1.
#[inline]
fn tanh(u: f32) -> f32 {
    1.0 - 2.0 / ((2.0 * u).exp() + 1.0)
}

/// GeLU, tanh approximation (TE's `gelu`): `0.5·a·(1 + tanh(√(2/π)·(a + 0.044715·a³)))`.
pub(crate) fn gelu(a: &Tensor) -> Result<Tensor> {
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
    zip_map("gelu_backward", dg, a, |d, x: f32| {
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

/// LayerNorm over the last dimension: `z = (x - μ)/σ · γ + β`, with the row statistics.
pub(crate) fn layernorm(x: &Tensor, gamma: &Tensor, beta: &Tensor) -> Result<(Tensor, LnStats)> {
    const OP: &str = "layernorm";
    let (rows, h) = dims2(OP, x)?;
    let (g, b) = (gamma.as_slice::<f32>()?, beta.as_slice::<f32>()?);
    if g.len() != h || b.len() != h {
        return Err(Error::shape(
            OP,
            format!(
                "γ and β must have {h} elements, got {} and {}",
                g.len(),
                b.len()
            ),
        ));
    }
    let xv = x.as_slice::<f32>()?;
    let mut z = vec![0.0f32; rows * h];
    let mut mean = vec![0.0f32; rows];
    let mut rstd = vec![0.0f32; rows];
    let inv_h = 1.0 / h as f32;
    for i in 0..rows {
        let row = &xv[i * h..(i + 1) * h];
        let mu = row.iter().sum::<f32>() * inv_h;
        let var = row.iter().map(|v| (v - mu) * (v - mu)).sum::<f32>() * inv_h;
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
/// `dβ` are summed over this call's rows, in row order.
pub(crate) fn layernorm_backward(
    dz: &Tensor,
    x: &Tensor,
    stats: &LnStats,
    gamma: &Tensor,
) -> Result<(Tensor, Vec<f32>, Vec<f32>)> {
    const OP: &str = "layernorm_backward";
    same_shape(OP, dz, x)?;
    let (rows, h) = dims2(OP, x)?;
    let (xv, dzv, g) = (
        x.as_slice::<f32>()?,
        dz.as_slice::<f32>()?,
        gamma.as_slice::<f32>()?,
    );
    let (mean, rstd) = (stats.mean.as_slice::<f32>()?, stats.rstd.as_slice::<f32>()?);
    if g.len() != h || mean.len() != rows || rstd.len() != rows {
        return Err(Error::shape(
            OP,
            format!("γ needs {h} elements and the statistics {rows} rows"),
        ));
    }
    let inv_h = 1.0 / h as f32;
    let mut dx = vec![0.0f32; rows * h];
    let mut dgamma = vec![0.0f32; h];
    let mut dbeta = vec![0.0f32; h];
    let mut xhat = vec![0.0f32; h];
    let mut dxhat = vec![0.0f32; h];
    for i in 0..rows {
        let (mu, r) = (mean[i], rstd[i]);
        let (row, drow) = (&xv[i * h..(i + 1) * h], &dzv[i * h..(i + 1) * h]);
        let (mut c1, mut c2) = (0.0f32, 0.0f32);
        for j in 0..h {
            xhat[j] = (row[j] - mu) * r;
            dgamma[j] += drow[j] * xhat[j];
            dbeta[j] += drow[j];
            dxhat[j] = drow[j] * g[j];
            c1 += dxhat[j] * xhat[j];
            c2 += dxhat[j];
        }
        let (c1, c2) = (c1 * inv_h, c2 * inv_h);
        for j in 0..h {
            dx[i * h + j] = r * (dxhat[j] - c2 - xhat[j] * c1);
        }
    }
    Ok((matrix(&dx, rows, h)?, dgamma, dbeta))
}

/// A dropout mask of `n` elements (1 = kept) drawn from the calling thread's current CPU
/// generator, exactly as [`Generator::dropout`](tessera_rng::Generator::dropout) draws
/// it (the generator advances by the same words).
pub(crate) fn draw_mask(n: usize, p: f32) -> Result<Vec<u8>> {
    let zeros = vec![0.0f32; n];
    let mut out = vec![0.0f32; n];
    let mut mask = vec![0u8; n];
    with_current_generator(Device::Cpu, |g| g.dropout(&zeros, p, &mut out, &mut mask))??;
    Ok(mask)
}

/// Dropout with a given mask (1 = kept): `x · 1/(1-p)` where kept, 0 elsewhere — the
/// forward, and also the backward (the same map of the output gradient).
pub(crate) fn apply_mask(x: &Tensor, mask: &Tensor, p: f32) -> Result<Tensor> {
    let scale = dropout_scale(p);
    zip_map(
        "apply_mask",
        x,
        mask,
        |v, m: u8| if m == 1 { v * scale } else { 0.0 },
    )
}

/// Rows `range` of a matrix.
pub(crate) fn rows(t: &Tensor, range: std::ops::Range<usize>) -> Result<Tensor> {
    tessera_fsdp::mlp::rows(t, range)
}

/// Rows `range` of a `u8` matrix (a dropout mask).
pub(crate) fn mask_rows(t: &Tensor, range: std::ops::Range<usize>) -> Result<Tensor> {
    let (r, c) = dims2("mask_rows", t)?;
    if range.start > range.end || range.end > r {
        return Err(Error::shape(
            "mask_rows",
            format!("rows {range:?} of a mask of shape {}", t.shape()),
        ));
    }
    let v = &t.as_slice::<u8>()?[range.start * c..range.end * c];
    Tensor::from_slice(v, [range.len(), c], Device::Cpu)
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
    let v = t.as_slice::<f32>()?;
    let mut out = Vec::with_capacity(r * width);
    for i in 0..r {
        out.extend_from_slice(&v[i * c + start..i * c + start + width]);
    }
    matrix(&out, r, width)
}

/// The matrices side by side (the inverse of [`col_block`]); all need the same rows.
pub(crate) fn concat_cols<T: tessera_core::Element>(blocks: &[Tensor]) -> Result<Tensor> {
    const OP: &str = "concat_cols";
    let Some(first) = blocks.first() else {
        return Err(Error::invalid(OP, "nothing to concatenate"));
    };
    let (r, _) = dims2(OP, first)?;
    let mut widths = Vec::with_capacity(blocks.len());
    for b in blocks {
        let (br, bc) = dims2(OP, b)?;
        if br != r {
            return Err(Error::shape(
                OP,
                format!("blocks of {br} and {r} rows cannot sit side by side"),
            ));
        }
        widths.push(bc);
    }
    let c: usize = widths.iter().sum();
    let slices = blocks
        .iter()
        .map(|b| b.as_slice::<T>())
        .collect::<Result<Vec<_>>>()?;
    let mut out = Vec::with_capacity(r * c);
    for i in 0..r {
        for (s, &w) in slices.iter().zip(&widths) {
            out.extend_from_slice(&s[i * w..(i + 1) * w]);
        }
    }
    Tensor::from_slice(&out, [r, c], Device::Cpu)
}

/// The matrices stacked (row blocks, in order); all need the same columns.
pub(crate) fn concat_rows(blocks: &[Tensor]) -> Result<Tensor> {
    const OP: &str = "concat_rows";
    let Some(first) = blocks.first() else {
        return Err(Error::invalid(OP, "nothing to concatenate"));
    };
    let (_, c) = dims2(OP, first)?;
    let mut out = Vec::new();
    let mut r = 0;
    for b in blocks {
        let (br, bc) = dims2(OP, b)?;
        if bc != c {
            return Err(Error::shape(
                OP,
                format!("blocks of {bc} and {c} columns cannot be stacked"),
            ));
        }
        out.extend_from_slice(b.as_slice::<f32>()?);
        r += br;
    }
    matrix(&out, r, c)
}

/// The values of `x` rounded to bf16 (round to nearest even), as a bf16 tensor.
pub(crate) fn to_bf16(x: &Tensor) -> Result<Tensor> {
    let v: Vec<bf16> = x
        .as_slice::<f32>()?
        .iter()
        .map(|&f| bf16::from_f32(f))
        .collect();
    Tensor::from_slice(&v, x.shape(), Device::Cpu)
}

/// A bf16 (or f32) tensor's values as f32.
pub(crate) fn to_f32(x: &Tensor) -> Result<Tensor> {
    match x.dtype() {
        DType::F32 => Ok(x.clone()),
        DType::BF16 => {
            let v: Vec<f32> = x.as_slice::<bf16>()?.iter().map(|b| b.to_f32()).collect();
            Tensor::from_slice(&v, x.shape(), Device::Cpu)
        }
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
        assert_eq!(dbeta, [1.5, -0.7, -0.45, 2.2]);
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
    fn blocks_round_trip() {
        let m = t(&(0..12).map(|v| v as f32).collect::<Vec<_>>(), 3, 4);
        let blocks = [col_block(&m, 0, 2).unwrap(), col_block(&m, 1, 2).unwrap()];
        assert_eq!(
            blocks[1].to_vec::<f32>().unwrap(),
            [2., 3., 6., 7., 10., 11.]
        );
        let back = concat_cols::<f32>(&blocks).unwrap();
        assert_eq!(back.to_vec::<f32>().unwrap(), m.to_vec::<f32>().unwrap());
        let stacked = concat_rows(&[rows(&m, 0..1).unwrap(), rows(&m, 1..3).unwrap()]).unwrap();
        assert_eq!(stacked.to_vec::<f32>().unwrap(), m.to_vec::<f32>().unwrap());
        assert!(col_block(&m, 2, 2).is_err());
    }
}
