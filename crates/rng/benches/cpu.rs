//! CPU throughput of the reference fills (criterion): `cargo bench -p tessera-rng --bench cpu`.

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use half::bf16;
use tessera_rng::Par;
use tessera_rng::stream;

fn fills(c: &mut Criterion) {
    let mut group = c.benchmark_group("fill");
    for n in [1usize << 12, 1 << 20] {
        group.throughput(Throughput::Bytes((n * 4) as u64));
        let mut out = vec![0f32; n];
        for par in [Par::Seq, Par::Rayon] {
            group.bench_with_input(
                BenchmarkId::new(format!("uniform/{par:?}"), n),
                &n,
                |b, _| b.iter(|| stream::fill_uniform(7, 0, &mut out, par)),
            );
            group.bench_with_input(
                BenchmarkId::new(format!("normal/{par:?}"), n),
                &n,
                |b, _| b.iter(|| stream::fill_normal(7, 0, &mut out, 0.0, 1.0, par)),
            );
        }
        let input = vec![bf16::ONE; n];
        let mut y = vec![bf16::ZERO; n];
        let mut m = vec![0u8; n];
        group.throughput(Throughput::Bytes((n * 5) as u64));
        group.bench_with_input(BenchmarkId::new("dropout-bf16/Rayon", n), &n, |b, _| {
            b.iter(|| stream::dropout(7, 0, 0.1, &input, &mut y, &mut m, Par::Rayon))
        });
    }
    group.finish();
}

criterion_group!(benches, fills);
criterion_main!(benches);
