//! Sharded checkpoints: every rank writes its shards to one safetensors file, rank 0 an
//! index; loading re-shards for any world size; [`consolidate`] writes one file.
//!
//! A checkpoint directory holds
//!
//! - `shard-RRRRR-of-NNNNN.safetensors` per rank `R` of `N`: for every parameter, the
//!   rows that rank owns (padding stripped), as an f32 tensor named after the parameter;
//! - `index.json` ([`ShardIndex`]): per parameter its shape and, per rank, the file and
//!   the row range `[start, end)` it holds.
//!
//! Every file is written atomically (a temporary file, flushed, renamed), and the index
//! only after every rank has written its file, so a directory with an index is complete.
//! Under hybrid sharding only the first replica writes.

use std::collections::{BTreeMap, HashMap};
use std::fs;
use std::io::Write;
use std::path::Path;

use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};
use serde::{Deserialize, Serialize};
use tessera_collectives::{ProcessGroup, ReduceOp};
use tessera_core::{DType, Device, Error, Result, Shape, Tensor};

use crate::Fsdp;

#[cfg(not(target_endian = "little"))]
compile_error!(
    "tessera-fsdp writes host tensor bytes to safetensors files as they are: little-endian only"
);

/// The index file's name.
pub const INDEX_FILE: &str = "index.json";
/// The `format` of a sharded checkpoint's index.
pub const INDEX_FORMAT: &str = "tessera-fsdp-sharded";
/// The index version this crate writes and reads.
pub const INDEX_VERSION: u32 = 1;

/// The index of a sharded checkpoint (`index.json`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardIndex {
    /// Always [`INDEX_FORMAT`].
    pub format: String,
    /// [`INDEX_VERSION`].
    pub version: u32,
    /// The number of ranks (shard files) the checkpoint was written with.
    pub world_size: usize,
    /// Every parameter, unit by unit.
    pub params: Vec<IndexParam>,
}

/// One parameter of a [`ShardIndex`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct IndexParam {
    /// Its name (the tensor name in the shard files).
    pub name: String,
    /// The unit (layer) it belongs to.
    pub unit: String,
    /// Its full shape.
    pub shape: Vec<usize>,
    /// The dtype of the stored rows (`"f32"`).
    pub dtype: String,
    /// Where its rows are, one entry per rank.
    pub shards: Vec<IndexShard>,
}

/// The rows of one parameter in one shard file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct IndexShard {
    /// The rank that wrote them.
    pub rank: usize,
    /// The file, relative to the checkpoint directory.
    pub file: String,
    /// The rows `[start, end)` of the parameter (may be empty).
    pub rows: [usize; 2],
}

/// The shard file of `rank` of `world`.
pub fn shard_file_name(rank: usize, world: usize) -> String {
    format!("shard-{rank:05}-of-{world:05}.safetensors")
}

fn io_err(op: &'static str, what: &str, path: &Path, e: impl std::fmt::Display) -> Error {
    Error::state(op, format!("cannot {what} `{}`: {e}", path.display()))
}

/// Writes `bytes` to `path` atomically (see [`tessera_core::fs::write_atomically`]): on
/// failure nothing is left behind.
pub fn write_atomically(path: &Path, bytes: &[u8]) -> Result<()> {
    tessera_core::fs::write_atomically(path, |w| w.write_all(bytes))
}

/// Serializes named f32 host tensors (and string metadata) as a safetensors file, written
/// atomically.
pub fn write_safetensors(
    path: &Path,
    tensors: &[(String, Tensor)],
    metadata: HashMap<String, String>,
) -> Result<()> {
    const OP: &str = "write_safetensors";
    let hosts: Vec<(String, Tensor)> = tensors
        .iter()
        .map(|(n, t)| Ok((n.clone(), t.to_device(Device::Cpu)?)))
        .collect::<Result<_>>()?;
    let mut views = Vec::with_capacity(hosts.len());
    for (name, t) in &hosts {
        let dtype = match t.dtype() {
            DType::F32 => Dtype::F32,
            DType::BF16 => Dtype::BF16,
            DType::F16 => Dtype::F16,
            other => return Err(Error::dtype(OP, "f32, bf16 or f16", other)),
        };
        let view = TensorView::new(dtype, t.shape().dims().to_vec(), t.as_bytes()?)
            .map_err(|e| Error::invalid(OP, format!("tensor `{name}`: {e}")))?;
        views.push((name.as_str(), view));
    }
    let bytes = safetensors::serialize(views, Some(metadata))
        .map_err(|e| Error::invalid(OP, format!("cannot serialize `{}`: {e}", path.display())))?;
    write_atomically(path, &bytes)
}

