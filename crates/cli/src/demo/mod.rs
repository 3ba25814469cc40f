//! `tessera demo`: tensor, sequence and data parallel training end to end, checked
//! against one unsharded rank.
//!
//! ```text
//! tessera demo [--tp 2] [--dp 2] [--layers 4] [--hidden 256] [--ffn 4·hidden] [--seq 256]
//!              [--steps 20] [--format mxfp8] [--checkpoint none|reentrant|non-reentrant]
//!              [--backend threads] [--reference-sums split|whole] [--report out.json]
//!              [--plot loss.svg] [--dropout 0.1] [--lr 1] [--seed 1234]
//! ```
//!
//! # What it trains
//!
//! A stack of `--layers` transformer MLP blocks, each `y = x + dropout(FC2(dropout(
//! GeLU(FC1(LN(x))))))`, written on tessera's crates (module `block`): `tp · dp` ranks —
//! threads of this process (tessera-collectives' `run_ranks`) or one process per GPU
//! (see [Backends](#backends)); rank `r` is tensor-parallel rank `r % tp` of
//! data-parallel rank `r / tp`.
//!
//! - Tensor parallelism: FC1 is column-parallel, FC2 row-parallel (each rank holds
//!   `ffn/tp` of the hidden layer).
//! - Sequence parallelism: between blocks each tensor-parallel rank holds `seq/tp` tokens;
//!   FC1's input is quantized (per-tensor formats with the amax all-reduced over the group)
//!   and all-gathered in the format; FC2's output is reduce-scattered.
//! - Data parallelism: every data-parallel rank trains on its own batch of `seq` tokens;
//!   parameters are sharded over the data-parallel group by tessera-fsdp (ZeRO-3: gathered
//!   before each block's forward and again before its backward, next block prefetched),
//!   gradients reduce-scattered and averaged, SGD on the f32 shards. FC1's and FC2's
//!   weights travel in the format where it allows (bf16: bf16; fp8-delayed: f32, cast
//!   after the gather with the delayed scale); LayerNorm's `γ`, `β` sit in a second
//!   engine that gathers them in high precision.
//! - Recompute: with `--checkpoint`, every block runs in a tessera-checkpoint frame
//!   (reentrant or non-reentrant, determinism check on) that replays the RNG tracker, the
//!   current generator and the delayed-scaling state.
//! - RNG: Megatron's seeds (tessera-rng's `model_parallel_manual_seed`): the dropout after
//!   GeLU forks the tracker's model-parallel stream, different on every tensor-parallel
//!   rank; the dropout on the residual stream draws the whole sequence's mask from the
//!   shared current generator, the same on every tensor-parallel rank, and each rank
//!   applies its rows. Data-parallel replicas share their seeds (Megatron's default).
//! - Task: the target of every token is its input with the features rotated by one;
//!   the loss is `0.5 · mean((y - target)²)`, averaged over the data-parallel batches.
//! - GEMMs: the `gemm` crate on the CPU, cuBLAS on a GPU, with f32 accumulation; the
//!   format decides what their inputs are rounded or quantized to ([`config`]).
//!
//! # The check
//!
//! The same model trains on one unsharded rank with the same recipe (module
//! `reference`): no communication, whole weights, whole sequences, every quantization and
//! every dropout mask reproduced exactly — FC1's input quantized whole (what the
//! sequence-parallel gather of shards quantized with the all-reduced amax equals), the
//! operands a tensor-parallel rank quantizes on its own (its weight shards, FC2's input
//! columns) quantized per column block, one RNG tracker per tensor-parallel rank and the
//! shared stream for the whole sequence.
//!
//! What can still differ is the order of float additions. The ranks split three sums:
//! FC2's product and FC1's input gradient over `ffn` (partial products per rank, added
//! by a reduce-scatter), and LayerNorm's `γ`/`β` gradients over the sequence (per shard,
//! added by an all-reduce); and a GEMM kernel may block a sum differently for matrices of
//! another shape. By default (`--reference-sums split`) the reference makes the same
//! additions in the same order — each product with a rank's shape, the partial products
//! and the shards' gradients added in rank order — so **the two runs must agree bit for
//! bit**, for every format, checkpoint mode and `tp × dp`: any difference is a bug.
//!
//! With `--reference-sums whole` the reference multiplies whole matrices. Each sum of `K`
//! terms is then within `γ_K ≈ K·u` (relative, `u = 2⁻²⁴`) of the exact value in either
//! order, so the two differ by at most `2·K·u`; summing `K` over every such sum of a
//! step's forward and backward and doubling for the quadratic loss, the loss difference
//! is held to `4·u·K·L₀` ([`report::Tolerance`] lists the terms). That is a first-order
//! f32 bound: with a quantized (or bf16) format a rounding difference can move an element
//! across a quantization step, and training then carries the two runs apart further
//! than f32 rounding would — the largest relative differences measured at the defaults
//! over 20 steps: 5e-5 for bf16, 3e-4 to 9e-4 for the FP8 formats and MXFP8, 2.8e-3 for
//! NVFP4, against a bound of 3.2e-3 — which is why the exact check is the default.
//!
//! The RNG checks compare mask checksums: data-parallel-region masks identical on every
//! tensor-parallel rank, model-parallel-region masks pairwise different, and every mask
//! equal to the reference's. With checkpointing, every block must have been recomputed
//! with the determinism check on (it compares every saved tensor, masks included, with
//! its forward). The saved-activation meter of the checkpoint frames must equal what the
//! blocks' byte counts predict. A failed check exits with status 1; options that do not
//! fit together (`--seq` not divisible by `--tp`, shapes a block format cannot hold) with
//! 2.
//!
//! # Backends
//!
//! - `--backend threads` (the default): `tp · dp` thread ranks of this process on the
//!   CPU, exchanging host tensors through a [`ThreadGroup`](tessera_collectives::ThreadGroup).
//! - `--backend nccl`: one process per GPU, started by a torchrun-style launcher
//!   (`torchrun --no-python`, or `cargo xtask test-gpu`'s, which runs the demo this way)
//!   that sets `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR` and `MASTER_PORT`. Each
//!   process joins an `NcclGroup` (`tessera_collectives::nccl`) and trains its
//!   rank on its GPU: GEMMs through cuBLAS, LayerNorm, GeLU, dropout and the
//!   quantizers through tessera's kernels (module `process`). Rank 0 trains the
//!   reference on its GPU too, so the exact check compares cuBLAS with cuBLAS; needs a
//!   build with the `cuda` feature.
//!
//! The arithmetic is the same on both (module `ops`): apart from the GEMMs' internal
//! blocking, a GPU run computes the very bits of a CPU run.

