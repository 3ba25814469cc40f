//! Checkpoint frames: the first forward, the saved inputs and replay snapshots, and the
//! recompute at backward (eager for reentrant, lazy for non-reentrant frames).

use std::fmt;
use std::sync::Arc;

use tessera_collectives::{
    Chunk1d, ProcessGroup, gather_split_1d_tensor, split_tensor_into_1d_equal_chunks,
};
use tessera_core::{Device, Error, Replay, Result, Snapshot, Tensor};
use tessera_rng::CurrentGenerator;

use crate::context::{Held, MemoryMeter, UserContext};
use crate::saver::{Meta, Saver};
use crate::{Phase, Recompute};

/// How a [`Checkpoint`] treats the activations a forward saves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Mode {
    /// No checkpointing: the forward keeps what it saves until backward takes it (the
    /// baseline, and the way to switch checkpointing off per layer with one code path).
    Off,
    /// TransformerEngine's default (`use_reentrant=True`): the forward drops what it
    /// saves; backward restores the replay states, recomputes the whole forward, puts
    /// the backward-time states back, then runs the layer's backward.
    Reentrant,
    /// Saved-tensor hooks (`use_reentrant=False`): the forward saves only indices; the
    /// backward's first [`Saved::take`] recomputes the forward under the restored states.
    /// A backward that takes nothing recomputes nothing.
    NonReentrant,
}

impl Mode {
    /// `"off"`, `"reentrant"` or `"non-reentrant"`.
    pub fn name(self) -> &'static str {
        match self {
            Mode::Off => "off",
            Mode::Reentrant => "reentrant",
            Mode::NonReentrant => "non-reentrant",
        }
    }
}

/// How to run a [`Recompute`] forward: the mode and its options (a cheap, clonable
/// configuration; one value serves every layer and step).
///
/// | option | default | meaning |
/// |---|---|---|
/// | [`distribute_saved_activations`](Self::distribute_saved_activations) | off | keep the first input as this rank's 1-D shard, all-gather it before recompute |
/// | [`determinism_check`](Self::determinism_check) | off | compare checksums of the recomputed activations with the forward's |
/// | [`replay_current_generators`](Self::replay_current_generators) | the CPU and the inputs' devices | the per-thread current generators to snapshot and replay |
/// | [`context`](Self::context) | none | hooks around the forward and the recompute |
/// | [`meter`](Self::meter) | none | a shared count of saved bytes |
///
/// Shapes and dtypes of the recomputed activations are always compared with the
/// forward's (PyTorch's default determinism check); the checksums are opt-in.
#[derive(Clone)]
pub struct Checkpoint {
    mode: Mode,
    group: Option<Arc<dyn ProcessGroup>>,
    determinism_check: bool,
    /// `None`: the CPU and the devices of the forward's inputs.
    devices: Option<Vec<Device>>,
    context: Option<Arc<dyn UserContext>>,
    meter: Option<MemoryMeter>,
}

impl Checkpoint {
    /// A configuration for `mode` with the defaults.
    pub fn new(mode: Mode) -> Self {
        Checkpoint {
            mode,
            group: None,
            determinism_check: false,
            devices: None,
            context: None,
            meter: None,
        }
    }

    /// No checkpointing ([`Mode::Off`]).
    pub fn off() -> Self {
        Self::new(Mode::Off)
    }

    /// Reentrant checkpointing ([`Mode::Reentrant`]).
    pub fn reentrant() -> Self {
        Self::new(Mode::Reentrant)
    }

    /// Non-reentrant checkpointing ([`Mode::NonReentrant`]).
    pub fn non_reentrant() -> Self {
        Self::new(Mode::NonReentrant)
    }

    /// Keeps the first input only as this rank's 1-D shard across `group` (TE's
    /// `distribute_saved_activations`, in both modes) and all-gathers it before the
    /// recompute. Sizes that do not divide by the group size are padded, not rejected.
    ///
    /// The first input must be identical on every rank (replicated, as in a
    /// tensor-parallel region), and every rank must run its backwards in the same order
    /// (the gather is a collective). With the determinism check, a gathered input that
    /// differs from the forward's is an error. Ignored by [`Mode::Off`].
    pub fn distribute_saved_activations(mut self, group: Arc<dyn ProcessGroup>) -> Self {
        self.group = Some(group);
        self
    }

