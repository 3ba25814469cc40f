//! ThreadGroup all-gather throughput against a plain memcpy of the same bytes (not a
//! test): `cargo bench -p tessera-collectives --bench thread`.
//!
//! Each of `world` thread ranks gathers a shard of `bytes` bytes (as u8) into a reused
//! output, so every rank receives `world · bytes`; the peer is one `copy_from_slice` of
//! `world · bytes` on one thread. With more ranks than cores the ranks share the cores,
//! so the best ratio is about cores / ranks. Also a quantized gather (MXFP8 of a bf16 shard) through
//! `gather_along_first_dim`, reported per input byte. Medians of 7 runs.

use std::sync::Arc;
use std::time::Instant;

use tessera_collectives::{MaybeQuantized, ProcessGroup, gather_along_first_dim, run_ranks};
use tessera_core::{DType, Device, Result, Tensor, bf16};
use tessera_quant::{Fp8Format, Mxfp8Quantizer};

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() -> Result<()> {
    let world = 4;
    println!(
        "ThreadGroup, {world} ranks (this machine: {} CPUs)",
        std::thread::available_parallelism().map_or(1, |n| n.get())
    );
    println!(
        "{:>10} {:>12} {:>12} {:>8} {:>16}",
        "shard", "gather ms", "memcpy ms", "ratio", "mxfp8 gather ms"
    );
    for shard in [1usize << 20, 4 << 20, 16 << 20, 64 << 20] {
        let src = vec![7u8; world * shard];
        let mut dst = vec![0u8; world * shard];
        let memcpy = median(
            (0..7)
                .map(|_| {
                    let t = Instant::now();
                    dst.copy_from_slice(&src);
                    std::hint::black_box(&dst);
                    t.elapsed().as_secs_f64() * 1e3
                })
                .collect(),
        );
        let times = run_ranks(world, |g| -> Result<(f64, f64)> {
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
            for _ in 0..3 {
                group.barrier()?;
                let t = Instant::now();
                let mut q = Mxfp8Quantizer::new(Fp8Format::E4M3);
                std::hint::black_box(
                    gather_along_first_dim(
                        &MaybeQuantized::Plain(y.clone()),
                        &group,
                        Some(&mut q),
                    )?
                    .into_result()?,
                );
                quant.push(t.elapsed().as_secs_f64() * 1e3);
            }
            Ok((median(plain), median(quant)))
        })?;
        let (g, q) = times[0].as_ref().map_err(Clone::clone)?;
        println!(
            "{:>9}K {:>12.3} {:>12.3} {:>8.2} {:>16.3}",
            shard >> 10,
            g,
            memcpy,
            memcpy / g,
            q
        );
    }
    Ok(())
}
