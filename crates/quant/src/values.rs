//! Conversions between high-precision tensors and the float32 values every quantizer
//! computes with (bf16 and f16 widen to f32 exactly).

use std::borrow::Cow;

use half::{bf16, f16};
use tessera_core::{DType, Device, Error, Result, Shape, Tensor};

/// The values of a host f32/bf16/f16 tensor as f32.
pub(crate) fn to_f32<'a>(op: &'static str, x: &'a Tensor) -> Result<Cow<'a, [f32]>> {
    if x.device() != Device::Cpu {
        return Err(Error::device(
            op,
            "cpu (the CPU reference reads host tensors)",
            x.device(),
        ));
    }
    Ok(match x.dtype() {
        DType::F32 => Cow::Borrowed(x.as_slice::<f32>()?),
        DType::BF16 => Cow::Owned(x.as_slice::<bf16>()?.iter().map(|v| v.to_f32()).collect()),
        DType::F16 => Cow::Owned(x.as_slice::<f16>()?.iter().map(|v| v.to_f32()).collect()),
        other => return Err(Error::dtype(op, "f32, bf16 or f16", other)),
    })
}

/// A host tensor of `dtype` (f32, bf16 or f16, rounded to nearest-even) from f32 values.
/// NaN is written as the canonical NaN a CUDA GPU produces (`0x7FFFFFFF`, `0x7FFF`), so
/// CPU and GPU dequantization agree bit for bit.
pub(crate) fn from_f32(v: &[f32], shape: &Shape, dtype: DType) -> Result<Tensor> {
    fn conv<T: tessera_core::Element>(
        v: &[f32],
        shape: &Shape,
        nan: T,
        f: impl Fn(f32) -> T,
    ) -> Result<Tensor> {
        let c: Vec<T> = v
            .iter()
            .map(|&x| if x.is_nan() { nan } else { f(x) })
            .collect();
        Tensor::from_slice(&c, shape, Device::Cpu)
    }
    match dtype {
        DType::F32 => conv(v, shape, f32::from_bits(0x7FFF_FFFF), |x| x),
        DType::BF16 => conv(v, shape, bf16::from_bits(0x7FFF), bf16::from_f32),
        DType::F16 => conv(v, shape, f16::from_bits(0x7FFF), f16::from_f32),
        other => Err(Error::dtype("dequantize", "f32, bf16 or f16", other)),
    }
}

/// The largest finite value of a high-precision dtype (FP8 block scaling's
/// `value_for_inf`): `FLT_MAX`, bf16's 3.3895314e38 or f16's 65504.
pub(crate) fn dtype_max(dtype: DType) -> f32 {
    match dtype {
        DType::BF16 => bf16::MAX.to_f32(),
        DType::F16 => f16::MAX.to_f32(),
        _ => f32::MAX,
    }
}

/// Checks a quantizer input: host, f32/bf16/f16, rank ≥ 1; returns `(M, K)`.
pub(crate) fn check_input(op: &'static str, x: &Tensor) -> Result<(usize, usize)> {
    if !x.dtype().is_high_precision_float() {
        return Err(Error::dtype(op, "f32, bf16 or f16", x.dtype()));
    }
    if x.shape().rank() == 0 {
        return Err(Error::shape(
            op,
            "cannot quantize a rank-0 tensor; reshape it to [1]",
        ));
    }
    Ok(x.shape().flat_2d())
}

/// The columnwise (transposed) shape `(K, d0, ..., d_{n-2})` of `shape`.
pub(crate) fn transposed_shape(shape: &Shape) -> Shape {
    let d = shape.dims();
    match d.split_last() {
        None => Shape::new([]),
        Some((&k, rest)) => {
            let mut v = vec![k];
            v.extend_from_slice(rest);
            Shape::new(v)
        }
    }
}
