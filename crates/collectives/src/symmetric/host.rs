//! Symmetric memory on the host: the buffers of every rank of a group whose ranks are
//! threads of this process, in one shared object.
//!
//! Each buffer (one per `(numel, dtype)` of a [`SymmetricAllReduce`](super::SymmetricAllReduce))
//! has one input slot per rank and one result chunk per rank. A call is numbered (its
//! *epoch*, the same on every rank because every rank issues the same calls in the same
//! order) and goes through three stages, tracked per rank in [`Progress`]:
//!
//! 1. *deposit* (in the call): wait until every rank has finished reading epoch − 1,
//!    copy the contribution into the own slot, mark `deposited`;
//! 2. *reduce* (in the [`Work`]'s wait): wait until every rank has deposited, then
//!    - one-shot: reduce all slots in rank order into the output;
//!    - two-shot: reduce chunk r of all slots into result chunk r, mark `reduced`, wait
//!      until every rank has, copy all result chunks into the output;
//! 3. mark `read`: this rank no longer reads the slots or chunks of this epoch.
//!
//! A slot is rewritten only at epoch + 1, after every rank marked `read`, and a result
//! chunk only at a later epoch's reduce, after every rank deposited again (which needs
//! every `read`): no reader ever sees a later epoch's bytes. The stages only ever
//! wait for stages of other ranks that the collective contract guarantees (each rank
//! finishes its own previous epoch on a buffer before depositing the next one, see
//! [`HostEntry::all_reduce`]), so within the contract nothing deadlocks; outside it, a
//! wait fails after the timeout, and a rank that drops its buffers makes the others'
//! waits for it fail at once, naming it.
//!
//! Slot and chunk bytes sit behind `RwLock`s that the stage protocol never contends
//! (a writer and the readers of one slot are always in different epochs' stages), so
//! the sharing needs no `unsafe`.

use std::fmt;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, RwLock};
use std::time::{Duration, Instant};

use tessera_core::{DType, Device, Error, Result, Tensor};

use super::reduce::reduce_into;
use super::registry;
use super::{SymmAlgo, chunk_len};
use crate::Work;
use crate::group::{ProcessGroup, ReduceOp};

const OP: &str = "SymmetricAllReduce";

/// What a rank says about its call; every rank's must be equal.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Header {
    op: ReduceOp,
    algo: SymmAlgo,
    dims: Vec<usize>,
}

impl fmt::Display for Header {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {:?} of shape {:?}", self.algo, self.op, self.dims)
    }
}

/// Per-rank progress through the epochs of one buffer.
struct Progress {
    deposited: Vec<u64>,
    reduced: Vec<u64>,
    read: Vec<u64>,
    headers: Vec<Option<Header>>,
    departed: Vec<bool>,
    failed: Option<String>,
}

/// One symmetric buffer shared by the ranks (threads) of a group.
pub(super) struct HostShared {
    size: usize,
    numel: usize,
    dtype: DType,
    /// Elements per two-shot chunk.
    chunk: usize,
    timeout: Duration,
    slots: Vec<RwLock<Vec<u64>>>,
    chunks: Vec<RwLock<Vec<u64>>>,
    progress: Mutex<Progress>,
    cv: Condvar,
}

fn words(bytes: usize) -> Result<Vec<u64>> {
    let n = bytes.div_ceil(8);
    let mut v = Vec::new();
    v.try_reserve_exact(n).map_err(|_| {
        Error::shape(
            OP,
            format!("cannot allocate {bytes} bytes of symmetric host memory"),
        )
    })?;
    v.resize(n, 0);
    Ok(v)
}