/// Reads `dir/index.json` and checks its format and version.
pub fn read_index(dir: &Path) -> Result<ShardIndex> {
    const OP: &str = "read_index";
    let path = dir.join(INDEX_FILE);
    let text = fs::read_to_string(&path).map_err(|e| io_err(OP, "read", &path, e))?;
    let index: ShardIndex = serde_json::from_str(&text).map_err(|e| {
        Error::invalid(
            OP,
            format!(
                "`{}` is not a sharded-checkpoint index: {e}",
                path.display()
            ),
        )
    })?;
    if index.format != INDEX_FORMAT || index.version != INDEX_VERSION {
        return Err(Error::invalid(
            OP,
            format!(
                "`{}` has format `{}` version {}; expected `{INDEX_FORMAT}` version {INDEX_VERSION}",
                path.display(),
                index.format,
                index.version
            ),
        ));
    }
    for p in &index.params {
        if p.dtype != "f32" {
            return Err(Error::invalid(
                OP,
                format!(
                    "parameter `{}` is stored as `{}`; this version reads f32",
                    p.name, p.dtype
                ),
            ));
        }
        if p.shape.is_empty() {
            return Err(Error::shape(
                OP,
                format!("parameter `{}` has rank 0", p.name),
            ));
        }
    }
    Ok(index)
}

/// The shard files of a checkpoint, read on demand and kept.
struct Files<'a> {
    dir: &'a Path,
    bytes: HashMap<String, Vec<u8>>,
}

impl Files<'_> {
    /// Parameter `p`'s rows `[lo, hi)` (within the shard `s` holds), as f32 bytes.
    fn rows(&mut self, p: &IndexParam, s: &IndexShard, lo: usize, hi: usize) -> Result<Vec<u8>> {
        const OP: &str = "sharded checkpoint";
        if s.file.contains(['/', '\\']) || s.file.starts_with('.') {
            return Err(Error::invalid(
                OP,
                format!(
                    "the index names a file outside the checkpoint: `{}`",
                    s.file
                ),
            ));
        }
        if !self.bytes.contains_key(&s.file) {
            let path = self.dir.join(&s.file);
            let b = fs::read(&path).map_err(|e| io_err(OP, "read", &path, e))?;
            self.bytes.insert(s.file.clone(), b);
        }
        let bytes = &self.bytes[&s.file];
        let st = SafeTensors::deserialize(bytes).map_err(|e| {
            Error::invalid(
                OP,
                format!("`{}` is not a readable .safetensors file: {e}", s.file),
            )
        })?;
        let view = st.tensor(&p.name).map_err(|e| {
            Error::invalid(OP, format!("`{}` has no tensor `{}`: {e}", s.file, p.name))
        })?;
        let mut want = p.shape.clone();
        want[0] = s.rows[1] - s.rows[0];
        if view.dtype() != Dtype::F32 || view.shape() != want.as_slice() {
            return Err(Error::shape(
                OP,
                format!(
                    "`{}` in `{}` is {:?} {:?}; the index says F32 {:?}",
                    p.name,
                    s.file,
                    view.dtype(),
                    view.shape(),
                    want
                ),
            ));
        }
        let rb = p.shape[1..].iter().product::<usize>() * 4;
        let (a, b) = (lo - s.rows[0], hi - s.rows[0]);
        Ok(view.data()[a * rb..b * rb].to_vec())
    }
}

