//! The CUDA paths of the quantizers (feature `cuda`): the same bytes as the CPU
//! reference, computed on the device, with no round trip through the host.
//!
//! Quantizers whose scale depends on the whole tensor (FP8 current scaling, NVFP4's
//! global amax) run two passes: an amax pass into a device scalar, then the quantizing
//! kernel, which reads that scalar and computes its scales itself (no launch between the
//! two) and takes its tiles last first, so that it starts on the lines the amax pass
//! read last and L2 still holds (`cta_order` in kernels/common.cuh). The second pass is
//! a programmatic dependent launch (`Order::OverlapAmaxPass`): its CTAs load their tiles
//! while the amax pass finishes. The amax pass itself, and the one-thread kernel that
//! clears its scalar first (`tessera_clear_amaxes`), are programmatic launches too
//! (`Order::WaitFirst`), so nothing in the chain waits for the GPU to drain; the amax
//! pass lets its second pass launch only after its own wait (`pdl_amax_first` in
//! kernels/common.cuh), so the input is complete when the second pass reads it early.
//! An amax reduction across ranks is the one step that reads the amax back to the host
//! (and then the second pass launches the ordinary way).
//!
//! Dequantizers are one launch each, sized to their work rather than striding: a thread
//! per two 16-byte units of output for data in the output's order
//! (`dequant_units_grid`), a CTA per shared-memory tile for transposed columnwise data
//! (`dequant_cols_grid`).
//!
//! The one-pass kernels (MXFP8 and FP8 block quantization, the FP8 casts with a given
//! scale and the delayed-scaling update, every dequantizer, the layout helpers) are
//! programmatic dependent launches too (`Order::WaitFirst`): they let the next such
//! launch take the SM slots their CTAs free, and they touch memory only after the kernel
//! before them has finished. A run of them (the quantization of several tensors, a
//! quantization and its dequantization) overlaps each launch with the tail of the kernel
//! before instead of leaving the GPU idle between them.

pub(crate) mod block;
pub(crate) mod fp8;
pub mod layout;
pub(crate) mod mxfp8;
pub(crate) mod nvfp4;

use std::ffi::c_void;
use std::marker::PhantomData;

use cudarc::driver::{CudaFunction, DeviceRepr, LaunchConfig};
use tessera_core::cuda::{CudaDevice, CudaResultExt};
use tessera_core::kernels::PtxModule;
use tessera_core::{DType, Error, Result, Tensor};

use crate::Fp8Format;

/// The compiled kernels of `kernels/fp8.cu` (per-tensor FP8, amax, layouts).
pub(crate) const FP8_PTX: PtxModule = PtxModule {
    name: "tessera_quant_fp8",
    ptx: include_str!("../../kernels/ptx/fp8.ptx"),
};

/// The compiled kernels of `kernels/mxfp8.cu`.
pub(crate) const MXFP8_PTX: PtxModule = PtxModule {
    name: "tessera_quant_mxfp8",
    ptx: include_str!("../../kernels/ptx/mxfp8.ptx"),
};

/// The compiled kernels of `kernels/block.cu`.
pub(crate) const BLOCK_PTX: PtxModule = PtxModule {
    name: "tessera_quant_block",
    ptx: include_str!("../../kernels/ptx/block.ptx"),
};

/// The compiled kernels of `kernels/nvfp4.cu`.
pub(crate) const NVFP4_PTX: PtxModule = PtxModule {
    name: "tessera_quant_nvfp4",
    ptx: include_str!("../../kernels/ptx/nvfp4.ptx"),
};

/// Threads per block of every kernel here (their `__launch_bounds__`).
pub(crate) const BLOCK: u32 = 256;

/// `f32`, `bf16` or `f16`: the kernel-name suffix of an input dtype.
pub(crate) fn dtype_suffix(op: &'static str, dtype: DType) -> Result<&'static str> {
    match dtype {
        DType::F32 => Ok("f32"),
        DType::BF16 => Ok("bf16"),
        DType::F16 => Ok("f16"),
        other => Err(Error::dtype(op, "f32, bf16 or f16", other)),
    }
}

/// `e4m3` or `e5m2`.
pub(crate) fn format_suffix(f: Fp8Format) -> &'static str {
    f.name()
}

/// Output elements a dequantizing thread writes with one 16-byte store (`DEQ_VALS` in
/// `common.cuh`): 8 of bf16 or f16, 4 of f32.
pub(crate) fn dequant_vals(dtype: DType) -> usize {
    16 / dtype.size_in_bytes()
}

