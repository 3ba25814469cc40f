//! A reference layer for checkpointing: an MLP block written the way
//! TransformerEngine's modules are, with a hand-written backward.
//!
//! `x → fake-FP8 (current scaling) → FC1 → GeLU → dropout → fake-FP8 (delayed scaling) →
//! FC2`, where
//!
//! - the dropout mask is drawn from the tracker's [`MODEL_PARALLEL_RNG`] state, forked
//!   into the current generator of the input's device ([`RngTracker::fork`]);
//! - "fake-FP8" quantizes to FP8 E4M3 and dequantizes back (the backward passes
//!   gradients straight through);
//! - the delayed-scaling quantizer rolls its amax history and derives its scale at the
//!   start of every forward (TE's pre-forward `amax_and_scale_update`), then records the
//!   amax of its cast.
//!
//! [`MlpCall`] — the block plus a borrowed tracker — implements
//! [`Recompute`]: it saves the FC1 input, the FC1 output, the dropout mask and the FC2
//! input, and lists the tracker and the delayed-scaling state as replay states. With
//! [`Mlp::with_delayed_scaling_replay(false)`](Mlp::with_delayed_scaling_replay) the
//! delayed-scaling state is not replayed, and the block uses the [`Phase`] instead, as TE
//! does: in the recompute it skips the history update and the amax record and casts
//! with the scale the forward used.
//!
//! The matrix products are plain f32 loops, parallel over output rows (each output is
//! summed in a fixed order, so results do not depend on the thread count); the block
//! runs on host tensors.

use rayon::prelude::*;
use tessera_core::{DType, Device, Error, Replay, Result, Tensor};
use tessera_quant::{
    DelayedScalingState, Fp8CurrentScaling, Fp8DelayedScaling, Fp8Format, Quantizer, Usage,
};
use tessera_rng::tp::MODEL_PARALLEL_RNG;
use tessera_rng::{Generator, RngTracker, stream::dropout_scale, with_current_generator};

use crate::{Checkpoint, Frame, Phase, Recompute, Saved, Saver, exactly};

/// Length of the delayed-scaling amax history of an [`Mlp`].
pub const AMAX_HISTORY_LEN: usize = 16;

/// The parameters, gradients and quantizers of one MLP block.
#[derive(Debug, Clone)]
pub struct Mlp {
    d_model: usize,
    d_ffn: usize,
    w1: Tensor,
    w2: Tensor,
    grad_w1: Option<Tensor>,
    grad_w2: Option<Tensor>,
    dropout: f32,
    current: Fp8CurrentScaling,
    delayed: Fp8DelayedScaling,
    replay_delayed: bool,
}

impl Mlp {
    /// A block `d_model → d_ffn → d_model` with dropout probability `dropout`, weights
    /// drawn from `N(0, 1/fan_in)` with a generator seeded `seed`.
    pub fn new(d_model: usize, d_ffn: usize, dropout: f32, seed: u64) -> Result<Mlp> {
        if d_model == 0 || d_ffn == 0 {
            return Err(Error::invalid(
                "Mlp::new",
                format!("dimensions must be positive, got d_model {d_model}, d_ffn {d_ffn}"),
            ));
        }
        if !(0.0..1.0).contains(&dropout) {
            return Err(Error::invalid(
                "Mlp::new",
                format!("dropout probability {dropout} must be in [0, 1)"),
            ));
        }
        let mut g = Generator::new(seed);
        let mut w1 = vec![0.0f32; d_model * d_ffn];
        let mut w2 = vec![0.0f32; d_ffn * d_model];
        g.fill_normal(&mut w1, 0.0, 1.0 / (d_model as f32).sqrt());
        g.fill_normal(&mut w2, 0.0, 1.0 / (d_ffn as f32).sqrt());
        Ok(Mlp {
            d_model,
            d_ffn,
            w1: Tensor::from_slice(&w1, [d_model, d_ffn], Device::Cpu)?,
            w2: Tensor::from_slice(&w2, [d_ffn, d_model], Device::Cpu)?,
            grad_w1: None,
            grad_w2: None,
            dropout,
            current: Fp8CurrentScaling::new(Fp8Format::E4M3).with_usage(Usage::Rowwise),
            delayed: Fp8DelayedScaling::new(Fp8Format::E4M3, AMAX_HISTORY_LEN)?
                .with_usage(Usage::Rowwise),
            replay_delayed: true,
        })
    }

