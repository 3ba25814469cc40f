//! Sharding the tensors a module saved for backward over the FSDP group: TE's
//! `_fsdp_scatter_tensors` / `_fsdp_gather_tensors`.
//!
//! After a forward, each saved tensor is flattened and split into `N` equal 1-D chunks
//! (the last padded with zeros), and each rank keeps only its chunk — a quantized tensor
//! scatters every one of its [`data_tensors`](tessera_quant::QuantizedTensor::data_tensors).
//! Before the backward, one coalesced all-gather brings the chunks back and each buffer
//! is viewed again with the shape [`fsdp_scatter_tensors`] recorded.
//!
//! The gather rebuilds a tensor from *every rank's* chunk, so this only makes sense for
//! tensors that are the same on every rank of the group: the unsharded (e.g. quantized)
//! weight copies a layer keeps for its backward, which is what TransformerEngine
//! scatters. Each recorded shape carries a checksum of the tensor as it was on this
//! rank; a gathered tensor that differs (the tensor was not replicated) is an error,
//! never silently another rank's data.
//!
//! [`SavedActivations`] wraps both steps and skips them for checkpointed modules, whose
//! activations are recomputed anyway.

use std::collections::BTreeMap;
use std::sync::Arc;

use tessera_checkpoint::{Saver, tensor_checksum};
use tessera_collectives::{
    Collective, MaybeQuantized, ProcessGroup, split_tensor_into_1d_equal_chunks,
};
use tessera_core::{DType, Error, Result, Shape, Tensor};
use tessera_quant::{BufferName, Kind, QuantizedTensor};

/// What scattering left of one saved tensor: this rank's 1-D chunk(s).
#[derive(Debug, Clone)]
pub enum Scattered {
    /// The chunk of a plain tensor.
    Plain(Tensor),
    /// The chunks of every buffer of a quantized tensor, with what is needed to
    /// reassemble it.
    Quantized {
        /// The format.
        kind: Kind,
        /// The logical shape.
        shape: Shape,
        /// The dtype it was quantized from.
        source_dtype: DType,
        /// One chunk per buffer, in [`BufferName`] order.
        chunks: Vec<(BufferName, Tensor)>,
    },
}

impl Scattered {
    /// Bytes this rank holds for the tensor.
    pub fn size_in_bytes(&self) -> usize {
        match self {
            Scattered::Plain(t) => t.size_in_bytes(),
            Scattered::Quantized { chunks, .. } => {
                chunks.iter().map(|(_, t)| t.size_in_bytes()).sum()
            }
        }
    }
}

/// The shape and checksum of one buffer before scattering.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BufferShape {
    /// The buffer's shape.
    pub shape: Shape,
    /// The buffer's dtype.
    pub dtype: DType,
    /// FNV-1a of dtype, shape and bytes on this rank
    /// ([`tensor_checksum`]).
    pub checksum: u64,
}

/// What [`fsdp_scatter_tensors`] records of one saved tensor (TE's `fsdp_shapes` entry),
/// and what [`fsdp_gather_tensors`] needs to rebuild it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SavedShape {
    /// A plain tensor.
    Plain(BufferShape),
    /// A quantized tensor: each buffer, in [`BufferName`] order.
    Quantized(Vec<(BufferName, BufferShape)>),
}

fn buffer_shape(t: &Tensor) -> Result<BufferShape> {
    Ok(BufferShape {
        shape: t.shape().clone(),
        dtype: t.dtype(),
        checksum: tensor_checksum(t)?,
    })
}

/// What [`fsdp_scatter_tensors`] returns: this rank's chunks of each tensor, and the
/// shapes to gather them back with.
pub type ScatteredTensors = (Vec<Option<Scattered>>, Vec<Option<SavedShape>>);

/// Splits each tensor into 1-D chunks over `group` and keeps this rank's; returns the
/// chunks and the shapes to gather them back with. `None` entries stay `None` (as TE's
/// non-tensor arguments). No communication happens.
pub fn fsdp_scatter_tensors(
    group: &dyn ProcessGroup,
    tensors: Vec<Option<MaybeQuantized>>,
) -> Result<ScatteredTensors> {
    let mut chunks = Vec::with_capacity(tensors.len());
    let mut shapes = Vec::with_capacity(tensors.len());
    for t in tensors {
        match t {
            None => {
                chunks.push(None);
                shapes.push(None);
            }
            Some(MaybeQuantized::Plain(t)) => {
                shapes.push(Some(SavedShape::Plain(buffer_shape(&t)?)));
                chunks.push(Some(Scattered::Plain(
                    split_tensor_into_1d_equal_chunks(&t, group)?.chunk,
                )));
            }
            Some(MaybeQuantized::Quantized(q)) => {
                let (kind, shape, source_dtype) = (q.kind(), q.shape().clone(), q.source_dtype());
                let mut s = Vec::new();
                let mut c = Vec::new();
                for (name, t) in q.into_buffers() {
                    s.push((name, buffer_shape(&t)?));
                    c.push((name, split_tensor_into_1d_equal_chunks(&t, group)?.chunk));
                }
                shapes.push(Some(SavedShape::Quantized(s)));
                chunks.push(Some(Scattered::Quantized {
                    kind,
                    shape,
                    source_dtype,
                    chunks: c,
                }));
            }
        }
    }
    Ok((chunks, shapes))
}

