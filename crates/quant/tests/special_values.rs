//! NaN, ±Inf, all-zero blocks, f32-subnormal and near-`f32::MAX` inputs: the kernel
//! rules of `spec/formats.md` §8 (and §3.4, §4.2, §5.2, §6.2), checked on the bytes.
//!
//! Expected bytes are spelled out as literals where the spec gives them, and otherwise
//! computed from the spec's formulas with the element encoders (whose bit-exactness
//! `tests/casts.rs` checks against an independent oracle).

use half::bf16;
use tessera_core::{DType, Device, Tensor};
use tessera_quant::cast::{decode_e4m3, encode_e2m1, encode_e4m3, encode_e5m2};
use tessera_quant::{
    BlockDim, BufferName, Fp8BlockQuantizer, Fp8CurrentScaling, Fp8DelayedScaling, Fp8Format,
    Mxfp8Quantizer, Nvfp4Quantizer, QuantizedTensor, Quantizer, Usage,
};

const NAN: f32 = f32::NAN;
const INF: f32 = f32::INFINITY;

fn t32(v: &[f32], dims: &[usize]) -> Tensor {
    Tensor::from_slice(v, dims, Device::Cpu).unwrap()
}

fn bytes(qt: &QuantizedTensor, name: BufferName) -> Vec<u8> {
    qt.buffer(name).unwrap().to_bytes().unwrap()
}

fn f32s(qt: &QuantizedTensor, name: BufferName) -> Vec<f32> {
    qt.buffer(name).unwrap().to_vec::<f32>().unwrap()
}

fn enc(f: Fp8Format, v: f32) -> u8 {
    match f {
        Fp8Format::E4M3 => encode_e4m3(v),
        Fp8Format::E5M2 => encode_e5m2(v),
    }
}

// ---------------------------------------------------------------------------------------
// FP8 per-tensor

fn current(f: Fp8Format, pow2: bool, x: &[f32], dims: &[usize]) -> QuantizedTensor {
    Fp8CurrentScaling::new(f)
        .with_pow2_scales(pow2)
        .quantize(&t32(x, dims))
        .unwrap()
}

#[test]
fn fp8_current_scaling_inf_amax_gives_scale_one() {
    // amax is Inf (NaN ignored) → scale 1 (§3.4 step 2); NaN → 0x7F, ±Inf → ±max.
    let x = [1.0, NAN, INF, -INF, -2.0, 0.0, -0.0, 3.0];
    let q = current(Fp8Format::E4M3, false, &x, &[2, 4]);
    assert_eq!(f32s(&q, BufferName::ScaleInv), [1.0]);
    assert_eq!(
        bytes(&q, BufferName::Data),
        [0x38, 0x7F, 0x7E, 0xFE, 0xC0, 0x00, 0x80, 0x44]
    );
    let q = current(Fp8Format::E5M2, true, &x, &[2, 4]);
    assert_eq!(f32s(&q, BufferName::ScaleInv), [1.0]);
    assert_eq!(
        bytes(&q, BufferName::Data),
        [0x3C, 0x7F, 0x7B, 0xFB, 0xC0, 0x00, 0x80, 0x42]
    );
    // Columnwise bytes are the transpose.
    assert_eq!(
        bytes(&q, BufferName::ColumnwiseData),
        [0x3C, 0xC0, 0x7F, 0x00, 0x7B, 0x80, 0xFB, 0x42]
    );
}

