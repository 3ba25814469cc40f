//! FP8 block scaling: float32 scales per 1×128 block (128×1 for the columnwise copy,
//! scaled independently) or per 128×128 tile (`spec/formats.md` §6). Any shape is
//! accepted; edge blocks are partial.
//!
//! Buffers, GEMM-ready layout: `data` (input shape), `columnwise_data`
//! `[K, d0, ..., d_{n-2}]` (transposed), and float32 scales:
//!
//! | | `scale_inv` | `columnwise_scale_inv` |
//! |---|---|---|
//! | 1-D | `[ceil(K/128), roundup(M,4)]`, entry `[j, m]` | `[ceil(M/128), roundup(K,4)]`, entry `[i, k]` |
//! | 2-D | `[ceil(M/128), roundup(ceil(K/128),4)]`, entry `[i, j]` | `[ceil(K/128), roundup(ceil(M/128),4)]`, entry `[j, i]` |

use std::collections::BTreeMap;

use rayon::prelude::*;
use tessera_core::{DType, Result, Shape, Tensor};

use crate::layout::{roundup, transpose};
use crate::scale::{amax, compute_scale_from_amax};
use crate::values::{CHUNK, Operand, Values, check_input, dtype_max, transposed_shape};
use crate::{BlockDim, BufferName, BufferSpec, Fp8Format, Kind, QuantizedTensor, Quantizer, Usage};

/// Block length.
pub const BLOCK: usize = 128;

/// Scale parameters of block scaling.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BlockScaling {
    /// E4M3 or E5M2.
    pub format: Fp8Format,
    /// Round scales down to powers of two (TE's default).
    pub pow2: bool,
    /// Amax floor.
    pub eps: f32,
    /// The scale used when `fp8_max / amax` overflows: the input dtype's largest value.
    pub value_for_inf: f32,
}

impl BlockScaling {
    /// The scale of a block with amax `a`.
    #[inline]
    pub fn scale(&self, a: f32) -> f32 {
        compute_scale_from_amax(
            a,
            self.format.max(),
            self.pow2,
            self.eps,
            self.value_for_inf,
        )
    }
}

/// 1×128 quantization along the rows of a `[rows, cols]` matrix: `(data [rows, cols],
/// scale_inv [rows, ceil(cols/128)])` (scales row-major, not yet in the GEMM layout).
pub fn quantize_1d(x: &[f32], rows: usize, cols: usize, p: &BlockScaling) -> (Vec<u8>, Vec<f32>) {
    let v = Values::from_f32(x);
    one_d(&Operand::new(&v, rows, cols), p)
}

/// 128×128 tile quantization of an `[m, k]` matrix: `(data [m, k], scale_inv
/// [ceil(m/128), ceil(k/128)])`.
pub fn quantize_2d(x: &[f32], m: usize, k: usize, p: &BlockScaling) -> (Vec<u8>, Vec<f32>) {
    two_d(&Values::from_f32(x), m, k, p)
}

/// [`quantize_1d`] of an operand of f32, bf16 or f16 values (possibly the transposed
/// input): one task per group of rows.
fn one_d(x: &Operand<'_>, p: &BlockScaling) -> (Vec<u8>, Vec<f32>) {
    let (rows, cols) = (x.rows(), x.cols());
    let nb = cols.div_ceil(BLOCK);
    let mut data = vec![0u8; rows * cols];
    let mut si = vec![0f32; rows * nb];
    if cols == 0 {
        return (data, si);
    }
    let g = x.group();
    data.par_chunks_mut(g * cols)
        .zip(si.par_chunks_mut(g * nb))
        .enumerate()
        .with_min_len(CHUNK.div_ceil(g * cols))
        .for_each_init(Vec::new, |buf, (i, (dgroup, sgroup))| {
            let xgroup = x.read_rows(i * g, dgroup.len() / cols, buf);
            let rows_of_group = xgroup
                .chunks_exact(cols)
                .zip(dgroup.chunks_exact_mut(cols))
                .zip(sgroup.chunks_exact_mut(nb));
            for ((xr, d), s) in rows_of_group {
                for ((blk, q), s) in xr.chunks(BLOCK).zip(d.chunks_mut(BLOCK)).zip(s) {
                    let scale = p.scale(amax(blk));
                    *s = 1.0 / scale;
                    p.format.encode_scaled(blk, scale, q);
                }
            }
        });
    (data, si)
}

