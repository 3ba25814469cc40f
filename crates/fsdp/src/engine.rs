//! The sharding engine: units of parameters sharded along dim 0, unshard (all-gather,
//! plain or quantized) with prefetch, reshard, gradient reduce-scatter, SGD on shards.

use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tessera_collectives::{
    Collective, MaybeQuantized, ProcessGroup, ReduceOp, ThreadGroup, Work, gather_along_first_dim,
};
use tessera_core::{DType, Device, Error, Result, Shape, Tensor};
use tessera_quant::QuantizedTensor;

use crate::config::{FsdpConfig, GradReduce, ReshardPolicy, WeightFormat};
use crate::lowp::reduce_scatter_low_precision;
use crate::shard::{ShardLayout, cast};

/// How one parameter travels when its unit is unsharded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Wire {
    /// In the parameter dtype.
    HighPrecision,
    /// Quantized shards all-gathered (only the quantized bytes travel).
    Quantized,
    /// In the parameter dtype, then the whole weight quantized on every rank.
    QuantizeAfter,
}

/// One parameter: its layout and this rank's f32 shard (the master copy) and gradient.
#[derive(Debug, Clone)]
pub struct ShardedParam {
    name: String,
    layout: ShardLayout,
    wire: Wire,
    pub(crate) shard: Tensor,
    grad: Option<Tensor>,
}

impl ShardedParam {
    /// The parameter's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// How it is split.
    pub fn layout(&self) -> &ShardLayout {
        &self.layout
    }

    /// How it travels at unshard.
    pub fn wire(&self) -> Wire {
        self.wire
    }

    /// This rank's shard, `[rows_per_rank, ...]` f32, padding rows included (zero).
    pub fn shard(&self) -> &Tensor {
        &self.shard
    }

    /// This rank's gradient shard (f32, averaged over the data-parallel ranks), after a
    /// backward.
    pub fn grad(&self) -> Option<&Tensor> {
        self.grad.as_ref()
    }
}

/// A parameter as the layer computes with it after unshard.
#[derive(Debug, Clone)]
pub struct FullParam {
    /// The full parameter in f32, with the values of the parameter dtype, or of the
    /// quantized format when it was quantized (dequantized).
    pub tensor: Tensor,
    /// The quantized tensor the values came from, when the weight format quantizes: all
    /// `world·rows_per_rank` rows for a quantized gather (the padding rows included), the
    /// parameter's rows when quantized after the gather.
    pub quantized: Option<QuantizedTensor>,
}

impl FullParam {
    /// Bytes held.
    pub fn size_in_bytes(&self) -> usize {
        self.tensor.size_in_bytes()
            + self
                .quantized
                .as_ref()
                .map_or(0, QuantizedTensor::size_in_bytes)
    }

    /// The parameter of `layout` from its quantized copy (as saved for a backward):
    /// dequantized to f32 and trimmed to the parameter's rows.
    pub fn from_quantized(q: QuantizedTensor, layout: &ShardLayout) -> Result<FullParam> {
        let t = q.dequantize(DType::F32)?;
        let tensor = if t.shape() == layout.shape() {
            t
        } else {
            layout.trim(&t)?
        };
        Ok(FullParam {
            tensor,
            quantized: Some(q),
        })
    }
}

enum UnitState {
    Sharded,
    Pending {
        work: Work<Vec<FullParam>>,
        bytes: usize,
    },
    Full {
        params: Vec<FullParam>,
        bytes: usize,
    },
}

struct Unit {
    name: String,
    params: Vec<ShardedParam>,
    state: UnitState,
}

/// Per-rank memory of the parameters, in bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MemoryStats {
    /// The f32 shards (padding included).
    pub shard_bytes: usize,
    /// The gradient shards held now.
    pub grad_bytes: usize,
    /// Full (unsharded) parameters held now, in flight included, counted as their f32
    /// compute copies (`numel · 4`; a quantized gather's received bytes are smaller and
    /// transient).
    pub full_bytes: usize,
    /// The most full-parameter bytes held at once since the last reset.
    pub peak_full_bytes: usize,
}

