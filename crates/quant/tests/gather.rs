//! Wire layouts and the generic first-dimension gather (`tessera_quant::wire`,
//! `spec/formats.md` §3.6, §4.4, §5.5, §6.5, §7).
//!
//! For every format and option and world sizes 1..=4, a random tensor is split along
//! dim 0 into equal shards (whose M is a multiple of the format's block height), each
//! shard is quantized by its own "rank" — in its own thread, agreeing on per-tensor
//! amaxes through a simulated MAX all-reduce — and `gather_reference` of the shards
//! must equal, byte for byte, the quantization of the whole tensor.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use tessera_core::{DType, Device, Error, Result, Shape, Tensor};
use tessera_quant::wire::{self, Gather};
use tessera_quant::{
    AmaxReduction, BlockDim, BufferName, Fp8BlockQuantizer, Fp8CurrentScaling, Fp8DelayedScaling,
    Fp8Format, Mxfp8Quantizer, Nvfp4Quantizer, QuantizedTensor, Quantizer, Usage,
};
use tessera_rng::{Generator, GeneratorState};

// ---------------------------------------------------------------------------------------
// A simulated process group

/// Shared state of a simulated MAX all-reduce: per round, how many ranks arrived and
/// the running (NaN-ignoring) maximum.
struct Group {
    world: usize,
    rounds: Mutex<Vec<(usize, f32)>>,
    cv: Condvar,
}

/// One rank's handle on the group: its k-th call joins the group's k-th round.
struct Rank {
    group: Arc<Group>,
    round: AtomicUsize,
}

impl AmaxReduction for Rank {
    fn all_reduce_max(&self, amax: f32) -> Result<f32> {
        let round = self.round.fetch_add(1, Ordering::SeqCst);
        let g = &self.group;
        let mut rounds = g.rounds.lock().unwrap();
        if rounds.len() <= round {
            rounds.resize(round + 1, (0, 0.0));
        }
        rounds[round].0 += 1;
        rounds[round].1 = rounds[round].1.max(amax);
        g.cv.notify_all();
        let (rounds, timeout) =
            g.cv.wait_timeout_while(rounds, Duration::from_secs(60), |r| r[round].0 < g.world)
                .unwrap();
        if timeout.timed_out() {
            return Err(Error::state("test all-reduce", "a rank never arrived"));
        }
        Ok(rounds[round].1)
    }
}

fn group(world: usize) -> Vec<Arc<dyn AmaxReduction>> {
    let g = Arc::new(Group {
        world,
        rounds: Mutex::new(Vec::new()),
        cv: Condvar::new(),
    });
    (0..world)
        .map(|_| {
            Arc::new(Rank {
                group: g.clone(),
                round: AtomicUsize::new(0),
            }) as Arc<dyn AmaxReduction>
        })
        .collect()
}

// ---------------------------------------------------------------------------------------
// Inputs

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
    /// A value with a random sign, mantissa and exponent in [-6, 6], or 0.
    fn value(&mut self) -> f32 {
        let r = self.next_u64();
        if r.is_multiple_of(32) {
            return 0.0;
        }
        let m = 1.0 + (r >> 11) as f64 * 2f64.powi(-53);
        let e = (r % 13) as i32 - 6;
        let v = (m * 2f64.powi(e)) as f32;
        if r & (1 << 8) != 0 { -v } else { v }
    }
}

fn tensor(v: &[f32], dims: &[usize], dtype: DType) -> Tensor {
    Tensor::from_f32_values(v, dims, dtype, Device::Cpu).unwrap()
}

// ---------------------------------------------------------------------------------------
// Formats and options

#[derive(Debug, Clone, Copy)]
enum Cfg {
    Fp8Current {
        f: Fp8Format,
        pow2: bool,
    },
    Fp8Delayed {
        f: Fp8Format,
    },
    Mxfp8 {
        f: Fp8Format,
        two_d: bool,
        swizzled: bool,
    },
    Nvfp4 {
        two_d: bool,
        rht: bool,
        swizzled: bool,
        sr: bool,
    },
    Block {
        f: Fp8Format,
        dim: BlockDim,
        pow2: bool,
    },
}

