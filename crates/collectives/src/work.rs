//! Handles of asynchronous collectives.

use std::fmt;

use tessera_core::{Error, Result};

/// The handle of a collective (or a group of them) whose result is a `T`.
///
/// [`wait`](Work::wait) blocks until the communication is done, then runs the
/// post-processing that was attached with [`then`](Work::then) — exactly once; waiting
/// again returns the stored result (or the stored error). The output buffers belong to
/// the handle until then, so they cannot be read early.
///
/// Dropping a handle without waiting is safe: the communication still completes (CUDA
/// frees the buffers in stream order after it), but the post-processing does not run and
/// its result is lost.
pub struct Work<T> {
    state: State<T>,
}

enum State<T> {
    Pending(Box<dyn FnOnce() -> Result<T> + Send>),
    Done(T),
    Failed(Error),
    Poisoned,
}

impl<T: Send + 'static> Work<T> {
    /// A handle whose result is computed by `finish` at the first wait.
    pub fn pending(finish: impl FnOnce() -> Result<T> + Send + 'static) -> Self {
        Work {
            state: State::Pending(Box::new(finish)),
        }
    }

    /// A completed handle.
    pub fn done(value: T) -> Self {
        Work {
            state: State::Done(value),
        }
    }

    /// Attaches post-processing that runs (once) after the communication, at the first
    /// wait.
    pub fn then<U: Send + 'static>(
        self,
        f: impl FnOnce(T) -> Result<U> + Send + 'static,
    ) -> Work<U> {
        match self.state {
            State::Pending(finish) => Work::pending(move || f(finish()?)),
            State::Done(v) => Work::pending(move || f(v)),
            State::Failed(e) => Work {
                state: State::Failed(e),
            },
            State::Poisoned => Work {
                state: State::Poisoned,
            },
        }
    }

    /// Waits for the result; later calls return the same result without doing anything.
    pub fn wait(&mut self) -> Result<&mut T> {
        if let State::Pending(_) = self.state {
            let State::Pending(finish) = std::mem::replace(&mut self.state, State::Poisoned) else {
                unreachable!("checked above")
            };
            self.state = match finish() {
                Ok(v) => State::Done(v),
                Err(e) => State::Failed(e),
            };
        }
        match &mut self.state {
            State::Done(v) => Ok(v),
            State::Failed(e) => Err(e.clone()),
            State::Poisoned => Err(Error::state(
                "Work::wait",
                "the post-processing of this collective panicked in an earlier wait",
            )),
            State::Pending(_) => unreachable!("resolved above"),
        }
    }

    /// Waits and returns the result by value.
    pub fn into_result(mut self) -> Result<T> {
        self.wait()?;
        match self.state {
            State::Done(v) => Ok(v),
            _ => unreachable!("wait succeeded"),
        }
    }

    /// Whether a wait has already produced the result (or an error).
    pub fn is_completed(&self) -> bool {
        matches!(self.state, State::Done(_) | State::Failed(_))
    }
}

impl<T> fmt::Debug for Work<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = match self.state {
            State::Pending(_) => "pending",
            State::Done(_) => "done",
            State::Failed(_) => "failed",
            State::Poisoned => "poisoned",
        };
        f.debug_struct("Work").field("state", &s).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[test]
    fn post_processing_runs_exactly_once() {
        let runs = Arc::new(AtomicUsize::new(0));
        let r = runs.clone();
        let mut w = Work::done(2).then(move |v| {
            r.fetch_add(1, Ordering::SeqCst);
            Ok(v * 10)
        });
        assert!(!w.is_completed());
        assert_eq!(*w.wait().unwrap(), 20);
        assert_eq!(*w.wait().unwrap(), 20);
        assert_eq!(runs.load(Ordering::SeqCst), 1);
        let mut f = Work::<u8>::pending(|| Err(Error::invalid("test", "boom")));
        assert!(f.wait().is_err());
        assert_eq!(f.wait().unwrap_err().to_string(), "test: boom");
        drop(Work::done(1).then(|_| -> Result<()> { panic!("never runs: the handle is dropped") }));
    }
}
