//! The systemd units of `packaging/systemd/`: systemd's own checker finds
//! nothing wrong in them, and hostd and vdev start and serve a tenant under
//! the limits the units put on them that could conflict with their own
//! sandbox (the capability bounding set, no_new_privs) — each daemon then
//! drops to its user with no capabilities, as it does without systemd.
//! This machine runs no systemd as PID 1, so the units themselves are not
//! started here; their mount and namespace settings are checked by
//! `systemd-analyze verify` only.

use std::path::Path;
use std::process::{Child, Command};

use vrdma_tests::daemon::{binary, TempDir};
use vrdma_tests::need;
use vrdma_tests::wrapped::{dropped_everything, spawn_logged, wait_for_path};

const UNITS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../packaging/systemd");

fn unit(name: &str) -> String {
    let path = Path::new(UNITS).join(name);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The value of `key` in the unit's text (the last one, as systemd takes
/// it).
fn setting<'a>(text: &'a str, key: &str) -> &'a str {
    text.lines()
        .filter_map(|l| l.strip_prefix(key)?.strip_prefix('='))
        .next_back()
        .unwrap_or_else(|| panic!("no {key}= in the unit"))
}

/// The unit with its programs where this build has them.
fn with_built_binaries(text: &str) -> String {
    text.replace("/usr/bin/hostd", &binary("hostd").display().to_string())
        .replace("/usr/bin/vdev", &binary("vdev").display().to_string())
}

/// A scratch directory the daemons can reach once they run as nobody.
fn scratch(tag: &str) -> TempDir {
    let dir = TempDir::new(&format!("units-{tag}"));
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).expect("chmod");
    dir
}

#[test]
fn systemd_analyze_finds_nothing_wrong_in_the_units() {
    let analyze = need::program("systemd-analyze", "systemd");
    let dir = scratch("verify");
    for name in ["vrdma-hostd.service", "vrdma-vdev@.service"] {
        std::fs::write(dir.path().join(name), with_built_binaries(&unit(name)))
            .expect("write unit");
    }
    // The template is checked through an instance of it.
    let out = Command::new(analyze)
        .arg("verify")
        .arg(dir.path().join("vrdma-hostd.service"))
        .arg(dir.path().join("vrdma-vdev@blue.service"))
        .output()
        .expect("run systemd-analyze");
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{said}");
    assert!(said.trim().is_empty(), "warnings: {said}");
}

/// `program args` under the unit's capability bounding set and
/// no_new_privs (setpriv), stderr to `log`.
fn under_unit_limits(unit_text: &str, program: &Path, args: &[&str], log: &Path) -> Child {
    assert_eq!(setting(unit_text, "NoNewPrivileges"), "yes");
    let caps: Vec<String> = setting(unit_text, "CapabilityBoundingSet")
        .split_whitespace()
        .map(|c| format!("+{}", c.trim_start_matches("CAP_").to_lowercase()))
        .collect();
    let setpriv = need::program("setpriv", "util-linux");
    let mut cmd = Command::new(setpriv);
    cmd.arg("--no-new-privs")
        .arg(format!("--bounding-set=-all,{}", caps.join(",")))
        .arg("--")
        .arg(program)
        .args(args);
    spawn_logged(cmd, log)
}

#[test]
fn hostd_and_vdev_serve_a_tenant_within_the_units_privileges() {
    need::root("the daemons start as root and drop to nobody, as under systemd");
    let dir = scratch("run");
    let (hostd_unit, vdev_unit) = (unit("vrdma-hostd.service"), unit("vrdma-vdev@.service"));
    // The units' command lines, with this test's files for /etc and /run.
    let hostd_sock = dir.path().join("hostd.sock");
    let config = dir.path().join("hostd.toml");
    let text = format!("socket = \"{}\"\n", hostd_sock.display());
    std::fs::write(&config, text).expect("hostd config");
    assert!(setting(&hostd_unit, "ExecStart").ends_with("--config /etc/vrdma/hostd.toml"));
    let hostd_log = dir.path().join("hostd.log");
    let config_arg = config.display().to_string();
    let mut hostd = under_unit_limits(
        &hostd_unit,
        &binary("hostd"),
        &["--config", &config_arg],
        &hostd_log,
    );
    wait_for_path(&hostd_sock, "hostd", &mut hostd, &hostd_log);

    let vdev_config = dir.path().join("alpha.toml");
    std::fs::write(&vdev_config, "tenant = \"alpha\"\n").expect("vdev config");
    let vdev_sock = dir.path().join("alpha.sock");
    let exec = setting(&vdev_unit, "ExecStart");
    assert!(
        exec.contains("--config /etc/vrdma/vdev/%i.toml --socket /run/vrdma/%i.sock --hostd /run/vrdma/hostd.sock"),
        "{exec}"
    );
    let vdev_log = dir.path().join("vdev.log");
    let args = [
        "--config".to_owned(),
        vdev_config.display().to_string(),
        "--socket".to_owned(),
        vdev_sock.display().to_string(),
        "--hostd".to_owned(),
        hostd_sock.display().to_string(),
    ];
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut vdev = under_unit_limits(&vdev_unit, &binary("vdev"), &args, &vdev_log);
    wait_for_path(&vdev_sock, "vdev", &mut vdev, &vdev_log);

    // A tenant's device works through both.
    let ctx = vrdma_guest_driver::Context::open_vhost_user(&vdev_sock).unwrap_or_else(|e| {
        panic!(
            "open the device: {e}\n--- hostd:\n{}\n--- vdev:\n{}",
            std::fs::read_to_string(&hostd_log).unwrap_or_default(),
            std::fs::read_to_string(&vdev_log).unwrap_or_default()
        )
    });
    let pd = ctx.alloc_pd().expect("a PD");
    let mr = pd.alloc_mr(4096, 0).expect("an MR");
    assert_ne!(mr.lkey(), 0);
    // Both dropped everything, as without systemd: no capabilities and an
    // empty bounding set (which takes CAP_SETPCAP from the unit).
    for (log, name) in [(&hostd_log, "hostd"), (&vdev_log, "vdev")] {
        dropped_everything(log, name);
    }
    drop((mr, pd, ctx));
    for child in [&mut vdev, &mut hostd] {
        assert!(matches!(child.try_wait(), Ok(None)), "still running");
        let _ = child.kill();
        let _ = child.wait();
    }
}
