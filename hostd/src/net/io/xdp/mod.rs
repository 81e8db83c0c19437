//! [`XdpIo`]: RoCEv2 packets through AF_XDP sockets — hostd's own queues
//! of the host's interface, the kernel's network stack bypassed.
//!
//! - An XDP program (`prog`, attached by a bpf_link, so nothing stays on
//!   the interface once hostd is gone) steers unfragmented IPv4 UDP
//!   packets to the RoCEv2 port that fit a UMEM frame to hostd's XSK of
//!   their receive queue (one per queue, `xsk`); everything else goes on
//!   to the kernel.
//! - Sending: hostd writes each packet's Ethernet, IPv4 and UDP headers
//!   into a UMEM frame itself, the payload after them, and queues the
//!   frame. The next hop's MAC address comes from the kernel's routing and
//!   neighbor tables (`neigh`, rtnetlink, asked once per destination and
//!   again every second); until the kernel knows it — and for
//!   destinations routed through another interface — packets go through
//!   the kernel's UDP path ([`UdpIo`]), which makes the kernel resolve it.
//! - Receiving: from the XSKs, and from [`UdpIo`]'s packet socket for what
//!   the program leaves to the kernel (frames too long for a UMEM frame,
//!   such as the GSO aggregates of a peer on the UDP path; IPv4 options;
//!   packets of another interface), so both paths interoperate.
//!
//! The interface, the program, the sockets and the rings are set up
//! before hostd's sandbox; the datapath thread then only reads and writes
//! the rings and calls `sendto(MSG_DONTWAIT)` (a transmit kick, and the
//! neighbor questions) and `recvfrom(MSG_DONTWAIT)` (their answers).

pub mod iface;
pub mod neigh;
mod prog;
mod xsk;

use std::collections::HashMap;
use std::io;
use std::net::Ipv4Addr;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::time::{Duration, Instant};

use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};

use iface::Interface;
use neigh::{Neighbors, NextHop};
pub use prog::XdpMode;
use xsk::Xsk;

use super::{InPacket, IoCounters, OutPacket, PacketIo, UdpIo, MAX_IN_PACKET};

/// Ethernet, IPv4 and UDP headers before a RoCEv2 payload.
const ETH: usize = 14;
const HEADERS: usize = ETH + vrdma_roce::IPV4_HEADER_LEN + vrdma_roce::UDP_HEADER_LEN;
/// The IPv4 TTL of every packet sent (the kernel's default).
const TTL: u8 = 64;

/// How often a destination's next hop is asked again: a neighbor that
/// changed its MAC address (a migrated VM, a replaced NIC) is followed
/// within this.
const NEIGHBOR_REFRESH: Duration = Duration::from_secs(1);
/// How often a destination the kernel has no MAC for yet is asked again
/// (its packets go through the kernel meanwhile).
const UNRESOLVED_RETRY: Duration = Duration::from_millis(1);
/// The kernel's packet socket is read on every this many receive calls
/// that found the XSKs short of what was asked (it only carries the
/// exceptions, and a `recvmmsg` costs a system call) — and on every call
/// while it has packets (a bulk transfer of packets too long for a UMEM
/// frame, a peer on the UDP path).
const KERNEL_EVERY: u32 = 8;
/// The XSKs' drop counters are read at least every this many receive
/// calls, and when one finds nothing if they were not read for
/// [`STATS_IDLE_EVERY`].
const STATS_EVERY_CALLS: u32 = 4096;
const STATS_IDLE_EVERY: Duration = Duration::from_millis(10);

/// What hostd knows of one destination's next hop.
#[derive(Debug, Clone, Copy)]
struct Route {
    /// `None`: send through the kernel.
    mac: Option<[u8; 6]>,
    asked: Instant,
    /// Until when packets to it go through the kernel as GSO messages
    /// (see [`BULK_RUN`]).
    bulk_until: Option<Instant>,
}

