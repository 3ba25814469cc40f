//! Training the reference MLP under FSDP on ThreadGroup ranks: equal to replicated data
//! parallelism bit for bit, to one unsharded rank within f32 tolerance; hybrid sharding,
//! mixed precision, memory, prefetch and bad input.

use std::sync::{Arc, Mutex};

use tessera_collectives::{ProcessGroup, ReduceOp, ThreadGroup, run_ranks};
use tessera_core::{DType, Device, Error, Result, Shape, Tensor};
use tessera_fsdp::mlp::{
    Activations, MlpSpec, batch, block_backward, block_forward, mse_loss, rows, train_step,
};
use tessera_fsdp::{CountingGroup, Fsdp, FsdpConfig, ReshardPolicy, thread_hybrid_groups};

const SPEC: MlpSpec = MlpSpec {
    d_model: 24,
    d_ffn: 40,
    layers: 2,
    seed: 11,
};
const TOKENS: usize = 3; // per rank
const STEPS: usize = 3;
const LR: f32 = 0.3;

type Run = (Vec<f64>, Vec<(String, Tensor)>);

/// Replicated data parallelism: full weights on every rank, gradients all-reduced (sum,
/// rank order, f32) and multiplied by 1/world, SGD. Per rank: losses and final weights.
fn data_parallel(world: usize, spec: MlpSpec, x: &Tensor) -> Vec<Run> {
    run_ranks(world, |g| -> Result<Run> {
        let r = g.rank();
        let mine = rows(x, r * TOKENS..(r + 1) * TOKENS)?;
        let mut w: Vec<(String, Tensor)> = spec.init()?.into_iter().flatten().collect();
        let inv = 1.0 / world as f32;
        let mut losses = Vec::new();
        for _ in 0..STEPS {
            let mut kept = Vec::new();
            let mut h = mine.clone();
            for l in 0..spec.layers {
                let (y, a) = block_forward(&h, &w[2 * l].1, &w[2 * l + 1].1)?;
                kept.push((h, a));
                h = y;
            }
            let (loss, mut dy) = mse_loss(&h)?;
            losses.push(loss);
            let mut grads = vec![None; 2 * spec.layers];
            for l in (0..spec.layers).rev() {
                let (x, a) = kept.pop().unwrap();
                let (dx, dw1, dw2) = block_backward(&x, &a, &w[2 * l].1, &w[2 * l + 1].1, &dy)?;
                grads[2 * l] = Some(dw1);
                grads[2 * l + 1] = Some(dw2);
                dy = dx;
            }
            for ((_, w), grad) in w.iter_mut().zip(grads) {
                let summed = g.all_reduce(grad.unwrap(), ReduceOp::Sum)?.into_result()?;
                let gv: Vec<f32> = summed.as_slice::<f32>()?.iter().map(|v| v * inv).collect();
                for (w, g) in w.as_mut_slice::<f32>()?.iter_mut().zip(&gv) {
                    *w -= LR * g;
                }
            }
        }
        Ok((losses, w))
    })
    .unwrap()
    .into_iter()
    .map(Result::unwrap)
    .collect()
}

/// FSDP training on `world` ranks; per rank: losses and the gathered final weights.
fn fsdp_run(
    world: usize,
    spec: MlpSpec,
    x: &Tensor,
    config: FsdpConfig,
    mode: Activations,
) -> Vec<Run> {
    run_ranks(world, |g| -> Result<Run> {
        let r = g.rank();
        let mine = rows(x, r * TOKENS..(r + 1) * TOKENS)?;
        let mut fsdp = Fsdp::new(Arc::new(g), config)?;
        spec.build(&mut fsdp)?;
        let losses = (0..STEPS)
            .map(|_| Ok(train_step(&mut fsdp, &mine, LR, mode)?.loss))
            .collect::<Result<Vec<_>>>()?;
        Ok((losses, fsdp.gather_full_parameters()?))
    })
    .unwrap()
    .into_iter()
    .map(Result::unwrap)
    .collect()
}

fn bits(t: &Tensor) -> Vec<u8> {
    t.to_bytes().unwrap()
}

