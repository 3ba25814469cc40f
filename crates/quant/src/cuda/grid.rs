//! Launch grids: the dequantizers' covering grids and the tile kernels' grids, each
//! refusing what a launch cannot hold instead of leaving work undone.

use cudarc::driver::LaunchConfig;
use tessera_core::{Error, Result};

use super::BLOCK;

/// Units of work a dequantizing thread takes (`DEQ_UNITS` in `common.cuh`).
const DEQ_UNITS: usize = 2;

/// The launch of a dequantizer that gives each thread [`DEQ_UNITS`] units of work and does
/// not stride (`for_units` in `common.cuh`): the grid covers all `units`.
pub(crate) fn dequant_units_grid(units: usize) -> Result<LaunchConfig> {
    covering(
        "cuda dequantize",
        units.div_ceil(DEQ_UNITS).div_ceil(BLOCK as usize),
    )
}

/// The launch of a columnwise dequantizer that reads its stored `[k, m]` operand in tiles
/// of `tile[0]` stored rows by `tile[1]` elements along `m`, a CTA per tile.
fn dequant_cols_grid(m: usize, k: usize, tile: [usize; 2]) -> Result<LaunchConfig> {
    // The stored operand is [k, m]: its row-major tiles are what the kernels map blockIdx to.
    tile_grid("cuda dequantize columnwise", k, m, tile[0], tile[1])
}

/// The two tiles of a columnwise dequantizer (`fp8_dequant_cols` in `common.cuh`, for FP8
/// per-tensor and block data; `nvfp4_dequant_cols` in `nvfp4.cu`), `[stored rows, elements
/// along m]`: the short one suits any shape, the tall one (twice the rows, so twice a
/// CTA's bytes in flight and half the CTAs) is faster once its grid fills the card and
/// slower while it leaves SMs idle. [`DeqColsTiles::pick`] chooses by shape.
#[derive(Clone, Copy, Debug)]
pub(crate) struct DeqColsTiles {
    /// The tile of the `_t_` entry points.
    short: [usize; 2],
    /// The tile of the `_t_tall_` entry points.
    tall: [usize; 2],
    /// CTAs of a tall entry point resident on an SM (its `__launch_bounds__` minimum).
    tall_per_sm: usize,
}

/// `fp8_dequant_cols`: `[DEQ_TILE_K | DEQ_TILE_K_TALL, DEQ_TILE_M]` in `common.cuh`, the
/// tall kernels built for `DEQ_T_TALL_MINB` CTAs an SM (64 registers).
pub(crate) const FP8_DEQ_TILES: DeqColsTiles = DeqColsTiles {
    short: [64, 256],
    tall: [128, 256],
    tall_per_sm: 4,
};
/// `nvfp4_dequant_cols`: `[NVFP4_DEQ_TILE_K | NVFP4_DEQ_TILE_K_TALL, NVFP4_DEQ_TILE_M]` in
/// `nvfp4.cu`, both built for `NVFP4_DEQ_T_MINB` CTAs an SM (32 registers). The
/// inverse-RHT kernel has the short tile only.
pub(crate) const NVFP4_DEQ_TILES: DeqColsTiles = DeqColsTiles {
    short: [64, 256],
    tall: [128, 256],
    tall_per_sm: 8,
};

/// Which of a columnwise dequantizer's tiles a launch takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ColsTile {
    /// [`DeqColsTiles::short`]: the `_t_` entry points.
    Short,
    /// [`DeqColsTiles::tall`]: the `_t_tall_` entry points.
    Tall,
}

impl ColsTile {
    /// The entry point's infix after the format's prefix (`tessera_fp8_dequant_` ...).
    pub(crate) fn infix(self) -> &'static str {
        match self {
            ColsTile::Short => "t_",
            ColsTile::Tall => "t_tall_",
        }
    }
}

