//! The port of a vrdma device goes down when hostd (the host's datapath)
//! goes away, and every open context of the device is told (issue 14):
//! Debian's unmodified `ibv_asyncwatch` prints `IBV_EVENT_PORT_ERR` on
//! port 1, and a program with two contexts (`tests/c/port_events.c`) gets
//! one `IBV_EVENT_PORT_ERR` on each and then finds port 1 down, its QP
//! (in RESET: nothing ran) as it was, new CQs refused (EIO) and its
//! objects still destroyed. When hostd comes back the port comes back in
//! the same contexts, as after a link flap (`tests/c/port_flap.c`):
//! `IBV_EVENT_PORT_ACTIVE`, the QP that was connected in ERR with its
//! work flushed, the device's GID unchanged, and new QPs that move data
//! to another tenant. All run on the drop-in library, in process mode.

use std::io::{BufRead, BufReader, Lines, Write};
use std::process::{Child, ChildStdout, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use vrdma_tests::c_program::build_c_program;
use vrdma_tests::daemon::{Hostd, IbverbsShim, TempDir, Vdev};
use vrdma_tests::need;
use vrdma_tests::two_tenants::{run_pair, Fabric};

/// How long a line may take to come.
const PATIENCE: Duration = Duration::from_secs(30);

/// `child`'s stdout lines, read on a thread so that waiting for one can
/// time out.
fn lines_of(child: &mut Child) -> mpsc::Receiver<String> {
    let out = child.stdout.take().expect("piped stdout");
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let lines: Lines<BufReader<ChildStdout>> = BufReader::new(out).lines();
        for line in lines.map_while(Result::ok) {
            if tx.send(line).is_err() {
                return;
            }
        }
    });
    rx
}

/// Lines from `rx` until one that `done` accepts (within [`PATIENCE`]);
/// all of them, that one last.
fn read_until(
    rx: &mpsc::Receiver<String>,
    done: impl Fn(&str) -> bool,
    logs: &dyn Fn() -> String,
) -> Vec<String> {
    let mut got = Vec::new();
    loop {
        match rx.recv_timeout(PATIENCE) {
            Ok(line) => {
                let last = done(&line);
                got.push(line);
                if last {
                    return got;
                }
            }
            Err(e) => panic!("no expected line ({e}); got {got:?}\n{}", logs()),
        }
    }
}

#[test]
fn hostd_going_away_takes_the_port_down_in_every_context() {
    need::program("ibv_asyncwatch", "ibverbs-utils");
    let dir = TempDir::new("port-events");
    let exe = build_c_program(&dir, "port_events", include_str!("../c/port_events.c"));
    let mut hostd = Hostd::start(None);
    let vdev = Vdev::on_hostd(&hostd, "alpha", &[]);
    let shim = IbverbsShim::new();
    let hostd_log = hostd.log_path().to_owned();
    let vdev_log = || {
        format!(
            "--- hostd log:\n{}\n--- vdev log:\n{}",
            std::fs::read_to_string(&hostd_log).unwrap_or_default(),
            vdev.log()
        )
    };

    let mut watch = shim
        .command("ibv_asyncwatch", &vdev.socket)
        .spawn()
        .expect("run ibv_asyncwatch");
    let watch_lines = lines_of(&mut watch);
    let mut program = shim
        .command(exe.to_str().expect("UTF-8 path"), &vdev.socket)
        .arg("2")
        .spawn()
        .expect("run port_events");
    let program_lines = lines_of(&mut program);
    // Both are open (three contexts) before hostd goes.
    read_until(&watch_lines, |l| l.contains("async event FD"), &vdev_log);
    read_until(&program_lines, |l| l == "ready", &vdev_log);
    vdev.wait_settled(3);

    hostd.kill();

    let events = read_until(&watch_lines, |l| l.contains("event_type"), &vdev_log);
    assert_eq!(
        events.last().map(String::as_str),
        Some("  event_type IBV_EVENT_PORT_ERR (10), port 1"),
        "{}",
        vdev_log()
    );
    let create_cq = format!("create_cq: errno {}", libc::EIO);
    let seen = read_until(&program_lines, |l| l == "destroyed", &vdev_log);
    assert_eq!(
        seen,
        [
            "context 0: port error port 1",
            "context 1: port error port 1",
            "context 0: state down",
            "context 1: state down",
            // The device's verbs that need hostd fail: it is gone.
            create_cq.as_str(),
            // Its QP was in RESET and stays there (IBV_QPS_RESET): it was
            // not connected, nothing of it ran on the datapath that went;
            // and what it made is destroyed all the same.
            "qp state 0",
            "destroyed",
        ],
        "{}",
        vdev_log()
    );
    let status = program.wait().expect("port_events exits");
    assert!(status.success(), "port_events: {status}\n{}", vdev_log());
    // One event per context: ibv_asyncwatch gets no second one.
    assert!(
        watch_lines
            .recv_timeout(Duration::from_millis(500))
            .is_err(),
        "a second event"
    );
    let _ = watch.kill();
    let _ = watch.wait();
    vdev.assert_logged(&["hostd went away: the port is down"]);
}

