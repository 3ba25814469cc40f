//! One transformer MLP block on one rank, with tensor and sequence parallelism, as a
//! [`Recompute`] unit that checkpoint frames can wrap.
//!
//! Tensor-parallel rank `t` of `tp` holds `n = seq/tp` tokens of the residual stream and
//! the `fl = ffn/tp` columns `t·fl..` of the hidden layer:
//!
//! | step | shape on this rank | communication (TP group) |
//! |---|---|---|
//! | LayerNorm `z = LN(x)` | `[n, h]` | |
//! | FC1 input, quantized with the amax all-reduced, gathered | `[seq, h]` | all-gather in the format |
//! | FC1 `a = z·W1ᵀ` (column-parallel) | `[seq, fl]` | |
//! | GeLU, dropout from the model-parallel stream | `[seq, fl]` | |
//! | FC2 `o = d·W2ᵀ` (row-parallel, a partial sum) | `[seq, h]` | |
//! | reduce-scatter along the sequence | `[n, h]` | reduce-scatter (f32) |
//! | dropout from the shared stream, residual | `[n, h]` | |
//!
//! The backward mirrors it: the FC2 output gradient is all-gathered, FC1's input is
//! gathered again from its saved quantized shard for the weight gradient (as TE does, so
//! only the shard is kept), FC1's input gradient is reduce-scattered, and LayerNorm's
//! `γ`/`β` gradients — partial sums over this rank's tokens — are all-reduced over the
//! TP group (sequence-parallel parameters). Activations and gradients stay f32; only
//! GEMM inputs take the format, and the backward GEMMs multiply the saved quantized
//! values (gradients pass straight through the quantizers).

use std::sync::Arc;

use tessera_checkpoint::{Phase, Recompute, Saved, Saver, exactly, tensor_checksum};
use tessera_collectives::{
    GroupAmaxReduction, MaybeQuantized, ProcessGroup, ReduceOp, gather_along_first_dim,
    reduce_scatter_along_first_dim,
};
use tessera_core::{DType, Error, Replay, Result, Shape, Tensor};
use tessera_fsdp::{CountingGroup, FullParam};
use tessera_quant::{AmaxReduction, BufferName, Kind, QuantizedTensor};
use tessera_rng::tp::MODEL_PARALLEL_RNG;
use tessera_rng::{RngTracker, with_current_generator};

use super::config::{DemoConfig, LayerSites, Site, Wire, format_name, idx};
use super::ops::{self, LnStats, dims2};
use super::record::{BlockBytes, MaskRecord, Region, Traffic, TrafficKey};
use crate::args::{DemoFault, DemoFormat};

/// What one rank's blocks share: its groups, RNG tracker, quantizers and records.
pub(crate) struct RankCtx {
    pub(crate) cfg: DemoConfig,
    pub(crate) tp_rank: usize,
    pub(crate) dp_rank: usize,
    /// The tensor-parallel group, counted.
    pub(crate) tp: Arc<CountingGroup>,
    /// The model-parallel stream (and the expert-parallel one, unused).
    pub(crate) tracker: RngTracker,
    /// Every block's quantizers.
    pub(crate) sites: Vec<LayerSites>,
    pub(crate) traffic: Traffic,
    pub(crate) masks: Vec<MaskRecord>,
    /// How each block saved its quantized operands (set by its forward).
    pub(crate) layouts: Vec<Option<BlockLayout>>,
    /// What each block kept at its last first forward.
    pub(crate) bytes: Vec<BlockBytes>,
    /// The step being run.
    pub(crate) step: usize,
}

impl RankCtx {
    fn group(&self) -> Arc<dyn ProcessGroup> {
        self.tp.clone()
    }

    /// Runs `f`, adding what the TP group moved meanwhile to the traffic under `what`.
    fn counted<R>(
        &mut self,
        what: String,
        format: String,
        f32_bytes: usize,
        f: impl FnOnce(&mut Self) -> Result<R>,
    ) -> Result<R> {
        let before = self.tp.counts();
        let r = f(self)?;
        let delta = self.tp.counts().since(&before);
        self.traffic.add(
            TrafficKey {
                order: order_of(&what),
                group: "tp",
                what,
                format,
            },
            delta,
            f32_bytes as u64,
        );
        Ok(r)
    }
}

