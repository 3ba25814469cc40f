//! Independent oracles for the element casts (`spec/formats.md` §1–§2.3).
//!
//! The oracle does not reuse any rounding arithmetic of the crate: it enumerates every
//! finite code of a format, decodes it from its bit fields, and for an input picks the
//! nearest code value by search (ties to the code whose mantissa LSB — i.e. whose code
//! — is even), saturating beyond the largest finite value, mapping NaN to the format's
//! NaN code and copying the sign bit (so −0 and tiny negatives keep it). The E8M0
//! oracle searches the smallest power of two `>= v`.

use half::{bf16, f16};
use proptest::prelude::*;
use tessera_quant::Fp8Format;
use tessera_quant::cast::{
    decode_e2m1, decode_e4m3, decode_e5m2, decode_e8m0, e8m0_reciprocal, encode_e2m1, encode_e4m3,
    encode_e5m2, float_to_e8m0,
};

/// A sign-magnitude minifloat, described by its fields only.
#[derive(Debug, Clone, Copy)]
struct Format {
    name: &'static str,
    exp_bits: u32,
    man_bits: u32,
    bias: i32,
    /// The largest finite positive code.
    max_code: u8,
    /// The code every NaN maps to.
    nan_code: u8,
    /// The sign bit.
    sign: u8,
    encode: fn(f32) -> u8,
}

const E4M3: Format = Format {
    name: "e4m3",
    exp_bits: 4,
    man_bits: 3,
    bias: 7,
    max_code: 0x7E,
    nan_code: 0x7F,
    sign: 0x80,
    encode: encode_e4m3,
};
const E5M2: Format = Format {
    name: "e5m2",
    exp_bits: 5,
    man_bits: 2,
    bias: 15,
    max_code: 0x7B,
    nan_code: 0x7F,
    sign: 0x80,
    encode: encode_e5m2,
};
const E2M1: Format = Format {
    name: "e2m1",
    exp_bits: 2,
    man_bits: 1,
    bias: 1,
    max_code: 0x7,
    nan_code: 0x7,
    sign: 0x8,
    encode: encode_e2m1,
};
const FORMATS: [Format; 3] = [E4M3, E5M2, E2M1];

impl Format {
    /// The value of a non-negative code, from its exponent and mantissa fields.
    fn value(self, code: u8) -> f64 {
        let e = i32::from(code >> self.man_bits) & ((1 << self.exp_bits) - 1);
        let m = f64::from(code & ((1 << self.man_bits) - 1));
        let frac = f64::from(1u32 << self.man_bits);
        if e == 0 {
            m / frac * 2f64.powi(1 - self.bias)
        } else {
            (1.0 + m / frac) * 2f64.powi(e - self.bias)
        }
    }

    /// Every finite non-negative code with its value, increasing.
    fn grid(self) -> Vec<(f64, u8)> {
        let g: Vec<_> = (0..=self.max_code).map(|c| (self.value(c), c)).collect();
        assert!(g.windows(2).all(|w| w[0].0 < w[1].0), "{} grid", self.name);
        g
    }

    fn max(self) -> f64 {
        self.value(self.max_code)
    }

    /// The oracle: nearest grid value, ties to the even code, saturating, NaN code,
    /// sign copied.
    fn oracle(self, grid: &[(f64, u8)], x: f32) -> u8 {
        if x.is_nan() {
            return self.nan_code;
        }
        let sign = if x.is_sign_negative() { self.sign } else { 0 };
        let a = f64::from(x.abs());
        if a >= self.max() {
            return sign | self.max_code;
        }
        // grid[i].0 <= a < grid[i + 1].0
        let i = grid.partition_point(|&(v, _)| v <= a) - 1;
        let (lo, lc) = grid[i];
        let (hi, hc) = grid[i + 1];
        let code = match (a - lo).partial_cmp(&(hi - a)).unwrap() {
            std::cmp::Ordering::Less => lc,
            std::cmp::Ordering::Greater => hc,
            std::cmp::Ordering::Equal => {
                if lc % 2 == 0 {
                    lc
                } else {
                    hc
                }
            }
        };
        sign | code
    }
}