/// [`quantize_2d`] of f32, bf16 or f16 values: one task per 128 rows.
fn two_d(x: &Values<'_>, m: usize, k: usize, p: &BlockScaling) -> (Vec<u8>, Vec<f32>) {
    let (mb, kb) = (m.div_ceil(BLOCK), k.div_ceil(BLOCK));
    let mut data = vec![0u8; m * k];
    let mut si = vec![0f32; mb * kb];
    if k == 0 {
        return (data, si);
    }
    data.par_chunks_mut(BLOCK * k)
        .zip(si.par_chunks_mut(kb))
        .enumerate()
        .for_each_init(
            || (Vec::new(), vec![0.0f32; kb]),
            |(buf, scales), (i, (d, s))| {
                // Rows i·128.. (128, or fewer at the bottom edge).
                let xb = x.read(i * BLOCK * k, d.len(), buf);
                // The tile amaxes, then their scales.
                scales.fill(0.0);
                for xr in xb.chunks_exact(k) {
                    for (a, blk) in scales.iter_mut().zip(xr.chunks(BLOCK)) {
                        *a = a.max(amax(blk));
                    }
                }
                for (a, s) in scales.iter_mut().zip(s) {
                    *a = p.scale(*a);
                    *s = 1.0 / *a;
                }
                for (xr, dr) in xb.chunks_exact(k).zip(d.chunks_exact_mut(k)) {
                    let blocks = xr.chunks(BLOCK).zip(dr.chunks_mut(BLOCK));
                    for ((blk, q), &scale) in blocks.zip(scales.iter()) {
                        p.format.encode_scaled(blk, scale, q);
                    }
                }
            },
        );
    (data, si)
}

/// A row-major `[rows, cols]` f32 matrix placed in a zero-padded `[rows, padded_cols]`
/// one, as bytes.
fn padded_f32(v: &[f32], rows: usize, cols: usize, padded_cols: usize) -> Vec<u8> {
    crate::layout::pad(bytemuck::cast_slice(v), rows, cols, rows, padded_cols, 4)
}

/// Padded scale shapes `(rowwise, columnwise)` for an `[m, k]` matrix.
pub fn scale_shapes(m: usize, k: usize, dim: BlockDim) -> ([usize; 2], [usize; 2]) {
    let (mb, kb) = (m.div_ceil(BLOCK), k.div_ceil(BLOCK));
    match dim {
        BlockDim::OneD => ([kb, roundup(m, 4)], [mb, roundup(k, 4)]),
        BlockDim::TwoD => ([mb, roundup(kb, 4)], [kb, roundup(mb, 4)]),
    }
}

pub(crate) fn buffer_specs(format: Fp8Format, dim: BlockDim, shape: &Shape) -> Vec<BufferSpec> {
    let (m, k) = shape.flat_2d();
    let (rs, cs) = scale_shapes(m, k, dim);
    vec![
        BufferSpec {
            name: BufferName::Data,
            dtype: format.dtype(),
            shape: shape.clone(),
        },
        BufferSpec {
            name: BufferName::ScaleInv,
            dtype: DType::F32,
            shape: Shape::new(rs),
        },
        BufferSpec {
            name: BufferName::ColumnwiseData,
            dtype: format.dtype(),
            shape: transposed_shape(shape),
        },
        BufferSpec {
            name: BufferName::ColumnwiseScaleInv,
            dtype: DType::F32,
            shape: Shape::new(cs),
        },
    ]
}

/// The FP8 block-scaling quantizer (TE's `Float8BlockQuantizer`).
#[derive(Debug, Clone)]
pub struct Fp8BlockQuantizer {
    format: Fp8Format,
    usage: Usage,
    dim: BlockDim,
    pow2: bool,
    eps: f32,
}

impl Fp8BlockQuantizer {
    /// TE's recipe defaults: power-of-two scales, epsilon 0, both usages.
    pub fn new(format: Fp8Format, dim: BlockDim) -> Self {
        Fp8BlockQuantizer {
            format,
            usage: Usage::Both,
            dim,
            pow2: true,
            eps: 0.0,
        }
    }

    /// Power-of-two (`true`, default) or float32 scales.
    pub fn with_pow2_scales(mut self, pow2: bool) -> Self {
        self.pow2 = pow2;
        self
    }

