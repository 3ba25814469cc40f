//! Ranks as threads of one process: the reference backend and the test bed.

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use half::{bf16, f16};
use tessera_core::{DType, Device, Error, Result, Tensor};

use crate::Work;
use crate::group::{Collective, ProcessGroup, ReduceOp};

/// How long a rank waits for the others before a collective fails (default).
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

/// One rank of a group whose ranks are threads of this process, exchanging host tensors.
///
/// [`ThreadGroup::new`] makes the handles of all ranks; move each into its own thread
/// (or use [`run_ranks`]). Collectives complete when every rank has
/// issued them; a rank that returns early (drops its handle) or calls
/// [`abort`](ThreadGroup::abort) makes the others' pending and later collectives fail
/// with an error naming it, instead of hanging. Reductions combine contributions in rank
/// order, each step in the tensor's dtype (bf16/f16 round after every addition, like a
/// ring all-reduce does).
pub struct ThreadGroup {
    rank: usize,
    shared: Arc<Shared>,
}

struct Shared {
    size: usize,
    timeout: Duration,
    state: Mutex<Round>,
    cv: Condvar,
    subgroups: Mutex<HashMap<SubgroupKey, Arc<Shared>>>,
}

/// A subgroup is identified by its parent ranks and the parent round that created it.
type SubgroupKey = (Vec<usize>, u64);

/// One exchange: every rank deposits a payload, every rank reads all of them.
struct Round {
    seq: u64,
    slots: Vec<Option<Arc<Payload>>>,
    result: Option<Arc<Vec<Arc<Payload>>>>,
    taken: usize,
    departed: Vec<bool>,
    aborted: Option<String>,
}

/// What a rank contributes to an exchange: a description of its operations (checked
/// against the other ranks') and their inputs. The inputs are tensor clones — shared,
/// immutable storage (tensors are copy-on-write) — so depositing copies nothing and the
/// other ranks read the bytes where they are.
struct Payload {
    signature: String,
    data: Vec<Option<Tensor>>,
}

impl Shared {
    fn new(size: usize, timeout: Duration) -> Arc<Shared> {
        Arc::new(Shared {
            size,
            timeout,
            state: Mutex::new(Round {
                seq: 0,
                slots: vec![None; size],
                result: None,
                taken: 0,
                departed: vec![false; size],
                aborted: None,
            }),
            cv: Condvar::new(),
            subgroups: Mutex::new(HashMap::new()),
        })
    }

    fn lock(&self) -> MutexGuard<'_, Round> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Deposits `payload` for `rank` and returns the round's number (the same on every
    /// rank) and every rank's payload of that round.
    fn exchange(&self, rank: usize, payload: Payload) -> Result<(u64, Arc<Vec<Arc<Payload>>>)> {
        const OP: &str = "ThreadGroup";
        let deadline = Instant::now() + self.timeout;
        let mut st = self.lock();
        // Wait until the previous round has been read by everyone.
        while st.slots[rank].is_some() || st.result.is_some() {
            st = self.wait(st, deadline, rank)?;
        }
        let seq = st.seq;
        st.slots[rank] = Some(Arc::new(payload));
        if st.slots.iter().all(Option::is_some) {
            let all: Vec<Arc<Payload>> = st
                .slots
                .iter()
                .map(|s| s.clone().expect("all present"))
                .collect();
            st.result = Some(Arc::new(all));
            self.cv.notify_all();
        }
        while st.result.is_none() || st.seq != seq {
            if let Some(r) = &st.aborted {
                return Err(Error::state(OP, format!("the group was aborted: {r}")));
            }
            let gone: Vec<usize> = (0..self.size)
                .filter(|&r| st.departed[r] && st.slots[r].is_none())
                .collect();
            if !gone.is_empty() {
                st.slots[rank] = None;
                return Err(Error::state(
                    OP,
                    format!("rank(s) {gone:?} left the group before joining collective #{seq}"),
                ));
            }
            st = self.wait(st, deadline, rank)?;
        }
        let out = st.result.clone().expect("present");
        st.taken += 1;
        if st.taken == self.size {
            st.taken = 0;
            st.result = None;
            st.slots.iter_mut().for_each(|s| *s = None);
            st.seq += 1;
            self.cv.notify_all();
        }
        Ok((seq, out))
    }

    fn wait<'a>(
        &'a self,
        st: MutexGuard<'a, Round>,
        deadline: Instant,
        rank: usize,
    ) -> Result<MutexGuard<'a, Round>> {
        if let Some(r) = &st.aborted {
            return Err(Error::state(
                "ThreadGroup",
                format!("the group was aborted: {r}"),
            ));
        }
        let now = Instant::now();
        if now >= deadline {
            let missing: Vec<usize> = (0..self.size).filter(|&r| st.slots[r].is_none()).collect();
            return Err(Error::state(
                "ThreadGroup",
                format!(
                    "rank {rank} waited {:?} for collective #{}; rank(s) {missing:?} never joined",
                    self.timeout, st.seq
                ),
            ));
        }
        let (g, _) = self
            .cv
            .wait_timeout(st, deadline - now)
            .unwrap_or_else(|e| e.into_inner());
        Ok(g)
    }
}

