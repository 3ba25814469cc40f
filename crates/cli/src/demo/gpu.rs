//! The CUDA side of [`ops`](super::ops) (feature `cuda`): GEMMs through cuBLAS, the
//! element-wise and row functions through `kernels/demo.cu`.
//!
//! Each function here takes CUDA tensors whose shapes and dtypes its caller in `ops`
//! checked, and computes the same values as that caller's CPU code: bit for bit for
//! everything but the GEMMs (the kernels round every operation like the CPU, see the
//! kernel file), and for the GEMMs an f32 product as exact as cuBLAS's own (pedantic
//! math: no TF32, no reduced precision). Two runs of one GEMM on one GPU give the same
//! bits, which is what the demo's distributed-versus-reference check rests on.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::cublas::{CudaBlas, result as blas, sys as blas_sys};
use cudarc::driver::{DevicePtr, DevicePtrMut, PushKernelArg};
use tessera_core::cuda::{CudaDevice, CudaResultExt, grid_1d};
use tessera_core::kernels::{PtxModule, Sass};
use tessera_core::{DType, Device, Error, Result, Shape, Tensor};

/// The compiled kernels of `kernels/demo.cu`.
pub(crate) const PTX: PtxModule = PtxModule {
    name: "tessera_demo",
    ptx: include_str!("../../kernels/ptx/demo.ptx"),
    sass: Some(Sass {
        cubin: include_bytes!("../../kernels/ptx/demo.sm_90.cubin"),
        ptx_sha256: include_str!("../../kernels/ptx/demo.sm_90.cubin.sha256"),
    }),
};

/// Threads per block of every kernel (their `__launch_bounds__`).
const BLOCK: u32 = 256;
/// Rows per block of the warp-per-row kernels.
const ROWS_PER_BLOCK: usize = (BLOCK / 32) as usize;

/// A new uninitialised CUDA tensor on `dev`.
fn empty(shape: impl Into<Shape>, dtype: DType, dev: &CudaDevice) -> Result<Tensor> {
    Tensor::empty(shape, dtype, Device::Cuda(dev.ordinal()))
}

/// The device both tensors live on, or an error naming `op`.
fn same_device<'a>(op: &'static str, a: &'a Tensor, b: &Tensor) -> Result<&'a Arc<CudaDevice>> {
    if a.device() != b.device() {
        return Err(Error::device(
            op,
            format!("{} (the first operand's device)", a.device()),
            b.device(),
        ));
    }
    a.cuda_device()
}

/// Launches `kernel` of [`PTX`] on `dev`'s stream with the arguments in order.
///
/// Each call site passes, as `params`, the kernel's parameter list and the sizes its
/// buffers must have: that text is the argument of the `unsafe` launch below.
macro_rules! launch {
    ($dev:expr, $kernel:literal, $cfg:expr, [$($arg:expr),* $(,)?], $params:literal) => {{
        let dev: &CudaDevice = $dev;
        let f = dev.function(&PTX, $kernel)?;
        let mut b = dev.stream().launch_builder(&f);
        $( b.arg($arg); )*
        let _params: &str = $params;
        // SAFETY: the arguments were pushed in the order and with the types of the
        // kernel's parameters, which the call site's `params` spells out; every
        // buffer is a tensor of the documented size (its caller in `ops` checked the
        // shapes and dtypes), outputs are fresh allocations distinct from the inputs,
        // and each kernel guards its index against its element or row count.
        unsafe { b.launch($cfg) }.cuda_op(concat!("launch ", $kernel))?;
    }};
}

/// A grid-stride launch over `n` elements.
fn grid(dev: &CudaDevice, n: usize) -> Result<tessera_core::cuda::LaunchConfig> {
    grid_1d(dev, n.max(1), BLOCK)
}

/// A launch of one warp per row over `rows` rows.
fn warp_rows(rows: usize) -> Result<tessera_core::cuda::LaunchConfig> {
    let blocks = u32::try_from(rows.div_ceil(ROWS_PER_BLOCK).max(1))
        .map_err(|_| Error::invalid("demo kernels", format!("{rows} rows need too many blocks")))?;
    Ok(tessera_core::cuda::LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (BLOCK, 1, 1),
        shared_mem_bytes: 0,
    })
}