    /// Compares each recomputed saved tensor and output with the forward's — shape,
    /// dtype and an FNV-1a checksum of the bytes — and fails backward with an error
    /// naming the first difference (PyTorch's `determinism_check`, with values).
    pub fn determinism_check(mut self, on: bool) -> Self {
        self.determinism_check = on;
        self
    }

    /// The devices whose per-thread current generators
    /// ([`tessera_rng::current`]) are snapshotted and replayed, in this order, before
    /// the layer's own [`replay_states`](Recompute::replay_states). Duplicates are
    /// dropped; an empty list replays no current generator.
    ///
    /// Without this call a frame replays the CPU's generator and those of the devices
    /// its forward's inputs live on (PyTorch's `preserve_rng_state`), so a layer on a
    /// GPU that draws from that GPU's current generator is reproduced without setup.
    pub fn replay_current_generators(mut self, devices: impl IntoIterator<Item = Device>) -> Self {
        self.devices = Some(unique(devices));
        self
    }

    /// The devices whose current generators a forward on `inputs` replays.
    fn generator_devices(&self, inputs: &[Tensor]) -> Vec<Device> {
        match &self.devices {
            Some(d) => d.clone(),
            None => unique(std::iter::once(Device::Cpu).chain(inputs.iter().map(Tensor::device))),
        }
    }

    /// Runs `context` around the forward and the recompute (TE's `context_fn`).
    pub fn context(mut self, context: Arc<dyn UserContext>) -> Self {
        self.context = Some(context);
        self
    }

    /// Reports saved bytes to `meter`.
    pub fn meter(mut self, meter: MemoryMeter) -> Self {
        self.meter = Some(meter);
        self
    }

    /// The mode.
    pub fn mode(&self) -> Mode {
        self.mode
    }

    /// Runs `layer`'s forward on `inputs` and returns its outputs and the frame its
    /// backward needs.
    ///
    /// Under checkpointing the frame keeps the inputs (the first as a shard when
    /// distributed) and a snapshot of every replay state: the current generators of
    /// [`replay_current_generators`](Self::replay_current_generators), then
    /// `layer.replay_states()`. The same states must be there at
    /// [`Frame::backward`].
    pub fn forward<L: Recompute>(
        &self,
        layer: &mut L,
        inputs: &[Tensor],
    ) -> Result<(Vec<Tensor>, Frame)> {
        let checkpointed = self.mode != Mode::Off;
        let checksums = checkpointed && self.determinism_check;
        let (devices, snapshots) = if checkpointed {
            let devices = self.generator_devices(inputs);
            let snapshots = snapshot_all(layer, &devices);
            (devices, snapshots)
        } else {
            (Vec::new(), Vec::new())
        };
        let (outputs, saver) = run_forward(
            self.context.as_deref(),
            layer,
            inputs,
            Phase::Forward,
            !checkpointed,
            checksums,
        )?;
        let output_metas = outputs
            .iter()
            .map(|o| Meta::of(o, None, checksums))
            .collect::<Result<Vec<_>>>()?;
        let mut held = Held::new(self.meter.clone());
        let mut stored = Vec::new();
        let mut first_input = None;
        let slots = if checkpointed {
            for (i, x) in inputs.iter().enumerate() {
                let s = match (&self.group, i) {
                    (Some(g), 0) => {
                        if checksums {
                            first_input = Some(Meta::of(x, None, true)?);
                        }
                        Stored::Shard(split_tensor_into_1d_equal_chunks(x, &**g)?)
                    }
                    _ => Stored::Whole(x.clone()),
                };
                held.add(s.bytes());
                stored.push(s);
            }
            saver.metas.iter().map(|_| Slot::Pending).collect()
        } else {
            saver
                .tensors
                .into_iter()
                .map(|t| {
                    held.add(t.size_in_bytes());
                    Slot::Held(t)
                })
                .collect()
        };
        let frame = Frame {
            config: self.clone(),
            inputs: stored,
            first_input,
            devices,
            snapshots,
            saved: saver.metas,
            outputs: output_metas,
            slots,
            consumed: false,
            failed: None,
            recomputed: false,
            held,
        };
        Ok((outputs, frame))
    }
}

