//! hostd is upgraded by handover while Debian's unmodified programs move
//! data: a new hostd (`--take-over`) takes the running one's sockets and
//! its contexts' transport state, the previous one exits 0, each vdev
//! registers its contexts with the new one, and the programs run on — a
//! pause, not an error — and exit 0 with their data checked
//! (docs/architecture.md, "hostd hands over").

use std::process::Child;
use std::time::{Duration, Instant};

use vrdma_tests::daemon::{tcp_listening, wait_output, IbverbsShim};
use vrdma_tests::need;
use vrdma_tests::two_tenants::{finish_pair, next_port, serial, spawn_pair, Fabric, Run};

/// What the new hostd logs per context that came back.
const BACK: &str = "Context back after the handover";
/// What the previous hostd logs as it goes.
const HANDED: &str = "Handed over to the new hostd; exiting";

/// Whether both programs still run.
fn both_running(server: &mut Child, client: &mut Child) -> bool {
    matches!((server.try_wait(), client.try_wait()), (Ok(None), Ok(None)))
}

/// How many contexts the new hostd took over (its log: "Took over from
/// the previous hostd ... contexts=N"; each vdev holds one context per
/// program and one made ahead for the next).
fn contexts_taken(log: &str) -> Option<usize> {
    let line = log
        .lines()
        .find(|l| l.contains("Took over from the previous hostd"))?;
    let n = line.split("contexts=").nth(1)?.split_whitespace().next()?;
    n.parse().ok()
}

/// Waits (10 s at most) until every context the new hostd took over came
/// back, and returns how many.
#[track_caller]
fn wait_all_back(log: impl Fn() -> String, logs: impl Fn() -> String) -> usize {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let text = log();
        if let Some(n) = contexts_taken(&text).filter(|&n| text.matches(BACK).count() >= n) {
            return n;
        }
        assert!(Instant::now() < deadline, "not all back:\n{}", logs());
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// The handover's traces in hostd's log (both processes write it): the
/// previous hostd handed over, every context came back, and no QP failed
/// to carry on.
#[track_caller]
fn assert_handed_over(log: &str, logs: &str) {
    assert!(log.contains(HANDED), "no handover:\n{logs}");
    let taken = contexts_taken(log).unwrap_or_else(|| panic!("nothing taken over:\n{logs}"));
    assert_eq!(
        log.matches(BACK).count(),
        taken,
        "contexts back after the handover:\n{logs}"
    );
    assert!(
        !log.contains("cannot carry on after the handover"),
        "a QP lost its transport:\n{logs}"
    );
}

#[test]
fn rc_pingpong_runs_on_while_hostd_is_handed_over() {
    need::program("ibv_rc_pingpong", "ibverbs-utils");
    let _serial = serial();
    let shim = IbverbsShim::new();
    let mut fabric = Fabric::start();
    let args = ["-g", "0", "-n", "100000", "-s", "4096", "-c"];
    let (mut server, mut client) = spawn_pair(&shim, &fabric, "ibv_rc_pingpong", &args, |_| {});
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        both_running(&mut server, &mut client),
        "ibv_rc_pingpong ended before the handover: make the run longer\n{}",
        fabric.logs()
    );
    fabric.hostd.hand_over();
    let contexts = wait_all_back(|| fabric.hostd.log(), || fabric.logs());
    assert!(contexts >= 2, "both programs' contexts:\n{}", fabric.logs());
    let mid_run = both_running(&mut server, &mut client);
    let run = finish_pair(&fabric, "ibv_rc_pingpong", server, client);
    assert!(mid_run, "the handover came after the run ended");
    for text in [run.server_text(), run.client_text()] {
        assert!(
            text.contains("100000 iters"),
            "every iteration ran:\n{text}"
        );
    }
    assert_handed_over(&fabric.hostd.log(), &fabric.logs());
    // The port never went down: no vdev saw hostd go.
    for vdev in [&fabric.alpha, &fabric.beta] {
        assert!(
            !vdev.log().contains("the port is down"),
            "{}",
            fabric.logs()
        );
    }
}
