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
//! a `.cu` file changed and its PTX was not regenerated, or the PTX is for another
//! architecture than [`PTX_TARGET`].
//!
//! Beside each PTX file the same command writes its machine code for [`PTX_TARGET`]
//! (`<name>.sm_90.cubin`, ptxas run on the PTX file) and the SHA-256 of the PTX it came
//! from (`<name>.sm_90.cubin.sha256`); both are committed and embedded too
//! ([`PtxModule::sass`]). A device of exactly that capability loads the cubin, so no
//! process pays the driver's PTX compilation; any newer one compiles the PTX. The
//! freshness tests also call [`PtxModule::check_sass_fresh`].

use sha2::{Digest, Sha256};

use crate::{Error, Result};

/// The prefix of the line that records a PTX file's source hash.
pub const SOURCE_HASH_PREFIX: &str = "// tessera-source-sha256: ";

/// The GPU architecture `cargo xtask ptx` compiles for (`-arch=sm_90`), as a compute
/// capability: the least a device needs to run the committed PTX.
pub const PTX_TARGET: (u32, u32) = (9, 0);

/// A PTX module embedded in a crate: a unique name (the key of the per-device module
/// cache), its text, and the machine code `cargo xtask ptx` compiled from that text for
/// [`PTX_TARGET`].
#[derive(Debug, Clone, Copy)]
pub struct PtxModule {
    /// A name unique across the workspace, e.g. `"tessera_rng"`.
    pub name: &'static str,
    /// The PTX text, as written by `cargo xtask ptx`.
    pub ptx: &'static str,
    /// The module's machine code for devices of compute capability [`PTX_TARGET`], which
    /// load it instead of having the driver compile the PTX (seconds for the larger
    /// modules the first time a process loads them without a warm compute cache). `None`
    /// loads the PTX everywhere.
    pub sass: Option<Sass>,
}

impl PtxModule {
    /// Checks that the module embeds a cubin and that it is fresh ([`check_sass_fresh`]):
    /// every module the workspace ships has one, so a missing cubin is stale too. The
    /// body of each kernel crate's CPU freshness test.
    pub fn check_sass_fresh(&self) -> Result<()> {
        match &self.sass {
            Some(sass) => check_sass_fresh(self.name, self.ptx, sass),
            None => Err(Error::StaleKernel {
                name: self.name.to_owned(),
                msg: "no cubin is embedded beside the PTX; generate it with `cargo xtask ptx` \
                      and embed it"
                    .to_owned(),
            }),
        }
    }
}

/// A module's machine code: the cubin `cargo xtask ptx` writes beside its PTX
/// (`kernels/ptx/<name>.sm_90.cubin`, compiled by ptxas from that PTX file for
/// [`PTX_TARGET`]), and the SHA-256 of the PTX text it was compiled from
/// (`<name>.sm_90.cubin.sha256`), which [`check_sass_fresh`] compares with the PTX.
#[derive(Debug, Clone, Copy)]
pub struct Sass {
    /// The cubin (an ELF image the driver loads as it is).
    pub cubin: &'static [u8],
    /// The hex SHA-256 of the PTX text the cubin was compiled from (trailing whitespace
    /// ignored).
    pub ptx_sha256: &'static str,
}

/// The file-name infix of the cubins `cargo xtask ptx` writes: `<name>.sm_90.cubin`.
pub const SASS_INFIX: &str = "sm_90";

/// The hex SHA-256 of a PTX text, as a cubin's `.sha256` file records it.
pub fn ptx_sha256(ptx: &str) -> String {
    source_hash(ptx)
}

