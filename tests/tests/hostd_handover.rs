//! hostd is upgraded by handover while Debian's unmodified programs move
//! data: a new hostd (`--take-over`) takes the running one's sockets and
//! its contexts' transport state, the previous one exits 0, each vdev
//! registers its contexts with the new one, and the programs run on — a
//! pause, not an error — and exit 0 with their data checked
//! (docs/architecture.md, "hostd hands over").

use std::process::Child;
use std::time::{Duration, Instant};

use vrdma_tests::daemon::IbverbsShim;
use vrdma_tests::need;
use vrdma_tests::two_tenants::{
    finish_pair, finish_pair_logged, serial, spawn_pair, spawn_pair_on, Fabric, Run,
};

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

/// `program args` between alpha (server) and beta (client) of one host,
/// with hostd handed over `settle` into the run, then `meanwhile` (more
/// trouble while the programs run); both must exit 0 with the handover
/// having come mid-run and every context back. Returns what they printed.
fn on_one_host(
    fabric: &mut Fabric,
    program: &str,
    args: &[&str],
    settle: Duration,
    meanwhile: impl FnOnce(&mut Fabric),
) -> Run {
    let shim = IbverbsShim::new();
    let (mut server, mut client) = spawn_pair(&shim, fabric, program, args, |_| {});
    std::thread::sleep(settle);
    assert!(
        both_running(&mut server, &mut client),
        "{program} ended before the handover: make the run longer\n{}",
        fabric.logs()
    );
    fabric.hostd.hand_over();
    let contexts = wait_all_back(|| fabric.hostd.log(), || fabric.logs());
    assert!(contexts >= 2, "both programs' contexts:\n{}", fabric.logs());
    meanwhile(fabric);
    let mid_run = both_running(&mut server, &mut client);
    let run = finish_pair(fabric, program, server, client);
    assert!(mid_run, "the handover came after the run ended");
    assert_handed_over(&fabric.hostd.log(), &fabric.logs());
    run
}

/// Both sides ran `iters` iterations.
#[track_caller]
fn assert_iterations(run: &Run, iters: &str) {
    for text in [run.server_text(), run.client_text()] {
        assert!(
            text.contains(&format!("{iters} iters")),
            "every iteration ran:\n{text}"
        );
    }
}

#[test]
fn rc_pingpong_runs_on_while_hostd_is_handed_over() {
    need::program("ibv_rc_pingpong", "ibverbs-utils");
    let _serial = serial();
    let mut fabric = Fabric::start();
    let args = ["-g", "0", "-n", "100000", "-s", "4096", "-c"];
    let run = on_one_host(
        &mut fabric,
        "ibv_rc_pingpong",
        &args,
        Duration::from_millis(300),
        |_| {},
    );
    assert_iterations(&run, "100000");
    // The port never went down: no vdev saw hostd go.
    for vdev in [&fabric.alpha, &fabric.beta] {
        assert!(
            !vdev.log().contains("the port is down"),
            "{}",
            fabric.logs()
        );
    }
}

#[test]
fn write_bw_runs_on_while_hostd_is_handed_over() {
    need::program("ib_write_bw", "perftest");
    let _serial = serial();
    let mut fabric = Fabric::start();
    // Four seconds of 64 KiB WRITEs; hostd is handed over in the middle
    // (perftest takes a second to set up).
    let args = ["-x", "0", "-s", "65536", "-D", "4"];
    let run = on_one_host(
        &mut fabric,
        "ib_write_bw",
        &args,
        Duration::from_secs(3),
        |_| {},
    );
    // The report's line for 64 KiB: an average of 0 would mean nothing moved.
    assert!(
        average_64k(&run.client_text()) > 0.0,
        "{}",
        run.client_text()
    );
}

/// `program args` between alpha on `server` and alpha on `client` (hosts
/// of a three-host cluster; every RDMA byte goes over the namespaces'
/// bridge as RoCEv2), with h1's hostd handed over `settle` into the run:
/// the new one takes the RoCEv2 socket and each QP's PSNs, and what was on
/// the wire meanwhile is sent again (the peer's requester on its timeout,
/// h1's from the oldest message not completed). Both exit 0; returns what
/// they printed.
fn across_hosts(
    program: &str,
    args: &[&str],
    (server, client): (usize, usize),
    settle: Duration,
) -> Run {
    vrdma_tests::need::root("network namespaces");
    let _serial = serial();
    let shim = IbverbsShim::new();
    let mut fabric = vrdma_tests::hosts::Fabric::start();
    let (mut server, mut client) = spawn_pair_on(
        &shim,
        (
            fabric.device(server, "alpha"),
            fabric.device(client, "alpha"),
        ),
        program,
        args,
        |_| {},
    );
    std::thread::sleep(settle);
    assert!(
        both_running(&mut server, &mut client),
        "ended before the handover\n{}",
        fabric.logs()
    );
    let hostd = fabric.hostds[0].as_mut().expect("h1's hostd");
    hostd.hand_over();
    let log = || {
        fabric.hostds[0]
            .as_ref()
            .map(|h| h.log())
            .unwrap_or_default()
    };
    wait_all_back(log, || fabric.logs());
    let mid_run = both_running(&mut server, &mut client);
    let run = finish_pair_logged(program, (server, Duration::from_secs(30)), client, || {
        fabric.logs()
    });
    assert!(mid_run, "the handover came after the run ended");
    assert_handed_over(&log(), &fabric.logs());
    run
}

