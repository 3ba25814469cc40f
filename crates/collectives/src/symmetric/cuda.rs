//! Symmetric memory on GPUs: plain `cuMemAlloc` buffers, reached by the other ranks
//! through CUDA IPC (other processes) or peer access (threads of this process), and
//! the kernels of `kernels/symmetric.cu`.
//!
//! Every rank's buffer has the same layout ([`Layout`]): two input slots (one-shot
//! alternates between them, see the module docs of `symmetric`) and a result chunk
//! (two-shot), each 256-byte aligned.

use std::ffi::{c_char, c_uint};
use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use cudarc::driver::sys::{self, CUdeviceptr, CUresult};
use cudarc::driver::{DevicePtrMut, DeviceRepr, PushKernelArg};
use tessera_core::cuda::{CudaDevice, CudaResultExt, grid_1d};
use tessera_core::kernels::{PtxModule, Sass};
use tessera_core::{DType, Device, Error, Result, Tensor};

use super::host::{dtype_code, dtype_name};
use super::registry;
use super::{MAX_SYMMETRIC_GPU_RANKS, SymmAlgo, chunk_len};
use crate::Work;
use crate::group::{ProcessGroup, ReduceOp};

const OP: &str = "SymmetricAllReduce";

/// The compiled kernels of `kernels/symmetric.cu`.
pub(super) const PTX: PtxModule = PtxModule {
    name: "tessera_collectives_symmetric",
    ptx: include_str!("../../kernels/ptx/symmetric.ptx"),
    sass: Some(Sass {
        cubin: include_bytes!("../../kernels/ptx/symmetric.sm_90.cubin"),
        ptx_sha256: include_str!("../../kernels/ptx/symmetric.sm_90.cubin.sha256"),
    }),
};

/// Threads per block (the kernels' `__launch_bounds__`).
const BLOCK: u32 = 256;

/// Alignment of every region of a buffer.
const ALIGN: usize = 256;

/// Bytes of a CUDA IPC memory handle.
const HANDLE_BYTES: usize = 64;

/// `struct Peers` of symmetric.cu: rank r's address of a region, r < world.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
struct Peers {
    p: [u64; MAX_SYMMETRIC_GPU_RANKS],
}

// SAFETY: a `#[repr(C)]` array of eight u64, laid out exactly as the kernels'
// `struct Peers { u64 p[8]; }`, passed by value; every bit pattern is valid.
unsafe impl DeviceRepr for Peers {}

/// Where the regions of a rank's buffer lie (the same on every rank).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Layout {
    /// Bytes of the tensor.
    nbytes: usize,
    /// Bytes per input slot (two of them, at 0 and `slot`).
    slot: usize,
    /// Offset of the result chunk.
    result: usize,
    /// Elements per two-shot chunk.
    chunk: usize,
    /// Bytes of the whole allocation.
    pub(super) total: usize,
}

impl Layout {
    pub(super) fn new(numel: usize, dtype: DType, size: usize) -> Result<Layout> {
        let es = dtype.size_in_bytes();
        let too_large = || {
            Error::shape(
                OP,
                format!("a symmetric buffer for {numel} elements of {dtype} is too large"),
            )
        };
        let round = |b: usize| b.checked_next_multiple_of(ALIGN).ok_or_else(too_large);
        let nbytes = numel.checked_mul(es).ok_or_else(too_large)?;
        let slot = round(nbytes)?;
        let chunk = chunk_len(numel, size, es);
        let result = slot.checked_mul(2).ok_or_else(too_large)?;
        let total = result
            .checked_add(round(chunk.checked_mul(es).ok_or_else(too_large)?)?)
            .ok_or_else(too_large)?;
        Ok(Layout {
            nbytes,
            slot,
            result,
            chunk,
            total,
        })
    }

    /// The element range of rank `r`'s two-shot chunk of `numel` elements.
    fn chunk_range(&self, r: usize, numel: usize) -> (usize, usize) {
        let b = (r * self.chunk).min(numel);
        (b, (b + self.chunk).min(numel))
    }
}

fn driver(op: &'static str, r: CUresult) -> Result<()> {
    r.result().cuda_op(op)
}

/// A plain `cuMemAlloc` allocation (exportable through IPC, unlike the stream-ordered
/// pool allocations of tessera's tensors). Freed on drop, unless marked leaked.
pub(super) struct DeviceAlloc {
    device: Arc<CudaDevice>,
    ptr: CUdeviceptr,
    bytes: usize,
    /// Set when other processes may still map the allocation: it then lives until the
    /// process ends (freeing it under their mappings is undefined behaviour).
    leak: AtomicBool,
}

impl DeviceAlloc {
    fn new(device: &Arc<CudaDevice>, bytes: usize) -> Result<Self> {
        device
            .context()
            .bind_to_thread()
            .cuda_op("cuCtxSetCurrent")?;
        // SAFETY: the device's context is current on this thread; the memory is only
        // ever used as bytes that are written before they are read.
        let ptr =
            unsafe { cudarc::driver::result::malloc_sync(bytes.max(1)) }.cuda_op("cuMemAlloc")?;
        Ok(DeviceAlloc {
            device: device.clone(),
            ptr,
            bytes,
            leak: AtomicBool::new(false),
        })
    }

