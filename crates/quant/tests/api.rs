//! The quantizer API: `make_empty` against `quantize`, shape rules (`check_shape`,
//! `is_quantizable`), typed errors for bad input, `QuantizedTensor::from_buffers`
//! validation, and the dequantize entry points (`dequantize_into` among them).

use std::collections::BTreeMap;

use tessera_core::{DType, Device, Error, Shape, Tensor};
use tessera_quant::{
    BlockDim, BufferName, Fp8BlockQuantizer, Fp8CurrentScaling, Fp8DelayedScaling, Fp8Format, Kind,
    Mxfp8Quantizer, Nvfp4Quantizer, QuantizedTensor, Quantizer, Usage, buffer_specs,
};
use tessera_rng::Generator;

type Make = fn(Usage) -> Box<dyn Quantizer>;

/// Every quantizer and option, with shapes it accepts.
fn quantizers() -> Vec<(&'static str, Make, Vec<Vec<usize>>)> {
    let fp8_shapes = vec![vec![7], vec![3, 5], vec![2, 3, 4]];
    let mx_shapes = vec![vec![32, 32], vec![2, 16, 64], vec![96, 32]];
    let nv_shapes = vec![vec![16, 16], vec![2, 8, 32], vec![48, 16]];
    let blk_shapes = vec![vec![5], vec![3, 200], vec![2, 3, 64], vec![130, 129]];
    vec![
        (
            "fp8-current",
            |u| Box::new(Fp8CurrentScaling::new(Fp8Format::E4M3).with_usage(u)),
            fp8_shapes.clone(),
        ),
        (
            "fp8-current-e5m2-pow2",
            |u| {
                Box::new(
                    Fp8CurrentScaling::new(Fp8Format::E5M2)
                        .with_pow2_scales(true)
                        .with_usage(u),
                )
            },
            fp8_shapes.clone(),
        ),
        (
            "fp8-delayed",
            |u| {
                Box::new(
                    Fp8DelayedScaling::new(Fp8Format::E4M3, 4)
                        .unwrap()
                        .with_usage(u),
                )
            },
            fp8_shapes,
        ),
        (
            "mxfp8",
            |u| Box::new(Mxfp8Quantizer::new(Fp8Format::E4M3).with_usage(u)),
            mx_shapes.clone(),
        ),
        (
            "mxfp8-2d-swizzled-e5m2",
            |u| {
                Box::new(
                    Mxfp8Quantizer::new(Fp8Format::E5M2)
                        .with_2d(true)
                        .with_swizzled_scales(true)
                        .with_usage(u),
                )
            },
            mx_shapes,
        ),
        (
            "nvfp4",
            |u| Box::new(Nvfp4Quantizer::new().with_usage(u)),
            nv_shapes.clone(),
        ),
        (
            "nvfp4-2d-rht-sr-swizzled",
            |u| {
                Box::new(
                    Nvfp4Quantizer::new()
                        .with_2d(true)
                        .with_rht(true)
                        .with_swizzled_scales(true)
                        .with_stochastic_rounding(Some(Generator::new(3)))
                        .with_usage(u),
                )
            },
            nv_shapes,
        ),
        (
            "fp8-block-1d",
            |u| Box::new(Fp8BlockQuantizer::new(Fp8Format::E4M3, BlockDim::OneD).with_usage(u)),
            blk_shapes.clone(),
        ),
        (
            "fp8-block-2d-fp32",
            |u| {
                Box::new(
                    Fp8BlockQuantizer::new(Fp8Format::E5M2, BlockDim::TwoD)
                        .with_pow2_scales(false)
                        .with_usage(u),
                )
            },
            blk_shapes,
        ),
    ]
}

fn input(dims: &[usize], dtype: DType) -> Tensor {
    let n: usize = dims.iter().product();
    let v: Vec<f32> = (0..n)
        .map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.13)
        .collect();
    Tensor::from_f32_values(&v, dims, dtype, Device::Cpu).unwrap()
}

fn layout_of(q: &QuantizedTensor) -> Vec<(BufferName, DType, Shape)> {
    q.data_tensors()
        .into_iter()
        .map(|(n, t)| (n, t.dtype(), t.shape().clone()))
        .collect()
}

