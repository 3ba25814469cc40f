//! The model both runs train: its initial weights, its data and its loss.
//!
//! - Weights: block `l` has LayerNorm's `γ` (ones) and `β` (zeros), FC1's weight `W1`
//!   `[ffn, hidden]` drawn from `N(0, 1/hidden)` and FC2's weight `W2` `[hidden, ffn]`
//!   drawn from `N(0, 1/ffn)` (TE's `[out, in]` layout), from one generator seeded with
//!   the run's seed: the master weights, as Megatron's CPU initialisation makes them
//!   before splitting. Tensor-parallel rank `t` holds rows `t·ffn/tp..` of `W1` and the
//!   same columns of `W2`.
//! - Data: data-parallel batch `d` of step `k` is `seq × hidden` values drawn from
//!   `N(0, 1)`; the target of token `i`, feature `j` is its input's feature `j + 1 mod
//!   hidden` (a fixed linear map the blocks learn to approximate).
//! - Loss: `0.5 · mean((y - target)²)` over a batch, averaged over the batches.

use tessera_core::{Device, Result, Tensor};
use tessera_rng::Generator;

use super::config::DemoConfig;
use super::ops;

/// The parameters of one block, whole.
#[derive(Debug, Clone)]
pub(crate) struct LayerWeights {
    /// LayerNorm scale `[hidden]`.
    pub(crate) gamma: Tensor,
    /// LayerNorm shift `[hidden]`.
    pub(crate) beta: Tensor,
    /// FC1 `[ffn, hidden]`.
    pub(crate) w1: Tensor,
    /// FC2 `[hidden, ffn]`.
    pub(crate) w2: Tensor,
}

/// Salts that keep the weight and data streams apart from the RNG tracker's.
const INIT_SALT: u64 = 0x1417_5EED_0000_0001;
const DATA_SALT: u64 = 0xDA7A_5EED_0000_0002;

/// The initial weights of every block.
pub(crate) fn init(cfg: &DemoConfig) -> Result<Vec<LayerWeights>> {
    let (h, f) = (cfg.hidden, cfg.ffn);
    let mut g = Generator::new(cfg.seed ^ INIT_SALT);
    (0..cfg.layers)
        .map(|_| {
            let mut w1 = vec![0.0f32; f * h];
            let mut w2 = vec![0.0f32; h * f];
            g.fill_normal(&mut w1, 0.0, 1.0 / (h as f32).sqrt());
            g.fill_normal(&mut w2, 0.0, 1.0 / (f as f32).sqrt());
            Ok(LayerWeights {
                gamma: Tensor::from_slice(&vec![1.0f32; h], [h], Device::Cpu)?,
                beta: Tensor::from_slice(&vec![0.0f32; h], [h], Device::Cpu)?,
                w1: Tensor::from_slice(&w1, [f, h], Device::Cpu)?,
                w2: Tensor::from_slice(&w2, [h, f], Device::Cpu)?,
            })
        })
        .collect()
}

/// Tensor-parallel rank `t`'s shards of a block: `(γ, β, W1 rows, W2 columns)`.
pub(crate) fn tp_shard(
    w: &LayerWeights,
    cfg: &DemoConfig,
    t: usize,
) -> Result<(Tensor, Tensor, Tensor, Tensor)> {
    let fl = cfg.local_ffn();
    Ok((
        w.gamma.clone(),
        w.beta.clone(),
        ops::rows(&w.w1, t * fl..(t + 1) * fl)?,
        ops::col_block(&w.w2, t, fl)?,
    ))
}

/// Data-parallel batch `d` of step `step`: `(input, target)`, each `[seq, hidden]`.
pub(crate) fn batch(cfg: &DemoConfig, step: usize, d: usize) -> Result<(Tensor, Tensor)> {
    let (s, h) = (cfg.seq, cfg.hidden);
    let key = (cfg.seed ^ DATA_SALT)
        .wrapping_add((step as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15))
        .wrapping_add((d as u64).wrapping_mul(0xC2B2_AE3D_27D4_EB4F));
    let mut x = vec![0.0f32; s * h];
    Generator::new(key).fill_normal(&mut x, 0.0, 1.0);
    let mut t = vec![0.0f32; s * h];
    for i in 0..s {
        for j in 0..h {
            t[i * h + j] = x[i * h + (j + 1) % h];
        }
    }
    Ok((
        Tensor::from_slice(&x, [s, h], cfg.device)?,
        Tensor::from_slice(&t, [s, h], cfg.device)?,
    ))
}

/// `(Σ 0.5·(y - target)², dy)` over the rows given, with `dy = (y - target) · inv` where
/// `inv = 1 / (seq · hidden)`: the sum (in f64, row order) is one part of a batch's loss
/// numerator, `dy` the gradient of the batch's mean, on `y`'s device.
///
/// The loss is a number the host prints, so it is computed there: CUDA outputs come to
/// the host (one `[rows, hidden]` pair per step) and `dy` goes back.
pub(crate) fn loss_part(y: &Tensor, target: &Tensor, inv: f32) -> Result<(f64, Tensor)> {
    let (yv, tv) = (y.to_vec::<f32>()?, target.to_vec::<f32>()?);
    if yv.len() != tv.len() {
        return Err(tessera_core::Error::shape(
            "loss",
            format!("output {} and target {} differ", y.shape(), target.shape()),
        ));
    }
    let mut sum = 0.0f64;
    let mut dy = Vec::with_capacity(yv.len());
    for (&a, &b) in yv.iter().zip(&tv) {
        let e = a - b;
        sum += 0.5 * f64::from(e) * f64::from(e);
        dy.push(e * inv);
    }
    Ok((sum, Tensor::from_slice(&dy, y.shape(), y.device())?))
}

/// `1 / (seq · hidden)` in f32, the factor of every loss gradient.
pub(crate) fn loss_scale(cfg: &DemoConfig) -> f32 {
    1.0 / (cfg.seq * cfg.hidden) as f32
}

/// The step's loss from the batches' numerators, batch by batch in order:
/// `mean_d(Σ_d / (seq · hidden))`.
pub(crate) fn step_loss(cfg: &DemoConfig, per_batch_sums: &[f64]) -> f64 {
    let n = (cfg.seq * cfg.hidden) as f64;
    per_batch_sums.iter().map(|s| s / n).sum::<f64>() / per_batch_sums.len().max(1) as f64
}
