//! Every TransformerEngine quantized tensor format, byte for byte: a CPU reference, and
//! (feature `cuda`) CUDA kernels that produce the same bytes.
//!
//! | quantizer | format | scales |
//! |---|---|---|
//! | [`Fp8CurrentScaling`], [`Fp8DelayedScaling`] | FP8 E4M3/E5M2 | one f32 per tensor |
//! | [`Mxfp8Quantizer`] | FP8 | E8M0 per 1×32 (or 32×32), compact or GEMM-swizzled |
//! | [`Nvfp4Quantizer`] | FP4 E2M1 | E4M3 per 1×16 (or 16×16) + f32 global amax; RHT, stochastic rounding |
//! | [`Fp8BlockQuantizer`] | FP8 | f32 per 1×128 or 128×128 |
//!
//! `spec/formats.md` is the specification; each format's module documents its buffers.
//! Every quantizer implements [`Quantizer`] (`quantize`, `make_empty`,
//! `is_quantizable`, usage), producing a [`QuantizedTensor`] whose
//! [`data_tensors`](QuantizedTensor::data_tensors) are plain [`Tensor`]s. Scale padding
//! is written as zeros (TE leaves it undefined). [`wire`] describes how each buffer
//! behaves under a first-dimension all-gather, for the collectives. Dequantization
//! ([`QuantizedTensor::dequantize`], `dequantize_usage` for one orientation, or
//! `dequantize_into` a tensor the caller keeps) runs where the data lives: a CUDA tensor
//! is dequantized by one kernel launch, with no host round trip.
//!
//! On a CUDA device, [`Quantizer::quantize_into`] and
//! [`QuantizedTensor::dequantize_into`] replace none of the output's buffers and keep no
//! allocation past the call, so both can be captured into a CUDA graph
//! (`tessera_core::cuda::Graph`) and replayed on whatever the input holds: the GPU tests
//! replay FP8 current scaling, MXFP8, FP8 block and NVFP4 (with and without the RHT)
//! against the CPU. [`Fp8DelayedScaling`] keeps its history and scale on the host unless
//! [`Fp8DelayedScaling::to_device`] moves them to the device; then its casts and
//! [`Fp8DelayedScaling::update_on_device`] (the fused amax-and-scale update as one
//! kernel) capture too, and each replay casts with the scale the previous one computed.
//! The quantizer is a `tessera_core::Replay` state for activation checkpointing; the
//! snapshot of a device-held state is a copy on the device, so checkpoint frames never
//! wait for it.
//!
//! The kernels are programmatic dependent launches (sm_90): a quantization that follows
//! another kernel on the device's stream starts its CTAs while that kernel finishes and
//! touches memory only after it has. A kernel of your own that you launch after tessera's
//! with programmatic stream serialization must wait (`cudaGridDependencySynchronize`)
//! before it reads tessera's outputs, as any such kernel must.
//!
//! The CPU reference is built from small public functions per step (casts in [`cast`],
//! amax and scales in [`scale`], layouts in [`layout`], and each format's block
//! quantizers), so the CUDA kernels can be checked against them one by one: the GPU tests
//! (`cargo xtask test-gpu`) compare every format, option and input type bit for bit on
//! random and ragged inputs. `cargo xtask bench-gpu` times each kernel against a device
//! copy in the same run; `BENCHMARKS.md` keeps the figures, by card.
//!
//! ```
//! use tessera_core::{DType, Device, Tensor};
//! use tessera_quant::{BufferName, Fp8CurrentScaling, Fp8Format, Quantizer};
//!
//! # fn main() -> tessera_core::Result<()> {
//! let x = Tensor::from_slice(&[1.0f32, -2.5, 0.1, 300.0], [2, 2], Device::Cpu)?;
//! let q = Fp8CurrentScaling::new(Fp8Format::E4M3).quantize(&x)?;
//! assert_eq!(q.buffer(BufferName::Data).unwrap().as_bytes()?, &[0x3C, 0xC7, 0x22, 0x7E]);
//! let y = q.dequantize(DType::F32)?;
//! assert_eq!(y.as_slice::<f32>()?, &[1.0044643, -2.5111609, 0.1046317, 300.0]);
//! # Ok(())
//! # }
//! ```

