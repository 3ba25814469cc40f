//! ThreadGroup and the distributed.py operations at world sizes 1..8.

use std::sync::Arc;
use std::time::Duration;

use proptest::prelude::*;
use tessera_collectives::{
    Collective, MaybeQuantized, ProcessGroup, ReduceOp, ThreadGroup, gather_along_first_dim,
    gather_split_1d_tensor, run_ranks, split_tensor_into_1d_equal_chunks,
};
use tessera_core::{DType, Device, Error, Result, Tensor};
use tessera_quant::{
    BlockDim, Fp8BlockQuantizer, Fp8CurrentScaling, Fp8DelayedScaling, Fp8Format, Mxfp8Quantizer,
    Nvfp4Quantizer, Quantizer, Usage,
};
use tessera_rng::Generator;

fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut v = vec![0f32; n];
    Generator::new(seed).fill_normal(&mut v, 0.0, 3.0);
    v
}

/// Rank `r`'s `[rows, cols]` shard of the whole `[world·rows, cols]` input.
fn shard(whole: &[f32], rows: usize, cols: usize, r: usize) -> Tensor {
    Tensor::from_slice(
        &whole[r * rows * cols..][..rows * cols],
        [rows, cols],
        Device::Cpu,
    )
    .unwrap()
}

fn group(g: ThreadGroup) -> Arc<dyn ProcessGroup> {
    Arc::new(g)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    #[test]
    fn plain_gather_reduce_scatter_and_all_reduce(world in 1usize..=8, rows in 1usize..5, cols in 1usize..9, seed: u64) {
        let whole = values(world * rows * cols, seed);
        let results = run_ranks(world, |g| -> Result<_> {
            let r = g.rank();
            let x = shard(&whole, rows, cols, r);
            let gathered = g.all_gather(&x)?.into_result()?;
            let summed = g.all_reduce(x.clone(), ReduceOp::Sum)?.into_result()?;
            // all_gather(reduce_scatter(y)) == all_reduce(y) for y = the gathered tensor.
            let rs = g.reduce_scatter(&gathered, ReduceOp::Sum)?.into_result()?;
            let ag = g.all_gather(&rs)?.into_result()?;
            let ar = g.all_reduce(gathered.clone(), ReduceOp::Sum)?.into_result()?;
            Ok((gathered.to_vec::<f32>()?, summed.to_vec::<f32>()?, ag.to_vec::<f32>()?, ar.to_vec::<f32>()?))
        }).unwrap();
        for res in results {
            let (gathered, summed, ag, ar) = res.unwrap();
            prop_assert_eq!(&gathered, &whole);
            let mut want = vec![0f32; rows * cols];
            for r in 0..world {
                for (w, v) in want.iter_mut().zip(&whole[r * rows * cols..][..rows * cols]) {
                    *w += v;
                }
            }
            prop_assert_eq!(summed, want);
            prop_assert_eq!(ag, ar);
        }
    }

    #[test]
    fn coalesced_and_async_equal_sync(world in 1usize..=6, seed: u64) {
        let whole = values(world * 8, seed);
        let results = run_ranks(world, |g| -> Result<_> {
            let x = shard(&whole, 2, 4, g.rank());
            let sync_gather = g.all_gather(&x)?.into_result()?;
            let sync_max = g.all_reduce(x.clone(), ReduceOp::Max)?.into_result()?;
            let mut work = g.run(vec![
                Collective::AllGather { input: x.clone(), output: Tensor::zeros([2 * world, 4], DType::F32, Device::Cpu)? },
                Collective::AllReduce { tensor: x.clone(), op: ReduceOp::Max },
                Collective::Broadcast { tensor: x.clone(), root: world - 1 },
            ])?;
            let outs = work.wait()?.clone();
            let again = work.wait()?.clone(); // waiting twice is fine
            Ok((sync_gather.to_vec::<f32>()?, sync_max.to_vec::<f32>()?, outs.iter().map(|t| t.to_vec::<f32>()).collect::<Result<Vec<_>>>()?, again.len()))
        }).unwrap();
        for res in results {
            let (g, m, outs, n) = res.unwrap();
            prop_assert_eq!(&outs[0], &g);
            prop_assert_eq!(&outs[1], &m);
            prop_assert_eq!(&outs[2], &whole[(world - 1) * 8..].to_vec());
            prop_assert_eq!(n, 3);
        }
    }
}

