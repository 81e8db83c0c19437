//! [`UdpIo`]: RoCEv2 packets through the kernel's IPv4 stack.
//!
//! - Sending: one unconnected UDP socket bound to the RoCEv2 port with
//!   `IP_MTU_DISCOVER = IP_PMTUDISC_DO`: DF is set, and Linux then writes
//!   IPv4 ID 0 in every datagram of a socket that is not connected, the ID
//!   the engine computes the ICRC with. Each packet's source address (its
//!   device's GID) is chosen by an `IP_PKTINFO` control message, its TOS by
//!   an `IP_TOS` one; a batch goes in one `sendmmsg`. Runs of packets to
//!   the same destination from the same source with the same TOS and size
//!   can go as one UDP GSO message each ([`UdpIo::set_gso`], off unless
//!   asked for: see there).
//! - Receiving: a packet socket ([`super::rx`]) hands whole IPv4
//!   packets, the ID and flags the ICRC covers included, and cuts the GSO
//!   messages that arrive whole. The UDP socket has a filter that drops
//!   everything and takes GSO messages whole (`UDP_GRO`, so the kernel
//!   does not cut them for it only to drop the pieces): it exists so that
//!   the kernel does not answer RoCEv2 packets with ICMP port-unreachable,
//!   and nothing must queue on it.
//!
//! Both sockets are opened before hostd's sandbox goes up (the datapath's
//! seccomp role has no `socket`); the datapath only calls `sendmmsg` and
//! `recvmmsg` (with `MSG_DONTWAIT`, which the role checks).

use std::io;
use std::mem::size_of;
use std::net::Ipv4Addr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

use libc::{c_int, c_void, sock_filter};

use super::gso::{icrc_for_id, IdDeltas, ICRC_LEN};
use super::rx::PacketRx;
use super::{bpf, InPacket, IoCounters, OutPacket, PacketIo, MAX_PACKET};

/// Packets (and so messages) one `sendmmsg` takes at most; larger batches
/// take several calls. The call's arrays live on the stack (no allocation
/// on the datapath).
const BATCH: usize = 64;

/// The most segments one GSO message carries (the kernel's
/// `UDP_MAX_SEGMENTS` is 64 on older kernels, 128 on newer).
const GSO_MAX_SEGMENTS: usize = 64;

/// The most UDP payload one GSO message carries (one IPv4 datagram's).
const GSO_MAX_BYTES: usize = 65_507;

/// The socket buffers asked for: a few milliseconds of a fast link.
const SOCKET_BUFFER: c_int = 8 << 20;

/// `UDP_GRO` (`linux/udp.h`; not in the libc crate).
const UDP_GRO: c_int = 104;

/// Room for one message's control messages: `IP_PKTINFO` (12 bytes),
/// `IP_TOS` (an int) and `UDP_SEGMENT` (a u16), each a 16-byte header and
/// data padded to 8.
const CMSG_ROOM: usize = (16 + 16) + (16 + 8) + (16 + 8);

/// A control message buffer, aligned as `cmsghdr` wants.
#[repr(C, align(8))]
#[derive(Clone, Copy)]
struct Cmsgs([u8; CMSG_ROOM]);

/// A `sendmmsg` call's arrays, kept from call to call (on the heap,
/// zeroed once): a call writes only the entries it uses, instead of
/// zeroing some 12 KiB of stack every time.
struct TxArrays {
    msgs: [libc::mmsghdr; BATCH],
    iovs: [libc::iovec; 2 * BATCH],
    addrs: [libc::sockaddr_in; BATCH],
    cmsgs: [Cmsgs; BATCH],
    /// ICRCs corrected for a GSO segment's IPv4 ID.
    icrcs: [[u8; ICRC_LEN]; BATCH],
    /// Packets in each message.
    counts: [usize; BATCH],
    /// Where each message's iovecs start.
    iov_starts: [usize; BATCH],
}

// SAFETY: the raw pointers in `TxArrays` (iovecs, names, control
// messages) are written by a `send_some` call before its `sendmmsg` and
// mean nothing after it; nothing reads them between calls, so moving the
// arrays to another thread moves no live borrow.
unsafe impl Send for TxArrays {}

impl std::fmt::Debug for TxArrays {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TxArrays")
    }
}

/// RoCEv2 packets through a UDP socket (send) and a packet socket
/// (receive).
#[derive(Debug)]
pub struct UdpIo {
    udp: OwnedFd,
    tx: Box<TxArrays>,
    rx: PacketRx,
    port: u16,
    gso: bool,
    counters: IoCounters,
}