/// Report order of the TP collectives.
fn order_of(what: &str) -> u8 {
    const ORDER: [&str; 6] = [
        "SP all-gather: FC1 input",
        "SP reduce-scatter: FC2 output",
        "SP all-gather: FC2 output grad",
        "SP all-gather: FC1 input again (wgrad)",
        "SP reduce-scatter: FC1 input grad",
        "all-reduce: LayerNorm grads (SP)",
    ];
    let (name, recompute) = match what.strip_suffix(" (recompute)") {
        Some(n) => (n, true),
        None => (what, false),
    };
    let base = ORDER.iter().position(|o| name == *o).unwrap_or(ORDER.len()) as u8;
    base + if recompute { 10 } else { 0 }
}

/// A block's parameters as its GEMMs use them: `γ`, `β` (f32; bf16 values for bf16) and
/// the weight shards' quantized values.
#[derive(Debug, Clone)]
pub(crate) struct BlockWeights {
    pub(crate) gamma: Tensor,
    pub(crate) beta: Tensor,
    pub(crate) w1: Tensor,
    pub(crate) w2: Tensor,
}

impl BlockWeights {
    /// From the parameters FSDP gathered: `[γ, β]` and `[W1 shard, W2 shard]`. A weight
    /// FSDP already quantized (or gathered in bf16) is used as it came; otherwise
    /// (fp8-delayed, whose scale lives in `sites`) it is quantized here, recording its
    /// amax when `record` is set (at the forward, not again for the backward).
    pub(crate) fn from_fsdp(
        norms: Vec<FullParam>,
        weights: Vec<FullParam>,
        format: DemoFormat,
        sites: &mut LayerSites,
        record: bool,
    ) -> Result<BlockWeights> {
        let count = |what: &str, n: usize| {
            Error::invalid(
                "BlockWeights",
                format!("a block has 2 {what} parameters, FSDP returned {n}"),
            )
        };
        let [g, b]: [FullParam; 2] = norms
            .try_into()
            .map_err(|p: Vec<_>| count("LayerNorm", p.len()))?;
        let [w1, w2]: [FullParam; 2] = weights
            .try_into()
            .map_err(|p: Vec<_>| count("GEMM", p.len()))?;
        let mut weight = |p: FullParam, site: Site| -> Result<Tensor> {
            if p.quantized.is_some() || format == DemoFormat::Bf16 {
                Ok(p.tensor)
            } else {
                Ok(sites[idx(site)].quantize(&p.tensor, record)?.values)
            }
        };
        Ok(BlockWeights {
            w1: weight(w1, Site::Fc1Weight)?,
            w2: weight(w2, Site::Fc2Weight)?,
            gamma: g.tensor,
            beta: b.tensor,
        })
    }
}

/// How a saved operand was stored: its buffers' order and what rebuilds it.
#[derive(Debug, Clone)]
pub(crate) enum SavedForm {
    /// One bf16 tensor.
    Bf16,
    /// One f32 tensor (a shard that cannot travel quantized; quantized after gathering).
    Plain,
    /// The buffers of a quantized tensor, in this order.
    Quantized {
        kind: Kind,
        shape: Shape,
        names: Vec<BufferName>,
    },
}

impl SavedForm {
    fn len(&self) -> usize {
        match self {
            SavedForm::Bf16 | SavedForm::Plain => 1,
            SavedForm::Quantized { names, .. } => names.len(),
        }
    }
}

/// The operands a block saved, and where their buffers sit among its saved tensors.
#[derive(Debug, Clone)]
pub(crate) struct BlockLayout {
    z: SavedForm,
    d: SavedForm,
}

