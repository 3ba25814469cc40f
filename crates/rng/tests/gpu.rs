//! GPU tests: every CUDA fill against the CPU reference, bit for bit (normals within
//! `NORMAL_TOLERANCE`), on random seeds, offsets and sizes; graph capture and replay of
//! the graph-safe generator. Run with `cargo xtask test-gpu`.
#![cfg(feature = "cuda")]

use half::{bf16, f16};
use tessera_core::cuda::{Graph, device, is_available};
use tessera_core::{DType, Device, Element, Error, Tensor};
use tessera_rng::{Generator, GeneratorState, GraphSafeGenerator, NORMAL_TOLERANCE};

const GPU: Device = Device::Cuda(0);

fn require_gpu() {
    assert!(
        is_available(),
        "these tests need a CUDA GPU and driver; run them with `cargo xtask test-gpu` on one"
    );
}

/// Random cases: (seed, offset, n). Sizes cover 0..8, values around the kernels' step
/// and block sizes, and large ones; offsets include a block counter that crosses 2^32
/// inside the request and one near 2^64 words.
fn cases() -> Vec<(u64, u64, usize)> {
    let mut pick = Generator::new(0x7e55e7a);
    let mut r = [0u32; 4096];
    pick.fill_u32(&mut r);
    let mut r = r.into_iter();
    let mut next = move || u64::from(r.next().unwrap()) << 32 | u64::from(r.next().unwrap());
    let mut sizes: Vec<usize> = (0..9).collect();
    sizes.extend([
        255,
        256,
        1023,
        1024,
        1025,
        4093,
        65_536 + 3,
        1 << 20,
        (1 << 22) + 7,
    ]);
    for _ in 0..6 {
        sizes.push((next() % 3_000_000) as usize);
    }
    let mut out = Vec::new();
    for (i, &n) in sizes.iter().enumerate() {
        let offset = match i % 4 {
            0 => 0,
            1 => 4 * ((1u64 << 32) - 3), // block counter crosses 2^32
            2 => (u64::MAX - 4 * 100 + 1) & !3,
            _ => (next() >> 8) * 4,
        };
        let seed = if i % 5 == 0 { u64::MAX } else { next() };
        out.push((seed, offset, n));
    }
    out
}

fn poisoned(n: usize, dtype: DType) -> Tensor {
    Tensor::filled_with_byte([n], dtype, GPU, 0xA5).unwrap()
}

fn host_bytes(t: &Tensor) -> Vec<u8> {
    t.to_bytes().unwrap()
}

#[test]
#[ignore = "needs a CUDA GPU: cargo xtask test-gpu"]
fn words_and_uniforms_are_bit_identical() {
    require_gpu();
    for (seed, offset, n) in cases() {
        let state = GeneratorState { seed, offset };
        let (mut cpu, mut gpu) = (
            Generator::from_state(state).unwrap(),
            Generator::from_state(state).unwrap(),
        );
        let mut want = Tensor::zeros([n], DType::U32, Device::Cpu).unwrap();
        let mut got = poisoned(n, DType::U32);
        cpu.fill_u32_tensor(&mut want).unwrap();
        gpu.fill_u32_tensor(&mut got).unwrap();
        assert_eq!(
            host_bytes(&got),
            host_bytes(&want),
            "u32 seed {seed:#x} offset {offset} n {n}"
        );
        let mut want = Tensor::zeros([n], DType::F32, Device::Cpu).unwrap();
        let mut got = poisoned(n, DType::F32);
        cpu.fill_uniform_tensor(&mut want).unwrap();
        gpu.fill_uniform_tensor(&mut got).unwrap();
        assert_eq!(
            host_bytes(&got),
            host_bytes(&want),
            "uniform seed {seed:#x} offset {offset} n {n}"
        );
        assert_eq!(cpu.state(), gpu.state());
    }
}

/// Inputs with every special value dropout can meet.
fn dropout_input<T: Element>(
    n: usize,
    seed: u64,
    from_f32: impl Fn(f32) -> T,
    specials: &[T],
) -> Vec<T> {
    let mut u = vec![0f32; n];
    Generator::new(seed ^ 0x5eed).fill_normal(&mut u, 0.0, 100.0);
    let mut v: Vec<T> = u.iter().map(|&x| from_f32(x)).collect();
    for (i, s) in specials.iter().enumerate() {
        if i * 7 < n {
            v[i * 7] = *s;
        }
    }
    v
}

