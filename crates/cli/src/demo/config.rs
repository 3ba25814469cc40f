//! The demo's options, checked, and the recipe each `--format` stands for: how every GEMM
//! operand is quantized, what the sequence-parallel and FSDP gathers carry.

use std::sync::Arc;

use tessera_checkpoint::Mode;
use tessera_core::{DType, Device, Replay, Result, Shape, Tensor};
use tessera_fsdp::{FsdpConfig, WeightFormat};
use tessera_quant::{
    AmaxReduction, Fp8DelayedScaling, Fp8Format, QuantizedTensor, Quantizer, Usage,
};

use super::DemoError;
use super::ops;
use crate::args::{Backend, CheckpointArg, DemoArgs, DemoFault, DemoFormat, ReferenceSums};

/// Amax history length of the delayed-scaling recipe (TE's default is 1024; a short
/// history lets the scales follow a 20-step run).
pub(crate) const AMAX_HISTORY: usize = 16;

/// Most thread ranks the demo starts.
pub(crate) const MAX_WORLD: usize = 64;

/// A checked `tessera demo` configuration.
#[derive(Debug, Clone)]
pub struct DemoConfig {
    /// Tensor-parallel ranks.
    pub tp: usize,
    /// Data-parallel ranks.
    pub dp: usize,
    /// Blocks.
    pub layers: usize,
    /// Residual width.
    pub hidden: usize,
    /// MLP hidden width (all tensor-parallel ranks together).
    pub ffn: usize,
    /// Tokens per data-parallel batch.
    pub seq: usize,
    /// Training steps.
    pub steps: usize,
    /// The GEMM recipe.
    pub format: DemoFormat,
    /// Checkpointing of every block.
    pub checkpoint: Mode,
    /// Dropout probability.
    pub dropout: f32,
    /// SGD learning rate.
    pub lr: f32,
    /// Seed of weights, data and RNG streams.
    pub seed: u64,
    /// How the reference adds what tensor parallelism splits.
    pub reference_sums: ReferenceSums,
    /// A deliberate bug, for tests.
    pub fault: Option<DemoFault>,
    /// Thread ranks or one process per GPU.
    pub backend: Backend,
    /// Where the ranks' tensors live: the host for thread ranks; a process rank's GPU
    /// (set from its group when it joins).
    pub device: Device,
}

/// The command-line name of a format.
pub fn format_name(f: DemoFormat) -> &'static str {
    match f {
        DemoFormat::Bf16 => "bf16",
        DemoFormat::Fp8Current => "fp8-current",
        DemoFormat::Fp8Delayed => "fp8-delayed",
        DemoFormat::Mxfp8 => "mxfp8",
        DemoFormat::Nvfp4 => "nvfp4",
        DemoFormat::Fp8Block => "fp8-block",
    }
}

/// One line describing a format's recipe.
pub fn format_recipe(f: DemoFormat) -> &'static str {
    match f {
        DemoFormat::Bf16 => "GEMM inputs rounded to bf16, f32 accumulation, f32 master weights",
        DemoFormat::Fp8Current => {
            "GEMM inputs in FP8 E4M3, one scale per tensor from its amax (the sequence-parallel \
             gather's amax all-reduced over the TP group)"
        }
        DemoFormat::Fp8Delayed => {
            "GEMM inputs in FP8 E4M3, scales from a 16-step amax history all-reduced over \
             every rank after each step"
        }
        DemoFormat::Mxfp8 => "GEMM inputs in MXFP8 E4M3, an E8M0 scale per 1×32 block",
        DemoFormat::Nvfp4 => {
            "GEMM inputs in NVFP4 (E2M1, an E4M3 scale per 1×16 block, a global amax \
             all-reduced over the sequence-parallel gather)"
        }
        DemoFormat::Fp8Block => {
            "GEMM inputs in FP8 E4M3, an f32 power-of-two scale per 1×128 block"
        }
    }
}