impl fmt::Debug for Checkpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Checkpoint")
            .field("mode", &self.mode)
            .field(
                "distribute_saved_activations",
                &self.group.as_ref().map(|g| g.size()),
            )
            .field("determinism_check", &self.determinism_check)
            .field("replay_current_generators", &self.devices)
            .field("context", &self.context.is_some())
            .field("meter", &self.meter)
            .finish()
    }
}

/// A saved input: whole, or this rank's 1-D shard.
enum Stored {
    Whole(Tensor),
    Shard(Chunk1d),
}

impl Stored {
    fn bytes(&self) -> usize {
        match self {
            Stored::Whole(t) => t.size_in_bytes(),
            Stored::Shard(c) => c.chunk.size_in_bytes(),
        }
    }
}

/// A saved activation: not recomputed yet, held, or taken by the backward.
enum Slot {
    Pending,
    Held(Tensor),
    Taken,
}

/// What one forward left for its backward: saved activations (without checkpointing)
/// or the inputs and replay snapshots (with it). [`backward`](Frame::backward) runs
/// once.
///
/// Dropping a frame without running its backward releases what it holds.
pub struct Frame {
    config: Checkpoint,
    inputs: Vec<Stored>,
    first_input: Option<Meta>,
    /// The devices whose current generators `snapshots` begins with.
    devices: Vec<Device>,
    snapshots: Vec<Snapshot>,
    saved: Vec<Meta>,
    outputs: Vec<Meta>,
    slots: Vec<Slot>,
    consumed: bool,
    failed: Option<Error>,
    recomputed: bool,
    held: Held,
}

impl Frame {
    /// Runs `layer`'s backward with the gradients of the forward's outputs and returns
    /// its input gradients.
    ///
    /// `layer` must present the same replay states as at the forward (by count and
    /// kind; a missing one is an [`Error::State`], one of another kind an
    /// [`Error::SnapshotMismatch`], and neither consumes the frame). A reentrant frame
    /// then recomputes: it restores the forward-time snapshots, re-runs the forward in
    /// [`Phase::Recompute`], restores the snapshots taken just before, and checks the
    /// recompute against the forward. A non-reentrant frame does the same at the first
    /// [`Saved::take`]. A second call is an [`Error::State`].
    pub fn backward<L: Recompute>(
        &mut self,
        layer: &mut L,
        grad_outputs: &[Tensor],
    ) -> Result<Vec<Tensor>> {
        const OP: &str = "Frame::backward";
        if self.consumed {
            return Err(Error::state(
                OP,
                "backward already ran on this frame; its saved inputs and activations were \
                 released by the first backward (run the forward again for another backward)",
            ));
        }
        if grad_outputs.len() != self.outputs.len() {
            return Err(Error::invalid(
                OP,
                format!(
                    "the forward returned {} outputs but backward got {} output gradients",
                    self.outputs.len(),
                    grad_outputs.len()
                ),
            ));
        }
        for (i, (g, o)) in grad_outputs.iter().zip(&self.outputs).enumerate() {
            if *g.shape() != o.shape {
                return Err(Error::shape(
                    OP,
                    format!(
                        "the gradient of output {i} has shape {}, the output has shape {}",
                        g.shape(),
                        o.shape
                    ),
                ));
            }
        }
        if self.checkpointed() {
            let now = snapshot_all(layer, &self.devices);
            check_kinds(OP, &self.snapshots, &now)?;
        }
        self.consumed = true;
        let result = self.run_backward(layer, grad_outputs);
        self.release_all();
        result
    }

    fn run_backward<L: Recompute>(
        &mut self,
        layer: &mut L,
        grad_outputs: &[Tensor],
    ) -> Result<Vec<Tensor>> {
        if self.config.mode == Mode::Reentrant {
            self.recompute(layer)?;
        }
        let mut saved = Saved { layer, frame: self };
        L::backward(&mut saved, grad_outputs)
    }

