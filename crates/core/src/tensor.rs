//! Dense tensors whose bytes live on the host or on a CUDA device.

use std::fmt;
use std::sync::Arc;

use crate::{DType, Device, Element, Error, Result, Shape, bf16, f16};

#[cfg(feature = "cuda")]
use crate::cuda::{CudaDevice, CudaResultExt};
#[cfg(feature = "cuda")]
use cudarc::driver::CudaSlice;

/// A dense, contiguous, row-major tensor: shape, dtype and storage.
///
/// Plain data with no autograd. Cloning is cheap (the storage is shared through an
/// `Arc`); the mutating accessors copy the storage first when it is shared
/// (copy-on-write), so a clone never observes another clone's writes.
///
/// Storage is host memory (64-byte aligned, so any [`Element`] view is aligned) or, with
/// the `cuda` feature, a device allocation on the owning device's tessera stream.
#[derive(Clone)]
pub struct Tensor {
    shape: Shape,
    dtype: DType,
    storage: Arc<Storage>,
}

#[derive(Clone)]
enum Storage {
    Host(HostBuffer),
    #[cfg(feature = "cuda")]
    Cuda(CudaBuffer),
}

/// Host bytes with 64-byte alignment.
#[derive(Clone)]
struct HostBuffer {
    chunks: Vec<Chunk>,
    len: usize,
}

#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
#[repr(C, align(64))]
struct Chunk([u8; 64]);

impl HostBuffer {
    /// `len` zero bytes. Large buffers come from the allocator's zeroed memory
    /// (`calloc`: fresh pages are zero without being written), so allocating an output
    /// that will be overwritten costs no pass over it.
    fn zeroed(len: usize) -> Result<Self> {
        let n = len.div_ceil(64);
        let too_large = || {
            Error::shape(
                "Tensor::alloc",
                format!("cannot allocate {len} bytes of host memory"),
            )
        };
        if n == 0 {
            return Ok(HostBuffer {
                chunks: Vec::new(),
                len,
            });
        }
        let layout = std::alloc::Layout::array::<Chunk>(n).map_err(|_| too_large())?;
        // SAFETY: `layout` has a non-zero size (n > 0) and Chunk's alignment.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) }.cast::<Chunk>();
        if ptr.is_null() {
            return Err(too_large());
        }
        // SAFETY: `ptr` was allocated by the global allocator with the layout of exactly
        // `n` Chunks (so capacity n), and all `n` are initialised: all-zero bytes are a
        // valid Chunk (it is Zeroable).
        let chunks = unsafe { Vec::from_raw_parts(ptr, n, n) };
        Ok(HostBuffer { chunks, len })
    }

    fn bytes(&self) -> &[u8] {
        &bytemuck::cast_slice(&self.chunks)[..self.len]
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        &mut bytemuck::cast_slice_mut(&mut self.chunks)[..self.len]
    }
}

#[cfg(feature = "cuda")]
#[derive(Clone)]
struct CudaBuffer {
    device: Arc<CudaDevice>,
    slice: CudaSlice<u8>,
}

#[cfg(feature = "cuda")]
impl CudaBuffer {
    fn try_clone(&self, len: usize) -> Result<Self> {
        let mut slice = self.device.alloc_bytes(len)?;
        self.device
            .stream()
            .memcpy_dtod(&self.slice.slice(..len), &mut slice.slice_mut(..len))
            .cuda_op("cuMemcpyDtoDAsync")?;
        Ok(CudaBuffer {
            device: self.device.clone(),
            slice,
        })
    }
}

/// The byte size of `numel` elements of `dtype`, or an error for impossible sizes.
fn byte_len(op: &'static str, shape: &Shape, dtype: DType) -> Result<usize> {
    shape
        .numel()
        .checked_mul(dtype.size_in_bytes())
        .filter(|&b| b <= isize::MAX as usize)
        .ok_or_else(|| {
            Error::shape(
                op,
                format!("a {dtype} tensor of shape {shape} is too large"),
            )
        })
}

