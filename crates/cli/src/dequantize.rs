//! `tessera dequantize`: rebuild the quantized tensors of a file and write their values.

use std::collections::{BTreeMap, BTreeSet};

use anyhow::{Context, bail};
use tessera_core::{DType, Device, Shape, Tensor};
use tessera_quant::QuantizedTensor;

use crate::args::DequantizeArgs;
use crate::io::{self, FileKind, SafetensorsFile};
use crate::recipe::{self, Recipe};

/// Runs `tessera dequantize`.
pub fn run(a: &DequantizeArgs) -> anyhow::Result<()> {
    if FileKind::of(&a.input).ok() != Some(FileKind::Safetensors) {
        bail!(
            "the input must be a .safetensors file written by `tessera quantize`, got `{}`",
            a.input.display()
        );
    }
    let out_kind = FileKind::of(&a.output)?;
    let file = SafetensorsFile::read(&a.input)?;
    let tensors = load_quantized(&file).with_context(|| format!("`{}`", a.input.display()))?;
    match out_kind {
        FileKind::Npy => {
            let mut it = tensors.iter();
            let (Some((name, qt)), None) = (it.next(), it.next()) else {
                bail!(
                    "a .npy file holds one tensor, but `{}` has {}; write a .safetensors file instead",
                    a.input.display(),
                    tensors.len()
                );
            };
            let t = qt
                .dequantize(qt.source_dtype())
                .with_context(|| format!("tensor `{name}`"))?;
            io::write_npy(&a.output, &npy_compatible(&t)?)
        }
        FileKind::Safetensors => {
            let mut out = Vec::with_capacity(tensors.len());
            for (name, qt) in &tensors {
                let t = qt
                    .dequantize(qt.source_dtype())
                    .with_context(|| format!("tensor `{name}`"))?;
                out.push((name.clone(), t));
            }
            let refs: Vec<(String, &Tensor)> = out.iter().map(|(n, t)| (n.clone(), t)).collect();
            io::write_safetensors(&a.output, &refs, BTreeMap::new())
        }
    }
}

/// `t` in a dtype `.npy` has: bf16 is widened (exactly) to f32, f32 and f16 are kept.
fn npy_compatible(t: &Tensor) -> anyhow::Result<Tensor> {
    Ok(match t.dtype() {
        DType::BF16 => Tensor::from_slice(&t.to_f32_vec()?, t.shape(), Device::Cpu)?,
        _ => t.clone(),
    })
}

/// Rebuilds every quantized tensor a file written by `tessera quantize` holds, checking
/// each buffer's dtype (against what the format stores it as) and shape (with
/// [`QuantizedTensor::from_buffers`]), that every tensor has the buffers of the usage the
/// metadata names, and that the file holds no entry belonging to no tensor.
pub fn load_quantized(file: &SafetensorsFile) -> anyhow::Result<BTreeMap<String, QuantizedTensor>> {
    let meta = file.metadata();
    let recipe = Recipe::from_metadata(&meta)?;
    let kind = recipe.kind();
    let mut used = BTreeSet::new();
    let mut out = BTreeMap::new();
    for (name, (shape, dtype)) in recipe::tensors_from_metadata(&meta)? {
        let specs = tessera_quant::buffer_specs(&kind, &shape).map_err(|e| {
            anyhow::anyhow!(
                "tensor `{name}` of shape {shape} cannot be a {} tensor: {e}",
                recipe.format.name()
            )
        })?;
        let mut buffers = BTreeMap::new();
        for spec in specs {
            let key = format!("{name}.{}", spec.name.name());
            let Some(stored) = file.get(&key) else {
                continue;
            };
            let want = io::storage_dtype(spec.dtype)?;
            if stored.dtype != want {
                bail!(
                    "entry `{key}` is {}, but a {} file stores it as {want}",
                    stored.dtype,
                    recipe.describe()
                );
            }
            let t = Tensor::from_bytes(
                stored.data,
                Shape::new(stored.shape.clone()),
                spec.dtype,
                Device::Cpu,
            )
            .with_context(|| format!("entry `{key}`"))?;
            buffers.insert(spec.name, t);
            used.insert(key);
        }
        if buffers.is_empty() {
            bail!("the metadata lists tensor `{name}`, but the file has none of its buffers");
        }
        let qt = QuantizedTensor::from_buffers(kind, shape, dtype, buffers)
            .with_context(|| format!("tensor `{name}`"))?;
        if qt.usage() != recipe.usage {
            bail!(
                "tensor `{name}` has {} buffers, but the metadata says usage {}",
                qt.usage().name(),
                recipe.usage.name()
            );
        }
        out.insert(name, qt);
    }
    if let Some(stray) = file.names().into_iter().find(|n| !used.contains(n)) {
        bail!("entry `{stray}` belongs to no tensor the metadata lists");
    }
    Ok(out)
}
