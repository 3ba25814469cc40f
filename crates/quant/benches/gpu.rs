//! GPU benchmark of the quantization kernels (not a test): `cargo xtask bench-gpu`.
//!
//! For bf16 inputs of 16384x8192 and 4096x4096 (or the `--shape`s given) it times, with
//! CUDA events (median of `--iters` batches of 10 back-to-back launches), a device copy
//! as the ceiling and each quantizer through `Quantizer::quantize_into` (outputs
//! allocated once). GB/s counts the minimal traffic: the input read once plus every
//! output byte written once; for current scaling the two-pass floor (input read twice)
//! is reported too.

use std::fmt::Write as _;

use tessera_core::cuda::{CudaDevice, EventTimer, device};
use tessera_core::{DType, Device, Result, Shape, Tensor, bf16};
use tessera_quant::cuda::{Nvfp4Launch, set_nvfp4_launch};
use tessera_quant::{
    BlockDim, BufferName, Fp8BlockQuantizer, Fp8CurrentScaling, Fp8DelayedScaling, Fp8Format,
    Mxfp8Quantizer, Nvfp4Quantizer, QuantizedTensor, Quantizer, Usage,
};
use tessera_rng::Generator;

const BATCH: usize = 10;

fn time(dev: &CudaDevice, iters: usize, f: impl FnMut() -> Result<()>) -> Result<f64> {
    EventTimer::median_ms(dev, iters, BATCH, f)
}

struct Row {
    shape: String,
    name: String,
    ms: f64,
    bytes: usize,
    floor_bytes: usize,
}

/// The rows measured so far and how to measure.
struct Bench<'a> {
    dev: &'a CudaDevice,
    iters: usize,
    rows: Vec<Row>,
}

impl Bench<'_> {
    /// Times `q.quantize_into(x)` into outputs allocated once; `two_pass` marks formats
    /// that must read the input twice (amax first), whose floor counts two reads.
    fn quantizer(
        &mut self,
        x: &Tensor,
        name: &str,
        q: &mut dyn Quantizer,
        two_pass: bool,
    ) -> Result<()> {
        let mut out: QuantizedTensor = q.make_empty(x.shape(), x.dtype(), x.device())?;
        let out_bytes = out.size_in_bytes();
        let ms = time(self.dev, self.iters, || q.quantize_into(x, &mut out))?;
        let bytes = x.size_in_bytes() + out_bytes;
        let floor_bytes = if two_pass {
            bytes + x.size_in_bytes()
        } else {
            bytes
        };
        self.push(x, name, ms, bytes, floor_bytes);
        Ok(())
    }

    /// Records a row for input `x`.
    fn push(&mut self, x: &Tensor, name: &str, ms: f64, bytes: usize, floor_bytes: usize) {
        self.rows.push(Row {
            shape: x.shape().to_string(),
            name: name.into(),
            ms,
            bytes,
            floor_bytes,
        });
    }

    /// Times `q.quantize(x)`, which allocates its output on every call (the device
    /// allocator's cache makes that cheap; what is left is any work besides the kernels).
    fn allocating(&mut self, x: &Tensor, name: &str, q: &mut dyn Quantizer) -> Result<()> {
        let bytes = x.size_in_bytes()
            + q.make_empty(x.shape(), x.dtype(), x.device())?
                .size_in_bytes();
        let ms = time(self.dev, self.iters, || q.quantize(x).map(drop))?;
        self.push(x, name, ms, bytes, bytes);
        Ok(())
    }

    /// Times training-step-like use of delayed scaling: casts into `out`, and `update`
    /// after every tenth.
    fn delayed_steps(
        &mut self,
        x: &Tensor,
        out: &mut QuantizedTensor,
        q: &mut Fp8DelayedScaling,
        name: &str,
        mut update: impl FnMut(&mut Fp8DelayedScaling) -> Result<()>,
    ) -> Result<()> {
        let bytes = x.size_in_bytes() + out.size_in_bytes();
        let mut n = 0usize;
        let ms = time(self.dev, self.iters, || {
            q.quantize_into(x, out)?;
            n += 1;
            if n.is_multiple_of(BATCH) {
                update(q)?;
            }
            Ok(())
        })?;
        self.push(x, name, ms, bytes, bytes);
        Ok(())
    }
}

/// Options (`cargo bench` passes `--bench`, accepted and ignored).
#[derive(clap::Parser)]
struct Args {
    /// Timed batches per measurement (the median is reported).
    #[arg(long, default_value_t = 20)]
    iters: usize,
    /// Where to write the results as JSON.
    #[arg(long)]
    json: Option<String>,
    /// Input shapes as ROWSxCOLS, in order (repeat the flag), both multiples of 32 (so
    /// that every format here takes them); 16384x8192 and 4096x4096 when none is given.
    /// Shapes whose scale grids have padding (rows not a multiple of 128, say) time the
    /// padding's clearing too.
    #[arg(long = "shape", value_parser = parse_shape)]
    shapes: Vec<(usize, usize)>,
    /// How the 1-D NVFP4 both kernel with compact scales launches
    /// (`tessera_quant::cuda::Nvfp4Launch`): auto, bands, clusters or two-step.
    #[arg(long, value_parser = parse_launch, default_value = "auto")]
    nvfp4_launch: Nvfp4Launch,
    #[arg(long, hide = true)]
    bench: bool,
}

