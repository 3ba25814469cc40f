//! A reference model trained under FSDP: a stack of residual MLP blocks
//! `y = x + gelu(x·W1)·W2` with a hand-written backward, one FSDP unit per block.
//!
//! The matrix products and GeLU are tessera-checkpoint's reference kernels
//! ([`tessera_checkpoint::mlp`]): f32, parallel over output rows, each output summed in
//! a fixed order, so results do not depend on thread counts and a data-parallel run can
//! be compared with an FSDP run bit for bit. [`train_step`] runs one step on one rank;
//! [`Activations`] chooses what a block keeps for its backward.

use tessera_checkpoint::mlp::{gelu, gelu_backward, matmul, matmul_nt, matmul_tn};
use tessera_checkpoint::{Checkpoint, Recompute, Saved, Saver, exactly};
use tessera_collectives::MaybeQuantized;
use tessera_core::{Device, Error, Result, Tensor};
use tessera_rng::Generator;

use crate::activations::SavedActivations;
use crate::engine::{Fsdp, FullParam};

/// The shape of a stack of blocks and the seed of its initial weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MlpSpec {
    /// Width of the residual stream.
    pub d_model: usize,
    /// Width of the hidden layer.
    pub d_ffn: usize,
    /// Number of blocks.
    pub layers: usize,
    /// Seed of the weights' generator.
    pub seed: u64,
}

impl MlpSpec {
    /// The initial weights, block by block: `layerI.w1` `[d_model, d_ffn]` and
    /// `layerI.w2` `[d_ffn, d_model]`, drawn from `N(0, 1/fan_in)` (the same on every
    /// rank).
    pub fn init(&self) -> Result<Vec<Vec<(String, Tensor)>>> {
        if self.d_model == 0 || self.d_ffn == 0 || self.layers == 0 {
            return Err(Error::invalid(
                "MlpSpec::init",
                format!("every dimension must be positive: {self:?}"),
            ));
        }
        let mut g = Generator::new(self.seed);
        (0..self.layers)
            .map(|l| {
                let mut w1 = vec![0.0f32; self.d_model * self.d_ffn];
                let mut w2 = vec![0.0f32; self.d_ffn * self.d_model];
                g.fill_normal(&mut w1, 0.0, 1.0 / (self.d_model as f32).sqrt());
                g.fill_normal(&mut w2, 0.0, 1.0 / (self.d_ffn as f32).sqrt());
                Ok(vec![
                    (
                        format!("layer{l}.w1"),
                        Tensor::from_slice(&w1, [self.d_model, self.d_ffn], Device::Cpu)?,
                    ),
                    (
                        format!("layer{l}.w2"),
                        Tensor::from_slice(&w2, [self.d_ffn, self.d_model], Device::Cpu)?,
                    ),
                ])
            })
            .collect()
    }

    /// Adds one unit per block (`layerI`) to `fsdp`.
    pub fn build(&self, fsdp: &mut Fsdp) -> Result<()> {
        for (l, params) in self.init()?.into_iter().enumerate() {
            fsdp.add_unit(&format!("layer{l}"), params)?;
        }
        Ok(())
    }

    /// Parameter bytes of the whole model in f32.
    pub fn param_bytes(&self) -> usize {
        self.layers * 2 * self.d_model * self.d_ffn * 4
    }
}

/// A batch of `tokens` rows of width `d_model`, drawn from `N(0, 1)` with `seed`.
pub fn batch(tokens: usize, d_model: usize, seed: u64) -> Result<Tensor> {
    let mut v = vec![0.0f32; tokens * d_model];
    Generator::new(seed).fill_normal(&mut v, 0.0, 1.0);
    Tensor::from_slice(&v, [tokens, d_model], Device::Cpu)
}

/// Rows `[start, end)` of a matrix (a data-parallel rank's part of a batch).
pub fn rows(t: &Tensor, range: std::ops::Range<usize>) -> Result<Tensor> {
    let dims = t.shape().dims();
    if dims.len() != 2 || range.start > range.end || range.end > dims[0] {
        return Err(Error::shape(
            "rows",
            format!("rows {range:?} of a tensor of shape {}", t.shape()),
        ));
    }
    let k = dims[1];
    let v = t.as_slice::<f32>()?;
    Tensor::from_slice(
        &v[range.start * k..range.end * k],
        [range.len(), k],
        Device::Cpu,
    )
}

