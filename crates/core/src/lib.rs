//! The shared foundation of tessera.
//!
//! Every other tessera crate builds on these types:
//!
//! - [`DType`], [`Shape`] and [`Device`]: what a buffer holds, how it is laid out, and
//!   where it lives;
//! - [`Tensor`]: a dense row-major buffer on the host or (feature `cuda`) on a CUDA
//!   device, cheap to clone, copy-on-write, with typed host access through bytemuck and
//!   f32 values in and out of its floating-point dtypes
//!   ([`Tensor::from_f32_values`], [`Tensor::to_f32_vec`]);
//! - [`Error`]: the one error type, whose messages say what was wrong and what was
//!   expected;
//! - [`Replay`] and [`Snapshot`]: state that activation recomputation must replay
//!   exactly (RNG generators and trackers, amax histories);
//! - [`Parameter`] and [`TpAttributes`]: a tensor with its tensor-parallel split;
//! - [`kernels`]: embedded PTX modules and the check that keeps them in step with their
//!   CUDA sources;
//! - `cuda` (feature `cuda`): device discovery that returns an error instead of
//!   panicking when there is no driver, one stream per device, a cache of loaded PTX
//!   modules, launch helpers, graph capture and event timers.
//!
//! ```
//! use tessera_core::{DType, Device, Tensor};
//!
//! # fn main() -> tessera_core::Result<()> {
//! let x = Tensor::from_slice(&[1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0], [2, 3], Device::Cpu)?;
//! assert_eq!(x.shape().flat_2d(), (2, 3));
//! let mut y = x.clone(); // shares the bytes ...
//! y.as_mut_slice::<f32>()?[0] = -1.0; // ... until one side writes
//! assert_eq!(x.as_slice::<f32>()?[0], 1.0);
//!
//! // f32 values to bf16 (round to nearest-even) and back (exact).
//! let b = Tensor::from_f32_values(&[1.0, 1.00390625, 3.0], [3], DType::BF16, Device::Cpu)?;
//! assert_eq!(b.to_f32_vec()?, [1.0, 1.0, 3.0]);
//!
//! // Bad input is a typed error, not a panic.
//! let err = x.as_slice::<u32>().unwrap_err();
//! assert_eq!(err.to_string(), "Tensor::as_slice: expected a tensor of dtype u32, got f32");
//! # Ok(())
//! # }
//! ```

#![warn(missing_docs)]

#[cfg(feature = "cuda")]
pub mod cuda;
mod device;
mod dtype;
mod error;
pub mod fs;
pub mod kernels;
mod param;
mod replay;
mod shape;
mod tensor;

pub use device::Device;
pub use dtype::{DType, Element};
pub use error::{Error, Result};
pub use half::{bf16, f16};
pub use param::{Parameter, TpAttributes};
pub use replay::{Replay, Snapshot};
pub use shape::Shape;
pub use tensor::Tensor;
