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

    /// `out[i] = encode(x[i] · scale)` over two slices of one length: the loop the
    /// quantizers run, with the format chosen once rather than per element.
    #[inline]
    pub(crate) fn encode_scaled(self, x: &[f32], scale: f32, out: &mut [u8]) {
        fn run(x: &[f32], scale: f32, out: &mut [u8], encode: impl Fn(f32) -> u8) {
            assert_eq!(
                x.len(),
                out.len(),
                "encode_scaled: slices of different lengths"
            );
            for (q, &v) in out.iter_mut().zip(x) {
                *q = encode(v * scale);
            }
        }
        match self {
            Fp8Format::E4M3 => run(x, scale, out, encode_e4m3),
            Fp8Format::E5M2 => run(x, scale, out, encode_e5m2),
        }
    }

    /// `out[i] = encode(x[i] · scales[i])` over three slices of one length.
    #[inline]
    pub(crate) fn encode_scaled_each(self, x: &[f32], scales: &[f32], out: &mut [u8]) {
        fn run(x: &[f32], scales: &[f32], out: &mut [u8], encode: impl Fn(f32) -> u8) {
            assert!(
                x.len() == out.len() && scales.len() == out.len(),
                "encode_scaled_each: slices of different lengths"
            );
            for ((q, &v), &s) in out.iter_mut().zip(x).zip(scales) {
                *q = encode(v * s);
            }
        }
        match self {
            Fp8Format::E4M3 => run(x, scales, out, encode_e4m3),
            Fp8Format::E5M2 => run(x, scales, out, encode_e5m2),
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
    /// Exponent of the smallest normal value (`1 - bias`).
    const fn emin(self) -> i32 {
        1 - self.bias
    }

    /// Mantissa bits a float32 loses in this format (`23 - man_bits`).
    const fn shift(self) -> u32 {
        23 - self.man_bits
    }

    /// The code of a finite, non-negative float32 with bits `a` rounded to nearest-even on
    /// this format's grid and clamped to `max` (NaN handled by the callers). Both
    /// candidates below are computed and one is selected, with no data-dependent branch,
    /// so that loops over slices vectorise:
    ///
    /// - In the format's normal range (`a >= 2^emin`), integer rounding of the float32
    ///   bits: keep the top `man_bits` mantissa bits, rounded to nearest even
    ///   ([`shr_round_even`]); a carry out of the mantissa bumps the exponent field, which
    ///   is exactly the next binade's first code; then rebias the exponent. Inputs `>= max`
    ///   (infinity included) are clamped to `max` first; every value below `max` rounds to
    ///   at most `max`, so nothing else saturates.
    /// - Below `2^emin` the code *is* `|x|` in units of the smallest subnormal
    ///   `u = 2^(emin - man_bits)`, rounded to an integer (rounding up to `2^man_bits`
    ///   gives the smallest normal's code, as it should). That rounding is one float32
    ///   addition: with `c = 2^23 · u > 2^emin > |x|`, the sum `|x| + c` lies in `[c, 2c)`,
    ///   where the float32 ulp is exactly `u`, so IEEE addition (round to nearest, ties to
    ///   even: the only mode Rust runs in) yields `c + round_even(|x| / u) · u`, whose bits
    ///   are `c`'s bits plus that integer. It replaces a shift by a data-dependent amount,
    ///   which SSE2 lacks. The sum is normal, and a float32 subnormal `|x|` gives 0
    ///   whether or not it is flushed, so even FTZ/DAZ could not change the result.
    #[inline]
    fn encode_magnitude(self, a: u32) -> u32 {
        let rebias = ((127 - self.bias) as u32) << self.man_bits;
        let normal = shr_round_even(a.min(self.max.to_bits()), self.shift()).wrapping_sub(rebias);
        let c = f32::from_bits(((self.emin() - self.man_bits as i32 + 23 + 127) as u32) << 23);
        let subnormal = (f32::from_bits(a) + c).to_bits().wrapping_sub(c.to_bits());
        let min_normal = ((self.emin() + 127) as u32) << 23;
        if a >= min_normal { normal } else { subnormal }
    }

    #[inline]
    fn encode(self, x: f32, nan_code: u8) -> u8 {
        if x.is_nan() {
            return nan_code;
        }
        let bits = x.to_bits();
        let sign = (bits >> 31) << self.sign_shift;
        (sign | self.encode_magnitude(bits & 0x7FFF_FFFF)) as u8
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

/// `v / 2^r` rounded to nearest, ties to even, for `1 <= r <= 31` and `v < 2^31`:
/// adding `2^(r-1) - 1` plus the quotient's lowest bit carries into the quotient exactly
/// when the remainder is above one half, or equal to it with an odd quotient.
#[inline]
const fn shr_round_even(v: u32, r: u32) -> u32 {
    (v + (1 << (r - 1)) - 1 + ((v >> r) & 1)) >> r
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
/// of `x`; NaN gives +6. Unbiased up to the 1/256 of a step that 8 random bits resolve.
///
/// `t` is the exact sum, as the rule states and as a hardware conversion that adds the
/// random bits below the kept mantissa bit computes it, not the sum rounded to float32
/// (which rounds onto a grid point in rare cases, e.g. `|x| = 0.25 − 2^-26` with
/// `r = 128`: exactly `t = 0.5 − 2^-26` gives 0, rounded `t = 0.5` gives 0.5). With
/// `a = |x| < 8`: `floor(t / s(a)) = floor((floor(256·a / s(a)) + r) / 256)`, all in
/// integers (`256·a / s(a)` is `a` scaled by a power of two, exact). Where `t` reaches
/// the next binade, `floor(t / s(a))·s(a)` is that binade's first grid point, as is
/// `floor(t / s(t))·s(t)`, since `t` passes it by less than `s(a)`, half the next
/// binade's step. From 8 up `t >= 8` saturates.
#[inline]
pub fn encode_e2m1_stochastic(x: f32, r: u8) -> u8 {
    if x.is_nan() {
        return 7;
    }
    let a = x.abs();
    let sign = u8::from(x.is_sign_negative()) << 3;
    if a >= 8.0 {
        return sign | 7;
    }
    // 256 / s(a) and s(a) for a < 8.
    let (per_step, s) = if a < 2.0 {
        (512.0f32, 0.5f32)
    } else if a < 4.0 {
        (256.0, 1.0)
    } else {
        (128.0, 2.0)
    };
    // Exact: a·256/s(a) is below 1024 (a scaled by a power of two), an integer after
    // floor.
    let k = ((a * per_step).floor() as u32 + u32::from(r)) / 256;
    let v = (k as f32 * s).min(6.0);
    sign | E2M1.encode_magnitude(v.to_bits()) as u8
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

    /// The original encoder (f64 arithmetic on the grid spacing), kept as the reference
    /// for the bit-manipulation one.
    fn reference(f: MiniFloat, x: f32, nan_code: u8) -> u8 {
        fn code_of(f: MiniFloat, v: f32) -> u32 {
            if v == 0.0 {
                return 0;
            }
            let e = ((v.to_bits() >> 23) as i32 - 127).max(f.emin());
            let scaled = f64::from(v) / f64::from(2.0f32).powi(e - f.man_bits as i32);
            let m = scaled as u32; // exact: v is on the grid
            if m < (1 << f.man_bits) {
                m // subnormal: exponent field 0
            } else {
                (((e + f.bias) as u32) << f.man_bits) | (m - (1 << f.man_bits))
            }
        }
        if x.is_nan() {
            return nan_code;
        }
        let a = x.abs();
        let code = if a >= f.max {
            code_of(f, f.max)
        } else {
            let e = if a == 0.0 {
                f.emin()
            } else {
                (a.to_bits() >> 23) as i32 - 127
            }
            .max(f.emin());
            // Grid spacing at this exponent; a / ulp is exact in f64.
            let ulp = f64::from(2.0f32).powi(e - f.man_bits as i32);
            let m = (f64::from(a) / ulp).round_ties_even();
            code_of(f, (m * ulp).min(f64::from(f.max)) as f32)
        };
        (u32::from(x.is_sign_negative()) << f.sign_shift | code) as u8
    }

    #[test]
    fn encoders_match_the_reference_on_every_257th_bit_pattern() {
        use rayon::prelude::*;
        let formats = [
            (E4M3, 0x7F, encode_e4m3 as fn(f32) -> u8),
            (E5M2, 0x7F, encode_e5m2),
            (E2M1, 7, encode_e2m1),
        ];
        let mismatches: usize = (0..=u32::MAX / 257)
            .into_par_iter()
            .map(|i| {
                let x = f32::from_bits(i * 257);
                formats
                    .iter()
                    .filter(|(f, nan, enc)| enc(x) != reference(*f, x, *nan))
                    .count()
            })
            .sum();
        assert_eq!(mismatches, 0);
        // And every value around each format's grid: all codes, midpoints, neighbours.
        for (f, nan, enc) in formats {
            for b in 0..=255u8 {
                let v = f.decode(b & ((2 << f.sign_shift) - 1) as u8);
                for w in [v, v * 0.75, v * 1.0625, v * 1.125, v * 1.25] {
                    for d in -2i32..=2 {
                        let y = f32::from_bits(w.to_bits().wrapping_add_signed(d));
                        assert_eq!(
                            enc(y),
                            reference(f, y, nan),
                            "{y:e} ({:#010x})",
                            y.to_bits()
                        );
                    }
                }
            }
        }
    }

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

    /// The rule with `t` summed in float64, exact for `|x| >= 2^-20` (t's bits then span
    /// 2^3 down to 2^-43, fewer than 53).
    fn stochastic_in_f64(x: f32, r: u8) -> u8 {
        let a = f64::from(x.abs());
        let step = |v: f64| {
            if v < 2.0 {
                0.5
            } else if v < 4.0 {
                1.0
            } else {
                2.0
            }
        };
        let t = a + f64::from(r) / 256.0 * step(a);
        let v = ((t / step(t)).floor() * step(t)).min(6.0);
        (u8::from(x.is_sign_negative()) << 3) | encode_e2m1(v as f32)
    }

    #[test]
    fn stochastic_rounding_sums_exactly() {
        // Rounded to float32, t = 0.5 - 2^-26 becomes 0.5 (a tie, to even) and the code 1.
        let x = 0.25f32 - (2.0f32).powi(-26);
        assert_eq!(x + 128.0 / 256.0 * 0.5, 0.5);
        assert_eq!(encode_e2m1_stochastic(x, 128), 0);
        assert_eq!(encode_e2m1_stochastic(x, 129), 1);
        // Every byte on magnitudes across all binades from 2^-20 to 8 and past it, both
        // signs: a stride through the float32 bit patterns that hits all mantissa bits.
        let (lo, hi) = ((2.0f32).powi(-20).to_bits(), 9.0f32.to_bits());
        for bits in (lo..hi).step_by(4099) {
            for x in [f32::from_bits(bits), -f32::from_bits(bits)] {
                for r in 0..=255u8 {
                    assert_eq!(
                        encode_e2m1_stochastic(x, r),
                        stochastic_in_f64(x, r),
                        "x {x:e} ({bits:#010x}), r {r}"
                    );
                }
            }
        }
        // Below 2^-20, 2t < 2^-19 + 255/256 < 1 for every byte: the code is 0.
        for x in [f32::from_bits(1), 1e-30, (2.0f32).powi(-21)] {
            assert_eq!(encode_e2m1_stochastic(x, 255), 0);
            assert_eq!(encode_e2m1_stochastic(-x, 255), 8);
        }
        assert_eq!(encode_e2m1_stochastic(f32::INFINITY, 0), 7);
        assert_eq!(encode_e2m1_stochastic(f32::NEG_INFINITY, 0), 15);
    }
}