    /// Whether the delayed-scaling state is a replay state (the default) or handled
    /// through the [`Phase`] (TE's way).
    pub fn with_delayed_scaling_replay(mut self, replay: bool) -> Self {
        self.replay_delayed = replay;
        self
    }

    /// The block with `tracker`, as a [`Recompute`].
    pub fn call<'a>(&'a mut self, tracker: &'a mut RngTracker) -> MlpCall<'a> {
        MlpCall { mlp: self, tracker }
    }

    /// `(w1 [d_model, d_ffn], w2 [d_ffn, d_model])`.
    pub fn weights(&self) -> (&Tensor, &Tensor) {
        (&self.w1, &self.w2)
    }

    /// The gradients of the last backward, if any.
    pub fn grads(&self) -> Option<(&Tensor, &Tensor)> {
        Some((self.grad_w1.as_ref()?, self.grad_w2.as_ref()?))
    }

    /// The delayed-scaling quantizer's amax history and scale.
    pub fn delayed_scaling(&self) -> &DelayedScalingState {
        self.delayed.state()
    }

    /// `w -= lr · grad` for both weights; an error before the first backward.
    pub fn sgd_step(&mut self, lr: f32) -> Result<()> {
        let (Some(g1), Some(g2)) = (&self.grad_w1, &self.grad_w2) else {
            return Err(Error::state(
                "Mlp::sgd_step",
                "no gradients yet: run a backward first",
            ));
        };
        for (w, g) in [(&mut self.w1, g1), (&mut self.w2, g2)] {
            let g = g.as_slice::<f32>()?;
            for (w, g) in w.as_mut_slice::<f32>()?.iter_mut().zip(g) {
                *w -= lr * g;
            }
        }
        Ok(())
    }

    fn check_input(&self, x: &Tensor) -> Result<()> {
        x.expect_dtype("Mlp::forward", DType::F32)?;
        match x.shape().dims() {
            [_, k] if *k == self.d_model => Ok(()),
            _ => Err(Error::shape(
                "Mlp::forward",
                format!(
                    "expected an input of shape [tokens, {}], got {}",
                    self.d_model,
                    x.shape()
                ),
            )),
        }
    }

    /// `d_model` and `d_ffn`.
    pub fn dims(&self) -> (usize, usize) {
        (self.d_model, self.d_ffn)
    }
}

/// An [`Mlp`] with the tracker its dropout forks: the [`Recompute`] unit. Build it for
/// the forward and again for the backward.
#[derive(Debug)]
pub struct MlpCall<'a> {
    mlp: &'a mut Mlp,
    tracker: &'a mut RngTracker,
}

/// Indices of the saved tensors.
const XQ: usize = 0;
const A: usize = 1;
const MASK: usize = 2;
const DQ: usize = 3;

