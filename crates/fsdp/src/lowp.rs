//! Gradient reduce-scatter in low precision with f32 accumulation — beyond TE (its issue
//! #1579 asks for it).
//!
//! A native reduce-scatter in bf16 rounds the running sum to bf16 after every addition
//! (a ring adds one rank's contribution per step), so the error grows with the world
//! size, and NCCL has no FP8 reduction at all. Here each rank quantizes each of its `N`
//! gradient chunks (chunk `r` is destined for rank `r`) on its own, the chunks are
//! exchanged, and each rank dequantizes the `N` chunks addressed to it and sums them **in
//! f32, in rank order** — one rounding per contribution (its quantization), none in the
//! sum, and the same result on every run.
//!
//! # Communication volume
//!
//! [`ProcessGroup`] has collectives but no point-to-point sends, so the exchange is one
//! coalesced all-gather of every rank's quantized chunks (plus one f32 scale per chunk
//! for FP8); each rank keeps the chunks addressed to it. For a gradient of `E` elements
//! and `q` bytes per element on the wire (1 for FP8, 2 for bf16), each rank contributes
//! `E·q` bytes and a ring transmits `(N−1)·E·q` per rank — versus `(N−1)/N·E·4` for an f32
//! reduce-scatter and `(N−1)/N·E·2` for a native bf16 one. So with this transport FP8
//! moves fewer bytes than an f32 reduce-scatter only for `N < 4` (equal at 4), and bf16
//! for `N < 2`; an all-to-all over point-to-point sends (NCCL's `ncclSend`/`ncclRecv`,
//! which `ProcessGroup` does not expose yet) would move `(N−1)/N·E·q`, i.e. 1/4 (FP8) or
//! 1/2 (bf16) of the f32 reduce-scatter at any `N`. What this module buys today is the
//! numerics (f32 accumulation, FP8 payloads); [`CountingGroup`](crate::CountingGroup)
//! measures the bytes.

use std::collections::BTreeMap;

use tessera_collectives::{Collective, ProcessGroup};
use tessera_core::{DType, Error, Result, Shape, Tensor};
use tessera_quant::{
    BufferName, Fp8CurrentScaling, Fp8Format, Kind, QuantizedTensor, Quantizer, Usage,
};

/// The wire format of a low-precision reduce-scatter.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LowPrecision {
    /// FP8 with one current-scaling scale per chunk (E5M2, TE's gradient format, or
    /// E4M3).
    Fp8(Fp8Format),
    /// bf16 (rounded to nearest even).
    Bf16,
}

impl LowPrecision {
    /// `"fp8-e4m3"`, `"fp8-e5m2"` or `"bf16"`.
    pub fn name(self) -> &'static str {
        match self {
            LowPrecision::Fp8(Fp8Format::E4M3) => "fp8-e4m3",
            LowPrecision::Fp8(Fp8Format::E5M2) => "fp8-e5m2",
            LowPrecision::Bf16 => "bf16",
        }
    }
}

/// The sum over the group's ranks of `input` (f32, `[N·c, ...]`), this rank's `[c, ...]`
/// chunk of dim 0, with each rank's chunks sent in `format` and summed in f32 in rank
/// order (see the [module docs](self) for the numerics and the volume).
///
/// Every rank must call it with the same shape and format. A first dimension not
/// divisible by the group size, or a non-f32 input, is an error before any
/// communication.
pub fn reduce_scatter_low_precision(
    input: &Tensor,
    group: &dyn ProcessGroup,
    format: LowPrecision,
) -> Result<Tensor> {
    const OP: &str = "reduce_scatter_low_precision";
    input.expect_dtype(OP, DType::F32)?;
    let n = group.size();
    let me = group.rank();
    let dims = input.shape().dims();
    let d0 = dims.first().copied().unwrap_or(0);
    if input.shape().rank() == 0 || n == 0 || d0 % n != 0 {
        return Err(Error::shape(
            OP,
            format!(
                "the input's first dimension of {} is not divisible by the world size {n}",
                input.shape()
            ),
        ));
    }
    let mut chunk_dims = dims.to_vec();
    chunk_dims[0] = d0 / n;
    let chunk_shape = Shape::new(chunk_dims);
    let cn = chunk_shape.numel();
    let x = input.to_device(tessera_core::Device::Cpu)?;
    let values = x.as_slice::<f32>()?;
    let device = group.device();
    let mut acc = vec![0.0f32; cn];
    match format {
        LowPrecision::Bf16 => {
            let send = Tensor::from_f32_values(values, [values.len()], DType::BF16, device)?;
            let all = group.all_gather(&send)?.into_result()?.to_f32_vec()?;
            for r in 0..n {
                let part = &all[(r * n + me) * cn..][..cn];
                for (a, v) in acc.iter_mut().zip(part) {
                    // r == 0 starts the sum (0 + v would turn -0.0 into +0.0).
                    *a = if r == 0 { *v } else { *a + v };
                }
            }
        }
        LowPrecision::Fp8(fmt) => {
            let mut q = Fp8CurrentScaling::new(fmt).with_usage(Usage::Rowwise);
            let mut data = Vec::with_capacity(values.len());
            let mut scales = Vec::with_capacity(n);
            for j in 0..n {
                let chunk = Tensor::from_slice(
                    &values[j * cn..][..cn],
                    chunk_shape.clone(),
                    tessera_core::Device::Cpu,
                )?;
                let qt = q.quantize(&chunk)?;
                let d = qt
                    .buffer(BufferName::Data)
                    .ok_or_else(|| missing(BufferName::Data))?;
                let s = qt
                    .buffer(BufferName::ScaleInv)
                    .ok_or_else(|| missing(BufferName::ScaleInv))?;
                data.extend_from_slice(d.as_bytes()?);
                scales.push(s.as_slice::<f32>()?[0]);
            }
            let data = Tensor::from_bytes(&data, [values.len()], fmt.dtype(), device)?;
            let scales = Tensor::from_slice(&scales, [n], device)?;
            let out = group
                .run(vec![
                    Collective::AllGather {
                        output: Tensor::empty([n * values.len()], fmt.dtype(), device)?,
                        input: data,
                    },
                    Collective::AllGather {
                        output: Tensor::empty([n * n], DType::F32, device)?,
                        input: scales,
                    },
                ])?
                .into_result()?;
            let (all_data, all_scales) = (out[0].to_bytes()?, out[1].to_vec::<f32>()?);
            for r in 0..n {
                let k = r * n + me;
                let mut buffers = BTreeMap::new();
                buffers.insert(
                    BufferName::Data,
                    Tensor::from_bytes(
                        &all_data[k * cn..][..cn],
                        chunk_shape.clone(),
                        fmt.dtype(),
                        tessera_core::Device::Cpu,
                    )?,
                );
                buffers.insert(
                    BufferName::ScaleInv,
                    Tensor::from_slice(&[all_scales[k]], [1], tessera_core::Device::Cpu)?,
                );
                let part = QuantizedTensor::from_buffers(
                    Kind::Fp8 { format: fmt },
                    chunk_shape.clone(),
                    DType::F32,
                    buffers,
                )?
                .dequantize(DType::F32)?;
                for (a, &v) in acc.iter_mut().zip(part.as_slice::<f32>()?) {
                    *a = if r == 0 { v } else { *a + v };
                }
            }
        }
    }
    Tensor::from_slice(&acc, chunk_shape, device)
}

fn missing(name: BufferName) -> Error {
    Error::state(
        "reduce_scatter_low_precision",
        format!("the FP8 quantizer produced no `{name}` buffer"),
    )
}
