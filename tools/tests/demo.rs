//! `vrdma-demo` runs its story to "vrdma demo: OK" against the workspace's
//! hostd and vdev, and a missing binary fails it with the error chain.

use std::path::PathBuf;
use std::process::Command;

const DEMO: &str = env!("CARGO_BIN_EXE_vrdma-demo");

/// Workspace binary `name` (built by `cargo test --workspace`).
fn binary(name: &str, package: &str) -> PathBuf {
    vrdma_tools::supervisor::find_binary(name, package).expect("workspace binary")
}

#[test]
fn the_demo_runs_to_ok() {
    let out = Command::new(DEMO)
        .arg("--vdev")
        .arg(binary("vdev", "vrdma-vdev"))
        .arg("--hostd")
        .arg(binary("hostd", "vrdma-hostd"))
        .output()
        .expect("run vrdma-demo");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "demo failed:\n{stdout}\n{stderr}");
    for expected in [
        "vrdma_",
        "ACTIVE",
        "lkey",
        "RTS",
        "EBUSY",
        "RDMA_WRITE SUCCESS",
        "beta's MR holds the 8192 bytes, byte for byte",
        "RDMA_READ SUCCESS",
        "read back equal alpha's buffer",
        "SEND SUCCESS",
        "RECV SUCCESS, byte_len 25, imm 0x1234abcd",
        "FETCH_ADD SUCCESS, fetched 41",
        "counter went from 41 to 42",
        "REM_ACCESS_ERR (remote access error)",
        "beta's MR is unchanged",
        "alpha's QP is now ERR",
        "exited with status 0",
        "SIGTERM",
    ] {
        assert!(stdout.contains(expected), "{expected:?} missing:\n{stdout}");
    }
    assert!(
        stdout.trim_end().ends_with("vrdma demo: OK"),
        "\"vrdma demo: OK\" is not the last line:\n{stdout}"
    );

    let out = Command::new(DEMO)
        .args(["--vdev", "/nonexistent/vdev"])
        .arg("--hostd")
        .arg(binary("hostd", "vrdma-hostd"))
        .output()
        .expect("run vrdma-demo");
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("vrdma demo: FAILED") && stderr.contains("/nonexistent/vdev"),
        "{stderr}"
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        !stdout.contains("kept"),
        "nothing to keep before vdev ran: {stdout}"
    );
}
