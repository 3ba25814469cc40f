//! Quantized weight gathers (bytes moved, equality with quantizing the whole weight on
//! one rank, training) and the low-precision gradient reduce-scatter.

use std::sync::Arc;

use tessera_collectives::{ProcessGroup, ReduceOp, run_ranks};
use tessera_core::{DType, Device, Result, Tensor, bf16};
use tessera_fsdp::mlp::{Activations, MlpSpec, batch, rows, train_step};
use tessera_fsdp::{
    CountingGroup, Fsdp, FsdpConfig, GradReduce, LowPrecision, WeightFormat, Wire,
    reduce_scatter_low_precision,
};
use tessera_quant::Fp8Format;
use tessera_rng::Generator;

/// Bytes each rank contributes to one unshard of every unit, in `format`.
fn unshard_bytes(world: usize, spec: MlpSpec, format: WeightFormat, param_dtype: DType) -> u64 {
    let out = run_ranks(world, |g| -> Result<u64> {
        let counted = Arc::new(CountingGroup::new(Arc::new(g)));
        let config = FsdpConfig::default()
            .weight_format(format)
            .mixed_precision(param_dtype, DType::F32);
        let mut fsdp = Fsdp::new(counted.clone(), config)?;
        spec.build(&mut fsdp)?;
        assert!(fsdp.all_params().all(|p| p.wire()
            == if format == WeightFormat::HighPrecision {
                Wire::HighPrecision
            } else {
                Wire::Quantized
            }));
        for u in 0..fsdp.num_units() {
            fsdp.full_params(u)?;
        }
        let c = counted.counts();
        Ok(c.total().bytes)
    })
    .unwrap();
    let v: Vec<u64> = out.into_iter().map(Result::unwrap).collect();
    assert!(v.iter().all(|&b| b == v[0]));
    v[0]
}

#[test]
fn quantized_gathers_move_the_expected_fraction_of_bf16_bytes() {
    let spec = MlpSpec {
        d_model: 128,
        d_ffn: 256,
        layers: 2,
        seed: 1,
    };
    for world in [2, 4] {
        let bf16 = unshard_bytes(world, spec, WeightFormat::HighPrecision, DType::BF16) as f64;
        // f32 moves twice the bf16 bytes exactly.
        assert_eq!(
            unshard_bytes(world, spec, WeightFormat::HighPrecision, DType::F32) as f64,
            2.0 * bf16
        );
        for (format, lo, hi) in [
            (WeightFormat::Fp8, 0.500, 0.502), // 1 byte/value + scale and amax
            (WeightFormat::Mxfp8, 0.515, 0.517), // (1 + 1/32) / 2
            (WeightFormat::Nvfp4, 0.281, 0.283), // (1/2 + 1/16) / 2 + amax
        ] {
            let ratio = unshard_bytes(world, spec, format, DType::F32) as f64 / bf16;
            assert!(
                (lo..=hi).contains(&ratio),
                "world {world} {format}: {ratio:.4} of bf16"
            );
        }
    }
    // FP8 block scaling needs shards of 128 rows.
    let spec = MlpSpec {
        d_model: 256,
        d_ffn: 256,
        layers: 1,
        seed: 2,
    };
    let bf16 = unshard_bytes(2, spec, WeightFormat::HighPrecision, DType::BF16) as f64;
    let ratio = unshard_bytes(2, spec, WeightFormat::Fp8Block, DType::F32) as f64 / bf16;
    assert!((0.515..=0.517).contains(&ratio), "fp8-block: {ratio:.4}");
}

