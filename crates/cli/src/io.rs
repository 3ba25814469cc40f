//! Files: reading `.npy` and `.safetensors` tensors, writing them, mapping dtypes, and
//! writing atomically.
//!
//! `.npy` files are read and written with the `npyz` crate; `.safetensors` files with the
//! `safetensors` crate. Both store little-endian bytes, and tessera's host tensors hold
//! native-endian bytes, so the crate only builds for little-endian targets.

use std::collections::{BTreeMap, HashMap};
use std::fs::{self, File};
use std::io::{BufWriter, Write};
use std::ops::Range;
use std::path::{Path, PathBuf};

use anyhow::{Context, anyhow, bail};
use half::f16;
use npyz::WriterBuilder as _;
use safetensors::Dtype;
use safetensors::tensor::TensorView;
use tessera_core::{DType, Device, Shape, Tensor};

#[cfg(not(target_endian = "little"))]
compile_error!("tessera-cli copies file bytes into host tensors as they are: little-endian only");

/// The kinds of tensor file the command reads and writes, told apart by extension.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FileKind {
    /// NumPy `.npy`: one array.
    Npy,
    /// Hugging Face `.safetensors`: named tensors plus string metadata.
    Safetensors,
}

impl FileKind {
    /// The kind of `path`, from its extension (case-insensitive).
    pub fn of(path: &Path) -> anyhow::Result<FileKind> {
        let ext = path
            .extension()
            .and_then(|e| e.to_str())
            .map(str::to_ascii_lowercase);
        match ext.as_deref() {
            Some("npy") => Ok(FileKind::Npy),
            Some("safetensors") => Ok(FileKind::Safetensors),
            _ => bail!(
                "`{}` is neither a .npy nor a .safetensors file (told by its extension)",
                path.display()
            ),
        }
    }
}

/// The safetensors dtype a buffer of tessera dtype `d` is stored as: FP8 as
/// `F8_E4M3`/`F8_E5M2`, E8M0 as `F8_E8M0`, packed FP4 pairs ([`DType::F4E2M1x2`]) as `U8`
/// (so a tensor of `K` FP4 values along its last dimension has `K/2` bytes there, as in
/// TransformerEngine), and the plain types as themselves.
pub fn storage_dtype(d: DType) -> anyhow::Result<Dtype> {
    Ok(match d {
        DType::F32 => Dtype::F32,
        DType::BF16 => Dtype::BF16,
        DType::F16 => Dtype::F16,
        DType::F8E4M3 => Dtype::F8_E4M3,
        DType::F8E5M2 => Dtype::F8_E5M2,
        DType::E8M0 => Dtype::F8_E8M0,
        DType::F4E2M1x2 | DType::U8 => Dtype::U8,
        DType::U32 => Dtype::U32,
        DType::I32 => Dtype::I32,
        DType::U64 => Dtype::U64,
        DType::I64 => Dtype::I64,
        other => bail!("tessera dtype {other} has no safetensors dtype"),
    })
}

/// The tessera dtype of a high-precision safetensors tensor (`F32`, `BF16`, `F16`), the
/// only ones tessera quantizes.
pub fn source_dtype(d: Dtype) -> Option<DType> {
    match d {
        Dtype::F32 => Some(DType::F32),
        Dtype::BF16 => Some(DType::BF16),
        Dtype::F16 => Some(DType::F16),
        _ => None,
    }
}

/// The element type of one input tensor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum InputDtype {
    /// f32, bf16 or f16: can be quantized.
    Float(DType),
    /// Anything else, as the file names it (`I32`, `<f8`, ...).
    Unsupported(String),
}

/// One tensor of an [`Input`].
#[derive(Debug, Clone)]
pub struct InputEntry {
    /// Its name: the safetensors key, or the `.npy` file's stem.
    pub name: String,
    /// Its element type.
    pub dtype: InputDtype,
    /// Its shape.
    pub shape: Shape,
    /// Its size in the file, in bytes.
    size: usize,
    /// Where its bytes are in [`Input`]'s buffer (little-endian, row-major); empty for
    /// an unsupported `.npy` dtype, whose data is not read.
    range: Range<usize>,
}

impl InputEntry {
    /// Its size in the file, in bytes.
    pub fn size_in_bytes(&self) -> usize {
        self.size
    }

    /// Why it cannot be quantized, if its dtype is not f32, bf16 or f16.
    pub fn unsupported_reason(&self, kind: FileKind) -> Option<String> {
        match &self.dtype {
            InputDtype::Float(_) => None,
            InputDtype::Unsupported(d) => Some(match kind {
                FileKind::Safetensors => {
                    format!("dtype {d} is not supported; tessera quantizes F32, BF16 or F16")
                }
                FileKind::Npy => {
                    format!("dtype {d} is not supported; tessera quantizes f32 or f16 .npy arrays")
                }
            }),
        }
    }
}

