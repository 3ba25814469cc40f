//! Byte layouts shared by the formats and the collectives: padding, the cuBLAS
//! GEMM-swizzled scale layout, transposes and `swap_first_dims` (`spec/formats.md`
//! §4.5, §7).

use rayon::prelude::*;
use tessera_core::{Error, Result, Shape, Tensor};

/// `x` rounded up to a multiple of `m`.
#[inline]
pub const fn roundup(x: usize, m: usize) -> usize {
    x.div_ceil(m) * m
}

/// Where byte `(i, j)` of a compact scale grid with `cols` columns (padded: rows a
/// multiple of 128, `cols` a multiple of 4) lives in cuBLAS's block-scaling layout
/// (TE's `gemm_swizzled_scale_idx`): 128×4 tiles stored tile-row-major, 512 bytes each,
/// and inside a tile byte `(i, j)` at `(i % 32)·16 + (i % 128 / 32)·4 + j % 4`.
#[inline]
pub const fn swizzled_index(i: usize, j: usize, cols: usize) -> usize {
    let tile = (i / 128) * (cols / 4) + j / 4;
    let r = i % 128;
    tile * 512 + (r % 32) * 16 + (r / 32) * 4 + j % 4
}

fn check_swizzle_grid(op: &'static str, len: usize, rows: usize, cols: usize) -> Result<()> {
    if !rows.is_multiple_of(128) || !cols.is_multiple_of(4) || rows * cols != len {
        return Err(Error::shape(
            op,
            format!(
                "a swizzled scale grid needs rows a multiple of 128 and columns a multiple of \
                 4 covering the buffer; got {rows}x{cols} for {len} bytes"
            ),
        ));
    }
    Ok(())
}

/// The compact row-major grid `[rows, cols]` in the GEMM-swizzled layout.
pub fn swizzle(compact: &[u8], rows: usize, cols: usize) -> Result<Vec<u8>> {
    check_swizzle_grid("swizzle", compact.len(), rows, cols)?;
    let mut out = vec![0u8; compact.len()];
    for i in 0..rows {
        for j in 0..cols {
            out[swizzled_index(i, j, cols)] = compact[i * cols + j];
        }
    }
    Ok(out)
}

/// The inverse of [`swizzle`].
pub fn unswizzle(swizzled: &[u8], rows: usize, cols: usize) -> Result<Vec<u8>> {
    check_swizzle_grid("unswizzle", swizzled.len(), rows, cols)?;
    let mut out = vec![0u8; swizzled.len()];
    for i in 0..rows {
        for j in 0..cols {
            out[i * cols + j] = swizzled[swizzled_index(i, j, cols)];
        }
    }
    Ok(out)
}

/// The transpose of a row-major `[rows, cols]` matrix of `T` (`src.len()` must be
/// `rows * cols`; checked by the callers, which derive both from one shape).
///
/// Cache-blocked: one rayon task per band of 32 source columns (= 32 output rows), walked
/// down in 32×32 tiles. Each tile is copied row by row into a small array and written out
/// row by row from it, so every access to `src` and `out` is a run of up to 32
/// consecutive elements and power-of-two strides cannot thrash the cache.
pub fn transpose<T: Copy + Send + Sync>(src: &[T], rows: usize, cols: usize) -> Vec<T> {
    const TILE: usize = 32;
    let n = rows * cols;
    debug_assert_eq!(src.len(), n);
    let mut out: Vec<T> = Vec::with_capacity(n);
    if n == 0 {
        return out;
    }
    let first = src[0]; // fills the tile buffer before its first use
    out.spare_capacity_mut()[..n]
        .par_chunks_mut(TILE * rows)
        .enumerate()
        .for_each(|(band, dst)| {
            // dst: output rows c0..c0 + w, i.e. source columns c0..c0 + w.
            let c0 = band * TILE;
            let w = dst.len() / rows;
            let mut tile = [[first; TILE]; TILE];
            for r0 in (0..rows).step_by(TILE) {
                let h = TILE.min(rows - r0);
                for (t, r) in tile.iter_mut().zip(r0..r0 + h) {
                    let run = &src[r * cols + c0..][..w];
                    match <&[T; TILE]>::try_from(run) {
                        Ok(full) => *t = *full, // a fixed-size copy, inlined
                        Err(_) => t[..w].copy_from_slice(run),
                    }
                }
                // Column c of the tile is output row c0 + c.
                for (c, row) in dst.chunks_exact_mut(rows).enumerate() {
                    for (o, t) in row[r0..r0 + h].iter_mut().zip(&tile) {
                        o.write(t[c]);
                    }
                }
            }
        });
    // SAFETY: the chunks cover out[..n] (n = rows · cols) exactly once: chunk `band` holds
    // output rows band·TILE.. (w of them, `rows` elements each), and for each of these
    // rows the r0 loop writes elements r0..r0 + h for r0 = 0, TILE, ..., i.e. all of
    // 0..rows. So all n elements are initialised (and T: Copy has nothing to drop).
    unsafe { out.set_len(n) };
    out
}

