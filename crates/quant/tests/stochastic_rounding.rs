//! NVFP4 stochastic rounding (`spec/formats.md` §2.4, `nvfp4.rs` module docs):
//! determinism in the generator state, the documented word/byte mapping and offset
//! advance, bracketing, and unbiasedness (the mean over many seeds approaches the
//! input).

use proptest::prelude::*;
use tessera_core::{DType, Device, Tensor};
use tessera_quant::cast::{E2M1_VALUES, decode_e4m3, encode_e2m1_stochastic};
use tessera_quant::{BufferName, Nvfp4Quantizer, QuantizedTensor, Quantizer, Usage};
use tessera_rng::{Generator, GeneratorState};

fn sr(seed: u64, offset: u64, usage: Usage) -> Nvfp4Quantizer {
    Nvfp4Quantizer::new()
        .with_usage(usage)
        .with_stochastic_rounding(Some(
            Generator::from_state(GeneratorState { seed, offset }).unwrap(),
        ))
}

fn bytes(qt: &QuantizedTensor, name: BufferName) -> Vec<u8> {
    qt.buffer(name).unwrap().to_bytes().unwrap()
}

fn values(seed: u64, n: usize) -> Vec<f32> {
    let mut s = seed;
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let u = (s >> 40) as f32 / (1u64 << 24) as f32;
            let e = ((s >> 20) % 7) as i32 - 3;
            (u - 0.5) * 2f32.powi(e)
        })
        .collect()
}

fn tensor(v: &[f32], dims: &[usize]) -> Tensor {
    Tensor::from_slice(v, dims, Device::Cpu).unwrap()
}

/// The words of one operand as documented: `ceil(M·K/4)` words; the generator advances
/// by that rounded up to whole 4-word blocks.
fn operand_advance(m: usize, k: usize) -> u64 {
    let words = (m * k).div_ceil(4) as u64;
    4 * words.div_ceil(4)
}

fn shape_strategy() -> impl Strategy<Value = Vec<usize>> {
    (1usize..=3, 1usize..=3, any::<bool>()).prop_map(|(a, b, nd)| {
        if nd {
            vec![2, 8 * a, 16 * b]
        } else {
            vec![16 * a, 16 * b]
        }
    })
}

/// The spec's S_enc, and the block encode multiplier g from a stored E4M3 scale.
fn s_enc(a: f32) -> f32 {
    if a == 0.0 {
        return 1.0;
    }
    let s = 2688.0f32 / a;
    if s == 0.0 { 1.0 } else { s.min(f32::MAX) }
}

/// Recomputes an operand's codes from the documented mapping: element `e` rounds
/// `y = x·g` with byte `e % 4` of word `e / 4` of the operand's words.
fn expected_codes(
    op: &[f32],
    cols: usize,
    scales: &[u8],
    scale_cols: usize,
    a: f32,
    words: &[u32],
) -> Vec<u8> {
    let sd = 1.0f32 / s_enc(a);
    op.iter()
        .enumerate()
        .map(|(e, &x)| {
            let (r, c) = (e / cols, e % cols);
            let g = (1.0f32 / (decode_e4m3(scales[r * scale_cols + c / 16]) * sd)).min(f32::MAX);
            encode_e2m1_stochastic(x * g, (words[e / 4] >> (8 * (e % 4))) as u8)
        })
        .collect()
}