    /// The allocation's IPC handle (`cuIpcGetMemHandle`).
    fn ipc_handle(&self) -> Result<[u8; HANDLE_BYTES]> {
        self.device
            .context()
            .bind_to_thread()
            .cuda_op("cuCtxSetCurrent")?;
        let mut h = sys::CUipcMemHandle {
            reserved: [0; HANDLE_BYTES],
        };
        // SAFETY: `ptr` is a live `cuMemAlloc` allocation of the current context and `h`
        // a writable handle.
        driver("cuIpcGetMemHandle", unsafe {
            sys::cuIpcGetMemHandle(&mut h, self.ptr)
        })?;
        Ok(h.reserved.map(|c| c as u8))
    }
}

impl Drop for DeviceAlloc {
    fn drop(&mut self) {
        if self.leak.load(Ordering::Acquire) {
            return;
        }
        let _ = self.device.context().bind_to_thread();
        // SAFETY: allocated by `cuMemAlloc` in this device's (now current) context and
        // freed only here, once. Its users are done: this rank synchronized its stream
        // before dropping its entry; ranks of this process hold an `Arc` of it and
        // synchronize before dropping theirs; ranks of other processes closed their
        // mappings before the barrier of `clear` (otherwise `leak` is set).
        if let Err(e) = unsafe { cudarc::driver::result::free_sync(self.ptr) } {
            tracing::warn!("SymmetricAllReduce: cuMemFree of a symmetric buffer failed: {e}");
        }
    }
}

impl fmt::Debug for DeviceAlloc {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeviceAlloc")
            .field("device", &self.device.ordinal())
            .field("bytes", &self.bytes)
            .finish_non_exhaustive()
    }
}

/// Another process's allocation mapped into this one (`cuIpcOpenMemHandle`); closed on
/// drop.
struct IpcMapping {
    device: Arc<CudaDevice>,
    ptr: CUdeviceptr,
}

impl IpcMapping {
    fn open(device: &Arc<CudaDevice>, handle: &[u8; HANDLE_BYTES]) -> Result<Self> {
        device
            .context()
            .bind_to_thread()
            .cuda_op("cuCtxSetCurrent")?;
        let h = sys::CUipcMemHandle {
            reserved: handle.map(|b| b as c_char),
        };
        let mut ptr: CUdeviceptr = 0;
        let flags = sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as c_uint;
        // SAFETY: the device's context is current; `ptr` is writable; the driver checks
        // the handle (from a peer's `cuIpcGetMemHandle`) and fails on a bad one.
        driver("cuIpcOpenMemHandle", unsafe {
            sys::cuIpcOpenMemHandle_v2(&mut ptr, h, flags)
        })?;
        Ok(IpcMapping {
            device: device.clone(),
            ptr,
        })
    }
}

impl Drop for IpcMapping {
    fn drop(&mut self) {
        let _ = self.device.context().bind_to_thread();
        // SAFETY: `ptr` was returned by `cuIpcOpenMemHandle` in this context and is
        // closed once; this rank's stream was synchronized, so no kernel of it still
        // reads the mapping.
        if let Err(e) = driver("cuIpcCloseMemHandle", unsafe {
            sys::cuIpcCloseMemHandle(self.ptr)
        }) {
            tracing::warn!("SymmetricAllReduce: {e}");
        }
    }
}