/// Checks that `sass` is a CUDA cubin (a 64-bit little-endian ELF image for machine
/// `EM_CUDA`) compiled from exactly `ptx` (see [`Sass::ptx_sha256`]).
///
/// Returns [`Error::StaleKernel`] naming the module when the image is not a cubin or the
/// recorded hash differs, with the command that fixes it.
pub fn check_sass_fresh(name: &str, ptx: &str, sass: &Sass) -> Result<()> {
    const EM_CUDA: u16 = 190;
    let c = sass.cubin;
    let is_cubin = c.len() >= 64
        && c.starts_with(b"\x7fELF")
        && c[4] == 2 // 64-bit
        && c[5] == 1 // little-endian
        && u16::from_le_bytes([c[18], c[19]]) == EM_CUDA;
    if !is_cubin {
        return Err(Error::StaleKernel {
            name: name.to_owned(),
            msg: "the embedded cubin is not a 64-bit CUDA ELF image; regenerate it with \
                  `cargo xtask ptx`"
                .to_owned(),
        });
    }
    let expected = ptx_sha256(ptx);
    let recorded = sass.ptx_sha256.trim();
    if recorded == expected {
        return Ok(());
    }
    Err(Error::StaleKernel {
        name: name.to_owned(),
        msg: format!(
            "the cubin was compiled from PTX with hash {recorded}, the PTX now hashes to \
             {expected}; run `cargo xtask ptx` where nvcc and ptxas exist and commit both"
        ),
    })
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

/// Checks that `ptx` is what `cargo xtask ptx` writes from exactly `source`: compiled
/// from it, for [`PTX_TARGET`] (what `CudaDevice::function` compares with a device's
/// compute capability).
///
/// Returns [`Error::StaleKernel`] naming the file when the recorded hash is missing or
/// differs, or the `.target` is another architecture, with the command that fixes it.
pub fn check_ptx_fresh(name: &str, source: &str, ptx: &str) -> Result<()> {
    let expected = source_hash(source);
    let recorded = ptx
        .lines()
        .next()
        .and_then(|l| l.strip_prefix(SOURCE_HASH_PREFIX))
        .map(str::trim);
    match recorded {
        Some(h) if h == expected => match ptx_target(ptx) {
            Some(t) if t == PTX_TARGET => Ok(()),
            t => Err(Error::StaleKernel {
                name: name.to_owned(),
                msg: format!(
                    "the PTX targets {}, `cargo xtask ptx` writes sm_{}{}; regenerate it",
                    t.map_or("no architecture".to_owned(), |(a, b)| format!("sm_{a}{b}")),
                    PTX_TARGET.0,
                    PTX_TARGET.1
                ),
            }),
        },
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

/// The GPU architecture a PTX module is written for, as a compute capability: its
/// `.target sm_XY` directive read as `(X, Y)` (`sm_90` is `(9, 0)`, `sm_100a` is
/// `(10, 0)`). `None` when the text has no such directive.
pub fn ptx_target(ptx: &str) -> Option<(u32, u32)> {
    let arch = directive(ptx, ".target")?.split(',').next()?.trim();
    let digits: String = arch
        .strip_prefix("sm_")?
        .chars()
        .take_while(char::is_ascii_digit)
        .collect();
    let n: u32 = digits.parse().ok()?;
    Some((n / 10, n % 10))
}

/// The PTX ISA version a module is written in (its `.version X.Y` directive), which the
/// driver must know to compile it: ISA 9.0 came with CUDA 13.0. `None` when the text has
/// no such directive.
pub fn ptx_isa_version(ptx: &str) -> Option<(u32, u32)> {
    let (major, minor) = directive(ptx, ".version")?.split_once('.')?;
    Some((major.trim().parse().ok()?, minor.trim().parse().ok()?))
}

/// The rest of the first line of `ptx` that starts with `name` and a space.
fn directive<'a>(ptx: &'a str, name: &str) -> Option<&'a str> {
    ptx.lines()
        .map(str::trim_start)
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
}

/// `Ok` when a device of compute capability `has` can run PTX written for `needs` (see
/// [`ptx_target`]): the driver compiles PTX for its own GPU or any newer one, never an
/// older one. Otherwise [`Error::UnsupportedDevice`] naming the module, the device and
/// both capabilities.
pub fn check_device_runs(
    module: &'static str,
    device: &str,
    has: (u32, u32),
    needs: (u32, u32),
) -> Result<()> {
    if has >= needs {
        return Ok(());
    }
    Err(Error::UnsupportedDevice {
        module,
        device: device.to_owned(),
        has,
        needs,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fresh_and_stale_sass() {
        let ptx = format!("{}\n.version 9.0\n.target sm_90\n", ptx_header("k"));
        let hash = ptx_sha256(&ptx);
        // The header of a 64-bit little-endian ELF image for EM_CUDA (190).
        let mut image = vec![0u8; 64];
        image[..6].copy_from_slice(b"\x7fELF\x02\x01");
        image[18..20].copy_from_slice(&190u16.to_le_bytes());
        let image: &'static [u8] = Box::leak(image.into_boxed_slice());
        let recorded: &'static str = Box::leak(format!("{hash}\n").into_boxed_str());
        let sass = Sass {
            cubin: image,
            ptx_sha256: recorded,
        };
        check_sass_fresh("k", &ptx, &sass).unwrap();
        let err = check_sass_fresh("k", &format!("{ptx}// edited\n"), &sass).unwrap_err();
        assert!(matches!(err, Error::StaleKernel { .. }), "{err}");
        assert!(err.to_string().contains(&hash), "{err}");
        // Another machine's ELF, or no ELF at all, is not a cubin.
        let mut x86 = image.to_vec();
        x86[18..20].copy_from_slice(&62u16.to_le_bytes());
        for cubin in [&x86[..], &image[..16]] {
            let cubin: &'static [u8] = Box::leak(cubin.to_vec().into_boxed_slice());
            let err = check_sass_fresh("k", &ptx, &Sass { cubin, ..sass }).unwrap_err();
            assert!(err.to_string().contains("not a 64-bit CUDA ELF"), "{err}");
        }
        // A module checks its own cubin, and one without a cubin is stale.
        let ptx: &'static str = Box::leak(ptx.into_boxed_str());
        let module = PtxModule {
            name: "k",
            ptx,
            sass: Some(sass),
        };
        module.check_sass_fresh().unwrap();
        let err = PtxModule {
            sass: None,
            ..module
        }
        .check_sass_fresh()
        .unwrap_err();
        assert!(matches!(err, Error::StaleKernel { .. }), "{err}");
        assert!(err.to_string().contains("no cubin"), "{err}");
    }

    #[test]
    fn fresh_and_stale_ptx() {
        let src = "__global__ void k() {}\n";
        let ptx = format!("{}\n.version 9.0\n.target sm_90\n", ptx_header(src));
        check_ptx_fresh("k.cu", src, &ptx).unwrap();
        // The right source compiled for another architecture (or none) is stale too.
        for other in [".target sm_80\n", ""] {
            let ptx = format!("{}\n.version 9.0\n{other}", ptx_header(src));
            let err = check_ptx_fresh("k.cu", src, &ptx).unwrap_err();
            assert!(matches!(err, Error::StaleKernel { .. }), "{err}");
            assert!(
                err.to_string().contains("`cargo xtask ptx` writes sm_90"),
                "{err}"
            );
        }
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

    #[test]
    fn ptx_directives() {
        let ptx =
            "// tessera-source-sha256: 00\n//\n.version 9.0\n.target sm_90\n.address_size 64\n";
        assert_eq!(ptx_target(ptx), Some((9, 0)));
        assert_eq!(ptx_isa_version(ptx), Some((9, 0)));
        assert_eq!(ptx_target(".target sm_100a\n"), Some((10, 0)));
        assert_eq!(ptx_target(".target sm_89, debug\n"), Some((8, 9)));
        assert_eq!(ptx_isa_version(".version 8.8\n"), Some((8, 8)));
        // A comment or another directive that merely starts alike is not the directive.
        assert_eq!(ptx_target("// .target sm_80\n.targets sm_80\n"), None);
        assert_eq!(ptx_target(".target compute_90\n"), None);
        assert_eq!(ptx_isa_version(".version nine\n"), None);
    }

    #[test]
    fn devices_run_ptx_for_their_architecture_or_older() {
        check_device_runs("m", "H100", (9, 0), (9, 0)).unwrap();
        check_device_runs("m", "B200", (10, 0), (9, 0)).unwrap();
        let err =
            check_device_runs("tessera_quant_fp8", "NVIDIA A100", (8, 0), (9, 0)).unwrap_err();
        assert!(matches!(err, Error::UnsupportedDevice { .. }), "{err}");
        let msg = err.to_string();
        for part in ["tessera_quant_fp8", "NVIDIA A100", "8.0", "9.0", "sm_90"] {
            assert!(msg.contains(part), "{msg} lacks {part}");
        }
        assert!(check_device_runs("m", "RTX 4090", (8, 9), (9, 0)).is_err());
    }
}
