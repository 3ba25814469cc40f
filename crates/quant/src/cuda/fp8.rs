//! Per-tensor FP8 on the device.

use cudarc::driver::{DeviceRepr, LaunchConfig};
use tessera_core::cuda::{CudaDevice, CudaResultExt, grid_1d};
use tessera_core::{DType, Device, Error, Result, Tensor};

use super::{
    BLOCK, FP8_DEQ_TILES, FP8_PTX, Order, Params, amax_target, clear_amaxes, dequant_addrs,
    dequant_units_grid, dequant_vals, device_addr, device_addr_mut, device_of, dtype_suffix,
    format_suffix, launch_params, tile_grid,
};
use crate::values::check_input;
use crate::{AmaxComputeAlgo, BufferName, DelayedScalingState, Fp8Format, QuantizedTensor};

/// Steps of 16 elements each thread of the rowwise cast loads per round
/// (`TQ_CAST_ROUND` in kernels/fp8.cu): the grid covers `numel / (16 * CAST_ROUND)`
/// threads before its cap.
const CAST_ROUND: usize = 2;

/// NaN-ignoring `max |x|` of a CUDA tensor into a new device `f32 [1]`.
pub(crate) fn amax(x: &Tensor) -> Result<Tensor> {
    let mut out = Tensor::empty([1], DType::F32, x.device())?;
    amax_into(x, &mut out)?;
    Ok(out)
}

/// NaN-ignoring `max |x|` of a CUDA tensor into `out`, a device `f32 [1]` on `x`'s
/// device, which is cleared first (the pass accumulates with atomic maxima). Both
/// launches are programmatic (`Order::WaitFirst`), so the quantizing pass after them
/// can launch early too.
pub(crate) fn amax_into(x: &Tensor, out: &mut Tensor) -> Result<()> {
    const OP: &str = "cuda amax";
    let dev = device_of(x)?;
    let dst = amax_target(OP, &dev, x, out)?;
    let f = dev.function(
        &FP8_PTX,
        &format!("tessera_amax_{}", dtype_suffix(OP, x.dtype())?),
    )?;
    let (src, n) = (device_addr(&dev, x)?, x.numel() as u64);
    let per = 16 / x.dtype().size_in_bytes();
    let cfg = grid_1d(&dev, x.numel().div_ceil(per), BLOCK)?;
    // SAFETY: dst is the address of `out`, an f32 [1] on dev (amax_target), borrowed
    // mutably here.
    unsafe { clear_amaxes(&dev, OP, dst, 0) }?;
    let mut p = Params::default();
    p.arg(&src).arg(&n).arg(&dst);
    // SAFETY: tessera_amax_T(const T* x, u64 n, float* out): x holds n elements of T
    // (dtype-checked by the kernel name), out one float, zeroed by the launch before;
    // the kernel touches memory only after its pdl_amax_first().
    unsafe { launch_params(&dev, &f, cfg, OP, Order::WaitFirst, &mut p) }
}

/// Where a cast takes its scale from: a device `f32 [1]` (delayed scaling, or a scale
/// the host computed), or `compute_scale_from_amax` of a device amax, which the cast
/// kernel computes itself (current scaling: no launch between the amax pass and the cast).
pub(crate) enum ScaleFrom<'a> {
    /// `scale[0]`.
    Scale(&'a Tensor),
    /// `compute_scale_from_amax(amax[0], format max, pow2, eps, f32::MAX)`.
    Amax {
        amax: &'a Tensor,
        pow2: bool,
        eps: f32,
    },
}

/// The kernels' `Fp8Scale` (kernels/fp8.cu), field for field.
#[repr(C)]
#[derive(Clone, Copy)]
struct Fp8Scale {
    scale: u64,
    amax: u64,
    fp8_max: f32,
    eps: f32,
    pow2: i32,
    /// Spelled out so that every byte the driver copies is initialised.
    pad: i32,
}

// SAFETY: a #[repr(C)] struct of two u64 and four 4-byte fields laid out exactly as the
// kernel's `Fp8Scale` (naturally aligned, no implicit padding), passed by value.
unsafe impl DeviceRepr for Fp8Scale {}

