//! FP8 with one scale per tensor: delayed scaling (scale from an amax history) and
//! current scaling (scale from this tensor's amax) — `spec/formats.md` §3.
//!
//! Buffers: `data` (the input shape, FP8 bytes), `scale_inv` (`f32 [1]`, shared by both
//! orientations) and `columnwise_data` (`[K, d0, ..., d_{n-2}]`, the transposed bytes —
//! Hopper needs TN GEMMs, so the transpose exists whenever columnwise usage is asked for).

use std::collections::BTreeMap;
use std::fmt;
use std::sync::{Arc, OnceLock};

use rayon::prelude::*;
use tessera_core::{DType, Device, Error, Replay, Result, Shape, Snapshot, Tensor};

use crate::layout::transpose;
use crate::scale::{compute_scale_from_amax, reciprocal};
use crate::values::{CHUNK, Values, check_input, transposed_shape};
use crate::{
    AmaxReduction, BufferName, BufferSpec, Fp8Format, Kind, QuantizedTensor, Quantizer, Usage,
};

/// `q = sat_rne_fp8(x · scale)` for every element (reference for the CUDA cast).
pub fn cast(x: &[f32], scale: f32, format: Fp8Format) -> Vec<u8> {
    cast_values(&Values::from_f32(x), scale, format)
}

/// [`cast`] of f32, bf16 or f16 values.
fn cast_values(v: &Values<'_>, scale: f32, format: Fp8Format) -> Vec<u8> {
    let mut q = vec![0u8; v.len()];
    q.par_chunks_mut(CHUNK)
        .enumerate()
        .for_each_init(Vec::new, |buf, (i, q)| {
            format.encode_scaled(v.read(i * CHUNK, q.len(), buf), scale, q);
        });
    q
}

/// Buffer layout of a per-tensor FP8 tensor of logical `shape`.
pub(crate) fn buffer_specs(format: Fp8Format, shape: &Shape) -> Vec<BufferSpec> {
    vec![
        BufferSpec {
            name: BufferName::Data,
            dtype: format.dtype(),
            shape: shape.clone(),
        },
        BufferSpec {
            name: BufferName::ScaleInv,
            dtype: DType::F32,
            shape: Shape::new([1]),
        },
        BufferSpec {
            name: BufferName::ColumnwiseData,
            dtype: format.dtype(),
            shape: transposed_shape(shape),
        },
    ]
}

/// Quantizes `x`, whose values are `v`, with `scale`, producing the buffers `usage` asks
/// for.
fn quantize_with_scale(
    x: &Tensor,
    v: &Values<'_>,
    scale: f32,
    format: Fp8Format,
    usage: Usage,
) -> Result<QuantizedTensor> {
    let (m, k) = x.shape().flat_2d();
    let q = cast_values(v, scale, format);
    let mut buffers = BTreeMap::new();
    if usage.columnwise() {
        let t = transpose(&q, m, k);
        buffers.insert(
            BufferName::ColumnwiseData,
            Tensor::from_bytes(&t, transposed_shape(x.shape()), format.dtype(), Device::Cpu)?,
        );
    }
    if usage.rowwise() {
        buffers.insert(
            BufferName::Data,
            Tensor::from_bytes(&q, x.shape(), format.dtype(), Device::Cpu)?,
        );
    }
    buffers.insert(
        BufferName::ScaleInv,
        Tensor::from_slice(&[reciprocal(scale)], [1], Device::Cpu)?,
    );
    Ok(QuantizedTensor {
        kind: Kind::Fp8 { format },
        shape: x.shape().clone(),
        source_dtype: x.dtype(),
        buffers,
    })
}

/// FP8 current scaling (TE's `Float8CurrentScalingQuantizer`): each call computes the
/// tensor's NaN-ignoring amax, optionally all-reduces it (MAX) over a group, and casts
/// with `scale = compute_scale_from_amax(amax)` (`FLT_MAX` for an overflowing scale).
#[derive(Clone)]
pub struct Fp8CurrentScaling {
    format: Fp8Format,
    usage: Usage,
    pow2_scales: bool,
    amax_epsilon: f32,
    reduction: Option<Arc<dyn AmaxReduction>>,
}

impl Fp8CurrentScaling {
    /// TE's defaults: both usages, float32 scales, epsilon 0, no amax reduction.
    pub fn new(format: Fp8Format) -> Self {
        Fp8CurrentScaling {
            format,
            usage: Usage::Both,
            pow2_scales: false,
            amax_epsilon: 0.0,
            reduction: None,
        }
    }

    /// Round scales down to powers of two.
    pub fn with_pow2_scales(mut self, pow2: bool) -> Self {
        self.pow2_scales = pow2;
        self
    }

    /// Floor the amax at `eps` before computing the scale.
    pub fn with_amax_epsilon(mut self, eps: f32) -> Self {
        self.amax_epsilon = eps;
        self
    }

    /// The usages to produce.
    pub fn with_usage(mut self, usage: Usage) -> Self {
        self.usage = usage;
        self
    }

