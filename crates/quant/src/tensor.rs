//! Quantized tensors: a logical shape, a format, and the plain buffers it is made of.

use std::collections::BTreeMap;
use std::fmt;

use tessera_core::{DType, Device, Error, Result, Shape, Tensor};

use crate::Fp8Format;

/// Which orientations a quantizer produces (TE's rowwise / columnwise usage).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Usage {
    /// Blocks along the last dimension (the forward GEMM operand).
    Rowwise,
    /// Blocks along the first dimensions (the transposed operand of wgrad/dgrad).
    Columnwise,
    /// Both, from one pass over the input.
    #[default]
    Both,
}

impl Usage {
    /// Whether rowwise buffers are produced.
    pub fn rowwise(self) -> bool {
        matches!(self, Usage::Rowwise | Usage::Both)
    }

    /// Whether columnwise buffers are produced.
    pub fn columnwise(self) -> bool {
        matches!(self, Usage::Columnwise | Usage::Both)
    }

    /// `"rowwise"`, `"columnwise"` or `"both"`.
    pub const fn name(self) -> &'static str {
        match self {
            Usage::Rowwise => "rowwise",
            Usage::Columnwise => "columnwise",
            Usage::Both => "both",
        }
    }
}

impl std::str::FromStr for Usage {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "rowwise" => Ok(Usage::Rowwise),
            "columnwise" => Ok(Usage::Columnwise),
            "both" => Ok(Usage::Both),
            _ => Err(Error::invalid(
                "Usage::from_str",
                format!("unknown usage `{s}`; expected rowwise, columnwise or both"),
            )),
        }
    }
}

/// The block shape of FP8 block scaling.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum BlockDim {
    /// 1×128 blocks (128×1 for the columnwise copy, scaled independently).
    #[default]
    OneD,
    /// 128×128 tiles shared by both orientations.
    TwoD,
}

/// A quantized format and the options that change its bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Kind {
    /// FP8 with one scale per tensor (delayed or current scaling produce the same
    /// layout).
    Fp8 {
        /// E4M3 or E5M2.
        format: Fp8Format,
    },
    /// MXFP8: E8M0 scale per 32 elements (1×32, or 32×32 tiles).
    Mxfp8 {
        /// E4M3 or E5M2.
        format: Fp8Format,
        /// One scale per 32×32 tile for both orientations.
        two_d: bool,
        /// Scales in cuBLAS's GEMM-swizzled layout instead of compact row-major.
        swizzled: bool,
    },
    /// NVFP4: E2M1 values, E4M3 scale per 16 elements, and a global amax.
    Nvfp4 {
        /// One scale per 16×16 tile for both orientations.
        two_d: bool,
        /// Random Hadamard transform of the columnwise operand.
        rht: bool,
        /// Scales in cuBLAS's GEMM-swizzled layout.
        swizzled: bool,
    },
    /// FP8 with float32 scales per 1×128 block or 128×128 tile.
    Fp8Block {
        /// E4M3 or E5M2.
        format: Fp8Format,
        /// 1-D or 2-D blocks.
        block_dim: BlockDim,
    },
}

impl Kind {
    /// The format's command-line name: `fp8`, `mxfp8`, `nvfp4` or `fp8-block`.
    pub fn name(&self) -> &'static str {
        match self {
            Kind::Fp8 { .. } => "fp8",
            Kind::Mxfp8 { .. } => "mxfp8",
            Kind::Nvfp4 { .. } => "nvfp4",
            Kind::Fp8Block { .. } => "fp8-block",
        }
    }
}

/// The named buffers a quantized tensor is made of (TE's storage attributes).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum BufferName {
    /// Rowwise data (`_data` / `_rowwise_data`).
    Data,
    /// Rowwise scale inverse (per-tensor formats: the one shared scale inverse).
    ScaleInv,
    /// Columnwise data (`_transpose` / `_columnwise_data`).
    ColumnwiseData,
    /// Columnwise scale inverse.
    ColumnwiseScaleInv,
    /// NVFP4 rowwise global amax.
    Amax,
    /// NVFP4 columnwise global amax.
    ColumnwiseAmax,
}

impl BufferName {
    /// Every buffer name, in order.
    pub const ALL: [BufferName; 6] = [
        BufferName::Data,
        BufferName::ScaleInv,
        BufferName::ColumnwiseData,
        BufferName::ColumnwiseScaleInv,
        BufferName::Amax,
        BufferName::ColumnwiseAmax,
    ];