/// Gathers `world` shards of a random `[world·rows, cols]` tensor with `make()`'s
/// quantizer on every rank and checks the result against quantizing the whole tensor.
fn check_quantized_gather(
    world: usize,
    rows: usize,
    cols: usize,
    make: &(dyn Fn() -> Box<dyn Quantizer> + Sync),
    what: &str,
) {
    let whole = values(
        world * rows * cols,
        (world * 1000 + rows * 10 + cols) as u64,
    );
    let results = run_ranks(world, |g| -> Result<_> {
        let group = group(g);
        let x = shard(&whole, rows, cols, group.rank());
        let mut q = make();
        let out = gather_along_first_dim(&MaybeQuantized::Plain(x), &group, Some(q.as_mut()))?
            .into_result()?;
        Ok(out)
    })
    .unwrap();
    let full = Tensor::from_slice(&whole, [world * rows, cols], Device::Cpu).unwrap();
    let mut q = make();
    let want = q.quantize(&full).unwrap();
    for (r, res) in results.into_iter().enumerate() {
        let got = res.unwrap_or_else(|e| panic!("{what}: rank {r}: {e}"));
        let got = got
            .quantized()
            .unwrap_or_else(|| panic!("{what}: rank {r} got a plain tensor"));
        assert_eq!(got.shape(), want.shape(), "{what}");
        for ((n, a), (_, b)) in got.data_tensors().into_iter().zip(want.data_tensors()) {
            assert_eq!(
                a.to_bytes().unwrap(),
                b.to_bytes().unwrap(),
                "{what}: rank {r} buffer {n}"
            );
        }
        // And so it dequantizes to the dequantized whole.
        assert_eq!(
            got.dequantize(DType::F32).unwrap().to_bytes().unwrap(),
            want.dequantize(DType::F32).unwrap().to_bytes().unwrap(),
            "{what}"
        );
    }
}

/// Makes a fresh quantizer (one per rank).
type MakeQuantizer = Box<dyn Fn() -> Box<dyn Quantizer> + Sync>;

#[test]
fn quantized_gathers_equal_quantizing_the_whole_tensor() {
    for world in [1usize, 2, 3, 4, 8] {
        let e4 = Fp8Format::E4M3;
        let cases: Vec<(&str, usize, usize, MakeQuantizer)> = vec![
            (
                "fp8 current",
                3,
                20,
                Box::new(move || Box::new(Fp8CurrentScaling::new(e4))),
            ),
            (
                "fp8 current pow2 rowwise",
                2,
                9,
                Box::new(move || {
                    Box::new(
                        Fp8CurrentScaling::new(e4)
                            .with_pow2_scales(true)
                            .with_usage(Usage::Rowwise),
                    )
                }),
            ),
            (
                "fp8 delayed",
                2,
                16,
                Box::new(move || {
                    Box::new(
                        Fp8DelayedScaling::new(e4, 4)
                            .unwrap()
                            .with_scale(2.0)
                            .unwrap(),
                    )
                }),
            ),
            (
                "mxfp8",
                32,
                64,
                Box::new(move || Box::new(Mxfp8Quantizer::new(e4))),
            ),
            (
                "mxfp8 2d swizzled",
                32,
                128,
                Box::new(move || {
                    Box::new(
                        Mxfp8Quantizer::new(e4)
                            .with_2d(true)
                            .with_swizzled_scales(true),
                    )
                }),
            ),
            (
                "nvfp4",
                16,
                32,
                Box::new(|| Box::new(Nvfp4Quantizer::new())),
            ),
            (
                "nvfp4 2d rht swizzled",
                16,
                48,
                Box::new(|| {
                    Box::new(
                        Nvfp4Quantizer::new()
                            .with_2d(true)
                            .with_rht(true)
                            .with_swizzled_scales(true),
                    )
                }),
            ),
            (
                "fp8 block 1d",
                128,
                256,
                Box::new(move || Box::new(Fp8BlockQuantizer::new(e4, BlockDim::OneD))),
            ),
            (
                "fp8 block 2d",
                128,
                128,
                Box::new(move || Box::new(Fp8BlockQuantizer::new(e4, BlockDim::TwoD))),
            ),
        ];
        for (what, rows, cols, make) in &cases {
            check_quantized_gather(
                world,
                *rows,
                *cols,
                make.as_ref(),
                &format!("{what}, world {world}"),
            );
        }
    }
}

