//! InfiniBand ports: hostd with `link_layer = "infiniband"` (here the
//! `--link-layer` flag), so that programs written for InfiniBand, which
//! name their peer by LID without a GRH, run unmodified between two
//! tenants. Debian's qperf runs every RC, UC and UD test it has in one
//! client invocation (it connects by LID only: on a RoCE port none of its
//! RDMA tests could run without rdma_cm); ibverbs-utils' pingpongs run
//! without `-g` and perftest without `-x`. Address vectors naming a LID
//! are checked as those naming a GID are, by a C program built against
//! Debian's <infiniband/verbs.h>; on an Ethernet port (the default) they
//! stay invalid.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, Instant};

use vrdma_tests::c_program::build_c_program;
use vrdma_tests::daemon::{tcp_listening, Hostd, IbverbsShim, TempDir, Vdev};
use vrdma_tests::need;
use vrdma_tests::qperf;
use vrdma_tests::tenant::blue_and_red;
use vrdma_tests::two_tenants::{finish, next_port, run_one, run_pair, serial, Fabric};

/// hostd with InfiniBand ports, enforcing `policy` (the default one
/// without).
fn ib_hostd(policy: Option<&str>) -> Hostd {
    Hostd::start_with(policy, &["--link-layer", "infiniband"])
}

/// hostd with InfiniBand ports and its two default tenants' vdevs.
fn ib_fabric() -> Fabric {
    let hostd = ib_hostd(None);
    let alpha = Vdev::on_hostd(&hostd, "alpha", &[]);
    let beta = Vdev::on_hostd(&hostd, "beta", &[]);
    Fabric { alpha, beta, hostd }
}

/// Successful work requests of `tenant` by kind, from hostd's stats.
fn ops(hostd: &Hostd, tenant: &str) -> BTreeMap<String, u64> {
    let stats = hostd.tenant_stats(tenant);
    let ops = stats["ops"].as_object().expect("ops by kind");
    ops.iter()
        .map(|(k, v)| (k.clone(), v.as_u64().expect("a count")))
        .collect()
}

#[test]
fn qperf_runs_every_rc_uc_and_ud_test_in_one_client_run() {
    need::program("qperf", "qperf");
    let _serial = serial();
    let shim = IbverbsShim::new();
    let fabric = ib_fabric();
    let port = next_port().to_string();
    // The server on beta's device, the client on alpha's; qperf's own
    // control connection over loopback TCP.
    let server = shim
        .command("qperf", &fabric.beta.socket)
        .args(["--listen_port", &port])
        .spawn()
        .expect("spawn the qperf server");
    let deadline = Instant::now() + Duration::from_secs(20);
    while !tcp_listening(port.parse().expect("port")) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    let client = shim
        .command("qperf", &fabric.alpha.socket)
        .args(["127.0.0.1", "--listen_port", &port, "--time", "1"])
        .args(qperf::TESTS)
        // Ends the server once every test ran.
        .arg("quit")
        .spawn()
        .expect("spawn the qperf client");
    let what = format!("qperf {}", qperf::TESTS.join(" "));
    let text = finish(client, &what, Duration::from_secs(120), || fabric.logs());
    let server_text = finish(server, "qperf server", Duration::from_secs(20), || {
        fabric.logs()
    });
    assert!(
        server_text.trim().is_empty(),
        "the server reported:\n{server_text}"
    );
    qperf::assert_every_figure(&text, qperf::TESTS);
    // hostd moved the tests' work: the client sent, wrote, read, did
    // atomics and received (the latency tests' replies); the server
    // received, replied and wrote back.
    let client_ops = ops(&fabric.hostd, "alpha");
    for kind in ["send", "write", "read", "atomic", "recv"] {
        assert!(client_ops[kind] > 0, "alpha's {kind}: {client_ops:?}");
    }
    let server_ops = ops(&fabric.hostd, "beta");
    for kind in ["send", "write", "recv"] {
        assert!(server_ops[kind] > 0, "beta's {kind}: {server_ops:?}");
    }
}