fn add(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    if a.shape() != b.shape() {
        return Err(Error::shape(
            "add",
            format!("shapes {} and {} differ", a.shape(), b.shape()),
        ));
    }
    let v: Vec<f32> = a
        .as_slice::<f32>()?
        .iter()
        .zip(b.as_slice::<f32>()?)
        .map(|(x, y)| x + y)
        .collect();
    Tensor::from_slice(&v, a.shape(), Device::Cpu)
}

/// One block's forward: `(y, a)` with `a = x·W1` and `y = x + gelu(a)·W2`.
pub fn block_forward(x: &Tensor, w1: &Tensor, w2: &Tensor) -> Result<(Tensor, Tensor)> {
    let a = matmul(x, w1)?;
    let y = add(x, &matmul(&gelu(&a)?, w2)?)?;
    Ok((y, a))
}

/// One block's backward from its input `x`, its `a` and the gradient `dy`:
/// `(dx, dW1, dW2)`.
pub fn block_backward(
    x: &Tensor,
    a: &Tensor,
    w1: &Tensor,
    w2: &Tensor,
    dy: &Tensor,
) -> Result<(Tensor, Tensor, Tensor)> {
    let g = gelu(a)?;
    let dw2 = matmul_tn(&g, dy)?;
    let dg = matmul_nt(dy, w2)?;
    let da = gelu_backward(a, &dg)?;
    let dw1 = matmul_tn(x, &da)?;
    let dx = add(dy, &matmul_nt(&da, w1)?)?;
    Ok((dx, dw1, dw2))
}

/// `0.5·mean(y²)` (in f64) and its gradient `y / numel`.
pub fn mse_loss(y: &Tensor) -> Result<(f64, Tensor)> {
    let v = y.as_slice::<f32>()?;
    let n = v.len().max(1);
    let loss = v
        .iter()
        .map(|&x| 0.5 * f64::from(x) * f64::from(x))
        .sum::<f64>()
        / n as f64;
    let inv = 1.0 / n as f32;
    let dy: Vec<f32> = v.iter().map(|&x| x * inv).collect();
    Ok((loss, Tensor::from_slice(&dy, y.shape(), Device::Cpu)?))
}

/// What a block keeps between its forward and its backward.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Activations {
    /// Its input and `a`; the weights are gathered again for the backward (per the
    /// engine's reshard policy).
    #[default]
    Keep,
    /// Its input and `a`, plus the full weights it computed with (quantized when the
    /// weight format quantizes) scattered over the FSDP group
    /// ([`SavedActivations`], TE's `_fsdp_scatter_tensors`): each rank keeps `1/N` of
    /// them and the backward gathers them back instead of unsharding again.
    ScatterWeights,
    /// Nothing but its input, under a reentrant [`Checkpoint`]: the backward gathers the
    /// weights and recomputes `a` (activation sharding is skipped: there is nothing
    /// to shard).
    Recompute,
}

/// What one [`train_step`] did on this rank.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepReport {
    /// This rank's loss `0.5·mean(y²)` over its batch.
    pub loss: f64,
    /// Bytes the blocks kept between the forward and the backward (activations,
    /// scattered weight chunks, checkpointed inputs).
    pub saved_bytes: usize,
}

/// A block under a [`Checkpoint`] frame.
struct BlockCall {
    w1: Tensor,
    w2: Tensor,
    grads: Option<(Tensor, Tensor)>,
}

impl Recompute for BlockCall {
    fn forward(&mut self, inputs: &[Tensor], saver: &mut Saver) -> Result<Vec<Tensor>> {
        let [x] = exactly("BlockCall::forward", inputs)?;
        let (y, a) = block_forward(x, &self.w1, &self.w2)?;
        saver.save_named("input", x);
        saver.save_named("fc1 output", &a);
        Ok(vec![y])
    }

    fn backward(saved: &mut Saved<'_, Self>, grads: &[Tensor]) -> Result<Vec<Tensor>> {
        let [dy] = exactly("BlockCall::backward", grads)?;
        let (x, a) = (saved.take(0)?, saved.take(1)?);
        let me = saved.layer();
        let (dx, dw1, dw2) = block_backward(&x, &a, &me.w1, &me.w2, dy)?;
        me.grads = Some((dw1, dw2));
        Ok(vec![dx])
    }
}

enum Kept {
    Activations {
        x: Tensor,
        a: Tensor,
        weights: Option<SavedActivations>,
    },
    Frame(Box<tessera_checkpoint::Frame>),
}