/// One element-wise kernel over `inputs` (one device, one shape, `n` elements each)
/// into a new tensor of `out_dtype`; the kernel's parameters are `(out, inputs...,
/// [float scalar,] u64 n)`.
fn elementwise(
    kernel: &'static str,
    inputs: &[&Tensor],
    scalar: Option<f32>,
    out_dtype: DType,
) -> Result<Tensor> {
    let first = inputs[0];
    for t in &inputs[1..] {
        same_device(kernel, first, t)?;
    }
    let dev = first.cuda_device()?.clone();
    let n = first.numel();
    let mut out = empty(first.shape(), out_dtype, &dev)?;
    if n == 0 {
        return Ok(out);
    }
    let n64 = n as u64;
    let f = dev.function(&PTX, kernel)?;
    let cfg = grid(&dev, n)?;
    {
        let mut b = dev.stream().launch_builder(&f);
        b.arg(out.cuda_slice_mut()?);
        for t in inputs {
            b.arg(t.cuda_slice()?);
        }
        if let Some(s) = &scalar {
            b.arg(s);
        }
        b.arg(&n64);
        // SAFETY: every element-wise kernel of `kernels/demo.cu` takes (T* out, const
        // U* in..., [float scalar,] u64 n) in this order, as pushed; `out` is a fresh
        // allocation of n elements of `out_dtype` and each input holds n elements (its
        // caller in `ops` checked the shapes and dtypes); the kernels guard i < n.
        unsafe { b.launch(cfg) }.cuda_op("launch a tessera_demo element-wise kernel")?;
    }
    Ok(out)
}

/// `a + b` (f32, one shape).
pub(crate) fn add(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    elementwise("tessera_demo_add", &[a, b], None, DType::F32)
}

/// GeLU of an f32 tensor.
pub(crate) fn gelu(a: &Tensor) -> Result<Tensor> {
    elementwise("tessera_demo_gelu", &[a], None, DType::F32)
}

/// `dg · gelu'(a)`.
pub(crate) fn gelu_backward(a: &Tensor, dg: &Tensor) -> Result<Tensor> {
    elementwise("tessera_demo_gelu_backward", &[a, dg], None, DType::F32)
}

/// `x · scale` where `mask` is 1, 0 elsewhere.
pub(crate) fn apply_mask(x: &Tensor, mask: &Tensor, scale: f32) -> Result<Tensor> {
    elementwise(
        "tessera_demo_apply_mask",
        &[x, mask],
        Some(scale),
        DType::F32,
    )
}

/// LayerNorm of `[rows, h]`: `(z, mean, rstd)`.
pub(crate) fn layernorm(
    x: &Tensor,
    gamma: &Tensor,
    beta: &Tensor,
    rows: usize,
    h: usize,
    inv_h: f32,
    eps: f32,
) -> Result<(Tensor, Tensor, Tensor)> {
    let dev = same_device("layernorm", x, gamma)?.clone();
    same_device("layernorm", x, beta)?;
    let mut z = empty([rows, h], DType::F32, &dev)?;
    let mut mean = empty([rows], DType::F32, &dev)?;
    let mut rstd = empty([rows], DType::F32, &dev)?;
    if rows > 0 {
        let (r64, h64) = (rows as u64, h as u64);
        launch!(
            &dev,
            "tessera_demo_layernorm",
            warp_rows(rows)?,
            [
                z.cuda_slice_mut()?,
                mean.cuda_slice_mut()?,
                rstd.cuda_slice_mut()?,
                x.cuda_slice()?,
                gamma.cuda_slice()?,
                beta.cuda_slice()?,
                &r64,
                &h64,
                &inv_h,
                &eps,
            ],
            "(float* z, float* mean, float* rstd, const float* x, const float* gamma, const float* beta, u64 rows, u64 h, float inv_h, float eps): x and z hold rows·h f32, mean and rstd rows, gamma and beta h"
        );
    }
    Ok((z, mean, rstd))
}

