//! The wire layout's pack and unpack where the tensors live (`tessera_collectives::packing`).
//!
//! CPU tests (always run): the host executor is `wire`'s, copy plans reject steps out
//! of bounds with typed errors, and the committed PTX is fresh. GPU tests (ignored;
//! `cargo xtask test-gpu`): for every format and random shapes — equal and uneven
//! shards, world sizes 1..=4 — the device pack, unpack and unpack_parts give the host
//! path's bytes exactly, and a world-size-1 NcclGroup gather of CUDA tensors equals
//! the ThreadGroup's on the host.

use std::collections::BTreeMap;

use tessera_collectives::packing;
use tessera_core::{DType, Device, Error, Shape, Tensor};
use tessera_quant::wire::{self, CopyPlan, CopyStep, PlanInput, SwizzleStep};
use tessera_quant::{
    BlockDim, BufferName, Fp8BlockQuantizer, Fp8CurrentScaling, Fp8Format, Mxfp8Quantizer,
    Nvfp4Quantizer, QuantizedTensor, Quantizer, Usage,
};

struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
    fn pick<T: Copy>(&mut self, v: &[T]) -> T {
        v[self.below(v.len())]
    }
    /// A value with a random sign, mantissa and exponent in [-6, 6].
    fn value(&mut self) -> f32 {
        let r = self.next_u64();
        let m = 1.0 + (r >> 11) as f64 * 2f64.powi(-53);
        let v = (m * 2f64.powi((r % 13) as i32 - 6)) as f32;
        if r & (1 << 8) != 0 { -v } else { v }
    }
}

/// A format with its options, the rows of M a rank's shard must cover, and the last
/// dimensions to try.
#[derive(Debug, Clone, Copy)]
enum Cfg {
    Fp8(Usage),
    Mxfp8 { two_d: bool, swizzled: bool },
    Nvfp4 { two_d: bool, swizzled: bool },
    Block(BlockDim, Usage),
}

fn all_cfgs() -> Vec<Cfg> {
    let mut v = vec![
        Cfg::Fp8(Usage::Both),
        Cfg::Fp8(Usage::Rowwise),
        Cfg::Fp8(Usage::Columnwise),
    ];
    for two_d in [false, true] {
        for swizzled in [false, true] {
            v.push(Cfg::Mxfp8 { two_d, swizzled });
            v.push(Cfg::Nvfp4 { two_d, swizzled });
        }
    }
    for dim in [BlockDim::OneD, BlockDim::TwoD] {
        v.push(Cfg::Block(dim, Usage::Both));
        v.push(Cfg::Block(dim, Usage::Columnwise));
    }
    v.push(Cfg::Block(BlockDim::OneD, Usage::Rowwise));
    v
}

impl Cfg {
    fn quantizer(self) -> Box<dyn Quantizer> {
        match self {
            Cfg::Fp8(u) => Box::new(Fp8CurrentScaling::new(Fp8Format::E4M3).with_usage(u)),
            Cfg::Mxfp8 { two_d, swizzled } => Box::new(
                Mxfp8Quantizer::new(Fp8Format::E4M3)
                    .with_2d(two_d)
                    .with_swizzled_scales(swizzled),
            ),
            Cfg::Nvfp4 { two_d, swizzled } => Box::new(
                Nvfp4Quantizer::new()
                    .with_2d(two_d)
                    .with_swizzled_scales(swizzled),
            ),
            Cfg::Block(dim, u) => {
                Box::new(Fp8BlockQuantizer::new(Fp8Format::E4M3, dim).with_usage(u))
            }
        }
    }

    /// The rows of M every rank's shard must cover.
    fn granule(self) -> usize {
        match self {
            Cfg::Fp8(_) | Cfg::Block(BlockDim::OneD, Usage::Rowwise) => 1,
            Cfg::Mxfp8 { .. } => 32,
            Cfg::Nvfp4 { .. } => 16,
            Cfg::Block(..) => 128,
        }
    }