impl DeqColsTiles {
    /// The tile for a `[m, k]` output on a device of `sms` SMs: the tall one when its CTAs
    /// fill at least 7/8 of a wave (`sms * tall_per_sm` resident), else the short one.
    ///
    /// Measured on an H100 (132 SMs, bf16, bench/cuda/dequant_variants.cu, 2026-12-06):
    /// FP8's tall tile ran at 1.06 of a copy against 0.96 at 4096x4096 (512 CTAs, 0.97 of
    /// a wave) and 0.94-0.95 against 0.86-0.90 from 8192x8192 up, but 0.88 against 0.90 at
    /// 2048x4096 (half a wave); NVFP4's at 0.85-0.87 against 0.82-0.84 from 4096x8192 up
    /// (1024 CTAs, 0.97 of a wave), but 0.90 against 0.99 at 4096x4096 (half a wave). An
    /// H200 (also 132 SMs) wins and loses at the same shapes (BENCHMARKS.md, figures of
    /// record v26).
    pub(crate) fn pick(&self, m: usize, k: usize, sms: usize) -> ColsTile {
        let tall_ctas = tile_count(k, m, self.tall[0], self.tall[1]);
        if tall_ctas.saturating_mul(8) >= sms.saturating_mul(self.tall_per_sm).saturating_mul(7) {
            ColsTile::Tall
        } else {
            ColsTile::Short
        }
    }

    /// The launch of `tile`: a CTA per tile of the stored `[k, m]` operand, ragged edges
    /// rounded up; fails past the grid's 2^31 - 1 CTAs.
    pub(crate) fn grid(&self, m: usize, k: usize, tile: ColsTile) -> Result<LaunchConfig> {
        dequant_cols_grid(
            m,
            k,
            match tile {
                ColsTile::Short => self.short,
                ColsTile::Tall => self.tall,
            },
        )
    }
}

/// `blocks` CTAs of `BLOCK` threads on a 1-D grid, refused past the grid's limit of
/// 2^31 - 1 CTAs in x (the kernels launched this way do not stride, so a capped grid would
/// leave work undone).
fn covering(op: &'static str, blocks: usize) -> Result<LaunchConfig> {
    let blocks = i32::try_from(blocks.max(1)).map_err(|_| {
        Error::shape(
            op,
            format!(
                "{blocks} thread blocks exceed the launch grid's limit of {}",
                i32::MAX
            ),
        )
    })? as u32;
    Ok(LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (BLOCK, 1, 1),
        shared_mem_bytes: 0,
    })
}

/// A 2-D launch of 64×64 tiles over an `[rows, cols]` matrix (rows in x, cols in y).
pub(crate) fn tiles_64(rows: usize, cols: usize) -> Result<LaunchConfig> {
    let gy = cols.div_ceil(64).max(1);
    if gy > 65_535 {
        return Err(Error::shape(
            "cuda launch",
            format!("a matrix with {cols} columns exceeds the 64x65535-column tile grid"),
        ));
    }
    Ok(LaunchConfig {
        grid_dim: (
            rows.div_ceil(64).clamp(1, u32::MAX as usize) as u32,
            gy as u32,
            1,
        ),
        block_dim: (BLOCK, 1, 1),
        shared_mem_bytes: 0,
    })
}

/// The `tm x tk` tiles covering an `[m, k]` matrix, ragged edges rounded up, at least one
/// (saturating: a count past any grid's limit stays past it).
fn tile_count(m: usize, k: usize, tm: usize, tk: usize) -> usize {
    m.div_ceil(tm).max(1).saturating_mul(k.div_ceil(tk).max(1))
}

/// The launch of a tile kernel over an `[m, k]` matrix cut into `tm x tk` tiles: a 1-D
/// grid of one CTA per tile, which the kernel maps to its tile, in row-major order
/// (`tile_row` / `tile_col` in kernels/common.cuh; the general NVFP4 kernel takes them
/// column-major). Fails when there are more than 2^31 - 1 tiles.
pub(crate) fn tile_grid(
    op: &'static str,
    m: usize,
    k: usize,
    tm: usize,
    tk: usize,
) -> Result<LaunchConfig> {
    let tiles = tile_count(m, k, tm, tk);
    if tiles > i32::MAX as usize {
        return Err(Error::shape(
            op,
            format!(
                "[{m}, {k}] needs {tiles} tiles of {tm}x{tk}; the launch grid holds at most {}",
                i32::MAX
            ),
        ));
    }
    Ok(LaunchConfig {
        grid_dim: (tiles as u32, 1, 1),
        block_dim: (BLOCK, 1, 1),
        shared_mem_bytes: 0,
    })
}