/// The `port_lid` `ibv_devinfo -v` shows for `device`, after checking the
/// port is InfiniBand with hostd as its subnet manager.
fn port_lid(shim: &IbverbsShim, device: &Path) -> u16 {
    let text = run_one(
        shim,
        "ibv_devinfo",
        device,
        &["-v"],
        Duration::from_secs(30),
    );
    for expected in [
        "state:\t\t\tPORT_ACTIVE (4)",
        "link_layer:\t\tInfiniBand",
        "sm_lid:\t\t\t1\n",
        "GID[  0]:\t\t",
    ] {
        assert!(text.contains(expected), "no {expected:?} in:\n{text}");
    }
    assert!(!text.contains("RoCE"), "{text}");
    let lid = text
        .lines()
        .find_map(|l| l.trim().strip_prefix("port_lid:"))
        .and_then(|v| v.trim().parse::<u16>().ok())
        .unwrap_or_else(|| panic!("no port_lid in:\n{text}"));
    // LID 1 is the subnet manager's (hostd's).
    assert!(lid > 1, "{text}");
    lid
}

#[test]
fn ibverbs_utils_and_perftest_name_their_peers_by_lid() {
    for program in ["ibv_rc_pingpong", "ibv_ud_pingpong", "ibv_devinfo"] {
        need::program(program, "ibverbs-utils");
    }
    need::program("ib_write_bw", "perftest");
    let _serial = serial();
    let shim = IbverbsShim::new();
    let fabric = ib_fabric();
    let alpha = port_lid(&shim, &fabric.alpha.socket);
    let beta = port_lid(&shim, &fabric.beta.socket);
    assert_ne!(alpha, beta);
    // No `-g`: the pingpongs exchange LIDs and connect by them (the UD
    // one makes its address handle from the peer's LID); `-c` checks
    // every received buffer.
    for (program, bytes) in [
        ("ibv_rc_pingpong", "8192000 bytes"),
        ("ibv_ud_pingpong", "2048000 bytes"),
    ] {
        let run = run_pair(&shim, &fabric, program, &["-n", "1000", "-c"]);
        for (side, text, peer) in [
            ("server", run.server_text(), beta),
            ("client", run.client_text(), alpha),
        ] {
            let remote = format!("remote address: LID {peer:#06x}");
            assert!(
                text.contains(&remote) && text.contains(", GID ::\n"),
                "{program} {side} (no GID, peer by LID):\n{text}"
            );
            assert!(
                text.contains(&format!("{bytes} in ")) && text.contains("\n1000 iters in "),
                "{program} {side}:\n{text}"
            );
        }
    }
    // perftest without `-x`: on an IB port it connects by LID (the
    // client runs on beta, its peer is alpha).
    let run = run_pair(
        &shim,
        &fabric,
        "ib_write_bw",
        &["-s", "65536", "-n", "2000", "-F"],
    );
    let client = run.client_text();
    assert!(
        client.contains("Link type       : IB")
            && client.contains(&format!("remote address: LID {alpha:#04x} ")),
        "ib_write_bw client:\n{client}"
    );
    let row = client
        .lines()
        .find(|l| l.split_whitespace().next() == Some("65536"))
        .unwrap_or_else(|| panic!("no result row:\n{client}"));
    let average: f64 = row
        .split_whitespace()
        .nth(3)
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no average in {row:?}"));
    assert!(average > 0.0, "{row}");
}

/// What `lid_addressing` printed for one LID: the errnos of RC RTR, UC
/// RTR and `ibv_create_ah` (0: it succeeded).
fn attempts(text: &str, lid: u16) -> [i32; 3] {
    let prefix = format!("dlid {lid:#x}: ");
    let line = text
        .lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .unwrap_or_else(|| panic!("no {prefix:?} in:\n{text}"));
    let errnos: Vec<i32> = line
        .split_whitespace()
        .skip(1)
        .step_by(2)
        .map(|e| e.parse().expect("an errno"))
        .collect();
    errnos.try_into().unwrap_or_else(|_| panic!("{line:?}"))
}