/// Time and counts of the unshards and gradient reductions since the last reset.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GatherStats {
    /// Unshards issued.
    pub unshards: u64,
    /// Of which issued ahead as a prefetch.
    pub prefetches: u64,
    /// Time the calling thread spent issuing unshards (quantizing shards, and on a
    /// backend whose collectives complete at issue, such as `ThreadGroup`, the whole
    /// exchange).
    pub issue_time: Duration,
    /// Time the calling thread spent waiting for issued unshards to complete (including
    /// their post-processing: dequantizing, trimming).
    pub wait_time: Duration,
    /// Time spent in gradient reductions.
    pub reduce_time: Duration,
}

impl GatherStats {
    /// `issue_time + wait_time`: the gather time the computation was blocked by.
    pub fn blocked_time(&self) -> Duration {
        self.issue_time + self.wait_time
    }
}

/// The FSDP engine of one rank: units of parameters (one per layer) sharded along dim 0
/// over a group, gathered before use and freed after, gradients reduce-scattered back.
///
/// The training loop calls, per unit `u`, [`forward_pre`](Self::forward_pre) (returns the
/// full parameters and prefetches `u + 1`), computes, [`forward_post`](Self::forward_post)
/// (reshards per policy); then in reverse [`backward_pre`](Self::backward_pre)
/// (prefetches `u − 1`), computes gradients, [`backward_post`](Self::backward_post)
/// (reduce-scatters them, reshards); then [`sgd_step`](Self::sgd_step). Every call that
/// communicates is a collective: every rank must make the same calls in the same order.
///
/// With [`hybrid`](Self::hybrid), parameters are sharded within a subgroup and
/// replicated across subgroups: unshards stay within the subgroup; gradients are
/// reduce-scattered within it and then all-reduced across the replicas.
pub struct Fsdp {
    group: Arc<dyn ProcessGroup>,
    replicate: Option<Arc<dyn ProcessGroup>>,
    config: FsdpConfig,
    units: Vec<Unit>,
    peak_full: usize,
    stats: GatherStats,
}

impl fmt::Debug for Fsdp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Fsdp")
            .field("rank", &self.group.rank())
            .field("shard_size", &self.group.size())
            .field("replicas", &self.replicas())
            .field("config", &self.config)
            .field(
                "units",
                &self.units.iter().map(|u| &u.name).collect::<Vec<_>>(),
            )
            .field("memory", &self.memory())
            .finish()
    }
}

/// The shard and replicate groups of hybrid sharding.
pub fn hybrid_groups(
    world: &Arc<dyn ProcessGroup>,
    shard_size: usize,
) -> Result<(Arc<dyn ProcessGroup>, Arc<dyn ProcessGroup>)> {
    const OP: &str = "hybrid_groups";
    let n = world.size();
    if shard_size == 0 || !n.is_multiple_of(shard_size) {
        return Err(Error::invalid(
            OP,
            format!("the shard group size {shard_size} must divide the world size {n}"),
        ));
    }
    let replicas = n / shard_size;
    let mut shard = None;
    let mut replicate = None;
    // Every rank creates every subgroup, in the same order.
    for i in 0..replicas {
        let ranks: Vec<usize> = (i * shard_size..(i + 1) * shard_size).collect();
        if let Some(g) = world.new_subgroup(&ranks)? {
            shard = Some(g);
        }
    }
    for j in 0..shard_size {
        let ranks: Vec<usize> = (0..replicas).map(|i| i * shard_size + j).collect();
        if let Some(g) = world.new_subgroup(&ranks)? {
            replicate = Some(g);
        }
    }
    match (shard, replicate) {
        (Some(s), Some(r)) => Ok((s, r)),
        _ => Err(Error::state(
            OP,
            "this rank is in no shard or replicate group",
        )),
    }
}