#[test]
fn unquantizable_shapes_fall_back_to_high_precision() {
    // 16 rows per rank is not a multiple of MXFP8's 32: gathered in bf16, quantized after.
    let world = 2;
    let whole = values(world * 16 * 32, 5);
    let results = run_ranks(world, |g| -> Result<_> {
        let group = group(g);
        let x = shard(&whole, 16, 32, group.rank());
        let mut q = Mxfp8Quantizer::new(Fp8Format::E4M3);
        gather_along_first_dim(&MaybeQuantized::Plain(x), &group, Some(&mut q))?.into_result()
    })
    .unwrap();
    let full = Tensor::from_slice(&whole, [32, 32], Device::Cpu).unwrap();
    let want = Mxfp8Quantizer::new(Fp8Format::E4M3)
        .quantize(&full)
        .unwrap();
    for res in results {
        let got = res.unwrap();
        let got = got.quantized().unwrap();
        for ((n, a), (_, b)) in got.data_tensors().into_iter().zip(want.data_tensors()) {
            assert_eq!(a.to_bytes().unwrap(), b.to_bytes().unwrap(), "{n}");
        }
    }
}

#[test]
fn ranks_with_different_scales_are_caught() {
    // Delayed scaling with a different scale per rank: the gathered metadata would lie.
    let results = run_ranks(2, |g| -> Result<_> {
        let group = group(g);
        let x = Tensor::from_slice(&[1.0f32; 8], [2, 4], Device::Cpu)?;
        let mut q =
            Fp8DelayedScaling::new(Fp8Format::E4M3, 2)?.with_scale(1.0 + group.rank() as f32)?;
        gather_along_first_dim(&MaybeQuantized::Plain(x), &group, Some(&mut q))?.into_result()
    })
    .unwrap();
    for res in results {
        let err = res.unwrap_err();
        assert!(err.to_string().contains("differs from rank 0"), "{err}");
    }
}

#[test]
fn split_and_gather_1d_handles_uneven_sizes() {
    for world in 1..=5 {
        for n in [1usize, 7, 10, 33] {
            let v: Vec<f32> = (0..n).map(|i| i as f32).collect();
            let results = run_ranks(world, |g| -> Result<_> {
                let t = Tensor::from_slice(&v, [n], Device::Cpu)?;
                let c = split_tensor_into_1d_equal_chunks(&t, &g)?;
                assert_eq!(c.chunk.numel(), n.div_ceil(world));
                gather_split_1d_tensor(&c, &g)?
                    .into_result()?
                    .to_vec::<f32>()
            })
            .unwrap();
            for r in results {
                assert_eq!(r.unwrap(), v);
            }
        }
    }
}

#[test]
fn a_chunk_too_short_for_its_shape_is_a_shape_error() {
    let results = run_ranks(2, |g| -> Result<()> {
        let t = Tensor::from_slice(&[1f32, 2., 3., 4., 5.], [5], Device::Cpu)?;
        let mut c = split_tensor_into_1d_equal_chunks(&t, &g)?;
        assert_eq!(c.chunk.numel(), 3);
        c.chunk = Tensor::zeros([2], DType::F32, Device::Cpu)?;
        let err = gather_split_1d_tensor(&c, &g).unwrap_err();
        assert!(
            matches!(err, Error::Shape { .. }) && err.to_string().contains("ceil(5 / 2)"),
            "{err}"
        );
        Ok(())
    })
    .unwrap();
    for r in results {
        r.unwrap();
    }
}

