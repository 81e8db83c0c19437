//! Debian's unmodified rdma_cm programs on vrdma's drop-in
//! `librdmacm.so.1`, each between two tenants of one host and between two
//! hosts (the multi-host namespaces of [`vrdma_tests::hosts`]), the client
//! naming the server by its device's IP address as on a RoCE NIC:
//! rdmacm-utils (rping, ucmatose, udaddy, rdma_server/rdma_client,
//! cmtime), perftest over rdma_cm (`-R`), qperf on RoCE ports (`-cm1`) and
//! libfabric's verbs provider with connected endpoints. Then the ways a
//! connection fails (nobody listening, another tenant's address, the
//! server killed) and 1,000 connect/disconnect cycles that leave the
//! devices' counters where they started.
//!
//! Every program runs inside its host's network namespace, where its
//! device's address is on the host's interface (as an RoCE NIC's GID is
//! its netdev's address); the programs' own TCP exchanges (qperf's,
//! libfabric's) go to that address too.

use std::net::Ipv4Addr;
use std::process::{Child, Command};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use vrdma_tests::c_program::build_rdmacm_program;
use vrdma_tests::daemon::{tcp_listening, wait_output, IbverbsShim, TempDir};
use vrdma_tests::hosts::{tail, Fabric};
use vrdma_tests::need;
use vrdma_tests::qperf;
use vrdma_tests::strings;

static SERIAL: Mutex<()> = Mutex::new(());

/// One cluster at a time: the machine has two cores.
fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// A port no other test of this run uses.
fn next_port() -> u16 {
    use std::sync::atomic::{AtomicU16, Ordering};
    static NEXT: AtomicU16 = AtomicU16::new(0);
    20000 + (std::process::id() % 10000) as u16 + NEXT.fetch_add(1, Ordering::Relaxed)
}

/// Where the two ends of a pair run.
#[derive(Clone, Copy, Debug)]
enum Placement {
    /// h1's alpha serves h1's gamma (same network, same hostd).
    OneHost,
    /// h1's alpha serves h2's alpha: every packet crosses the bridge.
    TwoHosts,
}

const BOTH: [Placement; 2] = [Placement::OneHost, Placement::TwoHosts];

impl Placement {
    fn server(self) -> (usize, &'static str) {
        (1, "alpha")
    }

    fn client(self) -> (usize, &'static str) {
        match self {
            Placement::OneHost => (1, "gamma"),
            Placement::TwoHosts => (2, "alpha"),
        }
    }

    /// The server device's address, which clients connect to.
    fn server_ip(self) -> Ipv4Addr {
        let (host, tenant) = self.server();
        Fabric::ip(host, tenant)
    }
}

/// How a test knows the server is ready for its client.
#[derive(Clone, Copy)]
enum Ready {
    /// The server's vdev logged an rdma_cm listen on this port.
    Listen(u16),
    /// A TCP port (the program's own exchange) listens on the server's
    /// address.
    Tcp(u16),
}

/// How the server of a pair ends.
#[derive(Clone, Copy, PartialEq, Eq)]
enum ServerEnd {
    /// By itself once it has served its client: it must exit 0.
    Exits,
    /// Never (cmtime's): it must still be serving when the client is done,
    /// and is killed then.
    ServesUntilKilled,
}

/// What the two ends of a pair printed and how they ended.
struct Pair {
    server: String,
    client: String,
    server_ok: bool,
    client_ok: bool,
    /// How each ended (for a failure's message).
    statuses: String,
}

impl Pair {
    fn both_ok(&self) -> bool {
        self.server_ok && self.client_ok
    }
}

/// The test's daemons and the drop-in libraries.
struct Setup {
    fabric: Fabric,
    shim: IbverbsShim,
    out: TempDir,
}

impl Setup {
    fn start() -> Self {
        need::root("network namespaces");
        Setup {
            fabric: Fabric::start(),
            shim: IbverbsShim::new(),
            out: TempDir::new("rdmacm-out"),
        }
    }

    fn command(&self, (host, tenant): (usize, &str), program: &str) -> Command {
        self.fabric.command(&self.shim, host, tenant, program)
    }

