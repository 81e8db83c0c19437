//! A vdev that dies (SIGKILL) and is restarted takes nothing of its
//! tenant's with it: Debian's unmodified programs, through the drop-in
//! `libibverbs.so.1`, run on across the restart and exit 0 with their data
//! checked. hostd keeps the dead vdev's contexts running for the next
//! vdev (docs/architecture.md, "A context outlives its vdev"); the
//! programs' drivers reconnect to the restarted vdev, which takes their
//! contexts over from hostd's journal, and the verbs after it (the
//! teardown at the end) work on the objects made before it.

use std::process::Child;
use std::time::{Duration, Instant};

use vrdma_tests::daemon::IbverbsShim;
use vrdma_tests::need;
use vrdma_tests::two_tenants::{
    finish_pair, finish_pair_logged, serial, spawn_pair, spawn_pair_on, Fabric,
};

/// hostd keeps a dead vdev's contexts for its successor (the tests'
/// hostds do not by default).
const KEEP_ORPHANS: &[&str] = &["--orphan-grace-ms", "30000"];

/// What a restarted vdev logs per context it took over.
const TAKEN_OVER: &str = "Took over the context of the previous vdev";

/// Starts `program args` as the server on alpha and its client on beta,
/// and waits until the client has been running for `settle` (the pair
/// has connected and moves data).
fn start_pair(
    shim: &IbverbsShim,
    fabric: &Fabric,
    program: &str,
    args: &[&str],
    settle: Duration,
) -> (Child, Child) {
    let pair = spawn_pair(shim, fabric, program, args, |_| {});
    std::thread::sleep(settle);
    pair
}

/// The server's QP was connected (INIT, then RTR: perftest's WRITE
/// server goes no further) before its vdev is killed: the restart comes
/// while data moves.
#[track_caller]
fn assert_connected(fabric: &Fabric) {
    let log = fabric.alpha.log();
    assert!(
        log.matches("opcode=ModifyQp").count() >= 2,
        "the server's QP is not connected yet:\n{}",
        fabric.logs()
    );
}

/// Whether both programs still run (the kill came in the middle).
fn both_running(server: &mut Child, client: &mut Child) -> bool {
    matches!((server.try_wait(), client.try_wait()), (Ok(None), Ok(None)))
}

#[test]
fn rc_pingpong_runs_on_while_its_vdev_is_killed_and_restarted() {
    // 100000 round trips with 4 KiB messages (the programs check every
    // message's size and, with -c, the receive's contents).
    pingpong_across_a_restart(&["-g", "0", "-n", "100000", "-s", "4096", "-c"]);
}

/// The same, both sides sleeping on completion events (`-e`): the driver
/// is waiting on its completion channel when its vdev dies, reconnects
/// from there, and the interrupts (hostd's) go on meanwhile.
#[test]
fn rc_pingpong_on_completion_events_runs_on_while_its_vdev_is_killed_and_restarted() {
    pingpong_across_a_restart(&["-g", "0", "-n", "20000", "-s", "4096", "-c", "-e"]);
}

fn pingpong_across_a_restart(args: &[&str]) {
    need::program("ibv_rc_pingpong", "ibverbs-utils");
    let _serial = serial();
    let shim = IbverbsShim::new();
    let mut fabric = Fabric::start_with_hostd_args(KEEP_ORPHANS);
    let iters = args
        .iter()
        .skip_while(|&&a| a != "-n")
        .nth(1)
        .copied()
        .unwrap_or("1000");
    let (mut server, mut client) = start_pair(
        &shim,
        &fabric,
        "ibv_rc_pingpong",
        args,
        Duration::from_millis(300),
    );
    assert!(
        both_running(&mut server, &mut client),
        "ibv_rc_pingpong ended before the kill: make the run longer\n{}",
        fabric.logs()
    );
    assert_connected(&fabric);
    fabric.alpha.restart();
    // The drivers reconnect as soon as vdev is back, not at their next
    // verb (a polling program has none until its end): the takeover comes
    // while the programs run.
    let deadline = Instant::now() + Duration::from_secs(5);
    while !fabric.alpha.log().contains(TAKEN_OVER) {
        assert!(Instant::now() < deadline, "no takeover:\n{}", fabric.logs());
        std::thread::sleep(Duration::from_millis(5));
    }
    let killed_mid_run = both_running(&mut server, &mut client);
    let run = finish_pair(&fabric, "ibv_rc_pingpong", server, client);
    assert!(
        killed_mid_run,
        "the restart and the takeover came after the run ended"
    );
    for text in [run.server_text(), run.client_text()] {
        assert!(
            text.contains(&format!("{iters} iters")),
            "every iteration ran:\n{text}"
        );
    }
    let alpha = fabric.alpha.log();
    assert!(
        alpha.contains("Took over the context of the previous vdev"),
        "the restarted vdev took the context over:\n{}",
        fabric.logs()
    );
    let hostd = fabric.hostd.log();
    assert!(
        hostd.contains("its context runs on, kept for the next vdev")
            && hostd.contains("A new vdev took over an orphaned context"),
        "hostd kept the context for the new vdev:\n{hostd}"
    );
}

