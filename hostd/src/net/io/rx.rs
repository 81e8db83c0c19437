//! The receive queue of [`super::UdpIo`]: an `AF_PACKET` socket that hands
//! whole frames with a virtio-net header (`PACKET_VNET_HDR`), so that a
//! UDP GSO message that reached this host whole (over `lo`, a veth, a
//! bridge: nothing cut it) or a GRO aggregate of a NIC comes with its
//! segment size, and is cut here into the datagrams its sender built.
//!
//! Why not a raw IPv4 socket (which hostd used first): it hands the IPv4
//! packet the ICRC needs (the ID and flags a UDP socket does not report)
//! but not a GSO message's segment size, so one message of 15 RoCEv2
//! packets arrived as one unusable 60 KiB packet, and every sender had to
//! send a datagram per packet: a syscall's, an skb's and a softirq's cost
//! per 4 KiB where TCP pays them per 64 KiB.
//!
//! Segment `k` of a message is given the IPv4 header the kernel would
//! have given it had it cut the message: the message's, with the ID plus
//! `k` and the lengths of the segment (checksum recomputed), so its ICRC
//! checks exactly as if it had come alone (see `gso.rs` for the sender's
//! side). A packet socket sees frames before the IPv4 stack: its filter
//! keeps frames to this host (`PACKET_HOST`, not ones this host sends)
//! that are unfragmented IPv4 UDP to the RoCEv2 port, and everything a
//! frame claims (lengths, header, segment size) is checked here or by the
//! parser; Ethernet padding after a short datagram is cut off.

use std::io;
use std::mem::size_of;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};

use vrdma_roce::{write_ipv4_udp_header, Ipv4Meta, IPV4_HEADER_LEN, UDP_HEADER_LEN};

use super::udp::{attach_filter, set_buffer, setsockopt_int, socket};
use super::{bpf, InPacket, IoCounters, MAX_IN_PACKET};

/// Frames one `recvmmsg` takes at most.
const SLOTS: usize = 32;

/// `struct virtio_net_hdr` (without `num_buffers`), before every frame.
const VNET_HDR_LEN: usize = 10;

/// `virtio_net_hdr.gso_type` values (`linux/virtio_net.h`).
const GSO_NONE: u8 = 0;
const GSO_UDP_L4: u8 = 5;
/// The ECN bit that may accompany a GSO type.
const GSO_ECN: u8 = 0x80;

/// The longest link-layer header before the IPv4 header that hostd knows
/// (Ethernet's; `lo` has a zeroed one of the same length).
const MAX_L2_HEADER: usize = 14;

/// A slot: the virtio-net header, a link-layer header and the largest
/// IPv4 datagram.
const SLOT: usize = VNET_HDR_LEN + MAX_L2_HEADER + u16::MAX as usize + 1;

/// Headers in front of a segment's UDP payload.
const IP_UDP: usize = IPV4_HEADER_LEN + UDP_HEADER_LEN;

/// One frame received into a slot.
#[derive(Debug, Clone, Copy, Default)]
struct Frame {
    /// Bytes the kernel wrote into the slot (header and frame).
    len: usize,
    /// The link-layer header's length (from the device type).
    l2: usize,
}

/// The `recvmmsg` call's arrays, set up once (they point into the arena
/// and at each other, all on the heap, where nothing moves them): a call
/// then writes nothing but what the kernel overwrites.
struct Headers {
    msgs: [libc::mmsghdr; SLOTS],
    iovs: [libc::iovec; SLOTS],
    names: [libc::sockaddr_ll; SLOTS],
}

// SAFETY: the raw pointers in `Headers` point into memory owned by the
// same `PacketRx` (its arena and the boxed `Headers` itself), which moves
// between threads as a whole; they are only used by `recvmmsg` calls made
// through `&mut PacketRx`.
unsafe impl Send for Headers {}

impl std::fmt::Debug for Headers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Headers")
    }
}

/// Frames received and not yet handed out, with a cursor over their
/// datagrams.
#[derive(Debug)]
pub(super) struct PacketRx {
    fd: OwnedFd,
    /// `SLOTS` slots of `SLOT` bytes.
    arena: Vec<u8>,
    headers: Box<Headers>,
    frames: [Frame; SLOTS],
    /// Frames in `frames` from the last `recvmmsg`.
    filled: usize,
    /// The next frame to hand out, and the next segment within it.
    next: usize,
    segment: usize,
    /// `recvmmsg` calls since the kernel's drop counter was last read, and
    /// when that was.
    calls_since_stats: u32,
    stats_read: std::time::Instant,
}