/// LayerNorm's backward: `(dx, dγ, dβ)` as tensors `[rows, h]`, `[h]`, `[h]`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn layernorm_backward(
    dz: &Tensor,
    x: &Tensor,
    mean: &Tensor,
    rstd: &Tensor,
    gamma: &Tensor,
    rows: usize,
    h: usize,
    inv_h: f32,
) -> Result<(Tensor, Tensor, Tensor)> {
    const OP: &str = "layernorm_backward";
    let dev = same_device(OP, dz, x)?.clone();
    for t in [mean, rstd, gamma] {
        same_device(OP, dz, t)?;
    }
    let mut dx = empty([rows, h], DType::F32, &dev)?;
    let mut dgamma = empty([h], DType::F32, &dev)?;
    let mut dbeta = empty([h], DType::F32, &dev)?;
    let (r64, h64) = (rows as u64, h as u64);
    if rows > 0 {
        launch!(
            &dev,
            "tessera_demo_layernorm_backward_dx",
            warp_rows(rows)?,
            [
                dx.cuda_slice_mut()?,
                dz.cuda_slice()?,
                x.cuda_slice()?,
                mean.cuda_slice()?,
                rstd.cuda_slice()?,
                gamma.cuda_slice()?,
                &r64,
                &h64,
                &inv_h,
            ],
            "(float* dx, const float* dz, const float* x, const float* mean, const float* rstd, const float* gamma, u64 rows, u64 h, float inv_h): dx, dz, x hold rows·h f32, mean and rstd rows, gamma h"
        );
    }
    if h > 0 {
        launch!(
            &dev,
            "tessera_demo_layernorm_backward_params",
            grid(&dev, h)?,
            [
                dgamma.cuda_slice_mut()?,
                dbeta.cuda_slice_mut()?,
                dz.cuda_slice()?,
                x.cuda_slice()?,
                mean.cuda_slice()?,
                rstd.cuda_slice()?,
                &r64,
                &h64,
            ],
            "(float* dgamma, float* dbeta, const float* dz, const float* x, const float* mean, const float* rstd, u64 rows, u64 h): dgamma and dbeta hold h f32, dz and x rows·h, mean and rstd rows"
        );
    }
    Ok((dx, dgamma, dbeta))
}

/// f32 values rounded to a bf16 tensor.
pub(crate) fn to_bf16(x: &Tensor) -> Result<Tensor> {
    elementwise("tessera_demo_to_bf16", &[x], None, DType::BF16)
}

/// A bf16 tensor's values as f32.
pub(crate) fn bf16_to_f32(x: &Tensor) -> Result<Tensor> {
    elementwise("tessera_demo_bf16_to_f32", &[x], None, DType::F32)
}

