//! The `vdev` command line as an operator meets it: errors are one clear
//! line on stderr and exit code 2, before any socket is touched.

use std::process::Command;

use vrdma_isolation::daemon::testing::{arg, ScratchDir};

fn vdev(args: &[&str]) -> (i32, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_vdev"))
        .args(args)
        .output()
        .expect("run vdev");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn missing_socket_is_a_usage_error() {
    let (code, stderr) = vdev(&[]);
    assert_eq!(code, 2);
    assert!(stderr.contains("No vhost-user socket given"), "{stderr}");
}

#[test]
fn config_file_errors_name_file_and_key() {
    let dir = ScratchDir::new("vdev-cli");
    let bad_value = dir.write(
        "bad.toml",
        "socket = \"/tmp/x.sock\"\n[limits]\nmax_qp = 0\n",
    );
    let bad_type = dir.write("bad-type.toml", "socket = 5\n");
    let missing = "/nonexistent/vdev.toml";
    for (file, expected) in [
        (arg(&bad_value), &["max_qp", "at least 1"][..]),
        (arg(&bad_type), &["bad-type.toml", "socket"]),
        (missing, &["Cannot read config file /nonexistent/vdev.toml"]),
    ] {
        let (code, stderr) = vdev(&["--config", file]);
        assert_eq!(code, 2, "{stderr}");
        assert!(expected.iter().all(|e| stderr.contains(e)), "{stderr}");
    }
}