impl Tensor {
    /// A tensor of zeros.
    pub fn zeros(shape: impl Into<Shape>, dtype: DType, device: Device) -> Result<Tensor> {
        Self::filled_with_byte(shape, dtype, device, 0)
    }

    /// A tensor whose every byte is `byte` — e.g. a poisoned output buffer that makes
    /// unwritten bytes visible in tests.
    pub fn filled_with_byte(
        shape: impl Into<Shape>,
        dtype: DType,
        device: Device,
        byte: u8,
    ) -> Result<Tensor> {
        let shape = shape.into();
        let len = byte_len("Tensor::filled_with_byte", &shape, dtype)?;
        let storage = match device {
            Device::Cpu => {
                let mut buf = HostBuffer::zeroed(len)?;
                if byte != 0 {
                    buf.bytes_mut().fill(byte);
                }
                Storage::Host(buf)
            }
            Device::Cuda(ordinal) => cuda_storage(ordinal, len, Init::Byte(byte))?,
        };
        Ok(Tensor {
            shape,
            dtype,
            storage: Arc::new(storage),
        })
    }

    /// A tensor whose contents are unspecified: zeros on the host, whatever the
    /// allocator returns on a device. For outputs that are fully overwritten.
    pub fn empty(shape: impl Into<Shape>, dtype: DType, device: Device) -> Result<Tensor> {
        let shape = shape.into();
        let len = byte_len("Tensor::empty", &shape, dtype)?;
        let storage = match device {
            Device::Cpu => Storage::Host(HostBuffer::zeroed(len)?),
            Device::Cuda(ordinal) => cuda_storage(ordinal, len, Init::Uninit)?,
        };
        Ok(Tensor {
            shape,
            dtype,
            storage: Arc::new(storage),
        })
    }

    /// A tensor holding `data`, which must have exactly `shape.numel()` elements.
    pub fn from_slice<T: Element>(
        data: &[T],
        shape: impl Into<Shape>,
        device: Device,
    ) -> Result<Tensor> {
        Self::from_bytes(bytemuck::cast_slice(data), shape, T::DTYPE, device)
    }

    /// A tensor of the floating-point `dtype` (f32, bf16 or f16) holding `values`, each
    /// rounded to nearest-even where `dtype` is narrower (what `half`'s `from_f32` does).
    /// `values` must have exactly `shape.numel()` elements.
    pub fn from_f32_values(
        values: &[f32],
        shape: impl Into<Shape>,
        dtype: DType,
        device: Device,
    ) -> Result<Tensor> {
        match dtype {
            DType::F32 => Self::from_slice(values, shape, device),
            DType::BF16 => {
                let v: Vec<bf16> = values.iter().map(|&x| bf16::from_f32(x)).collect();
                Self::from_slice(&v, shape, device)
            }
            DType::F16 => {
                let v: Vec<f16> = values.iter().map(|&x| f16::from_f32(x)).collect();
                Self::from_slice(&v, shape, device)
            }
            other => Err(Error::dtype(
                "Tensor::from_f32_values",
                "f32, bf16 or f16",
                other,
            )),
        }
    }

    /// A tensor of `dtype` holding these bytes, which must be exactly
    /// `shape.numel() * dtype.size_in_bytes()` long.
    pub fn from_bytes(
        bytes: &[u8],
        shape: impl Into<Shape>,
        dtype: DType,
        device: Device,
    ) -> Result<Tensor> {
        let shape = shape.into();
        let len = byte_len("Tensor::from_bytes", &shape, dtype)?;
        if bytes.len() != len {
            return Err(Error::shape(
                "Tensor::from_bytes",
                format!(
                    "a {dtype} tensor of shape {shape} needs {len} bytes, got {}",
                    bytes.len()
                ),
            ));
        }
        let storage = match device {
            Device::Cpu => {
                let mut buf = HostBuffer::zeroed(len)?;
                buf.bytes_mut().copy_from_slice(bytes);
                Storage::Host(buf)
            }
            Device::Cuda(ordinal) => cuda_storage(ordinal, len, Init::Copy(bytes))?,
        };
        Ok(Tensor {
            shape,
            dtype,
            storage: Arc::new(storage),
        })
    }

