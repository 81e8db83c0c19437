//! RC, UC and UD service between a QP of this host and one on another
//! host, as RoCEv2 packets: hostd is the NIC's transport. [`requester`]
//! puts RC and UC send WQEs on the wire (RC's complete when answered,
//! UC's when sent); [`responder`] takes RC request packets in PSN order,
//! [`uc`] UC ones (no acknowledgements: a gap drops the message it
//! interrupts); [`datagram`] sends and receives UD. This module owns the
//! packet queues (the [`PacketIo`] a NIC's physical queues stand for),
//! receives and dispatches, and keeps the per-peer counters.
//!
//! A packet is accepted only if it parses (ICRC included), its source is
//! a GID the directory knows, it is addressed to a GID of a device here
//! and names a QP of that device of the packet's transport, which is
//! connected to exactly the packet's source GID (RC, UC) or whose
//! tenant may reach the source's network (UD). Tenants never build packets: hostd does, from WQEs it
//! checked.

mod closed;
mod datagram;
mod peers;
mod requester;
mod responder;
pub mod state;
mod uc;

use std::net::Ipv4Addr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use vrdma_roce::{Bth, Headers, Ipv4Meta, Psn};
use vrdma_spec::verbs::QpType;

use crate::net::directory::Directory;
use crate::net::io::{InPacket, OutPacket, PacketIo};
pub use peers::{PeerStats, Peers};
use state::{Path, RemoteQp};

use super::rc::QpRef;
use super::Engine;

/// Packets queued for sending before the queue is handed to the kernel.
pub const TX_BATCH: usize = 64;
/// Places of the send queue only QP1's MADs may take (`Wire::emit_control`).
const CONTROL_RESERVE: usize = 8;
/// Packets received per call.
pub const RX_BATCH: usize = 64;
/// Receive calls per round at most (then the round does other work).
const RX_CALLS: usize = 8;
/// The AETH credit code for "no credit information" (IBA 9.7.5.1.3).
pub const NO_CREDITS: u8 = 31;
/// The default P_Key, the only one vrdma's port has.
pub use vrdma_roce::DEFAULT_PKEY;

/// RC opcodes (IBA table 37: transport RC is 000).
pub mod op {
    use vrdma_roce::Opcode;

    pub const SEND_FIRST: u8 = 0x00;
    pub const SEND_MIDDLE: u8 = 0x01;
    pub const SEND_LAST: u8 = 0x02;
    pub const SEND_LAST_IMM: u8 = 0x03;
    pub const SEND_ONLY: u8 = 0x04;
    pub const SEND_ONLY_IMM: u8 = 0x05;
    pub const WRITE_FIRST: u8 = 0x06;
    pub const WRITE_MIDDLE: u8 = 0x07;
    pub const WRITE_LAST: u8 = 0x08;
    pub const WRITE_LAST_IMM: u8 = 0x09;
    pub const WRITE_ONLY: u8 = 0x0a;
    pub const WRITE_ONLY_IMM: u8 = 0x0b;
    pub const READ_REQUEST: u8 = 0x0c;
    pub const READ_RESPONSE_FIRST: u8 = 0x0d;
    pub const READ_RESPONSE_MIDDLE: u8 = 0x0e;
    pub const READ_RESPONSE_LAST: u8 = 0x0f;
    pub const READ_RESPONSE_ONLY: u8 = 0x10;
    pub const ACK: u8 = 0x11;
    pub const ATOMIC_ACK: u8 = 0x12;
    pub const CMP_SWAP: u8 = 0x13;
    pub const FETCH_ADD: u8 = 0x14;
    /// What UC's opcodes add to RC's (IBA table 37: transport 001).
    pub const UC: u8 = 0x20;
    /// The transport bits of an opcode.
    pub const TRANSPORT: u8 = 0xe0;
    /// UD's SEND ONLY, without and with immediate (transport 011).
    pub const UD_SEND_ONLY: u8 = 0x64;
    pub const UD_SEND_ONLY_IMM: u8 = 0x65;

    /// Whether `code` (an RC or UC operation) starts a message.
    pub fn is_first_or_only(code: u8) -> bool {
        matches!(
            code,
            SEND_FIRST | SEND_ONLY | SEND_ONLY_IMM | WRITE_FIRST | WRITE_ONLY | WRITE_ONLY_IMM
        )
    }