/// The shard and replicate groups of hybrid sharding for `world` thread ranks, made
/// directly as [`ThreadGroup`]s (index = world rank `i·shard_size + j`: rank `j` of shard
/// group `i`, rank `i` of replicate group `j`). Move each pair into its rank's thread and
/// pass it to [`Fsdp::with_groups`].
pub fn thread_hybrid_groups(
    world: usize,
    shard_size: usize,
) -> Result<Vec<(ThreadGroup, ThreadGroup)>> {
    if shard_size == 0 || world == 0 || !world.is_multiple_of(shard_size) {
        return Err(Error::invalid(
            "thread_hybrid_groups",
            format!("the shard group size {shard_size} must divide the world size {world}"),
        ));
    }
    let replicas = world / shard_size;
    let mut shards = (0..replicas)
        .map(|_| {
            Ok(ThreadGroup::new(shard_size)?
                .into_iter()
                .map(Some)
                .collect::<Vec<_>>())
        })
        .collect::<Result<Vec<_>>>()?;
    let mut reps = (0..shard_size)
        .map(|_| {
            Ok(ThreadGroup::new(replicas)?
                .into_iter()
                .map(Some)
                .collect::<Vec<_>>())
        })
        .collect::<Result<Vec<_>>>()?;
    (0..world)
        .map(|r| {
            let (i, j) = (r / shard_size, r % shard_size);
            match (shards[i][j].take(), reps[j][i].take()) {
                (Some(s), Some(p)) => Ok((s, p)),
                _ => Err(Error::state(
                    "thread_hybrid_groups",
                    "a group handle was taken twice",
                )),
            }
        })
        .collect()
}

fn elapsed(t: Instant) -> Duration {
    t.elapsed()
}

impl Fsdp {
    /// An engine sharding over every rank of `group`.
    pub fn new(group: Arc<dyn ProcessGroup>, config: FsdpConfig) -> Result<Fsdp> {
        config.validate()?;
        Ok(Fsdp {
            group,
            replicate: None,
            config,
            units: Vec::new(),
            peak_full: 0,
            stats: GatherStats::default(),
        })
    }

    /// Hybrid sharding: shard over subgroups of `shard_size` consecutive ranks of
    /// `world`, replicate across them (the subgroups come from [`hybrid_groups`]). Every
    /// rank of `world` must call it. [`thread_hybrid_groups`] with
    /// [`with_groups`](Self::with_groups) builds the same groups without collectives.
    pub fn hybrid(
        world: &Arc<dyn ProcessGroup>,
        shard_size: usize,
        config: FsdpConfig,
    ) -> Result<Fsdp> {
        let (shard, replicate) = hybrid_groups(world, shard_size)?;
        Fsdp::with_groups(shard, Some(replicate), config)
    }

    /// Hybrid sharding over groups the caller made: parameters sharded over `shard`,
    /// replicated across `replicate` (the ranks holding the same shard in the other
    /// replicas; `None` for plain FSDP).
    pub fn with_groups(
        shard: Arc<dyn ProcessGroup>,
        replicate: Option<Arc<dyn ProcessGroup>>,
        config: FsdpConfig,
    ) -> Result<Fsdp> {
        let mut f = Fsdp::new(shard, config)?;
        f.replicate = replicate;
        Ok(f)
    }

    /// The configuration.
    pub fn config(&self) -> &FsdpConfig {
        &self.config
    }

    /// The group parameters are sharded over (also the group saved activations are
    /// scattered over).
    pub fn group(&self) -> &Arc<dyn ProcessGroup> {
        &self.group
    }

    /// The group parameters are replicated across (hybrid sharding).
    pub fn replicate_group(&self) -> Option<&Arc<dyn ProcessGroup>> {
        self.replicate.as_ref()
    }

    /// The number of replicas (1 without hybrid sharding).
    pub fn replicas(&self) -> usize {
        self.replicate.as_ref().map_or(1, |g| g.size())
    }

