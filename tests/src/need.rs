//! What the tests need from outside the workspace. A test never passes
//! without running what it claims: when a program, a header or root is
//! missing it fails, and says which Debian package to install.
//! `scripts/test` (the README's test command) installs them all.

use std::path::{Path, PathBuf};

/// What every message ends with.
const HOW: &str = "`scripts/test` run as root installs everything the tests need";

/// `name` found on `PATH`.
pub fn which(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join(name))
        .find(|p| p.is_file())
}

/// Program `name` on `PATH`, which Debian's `package` installs; the test
/// fails if it is missing.
#[track_caller]
pub fn program(name: &str, package: &str) -> PathBuf {
    which(name)
        .unwrap_or_else(|| panic!("{name} is not installed: apt-get install {package} ({HOW})"))
}

/// File `path` (a header, a library), which Debian's `package` installs;
/// the test fails if it is missing.
#[track_caller]
pub fn file(path: &Path, package: &str) {
    assert!(
        path.exists(),
        "{} is missing: apt-get install {package} ({HOW})",
        path.display()
    );
}

/// Root, for what only root may do (`why`); the test fails otherwise.
#[track_caller]
pub fn root(why: &str) {
    // SAFETY: geteuid has no preconditions and touches no memory.
    let euid = unsafe { libc::geteuid() };
    assert_eq!(euid, 0, "{why} needs root: run the tests as root ({HOW})");
}