/// How this rank reaches a peer's buffer.
enum PeerMem {
    /// This rank's own buffer.
    Own,
    /// A rank of this process: its allocation, kept alive by this rank's `Arc`.
    SameProcess(#[allow(dead_code)] Arc<DeviceAlloc>),
    /// A rank of another process: an IPC mapping.
    Ipc(#[allow(dead_code)] IpcMapping),
}

/// Enables access from `device` to `peer`'s memory (idempotent).
fn enable_peer_access(device: &CudaDevice, peer: &CudaDevice) -> Result<()> {
    if device.ordinal() == peer.ordinal() {
        return Ok(());
    }
    let mut can = 0;
    // SAFETY: two valid device handles of live contexts; `can` is writable.
    driver("cuDeviceCanAccessPeer", unsafe {
        sys::cuDeviceCanAccessPeer(
            &mut can,
            device.context().cu_device(),
            peer.context().cu_device(),
        )
    })?;
    if can == 0 {
        return Err(Error::invalid(
            OP,
            format!(
                "cuda:{} cannot access the memory of cuda:{} (no peer-to-peer path between them), so they cannot share symmetric memory",
                device.ordinal(),
                peer.ordinal()
            ),
        ));
    }
    device
        .context()
        .bind_to_thread()
        .cuda_op("cuCtxSetCurrent")?;
    // SAFETY: this device's context is current; the peer's context is alive (held by
    // its `CudaDevice`, which lives for the process).
    match unsafe { sys::cuCtxEnablePeerAccess(peer.context().cu_ctx(), 0) } {
        CUresult::CUDA_SUCCESS | CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED => Ok(()),
        e => driver("cuCtxEnablePeerAccess", e),
    }
}

/// A rank's own allocation, detached from its entry by `clear`: dropping it frees the
/// memory (once no rank of this process holds it).
pub(super) struct OwnBuffer {
    alloc: Arc<DeviceAlloc>,
    exported: bool,
}

impl OwnBuffer {
    /// Drops the allocation, but keeps the memory to the end of the process when ranks
    /// of other processes may still map it.
    pub(super) fn leak_if_exported(self) {
        if self.exported {
            self.alloc.leak.store(true, Ordering::Release);
            tracing::warn!(
                "SymmetricAllReduce: a symmetric buffer of {} bytes on cuda:{} stays allocated until the process ends: other processes may still map it (call clear() on every rank to free it)",
                self.alloc.bytes,
                self.alloc.device.ordinal()
            );
        }
    }
}

/// The row every rank contributes when a buffer is created.
const ROW_MAGIC: u64 = 0x5453_594D_4D52_0001; // "TSYMMR" v1
const ROW_WORDS: usize = 9;
const ROW_BYTES: usize = ROW_WORDS * 8 + HANDLE_BYTES;

struct Row {
    process: u64,
    host: u64,
    ordinal: usize,
    base: u64,
    id: u64,
    numel: u64,
    dtype: u64,
    total: u64,
    handle: [u8; HANDLE_BYTES],
}

impl Row {
    fn to_bytes(&self) -> Vec<u8> {
        let words = [
            ROW_MAGIC,
            self.process,
            self.host,
            self.ordinal as u64,
            self.base,
            self.id,
            self.numel,
            self.dtype,
            self.total,
        ];
        let mut v: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
        v.extend_from_slice(&self.handle);
        v
    }

    fn parse(b: &[u8], rank: usize) -> Result<Row> {
        let word =
            |i: usize| u64::from_le_bytes(b[i * 8..i * 8 + 8].try_into().unwrap_or_default());
        if b.len() != ROW_BYTES || word(0) != ROW_MAGIC {
            return Err(Error::state(
                OP,
                format!("rank {rank} sent a malformed symmetric-buffer description"),
            ));
        }
        let mut handle = [0u8; HANDLE_BYTES];
        handle.copy_from_slice(&b[ROW_WORDS * 8..]);
        Ok(Row {
            process: word(1),
            host: word(2),
            ordinal: word(3) as usize,
            base: word(4),
            id: word(5),
            numel: word(6),
            dtype: word(7),
            total: word(8),
            handle,
        })
    }
}

/// A rank's cache entry for one GPU buffer.
pub(super) struct CudaEntry {
    device: Arc<CudaDevice>,
    rank: usize,
    size: usize,
    numel: usize,
    dtype: DType,
    layout: Layout,
    own: Option<Arc<DeviceAlloc>>,
    peers: Vec<PeerMem>,
    /// Every rank's buffer as this device addresses it.
    bases: Peers,
    /// Whether ranks of other processes map this rank's buffer.
    exported: bool,
    /// Calls so far (one-shot alternates its input slot with the parity).
    calls: u64,
}

impl fmt::Debug for CudaEntry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaEntry")
            .field("device", &self.device.ordinal())
            .field("rank", &self.rank)
            .field("size", &self.size)
            .field("numel", &self.numel)
            .field("dtype", &self.dtype)
            .field("layout", &self.layout)
            .finish_non_exhaustive()
    }
}

/// Checks the ranks' rows and reaches every peer's buffer: directly (a rank of this
/// process, with peer access enabled) or through its IPC handle (another process).
fn reach_peers(
    device: &Arc<CudaDevice>,
    rank: usize,
    rows: &[Row],
    mine: &Row,
    process: u64,
) -> Result<(Vec<PeerMem>, Peers)> {
    for (s, r) in rows.iter().enumerate() {
        if r.host != 0 && mine.host != 0 && r.host != mine.host {
            return Err(Error::invalid(
                OP,
                format!(
                    "symmetric memory needs every rank of the group on one host; rank {s} is on another host than rank {rank}"
                ),
            ));
        }
        if (r.numel, r.dtype, r.total) != (mine.numel, mine.dtype, mine.total) {
            return Err(Error::shape(
                OP,
                format!(
                    "ranks disagree on the symmetric buffer: rank {rank} asks for {} elements of {}, rank {s} for {} elements of {}",
                    mine.numel,
                    dtype_name(mine.dtype),
                    r.numel,
                    dtype_name(r.dtype)
                ),
            ));
        }
    }
    let mut peers = Vec::with_capacity(rows.len());
    let mut bases = Peers::default();
    for (s, r) in rows.iter().enumerate() {
        if s == rank {
            peers.push(PeerMem::Own);
            bases.p[s] = mine.base;
        } else if r.process == process {
            let alloc = registry::lookup::<DeviceAlloc>(r.id).ok_or_else(|| {
                Error::state(
                    OP,
                    format!(
                        "rank {rank}: rank {s}'s symmetric buffer (id {}) is gone before this rank attached",
                        r.id
                    ),
                )
            })?;
            let peer = tessera_core::cuda::device(r.ordinal)?;
            enable_peer_access(device, &peer)?;
            bases.p[s] = alloc.ptr;
            peers.push(PeerMem::SameProcess(alloc));
        } else {
            let m = IpcMapping::open(device, &r.handle).map_err(|e| Error::Cuda {
                op: "cuIpcOpenMemHandle",
                msg: format!(
                    "rank {rank} (cuda:{}) mapping rank {s}'s buffer (cuda:{} of another process): {e}",
                    mine.ordinal, r.ordinal
                ),
            })?;
            bases.p[s] = m.ptr;
            peers.push(PeerMem::Ipc(m));
        }
    }
    Ok((peers, bases))
}

