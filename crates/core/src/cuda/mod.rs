//! CUDA glue: device discovery that never panics, one stream per device, a cache of
//! loaded PTX modules, launch helpers, graph capture and event timers.
//!
//! cudarc loads the driver at run time and panics when the library is missing; every
//! entry point here first asks whether the library exists and turns its absence into
//! [`Error::CudaUnavailable`], so the same binary runs
//! its CPU paths on a machine without CUDA.
//!
//! # The stream invariant
//!
//! Each device has one tessera stream ([`CudaDevice::stream`]). Every allocation, copy
//! and kernel tessera issues for a device goes to that stream, in program order, so
//! work on one device needs no events between operations. cudarc's per-buffer event
//! tracking is therefore switched off for tessera's contexts (it would also put
//! cross-capture event waits into CUDA graphs). Work a caller puts on other streams
//! must be ordered against the tessera stream by the caller.
//!
//! # Allocation
//!
//! Allocations are stream-ordered (`cuMemAllocAsync`) from the device's default memory
//! pool, which keeps freed memory cached for later allocations instead of handing it
//! back to the driver at every synchronisation (a release threshold of `u64::MAX`, as
//! PyTorch's allocators set). [`CudaDevice::release_cached_memory`] hands it back.

mod device;
mod graph;
mod launch;
mod timer;

pub use cudarc;
pub use device::{CudaDevice, ModuleCode, device, device_count, is_available};
pub use graph::Graph;
pub use launch::{LaunchConfig, grid_1d, grid_1d_cover};
pub use timer::EventTimer;

use crate::{Error, Result};

/// Adds the failing operation's name to cudarc driver errors.
pub trait CudaResultExt<T> {
    /// Maps a driver error to [`Error::Cuda`] for operation `op`.
    fn cuda_op(self, op: &'static str) -> Result<T>;
}

impl<T> CudaResultExt<T> for std::result::Result<T, cudarc::driver::DriverError> {
    fn cuda_op(self, op: &'static str) -> Result<T> {
        self.map_err(|e| Error::Cuda {
            op,
            msg: e.to_string(),
        })
    }
}
