//! Programmatic dependent launches: how a kernel orders against the one before it
//! ([`Order`]) and the raw launch that sets it ([`launch_params`]).

use std::ffi::c_void;
use std::marker::PhantomData;

use cudarc::driver::{CudaFunction, CudaStream, DeviceRepr, LaunchConfig};
use tessera_core::Result;
use tessera_core::cuda::{CudaDevice, CudaResultExt};

/// The parameters of a [`launch_params`] launch, in order: the address of each value
/// (a device pointer is passed as its `u64` address), borrowed until the launch returns
/// (the driver copies the values at launch).
#[derive(Default)]
pub(crate) struct Params<'a> {
    ptrs: Vec<*mut c_void>,
    values: PhantomData<&'a ()>,
}

impl<'a> Params<'a> {
    /// Appends the parameter `v`.
    pub(crate) fn arg<T: DeviceRepr>(&mut self, v: &'a T) -> &mut Self {
        self.ptrs.push(std::ptr::from_ref(v).cast_mut().cast());
        self
    }
}

/// How a launch orders against the kernel launched before it on the stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Order {
    /// It starts once that kernel has finished (an ordinary launch).
    AfterPrevious,
    /// The second pass of a two-pass quantizer right after its amax pass: a programmatic
    /// dependent launch (sm_90). Its CTAs may start while the amax pass's last CTAs
    /// still run (that pass lets them, after its own wait: `pdl_amax_first` in
    /// kernels/common.cuh), load their tiles, and wait for the amax in `pdl_wait()`
    /// (which keeps the loads ahead of the wait in the SASS too, see common.cuh). This
    /// hides the launch gap and the amax pass's tail: on an H200, bf16 4096x4096 FP8
    /// current scaling (both) went from 0.93 to 0.99 of its two-pass floor
    /// (bench/cuda/quant_variants.cu).
    OverlapAmaxPass,
    /// A one-pass kernel after any kernel: a programmatic dependent launch whose kernel
    /// calls `pdl_first()` (kernels/common.cuh) before any memory access. Its CTAs may
    /// become resident once every CTA of the kernel before has started (if that kernel
    /// lets dependents launch, as these do) or exited, and wait there until it has
    /// finished and its writes are visible. This hides the launch and the CTAs' start
    /// behind the tail of the kernel before: on an H200, bf16 4096x4096 quantizations
    /// and dequantizations back to back took 4-12% less time each (BENCHMARKS.md).
    WaitFirst,
}

/// Launches `f` with `params`, ordered by `order`.
///
/// # Safety
/// `params` must hold exactly the kernel's parameters, in order and with the right
/// types, and every pointer must address device memory large enough for what the kernel
/// touches under `cfg`. With [`Order::OverlapAmaxPass`], the last kernel launched on
/// the device's stream must also be an amax pass that only reads the input and lets
/// dependents launch only after its own wait (`pdl_amax_first()`), and `f` must read
/// nothing but that input before its `pdl_wait()` and write nothing before it. With
/// [`Order::WaitFirst`], `f` must access no memory before its `pdl_first()` (or
/// `pdl_amax_first()`).
pub(crate) unsafe fn launch_params(
    dev: &CudaDevice,
    f: &CudaFunction,
    cfg: LaunchConfig,
    op: &'static str,
    order: Order,
    params: &mut Params<'_>,
) -> Result<()> {
    use cudarc::driver::sys;
    let stream = dev.stream();
    stream.context().bind_to_thread().cuda_op(op)?;
    // SAFETY: an all-zero bit pattern is a valid value of this plain-data union.
    let mut value: sys::CUlaunchAttributeValue = unsafe { std::mem::zeroed() };
    value.programmaticStreamSerializationAllowed = 1;
    let mut attr = sys::CUlaunchAttribute {
        id: sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
        pad: [0; 4],
        value,
    };
    let config = driver_config(
        &cfg,
        stream,
        &mut attr,
        u32::from(order != Order::AfterPrevious),
    );
    // SAFETY: `config` and `attr` live across the call; `params` holds one pointer per
    // kernel parameter to values borrowed for its lifetime (the caller's contract: they
    // match the kernel), and the function belongs to the stream's context, which is
    // bound to this thread.
    unsafe {
        sys::cuLaunchKernelEx(
            &config,
            f.cu_function(),
            params.ptrs.as_mut_ptr(),
            std::ptr::null_mut(),
        )
    }
    .result()
    .cuda_op(op)
}

/// How many clusters of `f`'s compile-time cluster shape (`__cluster_dims__`) the device
/// can hold at once for a launch of `cfg` (`cuOccupancyMaxActiveClusters`): 0 where a
/// cluster does not fit one GPC (a MIG slice, say), and a launch would fail.
pub(crate) fn max_active_clusters(
    dev: &CudaDevice,
    f: &CudaFunction,
    cfg: LaunchConfig,
    op: &'static str,
) -> Result<u32> {
    use cudarc::driver::sys;
    let stream = dev.stream();
    stream.context().bind_to_thread().cuda_op(op)?;
    let config = driver_config(&cfg, stream, std::ptr::null_mut(), 0);
    let mut clusters = 0;
    // SAFETY: `clusters` and `config` live across the call, which only reads `config`
    // (no attributes) and writes `clusters`; the function belongs to the stream's
    // context, which is bound to this thread.
    unsafe { sys::cuOccupancyMaxActiveClusters(&mut clusters, f.cu_function(), &config) }
        .result()
        .cuda_op(op)?;
    Ok(u32::try_from(clusters).unwrap_or(0))
}

/// `cfg` on `stream` as the driver's launch configuration, with the first `num_attrs`
/// attributes at `attrs`.
fn driver_config(
    cfg: &LaunchConfig,
    stream: &CudaStream,
    attrs: *mut cudarc::driver::sys::CUlaunchAttribute,
    num_attrs: u32,
) -> cudarc::driver::sys::CUlaunchConfig {
    cudarc::driver::sys::CUlaunchConfig {
        gridDimX: cfg.grid_dim.0,
        gridDimY: cfg.grid_dim.1,
        gridDimZ: cfg.grid_dim.2,
        blockDimX: cfg.block_dim.0,
        blockDimY: cfg.block_dim.1,
        blockDimZ: cfg.block_dim.2,
        sharedMemBytes: cfg.shared_mem_bytes,
        hStream: stream.cu_stream(),
        attrs,
        numAttrs: num_attrs,
    }
}