fn check(fmt: Format, grid: &[(f64, u8)], x: f32) {
    let want = fmt.oracle(grid, x);
    let got = (fmt.encode)(x);
    assert_eq!(
        got,
        want,
        "{}: input {x:e} (bits {:#010x}) gave {got:#04x}, oracle {want:#04x}",
        fmt.name,
        x.to_bits()
    );
}

/// Interesting inputs of a format: every code value, every midpoint between adjacent
/// codes, their f32 neighbours (±1, ±2 ulp), the saturation region, both signs.
fn edge_inputs(fmt: Format) -> Vec<f32> {
    let grid = fmt.grid();
    let mut pts: Vec<f32> = Vec::new();
    for w in grid.windows(2) {
        pts.push(w[0].0 as f32);
        let mid = (w[0].0 + w[1].0) / 2.0;
        assert_eq!(f64::from(mid as f32), mid, "midpoints are exact in f32");
        pts.push(mid as f32);
    }
    let max = fmt.max();
    let top_ulp = max - grid[grid.len() - 2].0;
    for k in [0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 4.0] {
        pts.push((max + k * top_ulp) as f32);
    }
    pts.extend([
        max as f32,
        f32::MAX,
        f32::INFINITY,
        f32::MIN_POSITIVE,
        f32::from_bits(1),
        f32::from_bits(0x007F_FFFF),
        1e-30,
        (grid[1].0 / 2.0) as f32,
        (grid[1].0 / 4.0) as f32,
    ]);
    let mut out = Vec::new();
    for p in pts {
        let mut v = p;
        let mut lo = p;
        for _ in 0..2 {
            v = v.next_up();
            lo = lo.next_down();
            out.extend([v, lo]);
        }
        out.push(p);
    }
    let neg: Vec<f32> = out.iter().map(|v| -v).collect();
    out.extend(neg);
    out.extend([0.0, -0.0, f32::NAN, -f32::NAN, f32::from_bits(0x7F80_0001)]);
    out.extend([f32::from_bits(0xFFC0_0000), f32::NEG_INFINITY]);
    out
}

#[test]
fn decoders_match_the_bit_fields() {
    for fmt in [E4M3, E5M2] {
        let decode = if fmt.name == "e4m3" {
            decode_e4m3
        } else {
            decode_e5m2
        };
        for code in 0..=255u8 {
            let mag = code & 0x7F;
            let v = decode(code);
            if mag <= fmt.max_code {
                let want = fmt.value(mag) * if code & 0x80 != 0 { -1.0 } else { 1.0 };
                assert_eq!(f64::from(v), want, "{} {code:#04x}", fmt.name);
                assert_eq!(v.is_sign_negative(), code & 0x80 != 0);
            } else if fmt.name == "e5m2" && mag == 0x7C {
                assert_eq!(v.is_infinite() && v.is_sign_negative(), code & 0x80 != 0);
                assert!(v.is_infinite());
            } else {
                assert!(v.is_nan(), "{} {code:#04x} decodes to NaN", fmt.name);
            }
        }
    }
    for code in 0..16u8 {
        let v = decode_e2m1(code);
        let want = E2M1.value(code & 7) * if code & 8 != 0 { -1.0 } else { 1.0 };
        assert_eq!(f64::from(v), want);
        assert_eq!(v.is_sign_negative(), code & 8 != 0, "code {code}");
    }
    // spec §1: E2M1 codes 0..7.
    let vals: Vec<f64> = (0..8).map(|c| E2M1.value(c)).collect();
    assert_eq!(vals, [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]);
    assert_eq!(E4M3.max(), 448.0);
    assert_eq!(E5M2.max(), 57344.0);
    assert_eq!(E4M3.value(1), 2f64.powi(-9));
    assert_eq!(E5M2.value(1), 2f64.powi(-16));
}

#[test]
fn every_code_midpoint_and_neighbour_matches_the_oracle() {
    for fmt in FORMATS {
        let grid = fmt.grid();
        for x in edge_inputs(fmt) {
            check(fmt, &grid, x);
        }
    }
}

#[test]
fn every_bf16_and_f16_value_matches_the_oracle() {
    for fmt in FORMATS {
        let grid = fmt.grid();
        for bits in 0..=u16::MAX {
            check(fmt, &grid, bf16::from_bits(bits).to_f32());
            check(fmt, &grid, f16::from_bits(bits).to_f32());
        }
    }
}

