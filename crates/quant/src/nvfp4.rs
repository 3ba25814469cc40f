//! NVFP4: E2M1 values with one E4M3 scale per 16 elements and a float32 global amax
//! (`spec/formats.md` §5), with 1×16 or 16×16 blocks, the random Hadamard transform on
//! the columnwise operand, and stochastic rounding from a tessera-rng Philox stream.
//!
//! Buffers (M, K multiples of 16): `data` (the input shape with the last dim halved, two
//! codes per byte, element `2j` in the low nibble), `columnwise_data` `[K, M/2]` (the
//! packed transpose, always 2-D), `scale_inv` E4M3 `[roundup(M,128), roundup(K/16,4)]`,
//! `columnwise_scale_inv` E4M3 `[roundup(K,128), roundup(M/16,4)]`, and the global
//! amaxes `amax`, `columnwise_amax` (`f32 [1]`).
//!
//! # Stochastic rounding
//!
//! With stochastic rounding on, each quantize call draws, from the quantizer's
//! [`Generator`], `ceil(M·K/4)` words for the rowwise operand and then as many for the
//! columnwise operand. Element `e` of an operand (row-major: `x` rowwise, the
//! (transformed) `xᵀ` columnwise) rounds with byte `e % 4` (bits `8·(e%4)..`) of word
//! `e / 4` (see [`encode_e2m1_stochastic`]).
//!
//! # Random Hadamard transform
//!
//! Each run of 16 consecutive elements `v` of a row of `xᵀ` becomes `y = v·(diag(s)·H₁₆)/4`
//! with the Sylvester Hadamard matrix `H₁₆` and TE's sign vector `s`, computed in float32
//! as a fast Walsh–Hadamard transform ([`rht16`]): `u_t = v_t·(s_t/4)` (exact for 2-byte
//! inputs), then four butterfly stages `(a, b) → (a + b, a − b)` over the index pairs
//! `(i, i + h)`, `h = 1, 2, 4, 8`. Each output is 4 roundings deep instead of the 15 of a
//! running sum, and the transform costs 4 additions per element instead of 16. When a
//! run's magnitudes span at most 2^12 (most runs) every sum is exact, so any order gives
//! these bytes; TE computes the sums on tensor cores, whose accumulation order is
//! unspecified, so its bytes can differ in the last bit of a transformed value of a
//! wider run. tessera's CPU and CUDA paths agree with each other exactly.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;

use rayon::prelude::*;
use tessera_core::{DType, Result, Shape, Tensor};
use tessera_rng::Generator;

use crate::cast::{decode_e2m1, decode_e4m3, encode_e2m1, encode_e2m1_stochastic, encode_e4m3};
use crate::layout::{pad, roundup, swizzle, transpose, unswizzle};
use crate::scale::amax;
use crate::values::{CHUNK, Operand, Values, check_input};
use crate::{AmaxReduction, BufferName, BufferSpec, Kind, QuantizedTensor, Quantizer, Usage};

/// Elements per NVFP4 block.
pub const BLOCK: usize = 16;

/// TE's sign vector of the wgrad RHT (`get_wgrad_sign_vector`).
pub const RHT_SIGNS: [f32; 16] = [
    1.0, 1.0, 1.0, -1.0, 1.0, -1.0, -1.0, -1.0, -1.0, -1.0, -1.0, 1.0, -1.0, 1.0, -1.0, -1.0,
];

/// `S_enc = min(fp32(2688 / A), FLT_MAX)`, or 1 when `A` is 0 or the quotient is 0
/// (`A = inf`).
pub fn global_encode_scale(a: f32) -> f32 {
    if a == 0.0 {
        return 1.0;
    }
    let s = (448.0f32 * 6.0) / a;
    if s == 0.0 { 1.0 } else { s.min(f32::MAX) }
}

/// The E4M3 byte of a block's decode scale: `sat_e4m3(min(b · fp32(S_enc · fp32(1/6)),
/// FLT_MAX))`.
#[inline]
pub fn block_scale(b: f32, s_enc: f32) -> u8 {
    encode_e4m3((b * (s_enc * (1.0f32 / 6.0))).min(f32::MAX))
}