    /// The shape.
    pub fn shape(&self) -> &Shape {
        &self.shape
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Where the bytes live.
    pub fn device(&self) -> Device {
        match &*self.storage {
            Storage::Host(_) => Device::Cpu,
            #[cfg(feature = "cuda")]
            Storage::Cuda(b) => Device::Cuda(b.device.ordinal()),
        }
    }

    /// Number of elements (for [`DType::F4E2M1x2`], packed bytes).
    pub fn numel(&self) -> usize {
        self.shape.numel()
    }

    /// Number of bytes.
    pub fn size_in_bytes(&self) -> usize {
        self.numel() * self.dtype.size_in_bytes()
    }

    /// `true` when both tensors share one storage (one is a clone or reshape of the
    /// other and neither has been written since).
    pub fn shares_storage_with(&self, other: &Tensor) -> bool {
        Arc::ptr_eq(&self.storage, &other.storage)
    }

    /// The same storage viewed with another shape of the same element count.
    pub fn reshape(&self, shape: impl Into<Shape>) -> Result<Tensor> {
        let shape = shape.into();
        if shape.numel() != self.numel() {
            return Err(Error::shape(
                "Tensor::reshape",
                format!(
                    "cannot view a tensor of shape {} ({} elements) as {shape} ({} elements)",
                    self.shape,
                    self.numel(),
                    shape.numel()
                ),
            ));
        }
        Ok(Tensor {
            shape,
            dtype: self.dtype,
            storage: self.storage.clone(),
        })
    }

    /// Checks that the tensor has dtype `expected`, for operation `op`.
    pub fn expect_dtype(&self, op: &'static str, expected: DType) -> Result<()> {
        if self.dtype == expected {
            Ok(())
        } else {
            Err(Error::dtype(op, expected.name(), self.dtype))
        }
    }

    /// The bytes of a host tensor.
    pub fn as_bytes(&self) -> Result<&[u8]> {
        match &*self.storage {
            Storage::Host(b) => Ok(b.bytes()),
            #[cfg(feature = "cuda")]
            Storage::Cuda(_) => Err(self.not_on_host("Tensor::as_bytes")),
        }
    }

    /// The bytes of a host tensor, for writing (copies a shared storage first).
    pub fn as_bytes_mut(&mut self) -> Result<&mut [u8]> {
        if !self.device().is_cpu() {
            return Err(self.not_on_host("Tensor::as_bytes_mut"));
        }
        match Arc::make_mut(&mut self.storage) {
            Storage::Host(b) => Ok(b.bytes_mut()),
            #[cfg(feature = "cuda")]
            Storage::Cuda(_) => unreachable!("checked to be on the host above"),
        }
    }

    /// The elements of a host tensor of dtype `T::DTYPE`.
    pub fn as_slice<T: Element>(&self) -> Result<&[T]> {
        self.expect_dtype("Tensor::as_slice", T::DTYPE)?;
        Ok(bytemuck::cast_slice(self.as_bytes()?))
    }

    /// The elements of a host tensor of dtype `T::DTYPE`, for writing.
    pub fn as_mut_slice<T: Element>(&mut self) -> Result<&mut [T]> {
        self.expect_dtype("Tensor::as_mut_slice", T::DTYPE)?;
        Ok(bytemuck::cast_slice_mut(self.as_bytes_mut()?))
    }

    /// A copy of the bytes, from any device (waits for a device's queued work).
    pub fn to_bytes(&self) -> Result<Vec<u8>> {
        match &*self.storage {
            Storage::Host(b) => Ok(b.bytes().to_vec()),
            #[cfg(feature = "cuda")]
            Storage::Cuda(b) => {
                let len = self.size_in_bytes();
                let mut out = vec![0u8; len];
                b.device
                    .stream()
                    .memcpy_dtoh(&b.slice.slice(..len), &mut out)
                    .cuda_op("cuMemcpyDtoHAsync")?;
                b.device.synchronize()?;
                Ok(out)
            }
        }
    }

    /// A copy of the elements, from any device.
    pub fn to_vec<T: Element>(&self) -> Result<Vec<T>> {
        self.expect_dtype("Tensor::to_vec", T::DTYPE)?;
        let bytes = self.to_bytes()?;
        Ok(bytemuck::pod_collect_to_vec(&bytes))
    }

    /// The elements of a floating-point tensor (f32, bf16 or f16) as f32 values (exact),
    /// from any device.
    pub fn to_f32_vec(&self) -> Result<Vec<f32>> {
        fn widen<T: Element>(t: &Tensor, f: impl Fn(T) -> f32) -> Result<Vec<f32>> {
            Ok(t.to_vec::<T>()?.into_iter().map(f).collect())
        }
        match self.dtype {
            DType::F32 => self.to_vec::<f32>(),
            DType::BF16 => widen(self, bf16::to_f32),
            DType::F16 => widen(self, f16::to_f32),
            other => Err(Error::dtype(
                "Tensor::to_f32_vec",
                "f32, bf16 or f16",
                other,
            )),
        }
    }

    /// This tensor on `device`: a cheap clone when it is already there, else a copy.
    pub fn to_device(&self, device: Device) -> Result<Tensor> {
        if device == self.device() {
            return Ok(self.clone());
        }
        match (&*self.storage, device) {
            (Storage::Host(b), _) => Tensor::from_bytes(b.bytes(), &self.shape, self.dtype, device),
            #[cfg(feature = "cuda")]
            (Storage::Cuda(_), _) => {
                // Device to host, or between two devices through the host.
                Tensor::from_bytes(&self.to_bytes()?, &self.shape, self.dtype, device)
            }
        }
    }

    fn not_on_host(&self, op: &'static str) -> Error {
        Error::device(
            op,
            "cpu (copy it with `to_device(Device::Cpu)` first)",
            self.device(),
        )
    }
}

#[cfg(feature = "cuda")]
impl Tensor {
    /// The device handle of a CUDA tensor.
    pub fn cuda_device(&self) -> Result<&Arc<CudaDevice>> {
        match &*self.storage {
            Storage::Cuda(b) => Ok(&b.device),
            Storage::Host(_) => Err(Error::device(
                "Tensor::cuda_device",
                "a CUDA device",
                Device::Cpu,
            )),
        }
    }

