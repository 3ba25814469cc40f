//! Tensor-parallel seeding and parameter initialisation (Megatron-LM conventions, as
//! TransformerEngine's `distributed.py` uses them).
//!
//! # Seeds
//!
//! From one user seed `s`, rank `t` of the tensor-parallel group and rank `e` of the
//! expert-parallel group (Megatron's `model_parallel_cuda_manual_seed`):
//!
//! | stream | seed | same on all TP ranks? |
//! |---|---|---|
//! | data-parallel: the device's current generator | `s` | yes |
//! | [`MODEL_PARALLEL_RNG`] | `s + 2718 + t` | no |
//! | [`EXPERT_PARALLEL_RNG`] | `s + 1024 + 100·e + t` | no |
//!
//! Dropout in the replicated (sequence/data-parallel) region draws from the current
//! generator and agrees across TP ranks; dropout inside the tensor-parallel region and
//! the initialisation of sharded weights fork the model-parallel state and differ.

use tessera_core::{Error, Parameter, Result, Tensor, TpAttributes};

use crate::current::{manual_seed, with_current_generator};
use crate::tracker::RngTracker;

/// The tracker name of the per-TP-rank stream (Megatron's
/// `_MODEL_PARALLEL_RNG_TRACKER_NAME`).
pub const MODEL_PARALLEL_RNG: &str = "model-parallel-rng";

/// The tracker name of the per-expert-rank stream (Megatron's
/// `_EXPERT_PARALLEL_RNG_TRACKER_NAME`).
pub const EXPERT_PARALLEL_RNG: &str = "expert-parallel-rng";

/// The seeds of one rank, derived from the user's seed (see the [module docs](self)).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ParallelSeeds {
    /// Seed of the device's current generator: the user seed, on every rank.
    pub data_parallel: u64,
    /// Seed of [`MODEL_PARALLEL_RNG`]: `seed + 2718 + tp_rank`.
    pub model_parallel: u64,
    /// Seed of [`EXPERT_PARALLEL_RNG`]: `seed + 1024 + 100 * ep_rank + tp_rank`.
    pub expert_parallel: u64,
}

impl ParallelSeeds {
    /// The seeds of tensor-parallel rank `tp_rank` and expert-parallel rank `ep_rank`.
    /// Fails when a seed would overflow `u64`.
    pub fn megatron(seed: u64, tp_rank: u64, ep_rank: u64) -> Result<Self> {
        let overflow = || {
            Error::invalid(
                "ParallelSeeds::megatron",
                format!("seed {seed} with tp rank {tp_rank} and ep rank {ep_rank} overflows u64"),
            )
        };
        let model_parallel = seed
            .checked_add(2718)
            .and_then(|s| s.checked_add(tp_rank))
            .ok_or_else(overflow)?;
        let expert_parallel = ep_rank
            .checked_mul(100)
            .and_then(|e| e.checked_add(1024))
            .and_then(|e| e.checked_add(tp_rank))
            .and_then(|e| e.checked_add(seed))
            .ok_or_else(overflow)?;
        Ok(ParallelSeeds {
            data_parallel: seed,
            model_parallel,
            expert_parallel,
        })
    }
}

/// Seeds one rank: resets `tracker`, seeds its device's current generator with the
/// data-parallel seed, and adds the model-parallel and expert-parallel states
/// (Megatron's `model_parallel_cuda_manual_seed`). Returns the seeds used.
pub fn model_parallel_manual_seed(
    tracker: &mut RngTracker,
    seed: u64,
    tp_rank: u64,
    ep_rank: u64,
) -> Result<ParallelSeeds> {
    let seeds = ParallelSeeds::megatron(seed, tp_rank, ep_rank)?;
    tracker.reset();
    manual_seed(tracker.device(), seeds.data_parallel)?;
    tracker.add(MODEL_PARALLEL_RNG, seeds.model_parallel)?;
    tracker.add(EXPERT_PARALLEL_RNG, seeds.expert_parallel)?;
    Ok(seeds)
}

/// How [`initialize_affine_weight`] treats a parameter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AffineInit {
    /// The dimension each rank holds a slice of (0 for a column-parallel weight
    /// `[out/tp, in]`, 1 for a row-parallel weight `[out, in/tp]`).
    pub partition_dim: usize,
    /// Interleaved partitions per rank along `partition_dim`.
    pub stride: usize,
    /// Whether to record the tensor-parallel attributes on the parameter.
    pub set_tp_attributes: bool,
}

impl Default for AffineInit {
    fn default() -> Self {
        AffineInit {
            partition_dim: 0,
            stride: 1,
            set_tp_attributes: true,
        }
    }
}

/// Initialises a tensor-parallel weight shard (TransformerEngine's
/// `initialize_affine_weight_gpu`): records its attributes (`is_parallel`,
/// `partition_dim`, `stride`; a second time is an error), then runs `init` on the
/// tensor — under the tracker's [`MODEL_PARALLEL_RNG`] state when a tracker is given,
/// so every rank draws a different shard, or on the current generator otherwise.
pub fn initialize_affine_weight(
    weight: &mut Parameter,
    how: AffineInit,
    tracker: Option<&mut RngTracker>,
    init: impl FnOnce(&mut Tensor) -> Result<()>,
) -> Result<()> {
    if how.set_tp_attributes {
        weight.set_tp_attributes(TpAttributes {
            is_parallel: true,
            partition_dim: how.partition_dim,
            stride: how.stride,
        })?;
    }
    let tensor = weight.tensor_mut();
    match tracker {
        Some(t) => t.fork(MODEL_PARALLEL_RNG, || init(tensor)),
        None => init(tensor),
    }
}

/// An initialiser drawing `N(0, std²)` from the current generator of the tensor's device
/// (Megatron's `init_method_normal`). The tensor must be `f32`.
pub fn init_normal(std: f32) -> impl FnOnce(&mut Tensor) -> Result<()> {
    move |t: &mut Tensor| with_current_generator(t.device(), |g| g.fill_normal_tensor(t, 0.0, std))?
}