    /// The number of data-parallel ranks gradients are averaged over.
    pub fn data_parallel_size(&self) -> usize {
        self.group.size() * self.replicas()
    }

    /// Adds a unit (a layer) whose parameters are given whole — the same values on every
    /// rank, on any device — keeping this rank's f32 shards on the group's device.
    /// Returns its index. Names must be unique.
    pub fn add_unit(&mut self, name: &str, params: Vec<(String, Tensor)>) -> Result<usize> {
        let mut sharded = Vec::with_capacity(params.len());
        for (pname, t) in params {
            let f = cast(&t, DType::F32)?;
            let mut p = self.new_param(pname, f.shape())?;
            p.shard = p
                .layout
                .shard_of(&f, self.group.rank())?
                .to_device(self.group.device())?;
            sharded.push(p);
        }
        self.push_unit(name, sharded)
    }

    /// Adds a unit of parameters with these shapes and zero shards (to be loaded from a
    /// sharded checkpoint). Returns its index.
    pub fn add_unit_shapes(&mut self, name: &str, params: Vec<(String, Shape)>) -> Result<usize> {
        let sharded = params
            .into_iter()
            .map(|(n, s)| self.new_param(n, &s))
            .collect::<Result<Vec<_>>>()?;
        self.push_unit(name, sharded)
    }

    fn push_unit(&mut self, name: &str, params: Vec<ShardedParam>) -> Result<usize> {
        for p in &params {
            let dup = self
                .units
                .iter()
                .flat_map(|u| &u.params)
                .any(|q| q.name == p.name)
                || params.iter().filter(|q| q.name == p.name).count() > 1;
            if dup {
                return Err(Error::Duplicate {
                    what: "FSDP parameter",
                    name: p.name.clone(),
                    detail: String::new(),
                });
            }
        }
        self.units.push(Unit {
            name: name.to_owned(),
            params,
            state: UnitState::Sharded,
        });
        Ok(self.units.len() - 1)
    }

    fn new_param(&self, name: String, shape: &Shape) -> Result<ShardedParam> {
        let world = self.group.size();
        let granule = self.config.row_granule();
        let mut layout = ShardLayout::new(shape, world, granule)?;
        let wire = match self.config.weight_format.quantizer() {
            None => Wire::HighPrecision,
            // Vectors (biases, LayerNorm's gamma and beta) are no GEMM operands: they stay
            // in the parameter dtype, as in TE, where only linear layers' weights are
            // quantized.
            Some(_) if shape.rank() < 2 => {
                layout = ShardLayout::new(shape, world, 1)?;
                Wire::HighPrecision
            }
            Some(q) => {
                let fmt = self.config.weight_format;
                let whole_ok = q.check_shape(shape).is_ok();
                if !self.config.quantize_after_gather
                    && q.is_quantizable(&layout.shard_shape())
                    && q.check_shape(&layout.padded_shape()).is_ok()
                {
                    Wire::Quantized
                } else if whole_ok {
                    if !self.config.quantize_after_gather {
                        tracing::warn!(
                            param = %name, %shape, format = %fmt,
                            "shards cannot travel quantized; gathering in high precision and quantizing after"
                        );
                        // High precision needs no row granule.
                        layout = ShardLayout::new(shape, world, 1)?;
                    }
                    Wire::QuantizeAfter
                } else {
                    tracing::warn!(
                        param = %name, %shape, format = %fmt,
                        "the parameter cannot be quantized in this format; gathering and computing in high precision"
                    );
                    layout = ShardLayout::new(shape, world, 1)?;
                    Wire::HighPrecision
                }
            }
        };
        let shard = Tensor::zeros(layout.shard_shape(), DType::F32, Device::Cpu)?
            .to_device(self.group.device())?;
        Ok(ShardedParam {
            name,
            layout,
            wire,
            shard,
            grad: None,
        })
    }

