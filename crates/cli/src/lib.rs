//! The `tessera` command: tessera's user-facing front door, thin over the crates.
//!
//! ```text
//! tessera quantize   --format <FORMAT> [options] INPUT OUTPUT.safetensors
//! tessera dequantize INPUT.safetensors OUTPUT(.npy|.safetensors)
//! tessera report     --format <FORMAT> [options] MODEL.safetensors
//! tessera gather     --world N [--backend threads|nccl] --format <FORMAT> INPUT OUTPUT.safetensors
//! tessera demo       [--tp N] [--dp N] [--format F] [--checkpoint MODE] [options]
//! ```
//!
//! - [`quantize`] reads every f32/bf16/f16 tensor of a `.npy` or `.safetensors` file and
//!   writes, for each tensor `NAME`, its TransformerEngine buffers (`NAME.data`,
//!   `NAME.scale_inv`, `NAME.columnwise_data`, ...) with TE's shapes, padding included,
//!   plus `__metadata__` naming the format, its options and each tensor's logical shape
//!   and source dtype ([`recipe`] describes the keys).
//! - [`dequantize`] rebuilds each tensor of such a file with
//!   [`QuantizedTensor::from_buffers`](tessera_quant::QuantizedTensor::from_buffers), which
//!   checks every buffer's shape and dtype, and writes the values in the source dtype.
//! - [`report`] quantizes every tensor of a model in memory and prints, per tensor, the
//!   bytes before and after, the largest absolute error and the signal-to-noise ratio.
//! - [`gather`] shards each tensor along its first dimension over `N` ranks, quantizes
//!   every shard on its rank and all-gathers the quantized bytes; rank 0 writes what it
//!   gathered, byte for byte what [`quantize`] writes for the whole file. Ranks are
//!   threads, or (`--backend nccl`, `cuda` feature) one process per GPU started by a
//!   torchrun-style launcher, quantizing with the CUDA kernels.
//! - [`demo`] trains transformer MLP blocks with tensor, sequence and data (FSDP)
//!   parallelism on thread ranks and checks every step against one unsharded rank.
//!
//! The library half of the crate exists so that each step can be tested on its own; the
//! binary (`src/main.rs`) only parses the command line, calls [`run`] and turns an error
//! into one `error: ...` line on stderr and an exit code ([`exit_code`]).
//!
//! The same steps from Rust: parse options, build the quantizer, measure its error.
//!
//! ```
//! use clap::Parser;
//! use tessera_cli::recipe::Recipe;
//! use tessera_cli::{Cli, Command};
//! use tessera_core::{Device, Tensor};
//!
//! # fn main() -> anyhow::Result<()> {
//! let cli = Cli::try_parse_from(["tessera", "report", "--format", "mxfp8", "--2d", "m.safetensors"])?;
//! let Command::Report(args) = cli.command else { unreachable!() };
//! let recipe = Recipe::from_args(&args.quant)?;
//! assert_eq!(recipe.to_metadata()["2d"], "true");
//!
//! let x = Tensor::from_slice(&vec![1.0f32; 32 * 32], [32, 32], Device::Cpu)?;
//! let qt = recipe.quantizer()?.quantize(&x)?;
//! let err = tessera_cli::report::measure(&x, &qt)?;
//! assert_eq!(err.snr_db, f64::INFINITY); // 1.0 is exact in MXFP8
//!
//! // An option the format does not have is a usage error (exit status 2).
//! let cli = Cli::try_parse_from(["tessera", "report", "--format", "mxfp8", "--rht", "m.safetensors"])?;
//! let Command::Report(args) = cli.command else { unreachable!() };
//! let err = Recipe::from_args(&args.quant).unwrap_err();
//! assert_eq!(err.to_string(), "--rht does not apply to --format mxfp8; it applies to nvfp4");
//! # Ok(())
//! # }
//! ```

#![warn(missing_docs)]

pub mod args;
pub mod consolidate;
pub mod demo;
pub mod dequantize;
pub mod gather;
pub mod io;
pub mod progress;
pub mod quantize;
pub mod recipe;
pub mod report;

use std::fmt;

pub use args::{Cli, Command};

/// A command line that parsed but asks for something inconsistent (an option the chosen
/// format does not have, an out-of-range value). The binary exits with status 2 for it,
/// like clap's own usage errors.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UsageError(pub String);

impl fmt::Display for UsageError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for UsageError {}

/// Runs one parsed command line.
pub fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Quantize(a) => quantize::run(&a),
        Command::Dequantize(a) => dequantize::run(&a),
        Command::Report(a) => report::run(&a),
        Command::Gather(a) => gather::run(&a),
        Command::Consolidate(a) => consolidate::run(&a),
        Command::Demo(a) => demo::run(&a),
    }
}

/// The exit status for an error returned by [`run`]: 2 for a [`UsageError`], 1 for
/// everything else.
pub fn exit_code(err: &anyhow::Error) -> u8 {
    if err.downcast_ref::<UsageError>().is_some() {
        2
    } else {
        1
    }
}

/// `err` and its causes as one line: `outer: inner: innermost`, with any line breaks
/// inside a message replaced by spaces.
pub fn one_line(err: &anyhow::Error) -> String {
    format!("{err:#}")
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect::<Vec<_>>()
        .join(" ")
}

/// Whether `err` was caused by writing to a closed pipe (e.g. `tessera report ... | head`).
pub fn is_broken_pipe(err: &anyhow::Error) -> bool {
    err.chain().any(|e| {
        e.downcast_ref::<std::io::Error>()
            .is_some_and(|e| e.kind() == std::io::ErrorKind::BrokenPipe)
    })
}
