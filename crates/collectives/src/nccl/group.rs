//! [`NcclGroup`]: the one-process-per-GPU [`ProcessGroup`] over NCCL.

use std::ffi::{c_int, c_void};
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use cudarc::driver::{CudaEvent, CudaStream, DevicePtr, DevicePtrMut};
use cudarc::nccl::sys;
use tessera_core::cuda::{CudaDevice, CudaResultExt};
use tessera_core::{DType, Device, Error, Result, Tensor};

use super::comm::{Communicator, UniqueId};
use super::loader::ensure_available;
use crate::group::{Collective, ProcessGroup, ReduceOp};
use crate::store::{DEFAULT_STORE_TIMEOUT, RendezvousEnv, Store};
use crate::{DEFAULT_TIMEOUT, Work};

/// Timeouts of an [`NcclGroup`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NcclOptions {
    /// How long a collective (a [`run`](ProcessGroup::run) group) may take, from its
    /// launch to the end of its wait, before the communicator is aborted and the wait
    /// fails. Default: [`DEFAULT_TIMEOUT`] (300 s).
    pub timeout: Duration,
    /// How long creating, splitting or finalizing a communicator may take (every
    /// rank must join). Default: 300 s.
    pub init_timeout: Duration,
    /// How long [`NcclGroup::from_env`] waits for the store and for every rank to
    /// reach it. Default: [`DEFAULT_STORE_TIMEOUT`].
    pub store_timeout: Duration,
}

impl Default for NcclOptions {
    fn default() -> Self {
        NcclOptions {
            timeout: DEFAULT_TIMEOUT,
            init_timeout: Duration::from_secs(300),
            store_timeout: DEFAULT_STORE_TIMEOUT,
        }
    }
}

/// One rank of a group of processes, one GPU each, communicating through NCCL.
///
/// Tensors must live on the group's device ([`ProcessGroup::device`]). A
/// [`run`](ProcessGroup::run) issues its collectives as one `ncclGroupStart/End` on
/// the device's tessera stream (so they are ordered after every earlier tessera
/// operation on the device, and later ones after them — the stream invariant of
/// `tessera_core::cuda`), records an event, and returns a [`Work`] whose wait polls
/// that event together with `ncclCommGetAsyncError` until the event completes, an
/// asynchronous NCCL error appears, or [`NcclOptions::timeout`] passes; on an error or
/// a timeout it aborts the communicator and fails instead of hanging, and every later
/// call on the group fails too.
///
/// All-gathers and broadcasts of FP8, E8M0 and packed FP4 tensors travel as bytes
/// (`ncclUint8`); reductions are typed (f32, bf16, f16, u8, u32, i32, u64, i64) —
/// NCCL 2.28 cannot reduce FP8, so reduce in bf16/f32. The communicator is `Send` but
/// not `Sync`; the group serializes its use behind a mutex, so the group itself may be
/// shared between threads (collectives from several threads must still be issued in
/// the same order on every rank).
pub struct NcclGroup {
    comm: Arc<Mutex<Communicator>>,
    rank: usize,
    size: usize,
    device: Arc<CudaDevice>,
    options: NcclOptions,
    /// The store of [`from_env`](NcclGroup::from_env) (rank 0 hosts its server).
    store: Option<Arc<Store>>,
}

impl NcclGroup {
    /// The group of a torchrun-style job: reads `RANK`, `WORLD_SIZE`, `LOCAL_RANK`,
    /// `MASTER_ADDR`, `MASTER_PORT`, meets the other ranks at the
    /// [`Store`] on `MASTER_ADDR:MASTER_PORT` (rank 0 hosts it), and creates the
    /// communicator on CUDA device `LOCAL_RANK`. Default [`NcclOptions`].
    pub fn from_env() -> Result<NcclGroup> {
        Self::from_env_with(NcclOptions::default())
    }

