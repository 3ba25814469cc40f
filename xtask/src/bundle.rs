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
    // Only binaries with GPU (ignored) tests travel: the bundle must stay small enough
    // to copy to a GPU machine.
    let bins: Vec<PathBuf> = bins.into_iter().filter(|b| has_ignored_tests(b)).collect();
    let names = install(&bins, &dir.join("bin"))?;
    let mut script = String::from(RUN_TESTS_HEAD);
    for n in &names {
        writeln!(
            script,
            "echo \"== {n}\"; ./bin/{n} --ignored --test-threads=1 --skip multi_gpu_ --skip multi_process_ \"${{args[@]}}\" || fail=1"
        )?;
    }
    script.push_str("if [ \"$gpus\" -ge 2 ]; then\n");
    for n in &names {
        writeln!(
            script,
            "  echo \"== {n} (multi-GPU)\"; ./bin/{n} --ignored --test-threads=1 multi_gpu_ \"${{args[@]}}\" || fail=1"
        )?;
    }
    script.push_str("fi\n");
    // The one-process-per-GPU tests run at every GPU count, world size 1 included.
    for n in &names {
        writeln!(script, "launch ./bin/{n} || fail=1")?;
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

/// The start of `run-tests.sh`: argument parsing, the NCCL shim, and the launcher of the
/// one-process-per-GPU tests.
const RUN_TESTS_HEAD: &str = r#"#!/usr/bin/env bash
# Runs the GPU tests of every bundled test binary: ./run-tests.sh [--gpus N] [test args...]
# With --gpus N (N >= 2) also the multi-GPU tests. The multi_process_ tests run as N
# processes per binary (1 by default) with the torchrun variables.
cd "$(dirname "$0")"
gpus=1
args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --gpus) gpus="$2"; shift 2 ;;
    *) args+=("$1"); shift ;;
  esac
done
export NCCL_NVLS_ENABLE=0
# cudarc loads libnccl.so; where only the runtime's libnccl.so.2 exists, link it.
if ! ldconfig -p 2>/dev/null | grep -q 'libnccl\.so '; then
  so2=$(ldconfig -p 2>/dev/null | awk '/libnccl\.so\.2 /{print $NF; exit}')
  if [ -n "$so2" ]; then
    shim="${TMPDIR:-/tmp}/tessera-nccl-shim"
    mkdir -p "$shim" && ln -sf "$so2" "$shim/libnccl.so"
    export LD_LIBRARY_PATH="$shim${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  fi
fi
# launch BIN: one process per GPU running BIN's multi_process_ tests.
launch() {
  local bin="$1" port=$((29500 + RANDOM % 1000)) pids=() status=0
  if ! "$bin" --list --ignored 2>/dev/null | grep -q '^multi_process_'; then return 0; fi
  echo "== $bin (one process per GPU, $gpus ranks)"
  for r in $(seq 0 $((gpus - 1))); do
    RANK=$r WORLD_SIZE=$gpus LOCAL_RANK=$r MASTER_ADDR=127.0.0.1 MASTER_PORT=$port       "$bin" --ignored --test-threads=1 multi_process_ &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p" || status=1; done
  return $status
}
fail=0
"#;

/// Builds the GPU benchmark binaries into `dir/bin`, copies the PyTorch anchor script
/// when `../shared/bench/torch_anchor.py` exists and `bench/alternate.sh` (runs the
/// binaries of several builds in turn), and writes `dir/run-bench.sh OUTDIR`, which runs
/// every binary (JSON into `OUTDIR/PACKAGE.json`) and then the anchor script.
pub(crate) fn benches(root: &Path, dir: &Path) -> Result<()> {
    let mut runs = Vec::new(); // (package, executable)
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
        let exes = build(c, |msg| {
            msg["target"]["name"] == *bench && msg["target"]["kind"][0] == "bench"
        })?;
        runs.extend(exes.into_iter().map(|exe| (*package, exe)));
    }
    let exes: Vec<PathBuf> = runs.iter().map(|(_, exe)| exe.clone()).collect();
    let names = install(&exes, &dir.join("bin"))?;
    let anchor = root.join("../shared/bench/torch_anchor.py");
    if anchor.is_file() {
        copy_over(&anchor, &dir.join("torch_anchor.py"))?;
    }
    copy_over(&root.join("bench/alternate.sh"), &dir.join("alternate.sh"))?;
    let mut script = String::from(
        "#!/usr/bin/env bash\n# Runs every bundled GPU benchmark; JSON goes to $1 (default .).\n\
         cd \"$(dirname \"$0\")\"\nout=${1:-.}\nmkdir -p \"$out\"\nfail=0\n",
    );
    for (package, exe) in &runs {
        let n = file_name(exe)?;
        writeln!(script, "./bin/{n} --json \"$out/{package}.json\" || fail=1")?;
    }
    script.push_str(RUN_ANCHOR);
    script.push_str("exit $fail\n");
    write_script(&dir.join("run-bench.sh"), &script)?;
    println!(
        "bundled {} benchmark binaries into {}",
        names.len(),
        dir.display()
    );
    Ok(())
}

/// The tail of `run-bench.sh` that measures the PyTorch peers (the issue asks for them
/// in the same device call as the kernels) where the bundle carries the anchor script,
/// and says so on stderr where it cannot: no script bundled, or no python3 with torch.
const RUN_ANCHOR: &str = r#"if [ ! -f torch_anchor.py ]; then
  echo "run-bench.sh: PyTorch peers not measured: no torch_anchor.py in the bundle" >&2
elif ! python3 -c 'import torch' 2>/dev/null; then
  echo "run-bench.sh: PyTorch peers not measured: python3 cannot import torch" >&2