/// The average bandwidth of ib_write_bw's 64 KiB line (0 would mean
/// nothing moved).
fn average_64k(report: &str) -> f64 {
    let line = report
        .lines()
        .find(|l| l.trim_start().starts_with("65536"))
        .unwrap_or_else(|| panic!("no 64 KiB line:\n{report}"));
    line.split_whitespace()
        .nth(3)
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no average bandwidth in {line:?}"))
}

#[test]
fn rc_pingpong_across_hosts_runs_on_while_a_hostd_is_handed_over() {
    need::program("ibv_rc_pingpong", "ibverbs-utils");
    let args = ["-g", "0", "-n", "20000", "-s", "1024", "-c"];
    let run = across_hosts("ibv_rc_pingpong", &args, (1, 2), Duration::from_millis(500));
    assert_iterations(&run, "20000");
}

/// `program args` (a perftest bandwidth program) across hosts, once with
/// each side's order in `sides` (server host, client host), h1's hostd
/// handed over `settle` into each run: the client reports a 64 KiB line
/// with an average above 0.
fn bandwidth_across_hosts(
    program: &str,
    args: &[&str],
    sides: [(usize, usize); 2],
    settle: Duration,
) {
    for order in sides {
        let run = across_hosts(program, args, order, settle);
        assert!(
            average_64k(&run.client_text()) > 0.0,
            "{}",
            run.client_text()
        );
    }
}

/// h1 receives the WRITEs (its responder is handed over in the middle of
/// a 64 KiB message), then h1 sends them (its requester has a window of
/// WRITEs on the wire, sent again from the oldest).
#[test]
fn write_bw_across_hosts_runs_on_while_either_side_is_handed_over() {
    need::program("ib_write_bw", "perftest");
    let args = ["-x", "0", "-s", "65536", "-D", "4"];
    bandwidth_across_hosts(
        "ib_write_bw",
        &args,
        [(1, 2), (2, 1)],
        Duration::from_secs(3),
    );
}

/// READs across hosts: h1 reads from h2 (its requester has READs on the
/// wire, asked again from the oldest: the peer answers a duplicate READ
/// request by reading again), then h2 reads from h1 (h1's responder owes
/// READ responses, handed over).
#[test]
fn read_bw_across_hosts_runs_on_while_either_side_is_handed_over() {
    need::program("ib_read_bw", "perftest");
    let args = ["-x", "0", "-s", "65536", "-D", "3"];
    bandwidth_across_hosts(
        "ib_read_bw",
        &args,
        [(2, 1), (1, 2)],
        Duration::from_secs(2),
    );
}

/// The new hostd holds each context's whole journal (its vdev sends it
/// after bringing the context back): a vdev killed after the handover is
/// taken over by its successor as before it.
#[test]
fn a_vdev_killed_after_a_handover_is_still_taken_over() {
    need::program("ibv_rc_pingpong", "ibverbs-utils");
    let _serial = serial();
    let mut fabric = Fabric::start_with_hostd_args(&["--orphan-grace-ms", "30000"]);
    let args = ["-g", "0", "-n", "100000", "-s", "4096", "-c"];
    let run = on_one_host(
        &mut fabric,
        "ibv_rc_pingpong",
        &args,
        Duration::from_millis(300),
        |fabric| {
            // Killed once it has brought its contexts back to the new
            // hostd and sent their journals (killed in the middle of that,
            // a context is not kept: hostd cannot know what it missed).
            // (Its link logs each round of registrations; the last must be
            // done.)
            let back = |log: &str| {
                let done = log.rfind("Every context is on the new hostd");
                let started = log.rfind("vrdma_vdev::link: hostd handed over");
                matches!((done, started), (Some(d), Some(s)) if d > s)
            };
            let deadline = Instant::now() + Duration::from_secs(5);
            while !back(&fabric.alpha.log()) {
                assert!(Instant::now() < deadline, "not back:\n{}", fabric.logs());
                std::thread::sleep(Duration::from_millis(5));
            }
            fabric.alpha.restart();
            let deadline = Instant::now() + Duration::from_secs(5);
            while !fabric
                .alpha
                .log()
                .contains("Took over the context of the previous vdev")
            {
                assert!(Instant::now() < deadline, "no takeover:\n{}", fabric.logs());
                std::thread::sleep(Duration::from_millis(5));
            }
        },
    );
    assert_iterations(&run, "100000");
}