impl ThreadGroup {
    /// The handles of a group of `size` ranks (index = rank), with the default timeout.
    pub fn new(size: usize) -> Result<Vec<ThreadGroup>> {
        Self::with_timeout(size, DEFAULT_TIMEOUT)
    }

    /// Like [`new`](Self::new), failing a collective after `timeout` without all ranks.
    pub fn with_timeout(size: usize, timeout: Duration) -> Result<Vec<ThreadGroup>> {
        if size == 0 {
            return Err(Error::invalid(
                "ThreadGroup::new",
                "a group needs at least one rank",
            ));
        }
        let shared = Shared::new(size, timeout);
        Ok((0..size)
            .map(|rank| ThreadGroup {
                rank,
                shared: shared.clone(),
            })
            .collect())
    }

    /// Fails every pending and later collective of the group, on every rank.
    pub fn abort(&self, reason: &str) {
        let mut st = self.shared.lock();
        st.aborted
            .get_or_insert_with(|| format!("rank {}: {reason}", self.rank));
        self.shared.cv.notify_all();
    }

    fn exchange(
        &self,
        signature: String,
        data: Vec<Option<Tensor>>,
    ) -> Result<(u64, Arc<Vec<Arc<Payload>>>)> {
        let (seq, all) = self
            .shared
            .exchange(self.rank, Payload { signature, data })?;
        let mine = &all[self.rank].signature;
        if let Some((r, p)) = all.iter().enumerate().find(|(_, p)| &p.signature != mine) {
            return Err(Error::invalid(
                "ThreadGroup",
                format!(
                    "mismatched collectives: rank {} issued {mine}, rank {r} issued {}",
                    self.rank, p.signature
                ),
            ));
        }
        Ok((seq, all))
    }
}

impl Drop for ThreadGroup {
    fn drop(&mut self) {
        let mut st = self.shared.lock();
        st.departed[self.rank] = true;
        self.shared.cv.notify_all();
    }
}

impl fmt::Debug for ThreadGroup {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ThreadGroup")
            .field("rank", &self.rank)
            .field("size", &self.shared.size)
            .finish()
    }
}

/// The signature of an operation list: kinds, dtypes, shapes (roots, reductions).
fn signature(ops: &[Collective]) -> String {
    ops.iter()
        .map(|op| match op {
            Collective::AllGather { input, .. } => {
                format!("all_gather({} {})", input.dtype(), input.shape())
            }
            Collective::ReduceScatter { input, op, .. } => format!(
                "reduce_scatter({} {}, {op:?})",
                input.dtype(),
                input.shape()
            ),
            Collective::AllReduce { tensor, op } => {
                format!("all_reduce({} {}, {op:?})", tensor.dtype(), tensor.shape())
            }
            Collective::Broadcast { tensor, root } => format!(
                "broadcast({} {}, root {root})",
                tensor.dtype(),
                tensor.shape()
            ),
        })
        .collect::<Vec<_>>()
        .join(", ")
}

