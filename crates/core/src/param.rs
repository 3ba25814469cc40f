//! Parameters: a tensor plus the tensor-parallel attributes that say how it is split.

use crate::{Error, Result, Tensor};

/// How a parameter is split across the tensor-parallel group (Megatron's
/// `tensor_model_parallel`, `partition_dim` and `partition_stride` attributes).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TpAttributes {
    /// Whether the parameter is split at all (`false` for replicated parameters).
    pub is_parallel: bool,
    /// The dimension along which each rank holds a slice.
    pub partition_dim: usize,
    /// The number of interleaved partitions per rank along `partition_dim` (1 for a
    /// plain contiguous split).
    pub stride: usize,
}

/// A trainable tensor and its tensor-parallel attributes, which may be set once.
#[derive(Debug, Clone)]
pub struct Parameter {
    tensor: Tensor,
    tp: Option<TpAttributes>,
}

impl Parameter {
    /// A parameter with no tensor-parallel attributes yet.
    pub fn new(tensor: Tensor) -> Self {
        Parameter { tensor, tp: None }
    }

    /// The tensor.
    pub fn tensor(&self) -> &Tensor {
        &self.tensor
    }

    /// The tensor, for writing.
    pub fn tensor_mut(&mut self) -> &mut Tensor {
        &mut self.tensor
    }

    /// Consumes the parameter, returning its tensor.
    pub fn into_tensor(self) -> Tensor {
        self.tensor
    }

    /// The tensor-parallel attributes, if set.
    pub fn tp_attributes(&self) -> Option<TpAttributes> {
        self.tp
    }

    /// Records how the parameter is split. Setting them a second time is an error (as
    /// Megatron's `set_tensor_model_parallel_attributes` asserts), and so is a
    /// `partition_dim` beyond the tensor's rank or a zero `stride`.
    pub fn set_tp_attributes(&mut self, attrs: TpAttributes) -> Result<()> {
        const OP: &str = "Parameter::set_tp_attributes";
        if let Some(old) = self.tp {
            return Err(Error::state(
                OP,
                format!(
                    "tensor-parallel attributes are already set ({old:?}); they can be set once"
                ),
            ));
        }
        let rank = self.tensor.shape().rank();
        if attrs.partition_dim >= rank {
            return Err(Error::invalid(
                OP,
                format!(
                    "partition_dim {} is out of range for a rank-{rank} parameter of shape {}",
                    attrs.partition_dim,
                    self.tensor.shape()
                ),
            ));
        }
        if attrs.stride == 0 {
            return Err(Error::invalid(OP, "stride must be at least 1"));
        }
        self.tp = Some(attrs);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{DType, Device};

    #[test]
    fn attributes_are_set_once_and_validated() {
        let t = Tensor::zeros([4, 8], DType::F32, Device::Cpu).unwrap();
        let mut p = Parameter::new(t);
        let attrs = TpAttributes {
            is_parallel: true,
            partition_dim: 1,
            stride: 1,
        };
        let bad = TpAttributes {
            partition_dim: 2,
            ..attrs
        };
        assert!(
            p.set_tp_attributes(bad)
                .unwrap_err()
                .to_string()
                .contains("out of range")
        );
        let zero = TpAttributes { stride: 0, ..attrs };
        assert!(
            p.set_tp_attributes(zero)
                .unwrap_err()
                .to_string()
                .contains("stride")
        );
        p.set_tp_attributes(attrs).unwrap();
        assert_eq!(p.tp_attributes(), Some(attrs));
        let err = p.set_tp_attributes(attrs).unwrap_err();
        assert!(err.to_string().contains("already set"), "{err}");
    }
}
