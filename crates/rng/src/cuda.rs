//! CUDA fills and the graph-safe generator (feature `cuda`).

use std::fmt;
use std::sync::Arc;

use cudarc::driver::{CudaSlice, LaunchArgs, PushKernelArg};
use tessera_core::cuda::{CudaDevice, CudaResultExt, grid_1d, grid_1d_cover};
use tessera_core::kernels::{PtxModule, Sass};
use tessera_core::{DType, Device, Error, Result, Tensor};

use crate::GeneratorState;
use crate::generator::{Fill, check_dropout_dtype, check_dropout_outputs, check_probability};
use crate::stream::{dropout_scale, offset_increment};

/// The compiled kernels of `kernels/rng.cu`.
pub(crate) const PTX: PtxModule = PtxModule {
    name: "tessera_rng",
    ptx: include_str!("../kernels/ptx/rng.ptx"),
    sass: Some(Sass {
        cubin: include_bytes!("../kernels/ptx/rng.sm_90.cubin"),
        ptx_sha256: include_str!("../kernels/ptx/rng.sm_90.cubin.sha256"),
    }),
};

/// Threads per block of every fill kernel (their `__launch_bounds__`).
const BLOCK: u32 = 256;

/// Where a kernel takes its generator state from.
#[derive(Clone, Copy)]
pub(crate) enum Draw<'a> {
    /// Seed and offset passed by value (eager use).
    At(GeneratorState),
    /// Seed and offset read from a device buffer `{seed, offset}` (graph-safe use).
    GraphSafe(&'a CudaSlice<u64>),
}

impl Draw<'_> {
    fn kernel(self, base: &str) -> String {
        match self {
            Draw::At(_) => base.to_owned(),
            Draw::GraphSafe(_) => format!("{base}_gs"),
        }
    }
}

/// Pushes the state arguments of `draw`: `seed, offset` or `state`.
fn push_draw<'a>(b: &mut LaunchArgs<'a>, draw: &'a Draw<'a>) {
    match draw {
        Draw::At(s) => {
            b.arg(&s.seed).arg(&s.offset);
        }
        Draw::GraphSafe(state) => {
            b.arg(*state);
        }
    }
}

/// Fills a CUDA tensor (dtype already checked by the caller) with `fill`.
pub(crate) fn fill(draw: Draw<'_>, fill: Fill, t: &mut Tensor) -> Result<()> {
    fill_from(&PTX, draw, fill, t)
}

/// [`fill`] with the kernels of `module` (this crate's PTX, or in the tests the same PTX
/// without its cubin).
fn fill_from(module: &PtxModule, draw: Draw<'_>, fill: Fill, t: &mut Tensor) -> Result<()> {
    let n = t.numel() as u64;
    if n == 0 {
        return Ok(());
    }
    let dev = t.cuda_device()?.clone();
    let base = match fill {
        Fill::U32 => "tessera_rng_u32",
        Fill::Uniform => "tessera_rng_uniform",
        Fill::Normal { .. } => "tessera_rng_normal",
    };
    let f = dev.function(module, &draw.kernel(base))?;
    let cfg = grid_1d(&dev, n.div_ceil(4) as usize, BLOCK)?;
    let (mean, std) = match fill {
        Fill::Normal { mean, std } => (mean, std),
        _ => (0.0, 1.0),
    };
    let out = t.cuda_slice_mut()?;
    let mut b = dev.stream().launch_builder(&f);
    b.arg(out).arg(&n);
    push_draw(&mut b, &draw);
    if matches!(fill, Fill::Normal { .. }) {
        b.arg(&mean).arg(&std);
    }
    // SAFETY: the kernel's parameters are (u32* out, u64 n, u64 seed, u64 offset) or
    // (u32* out, u64 n, const u64* state), then (float mean, float std) for normals,
    // exactly the arguments pushed above; `out` holds n 4-byte elements (dtype checked
    // by the caller), and `state` is a live 2-element device buffer. It writes only
    // `out[0..n]`.
    unsafe { b.launch(cfg) }.cuda_op("launch tessera_rng fill")?;
    Ok(())
}