impl CudaEntry {
    /// Creates the group's buffers for `numel` elements of `dtype` (collective).
    ///
    /// Every rank allocates its buffer (`cuMemAlloc`), takes its IPC handle, publishes
    /// it in the process registry, and all-gathers a row: process and host tokens,
    /// device, address, registry id, numel, dtype, size, IPC handle. Then each rank
    /// reaches every peer: directly (same process, peer access enabled) or by opening
    /// its IPC handle (another process on this host). An all-gather of every rank's
    /// success ends it: all ranks fail together, and no publication is withdrawn
    /// before everyone took it.
    pub(super) fn attach(group: &dyn ProcessGroup, numel: usize, dtype: DType) -> Result<Self> {
        let (rank, size) = (group.rank(), group.size());
        let Device::Cuda(ordinal) = group.device() else {
            return Err(Error::state(OP, "internal: a host group on the GPU path"));
        };
        let device = tessera_core::cuda::device(ordinal)?;
        let layout = Layout::new(numel, dtype, size)?;
        let own = Arc::new(DeviceAlloc::new(&device, layout.total)?);
        let handle = own.ipc_handle()?;
        let published = registry::publish(&own);
        let process = registry::process_token();
        let host = registry::host_token();
        let mine = Row {
            process,
            host,
            ordinal,
            base: own.ptr,
            id: published.id(),
            numel: numel as u64,
            dtype: dtype_code(dtype),
            total: layout.total as u64,
            handle,
        };
        let row = Tensor::from_bytes(&mine.to_bytes(), [ROW_BYTES], DType::U8, group.device())?;
        let all = group.all_gather(&row)?.into_result()?.to_bytes()?;
        let rows = all
            .chunks(ROW_BYTES)
            .enumerate()
            .map(|(s, b)| Row::parse(b, s))
            .collect::<Result<Vec<_>>>()?;
        if rows.len() != size {
            return Err(Error::state(
                OP,
                format!("expected {size} buffer descriptions, got {}", rows.len()),
            ));
        }
        // Ranks of other processes may map this rank's buffer from here on: if
        // anything fails, the buffer is left allocated rather than freed under them.
        let exported = rows.iter().any(|r| r.process != process);
        let reached = reach_peers(&device, rank, &rows, &mine, process);
        // Every rank says whether it reached all the others, so that all fail together
        // (instead of some waiting forever for the others) — and, like a barrier, this
        // keeps every publication alive until everyone has taken what it needs.
        let status = Tensor::from_slice(&[u8::from(reached.is_err())], [1], group.device())?;
        let failed: Vec<usize> = group
            .all_gather(&status)
            .and_then(Work::into_result)
            .and_then(|t| t.to_bytes())
            .inspect_err(|_| own.leak.store(exported, Ordering::Release))?
            .iter()
            .enumerate()
            .filter_map(|(s, &f)| (f != 0).then_some(s))
            .collect();
        drop(published);
        let (peers, bases) = match reached {
            Ok(p) if failed.is_empty() => p,
            Ok(_) => {
                own.leak.store(exported, Ordering::Release);
                return Err(Error::state(
                    OP,
                    format!(
                        "rank(s) {failed:?} could not reach the other ranks' symmetric buffers (see their errors)"
                    ),
                ));
            }
            Err(e) => {
                own.leak.store(exported, Ordering::Release);
                return Err(e);
            }
        };
        Ok(CudaEntry {
            device,
            rank,
            size,
            numel,
            dtype,
            layout,
            own: Some(own),
            peers,
            bases,
            exported,
            calls: 0,
        })
    }

    /// Every rank's region at `offset` of its buffer.
    fn regions(&self, offset: usize) -> Peers {
        let mut p = Peers::default();
        for r in 0..self.size {
            p.p[r] = self.bases.p[r] + offset as u64;
        }
        p
    }

    /// Waits until this rank's queued work is done, then until every rank's is.
    fn barrier(&self, group: &dyn ProcessGroup) -> Result<()> {
        if self.size > 1 {
            self.device.synchronize()?;
            group.barrier()?;
        }
        Ok(())
    }