    /// [`from_env`](NcclGroup::from_env) with explicit options.
    pub fn from_env_with(options: NcclOptions) -> Result<NcclGroup> {
        let env = RendezvousEnv::from_env()?;
        // Fail fast, before waiting for other ranks, when this machine has no NCCL.
        ensure_available()?;
        let store = Arc::new(Store::from_rendezvous(&env, options.store_timeout)?);
        let mut group = NcclGroup::new(&store, env.rank, env.world_size, env.local_rank, options)?;
        group.store = Some(store);
        Ok(group)
    }

    /// Rank `rank` of a group of `size` processes on CUDA device `device_ordinal`,
    /// meeting through `store`: rank 0 creates the NCCL unique id and publishes its 128
    /// bytes under a fresh key ([`Store::next_namespace`]: every rank must create its
    /// groups on a store in the same order); the others read it; all create the
    /// communicator (non-blocking, polled up to [`NcclOptions::init_timeout`]).
    ///
    /// [`Error::CudaUnavailable`] without a CUDA driver, device or NCCL library.
    pub fn new(
        store: &Store,
        rank: usize,
        size: usize,
        device_ordinal: usize,
        options: NcclOptions,
    ) -> Result<NcclGroup> {
        const OP: &str = "NcclGroup::new";
        if size == 0 || rank >= size {
            return Err(Error::invalid(
                OP,
                format!("rank {rank} is not a rank of a group of {size}"),
            ));
        }
        ensure_available()?;
        let device = tessera_core::cuda::device(device_ordinal)?;
        let key = format!("{}/unique_id", store.next_namespace("tessera/nccl"));
        let id = if rank == 0 {
            match UniqueId::new() {
                Ok(id) => {
                    let mut v = vec![0u8];
                    v.extend_from_slice(&id.to_bytes());
                    store.set(&key, &v)?;
                    id
                }
                Err(e) => {
                    // Tell the other ranks instead of letting them time out.
                    let mut v = vec![1u8];
                    v.extend_from_slice(e.to_string().as_bytes());
                    let _ = store.set(&key, &v);
                    return Err(e);
                }
            }
        } else {
            let v = store.get_timeout(&key, options.init_timeout).map_err(|e| {
                Error::state(
                    OP,
                    format!("rank {rank} of {size}: no NCCL unique id from rank 0: {e}"),
                )
            })?;
            match v.split_first() {
                Some((0, id)) => UniqueId::from_bytes(id)?,
                Some((1, msg)) => {
                    return Err(Error::state(
                        OP,
                        format!(
                            "rank 0 could not create the NCCL unique id: {}",
                            String::from_utf8_lossy(msg)
                        ),
                    ));
                }
                _ => {
                    return Err(Error::state(
                        OP,
                        format!("the store's value under `{key}` is not an NCCL unique id"),
                    ));
                }
            }
        };
        let comm = Communicator::init_rank(&id, rank, size, &device, options.init_timeout)?;
        Ok(NcclGroup {
            comm: Arc::new(Mutex::new(comm)),
            rank,
            size,
            device,
            options,
            store: None,
        })
    }

    /// The group's options.
    pub fn options(&self) -> &NcclOptions {
        &self.options
    }

    /// The store this group was created with by [`from_env`](NcclGroup::from_env).
    pub fn store(&self) -> Option<&Arc<Store>> {
        self.store.as_ref()
    }

    /// Aborts the communicator: pending collectives stop and their waits fail, and so
    /// does every later call on this group (other ranks' pending collectives time out
    /// or fail with NCCL's error).
    pub fn abort(&self, reason: &str) {
        self.lock()
            .abort_with(&format!("rank {}: {reason}", self.rank));
    }

    /// Whether the communicator was aborted (after an error or [`abort`](Self::abort)).
    pub fn is_aborted(&self) -> bool {
        self.lock().is_aborted()
    }

