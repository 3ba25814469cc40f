//! The host reduction of the symmetric all-reduce: the ThreadGroup's, step for step.

use std::borrow::Cow;

use half::{bf16, f16};
use tessera_core::{DType, Error, Result};

use crate::group::ReduceOp;

/// Whether `dtype` can be reduced with `op` (the rule of `Collective::check`): floats
/// with every op, integers with every op but `Avg`; FP8, E8M0 and packed FP4 never.
pub(super) fn check_reducible(op_name: &'static str, dtype: DType, op: ReduceOp) -> Result<()> {
    let ok = match dtype {
        DType::F32 | DType::BF16 | DType::F16 => true,
        DType::U8 | DType::U32 | DType::I32 | DType::U64 | DType::I64 => op != ReduceOp::Avg,
        _ => false,
    };
    if ok {
        Ok(())
    } else {
        Err(Error::dtype(
            op_name,
            format!(
                "a dtype {op:?} can reduce (f32, bf16, f16, or an integer type for Sum/Prod/Max/Min)"
            ),
            dtype,
        ))
    }
}

/// `bytes` as elements of `T`: borrowed when aligned, copied otherwise.
fn view<T: bytemuck::Pod>(bytes: &[u8]) -> Cow<'_, [T]> {
    match bytemuck::try_cast_slice(bytes) {
        Ok(s) => Cow::Borrowed(s),
        Err(_) => Cow::Owned(bytemuck::pod_collect_to_vec(bytes)),
    }
}

/// Reduces `parts` (rank order, equal lengths) of `dtype` elements into `out`, exactly
/// as the ThreadGroup's all-reduce does: `out = parts[0]`, then `out = f(out, p)` for
/// each later part, each step rounded to the dtype, then the final step (`Avg`
/// divides by `size`).
pub(super) fn reduce_into(
    dtype: DType,
    op: ReduceOp,
    parts: &[&[u8]],
    out: &mut [u8],
    size: usize,
) -> Result<()> {
    const OP: &str = "symmetric all_reduce";
    if parts.iter().any(|p| p.len() != out.len()) {
        return Err(Error::state(
            OP,
            "internal: a contribution's length differs from the output's",
        ));
    }
    let Some((first, rest)) = parts.split_first() else {
        return Err(Error::state(OP, "internal: no contribution to reduce"));
    };
    fn go<T: bytemuck::Pod>(
        first: &[u8],
        rest: &[&[u8]],
        out: &mut [u8],
        f: impl Fn(T, T) -> T,
        fin: impl Fn(T) -> T,
    ) -> Result<()> {
        let o: &mut [T] = bytemuck::try_cast_slice_mut(out)
            .map_err(|e| Error::state(OP, format!("internal: misaligned output buffer ({e})")))?;
        o.copy_from_slice(&view::<T>(first));
        for p in rest {
            let p = view::<T>(p);
            for (a, &b) in o.iter_mut().zip(p.iter()) {
                *a = f(*a, b);
            }
        }
        for a in o.iter_mut() {
            *a = fin(*a);
        }
        Ok(())
    }
    macro_rules! float {
        ($t:ty, $from:expr, $to:expr) => {{
            let n = size as f32;
            let to = $to;
            let from = $from;
            let nan_aware = |a: $t, b: $t, pick: fn(f32, f32) -> f32| -> $t {
                if to(a).is_nan() || to(b).is_nan() {
                    from(f32::NAN)
                } else {
                    from(pick(to(a), to(b)))
                }
            };
            match op {
                ReduceOp::Sum => go::<$t>(first, rest, out, |a, b| from(to(a) + to(b)), |a| a),
                ReduceOp::Avg => go::<$t>(
                    first,
                    rest,
                    out,
                    |a, b| from(to(a) + to(b)),
                    |a| from(to(a) / n),
                ),
                ReduceOp::Prod => go::<$t>(first, rest, out, |a, b| from(to(a) * to(b)), |a| a),
                ReduceOp::Max => {
                    go::<$t>(first, rest, out, |a, b| nan_aware(a, b, f32::max), |a| a)
                }
                ReduceOp::Min => {
                    go::<$t>(first, rest, out, |a, b| nan_aware(a, b, f32::min), |a| a)
                }
            }
        }};
    }
    macro_rules! int {
        ($t:ty) => {
            match op {
                ReduceOp::Sum => go::<$t>(first, rest, out, |a, b| a.wrapping_add(b), |a| a),
                ReduceOp::Prod => go::<$t>(first, rest, out, |a, b| a.wrapping_mul(b), |a| a),
                ReduceOp::Max => go::<$t>(first, rest, out, |a, b| a.max(b), |a| a),
                ReduceOp::Min => go::<$t>(first, rest, out, |a, b| a.min(b), |a| a),
                ReduceOp::Avg => Err(Error::dtype(OP, "f32, bf16 or f16 for Avg", dtype)),
            }
        };
    }
    match dtype {
        DType::F32 => float!(f32, |v: f32| v, |v: f32| v),
        DType::BF16 => float!(bf16, bf16::from_f32, |v: bf16| v.to_f32()),
        DType::F16 => float!(f16, f16::from_f32, |v: f16| v.to_f32()),
        DType::U8 => int!(u8),
        DType::U32 => int!(u32),
        DType::I32 => int!(i32),
        DType::U64 => int!(u64),
        DType::I64 => int!(i64),
        other => Err(Error::dtype(OP, "f32, bf16, f16 or an integer type", other)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sums_in_rank_order_rounding_each_step() {
        // 1 + 2^-8 + 2^-8 in bf16: each step rounds back to 1 (ties to even), where a
        // sum in f32 then one rounding would give 1 + 2^-7.
        let parts: Vec<Vec<u8>> = [1.0f32, 2f32.powi(-8), 2f32.powi(-8)]
            .iter()
            .map(|&v| bytemuck::bytes_of(&bf16::from_f32(v)).to_vec())
            .collect();
        let refs: Vec<&[u8]> = parts.iter().map(Vec::as_slice).collect();
        let mut out = vec![0u8; 2];
        reduce_into(DType::BF16, ReduceOp::Sum, &refs, &mut out, 3).unwrap();
        assert_eq!(bytemuck::pod_read_unaligned::<bf16>(&out), bf16::ONE);
        let mut out = vec![0u8; 2];
        let e = reduce_into(DType::BF16, ReduceOp::Sum, &refs[..1], &mut out[..1], 1);
        assert!(matches!(e, Err(Error::State { .. })));
        let e = reduce_into(DType::F8E4M3, ReduceOp::Sum, &refs, &mut out, 3).unwrap_err();
        assert!(matches!(e, Error::DType { .. }), "{e}");
    }

    #[test]
    fn reducible_dtypes() {
        assert!(check_reducible("t", DType::BF16, ReduceOp::Avg).is_ok());
        assert!(check_reducible("t", DType::I64, ReduceOp::Prod).is_ok());
        assert!(check_reducible("t", DType::U8, ReduceOp::Avg).is_err());
        assert!(check_reducible("t", DType::E8M0, ReduceOp::Max).is_err());
    }
}