    /// All-reduce (MAX) the amax over a group before computing the scale, so every rank
    /// quantizes with the same scale (needed for sequence-parallel gathers).
    pub fn with_amax_reduction(mut self, reduction: Arc<dyn AmaxReduction>) -> Self {
        self.reduction = Some(reduction);
        self
    }

    /// The scale `x` would be quantized with (after the amax reduction).
    pub fn scale_for(&self, x: &Tensor) -> Result<f32> {
        const OP: &str = "Fp8CurrentScaling::quantize";
        check_input(OP, x)?;
        self.scale_from_amax(Values::new(OP, x)?.amax())
    }

    /// The scale for a tensor with amax `amax` (after the amax reduction).
    fn scale_from_amax(&self, mut amax: f32) -> Result<f32> {
        if let Some(r) = &self.reduction {
            amax = r.all_reduce_max(amax)?;
        }
        Ok(compute_scale_from_amax(
            amax,
            self.format.max(),
            self.pow2_scales,
            self.amax_epsilon,
            f32::MAX,
        ))
    }
}

impl Fp8CurrentScaling {
    /// amax, scale and cast on the device; only an amax reduction reads the amax back.
    #[cfg(feature = "cuda")]
    fn quantize_into_cuda(&self, x: &Tensor, out: &mut QuantizedTensor) -> Result<()> {
        use crate::cuda::fp8 as k;
        check_input("Fp8CurrentScaling::quantize", x)?;
        let amax = k::amax(x)?;
        let scale = match &self.reduction {
            None => {
                let from = k::ScaleFrom::Amax {
                    amax: &amax,
                    pow2: self.pow2_scales,
                    eps: self.amax_epsilon,
                };
                return k::cast_into(x, from, self.format, out, None);
            }
            Some(r) => {
                let a = r.all_reduce_max(amax.to_vec::<f32>()?[0])?;
                let s = compute_scale_from_amax(
                    a,
                    self.format.max(),
                    self.pow2_scales,
                    self.amax_epsilon,
                    f32::MAX,
                );
                Tensor::from_slice(&[s], [1], x.device())?
            }
        };
        k::cast_into(x, k::ScaleFrom::Scale(&scale), self.format, out, None)
    }

    #[cfg(not(feature = "cuda"))]
    fn quantize_into_cuda(&self, _x: &Tensor, _out: &mut QuantizedTensor) -> Result<()> {
        Err(Error::no_cuda_feature("quantizing a CUDA tensor"))
    }
}

impl fmt::Debug for Fp8CurrentScaling {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Fp8CurrentScaling")
            .field("format", &self.format)
            .field("usage", &self.usage)
            .field("pow2_scales", &self.pow2_scales)
            .field("amax_epsilon", &self.amax_epsilon)
            .field("amax_reduction", &self.reduction.is_some())
            .finish()
    }
}

impl Quantizer for Fp8CurrentScaling {
    fn kind(&self) -> Kind {
        Kind::Fp8 {
            format: self.format,
        }
    }
    fn usage(&self) -> Usage {
        self.usage
    }
    fn set_usage(&mut self, usage: Usage) {
        self.usage = usage;
    }
    fn set_amax_reduction(&mut self, reduction: Option<Arc<dyn AmaxReduction>>) {
        self.reduction = reduction;
    }
    fn check_shape(&self, shape: &Shape) -> Result<()> {
        crate::check_rank("Fp8CurrentScaling", shape)
    }
    fn is_quantizable(&self, shape: &Shape) -> bool {
        shape.rank() >= 2
    }
    fn quantize_into(&mut self, x: &Tensor, out: &mut QuantizedTensor) -> Result<()> {
        crate::check_into("Quantizer::quantize_into", &self.kind(), x, out)?;
        if x.device().is_cuda() {
            return self.quantize_into_cuda(x, out);
        }
        let q = self.quantize(x)?;
        out.replace_buffers(q)
    }
    fn quantize(&mut self, x: &Tensor) -> Result<QuantizedTensor> {
        if x.device().is_cuda() {
            return crate::quantize_on_device(self, x);
        }
        const OP: &str = "Fp8CurrentScaling::quantize";
        check_input(OP, x)?;
        // One read of the input for the amax, one for the cast.
        let v = Values::new(OP, x)?;
        let scale = self.scale_from_amax(v.amax())?;
        quantize_with_scale(x, &v, scale, self.format, self.usage)
    }
}

/// How delayed scaling turns the amax history into one amax.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AmaxComputeAlgo {
    /// The maximum over the whole history (TE's default).
    #[default]
    Max,
    /// The newest amax only.
    MostRecent,
}

/// The state of one delayed-scaling quantizer: its amax history (slot 0 collects the
/// amax of the casts since the last update) and its current scale.
#[derive(Debug, Clone, PartialEq)]
pub struct DelayedScalingState {
    history: Vec<f32>,
    scale: f32,
}

impl DelayedScalingState {
    /// History of `len` zeros (TE's default length is 1024) and scale 1.
    pub fn new(len: usize) -> Result<Self> {
        if len == 0 {
            return Err(Error::invalid(
                "DelayedScalingState::new",
                "the amax history needs at least one entry",
            ));
        }
        Ok(DelayedScalingState {
            history: vec![0.0; len],
            scale: 1.0,
        })
    }

