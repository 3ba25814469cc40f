//! The NCCL backend. CPU tests (always run): without CUDA or NCCL every entry point
//! returns a typed error, never panics. GPU tests (ignored; `cargo xtask test-gpu`):
//! NCCL in-process at world size 1 against the ThreadGroup on the same inputs, byte
//! gathers of FP8, coalesced groups, split subgroups, abort and timeouts, and
//! quantized gathers; and, on machines with two or more GPUs, one thread per GPU.
#![cfg(feature = "cuda")]

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tessera_collectives::nccl::{self, NcclVersion, UniqueId};
use tessera_collectives::{
    Collective, GroupAmaxReduction, MaybeQuantized, NcclGroup, NcclOptions, ProcessGroup, ReduceOp,
    Store, ThreadGroup, gather_along_first_dim, gather_split_1d_tensor, run_ranks,
    split_tensor_into_1d_equal_chunks,
};
use tessera_core::{DType, Device, Error, Result, Tensor};
use tessera_quant::{Fp8CurrentScaling, Fp8Format, Mxfp8Quantizer, Quantizer};
use tessera_rng::Generator;

fn store(world: usize) -> Store {
    Store::serve("127.0.0.1:0", world, Duration::from_secs(60)).unwrap()
}

fn temp_dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("tessera-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

// ---------------------------------------------------------------------------------
// CPU tests
// ---------------------------------------------------------------------------------

#[test]
fn without_cuda_or_nccl_every_entry_point_is_a_typed_error() {
    if nccl::is_available() {
        return; // a GPU machine with NCCL: the GPU tests cover it
    }
    let unavailable = |e: Error| {
        assert!(matches!(e, Error::CudaUnavailable { .. }), "{e:?}");
        e.to_string()
    };
    let msg = unavailable(nccl::ensure_available().unwrap_err());
    eprintln!("{msg}");
    assert!(msg.starts_with("CUDA is unavailable: "), "{msg}");
    unavailable(UniqueId::new().unwrap_err());
    let s = store(1);
    unavailable(NcclGroup::new(&s, 0, 1, 0, NcclOptions::default()).unwrap_err());
    // Asking twice gives the same answer (it is computed once).
    assert_eq!(
        nccl::ensure_available().unwrap_err().to_string(),
        msg,
        "stable"
    );
}

#[test]
fn bad_arguments_are_rejected_before_touching_cuda() {
    let s = store(1);
    for (rank, size) in [(1, 1), (0, 0), (5, 2)] {
        let e = NcclGroup::new(&s, rank, size, 0, NcclOptions::default()).unwrap_err();
        assert!(matches!(e, Error::InvalidArgument { .. }), "{e}");
    }
}

#[test]
fn unique_ids_round_trip_through_bytes() {
    let bytes: Vec<u8> = (0..128u32).map(|i| (i * 37 % 256) as u8).collect();
    let id = UniqueId::from_bytes(&bytes).unwrap();
    assert_eq!(id.to_bytes().to_vec(), bytes);
    assert_eq!(format!("{id:?}"), "UniqueId(..)");
    let e = UniqueId::from_bytes(&bytes[..127]).unwrap_err();
    assert!(e.to_string().contains("128 bytes, got 127"), "{e}");
}

#[test]
fn nccl_versions_decode() {
    let v = NcclVersion::from_code(22803);
    assert_eq!((v.major, v.minor, v.patch), (2, 28, 3));
    assert_eq!(v.to_string(), "2.28.3");
    assert_eq!(NcclVersion::from_code(2708).to_string(), "2.7.8");
    assert!(NcclVersion::from_code(21805) < NcclVersion::from_code(22800));
}

#[test]
fn the_libnccl_shim_is_a_symlink_directory() {
    let dir = temp_dir("shim");
    let target = PathBuf::from("/opt/somewhere/lib/libnccl.so.2");
    assert_eq!(nccl::create_nccl_shim(&dir, &target).unwrap(), dir);
    assert_eq!(std::fs::read_link(dir.join("libnccl.so")).unwrap(), target);
    // Idempotent, and a new target replaces the old link.
    nccl::create_nccl_shim(&dir, &target).unwrap();
    let other = PathBuf::from("/elsewhere/libnccl.so.2");
    nccl::create_nccl_shim(&dir, &other).unwrap();
    assert_eq!(std::fs::read_link(dir.join("libnccl.so")).unwrap(), other);
    // A regular file is not replaced.
    let dir2 = temp_dir("shim-file");
    std::fs::create_dir_all(&dir2).unwrap();
    std::fs::write(dir2.join("libnccl.so"), b"not a link").unwrap();
    let e = nccl::create_nccl_shim(&dir2, &target).unwrap_err();
    assert!(e.to_string().contains("is not a symlink"), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
    let _ = std::fs::remove_dir_all(&dir2);
}

#[test]
fn the_shim_helper_reports_what_it_found() {
    let dir = temp_dir("shim-auto");
    match nccl::nccl_shim_dir(&dir) {
        // cudarc loads NCCL already: nothing to do.
        Ok(None) => {}
        // Only libnccl.so.2 exists: a link to it.
        Ok(Some(d)) => {
            let link = std::fs::read_link(d.join("libnccl.so")).unwrap();
            assert!(link.to_string_lossy().contains("libnccl.so"), "{link:?}");
            assert_eq!(Some(link), nccl::find_libnccl_so2());
        }
        // No NCCL at all (this CI machine).
        Err(e) => assert!(matches!(e, Error::CudaUnavailable { .. }), "{e}"),
    }
    let _ = std::fs::remove_dir_all(&dir);
}

// ---------------------------------------------------------------------------------
// GPU tests, world size 1
// ---------------------------------------------------------------------------------

fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut v = vec![0f32; n];
    Generator::new(seed).fill_normal(&mut v, 0.0, 3.0);
    v
}

/// `v` as a tensor of `dtype` (f32 or bf16) on `device`.
fn tensor(v: &[f32], dims: [usize; 2], dtype: DType, device: Device) -> Tensor {
    Tensor::from_f32_values(v, dims, dtype, device).unwrap()
}

fn nccl_group_of_one(options: NcclOptions) -> (Store, NcclGroup) {
    let s = store(1);
    let g = NcclGroup::new(&s, 0, 1, 0, options).unwrap();
    (s, g)
}

fn thread_group_of_one() -> ThreadGroup {
    ThreadGroup::new(1).unwrap().pop().unwrap()
}

/// Runs `make(device)`'s operations on the NCCL group and on a one-rank ThreadGroup
/// (host copies of the same inputs) and checks the outputs are the same bytes.
fn same_as_thread_group(
    nccl: &dyn ProcessGroup,
    make: impl Fn(Device) -> Vec<Collective>,
    what: &str,
) {
    let got = nccl
        .run(make(nccl.device()))
        .unwrap()
        .into_result()
        .unwrap();
    let want = thread_group_of_one()
        .run(make(Device::Cpu))
        .unwrap()
        .into_result()
        .unwrap();
    assert_eq!(got.len(), want.len(), "{what}");
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_eq!(g.device(), nccl.device(), "{what} #{i}");
        assert_eq!(g.shape(), w.shape(), "{what} #{i}");
        assert_eq!(g.dtype(), w.dtype(), "{what} #{i}");
        assert_eq!(g.to_bytes().unwrap(), w.to_bytes().unwrap(), "{what} #{i}");
    }
}

