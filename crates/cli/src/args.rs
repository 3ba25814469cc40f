//! The command line, as clap derive structures.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand, ValueEnum};

/// Quantize tensor files into TransformerEngine's formats (FP8 per-tensor, MXFP8, NVFP4,
/// FP8 block scaling), dequantize them, and measure the error each format makes.
#[derive(Debug, Parser)]
#[command(name = "tessera", version, propagate_version = true)]
pub struct Cli {
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// The subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Quantize every tensor of a .npy or .safetensors file into a .safetensors file of
    /// TransformerEngine buffers.
    ///
    /// For each input tensor NAME the output holds those of NAME.data, NAME.scale_inv,
    /// NAME.columnwise_data, NAME.columnwise_scale_inv, NAME.amax and
    /// NAME.columnwise_amax that the format and usage have, with TransformerEngine's
    /// shapes (scale padding included, written as zeros). FP8 buffers are stored as
    /// F8_E4M3/F8_E5M2, E8M0 scales as F8_E8M0, packed FP4 as U8 of shape [.., K/2]. The
    /// `__metadata__` names the format, its options and each tensor's shape and source
    /// dtype, so `tessera dequantize` can rebuild the tensors. A .npy file's tensor is
    /// named after the file's stem. Tensors are quantized in name order with one
    /// quantizer (this matters only for stochastic rounding, whose random stream runs
    /// on from tensor to tensor).
    Quantize(QuantizeArgs),

    /// Dequantize a file written by `tessera quantize` back to high precision.
    ///
    /// Every tensor is dequantized from its rowwise data (from the columnwise data when
    /// it has no rowwise data) and written in its source dtype. A .npy output holds
    /// exactly one tensor and has no bf16: a bf16 tensor is written as f32 (the bf16
    /// values, widened exactly).
    Dequantize(DequantizeArgs),

    /// Quantize every tensor of a model in memory and report the error per tensor.
    ///
    /// Prints one line per tensor: shape, dtype, bytes before and after (every buffer the
    /// usage asks for, padding included), the largest absolute error and the
    /// signal-to-noise ratio 10·log10(Σx²/Σ(x−x̂)²) in dB (+inf when exact). With usage
    /// both, the error is that of the worse orientation. Tensors the format cannot hold
    /// (shape or dtype) are listed as skipped with the reason. A summary line closes the
    /// report.
    Report(ReportArgs),

    /// Split every tensor's first dimension into --world equal shards, quantize each
    /// shard on its own rank and all-gather the quantized bytes; write rank 0's gathered
    /// tensors in the layout of `tessera quantize`.
    ///
    /// Per-tensor scales (fp8-current, nvfp4) use the amax all-reduced over the ranks, so
    /// the gathered bytes equal quantizing the whole tensor. Shards the format cannot
    /// gather quantized (e.g. mxfp8 shards whose rows are not a multiple of 32) travel in
    /// high precision and are quantized after the gather. Prints, per tensor, the bytes
    /// each rank sent.
    Gather(GatherArgs),

    /// Consolidate a sharded FSDP checkpoint (a directory of per-rank .safetensors shards
    /// and an index.json, as tessera-fsdp's `Fsdp::save_sharded` writes) into one
    /// .safetensors file holding every parameter whole.
    ///
    /// The rows of each parameter are read from whichever shard files the index lists for
    /// them; every row must be in exactly one shard. Parameters are written as f32 with
    /// their full shapes; the `__metadata__` records the format
    /// (`tessera-fsdp-consolidated`) and the world size the checkpoint was saved with.
    /// Prints one line per parameter and a summary.
    Consolidate(ConsolidateArgs),
}

/// `tessera consolidate`.
#[derive(Debug, Clone, Args)]
pub struct ConsolidateArgs {
    /// The checkpoint directory (holding index.json).
    pub checkpoint: PathBuf,

    /// The .safetensors file to write (written atomically).
    pub output: PathBuf,
}

/// Where the ranks of `tessera gather` run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Backend {
    /// Ranks are threads of this process.
    Threads,
    /// One process per GPU over NCCL (started by `cargo xtask test-gpu`'s launcher).
    Nccl,
}

/// `tessera gather`.
#[derive(Debug, Clone, Args)]
pub struct GatherArgs {
    /// The number of ranks (shards).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=1024))]
    pub world: u32,

    /// Where the ranks run.
    #[arg(long, value_enum, default_value = "threads")]
    pub backend: Backend,

    /// The format and its options.
    #[command(flatten)]
    pub quant: QuantArgs,

    /// The tensors to shard and gather (.npy or .safetensors).
    pub input: PathBuf,

    /// The .safetensors file to write (written atomically).
    pub output: PathBuf,
}

/// `tessera quantize`.
#[derive(Debug, Clone, Args)]
pub struct QuantizeArgs {
    /// The format and its options.
    #[command(flatten)]
    pub quant: QuantArgs,