/// The launch of a banded tile kernel (`tile_banded` in kernels/common.cuh) over an
/// `[m, k]` matrix cut into `t x t` tiles: bands of `h` tile rows, `h` the least power of
/// two at least the number of tile rows, at most 8; `grid.x` covers a band (its tile
/// columns times `h`, tile rows fastest), `grid.y` counts the bands. The last band's
/// tiles past the matrix have CTAs that return at once. Fails when a band holds more
/// than 2^31 - 1 tiles or there are more than 65535 bands.
pub(crate) fn banded_grid(op: &'static str, m: usize, k: usize, t: usize) -> Result<LaunchConfig> {
    let gx = m.div_ceil(t).max(1);
    let h = gx.next_power_of_two().min(1 << BAND_ROWS_LOG2);
    bands(op, [m, k], t, h, k.div_ceil(t).max(1))
}

/// The launch of the NVFP4 both kernel in clusters of 8x2 tiles (`BothClusters` in
/// kernels/nvfp4.cu) over an `[m, k]` matrix cut into `t x t` tiles: [`banded_grid`]'s
/// grid with bands of 8 tile rows whatever `m`, and the tile columns rounded up to even,
/// so that `grid.x` is a whole number of clusters of 16 CTAs (a padding column's tiles
/// lie past `k`). Fails as [`banded_grid`] does.
pub(crate) fn banded_grid_padded(
    op: &'static str,
    m: usize,
    k: usize,
    t: usize,
) -> Result<LaunchConfig> {
    let gy = k.div_ceil(t).max(1).next_multiple_of(2);
    bands(op, [m, k], t, 1 << BAND_ROWS_LOG2, gy)
}

/// Bands of `h` tile rows of `gy` tile columns each over `[m, k]` (`t x t` tiles): `grid.x`
/// a band's CTAs, `grid.y` the bands; refused past 2^31 - 1 CTAs a band or 65535 bands.
fn bands(
    op: &'static str,
    [m, k]: [usize; 2],
    t: usize,
    h: usize,
    gy: usize,
) -> Result<LaunchConfig> {
    let (x, y) = (gy.saturating_mul(h), m.div_ceil(t).max(1).div_ceil(h));
    if x > i32::MAX as usize || y > u16::MAX as usize {
        return Err(Error::shape(
            op,
            format!(
                "[{m}, {k}] needs {y} bands of {h} x {gy} tiles of {t}x{t}; a launch holds at \
                 most 65535 bands of at most {} tiles",
                i32::MAX
            ),
        ));
    }
    Ok(LaunchConfig {
        grid_dim: (x as u32, y as u32, 1),
        block_dim: (BLOCK, 1, 1),
        shared_mem_bytes: 0,
    })
}

