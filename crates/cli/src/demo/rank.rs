//! One rank's training loop: its groups, its seeds, FSDP over the data-parallel group,
//! checkpoint frames around every block, the step.
//!
//! Rank `r` of `tp·dp` thread ranks is tensor-parallel rank `r % tp` of data-parallel
//! rank `r / tp`. Every rank makes every TP group (consecutive ranks) and every DP group
//! (ranks `t, t+tp, ...`) as subgroups of the world group, in the same order, and keeps
//! the two it belongs to, each wrapped in a [`CountingGroup`].

use std::sync::Arc;
use std::time::{Duration, Instant};

use tessera_checkpoint::{Checkpoint, Frame, MemoryMeter, Mode};
use tessera_collectives::{ProcessGroup, ReduceOp};
use tessera_core::{Error, Result, Tensor};
use tessera_fsdp::{CountingGroup, Fsdp, FullParam, MemoryStats, Wire};
use tessera_rng::RngTracker;
use tessera_rng::tp::{
    EXPERT_PARALLEL_RNG, MODEL_PARALLEL_RNG, ParallelSeeds, model_parallel_manual_seed,
};

use super::block::{BlockCall, BlockWeights, RankCtx};
use super::config::{DemoConfig, format_name, new_sites, newest_amaxes, update_delayed};
use super::model::{self, LayerWeights};
use super::ops;
use super::record::{BlockBytes, MaskRecord, Traffic, TrafficKey};
use crate::args::{DemoFault, DemoFormat};

/// What a rank reports after each step: its part of its batch's loss numerator.
#[derive(Debug, Clone, Copy)]
pub(crate) struct StepEvent {
    pub(crate) step: usize,
    pub(crate) dp: usize,
    pub(crate) tp: usize,
    /// `Σ 0.5·(y - target)²` over this rank's tokens.
    pub(crate) loss_sum: f64,
}

/// What a rank did, for the report.
#[derive(Debug)]
pub(crate) struct RankOutput {
    pub(crate) tp_rank: usize,
    pub(crate) dp_rank: usize,
    /// The seed of this rank's model-parallel stream.
    pub(crate) mp_seed: u64,
    pub(crate) traffic: Traffic,
    pub(crate) masks: Vec<MaskRecord>,
    /// Per block: what a frame keeps with and without checkpointing.
    pub(crate) bytes: Vec<BlockBytes>,
    /// The most saved-activation bytes held at once (the checkpoint frames' meter).
    pub(crate) peak_saved: usize,
    /// Frames whose forward was recomputed.
    pub(crate) recomputes: usize,
    /// FSDP's parameter memory at the end.
    pub(crate) fsdp: MemoryStats,
    /// How FSDP gathers the parameters, e.g. `weights mxfp8, LayerNorm f32`.
    pub(crate) fsdp_wire: String,
    /// Time in the training loop.
    pub(crate) elapsed: Duration,
}

/// The counted TP, DP and world groups of a rank.
struct Groups {
    tp: Arc<CountingGroup>,
    dp: Arc<CountingGroup>,
    world: Arc<CountingGroup>,
}

fn make_groups(world: Arc<dyn ProcessGroup>, tp: usize, dp: usize) -> Result<Groups> {
    let mut tp_group = None;
    for d in 0..dp {
        let ranks: Vec<usize> = (d * tp..(d + 1) * tp).collect();
        if let Some(g) = world.new_subgroup(&ranks)? {
            tp_group = Some(g);
        }
    }
    let mut dp_group = None;
    for t in 0..tp {
        let ranks: Vec<usize> = (0..dp).map(|d| d * tp + t).collect();
        if let Some(g) = world.new_subgroup(&ranks)? {
            dp_group = Some(g);
        }
    }
    match (tp_group, dp_group) {
        (Some(t), Some(d)) => Ok(Groups {
            tp: Arc::new(CountingGroup::new(t)),
            dp: Arc::new(CountingGroup::new(d)),
            world: Arc::new(CountingGroup::new(world)),
        }),
        _ => Err(Error::state(
            "tessera demo",
            "this rank is in no tensor-parallel or no data-parallel group",
        )),
    }
}

