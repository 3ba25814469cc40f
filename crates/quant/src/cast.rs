//! Element encodings: float32 to and from FP8 (E4M3, E5M2), E8M0 and FP4 (E2M1), exactly
//! as the CUDA conversion instructions TransformerEngine's kernels use (`spec/formats.md`
//! §1–§2).
//!
//! All encoders round to nearest, ties to even, keep subnormals and saturate
//! (`satfinite`): values beyond the largest finite code, and infinities, become ±max.
//! NaN becomes `0x7F` for both FP8 formats (CUDA drops the sign) and `+6` (code 7) for
//! E2M1, which has no NaN.

/// An FP8 element format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Fp8Format {
    /// E4M3 (`float8_e4m3fn`): max 448, no infinities. TE's forward format.
    #[default]
    E4M3,
    /// E5M2 (`float8_e5m2`): max 57344, with infinities. TE's backward format.
    E5M2,
}

impl Fp8Format {
    /// The largest finite value: 448 or 57344.
    pub const fn max(self) -> f32 {
        match self {
            Fp8Format::E4M3 => 448.0,
            Fp8Format::E5M2 => 57344.0,
        }
    }

    /// The float32 reciprocal of [`max`](Self::max) (TE's `max_norm_rcp`).
    pub fn max_rcp(self) -> f32 {
        1.0 / self.max()
    }

    /// The tessera dtype of this format's bytes.
    pub const fn dtype(self) -> tessera_core::DType {
        match self {
            Fp8Format::E4M3 => tessera_core::DType::F8E4M3,
            Fp8Format::E5M2 => tessera_core::DType::F8E5M2,
        }
    }

    /// `"e4m3"` or `"e5m2"`.
    pub const fn name(self) -> &'static str {
        match self {
            Fp8Format::E4M3 => "e4m3",
            Fp8Format::E5M2 => "e5m2",
        }
    }

    /// Encodes one value (RNE, satfinite, NaN to 0x7F).
    #[inline]
    pub fn encode(self, x: f32) -> u8 {
        match self {
            Fp8Format::E4M3 => encode_e4m3(x),
            Fp8Format::E5M2 => encode_e5m2(x),
        }
    }

    /// Decodes one byte (NaN codes give NaN; E5M2 `0x7C`/`0xFC` give ±inf).
    #[inline]
    pub fn decode(self, b: u8) -> f32 {
        match self {
            Fp8Format::E4M3 => decode_e4m3(b),
            Fp8Format::E5M2 => decode_e5m2(b),
        }
    }
}

impl std::str::FromStr for Fp8Format {
    type Err = tessera_core::Error;
    fn from_str(s: &str) -> tessera_core::Result<Self> {
        match s.to_ascii_lowercase().as_str() {
            "e4m3" => Ok(Fp8Format::E4M3),
            "e5m2" => Ok(Fp8Format::E5M2),
            _ => Err(tessera_core::Error::invalid(
                "Fp8Format::from_str",
                format!("unknown FP8 format `{s}`; expected e4m3 or e5m2"),
            )),
        }
    }
}

/// A sign-magnitude minifloat with `exp_bits` exponent and `man_bits` mantissa bits.
#[derive(Clone, Copy)]
struct MiniFloat {
    man_bits: u32,
    bias: i32,
    /// Largest finite magnitude.
    max: f32,
    /// Bit position of the sign.
    sign_shift: u32,
}

const E4M3: MiniFloat = MiniFloat {
    man_bits: 3,
    bias: 7,
    max: 448.0,
    sign_shift: 7,
};
const E5M2: MiniFloat = MiniFloat {
    man_bits: 2,
    bias: 15,
    max: 57344.0,
    sign_shift: 7,
};
const E2M1: MiniFloat = MiniFloat {
    man_bits: 1,
    bias: 1,
    max: 6.0,
    sign_shift: 3,
};

