//! CPU throughput of the reference quantizers (criterion), on a bf16 4096×4096 input;
//! throughput counts the bytes of input (32 MiB per call). Two building blocks are
//! measured as well: the E4M3 element cast and the f32 transpose, on the same values as
//! f32 (64 MiB).
//!
//! ```text
//! cargo bench -p tessera-quant --bench cpu -- --warm-up-time 1 --measurement-time 3
//! ```

use criterion::{Criterion, SamplingMode, Throughput, criterion_group, criterion_main};
use tessera_core::{Device, Tensor, bf16};
use tessera_quant::{
    BlockDim, Fp8BlockQuantizer, Fp8CurrentScaling, Fp8Format, Mxfp8Quantizer, Nvfp4Quantizer,
    Quantizer, Usage,
};

const M: usize = 4096;
const K: usize = 4096;

/// Normal-ish values whose magnitude changes every 64 columns and 64 rows, so block
/// scales differ (deterministic, no RNG dependency).
fn input() -> Tensor {
    let mut s = 0x2545_F491_4F6C_DD1Du64;
    let v: Vec<bf16> = (0..M * K)
        .map(|i| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            // Sum of four uniforms: roughly normal, mean 0.
            let u: f32 = (0..4)
                .map(|j| ((s >> (16 * j)) & 0xFFFF) as f32 / 65536.0)
                .sum::<f32>()
                - 2.0;
            let (r, c) = (i / K, i % K);
            let e = ((r / 64 * 7 + c / 64 * 3) % 17) as i32 - 8;
            bf16::from_f32(u * 2f32.powi(e))
        })
        .collect();
    Tensor::from_slice(&v, [M, K], Device::Cpu).unwrap()
}

fn quantizers(c: &mut Criterion) {
    let x = input();
    let mut group = c.benchmark_group("quantize-bf16-4096x4096");
    group.throughput(Throughput::Bytes(x.size_in_bytes() as u64));
    // Each call takes a sizeable fraction of a second: few, equal samples.
    group.sample_size(10);
    group.sampling_mode(SamplingMode::Flat);
    let cases: Vec<(&str, Box<dyn Quantizer>)> = vec![
        (
            "fp8-current/rowwise",
            Box::new(Fp8CurrentScaling::new(Fp8Format::E4M3).with_usage(Usage::Rowwise)),
        ),
        (
            "fp8-current/both",
            Box::new(Fp8CurrentScaling::new(Fp8Format::E4M3).with_usage(Usage::Both)),
        ),
        (
            "mxfp8/rowwise",
            Box::new(Mxfp8Quantizer::new(Fp8Format::E4M3).with_usage(Usage::Rowwise)),
        ),
        (
            "mxfp8/both",
            Box::new(Mxfp8Quantizer::new(Fp8Format::E4M3).with_usage(Usage::Both)),
        ),
        (
            "nvfp4/rowwise",
            Box::new(Nvfp4Quantizer::new().with_usage(Usage::Rowwise)),
        ),
        (
            "nvfp4/both",
            Box::new(Nvfp4Quantizer::new().with_usage(Usage::Both)),
        ),
        (
            "fp8-block-1d/rowwise",
            Box::new(
                Fp8BlockQuantizer::new(Fp8Format::E4M3, BlockDim::OneD).with_usage(Usage::Rowwise),
            ),
        ),
        (
            "fp8-block-1d/both",
            Box::new(
                Fp8BlockQuantizer::new(Fp8Format::E4M3, BlockDim::OneD).with_usage(Usage::Both),
            ),
        ),
    ];
    for (name, mut q) in cases {
        group.bench_function(name, |b| b.iter(|| q.quantize(&x).unwrap()));
    }
    group.finish();
}

fn building_blocks(c: &mut Criterion) {
    let x = input();
    let v = x.to_f32_vec().unwrap();
    let mut group = c.benchmark_group("f32-4096x4096");
    group.throughput(Throughput::Bytes((v.len() * 4) as u64));
    group.sample_size(10);
    group.sampling_mode(SamplingMode::Flat);
    group.bench_function("cast-e4m3", |b| {
        b.iter(|| tessera_quant::fp8::cast(&v, 1.0, Fp8Format::E4M3))
    });
    group.bench_function("transpose", |b| {
        b.iter(|| tessera_quant::layout::transpose(&v, M, K))
    });
    group.finish();
}

criterion_group!(benches, quantizers, building_blocks);
criterion_main!(benches);
