//! How one parameter is split along dim 0 over the ranks of a group.

use tessera_core::{DType, Device, Error, Result, Shape, Tensor};

/// The dim-0 split of one parameter over `world` ranks.
///
/// Rank `r` holds rows `[r·R, min((r+1)·R, rows))` of the parameter, where the rows per
/// rank `R = roundup(ceil(rows / world), granule)`; its shard is always `R` rows, the
/// rows past the end zero (padding). So every shard has the same shape, the
/// concatenation of all shards is the parameter followed by `world·R − rows` zero rows,
/// and a quantized format whose blocks span `granule` rows never has a block straddle
/// two ranks.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ShardLayout {
    shape: Shape,
    world: usize,
    rows_per_rank: usize,
}

impl ShardLayout {
    /// The layout of a parameter of `shape` (rank 1 or more) over `world` ranks with
    /// shards a multiple of `granule` rows.
    pub fn new(shape: &Shape, world: usize, granule: usize) -> Result<Self> {
        const OP: &str = "ShardLayout::new";
        if shape.rank() == 0 {
            return Err(Error::shape(
                OP,
                "a rank-0 parameter cannot be sharded along dim 0; reshape it to [1]",
            ));
        }
        if world == 0 || granule == 0 {
            return Err(Error::invalid(
                OP,
                format!("world size ({world}) and row granule ({granule}) must be positive"),
            ));
        }
        let rows = shape.dims()[0];
        let rows_per_rank = rows.div_ceil(world).div_ceil(granule) * granule;
        Ok(ShardLayout {
            shape: shape.clone(),
            world,
            rows_per_rank,
        })
    }

    /// The parameter's (full, unpadded) shape.
    pub fn shape(&self) -> &Shape {
        &self.shape
    }

    /// The number of ranks.
    pub fn world(&self) -> usize {
        self.world
    }

    /// The rows of the parameter.
    pub fn rows(&self) -> usize {
        self.shape.dims()[0]
    }

    /// The rows of every shard, padding included.
    pub fn rows_per_rank(&self) -> usize {
        self.rows_per_rank
    }

    /// Elements per row.
    pub fn row_numel(&self) -> usize {
        self.shape.dims()[1..].iter().product()
    }

    /// The parameter rows rank `rank` holds (may be empty).
    pub fn valid_rows(&self, rank: usize) -> std::ops::Range<usize> {
        let start = (rank * self.rows_per_rank).min(self.rows());
        let end = (start + self.rows_per_rank).min(self.rows());
        start..end
    }

    /// The shape of every shard: `[R, ...]`.
    pub fn shard_shape(&self) -> Shape {
        self.with_rows(self.rows_per_rank)
    }

    /// The shape of all shards concatenated: `[world·R, ...]`.
    pub fn padded_shape(&self) -> Shape {
        self.with_rows(self.world * self.rows_per_rank)
    }

    fn with_rows(&self, rows: usize) -> Shape {
        let mut d = self.shape.dims().to_vec();
        d[0] = rows;
        Shape::new(d)
    }

    /// Rank `rank`'s shard of the full parameter `full`, in `full`'s dtype.
    pub fn shard_of(&self, full: &Tensor, rank: usize) -> Result<Tensor> {
        self.check_full("ShardLayout::shard_of", full)?;
        let rb = self.row_numel() * full.dtype().size_in_bytes();
        let r = self.valid_rows(rank);
        let bytes = full.to_bytes()?;
        let mut out = vec![0u8; self.rows_per_rank * rb];
        out[..r.len() * rb].copy_from_slice(&bytes[r.start * rb..r.end * rb]);
        Tensor::from_bytes(&out, self.shard_shape(), full.dtype(), full.device())
    }

    /// The full parameter padded to `[world·R, ...]` with zero rows.
    pub fn pad(&self, full: &Tensor) -> Result<Tensor> {
        self.check_full("ShardLayout::pad", full)?;
        let mut bytes = full.to_bytes()?;
        bytes.resize(
            self.padded_shape().numel() * full.dtype().size_in_bytes(),
            0,
        );
        Tensor::from_bytes(&bytes, self.padded_shape(), full.dtype(), full.device())
    }

    /// The first `rows` rows of a padded `[world·R, ...]` tensor, as the parameter's
    /// shape.
    pub fn trim(&self, padded: &Tensor) -> Result<Tensor> {
        if padded.shape() != &self.padded_shape() {
            return Err(Error::shape(
                "ShardLayout::trim",
                format!(
                    "expected the padded shape {}, got {}",
                    self.padded_shape(),
                    padded.shape()
                ),
            ));
        }
        let n = self.shape.numel() * padded.dtype().size_in_bytes();
        let bytes = padded.to_bytes()?;
        Tensor::from_bytes(
            &bytes[..n],
            self.shape.clone(),
            padded.dtype(),
            padded.device(),
        )
    }

    fn check_full(&self, op: &'static str, full: &Tensor) -> Result<()> {
        if full.shape() != &self.shape {
            return Err(Error::shape(
                op,
                format!(
                    "expected the parameter's shape {}, got {}",
                    self.shape,
                    full.shape()
                ),
            ));
        }
        Ok(())
    }
}

/// `t` (f32, bf16 or f16) converted to `dtype` (f32 or bf16, rounded to nearest-even), by
/// way of the host; a cheap clone when it already has it.
pub(crate) fn cast(t: &Tensor, dtype: DType) -> Result<Tensor> {
    if t.dtype() == dtype {
        return Ok(t.clone());
    }
    if !matches!(dtype, DType::F32 | DType::BF16) {
        return Err(Error::dtype("cast", "f32 or bf16", dtype));
    }
    Tensor::from_f32_values(&t.to_f32_vec()?, t.shape(), dtype, Device::Cpu)?.to_device(t.device())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uneven_rows_are_padded_and_tracked() {
        let l = ShardLayout::new(&Shape::from([10, 3]), 4, 1).unwrap();
        assert_eq!(l.rows_per_rank(), 3);
        assert_eq!(l.valid_rows(3), 9..10);
        assert_eq!(l.padded_shape().dims(), &[12, 3]);
        let l = ShardLayout::new(&Shape::from([10, 3]), 8, 1).unwrap();
        assert_eq!((l.valid_rows(4), l.valid_rows(7)), (8..10, 10..10));
        let l = ShardLayout::new(&Shape::from([40, 32]), 4, 32).unwrap();
        assert_eq!(l.rows_per_rank(), 32);
        assert_eq!(l.valid_rows(1), 32..40);
        let v: Vec<f32> = (0..30).map(|i| i as f32).collect();
        let full = Tensor::from_slice(&v, [10, 3], Device::Cpu).unwrap();
        let l = ShardLayout::new(&Shape::from([10, 3]), 4, 1).unwrap();
        let s = l.shard_of(&full, 3).unwrap();
        assert_eq!(
            s.to_vec::<f32>().unwrap(),
            [27.0, 28.0, 29.0, 0., 0., 0., 0., 0., 0.]
        );
        let p = l.pad(&full).unwrap();
        assert_eq!(l.trim(&p).unwrap().to_vec::<f32>().unwrap(), v);
        assert!(ShardLayout::new(&Shape::new([]), 2, 1).is_err());
        assert!(l.trim(&full).is_err());
    }
}
