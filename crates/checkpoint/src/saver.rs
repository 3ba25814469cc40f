//! What a forward saves for its backward: the [`Saver`] a [`Recompute`](crate::Recompute)
//! forward writes to, and the descriptions checkpoint frames compare at recompute.

use std::fmt;

use tessera_core::{DType, Error, Result, Shape, Tensor};

/// Which pass a [`Recompute::forward`](crate::Recompute::forward) is running in.
///
/// TransformerEngine answers this with the globals `activation_recompute_forward` and
/// `in_fp8_activation_recompute_phase`; here the [`Saver`] carries it.
///
/// State registered for replay ([`Recompute::replay_states`](crate::Recompute::replay_states),
/// the current generators) needs no special case: a recompute starts from the
/// forward-time snapshots, so running the same code in both phases gives the same
/// numbers, and the backward-time snapshots are put back afterwards. The phase is for
/// side effects on state that is *not* replayed — e.g. a delayed-scaling quantizer that
/// is not registered skips its amax update and record when
/// [`is_recompute`](Phase::is_recompute), and keeps the scale the forward used.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Phase {
    /// The first forward (and every forward without checkpointing).
    Forward,
    /// The forward re-run during backward, under the restored replay states.
    Recompute,
}

impl Phase {
    /// `true` for [`Phase::Forward`].
    pub fn is_forward(self) -> bool {
        self == Phase::Forward
    }

    /// `true` for [`Phase::Recompute`].
    pub fn is_recompute(self) -> bool {
        self == Phase::Recompute
    }

    /// `"forward"` or `"recompute"`.
    pub fn name(self) -> &'static str {
        match self {
            Phase::Forward => "forward",
            Phase::Recompute => "recompute",
        }
    }
}

impl fmt::Display for Phase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The description of one saved tensor (or output) that recompute must reproduce.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Meta {
    pub(crate) label: Option<&'static str>,
    pub(crate) shape: Shape,
    pub(crate) dtype: DType,
    /// FNV-1a of dtype, shape and bytes; only with the determinism check.
    pub(crate) checksum: Option<u64>,
}

impl Meta {
    pub(crate) fn of(t: &Tensor, label: Option<&'static str>, checksum: bool) -> Result<Meta> {
        Ok(Meta {
            label,
            shape: t.shape().clone(),
            dtype: t.dtype(),
            checksum: if checksum {
                Some(tensor_checksum(t)?)
            } else {
                None
            },
        })
    }

    /// `None` when `recomputed` reproduces `self`, else what differs (for an error).
    pub(crate) fn difference(&self, recomputed: &Meta) -> Option<String> {
        if self.shape != recomputed.shape {
            return Some(format!(
                "shape {} in the forward, {} in the recompute",
                self.shape, recomputed.shape
            ));
        }
        if self.dtype != recomputed.dtype {
            return Some(format!(
                "dtype {} in the forward, {} in the recompute",
                self.dtype, recomputed.dtype
            ));
        }
        match (self.checksum, recomputed.checksum) {
            (Some(a), Some(b)) if a != b => Some(format!(
                "same shape {} and dtype {} but different values (checksum {a:#018x} in the \
                 forward, {b:#018x} in the recompute)",
                self.shape, self.dtype
            )),
            _ => None,
        }
    }

    /// `"saved tensor 2 (`mask`)"` or `"output 0"`.
    pub(crate) fn describe(&self, what: &str, index: usize) -> String {
        match self.label {
            Some(l) => format!("{what} {index} (`{l}`)"),
            None => format!("{what} {index}"),
        }
    }
}

const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;

fn fnv1a(mut h: u64, bytes: &[u8]) -> u64 {
    for &b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(FNV_PRIME);
    }
    h
}

/// The 64-bit FNV-1a checksum of a tensor's dtype, shape and bytes — what the
/// determinism check compares. A CUDA tensor is copied to the host first.
pub fn tensor_checksum(t: &Tensor) -> Result<u64> {
    let mut h = fnv1a(FNV_OFFSET, t.dtype().name().as_bytes());
    for &d in t.shape().dims() {
        h = fnv1a(h, &(d as u64).to_le_bytes());
    }
    h = match t.as_bytes() {
        Ok(b) => fnv1a(h, b),
        Err(_) => fnv1a(h, &t.to_bytes()?),
    };
    Ok(h)
}

