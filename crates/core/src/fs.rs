//! Files written so that a reader never sees half of one.

use std::fs::{self, File, OpenOptions};
use std::io::BufWriter;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};

use crate::{Error, Result};

/// Writes `path` through `write` atomically: the bytes go to a new temporary file in the
/// same directory, which is flushed to disk and then renamed over `path`. When `write`
/// or any step fails, the temporary file is removed and `path` is left as it was.
///
/// ```
/// use std::io::Write;
/// # fn main() -> tessera_core::Result<()> {
/// let path = std::env::temp_dir().join(format!("tessera-doc-{}.txt", std::process::id()));
/// tessera_core::fs::write_atomically(&path, |w| w.write_all(b"all or nothing"))?;
/// assert_eq!(std::fs::read(&path).unwrap(), b"all or nothing");
/// # std::fs::remove_file(&path).unwrap();
/// # Ok(())
/// # }
/// ```
pub fn write_atomically(
    path: &Path,
    write: impl FnOnce(&mut BufWriter<File>) -> std::io::Result<()>,
) -> Result<()> {
    const OP: &str = "write_atomically";
    static COUNTER: AtomicU32 = AtomicU32::new(0);
    let io = |what: &str, e: std::io::Error| Error::Io {
        op: OP,
        msg: format!("cannot {what} `{}`: {e}", path.display()),
    };
    let file_name = path
        .file_name()
        .ok_or_else(|| Error::invalid(OP, format!("`{}` does not name a file", path.display())))?;
    let dir = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    let (tmp, file) = loop {
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let mut name = std::ffi::OsString::from(".");
        name.push(file_name);
        name.push(format!(".tessera-tmp-{}-{n}", std::process::id()));
        let tmp = dir.join(name);
        match OpenOptions::new().write(true).create_new(true).open(&tmp) {
            Ok(f) => break (tmp, f),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && n < 100_000 => continue,
            Err(e) => return Err(io("create a temporary file for", e)),
        }
    };
    let guard = RemoveOnDrop(Some(tmp));
    let mut w = BufWriter::new(file);
    write(&mut w).map_err(|e| io("write", e))?;
    let file = w.into_inner().map_err(|e| io("write", e.into_error()))?;
    file.sync_all().map_err(|e| io("write", e))?;
    drop(file);
    let tmp = guard.0.as_deref().expect("set above");
    fs::rename(tmp, path).map_err(|e| io("write", e))?;
    guard.disarm();
    Ok(())
}

/// Removes a temporary file when dropped, unless disarmed.
struct RemoveOnDrop(Option<PathBuf>);

impl RemoveOnDrop {
    fn disarm(mut self) {
        self.0 = None;
    }
}

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        if let Some(p) = self.0.take() {
            let _ = fs::remove_file(p);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn a_failed_write_leaves_nothing() {
        let dir = std::env::temp_dir().join(format!("tessera-fs-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        let path = dir.join("f.bin");
        fs::write(&path, b"old").unwrap();
        let err = write_atomically(&path, |w| {
            w.write_all(b"partial")?;
            Err(std::io::Error::other("disk full"))
        })
        .unwrap_err();
        assert!(err.to_string().contains("disk full"), "{err}");
        assert_eq!(fs::read(&path).unwrap(), b"old");
        assert_eq!(
            fs::read_dir(&dir).unwrap().count(),
            1,
            "no temporary file left"
        );
        write_atomically(&path, |w| w.write_all(b"new")).unwrap();
        assert_eq!(fs::read(&path).unwrap(), b"new");
        fs::remove_dir_all(&dir).unwrap();
    }
}
