//! `tessera consolidate`: one .safetensors file from a sharded FSDP checkpoint.

use std::io::Write;

use anyhow::{Context, bail};

use crate::args::ConsolidateArgs;
use crate::io::FileKind;

/// Runs `tessera consolidate`: reads the checkpoint's index and shards
/// ([`tessera_fsdp::consolidate`]), writes the output atomically and prints one line per
/// parameter and a summary.
pub fn run(a: &ConsolidateArgs) -> anyhow::Result<()> {
    if FileKind::of(&a.output).ok() != Some(FileKind::Safetensors) {
        bail!(
            "the output must be a .safetensors file, got `{}`",
            a.output.display()
        );
    }
    if !a.checkpoint.is_dir() {
        bail!(
            "`{}` is not a directory; pass the directory a sharded checkpoint was saved to",
            a.checkpoint.display()
        );
    }
    let c = tessera_fsdp::consolidate(&a.checkpoint, &a.output).with_context(|| {
        format!(
            "cannot consolidate the checkpoint in `{}`",
            a.checkpoint.display()
        )
    })?;
    let mut out = std::io::stdout().lock();
    for (name, shape) in &c.params {
        writeln!(out, "{name}  {shape}  f32  {} bytes", shape.numel() * 4)?;
    }
    writeln!(
        out,
        "consolidated {} parameters ({} bytes) saved at {} ranks into `{}`",
        c.params.len(),
        c.bytes,
        c.world_size,
        a.output.display()
    )?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use clap::Parser;
    use tessera_collectives::{ProcessGroup, run_ranks};
    use tessera_core::Tensor;
    use tessera_fsdp::mlp::{Activations, MlpSpec, batch, rows, train_step};
    use tessera_fsdp::{Fsdp, FsdpConfig};

    use super::*;
    use crate::io::SafetensorsFile;
    use crate::{Cli, Command};

    fn parse(args: &[&str]) -> ConsolidateArgs {
        let cli = Cli::try_parse_from(args).unwrap();
        let Command::Consolidate(a) = cli.command else {
            panic!("not consolidate")
        };
        a
    }

    #[test]
    fn consolidates_a_checkpoint_saved_at_three_ranks() {
        let dir =
            std::env::temp_dir().join(format!("tessera-cli-consolidate-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let ckpt = dir.join("ckpt");
        let spec = MlpSpec {
            d_model: 16,
            d_ffn: 20,
            layers: 2,
            seed: 4,
        };
        let x = batch(6, 16, 1).unwrap();
        let params = run_ranks(3, |g| -> tessera_core::Result<Vec<(String, Tensor)>> {
            let r = g.rank();
            let mut fsdp = Fsdp::new(Arc::new(g), FsdpConfig::default())?;
            spec.build(&mut fsdp)?;
            train_step(
                &mut fsdp,
                &rows(&x, 2 * r..2 * r + 2)?,
                0.1,
                Activations::Keep,
            )?;
            fsdp.save_sharded(&ckpt)?;
            fsdp.gather_full_parameters()
        })
        .unwrap()
        .remove(0)
        .unwrap();

        let out = dir.join("model.safetensors");
        let a = parse(&[
            "tessera",
            "consolidate",
            ckpt.to_str().unwrap(),
            out.to_str().unwrap(),
        ]);
        run(&a).unwrap();
        let f = SafetensorsFile::read(&out).unwrap();
        assert_eq!(f.metadata()["format"], "tessera-fsdp-consolidated");
        assert_eq!(f.metadata()["source_world_size"], "3");
        assert_eq!(f.names().len(), 4);
        for (name, t) in &params {
            let s = f.get(name).unwrap();
            assert_eq!(s.shape, t.shape().dims());
            assert_eq!(s.data, t.as_bytes().unwrap(), "{name}");
        }

        // Bad input: the wrong output kind, a directory that is not a checkpoint.
        let npy = dir.join("model.npy");
        let err = run(&parse(&[
            "tessera",
            "consolidate",
            ckpt.to_str().unwrap(),
            npy.to_str().unwrap(),
        ]))
        .unwrap_err();
        assert!(err.to_string().contains(".safetensors"), "{err}");
        let missing = dir.join("nope");
        let err = run(&parse(&[
            "tessera",
            "consolidate",
            missing.to_str().unwrap(),
            out.to_str().unwrap(),
        ]))
        .unwrap_err();
        assert!(err.to_string().contains("not a directory"), "{err}");
        let err = run(&parse(&[
            "tessera",
            "consolidate",
            dir.to_str().unwrap(),
            out.to_str().unwrap(),
        ]))
        .unwrap_err();
        assert!(crate::one_line(&err).contains("index.json"), "{err:#}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
