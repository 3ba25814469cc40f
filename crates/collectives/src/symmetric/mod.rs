//! Symmetric-memory all-reduce: TransformerEngine's `symmetric_all_reduce`, one-shot
//! and two-shot, over buffers every rank of a single-host group can read.
//!
//! A [`SymmetricAllReduce`] belongs to one group and caches one symmetric buffer per
//! `(numel, dtype)` — TE's cache key (numel, dtype, device, group), with the group and
//! device fixed by the object. The first call for a new `(numel, dtype)` creates the
//! buffer collectively (every rank allocates, the ranks exchange what the others need
//! to reach it, a barrier); later calls reuse it, whatever the shape, as long as the
//! element count and dtype are the same. A call:
//!
//! 1. copies this rank's tensor into its own slot of the buffer;
//! 2. **one-shot**: every rank reads every rank's slot and reduces them all in rank
//!    order into its output — one step, `size`× the data read per rank, lowest
//!    latency for small tensors;
//!    **two-shot**: rank `r` reduces chunk `r` of all slots (a reduce-scatter) into a
//!    result chunk the others can read, then every rank copies every rank's result
//!    chunk (an all-gather) — each rank reads 2× the data whatever the world size,
//!    better for large tensors.
//!
//! The result is written into the tensor (copy-on-write, like every in-place
//! collective here) and handed back by the [`Work`] handle.
//!
//! # Results
//!
//! Both algorithms reduce exactly as the group's ordinary all-reduce does on the
//! [`ThreadGroup`](crate::ThreadGroup): contributions in rank order, each step rounded
//! to the dtype (bf16/f16 go through f32 and back after every addition), `Avg` divides
//! at the end, integers wrap. So results are bit for bit those of
//! `group.all_reduce(tensor, op)` on a ThreadGroup, and the CUDA kernels reproduce the
//! same bits (except the payload of a NaN produced by a sum or product, and the sign
//! of Max/Min of +0 and −0, on which x86 and the GPU differ). Reductions are those of [`ReduceOp`] for f32, bf16, f16 and the integer types
//! (not `Avg` for integers); FP8, E8M0 and packed FP4 are refused with
//! [`Error::DType`].
//!
//! # Backends
//!
//! - **Host tensors** (a group on [`Device::Cpu`], such as a
//!   [`ThreadGroup`](crate::ThreadGroup) or its subgroups): the ranks are threads of
//!   this process, so the buffer is ordinary memory that every rank holds an `Arc` of.
//!   A group moves bytes, not objects, so the buffer is handed over through a
//!   process-global registry: rank 0 publishes it under a fresh id and the id travels
//!   through the group (threads share the address space; a rank in another process is
//!   a typed error). Calls are genuinely asynchronous: the call deposits the
//!   contribution; the reduction runs in the handle's wait. Each call is numbered, and
//!   every rank's progress through deposit, reduce and read of each call is tracked, so
//!   a slot is rewritten only after every rank has read it; waits fail after
//!   [`SymmetricOptions::timeout`], or at once when a rank they wait for has dropped its
//!   buffers, instead of hanging.
//! - **CUDA tensors** (feature `cuda`, e.g. an `NcclGroup` with one
//!   GPU per rank on one host): each rank allocates its buffer with the driver's plain
//!   `cuMemAlloc` — allocations from a stream-ordered memory pool, which is what
//!   tessera's tensors use, cannot be exported with `cuIpcGetMemHandle` — and the
//!   ranks exchange, through the group, their process, host, device, address and
//!   64-byte IPC handle. A peer in another process is mapped with
//!   `cuIpcOpenMemHandle` (lazy peer access); a peer that is a thread of this process
//!   is addressed directly, with peer access enabled between the two devices (CUDA
//!   cannot open an IPC handle in the process that made it). Kernels
//!   (`kernels/symmetric.cu`) then read the peers' buffers directly.
//!
//! # Synchronisation between ranks on GPUs, and its cost
//!
//! Phases are separated by host barriers: before a rank's kernel reads the other
//! ranks' buffers, every rank synchronizes its stream (its copy into the buffer is
//! done) and the group runs a barrier (for an `NcclGroup`, a one-element NCCL
//! all-reduce). One-shot has one barrier per call and double-buffers its input slots,
//! so a rank's next copy can never overwrite a slot a slower rank is still reading (that
//! rank's kernel finished before it entered this call's barrier); two-shot has two
//! (before the reduce-scatter kernel and before the all-gather kernel). A barrier costs
//! a stream synchronization and a round trip through the group, tens of microseconds —
//! as much as the NCCL all-reduce this replaces for small tensors, so on GPUs this is
//! a correct implementation of the algorithms and of their memory plumbing (IPC,
//! peer access, caching), not yet a latency win. Stream-ordered flags in the symmetric buffers
//! (write data, `__threadfence_system`, raise a flag; spin on the peers' flags with a
//! bounded counter) would remove the host round trips; they are not implemented,
//! because a protocol bug there hangs GPUs, and they cannot be tested on the one-GPU
//! machines this was written on. Kernels never spin, so they cannot hang.
//!
//! # Asynchronous use
//!
//! Unlike TE, which refuses `async_op` for symmetric memory, every call returns a
//! [`Work`]: on the host, the reduction runs at the first wait (or when the handle is
//! dropped, or at this rank's next call on the same buffer, which must first finish
//! the previous one, or at [`clear`](SymmetricAllReduce::clear)); on GPUs, the call
//! returns once the last kernel is queued on the device's tessera stream (the host
//! blocks in the call only for the barriers) and the wait synchronizes with it. Later
//! work on the tessera stream sees the result without waiting. Results of async and
//! sync use are identical.
//!
//! # Multimem
//!
//! [`SymmAlgo::Multimem`] (NVLink SHARP multicast objects, `multimem.ld_reduce`) is a
//! typed error, [`Error::InvalidArgument`] with a
//! message starting `unsupported:`. tessera never calls `cuMulticastCreate`: NVLink
//! multicast must stay off on shared machines.
//!
//! # Freeing
//!
//! [`SymmetricAllReduce::clear`] frees every cached buffer, collectively (after a
//! barrier, when no peer can still read them). Dropping the object completes this
//! rank's outstanding host calls, synchronizes its GPU stream, closes its IPC mappings
//! of the peers' buffers and releases its own buffers — except a GPU buffer that
//! ranks in other processes have mapped: freeing it while they may still read it is
//! undefined behaviour, and a drop cannot wait for them, so such a buffer is left to
//! the end of the process (with a `tracing` warning) unless `clear` ran first.
//!
//! ```
//! use std::sync::Arc;
//! use tessera_collectives::{ProcessGroup, ReduceOp, SymmAlgo, SymmetricAllReduce, run_ranks};
//! use tessera_core::{DType, Device, Error, Tensor};
//!
//! # fn main() -> tessera_core::Result<()> {
//! let results = run_ranks(4, |g| -> tessera_core::Result<()> {
//!     let group: Arc<dyn ProcessGroup> = Arc::new(g);
//!     // One per group and rank; buffers are created on first use, per (numel, dtype).
//!     let symm = SymmetricAllReduce::new(group.clone());
//!     let x = Tensor::from_slice(&[group.rank() as f32 + 1.0; 6], [2, 3], Device::Cpu)?;
//!     let one = symm.all_reduce(x.clone(), ReduceOp::Sum, SymmAlgo::OneShot)?;
//!     // A second call before the first is waited for.
//!     let two = symm.all_reduce(x.clone(), ReduceOp::Sum, SymmAlgo::TwoShot)?;
//!     let plain = group.all_reduce(x, ReduceOp::Sum)?.into_result()?;
//!     assert_eq!(one.into_result()?.to_bytes()?, plain.to_bytes()?);
//!     assert_eq!(two.into_result()?.to_vec::<f32>()?, vec![10.0; 6]);
//!     // Multicast is never used.
//!     let z = Tensor::zeros([2], DType::F32, Device::Cpu)?;
//!     let e = symm.all_reduce(z, ReduceOp::Sum, SymmAlgo::Multimem).unwrap_err();
//!     assert!(matches!(&e, Error::InvalidArgument { msg, .. } if msg.starts_with("unsupported:")));
//!     symm.clear() // collective: every rank frees its buffers
//! })?;
//! for r in results {
//!     r?;
//! }
//! # Ok(())
//! # }
//! ```

