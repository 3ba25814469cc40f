//! MXFP8: FP8 values with one E8M0 power-of-two scale per 32 elements — 1×32 blocks
//! along K (rowwise) and 32×1 along M (columnwise), or one 32×32 tile for both
//! (`spec/formats.md` §4).
//!
//! Buffers (M, K multiples of 32): `data` and `columnwise_data` both in the input shape
//! (the columnwise copy is **not** transposed); `scale_inv` E8M0
//! `[roundup(M, 128), roundup(K/32, 4)]` and `columnwise_scale_inv`
//! `[roundup(M/32, 4), roundup(K, 128)]`, padding zero, compact row-major or in cuBLAS's
//! GEMM-swizzled layout.

use std::collections::BTreeMap;

use rayon::prelude::*;
use tessera_core::{DType, Result, Shape, Tensor};

use crate::cast::{decode_e8m0, e8m0_reciprocal, float_to_e8m0};
use crate::layout::{pad, roundup, swizzle, transpose, unswizzle};
use crate::scale::{amax, max_abs};
use crate::values::{CHUNK, Values, check_input};
use crate::{BufferName, BufferSpec, Fp8Format, Kind, QuantizedTensor, Quantizer, Usage};

/// Elements per MXFP8 block.
pub const BLOCK: usize = 32;

/// The E8M0 scale of a block with amax `a`: the smallest power of two `>= a · fp32(1/max)`.
#[inline]
pub fn block_exponent(a: f32, format: Fp8Format) -> u8 {
    float_to_e8m0(a * format.max_rcp())
}

/// Rowwise 1×32 quantization of a row-major `[m, k]` matrix: `(data [m, k], compact scales
/// [m, k/32])`.
pub fn quantize_rowwise(x: &[f32], m: usize, k: usize, format: Fp8Format) -> (Vec<u8>, Vec<u8>) {
    rowwise(&Values::from_f32(x), m, k, format)
}

/// Columnwise 32×1 quantization: `(data [m, k] (not transposed), compact scales
/// [m/32, k])`.
pub fn quantize_columnwise(x: &[f32], m: usize, k: usize, format: Fp8Format) -> (Vec<u8>, Vec<u8>) {
    columnwise(&Values::from_f32(x), m, k, format)
}

/// 2-D quantization with one scale per 32×32 tile: `(data [m, k], tile scales
/// [m/32, k/32])`. Rowwise and columnwise data are these same bytes.
pub fn quantize_2d(x: &[f32], m: usize, k: usize, format: Fp8Format) -> (Vec<u8>, Vec<u8>) {
    two_d(&Values::from_f32(x), m, k, format)
}

/// [`quantize_rowwise`] of f32, bf16 or f16 values: one task per group of rows.
fn rowwise(x: &Values<'_>, m: usize, k: usize, format: Fp8Format) -> (Vec<u8>, Vec<u8>) {
    let nb = k / BLOCK;
    let mut data = vec![0u8; m * k];
    let mut scales = vec![0u8; m * nb];
    if k == 0 {
        return (data, scales);
    }
    data.par_chunks_mut(k)
        .zip(scales.par_chunks_mut(nb.max(1)))
        .enumerate()
        .with_min_len(CHUNK.div_ceil(k))
        .for_each_init(Vec::new, |buf, (r, (drow, srow))| {
            let xrow = x.read(r * k, k, buf);
            let blocks = xrow.chunks_exact(BLOCK).zip(drow.chunks_exact_mut(BLOCK));
            for ((blk, q), s) in blocks.zip(srow) {
                let e = block_exponent(amax(blk), format);
                *s = e;
                format.encode_scaled(blk, e8m0_reciprocal(e), q);
            }
        });
    (data, scales)
}

