//! The Soft-RoCE guest of the interoperability tests, proven on its own
//! (before vrdma speaks RoCE): a QEMU guest whose Debian trixie kernel runs
//! `rdma_rxe` on its virtio-net NIC, a tap in a network namespace the test
//! creates, with Debian's unmodified RDMA programs (`vrdma_tests::vm::rxe`).
//!
//! One boot shows:
//! - the host side of the tap (10.99.0.1, in the namespace) and the guest
//!   (10.99.0.2) exchange UDP datagrams both ways, also with a second
//!   address added to the tap;
//! - `rdma link add rxe0 type rxe netdev eth0` works; `ibv_devinfo -v`
//!   shows rxe0's port active, link layer Ethernet, and the RoCEv2 GID
//!   `::ffff:10.99.0.2`;
//! - `ibv_rc_pingpong -g` and `ib_write_bw -x` between two processes on
//!   rxe0 in the guest exit 0 (rxe, libibverbs' rxe provider and perftest
//!   work in the guest);
//! - pointed at 10.99.0.1 (a fake `ibv_rc_pingpong` server in the
//!   namespace answers its TCP exchange, nobody answers RoCE), the guest's
//!   `ibv_rc_pingpong` sends a RoCEv2 RC SEND_ONLY to 10.99.0.1:4791, then
//!   the same packet again and again (rxe takes retry_cnt 7 as "forever"):
//!   the packets are read with a raw socket in the namespace and checked field
//!   by field, ICRC included (computed as the design's `vrdma_roce::icrc`
//!   must). `VRDMA_VM_WRITE_FIXTURE=1` saves one as
//!   `tests/vm/fixtures/rxe-rc-send.bin` (see `rxe-rc-send.md`), which the
//!   VM-less test here checks the same way.
//!
//! Needs root, debootstrap, xz-utils and binutils (`scripts/test`
//! installs them), like the other VM tests (docs/vm.md).

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, UdpSocket};
use std::path::Path;
use std::time::{Duration, Instant};

use vrdma_tests::vm::rxe::{
    Netns, RoceCapture, RxeGuest, GUEST_ADDR, HOST_ADDR, ROCE_V2_PORT, RXE_DEVICE,
};
use vrdma_tests::vm::{self, VmError};

/// One guest step under TCG on a loaded 2-core machine.
const STEP: Duration = Duration::from_secs(120);
const FIXTURE: &str = "vm/fixtures/rxe-rc-send.bin";

/// The fake peer's QPN and PSN, in its answer to the guest's pingpong.
const FAKE_QPN: u32 = 0x0000ab;
const FAKE_PSN: u32 = 0x123456;
/// The guest pingpong's message size: one SEND_ONLY packet.
const SEND_SIZE: usize = 64;
/// RC SEND_ONLY (IBA 9.2 opcode table).
const RC_SEND_ONLY: u8 = 0x04;

#[track_caller]
fn ok<T>(result: Result<T, VmError>) -> T {
    result.unwrap_or_else(|e| panic!("{e}"))
}

#[test]
fn a_soft_roce_guest_on_a_tap_runs_rxe_and_debians_rdma_programs() {
    let image = vm::image_for_test("vm rxe test");
    vrdma_tests::need::program("ip", "iproute2");
    let started = Instant::now();
    let netns = ok(Netns::create("rxe"));
    let guest = ok(RxeGuest::boot(&image, netns.name()));
    println!("QEMU: {}", guest.guest().command_line().join(" "));
    println!("{:?}: guest up", started.elapsed());

    udp_both_ways(&guest, &netns);
    println!("{:?}: UDP both ways", started.elapsed());

    let rxe = ok(guest.add_rxe());
    println!("{}", rxe.devinfo);
    let info = &rxe.devinfo;
    assert!(info.contains("hca_id:\trxe0"), "{info}");
    assert!(info.contains("PORT_ACTIVE (4)"), "port active:\n{info}");
    assert!(
        info.contains("link_layer:\t\tEthernet"),
        "link layer:\n{info}"
    );
    // rxe lists the link-local GIDs first, then the IPv4 address's.
    assert!(rxe.gid_index > 0, "GID index {}:\n{info}", rxe.gid_index);
    let gid = rxe.gid_index;
    println!(
        "{:?}: {RXE_DEVICE} up, RoCEv2 GID ::ffff:{GUEST_ADDR} at index {gid}",
        started.elapsed()
    );

    // Two processes on rxe0 in the guest: RC SEND/RECV, then perftest's
    // RDMA WRITE.
    let (server, client) = loopback(
        &guest,
        18515,
        &format!("ibv_rc_pingpong -d {RXE_DEVICE} -g {gid} -n 100"),
    );
    for (side, out) in [("server", &server), ("client", &client)] {
        assert!(
            out.stdout.contains(&format!("GID ::ffff:{GUEST_ADDR}"))
                && out.stdout.contains("100 iters in"),
            "ibv_rc_pingpong {side}: {out}"
        );
    }
    print!("ibv_rc_pingpong client:\n{}", client.stdout);
    println!("{:?}: ibv_rc_pingpong on rxe0", started.elapsed());
    let (_, client) = loopback(
        &guest,
        18515,
        &format!("ib_write_bw -d {RXE_DEVICE} -x {gid} -s 4096 -n 200 -F"),
    );
    assert!(
        client.stdout.contains("RDMA_Write BW Test")
            && client.stdout.lines().any(|l| l.trim().starts_with("4096 ")),
        "ib_write_bw: {client}"
    );
    print!("ib_write_bw client:\n{}", client.stdout);
    println!("{:?}: ib_write_bw on rxe0", started.elapsed());

    // The guest's rxe sends to the host side: capture its packets.
    let packets = rxe_packets_to_the_host(&guest, &netns, gid);
    println!("{:?}: captured rxe's RoCEv2 packets", started.elapsed());
    if std::env::var_os("VRDMA_VM_WRITE_FIXTURE").is_some() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(FIXTURE);
        std::fs::write(&path, &packets[0]).expect("write the rxe packet fixture");
        println!("wrote {}", path.display());
    }
}