impl Recompute for MlpCall<'_> {
    fn forward(&mut self, inputs: &[Tensor], saver: &mut Saver) -> Result<Vec<Tensor>> {
        let [x] = exactly("Mlp::forward", inputs)?;
        let mlp = &mut *self.mlp;
        mlp.check_input(x)?;
        let xq = fake_quantize(&mut mlp.current, x)?;
        let a = matmul(&xq, &mlp.w1)?;
        let g = gelu(&a)?;
        let (p, device) = (mlp.dropout, x.device());
        let (dropped, mask) = self.tracker.fork(MODEL_PARALLEL_RNG, || -> Result<_> {
            with_current_generator(device, |rng| rng.dropout_tensor(&g, p))?
        })?;
        // A replayed state runs the same code in both phases (the recompute starts from
        // the forward-time snapshot); an unreplayed one must not update twice.
        let update = mlp.replay_delayed || saver.phase() == Phase::Forward;
        if update {
            mlp.delayed.update(None);
        }
        mlp.delayed.set_record_amax(update);
        let dq = fake_quantize(&mut mlp.delayed, &dropped)?;
        let y = matmul(&dq, &mlp.w2)?;
        let saved = [
            saver.save_named("fc1 input (fp8)", &xq),
            saver.save_named("fc1 output", &a),
            saver.save_named("dropout mask", &mask),
            saver.save_named("fc2 input (fp8)", &dq),
        ];
        debug_assert_eq!(saved, [XQ, A, MASK, DQ]);
        Ok(vec![y])
    }

    fn backward(saved: &mut Saved<'_, Self>, grads: &[Tensor]) -> Result<Vec<Tensor>> {
        let [dy] = exactly("Mlp::backward", grads)?;
        let (w1, w2, p) = {
            let m = &saved.layer().mlp;
            (m.w1.clone(), m.w2.clone(), m.dropout)
        };
        // Each activation is taken when it is needed, and dropped after.
        let dq = saved.take(DQ)?;
        let grad_w2 = matmul_tn(&dq, dy)?;
        drop(dq);
        let d_dropped = matmul_nt(dy, &w2)?;
        let dg = dropout_backward(&d_dropped, &saved.take(MASK)?, p)?;
        let da = gelu_backward(&saved.take(A)?, &dg)?;
        let xq = saved.take(XQ)?;
        let grad_w1 = matmul_tn(&xq, &da)?;
        let dx = matmul_nt(&da, &w1)?;
        let m = &mut saved.layer().mlp;
        m.grad_w1 = Some(grad_w1);
        m.grad_w2 = Some(grad_w2);
        Ok(vec![dx])
    }

    fn replay_states(&mut self) -> Vec<&mut dyn Replay> {
        let mut states: Vec<&mut dyn Replay> = vec![&mut *self.tracker];
        if self.mlp.replay_delayed {
            states.push(&mut self.mlp.delayed);
        }
        states
    }
}

/// What one [`train_step`] did.
#[derive(Debug, Clone)]
pub struct Step {
    /// `0.5 · mean(y²)` of the last block's output (computed in f64).
    pub loss: f64,
    /// The gradient of the stack's input.
    pub dx: Tensor,
    /// Bytes the frames held between the forward and the backward (all blocks).
    pub saved_after_forward: usize,
}

/// One training step of a stack of blocks sharing `tracker`: the forward through every
/// block under `ckpt`, the loss `0.5 · mean(y²)` (so `dy = y / numel`), the backward in reverse,
/// then SGD with rate `lr`.
pub fn train_step(
    blocks: &mut [Mlp],
    tracker: &mut RngTracker,
    x: &Tensor,
    ckpt: &Checkpoint,
    lr: f32,
) -> Result<Step> {
    let mut frames: Vec<Frame> = Vec::with_capacity(blocks.len());
    let mut h = x.clone();
    for block in blocks.iter_mut() {
        let (mut out, frame) = ckpt.forward(&mut block.call(tracker), &[h])?;
        h = out
            .pop()
            .ok_or_else(|| Error::state("train_step", "a block returned no output"))?;
        frames.push(frame);
    }
    let saved_after_forward = frames.iter().map(Frame::saved_bytes).sum();
    let n = h.numel().max(1);
    let loss = h
        .as_slice::<f32>()?
        .iter()
        .map(|&v| 0.5 * f64::from(v) * f64::from(v))
        .sum::<f64>()
        / n as f64;
    let inv_n = 1.0 / n as f32;
    let mut grad = map(&h, |v| v * inv_n)?;
    for (block, mut frame) in blocks.iter_mut().zip(frames).rev() {
        let mut dx = frame.backward(&mut block.call(tracker), &[grad])?;
        grad = dx
            .pop()
            .ok_or_else(|| Error::state("train_step", "a block returned no input gradient"))?;
    }
    for block in blocks.iter_mut() {
        block.sgd_step(lr)?;
    }
    Ok(Step {
        loss,
        dx: grad,
        saved_after_forward,
    })
}

/// Quantizes `x` and dequantizes it back to its dtype.
pub fn fake_quantize(q: &mut dyn Quantizer, x: &Tensor) -> Result<Tensor> {
    q.quantize(x)?.dequantize(x.dtype())
}

fn dims2(op: &'static str, t: &Tensor) -> Result<(usize, usize)> {
    match t.shape().dims() {
        &[m, k] => Ok((m, k)),
        _ => Err(Error::shape(
            op,
            format!("expected a matrix, got shape {}", t.shape()),
        )),
    }
}

