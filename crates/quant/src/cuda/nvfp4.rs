//! NVFP4 on the device.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::sys::{CUdevice_attribute, CUfunction_attribute};
use cudarc::driver::{DeviceRepr, LaunchConfig};
use tessera_core::cuda::{CudaDevice, CudaResultExt, grid_1d};
use tessera_core::{DType, Error, Result, Tensor};
use tessera_rng::Generator;

use super::{
    BLOCK, ColsTile, NVFP4_DEQ_TILES, NVFP4_PTX, Order, Outputs, Params, amax_target, banded_grid,
    banded_grid_padded, clear_amaxes, dequant_addrs, dequant_units_grid, dequant_vals, device_addr,
    device_of, dtype_suffix, launch_params, max_active_clusters, tile_grid,
};
use crate::values::check_input;
use crate::{AmaxReduction, BufferName, QuantizedTensor, Usage};

/// The 1x16 blocks each thread of the rowwise kernel quantizes (`NVFP4_ROW_BLOCKS` in
/// kernels/nvfp4.cu).
const ROW_BLOCKS: usize = 2;

/// The kernel's `Nvfp4Args` (kernels/nvfp4.cu), field for field.
#[repr(C)]
#[derive(Clone, Copy)]
struct Nvfp4Args {
    m: u64,
    k: u64,
    amax_row: u64,
    amax_col: u64,
    q_row: u64,
    s_row: u64,
    s_row_cols: u64,
    q_col: u64,
    s_col: u64,
    s_col_cols: u64,
    two_d: i32,
    rht: i32,
    swizzled: i32,
    sr: i32,
    seed: u64,
    off_row: u64,
    off_col: u64,
    amax_copy: u64,
}

// SAFETY: a #[repr(C)] struct of integers laid out exactly as the kernel's `Nvfp4Args`
// (all fields naturally aligned, no padding), passed by value.
unsafe impl DeviceRepr for Nvfp4Args {}

/// All-reduces the device scalar `a` (on `dev`) in place through `reduction` (which
/// reads it back to the host).
fn reduce_in_place(
    dev: &CudaDevice,
    a: &mut Tensor,
    reduction: &Arc<dyn AmaxReduction>,
) -> Result<()> {
    let v = reduction.all_reduce_max(a.to_vec::<f32>()?[0])?;
    dev.stream()
        .memcpy_htod(&v.to_le_bytes()[..], a.cuda_slice_mut()?)
        .cuda_op("cuda nvfp4 amax reduction")
}

/// The global amaxes of an RHT quantization on the device, from one read of `x`:
/// `max |x|` (rowwise) into `row` and `max |RHT(xᵀ)|` (columnwise) into `col`, both
/// `f32 [1]` on `x`'s device and cleared first. Both launches are programmatic, as in
/// [`super::fp8::amax_into`].
fn rht_amaxes_into(dev: &CudaDevice, x: &Tensor, row: &mut Tensor, col: &mut Tensor) -> Result<()> {
    const OP: &str = "cuda nvfp4 amax";
    let (m, k) = x.shape().flat_2d();
    let r = amax_target(OP, dev, x, row)?;
    let c = amax_target(OP, dev, x, col)?;
    let f = dev.function(
        &NVFP4_PTX,
        &format!("tessera_nvfp4_rht_amax_{}", dtype_suffix(OP, x.dtype())?),
    )?;
    let (src, mu, ku) = (device_addr(dev, x)?, m as u64, k as u64);
    // A thread per run of 16 rows of RHT_AMAX_COLS columns (8 for 2-byte types).
    let cols = if x.dtype().size_in_bytes() == 2 { 8 } else { 1 };
    let cfg = grid_1d(dev, (m / 16) * (k / cols), BLOCK)?;
    // SAFETY: r and c are the addresses of `row` and `col`, distinct f32 [1] tensors on
    // dev (amax_target), borrowed mutably here.
    unsafe { clear_amaxes(dev, OP, r, c) }?;
    let mut p = Params::default();
    p.arg(&src).arg(&mu).arg(&ku).arg(&r).arg(&c);
    // SAFETY: (const T* x, u64 m, u64 k, float* row, float* col): x is [m, k] with m and
    // k multiples of 16 (checked by the quantizer), so 8-column groups of 2-byte T are
    // 16-byte aligned rows of a 256-byte-aligned allocation; row and col are distinct
    // f32 scalars, zeroed by the launch before; the kernel touches memory only after
    // its pdl_amax_first().
    unsafe { launch_params(dev, &f, cfg, OP, Order::WaitFirst, &mut p) }
}

/// The global amaxes of a quantization, in `out`'s own amax buffers: `Amax` for the
/// rowwise data and `ColumnwiseAmax` for the columnwise data, each taken out of `out`
/// (the caller puts them back). Nothing of `out` is replaced or freed, so the
/// quantization can be captured into a CUDA graph: a buffer dropped during capture
/// would free memory the graph does not own, which fails the capture.
struct Amaxes {
    row: Option<Tensor>,
    col: Option<Tensor>,
    /// The RHT's rowwise amax when `out` has no rowwise data (the pass computes both).
    spare: Option<Tensor>,
}

