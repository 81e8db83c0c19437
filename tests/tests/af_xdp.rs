//! The walls of hostd's AF_XDP packet path (`[fabric] packet_io =
//! "af_xdp"`), on the multi-host fabric of `vrdma_tests::hosts` (three
//! hosts as network namespaces on a bridge): while hostd holds its
//! interface's queues, everything that is not RoCEv2 still reaches the
//! host's kernel; and once hostd is gone — killed or stopped — nothing of
//! it stays on the interface, and a new hostd takes the queues again.
//! (RDMA over AF_XDP itself: tests/tests/roce.rs, `<test>::af_xdp`.)

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddrV4, TcpListener, TcpStream, UdpSocket};
use std::time::{Duration, Instant};

use vrdma_tests::daemon::IbverbsShim;
use vrdma_tests::hosts::{text, wait, Fabric};
use vrdma_tests::two_tenants::{serial, spawn_pair_on};

/// `ip -d link show eth0` of host `host`.
fn link(fabric: &Fabric, host: usize) -> String {
    let out = fabric
        .cluster
        .host(host)
        .command("ip")
        .args(["-d", "link", "show", "eth0"])
        .output()
        .expect("run ip (install iproute2)");
    assert!(out.status.success(), "ip link: {}", text(&out));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The id of the XDP program on host `host`'s eth0, if one is attached
/// (`ip` shows `prog/xdp id N` in its details).
fn xdp_program(fabric: &Fabric, host: usize) -> Option<u32> {
    let l = link(fabric, host);
    let at = l.find("prog/xdp id ")? + "prog/xdp id ".len();
    l[at..].split_whitespace().next()?.parse().ok()
}

/// Waits up to 5 s for `cond`.
fn eventually(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while !cond() {
        assert!(Instant::now() < deadline, "not within 5 s: {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// ibv_rc_pingpong between alpha on h1 and alpha on h2, its data checked.
fn pingpong(fabric: &Fabric, shim: &IbverbsShim) {
    let (s, c) = spawn_pair_on(
        shim,
        (fabric.device(1, "alpha"), fabric.device(2, "alpha")),
        "ibv_rc_pingpong",
        &["-g", "0", "-n", "200", "-c"],
        |_| {},
    );
    let c = wait(c, Duration::from_secs(60));
    let s = wait(s, Duration::from_secs(5));
    assert!(
        s.status.success() && c.status.success(),
        "ibv_rc_pingpong:\n{}\n{}\n{}",
        text(&s),
        text(&c),
        fabric.logs()
    );
}

#[test]
fn traffic_that_is_not_rocev2_reaches_the_kernel_while_hostd_holds_the_queues() {
    let _one = serial();
    vrdma_tests::need::root("network namespaces");
    let fabric = Fabric::start();
    for h in [1, 2] {
        assert!(
            xdp_program(&fabric, h).is_some(),
            "h{h}: no XDP program:\n{}",
            link(&fabric, h)
        );
    }
    let (h1, h2) = (fabric.cluster.host(1), fabric.cluster.host(2));
    let h2_addr = Ipv4Addr::new(10, 200, 0, 2);

    // UDP to another port, both ways (the echo answers from h2).
    let echo = h2.run(|| UdpSocket::bind(SocketAddrV4::new(h2_addr, 9911)).expect("bind echo"));
    let echoer = std::thread::spawn(move || {
        let _ = echo.set_read_timeout(Some(Duration::from_secs(10)));
        let mut buf = [0u8; 64];
        let (n, from) = echo
            .recv_from(&mut buf)
            .expect("a datagram reached h2's kernel");
        echo.send_to(&buf[..n], from).expect("echo");
    });
    let answer = h1.run(move || {
        let s = UdpSocket::bind("10.200.0.1:0").expect("bind");
        s.set_read_timeout(Some(Duration::from_secs(10)))
            .expect("timeout");
        s.send_to(b"not rocev2", SocketAddrV4::new(h2_addr, 9911))
            .expect("send");
        let mut buf = [0u8; 64];
        let (n, _) = s.recv_from(&mut buf).expect("the echo reached h1's kernel");
        buf[..n].to_vec()
    });
    assert_eq!(answer, b"not rocev2");
    echoer.join().expect("echo thread");

    // TCP (here to the RoCEv2 port's number: only UDP 4791 is steered).
    let listener = h2.run(|| TcpListener::bind(SocketAddrV4::new(h2_addr, 4791)).expect("listen"));
    let server = std::thread::spawn(move || {
        let (mut c, _) = listener.accept().expect("accept");
        let mut buf = [0u8; 5];
        c.read_exact(&mut buf).expect("read");
        c.write_all(&buf).expect("write");
    });
    let got = h1.run(move || {
        let mut c = TcpStream::connect(SocketAddrV4::new(h2_addr, 4791)).expect("connect");
        c.write_all(b"hello").expect("write");
        let mut buf = [0u8; 5];
        c.read_exact(&mut buf).expect("read");
        buf
    });
    assert_eq!(&got, b"hello");
    server.join().expect("server thread");

    // UDP to 4791 from a kernel socket (a checksum on it): the program
    // leaves it to the kernel, where hostd's packet socket sees it and
    // drops it as malformed; nothing reached the XSK.
    let before = received(&fabric, 2);
    h1.run(move || {
        let s = UdpSocket::bind("10.200.0.1:0").expect("bind");
        s.send_to(&[0u8; 64], SocketAddrV4::new(h2_addr, 4791))
            .expect("send");
    });
    eventually("h2's kernel path took the datagram", || {
        received(&fabric, 2).0 > before.0
    });
    assert_eq!(received(&fabric, 2).1, before.1, "it went to the XSK");
}

/// Host `host`'s hostd's packets received in all, and through its XSKs.
fn received(fabric: &Fabric, host: usize) -> (u64, u64) {
    let (_, stats, _) = fabric.hostd(host).ctl(&["stats", "--json"]);
    let stats: serde_json::Value = serde_json::from_str(&stats).expect("stats JSON");
    let io = &stats["packet_io"];
    let n = |k: &str| io[k].as_u64().unwrap_or(0);
    (n("received_packets"), n("xdp_received_packets"))
}

#[test]
fn nothing_stays_on_the_interface_after_hostd_exits_and_a_new_hostd_takes_it_again() {
    let _one = serial();
    vrdma_tests::need::root("network namespaces");
    let shim = IbverbsShim::new();
    let mut fabric = Fabric::start();
    pingpong(&fabric, &shim);
    let first = xdp_program(&fabric, 2).expect("h2's XDP program");

    // Killed: its bpf_link and its sockets die with it.
    fabric.hostds[1].as_mut().expect("h2's hostd").kill();
    eventually("no XDP program on h2's eth0 after SIGKILL", || {
        xdp_program(&fabric, 2).is_none()
    });
    // Started again (as a supervisor would): it binds the same queue and
    // attaches its own program, and RDMA runs through them.
    let hostd = fabric.hostds[1].as_mut().expect("h2's hostd");
    hostd.restart().expect("restart h2's hostd");
    let second = xdp_program(&fabric, 2).expect("the new hostd's XDP program");
    assert_ne!(first, second, "the same program is still attached");
    assert!(
        fabric
            .hostd(2)
            .log()
            .contains("RoCEv2 packets through AF_XDP"),
        "{}",
        fabric.hostd(2).log()
    );
    // alpha's vdev on h2 registers again on its own.
    eventually("alpha's vdev back on h2's new hostd", || {
        fabric.hostd(2).usage("alpha")["devices"] == 1
    });
    pingpong(&fabric, &shim);
    let (_, xdp) = received(&fabric, 2);
    assert!(xdp > 0, "the new hostd received nothing through its XSK");

    // Stopped as systemd stops it (SIGTERM, whose default action ends
    // hostd): the same.
    let status = fabric.hostds[1]
        .as_mut()
        .expect("h2's hostd")
        .stop()
        .expect("stop h2's hostd");
    use std::os::unix::process::ExitStatusExt;
    assert!(
        status.success() || status.signal() == Some(libc::SIGTERM),
        "hostd exited with {status}"
    );
    eventually("no XDP program on h2's eth0 after SIGTERM", || {
        xdp_program(&fabric, 2).is_none()
    });
    fabric.hostds[1] = None;
}
