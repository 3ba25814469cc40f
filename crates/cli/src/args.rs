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

    /// Train a stack of transformer MLP blocks with tensor, sequence and data (FSDP)
    /// parallelism on thread ranks, train the same model on one unsharded rank with the
    /// same recipe, and check that both agree.
    ///
    /// Each block: LayerNorm; column-parallel FC1 whose input is all-gathered along the
    /// sequence in --format; GeLU; dropout from the model-parallel RNG stream; row-parallel
    /// FC2 whose output is reduce-scattered along the sequence; residual + dropout from the
    /// shared data-parallel stream. Weights are sharded over the data-parallel ranks
    /// (FSDP) and gathered in --format where it allows. Prints each step's loss of both
    /// runs and their difference, then a summary: the largest difference and the
    /// tolerance it is held to, tokens/s, bytes per collective and format, peak saved
    /// activations with and without checkpointing, and the RNG checks. Exits with status
    /// 1 when a check fails.
    Demo(DemoArgs),
}

/// The GEMM recipe of `tessera demo`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, ValueEnum)]
pub enum DemoFormat {
    /// GEMM operands rounded to bf16, f32 accumulation; FSDP gathers weights in bf16.
    Bf16,
    /// FP8 E4M3 with one scale per tensor from its amax (all-reduced over the
    /// sequence-parallel gather).
    Fp8Current,
    /// FP8 E4M3 with scales from an amax history (all-reduced over every rank once per
    /// step).
    Fp8Delayed,
    /// MXFP8 E4M3 with an E8M0 scale per 32 elements.
    Mxfp8,
    /// NVFP4: FP4 E2M1 with an E4M3 scale per 16 elements and a global amax.
    Nvfp4,
    /// FP8 E4M3 with an f32 scale per 1×128 block.
    Fp8Block,
}

/// Activation checkpointing of `tessera demo`'s blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, ValueEnum)]
pub enum CheckpointArg {
    /// Every block keeps what its backward needs.
    None,
    /// Blocks keep their input; backward recomputes the forward first.
    Reentrant,
    /// Blocks keep their input; the backward's first use of an activation recomputes.
    NonReentrant,
}

/// How `tessera demo`'s reference adds the products tensor parallelism splits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, ValueEnum)]
pub enum ReferenceSums {
    /// FC2's product and FC1's input gradient summed over the ranks' partial products in
    /// rank order, LayerNorm's gradients over sequence shards, each product with the
    /// ranks' shapes: the same float additions in the same order.
    Split,
    /// Whole matrices multiplied at once: the float additions in another order.
    Whole,
}

/// A deliberate bug for testing that `tessera demo`'s checks catch it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, ValueEnum)]
pub enum DemoFault {
    /// The last tensor-parallel rank seeds its model-parallel stream wrongly.
    MpMask,
    /// The last tensor-parallel rank's data-parallel stream runs 4 words ahead.
    DpMask,
}

/// `tessera demo`.
#[derive(Debug, Clone, Args)]
pub struct DemoArgs {
    /// Tensor-parallel ranks (the sequence is split across them too).
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..=64))]
    pub tp: u32,

    /// Data-parallel ranks (parameters FSDP-sharded across them; each trains on its own
    /// batch of --seq tokens).
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..=64))]
    pub dp: u32,

    /// Transformer MLP blocks.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..=256))]
    pub layers: u32,

    /// Width of the residual stream.
    #[arg(long, default_value_t = 256, value_parser = clap::value_parser!(u32).range(1..=65536))]
    pub hidden: u32,

    /// Width of the MLP's hidden layer [default: 4 × --hidden].
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=262144))]
    pub ffn: Option<u32>,

    /// Tokens per data-parallel batch (divisible by --tp).
    #[arg(long, default_value_t = 256, value_parser = clap::value_parser!(u32).range(1..=65536))]
    pub seq: u32,

    /// Training steps.
    #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u32).range(1..=100000))]
    pub steps: u32,

    /// The GEMM recipe: what GEMM inputs, sequence-parallel gathers and FSDP weight
    /// gathers are quantized to.
    #[arg(long, value_enum, default_value = "mxfp8")]
    pub format: DemoFormat,

    /// Activation checkpointing of every block.
    #[arg(long, value_enum, default_value = "none")]
    pub checkpoint: CheckpointArg,

    /// Where the ranks run.
    #[arg(long, value_enum, default_value = "threads")]
    pub backend: Backend,

    /// Dropout probability (both dropouts).
    #[arg(long, default_value_t = 0.1, value_name = "P")]
    pub dropout: f32,

    /// SGD learning rate.
    #[arg(long, default_value_t = 1.0, value_name = "LR")]
    pub lr: f32,

    /// The seed of the weights, the data and the RNG streams.
    #[arg(long, default_value_t = 1234)]
    pub seed: u64,

    /// Write the per-step losses and the summary as JSON.
    #[arg(long, value_name = "OUT.json")]
    pub report: Option<PathBuf>,

    /// Draw both loss curves and their difference as an SVG chart.
    #[arg(long, value_name = "LOSS.svg")]
    pub plot: Option<PathBuf>,

    /// How the reference adds the products the tensor-parallel ranks split: `split` adds
    /// the same partial sums in the ranks' order (both runs must then agree bit for bit);
    /// `whole` multiplies whole matrices (the loss is then held to an f32 rounding bound).
    #[arg(long, value_enum, default_value = "split")]
    pub reference_sums: ReferenceSums,

    /// Break the run on purpose, to see a check fail (for tests).
    #[arg(long, value_enum, hide = true)]
    pub inject_fault: Option<DemoFault>,
}

/// `tessera consolidate`.
#[derive(Debug, Clone, Args)]
pub struct ConsolidateArgs {
    /// The checkpoint directory (holding index.json).
    pub checkpoint: PathBuf,

    /// The .safetensors file to write (written atomically).
    pub output: PathBuf,
}

/// Where the ranks of `tessera gather` and `tessera demo` run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Backend {
    /// Ranks are threads of this process.
    Threads,
    /// One process per GPU over NCCL, started by a torchrun-style launcher (`RANK`,
    /// `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT`); needs the `cuda`
    /// feature. `tessera gather` only: rank 0 writes the output.
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
