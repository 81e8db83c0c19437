//! C programs the tests compile at run time against Debian's
//! `<infiniband/verbs.h>` and libibverbs, and run on vrdma's drop-in
//! library (`tests/c/`).

use std::io::Write;
use std::path::Path;
use std::process::Command;

use crate::daemon::TempDir;
use crate::need;

/// Compiles the C program `source` as `dir/name` against Debian's
/// <infiniband/verbs.h>, linked against Debian's libibverbs (`-z now`), so
/// the binary imports versioned symbols exactly as packaged programs do.
pub fn build_c_program(dir: &TempDir, name: &str, source: &str) -> std::path::PathBuf {
    need::program("cc", "gcc");
    need::file(
        Path::new("/usr/include/infiniband/verbs.h"),
        "libibverbs-dev",
    );
    let src = dir.path().join(format!("{name}.c"));
    std::fs::File::create(&src)
        .and_then(|mut f| f.write_all(source.as_bytes()))
        .expect("write the C program");
    let exe = dir.path().join(name);
    let cc = Command::new("cc")
        .args(["-Wall", "-Werror"])
        // tests/c: the headers the programs share (rc.h).
        .arg(concat!("-I", env!("CARGO_MANIFEST_DIR"), "/c"))
        .arg(&src)
        .arg("-o")
        .arg(&exe)
        .args(["-Wl,-z,now", "-libverbs"])
        .output()
        .expect("run cc");
    assert!(
        cc.status.success(),
        "cc: {}{}",
        String::from_utf8_lossy(&cc.stdout),
        String::from_utf8_lossy(&cc.stderr)
    );
    exe
}
