//! How each buffer of a quantized tensor behaves under a first-dimension all-gather,
//! and the one generic gather built on that description.
//!
//! TransformerEngine's `distributed.py` has a separate gather per format. Here every
//! format describes its buffers instead ([`layout`]), and one algorithm serves all:
//!
//! 1. [`pack`]: each rank takes the valid region of each gathered buffer in compact
//!    layout (scale padding stripped, swizzled scales unswizzled) as a `[rows, cols]`
//!    matrix;
//! 2. the collective concatenates the ranks' matrices along dim 0;
//! 3. [`unpack`]: buffers whose rows follow M ([`Gather::Rows`]) are complete;
//!    buffers whose columns follow M ([`Gather::Columns`]: transposed data, M-inner
//!    scales) are interleaved with `swap_first_dims`; then padding is restored (zeros)
//!    and scales are swizzled again where the format asks for it. Per-tensor metadata
//!    ([`Gather::Replicated`]) is taken from the local rank — correct because every
//!    rank quantized with the same all-reduced amax (the collectives do that first).
//!
//! [`gather_reference`] runs the three steps on a list of per-rank tensors in one
//! process; its result equals quantizing the concatenated input.

use std::collections::BTreeMap;

use tessera_core::{DType, Device, Error, Result, Shape, Tensor};

use crate::layout::{pad, strip_padding};
use crate::{BlockDim, BufferName, Kind, QuantizedTensor, block, buffer_specs, mxfp8, nvfp4};

/// How one buffer travels in a first-dimension all-gather.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Gather {
    /// Its rows follow M: rank matrices are concatenated along dim 0 as they are.
    Rows,
    /// Its columns follow M: after concatenation, `swap_first_dims` makes each row the
    /// concatenation of that row across ranks.
    Columns,
    /// The same on every rank; not communicated.
    Replicated,
}

/// The wire description of one buffer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WireBuffer {
    /// Which buffer.
    pub name: BufferName,
    /// Its dtype.
    pub dtype: DType,
    /// How it is gathered.
    pub gather: Gather,
    /// The valid region of the local buffer as a `[rows, cols]` matrix of elements, in
    /// compact layout (what [`pack`] produces).
    pub valid: [usize; 2],
}

/// The wire description of every buffer `qt` has.
pub fn layout(qt: &QuantizedTensor) -> Result<Vec<WireBuffer>> {
    let (m, k) = qt.shape().flat_2d();
    let kind = qt.kind();
    let specs = buffer_specs(&kind, qt.shape())?;
    let mut out = Vec::new();
    for (name, _) in qt.data_tensors() {
        use BufferName::*;
        use Gather::*;
        let (gather, valid) = match (kind, name) {
            (_, Amax | ColumnwiseAmax) | (Kind::Fp8 { .. }, ScaleInv) => (Replicated, [1, 1]),
            (Kind::Nvfp4 { .. }, Data) => (Rows, [m, k / 2]),
            (Kind::Nvfp4 { .. }, ColumnwiseData) => (Columns, [k, m / 2]),
            (Kind::Nvfp4 { .. }, ScaleInv) => (Rows, [m, k / nvfp4::BLOCK]),
            (Kind::Nvfp4 { .. }, ColumnwiseScaleInv) => (Columns, [k, m / nvfp4::BLOCK]),
            (Kind::Mxfp8 { .. }, Data | ColumnwiseData) => (Rows, [m, k]),
            (Kind::Mxfp8 { .. }, ScaleInv) => (Rows, [m, k / mxfp8::BLOCK]),
            (Kind::Mxfp8 { .. }, ColumnwiseScaleInv) => (Rows, [m / mxfp8::BLOCK, k]),
            (_, Data) => (Rows, [m, k]),
            (_, ColumnwiseData) => (Columns, [k, m]),
            (
                Kind::Fp8Block {
                    block_dim: BlockDim::OneD,
                    ..
                },
                ScaleInv,
            ) => (Columns, [k.div_ceil(block::BLOCK), m]),
            (
                Kind::Fp8Block {
                    block_dim: BlockDim::OneD,
                    ..
                },
                ColumnwiseScaleInv,
            ) => (Rows, [m.div_ceil(block::BLOCK), k]),
            (
                Kind::Fp8Block {
                    block_dim: BlockDim::TwoD,
                    ..
                },
                ScaleInv,
            ) => (Rows, [m.div_ceil(block::BLOCK), k.div_ceil(block::BLOCK)]),
            (
                Kind::Fp8Block {
                    block_dim: BlockDim::TwoD,
                    ..
                },
                ColumnwiseScaleInv,
            ) => (
                Columns,
                [k.div_ceil(block::BLOCK), m.div_ceil(block::BLOCK)],
            ),
            (Kind::Fp8 { .. }, ColumnwiseScaleInv) => {
                return Err(Error::invalid(
                    "wire::layout",
                    "per-tensor FP8 has no columnwise scale",
                ));
            }
        };
        let dtype = specs
            .iter()
            .find(|s| s.name == name)
            .map(|s| s.dtype)
            .unwrap_or(DType::U8);
        out.push(WireBuffer {
            name,
            dtype,
            gather,
            valid,
        });
    }
    Ok(out)
}

