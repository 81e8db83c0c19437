//! RDMA across hosts: three hostds in three network namespaces joined by a
//! kernel bridge (real veths, real UDP/IP), each serving tenants whose
//! GIDs are addresses of its namespace; Debian's unmodified
//! `ibv_rc_pingpong` and perftest between tenants on different hosts. The
//! programs' own out-of-band exchange runs over the test's loopback; every
//! RDMA byte crosses the bridge as RoCEv2.
//!
//! The cluster: h1 serves alpha (10.200.1.1) and gamma (10.200.1.3), h2
//! alpha (10.200.2.1) and gamma (10.200.2.3), h3 alpha (10.200.3.1) and
//! beta (10.200.3.2). alpha and gamma share network "blue"; beta is alone
//! in "red".

use std::path::Path;
use std::process::{Child, Command, Output};
use std::time::{Duration, Instant};

use vrdma_guest_driver::verbs::QpCapabilities;
use vrdma_tests::daemon::{tcp_listening, IbverbsShim, TempDir};
use vrdma_tests::hosts::{packets_to, text, wait, Backend, Directory, Fabric};
use vrdma_tests::netns::Cluster;
use vrdma_tests::tenant::Tenant;
use vrdma_tests::two_tenants::{next_port, serial, spawn_pair_on};
use vrdma_tools::relay::Faults;
use vrdma_tools::verbs::{bring_up, Connection};

/// Every test of this file runs once over each of hostd's packet paths:
/// `<test>::af_xdp` and `<test>::udp`.
macro_rules! over_both_backends {
    ($($name:ident),* $(,)?) => {$(
        mod $name {
            use vrdma_tests::hosts::Backend;

            #[test]
            fn af_xdp() {
                super::$name(Backend::AfXdp)
            }

            #[test]
            fn udp() {
                super::$name(Backend::Udp)
            }
        }
    )*};
}

over_both_backends!(
    unmodified_programs_run_between_tenants_on_different_hosts,
    ud_and_uc_run_between_tenants_on_different_hosts,
    ucx_and_open_mpi_run_between_hosts,
    a_tenant_cannot_connect_to_another_network_on_another_host,
    a_dead_host_fails_its_peers_with_retry_exceeded_while_others_run_on,
    a_hostile_network_loses_no_byte_and_hangs_nothing,
    with_the_directory_in_etcd_hosts_find_each_other_and_a_dead_host_disappears,
    every_rc_operation_is_byte_exact_between_hosts,
);

/// `program args` as server on `server`, then as client on `client`
/// (both `-p port`), over loopback; returns (server, client) outputs.
fn pair(
    shim: &IbverbsShim,
    server: &Path,
    client: &Path,
    program: &str,
    args: &[&str],
    timeout: Duration,
) -> (Output, Output) {
    let (s, c) = spawn_pair_on(shim, (server, client), program, args, |_| {});
    let c = wait(c, timeout);
    let s = wait(s, Duration::from_secs(5));
    (s, c)
}

fn spawn(
    shim: &IbverbsShim,
    device: &Path,
    program: &str,
    port: &str,
    args: &[&str],
    server: Option<&str>,
) -> Child {
    let mut cmd: Command = shim.command(program, device);
    cmd.args(["-p", port]).args(args);
    if let Some(s) = server {
        cmd.arg(s);
    }
    cmd.spawn()
        .unwrap_or_else(|e| panic!("spawn {program}: {e}"))
}

/// Runs each of `programs` (name, arguments) as a pair between alpha on
/// h1 (server) and alpha on h2 (client); each must exit 0 on both sides.
/// Returns the outputs of the first.
fn run_between_h1_and_h2(
    fabric: &Fabric,
    shim: &IbverbsShim,
    programs: &[(&str, &[&str])],
    timeout: Duration,
) -> (Output, Output) {
    let (h1, h2) = (fabric.device(1, "alpha"), fabric.device(2, "alpha"));
    let mut first = None;
    for &(program, args) in programs {
        let r = pair(shim, h1, h2, program, args, timeout);
        assert_ok(fabric, program, &r);
        first.get_or_insert(r);
    }
    first.expect("at least one program")
}

/// alpha (blue, on h1) serving beta (red, on h3): the server connects
/// first, towards beta's GID, and is refused at RTR (blue may not reach
/// red); the client then loses its peer. Neither exits 0.
fn assert_another_network_is_refused(fabric: &Fabric, shim: &IbverbsShim) {
    let (s, c) = pair(
        shim,
        fabric.device(1, "alpha"),
        fabric.device(3, "beta"),
        "ibv_rc_pingpong",
        &["-g", "0", "-n", "10"],
        Duration::from_secs(20),
    );
    assert!(
        !s.status.success() && !c.status.success(),
        "beta and alpha connected:\n{}\n{}",
        text(&s),
        text(&c)
    );
    assert!(
        text(&s).contains("Failed to modify QP to RTR"),
        "refused at RTR:\n{}",
        text(&s)
    );
}