/// A strided copy of `rows` rows of `width` elements: element `(r, c)` of `src` at
/// `src_offset + r·src_pitch + c` goes to `dst_offset + r·dst_pitch + c` of `dst`
/// (offsets and pitches in elements of the tensors' dtype, which must agree).
///
/// The caller keeps every index inside both tensors.
#[allow(clippy::too_many_arguments)]
pub(crate) fn copy2d(
    dst: &mut Tensor,
    dst_offset: usize,
    dst_pitch: usize,
    src: &Tensor,
    src_offset: usize,
    src_pitch: usize,
    rows: usize,
    width: usize,
) -> Result<()> {
    const OP: &str = "copy2d";
    if dst.dtype() != src.dtype() {
        return Err(Error::dtype(OP, dst.dtype().name(), src.dtype()));
    }
    let dev = same_device(OP, dst, src)?.clone();
    let esize = src.dtype().size_in_bytes();
    let last = |offset: usize, pitch: usize| offset + (rows.max(1) - 1) * pitch + width;
    if rows > 0
        && width > 0
        && (last(src_offset, src_pitch) > src.numel() || last(dst_offset, dst_pitch) > dst.numel())
    {
        return Err(Error::shape(
            OP,
            format!(
                "{rows} rows of {width} from offset {src_offset} (pitch {src_pitch}) of {} \
                 elements to offset {dst_offset} (pitch {dst_pitch}) of {}",
                src.numel(),
                dst.numel()
            ),
        ));
    }
    if rows == 0 || width == 0 {
        return Ok(());
    }
    let stream = dev.stream().clone();
    // Words when every element is a whole number of 4-byte words, bytes otherwise.
    let word = if esize.is_multiple_of(4) { 4 } else { 1 };
    let per = esize / word;
    let (rows64, width64) = (rows as u64, (width * per) as u64);
    let (sp, dp) = ((src_pitch * per) as u64, (dst_pitch * per) as u64);
    let kernel = if word == 4 {
        "tessera_demo_copy2d_u32"
    } else {
        "tessera_demo_copy2d_u8"
    };
    let f = dev.function(&PTX, kernel)?;
    let cfg = grid(&dev, rows * width * per)?;
    let (src_ptr, _src_sync) = src.cuda_slice()?.device_ptr(&stream);
    let (dst_ptr, _dst_sync) = dst.cuda_slice_mut()?.device_ptr_mut(&stream);
    let src_ptr = src_ptr + (src_offset * esize) as u64;
    let dst_ptr = dst_ptr + (dst_offset * esize) as u64;
    let mut b = stream.launch_builder(&f);
    b.arg(&dst_ptr)
        .arg(&dp)
        .arg(&src_ptr)
        .arg(&sp)
        .arg(&rows64)
        .arg(&width64);
    // SAFETY: the kernel's parameters are (T* dst, u64 dst_pitch, const T* src, u64
    // src_pitch, u64 rows, u64 width) with T a 4-byte word or a byte, all counted in T;
    // the pointers are the tensors' allocations advanced by whole elements, and the
    // check above keeps the last element of either side inside its tensor. `dst` was
    // made unique by `cuda_slice_mut`, so the two do not overlap.
    unsafe { b.launch(cfg) }.cuda_op("launch tessera_demo copy2d")?;
    Ok(())
}

/// cuBLAS handles, one per device, each bound to that device's tessera stream.
fn blas(dev: &Arc<CudaDevice>) -> Result<Arc<CudaBlas>> {
    static HANDLES: OnceLock<Mutex<HashMap<usize, Arc<CudaBlas>>>> = OnceLock::new();
    let mut map = HANDLES
        .get_or_init(Default::default)
        .lock()
        .map_err(|_| Error::state("cuBLAS", "a thread panicked holding the handle cache"))?;
    if let Some(h) = map.get(&dev.ordinal()) {
        return Ok(h.clone());
    }
    // SAFETY: only probes for the library file; loading it has no other effect.
    if !unsafe { blas_sys::is_culib_present() } {
        return Err(Error::Cuda {
            op: "cuBLAS",
            msg: "libcublas was not found (looked for libcublas.so and libcublas.so.13 on \
                  the loader's path): install the CUDA toolkit's cuBLAS or add its lib \
                  directory to LD_LIBRARY_PATH"
                .into(),
        });
    }
    let handle = CudaBlas::new(dev.stream().clone()).map_err(|e| Error::Cuda {
        op: "cublasCreate",
        msg: e.to_string(),
    })?;
    // SAFETY: `handle` is a live cuBLAS handle owned by `handle`.
    unsafe {
        blas_sys::cublasSetMathMode(
            *handle.handle(),
            blas_sys::cublasMath_t::CUBLAS_PEDANTIC_MATH,
        )
    }
    .result()
    .map_err(|e| Error::Cuda {
        op: "cublasSetMathMode",
        msg: e.to_string(),
    })?;
    let handle = Arc::new(handle);
    map.insert(dev.ordinal(), handle.clone());
    Ok(handle)
}