impl UdpIo {
    /// Opens the sockets: UDP bound to `(bind, port)` (`bind` usually
    /// 0.0.0.0, `port` 4791), a packet socket receiving packets to `port`
    /// of this host. Needs `CAP_NET_RAW` (the packet socket), and must run
    /// before the sandbox. GSO is on.
    pub fn open(bind: Ipv4Addr, port: u16) -> io::Result<UdpIo> {
        let udp = socket(libc::AF_INET, libc::SOCK_DGRAM, libc::IPPROTO_UDP)?;
        // Before bind: nothing ever queues on the send socket.
        attach_filter(&udp, &bpf::drop_all())?;
        setsockopt_int(&udp, libc::SOL_UDP, UDP_GRO, 1)?;
        setsockopt_int(
            &udp,
            libc::IPPROTO_IP,
            libc::IP_MTU_DISCOVER,
            libc::IP_PMTUDISC_DO,
        )?;
        set_buffer(&udp, libc::SO_SNDBUFFORCE, libc::SO_SNDBUF)?;
        bind_to(&udp, bind, port)?;
        Self::adopt(udp, port)
    }

    /// Opens the packet socket and takes `udp`, the send socket set up and
    /// bound to `port` by [`UdpIo::open`] — in this process, or in a
    /// previous hostd that handed it over (the new one could not bind the
    /// port while the previous one holds it). Needs `CAP_NET_RAW`; before
    /// the sandbox.
    pub fn adopt(udp: OwnedFd, port: u16) -> io::Result<UdpIo> {
        Ok(UdpIo {
            udp,
            // SAFETY: all-zero is a valid value of these C structs and
            // plain arrays (null pointers, zero lengths).
            tx: Box::new(unsafe { std::mem::zeroed() }),
            rx: PacketRx::open(port)?,
            port,
            gso: true,
            counters: IoCounters::default(),
        })
    }

    /// A descriptor of the send socket, for a handover.
    pub fn send_socket(&self) -> io::Result<OwnedFd> {
        self.udp.try_clone()
    }

    /// Turns UDP GSO on or off (on after [`UdpIo::open`]). With GSO on, a
    /// run of packets with the same source, destination, TOS and length
    /// (the last one may be shorter) goes as one message, which the kernel
    /// or the NIC cuts into datagrams, or which reaches the receiver whole
    /// (over `lo`, a veth, a bridge) and is cut there; each datagram after
    /// the first gets the next IPv4 ID, so `UdpIo` sends its ICRC
    /// corrected for that ID (build every packet for ID 0 regardless).
    pub fn set_gso(&mut self, on: bool) {
        self.gso = on;
    }

    /// Whether runs go as GSO messages (false after the kernel refused).
    pub fn gso(&self) -> bool {
        self.gso
    }

    /// The send socket's fd (for tests and diagnostics; never readable).
    pub fn tx_fd(&self) -> RawFd {
        self.udp.as_raw_fd()
    }