/// log2 of the most tile rows in a band (`TQ_BAND_ROWS_LOG2` in kernels/common.cuh).
const BAND_ROWS_LOG2: u32 = 3;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dequantizer_grids_cover_their_work_and_refuse_past_the_grid_limit() {
        // Two units a thread, in whole CTAs: every unit has a thread, with less than a
        // CTA to spare.
        for units in [1usize, 511, 512, 513, 1 << 20, 16384 * 8192 / 8 + 3] {
            let cfg = dequant_units_grid(units).unwrap();
            let threads = cfg.grid_dim.0 as usize * BLOCK as usize;
            assert!(
                threads * DEQ_UNITS >= units,
                "{units} units, {threads} threads"
            );
            assert!(
                (threads - BLOCK as usize) * DEQ_UNITS < units,
                "{units} units, {threads} threads"
            );
        }
        // No work still launches one CTA (the per-tensor kernel's tail needs threads).
        assert_eq!(dequant_units_grid(0).unwrap().grid_dim, (1, 1, 1));
        // A CTA per tile of the stored operand, ragged edges rounded up.
        for (tiles, [m, k], tile, ctas) in [
            (FP8_DEQ_TILES, [16384, 8192], ColsTile::Short, 128 * 64),
            (FP8_DEQ_TILES, [16384, 8192], ColsTile::Tall, 64 * 64),
            (NVFP4_DEQ_TILES, [6176, 4192], ColsTile::Short, 66 * 25),
            (NVFP4_DEQ_TILES, [6176, 4192], ColsTile::Tall, 33 * 25),
        ] {
            let cfg = tiles.grid(m, k, tile).unwrap();
            assert_eq!(cfg.grid_dim, (ctas, 1, 1), "[{m}, {k}] {tile:?}");
        }
        // The kernels do not stride, so a grid past 2^31 - 1 CTAs (CUDA's limit in x) is an
        // error, not a silently capped launch.
        let per_cta = BLOCK as usize * DEQ_UNITS;
        assert_eq!(
            dequant_units_grid(i32::MAX as usize * per_cta)
                .unwrap()
                .grid_dim,
            (i32::MAX as u32, 1, 1)
        );
        assert!(dequant_units_grid((i32::MAX as usize + 1) * per_cta).is_err());
        assert!(
            FP8_DEQ_TILES
                .grid(1 << 40, 1 << 20, ColsTile::Short)
                .is_err()
        );
        assert!(
            NVFP4_DEQ_TILES
                .grid(1 << 41, 1 << 20, ColsTile::Tall)
                .is_err()
        );
        let e = dequant_units_grid(1 << 45).unwrap_err();
        assert!(matches!(e, Error::Shape { .. }), "{e}");
        assert!(e.to_string().contains("exceed the launch grid"), "{e}");
    }

    #[test]
    fn columnwise_dequantizers_take_the_tall_tile_once_it_fills_the_card() {
        // The shapes measured on a 132-SM H100 ([m, k] of the output), each on the side
        // that ran faster there.
        let h100 = 132;
        for (m, k, fp8, nvfp4) in [
            (2048, 4096, ColsTile::Short, ColsTile::Short),
            (4096, 4096, ColsTile::Tall, ColsTile::Short),
            (4096, 8192, ColsTile::Tall, ColsTile::Tall),
            (8192, 4096, ColsTile::Tall, ColsTile::Tall),
            (16384, 8192, ColsTile::Tall, ColsTile::Tall),
            (32768, 8192, ColsTile::Tall, ColsTile::Tall),
        ] {
            assert_eq!(FP8_DEQ_TILES.pick(m, k, h100), fp8, "fp8 [{m}, {k}]");
            assert_eq!(NVFP4_DEQ_TILES.pick(m, k, h100), nvfp4, "nvfp4 [{m}, {k}]");
        }
        // More SMs need more CTAs; empty and tiny tensors take the short tile.
        assert_eq!(FP8_DEQ_TILES.pick(4096, 4096, 160), ColsTile::Short);
        assert_eq!(FP8_DEQ_TILES.pick(0, 0, h100), ColsTile::Short);
        assert_eq!(NVFP4_DEQ_TILES.pick(16, 16, h100), ColsTile::Short);
        // No overflow at the extremes.
        assert_eq!(
            FP8_DEQ_TILES.pick(usize::MAX, usize::MAX, usize::MAX),
            ColsTile::Tall
        );
        assert_eq!(ColsTile::Short.infix(), "t_");
        assert_eq!(ColsTile::Tall.infix(), "t_tall_");
    }

    #[test]
    fn tile_grid_launches_one_cta_per_tile_on_a_1d_grid() {
        let cfg = tile_grid("test", 16384, 8192, 128, 128).unwrap();
        assert_eq!(cfg.grid_dim, (128 * 64, 1, 1));
        assert_eq!(cfg.block_dim, (BLOCK, 1, 1));
        // Ragged edges round up; an empty matrix still launches one CTA.
        assert_eq!(
            tile_grid("test", 65, 257, 64, 256).unwrap().grid_dim,
            (2 * 2, 1, 1)
        );
        assert_eq!(
            tile_grid("test", 0, 0, 32, 128).unwrap().grid_dim,
            (1, 1, 1)
        );
        // K of more than 65535 tiles is fine now that the grid is 1-D.
        assert_eq!(
            tile_grid("test", 32, 128 * 70_000, 32, 128)
                .unwrap()
                .grid_dim,
            (70_000, 1, 1)
        );
    }

    #[test]
    fn banded_grid_covers_bands_of_a_power_of_two_tile_rows() {
        // 128 x 64 tiles: 16 bands of 8 tile rows.
        let cfg = banded_grid("test", 16384, 8192, 128).unwrap();
        assert_eq!(cfg.grid_dim, (8 * 64, 16, 1));
        assert_eq!(cfg.block_dim, (BLOCK, 1, 1));
        // 33 tile rows: a fifth band of 8 with one tile row in the matrix.
        assert_eq!(
            banded_grid("test", 33 * 128, 128, 128).unwrap().grid_dim,
            (8, 5, 1)
        );
        // 3 tile rows: one band of 4 (the least power of two), ragged columns round up.
        assert_eq!(
            banded_grid("test", 3 * 128 - 16, 129, 128)
                .unwrap()
                .grid_dim,
            (4 * 2, 1, 1)
        );
        // One tile row, and an empty matrix: bands of one.
        assert_eq!(
            banded_grid("test", 16, 1024, 128).unwrap().grid_dim,
            (8, 1, 1)
        );
        assert_eq!(banded_grid("test", 0, 0, 128).unwrap().grid_dim, (1, 1, 1));
    }

    #[test]
    fn padded_banded_grid_is_whole_clusters_of_8x2_tiles() {
        // 128 x 64 tiles: as the banded grid.
        let cfg = banded_grid_padded("test", 16384, 8192, 128).unwrap();
        assert_eq!(cfg.grid_dim, (8 * 64, 16, 1));
        // 33 x 65 tiles: 5 bands of 8 tile rows, 66 tile columns.
        assert_eq!(
            banded_grid_padded("test", 33 * 128 - 16, 64 * 128 + 16, 128)
                .unwrap()
                .grid_dim,
            (8 * 66, 5, 1)
        );
        // Fewer than 8 tile rows still take bands of 8; an empty matrix one cluster.
        assert_eq!(
            banded_grid_padded("test", 3 * 128, 128, 128)
                .unwrap()
                .grid_dim,
            (16, 1, 1)
        );
        assert_eq!(
            banded_grid_padded("test", 0, 0, 128).unwrap().grid_dim,
            (16, 1, 1)
        );
        for (m, k) in [(16, 16), (5000, 3000), (1 << 20, 1 << 12)] {
            let cfg = banded_grid_padded("test", m, k, 128).unwrap();
            let (x, y) = (cfg.grid_dim.0 as usize, cfg.grid_dim.1 as usize);
            assert_eq!(x % 16, 0, "[{m}, {k}]");
            assert!(x / 8 * 128 >= k && y * 8 * 128 >= m, "[{m}, {k}] {x} x {y}");
            assert!((x / 8 - 2) * 128 < k.max(1) && (y - 1) * 8 * 128 < m.max(1));
        }
        // The limits are the banded grid's.
        let err = banded_grid_padded("test", 128 * 8 * 65536, 128, 128).unwrap_err();
        assert!(err.to_string().contains("65536 bands"), "{err}");
    }

    #[test]
    fn banded_grid_refuses_what_a_launch_cannot_hold() {
        // 65536 bands of 8 tile rows of 128.
        let err = banded_grid("test", 128 * 8 * 65536, 128, 128).unwrap_err();
        assert!(err.to_string().contains("65536 bands"), "{err}");
        // A band of 8 x 2^28 tiles.
        let err = banded_grid("test", 128 * 8, 128 << 28, 128).unwrap_err();
        assert!(err.to_string().contains("2147483647"), "{err}");
    }

    #[test]
    fn tile_grid_refuses_more_tiles_than_a_launch_holds() {
        let err = tile_grid("test", 1 << 26, 1 << 20, 32, 128).unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains("[67108864, 1048576]") && msg.contains("2147483647"),
            "{msg}"
        );
    }
}