/// The tensors of a `.npy` or `.safetensors` file, in name order. The bytes are held in
/// memory; [`Input::tensor`] copies one tensor out at a time.
#[derive(Debug)]
pub struct Input {
    /// The file.
    pub path: PathBuf,
    /// Its kind.
    pub kind: FileKind,
    /// Its tensors, in name order.
    pub entries: Vec<InputEntry>,
    bytes: Vec<u8>,
}

impl Input {
    /// Reads `path`, a `.npy` or `.safetensors` file. Tensors of other dtypes are listed
    /// as [`InputDtype::Unsupported`], not rejected; a malformed file is an error.
    pub fn read(path: &Path) -> anyhow::Result<Input> {
        let kind = FileKind::of(path)?;
        let bytes = fs::read(path).with_context(|| format!("cannot read `{}`", path.display()))?;
        match kind {
            FileKind::Npy => read_npy(path, &bytes)
                .with_context(|| format!("`{}` is not a readable .npy file", path.display())),
            FileKind::Safetensors => {
                let entries = safetensors_entries(&bytes).with_context(|| {
                    format!("`{}` is not a readable .safetensors file", path.display())
                })?;
                Ok(Input {
                    path: path.to_owned(),
                    kind,
                    entries,
                    bytes,
                })
            }
        }
    }

    /// The tensor of `entry` as a host [`Tensor`], or an error naming its dtype.
    pub fn tensor(&self, entry: &InputEntry) -> anyhow::Result<Tensor> {
        let InputDtype::Float(dtype) = entry.dtype else {
            bail!(
                "tensor `{}`: {}",
                entry.name,
                entry.unsupported_reason(self.kind).unwrap_or_default()
            );
        };
        Ok(Tensor::from_bytes(
            &self.bytes[entry.range.clone()],
            &entry.shape,
            dtype,
            Device::Cpu,
        )?)
    }

    /// The total size of the tensors in the file, in bytes.
    pub fn total_bytes(&self) -> u64 {
        self.entries.iter().map(|e| e.size_in_bytes() as u64).sum()
    }
}

/// The entries of a safetensors file, in name order, with ranges into `bytes`.
fn safetensors_entries(bytes: &[u8]) -> anyhow::Result<Vec<InputEntry>> {
    let (header_len, meta) = safetensors::SafeTensors::read_metadata(bytes)?;
    let start = 8 + header_len;
    let mut entries: Vec<InputEntry> = meta
        .tensors()
        .into_iter()
        .map(|(name, info)| InputEntry {
            dtype: match source_dtype(info.dtype) {
                Some(d) => InputDtype::Float(d),
                None => InputDtype::Unsupported(info.dtype.to_string()),
            },
            shape: Shape::new(info.shape.clone()),
            size: info.data_offsets.1 - info.data_offsets.0,
            range: start + info.data_offsets.0..start + info.data_offsets.1,
            name,
        })
        .collect();
    entries.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(entries)
}

/// Reads a `.npy` file: f32 or f16 (either byte order, C or Fortran order) becomes one
/// entry named after the file stem; other dtypes an [`InputDtype::Unsupported`] entry.
fn read_npy(path: &Path, bytes: &[u8]) -> anyhow::Result<Input> {
    let npy = npyz::NpyFile::new(bytes)?;
    let shape: Vec<usize> = npy
        .shape()
        .iter()
        .map(|&d| usize::try_from(d))
        .collect::<Result<_, _>>()
        .context("a dimension does not fit in memory")?;
    let fortran = npy.order() == npyz::Order::Fortran;
    let name = path
        .file_stem()
        .and_then(|s| s.to_str())
        .ok_or_else(|| anyhow!("the file name is not valid UTF-8"))?
        .to_owned();
    let typestr = match npy.dtype() {
        npyz::DType::Plain(t) => Some(t),
        _ => None,
    };
    let float = typestr
        .as_ref()
        .filter(|t| t.type_char() == npyz::TypeChar::Float)
        .and_then(|t| match t.size_field() {
            4 => Some(DType::F32),
            2 => Some(DType::F16),
            _ => None,
        });
    let size = typestr
        .as_ref()
        .and_then(|t| t.num_bytes())
        .map_or(0, |b| b.saturating_mul(Shape::new(shape.clone()).numel()));
    let (dtype, data) = match float {
        Some(DType::F32) => {
            let v: Vec<f32> = npy.into_vec()?;
            let v = if fortran { fortran_to_c(&v, &shape) } else { v };
            (
                InputDtype::Float(DType::F32),
                bytemuck::cast_slice(&v).to_vec(),
            )
        }
        Some(_) => {
            let v: Vec<f16> = npy.into_vec()?;
            let v = if fortran { fortran_to_c(&v, &shape) } else { v };
            (
                InputDtype::Float(DType::F16),
                bytemuck::cast_slice(&v).to_vec(),
            )
        }
        None => {
            let d = match typestr {
                Some(t) => t.to_string(),
                None => npy.dtype().descr(),
            };
            (InputDtype::Unsupported(d), Vec::new())
        }
    };
    Ok(Input {
        path: path.to_owned(),
        kind: FileKind::Npy,
        entries: vec![InputEntry {
            name,
            dtype,
            shape: Shape::new(shape),
            size,
            range: 0..data.len(),
        }],
        bytes: data,
    })
}