    /// One `sendmmsg` of the first packets of `batch` (not empty): how
    /// many packets it is done with, or `None` when the queue is full.
    fn send_some(&mut self, batch: &[OutPacket]) -> Option<usize> {
        let TxArrays {
            msgs,
            iovs,
            addrs,
            cmsgs,
            icrcs,
            counts,
            iov_starts,
        } = &mut *self.tx;
        let (mut nmsgs, mut npkts, mut niovs) = (0usize, 0usize, 0usize);
        while nmsgs < BATCH && npkts < batch.len() && npkts < BATCH {
            let first = &batch[npkts];
            let run = if self.gso {
                gso_run(&batch[npkts..batch.len().min(BATCH)])
            } else {
                1
            };
            let iov_start = niovs;
            // The ICRC changes of the run's full-size segments, once.
            let deltas = (run > 1).then(|| IdDeltas::new(first.len, (run - 1) as u16));
            for (k, p) in batch[npkts..npkts + run].iter().enumerate() {
                let payload = p.payload();
                if k == 0 {
                    iovs[niovs] = iovec(payload);
                    niovs += 1;
                } else {
                    // Segment k leaves with IPv4 ID k (see `gso`).
                    let (body, icrc) = payload.split_at(payload.len() - ICRC_LEN);
                    let mut old = [0u8; ICRC_LEN];
                    old.copy_from_slice(icrc);
                    icrcs[npkts + k] = match &deltas {
                        Some(d) if p.len == first.len => d.icrc_for(old, k as u16),
                        // The run's last packet may be shorter.
                        _ => icrc_for_id(old, k as u16, payload.len()),
                    };
                    iovs[niovs] = iovec(body);
                    iovs[niovs + 1] = iovec(&icrcs[npkts + k]);
                    niovs += 2;
                }
            }
            addrs[nmsgs] = sockaddr(first.dst, super::ROCE_V2_PORT);
            let segment = (run > 1).then_some(first.len as u16);
            let hdr = &mut msgs[nmsgs].msg_hdr;
            hdr.msg_namelen = size_of::<libc::sockaddr_in>() as u32;
            hdr.msg_controllen = write_cmsgs(&mut cmsgs[nmsgs].0, first.src, first.tos, segment);
            iov_starts[nmsgs] = iov_start;
            hdr.msg_iovlen = niovs - iov_start;
            counts[nmsgs] = run;
            nmsgs += 1;
            npkts += run;
        }
        // The pointers, taken once the arrays are written.
        let (iov_base, addr_base) = (iovs.as_mut_ptr(), addrs.as_mut_ptr());
        let cmsg_base = cmsgs.as_mut_ptr();
        for (m, msg) in msgs.iter_mut().enumerate().take(nmsgs) {
            let hdr = &mut msg.msg_hdr;
            hdr.msg_iov = iov_base.wrapping_add(iov_starts[m]);
            hdr.msg_name = addr_base.wrapping_add(m).cast();
            hdr.msg_control = cmsg_base.wrapping_add(m).cast();
        }

        // SAFETY: every header points into the arrays above (names,
        // iovecs, control messages), which outlive the call, and the
        // iovecs into the batch's buffers within their lengths; the kernel
        // only reads them.
        let sent = unsafe {
            libc::sendmmsg(
                self.udp.as_raw_fd(),
                msgs.as_mut_ptr(),
                nmsgs as u32,
                libc::MSG_DONTWAIT,
            )
        };
        if sent >= 0 {
            let sent = sent as usize;
            let mut done = 0;
            for &count in counts.iter().take(sent) {
                for p in &batch[done..done + count] {
                    self.counters.sent_bytes += p.len as u64;
                }
                self.counters.sent_packets += count as u64;
                if count > 1 {
                    self.counters.gso_messages += 1;
                    self.counters.gso_packets += count as u64;
                }
                done += count;
            }
            // When fewer than all went, the next call meets the error.
            return Some(done);
        }
        let e = io::Error::last_os_error();
        let errno = e.raw_os_error().unwrap_or(0);
        match errno {
            libc::EINTR => Some(0),
            libc::EAGAIN => {
                self.counters.send_would_block += 1;
                None
            }
            libc::ENOBUFS => {
                self.counters.send_no_buffers += 1;
                None
            }
            libc::EIO | libc::EINVAL if counts[0] > 1 => {
                // The kernel cannot segment here (no checksum offload,
                // segment larger than the MTU, an old kernel): one
                // message per packet from now on.
                self.gso = false;
                self.counters.gso_fallbacks += 1;
                tracing::warn!(error = %e, "UDP GSO refused: sending a datagram per packet from now on");
                Some(0)
            }
            _ => {
                let dropped = counts[0] as u64;
                let counter = match errno {
                    libc::ENETUNREACH | libc::EHOSTUNREACH => &mut self.counters.send_unreachable,
                    libc::EMSGSIZE => &mut self.counters.send_too_big,
                    _ => &mut self.counters.send_other_errors,
                };
                *counter += dropped;
                tracing::debug!(error = %e, src = %batch[0].src, dst = %batch[0].dst, "packet dropped by the kernel");
                Some(counts[0])
            }
        }
    }
}

impl PacketIo for UdpIo {
    fn send(&mut self, batch: &[OutPacket]) -> io::Result<usize> {
        let mut done = 0;
        while done < batch.len() {
            match self.send_some(&batch[done..]) {
                Some(n) => done += n,
                None => break,
            }
        }
        Ok(done)
    }

    fn recv(&mut self, bufs: &mut [InPacket]) -> io::Result<usize> {
        self.rx.recv(bufs, &mut self.counters)
    }

    fn rx_fd(&self) -> RawFd {
        self.rx.fd()
    }

    fn src_port(&self) -> u16 {
        self.port
    }

    fn counters(&self) -> IoCounters {
        self.counters
    }
}