const SR_SEED: u64 = 0x5EED;

fn all_cfgs() -> Vec<Cfg> {
    let mut v = Vec::new();
    for f in [Fp8Format::E4M3, Fp8Format::E5M2] {
        for pow2 in [false, true] {
            v.push(Cfg::Fp8Current { f, pow2 });
            for dim in [BlockDim::OneD, BlockDim::TwoD] {
                v.push(Cfg::Block { f, dim, pow2 });
            }
        }
        v.push(Cfg::Fp8Delayed { f });
        for two_d in [false, true] {
            for swizzled in [false, true] {
                v.push(Cfg::Mxfp8 { f, two_d, swizzled });
            }
        }
    }
    for two_d in [false, true] {
        for rht in [false, true] {
            for swizzled in [false, true] {
                for sr in [false, true] {
                    v.push(Cfg::Nvfp4 {
                        two_d,
                        rht,
                        swizzled,
                        sr,
                    });
                }
            }
        }
    }
    v
}

impl Cfg {
    fn usages(self) -> Vec<Usage> {
        match self {
            // Stochastic rounding draws its random bits in the order of the quantized
            // operand: a rank's rowwise operand is a contiguous slice of the whole
            // tensor's (so offset generators reproduce it), its columnwise operand
            // (xᵀ) is not, so only rowwise SR tensors can match a whole quantization.
            Cfg::Nvfp4 { sr: true, .. } => vec![Usage::Rowwise],
            _ => vec![Usage::Rowwise, Usage::Columnwise, Usage::Both],
        }
    }

    /// Shard shapes the format accepts: M a multiple of its block height.
    fn shard_shapes(self, usage: Usage) -> Vec<Vec<usize>> {
        match self {
            Cfg::Fp8Current { .. } | Cfg::Fp8Delayed { .. } => {
                vec![vec![3, 5], vec![2, 3, 64], vec![1, 7], vec![4, 1]]
            }
            Cfg::Mxfp8 { .. } => vec![vec![32, 64], vec![2, 16, 32], vec![64, 96]],
            Cfg::Nvfp4 { .. } => vec![vec![16, 32], vec![2, 8, 48], vec![32, 16]],
            Cfg::Block {
                dim: BlockDim::OneD,
                ..
            } if usage == Usage::Rowwise => {
                // 1-D rowwise blocks never cross rows: any M; ragged K.
                vec![vec![3, 200], vec![2, 3, 64], vec![1, 129], vec![5, 1]]
            }
            Cfg::Block { .. } => vec![vec![128, 200], vec![2, 64, 130], vec![128, 1]],
        }
    }

    /// The quantizer of one rank (`reduction`, and the SR generator at `sr_offset`).
    fn build(
        self,
        usage: Usage,
        reduction: Option<Arc<dyn AmaxReduction>>,
        sr_offset: u64,
    ) -> Box<dyn Quantizer> {
        match self {
            Cfg::Fp8Current { f, pow2 } => {
                let mut q = Fp8CurrentScaling::new(f)
                    .with_pow2_scales(pow2)
                    .with_usage(usage);
                if let Some(r) = reduction {
                    q = q.with_amax_reduction(r);
                }
                Box::new(q)
            }
            // Delayed scaling: every rank holds the same (reduced) scale.
            Cfg::Fp8Delayed { f } => Box::new(
                Fp8DelayedScaling::new(f, 8)
                    .unwrap()
                    .with_scale(37.5)
                    .unwrap()
                    .with_usage(usage),
            ),
            Cfg::Mxfp8 { f, two_d, swizzled } => Box::new(
                Mxfp8Quantizer::new(f)
                    .with_2d(two_d)
                    .with_swizzled_scales(swizzled)
                    .with_usage(usage),
            ),
            Cfg::Nvfp4 {
                two_d,
                rht,
                swizzled,
                sr,
            } => {
                let mut q = Nvfp4Quantizer::new()
                    .with_2d(two_d)
                    .with_rht(rht)
                    .with_swizzled_scales(swizzled)
                    .with_usage(usage);
                if sr {
                    let g = Generator::from_state(GeneratorState {
                        seed: SR_SEED,
                        offset: sr_offset,
                    })
                    .unwrap();
                    q = q.with_stochastic_rounding(Some(g));
                }
                if let Some(r) = reduction {
                    q = q.with_amax_reduction(r);
                }
                Box::new(q)
            }
            Cfg::Block { f, dim, pow2 } => Box::new(
                Fp8BlockQuantizer::new(f, dim)
                    .with_pow2_scales(pow2)
                    .with_usage(usage),
            ),
        }
    }
}