#[test]
fn make_empty_has_the_buffers_of_quantize() {
    for (name, make, shapes) in quantizers() {
        for usage in [Usage::Rowwise, Usage::Columnwise, Usage::Both] {
            for dims in &shapes {
                for dtype in [DType::F32, DType::BF16, DType::F16] {
                    let what = format!("{name} {usage:?} {dims:?} {dtype}");
                    let mut q = make(usage);
                    let shape = Shape::new(dims.clone());
                    let empty = q.make_empty(&shape, dtype, Device::Cpu).unwrap();
                    let full = q.quantize(&input(dims, dtype)).unwrap();
                    assert_eq!(empty.kind(), q.kind(), "{what}");
                    assert_eq!(full.kind(), q.kind(), "{what}");
                    assert_eq!(empty.shape(), full.shape(), "{what}");
                    assert_eq!(empty.source_dtype(), dtype, "{what}");
                    assert_eq!(full.source_dtype(), dtype, "{what}");
                    assert_eq!(empty.usage(), usage, "{what}");
                    assert_eq!(full.usage(), usage, "{what}");
                    assert_eq!(empty.device(), Device::Cpu);
                    assert_eq!(layout_of(&empty), layout_of(&full), "{what}");
                    assert_eq!(empty.size_in_bytes(), full.size_in_bytes());
                    for (n, t) in empty.data_tensors() {
                        assert!(
                            t.to_bytes().unwrap().iter().all(|&b| b == 0),
                            "{what}: {n} zero-filled"
                        );
                    }
                    // Every buffer is one of the format's specs.
                    let specs = buffer_specs(&q.kind(), &shape).unwrap();
                    for (n, dt, sh) in layout_of(&full) {
                        assert!(
                            specs
                                .iter()
                                .any(|s| s.name == n && s.dtype == dt && s.shape == sh),
                            "{what}: {n} {dt} {sh} not in {specs:?}"
                        );
                    }
                    if usage == Usage::Both {
                        assert_eq!(specs.len(), full.data_tensors().len(), "{what}");
                    }
                    // The buffers reassemble.
                    let again = QuantizedTensor::from_buffers(
                        full.kind(),
                        full.shape().clone(),
                        dtype,
                        full.clone().into_buffers(),
                    )
                    .unwrap();
                    assert_eq!(layout_of(&again), layout_of(&full));
                    for (n, t) in again.data_tensors() {
                        assert_eq!(
                            t.to_bytes().unwrap(),
                            full.buffer(n).unwrap().to_bytes().unwrap()
                        );
                    }
                    let copy = full.to_device(Device::Cpu).unwrap();
                    assert_eq!(layout_of(&copy), layout_of(&full));
                }
            }
        }
    }
}

#[test]
fn shape_rules_per_format() {
    let s = |d: &[usize]| Shape::new(d.to_vec());
    // (quantizer, shape, check_shape ok, is_quantizable)
    let fp8 = Fp8CurrentScaling::new(Fp8Format::E4M3);
    let delayed = Fp8DelayedScaling::new(Fp8Format::E5M2, 1).unwrap();
    let mx = Mxfp8Quantizer::new(Fp8Format::E4M3);
    let nv = Nvfp4Quantizer::new();
    let blk = Fp8BlockQuantizer::new(Fp8Format::E4M3, BlockDim::OneD);
    let blk2 = Fp8BlockQuantizer::new(Fp8Format::E4M3, BlockDim::TwoD);
    let table: Vec<(&dyn Quantizer, Vec<usize>, bool, bool)> = vec![
        (&fp8, vec![], false, false),
        // A rank-1 tensor's first dimension is its K: it gathers in high precision.
        (&fp8, vec![1], true, false),
        (&fp8, vec![3, 5], true, true),
        (&delayed, vec![], false, false),
        (&delayed, vec![2, 3, 4], true, true),
        // MXFP8 (§4.1): M and K multiples of 32; gathering also needs rank ≥ 2.
        (&mx, vec![], false, false),
        (&mx, vec![32], false, false),
        (&mx, vec![32, 32], true, true),
        (&mx, vec![2, 16, 64], true, true),
        (&mx, vec![48, 32], false, false),
        (&mx, vec![32, 48], false, false),
        (&mx, vec![2, 3, 32], false, false),
        // NVFP4 (§5.1): multiples of 16.
        (&nv, vec![], false, false),
        (&nv, vec![16], false, false),
        (&nv, vec![16, 16], true, true),
        (&nv, vec![2, 8, 16], true, true),
        (&nv, vec![24, 16], false, false),
        (&nv, vec![16, 24], false, false),
        // FP8 block (§6.3): any shape quantizes; gathering needs rank ≥ 2 and
        // M, K multiples of 128.
        (&blk, vec![], false, false),
        (&blk, vec![5], true, false),
        (&blk, vec![128], true, false),
        (&blk, vec![3, 200], true, false),
        (&blk, vec![128, 128], true, true),
        (&blk, vec![2, 64, 256], true, true),
        (&blk, vec![128, 100], true, false),
        (&blk, vec![100, 128], true, false),
        (&blk2, vec![256, 384], true, true),
        (&blk2, vec![1, 1], true, false),
    ];
    for (q, dims, ok, quantizable) in table {
        let shape = s(&dims);
        let r = q.check_shape(&shape);
        assert_eq!(r.is_ok(), ok, "{:?} check_shape({shape})", q.kind());
        if let Err(e) = r {
            assert!(matches!(e, Error::Shape { .. }), "{e:?}");
        }
        assert_eq!(
            q.is_quantizable(&shape),
            quantizable,
            "{:?} is_quantizable({shape})",
            q.kind()
        );
        // make_empty follows check_shape.
        assert_eq!(
            q.make_empty(&shape, DType::BF16, Device::Cpu).is_ok(),
            ok,
            "{:?} make_empty({shape})",
            q.kind()
        );
    }
}

