//! The multi-host test infrastructure (`vrdma_tests::netns`, `vrdma-relay`,
//! daemons in a namespace): hosts in network namespaces reach each other
//! over a bridge and over the relay, daemons and tenants run inside a
//! host, nothing is left behind, and the relay does to RoCE datagrams
//! (UDP to port 4791) exactly the harm it is asked to, and to nothing
//! else. Needs root and iproute2 (and ethtool for the relay).

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddrV4, TcpListener, TcpStream, UdpSocket};
use std::os::fd::AsRawFd;
use std::os::unix::fs::MetadataExt;
use std::sync::mpsc;
use std::time::Duration;

use vrdma_tests::daemon::Hostd;
use vrdma_tests::netns::{Cluster, Host};
use vrdma_tests::tenant::Tenant;
use vrdma_tools::relay::{Faults, Stats, ROCE_V2_PORT};

/// Datagrams the relay tests send.
const COUNT: u32 = 1000;
/// Bytes of each: its number, big-endian, 16 times.
const LEN: usize = 64;

fn datagram(n: u32) -> Vec<u8> {
    n.to_be_bytes().repeat(LEN / 4)
}

/// The number a (possibly harmed) datagram carries: the value most of its
/// whole 4-byte words hold (one flipped bit changes one word).
fn number(d: &[u8]) -> Option<u32> {
    let mut votes: HashMap<u32, usize> = HashMap::new();
    for w in d.chunks_exact(4) {
        *votes
            .entry(u32::from_be_bytes([w[0], w[1], w[2], w[3]]))
            .or_default() += 1;
    }
    votes.into_iter().max_by_key(|&(_, n)| n).map(|(v, _)| v)
}

