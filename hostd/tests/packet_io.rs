//! `UdpIo` on real sockets, each test inside a network namespace of its
//! own (`vrdma-io-<pid>-<test>`, removed at the end even on failure) with
//! `lo` up and two addresses, A = 10.201.0.1 and B = 10.201.0.2: one
//! `UdpIo` sends from A or B to the other, and its own packet socket receives
//! what the kernel delivers. Nothing is sent outside the namespace.
//!
//! Needs root and `ip` (iproute2); fails saying so when missing.

use std::net::{Ipv4Addr, UdpSocket};
use std::os::fd::{AsRawFd, RawFd};
use std::process::Command;
use std::thread;
use std::time::{Duration, Instant};

use vrdma_hostd::net::io::{InPacket, OutPacket, PacketIo, UdpIo, MAX_PACKET, ROCE_V2_PORT};

const A: Ipv4Addr = Ipv4Addr::new(10, 201, 0, 1);
const B: Ipv4Addr = Ipv4Addr::new(10, 201, 0, 2);

/// What every missing-requirement message ends with (tests/src/need.rs).
const HOW: &str = "`scripts/test` run as root installs everything the tests need";

/// A network namespace this test made, deleted when dropped.
struct Netns {
    name: String,
}

impl Netns {
    /// A namespace with `lo` up and addresses A and B on it; `lo_args`
    /// are more `ip link set lo` arguments.
    fn new(tag: &str, lo_args: &[&str]) -> Netns {
        // SAFETY: geteuid has no preconditions.
        let euid = unsafe { libc::geteuid() };
        assert_eq!(
            euid, 0,
            "network namespaces and raw sockets need root: run the tests as root ({HOW})"
        );
        let found = std::env::var_os("PATH")
            .map(|p| std::env::split_paths(&p).any(|d| d.join("ip").is_file()))
            .unwrap_or(false);
        assert!(
            found,
            "ip is not installed: apt-get install iproute2 ({HOW})"
        );
        let name = format!("vrdma-io-{}-{tag}", std::process::id());
        ip(&["netns", "add", &name]);
        // From here on the guard removes it.
        let ns = Netns { name };
        ip(&["-n", &ns.name, "addr", "add", "10.201.0.1/24", "dev", "lo"]);
        ip(&["-n", &ns.name, "addr", "add", "10.201.0.2/24", "dev", "lo"]);
        let mut set = vec!["-n", &ns.name, "link", "set", "lo", "up"];
        set.extend_from_slice(lo_args);
        ip(&set);
        ns
    }

    /// Runs `f` on a thread that has entered the namespace (sockets it
    /// opens belong to it).
    fn run<T: Send>(&self, f: impl FnOnce() -> T + Send) -> T {
        let path = format!("/run/netns/{}", self.name);
        thread::scope(|s| {
            s.spawn(|| {
                let file = std::fs::File::open(&path).expect("open the namespace");
                // SAFETY: a namespace descriptor; only this thread moves.
                let r = unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) };
                assert_eq!(r, 0, "setns: {}", std::io::Error::last_os_error());
                f()
            })
            .join()
            .unwrap_or_else(|e| std::panic::resume_unwind(e))
        })
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip")
            .args(["netns", "del", &self.name])
            .status();
    }
}

