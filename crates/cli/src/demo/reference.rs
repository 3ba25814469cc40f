//! The reference: the same model on one unsharded rank, with the same recipe.
//!
//! It holds every block's whole weights and multiplies whole matrices: FC1 `[seq, h] ×
//! [h, ffn]`, FC2 `[seq, ffn] × [ffn, h]`, their backward products, LayerNorm's gradients
//! summed over the whole sequence. What it reproduces exactly, by construction:
//!
//! - quantization: FC1's input is quantized whole (what the sequence-parallel gather of
//!   shards quantized with the all-reduced amax equals); an operand a tensor-parallel
//!   rank quantizes on its own (its weight shards, FC2's input columns) is quantized per
//!   column block here, with the same quantizer — the recipe's unit of quantization is
//!   the rank's tensor, as in TE;
//! - dropout: one [`RngTracker`] per tensor-parallel rank, seeded as that rank seeds its
//!   own, draws the model-parallel mask of that rank's column block; the thread's current
//!   generator, seeded with the shared seed, draws the whole sequence's data-parallel
//!   mask. Data-parallel replicas share their seeds (Megatron's default), so each batch
//!   of a step starts from the step's starting RNG state;
//! - data parallelism: each batch's gradients, summed in batch order and multiplied by
//!   `1/dp` — the order of FSDP's reduce-scatter — and one SGD step on the f32 master
//!   weights; delayed scaling's newest amax is the maximum over every batch and block.
//!
//! The batches of a step are independent given the weights, so they run on threads.

use tessera_checkpoint::tensor_checksum;
use tessera_core::{Error, Result, Tensor};
use tessera_rng::tp::MODEL_PARALLEL_RNG;
use tessera_rng::{
    GeneratorState, RngTracker, get_rng_state, set_rng_state, with_current_generator,
};

use super::config::{
    DemoConfig, LayerSites, Site, SiteQuantizer, idx, new_sites, newest_amaxes, update_delayed,
};
use super::model::{self, LayerWeights};
use super::ops::{self, LnStats};
use super::rank::reference_tracker;
use super::record::{MaskRecord, Region};
use crate::args::{DemoFormat, ReferenceSums};

/// The unsharded model and its RNG and scaling state.
pub(crate) struct Reference {
    cfg: DemoConfig,
    layers: Vec<LayerWeights>,
    /// One per tensor-parallel rank.
    trackers: Vec<RngTracker>,
    /// The shared (data-parallel) stream.
    current: GeneratorState,
    sites: Vec<LayerSites>,
}

/// What one reference step did.
#[derive(Debug, Clone)]
pub(crate) struct RefStep {
    /// `mean_d(0.5 · mean((y - target)²))`.
    pub(crate) loss: f64,
    /// Every mask it drew.
    pub(crate) masks: Vec<MaskRecord>,
}

/// A block's weights as the GEMMs use them, whole and as the tensor-parallel blocks
/// (`W1`'s rows, `W2`'s columns).
struct View {
    gamma: Tensor,
    beta: Tensor,
    w1: Tensor,
    w2: Tensor,
    w1_blocks: Vec<Tensor>,
    w2_blocks: Vec<Tensor>,
}

/// What a block's forward keeps for its backward (per tensor-parallel column block
/// where the hidden layer is concerned).
struct Kept {
    x: Tensor,
    stats: LnStats,
    zq: Tensor,
    a: Vec<Tensor>,
    mask_mp: Vec<Tensor>,
    dq: Vec<Tensor>,
    mask_dp: Tensor,
}

/// One batch's results.
struct BatchOut {
    loss_sum: f64,
    grads: Vec<[Tensor; 4]>,
    masks: Vec<MaskRecord>,
    trackers: Vec<RngTracker>,
    current: GeneratorState,
    /// The batch's FC1-input and FC2-input quantizers (their newest amaxes).
    sites: Vec<[SiteQuantizer; 2]>,
}

impl Reference {
    /// The model at the initial weights `init`, seeded as the ranks seed themselves.
    pub(crate) fn new(cfg: &DemoConfig, init: &[LayerWeights]) -> Result<Reference> {
        Ok(Reference {
            cfg: cfg.clone(),
            layers: init.to_vec(),
            trackers: (0..cfg.tp)
                .map(|t| reference_tracker(cfg, t))
                .collect::<Result<_>>()?,
            current: GeneratorState::new(cfg.seed),
            sites: new_sites(cfg)?,
        })
    }