/// The RNG tracker of tensor-parallel rank `tp_rank` (Megatron's seeds; the current
/// generator of this thread seeded with the shared data-parallel seed).
fn seed_rng(cfg: &DemoConfig, tp_rank: usize) -> Result<RngTracker> {
    let mut tracker = RngTracker::new(cfg.device);
    let seeds = model_parallel_manual_seed(&mut tracker, cfg.seed, tp_rank as u64, 0)?;
    if cfg.fault == Some(DemoFault::MpMask) && tp_rank + 1 == cfg.tp {
        tracker.reset();
        tracker.add(MODEL_PARALLEL_RNG, seeds.model_parallel.wrapping_add(7919))?;
        tracker.add(EXPERT_PARALLEL_RNG, seeds.expert_parallel)?;
    }
    Ok(tracker)
}

/// The seeds the reference must reproduce for tensor-parallel rank `t`.
pub(crate) fn reference_tracker(cfg: &DemoConfig, t: usize) -> Result<RngTracker> {
    let seeds = ParallelSeeds::megatron(cfg.seed, t as u64, 0)?;
    let mut tracker = RngTracker::new(cfg.device);
    tracker.add(MODEL_PARALLEL_RNG, seeds.model_parallel)?;
    tracker.add(EXPERT_PARALLEL_RNG, seeds.expert_parallel)?;
    Ok(tracker)
}

/// Runs `f`, adding what `group` moved meanwhile to `traffic`.
fn counted<R>(
    traffic: &mut Traffic,
    group: &CountingGroup,
    key: TrafficKey,
    f32_bytes: impl FnOnce(&R) -> u64,
    f: impl FnOnce() -> Result<R>,
) -> Result<R> {
    let before = group.counts();
    let r = f()?;
    traffic.add(key, group.counts().since(&before), f32_bytes(&r));
    Ok(r)
}

fn key(order: u8, group: &'static str, what: &str, format: &str) -> TrafficKey {
    TrafficKey {
        order,
        group,
        what: what.into(),
        format: format.into(),
    }
}

/// How an FSDP engine gathers unit 0's parameters, e.g. `mxfp8` or `f32, quantized
/// after the gather`.
fn fsdp_wire(fsdp: &Fsdp, cfg: &DemoConfig) -> Result<String> {
    let hp = if cfg.format == DemoFormat::Bf16 {
        "bf16"
    } else {
        "f32"
    };
    let name = |w: Wire| match w {
        Wire::Quantized => format_name(cfg.format).to_string(),
        Wire::QuantizeAfter => format!("{hp}, then {}", format_name(cfg.format)),
        Wire::HighPrecision => hp.to_string(),
    };
    let p = fsdp.params(0)?;
    let wires: Vec<String> = p.iter().map(|p| name(p.wire())).collect();
    if wires.windows(2).all(|w| w[0] == w[1]) {
        return Ok(wires.first().cloned().unwrap_or_default());
    }
    // `block0.fc1.weight` → `fc1`.
    Ok(p.iter()
        .zip(&wires)
        .map(|(p, w)| {
            let short = p.name().split('.').nth(1).unwrap_or(p.name());
            format!("{short}: {w}")
        })
        .collect::<Vec<_>>()
        .join("; "))
}

/// A block's parameters under FSDP: GEMM weights in one engine (gathered in the format)
/// and LayerNorm's `γ`, `β` in another (always high precision), both sharded over the
/// data-parallel group, with what their collectives moved.
struct Sharded {
    weights: Fsdp,
    norms: Fsdp,
    group: Arc<CountingGroup>,
    keys: [TrafficKey; 4],
    unit_f32: [u64; 2],
}

impl Sharded {
    fn new(
        cfg: &DemoConfig,
        init: &[LayerWeights],
        group: Arc<CountingGroup>,
        tp_rank: usize,
    ) -> Result<Sharded> {
        let mut weights = Fsdp::new(group.clone(), cfg.fsdp_weights_config())?;
        let mut norms = Fsdp::new(group.clone(), cfg.fsdp_norms_config())?;
        for (l, w) in init.iter().enumerate() {
            let (g, b, w1, w2) = model::tp_shard(w, cfg, tp_rank)?;
            norms.add_unit(
                &format!("block{l}.ln"),
                vec![
                    (format!("block{l}.ln.gamma"), g),
                    (format!("block{l}.ln.beta"), b),
                ],
            )?;
            weights.add_unit(
                &format!("block{l}.mlp"),
                vec![
                    (format!("block{l}.fc1.weight"), w1),
                    (format!("block{l}.fc2.weight"), w2),
                ],
            )?;
        }
        let unit_f32 = |f: &Fsdp| -> Result<u64> {
            Ok(f.params(0)?
                .iter()
                .map(|p| p.shard().numel() as u64 * 4)
                .sum())
        };
        let keys = [
            key(
                20,
                "dp",
                "FSDP all-gather: FC1, FC2 weights",
                &fsdp_wire(&weights, cfg)?,
            ),
            key(
                21,
                "dp",
                "FSDP all-gather: LayerNorm γ, β",
                &fsdp_wire(&norms, cfg)?,
            ),
            key(22, "dp", "FSDP reduce-scatter: weight gradients", "f32"),
            key(23, "dp", "FSDP reduce-scatter: LayerNorm gradients", "f32"),
        ];
        Ok(Sharded {
            unit_f32: [unit_f32(&weights)?, unit_f32(&norms)?],
            weights,
            norms,
            group,
            keys,
        })
    }