#![warn(missing_docs)]

pub mod block;
pub mod cast;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod fp8;
pub mod layout;
pub mod mxfp8;
pub mod nvfp4;
pub mod scale;
mod tensor;
mod values;
pub mod wire;

use std::collections::BTreeMap;

use tessera_core::{DType, Device, Error, Result, Shape, Tensor};

pub use block::Fp8BlockQuantizer;
pub use cast::Fp8Format;
pub use fp8::{AmaxComputeAlgo, DelayedScalingState, Fp8CurrentScaling, Fp8DelayedScaling};
pub use mxfp8::Mxfp8Quantizer;
pub use nvfp4::Nvfp4Quantizer;
pub use tensor::{BlockDim, BufferName, BufferSpec, Kind, QuantizedTensor, Usage};

/// A quantizer: turns high-precision tensors into one [`Kind`] of [`QuantizedTensor`].
pub trait Quantizer: Send {
    /// The format and options of the tensors it makes.
    fn kind(&self) -> Kind;

    /// The orientations it produces.
    fn usage(&self) -> Usage;

    /// Changes the orientations it produces.
    fn set_usage(&mut self, usage: Usage);

    /// `Ok` when tensors of `shape` can be quantized at all; otherwise an
    /// [`Error::Shape`] saying which dimension does not fit.
    fn check_shape(&self, shape: &Shape) -> Result<()>;

    /// Whether a tensor of `shape` can be all-gathered along its first dimension in this
    /// format (TE's `is_quantizable`); if not, gathers fall back to high precision.
    fn is_quantizable(&self, shape: &Shape) -> bool;

    /// A zero-filled quantized tensor of logical `shape` on `device`, with the buffers
    /// of this quantizer's usage; `dtype` is the high-precision type it stands for. Fails
    /// as [`check_shape`](Self::check_shape) does.
    fn make_empty(&self, shape: &Shape, dtype: DType, device: Device) -> Result<QuantizedTensor> {
        self.check_shape(shape)?;
        make_empty_from_specs(self.kind(), self.usage(), shape, dtype, device)
    }

    /// Quantizes an f32/bf16/f16 tensor on the host or (feature `cuda`, for the formats
    /// with kernels) on its CUDA device, where the result stays.
    fn quantize(&mut self, x: &Tensor) -> Result<QuantizedTensor>;

    /// Installs (or removes) the amax all-reduce that per-tensor formats (FP8 current
    /// scaling, NVFP4) run before computing their scales, so every rank of a group
    /// quantizes with the same scale. Formats with only per-block scales ignore it.
    fn set_amax_reduction(&mut self, reduction: Option<std::sync::Arc<dyn AmaxReduction>>) {
        let _ = reduction;
    }

    /// Quantizes into the buffers of `out` (from [`make_empty`](Self::make_empty) with
    /// this quantizer's usage, on `x`'s device). CUDA kernels write `out`'s buffers in
    /// place; the default implementation quantizes and replaces them.
    fn quantize_into(&mut self, x: &Tensor, out: &mut QuantizedTensor) -> Result<()> {
        check_into("Quantizer::quantize_into", &self.kind(), x, out)?;
        let q = self.quantize(x)?;
        out.replace_buffers(q)
    }
}

/// `Ok` for tensors of rank 1 or more: the shape check of the formats without block
/// divisibility constraints.
pub(crate) fn check_rank(op: &'static str, shape: &Shape) -> Result<()> {
    if shape.rank() == 0 {
        return Err(Error::shape(
            op,
            "cannot quantize a rank-0 tensor; reshape it to [1]",
        ));
    }
    Ok(())
}