/// In copy mode, a run of at least this many packets to one destination
/// in one send goes through the kernel's UDP path as GSO messages: an XSK
/// in copy mode makes a socket buffer per packet, the kernel one per 64
/// packets, and a burst is where that counts (measured: 64 B WRITEs on 8
/// QPs across a veth, docs/performance.md). Single packets keep the XSK's
/// shorter way.
const BULK_RUN: usize = 8;
/// How long a destination stays on the kernel's path after its last
/// packet went that way: packets to it return to the faster XSK only once
/// those sent before through the kernel have arrived, so that a QP's
/// packets are not reordered.
const BULK_HOLD: Duration = Duration::from_micros(500);

/// RoCEv2 packets through AF_XDP (see the module's documentation).
pub struct XdpIo {
    // Dropped in this order: the sockets, then the program.
    xsks: Vec<Xsk>,
    program: prog::Attached,
    kernel: UdpIo,
    neighbors: Neighbors,
    iface: Interface,
    routes: HashMap<Ipv4Addr, Route, foldhash::fast::RandomState>,
    /// The XSKs' fds and the packet socket's, for the datapath's epoll.
    epoll: Epoll,
    next_rx: usize,
    short_receives: u32,
    /// The last kernel read found packets: read it on every call.
    kernel_busy: bool,
    /// Whether any XSK copies (no zero copy): bursts then go through the
    /// kernel ([`BULK_RUN`]).
    copy_mode: bool,
    /// Each XSK's drop counters when last read, and when that was.
    stats: Vec<xsk::XskStats>,
    calls_since_stats: u32,
    stats_read: Instant,
    counters: XdpCounters,
}

impl std::fmt::Debug for XdpIo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("XdpIo")
            .field("interface", &self.iface.name)
            .field("mode", &self.program.mode())
            .field("queues", &self.xsks.len())
            .finish()
    }
}

/// What the AF_XDP side has done (the kernel side counts in [`UdpIo`]).
#[derive(Debug, Default, Clone, Copy)]
struct XdpCounters {
    sent_packets: u64,
    sent_bytes: u64,
    /// Sends stopped because every transmit frame was in the kernel's
    /// hands.
    tx_full: u64,
    /// Packets sent through the kernel for want of the next hop's MAC.
    kernel_sends: u64,
    received_packets: u64,
    received_bytes: u64,
    /// Frames dropped: shorter than their headers, not IPv4.
    received_invalid: u64,
}

impl XdpIo {
    /// Sets AF_XDP up on the interface that holds `host` (this host's
    /// address): the program in `mode` (`None`: generic XDP on a virtual
    /// interface, native on a real one), an XSK on every receive queue,
    /// and the kernel path beside it ([`UdpIo::open`] or `kernel`, a
    /// socket handed over). Needs `CAP_BPF`, `CAP_NET_ADMIN`,
    /// `CAP_NET_RAW` and `CAP_IPC_LOCK`; before the sandbox.
    pub fn open(host: Ipv4Addr, mode: Option<XdpMode>, kernel: UdpIo) -> io::Result<XdpIo> {
        let iface = iface::interface_of(host)?;
        let mode = mode.unwrap_or(if iface.virtual_device {
            XdpMode::Generic
        } else {
            XdpMode::Driver
        });
        let program = prog::Attached::load(iface.index, iface.rx_queues, xsk::MAX_FRAME, mode)
            .map_err(|e| {
                annotate(
                    e,
                    format!(
                        "loading and attaching the XDP program ({} XDP) on {}",
                        mode.name(),
                        iface.name
                    ),
                )
            })?;
        let mut xsks = Vec::with_capacity(iface.rx_queues as usize);
        for q in 0..iface.rx_queues {
            let x = Xsk::open(iface.index, q, mode).map_err(|e| {
                annotate(
                    e,
                    format!("an AF_XDP socket on queue {q} of {}", iface.name),
                )
            })?;
            program.set_socket(q, &x).map_err(|e| {
                annotate(
                    e,
                    format!("steering queue {q} of {} to its socket", iface.name),
                )
            })?;
            xsks.push(x);
        }
        let neighbors = Neighbors::open(iface.index)?;
        let epoll = epoll_over(xsks.iter().map(AsRawFd::as_raw_fd).chain([kernel.rx_fd()]))?;
        let stats = vec![xsk::XskStats::default(); xsks.len()];
        let copy_mode = !xsks.iter().all(Xsk::zero_copy);
        Ok(XdpIo {
            xsks,
            program,
            kernel,
            neighbors,
            iface,
            routes: HashMap::with_capacity_and_hasher(64, foldhash::fast::RandomState::default()),
            epoll,
            next_rx: 0,
            short_receives: 0,
            kernel_busy: false,
            copy_mode,
            stats,
            calls_since_stats: 0,
            stats_read: Instant::now(),
            counters: XdpCounters::default(),
        })
    }