fn assert_ok(fabric: &Fabric, what: &str, (s, c): &(Output, Output)) {
    assert!(
        s.status.success() && c.status.success(),
        "{what}: server {:?}, client {:?}\n--- server:\n{}\n--- client:\n{}\n{}",
        s.status.code(),
        c.status.code(),
        text(s),
        text(c),
        fabric.logs()
    );
}

/// A host on AF_XDP and a host on the kernel's UDP path (as during a
/// rolling upgrade, or after a handover) carry every operation between
/// them, both ways: the UDP host's GSO messages cross the bridge whole,
/// the AF_XDP host's XDP program leaves them (and every datagram with a
/// UDP checksum) to its kernel, and its packet socket cuts them.
#[test]
fn a_host_on_af_xdp_and_a_host_on_udp_carry_everything_between_them() {
    let _one = serial();
    vrdma_tests::need::root("network namespaces");
    let shim = IbverbsShim::new();
    let fabric = Fabric::start_mixed([Backend::Udp, Backend::AfXdp, Backend::AfXdp]);
    let (h1, h2) = (fabric.device(1, "alpha"), fabric.device(2, "alpha"));
    let programs: [(&str, &[&str]); 4] = [
        (
            "ibv_rc_pingpong",
            &["-g", "0", "-n", "300", "-s", "4096", "-c"],
        ),
        ("ib_write_bw", &["-x", "0", "-s", "65536", "-n", "300"]),
        ("ib_read_bw", &["-x", "0", "-s", "65536", "-n", "200"]),
        ("ib_send_bw", &["-x", "0", "-s", "8192", "-n", "300"]),
    ];
    for (server, client) in [(h1, h2), (h2, h1)] {
        for (program, args) in programs {
            let r = pair(
                &shim,
                server,
                client,
                program,
                args,
                Duration::from_secs(60),
            );
            assert_ok(&fabric, program, &r);
        }
    }
    let io = |h: usize| {
        let stats = fabric.hostd(h).ctl(&["stats", "--json"]).1;
        let stats: serde_json::Value = serde_json::from_str(&stats).expect("stats JSON");
        stats["packet_io"].clone()
    };
    let (udp, xdp) = (io(1), io(2));
    let n = |io: &serde_json::Value, key: &str| io[key].as_u64().unwrap_or(0);
    // h1's GSO messages reached h2's kernel and packet socket, cut there;
    // none went to h2's XSK (it would have taken one for a datagram).
    assert!(n(&udp, "gso_messages") > 100, "h1: {udp}");
    assert!(n(&xdp, "received_gso_messages") > 100, "h2: {xdp}");
    assert_eq!(n(&xdp, "xdp_received_packets"), 0, "h2: {xdp}");
    // h2 sent single packets through its XSK, bursts as GSO messages
    // through its kernel; h1 took both.
    assert!(n(&xdp, "xdp_sent_packets") > 1000, "h2: {xdp}");
    assert!(n(&xdp, "gso_messages") > 100, "h2: {xdp}");
    assert!(n(&udp, "received_packets") > 10_000, "h1: {udp}");
}