/// The rows of M a block of the format spans: a rank's share of M must be a multiple of
/// it, or blocks would straddle ranks.
fn m_granule(qt: &QuantizedTensor) -> usize {
    match qt.kind() {
        Kind::Fp8 { .. } => 1,
        Kind::Mxfp8 { .. } => mxfp8::BLOCK,
        Kind::Nvfp4 { .. } => nvfp4::BLOCK,
        Kind::Fp8Block { block_dim, .. } => {
            if block_dim == BlockDim::TwoD || qt.buffer(BufferName::ColumnwiseData).is_some() {
                block::BLOCK
            } else {
                1
            }
        }
    }
}

/// The compact valid region of one buffer, as bytes.
fn compact(qt: &QuantizedTensor, w: &WireBuffer) -> Result<Vec<u8>> {
    let (m, k) = qt.shape().flat_2d();
    let t = qt.buffer(w.name).expect("layout lists present buffers");
    let bytes = t.as_bytes()?;
    Ok(match (qt.kind(), w.name) {
        (Kind::Mxfp8 { swizzled, .. }, BufferName::ScaleInv) => {
            mxfp8::rowwise_compact(bytes, m, k, swizzled)?
        }
        (Kind::Mxfp8 { swizzled, .. }, BufferName::ColumnwiseScaleInv) => {
            mxfp8::columnwise_compact(bytes, m, k, swizzled)?
        }
        (Kind::Nvfp4 { swizzled, .. }, BufferName::ScaleInv | BufferName::ColumnwiseScaleInv) => {
            let padded = [t.shape().dims()[0], t.shape().dims()[1]];
            nvfp4::compact_scales(bytes, w.valid[0], w.valid[1], padded, swizzled)?
        }
        _ => {
            let total_cols = if t.shape().rank() == 2 && w.gather != Gather::Replicated {
                t.shape().dims()[1]
            } else {
                w.valid[1]
            };
            strip_padding(
                bytes,
                total_cols,
                w.valid[0],
                w.valid[1],
                w.dtype.size_in_bytes(),
            )
        }
    })
}

/// Step 1: the send buffers of a host tensor — for every gathered buffer, its compact
/// valid region as a `[rows, cols]` tensor. Fails when the tensor's share of M is not
/// a multiple of the format's block height (blocks would straddle ranks).
pub fn pack(qt: &QuantizedTensor) -> Result<Vec<(BufferName, Tensor)>> {
    const OP: &str = "wire::pack";
    if qt.shape().rank() < 2 {
        // The first dimension of a rank-1 tensor is its last (K): blocks and transposes
        // would be split across ranks.
        return Err(Error::shape(
            OP,
            format!(
                "a rank-1 shard {} cannot be gathered in a quantized format; gather it in high precision",
                qt.shape()
            ),
        ));
    }
    let (m, _) = qt.shape().flat_2d();
    let g = m_granule(qt);
    if m % g != 0 {
        return Err(Error::shape(
            OP,
            format!(
                "a rank's {} tensor of shape {} has M = {m}, not a multiple of its {g}-row blocks",
                qt.kind().name(),
                qt.shape()
            ),
        ));
    }
    let host = qt.to_device(Device::Cpu)?;
    layout(&host)?
        .into_iter()
        .filter(|w| w.gather != Gather::Replicated)
        .map(|w| {
            Ok((
                w.name,
                Tensor::from_bytes(
                    &compact(&host, &w)?,
                    Shape::new(w.valid),
                    w.dtype,
                    Device::Cpu,
                )?,
            ))
        })
        .collect()
}

/// The logical shape of `world` ranks' shards of `shape` gathered along dim 0.
pub fn gathered_shape(shape: &Shape, world: usize) -> Shape {
    let mut d = shape.dims().to_vec();
    if let Some(d0) = d.first_mut() {
        *d0 *= world;
    }
    Shape::new(d)
}