mod block;
pub mod config;
#[cfg(feature = "cuda")]
mod gpu;
mod model;
mod ops;
mod plot;
mod process;
mod rank;
pub mod record;
mod reference;
pub mod report;

use std::path::PathBuf;
use std::sync::mpsc;
use std::time::Instant;

use std::sync::Arc;

use tessera_collectives::{ProcessGroup, run_ranks};

pub use config::DemoConfig;
pub use process::execute_in_group;
pub use report::DemoReport;

use crate::UsageError;
use crate::args::{Backend, DemoArgs};
use rank::{RankOutput, StepEvent};
use reference::Reference;
use report::Console;

/// Everything `tessera demo` can fail with.
#[derive(Debug, thiserror::Error)]
pub enum DemoError {
    /// `--seq` does not split into `--tp` equal sequence shards.
    #[error(
        "--seq {seq} is not divisible by --tp {tp}: sequence parallelism gives each \
         tensor-parallel rank seq/tp tokens"
    )]
    SeqNotDivisible {
        /// `--seq`.
        seq: usize,
        /// `--tp`.
        tp: usize,
    },
    /// A GEMM operand's shape does not hold whole blocks of the format.
    #[error("--format {format} cannot quantize the {what}: {reason}")]
    NotQuantizable {
        /// The format.
        format: &'static str,
        /// The operand and where its shape comes from.
        what: String,
        /// The quantizer's message.
        reason: String,
    },
    /// Any other option out of range or inconsistent.
    #[error("{0}")]
    Usage(String),
    /// `--backend nccl` in a build without the `cuda` feature.
    #[error(
        "--backend nccl needs a tessera built with the `cuda` feature \
         (cargo build -p tessera-cli --features cuda); use --backend threads here"
    )]
    NoCuda,
    /// A tessera operation failed on a rank or in the reference.
    #[error("{context}: {source}")]
    Tessera {
        /// Where.
        context: String,
        /// What.
        #[source]
        source: tessera_core::Error,
    },
    /// Writing the output, the report or the chart failed.
    #[error("writing {what}: {source}")]
    Io {
        /// What was being written.
        what: String,
        /// Why it failed.
        #[source]
        source: std::io::Error,
    },
    /// The chart could not be drawn.
    #[error("drawing {path}: {msg}")]
    Plot {
        /// The chart's path.
        path: PathBuf,
        /// What went wrong.
        msg: String,
    },
    /// The run finished and some checks failed.
    #[error("{failed} of {total} checks failed: {names}")]
    ChecksFailed {
        /// How many failed.
        failed: usize,
        /// How many ran.
        total: usize,
        /// Their names.
        names: String,
    },
}