fn unmodified_programs_run_between_tenants_on_different_hosts(backend: Backend) {
    let _one = serial();
    vrdma_tests::need::root("network namespaces");
    let shim = IbverbsShim::new();
    let fabric = Fabric::start_over(backend);
    let peers = |host: usize| {
        let (code, json, err) = fabric.hostd(host).ctl(&["peers", "--json"]);
        assert_eq!(code, 0, "vrdmactl peers: {err}");
        let peers: serde_json::Value = serde_json::from_str(&json).expect("peers JSON");
        peers.as_array().expect("list").clone()
    };
    let row = |peers: &[serde_json::Value], host: &str| {
        (peers.iter().find(|p| p["host"] == host))
            .unwrap_or_else(|| panic!("no row for {host}: {peers:?}"))
            .clone()
    };
    // Before any traffic, every other host of the cluster has its row,
    // and there is no row of unknown sources.
    let before = peers(1);
    let hosts: Vec<&str> = before.iter().filter_map(|p| p["host"].as_str()).collect();
    assert_eq!(hosts, ["h2", "h3"], "{before:?}");
    // rc_pingpong validates every message's bytes (-c).
    let r = run_between_h1_and_h2(
        &fabric,
        &shim,
        &[
            (
                "ibv_rc_pingpong",
                &["-g", "0", "-n", "500", "-s", "4096", "-c"],
            ),
            ("ib_write_bw", &["-x", "0", "-s", "65536", "-n", "500"]),
            ("ib_read_bw", &["-x", "0", "-s", "65536", "-n", "300"]),
            ("ib_send_bw", &["-x", "0", "-s", "8192", "-n", "500"]),
            ("ib_write_lat", &["-x", "0", "-s", "64", "-n", "500"]),
            ("ib_atomic_bw", &["-x", "0", "-n", "500"]),
        ],
        Duration::from_secs(60),
    );
    assert!(
        text(&r.1).contains("500 iters"),
        "the client ran every exchange:\n{}",
        text(&r.1)
    );
    // The bytes crossed the bridge: hostd h1 counted packets both ways
    // with peer h2.
    let h2 = row(&peers(1), "h2");
    let h1 = row(&peers(2), "h1");
    assert!(h2["tx_packets"].as_u64().unwrap_or(0) > 10_000, "{h2}");
    assert!(h2["rx_packets"].as_u64().unwrap_or(0) > 10_000, "{h2}");
    // Bytes are the RoCE packets (the UDP payload) both ways: what h2 took
    // from h1 is what h1 sent h2, less at most the largest packet for each
    // packet lost on the way (a socket buffer that overflowed), and the
    // other way round.
    let n = |p: &serde_json::Value, key: &str| p[key].as_u64().unwrap_or(0);
    for (tx, rx) in [(&h2, &h1), (&h1, &h2)] {
        let lost = n(tx, "tx_packets").saturating_sub(n(rx, "rx_packets"));
        let (sent, taken) = (n(tx, "tx_bytes"), n(rx, "rx_bytes"));
        assert!(
            taken <= sent && sent - taken <= lost * 4200,
            "sent {sent} bytes, taken {taken}, {lost} packets lost:\n{h2}\n{h1}"
        );
    }
    let metrics = fabric.hostd(1).ctl(&["metrics"]).1;
    assert!(
        metrics.contains("vrdma_peer_tx_packets_total{host=\"h2\"}"),
        "{metrics}"
    );
    assert_packet_path(&fabric, backend, 1_000);
}

/// Each of the first two hosts' hostd carried the traffic through
/// `backend`: over UDP, the 64 KiB WRITEs and READ responses went as UDP
/// GSO messages and crossed the bridge whole (the receivers cut them);
/// over AF_XDP, at least `packets` each way went through its XSK (the
/// ping-pongs' single packets), the bursts through the kernel as GSO
/// messages, and the XSKs dropped nothing.
fn assert_packet_path(fabric: &Fabric, backend: Backend, packets: u64) {
    for h in [1, 2] {
        let stats = fabric.hostd(h).ctl(&["stats", "--json"]).1;
        let stats: serde_json::Value = serde_json::from_str(&stats).expect("stats JSON");
        let io = &stats["packet_io"];
        let n = |key: &str| io[key].as_u64().unwrap_or(0);
        match backend {
            Backend::Udp => {
                for counter in ["gso_messages", "received_gso_messages"] {
                    assert!(n(counter) > 100, "h{h}: {io}");
                }
                assert_eq!(
                    n("xdp_sent_packets") + n("xdp_received_packets"),
                    0,
                    "h{h}: {io}"
                );
            }
            Backend::AfXdp => {
                for counter in ["xdp_sent_packets", "xdp_received_packets"] {
                    assert!(n(counter) >= packets, "h{h}: {io}");
                }
                // Bursts (the bandwidth tests') went as GSO messages
                // through the kernel, the copy-mode XSK's bulk path.
                assert!(n("gso_messages") > 100, "h{h}: {io}");
                for counter in [
                    "xdp_received_invalid",
                    "xdp_rx_dropped",
                    "xdp_rx_ring_full",
                    "xdp_fill_ring_empty",
                ] {
                    assert_eq!(n(counter), 0, "h{h}: {counter}: {io}");
                }
            }
        }
        assert_eq!(n("receive_truncated"), 0, "h{h}: {io}");
        assert!(
            fabric.hostd(h).log().contains(match backend {
                Backend::AfXdp => "RoCEv2 packets through AF_XDP",
                Backend::Udp => "RoCEv2 packets through the kernel's UDP path",
            }),
            "h{h}'s log does not say {backend:?}"
        );
    }
}

