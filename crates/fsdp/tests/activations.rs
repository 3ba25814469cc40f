//! Activation sharding (TE's `_fsdp_scatter_tensors` / `_fsdp_gather_tensors`) at world
//! sizes 1..8: round trips of plain tensors and every buffer of every quantized format,
//! mismatched shape lists, non-replicated tensors, checkpointed modules.

use std::sync::Arc;

use proptest::prelude::*;
use tessera_checkpoint::{Checkpoint, Recompute, Saved, Saver, exactly};
use tessera_collectives::{MaybeQuantized, ProcessGroup, run_ranks};
use tessera_core::{DType, Device, Error, Result, Tensor, bf16};
use tessera_fsdp::{
    SavedActivations, SavedShape, Scattered, fsdp_gather_tensors, fsdp_scatter_tensors,
};
use tessera_quant::{
    BlockDim, Fp8BlockQuantizer, Fp8CurrentScaling, Fp8Format, Mxfp8Quantizer, Nvfp4Quantizer,
    Quantizer,
};
use tessera_rng::Generator;

fn normal(shape: [usize; 2], seed: u64) -> Tensor {
    let mut v = vec![0f32; shape[0] * shape[1]];
    Generator::new(seed).fill_normal(&mut v, 0.0, 2.0);
    Tensor::from_slice(&v, shape, Device::Cpu).unwrap()
}

/// A layer's saved tensors: plain f32 and bf16, `None`, and a quantized tensor of every
/// format with both usages (every buffer kind: data, scales, transposes, amaxes).
fn saved_tensors(seed: u64) -> Vec<Option<MaybeQuantized>> {
    let q = |mut q: Box<dyn Quantizer>, shape: [usize; 2], s: u64| {
        Some(MaybeQuantized::Quantized(
            q.quantize(&normal(shape, seed + s)).unwrap(),
        ))
    };
    let b: Vec<bf16> = (0..7).map(|i| bf16::from_f32(i as f32 - 3.0)).collect();
    vec![
        Some(MaybeQuantized::Plain(normal([5, 7], seed))),
        None,
        Some(MaybeQuantized::Plain(
            Tensor::from_slice(&b, [7], Device::Cpu).unwrap(),
        )),
        q(
            Box::new(Fp8CurrentScaling::new(Fp8Format::E4M3)),
            [32, 48],
            1,
        ),
        q(Box::new(Mxfp8Quantizer::new(Fp8Format::E5M2)), [64, 32], 2),
        q(
            Box::new(
                Mxfp8Quantizer::new(Fp8Format::E4M3)
                    .with_2d(true)
                    .with_swizzled_scales(true),
            ),
            [32, 64],
            3,
        ),
        q(Box::new(Nvfp4Quantizer::new().with_rht(true)), [32, 48], 4),
        q(
            Box::new(Fp8BlockQuantizer::new(Fp8Format::E4M3, BlockDim::OneD)),
            [128, 256],
            5,
        ),
        q(
            Box::new(Fp8BlockQuantizer::new(Fp8Format::E4M3, BlockDim::TwoD)),
            [130, 64],
            6,
        ),
        None,
    ]
}

fn all_buffers(t: &Option<MaybeQuantized>) -> Vec<(String, Vec<u8>)> {
    match t {
        None => Vec::new(),
        Some(MaybeQuantized::Plain(t)) => {
            vec![(format!("plain {}", t.shape()), t.to_bytes().unwrap())]
        }
        Some(MaybeQuantized::Quantized(q)) => q
            .data_tensors()
            .into_iter()
            .map(|(n, t)| {
                (
                    format!("{:?} {n} {}", q.kind(), t.shape()),
                    t.to_bytes().unwrap(),
                )
            })
            .collect(),
    }
}

fn total_bytes(ts: &[Option<MaybeQuantized>]) -> usize {
    ts.iter()
        .flatten()
        .map(|t| match t {
            MaybeQuantized::Plain(t) => t.size_in_bytes(),
            MaybeQuantized::Quantized(q) => q.size_in_bytes(),
        })
        .sum()
}