impl DemoError {
    /// Whether this is a usage error (exit status 2).
    pub fn is_usage(&self) -> bool {
        matches!(
            self,
            DemoError::SeqNotDivisible { .. }
                | DemoError::NotQuantizable { .. }
                | DemoError::Usage(_)
        )
    }

    fn tessera(context: impl Into<String>) -> impl FnOnce(tessera_core::Error) -> DemoError {
        let context = context.into();
        move |source| DemoError::Tessera { context, source }
    }
}

/// Runs `tessera demo` from its parsed options; usage errors come back as
/// [`UsageError`] (exit status 2), failed checks and everything else as errors with
/// status 1.
pub fn run(a: &DemoArgs) -> anyhow::Result<()> {
    let out = DemoConfig::from_args(a).and_then(|cfg| {
        let mut console = Console::new(cfg.steps);
        let report = match cfg.backend {
            Backend::Threads => execute(&cfg, &mut console)?,
            Backend::Nccl => match execute_in_group(&cfg, nccl_world()?, &mut console)? {
                Some(report) => report,
                // Rank 0 reports; the others are done once their part is.
                None => return Ok(()),
            },
        };
        if let Some(path) = &a.report {
            report.write_json(path)?;
        }
        if let Some(path) = &a.plot {
            plot::write_svg(path, &report)?;
        }
        report.result()
    });
    out.map_err(|e| {
        if e.is_usage() {
            anyhow::Error::new(UsageError(e.to_string()))
        } else {
            anyhow::Error::new(e)
        }
    })
}

/// This process's rank of the NCCL group its launcher started.
#[cfg(feature = "cuda")]
fn nccl_world() -> Result<Arc<dyn ProcessGroup>, DemoError> {
    let group = tessera_collectives::nccl::NcclGroup::from_env().map_err(DemoError::tessera(
        "--backend nccl: joining the NCCL group of this process's launcher (one process per \
         GPU with RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT set)",
    ))?;
    Ok(Arc::new(group))
}

/// Without the `cuda` feature there is no NCCL group to join.
#[cfg(not(feature = "cuda"))]
fn nccl_world() -> Result<Arc<dyn ProcessGroup>, DemoError> {
    Err(DemoError::NoCuda)
}