impl HostShared {
    fn new(size: usize, numel: usize, dtype: DType, timeout: Duration) -> Result<Self> {
        let es = dtype.size_in_bytes();
        let chunk = chunk_len(numel, size, es);
        Ok(HostShared {
            size,
            numel,
            dtype,
            chunk,
            timeout,
            slots: (0..size)
                .map(|_| words(numel * es).map(RwLock::new))
                .collect::<Result<_>>()?,
            chunks: (0..size)
                .map(|_| words(chunk * es).map(RwLock::new))
                .collect::<Result<_>>()?,
            progress: Mutex::new(Progress {
                deposited: vec![0; size],
                reduced: vec![0; size],
                read: vec![0; size],
                headers: vec![None; size],
                departed: vec![false; size],
                failed: None,
            }),
            cv: Condvar::new(),
        })
    }

    fn lock(&self) -> MutexGuard<'_, Progress> {
        self.progress.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The element range of rank `r`'s two-shot chunk.
    fn chunk_range(&self, r: usize) -> (usize, usize) {
        let b = (r * self.chunk).min(self.numel);
        (b, (b + self.chunk).min(self.numel))
    }

    /// Marks the buffer failed (every later wait on it fails with `msg`) and wakes
    /// everyone; returns the error.
    fn fail(&self, st: &mut Progress, msg: String) -> Error {
        st.failed.get_or_insert(msg.clone());
        self.cv.notify_all();
        Error::state(OP, msg)
    }