/// The kernel's drop counter is read at least every this many receives...
const STATS_EVERY_CALLS: u32 = 4096;
/// ... and when the queue runs empty, if it was not read for this long.
const STATS_IDLE_EVERY: std::time::Duration = std::time::Duration::from_millis(10);

impl PacketRx {
    /// Opens the socket (needs `CAP_NET_RAW`; before the sandbox): every
    /// IPv4 frame to this host on any interface that the filter keeps.
    pub(super) fn open(port: u16) -> io::Result<PacketRx> {
        let proto = libc::c_int::from((libc::ETH_P_IP as u16).to_be());
        let fd = socket(libc::AF_PACKET, libc::SOCK_RAW, proto)?;
        attach_filter(&fd, &bpf::roce(port))?;
        setsockopt_int(&fd, libc::SOL_PACKET, libc::PACKET_VNET_HDR, 1)?;
        setsockopt_int(&fd, libc::SOL_PACKET, libc::PACKET_IGNORE_OUTGOING, 1)?;
        set_buffer(&fd, libc::SO_RCVBUFFORCE, libc::SO_RCVBUF)?;
        let mut arena = vec![0u8; SLOTS * SLOT];
        // SAFETY: all-zero is a valid value of these C structs (null
        // pointers, zero lengths).
        let mut headers: Box<Headers> = Box::new(unsafe { std::mem::zeroed() });
        let h = &mut *headers;
        for (i, slot) in arena.chunks_exact_mut(SLOT).enumerate() {
            h.iovs[i] = libc::iovec {
                iov_base: slot.as_mut_ptr().cast(),
                iov_len: SLOT,
            };
            let hdr = &mut h.msgs[i].msg_hdr;
            hdr.msg_iov = &mut h.iovs[i];
            hdr.msg_iovlen = 1;
            hdr.msg_name = (&mut h.names[i] as *mut libc::sockaddr_ll).cast();
        }
        let mut rx = PacketRx {
            fd,
            arena,
            headers,
            frames: [Frame::default(); SLOTS],
            filled: 0,
            next: 0,
            segment: 0,
            calls_since_stats: 0,
            stats_read: std::time::Instant::now(),
        };
        rx.drain_unfiltered()?;
        Ok(rx)
    }