/// Where a [`Recompute::forward`](crate::Recompute::forward) saves the tensors its
/// backward needs, and learns which [`Phase`] it runs in.
///
/// [`save`](Saver::save) returns the index the backward passes to
/// [`Saved::take`](crate::Saved::take). What happens to the tensor depends on the
/// frame: without checkpointing it is kept; under checkpointing the first forward only
/// records its index, shape and dtype (and, with the determinism check, a checksum) and
/// drops it, and the recompute keeps it for the backward.
///
/// Saving never fails; a tensor that cannot be read for its checksum (a CUDA tensor
/// whose copy fails) is reported by the frame when the forward returns.
pub struct Saver {
    phase: Phase,
    keep: bool,
    checksums: bool,
    pub(crate) metas: Vec<Meta>,
    pub(crate) tensors: Vec<Tensor>,
    pub(crate) error: Option<Error>,
}

impl Saver {
    pub(crate) fn new(phase: Phase, keep: bool, checksums: bool) -> Saver {
        Saver {
            phase,
            keep,
            checksums,
            metas: Vec::new(),
            tensors: Vec::new(),
            error: None,
        }
    }

    /// The pass this forward runs in.
    pub fn phase(&self) -> Phase {
        self.phase
    }

    /// `true` when this forward runs under a checkpoint frame that recomputes it
    /// (first forward or recompute), `false` without checkpointing.
    pub fn is_checkpointed(&self) -> bool {
        !(self.keep && self.phase.is_forward())
    }

    /// Saves `t` for the backward and returns its index.
    pub fn save(&mut self, t: &Tensor) -> usize {
        self.save_impl(t, None)
    }

    /// Saves `t` under a label that errors (shape or determinism mismatches) name.
    pub fn save_named(&mut self, label: &'static str, t: &Tensor) -> usize {
        self.save_impl(t, Some(label))
    }

    /// How many tensors were saved so far.
    pub fn len(&self) -> usize {
        self.metas.len()
    }

    /// `true` when nothing was saved yet.
    pub fn is_empty(&self) -> bool {
        self.metas.is_empty()
    }

    fn save_impl(&mut self, t: &Tensor, label: Option<&'static str>) -> usize {
        let index = self.metas.len();
        let meta = match Meta::of(t, label, self.checksums) {
            Ok(m) => m,
            Err(e) => {
                self.error.get_or_insert(e);
                Meta::of(t, label, false).unwrap_or(Meta {
                    label,
                    shape: t.shape().clone(),
                    dtype: t.dtype(),
                    checksum: None,
                })
            }
        };
        self.metas.push(meta);
        if self.keep {
            self.tensors.push(t.clone());
        }
        index
    }
}

impl fmt::Debug for Saver {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Saver")
            .field("phase", &self.phase)
            .field("keep", &self.keep)
            .field("saved", &self.metas.len())
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tessera_core::Device;

    #[test]
    fn checksum_sees_values_shape_and_dtype() {
        let a = Tensor::from_slice(&[1.0f32, 2.0, 3.0, 4.0], [2, 2], Device::Cpu).unwrap();
        let b = Tensor::from_slice(&[1.0f32, 2.0, 3.0, 4.5], [2, 2], Device::Cpu).unwrap();
        let c = a.reshape([4]).unwrap();
        let d = Tensor::from_slice(&[1u32, 2, 3, 4], [2, 2], Device::Cpu).unwrap();
        let ha = tensor_checksum(&a).unwrap();
        assert_eq!(ha, tensor_checksum(&a.clone()).unwrap());
        for other in [&b, &c, &d] {
            assert_ne!(ha, tensor_checksum(other).unwrap());
        }
    }

    #[test]
    fn meta_difference_names_the_first_mismatch() {
        let a = Tensor::zeros([2, 3], DType::F32, Device::Cpu).unwrap();
        let b = Tensor::zeros([3, 2], DType::F32, Device::Cpu).unwrap();
        let ma = Meta::of(&a, Some("h"), true).unwrap();
        let mb = Meta::of(&b, Some("h"), true).unwrap();
        let d = ma.difference(&mb).unwrap();
        assert!(d.contains("shape [2, 3] in the forward, [3, 2]"), "{d}");
        assert_eq!(ma.describe("saved tensor", 1), "saved tensor 1 (`h`)");
        assert!(ma.difference(&ma.clone()).is_none());
    }
}
