//! Per-tensor FP8 on the device.

use cudarc::driver::PushKernelArg;
use tessera_core::cuda::{CudaDevice, grid_1d};
use tessera_core::{DType, Device, Error, Result, Shape, Tensor};

use super::{BLOCK, FP8_PTX, device_of, dtype_suffix, format_suffix, launch, tile_grid};
use crate::values::check_input;
use crate::{BufferName, Fp8Format, QuantizedTensor};

/// NaN-ignoring `max |x|` of a CUDA tensor into a new device `f32 [1]`.
pub(crate) fn amax(x: &Tensor) -> Result<Tensor> {
    const OP: &str = "cuda amax";
    let dev = device_of(x)?;
    let mut out = Tensor::zeros([1], DType::F32, x.device())?;
    let n = x.numel() as u64;
    let f = dev.function(
        &FP8_PTX,
        &format!("tessera_amax_{}", dtype_suffix(OP, x.dtype())?),
    )?;
    let per = 16 / x.dtype().size_in_bytes();
    let cfg = grid_1d(&dev, x.numel().div_ceil(per), BLOCK)?;
    let dst = out.cuda_slice_mut()?;
    // SAFETY: tessera_amax_T(const T* x, u64 n, float* out): x holds n elements of T
    // (dtype-checked by the kernel name), out one float.
    unsafe {
        launch(&dev, &f, cfg, OP, |b| {
            b.arg(x.cuda_slice().expect("checked")).arg(&n).arg(dst);
        })
    }?;
    Ok(out)
}

/// `scale = compute_scale_from_amax(amax)` on the device, into a new `f32 [1]`.
pub(crate) fn scale_from_amax(
    dev: &CudaDevice,
    device: Device,
    amax: &Tensor,
    fp8_max: f32,
    pow2: bool,
    eps: f32,
) -> Result<Tensor> {
    let mut scale = Tensor::empty([1], DType::F32, device)?;
    let f = dev.function(&FP8_PTX, "tessera_fp8_scale_from_amax")?;
    let (pow2, value_for_inf) = (i32::from(pow2), f32::MAX);
    let cfg = cudarc::driver::LaunchConfig {
        grid_dim: (1, 1, 1),
        block_dim: (1, 1, 1),
        shared_mem_bytes: 0,
    };
    let dst = scale.cuda_slice_mut()?;
    // SAFETY: (const float* amax, float fp8_max, int pow2, float eps, float
    // value_for_inf, float* scale), both pointers one float.
    unsafe {
        launch(dev, &f, cfg, "cuda scale_from_amax", |b| {
            b.arg(amax.cuda_slice().expect("device tensor"))
                .arg(&fp8_max)
                .arg(&pow2)
                .arg(&eps)
                .arg(&value_for_inf)
                .arg(dst);
        })
    }?;
    Ok(scale)
}

/// Casts `x` with the device scale `scale` (`f32 [1]`) into `out`'s buffers (its usage
/// decides which); `amax`, when given, collects `max |x|`.
pub(crate) fn cast_into(
    x: &Tensor,
    scale: &Tensor,
    format: Fp8Format,
    out: &mut QuantizedTensor,
    amax: Option<&mut Tensor>,
) -> Result<()> {
    const OP: &str = "cuda fp8 cast";
    let (m, k) = check_input(OP, x)?;
    let dev = device_of(x)?;
    let sfx = dtype_suffix(OP, x.dtype())?;
    let fmt = format_suffix(format);
    let usage = out.usage();
    let null = 0u64;
    let amax_ptr = match amax {
        Some(a) => Some(a.cuda_slice_mut()?),
        None => None,
    };
    let mut scale_inv = out.take_buffer(BufferName::ScaleInv)?;
    let sis = scale_inv.cuda_slice_mut()?;
    if usage.columnwise() {
        let mut q = match usage.rowwise() {
            true => Some(out.take_buffer(BufferName::Data)?),
            false => None,
        };
        let mut qt = out.take_buffer(BufferName::ColumnwiseData)?;
        let f = dev.function(&FP8_PTX, &format!("tessera_fp8_cast_transpose_{sfx}_{fmt}"))?;
        let cfg = tile_grid(OP, m, k, 128, 128)?;
        let (mu, ku) = (m as u64, k as u64);
        {
            let qs = match q.as_mut() {
                Some(q) => Some(q.cuda_slice_mut()?),
                None => None,
            };
            let qts = qt.cuda_slice_mut()?;
            // SAFETY: (const T* x, u8* q, u8* qt, u64 m, u64 k, const float* scale, float*
            // scale_inv, float* amax): x is [m, k] of T, q [m, k] bytes or null, qt [k, m]
            // bytes, scale/scale_inv/amax one float each (amax may be null).
            unsafe {
                launch(&dev, &f, cfg, OP, |b| {
                    b.arg(x.cuda_slice().expect("device tensor"));
                    match qs {
                        Some(q) => b.arg(q),
                        None => b.arg(&null),
                    };
                    b.arg(qts)
                        .arg(&mu)
                        .arg(&ku)
                        .arg(scale.cuda_slice().expect("device tensor"))
                        .arg(sis);
                    match amax_ptr {
                        Some(a) => b.arg(a),
                        None => b.arg(&null),
                    };
                })
            }?;
        }
        out.put_buffer(BufferName::ColumnwiseData, qt);
        if let Some(q) = q {
            out.put_buffer(BufferName::Data, q);
        }
    } else {
        let mut q = out.take_buffer(BufferName::Data)?;
        let f = dev.function(&FP8_PTX, &format!("tessera_fp8_cast_{sfx}_{fmt}"))?;
        let n = x.numel() as u64;
        let cfg = grid_1d(&dev, x.numel().div_ceil(16), BLOCK)?;
        {
            let qs = q.cuda_slice_mut()?;
            // SAFETY: (const T* x, u8* q, u64 n, const float* scale, float* scale_inv,
            // float* amax): x holds n elements of T, q n bytes; 16-element steps read
            // 16-byte-aligned vectors (allocations are 256-byte aligned and steps start at
            // multiples of 16 elements).
            unsafe {
                launch(&dev, &f, cfg, OP, |b| {
                    b.arg(x.cuda_slice().expect("device tensor"))
                        .arg(qs)
                        .arg(&n)
                        .arg(scale.cuda_slice().expect("device tensor"))
                        .arg(sis);
                    match amax_ptr {
                        Some(a) => b.arg(a),
                        None => b.arg(&null),
                    };
                })
            }?;
        }
        out.put_buffer(BufferName::Data, q);
    }
    out.put_buffer(BufferName::ScaleInv, scale_inv);
    out.source_dtype = x.dtype();
    Ok(())
}

