//! `tessera demo --backend nccl`: one process per GPU, started with the torchrun
//! variables by `cargo xtask test-gpu` (world size 1 on a one-GPU machine). Every format
//! and checkpoint mode must agree with the reference (on rank 0's GPU) bit for bit, and
//! stay close to the same run on CPU thread ranks (the GEMMs block their sums
//! differently there).

use std::fs;
use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;
use serde_json::Value;
use tessera_collectives::{RendezvousEnv, Store};

fn var(k: &str) -> usize {
    std::env::var(k)
        .unwrap_or_else(|_| {
            panic!(
                "{k} is not set: cargo xtask test-gpu starts this test with the torchrun variables"
            )
        })
        .parse()
        .unwrap()
}

fn run_tessera(args: &[&str]) -> anyhow::Result<()> {
    let cli =
        tessera_cli::Cli::try_parse_from(std::iter::once("tessera").chain(args.iter().copied()))?;
    tessera_cli::run(cli)
}

fn read(path: &PathBuf) -> Value {
    serde_json::from_slice(&fs::read(path).expect("rank 0 wrote the report")).unwrap()
}

#[test]
#[ignore = "needs a CUDA GPU: cargo xtask test-gpu"]
fn multi_process_demo_over_nccl_agrees_with_its_reference() {
    let (rank, world) = (var("RANK"), var("WORLD_SIZE"));
    // Each demo joins (and leaves) its own NCCL group through the store on MASTER_PORT;
    // the ranks meet on a second store between runs so none reads a stale NCCL id.
    let port = var("MASTER_PORT") + 1;
    let env = RendezvousEnv::from_lookup(|k| match k {
        "MASTER_PORT" => Some(port.to_string()),
        _ => std::env::var(k).ok(),
    })
    .unwrap();
    let between = Store::from_rendezvous(&env, Duration::from_secs(300)).unwrap();
    let dir = std::env::temp_dir().join(format!("tessera-demo-nccl-{port}-rank{rank}"));
    let _ = fs::remove_dir_all(&dir);
    fs::create_dir_all(&dir).unwrap();
    // Tensor parallelism where there are two GPUs or more (groups of two ranks: NCCL's
    // sum of two terms is the reference's), data parallelism across the rest.
    let tp = if world.is_multiple_of(2) { 2 } else { 1 };
    let (tp_arg, dp_arg) = (tp.to_string(), (world / tp).to_string());
    // hidden 128 and 256 tokens: every shard holds whole blocks of every format.
    let small = [
        "--layers", "2", "--hidden", "128", "--seq", "256", "--steps", "3", "--lr", "2",
    ];
    let cases = [
        ("bf16", "none"),
        ("fp8-current", "reentrant"),
        ("fp8-delayed", "non-reentrant"),
        ("mxfp8", "none"),
        ("mxfp8", "reentrant"),
        ("mxfp8", "non-reentrant"),
        ("nvfp4", "non-reentrant"),
        ("fp8-block", "reentrant"),
    ];
    for (format, checkpoint) in cases {
        let name = format!("{format}-{checkpoint}");
        let report = dir.join(format!("{name}.json"));
        let mut args = vec![
            "demo",
            "--backend",
            "nccl",
            "--tp",
            &tp_arg,
            "--dp",
            &dp_arg,
            "--format",
            format,
            "--checkpoint",
            checkpoint,
            "--report",
            report.to_str().unwrap(),
        ];
        args.extend(small);
        run_tessera(&args).unwrap_or_else(|e| panic!("rank {rank}: demo {name}: {e:#}"));
        between.barrier(&format!("after {name}")).unwrap();
        if rank != 0 {
            assert!(!report.exists(), "only rank 0 writes the report");
            continue;
        }
        let r = read(&report);
        assert_eq!(r["passed"], true, "{name}: {r:#}");
        assert_eq!(r["max_abs_difference"], 0.0, "{name}: not bit for bit");
        assert_eq!(r["config"]["backend"], "nccl");
        assert_eq!(r["config"]["device"], "cuda:0", "rank 0 trains on its GPU");
        // The same run on CPU thread ranks: the same model, GEMM sums blocked otherwise.
        let cpu_report = dir.join(format!("{name}-cpu.json"));
        let mut cpu_args: Vec<&str> = args
            .iter()
            .copied()
            .filter(|a| *a != "nccl" && *a != "--backend")
            .collect();
        let at = cpu_args.iter().position(|a| *a == "--report").unwrap();
        cpu_args[at + 1] = cpu_report.to_str().unwrap();
        run_tessera(&cpu_args).unwrap_or_else(|e| panic!("demo {name} on threads: {e:#}"));
        let cpu = read(&cpu_report);
        let loss = |r: &Value, i: usize| r["steps"][i]["loss"].as_f64().unwrap();
        // Before any update only the GEMMs' rounding differs (and what it moves across
        // a quantization step); training carries that along, hence the looser bound.
        let first = (loss(&r, 0) - loss(&cpu, 0)).abs() / loss(&cpu, 0);
        assert!(
            first < 1e-3,
            "{name}: GPU loss {} vs CPU {}",
            loss(&r, 0),
            loss(&cpu, 0)
        );
        let last = (loss(&r, 2) - loss(&cpu, 2)).abs() / loss(&cpu, 2);
        assert!(
            last < 2e-2,
            "{name}: GPU loss {} vs CPU {}",
            loss(&r, 2),
            loss(&cpu, 2)
        );
        assert_eq!(
            r["communication"], cpu["communication"],
            "{name}: the collectives moved other bytes"
        );
    }
    // --tp × --dp must match the launcher's WORLD_SIZE.
    let wrong = (2 * world).to_string();
    let e = run_tessera(&[
        "demo",
        "--backend",
        "nccl",
        "--tp",
        "1",
        "--dp",
        &wrong,
        "--steps",
        "1",
    ])
    .unwrap_err();
    let msg = format!("{e:#}");
    assert!(msg.contains("but the launcher started"), "{msg}");
    // Rank 0 hosts `between`: it leaves last.
    between.barrier("end").unwrap();
    let _ = fs::remove_dir_all(&dir);
}