    /// The mode the frame was made with.
    pub fn mode(&self) -> Mode {
        self.config.mode
    }

    /// Bytes held now: saved activations, inputs (or shards) and recomputed activations
    /// not yet taken.
    pub fn saved_bytes(&self) -> usize {
        self.held.bytes()
    }

    /// The most bytes this frame held at once.
    pub fn peak_saved_bytes(&self) -> usize {
        self.held.peak()
    }

    /// How many tensors the forward saved.
    pub fn num_saved(&self) -> usize {
        self.slots.len()
    }

    /// How many outputs the forward returned.
    pub fn num_outputs(&self) -> usize {
        self.outputs.len()
    }

    /// `true` once backward has run (successfully or not, past the argument checks).
    pub fn is_consumed(&self) -> bool {
        self.consumed
    }

    /// `true` once the forward has been recomputed (always `false` for [`Mode::Off`]).
    pub fn is_recomputed(&self) -> bool {
        self.recomputed
    }

    fn checkpointed(&self) -> bool {
        self.config.mode != Mode::Off
    }

    fn release_all(&mut self) {
        for slot in &mut self.slots {
            if let Slot::Held(t) = std::mem::replace(slot, Slot::Taken) {
                self.held.sub(t.size_in_bytes());
            }
        }
        for s in self.inputs.drain(..) {
            self.held.sub(s.bytes());
        }
    }

    /// Recomputes once; a failure is remembered and returned to later takes.
    fn recompute<L: Recompute>(&mut self, layer: &mut L) -> Result<()> {
        if let Some(e) = &self.failed {
            return Err(e.clone());
        }
        let r = self.recompute_inner(layer);
        if let Err(e) = &r {
            self.failed = Some(e.clone());
        }
        r
    }

    fn recompute_inner<L: Recompute>(&mut self, layer: &mut L) -> Result<()> {
        const OP: &str = "checkpoint recompute";
        let inputs = self.materialize_inputs()?;
        let devices = self.devices.clone();
        let backward_time = snapshot_all(layer, &devices);
        check_kinds(OP, &self.snapshots, &backward_time)?;
        restore_all(layer, &devices, &self.snapshots)?;
        let ran = run_forward(
            self.config.context.as_deref(),
            layer,
            &inputs,
            Phase::Recompute,
            true,
            self.config.determinism_check,
        );
        let restored = restore_all(layer, &devices, &backward_time);
        let (outputs, saver) = ran?;
        restored?;
        self.compare(&outputs, &saver)?;
        for (slot, t) in self.slots.iter_mut().zip(saver.tensors) {
            self.held.add(t.size_in_bytes());
            *slot = Slot::Held(t);
        }
        for s in self.inputs.drain(..) {
            self.held.sub(s.bytes());
        }
        self.recomputed = true;
        Ok(())
    }

    /// The inputs of the recompute: whole tensors, and the first one gathered from its
    /// shards when distributed.
    fn materialize_inputs(&self) -> Result<Vec<Tensor>> {
        const OP: &str = "checkpoint recompute";
        let mut out = Vec::with_capacity(self.inputs.len());
        for s in &self.inputs {
            match s {
                Stored::Whole(t) => out.push(t.clone()),
                Stored::Shard(c) => {
                    let group = self.config.group.as_ref().ok_or_else(|| {
                        Error::state(OP, "a sharded input without a process group")
                    })?;
                    let full = gather_split_1d_tensor(c, &**group)?.into_result()?;
                    if let Some(m) = &self.first_input {
                        let got = Meta::of(&full, None, true)?;
                        if let Some(d) = m.difference(&got) {
                            return Err(Error::state(
                                OP,
                                format!(
                                    "the first input gathered from the ranks' shards differs \
                                     from this rank's forward input ({d}): \
                                     distribute_saved_activations needs the first input \
                                     replicated on every rank of the group"
                                ),
                            ));
                        }
                    }
                    out.push(full);
                }
            }
        }
        Ok(out)
    }