/// `Ok` when both flattened dimensions of `shape` (rank 1 or more) are multiples of
/// `block`: the shape check of the formats whose blocks may not straddle an edge.
pub(crate) fn check_block_multiple(
    op: &'static str,
    format: &str,
    block: usize,
    shape: &Shape,
) -> Result<()> {
    let (m, k) = shape.flat_2d();
    if shape.rank() == 0 || m % block != 0 || k % block != 0 {
        return Err(Error::shape(
            op,
            format!(
                "{format} needs both flattened dimensions to be multiples of {block}; shape {shape} is [{m}, {k}] as a matrix"
            ),
        ));
    }
    Ok(())
}

/// Checks that `out` can receive the quantization of `x` in format `kind`.
pub(crate) fn check_into(
    op: &'static str,
    kind: &Kind,
    x: &Tensor,
    out: &QuantizedTensor,
) -> Result<()> {
    if out.kind() != *kind || out.shape() != x.shape() || out.device() != x.device() {
        return Err(Error::invalid(
            op,
            format!(
                "the output is a {:?} tensor of shape {} on {}, the input needs a {:?} tensor of shape {} on {}",
                out.kind(),
                out.shape(),
                out.device(),
                kind,
                x.shape(),
                x.device()
            ),
        ));
    }
    Ok(())
}

/// The hook per-tensor formats use to agree on one amax across a process group: the
/// collectives crate implements it with a MAX all-reduce.
pub trait AmaxReduction: Send + Sync {
    /// The maximum of `amax` over every rank of the group.
    fn all_reduce_max(&self, amax: f32) -> Result<f32>;
}

/// The buffers a tensor of `kind` and logical `shape` has (all usages).
pub fn buffer_specs(kind: &Kind, shape: &Shape) -> Result<Vec<BufferSpec>> {
    if shape.rank() == 0 {
        return Err(Error::shape(
            "buffer_specs",
            "quantized tensors have rank 1 or more",
        ));
    }
    let need = |b: usize, what: &str| check_block_multiple("buffer_specs", what, b, shape);
    Ok(match *kind {
        Kind::Fp8 { format } => fp8::buffer_specs(format, shape),
        Kind::Mxfp8 { format, .. } => {
            need(mxfp8::BLOCK, "MXFP8")?;
            mxfp8::buffer_specs(format, shape)
        }
        Kind::Nvfp4 { .. } => {
            need(nvfp4::BLOCK, "NVFP4")?;
            nvfp4::buffer_specs(shape)
        }
        Kind::Fp8Block { format, block_dim } => block::buffer_specs(format, block_dim, shape),
    })
}

/// Whether `usage` names the columnwise orientation; `Both` names none, and is refused.
pub(crate) fn dequantized_orientation(usage: Usage) -> Result<bool> {
    match usage {
        Usage::Rowwise => Ok(false),
        Usage::Columnwise => Ok(true),
        Usage::Both => Err(Error::invalid(
            "dequantize",
            "choose one orientation: rowwise or columnwise",
        )),
    }
}

/// Dequantized f32 values of one orientation of a host tensor, in logical order.
pub(crate) fn dequantize_values(qt: &QuantizedTensor, usage: Usage) -> Result<Vec<f32>> {
    let columnwise = dequantized_orientation(usage)?;
    match qt.kind {
        Kind::Fp8 { format } => fp8::dequantize(qt, format, columnwise),
        Kind::Mxfp8 {
            format, swizzled, ..
        } => mxfp8::dequantize(qt, format, swizzled, columnwise),
        Kind::Nvfp4 { rht, swizzled, .. } => nvfp4::dequantize(qt, rht, swizzled, columnwise),
        Kind::Fp8Block { format, block_dim } => {
            block::dequantize(qt, format, block_dim, columnwise)
        }
    }
}