#[test]
fn fp8_current_scaling_zero_and_all_nan_tensors() {
    for f in [Fp8Format::E4M3, Fp8Format::E5M2] {
        for pow2 in [false, true] {
            // amax 0 → scale 1; the sign of zero is kept.
            let q = current(f, pow2, &[0.0, -0.0, 0.0, -0.0], &[4]);
            assert_eq!(f32s(&q, BufferName::ScaleInv), [1.0]);
            assert_eq!(bytes(&q, BufferName::Data), [0x00, 0x80, 0x00, 0x80]);
            // All NaN: NaN-ignoring amax is 0 → scale 1, every byte 0x7F.
            let q = current(f, pow2, &[NAN, -NAN, NAN, NAN, NAN, NAN], &[2, 3]);
            assert_eq!(f32s(&q, BufferName::ScaleInv), [1.0]);
            assert_eq!(bytes(&q, BufferName::Data), [0x7F; 6]);
            assert_eq!(bytes(&q, BufferName::ColumnwiseData), [0x7F; 6]);
        }
        // amax_epsilon floors a zero amax: scale = max / eps.
        let q = Fp8CurrentScaling::new(f)
            .with_amax_epsilon(2.0)
            .quantize(&t32(&[0.0; 4], &[2, 2]))
            .unwrap();
        assert_eq!(f32s(&q, BufferName::ScaleInv), [1.0 / (f.max() / 2.0)]);
    }
}

#[test]
fn fp8_current_scaling_nan_is_ignored_by_the_amax() {
    let x = [NAN, 300.0, -1.0, 0.1];
    let q = current(Fp8Format::E4M3, false, &x, &[2, 2]);
    // §3.5: amax 300 → scale_inv bits 0x3F2B6DB7.
    assert_eq!(f32s(&q, BufferName::ScaleInv)[0].to_bits(), 0x3F2B_6DB7);
    let d = bytes(&q, BufferName::Data);
    assert_eq!(d[0], 0x7F);
    assert_eq!(d[1], 0x7E);
}

#[test]
fn fp8_current_scaling_subnormal_and_huge_amax() {
    for f in [Fp8Format::E4M3, Fp8Format::E5M2] {
        // f32 subnormals: max/amax overflows → FLT_MAX (current scaling's value_for_inf);
        // pow2 truncates FLT_MAX to 2^127.
        let x = [1e-40f32, -3e-41, 0.0, 7e-45];
        for (pow2, scale) in [(false, f32::MAX), (true, 2f32.powi(127))] {
            let q = current(f, pow2, &x, &[2, 2]);
            assert_eq!(
                f32s(&q, BufferName::ScaleInv)[0].to_bits(),
                (1.0 / scale).to_bits()
            );
            let want: Vec<u8> = x.iter().map(|&v| enc(f, v * scale)).collect();
            assert_eq!(bytes(&q, BufferName::Data), want, "{f:?} pow2={pow2}");
            assert_eq!(want[0], f.encode(1e-40 * scale));
        }
        // Near f32::MAX: scale = max/FLT_MAX, a normal float; the amax maps to max.
        let x = [f32::MAX, -3e38, 1.0, -f32::MAX];
        let q = current(f, false, &x, &[4]);
        let scale = f.max() / f32::MAX;
        assert!(scale.is_normal());
        assert_eq!(
            f32s(&q, BufferName::ScaleInv)[0].to_bits(),
            (1.0 / scale).to_bits()
        );
        let d = bytes(&q, BufferName::Data);
        let max_code = enc(f, f.max());
        assert_eq!(d, [max_code, enc(f, -3e38 * scale), 0x00, max_code | 0x80]);
        // The dequantized amax comes back to within the format's precision.
        let y = q.dequantize(DType::F32).unwrap().to_vec::<f32>().unwrap();
        assert!((f64::from(y[0]) - f64::from(f32::MAX)).abs() <= 1e-6 * f64::from(f32::MAX));
    }
}