// Saved tensor indices: the block input, LayerNorm's statistics, FC1's input shard
// (1..n buffers), FC1's output, the model-parallel mask, FC2's input (1..n buffers) and
// the data-parallel mask.
const X: usize = 0;
const MEAN: usize = 1;
const RSTD: usize = 2;
const Z0: usize = 3;

impl BlockLayout {
    fn a(&self) -> usize {
        Z0 + self.z.len()
    }
    fn mask_mp(&self) -> usize {
        self.a() + 1
    }
    fn d0(&self) -> usize {
        self.a() + 2
    }
    fn mask_dp(&self) -> usize {
        self.d0() + self.d.len()
    }
}

/// An operand as kept for the backward.
#[derive(Debug, Clone)]
enum Kept {
    Bf16(Tensor),
    Plain(Tensor),
    Quantized(QuantizedTensor),
}

impl Kept {
    fn from_wire(w: Wire) -> Kept {
        match w {
            Wire::Bf16(t) => Kept::Bf16(t),
            Wire::Quantized(q) => Kept::Quantized(q),
        }
    }

    fn form(&self) -> SavedForm {
        match self {
            Kept::Bf16(_) => SavedForm::Bf16,
            Kept::Plain(_) => SavedForm::Plain,
            Kept::Quantized(q) => SavedForm::Quantized {
                kind: q.kind(),
                shape: q.shape().clone(),
                names: q.data_tensors().into_iter().map(|(n, _)| n).collect(),
            },
        }
    }

    fn save(&self, saver: &mut Saver, label: &'static str) -> usize {
        match self {
            Kept::Bf16(t) | Kept::Plain(t) => {
                saver.save_named(label, t);
                t.size_in_bytes()
            }
            Kept::Quantized(q) => q
                .data_tensors()
                .into_iter()
                .map(|(_, t)| {
                    saver.save_named(label, t);
                    t.size_in_bytes()
                })
                .sum(),
        }
    }

    fn take(saved: &mut Saved<'_, BlockCall<'_>>, form: &SavedForm, at: usize) -> Result<Kept> {
        Ok(match form {
            SavedForm::Bf16 => Kept::Bf16(saved.take(at)?),
            SavedForm::Plain => Kept::Plain(saved.take(at)?),
            SavedForm::Quantized { kind, shape, names } => {
                let mut buffers = std::collections::BTreeMap::new();
                for (i, n) in names.iter().enumerate() {
                    buffers.insert(*n, saved.take(at + i)?);
                }
                Kept::Quantized(QuantizedTensor::from_buffers(
                    *kind,
                    shape.clone(),
                    DType::F32,
                    buffers,
                )?)
            }
        })
    }

    /// The operand's values (a plain shard is quantized by the caller instead).
    fn values(&self) -> Result<Tensor> {
        match self {
            Kept::Bf16(t) => ops::to_f32(t),
            Kept::Plain(t) => Ok(t.clone()),
            Kept::Quantized(q) => q.dequantize(DType::F32),
        }
    }
}

/// The gradients of a block's parameters: `γ`, `β` (summed over the whole sequence), and
/// this rank's `W1` and `W2` shards.
pub(crate) type BlockGrads = [Tensor; 4];

/// One block on one rank: its weights and the rank's shared state, for one forward or
/// one backward.
pub(crate) struct BlockCall<'a> {
    pub(crate) layer: usize,
    pub(crate) w: &'a BlockWeights,
    pub(crate) ctx: &'a mut RankCtx,
    pub(crate) grads: Option<BlockGrads>,
}

fn suffix(phase: Phase) -> &'static str {
    if phase.is_recompute() {
        " (recompute)"
    } else {
        ""
    }
}