#[test]
fn quantized_gathers_equal_quantizing_the_whole_weight_on_one_rank() {
    let cases = [
        (
            WeightFormat::Fp8,
            4,
            MlpSpec {
                d_model: 64,
                d_ffn: 96,
                layers: 1,
                seed: 3,
            },
        ),
        (
            WeightFormat::Fp8,
            3,
            MlpSpec {
                d_model: 40,
                d_ffn: 48,
                layers: 1,
                seed: 3,
            },
        ),
        (
            WeightFormat::Mxfp8,
            4,
            MlpSpec {
                d_model: 128,
                d_ffn: 64,
                layers: 1,
                seed: 4,
            },
        ),
        (
            WeightFormat::Mxfp8,
            3,
            MlpSpec {
                d_model: 64,
                d_ffn: 96,
                layers: 1,
                seed: 4,
            },
        ), // padded
        (
            WeightFormat::Nvfp4,
            4,
            MlpSpec {
                d_model: 64,
                d_ffn: 128,
                layers: 1,
                seed: 5,
            },
        ),
        (
            WeightFormat::Nvfp4,
            8,
            MlpSpec {
                d_model: 32,
                d_ffn: 64,
                layers: 1,
                seed: 5,
            },
        ), // padded
        (
            WeightFormat::Fp8Block,
            2,
            MlpSpec {
                d_model: 256,
                d_ffn: 128,
                layers: 1,
                seed: 6,
            },
        ),
    ];
    for (format, world, spec) in cases {
        for param_dtype in [DType::F32, DType::BF16] {
            let whole: Vec<(String, Tensor)> = spec.init().unwrap().into_iter().flatten().collect();
            let want: Vec<Vec<u8>> = whole
                .iter()
                .map(|(_, t)| {
                    let src = if param_dtype == DType::BF16 {
                        to_bf16(t)
                    } else {
                        t.clone()
                    };
                    let q = format.quantizer().unwrap().quantize(&src).unwrap();
                    q.dequantize(DType::F32).unwrap().to_bytes().unwrap()
                })
                .collect();
            let got = run_ranks(world, |g| -> Result<Vec<Vec<u8>>> {
                let config = FsdpConfig::default()
                    .weight_format(format)
                    .mixed_precision(param_dtype, DType::F32);
                let mut fsdp = Fsdp::new(Arc::new(g), config)?;
                spec.build(&mut fsdp)?;
                assert!(fsdp.all_params().all(|p| p.wire() == Wire::Quantized));
                fsdp.full_params(0)?
                    .iter()
                    .map(|p| p.tensor.to_bytes())
                    .collect()
            })
            .unwrap();
            for (r, g) in got.into_iter().enumerate() {
                assert_eq!(
                    g.unwrap(),
                    want,
                    "{format} world {world} rank {r} {param_dtype}"
                );
            }
        }
    }
}

fn to_bf16(t: &Tensor) -> Tensor {
    Tensor::from_f32_values(
        t.as_slice::<f32>().unwrap(),
        t.shape(),
        DType::BF16,
        Device::Cpu,
    )
    .unwrap()
}

type Run = (Vec<f64>, Vec<(String, Tensor)>);

fn train(
    world: usize,
    spec: MlpSpec,
    x: &Tensor,
    tokens: usize,
    config: FsdpConfig,
    mode: Activations,
    steps: usize,
) -> Vec<Run> {
    run_ranks(world, |g| -> Result<Run> {
        let r = g.rank();
        let mut fsdp = Fsdp::new(Arc::new(g), config)?;
        spec.build(&mut fsdp)?;
        let mine = rows(x, r * tokens..(r + 1) * tokens)?;
        let losses = (0..steps)
            .map(|_| Ok(train_step(&mut fsdp, &mine, 0.5, mode)?.loss))
            .collect::<Result<Vec<_>>>()?;
        Ok((losses, fsdp.gather_full_parameters()?))
    })
    .unwrap()
    .into_iter()
    .map(Result::unwrap)
    .collect()
}

#[test]
fn training_with_quantized_gathers_equals_quantizing_whole_weights() {
    let spec = MlpSpec {
        d_model: 64,
        d_ffn: 128,
        layers: 2,
        seed: 8,
    };
    let (world, tokens, steps) = (4, 4, 3);
    let x = batch(world * tokens, spec.d_model, 77).unwrap();
    let hp = train(
        world,
        spec,
        &x,
        tokens,
        FsdpConfig::default(),
        Activations::Keep,
        steps,
    );
    for format in [WeightFormat::Fp8, WeightFormat::Mxfp8, WeightFormat::Nvfp4] {
        let reference = train(
            world,
            spec,
            &x,
            tokens,
            FsdpConfig::default()
                .weight_format(format)
                .quantize_after_gather(true),
            Activations::Keep,
            steps,
        );
        // Quantized weights kept for the backward through activation scattering: every
        // buffer of every quantized weight is split over the ranks and gathered back.
        for mode in [Activations::Keep, Activations::ScatterWeights] {
            let got = train(
                world,
                spec,
                &x,
                tokens,
                FsdpConfig::default().weight_format(format),
                mode,
                steps,
            );
            for (r, (a, b)) in reference.iter().zip(&got).enumerate() {
                assert_eq!(a.0, b.0, "{format} {mode:?} rank {r}: losses");
                for ((n, x), (_, y)) in a.1.iter().zip(&b.1) {
                    assert_eq!(
                        x.to_bytes().unwrap(),
                        y.to_bytes().unwrap(),
                        "{format} {mode:?} rank {r} {n}"
                    );
                }
            }
        }
        assert!(
            reference[0].0[steps - 1] < reference[0].0[0],
            "{format}: the loss did not fall"
        );
        // The weights really were quantized: the losses are not the high-precision ones.
        assert_ne!(reference[0].0, hp[0].0, "{format}");
    }
}

