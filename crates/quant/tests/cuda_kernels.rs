//! GPU tests of the tessera-quant kernels: every CUDA path against the CPU reference,
//! byte for byte, on random shapes and values (including NaN, ±Inf, zeros, subnormals
//! and huge magnitudes), with poisoned outputs. Run with `cargo xtask test-gpu`.
#![cfg(feature = "cuda")]

use std::collections::BTreeMap;
use tessera_core::cuda::is_available;
use tessera_core::{DType, Device, Replay, Tensor};

use tessera_quant::{
    BlockDim, BufferName, Fp8BlockQuantizer, Fp8CurrentScaling, Fp8DelayedScaling, Fp8Format,
    Mxfp8Quantizer, Nvfp4Quantizer, QuantizedTensor, Quantizer, Usage,
};
use tessera_rng::Generator;

const GPU: Device = Device::Cuda(0);

fn require_gpu() {
    assert!(
        is_available(),
        "these tests need a CUDA GPU; run them with `cargo xtask test-gpu`"
    );
}

/// Random values with block-varying magnitudes and specials sprinkled in.
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut g = Generator::new(seed);
    let mut z = vec![0f32; n];
    g.fill_normal(&mut z, 0.0, 1.0);
    let mut w = vec![0u32; n];
    g.fill_u32(&mut w);
    let specials = [
        f32::NAN,
        -f32::NAN,
        f32::INFINITY,
        f32::NEG_INFINITY,
        0.0,
        -0.0,
        1e-42,
        -3e38,
        3e38,
        1e-30,
    ];
    z.iter()
        .zip(&w)
        .enumerate()
        .map(|(i, (&v, &r))| {
            if r % 97 == 0 {
                specials[(r as usize / 97) % specials.len()]
            } else {
                // magnitudes from 2^-20 to 2^20, changing every 64 elements
                v * 2f32.powi(((i / 64) as i32 * 7 % 41) - 20)
            }
        })
        .collect()
}

fn input(shape: &[usize], dtype: DType, seed: u64) -> Tensor {
    let n: usize = shape.iter().product();
    tensor_of(&values(n, seed), shape, dtype)
}

/// `v` as a CPU tensor of `dtype` (f32, bf16 or f16; rounded to nearest).
fn tensor_of(v: &[f32], shape: &[usize], dtype: DType) -> Tensor {
    Tensor::from_f32_values(v, shape, dtype, Device::Cpu).unwrap()
}

/// Shapes covering vector widths, tile edges (64) and ragged sizes.
const SHAPES: &[&[usize]] = &[
    &[1],
    &[7],
    &[16],
    &[1, 33],
    &[3, 5],
    &[64, 64],
    &[65, 63],
    &[128, 256],
    &[2, 3, 40],
    &[257, 129],
    &[1000, 24],
    &[512, 1030],
];

fn assert_same(gpu: &QuantizedTensor, cpu: &QuantizedTensor, what: &str) {
    assert_eq!(
        gpu.device(),
        GPU,
        "{what}: GPU result must stay on the device"
    );
    assert_eq!(gpu.shape(), cpu.shape(), "{what}");
    let g = gpu.data_tensors();
    let c = cpu.data_tensors();
    assert_eq!(
        g.iter().map(|(n, _)| *n).collect::<Vec<_>>(),
        c.iter().map(|(n, _)| *n).collect::<Vec<_>>(),
        "{what}: buffer lists"
    );
    for ((name, gt), (_, ct)) in g.iter().zip(&c) {
        assert_eq!(gt.dtype(), ct.dtype(), "{what}: {name} dtype");
        assert_eq!(gt.shape(), ct.shape(), "{what}: {name} shape");
        let (gb, cb) = (gt.to_bytes().unwrap(), ct.to_bytes().unwrap());
        if gb != cb {
            let i = gb.iter().zip(&cb).position(|(a, b)| a != b).unwrap();
            panic!(
                "{what}: buffer {name} differs first at byte {i}: gpu {:#04x} cpu {:#04x}",
                gb[i], cb[i]
            );
        }
    }
}

/// An output for `q` on the GPU whose every byte is 0xA5, so a byte the kernels leave
/// unwritten shows up in the comparison.
fn poisoned_output(q: &dyn Quantizer, x: &Tensor) -> QuantizedTensor {
    let empty = q.make_empty(x.shape(), x.dtype(), GPU).unwrap();
    let buffers: BTreeMap<_, _> = empty
        .data_tensors()
        .into_iter()
        .map(|(n, t)| {
            (
                n,
                Tensor::filled_with_byte(t.shape(), t.dtype(), GPU, 0xA5).unwrap(),
            )
        })
        .collect();
    QuantizedTensor::from_buffers(empty.kind(), empty.shape().clone(), x.dtype(), buffers).unwrap()
}