fn nibbles(b: &[u8]) -> Vec<u8> {
    b.iter().flat_map(|&x| [x & 0xF, x >> 4]).collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn same_state_same_bytes_and_the_documented_offsets(
        dims in shape_strategy(),
        seed in any::<u64>(),
        start in 0u64..1000,
        vseed in any::<u64>(),
        two_d in any::<bool>(),
        rht in any::<bool>(),
    ) {
        let n: usize = dims.iter().product();
        let (m, k) = (n / dims[dims.len() - 1], dims[dims.len() - 1]);
        let x = tensor(&values(vseed, n), &dims);
        let offset = 4 * start;
        let adv = operand_advance(m, k);
        prop_assert_eq!(adv, (m * k / 4) as u64, "M·K is a multiple of 256 here");
        for (usage, orientations) in [(Usage::Rowwise, 1), (Usage::Columnwise, 1), (Usage::Both, 2)] {
            let mut a = sr(seed, offset, usage).with_2d(two_d).with_rht(rht);
            let mut b = a.clone();
            let qa = a.quantize(&x).unwrap();
            let qb = b.quantize(&x).unwrap();
            for (name, t) in qa.data_tensors() {
                prop_assert_eq!(t.to_bytes().unwrap(), qb.buffer(name).unwrap().to_bytes().unwrap());
            }
            let g = a.generator().unwrap();
            prop_assert_eq!(g.seed(), seed);
            prop_assert_eq!(g.offset(), offset + orientations * adv, "{:?}", usage);
            // A second call continues from there.
            a.quantize(&x).unwrap();
            prop_assert_eq!(a.generator().unwrap().offset(), offset + 2 * orientations * adv);
        }
        // Both = rowwise words first, then columnwise words.
        let both = sr(seed, offset, Usage::Both).with_2d(two_d).with_rht(rht).quantize(&x).unwrap();
        let row = sr(seed, offset, Usage::Rowwise).with_2d(two_d).with_rht(rht).quantize(&x).unwrap();
        let col = sr(seed, offset + adv, Usage::Columnwise).with_2d(two_d).with_rht(rht).quantize(&x).unwrap();
        for q in [&row, &col] {
            for (name, t) in q.data_tensors() {
                prop_assert_eq!(t.to_bytes().unwrap(), both.buffer(name).unwrap().to_bytes().unwrap(), "{}", name);
            }
        }
    }

    #[test]
    fn codes_follow_the_documented_word_mapping(
        dims in shape_strategy(),
        seed in any::<u64>(),
        start in 0u64..1000,
        vseed in any::<u64>(),
        two_d in any::<bool>(),
    ) {
        let n: usize = dims.iter().product();
        let (m, k) = (n / dims[dims.len() - 1], dims[dims.len() - 1]);
        let v = values(vseed, n);
        let offset = 4 * start;
        let qt = sr(seed, offset, Usage::Both).with_2d(two_d).quantize(&tensor(&v, &dims)).unwrap();
        // The same words, drawn from an independent generator.
        let mut g = Generator::from_state(GeneratorState { seed, offset }).unwrap();
        let mut wr = vec![0u32; (m * k).div_ceil(4)];
        let mut wc = vec![0u32; (m * k).div_ceil(4)];
        g.fill_u32(&mut wr);
        g.fill_u32(&mut wc);
        let a = qt.buffer(BufferName::Amax).unwrap().to_vec::<f32>().unwrap()[0];
        let s = bytes(&qt, BufferName::ScaleInv);
        let sc = qt.buffer(BufferName::ScaleInv).unwrap().shape().dims()[1];
        let want = expected_codes(&v, k, &s, sc, a, &wr);
        prop_assert_eq!(nibbles(&bytes(&qt, BufferName::Data)), want);
        let vt: Vec<f32> = (0..m * k).map(|i| v[(i % m) * k + i / m]).collect();
        let s = bytes(&qt, BufferName::ColumnwiseScaleInv);
        let sc = qt.buffer(BufferName::ColumnwiseScaleInv).unwrap().shape().dims()[1];
        let want = expected_codes(&vt, m, &s, sc, a, &wc);
        prop_assert_eq!(nibbles(&bytes(&qt, BufferName::ColumnwiseData)), want);
    }

    #[test]
    fn stochastic_codes_bracket_the_value_and_keep_the_scales(
        dims in shape_strategy(),
        seed in any::<u64>(),
        vseed in any::<u64>(),
    ) {
        let n: usize = dims.iter().product();
        let (m, k) = (n / dims[dims.len() - 1], dims[dims.len() - 1]);
        let v = values(vseed, n);
        let x = tensor(&v, &dims);
        let rne = Nvfp4Quantizer::new().quantize(&x).unwrap();
        let q = sr(seed, 0, Usage::Both).quantize(&x).unwrap();
        // Scales and amaxes do not depend on the rounding mode.
        for name in [BufferName::ScaleInv, BufferName::ColumnwiseScaleInv, BufferName::Amax, BufferName::ColumnwiseAmax] {
            prop_assert_eq!(bytes(&q, name), bytes(&rne, name));
        }
        // Each value rounds to one of the two grid points around it (saturating at 6):
        // its error is below one grid step at the block's scale.
        let a = q.buffer(BufferName::Amax).unwrap().to_vec::<f32>().unwrap()[0];
        let s = bytes(&q, BufferName::ScaleInv);
        let sc = q.buffer(BufferName::ScaleInv).unwrap().shape().dims()[1];
        let y = q.dequantize_usage(Usage::Rowwise, DType::F32).unwrap().to_vec::<f32>().unwrap();
        for r in 0..m {
            for c in 0..k {
                let d = f64::from((decode_e4m3(s[r * sc + c / 16]) * a) * (1.0f32 / 2688.0));
                let xa = f64::from(v[r * k + c].abs());
                let z = xa / d;
                let step = if z < 2.0 * (1.0 + 1e-5) { 0.5 } else if z < 4.0 * (1.0 + 1e-5) { 1.0 } else { 2.0 };
                let err = (f64::from(y[r * k + c]) - f64::from(v[r * k + c])).abs();
                let bound = step * d * (1.0 + 1e-5) + (xa - 6.0 * d).max(0.0) + 1e-30;
                prop_assert!(err <= bound, "({}, {}): x {} y {} d {}", r, c, v[r * k + c], y[r * k + c], d);
            }
        }
    }
}

