//! Round trips: `dequantize(quantize(x))` stays within each format's error bound, for
//! every quantizer and option, both orientations, and f32/bf16/f16 inputs.
//!
//! Each check reads the scales straight from the buffers (with the layouts of
//! `spec/formats.md` written out again here, including cuBLAS's swizzle), checks them
//! against the spec's scale rule for the block's amax, and then bounds every element's
//! error by the element cast's rounding error at that scale:
//!
//! * an FP8 / E2M1 cast with `p` mantissa bits rounds a value `y` in the normal range to
//!   within half an ulp, `2^-(p+1)·|y|` (E4M3: `2^-4`, E5M2: `2^-3`, E2M1: `2^-2`), and
//!   a value in the subnormal range to within half the subnormal spacing (E4M3:
//!   `2^-10`, E5M2: `2^-17`, E2M1: `0.25`); together `|q - y| <= 2^-(p+1)·|y| + sub/2`.
//!   In the input's units both terms are multiplied by the block's `scale_inv`;
//! * a value beyond the largest finite code saturates: its error is `|x| - max·scale_inv`;
//! * the float32 products of the scaling and of dequantization add a few ulps of `x`
//!   (`2^-21·|x|` covers them generously) and, for f32-subnormal results, `2^-149`.
//!
//! The scale rules then turn these per-element bounds into bounds relative to the
//! block amax `b`: e.g. MXFP8's scale `S` is the smallest power of two `>= b/max`, so
//! `S < 2b/max` and the subnormal term is below `2^-10·2b/448` for E4M3.

use half::{bf16, f16};
use proptest::prelude::*;
use tessera_core::{DType, Device, Tensor};
use tessera_quant::cast::{E2M1_VALUES, decode_e4m3, encode_e4m3};
use tessera_quant::{
    BlockDim, BufferName, Fp8BlockQuantizer, Fp8CurrentScaling, Fp8DelayedScaling, Fp8Format,
    Mxfp8Quantizer, Nvfp4Quantizer, QuantizedTensor, Quantizer, Usage,
};

// ---------------------------------------------------------------------------------------
// Inputs

/// SplitMix64: a small, dependency-free generator for test inputs.
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in [0, 1).
    fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * 2f64.powi(-53)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }
    fn normal(&mut self) -> f64 {
        let u = 1.0 - self.uniform();
        let v = self.uniform();
        (-2.0 * u.ln()).sqrt() * (2.0 * std::f64::consts::PI * v).cos()
    }
}

/// `m × k` normal values whose magnitude changes between regions of 8 rows × 16
/// columns (`2^e`, `e` uniform in `exps`), so blocks of every format see different
/// scales and some blocks mix magnitudes; a few regions are all zero and a few single
/// elements are ±0.
fn values(seed: u64, m: usize, k: usize, exps: (i32, i32)) -> Vec<f32> {
    let mut rng = Rng(seed);
    let (rm, rk) = (m.div_ceil(8), k.div_ceil(16));
    let span = (exps.1 - exps.0 + 1) as u64;
    let region: Vec<Option<f64>> = (0..rm * rk)
        .map(|_| {
            if rng.below(16) == 0 {
                None
            } else {
                Some(2f64.powi(exps.0 + rng.below(span) as i32))
            }
        })
        .collect();
    (0..m * k)
        .map(|i| {
            let (r, c) = (i / k, i % k);
            match region[(r / 8) * rk + c / 16] {
                None => 0.0,
                Some(s) => match rng.below(64) {
                    0 => 0.0,
                    1 => -0.0,
                    _ => (rng.normal() * s) as f32,
                },
            }
        })
        .collect()
}

/// A host tensor of `dtype` from `v`, and its exact values as f32.
fn input(v: &[f32], dims: &[usize], dtype: DType) -> (Tensor, Vec<f32>) {
    let t = Tensor::from_f32_values(v, dims, dtype, Device::Cpu).unwrap();
    let exact = t.to_f32_vec().unwrap();
    (t, exact)
}

fn dtype_strategy() -> impl Strategy<Value = DType> {
    prop_oneof![Just(DType::F32), Just(DType::BF16), Just(DType::F16)]
}

fn format_strategy() -> impl Strategy<Value = Fp8Format> {
    prop_oneof![Just(Fp8Format::E4M3), Just(Fp8Format::E5M2)]
}

/// Magnitude exponents per dtype: f16 has a narrow range.
fn exps(dtype: DType) -> (i32, i32) {
    if dtype == DType::F16 {
        (-8, 8)
    } else {
        (-30, 30)
    }
}

// ---------------------------------------------------------------------------------------
// Independent layout helpers

/// cuBLAS's block-scaling layout as TE's test helpers write it: the padded `[R, C]`
/// grid viewed as `[R/128, 4, 32, C/4, 4]` and permuted to `(0, 3, 2, 1, 4)`.
fn swz(i: usize, j: usize, cols: usize) -> usize {
    let (a, b, c) = (i / 128, (i % 128) / 32, i % 32);
    let (d, e) = (j / 4, j % 4);
    (((a * (cols / 4) + d) * 32 + c) * 4 + b) * 4 + e
}