/// Step 3: the gathered tensor from the concatenated send buffers (`gathered`, each
/// `[world·rows, cols]`) and the local tensor (for the replicated buffers and the
/// format). Every rank sent a shard of the local tensor's shape.
pub fn unpack(
    local: &QuantizedTensor,
    world: usize,
    gathered: BTreeMap<BufferName, Tensor>,
) -> Result<QuantizedTensor> {
    const OP: &str = "wire::unpack";
    if world == 0 {
        return Err(Error::invalid(OP, "a gather needs at least one rank"));
    }
    let layout = layout(local)?;
    let mut parts = vec![BTreeMap::new(); world];
    for w in layout.iter().filter(|w| w.gather != Gather::Replicated) {
        let g = gathered
            .get(&w.name)
            .ok_or_else(|| Error::invalid(OP, format!("the gathered buffers lack `{}`", w.name)))?;
        let want = [world * w.valid[0], w.valid[1]];
        if g.shape().dims() != want || g.dtype() != w.dtype {
            return Err(Error::shape(
                OP,
                format!(
                    "gathered `{}` must be {} {:?}, got {} {}",
                    w.name,
                    w.dtype,
                    want,
                    g.dtype(),
                    g.shape()
                ),
            ));
        }
        let bytes = g.to_bytes()?;
        let per = bytes.len() / world;
        for (r, part) in parts.iter_mut().enumerate() {
            part.insert(
                w.name,
                Tensor::from_bytes(
                    &bytes[r * per..][..per],
                    Shape::new(w.valid),
                    w.dtype,
                    Device::Cpu,
                )?,
            );
        }
    }
    let d0 = local.shape().dims()[0];
    unpack_parts(local, &parts, &vec![d0; world])
}

/// Step 3 for shards of different first dimensions: `parts[r]` holds rank `r`'s packed
/// buffers (what [`pack`] made on that rank) and `rank_d0[r]` its first dimension. Rows
/// buffers are concatenated in rank order; for Columns buffers each row is the
/// concatenation of that row across ranks (what `swap_first_dims` does when the shards
/// are equal). Padding is restored and scales are swizzled where the format asks.
pub fn unpack_parts(
    local: &QuantizedTensor,
    parts: &[BTreeMap<BufferName, Tensor>],
    rank_d0: &[usize],
) -> Result<QuantizedTensor> {
    const OP: &str = "wire::unpack";
    if parts.is_empty() || parts.len() != rank_d0.len() {
        return Err(Error::invalid(
            OP,
            format!(
                "{} ranks' buffers but {} first dimensions",
                parts.len(),
                rank_d0.len()
            ),
        ));
    }
    let local = local.to_device(Device::Cpu)?;
    let mut dims = local.shape().dims().to_vec();
    dims[0] = rank_d0.iter().sum();
    let shape = Shape::new(dims);
    let (m, k) = shape.flat_2d();
    let kind = local.kind();
    let specs = buffer_specs(&kind, &shape)?;
    let mut buffers = BTreeMap::new();
    for w in layout(&local)? {
        let spec = specs
            .iter()
            .find(|s| s.name == w.name)
            .expect("same format");
        if w.gather == Gather::Replicated {
            buffers.insert(w.name, local.buffer(w.name).expect("listed").clone());
            continue;
        }
        let elem = w.dtype.size_in_bytes();
        let mut mats = Vec::with_capacity(parts.len());
        for (r, part) in parts.iter().enumerate() {
            let t = part.get(&w.name).ok_or_else(|| {
                Error::invalid(OP, format!("rank {r}'s buffers lack `{}`", w.name))
            })?;
            let d = t.shape().dims();
            if d.len() != 2 || t.dtype() != w.dtype {
                return Err(Error::shape(
                    OP,
                    format!(
                        "rank {r}'s `{}` must be a 2-D {} matrix, got {} {}",
                        w.name,
                        w.dtype,
                        t.dtype(),
                        t.shape()
                    ),
                ));
            }
            mats.push(([d[0], d[1]], t.to_bytes()?));
        }
        let (valid, bytes) = match w.gather {
            Gather::Rows => {
                let cols = mats[0].0[1];
                if let Some(r) = mats.iter().position(|(d, _)| d[1] != cols) {
                    return Err(Error::shape(
                        OP,
                        format!(
                            "rank {r}'s `{}` has {} columns, rank 0's {cols}",
                            w.name, mats[r].0[1]
                        ),
                    ));
                }
                let rows = mats.iter().map(|(d, _)| d[0]).sum();
                (
                    [rows, cols],
                    mats.into_iter().flat_map(|(_, b)| b).collect::<Vec<u8>>(),
                )
            }
            Gather::Columns => {
                let rows = mats[0].0[0];
                if let Some(r) = mats.iter().position(|(d, _)| d[0] != rows) {
                    return Err(Error::shape(
                        OP,
                        format!(
                            "rank {r}'s `{}` has {} rows, rank 0's {rows}",
                            w.name, mats[r].0[0]
                        ),
                    ));
                }
                let cols: usize = mats.iter().map(|(d, _)| d[1]).sum();
                let mut out = Vec::with_capacity(rows * cols * elem);
                for i in 0..rows {
                    for (d, b) in &mats {
                        out.extend_from_slice(&b[i * d[1] * elem..][..d[1] * elem]);
                    }
                }
                ([rows, cols], out)
            }
            Gather::Replicated => unreachable!("handled above"),
        };
        let full = match (kind, w.name) {
            (Kind::Mxfp8 { swizzled, .. }, BufferName::ScaleInv) => {
                mxfp8::rowwise_scale_buffer(&bytes, m, k, swizzled)
            }
            (Kind::Mxfp8 { swizzled, .. }, BufferName::ColumnwiseScaleInv) => {
                mxfp8::columnwise_scale_buffer(&bytes, m, k, swizzled)
            }
            (
                Kind::Nvfp4 { swizzled, .. },
                BufferName::ScaleInv | BufferName::ColumnwiseScaleInv,
            ) => {
                let d = spec.shape.dims();
                nvfp4::scale_buffer(&bytes, valid[0], valid[1], [d[0], d[1]], swizzled)
            }
            _ if spec.shape.rank() == 2
                && matches!(
                    w.name,
                    BufferName::ScaleInv | BufferName::ColumnwiseScaleInv
                ) =>
            {
                let d = spec.shape.dims();
                pad(&bytes, valid[0], valid[1], d[0], d[1], elem)
            }
            _ => bytes,
        };
        buffers.insert(
            w.name,
            Tensor::from_bytes(&full, &spec.shape, spec.dtype, Device::Cpu)?,
        );
    }
    QuantizedTensor::from_buffers(kind, shape, local.source_dtype(), buffers)
}