/// `op(a) · op(b)` for row-major f32 matrices: `a` is `[m, k]` (`[k, m]` when `ta`),
/// `b` is `[k, n]` (`[n, k]` when `tb`); the caller checked the sizes.
///
/// cuBLAS is column-major, where a row-major `[r, c]` matrix reads as its transpose
/// `[c, r]`; so the row-major `C = op(A)·op(B)` is the column-major
/// `Cᵀ = op(B)ᵀ·op(A)ᵀ`, one call with the operands swapped.
#[allow(clippy::too_many_arguments)]
pub(crate) fn matmul(
    a: &Tensor,
    ta: bool,
    b: &Tensor,
    tb: bool,
    m: usize,
    n: usize,
    k: usize,
) -> Result<Tensor> {
    const OP: &str = "matmul";
    let dev = same_device(OP, a, b)?.clone();
    let mut out = empty([m, n], DType::F32, &dev)?;
    if m == 0 || n == 0 {
        return Ok(out);
    }
    if k == 0 {
        return Tensor::zeros([m, n], DType::F32, Device::Cuda(dev.ordinal()));
    }
    let int = |v: usize| {
        i32::try_from(v).map_err(|_| {
            Error::invalid(
                OP,
                format!("a GEMM of {m}x{n}x{k} exceeds cuBLAS's 32-bit sizes"),
            )
        })
    };
    let (mi, ni, ki) = (int(m)?, int(n)?, int(k)?);
    let op = |t: bool| {
        if t {
            blas_sys::cublasOperation_t::CUBLAS_OP_T
        } else {
            blas_sys::cublasOperation_t::CUBLAS_OP_N
        }
    };
    let handle = blas(&dev)?;
    let stream = dev.stream().clone();
    let (pa, _sa) = a.cuda_slice()?.device_ptr(&stream);
    let (pb, _sb) = b.cuda_slice()?.device_ptr(&stream);
    let out_slice = out.cuda_slice_mut()?;
    let (pc, sc) = out_slice.device_ptr_mut(&stream);
    let (alpha, beta) = (1.0f32, 0.0f32);
    // SAFETY: the handle is live and bound to this device's stream, on which the
    // pointers were taken; in cuBLAS's column-major terms the call is
    // `C[n, m] = op(B)[n, k] · op(A)[k, m]` with `B` read through `ldb' = k` (stored
    // `[n, k]`, transposed) or `n`, `A` through `m` (stored `[k, m]`, transposed) or
    // `k`, and `C` written with `ldc = n`: each leading dimension is the row length
    // of the row-major matrix, so every access stays inside `a` (m·k), `b` (k·n) and
    // `out` (m·n elements), which the caller's shape checks guarantee. `alpha` and
    // `beta` are host scalars (the handle's default pointer mode) that outlive the
    // call, and `out` is a fresh allocation distinct from both inputs.
    unsafe {
        blas::sgemm(
            *handle.handle(),
            op(tb),
            op(ta),
            ni,
            mi,
            ki,
            &alpha,
            pb as *const f32,
            if tb { ki } else { ni },
            pa as *const f32,
            if ta { mi } else { ki },
            &beta,
            pc as *mut f32,
            ni,
        )
    }
    .map_err(|e| Error::Cuda {
        op: "cublasSgemm",
        msg: e.to_string(),
    })?;
    drop(sc);
    Ok(out)
}

#[cfg(test)]
mod tests {
    //! Every CUDA function against its CPU twin in `ops`, bit for bit (the GEMMs: on
    //! integer-valued inputs, whose products and sums are exact in any order, plus an
    //! f32-accuracy check on random values).

    use tessera_rng::Generator;

    use super::super::ops;
    use super::*;

    fn cuda() -> Device {
        assert!(
            tessera_core::cuda::is_available(),
            "no CUDA driver or device: these tests need a GPU"
        );
        Device::Cuda(0)
    }

    /// `n` values from N(0, std), with a few specials mixed in when `specials`.
    fn values(n: usize, seed: u64, std: f32, specials: bool) -> Vec<f32> {
        let mut v = vec![0.0f32; n];
        Generator::new(seed).fill_normal(&mut v, 0.0, std);
        if specials {
            let s = [
                0.0,
                -0.0,
                f32::INFINITY,
                f32::NEG_INFINITY,
                f32::NAN,
                1e-40,
                -3e38,
                88.5,
                -87.5,
                1.0 + f32::EPSILON,
            ];
            for (i, x) in s.iter().enumerate() {
                if i * 7 < n {
                    v[i * 7] = *x;
                }
            }
        }
        v
    }