#[test]
fn scatter_then_gather_round_trips_every_buffer_at_world_sizes_1_to_8() {
    let original = saved_tensors(42);
    let n_buffers: usize = original.iter().map(|t| all_buffers(t).len()).sum();
    assert!(n_buffers >= 20, "{n_buffers}");
    let whole = total_bytes(&original);
    for world in 1..=8 {
        let out = run_ranks(world, |g| -> Result<_> {
            let group: Arc<dyn ProcessGroup> = Arc::new(g);
            let tensors = saved_tensors(42);
            let saved = SavedActivations::save(tensors, Some(&group), false)?;
            assert_eq!(saved.is_sharded(), world > 1);
            let held = saved.held_bytes();
            Ok((held, saved.restore()?))
        })
        .unwrap();
        for (r, o) in out.into_iter().enumerate() {
            let (held, back) = o.unwrap();
            // Each rank keeps 1/N of every buffer (plus at most one element of padding).
            assert!(
                held * world >= whole && held * world <= whole + world * 4 * 40,
                "world {world}: held {held} of {whole}"
            );
            assert_eq!(back.len(), original.len());
            for (a, b) in original.iter().zip(&back) {
                assert_eq!(all_buffers(a), all_buffers(b), "world {world} rank {r}");
                if let (Some(MaybeQuantized::Quantized(a)), Some(MaybeQuantized::Quantized(b))) =
                    (a, b)
                {
                    assert_eq!(
                        (a.kind(), a.shape(), a.source_dtype()),
                        (b.kind(), b.shape(), b.source_dtype())
                    );
                    assert_eq!(
                        a.dequantize(DType::F32).unwrap().to_bytes().unwrap(),
                        b.dequantize(DType::F32).unwrap().to_bytes().unwrap()
                    );
                }
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(16))]

    #[test]
    fn any_shape_round_trips(world in 1usize..=8, rows in 0usize..9, cols in 1usize..11, seed: u64) {
        let out = run_ranks(world, |g| -> Result<_> {
            let t = normal([rows, cols], seed);
            let (chunks, shapes) = fsdp_scatter_tensors(&g, vec![Some(MaybeQuantized::Plain(t))])?;
            if let Some(Scattered::Plain(c)) = &chunks[0] {
                assert_eq!(c.numel(), (rows * cols).div_ceil(world));
            }
            let back = fsdp_gather_tensors(&g, &shapes, chunks)?;
            back[0].as_ref().unwrap().to_plain()?.to_bytes()
        }).unwrap();
        let want = normal([rows, cols], seed).to_bytes().unwrap();
        for o in out {
            prop_assert_eq!(o.unwrap(), want.clone());
        }
    }
}

#[test]
fn a_shape_list_that_does_not_match_is_a_typed_error() {
    run_ranks(3, |g| -> Result<()> {
        let (chunks, shapes) = fsdp_scatter_tensors(&g, saved_tensors(1))?;
        // Wrong length.
        let e = fsdp_gather_tensors(&g, &shapes[1..], chunks.clone()).unwrap_err();
        assert!(
            matches!(e, Error::InvalidArgument { .. }) && e.to_string().contains("recorded shapes"),
            "{e}"
        );
        // A shape where there is no tensor, and the reverse.
        let mut s = shapes.clone();
        s.swap(0, 1);
        let e = fsdp_gather_tensors(&g, &s, chunks.clone()).unwrap_err();
        assert!(
            e.to_string().contains(
                "tensor 0: the shape list records nothing but the tensor list holds a plain tensor"
            ),
            "{e}"
        );
        // Plain where the tensor is quantized.
        let mut s = shapes.clone();
        s.swap(2, 3);
        let e = fsdp_gather_tensors(&g, &s, chunks.clone()).unwrap_err();
        assert!(e.to_string().contains("tensor 2"), "{e}");
        // Shapes of other tensors (a chunk length that does not fit).
        let (other_chunks, _) =
            fsdp_scatter_tensors(&g, vec![Some(MaybeQuantized::Plain(normal([4, 4], 0)))])?;
        let e = fsdp_gather_tensors(&g, &shapes[..1], other_chunks).unwrap_err();
        assert!(matches!(e, Error::Shape { .. }), "{e}");
        // A quantized tensor's buffer list that differs.
        let mut s = shapes.clone();
        if let Some(SavedShape::Quantized(b)) = &mut s[3] {
            b.pop();
        }
        let e = fsdp_gather_tensors(&g, &s, chunks.clone()).unwrap_err();
        assert!(e.to_string().contains("recorded buffers"), "{e}");
        // The matching list still works afterwards (nothing was communicated above).
        let back = fsdp_gather_tensors(&g, &shapes, chunks)?;
        assert_eq!(back.len(), shapes.len());
        Ok(())
    })
    .unwrap()
    .into_iter()
    .for_each(Result::unwrap);
}

#[test]
fn tensors_that_differ_between_ranks_are_an_error_not_a_mix() {
    let out = run_ranks(4, |g| -> Result<Error> {
        let group: Arc<dyn ProcessGroup> = Arc::new(g);
        let mine = normal([6, 6], group.rank() as u64); // per-rank data
        let saved =
            SavedActivations::save(vec![Some(MaybeQuantized::Plain(mine))], Some(&group), false)?;
        Ok(saved.restore().unwrap_err())
    })
    .unwrap();
    for e in out {
        let e = e.unwrap();
        assert!(
            matches!(e, Error::State { .. }) && e.to_string().contains("same on every rank"),
            "{e}"
        );
    }
}

/// A layer that keeps its input through [`SavedActivations::save_for`].
struct Layer {
    group: Arc<dyn ProcessGroup>,
    sharded: Vec<bool>,
}

impl Recompute for Layer {
    fn forward(&mut self, inputs: &[Tensor], saver: &mut Saver) -> Result<Vec<Tensor>> {
        let [x] = exactly("Layer", inputs)?;
        let kept = SavedActivations::save_for(
            saver,
            vec![Some(MaybeQuantized::Plain(x.clone()))],
            Some(&self.group),
        )?;
        self.sharded.push(kept.is_sharded());
        let back = kept.restore()?;
        saver.save(x);
        Ok(vec![back[0].as_ref().unwrap().to_plain()?])
    }

    fn backward(saved: &mut Saved<'_, Self>, grads: &[Tensor]) -> Result<Vec<Tensor>> {
        saved.take(0)?;
        Ok(grads.to_vec())
    }
}

#[test]
fn checkpointed_modules_skip_activation_sharding() {
    let out = run_ranks(2, |g| -> Result<Vec<bool>> {
        let group: Arc<dyn ProcessGroup> = Arc::new(g);
        let x = normal([4, 4], 5);
        let mut layer = Layer {
            group: group.clone(),
            sharded: Vec::new(),
        };
        for ckpt in [Checkpoint::off(), Checkpoint::reentrant()] {
            let (_, mut frame) = ckpt.forward(&mut layer, std::slice::from_ref(&x))?;
            frame.backward(&mut layer, std::slice::from_ref(&x))?;
        }
        // Without a group, or with a group of one, nothing is sharded either.
        assert!(!SavedActivations::save(vec![None], None, false)?.is_sharded());
        Ok(layer.sharded)
    })
    .unwrap();
    for o in out {
        // off: sharded; reentrant forward and recompute: skipped.
        assert_eq!(o.unwrap(), [true, false, false]);
    }
}