fn weights(p: &[FullParam]) -> Result<(Tensor, Tensor)> {
    match p {
        [w1, w2] => Ok((w1.tensor.clone(), w2.tensor.clone())),
        _ => Err(Error::invalid(
            "mlp",
            format!("a block has 2 parameters, the unit {}", p.len()),
        )),
    }
}

/// One training step of the stack in `fsdp` (built with [`MlpSpec::build`]) on this
/// rank's batch `x`: forward through every unit, the loss [`mse_loss`], backward in
/// reverse with the gradients reduce-scattered unit by unit, then SGD with rate `lr` on
/// the shards. A collective: every rank of the engine's groups runs it.
pub fn train_step(fsdp: &mut Fsdp, x: &Tensor, lr: f32, mode: Activations) -> Result<StepReport> {
    let n = fsdp.num_units();
    let mut kept = Vec::with_capacity(n);
    let mut h = x.clone();
    for u in 0..n {
        let params = fsdp.forward_pre(u)?;
        let (w1, w2) = weights(&params)?;
        match mode {
            Activations::Recompute => {
                let mut call = BlockCall {
                    w1,
                    w2,
                    grads: None,
                };
                let (mut out, frame) = Checkpoint::reentrant().forward(&mut call, &[h])?;
                h = out
                    .pop()
                    .ok_or_else(|| Error::state("train_step", "a block returned no output"))?;
                kept.push(Kept::Frame(Box::new(frame)));
            }
            Activations::Keep | Activations::ScatterWeights => {
                let (y, a) = block_forward(&h, &w1, &w2)?;
                let weights = if mode == Activations::ScatterWeights {
                    let tensors = params
                        .into_iter()
                        .map(|p| {
                            Some(match p.quantized {
                                Some(q) => MaybeQuantized::Quantized(q),
                                None => MaybeQuantized::Plain(p.tensor),
                            })
                        })
                        .collect();
                    Some(SavedActivations::save(tensors, Some(fsdp.group()), false)?)
                } else {
                    None
                };
                kept.push(Kept::Activations { x: h, a, weights });
                h = y;
            }
        }
        fsdp.forward_post(u)?;
    }
    let saved_bytes = kept
        .iter()
        .map(|k| match k {
            Kept::Activations { x, a, weights } => {
                x.size_in_bytes()
                    + a.size_in_bytes()
                    + weights.as_ref().map_or(0, SavedActivations::held_bytes)
            }
            Kept::Frame(f) => f.saved_bytes(),
        })
        .sum();
    let (loss, mut dy) = mse_loss(&h)?;
    for u in (0..n).rev() {
        let k = kept
            .pop()
            .ok_or_else(|| Error::state("train_step", "a block kept nothing"))?;
        let (dx, dw1, dw2) = match k {
            Kept::Activations {
                x,
                a,
                weights: Some(saved),
            } => {
                let layouts: Vec<_> = fsdp.params(u)?.iter().map(|p| p.layout().clone()).collect();
                let full = saved
                    .restore()?
                    .into_iter()
                    .zip(&layouts)
                    .map(|(t, layout)| match t {
                        Some(MaybeQuantized::Quantized(q)) => FullParam::from_quantized(q, layout),
                        Some(MaybeQuantized::Plain(t)) => Ok(FullParam {
                            tensor: t,
                            quantized: None,
                        }),
                        None => Err(Error::state("train_step", "a saved weight is missing")),
                    })
                    .collect::<Result<Vec<_>>>()?;
                let (w1, w2) = weights(&full)?;
                block_backward(&x, &a, &w1, &w2, &dy)?
            }
            Kept::Activations {
                x,
                a,
                weights: None,
            } => {
                let (w1, w2) = weights(&fsdp.backward_pre(u)?)?;
                block_backward(&x, &a, &w1, &w2, &dy)?
            }
            Kept::Frame(mut frame) => {
                let (w1, w2) = weights(&fsdp.backward_pre(u)?)?;
                let mut call = BlockCall {
                    w1,
                    w2,
                    grads: None,
                };
                let dx = frame.backward(&mut call, &[dy])?.pop().ok_or_else(|| {
                    Error::state("train_step", "a block returned no input gradient")
                })?;
                let (dw1, dw2) = call.grads.ok_or_else(|| {
                    Error::state("train_step", "a block computed no weight gradients")
                })?;
                (dx, dw1, dw2)
            }
        };
        fsdp.backward_post(u, vec![dw1, dw2])?;
        dy = dx;
    }
    fsdp.sgd_step(lr)?;
    Ok(StepReport { loss, saved_bytes })
}