/// Dropout of a CUDA tensor into `out` and `mask` (checked by the caller).
pub(crate) fn dropout(
    draw: Draw<'_>,
    p: f32,
    input: &Tensor,
    out: &mut Tensor,
    mask: &mut Tensor,
) -> Result<()> {
    let n = input.numel() as u64;
    if n == 0 {
        return Ok(());
    }
    let dev = input.cuda_device()?.clone();
    let (base, per_thread) = match input.dtype() {
        DType::F32 => ("tessera_rng_dropout_f32", 4),
        DType::BF16 => ("tessera_rng_dropout_bf16", 8),
        DType::F16 => ("tessera_rng_dropout_f16", 8),
        other => return Err(Error::dtype("dropout", "f32, bf16 or f16", other)),
    };
    let f = dev.function(&PTX, &draw.kernel(base))?;
    // One thread per whole step, plus one for the tail (the kernel has no loop).
    let cfg = grid_1d_cover((n / per_thread + 1) as usize, BLOCK)?;
    let scale = dropout_scale(p);
    let out = out.cuda_slice_mut()?;
    let mask = mask.cuda_slice_mut()?;
    let mut b = dev.stream().launch_builder(&f);
    b.arg(input.cuda_slice()?).arg(out).arg(mask).arg(&n);
    push_draw(&mut b, &draw);
    b.arg(&p).arg(&scale);
    // SAFETY: the kernel's parameters are (const T* in, T* out, u8* mask, u64 n, then
    // u64 seed, u64 offset or const u64* state, then float p, float scale), as pushed
    // above; `in` and `out` hold n elements of T (the caller checked dtypes and shapes
    // match), `mask` n bytes, and the three are distinct allocations (out and mask were
    // made unique by `cuda_slice_mut`).
    unsafe { b.launch(cfg) }.cuda_op("launch tessera_rng dropout")?;
    Ok(())
}

/// A generator whose state lives in device memory, for random fills inside CUDA graphs.
///
/// An eager [`Generator`](crate::Generator) passes its seed and offset to each kernel
/// by value, so a captured graph would replay the same numbers forever. A
/// `GraphSafeGenerator` keeps `{seed, offset}` in a device buffer: each fill's kernel
/// reads it, and a one-thread kernel queued right after moves the offset on. Captured
/// in a graph, replay `r` of a region therefore draws exactly what eager execution of
/// the region would draw from the offset reached after `r` earlier replays.
///
/// Its fills write preallocated tensors on its own device and never allocate, so they
/// can be captured. Calling one with a host tensor or a tensor on another device is an
/// [`Error::Device`].
pub struct GraphSafeGenerator {
    device: Arc<CudaDevice>,
    state: CudaSlice<u64>,
}

impl GraphSafeGenerator {
    /// A graph-safe generator on `device` starting at `state`. `device` must be a CUDA
    /// device: the state lives in its memory.
    pub fn new(device: Device, state: GeneratorState) -> Result<Self> {
        let state = state.validate()?;
        let Device::Cuda(ordinal) = device else {
            return Err(Error::device(
                "GraphSafeGenerator::new",
                "a CUDA device (graph-safe generators keep their offset in device memory)",
                device,
            ));
        };
        let dev = tessera_core::cuda::device(ordinal)?;
        let state = dev
            .stream()
            .clone_htod(&[state.seed, state.offset])
            .cuda_op("cuMemcpyHtoDAsync")?;
        Ok(GraphSafeGenerator { device: dev, state })
    }

    /// The device holding the state.
    pub fn device(&self) -> Device {
        Device::Cuda(self.device.ordinal())
    }

    /// The state after all queued work (waits for the device's stream).
    pub fn state(&self) -> Result<GeneratorState> {
        let v = self
            .device
            .stream()
            .clone_dtoh(&self.state)
            .cuda_op("cuMemcpyDtoHAsync")?;
        self.device.synchronize()?;
        Ok(GeneratorState {
            seed: v[0],
            offset: v[1],
        })
    }

    /// Queues a write of `state` into the device buffer (not capturable: call it
    /// outside graph capture).
    pub fn set_state(&mut self, state: GeneratorState) -> Result<()> {
        let state = state.validate()?;
        self.device
            .stream()
            .memcpy_htod(&[state.seed, state.offset], &mut self.state)
            .cuda_op("cuMemcpyHtoDAsync")
    }

    /// Fills a `u32` tensor on this generator's device with the next words.
    pub fn fill_u32_tensor(&mut self, t: &mut Tensor) -> Result<()> {
        t.expect_dtype("GraphSafeGenerator::fill_u32_tensor", DType::U32)?;
        self.fill_tensor("GraphSafeGenerator::fill_u32_tensor", t, Fill::U32)
    }

    /// Fills an `f32` tensor on this generator's device with uniforms in `[0, 1)`.
    pub fn fill_uniform_tensor(&mut self, t: &mut Tensor) -> Result<()> {
        t.expect_dtype("GraphSafeGenerator::fill_uniform_tensor", DType::F32)?;
        self.fill_tensor("GraphSafeGenerator::fill_uniform_tensor", t, Fill::Uniform)
    }