/// Reorders column-major (Fortran) elements of an array of `shape` into row-major order.
pub fn fortran_to_c<T: Copy>(v: &[T], shape: &[usize]) -> Vec<T> {
    let n = v.len();
    if shape.len() < 2 || n == 0 {
        return v.to_vec();
    }
    // Column-major strides: dimension 0 is contiguous.
    let mut strides = vec![1usize; shape.len()];
    for i in 1..shape.len() {
        strides[i] = strides[i - 1] * shape[i - 1];
    }
    let mut idx = vec![0usize; shape.len()];
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let src: usize = idx.iter().zip(&strides).map(|(i, s)| i * s).sum();
        out.push(v[src]);
        // Advance the row-major index (last dimension fastest).
        for d in (0..shape.len()).rev() {
            idx[d] += 1;
            if idx[d] < shape[d] {
                break;
            }
            idx[d] = 0;
        }
    }
    out
}

/// A tensor of a safetensors file as stored: dtype, shape and bytes.
#[derive(Debug, Clone)]
pub struct StoredTensor<'a> {
    /// The safetensors dtype.
    pub dtype: Dtype,
    /// The shape.
    pub shape: Vec<usize>,
    /// The little-endian bytes.
    pub data: &'a [u8],
}

/// A whole safetensors file in memory, parsed: its metadata and its tensors by name.
#[derive(Debug)]
pub struct SafetensorsFile {
    bytes: Vec<u8>,
    header_len: usize,
    meta: safetensors::tensor::Metadata,
}

impl SafetensorsFile {
    /// Reads and parses `path`.
    pub fn read(path: &Path) -> anyhow::Result<SafetensorsFile> {
        let bytes = fs::read(path).with_context(|| format!("cannot read `{}`", path.display()))?;
        let (header_len, meta) = safetensors::SafeTensors::read_metadata(&bytes)
            .with_context(|| format!("`{}` is not a readable .safetensors file", path.display()))?;
        Ok(SafetensorsFile {
            bytes,
            header_len,
            meta,
        })
    }

    /// The `__metadata__` string map (empty when the file has none).
    pub fn metadata(&self) -> HashMap<String, String> {
        self.meta.metadata().clone().unwrap_or_default()
    }

    /// The tensor names, in name order.
    pub fn names(&self) -> Vec<String> {
        let mut v: Vec<String> = self.meta.tensors().into_keys().collect();
        v.sort();
        v
    }

    /// The tensor called `name`, if there is one.
    pub fn get(&self, name: &str) -> Option<StoredTensor<'_>> {
        let info = self.meta.info(name)?;
        let start = 8 + self.header_len;
        Some(StoredTensor {
            dtype: info.dtype,
            shape: info.shape.clone(),
            data: &self.bytes[start + info.data_offsets.0..start + info.data_offsets.1],
        })
    }
}

/// Writes named host tensors and string metadata to a `.safetensors` file, atomically.
/// Each tensor is stored with [`storage_dtype`].
pub fn write_safetensors(
    path: &Path,
    tensors: &[(String, &Tensor)],
    metadata: BTreeMap<String, String>,
) -> anyhow::Result<()> {
    let mut views = Vec::with_capacity(tensors.len());
    let mut seen = std::collections::HashSet::new();
    for (name, t) in tensors {
        if !seen.insert(name.as_str()) {
            bail!("two tensors would be written as `{name}`");
        }
        let view = TensorView::new(
            storage_dtype(t.dtype())?,
            t.shape().dims().to_vec(),
            t.as_bytes()?,
        )
        .with_context(|| format!("tensor `{name}`"))?;
        views.push((name.as_str(), view));
    }
    let meta: HashMap<String, String> = metadata.into_iter().collect();
    let bytes = safetensors::serialize(views, Some(meta))?;
    write_atomically(path, |w| Ok(w.write_all(&bytes)?))
}