impl MiniFloat {
    /// The code of a finite, non-negative `a` rounded to nearest-even on this format's
    /// grid and clamped to `max` (NaN handled by the callers).
    #[inline]
    fn encode_magnitude(self, a: f32) -> u32 {
        if a >= self.max {
            return self.code_of(self.max);
        }
        let emin = 1 - self.bias; // exponent of the smallest normal
        // Exponent of `a`, floored at emin (subnormals share emin's spacing).
        let e = if a == 0.0 {
            emin
        } else {
            (a.to_bits() >> 23) as i32 - 127
        }
        .max(emin);
        // Grid spacing at this exponent; a / ulp is exact in f64.
        let ulp = f64::from(2.0f32).powi(e - self.man_bits as i32);
        let m = (f64::from(a) / ulp).round_ties_even();
        let v = (m * ulp).min(f64::from(self.max));
        self.code_of(v as f32)
    }

    /// The code of a value exactly on the grid.
    #[inline]
    fn code_of(self, v: f32) -> u32 {
        if v == 0.0 {
            return 0;
        }
        let emin = 1 - self.bias;
        let e = ((v.to_bits() >> 23) as i32 - 127).max(emin);
        let scaled = f64::from(v) / f64::from(2.0f32).powi(e - self.man_bits as i32);
        let m = scaled as u32; // exact: v is on the grid
        if m < (1 << self.man_bits) {
            m // subnormal: exponent field 0
        } else {
            (((e + self.bias) as u32) << self.man_bits) | (m - (1 << self.man_bits))
        }
    }

    #[inline]
    fn encode(self, x: f32, nan_code: u8) -> u8 {
        if x.is_nan() {
            return nan_code;
        }
        let sign = u32::from(x.is_sign_negative()) << self.sign_shift;
        (sign | self.encode_magnitude(x.abs())) as u8
    }

    fn decode(self, code: u8) -> f32 {
        let sign = if code >> self.sign_shift & 1 == 1 {
            -1.0f32
        } else {
            1.0
        };
        let mag = u32::from(code) & ((1 << self.sign_shift) - 1);
        let field = (mag >> self.man_bits) as i32;
        let man = mag & ((1 << self.man_bits) - 1);
        let v = if field == 0 {
            f64::from(man) * f64::from(2.0f32).powi(1 - self.bias - self.man_bits as i32)
        } else {
            f64::from((1 << self.man_bits) | man)
                * f64::from(2.0f32).powi(field - self.bias - self.man_bits as i32)
        };
        sign * v as f32
    }
}

/// A 256-entry decode table (built once, at first use).
fn table(f: impl Fn(u8) -> f32) -> [f32; 256] {
    std::array::from_fn(|i| f(i as u8))
}

fn e4m3_table() -> &'static [f32; 256] {
    static T: std::sync::OnceLock<[f32; 256]> = std::sync::OnceLock::new();
    T.get_or_init(|| {
        table(|b| {
            if b & 0x7F == 0x7F {
                f32::NAN
            } else {
                E4M3.decode(b)
            }
        })
    })
}

fn e5m2_table() -> &'static [f32; 256] {
    static T: std::sync::OnceLock<[f32; 256]> = std::sync::OnceLock::new();
    T.get_or_init(|| {
        table(|b| match b & 0x7F {
            0x7C => {
                if b & 0x80 != 0 {
                    f32::NEG_INFINITY
                } else {
                    f32::INFINITY
                }
            }
            0x7D..=0x7F => f32::NAN,
            _ => E5M2.decode(b),
        })
    })
}

/// float32 → E4M3 byte (RNE, satfinite, NaN → 0x7F).
#[inline]
pub fn encode_e4m3(x: f32) -> u8 {
    E4M3.encode(x, 0x7F)
}

/// float32 → E5M2 byte (RNE, satfinite, NaN → 0x7F).
#[inline]
pub fn encode_e5m2(x: f32) -> u8 {
    E5M2.encode(x, 0x7F)
}

/// E4M3 byte → float32.
#[inline]
pub fn decode_e4m3(b: u8) -> f32 {
    e4m3_table()[b as usize]
}

/// E5M2 byte → float32.
#[inline]
pub fn decode_e5m2(b: u8) -> f32 {
    e5m2_table()[b as usize]
}

/// float32 → E2M1 code in the low nibble (RNE, satfinite to ±6, NaN → 7 = +6, the
/// sign of zero kept).
#[inline]
pub fn encode_e2m1(x: f32) -> u8 {
    E2M1.encode(x, 7)
}