/// A bigger receive buffer (root may exceed rmem_max): a burst of
/// datagrams must not overflow it.
fn big_buffer(socket: &UdpSocket) {
    let bytes: libc::c_int = 8 << 20;
    // SAFETY: setsockopt reads a live c_int of the size given.
    let ret = unsafe {
        libc::setsockopt(
            socket.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVBUFFORCE,
            (&bytes as *const libc::c_int).cast(),
            size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    assert_eq!(ret, 0, "SO_RCVBUFFORCE");
}

/// Receives datagrams on `to` at `addr` while `send` runs on `from`;
/// returns them (source, bytes) in arrival order, once none came for
/// half a second.
fn exchange(
    from: &Host,
    to: &Host,
    addr: SocketAddrV4,
    send: impl FnOnce(&UdpSocket) + Send,
) -> Vec<(SocketAddrV4, Vec<u8>)> {
    let (ready, bound) = mpsc::channel();
    let receiver = to.spawn(move || {
        let socket = UdpSocket::bind(addr).expect("bind the receiver");
        big_buffer(&socket);
        ready.send(()).expect("signal");
        let mut got = Vec::new();
        let mut buf = [0u8; 65536];
        socket
            .set_read_timeout(Some(Duration::from_secs(5)))
            .expect("timeout");
        while let Ok((n, src)) = socket.recv_from(&mut buf) {
            let std::net::SocketAddr::V4(src) = src else {
                panic!("IPv6 source {src}")
            };
            got.push((src, buf[..n].to_vec()));
            socket
                .set_read_timeout(Some(Duration::from_millis(500)))
                .expect("timeout");
        }
        got
    });
    bound.recv().expect("receiver bound");
    from.run(|| {
        let socket = UdpSocket::bind((Ipv4Addr::UNSPECIFIED, 0)).expect("bind the sender");
        send(&socket);
    });
    receiver.join().expect("receiver")
}

/// Sends datagrams 0..COUNT to `to`, paced (bursts of 20), and returns
/// what arrived.
fn send_numbered(from: &Host, to: &Host, port: u16) -> Vec<Vec<u8>> {
    let addr = SocketAddrV4::new(to.underlay, port);
    // Resolve the neighbour first: until ARP answers, the kernel holds only
    // ~200 KB of datagrams for it and drops the oldest, so on a loaded
    // machine a slow first ARP exchange (through the relay) would lose the
    // stream's head and fail the test for a reason it does not test.
    let warm = SocketAddrV4::new(to.underlay, port.wrapping_add(100));
    let got = exchange(from, to, warm, |socket| {
        socket.send_to(b"warm", warm).expect("send");
    });
    assert_eq!(
        got.len(),
        1,
        "one datagram reaches {} (ARP passes)",
        to.name
    );
    let got = exchange(from, to, addr, |socket| {
        for n in 0..COUNT {
            socket.send_to(&datagram(n), addr).expect("send");
            if n % 20 == 19 {
                std::thread::sleep(Duration::from_millis(1));
            }
        }
    });
    got.into_iter().map(|(_, d)| d).collect()
}

/// Opens a TCP connection from `from` to `to`, sends a message and reads
/// it back from an echo server on `to`.
fn tcp_echo(from: &Host, to: &Host) {
    let addr = SocketAddrV4::new(to.underlay, 7000);
    let message: Vec<u8> = (0..200_000u32).map(|i| (i % 251) as u8).collect();
    let (ready, listening) = mpsc::channel();
    let server = to.spawn(move || {
        let listener = TcpListener::bind(addr).expect("listen");
        ready.send(()).expect("signal");
        let (mut stream, peer) = listener.accept().expect("accept");
        let mut data = Vec::new();
        stream.read_to_end(&mut data).expect("read");
        stream.write_all(&data).expect("echo");
        peer
    });
    listening.recv().expect("server listening");
    let echoed = from.run(|| {
        let mut stream = TcpStream::connect(addr).expect("connect");
        stream.write_all(&message).expect("write");
        stream
            .shutdown(std::net::Shutdown::Write)
            .expect("shutdown");
        let mut back = Vec::new();
        stream.read_to_end(&mut back).expect("read the echo");
        back
    });
    assert!(
        echoed == message,
        "TCP echo from {} to {} differs",
        from.name,
        to.name
    );
    let peer = server.join().expect("server");
    assert_eq!(peer.ip(), std::net::IpAddr::V4(from.underlay));
}

#[test]
fn hosts_on_a_bridge_reach_each_other_by_udp_tcp_and_added_addresses() {
    let cluster = Cluster::bridged(3);
    let (h1, h2, h3) = (cluster.host(1), cluster.host(2), cluster.host(3));
    assert_eq!(h3.underlay, Ipv4Addr::new(10, 200, 0, 3));

    let addr = SocketAddrV4::new(h3.underlay, ROCE_V2_PORT);
    let got = exchange(h1, h3, addr, |s| {
        s.send_to(b"one", addr).expect("send");
    });
    assert_eq!(got.len(), 1);
    assert_eq!(
        (*got[0].0.ip(), got[0].1.as_slice()),
        (h1.underlay, &b"one"[..])
    );

    tcp_echo(h2, h1);
    tcp_echo(h3, h2);

    // A tenant GID on h2: reached from h3 (ARP resolves it on the same
    // /16), and used as a source address by h2.
    let gid = Ipv4Addr::new(10, 200, 1, 7);
    cluster.add_address(2, gid);
    let to_gid = SocketAddrV4::new(gid, 4791);
    let got = exchange(h3, h2, to_gid, |s| {
        s.send_to(b"to a gid", to_gid).expect("send");
    });
    assert_eq!(got.len(), 1, "a datagram to the added address arrives");
    let back = SocketAddrV4::new(h3.underlay, 4791);
    let got = exchange(h2, h3, back, |_| {
        let s = UdpSocket::bind((gid, 0)).expect("bind to the GID");
        s.send_to(b"from a gid", back).expect("send");
    });
    assert_eq!(got.len(), 1);
    assert_eq!(*got[0].0.ip(), gid, "the source is the added address");
    cluster.remove_address(2, gid);
    let (ready, bound) = mpsc::channel();
    let bind = h2.spawn(move || {
        let result = UdpSocket::bind(to_gid).map(drop);
        ready.send(()).expect("signal");
        result
    });
    bound.recv().expect("tried");
    assert!(
        bind.join().expect("thread").is_err(),
        "a removed address cannot be bound"
    );
}

#[test]
fn processes_run_inside_a_host_and_its_namespaces_go_with_the_cluster() {
    let cluster = Cluster::bridged(2);
    let names = cluster.namespaces();
    assert_eq!(names.len(), 3);
    let out = cluster
        .host(2)
        .command("ip")
        .args(["-o", "-4", "addr", "show"])
        .output()
        .expect("ip addr in h2");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("10.200.0.2/16"), "h2's addresses: {text}");
    assert!(
        !text.contains("10.200.0.1/"),
        "h1's address is not h2's: {text}"
    );
    drop(cluster);
    for name in &names {
        assert!(
            !std::path::Path::new("/run/netns").join(name).exists(),
            "namespace {name} is left"
        );
    }
    let out = std::process::Command::new("ip")
        .args(["-o", "-4", "addr", "show"])
        .output()
        .expect("ip addr");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(!text.contains("10.200."), "addresses are left: {text}");
}

#[test]
fn namespaces_a_killed_run_left_are_removed_by_the_next_cluster() {
    // A pid above pid_max never runs.
    let pid_max: u64 = std::fs::read_to_string("/proc/sys/kernel/pid_max")
        .expect("pid_max")
        .trim()
        .parse()
        .expect("a number");
    let stale = format!("vr{}c0h1", pid_max + 1);
    let status = std::process::Command::new("ip")
        .args(["netns", "add", &stale])
        .status()
        .expect("ip netns add");
    assert!(status.success());
    let path = std::path::Path::new("/run/netns").join(&stale);
    assert!(path.exists());
    let _cluster = Cluster::bridged(1);
    assert!(!path.exists(), "{stale} was not removed");
}

#[test]
fn hostd_its_vdevs_and_tenants_run_inside_a_host() {
    let cluster = Cluster::bridged(1);
    let host = cluster.host(1);
    let hostd = Hostd::start_in_netns(Some(&host.netns_path()), None, &[]);
    let tenant = Tenant::start(&hostd, "alpha");
    let inode = std::fs::metadata(host.netns_path())
        .expect("netns file")
        .ino();
    let netns_of = |pid: u32| {
        std::fs::metadata(format!("/proc/{pid}/ns/net"))
            .expect("ns of the daemon")
            .ino()
    };
    assert_eq!(netns_of(hostd.pid()), inode, "hostd runs in h1");
    assert_eq!(netns_of(tenant.vdev.pid()), inode, "its vdev runs in h1");
    assert_ne!(netns_of(std::process::id()), inode, "the test does not");
    // The tenant reached hostd through vdev over unix sockets across the
    // namespaces: its device has a port.
    assert_ne!(tenant.gid, [0; 16], "hostd gave its device a GID");
    drop(tenant);
    drop(hostd);
}

/// A cluster of 2 hosts on the relay with `faults`; h1 sends 1000
/// numbered RoCE datagrams to h2; returns what arrived and the relay's
/// final counters.
fn through_relay(faults: Faults) -> (Vec<Vec<u8>>, Stats) {
    let mut cluster = Cluster::relayed(2, &faults);
    let got = send_numbered(cluster.host(1), cluster.host(2), ROCE_V2_PORT);
    let stats = cluster.stop_relay();
    assert_eq!(
        stats.roce,
        u64::from(COUNT),
        "the relay saw every datagram: {stats:?}"
    );
    assert_eq!((stats.send_errors, stats.socket_drops), (0, 0), "{stats:?}");
    (got, stats)
}

#[test]
fn the_relay_without_faults_forwards_udp_tcp_and_gso_intact_and_in_order() {
    let mut cluster = Cluster::relayed(3, &Faults::default());
    let (h1, h2, h3) = (cluster.host(1), cluster.host(2), cluster.host(3));
    let got = send_numbered(h1, h2, ROCE_V2_PORT);
    let sent: Vec<Vec<u8>> = (0..COUNT).map(datagram).collect();
    assert_eq!(got.len(), sent.len());
    assert!(got == sent, "datagrams arrive intact and in order");
    tcp_echo(h3, h1);

    // Ten datagrams sent as one (UDP GSO, as hostd batches): the host's
    // segmentation is off, so the relay forwards ten frames, each with its
    // checksum completed.
    let addr = SocketAddrV4::new(h3.underlay, ROCE_V2_PORT);
    let got = exchange(h2, h3, addr, |s| {
        let segment: libc::c_int = 100;
        // SAFETY: setsockopt reads a live c_int of the size given.
        let ret = unsafe {
            libc::setsockopt(
                s.as_raw_fd(),
                libc::SOL_UDP,
                libc::UDP_SEGMENT,
                (&segment as *const libc::c_int).cast(),
                size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        assert_eq!(ret, 0, "UDP_SEGMENT");
        let all: Vec<u8> = (0..10u8).flat_map(|i| [i; 100]).collect();
        assert_eq!(s.send_to(&all, addr).expect("send a GSO batch"), 1000);
    });
    let sizes: Vec<(usize, u8)> = got.iter().map(|(_, d)| (d.len(), d[0])).collect();
    let expected: Vec<(usize, u8)> = (0..10).map(|i| (100, i)).collect();
    assert_eq!(sizes, expected);

    let stats = cluster.stop_relay();
    assert_eq!(stats.roce, u64::from(COUNT) + 10, "{stats:?}");
    assert!(
        stats.checksums_completed > 0,
        "veth offloads checksums: {stats:?}"
    );
    assert_eq!(
        (
            stats.dropped,
            stats.duplicated,
            stats.corrupted,
            stats.send_errors
        ),
        (0, 0, 0, 0)
    );
}

#[test]
fn the_relay_drops_about_the_rate_it_is_given() {
    let (got, stats) = through_relay(Faults {
        drop: 0.5,
        seed: 1,
        ..Faults::default()
    });
    let n = got.len() as u64;
    assert!((300..=700).contains(&n), "{n} of {COUNT} arrived");
    assert_eq!(n, u64::from(COUNT) - stats.dropped);
    // What arrives is intact and in order.
    let numbers: Vec<u32> = got.iter().map(|d| number(d).expect("numbered")).collect();
    assert!(numbers.windows(2).all(|w| w[0] < w[1]));
    assert!(got.iter().zip(&numbers).all(|(d, &n)| *d == datagram(n)));
}

#[test]
fn the_relay_duplicates() {
    let (got, stats) = through_relay(Faults {
        dup: 0.1,
        seed: 2,
        ..Faults::default()
    });
    let mut seen: HashMap<u32, usize> = HashMap::new();
    for d in &got {
        *seen.entry(number(d).expect("numbered")).or_default() += 1;
    }
    let twice = seen.values().filter(|&&n| n == 2).count() as u64;
    assert_eq!(seen.len(), COUNT as usize, "every datagram arrives");
    assert!(seen.values().all(|&n| n <= 2));
    assert!(twice > 0);
    assert_eq!(
        (twice, got.len() as u64),
        (stats.duplicated, u64::from(COUNT) + twice)
    );
}

#[test]
fn the_relay_corrupts_one_bit_and_fixes_the_udp_checksum() {
    let (got, stats) = through_relay(Faults {
        corrupt: 0.2,
        seed: 3,
        ..Faults::default()
    });
    assert_eq!(
        got.len(),
        COUNT as usize,
        "corrupted datagrams are delivered"
    );
    let mut corrupted = 0;
    for d in &got {
        let n = number(d).expect("numbered");
        let bits: u32 = d
            .iter()
            .zip(datagram(n))
            .map(|(a, b)| (a ^ b).count_ones())
            .sum();
        assert!(bits <= 1, "datagram {n} differs in {bits} bits");
        corrupted += u64::from(bits);
    }
    assert!((100..=300).contains(&corrupted), "{corrupted} corrupted");
    assert_eq!(corrupted, stats.corrupted);

    // Without the fix, the receiver's kernel drops them on the UDP checksum.
    let (got, stats) = through_relay(Faults {
        corrupt: 0.2,
        fix_udp_checksum: false,
        seed: 3,
        ..Faults::default()
    });
    assert!(stats.corrupted > 0);
    assert_eq!(got.len() as u64, u64::from(COUNT) - stats.corrupted);
    assert!(got
        .iter()
        .all(|d| number(d).is_some_and(|n| *d == datagram(n))));
}

#[test]
fn the_relay_truncates_to_shorter_datagrams() {
    let (got, stats) = through_relay(Faults {
        truncate: 0.2,
        seed: 4,
        ..Faults::default()
    });
    assert_eq!(
        got.len(),
        COUNT as usize,
        "truncated datagrams are delivered"
    );
    let short: Vec<&Vec<u8>> = got.iter().filter(|d| d.len() < LEN).collect();
    assert_eq!(short.len() as u64, stats.truncated);
    assert!((100..=300).contains(&stats.truncated), "{stats:?}");
    for d in &got {
        // Every datagram is a prefix of one sent (a datagram cut to fewer
        // than 4 bytes does not say its number).
        let prefix = match number(d) {
            Some(n) => datagram(n).starts_with(d),
            None => (0..COUNT).any(|n| datagram(n).starts_with(d)),
        };
        assert!(prefix, "{d:?} is not a prefix of a datagram sent");
    }
}

#[test]
fn the_relay_reorders_and_delays_but_loses_nothing() {
    let (got, stats) = through_relay(Faults {
        reorder: 0.1,
        reorder_gap: 3,
        delay: Duration::from_micros(500),
        delay_rate: 0.1,
        seed: 5,
        ..Faults::default()
    });
    let mut numbers: Vec<u32> = got.iter().map(|d| number(d).expect("numbered")).collect();
    let out_of_order = numbers.windows(2).filter(|w| w[0] > w[1]).count();
    assert!(out_of_order > 0, "something overtook something");
    assert!(stats.reordered > 0 && stats.delayed > 0, "{stats:?}");
    numbers.sort_unstable();
    assert_eq!(numbers, (0..COUNT).collect::<Vec<_>>());
}

#[test]
fn the_relay_harms_nothing_but_roce() {
    let faults = Faults {
        drop: 0.4,
        truncate: 0.3,
        corrupt: 0.3,
        ..Faults::default()
    };
    let mut cluster = Cluster::relayed(2, &faults);
    let (h1, h2) = (cluster.host(1), cluster.host(2));
    // Another UDP port: every datagram intact, in order (and ARP, which
    // every frame between the hosts needed, passed).
    let got = send_numbered(h1, h2, ROCE_V2_PORT + 1);
    tcp_echo(h1, h2);
    let stats = cluster.stop_relay();
    assert_eq!((stats.roce, stats.dropped), (0, 0), "{stats:?}");
    let intact = got
        .iter()
        .enumerate()
        .take_while(|(n, d)| **d == datagram(*n as u32))
        .count();
    assert!(
        got.len() == COUNT as usize && intact == got.len(),
        "{} of {COUNT} datagrams arrived, the first {intact} intact and in order; {stats:?}",
        got.len()
    );
}