/// [`quantize_columnwise`] of f32, bf16 or f16 values: one task per 32 rows, each read
/// once for the column amaxes and once to encode, row by row.
fn columnwise(x: &Values<'_>, m: usize, k: usize, format: Fp8Format) -> (Vec<u8>, Vec<u8>) {
    let mut data = vec![0u8; m * k];
    let mut scales = vec![0u8; m / BLOCK * k];
    if k == 0 {
        return (data, scales);
    }
    data.par_chunks_mut(BLOCK * k)
        .zip(scales.par_chunks_mut(k))
        .enumerate()
        .for_each_init(
            || (Vec::new(), vec![0.0f32; k]),
            |(buf, mult), (i, (dblk, srow))| {
                let xblk = x.read(i * BLOCK * k, BLOCK * k, buf);
                // The 32×1 block amaxes of the k columns, then their scales.
                mult.fill(0.0);
                for xrow in xblk.chunks_exact(k) {
                    for (a, &v) in mult.iter_mut().zip(xrow) {
                        *a = max_abs(*a, v);
                    }
                }
                for (a, s) in mult.iter_mut().zip(srow) {
                    *s = block_exponent(*a, format);
                    *a = e8m0_reciprocal(*s);
                }
                for (xrow, drow) in xblk.chunks_exact(k).zip(dblk.chunks_exact_mut(k)) {
                    format.encode_scaled_each(xrow, mult, drow);
                }
            },
        );
    (data, scales)
}

/// [`quantize_2d`] of f32, bf16 or f16 values: one task per 32 rows.
fn two_d(x: &Values<'_>, m: usize, k: usize, format: Fp8Format) -> (Vec<u8>, Vec<u8>) {
    let kb = k / BLOCK;
    let mut data = vec![0u8; m * k];
    let mut tiles = vec![0u8; m / BLOCK * kb];
    if k == 0 {
        return (data, tiles);
    }
    data.par_chunks_mut(BLOCK * k)
        .zip(tiles.par_chunks_mut(kb.max(1)))
        .enumerate()
        .for_each_init(
            || (Vec::new(), vec![0.0f32; kb]),
            |(buf, mult), (i, (dblk, trow))| {
                let xblk = x.read(i * BLOCK * k, BLOCK * k, buf);
                // The tile amaxes, then their scales.
                mult.fill(0.0);
                for xrow in xblk.chunks_exact(k) {
                    for (a, blk) in mult.iter_mut().zip(xrow.chunks_exact(BLOCK)) {
                        *a = a.max(amax(blk));
                    }
                }
                for (a, t) in mult.iter_mut().zip(trow) {
                    *t = block_exponent(*a, format);
                    *a = e8m0_reciprocal(*t);
                }
                for (xrow, drow) in xblk.chunks_exact(k).zip(dblk.chunks_exact_mut(k)) {
                    let blocks = xrow.chunks_exact(BLOCK).zip(drow.chunks_exact_mut(BLOCK));
                    for ((blk, q), &s) in blocks.zip(mult.iter()) {
                        format.encode_scaled(blk, s, q);
                    }
                }
            },
        );
    (data, tiles)
}

/// Padded scale-buffer shapes `(rowwise, columnwise)` for an `[m, k]` matrix.
pub fn scale_shapes(m: usize, k: usize) -> ([usize; 2], [usize; 2]) {
    (
        [roundup(m, 128), roundup(k / BLOCK, 4)],
        [roundup(m / BLOCK, 4), roundup(k, 128)],
    )
}

/// The rowwise scale buffer from compact `[m, k/32]` scales: zero-padded, swizzled if
/// asked.
pub fn rowwise_scale_buffer(compact: &[u8], m: usize, k: usize, swizzled: bool) -> Vec<u8> {
    let ([r, c], _) = scale_shapes(m, k);
    let padded = pad(compact, m, k / BLOCK, r, c, 1);
    if swizzled {
        swizzle(&padded, r, c).expect("padded grid")
    } else {
        padded
    }
}

/// The columnwise scale buffer from compact `[m/32, k]` scales: zero-padded, and
/// swizzled as the transpose of its grid if asked.
pub fn columnwise_scale_buffer(compact: &[u8], m: usize, k: usize, swizzled: bool) -> Vec<u8> {
    let (_, [r, c]) = scale_shapes(m, k);
    let padded = pad(compact, m / BLOCK, k, r, c, 1);
    if swizzled {
        swizzle(&transpose(&padded, r, c), c, r).expect("padded grid")
    } else {
        padded
    }
}

/// Compact `[m, k/32]` rowwise scales from a scale buffer.
pub(crate) fn rowwise_compact(buf: &[u8], m: usize, k: usize, swizzled: bool) -> Result<Vec<u8>> {
    let ([r, c], _) = scale_shapes(m, k);
    let padded = if swizzled {
        unswizzle(buf, r, c)?
    } else {
        buf.to_vec()
    };
    Ok(crate::layout::strip_padding(&padded, c, m, k / BLOCK, 1))
}