fn mismatch(op: &'static str, a: &Tensor, b: &Tensor) -> Error {
    Error::shape(
        op,
        format!("cannot multiply {} by {}", a.shape(), b.shape()),
    )
}

/// Runs `row(i, out_row)` for every output row of an `[m, n]` result.
fn by_rows(m: usize, n: usize, row: impl Fn(usize, &mut [f32]) + Sync) -> Result<Tensor> {
    let mut out = vec![0.0f32; m * n];
    if n > 0 {
        out.par_chunks_mut(n)
            .enumerate()
            .for_each(|(i, r)| row(i, r));
    }
    Tensor::from_slice(&out, [m, n], Device::Cpu)
}

/// `a [m, k] · b [k, n]` (f32, host).
pub fn matmul(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    const OP: &str = "matmul";
    let ((m, k), (k2, n)) = (dims2(OP, a)?, dims2(OP, b)?);
    if k != k2 {
        return Err(mismatch(OP, a, b));
    }
    let (av, bv) = (a.as_slice::<f32>()?, b.as_slice::<f32>()?);
    by_rows(m, n, |i, r| {
        for (p, &x) in av[i * k..(i + 1) * k].iter().enumerate() {
            for (o, &w) in r.iter_mut().zip(&bv[p * n..(p + 1) * n]) {
                *o += x * w;
            }
        }
    })
}

/// `aᵀ · b` for `a [m, k]`, `b [m, n]`: a `[k, n]` weight gradient.
pub fn matmul_tn(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    const OP: &str = "matmul_tn";
    let ((m, k), (m2, n)) = (dims2(OP, a)?, dims2(OP, b)?);
    if m != m2 {
        return Err(mismatch(OP, a, b));
    }
    let (av, bv) = (a.as_slice::<f32>()?, b.as_slice::<f32>()?);
    by_rows(k, n, |p, r| {
        for i in 0..m {
            let x = av[i * k + p];
            for (o, &w) in r.iter_mut().zip(&bv[i * n..(i + 1) * n]) {
                *o += x * w;
            }
        }
    })
}

/// `a · bᵀ` for `a [m, k]`, `b [n, k]`: a `[m, n]` input gradient.
pub fn matmul_nt(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    const OP: &str = "matmul_nt";
    let ((m, k), (n, k2)) = (dims2(OP, a)?, dims2(OP, b)?);
    if k != k2 {
        return Err(mismatch(OP, a, b));
    }
    let (av, bv) = (a.as_slice::<f32>()?, b.as_slice::<f32>()?);
    by_rows(m, n, |i, r| {
        let ar = &av[i * k..(i + 1) * k];
        for (j, o) in r.iter_mut().enumerate() {
            *o = ar
                .iter()
                .zip(&bv[j * k..(j + 1) * k])
                .fold(0.0f32, |s, (x, w)| s + x * w);
        }
    })
}

const SQRT_2_OVER_PI: f32 = 0.797_884_6;
const GELU_C: f32 = 0.044_715;

fn map(t: &Tensor, f: impl Fn(f32) -> f32 + Sync) -> Result<Tensor> {
    let v: Vec<f32> = t.as_slice::<f32>()?.par_iter().map(|&x| f(x)).collect();
    Tensor::from_slice(&v, t.shape(), Device::Cpu)
}

fn zip_map<T: tessera_core::Element + Sync>(
    op: &'static str,
    a: &Tensor,
    b: &Tensor,
    f: impl Fn(f32, T) -> f32 + Sync,
) -> Result<Tensor> {
    if a.shape() != b.shape() {
        return Err(Error::shape(
            op,
            format!("shapes {} and {} differ", a.shape(), b.shape()),
        ));
    }
    let v: Vec<f32> = a
        .as_slice::<f32>()?
        .par_iter()
        .zip(b.as_slice::<T>()?)
        .map(|(&x, &y)| f(x, y))
        .collect();
    Tensor::from_slice(&v, a.shape(), Device::Cpu)
}

/// GeLU, tanh approximation: `0.5·a·(1 + tanh(√(2/π)·(a + 0.044715·a³)))`.
pub fn gelu(a: &Tensor) -> Result<Tensor> {
    map(a, |x| {
        0.5 * x * (1.0 + (SQRT_2_OVER_PI * (x + GELU_C * x * x * x)).tanh())
    })
}