/// The chunk length [`split_tensor_into_1d_equal_chunks`] makes for `numel` elements.
fn chunk_len(numel: usize, world: usize) -> usize {
    numel.div_ceil(world.max(1))
}

/// Checks one chunk against its recorded buffer shape.
fn check_chunk(
    op: &'static str,
    i: usize,
    what: &str,
    chunk: &Tensor,
    s: &BufferShape,
    world: usize,
) -> Result<()> {
    let want = chunk_len(s.shape.numel(), world);
    if chunk.dtype() != s.dtype || chunk.shape().dims() != [want] {
        return Err(Error::shape(
            op,
            format!(
                "tensor {i}{what}: the recorded shape {} ({}) needs a 1-D {} chunk of {want} elements over {world} ranks, got {} {}",
                s.shape,
                s.dtype,
                s.dtype,
                chunk.dtype(),
                chunk.shape()
            ),
        ));
    }
    Ok(())
}

/// Gathers every rank's chunks back into whole tensors of the recorded shapes (one
/// coalesced all-gather for all of them).
///
/// `shapes` must be what [`fsdp_scatter_tensors`] returned for these chunks: the same
/// length, `None` where the tensor is `None`, plain for plain and the same buffers for
/// quantized tensors, and chunk lengths that fit the shapes; anything else is an
/// [`Error::Shape`] or [`Error::InvalidArgument`] before any communication. A gathered
/// buffer whose checksum differs from the one recorded on this rank (the tensor was not
/// the same on every rank) is an [`Error::State`].
pub fn fsdp_gather_tensors(
    group: &dyn ProcessGroup,
    shapes: &[Option<SavedShape>],
    tensors: Vec<Option<Scattered>>,
) -> Result<Vec<Option<MaybeQuantized>>> {
    const OP: &str = "fsdp_gather_tensors";
    let world = group.size();
    if shapes.len() != tensors.len() {
        return Err(Error::invalid(
            OP,
            format!(
                "{} recorded shapes for {} tensors; pass the shape list the scatter returned for these tensors",
                shapes.len(),
                tensors.len()
            ),
        ));
    }
    // Validate everything before communicating.
    for (i, (s, t)) in shapes.iter().zip(&tensors).enumerate() {
        match (s, t) {
            (None, None) => {}
            (Some(SavedShape::Plain(b)), Some(Scattered::Plain(c))) => {
                check_chunk(OP, i, "", c, b, world)?;
            }
            (Some(SavedShape::Quantized(bs)), Some(Scattered::Quantized { chunks, .. })) => {
                let names: Vec<BufferName> = bs.iter().map(|(n, _)| *n).collect();
                let have: Vec<BufferName> = chunks.iter().map(|(n, _)| *n).collect();
                if names != have {
                    return Err(Error::invalid(
                        OP,
                        format!(
                            "tensor {i}: recorded buffers {names:?} but the scattered tensor has {have:?}"
                        ),
                    ));
                }
                for ((n, b), (_, c)) in bs.iter().zip(chunks) {
                    check_chunk(OP, i, &format!(" buffer `{n}`"), c, b, world)?;
                }
            }
            (s, t) => {
                let d = |present: bool, quantized: bool| match (present, quantized) {
                    (false, _) => "nothing",
                    (true, false) => "a plain tensor",
                    (true, true) => "a quantized tensor",
                };
                return Err(Error::invalid(
                    OP,
                    format!(
                        "tensor {i}: the shape list records {} but the tensor list holds {}",
                        d(s.is_some(), matches!(s, Some(SavedShape::Quantized(_)))),
                        d(t.is_some(), matches!(t, Some(Scattered::Quantized { .. })))
                    ),
                ));
            }
        }
    }
    let mut ops = Vec::new();
    for t in tensors.iter().flatten() {
        let chunks: Vec<&Tensor> = match t {
            Scattered::Plain(c) => vec![c],
            Scattered::Quantized { chunks, .. } => chunks.iter().map(|(_, c)| c).collect(),
        };
        for c in chunks {
            ops.push(Collective::AllGather {
                input: c.clone(),
                output: Tensor::empty([world * c.numel()], c.dtype(), group.device())?,
            });
        }
    }
    let mut gathered = if ops.is_empty() {
        Vec::new()
    } else {
        group.run(ops)?.into_result()?
    }
    .into_iter();
    let mut rebuild = |b: &BufferShape, what: String| -> Result<Tensor> {
        let all = gathered
            .next()
            .ok_or_else(|| Error::state(OP, "the all-gather returned fewer outputs than issued"))?;
        let elem = all.dtype().size_in_bytes();
        let bytes = all.to_bytes()?;
        let t = Tensor::from_bytes(
            &bytes[..b.shape.numel() * elem],
            b.shape.clone(),
            b.dtype,
            all.device(),
        )?;
        if tensor_checksum(&t)? != b.checksum {
            return Err(Error::state(
                OP,
                format!(
                    "{what} gathered from the ranks' chunks differs from this rank's tensor at the scatter: \
                     activation sharding needs tensors that are the same on every rank of the FSDP group \
                     (e.g. unsharded weight copies), not per-rank activations"
                ),
            ));
        }
        Ok(t)
    };
    let mut out = Vec::with_capacity(tensors.len());
    for (i, (s, t)) in shapes.iter().zip(tensors).enumerate() {
        out.push(match (s, t) {
            (Some(SavedShape::Plain(b)), Some(Scattered::Plain(_))) => {
                Some(MaybeQuantized::Plain(rebuild(b, format!("tensor {i}"))?))
            }
            (
                Some(SavedShape::Quantized(bs)),
                Some(Scattered::Quantized {
                    kind,
                    shape,
                    source_dtype,
                    ..
                }),
            ) => {
                let mut buffers = BTreeMap::new();
                for (n, b) in bs {
                    buffers.insert(*n, rebuild(b, format!("tensor {i} buffer `{n}`"))?);
                }
                Some(MaybeQuantized::Quantized(QuantizedTensor::from_buffers(
                    kind,
                    shape,
                    source_dtype,
                    buffers,
                )?))
            }
            _ => None,
        });
    }
    Ok(out)
}