/// A UDP datagram from the namespace's host side to the guest's
/// netcat, and one from the guest to a socket in the namespace.
fn udp_both_ways(guest: &RxeGuest, netns: &Netns) {
    let socket = ok(netns.run(|| UdpSocket::bind((HOST_ADDR, 0)))).expect("UDP socket on the tap");
    socket
        .set_read_timeout(Some(Duration::from_millis(500)))
        .expect("timeout");

    // Host to guest: netcat in the guest quits after one datagram.
    let listener = guest.spawn("nc.openbsd -u -l -W 1 5555");
    ok(guest.wait_listening(5555, STEP));
    let deadline = Instant::now() + STEP;
    let heard = loop {
        socket
            .send_to(b"host to guest\n", (GUEST_ADDR, 5555))
            .expect("send to the guest");
        if let Some(out) = guest.finished(&listener) {
            break out;
        }
        assert!(
            Instant::now() < deadline,
            "the guest's netcat got nothing:\n{}",
            guest.guest().console()
        );
        std::thread::sleep(Duration::from_millis(500));
    };
    assert!(heard.success(), "netcat in the guest: {heard}");
    assert_eq!(heard.stdout, "host to guest\n");

    // Guest to host: to the tap's address, and to one more address added
    // to the tap (as a vrdma device's GID would be).
    let extra = Ipv4Addr::new(10, 99, 0, 10);
    ok(guest.add_host_address(extra));
    let other = ok(netns.run(|| UdpSocket::bind((extra, 0)))).expect("UDP socket on 10.99.0.10");
    for socket in [&socket, &other] {
        let to = socket.local_addr().expect("address");
        socket
            .set_read_timeout(Some(Duration::from_millis(500)))
            .expect("timeout");
        let sent = ok(guest.run_ok(
            &format!(
                "echo guest to {to} | nc.openbsd -u -w 1 {} {}",
                to.ip(),
                to.port()
            ),
            STEP,
        ));
        let mut buf = [0u8; 256];
        let deadline = Instant::now() + STEP;
        let (n, from) = loop {
            match socket.recv_from(&mut buf) {
                Ok(got) => break got,
                Err(_) if Instant::now() < deadline => {}
                Err(e) => panic!("no datagram from the guest to {to} ({e}); its netcat: {sent}"),
            }
        };
        assert_eq!(&buf[..n], format!("guest to {to}\n").as_bytes());
        assert_eq!(from, SocketAddr::from((GUEST_ADDR, from.port())));
    }
}

/// `command` as a server and as a client of 10.99.0.2 in the guest (both
/// on rxe0, TCP `port` for their exchange); both must exit 0.
fn loopback(guest: &RxeGuest, port: u16, command: &str) -> (vm::rxe::Output, vm::rxe::Output) {
    let server = guest.spawn(command);
    ok(guest.wait_listening(port, STEP));
    let client = ok(guest.run(&format!("{command} {GUEST_ADDR}"), STEP));
    let server = ok(guest.wait(&server, STEP));
    assert!(
        client.success(),
        "client `{command} {GUEST_ADDR}`: {client}"
    );
    assert!(server.success(), "server `{command}`: {server}");
    (server, client)
}