    /// Waits until `missing` (the ranks this rank still waits for) is empty, failing on
    /// an earlier failure, on a departed rank, or after the timeout.
    fn wait_for<'a>(
        &'a self,
        rank: usize,
        what: &dyn Fn() -> String,
        missing: impl Fn(&Progress) -> Vec<usize>,
    ) -> Result<MutexGuard<'a, Progress>> {
        let deadline = Instant::now() + self.timeout;
        let mut st = self.lock();
        loop {
            if let Some(f) = &st.failed {
                return Err(Error::state(
                    OP,
                    format!("this symmetric buffer failed earlier: {f}"),
                ));
            }
            let m = missing(&st);
            if m.is_empty() {
                return Ok(st);
            }
            let gone: Vec<usize> = m.iter().copied().filter(|&r| st.departed[r]).collect();
            if !gone.is_empty() {
                let msg = format!(
                    "rank(s) {gone:?} dropped their symmetric buffers before {}",
                    what()
                );
                return Err(self.fail(&mut st, msg));
            }
            let now = Instant::now();
            if now >= deadline {
                let msg = format!(
                    "rank {rank} waited {:?} for rank(s) {m:?} {}",
                    self.timeout,
                    what()
                );
                return Err(self.fail(&mut st, msg));
            }
            st = self
                .cv
                .wait_timeout(st, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// Stage 1 of `epoch` for `rank`.
    fn deposit(&self, rank: usize, epoch: u64, bytes: &[u8], header: Header) -> Result<()> {
        let prev = epoch - 1;
        drop(self.wait_for(
            rank,
            &|| format!("to finish reading symmetric all-reduce #{prev}"),
            |p| (0..self.size).filter(|&s| p.read[s] < prev).collect(),
        )?);
        {
            let mut slot = self.slots[rank].write().unwrap_or_else(|e| e.into_inner());
            bytemuck::cast_slice_mut::<u64, u8>(&mut slot)[..bytes.len()].copy_from_slice(bytes);
        }
        let mut st = self.lock();
        st.deposited[rank] = epoch;
        st.headers[rank] = Some(header);
        self.cv.notify_all();
        Ok(())
    }

    /// Stages 2 and 3 of `epoch` for `rank`: the reduced values into `out`.
    fn complete(
        &self,
        rank: usize,
        epoch: u64,
        op: ReduceOp,
        algo: SymmAlgo,
        out: &mut [u8],
    ) -> Result<()> {
        let es = self.dtype.size_in_bytes();
        let nbytes = self.numel * es;
        let mut st = self.wait_for(
            rank,
            &|| format!("to contribute to symmetric all-reduce #{epoch}"),
            |p| (0..self.size).filter(|&s| p.deposited[s] < epoch).collect(),
        )?;
        let mine = st.headers[rank].clone();
        let mismatch = st
            .headers
            .iter()
            .enumerate()
            .find(|(_, h)| **h != mine)
            .map(|(s, h)| (s, h.clone()));
        if let Some((s, theirs)) = mismatch {
            // Every rank sees the same headers, so every rank fails here; keep the
            // epochs consistent so that the buffer stays usable.
            st.reduced[rank] = epoch;
            st.read[rank] = epoch;
            self.cv.notify_all();
            let show = |h: &Option<Header>| h.as_ref().map_or("nothing".into(), |h| h.to_string());
            return Err(Error::invalid(
                OP,
                format!(
                    "mismatched symmetric all-reduce #{epoch}: rank {rank} issued {}, rank {s} issued {}",
                    show(&mine),
                    show(&theirs)
                ),
            ));
        }
        drop(st);
        let result = self.reduce_stages(rank, epoch, op, algo, es, nbytes, out);
        let mut st = self.lock();
        match result {
            Ok(()) => {
                st.reduced[rank] = epoch;
                st.read[rank] = epoch;
                self.cv.notify_all();
                Ok(())
            }
            Err(e) => {
                if st.failed.is_none() {
                    // Peers may be waiting for this rank's chunk: make them fail too.
                    self.fail(&mut st, format!("rank {rank}: {e}"));
                }
                Err(e)
            }
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn reduce_stages(
        &self,
        rank: usize,
        epoch: u64,
        op: ReduceOp,
        algo: SymmAlgo,
        es: usize,
        nbytes: usize,
        out: &mut [u8],
    ) -> Result<()> {
        let read_all = || -> Vec<_> {
            self.slots
                .iter()
                .map(|s| s.read().unwrap_or_else(|e| e.into_inner()))
                .collect()
        };
        match algo {
            SymmAlgo::OneShot => {
                let slots = read_all();
                let parts: Vec<&[u8]> = slots
                    .iter()
                    .map(|g| &bytemuck::cast_slice::<u64, u8>(g)[..nbytes])
                    .collect();
                reduce_into(self.dtype, op, &parts, out, self.size)
            }
            SymmAlgo::TwoShot => {
                let (b, e) = self.chunk_range(rank);
                {
                    let slots = read_all();
                    let parts: Vec<&[u8]> = slots
                        .iter()
                        .map(|g| &bytemuck::cast_slice::<u64, u8>(g)[b * es..e * es])
                        .collect();
                    let mut chunk = self.chunks[rank].write().unwrap_or_else(|e| e.into_inner());
                    let dst = &mut bytemuck::cast_slice_mut::<u64, u8>(&mut chunk)[..(e - b) * es];
                    if e > b {
                        reduce_into(self.dtype, op, &parts, dst, self.size)?;
                    }
                }
                {
                    let mut st = self.lock();
                    st.reduced[rank] = epoch;
                    self.cv.notify_all();
                }
                drop(self.wait_for(
                    rank,
                    &|| format!("to reduce their chunks of symmetric all-reduce #{epoch}"),
                    |p| (0..self.size).filter(|&s| p.reduced[s] < epoch).collect(),
                )?);
                for s in 0..self.size {
                    let (b, e) = self.chunk_range(s);
                    let chunk = self.chunks[s].read().unwrap_or_else(|e| e.into_inner());
                    out[b * es..e * es]
                        .copy_from_slice(&bytemuck::cast_slice::<u64, u8>(&chunk)[..(e - b) * es]);
                }
                Ok(())
            }
            SymmAlgo::Multimem => Err(Error::state(OP, "internal: multimem reached the host path")),
        }
    }
}

/// A rank's handle on a shared buffer; dropping the last one marks the rank departed,
/// so that the others' waits for it fail instead of timing out.
pub(super) struct HostMember {
    shared: Arc<HostShared>,
    rank: usize,
}

impl Drop for HostMember {
    fn drop(&mut self) {
        let mut st = self.shared.lock();
        st.departed[self.rank] = true;
        self.shared.cv.notify_all();
    }
}

/// An all-reduce whose contribution is deposited and whose result is still to be
/// collected (by its [`Work`], or by the rank's next call on the same buffer).
struct PendingOp {
    state: Mutex<OpState>,
}

enum OpState {
    Waiting(Job),
    Done(Result<Tensor>),
    Taken,
}

struct Job {
    member: Arc<HostMember>,
    epoch: u64,
    tensor: Tensor,
    op: ReduceOp,
    algo: SymmAlgo,
}

impl Job {
    fn run(self) -> Result<Tensor> {
        let Job {
            member,
            epoch,
            mut tensor,
            op,
            algo,
        } = self;
        let out = tensor.as_bytes_mut()?;
        member.shared.complete(member.rank, epoch, op, algo, out)?;
        Ok(tensor)
    }
}

impl PendingOp {
    fn lock(&self) -> MutexGuard<'_, OpState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Runs the reduction if it has not run yet (idempotent).
    fn complete(&self) {
        let mut st = self.lock();
        if matches!(*st, OpState::Waiting(_)) {
            let OpState::Waiting(job) = std::mem::replace(&mut *st, OpState::Taken) else {
                unreachable!("checked above")
            };
            *st = OpState::Done(job.run());
        }
    }

    /// The result, once.
    fn take(&self) -> Result<Tensor> {
        self.complete();
        match std::mem::replace(&mut *self.lock(), OpState::Taken) {
            OpState::Done(r) => r,
            _ => Err(Error::state(
                OP,
                "internal: the result of this all-reduce was already taken",
            )),
        }
    }

    /// Completes the operation and drops its result: nobody will collect it.
    fn discard(&self) {
        self.complete();
        *self.lock() = OpState::Taken;
    }
}

/// Held by a [`Work`]'s closure: when the handle is dropped without a wait, the
/// all-reduce still completes (the other ranks may need this rank's chunk), as every
/// collective's handle promises.
struct CompleteOnDrop(Arc<PendingOp>);

impl Drop for CompleteOnDrop {
    fn drop(&mut self) {
        self.0.discard();
    }
}

/// A rank's cache entry for one host buffer.
pub(super) struct HostEntry {
    member: Arc<HostMember>,
    /// The epochs this rank has deposited.
    epoch: u64,
    /// The latest call's operation, until the next call (which completes it first).
    pending: Option<Arc<PendingOp>>,
}

impl fmt::Debug for HostEntry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HostEntry")
            .field("rank", &self.member.rank)
            .field("numel", &self.member.shared.numel)
            .field("dtype", &self.member.shared.dtype)
            .field("epoch", &self.epoch)
            .finish()
    }
}

/// The bytes of host symmetric memory a rank's buffer for `numel` elements of `dtype`
/// accounts for: its input slot and its result chunk.
pub(super) fn entry_bytes(numel: usize, dtype: DType, size: usize) -> usize {
    let es = dtype.size_in_bytes();
    (numel + chunk_len(numel, size, es)) * es
}

impl HostEntry {
    /// Creates the group's shared buffer for `numel` elements of `dtype` (collective:
    /// every rank of `group` must call it at the same point).
    ///
    /// Rank 0 allocates the buffer and publishes it in the process-global registry;
    /// an all-gather sends its id with every rank's process token, numel and dtype;
    /// the other ranks take the buffer from the registry; a barrier keeps rank 0's
    /// publication alive until everyone has it. Ranks in another process (a host-tensor
    /// group spanning processes) are a typed error: they cannot share host memory.
    pub(super) fn attach(
        group: &dyn ProcessGroup,
        numel: usize,
        dtype: DType,
        timeout: Duration,
    ) -> Result<HostEntry> {
        let (rank, size) = (group.rank(), group.size());
        let token = registry::process_token();
        let mut published = None;
        let mut shared = None;
        if rank == 0 {
            let s = Arc::new(HostShared::new(size, numel, dtype, timeout)?);
            published = Some(registry::publish(&s));
            shared = Some(s);
        }
        let id = published.as_ref().map_or(0, registry::Published::id);
        let row = [token, id, numel as u64, dtype_code(dtype)];
        let mine = Tensor::from_slice(&row, [1, row.len()], Device::Cpu)?;
        let all = group.all_gather(&mine)?.into_result()?.to_vec::<u64>()?;
        let rows: Vec<&[u64]> = all.chunks(row.len()).collect();
        if let Some(s) = rows.iter().position(|r| r[0] != token) {
            return Err(Error::invalid(
                OP,
                format!(
                    "symmetric memory for host tensors needs every rank of the group to be a thread of this process; rank {s} is in another process"
                ),
            ));
        }
        if let Some(s) = rows.iter().position(|r| r[2..] != row[2..]) {
            return Err(Error::shape(
                OP,
                format!(
                    "ranks disagree on the symmetric buffer: rank {rank} asks for {numel} elements of {dtype}, rank {s} for {} elements of {}",
                    rows[s][2],
                    dtype_name(rows[s][3])
                ),
            ));
        }
        let shared = match shared {
            Some(s) => s,
            None => registry::lookup::<HostShared>(rows[0][1]).ok_or_else(|| {
                Error::state(
                    OP,
                    format!(
                        "rank {rank}: rank 0's symmetric buffer (id {}) is gone before this rank attached",
                        rows[0][1]
                    ),
                )
            })?,
        };
        // Rank 0's publication (and its Arc) lives until every rank holds the buffer.
        group.barrier()?;
        drop(published);
        Ok(HostEntry {
            member: Arc::new(HostMember { shared, rank }),
            epoch: 0,
            pending: None,
        })
    }

    /// Deposits `tensor` and returns the handle that collects the result.
    pub(super) fn all_reduce(
        &mut self,
        tensor: Tensor,
        op: ReduceOp,
        algo: SymmAlgo,
    ) -> Result<Work<Tensor>> {
        // This rank's previous call on the buffer must be complete before its slot is
        // rewritten: collect it now if its handle has not been waited.
        if let Some(p) = self.pending.take() {
            p.complete();
        }
        let epoch = self.epoch + 1;
        let header = Header {
            op,
            algo,
            dims: tensor.shape().dims().to_vec(),
        };
        self.member
            .shared
            .deposit(self.member.rank, epoch, tensor.as_bytes()?, header)?;
        self.epoch = epoch;
        let pending = Arc::new(PendingOp {
            state: Mutex::new(OpState::Waiting(Job {
                member: self.member.clone(),
                epoch,
                tensor,
                op,
                algo,
            })),
        });
        self.pending = Some(pending.clone());
        let guard = CompleteOnDrop(pending);
        Ok(Work::pending(move || guard.0.take()))
    }

    /// Completes this rank's outstanding call (for `clear` and drop); its handle, if
    /// still held, then returns the stored result.
    pub(super) fn finish(&mut self) {
        if let Some(p) = self.pending.take() {
            p.complete();
        }
    }
}

impl Drop for HostEntry {
    fn drop(&mut self) {
        // The other ranks may need this rank's two-shot chunk of the last call.
        self.finish();
    }
}

/// The dtype of a [`dtype_code`], for messages.
pub(super) fn dtype_name(code: u64) -> String {
    usize::try_from(code)
        .ok()
        .and_then(|i| DType::ALL.get(i))
        .map_or_else(|| format!("dtype #{code}"), |d| d.to_string())
}

/// A stable number for a dtype (its index in `DType::ALL`), for the exchanged rows.
pub(super) fn dtype_code(dtype: DType) -> u64 {
    DType::ALL
        .iter()
        .position(|&d| d == dtype)
        .map_or(u64::MAX, |i| i as u64)
}