fn check_dropout<T: Element>(specials: &[T], from_f32: impl Fn(f32) -> T + Copy) {
    for (case, (seed, offset, n)) in cases().into_iter().enumerate() {
        let p = [0.0f32, 0.1, 0.5, 0.999, 1.0, 0.25][case % 6];
        let state = GeneratorState { seed, offset };
        let x = Tensor::from_slice(
            &dropout_input(n, seed, from_f32, specials),
            [n],
            Device::Cpu,
        )
        .unwrap();
        let xd = x.to_device(GPU).unwrap();
        let (want, want_mask) = Generator::from_state(state)
            .unwrap()
            .dropout_tensor(&x, p)
            .unwrap();
        let mut got = poisoned(n, T::DTYPE);
        let mut got_mask = poisoned(n, DType::U8);
        let mut g = Generator::from_state(state).unwrap();
        g.dropout_into(&xd, p, &mut got, &mut got_mask).unwrap();
        let what = format!("{} seed {seed:#x} offset {offset} n {n} p {p}", T::DTYPE);
        assert_eq!(host_bytes(&got_mask), host_bytes(&want_mask), "mask {what}");
        assert_eq!(host_bytes(&got), host_bytes(&want), "output {what}");
        assert_eq!(g.offset(), offset.wrapping_add(4 * (n as u64).div_ceil(4)));
    }
}

#[test]
#[ignore = "needs a CUDA GPU: cargo xtask test-gpu"]
fn dropout_is_bit_identical_for_f32_bf16_f16() {
    require_gpu();
    let sub = f32::from_bits(1);
    check_dropout::<f32>(
        &[
            f32::NAN,
            -f32::NAN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            -0.0,
            sub,
            f32::MAX,
            -f32::MIN_POSITIVE,
        ],
        |x| x,
    );
    check_dropout::<bf16>(
        &[
            bf16::NAN,
            bf16::from_bits(0xFFC1),
            bf16::INFINITY,
            bf16::NEG_INFINITY,
            bf16::NEG_ZERO,
            bf16::from_bits(1),
            bf16::MAX,
        ],
        bf16::from_f32,
    );
    check_dropout::<f16>(
        &[
            f16::NAN,
            f16::from_bits(0xFE01),
            f16::INFINITY,
            f16::NEG_INFINITY,
            f16::NEG_ZERO,
            f16::from_bits(1),
            f16::MAX,
        ],
        f16::from_f32,
    );
}

#[test]
#[ignore = "needs a CUDA GPU: cargo xtask test-gpu"]
fn normals_are_within_the_documented_tolerance() {
    require_gpu();
    let mut worst = 0f32;
    for (seed, offset, n) in cases() {
        let state = GeneratorState { seed, offset };
        for (mean, std) in [(0.0f32, 1.0f32), (-2.0, 0.02)] {
            let mut want = Tensor::zeros([n], DType::F32, Device::Cpu).unwrap();
            let mut got = poisoned(n, DType::F32);
            Generator::from_state(state)
                .unwrap()
                .fill_normal_tensor(&mut want, mean, std)
                .unwrap();
            Generator::from_state(state)
                .unwrap()
                .fill_normal_tensor(&mut got, mean, std)
                .unwrap();
            let (want, got) = (want.to_vec::<f32>().unwrap(), got.to_vec::<f32>().unwrap());
            for (i, (&w, &g)) in want.iter().zip(&got).enumerate() {
                let z = (w - mean) / std;
                // One more rounding for the affine map: half an ulp of the result.
                let bound = std * NORMAL_TOLERANCE * z.abs().max(1.0) + f32::EPSILON * w.abs();
                let err = (g - w).abs();
                assert!(
                    g.is_finite() && err <= bound,
                    "normal {i} of n {n} seed {seed:#x}: cpu {w} gpu {g}"
                );
                if (mean, std) == (0.0, 1.0) {
                    worst = worst.max(err / z.abs().max(1.0));
                }
            }
        }
    }
    println!(
        "largest standard-normal difference: {:.2} eps * max(|z|, 1)",
        worst / f32::EPSILON
    );
}