    /// The opcode of `code` (one of the constants above, or an RC one
    /// plus [`UC`]).
    pub fn opcode(code: u8) -> Opcode {
        Opcode::from_u8(code).unwrap_or(Opcode::RcSendOnly)
    }

    pub fn is_send(code: u8) -> bool {
        code <= SEND_ONLY_IMM
    }

    pub fn is_write(code: u8) -> bool {
        (WRITE_FIRST..=WRITE_ONLY_IMM).contains(&code)
    }

    pub fn is_send_or_write(code: u8) -> bool {
        code <= WRITE_ONLY_IMM
    }

    /// A request the requester sends (the rest are responses).
    pub fn is_request(code: u8) -> bool {
        code <= READ_REQUEST || code == CMP_SWAP || code == FETCH_ADD
    }

    pub fn is_middle_or_last(code: u8) -> bool {
        matches!(
            code,
            SEND_MIDDLE | SEND_LAST | SEND_LAST_IMM | WRITE_MIDDLE | WRITE_LAST | WRITE_LAST_IMM
        )
    }

    pub fn is_first_or_middle(code: u8) -> bool {
        matches!(code, SEND_FIRST | SEND_MIDDLE | WRITE_FIRST | WRITE_MIDDLE)
    }

    pub fn is_last_or_only(code: u8) -> bool {
        matches!(
            code,
            SEND_LAST
                | SEND_LAST_IMM
                | SEND_ONLY
                | SEND_ONLY_IMM
                | WRITE_LAST
                | WRITE_LAST_IMM
                | WRITE_ONLY
                | WRITE_ONLY_IMM
        )
    }
}

/// A BTH with vrdma's constant fields.
pub fn bth(code: u8, dest_qp: u32, psn: Psn) -> Bth {
    Bth {
        opcode: op::opcode(code),
        solicited: false,
        migreq: true,
        pad: 0,
        pkey: DEFAULT_PKEY,
        fecn: false,
        becn: false,
        dest_qp,
        ack_req: false,
        psn,
    }
}

/// Headers of a packet with `bth` and no extension header yet.
pub fn headers(bth: Bth) -> Headers {
    Headers::new(bth)
}

/// What queueing a packet came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Emit {
    Sent,
    /// The packet queue is full (the kernel's too): try again later.
    Full,
    /// Its payload could not be read from local memory.
    LocalError,
}

/// The engine's network side: the packet queues, the directory, the
/// counters and which QPs have transport work.
pub struct Wire {
    io: Box<dyn PacketIo>,
    directory: Arc<dyn Directory>,
    tx: Vec<OutPacket>,
    tx_len: usize,
    rx: Vec<InPacket>,
    /// QPs with packets to send, responses owed or timers running.
    active: Vec<QpRef>,
    /// QPs owing a coalesced acknowledgement.
    acks: Vec<QpRef>,
    /// Destroyed RC QPs that still acknowledge what they took.
    closed: closed::ClosedQps,
    pub peers: Peers,
    /// The UD QP the last datagram went to: (destination GID, QP number)
    /// → its ref and serial. A GSO message's datagrams go to one QP, so
    /// this spares most datagrams the GID, device and QP lookups; a QP
    /// destroyed since has another serial (or none) and misses.
    last_ud: Option<(Ipv4Addr, u32, QpRef, u64)>,
    /// A datapath round is running: only then may a full queue be handed
    /// to the kernel from `emit`. The packet queues' system calls are the
    /// datapath threads' (their seccomp role); a request a vdev's
    /// connection thread runs (a MAD, a QP flushed) meets a full queue
    /// with `Emit::Full` instead.
    pub(crate) in_round: bool,
}

impl std::fmt::Debug for Wire {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Wire")
            .field("active", &self.active.len())
            .finish_non_exhaustive()
    }
}

impl Wire {
    /// The wire over `io`, accepting peers `directory` knows.
    pub fn new(io: Box<dyn PacketIo>, directory: Arc<dyn Directory>) -> Self {
        Wire {
            io,
            directory,
            tx: (0..TX_BATCH).map(|_| OutPacket::default()).collect(),
            tx_len: 0,
            rx: (0..RX_BATCH).map(|_| InPacket::default()).collect(),
            active: Vec::new(),
            acks: Vec::new(),
            closed: closed::ClosedQps::default(),
            peers: Peers::default(),
            last_ud: None,
            in_round: false,
        }
    }

