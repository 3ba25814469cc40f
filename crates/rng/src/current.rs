//! The current generator of each device — what `torch.cuda.get_rng_state` /
//! `set_rng_state` read and write in PyTorch.
//!
//! Library code that draws random numbers without being handed a generator (dropout in
//! a layer, weight initialisation) draws from the current generator of the tensor's
//! device, and [`RngTracker::fork`](crate::RngTracker::fork) swaps a named state in and
//! out of it.
//!
//! The current generators are **per thread**: a rank of a tensor-parallel group is a
//! thread (tessera's thread backend) or a process, and each rank must own its streams,
//! as each PyTorch process owns its CUDA generators. A new thread starts every device at
//! [`DEFAULT_SEED`], offset 0.

use std::cell::RefCell;
use std::collections::BTreeMap;

use tessera_core::{Device, Error, Replay, Result, Snapshot};

use crate::{Generator, GeneratorState};

/// The seed a device's current generator starts from (PyTorch's `default_rng_seed_val`).
pub const DEFAULT_SEED: u64 = 67_280_421_310_721;

thread_local! {
    static CURRENT: RefCell<BTreeMap<Device, Generator>> = const { RefCell::new(BTreeMap::new()) };
}

/// Runs `f` on the current generator of `device` on this thread.
///
/// Fails, without running `f`, when called from inside another `with_current_generator`
/// on the same thread (the generator is already lent out).
pub fn with_current_generator<R>(device: Device, f: impl FnOnce(&mut Generator) -> R) -> Result<R> {
    CURRENT.with(|c| {
        let mut map = c.try_borrow_mut().map_err(|_| {
            Error::state(
                "with_current_generator",
                format!(
                    "the current generators of this thread are already borrowed; a nested \
                     call for {device} must use the generator it was given"
                ),
            )
        })?;
        let g = map
            .entry(device)
            .or_insert_with(|| Generator::new(DEFAULT_SEED));
        Ok(f(g))
    })
}

/// The state of `device`'s current generator on this thread.
pub fn get_rng_state(device: Device) -> Result<GeneratorState> {
    with_current_generator(device, |g| g.state())
}

/// Moves `device`'s current generator on this thread to `state`.
pub fn set_rng_state(device: Device, state: GeneratorState) -> Result<()> {
    with_current_generator(device, |g| g.set_state(state))?
}

/// Reseeds `device`'s current generator on this thread (offset 0).
pub fn manual_seed(device: Device, seed: u64) -> Result<()> {
    with_current_generator(device, |g| g.manual_seed(seed))
}

/// A handle to one device's current generator on the calling thread, so it can be
/// registered with a checkpoint frame as [`Replay`] state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CurrentGenerator {
    device: Device,
}

impl CurrentGenerator {
    /// The handle for `device`.
    pub fn new(device: Device) -> Self {
        CurrentGenerator { device }
    }

    /// The device.
    pub fn device(&self) -> Device {
        self.device
    }
}

const CURRENT_KIND: &str = "CurrentGenerator";

impl Replay for CurrentGenerator {
    /// The current state, or the state a fresh thread would have when the generators are
    /// lent out (a snapshot is only taken between draws, never during one).
    fn snapshot(&self) -> Snapshot {
        let state = get_rng_state(self.device).unwrap_or(GeneratorState::new(DEFAULT_SEED));
        Snapshot::new(CURRENT_KIND, (self.device, state))
    }

    fn restore(&mut self, snapshot: &Snapshot) -> Result<()> {
        let &(device, state) = snapshot.get::<(Device, GeneratorState)>(CURRENT_KIND)?;
        if device != self.device {
            return Err(Error::device(
                "CurrentGenerator::restore",
                format!("{} (the snapshot was taken on {device})", self.device),
                device,
            ));
        }
        set_rng_state(device, state)
    }
}
