//! The output directory's own files: `images.json` (the index the tests read), the lock that
//! keeps two builds out of one directory, and atomic writes and removals.

use std::{
    fs::{self, File},
    io,
    path::{Path, PathBuf},
};

use anyhow::{Context, Result};
use serde_json::Value;

use super::Built;

/// Writes `out/images.json` for `built` unless it already says exactly that; returns its path.
pub(crate) fn write_index(out: &Path, built: &[Built]) -> Result<PathBuf> {
    let index = out.join("images.json");
    let text = images_json(built);
    if fs::read_to_string(&index).ok().as_deref() != Some(text.as_str()) {
        write_atomically(&index, text.as_bytes())?;
    }
    Ok(index)
}

/// `images.json`: `[{"name", "ref", "archive", "manifest_digest"}, ...]`, one image a line.
pub(crate) fn images_json(built: &[Built]) -> String {
    let q = |s: &str| Value::from(s).to_string();
    let lines: Vec<String> = built
        .iter()
        .map(|b| {
            format!(
                "  {{\"name\": {}, \"ref\": {}, \"archive\": {}, \"manifest_digest\": {}}}",
                q(b.name),
                q(b.reference),
                q(&b.archive.to_string_lossy()),
                q(&b.manifest_digest)
            )
        })
        .collect();
    format!("[\n{}\n]\n", lines.join(",\n"))
}

pub(crate) fn write_atomically(path: &Path, bytes: &[u8]) -> Result<()> {
    let tmp = path.with_extension(format!("tmp-{}", std::process::id()));
    fs::write(&tmp, bytes).with_context(|| format!("writing {}", tmp.display()))?;
    fs::rename(&tmp, path).with_context(|| format!("renaming {}", tmp.display()))
}

/// An exclusive lock on `path` (two builds into one directory would race), released on drop.
pub(crate) fn lock(path: &Path) -> Result<File> {
    crate::util::lock_exclusive(path, "another build of the images")
}

/// Removes `path`; a file that is not there is no error.
pub(crate) fn remove_if_there(path: &Path) -> Result<()> {
    match fs::remove_file(path) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => {
            Err(e).with_context(|| format!("removing {}", path.display()))
        }
        _ => Ok(()),
    }
}
