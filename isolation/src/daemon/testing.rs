//! The daemons' configuration tests, their shared pieces (cargo feature
//! `testing`; the daemons turn it on in their dev-dependencies): a command
//! line parsed as the daemon parses its own, and a scratch directory for
//! the config and policy files a test writes.

use std::path::{Path, PathBuf};

/// `daemon`'s command line `args` (after the program's name), which clap
/// must accept (a test helper: it panics otherwise), validated into the
/// daemon's configuration `C`.
pub fn parse_command_line<A: clap::Parser, C: TryFrom<A>>(
    daemon: &str,
    args: &[&str],
) -> Result<C, C::Error> {
    let line = std::iter::once(daemon).chain(args.iter().copied());
    C::try_from(A::try_parse_from(line).expect("clap accepts"))
}

/// A directory of one test's own, removed with its files on drop.
#[derive(Debug)]
pub struct ScratchDir(PathBuf);

impl ScratchDir {
    /// `<tmp>/<name>-<pid>`, new and empty: `name` tells it apart from the
    /// directories of the other tests of the process, which run at the
    /// same time.
    pub fn new(name: &str) -> ScratchDir {
        let dir = std::env::temp_dir().join(format!("{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("scratch dir");
        ScratchDir(dir)
    }

    pub fn path(&self) -> &Path {
        &self.0
    }

    /// The file `name` in the directory, written with `contents`.
    pub fn write(&self, name: &str, contents: impl AsRef<[u8]>) -> PathBuf {
        let path = self.0.join(name);
        std::fs::write(&path, contents).expect("write scratch file");
        path
    }
}

impl Drop for ScratchDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A path as a command-line argument (the scratch directory's paths are
/// UTF-8).
pub fn arg(path: &Path) -> &str {
    path.to_str().expect("utf-8 path")
}
