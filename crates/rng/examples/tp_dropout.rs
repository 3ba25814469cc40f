//! Tensor-parallel dropout streams, with ranks as threads.
//!
//! Every rank seeds its RNG the Megatron way (`tp::model_parallel_manual_seed`), then
//! applies dropout twice per layer:
//! - inside the tensor-parallel region, to its own shard `[seq, hidden / tp]`, under the
//!   forked `model-parallel-rng` state: the masks must differ between ranks;
//! - in the replicated region, to the full `[seq, hidden]` activation, from the
//!   device's current generator: the masks must be identical on every rank.
//!
//! Finally it restores the RNG snapshots taken before the first layer and replays the
//! layers, as activation recomputation does: the replayed masks must equal the originals.
//!
//! ```text
//! cargo run --release -p tessera-rng --example tp_dropout -- [--tp 4] [--layers 3]
//!     [--seq 512] [--hidden 1024] [--p 0.1] [--seed 1234] [--device cpu|cuda:N]
//! ```
//! The exit code is non-zero when a check fails.

use std::process::ExitCode;
use std::time::Instant;

use tessera_core::{Device, Replay, Result, Tensor};
use tessera_rng::tp::{self, MODEL_PARALLEL_RNG};
use tessera_rng::{CurrentGenerator, RngTracker, with_current_generator};

struct Opts {
    tp: usize,
    layers: usize,
    seq: usize,
    hidden: usize,
    p: f32,
    seed: u64,
    device: Device,
}

fn parse() -> std::result::Result<Opts, String> {
    let mut o = Opts {
        tp: 4,
        layers: 3,
        seq: 512,
        hidden: 1024,
        p: 0.1,
        seed: 1234,
        device: Device::Cpu,
    };
    let mut it = std::env::args().skip(1);
    while let Some(k) = it.next() {
        let v = it.next().ok_or_else(|| format!("{k} needs a value"))?;
        let bad = |e: &dyn std::fmt::Display| format!("{k} {v}: {e}");
        match k.as_str() {
            "--tp" => o.tp = v.parse().map_err(|e| bad(&e))?,
            "--layers" => o.layers = v.parse().map_err(|e| bad(&e))?,
            "--seq" => o.seq = v.parse().map_err(|e| bad(&e))?,
            "--hidden" => o.hidden = v.parse().map_err(|e| bad(&e))?,
            "--p" => o.p = v.parse().map_err(|e| bad(&e))?,
            "--seed" => o.seed = v.parse().map_err(|e| bad(&e))?,
            "--device" => {
                o.device = match v.as_str() {
                    "cpu" => Device::Cpu,
                    d => Device::Cuda(
                        d.strip_prefix("cuda:")
                            .and_then(|n| n.parse().ok())
                            .ok_or_else(|| bad(&"expected cpu or cuda:N"))?,
                    ),
                }
            }
            _ => return Err(format!("unknown option {k}")),
        }
    }
    if o.tp == 0 || !o.hidden.is_multiple_of(o.tp) {
        return Err(format!(
            "--hidden {} must be a positive multiple of --tp {}",
            o.hidden, o.tp
        ));
    }
    Ok(o)
}

/// The dropout masks one rank draws: per layer, (model-parallel shard mask, replicated mask).
type Masks = Vec<(Vec<u8>, Vec<u8>)>;

fn layers(o: &Opts, tracker: &mut RngTracker, x_shard: &Tensor, x_full: &Tensor) -> Result<Masks> {
    let mut masks = Vec::new();
    for _ in 0..o.layers {
        let (_, mp) = tracker.fork(MODEL_PARALLEL_RNG, || {
            with_current_generator(o.device, |g| g.dropout_tensor(x_shard, o.p))?
        })?;
        let (_, dp) = with_current_generator(o.device, |g| g.dropout_tensor(x_full, o.p))??;
        masks.push((mp.to_vec::<u8>()?, dp.to_vec::<u8>()?));
    }
    Ok(masks)
}

