//! Collectives for tessera: process groups and the communication operations of
//! TransformerEngine's `distributed.py`, including quantized first-dimension gathers.
//!
//! - [`ProcessGroup`]: rank, size, coalesced groups of all-gather / reduce-scatter /
//!   all-reduce / broadcast ([`Collective`]), barrier, subgroups; each call returns a
//!   [`Work`] handle whose `wait()` runs the post-processing exactly once.
//! - [`ThreadGroup`]: ranks as threads of one process exchanging host tensors — the
//!   reference backend and the test bed; [`run_ranks`] runs a closure per rank.
//! - [`gather_along_first_dim`] for plain and quantized tensors of every format, one
//!   generic implementation driven by the formats' wire layouts
//!   ([`tessera_quant::wire`]); [`reduce_scatter_along_first_dim`], [`allreduce`],
//!   [`split_tensor_into_1d_equal_chunks`] / [`gather_split_1d_tensor`].
//! - [`packing`]: the wire layout's pack and unpack run where the tensors live — host
//!   copies for host tensors, device-to-device and 2-D copies on the tessera stream for
//!   CUDA tensors (feature `cuda`) — so a quantized gather of CUDA tensors never takes
//!   a round trip through host memory.
//! - [`Store`]: a torchrun-style TCP rendezvous store (`MASTER_ADDR:MASTER_PORT`) on
//!   `std::net`, for exchanging NCCL ids and for barriers between processes.
//! - `nccl` (feature `cuda`): `NcclGroup`, the one-process-per-GPU backend over NCCL,
//!   on a project-owned `Communicator` (non-blocking init, split, abort, async-error
//!   polling and timeouts, so a failed peer is an error rather than a hang). Without a
//!   CUDA driver or NCCL library it returns [`tessera_core::Error::CudaUnavailable`].
//! - [`SymmetricAllReduce`]: TE's symmetric-memory all-reduce, one-shot and two-shot
//!   ([`SymmAlgo`]), over buffers every rank of a single-host group can read, cached per
//!   `(numel, dtype)`: shared host memory for ranks that are threads, plain `cuMemAlloc`
//!   buffers reached through CUDA IPC or peer access on GPUs (feature `cuda`). Results
//!   equal the ThreadGroup's all-reduce bit for bit; calls may be asynchronous; the
//!   multimem variant is a typed `unsupported:` error (NVLink multicast stays off).
//!
//! ```
//! use std::sync::Arc;
//! use tessera_collectives::{MaybeQuantized, ProcessGroup, gather_along_first_dim, run_ranks};
//! use tessera_core::{Device, Tensor};
//! use tessera_quant::{Fp8CurrentScaling, Fp8Format};
//!
//! # fn main() -> tessera_core::Result<()> {
//! let shapes = run_ranks(4, |g| -> tessera_core::Result<_> {
//!     let group: Arc<dyn ProcessGroup> = Arc::new(g);
//!     let shard = Tensor::from_slice(&vec![group.rank() as f32; 2 * 16], [2, 16], Device::Cpu)?;
//!     let mut q = Fp8CurrentScaling::new(Fp8Format::E4M3);
//!     let out = gather_along_first_dim(&MaybeQuantized::Plain(shard), &group, Some(&mut q))?;
//!     Ok(out.into_result()?.shape().clone())
//! })?;
//! for s in shapes {
//!     assert_eq!(s?.dims(), &[8, 16]);
//! }
//! # Ok(())
//! # }
//! ```

#![warn(missing_docs)]

mod group;
#[cfg(feature = "cuda")]
pub mod nccl;
mod ops;
pub mod packing;
mod store;
pub mod symmetric;
mod thread;
mod work;

pub use group::{Collective, ProcessGroup, ReduceOp};
#[cfg(feature = "cuda")]
pub use nccl::{NcclGroup, NcclOptions};
pub use ops::{
    Chunk1d, GroupAmaxReduction, MaybeQuantized, allreduce, gather_along_first_dim,
    gather_along_first_dim_uneven, gather_quantized, gather_split_1d_tensor,
    reduce_scatter_along_first_dim, split_tensor_into_1d_equal_chunks,
};
pub use store::{DEFAULT_STORE_TIMEOUT, RendezvousEnv, Store, StoreServer};
pub use symmetric::{MAX_SYMMETRIC_GPU_RANKS, SymmAlgo, SymmetricAllReduce, SymmetricOptions};
pub use thread::{DEFAULT_TIMEOUT, ThreadGroup, run_ranks};
pub use work::Work;
