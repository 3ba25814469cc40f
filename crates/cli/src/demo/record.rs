//! What the runs record for the report: the bytes each collective moved, the dropout
//! masks each rank drew (as checksums), the activation bytes each block kept.

use std::collections::BTreeMap;

use serde::Serialize;
use tessera_fsdp::{CommCounts, OpCount};

/// Where a dropout mask was drawn.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Region {
    /// After GeLU, inside the tensor-parallel region: the model-parallel stream, a
    /// different one on every tensor-parallel rank.
    ModelParallel,
    /// After FC2, on the residual stream: the shared data-parallel stream, the same on
    /// every tensor-parallel rank.
    DataParallel,
}

/// One dropout mask: which step, block, data-parallel batch and tensor-parallel rank
/// (the column block, for the reference) drew it, and the FNV-1a checksum of its bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct MaskRecord {
    /// Step.
    pub step: usize,
    /// Block.
    pub layer: usize,
    /// Data-parallel batch.
    pub dp: usize,
    /// Tensor-parallel rank (model-parallel masks) or the rank that drew the whole
    /// sequence's mask (data-parallel masks; 0 in the reference).
    pub tp: usize,
    /// Which stream.
    pub region: Region,
    /// Checksum of the mask's dtype, shape and bytes.
    pub checksum: u64,
}

/// The collectives one rank ran, by group, purpose and format.
#[derive(Debug, Clone, Default)]
pub struct Traffic {
    entries: BTreeMap<TrafficKey, TrafficEntry>,
}

/// Which collective: the group (`tp`, `dp`, `world`), what it moved, in which format.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct TrafficKey {
    /// Order of appearance in the report.
    pub order: u8,
    /// `tp`, `dp` or `world`.
    pub group: &'static str,
    /// What it moves, e.g. `SP all-gather: FC1 input`.
    pub what: String,
    /// The format on the wire, e.g. `mxfp8` or `f32`.
    pub format: String,
}

/// What one kind of collective moved.
#[derive(Debug, Clone, Copy, Default)]
pub struct TrafficEntry {
    /// Per kind of collective.
    pub counts: CommCounts,
    /// What the same tensors would have taken in f32.
    pub f32_bytes: u64,
}

impl TrafficEntry {
    /// Every kind together.
    pub fn total(&self) -> OpCount {
        self.counts.total()
    }
}

impl Traffic {
    /// Adds what a [`CountingGroup`](tessera_fsdp::CountingGroup) counted around one call.
    pub fn add(&mut self, key: TrafficKey, counts: CommCounts, f32_bytes: u64) {
        let e = self.entries.entry(key).or_default();
        let add = |a: &mut OpCount, b: &OpCount| {
            a.calls += b.calls;
            a.bytes += b.bytes;
            a.wire_bytes += b.wire_bytes;
        };
        add(&mut e.counts.all_gather, &counts.all_gather);
        add(&mut e.counts.reduce_scatter, &counts.reduce_scatter);
        add(&mut e.counts.all_reduce, &counts.all_reduce);
        add(&mut e.counts.broadcast, &counts.broadcast);
        e.f32_bytes += f32_bytes;
    }

    /// The entries, in report order.
    pub fn entries(&self) -> impl Iterator<Item = (&TrafficKey, &TrafficEntry)> {
        self.entries.iter()
    }
}

/// The bytes one block kept from its forward to its backward.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct BlockBytes {
    /// Its input (what a checkpoint frame keeps).
    pub input: usize,
    /// Everything its forward saved (what it keeps without checkpointing).
    pub saved: usize,
}