/// UD and UC between hosts: Debian's pingpongs with their data checked
/// (`-c`), 10,000 exchanges each, and perftest's UD SEND and UC WRITE
/// bandwidth; then a UD address handle towards a network the tenant may
/// not reach is refused, and the datagrams' way is counted per peer.
fn ud_and_uc_run_between_tenants_on_different_hosts(backend: Backend) {
    let _one = serial();
    vrdma_tests::need::root("network namespaces");
    let shim = IbverbsShim::new();
    let fabric = Fabric::start_over(backend);
    let before = packets_to(fabric.hostd(1), "h2");
    let r = run_between_h1_and_h2(
        &fabric,
        &shim,
        &[
            (
                "ibv_ud_pingpong",
                &["-g", "0", "-n", "10000", "-s", "1024", "-c"],
            ),
            (
                "ibv_uc_pingpong",
                &["-g", "0", "-n", "10000", "-s", "4096", "-c"],
            ),
            (
                "ib_send_bw",
                &["-c", "UD", "-x", "0", "-s", "1024", "-n", "2000"],
            ),
            (
                "ib_write_bw",
                &["-c", "UC", "-x", "0", "-s", "65536", "-n", "500"],
            ),
        ],
        Duration::from_secs(120),
    );
    assert!(
        text(&r.1).contains("10000 iters"),
        "the UD client ran every exchange:\n{}",
        text(&r.1)
    );
    // 10,000 datagrams each way at least crossed the bridge, as UDP.
    assert!(packets_to(fabric.hostd(1), "h2") >= before + 20_000);
    // alpha (blue) may not address beta (red): its address handle is
    // refused, and the program says so.
    let (s, c) = pair(
        &shim,
        fabric.device(1, "alpha"),
        fabric.device(3, "beta"),
        "ibv_ud_pingpong",
        &["-g", "0", "-n", "10"],
        Duration::from_secs(20),
    );
    assert!(
        !s.status.success() && !c.status.success(),
        "alpha and beta exchanged datagrams:\n{}\n{}",
        text(&s),
        text(&c)
    );
    assert!(
        text(&s).contains("Failed to create AH") || text(&c).contains("Failed to create AH"),
        "refused at the AH:\n{}\n{}",
        text(&s),
        text(&c)
    );
}

