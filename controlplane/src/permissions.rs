//! Owner-only data on disk (issue 35, its first part).
//!
//! A server sets its umask to `077` before it creates anything, so the data
//! directory, the WAL, sled's state and journal, snapshots, `cluster-id`,
//! and the executor's worker logs, pid and exit records and checkpoint
//! directories are created `0700`/`0600`, whoever creates them later (a
//! new WAL segment, a snapshot, a rotated log; `keel supervise` inherits
//! it). Workers get back the umask the server was started with
//! (`keel supervise --worker-umask`), so what a job writes is as its user
//! expects, inside directories only the server's user can open.
//!
//! A data or executor directory that already exists and that others may
//! read is said at start; `--strict-permissions` refuses it.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use nix::sys::stat::{umask, Mode};

/// The umask a server runs under.
pub const OWNER_ONLY_UMASK: u32 = 0o077;

/// Sets the process's umask to [`OWNER_ONLY_UMASK`]; returns the one it
/// replaced.
pub fn restrict_umask() -> u32 {
    umask(Mode::from_bits_truncate(OWNER_ONLY_UMASK)).bits()
}

/// Why `dir` (`what`, e.g. "the data directory") is not private to its
/// owner, if it exists and its group or others may read, write or enter it.
pub fn not_private(dir: &Path, what: &str) -> Option<String> {
    let mode = std::fs::metadata(dir).ok()?.permissions().mode() & 0o777;
    (mode & 0o077 != 0).then(|| {
        format!(
            "{what} {} is open to other users (mode {mode:04o}): anyone on this machine can read the jobs' \
             specs and logs in it. Run `chmod 700 {}` (--strict-permissions refuses to start on it)",
            dir.display(),
            dir.display()
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_directory_others_can_read_is_named_with_its_mode() {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755))
            .expect("chmod");
        let why = not_private(dir.path(), "the data directory").expect("open to others");
        assert!(
            why.contains("mode 0755") && why.contains("chmod 700"),
            "{why}"
        );
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o700))
            .expect("chmod");
        assert_eq!(not_private(dir.path(), "the data directory"), None);
        assert_eq!(not_private(&dir.path().join("missing"), "x"), None);
    }
}