    /// Amax floor.
    pub fn with_amax_epsilon(mut self, eps: f32) -> Self {
        self.eps = eps;
        self
    }

    /// The usages to produce.
    pub fn with_usage(mut self, usage: Usage) -> Self {
        self.usage = usage;
        self
    }

    fn params(&self, dtype: DType) -> BlockScaling {
        BlockScaling {
            format: self.format,
            pow2: self.pow2,
            eps: self.eps,
            value_for_inf: dtype_max(dtype),
        }
    }
}

impl Quantizer for Fp8BlockQuantizer {
    fn kind(&self) -> Kind {
        Kind::Fp8Block {
            format: self.format,
            block_dim: self.dim,
        }
    }
    fn usage(&self) -> Usage {
        self.usage
    }
    fn set_usage(&mut self, usage: Usage) {
        self.usage = usage;
    }
    fn check_shape(&self, shape: &Shape) -> Result<()> {
        crate::check_rank("Fp8BlockQuantizer", shape)
    }
    fn is_quantizable(&self, shape: &Shape) -> bool {
        let (m, k) = shape.flat_2d();
        shape.rank() >= 2 && m % BLOCK == 0 && k % BLOCK == 0
    }
    fn quantize_into(&mut self, x: &Tensor, out: &mut QuantizedTensor) -> Result<()> {
        crate::check_into("Quantizer::quantize_into", &self.kind(), x, out)?;
        if x.device().is_cuda() {
            check_input("Fp8BlockQuantizer::quantize", x)?;
            #[cfg(feature = "cuda")]
            return crate::cuda::block::quantize_into(x, &self.params(x.dtype()), self.dim, out);
            #[cfg(not(feature = "cuda"))]
            return Err(tessera_core::Error::no_cuda_feature(
                "quantizing a CUDA tensor",
            ));
        }
        let q = self.quantize(x)?;
        out.replace_buffers(q)
    }
    fn quantize(&mut self, x: &Tensor) -> Result<QuantizedTensor> {
        const OP: &str = "Fp8BlockQuantizer::quantize";
        if x.device().is_cuda() {
            return crate::quantize_on_device(self, x);
        }
        let (m, k) = check_input(OP, x)?;
        let v = Values::new(OP, x)?;
        let p = self.params(x.dtype());
        let (rs, cs) = scale_shapes(m, k, self.dim);
        let mut out: BTreeMap<BufferName, Vec<u8>> = BTreeMap::new();
        match self.dim {
            BlockDim::OneD => {
                if self.usage.rowwise() {
                    let (d, s) = one_d(&Operand::new(&v, m, k), &p);
                    // Stored transposed: [ceil(K/128), roundup(M, 4)].
                    let st = transpose(&s, m, k.div_ceil(BLOCK));
                    out.insert(BufferName::Data, d);
                    out.insert(BufferName::ScaleInv, padded_f32(&st, rs[0], m, rs[1]));
                }
                if self.usage.columnwise() {
                    // xᵀ, gathered from x as it is read.
                    let (d, s) = one_d(&Operand::transpose_of(&v, m, k), &p);
                    // s is [K, ceil(M/128)]; stored as [ceil(M/128), roundup(K, 4)].
                    let st = transpose(&s, k, m.div_ceil(BLOCK));
                    out.insert(BufferName::ColumnwiseData, d);
                    out.insert(
                        BufferName::ColumnwiseScaleInv,
                        padded_f32(&st, cs[0], k, cs[1]),
                    );
                }
            }
            BlockDim::TwoD => {
                let (d, s) = two_d(&v, m, k, &p);
                let (mb, kb) = (m.div_ceil(BLOCK), k.div_ceil(BLOCK));
                if self.usage.columnwise() {
                    out.insert(BufferName::ColumnwiseData, transpose(&d, m, k));
                    out.insert(
                        BufferName::ColumnwiseScaleInv,
                        padded_f32(&transpose(&s, mb, kb), kb, mb, cs[1]),
                    );
                }
                if self.usage.rowwise() {
                    out.insert(BufferName::ScaleInv, padded_f32(&s, mb, kb, rs[1]));
                    out.insert(BufferName::Data, d);
                }
            }
        }
        crate::assemble(
            self.kind(),
            x,
            &buffer_specs(self.format, self.dim, x.shape()),
            out,
        )
    }
}

