//! The nodes the servers sharing an executor directory run workers on:
//! one empty marker file per node in a directory, so whichever of those
//! servers leads owns them (the local and hollow executors).

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use crate::executor::ExecutorError;

/// A directory of node markers.
#[derive(Debug, Clone)]
pub struct DeclaredNodes {
    dir: PathBuf,
}

impl DeclaredNodes {
    pub fn new(dir: &Path) -> DeclaredNodes {
        DeclaredNodes {
            dir: dir.to_path_buf(),
        }
    }

    /// Declares `names` (their markers written).
    pub fn declare<'a>(
        &self,
        names: impl IntoIterator<Item = &'a str>,
    ) -> Result<(), ExecutorError> {
        for name in names {
            let path = self.marker(name).ok_or_else(|| {
                ExecutorError::Other(format!("node name {name:?} is not a file name"))
            })?;
            std::fs::write(&path, b"")
                .map_err(|e| ExecutorError::Other(format!("declaring {}: {e}", path.display())))?;
        }
        Ok(())
    }

    /// Whether `name` is declared (its marker read now).
    pub fn contains(&self, name: &str) -> bool {
        self.marker(name).is_some_and(|p| p.is_file())
    }

    /// Every node declared now.
    pub fn all(&self) -> BTreeSet<String> {
        let Ok(entries) = std::fs::read_dir(&self.dir) else {
            return BTreeSet::new();
        };
        entries
            .flatten()
            .filter_map(|e| e.file_name().to_str().map(str::to_string))
            .filter(|name| self.marker(name).is_some())
            .collect()
    }

    /// The marker file of a node, if its name can be one.
    fn marker(&self, name: &str) -> Option<PathBuf> {
        let plain = !name.is_empty()
            && !name.starts_with('.')
            && name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'));
        plain.then(|| self.dir.join(name))
    }
}
