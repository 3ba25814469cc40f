//! NVFP4 on the device.

use std::sync::Arc;

use cudarc::driver::{DeviceRepr, LaunchConfig, PushKernelArg};
use tessera_core::cuda::{CudaDevice, grid_1d};
use tessera_core::{DType, Error, Result, Tensor};
use tessera_rng::Generator;

use super::{
    BLOCK, NVFP4_DEQ_TILE_M, NVFP4_PTX, Order, Outputs, Params, banded_grid, dequant_cols_grid,
    dequant_units_grid, dequant_vals, device_addr, device_of, dtype_suffix, launch, launch_params,
    tile_grid,
};
use crate::values::check_input;
use crate::{AmaxReduction, BufferName, QuantizedTensor};

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
}

// SAFETY: a #[repr(C)] struct of integers laid out exactly as the kernel's `Nvfp4Args`
// (all fields naturally aligned, no padding), passed by value.
unsafe impl DeviceRepr for Nvfp4Args {}

/// `a` all-reduced through `reduction` when given (which reads it back).
fn reduced(a: Tensor, reduction: Option<&Arc<dyn AmaxReduction>>) -> Result<Tensor> {
    match reduction {
        Some(r) => {
            let v = r.all_reduce_max(a.to_vec::<f32>()?[0])?;
            Tensor::from_slice(&[v], [1], a.device())
        }
        None => Ok(a),
    }
}