#[test]
fn bad_inputs_are_typed_errors_with_helpful_messages() {
    let u8_t = Tensor::from_slice(&[1u8, 2, 3, 4], [2, 2], Device::Cpu).unwrap();
    let i32_t = Tensor::from_slice(&[1i32; 1024], [32, 32], Device::Cpu).unwrap();
    let fp8_t = Tensor::from_bytes(&[0u8; 1024], [32, 32], DType::F8E4M3, Device::Cpu).unwrap();
    let scalar = Tensor::from_slice(&[1.0f32], [], Device::Cpu).unwrap();
    for (name, make, _) in quantizers() {
        let mut q = make(Usage::Both);
        for t in [&u8_t, &i32_t, &fp8_t] {
            let e = q.quantize(t).unwrap_err();
            assert!(matches!(e, Error::DType { .. }), "{name}: {e:?}");
            let msg = e.to_string();
            assert!(
                msg.contains("f32, bf16 or f16") && msg.contains(t.dtype().name()),
                "{name}: {msg}"
            );
        }
        let e = q.quantize(&scalar).unwrap_err();
        assert!(matches!(e, Error::Shape { .. }), "{name}: {e:?}");
        assert!(e.to_string().contains("rank-0"), "{name}: {e}");
        let e = q
            .make_empty(&Shape::new([32, 32]), DType::U8, Device::Cpu)
            .unwrap_err();
        assert!(matches!(e, Error::DType { .. }), "{name}: {e:?}");
    }
    let x = input(&[48, 32], DType::F32);
    let e = Mxfp8Quantizer::new(Fp8Format::E4M3)
        .quantize(&x)
        .unwrap_err();
    assert!(matches!(e, Error::Shape { .. }), "{e:?}");
    let msg = e.to_string();
    assert!(
        msg.contains("multiples of 32") && msg.contains("[48, 32]"),
        "{msg}"
    );
    let x = input(&[2, 3, 32], DType::BF16);
    let msg = Mxfp8Quantizer::new(Fp8Format::E5M2)
        .quantize(&x)
        .unwrap_err()
        .to_string();
    assert!(
        msg.contains("[6, 32]"),
        "the flattened matrix is named: {msg}"
    );
    let x = input(&[24, 16], DType::F32);
    let e = Nvfp4Quantizer::new().quantize(&x).unwrap_err();
    assert!(matches!(e, Error::Shape { .. }), "{e:?}");
    let msg = e.to_string();
    assert!(
        msg.contains("multiples of 16") && msg.contains("[24, 16]"),
        "{msg}"
    );
    let x = input(&[16, 8], DType::F16);
    assert!(matches!(
        Nvfp4Quantizer::new().quantize(&x),
        Err(Error::Shape { .. })
    ));
    // Bad constructor arguments.
    assert!(matches!(
        Fp8DelayedScaling::new(Fp8Format::E4M3, 0),
        Err(Error::InvalidArgument { .. })
    ));
    for bad in [0.0, -1.0, f32::NAN, f32::INFINITY] {
        let e = Fp8DelayedScaling::new(Fp8Format::E4M3, 2)
            .unwrap()
            .with_scale(bad)
            .unwrap_err();
        assert!(e.to_string().contains("finite and positive"), "{e}");
    }
}