#[test]
fn shapes_that_cannot_travel_quantized_fall_back() {
    // MXFP8 needs 32-element blocks along K: 24 columns cannot be quantized at all; a
    // rank-1 parameter (a bias, a norm weight) is no GEMM operand and stays in high
    // precision in every format.
    let out = run_ranks(2, |g| -> Result<Vec<Wire>> {
        let mut wires = Vec::new();
        let group: Arc<dyn ProcessGroup> = Arc::new(g);
        for format in [WeightFormat::Mxfp8, WeightFormat::Fp8] {
            let mut fsdp = Fsdp::new(group.clone(), FsdpConfig::default().weight_format(format))?;
            fsdp.add_unit(
                "u",
                vec![
                    (
                        "w".into(),
                        Tensor::from_slice(&[0.5f32; 64 * 24], [64, 24], Device::Cpu)?,
                    ),
                    (
                        "b".into(),
                        Tensor::from_slice(&[0.25f32; 64], [64], Device::Cpu)?,
                    ),
                ],
            )?;
            let full = fsdp.full_params(0)?;
            assert_eq!(full[0].tensor.to_vec::<f32>()?, vec![0.5; 64 * 24]);
            assert_eq!(full[1].tensor.to_vec::<f32>()?, vec![0.25; 64]);
            wires.extend(fsdp.all_params().map(|p| p.wire()));
        }
        Ok(wires)
    })
    .unwrap();
    for w in out {
        assert_eq!(
            w.unwrap(),
            [
                Wire::HighPrecision,
                Wire::HighPrecision,
                Wire::Quantized,
                Wire::HighPrecision
            ]
        );
    }
}

fn gradients(world: usize, rows_per_rank: usize, cols: usize, seed: u64) -> Vec<Vec<f32>> {
    (0..world)
        .map(|r| {
            let mut v = vec![0f32; world * rows_per_rank * cols];
            Generator::new(seed + r as u64).fill_normal(&mut v, 0.0, 1.0 + r as f32);
            v
        })
        .collect()
}