    /// The device allocation of a CUDA tensor. It may be one byte longer than
    /// [`size_in_bytes`](Tensor::size_in_bytes) for empty tensors.
    pub fn cuda_slice(&self) -> Result<&CudaSlice<u8>> {
        match &*self.storage {
            Storage::Cuda(b) => Ok(&b.slice),
            Storage::Host(_) => Err(Error::device(
                "Tensor::cuda_slice",
                "a CUDA device",
                Device::Cpu,
            )),
        }
    }

    /// The device allocation of a CUDA tensor, for writing (copies a shared storage
    /// first, on the device).
    pub fn cuda_slice_mut(&mut self) -> Result<&mut CudaSlice<u8>> {
        let len = self.size_in_bytes();
        if Arc::get_mut(&mut self.storage).is_none() {
            let copy = match &*self.storage {
                Storage::Cuda(b) => Storage::Cuda(b.try_clone(len)?),
                Storage::Host(_) => {
                    return Err(Error::device(
                        "Tensor::cuda_slice_mut",
                        "a CUDA device",
                        Device::Cpu,
                    ));
                }
            };
            self.storage = Arc::new(copy);
        }
        match Arc::get_mut(&mut self.storage) {
            Some(Storage::Cuda(b)) => Ok(&mut b.slice),
            Some(Storage::Host(_)) => Err(Error::device(
                "Tensor::cuda_slice_mut",
                "a CUDA device",
                Device::Cpu,
            )),
            None => unreachable!("the storage was made unique above"),
        }
    }
}

/// How a new device allocation is filled.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
enum Init<'a> {
    Uninit,
    Byte(u8),
    Copy(&'a [u8]),
}

#[cfg(feature = "cuda")]
fn cuda_storage(ordinal: usize, len: usize, init: Init<'_>) -> Result<Storage> {
    use cudarc::driver::DevicePtrMut;

    let device = crate::cuda::device(ordinal)?;
    let mut slice = device.alloc_bytes(len)?;
    let stream = device.stream();
    match init {
        Init::Uninit => {}
        Init::Byte(byte) => {
            let (ptr, _record) = slice.device_ptr_mut(stream);
            // SAFETY: `ptr` addresses a live allocation of at least `len` bytes made on
            // `stream`, and the memset is queued on that same stream.
            unsafe { cudarc::driver::result::memset_d8_async(ptr, byte, len, stream.cu_stream()) }
                .cuda_op("cuMemsetD8Async")?;
        }
        Init::Copy(bytes) => stream
            .memcpy_htod(bytes, &mut slice.slice_mut(..len))
            .cuda_op("cuMemcpyHtoDAsync")?,
    }
    Ok(Storage::Cuda(CudaBuffer { device, slice }))
}

#[cfg(not(feature = "cuda"))]
fn cuda_storage(ordinal: usize, _len: usize, _init: Init<'_>) -> Result<Storage> {
    Err(Error::no_cuda_feature(format!(
        "a tensor on cuda:{ordinal}"
    )))
}

impl fmt::Debug for Tensor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tensor")
            .field("shape", &self.shape)
            .field("dtype", &self.dtype)
            .field("device", &self.device())
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_round_trip_and_alignment() {
        let data: Vec<f32> = (0..10).map(|i| i as f32 * 0.5).collect();
        let t = Tensor::from_slice(&data, [2, 5], Device::Cpu).unwrap();
        assert_eq!(t.as_slice::<f32>().unwrap(), &data[..]);
        assert_eq!(t.as_bytes().unwrap().as_ptr() as usize % 64, 0);
        assert_eq!(t.to_vec::<f32>().unwrap(), data);
        assert_eq!(t.size_in_bytes(), 40);
    }