    /// The suffix used in files: `data`, `scale_inv`, `columnwise_data`, ...
    pub const fn name(self) -> &'static str {
        match self {
            BufferName::Data => "data",
            BufferName::ScaleInv => "scale_inv",
            BufferName::ColumnwiseData => "columnwise_data",
            BufferName::ColumnwiseScaleInv => "columnwise_scale_inv",
            BufferName::Amax => "amax",
            BufferName::ColumnwiseAmax => "columnwise_amax",
        }
    }

    /// The name for a file suffix.
    pub fn from_name(s: &str) -> Option<BufferName> {
        BufferName::ALL.into_iter().find(|b| b.name() == s)
    }
}

impl fmt::Display for BufferName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A quantized tensor: logical shape, [`Kind`], the dtype it was quantized from, and
/// its plain buffers ([`data_tensors`](Self::data_tensors)).
#[derive(Clone)]
pub struct QuantizedTensor {
    pub(crate) kind: Kind,
    pub(crate) shape: Shape,
    pub(crate) source_dtype: DType,
    pub(crate) buffers: BTreeMap<BufferName, Tensor>,
}

impl QuantizedTensor {
    /// Assembles a quantized tensor from its buffers, checking each buffer's dtype and
    /// shape against what `kind` and `shape` require (for tensors read from files or
    /// received from other ranks).
    pub fn from_buffers(
        kind: Kind,
        shape: Shape,
        source_dtype: DType,
        buffers: BTreeMap<BufferName, Tensor>,
    ) -> Result<Self> {
        const OP: &str = "QuantizedTensor::from_buffers";
        if !source_dtype.is_high_precision_float() {
            return Err(Error::dtype(OP, "f32, bf16 or f16", source_dtype));
        }
        let expected = crate::buffer_specs(&kind, &shape)?;
        for (name, t) in &buffers {
            let Some(spec) = expected.iter().find(|s| s.name == *name) else {
                return Err(Error::invalid(
                    OP,
                    format!("{} tensors have no `{name}` buffer", kind.name()),
                ));
            };
            if t.dtype() != spec.dtype || t.shape() != &spec.shape {
                return Err(Error::shape(
                    OP,
                    format!(
                        "buffer `{name}` of a {} tensor of shape {shape} must be {} {}, got {} {}",
                        kind.name(),
                        spec.dtype,
                        spec.shape,
                        t.dtype(),
                        t.shape()
                    ),
                ));
            }
        }
        let has = |b| buffers.contains_key(&b);
        if !has(BufferName::Data) && !has(BufferName::ColumnwiseData) {
            return Err(Error::invalid(
                OP,
                "a quantized tensor needs rowwise or columnwise data",
            ));
        }
        for (data, scale) in [
            (BufferName::Data, BufferName::ScaleInv),
            (BufferName::ColumnwiseData, BufferName::ColumnwiseScaleInv),
        ] {
            let scale = match kind {
                Kind::Fp8 { .. } => BufferName::ScaleInv,
                _ => scale,
            };
            if has(data) && !has(scale) {
                return Err(Error::invalid(
                    OP,
                    format!("buffer `{data}` needs `{scale}`"),
                ));
            }
        }
        if matches!(kind, Kind::Nvfp4 { .. }) {
            for (data, amax) in [
                (BufferName::Data, BufferName::Amax),
                (BufferName::ColumnwiseData, BufferName::ColumnwiseAmax),
            ] {
                if has(data) && !has(amax) {
                    return Err(Error::invalid(
                        OP,
                        format!("buffer `{data}` needs `{amax}`"),
                    ));
                }
            }
        }
        Ok(QuantizedTensor {
            kind,
            shape,
            source_dtype,
            buffers,
        })
    }

    /// The format and its options.
    pub fn kind(&self) -> Kind {
        self.kind
    }

    /// The logical (unquantized) shape.
    pub fn shape(&self) -> &Shape {
        &self.shape
    }

    /// The dtype the tensor was quantized from (the default dequantization target).
    pub fn source_dtype(&self) -> DType {
        self.source_dtype
    }