/// Points the guest's `ibv_rc_pingpong` at the namespace's host side: a
/// fake server there answers its TCP exchange with QPN [`FAKE_QPN`], and
/// nobody answers RoCE. Returns the RoCEv2 packets rxe sent (IPv4 header
/// onward), checked.
fn rxe_packets_to_the_host(guest: &RxeGuest, netns: &Netns, gid: u32) -> Vec<Vec<u8>> {
    let capture = ok(RoceCapture::open(netns.name()));
    let listener =
        ok(netns.run(|| TcpListener::bind((HOST_ADDR, 0)))).expect("fake pingpong server");
    let port = listener.local_addr().expect("address").port();
    let fake = std::thread::spawn(move || fake_pingpong_server(&listener));
    let client = guest.spawn(&format!(
        "ibv_rc_pingpong -d {RXE_DEVICE} -g {gid} -s {SEND_SIZE} -n 1 -p {port} {HOST_ADDR}"
    ));
    let client_msg = fake.join().expect("fake server thread");
    // "LLLL:QQQQQQ:PPPPPP:GID": the guest QP's number and first PSN.
    let fields: Vec<&str> = client_msg.split(':').collect();
    assert_eq!(fields.len(), 4, "pingpong message {client_msg:?}");
    let client_qpn = u32::from_str_radix(fields[1], 16).expect("QPN");
    let client_psn = u32::from_str_radix(fields[2], 16).expect("PSN");
    assert_eq!(
        fields[3].trim_end_matches('\0'),
        "00000000000000000000ffff0a630002",
        "the client's GID is ::ffff:10.99.0.2"
    );

    let mut packets = Vec::new();
    while packets.len() < 3 {
        match capture.next(Duration::from_secs(30)) {
            Ok(Some(packet)) => packets.push(packet),
            Ok(None) => break,
            Err(e) => panic!("capture: {e}"),
        }
    }
    assert!(
        packets.len() >= 2,
        "rxe sent the request and retried it: {} packets",
        packets.len()
    );
    for (i, packet) in packets.iter().enumerate() {
        println!("packet {i}: {}", hex(packet));
        let send = check_send_only(packet);
        assert_eq!(send.dest_qp, FAKE_QPN, "packet {i} goes to the fake QP");
        assert_eq!(
            send.psn, client_psn,
            "packet {i} has the client's first PSN (retries repeat it)"
        );
        assert_eq!(send.payload, vec![0x7b; SEND_SIZE], "pingpong's buffer");
    }
    // rxe takes ibv_rc_pingpong's retry_cnt of 7 as "retry forever" (the
    // IBA gives 7 that meaning for rnr_retry only): the client never gives
    // up by itself.
    let still = guest.finished(&client);
    assert!(
        still.is_none(),
        "the unanswered client still retries: {still:?}"
    );
    ok(guest.kill(&client));
    let out = ok(guest.wait(&client, STEP));
    assert_eq!(out.code, 137, "the client, killed: {out}");
    println!(
        "the guest's QP {client_qpn:#08x} sent {} SEND_ONLY packets to QP {FAKE_QPN:#08x}",
        packets.len()
    );
    packets
}

/// Plays `ibv_rc_pingpong`'s server for one TCP exchange: reads the
/// client's "LID:QPN:PSN:GID" message, answers with [`FAKE_QPN`],
/// [`FAKE_PSN`] and GID ::ffff:10.99.0.1, reads its "done". Returns the
/// client's message.
fn fake_pingpong_server(listener: &TcpListener) -> String {
    let (mut stream, _) = listener.accept().expect("the guest's pingpong connects");
    stream.set_read_timeout(Some(STEP)).expect("read timeout");
    // sizeof "0000:000000:000000:00000000000000000000000000000000"
    let mut msg = [0u8; 52];
    stream.read_exact(&mut msg).expect("the client's message");
    let mut reply = format!(
        "{:04x}:{FAKE_QPN:06x}:{FAKE_PSN:06x}:00000000000000000000ffff{:08x}",
        0,
        u32::from(HOST_ADDR)
    )
    .into_bytes();
    reply.push(0);
    assert_eq!(reply.len(), msg.len());
    stream.write_all(&reply).expect("answer the client");
    let mut done = [0u8; 5];
    stream.read_exact(&mut done).expect("the client's done");
    String::from_utf8_lossy(&msg)
        .trim_end_matches('\0')
        .to_owned()
}

/// The fields of a RoCEv2 RC SEND_ONLY the checks look at.
struct SendOnly {
    dest_qp: u32,
    psn: u32,
    payload: Vec<u8>,
}

