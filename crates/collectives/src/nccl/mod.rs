//! The NCCL backend (feature `cuda`): [`NcclGroup`], one process per GPU, on a
//! project-owned [`Communicator`] over cudarc's `nccl::sys` layer.
//!
//! cudarc's safe `Comm` cannot split, configure, poll asynchronous errors, or move
//! between threads, and its group guard panics on error; so this module owns the raw
//! `ncclComm_t` itself. Communicators are created non-blocking
//! (`ncclCommInitRankConfig` with `blocking = 0`, the config built by hand as
//! `NCCL_CONFIG_INITIALIZER` would) and every wait — init, split, group launch,
//! completion, finalize — polls `ncclCommGetAsyncError` under a timeout, aborting the
//! communicator and returning an error instead of hanging when a peer dies or
//! diverges. Errors carry NCCL's own text (`ncclGetErrorString`, `ncclGetLastError`).
//!
//! ```no_run
//! use tessera_collectives::{NcclGroup, ProcessGroup, ReduceOp};
//! use tessera_core::{Device, Tensor};
//!
//! # fn main() -> tessera_core::Result<()> {
//! // Started by torchrun or `cargo xtask test-gpu`: RANK, WORLD_SIZE, LOCAL_RANK,
//! // MASTER_ADDR, MASTER_PORT are set.
//! let group = NcclGroup::from_env()?;
//! let x = Tensor::from_slice(&[group.rank() as f32; 4], [4], group.device())?;
//! let sum = group.all_reduce(x, ReduceOp::Sum)?.into_result()?;
//! assert_eq!(sum.to_vec::<f32>()?[0], (0..group.size()).sum::<usize>() as f32);
//! # let _ = Device::Cpu;
//! # Ok(())
//! # }
//! ```
//!
//! # No panics without CUDA or NCCL
//!
//! cudarc panics when a library it needs cannot be loaded. Everything here first
//! checks [`ensure_available`] — the CUDA driver with a device
//! (`tessera_core::cuda::device_count`) and `cudarc::nccl::sys::is_culib_present()` —
//! and returns [`Error::CudaUnavailable`](tessera_core::Error::CudaUnavailable)
//! instead, so CPU-only machines get a typed error.
//!
//! # `libnccl.so.2`
//!
//! cudarc's loader tries `libnccl.so` (and `libnccl.so.{1,9..13}`, …) but never
//! `libnccl.so.2`, the only file that pip's `nvidia-nccl-cu*` wheels and Debian's
//! `libnccl2` install. Nothing in-process fixes that with glibc: `dlopen` reuses a
//! loaded object only for its load name or `DT_SONAME` (`libnccl.so.2`), so
//! preloading it (even `RTLD_GLOBAL`) does not satisfy `dlopen("libnccl.so")`, and
//! `LD_LIBRARY_PATH` is read once at process start. Launchers therefore call
//! [`nccl_shim_dir`], which makes a directory holding `libnccl.so -> …/libnccl.so.2`,
//! and prepend it to the ranks' `LD_LIBRARY_PATH`:
//!
//! ```sh
//! mkdir -p /tmp/nccl-shim
//! ln -sf "$(python3 -c 'import nvidia.nccl, os; print(os.path.dirname(nvidia.nccl.__file__))')/lib/libnccl.so.2" /tmp/nccl-shim/libnccl.so
//! LD_LIBRARY_PATH=/tmp/nccl-shim:$LD_LIBRARY_PATH ./my-rank-binary
//! ```
//!
//! When only `libnccl.so.2` is present, [`ensure_available`]'s error says so and
//! names the file.
//!
//! # The process environment
//!
//! The first call into this module that needs NCCL sets `NCCL_NVLS_ENABLE=0` in the
//! process environment when the variable is unset, before NCCL is loaded or called:
//! NVLink SHARP (multicast) stays off, and this module never creates multicast
//! objects. Set the variable yourself (or before starting threads that call C's
//! `getenv`) to decide otherwise; Rust's own environment accesses are synchronized.
//!
//! # Streams
//!
//! Collectives run on the device's tessera stream (`tessera_core::cuda`'s stream
//! invariant): their inputs are ready when queued, and tessera work queued after a
//! collective sees its output. Completion for the host is the [`Work`](crate::Work)'s
//! wait.

mod comm;
mod group;
mod loader;

pub use comm::{CommState, Communicator, NCCL_SPLIT_NOCOLOR, UNIQUE_ID_BYTES, UniqueId};
pub use group::{NcclGroup, NcclOptions};
pub use loader::{
    NcclVersion, create_nccl_shim, ensure_available, find_libnccl_so2, is_available, nccl_shim_dir,
};