    /// Checks the recompute against the forward: output and save counts, then shapes,
    /// dtypes and (with the determinism check) checksums.
    fn compare(&self, outputs: &[Tensor], saver: &Saver) -> Result<()> {
        const OP: &str = "checkpoint recompute";
        const HINT: &str = "a checkpointed forward must be a deterministic function of its \
                            inputs and replay states; register every Replay state it draws \
                            from (Recompute::replay_states, \
                            Checkpoint::replay_current_generators)";
        if outputs.len() != self.outputs.len() {
            return Err(Error::state(
                OP,
                format!(
                    "the recompute returned {} outputs but the forward returned {}; {HINT}",
                    outputs.len(),
                    self.outputs.len()
                ),
            ));
        }
        if saver.metas.len() != self.saved.len() {
            return Err(Error::state(
                OP,
                format!(
                    "the recompute saved {} tensors but the forward saved {}; {HINT}",
                    saver.metas.len(),
                    self.saved.len()
                ),
            ));
        }
        for (i, (f, r)) in self.saved.iter().zip(&saver.metas).enumerate() {
            if let Some(d) = f.difference(r) {
                return Err(Error::state(
                    OP,
                    format!("{} differs: {d}; {HINT}", f.describe("saved tensor", i)),
                ));
            }
        }
        for (i, (f, o)) in self.outputs.iter().zip(outputs).enumerate() {
            let r = Meta::of(o, None, f.checksum.is_some())?;
            if let Some(d) = f.difference(&r) {
                return Err(Error::state(
                    OP,
                    format!("{} differs: {d}; {HINT}", f.describe("output", i)),
                ));
            }
        }
        Ok(())
    }
}

impl fmt::Debug for Frame {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Frame")
            .field("mode", &self.config.mode)
            .field("consumed", &self.consumed)
            .field("saved", &self.slots.len())
            .field("outputs", &self.outputs.len())
            .field("replay_states", &self.snapshots)
            .field("saved_bytes", &self.held.bytes())
            .finish_non_exhaustive()
    }
}

/// What a [`Recompute::backward`] reads: the saved tensors, by the indices
/// [`Saver::save`] returned, and the layer itself.
///
/// [`take`](Saved::take) hands a tensor over and releases the frame's hold on it, so each
/// activation is freed as soon as the backward has consumed it. Under non-reentrant
/// checkpointing the first take recomputes the forward (it needs the layer, which is why
/// the backward reaches the layer through [`layer`](Saved::layer)); take what you need
/// before borrowing the layer, or clone its parameters (tensors are cheap to clone).
pub struct Saved<'a, L> {
    layer: &'a mut L,
    frame: &'a mut Frame,
}

impl<L: Recompute> Saved<'_, L> {
    /// Takes saved tensor `index` (each can be taken once). Under non-reentrant
    /// checkpointing the first take recomputes the forward, and fails with the
    /// recompute's error if that fails.
    pub fn take(&mut self, index: usize) -> Result<Tensor> {
        const OP: &str = "Saved::take";
        let n = self.frame.slots.len();
        let describe = |f: &Frame| {
            f.saved
                .get(index)
                .map(|m| m.describe("saved tensor", index))
                .unwrap_or_else(|| format!("saved tensor {index}"))
        };
        match self.frame.slots.get(index) {
            None => {
                return Err(Error::invalid(
                    OP,
                    format!("index {index} is out of range: the forward saved {n} tensors"),
                ));
            }
            Some(Slot::Taken) => {
                return Err(Error::state(
                    OP,
                    format!(
                        "{} was already taken; each saved tensor can be taken once (clone it \
                         to use it twice)",
                        describe(self.frame)
                    ),
                ));
            }
            Some(Slot::Pending) => self.frame.recompute(self.layer)?,
            Some(Slot::Held(_)) => {}
        }
        match std::mem::replace(&mut self.frame.slots[index], Slot::Taken) {
            Slot::Held(t) => {
                self.frame.held.sub(t.size_in_bytes());
                Ok(t)
            }
            other => {
                self.frame.slots[index] = other;
                Err(Error::state(
                    OP,
                    format!("{} is not available", describe(self.frame)),
                ))
            }
        }
    }

    /// The layer, for its parameters and gradient buffers.
    pub fn layer(&mut self) -> &mut L {
        self.layer
    }

    /// How many tensors the forward saved.
    pub fn len(&self) -> usize {
        self.frame.slots.len()
    }

    /// `true` when the forward saved nothing.
    pub fn is_empty(&self) -> bool {
        self.frame.slots.is_empty()
    }

    /// The bytes the frame holds now (see [`Frame::saved_bytes`]).
    pub fn held_bytes(&self) -> usize {
        self.frame.held.bytes()
    }

    /// The frame's mode.
    pub fn mode(&self) -> Mode {
        self.frame.config.mode
    }
}