/// Units of work a dequantizing thread takes (`DEQ_UNITS` in `common.cuh`).
const DEQ_UNITS: usize = 2;

/// The launch of a dequantizer that gives each thread [`DEQ_UNITS`] units of work and does
/// not stride (`for_units` in `common.cuh`): the grid covers all `units`.
pub(crate) fn dequant_units_grid(units: usize) -> Result<LaunchConfig> {
    covering(
        "cuda dequantize",
        units.div_ceil(DEQ_UNITS).div_ceil(BLOCK as usize),
    )
}

/// The launch of a columnwise dequantizer that reads its stored `[k, m]` operand in tiles
/// of 64 stored rows by `tile_m` elements along `m`, a CTA per tile: `fp8_dequant_cols`
/// ([`FP8_DEQ_TILE_M`]) and NVFP4's ([`NVFP4_DEQ_TILE_M`]).
pub(crate) fn dequant_cols_grid(m: usize, k: usize, tile_m: usize) -> Result<LaunchConfig> {
    // The stored operand is [k, m]: its row-major tiles are what the kernels map blockIdx to.
    tile_grid("cuda dequantize columnwise", k, m, 64, tile_m)
}

/// `DEQ_TILE_M` in `common.cuh`.
pub(crate) const FP8_DEQ_TILE_M: usize = 256;
/// `NVFP4_DEQ_TILE_M` in `nvfp4.cu`.
pub(crate) const NVFP4_DEQ_TILE_M: usize = 256;

/// `blocks` CTAs of `BLOCK` threads on a 1-D grid, refused past the grid's limit of
/// 2^31 - 1 CTAs in x (the kernels launched this way do not stride, so a capped grid would
/// leave work undone).
fn covering(op: &'static str, blocks: usize) -> Result<LaunchConfig> {
    let blocks = i32::try_from(blocks.max(1)).map_err(|_| {
        Error::shape(
            op,
            format!(
                "{blocks} thread blocks exceed the launch grid's limit of {}",
                i32::MAX
            ),
        )
    })? as u32;
    Ok(LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (BLOCK, 1, 1),
        shared_mem_bytes: 0,
    })
}

/// A 2-D launch of 64×64 tiles over an `[rows, cols]` matrix (rows in x, cols in y).
pub(crate) fn tiles_64(rows: usize, cols: usize) -> Result<LaunchConfig> {
    let gy = cols.div_ceil(64).max(1);
    if gy > 65_535 {
        return Err(Error::shape(
            "cuda launch",
            format!("a matrix with {cols} columns exceeds the 64x65535-column tile grid"),
        ));
    }
    Ok(LaunchConfig {
        grid_dim: (
            rows.div_ceil(64).clamp(1, u32::MAX as usize) as u32,
            gy as u32,
            1,
        ),
        block_dim: (BLOCK, 1, 1),
        shared_mem_bytes: 0,
    })
}

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
    /// kernels/common.cuh),
    /// load their tiles, and wait for the amax in `pdl_wait()` (which keeps the loads
    /// ahead of the wait in the SASS too, see common.cuh). This hides the launch gap
    /// and the amax pass's tail: on an H200, bf16 4096x4096 FP8 current scaling (both)
    /// went from 0.93 to 0.99 of its two-pass floor (bench/cuda/quant_variants.cu).
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
    let config = sys::CUlaunchConfig {
        gridDimX: cfg.grid_dim.0,
        gridDimY: cfg.grid_dim.1,
        gridDimZ: cfg.grid_dim.2,
        blockDimX: cfg.block_dim.0,
        blockDimY: cfg.block_dim.1,
        blockDimZ: cfg.block_dim.2,
        sharedMemBytes: cfg.shared_mem_bytes,
        hStream: stream.cu_stream(),
        attrs: &mut attr,
        numAttrs: u32::from(order != Order::AfterPrevious),
    };
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

/// The buffers a both-orientations kernel writes, taken out of the output tensor (its
/// usage decides which exist) so the kernel owns them uniquely; scale buffers with
/// padding are cleared first ([`clear_tensor`]), because kernels write only the valid
/// entries and padding must read 0.
pub(crate) struct Outputs {
    pub(crate) q_row: Option<Tensor>,
    pub(crate) s_row: Option<Tensor>,
    pub(crate) q_col: Option<Tensor>,
    pub(crate) s_col: Option<Tensor>,
}