    /// The fd the datapath sleeps on for packets.
    pub fn rx_fd(&self) -> std::os::fd::RawFd {
        self.io.rx_fd()
    }

    /// What the packet queues have done.
    pub fn io_counters(&self) -> crate::net::io::IoCounters {
        self.io.counters()
    }

    /// Queues a packet with headers `h` and `len` payload bytes written by
    /// `fill` (false: the local memory failed), for `path`. The transport's
    /// packets leave the queue's last [`CONTROL_RESERVE`] places to
    /// [`Wire::emit_control`]'s.
    pub fn emit(
        &mut self,
        path: &Path,
        h: &Headers,
        len: usize,
        fill: impl FnOnce(&mut [u8]) -> bool,
    ) -> Emit {
        self.emit_within(self.tx.len() - CONTROL_RESERVE, path, h, len, fill)
    }

    /// [`Wire::emit`] for a MAD of QP1: it may take the places the
    /// transport leaves, so that a connection's setup is not refused while
    /// a window of retransmissions waits for the next round (a vdev's
    /// connection thread queues MADs between rounds).
    pub fn emit_control(
        &mut self,
        path: &Path,
        h: &Headers,
        len: usize,
        fill: impl FnOnce(&mut [u8]) -> bool,
    ) -> Emit {
        self.emit_within(self.tx.len(), path, h, len, fill)
    }

    fn emit_within(
        &mut self,
        limit: usize,
        path: &Path,
        h: &Headers,
        len: usize,
        fill: impl FnOnce(&mut [u8]) -> bool,
    ) -> Emit {
        if self.tx_len >= limit {
            if self.in_round {
                self.flush();
            }
            if self.tx_len >= limit {
                return Emit::Full;
            }
        }
        let meta = Ipv4Meta::outgoing(path.src, path.dst, self.io.src_port());
        let slot = &mut self.tx[self.tx_len];
        let start = vrdma_roce::header_len(h);
        let Some(payload) = slot.buf.get_mut(start..start + len) else {
            return Emit::LocalError;
        };
        if !fill(payload) {
            return Emit::LocalError;
        }
        let Ok(n) = vrdma_roce::finish_in_place(&mut slot.buf[..], h, len, &meta) else {
            return Emit::LocalError;
        };
        slot.len = n;
        slot.src = path.src;
        slot.dst = path.dst;
        slot.tos = path.tos;
        self.tx_len += 1;
        Emit::Sent
    }

    /// Hands the queued packets to the kernel; what it cannot take now
    /// stays queued (a send error drops the packet it names: the
    /// transport's retransmission covers it as any loss).
    pub fn flush(&mut self) {
        while self.tx_len > 0 {
            match self.io.send(&self.tx[..self.tx_len]) {
                Ok(0) => return,
                Ok(n) => {
                    self.count_sent(n);
                    self.tx[..self.tx_len].rotate_left(n);
                    self.tx_len -= n;
                }
                Err(e) => {
                    tracing::debug!("Packet send failed: {e}");
                    self.peers.global.send_errors += 1;
                    self.tx[..self.tx_len].rotate_left(1);
                    self.tx_len -= 1;
                }
            }
        }
    }

    fn count_sent(&mut self, n: usize) {
        // A batch mostly goes to one peer: looked up once per run of it.
        let mut last: Option<(Ipv4Addr, usize)> = None;
        for p in &self.tx[..n] {
            let i = match last {
                Some((dst, i)) if dst == p.dst => i,
                _ => {
                    let i = self.peers.of_gid(&*self.directory, p.dst).unwrap_or(0);
                    last = Some((p.dst, i));
                    i
                }
            };
            self.peers.sent(i, p.len);
        }
    }

    /// Whether packets wait to be handed to the kernel.
    pub fn backlog(&self) -> bool {
        self.tx_len > 0
    }

    /// Whether remote QPs have packets to send, responses owed or timers
    /// running.
    pub fn has_active(&self) -> bool {
        !self.active.is_empty()
    }

    pub(in crate::engine) fn mark_active(&mut self, qref: QpRef) {
        if !self.active.contains(&qref) {
            self.active.push(qref);
        }
    }

    fn ack_due(&mut self, qref: QpRef, remote: &mut RemoteQp) {
        if !remote.ack_due {
            remote.ack_due = true;
            self.acks.push(qref);
        }
    }