impl ProcessGroup for ThreadGroup {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.shared.size
    }

    fn device(&self) -> Device {
        Device::Cpu
    }

    fn run(&self, ops: Vec<Collective>) -> Result<Work<Vec<Tensor>>> {
        for op in &ops {
            op.check(self.size(), Device::Cpu)?;
        }
        let data =
            ops.iter()
                .map(|op| match op {
                    Collective::AllGather { input, .. }
                    | Collective::ReduceScatter { input, .. } => Some(input.clone()),
                    Collective::AllReduce { tensor, .. } => Some(tensor.clone()),
                    Collective::Broadcast { tensor, root } if *root == self.rank => {
                        Some(tensor.clone())
                    }
                    Collective::Broadcast { .. } => None,
                })
                .collect::<Vec<_>>();
        let (_, all) = self.exchange(signature(&ops), data)?;
        let size = self.size();
        let outputs = ops
            .into_iter()
            .enumerate()
            .map(|(i, op)| {
                let parts: Vec<&[u8]> = all
                    .iter()
                    .map(|p| p.data[i].as_ref().map_or(Ok(&[][..]), Tensor::as_bytes))
                    .collect::<Result<_>>()?;
                match op {
                    Collective::AllGather { mut output, .. } => {
                        let out = output.as_bytes_mut()?;
                        let mut at = 0;
                        for p in parts {
                            out[at..at + p.len()].copy_from_slice(p);
                            at += p.len();
                        }
                        Ok(output)
                    }
                    Collective::ReduceScatter {
                        input,
                        mut output,
                        op,
                    } => {
                        let chunk = input.size_in_bytes() / size;
                        let mine: Vec<&[u8]> = parts
                            .iter()
                            .map(|p| &p[self.rank * chunk..][..chunk])
                            .collect();
                        reduce_into(input.dtype(), op, &mine, output.as_bytes_mut()?, size)?;
                        Ok(output)
                    }
                    Collective::AllReduce { mut tensor, op } => {
                        let dtype = tensor.dtype();
                        reduce_into(dtype, op, &parts, tensor.as_bytes_mut()?, size)?;
                        Ok(tensor)
                    }
                    Collective::Broadcast { mut tensor, root } => {
                        if root != self.rank {
                            tensor.as_bytes_mut()?.copy_from_slice(parts[root]);
                        }
                        Ok(tensor)
                    }
                }
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Work::done(outputs))
    }

    fn barrier(&self) -> Result<()> {
        self.exchange("barrier".into(), Vec::new()).map(drop)
    }

    fn new_subgroup(&self, ranks: &[usize]) -> Result<Option<Arc<dyn ProcessGroup>>> {
        const OP: &str = "ThreadGroup::new_subgroup";
        let size = self.size();
        let mut seen = vec![false; size];
        for &r in ranks {
            if r >= size || std::mem::replace(&mut seen[r], true) {
                return Err(Error::invalid(
                    OP,
                    format!("ranks {ranks:?} must be distinct ranks of a group of {size}"),
                ));
            }
        }
        if ranks.is_empty() {
            return Err(Error::invalid(OP, "a subgroup needs at least one rank"));
        }
        // The key is the round of this exchange, which every rank agrees on (reading the
        // counter before the exchange could see a round some ranks have already left).
        let (seq, _) = self.exchange(format!("new_subgroup({ranks:?})"), Vec::new())?;
        let Some(sub_rank) = ranks.iter().position(|&r| r == self.rank) else {
            return Ok(None);
        };
        let shared = self
            .shared
            .subgroups
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry((ranks.to_vec(), seq))
            .or_insert_with(|| Shared::new(ranks.len(), self.shared.timeout))
            .clone();
        Ok(Some(Arc::new(ThreadGroup {
            rank: sub_rank,
            shared,
        })))
    }
}