/// The FC1 input: quantize this rank's shard (the amax all-reduced over the TP group for
/// per-tensor formats), all-gather the quantized bytes, return the whole sequence's
/// values and the shard to keep. A shard the format cannot gather travels in f32 and the
/// whole sequence is quantized after.
fn gather_fc1_input(
    ctx: &mut RankCtx,
    layer: usize,
    z: &Tensor,
    phase: Phase,
) -> Result<(Tensor, Kept)> {
    let record = phase.is_forward();
    let format = ctx.cfg.format;
    if ctx.cfg.tp == 1 {
        let op = ctx.sites[layer][idx(Site::Fc1Input)].quantize(z, record)?;
        return Ok((op.values, Kept::from_wire(op.wire)));
    }
    let group = ctx.group();
    let gatherable = ctx.sites[layer][idx(Site::Fc1Input)].is_gatherable(z.shape());
    let what = format!("SP all-gather: FC1 input{}", suffix(phase));
    if gatherable {
        ctx.counted(what, format_name(format).into(), z.size_in_bytes(), |ctx| {
            let reduction: Arc<dyn AmaxReduction> =
                Arc::new(GroupAmaxReduction::new(group.clone()));
            let local = ctx.sites[layer][idx(Site::Fc1Input)].quantize_reduced(
                z,
                Some(reduction),
                record,
            )?;
            let full = match &local.wire {
                Wire::Bf16(t) => ops::to_f32(&group.all_gather(t)?.into_result()?)?,
                Wire::Quantized(q) => {
                    gather_along_first_dim(&MaybeQuantized::Quantized(q.clone()), &group, None)?
                        .into_result()?
                        .to_plain()?
                }
            };
            Ok((full, Kept::from_wire(local.wire)))
        })
    } else {
        ctx.counted(
            what,
            format!("f32, then {}", format_name(format)),
            z.size_in_bytes(),
            |ctx| {
                let full = group.all_gather(z)?.into_result()?;
                let op = ctx.sites[layer][idx(Site::Fc1Input)].quantize(&full, record)?;
                Ok((op.values, Kept::Plain(z.clone())))
            },
        )
    }
}

/// The FC1 input's values again in the backward, gathered from the kept shard.
fn regather_fc1_input(ctx: &mut RankCtx, layer: usize, kept: Kept) -> Result<Tensor> {
    let plain = matches!(kept, Kept::Plain(_));
    if ctx.cfg.tp == 1 {
        return if plain {
            Ok(ctx.sites[layer][idx(Site::Fc1Input)]
                .quantize(&kept.values()?, false)?
                .values)
        } else {
            kept.values()
        };
    }
    let group = ctx.group();
    let format = match &kept {
        Kept::Plain(_) => format!("f32, then {}", format_name(ctx.cfg.format)),
        _ => format_name(ctx.cfg.format).into(),
    };
    let f32_bytes = match &kept {
        Kept::Bf16(t) | Kept::Plain(t) => t.numel() * 4,
        Kept::Quantized(q) => q.shape().numel() * 4,
    };
    ctx.counted(
        "SP all-gather: FC1 input again (wgrad)".into(),
        format,
        f32_bytes,
        |ctx| match kept {
            Kept::Bf16(t) => ops::to_f32(&group.all_gather(&t)?.into_result()?),
            Kept::Quantized(q) => {
                gather_along_first_dim(&MaybeQuantized::Quantized(q), &group, None)?
                    .into_result()?
                    .to_plain()
            }
            Kept::Plain(t) => {
                let full = group.all_gather(&t)?.into_result()?;
                Ok(ctx.sites[layer][idx(Site::Fc1Input)]
                    .quantize(&full, false)?
                    .values)
            }
        },
    )
}

/// The sum over the TP group of `t` (`[seq, h]` on every rank), this rank's rows.
fn reduce_scatter(ctx: &mut RankCtx, what: String, t: &Tensor) -> Result<Tensor> {
    if ctx.cfg.tp == 1 {
        return Ok(t.clone());
    }
    let group = ctx.group();
    ctx.counted(what, "f32".into(), t.size_in_bytes(), |_| {
        reduce_scatter_along_first_dim(t, &*group)?.into_result()
    })
}

/// Every rank's rows of `t`, in rank order.
fn all_gather(ctx: &mut RankCtx, what: String, t: &Tensor) -> Result<Tensor> {
    if ctx.cfg.tp == 1 {
        return Ok(t.clone());
    }
    let group = ctx.group();
    ctx.counted(what, "f32".into(), t.size_in_bytes(), |_| {
        group.all_gather(t)?.into_result()
    })
}