/// Builds a host [`QuantizedTensor`] from raw buffer bytes, with the dtypes and shapes
/// of `specs`.
pub(crate) fn assemble(
    kind: Kind,
    x: &Tensor,
    specs: &[BufferSpec],
    bytes: BTreeMap<BufferName, Vec<u8>>,
) -> Result<QuantizedTensor> {
    let mut buffers = BTreeMap::new();
    for (name, b) in bytes {
        let spec = specs.iter().find(|s| s.name == name).ok_or_else(|| {
            Error::invalid(
                "assemble",
                format!("{} has no `{name}` buffer", kind.name()),
            )
        })?;
        buffers.insert(
            name,
            Tensor::from_bytes(&b, &spec.shape, spec.dtype, Device::Cpu)?,
        );
    }
    Ok(QuantizedTensor {
        kind,
        shape: x.shape().clone(),
        source_dtype: x.dtype(),
        buffers,
    })
}

/// `quantize` of a CUDA tensor: `quantize_into` an output whose buffers are left
/// uninitialised. Every format's kernels write every byte of their outputs, scale padding
/// included (the GPU tests quantize into outputs poisoned with 0xA5 and compare them with
/// the CPU's), so zero-filling them first would be a memset of the whole output for
/// nothing. Without the `cuda` feature there are no CUDA tensors, and `quantize_into`
/// says so.
pub(crate) fn quantize_on_device(q: &mut dyn Quantizer, x: &Tensor) -> Result<QuantizedTensor> {
    q.check_shape(x.shape())?;
    #[cfg(feature = "cuda")]
    let mut out = make_uninit_from_specs(q.kind(), q.usage(), x.shape(), x.dtype(), x.device())?;
    #[cfg(not(feature = "cuda"))]
    let mut out = q.make_empty(x.shape(), x.dtype(), x.device())?;
    q.quantize_into(x, &mut out)?;
    Ok(out)
}

/// Zero-filled buffers for `usage`.
pub(crate) fn make_empty_from_specs(
    kind: Kind,
    usage: Usage,
    shape: &Shape,
    dtype: DType,
    device: Device,
) -> Result<QuantizedTensor> {
    alloc_from_specs(kind, usage, shape, dtype, device, true)
}

/// [`make_empty_from_specs`] with the buffers' contents left unspecified on a device (no
/// memset launch), for outputs a kernel overwrites entirely.
#[cfg(feature = "cuda")]
pub(crate) fn make_uninit_from_specs(
    kind: Kind,
    usage: Usage,
    shape: &Shape,
    dtype: DType,
    device: Device,
) -> Result<QuantizedTensor> {
    alloc_from_specs(kind, usage, shape, dtype, device, false)
}

/// The buffers of `kind` that `usage` asks for, zeroed or left uninitialised.
fn alloc_from_specs(
    kind: Kind,
    usage: Usage,
    shape: &Shape,
    dtype: DType,
    device: Device,
    zeroed: bool,
) -> Result<QuantizedTensor> {
    if !dtype.is_high_precision_float() {
        return Err(Error::dtype("make_empty", "f32, bf16 or f16", dtype));
    }
    let mut buffers = BTreeMap::new();
    for spec in buffer_specs(&kind, shape)? {
        let wanted = match spec.name {
            BufferName::Data | BufferName::ScaleInv | BufferName::Amax => usage.rowwise(),
            _ => usage.columnwise(),
        };
        let wanted =
            wanted || (matches!(kind, Kind::Fp8 { .. }) && spec.name == BufferName::ScaleInv);
        if wanted {
            let t = if zeroed {
                Tensor::zeros(spec.shape, spec.dtype, device)?
            } else {
                Tensor::empty(spec.shape, spec.dtype, device)?
            };
            buffers.insert(spec.name, t);
        }
    }
    Ok(QuantizedTensor {
        kind,
        shape: shape.clone(),
        source_dtype: dtype,
        buffers,
    })
}
