//! JSON-lines result files: the commands append their rows to `--json-out`.

use std::fs::File;
use std::path::Path;

use anyhow::{Context, Result};

/// Opens `path` for appending, creating it (and its folder) when missing.
pub fn open_append(path: &Path) -> Result<File> {
    create_parent(path)?;
    File::options()
        .create(true)
        .append(true)
        .open(path)
        .with_context(|| format!("opening {} for appending", path.display()))
}

/// Creates the folder `path` goes in, when it has one.
pub fn create_parent(path: &Path) -> Result<()> {
    if let Some(d) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(d).with_context(|| format!("creating {}", d.display()))?;
    }
    Ok(())
}