fn mx_tensor(usage: Usage) -> QuantizedTensor {
    Mxfp8Quantizer::new(Fp8Format::E4M3)
        .with_usage(usage)
        .quantize(&input(&[32, 64], DType::F32))
        .unwrap()
}

fn rebuild(q: &QuantizedTensor, f: impl FnOnce(&mut BTreeMap<BufferName, Tensor>)) -> Error {
    let mut b = q.clone().into_buffers();
    f(&mut b);
    QuantizedTensor::from_buffers(q.kind(), q.shape().clone(), DType::F32, b).unwrap_err()
}

#[test]
fn from_buffers_rejects_bad_buffer_sets() {
    let mx = mx_tensor(Usage::Both);
    // Wrong shape.
    let e = rebuild(&mx, |b| {
        b.insert(
            BufferName::ScaleInv,
            Tensor::zeros([32, 2], DType::E8M0, Device::Cpu).unwrap(),
        );
    });
    assert!(matches!(e, Error::Shape { .. }), "{e:?}");
    let msg = e.to_string();
    assert!(
        msg.contains("scale_inv") && msg.contains("[128, 4]"),
        "{msg}"
    );
    // Wrong dtype.
    let e = rebuild(&mx, |b| {
        b.insert(
            BufferName::Data,
            Tensor::zeros([32, 64], DType::U8, Device::Cpu).unwrap(),
        );
    });
    let msg = e.to_string();
    assert!(
        msg.contains("data") && msg.contains("f8e4m3") && msg.contains("u8"),
        "{msg}"
    );
    // Missing scales.
    let e = rebuild(&mx, |b| {
        b.remove(&BufferName::ColumnwiseScaleInv);
    });
    assert!(matches!(e, Error::InvalidArgument { .. }), "{e:?}");
    assert!(
        e.to_string().contains("needs `columnwise_scale_inv`"),
        "{e}"
    );
    let e = rebuild(&mx, |b| {
        b.remove(&BufferName::ScaleInv);
    });
    assert!(e.to_string().contains("needs `scale_inv`"), "{e}");
    // No data at all.
    let e = rebuild(&mx, |b| {
        b.remove(&BufferName::Data);
        b.remove(&BufferName::ColumnwiseData);
    });
    assert!(e.to_string().contains("rowwise or columnwise data"), "{e}");
    // A buffer the format does not have.
    let e = rebuild(&mx, |b| {
        b.insert(
            BufferName::Amax,
            Tensor::zeros([1], DType::F32, Device::Cpu).unwrap(),
        );
    });
    assert!(e.to_string().contains("no `amax` buffer"), "{e}");
    // A shape the format cannot have.
    let e = QuantizedTensor::from_buffers(
        mx.kind(),
        Shape::new([48, 64]),
        DType::F32,
        mx.clone().into_buffers(),
    )
    .unwrap_err();
    assert!(matches!(e, Error::Shape { .. }), "{e:?}");
    // A source dtype that is not high precision.
    let e = QuantizedTensor::from_buffers(
        mx.kind(),
        mx.shape().clone(),
        DType::U8,
        mx.clone().into_buffers(),
    )
    .unwrap_err();
    assert!(matches!(e, Error::DType { .. }), "{e:?}");
    // Per-tensor FP8: both orientations share `scale_inv`; there is no columnwise scale.
    let fp8 = Fp8CurrentScaling::new(Fp8Format::E4M3)
        .with_usage(Usage::Columnwise)
        .quantize(&input(&[3, 5], DType::F32))
        .unwrap();
    let e = rebuild(&fp8, |b| {
        b.remove(&BufferName::ScaleInv);
    });
    assert!(e.to_string().contains("needs `scale_inv`"), "{e}");
    let e = rebuild(&fp8, |b| {
        b.insert(
            BufferName::ColumnwiseScaleInv,
            Tensor::zeros([1], DType::F32, Device::Cpu).unwrap(),
        );
    });
    assert!(matches!(e, Error::InvalidArgument { .. }), "{e:?}");
    // The transpose buffer must have the transposed shape.
    let e = rebuild(&fp8, |b| {
        b.insert(
            BufferName::ColumnwiseData,
            Tensor::zeros([3, 5], DType::F8E4M3, Device::Cpu).unwrap(),
        );
    });
    assert!(e.to_string().contains("[5, 3]"), "{e}");
    // NVFP4 data needs its amax.
    let nv = Nvfp4Quantizer::new()
        .quantize(&input(&[16, 32], DType::F32))
        .unwrap();
    let e = rebuild(&nv, |b| {
        b.remove(&BufferName::ColumnwiseAmax);
    });
    assert!(e.to_string().contains("needs `columnwise_amax`"), "{e}");
    let e = rebuild(&nv, |b| {
        b.remove(&BufferName::Amax);
    });
    assert!(e.to_string().contains("needs `amax`"), "{e}");
    // NVFP4 columnwise data is [K, M/2], always 2-D.
    let e = rebuild(&nv, |b| {
        b.insert(
            BufferName::ColumnwiseData,
            Tensor::zeros([16, 16], DType::F4E2M1x2, Device::Cpu).unwrap(),
        );
    });
    assert!(e.to_string().contains("[32, 8]"), "{e}");
}