/// The block encode scale `min(fp32(1 / fp32(e4m3 · S_dec)), FLT_MAX)`.
#[inline]
pub fn block_encode_scale(e4m3: u8, s_dec: f32) -> f32 {
    (1.0 / (decode_e4m3(e4m3) * s_dec)).min(f32::MAX)
}

/// The unnormalised Walsh–Hadamard transform `u·H₁₆` in place: butterflies
/// `(u_i, u_{i+h}) → (u_i + u_{i+h}, u_i − u_{i+h})` for every `i` with `i & h == 0`, in
/// stages `h = 1, 2, 4, 8` (the order the CUDA kernels follow).
fn fwht16(u: &mut [f32; 16]) {
    for h in [1, 2, 4, 8] {
        for i in (0..16).filter(|i| i & h == 0) {
            let (a, b) = (u[i], u[i + h]);
            u[i] = a + b;
            u[i + h] = a - b;
        }
    }
}

/// `y = v·(diag(s)·H₁₆)/4` of the first 16 elements of `v`: `u_t = v_t·(s_t/4)`, then the
/// four butterfly stages (module docs).
pub fn rht16(v: &[f32]) -> [f32; 16] {
    let mut u: [f32; 16] = std::array::from_fn(|t| v[t] * (RHT_SIGNS[t] * 0.25));
    fwht16(&mut u);
    u
}

/// The inverse transform `v = y·(H₁₆·diag(s))/4` of the first 16 elements of `y`:
/// `u_j = y_j/4`, the four butterfly stages, then `v_t = u_t·s_t`.
pub fn inverse_rht16(y: &[f32]) -> [f32; 16] {
    let mut u: [f32; 16] = std::array::from_fn(|j| y[j] * 0.25);
    fwht16(&mut u);
    std::array::from_fn(|t| u[t] * RHT_SIGNS[t])
}

/// Applies `f` to every run of 16 along the rows of an operand: a row-major f32 result.
fn map_runs(x: &Operand<'_>, f: fn(&[f32]) -> [f32; 16]) -> Vec<f32> {
    let (rows, cols) = (x.rows(), x.cols());
    let mut out = vec![0.0f32; rows * cols];
    if cols == 0 {
        return out;
    }
    let g = x.group();
    out.par_chunks_mut(g * cols)
        .enumerate()
        .with_min_len(CHUNK.div_ceil(g * cols))
        .for_each_init(Vec::new, |buf, (i, o)| {
            let v = x.read_rows(i * g, o.len() / cols, buf);
            for (o, v) in o.chunks_mut(BLOCK).zip(v.chunks(BLOCK)) {
                o.copy_from_slice(&f(v));
            }
        });
    out
}

/// The per-block amaxes `[rows, cols/16]` of a `[rows, cols]` operand, 1×16 blocks.
pub fn block_amax_1d(v: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let nb = cols / BLOCK;
    let mut out = vec![0.0f32; rows * nb];
    out.par_chunks_mut(nb.max(1))
        .enumerate()
        .with_min_len(CHUNK.div_ceil(cols.max(1)))
        .for_each(|(r, o)| {
            for (a, blk) in o.iter_mut().zip(v[r * cols..][..cols].chunks_exact(BLOCK)) {
                *a = amax(blk);
            }
        });
    out
}

/// The 16×16 tile amaxes `[m/16, k/16]` of an `[m, k]` matrix.
pub fn tile_amax(x: &[f32], m: usize, k: usize) -> Vec<f32> {
    tile_amaxes(&Values::from_f32(x), m, k)
}

/// [`tile_amax`] of f32, bf16 or f16 values.
fn tile_amaxes(x: &Values<'_>, m: usize, k: usize) -> Vec<f32> {
    let (mb, kb) = (m / BLOCK, k / BLOCK);
    let mut out = vec![0.0f32; mb * kb];
    out.par_chunks_mut(kb.max(1))
        .enumerate()
        .for_each_init(Vec::new, |buf, (i, o)| {
            let xblk = x.read(i * BLOCK * k, BLOCK * k, buf);
            for xrow in xblk.chunks_exact(k) {
                for (a, blk) in o.iter_mut().zip(xrow.chunks_exact(BLOCK)) {
                    *a = a.max(amax(blk));
                }
            }
        });
    out
}

