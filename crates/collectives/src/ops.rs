//! The operations of TransformerEngine's `distributed.py`, on any [`ProcessGroup`].

use std::collections::BTreeMap;
use std::sync::Arc;

use tessera_core::{Error, Result, Shape, Tensor};
use tessera_quant::wire::{self, CopyPlan, Gather, PartLayout, PlanInput};
use tessera_quant::{AmaxReduction, BufferName, QuantizedTensor, Quantizer};

use crate::Work;
use crate::group::{Collective, ProcessGroup, ReduceOp};
use crate::packing;

/// A tensor in high precision or in a quantized format.
#[derive(Debug, Clone)]
pub enum MaybeQuantized {
    /// A plain tensor.
    Plain(Tensor),
    /// A quantized tensor.
    Quantized(QuantizedTensor),
}

impl MaybeQuantized {
    /// The logical shape.
    pub fn shape(&self) -> &Shape {
        match self {
            MaybeQuantized::Plain(t) => t.shape(),
            MaybeQuantized::Quantized(q) => q.shape(),
        }
    }

    /// The plain tensor, or the dequantized values in the source dtype.
    pub fn to_plain(&self) -> Result<Tensor> {
        match self {
            MaybeQuantized::Plain(t) => Ok(t.clone()),
            MaybeQuantized::Quantized(q) => q.dequantize(q.source_dtype()),
        }
    }

    /// The quantized tensor, if it is one.
    pub fn quantized(&self) -> Option<&QuantizedTensor> {
        match self {
            MaybeQuantized::Quantized(q) => Some(q),
            MaybeQuantized::Plain(_) => None,
        }
    }
}

/// An [`AmaxReduction`] that all-reduces (MAX) over a process group: install it on a
/// quantizer so every rank of the group quantizes with the same per-tensor scale.
#[derive(Debug, Clone)]
pub struct GroupAmaxReduction {
    group: Arc<dyn ProcessGroup>,
}

impl GroupAmaxReduction {
    /// The reduction over `group`.
    pub fn new(group: Arc<dyn ProcessGroup>) -> Self {
        GroupAmaxReduction { group }
    }
}

impl AmaxReduction for GroupAmaxReduction {
    fn all_reduce_max(&self, amax: f32) -> Result<f32> {
        let t = Tensor::from_slice(&[amax], [1], self.group.device())?;
        let r = self.group.all_reduce(t, ReduceOp::Max)?.into_result()?;
        Ok(r.to_vec::<f32>()?[0])
    }
}

/// TE's `gather_along_first_dim`: every rank's `input` concatenated along dim 0.
///
/// - Without a quantizer, a plain input is gathered as is and a quantized input in its
///   own format (each buffer as its wire layout says); a quantized input whose shard
///   cannot travel quantized (blocks would straddle ranks) is dequantized and gathered
///   in high precision.
/// - With a quantizer, a plain input is quantized first — with the group's amax
///   all-reduced (MAX) so per-tensor scales agree — and the quantized bytes travel;
///   when the quantizer cannot gather this shape ([`Quantizer::is_quantizable`]) the
///   high-precision tensor is gathered and quantized after (logged through `tracing`).
///   A quantized input lacking a usage the quantizer asks for is requantized.
///
/// Per-tensor metadata (FP8 scale inverse, NVFP4 amax) is gathered too and checked to be
/// equal on every rank, so a gathered tensor's metadata is right by construction, not by
/// assumption. The returned work's post-processing (`swap_first_dims`, re-padding) runs
/// once, at the first wait.
pub fn gather_along_first_dim(
    input: &MaybeQuantized,
    group: &Arc<dyn ProcessGroup>,
    quantizer: Option<&mut dyn Quantizer>,
) -> Result<Work<MaybeQuantized>> {
    let world = group.size();
    let quantized_input: QuantizedTensor = match (input, quantizer) {
        (MaybeQuantized::Plain(t), None) => {
            return Ok(group.all_gather(t)?.then(|t| Ok(MaybeQuantized::Plain(t))));
        }
        (MaybeQuantized::Plain(t), Some(q)) => {
            if world == 1 {
                return Ok(Work::done(MaybeQuantized::Quantized(q.quantize(t)?)));
            }
            if !q.is_quantizable(t.shape()) {
                tracing::warn!(
                    shape = %t.shape(),
                    format = q.kind().name(),
                    "shape cannot be gathered in the quantized format; gathering in high precision and quantizing after"
                );
                let full = group.all_gather(t)?.into_result()?;
                return Ok(Work::done(MaybeQuantized::Quantized(q.quantize(&full)?)));
            }
            let reduction: Arc<dyn AmaxReduction> =
                Arc::new(GroupAmaxReduction::new(group.clone()));
            q.set_amax_reduction(Some(reduction));
            let r = q.quantize(t);
            q.set_amax_reduction(None);
            r?
        }
        (MaybeQuantized::Quantized(qt), Some(q)) => {
            let want = q.usage();
            let have = qt.usage();
            let missing =
                (want.rowwise() && !have.rowwise()) || (want.columnwise() && !have.columnwise());
            if missing || qt.kind() != q.kind() {
                tracing::warn!(
                    have = have.name(),
                    want = want.name(),
                    "the quantized input lacks a usage (or format) the quantizer asks for; requantizing"
                );
                let plain = qt.dequantize(qt.source_dtype())?;
                return gather_along_first_dim(&MaybeQuantized::Plain(plain), group, Some(q));
            }
            qt.clone()
        }
        (MaybeQuantized::Quantized(qt), None) => {
            if world == 1 {
                return Ok(Work::done(input.clone()));
            }
            qt.clone()
        }
    };
    if world == 1 {
        return Ok(Work::done(MaybeQuantized::Quantized(quantized_input)));
    }
    gather_quantized(quantized_input, group)
}