    /// The number of units.
    pub fn num_units(&self) -> usize {
        self.units.len()
    }

    /// Unit `u`'s name.
    pub fn unit_name(&self, u: usize) -> Result<&str> {
        Ok(&self.unit(u)?.name)
    }

    /// Unit `u`'s parameters.
    pub fn params(&self, u: usize) -> Result<&[ShardedParam]> {
        Ok(&self.unit(u)?.params)
    }

    /// Every parameter, unit by unit.
    pub fn all_params(&self) -> impl Iterator<Item = &ShardedParam> {
        self.units.iter().flat_map(|u| &u.params)
    }

    pub(crate) fn all_params_mut(&mut self) -> impl Iterator<Item = &mut ShardedParam> {
        self.units.iter_mut().flat_map(|u| &mut u.params)
    }

    fn unit(&self, u: usize) -> Result<&Unit> {
        self.units.get(u).ok_or_else(|| {
            Error::invalid(
                "Fsdp",
                format!(
                    "unit {u} does not exist: the engine has {} units",
                    self.units.len()
                ),
            )
        })
    }

    /// Whether unit `u` holds (or is gathering) its full parameters.
    pub fn is_unsharded(&self, u: usize) -> Result<bool> {
        Ok(!matches!(self.unit(u)?.state, UnitState::Sharded))
    }

    /// Per-rank parameter memory.
    pub fn memory(&self) -> MemoryStats {
        let shard_bytes = self.all_params().map(|p| p.shard.size_in_bytes()).sum();
        let grad_bytes = self
            .all_params()
            .filter_map(|p| p.grad.as_ref())
            .map(Tensor::size_in_bytes)
            .sum();
        MemoryStats {
            shard_bytes,
            grad_bytes,
            full_bytes: self.full_bytes(),
            peak_full_bytes: self.peak_full,
        }
    }

    fn full_bytes(&self) -> usize {
        self.units
            .iter()
            .map(|u| match &u.state {
                UnitState::Sharded => 0,
                UnitState::Pending { bytes, .. } | UnitState::Full { bytes, .. } => *bytes,
            })
            .sum()
    }

    /// Gather and reduction statistics.
    pub fn stats(&self) -> GatherStats {
        self.stats
    }

    /// Sets the statistics and the memory peak back to zero (the peak to what is held
    /// now).
    pub fn reset_stats(&mut self) {
        self.stats = GatherStats::default();
        self.peak_full = self.full_bytes();
    }

    /// Issues unit `u`'s unshard (all-gathers its shards) without waiting; a no-op when
    /// it is already unsharded or in flight. A collective.
    pub fn unshard(&mut self, u: usize) -> Result<()> {
        self.issue(u, false)
    }

    fn issue(&mut self, u: usize, prefetch: bool) -> Result<()> {
        if self.is_unsharded(u)? {
            return Ok(());
        }
        let t0 = Instant::now();
        let (work, bytes) = self.issue_gathers(u)?;
        self.stats.issue_time += elapsed(t0);
        self.stats.unshards += 1;
        self.stats.prefetches += u64::from(prefetch);
        self.units[u].state = UnitState::Pending { work, bytes };
        self.peak_full = self.peak_full.max(self.full_bytes());
        Ok(())
    }