/// Quantizes a `[rows, cols]` operand with global amax `a`, where block `(r, j)` has amax
/// `block_amax[r·(cols/16) + j]`. Returns the packed codes `[rows, cols/2]` and the
/// compact E4M3 scales `[rows, cols/16]`. `random` holds the operand's
/// stochastic-rounding words.
pub fn quantize_operand(
    v: &[f32],
    rows: usize,
    cols: usize,
    block_amax: &[f32],
    a: f32,
    random: Option<&[u32]>,
) -> (Vec<u8>, Vec<u8>) {
    let v = Values::from_f32(v);
    operand(&Operand::new(&v, rows, cols), Some(block_amax), a, random)
}

/// [`quantize_operand`] of f32, bf16 or f16 values; `block_amax: None` stands for the
/// amaxes of the operand's own 1×16 blocks, computed on the way.
fn operand(
    x: &Operand<'_>,
    block_amax: Option<&[f32]>,
    a: f32,
    random: Option<&[u32]>,
) -> (Vec<u8>, Vec<u8>) {
    let (rows, cols) = (x.rows(), x.cols());
    let nb = cols / BLOCK;
    let s_enc = global_encode_scale(a);
    let s_dec = 1.0 / s_enc;
    // The block encode scale of each of the 256 scale bytes (one division each).
    let encode_scale: [f32; 256] = std::array::from_fn(|e| block_encode_scale(e as u8, s_dec));
    let mut codes = vec![0u8; rows * cols / 2];
    let mut scales = vec![0u8; rows * nb];
    if nb == 0 {
        return (codes, scales); // no whole block to encode
    }
    // Row r: its codes [cols/2] and E4M3 scales [cols/16] from its values.
    let operand_row = |r: usize, xrow: &[f32], crow: &mut [u8], srow: &mut [u8]| {
        let blocks = xrow
            .chunks_exact(BLOCK)
            .zip(crow.chunks_exact_mut(BLOCK / 2));
        for (j, ((blk, cblk), s)) in blocks.zip(srow).enumerate() {
            let b = match block_amax {
                Some(ba) => ba[r * nb + j],
                None => amax(blk),
            };
            let e = block_scale(b, s_enc);
            *s = e;
            let g = encode_scale[usize::from(e)];
            let mut q = [0u8; BLOCK];
            match random {
                None => {
                    for (q, &x) in q.iter_mut().zip(blk) {
                        *q = encode_e2m1(x * g);
                    }
                }
                Some(w) => {
                    // Element e of the operand rounds with byte e % 4 of word e / 4.
                    let e0 = r * cols + j * BLOCK;
                    for (i, (q, &x)) in q.iter_mut().zip(blk).enumerate() {
                        let e = e0 + i;
                        *q = encode_e2m1_stochastic(x * g, (w[e / 4] >> (8 * (e % 4))) as u8);
                    }
                }
            }
            for (c, pair) in cblk.iter_mut().zip(q.chunks_exact(2)) {
                *c = pair[0] | pair[1] << 4;
            }
        }
    };
    // One task per group of rows (x.group() of them per read).
    let g = x.group();
    codes
        .par_chunks_mut(g * (cols / 2))
        .zip(scales.par_chunks_mut(g * nb))
        .enumerate()
        .with_min_len(CHUNK.div_ceil(g * cols))
        .for_each_init(Vec::new, |buf, (i, (cgroup, sgroup))| {
            let xgroup = x.read_rows(i * g, sgroup.len() / nb, buf);
            let rows_of_group = xgroup
                .chunks_exact(cols)
                .zip(cgroup.chunks_exact_mut(cols / 2))
                .zip(sgroup.chunks_exact_mut(nb));
            for (r, ((xrow, crow), srow)) in (i * g..).zip(rows_of_group) {
                operand_row(r, xrow, crow, srow);
            }
        });
    (codes, scales)
}

/// Padded scale-buffer shapes `(rowwise, columnwise)` for an `[m, k]` matrix.
pub fn scale_shapes(m: usize, k: usize) -> ([usize; 2], [usize; 2]) {
    (
        [roundup(m, 128), roundup(k / BLOCK, 4)],
        [roundup(k, 128), roundup(m / BLOCK, 4)],
    )
}