#[test]
#[ignore = "needs a CUDA GPU: cargo xtask test-gpu"]
fn single_collectives_match_the_thread_group() {
    let (_s, g) = nccl_group_of_one(NcclOptions::default());
    assert_eq!((g.rank(), g.size(), g.device()), (0, 1, Device::Cuda(0)));
    let v = values(6 * 10, 1);
    for dtype in [DType::F32, DType::BF16] {
        let x = |d| tensor(&v, [6, 10], dtype, d);
        same_as_thread_group(
            &g,
            |d| {
                vec![Collective::AllGather {
                    input: x(d),
                    output: Tensor::empty([6, 10], dtype, d).unwrap(),
                }]
            },
            "all_gather",
        );
        for op in [
            ReduceOp::Sum,
            ReduceOp::Avg,
            ReduceOp::Max,
            ReduceOp::Min,
            ReduceOp::Prod,
        ] {
            same_as_thread_group(
                &g,
                |d| {
                    vec![Collective::ReduceScatter {
                        input: x(d),
                        output: Tensor::empty([6, 10], dtype, d).unwrap(),
                        op,
                    }]
                },
                &format!("reduce_scatter {op:?} {dtype}"),
            );
            same_as_thread_group(
                &g,
                |d| vec![Collective::AllReduce { tensor: x(d), op }],
                &format!("all_reduce {op:?} {dtype}"),
            );
        }
        same_as_thread_group(
            &g,
            |d| {
                vec![Collective::Broadcast {
                    tensor: x(d),
                    root: 0,
                }]
            },
            "broadcast",
        );
        // The convenience methods too.
        let t = x(g.device());
        let host = x(Device::Cpu);
        let gathered = g.all_gather(&t).unwrap().into_result().unwrap();
        assert_eq!(gathered.to_bytes().unwrap(), host.to_bytes().unwrap());
        let reduced = g
            .reduce_scatter(&t, ReduceOp::Sum)
            .unwrap()
            .into_result()
            .unwrap();
        assert_eq!(reduced.to_bytes().unwrap(), host.to_bytes().unwrap());
    }
    // In-place all-reduce never writes a tensor the caller still holds.
    let t = tensor(&v, [6, 10], DType::F32, g.device());
    let before = t.to_bytes().unwrap();
    let _ = g
        .all_reduce(t.clone(), ReduceOp::Sum)
        .unwrap()
        .into_result()
        .unwrap();
    assert_eq!(t.to_bytes().unwrap(), before);
    g.barrier().unwrap();
}