#[cfg(feature = "cuda")]
mod cuda;
mod host;
mod reduce;
mod registry;

use std::collections::HashMap;
use std::fmt;
use std::str::FromStr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tessera_core::{DType, Device, Error, Result, Tensor};

use crate::group::{ProcessGroup, ReduceOp};
use crate::{DEFAULT_TIMEOUT, Work};

use host::HostEntry;

const OP: &str = "SymmetricAllReduce";

/// The most ranks a symmetric group on GPUs may have (the GPUs of one host; the
/// kernels take the ranks' addresses as arguments).
pub const MAX_SYMMETRIC_GPU_RANKS: usize = 8;

/// The algorithm of a symmetric-memory all-reduce.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SymmAlgo {
    /// Every rank reduces every rank's whole buffer (one phase; reads `size`× the data).
    OneShot,
    /// Reduce-scatter into the symmetric buffers, then all-gather from them (two
    /// phases; reads 2× the data).
    TwoShot,
    /// NVLink SHARP multicast (`multimem` instructions). Always refused with an
    /// `unsupported:` error: tessera never creates multicast objects.
    Multimem,
}

impl SymmAlgo {
    /// TE's name of the algorithm (`all_reduce_type`): `one_shot`, `two_shot`,
    /// `multimem_all_reduce`.
    pub fn name(self) -> &'static str {
        match self {
            SymmAlgo::OneShot => "one_shot",
            SymmAlgo::TwoShot => "two_shot",
            SymmAlgo::Multimem => "multimem_all_reduce",
        }
    }
}