#[test]
#[ignore = "needs a CUDA GPU: cargo xtask test-gpu"]
fn graph_safe_fills_draw_fresh_numbers_on_every_replay() {
    require_gpu();
    let start = GeneratorState {
        seed: 0xC0FFEE,
        offset: 4 * 12345,
    };
    let (n1, n2, n3) = (1001usize, 70_001usize, 33usize);
    let x = Tensor::from_slice(
        &dropout_input(n2, 3, bf16::from_f32, &[bf16::NAN]),
        [n2],
        Device::Cpu,
    )
    .unwrap();
    let xd = x.to_device(GPU).unwrap();
    let mut gs = GraphSafeGenerator::new(GPU, start).unwrap();
    let mut a = poisoned(n1, DType::U32);
    let mut y = poisoned(n2, DType::BF16);
    let mut m = poisoned(n2, DType::U8);
    let mut c = poisoned(n3, DType::F32);
    let dev = device(0).unwrap();
    let graph = Graph::capture(&dev, || {
        gs.fill_u32_tensor(&mut a)?;
        gs.dropout_into(&xd, 0.2, &mut y, &mut m)?;
        gs.fill_uniform_tensor(&mut c)
    })
    .unwrap();
    // Capturing ran nothing.
    assert_eq!(gs.state().unwrap(), start);
    let mut cpu = Generator::from_state(start).unwrap();
    for replay in 0..3 {
        graph.replay().unwrap();
        let mut wa = Tensor::zeros([n1], DType::U32, Device::Cpu).unwrap();
        cpu.fill_u32_tensor(&mut wa).unwrap();
        let (wy, wm) = cpu.dropout_tensor(&x, 0.2).unwrap();
        let mut wc = Tensor::zeros([n3], DType::F32, Device::Cpu).unwrap();
        cpu.fill_uniform_tensor(&mut wc).unwrap();
        assert_eq!(host_bytes(&a), host_bytes(&wa), "replay {replay}: words");
        assert_eq!(
            host_bytes(&y),
            host_bytes(&wy),
            "replay {replay}: dropout output"
        );
        assert_eq!(
            host_bytes(&m),
            host_bytes(&wm),
            "replay {replay}: dropout mask"
        );
        assert_eq!(host_bytes(&c), host_bytes(&wc), "replay {replay}: uniforms");
        assert_eq!(
            gs.state().unwrap(),
            cpu.state(),
            "replay {replay}: device offset"
        );
    }
    // Eager graph-safe use draws the same as an eager generator.
    gs.set_state(start).unwrap();
    let mut e = poisoned(n1, DType::U32);
    gs.fill_u32_tensor(&mut e).unwrap();
    let mut we = Tensor::zeros([n1], DType::U32, Device::Cpu).unwrap();
    Generator::from_state(start)
        .unwrap()
        .fill_u32_tensor(&mut we)
        .unwrap();
    assert_eq!(host_bytes(&e), host_bytes(&we));
}

#[test]
#[ignore = "needs a CUDA GPU: cargo xtask test-gpu"]
fn graph_safe_calls_outside_a_cuda_context_are_errors() {
    require_gpu();
    let err = GraphSafeGenerator::new(Device::Cpu, GeneratorState::new(1)).unwrap_err();
    assert!(matches!(err, Error::Device { .. }), "{err}");
    let mut gs = GraphSafeGenerator::new(GPU, GeneratorState::new(1)).unwrap();
    let mut host = Tensor::zeros([4], DType::U32, Device::Cpu).unwrap();
    let err = gs.fill_u32_tensor(&mut host).unwrap_err();
    assert!(
        err.to_string().contains("expected a tensor on cuda:0"),
        "{err}"
    );
    let x = Tensor::zeros([4], DType::F32, GPU).unwrap();
    let (mut y, mut m) = (
        Tensor::zeros([4], DType::F32, Device::Cpu).unwrap(),
        poisoned(4, DType::U8),
    );
    assert!(matches!(
        gs.dropout_into(&x, 0.5, &mut y, &mut m),
        Err(Error::Device { .. })
    ));
    let err = Tensor::zeros([4], DType::F32, Device::Cuda(1000)).unwrap_err();
    assert!(
        err.to_string().contains("CUDA device 1000 requested"),
        "{err}"
    );
    assert_eq!(
        gs.state().unwrap(),
        GeneratorState::new(1),
        "failed calls draw nothing"
    );
}
