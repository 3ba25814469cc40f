//! User contexts around the forward and the recompute (TransformerEngine's
//! `context_fn`), and the meter of saved-activation bytes.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use tessera_core::Result;

use crate::Phase;

/// A hook pair that runs around every forward a checkpoint frame runs: around the
/// first forward with [`Phase::Forward`] and around the recompute with
/// [`Phase::Recompute`] (TransformerEngine's `context_fn`, which returns a forward
/// context and a recompute context).
///
/// `exit` runs also when the forward fails (the forward's error is returned); when
/// `enter` fails, neither the forward nor `exit` runs. A context is shared by every
/// frame made from one [`Checkpoint`](crate::Checkpoint), so state lives behind
/// interior mutability. [`context_fn`] builds one from two closures.
pub trait UserContext: Send + Sync {
    /// Runs before the forward of `phase`.
    fn enter(&self, phase: Phase) -> Result<()>;

    /// Runs after the forward of `phase`, whether it succeeded or not.
    fn exit(&self, phase: Phase) -> Result<()>;
}

/// A [`UserContext`] made of two closures.
pub struct ContextFn<E, X> {
    enter: E,
    exit: X,
}

/// A [`UserContext`] that calls `enter(phase)` before and `exit(phase)` after each
/// forward and recompute.
///
/// ```
/// use std::sync::{Arc, Mutex};
/// use tessera_checkpoint::{Phase, context_fn};
///
/// let log = Arc::new(Mutex::new(Vec::new()));
/// let (l1, l2) = (log.clone(), log.clone());
/// let ctx = context_fn(
///     move |p: Phase| Ok(l1.lock().unwrap().push(format!("enter {p}"))),
///     move |p: Phase| Ok(l2.lock().unwrap().push(format!("exit {p}"))),
/// );
/// # let _ = ctx;
/// ```
pub fn context_fn<E, X>(enter: E, exit: X) -> Arc<ContextFn<E, X>>
where
    E: Fn(Phase) -> Result<()> + Send + Sync,
    X: Fn(Phase) -> Result<()> + Send + Sync,
{
    Arc::new(ContextFn { enter, exit })
}

impl<E, X> UserContext for ContextFn<E, X>
where
    E: Fn(Phase) -> Result<()> + Send + Sync,
    X: Fn(Phase) -> Result<()> + Send + Sync,
{
    fn enter(&self, phase: Phase) -> Result<()> {
        (self.enter)(phase)
    }

    fn exit(&self, phase: Phase) -> Result<()> {
        (self.exit)(phase)
    }
}

impl<E, X> fmt::Debug for ContextFn<E, X> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ContextFn").finish_non_exhaustive()
    }
}

/// Current and peak bytes of saved activations over every frame that reports to it
/// (a cheap, shared handle; give it to [`Checkpoint::meter`](crate::Checkpoint::meter)).
///
/// A frame reports what it holds between its forward and the end of its backward: the
/// tensors a forward saved without checkpointing; the inputs (or this rank's 1-D shard
/// of the first one) under checkpointing, plus the recomputed activations from the
/// recompute until the backward takes them.
#[derive(Debug, Clone, Default)]
pub struct MemoryMeter {
    inner: Arc<Counters>,
}

#[derive(Debug, Default)]
struct Counters {
    current: AtomicUsize,
    peak: AtomicUsize,
}

impl MemoryMeter {
    /// A meter at zero.
    pub fn new() -> Self {
        Self::default()
    }

    /// Bytes held now.
    pub fn current(&self) -> usize {
        self.inner.current.load(Ordering::Relaxed)
    }

    /// The most bytes held at once since creation or the last
    /// [`reset_peak`](Self::reset_peak).
    pub fn peak(&self) -> usize {
        self.inner.peak.load(Ordering::Relaxed)
    }

    /// Starts a new peak from the bytes held now.
    pub fn reset_peak(&self) {
        self.inner.peak.store(self.current(), Ordering::Relaxed);
    }

    pub(crate) fn add(&self, n: usize) {
        let now = self.inner.current.fetch_add(n, Ordering::Relaxed) + n;
        self.inner.peak.fetch_max(now, Ordering::Relaxed);
    }

    pub(crate) fn sub(&self, n: usize) {
        self.inner.current.fetch_sub(n, Ordering::Relaxed);
    }
}

/// One frame's byte accounting, mirrored into an optional shared meter. Dropping it
/// (with its frame) gives the bytes back.
#[derive(Debug, Default)]
pub(crate) struct Held {
    bytes: usize,
    peak: usize,
    meter: Option<MemoryMeter>,
}

impl Held {
    pub(crate) fn new(meter: Option<MemoryMeter>) -> Self {
        Held {
            bytes: 0,
            peak: 0,
            meter,
        }
    }

    pub(crate) fn add(&mut self, n: usize) {
        self.bytes += n;
        self.peak = self.peak.max(self.bytes);
        if let Some(m) = &self.meter {
            m.add(n);
        }
    }

    pub(crate) fn sub(&mut self, n: usize) {
        let n = n.min(self.bytes);
        self.bytes -= n;
        if let Some(m) = &self.meter {
            m.sub(n);
        }
    }

    pub(crate) fn bytes(&self) -> usize {
        self.bytes
    }

    pub(crate) fn peak(&self) -> usize {
        self.peak
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        let n = self.bytes;
        self.sub(n);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn meter_tracks_current_and_peak_across_frames() {
        let m = MemoryMeter::new();
        let mut a = Held::new(Some(m.clone()));
        let mut b = Held::new(Some(m.clone()));
        a.add(10);
        b.add(5);
        a.sub(10);
        assert_eq!((m.current(), m.peak()), (5, 15));
        assert_eq!((a.bytes(), a.peak()), (0, 10));
        drop(b);
        assert_eq!(m.current(), 0);
        m.reset_peak();
        assert_eq!(m.peak(), 0);
    }
}
