//! Compiled kernels shipped as PTX text, and the check that keeps them in step with
//! their CUDA sources.
//!
//! Kernel sources live beside the crate that launches them (`crates/<c>/kernels/*.cu`).
//! `cargo xtask ptx` compiles each with nvcc into `kernels/ptx/<name>.ptx` and writes
//! the SHA-256 of the source — the `.cu` text followed by every `.cuh` header of the same
//! directory in name order — into the PTX's first line:
//!
//! ```text
//! // tessera-source-sha256: 3b1f...
//! ```
//!
//! The PTX is committed and embedded with `include_str!`, so building never needs
//! nvcc. Each kernel crate has a CPU test calling [`check_ptx_fresh`], which fails when
//! a `.cu` file changed and its PTX was not regenerated.

use sha2::{Digest, Sha256};

use crate::{Error, Result};

/// The prefix of the line that records a PTX file's source hash.
pub const SOURCE_HASH_PREFIX: &str = "// tessera-source-sha256: ";

/// A PTX module embedded in a crate: a unique name (the key of the per-device module
/// cache) and its text.
#[derive(Debug, Clone, Copy)]
pub struct PtxModule {
    /// A name unique across the workspace, e.g. `"tessera_rng"`.
    pub name: &'static str,
    /// The PTX text, as written by `cargo xtask ptx`.
    pub ptx: &'static str,
}

/// The hex SHA-256 of a kernel source, as recorded in its PTX.
pub fn source_hash(source: &str) -> String {
    let digest = Sha256::digest(source.as_bytes());
    digest.iter().map(|b| format!("{b:02x}")).collect()
}

/// The header line `cargo xtask ptx` puts first in a PTX file compiled from `source`.
pub fn ptx_header(source: &str) -> String {
    format!("{SOURCE_HASH_PREFIX}{}", source_hash(source))
}

/// Checks that `ptx` was compiled from exactly `source`.
///
/// Returns [`Error::StaleKernel`] naming the file when the recorded hash is missing or
/// differs, with the command that fixes it.
pub fn check_ptx_fresh(name: &str, source: &str, ptx: &str) -> Result<()> {
    let expected = source_hash(source);
    let recorded = ptx
        .lines()
        .next()
        .and_then(|l| l.strip_prefix(SOURCE_HASH_PREFIX))
        .map(str::trim);
    match recorded {
        Some(h) if h == expected => Ok(()),
        Some(h) => Err(Error::StaleKernel {
            name: name.to_owned(),
            msg: format!(
                "the PTX was compiled from a source with hash {h}, the source now hashes to \
                 {expected}; run `cargo xtask ptx` where nvcc exists and commit the PTX"
            ),
        }),
        None => Err(Error::StaleKernel {
            name: name.to_owned(),
            msg: format!(
                "the PTX has no `{}` header line; regenerate it with `cargo xtask ptx`",
                SOURCE_HASH_PREFIX.trim_end()
            ),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fresh_and_stale_ptx() {
        let src = "__global__ void k() {}\n";
        let ptx = format!("{}\n.version 9.0\n", ptx_header(src));
        check_ptx_fresh("k.cu", src, &ptx).unwrap();
        let err = check_ptx_fresh("k.cu", "__global__ void k2() {}\n", &ptx).unwrap_err();
        assert!(matches!(err, Error::StaleKernel { .. }), "{err}");
        assert!(err.to_string().contains("cargo xtask ptx"));
        let err = check_ptx_fresh("k.cu", src, ".version 9.0\n").unwrap_err();
        assert!(
            err.to_string()
                .contains("no `// tessera-source-sha256:` header"),
            "{err}"
        );
    }
}
