//! The wire layout's pack and unpack ([`tessera_quant::wire`]) where the tensors live.
//!
//! `wire` describes each step as [`CopyPlan`]s — lists of strided byte moves and
//! swizzles, derived from the formats' wire layouts — and runs them on the host. Here
//! [`execute`] runs the same plans on the tensors' device: host tensors through
//! [`CopyPlan::run_host`], CUDA tensors (feature `cuda`) as device-to-device copies
//! (`cuMemcpyDtoDAsync`, `cuMemcpy2DAsync` for strided pieces: padded rows,
//! transposed buffers joined across ranks) and one small kernel for the GEMM-swizzled
//! scale grids (`kernels/wire.cu`), all queued on the device's tessera stream with no
//! host synchronisation. Both give the same bytes. A plan that copies a whole buffer
//! unchanged (e.g. FP8 data) moves nothing: the output shares the input's storage.
//!
//! [`pack`], [`unpack`] and [`unpack_parts`] are `wire`'s functions of the same names
//! with this executor, so a CUDA tensor's gather never passes through host memory.

use std::collections::BTreeMap;

use tessera_core::{Device, Error, Result, Tensor};
use tessera_quant::wire::{self, CopyPlan, PlanInput};
use tessera_quant::{BufferName, QuantizedTensor};

const OP: &str = "packing::execute";