impl Outputs {
    /// Takes the buffers of `out` that its usage has, clearing padded scale buffers.
    ///
    /// `valid` holds the `[rows, cols]` of the entries the kernel writes in the rowwise
    /// and the columnwise scale buffer: a buffer of exactly that shape has no padding and
    /// is not cleared (one launch less per call).
    pub(crate) fn take(
        dev: &CudaDevice,
        out: &mut crate::QuantizedTensor,
        op: &'static str,
        valid: [[usize; 2]; 2],
    ) -> Result<Self> {
        use crate::BufferName as B;
        let usage = out.usage();
        let mut take = |name, wanted: bool| -> Result<Option<Tensor>> {
            if wanted {
                out.take_buffer(name).map(Some)
            } else {
                Ok(None)
            }
        };
        let mut o = Outputs {
            q_row: take(B::Data, usage.rowwise())?,
            s_row: take(B::ScaleInv, usage.rowwise())?,
            q_col: take(B::ColumnwiseData, usage.columnwise())?,
            s_col: take(B::ColumnwiseScaleInv, usage.columnwise())?,
        };
        for (s, valid) in [(&mut o.s_row, valid[0]), (&mut o.s_col, valid[1])] {
            let Some(s) = s else { continue };
            if s.shape().dims() == valid.as_slice() {
                continue;
            }
            clear_tensor(dev, op, s)?;
        }
        Ok(o)
    }

    /// `[rows, cols]` of a 2-D scale buffer, or zeros when absent.
    pub(crate) fn dims(t: &Option<Tensor>) -> [u64; 2] {
        t.as_ref().map_or([0, 0], |t| {
            [t.shape().dims()[0] as u64, t.shape().dims()[1] as u64]
        })
    }

    /// The device addresses of the four buffers (rows data, rows scales, columns data,
    /// columns scales), 0 (a null pointer to the kernels) where absent.
    pub(crate) fn addrs(&mut self, dev: &CudaDevice) -> Result<[u64; 4]> {
        let f = |t: &mut Option<Tensor>| t.as_mut().map_or(Ok(0), |t| device_addr_mut(dev, t));
        Ok([
            f(&mut self.q_row)?,
            f(&mut self.s_row)?,
            f(&mut self.q_col)?,
            f(&mut self.s_col)?,
        ])
    }

    /// Puts the buffers back into `out`.
    pub(crate) fn put_back(self, out: &mut crate::QuantizedTensor) {
        use crate::BufferName as B;
        for (name, t) in [
            (B::Data, self.q_row),
            (B::ScaleInv, self.s_row),
            (B::ColumnwiseData, self.q_col),
            (B::ColumnwiseScaleInv, self.s_col),
        ] {
            if let Some(t) = t {
                out.put_buffer(name, t);
            }
        }
    }
}

/// The launch of a tile kernel over an `[m, k]` matrix cut into `tm x tk` tiles: a 1-D
/// grid of one CTA per tile, which the kernel maps to its tile, in row-major order
/// (`tile_row` / `tile_col` in kernels/common.cuh; the general NVFP4 kernel takes them
/// column-major). Fails when there are more than 2^31 - 1 tiles.
pub(crate) fn tile_grid(
    op: &'static str,
    m: usize,
    k: usize,
    tm: usize,
    tk: usize,
) -> Result<LaunchConfig> {
    let tiles = m.div_ceil(tm).max(1).saturating_mul(k.div_ceil(tk).max(1));
    if tiles > i32::MAX as usize {
        return Err(Error::shape(
            op,
            format!(
                "[{m}, {k}] needs {tiles} tiles of {tm}x{tk}; the launch grid holds at most {}",
                i32::MAX
            ),
        ));
    }
    Ok(LaunchConfig {
        grid_dim: (tiles as u32, 1, 1),
        block_dim: (BLOCK, 1, 1),
        shared_mem_bytes: 0,
    })
}