/// Compact `[m/32, k]` columnwise scales from a scale buffer.
pub(crate) fn columnwise_compact(
    buf: &[u8],
    m: usize,
    k: usize,
    swizzled: bool,
) -> Result<Vec<u8>> {
    let (_, [r, c]) = scale_shapes(m, k);
    let padded = if swizzled {
        transpose(&unswizzle(buf, c, r)?, c, r)
    } else {
        buf.to_vec()
    };
    Ok(crate::layout::strip_padding(&padded, c, m / BLOCK, k, 1))
}

pub(crate) fn buffer_specs(format: Fp8Format, shape: &Shape) -> Vec<BufferSpec> {
    let (m, k) = shape.flat_2d();
    let (rs, cs) = scale_shapes(m, k);
    vec![
        BufferSpec {
            name: BufferName::Data,
            dtype: format.dtype(),
            shape: shape.clone(),
        },
        BufferSpec {
            name: BufferName::ScaleInv,
            dtype: DType::E8M0,
            shape: Shape::new(rs),
        },
        BufferSpec {
            name: BufferName::ColumnwiseData,
            dtype: format.dtype(),
            shape: shape.clone(),
        },
        BufferSpec {
            name: BufferName::ColumnwiseScaleInv,
            dtype: DType::E8M0,
            shape: Shape::new(cs),
        },
    ]
}

/// The MXFP8 quantizer (TE's `MXFP8Quantizer`).
#[derive(Debug, Clone)]
pub struct Mxfp8Quantizer {
    format: Fp8Format,
    usage: Usage,
    two_d: bool,
    swizzled: bool,
}

impl Mxfp8Quantizer {
    /// 1-D blocks, both usages, compact scales.
    pub fn new(format: Fp8Format) -> Self {
        Mxfp8Quantizer {
            format,
            usage: Usage::Both,
            two_d: false,
            swizzled: false,
        }
    }

    /// One scale per 32×32 tile (TE's `enable_2d_quantization`, for weights).
    pub fn with_2d(mut self, two_d: bool) -> Self {
        self.two_d = two_d;
        self
    }

    /// Scales in cuBLAS's GEMM-swizzled layout (TE's `optimize_for_gemm`).
    pub fn with_swizzled_scales(mut self, swizzled: bool) -> Self {
        self.swizzled = swizzled;
        self
    }

    /// The usages to produce.
    pub fn with_usage(mut self, usage: Usage) -> Self {
        self.usage = usage;
        self
    }
}