/// A scale buffer `[rows_padded, cols_padded]` from compact `[rows, cols]` scales.
pub fn scale_buffer(
    compact: &[u8],
    rows: usize,
    cols: usize,
    padded: [usize; 2],
    swizzled: bool,
) -> Vec<u8> {
    let p = pad(compact, rows, cols, padded[0], padded[1], 1);
    if swizzled {
        swizzle(&p, padded[0], padded[1]).expect("padded grid")
    } else {
        p
    }
}

pub(crate) fn compact_scales(
    buf: &[u8],
    rows: usize,
    cols: usize,
    padded: [usize; 2],
    swizzled: bool,
) -> Result<Vec<u8>> {
    let p = if swizzled {
        unswizzle(buf, padded[0], padded[1])?
    } else {
        buf.to_vec()
    };
    Ok(crate::layout::strip_padding(&p, padded[1], rows, cols, 1))
}

/// The data shape of an NVFP4 tensor: `shape` with the last dimension halved.
fn packed_shape(shape: &Shape) -> Shape {
    let mut d = shape.dims().to_vec();
    if let Some(last) = d.last_mut() {
        *last /= 2;
    }
    Shape::new(d)
}

pub(crate) fn buffer_specs(shape: &Shape) -> Vec<BufferSpec> {
    let (m, k) = shape.flat_2d();
    let (rs, cs) = scale_shapes(m, k);
    vec![
        BufferSpec {
            name: BufferName::Data,
            dtype: DType::F4E2M1x2,
            shape: packed_shape(shape),
        },
        BufferSpec {
            name: BufferName::ScaleInv,
            dtype: DType::F8E4M3,
            shape: Shape::new(rs),
        },
        BufferSpec {
            name: BufferName::ColumnwiseData,
            dtype: DType::F4E2M1x2,
            shape: Shape::new([k, m / 2]),
        },
        BufferSpec {
            name: BufferName::ColumnwiseScaleInv,
            dtype: DType::F8E4M3,
            shape: Shape::new(cs),
        },
        BufferSpec {
            name: BufferName::Amax,
            dtype: DType::F32,
            shape: Shape::new([1]),
        },
        BufferSpec {
            name: BufferName::ColumnwiseAmax,
            dtype: DType::F32,
            shape: Shape::new([1]),
        },
    ]
}

/// The NVFP4 quantizer (TE's `NVFP4Quantizer`).
#[derive(Clone)]
pub struct Nvfp4Quantizer {
    usage: Usage,
    two_d: bool,
    rht: bool,
    swizzled: bool,
    rng: Option<Generator>,
    reduction: Option<Arc<dyn AmaxReduction>>,
}

impl Nvfp4Quantizer {
    /// 1-D blocks, both usages, no RHT, round-to-nearest, compact scales.
    pub fn new() -> Self {
        Nvfp4Quantizer {
            usage: Usage::Both,
            two_d: false,
            rht: false,
            swizzled: false,
            rng: None,
            reduction: None,
        }
    }

    /// One scale per 16×16 tile (TE's default for weights).
    pub fn with_2d(mut self, two_d: bool) -> Self {
        self.two_d = two_d;
        self
    }

    /// The random Hadamard transform of the columnwise operand (TE's default for
    /// inputs and gradients).
    pub fn with_rht(mut self, rht: bool) -> Self {
        self.rht = rht;
        self
    }

    /// Scales in cuBLAS's GEMM-swizzled layout.
    pub fn with_swizzled_scales(mut self, swizzled: bool) -> Self {
        self.swizzled = swizzled;
        self
    }

    /// Stochastic rounding with random bits from `generator` (TE's default for
    /// gradients); `None` rounds to nearest.
    pub fn with_stochastic_rounding(mut self, generator: Option<Generator>) -> Self {
        self.rng = generator;
        self
    }

    /// The stochastic-rounding generator, if any (its offset advances with each call).
    pub fn generator(&self) -> Option<&Generator> {
        self.rng.as_ref()
    }

    /// The usages to produce.
    pub fn with_usage(mut self, usage: Usage) -> Self {
        self.usage = usage;
        self
    }

    /// All-reduce (MAX) the global amaxes over a group before quantizing.
    pub fn with_amax_reduction(mut self, reduction: Arc<dyn AmaxReduction>) -> Self {
        self.reduction = Some(reduction);
        self
    }

    fn reduce(&self, a: f32) -> Result<f32> {
        match &self.reduction {
            Some(r) => r.all_reduce_max(a),
            None => Ok(a),
        }
    }