    /// Starts `program args` at `end` with its output in files named
    /// `tag.out` and `tag.err` (a verbose rping fills a pipe and blocks
    /// before a test would read it).
    fn spawn(&self, end: (usize, &str), program: &str, args: &[String], tag: &str) -> Child {
        let file = |ext: &str| {
            std::fs::File::create(self.out.path().join(format!("{tag}.{ext}")))
                .expect("output file")
        };
        self.command(end, program)
            .args(args)
            .stdout(file("out"))
            .stderr(file("err"))
            .spawn()
            .unwrap_or_else(|e| panic!("start {program}: {e}"))
    }

    /// What `tag` printed: stdout's lines, then stderr's.
    fn output(&self, tag: &str) -> String {
        let part = |ext: &str| {
            std::fs::read_to_string(self.out.path().join(format!("{tag}.{ext}")))
                .unwrap_or_default()
        };
        format!("{}{}", part("out"), part("err"))
    }

    /// Times the vdev of `end` logged a listen on `port`.
    fn listens(&self, (host, tenant): (usize, &str), port: u16) -> usize {
        self.fabric.vdev(host, tenant).listens_on(port)
    }

    /// Waits until the server is `ready` (it listened once more than
    /// `before` times), or 20 s.
    fn wait_ready(&self, placement: Placement, ready: Ready, before: usize) {
        let deadline = Instant::now() + Duration::from_secs(20);
        let is_ready = || match ready {
            Ready::Listen(port) => self.listens(placement.server(), port) > before,
            // From /proc: a probe connection would be the server's one
            // client (qperf's, fi_pingpong's).
            Ready::Tcp(port) => {
                (self.fabric.cluster.host(placement.server().0)).run(move || tcp_listening(port))
            }
        };
        while !is_ready() {
            assert!(Instant::now() < deadline, "the server never became ready");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Runs `server` (program, arguments) then, once it is `ready`,
    /// `client`; waits for both (the client up to `timeout`).
    fn pair(
        &self,
        placement: Placement,
        server: (&str, &[String]),
        client: (&str, &[String]),
        ready: Ready,
        server_end: ServerEnd,
        timeout: Duration,
    ) -> Pair {
        let tag = format!("{}-{placement:?}", client.0);
        let before = match ready {
            Ready::Listen(port) => self.listens(placement.server(), port),
            Ready::Tcp(_) => 0,
        };
        let s = self.spawn(
            placement.server(),
            server.0,
            server.1,
            &format!("{tag}-server"),
        );
        self.wait_ready(placement, ready, before);
        let c = self.spawn(
            placement.client(),
            client.0,
            client.1,
            &format!("{tag}-client"),
        );
        let (co, client_killed) = wait_output(c, timeout);
        let serves_forever = server_end == ServerEnd::ServesUntilKilled;
        let (so, server_killed) = wait_output(
            s,
            Duration::from_millis(if serves_forever { 500 } else { 20_000 }),
        );
        Pair {
            server: self.output(&format!("{tag}-server")),
            client: self.output(&format!("{tag}-client")),
            server_ok: if serves_forever {
                server_killed
            } else {
                so.status.success()
            },
            client_ok: co.status.success(),
            statuses: format!(
                "server {:?}{}, client {:?}{}",
                so.status,
                if server_killed {
                    " (killed: still running)"
                } else {
                    ""
                },
                co.status,
                if client_killed {
                    " (killed after the timeout)"
                } else {
                    ""
                },
            ),
        }
    }

    /// [`Setup::pair`] of one program with the same arguments on both
    /// sides, the client's followed by `client_tail`.
    fn same(
        &self,
        placement: Placement,
        program: &str,
        args: &[&str],
        client_tail: &[&str],
        ready: Ready,
    ) -> Pair {
        let server = strings(args);
        let client = [server.clone(), strings(client_tail)].concat();
        self.pair(
            placement,
            (program, &server),
            (program, &client),
            ready,
            ServerEnd::Exits,
            Duration::from_secs(90),
        )
    }

    /// Fails the test unless both ends of `pair` exited 0.
    #[track_caller]
    fn assert_ok(&self, what: &str, placement: Placement, pair: &Pair) {
        assert!(
            pair.both_ok(),
            "{what} ({placement:?}) failed: {}\n--- server:\n{}\n--- client:\n{}\n{}",
            pair.statuses,
            pair.server,
            pair.client,
            self.fabric.logs()
        );
    }
}

#[test]
fn rping_verifies_1000_pings_by_ip_address() {
    need::program("rping", "rdmacm-utils");
    let _one = serial();
    let t = Setup::start();
    for placement in BOTH {
        let port = next_port();
        let (ip, p) = (placement.server_ip().to_string(), port.to_string());
        let common = strings(&["-v", "-V", "-C", "1000", "-p", &p]);
        let server = [strings(&["-s", "-a", "0.0.0.0"]), common.clone()].concat();
        let client = [strings(&["-c", "-a", &ip]), common].concat();
        let r = t.pair(
            placement,
            ("rping", &server),
            ("rping", &client),
            Ready::Listen(port),
            ServerEnd::Exits,
            Duration::from_secs(60),
        );
        t.assert_ok("rping", placement, &r);
        let pings = (r.client.lines())
            .filter(|l| l.starts_with("ping data: rdma-ping-"))
            .count();
        assert_eq!(pings, 1000, "{placement:?}: the client verified every ping");
    }
}

#[test]
fn ucmatose_udaddy_rdma_server_and_cmtime_connect_by_ip_address() {
    need::program("ucmatose", "rdmacm-utils");
    let _one = serial();
    let t = Setup::start();
    for placement in BOTH {
        let ip = placement.server_ip().to_string();
        // ucmatose: 10 RC connections at once, messages both ways.
        let port = next_port();
        let p = port.to_string();
        let r = t.same(
            placement,
            "ucmatose",
            &["-p", &p, "-c", "10"],
            &["-s", &ip],
            Ready::Listen(port),
        );
        t.assert_ok("ucmatose -c 10", placement, &r);
        for text in [&r.server, &r.client] {
            assert!(
                text.contains("data transfers complete") && text.contains("return status 0"),
                "ucmatose ({placement:?}):\n{text}"
            );
        }
        // udaddy: UD through SIDR on rdma_cm's UDP port space (its port is
        // fixed, 7174); the server answers through an AH it builds from
        // each datagram's GRH.
        let r = t.same(placement, "udaddy", &[], &["-s", &ip], Ready::Listen(7174));
        t.assert_ok("udaddy", placement, &r);
        for text in [&r.server, &r.client] {
            assert!(
                text.contains("data transfers complete") && text.contains("return status 0"),
                "udaddy ({placement:?}):\n{text}"
            );
        }
        // rdma_server/rdma_client: the synchronous calls (rdma_getaddrinfo,
        // rdma_create_ep, rdma_get_request) and rdma_verbs.h's helpers.
        let port = next_port();
        let p = port.to_string();
        let r = t.pair(
            placement,
            ("rdma_server", &strings(&["-p", &p])),
            ("rdma_client", &strings(&["-s", &ip, "-p", &p])),
            Ready::Listen(port),
            ServerEnd::Exits,
            Duration::from_secs(30),
        );
        t.assert_ok("rdma_server/rdma_client", placement, &r);
        assert!(r.server.contains("rdma_server: end 0"), "{}", r.server);
        assert!(r.client.contains("rdma_client: end 0"), "{}", r.client);
        // cmtime: 100 connections set up and torn down concurrently,
        // each step timed.
        let port = next_port();
        let p = port.to_string();
        let r = t.pair(
            placement,
            ("cmtime", &strings(&["-p", &p])),
            ("cmtime", &strings(&["-p", &p, "-s", &ip])),
            Ready::Listen(port),
            ServerEnd::ServesUntilKilled,
            Duration::from_secs(90),
        );
        t.assert_ok("cmtime", placement, &r);
        // cmtime exits 0 and times its steps even when connections failed
        // (it skips them): none may have.
        for line in r.client.lines() {
            assert!(
                !line.contains("failure") && !line.contains("error"),
                "cmtime ({placement:?}) failed a connection: {line}\n{}",
                r.client
            );
        }
        for step in [
            "resolve addr",
            "resolve route",
            "create qp",
            "connect",
            "disconnect",
        ] {
            assert!(
                r.client.lines().any(|l| l.starts_with(step)),
                "cmtime ({placement:?}) timed {step}:\n{}",
                r.client
            );
        }
    }
}

#[test]
fn perftest_connects_through_rdma_cm() {
    need::program("ib_write_bw", "perftest");
    let _one = serial();
    let t = Setup::start();
    for placement in BOTH {
        let ip = placement.server_ip().to_string();
        for (program, args) in [
            // -T: rdma_set_option(RDMA_OPTION_ID_TOS).
            (
                "ib_write_bw",
                &["-s", "65536", "-n", "1000", "-T", "32"][..],
            ),
            ("ib_read_lat", &["-n", "1000"][..]),
            ("ib_send_bw", &["-s", "65536", "-n", "1000"][..]),
            ("ib_send_bw", &["-c", "UD", "-n", "1000"][..]),
        ] {
            let port = next_port();
            let p = port.to_string();
            let mut common = vec!["-R", "-p", &p];
            common.extend_from_slice(args);
            let r = t.same(placement, program, &common, &[&ip], Ready::Listen(port));
            let what = format!("{program} -R {}", args.join(" "));
            t.assert_ok(&what, placement, &r);
            // The result row: the message size first, then figures.
            let row = (r.client.lines())
                .map(str::split_whitespace)
                .filter_map(|mut w| Some((w.next()?.parse::<u64>().ok()?, w.count())))
                .next();
            assert!(
                matches!(row, Some((_, n)) if n >= 3),
                "{what} ({placement:?}) reported no result:\n{}",
                r.client
            );
        }
    }
}

// qperf's RC tests (`vrdma_tests::qperf::rc_tests`): its UC and UD tests
// cannot run on any RoCE port: qperf uses rdma_cm for RC only
// (`rd_params` sets `use_cm` to 0 for every other transport) and
// addresses the peer by LID without a GRH, which a RoCE device refuses
// (`EINVAL`: RoCE needs a GRH), as Linux's ib core does for rxe and every
// RoCE NIC. tests/tests/qperf.rs runs all 21 of them on InfiniBand ports.

#[test]
fn qperf_runs_every_rc_test_on_roce_ports_through_rdma_cm() {
    need::program("qperf", "qperf");
    let _one = serial();
    let t = Setup::start();
    for placement in BOTH {
        let ip = placement.server_ip().to_string();
        let port = next_port();
        let p = port.to_string();
        let mut client = strings(&[&ip, "--listen_port", &p, "-cm1", "--time", "1"]);
        client.extend(qperf::rc_tests().map(String::from));
        client.push("quit".into());
        let r = t.pair(
            placement,
            ("qperf", &strings(&["--listen_port", &p])),
            ("qperf", &client),
            Ready::Tcp(port),
            ServerEnd::Exits,
            Duration::from_secs(120),
        );
        t.assert_ok("qperf -cm1", placement, &r);
        assert!(
            r.server.trim().is_empty(),
            "the server reported:\n{}",
            r.server
        );
        qperf::assert_every_figure(&r.client, qperf::rc_tests());
    }
}

#[test]
fn libfabric_verbs_provider_runs_connected_endpoints() {
    need::program("fi_pingpong", "libfabric-bin");
    let _one = serial();
    let t = Setup::start();
    // fi_info finds the device's address on the host's interface and
    // offers connected (FI_EP_MSG) endpoints on it.
    let out = t
        .command((1, "alpha"), "fi_info")
        .args(["-p", "verbs", "-t", "FI_EP_MSG"])
        .output()
        .expect("run fi_info");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && text.contains("domain: vrdma0") && text.contains("FI_EP_MSG"),
        "fi_info -p verbs:\n{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for placement in BOTH {
        let ip = placement.server_ip().to_string();
        let port = next_port();
        let p = port.to_string();
        // RDM over connected verbs endpoints (ofi_rxm); fi_pingpong's own
        // exchange over TCP on `port`, its data (checked, -v) by RDMA.
        // (-B: the server's port, -P: the one the client connects to).
        let common = ["-p", "verbs;ofi_rxm", "-e", "rdm", "-I", "1000", "-v"];
        let server = [strings(&common), strings(&["-B", &p])].concat();
        let client = [strings(&common), strings(&["-P", &p, &ip])].concat();
        let r = t.pair(
            placement,
            ("fi_pingpong", &server),
            ("fi_pingpong", &client),
            Ready::Tcp(port),
            ServerEnd::Exits,
            Duration::from_secs(60),
        );
        t.assert_ok("fi_pingpong verbs;ofi_rxm", placement, &r);
        assert!(
            r.client.contains("1k") || r.client.lines().any(|l| l.contains("iters")),
            "fi_pingpong ({placement:?}) reported no result:\n{}",
            r.client
        );
    }
}

/// `program args` at `end`, run to its end (killed after `timeout`);
/// returns its output, whether it exited 0, and how long it ran.
fn run_alone(
    t: &Setup,
    end: (usize, &str),
    program: &str,
    args: &[&str],
    timeout: Duration,
) -> (String, bool, Duration) {
    let tag = format!("{program}-{}-{}-alone", end.0, end.1);
    let start = Instant::now();
    let child = t.spawn(end, program, &strings(args), &tag);
    let (out, killed) = wait_output(child, timeout);
    let took = start.elapsed();
    assert!(!killed, "{program} {args:?} did not end in {timeout:?}");
    (t.output(&tag), out.status.success(), took)
}

/// What a tenant's device holds, as hostd counts it (QPs, MRs and their
/// bytes, devices, queues) and its CM traffic.
fn held(t: &Setup, (host, tenant): (usize, &str)) -> (serde_json::Value, serde_json::Value) {
    let stats = t.fabric.hostd(host).tenant_stats(tenant);
    (stats["usage"].clone(), stats["gsi"].clone())
}

#[test]
fn failed_connections_fail_as_rdma_cm_reports_them() {
    need::program("rping", "rdmacm-utils");
    let _one = serial();
    let t = Setup::start();
    for placement in BOTH {
        // Nobody listens on the port: the server's CM rejects the REQ.
        let ip = placement.server_ip().to_string();
        let p = next_port().to_string();
        let (text, ok, _) = run_alone(
            &t,
            placement.client(),
            "rping",
            &["-c", "-a", &ip, "-p", &p, "-C", "1"],
            Duration::from_secs(30),
        );
        assert!(
            !ok && text.contains("RDMA_CM_EVENT_REJECTED"),
            "{placement:?}: a connect to a port nobody listens on:\n{text}"
        );
    }
    // Another tenant's address (beta, network red, on h3), where beta
    // listens: alpha (blue) cannot even resolve it, and beta sees nothing.
    let beta = (3, "beta");
    let port = next_port();
    let p = port.to_string();
    let before = t.listens(beta, port);
    let server = t.spawn(
        beta,
        "rping",
        &strings(&["-s", "-a", "0.0.0.0", "-p", &p]),
        "beta",
    );
    while t.listens(beta, port) == before {
        std::thread::sleep(Duration::from_millis(20));
    }
    let beta_before = held(&t, beta);
    let beta_ip = Fabric::ip(3, "beta").to_string();
    for client in [(1, "alpha"), (2, "gamma")] {
        let (text, ok, _) = run_alone(
            &t,
            client,
            "rping",
            &["-c", "-a", &beta_ip, "-p", &p, "-C", "1"],
            Duration::from_secs(30),
        );
        assert!(
            !ok && text.contains("RDMA_CM_EVENT_ADDR_ERROR"),
            "{client:?} towards another network's tenant:\n{text}"
        );
    }
    assert_eq!(held(&t, beta), beta_before, "beta's device saw nothing");
    let (out, killed) = wait_output(server, Duration::from_millis(200));
    assert!(killed, "beta's server still waits: {:?}", out.status);
    assert!(t.output("beta").is_empty(), "{}", t.output("beta"));

    // The server killed in the middle of a connection: its device
    // disconnects (DREQ), and the client sees DISCONNECTED and ends
    // (rping's client then exits 0: it counts a disconnect as an end).
    for placement in BOTH {
        let port = next_port();
        let (ip, p) = (placement.server_ip().to_string(), port.to_string());
        let before = t.listens(placement.server(), port);
        let ops_before = t
            .fabric
            .hostd(placement.server().0)
            .ops(placement.server().1);
        let common = ["-v", "-C", "1000000", "-p", &p];
        let server = t.spawn(
            placement.server(),
            "rping",
            &[strings(&["-s", "-a", "0.0.0.0"]), strings(&common)].concat(),
            "killed-server",
        );
        t.wait_ready(placement, Ready::Listen(port), before);
        let tag = format!("{placement:?}-survivor");
        let client = t.spawn(
            placement.client(),
            "rping",
            &[strings(&["-c", "-a", &ip]), strings(&common)].concat(),
            &tag,
        );
        let (server_host, server_tenant) = placement.server();
        let pinged = || t.fabric.hostd(server_host).ops(server_tenant);
        let deadline = Instant::now() + Duration::from_secs(20);
        while pinged() < ops_before + 1000 {
            assert!(Instant::now() < deadline, "{placement:?}: rping never ran");
            std::thread::sleep(Duration::from_millis(50));
        }
        let mut server = server;
        server.kill().expect("kill the server");
        let _ = server.wait();
        let killed_at = Instant::now();
        let (out, hung) = wait_output(client, Duration::from_secs(30));
        let took = killed_at.elapsed();
        let text = t.output(&tag);
        assert!(
            !hung && text.contains("client DISCONNECT EVENT"),
            "{placement:?}: the client after its server was killed ({:?}, {took:?}):\n{}\n{}",
            out.status,
            tail(&text, 20),
            t.fabric.logs()
        );
        assert!(
            took < Duration::from_secs(10),
            "{placement:?}: DISCONNECTED after {took:?}"
        );
        eprintln!("{placement:?}: DISCONNECTED {took:?} after the server was killed");
    }
}

/// 1,000 connections made, used (one checked SEND) and torn down one
/// after the other (tests/c/cm_cycles.c) leave both devices holding what
/// they held after the first. The client sets RDMA_OPTION_ID_TOS 32 and
/// RDMA_OPTION_ID_ACK_TIMEOUT 14 on every ID: both sides' QPs get the
/// traffic class (the REQ carries it), the client's QP the timeout.
#[test]
fn a_thousand_connect_disconnect_cycles_leave_the_counters_where_they_started() {
    use std::io::Write;
    use std::process::Stdio;
    let _one = serial();
    let t = Setup::start();
    let exe = build_rdmacm_program(&t.out, "cm_cycles", include_str!("../c/cm_cycles.c"));
    let exe = exe.to_str().expect("UTF-8 path");
    for placement in BOTH {
        let port = next_port();
        let (ip, p) = (placement.server_ip().to_string(), port.to_string());
        let before = t.listens(placement.server(), port);
        let server = t.spawn(
            placement.server(),
            exe,
            &strings(&["-s", "-p", &p, "-n", "1001", "-q"]),
            "cycles-server",
        );
        t.wait_ready(placement, Ready::Listen(port), before);
        let tag = format!("cycles-{placement:?}");
        let file = |ext: &str| {
            std::fs::File::create(t.out.path().join(format!("{tag}.{ext}"))).expect("output file")
        };
        let mut client = t
            .command(placement.client(), exe)
            .args(["-c", &ip, "-p", &p, "-n", "1000", "-w"])
            .args(["-t", "32", "-a", "14", "-q"])
            .stdin(Stdio::piped())
            .stdout(file("out"))
            .stderr(file("err"))
            .spawn()
            .expect("start cm_cycles");
        let wait_for = |word: &str| {
            let deadline = Instant::now() + Duration::from_secs(120);
            while !t.output(&tag).lines().any(|l| l == word) {
                assert!(
                    Instant::now() < deadline,
                    "{placement:?}: no {word:?} from cm_cycles:\n{}\n{}",
                    t.output(&tag),
                    t.fabric.logs()
                );
                std::thread::sleep(Duration::from_millis(50));
            }
        };
        let ends = [placement.server(), placement.client()];
        wait_for("warm");
        let warm: Vec<_> = ends.iter().map(|&e| held(&t, e).0).collect();
        let mut stdin = client.stdin.take().expect("stdin");
        stdin.write_all(b"go\n").expect("start the cycles");
        wait_for("done");
        let done: Vec<_> = ends.iter().map(|&e| held(&t, e).0).collect();
        drop(stdin);
        let (out, _) = wait_output(client, Duration::from_secs(20));
        let (so, _) = wait_output(server, Duration::from_secs(20));
        let (text, server_text) = (t.output(&tag), t.output("cycles-server"));
        assert!(
            out.status.success() && so.status.success(),
            "{placement:?}:\n{text}\n{server_text}"
        );
        assert!(
            server_text.contains("1001 connections served"),
            "{server_text}"
        );
        assert!(
            text.lines().any(|l| l == "client: tclass 32 timeout 14"),
            "{placement:?}: the client's QP:\n{text}"
        );
        assert!(
            server_text
                .lines()
                .any(|l| l.starts_with("server: tclass 32 ")),
            "{placement:?}: the server's QP:\n{server_text}"
        );
        assert_eq!(
            done, warm,
            "{placement:?}: what the devices hold after 1,000 cycles"
        );
        eprintln!(
            "{placement:?}: {}",
            text.lines()
                .find(|l| l.starts_with("client:"))
                .unwrap_or("")
        );
    }
}

/// A server listening on the wildcard address listens on every device of
/// its process, as on Linux: ucmatose serving h1's alpha and gamma devices
/// at once accepts a connection to each device's address (from h2's
/// alpha and h2's gamma), each placed on the device it came to.
#[test]
fn a_wildcard_listener_serves_every_device_of_its_process() {
    need::program("ucmatose", "rdmacm-utils");
    let _one = serial();
    let t = Setup::start();
    let port = next_port();
    let p = port.to_string();
    let (alpha, gamma) = ((1, "alpha"), (1, "gamma"));
    let before = [t.listens(alpha, port), t.listens(gamma, port)];
    let both = format!(
        "{},{}",
        t.fabric.device(1, "alpha").display(),
        t.fabric.device(1, "gamma").display()
    );
    let out = |tag: &str, ext: &str| {
        std::fs::File::create(t.out.path().join(format!("{tag}.{ext}"))).expect("output file")
    };
    let server = t
        .command(alpha, "ucmatose")
        .env("VRDMA_DEVICES", &both)
        .args(["-p", &p, "-c", "2"])
        .stdout(out("both", "out"))
        .stderr(out("both", "err"))
        .spawn()
        .expect("start ucmatose");
    let deadline = Instant::now() + Duration::from_secs(20);
    while t.listens(alpha, port) == before[0] || t.listens(gamma, port) == before[1] {
        assert!(
            Instant::now() < deadline,
            "the server never listened on both devices"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let clients: Vec<_> = [
        (2, "alpha", Fabric::ip(1, "alpha")),
        (2, "gamma", Fabric::ip(1, "gamma")),
    ]
    .into_iter()
    .map(|(host, tenant, to)| {
        let tag = format!("to-{to}");
        let child = t.spawn(
            (host, tenant),
            "ucmatose",
            &strings(&["-s", &to.to_string(), "-p", &p, "-c", "1"]),
            &tag,
        );
        (tag, child)
    })
    .collect();
    for (tag, child) in clients {
        let (o, killed) = wait_output(child, Duration::from_secs(60));
        let text = t.output(&tag);
        assert!(
            o.status.success() && !killed && text.contains("return status 0"),
            "client {tag}:\n{text}\n--- server:\n{}\n{}",
            t.output("both"),
            t.fabric.logs()
        );
    }
    let (o, killed) = wait_output(server, Duration::from_secs(20));
    let text = t.output("both");
    assert!(
        o.status.success() && !killed && text.contains("data transfers complete"),
        "the server of both devices:\n{text}"
    );
}
