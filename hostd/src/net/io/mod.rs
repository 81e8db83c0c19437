//! Packet I/O: the physical queues hostd sends and receives RoCEv2 packets
//! through. The engine builds whole UDP payloads (BTH … ICRC, see the
//! `vrdma-roce` crate) into [`OutPacket`]s and parses whole IPv4 packets
//! from [`InPacket`]s; what lies between is a [`PacketIo`].
//!
//! [`UdpIo`] is the kernel's network stack: one UDP socket sends (the
//! source address of each packet chosen per packet, so that every device
//! sends from its own GID; runs of packets as one UDP GSO message), one
//! packet socket receives (because the ICRC covers the IPv4 ID and flags,
//! which a UDP socket does not report, and a GSO message's segment size
//! comes with it).

mod bpf;
mod gso;
mod rx;
mod udp;
mod xdp;

use std::io;
use std::net::Ipv4Addr;
use std::os::fd::RawFd;

use serde::{Deserialize, Serialize};

pub use udp::UdpIo;
pub use xdp::{XdpIo, XdpMode};

/// The UDP port of RoCEv2.
pub const ROCE_V2_PORT: u16 = 4791;

/// The largest UDP payload hostd sends: a 4096-byte MTU's payload, the
/// headers before it and the ICRC.
pub const MAX_PACKET: usize = 4096 + 128;

/// The room of a receive buffer: [`MAX_PACKET`] and the IPv4 and UDP
/// headers before it, with some to spare (a longer packet is truncated,
/// counted and dropped).
pub const MAX_IN_PACKET: usize = MAX_PACKET + 64;

/// A packet to send: its UDP payload (BTH … ICRC, built with `Ipv4Meta {
/// id: 0, flags_frag: 0x4000 (DF), src_port: io.src_port(), dst_port: 4791
/// }`), its source GID address (an address of this host), its destination
/// address and its IP TOS (the traffic class).
pub struct OutPacket {
    /// The IPv4 source: the sending device's GID, a local address.
    pub src: Ipv4Addr,
    /// The IPv4 destination: the receiving device's GID.
    pub dst: Ipv4Addr,
    /// The IPv4 TOS byte (DSCP and ECN): the traffic class.
    pub tos: u8,
    /// How many bytes of `buf` are the UDP payload.
    pub len: usize,
    /// The UDP payload in its first `len` bytes.
    pub buf: Box<[u8; MAX_PACKET]>,
}

impl OutPacket {
    /// An empty packet (zero length, unspecified addresses), its buffer
    /// allocated on the heap only (never on the stack).
    pub fn new() -> OutPacket {
        OutPacket {
            src: Ipv4Addr::UNSPECIFIED,
            dst: Ipv4Addr::UNSPECIFIED,
            tos: 0,
            len: 0,
            buf: zeroed_box(),
        }
    }

    /// The UDP payload.
    pub fn payload(&self) -> &[u8] {
        &self.buf[..self.len.min(MAX_PACKET)]
    }
}

impl Default for OutPacket {
    fn default() -> Self {
        OutPacket::new()
    }
}

/// A received IPv4 packet, whole: from its IPv4 header to the ICRC.
pub struct InPacket {
    /// How many bytes of `buf` the packet is.
    pub len: usize,
    /// The packet in its first `len` bytes.
    pub buf: Box<[u8; MAX_IN_PACKET]>,
}

impl InPacket {
    /// Asks the CPU to bring the packet's headers close, ahead of parsing
    /// it: a hint that changes nothing a reader sees.
    pub fn prefetch(&self) {
        crate::cpu::prefetch(self.buf.as_ptr());
    }

    /// An empty receive buffer, allocated on the heap only.
    pub fn new() -> InPacket {
        InPacket {
            len: 0,
            buf: zeroed_box(),
        }
    }

    /// The packet received.
    pub fn packet(&self) -> &[u8] {
        &self.buf[..self.len.min(MAX_IN_PACKET)]
    }
}

impl Default for InPacket {
    fn default() -> Self {
        InPacket::new()
    }
}

/// A zeroed `N`-byte array on the heap, without building it on the stack
/// first (4 KiB arrays by the thousand would be copied through it).
fn zeroed_box<const N: usize>() -> Box<[u8; N]> {
    match vec![0u8; N].into_boxed_slice().try_into() {
        Ok(b) => b,
        Err(_) => unreachable!("a vector of N bytes is an array of N bytes"),
    }
}

