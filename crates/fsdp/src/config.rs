//! How an [`Fsdp`](crate::Fsdp) engine gathers weights, reduces gradients and frees
//! memory.

use std::fmt;

use tessera_core::{DType, Error, Result};
use tessera_quant::{
    BlockDim, Fp8BlockQuantizer, Fp8CurrentScaling, Fp8Format, Mxfp8Quantizer, Nvfp4Quantizer,
    Quantizer, Usage,
};

/// The format weights travel in when a layer is unsharded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum WeightFormat {
    /// The parameter dtype of the [`FsdpConfig`] (f32 or bf16).
    #[default]
    HighPrecision,
    /// FP8 E4M3 with one scale per tensor from the amax all-reduced (MAX) over the
    /// group (TE's current scaling).
    Fp8,
    /// MXFP8 E4M3, an E8M0 scale per 1×32 block.
    Mxfp8,
    /// NVFP4: E2M1 values, an E4M3 scale per 1×16 block and the all-reduced global amax.
    Nvfp4,
    /// FP8 E4M3 with an f32 (power-of-two) scale per 1×128 block.
    Fp8Block,
}

impl WeightFormat {
    /// Every format.
    pub const ALL: [WeightFormat; 5] = [
        WeightFormat::HighPrecision,
        WeightFormat::Fp8,
        WeightFormat::Mxfp8,
        WeightFormat::Nvfp4,
        WeightFormat::Fp8Block,
    ];

    /// `"hp"`, `"fp8"`, `"mxfp8"`, `"nvfp4"` or `"fp8-block"`.
    pub const fn name(self) -> &'static str {
        match self {
            WeightFormat::HighPrecision => "hp",
            WeightFormat::Fp8 => "fp8",
            WeightFormat::Mxfp8 => "mxfp8",
            WeightFormat::Nvfp4 => "nvfp4",
            WeightFormat::Fp8Block => "fp8-block",
        }
    }

    /// The rowwise quantizer of the format (the forward GEMM operand), `None` for
    /// [`HighPrecision`](WeightFormat::HighPrecision).
    pub fn quantizer(self) -> Option<Box<dyn Quantizer>> {
        let e4m3 = Fp8Format::E4M3;
        Some(match self {
            WeightFormat::HighPrecision => return None,
            WeightFormat::Fp8 => Box::new(Fp8CurrentScaling::new(e4m3).with_usage(Usage::Rowwise)),
            WeightFormat::Mxfp8 => Box::new(Mxfp8Quantizer::new(e4m3).with_usage(Usage::Rowwise)),
            WeightFormat::Nvfp4 => Box::new(Nvfp4Quantizer::new().with_usage(Usage::Rowwise)),
            WeightFormat::Fp8Block => {
                Box::new(Fp8BlockQuantizer::new(e4m3, BlockDim::OneD).with_usage(Usage::Rowwise))
            }
        })
    }

    /// The rows a shard must be a multiple of for its blocks not to straddle ranks (and
    /// for the quantizer to accept the shard): 32 for MXFP8, 16 for NVFP4, 128 for FP8
    /// block scaling, 1 otherwise. Shards are padded up to it.
    pub const fn row_granule(self) -> usize {
        match self {
            WeightFormat::HighPrecision | WeightFormat::Fp8 => 1,
            WeightFormat::Mxfp8 => 32,
            WeightFormat::Nvfp4 => 16,
            WeightFormat::Fp8Block => 128,
        }
    }
}

impl fmt::Display for WeightFormat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// When the full copies of a layer's parameters are freed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum ReshardPolicy {
    /// After the forward, and gathered again for the backward (ZeRO-3, PyTorch's
    /// `FULL_SHARD`): the least memory.
    #[default]
    AfterForward,
    /// Kept from the forward to the backward and freed after it (ZeRO-2,
    /// `SHARD_GRAD_OP`): one gather per step.
    AfterBackward,
    /// Never freed once gathered (gathered again only after an optimizer step changes
    /// the shards).
    Never,
}