impl ScaleFrom<'_> {
    fn arg(&self, dev: &CudaDevice, format: Fp8Format) -> Result<Fp8Scale> {
        Ok(match *self {
            ScaleFrom::Scale(s) => Fp8Scale {
                scale: device_addr(dev, s)?,
                amax: 0,
                fp8_max: format.max(),
                eps: 0.0,
                pow2: 0,
                pad: 0,
            },
            ScaleFrom::Amax { amax, pow2, eps } => Fp8Scale {
                scale: 0,
                amax: device_addr(dev, amax)?,
                fp8_max: format.max(),
                eps,
                pow2: i32::from(pow2),
                pad: 0,
            },
        })
    }
}

/// Casts `x` with the scale `scale` names into `out`'s buffers (its usage decides which);
/// `amax`, when given, collects `max |x|`.
pub(crate) fn cast_into(
    x: &Tensor,
    scale: ScaleFrom<'_>,
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
    // Current scaling's cast follows its amax pass directly; with a given scale the
    // kernels call pdl_first() before any memory access.
    let order = match scale {
        ScaleFrom::Amax { .. } => Order::OverlapAmaxPass,
        ScaleFrom::Scale(_) => Order::WaitFirst,
    };
    let sa = scale.arg(&dev, format)?;
    let amax = amax.map_or(Ok(0), |a| device_addr_mut(&dev, a))?;
    let xa = device_addr(&dev, x)?;
    let scale_inv = out.take_buffer(BufferName::ScaleInv)?;
    let sia = device_addr(&dev, &scale_inv)?;
    if usage.columnwise() {
        let q = match usage.rowwise() {
            true => Some(out.take_buffer(BufferName::Data)?),
            false => None,
        };
        let qt = out.take_buffer(BufferName::ColumnwiseData)?;
        let f = dev.function(&FP8_PTX, &format!("tessera_fp8_cast_transpose_{sfx}_{fmt}"))?;
        let cfg = tile_grid(OP, m, k, 128, 128)?;
        let (mu, ku) = (m as u64, k as u64);
        let qa = q.as_ref().map_or(Ok(0), |q| device_addr(&dev, q))?;
        let qta = device_addr(&dev, &qt)?;
        let mut p = Params::default();
        p.arg(&xa).arg(&qa).arg(&qta).arg(&mu).arg(&ku);
        p.arg(&sa).arg(&sia).arg(&amax);
        // SAFETY: (const T* x, u8* q, u8* qt, u64 m, u64 k, Fp8Scale scale, float*
        // scale_inv, float* amax): x is [m, k] of T, q [m, k] bytes or null, qt [k, m]
        // bytes, scale's live pointer and scale_inv/amax one float each (amax may be
        // null). After the amax pass the kernel loads only its tile of x before
        // pdl_wait().
        unsafe { launch_params(&dev, &f, cfg, OP, order, &mut p) }?;
        out.put_buffer(BufferName::ColumnwiseData, qt);
        if let Some(q) = q {
            out.put_buffer(BufferName::Data, q);
        }
    } else {
        let q = out.take_buffer(BufferName::Data)?;
        let f = dev.function(&FP8_PTX, &format!("tessera_fp8_cast_{sfx}_{fmt}"))?;
        let n = x.numel() as u64;
        let cfg = grid_1d(&dev, x.numel().div_ceil(16 * CAST_ROUND), BLOCK)?;
        let qa = device_addr(&dev, &q)?;
        let mut p = Params::default();
        p.arg(&xa).arg(&qa).arg(&n).arg(&sa).arg(&sia).arg(&amax);
        // SAFETY: (const T* x, u8* q, u64 n, Fp8Scale scale, float* scale_inv, float*
        // amax): x holds n elements of T, q n bytes, scale's live pointer and
        // scale_inv/amax one float each (amax may be null); 16-element steps read
        // 16-byte-aligned vectors (allocations are 256-byte aligned and steps start at
        // multiples of 16 elements). After the amax pass the kernel loads only its first
        // step of x before pdl_wait().
        unsafe { launch_params(&dev, &f, cfg, OP, order, &mut p) }?;
        out.put_buffer(BufferName::Data, q);
    }
    out.put_buffer(BufferName::ScaleInv, scale_inv);
    out.source_dtype = x.dtype();
    Ok(())
}

