//! Tensor shapes.

use std::fmt;

/// The dimensions of a tensor, outermost first (row-major).
///
/// A shape is plain data; it is built from anything that gives `usize`s
/// (`[2, 3]`, `vec![2, 3]`, `&[2, 3][..]`). [`Shape::numel`] saturates at `usize::MAX`
/// instead of overflowing, and every constructor that allocates checks the byte count,
/// so an impossible shape becomes an [`Error::Shape`](crate::Error::Shape), never a
/// wrapped size.
#[derive(Clone, PartialEq, Eq, Hash, Default)]
pub struct Shape(Vec<usize>);

impl Shape {
    /// A shape with these dimensions.
    pub fn new(dims: impl Into<Vec<usize>>) -> Self {
        Shape(dims.into())
    }

    /// The dimensions.
    pub fn dims(&self) -> &[usize] {
        &self.0
    }

    /// The number of dimensions.
    pub fn rank(&self) -> usize {
        self.0.len()
    }

    /// The number of elements (1 for a rank-0 shape), saturating at `usize::MAX`.
    pub fn numel(&self) -> usize {
        self.0
            .iter()
            .try_fold(1usize, |acc, &d| acc.checked_mul(d))
            .unwrap_or(usize::MAX)
    }

    /// Dimension `i`, or an error naming the rank.
    pub fn dim(&self, i: usize) -> crate::Result<usize> {
        self.0.get(i).copied().ok_or_else(|| {
            crate::Error::shape(
                "Shape::dim",
                format!(
                    "dimension {i} requested of a rank-{} shape {self}",
                    self.rank()
                ),
            )
        })
    }

    /// The shape viewed as a matrix `(M, K)`: `K` is the last dimension and `M` the
    /// product of all others (TransformerEngine's `flat_2d_dims`). A rank-0 shape is
    /// `(1, 1)`, a rank-1 shape `[K]` is `(1, K)`.
    pub fn flat_2d(&self) -> (usize, usize) {
        match self.0.split_last() {
            None => (1, 1),
            Some((&k, rest)) => (Shape(rest.to_vec()).numel(), k),
        }
    }
}

impl fmt::Debug for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl fmt::Display for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("[")?;
        for (i, d) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            write!(f, "{d}")?;
        }
        f.write_str("]")
    }
}

impl From<Vec<usize>> for Shape {
    fn from(v: Vec<usize>) -> Self {
        Shape(v)
    }
}

impl From<&[usize]> for Shape {
    fn from(v: &[usize]) -> Self {
        Shape(v.to_vec())
    }
}

impl<const N: usize> From<[usize; N]> for Shape {
    fn from(v: [usize; N]) -> Self {
        Shape(v.to_vec())
    }
}

impl From<&Shape> for Shape {
    fn from(s: &Shape) -> Self {
        s.clone()
    }
}

impl From<usize> for Shape {
    fn from(n: usize) -> Self {
        Shape(vec![n])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numel_and_flat_2d() {
        assert_eq!(Shape::new([]).numel(), 1);
        assert_eq!(Shape::new([]).flat_2d(), (1, 1));
        assert_eq!(Shape::from(7).flat_2d(), (1, 7));
        let s = Shape::from([2, 3, 4]);
        assert_eq!(s.numel(), 24);
        assert_eq!(s.flat_2d(), (6, 4));
        assert_eq!(s.to_string(), "[2, 3, 4]");
        assert_eq!(Shape::from([2, 0, 4]).numel(), 0);
    }

    #[test]
    fn numel_saturates_instead_of_wrapping() {
        assert_eq!(Shape::from([usize::MAX, 2]).numel(), usize::MAX);
    }

    #[test]
    fn dim_out_of_range_is_an_error() {
        let err = Shape::from([2, 3]).dim(2).unwrap_err().to_string();
        assert!(
            err.contains("dimension 2") && err.contains("rank-2"),
            "{err}"
        );
    }
}