/// The tensors a module keeps for its backward, sharded over the FSDP group or whole.
///
/// [`save`](SavedActivations::save) scatters them (each rank keeps `1/N`) unless the
/// module is checkpointed (its activations are recomputed, so there is nothing to keep)
/// or there is no group (or a group of one); [`restore`](SavedActivations::restore)
/// gathers them back. The tensors must be the same on every rank of the group (see the
/// [module docs](self)).
#[derive(Debug, Clone)]
pub struct SavedActivations {
    group: Option<Arc<dyn ProcessGroup>>,
    state: State,
}

#[derive(Debug, Clone)]
enum State {
    Whole(Vec<Option<MaybeQuantized>>),
    Sharded {
        chunks: Vec<Option<Scattered>>,
        shapes: Vec<Option<SavedShape>>,
    },
}

fn maybe_bytes(t: &MaybeQuantized) -> usize {
    match t {
        MaybeQuantized::Plain(t) => t.size_in_bytes(),
        MaybeQuantized::Quantized(q) => q.size_in_bytes(),
    }
}

impl SavedActivations {
    /// Keeps `tensors` for the backward: this rank's chunks when `group` has more than
    /// one rank and the module is not `checkpointed`, else the whole tensors.
    pub fn save(
        tensors: Vec<Option<MaybeQuantized>>,
        group: Option<&Arc<dyn ProcessGroup>>,
        checkpointed: bool,
    ) -> Result<Self> {
        match group {
            Some(g) if !checkpointed && g.size() > 1 => {
                let (chunks, shapes) = fsdp_scatter_tensors(&**g, tensors)?;
                Ok(SavedActivations {
                    group: Some(g.clone()),
                    state: State::Sharded { chunks, shapes },
                })
            }
            _ => Ok(SavedActivations {
                group: group.cloned(),
                state: State::Whole(tensors),
            }),
        }
    }

    /// [`save`](Self::save) from inside a [`Recompute`](tessera_checkpoint::Recompute)
    /// forward: checkpointed when `saver` says the forward runs under a checkpoint frame.
    pub fn save_for(
        saver: &Saver,
        tensors: Vec<Option<MaybeQuantized>>,
        group: Option<&Arc<dyn ProcessGroup>>,
    ) -> Result<Self> {
        Self::save(tensors, group, saver.is_checkpointed())
    }

    /// Whether the tensors are held as chunks.
    pub fn is_sharded(&self) -> bool {
        matches!(self.state, State::Sharded { .. })
    }

    /// Bytes this rank holds.
    pub fn held_bytes(&self) -> usize {
        match &self.state {
            State::Whole(t) => t.iter().flatten().map(maybe_bytes).sum(),
            State::Sharded { chunks, .. } => {
                chunks.iter().flatten().map(Scattered::size_in_bytes).sum()
            }
        }
    }

    /// The whole tensors again (gathered from every rank when sharded: a collective that
    /// every rank of the group must call in the same order).
    pub fn restore(self) -> Result<Vec<Option<MaybeQuantized>>> {
        match self.state {
            State::Whole(t) => Ok(t),
            State::Sharded { chunks, shapes } => {
                let g = self.group.ok_or_else(|| {
                    Error::state(
                        "SavedActivations::restore",
                        "sharded tensors without a group",
                    )
                })?;
                fsdp_gather_tensors(&*g, &shapes, chunks)
            }
        }
    }
}