/// The generic quantized gather of [`gather_along_first_dim`], at any world size (it has
/// no world-size-1 shortcut, so it always runs the wire layout's pack and unpack): pack
/// on the device `local` lives on, one coalesced group of all-gathers (the replicated
/// metadata included, to check it), unpack on the group's device in the
/// post-processing. CUDA tensors are packed and unpacked with device copies on the
/// tessera stream ([`packing`]). A shard that cannot travel quantized
/// (blocks would straddle ranks) is dequantized and gathered in high precision.
pub fn gather_quantized(
    local: QuantizedTensor,
    group: &Arc<dyn ProcessGroup>,
) -> Result<Work<MaybeQuantized>> {
    let world = group.size();
    let device = group.device();
    let packed = match packing::pack(&local) {
        Ok(p) => p,
        Err(e) => {
            tracing::warn!(error = %e, "quantized shard cannot travel quantized; gathering dequantized values");
            let plain = local.dequantize(local.source_dtype())?;
            return Ok(group
                .all_gather(&plain.to_device(device)?)?
                .then(|t| Ok(MaybeQuantized::Plain(t))));
        }
    };
    let replicated: Vec<BufferName> = wire::layout(&local)?
        .into_iter()
        .filter(|w| w.gather == Gather::Replicated)
        .map(|w| w.name)
        .collect();
    let mut names = Vec::new();
    let mut ops = Vec::new();
    for (name, t) in packed.into_iter().chain(
        replicated
            .iter()
            .map(|n| (*n, local.buffer(*n).expect("listed").clone())),
    ) {
        let t = t.to_device(device)?;
        let [r, c] = [
            t.shape().dims()[0],
            t.shape().numel() / t.shape().dims()[0].max(1),
        ];
        let output = Tensor::empty([world * r, c], t.dtype(), device)?;
        ops.push(Collective::AllGather {
            input: t.reshape([r, c])?,
            output,
        });
        names.push(name);
    }
    let n_gathered = names.len() - replicated.len();
    let work = group.run(ops)?;
    Ok(work.then(move |outputs| {
        let mut gathered = BTreeMap::new();
        for (i, (name, t)) in names.into_iter().zip(outputs).enumerate() {
            if i < n_gathered {
                gathered.insert(name, t);
            } else {
                // Every rank's copy of the per-tensor metadata must be the same (a few
                // bytes read back; the collective has completed at this point).
                let bytes = t.to_bytes()?;
                let per = bytes.len() / world;
                if let Some(r) = (1..world).find(|&r| bytes[r * per..][..per] != bytes[..per]) {
                    return Err(Error::invalid(
                        "gather_along_first_dim",
                        format!("rank {r}'s `{name}` differs from rank 0's: quantize with an all-reduced amax (or agreed delayed scales) before gathering"),
                    ));
                }
            }
        }
        let out = packing::unpack(&local, world, &gathered)?;
        Ok(MaybeQuantized::Quantized(out.to_device(device)?))
    }))
}