#[test]
fn fp8_delayed_scaling_saturates_and_records_a_nan_ignoring_amax() {
    // §3.5: a delayed cast with scale 1 of [600, −1e9, NaN, +Inf] gives 7E FE 7F 7E.
    let x = t32(&[600.0, -1e9, NAN, INF], &[4]);
    let mut q = Fp8DelayedScaling::new(Fp8Format::E4M3, 3).unwrap();
    let qt = q.quantize(&x).unwrap();
    assert_eq!(bytes(&qt, BufferName::Data), [0x7E, 0xFE, 0x7F, 0x7E]);
    assert_eq!(q.state().history()[0], INF);
    let mut q = Fp8DelayedScaling::new(Fp8Format::E5M2, 3).unwrap();
    let qt = q.quantize(&x).unwrap();
    assert_eq!(
        bytes(&qt, BufferName::Data),
        [encode_e5m2(600.0), 0xFB, 0x7F, 0x7B]
    );
    // NaN never wins the recorded amax; casts accumulate with max.
    let mut q = Fp8DelayedScaling::new(Fp8Format::E4M3, 3)
        .unwrap()
        .with_usage(Usage::Rowwise);
    q.quantize(&t32(&[NAN, 2.0, -3.0], &[3])).unwrap();
    assert_eq!(q.state().history()[0], 3.0);
    q.quantize(&t32(&[NAN, 1.0], &[2])).unwrap();
    assert_eq!(q.state().history()[0], 3.0);
    q.quantize(&t32(&[-5.0, 1.0], &[2])).unwrap();
    assert_eq!(q.state().history()[0], 5.0);
    q.set_record_amax(false);
    q.quantize(&t32(&[-50.0], &[1])).unwrap();
    assert_eq!(q.state().history()[0], 5.0, "recording turned off");
}

// ---------------------------------------------------------------------------------------
// MXFP8

/// One rowwise block of 32 (a [32, 32] tensor whose row 0 is `row`, other rows 1.0).
fn mx_rowwise(f: Fp8Format, row: &[f32]) -> (u8, Vec<u8>) {
    let mut x = vec![1.0f32; 32 * 32];
    x[..32].copy_from_slice(row);
    let q = Mxfp8Quantizer::new(f)
        .with_usage(Usage::Rowwise)
        .quantize(&t32(&x, &[32, 32]))
        .unwrap();
    let s = bytes(&q, BufferName::ScaleInv);
    let d = bytes(&q, BufferName::Data);
    // Other rows: amax 1 → v = fp32(1/max) → smallest power of two ≥ it.
    let e1 = if f == Fp8Format::E4M3 {
        127 - 8
    } else {
        127 - 15
    };
    assert_eq!(s[4], e1, "row 1's scale (cols padded to 4)");
    (s[0], d[..32].to_vec())
}

/// The same block as a column of a [32, 32] tensor, quantized columnwise.
fn mx_columnwise(f: Fp8Format, col: &[f32]) -> (u8, Vec<u8>) {
    let mut x = vec![1.0f32; 32 * 32];
    for (r, &v) in col.iter().enumerate() {
        x[r * 32] = v;
    }
    let q = Mxfp8Quantizer::new(f)
        .with_usage(Usage::Columnwise)
        .quantize(&t32(&x, &[32, 32]))
        .unwrap();
    let s = bytes(&q, BufferName::ColumnwiseScaleInv);
    let d = bytes(&q, BufferName::ColumnwiseData);
    (s[0], (0..32).map(|r| d[r * 32]).collect())
}