/// Quantizes on the CPU, on the GPU, and on the GPU into a poisoned output; all three
/// must agree byte for byte, and so must the dequantized values of each orientation (also
/// when written into an output poisoned with 0xFF bytes, so an unwritten element shows).
///
/// Each call quantizes with a clone of `q`, so quantizers whose state advances per call
/// (NVFP4's stochastic-rounding generator) draw the same bits every time.
fn check_quantizer<Q: Quantizer + Clone>(q: &mut Q, x: &Tensor, what: &str) {
    let cpu = q.clone().quantize(x).unwrap();
    let xd = x.to_device(GPU).unwrap();
    let gpu = q.clone().quantize(&xd).unwrap();
    assert_same(&gpu, &cpu, what);
    let mut q = q.clone();
    let mut out = poisoned_output(&q, x);
    q.quantize_into(&xd, &mut out).unwrap();
    assert_same(&out, &cpu, &format!("{what} (into poisoned output)"));
    for u in [Usage::Rowwise, Usage::Columnwise] {
        let has = match u {
            Usage::Rowwise => cpu.buffer(BufferName::Data).is_some(),
            _ => cpu.buffer(BufferName::ColumnwiseData).is_some(),
        };
        if !has {
            continue;
        }
        for dt in [DType::F32, DType::BF16, DType::F16] {
            let d_cpu = cpu.dequantize_usage(u, dt).unwrap().to_bytes().unwrap();
            let d_gpu = gpu.dequantize_usage(u, dt).unwrap();
            assert_eq!(d_gpu.device(), GPU);
            assert_eq!(
                d_gpu.to_bytes().unwrap(),
                d_cpu,
                "{what}: dequantize {u:?} to {dt}"
            );
            let mut out = Tensor::filled_with_byte(x.shape().clone(), dt, GPU, 0xFF).unwrap();
            gpu.dequantize_into(u, &mut out).unwrap();
            assert_eq!(
                out.to_bytes().unwrap(),
                d_cpu,
                "{what}: dequantize {u:?} to {dt} (into a poisoned output)"
            );
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU: cargo xtask test-gpu"]
fn mxfp8_matches_the_cpu() {
    require_gpu();
    let shapes: &[&[usize]] = &[
        &[32, 32],
        &[64, 96],
        &[96, 160],
        &[128, 256],
        &[2, 48, 64],
        &[256, 32],
        &[320, 416],
    ];
    let mut seed = 500;
    for &shape in shapes {
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            for format in [Fp8Format::E4M3, Fp8Format::E5M2] {
                for two_d in [false, true] {
                    for swizzled in [false, true] {
                        for usage in [Usage::Rowwise, Usage::Columnwise, Usage::Both] {
                            seed += 1;
                            let x = input(shape, dtype, seed);
                            let mut q = Mxfp8Quantizer::new(format)
                                .with_2d(two_d)
                                .with_swizzled_scales(swizzled)
                                .with_usage(usage);
                            let what = format!(
                                "mxfp8 {shape:?} {dtype} {format:?} 2d={two_d} swizzled={swizzled} {usage:?}"
                            );
                            check_quantizer(&mut q, &x, &what);
                        }
                    }
                }
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU: cargo xtask test-gpu"]
fn fp8_block_scaling_matches_the_cpu() {
    require_gpu();
    let shapes: &[&[usize]] = &[
        &[1],
        &[7],
        &[3, 5],
        &[128, 128],
        &[129, 130],
        &[200, 300],
        &[256, 512],
        &[2, 70, 130],
        &[1, 1000],
    ];
    let mut seed = 900;
    for &shape in shapes {
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            for format in [Fp8Format::E4M3, Fp8Format::E5M2] {
                for dim in [BlockDim::OneD, BlockDim::TwoD] {
                    for pow2 in [true, false] {
                        for usage in [Usage::Rowwise, Usage::Columnwise, Usage::Both] {
                            seed += 1;
                            let x = input(shape, dtype, seed);
                            let mut q = Fp8BlockQuantizer::new(format, dim)
                                .with_pow2_scales(pow2)
                                .with_usage(usage);
                            let what = format!(
                                "fp8-block {shape:?} {dtype} {format:?} {dim:?} pow2={pow2} {usage:?}"
                            );
                            check_quantizer(&mut q, &x, &what);
                        }
                    }
                }
            }
        }
    }
    // amax epsilon
    let x = input(&[130, 260], DType::BF16, 3);
    check_quantizer(
        &mut Fp8BlockQuantizer::new(Fp8Format::E4M3, BlockDim::OneD).with_amax_epsilon(0.5),
        &x,
        "fp8-block eps",
    );
}

#[test]
#[ignore = "needs a CUDA GPU: cargo xtask test-gpu"]
fn fp8_current_scaling_matches_the_cpu() {
    require_gpu();
    let mut seed = 1;
    for &shape in SHAPES {
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            for format in [Fp8Format::E4M3, Fp8Format::E5M2] {
                for usage in [Usage::Rowwise, Usage::Columnwise, Usage::Both] {
                    for pow2 in [false, true] {
                        seed += 1;
                        let x = input(shape, dtype, seed);
                        let mut q = Fp8CurrentScaling::new(format)
                            .with_usage(usage)
                            .with_pow2_scales(pow2);
                        let what =
                            format!("current {shape:?} {dtype} {format:?} {usage:?} pow2={pow2}");
                        check_quantizer(&mut q, &x, &what);
                        let cpu = q.quantize(&x).unwrap();
                        let gpu = q.quantize(&x.to_device(GPU).unwrap()).unwrap();
                        let what =
                            format!("current {shape:?} {dtype} {format:?} {usage:?} pow2={pow2}");
                        assert_same(&gpu, &cpu, &what);
                        for u in [Usage::Rowwise, Usage::Columnwise] {
                            if (u == Usage::Rowwise && !usage.rowwise())
                                || (u == Usage::Columnwise && !usage.columnwise())
                            {
                                continue;
                            }
                            for out in [DType::F32, DType::BF16, DType::F16] {
                                let d_cpu =
                                    cpu.dequantize_usage(u, out).unwrap().to_bytes().unwrap();
                                let d_gpu = gpu.dequantize_usage(u, out).unwrap();
                                assert_eq!(d_gpu.device(), GPU);
                                assert_eq!(
                                    d_gpu.to_bytes().unwrap(),
                                    d_cpu,
                                    "{what}: dequantize {u:?} to {out}"
                                );
                            }
                        }
                    }
                }
            }
        }
    }
}

/// Tensors with a zero dimension quantize on the device to what the CPU gives (empty
/// data, scale grids with their padding written) and dequantize to empty tensors, for
/// every format and each way a dimension can be empty.
#[test]
#[ignore = "needs a CUDA GPU: cargo xtask test-gpu"]
fn empty_tensors_match_the_cpu() {
    require_gpu();
    let zeros = |dims: &[usize]| Tensor::zeros(dims, DType::BF16, Device::Cpu).unwrap();
    for dims in [&[0, 5][..], &[5, 0], &[0], &[0, 0]] {
        let x = zeros(dims);
        for usage in [Usage::Rowwise, Usage::Both] {
            let what = format!("{dims:?} {usage:?}");
            let mut q = Fp8CurrentScaling::new(Fp8Format::E4M3).with_usage(usage);
            check_quantizer(&mut q, &x, &format!("current {what}"));
            let mut q = Fp8DelayedScaling::new(Fp8Format::E4M3, 4)
                .unwrap()
                .with_usage(usage);
            check_quantizer(&mut q, &x, &format!("delayed {what}"));
            for dim in [BlockDim::OneD, BlockDim::TwoD] {
                let mut q = Fp8BlockQuantizer::new(Fp8Format::E4M3, dim).with_usage(usage);
                check_quantizer(&mut q, &x, &format!("fp8-block {dim:?} {what}"));
            }
        }
    }
    // MXFP8 and NVFP4 need both flattened dimensions to be multiples of their blocks.
    for dims in [&[0, 64][..], &[64, 0], &[0, 0]] {
        let x = zeros(dims);
        for two_d in [false, true] {
            let mut q = Mxfp8Quantizer::new(Fp8Format::E4M3)
                .with_2d(two_d)
                .with_usage(Usage::Both);
            check_quantizer(&mut q, &x, &format!("mxfp8 {dims:?} 2d={two_d}"));
        }
        for (rht, usage) in [
            (false, Usage::Rowwise),
            (false, Usage::Both),
            (true, Usage::Both),
        ] {
            let mut q = Nvfp4Quantizer::new().with_rht(rht).with_usage(usage);
            check_quantizer(&mut q, &x, &format!("nvfp4 {dims:?} rht={rht} {usage:?}"));
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU: cargo xtask test-gpu"]
fn fp8_all_zero_and_all_nan_inputs() {
    require_gpu();
    for v in [0.0f32, f32::NAN, f32::INFINITY] {
        let x = Tensor::from_slice(&vec![v; 300], [10, 30], Device::Cpu).unwrap();
        let mut q = Fp8CurrentScaling::new(Fp8Format::E4M3);
        let cpu = q.quantize(&x).unwrap();
        let gpu = q.quantize(&x.to_device(GPU).unwrap()).unwrap();
        assert_same(&gpu, &cpu, &format!("constant {v}"));
    }
}

/// The cast kernels compute current scaling's scale from the device amax themselves; an
/// epsilon above the amax must reach them (scale = 448 / eps, rounded down to a power of
/// two with pow2 scales).
#[test]
#[ignore = "needs a CUDA GPU: cargo xtask test-gpu"]
fn fp8_current_scaling_applies_the_amax_epsilon_on_the_device() {
    require_gpu();
    for dtype in [DType::F32, DType::BF16] {
        let x = plain(&[64, 96], dtype, 7, 1e-3);
        for usage in [Usage::Rowwise, Usage::Both] {
            for pow2 in [false, true] {
                let mut q = Fp8CurrentScaling::new(Fp8Format::E4M3)
                    .with_usage(usage)
                    .with_pow2_scales(pow2)
                    .with_amax_epsilon(0.3);
                let cpu = q.quantize(&x).unwrap();
                let gpu = q.quantize(&x.to_device(GPU).unwrap()).unwrap();
                let what = format!("eps 0.3 {dtype} {usage:?} pow2={pow2}");
                assert_same(&gpu, &cpu, &what);
                let s = gpu
                    .buffer(BufferName::ScaleInv)
                    .unwrap()
                    .to_vec::<f32>()
                    .unwrap()[0];
                let scale = if pow2 { 1024.0f32 } else { 448.0 / 0.3 };
                assert_eq!(s, 1.0 / scale, "{what}: scale_inv");
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU: cargo xtask test-gpu"]
fn fp8_delayed_scaling_matches_the_cpu_and_records_amax() {
    require_gpu();
    for (i, &shape) in SHAPES.iter().enumerate() {
        let x = input(shape, DType::BF16, 100 + i as u64);
        let mk = || {
            Fp8DelayedScaling::new(Fp8Format::E4M3, 8)
                .unwrap()
                .with_scale(3.5)
                .unwrap()
        };
        let (mut qc, mut qg) = (mk(), mk());
        let cpu = qc.quantize(&x).unwrap();
        let gpu = qg.quantize(&x.to_device(GPU).unwrap()).unwrap();
        assert_same(&gpu, &cpu, &format!("delayed {shape:?}"));
        assert_eq!(
            qg.state().history()[0].to_bits(),
            qc.state().history()[0].to_bits(),
            "{shape:?} recorded amax"
        );
        qc.update(None);
        qg.update(None);
        assert_eq!(qg.state(), qc.state());
    }
}

/// Normal values times `mag`, with no NaN or infinity (so the amaxes move the scale).
fn plain(shape: &[usize], dtype: DType, seed: u64, mag: f32) -> Tensor {
    let n: usize = shape.iter().product();
    let mut v = vec![0f32; n];
    Generator::new(seed).fill_normal(&mut v, 0.0, 1.0);
    let v: Vec<f32> = v.iter().map(|&x| x * mag).collect();
    tensor_of(&v, shape, dtype)
}

/// Call `call` of step `step` of a delayed-scaling sequence: plain values with magnitudes
/// that move the scale up and down, or (call 1 of a `special` step) values with NaN,
/// infinities and extremes.
fn step_input(
    shape: &[usize],
    dtype: DType,
    seed: u64,
    step: usize,
    call: usize,
    special: bool,
) -> Tensor {
    if special && call == 1 {
        input(shape, dtype, seed)
    } else {
        let mag = 2f32.powi((step as i32 * 5 + call as i32) % 13 - 6);
        plain(shape, dtype, seed, mag)
    }
}

/// `x` (on the host) cast by `qg` on the device and by `qc` on the host, as (GPU, CPU):
/// through `quantize` on even calls, `quantize_into` a poisoned output on odd ones.
fn cast_both(
    qg: &mut Fp8DelayedScaling,
    qc: &mut Fp8DelayedScaling,
    x: &Tensor,
    call: usize,
) -> (QuantizedTensor, QuantizedTensor) {
    let cpu = qc.quantize(x).unwrap();
    let xd = x.to_device(GPU).unwrap();
    let gpu = if call.is_multiple_of(2) {
        qg.quantize(&xd).unwrap()
    } else {
        let mut out = poisoned_output(qg, x);
        qg.quantize_into(&xd, &mut out).unwrap();
        out
    };
    (gpu, cpu)
}

/// The history and scale of two delayed-scaling quantizers, bit for bit (NaN included),
/// and their `Debug` text.
fn assert_same_state(gpu: &Fp8DelayedScaling, cpu: &Fp8DelayedScaling, what: &str) {
    let bits = |q: &Fp8DelayedScaling| {
        let s = q.state();
        (
            s.history().iter().map(|h| h.to_bits()).collect::<Vec<_>>(),
            s.scale().to_bits(),
        )
    };
    assert_eq!(bits(gpu), bits(cpu), "{what}: history and scale");
    assert_eq!(format!("{gpu:?}"), format!("{cpu:?}"), "{what}: Debug");
}

/// Train-step-like sequences of delayed-scaling casts of CUDA tensors (several casts per
/// step, the state looked at only now and then, updates, snapshots restored in between,
/// recording turned off for some casts, a clone taken with amaxes still on the device)
/// against the same sequence on the CPU: every output byte, the amax history and the
/// scale after each update agree bit for bit.
#[test]
#[ignore = "needs a CUDA GPU: cargo xtask test-gpu"]
fn fp8_delayed_scaling_steps_match_the_cpu() {
    use tessera_quant::AmaxComputeAlgo;
    require_gpu();
    let shapes: &[&[usize]] = &[
        &[64, 64],
        &[65, 63],
        &[257, 129],
        &[2, 3, 40],
        &[7],
        &[512, 1030],
    ];
    let mut seed = 2000u64;
    let mut case = 0usize;
    for usage in [Usage::Rowwise, Usage::Columnwise, Usage::Both] {
        for (dtype, format, algo, margin) in [
            (DType::BF16, Fp8Format::E4M3, AmaxComputeAlgo::Max, 0),
            (DType::F32, Fp8Format::E5M2, AmaxComputeAlgo::MostRecent, 1),
            (DType::F16, Fp8Format::E4M3, AmaxComputeAlgo::Max, 2),
        ] {
            case += 1;
            let mk = || {
                Fp8DelayedScaling::new(format, 4)
                    .unwrap()
                    .with_usage(usage)
                    .with_algo(algo)
                    .with_margin(margin)
                    .with_scale(0.75)
                    .unwrap()
            };
            let (mut qc, mut qg) = (mk(), mk());
            let mut snaps = None;
            let mut clones = None;
            for step in 0..7usize {
                let what = format!("case {case} {usage:?} {dtype} {format:?} step {step}");
                let mut outs = Vec::new();
                for call in 0..4usize {
                    seed += 1;
                    let shape = shapes[(step + call + case) % shapes.len()];
                    // Step 5 has NaN and infinities (the scale is kept, the history
                    // records Inf).
                    let x = step_input(shape, dtype, seed, step, call, step == 5);
                    let off = step == 2 && call == 1;
                    if off {
                        qc.set_record_amax(false);
                        qg.set_record_amax(false);
                    }
                    let (gpu, cpu) = cast_both(&mut qg, &mut qc, &x, call);
                    if off {
                        qc.set_record_amax(true);
                        qg.set_record_amax(true);
                    }
                    outs.push((gpu, cpu, format!("{what} call {call} {shape:?}")));
                    // Look at the state mid-step now and then (the next cast goes on
                    // from what was read).
                    if (step + call) % 3 == 0 {
                        assert_same_state(&qg, &qc, &format!("{what} after call {call}"));
                    }
                    if step == 1 && call == 2 {
                        // Snapshots with amaxes still on the device: through `state()`
                        // for the GPU, `state_mut()` for the CPU.
                        snaps = Some((qg.state().snapshot(), qc.state_mut().snapshot()));
                    }
                    if step == 3 && call == 0 {
                        clones = Some((qg.clone(), qc.clone()));
                    }
                }
                for (gpu, cpu, w) in &outs {
                    assert_same(gpu, cpu, w);
                }
                if step == 4 {
                    // Recompute-style replay: restore the snapshot over pending amaxes.
                    let (sg, sc) = snaps.as_ref().unwrap();
                    qg.state_mut().restore(sg).unwrap();
                    qc.state_mut().restore(sc).unwrap();
                    assert_same_state(&qg, &qc, &format!("{what} restored"));
                }
                if step == 3 {
                    // Snapshots of the GPU quantizer restore into the CPU one and back.
                    let s = qg.state_mut().snapshot();
                    let mut back = mk();
                    back.state_mut().restore(&s).unwrap();
                    let mut cpu_back = mk();
                    cpu_back
                        .state_mut()
                        .restore(&qc.state().snapshot())
                        .unwrap();
                    assert_same_state(&back, &cpu_back, &format!("{what} snapshot"));
                }
                let reduced = match step % 3 {
                    0 => None,
                    1 => Some(qc.state().history()[0] * 1.5),
                    _ => Some(0.0),
                };
                if step != 6 {
                    qc.update(reduced);
                    qg.update(reduced);
                    assert_same_state(&qg, &qc, &format!("{what} after update"));
                }
            }
            // Casts still pending at the end, then a clone taken mid-sequence.
            assert_same_state(&qg, &qc, &format!("case {case} end"));
            let (cg, cc) = clones.unwrap();
            assert_same_state(&cg, &cc, &format!("case {case} clone"));
        }
    }
}

/// One delayed-scaling quantizer fed CUDA and host tensors in turn, against one fed only
/// host tensors.
#[test]
#[ignore = "needs a CUDA GPU: cargo xtask test-gpu"]
fn fp8_delayed_scaling_mixed_devices_match_the_cpu() {
    require_gpu();
    let mk = || {
        Fp8DelayedScaling::new(Fp8Format::E4M3, 3)
            .unwrap()
            .with_scale(2.0)
            .unwrap()
    };
    let (mut qc, mut qm) = (mk(), mk());
    for step in 0..4 {
        for call in 0..5u64 {
            let x = plain(
                &[96, 80],
                DType::BF16,
                3000 + 10 * step + call,
                (call + 1) as f32,
            );
            let cpu = qc.quantize(&x).unwrap();
            let on_gpu = (step + call) % 2 == 0;
            let got = if on_gpu {
                qm.quantize(&x.to_device(GPU).unwrap()).unwrap()
            } else {
                qm.quantize(&x).unwrap()
            };
            if on_gpu {
                assert_same(&got, &cpu, &format!("step {step} call {call}"));
            } else {
                let bytes = |q: &QuantizedTensor| {
                    q.data_tensors()
                        .into_iter()
                        .map(|(n, t)| (n, t.to_bytes().unwrap()))
                        .collect::<Vec<_>>()
                };
                assert_eq!(bytes(&got), bytes(&cpu), "step {step} call {call}");
            }
        }
        qc.update(None);
        qm.update(None);
        assert_same_state(&qm, &qc, &format!("step {step}"));
    }
}

/// The history and scale of a state as bits (NaN included).
fn state_bits(s: &tessera_quant::DelayedScalingState) -> (Vec<u32>, u32) {
    (
        s.history().iter().map(|h| h.to_bits()).collect(),
        s.scale().to_bits(),
    )
}

/// Overwrites the device `f32 [1]` `t` with `v` in place (what an all-reduce leaves).
fn write_scalar(t: &mut Tensor, v: f32) {
    let dev = tessera_core::cuda::device(0).unwrap();
    dev.stream()
        .memcpy_htod(&v.to_le_bytes()[..], t.cuda_slice_mut().unwrap())
        .unwrap();
}

/// Delayed scaling with its state on the device (`to_device`, casts recording there,
/// `update_on_device`) against the same steps on the CPU with host updates: every output
/// byte, and the history and scale after each update (read back fresh and through
/// `state()`), bit for bit. Histories of 1 to 1030 slots, long enough runs to wrap the
/// device's ring, both algorithms, margins of both signs; a step recording nothing (no
/// roll), NaN and infinities (the scale is kept), casts not recording, slot 0 raised in
/// place as an all-reduce would (the CPU gets it as `reduced_amax`), a state moved to
/// the device mid-sequence, a clone taken on the device, and the trip back to the host
/// and onto the device again.
#[test]
#[ignore = "needs a CUDA GPU: cargo xtask test-gpu"]
fn fp8_delayed_scaling_updates_on_the_device_match_the_cpu() {
    use tessera_quant::AmaxComputeAlgo::{Max, MostRecent};
    require_gpu();
    let shapes: &[&[usize]] = &[&[64, 64], &[65, 63], &[257, 129], &[2, 3, 40], &[512, 1030]];
    let mut seed = 7000u64;
    let cases = [
        (1, DType::BF16, Fp8Format::E4M3, Max, 0, Usage::Both),
        (
            2,
            DType::F32,
            Fp8Format::E5M2,
            MostRecent,
            1,
            Usage::Rowwise,
        ),
        (5, DType::BF16, Fp8Format::E4M3, Max, -2, Usage::Columnwise),
        (1030, DType::F16, Fp8Format::E4M3, Max, 3, Usage::Both),
        (4, DType::BF16, Fp8Format::E5M2, MostRecent, 0, Usage::Both),
    ];
    for (case, (len, dtype, format, algo, margin, usage)) in cases.into_iter().enumerate() {
        let mk = || {
            Fp8DelayedScaling::new(format, len)
                .unwrap()
                .with_usage(usage)
                .with_algo(algo)
                .with_margin(margin)
                .with_scale(0.5)
                .unwrap()
        };
        let (mut qc, mut qg) = (mk(), mk());
        // Case 2 casts on the host state first and moves with amaxes pending.
        let move_at = if case == 2 { 2 } else { 0 };
        let mut clones = None;
        for step in 0..10usize {
            let what = format!("case {case} (len {len} {dtype} {format:?} {algo:?}) step {step}");
            if step == move_at {
                qg.to_device(GPU).unwrap();
                assert_eq!(qg.state_device(), Some(GPU), "{what}");
            }
            let calls = if step == 3 { 0 } else { 3 };
            for call in 0..calls {
                seed += 1;
                let shape = shapes[(step + call + case) % shapes.len()];
                let x = step_input(shape, dtype, seed, step, call, step == 4);
                let off = step == 1 && call == 2;
                qc.set_record_amax(!off);
                qg.set_record_amax(!off);
                let (gpu, cpu) = cast_both(&mut qg, &mut qc, &x, call);
                assert_same(&gpu, &cpu, &format!("{what} call {call} {shape:?}"));
            }
            if step == 2 {
                clones = Some((qg.clone(), qc.clone()));
            }
            let on_device = qg.state_device().is_some();
            let reduced = (step % 3 == 1 && on_device).then(|| qc.state().history()[0] * 1.5);
            if let Some(r) = reduced {
                write_scalar(qg.device_amax_mut().unwrap(), r);
            }
            qc.update(reduced);
            if on_device {
                qg.update_on_device().unwrap();
                assert_eq!(qg.state_device(), Some(GPU), "{what}");
            } else {
                qg.update(None);
            }
            assert_eq!(
                state_bits(&qg.fetch_state().unwrap()),
                state_bits(qc.state()),
                "{what}: fetched after the update"
            );
            assert_same_state(&qg, &qc, &format!("{what} after the update"));
        }
        // The clone taken on the device kept its own state while the original went on.
        let (cg, cc) = clones.unwrap();
        assert_eq!(
            state_bits(&cg.fetch_state().unwrap()),
            state_bits(cc.state()),
            "case {case}: clone"
        );
        // Home (host casts and update), then onto the device again.
        qg.state_mut();
        assert_eq!(qg.state_device(), None);
        for (i, on_device) in [false, true].into_iter().enumerate() {
            if on_device {
                qg.to_device(GPU).unwrap();
            }
            let x = plain(&[96, 80], dtype, 7900 + i as u64, 3.0 + i as f32);
            let cpu = qc.quantize(&x).unwrap();
            let gpu = qg.quantize(&x.to_device(GPU).unwrap()).unwrap();
            assert_same(&gpu, &cpu, &format!("case {case} trip {i}"));
            qc.update(None);
            match on_device {
                true => qg.update_on_device().unwrap(),
                false => qg.update(None),
            }
            assert_same_state(&qg, &qc, &format!("case {case} trip {i}"));
        }
    }
}

/// `update_all_on_device` over 150 device-held quantizers (three launches: 64, 64, 22)
/// of every history length from 1 to 9, both algorithms, several margins and both
/// formats, some without a cast since the last update (no roll): every history and
/// scale matches a host update of its CPU twin, round after round. With one state left
/// on the host the call is refused and queues nothing.
#[test]
#[ignore = "needs a CUDA GPU: cargo xtask test-gpu"]
fn fp8_delayed_scaling_bulk_update_matches_the_cpu() {
    use tessera_quant::AmaxComputeAlgo::{Max, MostRecent};
    require_gpu();
    let n = 150usize;
    let mk = |i: usize| {
        let format = [Fp8Format::E4M3, Fp8Format::E5M2][i % 2];
        Fp8DelayedScaling::new(format, 1 + i % 9)
            .unwrap()
            .with_usage(Usage::Rowwise)
            .with_algo([Max, MostRecent][(i / 2) % 2])
            .with_margin((i % 5) as i32 - 2)
    };
    let mut cpu: Vec<Fp8DelayedScaling> = (0..n).map(mk).collect();
    let mut gpu: Vec<Fp8DelayedScaling> = (0..n).map(mk).collect();
    for q in &mut gpu {
        q.to_device(GPU).unwrap();
    }
    for round in 0..4usize {
        for (i, (qc, qg)) in cpu.iter_mut().zip(gpu.iter_mut()).enumerate() {
            if (i + round) % 7 == 3 {
                continue;
            }
            let mag = 2f32.powi(((i * 3 + round * 5) % 17) as i32 - 8);
            let x = plain(&[16, 32], DType::BF16, 9500 + (round * n + i) as u64, mag);
            let want = qc.quantize(&x).unwrap();
            let got = qg.quantize(&x.to_device(GPU).unwrap()).unwrap();
            assert_same(&got, &want, &format!("round {round} quantizer {i}"));
        }
        for qc in &mut cpu {
            qc.update(None);
        }
        let mut all: Vec<&mut Fp8DelayedScaling> = gpu.iter_mut().collect();
        Fp8DelayedScaling::update_all_on_device(&mut all).unwrap();
        for (i, (qc, qg)) in cpu.iter().zip(&gpu).enumerate() {
            assert_eq!(
                state_bits(&qg.fetch_state().unwrap()),
                state_bits(qc.state()),
                "round {round} quantizer {i}"
            );
        }
    }
    // One state brought home: refused, and the others are left as they were.
    let x = plain(&[16, 32], DType::BF16, 9999, 5.0)
        .to_device(GPU)
        .unwrap();
    for q in &mut gpu {
        q.quantize(&x).unwrap();
    }
    let before: Vec<_> = gpu.iter().map(|q| q.fetch_state().unwrap()).collect();
    gpu[77].state_mut();
    let mut all: Vec<&mut Fp8DelayedScaling> = gpu.iter_mut().collect();
    let e = Fp8DelayedScaling::update_all_on_device(&mut all).unwrap_err();
    assert!(e.to_string().contains("quantizer 77"), "{e}");
    for (i, q) in gpu.iter().enumerate() {
        assert_eq!(q.fetch_state().unwrap(), before[i], "quantizer {i}");
    }
}

/// A training step's delayed-scaling casts and update, captured into one CUDA graph with
/// the state on the device, replayed on new inputs: after every replay the outputs and
/// the history and scale match the same steps on the CPU, bit for bit (so each replay
/// cast with the scale the previous replay's update computed). Midway the state goes to
/// the host and back, into the same buffers, and the graph goes on; later a snapshot
/// taken before replay 5 is restored after replay 6 (in place), and the graph goes on
/// from it.
#[test]
#[ignore = "needs a CUDA GPU: cargo xtask test-gpu"]
fn fp8_delayed_scaling_steps_replay_in_a_cuda_graph() {
    require_gpu();
    let dev = tessera_core::cuda::device(0).unwrap();
    let dtype = DType::BF16;
    let shapes = [[256usize, 512], [128, 384]];
    let mk = || {
        Fp8DelayedScaling::new(Fp8Format::E4M3, 3)
            .unwrap()
            .with_usage(Usage::Both)
    };
    let (mut qc, mut qg) = (mk(), mk());
    qg.to_device(GPU).unwrap();
    let mut xs: Vec<Tensor> = shapes
        .iter()
        .map(|s| Tensor::zeros(*s, dtype, GPU).unwrap())
        .collect();
    let mut outs: Vec<QuantizedTensor> = xs
        .iter()
        .map(|x| qg.make_empty(x.shape(), dtype, GPU).unwrap())
        .collect();
    let graph = tessera_core::cuda::Graph::capture(&dev, || {
        for (x, out) in xs.iter().zip(outs.iter_mut()) {
            qg.quantize_into(x, out)?;
        }
        qg.update_on_device()
    })
    .unwrap();
    let mut snaps = None;
    for replay in 0..8u64 {
        if replay == 5 {
            snaps = Some((qg.snapshot(), qc.snapshot()));
        }
        let hosts: Vec<Tensor> = shapes
            .iter()
            .zip(0u64..)
            .map(|(s, i)| {
                let mag = 2f32.powi((replay as i32 * 3) % 7 - 3);
                plain(s, dtype, 8000 + 10 * replay + i, mag)
            })
            .collect();
        for (x, h) in xs.iter_mut().zip(&hosts) {
            dev.stream()
                .memcpy_htod(&h.to_bytes().unwrap()[..], x.cuda_slice_mut().unwrap())
                .unwrap();
        }
        graph.replay().unwrap();
        for (h, out) in hosts.iter().zip(&outs) {
            let want = qc.quantize(h).unwrap();
            assert_same(out, &want, &format!("replay {replay} {:?}", h.shape()));
        }
        qc.update(None);
        assert_eq!(
            state_bits(&qg.fetch_state().unwrap()),
            state_bits(qc.state()),
            "replay {replay}"
        );
        if replay == 3 {
            qg.state_mut();
            qg.to_device(GPU).unwrap();
        }
        if replay == 6 {
            // Back to the state before replay 5: the device snapshot is restored into
            // the buffers the graph writes, so replay 7 goes on from it.
            let (sg, sc) = snaps.take().unwrap();
            qg.restore(&sg).unwrap();
            qc.restore(&sc).unwrap();
            assert_eq!(qg.state_device(), Some(GPU));
            assert_eq!(
                state_bits(&qg.fetch_state().unwrap()),
                state_bits(qc.state()),
                "restored after replay {replay}"
            );
        }
    }
}

/// The quantizer as a replay state (what a checkpoint frame registers) with CUDA casts:
/// a snapshot taken with amaxes still on the device, one of a device-held state (a copy
/// on the device), each restored after more casts and updates, and each restored into
/// the quantizer with its state on the other side (a host snapshot brings the state
/// home, a device snapshot moves it back into its buffers). After every restore the
/// history and scale, and the next casts' bytes, match the CPU's restored twin.
#[test]
#[ignore = "needs a CUDA GPU: cargo xtask test-gpu"]
fn fp8_delayed_scaling_replays_its_state_on_either_side() {
    require_gpu();
    let dtype = DType::BF16;
    let mk = || {
        Fp8DelayedScaling::new(Fp8Format::E4M3, 4)
            .unwrap()
            .with_usage(Usage::Both)
            .with_scale(0.25)
            .unwrap()
    };
    let (mut qc, mut qg) = (mk(), mk());
    let mut seed = 8500u64;
    let mut casts = |qg: &mut Fp8DelayedScaling, qc: &mut Fp8DelayedScaling, what: &str| {
        for call in 0..3 {
            seed += 1;
            let x = step_input(&[96, 160], dtype, seed, seed as usize % 7, call, false);
            let (gpu, cpu) = cast_both(qg, qc, &x, call);
            assert_same(&gpu, &cpu, &format!("{what} call {call}"));
        }
    };
    let update = |qg: &mut Fp8DelayedScaling, qc: &mut Fp8DelayedScaling| {
        qc.update(None);
        match qg.state_device() {
            Some(_) => qg.update_on_device().unwrap(),
            None => qg.update(None),
        }
    };
    // On the host, with amaxes pending on the device.
    casts(&mut qg, &mut qc, "host");
    let (host_g, host_c) = (qg.snapshot(), qc.snapshot());
    casts(&mut qg, &mut qc, "host, after the snapshot");
    update(&mut qg, &mut qc);
    qg.restore(&host_g).unwrap();
    qc.restore(&host_c).unwrap();
    assert_same_state(&qg, &qc, "host snapshot restored");
    casts(&mut qg, &mut qc, "host, restored");
    update(&mut qg, &mut qc);
    // On the device.
    qg.to_device(GPU).unwrap();
    casts(&mut qg, &mut qc, "device");
    let (dev_g, dev_c) = (qg.snapshot(), qc.snapshot());
    for round in 0..2 {
        update(&mut qg, &mut qc);
        casts(&mut qg, &mut qc, "device, after the snapshot");
        update(&mut qg, &mut qc);
        qg.restore(&dev_g).unwrap();
        qc.restore(&dev_c).unwrap();
        assert_eq!(qg.state_device(), Some(GPU), "round {round}");
        assert_same_state(
            &qg,
            &qc,
            &format!("device snapshot restored, round {round}"),
        );
        casts(&mut qg, &mut qc, "device, restored");
    }
    // Each snapshot into the other side.
    qg.restore(&host_g).unwrap();
    qc.restore(&host_c).unwrap();
    assert_eq!(qg.state_device(), None);
    assert_same_state(&qg, &qc, "host snapshot into a device-held state");
    casts(&mut qg, &mut qc, "home again");
    update(&mut qg, &mut qc);
    qg.restore(&dev_g).unwrap();
    qc.restore(&dev_c).unwrap();
    assert_eq!(qg.state_device(), Some(GPU));
    assert_same_state(&qg, &qc, "device snapshot into a host state");
    casts(&mut qg, &mut qc, "on the device again");
    update(&mut qg, &mut qc);
    assert_same_state(&qg, &qc, "last update");
    // A device snapshot belongs to its quantizer's buffers.
    let mut fresh = mk();
    let e = fresh.restore(&dev_g).unwrap_err();
    assert!(e.to_string().contains("restore a snapshot"), "{e}");
}

#[test]
#[ignore = "needs a CUDA GPU: cargo xtask test-gpu"]
fn layout_helpers_match_the_cpu() {
    require_gpu();
    use tessera_quant::cuda::layout as dl;
    use tessera_quant::layout as hl;
    let mut g = Generator::new(9);
    for (world, rows, cols) in [(1, 3, 5), (2, 2, 3), (4, 17, 33), (3, 128, 4), (8, 5, 1)] {
        let mut w = vec![0u32; world * rows * cols];
        g.fill_u32(&mut w);
        let t = Tensor::from_slice(&w, [world * rows, cols], Device::Cpu).unwrap();
        let want = hl::swap_first_dims(&t, world).unwrap();
        let got = dl::swap_first_dims(&t.to_device(GPU).unwrap(), world).unwrap();
        assert_eq!(got.shape(), want.shape());
        assert_eq!(
            got.to_bytes().unwrap(),
            want.to_bytes().unwrap(),
            "swap {world} {rows} {cols}"
        );
    }
    for (rows, cols, pr, pc) in [
        (3, 5, 128, 8),
        (128, 4, 128, 4),
        (100, 30, 64, 16),
        (1, 1, 4, 4),
    ] {
        let mut w = vec![0u32; rows * cols];
        g.fill_u32(&mut w);
        let bytes: Vec<u8> = w.iter().map(|&x| x as u8).collect();
        let t = Tensor::from_bytes(&bytes, [rows, cols], DType::U8, Device::Cpu).unwrap();
        let (vr, vc) = (rows.min(pr), cols.min(pc));
        let stripped = hl::strip_padding(&bytes, cols, vr, vc, 1);
        let want = hl::pad(&stripped, vr, vc, pr, pc, 1);
        let got = dl::repad(&t.to_device(GPU).unwrap(), vr, vc, pr, pc).unwrap();
        assert_eq!(
            got.to_bytes().unwrap(),
            want,
            "repad {rows}x{cols} -> {pr}x{pc}"
        );
        let tt = dl::transpose_bytes(&t.to_device(GPU).unwrap(), rows, cols).unwrap();
        assert_eq!(
            tt.to_bytes().unwrap(),
            hl::transpose(&bytes, rows, cols),
            "transpose {rows}x{cols}"
        );
    }
}

#[test]
#[ignore = "needs a CUDA GPU: cargo xtask test-gpu"]
fn nvfp4_matches_the_cpu() {
    require_gpu();
    let shapes: &[&[usize]] = &[
        &[16, 16],
        &[32, 48],
        &[48, 80],
        &[64, 64],
        &[80, 144],
        &[2, 24, 32],
        &[128, 256],
        &[144, 16],
        // Several full tiles of the 1-D kernels (16x512 rowwise, 128x128 both) and a ragged
        // last one in each direction.
        &[272, 1040],
        &[48, 4112],
    ];
    let mut seed = 1300;
    for &shape in shapes {
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            for two_d in [false, true] {
                for rht in [false, true] {
                    for swizzled in [false, true] {
                        for sr in [false, true] {
                            for usage in [Usage::Rowwise, Usage::Columnwise, Usage::Both] {
                                seed += 1;
                                let x = input(shape, dtype, seed);
                                let mut q = Nvfp4Quantizer::new()
                                    .with_2d(two_d)
                                    .with_rht(rht)
                                    .with_swizzled_scales(swizzled)
                                    .with_stochastic_rounding(sr.then(|| Generator::new(seed)))
                                    .with_usage(usage);
                                let what = format!(
                                    "nvfp4 {shape:?} {dtype} 2d={two_d} rht={rht} swizzled={swizzled} sr={sr} {usage:?}"
                                );
                                check_quantizer(&mut q, &x, &what);
                            }
                        }
                    }
                }
            }
        }
    }
}

/// Every format's dequantization, both orientations, equal to the CPU's bytes on tensors of
/// millions of elements, whose shapes are not multiples of the columnwise tiles (64 or 128
/// stored rows by 256 stored columns: [8640, 8224], [6176, 4192] and [2064, 4112] leave
/// partial tiles at both edges) and whose threads' positions cross many rows. The
/// columnwise dequantizers take their tall tiles (128 rows) where those fill the card: on
/// a card of 100 to 260 SMs, FP8's at [8640, 8224] and [6176, 4192] and not at
/// [2064, 4112], NVFP4's at [8640, 8224] only (and never with the RHT). (The small shapes
/// of the other tests reach the ragged paths: m % 16 != 0, k % 8 != 0.)
#[test]
#[ignore = "needs a CUDA GPU: cargo xtask test-gpu"]
fn dequantizers_match_the_cpu_on_large_ragged_tiles() {
    require_gpu();
    let x = input(&[8640, 8224], DType::BF16, 71);
    check_quantizer(
        &mut Fp8CurrentScaling::new(Fp8Format::E4M3).with_usage(Usage::Both),
        &x,
        "current [8640, 8224]",
    );
    // An output on another device than the data is refused.
    let q = Fp8CurrentScaling::new(Fp8Format::E4M3)
        .quantize(&x.to_device(GPU).unwrap())
        .unwrap();
    let mut host = Tensor::zeros(x.shape().clone(), DType::BF16, Device::Cpu).unwrap();
    let e = q.dequantize_into(Usage::Rowwise, &mut host).unwrap_err();
    assert!(matches!(e, tessera_core::Error::Device { .. }), "{e}");
    let x = input(&[6176, 4192], DType::BF16, 72);
    for swizzled in [false, true] {
        check_quantizer(
            &mut Mxfp8Quantizer::new(Fp8Format::E4M3)
                .with_swizzled_scales(swizzled)
                .with_usage(Usage::Both),
            &x,
            &format!("mxfp8 [6176, 4192] swizzled={swizzled}"),
        );
        check_quantizer(
            &mut Nvfp4Quantizer::new()
                .with_rht(!swizzled)
                .with_swizzled_scales(swizzled)
                .with_usage(Usage::Both),
            &x,
            &format!("nvfp4 [6176, 4192] rht={} swizzled={swizzled}", !swizzled),
        );
    }
    for dim in [BlockDim::OneD, BlockDim::TwoD] {
        check_quantizer(
            &mut Fp8BlockQuantizer::new(Fp8Format::E4M3, dim).with_usage(Usage::Both),
            &x,
            &format!("fp8-block [6176, 4192] {dim:?}"),
        );
    }
    let x = input(&[8640, 8224], DType::BF16, 73);
    for two_d in [false, true] {
        check_quantizer(
            &mut Nvfp4Quantizer::new().with_2d(two_d).with_usage(Usage::Both),
            &x,
            &format!("nvfp4 [8640, 8224] 2d={two_d}"),
        );
    }
    let x = input(&[2064, 4112], DType::BF16, 74);
    check_quantizer(
        &mut Fp8CurrentScaling::new(Fp8Format::E5M2).with_usage(Usage::Both),
        &x,
        "current [2064, 4112]",
    );
    check_quantizer(
        &mut Fp8BlockQuantizer::new(Fp8Format::E4M3, BlockDim::TwoD).with_usage(Usage::Both),
        &x,
        "fp8-block [2064, 4112] TwoD",
    );
}

/// Finite values of moderate range, with runs of zeros and negative zeros: every NVFP4
/// block (1-D or 2-D) gets a normal E4M3 scale, the input the both-orientations kernels'
/// fast paths take. With `odd`, a NaN, an infinity and a 16-run 2^-40 smaller than the rest land in
/// three warp tiles, which take the general path within the same launch.
fn tame_input(shape: &[usize], dtype: DType, seed: u64, odd: bool) -> Tensor {
    let n: usize = shape.iter().product();
    let mut g = Generator::new(seed);
    let mut v = vec![0f32; n];
    g.fill_normal(&mut v, 0.0, 1.0);
    for (i, x) in v.iter_mut().enumerate() {
        // magnitudes from 2^-3 to 2^3, changing every 64 elements
        *x *= 2f32.powi(((i / 64) as i32 * 3 % 7) - 3);
        match (i / 16) % 37 {
            5 => *x = 0.0,
            11 => *x = -0.0,
            _ => {}
        }
    }
    if odd {
        v[n / 3] = f32::NAN;
        v[2 * n / 3] = f32::INFINITY;
        let r = n / 2 / 16 * 16;
        for x in &mut v[r..r + 16] {
            *x *= 2f32.powi(-40);
        }
    }
    tensor_of(&v, shape, dtype)
}

#[test]
#[ignore = "needs a CUDA GPU: cargo xtask test-gpu"]
fn nvfp4_fast_path_matches_the_cpu() {
    require_gpu();
    let shapes: &[&[usize]] = &[
        &[64, 256],
        &[272, 1040],
        &[48, 4112],
        &[1024, 768],
        &[2112, 528],
    ];
    let mut seed = 2600;
    // 1-D blocks (the both kernel; rowwise alone has its own kernel) and 2-D blocks (their
    // kernel serves every usage).
    let cases = [
        (false, Usage::Columnwise),
        (false, Usage::Both),
        (true, Usage::Rowwise),
        (true, Usage::Columnwise),
        (true, Usage::Both),
    ];
    for &shape in shapes {
        for dtype in [DType::BF16, DType::F16] {
            for odd in [false, true] {
                for swizzled in [false, true] {
                    for (two_d, usage) in cases {
                        seed += 1;
                        let x = tame_input(shape, dtype, seed, odd);
                        let mut q = Nvfp4Quantizer::new()
                            .with_2d(two_d)
                            .with_swizzled_scales(swizzled)
                            .with_usage(usage);
                        if !odd {
                            // The input is what the fast path needs: no scale byte is an
                            // E4M3 subnormal (1 ..= 7) or NaN (0x7F).
                            let cpu = q.clone().quantize(&x).unwrap();
                            let name = match usage {
                                Usage::Rowwise => BufferName::ScaleInv,
                                _ => BufferName::ColumnwiseScaleInv,
                            };
                            let s = cpu.buffer(name).unwrap();
                            let bytes = s.to_bytes().unwrap();
                            assert!(
                                bytes.iter().all(|&b| b == 0 || (8..0x7F).contains(&b)),
                                "tame input {shape:?} {dtype} has a subnormal or NaN scale"
                            );
                        }
                        let what = format!(
                            "nvfp4 fast path {shape:?} {dtype} 2d={two_d} odd={odd} \
                             swizzled={swizzled} {usage:?}"
                        );
                        check_quantizer(&mut q, &x, &what);
                    }
                }
            }
        }
    }
}

/// The round-to-nearest 1-D kernel launched in clusters of 8x2 tiles (`Nvfp4Launch`,
/// set to `Clusters` for the test, so that every card runs it): a ragged shape (33 tile
/// rows, a band of one; 129 tile columns, padded to 130) in both 2-byte types, tame and
/// odd inputs, a shape of whole clusters, columnwise alone, and shapes under the `Auto`
/// bound (2^26 values) down to the fewest rows the kernel takes. The setting is the
/// process's: other tests running meanwhile may take clusters too, with the same bytes.
#[test]
#[ignore = "needs a CUDA GPU: cargo xtask test-gpu"]
fn nvfp4_cluster_launch_matches_the_cpu() {
    require_gpu();
    let mut cases = vec![];
    for dtype in [DType::BF16, DType::F16] {
        for odd in [false, true] {
            cases.push(([4112, 16400], dtype, odd, Usage::Both));
        }
    }
    cases.push(([8192, 8192], DType::BF16, false, Usage::Columnwise));
    cases.push(([528, 4096], DType::BF16, true, Usage::Both));
    cases.push(([2048, 1056], DType::F16, false, Usage::Both));
    check_nvfp4_launch(tessera_quant::cuda::Nvfp4Launch::Clusters, 2700, &cases);
}

/// The round-to-nearest 1-D kernel with two-step compact scales (`Nvfp4Launch::TwoStep`,
/// set for the test): ragged shapes both ways (a part tile row; tile columns whose
/// grid rows are 4 but not 8 bytes long, so the second step stores words), columnwise
/// alone, and tensors of one tile. The setting is the process's, as in the cluster test.
#[test]
#[ignore = "needs a CUDA GPU: cargo xtask test-gpu"]
fn nvfp4_two_step_scales_match_the_cpu() {
    require_gpu();
    let mut cases = vec![];
    for dtype in [DType::BF16, DType::F16] {
        for odd in [false, true] {
            cases.push(([4112, 16400], dtype, odd, Usage::Both));
        }
    }
    cases.push(([1040, 4160], DType::BF16, true, Usage::Both));
    cases.push(([2048, 1056], DType::F16, false, Usage::Columnwise));
    cases.push(([128, 128], DType::BF16, true, Usage::Both));
    cases.push(([16, 64], DType::F16, false, Usage::Both));
    check_nvfp4_launch(tessera_quant::cuda::Nvfp4Launch::TwoStep, 2900, &cases);
}

/// 2-D blocks' compact scales in two steps (the tile kernel's block scales into 128 bytes
/// of scratch a tile, then `tessera_nvfp4_scales_2d`), which the quantizer takes from
/// 2^25 values with columnwise data (from 2^24 where the DRAM is slow for the SMs, an
/// H100's; these shapes take two steps on every card): ragged shapes both ways whose
/// block-grid rows end one block into a word (513 and 129 blocks), so the second step
/// masks a word's bytes past the row's end, in both 2-byte types, tame inputs (the fast
/// path) and odd ones (a NaN, an infinity and a tiny run: three warps on the general
/// path; `tame_input`), both orientations and columnwise alone.
#[test]
#[ignore = "needs a CUDA GPU: cargo xtask test-gpu"]
fn nvfp4_2d_two_step_scales_match_the_cpu() {
    require_gpu();
    let cases = [
        ([4112, 8208], DType::BF16, true, Usage::Both),
        ([4112, 8208], DType::F16, false, Usage::Both),
        ([2064, 16400], DType::BF16, false, Usage::Columnwise),
        ([2064, 16400], DType::F16, true, Usage::Both),
    ];
    for (i, (shape, dtype, odd, usage)) in cases.into_iter().enumerate() {
        assert!(
            shape[0] * shape[1] >= 1 << 25,
            "{shape:?} is under the two-step bound"
        );
        let x = tame_input(&shape, dtype, 3100 + i as u64, odd);
        let mut q = Nvfp4Quantizer::new().with_2d(true).with_usage(usage);
        check_quantizer(
            &mut q,
            &x,
            &format!("nvfp4 2d two-step {shape:?} {dtype} odd={odd} {usage:?}"),
        );
    }
}

/// Checks the 1-D round-to-nearest quantizer against the CPU on each case (shape, dtype,
/// odd input, usage; seeds from `seed` + 1 up) with the process's NVFP4 launch set to
/// `launch` (asserted); puts [`Nvfp4Launch::Auto`](tessera_quant::cuda::Nvfp4Launch)
/// back when it returns or panics. The setting is the process's: other tests running
/// meanwhile take it too, with the same bytes.
fn check_nvfp4_launch(
    launch: tessera_quant::cuda::Nvfp4Launch,
    seed: u64,
    cases: &[([usize; 2], DType, bool, Usage)],
) {
    use tessera_quant::cuda;
    /// Puts the automatic launch back on drop, so on a panic too.
    struct Restore;
    impl Drop for Restore {
        fn drop(&mut self) {
            cuda::set_nvfp4_launch(cuda::Nvfp4Launch::Auto);
        }
    }
    let _restore = Restore;
    cuda::set_nvfp4_launch(launch);
    assert_eq!(cuda::nvfp4_launch(), launch);
    for (i, &(shape, dtype, odd, usage)) in cases.iter().enumerate() {
        let x = tame_input(&shape, dtype, seed + 1 + i as u64, odd);
        let mut q = Nvfp4Quantizer::new().with_usage(usage);
        let what = format!("nvfp4 {launch:?} {shape:?} {dtype} odd={odd} {usage:?}");
        check_quantizer(&mut q, &x, &what);
    }
}

/// The 1-D kernels of TE's recipes for 2-byte inputs (the RHT on the columnwise operand,
/// stochastic rounding, both), on inputs of moderate range and, with `odd`, a NaN, an
/// infinity and a run far below the rest, over several 128x128 tiles and ragged ones.
#[test]
#[ignore = "needs a CUDA GPU: cargo xtask test-gpu"]
fn nvfp4_rht_and_stochastic_rounding_kernels_match_the_cpu() {
    require_gpu();
    let shapes: &[&[usize]] = &[&[272, 1040], &[1024, 768], &[2112, 528], &[16, 4096]];
    let mut seed = 3900;
    for &shape in shapes {
        for dtype in [DType::BF16, DType::F16] {
            for odd in [false, true] {
                for (rht, sr) in [(true, false), (false, true), (true, true)] {
                    for swizzled in [false, true] {
                        for usage in [Usage::Rowwise, Usage::Columnwise, Usage::Both] {
                            seed += 1;
                            let x = tame_input(shape, dtype, seed, odd);
                            let mut q = Nvfp4Quantizer::new()
                                .with_rht(rht)
                                .with_stochastic_rounding(sr.then(|| Generator::new(seed)))
                                .with_swizzled_scales(swizzled)
                                .with_usage(usage);
                            let what = format!(
                                "nvfp4 {shape:?} {dtype} odd={odd} rht={rht} sr={sr} \
                                 swizzled={swizzled} {usage:?}"
                            );
                            check_quantizer(&mut q, &x, &what);
                        }
                    }
                }
            }
        }
    }
}

/// The second pass of a two-pass quantizer starts before its amax pass ends (a
/// programmatic dependent launch) and must still see that pass's amax, and the amax pass
/// the input written just before it. One device buffer is refilled by a kernel before
/// every call, with magnitudes that change by 2^9 from call to call, so a stale or
/// partial amax, or a stale input, shows in the bytes.
#[test]
#[ignore = "needs a CUDA GPU: cargo xtask test-gpu"]
fn two_pass_quantizers_see_the_amax_and_input_written_just_before() {
    require_gpu();
    let shape = [2048, 4096];
    let mut x = Tensor::zeros(shape, DType::F32, GPU).unwrap();
    let mut fill = Generator::new(8100);
    let mut fp8 = Fp8CurrentScaling::new(Fp8Format::E4M3).with_usage(Usage::Both);
    let mut nvfp4 = Nvfp4Quantizer::new().with_usage(Usage::Both);
    let mut out_fp8 = fp8.make_empty(x.shape(), x.dtype(), GPU).unwrap();
    let mut out_nvfp4 = nvfp4.make_empty(x.shape(), x.dtype(), GPU).unwrap();
    for round in 0..6 {
        let std = 2f32.powi(9 * (round % 3) - 9);
        fill.fill_normal_tensor(&mut x, 0.0, std).unwrap();
        fp8.quantize_into(&x, &mut out_fp8).unwrap();
        nvfp4.quantize_into(&x, &mut out_nvfp4).unwrap();
        let host = x.to_device(Device::Cpu).unwrap();
        assert_same(
            &out_fp8,
            &fp8.quantize(&host).unwrap(),
            &format!("fp8 current scaling, round {round}"),
        );
        assert_same(
            &out_nvfp4,
            &nvfp4.quantize(&host).unwrap(),
            &format!("nvfp4, round {round}"),
        );
    }
}

/// The same when the input comes from early-launched kernels: the dequantization of a
/// large tensor, then a small dequantization that writes the input, both
/// `Order::WaitFirst` launches, which let the next launch start at once. The clear,
/// amax and second passes follow as programmatic launches too, and the small ones fit
/// beside the large dequantization's last CTAs. The second pass reads its tile before
/// its own wait, so it must not start before the input is written: a tile read early
/// shows as the input of the quantization before, whose values are 2^9 times larger or
/// smaller. Inputs of 256 rows fill the scale grids; 224 rows leave the MXFP8 and NVFP4
/// grids padded, so the kernel that clears padding is in the chain too. (An amax pass
/// that let its second pass launch before its own wait failed this test on an H100; with
/// a 4096x4096 input alone in front, it passed.)
#[test]
#[ignore = "needs a CUDA GPU: cargo xtask test-gpu"]
fn two_pass_quantizers_see_an_input_an_early_launch_wrote() {
    require_gpu();
    let mut fill = Generator::new(8200);
    let mut mxfp8 = Mxfp8Quantizer::new(Fp8Format::E4M3).with_usage(Usage::Rowwise);
    let big_shape = [8192, 8192];
    let mut big = Tensor::zeros(big_shape, DType::F32, GPU).unwrap();
    fill.fill_normal_tensor(&mut big, 0.0, 1.0).unwrap();
    let big_q = mxfp8.quantize(&big).unwrap();
    let mut big_out = Tensor::zeros(big_shape, DType::BF16, GPU).unwrap();
    let mut call = 0;
    for (shape, dtype) in [
        ([256, 1024], DType::BF16),
        ([256, 1024], DType::F32),
        ([224, 1024], DType::BF16),
        ([224, 1024], DType::F32),
    ] {
        let mut y = Tensor::zeros(shape, DType::F32, GPU).unwrap();
        let mut q = mxfp8.make_empty(y.shape(), y.dtype(), GPU).unwrap();
        let mut x = Tensor::zeros(shape, dtype, GPU).unwrap();
        let mut quantizers: Vec<(&str, Box<dyn Quantizer>)> = vec![
            (
                "fp8 current scaling",
                Box::new(Fp8CurrentScaling::new(Fp8Format::E4M3).with_usage(Usage::Both)),
            ),
            (
                "nvfp4",
                Box::new(Nvfp4Quantizer::new().with_usage(Usage::Both)),
            ),
            (
                "nvfp4 rht",
                Box::new(Nvfp4Quantizer::new().with_rht(true).with_usage(Usage::Both)),
            ),
        ];
        // Allocated before the launches, so that no allocation stands between them.
        let mut outs: Vec<QuantizedTensor> = quantizers
            .iter()
            .map(|(_, quantizer)| quantizer.make_empty(x.shape(), x.dtype(), GPU).unwrap())
            .collect();
        for round in 0..8 {
            for ((name, quantizer), out) in quantizers.iter_mut().zip(&mut outs) {
                call += 1;
                let std = 2f32.powi(9 * (call % 3) - 9);
                fill.fill_normal_tensor(&mut y, 0.0, std).unwrap();
                mxfp8.quantize_into(&y, &mut q).unwrap();
                big_q.dequantize_into(Usage::Rowwise, &mut big_out).unwrap();
                q.dequantize_into(Usage::Rowwise, &mut x).unwrap();
                quantizer.quantize_into(&x, out).unwrap();
                let host = x.to_device(Device::Cpu).unwrap();
                assert_same(
                    out,
                    &quantizer.quantize(&host).unwrap(),
                    &format!("{name} of {dtype} {shape:?}, round {round}"),
                );
            }
        }
    }
}

/// Every two-pass quantization starts its global amax from zero. Calls whose inputs
/// shrink by 2^10 each time, and all-zero inputs, on amax grids of one CTA to thousands
/// (every input dtype; the plain and the RHT amax passes), each match the CPU: a
/// maximum left over from the call before shows in the scales.
#[test]
#[ignore = "needs a CUDA GPU: cargo xtask test-gpu"]
fn amax_passes_start_from_zero_every_call() {
    require_gpu();
    let shapes: &[&[usize]] = &[&[2048, 4096], &[272, 1040], &[16, 16], &[4096, 1024]];
    let mut seed = 8300;
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        for (i, &shape) in shapes.iter().enumerate() {
            for scale in [1.0f32, 0.0] {
                seed += 1;
                let n: usize = shape.iter().product();
                let mag = scale * 2f32.powi(-10 * i as i32);
                let v: Vec<f32> = values(n, seed)
                    .iter()
                    .map(|x| {
                        if x.is_finite() {
                            (x * mag).clamp(-1e4, 1e4)
                        } else {
                            0.0
                        }
                    })
                    .collect();
                let x = tensor_of(&v, shape, dtype);
                let what = format!("{shape:?} {dtype} magnitude {mag:e}");
                let mut fp8 = Fp8CurrentScaling::new(Fp8Format::E4M3).with_usage(Usage::Both);
                check_quantizer(&mut fp8, &x, &format!("fp8 current scaling {what}"));
                let mut nvfp4 = Nvfp4Quantizer::new().with_usage(Usage::Both);
                check_quantizer(&mut nvfp4, &x, &format!("nvfp4 {what}"));
                let mut rht = Nvfp4Quantizer::new().with_rht(true).with_usage(Usage::Both);
                check_quantizer(&mut rht, &x, &format!("nvfp4 rht {what}"));
            }
        }
    }
}

/// A quantization and a dequantization of its columnwise data, captured into a CUDA
/// graph (input and outputs allocated before the capture), replay on whatever the input
/// holds at each replay: new values are copied into the input between replays, and every
/// replay's outputs match the CPU's, byte for byte.
#[test]
#[ignore = "needs a CUDA GPU: cargo xtask test-gpu"]
fn quantizers_replay_in_a_cuda_graph() {
    require_gpu();
    let dev = tessera_core::cuda::device(0).unwrap();
    type Make = fn() -> Box<dyn Quantizer>;
    let quantizers: [(&str, Make); 5] = [
        ("fp8 current scaling", || {
            Box::new(Fp8CurrentScaling::new(Fp8Format::E4M3).with_usage(Usage::Both))
        }),
        ("mxfp8", || {
            Box::new(Mxfp8Quantizer::new(Fp8Format::E4M3).with_usage(Usage::Both))
        }),
        ("fp8 block 1x128", || {
            Box::new(
                Fp8BlockQuantizer::new(Fp8Format::E4M3, BlockDim::OneD).with_usage(Usage::Both),
            )
        }),
        ("nvfp4", || {
            Box::new(Nvfp4Quantizer::new().with_usage(Usage::Both))
        }),
        ("nvfp4 rht", || {
            Box::new(Nvfp4Quantizer::new().with_rht(true).with_usage(Usage::Both))
        }),
    ];
    let shape = [512usize, 1024];
    for dtype in [DType::BF16, DType::F32] {
        for (name, make) in quantizers {
            let mut q = make();
            let mut x = input(&shape, dtype, 9000).to_device(GPU).unwrap();
            let mut out = q.make_empty(x.shape(), dtype, GPU).unwrap();
            let mut back = Tensor::zeros(shape, DType::F32, GPU).unwrap();
            let graph = tessera_core::cuda::Graph::capture(&dev, || {
                q.quantize_into(&x, &mut out)?;
                out.dequantize_into(Usage::Columnwise, &mut back)
            })
            .unwrap_or_else(|e| panic!("{name} {dtype}: capture: {e}"));
            for replay in 0..3u64 {
                // Magnitudes move by 2^8 from replay to replay (a stale amax would show).
                let v: Vec<f32> = values(shape[0] * shape[1], 9100 + replay)
                    .iter()
                    .map(|x| x * 2f32.powi(8 * (replay as i32 % 2)))
                    .collect();
                let host = tensor_of(&v, &shape, dtype);
                dev.stream()
                    .memcpy_htod(&host.to_bytes().unwrap()[..], x.cuda_slice_mut().unwrap())
                    .unwrap();
                graph
                    .replay()
                    .unwrap_or_else(|e| panic!("{name} {dtype}: replay {replay}: {e}"));
                let want = make().quantize(&host).unwrap();
                assert_same(&out, &want, &format!("{name} {dtype}, replay {replay}"));
                assert_eq!(
                    back.to_bytes().unwrap(),
                    want.dequantize_usage(Usage::Columnwise, DType::F32)
                        .unwrap()
                        .to_bytes()
                        .unwrap(),
                    "{name} {dtype}, replay {replay}: columnwise dequantization"
                );
            }
        }
    }
}

/// Freed device memory stays cached in the device's pool (so that `quantize`, which
/// allocates its outputs, maps no fresh pages in a steady loop) until
/// `release_cached_memory` hands it back; quantizing afterwards still works.
#[test]
#[ignore = "needs a CUDA GPU: cargo xtask test-gpu"]
fn freed_device_memory_stays_cached_until_released() {
    require_gpu();
    let dev = tessera_core::cuda::device(0).unwrap();
    let free = || {
        dev.context().bind_to_thread().unwrap();
        dev.synchronize().unwrap();
        cudarc::driver::result::mem_get_info().unwrap().0
    };
    const BIG: usize = 2 << 30;
    // Start from an empty pool: blocks the tests before this one freed would otherwise
    // serve part of the allocation without a driver call.
    dev.release_cached_memory().unwrap();
    let before = free();
    let t = Tensor::empty([BIG], DType::U8, GPU).unwrap();
    let held = free();
    drop(t);
    let cached = free();
    dev.release_cached_memory().unwrap();
    let released = free();
    assert!(
        held + BIG / 2 <= before,
        "allocating 2 GiB: {before} -> {held} bytes free"
    );
    assert!(
        cached + BIG / 2 <= before,
        "freed memory left the pool: {cached} free after the drop, {before} before"
    );
    assert!(
        released >= cached + BIG / 2,
        "release_cached_memory: {cached} -> {released} bytes free"
    );
    let x = input(&[256, 512], DType::BF16, 42);
    let mut q = Fp8CurrentScaling::new(Fp8Format::E4M3).with_usage(Usage::Both);
    check_quantizer(
        &mut q,
        &x,
        "fp8 current scaling after release_cached_memory",
    );
}

/// An amax all-reduce that stands for other ranks whose amax is `floor`.
struct OtherRanks {
    floor: f32,
}

impl tessera_quant::AmaxReduction for OtherRanks {
    fn all_reduce_max(&self, amax: f32) -> tessera_core::Result<f32> {
        Ok(amax.max(self.floor))
    }
}

/// With an amax all-reduce installed, the two-pass quantizers read the device amax back,
/// reduce it and quantize with the reduced one, into the output's own amax buffers: the
/// same bytes as the CPU with the same reduction, when the other ranks' amax is above
/// this rank's (it decides the scales) and below it (it does not).
#[test]
#[ignore = "needs a CUDA GPU: cargo xtask test-gpu"]
fn two_pass_quantizers_quantize_with_the_reduced_amax() {
    require_gpu();
    let x = input(&[272, 1040], DType::BF16, 8700);
    for floor in [1e6f32, 1e-6] {
        let r: std::sync::Arc<dyn tessera_quant::AmaxReduction> =
            std::sync::Arc::new(OtherRanks { floor });
        for usage in [Usage::Rowwise, Usage::Columnwise, Usage::Both] {
            let what = format!("other ranks' amax {floor:e}, {usage:?}");
            let mut fp8 = Fp8CurrentScaling::new(Fp8Format::E4M3)
                .with_usage(usage)
                .with_amax_reduction(r.clone());
            check_quantizer(&mut fp8, &x, &format!("fp8 current scaling, {what}"));
            for rht in [false, true] {
                let mut nvfp4 = Nvfp4Quantizer::new()
                    .with_rht(rht)
                    .with_usage(usage)
                    .with_amax_reduction(r.clone());
                check_quantizer(&mut nvfp4, &x, &format!("nvfp4 rht={rht}, {what}"));
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU: cargo xtask test-gpu"]
fn stochastic_rounding_advances_the_generator_like_the_cpu() {
    require_gpu();
    let x = input(&[64, 48], DType::BF16, 77);
    let mut cpu = Nvfp4Quantizer::new().with_stochastic_rounding(Some(Generator::new(5)));
    let mut gpu = cpu.clone();
    let xd = x.to_device(GPU).unwrap();
    for round in 0..3 {
        let a = cpu.quantize(&x).unwrap();
        let b = gpu.quantize(&xd).unwrap();
        assert_same(&b, &a, &format!("round {round}"));
        assert_eq!(
            cpu.generator().unwrap().state(),
            gpu.generator().unwrap().state()
        );
    }
}

#[test]
#[ignore = "needs a CUDA GPU: cargo xtask test-gpu"]
fn cuda_results_stay_on_the_device() {
    require_gpu();
    let x = input(&[64, 64], DType::BF16, 5).to_device(GPU).unwrap();
    let q = Nvfp4Quantizer::new().quantize(&x).unwrap();
    for (name, t) in q.data_tensors() {
        assert_eq!(t.device(), GPU, "{name}");
    }
    let q = Fp8CurrentScaling::new(Fp8Format::E4M3)
        .quantize(&x)
        .unwrap();
    assert!(q.buffer(BufferName::Data).is_some());
    assert_eq!(q.dequantize(DType::BF16).unwrap().device(), GPU);
}

#[test]
fn committed_ptx_is_fresh() {
    let common = include_str!("../kernels/common.cuh");
    for (name, cu, ptx) in [
        (
            "fp8.cu",
            include_str!("../kernels/fp8.cu"),
            include_str!("../kernels/ptx/fp8.ptx"),
        ),
        (
            "mxfp8.cu",
            include_str!("../kernels/mxfp8.cu"),
            include_str!("../kernels/ptx/mxfp8.ptx"),
        ),
        (
            "block.cu",
            include_str!("../kernels/block.cu"),
            include_str!("../kernels/ptx/block.ptx"),
        ),
        (
            "nvfp4.cu",
            include_str!("../kernels/nvfp4.cu"),
            include_str!("../kernels/ptx/nvfp4.ptx"),
        ),
    ] {
        tessera_core::kernels::check_ptx_fresh(name, &[cu, common].concat(), ptx).unwrap();
    }
}