    /// Where the buffers live.
    pub fn device(&self) -> Device {
        self.buffers
            .values()
            .next()
            .map_or(Device::Cpu, Tensor::device)
    }

    /// The usages present.
    pub fn usage(&self) -> Usage {
        match (
            self.buffers.contains_key(&BufferName::Data),
            self.buffers.contains_key(&BufferName::ColumnwiseData),
        ) {
            (true, true) => Usage::Both,
            (false, true) => Usage::Columnwise,
            _ => Usage::Rowwise,
        }
    }

    /// One buffer, if the tensor has it.
    pub fn buffer(&self, name: BufferName) -> Option<&Tensor> {
        self.buffers.get(&name)
    }

    /// The data and scale buffers of one orientation (`columnwise`: the transposed
    /// copy's), or an error naming the one the tensor lacks. For the per-block formats;
    /// FP8 per-tensor shares one `ScaleInv` between orientations.
    pub(crate) fn data_and_scales(&self, columnwise: bool) -> Result<(&Tensor, &Tensor)> {
        let (dn, sn) = if columnwise {
            (BufferName::ColumnwiseData, BufferName::ColumnwiseScaleInv)
        } else {
            (BufferName::Data, BufferName::ScaleInv)
        };
        let get = |n| self.buffer(n).ok_or_else(|| crate::fp8::missing(n));
        Ok((get(dn)?, get(sn)?))
    }

    /// The plain buffers the tensor is made of, in [`BufferName`] order — what FSDP
    /// scatters and what communication moves.
    pub fn data_tensors(&self) -> Vec<(BufferName, &Tensor)> {
        self.buffers.iter().map(|(n, t)| (*n, t)).collect()
    }

    /// Replaces every buffer with `src`'s, which must have the same format, shape and
    /// buffer set; the buffers move to this tensor's device.
    pub fn replace_buffers(&mut self, src: QuantizedTensor) -> Result<()> {
        let names = |q: &QuantizedTensor| q.buffers.keys().copied().collect::<Vec<_>>();
        if src.kind != self.kind || src.shape != self.shape || names(&src) != names(self) {
            return Err(Error::invalid(
                "QuantizedTensor::replace_buffers",
                format!(
                    "{:?} {} with {:?} cannot replace {:?} {} with {:?}",
                    src.kind,
                    src.shape,
                    names(&src),
                    self.kind,
                    self.shape,
                    names(self)
                ),
            ));
        }
        let device = self.device();
        for (name, t) in src.buffers {
            self.buffers.insert(name, t.to_device(device)?);
        }
        self.source_dtype = src.source_dtype;
        Ok(())
    }