fn ip(args: &[&str]) {
    let out = Command::new("ip").args(args).output().expect("run ip");
    assert!(
        out.status.success(),
        "ip {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A packet from `src` to `dst` whose payload is `len` bytes derived from
/// `seed`, ending in a valid ICRC for IPv4 ID 0.
fn packet(src: Ipv4Addr, dst: Ipv4Addr, tos: u8, len: usize, seed: u8) -> OutPacket {
    let mut p = OutPacket::new();
    p.src = src;
    p.dst = dst;
    p.tos = tos;
    p.len = len;
    for (i, b) in p.buf[..len - 4].iter_mut().enumerate() {
        *b = seed.wrapping_mul(31).wrapping_add(i as u8);
    }
    let icrc = icrc(src, dst, 0, &p.buf[..len - 4]);
    p.buf[len - 4..len].copy_from_slice(&icrc);
    p
}

/// The ICRC from its definition, bit by bit (as in rxe): ones for the
/// LRH, the IPv4 header (TOS, TTL, checksum all ones; DF; ID `id`), the
/// UDP header (4791 to 4791, checksum all ones), the payload with the
/// BTH's reserved byte all ones; inverted, little-endian.
fn icrc(src: Ipv4Addr, dst: Ipv4Addr, id: u16, payload: &[u8]) -> [u8; 4] {
    let total = (20 + 8 + payload.len() + 4) as u16;
    let mut data = vec![0xffu8; 8];
    data.extend_from_slice(&[0x45, 0xff]);
    data.extend_from_slice(&total.to_be_bytes());
    data.extend_from_slice(&id.to_be_bytes());
    data.extend_from_slice(&[0x40, 0, 0xff, 17, 0xff, 0xff]);
    data.extend_from_slice(&src.octets());
    data.extend_from_slice(&dst.octets());
    data.extend_from_slice(&ROCE_V2_PORT.to_be_bytes());
    data.extend_from_slice(&ROCE_V2_PORT.to_be_bytes());
    data.extend_from_slice(&(total - 20).to_be_bytes());
    data.extend_from_slice(&[0xff, 0xff]);
    let mut body = payload.to_vec();
    if body.len() > 4 {
        body[4] = 0xff;
    }
    data.extend_from_slice(&body);
    let mut reg = u32::MAX;
    for byte in data {
        reg ^= u32::from(byte);
        for _ in 0..8 {
            reg = if reg & 1 != 0 {
                (reg >> 1) ^ 0xEDB8_8320
            } else {
                reg >> 1
            };
        }
    }
    (!reg).to_le_bytes()
}

/// A received IPv4 packet's fields.
struct Seen {
    tos: u8,
    id: u16,
    flags_frag: u16,
    src: Ipv4Addr,
    dst: Ipv4Addr,
    dst_port: u16,
    payload: Vec<u8>,
}

fn seen(p: &InPacket) -> Seen {
    let b = p.packet();
    assert_eq!(b[0], 0x45, "IPv4 without options");
    let total = usize::from(u16::from_be_bytes([b[2], b[3]]));
    assert_eq!(total, b.len(), "the whole packet");
    assert_eq!(b[9], 17);
    let udp_len = usize::from(u16::from_be_bytes([b[24], b[25]]));
    assert_eq!(udp_len, b.len() - 20);
    Seen {
        tos: b[1],
        id: u16::from_be_bytes([b[4], b[5]]),
        flags_frag: u16::from_be_bytes([b[6], b[7]]),
        src: Ipv4Addr::new(b[12], b[13], b[14], b[15]),
        dst: Ipv4Addr::new(b[16], b[17], b[18], b[19]),
        dst_port: u16::from_be_bytes([b[22], b[23]]),
        payload: b[28..].to_vec(),
    }
}

fn open() -> UdpIo {
    UdpIo::open(Ipv4Addr::UNSPECIFIED, ROCE_V2_PORT).expect("open UdpIo")
}

fn bufs(n: usize) -> Vec<InPacket> {
    (0..n).map(|_| InPacket::new()).collect()
}

/// Waits (up to 5 s) until `fd` is readable.
fn readable(fd: RawFd) -> bool {
    let mut pfd = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one pollfd, valid for the call.
    unsafe { libc::poll(&mut pfd, 1, 5000) == 1 }
}

/// Receives exactly `n` packets (within 5 s), then checks nothing more
/// waits.
fn receive(io: &mut UdpIo, n: usize) -> Vec<Seen> {
    let mut got = Vec::new();
    let mut b = bufs(16);
    let deadline = Instant::now() + Duration::from_secs(5);
    while got.len() < n && Instant::now() < deadline {
        // What the last call left (a GSO message cut into more datagrams
        // than there were buffers) is no longer the fd's to announce.
        let k = io.recv(&mut b).expect("recv");
        if k == 0 && !readable(io.rx_fd()) {
            break;
        }
        got.extend(b[..k].iter().map(seen));
    }
    assert_eq!(got.len(), n, "packets received");
    thread::sleep(Duration::from_millis(50));
    assert_eq!(io.recv(&mut b).expect("recv"), 0, "nothing more");
    got
}

#[test]
fn a_mixed_batch_arrives_whole_in_order_from_its_sources_with_id_0_df_and_tos() {
    let ns = Netns::new("batch", &[]);
    ns.run(|| {
        let mut io = open();
        let sizes = [16usize, 64, 1000, 4096 + 60, MAX_PACKET, 500, 28, 1500];
        let batch: Vec<OutPacket> = (0..64)
            .map(|i| {
                let (src, dst) = if i % 3 == 0 { (B, A) } else { (A, B) };
                let tos = (i as u8 % 4) << 5 | 0x02;
                packet(src, dst, tos, sizes[i % sizes.len()], i as u8)
            })
            .collect();
        assert_eq!(
            io.send(&batch).expect("send"),
            64,
            "a batch of 64 in one go"
        );
        let got = receive(&mut io, 64);
        for (i, (p, s)) in batch.iter().zip(&got).enumerate() {
            assert_eq!(s.payload, p.payload(), "packet {i}'s bytes");
            assert_eq!((s.src, s.dst), (p.src, p.dst), "packet {i}'s addresses");
            assert_eq!(s.tos, p.tos, "packet {i}'s TOS");
            assert_eq!(s.id, 0, "packet {i}'s IP ID");
            assert_eq!(s.flags_frag, 0x4000, "packet {i}: DF, not a fragment");
            assert_eq!(s.dst_port, ROCE_V2_PORT);
            let n = s.payload.len();
            assert_eq!(
                s.payload[n - 4..],
                icrc(s.src, s.dst, s.id, &s.payload[..n - 4])
            );
        }
        let c = io.counters();
        assert_eq!(c.sent_packets, 64);
        let bytes: usize = batch.iter().map(|p| p.len).sum();
        assert_eq!(c.sent_bytes, bytes as u64);
        assert_eq!(c.received_packets, 64);
        assert_eq!(c.received_bytes, bytes as u64 + 64 * 28);
        assert_eq!((c.gso_messages, c.receive_truncated), (0, 0));
    });
}

#[test]
fn gso_runs_go_as_one_message_and_arrive_as_datagrams_with_valid_icrcs() {
    // lo cutting every GSO message in software, as a NIC would.
    gso_runs(Netns::new("gso", &["gso_max_segs", "1"]), false);
}

#[test]
fn gso_messages_that_arrive_whole_are_cut_by_the_receiver() {
    // lo handing every GSO message on whole, as a veth or a bridge does.
    gso_runs(Netns::new("gso-whole", &[]), true);
}

/// Sends runs as GSO messages and checks every packet arrives on its own
/// with the ICRC right for the ID it has; `whole`: the messages reached
/// the receiver uncut (and the receiver cut them).
fn gso_runs(ns: Netns, whole: bool) {
    ns.run(|| {
        let mut io = open();
        assert!(io.gso(), "GSO is on by default");
        let mut batch = Vec::new();
        // A run of 5 x 1000 ending in a 400, a run of 3 x 4156, a lone
        // packet of another TOS, then 2 x 64 from the other source.
        for i in 0..5 {
            batch.push(packet(A, B, 0, 1000, i));
        }
        batch.push(packet(A, B, 0, 400, 5));
        for i in 0..3 {
            batch.push(packet(A, B, 0, 4156, 10 + i));
        }
        batch.push(packet(A, B, 0x20, 4156, 20));
        batch.push(packet(B, A, 0, 64, 21));
        batch.push(packet(B, A, 0, 64, 22));
        let n = batch.len();
        assert_eq!(io.send(&batch).expect("send"), n);
        let c = io.counters();
        assert_eq!(c.gso_fallbacks, 0);
        assert_eq!(c.gso_messages, 3, "{c:?}");
        assert_eq!(c.gso_packets, 6 + 3 + 2);
        assert_eq!(c.sent_packets, n as u64);
        let got = receive(&mut io, n);
        let mut ids = Vec::new();
        for (i, (p, s)) in batch.iter().zip(&got).enumerate() {
            let m = s.payload.len();
            assert_eq!(m, p.len, "packet {i} arrives as its own datagram");
            assert_eq!(s.payload[..m - 4], p.payload()[..m - 4], "packet {i}");
            assert_eq!((s.src, s.dst, s.tos), (p.src, p.dst, p.tos));
            assert_eq!(s.flags_frag, 0x4000);
            assert_eq!(
                s.payload[m - 4..],
                icrc(s.src, s.dst, s.id, &s.payload[..m - 4]),
                "packet {i}'s ICRC for the ID it arrived with ({})",
                s.id
            );
            ids.push(s.id);
        }
        // The kernel numbers a message's segments, and the receiver that
        // cuts one numbers them as the kernel would have.
        assert_eq!(ids, [0, 1, 2, 3, 4, 5, 0, 1, 2, 0, 0, 1]);
        let c = io.counters();
        if whole {
            assert_eq!(
                (c.received_gso_messages, c.received_gso_packets),
                (3, 11),
                "{c:?}"
            );
        } else {
            assert_eq!(
                (c.received_gso_messages, c.received_gso_packets),
                (0, 0),
                "{c:?}"
            );
        }
    });
}

#[test]
fn the_receive_socket_gets_only_the_roce_port_and_the_udp_socket_keeps_nothing() {
    let ns = Netns::new("filter", &[]);
    ns.run(|| {
        let mut io = open();
        let mut b = bufs(4);
        // Empty: no packet, no error (EAGAIN inside).
        assert_eq!(io.recv(&mut b).expect("recv on an empty queue"), 0);

        // A datagram to port 4792, received by a socket there (so it was
        // delivered), not by the packet socket.
        let other = UdpSocket::bind((B, 4792)).expect("bind 4792");
        let plain = UdpSocket::bind((A, 0)).expect("bind a sender");
        plain.send_to(b"not roce", (B, 4792)).expect("send to 4792");
        other
            .set_read_timeout(Some(Duration::from_secs(5)))
            .expect("timeout");
        let mut buf = [0u8; 64];
        assert_eq!(other.recv(&mut buf).expect("4792 receives"), 8);
        thread::sleep(Duration::from_millis(50));
        assert_eq!(io.recv(&mut b).expect("recv"), 0, "4792 is filtered out");

        // Plain UDP to 4791 is RoCE-port traffic: the packet socket has it,
        // the UDP socket bound to 4791 does not.
        plain
            .send_to(b"to 4791!", (B, ROCE_V2_PORT))
            .expect("send to 4791");
        let got = receive(&mut io, 1);
        assert_eq!(got[0].payload, b"to 4791!");
        let sent = [packet(A, B, 0, 100, 1), packet(B, A, 0, 100, 2)];
        assert_eq!(io.send(&sent).expect("send"), 2);
        receive(&mut io, 2);
        // SAFETY: the buffer is valid for its length.
        let r = unsafe {
            libc::recv(
                io.tx_fd(),
                buf.as_mut_ptr().cast(),
                buf.len(),
                libc::MSG_DONTWAIT,
            )
        };
        let e = std::io::Error::last_os_error();
        assert_eq!(r, -1, "nothing queued on the UDP socket");
        assert_eq!(e.raw_os_error(), Some(libc::EAGAIN));
    });
}

#[test]
fn a_packet_from_an_address_not_of_this_host_is_dropped_and_counted() {
    let ns = Netns::new("badsrc", &[]);
    ns.run(|| {
        let mut io = open();
        // (All of 10.201.0.0/24 is local: its addresses are on lo.)
        let stranger = Ipv4Addr::new(10, 202, 0, 9);
        let batch = [
            packet(A, B, 0, 100, 1),
            packet(stranger, B, 0, 100, 2),
            packet(B, A, 0, 100, 3),
        ];
        assert_eq!(io.send(&batch).expect("send"), 3, "done with all three");
        let c = io.counters();
        assert_eq!((c.sent_packets, c.send_unreachable), (2, 1), "{c:?}");
        let got = receive(&mut io, 2);
        assert_eq!(got[0].payload, batch[0].payload());
        assert_eq!(got[1].payload, batch[2].payload());
    });
}