    /// Packet `psn` of `remote`, whose answer ends before PSN `end`, was
    /// queued: a retransmission if it was sent before; otherwise the RTT
    /// probe if none is running.
    fn note_sent(&mut self, remote: &mut RemoteQp, psn: Psn, end: Psn, now: Instant) {
        if psn.diff(remote.high) < 0 {
            self.peers.at(remote.conn.peer).retransmissions += 1;
            return;
        }
        remote.high = end;
        if remote.probe.is_none() {
            remote.probe = Some((psn, now));
        }
    }

    pub(in crate::engine) fn drop_packet(&mut self, peer: usize, why: &'static str) {
        self.peers.dropped(peer, why);
    }

    fn timeout(&mut self, peer: usize) {
        self.peers.at(peer).timeouts += 1;
    }

    fn duplicate(&mut self, peer: usize) {
        self.peers.at(peer).duplicates += 1;
    }

    fn nak_sent(&mut self, peer: usize, kind: &'static str) {
        peers::bump(&mut self.peers.at(peer).naks_sent, kind);
    }

    fn nak_received(&mut self, peer: usize, kind: &'static str) {
        peers::bump(&mut self.peers.at(peer).naks_received, kind);
    }

    fn rtt_sample(&mut self, peer: usize, rtt: Duration) {
        self.peers.at(peer).rtt(rtt);
    }
}

impl Engine {
    /// Puts the engine on the network: remote QPs send and receive through
    /// `wire`.
    pub fn attach_wire(&mut self, wire: Wire) {
        self.wire = Some(Box::new(wire));
    }

    /// The wire, if the engine has one.
    pub fn wire(&self) -> Option<&Wire> {
        self.wire.as_deref()
    }

    /// Receives and handles what the network brought; then sends the
    /// acknowledgements the packets made due (one per QP: coalesced).
    /// Whether it worked for tenants' QPs: packets for QP1 alone are
    /// handled but do not count — the connection manager's MADs promise
    /// no data traffic, so the datapath does not start polling after them
    /// (a thousand connections' MADs kept both hostds' datapaths polling
    /// through the whole setup, on the core the CM and vdevs share: half
    /// of that core's context switches).
    pub(super) fn wire_receive(&mut self, now: Instant) -> bool {
        let Some(mut w) = self.wire.take() else {
            return false;
        };
        let mut packets = 0u64;
        let gsi_before = self.gsi_packets;
        let mut rx = std::mem::take(&mut w.rx);
        for _ in 0..RX_CALLS {
            let n = match w.io.recv(&mut rx) {
                Ok(n) => n,
                Err(e) => {
                    tracing::debug!("Packet receive failed: {e}");
                    w.peers.global.receive_errors += 1;
                    0
                }
            };
            if n == 0 {
                break;
            }
            packets += n as u64;
            for (i, p) in rx[..n].iter().enumerate() {
                // The next packet's headers while this one is handled: they
                // were often out of cache by the time the parser read them
                // (a tenth of a UD receiver's time; UD 64 B rate across
                // hosts +10 %, docs/performance.md).
                if let Some(next) = rx[..n].get(i + 1) {
                    next.prefetch();
                }
                let bytes = p.buf.get(..p.len).unwrap_or(&[]);
                self.dispatch(&mut w, bytes, now);
            }
            if n < rx.len() {
                break;
            }
        }
        w.rx = rx;
        let acks = std::mem::take(&mut w.acks);
        for &qref in &acks {
            let Some(remote) = self.qps.get_mut(qref).and_then(|q| q.remote.as_deref_mut()) else {
                continue;
            };
            remote.ack_due = false;
            let psn = remote.epsn.sub(1);
            let aeth = vrdma_roce::Aeth::Ack {
                credits: NO_CREDITS,
                msn: remote.msn,
            };
            let path = remote.conn.path;
            responder::send_ack(&mut w, &path, psn, aeth);
        }
        w.acks = acks;
        w.acks.clear();
        self.wire = Some(w);
        packets > self.gsi_packets - gsi_before
    }