impl fmt::Display for SymmAlgo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for SymmAlgo {
    type Err = Error;

    /// TE's names (`one_shot`, `two_shot`, `multimem_all_reduce`, also `multimem`).
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "one_shot" => Ok(SymmAlgo::OneShot),
            "two_shot" => Ok(SymmAlgo::TwoShot),
            "multimem_all_reduce" | "multimem" => Ok(SymmAlgo::Multimem),
            other => Err(Error::invalid(
                "SymmAlgo::from_str",
                format!(
                    "unknown symmetric all-reduce type `{other}`; expected one_shot, two_shot or multimem_all_reduce"
                ),
            )),
        }
    }
}

/// Settings of a [`SymmetricAllReduce`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SymmetricOptions {
    /// How long a rank waits for the others inside a host all-reduce before failing
    /// (instead of hanging). GPU calls wait in the group's barriers, under the group's
    /// own timeout. Default: [`DEFAULT_TIMEOUT`] (300 s).
    pub timeout: Duration,
    /// The most bytes of symmetric memory this rank's cached buffers may hold (per
    /// buffer: on the host its input slot and result chunk, on a GPU its whole
    /// allocation: two input slots and a result chunk). A call that needs a new buffer
    /// beyond it fails with [`Error::InvalidArgument`] on every rank; [`clear`](SymmetricAllReduce::clear)
    /// frees the cache. Default: 4 GiB.
    pub max_cached_bytes: usize,
}

impl Default for SymmetricOptions {
    fn default() -> Self {
        SymmetricOptions {
            timeout: DEFAULT_TIMEOUT,
            max_cached_bytes: 4 << 30,
        }
    }
}

/// Elements per two-shot chunk: `ceil(numel / size)` rounded up to 16 bytes, so that
/// every chunk starts 16-byte aligned (the last ranks' chunks may be short or empty).
pub(crate) fn chunk_len(numel: usize, size: usize, elem_bytes: usize) -> usize {
    let per16 = (16 / elem_bytes.max(1)).max(1);
    numel.div_ceil(size.max(1)).div_ceil(per16) * per16
}

/// One cached buffer of this rank.
enum Entry {
    Host(HostEntry),
    #[cfg(feature = "cuda")]
    Cuda(cuda::CudaEntry),
}

#[derive(Default)]
struct Cache {
    entries: HashMap<(usize, DType), (Entry, usize)>,
    bytes: usize,
}

/// Symmetric-memory all-reduces over one group, with the group's symmetric buffers
/// cached per `(numel, dtype)`. See the [module docs](self).
///
/// Every rank of the group creates its own object (no communication) and then issues
/// the same calls in the same order, as for any collective. Creating a buffer (the
/// first call with a new `(numel, dtype)`) and [`clear`](Self::clear) are collective.
pub struct SymmetricAllReduce {
    group: Arc<dyn ProcessGroup>,
    options: SymmetricOptions,
    cache: Mutex<Cache>,
}

impl SymmetricAllReduce {
    /// The symmetric all-reduces of `group`, with default options.
    pub fn new(group: Arc<dyn ProcessGroup>) -> Self {
        Self::with_options(group, SymmetricOptions::default())
    }

    /// The symmetric all-reduces of `group`.
    pub fn with_options(group: Arc<dyn ProcessGroup>, options: SymmetricOptions) -> Self {
        SymmetricAllReduce {
            group,
            options,
            cache: Mutex::new(Cache::default()),
        }
    }