impl DemoConfig {
    /// Checks the options: the shapes every rank works on must exist and, for the block
    /// formats, hold whole blocks. Every problem is a usage error.
    pub fn from_args(a: &DemoArgs) -> Result<DemoConfig, DemoError> {
        let (tp, dp) = (a.tp as usize, a.dp as usize);
        let hidden = a.hidden as usize;
        let ffn = a.ffn.map_or(4 * hidden, |f| f as usize);
        let seq = a.seq as usize;
        if tp * dp > MAX_WORLD {
            return Err(DemoError::Usage(format!(
                "--tp {tp} × --dp {dp} = {} thread ranks; at most {MAX_WORLD}",
                tp * dp
            )));
        }
        if !seq.is_multiple_of(tp) {
            return Err(DemoError::SeqNotDivisible { seq, tp });
        }
        if !ffn.is_multiple_of(tp) {
            return Err(DemoError::Usage(format!(
                "--ffn {ffn} is not divisible by --tp {tp}: each tensor-parallel rank holds \
                 ffn/tp columns of FC1 and rows of FC2"
            )));
        }
        if !(0.0..1.0).contains(&a.dropout) {
            return Err(DemoError::Usage(format!(
                "--dropout {} must be in [0, 1)",
                a.dropout
            )));
        }
        if !(a.lr.is_finite() && a.lr > 0.0) {
            return Err(DemoError::Usage(format!(
                "--lr {} must be finite and positive",
                a.lr
            )));
        }
        let checkpoint = match a.checkpoint {
            CheckpointArg::None => Mode::Off,
            CheckpointArg::Reentrant => Mode::Reentrant,
            CheckpointArg::NonReentrant => Mode::NonReentrant,
        };
        let cfg = DemoConfig {
            tp,
            dp,
            layers: a.layers as usize,
            hidden,
            ffn,
            seq,
            steps: a.steps as usize,
            format: a.format,
            checkpoint,
            dropout: a.dropout,
            lr: a.lr,
            seed: a.seed,
            reference_sums: a.reference_sums,
            fault: a.inject_fault,
            backend: a.backend,
            device: Device::Cpu,
        };
        cfg.check_operand_shapes()?;
        Ok(cfg)
    }

    /// Thread ranks: `tp · dp`.
    pub fn world(&self) -> usize {
        self.tp * self.dp
    }

    /// Tokens each tensor-parallel rank holds between blocks: `seq / tp`.
    pub fn local_tokens(&self) -> usize {
        self.seq / self.tp
    }

    /// FFN columns per tensor-parallel rank: `ffn / tp`.
    pub fn local_ffn(&self) -> usize {
        self.ffn / self.tp
    }

    /// Tokens trained on per step (every data-parallel batch).
    pub fn tokens_per_step(&self) -> usize {
        self.seq * self.dp
    }

    /// The four GEMM operands a rank quantizes, with their shapes, must be quantizable.
    fn check_operand_shapes(&self) -> Result<(), DemoError> {
        let Some(q) = stateless_quantizer(self.format) else {
            return Ok(());
        };
        let (s, h, fl) = (self.seq, self.hidden, self.local_ffn());
        let operands = [
            ("FC1 input", [s, h], "--seq × --hidden"),
            ("FC1 weight shard", [fl, h], "--ffn/--tp × --hidden"),
            ("FC2 input", [s, fl], "--seq × --ffn/--tp"),
            ("FC2 weight shard", [h, fl], "--hidden × --ffn/--tp"),
        ];
        for (what, shape, from) in operands {
            if let Err(e) = q.check_shape(&Shape::new(shape.to_vec())) {
                return Err(DemoError::NotQuantizable {
                    format: format_name(self.format),
                    what: format!("{what} [{}, {}] ({from})", shape[0], shape[1]),
                    reason: e.to_string(),
                });
            }
        }
        Ok(())
    }

    /// How FSDP gathers this format's GEMM weights: quantized where the format allows
    /// (bf16: in bf16; fp8-delayed: in f32 and cast after the gather with the delayed
    /// scale, which lives in per-block state FSDP's gather does not carry).
    pub fn fsdp_weights_config(&self) -> FsdpConfig {
        match self.format {
            DemoFormat::Fp8Delayed | DemoFormat::Bf16 => self.fsdp_norms_config(),
            f => FsdpConfig::default().weight_format(weight_format(f)),
        }
    }

    /// How FSDP gathers LayerNorm's `γ` and `β`: never quantized (TE keeps them in high
    /// precision; tessera-fsdp's quantized gathers would quantize every parameter whose
    /// shape the format holds, 1-D ones included, so they live in an engine of their
    /// own), in bf16 for the bf16 recipe.
    pub fn fsdp_norms_config(&self) -> FsdpConfig {
        match self.format {
            DemoFormat::Bf16 => FsdpConfig::default().mixed_precision(DType::BF16, DType::F32),
            _ => FsdpConfig::default(),
        }
    }
}