fn up(x: usize, m: usize) -> usize {
    x.div_ceil(m) * m
}

/// NaN-ignoring `max |x|` over the `bh × bw` blocks of an `[m, k]` matrix (edge blocks
/// partial): `[ceil(m/bh), ceil(k/bw)]`.
fn block_amax(x: &[f32], m: usize, k: usize, bh: usize, bw: usize) -> Vec<f32> {
    let (mb, kb) = (m.div_ceil(bh), k.div_ceil(bw));
    let mut out = vec![0.0f32; mb * kb];
    for r in 0..m {
        for c in 0..k {
            let a = &mut out[(r / bh) * kb + c / bw];
            let v = x[r * k + c].abs();
            if v > *a {
                *a = v; // NaN never compares greater
            }
        }
    }
    out
}

fn bytes(qt: &QuantizedTensor, name: BufferName) -> Vec<u8> {
    qt.buffer(name)
        .unwrap_or_else(|| panic!("missing {name}"))
        .to_bytes()
        .unwrap()
}

fn f32s(qt: &QuantizedTensor, name: BufferName) -> Vec<f32> {
    qt.buffer(name).unwrap().to_vec::<f32>().unwrap()
}

/// Asserts that every byte of `buf` outside `used` is zero (scale padding).
fn padding_is_zero(buf: &[u8], used: &[bool], what: &str) {
    for (i, (&b, &u)) in buf.iter().zip(used).enumerate() {
        assert!(u || b == 0, "{what}: padding byte {i} is {b:#04x}");
    }
}

fn orientations() -> [(Usage, bool); 2] {
    [(Usage::Rowwise, false), (Usage::Columnwise, true)]
}

/// The dequantized f32 values of one orientation, after checking that the bf16 and
/// f16 dequantizations are those values rounded to nearest-even.
fn dequantized(qt: &QuantizedTensor, usage: Usage) -> Vec<f32> {
    let y = qt
        .dequantize_usage(usage, DType::F32)
        .unwrap()
        .to_vec::<f32>()
        .unwrap();
    assert_eq!(
        qt.dequantize_usage(usage, DType::F32).unwrap().shape(),
        qt.shape()
    );
    let b = qt
        .dequantize_usage(usage, DType::BF16)
        .unwrap()
        .to_vec::<bf16>()
        .unwrap();
    let h = qt
        .dequantize_usage(usage, DType::F16)
        .unwrap()
        .to_vec::<f16>()
        .unwrap();
    for ((v, b), h) in y.iter().zip(&b).zip(&h) {
        assert_eq!(b.to_bits(), bf16::from_f32(*v).to_bits());
        assert_eq!(h.to_bits(), f16::from_f32(*v).to_bits());
    }
    y
}

fn assert_within(x: f32, got: f32, bound: f64, what: &dyn Fn() -> String) {
    let err = (f64::from(got) - f64::from(x)).abs();
    assert!(
        err <= bound,
        "{}: x = {x:e}, dequantized {got:e}, error {err:e} > bound {bound:e}",
        what()
    );
}

// ---------------------------------------------------------------------------------------
// FP8 element bounds

/// `(2^-(p+1), half the subnormal spacing, max)` of an FP8 format.
fn fp8_consts(f: Fp8Format) -> (f64, f64, f64) {
    match f {
        Fp8Format::E4M3 => (2f64.powi(-4), 2f64.powi(-10), 448.0),
        Fp8Format::E5M2 => (2f64.powi(-3), 2f64.powi(-17), 57344.0),
    }
}

/// The error bound of one element quantized with multiplier `1/si` and dequantized
/// with `si` (see the module comment): RNE error at the scale, saturation, f32 slop.
fn fp8_bound(x: f32, si: f32, f: Fp8Format) -> f64 {
    let (rel, half_sub, max) = fp8_consts(f);
    let (a, si) = (f64::from(x.abs()), f64::from(si));
    let sat = (a - max * si).max(0.0);
    rel * a + half_sub * si + sat + a * 2f64.powi(-21) + 2f64.powi(-148)
}

/// TE's `compute_scale_from_amax` (§3.4), written from the spec.
fn spec_scale(amax: f32, max: f32, pow2: bool, value_for_inf: f32) -> f32 {
    if amax.is_nan() || amax.is_infinite() || amax == 0.0 {
        return 1.0;
    }
    let mut s = max / amax;
    if s == f32::INFINITY {
        s = value_for_inf;
    }
    if pow2 {
        s = f32::from_bits(s.to_bits() & 0xFF80_0000);
    }
    s
}

fn nan_ignoring_amax(x: &[f32]) -> f32 {
    x.iter()
        .fold(0.0f32, |a, &v| if v.abs() > a { v.abs() } else { a })
}

