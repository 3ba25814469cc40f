//! Finding NCCL without panicking, the `libnccl.so.2` shim, and the process
//! environment NCCL must see.

use std::path::{Path, PathBuf};
use std::sync::{Once, OnceLock};

use cudarc::nccl::sys;
use tessera_core::{Error, Result};

/// The oldest NCCL this backend accepts: it needs `ncclCommInitRankConfig`
/// (non-blocking), `ncclCommSplit` and `ncclCommFinalize`.
const MIN_VERSION: NcclVersion = NcclVersion {
    major: 2,
    minor: 18,
    patch: 0,
};

/// A version of the NCCL library.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct NcclVersion {
    /// Major version.
    pub major: u32,
    /// Minor version.
    pub minor: u32,
    /// Patch level.
    pub patch: u32,
}

impl NcclVersion {
    /// Decodes `NCCL_VERSION_CODE` (`ncclGetVersion`): `major·10000 + minor·100 +
    /// patch` since 2.9, `major·1000 + minor·100 + patch` before.
    pub fn from_code(code: u32) -> Self {
        if code >= 10000 {
            NcclVersion {
                major: code / 10000,
                minor: code % 10000 / 100,
                patch: code % 100,
            }
        } else {
            NcclVersion {
                major: code / 1000,
                minor: code % 1000 / 100,
                patch: code % 100,
            }
        }
    }
}

impl std::fmt::Display for NcclVersion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}.{}", self.major, self.minor, self.patch)
    }
}

/// Whether NCCL can be used here: a CUDA driver with at least one device, and an
/// NCCL library (2.18 or newer) that cudarc can load. Never panics.
pub fn is_available() -> bool {
    ensure_available().is_ok()
}

/// The loaded NCCL's version, or why NCCL cannot be used
/// ([`Error::CudaUnavailable`]). The first call also applies the
/// [process environment](super#the-process-environment) NCCL must see. Never panics;
/// the answer is computed once per process.
pub fn ensure_available() -> Result<NcclVersion> {
    static STATE: OnceLock<Result<NcclVersion>> = OnceLock::new();
    STATE.get_or_init(probe).clone()
}

fn probe() -> Result<NcclVersion> {
    let devices = tessera_core::cuda::device_count()?;
    if devices == 0 {
        return Err(Error::CudaUnavailable {
            reason: "the CUDA driver reports no device, so NCCL cannot be used".into(),
        });
    }
    prepare_environment();
    if !cudarc_can_load_nccl() {
        return Err(Error::CudaUnavailable {
            reason: absent_nccl_message(),
        });
    }
    let mut code: std::ffi::c_int = 0;
    // SAFETY: the library is present (checked above, so the symbol lookup cannot hit
    // cudarc's missing-library panic), and `code` is a valid place for the int.
    let r = unsafe { sys::ncclGetVersion(&mut code) };
    if r != sys::ncclResult_t::ncclSuccess {
        return Err(Error::CudaUnavailable {
            reason: format!("ncclGetVersion failed: {r:?}"),
        });
    }
    let version = NcclVersion::from_code(u32::try_from(code).unwrap_or(0));
    if version < MIN_VERSION {
        return Err(Error::CudaUnavailable {
            reason: format!(
                "NCCL {version} is too old: tessera needs {MIN_VERSION} or newer (non-blocking communicators, ncclCommSplit)"
            ),
        });
    }
    if (version.major, version.minor) > (2, 29) {
        tracing::warn!(
            %version,
            "tessera's NCCL bindings are for 2.28; a newer library works for the calls tessera makes, but its new result codes (e.g. ncclTimeout) are reported as unknown"
        );
    }
    Ok(version)
}

/// Whether cudarc's loader finds an NCCL library (it tries `libnccl.so` and a few
/// other names, never `libnccl.so.2`).
fn cudarc_can_load_nccl() -> bool {
    // SAFETY: `is_culib_present` only dlopens cudarc's candidate names and drops the
    // handles; loading NCCL runs no code that depends on our state.
    unsafe { sys::is_culib_present() }
}

fn absent_nccl_message() -> String {
    match find_libnccl_so2() {
        Some(path) => format!(
            "NCCL cannot be loaded as `libnccl.so`, and cudarc never tries `libnccl.so.2`, although {} exists. \
             Start the process with a directory holding the symlink `libnccl.so -> {}` first on LD_LIBRARY_PATH \
             (`tessera_collectives::nccl::nccl_shim_dir` makes one; glibc reads LD_LIBRARY_PATH only at process start), \
             or install the NCCL development package, which provides `libnccl.so`",
            path.display(),
            path.display()
        ),
        None => "the NCCL library (libnccl.so) was not found: install NCCL or put its directory on LD_LIBRARY_PATH".into(),
    }
}