/// Completion events (`-e`): both programs sleep on their completion
/// channels across the handover; the interrupts come from the new hostd
/// through the eventfds the vdevs gave it again.
#[test]
fn rc_pingpong_on_completion_events_runs_on_while_hostd_is_handed_over() {
    need::program("ibv_rc_pingpong", "ibverbs-utils");
    let _serial = serial();
    let mut fabric = Fabric::start();
    let args = ["-g", "0", "-n", "20000", "-s", "4096", "-c", "-e"];
    let run = on_one_host(
        &mut fabric,
        "ibv_rc_pingpong",
        &args,
        Duration::from_millis(300),
        |_| {},
    );
    assert_iterations(&run, "20000");
}

/// Control verbs issued while hostd hands over do not fail: one whose
/// request to hostd meets the handover waits until its context is on the
/// new hostd and runs there. A program registering and deregistering
/// memory regions back to back (thousands a second) across a handover,
/// then creating a QP, sees no error.
#[test]
fn control_verbs_during_a_handover_wait_instead_of_failing() {
    let _serial = serial();
    let mut hostd = vrdma_tests::daemon::Hostd::start(None);
    let tenant = vrdma_tests::tenant::Tenant::start(&hostd, "alpha");
    let stop = std::sync::atomic::AtomicBool::new(false);
    let (verbs, tenant) = std::thread::scope(|s| {
        let worker = s.spawn(|| {
            let mut verbs = 0u64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let mr = tenant
                    .pd
                    .alloc_mr(4096, 0)
                    .unwrap_or_else(|e| panic!("REG_MR after {verbs} verbs: {e}"));
                mr.dereg()
                    .map_err(|e| e.error)
                    .unwrap_or_else(|e| panic!("DEREG_MR after {verbs} verbs: {e}"));
                verbs += 2;
            }
            verbs
        });
        std::thread::sleep(Duration::from_millis(200));
        hostd.hand_over();
        wait_all_back(|| hostd.log(), || hostd.log());
        std::thread::sleep(Duration::from_millis(200));
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        (worker.join(), &tenant)
    });
    let verbs = verbs.unwrap_or_else(|_| panic!("a verb failed:\n{}", tenant.vdev.log()));
    assert!(verbs > 100, "{verbs} verbs ran");
    // How many met the handover mid-request (0 when the handover fell
    // between two): for the record.
    let met = (tenant.vdev.log())
        .matches("Control command met a hostd handover")
        .count();
    eprintln!("{verbs} verbs, {met} of them met the handover mid-request");
    let qp = tenant.qp(vrdma_tests::tenant::default_caps());
    drop(qp);
    assert_handed_over(&hostd.log(), &tenant.vdev.log());
}