#[test]
fn bad_input_is_a_typed_error() {
    let results = run_ranks(3, |g| -> Result<()> {
        let x = Tensor::zeros([4, 2], DType::F32, Device::Cpu)?;
        let err = g.reduce_scatter(&x, ReduceOp::Sum).unwrap_err();
        assert!(
            matches!(err, Error::Shape { .. })
                && err
                    .to_string()
                    .contains("not divisible by the world size 3"),
            "{err}"
        );
        let err = g
            .all_reduce(
                Tensor::zeros([2], DType::F8E4M3, Device::Cpu)?,
                ReduceOp::Sum,
            )
            .unwrap_err();
        assert!(matches!(err, Error::DType { .. }), "{err}");
        let err = g.broadcast(x.clone(), 7).unwrap_err();
        assert!(err.to_string().contains("root 7"), "{err}");
        // Mismatched dtypes across ranks: every rank gets an error naming both.
        let t = if g.rank() == 1 {
            Tensor::zeros([2], DType::BF16, Device::Cpu)?
        } else {
            Tensor::zeros([2], DType::F32, Device::Cpu)?
        };
        let err = g.all_gather(&t).unwrap_err();
        assert!(err.to_string().contains("mismatched collectives"), "{err}");
        Ok(())
    })
    .unwrap();
    for r in results {
        r.unwrap();
    }
}

#[test]
fn a_failing_rank_makes_the_others_fail_instead_of_hanging() {
    let results = run_ranks(3, |g| -> Result<Vec<f32>> {
        if g.rank() == 2 {
            return Err(Error::invalid("rank 2", "failed before the collective")); // drops its handle
        }
        let x = Tensor::from_slice(&[1.0f32], [1], Device::Cpu)?;
        g.all_reduce(x, ReduceOp::Sum)?.into_result()?.to_vec()
    })
    .unwrap();
    for (r, res) in results.into_iter().enumerate() {
        let err = res.unwrap_err();
        if r < 2 {
            assert!(err.to_string().contains("left the group"), "{err}");
        }
    }
    // A rank that never arrives hits the timeout.
    let mut groups = ThreadGroup::with_timeout(2, Duration::from_millis(200)).unwrap();
    let _silent = groups.pop().unwrap();
    let g0 = groups.pop().unwrap();
    let err = g0.barrier().unwrap_err();
    assert!(err.to_string().contains("never joined"), "{err}");
    // abort fails the others at once.
    let results = run_ranks(2, |g| -> Result<()> {
        if g.rank() == 0 {
            g.abort("out of memory");
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(20));
        g.barrier()
    })
    .unwrap();
    assert!(
        results[1]
            .as_ref()
            .unwrap_err()
            .to_string()
            .contains("aborted: rank 0: out of memory")
    );
}

#[test]
fn subgroups() {
    let results = run_ranks(4, |g| -> Result<Option<Vec<f32>>> {
        let sub = g.new_subgroup(&[3, 1])?;
        match sub {
            None => Ok(None),
            Some(s) => {
                let x = Tensor::from_slice(&[g.rank() as f32], [1], Device::Cpu)?;
                Ok(Some(s.all_gather(&x)?.into_result()?.to_vec()?))
            }
        }
    })
    .unwrap();
    let r: Vec<_> = results.into_iter().map(|r| r.unwrap()).collect();
    assert_eq!(
        r,
        vec![None, Some(vec![3.0, 1.0]), None, Some(vec![3.0, 1.0])]
    );
}