/// The launch of a banded tile kernel (`tile_banded` in kernels/common.cuh) over an
/// `[m, k]` matrix cut into `t x t` tiles: bands of `h` tile rows, `h` the least power of
/// two at least the number of tile rows, at most 8; `grid.x` covers a band (its tile
/// columns times `h`, tile rows fastest), `grid.y` counts the bands. The last band's
/// tiles past the matrix have CTAs that return at once. Fails when a band holds more
/// than 2^31 - 1 tiles or there are more than 65535 bands.
pub(crate) fn banded_grid(op: &'static str, m: usize, k: usize, t: usize) -> Result<LaunchConfig> {
    let (gx, gy) = (m.div_ceil(t).max(1), k.div_ceil(t).max(1));
    let h = gx.next_power_of_two().min(1 << BAND_ROWS_LOG2);
    let (x, y) = (gy.saturating_mul(h), gx.div_ceil(h));
    if x > i32::MAX as usize || y > u16::MAX as usize {
        return Err(Error::shape(
            op,
            format!(
                "[{m}, {k}] needs {y} bands of {h} x {gy} tiles of {t}x{t}; a launch holds at \
                 most 65535 bands of at most {} tiles",
                i32::MAX
            ),
        ));
    }
    Ok(LaunchConfig {
        grid_dim: (x as u32, y as u32, 1),
        block_dim: (BLOCK, 1, 1),
        shared_mem_bytes: 0,
    })
}

/// log2 of the most tile rows in a band (`TQ_BAND_ROWS_LOG2` in kernels/common.cuh).
const BAND_ROWS_LOG2: u32 = 3;

/// The device address of a CUDA tensor's storage, for kernel arguments passed inside a
/// by-value struct.
pub(crate) fn device_addr(dev: &CudaDevice, t: &Tensor) -> Result<u64> {
    use cudarc::driver::DevicePtr;
    let (p, _sync) = t.cuda_slice()?.device_ptr(dev.stream());
    Ok(p)
}

/// The device addresses of a dequantizer's operands: the stored data `q`, its scale grid
/// `s` and the output `y`.
pub(crate) fn dequant_addrs(
    dev: &CudaDevice,
    q: &Tensor,
    s: &Tensor,
    y: &mut Tensor,
) -> Result<[u64; 3]> {
    Ok([
        device_addr(dev, q)?,
        device_addr(dev, s)?,
        device_addr_mut(dev, y)?,
    ])
}

/// The device address of a CUDA tensor's storage that a kernel will write, passed inside
/// a by-value struct. A storage shared with another tensor (a clone) is copied first, so
/// the write reaches this tensor alone.
pub(crate) fn device_addr_mut(dev: &CudaDevice, t: &mut Tensor) -> Result<u64> {
    use cudarc::driver::DevicePtrMut;
    let (p, _sync) = t.cuda_slice_mut()?.device_ptr_mut(dev.stream());
    Ok(p)
}

/// The device address of `out`, a global amax a kernel accumulates into, once `out` is
/// checked to be an `f32 [1]` on `x`'s device. [`clear_amaxes`] zeroes it.
pub(crate) fn amax_target(
    op: &'static str,
    dev: &CudaDevice,
    x: &Tensor,
    out: &mut Tensor,
) -> Result<u64> {
    if out.dtype() != DType::F32 || out.numel() != 1 || out.device() != x.device() {
        return Err(Error::invalid(
            op,
            format!(
                "an amax buffer must be an f32 [1] tensor on {}, got {} {} on {}",
                x.device(),
                out.dtype(),
                out.shape(),
                out.device()
            ),
        ));
    }
    device_addr_mut(dev, out)
}