/// Sets the process environment NCCL must see, once, before the first NCCL call:
/// `NCCL_NVLS_ENABLE=0` unless the variable is already set.
pub(crate) fn prepare_environment() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        if std::env::var_os("NCCL_NVLS_ENABLE").is_none() {
            // SAFETY: std serializes its own environment reads and writes; the hazard
            // is a concurrent `getenv` from C code in another thread. This runs once,
            // before tessera loads or calls NCCL (the only C library here that reads
            // NCCL_* variables), which is the window the docs of `nccl` ask callers to
            // keep free of other threads' C environment reads.
            unsafe { std::env::set_var("NCCL_NVLS_ENABLE", "0") };
        }
    });
}

/// Where `libnccl.so.2` is, if the dynamic loader (or a directory of
/// `LD_LIBRARY_PATH`) has one: the directories of `LD_LIBRARY_PATH` first, then the
/// file the dynamic loader maps for `dlopen("libnccl.so.2")`, read from
/// `/proc/self/maps`.
pub fn find_libnccl_so2() -> Option<PathBuf> {
    if let Some(paths) = std::env::var_os("LD_LIBRARY_PATH") {
        for dir in std::env::split_paths(&paths) {
            let p = dir.join("libnccl.so.2");
            if p.is_file() {
                return Some(p);
            }
        }
    }
    // SAFETY: loading NCCL runs only its static initialisers, which set up private
    // state and read no memory of ours; the handle is dropped (dlclose) below.
    let lib = unsafe { libloading::Library::new("libnccl.so.2") }.ok()?;
    let maps = std::fs::read_to_string("/proc/self/maps").ok();
    drop(lib);
    maps?
        .lines()
        .filter_map(|l| l.split_whitespace().nth(5))
        .find(|p| {
            Path::new(p)
                .file_name()
                .and_then(|f| f.to_str())
                .is_some_and(|f| f.starts_with("libnccl.so"))
        })
        .map(PathBuf::from)
}

/// Creates `dir` (if needed) holding the symlink `libnccl.so -> target` and returns
/// `dir`: put it first on `LD_LIBRARY_PATH` of the processes you start, and cudarc
/// finds NCCL. An existing `libnccl.so` symlink in `dir` is replaced; a regular file
/// there is an error (it is not ours to delete).
pub fn create_nccl_shim(dir: &Path, target: &Path) -> Result<PathBuf> {
    const OP: &str = "nccl::create_nccl_shim";
    let io = |what: &str, e: std::io::Error| Error::state(OP, format!("{what}: {e}"));
    std::fs::create_dir_all(dir).map_err(|e| io(&format!("creating {}", dir.display()), e))?;
    let link = dir.join("libnccl.so");
    if let Ok(meta) = std::fs::symlink_metadata(&link) {
        if !meta.file_type().is_symlink() {
            return Err(Error::state(
                OP,
                format!("{} exists and is not a symlink", link.display()),
            ));
        }
        if std::fs::read_link(&link).ok().as_deref() == Some(target) {
            return Ok(dir.to_path_buf());
        }
        std::fs::remove_file(&link).map_err(|e| io(&format!("replacing {}", link.display()), e))?;
    }
    std::os::unix::fs::symlink(target, &link).map_err(|e| {
        io(
            &format!("linking {} -> {}", link.display(), target.display()),
            e,
        )
    })?;
    Ok(dir.to_path_buf())
}

/// For launchers: `Ok(None)` when cudarc can already load NCCL; otherwise, when a
/// `libnccl.so.2` is found ([`find_libnccl_so2`]), the shim directory made by
/// [`create_nccl_shim`] in `dir`, to prepend to `LD_LIBRARY_PATH` of the ranks it
/// starts; [`Error::CudaUnavailable`] when there is no NCCL at all.
///
/// Why a directory and not something in-process: cudarc dlopens fixed names
/// (`libnccl.so`, …, never `libnccl.so.2`). glibc's `dlopen` reuses an already
/// loaded object only when the requested name equals the object's load name or its
/// `DT_SONAME` (`libnccl.so.2`), so loading `libnccl.so.2` first, even with
/// `RTLD_GLOBAL`, does not satisfy a later `dlopen("libnccl.so")`; and glibc reads
/// `LD_LIBRARY_PATH` once, at process start, so setting it from inside the process
/// changes nothing. cudarc reads no environment variable naming the library.
pub fn nccl_shim_dir(dir: &Path) -> Result<Option<PathBuf>> {
    if cudarc_can_load_nccl() {
        return Ok(None);
    }
    match find_libnccl_so2() {
        Some(target) => create_nccl_shim(dir, &target).map(Some),
        None => Err(Error::CudaUnavailable {
            reason: "neither libnccl.so nor libnccl.so.2 was found: install NCCL".into(),
        }),
    }
}