#[test]
fn dequantize_entry_points() {
    let row = mx_tensor(Usage::Rowwise);
    let col = mx_tensor(Usage::Columnwise);
    let e = row.dequantize_usage(Usage::Both, DType::F32).unwrap_err();
    assert!(e.to_string().contains("choose one orientation"), "{e}");
    assert!(matches!(
        row.dequantize(DType::U8),
        Err(Error::DType { .. })
    ));
    for (name, make, shapes) in quantizers() {
        let dims = &shapes[shapes.len() - 1];
        for (usage, missing) in [
            (Usage::Rowwise, Usage::Columnwise),
            (Usage::Columnwise, Usage::Rowwise),
        ] {
            let q = make(usage).quantize(&input(dims, DType::BF16)).unwrap();
            let e = q.dequantize_usage(missing, DType::F32).unwrap_err();
            assert!(
                e.to_string().contains("has no"),
                "{name}: dequantizing a missing orientation: {e}"
            );
            // dequantize() picks the orientation present and the requested dtype.
            let y = q.dequantize(DType::BF16).unwrap();
            assert_eq!(y.dtype(), DType::BF16);
            assert_eq!(y.shape(), q.shape());
        }
    }
    assert_eq!(
        col.dequantize(DType::F32).unwrap().to_bytes().unwrap(),
        col.dequantize_usage(Usage::Columnwise, DType::F32)
            .unwrap()
            .to_bytes()
            .unwrap()
    );
}

/// `dequantize_into` writes exactly what `dequantize_usage` returns, over a poisoned
/// output, for every format, orientation and output dtype; a wrong output shape or dtype,
/// or no single orientation, is a typed error that names what was expected.
#[test]
fn dequantize_into_matches_dequantize_usage() {
    for (name, make, shapes) in quantizers() {
        for dims in &shapes {
            let q = make(Usage::Both)
                .quantize(&input(dims, DType::BF16))
                .unwrap();
            for usage in [Usage::Rowwise, Usage::Columnwise] {
                for dtype in [DType::F32, DType::BF16, DType::F16] {
                    let want = q.dequantize_usage(usage, dtype).unwrap();
                    let mut out =
                        Tensor::filled_with_byte(dims.as_slice(), dtype, Device::Cpu, 0xA5)
                            .unwrap();
                    q.dequantize_into(usage, &mut out).unwrap();
                    assert_eq!(
                        out.to_bytes().unwrap(),
                        want.to_bytes().unwrap(),
                        "{name} {dims:?} {usage:?} {dtype}"
                    );
                }
            }
        }
    }
    let q = mx_tensor(Usage::Both);
    let mut wrong_shape = Tensor::zeros([32, 32], DType::F32, Device::Cpu).unwrap();
    let e = q
        .dequantize_into(Usage::Rowwise, &mut wrong_shape)
        .unwrap_err();
    assert!(matches!(e, Error::Shape { .. }), "{e}");
    assert!(e.to_string().contains("expected the same shape"), "{e}");
    let mut wrong_dtype = Tensor::zeros(q.shape().clone(), DType::U8, Device::Cpu).unwrap();
    let e = q
        .dequantize_into(Usage::Rowwise, &mut wrong_dtype)
        .unwrap_err();
    assert!(matches!(e, Error::DType { .. }), "{e}");
    let mut out = Tensor::zeros(q.shape().clone(), DType::F32, Device::Cpu).unwrap();
    let e = q.dequantize_into(Usage::Both, &mut out).unwrap_err();
    assert!(e.to_string().contains("choose one orientation"), "{e}");
}