    fn lock(&self) -> MutexGuard<'_, Communicator> {
        self.comm.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// One planned NCCL call: raw device addresses, element count and type.
struct Plan {
    kind: Kind,
    send: u64,
    recv: u64,
    count: usize,
    ty: sys::ncclDataType_t,
}

enum Kind {
    AllGather,
    ReduceScatter(sys::ncclRedOp_t),
    AllReduce(sys::ncclRedOp_t),
    Broadcast(c_int),
}

impl Plan {
    /// Issues the call.
    ///
    /// # Safety
    ///
    /// `comm` is a live communicator of the addresses' device, `stream` a stream of
    /// that device, and the addresses point to live allocations of the bytes the
    /// call touches (see [`plan`]), which stay alive until the stream passes it.
    unsafe fn issue(&self, comm: sys::ncclComm_t, stream: sys::cudaStream_t) -> sys::ncclResult_t {
        let send = self.send as *const c_void;
        let recv = self.recv as *mut c_void;
        // SAFETY: forwarded from this function's contract.
        unsafe {
            match self.kind {
                Kind::AllGather => {
                    sys::ncclAllGather(send, recv, self.count, self.ty, comm, stream)
                }
                Kind::ReduceScatter(op) => {
                    sys::ncclReduceScatter(send, recv, self.count, self.ty, op, comm, stream)
                }
                Kind::AllReduce(op) => {
                    sys::ncclAllReduce(send, recv, self.count, self.ty, op, comm, stream)
                }
                Kind::Broadcast(root) => {
                    sys::ncclBroadcast(send, recv, self.count, self.ty, root, comm, stream)
                }
            }
        }
    }
}

/// NCCL's type for the dtypes it knows; FP8, E8M0 and packed FP4 have none here
/// (NCCL 2.28 has FP8 types but cannot reduce them; their gathers travel as bytes).
fn nccl_type(dtype: DType) -> Option<sys::ncclDataType_t> {
    use sys::ncclDataType_t::*;
    Some(match dtype {
        DType::F32 => ncclFloat32,
        DType::BF16 => ncclBfloat16,
        DType::F16 => ncclFloat16,
        DType::U8 => ncclUint8,
        DType::U32 => ncclUint32,
        DType::I32 => ncclInt32,
        DType::U64 => ncclUint64,
        DType::I64 => ncclInt64,
        // FP8, E8M0, packed FP4, and any dtype added later.
        _ => return None,
    })
}

/// Type and element count for a data movement (gather, broadcast): typed when NCCL
/// knows the dtype, bytes otherwise.
fn moved(t: &Tensor) -> (sys::ncclDataType_t, usize) {
    match nccl_type(t.dtype()) {
        Some(ty) => (ty, t.numel()),
        None => (sys::ncclDataType_t::ncclUint8, t.size_in_bytes()),
    }
}

/// Type for a reduction.
fn reduced(op: &'static str, t: &Tensor) -> Result<sys::ncclDataType_t> {
    nccl_type(t.dtype()).ok_or_else(|| {
        Error::dtype(
            op,
            "a dtype NCCL 2.28 can reduce (f32, bf16, f16 or an integer type); reduce FP8 data in bf16 or f32",
            t.dtype(),
        )
    })
}

fn red_op(op: ReduceOp) -> sys::ncclRedOp_t {
    match op {
        ReduceOp::Sum => sys::ncclRedOp_t::ncclSum,
        ReduceOp::Prod => sys::ncclRedOp_t::ncclProd,
        ReduceOp::Max => sys::ncclRedOp_t::ncclMax,
        ReduceOp::Min => sys::ncclRedOp_t::ncclMin,
        ReduceOp::Avg => sys::ncclRedOp_t::ncclAvg,
    }
}

fn read_ptr(t: &Tensor, stream: &CudaStream) -> Result<u64> {
    // Event tracking is off for tessera's contexts, so the guard does nothing.
    let (p, _guard) = t.cuda_slice()?.device_ptr(stream);
    Ok(p)
}

fn write_ptr(t: &mut Tensor, stream: &CudaStream) -> Result<u64> {
    // Copy-on-write: a shared storage is copied first (queued on `stream`), so the
    // collective never writes a buffer another tensor still reads.
    let (p, _guard) = t.cuda_slice_mut()?.device_ptr_mut(stream);
    Ok(p)
}

/// The call for one (checked) collective. The pointers stay valid as long as the
/// collective's tensors live: moving a `Tensor` does not move its device memory.
fn plan(c: &mut Collective, stream: &CudaStream) -> Result<Plan> {
    Ok(match c {
        Collective::AllGather { input, output } => {
            let (ty, count) = moved(input);
            Plan {
                kind: Kind::AllGather,
                send: read_ptr(input, stream)?,
                recv: write_ptr(output, stream)?,
                count,
                ty,
            }
        }
        Collective::ReduceScatter { input, output, op } => Plan {
            kind: Kind::ReduceScatter(red_op(*op)),
            ty: reduced("reduce_scatter", input)?,
            count: output.numel(),
            send: read_ptr(input, stream)?,
            recv: write_ptr(output, stream)?,
        },
        Collective::AllReduce { tensor, op } => {
            let ty = reduced("all_reduce", tensor)?;
            let p = write_ptr(tensor, stream)?;
            Plan {
                kind: Kind::AllReduce(red_op(*op)),
                send: p,
                recv: p,
                count: tensor.numel(),
                ty,
            }
        }
        Collective::Broadcast { tensor, root } => {
            let (ty, count) = moved(tensor);
            let p = write_ptr(tensor, stream)?;
            Plan {
                kind: Kind::Broadcast(
                    c_int::try_from(*root)
                        .map_err(|_| Error::invalid("broadcast", "root too large"))?,
                ),
                send: p,
                recv: p,
                count,
                ty,
            }
        }
    })
}

/// Waits for `event` while polling the communicator for asynchronous errors, up to
/// `timeout`; aborts the communicator on an error or the timeout.
fn wait_for(
    comm: &Mutex<Communicator>,
    event: &CudaEvent,
    timeout: Duration,
    started: Instant,
    what: &str,
) -> Result<()> {
    const OP: &str = "NcclGroup::wait";
    let lock = || comm.lock().unwrap_or_else(|e| e.into_inner());
    let mut polls = 0u32;
    let mut nap = Duration::from_micros(10);
    loop {
        let done = event.try_is_complete();
        let mut c = lock();
        match done {
            Ok(true) => {
                // Surface an asynchronous error that arrived meanwhile (or an abort).
                c.poll(OP).map_err(|e| with_context(e, what))?;
                return Ok(());
            }
            Ok(false) => {}
            Err(e) => {
                let e = Error::Cuda {
                    op: "cuEventQuery",
                    msg: format!("waiting for {what}: {e}"),
                };
                c.abort_with(&e.to_string());
                return Err(e);
            }
        }
        c.poll(OP).map_err(|e| with_context(e, what))?;
        if started.elapsed() >= timeout {
            let msg = format!(
                "rank {} of {}: {what} did not complete within {timeout:?}; aborted the communicator (a peer may have died or issued different collectives)",
                c.rank(),
                c.size()
            );
            c.abort_with(&msg);
            return Err(Error::state(OP, msg));
        }
        drop(c);
        polls += 1;
        if polls < 200 {
            std::thread::yield_now();
        } else {
            std::thread::sleep(nap);
            nap = (nap * 2).min(Duration::from_millis(1));
        }
    }
}

fn with_context(e: Error, what: &str) -> Error {
    match e {
        Error::Cuda { op, msg } => Error::Cuda {
            op,
            msg: format!("{msg} (while waiting for {what})"),
        },
        Error::State { op, msg } => Error::State {
            op,
            msg: format!("{msg} (while waiting for {what})"),
        },
        other => other,
    }
}

impl ProcessGroup for NcclGroup {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn device(&self) -> Device {
        Device::Cuda(self.device.ordinal())
    }