/// Parameter `p`'s rows `[lo, hi)` assembled from the shards that hold them; every row
/// must be held by exactly one shard.
fn assemble_rows(files: &mut Files<'_>, p: &IndexParam, lo: usize, hi: usize) -> Result<Vec<u8>> {
    const OP: &str = "sharded checkpoint";
    let too_large = || {
        Error::shape(
            OP,
            format!("parameter `{}` of shape {:?} is too large", p.name, p.shape),
        )
    };
    let rb = p.shape[1..]
        .iter()
        .try_fold(4usize, |a, &d| a.checked_mul(d))
        .ok_or_else(too_large)?;
    let len = (hi - lo)
        .checked_mul(rb)
        .filter(|&n| n <= isize::MAX as usize)
        .ok_or_else(too_large)?;
    let mut out = vec![0u8; len];
    let mut covered = 0usize;
    for s in &p.shards {
        let [a, b] = s.rows;
        if a > b || b > p.shape[0] {
            return Err(Error::shape(
                OP,
                format!(
                    "parameter `{}`: rank {}'s rows {a}..{b} do not fit its {} rows",
                    p.name, s.rank, p.shape[0]
                ),
            ));
        }
        let (x, y) = (a.max(lo), b.min(hi));
        if x >= y {
            continue;
        }
        let data = files.rows(p, s, x, y)?;
        out[(x - lo) * rb..(y - lo) * rb].copy_from_slice(&data);
        covered += y - x;
    }
    if covered != hi - lo {
        return Err(Error::shape(
            OP,
            format!(
                "parameter `{}`: the shards hold {covered} of its rows {lo}..{hi} (each row must be in exactly one shard)",
                p.name
            ),
        ));
    }
    Ok(out)
}

/// All-reduces (MAX) a failure flag so every rank learns whether any failed; doubles as
/// a barrier over `groups` (the shard group, then the replicate group, which together
/// span every rank).
fn agree(groups: &[&dyn ProcessGroup], failed: bool) -> Result<bool> {
    let mut flag = u32::from(failed);
    for g in groups {
        let t = Tensor::from_slice(&[flag], [1], g.device())?;
        flag = g
            .all_reduce(t, ReduceOp::Max)?
            .into_result()?
            .to_vec::<u32>()?[0];
    }
    Ok(flag != 0)
}

impl Fsdp {
    /// Saves every rank's shards under `dir` (created if needed) with one index file
    /// (see the [module docs](crate::sharded)). A collective over every rank (the
    /// replicas of hybrid sharding included); every rank returns the same success, or an
    /// error (its own, or saying another rank failed).
    pub fn save_sharded(&self, dir: &Path) -> Result<()> {
        const OP: &str = "Fsdp::save_sharded";
        let rank = self.group().rank();
        let world = self.group().size();
        let writer = self.replicate_group().is_none_or(|g| g.rank() == 0);
        let groups: Vec<&dyn ProcessGroup> = std::iter::once(&**self.group())
            .chain(self.replicate_group().map(|g| &**g))
            .collect();
        let mine = if writer {
            self.write_shard_file(dir)
        } else {
            Ok(())
        };
        if agree(&groups, mine.is_err())? {
            mine?;
            return Err(Error::state(
                OP,
                "another rank failed to write its shard file",
            ));
        }
        let index = if writer && rank == 0 {
            self.write_index(dir, world)
        } else {
            Ok(())
        };
        if agree(&groups, index.is_err())? {
            index?;
            return Err(Error::state(OP, "rank 0 failed to write the index"));
        }
        Ok(())
    }

    fn write_shard_file(&self, dir: &Path) -> Result<()> {
        const OP: &str = "Fsdp::save_sharded";
        fs::create_dir_all(dir).map_err(|e| io_err(OP, "create", dir, e))?;
        let (rank, world) = (self.group().rank(), self.group().size());
        let mut tensors = Vec::new();
        for p in self.all_params() {
            let rows = p.layout().valid_rows(rank);
            let rb = p.layout().row_numel() * 4;
            let bytes = p.shard().to_bytes()?;
            let mut shape = p.layout().shape().dims().to_vec();
            shape[0] = rows.len();
            tensors.push((
                p.name().to_owned(),
                Tensor::from_bytes(&bytes[..rows.len() * rb], shape, DType::F32, Device::Cpu)?,
            ));
        }
        let meta = HashMap::from([
            ("format".to_owned(), INDEX_FORMAT.to_owned()),
            ("rank".to_owned(), rank.to_string()),
            ("world_size".to_owned(), world.to_string()),
        ]);
        write_safetensors(&dir.join(shard_file_name(rank, world)), &tensors, meta)
    }