#[test]
fn mxfp8_special_blocks() {
    for f in [Fp8Format::E4M3, Fp8Format::E5M2] {
        let mut cases: Vec<(Vec<f32>, u8, Vec<u8>)> = Vec::new();
        // Zero block (with −0): code 0 (2^-127), zeros keep their sign.
        let mut z = vec![0.0f32; 32];
        z[5] = -0.0;
        let mut want = vec![0u8; 32];
        want[5] = 0x80;
        cases.push((z, 0, want));
        // All-NaN block: amax 0 → code 0; NaN → 0x7F.
        cases.push((vec![NAN; 32], 0, vec![0x7F; 32]));
        // NaN next to finite values: NaN ignored by the amax (10 → e = 122 for E4M3).
        let mut v = vec![0.0f32; 32];
        v[0] = 10.0;
        v[1] = NAN;
        v[2] = -3.3;
        let e = if f == Fp8Format::E4M3 { 122 } else { 127 - 12 };
        let s = 2f32.powi(127 - i32::from(e));
        let mut want: Vec<u8> = v.iter().map(|&x| enc(f, x * s)).collect();
        want[1] = 0x7F;
        cases.push((v, e, want));
        // Inf in the block: e = 0xFE (satfinite), multiplier 2^-127: finite values flush
        // to ±0, ±Inf saturates to ±max, NaN → 0x7F.
        let mut v = vec![1.0f32; 32];
        v[3] = INF;
        v[4] = -INF;
        v[5] = NAN;
        v[6] = -1.0;
        v[7] = f32::MAX;
        let mut want = vec![0u8; 32];
        want[3] = enc(f, f.max());
        want[4] = want[3] | 0x80;
        want[5] = 0x7F;
        want[6] = 0x80;
        // f32::MAX · 2^-127 = 2^1·(2 − 2^-23): saturates in E4M3? no: it is ~2, encodes.
        want[7] = enc(f, f32::MAX * 2f32.powi(-127));
        cases.push((v, 0xFE, want));
        // f32 subnormals: v = amax/max ≤ 2^-127 → code 0, multiplier 2^127.
        let mut v = vec![0.0f32; 32];
        v[0] = 1e-40;
        v[1] = -7e-45;
        let want: Vec<u8> = v.iter().map(|&x| enc(f, x * 2f32.powi(127))).collect();
        assert_ne!(want[0], 0, "the subnormal survives at scale 2^-127");
        cases.push((v, 0, want));
        // Near f32::MAX: 3e38 → e = 247 for E4M3 (§4.3).
        let mut v = vec![0.0f32; 32];
        v[0] = 3e38;
        v[1] = -f32::MAX;
        v[2] = 1e30;
        let e = if f == Fp8Format::E4M3 {
            247
        } else {
            254 - 15 + 1
        };
        let s = 2f32.powi(127 - i32::from(e));
        let want: Vec<u8> = v.iter().map(|&x| enc(f, x * s)).collect();
        cases.push((v, e, want));
        for (i, (v, e, want)) in cases.iter().enumerate() {
            let (se, d) = mx_rowwise(f, v);
            assert_eq!((se, &d), (*e, want), "{f:?} rowwise case {i}");
            let (se, d) = mx_columnwise(f, v);
            assert_eq!((se, &d), (*e, want), "{f:?} columnwise case {i}");
        }
    }
}

#[test]
fn mxfp8_2d_tile_with_inf_or_nan() {
    // One Inf anywhere in a 32×32 tile sets the whole tile's exponent to 0xFE; the
    // other tile is unaffected. NaN is ignored.
    let mut x = vec![1.0f32; 32 * 64];
    x[17 * 64 + 9] = INF;
    x[3 * 64 + 40] = NAN;
    let q = Mxfp8Quantizer::new(Fp8Format::E4M3)
        .with_2d(true)
        .quantize(&t32(&x, &[32, 64]))
        .unwrap();
    let s = bytes(&q, BufferName::ScaleInv);
    let cs = bytes(&q, BufferName::ColumnwiseScaleInv);
    let cols = q.buffer(BufferName::ScaleInv).unwrap().shape().dims()[1];
    for r in 0..32 {
        assert_eq!(s[r * cols], 0xFE);
        assert_eq!(s[r * cols + 1], 127 - 8);
    }
    for (c, &e) in cs.iter().take(64).enumerate() {
        assert_eq!(e, if c < 32 { 0xFE } else { 127 - 8 });
    }
    let d = bytes(&q, BufferName::Data);
    assert_eq!(d[17 * 64 + 9], 0x7E);
    assert_eq!(d[0], 0x00);
    assert_eq!(d[3 * 64 + 40], 0x7F);
    assert_eq!(d[40], encode_e4m3(256.0));
    assert_eq!(d, bytes(&q, BufferName::ColumnwiseData));
}

// ---------------------------------------------------------------------------------------
// NVFP4

