//! The symmetric-memory all-reduce. CPU tests (always run): on ThreadGroups of 1..8
//! ranks, one-shot and two-shot equal the group's own all-reduce bit for bit, async
//! equals sync, the cache, typed errors, failures instead of hangs. GPU tests (ignored;
//! `cargo xtask test-gpu`): an NcclGroup of one GPU against the ThreadGroup; with two or
//! more GPUs, one thread per GPU (peer access) and one process per GPU (CUDA IPC).

use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use proptest::prelude::*;
use tessera_collectives::{
    Collective, ProcessGroup, ReduceOp, SymmAlgo, SymmetricAllReduce, SymmetricOptions,
    ThreadGroup, Work, run_ranks,
};
use tessera_core::{DType, Device, Error, Result, Tensor};
use tessera_rng::Generator;

const ALGOS: [SymmAlgo; 2] = [SymmAlgo::OneShot, SymmAlgo::TwoShot];

const DTYPES: [DType; 8] = [
    DType::F32,
    DType::BF16,
    DType::F16,
    DType::U8,
    DType::U32,
    DType::I32,
    DType::U64,
    DType::I64,
];

fn ops(dtype: DType) -> Vec<ReduceOp> {
    let mut v = vec![ReduceOp::Sum, ReduceOp::Prod, ReduceOp::Max, ReduceOp::Min];
    if dtype.is_high_precision_float() {
        v.push(ReduceOp::Avg);
    }
    v
}

/// Rank `rank`'s contribution of `dims`: finite values of mixed magnitudes as `dtype`
/// (integers wide enough that sums and products wrap).
fn input(dims: &[usize], dtype: DType, rank: usize, seed: u64, device: Device) -> Tensor {
    let n: usize = dims.iter().product();
    let mut v = vec![0f32; n];
    Generator::new(seed.wrapping_mul(1000) + rank as u64).fill_normal(&mut v, 0.0, 1.0);
    let v: Vec<f32> = v
        .iter()
        .enumerate()
        .map(|(i, x)| x * 2f32.powi((i % 11) as i32 - 5))
        .collect();
    macro_rules! ints {
        ($t:ty, $scale:expr) => {
            Tensor::from_slice(
                &v.iter()
                    .map(|&x| (f64::from(x) * $scale) as i64 as $t)
                    .collect::<Vec<$t>>(),
                dims,
                device,
            )
        };
    }
    match dtype {
        DType::F32 | DType::BF16 | DType::F16 => Tensor::from_f32_values(&v, dims, dtype, device),
        DType::U8 => ints!(u8, 1e3),
        DType::U32 => ints!(u32, 1e9),
        DType::I32 => ints!(i32, 1e9),
        DType::U64 => ints!(u64, 1e18),
        DType::I64 => ints!(i64, 1e18),
        other => panic!("no test data for {other}"),
    }
    .unwrap()
}

fn arc(g: ThreadGroup) -> Arc<dyn ProcessGroup> {
    Arc::new(g)
}

fn bytes(w: Result<Work<Tensor>>) -> Vec<u8> {
    w.unwrap().into_result().unwrap().to_bytes().unwrap()
}

// ---------------------------------------------------------------------------------
// Results
// ---------------------------------------------------------------------------------