    /// The weights as this step's GEMMs use them: each tensor-parallel shard of a weight
    /// quantized on its own (FSDP's gathers quantize the rank's shard; per-tensor scales
    /// are per shard), `γ` and `β` in bf16 for the bf16 recipe.
    fn views(&mut self) -> Result<Vec<View>> {
        let (tp, fl) = (self.cfg.tp, self.cfg.local_ffn());
        let bf16 = self.cfg.format == DemoFormat::Bf16;
        let dev = self.cfg.device;
        let round = |t: &Tensor| -> Result<Tensor> {
            let t = t.to_device(dev)?;
            if bf16 {
                ops::to_f32(&ops::to_bf16(&t)?)
            } else {
                Ok(t)
            }
        };
        let mut out = Vec::with_capacity(self.layers.len());
        for (w, sites) in self.layers.iter().zip(&mut self.sites) {
            let mut w1 = Vec::with_capacity(tp);
            let mut w2 = Vec::with_capacity(tp);
            for t in 0..tp {
                let rows = ops::rows(&w.w1, t * fl..(t + 1) * fl)?.to_device(dev)?;
                w1.push(sites[idx(Site::Fc1Weight)].quantize(&rows, true)?.values);
                let cols = ops::col_block(&w.w2, t, fl)?.to_device(dev)?;
                w2.push(sites[idx(Site::Fc2Weight)].quantize(&cols, true)?.values);
            }
            out.push(View {
                gamma: round(&w.gamma)?,
                beta: round(&w.beta)?,
                w1: ops::concat_rows(&w1)?,
                w2: ops::concat_cols(&w2)?,
                w1_blocks: w1,
                w2_blocks: w2,
            });
        }
        Ok(out)
    }

    /// One training step over every data-parallel batch.
    pub(crate) fn step(&mut self, step: usize) -> Result<RefStep> {
        let views = self.views()?;
        let act_sites = self
            .sites
            .iter()
            .map(|s| {
                Ok([
                    s[idx(Site::Fc1Input)].duplicate()?,
                    s[idx(Site::Fc2Input)].duplicate()?,
                ])
            })
            .collect::<Result<Vec<_>>>()?;
        let (cfg, trackers, current) = (&self.cfg, &self.trackers, self.current);
        let outs: Vec<Result<BatchOut>> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..cfg.dp)
                .map(|d| {
                    let sites = act_sites
                        .iter()
                        .map(|[a, b]| Ok([a.duplicate()?, b.duplicate()?]))
                        .collect::<Result<Vec<_>>>();
                    let views = &views;
                    s.spawn(move || batch(cfg, step, d, views, trackers.clone(), current, sites?))
                })
                .collect();
            handles
                .into_iter()
                .enumerate()
                .map(|(d, h)| {
                    h.join().unwrap_or_else(|_| {
                        Err(Error::state(
                            "reference",
                            format!("the thread of batch {d} panicked"),
                        ))
                    })
                })
                .collect()
        });
        let outs = outs.into_iter().collect::<Result<Vec<_>>>()?;
        let first = outs
            .first()
            .ok_or_else(|| Error::state("reference", "no batches ran"))?;
        // Every batch started from the same state and drew the same amounts.
        self.trackers = first.trackers.clone();
        self.current = first.current;

        // FSDP's order: the sum over data-parallel ranks in rank order, times 1/dp.
        let inv = 1.0 / cfg.dp as f32;
        for (l, layer) in self.layers.iter_mut().enumerate() {
            let params = [
                &mut layer.gamma,
                &mut layer.beta,
                &mut layer.w1,
                &mut layer.w2,
            ];
            for (i, w) in params.into_iter().enumerate() {
                let mut g = outs[0].grads[l][i].to_vec::<f32>()?;
                for o in &outs[1..] {
                    for (a, b) in g.iter_mut().zip(o.grads[l][i].to_vec::<f32>()?) {
                        *a += b;
                    }
                }
                for (w, g) in w.as_mut_slice::<f32>()?.iter_mut().zip(&g) {
                    *w -= cfg.lr * (g * inv);
                }
            }
        }
        for o in &outs {
            for (sites, [fc1, fc2]) in self.sites.iter_mut().zip(&o.sites) {
                for (site, amax) in [
                    (Site::Fc1Input, fc1.newest_amax()),
                    (Site::Fc2Input, fc2.newest_amax()),
                ] {
                    if let Some(d) = sites[idx(site)].delayed_mut() {
                        d.state_mut().record_amax(amax);
                    }
                }
            }
        }
        let newest = newest_amaxes(&self.sites);
        update_delayed(&mut self.sites, &newest);

        let sums: Vec<f64> = outs.iter().map(|o| o.loss_sum).collect();
        Ok(RefStep {
            loss: model::step_loss(cfg, &sums),
            masks: outs.into_iter().flat_map(|o| o.masks).collect(),
        })
    }
}