    /// The interface, the XDP mode and whether the sockets copy, for
    /// hostd's log.
    pub fn describe(&self) -> String {
        format!(
            "{} ({} XDP, {} queue{}, {})",
            self.iface.name,
            self.program.mode().name(),
            self.xsks.len(),
            if self.xsks.len() == 1 { "" } else { "s" },
            if self.xsks.iter().all(Xsk::zero_copy) {
                "zero copy"
            } else {
                "copy mode"
            }
        )
    }

    /// The kernel path's send socket, for a handover.
    pub fn send_socket(&self) -> io::Result<OwnedFd> {
        self.kernel.send_socket()
    }

    /// The MAC address of `dst`'s next hop through the interface, `None`
    /// when packets to `dst` must go through the kernel.
    fn next_hop(&mut self, dst: Ipv4Addr, now: Instant) -> Option<[u8; 6]> {
        let mut bulk_until = None;
        if let Some(r) = self.routes.get(&dst) {
            bulk_until = r.bulk_until;
            let fresh = now.duration_since(r.asked)
                < if r.mac.is_some() {
                    NEIGHBOR_REFRESH
                } else {
                    UNRESOLVED_RETRY
                };
            if fresh {
                return r.mac;
            }
        }
        let mac = match self.neighbors.next_hop(dst) {
            Ok(NextHop::Mac(mac)) => Some(mac),
            Ok(NextHop::Unresolved | NextHop::Elsewhere) => None,
            Err(e) => {
                tracing::debug!(%dst, error = %e, "next hop not known: sending through the kernel");
                None
            }
        };
        self.routes.insert(
            dst,
            Route {
                mac,
                asked: now,
                bulk_until,
            },
        );
        mac
    }

    /// Whether `run` packets to `dst` (whose next hop is known) go through
    /// the kernel as a burst: a run of [`BULK_RUN`] or more starts or
    /// extends the hold, and anything within the hold goes the same way.
    /// Only in copy mode (zero copy has no socket buffer to save).
    fn bulk(&mut self, dst: Ipv4Addr, run: usize, now: Instant) -> bool {
        if !self.copy_mode {
            return false;
        }
        let Some(r) = self.routes.get_mut(&dst) else {
            return false;
        };
        if run >= BULK_RUN || r.bulk_until.is_some_and(|t| now < t) {
            r.bulk_until = Some(now + BULK_HOLD);
            return true;
        }
        false
    }

    /// Reads every XSK's drop counters (the kernel keeps their totals).
    fn read_stats(&mut self) {
        self.calls_since_stats = 0;
        self.stats_read = Instant::now();
        for (x, last) in self.xsks.iter().zip(self.stats.iter_mut()) {
            if let Some(s) = x.statistics() {
                *last = s;
            }
        }
    }

    /// Sends `batch` (all to the next hop `mac`, all fitting a frame) on
    /// the first XSK; how many it queued.
    fn send_xdp(&mut self, batch: &[OutPacket], mac: [u8; 6]) -> usize {
        let (src_mac, port) = (self.iface.mac, self.kernel.src_port());
        let Some(xsk) = self.xsks.first_mut() else {
            return 0;
        };
        let mut bytes = 0u64;
        let n = xsk.send(batch.len(), |i, frame| {
            let p = &batch[i];
            bytes += p.len as u64;
            write_frame(frame, p, &mac, &src_mac, port)
        });
        self.counters.sent_packets += n as u64;
        self.counters.sent_bytes += bytes;
        if n < batch.len() {
            self.counters.tx_full += 1;
        }
        n
    }
}