#[test]
fn names_and_parsing() {
    for b in BufferName::ALL {
        assert_eq!(BufferName::from_name(b.name()), Some(b));
        assert_eq!(b.to_string(), b.name());
    }
    assert_eq!(BufferName::from_name("nope"), None);
    for u in [Usage::Rowwise, Usage::Columnwise, Usage::Both] {
        assert_eq!(u.name().parse::<Usage>().unwrap(), u);
    }
    assert!("sideways".parse::<Usage>().is_err());
    assert_eq!(Usage::default(), Usage::Both);
    assert!(Usage::Both.rowwise() && Usage::Both.columnwise());
    assert!(!Usage::Rowwise.columnwise() && !Usage::Columnwise.rowwise());
    for f in [Fp8Format::E4M3, Fp8Format::E5M2] {
        assert_eq!(f.name().parse::<Fp8Format>().unwrap(), f);
        assert_eq!(f.name().to_uppercase().parse::<Fp8Format>().unwrap(), f);
    }
    let e = "e3m4".parse::<Fp8Format>().unwrap_err().to_string();
    assert!(e.contains("e4m3 or e5m2"), "{e}");
    assert_eq!(Fp8Format::E4M3.dtype(), DType::F8E4M3);
    assert_eq!(Fp8Format::E5M2.dtype(), DType::F8E5M2);
    assert_eq!(
        Kind::Fp8 {
            format: Fp8Format::E4M3
        }
        .name(),
        "fp8"
    );
    assert_eq!(
        Kind::Fp8Block {
            format: Fp8Format::E4M3,
            block_dim: BlockDim::TwoD
        }
        .name(),
        "fp8-block"
    );
    for (name, make, _) in quantizers() {
        let q = make(Usage::Rowwise);
        assert!(
            ["fp8", "mxfp8", "nvfp4", "fp8-block"].contains(&q.kind().name()),
            "{name}"
        );
    }
    assert!(format!("{:?}", mx_tensor(Usage::Both)).contains("Mxfp8"));
    assert!(format!("{:?}", Nvfp4Quantizer::new()).contains("Nvfp4Quantizer"));
}

/// Empty tensors (a zero dimension) quantize to empty buffers with padded scales and
/// dequantize to empty tensors.
#[test]
fn empty_tensors() {
    let cases: Vec<(Box<dyn Quantizer>, Vec<usize>)> = vec![
        (
            Box::new(Fp8CurrentScaling::new(Fp8Format::E4M3)),
            vec![0, 5],
        ),
        (
            Box::new(Fp8CurrentScaling::new(Fp8Format::E4M3)),
            vec![5, 0],
        ),
        (Box::new(Fp8CurrentScaling::new(Fp8Format::E5M2)), vec![0]),
        (
            Box::new(Fp8BlockQuantizer::new(Fp8Format::E4M3, BlockDim::OneD)),
            vec![0, 5],
        ),
        (
            Box::new(Fp8BlockQuantizer::new(Fp8Format::E4M3, BlockDim::TwoD)),
            vec![5, 0],
        ),
        (Box::new(Mxfp8Quantizer::new(Fp8Format::E4M3)), vec![0, 32]),
        (
            Box::new(Mxfp8Quantizer::new(Fp8Format::E4M3).with_2d(true)),
            vec![0, 64],
        ),
        (Box::new(Mxfp8Quantizer::new(Fp8Format::E4M3)), vec![32, 0]),
        (
            Box::new(Mxfp8Quantizer::new(Fp8Format::E5M2).with_2d(true)),
            vec![64, 0],
        ),
        (Box::new(Mxfp8Quantizer::new(Fp8Format::E4M3)), vec![0, 0]),
        (Box::new(Nvfp4Quantizer::new()), vec![0, 16]),
        (Box::new(Nvfp4Quantizer::new().with_rht(true)), vec![16, 0]),
    ];
    for (mut q, dims) in cases {
        let shape = Shape::new(dims.clone());
        let x = Tensor::zeros(shape.clone(), DType::BF16, Device::Cpu).unwrap();
        let qt = q.quantize(&x).unwrap();
        let empty = q.make_empty(&shape, DType::BF16, Device::Cpu).unwrap();
        assert_eq!(layout_of(&qt), layout_of(&empty), "{:?} {dims:?}", q.kind());
        for usage in [Usage::Rowwise, Usage::Columnwise] {
            let y = qt.dequantize_usage(usage, DType::F32).unwrap();
            assert_eq!(y.shape(), &shape);
            assert_eq!(y.numel(), 0);
        }
    }
}