/// `Σ_t parts[t]`, added in order (a ThreadGroup reduction's order).
fn fold(parts: Vec<Tensor>) -> Result<Tensor> {
    let mut it = parts.into_iter();
    let first = it
        .next()
        .ok_or_else(|| Error::invalid("reference", "nothing to sum"))?;
    it.try_fold(first, |acc, p| ops::add(&acc, &p))
}

/// Forward and backward of data-parallel batch `d`, from the step's RNG state.
///
/// With split sums every product has a rank's shape — FC1 and FC2 block by block along
/// the hidden layer, their partial products added in rank order — and LayerNorm's
/// gradients are summed per sequence shard, then over the shards in order: the same
/// float operations as the ranks'. With whole sums, whole matrices.
fn batch(
    cfg: &DemoConfig,
    step: usize,
    d: usize,
    views: &[View],
    mut trackers: Vec<RngTracker>,
    current: GeneratorState,
    mut sites: Vec<[SiteQuantizer; 2]>,
) -> Result<BatchOut> {
    let dev = cfg.device;
    set_rng_state(dev, current)?;
    let (s, h, fl, p, tp) = (cfg.seq, cfg.hidden, cfg.local_ffn(), cfg.dropout, cfg.tp);
    let split = cfg.reference_sums == ReferenceSums::Split;
    let (mut x, target) = model::batch(cfg, step, d)?;
    let mut masks = Vec::new();
    let mut kept = Vec::with_capacity(views.len());
    for (l, (w, [fc1_in, fc2_in])) in views.iter().zip(&mut sites).enumerate() {
        let (z, stats) = ops::layernorm(&x, &w.gamma, &w.beta)?;
        let zq = fc1_in.quantize(&z, true)?.values;
        let a: Vec<Tensor> = if split {
            w.w1_blocks
                .iter()
                .map(|w1| ops::matmul(&zq, false, w1, true))
                .collect::<Result<_>>()?
        } else {
            let a = ops::matmul(&zq, false, &w.w1, true)?;
            (0..tp)
                .map(|t| ops::col_block(&a, t, fl))
                .collect::<Result<_>>()?
        };
        let mut dq = Vec::with_capacity(tp);
        let mut mask_mp = Vec::with_capacity(tp);
        for (t, (tracker, a_t)) in trackers.iter_mut().zip(&a).enumerate() {
            let g_t = ops::gelu(a_t)?;
            let (d_t, m_t) = tracker.fork(MODEL_PARALLEL_RNG, || -> Result<_> {
                with_current_generator(dev, |rng| rng.dropout_tensor(&g_t, p))?
            })?;
            masks.push(MaskRecord {
                step,
                layer: l,
                dp: d,
                tp: t,
                region: Region::ModelParallel,
                checksum: tensor_checksum(&m_t)?,
            });
            dq.push(fc2_in.quantize(&d_t, true)?.values);
            mask_mp.push(m_t);
        }
        let o = if split {
            fold(
                dq.iter()
                    .zip(&w.w2_blocks)
                    .map(|(dq_t, w2)| ops::matmul(dq_t, false, w2, true))
                    .collect::<Result<_>>()?,
            )?
        } else {
            ops::matmul(&ops::concat_cols(&dq)?, false, &w.w2, true)?
        };
        let mask_dp = ops::draw_mask([s, h], p, dev)?;
        masks.push(MaskRecord {
            step,
            layer: l,
            dp: d,
            tp: 0,
            region: Region::DataParallel,
            checksum: tensor_checksum(&mask_dp)?,
        });
        let y = ops::add(&x, &ops::apply_mask(&o, &mask_dp, p)?)?;
        kept.push(Kept {
            x,
            stats,
            zq,
            a,
            mask_mp,
            dq,
            mask_dp,
        });
        x = y;
    }
    // The loss numerator per sequence shard, added in shard order, as the ranks' parts
    // are; the gradient is element-wise.
    let (_, mut dy) = model::loss_part(&x, &target, model::loss_scale(cfg))?;
    let n = cfg.local_tokens();
    let mut loss_sum = 0.0;
    for t in 0..tp {
        let r = t * n..(t + 1) * n;
        let (part, _) = model::loss_part(&ops::rows(&x, r.clone())?, &ops::rows(&target, r)?, 1.0)?;
        loss_sum += part;
    }
    let mut grads = Vec::with_capacity(views.len());
    for (w, k) in views.iter().zip(kept).rev() {
        let d_o = ops::apply_mask(&dy, &k.mask_dp, p)?;
        let (dw1, dw2, dz) = if split {
            let mut dw1 = Vec::with_capacity(tp);
            let mut dw2 = Vec::with_capacity(tp);
            let mut dz = Vec::with_capacity(tp);
            for t in 0..tp {
                dw2.push(ops::matmul(&d_o, true, &k.dq[t], false)?);
                let dd = ops::matmul(&d_o, false, &w.w2_blocks[t], false)?;
                let da = ops::gelu_backward(&k.a[t], &ops::apply_mask(&dd, &k.mask_mp[t], p)?)?;
                dw1.push(ops::matmul(&da, true, &k.zq, false)?);
                dz.push(ops::matmul(&da, false, &w.w1_blocks[t], false)?);
            }
            (ops::concat_rows(&dw1)?, ops::concat_cols(&dw2)?, fold(dz)?)
        } else {
            let dq = ops::concat_cols(&k.dq)?;
            let dw2 = ops::matmul(&d_o, true, &dq, false)?;
            let dd = ops::matmul(&d_o, false, &w.w2, false)?;
            let dg = ops::apply_mask(&dd, &ops::concat_cols(&k.mask_mp)?, p)?;
            let da = ops::gelu_backward(&ops::concat_cols(&k.a)?, &dg)?;
            let dw1 = ops::matmul(&da, true, &k.zq, false)?;
            (dw1, dw2, ops::matmul(&da, false, &w.w1, false)?)
        };
        let (dx_ln, dgamma, dbeta) = if split {
            layernorm_backward_sharded(&dz, &k.x, &k.stats, &w.gamma, tp)?
        } else {
            ops::layernorm_backward(&dz, &k.x, &k.stats, &w.gamma)?
        };
        dy = ops::add(&dy, &dx_ln)?;
        grads.push([dgamma, dbeta, dw1, dw2]);
    }
    grads.reverse();
    Ok(BatchOut {
        loss_sum,
        grads,
        masks,
        trackers,
        current: get_rng_state(dev)?,
        sites,
    })
}

/// LayerNorm's backward over `shards` equal row ranges, the parameter gradients of each
/// range added in order (what the sequence-parallel ranks' all-reduce adds).
fn layernorm_backward_sharded(
    dz: &Tensor,
    x: &Tensor,
    stats: &LnStats,
    gamma: &Tensor,
    shards: usize,
) -> Result<(Tensor, Tensor, Tensor)> {
    let n = x.shape().dims()[0] / shards;
    let mut dx = Vec::with_capacity(shards);
    let (mut dgamma, mut dbeta) = (Vec::with_capacity(shards), Vec::with_capacity(shards));
    for t in 0..shards {
        let r = t * n..(t + 1) * n;
        let (dx_t, dg_t, db_t) = ops::layernorm_backward(
            &ops::rows(dz, r.clone())?,
            &ops::rows(x, r.clone())?,
            &stats.rows(r)?,
            gamma,
        )?;
        dx.push(dx_t);
        dgamma.push(dg_t);
        dbeta.push(db_t);
    }
    Ok((ops::concat_rows(&dx)?, fold(dgamma)?, fold(dbeta)?))
}
