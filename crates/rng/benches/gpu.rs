//! GPU benchmark of the random fills (not a test): `cargo xtask bench-gpu`.
//!
//! For outputs of `--mib` MiB (default 256) it times, with CUDA events (median of
//! `--iters` batches of 10 back-to-back runs, after warm-up), a plain device fill (`cuMemsetD8`) and a device copy
//! as ceilings, then each fill. GB/s counts the minimal traffic: bytes written, plus
//! bytes read for dropout (input read, output and mask written). Prints a table and
//! writes JSON with `--json PATH`.

use std::fmt::Write as _;

use cudarc::driver::DevicePtrMut;
use tessera_core::cuda::{CudaDevice, EventTimer, device};
use tessera_core::{DType, Device, Result, Tensor, bf16, f16};
use tessera_rng::Generator;

/// Options (`cargo bench` passes `--bench`, accepted and ignored).
#[derive(clap::Parser)]
struct Args {
    /// Output size in MiB.
    #[arg(long, default_value_t = 256)]
    mib: usize,
    /// Timed batches per measurement (the median is reported).
    #[arg(long, default_value_t = 30)]
    iters: usize,
    /// Where to write the results as JSON.
    #[arg(long)]
    json: Option<String>,
    #[arg(long, hide = true)]
    bench: bool,
}

/// Launches per timed sample: the queue stays full, so the host's launch cost (which
/// would otherwise sit between the start event and the first kernel) is hidden, as it
/// is in a training step.
const BATCH: usize = 10;

/// Median milliseconds per run of `f` over `iters` event-timed batches of [`BATCH`]
/// runs, after a warm-up batch.
fn time(dev: &CudaDevice, iters: usize, f: impl FnMut() -> Result<()>) -> Result<f64> {
    EventTimer::median_ms(dev, iters, BATCH, f)
}

struct Row {
    name: String,
    ms: f64,
    bytes: usize,
}

fn main() -> Result<()> {
    let a = <Args as clap::Parser>::parse();
    let dev = device(0)?;
    let bytes = a.mib << 20;
    let gpu = Device::Cuda(0);
    let mut rows = Vec::new();

    let mut buf = Tensor::empty([bytes], DType::U8, gpu)?;
    let stream = dev.stream().clone();
    let ms = time(&dev, a.iters, || {
        let slice = buf.cuda_slice_mut()?;
        let (ptr, _rec) = slice.device_ptr_mut(&stream);
        // SAFETY: `ptr` addresses `bytes` bytes of a live allocation on `stream`.
        unsafe { cudarc::driver::result::memset_d8_async(ptr, 0x5A, bytes, stream.cu_stream()) }
            .map_err(|e| tessera_core::Error::Cuda {
                op: "memset",
                msg: e.to_string(),
            })
    })?;
    rows.push(Row {
        name: "fill (cuMemsetD8)".into(),
        ms,
        bytes,
    });
    let src = Tensor::filled_with_byte([bytes], DType::U8, gpu, 1)?;
    let ms = time(&dev, a.iters, || {
        let dst = buf.cuda_slice_mut()?;
        stream
            .memcpy_dtod(src.cuda_slice()?, dst)
            .map_err(|e| tessera_core::Error::Cuda {
                op: "copy",
                msg: e.to_string(),
            })
    })?;
    rows.push(Row {
        name: "copy (read + write)".into(),
        ms,
        bytes: 2 * bytes,
    });
    drop(buf);

    let mut g = Generator::new(1);
    let n32 = bytes / 4;
    let mut w = Tensor::empty([n32], DType::U32, gpu)?;
    let ms = time(&dev, a.iters, || g.fill_u32_tensor(&mut w))?;
    rows.push(Row {
        name: "u32 words".into(),
        ms,
        bytes,
    });
    drop(w);
    let mut u = Tensor::empty([n32], DType::F32, gpu)?;
    let ms = time(&dev, a.iters, || g.fill_uniform_tensor(&mut u))?;
    rows.push(Row {
        name: "uniform f32".into(),
        ms,
        bytes,
    });
    let ms = time(&dev, a.iters, || g.fill_normal_tensor(&mut u, 0.0, 1.0))?;
    rows.push(Row {
        name: "normal f32".into(),
        ms,
        bytes,
    });
    drop(u);

    for dtype in [DType::BF16, DType::F16, DType::F32] {
        // Output of `bytes` bytes; input the same; mask one byte per element.
        let n = bytes / dtype.size_in_bytes();
        let mut z = vec![0f32; n];
        Generator::new(2).fill_normal(&mut z, 0.0, 1.0);
        let x = match dtype {
            DType::BF16 => Tensor::from_slice(
                &z.iter().map(|&v| bf16::from_f32(v)).collect::<Vec<_>>(),
                [n],
                gpu,
            )?,
            DType::F16 => Tensor::from_slice(
                &z.iter().map(|&v| f16::from_f32(v)).collect::<Vec<_>>(),
                [n],
                gpu,
            )?,
            _ => Tensor::from_slice(&z, [n], gpu)?,
        };
        drop(z);
        let mut y = Tensor::empty([n], dtype, gpu)?;
        let mut m = Tensor::empty([n], DType::U8, gpu)?;
        let ms = time(&dev, a.iters, || g.dropout_into(&x, 0.1, &mut y, &mut m))?;
        rows.push(Row {
            name: format!("dropout {dtype} p=0.1 (+mask)"),
            ms,
            bytes: 2 * bytes + n,
        });
    }

    let fill_gbs = rows[0].bytes as f64 / rows[0].ms / 1e6;
    let copy_gbs = rows[1].bytes as f64 / rows[1].ms / 1e6;
    println!(
        "{} (sm_{}{}), outputs of {} MiB, median of {} runs",
        dev.name(),
        dev.compute_capability().0,
        dev.compute_capability().1,
        a.mib,
        a.iters
    );
    println!(
        "{:34} {:>9} {:>10} {:>8} {:>8}",
        "kernel", "ms", "GB/s", "of fill", "of copy"
    );
    let mut json = String::from("{\n");
    writeln!(
        json,
        "  \"device\": \"{}\",\n  \"mib\": {},",
        dev.name(),
        a.mib
    )
    .unwrap();
    json.push_str("  \"rows\": [\n");
    for (i, r) in rows.iter().enumerate() {
        let gbs = r.bytes as f64 / r.ms / 1e6;
        println!(
            "{:34} {:9.4} {:10.1} {:8.3} {:8.3}",
            r.name,
            r.ms,
            gbs,
            gbs / fill_gbs,
            gbs / copy_gbs
        );
        let sep = if i + 1 < rows.len() { "," } else { "" };
        writeln!(
            json,
            "    {{\"kernel\": \"{}\", \"ms\": {:.5}, \"bytes\": {}, \"gbps\": {:.1}, \"of_fill\": {:.4}, \"of_copy\": {:.4}}}{sep}",
            r.name, r.ms, r.bytes, gbs, gbs / fill_gbs, gbs / copy_gbs
        )
        .unwrap();
    }
    json.push_str("  ]\n}\n");
    if let Some(path) = a.json {
        std::fs::write(&path, json)
            .map_err(|e| tessera_core::Error::invalid("bench", format!("writing {path}: {e}")))?;
    }
    Ok(())
}