// ---------------------------------------------------------------------------------------
// FP8 per-tensor

fn check_fp8_per_tensor(x: &[f32], qt: &QuantizedTensor, f: Fp8Format, scale: f32) {
    let (m, k) = qt.shape().flat_2d();
    let si = f32s(qt, BufferName::ScaleInv);
    assert_eq!(si.len(), 1);
    assert_eq!(
        si[0].to_bits(),
        (1.0 / scale).to_bits(),
        "scale_inv = 1/scale"
    );
    // The transpose buffer holds the same bytes, transposed (§3.1).
    let d = bytes(qt, BufferName::Data);
    let t = bytes(qt, BufferName::ColumnwiseData);
    for r in 0..m {
        for c in 0..k {
            assert_eq!(t[c * m + r], d[r * k + c]);
        }
    }
    for (usage, _) in orientations() {
        let y = dequantized(qt, usage);
        for (i, (&x, &y)) in x.iter().zip(&y).enumerate() {
            assert_within(x, y, fp8_bound(x, si[0], f), &|| {
                format!("fp8 {f:?} {usage:?} element {i}")
            });
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    #[test]
    fn fp8_current_scaling_round_trips(
        dims in prop::collection::vec(1usize..24, 1..=3),
        f in format_strategy(),
        pow2 in any::<bool>(),
        dtype in dtype_strategy(),
        seed in any::<u64>(),
    ) {
        let (m, k) = (dims[..dims.len() - 1].iter().product::<usize>(), dims[dims.len() - 1]);
        let (t, x) = input(&values(seed, m, k, exps(dtype)), &dims, dtype);
        let mut q = Fp8CurrentScaling::new(f).with_pow2_scales(pow2);
        let qt = q.quantize(&t).unwrap();
        // §3.4: scale from the NaN-ignoring amax; FLT_MAX if it overflows; pow2 truncates.
        let amax = nan_ignoring_amax(&x);
        let scale = spec_scale(amax, f.max(), pow2, f32::MAX);
        if amax > 0.0 {
            // No saturation: amax·scale rounds to at most max.
            prop_assert!(f64::from(amax) * f64::from(scale) <= f64::from(f.max()) * (1.0 + 1e-6));
            if pow2 {
                // A power of two in (max/(2·amax), max/amax]: scale_inv < 2·amax/max.
                prop_assert!(f64::from(scale) > f64::from(f.max()) / f64::from(amax) / 2.0);
            }
        }
        check_fp8_per_tensor(&x, &qt, f, scale);
    }

    #[test]
    fn fp8_delayed_scaling_round_trips_and_saturates(
        dims in prop::collection::vec(1usize..24, 1..=3),
        f in format_strategy(),
        dtype in dtype_strategy(),
        seed in any::<u64>(),
        // The shared scale relative to max/amax: sometimes too large (saturation).
        log2_factor in -4i32..=2,
    ) {
        let (m, k) = (dims[..dims.len() - 1].iter().product::<usize>(), dims[dims.len() - 1]);
        let (t, x) = input(&values(seed, m, k, exps(dtype)), &dims, dtype);
        let amax = nan_ignoring_amax(&x);
        let scale = if amax > 0.0 { f.max() / amax * 2f32.powi(log2_factor) } else { 3.0 };
        let mut q = Fp8DelayedScaling::new(f, 4).unwrap().with_scale(scale).unwrap();
        let qt = q.quantize(&t).unwrap();
        check_fp8_per_tensor(&x, &qt, f, scale);
        // The cast records the tensor's amax into history slot 0 (§3.2).
        prop_assert_eq!(q.state().history()[0].to_bits(), amax.to_bits());
        prop_assert_eq!(q.state().scale(), scale);
    }
}

// ---------------------------------------------------------------------------------------
// MXFP8

/// The E8M0 code of a block with amax `b` (§4.2 step 3), from exact arithmetic: the
/// smallest power of two `>= b/max`, code 0 at or below 2^-127.
fn e8m0_of_block(b: f32, max: f32) -> u8 {
    let v = f64::from(b) / f64::from(max);
    if v <= 2f64.powi(-127) {
        return 0;
    }
    (-126..=127)
        .find(|&e| 2f64.powi(e) >= v)
        .map(|e| (e + 127) as u8)
        .unwrap_or(0xFE)
}

fn check_mxfp8(x: &[f32], qt: &QuantizedTensor, f: Fp8Format, two_d: bool, swizzled: bool) {
    let (m, k) = qt.shape().flat_2d();
    let (rel, half_sub, _) = fp8_consts(f);
    for (usage, columnwise) in orientations() {
        // Block shape in the [m, k] matrix, and the scale grid.
        let (bh, bw) = match (two_d, columnwise) {
            (true, _) => (32, 32),
            (false, false) => (1, 32),
            (false, true) => (32, 1),
        };
        let amax = block_amax(x, m, k, bh, bw);
        let (sname, rows, cols) = if columnwise {
            (BufferName::ColumnwiseScaleInv, up(m / 32, 4), up(k, 128))
        } else {
            (BufferName::ScaleInv, up(m, 128), up(k / 32, 4))
        };
        let sbuf = bytes(qt, sname);
        assert_eq!(
            qt.buffer(sname).unwrap().shape().dims(),
            &[rows, cols],
            "{sname} shape"
        );
        // Position in the buffer of the scale of element (r, c).
        let pos = |r: usize, c: usize| -> usize {
            match (columnwise, swizzled) {
                (false, false) => r * cols + c / 32,
                (false, true) => swz(r, c / 32, cols),
                (true, false) => (r / 32) * cols + c,
                // Columnwise scales are swizzled as the transpose of their grid.
                (true, true) => swz(c, r / 32, rows),
            }
        };
        let mut used = vec![false; sbuf.len()];
        let y = dequantized(qt, usage);
        for r in 0..m {
            for c in 0..k {
                let p = pos(r, c);
                used[p] = true;
                let b = amax[(r / bh) * k.div_ceil(bw) + c / bw];
                let e = sbuf[p];
                assert_eq!(
                    e,
                    e8m0_of_block(b, f.max()),
                    "mxfp8 {usage:?} scale of ({r}, {c}), block amax {b:e}"
                );
                let s = if e == 0 {
                    2f64.powi(-127)
                } else {
                    2f64.powi(i32::from(e) - 127)
                };
                // No saturation (s >= b/max) and s < 2b/max unless code 0.
                let xi = x[r * k + c];
                let bound = rel * f64::from(xi.abs()) + half_sub * s + 2f64.powi(-149);
                assert_within(xi, y[r * k + c], bound, &|| {
                    format!(
                        "mxfp8 {f:?} 2d={two_d} {usage:?} ({r}, {c}) scale 2^{}",
                        e as i32 - 127
                    )
                });
            }
        }
        padding_is_zero(&sbuf, &used, &format!("mxfp8 {sname}"));
    }
    if two_d {
        assert_eq!(
            bytes(qt, BufferName::Data),
            bytes(qt, BufferName::ColumnwiseData),
            "2-D rowwise and columnwise data are the same bytes"
        );
    }
}

/// Shapes whose flattened rows and columns are multiples of `block` (1 to `max_rows`
/// blocks of rows, 1 to 4 of columns), half of them 3-D with the rows split in two.
fn block_multiple_dims(block: usize, max_rows: usize) -> impl Strategy<Value = Vec<usize>> {
    (1usize..=max_rows, 1usize..=4, any::<bool>()).prop_map(move |(a, kb, split)| {
        if split {
            vec![2, block / 2 * a, block * kb]
        } else {
            vec![block * a, block * kb]
        }
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    #[test]
    fn mxfp8_round_trips(
        dims in block_multiple_dims(32, 3),
        f in format_strategy(),
        two_d in any::<bool>(),
        swizzled in any::<bool>(),
        dtype in dtype_strategy(),
        seed in any::<u64>(),
    ) {
        let (m, k) = (dims[..dims.len() - 1].iter().product::<usize>(), dims[dims.len() - 1]);
        let (t, x) = input(&values(seed, m, k, exps(dtype)), &dims, dtype);
        let qt = Mxfp8Quantizer::new(f)
            .with_2d(two_d)
            .with_swizzled_scales(swizzled)
            .quantize(&t)
            .unwrap();
        check_mxfp8(&x, &qt, f, two_d, swizzled);
    }
}

// ---------------------------------------------------------------------------------------
// NVFP4

/// The Sylvester Hadamard matrix H₁₆ (H₂ₙ = [[H, H], [H, −H]]).
fn hadamard16() -> [[f64; 16]; 16] {
    let mut h = [[0.0; 16]; 16];
    h[0][0] = 1.0;
    let mut n = 1;
    while n < 16 {
        for i in 0..n {
            for j in 0..n {
                let v = h[i][j];
                h[i][j + n] = v;
                h[i + n][j] = v;
                h[i + n][j + n] = -v;
            }
        }
        n *= 2;
    }
    h
}

/// TE's wgrad sign vector (`get_wgrad_sign_vector`, §5.3).
const SIGNS: [f64; 16] = [
    1.0, 1.0, 1.0, -1.0, 1.0, -1.0, -1.0, -1.0, -1.0, -1.0, -1.0, 1.0, -1.0, 1.0, -1.0, -1.0,
];

/// `y = v·(diag(s)·H₁₆)/4` on each run of 16 along the rows of `[rows, cols]`, in f64.
fn rht(v: &[f32], cols: usize) -> Vec<f64> {
    let h = hadamard16();
    let mut out = vec![0.0; v.len()];
    for (o, x) in out.chunks_mut(16).zip(v.chunks(16)) {
        for j in 0..16 {
            o[j] = (0..16)
                .map(|t| f64::from(x[t]) * SIGNS[t] * h[t][j] / 4.0)
                .sum();
        }
    }
    assert_eq!(cols % 16, 0);
    out
}

/// `S_enc` (§5.2 step 1), from the spec.
fn s_enc(a: f32) -> f32 {
    if a == 0.0 {
        return 1.0;
    }
    let s = 2688.0f32 / a;
    if s == 0.0 { 1.0 } else { s.min(f32::MAX) }
}

/// The error bound of an element `t` (in the quantized operand's units) whose block
/// decodes with multiplier `d`: E2M1 rounds `y = t/d` to within half the grid step of
/// its interval (0.25 below 2, 0.5 in [2, 4), 1 in [4, 6]); beyond 6 it saturates, an
/// extra `|t| - 6d`. Thresholds are lowered by 2^-16 so that values at an interval
/// edge get the larger step (y is computed with a few roundings).
fn e2m1_bound(t: f64, d: f64) -> f64 {
    let a = t.abs();
    let z = a / d * (1.0 + 2f64.powi(-16));
    let h = if z < 2.0 {
        0.25
    } else if z < 4.0 {
        0.5
    } else {
        1.0
    };
    h * d * (1.0 + 2f64.powi(-16)) + (a * (1.0 + 2f64.powi(-16)) - 6.0 * d).max(0.0)
}

fn check_nvfp4(x: &[f32], qt: &QuantizedTensor, two_d: bool, rht_on: bool, swizzled: bool) {
    let (m, k) = qt.shape().flat_2d();
    let a_row = f32s(qt, BufferName::Amax)[0];
    assert_eq!(
        a_row.to_bits(),
        nan_ignoring_amax(x).to_bits(),
        "rowwise amax"
    );
    let a_col = f32s(qt, BufferName::ColumnwiseAmax)[0];
    assert_eq!(
        qt.buffer(BufferName::Data).unwrap().shape().dims().last(),
        Some(&(qt.shape().dims().last().unwrap() / 2))
    );
    assert_eq!(
        qt.buffer(BufferName::ColumnwiseData)
            .unwrap()
            .shape()
            .dims(),
        &[k, m / 2]
    );
    for (usage, columnwise) in orientations() {
        // The quantized operand, [rows, cols] row-major, in f64: x, xᵀ or RHT(xᵀ).
        let (rows, cols) = if columnwise { (k, m) } else { (m, k) };
        let xt: Vec<f32> = if columnwise {
            (0..k * m).map(|i| x[(i % m) * k + i / m]).collect()
        } else {
            x.to_vec()
        };
        let op: Vec<f64> = if columnwise && rht_on {
            // The spec defines the transform as f32 butterflies (nvfp4.rs): the
            // quantizer's block amaxes and codes follow those values, which can differ
            // from the exact (f64) transform by f32 cancellation error in a run with a
            // wide value range. The f64 transform checks rht16 itself, below.
            let exact = rht(&xt, m);
            let ours: Vec<f64> = xt
                .chunks(16)
                .flat_map(tessera_quant::nvfp4::rht16)
                .map(f64::from)
                .collect();
            for (i, (a, b)) in ours.iter().zip(&exact).enumerate() {
                let run = &xt[i / 16 * 16..][..16];
                let mag: f64 = run.iter().map(|v| f64::from(v.abs())).sum();
                assert!(
                    (a - b).abs() <= mag * 2f64.powi(-20),
                    "rht16 element {i}: {a} vs exact {b}"
                );
            }
            ours
        } else {
            xt.iter().map(|&v| f64::from(v)).collect()
        };
        let a = if columnwise { a_col } else { a_row };
        if columnwise && rht_on {
            let amax_t = op.iter().fold(0.0f64, |acc, v| acc.max(v.abs()));
            assert!(
                (f64::from(a) - amax_t).abs() <= amax_t * 2f64.powi(-18),
                "columnwise amax {a} is the amax of the transformed operand {amax_t}"
            );
        } else {
            assert_eq!(
                a.to_bits(),
                a_row.to_bits(),
                "without RHT both amaxes agree"
            );
        }
        let (bh, bw) = if two_d { (16, 16) } else { (1, 16) };
        let op32: Vec<f32> = op.iter().map(|&v| v as f32).collect();
        let bamax = block_amax(&op32, rows, cols, bh, bw);
        let (sname, dname, prow, pcol) = if columnwise {
            (
                BufferName::ColumnwiseScaleInv,
                BufferName::ColumnwiseData,
                up(k, 128),
                up(m / 16, 4),
            )
        } else {
            (
                BufferName::ScaleInv,
                BufferName::Data,
                up(m, 128),
                up(k / 16, 4),
            )
        };
        let sbuf = bytes(qt, sname);
        let codes = bytes(qt, dname);
        assert_eq!(qt.buffer(sname).unwrap().shape().dims(), &[prow, pcol]);
        let se = s_enc(a);
        let mut used = vec![false; sbuf.len()];
        // Per-element bound in the operand's units, and the decode multiplier.
        let mut bound_op = vec![0.0f64; rows * cols];
        for r in 0..rows {
            for c in 0..cols {
                let p = if swizzled {
                    swz(r, c / 16, pcol)
                } else {
                    r * pcol + c / 16
                };
                used[p] = true;
                let byte = sbuf[p];
                let b = bamax[(r / bh) * (cols / bw) + c / bw];
                if !(columnwise && rht_on) {
                    // §5.2 step 3: E4M3 of b·fp32(S_enc·fp32(1/6)), capped at FLT_MAX.
                    let want = encode_e4m3((b * (se * (1.0f32 / 6.0))).min(f32::MAX));
                    assert_eq!(byte, want, "nvfp4 {usage:?} scale of ({r}, {c}), b = {b:e}");
                }
                // Dequantization multiplier (§5.2): (e4m3·A)·fp32(1/2688).
                let d32 = (decode_e4m3(byte) * a) * (1.0f32 / 2688.0);
                let d = f64::from(d32);
                let dq = f64::from(decode_e4m3(byte));
                let bf = f64::from(b);
                // Relative to the block amax: for a normal E4M3 scale, d is b/6 up to the
                // scale's RNE error 2^-4 (plus f32 slop), so every element is within one
                // E2M1 half-step at the top of the grid (1·d) of its value.
                if dq >= 2f64.powi(-6) && dq < 448.0 {
                    assert!(
                        // RNE moves a value by at most half a step, 2^-4 of the code's value
                        // q (relative to q, not to the input: just below 2^-6 the input
                        // is subnormal and its own relative error is slightly larger).
                        bf / 6.0 <= d * (1.0 + 2f64.powi(-4)) * (1.0 + 2f64.powi(-16))
                            && bf / 6.0 >= d * (1.0 - 2f64.powi(-4)) * (1.0 - 2f64.powi(-16)),
                        "nvfp4 block scale {d:e} vs block amax {bf:e} ({usage:?}, 2d={two_d}, rht={rht_on}, block ({r}, {c}) of [{rows}, {cols}], e4m3 {byte:#04x}, A {a:e})"
                    );
                }
                let t = op[r * cols + c];
                bound_op[r * cols + c] =
                    e2m1_bound(t, d) + t.abs() * 2f64.powi(-20) + 2f64.powi(-140);
            }
        }
        padding_is_zero(&sbuf, &used, &format!("nvfp4 {sname}"));
        let y = dequantized(qt, usage);
        if columnwise && rht_on {
            // The inverse transform is orthonormal with entries ±1/4: the error of each
            // element is at most a quarter of the sum of the errors of its run.
            for kr in 0..k {
                for run in 0..m / 16 {
                    let base = kr * m + run * 16;
                    let sum: f64 = bound_op[base..base + 16].iter().sum::<f64>() / 4.0;
                    let mag: f64 = op[base..base + 16].iter().map(|v| v.abs()).sum::<f64>();
                    for i in 0..16 {
                        let mc = run * 16 + i;
                        let xi = x[mc * k + kr];
                        let bound = sum + mag * 2f64.powi(-18) + 2f64.powi(-140);
                        assert_within(xi, y[mc * k + kr], bound, &|| {
                            format!("nvfp4 rht columnwise x[{mc}, {kr}]")
                        });
                    }
                }
            }
        } else {
            for r in 0..rows {
                for c in 0..cols {
                    let e = r * cols + c;
                    let (xr, xc) = if columnwise { (c, r) } else { (r, c) };
                    let code = (codes[e / 2] >> (4 * (e % 2))) & 0xF;
                    let p = if swizzled {
                        swz(r, c / 16, pcol)
                    } else {
                        r * pcol + c / 16
                    };
                    let d32 = (decode_e4m3(sbuf[p]) * a) * (1.0f32 / 2688.0);
                    let got = y[xr * k + xc];
                    assert_eq!(
                        got.to_bits(),
                        (E2M1_VALUES[code as usize] * d32).to_bits(),
                        "nvfp4 {usage:?} ({r}, {c}) = code value · (e4m3·A)/2688"
                    );
                    assert_within(x[xr * k + xc], got, bound_op[e], &|| {
                        format!("nvfp4 2d={two_d} {usage:?} operand ({r}, {c})")
                    });
                }
            }
        }
    }
    if two_d && !rht_on {
        // The columnwise codes are the transposed rowwise codes, repacked along M.
        let d = bytes(qt, BufferName::Data);
        let cd = bytes(qt, BufferName::ColumnwiseData);
        let nib = |b: &[u8], e: usize| (b[e / 2] >> (4 * (e % 2))) & 0xF;
        for r in 0..m {
            for c in 0..k {
                assert_eq!(nib(&d, r * k + c), nib(&cd, c * m + r));
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(160))]

    #[test]
    fn nvfp4_round_trips(
        dims in block_multiple_dims(16, 4),
        two_d in any::<bool>(),
        rht_on in any::<bool>(),
        swizzled in any::<bool>(),
        dtype in dtype_strategy(),
        seed in any::<u64>(),
        wide in any::<bool>(),
    ) {
        let (m, k) = (dims[..dims.len() - 1].iter().product::<usize>(), dims[dims.len() - 1]);
        // A narrow magnitude range keeps most block scales normal; a wide one makes
        // some of them underflow (scale 0: codes ±6 that dequantize to 0).
        let e = if wide { exps(dtype) } else { (-4, 4) };
        let (t, x) = input(&values(seed, m, k, e), &dims, dtype);
        let qt = Nvfp4Quantizer::new()
            .with_2d(two_d)
            .with_rht(rht_on)
            .with_swizzled_scales(swizzled)
            .quantize(&t)
            .unwrap();
        check_nvfp4(&x, &qt, two_d, rht_on, swizzled);
    }
}

// ---------------------------------------------------------------------------------------
// FP8 block scaling

fn dtype_max(dtype: DType) -> f32 {
    match dtype {
        DType::BF16 => bf16::MAX.to_f32(),
        DType::F16 => f16::MAX.to_f32(),
        _ => f32::MAX,
    }
}

fn check_block(
    x: &[f32],
    qt: &QuantizedTensor,
    f: Fp8Format,
    dim: BlockDim,
    pow2: bool,
    dtype: DType,
) {
    let (m, k) = qt.shape().flat_2d();
    let (mb, kb) = (m.div_ceil(128), k.div_ceil(128));
    for (usage, columnwise) in orientations() {
        let (bh, bw) = match (dim, columnwise) {
            (BlockDim::TwoD, _) => (128, 128),
            (BlockDim::OneD, false) => (1, 128),
            (BlockDim::OneD, true) => (128, 1),
        };
        let amax = block_amax(x, m, k, bh, bw);
        let (sname, shape) = match (dim, columnwise) {
            (BlockDim::OneD, false) => (BufferName::ScaleInv, [kb, up(m, 4)]),
            (BlockDim::OneD, true) => (BufferName::ColumnwiseScaleInv, [mb, up(k, 4)]),
            (BlockDim::TwoD, false) => (BufferName::ScaleInv, [mb, up(kb, 4)]),
            (BlockDim::TwoD, true) => (BufferName::ColumnwiseScaleInv, [kb, up(mb, 4)]),
        };
        assert_eq!(qt.buffer(sname).unwrap().shape().dims(), &shape);
        let s = f32s(qt, sname);
        // Entry of element (r, c) (§6.3 table).
        let pos = |r: usize, c: usize| match (dim, columnwise) {
            (BlockDim::OneD, false) => (c / 128) * shape[1] + r,
            (BlockDim::OneD, true) => (r / 128) * shape[1] + c,
            (BlockDim::TwoD, false) => (r / 128) * shape[1] + c / 128,
            (BlockDim::TwoD, true) => (c / 128) * shape[1] + r / 128,
        };
        let mut used = vec![false; s.len()];
        let y = dequantized(qt, usage);
        for r in 0..m {
            for c in 0..k {
                let p = pos(r, c);
                used[p] = true;
                let b = amax[(r / bh) * k.div_ceil(bw) + c / bw];
                let scale = spec_scale(b, f.max(), pow2, dtype_max(dtype));
                assert_eq!(
                    s[p].to_bits(),
                    (1.0 / scale).to_bits(),
                    "fp8-block {usage:?} scale_inv of ({r}, {c}), block amax {b:e}"
                );
                let xi = x[r * k + c];
                assert_within(xi, y[r * k + c], fp8_bound(xi, s[p], f), &|| {
                    format!("fp8-block {f:?} {dim:?} pow2={pow2} {usage:?} ({r}, {c})")
                });
            }
        }
        let padding: Vec<u8> = s.iter().map(|v| u8::from(v.to_bits() != 0)).collect();
        padding_is_zero(&padding, &used, &format!("fp8-block {sname}"));
    }
    let d = bytes(qt, BufferName::Data);
    let cd = bytes(qt, BufferName::ColumnwiseData);
    assert_eq!(
        qt.buffer(BufferName::ColumnwiseData)
            .unwrap()
            .shape()
            .dims()[0],
        k
    );
    if dim == BlockDim::TwoD {
        for r in 0..m {
            for c in 0..k {
                assert_eq!(
                    cd[c * m + r],
                    d[r * k + c],
                    "2-D columnwise is the transpose"
                );
            }
        }
    }
}

fn block_dims() -> impl Strategy<Value = Vec<usize>> {
    (1usize..=3, 1usize..=130, 1usize..=260, any::<bool>()).prop_map(|(d0, d1, k, nd)| {
        if nd {
            vec![d0, d1, k]
        } else {
            vec![d0 * d1, k]
        }
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(96))]

    #[test]
    fn fp8_block_round_trips(
        dims in block_dims(),
        f in format_strategy(),
        two_d in any::<bool>(),
        pow2 in any::<bool>(),
        dtype in dtype_strategy(),
        seed in any::<u64>(),
    ) {
        let dim = if two_d { BlockDim::TwoD } else { BlockDim::OneD };
        let (m, k) = (dims[..dims.len() - 1].iter().product::<usize>(), dims[dims.len() - 1]);
        let (t, x) = input(&values(seed, m, k, exps(dtype)), &dims, dtype);
        let qt = Fp8BlockQuantizer::new(f, dim)
            .with_pow2_scales(pow2)
            .quantize(&t)
            .unwrap();
        check_block(&x, &qt, f, dim, pow2, dtype);
    }
}

#[test]
fn fp8_block_fixed_shapes_with_ragged_edges() {
    for dims in [
        vec![2, 3, 64],
        vec![1, 1],
        vec![129, 1],
        vec![1, 129],
        vec![257, 131],
        vec![5],
    ] {
        let (m, k) = (
            dims[..dims.len() - 1].iter().product::<usize>(),
            dims[dims.len() - 1],
        );
        for dim in [BlockDim::OneD, BlockDim::TwoD] {
            for dtype in [DType::F32, DType::BF16, DType::F16] {
                let (t, x) = input(&values(7 + m as u64, m, k, exps(dtype)), &dims, dtype);
                let qt = Fp8BlockQuantizer::new(Fp8Format::E4M3, dim)
                    .quantize(&t)
                    .unwrap();
                check_block(&x, &qt, Fp8Format::E4M3, dim, true, dtype);
            }
        }
    }
}

// ---------------------------------------------------------------------------------------
// Usage subsets

/// Quantizing one orientation gives exactly that orientation's buffers of `Both`.
#[test]
fn single_usages_are_subsets_of_both() {
    type Make = fn() -> Box<dyn Quantizer>;
    let makers: Vec<(&str, Make, Vec<usize>)> = vec![
        (
            "fp8-current",
            || Box::new(Fp8CurrentScaling::new(Fp8Format::E4M3)),
            vec![3, 5, 7],
        ),
        (
            "fp8-delayed",
            || Box::new(Fp8DelayedScaling::new(Fp8Format::E5M2, 2).unwrap()),
            vec![6, 9],
        ),
        (
            "mxfp8",
            || Box::new(Mxfp8Quantizer::new(Fp8Format::E4M3).with_swizzled_scales(true)),
            vec![64, 96],
        ),
        (
            "mxfp8-2d",
            || Box::new(Mxfp8Quantizer::new(Fp8Format::E5M2).with_2d(true)),
            vec![2, 16, 64],
        ),
        (
            "nvfp4",
            || Box::new(Nvfp4Quantizer::new().with_rht(true)),
            vec![48, 32],
        ),
        (
            "nvfp4-2d",
            || {
                Box::new(
                    Nvfp4Quantizer::new()
                        .with_2d(true)
                        .with_swizzled_scales(true),
                )
            },
            vec![32, 48],
        ),
        (
            "fp8-block-1d",
            || Box::new(Fp8BlockQuantizer::new(Fp8Format::E4M3, BlockDim::OneD)),
            vec![130, 200],
        ),
        (
            "fp8-block-2d",
            || Box::new(Fp8BlockQuantizer::new(Fp8Format::E4M3, BlockDim::TwoD)),
            vec![2, 70, 150],
        ),
    ];
    for (name, make, dims) in makers {
        let (m, k) = (
            dims[..dims.len() - 1].iter().product::<usize>(),
            dims[dims.len() - 1],
        );
        let (t, _) = input(&values(99, m, k, (-3, 3)), &dims, DType::BF16);
        let both = make().quantize(&t).unwrap();
        assert_eq!(both.usage(), Usage::Both);
        for usage in [Usage::Rowwise, Usage::Columnwise] {
            let mut q = make();
            q.set_usage(usage);
            assert_eq!(q.usage(), usage);
            let one = q.quantize(&t).unwrap();
            assert_eq!(one.usage(), usage, "{name}");
            for (n, buf) in one.data_tensors() {
                assert_eq!(
                    buf.to_bytes().unwrap(),
                    both.buffer(n).unwrap().to_bytes().unwrap(),
                    "{name} {usage:?} {n}"
                );
            }
            let y = one.dequantize(DType::F32).unwrap();
            assert_eq!(
                y.to_bytes().unwrap(),
                both.dequantize_usage(usage, DType::F32)
                    .unwrap()
                    .to_bytes()
                    .unwrap(),
                "{name}: dequantize() uses the orientation present"
            );
        }
    }
}