    #[test]
    fn clones_are_copy_on_write() {
        let a = Tensor::zeros([4], DType::U32, Device::Cpu).unwrap();
        let mut b = a.clone();
        assert!(a.shares_storage_with(&b));
        b.as_mut_slice::<u32>().unwrap()[1] = 7;
        assert!(!a.shares_storage_with(&b));
        assert_eq!(a.as_slice::<u32>().unwrap(), &[0, 0, 0, 0]);
        assert_eq!(b.as_slice::<u32>().unwrap(), &[0, 7, 0, 0]);
    }

    #[test]
    fn bad_input_is_a_typed_error() {
        let err = Tensor::from_slice(&[1.0f32; 3], [2, 2], Device::Cpu).unwrap_err();
        assert!(matches!(err, Error::Shape { .. }), "{err}");
        assert!(err.to_string().contains("needs 16 bytes, got 12"), "{err}");
        let t = Tensor::zeros([2], DType::F32, Device::Cpu).unwrap();
        let err = t.as_slice::<u32>().unwrap_err();
        assert!(
            err.to_string()
                .contains("expected a tensor of dtype u32, got f32"),
            "{err}"
        );
        let err = t.reshape([3]).unwrap_err();
        assert!(err.to_string().contains("cannot view"), "{err}");
        let err = Tensor::zeros([usize::MAX, 2], DType::F32, Device::Cpu).unwrap_err();
        assert!(err.to_string().contains("too large"), "{err}");
    }