#[test]
fn fsdp_equals_data_parallel_bit_for_bit_at_world_sizes_1_to_8() {
    let modes = [
        Activations::Keep,
        Activations::ScatterWeights,
        Activations::Recompute,
    ];
    let policies = [
        ReshardPolicy::AfterForward,
        ReshardPolicy::AfterBackward,
        ReshardPolicy::Never,
    ];
    for world in 1..=8 {
        let x = batch(world * TOKENS, SPEC.d_model, 100 + world as u64).unwrap();
        let dp = data_parallel(world, SPEC, &x);
        let mode = modes[world % 3];
        let config = FsdpConfig::default()
            .reshard(policies[(world / 3) % 3])
            .prefetch(world % 2 == 0);
        let fsdp = fsdp_run(world, SPEC, &x, config, mode);
        for (r, ((dl, dw), (fl, fw))) in dp.iter().zip(&fsdp).enumerate() {
            assert_eq!(
                dl, fl,
                "world {world} rank {r} ({mode:?}, {config:?}): losses differ"
            );
            for ((dn, dt), (fname, ft)) in dw.iter().zip(fw) {
                assert_eq!(dn, fname);
                assert_eq!(
                    bits(dt),
                    bits(ft),
                    "world {world} rank {r} {dn}: weights differ"
                );
            }
        }
        assert!(
            dp[0].0[STEPS - 1] < dp[0].0[0],
            "world {world}: the loss did not fall"
        );
    }
}

fn max_rel_diff(a: &Tensor, b: &Tensor) -> f32 {
    let (a, b) = (a.as_slice::<f32>().unwrap(), b.as_slice::<f32>().unwrap());
    let scale = a.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-6);
    a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / scale
}

/// One rank on the whole batch (no sharding): losses of the whole batch and weights.
fn single_rank(spec: MlpSpec, x: &Tensor) -> Run {
    let tokens = x.shape().dims()[0];
    let mut out = run_ranks(1, |g| -> Result<Run> {
        let mut fsdp = Fsdp::new(Arc::new(g), FsdpConfig::default())?;
        spec.build(&mut fsdp)?;
        let whole = rows(x, 0..tokens)?;
        let losses = (0..STEPS)
            .map(|_| Ok(train_step(&mut fsdp, &whole, LR, Activations::Keep)?.loss))
            .collect::<Result<Vec<_>>>()?;
        Ok((losses, fsdp.gather_full_parameters()?))
    })
    .unwrap();
    out.remove(0).unwrap()
}

fn assert_close_to_single(world: usize, runs: &[Run], single: &Run, tol: f32) {
    for s in 0..STEPS {
        let mean = runs.iter().map(|r| r.0[s]).sum::<f64>() / runs.len() as f64;
        let rel = (mean - single.0[s]).abs() / single.0[s];
        assert!(
            rel < f64::from(tol),
            "world {world} step {s}: loss {mean} vs {} (rel {rel})",
            single.0[s]
        );
    }
    for run in runs {
        for ((n, a), (_, b)) in single.1.iter().zip(&run.1) {
            let d = max_rel_diff(a, b);
            assert!(d < tol, "world {world} {n}: max relative difference {d}");
        }
    }
}

#[test]
fn fsdp_matches_one_unsharded_rank_within_f32_tolerance() {
    for world in [2, 3, 4, 8] {
        let x = batch(world * TOKENS, SPEC.d_model, 5).unwrap();
        let single = single_rank(SPEC, &x);
        let runs = fsdp_run(world, SPEC, &x, FsdpConfig::default(), Activations::Keep);
        assert_close_to_single(world, &runs, &single, 1e-5);
    }
}