/// `swap_first_dims` on raw bytes (TE's `tex.swap_first_dims`): the input is
/// `[d0, d1, inner]` bytes, the output `[d1, d0, inner]` with
/// `out[i, j, :] = in[j, i, :]`.
pub fn swap_first_dims_bytes(src: &[u8], d0: usize, d1: usize, inner: usize) -> Result<Vec<u8>> {
    if d0 * d1 * inner != src.len() {
        return Err(Error::shape(
            "swap_first_dims",
            format!(
                "{} bytes cannot be viewed as [{d0}, {d1}, {inner}]",
                src.len()
            ),
        ));
    }
    let mut out = vec![0u8; src.len()];
    if inner == 0 {
        return Ok(out);
    }
    out.par_chunks_mut(inner).enumerate().for_each(|(k, row)| {
        let (i, j) = (k / d0, k % d0);
        row.copy_from_slice(&src[(j * d1 + i) * inner..][..inner]);
    });
    Ok(out)
}

/// `(R, C)` for `swap_first_dims` of a tensor of `shape` over `world` ranks (the host
/// and the CUDA twin share it): R = the first dimension over `world`, C = the product
/// of the trailing dims. An error when `shape` has rank 0 or its first dimension is not
/// a multiple of a nonzero `world`.
pub(crate) fn swap_first_dims_geometry(
    op: &'static str,
    shape: &Shape,
    world: usize,
) -> Result<(usize, usize)> {
    let dims = shape.dims();
    let Some(&d0) = dims.first() else {
        return Err(Error::shape(op, "a rank-0 tensor has no first dimension"));
    };
    if world == 0 || d0 % world != 0 {
        return Err(Error::shape(
            op,
            format!("first dimension {d0} of {shape} is not a multiple of the world size {world}"),
        ));
    }
    Ok((d0 / world, dims[1..].iter().product()))
}

/// The all-gather fix-up of `distributed.py::_swap_first_dims(t, world)` on a host
/// tensor: `t` of shape `[world·R, c...]` holds `world` rank blocks `[R, c...]`; the
/// result is `[R, world·C]` (C = the product of the trailing dims), each row the
/// concatenation of that row across ranks.
pub fn swap_first_dims(t: &Tensor, world: usize) -> Result<Tensor> {
    let (rows, trailing) = swap_first_dims_geometry("swap_first_dims", t.shape(), world)?;
    let inner = trailing * t.dtype().size_in_bytes();
    let bytes = swap_first_dims_bytes(t.as_bytes()?, world, rows, inner)?;
    Tensor::from_bytes(
        &bytes,
        Shape::new([rows, world * trailing]),
        t.dtype(),
        t.device(),
    )
}