/// The values of the 16 E2M1 codes (code 8 is −0).
pub const E2M1_VALUES: [f32; 16] = [
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
];

/// E2M1 code (low nibble) → float32.
#[inline]
pub fn decode_e2m1(code: u8) -> f32 {
    E2M1_VALUES[(code & 0xF) as usize]
}

/// Stochastic rounding of float32 to E2M1 with 8 random bits (`spec/formats.md` §2.4):
/// with `u = r / 256` and the grid step `s(v)` (0.5 below 2, 1 in [2, 4), 2 from 4),
/// `t = |x| + u·s(|x|)` and the result is `min(floor(t / s(t))·s(t), 6)` with the sign
/// of `x`; NaN gives +6. Unbiased: `E[result] = x` for `|x| <= 6`.
#[inline]
pub fn encode_e2m1_stochastic(x: f32, r: u8) -> u8 {
    if x.is_nan() {
        return 7;
    }
    fn step(v: f32) -> f32 {
        if v < 2.0 {
            0.5
        } else if v < 4.0 {
            1.0
        } else {
            2.0
        }
    }
    let a = x.abs();
    let u = f32::from(r) * (1.0 / 256.0);
    let t = a + u * step(a);
    let s = step(t);
    let v = ((t / s).floor() * s).min(6.0);
    let sign = u8::from(x.is_sign_negative()) << 3;
    sign | E2M1.code_of(v) as u8
}

/// float32 → E8M0 scale byte as TransformerEngine's `float_to_e8m0` computes it for a
/// non-negative value: the smallest power of two `>= v` (round toward +inf), with
/// values `<= 2^-127` → 0x00, values above `2^127` and +inf → 0xFE, NaN → 0xFF. A
/// negative input uses `|v|`.
#[inline]
pub fn float_to_e8m0(v: f32) -> u8 {
    if v.is_nan() {
        return 0xFF;
    }
    let bits = v.abs().to_bits();
    let mut e = bits >> 23;
    let m = bits & 0x7F_FFFF;
    if e == 0xFF {
        return 0xFE; // +inf, satfinite
    }
    if m > 0 && e != 0xFE && !(e == 0 && m <= 0x40_0000) {
        e += 1;
    }
    e as u8
}

/// E8M0 byte → its value `2^(e - 127)` (code 0 is the float32 subnormal `2^-127`, 0xFF
/// is NaN).
#[inline]
pub fn decode_e8m0(e: u8) -> f32 {
    match e {
        0 => f32::from_bits(0x0040_0000),
        0xFF => f32::NAN,
        e => f32::from_bits(u32::from(e) << 23),
    }
}

