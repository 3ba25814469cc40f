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
mod ops;
mod thread;
mod work;

pub use group::{Collective, ProcessGroup, ReduceOp};
pub use ops::{
    Chunk1d, GroupAmaxReduction, MaybeQuantized, allreduce, gather_along_first_dim,
    gather_split_1d_tensor, reduce_scatter_along_first_dim, split_tensor_into_1d_equal_chunks,
};
pub use thread::{DEFAULT_TIMEOUT, ThreadGroup, run_ranks};
pub use work::Work;