    fn run(&self, mut ops: Vec<Collective>) -> Result<Work<Vec<Tensor>>> {
        const OP: &str = "NcclGroup::run";
        let device = self.device();
        for op in &ops {
            op.check(self.size, device)?;
        }
        self.lock().check_usable(OP)?;
        if ops.is_empty() {
            return Ok(Work::done(Vec::new()));
        }
        let stream = self.device.stream().clone();
        let plans = ops
            .iter_mut()
            .map(|op| plan(op, &stream))
            .collect::<Result<Vec<_>>>()?;
        let inputs: Vec<Tensor> =
            ops.iter()
                .filter_map(|op| match op {
                    Collective::AllGather { input, .. }
                    | Collective::ReduceScatter { input, .. } => Some(input.clone()),
                    _ => None,
                })
                .collect();
        let what = format!(
            "[{}]",
            ops.iter()
                .map(Collective::name)
                .collect::<Vec<_>>()
                .join(", ")
        );
        let started = Instant::now();
        let cu_stream = stream.cu_stream() as sys::cudaStream_t;
        // SAFETY (of both blocks): `plan` took the addresses from live allocations
        // of the group's device (checked by `Collective::check`) sized for the calls
        // (checked shapes and dtypes); `ops` and `inputs` own those allocations and
        // move into the work below, which keeps them until the event recorded after
        // the group has completed (or, if dropped early, frees them in stream order
        // after the group). The stream is the device's tessera stream, and `raw` is
        // the group's live communicator, which `Communicator::group` passes in.
        let issue_all = |raw| {
            plans
                .iter()
                // SAFETY: see above.
                .map(|p| unsafe { p.issue(raw, cu_stream) })
                .collect()
        };
        let event = {
            let mut comm = self.lock();
            // SAFETY: see above.
            unsafe { comm.group(OP, self.options.timeout, issue_all) }?;
            let event = self
                .device
                .context()
                .new_event(None)
                .cuda_op("cuEventCreate")
                .and_then(|e| e.record(&stream).cuda_op("cuEventRecord").map(|()| e));
            match event {
                Ok(e) => e,
                Err(e) => {
                    comm.abort_with(&e.to_string());
                    return Err(e);
                }
            }
        };
        let comm = self.comm.clone();
        let timeout = self.options.timeout;
        Ok(Work::pending(move || {
            let _inputs = inputs;
            wait_for(&comm, &event, timeout, started, &what)?;
            Ok(ops.into_iter().map(Collective::into_output).collect())
        }))
    }