impl Recompute for BlockCall<'_> {
    fn forward(&mut self, inputs: &[Tensor], saver: &mut Saver) -> Result<Vec<Tensor>> {
        let [x] = exactly("block forward", inputs)?;
        let phase = saver.phase();
        let (l, w) = (self.layer, self.w);
        let ctx = &mut *self.ctx;
        let cfg = ctx.cfg.clone();
        let (n, h) = dims2("block forward", x)?;
        let (s, p) = (cfg.seq, cfg.dropout);

        let (z, stats) = ops::layernorm(x, &w.gamma, &w.beta)?;
        let (z_full, z_kept) = gather_fc1_input(ctx, l, &z, phase)?;
        let a = ops::matmul(&z_full, false, &w.w1, true)?;
        let g = ops::gelu(&a)?;
        let (d, mask_mp) = ctx.tracker.fork(MODEL_PARALLEL_RNG, || -> Result<_> {
            with_current_generator(cfg.device, |rng| rng.dropout_tensor(&g, p))?
        })?;
        let dq = ctx.sites[l][idx(Site::Fc2Input)].quantize(&d, phase.is_forward())?;
        let o_partial = ops::matmul(&dq.values, false, &w.w2, true)?;
        let o = reduce_scatter(
            ctx,
            format!("SP reduce-scatter: FC2 output{}", suffix(phase)),
            &o_partial,
        )?;
        // The shared stream draws the whole sequence's mask on every TP rank (so they
        // agree by construction); each keeps its rows.
        let last_tp = ctx.tp_rank + 1 == cfg.tp;
        if cfg.fault == Some(DemoFault::DpMask) && last_tp && ctx.step == 0 && l == 0 {
            with_current_generator(cfg.device, |rng| rng.advance(4))?;
        }
        let full_mask = ops::draw_mask([s, h], p, cfg.device)?;
        let mask_dp = ops::rows(&full_mask, ctx.tp_rank * n..(ctx.tp_rank + 1) * n)?;
        let y = ops::add(x, &ops::apply_mask(&o, &mask_dp, p)?)?;

        let d_kept = Kept::from_wire(dq.wire);
        let layout = BlockLayout {
            z: z_kept.form(),
            d: d_kept.form(),
        };
        let mut bytes = 0;
        for t in [x, &stats.mean, &stats.rstd] {
            saver.save_named("block input / LayerNorm statistics", t);
            bytes += t.size_in_bytes();
        }
        bytes += z_kept.save(saver, "FC1 input shard");
        saver.save_named("FC1 output", &a);
        saver.save_named("model-parallel dropout mask", &mask_mp);
        bytes += a.size_in_bytes() + mask_mp.size_in_bytes();
        bytes += d_kept.save(saver, "FC2 input");
        saver.save_named("data-parallel dropout mask", &mask_dp);
        bytes += mask_dp.size_in_bytes();

        if phase.is_forward() {
            let (step, dp, tp) = (ctx.step, ctx.dp_rank, ctx.tp_rank);
            for (region, m) in [
                (Region::ModelParallel, &mask_mp),
                (Region::DataParallel, &full_mask),
            ] {
                ctx.masks.push(MaskRecord {
                    step,
                    layer: l,
                    dp,
                    tp,
                    region,
                    checksum: tensor_checksum(m)?,
                });
            }
            ctx.bytes[l] = BlockBytes {
                input: x.size_in_bytes(),
                saved: bytes,
            };
        }
        ctx.layouts[l] = Some(layout);
        Ok(vec![y])
    }

    fn backward(saved: &mut Saved<'_, Self>, grads: &[Tensor]) -> Result<Vec<Tensor>> {
        let [dy] = exactly("block backward", grads)?;
        // Every forward (the first one and a recompute) records the layout of what it
        // saved; a non-reentrant frame recomputes at this first take.
        let x = saved.take(X)?;
        let layout = {
            let me = saved.layer();
            me.ctx.layouts[me.layer].clone().ok_or_else(|| {
                Error::state("block backward", "the block's forward left no layout")
            })?
        };
        let p = saved.layer().ctx.cfg.dropout;

        let mask_dp = saved.take(layout.mask_dp())?;
        let do_local = ops::apply_mask(dy, &mask_dp, p)?;
        drop(mask_dp);
        let do_full = {
            let me = saved.layer();
            all_gather(me.ctx, "SP all-gather: FC2 output grad".into(), &do_local)?
        };
        let dq = Kept::take(saved, &layout.d, layout.d0())?.values()?;
        let (w1, w2) = {
            let me = saved.layer();
            (me.w.w1.clone(), me.w.w2.clone())
        };
        let dw2 = ops::matmul(&do_full, true, &dq, false)?;
        drop(dq);
        let dd = ops::matmul(&do_full, false, &w2, false)?;
        let dg = ops::apply_mask(&dd, &saved.take(layout.mask_mp())?, p)?;
        let da = ops::gelu_backward(&saved.take(layout.a())?, &dg)?;
        let z_kept = Kept::take(saved, &layout.z, Z0)?;
        let stats = LnStats {
            mean: saved.take(MEAN)?,
            rstd: saved.take(RSTD)?,
        };
        let me = saved.layer();
        let z_full = regather_fc1_input(me.ctx, me.layer, z_kept)?;
        let dw1 = ops::matmul(&da, true, &z_full, false)?;
        let dz_partial = ops::matmul(&da, false, &w1, false)?;
        let dz = reduce_scatter(
            me.ctx,
            "SP reduce-scatter: FC1 input grad".into(),
            &dz_partial,
        )?;
        let (dx_ln, mut dgamma, mut dbeta) = ops::layernorm_backward(&dz, &x, &stats, &me.w.gamma)?;
        let h = dgamma.numel();
        if me.ctx.cfg.tp > 1 {
            // γ and β see every token, but this rank only its own: sum over the group.
            let group = me.ctx.group();
            let both = ops::concat_rows(&[dgamma.reshape([1, h])?, dbeta.reshape([1, h])?])?;
            let sum = me.ctx.counted(
                "all-reduce: LayerNorm grads (SP)".into(),
                "f32".into(),
                both.size_in_bytes(),
                |_| group.all_reduce(both, ReduceOp::Sum)?.into_result(),
            )?;
            dgamma = ops::rows(&sum, 0..1)?.reshape([h])?;
            dbeta = ops::rows(&sum, 1..2)?.reshape([h])?;
        }
        let dx = ops::add(dy, &dx_ln)?;
        me.grads = Some([dgamma, dbeta, dw1, dw2]);
        Ok(vec![dx])
    }

    fn replay_states(&mut self) -> Vec<&mut dyn Replay> {
        let ctx = &mut *self.ctx;
        let mut states: Vec<&mut dyn Replay> = vec![&mut ctx.tracker];
        let [fc1_in, _, fc2_in, _] = &mut ctx.sites[self.layer];
        states.extend(fc1_in.replay_state());
        states.extend(fc2_in.replay_state());
        states
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_indices_follow_the_save_order() {
        let q = SavedForm::Quantized {
            kind: Kind::Mxfp8 {
                format: tessera_quant::Fp8Format::E4M3,
                two_d: false,
                swizzled: false,
            },
            shape: Shape::new(vec![32, 32]),
            names: vec![BufferName::Data, BufferName::ScaleInv],
        };
        let l = BlockLayout { z: q.clone(), d: q };
        assert_eq!((l.a(), l.mask_mp(), l.d0(), l.mask_dp()), (5, 6, 7, 9));
        let b = BlockLayout {
            z: SavedForm::Bf16,
            d: SavedForm::Bf16,
        };
        assert_eq!((b.a(), b.mask_mp(), b.d0(), b.mask_dp()), (4, 5, 6, 7));
    }
}