#[test]
fn hybrid_sharding_shards_within_and_replicates_across_subgroups() {
    for (world, shard) in [(4, 2), (6, 3), (4, 1), (4, 4)] {
        let x = batch(world * TOKENS, SPEC.d_model, 9).unwrap();
        let single = single_rank(SPEC, &x);
        let groups: Vec<Mutex<Option<(ThreadGroup, ThreadGroup)>>> =
            thread_hybrid_groups(world, shard)
                .unwrap()
                .into_iter()
                .map(|p| Mutex::new(Some(p)))
                .collect();
        let runs = run_ranks(world, |g| -> Result<(Run, usize, usize, u64)> {
            let r = g.rank();
            let (shard_group, replicate_group) = groups[r].lock().unwrap().take().unwrap();
            let counted = Arc::new(CountingGroup::new(Arc::new(shard_group)));
            let mut fsdp = Fsdp::with_groups(
                counted.clone(),
                Some(Arc::new(replicate_group)),
                FsdpConfig::default(),
            )?;
            assert_eq!(
                (fsdp.group().size(), fsdp.replicas()),
                (shard, world / shard)
            );
            assert_eq!(fsdp.data_parallel_size(), world);
            SPEC.build(&mut fsdp)?;
            let mine = rows(&x, r * TOKENS..(r + 1) * TOKENS)?;
            let losses = (0..STEPS)
                .map(|_| Ok(train_step(&mut fsdp, &mine, LR, Activations::Keep)?.loss))
                .collect::<Result<Vec<_>>>()?;
            let gathered = counted.counts().all_gather.bytes;
            Ok((
                (losses, fsdp.gather_full_parameters()?),
                fsdp.group().rank(),
                fsdp.memory().shard_bytes,
                gathered,
            ))
        })
        .unwrap()
        .into_iter()
        .map(Result::unwrap)
        .collect::<Vec<_>>();
        let plain: Vec<Run> = runs.iter().map(|r| r.0.clone()).collect();
        assert_close_to_single(world, &plain, &single, 1e-5);
        // Ranks at the same position of different replicas hold the same shards.
        for a in &runs {
            for b in &runs {
                if a.1 == b.1 {
                    assert_eq!(a.2, b.2);
                    for ((_, x), (_, y)) in a.0.1.iter().zip(&b.0.1) {
                        assert_eq!(bits(x), bits(y));
                    }
                }
            }
        }
        // Gathers stay within the shard group: each rank sends its 1/shard of every
        // weight, forward and backward.
        let shard_elems: usize = SPEC
            .init()
            .unwrap()
            .iter()
            .flatten()
            .map(|(_, t)| t.shape().dims()[0].div_ceil(shard) * t.shape().dims()[1])
            .sum();
        let want = if shard == 1 {
            0
        } else {
            STEPS * 2 * shard_elems * 4
        } as u64;
        assert!(
            runs.iter().all(|r| r.3 == want),
            "world {world} shard {shard}: {:?} vs {want}",
            runs.iter().map(|r| r.3).collect::<Vec<_>>()
        );
    }
}

#[test]
fn bf16_params_and_reduction_train_close_to_f32_and_gather_half_the_bytes() {
    let world = 4;
    let x = batch(world * TOKENS, SPEC.d_model, 21).unwrap();
    let single = single_rank(SPEC, &x);
    let results = run_ranks(world, |g| -> Result<(Run, u64)> {
        let r = g.rank();
        let counted = Arc::new(CountingGroup::new(Arc::new(g)));
        let config = FsdpConfig::default().mixed_precision(DType::BF16, DType::BF16);
        let mut fsdp = Fsdp::new(counted.clone(), config)?;
        SPEC.build(&mut fsdp)?;
        let mine = rows(&x, r * TOKENS..(r + 1) * TOKENS)?;
        let losses = (0..STEPS)
            .map(|_| Ok(train_step(&mut fsdp, &mine, LR, Activations::Keep)?.loss))
            .collect::<Result<Vec<_>>>()?;
        let c = counted.counts();
        Ok(((losses, fsdp.gather_full_parameters()?), c.all_gather.bytes))
    })
    .unwrap()
    .into_iter()
    .map(Result::unwrap)
    .collect::<Vec<_>>();
    let runs: Vec<Run> = results.iter().map(|r| r.0.clone()).collect();
    assert_close_to_single(world, &runs, &single, 2e-2);
    // bf16 gathers: 2 bytes per value, forward and backward.
    let rows_elems: usize = SPEC
        .init()
        .unwrap()
        .iter()
        .flatten()
        .map(|(_, t)| t.shape().dims()[0].div_ceil(world) * t.shape().dims()[1])
        .sum();
    let want = (STEPS * 2 * rows_elems * 2) as u64;
    assert!(
        results.iter().all(|r| r.1 == want),
        "{:?} vs {want}",
        results.iter().map(|r| r.1).collect::<Vec<_>>()
    );
}