/// Dequantizes rowwise FP8 bytes `q` with `scale_inv` into `y` (as many elements, of
/// f32, bf16 or f16).
pub(crate) fn dequantize(
    q: &Tensor,
    scale_inv: &Tensor,
    format: Fp8Format,
    y: &mut Tensor,
) -> Result<()> {
    const OP: &str = "cuda fp8 dequantize";
    let dev = device_of(q)?;
    let dtype = y.dtype();
    let f = dev.function(
        &FP8_PTX,
        &format!(
            "tessera_fp8_dequant_{}_{}",
            dtype_suffix(OP, dtype)?,
            format_suffix(format)
        ),
    )?;
    let n = q.numel() as u64;
    // Units of `v` elements, two a thread, and at least `v` threads for the last n % v.
    let v = dequant_vals(dtype);
    let cfg = dequant_units_grid(q.numel().div_ceil(v).max(v))?;
    let [qa, sa, ya] = dequant_addrs(&dev, q, scale_inv, y)?;
    let mut p = Params::default();
    p.arg(&qa).arg(&ya).arg(&n).arg(&sa);
    // SAFETY: (const u8* q, T* y, u64 n, const float* scale_inv): q n bytes, y n elements
    // of T, scale_inv one float; the kernel calls pdl_first() before any memory access.
    unsafe { launch_params(&dev, &f, cfg, OP, Order::WaitFirst, &mut p) }
}

/// Dequantizes the transposed columnwise FP8 data `qt` (`[k, m]` bytes) of an `[m, k]`
/// tensor straight into `y`, `[m, k]` elements of f32, bf16 or f16 (no separate
/// transpose).
pub(crate) fn dequantize_transposed(
    qt: &Tensor,
    scale_inv: &Tensor,
    format: Fp8Format,
    y: &mut Tensor,
) -> Result<()> {
    const OP: &str = "cuda fp8 dequantize columnwise";
    let (shape, dtype) = (y.shape().clone(), y.dtype());
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
    // A CTA per tile of the stored [k, m], 64 or 128 rows by 256 bytes by shape (striding
    // per element when m % 16 != 0).
    let tile = FP8_DEQ_TILES.pick(m, k, dev.multiprocessors() as usize);
    let f = dev.function(
        &FP8_PTX,
        &format!(
            "tessera_fp8_dequant_{}{}_{}",
            tile.infix(),
            dtype_suffix(OP, dtype)?,
            format_suffix(format)
        ),
    )?;
    let (mu, ku) = (m as u64, k as u64);
    let cfg = FP8_DEQ_TILES.grid(m, k, tile)?;
    let [qa, sa, ya] = dequant_addrs(&dev, qt, scale_inv, y)?;
    let mut p = Params::default();
    p.arg(&qa).arg(&ya).arg(&mu).arg(&ku).arg(&sa);
    // SAFETY: (const u8* q, T* y, u64 m, u64 k, const float* scale_inv): q holds the
    // m*k bytes of the [k, m] transpose (checked above), y m*k elements of T, scale_inv
    // one float; the kernel calls pdl_first() before any memory access.
    unsafe { launch_params(&dev, &f, cfg, OP, Order::WaitFirst, &mut p) }
}

/// A delayed-scaling state held on a device, in the buffers the casts and the update
/// kernel use: they stay put for the state's life (uploads write into them), so that a
/// captured CUDA graph keeps addressing the live state.
///
/// History slot 0 is `slot0` (`f32 [1]`, where casts collect their amaxes); slots 1 ..
/// are a ring (`f32 [max(len - 1, 1)]`) whose oldest entry, slot 1, is at index `head`
/// (`u32 [1]`); the scale is `scale` (`f32 [1]`).
#[derive(Clone)]
pub(crate) struct DelayedState {
    pub(crate) slot0: Tensor,
    ring: Tensor,
    /// The number of history slots (`len - 1` of them in the ring).
    len: usize,
    head: Tensor,
    pub(crate) scale: Tensor,
}