impl Amaxes {
    /// `usage` is `out`'s, from before [`Outputs::take`] (which leaves `out` without
    /// data buffers, from which its usage is read).
    fn take(out: &mut QuantizedTensor, usage: Usage) -> Result<Self> {
        let row = match usage.rowwise() {
            true => Some(out.take_buffer(BufferName::Amax)?),
            false => None,
        };
        let col = match usage.columnwise() {
            true => match out.take_buffer(BufferName::ColumnwiseAmax) {
                Ok(t) => Some(t),
                Err(e) => {
                    if let Some(t) = row {
                        out.put_buffer(BufferName::Amax, t);
                    }
                    return Err(e);
                }
            },
            false => None,
        };
        Ok(Amaxes {
            row,
            col,
            spare: None,
        })
    }

    /// Runs the amax pass(es) over `x` (with the RHT: both amaxes in one pass) and the
    /// all-reduce, if any. Without the RHT both orientations share one amax: it goes
    /// into the rowwise buffer when there is one, and the quantize kernel copies it to
    /// the columnwise one (`Nvfp4Args::amax_copy`, see [`addrs`](Self::addrs)).
    fn compute(
        &mut self,
        dev: &CudaDevice,
        x: &Tensor,
        rht: bool,
        reduction: Option<&Arc<dyn AmaxReduction>>,
    ) -> Result<()> {
        if rht {
            if self.row.is_none() {
                self.spare = Some(Tensor::empty([1], DType::F32, x.device())?);
            }
            let (Some(row), Some(col)) =
                (self.row.as_mut().or(self.spare.as_mut()), self.col.as_mut())
            else {
                return Err(Error::state(
                    "cuda nvfp4 amax",
                    "the RHT applies to the columnwise operand, and the output has none",
                ));
            };
            rht_amaxes_into(dev, x, row, col)?;
            if let Some(r) = reduction {
                reduce_in_place(dev, row, r)?;
                reduce_in_place(dev, col, r)?;
            }
        } else {
            let a = self.shared_mut()?;
            super::fp8::amax_into(x, a)?;
            if let Some(r) = reduction {
                reduce_in_place(dev, a, r)?;
            }
        }
        Ok(())
    }

    /// The buffer the amax pass fills without the RHT.
    fn shared_mut(&mut self) -> Result<&mut Tensor> {
        self.row
            .as_mut()
            .or(self.col.as_mut())
            .ok_or_else(|| Error::state("cuda nvfp4 amax", "the output has neither orientation"))
    }

    /// Device addresses for the kernel: (rowwise amax, columnwise amax, copy target).
    fn addrs(&self, dev: &CudaDevice, rht: bool) -> Result<(u64, u64, u64)> {
        let addr = |t: Option<&Tensor>| t.map_or(Ok(0), |t| device_addr(dev, t));
        if rht {
            let row = addr(self.row.as_ref().or(self.spare.as_ref()))?;
            Ok((row, addr(self.col.as_ref())?, 0))
        } else {
            let shared = addr(self.row.as_ref().or(self.col.as_ref()))?;
            // Both orientations: the pass filled `row`, the kernel copies it into `col`.
            let copy = match self.row.is_some() {
                true => addr(self.col.as_ref())?,
                false => 0,
            };
            Ok((shared, shared, copy))
        }
    }

    fn put_back(self, out: &mut QuantizedTensor) {
        if let Some(t) = self.row {
            out.put_buffer(BufferName::Amax, t);
        }
        if let Some(t) = self.col {
            out.put_buffer(BufferName::ColumnwiseAmax, t);
        }
    }
}

/// The fewest values of a 2-D NVFP4 tensor whose compact scale grids take two steps (block
/// scales into a scratch, then `tessera_nvfp4_scales_2d`). In one step the tile kernel
/// stores 8 bytes of 128 rows of each grid, partial lines, which cost the kernel a fifth of
/// its time on an H100 even while its outputs fit in L2 (8192x4096, 38 MB: 0.0578 ms
/// against 0.0452 without the scale bytes) and a quarter beyond it (16384x8192 on an H200:
/// 0.048 of 0.174 ms). The second kernel writes whole lines (0.0069 ms at 16384x8192, 0.87
/// of a copy, on an H100); two steps won 12-15% on an H100 at 2^25 values (8192x4096 0.0509
/// against 0.0579 ms, 4096x8192 0.0487 against 0.0568), 17-19% above, and lost 0.8-1% at
/// 4096x4096 (2^24), where the second launch costs about what the flush does. The H200
/// agrees: two steps 12-20% faster from 2^25 values up (8192x4096 0.0376 against 0.0426 ms,
/// 4096x8192 0.0364 against 0.0421, 16384x8192 0.1380 against 0.1734), 8% slower at
/// 4096x4096 (0.0214 against 0.0198) (BENCHMARKS, sessions 36, 37 and 40). The first step's
/// scales went through the block grid and its transpose then; through 128 bytes a tile of
/// scratch since, 0.7-1.6% faster on an H100 (session 50).
const TWO_STEP_2D_MIN_VALUES: usize = 1 << 25;
/// The fewest values that take two steps (as for [`TWO_STEP_2D_MIN_VALUES`]) on a device
/// whose DRAM is slow for its SMs ([`slow_dram`]: an H100 SXM). With the tile kernel at 3
/// CTAs per SM (session 51), two steps won 8.5% at 4096x4096 on an H100 (2-D both 0.978
/// of its floor against 0.895, 143 rounds alternated, session 53) where they had lost
/// 0.8-1% at 4 CTAs; the H200's last word (8% slower, session 40) predates both changes.
const TWO_STEP_2D_SLOW_DRAM_MIN_VALUES: usize = 1 << 24;