    #[test]
    fn f32_values_round_to_nearest_even_and_widen_exactly() {
        // 1 + 2^-8 is a bf16 tie (rounds down to 1, even); 1 + 3 * 2^-8 rounds up to
        // 1 + 2^-6; 1 + 2^-11 is an f16 tie (down to 1); NaN and infinities survive.
        let v = [
            1.0 + 2f32.powi(-8),
            1.0 + 3.0 * 2f32.powi(-8),
            1.0 + 2f32.powi(-11),
            f32::NEG_INFINITY,
        ];
        let b = Tensor::from_f32_values(&v, [2, 2], DType::BF16, Device::Cpu).unwrap();
        assert_eq!(b.dtype(), DType::BF16);
        assert_eq!(
            b.to_f32_vec().unwrap(),
            [1.0, 1.0 + 2f32.powi(-6), 1.0, f32::NEG_INFINITY]
        );
        let h = Tensor::from_f32_values(&v, [4], DType::F16, Device::Cpu).unwrap();
        assert_eq!(
            h.to_f32_vec().unwrap(),
            [
                1.0 + 2f32.powi(-8),
                1.0 + 3.0 * 2f32.powi(-8),
                1.0,
                f32::NEG_INFINITY
            ]
        );
        let n = Tensor::from_f32_values(&[f32::NAN], [1], DType::BF16, Device::Cpu).unwrap();
        assert!(n.to_f32_vec().unwrap()[0].is_nan());
        let f = Tensor::from_f32_values(&v, [4], DType::F32, Device::Cpu).unwrap();
        assert_eq!(f.to_f32_vec().unwrap(), v);
        // Other dtypes, and a length that does not match the shape, are refused.
        let err = Tensor::from_f32_values(&v, [4], DType::U8, Device::Cpu).unwrap_err();
        assert!(err.to_string().contains("f32, bf16 or f16"), "{err}");
        let err = Tensor::from_f32_values(&v, [3], DType::BF16, Device::Cpu).unwrap_err();
        assert!(matches!(err, Error::Shape { .. }), "{err}");
        let u = Tensor::zeros([2], DType::U32, Device::Cpu).unwrap();
        let err = u.to_f32_vec().unwrap_err();
        assert!(matches!(err, Error::DType { .. }), "{err}");
    }

    #[test]
    fn poison_fill_and_reshape() {
        let t = Tensor::filled_with_byte([3, 2], DType::BF16, Device::Cpu, 0xAB).unwrap();
        assert!(t.as_bytes().unwrap().iter().all(|&b| b == 0xAB));
        let r = t.reshape([6]).unwrap();
        assert!(r.shares_storage_with(&t));
        assert_eq!(r.shape().dims(), &[6]);
    }

    #[cfg(not(feature = "cuda"))]
    #[test]
    fn cuda_without_the_feature_is_an_error() {
        let err = Tensor::zeros([2], DType::F32, Device::Cuda(0)).unwrap_err();
        assert!(
            matches!(
                err,
                Error::FeatureDisabled {
                    feature: "cuda",
                    ..
                }
            ),
            "{err}"
        );
    }

    #[cfg(feature = "cuda")]
    #[test]
    fn cuda_without_a_driver_is_an_error_not_a_panic() {
        if crate::cuda::is_available() {
            return; // this machine has a GPU; the GPU tests cover it
        }
        let err = Tensor::zeros([2], DType::F32, Device::Cuda(0)).unwrap_err();
        assert!(matches!(err, Error::CudaUnavailable { .. }), "{err}");
    }

    #[cfg(feature = "cuda")]
    #[test]
    #[ignore = "needs a CUDA GPU: cargo xtask test-gpu"]
    fn cuda_round_trip_copy_on_write_and_poison() {
        let data: Vec<u32> = (0..1000).map(|i| i * 2654435761u32).collect();
        let host = Tensor::from_slice(&data, [10, 100], Device::Cpu).unwrap();
        let dev = host.to_device(Device::Cuda(0)).unwrap();
        assert_eq!(dev.device(), Device::Cuda(0));
        assert_eq!(dev.to_vec::<u32>().unwrap(), data);
        let mut other = dev.clone();
        other.cuda_slice_mut().unwrap();
        assert!(!other.shares_storage_with(&dev));
        assert_eq!(other.to_vec::<u32>().unwrap(), data);
        let p = Tensor::filled_with_byte([5], DType::U8, Device::Cuda(0), 0xCD).unwrap();
        assert_eq!(p.to_bytes().unwrap(), vec![0xCD; 5]);
        let e = Tensor::zeros([0], DType::F32, Device::Cuda(0)).unwrap();
        assert!(e.to_vec::<f32>().unwrap().is_empty());
    }
}