    fn draw(&mut self, n: usize) -> Option<Vec<u32>> {
        self.rng.as_mut().map(|g| {
            let mut w = vec![0u32; n.div_ceil(4)];
            g.fill_u32(&mut w);
            w
        })
    }
}

impl Default for Nvfp4Quantizer {
    fn default() -> Self {
        Self::new()
    }
}

impl fmt::Debug for Nvfp4Quantizer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Nvfp4Quantizer")
            .field("usage", &self.usage)
            .field("two_d", &self.two_d)
            .field("rht", &self.rht)
            .field("swizzled", &self.swizzled)
            .field(
                "stochastic_rounding",
                &self.rng.as_ref().map(Generator::state),
            )
            .field("amax_reduction", &self.reduction.is_some())
            .finish()
    }
}

impl Quantizer for Nvfp4Quantizer {
    fn kind(&self) -> Kind {
        Kind::Nvfp4 {
            two_d: self.two_d,
            rht: self.rht,
            swizzled: self.swizzled,
        }
    }
    fn usage(&self) -> Usage {
        self.usage
    }
    fn set_usage(&mut self, usage: Usage) {
        self.usage = usage;
    }
    fn set_amax_reduction(&mut self, reduction: Option<Arc<dyn AmaxReduction>>) {
        self.reduction = reduction;
    }
    fn check_shape(&self, shape: &Shape) -> Result<()> {
        crate::check_block_multiple("Nvfp4Quantizer", "NVFP4", BLOCK, shape)
    }
    fn is_quantizable(&self, shape: &Shape) -> bool {
        shape.rank() >= 2 && self.check_shape(shape).is_ok()
    }
    fn quantize_into(&mut self, x: &Tensor, out: &mut QuantizedTensor) -> Result<()> {
        crate::check_into("Quantizer::quantize_into", &self.kind(), x, out)?;
        if x.device().is_cuda() {
            check_input("Nvfp4Quantizer::quantize", x)?;
            self.check_shape(x.shape())?;
            #[cfg(feature = "cuda")]
            return crate::cuda::nvfp4::quantize_into(
                x,
                self.two_d,
                self.rht,
                self.swizzled,
                self.rng.as_mut(),
                self.reduction.as_ref(),
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
        const OP: &str = "Nvfp4Quantizer::quantize";
        if x.device().is_cuda() {
            return crate::quantize_on_device(self, x);
        }
        let (m, k) = check_input(OP, x)?;
        self.check_shape(x.shape())?;
        let v = Values::new(OP, x)?;
        let (rs, cs) = scale_shapes(m, k);
        let a_row = self.reduce(v.amax())?;
        let mut out: BTreeMap<BufferName, Vec<u8>> = BTreeMap::new();
        let tiles = self.two_d.then(|| tile_amaxes(&v, m, k));
        if self.usage.rowwise() {
            // 1-D: the blocks' own amaxes (None); 2-D: each row's tile amaxes.
            let block_amax: Option<Vec<f32>> = tiles.as_ref().map(|t| {
                (0..m)
                    .flat_map(|r| &t[r / BLOCK * (k / BLOCK)..][..k / BLOCK])
                    .copied()
                    .collect()
            });
            let random = self.draw(m * k);
            let x = Operand::new(&v, m, k);
            let (codes, s) = operand(&x, block_amax.as_deref(), a_row, random.as_deref());
            out.insert(BufferName::Data, codes);
            out.insert(
                BufferName::ScaleInv,
                scale_buffer(&s, m, k / BLOCK, rs, self.swizzled),
            );
            out.insert(BufferName::Amax, a_row.to_le_bytes().to_vec());
        }
        if self.usage.columnwise() {
            // With the RHT, the transformed xᵀ (in f32); without, xᵀ is gathered from x
            // as the operand is read.
            let transformed = self
                .rht
                .then(|| Values::F32(map_runs(&Operand::transpose_of(&v, m, k), rht16).into()));
            let (xt, a_col) = match &transformed {
                Some(t) => (Operand::new(t, k, m), self.reduce(t.amax())?),
                None => (Operand::transpose_of(&v, m, k), a_row),
            };
            let block_amax: Option<Vec<f32>> = match (&tiles, &transformed) {
                (Some(t), None) => Some(
                    (0..k)
                        .flat_map(|c| (0..m / BLOCK).map(move |i| (c, i)))
                        .map(|(c, i)| t[i * (k / BLOCK) + c / BLOCK])
                        .collect(),
                ),
                (Some(_), Some(t)) => {
                    // Tiles of the transformed operand.
                    let tt = tile_amaxes(t, k, m);
                    Some(
                        (0..k)
                            .flat_map(|c| &tt[c / BLOCK * (m / BLOCK)..][..m / BLOCK])
                            .copied()
                            .collect(),
                    )
                }
                (None, _) => None,
            };
            let random = self.draw(m * k);
            let (codes, s) = operand(&xt, block_amax.as_deref(), a_col, random.as_deref());
            out.insert(BufferName::ColumnwiseData, codes);
            out.insert(
                BufferName::ColumnwiseScaleInv,
                scale_buffer(&s, k, m / BLOCK, cs, self.swizzled),
            );
            out.insert(BufferName::ColumnwiseAmax, a_col.to_le_bytes().to_vec());
        }
        crate::assemble(self.kind(), x, &buffer_specs(x.shape()), out)
    }
}

/// The global amax buffer of one orientation of an NVFP4 tensor (`columnwise`: the
/// transposed operand's), or an error naming it when the tensor lacks it.
pub(crate) fn amax_buffer(qt: &QuantizedTensor, columnwise: bool) -> Result<&Tensor> {
    let n = if columnwise {
        BufferName::ColumnwiseAmax
    } else {
        BufferName::Amax
    };
    qt.buffer(n).ok_or_else(|| crate::fp8::missing(n))
}

/// Dequantized values (logical order) of one orientation. The columnwise data of an RHT
/// tensor is transformed back.
pub(crate) fn dequantize(
    qt: &QuantizedTensor,
    rht: bool,
    swizzled: bool,
    columnwise: bool,
) -> Result<Vec<f32>> {
    let (m, k) = qt.shape.flat_2d();
    let (rs, cs) = scale_shapes(m, k);
    let (rows, cols, padded) = if columnwise { (k, m, cs) } else { (m, k, rs) };
    let (codes, s) = qt.data_and_scales(columnwise)?;
    let codes = codes.as_bytes()?;
    let a = amax_buffer(qt, columnwise)?.as_slice::<f32>()?[0];
    let s = compact_scales(s.as_bytes()?, rows, cols / BLOCK, padded, swizzled)?;
    let nb = cols / BLOCK;
    let v: Vec<f32> = (0..rows * cols)
        .into_par_iter()
        .map(|e| {
            let byte = codes[e / 2];
            let code = if e % 2 == 0 { byte & 0xF } else { byte >> 4 };
            let scale =
                (decode_e4m3(s[(e / cols) * nb + (e % cols) / BLOCK]) * a) * (1.0f32 / 2688.0);
            decode_e2m1(code) * scale
        })
        .collect();
    Ok(if columnwise {
        let v = if rht {
            map_runs(&Operand::new(&Values::from_f32(&v), k, m), inverse_rht16)
        } else {
            v
        };
        transpose(&v, k, m)
    } else {
        v
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use tessera_core::Device;

    #[test]
    fn worked_example() {
        // spec §5.4: 16×16, only row 0 non-zero.
        let mut x = vec![0.0f32; 256];
        x[..6].copy_from_slice(&[12.0, -3.0, 1.1, 0.2, -0.3, 5.0]);
        let t = Tensor::from_slice(&x, [16, 16], Device::Cpu).unwrap();
        let q = Nvfp4Quantizer::new().quantize(&t).unwrap();
        let data = q.buffer(BufferName::Data).unwrap().as_bytes().unwrap();
        assert_eq!(&data[..3], &[0xB7, 0x01, 0x48]);
        let s = q.buffer(BufferName::ScaleInv).unwrap().as_bytes().unwrap();
        assert_eq!(s[0], 0x7E);
        assert_eq!(
            q.buffer(BufferName::Amax)
                .unwrap()
                .as_slice::<f32>()
                .unwrap(),
            &[12.0]
        );
        // Columnwise: column 0 holds only 12 → scale 0x7E, packed byte 0x07; column 2
        // holds only 1.1 → E4M3 40 (0x62).
        let cd = q
            .buffer(BufferName::ColumnwiseData)
            .unwrap()
            .as_bytes()
            .unwrap();
        assert_eq!(cd[0], 0x07);
        let cs = q.buffer(BufferName::ColumnwiseScaleInv).unwrap();
        let cols = cs.shape().dims()[1];
        assert_eq!(cs.as_bytes().unwrap()[0], 0x7E);
        assert_eq!(cs.as_bytes().unwrap()[2 * cols], 0x62);
        let d = q.dequantize(DType::F32).unwrap();
        assert_eq!(
            &d.as_slice::<f32>().unwrap()[..6],
            &[12.0, -3.0, 1.0, 0.0, -0.0, 4.0]
        );
        assert_eq!(global_encode_scale(12.0), 224.0);
        assert_eq!(12.0 * (224.0f32 * (1.0 / 6.0)), 448.000_03);
    }

    #[test]
    fn rht_inverts_and_is_orthogonal() {
        let v: Vec<f32> = (0..16).map(|i| (i as f32 - 7.5) * 0.375).collect();
        let y = rht16(&v);
        let back = inverse_rht16(&y);
        for (a, b) in v.iter().zip(back) {
            assert!((a - b).abs() < 1e-6, "{a} {b}");
        }
        let n2 = |x: &[f32]| x.iter().map(|v| v * v).sum::<f32>();
        assert!((n2(&v) - n2(&y)).abs() < 1e-3);
    }

    #[test]
    fn rht_is_exact_when_a_run_spans_at_most_2_pow_12() {
        // bf16-precision values (8 significant bits) with exponents within 12 of each
        // other: every butterfly sum is exact, so each output is the exact transform.
        let mut g = Generator::new(41);
        let mut w = vec![0u32; 16 * 64];
        g.fill_u32(&mut w);
        for run in w.chunks(16) {
            let e0 = (run[0] % 200) as i32 - 100;
            let v: Vec<f32> = run
                .iter()
                .map(|&r| {
                    let m = f64::from(r >> 24) / 128.0 + 1.0; // 1 + 7 bits: 8 significant
                    let s = if r & 1 == 0 { 1.0 } else { -1.0 };
                    (s * m * 2f64.powi(e0 + ((r >> 8) % 13) as i32)) as f32
                })
                .collect();
            let y = rht16(&v);
            for (j, &yj) in y.iter().enumerate() {
                let exact: f64 = (0..16)
                    .map(|t| {
                        let h = if (t & j).count_ones() % 2 == 0 {
                            0.25
                        } else {
                            -0.25
                        };
                        f64::from(v[t]) * f64::from(RHT_SIGNS[t]) * h
                    })
                    .sum();
                assert_eq!(yj.to_bits(), (exact as f32).to_bits(), "{v:?} output {j}");
            }
            let back = inverse_rht16(&y);
            assert_eq!(
                back.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                v.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
            );
        }
    }

    #[test]
    fn rht_adds_in_butterfly_order() {
        // u = v·s/4 = [1, 0, 2^-24, 2^-24, 0, ...]. A running sum rounds 1 + 2^-24 back
        // to 1 twice; the butterfly adds the two small terms first (stage 1, pair (2, 3))
        // and gets the exact 1 + 2^-23.
        let mut v = [0.0f32; 16];
        v[0] = 4.0;
        v[2] = 2f32.powi(-22);
        v[3] = -(2f32.powi(-22));
        assert_eq!(rht16(&v)[0], 1.0 + 2f32.powi(-23));
    }

    #[test]
    fn underflowing_block_scale_saturates_codes() {
        // Block amax tiny beside the tensor amax: E4M3 scale 0, codes ±6, dequantized 0.
        let mut x = vec![0.0f32; 32];
        x[0] = 1e6;
        x[16] = 1e-3;
        let t = Tensor::from_slice(&x, [1, 32], Device::Cpu).unwrap();
        let q = Nvfp4Quantizer::new()
            .with_usage(Usage::Rowwise)
            .check_shape(t.shape());
        assert!(q.is_err(), "M = 1 is not a multiple of 16");
        let (codes, s) = quantize_operand(&x, 1, 32, &block_amax_1d(&x, 1, 32), 1e6, None);
        assert_eq!(s[1], 0);
        assert_eq!(codes[8] & 0xF, 7);
    }
}