#[test]
#[ignore = "needs a CUDA GPU: cargo xtask test-gpu"]
fn fp8_and_packed_payloads_gather_as_bytes() {
    let (_s, g) = nccl_group_of_one(NcclOptions::default());
    let codes: Vec<u8> = (0..=255u8).collect();
    for dtype in [DType::F8E4M3, DType::F8E5M2, DType::E8M0, DType::U8] {
        let x = Tensor::from_bytes(&codes, [16, 16], dtype, g.device()).unwrap();
        let out = g.all_gather(&x).unwrap().into_result().unwrap();
        assert_eq!(out.dtype(), dtype);
        assert_eq!(out.shape().dims(), &[16, 16]);
        assert_eq!(out.to_bytes().unwrap(), codes, "{dtype}");
        let b = g.broadcast(x, 0).unwrap().into_result().unwrap();
        assert_eq!(b.to_bytes().unwrap(), codes, "{dtype}");
    }
    // Packed FP4: one element is a byte holding 2 values.
    let x = Tensor::from_bytes(&codes, [16, 16], DType::F4E2M1x2, g.device()).unwrap();
    let out = g.all_gather(&x).unwrap().into_result().unwrap();
    assert_eq!(out.to_bytes().unwrap(), codes);
    // FP8 cannot be reduced: a typed error before NCCL sees it.
    let x = Tensor::from_bytes(&codes, [256], DType::F8E4M3, g.device()).unwrap();
    let e = g.all_reduce(x, ReduceOp::Sum).unwrap_err();
    assert!(matches!(e, Error::DType { .. }), "{e}");
    assert!(!g.is_aborted());
}

#[test]
#[ignore = "needs a CUDA GPU: cargo xtask test-gpu"]
fn a_coalesced_group_matches_the_thread_group() {
    let (_s, g) = nccl_group_of_one(NcclOptions::default());
    let v = values(8 * 16, 2);
    let ints: Vec<i32> = (0..24).map(|i| i * 7 - 50).collect();
    let bytes: Vec<u8> = (0..40).map(|i| (i * 13) as u8).collect();
    same_as_thread_group(
        &g,
        |d| {
            vec![
                Collective::AllGather {
                    input: tensor(&v, [8, 16], DType::BF16, d),
                    output: Tensor::empty([8, 16], DType::BF16, d).unwrap(),
                },
                Collective::AllReduce {
                    tensor: tensor(&v, [8, 16], DType::F32, d),
                    op: ReduceOp::Max,
                },
                Collective::ReduceScatter {
                    input: Tensor::from_slice(&ints, [4, 6], d).unwrap(),
                    output: Tensor::empty([4, 6], DType::I32, d).unwrap(),
                    op: ReduceOp::Sum,
                },
                Collective::Broadcast {
                    tensor: Tensor::from_bytes(&bytes, [40], DType::F8E5M2, d).unwrap(),
                    root: 0,
                },
                Collective::AllReduce {
                    tensor: Tensor::from_slice(&[3i64, -4, 5], [3], d).unwrap(),
                    op: ReduceOp::Prod,
                },
            ]
        },
        "coalesced",
    );
    // Mismatched shapes are a typed error, not an NCCL call.
    let e = g
        .run(vec![Collective::AllGather {
            input: tensor(&v, [8, 16], DType::F32, g.device()),
            output: Tensor::empty([4, 16], DType::F32, g.device()).unwrap(),
        }])
        .unwrap_err();
    assert!(matches!(e, Error::Shape { .. }), "{e}");
    // Host tensors are rejected.
    let e = g
        .all_gather(&tensor(&v, [8, 16], DType::F32, Device::Cpu))
        .unwrap_err();
    assert!(matches!(e, Error::Device { .. }), "{e}");
    assert!(g.run(Vec::new()).unwrap().into_result().unwrap().is_empty());
}