/// How gradients are reduce-scattered to the shards. In a group of one nothing is
/// communicated or quantized (a native reduction still rounds to the reduce dtype).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum GradReduce {
    /// The group's reduce-scatter in the [`FsdpConfig::reduce_dtype`].
    #[default]
    Native,
    /// [`reduce_scatter_low_precision`](crate::reduce_scatter_low_precision): chunks
    /// quantized before they travel, summed in f32 by their receiver.
    LowPrecision(crate::LowPrecision),
}

/// The configuration of an [`Fsdp`](crate::Fsdp) engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FsdpConfig {
    /// The dtype unsharded weights are rounded to for compute and, in high precision,
    /// travel in: f32 or bf16 (shards are kept in f32, the master copy).
    pub param_dtype: DType,
    /// The dtype of a [`GradReduce::Native`] reduce-scatter (and of the hybrid
    /// all-reduce across replicas): f32 or bf16.
    pub reduce_dtype: DType,
    /// The format weights travel in.
    pub weight_format: WeightFormat,
    /// Gather in high precision and quantize the whole weight on every rank instead of
    /// quantizing shards (the reference a quantized gather must equal; TE's fallback for
    /// shapes that cannot travel quantized).
    pub quantize_after_gather: bool,
    /// How gradients are reduce-scattered.
    pub grad_reduce: GradReduce,
    /// When full parameters are freed.
    pub reshard: ReshardPolicy,
    /// Issue the next layer's unshard before the current layer computes.
    pub prefetch: bool,
}

impl Default for FsdpConfig {
    fn default() -> Self {
        FsdpConfig {
            param_dtype: DType::F32,
            reduce_dtype: DType::F32,
            weight_format: WeightFormat::HighPrecision,
            quantize_after_gather: false,
            grad_reduce: GradReduce::Native,
            reshard: ReshardPolicy::AfterForward,
            prefetch: true,
        }
    }
}

impl FsdpConfig {
    /// With these parameter and reduction dtypes (the mixed-precision policy).
    pub fn mixed_precision(mut self, param_dtype: DType, reduce_dtype: DType) -> Self {
        self.param_dtype = param_dtype;
        self.reduce_dtype = reduce_dtype;
        self
    }

    /// With this weight format.
    pub fn weight_format(mut self, f: WeightFormat) -> Self {
        self.weight_format = f;
        self
    }

    /// Quantizing after a high-precision gather (or not).
    pub fn quantize_after_gather(mut self, on: bool) -> Self {
        self.quantize_after_gather = on;
        self
    }

    /// With this gradient reduction.
    pub fn grad_reduce(mut self, r: GradReduce) -> Self {
        self.grad_reduce = r;
        self
    }

    /// With this reshard policy.
    pub fn reshard(mut self, r: ReshardPolicy) -> Self {
        self.reshard = r;
        self
    }

    /// Prefetching (or not).
    pub fn prefetch(mut self, on: bool) -> Self {
        self.prefetch = on;
        self
    }

    /// Checks the dtypes.
    pub fn validate(&self) -> Result<()> {
        for (what, d) in [
            ("param_dtype", self.param_dtype),
            ("reduce_dtype", self.reduce_dtype),
        ] {
            if !matches!(d, DType::F32 | DType::BF16) {
                return Err(Error::dtype(
                    "FsdpConfig",
                    format!("f32 or bf16 for {what}"),
                    d,
                ));
            }
        }
        Ok(())
    }

    /// The rows shards are padded to a multiple of: the weight format's
    /// [`row_granule`](WeightFormat::row_granule) unless weights are quantized after a
    /// high-precision gather.
    pub fn row_granule(&self) -> usize {
        if self.quantize_after_gather {
            1
        } else {
            self.weight_format.row_granule()
        }
    }
}
