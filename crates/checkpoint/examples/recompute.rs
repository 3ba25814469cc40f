//! Trains a stack of MLP blocks (dropout from the tracker's forked "model-parallel-rng"
//! state, FP8 current and delayed scaling) for a few steps without checkpointing and
//! with reentrant and non-reentrant checkpointing — also with
//! `distribute_saved_activations` on thread groups of 2 and 4 ranks — and prints, per
//! mode, the largest gradient difference to the baseline (must be 0), the bytes of
//! saved activations held between forward and backward (must fall to the inputs, or
//! 1/TP of them), the peak including the recompute, and the time per step.
//!
//! `cargo run --release -p tessera-checkpoint --example recompute`

use std::sync::Arc;
use std::time::{Duration, Instant};

use tessera_checkpoint::mlp::{Mlp, train_step};
use tessera_checkpoint::{Checkpoint, MemoryMeter};
use tessera_collectives::{ProcessGroup, run_ranks};
use tessera_core::{Device, Error, Result, Tensor};
use tessera_quant::DelayedScalingState;
use tessera_rng::tp::model_parallel_manual_seed;
use tessera_rng::{Generator, GeneratorState, RngTracker, get_rng_state};

const BLOCKS: usize = 4;
const TOKENS: usize = 128;
const D_MODEL: usize = 128;
const D_FFN: usize = 512;
const DROPOUT: f32 = 0.1;
const STEPS: usize = 5;
const LR: f32 = 0.5;

/// What one training run produced.
struct Outcome {
    /// Per step: every block's (grad w1, grad w2), then the input gradient.
    grads: Vec<Vec<Vec<f32>>>,
    losses: Vec<f64>,
    delayed: Vec<DelayedScalingState>,
    tracker: RngTracker,
    current: GeneratorState,
    saved_after_forward: usize,
    peak: usize,
    per_step: Duration,
}

fn run(ckpt: Checkpoint) -> Result<Outcome> {
    let meter = MemoryMeter::new();
    let ckpt = ckpt.meter(meter.clone());
    let mut tracker = RngTracker::new(Device::Cpu);
    // The same seeds on every rank: the blocks are replicated, so their activations
    // (and the inputs that distribute_saved_activations shards) are too.
    model_parallel_manual_seed(&mut tracker, 2024, 0, 0)?;
    let mut blocks = (0..BLOCKS)
        .map(|i| Mlp::new(D_MODEL, D_FFN, DROPOUT, 100 + i as u64))
        .collect::<Result<Vec<_>>>()?;
    let mut x = vec![0.0f32; TOKENS * D_MODEL];
    Generator::new(7).fill_normal(&mut x, 0.0, 1.0);
    let x = Tensor::from_slice(&x, [TOKENS, D_MODEL], Device::Cpu)?;

    let mut grads = Vec::new();
    let mut losses = Vec::new();
    let mut saved_after_forward = 0;
    let mut elapsed = Duration::ZERO;
    for _ in 0..STEPS {
        let t = Instant::now();
        let step = train_step(&mut blocks, &mut tracker, &x, &ckpt, LR)?;
        elapsed += t.elapsed();
        saved_after_forward = saved_after_forward.max(step.saved_after_forward);
        losses.push(step.loss);
        let mut g = Vec::new();
        for b in &blocks {
            let (g1, g2) = b
                .grads()
                .ok_or_else(|| Error::state("recompute example", "no gradients"))?;
            g.push(g1.to_vec::<f32>()?);
            g.push(g2.to_vec::<f32>()?);
        }
        g.push(step.dx.to_vec::<f32>()?);
        grads.push(g);
    }
    Ok(Outcome {
        grads,
        losses,
        delayed: blocks.iter().map(|b| b.delayed_scaling().clone()).collect(),
        tracker,
        current: get_rng_state(Device::Cpu)?,
        saved_after_forward,
        peak: meter.peak(),
        per_step: elapsed / STEPS as u32,
    })
}

fn max_abs_diff(a: &Outcome, b: &Outcome) -> f32 {
    let mut m = 0.0f32;
    for (sa, sb) in a.grads.iter().zip(&b.grads) {
        for (ta, tb) in sa.iter().zip(sb) {
            for (x, y) in ta.iter().zip(tb) {
                if x.to_bits() != y.to_bits() {
                    // A NaN or infinite difference counts as infinite.
                    let d = (x - y).abs();
                    m = if d.is_finite() {
                        m.max(d)
                    } else {
                        f32::INFINITY
                    };
                }
            }
            if ta.len() != tb.len() {
                m = f32::INFINITY;
            }
        }
    }
    m
}

struct Row {
    mode: String,
    ranks: usize,
    diff: f32,
    states_equal: bool,
    saved: usize,
    expected_saved: usize,
    peak: usize,
    per_step: Duration,
}

