//! `tessera gather --backend nccl`: one process per GPU, started with the torchrun
//! variables by `cargo xtask test-gpu` (world size 1 on a one-GPU machine). Rank 0's file
//! must hold, byte for byte, what `tessera quantize` writes for the whole input.

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};

use clap::Parser;
use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};
use tessera_collectives::{RendezvousEnv, Store};

/// This rank's scratch directory (every rank writes its own copy of the same input).
fn scratch(rank: usize) -> PathBuf {
    let port = std::env::var("MASTER_PORT").unwrap_or_default();
    let dir = std::env::temp_dir().join(format!("tessera-gather-nccl-{port}-rank{rank}"));
    let _ = fs::remove_dir_all(&dir);
    fs::create_dir_all(&dir).unwrap();
    dir
}

/// Deterministic values of several magnitudes (a small LCG: every rank gets the same).
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|i| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let u = (s >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
            u * [0.01f32, 1.0, 300.0][i % 3]
        })
        .collect()
}

fn run_tessera(args: &[&str]) -> anyhow::Result<()> {
    let cli =
        tessera_cli::Cli::try_parse_from(std::iter::once("tessera").chain(args.iter().copied()))?;
    tessera_cli::run(cli)
}

/// Every tensor of a .safetensors file: name → (dtype, shape, bytes), and its metadata.
type Contents = (
    BTreeMap<String, (Dtype, Vec<usize>, Vec<u8>)>,
    BTreeMap<String, String>,
);

fn read(path: &Path) -> Contents {
    let bytes = fs::read(path).unwrap();
    let (_, meta) = SafeTensors::read_metadata(&bytes).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let tensors = st
        .tensors()
        .into_iter()
        .map(|(n, v)| (n, (v.dtype(), v.shape().to_vec(), v.data().to_vec())))
        .collect();
    let metadata = meta
        .metadata()
        .clone()
        .unwrap_or_default()
        .into_iter()
        .collect();
    (tensors, metadata)
}

#[test]
#[ignore = "needs a CUDA GPU: cargo xtask test-gpu"]
fn multi_process_gather_over_nccl_equals_quantize() {
    let var = |k: &str| -> usize {
        std::env::var(k)
            .unwrap_or_else(|_| panic!("{k} is not set: cargo xtask test-gpu starts this test with the torchrun variables"))
            .parse()
            .unwrap()
    };
    let (rank, world) = (var("RANK"), var("WORLD_SIZE"));
    // Each `tessera gather` below joins (and leaves) its own NCCL group through a store
    // on MASTER_PORT that rank 0 hosts. A rank that ran ahead could reach the previous
    // command's store before rank 0 closes it and read a stale NCCL id, so the ranks
    // meet on a second store (MASTER_PORT + 1) between commands.
    let port = var("MASTER_PORT") + 1;
    let env = RendezvousEnv::from_lookup(|k| match k {
        "MASTER_PORT" => Some(port.to_string()),
        _ => std::env::var(k).ok(),
    })
    .unwrap();
    let between = Store::from_rendezvous(&env, std::time::Duration::from_secs(300)).unwrap();
    let dir = scratch(rank);
    let input = dir.join("model.safetensors");
    let w: Vec<u8> = values(world * 128 * 256, 1)
        .iter()
        .flat_map(|v| half::bf16::from_f32(*v).to_le_bytes())
        .collect();
    let b: Vec<u8> = bytemuck::cast_slice(&values(world * 4 * 16 * 64, 2)).to_vec();
    let views = [
        (
            "w",
            TensorView::new(Dtype::BF16, vec![world * 128, 256], &w).unwrap(),
        ),
        (
            "b",
            TensorView::new(Dtype::F32, vec![world * 4, 16, 64], &b).unwrap(),
        ),
    ];
    safetensors::serialize_to_file(views, None, &input).unwrap();
    let world_arg = world.to_string();
    for format in ["fp8-current", "mxfp8", "nvfp4", "fp8-block"] {
        let gathered = dir.join(format!("gathered-{format}.safetensors"));
        run_tessera(&[
            "gather",
            "--world",
            &world_arg,
            "--backend",
            "nccl",
            "--format",
            format,
            input.to_str().unwrap(),
            gathered.to_str().unwrap(),
        ])
        .unwrap_or_else(|e| panic!("rank {rank}: gather {format}: {e:#}"));
        between.barrier(&format!("after {format}")).unwrap();
        if rank != 0 {
            assert!(!gathered.exists(), "only rank 0 writes the output");
            continue;
        }
        let whole = dir.join(format!("whole-{format}.safetensors"));
        run_tessera(&[
            "quantize",
            "--format",
            format,
            input.to_str().unwrap(),
            whole.to_str().unwrap(),
        ])
        .unwrap();
        let (g, gm) = read(&gathered);
        let (q, _) = read(&whole);
        assert!(!g.is_empty());
        assert_eq!(
            g, q,
            "{format}: the gathered bytes differ from quantizing the whole file"
        );
        assert_eq!(gm.get("gathered_from_ranks"), Some(&world_arg));
    }
    // --world must match the launcher's WORLD_SIZE.
    let e = run_tessera(&[
        "gather",
        "--world",
        &(2 * world).to_string(),
        "--backend",
        "nccl",
        "--format",
        "mxfp8",
        input.to_str().unwrap(),
        dir.join("never.safetensors").to_str().unwrap(),
    ])
    .unwrap_err();
    let msg = format!("{e:#}");
    assert!(msg.contains("but the launcher started"), "{msg}");
    // Rank 0 hosts `between`: it leaves last.
    between.barrier("end").unwrap();
    let _ = fs::remove_dir_all(&dir);
}