    /// The amax history, slot 0 first.
    pub fn history(&self) -> &[f32] {
        &self.history
    }

    /// The current scale.
    pub fn scale(&self) -> f32 {
        self.scale
    }

    /// Records a cast's amax into slot 0 (NaN-ignoring max, as the kernel's atomic max).
    pub fn record_amax(&mut self, amax: f32) {
        self.history[0] = self.history[0].max(amax);
    }

    /// TE's fused amax-and-scale update (`kernel_bulk` in `delayed_scaling.cu`), run
    /// after the amax reduction. `reduced_amax` is the all-reduced newest amax, if any
    /// (0 means "not reduced"):
    ///
    /// 1. `last` = the reduced amax if non-zero, else `history[0]`;
    /// 2. `last == 0`: nothing changes (the history is not rolled);
    /// 3. otherwise `amax` = max of `history[1..]` and `last` (`Max`) or `last`
    ///    (`MostRecent`), and the history rolls left with `last` at the end and slot 0
    ///    cleared;
    /// 4. `scale = fp8_max · 2^-margin / amax` when `amax` is finite and positive
    ///    (`FLT_MAX` if that overflows); otherwise the scale is kept.
    pub fn update(
        &mut self,
        reduced_amax: Option<f32>,
        format: Fp8Format,
        margin: i32,
        algo: AmaxComputeAlgo,
    ) {
        let last = match reduced_amax {
            Some(r) if r != 0.0 => r,
            _ => self.history[0],
        };
        if last == 0.0 {
            return;
        }
        let l = self.history.len();
        let amax = match algo {
            AmaxComputeAlgo::Max => self.history[1..].iter().fold(last, |a, &h| a.max(h)),
            AmaxComputeAlgo::MostRecent => last,
        };
        self.history.rotate_left(1);
        self.history[l - 1] = last;
        self.history[0] = 0.0;
        if amax.is_finite() && amax > 0.0 {
            let s = Self::scaled_max(format, margin) / amax;
            self.scale = if s == f32::INFINITY { f32::MAX } else { s };
        }
    }

    /// `fp8_max · 2^-margin`, the numerator of the update's scale.
    pub(crate) fn scaled_max(format: Fp8Format, margin: i32) -> f32 {
        format.max() * 2f32.powi(-margin)
    }

    /// A state from its parts (`history` non-empty), as read back from a device.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn from_parts(history: Vec<f32>, scale: f32) -> Self {
        debug_assert!(!history.is_empty());
        DelayedScalingState { history, scale }
    }
}

const DELAYED_KIND: &str = "DelayedScalingState";

impl Replay for DelayedScalingState {
    fn snapshot(&self) -> Snapshot {
        Snapshot::new(DELAYED_KIND, self.clone())
    }
    fn restore(&mut self, snapshot: &Snapshot) -> Result<()> {
        *self = snapshot.get::<DelayedScalingState>(DELAYED_KIND)?.clone();
        Ok(())
    }
}

const QUANTIZER_KIND: &str = "Fp8DelayedScaling";

/// What [`Fp8DelayedScaling`]'s snapshot holds: the state where it was.
enum DelayedSnapshot {
    /// The host state and the device buffer of amaxes not yet recorded into it (shared
    /// copy-on-write: the quantizer's later casts write a copy of their own).
    Host {
        state: DelayedScalingState,
        pending: Option<Tensor>,
    },
    /// A device-side copy of the buffers of a state held on a device.
    #[cfg(feature = "cuda")]
    Device(crate::cuda::fp8::DelayedState),
    /// The device copy could not be made; restoring returns this.
    #[cfg(feature = "cuda")]
    Failed(Error),
}

/// The quantizer's history and scale, wherever they are: the snapshot of a state held
/// on a device is a copy queued on that device (TE clones its recompute meta tensors on
/// the device too), so neither taking nor restoring it waits for the device, and
/// restoring writes the quantizer's own buffers in place (graphs captured with them stay
/// valid). Restoring puts the state back where the snapshot found it: a host snapshot
/// leaves a device-held state on the host; a device snapshot moves the state back into
/// the buffers it was copied from. A checkpoint frame registers the quantizer itself:
/// `Recompute::replay_states` returns `&mut quantizer`.
impl Replay for Fp8DelayedScaling {
    fn snapshot(&self) -> Snapshot {
        #[cfg(feature = "cuda")]
        if self.device.resident {
            let held = self.device.held.as_ref().expect("a resident state is held");
            let snap = match held.duplicate() {
                Ok(d) => DelayedSnapshot::Device(d),
                Err(e) => DelayedSnapshot::Failed(e),
            };
            return Snapshot::new(QUANTIZER_KIND, snap);
        }
        Snapshot::new(
            QUANTIZER_KIND,
            DelayedSnapshot::Host {
                state: self.state.clone(),
                pending: self.device.pending.clone(),
            },
        )
    }