/// Runs `plan` on the device its inputs live on (all must be on one device): the host
/// executor for host tensors, device copies and the swizzle kernel for CUDA tensors.
pub fn execute(plan: &CopyPlan, inputs: &[PlanInput<'_>]) -> Result<Tensor> {
    let device = inputs.first().map_or(Device::Cpu, |i| i.tensor.device());
    if let Some(i) = inputs.iter().find(|i| i.tensor.device() != device) {
        return Err(Error::device(
            OP,
            format!("{device} (where the plan's first input is)"),
            i.tensor.device(),
        ));
    }
    match device {
        Device::Cpu => plan.run_host(inputs),
        #[cfg(feature = "cuda")]
        Device::Cuda(_) => cuda::run(plan, inputs),
        #[cfg(not(feature = "cuda"))]
        Device::Cuda(_) => Err(Error::no_cuda_feature("packing a CUDA tensor")),
    }
}

/// [`wire::pack`] on `qt`'s device: the send buffers of every gathered buffer, where
/// `qt` lives.
pub fn pack(qt: &QuantizedTensor) -> Result<Vec<(BufferName, Tensor)>> {
    wire::pack_with(qt, &execute)
}

/// [`wire::unpack`] on the gathered buffers' device.
pub fn unpack(
    local: &QuantizedTensor,
    world: usize,
    gathered: &BTreeMap<BufferName, Tensor>,
) -> Result<QuantizedTensor> {
    wire::unpack_with(local, world, gathered, &execute)
}

/// [`wire::unpack_parts`] on the parts' device.
pub fn unpack_parts(
    local: &QuantizedTensor,
    parts: &[BTreeMap<BufferName, Tensor>],
    rank_d0: &[usize],
) -> Result<QuantizedTensor> {
    wire::unpack_parts_with(local, parts, rank_d0, &execute)
}

#[cfg(feature = "cuda")]
mod cuda {
    //! Copy plans as device copies on the tessera stream.

    use cudarc::driver::sys::{self, CUmemorytype};
    use cudarc::driver::{DevicePtr, DevicePtrMut, PushKernelArg};
    use tessera_core::cuda::{CudaDevice, CudaResultExt, grid_1d};
    use tessera_core::kernels::{PtxModule, Sass};
    use tessera_core::{Device, Result, Tensor};
    use tessera_quant::wire::{CopyPlan, CopyStep, PlanInput, SwizzleStep};

    /// The compiled kernels of `kernels/wire.cu`.
    const PTX: PtxModule = PtxModule {
        name: "tessera_collectives_wire",
        ptx: include_str!("../kernels/ptx/wire.ptx"),
        sass: Some(Sass {
            cubin: include_bytes!("../kernels/ptx/wire.sm_90.cubin"),
            ptx_sha256: include_str!("../kernels/ptx/wire.sm_90.cubin.sha256"),
        }),
    };

    /// Threads per block (the kernel's `__launch_bounds__`).
    const BLOCK: u32 = 256;

    pub(super) fn run(plan: &CopyPlan, inputs: &[PlanInput<'_>]) -> Result<Tensor> {
        plan.check(inputs)?;
        if let Some(t) = plan.passthrough(inputs) {
            return t.reshape(plan.shape.clone());
        }
        let device = inputs[0].tensor.cuda_device()?.clone();
        let on = Device::Cuda(device.ordinal());
        let mut out = if plan.zeroed {
            Tensor::zeros(plan.shape.clone(), plan.dtype, on)?
        } else {
            Tensor::empty(plan.shape.clone(), plan.dtype, on)?
        };
        let stream = device.stream().clone();
        // Event tracking is off for tessera's contexts, so the guards do nothing; every
        // use below is ordered on the one tessera stream.
        let srcs = inputs
            .iter()
            .map(|i| {
                let (p, _guard) = i.tensor.cuda_slice()?.device_ptr(&stream);
                Ok(p + i.offset as u64)
            })
            .collect::<Result<Vec<u64>>>()?;
        let dst = {
            let (p, _guard) = out.cuda_slice_mut()?.device_ptr_mut(&stream);
            p
        };
        for step in &plan.steps {
            match *step {
                CopyStep::Strided {
                    src,
                    src_offset,
                    src_pitch,
                    dst_offset,
                    dst_pitch,
                    rows,
                    row_bytes,
                } => {
                    // SAFETY: `plan.check` proved every run inside its input (which
                    // starts at `srcs[src]`) and inside the output; the inputs are
                    // borrowed for this call and the output is owned, and any later
                    // free of either is queued on the same stream after this copy.
                    unsafe {
                        copy_2d(
                            &device,
                            [srcs[src] + src_offset as u64, src_pitch as u64],
                            [dst + dst_offset as u64, dst_pitch as u64],
                            rows,
                            row_bytes,
                        )
                    }?;
                }
                CopyStep::Swizzle(s) => {
                    let (from, to) = if s.to_grid {
                        (srcs[s.src] + s.compact_offset as u64, dst)
                    } else {
                        (srcs[s.src], dst + s.compact_offset as u64)
                    };
                    // SAFETY: as above, `plan.check` bounded every compact and grid
                    // byte the step touches by its buffer.
                    unsafe { launch_swizzle(&device, from, to, &s) }?;
                }
            }
        }
        Ok(out)
    }

    /// Queues `rows` runs of `row_bytes` bytes, `src[1]` / `dst[1]` bytes apart, from
    /// `src[0]` to `dst[0]` on the tessera stream: one device-to-device copy when the
    /// runs are contiguous, else one `cuMemcpy2DAsync`.
    ///
    /// # Safety
    ///
    /// The addresses are device memory of `device` holding every byte of the runs, the
    /// sources do not overlap the destinations, and both stay allocated until the copy
    /// has run on the stream.
    unsafe fn copy_2d(
        device: &CudaDevice,
        [src, src_pitch]: [u64; 2],
        [dst, dst_pitch]: [u64; 2],
        rows: usize,
        row_bytes: usize,
    ) -> Result<()> {
        if rows == 0 || row_bytes == 0 {
            return Ok(());
        }
        let stream = device.stream().cu_stream();
        if rows == 1 || (src_pitch == row_bytes as u64 && dst_pitch == row_bytes as u64) {
            // SAFETY: the caller's contract covers these rows · row_bytes bytes.
            return unsafe {
                cudarc::driver::result::memcpy_dtod_async(dst, src, rows * row_bytes, stream)
            }
            .cuda_op("cuMemcpyDtoDAsync");
        }
        let copy = sys::CUDA_MEMCPY2D {
            srcXInBytes: 0,
            srcY: 0,
            srcMemoryType: CUmemorytype::CU_MEMORYTYPE_DEVICE,
            srcHost: std::ptr::null(),
            srcDevice: src,
            srcArray: std::ptr::null_mut(),
            srcPitch: src_pitch as usize,
            dstXInBytes: 0,
            dstY: 0,
            dstMemoryType: CUmemorytype::CU_MEMORYTYPE_DEVICE,
            dstHost: std::ptr::null_mut(),
            dstDevice: dst,
            dstArray: std::ptr::null_mut(),
            dstPitch: dst_pitch as usize,
            WidthInBytes: row_bytes,
            Height: rows,
        };
        // SAFETY: `copy` describes device-to-device runs the caller's contract covers;
        // the driver reads the struct before returning.
        unsafe { sys::cuMemcpy2DAsync_v2(&copy, stream) }
            .result()
            .cuda_op("cuMemcpy2DAsync")
    }

    /// Queues `tessera_wire_swizzle` for step `s`: `src` and `dst` are the addresses
    /// of the step's source and destination (compact matrix or grid, per `to_grid`),
    /// offsets applied.
    ///
    /// # Safety
    ///
    /// Every compact and grid byte the step addresses lies in device memory of `device`
    /// that stays allocated until the kernel has run on the stream, and the source does
    /// not overlap the destination.
    unsafe fn launch_swizzle(
        device: &CudaDevice,
        src: u64,
        dst: u64,
        s: &SwizzleStep,
    ) -> Result<()> {
        let n = s.rows * s.cols;
        if n == 0 {
            return Ok(());
        }
        let f = device.function(&PTX, "tessera_wire_swizzle")?;
        let cfg = grid_1d(device, n, BLOCK)?;
        let [rows, cols, pitch, row0, col0, grid_cols] =
            [s.rows, s.cols, s.compact_pitch, s.row0, s.col0, s.grid_cols].map(|x| x as u64);
        let transposed = i32::from(s.transposed);
        let to_grid = i32::from(s.to_grid);
        let mut b = device.stream().launch_builder(&f);
        b.arg(&src)
            .arg(&dst)
            .arg(&rows)
            .arg(&cols)
            .arg(&pitch)
            .arg(&row0)
            .arg(&col0)
            .arg(&grid_cols)
            .arg(&transposed)
            .arg(&to_grid);
        // SAFETY: the kernel's parameters are (u64 src, u64 dst, u64 rows, u64 cols,
        // u64 pitch, u64 row0, u64 col0, u64 grid_cols, int transposed, int to_grid),
        // pushed in that order; the bytes it touches are valid (this function's
        // contract).
        unsafe { b.launch(cfg) }.cuda_op("cuLaunchKernel")?;
        Ok(())
    }

    #[cfg(test)]
    mod tests {
        use super::PTX;

        /// The embedded cubin was compiled from the PTX embedded beside it.
        #[test]
        fn embedded_sass_is_fresh() {
            PTX.check_sass_fresh().unwrap();
        }
    }
}