#[test]
#[ignore = "needs a CUDA GPU: cargo xtask test-gpu"]
fn a_subgroup_by_split() {
    let (_s, g) = nccl_group_of_one(NcclOptions::default());
    let sub = g.new_subgroup(&[0]).unwrap().expect("rank 0 is a member");
    assert_eq!((sub.rank(), sub.size(), sub.device()), (0, 1, g.device()));
    let v = values(4 * 4, 3);
    let x = tensor(&v, [4, 4], DType::F32, sub.device());
    let out = sub
        .all_reduce(x, ReduceOp::Sum)
        .unwrap()
        .into_result()
        .unwrap();
    assert_eq!(out.to_vec::<f32>().unwrap(), v);
    sub.barrier().unwrap();
    // A subgroup of the subgroup, and bad rank lists.
    assert!(sub.new_subgroup(&[0]).unwrap().is_some());
    for bad in [&[][..], &[1], &[0, 0]] {
        let e = g.new_subgroup(bad).unwrap_err();
        assert!(matches!(e, Error::InvalidArgument { .. }), "{e}");
    }
    // The parent still works after splitting.
    g.barrier().unwrap();
}

#[test]
#[ignore = "needs a CUDA GPU: cargo xtask test-gpu"]
fn after_an_abort_collectives_fail_instead_of_hanging() {
    let (_s, g) = nccl_group_of_one(NcclOptions::default());
    let x = Tensor::from_slice(&[1f32, 2.0], [2], g.device()).unwrap();
    // A collective in flight when the communicator is aborted fails at its wait.
    let mut work = g.all_reduce(x.clone(), ReduceOp::Sum).unwrap();
    g.abort("test");
    assert!(g.is_aborted());
    let e = work.wait().unwrap_err();
    assert!(e.to_string().contains("aborted"), "{e}");
    // Later calls fail at once with the reason.
    let e = g.all_reduce(x.clone(), ReduceOp::Sum).unwrap_err();
    assert!(matches!(e, Error::State { .. }), "{e}");
    assert!(e.to_string().contains("rank 0: test"), "{e}");
    assert!(g.barrier().is_err());
    assert!(g.new_subgroup(&[0]).is_err());
    // The device itself is fine: a new group works.
    let (_s2, g2) = nccl_group_of_one(NcclOptions::default());
    let out = g2
        .all_reduce(x, ReduceOp::Sum)
        .unwrap()
        .into_result()
        .unwrap();
    assert_eq!(out.to_vec::<f32>().unwrap(), [1.0, 2.0]);
}

#[test]
#[ignore = "needs a CUDA GPU: cargo xtask test-gpu"]
fn a_rank_that_never_joins_times_out_instead_of_hanging() {
    // World size 2, but rank 1 never comes: rank 0's non-blocking init stays in
    // progress until the timeout, then is aborted.
    let s = store(2);
    let options = NcclOptions {
        init_timeout: Duration::from_secs(3),
        ..NcclOptions::default()
    };
    let start = Instant::now();
    let e = NcclGroup::new(&s, 0, 2, 0, options).unwrap_err();
    let took = start.elapsed();
    assert!(took >= Duration::from_secs(3), "{took:?}");
    assert!(took < Duration::from_secs(60), "{took:?}");
    assert!(
        matches!(e, Error::State { .. } | Error::Cuda { .. }),
        "{e:?}"
    );
    assert!(e.to_string().contains("ncclCommInitRankConfig"), "{e}");
}

/// Makes a fresh quantizer.
type MakeQuantizer = Box<dyn Fn() -> Box<dyn Quantizer> + Sync>;