else
  python3 torch_anchor.py --json "$out/torch_anchor.json" || fail=1
fi
"#;

/// Copies `src` to `dest`, replacing a previous copy even where it is read-only (as the
/// shared anchor script is, and so its copy in an earlier bundle).
fn copy_over(src: &Path, dest: &Path) -> Result<()> {
    let _ = std::fs::remove_file(dest);
    std::fs::copy(src, dest)?;
    Ok(())
}

/// Whether a test binary lists any ignored test (`--list --ignored`).
fn has_ignored_tests(exe: &Path) -> bool {
    Command::new(exe)
        .args(["--list", "--ignored"])
        .output()
        .map(|o| {
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .any(|l| l.ends_with(": test"))
        })
        .unwrap_or(true)
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
        let name = file_name(exe)?;
        std::fs::copy(exe, bin.join(&name))?;
        names.push(name);
    }
    names.sort();
    names.dedup();
    Ok(names)
}

/// An executable's file name, as `install` copies it into `bin`.
fn file_name(exe: &Path) -> Result<String> {
    Ok(exe
        .file_name()
        .context("executable without a file name")?
        .to_string_lossy()
        .into_owned())
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

#[cfg(all(test, unix))]
mod tests {
    use super::*;

    /// `bench/alternate.sh`, which the bench bundle carries, run with fake benchmarks: a
    /// run of every label a round, each with its own and the common arguments and its
    /// JSON path; a failing binary reported in the exit status, the runs after it
    /// going on; malformed labels and missing binaries refused.
    #[test]
    fn alternate_runs_every_build_in_turn() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        let dir = std::env::temp_dir().join(format!("tessera-alternate-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        // Writes its arguments into the file after --json.
        let fake = dir.join("fake.sh");
        write_script(
            &fake,
            "#!/usr/bin/env bash\nargs=\"$*\"\nwhile [ $# -gt 1 ]; do shift; done\necho \"$args\" > \"$1\"\n",
        )
        .unwrap();
        let fails = dir.join("fails.sh");
        write_script(&fails, "#!/usr/bin/env bash\nexit 3\n").unwrap();
        let run = |args: &[&str]| {
            Command::new("bash")
                .arg(root.join("bench/alternate.sh"))
                .args(args)
                .current_dir(&dir)
                .output()
                .unwrap()
        };
        let out = run(&[
            "1",
            "out",
            "a=./fake.sh --x 1",
            "b=./fake.sh",
            "--",
            "--shape",
            "16x16",
        ]);
        assert!(out.status.success(), "{out:?}");
        let read = |f: &str| std::fs::read_to_string(dir.join("out").join(f)).unwrap();
        assert_eq!(
            read("a-0.json"),
            "--x 1 --shape 16x16 --json out/a-0.json\n"
        );
        assert_eq!(read("b-0.json"), "--shape 16x16 --json out/b-0.json\n");
        // The failing build first: the run after it in the same round still happens.
        let out = run(&["1", "out2", "b=./fails.sh", "a=./fake.sh"]);
        assert!(!out.status.success());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("b failed in round 0"), "{err}");
        assert!(dir.join("out2/a-0.json").is_file(), "{err}");
        for bad in [
            &["1", "o", "nolabel"][..],
            &["1", "o", "a=./missing.sh"],
            &["1"],
        ] {
            assert_eq!(run(bad).status.code(), Some(2), "{bad:?}");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// `run-bench.sh`'s anchor step with a fake `python3` first on PATH: the peers
    /// measured into `OUT/torch_anchor.json` where torch imports, a line on stderr and
    /// no failure where it does not or the script is missing, a failing script failing
    /// the run.
    #[test]
    fn run_bench_measures_the_peers_or_says_why_not() {
        let dir = std::env::temp_dir().join(format!("tessera-anchor-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("shim")).unwrap();
        let script = dir.join("run.sh");
        write_script(
            &script,
            &format!("#!/usr/bin/env bash\ncd \"$(dirname \"$0\")\"\nout=o\nfail=0\n{RUN_ANCHOR}exit $fail\n"),
        )
        .unwrap();
        // `python3 -c ...` exits with $TORCH; `python3 SCRIPT --json F` runs SCRIPT's
        // shell body with F.
        write_script(
            &dir.join("shim/python3"),
            "#!/usr/bin/env bash\nif [ \"$1\" = -c ]; then exit \"$TORCH\"; fi\nbash \"$1\" \"$3\"\n",
        )
        .unwrap();
        let path = format!(
            "{}:{}",
            dir.join("shim").display(),
            std::env::var("PATH").unwrap()
        );
        let run = |torch: &str| {
            Command::new("bash")
                .arg(&script)
                .env("PATH", &path)
                .env("TORCH", torch)
                .output()
                .unwrap()
        };
        let stderr = |o: &std::process::Output| String::from_utf8_lossy(&o.stderr).into_owned();
        let out = run("0");
        assert!(out.status.success(), "{out:?}");
        assert!(stderr(&out).contains("no torch_anchor.py"), "{out:?}");
        std::fs::create_dir_all(dir.join("o")).unwrap();
        std::fs::write(dir.join("torch_anchor.py"), "echo peers > \"$1\"\n").unwrap();
        let out = run("1");
        assert!(out.status.success(), "{out:?}");
        assert!(stderr(&out).contains("cannot import torch"), "{out:?}");
        assert!(!dir.join("o/torch_anchor.json").exists());
        let out = run("0");
        assert!(out.status.success(), "{out:?}");
        assert_eq!(
            std::fs::read_to_string(dir.join("o/torch_anchor.json")).unwrap(),
            "peers\n"
        );
        std::fs::write(dir.join("torch_anchor.py"), "exit 4\n").unwrap();
        assert!(!run("0").status.success());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