    /// One all-reduce (see the module docs of `symmetric` for the phases).
    pub(super) fn all_reduce(
        &mut self,
        group: &dyn ProcessGroup,
        mut tensor: Tensor,
        op: ReduceOp,
        algo: SymmAlgo,
    ) -> Result<Work<Tensor>> {
        let stream = self.device.stream().clone();
        self.device
            .context()
            .bind_to_thread()
            .cuda_op("cuCtxSetCurrent")?;
        let slot = (self.calls % 2) as usize * self.layout.slot;
        self.calls += 1;
        let own = self.bases.p[self.rank];
        // The output (a shared storage is copied first, on the stream), which holds
        // this rank's contribution until the kernel overwrites it.
        let out = {
            let (p, _guard) = tensor.cuda_slice_mut()?.device_ptr_mut(&stream);
            p
        };
        // SAFETY: `own + slot` is this rank's input slot (`Layout`: at least `nbytes`
        // bytes), `out` the tensor's `nbytes` bytes; both on this device, copied on the
        // tessera stream after every earlier use of the slot (double buffering and the
        // barriers, see the module docs).
        unsafe {
            cudarc::driver::result::memcpy_dtod_async(
                own + slot as u64,
                out,
                self.layout.nbytes,
                stream.cu_stream(),
            )
        }
        .cuda_op("cuMemcpyDtoDAsync")?;
        let inputs = self.regions(slot);
        // SAFETY (of the launches): for r < size, `inputs.p[r]` is rank r's input
        // slot of this call (at least `numel` elements, `Layout`), reachable from
        // this device (own memory, peer access or an IPC mapping), and written by
        // rank r before the barrier that precedes the launch; no rank rewrites it
        // before this kernel finishes (double buffering: a rank's next write to it
        // comes two calls later, after a barrier this rank enters only once its
        // stream, and so this kernel, is done). `out` is the tensor's `numel`
        // elements, `result` this rank's result chunk (`Layout::chunk` elements),
        // and `results.p[s]` rank s's, written before the second barrier and
        // rewritten only after the next call's first barrier.
        match algo {
            SymmAlgo::OneShot => {
                self.barrier(group)?;
                // SAFETY: see above.
                unsafe {
                    launch_reduce(
                        &self.device,
                        self.dtype,
                        self.size,
                        &inputs,
                        out,
                        0,
                        self.numel,
                        op,
                    )
                }?;
            }
            SymmAlgo::TwoShot => {
                self.barrier(group)?;
                let (b, e) = self.layout.chunk_range(self.rank, self.numel);
                let result = own + self.layout.result as u64;
                // SAFETY: see above.
                unsafe {
                    launch_reduce(
                        &self.device,
                        self.dtype,
                        self.size,
                        &inputs,
                        result,
                        b,
                        e - b,
                        op,
                    )
                }?;
                self.barrier(group)?;
                let results = self.regions(self.layout.result);
                let chunk_bytes = self.layout.chunk * self.dtype.size_in_bytes();
                // SAFETY: see above.
                unsafe {
                    launch_gather(
                        &self.device,
                        self.size,
                        &results,
                        out,
                        chunk_bytes,
                        self.layout.nbytes,
                    )
                }?;
            }
            SymmAlgo::Multimem => {
                return Err(Error::state(OP, "internal: multimem reached the GPU path"));
            }
        }
        let event = self
            .device
            .context()
            .new_event(None)
            .cuda_op("cuEventCreate")?;
        event.record(&stream).cuda_op("cuEventRecord")?;
        Ok(Work::pending(move || {
            event.synchronize().cuda_op("cuEventSynchronize")?;
            Ok(tensor)
        }))
    }

    /// `clear`'s first half: waits for this rank's kernels, closes its mappings of the
    /// peers' buffers and returns its own, to be dropped after the group's barrier.
    pub(super) fn release_peers(mut self) -> Result<OwnBuffer> {
        let synced = self.device.synchronize();
        self.peers.clear();
        let alloc = self
            .own
            .take()
            .ok_or_else(|| Error::state(OP, "internal: the buffer was released twice"))?;
        let own = OwnBuffer {
            alloc,
            exported: self.exported,
        };
        match synced {
            Ok(()) => Ok(own),
            Err(e) => {
                own.leak_if_exported();
                Err(e)
            }
        }
    }
}

impl Drop for CudaEntry {
    fn drop(&mut self) {
        if let Err(e) = self.device.synchronize() {
            tracing::warn!("SymmetricAllReduce: synchronizing before freeing: {e}");
        }
        self.peers.clear();
        if let Some(alloc) = self.own.take() {
            OwnBuffer {
                alloc,
                exported: self.exported,
            }
            .leak_if_exported();
        }
    }
}

