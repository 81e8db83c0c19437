//! The port of a vrdma device goes down when hostd (the host's datapath)
//! goes away, and every open context of the device is told (issue 14):
//! Debian's unmodified `ibv_asyncwatch` prints `IBV_EVENT_PORT_ERR` on
//! port 1, and a program with two contexts (`tests/c/port_events.c`) gets
//! one `IBV_EVENT_PORT_ERR` on each and then finds port 1 down, its QP in
//! ERR, new CQs refused (EIO) and its objects still destroyed. All run on
//! the drop-in library, on tenant alpha's device in process mode.

use std::io::{BufRead, BufReader, Lines};
use std::process::{Child, ChildStdout};
use std::sync::mpsc;
use std::time::Duration;

use vrdma_tests::c_program::build_c_program;
use vrdma_tests::daemon::{Hostd, IbverbsShim, TempDir, Vdev};
use vrdma_tests::need;

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
            // Its QP is in ERR (IBV_QPS_ERR): the datapath that ran it is
            // gone; and what it made is destroyed all the same.
            "qp state 6",
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