/// An [`Nvfp4Launch`] by name.
fn parse_launch(s: &str) -> std::result::Result<Nvfp4Launch, String> {
    match s {
        "auto" => Ok(Nvfp4Launch::Auto),
        "clusters" => Ok(Nvfp4Launch::Clusters),
        "bands" => Ok(Nvfp4Launch::Bands),
        "two-step" => Ok(Nvfp4Launch::TwoStep),
        _ => Err(format!(
            "expected auto, bands, clusters or two-step, got {s:?}"
        )),
    }
}

/// `ROWSxCOLS` as two positive multiples of 32.
fn parse_shape(s: &str) -> std::result::Result<(usize, usize), String> {
    let parsed = s
        .split_once('x')
        .and_then(|(m, k)| Some((m.trim().parse().ok()?, k.trim().parse().ok()?)));
    match parsed {
        Some((m, k)) if m > 0 && k > 0 && m % 32 == 0 && k % 32 == 0 => Ok((m, k)),
        _ => Err(format!(
            "expected ROWSxCOLS with both positive multiples of 32, like 4000x4096, got {s:?}"
        )),
    }
}

fn main() -> Result<()> {
    let Args {
        iters,
        json: json_path,
        mut shapes,
        nvfp4_launch,
        ..
    } = clap::Parser::parse();
    set_nvfp4_launch(nvfp4_launch);
    if shapes.is_empty() {
        shapes = vec![(16384, 8192), (4096, 4096)];
    }
    let dev = device(0)?;
    let gpu = Device::Cuda(0);
    let mut b = Bench {
        dev: &dev,
        iters,
        rows: Vec::new(),
    };
    let mut copies = Vec::new();
    for (m, k) in shapes {
        let shape = Shape::new([m, k]);
        let mut z = vec![0f32; m * k];
        Generator::new(1).fill_normal(&mut z, 0.0, 1.0);
        let host: Vec<bf16> = z.iter().map(|&v| bf16::from_f32(v)).collect();
        drop(z);
        let x = Tensor::from_slice(&host, &shape, gpu)?;
        let mut y = Tensor::empty(&shape, DType::BF16, gpu)?;
        let stream = dev.stream().clone();
        let copy_ms = time(&dev, b.iters, || {
            let dst = y.cuda_slice_mut()?;
            stream
                .memcpy_dtod(x.cuda_slice()?, dst)
                .map_err(|e| tessera_core::Error::Cuda {
                    op: "copy",
                    msg: e.to_string(),
                })
        })?;
        copies.push((
            shape.to_string(),
            2.0 * x.size_in_bytes() as f64 / copy_ms / 1e6,
        ));
        b.rows.push(Row {
            shape: shape.to_string(),
            name: "device copy (read + write)".into(),
            ms: copy_ms,
            bytes: 2 * x.size_in_bytes(),
            floor_bytes: 2 * x.size_in_bytes(),
        });
        drop(y);
        let e4 = Fp8Format::E4M3;
        for usage in [Usage::Rowwise, Usage::Both] {
            let u = usage.name();
            b.quantizer(
                &x,
                &format!("fp8 delayed cast {u}"),
                &mut Fp8DelayedScaling::new(e4, 16)?.with_usage(usage),
                false,
            )?;
            // As a training step uses it: ten casts, then one look at the state (the
            // update); and `quantize` allocating its outputs each call.
            let mut q = Fp8DelayedScaling::new(e4, 16)?.with_usage(usage);
            let mut out = q.make_empty(x.shape(), x.dtype(), x.device())?;
            b.delayed_steps(
                &x,
                &mut out,
                &mut q,
                &format!("fp8 delayed {u}, update per 10"),
                |q| {
                    q.update(None);
                    Ok(())
                },
            )?;
            // The same with the state on the device: the update is a kernel, and
            // nothing waits for the device.
            let mut qd = Fp8DelayedScaling::new(e4, 16)?.with_usage(usage);
            qd.to_device(gpu)?;
            let name = format!("fp8 delayed {u}, device update per 10");
            b.delayed_steps(
                &x,
                &mut out,
                &mut qd,
                &name,
                Fp8DelayedScaling::update_on_device,
            )?;
            b.allocating(&x, &format!("fp8 delayed {u}, quantize()"), &mut q)?;
            b.quantizer(
                &x,
                &format!("fp8 current scaling {u}"),
                &mut Fp8CurrentScaling::new(e4).with_usage(usage),
                true,
            )?;
            b.quantizer(
                &x,
                &format!("mxfp8 {u}"),
                &mut Mxfp8Quantizer::new(e4).with_usage(usage),
                false,
            )?;
            // The block formats' `quantize` as one example of an allocating call.
            b.allocating(
                &x,
                &format!("mxfp8 {u}, quantize()"),
                &mut Mxfp8Quantizer::new(e4).with_usage(usage),
            )?;
            b.quantizer(
                &x,
                &format!("fp8 block 1x128 {u}"),
                &mut Fp8BlockQuantizer::new(e4, BlockDim::OneD).with_usage(usage),
                false,
            )?;
            b.quantizer(
                &x,
                &format!("fp8 block 128x128 {u}"),
                &mut Fp8BlockQuantizer::new(e4, BlockDim::TwoD).with_usage(usage),
                false,
            )?;
            b.quantizer(
                &x,
                &format!("nvfp4 {u}"),
                &mut Nvfp4Quantizer::new().with_usage(usage),
                true,
            )?;
            // TE's recipe for weights: 16x16 blocks.
            b.quantizer(
                &x,
                &format!("nvfp4 2d {u}"),
                &mut Nvfp4Quantizer::new().with_2d(true).with_usage(usage),
                true,
            )?;
        }
        // TE's NVFP4 recipes: inputs with the RHT (round to nearest), gradients with
        // the RHT and stochastic rounding.
        b.quantizer(
            &x,
            "nvfp4 both, rht",
            &mut Nvfp4Quantizer::new().with_rht(true),
            true,
        )?;
        b.quantizer(
            &x,
            "nvfp4 both, rht + sr",
            &mut Nvfp4Quantizer::new()
                .with_rht(true)
                .with_stochastic_rounding(Some(Generator::new(3))),
            true,
        )?;
        // Dequantization to bf16 of each orientation into an output allocated once
        // (`dequantize_into`: the kernel alone): the orientation's data and scales read,
        // bf16 written.
        let dequantized: [(&str, QuantizedTensor); 4] = [
            (
                "fp8 current scaling",
                Fp8CurrentScaling::new(e4)
                    .with_usage(Usage::Both)
                    .quantize(&x)?,
            ),
            (
                "mxfp8",
                Mxfp8Quantizer::new(e4)
                    .with_usage(Usage::Both)
                    .quantize(&x)?,
            ),
            (
                "fp8 block 1x128",
                Fp8BlockQuantizer::new(e4, BlockDim::OneD)
                    .with_usage(Usage::Both)
                    .quantize(&x)?,
            ),
            (
                "nvfp4",
                Nvfp4Quantizer::new().with_usage(Usage::Both).quantize(&x)?,
            ),
        ];
        for (name, qt) in &dequantized {
            for (usage, data, scales) in [
                (Usage::Rowwise, BufferName::Data, BufferName::ScaleInv),
                (
                    Usage::Columnwise,
                    BufferName::ColumnwiseData,
                    BufferName::ColumnwiseScaleInv,
                ),
            ] {
                let read: usize = [data, scales]
                    .iter()
                    .filter_map(|n| qt.buffer(*n).map(Tensor::size_in_bytes))
                    .sum();
                let bytes = read + x.size_in_bytes();
                let mut y = Tensor::empty(x.shape().clone(), DType::BF16, x.device())?;
                let ms = time(&dev, b.iters, || qt.dequantize_into(usage, &mut y))?;
                b.rows.push(Row {
                    shape: shape.to_string(),
                    name: format!("{name} dequantize {}", usage.name()),
                    ms,
                    bytes,
                    floor_bytes: bytes,
                });
            }
        }
    }
    println!(
        "{} (sm_{}{})",
        dev.name(),
        dev.compute_capability().0,
        dev.compute_capability().1
    );
    println!(
        "{:12} {:42} {:>9} {:>9} {:>8} {:>9}",
        "shape", "kernel", "ms", "GB/s", "of copy", "of floor"
    );
    let mut json = String::from("{\n  \"rows\": [\n");
    let rows = b.rows;
    for (i, r) in rows.iter().enumerate() {
        let copy = copies
            .iter()
            .find(|(s, _)| *s == r.shape)
            .map_or(f64::NAN, |c| c.1);
        let gbs = r.bytes as f64 / r.ms / 1e6;
        let floor = r.floor_bytes as f64 / r.ms / 1e6 / copy;
        println!(
            "{:12} {:42} {:9.4} {:9.1} {:8.3} {:9.3}",
            r.shape,
            r.name,
            r.ms,
            gbs,
            gbs / copy,
            floor
        );
        let sep = if i + 1 < rows.len() { "," } else { "" };
        writeln!(
            json,
            "    {{\"shape\": \"{}\", \"kernel\": \"{}\", \"ms\": {:.5}, \"bytes\": {}, \"gbps\": {:.1}, \"of_copy\": {:.4}, \"of_floor\": {:.4}}}{sep}",
            r.shape, r.name, r.ms, r.bytes, gbs, gbs / copy, floor
        )
        .unwrap();
    }
    json.push_str("  ]\n}\n");
    if let Some(p) = json_path {
        std::fs::write(&p, json)
            .map_err(|e| tessera_core::Error::invalid("bench", format!("writing {p}: {e}")))?;
    }
    Ok(())
}
