//! The GEMM swizzle and `swap_first_dims` (`spec/formats.md` §4.5, §7) against the
//! formulas written out independently here.

use proptest::prelude::*;
use tessera_core::{DType, Device, Error, Tensor};
use tessera_quant::layout::{
    pad, roundup, strip_padding, swap_first_dims, swap_first_dims_bytes, swizzle, swizzled_index,
    transpose, unswizzle,
};

/// TE's test helper (`mxfp8_utils.py::swizzle_mxfp8_scale`): the padded `[R, C]` grid
/// viewed as `[R/128, 4, 32, C/4, 4]` and permuted to `(0, 3, 2, 1, 4)`. Returns, for
/// each output position, the compact index it holds.
fn te_swizzle_source(rows: usize, cols: usize) -> Vec<usize> {
    let mut out = Vec::with_capacity(rows * cols);
    for a in 0..rows / 128 {
        for d in 0..cols / 4 {
            for c in 0..32 {
                for b in 0..4 {
                    for e in 0..4 {
                        let (i, j) = (a * 128 + b * 32 + c, d * 4 + e);
                        out.push(i * cols + j);
                    }
                }
            }
        }
    }
    out
}

/// The spec's formula (§4.5) for the destination of byte (i, j).
fn spec_swizzled_index(i: usize, j: usize, cols: usize) -> usize {
    let tile = (i / 128) * (cols / 4) + j / 4;
    tile * 512 + (i % 128 % 32) * 16 + (i % 128 / 32) * 4 + j % 4
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn swizzle_matches_te_helper(tr in 1usize..=3, tc in 1usize..=6, seed: u64) {
        let (rows, cols) = (128 * tr, 4 * tc);
        let compact: Vec<u8> = (0..rows * cols)
            .map(|i| (seed.wrapping_mul(i as u64 + 1) >> 13) as u8)
            .collect();
        let src = te_swizzle_source(rows, cols);
        let want: Vec<u8> = src.iter().map(|&s| compact[s]).collect();
        let s = swizzle(&compact, rows, cols).unwrap();
        prop_assert_eq!(&s, &want);
        prop_assert_eq!(unswizzle(&s, rows, cols).unwrap(), compact);
        // The index function is the inverse of the helper's source map, and equals the
        // spec's tile formula.
        for (pos, &si) in src.iter().enumerate() {
            let (i, j) = (si / cols, si % cols);
            prop_assert_eq!(swizzled_index(i, j, cols), pos);
            prop_assert_eq!(spec_swizzled_index(i, j, cols), pos);
        }
    }

    #[test]
    fn swap_first_dims_bytes_matches_the_index_formula(
        d0 in 0usize..7, d1 in 0usize..7, inner in 0usize..9, seed: u64,
    ) {
        let n = d0 * d1 * inner;
        let src: Vec<u8> = (0..n).map(|i| (seed.rotate_left(i as u32 % 64) ^ i as u64) as u8).collect();
        let out = swap_first_dims_bytes(&src, d0, d1, inner).unwrap();
        prop_assert_eq!(out.len(), n);
        // Input [D0, D1, C]; with A = D1, B = D0: out[(i·B + j)·C + c] = in[(j·A + i)·C + c].
        let (a, b, c_) = (d1, d0, inner);
        for i in 0..a {
            for j in 0..b {
                for c in 0..c_ {
                    prop_assert_eq!(out[(i * b + j) * c_ + c], src[(j * a + i) * c_ + c]);
                }
            }
        }
        // Swapping back restores the input.
        prop_assert_eq!(swap_first_dims_bytes(&out, d1, d0, inner).unwrap(), src);
        prop_assert!(swap_first_dims_bytes(&[0u8; 5], d0, d1, inner).is_err() || n == 5);
    }

    #[test]
    fn swap_first_dims_of_a_gathered_tensor(world in 1usize..=4, rows in 1usize..6, cols in 1usize..6, seed: u64) {
        // `world` rank blocks [rows, cols] of f32, concatenated along dim 0.
        let v: Vec<f32> = (0..world * rows * cols)
            .map(|i| (seed.wrapping_add(i as u64) % 1000) as f32 - 500.0)
            .collect();
        let t = Tensor::from_slice(&v, [world * rows, cols], Device::Cpu).unwrap();
        let s = swap_first_dims(&t, world).unwrap();
        prop_assert_eq!(s.shape().dims(), &[rows, world * cols]);
        prop_assert_eq!(s.dtype(), DType::F32);
        let out = s.to_vec::<f32>().unwrap();
        // Row r is the concatenation of row r of every rank.
        for r in 0..rows {
            for w in 0..world {
                for c in 0..cols {
                    prop_assert_eq!(
                        out[r * world * cols + w * cols + c].to_bits(),
                        v[(w * rows + r) * cols + c].to_bits()
                    );
                }
            }
        }
    }

    #[test]
    fn pad_strip_and_transpose(rows in 0usize..9, cols in 0usize..9, er in 0usize..4, ec in 0usize..4, elem in 1usize..=4) {
        let src: Vec<u8> = (0..rows * cols * elem).map(|i| i as u8 ^ 0x5A).collect();
        let p = pad(&src, rows, cols, rows + er, cols + ec, elem);
        prop_assert_eq!(p.len(), (rows + er) * (cols + ec) * elem);
        prop_assert_eq!(strip_padding(&p, cols + ec, rows, cols, elem), src.clone());
        // Everything outside the valid region is zero.
        let nonzero_outside = (0..rows + er).any(|r| {
            (0..(cols + ec) * elem).any(|c| (r >= rows || c >= cols * elem) && p[r * (cols + ec) * elem + c] != 0)
        });
        prop_assert!(!nonzero_outside);
        let m: Vec<u32> = (0..(rows * cols) as u32).collect();
        let t = transpose(&m, rows, cols);
        for r in 0..rows {
            for c in 0..cols {
                prop_assert_eq!(t[c * rows + r], m[r * cols + c]);
            }
        }
        prop_assert_eq!(transpose(&t, cols, rows), m);
    }
}