/// Whether `p` fits a UMEM frame with its headers. Longer packets (a
/// 4096-byte path MTU's) go through the kernel, and come back through it
/// too (the XDP program passes them on).
fn fits(p: &OutPacket) -> bool {
    HEADERS + p.len <= xsk::FRAME_SIZE as usize
}

/// Adds what was being done to an error, keeping its kind.
fn annotate(e: io::Error, what: String) -> io::Error {
    io::Error::new(e.kind(), format!("{what}: {e}"))
}

/// Writes `p` as an Ethernet frame into `frame` (at least [`HEADERS`] +
/// `p.len` bytes: a UMEM frame); returns its length, 0 if it does not
/// fit. The IPv4 and UDP headers are `vrdma_roce`'s (ID 0 and DF, as the
/// engine computed the ICRC for; no UDP checksum: RoCEv2 relies on the
/// ICRC, and IPv4 allows 0).
fn write_frame(
    frame: &mut [u8],
    p: &OutPacket,
    dst_mac: &[u8; 6],
    src_mac: &[u8; 6],
    port: u16,
) -> usize {
    let payload = p.payload();
    let total = HEADERS + payload.len();
    if frame.len() < total {
        return 0;
    }
    frame[0..6].copy_from_slice(dst_mac);
    frame[6..12].copy_from_slice(src_mac);
    frame[12..14].copy_from_slice(&0x0800u16.to_be_bytes());
    let ip = vrdma_roce::Ipv4Meta::outgoing(p.src, p.dst, port);
    if vrdma_roce::write_ipv4_udp_header(&mut frame[ETH..], &ip, p.tos, TTL, payload.len()).is_err()
    {
        return 0;
    }
    frame[HEADERS..total].copy_from_slice(payload);
    total
}

/// An epoll set over `fds` (readable when any is).
fn epoll_over(fds: impl Iterator<Item = RawFd>) -> io::Result<Epoll> {
    let epoll = Epoll::new()?;
    for fd in fds {
        epoll.ctl(
            ControlOperation::Add,
            fd,
            EpollEvent::new(EventSet::IN, fd as u64),
        )?;
    }
    Ok(epoll)
}

impl PacketIo for XdpIo {
    fn send(&mut self, batch: &[OutPacket]) -> io::Result<usize> {
        // One clock read per call ages the routes and times the holds.
        let now = Instant::now();
        let mut done = 0;
        while done < batch.len() {
            // The packets from `done` to the same destination, then those
            // of them that go the same way: the XSK (known next hop, fits
            // a frame, no burst) or the kernel.
            let dst = batch[done].dst;
            let same = batch[done..].iter().take_while(|p| p.dst == dst).count();
            let hop = self.next_hop(dst, now);
            let to_xsk = |p: &OutPacket| fits(p);
            let (run, xsk) = match hop {
                Some(mac) if !self.bulk(dst, same, now) => {
                    let first = to_xsk(&batch[done]);
                    let run = batch[done..done + same]
                        .iter()
                        .take_while(|p| to_xsk(p) == first)
                        .count();
                    (run, first.then_some(mac))
                }
                _ => (same, None),
            };
            let part = &batch[done..done + run];
            let sent = match xsk {
                Some(mac) => self.send_xdp(part, mac),
                None => {
                    let n = self.kernel.send(part)?;
                    self.counters.kernel_sends += n as u64;
                    n
                }
            };
            done += sent;
            if sent < run {
                break;
            }
        }
        Ok(done)
    }