/// With a `[fabric]`, a device's GID is the first free one of its
/// tenant's pool on the host; after a handover each device gets its own
/// back whatever order the devices come back in (its peers' connections
/// name it). Here alpha has two devices and two GIDs on h1; the vdev of
/// the first device is stopped (SIGSTOP) through the handover, so the
/// second device registers with the new hostd first.
#[test]
fn each_device_gets_its_gid_back_whatever_order_it_comes_back_in() {
    vrdma_tests::need::root("network namespaces");
    let _serial = serial();
    let cluster = vrdma_tests::netns::Cluster::bridged(1);
    let files = vrdma_tests::daemon::TempDir::new("handover-gids");
    let cluster_file = files.path().join("cluster.toml");
    std::fs::write(
        &cluster_file,
        "[[host]]\nname = \"h1\"\naddress = \"10.200.0.1\"\n\n\
         [[gid]]\naddress = \"10.200.1.1\"\nhost = \"h1\"\ntenant = \"alpha\"\n\n\
         [[gid]]\naddress = \"10.200.1.2\"\nhost = \"h1\"\ntenant = \"alpha\"\n",
    )
    .expect("cluster file");
    let config = files.path().join("h1.toml");
    std::fs::write(
        &config,
        format!(
            "[fabric]\nhost = \"h1\"\ncluster = \"{}\"\ndirectory = \"static\"\n",
            cluster_file.display()
        ),
    )
    .expect("config");
    let config = config.to_str().expect("UTF-8");
    let policy = "[[tenant]]\nname = \"alpha\"\nnetwork = \"blue\"\n";
    let mut hostd = vrdma_tests::daemon::Hostd::start_in_netns(
        Some(&cluster.host(1).netns_path()),
        Some(policy),
        &["--config", config],
    );
    let mut first = vrdma_tests::daemon::Vdev::on_hostd(&hostd, "alpha", &[]);
    let second = vrdma_tests::daemon::Vdev::on_hostd(&hostd, "alpha", &[]);
    // Each device's GID, from hostd's log: "vdev connected ... device=..
    // ... gid=.." (the last such line per device).
    let gids = |log: &str| -> std::collections::BTreeMap<String, String> {
        let field = |line: &str, key: &str| -> Option<String> {
            let v = line
                .split(&format!(" {key}="))
                .nth(1)?
                .split_whitespace()
                .next()?;
            Some(v.trim_matches('"').to_owned())
        };
        (log.lines())
            .filter(|l| l.contains("vdev connected"))
            .filter_map(|l| Some((field(l, "device")?, field(l, "gid")?)))
            .collect()
    };
    // Both vdevs register their device as they start (the second may
    // still be at it).
    let deadline = Instant::now() + Duration::from_secs(10);
    while gids(&hostd.log()).len() < 2 {
        assert!(Instant::now() < deadline, "two devices:\n{}", hostd.log());
        std::thread::sleep(Duration::from_millis(10));
    }
    let before = gids(&hostd.log());
    assert_eq!(
        before
            .values()
            .collect::<std::collections::BTreeSet<_>>()
            .len(),
        2,
        "{before:?}"
    );
    first.signal(libc::SIGSTOP).expect("stop the first vdev");
    hostd.hand_over();
    // The second device is back first (its contexts: one each, made
    // ahead for a frontend).
    let deadline = Instant::now() + Duration::from_secs(10);
    while hostd.log().matches(BACK).count() < 1 {
        assert!(Instant::now() < deadline, "{}", hostd.log());
        std::thread::sleep(Duration::from_millis(5));
    }
    first
        .signal(libc::SIGCONT)
        .expect("continue the first vdev");
    wait_all_back(|| hostd.log(), || hostd.log());
    let after = gids(&hostd.log());
    eprintln!("GIDs before and after the handover: {before:?} / {after:?}");
    assert_eq!(after, before, "{}", hostd.log());
    drop(second);
}

/// A QP on an SRQ in the middle of receiving a SEND when hostd hands over
/// took its receive off the SRQ's ring at the message's first packet: the
/// new hostd gets that receive with the QP (else it would take the next
/// one and complete it with the message's first part missing). Debian's
/// `ibv_srq_pingpong` (16 QPs sharing the server's SRQ, every message's
/// contents checked with `-c`): across hosts with 64 KiB messages (64
/// packets of 1 KiB each: the server's QPs are mid-message most of the
/// time), and on one host with 8 KiB ones.
#[test]
fn srq_pingpong_runs_on_while_hostd_is_handed_over() {
    need::program("ibv_srq_pingpong", "ibverbs-utils");
    let args = ["-g", "0", "-n", "2000", "-s", "65536", "-m", "1024", "-c"];
    let run = across_hosts(
        "ibv_srq_pingpong",
        &args,
        (1, 2),
        Duration::from_millis(500),
    );
    assert_iterations(&run, "2000");
    let _serial = serial();
    let mut fabric = Fabric::start();
    let args = ["-g", "0", "-n", "20000", "-s", "8192", "-c"];
    let run = on_one_host(
        &mut fabric,
        "ibv_srq_pingpong",
        &args,
        Duration::from_millis(300),
        |_| {},
    );
    assert_iterations(&run, "20000");
}

/// What operators and Prometheus know by address keeps answering: the
/// metrics endpoint and the admin socket are the same sockets, served by
/// the new hostd once the previous one exited.
#[test]
fn metrics_and_the_admin_socket_answer_on_after_a_handover() {
    let _serial = serial();
    let mut hostd =
        vrdma_tests::daemon::Hostd::start_with(None, &["--metrics-listen", "127.0.0.1:0"]);
    let addr = hostd.metrics_addr();
    let scrape = || {
        use std::io::{Read, Write};
        let mut s = std::net::TcpStream::connect(addr).expect("connect to /metrics");
        s.set_read_timeout(Some(Duration::from_secs(10)))
            .expect("timeout");
        s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            .expect("ask");
        let mut answer = String::new();
        s.read_to_string(&mut answer).expect("read");
        answer
    };
    assert!(scrape().starts_with("HTTP/1.1 200"), "before");
    let alpha = vrdma_tests::tenant::Tenant::start(&hostd, "alpha");
    hostd.hand_over();
    wait_all_back(|| hostd.log(), || hostd.log());
    let answer = scrape();
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert!(answer.contains("vrdma_"), "{answer}");
    let (code, stats, err) = hostd.ctl(&["stats", "--json"]);
    assert_eq!(code, 0, "{err}");
    assert!(stats.contains("alpha"), "{stats}");
    drop(alpha);
}