#[test]
#[ignore = "needs a CUDA GPU: cargo xtask test-gpu"]
fn quantized_gather_at_world_size_one_through_nccl() {
    let (_s, g) = nccl_group_of_one(NcclOptions::default());
    let group: Arc<dyn ProcessGroup> = Arc::new(g);
    let v = values(64 * 32, 4);
    let on_gpu = tensor(&v, [64, 32], DType::F32, group.device());
    let on_cpu = tensor(&v, [64, 32], DType::F32, Device::Cpu);
    // The amax all-reduce runs through NCCL.
    let red = GroupAmaxReduction::new(group.clone());
    use tessera_quant::AmaxReduction;
    assert_eq!(red.all_reduce_max(3.5).unwrap(), 3.5);
    let makers: Vec<(&str, MakeQuantizer)> = vec![
        (
            "fp8 current",
            Box::new(|| Box::new(Fp8CurrentScaling::new(Fp8Format::E4M3))),
        ),
        (
            "mxfp8",
            Box::new(|| Box::new(Mxfp8Quantizer::new(Fp8Format::E4M3))),
        ),
    ];
    for (what, make) in &makers {
        let mut q = make();
        let got = gather_along_first_dim(
            &MaybeQuantized::Plain(on_gpu.clone()),
            &group,
            Some(q.as_mut()),
        )
        .unwrap()
        .into_result()
        .unwrap();
        let got = got.quantized().expect("quantized").clone();
        // The ThreadGroup reference, on the host.
        let want = run_ranks(1, |tg| -> Result<_> {
            let tg: Arc<dyn ProcessGroup> = Arc::new(tg);
            let mut q = make();
            gather_along_first_dim(
                &MaybeQuantized::Plain(on_cpu.clone()),
                &tg,
                Some(q.as_mut()),
            )?
            .into_result()
        })
        .unwrap()
        .pop()
        .unwrap()
        .unwrap();
        let want = want.quantized().expect("quantized");
        assert_eq!(got.shape(), want.shape(), "{what}");
        for ((n, a), (_, b)) in got.data_tensors().into_iter().zip(want.data_tensors()) {
            assert_eq!(a.to_bytes().unwrap(), b.to_bytes().unwrap(), "{what}: {n}");
        }
        // And with the amax reduction installed explicitly (an NCCL all-reduce inside
        // the quantizer).
        let mut q = make();
        q.set_amax_reduction(Some(Arc::new(GroupAmaxReduction::new(group.clone()))));
        let again = q.quantize(&on_gpu).unwrap();
        for ((n, a), (_, b)) in again.data_tensors().into_iter().zip(want.data_tensors()) {
            assert_eq!(
                a.to_bytes().unwrap(),
                b.to_bytes().unwrap(),
                "{what} (reduced amax): {n}"
            );
        }
        // A quantized input gathers as is.
        let gathered =
            gather_along_first_dim(&MaybeQuantized::Quantized(got.clone()), &group, None)
                .unwrap()
                .into_result()
                .unwrap();
        assert_eq!(
            gathered
                .quantized()
                .unwrap()
                .dequantize(DType::F32)
                .unwrap()
                .to_bytes()
                .unwrap(),
            want.dequantize(DType::F32).unwrap().to_bytes().unwrap(),
            "{what}"
        );
    }
}

#[test]
#[ignore = "needs a CUDA GPU: cargo xtask test-gpu"]
fn split_and_gather_1d_stay_on_the_device() {
    let (_s, g) = nccl_group_of_one(NcclOptions::default());
    for dtype in [DType::F32, DType::BF16] {
        let v = values(37 * 3, 11);
        let t = tensor(&v, [37, 3], dtype, g.device());
        let c = split_tensor_into_1d_equal_chunks(&t, &g).unwrap();
        assert_eq!(c.chunk.device(), g.device());
        assert_eq!(c.chunk.shape().dims(), &[37 * 3]);
        assert_eq!(c.chunk.to_bytes().unwrap(), t.to_bytes().unwrap());
        let back = gather_split_1d_tensor(&c, &g)
            .unwrap()
            .into_result()
            .unwrap();
        assert_eq!(back.device(), g.device());
        assert_eq!(back.shape(), t.shape());
        assert_eq!(back.to_bytes().unwrap(), t.to_bytes().unwrap(), "{dtype}");
    }
}

// ---------------------------------------------------------------------------------
// GPU tests with one thread per visible GPU (skipped on a one-GPU machine)
// ---------------------------------------------------------------------------------