fn assert_same(got: &QuantizedTensor, want: &QuantizedTensor, what: &str) {
    assert_eq!(got.kind(), want.kind(), "{what}: kind");
    assert_eq!(got.shape(), want.shape(), "{what}: shape");
    assert_eq!(got.source_dtype(), want.source_dtype(), "{what}: dtype");
    assert_eq!(got.usage(), want.usage(), "{what}: usage");
    let names = |q: &QuantizedTensor| q.data_tensors().iter().map(|(n, _)| *n).collect::<Vec<_>>();
    assert_eq!(names(got), names(want), "{what}: buffers");
    for (name, w) in want.data_tensors() {
        let g = got.buffer(name).unwrap();
        assert_eq!(g.shape(), w.shape(), "{what}: {name} shape");
        assert_eq!(g.dtype(), w.dtype(), "{what}: {name} dtype");
        let (gb, wb) = (g.to_bytes().unwrap(), w.to_bytes().unwrap());
        if let Some(i) = gb.iter().zip(&wb).position(|(a, b)| a != b) {
            panic!(
                "{what}: {name} differs first at byte {i}: gathered {:#04x}, whole {:#04x}",
                gb[i], wb[i]
            );
        }
    }
}

/// Quantizes each shard on its own thread and gathers.
fn quantize_ranks(
    cfg: Cfg,
    usage: Usage,
    shards: &[Tensor],
    words_per_shard: u64,
) -> Vec<QuantizedTensor> {
    let ranks = group(shards.len());
    std::thread::scope(|s| {
        let handles: Vec<_> = shards
            .iter()
            .zip(ranks)
            .enumerate()
            .map(|(r, (x, red))| {
                s.spawn(move || {
                    let mut q = cfg.build(usage, Some(red), r as u64 * words_per_shard);
                    q.quantize(x).unwrap()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

#[test]
fn gathering_quantized_shards_equals_quantizing_the_whole() {
    let mut rng = Rng(0xC0FFEE);
    let dtypes = [DType::F32, DType::BF16, DType::F16];
    let mut cases = 0;
    for cfg in all_cfgs() {
        for usage in cfg.usages() {
            for world in 1..=4usize {
                let shapes = cfg.shard_shapes(usage);
                let dims = shapes[rng.below(shapes.len())].clone();
                let dtype = dtypes[rng.below(3)];
                let shard_n: usize = dims.iter().product();
                let v: Vec<f32> = (0..world * shard_n).map(|_| rng.value()).collect();
                let mut whole_dims = dims.clone();
                whole_dims[0] *= world;
                let whole = cfg
                    .build(usage, None, 0)
                    .quantize(&tensor(&v, &whole_dims, dtype))
                    .unwrap();
                let shards: Vec<Tensor> =
                    v.chunks(shard_n).map(|c| tensor(c, &dims, dtype)).collect();
                // A rank's rowwise SR operand starts shard_n elements (shard_n/4 words)
                // further into the whole tensor's stream.
                let parts = quantize_ranks(cfg, usage, &shards, (shard_n / 4) as u64);
                let what = format!("{cfg:?} {usage:?} world {world} shard {dims:?} {dtype}");
                let gathered =
                    wire::gather_reference(&parts).unwrap_or_else(|e| panic!("{what}: {e}"));
                assert_eq!(
                    gathered.shape(),
                    &wire::gathered_shape(&Shape::new(dims.clone()), world)
                );
                assert_same(&gathered, &whole, &what);
                cases += 1;
            }
        }
    }
    assert!(cases > 300, "{cases} cases");
}

/// The spec's wire behaviour of each buffer: per-tensor metadata is replicated,
/// buffers whose rows follow M are concatenated, transposed (M-inner) buffers are
/// interleaved with `swap_first_dims` (§11 item 1 and 3).
#[test]
fn wire_layout_describes_each_buffer() {
    use BufferName::*;
    use Gather::*;
    let expect = |cfg: Cfg| -> Vec<(BufferName, Gather)> {
        match cfg {
            Cfg::Fp8Current { .. } | Cfg::Fp8Delayed { .. } => {
                vec![
                    (Data, Rows),
                    (ScaleInv, Replicated),
                    (ColumnwiseData, Columns),
                ]
            }
            Cfg::Mxfp8 { .. } => vec![
                (Data, Rows),
                (ScaleInv, Rows),
                (ColumnwiseData, Rows),
                (ColumnwiseScaleInv, Rows),
            ],
            Cfg::Nvfp4 { .. } => vec![
                (Data, Rows),
                (ScaleInv, Rows),
                (ColumnwiseData, Columns),
                (ColumnwiseScaleInv, Columns),
                (Amax, Replicated),
                (ColumnwiseAmax, Replicated),
            ],
            Cfg::Block {
                dim: BlockDim::OneD,
                ..
            } => vec![
                (Data, Rows),
                (ScaleInv, Columns),
                (ColumnwiseData, Columns),
                (ColumnwiseScaleInv, Rows),
            ],
            Cfg::Block {
                dim: BlockDim::TwoD,
                ..
            } => vec![
                (Data, Rows),
                (ScaleInv, Rows),
                (ColumnwiseData, Columns),
                (ColumnwiseScaleInv, Columns),
            ],
        }
    };
    for cfg in all_cfgs() {
        let dims = cfg.shard_shapes(Usage::Both)[0].clone();
        let n: usize = dims.iter().product();
        let x = tensor(&vec![1.5; n], &dims, DType::F32);
        let qt = cfg.build(Usage::Both, None, 0).quantize(&x).unwrap();
        let mut got: Vec<(BufferName, Gather)> = wire::layout(&qt)
            .unwrap()
            .into_iter()
            .map(|w| (w.name, w.gather))
            .collect();
        let mut want = expect(cfg);
        got.sort_by_key(|g| g.0);
        want.sort_by_key(|g| g.0);
        assert_eq!(got, want, "{cfg:?}");
        // The packed send buffers are the valid regions: [rows, cols] of the buffer's
        // dtype, one per non-replicated buffer.
        let layout = wire::layout(&qt).unwrap();
        let packed = wire::pack(&qt).unwrap();
        assert_eq!(
            packed.len(),
            layout.iter().filter(|w| w.gather != Replicated).count()
        );
        for (name, t) in &packed {
            let w = layout.iter().find(|w| w.name == *name).unwrap();
            assert_eq!(t.shape().dims(), &w.valid, "{cfg:?} {name}");
            assert_eq!(t.dtype(), qt.buffer(*name).unwrap().dtype());
        }
    }
}

#[test]
fn gather_rejects_parts_with_different_per_tensor_metadata() {
    let a = tensor(&[1.0, -2.0, 3.0, 0.5], &[2, 2], DType::F32);
    let b = tensor(&[10.0, -2.0, 3.0, 0.5], &[2, 2], DType::F32);
    // Current scaling without amax reduction: different scale_inv.
    let q = |x: &Tensor| {
        Fp8CurrentScaling::new(Fp8Format::E4M3)
            .with_usage(Usage::Rowwise)
            .quantize(x)
            .unwrap()
    };
    let e = wire::gather_reference(&[q(&a), q(&b)]).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument { .. }), "{e:?}");
    let msg = e.to_string();
    assert!(
        msg.contains("scale_inv") && msg.contains("all-reduced amax"),
        "{msg}"
    );
    assert!(wire::gather_reference(&[q(&a), q(&a)]).is_ok());
    // Delayed scaling with different scales.
    let d = |s: f32| {
        Fp8DelayedScaling::new(Fp8Format::E4M3, 2)
            .unwrap()
            .with_scale(s)
            .unwrap()
            .quantize(&a)
            .unwrap()
    };
    assert!(wire::gather_reference(&[d(2.0), d(4.0)]).is_err());
    // NVFP4 without amax reduction: different amax.
    let big: Vec<f32> = (0..256).map(|i| i as f32 * 0.01).collect();
    let small: Vec<f32> = (0..256).map(|i| i as f32 * 0.001).collect();
    let n = |v: &[f32]| {
        Nvfp4Quantizer::new()
            .quantize(&tensor(v, &[16, 16], DType::F32))
            .unwrap()
    };
    let msg = wire::gather_reference(&[n(&big), n(&small)])
        .unwrap_err()
        .to_string();
    assert!(msg.contains("amax"), "{msg}");
    // Rowwise-only NVFP4: the rowwise amax alone must agree.
    let nr = |v: &[f32]| {
        Nvfp4Quantizer::new()
            .with_usage(Usage::Rowwise)
            .quantize(&tensor(v, &[16, 16], DType::F32))
            .unwrap()
    };
    assert!(wire::gather_reference(&[nr(&big), nr(&small)]).is_err());
    // Parts of different formats, shapes or usages.
    let m = Mxfp8Quantizer::new(Fp8Format::E4M3)
        .quantize(&tensor(&[1.0; 1024], &[32, 32], DType::F32))
        .unwrap();
    let m_row = Mxfp8Quantizer::new(Fp8Format::E4M3)
        .with_usage(Usage::Rowwise)
        .quantize(&tensor(&[1.0; 1024], &[32, 32], DType::F32))
        .unwrap();
    let m64 = Mxfp8Quantizer::new(Fp8Format::E4M3)
        .quantize(&tensor(&[1.0; 2048], &[64, 32], DType::F32))
        .unwrap();
    let m_e5 = Mxfp8Quantizer::new(Fp8Format::E5M2)
        .quantize(&tensor(&[1.0; 1024], &[32, 32], DType::F32))
        .unwrap();
    for other in [&m_row, &m_e5] {
        let e = wire::gather_reference(&[m.clone(), other.clone()]).unwrap_err();
        assert!(e.to_string().contains("rank 1"), "{e}");
    }
    // Shards of different first dimensions gather (beyond TE): [32, 32] + [64, 32].
    let g = wire::gather_reference(&[m.clone(), m64.clone()]).unwrap();
    let whole = Mxfp8Quantizer::new(Fp8Format::E4M3)
        .quantize(&tensor(&[1.0; 3072], &[96, 32], DType::F32))
        .unwrap();
    for ((n, a), (_, b)) in g.data_tensors().into_iter().zip(whole.data_tensors()) {
        assert_eq!(a.to_bytes().unwrap(), b.to_bytes().unwrap(), "{n}");
    }
    // Trailing dimensions must agree.
    let m_wide = Mxfp8Quantizer::new(Fp8Format::E4M3)
        .quantize(&tensor(&[1.0; 2048], &[32, 64], DType::F32))
        .unwrap();
    let e = wire::gather_reference(&[m.clone(), m_wide]).unwrap_err();
    assert!(e.to_string().contains("rank 1"), "{e}");
    assert!(wire::gather_reference(&[]).is_err());
}

#[test]
fn pack_rejects_shards_that_split_blocks() {
    // FP8 block scaling with columnwise data or 2-D tiles spans 128 rows of M.
    for (dim, usage, dims) in [
        (BlockDim::OneD, Usage::Both, vec![100, 128]),
        (BlockDim::OneD, Usage::Columnwise, vec![2, 50, 256]),
        (BlockDim::TwoD, Usage::Rowwise, vec![64, 128]),
    ] {
        let n: usize = dims.iter().product();
        let qt = Fp8BlockQuantizer::new(Fp8Format::E4M3, dim)
            .with_usage(usage)
            .quantize(&tensor(&vec![1.0; n], &dims, DType::F32))
            .unwrap();
        let e = wire::pack(&qt).unwrap_err();
        assert!(matches!(e, Error::Shape { .. }), "{e:?}");
        assert!(
            e.to_string()
                .contains("not a multiple of its 128-row blocks"),
            "{e}"
        );
        assert!(wire::gather_reference(&[qt.clone(), qt]).is_err());
    }
    // 1-D rowwise blocks never span rows: any M packs.
    let qt = Fp8BlockQuantizer::new(Fp8Format::E4M3, BlockDim::OneD)
        .with_usage(Usage::Rowwise)
        .quantize(&tensor(&[1.0; 300], &[3, 100], DType::F32))
        .unwrap();
    assert!(wire::pack(&qt).is_ok());
}

#[test]
fn unpack_checks_the_gathered_buffers() {
    let qt = Mxfp8Quantizer::new(Fp8Format::E4M3)
        .with_usage(Usage::Rowwise)
        .quantize(&tensor(&[1.0; 1024], &[32, 32], DType::F32))
        .unwrap();
    let mut gathered: std::collections::BTreeMap<_, _> =
        wire::pack(&qt).unwrap().into_iter().collect();
    // Right: two copies of each send buffer.
    let doubled: std::collections::BTreeMap<_, _> = gathered
        .iter()
        .map(|(n, t)| {
            let b = [t.to_bytes().unwrap(), t.to_bytes().unwrap()].concat();
            let d = t.shape().dims();
            (
                *n,
                Tensor::from_bytes(&b, [2 * d[0], d[1]], t.dtype(), Device::Cpu).unwrap(),
            )
        })
        .collect();
    let g = wire::unpack(&qt, 2, doubled).unwrap();
    assert_eq!(g.shape().dims(), &[64, 32]);
    // Wrong: world 2 but one rank's worth of rows, or a buffer missing.
    assert!(matches!(
        wire::unpack(&qt, 2, gathered.clone()),
        Err(Error::Shape { .. })
    ));
    gathered.remove(&BufferName::ScaleInv);
    assert!(wire::unpack(&qt, 1, gathered).is_err());
}

#[test]
fn unpack_plans_refuse_parts_that_do_not_line_up() {
    // Rank 1's part is one element wider across the gather axis than rank 0's: the
    // rowwise data (gathered along rows) must agree in columns, the columnwise data
    // (gathered along columns) in rows.
    for (usage, across) in [(Usage::Rowwise, "columns"), (Usage::Columnwise, "rows")] {
        let qt = Fp8CurrentScaling::new(Fp8Format::E4M3)
            .with_usage(usage)
            .quantize(&tensor(&[1.0; 256], &[16, 16], DType::F32))
            .unwrap();
        let e = wire::unpack_plans(&qt, &[16, 16], &mut |r, w| {
            let mut dims = w.valid;
            let axis = usize::from(w.gather == Gather::Rows);
            dims[axis] += r;
            Ok(wire::PartLayout {
                input: r,
                offset: 0,
                dims,
                pitch: dims[1],
            })
        })
        .unwrap_err();
        let msg = e.to_string();
        assert!(matches!(e, Error::Shape { .. }), "{usage:?}: {msg}");
        assert!(
            msg.contains("rank 1's") && msg.contains(&format!("17 {across}, rank 0's 16")),
            "{usage:?}: {msg}"
        );
    }
}
