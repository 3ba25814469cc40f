//! The process-group abstraction every collective goes through.

use std::fmt;
use std::sync::Arc;

use tessera_core::{DType, Device, Error, Result, Shape, Tensor};

use crate::Work;

/// How a reduction combines the ranks' values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    /// Sum.
    Sum,
    /// Product.
    Prod,
    /// Maximum (NaN-propagating for floats, as NCCL).
    Max,
    /// Minimum.
    Min,
    /// Sum divided by the group size (floating-point dtypes only).
    Avg,
}

/// One collective of a (possibly coalesced) group of operations.
///
/// Outputs are passed by value: the collective owns them until its [`Work`] completes,
/// and the work's result hands them back in the order of the operations.
#[derive(Debug, Clone)]
pub enum Collective {
    /// `output = concat over ranks of input` along dim 0; `output` is `[size·d0, ...]`.
    AllGather {
        /// This rank's shard.
        input: Tensor,
        /// Receives every rank's shard, rank order.
        output: Tensor,
    },
    /// `output = chunk[rank] of reduce(inputs)` along dim 0; `input` is `[size·d0, ...]`.
    ReduceScatter {
        /// This rank's full-size contribution.
        input: Tensor,
        /// Receives this rank's reduced chunk.
        output: Tensor,
        /// The reduction.
        op: ReduceOp,
    },
    /// `tensor = reduce over ranks of tensor`, in place.
    AllReduce {
        /// Contribution in, result out.
        tensor: Tensor,
        /// The reduction.
        op: ReduceOp,
    },
    /// `tensor = root's tensor` on every rank.
    Broadcast {
        /// Root's data on the root; overwritten elsewhere.
        tensor: Tensor,
        /// The rank whose tensor is sent.
        root: usize,
    },
}

impl Collective {
    /// The operation's name, for messages.
    pub fn name(&self) -> &'static str {
        match self {
            Collective::AllGather { .. } => "all_gather",
            Collective::ReduceScatter { .. } => "reduce_scatter",
            Collective::AllReduce { .. } => "all_reduce",
            Collective::Broadcast { .. } => "broadcast",
        }
    }

    /// The tensor the operation writes.
    pub fn into_output(self) -> Tensor {
        match self {
            Collective::AllGather { output, .. } | Collective::ReduceScatter { output, .. } => {
                output
            }
            Collective::AllReduce { tensor, .. } | Collective::Broadcast { tensor, .. } => tensor,
        }
    }

    /// Checks shapes, dtypes and devices against a group of `size` ranks on `device`.
    pub fn check(&self, size: usize, device: Device) -> Result<()> {
        let op = self.name();
        let on = |t: &Tensor| -> Result<()> {
            if t.device() != device {
                return Err(Error::device(
                    op,
                    format!("{device} (the process group's device)"),
                    t.device(),
                ));
            }
            Ok(())
        };
        let same_dtype = |a: &Tensor, b: &Tensor| -> Result<()> {
            if a.dtype() != b.dtype() {
                return Err(Error::dtype(
                    op,
                    format!("{} (the input's)", a.dtype()),
                    b.dtype(),
                ));
            }
            Ok(())
        };
        match self {
            Collective::AllGather { input, output } => {
                on(input)?;
                on(output)?;
                same_dtype(input, output)?;
                let want = scaled_first_dim(input.shape(), size, op)?;
                if *output.shape() != want && output.numel() != want.numel() {
                    return Err(Error::shape(
                        op,
                        format!(
                            "the output must hold {want} for {size} ranks' {} shards, got {}",
                            input.shape(),
                            output.shape()
                        ),
                    ));
                }
            }
            Collective::ReduceScatter {
                input,
                output,
                op: r,
            } => {
                on(input)?;
                on(output)?;
                same_dtype(input, output)?;
                check_reducible(op, input.dtype(), *r)?;
                let d0 = input.shape().dims().first().copied().unwrap_or(1);
                if size == 0 || d0 % size != 0 {
                    return Err(Error::shape(
                        op,
                        format!(
                            "the input's first dimension {d0} is not divisible by the world size {size}"
                        ),
                    ));
                }
                if output.numel() * size != input.numel() {
                    return Err(Error::shape(
                        op,
                        format!(
                            "the output must hold 1/{size} of the input {}, got {}",
                            input.shape(),
                            output.shape()
                        ),
                    ));
                }
            }
            Collective::AllReduce { tensor, op: r } => {
                on(tensor)?;
                check_reducible(op, tensor.dtype(), *r)?;
            }
            Collective::Broadcast { tensor, root } => {
                on(tensor)?;
                if *root >= size {
                    return Err(Error::invalid(
                        op,
                        format!("root {root} is not a rank of a group of {size}"),
                    ));
                }
            }
        }
        Ok(())
    }
}