/// Writes one f32 or f16 host tensor to a `.npy` file (little-endian, C order),
/// atomically.
pub fn write_npy(path: &Path, t: &Tensor) -> anyhow::Result<()> {
    let shape: Vec<u64> = t.shape().dims().iter().map(|&d| d as u64).collect();
    match t.dtype() {
        DType::F32 => write_npy_values(path, &shape, t.as_slice::<f32>()?),
        DType::F16 => write_npy_values(path, &shape, t.as_slice::<f16>()?),
        other => bail!(".npy files are written as f32 or f16, not {other}"),
    }
}

/// The `.npy` file of `values` in C order with `shape`, written atomically.
fn write_npy_values<T: npyz::AutoSerialize + Copy>(
    path: &Path,
    shape: &[u64],
    values: &[T],
) -> anyhow::Result<()> {
    write_atomically(path, |w| {
        let mut npy = npyz::WriteOptions::<T>::new()
            .default_dtype()
            .shape(shape)
            .writer(w)
            .begin_nd()?;
        npy.extend(values.iter().copied())?;
        npy.finish()?;
        Ok(())
    })
}

/// Writes `path` through `write` atomically ([`tessera_core::fs::write_atomically`]): the
/// bytes go to a new temporary file in the same directory, which is flushed to disk and
/// then renamed over `path`. When `write` or any step fails, the temporary file is
/// removed and `path` is left as it was.
pub fn write_atomically(
    path: &Path,
    write: impl FnOnce(&mut BufWriter<File>) -> anyhow::Result<()>,
) -> anyhow::Result<()> {
    // The closure's own error (any kind) is kept aside and returned as it was.
    let mut failure = None;
    let r = tessera_core::fs::write_atomically(path, |w| {
        write(w).map_err(|e| {
            let msg = format!("{e:#}");
            failure = Some(e);
            std::io::Error::other(msg)
        })
    });
    match (r, failure) {
        (Ok(()), _) => Ok(()),
        (Err(_), Some(e)) => Err(e.context(format!("cannot write `{}`", path.display()))),
        (Err(e), None) => Err(e.into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fortran_order_becomes_c_order() {
        // A 2x3 array [[0, 1, 2], [3, 4, 5]] stored column-major.
        let f = [0, 3, 1, 4, 2, 5];
        assert_eq!(fortran_to_c(&f, &[2, 3]), [0, 1, 2, 3, 4, 5]);
        // 2x2x2: element (i, j, k) = 4i + 2j + k, stored with i fastest.
        let mut f = vec![0; 8];
        for i in 0..2 {
            for j in 0..2 {
                for k in 0..2 {
                    f[i + 2 * j + 4 * k] = 4 * i + 2 * j + k;
                }
            }
        }
        assert_eq!(fortran_to_c(&f, &[2, 2, 2]), (0..8).collect::<Vec<_>>());
        assert_eq!(fortran_to_c(&[1, 2, 3], &[3]), [1, 2, 3]);
    }

    #[test]
    fn dtypes_map_both_ways() {
        for d in [DType::F32, DType::BF16, DType::F16] {
            assert_eq!(source_dtype(storage_dtype(d).unwrap()), Some(d));
        }
        assert_eq!(storage_dtype(DType::F4E2M1x2).unwrap(), Dtype::U8);
        assert_eq!(storage_dtype(DType::E8M0).unwrap(), Dtype::F8_E8M0);
        assert_eq!(storage_dtype(DType::F8E4M3).unwrap(), Dtype::F8_E4M3);
        assert_eq!(storage_dtype(DType::F8E5M2).unwrap(), Dtype::F8_E5M2);
        assert_eq!(source_dtype(Dtype::I32), None);
        assert_eq!(source_dtype(Dtype::F64), None);
    }

    #[test]
    fn atomic_write_leaves_nothing_on_failure() {
        let dir = std::env::temp_dir().join(format!("tessera-io-test-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        let out = dir.join("out.bin");
        let err = write_atomically(&out, |w| {
            w.write_all(b"partial")?;
            bail!("boom")
        })
        .unwrap_err();
        assert!(format!("{err:#}").contains("boom"));
        assert_eq!(
            fs::read_dir(&dir).unwrap().count(),
            0,
            "temp file left behind"
        );
        write_atomically(&out, |w| Ok(w.write_all(b"whole")?)).unwrap();
        assert_eq!(fs::read(&out).unwrap(), b"whole");
        assert_eq!(fs::read_dir(&dir).unwrap().count(), 1);
        fs::remove_dir_all(&dir).unwrap();
    }
}