    fn host(v: &[f32], shape: &[usize]) -> Tensor {
        Tensor::from_slice(v, shape.to_vec(), Device::Cpu).unwrap()
    }

    /// Both tensors' bytes, equal — except that an f32 NaN matches any NaN: the CPU
    /// passes an input NaN's payload through arithmetic, the GPU returns its canonical
    /// `0x7fffffff` (bf16 results are converted bit by bit and must match exactly).
    fn assert_same(what: &str, cpu: &Tensor, gpu: &Tensor) {
        assert_eq!(cpu.shape(), gpu.shape(), "{what}: shapes");
        assert_eq!(cpu.dtype(), gpu.dtype(), "{what}: dtypes");
        assert_eq!(gpu.device(), cuda(), "{what}: the result left the GPU");
        let (a, b) = (cpu.to_bytes().unwrap(), gpu.to_bytes().unwrap());
        let e = cpu.dtype().size_in_bytes();
        let is_f32 = cpu.dtype() == DType::F32;
        let nan = |x: &[u8]| is_f32 && f32::from_le_bytes(x.try_into().unwrap()).is_nan();
        let differ = |(x, y): (&[u8], &[u8])| x != y && !(nan(x) && nan(y));
        if let Some(i) = a.chunks(e).zip(b.chunks(e)).position(differ) {
            panic!(
                "{what}: element {i} differs: cpu {:02x?}, gpu {:02x?}",
                &a[i * e..(i + 1) * e],
                &b[i * e..(i + 1) * e]
            );
        }
    }

    /// The embedded cubin was compiled from the PTX embedded beside it.
    #[test]
    fn embedded_sass_is_fresh() {
        PTX.check_sass_fresh().unwrap();
    }

    #[test]
    fn committed_ptx_is_fresh() {
        tessera_core::kernels::check_ptx_fresh(
            "crates/cli/kernels/demo.cu",
            include_str!("../../kernels/demo.cu"),
            PTX.ptx,
        )
        .unwrap();
    }

    #[test]
    #[ignore = "needs a CUDA GPU: cargo xtask test-gpu"]
    fn elementwise_kernels_equal_the_cpu() {
        let dev = cuda();
        for (seed, n) in [(1u64, 1usize), (2, 1000), (3, 65_537), (4, 300_001)] {
            for std in [0.5f32, 3.0, 40.0] {
                let a = host(&values(n, seed, std, true), &[n]);
                let b = host(&values(n, seed + 100, std, true), &[n]);
                let (ga, gb) = (a.to_device(dev).unwrap(), b.to_device(dev).unwrap());
                assert_same(
                    "add",
                    &ops::add(&a, &b).unwrap(),
                    &ops::add(&ga, &gb).unwrap(),
                );
                assert_same("gelu", &ops::gelu(&a).unwrap(), &ops::gelu(&ga).unwrap());
                assert_same(
                    "gelu_backward",
                    &ops::gelu_backward(&a, &b).unwrap(),
                    &ops::gelu_backward(&ga, &gb).unwrap(),
                );
                let bf = ops::to_bf16(&a).unwrap();
                assert_same("to_bf16", &bf, &ops::to_bf16(&ga).unwrap());
                assert_same(
                    "to_f32",
                    &ops::to_f32(&bf).unwrap(),
                    &ops::to_f32(&bf.to_device(dev).unwrap()).unwrap(),
                );
                let mask: Vec<u8> = (0..n)
                    .map(|i| u8::from(!(i * 7 + seed as usize).is_multiple_of(5)))
                    .collect();
                let m = Tensor::from_slice(&mask, [n], Device::Cpu).unwrap();
                assert_same(
                    "apply_mask",
                    &ops::apply_mask(&a, &m, 0.1).unwrap(),
                    &ops::apply_mask(&ga, &m.to_device(dev).unwrap(), 0.1).unwrap(),
                );
            }
        }
    }