    /// The socket's fd (readable when frames wait).
    pub(super) fn fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }

    /// Drops what the socket queued between its creation and its filter's
    /// attachment (any IPv4 frame).
    fn drain_unfiltered(&mut self) -> io::Result<()> {
        let mut scratch = [0u8; 64];
        loop {
            // SAFETY: the buffer is valid for its length; MSG_TRUNC only
            // reports the length of what is dropped.
            let r = unsafe {
                libc::recv(
                    self.fd.as_raw_fd(),
                    scratch.as_mut_ptr().cast(),
                    scratch.len(),
                    libc::MSG_DONTWAIT | libc::MSG_TRUNC,
                )
            };
            if r < 0 {
                let e = io::Error::last_os_error();
                return match e.kind() {
                    io::ErrorKind::WouldBlock => Ok(()),
                    io::ErrorKind::Interrupted => continue,
                    _ => Err(e),
                };
            }
        }
    }

    /// Fills `bufs` with datagrams, from frames already received first,
    /// then from one `recvmmsg` at a time while there is room and frames
    /// wait; returns how many buffers it filled.
    pub(super) fn recv(
        &mut self,
        bufs: &mut [InPacket],
        counters: &mut IoCounters,
    ) -> io::Result<usize> {
        let mut n = 0;
        loop {
            n += self.hand_out(&mut bufs[n..], counters);
            if n == bufs.len() {
                return Ok(n);
            }
            let got = self.receive()?;
            self.calls_since_stats += 1;
            if self.calls_since_stats >= STATS_EVERY_CALLS
                || (got == 0 && self.stats_read.elapsed() >= STATS_IDLE_EVERY)
            {
                counters.receive_kernel_drops += u64::from(self.kernel_drops());
            }
            if got == 0 {
                return Ok(n);
            }
        }
    }

    /// Frames the kernel dropped since the last call (its queue was full):
    /// `PACKET_STATISTICS`, which reading resets. 0 if it cannot say.
    fn kernel_drops(&mut self) -> u32 {
        self.calls_since_stats = 0;
        self.stats_read = std::time::Instant::now();
        let mut stats = libc::tpacket_stats {
            tp_packets: 0,
            tp_drops: 0,
        };
        let mut len = size_of::<libc::tpacket_stats>() as libc::socklen_t;
        // SAFETY: `stats` and `len` are live locals of the sizes the
        // kernel is told; it writes at most `len` bytes.
        let r = unsafe {
            libc::getsockopt(
                self.fd.as_raw_fd(),
                libc::SOL_PACKET,
                libc::PACKET_STATISTICS,
                (&mut stats as *mut libc::tpacket_stats).cast(),
                &mut len,
            )
        };
        if r == 0 {
            stats.tp_drops
        } else {
            0
        }
    }

    /// One `recvmmsg` into the arena (which [`PacketRx::hand_out`] has
    /// emptied); how many frames came.
    fn receive(&mut self) -> io::Result<usize> {
        let h = &mut *self.headers;
        for msg in &mut h.msgs {
            // The kernel wrote the last call's lengths here.
            msg.msg_hdr.msg_namelen = size_of::<libc::sockaddr_ll>() as u32;
        }
        let got = loop {
            // SAFETY: each header's iovec points into its own slot of the
            // arena, of the slot's length, and its name to its own
            // sockaddr_ll (set up in `open`; the arena and the boxed
            // headers never move); all outlive the call. No timeout.
            let r = unsafe {
                libc::recvmmsg(
                    self.fd.as_raw_fd(),
                    h.msgs.as_mut_ptr(),
                    SLOTS as u32,
                    libc::MSG_DONTWAIT,
                    std::ptr::null_mut(),
                )
            };
            if r >= 0 {
                break r as usize;
            }
            let e = io::Error::last_os_error();
            match e.kind() {
                io::ErrorKind::WouldBlock => break 0,
                io::ErrorKind::Interrupted => continue,
                _ => return Err(e),
            }
        };
        for ((frame, msg), name) in self.frames.iter_mut().zip(&h.msgs).zip(&h.names).take(got) {
            let truncated = msg.msg_hdr.msg_flags & libc::MSG_TRUNC != 0;
            *frame = Frame {
                // A truncated frame is handed out as too long to keep.
                len: if truncated {
                    usize::MAX
                } else {
                    msg.msg_len as usize
                },
                l2: match name.sll_hatype {
                    libc::ARPHRD_ETHER | libc::ARPHRD_LOOPBACK => MAX_L2_HEADER,
                    _ => 0,
                },
            };
        }
        self.filled = got;
        self.next = 0;
        self.segment = 0;
        Ok(got)
    }

    /// Copies datagrams of the frames received into `bufs`; how many.
    fn hand_out(&mut self, bufs: &mut [InPacket], counters: &mut IoCounters) -> usize {
        let mut n = 0;
        while n < bufs.len() && self.next < self.filled {
            let frame = self.frames[self.next];
            let slot = &self.arena[self.next * SLOT..(self.next + 1) * SLOT];
            match datagram(slot, frame, self.segment, &mut bufs[n]) {
                got @ (Datagram::Last | Datagram::More) => {
                    count(&bufs[n], counters);
                    n += 1;
                    let more = got == Datagram::More;
                    if more && self.segment == 0 {
                        counters.received_gso_messages += 1;
                    }
                    if more || self.segment > 0 {
                        counters.received_gso_packets += 1;
                    }
                    if more {
                        self.segment += 1;
                    } else {
                        self.next += 1;
                        self.segment = 0;
                    }
                }
                Datagram::Dropped => {
                    counters.receive_truncated += 1;
                    self.next += 1;
                    self.segment = 0;
                }
            }
        }
        n
    }
}

/// Counts a datagram handed out.
fn count(p: &InPacket, counters: &mut IoCounters) {
    counters.received_packets += 1;
    counters.received_bytes += p.len as u64;
}

