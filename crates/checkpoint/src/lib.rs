//! Activation recomputation for tessera: TransformerEngine's `checkpoint()`, framework
//! agnostic, replaying RNG and FP8 scaling state exactly through
//! [`Replay`].
//!
//! A checkpointed forward keeps only its inputs; backward re-runs the forward — with the
//! generators, the RNG tracker and the delayed-scaling histories exactly as they were —
//! and then computes gradients, trading compute for memory.
//!
//! - [`Recompute`]: the unit checkpointing wraps — a forward that saves what its backward
//!   needs through a [`Saver`], and a hand-written backward that takes it back from
//!   [`Saved`]. A layer also lists the [`Replay`] states its
//!   forward draws from ([`Recompute::replay_states`]).
//! - [`Checkpoint`]: how to run it — [`Mode::Off`] (the baseline), [`Mode::Reentrant`]
//!   (recompute eagerly at backward) or [`Mode::NonReentrant`] (saved-tensor hooks: the
//!   first [`Saved::take`] recomputes, each take releases its tensor) — with
//!   `distribute_saved_activations` (the first input kept as a 1-D shard of a
//!   [`ProcessGroup`](tessera_collectives::ProcessGroup), any size), a determinism check
//!   (checksums of the recomputed activations), user contexts ([`UserContext`], TE's
//!   `context_fn`) and a [`MemoryMeter`].
//! - [`Frame`]: what a forward leaves for its backward; [`Frame::backward`] runs once.
//! - [`Phase`]: whether a forward is the first one or the recompute (TE's
//!   `in_fp8_activation_recompute_phase`), for side effects on state that is not
//!   replayed.
//! - [`mlp`]: a reference layer (FC1 → GeLU → dropout from a forked tracker state → FP8
//!   current and delayed scaling → FC2) with a hand-written backward.
//!
//! # How replay works
//!
//! At the forward the frame snapshots the current generators of
//! [`Checkpoint::replay_current_generators`] (by default the CPU's and those of the
//! devices the inputs live on, as PyTorch's `preserve_rng_state`) and every state of
//! [`Recompute::replay_states`]. The recompute restores those snapshots, re-runs the
//! forward, and then restores the snapshots taken just before it. So the recompute draws
//! the same dropout masks and casts with the same FP8 scales as the forward, a
//! delayed-scaling amax recorded (or a history rolled) during the recompute is discarded
//! — the history advances once per step — and the generators end where they would have
//! without checkpointing. No global flags are involved.
//!
//! # Example
//!
//! A layer with a hand-written backward, `y = w · dropout(x)`, with the mask drawn from
//! the CPU's current generator; its gradients are bit-identical with and without
//! checkpointing.
//!
//! ```
//! use tessera_checkpoint::{Checkpoint, Recompute, Saved, Saver, exactly};
//! use tessera_core::{Device, Result, Tensor};
//! use tessera_rng::{get_rng_state, manual_seed, stream::dropout_scale, with_current_generator};
//!
//! struct ScaledDropout {
//!     w: f32,
//!     p: f32,
//!     grad_w: f32,
//! }
//!
//! impl Recompute for ScaledDropout {
//!     fn forward(&mut self, inputs: &[Tensor], saver: &mut Saver) -> Result<Vec<Tensor>> {
//!         let [x] = exactly("ScaledDropout", inputs)?;
//!         let (d, mask) = with_current_generator(Device::Cpu, |g| g.dropout_tensor(x, self.p))??;
//!         saver.save_named("dropped", &d);
//!         saver.save_named("mask", &mask);
//!         let y: Vec<f32> = d.as_slice::<f32>()?.iter().map(|v| v * self.w).collect();
//!         Ok(vec![Tensor::from_slice(&y, x.shape(), Device::Cpu)?])
//!     }
//!
//!     fn backward(saved: &mut Saved<'_, Self>, grads: &[Tensor]) -> Result<Vec<Tensor>> {
//!         let [dy] = exactly("ScaledDropout::backward", grads)?;
//!         let (d, mask) = (saved.take(0)?, saved.take(1)?);
//!         let me = saved.layer();
//!         let dy = dy.as_slice::<f32>()?;
//!         me.grad_w = dy.iter().zip(d.as_slice::<f32>()?).map(|(g, v)| g * v).sum();
//!         let s = dropout_scale(me.p) * me.w;
//!         let mask = mask.as_slice::<u8>()?;
//!         let dx: Vec<f32> = dy.iter().zip(mask).map(|(g, &m)| if m == 1 { g * s } else { 0.0 }).collect();
//!         Ok(vec![Tensor::from_slice(&dx, d.shape(), Device::Cpu)?])
//!     }
//! }
//!
//! # fn main() -> Result<()> {
//! let x = Tensor::from_slice(&[1.5f32; 64], [8, 8], Device::Cpu)?;
//! let dy = Tensor::from_slice(&[0.25f32; 64], [8, 8], Device::Cpu)?;
//! let mut results = Vec::new();
//! for ckpt in [Checkpoint::off(), Checkpoint::reentrant(), Checkpoint::non_reentrant()] {
//!     manual_seed(Device::Cpu, 7)?;
//!     let mut layer = ScaledDropout { w: 3.0, p: 0.5, grad_w: 0.0 };
//!     let (_y, mut frame) = ckpt.forward(&mut layer, &[x.clone()])?;
//!     let after_forward = get_rng_state(Device::Cpu)?;
//!     let held = frame.saved_bytes(); // 64 f32 + 64 u8 without checkpointing, x alone with it
//!     let dx = frame.backward(&mut layer, &[dy.clone()])?;
//!     assert_eq!(get_rng_state(Device::Cpu)?, after_forward); // replayed, then put back
//!     results.push((held, dx[0].to_vec::<f32>()?, layer.grad_w));
//!     // Bad input is a typed error: a frame runs one backward.
//!     assert!(frame.backward(&mut layer, &[dy.clone()]).is_err());
//! }
//! assert_eq!(results[0].0, 64 * 5);
//! assert_eq!((results[1].0, results[2].0), (64 * 4, 64 * 4));
//! assert!(results.windows(2).all(|w| (&w[0].1, w[0].2) == (&w[1].1, w[1].2)));
//! # Ok(())
//! # }
//! ```