#[test]
fn one_and_two_shot_equal_the_thread_group_bit_for_bit_at_world_sizes_1_to_8() {
    for world in 1..=8 {
        let results = run_ranks(world, |g| {
            let r = g.rank();
            let group = arc(g);
            let symm = SymmetricAllReduce::new(group.clone());
            for dtype in DTYPES {
                for (i, dims) in [&[5usize, 7][..], &[64], &[3, 1, 11]].iter().enumerate() {
                    let x = input(dims, dtype, r, i as u64, Device::Cpu);
                    for op in ops(dtype) {
                        let want = bytes(group.all_reduce(x.clone(), op));
                        for algo in ALGOS {
                            let got = symm.all_reduce(x.clone(), op, algo).unwrap();
                            let got = got.into_result().unwrap();
                            assert_eq!(got.shape().dims(), *dims);
                            assert_eq!(got.dtype(), dtype);
                            assert_eq!(
                                got.to_bytes().unwrap(),
                                want,
                                "world {world}, rank {r}, {dtype} {dims:?} {op:?} {algo}"
                            );
                        }
                    }
                }
            }
            // Inputs are not modified (the result is written copy-on-write).
            let x = input(&[4], DType::F32, r, 9, Device::Cpu);
            let before = x.to_bytes().unwrap();
            let _ = symm
                .all_reduce(x.clone(), ReduceOp::Sum, SymmAlgo::TwoShot)
                .unwrap()
                .into_result()
                .unwrap();
            assert_eq!(x.to_bytes().unwrap(), before);
        })
        .unwrap();
        assert_eq!(results.len(), world);
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    #[test]
    fn random_shapes_match_the_thread_group(
        world in 1usize..=8,
        numel in 1usize..700,
        d in 0usize..8,
        o in 0usize..5,
        seed: u64,
    ) {
        let dtype = DTYPES[d];
        let all = ops(dtype);
        let op = all[o % all.len()];
        let outs = run_ranks(world, |g| {
            let r = g.rank();
            let group = arc(g);
            let symm = SymmetricAllReduce::new(group.clone());
            let x = input(&[numel], dtype, r, seed, Device::Cpu);
            let want = bytes(group.all_reduce(x.clone(), op));
            let one = bytes(symm.all_reduce(x.clone(), op, SymmAlgo::OneShot));
            let two = bytes(symm.all_reduce(x, op, SymmAlgo::TwoShot));
            (want, one, two)
        }).unwrap();
        for (want, one, two) in outs {
            prop_assert_eq!(&one, &want);
            prop_assert_eq!(&two, &want);
        }
    }
}

#[test]
fn async_and_sync_results_are_equal() {
    for world in [1, 2, 3, 5, 8] {
        run_ranks(world, |g| {
            let r = g.rank();
            let group = arc(g);
            let symm = SymmetricAllReduce::new(group.clone());
            let xs: Vec<Tensor> = (0..12)
                .map(|i| {
                    // Two shapes (so two buffers), interleaved; same shape back to back.
                    let dims: &[usize] = if i % 3 == 2 { &[9, 4] } else { &[33] };
                    input(dims, DType::BF16, r, i, Device::Cpu)
                })
                .collect();
            let algo = |i: usize| ALGOS[i % 2];
            let sync: Vec<Vec<u8>> = xs
                .iter()
                .enumerate()
                .map(|(i, x)| bytes(symm.all_reduce(x.clone(), ReduceOp::Sum, algo(i))))
                .collect();
            // Everything issued before any wait, waited in reverse order.
            let mut works: Vec<Work<Tensor>> = xs
                .iter()
                .enumerate()
                .map(|(i, x)| symm.all_reduce(x.clone(), ReduceOp::Sum, algo(i)).unwrap())
                .collect();
            for (i, w) in works.iter_mut().enumerate().rev() {
                assert_eq!(w.wait().unwrap().to_bytes().unwrap(), sync[i], "call {i}");
                // Waiting again returns the same result.
                assert_eq!(w.wait().unwrap().to_bytes().unwrap(), sync[i]);
            }
            // Handles dropped without a wait still complete (the others need this
            // rank's two-shot chunk): the next calls work.
            for (i, x) in xs.iter().enumerate().take(4) {
                drop(symm.all_reduce(x.clone(), ReduceOp::Sum, algo(i)).unwrap());
            }
            let again = bytes(symm.all_reduce(xs[0].clone(), ReduceOp::Sum, SymmAlgo::OneShot));
            assert_eq!(again, sync[0]);
            // The ordinary group's collectives interleave with pending symmetric ones.
            let pending = symm
                .all_reduce(xs[1].clone(), ReduceOp::Sum, SymmAlgo::TwoShot)
                .unwrap();
            let plain = bytes(group.all_reduce(xs[1].clone(), ReduceOp::Sum));
            assert_eq!(pending.into_result().unwrap().to_bytes().unwrap(), plain);
        })
        .unwrap();
    }
}

#[test]
fn a_handle_outlives_clear_and_the_object() {
    run_ranks(3, |g| {
        let r = g.rank();
        let group = arc(g);
        let symm = SymmetricAllReduce::new(group.clone());
        let x = input(&[50], DType::F32, r, 4, Device::Cpu);
        let want = bytes(group.all_reduce(x.clone(), ReduceOp::Min));
        let a = symm
            .all_reduce(x.clone(), ReduceOp::Min, SymmAlgo::TwoShot)
            .unwrap();
        symm.clear().unwrap(); // completes `a` first
        let b = symm
            .all_reduce(x, ReduceOp::Min, SymmAlgo::OneShot)
            .unwrap();
        drop(symm); // completes `b`
        assert_eq!(a.into_result().unwrap().to_bytes().unwrap(), want);
        assert_eq!(b.into_result().unwrap().to_bytes().unwrap(), want);
    })
    .unwrap();
    fn send_sync<T: Send + Sync>() {}
    send_sync::<SymmetricAllReduce>();
}

#[test]
fn a_subgroup_reduces_over_its_ranks() {
    let outs = run_ranks(5, |g| {
        let sub = g.new_subgroup(&[4, 1, 2]).unwrap()?;
        let symm = SymmetricAllReduce::new(sub.clone());
        let x = input(&[17], DType::F32, g.rank(), 3, Device::Cpu);
        let want = bytes(sub.all_reduce(x.clone(), ReduceOp::Max));
        for algo in ALGOS {
            assert_eq!(bytes(symm.all_reduce(x.clone(), ReduceOp::Max, algo)), want);
        }
        Some(want)
    })
    .unwrap();
    assert_eq!(outs.iter().filter(|o| o.is_some()).count(), 3);
}

// ---------------------------------------------------------------------------------
// The cache
// ---------------------------------------------------------------------------------

#[test]
fn buffers_are_cached_per_element_count_and_dtype() {
    run_ranks(3, |g| {
        let r = g.rank();
        let symm = SymmetricAllReduce::new(arc(g));
        assert!(symm.cached().is_empty());
        for dims in [&[2usize, 3][..], &[3, 2], &[6]] {
            let x = input(dims, DType::F32, r, 1, Device::Cpu);
            let out = symm
                .all_reduce(x, ReduceOp::Sum, SymmAlgo::OneShot)
                .unwrap();
            assert_eq!(out.into_result().unwrap().shape().dims(), dims);
        }
        assert_eq!(
            symm.cached(),
            [(6, DType::F32)],
            "one buffer for every shape of 6"
        );
        let one = symm.cached_bytes();
        // (6 + chunk of 4, rounded to 16 bytes) f32 elements.
        assert_eq!(one, (6 + 4) * 4);
        for (dims, dtype) in [(&[4usize][..], DType::F32), (&[6][..], DType::BF16)] {
            let x = input(dims, dtype, r, 1, Device::Cpu);
            bytes(symm.all_reduce(x, ReduceOp::Sum, SymmAlgo::TwoShot));
        }
        assert_eq!(
            symm.cached(),
            [(4, DType::F32), (6, DType::F32), (6, DType::BF16)]
        );
        assert!(symm.cached_bytes() > one);
        symm.clear().unwrap();
        assert!(symm.cached().is_empty());
        assert_eq!(symm.cached_bytes(), 0);
        // Buffers are created anew after a clear.
        let x = input(&[6], DType::F32, r, 2, Device::Cpu);
        bytes(symm.all_reduce(x, ReduceOp::Sum, SymmAlgo::OneShot));
        assert_eq!(symm.cached(), [(6, DType::F32)]);
        // Empty tensors need no buffer.
        let e = Tensor::zeros([0, 3], DType::F32, Device::Cpu).unwrap();
        let out = symm
            .all_reduce(e, ReduceOp::Sum, SymmAlgo::OneShot)
            .unwrap();
        assert_eq!(out.into_result().unwrap().shape().dims(), &[0, 3]);
        assert_eq!(symm.cached().len(), 1);
        format!("{symm:?}")
    })
    .unwrap();
}

#[test]
fn a_cache_over_its_budget_is_a_typed_error_on_every_rank() {
    run_ranks(2, |g| {
        let r = g.rank();
        let options = SymmetricOptions {
            max_cached_bytes: 1000,
            ..SymmetricOptions::default()
        };
        let symm = SymmetricAllReduce::with_options(arc(g), options);
        assert_eq!(symm.options().max_cached_bytes, 1000);
        bytes(symm.all_reduce(
            input(&[100], DType::F32, r, 1, Device::Cpu),
            ReduceOp::Sum,
            SymmAlgo::OneShot,
        ));
        let big = input(&[120], DType::F32, r, 1, Device::Cpu);
        let e = symm
            .all_reduce(big.clone(), ReduceOp::Sum, SymmAlgo::OneShot)
            .unwrap_err();
        assert!(matches!(e, Error::InvalidArgument { .. }), "{e}");
        assert!(e.to_string().contains("max_cached_bytes = 1000"), "{e}");
        // Cached shapes still work; after a clear the new one fits.
        bytes(symm.all_reduce(
            input(&[10, 10], DType::F32, r, 1, Device::Cpu),
            ReduceOp::Sum,
            SymmAlgo::TwoShot,
        ));
        symm.clear().unwrap();
        bytes(symm.all_reduce(big, ReduceOp::Sum, SymmAlgo::OneShot));
    })
    .unwrap();
}

// ---------------------------------------------------------------------------------
// Errors
// ---------------------------------------------------------------------------------

#[test]
fn bad_requests_are_typed_errors_before_any_communication() {
    // Every rank gets the same error, and nothing is cached or exchanged: a rank that
    // made no call at all does not make them hang.
    let errs = run_ranks(3, |g| {
        let symm = SymmetricAllReduce::new(arc(g));
        let x = Tensor::zeros([4], DType::F32, Device::Cpu).unwrap();
        let multimem = symm
            .all_reduce(x.clone(), ReduceOp::Sum, SymmAlgo::Multimem)
            .unwrap_err();
        let fp8 = symm
            .all_reduce(
                Tensor::zeros([4], DType::F8E4M3, Device::Cpu).unwrap(),
                ReduceOp::Sum,
                SymmAlgo::OneShot,
            )
            .unwrap_err();
        let avg_int = symm
            .all_reduce(
                Tensor::zeros([4], DType::I32, Device::Cpu).unwrap(),
                ReduceOp::Avg,
                SymmAlgo::TwoShot,
            )
            .unwrap_err();
        assert!(symm.cached().is_empty());
        (multimem, fp8, avg_int)
    })
    .unwrap();
    for (multimem, fp8, avg_int) in errs {
        let Error::InvalidArgument { msg, .. } = &multimem else {
            panic!("{multimem:?}");
        };
        assert!(msg.starts_with("unsupported: "), "{msg}");
        assert!(
            msg.contains("cuMulticastCreate") && msg.contains("OneShot"),
            "{msg}"
        );
        assert!(
            matches!(
                fp8,
                Error::DType {
                    got: DType::F8E4M3,
                    ..
                }
            ),
            "{fp8}"
        );
        assert!(
            matches!(
                avg_int,
                Error::DType {
                    got: DType::I32,
                    ..
                }
            ),
            "{avg_int}"
        );
    }
    assert!("multimem".parse::<SymmAlgo>().unwrap() == SymmAlgo::Multimem);
}

#[cfg(feature = "cuda")]
#[test]
fn a_cuda_tensor_on_a_host_group_is_a_device_error() {
    // Without a GPU the tensor cannot even be made; the check itself is what matters.
    let Ok(x) = Tensor::zeros([4], DType::F32, Device::Cuda(0)) else {
        return;
    };
    let symm = SymmetricAllReduce::new(arc(ThreadGroup::new(1).unwrap().remove(0)));
    let e = symm
        .all_reduce(x, ReduceOp::Sum, SymmAlgo::OneShot)
        .unwrap_err();
    assert!(matches!(e, Error::Device { .. }), "{e}");
}

#[test]
fn mismatched_calls_across_ranks_are_errors_on_every_rank() {
    run_ranks(3, |g| {
        let r = g.rank();
        let symm = SymmetricAllReduce::new(arc(g));
        let x = |dims: &[usize]| input(dims, DType::F32, r, 5, Device::Cpu);
        let check = |w: Result<Work<Tensor>>, what: &str| {
            let e = w.and_then(Work::into_result).unwrap_err();
            assert!(matches!(e, Error::InvalidArgument { .. }), "{what}: {e}");
            let m = e.to_string();
            assert!(m.contains("mismatched symmetric all-reduce"), "{what}: {m}");
        };
        // Same element count, different shapes.
        let dims: &[usize] = if r == 0 { &[2, 3] } else { &[3, 2] };
        check(
            symm.all_reduce(x(dims), ReduceOp::Sum, SymmAlgo::OneShot),
            "shape",
        );
        // Different algorithms, different ops.
        let algo = if r == 1 {
            SymmAlgo::OneShot
        } else {
            SymmAlgo::TwoShot
        };
        check(symm.all_reduce(x(&[6]), ReduceOp::Sum, algo), "algorithm");
        let op = if r == 2 { ReduceOp::Max } else { ReduceOp::Sum };
        check(symm.all_reduce(x(&[6]), op, SymmAlgo::TwoShot), "op");
        // The buffer stays usable.
        bytes(symm.all_reduce(x(&[6]), ReduceOp::Sum, SymmAlgo::TwoShot));
    })
    .unwrap();
}

#[test]
fn ranks_that_disagree_on_the_element_count_or_dtype_get_a_typed_error() {
    let errs = run_ranks(2, |g| {
        let r = g.rank();
        let symm = SymmetricAllReduce::new(arc(g));
        let x = input(&[6 + 2 * r], DType::F32, r, 1, Device::Cpu);
        let count = symm
            .all_reduce(x, ReduceOp::Sum, SymmAlgo::OneShot)
            .unwrap_err();
        let dtype = [DType::F32, DType::BF16][r];
        let x = input(&[6], dtype, r, 1, Device::Cpu);
        let dtype = symm
            .all_reduce(x, ReduceOp::Sum, SymmAlgo::OneShot)
            .unwrap_err();
        assert!(symm.cached().is_empty());
        (count, dtype)
    })
    .unwrap();
    for (count, dtype) in errs {
        assert!(matches!(count, Error::Shape { .. }), "{count}");
        assert!(count.to_string().contains("disagree"), "{count}");
        let m = dtype.to_string();
        assert!(matches!(dtype, Error::Shape { .. }), "{m}");
        assert!(
            m.contains("elements of f32") && m.contains("elements of bf16"),
            "{m}"
        );
    }
}

#[test]
fn a_rank_that_drops_its_buffers_makes_the_others_fail_instead_of_hang() {
    let start = Instant::now();
    let outs = run_ranks(3, |g| {
        let r = g.rank();
        let symm = SymmetricAllReduce::new(arc(g));
        let x = input(&[40], DType::F16, r, 1, Device::Cpu);
        bytes(symm.all_reduce(x.clone(), ReduceOp::Sum, SymmAlgo::TwoShot));
        if r == 2 {
            return None; // drops its SymmetricAllReduce (and its group handle)
        }
        let e = symm
            .all_reduce(x, ReduceOp::Sum, SymmAlgo::TwoShot)
            .and_then(Work::into_result)
            .unwrap_err();
        Some(e)
    })
    .unwrap();
    for e in outs.into_iter().flatten() {
        assert!(matches!(e, Error::State { .. }), "{e}");
        assert!(e.to_string().contains("rank(s) [2] dropped"), "{e}");
    }
    assert!(start.elapsed() < Duration::from_secs(60), "failed fast");
}

#[test]
fn a_rank_that_never_calls_times_out_instead_of_hanging() {
    let done = Barrier::new(2);
    let options = SymmetricOptions {
        timeout: Duration::from_millis(300),
        ..SymmetricOptions::default()
    };
    let outs = run_ranks(2, |g| {
        let r = g.rank();
        let symm = SymmetricAllReduce::with_options(arc(g), options);
        let x = input(&[8], DType::F32, r, 1, Device::Cpu);
        bytes(symm.all_reduce(x.clone(), ReduceOp::Sum, SymmAlgo::OneShot));
        let out = if r == 0 {
            let t = Instant::now();
            let e = symm
                .all_reduce(x, ReduceOp::Sum, SymmAlgo::OneShot)
                .and_then(Work::into_result)
                .unwrap_err();
            Some((e, t.elapsed()))
        } else {
            None
        };
        done.wait(); // rank 1 keeps its buffers until rank 0 has failed
        out
    })
    .unwrap();
    let (e, took) = outs.into_iter().flatten().next().unwrap();
    assert!(matches!(e, Error::State { .. }), "{e}");
    let m = e.to_string();
    assert!(m.contains("rank 0 waited 300ms for rank(s) [1]"), "{m}");
    assert!(took < Duration::from_secs(30), "{took:?}");
}

/// A ThreadGroup whose all-gathers of u64 rows claim that rank 1 is another process
/// (its first word, the process token, is changed).
#[derive(Debug)]
struct OtherProcess(ThreadGroup);

impl ProcessGroup for OtherProcess {
    fn rank(&self) -> usize {
        self.0.rank()
    }
    fn size(&self) -> usize {
        self.0.size()
    }
    fn device(&self) -> Device {
        self.0.device()
    }
    fn run(&self, ops: Vec<Collective>) -> Result<Work<Vec<Tensor>>> {
        let gather = matches!(
            ops.as_slice(),
            [Collective::AllGather { input, .. }] if input.dtype() == DType::U64
        );
        Ok(self.0.run(ops)?.then(move |mut outs| {
            if gather {
                let row = outs[0].numel() / 2;
                outs[0].as_mut_slice::<u64>()?[row] ^= 1;
            }
            Ok(outs)
        }))
    }
    fn barrier(&self) -> Result<()> {
        self.0.barrier()
    }
    fn new_subgroup(&self, ranks: &[usize]) -> Result<Option<Arc<dyn ProcessGroup>>> {
        self.0.new_subgroup(ranks)
    }
}

#[test]
fn host_buffers_need_every_rank_in_this_process() {
    let errs = run_ranks(2, |g| {
        let symm = SymmetricAllReduce::new(Arc::new(OtherProcess(g)));
        let x = Tensor::zeros([4], DType::F32, Device::Cpu).unwrap();
        symm.all_reduce(x, ReduceOp::Sum, SymmAlgo::OneShot)
            .unwrap_err()
    })
    .unwrap();
    for e in errs {
        assert!(matches!(e, Error::InvalidArgument { .. }), "{e}");
        assert!(
            e.to_string()
                .contains("thread of this process; rank 1 is in another process"),
            "{e}"
        );
    }
}

#[test]
fn committed_ptx_is_fresh() {
    tessera_core::kernels::check_ptx_fresh(
        "crates/collectives/kernels/symmetric.cu",
        include_str!("../kernels/symmetric.cu"),
        include_str!("../kernels/ptx/symmetric.ptx"),
    )
    .unwrap();
}

// ---------------------------------------------------------------------------------
// GPU tests
// ---------------------------------------------------------------------------------

#[cfg(feature = "cuda")]
use tessera_collectives::{NcclGroup, NcclOptions, Store};

#[cfg(feature = "cuda")]
fn store(world: usize) -> Store {
    Store::serve("127.0.0.1:0", world, Duration::from_secs(60)).unwrap()
}

/// Every dtype, op and algorithm on `symm` (this rank `r` of `world`) against the
/// ThreadGroup's all-reduce of the same inputs, computed in this process with
/// `world` threads.
#[cfg(feature = "cuda")]
fn matches_the_thread_group(symm: &SymmetricAllReduce, r: usize, world: usize) {
    let device = symm.group().device();
    let shapes: [&[usize]; 5] = [&[1], &[7, 3], &[1000], &[33, 129], &[4099]];
    for dtype in DTYPES {
        for (i, dims) in shapes.iter().enumerate() {
            let want = run_ranks(world, |g| {
                let x = input(dims, dtype, g.rank(), i as u64, Device::Cpu);
                ops(dtype)
                    .into_iter()
                    .map(|op| bytes(g.all_reduce(x.clone(), op)))
                    .collect::<Vec<_>>()
            })
            .unwrap()
            .swap_remove(r);
            let x = input(dims, dtype, r, i as u64, device);
            for (op, want) in ops(dtype).into_iter().zip(&want) {
                for algo in ALGOS {
                    let got = symm.all_reduce(x.clone(), op, algo).unwrap();
                    let got = got.into_result().unwrap();
                    assert_eq!(got.device(), device);
                    assert_eq!(got.shape().dims(), *dims);
                    assert_eq!(
                        &got.to_bytes().unwrap(),
                        want,
                        "rank {r} of {world}: {dtype} {dims:?} {op:?} {algo}"
                    );
                }
            }
        }
    }
}

#[cfg(feature = "cuda")]
#[test]
#[ignore = "needs a CUDA GPU: cargo xtask test-gpu"]
fn one_gpu_matches_the_thread_group() {
    let s = store(1);
    let g: Arc<dyn ProcessGroup> =
        Arc::new(NcclGroup::new(&s, 0, 1, 0, NcclOptions::default()).unwrap());
    let symm = SymmetricAllReduce::new(g.clone());
    matches_the_thread_group(&symm, 0, 1);
    assert_eq!(symm.cached().len(), DTYPES.len() * 5);
    assert!(symm.cached_bytes() > 0);
    symm.clear().unwrap();
    assert!(symm.cached().is_empty());
}

#[cfg(feature = "cuda")]
#[test]
#[ignore = "needs a CUDA GPU: cargo xtask test-gpu"]
fn one_gpu_async_equals_sync_and_errors_are_typed() {
    let s = store(1);
    let g: Arc<dyn ProcessGroup> =
        Arc::new(NcclGroup::new(&s, 0, 1, 0, NcclOptions::default()).unwrap());
    let d = g.device();
    let symm = SymmetricAllReduce::new(g.clone());
    let xs: Vec<Tensor> = (0..9)
        .map(|i| input(&[257], DType::BF16, 0, i, d))
        .collect();
    let sync: Vec<Vec<u8>> = xs
        .iter()
        .enumerate()
        .map(|(i, x)| bytes(symm.all_reduce(x.clone(), ReduceOp::Avg, ALGOS[i % 2])))
        .collect();
    let works: Vec<Work<Tensor>> = xs
        .iter()
        .enumerate()
        .map(|(i, x)| {
            symm.all_reduce(x.clone(), ReduceOp::Avg, ALGOS[i % 2])
                .unwrap()
        })
        .collect();
    for (i, w) in works.into_iter().enumerate().rev() {
        assert_eq!(
            w.into_result().unwrap().to_bytes().unwrap(),
            sync[i],
            "call {i}"
        );
    }
    // The inputs were not modified.
    let again = input(&[257], DType::BF16, 0, 0, Device::Cpu);
    assert_eq!(xs[0].to_bytes().unwrap(), again.to_bytes().unwrap());
    let e = symm
        .all_reduce(again, ReduceOp::Sum, SymmAlgo::OneShot)
        .unwrap_err();
    assert!(matches!(e, Error::Device { .. }), "{e}");
    let e = symm
        .all_reduce(xs[0].clone(), ReduceOp::Sum, SymmAlgo::Multimem)
        .unwrap_err();
    assert!(e.to_string().contains("unsupported: "), "{e}");
    let fp8 = Tensor::zeros([16], DType::F8E5M2, d).unwrap();
    let e = symm
        .all_reduce(fp8, ReduceOp::Max, SymmAlgo::OneShot)
        .unwrap_err();
    assert!(matches!(e, Error::DType { .. }), "{e}");
    // Drop without clear: a group of one exported nothing, so everything is freed.
    drop(symm);
}

/// Runs `f` on one NcclGroup rank per visible GPU, as threads of this process.
#[cfg(feature = "cuda")]
fn on_every_gpu<R: Send>(f: impl Fn(Arc<dyn ProcessGroup>) -> R + Sync) -> Vec<R> {
    let n = tessera_core::cuda::device_count().unwrap();
    assert!(
        n >= 2,
        "multi-GPU tests need 2 or more GPUs, this machine has {n}: run `cargo xtask test-gpu --gpus N` on one"
    );
    let n = n.min(tessera_collectives::MAX_SYMMETRIC_GPU_RANKS);
    let s0 = store(n);
    let addr = s0.addr().to_string();
    let (f, s0) = (&f, &s0);
    std::thread::scope(|sc| {
        let hs: Vec<_> = (0..n)
            .map(|r| {
                let addr = addr.clone();
                sc.spawn(move || {
                    let own;
                    let s = if r == 0 {
                        s0
                    } else {
                        own = Store::connect(&addr, r, n, Duration::from_secs(60)).unwrap();
                        &own
                    };
                    let g = NcclGroup::new(s, r, n, r, NcclOptions::default()).unwrap();
                    f(Arc::new(g))
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

#[cfg(feature = "cuda")]
#[test]
#[ignore = "needs a CUDA GPU: cargo xtask test-gpu"]
fn multi_gpu_threads_with_peer_access_match_the_thread_group() {
    on_every_gpu(|g| {
        let (r, world) = (g.rank(), g.size());
        let symm = SymmetricAllReduce::new(g.clone());
        matches_the_thread_group(&symm, r, world);
        symm.clear().unwrap();
        g.barrier().unwrap();
    });
}

/// Run once per rank with the torchrun variables (one process per GPU; `cargo
/// xtask test-gpu --gpus N` starts them): the peers' buffers are CUDA IPC mappings.
#[cfg(feature = "cuda")]
#[test]
#[ignore = "needs a CUDA GPU: cargo xtask test-gpu"]
fn multi_process_ipc_matches_the_thread_group() {
    assert!(
        std::env::var_os("WORLD_SIZE").is_some(),
        "WORLD_SIZE is not set: start one process per GPU with the torchrun variables (cargo xtask test-gpu --gpus N does)"
    );
    let g = Arc::new(NcclGroup::from_env().unwrap());
    let (r, world) = (g.rank(), g.size());
    let group: Arc<dyn ProcessGroup> = g.clone();
    let symm = SymmetricAllReduce::new(group.clone());
    matches_the_thread_group(&symm, r, world);
    // Async: several calls in flight, against the ThreadGroup of this process.
    let want = run_ranks(world, |tg| {
        (0..6)
            .map(|i| {
                let x = input(&[3000], DType::F32, tg.rank(), i, Device::Cpu);
                bytes(tg.all_reduce(x, ReduceOp::Sum))
            })
            .collect::<Vec<_>>()
    })
    .unwrap()
    .swap_remove(r);
    let works: Vec<_> = (0..6)
        .map(|i| {
            let x = input(&[3000], DType::F32, r, i, group.device());
            symm.all_reduce(x, ReduceOp::Sum, ALGOS[i as usize % 2])
                .unwrap()
        })
        .collect();
    for (i, w) in works.into_iter().enumerate() {
        assert_eq!(
            w.into_result().unwrap().to_bytes().unwrap(),
            want[i],
            "call {i}"
        );
    }
    symm.clear().unwrap();
    // Rank 0 hosts the store: it leaves last.
    g.store().unwrap().barrier("symmetric_ipc/end").unwrap();
}