#[test]
fn different_seeds_give_different_bytes() {
    let v = values(11, 64 * 64);
    let x = tensor(&v, &[64, 64]);
    let rne = Nvfp4Quantizer::new().quantize(&x).unwrap();
    let mut seen = Vec::new();
    for seed in 0..8u64 {
        let q = sr(seed, 0, Usage::Both).quantize(&x).unwrap();
        let d = (
            bytes(&q, BufferName::Data),
            bytes(&q, BufferName::ColumnwiseData),
        );
        assert_ne!(
            d.0,
            bytes(&rne, BufferName::Data),
            "seed {seed} vs round-to-nearest"
        );
        assert!(
            !seen.contains(&d),
            "seed {seed} repeats an earlier seed's bytes"
        );
        seen.push(d);
    }
    // The same seed at another offset also differs.
    let a = sr(1, 0, Usage::Rowwise).quantize(&x).unwrap();
    let b = sr(1, 4096, Usage::Rowwise).quantize(&x).unwrap();
    assert_ne!(bytes(&a, BufferName::Data), bytes(&b, BufferName::Data));
}

/// The Sylvester Hadamard matrix and TE's sign vector (§5.3), for the RHT case.
fn rht16(v: &[f64]) -> Vec<f64> {
    const S: [f64; 16] = [
        1.0, 1.0, 1.0, -1.0, 1.0, -1.0, -1.0, -1.0, -1.0, -1.0, -1.0, 1.0, -1.0, 1.0, -1.0, -1.0,
    ];
    let h = |i: usize, j: usize| {
        if (i & j).count_ones().is_multiple_of(2) {
            1.0
        } else {
            -1.0
        }
    };
    (0..16)
        .map(|j| (0..16).map(|t| v[t] * S[t] * h(t, j) / 4.0).sum())
        .collect()
}

/// Mean and variance bound of a stochastically rounded operand value `t` whose block
/// decodes with `d`: with 8 random bits the probability of rounding up is a multiple of
/// 1/256, so the mean is within `step/256` of `t` (plus `|t| − 6d` when it saturates);
/// one sample varies by at most `step/2` around its mean.
fn sr_bias_and_sd(t: f64, d: f64) -> (f64, f64) {
    let z = t.abs() / d;
    let step = if z < 2.0 * (1.0 + 1e-5) {
        0.5
    } else if z < 4.0 * (1.0 + 1e-5) {
        1.0
    } else {
        2.0
    };
    (
        step * d / 256.0 + (t.abs() - 6.0 * d).max(0.0) + t.abs() * 1e-6,
        step * d / 2.0,
    )
}

/// A 16-value pattern with a block amax of 5.9 (all blocks alike).
const PATTERN: [f32; 16] = [
    3.7, -1.23, 0.4, 2.9, -5.5, 0.05, 1.0, -0.77, 4.4, 2.2, -3.3, 0.9, 1.6, -2.5, 0.31, 5.9,
];

