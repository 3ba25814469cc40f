//! Properties of the CPU reference: stream splitting, distributions, the tracker's
//! fork/restore semantics, snapshots, and the errors for bad input.

use std::panic::{AssertUnwindSafe, catch_unwind};

use half::{bf16, f16};
use proptest::prelude::*;
use tessera_core::{DType, Device, Error, Parameter, Replay, Tensor};
use tessera_rng::stream::{self, Par};
use tessera_rng::tp::{self, AffineInit, MODEL_PARALLEL_RNG, ParallelSeeds};
use tessera_rng::{
    CurrentGenerator, Generator, GeneratorState, RngTracker, get_rng_state, manual_seed,
    philox4x32_10, set_rng_state, with_current_generator,
};

/// The words of a request straight from the spec's formula, one Philox call per word.
fn spec_words(seed: u64, offset: u64, n: usize) -> Vec<u32> {
    (0..n as u64)
        .map(|i| {
            let block = offset / 4 + i / 4;
            philox4x32_10(
                [block as u32, (block >> 32) as u32, 0, 0],
                [seed as u32, (seed >> 32) as u32],
            )[(i % 4) as usize]
        })
        .collect()
}

fn words(g: &mut Generator, n: usize) -> Vec<u32> {
    let mut v = vec![0; n];
    g.fill_u32(&mut v);
    v
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn words_follow_the_spec_formula(seed: u64, block in any::<u64>(), n in 0usize..300) {
        let offset = block.wrapping_mul(4);
        let mut g = Generator::from_state(GeneratorState { seed, offset }).unwrap();
        prop_assert_eq!(words(&mut g, n), spec_words(seed, offset, n));
        prop_assert_eq!(g.offset(), offset.wrapping_add(4 * (n as u64).div_ceil(4)));
    }

    #[test]
    fn a_fill_split_anywhere_gives_the_same_words(seed: u64, n in 0usize..2000, cut in 0usize..2000) {
        let cut = cut.min(n);
        let whole = words(&mut Generator::new(seed), n);
        let mut g = Generator::new(seed);
        let head = words(&mut g, cut);
        prop_assert_eq!(&head[..], &whole[..cut]);
        // The second fill starts at the next whole block (spec: offsets advance by
        // 4 * ceil(n / 4)), so it continues the stream exactly when the cut is a
        // multiple of 4, and skips the rest of the cut block otherwise.
        let resume = cut.next_multiple_of(4);
        let tail = words(&mut g, n - cut);
        let expect = spec_words(seed, resume as u64, n - cut);
        prop_assert_eq!(&tail, &expect);
        if cut % 4 == 0 {
            prop_assert_eq!([head, tail].concat(), whole);
        }
    }

    #[test]
    fn sequential_and_rayon_fills_agree(seed: u64, block in 0u64..1 << 40, n in 0usize..40_000) {
        let offset = block * 4;
        let (mut a, mut b) = (vec![0f32; n], vec![0f32; n]);
        stream::fill_uniform(seed, offset, &mut a, Par::Seq);
        stream::fill_uniform(seed, offset, &mut b, Par::Rayon);
        prop_assert_eq!(&a, &b);
        stream::fill_normal(seed, offset, &mut a, 0.5, 2.0, Par::Seq);
        stream::fill_normal(seed, offset, &mut b, 0.5, 2.0, Par::Rayon);
        prop_assert_eq!(bits(&a), bits(&b));
        let input: Vec<bf16> = (0..n).map(|i| bf16::from_f32(i as f32 - 7.5)).collect();
        let (mut oa, mut ob) = (vec![bf16::ZERO; n], vec![bf16::ZERO; n]);
        let (mut ma, mut mb) = (vec![0u8; n], vec![0u8; n]);
        stream::dropout(seed, offset, 0.3, &input, &mut oa, &mut ma, Par::Seq);
        stream::dropout(seed, offset, 0.3, &input, &mut ob, &mut mb, Par::Rayon);
        prop_assert_eq!(ma, mb);
        prop_assert_eq!(oa, ob);
    }

    #[test]
    fn distributions_are_functions_of_the_words(seed: u64, n in 1usize..500, p in 0f32..=1.0) {
        let w = words(&mut Generator::new(seed), n);
        let mut u = vec![0f32; n];
        Generator::new(seed).fill_uniform(&mut u);
        for (&u, &w) in u.iter().zip(&w) {
            prop_assert_eq!(u, (w >> 8) as f32 / 16_777_216.0);
            prop_assert!((0.0..1.0).contains(&u));
        }
        let input: Vec<f32> = (0..n).map(|i| i as f32 * 0.25 - 3.0).collect();
        let (mut out, mut mask) = (vec![0f32; n], vec![0u8; n]);
        Generator::new(seed).dropout(&input, p, &mut out, &mut mask).unwrap();
        let scale = if p < 1.0 { 1.0 / (1.0 - p) } else { 1.0 };
        for i in 0..n {
            let keep = u[i] >= p;
            prop_assert_eq!(mask[i], keep as u8);
            prop_assert_eq!(out[i].to_bits(), if keep { (input[i] * scale).to_bits() } else { 0 });
        }
        let mut z = vec![0f32; n];
        Generator::new(seed).fill_normal(&mut z, 0.0, 1.0);
        for j in 0..n / 2 {
            let (z0, z1) = stream::normal_pair_from_words(w[2 * j], w[2 * j + 1]);
            prop_assert_eq!((z[2 * j], z[2 * j + 1]), (z0, z1));
        }
    }

    #[test]
    fn snapshots_replay_identical_numbers(seed: u64, skip in 0usize..100, n in 1usize..100) {
        let mut g = Generator::new(seed);
        words(&mut g, skip);
        let snap = g.snapshot();
        let first = words(&mut g, n);
        words(&mut g, 17);
        g.restore(&snap).unwrap();
        prop_assert_eq!(words(&mut g, n), first);
    }
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn dropout_keeps_the_expected_fraction() {
    let n = 200_000;
    let input = vec![1.0f32; n];
    let (mut out, mut mask) = (vec![0f32; n], vec![0u8; n]);
    let mut g = Generator::new(7);
    for p in [0.0f32, 0.1, 0.5, 0.9, 1.0] {
        g.dropout(&input, p, &mut out, &mut mask).unwrap();
        let kept = mask.iter().filter(|&&m| m == 1).count() as f64;
        let q = 1.0 - f64::from(p);
        let sigma = (n as f64 * q * (1.0 - q)).sqrt();
        // 6 sigma: a false failure has probability ~1e-9.
        assert!(
            (kept - n as f64 * q).abs() <= 6.0 * sigma + 1e-9,
            "p = {p}: kept {kept} of {n}, expected {} ± {}",
            n as f64 * q,
            6.0 * sigma
        );
        let mean: f64 = out.iter().map(|&x| f64::from(x)).sum::<f64>() / n as f64;
        if p < 1.0 {
            // E[out] = 1 for inverted dropout; the sum is (kept / n) / q.
            assert!(
                (mean - kept / n as f64 / q).abs() < 1e-4,
                "p = {p}: mean {mean}"
            );
        } else {
            assert_eq!(mean, 0.0);
        }
    }
}

#[test]
fn normals_have_unit_variance() {
    let n = 400_000;
    let mut z = vec![0f32; n];
    Generator::new(11).fill_normal(&mut z, 0.0, 1.0);
    let mean = z.iter().map(|&x| f64::from(x)).sum::<f64>() / n as f64;
    let var = z
        .iter()
        .map(|&x| (f64::from(x) - mean).powi(2))
        .sum::<f64>()
        / n as f64;
    // Standard errors: 1/sqrt(n) = 0.0016 for the mean, sqrt(2/n) = 0.0022 for the variance.
    assert!(mean.abs() < 0.01, "mean {mean}");
    assert!((var - 1.0).abs() < 0.015, "variance {var}");
    let mut y = vec![0f32; 8];
    Generator::new(11).fill_normal(&mut y, 3.0, 0.5);
    for (y, z) in y.iter().zip(&z) {
        assert_eq!(*y, 3.0 + 0.5 * z);
    }
}

#[test]
fn dropout_rounds_into_half_types_and_canonicalises_nan() {
    let input = [
        bf16::from_f32(1.0),
        bf16::NAN,
        bf16::INFINITY,
        bf16::from_f32(-3.0),
    ];
    let (mut out, mut mask) = ([bf16::ZERO; 4], [0u8; 4]);
    Generator::new(1)
        .dropout(&input, 0.0, &mut out, &mut mask)
        .unwrap();
    assert_eq!(mask, [1; 4]);
    assert_eq!(out[1].to_bits(), 0x7FFF);
    assert_eq!(out[2], bf16::INFINITY);
    let input = [f16::from_f32(0.1); 4];
    let (mut out, mut mask) = ([f16::ZERO; 4], [0u8; 4]);
    Generator::new(1)
        .dropout(&input, 0.3, &mut out, &mut mask)
        .unwrap();
    for (o, m) in out.iter().zip(mask) {
        let want = if m == 1 {
            f16::from_f32(0.1f32 * (1.0 / 0.7f32))
        } else {
            f16::ZERO
        };
        assert_eq!(o.to_bits(), want.to_bits());
    }
}

#[test]
fn tensor_fills_match_slice_fills() {
    let mut a = Generator::new(5);
    let mut b = Generator::new(5);
    let mut t = Tensor::zeros([3, 7], DType::U32, Device::Cpu).unwrap();
    a.fill_u32_tensor(&mut t).unwrap();
    assert_eq!(t.as_slice::<u32>().unwrap(), &words(&mut b, 21)[..]);
    let mut u = Tensor::zeros([5], DType::F32, Device::Cpu).unwrap();
    a.fill_uniform_tensor(&mut u).unwrap();
    let mut v = [0f32; 5];
    b.fill_uniform(&mut v);
    assert_eq!(u.as_slice::<f32>().unwrap(), &v);
    let x = Tensor::from_slice(&[2.0f32; 9], [9], Device::Cpu).unwrap();
    let (y, m) = a.dropout_tensor(&x, 0.5).unwrap();
    let (mut y2, mut m2) = ([0f32; 9], [0u8; 9]);
    b.dropout(&[2.0f32; 9], 0.5, &mut y2, &mut m2).unwrap();
    assert_eq!(y.as_slice::<f32>().unwrap(), &y2);
    assert_eq!(m.as_slice::<u8>().unwrap(), &m2);
    assert_eq!(a.state(), b.state());
}

#[test]
fn bad_input_is_a_typed_error_and_draws_nothing() {
    let mut g = Generator::new(3);
    let mut t = Tensor::zeros([4], DType::F32, Device::Cpu).unwrap();
    let err = g.fill_u32_tensor(&mut t).unwrap_err();
    assert!(matches!(err, Error::DType { .. }), "{err}");
    assert_eq!(
        err.to_string(),
        "Generator::fill_u32_tensor: expected a tensor of dtype u32, got f32"
    );
    let mut w = Tensor::zeros([4], DType::U32, Device::Cpu).unwrap();
    assert!(g.fill_normal_tensor(&mut w, 0.0, 1.0).is_err());
    let x = Tensor::zeros([4], DType::I32, Device::Cpu).unwrap();
    let err = g.dropout_tensor(&x, 0.1).unwrap_err();
    assert!(err.to_string().contains("f32, bf16 or f16"), "{err}");
    let x = Tensor::zeros([4], DType::F32, Device::Cpu).unwrap();
    for p in [-0.1, 1.5, f32::NAN] {
        let err = g.dropout_tensor(&x, p).unwrap_err();
        assert!(err.to_string().contains("outside [0, 1]"), "{err}");
    }
    let (mut out, mut mask) = (
        Tensor::zeros([5], DType::F32, Device::Cpu).unwrap(),
        Tensor::zeros([4], DType::U8, Device::Cpu).unwrap(),
    );
    let err = g.dropout_into(&x, 0.1, &mut out, &mut mask).unwrap_err();
    assert!(
        err.to_string()
            .contains("the output has shape [5], the input [4]"),
        "{err}"
    );
    let mut out = Tensor::zeros([4], DType::BF16, Device::Cpu).unwrap();
    assert!(matches!(
        g.dropout_into(&x, 0.1, &mut out, &mut mask),
        Err(Error::DType { .. })
    ));
    let err = g
        .dropout(&[1.0f32; 3], 0.5, &mut [0.0; 3], &mut [0; 2])
        .unwrap_err();
    assert!(err.to_string().contains("equal lengths"), "{err}");
    let err = Generator::from_state(GeneratorState { seed: 1, offset: 6 }).unwrap_err();
    assert!(err.to_string().contains("not a multiple of 4"), "{err}");
    assert_eq!(g.offset(), 0, "failed calls must not advance the generator");
}

#[cfg(not(feature = "cuda"))]
#[test]
fn cuda_tensors_need_the_feature() {
    let err = Tensor::zeros([4], DType::F32, Device::Cuda(0)).unwrap_err();
    assert!(matches!(err, Error::FeatureDisabled { .. }), "{err}");
}

#[test]
fn tracker_add_and_its_errors() {
    let mut t = RngTracker::new(Device::Cpu);
    t.add("a", 1).unwrap();
    t.add("b", 2).unwrap();
    let err = t.add("c", 1).unwrap_err();
    assert_eq!(
        err.to_string(),
        "RNG tracker seed `1` already exists (used by `a`)"
    );
    let err = t.add("a", 3).unwrap_err();
    assert_eq!(err.to_string(), "RNG tracker state `a` already exists");
    let err = t.fork("zzz", || Ok::<_, Error>(())).unwrap_err();
    assert_eq!(
        err.to_string(),
        "RNG tracker state `zzz` does not exist (known: a, b)"
    );
    assert_eq!(t.names().collect::<Vec<_>>(), ["a", "b"]);
    t.reset();
    assert!(t.names().next().is_none());
    t.add("a", 1).unwrap(); // seeds are free again after reset
}

#[test]
fn fork_swaps_the_current_generator_and_restores_it() {
    manual_seed(Device::Cpu, 99).unwrap();
    let outer = get_rng_state(Device::Cpu).unwrap();
    let mut t = RngTracker::new(Device::Cpu);
    t.add("mp", 1234).unwrap();
    let inside = t
        .fork("mp", || {
            with_current_generator(Device::Cpu, |g| words(g, 6))
        })
        .unwrap();
    assert_eq!(inside, words(&mut Generator::new(1234), 6));
    assert_eq!(get_rng_state(Device::Cpu).unwrap(), outer);
    assert_eq!(
        t.state("mp").unwrap(),
        GeneratorState {
            seed: 1234,
            offset: 8
        }
    );
    // A second fork continues the named stream.
    let next = t
        .fork("mp", || {
            with_current_generator(Device::Cpu, |g| words(g, 4))
        })
        .unwrap();
    let mut g = Generator::new(1234);
    words(&mut g, 8);
    assert_eq!(next, words(&mut g, 4));
}

#[test]
fn fork_restores_on_error_and_on_panic() {
    manual_seed(Device::Cpu, 5).unwrap();
    let outer = get_rng_state(Device::Cpu).unwrap();
    let mut t = RngTracker::new(Device::Cpu);
    t.add("mp", 77).unwrap();
    let err = t
        .fork("mp", || {
            with_current_generator(Device::Cpu, |g| words(g, 4))?;
            Err::<(), _>(Error::invalid("test", "boom"))
        })
        .unwrap_err();
    assert_eq!(err.to_string(), "test: boom");
    assert_eq!(get_rng_state(Device::Cpu).unwrap(), outer);
    assert_eq!(
        t.state("mp").unwrap().offset,
        4,
        "the advanced state is kept, as in TE"
    );

    let caught = catch_unwind(AssertUnwindSafe(|| {
        t.fork("mp", || -> Result<(), Error> {
            with_current_generator(Device::Cpu, |g| words(g, 4))?;
            panic!("inside fork");
        })
    }));
    assert!(caught.is_err());
    assert_eq!(get_rng_state(Device::Cpu).unwrap(), outer);
    assert_eq!(t.state("mp").unwrap().offset, 8);
}

#[test]
fn tracker_and_current_generator_snapshots_replay() {
    let mut t = RngTracker::new(Device::Cpu);
    t.add("mp", 10).unwrap();
    let mut cur = CurrentGenerator::new(Device::Cpu);
    set_rng_state(Device::Cpu, GeneratorState::new(20)).unwrap();
    let (ts, cs) = (t.snapshot(), cur.snapshot());
    let draw = |t: &mut RngTracker| {
        let a = t
            .fork("mp", || {
                with_current_generator(Device::Cpu, |g| words(g, 5))
            })
            .unwrap();
        let b = with_current_generator(Device::Cpu, |g| words(g, 3)).unwrap();
        (a, b)
    };
    let first = draw(&mut t);
    t.restore(&ts).unwrap();
    cur.restore(&cs).unwrap();
    assert_eq!(draw(&mut t), first);
    // get_states / set_states capture the same values.
    let states = t.get_states();
    let current = get_rng_state(Device::Cpu).unwrap();
    let second = draw(&mut t);
    assert_ne!(second, first, "the streams moved on");
    t.set_states(states).unwrap();
    set_rng_state(Device::Cpu, current).unwrap();
    assert_eq!(draw(&mut t), second);
    let err = t.restore(&cs).unwrap_err();
    assert!(matches!(err, Error::SnapshotMismatch { .. }), "{err}");
}

#[test]
fn nested_current_generator_use_is_an_error() {
    let r = with_current_generator(Device::Cpu, |_| get_rng_state(Device::Cpu)).unwrap();
    let err = r.unwrap_err();
    assert!(err.to_string().contains("already borrowed"), "{err}");
}

#[test]
fn current_generators_are_per_thread() {
    manual_seed(Device::Cpu, 1).unwrap();
    with_current_generator(Device::Cpu, |g| words(g, 8)).unwrap();
    let other = std::thread::spawn(|| get_rng_state(Device::Cpu).unwrap())
        .join()
        .unwrap();
    assert_eq!(other, GeneratorState::new(tessera_rng::DEFAULT_SEED));
    assert_eq!(
        get_rng_state(Device::Cpu).unwrap(),
        GeneratorState { seed: 1, offset: 8 }
    );
}

#[test]
fn megatron_seeds() {
    let s = ParallelSeeds::megatron(1234, 3, 2).unwrap();
    assert_eq!(s.data_parallel, 1234);
    assert_eq!(s.model_parallel, 1234 + 2718 + 3);
    assert_eq!(s.expert_parallel, 1234 + 1024 + 200 + 3);
    assert!(ParallelSeeds::megatron(u64::MAX - 10, 0, 0).is_err());
}

#[test]
fn tensor_parallel_streams_across_thread_ranks() {
    // Four TP ranks as threads: the model-parallel stream differs per rank, the
    // data-parallel (current) stream is the same on every rank.
    let per_rank: Vec<(Vec<u32>, Vec<u32>)> = (0..4u64)
        .map(|rank| {
            std::thread::spawn(move || {
                let mut t = RngTracker::new(Device::Cpu);
                tp::model_parallel_manual_seed(&mut t, 42, rank, 0).unwrap();
                let mp = t
                    .fork(MODEL_PARALLEL_RNG, || {
                        with_current_generator(Device::Cpu, |g| words(g, 16))
                    })
                    .unwrap();
                let dp = with_current_generator(Device::Cpu, |g| words(g, 16)).unwrap();
                (mp, dp)
            })
        })
        .map(|h| h.join().unwrap())
        .collect();
    for r in 1..4 {
        assert_ne!(
            per_rank[r].0, per_rank[0].0,
            "rank {r} model-parallel stream"
        );
        assert_eq!(
            per_rank[r].1, per_rank[0].1,
            "rank {r} data-parallel stream"
        );
    }
}

#[test]
fn initialize_affine_weight_forks_and_records_attributes() {
    let mut tracker = RngTracker::new(Device::Cpu);
    tp::model_parallel_manual_seed(&mut tracker, 7, 1, 0).unwrap();
    let outer = get_rng_state(Device::Cpu).unwrap();
    let mut w = Parameter::new(Tensor::zeros([4, 6], DType::F32, Device::Cpu).unwrap());
    let how = AffineInit {
        partition_dim: 1,
        ..AffineInit::default()
    };
    tp::initialize_affine_weight(&mut w, how, Some(&mut tracker), tp::init_normal(0.02)).unwrap();
    assert_eq!(get_rng_state(Device::Cpu).unwrap(), outer);
    let mut expect = vec![0f32; 24];
    Generator::new(7 + 2718 + 1).fill_normal(&mut expect, 0.0, 0.02);
    assert_eq!(w.tensor().as_slice::<f32>().unwrap(), &expect[..]);
    let attrs = w.tp_attributes().unwrap();
    assert!(attrs.is_parallel && attrs.partition_dim == 1 && attrs.stride == 1);
    let err = tp::initialize_affine_weight(&mut w, how, Some(&mut tracker), tp::init_normal(0.02))
        .unwrap_err();
    assert!(err.to_string().contains("already set"), "{err}");
    // Without a tracker the current generator is used.
    let mut v = Parameter::new(Tensor::zeros([2, 2], DType::F32, Device::Cpu).unwrap());
    tp::initialize_affine_weight(&mut v, AffineInit::default(), None, tp::init_normal(1.0))
        .unwrap();
    assert_eq!(get_rng_state(Device::Cpu).unwrap().offset, outer.offset + 4);
}

#[test]
fn committed_ptx_is_fresh() {
    let ptx = include_str!("../kernels/ptx/rng.ptx");
    tessera_core::kernels::check_ptx_fresh(
        "crates/rng/kernels/rng.cu",
        include_str!("../kernels/rng.cu"),
        ptx,
    )
    .unwrap();
}
