//! `tessera quantize`: every tensor of a file into TransformerEngine buffers.

use std::collections::BTreeMap;

use anyhow::{Context, bail};
use tessera_core::Tensor;
use tessera_quant::QuantizedTensor;

use crate::args::QuantizeArgs;
use crate::io::{self, FileKind, Input};
use crate::progress;
use crate::recipe::{self, Recipe};

/// Runs `tessera quantize`.
pub fn run(a: &QuantizeArgs) -> anyhow::Result<()> {
    let recipe = Recipe::from_args(&a.quant)?;
    if FileKind::of(&a.output).ok() != Some(FileKind::Safetensors) {
        bail!(
            "the output must be a .safetensors file, got `{}`",
            a.output.display()
        );
    }
    let input = Input::read(&a.input)?;
    let quantized = quantize_input(&input, &recipe)?;
    let mut metadata = recipe.to_metadata();
    let mut buffers: Vec<(String, &Tensor)> = Vec::new();
    for (name, qt) in &quantized {
        metadata.extend(recipe::tensor_metadata(name, qt.shape(), qt.source_dtype()));
        for (b, t) in qt.data_tensors() {
            buffers.push((format!("{name}.{}", b.name()), t));
        }
    }
    io::write_safetensors(&a.output, &buffers, metadata)
}

/// Quantizes every tensor of `input` with one quantizer, in name order. Every tensor's
/// dtype and shape are checked first, so a file that cannot be quantized fails before
/// any work is done.
pub fn quantize_input(
    input: &Input,
    recipe: &Recipe,
) -> anyhow::Result<BTreeMap<String, QuantizedTensor>> {
    let mut quantizer = recipe.quantizer()?;
    let file = input.path.display();
    for e in &input.entries {
        if let Some(why) = e.unsupported_reason(input.kind) {
            bail!("`{file}`: tensor `{}`: {why}", e.name);
        }
        if let Some(why) = recipe::shape_problem(quantizer.as_ref(), &e.shape) {
            bail!(
                "`{file}`: tensor `{}` of shape {} cannot be quantized as {}: {why}",
                e.name,
                e.shape,
                recipe.format.name()
            );
        }
    }
    let bar = progress::bar(input.total_bytes());
    let mut out = BTreeMap::new();
    for e in &input.entries {
        bar.set_message(e.name.clone());
        let x = input.tensor(e)?;
        let qt = quantizer
            .quantize(&x)
            .with_context(|| format!("`{file}`: tensor `{}`", e.name))?;
        out.insert(e.name.clone(), qt);
        bar.inc(e.size_in_bytes() as u64);
    }
    bar.finish_and_clear();
    Ok(out)
}