    fn barrier(&self) -> Result<()> {
        let t = Tensor::zeros([1], DType::F32, self.device())?;
        self.all_reduce(t, ReduceOp::Sum)?.into_result().map(drop)
    }

    fn new_subgroup(&self, ranks: &[usize]) -> Result<Option<Arc<dyn ProcessGroup>>> {
        const OP: &str = "NcclGroup::new_subgroup";
        let mut seen = vec![false; self.size];
        for &r in ranks {
            if r >= self.size || std::mem::replace(&mut seen[r], true) {
                return Err(Error::invalid(
                    OP,
                    format!(
                        "ranks {ranks:?} must be distinct ranks of a group of {}",
                        self.size
                    ),
                ));
            }
        }
        if ranks.is_empty() {
            return Err(Error::invalid(OP, "a subgroup needs at least one rank"));
        }
        let position = ranks.iter().position(|&r| r == self.rank);
        let child = self.lock().split(
            position.map(|_| 0),
            position.unwrap_or(0),
            self.options.init_timeout,
        )?;
        match (position, child) {
            (None, None) => Ok(None),
            (Some(p), Some(comm)) => {
                if comm.size() != ranks.len() || comm.rank() != p {
                    return Err(Error::state(
                        OP,
                        format!(
                            "ncclCommSplit made rank {} of {} where rank {p} of {} was expected",
                            comm.rank(),
                            comm.size(),
                            ranks.len()
                        ),
                    ));
                }
                Ok(Some(Arc::new(NcclGroup {
                    comm: Arc::new(Mutex::new(comm)),
                    rank: p,
                    size: ranks.len(),
                    device: self.device.clone(),
                    options: self.options,
                    store: None,
                })))
            }
            (Some(_), None) => Err(Error::state(
                OP,
                "ncclCommSplit returned no communicator for a member of the subgroup",
            )),
            (None, Some(_)) => Err(Error::state(
                OP,
                "ncclCommSplit returned a communicator for a rank outside the subgroup",
            )),
        }
    }
}

impl fmt::Debug for NcclGroup {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NcclGroup")
            .field("rank", &self.rank)
            .field("size", &self.size)
            .field("device", &self.device.ordinal())
            .field("options", &self.options)
            .finish()
    }
}