    /// Removes a buffer so a kernel can write it with unique ownership (no
    /// copy-on-write); [`put_buffer`](Self::put_buffer) returns it. After an error in
    /// between, the tensor is incomplete and must not be used.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn take_buffer(&mut self, name: BufferName) -> Result<Tensor> {
        self.buffers
            .remove(&name)
            .ok_or_else(|| crate::fp8::missing(name))
    }

    /// Puts back a buffer taken with [`take_buffer`](Self::take_buffer).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn put_buffer(&mut self, name: BufferName, t: Tensor) {
        self.buffers.insert(name, t);
    }

    /// Consumes the tensor, returning its buffers.
    pub fn into_buffers(self) -> BTreeMap<BufferName, Tensor> {
        self.buffers
    }

    /// Total bytes of all buffers.
    pub fn size_in_bytes(&self) -> usize {
        self.buffers.values().map(Tensor::size_in_bytes).sum()
    }

    /// The buffers copied to `device`.
    pub fn to_device(&self, device: Device) -> Result<QuantizedTensor> {
        let buffers = self
            .buffers
            .iter()
            .map(|(n, t)| Ok((*n, t.to_device(device)?)))
            .collect::<Result<_>>()?;
        Ok(QuantizedTensor {
            buffers,
            ..self.clone()
        })
    }

    /// Dequantizes to `dtype` (f32, bf16 or f16) from the rowwise data, or from the
    /// columnwise data when only that exists (NVFP4 with RHT then applies the inverse
    /// transform).
    pub fn dequantize(&self, dtype: DType) -> Result<Tensor> {
        let usage = if self.buffers.contains_key(&BufferName::Data) {
            Usage::Rowwise
        } else {
            Usage::Columnwise
        };
        self.dequantize_usage(usage, dtype)
    }

    /// Dequantizes one orientation (`Rowwise` or `Columnwise`) to `dtype`, in the logical
    /// shape.
    pub fn dequantize_usage(&self, usage: Usage, dtype: DType) -> Result<Tensor> {
        const OP: &str = "QuantizedTensor::dequantize";
        if !dtype.is_high_precision_float() {
            return Err(Error::dtype(OP, "f32, bf16 or f16", dtype));
        }
        if self.device().is_cuda() {
            let mut out = Tensor::empty(self.shape.clone(), dtype, self.device())?;
            self.dequantize_cuda(usage, &mut out)?;
            return Ok(out);
        }
        let values = crate::dequantize_values(self, usage)?;
        crate::values::from_f32(&values, &self.shape, dtype)
    }

    /// Dequantizes one orientation into `out`, a tensor of the logical shape on this
    /// tensor's device whose dtype (f32, bf16 or f16) is the one produced: what
    /// [`dequantize_usage`](Self::dequantize_usage) does, without allocating (on a CUDA
    /// device, one kernel launch and nothing else).
    pub fn dequantize_into(&self, usage: Usage, out: &mut Tensor) -> Result<()> {
        const OP: &str = "QuantizedTensor::dequantize_into";
        if !out.dtype().is_high_precision_float() {
            return Err(Error::dtype(OP, "f32, bf16 or f16", out.dtype()));
        }
        if out.shape() != &self.shape {
            return Err(Error::shape(
                OP,
                format!(
                    "an output of shape {} for a tensor of shape {} (expected the same shape)",
                    out.shape(),
                    self.shape
                ),
            ));
        }
        if out.device() != self.device() {
            return Err(Error::device(
                OP,
                format!("the quantized tensor's device, {}", self.device()),
                out.device(),
            ));
        }
        if self.device().is_cuda() {
            return self.dequantize_cuda(usage, out);
        }
        let values = crate::dequantize_values(self, usage)?;
        let t = crate::values::from_f32(&values, &self.shape, out.dtype())?;
        out.as_bytes_mut()?.copy_from_slice(t.as_bytes()?);
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn dequantize_cuda(&self, usage: Usage, out: &mut Tensor) -> Result<()> {
        let missing = crate::fp8::missing;
        let columnwise = crate::dequantized_orientation(usage)?;
        match self.kind {
            Kind::Fp8 { format } => {
                let scale_inv = self
                    .buffers
                    .get(&BufferName::ScaleInv)
                    .ok_or_else(|| missing(BufferName::ScaleInv))?;
                if columnwise {
                    let ct = self
                        .buffers
                        .get(&BufferName::ColumnwiseData)
                        .ok_or_else(|| missing(BufferName::ColumnwiseData))?;
                    return crate::cuda::fp8::dequantize_transposed(ct, scale_inv, format, out);
                }
                let data = self
                    .buffers
                    .get(&BufferName::Data)
                    .ok_or_else(|| missing(BufferName::Data))?;
                crate::cuda::fp8::dequantize(data, scale_inv, format, out)
            }
            Kind::Mxfp8 {
                format, swizzled, ..
            } => crate::cuda::mxfp8::dequantize(self, format, swizzled, columnwise, out),
            Kind::Fp8Block { format, block_dim } => {
                crate::cuda::block::dequantize(self, format, block_dim, columnwise, out)
            }
            Kind::Nvfp4 { rht, swizzled, .. } => {
                crate::cuda::nvfp4::dequantize(self, rht, swizzled, columnwise, out)
            }
        }
    }

    #[cfg(not(feature = "cuda"))]
    fn dequantize_cuda(&self, _usage: Usage, _out: &mut Tensor) -> Result<()> {
        Err(Error::no_cuda_feature("dequantizing a CUDA tensor"))
    }
}

impl fmt::Debug for QuantizedTensor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("QuantizedTensor")
            .field("kind", &self.kind)
            .field("shape", &self.shape)
            .field("source_dtype", &self.source_dtype)
            .field("buffers", &self.buffers.keys().collect::<Vec<_>>())
            .finish()
    }
}

/// What one buffer of a format must look like.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BufferSpec {
    /// Which buffer.
    pub name: BufferName,
    /// Its dtype.
    pub dtype: DType,
    /// Its shape, padding included.
    pub shape: Shape,
}