/// The global amaxes of an RHT quantization on the device, from one read of `x`:
/// `max |x|` (rowwise) and `max |RHT(xᵀ)|` (columnwise).
fn rht_amaxes(dev: &CudaDevice, x: &Tensor) -> Result<(Tensor, Tensor)> {
    const OP: &str = "cuda nvfp4 amax";
    let (m, k) = x.shape().flat_2d();
    let mut row = Tensor::zeros([1], DType::F32, x.device())?;
    let mut col = Tensor::zeros([1], DType::F32, x.device())?;
    let f = dev.function(
        &NVFP4_PTX,
        &format!("tessera_nvfp4_rht_amax_{}", dtype_suffix(OP, x.dtype())?),
    )?;
    let (mu, ku) = (m as u64, k as u64);
    // A thread per run of 16 rows of RHT_AMAX_COLS columns (8 for 2-byte types).
    let cols = if x.dtype().size_in_bytes() == 2 { 8 } else { 1 };
    let cfg = grid_1d(dev, (m / 16) * (k / cols), BLOCK)?;
    let (r, c) = (row.cuda_slice_mut()?, col.cuda_slice_mut()?);
    // SAFETY: (const T* x, u64 m, u64 k, float* row, float* col): x is [m, k] with m and
    // k multiples of 16 (checked by the quantizer), so 8-column groups of 2-byte T are
    // 16-byte aligned rows of a 256-byte-aligned allocation; row and col are distinct
    // zeroed f32 scalars.
    unsafe {
        launch(dev, &f, cfg, OP, |b| {
            b.arg(x.cuda_slice().expect("device tensor"))
                .arg(&mu)
                .arg(&ku)
                .arg(r)
                .arg(c);
        })
    }?;
    Ok((row, col))
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
    // and/or stochastic rounding; 2-D tiles and f32 inputs with either option take the
    // general kernel.
    let plain = !two_d && !rht && !sr;
    let row_only = plain && !usage.columnwise();
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
    } else if plain {
        (
            format!("tessera_nvfp4_both_{sfx}"),
            banded_grid(OP, m, k, 128)?,
        )
    } else if !two_d && x.dtype().size_in_bytes() == 2 {
        let recipe = match (rht, sr) {
            (true, true) => "rht_sr",
            (true, false) => "rht",
            _ => "sr",
        };
        (
            format!("tessera_nvfp4_both_{recipe}_{sfx}"),
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
    let amaxes = if rht {
        rht_amaxes(&dev, x).and_then(|(r, c)| Ok((reduced(r, reduction)?, reduced(c, reduction)?)))
    } else {
        super::fp8::amax(x)
            .and_then(|a| reduced(a, reduction))
            .map(|a| (a.clone(), a))
    };
    let (a_row, a_col) = match amaxes {
        Ok(a) => a,
        Err(e) => {
            o.put_back(out);
            return Err(e);
        }
    };
    // A reduction reads the amax back and writes the reduced one: the kernel then
    // follows that copy, not the amax pass.
    let order = match reduction {
        None => Order::OverlapAmaxPass,
        Some(_) => Order::AfterPrevious,
    };
    let (q_row, s_row, q_col, s_col) = (&o.q_row, &o.s_row, &o.q_col, &o.s_col);
    let p = |t: &Option<Tensor>| t.as_ref().map_or(Ok(0), |t| device_addr(&dev, t));
    let cols = |t: &Option<Tensor>| t.as_ref().map_or(0, |t| t.shape().dims()[1] as u64);
    let args = Nvfp4Args {
        m: m as u64,
        k: k as u64,
        amax_row: device_addr(&dev, &a_row)?,
        amax_col: device_addr(&dev, &a_col)?,
        q_row: p(q_row)?,
        s_row: p(s_row)?,
        s_row_cols: cols(s_row),
        q_col: p(q_col)?,
        s_col: p(s_col)?,
        s_col_cols: cols(s_col),
        two_d: i32::from(two_d),
        rht: i32::from(rht),
        swizzled: i32::from(swizzled),
        sr: i32::from(sr),
        seed,
        off_row,
        off_col,
    };
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
    }
    // SAFETY: x is [m, k] with m, k multiples of 16 (checked by the quantizer); the
    // pointers address live buffers of `out` (data [m, k/2] and [k, m/2] bytes, the
    // padded scale grids) and the amax scalars, all of which outlive the launch on this
    // stream; null pointers mark absent usages. The row kernel takes (const T* x, u64 m,
    // u64 k, const float* amax, u8* q, u8* s, u64 s_cols, int swizzled, u64 col_tiles),
    // its grid covering (m / 16) x col_tiles tiles exactly; the others (const T* x,
    // Nvfp4Args a), their tiles (128x128 banded or 64x64) covering [m, k]. Every one
    // loads only its input before pdl_wait(), and the amax pass ran last when there is
    // no reduction.
    unsafe { launch_params(&dev, &f, cfg, OP, order, &mut params) }?;
    let put_amax = |out: &mut QuantizedTensor, name, a: &Tensor| -> Result<()> {
        if out.buffer(name).is_some() {
            out.take_buffer(name)?;
            out.put_buffer(name, a.clone());
        }
        Ok(())
    };
    put_amax(out, BufferName::Amax, &a_row)?;
    put_amax(out, BufferName::ColumnwiseAmax, &a_col)?;
    o.put_back(out);
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
    let (dn, sn, an) = if columnwise {
        (
            BufferName::ColumnwiseData,
            BufferName::ColumnwiseScaleInv,
            BufferName::ColumnwiseAmax,
        )
    } else {
        (BufferName::Data, BufferName::ScaleInv, BufferName::Amax)
    };
    let get = |n| qt.buffer(n).ok_or_else(|| crate::fp8::missing(n));
    let (q, s, a) = (get(dn)?, get(sn)?, get(an)?);
    let dev = device_of(q)?;
    let f = dev.function(
        &NVFP4_PTX,
        &format!(
            "tessera_nvfp4_dequant_{}{}",
            if columnwise { "t_" } else { "" },
            dtype_suffix(OP, dtype)?
        ),
    )?;
    let dims = [m as u64, k as u64, s.shape().dims()[1] as u64];
    // Rowwise units of 16 bytes of output, two a thread (k % 16 == 0: whole units);
    // columnwise a CTA per tile of the transposed data; only that kernel takes `rht`.
    let (cfg, flags) = if columnwise {
        (
            dequant_cols_grid(m, k, NVFP4_DEQ_TILE_M)?,
            vec![i32::from(rht), i32::from(swizzled)],
        )
    } else {
        (
            dequant_units_grid(m * k / dequant_vals(dtype))?,
            vec![i32::from(swizzled)],
        )
    };
    let ys = y.cuda_slice_mut()?;
    // SAFETY: (const u8* q, const u8* s, const float* amax, T* y, u64 m, u64 k, u64
    // s_cols, [int rht,] int swizzled), rht for the columnwise kernel only: q the packed
    // data of the orientation, s its padded scale grid, amax one float, y [m, k] of T.
    unsafe {
        launch(&dev, &f, cfg, OP, |b| {
            b.arg(q.cuda_slice().expect("device tensor"))
                .arg(s.cuda_slice().expect("device tensor"))
                .arg(a.cuda_slice().expect("device tensor"))
                .arg(ys);
            for d in &dims {
                b.arg(d);
            }
            for fl in &flags {
                b.arg(fl);
            }
        })
    }?;
    Ok(())
}
