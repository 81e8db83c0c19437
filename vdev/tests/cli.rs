//! The `vdev` command line as an operator meets it: errors are one clear
//! line on stderr and exit code 2, before any socket is touched.

use std::process::Command;

use vrdma_isolation::daemon::testing::{arg, ScratchDir};

/// Runs vdev with `args`, which it must refuse as a usage error: exit code
/// 2 and every one of `expected` on stderr.
#[track_caller]
fn assert_usage_error(args: &[&str], expected: &[&str]) {
    let out = Command::new(env!("CARGO_BIN_EXE_vdev"))
        .args(args)
        .output()
        .expect("run vdev");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(expected.iter().all(|e| stderr.contains(e)), "{stderr}");
}

#[test]
fn missing_socket_is_a_usage_error() {
    assert_usage_error(&[], &["No vhost-user socket given"]);
}

#[test]
fn config_file_errors_name_file_and_key() {
    let dir = ScratchDir::new("vdev-cli");
    for (name, text, expected) in [
        (
            "bad.toml",
            "socket = \"/tmp/x.sock\"\n[limits]\nmax_qp = 0\n",
            &["max_qp", "at least 1"][..],
        ),
        (
            "bad-type.toml",
            "socket = 5\n",
            &["bad-type.toml", "socket"],
        ),
    ] {
        let file = dir.write(name, text);
        assert_usage_error(&["--config", arg(&file)], expected);
    }
    assert_usage_error(
        &["--config", "/nonexistent/vdev.toml"],
        &["Cannot read config file /nonexistent/vdev.toml"],
    );
}