#[test]
fn spec_examples_of_the_casts() {
    // §2.1: −NaN → 0x7F, −Inf → 0xFE / 0xFB, −0 → 0x80, ±2^-149 → ±0.
    assert_eq!(encode_e4m3(f32::from_bits(0xFFC0_0000)), 0x7F);
    assert_eq!(encode_e5m2(f32::from_bits(0xFFC0_0000)), 0x7F);
    assert_eq!(encode_e4m3(f32::NEG_INFINITY), 0xFE);
    assert_eq!(encode_e5m2(f32::NEG_INFINITY), 0xFB);
    assert_eq!(encode_e4m3(-0.0), 0x80);
    assert_eq!(encode_e5m2(-0.0), 0x80);
    assert_eq!(encode_e4m3(f32::from_bits(1)), 0x00);
    assert_eq!(encode_e4m3(-f32::from_bits(1)), 0x80);
    // E4M3 (448, 464] → 448; > 464 saturates too. E5M2 ≥ 61440 saturates.
    assert_eq!(encode_e4m3(464.0), 0x7E);
    assert_eq!(encode_e4m3(464.0f32.next_up()), 0x7E);
    assert_eq!(encode_e5m2(61440.0), 0x7B);
    assert_eq!(encode_e5m2(1e30), 0x7B);
    // §2.2 decision points and ties.
    let cases = [
        (0.25, 0),
        (0.25f32.next_up(), 1),
        (0.75, 2),
        (0.75f32.next_down(), 1),
        (1.25, 2),
        (1.25f32.next_up(), 3),
        (1.75, 4),
        (2.5, 4),
        (2.5f32.next_up(), 5),
        (3.5, 6),
        (5.0, 6),
        (5.0f32.next_up(), 7),
        (6.5, 7),
        (f32::INFINITY, 7),
        (f32::NEG_INFINITY, 15),
        (f32::NAN, 7),
        (-f32::NAN, 7),
        (-0.0, 8),
        (-0.1, 8),
    ];
    for (x, c) in cases {
        assert_eq!(encode_e2m1(x), c, "e2m1({x})");
    }
    assert_eq!(Fp8Format::E4M3.encode(-0.0), 0x80);
    assert_eq!(Fp8Format::E5M2.max(), 57344.0);
    assert_eq!(Fp8Format::E4M3.max_rcp(), 1.0f32 / 448.0);
}

/// The E8M0 oracle (§2.3): the smallest power of two `>= v`; `v <= 2^-127` → 0,
/// `v > 2^127` (and +Inf) → 0xFE, NaN → 0xFF.
fn e8m0_oracle(v: f32) -> u8 {
    if v.is_nan() {
        return 0xFF;
    }
    let a = f64::from(v);
    if a <= 2f64.powi(-127) {
        return 0;
    }
    if a > 2f64.powi(127) {
        return 0xFE;
    }
    (-126..=127)
        .find(|&e| 2f64.powi(e) >= a)
        .map(|e| (e + 127) as u8)
        .unwrap()
}

fn check_e8m0(v: f32) {
    assert_eq!(
        float_to_e8m0(v),
        e8m0_oracle(v),
        "float_to_e8m0({v:e}, bits {:#010x})",
        v.to_bits()
    );
}

#[test]
fn e8m0_matches_the_oracle_on_powers_of_two_and_neighbours() {
    for e in -149..=127 {
        let p = 2f32.powi(e);
        let mut v = p;
        let mut lo = p;
        check_e8m0(p);
        for _ in 0..3 {
            v = v.next_up();
            lo = lo.next_down();
            check_e8m0(v);
            check_e8m0(lo);
        }
        check_e8m0(p * 1.5);
    }
    for v in [
        0.0,
        -0.0,
        f32::MAX,
        f32::INFINITY,
        f32::NAN,
        f32::from_bits(0x0040_0000),
        f32::from_bits(0x0040_0001),
        f32::from_bits(0x003F_FFFF),
        f32::from_bits(0x007F_FFFF),
    ] {
        check_e8m0(v);
    }
    for bits in 0..=0x7FFFu16 {
        check_e8m0(bf16::from_bits(bits).to_f32());
    }
    // spec §4.3 boundaries through the kernel's multiplication by fp32(1/448).
    let r = 1.0f32 / 448.0;
    assert_eq!(float_to_e8m0(448.0 * r), 127);
    assert_eq!(float_to_e8m0(449.0 * r), 128);
    assert_eq!(float_to_e8m0(3e38 * r), 247);
    assert_eq!(float_to_e8m0(10.0 * r), 122);
}