/// The valid top-left `[rows, cols]` region of a row-major `[total_rows, total_cols]`
/// matrix of `elem`-byte elements (strips padding).
pub fn strip_padding(
    src: &[u8],
    total_cols: usize,
    rows: usize,
    cols: usize,
    elem: usize,
) -> Vec<u8> {
    let mut out = Vec::with_capacity(rows * cols * elem);
    for r in 0..rows {
        out.extend_from_slice(&src[r * total_cols * elem..][..cols * elem]);
    }
    out
}

/// A `[rows, cols]` matrix placed top-left in a zero-padded `[total_rows, total_cols]` one.
pub fn pad(
    src: &[u8],
    rows: usize,
    cols: usize,
    total_rows: usize,
    total_cols: usize,
    elem: usize,
) -> Vec<u8> {
    let mut out = vec![0u8; total_rows * total_cols * elem];
    for r in 0..rows {
        out[r * total_cols * elem..][..cols * elem]
            .copy_from_slice(&src[r * cols * elem..][..cols * elem]);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn swizzle_is_a_permutation_and_inverts() {
        let (rows, cols) = (256, 8);
        let compact: Vec<u8> = (0..rows * cols).map(|i| (i * 7 % 251) as u8).collect();
        let mut seen = vec![false; rows * cols];
        for i in 0..rows {
            for j in 0..cols {
                let k = swizzled_index(i, j, cols);
                assert!(!seen[k], "({i}, {j}) collides");
                seen[k] = true;
            }
        }
        let s = swizzle(&compact, rows, cols).unwrap();
        assert_eq!(unswizzle(&s, rows, cols).unwrap(), compact);
        // Spot values of the formula: row 33, column 5 of a 4-tile-wide grid.
        assert_eq!(swizzled_index(33, 5, 16), 512 + 16 + 4 + 1);
        assert!(swizzle(&compact[..100], 10, 10).is_err());
    }

    #[test]
    fn swap_first_dims_matches_the_spec_example() {
        // spec §7: world 2, per-rank [K=2, M_local=3], values 0..11.
        let t = Tensor::from_slice(
            &(0u8..12).collect::<Vec<_>>(),
            [4, 3],
            tessera_core::Device::Cpu,
        )
        .unwrap();
        let s = swap_first_dims(&t, 2).unwrap();
        assert_eq!(s.shape().dims(), &[2, 6]);
        assert_eq!(
            s.as_slice::<u8>().unwrap(),
            &[0, 1, 2, 6, 7, 8, 3, 4, 5, 9, 10, 11]
        );
        assert!(swap_first_dims(&t, 3).is_err());
    }

    #[test]
    fn blocked_transpose_matches_the_definition_across_tile_edges() {
        fn check<T: Copy + Send + Sync + PartialEq + std::fmt::Debug>(f: impl Fn(usize) -> T) {
            for rows in [1, 2, 31, 32, 33, 64, 65, 97] {
                for cols in [1, 3, 31, 32, 33, 64, 70] {
                    let m: Vec<T> = (0..rows * cols).map(&f).collect();
                    let t = transpose(&m, rows, cols);
                    let want: Vec<T> = (0..cols * rows)
                        .map(|i| m[(i % rows) * cols + i / rows])
                        .collect();
                    assert_eq!(t, want, "{rows}x{cols}");
                }
            }
        }
        check(|i| i as u8);
        check(|i| i as u16);
        check(|i| i as f32);
        check(|i| i as u64);
        assert!(transpose::<u8>(&[], 0, 5).is_empty());
        assert!(transpose::<u8>(&[], 7, 0).is_empty());
    }

    #[test]
    fn padding_round_trip_and_transpose() {
        let m: Vec<u8> = (0..6).collect();
        let p = pad(&m, 2, 3, 4, 4, 1);
        assert_eq!(p, [0, 1, 2, 0, 3, 4, 5, 0, 0, 0, 0, 0, 0, 0, 0, 0]);
        assert_eq!(strip_padding(&p, 4, 2, 3, 1), m);
        assert_eq!(transpose(&m, 2, 3), [0, 3, 1, 4, 2, 5]);
    }
}