    /// The collectives of one unshard, and the bytes its full parameters take.
    fn issue_gathers(&mut self, u: usize) -> Result<(Work<Vec<FullParam>>, usize)> {
        let cfg = self.config;
        let group = self.group.clone();
        let params = &self.units[u].params;
        let mut bytes = 0usize;
        let mut hp_idx = Vec::new();
        let mut hp_ops = Vec::new();
        let mut pieces: Vec<Work<Vec<(usize, FullParam)>>> = Vec::new();
        for (i, p) in params.iter().enumerate() {
            let full_elems = p.layout.shape().numel();
            bytes += full_elems * 4;
            let src = cast(&p.shard, cfg.param_dtype)?;
            match p.wire {
                Wire::Quantized => {
                    let mut q = cfg.weight_format.quantizer().ok_or_else(|| {
                        Error::state("Fsdp::unshard", "a quantized wire without a weight format")
                    })?;
                    let layout = p.layout.clone();
                    let w = gather_along_first_dim(
                        &MaybeQuantized::Plain(src),
                        &group,
                        Some(q.as_mut()),
                    )?;
                    pieces.push(w.then(move |mq| {
                        let fp = match mq {
                            MaybeQuantized::Quantized(q) => FullParam::from_quantized(q, &layout)?,
                            MaybeQuantized::Plain(t) => FullParam {
                                tensor: layout.trim(&cast(&t, DType::F32)?)?,
                                quantized: None,
                            },
                        };
                        Ok(vec![(i, fp)])
                    }));
                }
                Wire::HighPrecision | Wire::QuantizeAfter => {
                    let out =
                        Tensor::empty(p.layout.padded_shape(), cfg.param_dtype, group.device())?;
                    hp_ops.push(Collective::AllGather {
                        input: src,
                        output: out,
                    });
                    hp_idx.push((i, p.layout.clone(), p.wire));
                }
            }
        }
        if !hp_ops.is_empty() {
            let fmt = cfg.weight_format;
            let w = if group.size() == 1 {
                // A group of one: the shard is the whole (padded) parameter.
                Work::done(
                    hp_ops
                        .into_iter()
                        .map(|op| match op {
                            Collective::AllGather { input, .. } => input,
                            other => other.into_output(),
                        })
                        .collect(),
                )
            } else {
                group.run(hp_ops)?
            };
            pieces.push(w.then(move |outs| {
                outs.into_iter()
                    .zip(hp_idx)
                    .map(|(t, (i, layout, wire))| {
                        let fp = match (wire, fmt.quantizer()) {
                            (Wire::QuantizeAfter, Some(mut q)) => {
                                // The whole weight, in the parameter dtype, quantized here.
                                let qt = q.quantize(&layout.trim(&t)?)?;
                                FullParam {
                                    tensor: qt.dequantize(DType::F32)?,
                                    quantized: Some(qt),
                                }
                            }
                            _ => FullParam {
                                tensor: layout.trim(&cast(&t, DType::F32)?)?,
                                quantized: None,
                            },
                        };
                        Ok((i, fp))
                    })
                    .collect()
            }));
        }
        let n = params.len();
        let work = Work::pending(move || {
            let mut out: Vec<Option<FullParam>> = vec![None; n];
            for w in pieces {
                for (i, fp) in w.into_result()? {
                    out[i] = Some(fp);
                }
            }
            out.into_iter()
                .map(|p| {
                    p.ok_or_else(|| Error::state("Fsdp::unshard", "a parameter was not gathered"))
                })
                .collect()
        });
        Ok((work, bytes))
    }

    /// Unit `u`'s full parameters, unsharding it first if needed (waits for an unshard
    /// in flight). A collective when it has to gather.
    pub fn full_params(&mut self, u: usize) -> Result<Vec<FullParam>> {
        self.issue(u, false)?;
        let state = std::mem::replace(&mut self.units[u].state, UnitState::Sharded);
        let (params, bytes) = match state {
            UnitState::Pending { work, bytes } => {
                let t0 = Instant::now();
                let r = work.into_result();
                self.stats.wait_time += elapsed(t0);
                (r?, bytes)
            }
            UnitState::Full { params, bytes } => (params, bytes),
            UnitState::Sharded => unreachable!("issued above"),
        };
        let out = params.clone();
        self.units[u].state = UnitState::Full { params, bytes };
        Ok(out)
    }