    /// Unit `u`'s `(norms, weights)`, gathered for its forward (`backward` false) or its
    /// backward, with the next unit's gather issued ahead.
    fn gather(
        &mut self,
        traffic: &mut Traffic,
        u: usize,
        backward: bool,
    ) -> Result<(Vec<FullParam>, Vec<FullParam>)> {
        let mut out = Vec::with_capacity(2);
        for (i, f) in [&mut self.weights, &mut self.norms].into_iter().enumerate() {
            let unshards = f.stats().unshards;
            let before = self.group.counts();
            let params = if backward {
                f.backward_pre(u)?
            } else {
                f.forward_pre(u)?
            };
            let issued = f.stats().unshards - unshards;
            let f32_bytes = if self.group.size() > 1 {
                issued * self.unit_f32[i]
            } else {
                0
            };
            traffic.add(
                self.keys[i].clone(),
                self.group.counts().since(&before),
                f32_bytes,
            );
            out.push(params);
        }
        let norms = out.pop().unwrap_or_default();
        let weights = out.pop().unwrap_or_default();
        Ok((norms, weights))
    }

    fn forward_post(&mut self, u: usize) -> Result<()> {
        self.weights.forward_post(u)?;
        self.norms.forward_post(u)
    }

    /// Reduce-scatters unit `u`'s gradients `[dγ, dβ, dW1, dW2]`.
    fn reduce(&mut self, traffic: &mut Traffic, u: usize, grads: [Tensor; 4]) -> Result<()> {
        let [dg, db, dw1, dw2] = grads;
        for (i, (f, g)) in [
            (&mut self.weights, vec![dw1, dw2]),
            (&mut self.norms, vec![dg, db]),
        ]
        .into_iter()
        .enumerate()
        {
            let f32_bytes: u64 = g.iter().map(|t| t.numel() as u64 * 4).sum();
            let before = self.group.counts();
            f.backward_post(u, g)?;
            traffic.add(
                self.keys[2 + i].clone(),
                self.group.counts().since(&before),
                if self.group.size() > 1 { f32_bytes } else { 0 },
            );
        }
        Ok(())
    }

    fn sgd_step(&mut self, lr: f32) -> Result<()> {
        self.weights.sgd_step(lr)?;
        self.norms.sgd_step(lr)
    }

    fn memory(&self) -> MemoryStats {
        let (a, b) = (self.weights.memory(), self.norms.memory());
        MemoryStats {
            shard_bytes: a.shard_bytes + b.shard_bytes,
            grad_bytes: a.grad_bytes + b.grad_bytes,
            full_bytes: a.full_bytes + b.full_bytes,
            peak_full_bytes: a.peak_full_bytes + b.peak_full_bytes,
        }
    }

    fn wire(&self) -> String {
        format!(
            "weights {}, LayerNorm {}",
            self.keys[0].format, self.keys[1].format
        )
    }
}

