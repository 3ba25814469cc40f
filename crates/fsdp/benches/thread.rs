//! FSDP on ThreadGroup: step time and bytes moved per step for each weight-gather format
//! and gradient reduction, and the fraction of gather time hidden by prefetch.
//!
//! ```sh
//! cargo bench -p tessera-fsdp --bench thread
//! ```
//!
//! Prints markdown tables. Times are the median over the measured steps of the slowest
//! rank, the fastest of three interleaved runs; bytes are per rank per step, as a
//! [`CountingGroup`] counts them (`sent`: what the rank hands to collectives; `ring`:
//! what it would transmit in a ring).
//!
//! ThreadGroup completes a collective when the last rank issues it, on the issuing
//! thread, so a prefetched gather cannot overlap compute here: the hidden fraction is
//! measured, and is expected to be about zero. It is the NCCL backend that overlaps.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tessera_collectives::{ProcessGroup, run_ranks};
use tessera_core::{DType, Result, Tensor};
use tessera_fsdp::mlp::{Activations, MlpSpec, batch, rows, train_step};
use tessera_fsdp::{
    CommCounts, CountingGroup, Fsdp, FsdpConfig, GradReduce, LowPrecision, WeightFormat,
};
use tessera_quant::Fp8Format;

const WORLD: usize = 4;
const TOKENS: usize = 16;
const WARMUP: usize = 1;
const STEPS: usize = 4;
/// Each configuration is measured this many times, interleaved; the fastest is kept
/// (other jobs share the machine).
const ROUNDS: usize = 3;
const SPEC: MlpSpec = MlpSpec {
    d_model: 512,
    d_ffn: 512,
    layers: 4,
    seed: 1,
};