/// Checks that `packet` (IPv4 header onward) is rxe's RC SEND_ONLY from
/// 10.99.0.2 to 10.99.0.1:4791 with a valid ICRC; returns its fields.
#[track_caller]
fn check_send_only(packet: &[u8]) -> SendOnly {
    let text = hex(packet);
    assert!(packet.len() >= 20 + 8 + 12 + 4, "too short: {text}");
    assert_eq!(packet[0], 0x45, "IPv4 without options: {text}");
    let total = usize::from(u16::from_be_bytes([packet[2], packet[3]]));
    assert_eq!(total, packet.len(), "IPv4 total length: {text}");
    assert_eq!(packet[9], 17, "UDP: {text}");
    assert_eq!(
        Ipv4Addr::from([packet[12], packet[13], packet[14], packet[15]]),
        GUEST_ADDR
    );
    assert_eq!(
        Ipv4Addr::from([packet[16], packet[17], packet[18], packet[19]]),
        HOST_ADDR
    );
    let udp = &packet[20..28];
    assert_eq!(u16::from_be_bytes([udp[2], udp[3]]), ROCE_V2_PORT);
    assert_eq!(
        usize::from(u16::from_be_bytes([udp[4], udp[5]])),
        packet.len() - 20,
        "UDP length: {text}"
    );
    let bth = &packet[28..40];
    assert_eq!(bth[0], RC_SEND_ONLY, "opcode: {text}");
    let pad = usize::from((bth[1] >> 4) & 3);
    assert_eq!(bth[1] & 0x0f, 0, "transport header version 0: {text}");
    assert_eq!(
        u16::from_be_bytes([bth[2], bth[3]]),
        0xffff,
        "default P_Key"
    );
    let dest_qp = u32::from_be_bytes([0, bth[5], bth[6], bth[7]]);
    let psn = u32::from_be_bytes([0, bth[9], bth[10], bth[11]]);
    let end = packet.len() - 4;
    let payload = packet[40..end - pad].to_vec();
    let icrc = u32::from_le_bytes([
        packet[end],
        packet[end + 1],
        packet[end + 2],
        packet[end + 3],
    ]);
    assert_eq!(
        icrc,
        roce_v2_icrc(packet),
        "ICRC (stored little-endian, as rxe does): {text}"
    );
    SendOnly {
        dest_qp,
        psn,
        payload,
    }
}

/// The ICRC of RoCEv2 packet `packet` (IPv4 header onward, ICRC last) as
/// Linux's rxe computes it (rxe_icrc.c): CRC-32 (reflected, 0xEDB88320,
/// no final inversion inside) from seed 0xdebb20e3 (8 bytes of 0xff for
/// the masked LRH) over the IPv4 header with TOS, TTL and checksum all
/// ones, the UDP header with its checksum all ones, the BTH with its
/// reserved byte 4 all ones, and the rest up to the ICRC; the ICRC is its
/// complement.
fn roce_v2_icrc(packet: &[u8]) -> u32 {
    let end = packet.len() - 4;
    let mut masked = packet[..end].to_vec();
    masked[1] = 0xff; // TOS
    masked[8] = 0xff; // TTL
    masked[10..12].copy_from_slice(&[0xff, 0xff]); // header checksum
    masked[26..28].copy_from_slice(&[0xff, 0xff]); // UDP checksum
    masked[28 + 4] = 0xff; // BTH reserved byte
    let mut crc: u32 = 0xdebb_20e3;
    for &byte in &masked {
        crc ^= u32::from(byte);
        for _ in 0..8 {
            crc = (crc >> 1) ^ (0xedb8_8320 & (crc & 1).wrapping_neg());
        }
    }
    !crc
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The saved packet (no VM needed): rxe's SEND_ONLY with a valid ICRC.
#[test]
fn the_saved_rxe_packet_is_a_send_only_with_an_icrc_as_rxe_computes_it() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(FIXTURE);
    let packet = std::fs::read(&path).unwrap_or_else(|e| {
        panic!(
            "{} ({e}): VRDMA_VM_WRITE_FIXTURE=1 writes it",
            path.display()
        )
    });
    let send = check_send_only(&packet);
    assert_eq!(send.dest_qp, FAKE_QPN);
    assert_eq!(send.payload, vec![0x7b; SEND_SIZE]);
    // A corrupted byte anywhere the ICRC covers changes it.
    let mut bad = packet.clone();
    bad[45] ^= 1;
    assert_ne!(
        roce_v2_icrc(&bad),
        roce_v2_icrc(&packet),
        "the ICRC covers the payload"
    );
}