/// The spec's NVFP4 rule (§5.2) for a row-major `[rows, cols]` operand with 1×16 blocks
/// and global amax `a`: `(codes unpacked, scales)`.
fn nvfp4_expect(x: &[f32], rows: usize, cols: usize, a: f32) -> (Vec<u8>, Vec<u8>) {
    let se = if a == 0.0 {
        1.0
    } else {
        let s = 2688.0f32 / a;
        if s == 0.0 { 1.0 } else { s.min(f32::MAX) }
    };
    let sd = 1.0f32 / se;
    let mut codes = Vec::new();
    let mut scales = Vec::new();
    for r in 0..rows {
        for j in 0..cols / 16 {
            let blk = &x[r * cols + 16 * j..][..16];
            let b = blk
                .iter()
                .fold(0.0f32, |m, v| if v.abs() > m { v.abs() } else { m });
            let e = encode_e4m3((b * (se * (1.0f32 / 6.0))).min(f32::MAX));
            let g = (1.0f32 / (decode_e4m3(e) * sd)).min(f32::MAX);
            scales.push(e);
            codes.extend(blk.iter().map(|&v| encode_e2m1(v * g)));
        }
    }
    (codes, scales)
}

fn nibbles(b: &[u8]) -> Vec<u8> {
    b.iter().flat_map(|&x| [x & 0xF, x >> 4]).collect()
}

/// Quantizes a [16, 32] tensor (rowwise) and checks codes, scales and amax against the
/// spec rule; returns the codes.
fn nvfp4_case(x: &[f32]) -> Vec<u8> {
    let q = Nvfp4Quantizer::new().quantize(&t32(x, &[16, 32])).unwrap();
    let a = x
        .iter()
        .fold(0.0f32, |m, v| if v.abs() > m { v.abs() } else { m });
    assert_eq!(f32s(&q, BufferName::Amax)[0].to_bits(), a.to_bits());
    assert_eq!(
        f32s(&q, BufferName::ColumnwiseAmax)[0].to_bits(),
        a.to_bits()
    );
    let (codes, scales) = nvfp4_expect(x, 16, 32, a);
    assert_eq!(nibbles(&bytes(&q, BufferName::Data)), codes);
    let s = bytes(&q, BufferName::ScaleInv);
    let cols = q.buffer(BufferName::ScaleInv).unwrap().shape().dims()[1];
    for r in 0..16 {
        assert_eq!(
            &s[r * cols..r * cols + 2],
            &scales[2 * r..2 * r + 2],
            "row {r}"
        );
    }
    // Columnwise: the same rule on xᵀ.
    let xt: Vec<f32> = (0..32 * 16).map(|i| x[(i % 16) * 32 + i / 16]).collect();
    let (ccodes, cscales) = nvfp4_expect(&xt, 32, 16, a);
    assert_eq!(nibbles(&bytes(&q, BufferName::ColumnwiseData)), ccodes);
    let cs = bytes(&q, BufferName::ColumnwiseScaleInv);
    let ccols = q
        .buffer(BufferName::ColumnwiseScaleInv)
        .unwrap()
        .shape()
        .dims()[1];
    for r in 0..32 {
        assert_eq!(cs[r * ccols], cscales[r]);
    }
    codes
}