#[test]
fn per_rank_parameter_memory_is_a_shard_plus_one_unsharded_layer() {
    let spec = MlpSpec {
        d_model: 32,
        d_ffn: 64,
        layers: 4,
        seed: 3,
    };
    let world = 4;
    let unit_bytes = 2 * 32 * 64 * 4;
    for (prefetch, policy, want_peak) in [
        (false, ReshardPolicy::AfterForward, unit_bytes),
        (true, ReshardPolicy::AfterForward, 2 * unit_bytes),
        (
            false,
            ReshardPolicy::AfterBackward,
            spec.layers * unit_bytes,
        ),
    ] {
        let x = batch(world * TOKENS, spec.d_model, 1).unwrap();
        let mem = run_ranks(world, |g| -> Result<_> {
            let r = g.rank();
            let config = FsdpConfig::default().prefetch(prefetch).reshard(policy);
            let mut fsdp = Fsdp::new(Arc::new(g), config)?;
            spec.build(&mut fsdp)?;
            let mine = rows(&x, r * TOKENS..(r + 1) * TOKENS)?;
            train_step(&mut fsdp, &mine, LR, Activations::Keep)?;
            let stats = fsdp.stats();
            Ok((fsdp.memory(), stats))
        })
        .unwrap();
        for m in mem {
            let (m, stats) = m.unwrap();
            assert_eq!(m.shard_bytes, spec.param_bytes() / world);
            assert_eq!(
                m.peak_full_bytes, want_peak,
                "prefetch {prefetch}, {policy:?}"
            );
            assert_eq!(m.full_bytes, 0, "the optimizer step frees every full copy");
            assert_eq!(m.grad_bytes, 0);
            let unshards = if policy == ReshardPolicy::AfterForward {
                2 * spec.layers
            } else {
                spec.layers
            };
            assert_eq!(stats.unshards, unshards as u64);
            let prefetched = if prefetch { 2 * (spec.layers - 1) } else { 0 };
            assert_eq!(stats.prefetches, prefetched as u64);
        }
    }
}

#[test]
fn uneven_shapes_are_padded_and_tracked() {
    // 5 rows over 8 ranks: ranks 5..8 hold only padding.
    let out = run_ranks(8, |g| -> Result<_> {
        let mut fsdp = Fsdp::new(Arc::new(g), FsdpConfig::default())?;
        let w: Vec<f32> = (0..15).map(|i| i as f32).collect();
        let b: Vec<f32> = (0..7).map(|i| -(i as f32)).collect();
        fsdp.add_unit(
            "u",
            vec![
                ("w".into(), Tensor::from_slice(&w, [5, 3], Device::Cpu)?),
                ("b".into(), Tensor::from_slice(&b, [7], Device::Cpu)?),
            ],
        )?;
        let p = &fsdp.params(0)?[0];
        let (valid, shard) = (
            p.layout().valid_rows(fsdp.group().rank()),
            p.shard().to_vec::<f32>()?,
        );
        let full = fsdp.full_params(0)?;
        Ok((
            valid,
            shard,
            full[0].tensor.to_vec::<f32>()?,
            full[1].tensor.to_vec::<f32>()?,
        ))
    })
    .unwrap();
    for (r, o) in out.into_iter().enumerate() {
        let (valid, shard, w, b) = o.unwrap();
        assert_eq!(valid, r.min(5)..(r + 1).min(5));
        assert_eq!(
            shard,
            if r < 5 {
                vec![3.0 * r as f32, 3.0 * r as f32 + 1.0, 3.0 * r as f32 + 2.0]
            } else {
                vec![0.0; 3]
            }
        );
        assert_eq!(w, (0..15).map(|i| i as f32).collect::<Vec<_>>());
        assert_eq!(b, (0..7).map(|i| -(i as f32)).collect::<Vec<_>>());
    }
}