#![warn(missing_docs)]

mod context;
mod frame;
pub mod mlp;
mod saver;

pub use context::{ContextFn, MemoryMeter, UserContext, context_fn};
pub use frame::{Checkpoint, Frame, Mode, Saved};
pub use saver::{Phase, Saver, tensor_checksum};

use tessera_core::{Error, Replay, Result, Tensor};

/// A forward that can be re-run and saves what its backward needs, and a backward that
/// consumes it — the unit checkpointing wraps.
///
/// The forward must be a deterministic function of its inputs, its parameters and the
/// states it lists in [`replay_states`](Recompute::replay_states) (plus the current
/// generators the [`Checkpoint`] replays): the recompute re-runs it under the
/// forward-time snapshots of exactly those. It saves tensors through the [`Saver`]
/// (which returns their indices) and returns its outputs; the backward gets the
/// gradients of those outputs, takes the saved tensors back by index through
/// [`Saved`], writes parameter gradients into the layer ([`Saved::layer`]) and returns
/// the gradients of the inputs.
///
/// A layer that draws on shared state (an [`RngTracker`](tessera_rng::RngTracker)
/// owned by the model) implements `Recompute` on a short-lived view that borrows it —
/// see [`mlp::MlpCall`] — and builds the same view again for the backward.
pub trait Recompute {
    /// Runs the forward on `inputs`, saving what the backward needs through `saver`.
    fn forward(&mut self, inputs: &[Tensor], saver: &mut Saver) -> Result<Vec<Tensor>>;

    /// Runs the backward: `grad_outputs` are the gradients of the forward's outputs;
    /// returns the gradients of its inputs.
    fn backward(saved: &mut Saved<'_, Self>, grad_outputs: &[Tensor]) -> Result<Vec<Tensor>>
    where
        Self: Sized;

    /// The states the forward draws from that recompute must replay: RNG trackers,
    /// generators, delayed-scaling states. Listed in the same order every time; the
    /// default is none.
    fn replay_states(&mut self) -> Vec<&mut dyn Replay> {
        Vec::new()
    }
}

/// `tensors` as an array of exactly `N`, or an [`Error::InvalidArgument`] naming `op`:
/// `let [x, w] = exactly("Linear", inputs)?;`.
pub fn exactly<'a, const N: usize>(
    op: &'static str,
    tensors: &'a [Tensor],
) -> Result<&'a [Tensor; N]> {
    tensors
        .try_into()
        .map_err(|_| Error::invalid(op, format!("expected {N} tensor(s), got {}", tensors.len())))
}