#[test]
fn nvfp4_inf_nan_zero_tiny_and_huge() {
    // Inf in the tensor: A = Inf → S_enc = 1; its block's scale saturates to 448 (0x7E);
    // ±Inf → ±6 (codes 7 / 15); NaN → +6 (code 7).
    let mut x = vec![0.5f32; 512];
    x[0] = INF;
    x[1] = -INF;
    x[2] = NAN;
    x[3] = -0.0;
    x[40] = -3.0;
    let c = nvfp4_case(&x);
    assert_eq!(&c[..4], &[7, 15, 7, 8]);
    // Zero tensor (with −0): A = 0 → S_enc = 1, scales 0, codes 0 / 8.
    let mut z = vec![0.0f32; 512];
    z[7] = -0.0;
    let c = nvfp4_case(&z);
    assert!(
        c.iter()
            .enumerate()
            .all(|(i, &v)| v == if i == 7 { 8 } else { 0 })
    );
    // All NaN: amax 0, every code 7 (+6), every scale 0 — dequantizes to 0.
    let c = nvfp4_case(&[NAN; 512]);
    assert!(c.iter().all(|&v| v == 7));
    let q = Nvfp4Quantizer::new()
        .quantize(&t32(&[NAN; 512], &[16, 32]))
        .unwrap();
    assert!(
        q.dequantize(DType::F32)
            .unwrap()
            .to_vec::<f32>()
            .unwrap()
            .iter()
            .all(|&v| v == 0.0)
    );
    // f32 subnormals: 2688/A overflows → S_enc = FLT_MAX.
    let tiny: Vec<f32> = (0..512).map(|i| (i as f32 - 256.0) * 1e-42).collect();
    nvfp4_case(&tiny);
    // Near f32::MAX: the largest block maps to 448·6.
    let huge: Vec<f32> = (0..512)
        .map(|i| f32::MAX / (1.0 + (i % 37) as f32) * if i % 3 == 0 { -1.0 } else { 1.0 })
        .collect();
    let c = nvfp4_case(&huge);
    assert_eq!(c[0], 15, "-f32::MAX maps to -6");
    assert_eq!(c[1], 5, "f32::MAX / 2 maps to +3");
}

// ---------------------------------------------------------------------------------------
// FP8 block scaling

fn block_rowwise(f: Fp8Format, pow2: bool, x: &[f32], dtype: DType) -> (Vec<f32>, Vec<u8>) {
    // One row of 128 (rowwise 1×128 block), padded scale shape [1, 4].
    let t = match dtype {
        DType::F32 => t32(x, &[1, 128]),
        DType::BF16 => Tensor::from_slice(
            &x.iter().map(|&v| bf16::from_f32(v)).collect::<Vec<_>>(),
            [1, 128],
            Device::Cpu,
        )
        .unwrap(),
        _ => unreachable!(),
    };
    let q = Fp8BlockQuantizer::new(f, BlockDim::OneD)
        .with_pow2_scales(pow2)
        .with_usage(Usage::Rowwise)
        .quantize(&t)
        .unwrap();
    let s = f32s(&q, BufferName::ScaleInv);
    assert_eq!(&s[1..], &[0.0; 3], "padding");
    (vec![s[0]], bytes(&q, BufferName::Data))
}