#[test]
fn bad_input_is_a_typed_error() {
    run_ranks(2, |g| -> Result<()> {
        let group: Arc<dyn ProcessGroup> = Arc::new(g);
        let err = Fsdp::new(
            group.clone(),
            FsdpConfig::default().mixed_precision(DType::F16, DType::F32),
        )
        .unwrap_err();
        assert!(matches!(err, Error::DType { .. }), "{err}");
        assert!(Fsdp::hybrid(&group, 3, FsdpConfig::default()).is_err());
        let mut fsdp = Fsdp::new(group, FsdpConfig::default())?;
        SPEC.build(&mut fsdp)?;
        let err = fsdp.add_unit("again", SPEC.init()?.remove(0)).unwrap_err();
        assert!(matches!(err, Error::Duplicate { .. }), "{err}");
        let err = fsdp
            .add_unit(
                "scalar",
                vec![(
                    "s".into(),
                    Tensor::zeros(Shape::new([]), DType::F32, Device::Cpu)?,
                )],
            )
            .unwrap_err();
        assert!(err.to_string().contains("rank-0"), "{err}");
        let err = fsdp.sgd_step(0.1).unwrap_err();
        assert!(matches!(err, Error::State { .. }), "{err}");
        assert!(fsdp.full_params(7).is_err());
        let g = Tensor::zeros([SPEC.d_model, SPEC.d_ffn], DType::F32, Device::Cpu)?;
        let err = fsdp.reduce_gradients(0, vec![g.clone()]).unwrap_err();
        assert!(
            err.to_string().contains("2 parameters but 1 gradients"),
            "{err}"
        );
        let err = fsdp
            .reduce_gradients(0, vec![g.clone(), g.clone()])
            .unwrap_err();
        assert!(matches!(err, Error::Shape { .. }), "{err}");
        let bf = Tensor::zeros([SPEC.d_model, SPEC.d_ffn], DType::BF16, Device::Cpu)?;
        let ok2 = Tensor::zeros([SPEC.d_ffn, SPEC.d_model], DType::F32, Device::Cpu)?;
        let err = fsdp.reduce_gradients(0, vec![bf, ok2]).unwrap_err();
        assert!(matches!(err, Error::DType { .. }), "{err}");
        Ok(())
    })
    .unwrap()
    .into_iter()
    .for_each(Result::unwrap);
}

#[test]
fn hybrid_groups_from_subgroups_agree_on_thread_ranks() {
    // `hybrid_groups` builds its shard and replicate groups with `new_subgroup` in a row:
    // every rank must land in the groups of its position.
    let results = run_ranks(6, |g| -> Result<(f32, f32)> {
        let rank = g.rank() as f32;
        let world: Arc<dyn ProcessGroup> = Arc::new(g);
        let (shard, replicate) = tessera_fsdp::hybrid_groups(&world, 3)?;
        let x = Tensor::from_slice(&[rank], [1], Device::Cpu)?;
        let s = shard
            .all_reduce(x.clone(), ReduceOp::Sum)?
            .into_result()?
            .to_vec::<f32>()?[0];
        let r = replicate
            .all_reduce(x, ReduceOp::Sum)?
            .into_result()?
            .to_vec::<f32>()?[0];
        Ok((s, r))
    })
    .unwrap();
    let got: Vec<(f32, f32)> = results.into_iter().map(|r| r.unwrap()).collect();
    // Shard groups {0,1,2} and {3,4,5}; replicate groups {0,3}, {1,4}, {2,5}.
    assert_eq!(
        got,
        vec![
            (3.0, 3.0),
            (3.0, 5.0),
            (3.0, 7.0),
            (12.0, 3.0),
            (12.0, 5.0),
            (12.0, 7.0)
        ]
    );
}