/// Zeroes the amax scalars at `a` and, unless it is 0, `b` (addresses from
/// [`amax_target`]) with `tessera_clear_amaxes`: a programmatic launch, where a memset
/// would end the chain of early launches before the amax pass.
///
/// # Safety
/// `a`, and `b` unless it is 0, must be the device addresses of `f32` scalars on `dev`
/// that nothing else uses while the kernel runs.
pub(crate) unsafe fn clear_amaxes(
    dev: &CudaDevice,
    op: &'static str,
    a: u64,
    b: u64,
) -> Result<()> {
    let f = dev.function(&FP8_PTX, "tessera_clear_amaxes")?;
    let cfg = LaunchConfig {
        grid_dim: (1, 1, 1),
        block_dim: (32, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut p = Params::default();
    p.arg(&a).arg(&b);
    // SAFETY: tessera_clear_amaxes(float* a, float* b): a and b (unless 0, a null
    // pointer) address f32 scalars on this device (the caller's contract); the kernel
    // touches memory only after its pdl_first().
    unsafe { launch_params(dev, &f, cfg, op, Order::WaitFirst, &mut p) }
}

/// Zeroes the storage of `t`, a CUDA tensor on `dev`, with `tessera_clear_bytes`: a
/// programmatic launch (`Order::WaitFirst`), where a memset would end the chain of early
/// launches (the kernel after a memset starts only once it is done, and the memset only
/// once the kernel before has finished).
pub(crate) fn clear_tensor(dev: &CudaDevice, op: &'static str, t: &mut Tensor) -> Result<()> {
    let len = t.size_in_bytes();
    if len == 0 {
        return Ok(());
    }
    let addr = device_addr_mut(dev, t)?;
    let f = dev.function(&FP8_PTX, "tessera_clear_bytes")?;
    // A thread per 16-byte word, and at least 16 for the bytes around them.
    let cfg = tessera_core::cuda::grid_1d(dev, (len / 16).max(16), BLOCK)?;
    let n = len as u64;
    let mut p = Params::default();
    p.arg(&addr).arg(&n);
    // SAFETY: tessera_clear_bytes(uint8_t* p, u64 n): addr addresses the len bytes of
    // t's storage on this device, which the kernel alone writes; it touches memory only
    // after its pdl_first().
    unsafe { launch_params(dev, &f, cfg, op, Order::WaitFirst, &mut p) }
}

/// The device handle of a CUDA tensor.
pub(crate) fn device_of(t: &Tensor) -> Result<std::sync::Arc<CudaDevice>> {
    Ok(t.cuda_device()?.clone())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dequantizer_grids_cover_their_work_and_refuse_past_the_grid_limit() {
        // Two units a thread, in whole CTAs: every unit has a thread, with less than a
        // CTA to spare.
        for units in [1usize, 511, 512, 513, 1 << 20, 16384 * 8192 / 8 + 3] {
            let cfg = dequant_units_grid(units).unwrap();
            let threads = cfg.grid_dim.0 as usize * BLOCK as usize;
            assert!(
                threads * DEQ_UNITS >= units,
                "{units} units, {threads} threads"
            );
            assert!(
                (threads - BLOCK as usize) * DEQ_UNITS < units,
                "{units} units, {threads} threads"
            );
        }
        // No work still launches one CTA (the per-tensor kernel's tail needs threads).
        assert_eq!(dequant_units_grid(0).unwrap().grid_dim, (1, 1, 1));
        // A CTA per tile of 64 stored rows by `tile_m`, ragged edges rounded up.
        assert_eq!(
            dequant_cols_grid(16384, 8192, FP8_DEQ_TILE_M)
                .unwrap()
                .grid_dim,
            (128 * 64, 1, 1)
        );
        assert_eq!(
            dequant_cols_grid(6176, 4192, NVFP4_DEQ_TILE_M)
                .unwrap()
                .grid_dim,
            (66 * 25, 1, 1)
        );
        // The kernels do not stride, so a grid past 2^31 - 1 CTAs (CUDA's limit in x) is an
        // error, not a silently capped launch.
        let per_cta = BLOCK as usize * DEQ_UNITS;
        assert_eq!(
            dequant_units_grid(i32::MAX as usize * per_cta)
                .unwrap()
                .grid_dim,
            (i32::MAX as u32, 1, 1)
        );
        assert!(dequant_units_grid((i32::MAX as usize + 1) * per_cta).is_err());
        assert!(dequant_cols_grid(1 << 40, 1 << 20, FP8_DEQ_TILE_M).is_err());
        let e = dequant_units_grid(1 << 45).unwrap_err();
        assert!(matches!(e, Error::Shape { .. }), "{e}");
        assert!(e.to_string().contains("exceed the launch grid"), "{e}");
    }

    #[test]
    fn tile_grid_launches_one_cta_per_tile_on_a_1d_grid() {
        let cfg = tile_grid("test", 16384, 8192, 128, 128).unwrap();
        assert_eq!(cfg.grid_dim, (128 * 64, 1, 1));
        assert_eq!(cfg.block_dim, (BLOCK, 1, 1));
        // Ragged edges round up; an empty matrix still launches one CTA.
        assert_eq!(
            tile_grid("test", 65, 257, 64, 256).unwrap().grid_dim,
            (2 * 2, 1, 1)
        );
        assert_eq!(
            tile_grid("test", 0, 0, 32, 128).unwrap().grid_dim,
            (1, 1, 1)
        );
        // K of more than 65535 tiles is fine now that the grid is 1-D.
        assert_eq!(
            tile_grid("test", 32, 128 * 70_000, 32, 128)
                .unwrap()
                .grid_dim,
            (70_000, 1, 1)
        );
    }

    #[test]
    fn banded_grid_covers_bands_of_a_power_of_two_tile_rows() {
        // 128 x 64 tiles: 16 bands of 8 tile rows.
        let cfg = banded_grid("test", 16384, 8192, 128).unwrap();
        assert_eq!(cfg.grid_dim, (8 * 64, 16, 1));
        assert_eq!(cfg.block_dim, (BLOCK, 1, 1));
        // 33 tile rows: a fifth band of 8 with one tile row in the matrix.
        assert_eq!(
            banded_grid("test", 33 * 128, 128, 128).unwrap().grid_dim,
            (8, 5, 1)
        );
        // 3 tile rows: one band of 4 (the least power of two), ragged columns round up.
        assert_eq!(
            banded_grid("test", 3 * 128 - 16, 129, 128)
                .unwrap()
                .grid_dim,
            (4 * 2, 1, 1)
        );
        // One tile row, and an empty matrix: bands of one.
        assert_eq!(
            banded_grid("test", 16, 1024, 128).unwrap().grid_dim,
            (8, 1, 1)
        );
        assert_eq!(banded_grid("test", 0, 0, 128).unwrap().grid_dim, (1, 1, 1));
    }

    #[test]
    fn banded_grid_refuses_what_a_launch_cannot_hold() {
        // 65536 bands of 8 tile rows of 128.
        let err = banded_grid("test", 128 * 8 * 65536, 128, 128).unwrap_err();
        assert!(err.to_string().contains("65536 bands"), "{err}");
        // A band of 8 x 2^28 tiles.
        let err = banded_grid("test", 128 * 8, 128 << 28, 128).unwrap_err();
        assert!(err.to_string().contains("2147483647"), "{err}");
    }

    #[test]
    fn tile_grid_refuses_more_tiles_than_a_launch_holds() {
        let err = tile_grid("test", 1 << 26, 1 << 20, 32, 128).unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains("[67108864, 1048576]") && msg.contains("2147483647"),
            "{msg}"
        );
    }

    /// `tessera_clear_bytes` zeroes exactly its `n` bytes, from any start: inside a
    /// buffer of 0xA5 bytes, ranges that start and end on and off 16-byte boundaries
    /// (and `clear_tensor` on whole buffers) leave every byte outside them as it was.
    #[test]
    #[ignore = "needs a CUDA GPU: cargo xtask test-gpu"]
    fn clear_bytes_zeroes_exactly_its_range() {
        assert!(
            tessera_core::cuda::is_available(),
            "this test needs a CUDA GPU; run it with `cargo xtask test-gpu`"
        );
        let gpu = tessera_core::Device::Cuda(0);
        let dev = tessera_core::cuda::device(0).unwrap();
        let f = dev.function(&FP8_PTX, "tessera_clear_bytes").unwrap();
        for len in [1usize, 15, 16, 17, 33, 4096 + 5, (1 << 20) + 3] {
            for (start, n) in [(0, len), (1, len.saturating_sub(2)), (7, len / 2), (16, 1)] {
                if start + n > len {
                    continue;
                }
                let mut t = Tensor::filled_with_byte([len], DType::U8, gpu, 0xA5).unwrap();
                let addr = device_addr_mut(&dev, &mut t).unwrap() + start as u64;
                let n64 = n as u64;
                let cfg = tessera_core::cuda::grid_1d(&dev, (n / 16).max(16), BLOCK).unwrap();
                let mut p = Params::default();
                p.arg(&addr).arg(&n64);
                // SAFETY: tessera_clear_bytes(uint8_t* p, u64 n): [start, start + n) lies
                // inside t's len bytes, which nothing else uses.
                unsafe { launch_params(&dev, &f, cfg, "test", Order::WaitFirst, &mut p) }.unwrap();
                let got = t.to_vec::<u8>().unwrap();
                for (i, &b) in got.iter().enumerate() {
                    let want = if (start..start + n).contains(&i) {
                        0
                    } else {
                        0xA5
                    };
                    assert_eq!(b, want, "len {len}, range {start}+{n}: byte {i}");
                }
            }
            let mut t = Tensor::filled_with_byte([len], DType::U8, gpu, 0xA5).unwrap();
            clear_tensor(&dev, "test", &mut t).unwrap();
            assert!(
                t.to_vec::<u8>().unwrap().iter().all(|&b| b == 0),
                "len {len}"
            );
        }
    }
}