/// Dequantized values (logical order) of one orientation.
pub(crate) fn dequantize(
    qt: &QuantizedTensor,
    format: Fp8Format,
    dim: BlockDim,
    columnwise: bool,
) -> Result<Vec<f32>> {
    let (m, k) = qt.shape.flat_2d();
    let (rs, cs) = scale_shapes(m, k, dim);
    let (q, s) = qt.data_and_scales(columnwise)?;
    let (q, s) = (q.as_bytes()?, s.as_slice::<f32>()?);
    // The scale_inv of logical element (r, c) of the stored orientation.
    let scale_of = |r: usize, c: usize| -> f32 {
        match (dim, columnwise) {
            (BlockDim::OneD, false) => s[(c / BLOCK) * rs[1] + r],
            (BlockDim::OneD, true) => s[(c / BLOCK) * cs[1] + r], // stored [K, M]: r = k, c = m
            (BlockDim::TwoD, false) => s[(r / BLOCK) * rs[1] + c / BLOCK],
            (BlockDim::TwoD, true) => s[(r / BLOCK) * cs[1] + c / BLOCK],
        }
    };
    let (rows, cols) = if columnwise { (k, m) } else { (m, k) };
    let v: Vec<f32> = (0..rows * cols)
        .into_par_iter()
        .map(|e| format.decode(q[e]) * scale_of(e / cols, e % cols))
        .collect();
    Ok(if columnwise { transpose(&v, k, m) } else { v })
}

#[cfg(test)]
mod tests {
    use super::*;
    use tessera_core::Device;

    #[test]
    fn worked_example() {
        // spec §6.4: one row of 128, [1000, -3, 0.7, 0, ...].
        let mut row = vec![0.0f32; 128];
        row[..3].copy_from_slice(&[1000.0, -3.0, 0.7]);
        let x = Tensor::from_slice(&row, [1, 128], Device::Cpu).unwrap();
        let q = Fp8BlockQuantizer::new(Fp8Format::E4M3, BlockDim::OneD)
            .quantize(&x)
            .unwrap();
        assert_eq!(
            &q.buffer(BufferName::Data).unwrap().as_bytes().unwrap()[..3],
            &[0x78, 0xB4, 0x23]
        );
        let s = q.buffer(BufferName::ScaleInv).unwrap();
        assert_eq!(s.shape().dims(), &[1, 4]);
        assert_eq!(s.as_slice::<f32>().unwrap(), &[4.0, 0.0, 0.0, 0.0]);
        assert_eq!(
            q.buffer(BufferName::ColumnwiseScaleInv)
                .unwrap()
                .shape()
                .dims(),
            &[1, 128]
        );
        let q = Fp8BlockQuantizer::new(Fp8Format::E4M3, BlockDim::OneD)
            .with_pow2_scales(false)
            .quantize(&x)
            .unwrap();
        assert_eq!(
            &q.buffer(BufferName::Data).unwrap().as_bytes().unwrap()[..3],
            &[0x7E, 0xBB, 0x2A]
        );
        let si = q
            .buffer(BufferName::ScaleInv)
            .unwrap()
            .as_slice::<f32>()
            .unwrap()[0];
        assert!((si - 2.232_142_7).abs() < 1e-6, "{si}");
    }

    #[test]
    fn two_d_columnwise_is_the_transpose() {
        let x: Vec<f32> = (0..200 * 130)
            .map(|i| ((i * 37 % 1001) as f32 - 500.0) * 0.01)
            .collect();
        let t = Tensor::from_slice(&x, [200, 130], Device::Cpu).unwrap();
        let q = Fp8BlockQuantizer::new(Fp8Format::E4M3, BlockDim::TwoD)
            .quantize(&t)
            .unwrap();
        let d = q.buffer(BufferName::Data).unwrap().as_bytes().unwrap();
        let c = q
            .buffer(BufferName::ColumnwiseData)
            .unwrap()
            .as_bytes()
            .unwrap();
        assert_eq!(transpose(d, 200, 130), c);
        assert_eq!(
            q.buffer(BufferName::ScaleInv).unwrap().shape().dims(),
            &[2, 4]
        );
        assert_eq!(
            q.buffer(BufferName::ColumnwiseScaleInv)
                .unwrap()
                .shape()
                .dims(),
            &[2, 4]
        );
    }
}