    /// One received IPv4 packet: checked, then given to the QP's responder
    /// or requester.
    fn dispatch(&mut self, w: &mut Wire, bytes: &[u8], now: Instant) {
        let (meta, pkt) = match vrdma_roce::parse_ipv4(bytes) {
            Ok(parsed) => parsed,
            Err(reason) => {
                let peer = source_peer(w, bytes);
                w.peers.dropped(peer, reason.name());
                return;
            }
        };
        let Some((peer, network)) = w.peers.source(&*w.directory, meta.src) else {
            w.peers.dropped(0, "unknown_source");
            return;
        };
        // The RoCE packet (BTH to ICRC), as counted when sending: the UDP
        // payload (parse_ipv4 took only option-less IPv4 headers).
        let headers = vrdma_roce::IPV4_HEADER_LEN + vrdma_roce::UDP_HEADER_LEN;
        w.peers.received(peer, bytes.len().saturating_sub(headers));
        if pkt.bth.pkey != DEFAULT_PKEY {
            w.drop_packet(peer, "bad_pkey");
            return;
        }
        let code = pkt.bth.opcode as u8;
        let transport = match code & op::TRANSPORT {
            0 if code <= op::FETCH_ADD => QpType::Rc,
            op::UC => QpType::Uc,
            _ if matches!(code, op::UD_SEND_ONLY | op::UD_SEND_ONLY_IMM) => {
                // The IPv4 header is the GRH's second half (parse_ipv4
                // took 20 bytes of it).
                let ip_header = bytes.get(..20).unwrap_or(&[]);
                self.datagram(w, peer, &network, &meta, ip_header, &pkt);
                return;
            }
            _ => {
                w.drop_packet(peer, "unsupported_opcode");
                return;
            }
        };
        let Some(qref) = self.remote_qp_for(meta.dst, pkt.bth.dest_qp) else {
            if transport == QpType::Rc && op::is_send_or_write(code) && pkt.bth.ack_req {
                let psn = pkt.bth.psn;
                if let Some(r) = (w.closed).answer(meta.dst, pkt.bth.dest_qp, meta.src, psn, now) {
                    w.duplicate(r.peer);
                    let aeth = vrdma_roce::Aeth::Ack {
                        credits: NO_CREDITS,
                        msn: r.msn,
                    };
                    responder::send_ack(w, &r.path, r.psn, aeth);
                    return;
                }
            }
            tracing::debug!(dst = %meta.dst, qpn = pkt.bth.dest_qp, src = %meta.src, "Packet for an unknown QP dropped");
            w.drop_packet(peer, "unknown_qp");
            return;
        };
        let Some(qp) = self.qps.get(qref) else {
            return;
        };
        if qp.qp_type != transport {
            w.drop_packet(peer, "wrong_transport");
            return;
        }
        let Some(remote) = qp.remote.as_deref() else {
            w.drop_packet(peer, "not_connected");
            return;
        };
        if remote.conn.path.dst != meta.src {
            w.drop_packet(peer, "not_connected");
            return;
        }
        if transport == QpType::Uc {
            if !qp.receives() {
                w.drop_packet(peer, "qp_not_ready");
                return;
            }
            self.uc_request(w, qref, &pkt, now);
        } else if op::is_request(code) {
            if !qp.receives() {
                w.drop_packet(peer, "qp_not_ready");
                return;
            }
            self.request(w, qref, &pkt, now);
        } else {
            if !qp.sends() {
                w.drop_packet(peer, "qp_not_ready");
                return;
            }
            self.response(w, qref, &pkt, now);
        }
    }

    /// Sends what remote QPs have to send (new packets, retransmissions,
    /// READ responses) and runs their timers; then hands the packets to
    /// the kernel. Returns the earliest time a timer is due and whether
    /// work is left for the next round.
    pub(super) fn wire_send(&mut self, now: Instant) -> (Option<Instant>, bool) {
        let Some(mut w) = self.wire.take() else {
            return (None, false);
        };
        // Connection setup first: QP1's MADs that found the queue full.
        let mut left = !self.gsi_out.is_empty() && self.gsi_send_waiting(&mut w);
        let mut active = std::mem::take(&mut w.active);
        // A QP waiting out an RNR NAK stays active (its message is still in
        // its window): its `rnr_until` is among the timers below.
        let mut next_due: Option<Instant> = None;
        let mut i = 0;
        while i < active.len() {
            let qref = active[i];
            self.requester_timer(&mut w, qref, now);
            let more = self.pump(&mut w, qref, now) | self.pump_reads(&mut w, qref, now);
            left |= more;
            let Some(remote) = self.qps.get(qref).and_then(|q| q.remote.as_deref()) else {
                active.swap_remove(i);
                continue;
            };
            if let Some(due) = remote.due {
                next_due = Some(next_due.map_or(due, |d| d.min(due)));
            }
            if let Some(t) = remote.rnr_until {
                next_due = Some(next_due.map_or(t, |d| d.min(t)));
            }
            let idle = remote.inflight.is_empty() && remote.reads.is_empty();
            if idle && !more {
                active.swap_remove(i);
            } else {
                i += 1;
            }
        }
        // QPs made active while this ran join the list.
        for qref in std::mem::take(&mut w.active) {
            if !active.contains(&qref) {
                active.push(qref);
            }
        }
        w.active = active;
        w.flush();
        let backlog = w.backlog();
        self.wire = Some(w);
        (next_due, left || backlog)
    }

