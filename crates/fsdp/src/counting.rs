//! A [`ProcessGroup`] decorator that counts what each collective sends.

use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard};

use tessera_collectives::{Collective, ProcessGroup, Work};
use tessera_core::{Device, Result, Tensor};

/// What one kind of collective moved on this rank.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct OpCount {
    /// Collectives issued (each operation of a coalesced group counts once).
    pub calls: u64,
    /// Bytes this rank handed to the collectives: the input of an all-gather or
    /// reduce-scatter, the tensor of an all-reduce, the root's tensor of a broadcast
    /// (0 on the other ranks).
    pub bytes: u64,
    /// Bytes this rank transmits when the collective runs as a ring (NCCL's algorithm for
    /// these sizes): `(N-1)·input` for an all-gather, `(N-1)/N·input` for a
    /// reduce-scatter, `2(N-1)/N·tensor` for an all-reduce and `(N-1)/N·tensor` (the
    /// average over ranks of a pipelined ring) for a broadcast. 0 for a group of one.
    pub wire_bytes: u64,
}

impl OpCount {
    fn add(&mut self, bytes: u64, wire: u64) {
        self.calls += 1;
        self.bytes += bytes;
        self.wire_bytes += wire;
    }

    fn merge(&mut self, o: &OpCount) {
        self.calls += o.calls;
        self.bytes += o.bytes;
        self.wire_bytes += o.wire_bytes;
    }
}

/// The totals a [`CountingGroup`] has seen, per kind of collective.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CommCounts {
    /// All-gathers.
    pub all_gather: OpCount,
    /// Reduce-scatters.
    pub reduce_scatter: OpCount,
    /// All-reduces.
    pub all_reduce: OpCount,
    /// Broadcasts.
    pub broadcast: OpCount,
}

impl CommCounts {
    /// The sum over every kind.
    pub fn total(&self) -> OpCount {
        let mut t = OpCount::default();
        for o in [
            &self.all_gather,
            &self.reduce_scatter,
            &self.all_reduce,
            &self.broadcast,
        ] {
            t.merge(o);
        }
        t
    }

    /// `self - earlier`, kind by kind (for the traffic of one phase).
    pub fn since(&self, earlier: &CommCounts) -> CommCounts {
        let d = |a: &OpCount, b: &OpCount| OpCount {
            calls: a.calls.saturating_sub(b.calls),
            bytes: a.bytes.saturating_sub(b.bytes),
            wire_bytes: a.wire_bytes.saturating_sub(b.wire_bytes),
        };
        CommCounts {
            all_gather: d(&self.all_gather, &earlier.all_gather),
            reduce_scatter: d(&self.reduce_scatter, &earlier.reduce_scatter),
            all_reduce: d(&self.all_reduce, &earlier.all_reduce),
            broadcast: d(&self.broadcast, &earlier.broadcast),
        }
    }
}

/// Wraps a [`ProcessGroup`], delegating every call and adding up, per kind of collective,
/// the calls, the bytes this rank contributes and the bytes a ring would transmit
/// ([`OpCount`]). Subgroups made through it count into the same totals.
///
/// ```
/// use std::sync::Arc;
/// use tessera_collectives::{ProcessGroup, run_ranks};
/// use tessera_core::{Device, Tensor};
/// use tessera_fsdp::CountingGroup;
///
/// # fn main() -> tessera_core::Result<()> {
/// let sent = run_ranks(4, |g| -> tessera_core::Result<u64> {
///     let counted = Arc::new(CountingGroup::new(Arc::new(g)));
///     let x = Tensor::from_slice(&[1.0f32; 8], [2, 4], Device::Cpu)?;
///     counted.all_gather(&x)?.into_result()?;
///     Ok(counted.counts().all_gather.bytes)
/// })?;
/// assert!(sent.into_iter().all(|b| b.unwrap() == 32));
/// # Ok(())
/// # }
/// ```
pub struct CountingGroup {
    inner: Arc<dyn ProcessGroup>,
    counts: Arc<Mutex<CommCounts>>,
}

impl CountingGroup {
    /// Counts the collectives of `inner`, from zero.
    pub fn new(inner: Arc<dyn ProcessGroup>) -> Self {
        CountingGroup {
            inner,
            counts: Arc::new(Mutex::new(CommCounts::default())),
        }
    }

    /// The totals so far.
    pub fn counts(&self) -> CommCounts {
        *self.lock()
    }

    /// Sets the totals back to zero.
    pub fn reset(&self) {
        *self.lock() = CommCounts::default();
    }

    /// The wrapped group.
    pub fn inner(&self) -> &Arc<dyn ProcessGroup> {
        &self.inner
    }

    fn lock(&self) -> MutexGuard<'_, CommCounts> {
        self.counts.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn record(&self, ops: &[Collective]) {
        let n = self.inner.size() as u64;
        let ring = |b: u64, num: u64, den: u64| b.saturating_mul(num) / den.max(1);
        let mut c = self.lock();
        for op in ops {
            match op {
                Collective::AllGather { input, .. } => {
                    let b = input.size_in_bytes() as u64;
                    c.all_gather.add(b, ring(b, n - 1, 1));
                }
                Collective::ReduceScatter { input, .. } => {
                    let b = input.size_in_bytes() as u64;
                    c.reduce_scatter.add(b, ring(b, n - 1, n));
                }
                Collective::AllReduce { tensor, .. } => {
                    let b = tensor.size_in_bytes() as u64;
                    c.all_reduce.add(b, ring(b, 2 * (n - 1), n));
                }
                Collective::Broadcast { tensor, root } => {
                    let b = tensor.size_in_bytes() as u64;
                    let mine = if *root == self.inner.rank() { b } else { 0 };
                    c.broadcast.add(mine, ring(b, n - 1, n));
                }
            }
        }
    }
}

impl fmt::Debug for CountingGroup {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CountingGroup")
            .field("inner", &self.inner)
            .field("counts", &self.counts())
            .finish()
    }
}

impl ProcessGroup for CountingGroup {
    fn rank(&self) -> usize {
        self.inner.rank()
    }

    fn size(&self) -> usize {
        self.inner.size()
    }

    fn device(&self) -> Device {
        self.inner.device()
    }

    fn run(&self, ops: Vec<Collective>) -> Result<Work<Vec<Tensor>>> {
        self.record(&ops);
        self.inner.run(ops)
    }

    fn barrier(&self) -> Result<()> {
        self.inner.barrier()
    }

    fn new_subgroup(&self, ranks: &[usize]) -> Result<Option<Arc<dyn ProcessGroup>>> {
        Ok(self.inner.new_subgroup(ranks)?.map(|g| {
            Arc::new(CountingGroup {
                inner: g,
                counts: self.counts.clone(),
            }) as Arc<dyn ProcessGroup>
        }))
    }
}