#[test]
fn spec_examples() {
    // §7: world 2, per-rank [K=2, M_local=3], values 0..11.
    let t = Tensor::from_slice(&(0u8..12).collect::<Vec<_>>(), [4, 3], Device::Cpu).unwrap();
    let s = swap_first_dims(&t, 2).unwrap();
    assert_eq!(
        s.to_vec::<u8>().unwrap(),
        [0, 1, 2, 6, 7, 8, 3, 4, 5, 9, 10, 11]
    );
    assert_eq!(roundup(0, 4), 0);
    assert_eq!(roundup(5, 4), 8);
    assert_eq!(roundup(128, 128), 128);
    // One tile: byte (i, j) at (i % 32)·16 + (i / 32)·4 + j.
    assert_eq!(swizzled_index(0, 0, 4), 0);
    assert_eq!(swizzled_index(1, 0, 4), 16);
    assert_eq!(swizzled_index(32, 0, 4), 4);
    assert_eq!(swizzled_index(127, 3, 4), 31 * 16 + 3 * 4 + 3);
    assert_eq!(swizzled_index(128, 0, 4), 512);
    assert_eq!(swizzled_index(0, 4, 8), 512);
}

#[test]
fn bad_grids_and_shapes_are_errors() {
    let b = vec![0u8; 128 * 4];
    assert!(matches!(swizzle(&b, 64, 8), Err(Error::Shape { .. })));
    assert!(matches!(swizzle(&b, 128, 3), Err(Error::Shape { .. })));
    assert!(matches!(
        unswizzle(&b[..100], 128, 4),
        Err(Error::Shape { .. })
    ));
    let e = swizzle(&b, 256, 4).unwrap_err().to_string();
    assert!(e.contains("multiple of 128"), "{e}");
    assert!(matches!(
        swap_first_dims_bytes(&b, 3, 5, 7),
        Err(Error::Shape { .. })
    ));
    let t = Tensor::from_slice(&[0u8; 12], [4, 3], Device::Cpu).unwrap();
    assert!(matches!(swap_first_dims(&t, 3), Err(Error::Shape { .. })));
    assert!(matches!(swap_first_dims(&t, 0), Err(Error::Shape { .. })));
    let scalar = Tensor::from_slice(&[0u8], [], Device::Cpu).unwrap();
    assert!(matches!(
        swap_first_dims(&scalar, 1),
        Err(Error::Shape { .. })
    ));
}