/// `shape` with its first dimension multiplied by `size` (rank-0 shapes become `[size]`).
pub(crate) fn scaled_first_dim(shape: &Shape, size: usize, op: &'static str) -> Result<Shape> {
    let mut d = shape.dims().to_vec();
    match d.first_mut() {
        Some(d0) => {
            *d0 = d0
                .checked_mul(size)
                .ok_or_else(|| Error::shape(op, "the gathered shape overflows"))?
        }
        None => d.push(size),
    }
    Ok(Shape::new(d))
}

fn check_reducible(op: &'static str, dtype: DType, r: ReduceOp) -> Result<()> {
    let ok = match dtype {
        DType::F32 | DType::BF16 | DType::F16 => true,
        DType::U8 | DType::U32 | DType::I32 | DType::U64 | DType::I64 => r != ReduceOp::Avg,
        _ => false,
    };
    if ok {
        Ok(())
    } else {
        Err(Error::dtype(
            op,
            format!(
                "a dtype {r:?} can reduce (f32, bf16, f16, or an integer type for Sum/Prod/Max/Min)"
            ),
            dtype,
        ))
    }
}

/// A group of ranks that run collectives together: tessera's seam between algorithms
/// and transports ([`ThreadGroup`](crate::ThreadGroup) for ranks as threads of one
/// process, `NcclGroup` for one process per GPU).
///
/// Every rank of the group must issue the same collectives in the same order with
/// matching shapes and dtypes. Backends implement [`run`](ProcessGroup::run), which
/// executes a list of collectives as one coalesced group (NCCL's `groupStart/End`); the
/// single-operation methods are written on top of it.
pub trait ProcessGroup: Send + Sync + fmt::Debug {
    /// This rank's index, `0..size`.
    fn rank(&self) -> usize;

    /// The number of ranks.
    fn size(&self) -> usize;

    /// Where the group's tensors must live.
    fn device(&self) -> Device;

    /// Runs `ops` as one coalesced group; the work's result holds their output tensors,
    /// in order.
    fn run(&self, ops: Vec<Collective>) -> Result<Work<Vec<Tensor>>>;

    /// Blocks until every rank has reached the barrier.
    fn barrier(&self) -> Result<()>;

    /// A group of the given parent ranks (in that order), for the ranks that are in it,
    /// `None` for the others. Every rank of this group must call it with the same list.
    fn new_subgroup(&self, ranks: &[usize]) -> Result<Option<Arc<dyn ProcessGroup>>>;

    /// Gathers every rank's `input` along dim 0 into a new `[size·d0, ...]` tensor.
    fn all_gather(&self, input: &Tensor) -> Result<Work<Tensor>> {
        let shape = scaled_first_dim(input.shape(), self.size(), "all_gather")?;
        let output = Tensor::empty(shape, input.dtype(), self.device())?;
        self.all_gather_into(input, output)
    }

    /// Gathers every rank's `input` along dim 0 into `output`.
    fn all_gather_into(&self, input: &Tensor, output: Tensor) -> Result<Work<Tensor>> {
        single(self.run(vec![Collective::AllGather {
            input: input.clone(),
            output,
        }])?)
    }

    /// Reduces every rank's `input` and returns this rank's 1/size chunk along dim 0.
    fn reduce_scatter(&self, input: &Tensor, op: ReduceOp) -> Result<Work<Tensor>> {
        let mut d = input.shape().dims().to_vec();
        let size = self.size();
        match d.first_mut() {
            Some(d0) if size > 0 && *d0 % size == 0 => *d0 /= size,
            _ => {
                return Err(Error::shape(
                    "reduce_scatter",
                    format!(
                        "the input's first dimension of {} is not divisible by the world size {size}",
                        input.shape()
                    ),
                ));
            }
        }
        let output = Tensor::empty(d, input.dtype(), self.device())?;
        single(self.run(vec![Collective::ReduceScatter {
            input: input.clone(),
            output,
            op,
        }])?)
    }

    /// Reduces `tensor` over the ranks, returning the result.
    fn all_reduce(&self, tensor: Tensor, op: ReduceOp) -> Result<Work<Tensor>> {
        single(self.run(vec![Collective::AllReduce { tensor, op }])?)
    }

    /// Root's `tensor` on every rank.
    fn broadcast(&self, tensor: Tensor, root: usize) -> Result<Work<Tensor>> {
        single(self.run(vec![Collective::Broadcast { tensor, root }])?)
    }
}

fn single(w: Work<Vec<Tensor>>) -> Result<Work<Tensor>> {
    Ok(w.then(|mut v| Ok(v.remove(0))))
}