    fn last_dims(self) -> &'static [usize] {
        match self {
            Cfg::Fp8(_) => &[1, 5, 33, 64],
            Cfg::Mxfp8 { .. } => &[32, 96, 160, 512],
            Cfg::Nvfp4 { .. } => &[16, 48, 80, 512],
            Cfg::Block(..) => &[1, 130, 200, 384],
        }
    }
}

fn host_tensor(rng: &mut Rng, dims: &[usize]) -> Tensor {
    let n: usize = dims.iter().product();
    let v: Vec<f32> = (0..n).map(|_| rng.value()).collect();
    Tensor::from_slice(&v, dims, Device::Cpu).unwrap()
}

/// Random shards of one tensor: `world` ranks, first dimensions equal or not, covering
/// whole blocks; sometimes rank 3 (a middle dimension of 2).
fn random_shards(rng: &mut Rng, cfg: Cfg, world: usize, equal: bool) -> (Vec<Tensor>, Vec<usize>) {
    let k = rng.pick(cfg.last_dims());
    let rank3 = rng.below(3) == 0;
    let g = cfg.granule();
    // With a middle dimension of 2, M = 2·d0: d0 needs only half the granule.
    let step = if rank3 { g.div_ceil(2) } else { g };
    let d_equal = step * (1 + rng.below(3));
    let d0s: Vec<usize> = (0..world)
        .map(|_| {
            if equal {
                d_equal
            } else {
                step * (1 + rng.below(4))
            }
        })
        .collect();
    let shards = d0s
        .iter()
        .map(|&d| {
            let dims: Vec<usize> = if rank3 { vec![d, 2, k] } else { vec![d, k] };
            host_tensor(rng, &dims)
        })
        .collect();
    (shards, d0s)
}

fn assert_same_tensor(what: &str, want: &Tensor, got: &Tensor, on: Device) {
    assert_eq!(got.device(), on, "{what}: device");
    assert_eq!(got.shape(), want.shape(), "{what}: shape");
    assert_eq!(got.dtype(), want.dtype(), "{what}: dtype");
    assert_eq!(
        got.to_bytes().unwrap(),
        want.to_bytes().unwrap(),
        "{what}: bytes"
    );
}

fn assert_same_quantized(what: &str, want: &QuantizedTensor, got: &QuantizedTensor, on: Device) {
    assert_eq!(got.kind(), want.kind(), "{what}: kind");
    assert_eq!(got.shape(), want.shape(), "{what}: shape");
    assert_eq!(got.usage(), want.usage(), "{what}: usage");
    let names = |q: &QuantizedTensor| q.data_tensors().iter().map(|(n, _)| *n).collect::<Vec<_>>();
    assert_eq!(names(got), names(want), "{what}: buffers");
    for ((n, w), (_, g)) in want.data_tensors().into_iter().zip(got.data_tensors()) {
        assert_same_tensor(&format!("{what}: {n}"), w, g, on);
    }
}

/// The per-buffer concatenation of the ranks' packed buffers: what an all-gather of
/// equal shards delivers.
fn concatenated(parts: &[BTreeMap<BufferName, Tensor>]) -> BTreeMap<BufferName, Tensor> {
    parts[0]
        .iter()
        .map(|(name, t0)| {
            let bytes: Vec<u8> = parts
                .iter()
                .flat_map(|p| p[name].to_bytes().unwrap())
                .collect();
            let d = t0.shape().dims();
            let t = Tensor::from_bytes(&bytes, [parts.len() * d[0], d[1]], t0.dtype(), Device::Cpu)
                .unwrap();
            (*name, t)
        })
        .collect()
}