    /// The group.
    pub fn group(&self) -> &Arc<dyn ProcessGroup> {
        &self.group
    }

    /// The options.
    pub fn options(&self) -> &SymmetricOptions {
        &self.options
    }

    fn lock(&self) -> MutexGuard<'_, Cache> {
        self.cache.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The `(numel, dtype)` of every cached buffer, sorted.
    pub fn cached(&self) -> Vec<(usize, DType)> {
        let mut v: Vec<_> = self.lock().entries.keys().copied().collect();
        v.sort();
        v
    }

    /// Bytes of symmetric memory this rank's cached buffers hold (see
    /// [`SymmetricOptions::max_cached_bytes`]).
    pub fn cached_bytes(&self) -> usize {
        self.lock().bytes
    }

    /// Reduces `tensor` over the group with `algo`, in place (copy-on-write), and
    /// returns the result through the handle.
    ///
    /// Errors, before any communication: [`SymmAlgo::Multimem`]
    /// ([`Error::InvalidArgument`], `unsupported: ...`); a dtype or op that cannot
    /// reduce ([`Error::DType`]); a tensor off the group's device ([`Error::Device`]);
    /// more than [`MAX_SYMMETRIC_GPU_RANKS`] ranks on GPUs, or a new buffer over
    /// [`SymmetricOptions::max_cached_bytes`] ([`Error::InvalidArgument`]). Creating a
    /// buffer fails on every rank, with a typed error, when the ranks disagree on the
    /// element count or dtype, are not on one host (GPUs) or not in one process (host
    /// tensors). Mismatched shapes, ops or algorithms across ranks are an error of the
    /// call on host tensors; on GPUs they are the caller's bug, as with NCCL.
    pub fn all_reduce(&self, tensor: Tensor, op: ReduceOp, algo: SymmAlgo) -> Result<Work<Tensor>> {
        if algo == SymmAlgo::Multimem {
            return Err(Error::invalid(
                OP,
                "unsupported: the multimem all-reduce needs NVLink multicast objects \
                 (cuMulticastCreate), which tessera never creates — NVLink multicast must stay \
                 off on shared machines; use SymmAlgo::OneShot or SymmAlgo::TwoShot",
            ));
        }
        reduce::check_reducible(OP, tensor.dtype(), op)?;
        let device = self.group.device();
        if tensor.device() != device {
            return Err(Error::device(
                OP,
                format!("{device} (the process group's device)"),
                tensor.device(),
            ));
        }
        if tensor.numel() == 0 {
            return Ok(Work::done(tensor));
        }
        let key = (tensor.numel(), tensor.dtype());
        let mut cache = self.lock();
        if !cache.entries.contains_key(&key) {
            let needed = self.needed_bytes(key.0, key.1)?;
            let total = cache.bytes.saturating_add(needed);
            if total > self.options.max_cached_bytes {
                return Err(Error::invalid(
                    OP,
                    format!(
                        "a symmetric buffer for {} elements of {} needs {needed} bytes, which would make the cache hold {total}, over max_cached_bytes = {}; call clear() on every rank or raise SymmetricOptions::max_cached_bytes",
                        key.0, key.1, self.options.max_cached_bytes
                    ),
                ));
            }
            let entry = self.create(key.0, key.1)?;
            cache.bytes += needed;
            cache.entries.insert(key, (entry, needed));
        }
        let (entry, _) = cache
            .entries
            .get_mut(&key)
            .ok_or_else(|| Error::state(OP, "internal: the cached buffer vanished"))?;
        match entry {
            Entry::Host(e) => e.all_reduce(tensor, op, algo),
            #[cfg(feature = "cuda")]
            Entry::Cuda(e) => e.all_reduce(self.group.as_ref(), tensor, op, algo),
        }
    }

    /// The bytes a new buffer will account for; also checks the group's size.
    fn needed_bytes(&self, numel: usize, dtype: DType) -> Result<usize> {
        let size = self.group.size();
        match self.group.device() {
            Device::Cpu => Ok(host::entry_bytes(numel, dtype, size)),
            Device::Cuda(_) => {
                if size > MAX_SYMMETRIC_GPU_RANKS {
                    return Err(Error::invalid(
                        OP,
                        format!(
                            "symmetric memory on GPUs supports groups of at most {MAX_SYMMETRIC_GPU_RANKS} ranks (one host's GPUs), this group has {size}"
                        ),
                    ));
                }
                gpu_entry_bytes(numel, dtype, size)
            }
        }
    }

