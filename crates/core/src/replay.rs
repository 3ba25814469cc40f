//! State that must be identical when a forward pass is recomputed.

use std::any::Any;
use std::fmt;
use std::sync::Arc;

use crate::{Error, Result};

/// State that activation recomputation must replay exactly: RNG generators, the RNG
/// tracker, delayed-scaling amax histories.
///
/// A checkpoint frame takes a [`Snapshot`] of every registered `Replay` before the
/// forward pass, and restores them before recomputing it, so the recomputed pass draws
/// the same random numbers and uses the same scales. This one seam replaces
/// TransformerEngine's global flags and recompute-phase special cases.
///
/// Snapshots are values: restoring the same snapshot twice replays the same state twice.
pub trait Replay {
    /// A value capturing the current state.
    fn snapshot(&self) -> Snapshot;

    /// Puts the state back to what `snapshot` captured.
    ///
    /// Fails with [`Error::SnapshotMismatch`] when the snapshot was taken from a
    /// different kind of state.
    fn restore(&mut self, snapshot: &Snapshot) -> Result<()>;
}

impl<R: Replay + ?Sized> Replay for Box<R> {
    fn snapshot(&self) -> Snapshot {
        (**self).snapshot()
    }

    fn restore(&mut self, snapshot: &Snapshot) -> Result<()> {
        (**self).restore(snapshot)
    }
}

impl<R: Replay + ?Sized> Replay for &mut R {
    fn snapshot(&self) -> Snapshot {
        (**self).snapshot()
    }

    fn restore(&mut self, snapshot: &Snapshot) -> Result<()> {
        (**self).restore(snapshot)
    }
}

/// An immutable, cheaply clonable capture of some [`Replay`] state.
///
/// It records the kind of state it came from (`kind`, e.g. `"RngTracker"`), so that
/// restoring it into another kind of state is an error instead of a silent no-op.
#[derive(Clone)]
pub struct Snapshot {
    kind: &'static str,
    value: Arc<dyn Any + Send + Sync>,
}

impl Snapshot {
    /// Wraps `value`, captured from state of kind `kind`.
    pub fn new<T: Any + Send + Sync>(kind: &'static str, value: T) -> Self {
        Snapshot {
            kind,
            value: Arc::new(value),
        }
    }

    /// The kind of state this snapshot was taken from.
    pub fn kind(&self) -> &'static str {
        self.kind
    }

    /// The captured value, if this snapshot was taken from state of kind `kind` and
    /// holds a `T`.
    pub fn get<T: Any>(&self, kind: &'static str) -> Result<&T> {
        if self.kind != kind {
            return Err(Error::SnapshotMismatch {
                expected: kind,
                got: self.kind,
            });
        }
        self.value
            .downcast_ref::<T>()
            .ok_or(Error::SnapshotMismatch {
                expected: kind,
                got: self.kind,
            })
    }
}

impl fmt::Debug for Snapshot {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Snapshot")
            .field("kind", &self.kind)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Counter(u32);

    impl Replay for Counter {
        fn snapshot(&self) -> Snapshot {
            Snapshot::new("Counter", self.0)
        }
        fn restore(&mut self, s: &Snapshot) -> Result<()> {
            self.0 = *s.get::<u32>("Counter")?;
            Ok(())
        }
    }

    #[test]
    fn snapshot_restores_and_rejects_other_kinds() {
        let mut c = Counter(3);
        let s = c.snapshot();
        c.0 = 9;
        c.restore(&s).unwrap();
        assert_eq!(c.0, 3);
        let other = Snapshot::new("Other", 1u32);
        let err = c.restore(&other).unwrap_err();
        assert_eq!(
            err,
            Error::SnapshotMismatch {
                expected: "Counter",
                got: "Other"
            }
        );
        let mut boxed: Box<dyn Replay> = Box::new(Counter(1));
        let s = boxed.snapshot();
        boxed.restore(&s).unwrap();
    }
}
