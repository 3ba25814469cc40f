//! Conversions between high-precision tensors and the float32 values every quantizer
//! computes with (bf16 and f16 widen to f32 exactly).

use std::borrow::Cow;

use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};
use rayon::prelude::*;
use tessera_core::{DType, Device, Error, Result, Shape, Tensor};

use crate::scale::amax;

/// The values of a host f32/bf16/f16 tensor, read as f32 one slice at a time (bf16 and
/// f16 widen to f32 exactly), so the quantizers never hold an f32 copy of a whole bf16 or
/// f16 input: each task widens the rows it works on into a buffer of its own.
#[derive(Debug)]
pub(crate) enum Values<'a> {
    F32(Cow<'a, [f32]>),
    Bf16(Cow<'a, [bf16]>),
    F16(Cow<'a, [f16]>),
}

/// Elements per task of the element-wise passes (big enough to amortise a rayon task and
/// the widening buffer, small enough to balance the threads on typical tensors).
pub(crate) const CHUNK: usize = 1 << 15;

impl<'a> Values<'a> {
    /// The values of a host f32, bf16 or f16 tensor.
    pub(crate) fn new(op: &'static str, x: &'a Tensor) -> Result<Self> {
        if x.device() != Device::Cpu {
            return Err(Error::device(
                op,
                "cpu (the CPU reference reads host tensors)",
                x.device(),
            ));
        }
        Ok(match x.dtype() {
            DType::F32 => Values::F32(Cow::Borrowed(x.as_slice()?)),
            DType::BF16 => Values::Bf16(Cow::Borrowed(x.as_slice()?)),
            DType::F16 => Values::F16(Cow::Borrowed(x.as_slice()?)),
            other => return Err(Error::dtype(op, "f32, bf16 or f16", other)),
        })
    }

    /// f32 values (no copy).
    pub(crate) fn from_f32(v: &'a [f32]) -> Self {
        Values::F32(Cow::Borrowed(v))
    }

    /// The number of elements.
    pub(crate) fn len(&self) -> usize {
        match self {
            Values::F32(v) => v.len(),
            Values::Bf16(v) => v.len(),
            Values::F16(v) => v.len(),
        }
    }

    /// Elements `start..start + len` as f32: borrowed from an f32 input, widened into
    /// `buf` otherwise.
    #[inline]
    pub(crate) fn read<'b>(&'b self, start: usize, len: usize, buf: &'b mut Vec<f32>) -> &'b [f32] {
        match self {
            Values::F32(v) => &v[start..][..len],
            _ => {
                buf.resize(len, 0.0);
                self.widen(start, buf);
                buf
            }
        }
    }

    /// Elements `start..start + out.len()`, widened to f32 into `out`.
    #[inline]
    fn widen(&self, start: usize, out: &mut [f32]) {
        let n = out.len();
        match self {
            Values::F32(v) => out.copy_from_slice(&v[start..][..n]),
            Values::Bf16(v) => {
                for (o, b) in out.iter_mut().zip(&v[start..][..n]) {
                    *o = b.to_f32();
                }
            }
            Values::F16(v) => v[start..][..n].convert_to_f32_slice(out),
        }
    }

    /// The NaN-ignoring amax of all values ([`amax`]), in parallel.
    pub(crate) fn amax(&self) -> f32 {
        (0..self.len().div_ceil(CHUNK))
            .into_par_iter()
            .map_init(Vec::new, |buf, i| {
                let start = i * CHUNK;
                amax(self.read(start, CHUNK.min(self.len() - start), buf))
            })
            .reduce(|| 0.0, f32::max)
    }
}

/// A `[rows, cols]` operand of a quantizer, read as f32 a group of rows at a time: the
/// values as they are, or the transpose of `[cols, rows]` values (the columnwise operand
/// of NVFP4 and FP8 block scaling), gathered 32 source columns at a time through a small
/// tile, so that no transposed copy of the input is ever made.
#[derive(Debug)]
pub(crate) struct Operand<'a> {
    values: &'a Values<'a>,
    rows: usize,
    cols: usize,
    transposed: bool,
}

impl<'a> Operand<'a> {
    /// The row-major `[rows, cols]` matrix `values`.
    pub(crate) fn new(values: &'a Values<'a>, rows: usize, cols: usize) -> Self {
        Operand {
            values,
            rows,
            cols,
            transposed: false,
        }
    }

    /// The transpose (`[cols, rows]`) of the row-major `[rows, cols]` matrix `values`.
    pub(crate) fn transpose_of(values: &'a Values<'a>, rows: usize, cols: usize) -> Self {
        Operand {
            values,
            rows: cols,
            cols: rows,
            transposed: true,
        }
    }

    /// The number of rows.
    pub(crate) fn rows(&self) -> usize {
        self.rows
    }

    /// The number of columns.
    pub(crate) fn cols(&self) -> usize {
        self.cols
    }

    /// Rows per read: one for a row-major operand (a row is contiguous), a band of 32 for
    /// a transposed one (32 consecutive source elements per source row).
    pub(crate) fn group(&self) -> usize {
        if self.transposed { 32 } else { 1 }
    }

    /// Rows `r0..r0 + n` (`n <= group()`) as f32, row-major: borrowed from a row-major
    /// f32 operand, widened or gathered into `buf` otherwise.
    pub(crate) fn read_rows<'b>(&'b self, r0: usize, n: usize, buf: &'b mut Vec<f32>) -> &'b [f32] {
        if !self.transposed {
            return self.values.read(r0 * self.cols, n * self.cols, buf);
        }
        // Row r of the operand is column r of the source, whose rows are our columns:
        // copy (and widen) n-element runs of 32 source rows into a tile, then write the
        // tile's columns out as runs of 32 of our rows.
        const TILE: usize = 32;
        assert!(n <= TILE, "read_rows: {n} rows of a transposed operand");
        buf.resize(n * self.cols, 0.0);
        let mut tile = [[0.0f32; TILE]; TILE];
        for s0 in (0..self.cols).step_by(TILE) {
            let h = TILE.min(self.cols - s0);
            for (t, s) in tile.iter_mut().zip(s0..s0 + h) {
                self.values.widen(s * self.rows + r0, &mut t[..n]);
            }
            for (c, row) in buf.chunks_exact_mut(self.cols).enumerate() {
                for (o, t) in row[s0..s0 + h].iter_mut().zip(&tile) {
                    *o = t[c];
                }
            }
        }
        buf
    }
}

/// A host tensor of `dtype` (f32, bf16 or f16, rounded to nearest-even) from f32 values.
/// NaN is written as the canonical NaN a CUDA GPU produces (`0x7FFFFFFF`, `0x7FFF`), so
/// CPU and GPU dequantization agree bit for bit.
pub(crate) fn from_f32(v: &[f32], shape: &Shape, dtype: DType) -> Result<Tensor> {
    fn conv<T: tessera_core::Element>(
        v: &[f32],
        shape: &Shape,
        nan: T,
        f: impl Fn(f32) -> T,
    ) -> Result<Tensor> {
        let c: Vec<T> = v
            .iter()
            .map(|&x| if x.is_nan() { nan } else { f(x) })
            .collect();
        Tensor::from_slice(&c, shape, Device::Cpu)
    }
    match dtype {
        DType::F32 => conv(v, shape, f32::from_bits(0x7FFF_FFFF), |x| x),
        DType::BF16 => conv(v, shape, bf16::from_bits(0x7FFF), bf16::from_f32),
        DType::F16 => conv(v, shape, f16::from_bits(0x7FFF), f16::from_f32),
        other => Err(Error::dtype("dequantize", "f32, bf16 or f16", other)),
    }
}

/// The largest finite value of a high-precision dtype (FP8 block scaling's
/// `value_for_inf`): `FLT_MAX`, bf16's 3.3895314e38 or f16's 65504.
pub(crate) fn dtype_max(dtype: DType) -> f32 {
    match dtype {
        DType::BF16 => bf16::MAX.to_f32(),
        DType::F16 => f16::MAX.to_f32(),
        _ => f32::MAX,
    }
}

/// Checks a quantizer input: host, f32/bf16/f16, rank ≥ 1; returns `(M, K)`.
pub(crate) fn check_input(op: &'static str, x: &Tensor) -> Result<(usize, usize)> {
    if !x.dtype().is_high_precision_float() {
        return Err(Error::dtype(op, "f32, bf16 or f16", x.dtype()));
    }
    if x.shape().rank() == 0 {
        return Err(Error::shape(
            op,
            "cannot quantize a rank-0 tensor; reshape it to [1]",
        ));
    }
    Ok(x.shape().flat_2d())
}

/// The columnwise (transposed) shape `(K, d0, ..., d_{n-2})` of `shape`.
pub(crate) fn transposed_shape(shape: &Shape) -> Shape {
    let d = shape.dims();
    match d.split_last() {
        None => Shape::new([]),
        Some((&k, rest)) => {
            let mut v = vec![k];
            v.extend_from_slice(rest);
            Shape::new(v)
        }
    }
}