    fn recv(&mut self, bufs: &mut [InPacket]) -> io::Result<usize> {
        let mut got = 0;
        let queues = self.xsks.len();
        for k in 0..queues {
            if got == bufs.len() {
                break;
            }
            let q = (self.next_rx + k) % queues;
            let (rest, counters) = (&mut bufs[got..], &mut self.counters);
            let mut i = 0;
            self.xsks[q].receive(rest.len(), |frame| {
                if frame.len() < ETH + 20
                    || frame[12..14] != [0x08, 0x00]
                    || frame.len() - ETH > MAX_IN_PACKET
                {
                    counters.received_invalid += 1;
                    return;
                }
                let ip = &frame[ETH..];
                let out = &mut rest[i];
                out.buf[..ip.len()].copy_from_slice(ip);
                out.len = ip.len();
                counters.received_packets += 1;
                counters.received_bytes += ip.len() as u64;
                i += 1;
            });
            self.xsks[q].reap();
            got += i;
        }
        self.next_rx = (self.next_rx + 1) % queues.max(1);
        if got < bufs.len() {
            self.short_receives += 1;
            if self.kernel_busy || self.short_receives >= KERNEL_EVERY {
                self.short_receives = 0;
                let n = self.kernel.recv(&mut bufs[got..])?;
                self.kernel_busy = n > 0;
                got += n;
            }
        }
        self.calls_since_stats += 1;
        if self.calls_since_stats >= STATS_EVERY_CALLS
            || (got == 0 && self.stats_read.elapsed() >= STATS_IDLE_EVERY)
        {
            self.read_stats();
        }
        Ok(got)
    }

    fn rx_fd(&self) -> RawFd {
        self.epoll.as_raw_fd()
    }

    fn src_port(&self) -> u16 {
        self.kernel.src_port()
    }

    fn counters(&self) -> IoCounters {
        let mut c = self.kernel.counters();
        let x = &self.counters;
        c.sent_packets += x.sent_packets;
        c.sent_bytes += x.sent_bytes;
        c.received_packets += x.received_packets;
        c.received_bytes += x.received_bytes;
        c.xdp_sent_packets = x.sent_packets;
        c.xdp_received_packets = x.received_packets;
        c.xdp_tx_full = x.tx_full;
        c.xdp_kernel_sends = x.kernel_sends;
        c.xdp_received_invalid = x.received_invalid;
        for s in &self.stats {
            c.xdp_rx_dropped += s.rx_dropped;
            c.xdp_rx_ring_full += s.rx_ring_full;
            c.xdp_fill_ring_empty += s.rx_fill_ring_empty_descs;
        }
        c
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_frame_carries_the_headers_the_engine_computed_the_icrc_for() {
        let mut p = OutPacket::new();
        p.src = Ipv4Addr::new(10, 0, 0, 1);
        p.dst = Ipv4Addr::new(10, 0, 0, 2);
        p.tos = 0x68;
        p.len = 5;
        p.buf[..5].copy_from_slice(b"hello");
        let mut frame = vec![0u8; 4096];
        let n = write_frame(
            &mut frame,
            &p,
            &[2, 0, 0, 0, 0, 2],
            &[2, 0, 0, 0, 0, 1],
            4791,
        );
        assert_eq!(n, HEADERS + 5);
        assert_eq!(&frame[0..12], &[2, 0, 0, 0, 0, 2, 2, 0, 0, 0, 0, 1]);
        assert_eq!(&frame[12..14], &[0x08, 0x00]);
        let ip = &frame[ETH..ETH + 20];
        assert_eq!(ip[0], 0x45);
        assert_eq!(ip[1], 0x68);
        assert_eq!(u16::from_be_bytes([ip[2], ip[3]]), 33);
        assert_eq!(&ip[4..8], &[0, 0, 0x40, 0]);
        assert_eq!(ip[9], 17);
        // A header with its checksum in sums to 0xffff.
        let mut sum: u32 = ip
            .chunks_exact(2)
            .map(|w| u32::from(u16::from_be_bytes([w[0], w[1]])))
            .sum();
        while sum > 0xffff {
            sum = (sum & 0xffff) + (sum >> 16);
        }
        assert_eq!(sum, 0xffff);
        assert_eq!(&ip[12..20], &[10, 0, 0, 1, 10, 0, 0, 2]);
        let udp = &frame[ETH + 20..HEADERS];
        assert_eq!(udp, &[0x12, 0xb7, 0x12, 0xb7, 0, 13, 0, 0]);
        assert_eq!(&frame[HEADERS..n], b"hello");
    }

    #[test]
    fn a_frame_that_does_not_fit_is_not_written() {
        let mut p = OutPacket::new();
        p.len = 100;
        let mut frame = vec![0u8; HEADERS + 99];
        assert_eq!(write_frame(&mut frame, &p, &[0; 6], &[0; 6], 4791), 0);
    }
}