    fn restore(&mut self, snapshot: &Snapshot) -> Result<()> {
        match snapshot.get::<DelayedSnapshot>(QUANTIZER_KIND)? {
            #[cfg(feature = "cuda")]
            DelayedSnapshot::Failed(e) => return Err(e.clone()),
            DelayedSnapshot::Host { state, pending } => {
                if state.history().len() != self.state.history().len() {
                    return Err(Error::invalid(
                        "Fp8DelayedScaling::restore",
                        format!(
                            "the snapshot holds a history of {} slots; this quantizer's has {}",
                            state.history().len(),
                            self.state.history().len()
                        ),
                    ));
                }
                self.state = state.clone();
                self.device.pending = pending.clone();
                self.device.resident = false;
            }
            #[cfg(feature = "cuda")]
            DelayedSnapshot::Device(snap) => {
                let Some(held) = self.device.held.as_mut().filter(|h| h.matches(snap)) else {
                    return Err(Error::state(
                        "Fp8DelayedScaling::restore",
                        format!(
                            "the snapshot is of a state held on {}; this quantizer holds no \
                             buffers of that device and history length (restore a snapshot \
                             into the quantizer it was taken from)",
                            snap.device()
                        ),
                    ));
                };
                held.copy_from(snap)?;
                self.device.pending = None;
                self.device.resident = true;
            }
        }
        self.device.observed = OnceLock::new();
        Ok(())
    }
}

/// FP8 delayed scaling (TE's `Float8Quantizer` under the `DelayedScaling` recipe): casts
/// with the scale derived from earlier amaxes, and records this tensor's amax into the
/// history; [`update`](Self::update) then computes the next scale.
///
/// # Where the state lives
///
/// The history and scale start on the host. Casts of CUDA tensors never wait for the
/// device: the scale is uploaded when it changes, and the casts' amaxes collect in a
/// device buffer that is recorded into the history when the state is next looked at
/// ([`state`](Self::state), [`state_mut`](Self::state_mut), [`update`](Self::update),
/// `Debug`). What those show is exactly what recording each amax right after its cast
/// would have shown. An error reading that buffer back (a failed kernel) leaves the
/// history as it was and is returned by the next quantize call of a CUDA tensor.
///
/// [`to_device`](Self::to_device) moves the state onto a device, as TE keeps it: casts
/// there read the scale and max their amaxes into history slot 0 in device memory, and
/// [`update_on_device`](Self::update_on_device) runs the update as one kernel
/// (`update_all_on_device`, feature `cuda`: many quantizers' at once). Nothing
/// then involves the host, so a training step's casts and updates can be captured into
/// a CUDA graph (`tessera_core::cuda::Graph`) and replayed: the state's buffers stay put
/// for the quantizer's life. Across ranks, all-reduce (MAX) slot 0
/// ([`device_amax_mut`](Self::device_amax_mut)) in place before the update, as TE
/// reduces `amax_history[0]`. [`fetch_state`](Self::fetch_state) reads the state back;
/// [`state`](Self::state) does too, once, and keeps what it read until the next call
/// through `&mut self` (a graph replay does not count). [`state_mut`](Self::state_mut),
/// [`update`](Self::update), [`with_scale`](Self::with_scale) and casts of host tensors
/// or on another device bring the state back to the host first.
///
/// Clones are independent: buffers shared with a clone are copied before either writes.
/// A captured graph, though, writes the buffers it was captured with, whichever of the
/// two ends up owning them: clone before capturing, not after.
#[derive(Clone)]
pub struct Fp8DelayedScaling {
    format: Fp8Format,
    usage: Usage,
    margin: i32,
    algo: AmaxComputeAlgo,
    /// The state, without the amaxes still in `device.pending`; stale while the state
    /// is on a device (`device.resident`).
    state: DelayedScalingState,
    record: bool,
    device: DeviceSide,
}

/// What lets a delayed-scaling cast of a CUDA tensor run without a round trip through
/// the host.
#[derive(Clone, Default)]
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
struct DeviceSide {
    /// `f32 [1]` on a device: the NaN-ignoring max of the amaxes of the recording casts
    /// since the history last took them in (the kernels atomically max into it), or
    /// `None` when there were none. Always `None` while the state is on a device.
    pending: Option<Tensor>,
    /// The state with `pending` recorded (or, while the state is on a device, the state
    /// read back), read the first time it is looked at through `&self`; empty whenever
    /// there is nothing to read, and emptied by every call that may change it.
    observed: OnceLock<Observed>,
    /// The scale on a device with its `f32` bits, uploaded when the scale or the device
    /// changes (the host state's copy).
    scale: Option<(u32, Tensor)>,
    /// The buffers of [`Fp8DelayedScaling::to_device`], kept once made so that captured
    /// graphs keep addressing them.
    #[cfg(feature = "cuda")]
    held: Option<crate::cuda::fp8::DelayedState>,
    /// Whether `held` is the state (else the host's `state` is).
    resident: bool,
    /// A failure to read the device back, for the next quantize call of a CUDA tensor
    /// (or the next call that needs the device) to return.
    error: Option<Error>,
}