/// The FSDP weight format of a stateless quantized format.
pub(crate) fn weight_format(f: DemoFormat) -> WeightFormat {
    match f {
        DemoFormat::Fp8Current => WeightFormat::Fp8,
        DemoFormat::Mxfp8 => WeightFormat::Mxfp8,
        DemoFormat::Nvfp4 => WeightFormat::Nvfp4,
        DemoFormat::Fp8Block => WeightFormat::Fp8Block,
        DemoFormat::Bf16 | DemoFormat::Fp8Delayed => WeightFormat::HighPrecision,
    }
}

/// The rowwise quantizer of a format whose scales come from the tensor itself — the very
/// quantizer FSDP's weight gathers use, so that activations and weights share one recipe.
/// `None` for bf16 (a rounding) and fp8-delayed (stateful).
pub(crate) fn stateless_quantizer(f: DemoFormat) -> Option<Box<dyn Quantizer>> {
    match f {
        DemoFormat::Bf16 | DemoFormat::Fp8Delayed => None,
        f => weight_format(f).quantizer(),
    }
}

/// The four places a block quantizes a GEMM operand.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Site {
    /// LayerNorm's output, gathered along the sequence.
    Fc1Input,
    /// FC1's weight shard.
    Fc1Weight,
    /// The dropout output (FC2's input, this rank's columns).
    Fc2Input,
    /// FC2's weight shard.
    Fc2Weight,
}

/// A quantized GEMM operand: its values (f32, what the GEMM multiplies) and the bytes
/// that stand for them (what is saved for the backward and sent over the wire).
#[derive(Debug, Clone)]
pub(crate) struct Operand {
    /// The values, `[rows, cols]` f32.
    pub(crate) values: Tensor,
    /// The compact form.
    pub(crate) wire: Wire,
}

/// The compact form of an [`Operand`].
#[derive(Debug, Clone)]
pub(crate) enum Wire {
    /// bf16 values.
    Bf16(Tensor),
    /// A quantized tensor.
    Quantized(QuantizedTensor),
}

impl Wire {
    /// The values back, in f32.
    pub(crate) fn values(&self) -> Result<Tensor> {
        match self {
            Wire::Bf16(t) => ops::to_f32(t),
            Wire::Quantized(q) => q.dequantize(DType::F32),
        }
    }
}

/// The quantizer of one site.
pub(crate) enum SiteQuantizer {
    /// Round to bf16.
    Bf16,
    /// A quantizer whose scales come from the tensor (current scaling, block formats),
    /// and the format it was made for.
    Stateless(DemoFormat, Box<dyn Quantizer>),
    /// FP8 delayed scaling: the scale comes from the amax history.
    Delayed(Box<Fp8DelayedScaling>),
}

impl std::fmt::Debug for SiteQuantizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SiteQuantizer::Bf16 => f.write_str("Bf16"),
            SiteQuantizer::Stateless(_, q) => write!(f, "Stateless({:?})", q.kind()),
            SiteQuantizer::Delayed(d) => write!(f, "Delayed({:?})", d.state()),
        }
    }
}

impl SiteQuantizer {
    /// A copy: the same configuration and (delayed scaling) the same history and scale.
    pub(crate) fn duplicate(&self) -> Result<SiteQuantizer> {
        Ok(match self {
            SiteQuantizer::Bf16 => SiteQuantizer::Bf16,
            SiteQuantizer::Stateless(f, _) => SiteQuantizer::new(*f)?,
            SiteQuantizer::Delayed(d) => SiteQuantizer::Delayed(d.clone()),
        })
    }

    /// The quantizer of `format`.
    pub(crate) fn new(format: DemoFormat) -> Result<SiteQuantizer> {
        Ok(match format {
            DemoFormat::Bf16 => SiteQuantizer::Bf16,
            DemoFormat::Fp8Delayed => SiteQuantizer::Delayed(Box::new(
                Fp8DelayedScaling::new(Fp8Format::E4M3, AMAX_HISTORY)?.with_usage(Usage::Rowwise),
            )),
            f => match stateless_quantizer(f) {
                Some(q) => SiteQuantizer::Stateless(f, q),
                None => SiteQuantizer::Bf16,
            },
        })
    }