/// The multiplier that scales a block with E8M0 scale `e` into FP8 range: `2^(127 - e)`
/// (TE's `exp2f_rcp`); `e = 254` gives `2^-127`, `e = 255` NaN.
#[inline]
pub fn e8m0_reciprocal(e: u8) -> f32 {
    match e {
        255 => f32::NAN,
        254 => f32::from_bits(0x0040_0000),
        e => f32::from_bits((254 - u32::from(e)) << 23),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fp8_edges() {
        assert_eq!(encode_e4m3(448.0), 0x7E);
        assert_eq!(encode_e4m3(464.0), 0x7E);
        assert_eq!(encode_e4m3(1e9), 0x7E);
        assert_eq!(encode_e4m3(f32::INFINITY), 0x7E);
        assert_eq!(encode_e4m3(f32::NEG_INFINITY), 0xFE);
        assert_eq!(encode_e4m3(f32::from_bits(0xFFC0_0000)), 0x7F);
        assert_eq!(encode_e4m3(-0.0), 0x80);
        assert_eq!(encode_e4m3(-f32::from_bits(1)), 0x80);
        assert_eq!(encode_e4m3(2f32.powi(-9)), 0x01);
        assert_eq!(encode_e4m3(2f32.powi(-10)), 0x00); // tie to even (0)
        assert_eq!(encode_e4m3(1.5 * 2f32.powi(-9)), 0x02); // tie to even (2)
        assert_eq!(encode_e5m2(57344.0), 0x7B);
        assert_eq!(encode_e5m2(61440.0), 0x7B);
        assert_eq!(encode_e5m2(f32::NEG_INFINITY), 0xFB);
        assert_eq!(encode_e5m2(f32::NAN), 0x7F);
        assert_eq!(decode_e5m2(0x7C), f32::INFINITY);
        assert!(decode_e4m3(0xFF).is_nan());
        assert_eq!(decode_e4m3(0x7E), 448.0);
        assert_eq!(decode_e4m3(0x01), 2f32.powi(-9));
    }

    #[test]
    fn every_fp8_code_round_trips() {
        for f in [Fp8Format::E4M3, Fp8Format::E5M2] {
            for b in 0..=255u8 {
                let v = f.decode(b);
                if v.is_nan() || v.is_infinite() {
                    continue;
                }
                assert_eq!(f.encode(v), b, "{f:?} code {b:#04x} value {v}");
            }
        }
    }

    #[test]
    fn e2m1_rounding_points() {
        let cases = [
            (0.25, 0),
            (0.26, 1),
            (0.75, 2),
            (1.25, 2),
            (1.75, 4),
            (2.5, 4),
            (3.5, 6),
            (5.0, 6),
            (5.01, 7),
            (100.0, 7),
            (-0.0, 8),
            (-0.1, 8),
            (-6.0, 15),
        ];
        for (x, code) in cases {
            assert_eq!(encode_e2m1(x), code, "{x}");
        }
        assert_eq!(encode_e2m1(f32::NAN), 7);
        for c in 0..16u8 {
            assert_eq!(encode_e2m1(decode_e2m1(c)), c);
        }
    }

    #[test]
    fn e8m0_boundaries() {
        let r = Fp8Format::E4M3.max_rcp();
        // spec §4.3: amax 448 → 127, 449 → 128, 0 → 0, 3e38 → 247, 10 → 122.
        assert_eq!(float_to_e8m0(448.0 * r), 127);
        assert_eq!(float_to_e8m0(449.0 * r), 128);
        assert_eq!(float_to_e8m0(0.0), 0);
        assert_eq!(float_to_e8m0(3e38 * r), 247);
        assert_eq!(float_to_e8m0(10.0 * r), 122);
        assert_eq!(float_to_e8m0(f32::INFINITY), 0xFE);
        assert_eq!(float_to_e8m0(f32::NAN), 0xFF);
        assert_eq!(float_to_e8m0(f32::MAX), 0xFE);
        assert_eq!(float_to_e8m0(-3.0), 0x81);
        assert_eq!(decode_e8m0(0), f32::from_bits(0x0040_0000));
        assert_eq!(decode_e8m0(127), 1.0);
        assert_eq!(e8m0_reciprocal(122), 32.0);
        assert_eq!(e8m0_reciprocal(254), f32::from_bits(0x0040_0000));
    }

    #[test]
    fn stochastic_rounding_brackets_and_is_unbiased() {
        for x in [0.1f32, 0.7, 1.6, 2.2, 3.9, 4.5, 5.9, -2.7] {
            let lo = decode_e2m1(encode_e2m1_stochastic(x, 0));
            let hi = decode_e2m1(encode_e2m1_stochastic(x, 255));
            assert!(lo.abs() <= x.abs() && hi.abs() >= x.abs(), "{x}: {lo} {hi}");
            let mean: f64 = (0..=255u8)
                .map(|r| f64::from(decode_e2m1(encode_e2m1_stochastic(x, r))))
                .sum::<f64>()
                / 256.0;
            // With 8 random bits the rounding probability is quantised to 1/256 of a step.
            assert!(
                (mean - f64::from(x)).abs() <= 2.0 / 256.0 + 1e-6,
                "{x}: mean {mean}"
            );
        }
        assert_eq!(encode_e2m1_stochastic(7.0, 0), 7);
        assert_eq!(encode_e2m1_stochastic(f32::NAN, 3), 7);
        assert_eq!(encode_e2m1_stochastic(-0.0, 0), 8);
    }
}