/// The host state with the device-held amaxes recorded, or the state read back from a
/// device.
#[derive(Clone)]
struct Observed {
    state: DelayedScalingState,
    /// Why the device could not be read (then `state` is the host's state without it).
    error: Option<Error>,
}

impl Observed {
    /// `state` with the amax in `pending` recorded (waits for the device).
    fn read(state: &DelayedScalingState, pending: &Tensor) -> Observed {
        let mut state = state.clone();
        match pending.to_vec::<f32>() {
            Ok(a) => {
                state.record_amax(a[0]);
                Observed { state, error: None }
            }
            Err(e) => Observed {
                state,
                error: Some(e),
            },
        }
    }
}

impl fmt::Debug for Fp8DelayedScaling {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Fp8DelayedScaling")
            .field("format", &self.format)
            .field("usage", &self.usage)
            .field("margin", &self.margin)
            .field("algo", &self.algo)
            .field("state", self.state())
            .field("record", &self.record)
            .finish()
    }
}

impl Fp8DelayedScaling {
    /// TE's recipe defaults: history length `history_len` (TE: 1024), margin 0, `Max`,
    /// both usages, scale 1.
    pub fn new(format: Fp8Format, history_len: usize) -> Result<Self> {
        Ok(Fp8DelayedScaling {
            format,
            usage: Usage::Both,
            margin: 0,
            algo: AmaxComputeAlgo::Max,
            state: DelayedScalingState::new(history_len)?,
            record: true,
            device: DeviceSide::default(),
        })
    }

    /// The margin (scale divided by `2^margin`).
    pub fn with_margin(mut self, margin: i32) -> Self {
        self.margin = margin;
        self
    }

    /// How the history is reduced to one amax.
    pub fn with_algo(mut self, algo: AmaxComputeAlgo) -> Self {
        self.algo = algo;
        self
    }

    /// The usages to produce.
    pub fn with_usage(mut self, usage: Usage) -> Self {
        self.usage = usage;
        self
    }

    /// Starts from a given scale (e.g. restored from a checkpoint). The state comes
    /// back to the host first.
    pub fn with_scale(mut self, scale: f32) -> Result<Self> {
        if !(scale.is_finite() && scale > 0.0) {
            return Err(Error::invalid(
                "Fp8DelayedScaling::with_scale",
                format!("scale {scale} must be finite and positive"),
            ));
        }
        self.settle();
        self.state.scale = scale;
        Ok(self)
    }

    /// The history and scale. After casts of CUDA tensors, or while the state is on a
    /// device, this waits for the device the first time, to read what it holds. A read
    /// error shows the state as the host last knew it, and is returned by the next call
    /// that needs the device.
    pub fn state(&self) -> &DelayedScalingState {
        if let Some(o) = self.device.observed.get() {
            return &o.state;
        }
        match self.read_device() {
            Some(o) => &self.device.observed.get_or_init(|| o).state,
            None => &self.state,
        }
    }

    /// The history and scale as they are now, read from the device (waiting for it)
    /// whenever the device holds any of it: unlike [`state`](Self::state), nothing is
    /// kept, so this also sees what replays of a captured graph did. A failed read is
    /// returned.
    pub fn fetch_state(&self) -> Result<DelayedScalingState> {
        match self.read_device() {
            None => Ok(self.state.clone()),
            Some(Observed { error: Some(e), .. }) => Err(e),
            Some(o) => Ok(o.state),
        }
    }

    /// The state as the device holds it now (waits for the device): the host state with
    /// the pending amaxes recorded, or the whole state read back while it is on a
    /// device; `None` when the device holds none of it.
    fn read_device(&self) -> Option<Observed> {
        match (self.device.resident, &self.device.pending) {
            (true, _) => Some(self.read_held()),
            (false, Some(p)) => Some(Observed::read(&self.state, p)),
            (false, None) => None,
        }
    }

    /// The history and scale, to change by hand. Brings the state back to the host,
    /// recording the amaxes of earlier casts of CUDA tensors first, as
    /// [`state`](Self::state) does (so it waits for the device). For replay, register
    /// the quantizer itself: its snapshots stay where the state is and never wait.
    pub fn state_mut(&mut self) -> &mut DelayedScalingState {
        self.settle();
        &mut self.state
    }

    /// Brings the state to the host: records the device-held amaxes into `state`, or
    /// takes the whole state back from the device (reading it unless `state()` already
    /// did); a read error is kept for the next call that needs the device.
    fn settle(&mut self) {
        let Some(observed) = self.device.observed.take().or_else(|| self.read_device()) else {
            return;
        };
        self.device.resident = false;
        self.device.pending = None;
        self.state = observed.state;
        if let Some(e) = observed.error {
            self.device.error.get_or_insert(e);
        }
    }

    /// What the device-held state reads back as (waits for the device).
    #[cfg(feature = "cuda")]
    fn read_held(&self) -> Observed {
        let held = self.device.held.as_ref().expect("a resident state is held");
        match held.read() {
            Ok(state) => Observed { state, error: None },
            Err(e) => Observed {
                state: self.state.clone(),
                error: Some(e),
            },
        }
    }

