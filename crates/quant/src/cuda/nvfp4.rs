//! NVFP4 on the device.

use std::sync::Arc;

use cudarc::driver::{DeviceRepr, LaunchConfig};
use tessera_core::cuda::{CudaDevice, CudaResultExt, grid_1d};
use tessera_core::{DType, Error, Result, Tensor};
use tessera_rng::Generator;

use super::{
    BLOCK, ColsTile, NVFP4_DEQ_TILES, NVFP4_PTX, Order, Outputs, Params, amax_target, banded_grid,
    clear_amaxes, dequant_addrs, dequant_units_grid, dequant_vals, device_addr, device_of,
    dtype_suffix, launch_params, tile_grid,
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

/// The fewest values of a 2-D NVFP4 tensor whose compact scale grids take two steps
/// (block grid, then `tessera_nvfp4_scales_2d`). In one step the tile kernel stores 8
/// bytes of 128 rows of each grid, partial lines, which cost the kernel a fifth of its
/// time on an H100 even while its outputs fit in L2 (8192x4096, 38 MB: 0.0578 ms against
/// 0.0452 without the scale bytes) and a quarter beyond it (16384x8192 on an H200: 0.048
/// of 0.174 ms). The second kernel writes whole lines (0.0069 ms at 16384x8192, 0.87 of a
/// copy, on an H100); two steps won 12-15% on an H100 at 2^25 values (8192x4096 0.0509
/// against 0.0579 ms, 4096x8192 0.0487 against 0.0568), 17-19% above, and lost 0.8-1%
/// at 4096x4096 (2^24), where the second launch costs about what the flush does. The
/// H200 agrees: two steps 12-20% faster from 2^25 values up (8192x4096 0.0376 against
/// 0.0426 ms, 4096x8192 0.0364 against 0.0421, 16384x8192 0.1380 against 0.1734), 8%
/// slower at 4096x4096 (0.0214 against 0.0198) (BENCHMARKS, sessions 36, 37 and 40).
const TWO_STEP_2D_MIN_VALUES: usize = 1 << 25;

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
        (true, false, false) if two_byte => Some("2d_"),
        (false, true, true) if two_byte => Some("rht_sr_"),
        (false, true, false) if two_byte => Some("rht_"),
        (false, false, true) if two_byte => Some("sr_"),
        _ => None,
    };
    let tiles_2d = tile_kernel == Some("2d_");
    // 2-D blocks' compact scale grids in two steps when the columnwise grid is written
    // and the tensor is large (TWO_STEP_2D_MIN_VALUES; kernels/nvfp4.cu, BlockGrids and
    // tessera_nvfp4_scales_2d): the tile kernel stores one byte a block into the block
    // grid and its transpose (rows padded to 4 bytes), a second kernel the grids' whole
    // lines.
    let two_step = m * k >= TWO_STEP_2D_MIN_VALUES;
    // The bytes of the block grid and of its transpose (kernels/nvfp4.cu, BlockGrids).
    let (bm, bk) = (m / 16, k / 16);
    let grid_bytes = [bm * bk.next_multiple_of(4), bk * bm.next_multiple_of(4)];
    let blk = match tiles_2d && usage.columnwise() && !swizzled && two_step {
        true => {
            let bytes = grid_bytes[0] + grid_bytes[1];
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
            }
        }
        // SAFETY: x is [m, k] with m, k multiples of 16 (checked by the quantizer); the
        // pointers address live buffers of `out` (data [m, k/2] and [k, m/2] bytes, the
        // padded scale grids, the f32 [1] amaxes, and the amax copy target, distinct from
        // the amax it copies) and the spare amax, all of which outlive the launch on this
        // stream (the spare is freed in stream order after it); null pointers mark absent
        // usages. The row kernel takes (const T* x, u64 m, u64 k, const float* amax, u8* q,
        // u8* s, u64 s_cols, int swizzled, u64 col_tiles), its grid covering (m / 16) x
        // col_tiles tiles exactly; the others (const T* x, Nvfp4Args a), and the 2-D one
        // also (u8* blk), the block grids allocated above or null, their tiles (128x128
        // banded or 64x64) covering [m, k]. Every one reads nothing the amax pass
        // writes before pdl_wait(), and the amax pass ran last when there is no reduction.
        unsafe { launch_params(&dev, &f, cfg, OP, order, &mut params) }?;
        if blk.is_some() {
            let g = dev.function(&NVFP4_PTX, "tessera_nvfp4_scales_2d")?;
            // A thread per word of a block-grid row (4 blocks), storing all 16 copies of
            // it: on an H100 16 copies a thread were the best of 1-16 or within 2% of it
            // at every shape from 4096x4096 to 16384x8192 (0.0030 against 0.0038 ms for 2
            // at 4096x4096, 0.0066 against 0.0224 for 1 at 16384x8192).
            let words = grid_bytes[0].max(grid_bytes[1]) / 4;
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
            // u64 s_col_cols, int copies): blk the block grids the kernel before filled
            // (bm x bk padded to 4, then bk x bm padded to 4, as allocated above), the
            // compact scale grids as above (rows of s_*_cols bytes, multiples of 4; s_row
            // null without rowwise data), copies = 16 with one grid slice in z (which
            // stores every copy), a thread for each word of the larger block grid; the
            // kernel calls pdl_first() before any memory access.
            unsafe { launch_params(&dev, &g, cfg, OP, Order::WaitFirst, &mut p) }?;
        }
        Ok(())
    });
    // The block grid is freed in stream order, after the kernels that use it.
    drop(blk);
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
