//! FSDP on thread ranks: a residual MLP trained on 4 ranks with MXFP8 weight gathers,
//! the bytes each rank sent compared with bf16 gathers, per-rank parameter memory, a
//! sharded checkpoint saved at 4 ranks, loaded at 2 and consolidated into one file.
//!
//! ```sh
//! cargo run --release -p tessera-fsdp --example fsdp_mlp
//! ```
//!
//! Exits with an error if a check fails.

use std::sync::Arc;

use tessera_collectives::{ProcessGroup, run_ranks};
use tessera_core::{Error, Result};
use tessera_fsdp::mlp::{Activations, MlpSpec, batch, rows, train_step};
use tessera_fsdp::{CountingGroup, Fsdp, FsdpConfig, WeightFormat, consolidate};

const WORLD: usize = 4;
const TOKENS: usize = 8;
const STEPS: usize = 5;
const SPEC: MlpSpec = MlpSpec {
    d_model: 128,
    d_ffn: 256,
    layers: 3,
    seed: 2024,
};

struct RankReport {
    losses: Vec<f64>,
    gathered: u64,
    reduced: u64,
    shard_bytes: usize,
    peak_full: usize,
}

fn train(
    format: WeightFormat,
    x: &tessera_core::Tensor,
    dir: Option<&std::path::Path>,
) -> Result<Vec<RankReport>> {
    run_ranks(WORLD, |g| -> Result<RankReport> {
        let rank = g.rank();
        let counted = Arc::new(CountingGroup::new(Arc::new(g)));
        let config = FsdpConfig::default().weight_format(format).mixed_precision(
            if format == WeightFormat::HighPrecision {
                tessera_core::DType::BF16
            } else {
                tessera_core::DType::F32
            },
            tessera_core::DType::F32,
        );
        let mut fsdp = Fsdp::new(counted.clone(), config)?;
        SPEC.build(&mut fsdp)?;
        let mine = rows(x, rank * TOKENS..(rank + 1) * TOKENS)?;
        let mut losses = Vec::new();
        for _ in 0..STEPS {
            losses.push(train_step(&mut fsdp, &mine, 0.5, Activations::Keep)?.loss);
        }
        let c = counted.counts();
        if let Some(dir) = dir {
            fsdp.save_sharded(dir)?;
        }
        Ok(RankReport {
            losses,
            gathered: c.all_gather.bytes + c.all_reduce.bytes,
            reduced: c.reduce_scatter.bytes,
            shard_bytes: fsdp.memory().shard_bytes,
            peak_full: fsdp.memory().peak_full_bytes,
        })
    })?
    .into_iter()
    .collect()
}

fn main() -> Result<()> {
    let x = batch(WORLD * TOKENS, SPEC.d_model, 7)?;
    let dir = std::env::temp_dir().join(format!("tessera-fsdp-example-{}", std::process::id()));
    let mx = train(WeightFormat::Mxfp8, &x, Some(&dir))?;
    let bf = train(WeightFormat::HighPrecision, &x, None)?;
    println!(
        "{WORLD} thread ranks, {} blocks of {}→{}→{}, {TOKENS} tokens per rank",
        SPEC.layers, SPEC.d_model, SPEC.d_ffn, SPEC.d_model
    );
    println!("step  loss (mxfp8 gathers)  loss (bf16 gathers)");
    for s in 0..STEPS {
        let mean = |r: &[RankReport]| r.iter().map(|r| r.losses[s]).sum::<f64>() / WORLD as f64;
        println!("{s:>4}  {:>20.6}  {:>19.6}", mean(&mx), mean(&bf));
    }
    let ratio = mx[0].gathered as f64 / bf[0].gathered as f64;
    println!(
        "bytes each rank sent in weight gathers over {STEPS} steps: mxfp8 {}, bf16 {} ({ratio:.3} of bf16); gradient reduce-scatter (f32): {}",
        mx[0].gathered, bf[0].gathered, mx[0].reduced
    );
    let layer = SPEC.param_bytes() / SPEC.layers;
    println!(
        "per-rank parameter memory: shards {} B (1/{WORLD} of {} B) + at most {} B unsharded at once ({} layers: the current one and the prefetched next)",
        mx[0].shard_bytes,
        SPEC.param_bytes(),
        mx[0].peak_full,
        mx[0].peak_full / layer
    );
    if !(0.51..0.52).contains(&ratio) {
        return Err(Error::state(
            "example",
            format!("MXFP8 gathers moved {ratio:.3} of bf16's bytes, expected ~0.516"),
        ));
    }
    if mx[0].losses[STEPS - 1] >= mx[0].losses[0] {
        return Err(Error::state("example", "the loss did not fall"));
    }

    // Load the checkpoint saved at 4 ranks on 2 ranks, and consolidate it.
    let loaded = run_ranks(2, |g| -> Result<usize> {
        let group: Arc<dyn ProcessGroup> = Arc::new(g);
        let mut fsdp = Fsdp::new(group, FsdpConfig::default())?;
        SPEC.build(&mut fsdp)?;
        fsdp.load_sharded(&dir)?;
        Ok(fsdp.memory().shard_bytes)
    })?;
    let out = dir.join("model.safetensors");
    let c = consolidate(&dir, &out)?;
    println!(
        "checkpoint saved at {} ranks, loaded at 2 ({} B per rank), consolidated: {} parameters, {} B in `{}`",
        c.world_size,
        loaded[0].as_ref().map_err(Clone::clone)?,
        c.params.len(),
        c.bytes,
        out.display()
    );
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}