#[test]
fn e8m0_decode_and_reciprocal() {
    assert_eq!(decode_e8m0(0).to_bits(), 0x0040_0000);
    assert!(decode_e8m0(0xFF).is_nan());
    assert!(e8m0_reciprocal(0xFF).is_nan());
    for e in 1..=254u8 {
        assert_eq!(
            f64::from(decode_e8m0(e)),
            2f64.powi(i32::from(e) - 127),
            "{e}"
        );
    }
    for e in 0..=254u8 {
        let want = if e == 254 {
            2f64.powi(-127)
        } else {
            2f64.powi(127 - i32::from(e))
        };
        assert_eq!(f64::from(e8m0_reciprocal(e)), want, "exp2f_rcp({e})");
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn random_bit_patterns_match_the_oracle(bits in prop::collection::vec(any::<u32>(), 256)) {
        for fmt in FORMATS {
            let grid = fmt.grid();
            for &b in &bits {
                check(fmt, &grid, f32::from_bits(b));
            }
        }
    }

    #[test]
    fn in_range_values_match_the_oracle(
        vals in prop::collection::vec((-20i32..20, 0f64..1.0, any::<bool>()), 256)
    ) {
        // Values spread over the formats' ranges (normal and subnormal, both signs).
        for fmt in FORMATS {
            let grid = fmt.grid();
            for &(e, m, neg) in &vals {
                let v = ((1.0 + m) * 2f64.powi(e)) as f32;
                check(fmt, &grid, if neg { -v } else { v });
            }
        }
    }

    #[test]
    fn f32_subnormals_match_the_oracles(bits in prop::collection::vec(0u32..0x0080_0000, 64)) {
        for fmt in FORMATS {
            let grid = fmt.grid();
            for &b in &bits {
                check(fmt, &grid, f32::from_bits(b));
                check(fmt, &grid, -f32::from_bits(b));
            }
        }
        for &b in &bits {
            check_e8m0(f32::from_bits(b));
        }
    }

    #[test]
    fn positive_floats_match_the_e8m0_oracle(bits in prop::collection::vec(0u32..0x7FC0_0000, 256)) {
        for &b in &bits {
            check_e8m0(f32::from_bits(b));
        }
    }
}

#[test]
fn a_strided_sweep_of_all_f32_bit_patterns_matches_the_oracles() {
    // Every 1031st bit pattern (a prime stride, so every exponent and many mantissa
    // patterns are hit): about four million inputs, NaNs and infinities included.
    let grids: Vec<_> = FORMATS.iter().map(|f| f.grid()).collect();
    let mut bits = 0u64;
    while bits <= u64::from(u32::MAX) {
        let x = f32::from_bits(bits as u32);
        for (fmt, grid) in FORMATS.iter().zip(&grids) {
            check(*fmt, grid, x);
        }
        if !x.is_sign_negative() {
            check_e8m0(x);
        }
        bits += 1031;
    }
}

#[test]
fn the_quantizers_slice_cast_matches_the_element_encoder() {
    // `fp8::cast` runs the vectorised slice loop the quantizers use; it must agree with the
    // per-element encoders (checked against the oracle above) on every input, here every
    // 4099th bit pattern, with a unit scale and with a scale that moves values across the
    // formats' ranges.
    let x: Vec<f32> = (0..=u32::MAX / 4099)
        .map(|i| f32::from_bits(i * 4099))
        .collect();
    for format in [Fp8Format::E4M3, Fp8Format::E5M2] {
        for scale in [1.0f32, 0.3, 1.0e-3] {
            let q = tessera_quant::fp8::cast(&x, scale, format);
            for (&v, &b) in x.iter().zip(&q) {
                assert_eq!(b, format.encode(v * scale), "{format:?} {v:e} · {scale}");
            }
        }
    }
}