impl DelayedState {
    /// Buffers on `device` holding `state`.
    pub(crate) fn upload(state: &DelayedScalingState, device: Device) -> Result<Self> {
        let ring_len = (state.history().len() - 1).max(1);
        let mut s = DelayedState {
            slot0: Tensor::zeros([1], DType::F32, device)?,
            ring: Tensor::zeros([ring_len], DType::F32, device)?,
            len: state.history().len(),
            head: Tensor::zeros([1], DType::U32, device)?,
            scale: Tensor::zeros([1], DType::F32, device)?,
        };
        s.write(state)?;
        Ok(s)
    }

    /// The device these buffers are on.
    pub(crate) fn device(&self) -> Device {
        self.slot0.device()
    }

    /// Whether `state` fits these buffers (the same history length).
    pub(crate) fn fits(&self, state: &DelayedScalingState) -> bool {
        state.history().len() == self.len
    }

    /// Writes `state` (of this history length) into the buffers, in place: slot 0, the
    /// older slots from ring index 0, the scale.
    pub(crate) fn write(&mut self, state: &DelayedScalingState) -> Result<()> {
        const OP: &str = "Fp8DelayedScaling::to_device";
        debug_assert!(self.fits(state));
        let dev = device_of(&self.slot0)?;
        let h = state.history();
        let mut ring = h[1..].to_vec();
        ring.resize(self.ring.numel(), 0.0);
        let stream = dev.stream();
        let put = |t: &mut Tensor, bytes: &[u8]| -> Result<()> {
            stream.memcpy_htod(bytes, t.cuda_slice_mut()?).cuda_op(OP)?;
            Ok(())
        };
        put(&mut self.slot0, bytemuck::bytes_of(&h[0]))?;
        put(&mut self.ring, bytemuck::cast_slice(&ring))?;
        put(&mut self.head, bytemuck::bytes_of(&0u32))?;
        put(&mut self.scale, bytemuck::bytes_of(&state.scale()))
    }

    /// A copy of the buffers in fresh device memory, queued on the device's stream:
    /// nothing waits, and these buffers stay where they are (captured graphs keep
    /// addressing them).
    pub(crate) fn duplicate(&self) -> Result<DelayedState> {
        let mut d = self.clone();
        // Each clone shares its buffer with `self`; asking for it mutably copies it.
        for t in [&mut d.slot0, &mut d.ring, &mut d.head, &mut d.scale] {
            t.cuda_slice_mut()?;
        }
        Ok(d)
    }

    /// Copies what `other` (a [`duplicate`](Self::duplicate) of buffers of this device
    /// and history length) holds into these buffers in place, queued on the device's
    /// stream.
    pub(crate) fn copy_from(&mut self, other: &DelayedState) -> Result<()> {
        const OP: &str = "Fp8DelayedScaling::restore";
        debug_assert!(self.matches(other));
        let dev = device_of(&self.slot0)?;
        let stream = dev.stream();
        for (dst, src) in [
            (&mut self.slot0, &other.slot0),
            (&mut self.ring, &other.ring),
            (&mut self.head, &other.head),
            (&mut self.scale, &other.scale),
        ] {
            stream
                .memcpy_dtod(src.cuda_slice()?, dst.cuda_slice_mut()?)
                .cuda_op(OP)?;
        }
        Ok(())
    }

    /// Whether `other` has buffers of this device and history length.
    pub(crate) fn matches(&self, other: &DelayedState) -> bool {
        self.device() == other.device() && self.len == other.len
    }

    /// The state the buffers hold (waits for the device).
    pub(crate) fn read(&self) -> Result<DelayedScalingState> {
        let slot0 = self.slot0.to_vec::<f32>()?[0];
        let ring = self.ring.to_vec::<f32>()?;
        let head = self.head.to_vec::<u32>()?[0] as usize;
        let scale = self.scale.to_vec::<f32>()?[0];
        let older = &ring[..self.len - 1];
        let mut history = Vec::with_capacity(self.len);
        history.push(slot0);
        if !older.is_empty() {
            history.extend_from_slice(&older[head..]);
            history.extend_from_slice(&older[..head]);
        }
        Ok(DelayedScalingState::from_parts(history, scale))
    }
}

