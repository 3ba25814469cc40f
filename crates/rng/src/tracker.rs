//! Named RNG states with TransformerEngine's `CudaRNGStatesTracker` semantics.

use std::collections::{BTreeMap, BTreeSet};

use tessera_core::{Device, Error, Replay, Result, Snapshot};

use crate::GeneratorState;
use crate::current::{get_rng_state, set_rng_state};

/// Named generator states for tensor-parallel training (TransformerEngine's
/// `CudaRNGStatesTracker`, Megatron's `CudaRNGStatesTracker`).
///
/// Each name is an independent stream: [`fork`](Self::fork) makes it the device's
/// current generator for the duration of a closure, then stores the advanced state
/// back and puts the previous current state back — also when the closure fails or
/// panics. A typical tensor-parallel model adds a `"model-parallel-rng"` state seeded
/// differently on every rank (dropout inside the parallel region differs between
/// ranks) while the device's own current generator is seeded identically on every rank
/// (dropout in the replicated region agrees); see [`crate::tp`].
///
/// ```
/// use tessera_core::Device;
/// use tessera_rng::{RngTracker, get_rng_state, with_current_generator};
///
/// # fn main() -> tessera_core::Result<()> {
/// let mut tracker = RngTracker::new(Device::Cpu);
/// tracker.add("model-parallel-rng", 1234)?;
/// let outside = get_rng_state(Device::Cpu)?;
/// let mut noise = [0.0f32; 8];
/// tracker.fork("model-parallel-rng", || {
///     with_current_generator(Device::Cpu, |g| g.fill_uniform(&mut noise))
/// })?;
/// assert_eq!(get_rng_state(Device::Cpu)?, outside); // restored
/// assert_eq!(tracker.state("model-parallel-rng")?.offset, 8); // advanced
/// assert!(tracker.add("other", 1234).is_err()); // seeds are unique
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RngTracker {
    device: Device,
    states: TrackerStates,
}

/// The named states and the seeds in use: what [`RngTracker::get_states`] returns and
/// [`RngTracker::set_states`] takes. A plain value; restoring it replays the same
/// numbers.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct TrackerStates {
    /// State of each name.
    pub states: BTreeMap<String, GeneratorState>,
    /// Seeds already added (each may be used once).
    pub seeds: BTreeSet<u64>,
}

impl RngTracker {
    /// An empty tracker whose forks swap the current generator of `device`.
    pub fn new(device: Device) -> Self {
        RngTracker {
            device,
            states: TrackerStates::default(),
        }
    }

    /// The device whose current generator forks swap.
    pub fn device(&self) -> Device {
        self.device
    }

    /// Adds state `name` seeded with `seed` at offset 0. A name or a seed used twice is
    /// an error ([`Error::Duplicate`]), and the tracker is unchanged.
    pub fn add(&mut self, name: &str, seed: u64) -> Result<()> {
        if self.states.seeds.contains(&seed) {
            let owner = self
                .states
                .states
                .iter()
                .find(|(_, s)| s.seed == seed)
                .map(|(n, _)| format!(" (used by `{n}`)"))
                .unwrap_or_default();
            return Err(Error::Duplicate {
                what: "RNG tracker seed",
                name: seed.to_string(),
                detail: owner,
            });
        }
        if self.states.states.contains_key(name) {
            return Err(Error::Duplicate {
                what: "RNG tracker state",
                name: name.to_owned(),
                detail: String::new(),
            });
        }
        self.states.seeds.insert(seed);
        self.states
            .states
            .insert(name.to_owned(), GeneratorState::new(seed));
        Ok(())
    }

    /// The current state of `name`.
    pub fn state(&self, name: &str) -> Result<GeneratorState> {
        self.states
            .states
            .get(name)
            .copied()
            .ok_or_else(|| self.unknown(name))
    }

    /// The names, in order.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.states.states.keys().map(String::as_str)
    }

    /// Runs `f` with state `name` as the device's current generator (on this thread),
    /// then stores the advanced state under `name` and restores the previous current
    /// state. Both happen also when `f` returns an error or panics (the panic then
    /// continues). Forking an unknown name is an error and runs nothing.
    pub fn fork<T, E: From<Error>>(
        &mut self,
        name: &str,
        f: impl FnOnce() -> std::result::Result<T, E>,
    ) -> std::result::Result<T, E> {
        let named = self.state(name)?;
        let outer = get_rng_state(self.device)?;
        set_rng_state(self.device, named)?;
        let mut guard = ForkGuard {
            tracker: self,
            name,
            outer,
            armed: true,
        };
        let result = f();
        guard.armed = false;
        guard.restore()?;
        result
    }

    /// A copy of every named state and the seeds in use (TE's `get_states`).
    pub fn get_states(&self) -> TrackerStates {
        self.states.clone()
    }

    /// Replaces every named state and the seeds in use (TE's `set_states`).
    pub fn set_states(&mut self, states: TrackerStates) -> Result<()> {
        for (name, s) in &states.states {
            s.validate().map_err(|e| {
                Error::invalid("RngTracker::set_states", format!("state `{name}`: {e}"))
            })?;
        }
        self.states = states;
        Ok(())
    }

    /// Forgets every state and seed.
    pub fn reset(&mut self) {
        self.states = TrackerStates::default();
    }

    fn unknown(&self, name: &str) -> Error {
        Error::not_found("RNG tracker state", name, self.names())
    }
}

/// Puts the tracker and the current generator back after a fork, on every exit path.
struct ForkGuard<'a> {
    tracker: &'a mut RngTracker,
    name: &'a str,
    outer: GeneratorState,
    /// Still set when the closure unwinds instead of returning.
    armed: bool,
}

impl ForkGuard<'_> {
    fn restore(&mut self) -> Result<()> {
        let advanced = get_rng_state(self.tracker.device)?;
        if let Some(s) = self.tracker.states.states.get_mut(self.name) {
            *s = advanced;
        }
        set_rng_state(self.tracker.device, self.outer)
    }
}

impl Drop for ForkGuard<'_> {
    fn drop(&mut self) {
        if self.armed {
            // The forked closure panicked: restore, and let the panic go on. There is
            // no caller to report a restore error to, and both calls below only fail
            // when the current generators are lent out, which a fork rules out.
            let _ = self.restore();
        }
    }
}

const TRACKER_KIND: &str = "RngTracker";

impl Replay for RngTracker {
    fn snapshot(&self) -> Snapshot {
        Snapshot::new(TRACKER_KIND, self.states.clone())
    }

    fn restore(&mut self, snapshot: &Snapshot) -> Result<()> {
        self.states = snapshot.get::<TrackerStates>(TRACKER_KIND)?.clone();
        Ok(())
    }
}