/// The line of `lines` that starts with `prefix`, without it (the last
/// line that `read_until` returned).
fn value_after<'l>(lines: &'l [String], prefix: &str) -> &'l str {
    lines
        .iter()
        .find_map(|l| l.strip_prefix(prefix))
        .unwrap_or_else(|| panic!("no {prefix:?} in {lines:?}"))
}

/// hostd killed and started again on the same socket with the same
/// policy, as an upgrade or a crash and its supervisor would: on the same
/// vdevs (not restarted) and the same open contexts, Debian's
/// `ibv_asyncwatch` prints `IBV_EVENT_PORT_ERR` then
/// `IBV_EVENT_PORT_ACTIVE`; a program (`tests/c/port_flap.c`) whose QP
/// was connected gets `IBV_EVENT_QP_FATAL` for it, finds it in ERR, the
/// port down and new CQs refused (EIO) while hostd is away, and the SEND
/// it posts then completes with `IBV_WC_WR_FLUSH_ERR` once hostd is back;
/// the port's GID is the same after the restart, a new QP on the same PD,
/// MR and CQ connects to tenant beta and moves 4 KiB whose bytes beta
/// checks, hostd counts alpha's objects once, and a fresh
/// `ibv_rc_pingpong` between the two tenants passes.
#[test]
fn the_port_comes_back_in_the_same_contexts_when_hostd_restarts() {
    need::program("ibv_asyncwatch", "ibverbs-utils");
    need::program("ibv_rc_pingpong", "ibverbs-utils");
    let dir = TempDir::new("port-flap");
    let exe = build_c_program(&dir, "port_flap", include_str!("../c/port_flap.c"));
    let exe = exe.to_str().expect("UTF-8 path");
    let mut fabric = Fabric::start();
    let shim = IbverbsShim::new();

    let mut watch = shim
        .command("ibv_asyncwatch", &fabric.alpha.socket)
        .spawn()
        .expect("run ibv_asyncwatch");
    let watch_lines = lines_of(&mut watch);
    let mut flap = shim
        .command(exe, &fabric.alpha.socket)
        .arg("flap")
        .stdin(Stdio::piped())
        .spawn()
        .expect("run port_flap flap");
    let flap_lines = lines_of(&mut flap);
    let logs = || String::new();
    read_until(&watch_lines, |l| l.contains("async event FD"), &logs);
    let start = read_until(&flap_lines, |l| l == "ready", &logs);
    let gid_before = value_after(&start, "gid ").to_owned();
    fabric.alpha.wait_settled(2);
    let usage_before = fabric.hostd.usage("alpha");
    assert_eq!(usage_before["qps"], 1, "{usage_before}");

    fabric.hostd.kill();
    let event = read_until(&watch_lines, |l| l.contains("event_type"), &logs);
    assert_eq!(
        event.last().map(String::as_str),
        Some("  event_type IBV_EVENT_PORT_ERR (10), port 1"),
        "{}",
        fabric.logs()
    );
    let down = read_until(&flap_lines, |l| l == "posted", &|| fabric.logs());
    let create_cq = format!("create_cq: errno {}", libc::EIO);
    assert_eq!(
        down,
        [
            "event port error",
            // IBV_EVENT_QP_FATAL, for its own QP.
            "event local work queue catastrophic error qp=mine",
            "state down",
            // IBV_QPS_ERR: it was connected through the datapath that went.
            "qp state 6",
            create_cq.as_str(),
            "posted",
        ],
        "{}",
        fabric.logs()
    );

    // Same socket, same policy.
    fabric.hostd.restart().expect("hostd starts again");
    let event = read_until(&watch_lines, |l| l.contains("event_type"), &|| {
        fabric.logs()
    });
    assert_eq!(
        event.last().map(String::as_str),
        Some("  event_type IBV_EVENT_PORT_ACTIVE (9), port 1"),
        "{}",
        fabric.logs()
    );
    let up = read_until(&flap_lines, |l| l.starts_with("wc status"), &|| {
        fabric.logs()
    });
    let gid_after = format!("gid {gid_before}");
    let flushed = format!("wc status {} wr_id 7", 5 /* IBV_WC_WR_FLUSH_ERR */);
    assert_eq!(
        up,
        [
            "event port active",
            "state active",
            "qp state 6",
            gid_after.as_str(),
            flushed.as_str(),
        ],
        "the same GID; the SEND posted while the port was down is flushed\n{}",
        fabric.logs()
    );
    // A new QP on the same PD, MR and CQ, to tenant beta.
    let mut recv = shim
        .command(exe, &fabric.beta.socket)
        .arg("recv")
        .stdin(Stdio::piped())
        .spawn()
        .expect("run port_flap recv");
    let recv_lines = lines_of(&mut recv);
    let ours = read_until(&flap_lines, |l| l.starts_with("qp "), &|| fabric.logs());
    // Restored objects are counted once: as before the restart, with the
    // new QP (the program waits for beta's line now).
    let usage_after = fabric.hostd.usage("alpha");
    assert_eq!(usage_after["qps"], 2, "{usage_after}");
    for key in ["devices", "physical_queues", "mrs", "mr_bytes"] {
        assert_eq!(usage_after[key], usage_before[key], "{key}: {usage_after}");
    }
    let theirs = read_until(&recv_lines, |l| l.starts_with("qp "), &|| fabric.logs());
    let tell = |child: &mut Child, line: &str| {
        let stdin = child.stdin.as_mut().expect("piped stdin");
        writeln!(stdin, "{line}").expect("write the peer's line");
    };
    tell(&mut flap, theirs.last().expect("beta's qp line"));
    tell(&mut recv, ours.last().expect("alpha's qp line"));
    read_until(&flap_lines, |l| l == "sent", &|| fabric.logs());
    let got = read_until(&recv_lines, |l| l.starts_with("received"), &|| {
        fabric.logs()
    });
    assert_eq!(
        got.last().map(String::as_str),
        Some("received 4096 bytes, pattern ok")
    );
    for (name, child) in [("flap", &mut flap), ("recv", &mut recv)] {
        let status = child.wait().expect("port_flap exits");
        assert!(
            status.success(),
            "port_flap {name}: {status}\n{}",
            fabric.logs()
        );
    }
    let _ = watch.kill();
    let _ = watch.wait();

    // Both vdevs lived through the restart: a fresh pair of programs.
    let run = run_pair(
        &shim,
        &fabric,
        "ibv_rc_pingpong",
        &["-g", "0", "-n", "100", "-c"],
    );
    let client = run.client_text();
    assert!(
        client.contains(" bytes in ") && client.contains(" iters in "),
        "{client}\n{}",
        fabric.logs()
    );
    fabric.alpha.assert_logged(&[
        "hostd went away: the device's port is down",
        "Context registered with hostd again",
        "hostd is back: the device's port is active again",
    ]);
}