/// UCX with its default choice of transports and devices (no `UCX_TLS`,
/// no `UCX_NET_DEVICES`) between alpha on h1 and alpha on h2, each
/// process in a container of its own on its host (`on_host`: the host's
/// network namespace, IPC, PID and UTS namespaces of its own), so that UCX
/// finds no shared memory or CMA towards another host's processes, as
/// between two machines: ucx_perftest's tag latency and bandwidth, puts
/// and gets, the client naming the server by its address (h1's alpha
/// GID, over h2's eth0); then Open MPI over UCX, 4 ranks on 2 hosts (2 on
/// each host's alpha device, each rank in a container of its own), the
/// checked ping-pong and allreduce. UCX's log shows vrdma's transports
/// only (a rank's endpoint to itself aside), and the bytes crossed
/// between the hosts.
fn ucx_and_open_mpi_run_between_hosts(backend: Backend) {
    use vrdma_tests::ucx::{assert_chose_among, install_device_node};
    let _one = serial();
    vrdma_tests::need::root("network namespaces");
    vrdma_tests::need::program("ucx_perftest", "ucx-utils");
    vrdma_tests::need::program("mpirun", "openmpi-bin");
    install_device_node(0);
    let shim = IbverbsShim::new();
    let fabric = Fabric::start_over(backend);
    let vrdma = ["rc_verbs", "ud_verbs"];
    for test in ["tag_lat", "tag_bw", "ucp_put_bw", "ucp_get"] {
        let before = packets_to(fabric.hostd(2), "h1");
        let port: u16 = next_port();
        let p = port.to_string();
        let args = ["-t", test, "-s", "4096", "-n", "1000", "-p", &p];
        // Each side a process of its host, in a container of its own
        // there (IPC, PID and UTS namespaces): UCX, left to its default
        // choice among every transport and device, sees no shared memory
        // it could use towards the other host, as between two machines.
        let mut server = on_host(&fabric, &shim, 1, "ucx_perftest");
        server.env("UCX_LOG_LEVEL", "info");
        let server = server.args(args).spawn().expect("spawn ucx_perftest");
        let deadline = Instant::now() + Duration::from_secs(20);
        while !fabric.cluster.host(1).run(|| tcp_listening(port)) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        let mut client = on_host(&fabric, &shim, 2, "ucx_perftest");
        client.env("UCX_LOG_LEVEL", "info");
        let client = client
            .args(args)
            .arg(Fabric::ip(1, "alpha").to_string())
            .spawn()
            .expect("spawn ucx_perftest");
        let c = wait(client, Duration::from_secs(60));
        let s = wait(server, Duration::from_secs(10));
        assert_ok(
            &fabric,
            &format!("ucx_perftest -t {test}"),
            &(s.clone(), c.clone()),
        );
        let row = text(&c);
        let row = (row.lines())
            .find(|l| l.starts_with("Final:"))
            .unwrap_or_else(|| panic!("{test}: no result:\n{row}"))
            .to_owned();
        assert_chose_among(&text(&c), 1, &vrdma);
        assert_chose_among(&text(&s), 1, &vrdma);
        let crossed = packets_to(fabric.hostd(2), "h1") - before;
        assert!(crossed >= 1000, "{test}: {crossed} packets from h2 to h1");
        eprintln!("ucx_perftest -t {test} between hosts: {row}");
    }
    // Open MPI: ranks 0 and 1 on h1's alpha device, 2 and 3 on h2's.
    let dir = TempDir::new("roce-mpi");
    let exe = vrdma_tests::c_program::build_mpi_program(
        &dir,
        "mpi_pingpong",
        include_str!("../c/mpi_pingpong.c"),
    );
    let exe = exe.to_str().expect("UTF-8 path");
    let before = packets_to(fabric.hostd(1), "h2");
    // No UCX_TLS: UCX's own choice. Each rank in a container of its own
    // on its host (as `on_host`; hostname h<host>-<rank>), so that no two
    // ranks can share memory.
    let mut mpirun = shim.command("mpirun", fabric.device(1, "alpha"));
    mpirun
        .env("UCX_LOG_LEVEL", "info")
        .args(["--allow-run-as-root", "--oversubscribe"])
        .args(["-x", "LD_LIBRARY_PATH", "-x", "UCX_LOG_LEVEL"])
        .args(["--mca", "pml", "ucx", "--mca", "osc", "ucx"]);
    for host in [1, 2] {
        let device = format!("VRDMA_DEVICES={}", fabric.device(host, "alpha").display());
        if host == 2 {
            mpirun.arg(":");
        }
        mpirun
            .args(["-np", "2", "-x", &device, "unshare"])
            .args(container(&format!("h{host}"), "-$OMPI_COMM_WORLD_RANK"))
            .arg(exe);
    }
    let out = wait(
        mpirun.spawn().expect("spawn mpirun"),
        Duration::from_secs(180),
    );
    let all = text(&out);
    assert!(
        out.status.success(),
        "mpirun: {:?}\n{all}\n{}",
        out.status,
        fabric.logs()
    );
    for rank in 0..4 {
        let ok = format!("rank {rank} of 4 partner {} OK", (rank + 2) % 4);
        assert!(all.contains(&ok), "no {ok:?}:\n{all}");
    }
    // (A rank's endpoint to itself, UCX's `self` with `cma`, is left out.)
    assert_chose_among(&all, 4, &vrdma);
    let crossed = packets_to(fabric.hostd(1), "h2") - before;
    assert!(crossed >= 10_000, "mpirun: {crossed} packets from h1 to h2");
}

fn a_tenant_cannot_connect_to_another_network_on_another_host(backend: Backend) {
    let _one = serial();
    vrdma_tests::need::root("network namespaces");
    let shim = IbverbsShim::new();
    let fabric = Fabric::start_over(backend);
    assert_another_network_is_refused(&fabric, &shim);
    // gamma (blue, on h2) may reach alpha on h1.
    let r = pair(
        &shim,
        fabric.device(1, "alpha"),
        fabric.device(2, "gamma"),
        "ibv_rc_pingpong",
        &["-g", "0", "-n", "50", "-c"],
        Duration::from_secs(30),
    );
    assert_ok(&fabric, "gamma to alpha", &r);
}