    /// Quantizes `x`. A delayed-scaling site records `x`'s amax into its history when
    /// `record` is set.
    pub(crate) fn quantize(&mut self, x: &Tensor, record: bool) -> Result<Operand> {
        let wire = match self {
            SiteQuantizer::Bf16 => Wire::Bf16(ops::to_bf16(x)?),
            SiteQuantizer::Stateless(_, q) => Wire::Quantized(q.quantize(x)?),
            SiteQuantizer::Delayed(d) => {
                d.set_record_amax(record);
                let r = d.quantize(x);
                d.set_record_amax(true);
                Wire::Quantized(r?)
            }
        };
        Ok(Operand {
            values: wire.values()?,
            wire,
        })
    }

    /// Like [`quantize`](Self::quantize) with `reduction` installed for the per-tensor
    /// formats (so every rank of a gather uses one scale).
    pub(crate) fn quantize_reduced(
        &mut self,
        x: &Tensor,
        reduction: Option<Arc<dyn AmaxReduction>>,
        record: bool,
    ) -> Result<Operand> {
        if let (SiteQuantizer::Stateless(_, q), Some(r)) = (&mut *self, reduction) {
            q.set_amax_reduction(Some(r));
            let out = q.quantize(x);
            q.set_amax_reduction(None);
            let wire = Wire::Quantized(out?);
            return Ok(Operand {
                values: wire.values()?,
                wire,
            });
        }
        self.quantize(x, record)
    }

    /// Whether a shard of `shape` can travel quantized in an all-gather (bf16 always can).
    pub(crate) fn is_gatherable(&self, shape: &Shape) -> bool {
        match self {
            SiteQuantizer::Bf16 => true,
            SiteQuantizer::Stateless(_, q) => q.is_quantizable(shape),
            SiteQuantizer::Delayed(d) => d.is_quantizable(shape),
        }
    }

    /// The delayed-scaling state, for replay and the per-step update.
    pub(crate) fn delayed_mut(&mut self) -> Option<&mut Fp8DelayedScaling> {
        match self {
            SiteQuantizer::Delayed(d) => Some(d),
            _ => None,
        }
    }

    /// The delayed-scaling state as a replay state.
    pub(crate) fn replay_state(&mut self) -> Option<&mut dyn Replay> {
        self.delayed_mut().map(|d| d as &mut dyn Replay)
    }

    /// The newest amax a delayed site recorded this step (0 for other sites).
    pub(crate) fn newest_amax(&self) -> f32 {
        match self {
            SiteQuantizer::Delayed(d) => d.state().history()[0],
            _ => 0.0,
        }
    }
}

/// The quantizers of one block, indexed by [`idx`] of their [`Site`].
pub(crate) type LayerSites = [SiteQuantizer; 4];

/// Fresh quantizers for every block.
pub(crate) fn new_sites(cfg: &DemoConfig) -> Result<Vec<LayerSites>> {
    (0..cfg.layers)
        .map(|_| {
            Ok([
                SiteQuantizer::new(cfg.format)?,
                SiteQuantizer::new(cfg.format)?,
                SiteQuantizer::new(cfg.format)?,
                SiteQuantizer::new(cfg.format)?,
            ])
        })
        .collect()
}

/// Index of `site` in a [`LayerSites`] array.
pub(crate) const fn idx(site: Site) -> usize {
    match site {
        Site::Fc1Input => 0,
        Site::Fc1Weight => 1,
        Site::Fc2Input => 2,
        Site::Fc2Weight => 3,
    }
}

/// The end-of-step update of delayed scaling: every site's history rolls with the
/// newest amax `reduced[i]` (already the maximum over every rank).
pub(crate) fn update_delayed(sites: &mut [LayerSites], reduced: &[f32]) {
    for (s, &r) in sites.iter_mut().flatten().zip(reduced) {
        if let Some(d) = s.delayed_mut() {
            d.update(Some(r));
        }
    }
}

/// The newest amaxes of every site, in [`update_delayed`]'s order.
pub(crate) fn newest_amaxes(sites: &[LayerSites]) -> Vec<f32> {
    sites
        .iter()
        .flatten()
        .map(SiteQuantizer::newest_amax)
        .collect()
}
