pub use cudarc::driver::LaunchConfig;

use super::CudaDevice;
use crate::{Error, Result};

/// A one-dimensional launch for `units` independent work items with `block` threads
/// per block, for kernels that loop over their items with a grid stride.
///
/// The grid is just large enough to fill every multiprocessor of `device` with resident
/// blocks (more would only add scheduling), and never more than one block per
/// `block` items. Fails when `block` is 0 or above 1024.
pub fn grid_1d(device: &CudaDevice, units: usize, block: u32) -> Result<LaunchConfig> {
    if block == 0 || block > 1024 {
        return Err(Error::invalid(
            "cuda::grid_1d",
            format!("block size {block} outside 1..=1024"),
        ));
    }
    let needed = units.div_ceil(block as usize).max(1);
    let resident = device.multiprocessors() as usize
        * (device.max_threads_per_multiprocessor() / block).max(1) as usize;
    let grid = needed.min(resident).min(u32::MAX as usize) as u32;
    Ok(LaunchConfig {
        grid_dim: (grid, 1, 1),
        block_dim: (block, 1, 1),
        shared_mem_bytes: 0,
    })
}