impl<L> fmt::Debug for Saved<'_, L> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Saved")
            .field("frame", &self.frame)
            .finish_non_exhaustive()
    }
}

/// Runs one forward under the user context. `exit` runs even when the forward fails.
fn run_forward<L: Recompute>(
    context: Option<&dyn UserContext>,
    layer: &mut L,
    inputs: &[Tensor],
    phase: Phase,
    keep: bool,
    checksums: bool,
) -> Result<(Vec<Tensor>, Saver)> {
    let mut saver = Saver::new(phase, keep, checksums);
    if let Some(c) = context {
        c.enter(phase)?;
    }
    let out = layer.forward(inputs, &mut saver);
    let exited = match context {
        Some(c) => c.exit(phase),
        None => Ok(()),
    };
    let out = out?;
    exited?;
    if let Some(e) = saver.error.take() {
        return Err(e);
    }
    Ok((out, saver))
}

/// `devices` in first-seen order without repeats.
fn unique(devices: impl IntoIterator<Item = Device>) -> Vec<Device> {
    let mut out: Vec<Device> = Vec::new();
    for d in devices {
        if !out.contains(&d) {
            out.push(d);
        }
    }
    out
}

/// Snapshots of the current generators of `devices`, then of the layer's states.
fn snapshot_all<L: Recompute>(layer: &mut L, devices: &[Device]) -> Vec<Snapshot> {
    let mut out: Vec<Snapshot> = devices
        .iter()
        .map(|&d| CurrentGenerator::new(d).snapshot())
        .collect();
    out.extend(layer.replay_states().iter().map(|s| s.snapshot()));
    out
}

/// Restores what [`snapshot_all`] captured (the kinds were checked).
fn restore_all<L: Recompute>(layer: &mut L, devices: &[Device], snaps: &[Snapshot]) -> Result<()> {
    let (gens, rest) = snaps.split_at(devices.len().min(snaps.len()));
    for (&d, s) in devices.iter().zip(gens) {
        CurrentGenerator::new(d).restore(s)?;
    }
    for (state, s) in layer.replay_states().into_iter().zip(rest) {
        state.restore(s)?;
    }
    Ok(())
}

/// The states given now must be the states snapshotted at the forward: same count,
/// same kinds, same order.
fn check_kinds(op: &'static str, forward: &[Snapshot], now: &[Snapshot]) -> Result<()> {
    let fk: Vec<&'static str> = forward.iter().map(Snapshot::kind).collect();
    let nk: Vec<&'static str> = now.iter().map(Snapshot::kind).collect();
    if fk.len() != nk.len() {
        let mut rest = nk.clone();
        let mut missing = Vec::new();
        for k in &fk {
            match rest.iter().position(|r| r == k) {
                Some(p) => {
                    rest.remove(p);
                }
                None => missing.push(*k),
            }
        }
        let what = match (missing.is_empty(), rest.is_empty()) {
            (false, _) => format!("missing: {}", missing.join(", ")),
            (true, false) => format!("not snapshotted at the forward: {}", rest.join(", ")),
            (true, true) => String::new(),
        };
        return Err(Error::state(
            op,
            format!(
                "the forward snapshotted {} replay states [{}] but {} are given now [{}] ({what}); \
                 give backward the same states as the forward (Recompute::replay_states and \
                 Checkpoint::replay_current_generators)",
                fk.len(),
                fk.join(", "),
                nk.len(),
                nk.join(", ")
            ),
        ));
    }
    for (f, n) in fk.iter().zip(&nk) {
        if f != n {
            return Err(Error::SnapshotMismatch {
                expected: n,
                got: f,
            });
        }
    }
    Ok(())
}