/// [`gather_along_first_dim`] for shards whose first dimensions differ between ranks
/// (beyond TE, which needs equal shards): `rank_d0[r]` is rank `r`'s first dimension,
/// known to every rank (as in sequence parallelism with a ragged last shard, or FSDP
/// with uneven parameter shards).
///
/// Each rank pads its send buffers to the largest rank's size, one coalesced all-gather
/// moves them, and the padding is dropped before the buffers are joined. For quantized
/// gathers every shard's first dimension must cover whole blocks of the format (as for
/// equal shards); otherwise the tensors travel in high precision.
pub fn gather_along_first_dim_uneven(
    input: &MaybeQuantized,
    group: &Arc<dyn ProcessGroup>,
    quantizer: Option<&mut dyn Quantizer>,
    rank_d0: &[usize],
) -> Result<Work<MaybeQuantized>> {
    const OP: &str = "gather_along_first_dim_uneven";
    let (world, rank) = (group.size(), group.rank());
    let d0 = input.shape().dims().first().copied().unwrap_or(1);
    if rank_d0.len() != world || rank_d0[rank] != d0 || input.shape().rank() == 0 {
        return Err(Error::shape(
            OP,
            format!(
                "rank_d0 {rank_d0:?} must list {world} first dimensions, this rank's ({d0}) at index {rank}"
            ),
        ));
    }
    if rank_d0.iter().all(|&d| d == d0) {
        return gather_along_first_dim(input, group, quantizer);
    }
    if rank_d0.contains(&0) {
        return Err(Error::shape(
            OP,
            format!("every rank needs a non-empty shard, got first dimensions {rank_d0:?}"),
        ));
    }
    let shape_of = |d: usize| {
        let mut dims = input.shape().dims().to_vec();
        dims[0] = d;
        Shape::new(dims)
    };
    let local = match (input, quantizer) {
        (MaybeQuantized::Plain(t), None) => return gather_plain_uneven(t, group, rank_d0),
        (MaybeQuantized::Plain(t), Some(q)) => {
            if !rank_d0.iter().all(|&d| q.is_quantizable(&shape_of(d))) {
                tracing::warn!(
                    format = q.kind().name(),
                    "uneven shards cannot be gathered quantized; gathering in high precision"
                );
                let full = gather_plain_uneven(t, group, rank_d0)?
                    .into_result()?
                    .to_plain()?;
                return Ok(Work::done(MaybeQuantized::Quantized(q.quantize(&full)?)));
            }
            let reduction: Arc<dyn AmaxReduction> =
                Arc::new(GroupAmaxReduction::new(group.clone()));
            q.set_amax_reduction(Some(reduction));
            let r = q.quantize(t);
            q.set_amax_reduction(None);
            r?
        }
        (MaybeQuantized::Quantized(qt), _) => qt.clone(),
    };
    let layout = wire::layout(&local)?;
    let packed = packing::pack(&local)?;
    let device = group.device();
    let mut ops = Vec::new();
    let mut plan = Vec::new();
    for (name, t) in &packed {
        let w = layout
            .iter()
            .find(|w| w.name == *name)
            .expect("packed buffers are in the layout");
        // Each rank's valid size scales with its first dimension (every shard covers
        // whole blocks, so the division is exact).
        let per_rank: Vec<[usize; 2]> = rank_d0
            .iter()
            .map(|&d| match w.gather {
                Gather::Rows => [w.valid[0] * d / d0, w.valid[1]],
                _ => [w.valid[0], w.valid[1] * d / d0],
            })
            .collect();
        let max = [
            per_rank.iter().map(|v| v[0]).max().unwrap_or(0),
            per_rank.iter().map(|v| v[1]).max().unwrap_or(0),
        ];
        let t = t.to_device(device)?;
        let pad = wire::pad_plan(*name, t.dtype(), w.valid, max);
        let input = packing::execute(&pad, &[PlanInput::whole(&t)])?;
        let output = Tensor::empty([world * max[0], max[1]], t.dtype(), device)?;
        ops.push(Collective::AllGather { input, output });
        plan.push((*name, t.dtype(), max, per_rank));
    }
    let rank_d0 = rank_d0.to_vec();
    Ok(group.run(ops)?.then(move |outputs| {
        // Rank r's part of buffer `name` is the top-left `per_rank[r]` of its padded
        // `max` block in the gathered output: unpack reads it there, no stripping.
        let gathered: BTreeMap<BufferName, Tensor> =
            plan.iter().map(|(name, ..)| *name).zip(outputs).collect();
        let unpack = wire::unpack_plans(&local, &rank_d0, &mut |r, w| {
            let (_, dtype, max, per_rank) = plan
                .iter()
                .find(|(name, ..)| *name == w.name)
                .ok_or_else(|| Error::state(OP, format!("`{}` was not gathered", w.name)))?;
            Ok(PartLayout {
                input: 0,
                offset: r * max[0] * max[1] * dtype.size_in_bytes(),
                dims: per_rank[r],
                pitch: max[1],
            })
        })?;
        let out = unpack.run(
            &local,
            &|name| {
                gathered
                    .get(&name)
                    .map(|t| vec![PlanInput::whole(t)])
                    .ok_or_else(|| Error::state(OP, format!("`{name}` was not gathered")))
            },
            &packing::execute,
        )?;
        Ok(MaybeQuantized::Quantized(out.to_device(device)?))
    }))
}

