//! Debian's rdma_cm programs (rdmacm-utils) run unmodified on vrdma's
//! drop-in `librdmacm.so.1`, between two process-mode tenants of one hostd,
//! connecting by the server device's IP address.

use std::net::Ipv4Addr;
use std::time::Duration;

use vrdma_tests::daemon::{wait_output, IbverbsShim, TempDir, Vdev};
use vrdma_tests::need;
use vrdma_tests::two_tenants::{next_port, serial, Fabric};

/// The IPv4 address of `vdev`'s device (its IPv4-mapped GID 0), as
/// `ibv_devinfo -v` prints it through the shim.
fn ip_of(shim: &IbverbsShim, vdev: &Vdev) -> Ipv4Addr {
    let out = shim
        .command("ibv_devinfo", &vdev.socket)
        .arg("-v")
        .output()
        .expect("run ibv_devinfo");
    let text = String::from_utf8_lossy(&out.stdout);
    text.lines()
        .find_map(|l| {
            let l = l.trim();
            l.strip_prefix("GID[  0]:")
                .and_then(|g| g.trim().split(',').next())
                .and_then(|g| g.trim().strip_prefix("::ffff:"))
                .and_then(|ip| ip.parse().ok())
        })
        .unwrap_or_else(|| panic!("no IPv4 GID in ibv_devinfo -v:\n{text}"))
}

/// Runs `program server_args` on alpha and, once it listens, `program
/// client_args` on beta; returns both outputs (stdout + stderr).
fn pair(
    fabric: &Fabric,
    shim: &IbverbsShim,
    program: &str,
    server: &[String],
    client: &[String],
) -> (String, String, bool, bool) {
    need::program(program, "rdmacm-utils");
    // Output goes to files: wait_output reads pipes only once a program
    // ends, and a verbose rping fills a 64 KiB pipe (and blocks) first.
    let dir = TempDir::new("rdmacm-out");
    // stdout and stderr apart: rping's buffered stdout and unbuffered
    // stderr would interleave mid-line in one file.
    let start = |side: &str, vdev: &Vdev, args: &[String]| {
        let file = |ext: &str| {
            std::fs::File::create(dir.path().join(format!("{side}.{ext}"))).expect("output file")
        };
        shim.command(program, &vdev.socket)
            .args(args)
            .stdout(file("out"))
            .stderr(file("err"))
            .spawn()
            .expect("start")
    };
    let s = start("server", &fabric.alpha, server);
    std::thread::sleep(Duration::from_millis(500));
    let c = start("client", &fabric.beta, client);
    let (co, _) = wait_output(c, Duration::from_secs(60));
    let (so, _) = wait_output(s, Duration::from_secs(20));
    let read = |side: &str| {
        let part = |ext: &str| {
            std::fs::read_to_string(dir.path().join(format!("{side}.{ext}"))).unwrap_or_default()
        };
        // stdout first, whole lines; then stderr.
        format!("{}{}", part("out"), part("err"))
    };
    (
        read("server"),
        read("client"),
        so.status.success(),
        co.status.success(),
    )
}

#[test]
fn rping_verifies_1000_pings_between_two_tenants() {
    let _one = serial();
    let fabric = Fabric::start();
    let shim = IbverbsShim::new();
    let ip = ip_of(&shim, &fabric.alpha).to_string();
    let port = next_port().to_string();
    let s: Vec<String> = ["-s", "-v", "-V", "-C", "1000", "-a", "0.0.0.0", "-p", &port]
        .map(String::from)
        .to_vec();
    let c: Vec<String> = ["-c", "-v", "-V", "-C", "1000", "-a", &ip, "-p", &port]
        .map(String::from)
        .to_vec();
    let (so, co, sok, cok) = pair(&fabric, &shim, "rping", &s, &c);
    assert!(
        sok && cok,
        "rping failed\n--- server:\n{so}\n--- client:\n{co}\n{}",
        fabric.logs()
    );
    let pings = co
        .lines()
        .filter(|l| l.starts_with("ping data: rdma-ping-"))
        .count();
    assert_eq!(pings, 1000, "the client verified every ping:\n{co}");
}