    fn write_index(&self, dir: &Path, world: usize) -> Result<()> {
        const OP: &str = "Fsdp::save_sharded";
        let mut params = Vec::new();
        for u in 0..self.num_units() {
            for p in self.params(u)? {
                params.push(IndexParam {
                    name: p.name().to_owned(),
                    unit: self.unit_name(u)?.to_owned(),
                    shape: p.layout().shape().dims().to_vec(),
                    dtype: "f32".to_owned(),
                    shards: (0..world)
                        .map(|r| {
                            let rows = p.layout().valid_rows(r);
                            IndexShard {
                                rank: r,
                                file: shard_file_name(r, world),
                                rows: [rows.start, rows.end],
                            }
                        })
                        .collect(),
                });
            }
        }
        let index = ShardIndex {
            format: INDEX_FORMAT.to_owned(),
            version: INDEX_VERSION,
            world_size: world,
            params,
        };
        let text = serde_json::to_string_pretty(&index)
            .map_err(|e| Error::state(OP, format!("cannot serialize the index: {e}")))?;
        write_atomically(&dir.join(INDEX_FILE), text.as_bytes())
    }

    /// Loads this rank's shards from the checkpoint in `dir`, written with any world
    /// size: each rank reads the rows its layout gives it from whichever files hold them.
    /// Every parameter of the engine must be in the index with the same shape
    /// (parameters only in the index are ignored). Drops gradients and full copies. No
    /// communication.
    pub fn load_sharded(&mut self, dir: &Path) -> Result<()> {
        const OP: &str = "Fsdp::load_sharded";
        let index = read_index(dir)?;
        let by_name: BTreeMap<&str, &IndexParam> =
            index.params.iter().map(|p| (p.name.as_str(), p)).collect();
        let rank = self.group().rank();
        let mut files = Files {
            dir,
            bytes: HashMap::new(),
        };
        let mut shards = Vec::new();
        for p in self.all_params() {
            let ip = by_name.get(p.name()).ok_or_else(|| {
                Error::not_found("parameter in the checkpoint", p.name(), by_name.keys())
            })?;
            if ip.shape != p.layout().shape().dims() {
                return Err(Error::shape(
                    OP,
                    format!(
                        "parameter `{}` is {} in the engine but {:?} in the checkpoint",
                        p.name(),
                        p.layout().shape(),
                        ip.shape
                    ),
                ));
            }
            let rows = p.layout().valid_rows(rank);
            let mut bytes = assemble_rows(&mut files, ip, rows.start, rows.end)?;
            bytes.resize(p.layout().shard_shape().numel() * 4, 0);
            shards.push(
                Tensor::from_bytes(&bytes, p.layout().shard_shape(), DType::F32, Device::Cpu)?
                    .to_device(self.group().device())?,
            );
        }
        for (p, s) in self.all_params_mut().zip(shards) {
            p.shard = s;
        }
        self.zero_grad();
        for u in 0..self.num_units() {
            self.reshard(u)?;
        }
        Ok(())
    }
}

/// What [`consolidate`] wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Consolidated {
    /// The world size the checkpoint was saved with.
    pub world_size: usize,
    /// Each parameter and its shape, in index order.
    pub params: Vec<(String, Shape)>,
    /// The bytes of tensor data written.
    pub bytes: usize,
}

/// Reads the sharded checkpoint in `dir` and writes every parameter whole to one
/// safetensors file `out` (f32, atomically), with metadata `format =
/// tessera-fsdp-consolidated` and the source world size.
pub fn consolidate(dir: &Path, out: &Path) -> Result<Consolidated> {
    let index = read_index(dir)?;
    let mut files = Files {
        dir,
        bytes: HashMap::new(),
    };
    let mut tensors = Vec::with_capacity(index.params.len());
    for p in &index.params {
        let bytes = assemble_rows(&mut files, p, 0, p.shape[0])?;
        tensors.push((
            p.name.clone(),
            Tensor::from_bytes(&bytes, p.shape.clone(), DType::F32, Device::Cpu)?,
        ));
    }
    let meta = HashMap::from([
        ("format".to_owned(), "tessera-fsdp-consolidated".to_owned()),
        ("source_world_size".to_owned(), index.world_size.to_string()),
    ]);
    write_safetensors(out, &tensors, meta)?;
    Ok(Consolidated {
        world_size: index.world_size,
        bytes: tensors.iter().map(|(_, t)| t.size_in_bytes()).sum(),
        params: tensors
            .into_iter()
            .map(|(n, t)| (n, t.shape().clone()))
            .collect(),
    })
}
