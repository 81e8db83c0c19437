//! The `vdev` command line as an operator meets it: errors are one clear
//! line on stderr and exit code 2, before any socket is touched.

use std::process::Command;

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
    let dir = std::env::temp_dir().join(format!("vdev-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let path = dir.join("bad.toml");
    std::fs::write(&path, "socket = \"/tmp/x.sock\"\n[limits]\nmax_qp = 0\n").expect("write");
    let (code, stderr) = vdev(&["--config", path.to_str().expect("utf8")]);
    assert_eq!(code, 2);
    assert!(
        stderr.contains("max_qp") && stderr.contains("at least 1"),
        "{stderr}"
    );
    std::fs::write(&path, "socket = 5\n").expect("write");
    let (code, stderr) = vdev(&["--config", path.to_str().expect("utf8")]);
    assert_eq!(code, 2);
    assert!(
        stderr.contains("bad.toml") && stderr.contains("socket"),
        "{stderr}"
    );
    let (code, stderr) = vdev(&["--config", "/nonexistent/vdev.toml"]);
    assert_eq!(code, 2);
    assert!(
        stderr.contains("Cannot read config file /nonexistent/vdev.toml"),
        "{stderr}"
    );
    std::fs::remove_dir_all(&dir).ok();
}