/// Queues `out[j] = reduce over r < world of src.p[r][begin + j]`, `j < count`, on the
/// device's tessera stream (`tessera_symm_reduce_<dtype>`).
///
/// # Safety
///
/// For every `r < world`, `src.p[r]` addresses memory this device can read holding at
/// least `begin + count` elements of `dtype`, and `out` memory it can write holding
/// `count` of them, not overlapping the sources; they stay valid, and the sources
/// unchanged, until the kernel has finished on the stream.
#[allow(clippy::too_many_arguments)]
unsafe fn launch_reduce(
    device: &CudaDevice,
    dtype: DType,
    world: usize,
    src: &Peers,
    out: u64,
    begin: usize,
    count: usize,
    op: ReduceOp,
) -> Result<()> {
    if count == 0 {
        return Ok(());
    }
    if world == 0 || world > MAX_SYMMETRIC_GPU_RANKS {
        return Err(Error::state(OP, format!("internal: {world} ranks")));
    }
    let name = match dtype {
        DType::F32 => "tessera_symm_reduce_f32",
        DType::BF16 => "tessera_symm_reduce_bf16",
        DType::F16 => "tessera_symm_reduce_f16",
        DType::U8 => "tessera_symm_reduce_u8",
        DType::U32 => "tessera_symm_reduce_u32",
        DType::I32 => "tessera_symm_reduce_i32",
        DType::U64 => "tessera_symm_reduce_u64",
        DType::I64 => "tessera_symm_reduce_i64",
        other => return Err(Error::dtype(OP, "f32, bf16, f16 or an integer type", other)),
    };
    let f = device.function(&PTX, name)?;
    let per_pack = 16 / dtype.size_in_bytes();
    let cfg = grid_1d(device, count.div_ceil(per_pack), BLOCK)?;
    let (begin, count) = (begin as u64, count as u64);
    let world = world as i32;
    let code = op_code(op);
    let mut b = device.stream().launch_builder(&f);
    b.arg(src)
        .arg(&out)
        .arg(&begin)
        .arg(&count)
        .arg(&world)
        .arg(&code);
    // SAFETY: the kernel's parameters are (Peers src, u64 out, u64 begin, u64 count,
    // int world, int op), pushed in that order; the addresses are valid for the
    // elements the kernel touches (this function's contract).
    unsafe { b.launch(cfg) }.cuda_op("cuLaunchKernel")?;
    Ok(())
}

/// Queues `out[s · chunk_bytes + j] = src.p[s][j]` for every byte below `total_bytes`
/// on the device's tessera stream (`tessera_symm_gather`).
///
/// # Safety
///
/// For every `s < world`, `src.p[s]` addresses memory this device can read holding the
/// bytes of chunk `s` that lie below `total_bytes` (at most `chunk_bytes`), and `out`
/// memory it can write holding `total_bytes`, not overlapping the sources; they stay
/// valid, and the sources unchanged, until the kernel has finished on the stream.
unsafe fn launch_gather(
    device: &CudaDevice,
    world: usize,
    src: &Peers,
    out: u64,
    chunk_bytes: usize,
    total_bytes: usize,
) -> Result<()> {
    if total_bytes == 0 {
        return Ok(());
    }
    if world == 0 || world > MAX_SYMMETRIC_GPU_RANKS || chunk_bytes * world < total_bytes {
        return Err(Error::state(
            OP,
            format!("internal: {world} chunks of {chunk_bytes} bytes cannot hold {total_bytes}"),
        ));
    }
    let f = device.function(&PTX, "tessera_symm_gather")?;
    let cfg = grid_1d(device, total_bytes.div_ceil(16), BLOCK)?;
    let (chunk_bytes, total) = (chunk_bytes as u64, total_bytes as u64);
    let world = world as i32;
    let mut b = device.stream().launch_builder(&f);
    b.arg(src)
        .arg(&out)
        .arg(&chunk_bytes)
        .arg(&total)
        .arg(&world);
    // SAFETY: the kernel's parameters are (Peers src, u64 out, u64 chunk_bytes,
    // u64 total_bytes, int world), pushed in that order; the addresses are valid for the
    // bytes the kernel touches (this function's contract).
    unsafe { b.launch(cfg) }.cuda_op("cuLaunchKernel")?;
    Ok(())
}

/// The kernels' code of a reduction.
fn op_code(op: ReduceOp) -> i32 {
    match op {
        ReduceOp::Sum => 0,
        ReduceOp::Prod => 1,
        ReduceOp::Max => 2,
        ReduceOp::Min => 3,
        ReduceOp::Avg => 4,
    }
}

#[cfg(test)]
mod tests {
    //! The kernels against the ThreadGroup on one GPU, with several buffers of one
    //! device standing in for the ranks, and IPC between two processes on one GPU.
    //! GPU tests: `cargo xtask test-gpu`.

    use super::*;
    use crate::run_ranks;
    use cudarc::driver::DevicePtr;
    use tessera_rng::Generator;

    const GPU: Device = Device::Cuda(0);

    /// The embedded cubin was compiled from the PTX embedded beside it.
    #[test]
    fn embedded_sass_is_fresh() {
        PTX.check_sass_fresh().unwrap();
    }

    fn require_gpu() -> Arc<CudaDevice> {
        assert!(
            tessera_core::cuda::is_available(),
            "these tests need a CUDA GPU; run them with `cargo xtask test-gpu`"
        );
        tessera_core::cuda::device(0).unwrap()
    }

