//! Fully sharded data parallelism for tessera: the last system of TransformerEngine's
//! `distributed.py` (scattering saved tensors over the FSDP group) and, around it, the
//! sharding engine a Rust training stack needs, since Rust has no
//! `torch.distributed.fsdp` to plug into.
//!
//! - [`Fsdp`]: parameters grouped in units (one per layer), each parameter split along
//!   dim 0 over the group (uneven sizes padded, [`ShardLayout`]). Before a unit computes,
//!   [`Fsdp::forward_pre`] all-gathers it — in f32 or bf16, or quantized
//!   ([`WeightFormat`]: FP8 current scaling with the amax all-reduced, MXFP8, NVFP4, FP8
//!   block) so only the quantized bytes travel, through tessera-collectives' one generic
//!   quantized gather — and issues the next unit's gather (prefetch). After it,
//!   [`Fsdp::forward_post`] frees the full copy per [`ReshardPolicy`];
//!   [`Fsdp::backward_post`] reduce-scatters gradients back to shards under a
//!   mixed-precision policy ([`FsdpConfig::param_dtype`], [`FsdpConfig::reduce_dtype`]).
//!   [`Fsdp::hybrid`] shards within a subgroup and replicates across subgroups.
//! - [`reduce_scatter_low_precision`] ([`lowp`]): gradients exchanged in FP8 or bf16 and
//!   summed in f32 by their receiver, deterministically (beyond TE; its issue #1579); the
//!   module docs give the communication volume.
//! - [`activations`]: TE's `_fsdp_scatter_tensors` / `_fsdp_gather_tensors` — tensors
//!   kept for backward split into 1-D chunks over the group (every buffer of a quantized
//!   tensor), gathered back before the backward, skipped for checkpointed modules.
//! - [`sharded`]: per-rank safetensors shards plus an index; loading at another world
//!   size re-shards; [`consolidate`] writes one file (`tessera consolidate`).
//! - [`CountingGroup`]: a [`ProcessGroup`](tessera_collectives::ProcessGroup) decorator
//!   counting what each collective sends.
//! - [`mlp`]: a reference model (residual MLP blocks with a hand-written backward) and
//!   its [`train_step`](mlp::train_step).
//!
//! ```
//! use std::sync::Arc;
//! use tessera_collectives::{ProcessGroup, run_ranks};
//! use tessera_fsdp::mlp::{Activations, MlpSpec, batch, rows, train_step};
//! use tessera_fsdp::{CountingGroup, Fsdp, FsdpConfig, WeightFormat};
//!
//! # fn main() -> tessera_core::Result<()> {
//! let spec = MlpSpec { d_model: 128, d_ffn: 256, layers: 2, seed: 1 };
//! let x = batch(16, 128, 7)?; // the global batch; each of 4 ranks takes 4 rows
//! let per_rank = run_ranks(4, |g| -> tessera_core::Result<_> {
//!     let rank = g.rank();
//!     let counted = Arc::new(CountingGroup::new(Arc::new(g)));
//!     let config = FsdpConfig::default().weight_format(WeightFormat::Mxfp8);
//!     let mut fsdp = Fsdp::new(counted.clone(), config)?;
//!     spec.build(&mut fsdp)?;
//!     let mine = rows(&x, rank * 4..rank * 4 + 4)?;
//!     let mut losses = Vec::new();
//!     for _ in 0..3 {
//!         losses.push(train_step(&mut fsdp, &mine, 0.5, Activations::Keep)?.loss);
//!     }
//!     // Each rank keeps a quarter of the f32 parameters.
//!     assert_eq!(fsdp.memory().shard_bytes, spec.param_bytes() / 4);
//!     Ok((losses, counted.counts().all_gather.bytes))
//! })?;
//! for r in per_rank {
//!     let (losses, gathered) = r?;
//!     assert!(losses[2] < losses[0]);
//!     // 3 steps × (forward + backward) × 2 layers × 2 weights, each rank sending its
//!     // 8192 values of each weight as MXFP8: 1 byte per value + 1 E8M0 scale per 32
//!     // (0.516 of bf16's 2 bytes per value).
//!     assert_eq!(gathered, 3 * 2 * 2 * 2 * (8192 + 8192 / 32));
//! }
//! # Ok(())
//! # }
//! ```

#![warn(missing_docs)]

pub mod activations;
mod config;
mod counting;
mod engine;
pub mod lowp;
pub mod mlp;
mod shard;
pub mod sharded;

pub use activations::{
    SavedActivations, SavedShape, Scattered, ScatteredTensors, fsdp_gather_tensors,
    fsdp_scatter_tensors,
};
pub use config::{FsdpConfig, GradReduce, ReshardPolicy, WeightFormat};
pub use counting::{CommCounts, CountingGroup, OpCount};
pub use engine::{
    Fsdp, FullParam, GatherStats, MemoryStats, ShardedParam, Wire, hybrid_groups,
    thread_hybrid_groups,
};
pub use lowp::{LowPrecision, reduce_scatter_low_precision};
pub use shard::ShardLayout;
pub use sharded::{Consolidated, ShardIndex, consolidate};