fn row(mode: &str, ranks: usize, base: &Outcome, o: &Outcome, expected_saved: usize) -> Row {
    Row {
        mode: mode.to_owned(),
        ranks,
        diff: if base.losses == o.losses {
            max_abs_diff(base, o)
        } else {
            f32::INFINITY
        },
        states_equal: base.delayed == o.delayed
            && base.tracker == o.tracker
            && base.current == o.current,
        saved: o.saved_after_forward,
        expected_saved,
        peak: o.peak,
        per_step: o.per_step,
    }
}

fn kib(b: usize) -> String {
    format!("{:.1} KiB", b as f64 / 1024.0)
}

fn main() -> Result<()> {
    let input_bytes = TOKENS * D_MODEL * 4;
    let activation_bytes = input_bytes + TOKENS * D_FFN * (4 + 1 + 4);
    println!(
        "tessera-checkpoint: {BLOCKS} MLP blocks ({TOKENS} tokens, {D_MODEL} -> {D_FFN} -> \
         {D_MODEL}, dropout {DROPOUT} from the forked \"model-parallel-rng\" state, FP8 E4M3 \
         current + delayed scaling), {STEPS} SGD steps on the CPU"
    );
    println!(
        "each block's input is {}; without checkpointing a block keeps {} (FC1 input, FC1 \
         output, dropout mask, FC2 input)\n",
        kib(input_bytes),
        kib(activation_bytes)
    );

    let mut rows = Vec::new();
    let base = run(Checkpoint::off())?;
    let losses: Vec<String> = base.losses.iter().map(|l| format!("{l:.5}")).collect();
    println!("baseline loss per step: {}\n", losses.join(", "));
    rows.push(row(
        "off (baseline)",
        1,
        &base,
        &base,
        BLOCKS * activation_bytes,
    ));
    for (name, ckpt) in [
        ("reentrant", Checkpoint::reentrant()),
        ("non-reentrant", Checkpoint::non_reentrant()),
    ] {
        let o = run(ckpt)?;
        rows.push(row(name, 1, &base, &o, BLOCKS * input_bytes));
    }

    for tp in [2, 4] {
        // Every rank trains the baseline and both modes; rank 0 reports, the others
        // must agree.
        let per_rank = run_ranks(tp, |g| -> Result<Vec<Row>> {
            let group: Arc<dyn ProcessGroup> = Arc::new(g);
            let base = run(Checkpoint::off())?;
            let shard = (TOKENS * D_MODEL).div_ceil(tp) * 4;
            let mut rows = Vec::new();
            for (name, ckpt) in [
                ("reentrant, distributed", Checkpoint::reentrant()),
                ("non-reentrant, distributed", Checkpoint::non_reentrant()),
            ] {
                let o = run(ckpt.distribute_saved_activations(group.clone()))?;
                rows.push(row(name, tp, &base, &o, BLOCKS * shard));
            }
            Ok(rows)
        })?;
        let mut first = None;
        for (rank, r) in per_rank.into_iter().enumerate() {
            let r = r?;
            if r.iter().any(|x| x.diff != 0.0 || !x.states_equal) {
                return Err(Error::state(
                    "recompute example",
                    format!("rank {rank} of {tp} differs from its baseline"),
                ));
            }
            first.get_or_insert(r);
        }
        rows.extend(first.unwrap_or_default());
    }

    println!(
        "{:<28} {:>5} {:>12} {:>13} {:>16} {:>22} {:>11}",
        "mode",
        "ranks",
        "max |dgrad|",
        "RNG/amax",
        "saved after fwd",
        "peak incl. recompute",
        "time/step"
    );
    let mut ok = true;
    for r in &rows {
        let good = r.diff == 0.0 && r.states_equal && r.saved == r.expected_saved;
        ok &= good;
        println!(
            "{:<28} {:>5} {:>12} {:>13} {:>16} {:>22} {:>8.1} ms{}",
            r.mode,
            r.ranks,
            r.diff,
            if r.states_equal {
                "identical"
            } else {
                "DIFFERENT"
            },
            kib(r.saved),
            kib(r.peak),
            r.per_step.as_secs_f64() * 1e3,
            if good { "" } else { "  <-- FAILED" }
        );
    }
    println!(
        "\nsaved after fwd: bytes held by all frames between the forward and the backward, per \
         rank (checkpointing: the block inputs, 1/TP of them when distributed); peak incl. \
         recompute adds one block's recomputed activations during its backward; time/step of \
         the distributed rows is per rank, with all ranks sharing this machine's cores"
    );
    if !ok {
        return Err(Error::state(
            "recompute example",
            "a checkpointed run differs from the baseline or keeps more than its inputs",
        ));
    }
    println!("all checkpointed runs are bit-identical to the baseline");
    Ok(())
}