/// How many of `packets`' first ones (at least 1) can go as one GSO
/// message: same source, destination and TOS, all as long as the first
/// but the last (which may be shorter), within the kernel's limits.
fn gso_run(packets: &[OutPacket]) -> usize {
    let first = &packets[0];
    let size = first.len;
    if size <= ICRC_LEN || size > MAX_PACKET {
        return 1;
    }
    let limit = GSO_MAX_SEGMENTS.min(GSO_MAX_BYTES / size);
    let mut run = 1;
    for p in &packets[1..packets.len().min(limit)] {
        if p.src != first.src || p.dst != first.dst || p.tos != first.tos {
            break;
        }
        if p.len == size {
            run += 1;
        } else {
            if p.len > ICRC_LEN && p.len < size {
                run += 1;
            }
            break;
        }
    }
    run
}

fn iovec(bytes: &[u8]) -> libc::iovec {
    libc::iovec {
        // The kernel only reads a message to send.
        iov_base: bytes.as_ptr() as *mut c_void,
        iov_len: bytes.len(),
    }
}

fn sockaddr(addr: Ipv4Addr, port: u16) -> libc::sockaddr_in {
    libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: port.to_be(),
        sin_addr: libc::in_addr {
            s_addr: u32::from_ne_bytes(addr.octets()),
        },
        sin_zero: [0; 8],
    }
}

/// Writes one control message at `buf[at..]`; returns where the next goes.
fn put_cmsg(buf: &mut [u8], at: usize, level: c_int, kind: c_int, data: &[u8]) -> usize {
    const HDR: usize = size_of::<libc::cmsghdr>();
    const ALIGN: usize = size_of::<usize>();
    let len = HDR + data.len();
    buf[at..at + size_of::<usize>()].copy_from_slice(&len.to_ne_bytes());
    buf[at + 8..at + 12].copy_from_slice(&level.to_ne_bytes());
    buf[at + 12..at + 16].copy_from_slice(&kind.to_ne_bytes());
    buf[at + HDR..at + len].copy_from_slice(data);
    at + len.div_ceil(ALIGN) * ALIGN
}

/// A message's control messages: its source address (`IP_PKTINFO`'s
/// `ipi_spec_dst`), its TOS, its GSO segment size if any. Returns their
/// length.
fn write_cmsgs(buf: &mut [u8; CMSG_ROOM], src: Ipv4Addr, tos: u8, segment: Option<u16>) -> usize {
    // struct in_pktinfo { int ipi_ifindex; in_addr ipi_spec_dst; in_addr ipi_addr; }
    let mut pktinfo = [0u8; 12];
    pktinfo[4..8].copy_from_slice(&src.octets());
    let mut at = put_cmsg(buf, 0, libc::IPPROTO_IP, libc::IP_PKTINFO, &pktinfo);
    at = put_cmsg(
        buf,
        at,
        libc::IPPROTO_IP,
        libc::IP_TOS,
        &c_int::from(tos).to_ne_bytes(),
    );
    if let Some(size) = segment {
        at = put_cmsg(
            buf,
            at,
            libc::SOL_UDP,
            libc::UDP_SEGMENT,
            &size.to_ne_bytes(),
        );
    }
    at
}