    /// Frees unit `u`'s full parameters (an unshard in flight is dropped after it
    /// completes).
    pub fn reshard(&mut self, u: usize) -> Result<()> {
        self.unit(u)?;
        if let UnitState::Pending { work, .. } =
            std::mem::replace(&mut self.units[u].state, UnitState::Sharded)
        {
            // Complete it, so every rank's collectives stay matched, then drop it.
            let t0 = Instant::now();
            let r = work.into_result();
            self.stats.wait_time += elapsed(t0);
            r?;
        }
        Ok(())
    }

    /// Before unit `u`'s forward: its full parameters, with unit `u + 1`'s unshard
    /// issued (when prefetching) before they are returned, so it overlaps `u`'s compute
    /// on a backend with asynchronous collectives.
    pub fn forward_pre(&mut self, u: usize) -> Result<Vec<FullParam>> {
        let params = self.full_params(u)?;
        if self.config.prefetch && u + 1 < self.units.len() {
            self.issue(u + 1, true)?;
        }
        Ok(params)
    }

    /// After unit `u`'s forward: reshards it under [`ReshardPolicy::AfterForward`].
    pub fn forward_post(&mut self, u: usize) -> Result<()> {
        if self.config.reshard == ReshardPolicy::AfterForward {
            self.reshard(u)?;
        }
        Ok(())
    }

    /// Before unit `u`'s backward: its full parameters, with unit `u − 1`'s unshard
    /// issued ahead when prefetching.
    pub fn backward_pre(&mut self, u: usize) -> Result<Vec<FullParam>> {
        let params = self.full_params(u)?;
        if self.config.prefetch && u > 0 {
            self.issue(u - 1, true)?;
        }
        Ok(params)
    }

    /// After unit `u`'s backward: reduce-scatters `grads` (one f32 gradient per
    /// parameter, in the parameter's full shape, from this rank's data) into the
    /// gradient shards — summed over the data-parallel ranks, then divided by their
    /// number, accumulated into gradients already there — and reshards the unit unless
    /// the policy is [`ReshardPolicy::Never`]. A collective.
    pub fn backward_post(&mut self, u: usize, grads: Vec<Tensor>) -> Result<()> {
        self.reduce_gradients(u, grads)?;
        if self.config.reshard != ReshardPolicy::Never {
            self.reshard(u)?;
        }
        Ok(())
    }

    /// The gradient reduction of [`backward_post`](Self::backward_post), without the
    /// reshard.
    pub fn reduce_gradients(&mut self, u: usize, grads: Vec<Tensor>) -> Result<()> {
        const OP: &str = "Fsdp::reduce_gradients";
        let unit = self.unit(u)?;
        if grads.len() != unit.params.len() {
            return Err(Error::invalid(
                OP,
                format!(
                    "unit `{}` has {} parameters but {} gradients were given",
                    unit.name,
                    unit.params.len(),
                    grads.len()
                ),
            ));
        }
        for (p, g) in unit.params.iter().zip(&grads) {
            g.expect_dtype(OP, DType::F32)?;
            if g.shape() != p.layout.shape() {
                return Err(Error::shape(
                    OP,
                    format!(
                        "the gradient of `{}` has shape {}, the parameter {}",
                        p.name,
                        g.shape(),
                        p.layout.shape()
                    ),
                ));
            }
        }
        let t0 = Instant::now();
        let cfg = self.config;
        let group = self.group.clone();
        let padded: Vec<Tensor> = unit
            .params
            .iter()
            .zip(&grads)
            .map(|(p, g)| p.layout.pad(g))
            .collect::<Result<_>>()?;
        let mut reduced: Vec<Tensor> = match cfg.grad_reduce {
            // A group of one: nothing to reduce (the same rounding to the reduce dtype).
            _ if group.size() == 1 => padded
                .iter()
                .map(|g| cast(g, cfg.reduce_dtype))
                .collect::<Result<_>>()?,
            GradReduce::Native => {
                let ops = padded
                    .iter()
                    .zip(&unit.params)
                    .map(|(g, p)| {
                        Ok(Collective::ReduceScatter {
                            input: cast(g, cfg.reduce_dtype)?.to_device(group.device())?,
                            output: Tensor::empty(
                                p.layout.shard_shape(),
                                cfg.reduce_dtype,
                                group.device(),
                            )?,
                            op: ReduceOp::Sum,
                        })
                    })
                    .collect::<Result<Vec<_>>>()?;
                group.run(ops)?.into_result()?
            }
            GradReduce::LowPrecision(f) => padded
                .iter()
                .map(|g| reduce_scatter_low_precision(g, &*group, f))
                .collect::<Result<_>>()?,
        };
        if let Some(rep) = &self.replicate
            && rep.size() > 1
        {
            let ops = reduced
                .into_iter()
                .map(|t| Collective::AllReduce {
                    tensor: t,
                    op: ReduceOp::Sum,
                })
                .collect();
            reduced = rep.run(ops)?.into_result()?;
        }
        let inv = 1.0 / self.data_parallel_size() as f32;
        let unit = &mut self.units[u];
        for (p, r) in unit.params.iter_mut().zip(reduced) {
            let mut g = cast(&r, DType::F32)?.to_device(Device::Cpu)?;
            for v in g.as_mut_slice::<f32>()? {
                *v *= inv;
            }
            p.grad = Some(match p.grad.take() {
                None => g,
                Some(mut acc) => {
                    for (a, b) in acc
                        .as_mut_slice::<f32>()?
                        .iter_mut()
                        .zip(g.as_slice::<f32>()?)
                    {
                        *a += b;
                    }
                    acc
                }
            });
        }
        self.stats.reduce_time += elapsed(t0);
        Ok(())
    }