/// Builds the LID-addressing program (tests/c/lid_addressing.c).
fn lid_addressing(dir: &TempDir) -> String {
    let exe = build_c_program(dir, "lid_addressing", include_str!("../c/lid_addressing.c"));
    exe.to_str().expect("UTF-8 path").to_owned()
}

/// The port line `lid_addressing` printed: (link layer, LID).
fn port_of(text: &str) -> (u8, u16) {
    let line = text
        .lines()
        .find_map(|l| l.strip_prefix("port link_layer "))
        .unwrap_or_else(|| panic!("no port line in:\n{text}"));
    let (layer, lid) = line.split_once(" lid ").expect("link layer and LID");
    (
        layer.parse().expect("link layer"),
        lid.parse().expect("LID"),
    )
}

#[test]
fn an_address_vector_names_a_unicast_lid_of_a_reachable_device() {
    need::program("ibv_devinfo", "ibverbs-utils");
    let _serial = serial();
    let shim = IbverbsShim::new();
    let dir = TempDir::new("lid-addressing");
    let program = lid_addressing(&dir);
    // alpha and beta in network blue, gamma alone in red.
    let hostd = ib_hostd(Some(&blue_and_red()));
    let vdevs = ["alpha", "beta", "gamma"].map(|t| Vdev::on_hostd(&hostd, t, &[]));
    let lid_of = |v: &Vdev| {
        let text = run_one(&shim, &program, &v.socket, &[], Duration::from_secs(30));
        let (layer, lid) = port_of(&text);
        assert_eq!(layer, 1, "IBV_LINK_LAYER_INFINIBAND:\n{text}");
        lid
    };
    let [alpha, beta, gamma] = [0, 1, 2].map(|i| lid_of(&vdevs[i]));
    let unknown = alpha.max(beta).max(gamma) + 100;
    let lids = [beta, alpha, gamma, unknown, 0, 0xc000, 0xfffe, 0xffff];
    let args: Vec<String> = lids.iter().map(|l| format!("{l:#x}")).collect();
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let text = run_one(
        &shim,
        &program,
        &vdevs[0].socket,
        &args,
        Duration::from_secs(30),
    );
    let expect = |lid: u16, errno: i32, why: &str| {
        assert_eq!(attempts(&text, lid), [errno; 3], "{why}:\n{text}");
    };
    expect(beta, 0, "a device of the same network");
    expect(alpha, 0, "its own device");
    expect(gamma, libc::EACCES, "another tenant's network");
    expect(unknown, libc::ENOENT, "a LID no device has");
    expect(0, libc::EINVAL, "the reserved LID 0");
    expect(0xc000, libc::EINVAL, "a multicast LID");
    expect(0xfffe, libc::EINVAL, "a multicast LID");
    expect(0xffff, libc::EINVAL, "the permissive LID");
}

#[test]
fn on_an_ethernet_port_an_address_vector_without_a_grh_is_invalid() {
    let _serial = serial();
    let shim = IbverbsShim::new();
    let dir = TempDir::new("lid-addressing-roce");
    let program = lid_addressing(&dir);
    // The default: RoCEv2 ports.
    let fabric = Fabric::start();
    let text = run_one(
        &shim,
        &program,
        &fabric.alpha.socket,
        &["1", "2", "3"],
        Duration::from_secs(30),
    );
    assert_eq!(
        port_of(&text),
        (2, 0),
        "IBV_LINK_LAYER_ETHERNET, no LID:\n{text}"
    );
    for lid in [1, 2, 3] {
        assert_eq!(attempts(&text, lid), [libc::EINVAL; 3], "{text}");
    }
}