    #[cfg(not(feature = "cuda"))]
    fn read_held(&self) -> Observed {
        unreachable!("without the cuda feature the state never leaves the host")
    }

    /// Whether casts record their amax (turned off while recomputing a checkpointed
    /// forward, so the history is not updated twice).
    pub fn set_record_amax(&mut self, record: bool) {
        self.record = record;
    }

    /// Runs the fused update with the newest amax after an optional all-reduce, on the
    /// host (bringing the state back from a device first).
    pub fn update(&mut self, reduced_amax: Option<f32>) {
        self.settle();
        self.state
            .update(reduced_amax, self.format, self.margin, self.algo);
    }

    /// The device holding the state, if [`to_device`](Self::to_device) put it there and
    /// nothing has brought it back.
    pub fn state_device(&self) -> Option<Device> {
        #[cfg(feature = "cuda")]
        if self.device.resident {
            return self.device.held.as_ref().map(|h| h.device());
        }
        None
    }

    /// History slot 0 on the device while the state is there: an `f32 [1]` into which
    /// recording casts max their amaxes. All-reduce it (MAX) in place across a process
    /// group before [`update_on_device`](Self::update_on_device) and the update uses
    /// the group's amax, as [`update`](Self::update) does with `reduced_amax`. `None`
    /// while the state is on the host.
    pub fn device_amax_mut(&mut self) -> Option<&mut Tensor> {
        #[cfg(feature = "cuda")]
        if self.device.resident {
            self.device.observed = OnceLock::new();
            return self.device.held.as_mut().map(|h| &mut h.slot0);
        }
        None
    }
}

#[cfg(feature = "cuda")]
impl Fp8DelayedScaling {
    /// Moves the state onto CUDA `device` (recording any device-held amaxes first):
    /// from now on casts on that device read its scale and record into its history
    /// there, and [`update_on_device`](Self::update_on_device) updates it there. The
    /// buffers are made on the first call and written in place afterwards (the same
    /// history length on the same device), so graphs captured earlier stay valid.
    pub fn to_device(&mut self, device: Device) -> Result<()> {
        const OP: &str = "Fp8DelayedScaling::to_device";
        if !device.is_cuda() {
            return Err(Error::device(OP, "a CUDA device", device));
        }
        if self.state_device() == Some(device) {
            return Ok(());
        }
        self.settle();
        if let Some(e) = self.device.error.take() {
            return Err(e);
        }
        match &mut self.device.held {
            Some(h) if h.device() == device && h.fits(&self.state) => h.write(&self.state)?,
            held => *held = Some(crate::cuda::fp8::DelayedState::upload(&self.state, device)?),
        }
        self.device.resident = true;
        self.device.observed = OnceLock::new();
        Ok(())
    }

    /// Queues [`DelayedScalingState::update`] on the device holding the state (one
    /// kernel; nothing waits and nothing is allocated, so it can be captured into a CUDA
    /// graph). The reduced amax is whatever slot 0 holds: see
    /// [`device_amax_mut`](Self::device_amax_mut). Errors when the state is on the host
    /// ([`to_device`](Self::to_device) first) or when an earlier read of the device
    /// failed.
    pub fn update_on_device(&mut self) -> Result<()> {
        Self::update_all_on_device(&mut [self])
    }

    /// [`update_on_device`](Self::update_on_device) for every quantizer in
    /// `quantizers`, in one kernel launch per 64 of them (TE updates all of a recipe's
    /// histories in one launch too): a model's hundreds of quantizers cost a launch or a
    /// few, and a graph node or a few. Every state must be on the same device; when one
    /// is not, or an earlier read of a device failed, nothing is queued and the error is
    /// returned.
    pub fn update_all_on_device(quantizers: &mut [&mut Fp8DelayedScaling]) -> Result<()> {
        if let Some(i) = quantizers.iter().position(|q| !q.device.resident) {
            return Err(Error::state(
                "Fp8DelayedScaling::update_on_device",
                format!(
                    "the state of quantizer {i} is on the host: move it with `to_device` \
                     first, or update it on the host with `update`"
                ),
            ));
        }
        if let Some(q) = quantizers.iter_mut().find(|q| q.device.error.is_some()) {
            return Err(q.device.error.take().expect("found above"));
        }
        let mut updates: Vec<_> = quantizers
            .iter_mut()
            .map(|q| {
                let q = &mut **q;
                q.device.observed = OnceLock::new();
                crate::cuda::fp8::DelayedUpdate {
                    state: q.device.held.as_mut().expect("a resident state is held"),
                    format: q.format,
                    margin: q.margin,
                    algo: q.algo,
                }
            })
            .collect();
        crate::cuda::fp8::update_all(&mut updates)
    }
}

#[cfg(not(feature = "cuda"))]
impl Fp8DelayedScaling {
    /// Moves the state onto a CUDA device; without the `cuda` feature, an error.
    pub fn to_device(&mut self, device: Device) -> Result<()> {
        let _ = device;
        Err(Error::no_cuda_feature("Fp8DelayedScaling::to_device"))
    }