#[test]
fn the_mean_over_many_seeds_approaches_the_input() {
    const ROWS: usize = 256; // blocks per seed
    const SEEDS: u64 = 32;
    let n = (ROWS * SEEDS as usize) as f64;
    // Rowwise: x[r, c] = PATTERN[c]; columnwise: x[m, k] = PATTERN[m] (xᵀ rows are the
    // pattern); columnwise with the RHT: the transformed pattern is rounded, and the
    // inverse transform (entries ±1/4, orthonormal) averages 16 independent roundings.
    let row_x: Vec<f32> = (0..ROWS * 16).map(|i| PATTERN[i % 16]).collect();
    let col_x: Vec<f32> = (0..16 * ROWS).map(|i| PATTERN[i / ROWS]).collect();
    for (usage, rht, x, dims) in [
        (Usage::Rowwise, false, &row_x, [ROWS, 16]),
        (Usage::Columnwise, false, &col_x, [16, ROWS]),
        (Usage::Columnwise, true, &col_x, [16, ROWS]),
    ] {
        let t = tensor(x, &dims);
        let mut sum = [0.0f64; 16];
        let mut d = 0.0;
        let mut a = 0.0;
        for seed in 0..SEEDS {
            let q = sr(seed, 0, usage).with_rht(rht).quantize(&t).unwrap();
            let (sname, aname) = if usage == Usage::Rowwise {
                (BufferName::ScaleInv, BufferName::Amax)
            } else {
                (BufferName::ColumnwiseScaleInv, BufferName::ColumnwiseAmax)
            };
            a = q.buffer(aname).unwrap().to_vec::<f32>().unwrap()[0];
            let s = bytes(&q, sname)[0];
            d = f64::from((decode_e4m3(s) * a) * (1.0f32 / 2688.0));
            let y = q
                .dequantize_usage(usage, DType::F32)
                .unwrap()
                .to_vec::<f32>()
                .unwrap();
            for (i, v) in y.iter().enumerate() {
                let p = if usage == Usage::Rowwise {
                    i % 16
                } else {
                    i / ROWS
                };
                sum[p] += f64::from(*v);
            }
        }
        assert!(d > 0.0 && a > 0.0);
        let p64: Vec<f64> = PATTERN.iter().map(|&v| f64::from(v)).collect();
        let (bias, sd): (Vec<f64>, f64) = if rht {
            let t = rht16(&p64);
            let bs: Vec<(f64, f64)> = t.iter().map(|&v| sr_bias_and_sd(v, d)).collect();
            let bias = bs.iter().map(|b| b.0).sum::<f64>() / 4.0;
            let var = bs.iter().map(|b| b.1 * b.1).sum::<f64>() / 16.0;
            (vec![bias + 1e-5; 16], var.sqrt())
        } else {
            let bs: Vec<(f64, f64)> = p64.iter().map(|&v| sr_bias_and_sd(v, d)).collect();
            let sd = bs.iter().map(|b| b.1).fold(0.0, f64::max);
            (bs.iter().map(|b| b.0).collect(), sd)
        };
        for p in 0..16 {
            let mean = sum[p] / n;
            // Six standard deviations of the mean of n independent roundings.
            let bound = bias[p] + 6.0 * sd / n.sqrt();
            let err = (mean - p64[p]).abs();
            assert!(
                err <= bound,
                "{usage:?} rht={rht} element {p}: mean {mean} vs x {} (error {err:e} > {bound:e})",
                p64[p]
            );
            // And it is a real approach: well inside one grid step.
            assert!(bound < 0.1 * d, "{bound} vs step {d}");
        }
        // Round-to-nearest, by contrast, is biased for values between grid points.
        let rne = Nvfp4Quantizer::new()
            .with_usage(usage)
            .with_rht(rht)
            .quantize(&t)
            .unwrap()
            .dequantize_usage(usage, DType::F32)
            .unwrap()
            .to_vec::<f32>()
            .unwrap();
        let p = if usage == Usage::Rowwise { 1 } else { ROWS };
        let rne_err = (f64::from(rne[p]) - p64[1]).abs();
        if !rht {
            // −1.23/d = −1.2508…, just past the tie between −1 and −1.5.
            assert!(
                rne_err > bias[1] + 6.0 * sd / n.sqrt(),
                "RNE error {rne_err}"
            );
            assert_eq!(f64::from(rne[p]), f64::from(E2M1_VALUES[11]) * d);
        }
    }
}