    /// Fills an `f32` tensor on this generator's device with normals.
    pub fn fill_normal_tensor(&mut self, t: &mut Tensor, mean: f32, std: f32) -> Result<()> {
        t.expect_dtype("GraphSafeGenerator::fill_normal_tensor", DType::F32)?;
        let fill = Fill::Normal { mean, std };
        self.fill_tensor("GraphSafeGenerator::fill_normal_tensor", t, fill)
    }

    /// Dropout into preallocated `out` and `mask` tensors on this generator's device
    /// (same semantics as [`Generator::dropout_into`](crate::Generator::dropout_into)).
    pub fn dropout_into(
        &mut self,
        input: &Tensor,
        p: f32,
        out: &mut Tensor,
        mask: &mut Tensor,
    ) -> Result<()> {
        const OP: &str = "GraphSafeGenerator::dropout_into";
        check_dropout_dtype(OP, input.dtype())?;
        check_probability(p)?;
        self.check_device(OP, input)?;
        check_dropout_outputs(OP, input, out, mask)?;
        dropout(Draw::GraphSafe(&self.state), p, input, out, mask)?;
        self.advance(input.numel())
    }

    fn fill_tensor(&mut self, op: &'static str, t: &mut Tensor, fill: Fill) -> Result<()> {
        self.check_device(op, t)?;
        self::fill(Draw::GraphSafe(&self.state), fill, t)?;
        self.advance(t.numel())
    }

    fn check_device(&self, op: &'static str, t: &Tensor) -> Result<()> {
        if t.device() != self.device() {
            return Err(Error::device(
                op,
                format!("{} (the graph-safe generator's device)", self.device()),
                t.device(),
            ));
        }
        Ok(())
    }

    /// Queues `state.offset += words(n)`.
    fn advance(&mut self, n: usize) -> Result<()> {
        let words = offset_increment(n);
        if words == 0 {
            return Ok(());
        }
        let f = self.device.function(&PTX, "tessera_rng_advance")?;
        let cfg = tessera_core::cuda::LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (1, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = self.device.stream().launch_builder(&f);
        b.arg(&mut self.state).arg(&words);
        // SAFETY: `tessera_rng_advance(u64* state, u64 words)` with a live 2-element
        // state buffer; one thread adds to `state[1]`.
        unsafe { b.launch(cfg) }.cuda_op("launch tessera_rng_advance")?;
        Ok(())
    }
}

impl fmt::Debug for GraphSafeGenerator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GraphSafeGenerator")
            .field("device", &self.device())
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use tessera_core::cuda::ModuleCode;
    use tessera_core::kernels::PTX_TARGET;

    use super::*;

    /// The embedded cubin was compiled from the PTX embedded beside it.
    #[test]
    fn embedded_sass_is_fresh() {
        PTX.check_sass_fresh().unwrap();
    }

    /// A device of the cubin's capability loads the cubin, and its kernels draw the same
    /// bits as the driver's compilation of the PTX (loaded under another name).
    #[test]
    #[ignore = "needs a CUDA GPU: cargo xtask test-gpu"]
    fn the_cubin_and_the_ptx_draw_alike() {
        const PTX_ONLY: PtxModule = PtxModule {
            name: "tessera_rng_ptx_only",
            ptx: PTX.ptx,
            sass: None,
        };
        let dev = tessera_core::cuda::device(0).unwrap();
        let state = GeneratorState {
            seed: 0x5eed_1234_abcd,
            offset: 40,
        };
        for (kind, dtype) in [
            (Fill::U32, DType::U32),
            (Fill::Uniform, DType::F32),
            (
                Fill::Normal {
                    mean: 0.5,
                    std: 2.0,
                },
                DType::F32,
            ),
        ] {
            let mut a = Tensor::zeros([1000, 37], dtype, Device::Cuda(0)).unwrap();
            let mut b = Tensor::zeros([1000, 37], dtype, Device::Cuda(0)).unwrap();
            fill(Draw::At(state), kind, &mut a).unwrap();
            fill_from(&PTX_ONLY, Draw::At(state), kind, &mut b).unwrap();
            assert_eq!(a.to_bytes().unwrap(), b.to_bytes().unwrap(), "{kind:?}");
        }
        let (major, minor) = dev.compute_capability();
        let expected = match (major as u32, minor as u32) == PTX_TARGET {
            true => ModuleCode::Sass,
            false => ModuleCode::Ptx,
        };
        assert_eq!(dev.loaded_code(&PTX), Some(expected));
        assert_eq!(dev.loaded_code(&PTX_ONLY), Some(ModuleCode::Ptx));
    }
}