    /// Updates the device-held state; without the `cuda` feature, an error.
    pub fn update_on_device(&mut self) -> Result<()> {
        Err(Error::no_cuda_feature(
            "Fp8DelayedScaling::update_on_device",
        ))
    }
}

impl Quantizer for Fp8DelayedScaling {
    fn kind(&self) -> Kind {
        Kind::Fp8 {
            format: self.format,
        }
    }
    fn usage(&self) -> Usage {
        self.usage
    }
    fn set_usage(&mut self, usage: Usage) {
        self.usage = usage;
    }
    fn check_shape(&self, shape: &Shape) -> Result<()> {
        crate::check_rank("Fp8DelayedScaling", shape)
    }
    fn is_quantizable(&self, shape: &Shape) -> bool {
        shape.rank() >= 2
    }
    fn quantize_into(&mut self, x: &Tensor, out: &mut QuantizedTensor) -> Result<()> {
        crate::check_into("Quantizer::quantize_into", &self.kind(), x, out)?;
        if x.device().is_cuda() {
            return self.quantize_into_cuda(x, out);
        }
        let q = self.quantize(x)?;
        out.replace_buffers(q)
    }
    fn quantize(&mut self, x: &Tensor) -> Result<QuantizedTensor> {
        if x.device().is_cuda() {
            return crate::quantize_on_device(self, x);
        }
        const OP: &str = "Fp8DelayedScaling::quantize";
        check_input(OP, x)?;
        let v = Values::new(OP, x)?;
        if self.device.resident {
            self.settle();
        }
        let qt = quantize_with_scale(x, &v, self.state.scale, self.format, self.usage)?;
        if self.record {
            self.settle();
            self.state.record_amax(v.amax());
        }
        Ok(qt)
    }
}

impl Fp8DelayedScaling {
    /// The cast on the device, queued without waiting for it. With the state on this
    /// device, it reads the scale there and maxes its amax into slot 0. Otherwise the
    /// scale is uploaded only when it changed, and a recording cast maxes its amax into
    /// the device-held pending amax (recorded into the history when the state is looked
    /// at). The max of the amaxes is the same whether taken per cast on the host or at
    /// once on the device.
    #[cfg(feature = "cuda")]
    fn quantize_into_cuda(&mut self, x: &Tensor, out: &mut QuantizedTensor) -> Result<()> {
        use crate::cuda::fp8 as k;
        check_input("Fp8DelayedScaling::quantize", x)?;
        if let Some(e) = self.device.error.take() {
            return Err(e);
        }
        let device = x.device();
        if self.state_device() == Some(device) {
            let k::DelayedState { slot0, scale, .. } =
                self.device.held.as_mut().expect("a resident state is held");
            if self.record {
                self.device.observed = OnceLock::new();
            }
            let amax = self.record.then_some(slot0);
            return k::cast_into(x, k::ScaleFrom::Scale(scale), self.format, out, amax);
        }
        // The state is on another device, the history took the amaxes in already
        // (`state()`), or they are on another device than this cast's: bring them to
        // the host state before going on.
        let other_device = self
            .device
            .pending
            .as_ref()
            .is_some_and(|p| p.device() != device);
        if self.device.resident || self.device.observed.get().is_some() || other_device {
            self.settle();
            if let Some(e) = self.device.error.take() {
                return Err(e);
            }
        }
        let bits = self.state.scale.to_bits();
        let scale = match &self.device.scale {
            Some((b, t)) if *b == bits && t.device() == device => t,
            _ => {
                let t = Tensor::from_slice(&[self.state.scale], [1], device)?;
                &self.device.scale.insert((bits, t)).1
            }
        };
        let amax = match self.record {
            true => {
                if self.device.pending.is_none() {
                    self.device.pending = Some(Tensor::zeros([1], DType::F32, device)?);
                }
                self.device.pending.as_mut()
            }
            false => None,
        };
        k::cast_into(x, k::ScaleFrom::Scale(scale), self.format, out, amax)
    }

    #[cfg(not(feature = "cuda"))]
    fn quantize_into_cuda(&mut self, _x: &Tensor, _out: &mut QuantizedTensor) -> Result<()> {
        Err(Error::no_cuda_feature("quantizing a CUDA tensor"))
    }
}

/// Dequantized values of the rowwise (`columnwise == false`) or columnwise data, in the
/// logical element order.
pub(crate) fn dequantize(
    qt: &QuantizedTensor,
    format: Fp8Format,
    columnwise: bool,
) -> Result<Vec<f32>> {
    let scale_inv = qt.buffers[&BufferName::ScaleInv].as_slice::<f32>()?[0];
    let (m, k) = qt.shape.flat_2d();
    let name = if columnwise {
        BufferName::ColumnwiseData
    } else {
        BufferName::Data
    };
    let q = qt
        .buffers
        .get(&name)
        .ok_or_else(|| missing(name))?
        .as_bytes()?;
    let v: Vec<f32> = q
        .par_iter()
        .with_min_len(4096)
        .map(|&b| format.decode(b) * scale_inv)
        .collect();
    Ok(if columnwise { transpose(&v, k, m) } else { v })
}