/// How [`Nvfp4Quantizer`](crate::Nvfp4Quantizer) launches its round-to-nearest 1-D
/// kernel for 2-byte inputs without the RHT, with columnwise data and compact scales. A
/// compact scale grid's 128-byte line holds 8 bytes of each of 16 tiles (of 128x128
/// values), so the banded launch (CTAs in bands of 8 tile rows) stores partial lines,
/// which costs where the DRAM is slow for the SMs. Two launches mend that: clusters of
/// 8x2 tiles (`tessera_nvfp4_both_c8x2_*`), run at once on one GPC so that their pieces
/// of a line meet in L2, and two steps (`tessera_nvfp4_both_s2_*`, which stores each
/// tile's scale bytes into a scratch of 2 KiB a tile, whole lines, then
/// `tessera_nvfp4_scales_1d`, which writes the grids' rows). All three write the same
/// bytes. Set it with [`set_nvfp4_launch`].
///
/// Measured (the quantizer: amax pass and kernels, 39 runs alternated; BENCHMARKS.md,
/// session 46), on an H100 SXM, of the two-pass floor:
///
/// | `[m, k]` | bands | clusters | two steps |
/// |---|---:|---:|---:|
/// | 16384x8192 | 0.855 | 0.886 | 0.895 |
/// | 8192x8192 | 0.833 | 0.854 | 0.871 |
/// | 8192x4096 | 0.876 | 0.864 | 0.847 |
/// | 4096x4096 | 0.955 | 0.899 | 0.896 |
///
/// On an H200, whose compact stores cost the kernel about 2% (against a fifth on the
/// H100), bands are the launch measured.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Nvfp4Launch {
    /// Two steps for tensors of 2^26 values or more on devices whose DRAM moves at most
    /// 15 bytes per SM clock and SM (an H100 SXM: 12.8; an H200: about 18.4 by its data
    /// sheet), bands otherwise.
    #[default]
    Auto,
    /// Clusters for every tensor of more than 512 rows, on devices where a GPC holds a
    /// cluster of 16 CTAs (not every MIG slice does); bands otherwise.
    Clusters,
    /// Bands always.
    Bands,
    /// Two steps for every tensor (bands for one of more than 2^32 grid pieces of 8
    /// bytes, which the second kernel cannot index: some 5 * 10^11 values).
    TwoStep,
}

/// The process's [`Nvfp4Launch`], as its discriminant.
static LAUNCH: AtomicU8 = AtomicU8::new(Nvfp4Launch::Auto as u8);

/// Sets how every device of the process launches the NVFP4 kernel of [`Nvfp4Launch`]
/// (for measuring the launches against each other; [`Nvfp4Launch::Auto`] until set).
/// Quantizations already enqueued keep the launch they took.
pub fn set_nvfp4_launch(launch: Nvfp4Launch) {
    LAUNCH.store(launch as u8, Ordering::Relaxed);
}

/// The launch [`set_nvfp4_launch`] set last.
pub fn nvfp4_launch() -> Nvfp4Launch {
    match LAUNCH.load(Ordering::Relaxed) {
        x if x == Nvfp4Launch::Clusters as u8 => Nvfp4Launch::Clusters,
        x if x == Nvfp4Launch::Bands as u8 => Nvfp4Launch::Bands,
        x if x == Nvfp4Launch::TwoStep as u8 => Nvfp4Launch::TwoStep,
        _ => Nvfp4Launch::Auto,
    }
}

/// The fewest values of a tensor that [`Nvfp4Launch::Auto`] quantizes in two steps: the
/// H100's crossover (between 2^25 and 2^26 values).
const TWO_STEP_1D_MIN_VALUES: usize = 1 << 26;
/// The most DRAM bytes per SM clock and SM of a device that [`Nvfp4Launch::Auto`] takes
/// two steps on (and 2-D blocks from [`TWO_STEP_2D_SLOW_DRAM_MIN_VALUES`]).
const SLOW_DRAM_BYTES_PER_SM_CLOCK: f64 = 15.0;
/// Tensors of at most this many rows (4 tile rows) keep the banded launch under
/// [`Nvfp4Launch::Clusters`], their bands then as tall as the tensor; a cluster's band is
/// 8 tile rows.
const CLUSTER_MIN_ROWS: usize = 512;
/// The most 8-byte pieces of a scale grid's rows (rows times tiles a row) that two steps
/// take: `tessera_nvfp4_scales_1d` numbers its threads (a quarter as many) and the grid
/// rows (at most as many) in 32 bits.
const TWO_STEP_1D_MAX_PIECES: usize = u32::MAX as usize - 255;

/// DRAM bytes per SM clock and SM: 2 transfers a memory clock (`mem_khz`) over a bus of
/// `bus_bits`, divided by `sms` SMs at `sm_khz`. None where the driver reports a zero
/// (or negative) clock, width or count.
fn dram_bytes_per_sm_clock(mem_khz: i32, bus_bits: i32, sm_khz: i32, sms: u32) -> Option<f64> {
    if mem_khz <= 0 || bus_bits <= 0 || sm_khz <= 0 || sms == 0 {
        return None;
    }
    let bytes_per_ms = 2.0 * f64::from(mem_khz) * f64::from(bus_bits) / 8.0;
    Some(bytes_per_ms / (f64::from(sm_khz) * f64::from(sms)))
}

/// A driver's answer about a device, asked once per key for the process.
type Answers<K> = OnceLock<Mutex<HashMap<K, bool>>>;