    #[test]
    #[ignore = "needs a CUDA GPU: cargo xtask test-gpu"]
    fn layernorm_forward_and_backward_equal_the_cpu() {
        let dev = cuda();
        for (rows, h) in [
            (1usize, 1usize),
            (3, 31),
            (17, 64),
            (64, 100),
            (129, 257),
            (40, 1024),
        ] {
            let seed = (rows * 1000 + h) as u64;
            let x = host(&values(rows * h, seed, 2.0, false), &[rows, h]);
            let g = host(&values(h, seed + 1, 1.0, false), &[h]);
            let b = host(&values(h, seed + 2, 1.0, false), &[h]);
            let dz = host(&values(rows * h, seed + 3, 1.0, false), &[rows, h]);
            let on = |t: &Tensor| t.to_device(dev).unwrap();
            let (z, s) = ops::layernorm(&x, &g, &b).unwrap();
            let (gz, gs) = ops::layernorm(&on(&x), &on(&g), &on(&b)).unwrap();
            let what = format!("layernorm {rows}x{h}");
            assert_same(&what, &z, &gz);
            assert_same(&what, &s.mean, &gs.mean);
            assert_same(&what, &s.rstd, &gs.rstd);
            let (dx, dg, db) = ops::layernorm_backward(&dz, &x, &s, &g).unwrap();
            let (gdx, gdg, gdb) = ops::layernorm_backward(&on(&dz), &on(&x), &gs, &on(&g)).unwrap();
            let what = format!("layernorm_backward {rows}x{h}");
            assert_same(&what, &dx, &gdx);
            assert_same(&what, &dg, &gdg);
            assert_same(&what, &db, &gdb);
            let half = rows / 2;
            assert_same(
                "statistics rows",
                &s.rows(half..rows).unwrap().rstd,
                &gs.rows(half..rows).unwrap().rstd,
            );
        }
    }

    #[test]
    #[ignore = "needs a CUDA GPU: cargo xtask test-gpu"]
    fn row_and_column_blocks_equal_the_cpu() {
        let dev = cuda();
        let (r, c) = (37usize, 24usize);
        let f = host(&values(r * c, 9, 1.0, false), &[r, c]);
        let bytes: Vec<u8> = (0..r * c).map(|i| (i * 31 % 251) as u8).collect();
        let u = Tensor::from_slice(&bytes, [r, c], Device::Cpu).unwrap();
        for t in [&f, &u] {
            let g = t.to_device(dev).unwrap();
            assert_same(
                "rows",
                &ops::rows(t, 5..30).unwrap(),
                &ops::rows(&g, 5..30).unwrap(),
            );
            assert_same(
                "rows (empty)",
                &ops::rows(t, 3..3).unwrap(),
                &ops::rows(&g, 3..3).unwrap(),
            );
            let blocks: Vec<Tensor> = (0..3).map(|k| ops::col_block(t, k, 8).unwrap()).collect();
            let gblocks: Vec<Tensor> = (0..3).map(|k| ops::col_block(&g, k, 8).unwrap()).collect();
            for (b, gb) in blocks.iter().zip(&gblocks) {
                assert_same("col_block", b, gb);
            }
            assert_same(
                "concat_cols",
                &ops::concat_cols(&blocks).unwrap(),
                &ops::concat_cols(&gblocks).unwrap(),
            );
            assert_same(
                "concat_cols (round trip)",
                t,
                &ops::concat_cols(&gblocks)
                    .unwrap()
                    .to_device(Device::Cpu)
                    .unwrap()
                    .to_device(dev)
                    .unwrap(),
            );
            let parts = [ops::rows(&g, 0..10).unwrap(), ops::rows(&g, 10..r).unwrap()];
            assert_same(
                "concat_rows",
                &ops::concat_rows(&[ops::rows(t, 0..10).unwrap(), ops::rows(t, 10..r).unwrap()])
                    .unwrap(),
                &ops::concat_rows(&parts).unwrap(),
            );
            assert!(ops::col_block(&g, 3, 8).is_err(), "a block past the end");
        }
        let mixed = [f.to_device(dev).unwrap(), f.clone()];
        assert!(ops::concat_rows(&mixed).is_err(), "blocks on two devices");
    }