#[test]
fn uneven_shards_gather_like_the_whole_tensor() {
    let e4 = Fp8Format::E4M3;
    let cases: Vec<(&str, usize, Vec<usize>, MakeQuantizer)> = vec![
        (
            "fp8 current",
            8,
            vec![1, 3, 2],
            Box::new(move || Box::new(Fp8CurrentScaling::new(e4))),
        ),
        (
            "mxfp8",
            64,
            vec![32, 96, 64],
            Box::new(move || Box::new(Mxfp8Quantizer::new(e4))),
        ),
        (
            "mxfp8 2d swizzled",
            64,
            vec![64, 32],
            Box::new(move || {
                Box::new(
                    Mxfp8Quantizer::new(e4)
                        .with_2d(true)
                        .with_swizzled_scales(true),
                )
            }),
        ),
        (
            "nvfp4 rht",
            32,
            vec![16, 48, 32, 16],
            Box::new(|| Box::new(Nvfp4Quantizer::new().with_rht(true))),
        ),
        (
            "fp8 block 1d",
            128,
            vec![128, 256],
            Box::new(move || Box::new(Fp8BlockQuantizer::new(e4, BlockDim::OneD))),
        ),
        (
            "fp8 block 2d",
            128,
            vec![256, 128, 128],
            Box::new(move || Box::new(Fp8BlockQuantizer::new(e4, BlockDim::TwoD))),
        ),
    ];
    for (what, cols, rows, make) in &cases {
        let world = rows.len();
        let total: usize = rows.iter().sum();
        let whole = values(total * cols, 42);
        let starts: Vec<usize> = rows
            .iter()
            .scan(0, |s, &r| {
                let at = *s;
                *s += r;
                Some(at)
            })
            .collect();
        let results = run_ranks(world, |g| -> Result<_> {
            let r = g.rank();
            let group = group(g);
            let x = Tensor::from_slice(
                &whole[starts[r] * cols..][..rows[r] * cols],
                [rows[r], *cols],
                Device::Cpu,
            )?;
            let mut q = make();
            tessera_collectives::gather_along_first_dim_uneven(
                &MaybeQuantized::Plain(x.clone()),
                &group,
                Some(q.as_mut()),
                rows,
            )?
            .into_result()
            .and_then(|qt| {
                Ok((
                    qt,
                    tessera_collectives::gather_along_first_dim_uneven(
                        &MaybeQuantized::Plain(x),
                        &group,
                        None,
                        rows,
                    )?
                    .into_result()?,
                ))
            })
        })
        .unwrap();
        let full = Tensor::from_slice(&whole, [total, *cols], Device::Cpu).unwrap();
        let want = make().quantize(&full).unwrap();
        for (r, res) in results.into_iter().enumerate() {
            let (got, plain) = res.unwrap_or_else(|e| panic!("{what}: rank {r}: {e}"));
            assert_eq!(
                plain.to_plain().unwrap().to_vec::<f32>().unwrap(),
                whole,
                "{what}: plain gather"
            );
            let got = got.quantized().unwrap();
            for ((n, a), (_, b)) in got.data_tensors().into_iter().zip(want.data_tensors()) {
                assert_eq!(
                    a.to_bytes().unwrap(),
                    b.to_bytes().unwrap(),
                    "{what}: rank {r} buffer {n}"
                );
            }
        }
    }
}

#[test]
fn successive_subgroups_agree_on_every_rank() {
    // Hybrid sharding builds several subgroups in a row; every rank must land in the same
    // ones (regression: the key was read before the exchange and could differ).
    for _ in 0..20 {
        let results = run_ranks(4, |g| -> Result<Vec<f32>> {
            let a = g.new_subgroup(&[0, 1])?;
            let b = g.new_subgroup(&[2, 3])?;
            let c = g.new_subgroup(&[0, 2])?;
            let d = g.new_subgroup(&[1, 3])?;
            let mut out = Vec::new();
            for s in [a, b, c, d].into_iter().flatten() {
                let x = Tensor::from_slice(&[g.rank() as f32], [1], Device::Cpu)?;
                out.extend(
                    s.all_reduce(x, ReduceOp::Sum)?
                        .into_result()?
                        .to_vec::<f32>()?,
                );
            }
            Ok(out)
        })
        .unwrap();
        let r: Vec<_> = results.into_iter().map(|r| r.unwrap()).collect();
        assert_eq!(
            r,
            vec![
                vec![1.0, 2.0],
                vec![1.0, 4.0],
                vec![5.0, 2.0],
                vec![5.0, 4.0]
            ]
        );
    }
}