/// The cached answer for `key`, or `ask`'s (then cached; an error is not).
fn answer<K: Copy + Eq + std::hash::Hash>(
    cache: &'static Answers<K>,
    key: K,
    ask: impl FnOnce() -> Result<bool>,
) -> Result<bool> {
    let cache = cache.get_or_init(Default::default);
    if let Some(&known) = cache.lock().unwrap_or_else(|e| e.into_inner()).get(&key) {
        return Ok(known);
    }
    let known = ask()?;
    cache
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .insert(key, known);
    Ok(known)
}

/// Whether `dev`'s DRAM is slow enough for its SMs that [`Nvfp4Launch::Auto`] takes two
/// steps, as 2-D blocks do from 2^24 values (at most [`SLOW_DRAM_BYTES_PER_SM_CLOCK`],
/// from the driver's attributes; false where it reports a zero).
fn slow_dram(dev: &CudaDevice) -> Result<bool> {
    static SLOW: Answers<usize> = OnceLock::new();
    answer(&SLOW, dev.ordinal(), || {
        let attr = |a| dev.context().attribute(a).cuda_op("cuDeviceGetAttribute");
        let bytes = dram_bytes_per_sm_clock(
            attr(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE)?,
            attr(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH)?,
            attr(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_CLOCK_RATE)?,
            dev.multiprocessors(),
        );
        Ok(bytes.is_some_and(|b| b <= SLOW_DRAM_BYTES_PER_SM_CLOCK))
    })
}

/// Whether a GPC of `dev` holds a cluster of 16 CTAs of `tessera_nvfp4_both_c8x2_{sfx}`
/// (which is then allowed clusters past the portable 8).
fn clusters_fit(dev: &CudaDevice, sfx: &'static str) -> Result<bool> {
    const OP: &str = "cuda nvfp4 cluster launch";
    static FIT: Answers<(usize, &'static str)> = OnceLock::new();
    answer(&FIT, (dev.ordinal(), sfx), || {
        let f = dev.function(&NVFP4_PTX, &format!("tessera_nvfp4_both_c8x2_{sfx}"))?;
        f.set_attribute(
            CUfunction_attribute::CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED,
            1,
        )
        .cuda_op(OP)?;
        let one_cluster = LaunchConfig {
            grid_dim: (16, 1, 1),
            block_dim: (BLOCK, 1, 1),
            shared_mem_bytes: 0,
        };
        Ok(max_active_clusters(dev, &f, one_cluster, OP)? > 0)
    })
}

/// The launches of the 1-D round-to-nearest both kernel with compact scales
/// ([`Nvfp4Launch`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum BothLaunch {
    /// `tessera_nvfp4_both_*`, in bands of 8 tile rows.
    Bands,
    /// `tessera_nvfp4_both_c8x2_*`, in clusters of 8x2 tiles.
    Clusters,
    /// `tessera_nvfp4_both_s2_*` into a scratch, then `tessera_nvfp4_scales_1d`.
    TwoStep,
}

/// How the [`Nvfp4Launch`] kernel for an `[m, k]` tensor of `sfx` values launches on
/// `dev` (the caller has checked the rest: 2-byte values, round to nearest without the
/// RHT, columnwise data, compact scales).
fn both_launch(dev: &CudaDevice, sfx: &'static str, m: usize, k: usize) -> Result<BothLaunch> {
    choose_both_launch(
        nvfp4_launch(),
        m,
        k,
        || slow_dram(dev),
        || clusters_fit(dev, sfx),
    )
}

/// [`both_launch`]'s rule, the device's answers asked only where the choice needs them.
fn choose_both_launch(
    setting: Nvfp4Launch,
    m: usize,
    k: usize,
    slow_dram: impl FnOnce() -> Result<bool>,
    clusters_fit: impl FnOnce() -> Result<bool>,
) -> Result<BothLaunch> {
    let pieces = (m * k.div_ceil(128)).max(k * m.div_ceil(128));
    let two_step = |yes: bool| match yes && pieces <= TWO_STEP_1D_MAX_PIECES {
        true => BothLaunch::TwoStep,
        false => BothLaunch::Bands,
    };
    Ok(match setting {
        Nvfp4Launch::Bands => BothLaunch::Bands,
        Nvfp4Launch::TwoStep => two_step(true),
        Nvfp4Launch::Clusters => match m > CLUSTER_MIN_ROWS && clusters_fit()? {
            true => BothLaunch::Clusters,
            false => BothLaunch::Bands,
        },
        Nvfp4Launch::Auto => two_step(m * k >= TWO_STEP_1D_MIN_VALUES && slow_dram()?),
    })
}

/// Whether the compact scale grids of an `[m, k]` tensor of 2-D blocks take two steps:
/// from [`TWO_STEP_2D_MIN_VALUES`] values, and from [`TWO_STEP_2D_SLOW_DRAM_MIN_VALUES`]
/// where the DRAM is slow (asked only between the two).
fn two_step_2d(m: usize, k: usize, slow_dram: impl FnOnce() -> Result<bool>) -> Result<bool> {
    let values = m * k;
    Ok(values >= TWO_STEP_2D_MIN_VALUES
        || (values >= TWO_STEP_2D_SLOW_DRAM_MIN_VALUES && slow_dram()?))
}

