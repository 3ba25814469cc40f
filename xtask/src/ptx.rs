//! `cargo xtask ptx`: CUDA sources to committed PTX.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};
use tessera_core::kernels::PTX_TARGET;

/// nvcc flags shared by the PTX build and the resource report, after `-arch` (from
/// [`PTX_TARGET`], which the kernel crates' freshness tests check the PTX against). No
/// fast-math: the kernels must round exactly like the CPU reference. Warnings are errors:
/// a member template called without `.template` in a template (`row.fp8<E4M3>(s, w)`)
/// parses as two comparisons and only warns ("expression has no effect").
const NVCC_FLAGS: &[&str] = &["-std=c++17", "-O3", "-Werror", "all-warnings"];

/// `-arch=sm_XY` for [`PTX_TARGET`].
fn arch_flag() -> String {
    format!("-arch=sm_{}{}", PTX_TARGET.0, PTX_TARGET.1)
}

pub(crate) fn run(root: &Path, resources: bool, out: Option<&Path>) -> Result<()> {
    let nvcc = find_nvcc()?;
    let ptxas = nvcc.with_file_name("ptxas");
    if !ptxas.is_file() {
        bail!("ptxas not found beside {}", nvcc.display());
    }
    let sources = kernel_sources(root)?;
    if sources.is_empty() {
        bail!("no crates/*/kernels/*.cu files under {}", root.display());
    }
    for cu in sources {
        let source = hashed_source(&cu)?;
        let rel = cu.strip_prefix(root).unwrap_or(&cu);
        let kernels_dir = rel.parent().expect("a kernels/ directory");
        let stem = cu.file_stem().expect("a file name").to_string_lossy();
        let dest_dir = out.unwrap_or(root).join(kernels_dir).join("ptx");
        std::fs::create_dir_all(&dest_dir)?;
        let dest = dest_dir.join(format!("{stem}.ptx"));
        let tmp = dest.with_extension("ptx.tmp");
        run_tool(
            Command::new(&nvcc)
                .arg(arch_flag())
                .args(NVCC_FLAGS)
                .arg("-ptx")
                .arg(&cu)
                .arg("-o")
                .arg(&tmp),
            rel,
        )?;
        let body = std::fs::read_to_string(&tmp)?;
        std::fs::remove_file(&tmp)?;
        let header = tessera_core::kernels::ptx_header(&source);
        let ptx = format!("{header}\n{body}");
        std::fs::write(&dest, &ptx)?;
        println!("{} -> {}", rel.display(), dest.display());
        let cubin = write_sass(&ptxas, &dest, &ptx)?;
        println!("{} -> {}", dest.display(), cubin.display());
        if resources {
            let cubin = std::env::temp_dir().join(format!("tessera-{stem}.cubin"));
            run_tool(
                Command::new(&nvcc)
                    .arg(arch_flag())
                    .args(NVCC_FLAGS)
                    .args(["-cubin", "-Xptxas", "-v"])
                    .arg(&cu)
                    .arg("-o")
                    .arg(&cubin),
                rel,
            )?;
        }
    }
    Ok(())
}

/// Runs `cmd` (nvcc or ptxas on `input`) to completion; an error names the program and
/// the input when it cannot start or fails.
fn run_tool(cmd: &mut Command, input: &Path) -> Result<()> {
    let program = cmd.get_program().to_string_lossy().into_owned();
    let status = cmd.status().with_context(|| format!("running {program}"))?;
    if !status.success() {
        bail!("{program} failed on {}", input.display());
    }
    Ok(())
}

/// Compiles the PTX file `ptx_path` (whose text is `ptx`) with ptxas into
/// `<stem>.sm_90.cubin` beside it, and records the PTX's SHA-256 in
/// `<stem>.sm_90.cubin.sha256` (see `tessera_core::kernels::Sass`). Returns the cubin's
/// path.
fn write_sass(ptxas: &Path, ptx_path: &Path, ptx: &str) -> Result<PathBuf> {
    use tessera_core::kernels::{SASS_INFIX, ptx_sha256};
    let stem = ptx_path.file_stem().expect("a file name").to_string_lossy();
    let cubin = ptx_path.with_file_name(format!("{stem}.{SASS_INFIX}.cubin"));
    let tmp = cubin.with_extension("cubin.tmp");
    run_tool(
        Command::new(ptxas)
            .arg(arch_flag())
            .arg(ptx_path)
            .arg("-o")
            .arg(&tmp),
        ptx_path,
    )?;
    std::fs::rename(&tmp, &cubin)?;
    let sha = cubin.with_file_name(format!("{stem}.{SASS_INFIX}.cubin.sha256"));
    std::fs::write(sha, format!("{}\n", ptx_sha256(ptx)))?;
    Ok(cubin)
}

/// The text a PTX file's hash covers: the `.cu` file followed by every `.cuh` header of
/// its directory, in name order (so a header change marks every kernel of the crate
/// stale).
fn hashed_source(cu: &Path) -> Result<String> {
    let mut text = std::fs::read_to_string(cu)?;
    let dir = cu.parent().expect("a kernels/ directory");
    let mut headers: Vec<PathBuf> = std::fs::read_dir(dir)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "cuh"))
        .collect();
    headers.sort();
    for h in headers {
        text.push_str(&std::fs::read_to_string(h)?);
    }
    Ok(text)
}

/// Every `crates/*/kernels/*.cu`, sorted.
fn kernel_sources(root: &Path) -> Result<Vec<PathBuf>> {
    let mut out = Vec::new();
    for krate in std::fs::read_dir(root.join("crates"))? {
        let dir = krate?.path().join("kernels");
        if !dir.is_dir() {
            continue;
        }
        for f in std::fs::read_dir(&dir)? {
            let f = f?.path();
            if f.extension().is_some_and(|e| e == "cu") {
                out.push(f);
            }
        }
    }
    out.sort();
    Ok(out)
}

fn find_nvcc() -> Result<PathBuf> {
    if let Some(p) = std::env::var_os("NVCC") {
        return Ok(p.into());
    }
    let mut candidates: Vec<PathBuf> = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).map(|d| d.join("nvcc")).collect())
        .unwrap_or_default();
    if let Some(home) = std::env::var_os("CUDA_HOME") {
        candidates.push(PathBuf::from(home).join("bin/nvcc"));
    }
    candidates.push("/usr/local/cuda/bin/nvcc".into());
    candidates
        .into_iter()
        .find(|p| p.is_file())
        .context("nvcc not found: set NVCC, put it on PATH, or set CUDA_HOME")
}