#[derive(Debug, Clone, Copy)]
struct Measured {
    step: Duration,
    counts: CommCounts,
    blocked: Duration,
    reduce: Duration,
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn measure(config: FsdpConfig, x: &Tensor) -> Measured {
    let per_rank = run_ranks(WORLD, |g| -> Result<Measured> {
        let r = g.rank();
        let counted = Arc::new(CountingGroup::new(Arc::new(g)));
        let mut fsdp = Fsdp::new(counted.clone(), config)?;
        SPEC.build(&mut fsdp)?;
        let mine = rows(x, r * TOKENS..(r + 1) * TOKENS)?;
        for _ in 0..WARMUP {
            train_step(&mut fsdp, &mine, 0.1, Activations::Keep)?;
        }
        counted.reset();
        fsdp.reset_stats();
        let mut times = Vec::new();
        for _ in 0..STEPS {
            counted.barrier()?;
            let t0 = Instant::now();
            train_step(&mut fsdp, &mine, 0.1, Activations::Keep)?;
            times.push(t0.elapsed());
        }
        let s = fsdp.stats();
        Ok(Measured {
            step: median(times),
            counts: counted.counts(),
            blocked: s.blocked_time() / STEPS as u32,
            reduce: s.reduce_time / STEPS as u32,
        })
    })
    .expect("thread ranks");
    let per_rank: Vec<Measured> = per_rank
        .into_iter()
        .map(|m| m.expect("a rank failed"))
        .collect();
    let mut m = per_rank[0];
    m.step = per_rank.iter().map(|m| m.step).max().unwrap_or_default();
    m.blocked = per_rank.iter().map(|m| m.blocked).max().unwrap_or_default();
    m.reduce = per_rank.iter().map(|m| m.reduce).max().unwrap_or_default();
    m
}

/// The fastest of several measurements of one configuration (times only; the bytes are
/// the same every time).
fn best(v: Vec<Measured>) -> Measured {
    let mut m = v[0];
    m.step = v.iter().map(|m| m.step).min().unwrap_or_default();
    m.blocked = v.iter().map(|m| m.blocked).min().unwrap_or_default();
    m.reduce = v.iter().map(|m| m.reduce).min().unwrap_or_default();
    m
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn main() {
    let x = batch(WORLD * TOKENS, SPEC.d_model, 3).expect("batch");
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    println!(
        "load average at start: {}",
        load.split_whitespace()
            .take(3)
            .collect::<Vec<_>>()
            .join(" ")
    );
    println!(
        "FSDP on ThreadGroup: {WORLD} thread ranks on {cores} cores, {} blocks {}→{}→{} ({} MiB of f32 parameters), {TOKENS} tokens per rank, median of {STEPS} steps after {WARMUP} warm-up, best of {ROUNDS} interleaved runs\n",
        SPEC.layers,
        SPEC.d_model,
        SPEC.d_ffn,
        SPEC.d_model,
        SPEC.param_bytes() as f64 / (1 << 20) as f64
    );

    let steps = STEPS as u64;
    let formats: [(&str, FsdpConfig); 6] = [
        ("f32", FsdpConfig::default()),
        (
            "bf16",
            FsdpConfig::default().mixed_precision(DType::BF16, DType::F32),
        ),
        (
            "fp8 (current scaling)",
            FsdpConfig::default().weight_format(WeightFormat::Fp8),
        ),
        (
            "mxfp8",
            FsdpConfig::default().weight_format(WeightFormat::Mxfp8),
        ),
        (
            "nvfp4",
            FsdpConfig::default().weight_format(WeightFormat::Nvfp4),
        ),
        (
            "fp8 block 1x128",
            FsdpConfig::default().weight_format(WeightFormat::Fp8Block),
        ),
    ];
    println!(
        "| weight gather | step ms (prefetch) | step ms (no prefetch) | gather sent B/step | ratio to bf16 | gather ring B/step | gather blocked ms/step (prefetch / none) | hidden by prefetch |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|");
    let mut bf16_bytes = 0u64;
    for (i, (name, config)) in formats.iter().enumerate() {
        let (mut ons, mut offs) = (Vec::new(), Vec::new());
        for _ in 0..ROUNDS {
            ons.push(measure(config.prefetch(true), &x));
            offs.push(measure(config.prefetch(false), &x));
        }
        let (on, off) = (best(ons), best(offs));
        let gather = |c: &CommCounts| (c.all_gather.bytes + c.all_reduce.bytes) / steps;
        let ring = |c: &CommCounts| (c.all_gather.wire_bytes + c.all_reduce.wire_bytes) / steps;
        if i == 1 {
            bf16_bytes = gather(&on.counts);
        }
        let ratio = if i == 0 {
            2.0
        } else if bf16_bytes > 0 {
            gather(&on.counts) as f64 / bf16_bytes as f64
        } else {
            0.0
        };
        // Hidden fraction: how much of the gather time the computation no longer waits
        // for when the next unshard is issued ahead.
        let hidden = 1.0 - on.blocked.as_secs_f64() / off.blocked.as_secs_f64().max(1e-12);
        println!(
            "| {name} | {:.1} | {:.1} | {} | {ratio:.3} | {} | {:.1} / {:.1} | {:.0}% |",
            ms(on.step),
            ms(off.step),
            gather(&on.counts),
            ring(&on.counts),
            ms(on.blocked),
            ms(off.blocked),
            100.0 * hidden
        );
    }

    println!("\n| gradient reduction | step ms | reduce ms/step | sent B/step | ring B/step |");
    println!("|---|---:|---:|---:|---:|");
    let reductions: [(&str, FsdpConfig); 4] = [
        ("reduce-scatter f32", FsdpConfig::default()),
        (
            "reduce-scatter bf16 (bf16 sums)",
            FsdpConfig::default().mixed_precision(DType::F32, DType::BF16),
        ),
        (
            "low precision bf16, f32 sums",
            FsdpConfig::default().grad_reduce(GradReduce::LowPrecision(LowPrecision::Bf16)),
        ),
        (
            "low precision fp8 e5m2, f32 sums",
            FsdpConfig::default()
                .grad_reduce(GradReduce::LowPrecision(LowPrecision::Fp8(Fp8Format::E5M2))),
        ),
    ];
    let weights_only = measure(FsdpConfig::default(), &x).counts;
    for (i, (name, config)) in reductions.iter().enumerate() {
        let m = best((0..ROUNDS).map(|_| measure(*config, &x)).collect());
        let (sent, ring) = if i < 2 {
            (
                m.counts.reduce_scatter.bytes,
                m.counts.reduce_scatter.wire_bytes,
            )
        } else {
            // The low-precision exchange is an all-gather; subtract the weight gathers
            // (f32, the same in every row).
            let w = weights_only;
            (
                m.counts.all_gather.bytes - w.all_gather.bytes,
                m.counts.all_gather.wire_bytes - w.all_gather.wire_bytes,
            )
        };
        println!(
            "| {name} | {:.1} | {:.1} | {} | {} |",
            ms(m.step),
            ms(m.reduce),
            sent / steps,
            ring / steps
        );
    }
}