    /// Rank `rank`'s contribution: normal values of mixed magnitudes (finite), as
    /// `dtype`; integers are wide so that sums and products wrap.
    fn host_input(numel: usize, dtype: DType, rank: usize, seed: u64) -> Tensor {
        let mut v = vec![0f32; numel];
        Generator::new(seed * 131 + rank as u64).fill_normal(&mut v, 0.0, 1.0);
        let v: Vec<f32> = v
            .iter()
            .enumerate()
            .map(|(i, x)| x * 2f32.powi((i % 13) as i32 - 6))
            .collect();
        let d = [numel];
        match dtype {
            DType::F32 | DType::BF16 | DType::F16 => {
                Tensor::from_f32_values(&v, d, dtype, Device::Cpu)
            }
            DType::U8 => Tensor::from_slice(
                &v.iter()
                    .map(|&x| (x * 1e3) as i64 as u8)
                    .collect::<Vec<_>>(),
                d,
                Device::Cpu,
            ),
            DType::U32 => Tensor::from_slice(
                &v.iter()
                    .map(|&x| (x * 1e9) as i64 as u32)
                    .collect::<Vec<_>>(),
                d,
                Device::Cpu,
            ),
            DType::I32 => Tensor::from_slice(
                &v.iter().map(|&x| (x * 1e9) as i32).collect::<Vec<_>>(),
                d,
                Device::Cpu,
            ),
            DType::U64 => Tensor::from_slice(
                &v.iter()
                    .map(|&x| (x * 1e18) as i64 as u64)
                    .collect::<Vec<_>>(),
                d,
                Device::Cpu,
            ),
            DType::I64 => Tensor::from_slice(
                &v.iter().map(|&x| (x * 1e18) as i64).collect::<Vec<_>>(),
                d,
                Device::Cpu,
            ),
            other => panic!("no test data for {other}"),
        }
        .unwrap()
    }

    fn ops(dtype: DType) -> Vec<ReduceOp> {
        let mut v = vec![ReduceOp::Sum, ReduceOp::Prod, ReduceOp::Max, ReduceOp::Min];
        if dtype.is_high_precision_float() {
            v.push(ReduceOp::Avg);
        }
        v
    }

    fn ptr(t: &Tensor) -> u64 {
        let stream = t.cuda_device().unwrap().stream().clone();
        let (p, _g) = t.cuda_slice().unwrap().device_ptr(&stream);
        p
    }

    const DTYPES: [DType; 8] = [
        DType::F32,
        DType::BF16,
        DType::F16,
        DType::U8,
        DType::U32,
        DType::I32,
        DType::U64,
        DType::I64,
    ];

    #[test]
    #[ignore = "needs a CUDA GPU: cargo xtask test-gpu"]
    fn kernels_reduce_like_the_thread_group_for_one_to_eight_ranks() {
        let dev = require_gpu();
        for world in 1..=MAX_SYMMETRIC_GPU_RANKS {
            for dtype in DTYPES {
                for numel in [1usize, 7, 8, 33, 1000, 4099] {
                    let inputs: Vec<Tensor> = (0..world)
                        .map(|r| host_input(numel, dtype, r, numel as u64))
                        .collect();
                    let on_gpu: Vec<Tensor> =
                        inputs.iter().map(|t| t.to_device(GPU).unwrap()).collect();
                    let mut src = Peers::default();
                    for (r, t) in on_gpu.iter().enumerate() {
                        src.p[r] = ptr(t);
                    }
                    let layout = Layout::new(numel, dtype, world).unwrap();
                    let es = dtype.size_in_bytes();
                    for op in ops(dtype) {
                        let want = run_ranks(world, |g| {
                            g.all_reduce(inputs[g.rank()].clone(), op)
                                .unwrap()
                                .into_result()
                                .unwrap()
                                .to_bytes()
                                .unwrap()
                        })
                        .unwrap();
                        let what = format!("{world} ranks, {numel} {dtype}, {op:?}");
                        // One-shot.
                        let out = Tensor::filled_with_byte([numel], dtype, GPU, 0xA5).unwrap();
                        // SAFETY: `src` holds `world` live tensors of `numel` elements,
                        // `out` another one; all stay alive until the synchronization
                        // in `to_bytes`.
                        unsafe { launch_reduce(&dev, dtype, world, &src, ptr(&out), 0, numel, op) }
                            .unwrap();
                        assert_eq!(out.to_bytes().unwrap(), want[0], "one-shot, {what}");
                        // Two-shot: each virtual rank reduces its chunk, then gathers.
                        let chunk_bytes = layout.chunk * es;
                        let results: Vec<Tensor> = (0..world)
                            .map(|_| {
                                Tensor::filled_with_byte([chunk_bytes], DType::U8, GPU, 0x5A)
                                    .unwrap()
                            })
                            .collect();
                        let mut res = Peers::default();
                        for (r, t) in results.iter().enumerate() {
                            res.p[r] = ptr(t);
                            let (b, e) = layout.chunk_range(r, numel);
                            // SAFETY: as above; the result tensor holds a whole chunk.
                            unsafe {
                                launch_reduce(&dev, dtype, world, &src, ptr(t), b, e - b, op)
                            }
                            .unwrap();
                        }
                        for (r, w) in want.iter().enumerate() {
                            let out = Tensor::filled_with_byte([numel], dtype, GPU, 0xC3).unwrap();
                            // SAFETY: `res` holds `world` chunks of `chunk_bytes`, `out`
                            // the tensor's bytes; all alive until `to_bytes`.
                            unsafe {
                                launch_gather(&dev, world, &res, ptr(&out), chunk_bytes, numel * es)
                            }
                            .unwrap();
                            assert_eq!(&out.to_bytes().unwrap(), w, "two-shot rank {r}, {what}");
                        }
                    }
                }
            }
        }
    }