#[test]
fn low_precision_reduce_scatter_accumulates_in_f32_deterministically() {
    let (rows_per_rank, cols) = (3, 40);
    for world in 1..=8 {
        let grads = gradients(world, rows_per_rank, cols, 1000 * world as u64);
        let n = rows_per_rank * cols;
        // The exact sum, in f64.
        let exact: Vec<f64> = (0..world * n)
            .map(|i| grads.iter().map(|g| f64::from(g[i])).sum())
            .collect();
        let results = run_ranks(world, |g| -> Result<_> {
            let r = g.rank();
            let counted = Arc::new(CountingGroup::new(Arc::new(g)));
            let x = Tensor::from_slice(&grads[r], [world * rows_per_rank, cols], Device::Cpu)?;
            let mut out = Vec::new();
            for f in [
                LowPrecision::Fp8(Fp8Format::E4M3),
                LowPrecision::Fp8(Fp8Format::E5M2),
                LowPrecision::Bf16,
            ] {
                counted.reset();
                let a = reduce_scatter_low_precision(&x, &*counted, f)?;
                let bytes = counted.counts().all_gather.bytes;
                let b = reduce_scatter_low_precision(&x, &*counted, f)?;
                assert_eq!(a.to_bytes()?, b.to_bytes()?, "not deterministic");
                out.push((a.to_vec::<f32>()?, bytes));
            }
            let native = counted
                .reduce_scatter(
                    &Tensor::from_f32_values(
                        &grads[r],
                        [world * rows_per_rank, cols],
                        DType::BF16,
                        Device::Cpu,
                    )?,
                    ReduceOp::Sum,
                )?
                .into_result()?
                .to_vec::<bf16>()?
                .into_iter()
                .map(f32::from)
                .collect::<Vec<_>>();
            Ok((out, native))
        })
        .unwrap();
        let mut err = [0f64; 4];
        for (r, res) in results.into_iter().enumerate() {
            let (out, native) = res.unwrap();
            let want = &exact[r * n..(r + 1) * n];
            let scale = want.iter().fold(0f64, |m, v| m.max(v.abs()));
            for (k, (v, bytes)) in out.iter().enumerate() {
                let e = v
                    .iter()
                    .zip(want)
                    .map(|(a, b)| (f64::from(*a) - b).abs())
                    .fold(0f64, f64::max);
                err[k] = err[k].max(e);
                // FP8: per-rank rounding of 2^-4 (E4M3) or 2^-3 (E5M2) relative to each
                // rank's amax; bf16: 2^-9.
                let bound = [0.07, 0.13, 0.004][k] * scale * world as f64;
                assert!(
                    e <= bound,
                    "world {world} rank {r} format {k}: error {e} > {bound}"
                );
                let per = (world * n) as u64;
                // FP8: a byte per element and an f32 scale per chunk; bf16: 2 bytes.
                let want_bytes = [per + world as u64 * 4, per + world as u64 * 4, 2 * per][k];
                assert_eq!(*bytes, want_bytes, "world {world} format {k}: bytes");
            }
            let e = native
                .iter()
                .zip(want)
                .map(|(a, b)| (f64::from(*a) - b).abs())
                .fold(0f64, f64::max);
            err[3] = err[3].max(e);
        }
        if world >= 4 {
            // f32 accumulation of bf16 values beats a reduction that rounds to bf16 at
            // every step.
            assert!(
                err[2] < err[3],
                "world {world}: bf16 with f32 accumulation {} vs native bf16 {}",
                err[2],
                err[3]
            );
        }
    }
}

#[test]
fn training_with_low_precision_gradients_stays_close_to_f32() {
    let spec = MlpSpec {
        d_model: 32,
        d_ffn: 64,
        layers: 2,
        seed: 9,
    };
    let (world, tokens, steps) = (4, 3, 3);
    let x = batch(world * tokens, spec.d_model, 13).unwrap();
    let f32_run = train(
        world,
        spec,
        &x,
        tokens,
        FsdpConfig::default(),
        Activations::Keep,
        steps,
    );
    for (f, tol) in [
        (LowPrecision::Bf16, 1e-3),
        (LowPrecision::Fp8(Fp8Format::E5M2), 5e-2),
        (LowPrecision::Fp8(Fp8Format::E4M3), 3e-2),
    ] {
        let run = train(
            world,
            spec,
            &x,
            tokens,
            FsdpConfig::default().grad_reduce(GradReduce::LowPrecision(f)),
            Activations::Keep,
            steps,
        );
        for (a, b) in f32_run.iter().zip(&run) {
            for (la, lb) in a.0.iter().zip(&b.0) {
                assert!(
                    (la - lb).abs() / la < tol,
                    "{}: loss {lb} vs {la}",
                    f.name()
                );
            }
        }
    }
    // Bad input is a typed error, before any communication.
    run_ranks(2, |g| -> Result<()> {
        let e = reduce_scatter_low_precision(
            &Tensor::zeros([3, 2], DType::F32, Device::Cpu)?,
            &g,
            LowPrecision::Bf16,
        )
        .unwrap_err();
        assert!(e.to_string().contains("not divisible"), "{e}");
        let e = reduce_scatter_low_precision(
            &Tensor::zeros([4, 2], DType::BF16, Device::Cpu)?,
            &g,
            LowPrecision::Bf16,
        )
        .unwrap_err();
        assert!(matches!(e, tessera_core::Error::DType { .. }), "{e}");
        Ok(())
    })
    .unwrap()
    .into_iter()
    .for_each(Result::unwrap);
}
