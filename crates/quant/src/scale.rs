//! Amax and scale computations shared by the per-tensor and block formats
//! (`spec/formats.md` §3.3–§3.4, §6.2).

use rayon::prelude::*;

/// The NaN-ignoring `max |x|` every TransformerEngine kernel computes: it starts at 0 and
/// folds `fmaxf(acc, |x|)`, so NaN never wins and an all-NaN input gives 0. Inf wins.
///
/// Computed in eight independent lanes that are folded at the end, so that it
/// vectorises; the value is the same as the sequential fold's, bit for bit, because the
/// result is simply the largest non-NaN `|x|` (or 0), whatever the order.
#[inline]
pub fn amax(x: &[f32]) -> f32 {
    let mut lanes = [0.0f32; 8];
    let mut chunks = x.chunks_exact(8);
    for c in &mut chunks {
        for (l, &v) in lanes.iter_mut().zip(c) {
            *l = max_abs(*l, v);
        }
    }
    let tail = chunks
        .remainder()
        .iter()
        .fold(0.0f32, |acc, &v| max_abs(acc, v));
    lanes.iter().fold(tail, |acc, &l| max_abs(acc, l))
}

/// `fmaxf(acc, |v|)` for an accumulator `acc >= +0` that is not NaN: a NaN `|v|`
/// compares false and leaves `acc`, and no operand is `-0`, so this plain comparison (one
/// `maxss`/`maxps` on x86) agrees with `f32::max` bit for bit.
#[inline(always)]
pub(crate) fn max_abs(acc: f32, v: f32) -> f32 {
    let a = v.abs();
    if a > acc { a } else { acc }
}

/// [`amax`] over a large slice with rayon (same value: max is associative).
pub fn amax_par(x: &[f32]) -> f32 {
    if x.len() < 1 << 16 {
        return amax(x);
    }
    x.par_chunks(1 << 14).map(amax).reduce(|| 0.0, f32::max)
}

/// TE's `compute_scale_from_amax` (§3.4): the multiplier that maps `amax` to `fp8_max`.
///
/// 1. `amax < eps` → `amax = eps` (NaN stays NaN);
/// 2. amax Inf, NaN or 0 → 1;
/// 3. `scale = fp8_max / amax` (IEEE division);
/// 4. `scale` = +Inf → `value_for_inf`;
/// 5. `pow2` → clear the mantissa (round down to a power of two).
pub fn compute_scale_from_amax(
    amax: f32,
    fp8_max: f32,
    pow2: bool,
    eps: f32,
    value_for_inf: f32,
) -> f32 {
    let amax = if amax < eps { eps } else { amax };
    if !amax.is_finite() || amax == 0.0 {
        return 1.0;
    }
    let mut scale = fp8_max / amax;
    if scale == f32::INFINITY {
        scale = value_for_inf;
    }
    if pow2 {
        scale = f32::from_bits(scale.to_bits() & 0xFF80_0000);
    }
    scale
}

/// `1 / scale`, correctly rounded (CUDA's `__frcp_rn`).
#[inline]
pub fn reciprocal(scale: f32) -> f32 {
    1.0 / scale
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn amax_ignores_nan_but_not_inf() {
        assert_eq!(amax(&[1.0, f32::NAN, -3.0]), 3.0);
        assert_eq!(amax(&[f32::NAN, f32::NAN]), 0.0);
        assert_eq!(amax(&[1.0, f32::NEG_INFINITY]), f32::INFINITY);
        let v: Vec<f32> = (0..200_000)
            .map(|i| (i as f32 * 0.37).sin() * i as f32)
            .collect();
        assert_eq!(amax_par(&v), amax(&v));
    }

    #[test]
    fn amax_lanes_match_the_sequential_fold() {
        let fold = |x: &[f32]| x.iter().fold(0.0f32, |acc, &v| acc.max(v.abs()));
        let specials = [f32::NAN, -0.0, f32::INFINITY, f32::NEG_INFINITY, -f32::MAX];
        for n in 0..40 {
            let base: Vec<f32> = (0..n).map(|i| (i as f32 * 1.7).sin() * 3.0).collect();
            assert_eq!(amax(&base).to_bits(), fold(&base).to_bits(), "{n}");
            for i in 0..n {
                for s in specials {
                    let mut x = base.clone();
                    x[i] = s;
                    assert_eq!(amax(&x).to_bits(), fold(&x).to_bits(), "{n} {i} {s}");
                }
            }
        }
        assert_eq!(amax(&[f32::NAN; 19]).to_bits(), 0);
        assert_eq!(amax(&[-0.0; 9]).to_bits(), 0);
    }

    #[test]
    fn scale_rules() {
        // §3.5: amax 300 → 448/300 with bits 0x3FBF258C, scale_inv bits 0x3F2B6DB7.
        let s = compute_scale_from_amax(300.0, 448.0, false, 0.0, f32::MAX);
        assert_eq!(s.to_bits(), 0x3FBF_258C);
        assert_eq!(reciprocal(s).to_bits(), 0x3F2B_6DB7);
        assert_eq!(
            compute_scale_from_amax(300.0, 448.0, true, 0.0, f32::MAX),
            1.0
        );
        for bad in [0.0, f32::INFINITY, f32::NAN] {
            assert_eq!(
                compute_scale_from_amax(bad, 448.0, false, 0.0, f32::MAX),
                1.0
            );
        }
        assert_eq!(
            compute_scale_from_amax(0.0, 448.0, false, 2.0, f32::MAX),
            224.0
        );
        assert_eq!(
            compute_scale_from_amax(1e-45, 448.0, false, 0.0, f32::MAX),
            f32::MAX
        );
        let bf16_max = 3.389_531_4e38;
        assert_eq!(
            compute_scale_from_amax(1e-45, 448.0, false, 0.0, bf16_max),
            bf16_max
        );
        // pow2 after the substitution rounds down.
        assert_eq!(
            compute_scale_from_amax(1e-45, 448.0, true, 0.0, f32::MAX),
            2f32.powi(127)
        );
    }
}