    #[test]
    #[ignore = "needs a CUDA GPU: cargo xtask test-gpu"]
    fn nan_and_infinity_follow_the_thread_group() {
        let dev = require_gpu();
        let specials = [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 1.0, -2.5, 0.0];
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            let a: Vec<f32> = specials.iter().flat_map(|&x| specials.map(|_| x)).collect();
            let b: Vec<f32> = specials.iter().flat_map(|_| specials).collect();
            let host =
                |v: &[f32]| Tensor::from_f32_values(v, [v.len()], dtype, Device::Cpu).unwrap();
            let inputs = [host(&a), host(&b)];
            let gpu: Vec<Tensor> = inputs.iter().map(|t| t.to_device(GPU).unwrap()).collect();
            let mut src = Peers::default();
            src.p[0] = ptr(&gpu[0]);
            src.p[1] = ptr(&gpu[1]);
            for op in ops(dtype) {
                let want = run_ranks(2, |g| {
                    g.all_reduce(inputs[g.rank()].clone(), op)
                        .unwrap()
                        .into_result()
                        .unwrap()
                })
                .unwrap();
                let out = Tensor::zeros([a.len()], dtype, GPU).unwrap();
                // SAFETY: two live input tensors and an output of the same length, alive
                // until the synchronization in `to_device`.
                unsafe { launch_reduce(&dev, dtype, 2, &src, ptr(&out), 0, a.len(), op) }.unwrap();
                let got = out.to_f32_vec().unwrap();
                for (i, (g, w)) in got.iter().zip(&want[0].to_f32_vec().unwrap()).enumerate() {
                    let same = (g.is_nan() && w.is_nan()) || g.to_bits() == w.to_bits();
                    assert!(
                        same,
                        "{dtype} {op:?} #{i} ({} ? {}): got {g}, want {w}",
                        a[i], b[i]
                    );
                }
            }
        }
    }

    const IPC_ENV: &str = "TESSERA_SYMMETRIC_IPC_HANDLE";
    const IPC_BYTES: usize = 4096;

    fn pattern() -> Vec<u8> {
        (0..IPC_BYTES).map(|i| (i * 7 % 251) as u8).collect()
    }

    /// The child half of `an_ipc_handle_opens_in_another_process`: does nothing unless
    /// that test started this process.
    #[test]
    #[ignore = "needs a CUDA GPU: cargo xtask test-gpu"]
    fn ipc_child_maps_reads_and_writes() {
        let Ok(hex) = std::env::var(IPC_ENV) else {
            return;
        };
        let dev = require_gpu();
        let bytes: Vec<u8> = (0..hex.len() / 2)
            .map(|i| u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).unwrap())
            .collect();
        let handle: [u8; HANDLE_BYTES] = bytes.try_into().unwrap();
        let m = IpcMapping::open(&dev, &handle).unwrap();
        let mut seen = vec![0u8; IPC_BYTES];
        // SAFETY: the mapping holds the parent's IPC_BYTES-byte allocation, alive until
        // this process exits (the parent waits for it); the copies are synchronous.
        unsafe { cudarc::driver::result::memcpy_dtoh_sync(&mut seen, m.ptr) }.unwrap();
        assert_eq!(seen, pattern(), "the child reads the parent's bytes");
        let inverted: Vec<u8> = seen.iter().map(|b| !b).collect();
        // SAFETY: as above.
        unsafe { cudarc::driver::result::memcpy_htod_sync(m.ptr, &inverted) }.unwrap();
        drop(m);
    }

    #[test]
    #[ignore = "needs a CUDA GPU: cargo xtask test-gpu"]
    fn an_ipc_handle_opens_in_another_process() {
        let dev = require_gpu();
        let alloc = DeviceAlloc::new(&dev, IPC_BYTES).unwrap();
        // SAFETY: a live allocation of IPC_BYTES bytes; synchronous copy.
        unsafe { cudarc::driver::result::memcpy_htod_sync(alloc.ptr, &pattern()) }.unwrap();
        let handle = alloc.ipc_handle().unwrap();
        let hex: String = handle.iter().map(|b| format!("{b:02x}")).collect();
        let status = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--ignored",
                "--exact",
                "symmetric::cuda::tests::ipc_child_maps_reads_and_writes",
                "--test-threads=1",
            ])
            .env(IPC_ENV, hex)
            .status()
            .unwrap();
        assert!(status.success(), "the child process failed: {status}");
        let mut back = vec![0u8; IPC_BYTES];
        // SAFETY: as above.
        unsafe { cudarc::driver::result::memcpy_dtoh_sync(&mut back, alloc.ptr) }.unwrap();
        let want: Vec<u8> = pattern().iter().map(|b| !b).collect();
        assert_eq!(back, want, "the child wrote through its mapping");
        // A plain cuMemAlloc allocation exports; a pool allocation (a tensor's) does not.
        let t = Tensor::zeros([64], DType::U8, GPU).unwrap();
        let mut h = sys::CUipcMemHandle {
            reserved: [0; HANDLE_BYTES],
        };
        // SAFETY: `h` is writable; the pointer is a live (pool) allocation.
        let r = unsafe { sys::cuIpcGetMemHandle(&mut h, ptr(&t)) };
        assert_ne!(
            r,
            CUresult::CUDA_SUCCESS,
            "pool allocations are not exportable"
        );
    }
}
