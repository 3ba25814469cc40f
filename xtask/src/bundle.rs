//! Self-contained bundles of GPU test and benchmark binaries, for a GPU machine that
//! has no Rust toolchain: build here, copy the directory there, run its script.

use std::fmt::Write as _;
use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{Context, Result, bail};

/// `(package, bench target)` of every GPU benchmark (`harness = false`, takes `--json`).
pub(crate) const GPU_BENCHES: &[(&str, &str)] = &[("tessera-rng", "gpu"), ("tessera-quant", "gpu")];

/// Builds the release test binaries of the workspace with all features into
/// `dir/bin` and writes `dir/run-tests.sh`, which runs each binary's ignored (GPU)
/// tests and exits non-zero if any fails.
pub(crate) fn tests(root: &Path, dir: &Path) -> Result<()> {
    let mut c = cargo_json(root);
    c.args([
        "test",
        "--workspace",
        "--all-features",
        "--release",
        "--no-run",
    ]);
    let bins = build(c, |msg| msg["profile"]["test"] == true)?;
    let names = install(&bins, &dir.join("bin"))?;
    let mut script = String::from(
        "#!/usr/bin/env bash\n# Runs the GPU tests of every bundled test binary.\n\
         cd \"$(dirname \"$0\")\"\nfail=0\n",
    );
    for n in &names {
        writeln!(
            script,
            "echo \"== {n}\"; ./bin/{n} --ignored --test-threads=1 \"$@\" || fail=1"
        )?;
    }
    script.push_str("exit $fail\n");
    write_script(&dir.join("run-tests.sh"), &script)?;
    println!(
        "bundled {} test binaries into {}",
        names.len(),
        dir.display()
    );
    Ok(())
}

/// Builds the GPU benchmark binaries into `dir/bin`, copies the PyTorch anchor script
/// when `../shared/bench/torch_anchor.py` exists, and writes `dir/run-bench.sh OUTDIR`.
pub(crate) fn benches(root: &Path, dir: &Path) -> Result<()> {
    let mut bins = Vec::new();
    for (package, bench) in GPU_BENCHES {
        let mut c = cargo_json(root);
        c.args([
            "bench",
            "--package",
            package,
            "--bench",
            bench,
            "--features",
            "cuda",
            "--no-run",
        ]);
        bins.extend(build(c, |msg| {
            msg["target"]["name"] == *bench && msg["target"]["kind"][0] == "bench"
        })?);
    }
    let names = install(&bins, &dir.join("bin"))?;
    let anchor = root.join("../shared/bench/torch_anchor.py");
    if anchor.is_file() {
        let dest = dir.join("torch_anchor.py");
        // The shared copy is read-only, and so is a previous bundle's.
        let _ = std::fs::remove_file(&dest);
        std::fs::copy(&anchor, &dest)?;
    }
    let mut script = String::from(
        "#!/usr/bin/env bash\n# Runs every bundled GPU benchmark; JSON goes to $1 (default .).\n\
         cd \"$(dirname \"$0\")\"\nout=${1:-.}\nmkdir -p \"$out\"\nfail=0\n",
    );
    for n in &names {
        writeln!(script, "./bin/{n} --json \"$out/{n}.json\" || fail=1")?;
    }
    script.push_str("exit $fail\n");
    write_script(&dir.join("run-bench.sh"), &script)?;
    println!(
        "bundled {} benchmark binaries into {}",
        names.len(),
        dir.display()
    );
    Ok(())
}

fn cargo_json(root: &Path) -> Command {
    let mut c = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    c.current_dir(root).arg("--quiet");
    c
}

/// Runs a `cargo ... --no-run` build with JSON messages and returns the executables of
/// the `compiler-artifact` messages that pass `keep`.
fn build(mut c: Command, keep: impl Fn(&serde_json::Value) -> bool) -> Result<Vec<PathBuf>> {
    c.arg("--message-format=json").stdout(Stdio::piped());
    let mut child = c.spawn().with_context(|| format!("spawning {c:?}"))?;
    let stdout = child.stdout.take().expect("piped stdout");
    let mut exes = Vec::new();
    for line in std::io::BufReader::new(stdout).lines() {
        let msg: serde_json::Value = match serde_json::from_str(&line?) {
            Ok(m) => m,
            Err(_) => continue,
        };
        if msg.get("reason").and_then(|r| r.as_str()) != Some("compiler-artifact") {
            continue;
        }
        if let Some(exe) = msg.get("executable").and_then(|e| e.as_str())
            && keep(&msg)
        {
            exes.push(PathBuf::from(exe));
        }
    }
    if !child.wait()?.success() {
        bail!("{c:?} failed");
    }
    Ok(exes)
}

/// Copies the executables into a fresh `bin` under their file names, returns the names.
fn install(exes: &[PathBuf], bin: &Path) -> Result<Vec<String>> {
    if bin.exists() {
        std::fs::remove_dir_all(bin)?; // binaries of an earlier build
    }
    std::fs::create_dir_all(bin)?;
    let mut names = Vec::new();
    for exe in exes {
        let name = exe
            .file_name()
            .context("executable without a file name")?
            .to_string_lossy()
            .into_owned();
        std::fs::copy(exe, bin.join(&name))?;
        names.push(name);
    }
    names.sort();
    names.dedup();
    Ok(names)
}

fn write_script(path: &Path, body: &str) -> Result<()> {
    std::fs::write(path, body)?;
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755))?;
    }
    Ok(())
}
