//! ThreadGroup all-gather throughput against a plain memcpy of the same bytes (not a
//! test): `cargo bench -p tessera-collectives --bench thread`.
//!
//! Each of `world` thread ranks gathers a shard of `bytes` bytes (as u8) into a reused
//! output, so every rank receives `world · bytes`; the peer is one `copy_from_slice` of
//! `world · bytes` on one thread. With more ranks than cores the ranks share the cores,
//! so the best ratio is about cores / ranks. Also a quantized gather (MXFP8 of a bf16 shard,
//! both usages) through `gather_along_first_dim` — quantization, pack, gather and unpack —
//! against a memcpy of its gathered output's bytes, and the gather of the same tensor
//! already quantized (pack, gather, unpack: the wire layout's cost without the
//! quantizer's). Medians of 7 runs (3 for the quantizing gather), with the fastest and
//! slowest run.

use std::sync::Arc;
use std::time::Instant;

use tessera_collectives::{MaybeQuantized, ProcessGroup, gather_along_first_dim, run_ranks};
use tessera_core::{DType, Device, Result, Tensor, bf16};
use tessera_quant::{Fp8Format, Mxfp8Quantizer, Quantizer};

/// One rank's samples: plain gather ms, MXFP8 gather ms, the MXFP8 output bytes, and
/// pre-quantized gather ms.
type Samples = (Vec<f64>, Vec<f64>, usize, Vec<f64>);

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn min_max(v: &[f64]) -> (f64, f64) {
    v.iter()
        .fold((f64::INFINITY, 0f64), |(lo, hi), &x| (lo.min(x), hi.max(x)))
}

/// Milliseconds of a `copy_from_slice` of `bytes` bytes, 7 runs.
fn memcpy_ms(bytes: usize) -> Vec<f64> {
    let src = vec![7u8; bytes];
    let mut dst = vec![0u8; bytes];
    (0..7)
        .map(|_| {
            let t = Instant::now();
            dst.copy_from_slice(&src);
            std::hint::black_box(&dst);
            t.elapsed().as_secs_f64() * 1e3
        })
        .collect()
}

fn main() -> Result<()> {
    let world = 4;
    println!(
        "ThreadGroup, {world} ranks (this machine: {} CPUs)",
        std::thread::available_parallelism().map_or(1, |n| n.get())
    );
    println!(
        "{:>8} {:>22} {:>22} {:>6} {:>24} {:>10} {:>6} {:>24} {:>6}",
        "shard",
        "gather ms (min-max)",
        "memcpy ms (min-max)",
        "ratio",
        "mxfp8 gather ms (min-max)",
        "out MiB",
        "ratio",
        "pre-quantized ms (min-max)",
        "ratio"
    );
    for shard in [1usize << 20, 4 << 20, 16 << 20, 64 << 20] {
        let memcpy = memcpy_ms(world * shard);
        let times = run_ranks(world, |g| -> Result<Samples> {
            let group: Arc<dyn ProcessGroup> = Arc::new(g);
            let x = Tensor::filled_with_byte([shard], DType::U8, Device::Cpu, group.rank() as u8)?;
            // The output is allocated once and reused, like the memcpy's destination.
            let mut out = Tensor::zeros([world * shard], DType::U8, Device::Cpu)?;
            let mut plain = Vec::new();
            for _ in 0..7 {
                group.barrier()?;
                let t = Instant::now();
                out = group.all_gather_into(&x, out)?.into_result()?;
                plain.push(t.elapsed().as_secs_f64() * 1e3);
            }
            std::hint::black_box(&out);
            let rows = shard / 2 / 1024;
            let y = Tensor::from_slice(
                &vec![bf16::from_f32(0.5); rows * 1024],
                [rows, 1024],
                Device::Cpu,
            )?;
            let mut quant = Vec::new();
            let mut out_bytes = 0;
            for _ in 0..3 {
                group.barrier()?;
                let t = Instant::now();
                let mut q = Mxfp8Quantizer::new(Fp8Format::E4M3);
                let out = gather_along_first_dim(
                    &MaybeQuantized::Plain(y.clone()),
                    &group,
                    Some(&mut q),
                )?
                .into_result()?;
                quant.push(t.elapsed().as_secs_f64() * 1e3);
                out_bytes = out.quantized().map_or(0, |q| q.size_in_bytes());
                std::hint::black_box(out);
            }
            let qy = MaybeQuantized::Quantized(Mxfp8Quantizer::new(Fp8Format::E4M3).quantize(&y)?);
            let mut wire = Vec::new();
            for _ in 0..7 {
                group.barrier()?;
                let t = Instant::now();
                std::hint::black_box(gather_along_first_dim(&qy, &group, None)?.into_result()?);
                wire.push(t.elapsed().as_secs_f64() * 1e3);
            }
            Ok((plain, quant, out_bytes, wire))
        })?;
        let (g, q, out_bytes, wire) = times[0].as_ref().map_err(Clone::clone)?;
        let q_memcpy = median(memcpy_ms(*out_bytes));
        let range = |v: &[f64]| {
            let (lo, hi) = min_max(v);
            format!("{:.3} ({:.3}-{:.3})", median(v.to_vec()), lo, hi)
        };
        println!(
            "{:>7}K {:>22} {:>22} {:>6.2} {:>24} {:>10.1} {:>6.3} {:>24} {:>6.2}",
            shard >> 10,
            range(g),
            range(&memcpy),
            median(memcpy.clone()) / median(g.clone()),
            range(q),
            *out_bytes as f64 / (1 << 20) as f64,
            q_memcpy / median(q.clone()),
            range(wire),
            q_memcpy / median(wire.clone())
        );
    }
    Ok(())
}