    fn create(&self, numel: usize, dtype: DType) -> Result<Entry> {
        match self.group.device() {
            Device::Cpu => Ok(Entry::Host(HostEntry::attach(
                self.group.as_ref(),
                numel,
                dtype,
                self.options.timeout,
            )?)),
            #[cfg(feature = "cuda")]
            Device::Cuda(_) => Ok(Entry::Cuda(cuda::CudaEntry::attach(
                self.group.as_ref(),
                numel,
                dtype,
            )?)),
            #[cfg(not(feature = "cuda"))]
            Device::Cuda(i) => Err(Error::no_cuda_feature(format!(
                "a symmetric all-reduce on cuda:{i}"
            ))),
        }
    }

    /// Frees every cached buffer (collective: every rank must call it at the same
    /// point). Completes this rank's outstanding host calls, synchronizes its GPU
    /// stream and closes its mappings of the peers' buffers, then waits at a group
    /// barrier until every rank has, and only then frees its own buffers, so no peer
    /// can still read them. Later calls create buffers anew.
    pub fn clear(&self) -> Result<()> {
        let entries: Vec<Entry> = {
            let mut cache = self.lock();
            cache.bytes = 0;
            cache.entries.drain().map(|(_, (e, _))| e).collect()
        };
        let mut first_error = None;
        #[cfg_attr(not(feature = "cuda"), allow(unused_mut))]
        let mut owned: Vec<OwnBuffer> = Vec::new();
        for e in entries {
            match e {
                Entry::Host(mut h) => h.finish(),
                #[cfg(feature = "cuda")]
                Entry::Cuda(c) => match c.release_peers() {
                    Ok(own) => owned.push(own),
                    Err(err) => {
                        first_error.get_or_insert(err);
                    }
                },
            }
        }
        let barrier = if self.group.size() > 1 {
            self.group.barrier()
        } else {
            Ok(())
        };
        match barrier {
            // Every rank has closed its mappings: the own buffers can go.
            Ok(()) => drop(owned),
            Err(e) => {
                // Some rank may still map them: keep the exported ones.
                owned.into_iter().for_each(leak_if_exported);
                first_error.get_or_insert(e);
            }
        }
        match first_error {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

/// This rank's own GPU allocation, detached from its cache entry by `clear`.
#[cfg(feature = "cuda")]
type OwnBuffer = cuda::OwnBuffer;
#[cfg(not(feature = "cuda"))]
type OwnBuffer = std::convert::Infallible;

#[cfg(feature = "cuda")]
fn leak_if_exported(own: OwnBuffer) {
    own.leak_if_exported();
}

#[cfg(not(feature = "cuda"))]
fn leak_if_exported(own: OwnBuffer) {
    match own {}
}

/// The bytes of a GPU buffer, as [`SymmetricOptions::max_cached_bytes`] counts them.
#[cfg(feature = "cuda")]
fn gpu_entry_bytes(numel: usize, dtype: DType, size: usize) -> Result<usize> {
    cuda::Layout::new(numel, dtype, size).map(|l| l.total)
}

#[cfg(not(feature = "cuda"))]
fn gpu_entry_bytes(_numel: usize, _dtype: DType, _size: usize) -> Result<usize> {
    Ok(0)
}

impl fmt::Debug for SymmetricAllReduce {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let cache = self.lock();
        f.debug_struct("SymmetricAllReduce")
            .field("group", &self.group)
            .field("options", &self.options)
            .field("cached", &cache.entries.len())
            .field("cached_bytes", &cache.bytes)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_are_16_byte_aligned_and_cover_the_tensor() {
        for es in [1, 2, 4, 8] {
            for size in 1..=8 {
                for numel in [1, 2, 7, 8, 9, 63, 64, 65, 1000, 4099] {
                    let c = chunk_len(numel, size, es);
                    assert_eq!(c * es % 16, 0);
                    assert!(c * size >= numel, "{numel} {size} {es}");
                }
            }
        }
    }

    #[test]
    fn algorithm_names() {
        for a in [SymmAlgo::OneShot, SymmAlgo::TwoShot, SymmAlgo::Multimem] {
            assert_eq!(a.name().parse::<SymmAlgo>().unwrap(), a);
            assert_eq!(a.to_string(), a.name());
        }
        assert!(matches!(
            "three_shot".parse::<SymmAlgo>(),
            Err(Error::InvalidArgument { .. })
        ));
    }
}