/// A non-blocking socket.
pub(super) fn socket(domain: c_int, kind: c_int, protocol: c_int) -> io::Result<OwnedFd> {
    // SAFETY: plain system call, no pointers.
    let fd = unsafe {
        libc::socket(
            domain,
            kind | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
            protocol,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a descriptor just created, owned by nothing else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn setsockopt_bytes(
    fd: &OwnedFd,
    level: c_int,
    name: c_int,
    value: *const c_void,
    len: usize,
) -> io::Result<()> {
    // SAFETY: `value` points to `len` readable bytes (the callers pass a
    // reference and its size).
    let r = unsafe { libc::setsockopt(fd.as_raw_fd(), level, name, value, len as libc::socklen_t) };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

pub(super) fn setsockopt_int(
    fd: &OwnedFd,
    level: c_int,
    name: c_int,
    value: c_int,
) -> io::Result<()> {
    setsockopt_bytes(
        fd,
        level,
        name,
        (&value as *const c_int).cast(),
        size_of::<c_int>(),
    )
}

pub(super) fn attach_filter(fd: &OwnedFd, program: &[sock_filter]) -> io::Result<()> {
    let prog = libc::sock_fprog {
        len: program.len() as u16,
        filter: program.as_ptr() as *mut sock_filter,
    };
    setsockopt_bytes(
        fd,
        libc::SOL_SOCKET,
        libc::SO_ATTACH_FILTER,
        (&prog as *const libc::sock_fprog).cast(),
        size_of::<libc::sock_fprog>(),
    )
}

/// A big socket buffer: beyond `net.core.*mem_max` as root (`force`),
/// else as big as the limit allows.
pub(super) fn set_buffer(fd: &OwnedFd, force: c_int, plain: c_int) -> io::Result<()> {
    if setsockopt_int(fd, libc::SOL_SOCKET, force, SOCKET_BUFFER).is_ok() {
        return Ok(());
    }
    setsockopt_int(fd, libc::SOL_SOCKET, plain, SOCKET_BUFFER)
}

fn bind_to(fd: &OwnedFd, addr: Ipv4Addr, port: u16) -> io::Result<()> {
    let sa = sockaddr(addr, port);
    // SAFETY: `sa` is a sockaddr_in of the length given.
    let r = unsafe {
        libc::bind(
            fd.as_raw_fd(),
            (&sa as *const libc::sockaddr_in).cast(),
            size_of::<libc::sockaddr_in>() as libc::socklen_t,
        )
    };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn packet(src: [u8; 4], dst: [u8; 4], tos: u8, len: usize) -> OutPacket {
        let mut p = OutPacket::new();
        p.src = src.into();
        p.dst = dst.into();
        p.tos = tos;
        p.len = len;
        p
    }

    #[test]
    fn runs_join_equal_packets_and_end_at_a_shorter_one_or_a_change() {
        let a = [10, 0, 0, 1];
        let b = [10, 0, 0, 2];
        let same = |n: usize, len| (0..n).map(|_| packet(a, b, 0, len)).collect::<Vec<_>>();
        assert_eq!(gso_run(&same(5, 1000)), 5);
        let mut v = same(3, 1000);
        v.push(packet(a, b, 0, 500));
        v.push(packet(a, b, 0, 1000));
        assert_eq!(gso_run(&v), 4, "a shorter packet ends the run, in it");
        let mut v = same(2, 1000);
        v.push(packet(a, b, 0, 1500));
        assert_eq!(gso_run(&v), 2, "a longer packet starts the next");
        for other in [
            packet(b, b, 0, 1000),
            packet(a, a, 0, 1000),
            packet(a, b, 4, 1000),
        ] {
            let mut v = same(2, 1000);
            v.push(other);
            v.push(packet(a, b, 0, 1000));
            assert_eq!(gso_run(&v), 2);
        }
        assert_eq!(gso_run(&same(100, 100)), GSO_MAX_SEGMENTS);
        assert_eq!(gso_run(&same(100, 4000)), GSO_MAX_BYTES / 4000);
        assert_eq!(gso_run(&same(3, 4)), 1, "no room for an ICRC");
    }

    #[test]
    fn control_messages_are_laid_out_as_the_kernel_reads_them() {
        let mut buf = [0u8; CMSG_ROOM];
        let len = write_cmsgs(&mut buf, Ipv4Addr::new(10, 201, 0, 1), 0x2e, Some(1000));
        assert_eq!(len, CMSG_ROOM);
        // IP_PKTINFO: length 16 + 12, level, type, ifindex 0, spec_dst.
        assert_eq!(&buf[0..8], &28usize.to_ne_bytes());
        assert_eq!(&buf[8..12], &libc::IPPROTO_IP.to_ne_bytes());
        assert_eq!(&buf[12..16], &libc::IP_PKTINFO.to_ne_bytes());
        assert_eq!(&buf[16..24], &[0, 0, 0, 0, 10, 201, 0, 1]);
        // IP_TOS at 32.
        assert_eq!(&buf[32..40], &20usize.to_ne_bytes());
        assert_eq!(&buf[44..48], &libc::IP_TOS.to_ne_bytes());
        assert_eq!(&buf[48..52], &0x2e_i32.to_ne_bytes());
        // UDP_SEGMENT at 56.
        assert_eq!(&buf[56..64], &18usize.to_ne_bytes());
        assert_eq!(&buf[64..68], &libc::SOL_UDP.to_ne_bytes());
        assert_eq!(&buf[72..74], &1000u16.to_ne_bytes());
        let mut buf = [0u8; CMSG_ROOM];
        assert_eq!(write_cmsgs(&mut buf, Ipv4Addr::LOCALHOST, 0, None), 56);
    }
}