/// Dequantizes rowwise FP8 bytes `q` (any shape) with `scale_inv` into `dtype`.
pub(crate) fn dequantize(
    q: &Tensor,
    scale_inv: &Tensor,
    format: Fp8Format,
    dtype: DType,
) -> Result<Tensor> {
    const OP: &str = "cuda fp8 dequantize";
    let dev = device_of(q)?;
    let mut y = Tensor::empty(q.shape(), dtype, q.device())?;
    let f = dev.function(
        &FP8_PTX,
        &format!(
            "tessera_fp8_dequant_{}_{}",
            dtype_suffix(OP, dtype)?,
            format_suffix(format)
        ),
    )?;
    let n = q.numel() as u64;
    // Thread per 16 elements; at least 16 threads for the last n % 16.
    let cfg = grid_1d(&dev, (q.numel() / 16).max(16), BLOCK)?;
    let ys = y.cuda_slice_mut()?;
    // SAFETY: (const u8* q, T* y, u64 n, const float* scale_inv): q n bytes, y n elements
    // of T, scale_inv one float.
    unsafe {
        launch(&dev, &f, cfg, OP, |b| {
            b.arg(q.cuda_slice().expect("device tensor"))
                .arg(ys)
                .arg(&n)
                .arg(scale_inv.cuda_slice().expect("device tensor"));
        })
    }?;
    Ok(y)
}

/// Dequantizes the transposed columnwise FP8 data `qt` (`[k, m]` bytes) of an `[m, k]`
/// tensor straight into `[m, k]` elements of `dtype` (no separate transpose).
pub(crate) fn dequantize_transposed(
    qt: &Tensor,
    scale_inv: &Tensor,
    format: Fp8Format,
    dtype: DType,
    shape: &Shape,
) -> Result<Tensor> {
    const OP: &str = "cuda fp8 dequantize columnwise";
    let (m, k) = shape.flat_2d();
    if qt.numel() != m * k {
        return Err(Error::shape(
            OP,
            format!(
                "columnwise data of {} bytes for a tensor of shape {shape} (expected {})",
                qt.numel(),
                m * k
            ),
        ));
    }
    let dev = device_of(qt)?;
    let mut y = Tensor::empty(shape, dtype, qt.device())?;
    let f = dev.function(
        &FP8_PTX,
        &format!(
            "tessera_fp8_dequant_t_{}_{}",
            dtype_suffix(OP, dtype)?,
            format_suffix(format)
        ),
    )?;
    let (mu, ku) = (m as u64, k as u64);
    // Thread per run of 16 stored bytes (per element when m % 16 != 0; grid-stride).
    let cfg = grid_1d(&dev, m * k, BLOCK)?;
    let ys = y.cuda_slice_mut()?;
    // SAFETY: (const u8* q, T* y, u64 m, u64 k, const float* scale_inv): q holds the
    // m*k bytes of the [k, m] transpose (checked above), y m*k elements of T, scale_inv
    // one float.
    unsafe {
        launch(&dev, &f, cfg, OP, |b| {
            b.arg(qt.cuda_slice().expect("device tensor"))
                .arg(ys)
                .arg(&mu)
                .arg(&ku)
                .arg(scale_inv.cuda_slice().expect("device tensor"));
        })
    }?;
    Ok(y)
}