pub(crate) fn missing(name: BufferName) -> Error {
    Error::invalid("dequantize", format!("the tensor has no `{name}` buffer"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn current_scaling_worked_example() {
        // spec §3.5
        let x = Tensor::from_slice(&[1.0f32, -2.5, 0.1, 300.0], [2, 2], Device::Cpu).unwrap();
        let q = Fp8CurrentScaling::new(Fp8Format::E4M3)
            .quantize(&x)
            .unwrap();
        assert_eq!(
            q.buffer(BufferName::Data).unwrap().as_bytes().unwrap(),
            &[0x3C, 0xC7, 0x22, 0x7E]
        );
        assert_eq!(
            q.buffer(BufferName::ColumnwiseData)
                .unwrap()
                .as_bytes()
                .unwrap(),
            &[0x3C, 0x22, 0xC7, 0x7E]
        );
        assert_eq!(
            q.buffer(BufferName::ScaleInv)
                .unwrap()
                .as_slice::<f32>()
                .unwrap()[0]
                .to_bits(),
            0x3F2B_6DB7
        );
        let q = Fp8CurrentScaling::new(Fp8Format::E4M3)
            .with_pow2_scales(true)
            .quantize(&x)
            .unwrap();
        assert_eq!(
            q.buffer(BufferName::Data).unwrap().as_bytes().unwrap(),
            &[0x38, 0xC2, 0x1D, 0x79]
        );
        let q = Fp8CurrentScaling::new(Fp8Format::E5M2)
            .with_usage(Usage::Rowwise)
            .quantize(&x)
            .unwrap();
        assert_eq!(
            q.buffer(BufferName::Data).unwrap().as_bytes().unwrap(),
            &[0x5A, 0xDF, 0x4D, 0x7B]
        );
        assert!(
            (q.buffer(BufferName::ScaleInv)
                .unwrap()
                .as_slice::<f32>()
                .unwrap()[0]
                - 0.005_231_58)
                .abs()
                < 1e-8
        );
        assert!(q.buffer(BufferName::ColumnwiseData).is_none());
    }

    #[test]
    fn delayed_scaling_update_worked_example() {
        // spec §3.5: history [3, 2, 5] (3 newest), scale 1.
        let mut s = DelayedScalingState {
            history: vec![3.0, 2.0, 5.0],
            scale: 1.0,
        };
        let mut t = s.clone();
        s.update(None, Fp8Format::E4M3, 0, AmaxComputeAlgo::Max);
        assert_eq!(s.history, [0.0, 5.0, 3.0]);
        assert_eq!(s.scale, 89.6);
        let mut u = t.clone();
        t.update(None, Fp8Format::E4M3, 0, AmaxComputeAlgo::MostRecent);
        assert_eq!(t.scale, 448.0 / 3.0);
        u.update(None, Fp8Format::E4M3, 1, AmaxComputeAlgo::Max);
        assert_eq!(u.scale, 44.8);
        // A zero newest amax changes nothing.
        let mut z = DelayedScalingState {
            history: vec![0.0, 7.0],
            scale: 2.0,
        };
        z.update(None, Fp8Format::E4M3, 0, AmaxComputeAlgo::Max);
        assert_eq!((z.history.as_slice(), z.scale), (&[0.0, 7.0][..], 2.0));
        // A reduced amax overrides slot 0; Inf keeps the scale but rolls.
        let mut r = DelayedScalingState {
            history: vec![1.0, 0.0],
            scale: 2.0,
        };
        r.update(
            Some(f32::INFINITY),
            Fp8Format::E4M3,
            0,
            AmaxComputeAlgo::Max,
        );
        assert_eq!(
            (r.history.as_slice(), r.scale),
            (&[0.0, f32::INFINITY][..], 2.0)
        );
    }

    #[test]
    fn delayed_scaling_debug_lists_the_fields_and_state() {
        let q = Fp8DelayedScaling::new(Fp8Format::E4M3, 2)
            .unwrap()
            .with_usage(Usage::Rowwise);
        assert_eq!(
            format!("{q:?}"),
            "Fp8DelayedScaling { format: E4M3, usage: Rowwise, margin: 0, algo: Max, \
             state: DelayedScalingState { history: [0.0, 0.0], scale: 1.0 }, record: true }"
        );
    }

    #[test]
    fn delayed_cast_saturates_and_records_amax() {
        let x = Tensor::from_slice(&[600.0f32, -1e9, f32::NAN, f32::INFINITY], [4], Device::Cpu)
            .unwrap();
        let mut q = Fp8DelayedScaling::new(Fp8Format::E4M3, 4)
            .unwrap()
            .with_usage(Usage::Rowwise);
        let t = q.quantize(&x).unwrap();
        assert_eq!(
            t.buffer(BufferName::Data).unwrap().as_bytes().unwrap(),
            &[0x7E, 0xFE, 0x7F, 0x7E]
        );
        assert_eq!(q.state().history()[0], f32::INFINITY);
        let snap = q.state().snapshot();
        q.update(None);
        q.state_mut().restore(&snap).unwrap();
        assert_eq!(q.state().history()[0], f32::INFINITY);
    }
}