    /// The QP `qpn` of the device of this host whose GID is `gid`.
    fn remote_qp_for(&self, gid: Ipv4Addr, qpn: u32) -> Option<QpRef> {
        self.qp_at(&vrdma_spec::gid::ipv4_mapped(gid.octets()), qpn)
    }

    /// The transport's view of connection `c` of QP `qref`, if its peer is
    /// on another host: the engine has a wire and no device here has the
    /// destination GID.
    pub(super) fn wire_connection(
        &mut self,
        qref: QpRef,
        c: &vrdma_hostd_protocol::messages::QpConnection,
    ) -> Option<state::Connection> {
        self.wire.as_ref()?;
        if self.gids.contains_key(&c.dgid) {
            return None;
        }
        let dst = Ipv4Addr::from(vrdma_spec::gid::ipv4_of(&c.dgid)?);
        let qp = self.qps.get(qref)?;
        let src = Ipv4Addr::from(vrdma_spec::gid::ipv4_of(&self.devices.at(qp.dev)?.gid)?);
        let uc = qp.qp_type == QpType::Uc;
        let peer = self.peer_index(dst);
        Some(state::Connection {
            path: Path {
                src,
                dst,
                tos: c.traffic_class,
                dest_qpn: c.dest_qpn,
                mtu: c.path_mtu,
            },
            sq_psn: c.sq_psn,
            rq_psn: c.rq_psn,
            timeout: c.timeout,
            retry_cnt: c.retry_cnt,
            rnr_retry: c.rnr_retry,
            min_rnr_timer: c.min_rnr_timer,
            max_rd_atomic: c.max_rd_atomic,
            peer,
            unacknowledged: uc,
        })
    }

    /// Connects QP `qref` to a peer on another host (RTR; again at RTS),
    /// or disconnects it (`None`).
    pub(super) fn connect_remote(&mut self, qref: QpRef, conn: Option<state::Connection>) {
        let Some(qp) = self.qps.get_mut(qref) else {
            return;
        };
        match (conn, qp.remote.as_deref_mut()) {
            (None, _) => qp.remote = None,
            (Some(c), Some(r)) => r.reconnect(c),
            (Some(c), None) => qp.remote = Some(Box::new(RemoteQp::new(c))),
        }
    }

    /// QP `qref` (number `vqpn`) is being destroyed: if it is an RC QP
    /// connected to another host, what it took stays acknowledged for a
    /// while ([`closed`]).
    pub(super) fn remember_closed(&mut self, qref: QpRef, vqpn: u32) {
        let (Some(w), Some(qp)) = (self.wire.as_deref_mut(), self.qps.get(qref)) else {
            return;
        };
        if let (QpType::Rc, Some(remote)) = (qp.qp_type, qp.remote.as_deref()) {
            w.closed.remember(vqpn, remote, Instant::now());
        }
    }

    /// The peer index counters of `gid`'s host are kept under.
    pub(super) fn peer_index(&mut self, gid: Ipv4Addr) -> usize {
        match self.wire.as_deref_mut() {
            Some(w) => w.peers.of_gid(&*w.directory, gid).unwrap_or(0),
            None => 0,
        }
    }
}

/// The peer a packet that failed to parse came from, if its IPv4 source
/// is readable and known.
fn source_peer(w: &mut Wire, bytes: &[u8]) -> usize {
    let Some(src) = bytes.get(12..16) else {
        return 0;
    };
    let ip = Ipv4Addr::new(src[0], src[1], src[2], src[3]);
    w.peers.of_gid(&*w.directory, ip).unwrap_or(0)
}

#[cfg(test)]
mod link;
#[cfg(test)]
mod tests;
#[cfg(test)]
mod tests_unreliable;