/// The kernels' `DelayedDesc` (kernels/fp8.cu), field for field: one state's buffers
/// and update parameters.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct DelayedDesc {
    slot0: u64,
    ring: u64,
    head: u64,
    ring_len: u64,
    scale: u64,
    scaled_max: f32,
    history_max: i32,
}

/// States per update launch (`DELAYED_BULK` in kernels/fp8.cu).
const DELAYED_BULK: usize = 64;

/// The kernels' `DelayedBulk`: the descriptors of one launch, passed by value.
#[repr(C)]
#[derive(Clone, Copy)]
struct DelayedBulk {
    d: [DelayedDesc; DELAYED_BULK],
}

// SAFETY: #[repr(C)] arrays of a #[repr(C)] struct of five u64 and two 4-byte fields,
// laid out exactly as the kernel's `DelayedBulk` (naturally aligned, no implicit
// padding: 48 bytes a descriptor), passed by value.
unsafe impl DeviceRepr for DelayedBulk {}

/// One state to update: its buffers, the update's `fp8_max · 2^-margin`, and the
/// algorithm.
pub(crate) struct DelayedUpdate<'a> {
    pub(crate) state: &'a mut DelayedState,
    pub(crate) format: Fp8Format,
    pub(crate) margin: i32,
    pub(crate) algo: AmaxComputeAlgo,
}

/// Queues [`DelayedScalingState::update`] of every state in `updates` (all on one
/// device, else an error before anything is queued), without a reduced amax (an
/// all-reduce of slot 0 in place takes its role): one CTA per state, up to 64 states a
/// launch, their descriptors passed by value so that a captured graph holds them. Nothing waits and nothing is allocated (unless a buffer is
/// shared with a clone, which is copied first).
pub(crate) fn update_all(updates: &mut [DelayedUpdate<'_>]) -> Result<()> {
    const OP: &str = "cuda fp8 delayed-scaling update";
    let Some(first) = updates.first() else {
        return Ok(());
    };
    let device = first.state.device();
    if let Some(u) = updates.iter().find(|u| u.state.device() != device) {
        return Err(Error::device(OP, device.to_string(), u.state.device()));
    }
    let dev = device_of(&first.state.slot0)?;
    let f = dev.function(&FP8_PTX, "tessera_fp8_delayed_update")?;
    for chunk in updates.chunks_mut(DELAYED_BULK) {
        let mut bulk = DelayedBulk {
            d: [DelayedDesc::default(); DELAYED_BULK],
        };
        for (d, u) in bulk.d.iter_mut().zip(chunk.iter_mut()) {
            let s = &mut *u.state;
            *d = DelayedDesc {
                slot0: device_addr_mut(&dev, &mut s.slot0)?,
                ring: device_addr_mut(&dev, &mut s.ring)?,
                head: device_addr_mut(&dev, &mut s.head)?,
                ring_len: (s.len - 1) as u64,
                scale: device_addr_mut(&dev, &mut s.scale)?,
                scaled_max: DelayedScalingState::scaled_max(u.format, u.margin),
                history_max: i32::from(u.algo == AmaxComputeAlgo::Max),
            };
        }
        let n = chunk.len() as u32;
        let cfg = LaunchConfig {
            grid_dim: (n, 1, 1),
            block_dim: (BLOCK, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut p = Params::default();
        p.arg(&bulk).arg(&n);
        // SAFETY: (DelayedBulk b, u32 n), n CTAs: the first n descriptors address live
        // buffers of this device (checked before the loop): slot0, head and scale one element
        // each, ring at least ring_len floats (max(len - 1, 1) allocated), head below
        // ring_len whenever ring_len > 0 (written 0, then advanced modulo it); the kernel
        // calls pdl_first() before any memory access.
        unsafe { launch_params(&dev, &f, cfg, OP, Order::WaitFirst, &mut p) }?;
    }
    Ok(())
}