/// What a [`PacketIo`] has done, as plain counters (`vrdmactl stats
/// --json` and the `vrdma_packet_io_*` metrics show them). They only grow.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct IoCounters {
    /// Packets handed to the kernel.
    pub sent_packets: u64,
    /// Their UDP payload bytes.
    pub sent_bytes: u64,
    /// Sends stopped because the socket's buffer was full (EAGAIN): the
    /// packets stay with the caller.
    pub send_would_block: u64,
    /// Sends stopped because the device queue was full (ENOBUFS): the
    /// packets stay with the caller.
    pub send_no_buffers: u64,
    /// Packets dropped because no route leads to their destination, or
    /// because their source is not an address of this host (a GID not
    /// configured): Linux answers both with ENETUNREACH (EHOSTUNREACH too).
    pub send_unreachable: u64,
    /// Packets dropped because they exceed the path MTU (EMSGSIZE).
    pub send_too_big: u64,
    /// Packets dropped for any other error (EPERM from a firewall, …).
    pub send_other_errors: u64,
    /// Messages sent with UDP GSO (each carrying several packets).
    pub gso_messages: u64,
    /// Packets sent inside them.
    pub gso_packets: u64,
    /// Times the kernel refused GSO (EIO, EINVAL) and sending fell back
    /// to one message per packet for good.
    pub gso_fallbacks: u64,
    /// Packets received.
    pub received_packets: u64,
    /// Their bytes (whole IPv4 packets).
    pub received_bytes: u64,
    /// GSO messages (or a NIC's GRO aggregates) received whole and cut
    /// into their datagrams here.
    pub received_gso_messages: u64,
    /// The datagrams cut from them (counted in `received_packets` too).
    pub received_gso_packets: u64,
    /// Frames dropped because they could not be kept or cut: longer than
    /// a receive buffer, a GSO type other than UDP's, a bad segment size.
    pub receive_truncated: u64,
    /// Frames the kernel dropped before hostd could take them: its receive
    /// queue was full (the packet socket's `PACKET_STATISTICS`, read every
    /// few thousand receives and when the queue runs empty).
    #[serde(default)]
    pub receive_kernel_drops: u64,
    /// Packets sent through AF_XDP ([`XdpIo`]; counted in `sent_packets`
    /// too).
    #[serde(default)]
    pub xdp_sent_packets: u64,
    /// Packets received through AF_XDP (counted in `received_packets`
    /// too).
    #[serde(default)]
    pub xdp_received_packets: u64,
    /// AF_XDP sends stopped because every transmit frame was still the
    /// kernel's: the packets stay with the caller.
    #[serde(default)]
    pub xdp_tx_full: u64,
    /// Packets sent through the kernel's UDP path instead of AF_XDP: the
    /// next hop's MAC was not known yet, or the route leaves through
    /// another interface.
    #[serde(default)]
    pub xdp_kernel_sends: u64,
    /// Frames from the XSKs dropped as malformed.
    #[serde(default)]
    pub xdp_received_invalid: u64,
    /// Frames the kernel dropped on the XSKs (`XDP_STATISTICS`, read every
    /// few thousand receives and when they run empty): too long, …
    #[serde(default)]
    pub xdp_rx_dropped: u64,
    /// … because a receive ring was full (hostd did not keep up) …
    #[serde(default)]
    pub xdp_rx_ring_full: u64,
    /// … or for want of a fill frame.
    #[serde(default)]
    pub xdp_fill_ring_empty: u64,
}

impl IoCounters {
    /// Every counter by name (the metrics' names end in them).
    pub fn named(&self) -> [(&'static str, u64); 24] {
        [
            ("sent_packets", self.sent_packets),
            ("sent_bytes", self.sent_bytes),
            ("send_would_block", self.send_would_block),
            ("send_no_buffers", self.send_no_buffers),
            ("send_unreachable", self.send_unreachable),
            ("send_too_big", self.send_too_big),
            ("send_other_errors", self.send_other_errors),
            ("gso_messages", self.gso_messages),
            ("gso_packets", self.gso_packets),
            ("gso_fallbacks", self.gso_fallbacks),
            ("received_packets", self.received_packets),
            ("received_bytes", self.received_bytes),
            ("received_gso_messages", self.received_gso_messages),
            ("received_gso_packets", self.received_gso_packets),
            ("receive_truncated", self.receive_truncated),
            ("receive_kernel_drops", self.receive_kernel_drops),
            ("xdp_sent_packets", self.xdp_sent_packets),
            ("xdp_received_packets", self.xdp_received_packets),
            ("xdp_tx_full", self.xdp_tx_full),
            ("xdp_kernel_sends", self.xdp_kernel_sends),
            ("xdp_received_invalid", self.xdp_received_invalid),
            ("xdp_rx_dropped", self.xdp_rx_dropped),
            ("xdp_rx_ring_full", self.xdp_rx_ring_full),
            ("xdp_fill_ring_empty", self.xdp_fill_ring_empty),
        ]
    }
}

/// The queues hostd sends and receives RoCEv2 packets through.
pub trait PacketIo: Send {
    /// Sends what it can of `batch`, in order, and returns how many of its
    /// first packets it is done with: sent, or dropped because the kernel
    /// refused them for good (no route, a source not of this host, too big;
    /// counted, as a NIC drops them). The rest could not be sent now (the
    /// socket's or the device's queue is full): try again later. Never
    /// blocks.
    fn send(&mut self, batch: &[OutPacket]) -> io::Result<usize>;

    /// Receives up to `bufs.len()` packets without blocking into the first
    /// buffers of `bufs`; returns how many (0 when none waits).
    fn recv(&mut self, bufs: &mut [InPacket]) -> io::Result<usize>;

    /// An fd readable when packets wait in the kernel (for the datapath's
    /// epoll). Packets `recv` already took from the kernel but could not
    /// hand out (more than the buffers given) do not make it readable:
    /// call `recv` until it returns fewer than asked before waiting.
    fn rx_fd(&self) -> RawFd;

    /// The UDP source port to put in `Ipv4Meta` for packets it sends.
    fn src_port(&self) -> u16;

    /// What it has done so far.
    fn counters(&self) -> IoCounters;
}