    /// `shard -= lr · grad` for every parameter with a gradient, then drops the
    /// gradients and every full copy (now stale). An error when no parameter has a
    /// gradient.
    pub fn sgd_step(&mut self, lr: f32) -> Result<()> {
        if self.all_params().all(|p| p.grad.is_none()) {
            return Err(Error::state(
                "Fsdp::sgd_step",
                "no gradients: run a backward first",
            ));
        }
        for p in self.all_params_mut() {
            let Some(g) = p.grad.take() else { continue };
            let device = p.shard.device();
            let mut s = p.shard.to_device(Device::Cpu)?;
            for (w, g) in s
                .as_mut_slice::<f32>()?
                .iter_mut()
                .zip(g.as_slice::<f32>()?)
            {
                *w -= lr * g;
            }
            p.shard = s.to_device(device)?;
        }
        for u in 0..self.units.len() {
            self.reshard(u)?;
        }
        Ok(())
    }

    /// Drops every gradient.
    pub fn zero_grad(&mut self) {
        for p in self.all_params_mut() {
            p.grad = None;
        }
    }

    /// Every parameter whole, in f32 (a high-precision all-gather of every shard,
    /// whatever the weight format): for checks and exports. A collective.
    pub fn gather_full_parameters(&self) -> Result<Vec<(String, Tensor)>> {
        let ops = self
            .all_params()
            .map(|p| {
                Ok(Collective::AllGather {
                    input: p.shard.clone(),
                    output: Tensor::empty(
                        p.layout.padded_shape(),
                        DType::F32,
                        self.group.device(),
                    )?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let outs = if ops.is_empty() {
            Vec::new()
        } else {
            self.group.run(ops)?.into_result()?
        };
        self.all_params()
            .zip(outs)
            .map(|(p, t)| Ok((p.name.clone(), p.layout.trim(&t)?)))
            .collect()
    }

    /// The shapes of unit `u`'s parameters, by name.
    pub fn param_shapes(&self, u: usize) -> Result<Vec<(String, Shape)>> {
        Ok(self
            .unit(u)?
            .params
            .iter()
            .map(|p| (p.name.clone(), p.layout.shape().clone()))
            .collect())
    }

    /// The weight format, for callers that rebuild parameters from quantized copies.
    pub fn weight_format(&self) -> WeightFormat {
        self.config.weight_format
    }
}