/// Trains the reference and the distributed model on thread ranks, printing each step's
/// losses and the summary on `console`, and returns the report (its checks may have
/// failed).
pub fn execute(cfg: &DemoConfig, console: &mut Console) -> Result<DemoReport, DemoError> {
    console.intro(cfg)?;

    let init = model::init(cfg).map_err(DemoError::tessera("initial weights"))?;
    let (ref_steps, ref_time) = train_reference(cfg, &init, console)?;

    console.phase("distributed");
    let tolerance = report::Tolerance::new(cfg);
    let first_ref = ref_steps.first().map_or(0.0, |r| r.loss);
    console.table_header(&tolerance, first_ref)?;
    let (tx, rx) = mpsc::channel::<StepEvent>();
    let mut rows = Vec::with_capacity(cfg.steps);
    let ranks: Result<Vec<tessera_core::Result<RankOutput>>, DemoError> = std::thread::scope(|s| {
        let init = &init;
        let handle = s.spawn(move || {
            run_ranks(cfg.world(), |g| {
                let tx = tx.clone();
                // A receiver that went away has nothing left to show; training goes on.
                let mut send = |ev: StepEvent| {
                    let _ = tx.send(ev);
                    Ok(())
                };
                rank::run_rank(Arc::new(g), cfg, init, &mut send)
            })
        });
        let mut parts = vec![vec![None::<f64>; cfg.world()]; cfg.steps];
        let mut next = 0;
        for ev in rx {
            let Some(slot) = parts.get_mut(ev.step) else {
                continue;
            };
            slot[ev.dp * cfg.tp + ev.tp] = Some(ev.loss_sum);
            while next < cfg.steps && parts[next].iter().all(Option::is_some) {
                let sums: Vec<f64> = parts[next]
                    .chunks(cfg.tp)
                    .map(|c| c.iter().fold(0.0, |a, v| a + v.unwrap_or(0.0)))
                    .collect();
                let row = report::StepRow::new(
                    next,
                    model::step_loss(cfg, &sums),
                    ref_steps[next].loss,
                    tolerance.bound(first_ref),
                );
                console.row(&row)?;
                console.tick();
                rows.push(row);
                next += 1;
            }
        }
        handle
            .join()
            .map_err(|_| DemoError::Tessera {
                context: "distributed run".into(),
                source: tessera_core::Error::state("run_ranks", "the driver thread panicked"),
            })?
            .map_err(DemoError::tessera("distributed run"))
    });
    console.done();
    let outputs = first_failure(ranks?)?;
    let report = DemoReport::build(cfg, &tolerance, rows, &ref_steps, ref_time, &outputs);
    console.summary(&report)?;
    Ok(report)
}

/// Trains the reference from `init` on `cfg.device`, ticking `console` each step;
/// returns its steps and how long they took.
fn train_reference(
    cfg: &DemoConfig,
    init: &[model::LayerWeights],
    console: &Console,
) -> Result<(Vec<reference::RefStep>, std::time::Duration), DemoError> {
    console.phase("reference");
    let t0 = Instant::now();
    let mut reference = Reference::new(cfg, init).map_err(DemoError::tessera("reference"))?;
    let mut steps = Vec::with_capacity(cfg.steps);
    for step in 0..cfg.steps {
        steps.push(
            reference
                .step(step)
                .map_err(DemoError::tessera(format!("reference, step {}", step + 1)))?,
        );
        console.tick();
    }
    Ok((steps, t0.elapsed()))
}

/// Every rank's output, or the error that most likely started the failure: a rank's own
/// error rather than the "rank left the group" errors it caused on the others.
fn first_failure(
    ranks: Vec<tessera_core::Result<RankOutput>>,
) -> Result<Vec<RankOutput>, DemoError> {
    let mut errors = Vec::new();
    let mut outputs = Vec::new();
    for (r, res) in ranks.into_iter().enumerate() {
        match res {
            Ok(o) => outputs.push(o),
            Err(e) => errors.push((r, e)),
        }
    }
    let secondary = |e: &tessera_core::Error| {
        let m = e.to_string();
        m.contains("left the group") || m.contains("was aborted")
    };
    let pick = errors
        .iter()
        .position(|(_, e)| !secondary(e))
        .or(if errors.is_empty() { None } else { Some(0) });
    match pick {
        Some(i) => {
            let (r, e) = errors.swap_remove(i);
            Err(DemoError::Tessera {
                context: format!("rank {r}"),
                source: e,
            })
        }
        None => Ok(outputs),
    }
}