/// Quantizes `x` into `out` (NVFP4, its usage's buffers).
#[allow(clippy::too_many_arguments)]
pub(crate) fn quantize_into(
    x: &Tensor,
    two_d: bool,
    rht: bool,
    swizzled: bool,
    rng: Option<&mut Generator>,
    reduction: Option<&Arc<dyn AmaxReduction>>,
    out: &mut QuantizedTensor,
) -> Result<()> {
    const OP: &str = "cuda nvfp4 quantize";
    let (m, k) = check_input(OP, x)?;
    let dev = device_of(x)?;
    let usage = out.usage();
    // The RHT touches only the columnwise operand.
    let rht = rht && usage.columnwise();
    let sr = rng.is_some();
    let sfx = dtype_suffix(OP, x.dtype())?;
    // The kernel: 1-D round to nearest without the RHT has its own entry points (rowwise
    // only, or both orientations), and so have 1-D blocks of 2-byte inputs with the RHT
    // and/or stochastic rounding, and 2-D blocks of 2-byte inputs rounded to nearest
    // without the RHT (TE's recipe for weights; any usage); f32 inputs with any option
    // and 2-D blocks with either option take the general kernel.
    let row_only = !two_d && !rht && !sr && !usage.columnwise();
    // The 128x128 tile kernels, by their infix after `tessera_nvfp4_both_`.
    let two_byte = x.dtype().size_in_bytes() == 2;
    let tile_kernel = match (two_d, rht, sr) {
        (false, false, false) => Some(""),
        // 2-D rowwise alone: the same kernel built for more CTAs per SM.
        (true, false, false) if two_byte && !usage.columnwise() => Some("2d_row_"),
        (true, false, false) if two_byte => Some("2d_"),
        (false, true, true) if two_byte => Some("rht_sr_"),
        (false, true, false) if two_byte => Some("rht_"),
        (false, false, true) if two_byte => Some("sr_"),
        _ => None,
    };
    let tiles_2d = two_d && tile_kernel.is_some();
    // 2-D blocks' compact scale grids in two steps when the columnwise grid is written
    // and the tensor is large (two_step_2d; kernels/nvfp4.cu, BlockScratch and
    // tessera_nvfp4_scales_2d): the tile kernel stores its 64 block scales twice (row by
    // row, column by column) into 128 bytes of scratch a 128x128 tile, a second kernel
    // the grids' whole lines.
    let two_step =
        tiles_2d && usage.columnwise() && !swizzled && two_step_2d(m, k, || slow_dram(&dev))?;
    let blk = match two_step {
        true => {
            let bytes = m.div_ceil(128) * k.div_ceil(128) * 128;
            Some(Tensor::empty([bytes], DType::U8, x.device())?)
        }
        false => None,
    };
    // The 1-D round-to-nearest kernel of 2-byte inputs with compact scales launches as
    // Nvfp4Launch says; in two steps (kernels/nvfp4.cu, flush_scratch and
    // tessera_nvfp4_scales_1d) with 2 KiB of scratch a 128x128 tile, then a kernel a
    // thread per 32 bytes of a tile's scratch.
    let both = match tile_kernel == Some("") && two_byte && !swizzled && !row_only {
        true => both_launch(&dev, sfx, m, k)?,
        false => BothLaunch::Bands,
    };
    let scratch = match both == BothLaunch::TwoStep {
        true => {
            let bytes = m.div_ceil(128) * k.div_ceil(128) * 2048;
            Some(Tensor::empty([bytes], DType::U8, x.device())?)
        }
        false => None,
    };
    let col_tiles = k.div_ceil(256 * ROW_BLOCKS);
    let (name, cfg) = if row_only {
        let blocks = (m / 16) * col_tiles;
        if blocks > i32::MAX as usize {
            return Err(Error::shape(
                OP,
                format!(
                    "[{m}, {k}] needs {blocks} thread blocks of 16 x {} values; at most {} fit \
                     in one launch",
                    256 * ROW_BLOCKS,
                    i32::MAX
                ),
            ));
        }
        let cfg = LaunchConfig {
            grid_dim: (blocks as u32, 1, 1),
            block_dim: (BLOCK, 1, 1),
            shared_mem_bytes: 0,
        };
        (format!("tessera_nvfp4_row_{sfx}"), cfg)
    } else if scratch.is_some() {
        (
            format!("tessera_nvfp4_both_s2_{sfx}"),
            banded_grid(OP, m, k, 128)?,
        )
    } else if both == BothLaunch::Clusters {
        (
            format!("tessera_nvfp4_both_c8x2_{sfx}"),
            banded_grid_padded(OP, m, k, 128)?,
        )
    } else if let Some(infix) = tile_kernel {
        (
            format!("tessera_nvfp4_both_{infix}{sfx}"),
            banded_grid(OP, m, k, 128)?,
        )
    } else {
        (format!("tessera_nvfp4_{sfx}"), tile_grid(OP, m, k, 64, 64)?)
    };
    let f = dev.function(&NVFP4_PTX, &name)?;
    let (mut seed, mut off_row, mut off_col) = (0, 0, 0);
    if let Some(g) = rng {
        seed = g.seed();
        if usage.rowwise() {
            off_row = g.advance((m * k).div_ceil(4)).offset;
        }
        if usage.columnwise() {
            off_col = g.advance((m * k).div_ceil(4)).offset;
        }
    }
    // The outputs (their scale padding cleared) before the amax pass, so that the
    // kernel follows that pass directly and can overlap its tail.
    let o = Outputs::take(&dev, out, OP, [[m, k / 16], [k, m / 16]])?;
    let mut amaxes = match Amaxes::take(out, usage) {
        Ok(a) => a,
        Err(e) => {
            o.put_back(out);
            return Err(e);
        }
    };
    if let Err(e) = amaxes.compute(&dev, x, rht, reduction) {
        amaxes.put_back(out);
        o.put_back(out);
        return Err(e);
    }
    // A reduction reads the amax back and writes the reduced one: the kernel then
    // follows that copy, not the amax pass.
    let order = match reduction {
        None => Order::OverlapAmaxPass,
        Some(_) => Order::AfterPrevious,
    };
    // An empty input (m or k is 0): the row kernel's grid covers its tiles exactly and
    // there are none (a launch of no CTAs is an error); the amax pass above wrote the
    // amax, and every other buffer is empty.
    let empty = cfg.grid_dim.0 == 0;
    let (s_row_cols, s_col_cols) = (Outputs::dims(&o.s_row)[1], Outputs::dims(&o.s_col)[1]);
    let launched = o.launch_and_put_back(&dev, out, empty, |[q_row, s_row, q_col, s_col]| {
        let (amax_row, amax_col, amax_copy) = amaxes.addrs(&dev, rht)?;
        let args = Nvfp4Args {
            m: m as u64,
            k: k as u64,
            amax_row,
            amax_col,
            q_row,
            s_row,
            s_row_cols,
            q_col,
            s_col,
            s_col_cols,
            two_d: i32::from(two_d),
            rht: i32::from(rht),
            swizzled: i32::from(swizzled),
            sr: i32::from(sr),
            seed,
            off_row,
            off_col,
            amax_copy,
        };
        let blk_addr = blk.as_ref().map_or(Ok(0), |t| device_addr(&dev, t))?;
        let scratch_addr = scratch.as_ref().map_or(Ok(0), |t| device_addr(&dev, t))?;
        let xa = device_addr(&dev, x)?;
        let (mu, ku, tiles) = (m as u64, k as u64, col_tiles as u64);
        let mut params = Params::default();
        if row_only {
            params.arg(&xa).arg(&mu).arg(&ku).arg(&args.amax_row);
            params
                .arg(&args.q_row)
                .arg(&args.s_row)
                .arg(&args.s_row_cols);
            params.arg(&args.swizzled).arg(&tiles);
        } else {
            params.arg(&xa).arg(&args);
            if tiles_2d {
                params.arg(&blk_addr);
            } else if scratch.is_some() {
                params.arg(&scratch_addr);
            }
        }
        // SAFETY: x is [m, k] with m, k multiples of 16 (checked by the quantizer); the
        // pointers address live buffers of `out` (data [m, k/2] and [k, m/2] bytes, the
        // padded scale grids, the f32 [1] amaxes, and the amax copy target, distinct from
        // the amax it copies) and the spare amax, all of which outlive the launch on this
        // stream (the spare is freed in stream order after it); null pointers mark absent
        // usages. The row kernel takes (const T* x, u64 m, u64 k, const float* amax, u8* q,
        // u8* s, u64 s_cols, int swizzled, u64 col_tiles), its grid covering (m / 16) x
        // col_tiles tiles exactly; the others (const T* x, Nvfp4Args a), the 2-D one
        // also (u8* blk), the 2-D block scratch allocated above or null, the two-step one
        // also (u8* scratch), 2048 bytes a 128x128 tile allocated above, their tiles
        // (128x128 banded or 64x64) covering [m, k]. Every one reads nothing the amax pass
        // writes before pdl_wait(), and the amax pass ran last when there is no reduction.
        unsafe { launch_params(&dev, &f, cfg, OP, order, &mut params) }?;
        if blk.is_some() {
            let g = dev.function(&NVFP4_PTX, "tessera_nvfp4_scales_2d")?;
            // A thread per word of a block-grid row (4 blocks), storing all 16 copies of
            // it: on an H100 16 copies a thread were the best of 1-16 or within 2% of it
            // at every shape from 4096x4096 to 16384x8192 (0.0030 against 0.0038 ms for 2
            // at 4096x4096, 0.0066 against 0.0224 for 1 at 16384x8192).
            // The words (4 blocks) of the block grid and of its transpose, rows padded.
            let (bm, bk) = (m / 16, k / 16);
            let words = (bm * bk.div_ceil(4)).max(bk * bm.div_ceil(4));
            let copies = 16i32;
            let ctas = words.div_ceil(256);
            if ctas > i32::MAX as usize {
                return Err(Error::shape(
                    OP,
                    format!(
                        "[{m}, {k}] needs {ctas} scale-grid CTAs; the launch grid holds at \
                         most {}",
                        i32::MAX
                    ),
                ));
            }
            let cfg = LaunchConfig {
                grid_dim: (ctas as u32, 2, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            };
            let mut p = Params::default();
            p.arg(&blk_addr).arg(&args.m).arg(&args.k);
            p.arg(&args.s_row).arg(&args.s_row_cols);
            p.arg(&args.s_col).arg(&args.s_col_cols).arg(&copies);
            // SAFETY: (const u8* blk, u64 m, u64 k, u8* s_row, u64 s_row_cols, u8* s_col,
            // u64 s_col_cols, int copies): blk the block scratch the kernel before filled
            // (128 bytes for every tile, ceil(m / 128) x ceil(k / 128), as allocated
            // above), the compact scale grids as above (rows of s_*_cols bytes, multiples
            // of 4; s_row null without rowwise data), copies = 16 with one grid slice in z
            // (which stores every copy), a thread for each word of the larger block grid;
            // the kernel calls pdl_first() before any memory access.
            unsafe { launch_params(&dev, &g, cfg, OP, Order::WaitFirst, &mut p) }?;
        }
        if scratch.is_some() {
            let g = dev.function(&NVFP4_PTX, "tessera_nvfp4_scales_1d")?;
            // A thread per 32 bytes of a tile's scratch (4 grid rows of 8 bytes): m / 4
            // row quads of ceil(k / 128) tiles rowwise, k / 4 of ceil(m / 128)
            // columnwise (both_launch checked that 4 times the count fits the kernel's
            // 32-bit index).
            let quads = (m / 4 * k.div_ceil(128)).max(k / 4 * m.div_ceil(128));
            let cfg = LaunchConfig {
                grid_dim: (quads.div_ceil(256) as u32, 2, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            };
            let mut p = Params::default();
            p.arg(&scratch_addr).arg(&args.m).arg(&args.k);
            p.arg(&args.s_row).arg(&args.s_row_cols);
            p.arg(&args.s_col).arg(&args.s_col_cols);
            // SAFETY: (const u8* scratch, u64 m, u64 k, u8* s_row, u64 s_row_cols, u8*
            // s_col, u64 s_col_cols): scratch the 2048 bytes a tile the kernel before
            // filled for every tile (ceil(m / 128) x ceil(k / 128), as allocated above),
            // the compact scale grids as above (rows of s_*_cols bytes, multiples of 4, at
            // least k / 16 and m / 16; s_row null without rowwise data), m and k
            // multiples of 16 (checked by the quantizer), a thread for each quad of the
            // larger grid, whose count fits 32 bits (both_launch);
            // the kernel calls pdl_first() before any memory access.
            unsafe { launch_params(&dev, &g, cfg, OP, Order::WaitFirst, &mut p) }?;
        }
        Ok(())
    });
    // The 2-D block scratch and the 1-D scratch are freed in stream order, after the
    // kernels that use them.
    drop(blk);
    drop(scratch);
    amaxes.put_back(out);
    launched?;
    out.source_dtype = x.dtype();
    Ok(())
}

/// Dequantizes one orientation of an NVFP4 CUDA tensor into `dtype`.
pub(crate) fn dequantize(
    qt: &QuantizedTensor,
    rht: bool,
    swizzled: bool,
    columnwise: bool,
    y: &mut Tensor,
) -> Result<()> {
    let dtype = y.dtype();
    const OP: &str = "cuda nvfp4 dequantize";
    let (m, k) = qt.shape().flat_2d();
    let (q, s) = qt.data_and_scales(columnwise)?;
    let a = crate::nvfp4::amax_buffer(qt, columnwise)?;
    let dev = device_of(q)?;
    // Rowwise units of 16 bytes of output, two a thread (k % 16 == 0: whole units);
    // columnwise a CTA per tile of the transposed data, 64 or 128 q rows by shape, or
    // with the inverse RHT (its own entry point) always 64.
    let tile = columnwise.then(|| {
        if rht {
            ColsTile::Short
        } else {
            NVFP4_DEQ_TILES.pick(m, k, dev.multiprocessors() as usize)
        }
    });
    let f = dev.function(
        &NVFP4_PTX,
        &format!(
            "tessera_nvfp4_dequant_{}{}{}",
            tile.map_or("", |t| t.infix()),
            if rht && columnwise { "rht_" } else { "" },
            dtype_suffix(OP, dtype)?
        ),
    )?;
    let dims = [m as u64, k as u64, s.shape().dims()[1] as u64];
    let cfg = match tile {
        Some(tile) => NVFP4_DEQ_TILES.grid(m, k, tile)?,
        None => dequant_units_grid(m * k / dequant_vals(dtype))?,
    };
    let swizzled = i32::from(swizzled);
    let [qa, sa, ya] = dequant_addrs(&dev, q, s, y)?;
    let aa = device_addr(&dev, a)?;
    let mut p = Params::default();
    p.arg(&qa).arg(&sa).arg(&aa).arg(&ya);
    p.arg(&dims[0]).arg(&dims[1]).arg(&dims[2]).arg(&swizzled);
    // SAFETY: (const u8* q, const u8* s, const float* amax, T* y, u64 m, u64 k, u64
    // s_cols, int swizzled): q the packed data of the orientation, s its padded scale
    // grid, amax one float, y [m, k] of T; the kernel calls pdl_first() before any
    // memory access.
    unsafe { launch_params(&dev, &f, cfg, OP, Order::WaitFirst, &mut p) }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The H100 SXM's attributes as its driver reports them (a 2619 MHz memory clock, a
    /// 5120-bit bus, 1980 MHz SMs, 132 of them; seen 2026-12-07) give 12.8 bytes per SM
    /// clock; the H200's data sheet (4.8 TB/s, the same SMs) 18.4; a zero is unknown.
    #[test]
    fn dram_bytes_per_sm_clock_by_card() {
        let h100 = dram_bytes_per_sm_clock(2_619_000, 5120, 1_980_000, 132).unwrap();
        assert!((h100 - 12.826).abs() < 1e-3, "{h100}");
        assert!(h100 <= SLOW_DRAM_BYTES_PER_SM_CLOCK);
        // 4.8 TB/s over a 6144-bit bus: 3125 MHz.
        let h200 = dram_bytes_per_sm_clock(3_125_000, 6144, 1_980_000, 132).unwrap();
        assert!((h200 - 18.365).abs() < 1e-3, "{h200}");
        assert!(h200 > SLOW_DRAM_BYTES_PER_SM_CLOCK);
        assert_eq!(dram_bytes_per_sm_clock(0, 5120, 1_980_000, 132), None);
        assert_eq!(dram_bytes_per_sm_clock(2_619_000, 5120, 1_980_000, 0), None);
    }

    /// The launch rule: `Auto` takes two steps from 2^26 values where the DRAM is slow
    /// and asks the device nothing below that; `Clusters` needs more than 512 rows and a
    /// GPC that holds the cluster; `TwoStep` falls back to bands past the scales kernel's
    /// 32-bit index; a driver error is passed on.
    #[test]
    fn both_launch_by_setting_shape_and_device() {
        use BothLaunch::{Bands, Clusters, TwoStep};
        use Nvfp4Launch as L;
        let yes = || Ok(true);
        let no = || Ok(false);
        let unasked = || -> Result<bool> { panic!("the device was asked") };
        let choose = |s, m, k, slow: &dyn Fn() -> Result<bool>, fit: &dyn Fn() -> Result<bool>| {
            choose_both_launch(s, m, k, slow, fit).unwrap()
        };
        // Auto: 2^26 values is the first size that takes two steps, on slow DRAM only.
        assert_eq!(choose(L::Auto, 8192, 8192, &yes, &unasked), TwoStep);
        assert_eq!(choose(L::Auto, 16384, 8192, &no, &unasked), Bands);
        assert_eq!(choose(L::Auto, 8192, 8192 - 16, &unasked, &unasked), Bands);
        assert_eq!(choose(L::Auto, 16, 1 << 22, &yes, &unasked), TwoStep);
        // Forced launches.
        assert_eq!(choose(L::Bands, 16384, 8192, &unasked, &unasked), Bands);
        assert_eq!(choose(L::TwoStep, 16, 16, &unasked, &unasked), TwoStep);
        assert_eq!(choose(L::Clusters, 528, 4096, &unasked, &yes), Clusters);
        assert_eq!(choose(L::Clusters, 528, 4096, &unasked, &no), Bands);
        assert_eq!(choose(L::Clusters, 512, 1 << 20, &unasked, &unasked), Bands);
        // Past 2^32 - 256 pieces of 8 bytes (m rows of ceil(k / 128) tiles): bands.
        let (m, k) = (1 << 24, (1 << 15) - 128);
        assert_eq!(choose(L::TwoStep, m, k, &unasked, &unasked), TwoStep);
        assert_eq!(choose(L::TwoStep, m, k + 128, &unasked, &unasked), Bands);
        assert_eq!(choose(L::TwoStep, k + 128, m, &unasked, &unasked), Bands);
        assert_eq!(choose(L::Auto, m, k + 128, &yes, &unasked), Bands);
        // A driver error reaches the caller.
        let err = || Err(Error::shape("test", "driver says no"));
        assert!(choose_both_launch(L::Auto, 8192, 8192, err, no).is_err());
    }

    /// The 2-D rule: two steps from 2^25 values anywhere, from 2^24 on slow DRAM, the
    /// device asked only between; a driver error is passed on.
    #[test]
    fn two_step_2d_by_shape_and_device() {
        let yes = || Ok(true);
        let no = || Ok(false);
        let unasked = || -> Result<bool> { panic!("the device was asked") };
        let two_step = |m, k, slow: &dyn Fn() -> Result<bool>| two_step_2d(m, k, slow).unwrap();
        assert!(two_step(8192, 4096, &unasked));
        assert!(two_step(16, 1 << 21, &unasked));
        assert!(two_step(4096, 4096, &yes));
        assert!(!two_step(4096, 4096, &no));
        assert!(two_step(4096 + 16, 4096 + 16, &yes));
        assert!(!two_step(4096, 4096 - 16, &unasked));
        assert!(!two_step(16, 16, &unasked));
        let err = || Err(Error::shape("test", "driver says no"));
        assert!(two_step_2d(4096, 4096, err).is_err());
        assert!(two_step_2d(8192, 4096, err).is_ok());
    }

    /// A whole sm_90 GPU holds clusters of 16 CTAs of the cluster-launched kernel (a MIG
    /// slice may not, and takes the banded launch), and the driver's clocks put the
    /// H100 SXM under the bound of [`Nvfp4Launch::Auto`] and the H200 over it.
    #[test]
    #[ignore = "needs a CUDA GPU: cargo xtask test-gpu"]
    fn a_whole_gpu_holds_the_clusters_of_16() {
        super::super::require_gpu();
        let dev = tessera_core::cuda::device(0).unwrap();
        let name = dev.name().to_string();
        let whole = !name.contains("MIG");
        let slow = slow_dram(&dev).unwrap();
        if name.contains("H100") && name.contains("HBM3") {
            assert!(slow, "{name}");
        } else if name.contains("H200") {
            assert!(!slow, "{name}");
        }
        for sfx in ["bf16", "f16"] {
            assert_eq!(clusters_fit(&dev, sfx).unwrap(), whole, "{name} {sfx}");
            // Asked again: the cached answers.
            assert_eq!(clusters_fit(&dev, sfx).unwrap(), whole, "{name} {sfx}");
        }
        assert_eq!(slow_dram(&dev).unwrap(), slow, "{name}");
    }
}