    #[test]
    #[ignore = "needs a CUDA GPU: cargo xtask test-gpu"]
    fn matmul_equals_the_cpu_on_exact_inputs_and_is_f32_accurate() {
        let dev = cuda();
        // Small integers: every product and partial sum is exact in f32, so any
        // summation order gives the same bits.
        let ints = |n: usize, seed: u64| -> Vec<f32> {
            values(n, seed, 1.0, false)
                .iter()
                .map(|v| (v * 4.0).round().clamp(-8.0, 8.0))
                .collect()
        };
        for (m, n, k) in [
            (1usize, 1usize, 1usize),
            (7, 5, 3),
            (64, 48, 96),
            (130, 33, 257),
            (5, 9, 0),
        ] {
            for (ta, tb) in [(false, false), (true, false), (false, true), (true, true)] {
                let a_shape = if ta { [k, m] } else { [m, k] };
                let b_shape = if tb { [n, k] } else { [k, n] };
                let a = host(&ints(m * k, (m * n + k) as u64), &a_shape);
                let b = host(&ints(k * n, (m + n * k) as u64), &b_shape);
                let cpu = ops::matmul(&a, ta, &b, tb).unwrap();
                let gpu = ops::matmul(
                    &a.to_device(dev).unwrap(),
                    ta,
                    &b.to_device(dev).unwrap(),
                    tb,
                )
                .unwrap();
                assert_same(&format!("matmul {m}x{n}x{k} ta={ta} tb={tb}"), &cpu, &gpu);
            }
        }
        // Random values: within f32 accuracy of an f64 product (TF32 would miss by 1e-3).
        let (m, n, k) = (96usize, 80usize, 512usize);
        let av = values(m * k, 5, 1.0, false);
        let bv = values(k * n, 6, 1.0, false);
        let gpu = ops::matmul(
            &host(&av, &[m, k]).to_device(dev).unwrap(),
            false,
            &host(&bv, &[k, n]).to_device(dev).unwrap(),
            false,
        )
        .unwrap()
        .to_vec::<f32>()
        .unwrap();
        for i in 0..m {
            for j in 0..n {
                let (mut exact, mut size) = (0.0f64, 0.0f64);
                for p in 0..k {
                    let t = f64::from(av[i * k + p]) * f64::from(bv[p * n + j]);
                    exact += t;
                    size += t.abs();
                }
                let err = (f64::from(gpu[i * n + j]) - exact).abs();
                assert!(
                    err <= size * 1e-5,
                    "({i}, {j}): {} vs {exact}",
                    gpu[i * n + j]
                );
            }
        }
        let e = ops::matmul(
            &host(&av, &[m, k]).to_device(dev).unwrap(),
            false,
            &host(&bv, &[k, n]),
            false,
        );
        assert!(e.is_err(), "operands on two devices");
    }

    #[test]
    #[ignore = "needs a CUDA GPU: cargo xtask test-gpu"]
    fn dropout_masks_equal_the_cpu() {
        let dev = cuda();
        for (seed, offset) in [(1u64, 0u64), (77, 12)] {
            let state = tessera_rng::GeneratorState { seed, offset };
            tessera_rng::set_rng_state(Device::Cpu, state).unwrap();
            tessera_rng::set_rng_state(dev, state).unwrap();
            let cpu = ops::draw_mask([33, 70], 0.3, Device::Cpu).unwrap();
            let gpu = ops::draw_mask([33, 70], 0.3, dev).unwrap();
            assert_same("draw_mask", &cpu, &gpu);
            assert_eq!(
                tessera_rng::get_rng_state(Device::Cpu).unwrap(),
                tessera_rng::get_rng_state(dev).unwrap(),
                "both generators advance alike"
            );
        }
    }
}