fn rank(o: &Opts, rank: usize) -> Result<(Masks, Masks)> {
    let mut tracker = RngTracker::new(o.device);
    tp::model_parallel_manual_seed(&mut tracker, o.seed, rank as u64, 0)?;
    let x_shard = Tensor::from_slice(
        &vec![1.0f32; o.seq * o.hidden / o.tp],
        [o.seq, o.hidden / o.tp],
        o.device,
    )?;
    let x_full = Tensor::from_slice(&vec![1.0f32; o.seq * o.hidden], [o.seq, o.hidden], o.device)?;
    let mut current = CurrentGenerator::new(o.device);
    let snapshots = (tracker.snapshot(), current.snapshot());
    let first = layers(o, &mut tracker, &x_shard, &x_full)?;
    tracker.restore(&snapshots.0)?;
    current.restore(&snapshots.1)?;
    let replay = layers(o, &mut tracker, &x_shard, &x_full)?;
    Ok((first, replay))
}

/// FNV-1a, to print short fingerprints of masks.
fn fingerprint(bytes: &[u8]) -> u32 {
    bytes.iter().fold(0x811c_9dc5u32, |h, &b| {
        (h ^ u32::from(b)).wrapping_mul(0x0100_0193)
    })
}

fn kept(mask: &[u8]) -> f64 {
    mask.iter().map(|&m| f64::from(m)).sum::<f64>() / mask.len().max(1) as f64
}

fn main() -> ExitCode {
    let o = match parse() {
        Ok(o) => o,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    let t0 = Instant::now();
    let results: Vec<Result<(Masks, Masks)>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..o.tp)
            .map(|r| {
                let o = &o;
                s.spawn(move || rank(o, r))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("rank thread panicked"))
            .collect()
    });
    let mut ranks = Vec::new();
    for (r, res) in results.into_iter().enumerate() {
        match res {
            Ok(v) => ranks.push(v),
            Err(e) => {
                eprintln!("rank {r}: {e}");
                return ExitCode::FAILURE;
            }
        }
    }
    println!(
        "tensor-parallel dropout streams: tp={} layers={} seq={} hidden={} p={} seed={} device={}",
        o.tp, o.layers, o.seq, o.hidden, o.p, o.seed, o.device
    );
    println!(
        "{:>5} {:>6}  {:>24}  {:>24}",
        "rank", "layer", "model-parallel mask", "data-parallel mask"
    );
    for (r, (first, _)) in ranks.iter().enumerate() {
        for (l, (mp, dp)) in first.iter().enumerate() {
            println!(
                "{r:>5} {l:>6}  {:08x} kept {:.4}  {:08x} kept {:.4}",
                fingerprint(mp),
                kept(mp),
                fingerprint(dp),
                kept(dp)
            );
        }
    }
    let mut ok = true;
    let mut check = |name: &str, pass: bool| {
        println!("check: {name}: {}", if pass { "ok" } else { "FAILED" });
        ok &= pass;
    };
    let mp_distinct = (0..o.layers).all(|l| {
        let mut fps: Vec<u32> = ranks.iter().map(|(f, _)| fingerprint(&f[l].0)).collect();
        fps.sort_unstable();
        fps.dedup();
        fps.len() == o.tp
    });
    check(
        "model-parallel masks differ across TP ranks",
        mp_distinct || o.tp == 1,
    );
    let dp_same = ranks
        .iter()
        .all(|(f, _)| f.iter().zip(&ranks[0].0).all(|(a, b)| a.1 == b.1));
    check("data-parallel masks identical on every TP rank", dp_same);
    let layers_differ = o.layers < 2 || ranks[0].0[0].1 != ranks[0].0[1].1;
    check("successive layers draw fresh masks", layers_differ);
    check(
        "replay after restoring snapshots reproduces every mask",
        ranks.iter().all(|(f, r)| f == r),
    );
    let n = ranks[0]
        .0
        .iter()
        .map(|(a, b)| a.len() + b.len())
        .sum::<usize>()
        * o.tp
        * 2;
    println!("{n} dropout decisions in {:.2?}", t0.elapsed());
    if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