/// Plain uneven gather: pad to the largest shard, gather, drop the padding — copy
/// plans run where the tensors live.
fn gather_plain_uneven(
    t: &Tensor,
    group: &Arc<dyn ProcessGroup>,
    rank_d0: &[usize],
) -> Result<Work<MaybeQuantized>> {
    let max = rank_d0.iter().copied().max().unwrap_or(0);
    let d0 = t.shape().dims()[0];
    let row = t.size_in_bytes() / d0.max(1);
    let mut dims = t.shape().dims().to_vec();
    dims[0] = max;
    let mut pad = CopyPlan {
        name: BufferName::Data,
        dtype: t.dtype(),
        shape: Shape::new(dims.clone()),
        zeroed: d0 != max,
        steps: Vec::new(),
    };
    pad.push_strided(0, [0, d0 * row], [0, d0 * row], 1, d0 * row);
    let t = t.to_device(group.device())?;
    let padded = packing::execute(&pad, &[PlanInput::whole(&t)])?;
    let rank_d0 = rank_d0.to_vec();
    Ok(group.all_gather(&padded)?.then(move |all| {
        dims[0] = rank_d0.iter().sum();
        let mut join = CopyPlan {
            name: BufferName::Data,
            dtype: all.dtype(),
            shape: Shape::new(dims),
            zeroed: false,
            steps: Vec::new(),
        };
        let mut at = 0;
        for (r, &d) in rank_d0.iter().enumerate() {
            join.push_strided(0, [r * max * row, d * row], [at, d * row], 1, d * row);
            at += d * row;
        }
        Ok(MaybeQuantized::Plain(packing::execute(
            &join,
            &[PlanInput::whole(&all)],
        )?))
    }))
}

/// TE's `reduce_scatter_along_first_dim`: the sum over ranks, this rank's 1/size of dim 0.
pub fn reduce_scatter_along_first_dim(
    input: &Tensor,
    group: &dyn ProcessGroup,
) -> Result<Work<Tensor>> {
    group.reduce_scatter(input, ReduceOp::Sum)
}

/// TE's `allreduce`: the sum over ranks.
pub fn allreduce(input: &Tensor, group: &dyn ProcessGroup) -> Result<Work<Tensor>> {
    group.all_reduce(input.clone(), ReduceOp::Sum)
}

/// One rank's 1-D chunk of a tensor: TE's `split_tensor_into_1d_equal_chunks`, extended
/// to sizes that do not divide evenly (the last chunks are zero-padded to one chunk
/// length, and the original element count travels with the chunk).
#[derive(Debug, Clone)]
pub struct Chunk1d {
    /// `ceil(numel / size)` elements: this rank's part of the flattened tensor.
    pub chunk: Tensor,
    /// The original shape.
    pub shape: Shape,
}

/// This rank's chunk of `t` flattened, made where `t` lives (a copy plan: a device
/// copy for a CUDA tensor, no host round trip).
pub fn split_tensor_into_1d_equal_chunks(t: &Tensor, group: &dyn ProcessGroup) -> Result<Chunk1d> {
    let (n, size, rank) = (t.numel(), group.size(), group.rank());
    let len = n.div_ceil(size);
    let elem = t.dtype().size_in_bytes();
    let start = (rank * len).min(n);
    let end = ((rank + 1) * len).min(n);
    let mut plan = CopyPlan {
        name: BufferName::Data,
        dtype: t.dtype(),
        shape: Shape::new(vec![len]),
        zeroed: end - start < len,
        steps: Vec::new(),
    };
    let bytes = (end - start) * elem;
    plan.push_strided(0, [start * elem, bytes], [0, bytes], 1, bytes);
    Ok(Chunk1d {
        chunk: packing::execute(&plan, &[PlanInput::whole(t)])?,
        shape: t.shape().clone(),
    })
}

/// TE's `gather_split_1d_tensor`: the full tensor back from every rank's chunk (the
/// padding dropped where the gathered buffer lives).
pub fn gather_split_1d_tensor(c: &Chunk1d, group: &dyn ProcessGroup) -> Result<Work<Tensor>> {
    let shape = c.shape.clone();
    let len = c.chunk.numel();
    if len < shape.numel().div_ceil(group.size().max(1)) || c.chunk.shape().rank() != 1 {
        return Err(Error::shape(
            "gather_split_1d_tensor",
            format!(
                "expected a 1-D chunk of at least ceil({} / {}) elements for shape {shape}, got \
                 shape {}",
                shape.numel(),
                group.size(),
                c.chunk.shape()
            ),
        ));
    }
    Ok(group.all_gather(&c.chunk)?.then(move |all| {
        let bytes = shape.numel() * all.dtype().size_in_bytes();
        let mut plan = CopyPlan {
            name: BufferName::Data,
            dtype: all.dtype(),
            shape,
            zeroed: false,
            steps: Vec::new(),
        };
        plan.push_strided(0, [0, bytes], [0, bytes], 1, bytes);
        packing::execute(&plan, &[PlanInput::whole(&all)])
    }))
}
