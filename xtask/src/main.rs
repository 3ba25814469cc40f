//! `cargo xtask`: the project's automation.
//!
//! - `ptx`: compile every `crates/*/kernels/*.cu` with nvcc into the committed
//!   `kernels/ptx/*.ptx`, each headed by its source's hash, and each PTX file with
//!   ptxas into its sm_90 cubin (`*.sm_90.cubin`, with the PTX's hash beside it).
//! - `test-gpu`: run the GPU tests (the `#[ignore]`d ones), or with `--bundle DIR` build
//!   them into a directory that runs on a GPU machine without cargo.
//! - `bench-gpu`: run the GPU benchmarks (table + JSON) and the PyTorch peers
//!   (`../shared/bench/torch_anchor.py`, where python3 has torch), or bundle them likewise.
//! - `bench-compare`: two builds' benchmark JSON side by side, as a Markdown table.
//! - `bench-merge`: one build's benchmark runs in one file of many runs.
//! - `ci`: what `.ci/run` runs.

mod bundle;
mod compare;
mod ptx;

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "cargo xtask", about = "tessera's project automation")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Compile crates/*/kernels/*.cu to committed PTX and sm_90 cubins (needs nvcc:
    /// $NVCC, PATH, $CUDA_HOME/bin or /usr/local/cuda/bin; ptxas beside it).
    Ptx {
        /// Also print ptxas's resource report (registers, spills) for sm_90.
        #[arg(long)]
        resources: bool,
        /// Write the PTX and cubins under this directory (mirroring crates/) instead of
        /// in place.
        #[arg(long)]
        out: Option<PathBuf>,
    },
    /// Run the GPU tests (the ignored ones) with the `cuda` features.
    ///
    /// With `--gpus N` (N ≥ 2) it also runs the multi-GPU tests (one thread per GPU). The
    /// one-process-per-GPU tests (`multi_process_*`) run as N processes (1 by default)
    /// with the torchrun variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
    /// MASTER_PORT).
    TestGpu {
        /// Instead of running, build stripped release test binaries and a `run-tests.sh`
        /// into DIR, for a machine with a GPU and no cargo.
        #[arg(long, value_name = "DIR")]
        bundle: Option<PathBuf>,
        /// GPUs to use (1: skip the multi-GPU tests; the multi-process tests run as one
        /// rank).
        #[arg(long, default_value_t = 1)]
        gpus: u32,
    },
    /// Run the GPU benchmarks: a table on stdout and JSON per crate; then the PyTorch
    /// peers (`../shared/bench/torch_anchor.py`) into `torch_anchor.json` where python3
    /// imports torch (a line on stderr says when they were not measured).
    BenchGpu {
        /// Instead of running, build the benchmark binaries, the anchor script and a
        /// `run-bench.sh` (which runs them all) into DIR.
        #[arg(long, value_name = "DIR")]
        bundle: Option<PathBuf>,
        /// Directory for the JSON results.
        #[arg(long, default_value = "target/bench-gpu")]
        json_dir: PathBuf,
    },
    /// Compare the JSON of two builds' GPU benchmark runs (each run once or more, best
    /// alternated in one device call): one Markdown row per shape and kernel with every
    /// run's ratio to copy (and to its floor), and the change of the median time.
    BenchCompare {
        /// JSON files of the baseline build, one per run.
        #[arg(long, required = true, num_args = 1..)]
        base: Vec<PathBuf>,
        /// JSON files of the build under test, one per run.
        #[arg(long = "new", required = true, num_args = 1..)]
        new: Vec<PathBuf>,
        /// Leave out rows whose median time changed by less than this fraction (0.01:
        /// 1%); rows of one build only are always shown.
        #[arg(long, default_value_t = 0.0)]
        min_change: f64,
    },
    /// Merge the JSON of one build's GPU benchmark runs into one file of many runs (an
    /// array per field, an entry per run, in the order given), as kept under
    /// bench/results; bench-compare reads both kinds.
    BenchMerge {
        /// The runs' JSON files, in run order (files of many runs may be merged again).
        #[arg(required = true, num_args = 1..)]
        runs: Vec<PathBuf>,
        /// Where to write the merged file.
        #[arg(long)]
        out: PathBuf,
        /// The build and card, kept in the file as "build".
        #[arg(long)]
        label: Option<String>,
    },
    /// fmt check, clippy -D warnings, the tests, and builds with and without `cuda`.
    Ci,
}

fn main() -> Result<()> {
    let root = workspace_root();
    match Cli::parse().cmd {
        Cmd::Ptx { resources, out } => ptx::run(&root, resources, out.as_deref()),
        Cmd::TestGpu {
            bundle: Some(dir), ..
        } => bundle::tests(&root, &dir),
        Cmd::TestGpu { bundle: None, gpus } => {
            // One code path for both: build the bundle, run its script.
            let dir = root.join("target/gpu-tests");
            bundle::tests(&root, &dir)?;
            let mut c = Command::new(dir.join("run-tests.sh"));
            c.arg("--gpus").arg(gpus.to_string());
            run(c)
        }
        Cmd::BenchGpu {
            bundle: Some(dir), ..
        } => bundle::benches(&root, &dir),
        Cmd::BenchGpu {
            bundle: None,
            json_dir,
        } => {
            // As for the tests: build the bundle, run its script (which changes into the
            // bundle's directory, so the JSON directory goes to it absolute).
            let dir = root.join("target/gpu-bench");
            bundle::benches(&root, &dir)?;
            let mut c = Command::new(dir.join("run-bench.sh"));
            c.arg(std::path::absolute(&json_dir)?);
            run(c)
        }
        Cmd::BenchCompare {
            base,
            new,
            min_change,
        } => compare::run(&base, &new, min_change),
        Cmd::BenchMerge { runs, out, label } => compare::run_merge(&runs, &out, label.as_deref()),
        Cmd::Ci => {
            let mut c = Command::new(root.join(".ci/run"));
            c.current_dir(&root);
            run(c)
        }
    }
}

/// The workspace root: the parent of this crate's manifest directory.
fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lives one level below the workspace root")
        .to_path_buf()
}

fn run(mut c: Command) -> Result<()> {
    let status = c.status().with_context(|| format!("spawning {c:?}"))?;
    if !status.success() {
        bail!("{c:?} failed with {status}");
    }
    Ok(())
}
