//! The VM test's guest program (`vrdma-guest`), run here in process mode:
//! two copies against two tenants' vdevs on one hostd, QP information
//! exchanged over TCP on the loopback, WRITE/READ/SEND checked by both.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};

use vrdma_tools::supervisor::{find_binary, Daemon, Launch, Scratch};

const GUEST: &str = env!("CARGO_BIN_EXE_vrdma-guest");

/// hostd on its default policy and a vdev for each of its tenants.
fn daemons(dir: &Scratch) -> [Daemon; 3] {
    let hostd = find_binary("hostd", "vrdma-hostd").expect("hostd binary");
    let vdev = find_binary("vdev", "vrdma-vdev").expect("vdev binary");
    let hostd = Launch::hostd(&hostd, dir.path())
        .start()
        .expect("start hostd");
    let on_hostd = |tenant| Launch::vdev(&vdev, dir.path(), tenant, Some(hostd.socket()));
    let alpha = on_hostd("alpha").start().expect("start vdev alpha");
    let beta = on_hostd("beta").start().expect("start vdev beta");
    [alpha, beta, hostd]
}

#[test]
fn two_guest_programs_pass_against_each_other() {
    let dir = Scratch::new("guest-program").expect("scratch directory");
    let [alpha, beta, _hostd] = daemons(&dir);
    let device = |v: &Daemon| v.socket().to_str().expect("UTF-8 socket").to_owned();
    let mut listener = Command::new(GUEST)
        .args([
            "--device",
            &device(&alpha),
            "--listen",
            "127.0.0.1:0",
            "--size",
            "40000",
        ])
        .stdout(Stdio::piped())
        .spawn()
        .expect("start the listening guest program");
    let mut out = BufReader::new(listener.stdout.take().expect("stdout"));
    let mut first = String::new();
    out.read_line(&mut first).expect("first line");
    let addr = first
        .trim()
        .strip_prefix("VRDMA-GUEST: LISTENING ")
        .unwrap_or_else(|| panic!("unexpected first line {first:?}"))
        .to_owned();
    let connector = Command::new(GUEST)
        .args([
            "--device",
            &device(&beta),
            "--connect",
            &addr,
            "--size",
            "40000",
        ])
        .output()
        .expect("run the connecting guest program");
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut out, &mut rest).expect("listener output");
    let status = listener.wait().expect("listener exit");
    let connector_out = String::from_utf8_lossy(&connector.stdout);
    for (who, text, ok) in [
        ("listener", rest.as_str(), status.success()),
        ("connector", &*connector_out, connector.status.success()),
    ] {
        let verdict = text.lines().last().unwrap_or_default();
        assert!(
            ok && verdict.starts_with("VRDMA-GUEST: PASS WRITE, READ and SEND/RECV of 40000 bytes"),
            "{who}: {text}\nlistener said: {rest}\nconnector said: {connector_out}"
        );
    }
}

#[test]
fn a_missing_device_is_a_fail_verdict() {
    let out = Command::new(GUEST)
        .args([
            "--device",
            "/nonexistent/vdev.sock",
            "--connect",
            "127.0.0.1:1",
        ])
        .output()
        .expect("run the guest program");
    assert!(!out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.lines()
            .last()
            .unwrap_or_default()
            .starts_with("VRDMA-GUEST: FAIL cannot open /nonexistent/vdev.sock"),
        "{text}"
    );
}