/// What the uneven gather does with `parts` (rank r's packed buffers): each padded to
/// the largest rank's size with `wire::pad_plan`, the padded blocks concatenated (an
/// all-gather), and unpacked in place — parts read at a pitch wider than their rows.
/// Runs on the parts' device.
fn unpack_padded(
    local: &QuantizedTensor,
    parts: &[BTreeMap<BufferName, Tensor>],
    d0s: &[usize],
) -> QuantizedTensor {
    let mut gathered = BTreeMap::new();
    let mut maxes = BTreeMap::new();
    for (name, t0) in &parts[0] {
        let max = [0, 1].map(|i| {
            parts
                .iter()
                .map(|p| p[name].shape().dims()[i])
                .max()
                .unwrap()
        });
        let blocks: Vec<Tensor> = parts
            .iter()
            .map(|p| {
                let t = &p[name];
                let d = t.shape().dims();
                let plan = wire::pad_plan(*name, t.dtype(), [d[0], d[1]], max);
                packing::execute(&plan, &[PlanInput::whole(t)]).unwrap()
            })
            .collect();
        // Concatenate the blocks with one more plan (on the same device).
        let mut join = CopyPlan {
            name: *name,
            dtype: t0.dtype(),
            shape: Shape::new([parts.len() * max[0], max[1]]),
            zeroed: false,
            steps: Vec::new(),
        };
        let block = max[0] * max[1] * t0.dtype().size_in_bytes();
        for r in 0..parts.len() {
            join.push_strided(r, [0, block], [r * block, block], 1, block);
        }
        let inputs: Vec<PlanInput<'_>> = blocks.iter().map(PlanInput::whole).collect();
        gathered.insert(*name, packing::execute(&join, &inputs).unwrap());
        maxes.insert(*name, (max, block));
    }
    let plan = wire::unpack_plans(local, d0s, &mut |r, w| {
        let (max, block) = maxes[&w.name];
        let d = parts[r][&w.name].shape().dims();
        Ok(wire::PartLayout {
            input: 0,
            offset: r * block,
            dims: [d[0], d[1]],
            pitch: max[1],
        })
    })
    .unwrap();
    plan.run(
        local,
        &|name| Ok(vec![PlanInput::whole(&gathered[&name])]),
        &packing::execute,
    )
    .unwrap()
}

// ---------------------------------------------------------------------------------
// CPU tests
// ---------------------------------------------------------------------------------

#[test]
fn committed_wire_ptx_is_fresh() {
    tessera_core::kernels::check_ptx_fresh(
        "crates/collectives/kernels/wire.cu",
        include_str!("../kernels/wire.cu"),
        include_str!("../kernels/ptx/wire.ptx"),
    )
    .unwrap();
}

#[test]
fn host_packing_is_the_wire_host_path() {
    let mut rng = Rng(7);
    for cfg in all_cfgs() {
        for equal in [true, false] {
            let world = 1 + rng.below(4);
            let (shards, d0s) = random_shards(&mut rng, cfg, world, equal);
            let qs: Vec<QuantizedTensor> = shards
                .iter()
                .map(|x| cfg.quantizer().quantize(x).unwrap())
                .collect();
            let what = format!("{cfg:?} {d0s:?}");
            let mut parts = Vec::new();
            for q in &qs {
                let want = wire::pack(q).unwrap();
                let got = packing::pack(q).unwrap();
                assert_eq!(want.len(), got.len(), "{what}");
                for ((n, w), (m, g)) in want.iter().zip(&got) {
                    assert_eq!(n, m, "{what}");
                    assert_same_tensor(&format!("{what} pack {n}"), w, g, Device::Cpu);
                }
                parts.push(got.into_iter().collect::<BTreeMap<_, _>>());
            }
            let want = wire::unpack_parts(&qs[0], &parts, &d0s).unwrap();
            let got = packing::unpack_parts(&qs[0], &parts, &d0s).unwrap();
            assert_same_quantized(&what, &want, &got, Device::Cpu);
            let padded = unpack_padded(&qs[0], &parts, &d0s);
            assert_same_quantized(&format!("{what} padded"), &want, &padded, Device::Cpu);
            if equal {
                let g = concatenated(&parts);
                let got = packing::unpack(&qs[0], world, &g).unwrap();
                assert_same_quantized(&format!("{what} equal"), &want, &got, Device::Cpu);
            }
        }
    }
}

