//! C programs the tests compile at run time against Debian's
//! `<infiniband/verbs.h>` and libibverbs, or Open MPI's `<mpi.h>`, and run
//! on vrdma's drop-in library (`tests/c/`).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::daemon::TempDir;
use crate::need;

/// Compiles the C program `source` as `dir/name` against Debian's
/// <infiniband/verbs.h>, linked against Debian's libibverbs (`-z now`), so
/// the binary imports versioned symbols exactly as packaged programs do.
pub fn build_c_program(dir: &TempDir, name: &str, source: &str) -> PathBuf {
    need::program("cc", "gcc");
    need::file(
        Path::new("/usr/include/infiniband/verbs.h"),
        "libibverbs-dev",
    );
    compile(Command::new("cc"), dir, name, source, &["-libverbs"])
}

/// Like [`build_c_program`], for a program of Debian's librdmacm
/// (`<rdma/rdma_cma.h>`, linked with `-lrdmacm`).
pub fn build_rdmacm_program(dir: &TempDir, name: &str, source: &str) -> PathBuf {
    need::program("cc", "gcc");
    need::file(Path::new("/usr/include/rdma/rdma_cma.h"), "librdmacm-dev");
    compile(
        Command::new("cc"),
        dir,
        name,
        source,
        &["-lrdmacm", "-libverbs"],
    )
}

/// Compiles the MPI program `source` as `dir/name` with Open MPI's `mpicc`
/// (`-z now`, as packaged programs are linked).
pub fn build_mpi_program(dir: &TempDir, name: &str, source: &str) -> PathBuf {
    compile(
        Command::new(need::program("mpicc", "libopenmpi-dev")),
        dir,
        name,
        source,
        &[],
    )
}

/// Writes `source` to `dir/name.c` and compiles it with `cc` (warnings are
/// errors), linking `libs`; the test fails with the compiler's output.
fn compile(mut cc: Command, dir: &TempDir, name: &str, source: &str, libs: &[&str]) -> PathBuf {
    let src = dir.path().join(format!("{name}.c"));
    std::fs::File::create(&src)
        .and_then(|mut f| f.write_all(source.as_bytes()))
        .expect("write the C program");
    let exe = dir.path().join(name);
    let out = cc
        .args(["-Wall", "-Werror"])
        // tests/c: the headers the programs share (rc.h).
        .arg(concat!("-I", env!("CARGO_MANIFEST_DIR"), "/c"))
        .arg(&src)
        .arg("-o")
        .arg(&exe)
        .arg("-Wl,-z,now")
        .args(libs)
        .output()
        .expect("run the C compiler");
    assert!(
        out.status.success(),
        "cc: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    exe
}