#[test]
fn fp8_block_special_blocks() {
    for f in [Fp8Format::E4M3, Fp8Format::E5M2] {
        for pow2 in [false, true] {
            // Inf in the block: amax Inf → scale 1; NaN → 0x7F; ±Inf → ±max.
            let mut x = vec![0.5f32; 128];
            x[0] = INF;
            x[1] = -INF;
            x[2] = NAN;
            x[3] = -0.0;
            let (s, d) = block_rowwise(f, pow2, &x, DType::F32);
            assert_eq!(s, [1.0]);
            let mx = enc(f, f.max());
            assert_eq!(&d[..5], &[mx, mx | 0x80, 0x7F, 0x80, enc(f, 0.5)]);
            // All NaN: amax 0 → scale 1.
            let (s, d) = block_rowwise(f, pow2, &[NAN; 128], DType::F32);
            assert_eq!((s, d), (vec![1.0], vec![0x7F; 128]));
            // Zero block: scale 1.
            let (s, d) = block_rowwise(f, pow2, &[0.0; 128], DType::F32);
            assert_eq!((s, d), (vec![1.0], vec![0; 128]));
            // f32 subnormal amax: max/amax overflows → value_for_inf = FLT_MAX for f32
            // input (pow2: 2^127).
            let mut x = vec![0.0f32; 128];
            x[0] = 1e-40;
            x[1] = -2e-41;
            let scale = if pow2 { 2f32.powi(127) } else { f32::MAX };
            let (s, d) = block_rowwise(f, pow2, &x, DType::F32);
            assert_eq!(s[0].to_bits(), (1.0 / scale).to_bits());
            assert_eq!(&d[..2], &[enc(f, 1e-40 * scale), enc(f, -2e-41 * scale)]);
            // bf16 input: value_for_inf is bf16's max, 3.3895314e38 (pow2: 2^127).
            let b = bf16::from_bits(0x0001).to_f32(); // 2^-133
            let mut x = vec![0.0f32; 128];
            x[0] = b;
            let scale = if pow2 {
                2f32.powi(127)
            } else {
                bf16::MAX.to_f32()
            };
            assert_eq!(bf16::MAX.to_f32(), 3.389_531_4e38);
            let (s, d) = block_rowwise(f, pow2, &x, DType::BF16);
            assert_eq!(
                s[0].to_bits(),
                (1.0 / scale).to_bits(),
                "{f:?} pow2={pow2} bf16"
            );
            assert_eq!(d[0], enc(f, b * scale));
            // Near f32::MAX.
            let mut x = vec![1.0f32; 128];
            x[0] = f32::MAX;
            x[1] = -3e38;
            let mut scale = f.max() / f32::MAX;
            if pow2 {
                scale = f32::from_bits(scale.to_bits() & 0xFF80_0000);
            }
            let (s, d) = block_rowwise(f, pow2, &x, DType::F32);
            assert_eq!(s[0].to_bits(), (1.0 / scale).to_bits());
            assert_eq!(
                &d[..3],
                &[enc(f, f32::MAX * scale), enc(f, -3e38 * scale), 0]
            );
        }
        // amax_epsilon floors a zero block.
        let q = Fp8BlockQuantizer::new(f, BlockDim::TwoD)
            .with_pow2_scales(false)
            .with_amax_epsilon(4.0)
            .quantize(&t32(&[0.0; 6], &[2, 3]))
            .unwrap();
        assert_eq!(f32s(&q, BufferName::ScaleInv)[0], 4.0 / f.max());
    }
}

#[test]
fn fp8_block_special_values_columnwise_and_2d() {
    // A 256×2 tensor: column 0 has Inf in its first 128-row block, column 1 is all
    // NaN in the second. 1-D columnwise blocks are 128×1; 2-D tiles are 128×128.
    let mut x = vec![2.0f32; 256 * 2];
    x[5 * 2] = INF;
    for r in 128..256 {
        x[r * 2 + 1] = NAN;
    }
    let q = Fp8BlockQuantizer::new(Fp8Format::E4M3, BlockDim::OneD)
        .quantize(&t32(&x, &[256, 2]))
        .unwrap();
    let cs = f32s(&q, BufferName::ColumnwiseScaleInv);
    // [ceil(256/128), roundup(2, 4)] = [2, 4]: entry [i, k].
    let s2 = 1.0 / 128.0; // amax 2 → 448/2 = 224 → pow2 128
    assert_eq!(cs, [1.0, s2, 0.0, 0.0, s2, 1.0, 0.0, 0.0]);
    let cd = bytes(&q, BufferName::ColumnwiseData);
    assert_eq!(cd[5], 0x7E);
    assert_eq!(cd[256 + 200], 0x7F);
    let q = Fp8BlockQuantizer::new(Fp8Format::E4M3, BlockDim::TwoD)
        .quantize(&t32(&x, &[256, 2]))
        .unwrap();
    // Tile 0 holds the Inf → scale 1; tile 1: NaN ignored, amax 2.
    assert_eq!(
        f32s(&q, BufferName::ScaleInv),
        [1.0, 0.0, 0.0, 0.0, s2, 0.0, 0.0, 0.0]
    );
    assert_eq!(
        f32s(&q, BufferName::ColumnwiseScaleInv),
        [1.0, s2, 0.0, 0.0]
    );
}
