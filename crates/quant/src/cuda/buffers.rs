//! The device side of tensors for the kernels: addresses passed by value, the output
//! buffers a quantizer writes ([`Outputs`]), and clearing (amax scalars, padded scale
//! grids) by programmatic launches instead of memsets.

use cudarc::driver::LaunchConfig;
use tessera_core::cuda::CudaDevice;
use tessera_core::{DType, Error, Result, Tensor};

use super::{BLOCK, FP8_PTX, Order, Params, launch_params};

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
    fn addrs(&mut self, dev: &CudaDevice) -> Result<[u64; 4]> {
        let f = |t: &mut Option<Tensor>| t.as_mut().map_or(Ok(0), |t| device_addr_mut(dev, t));
        Ok([
            f(&mut self.q_row)?,
            f(&mut self.s_row)?,
            f(&mut self.q_col)?,
            f(&mut self.s_col)?,
        ])
    }

    /// Runs `launch` with the buffers' [`addrs`](Self::addrs) unless `empty` (an empty
    /// input, whose buffers are all empty: a launch would still start one tile), then
    /// puts the buffers back into `out` whatever `launch` returned.
    pub(crate) fn launch_and_put_back(
        mut self,
        dev: &CudaDevice,
        out: &mut crate::QuantizedTensor,
        empty: bool,
        launch: impl FnOnce([u64; 4]) -> Result<()>,
    ) -> Result<()> {
        let launched = if empty {
            Ok(())
        } else {
            self.addrs(dev).and_then(launch)
        };
        self.put_back(out);
        launched
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

    /// `tessera_clear_bytes` zeroes exactly its `n` bytes, from any start: inside a
    /// buffer of 0xA5 bytes, ranges that start and end on and off 16-byte boundaries
    /// (and `clear_tensor` on whole buffers) leave every byte outside them as it was.
    #[test]
    #[ignore = "needs a CUDA GPU: cargo xtask test-gpu"]
    fn clear_bytes_zeroes_exactly_its_range() {
        super::super::require_gpu();
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