#[test]
fn write_bw_runs_on_while_its_vdev_is_killed_and_restarted() {
    need::program("ib_write_bw", "perftest");
    let _serial = serial();
    let shim = IbverbsShim::new();
    let mut fabric = Fabric::start_with_hostd_args(KEEP_ORPHANS);
    // Four seconds of 64 KiB WRITEs; the server's vdev dies in the middle
    // (perftest takes a second to set up).
    let args = ["-x", "0", "-s", "65536", "-D", "4"];
    let (mut server, mut client) =
        start_pair(&shim, &fabric, "ib_write_bw", &args, Duration::from_secs(3));
    assert!(both_running(&mut server, &mut client), "{}", fabric.logs());
    assert_connected(&fabric);
    fabric.alpha.restart();
    let run = finish_pair(&fabric, "ib_write_bw", server, client);
    // The report's line for 64 KiB: bytes, iterations, peak and average
    // bandwidth, message rate; an average of 0 would mean nothing moved.
    let report = run.client_text();
    let line = report
        .lines()
        .find(|l| l.trim_start().starts_with("65536"))
        .unwrap_or_else(|| panic!("no 64 KiB line:\n{report}"));
    let average: f64 = line
        .split_whitespace()
        .nth(3)
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no average bandwidth in {line:?}"));
    assert!(average > 0.0, "{line}");
    assert!(
        fabric
            .alpha
            .log()
            .contains("Took over the context of the previous vdev"),
        "{}",
        fabric.logs()
    );
}

/// The same across hosts: alpha on h1 serves, alpha on h2 is the client,
/// every RDMA byte goes over the namespaces' bridge as RoCEv2; h1's vdev
/// is killed and restarted mid-run.
#[test]
fn rc_pingpong_across_hosts_runs_on_while_a_vdev_is_killed_and_restarted() {
    vrdma_tests::need::root("network namespaces");
    need::program("ibv_rc_pingpong", "ibverbs-utils");
    let _serial = serial();
    let shim = IbverbsShim::new();
    let mut fabric = vrdma_tests::hosts::Fabric::start_with_hostd_args(KEEP_ORPHANS);
    // Across hosts a round trip costs tens of µs (two kernels' UDP paths):
    // fewer iterations, one 1 KiB packet each way.
    let args = ["-g", "0", "-n", "20000", "-s", "1024", "-c"];
    let (mut server, mut client) = spawn_pair_on(
        &shim,
        (fabric.device(1, "alpha"), fabric.device(2, "alpha")),
        "ibv_rc_pingpong",
        &args,
        |_| {},
    );
    std::thread::sleep(Duration::from_millis(500));
    assert!(
        both_running(&mut server, &mut client),
        "ended before the kill\n{}",
        fabric.logs()
    );
    let vdev = (fabric.vdevs.iter_mut())
        .find(|(host, tenant, _)| *host == 1 && tenant == "alpha")
        .map(|(_, _, vdev)| vdev)
        .expect("h1's alpha");
    assert!(
        vdev.log().matches("opcode=ModifyQp").count() >= 3,
        "not connected yet"
    );
    vdev.restart();
    let run = finish_pair_logged(
        "ibv_rc_pingpong",
        (server, Duration::from_secs(30)),
        client,
        || fabric.logs(),
    );
    assert!(
        run.client_text().contains("20000 iters"),
        "{}",
        run.client_text()
    );
    let log = fabric.vdev(1, "alpha").log();
    assert!(
        log.contains("Took over the context of the previous vdev"),
        "{}",
        fabric.logs()
    );
}

/// A program that makes no verb after its vdev died (it polls, or sleeps)
/// still keeps its device: its driver watches the socket and reconnects
/// as soon as the new vdev listens, which takes the context over — long
/// before hostd's grace period would end it.
#[test]
fn an_idle_driver_reconnects_on_its_own() {
    let _serial = serial();
    let hostd = vrdma_tests::daemon::Hostd::start_with(None, KEEP_ORPHANS);
    let mut tenant = vrdma_tests::tenant::Tenant::start(&hostd, "alpha");
    let mr = tenant
        .pd
        .alloc_mr(4096, 0)
        .expect("an MR before the restart");
    tenant.vdev.restart();
    let deadline = Instant::now() + Duration::from_secs(5);
    while !tenant.vdev.log().contains(TAKEN_OVER) {
        assert!(
            Instant::now() < deadline,
            "no takeover without a verb:\n{}",
            tenant.vdev.log()
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    // The objects made before work on: the MR deregisters, a QP is made
    // on the CQ from before.
    let qp = tenant.qp(vrdma_tests::tenant::default_caps());
    drop(qp);
    mr.dereg()
        .map_err(|e| e.error)
        .expect("dereg after the restart");
}

/// A frontend that does not come back to a restarted vdev (it did not ack
/// VRDMA_F_RECONNECT: a VMM without reconnect, or a driver told not to
/// wait) leaves nothing running when its vdev dies: its memory may be
/// reused, so hostd releases the context at once, as before contexts
/// outlived their vdev.
#[test]
fn a_frontend_that_does_not_come_back_leaves_nothing_running() {
    let _serial = serial();
    let hostd = vrdma_tests::daemon::Hostd::start_with(None, KEEP_ORPHANS);
    let mut tenant = vrdma_tests::tenant::Tenant::open_without_reconnect(
        vrdma_tests::daemon::Vdev::on_hostd(&hostd, "alpha", &[]),
    );
    let qp = tenant.qp(vrdma_tests::tenant::default_caps());
    assert_eq!(hostd.usage("alpha")["qps"], 1);
    tenant.vdev.kill();
    let deadline = Instant::now() + Duration::from_secs(5);
    while hostd.usage("alpha")["qps"] != 0 {
        assert!(Instant::now() < deadline, "{}", hostd.log());
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(
        hostd.log().contains("its frontend does not come back"),
        "{}",
        hostd.log()
    );
    assert_eq!(hostd.usage("alpha")["orphaned_contexts"], 0);
    drop(qp);
}