/// Runs `f` on one NcclGroup rank per visible GPU, as threads of this process; `None`
/// when the machine has fewer than two GPUs.
fn on_every_gpu<R: Send>(f: impl Fn(Arc<dyn ProcessGroup>) -> R + Sync) -> Vec<R> {
    let n = tessera_core::cuda::device_count().unwrap();
    assert!(
        n >= 2,
        "multi-GPU tests need 2 or more GPUs, this machine has {n}: run `cargo xtask test-gpu --gpus N` on one"
    );
    let s0 = store(n);
    let addr = s0.addr().to_string();
    let f = &f;
    let s0 = &s0;
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

/// Small integers (exact in bf16, sums exact), different per rank.
fn int_values(n: usize, rank: usize) -> Vec<f32> {
    (0..n)
        .map(|i| ((i * 7 + rank * 3) % 13) as f32 - 6.0)
        .collect()
}

#[test]
#[ignore = "needs a CUDA GPU: cargo xtask test-gpu"]
fn multi_gpu_every_gpu_as_a_rank_matches_the_thread_group() {
    let ops = |rank: usize, world: usize, d: Device| -> Vec<Collective> {
        let v = int_values(4 * world * 8, rank);
        let mut ops = Vec::new();
        for dtype in [DType::F32, DType::BF16] {
            ops.push(Collective::AllGather {
                input: tensor(&v[..32], [4, 8], dtype, d),
                output: Tensor::empty([4 * world, 8], dtype, d).unwrap(),
            });
            ops.push(Collective::ReduceScatter {
                input: tensor(&v, [4 * world, 8], dtype, d),
                output: Tensor::empty([4, 8], dtype, d).unwrap(),
                op: ReduceOp::Sum,
            });
            ops.push(Collective::AllReduce {
                tensor: tensor(&v, [4 * world, 8], dtype, d),
                op: ReduceOp::Max,
            });
            ops.push(Collective::Broadcast {
                tensor: tensor(&v[..32], [4, 8], dtype, d),
                root: world - 1,
            });
        }
        ops
    };
    let got = on_every_gpu(|g| -> Vec<Vec<u8>> {
        let outs = g
            .run(ops(g.rank(), g.size(), g.device()))
            .unwrap()
            .into_result()
            .unwrap();
        g.barrier().unwrap();
        outs.iter().map(|t| t.to_bytes().unwrap()).collect()
    });
    let world = got.len();
    let want = run_ranks(world, |tg| -> Vec<Vec<u8>> {
        let outs = tg
            .run(ops(tg.rank(), world, Device::Cpu))
            .unwrap()
            .into_result()
            .unwrap();
        outs.iter().map(|t| t.to_bytes().unwrap()).collect()
    })
    .unwrap();
    assert_eq!(got, want);
}

#[test]
#[ignore = "needs a CUDA GPU: cargo xtask test-gpu"]
fn multi_gpu_every_gpu_as_a_rank_gathers_quantized_and_splits() {
    let results = on_every_gpu(|g| {
        let world = g.size();
        let rows = 32;
        let whole: Vec<f32> = values(world * rows * 64, 9);
        let shard = &whole[g.rank() * rows * 64..][..rows * 64];
        let x = tensor(shard, [rows, 64], DType::F32, g.device());
        let mut q = Fp8CurrentScaling::new(Fp8Format::E4M3);
        let got = gather_along_first_dim(&MaybeQuantized::Plain(x), &g, Some(&mut q))
            .unwrap()
            .into_result()
            .unwrap();
        let full = tensor(&whole, [world * rows, 64], DType::F32, Device::Cpu);
        let want = Fp8CurrentScaling::new(Fp8Format::E4M3)
            .quantize(&full)
            .unwrap();
        let got = got
            .quantized()
            .expect("quantized")
            .to_device(Device::Cpu)
            .unwrap();
        for ((n, a), (_, b)) in got.data_tensors().into_iter().zip(want.data_tensors()) {
            assert_eq!(
                a.to_bytes().unwrap(),
                b.to_bytes().unwrap(),
                "rank {}: {n}",
                g.rank()
            );
        }
        // Even ranks form a subgroup; odd ranks get None.
        let evens: Vec<usize> = (0..world).step_by(2).collect();
        let sub = g.new_subgroup(&evens).unwrap();
        assert_eq!(sub.is_some(), g.rank() % 2 == 0);
        if let Some(sub) = sub {
            assert_eq!(sub.size(), evens.len());
            assert_eq!(sub.rank(), g.rank() / 2);
            let t = Tensor::from_slice(&[g.rank() as f32], [1], sub.device()).unwrap();
            let s = sub
                .all_reduce(t, ReduceOp::Sum)
                .unwrap()
                .into_result()
                .unwrap();
            assert_eq!(
                s.to_vec::<f32>().unwrap()[0],
                evens.iter().sum::<usize>() as f32
            );
        }
        g.barrier().unwrap();
    });
    assert!(results.len() >= 2);
}

#[test]
#[ignore = "needs a CUDA GPU: cargo xtask test-gpu"]
fn multi_gpu_a_rank_that_skips_a_collective_times_out_and_aborts() {
    let n = tessera_core::cuda::device_count().unwrap();
    assert!(
        n >= 2,
        "multi-GPU tests need 2 or more GPUs, this machine has {n}"
    );
    let s0 = store(2);
    let addr = s0.addr().to_string();
    let options = NcclOptions {
        timeout: Duration::from_secs(3),
        init_timeout: Duration::from_secs(20),
        ..NcclOptions::default()
    };
    std::thread::scope(|sc| {
        let other = sc.spawn(|| {
            let s1 = Store::connect(&addr, 1, 2, Duration::from_secs(60)).unwrap();
            let g = NcclGroup::new(&s1, 1, 2, 1, options).unwrap();
            // Rank 1 never issues the all-reduce; it waits for rank 0's verdict, then
            // aborts (its peer is gone) rather than finalizing.
            s1.get("verdict").unwrap();
            g.abort("peer gave up");
        });
        let g = NcclGroup::new(&s0, 0, 2, 0, options).unwrap();
        let x = Tensor::from_slice(&[1f32; 1024], [1024], g.device()).unwrap();
        let start = Instant::now();
        let e = g
            .all_reduce(x, ReduceOp::Sum)
            .unwrap()
            .into_result()
            .unwrap_err();
        let took = start.elapsed();
        assert!(
            took >= Duration::from_secs(3) && took < Duration::from_secs(60),
            "{took:?}"
        );
        assert!(e.to_string().contains("did not complete within 3s"), "{e}");
        assert!(g.is_aborted());
        s0.set("verdict", b"done").unwrap();
        other.join().unwrap();
    });
}

// ---------------------------------------------------------------------------------
// One process per GPU, started by a launcher (torchrun conventions)
// ---------------------------------------------------------------------------------

/// Run once per rank with `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR` and
/// `MASTER_PORT` set (one process per GPU; `cargo xtask test-gpu --gpus N` starts them).
#[test]
#[ignore = "needs a CUDA GPU: cargo xtask test-gpu"]
fn multi_process_ranks_from_the_environment() {
    assert!(
        std::env::var_os("WORLD_SIZE").is_some(),
        "WORLD_SIZE is not set: start one process per GPU with the torchrun variables (cargo xtask test-gpu --gpus N does)"
    );
    let g = NcclGroup::from_env().unwrap();
    let (rank, world) = (g.rank(), g.size());
    assert!(g.store().is_some_and(|s| s.is_server() == (rank == 0)));
    let x = Tensor::from_slice(&[(rank + 1) as f32; 8], [2, 4], g.device()).unwrap();
    let sum = g
        .all_reduce(x.clone(), ReduceOp::Sum)
        .unwrap()
        .into_result()
        .unwrap();
    let want = (world * (world + 1) / 2) as f32;
    assert_eq!(sum.to_vec::<f32>().unwrap(), [want; 8]);
    let all = g.all_gather(&x).unwrap().into_result().unwrap();
    let v = all.to_vec::<f32>().unwrap();
    for r in 0..world {
        assert_eq!(v[r * 8..][..8], [(r + 1) as f32; 8]);
    }
    let b = g.broadcast(x, world - 1).unwrap().into_result().unwrap();
    assert_eq!(b.to_vec::<f32>().unwrap(), [world as f32; 8]);
    let sub = g.new_subgroup(&[0]).unwrap();
    assert_eq!(sub.is_some(), rank == 0);
    g.barrier().unwrap();
    // Rank 0 hosts the store: it leaves last.
    g.store()
        .unwrap()
        .barrier("ranks_from_the_environment/end")
        .unwrap();
}