/// `dg · gelu'(a)`.
pub fn gelu_backward(a: &Tensor, dg: &Tensor) -> Result<Tensor> {
    zip_map("gelu_backward", dg, a, |d, x: f32| {
        let t = (SQRT_2_OVER_PI * (x + GELU_C * x * x * x)).tanh();
        let dt = (1.0 - t * t) * SQRT_2_OVER_PI * (1.0 + 3.0 * GELU_C * x * x);
        d * (0.5 * (1.0 + t) + 0.5 * x * dt)
    })
}

/// The gradient through dropout: `d · scale` where the mask kept, 0 elsewhere.
pub fn dropout_backward(d: &Tensor, mask: &Tensor, p: f32) -> Result<Tensor> {
    let s = dropout_scale(p);
    zip_map("dropout_backward", d, mask, |g, m: u8| {
        if m == 1 { g * s } else { 0.0 }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(v: &[f32], shape: [usize; 2]) -> Tensor {
        Tensor::from_slice(v, shape, Device::Cpu).unwrap()
    }

    #[test]
    fn products_agree_with_the_definition() {
        let a = t(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0], [2, 3]);
        let b = t(&[1.0, 0.0, 0.0, 1.0, 1.0, 1.0], [3, 2]);
        assert_eq!(
            matmul(&a, &b).unwrap().to_vec::<f32>().unwrap(),
            [4.0, 5.0, 10.0, 11.0]
        );
        let bt = t(&[1.0, 0.0, 1.0, 0.0, 1.0, 1.0], [2, 3]);
        assert_eq!(
            matmul_nt(&a, &bt).unwrap().to_vec::<f32>().unwrap(),
            [4.0, 5.0, 10.0, 11.0]
        );
        let c = t(&[1.0, 2.0, 3.0, 4.0], [2, 2]);
        // aᵀ c: [3, 2]
        assert_eq!(
            matmul_tn(&a, &c).unwrap().to_vec::<f32>().unwrap(),
            [13.0, 18.0, 17.0, 24.0, 21.0, 30.0]
        );
        assert!(matmul(&a, &a).is_err());
        let empty = Tensor::zeros([0, 3], DType::F32, Device::Cpu).unwrap();
        assert_eq!(matmul(&empty, &b).unwrap().shape().dims(), &[0, 2]);
    }

    #[test]
    fn gelu_backward_matches_a_finite_difference() {
        let xs = [-2.0f32, -0.5, 0.0, 0.3, 1.7];
        let a = Tensor::from_slice(&xs, [5], Device::Cpu).unwrap();
        let ones = Tensor::from_slice(&[1.0f32; 5], [5], Device::Cpu).unwrap();
        let d = gelu_backward(&a, &ones).unwrap().to_vec::<f32>().unwrap();
        for (i, &x) in xs.iter().enumerate() {
            let h = 1e-3f32;
            let f = |v: f32| {
                gelu(&Tensor::from_slice(&[v], [1], Device::Cpu).unwrap())
                    .unwrap()
                    .to_vec::<f32>()
                    .unwrap()[0]
            };
            let fd = (f(x + h) - f(x - h)) / (2.0 * h);
            assert!((fd - d[i]).abs() < 1e-2, "x={x}: {fd} vs {}", d[i]);
        }
    }

    #[test]
    fn bad_block_input_is_a_typed_error() {
        assert!(Mlp::new(0, 4, 0.1, 1).is_err());
        assert!(Mlp::new(4, 4, 1.0, 1).is_err());
        let mut mlp = Mlp::new(4, 8, 0.1, 1).unwrap();
        assert!(mlp.sgd_step(0.1).is_err());
        let mut tracker = RngTracker::new(Device::Cpu);
        tracker.add(MODEL_PARALLEL_RNG, 5).unwrap();
        let x = Tensor::zeros([2, 5], DType::F32, Device::Cpu).unwrap();
        let err = Checkpoint::off()
            .forward(&mut mlp.call(&mut tracker), &[x])
            .unwrap_err();
        assert!(err.to_string().contains("[tokens, 4]"), "{err}");
    }
}