/// What [`datagram`] did.
#[derive(Debug, PartialEq, Eq)]
enum Datagram {
    /// Wrote the frame's last (or only) datagram.
    Last,
    /// Wrote a segment of a GSO frame that has more.
    More,
    /// The frame cannot be handed out (longer than a slot or a buffer, a
    /// GSO type other than UDP's, a segment size of 0, headers too short
    /// to cut): counted as truncated and dropped. A frame with headers
    /// the parser would refuse is handed out whole, for the parser to
    /// refuse and count by its reason.
    Dropped,
}

/// Writes datagram `segment` of the frame in `slot` into `out`.
fn datagram(slot: &[u8], frame: Frame, segment: usize, out: &mut InPacket) -> Datagram {
    let Some(bytes) = slot.get(..frame.len) else {
        return Datagram::Dropped;
    };
    let Some((vnet, rest)) = bytes.split_first_chunk::<VNET_HDR_LEN>() else {
        return Datagram::Dropped;
    };
    let Some(ip) = rest.get(frame.l2..) else {
        return Datagram::Dropped;
    };
    // Ethernet pads a short frame: the IPv4 total length says where the
    // datagram ends (a total beyond the frame is the parser's to refuse).
    let total = ip
        .get(2..4)
        .map_or(0, |t| usize::from(u16::from_be_bytes([t[0], t[1]])));
    let ip = if total >= IP_UDP && total < ip.len() {
        &ip[..total]
    } else {
        ip
    };
    let gso_type = vnet[1] & !GSO_ECN;
    let gso_size = usize::from(u16::from_le_bytes([vnet[4], vnet[5]]));
    match gso_type {
        GSO_NONE => {
            if !copy_into(out, &[ip]) {
                return Datagram::Dropped;
            }
            Datagram::Last
        }
        GSO_UDP_L4 => cut(ip, gso_size, segment, out),
        _ => Datagram::Dropped,
    }
}

/// Writes segment `k` of a UDP GSO datagram `ip` with segments of
/// `size` bytes into `out`, with the headers it would have had alone.
fn cut(ip: &[u8], size: usize, k: usize, out: &mut InPacket) -> Datagram {
    let Some((headers, payload)) = ip.split_first_chunk::<IP_UDP>() else {
        return Datagram::Dropped;
    };
    // The parser refuses options; so must the cut (the UDP header would
    // be elsewhere).
    if size == 0 || headers[0] != 0x45 {
        return Datagram::Dropped;
    }
    let Some(start) = k.checked_mul(size).filter(|&s| s < payload.len()) else {
        return Datagram::Dropped;
    };
    let end = payload.len().min(start + size);
    let h = headers;
    let meta = Ipv4Meta {
        src: [h[12], h[13], h[14], h[15]].into(),
        dst: [h[16], h[17], h[18], h[19]].into(),
        // The kernel numbers segments from the message's ID.
        id: u16::from_be_bytes([h[4], h[5]]).wrapping_add(k as u16),
        flags_frag: u16::from_be_bytes([h[6], h[7]]),
        src_port: u16::from_be_bytes([h[20], h[21]]),
        dst_port: u16::from_be_bytes([h[22], h[23]]),
    };
    let mut header = [0u8; IP_UDP];
    if write_ipv4_udp_header(&mut header, &meta, h[1], h[8], end - start).is_err()
        || !copy_into(out, &[&header, &payload[start..end]])
    {
        return Datagram::Dropped;
    }
    if end == payload.len() {
        Datagram::Last
    } else {
        Datagram::More
    }
}