#[test]
fn unpack_rejects_parts_that_do_not_fit() {
    let x = Tensor::from_slice(&[1.0f32; 64 * 64], [64, 64], Device::Cpu).unwrap();
    let q = Mxfp8Quantizer::new(Fp8Format::E4M3).quantize(&x).unwrap();
    let parts: BTreeMap<BufferName, Tensor> = packing::pack(&q).unwrap().into_iter().collect();
    // Rank 1 claims a first dimension its buffers do not have.
    let e = packing::unpack_parts(&q, &[parts.clone(), parts.clone()], &[64, 96]).unwrap_err();
    assert!(matches!(e, Error::Shape { .. }), "{e:?}");
    assert!(e.to_string().contains("join to"), "{e}");
    // A gathered buffer of the wrong size.
    let mut g = concatenated(&[parts.clone(), parts.clone()]);
    g.insert(
        BufferName::Data,
        Tensor::zeros([64, 64], DType::F8E4M3, Device::Cpu).unwrap(),
    );
    let e = packing::unpack(&q, 2, &g).unwrap_err();
    assert!(e.to_string().contains("gathered `data`"), "{e}");
    assert!(packing::unpack(&q, 0, &g).is_err());
    assert!(packing::unpack_parts(&q, &[], &[]).is_err());
}

#[test]
fn copy_plans_check_every_step_against_the_buffers() {
    let input = Tensor::from_slice(&(0..64u8).collect::<Vec<_>>(), [8, 8], Device::Cpu).unwrap();
    let plan = |steps: Vec<CopyStep>| CopyPlan {
        name: BufferName::Data,
        dtype: DType::U8,
        shape: Shape::new([4, 4]),
        zeroed: true,
        steps,
    };
    let strided =
        |src_offset, src_pitch, dst_offset, dst_pitch, rows, row_bytes| CopyStep::Strided {
            src: 0,
            src_offset,
            src_pitch,
            dst_offset,
            dst_pitch,
            rows,
            row_bytes,
        };
    let run = |p: CopyPlan| packing::execute(&p, &[PlanInput::whole(&input)]);
    // A 2-D copy: the top-left 3x2 of the 8x8 input into rows 1.. of the 4x4 output.
    let out = run(plan(vec![strided(0, 8, 4, 4, 3, 2)])).unwrap();
    assert_eq!(
        out.as_slice::<u8>().unwrap(),
        &[0, 0, 0, 0, 0, 1, 0, 0, 8, 9, 0, 0, 16, 17, 0, 0]
    );
    let shape_error = |p: CopyPlan| {
        let e = run(p).unwrap_err();
        assert!(matches!(e, Error::Shape { .. }), "{e:?}");
        e.to_string()
    };
    assert!(shape_error(plan(vec![strided(0, 8, 0, 4, 5, 4)])).contains("output"));
    assert!(shape_error(plan(vec![strided(60, 8, 0, 4, 1, 8)])).contains("input"));
    assert!(shape_error(plan(vec![strided(0, 2, 0, 4, 2, 4)])).contains("overlap"));
    // An input that does not exist, or starts past its tensor.
    let mut p = plan(vec![strided(0, 8, 0, 4, 1, 4)]);
    if let CopyStep::Strided { src, .. } = &mut p.steps[0] {
        *src = 1;
    }
    assert!(matches!(run(p).unwrap_err(), Error::InvalidArgument { .. }));
    let p = plan(vec![strided(0, 8, 0, 4, 1, 4)]);
    let e = packing::execute(
        &p,
        &[PlanInput {
            tensor: &input,
            offset: 65,
        }],
    )
    .unwrap_err();
    assert!(e.to_string().contains("starts at byte 65"), "{e}");
    // A swizzle needs a grid of 128-row tiles, and coordinates inside it.
    let swizzle = |grid_cols, row0| {
        CopyStep::Swizzle(SwizzleStep {
            src: 0,
            to_grid: false,
            compact_offset: 0,
            compact_pitch: 4,
            rows: 4,
            cols: 4,
            row0,
            col0: 0,
            grid_cols,
            transposed: false,
        })
    };
    assert!(shape_error(plan(vec![swizzle(4, 0)])).contains("not a swizzled grid"));
    let grid = Tensor::from_slice(&vec![3u8; 128 * 4], [128, 4], Device::Cpu).unwrap();
    let sw = |row0| packing::execute(&plan(vec![swizzle(4, row0)]), &[PlanInput::whole(&grid)]);
    assert!(
        sw(0)
            .unwrap()
            .as_slice::<u8>()
            .unwrap()
            .iter()
            .all(|&b| b == 3)
    );
    assert!(sw(125).unwrap_err().to_string().contains("outside"));
}