fn a_dead_host_fails_its_peers_with_retry_exceeded_while_others_run_on(backend: Backend) {
    let _one = serial();
    vrdma_tests::need::root("network namespaces");
    let shim = IbverbsShim::new();
    let mut fabric = Fabric::start_over(backend);
    // h1 streams RDMA WRITEs to h2 (ib_write_bw's client is the sender),
    // and an unrelated exchange runs between h1 and h3.
    let (p12, p13) = (next_port(), next_port());
    // (A process-mode device serves one process at a time: the stream
    // runs between gamma's devices, the exchange between alpha's.)
    let (g1, g2, a1, a3) = (
        fabric.device(1, "gamma").to_owned(),
        fabric.device(2, "gamma").to_owned(),
        fabric.device(1, "alpha").to_owned(),
        fabric.device(3, "alpha").to_owned(),
    );
    let stream = ["-x", "0", "-s", "4096", "-n", "100000000"];
    let exchange = ["-g", "0", "-n", "3000", "-s", "64"];
    let s12 = spawn(&shim, &g2, "ib_write_bw", &p12.to_string(), &stream, None);
    let s13 = spawn(
        &shim,
        &a1,
        "ibv_rc_pingpong",
        &p13.to_string(),
        &exchange,
        None,
    );
    let deadline = Instant::now() + Duration::from_secs(20);
    while !(tcp_listening(p12) && tcp_listening(p13)) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    let c12 = spawn(
        &shim,
        &g1,
        "ib_write_bw",
        &p12.to_string(),
        &stream,
        Some("127.0.0.1"),
    );
    // The stream runs: h1 has sent h2 thousands of packets.
    let deadline = Instant::now() + Duration::from_secs(30);
    while packets_to(fabric.hostd(1), "h2") < 5000 {
        assert!(
            Instant::now() < deadline,
            "the stream never ran:\n{}",
            fabric.logs()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let c13 = spawn(
        &shim,
        &a3,
        "ibv_rc_pingpong",
        &p13.to_string(),
        &exchange,
        Some("127.0.0.1"),
    );
    // h2's hostd dies: its peers' packets go unanswered.
    let killed = Instant::now();
    fabric.hostds[1] = None;
    // perftest's QPs: timeout 14 (67 ms), retry_cnt 7: about 0.5 s.
    let c12 = wait(c12, Duration::from_secs(10));
    let took = killed.elapsed();
    let _ = wait(s12, Duration::from_secs(2));
    let out = text(&c12);
    assert!(!c12.status.success(), "h1's sender failed:\n{out}");
    assert!(
        out.contains("Failed status 12"),
        "RETRY_EXC_ERR (status 12):\n{out}"
    );
    assert!(
        took < Duration::from_secs(5),
        "within its timeout: {took:?}"
    );
    // The unrelated pair ran to its end.
    let r = (
        wait(s13, Duration::from_secs(60)),
        wait(c13, Duration::from_secs(60)),
    );
    assert_ok(&fabric, "h1 <-> h3 while h2 died", &r);
}

fn a_hostile_network_loses_no_byte_and_hangs_nothing(backend: Backend) {
    let _one = serial();
    vrdma_tests::need::root("network namespaces");
    let shim = IbverbsShim::new();
    let faults = Faults {
        drop: 0.02,
        dup: 0.02,
        reorder: 0.02,
        delay: Duration::from_micros(300),
        delay_rate: 0.02,
        truncate: 0.01,
        corrupt: 0.01,
        seed: 7,
        ..Faults::default()
    };
    let fabric = Fabric::on_over(Cluster::relayed(3, &faults), Directory::File, backend);
    // Every message's bytes checked by rc_pingpong (-c). Go-back-N sends a
    // whole window again per loss: messages of a few packets keep the run
    // short at these loss rates.
    run_between_h1_and_h2(
        &fabric,
        &shim,
        &[
            (
                "ibv_rc_pingpong",
                &["-g", "0", "-n", "300", "-s", "4096", "-c"],
            ),
            ("ib_write_bw", &["-x", "0", "-s", "8192", "-n", "300"]),
            (
                "ib_read_bw",
                &["-x", "0", "-s", "8192", "-n", "300", "-o", "4"],
            ),
            ("ib_atomic_bw", &["-x", "0", "-n", "300"]),
        ],
        Duration::from_secs(90),
    );
    let stats = fabric.cluster.relay_stats();
    let harmed = serde_json::to_value(&stats).expect("stats");
    for fault in ["dropped", "duplicated", "corrupted", "truncated"] {
        assert!(
            harmed[fault].as_u64().unwrap_or(0) > 0,
            "the relay {fault} packets: {harmed}"
        );
    }
    // The hosts saw the harm: retransmissions, and damaged packets dropped
    // by the ICRC or length checks (never written anywhere).
    let peers = |host: usize| {
        let (_, json, _) = fabric.hostd(host).ctl(&["peers", "--json"]);
        serde_json::from_str::<serde_json::Value>(&json).expect("peers")
    };
    let (p1, p2) = (peers(1), peers(2));
    let sum = |v: &serde_json::Value, key: &str| -> u64 {
        (v.as_array().into_iter().flatten())
            .map(|p| p[key].as_u64().unwrap_or(0))
            .sum()
    };
    assert!(
        sum(&p1, "retransmissions") + sum(&p2, "retransmissions") > 0,
        "{p1} {p2}"
    );
    let drops = |v: &serde_json::Value| -> u64 {
        (v.as_array().into_iter().flatten())
            .flat_map(|p| p["drops"].as_object().into_iter().flatten())
            .filter(|(k, _)| ["bad_icrc", "truncated", "bad_length"].contains(&k.as_str()))
            .map(|(_, v)| v.as_u64().unwrap_or(0))
            .sum()
    };
    assert!(
        drops(&p1) + drops(&p2) > 0,
        "damaged packets dropped: {p1} {p2}"
    );
}

fn with_the_directory_in_etcd_hosts_find_each_other_and_a_dead_host_disappears(backend: Backend) {
    let _one = serial();
    vrdma_tests::need::root("network namespaces");
    let shim = IbverbsShim::new();
    let mut fabric = Fabric::on_over(Cluster::bridged(3), Directory::Etcd, backend);
    run_between_h1_and_h2(
        &fabric,
        &shim,
        &[
            (
                "ibv_rc_pingpong",
                &["-g", "0", "-n", "300", "-s", "4096", "-c"],
            ),
            ("ib_write_bw", &["-x", "0", "-s", "65536", "-n", "300"]),
            ("ib_read_bw", &["-x", "0", "-s", "65536", "-n", "200"]),
            ("ib_atomic_bw", &["-x", "0", "-n", "300"]),
        ],
        Duration::from_secs(60),
    );
    // Another network stays out of reach, through etcd's view too.
    assert_another_network_is_refused(&fabric, &shim);
    // A QP of h1's gamma may connect to h2's gamma (its GID is in etcd);
    // once h2 dies, its lease (2 s) expires, its GIDs leave h1's view and
    // the same connection is refused at RTR: no such GID (ENOENT).
    let i = (fabric.vdevs.iter())
        .position(|(h, t, _)| *h == 1 && t == "gamma")
        .expect("h1's gamma");
    let (_, _, vdev) = fabric.vdevs.remove(i);
    let tenant = Tenant::open(vdev);
    let h2_gamma = vrdma_spec::gid::ipv4_mapped([10, 200, 2, 3]);
    let connect = || {
        let qp = tenant.qp(QpCapabilities {
            max_send_wr: 4,
            max_recv_wr: 4,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: 0,
        });
        bring_up(&qp, 0x42, h2_gamma, Connection::default())
    };
    assert!(connect().is_ok(), "h2's gamma is in the directory");
    fabric.vdevs.retain(|(host, _, _)| *host != 2);
    fabric.hostds[1] = None;
    let gone = Instant::now();
    let refused = loop {
        match connect() {
            Err(e) if e.errno() == libc::ENOENT => break gone.elapsed(),
            _ if gone.elapsed() > Duration::from_secs(10) => {
                panic!("h2's GIDs never left h1's view:\n{}", fabric.logs())
            }
            _ => std::thread::sleep(Duration::from_millis(200)),
        }
    };
    assert!(
        refused < Duration::from_secs(5),
        "lease 2 s, refused after {refused:?}"
    );
}

fn every_rc_operation_is_byte_exact_between_hosts(backend: Backend) {
    use vrdma_guest_driver::{SendPayload, SendWr};
    use vrdma_spec::verbs::{SendOpcode, WcOpcode, WcStatus};
    use vrdma_tests::tenant::{fill, one, qp_pair, rdma, read_mr, signaled, Pair};
    let _one = serial();
    vrdma_tests::need::root("network namespaces");
    let mut fabric = Fabric::start_over(backend);
    // alpha's devices on h1 and h2, opened by this process.
    let mut take = |host: usize| {
        let i = (fabric.vdevs.iter())
            .position(|(h, t, _)| *h == host && t == "alpha")
            .expect("alpha's device");
        Tenant::open(fabric.vdevs.remove(i).2)
    };
    let (a, b) = (take(1), take(2));
    let (qa, qb) = qp_pair(&a, &b, Connection::default());
    let hostd = fabric.hostds[0].take().expect("h1's hostd");
    let s = Pair {
        qa,
        qb,
        a,
        b,
        hostd,
    };
    let (src, dst) = s.mrs(256 << 10);
    // WRITE of 100 KiB: 100 packets at the path MTU of 1 KiB.
    let data = fill(&src, 100 << 10, 3);
    let sge = [src.sge(0, data.len() as u32)];
    assert_eq!(
        s.rdma(SendOpcode::RdmaWrite, &sge, dst.iova(), dst.rkey()),
        WcStatus::Success
    );
    assert!(read_mr(&dst, 0, data.len()) == data, "WRITE's bytes on h2");
    // WRITE with immediate: the bytes and a receive completion.
    s.recv(9, &[]);
    let mut wr = rdma(
        2,
        SendOpcode::RdmaWriteWithImm,
        &sge[..],
        dst.iova() + 0x20000,
        dst.rkey(),
    );
    wr.imm_data = [9, 8, 7, 6];
    assert_eq!(s.post(wr).status, WcStatus::Success);
    let wc = one(&s.b.cq);
    assert_eq!(
        (wc.wr_id, wc.opcode, wc.imm_data),
        (9, Some(WcOpcode::RecvRdmaWithImm), Some([9, 8, 7, 6]))
    );
    assert!(read_mr(&dst, 0x20000, data.len()) == data);
    // SEND of 5000 bytes with immediate into a receive.
    s.recv(10, &[dst.sge(0x3_8000, 8192)]);
    let gather = [src.sge(0, 5000)];
    let mut send = signaled(SendWr::new(
        3,
        SendOpcode::SendWithImm,
        SendPayload::Sges(&gather),
    ));
    send.imm_data = [1, 2, 3, 4];
    assert_eq!(s.post(send).status, WcStatus::Success);
    let wc = one(&s.b.cq);
    assert_eq!(
        (wc.wr_id, wc.byte_len, wc.imm_data),
        (10, 5000, Some([1, 2, 3, 4]))
    );
    assert_eq!(wc.src_qp, s.qa.qp_num());
    assert!(read_mr(&dst, 0x3_8000, 5000) == data[..5000]);
    // READ of 60 KiB back from h2.
    let theirs = pattern_on(&dst, 0x3_0000, 60 << 10);
    let into = [src.sge(0x2_0000, 60 << 10)];
    assert_eq!(
        s.rdma(
            SendOpcode::RdmaRead,
            &into,
            dst.iova() + 0x3_0000,
            dst.rkey()
        ),
        WcStatus::Success
    );
    assert!(
        read_mr(&src, 0x2_0000, 60 << 10) == theirs,
        "READ's bytes on h1"
    );
    // Atomics on h2's memory.
    dst.write(0x3_f000, &100u64.to_le_bytes()).expect("init");
    let word = [src.sge(0x3_f000, 8)];
    let mut fa = rdma(
        4,
        SendOpcode::AtomicFetchAndAdd,
        &word,
        dst.iova() + 0x3_f000,
        dst.rkey(),
    );
    fa.compare_add = 5;
    assert_eq!(s.post(fa).status, WcStatus::Success);
    assert_eq!(read_mr(&src, 0x3_f000, 8), 100u64.to_le_bytes());
    let mut cs = rdma(
        5,
        SendOpcode::AtomicCmpAndSwp,
        &word,
        dst.iova() + 0x3_f000,
        dst.rkey(),
    );
    (cs.compare_add, cs.swap) = (105, 7);
    assert_eq!(s.post(cs).status, WcStatus::Success);
    assert_eq!(read_mr(&src, 0x3_f000, 8), 105u64.to_le_bytes());
    assert_eq!(read_mr(&dst, 0x3_f000, 8), 7u64.to_le_bytes());
    // A bad rkey is a remote access error; h2's memory is untouched.
    let before = read_mr(&dst, 0, 64);
    assert_eq!(
        s.rdma(
            SendOpcode::RdmaWrite,
            &[src.sge(0x2_0000, 64)],
            dst.iova(),
            0xdead
        ),
        WcStatus::RemAccessErr
    );
    assert_eq!(read_mr(&dst, 0, 64), before);
}

/// Writes a pattern of `len` bytes at `offset` of `mr`; the bytes.
fn pattern_on(mr: &vrdma_guest_driver::verbs::MemoryRegion, offset: usize, len: usize) -> Vec<u8> {
    let data = vrdma_tests::tenant::pattern(len, 11);
    mr.write(offset, &data).expect("fill");
    data
}

/// `program` as a process of host `host` runs it on its alpha device: in
/// the host's network namespace, and in IPC, PID and UTS namespaces of
/// its own (hostname `h<host>`), as in a container there.
fn on_host(fabric: &Fabric, shim: &IbverbsShim, host: usize, program: &str) -> Command {
    let mut cmd = fabric.command(shim, host, "alpha", "unshare");
    cmd.args(container(&format!("h{host}"), "")).arg(program);
    cmd
}

/// `unshare`'s arguments that run the program following them as in a
/// container of its own: IPC, PID and UTS namespaces, hostname `name`
/// followed by `suffix` (shell words, e.g. `-$OMPI_COMM_WORLD_RANK`).
fn container(name: &str, suffix: &str) -> Vec<String> {
    vrdma_tests::need::program("unshare", "util-linux");
    let script = format!("hostname \"$0{suffix}\" && exec \"$@\"");
    let mut args = vrdma_tests::strings(&[
        "--ipc",
        "--pid",
        "--uts",
        "--fork",
        "--kill-child",
        "--",
        "sh",
        "-c",
    ]);
    args.extend([script, name.to_owned()]);
    args
}
