//! `tessera gather`: shard, quantize per rank, all-gather the quantized bytes.

use std::collections::BTreeMap;
use std::sync::Arc;

use anyhow::{Context, bail};
use tessera_collectives::{MaybeQuantized, ProcessGroup, gather_along_first_dim, run_ranks};
use tessera_core::{Device, Tensor};
use tessera_quant::{QuantizedTensor, wire};

use crate::args::{Backend, GatherArgs};
use crate::io::{self, FileKind, Input};
use crate::recipe::{self, Recipe};

/// What rank 0 gathered for one tensor, and what each rank sent.
struct Gathered {
    tensor: QuantizedTensor,
    sent_bytes: usize,
    quantized_on_the_wire: bool,
}

/// Runs `tessera gather`.
pub fn run(a: &GatherArgs) -> anyhow::Result<()> {
    let recipe = Recipe::from_args(&a.quant)?;
    if FileKind::of(&a.output).ok() != Some(FileKind::Safetensors) {
        bail!(
            "the output must be a .safetensors file, got `{}`",
            a.output.display()
        );
    }
    let world = a.world as usize;
    let input = Input::read(&a.input)?;
    let file = input.path.display().to_string();
    let mut tensors = Vec::new();
    for e in &input.entries {
        if let Some(why) = e.unsupported_reason(input.kind) {
            bail!("`{file}`: tensor `{}`: {why}", e.name);
        }
        let d0 = e.shape.dims().first().copied().unwrap_or(1);
        if e.shape.rank() == 0 || d0 % world != 0 {
            bail!(
                "`{file}`: tensor `{}` of shape {}: its first dimension {d0} is not divisible by --world {world}",
                e.name,
                e.shape
            );
        }
        tensors.push((e.name.clone(), input.tensor(e)?));
    }
    let rank0 = match a.backend {
        Backend::Threads => {
            let results = run_ranks(world, |g| gather_on_rank(Arc::new(g), &tensors, &recipe))?;
            let mut ranks = results.into_iter();
            let rank0 = ranks.next().context("no ranks ran")??;
            for (r, res) in ranks.enumerate() {
                res.with_context(|| format!("rank {}", r + 1))?;
            }
            rank0
        }
        Backend::Nccl => {
            let group = nccl_group(world)?;
            let rank = group.rank();
            let gathered = gather_on_rank(group, &tensors, &recipe)
                .with_context(|| format!("rank {rank} of {world}"))?;
            if rank != 0 {
                // Rank 0 writes the file and prints the table.
                return Ok(());
            }
            gathered
        }
    };
    let mut metadata = recipe.to_metadata();
    metadata.insert("gathered_from_ranks".into(), world.to_string());
    let mut buffers: Vec<(String, &Tensor)> = Vec::new();
    println!(
        "{:32} {:>16} {:>16} {:>14} {:>12}",
        "tensor", "shard", "gathered", "sent per rank", "on the wire"
    );
    for (name, g) in &rank0 {
        let shard_shape = {
            let mut d = g.tensor.shape().dims().to_vec();
            d[0] /= world;
            tessera_core::Shape::new(d)
        };
        println!(
            "{:32} {:>16} {:>16} {:>14} {:>12}",
            name,
            shard_shape.to_string(),
            g.tensor.shape().to_string(),
            g.sent_bytes,
            if g.quantized_on_the_wire {
                "quantized"
            } else {
                "high prec."
            }
        );
        metadata.extend(recipe::tensor_metadata(
            name,
            g.tensor.shape(),
            g.tensor.source_dtype(),
        ));
        for (b, t) in g.tensor.data_tensors() {
            buffers.push((format!("{name}.{}", b.name()), t));
        }
    }
    io::write_safetensors(&a.output, &buffers, metadata)
}

/// One rank's part: quantize its shard of every tensor on the group's device, all-gather
/// the quantized bytes, and bring the gathered tensors to the host.
fn gather_on_rank(
    group: Arc<dyn ProcessGroup>,
    tensors: &[(String, Tensor)],
    recipe: &Recipe,
) -> anyhow::Result<BTreeMap<String, Gathered>> {
    let (rank, world, device) = (group.rank(), group.size(), group.device());
    let mut quantizer = recipe.quantizer()?;
    let mut out = BTreeMap::new();
    for (name, t) in tensors {
        if let Some(why) = recipe::shape_problem(quantizer.as_ref(), t.shape()) {
            bail!(
                "tensor `{name}` of shape {} cannot be quantized as {}: {why}",
                t.shape(),
                recipe.format.name()
            );
        }
        let shard = shard_of(t, world, rank)?.to_device(device)?;
        let quantized_on_the_wire = quantizer.is_quantizable(shard.shape());
        let sent_bytes = if quantized_on_the_wire {
            let local = quantizer.quantize(&shard)?;
            wire::pack(&local)
                .map(|p| p.iter().map(|(_, t)| t.size_in_bytes()).sum())
                .unwrap_or(shard.size_in_bytes())
        } else {
            shard.size_in_bytes()
        };
        let gathered = gather_along_first_dim(
            &MaybeQuantized::Plain(shard),
            &group,
            Some(quantizer.as_mut()),
        )?
        .into_result()
        .with_context(|| format!("gathering tensor `{name}`"))?;
        let MaybeQuantized::Quantized(tensor) = gathered else {
            bail!("tensor `{name}` came back unquantized");
        };
        out.insert(
            name.clone(),
            Gathered {
                tensor: tensor.to_device(Device::Cpu)?,
                sent_bytes,
                quantized_on_the_wire,
            },
        );
    }
    Ok(out)
}

/// This process's rank of the NCCL group its launcher started (torchrun variables),
/// checked against `--world`.
#[cfg(feature = "cuda")]
fn nccl_group(world: usize) -> anyhow::Result<Arc<dyn ProcessGroup>> {
    let group = tessera_collectives::nccl::NcclGroup::from_env().context(
        "--backend nccl: joining the NCCL group of this process's launcher (one process per \
         GPU with RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT set)",
    )?;
    if group.size() != world {
        bail!(
            "--backend nccl: --world {world} but the launcher started {} ranks (WORLD_SIZE)",
            group.size()
        );
    }
    Ok(Arc::new(group))
}

/// Without the `cuda` feature there is no NCCL group to join.
#[cfg(not(feature = "cuda"))]
fn nccl_group(_world: usize) -> anyhow::Result<Arc<dyn ProcessGroup>> {
    bail!(
        "--backend nccl needs a tessera built with the `cuda` feature \
         (cargo build -p tessera-cli --features cuda); use --backend threads here"
    )
}

/// Rank `rank`'s equal share of `t`'s first dimension.
fn shard_of(t: &Tensor, world: usize, rank: usize) -> anyhow::Result<Tensor> {
    let mut d = t.shape().dims().to_vec();
    d[0] /= world;
    let bytes = t.size_in_bytes() / world;
    let all = t.as_bytes()?;
    Ok(Tensor::from_bytes(
        &all[rank * bytes..][..bytes],
        d,
        t.dtype(),
        Device::Cpu,
    )?)
}