// ---------------------------------------------------------------------------------
// GPU tests
// ---------------------------------------------------------------------------------

#[cfg(feature = "cuda")]
mod gpu {
    use super::*;
    use std::sync::Arc;
    use std::time::Duration;
    use tessera_collectives::{
        MaybeQuantized, NcclGroup, NcclOptions, ProcessGroup, Store, ThreadGroup,
        gather_along_first_dim_uneven, gather_quantized,
    };

    fn gpu() -> Device {
        let d = tessera_core::cuda::device(0).expect("the GPU tests need CUDA device 0");
        Device::Cuda(d.ordinal())
    }

    /// Frees a poisoned allocation, so the stream's memory pool hands out non-zero
    /// bytes next: a device output a plan fails to write (or to zero) shows.
    fn poison_the_pool(on: Device) {
        drop(Tensor::filled_with_byte([4 << 20], DType::U8, on, 0xA5).unwrap());
    }

    fn to_device(parts: &BTreeMap<BufferName, Tensor>, on: Device) -> BTreeMap<BufferName, Tensor> {
        parts
            .iter()
            .map(|(n, t)| (*n, t.to_device(on).unwrap()))
            .collect()
    }

    #[test]
    #[ignore = "needs a CUDA GPU: cargo xtask test-gpu"]
    fn device_wire_pack_and_unpack_equal_the_host_path_bit_for_bit() {
        let on = gpu();
        let mut rng = Rng(0x5EED);
        let mut cases = 0;
        for cfg in all_cfgs() {
            for trial in 0..6 {
                let equal = trial % 2 == 0;
                let world = 1 + rng.below(4);
                let (shards, d0s) = random_shards(&mut rng, cfg, world, equal);
                let what = format!("{cfg:?} trial {trial}: {:?} x {d0s:?}", shards[0].shape());
                let qs: Vec<QuantizedTensor> = shards
                    .iter()
                    .map(|x| cfg.quantizer().quantize(x).unwrap())
                    .collect();
                let qs_dev: Vec<QuantizedTensor> =
                    qs.iter().map(|q| q.to_device(on).unwrap()).collect();
                // Pack: every rank's send buffers, on the device and on the host.
                let mut host_parts = Vec::new();
                let mut dev_parts = Vec::new();
                for (r, (q, qd)) in qs.iter().zip(&qs_dev).enumerate() {
                    let want = wire::pack(q).unwrap();
                    poison_the_pool(on);
                    let got = packing::pack(qd).unwrap();
                    assert_eq!(want.len(), got.len(), "{what}");
                    for ((n, w), (m, g)) in want.iter().zip(&got) {
                        assert_eq!(n, m, "{what}");
                        assert_same_tensor(&format!("{what}: rank {r} pack {n}"), w, g, on);
                    }
                    host_parts.push(want.into_iter().collect::<BTreeMap<_, _>>());
                    dev_parts.push(got.into_iter().collect::<BTreeMap<_, _>>());
                }
                // Unpack the parts (uneven or not): device parts against host parts.
                let want = wire::unpack_parts(&qs[0], &host_parts, &d0s).unwrap();
                poison_the_pool(on);
                let got = packing::unpack_parts(&qs_dev[0], &dev_parts, &d0s).unwrap();
                assert_same_quantized(&format!("{what}: unpack_parts"), &want, &got, on);
                // Host-packed parts uploaded unpack the same way.
                let uploaded: Vec<_> = host_parts.iter().map(|p| to_device(p, on)).collect();
                poison_the_pool(on);
                let again = packing::unpack_parts(&qs_dev[0], &uploaded, &d0s).unwrap();
                assert_same_quantized(
                    &format!("{what}: unpack_parts (uploaded)"),
                    &want,
                    &again,
                    on,
                );
                // Parts padded to the largest rank's and read at that pitch (the uneven
                // gather's layout).
                poison_the_pool(on);
                let padded = unpack_padded(&qs_dev[0], &dev_parts, &d0s);
                assert_same_quantized(&format!("{what}: padded parts"), &want, &padded, on);
                if equal {
                    // Unpack of an all-gather's output: one buffer holding every rank's
                    // block.
                    let g = concatenated(&host_parts);
                    let want = wire::unpack(&qs[0], world, g.clone()).unwrap();
                    poison_the_pool(on);
                    let got = packing::unpack(&qs_dev[0], world, &to_device(&g, on)).unwrap();
                    assert_same_quantized(&format!("{what}: unpack"), &want, &got, on);
                }
                cases += 1;
            }
        }
        eprintln!("{cases} cases, every buffer bit-identical to the host path");
    }