/// Copies `pieces` one after the other into `out`; false if they do not
/// fit.
fn copy_into(out: &mut InPacket, pieces: &[&[u8]]) -> bool {
    let len: usize = pieces.iter().map(|p| p.len()).sum();
    if len > MAX_IN_PACKET {
        return false;
    }
    let mut at = 0;
    for p in pieces {
        out.buf[at..at + p.len()].copy_from_slice(p);
        at += p.len();
    }
    out.len = len;
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A slot holding a virtio-net header, `l2` bytes of link header and
    /// an IPv4/UDP datagram with `payload`.
    fn slot(
        gso_type: u8,
        gso_size: u16,
        l2: usize,
        id: u16,
        payload: &[u8],
        pad: usize,
    ) -> Vec<u8> {
        let mut s = vec![0u8; VNET_HDR_LEN];
        s[1] = gso_type;
        s[4..6].copy_from_slice(&gso_size.to_le_bytes());
        s.extend(std::iter::repeat_n(0xee, l2));
        let meta = Ipv4Meta {
            src: [10, 0, 0, 1].into(),
            dst: [10, 0, 0, 2].into(),
            id,
            flags_frag: 0x4000,
            src_port: 4791,
            dst_port: 4791,
        };
        let mut h = [0u8; IP_UDP];
        write_ipv4_udp_header(&mut h, &meta, 0x48, 64, payload.len()).expect("header");
        s.extend_from_slice(&h);
        s.extend_from_slice(payload);
        s.extend(std::iter::repeat_n(0, pad));
        s
    }

    fn frame(s: &[u8], l2: usize) -> Frame {
        Frame { len: s.len(), l2 }
    }

    #[test]
    fn a_gso_frame_is_cut_into_datagrams_numbered_as_the_kernel_numbers_them() {
        let payload: Vec<u8> = (0..2500u32).map(|i| i as u8).collect();
        let s = slot(GSO_UDP_L4, 1000, 14, 0xfffe, &payload, 0);
        let mut out = InPacket::new();
        let mut got = Vec::new();
        for k in 0..3 {
            let r = datagram(&s, frame(&s, 14), k, &mut out);
            assert_eq!(
                r,
                if k < 2 {
                    Datagram::More
                } else {
                    Datagram::Last
                }
            );
            let (headers, udp) = out.packet().split_at(IP_UDP);
            // What the kernel writes for a datagram of its own (but the
            // UDP checksum, which the ICRC does not cover): the ID counts
            // on, the checksum is right for it.
            let own = slot(GSO_NONE, 0, 0, 0xfffe_u16.wrapping_add(k as u16), udp, 0);
            assert_eq!(
                headers,
                &own[VNET_HDR_LEN..VNET_HDR_LEN + IP_UDP],
                "segment {k}"
            );
            got.extend_from_slice(udp);
        }
        assert_eq!(got, payload);
        assert_eq!(datagram(&s, frame(&s, 14), 3, &mut out), Datagram::Dropped);
    }

    #[test]
    fn a_plain_frame_is_handed_out_whole_without_its_link_header_or_padding() {
        let s = slot(GSO_NONE, 0, 14, 7, &[1, 2, 3, 4], 10);
        let mut out = InPacket::new();
        assert_eq!(datagram(&s, frame(&s, 14), 0, &mut out), Datagram::Last);
        assert_eq!(out.len, IP_UDP + 4);
        assert_eq!(&out.packet()[IP_UDP..], &[1, 2, 3, 4]);
        // No link header (a tun device).
        let s = slot(GSO_NONE, 0, 0, 7, &[9; 40], 0);
        assert_eq!(datagram(&s, frame(&s, 0), 0, &mut out), Datagram::Last);
        assert_eq!(out.len, IP_UDP + 40);
    }

    #[test]
    fn frames_that_cannot_be_cut_or_kept_are_dropped() {
        let mut out = InPacket::new();
        let too_big = slot(GSO_NONE, 0, 14, 0, &vec![0; MAX_IN_PACKET], 0);
        assert_eq!(
            datagram(&too_big, frame(&too_big, 14), 0, &mut out),
            Datagram::Dropped
        );
        let tcp_gso = slot(1, 1000, 14, 0, &[0; 3000], 0);
        assert_eq!(
            datagram(&tcp_gso, frame(&tcp_gso, 14), 0, &mut out),
            Datagram::Dropped
        );
        let zero = slot(GSO_UDP_L4, 0, 14, 0, &[0; 3000], 0);
        assert_eq!(
            datagram(&zero, frame(&zero, 14), 0, &mut out),
            Datagram::Dropped
        );
        let big_segments = slot(GSO_UDP_L4, 5000, 14, 0, &[0; 9000], 0);
        assert_eq!(
            datagram(&big_segments, frame(&big_segments, 14), 0, &mut out),
            Datagram::Dropped
        );
        let truncated = Frame {
            len: usize::MAX,
            l2: 14,
        };
        assert_eq!(
            datagram(&too_big, truncated, 0, &mut out),
            Datagram::Dropped
        );
        let short = [0u8; 5];
        assert_eq!(
            datagram(&short, frame(&short, 14), 0, &mut out),
            Datagram::Dropped
        );
    }
}