    /// The tensors to quantize: a .npy file (f32 or f16) or a .safetensors file (every
    /// tensor in it must be F32, BF16 or F16).
    pub input: PathBuf,

    /// The .safetensors file to write (written atomically: on failure nothing is
    /// written).
    pub output: PathBuf,
}

/// `tessera dequantize`.
#[derive(Debug, Clone, Args)]
pub struct DequantizeArgs {
    /// A .safetensors file written by `tessera quantize`.
    pub input: PathBuf,

    /// The .npy or .safetensors file to write (written atomically).
    pub output: PathBuf,
}

/// `tessera report`.
#[derive(Debug, Clone, Args)]
pub struct ReportArgs {
    /// The format and its options.
    #[command(flatten)]
    pub quant: QuantArgs,

    /// The model: a .safetensors file (or a .npy file).
    pub model: PathBuf,
}

/// A quantized format, as named on the command line.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, ValueEnum)]
pub enum Format {
    /// FP8 with one scale per tensor, computed from the tensor's amax.
    Fp8Current,
    /// FP8 with one given scale per tensor (`--scale`), as delayed scaling uses it.
    Fp8Delayed,
    /// MXFP8: an E8M0 scale per 32 elements.
    Mxfp8,
    /// NVFP4: FP4 E2M1 values, an E4M3 scale per 16 elements and a global amax.
    Nvfp4,
    /// FP8 with a float32 scale per 1×128 block or 128×128 tile.
    Fp8Block,
}

impl Format {
    /// The name used on the command line and in file metadata, e.g. `fp8-current`.
    pub const fn name(self) -> &'static str {
        match self {
            Format::Fp8Current => "fp8-current",
            Format::Fp8Delayed => "fp8-delayed",
            Format::Mxfp8 => "mxfp8",
            Format::Nvfp4 => "nvfp4",
            Format::Fp8Block => "fp8-block",
        }
    }

    /// Every format.
    pub const ALL: [Format; 5] = [
        Format::Fp8Current,
        Format::Fp8Delayed,
        Format::Mxfp8,
        Format::Nvfp4,
        Format::Fp8Block,
    ];
}

/// An FP8 element format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Fp8Arg {
    /// E4M3: max 448, 3 mantissa bits.
    E4m3,
    /// E5M2: max 57344, 2 mantissa bits.
    E5m2,
}

/// How per-block or per-tensor float32 scales are computed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ScalesArg {
    /// Rounded down to powers of two.
    Pow2,
    /// Any float32 value.
    Fp32,
}

/// Which orientations to produce.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum UsageArg {
    /// Blocks along the last dimension only.
    Rowwise,
    /// Blocks along the first dimensions only (the transposed GEMM operand).
    Columnwise,
    /// Both.
    Both,
}

/// The quantizer options shared by `quantize` and `report`. Every option is optional so
/// that one the chosen format does not have can be reported as an error.
#[derive(Debug, Clone, Args)]
pub struct QuantArgs {
    /// The quantized format.
    #[arg(long, value_enum)]
    pub format: Format,

    /// The FP8 element format (all formats but nvfp4) [default: e4m3].
    #[arg(long, value_enum, value_name = "FP8")]
    pub fp8: Option<Fp8Arg>,

    /// The scale of fp8-delayed: values are multiplied by it before the cast
    /// [default: 1.0].
    #[arg(long, value_name = "S", allow_negative_numbers = true)]
    pub scale: Option<f32>,

    /// Power-of-two or float32 scales (fp8-current, fp8-block) [default: fp32 for
    /// fp8-current, pow2 for fp8-block].
    #[arg(long, value_enum)]
    pub scales: Option<ScalesArg>,

    /// The amax floor used when computing scales (fp8-current, fp8-block)
    /// [default: 0].
    #[arg(long, value_name = "E", allow_negative_numbers = true)]
    pub eps: Option<f32>,

    /// One scale per 2-D tile shared by both orientations: 32×32 for mxfp8, 16×16 for
    /// nvfp4.
    #[arg(long = "2d")]
    pub two_d: bool,

    /// The block shape of fp8-block: 1 (1×128 blocks) or 2 (128×128 tiles) [default: 1].
    #[arg(long, value_name = "1|2", value_parser = clap::value_parser!(u8).range(1..=2))]
    pub block_dim: Option<u8>,

    /// The orientations to produce [default: both].
    #[arg(long, value_enum)]
    pub usage: Option<UsageArg>,

    /// Scales in cuBLAS's GEMM-swizzled layout (mxfp8, nvfp4).
    #[arg(long)]
    pub swizzled: bool,

    /// The random Hadamard transform of the columnwise operand (nvfp4).
    #[arg(long)]
    pub rht: bool,

    /// Stochastic rounding with random bits from seed `--seed` (nvfp4).
    #[arg(long, requires = "seed")]
    pub stochastic_rounding: bool,

    /// The seed of the stochastic-rounding random stream.
    #[arg(long, value_name = "N", requires = "stochastic_rounding")]
    pub seed: Option<u64>,
}