    #[test]
    #[ignore = "needs a CUDA GPU: cargo xtask test-gpu"]
    fn device_wire_gather_of_cuda_tensors_through_nccl_equals_the_host_gather() {
        let on = gpu();
        let store = Store::serve("127.0.0.1:0", 1, Duration::from_secs(60)).unwrap();
        let nccl: Arc<dyn ProcessGroup> =
            Arc::new(NcclGroup::new(&store, 0, 1, 0, NcclOptions::default()).unwrap());
        assert_eq!(nccl.device(), on);
        let threads: Arc<dyn ProcessGroup> = Arc::new(ThreadGroup::new(1).unwrap().pop().unwrap());
        let mut rng = Rng(0xBEEF);
        for cfg in all_cfgs() {
            for _ in 0..2 {
                let (shards, d0s) = random_shards(&mut rng, cfg, 1, true);
                let what = format!("{cfg:?} {:?}", shards[0].shape());
                let q = cfg.quantizer().quantize(&shards[0]).unwrap();
                let want = match gather_quantized(q.clone(), &threads)
                    .unwrap()
                    .into_result()
                    .unwrap()
                {
                    MaybeQuantized::Quantized(w) => w,
                    MaybeQuantized::Plain(_) => panic!("{what}: the host gather fell back"),
                };
                // The gather of one rank is the tensor itself.
                assert_same_quantized(&format!("{what}: host"), &q, &want, Device::Cpu);
                poison_the_pool(on);
                let got = gather_quantized(q.to_device(on).unwrap(), &nccl)
                    .unwrap()
                    .into_result()
                    .unwrap();
                let got = got
                    .quantized()
                    .unwrap_or_else(|| panic!("{what}: fell back"));
                assert_same_quantized(&format!("{what}: nccl"), &want, got, on);
                // The uneven entry point (one rank: equal shards) agrees.
                let got = gather_along_first_dim_uneven(
                    &MaybeQuantized::Quantized(q.to_device(on).unwrap()),
                    &nccl,
                    None,
                    &d0s,
                )
                .unwrap()
                .into_result()
                .unwrap();
                assert_same_quantized(
                    &format!("{what}: uneven"),
                    &want,
                    got.quantized().unwrap(),
                    on,
                );
            }
        }
        // Plain CUDA tensors through the uneven gather's padding plans.
        let x = host_tensor(&mut rng, &[5, 7]);
        let got = gather_along_first_dim_uneven(
            &MaybeQuantized::Plain(x.to_device(on).unwrap()),
            &nccl,
            None,
            &[5],
        )
        .unwrap()
        .into_result()
        .unwrap();
        let MaybeQuantized::Plain(got) = got else {
            panic!("plain in, plain out")
        };
        assert_same_tensor("plain", &x, &got, on);
    }
}