impl Quantizer for Mxfp8Quantizer {
    fn kind(&self) -> Kind {
        Kind::Mxfp8 {
            format: self.format,
            two_d: self.two_d,
            swizzled: self.swizzled,
        }
    }
    fn usage(&self) -> Usage {
        self.usage
    }
    fn set_usage(&mut self, usage: Usage) {
        self.usage = usage;
    }
    fn check_shape(&self, shape: &Shape) -> Result<()> {
        crate::check_block_multiple("Mxfp8Quantizer", "MXFP8", BLOCK, shape)
    }
    fn is_quantizable(&self, shape: &Shape) -> bool {
        shape.rank() >= 2 && self.check_shape(shape).is_ok()
    }
    fn quantize_into(&mut self, x: &Tensor, out: &mut QuantizedTensor) -> Result<()> {
        crate::check_into("Quantizer::quantize_into", &self.kind(), x, out)?;
        if x.device().is_cuda() {
            self.check_shape(x.shape())?;
            #[cfg(feature = "cuda")]
            return crate::cuda::mxfp8::quantize_into(
                x,
                self.format,
                self.two_d,
                self.swizzled,
                out,
            );
            #[cfg(not(feature = "cuda"))]
            return Err(tessera_core::Error::no_cuda_feature(
                "quantizing a CUDA tensor",
            ));
        }
        let q = self.quantize(x)?;
        out.replace_buffers(q)
    }
    fn quantize(&mut self, x: &Tensor) -> Result<QuantizedTensor> {
        const OP: &str = "Mxfp8Quantizer::quantize";
        if x.device().is_cuda() {
            return crate::quantize_on_device(self, x);
        }
        let (m, k) = check_input(OP, x)?;
        self.check_shape(x.shape())?;
        let v = Values::new(OP, x)?;
        let specs = buffer_specs(self.format, x.shape());
        let mut out: BTreeMap<BufferName, Vec<u8>> = BTreeMap::new();
        if self.two_d {
            let (data, tiles) = two_d(&v, m, k, self.format);
            if self.usage.rowwise() {
                let compact: Vec<u8> = (0..m)
                    .flat_map(|r| &tiles[r / BLOCK * (k / BLOCK)..][..k / BLOCK])
                    .copied()
                    .collect();
                out.insert(
                    BufferName::ScaleInv,
                    rowwise_scale_buffer(&compact, m, k, self.swizzled),
                );
                out.insert(BufferName::Data, data.clone());
            }
            if self.usage.columnwise() {
                let compact: Vec<u8> = (0..m / BLOCK)
                    .flat_map(|i| (0..k).map(move |c| (i, c)))
                    .map(|(i, c)| tiles[i * (k / BLOCK) + c / BLOCK])
                    .collect();
                out.insert(
                    BufferName::ColumnwiseScaleInv,
                    columnwise_scale_buffer(&compact, m, k, self.swizzled),
                );
                out.insert(BufferName::ColumnwiseData, data);
            }
        } else {
            if self.usage.rowwise() {
                let (data, s) = rowwise(&v, m, k, self.format);
                out.insert(BufferName::Data, data);
                out.insert(
                    BufferName::ScaleInv,
                    rowwise_scale_buffer(&s, m, k, self.swizzled),
                );
            }
            if self.usage.columnwise() {
                let (data, s) = columnwise(&v, m, k, self.format);
                out.insert(BufferName::ColumnwiseData, data);
                out.insert(
                    BufferName::ColumnwiseScaleInv,
                    columnwise_scale_buffer(&s, m, k, self.swizzled),
                );
            }
        }
        crate::assemble(self.kind(), x, &specs, out)
    }
}

/// Dequantized values (logical order) of one orientation.
pub(crate) fn dequantize(
    qt: &QuantizedTensor,
    format: Fp8Format,
    swizzled: bool,
    columnwise: bool,
) -> Result<Vec<f32>> {
    let (m, k) = qt.shape.flat_2d();
    let (q, sbuf) = qt.data_and_scales(columnwise)?;
    let (q, sbuf) = (q.as_bytes()?, sbuf.as_bytes()?);
    let nb = k / BLOCK;
    let out = if columnwise {
        let s = columnwise_compact(sbuf, m, k, swizzled)?;
        (0..m * k)
            .into_par_iter()
            .map(|i| format.decode(q[i]) * decode_e8m0(s[(i / k / BLOCK) * k + i % k]))
            .collect()
    } else {
        let s = rowwise_compact(sbuf, m, k, swizzled)?;
        (0..m * k)
            .into_par_iter()
            .map(|i| format.decode(q[i]) * decode_e8m0(s[(i / k) * nb + (i % k) / BLOCK]))
            .collect()
    };
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn worked_example() {
        // spec §4.3: a block with amax 10 → e = 122 (multiplier 32).
        let mut row = vec![0.0f32; 32];
        row[..4].copy_from_slice(&[10.0, -3.3, 0.01, 7.77]);
        let (data, s) = quantize_rowwise(&row, 1, 32, Fp8Format::E4M3);
        assert_eq!(s, [122]);
        assert_eq!(&data[..4], &[0x7A, 0xED, 0x2A, 0x78]);
    }

    #[test]
    fn special_values_in_a_block() {
        let mut row = vec![1.0f32; 32];
        row[3] = f32::NAN;
        row[4] = f32::INFINITY;
        let (data, s) = quantize_rowwise(&row, 1, 32, Fp8Format::E4M3);
        assert_eq!(s, [0xFE]);
        assert_eq!(data[3], 0x7F);
        assert_eq!(data[4], 0x7E);
        assert_eq!(data[0], 0x00); // finite values flush to zero
        let (_, s) = quantize_rowwise(&[0.0; 32], 1, 32, Fp8Format::E4M3);
        assert_eq!(s, [0]);
    }
}