/// The whole gather on one process: `parts[r]` is rank `r`'s tensor. The shards may
/// differ in their first dimension (beyond TE, which needs equal shards); everything
/// else — format, trailing dimensions, usage and replicated metadata — must agree (a
/// rank that quantized with its own per-tensor scale would make the gathered bytes
/// inconsistent).
pub fn gather_reference(parts: &[QuantizedTensor]) -> Result<QuantizedTensor> {
    const OP: &str = "wire::gather_reference";
    let first = parts
        .first()
        .ok_or_else(|| Error::invalid(OP, "no parts to gather"))?;
    let trailing = |q: &QuantizedTensor| q.shape().dims().get(1..).map(<[usize]>::to_vec);
    let mut packed = Vec::with_capacity(parts.len());
    let mut rank_d0 = Vec::with_capacity(parts.len());
    for (r, p) in parts.iter().enumerate() {
        if p.kind() != first.kind() || trailing(p) != trailing(first) || p.usage() != first.usage()
        {
            return Err(Error::invalid(
                OP,
                format!(
                    "rank {r} holds a {:?} {} ({:?}), rank 0 a {:?} {} ({:?})",
                    p.kind(),
                    p.shape(),
                    p.usage(),
                    first.kind(),
                    first.shape(),
                    first.usage()
                ),
            ));
        }
        for w in layout(p)?.iter().filter(|w| w.gather == Gather::Replicated) {
            if p.buffer(w.name).map(Tensor::to_bytes).transpose()?
                != first.buffer(w.name).map(Tensor::to_bytes).transpose()?
            {
                return Err(Error::invalid(
                    OP,
                    format!(
                        "rank {r}'s `{}` differs from rank 0's: quantize with an all-reduced amax before gathering",
                        w.name
                    ),
                ));
            }
        }
        packed.push(pack(p)?.into_iter().collect::<BTreeMap<_, _>>());
        rank_d0.push(p.shape().dims()[0]);
    }
    unpack_parts(first, &packed, &rank_d0)
}