/// Trains on one rank of `world` from the initial weights `init`: `cfg.steps` steps on
/// `cfg.device`, handing each step's loss part to `report` (an error from it ends the
/// run).
pub(crate) fn run_rank(
    world: Arc<dyn ProcessGroup>,
    cfg: &DemoConfig,
    init: &[LayerWeights],
    report: &mut dyn FnMut(StepEvent) -> Result<()>,
) -> Result<RankOutput> {
    let rank = world.rank();
    let (tp_rank, dp_rank) = (rank % cfg.tp, rank / cfg.tp);
    let groups = make_groups(world, cfg.tp, cfg.dp)?;
    let tracker = seed_rng(cfg, tp_rank)?;
    let mp_seed = tracker.state(MODEL_PARALLEL_RNG)?.seed;

    let mut fsdp = Sharded::new(cfg, init, groups.dp.clone(), tp_rank)?;

    let meter = MemoryMeter::new();
    let ckpt = Checkpoint::new(cfg.checkpoint)
        .meter(meter.clone())
        .determinism_check(cfg.checkpoint != Mode::Off);
    let mut ctx = RankCtx {
        cfg: cfg.clone(),
        tp_rank,
        dp_rank,
        tp: groups.tp.clone(),
        tracker,
        sites: new_sites(cfg)?,
        traffic: Traffic::default(),
        masks: Vec::new(),
        layouts: vec![None; cfg.layers],
        bytes: vec![BlockBytes::default(); cfg.layers],
        step: 0,
    };
    let n = cfg.local_tokens();
    let inv = model::loss_scale(cfg);
    let mut recomputes = 0;
    let start = Instant::now();
    for step in 0..cfg.steps {
        ctx.step = step;
        let (x_full, t_full) = model::batch(cfg, step, dp_rank)?;
        let mine = tp_rank * n..(tp_rank + 1) * n;
        let (x, target) = (ops::rows(&x_full, mine.clone())?, ops::rows(&t_full, mine)?);

        let mut frames: Vec<Frame> = Vec::with_capacity(cfg.layers);
        let mut h = x;
        for u in 0..cfg.layers {
            let (norms, weights) = fsdp.gather(&mut ctx.traffic, u, false)?;
            let w = BlockWeights::from_fsdp(norms, weights, cfg.format, &mut ctx.sites[u], true)?;
            let mut call = BlockCall {
                layer: u,
                w: &w,
                ctx: &mut ctx,
                grads: None,
            };
            let (mut out, frame) = ckpt.forward(&mut call, &[h])?;
            h = out
                .pop()
                .ok_or_else(|| Error::state("tessera demo", "a block returned no output"))?;
            frames.push(frame);
            fsdp.forward_post(u)?;
        }
        let (loss_sum, mut dy) = model::loss_part(&h, &target, inv)?;
        for u in (0..cfg.layers).rev() {
            let (norms, weights) = fsdp.gather(&mut ctx.traffic, u, true)?;
            let w = BlockWeights::from_fsdp(norms, weights, cfg.format, &mut ctx.sites[u], false)?;
            let mut frame = frames
                .pop()
                .ok_or_else(|| Error::state("tessera demo", "a block left no frame"))?;
            let mut call = BlockCall {
                layer: u,
                w: &w,
                ctx: &mut ctx,
                grads: None,
            };
            let mut dx = frame.backward(&mut call, &[dy])?;
            let grads = call.grads.take().ok_or_else(|| {
                Error::state("tessera demo", "a block's backward left no gradients")
            })?;
            recomputes += usize::from(frame.is_recomputed());
            drop(frame);
            dy = dx
                .pop()
                .ok_or_else(|| Error::state("tessera demo", "a block returned no gradient"))?;
            fsdp.reduce(&mut ctx.traffic, u, grads)?;
        }
        fsdp.sgd_step(cfg.lr)?;
        if cfg.format == DemoFormat::Fp8Delayed {
            let newest = newest_amaxes(&ctx.sites);
            let reduced = if cfg.world() > 1 {
                let t = Tensor::from_slice(&newest, [newest.len()], cfg.device)?;
                counted(
                    &mut ctx.traffic,
                    &groups.world,
                    key(
                        30,
                        "world",
                        "all-reduce (max): delayed-scaling amaxes",
                        "f32",
                    ),
                    |_| newest.len() as u64 * 4,
                    || groups.world.all_reduce(t, ReduceOp::Max)?.into_result(),
                )?
                .to_vec::<f32>()?
            } else {
                newest
            };
            update_delayed(&mut ctx.sites, &reduced);
        }
        report(StepEvent {
            step,
            dp: dp_rank,
            tp: tp_rank,
            loss_sum,
        })?;
    }
    Ok(RankOutput {
        tp_rank,
        dp_rank,
        mp_seed,
        traffic: ctx.traffic,
        masks: ctx.masks,
        bytes: ctx.bytes,
        peak_saved: meter.peak(),
        recomputes,
        fsdp: fsdp.memory(),
        fsdp_wire: fsdp.wire(),
        elapsed: start.elapsed(),
    })
}