/// Reduces `parts` (rank order) of `dtype` elements into `out`.
fn reduce_into(
    dtype: DType,
    op: ReduceOp,
    parts: &[&[u8]],
    out: &mut [u8],
    size: usize,
) -> Result<()> {
    fn go<T: bytemuck::Pod>(
        parts: &[&[u8]],
        out: &mut [u8],
        f: impl Fn(T, T) -> T,
        fin: impl Fn(T) -> T,
    ) {
        let o: &mut [T] = bytemuck::cast_slice_mut(out);
        let first: Vec<T> = bytemuck::pod_collect_to_vec(parts[0]);
        o.copy_from_slice(&first);
        for p in &parts[1..] {
            let p: Vec<T> = bytemuck::pod_collect_to_vec(p);
            for (a, &b) in o.iter_mut().zip(&p) {
                *a = f(*a, b);
            }
        }
        for a in o.iter_mut() {
            *a = fin(*a);
        }
    }
    macro_rules! float {
        ($t:ty, $from:expr, $to:expr) => {{
            let n = size as f32;
            let to = $to;
            let from = $from;
            match op {
                ReduceOp::Sum => go::<$t>(parts, out, |a, b| from(to(a) + to(b)), |a| a),
                ReduceOp::Avg => {
                    go::<$t>(parts, out, |a, b| from(to(a) + to(b)), |a| from(to(a) / n))
                }
                ReduceOp::Prod => go::<$t>(parts, out, |a, b| from(to(a) * to(b)), |a| a),
                ReduceOp::Max => go::<$t>(
                    parts,
                    out,
                    |a, b| {
                        if to(a).is_nan() || to(b).is_nan() {
                            from(f32::NAN)
                        } else {
                            from(to(a).max(to(b)))
                        }
                    },
                    |a| a,
                ),
                ReduceOp::Min => go::<$t>(
                    parts,
                    out,
                    |a, b| {
                        if to(a).is_nan() || to(b).is_nan() {
                            from(f32::NAN)
                        } else {
                            from(to(a).min(to(b)))
                        }
                    },
                    |a| a,
                ),
            }
        }};
    }
    macro_rules! int {
        ($t:ty) => {
            match op {
                ReduceOp::Sum => go::<$t>(parts, out, |a, b| a.wrapping_add(b), |a| a),
                ReduceOp::Prod => go::<$t>(parts, out, |a, b| a.wrapping_mul(b), |a| a),
                ReduceOp::Max => go::<$t>(parts, out, |a, b| a.max(b), |a| a),
                ReduceOp::Min => go::<$t>(parts, out, |a, b| a.min(b), |a| a),
                ReduceOp::Avg => unreachable!("rejected by Collective::check"),
            }
        };
    }
    match dtype {
        DType::F32 => float!(f32, |v: f32| v, |v: f32| v),
        DType::BF16 => float!(bf16, bf16::from_f32, |v: bf16| v.to_f32()),
        DType::F16 => float!(f16, f16::from_f32, |v: f16| v.to_f32()),
        DType::U8 => int!(u8),
        DType::U32 => int!(u32),
        DType::I32 => int!(i32),
        DType::U64 => int!(u64),
        DType::I64 => int!(i64),
        other => {
            return Err(Error::dtype(
                "reduce",
                "f32, bf16, f16 or an integer type",
                other,
            ));
        }
    }
    Ok(())
}

/// Runs `f` on `size` thread ranks of a new [`ThreadGroup`] and returns each rank's
/// result (index = rank). A rank that fails makes the others' collectives fail too
/// (its handle is dropped), so this never hangs on an error.
pub fn run_ranks<R: Send>(size: usize, f: impl Fn(ThreadGroup) -> R + Sync) -> Result<Vec<R>> {
    let groups = ThreadGroup::new(size)?;
    let f = &f;
    let results = std::thread::scope(|s| {
        let handles: Vec<_> = groups.into_iter().map(|g| s.spawn(move || f(g))).collect();
        handles.into_iter().map(|h| h.join()).collect::<Vec<_>>()
    });
    results
        .into_iter()
        .enumerate()
        .map(|(r, res)| res.map_err(|_| Error::state("run_ranks", format!("rank {r} panicked"))))
        .collect()
}
