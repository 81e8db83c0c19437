//! What the RC transport keeps per QP whose peer is on another host: the
//! requester's window of messages on the wire, the responder's expected
//! PSN and the message it is receiving, the READ responses it still owes
//! and the atomic results it may have to send again.

use std::collections::VecDeque;
use std::net::Ipv4Addr;
use std::time::{Duration, Instant};

use vrdma_roce::Psn;
use vrdma_spec::verbs::{SendOpcode, WcStatus};

use crate::engine::wqe::SendWork;

/// Messages a QP keeps on the wire at most (its send queue may be deeper:
/// the rest wait in the guest's ring).
pub const WINDOW_MESSAGES: usize = 64;
/// Packets a QP has sent and not had acknowledged at most.
pub const WINDOW_PACKETS: u32 = 256;
/// The requester asks for an acknowledgement at least this often within a
/// long message (and always on a message's last packet).
pub const ACK_EVERY: u32 = 32;
/// Atomic results a responder keeps to answer a duplicate request with
/// (the most `max_dest_rd_atomic` allows, 16).
pub const ATOMIC_REPLAY: usize = 16;

/// Where a QP's packets go and how big they are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Path {
    /// This QP's device's GID (the packets' IP source).
    pub src: Ipv4Addr,
    /// The peer's GID (their IP destination).
    pub dst: Ipv4Addr,
    /// IP TOS: the AV's traffic class.
    pub tos: u8,
    pub dest_qpn: u32,
    /// Payload bytes per packet (the path MTU).
    pub mtu: u32,
}

/// The connection of a remote QP, as the transport needs it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Connection {
    pub path: Path,
    /// First PSN this QP sends, and first it expects.
    pub sq_psn: u32,
    pub rq_psn: u32,
    /// The local ACK timeout code (4.096 µs × 2^timeout; 0: none).
    pub timeout: u8,
    pub retry_cnt: u8,
    pub rnr_retry: u8,
    /// The RNR timer code this QP asks requesters to wait.
    pub min_rnr_timer: u8,
    /// READs and atomics this QP has outstanding at most.
    pub max_rd_atomic: u8,
    /// The peer host's index in the wire's counters.
    pub peer: usize,
    /// UC: nothing is acknowledged, retried or timed; a message is done
    /// when its last packet is sent, and a gap drops what it interrupts.
    pub unacknowledged: bool,
}

/// The local ACK timeout of `code`: 4.096 µs × 2^code, none for 0 (IBA
/// 9.7.6.1.3; codes above 31 as 31).
pub fn ack_timeout(code: u8) -> Option<Duration> {
    if code == 0 {
        return None;
    }
    let shift = u32::from(code.min(31));
    Some(Duration::from_nanos(4096u64 << shift))
}

/// A message on the wire.
#[derive(Debug)]
pub struct Issued {
    pub work: Box<SendWork>,
    /// Its first PSN and how many PSNs it takes (a READ takes one per
    /// response packet).
    pub first: Psn,
    pub npkts: u32,
    /// Packets sent in the current pass (a READ request counts as
    /// `npkts` once sent; retransmission rewinds it).
    pub sent: u32,
    /// READ: response packets received from the first on, without a gap.
    pub got: u32,
    /// READ: response packets `got + 1 + i` received ahead of a gap (bit i).
    pub ahead: u64,
    /// READ: `got` when it was last asked for (an implicit NAK asks again
    /// only after progress since).
    pub asked: Option<u32>,
    /// A READ or atomic has its whole response.
    pub answered: bool,
    /// The status it completes with, when the peer failed it.
    pub failed: Option<WcStatus>,
}

/// Whether the peer answers `opcode` with data (a READ or an atomic):
/// such a message completes with its answer, not with an acknowledgement,
/// and counts against `max_rd_atomic`.
pub fn answered_with_data(opcode: SendOpcode) -> bool {
    matches!(
        opcode,
        SendOpcode::RdmaRead | SendOpcode::AtomicCmpAndSwp | SendOpcode::AtomicFetchAndAdd
    )
}

impl Issued {
    /// Whether the peer answers it with data (a READ or an atomic).
    pub fn reads(&self) -> bool {
        answered_with_data(self.work.opcode)
    }

    /// Its last PSN.
    pub fn last(&self) -> Psn {
        self.first.add(self.npkts.saturating_sub(1))
    }

    /// Whether `psn` is one of its PSNs.
    pub fn holds(&self, psn: Psn) -> bool {
        let d = psn.diff(self.first);
        d >= 0 && (d as u32) < self.npkts
    }

    /// Whether every packet of it has been sent in this pass.
    pub fn all_sent(&self) -> bool {
        self.sent >= self.npkts
    }

    /// Whether it has packets to send: not all sent in this pass, and
    /// neither answered (never sent again) nor failed.
    pub fn to_send(&self) -> bool {
        !self.all_sent() && !self.answered && self.failed.is_none()
    }
}

/// The message a responder is in the middle of.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Receiving {
    #[default]
    Nothing,
    /// A SEND: bytes placed in the head receive so far.
    Send { offset: u64 },
    /// An RDMA WRITE: its target and bytes placed so far.
    Write {
        va: u64,
        rkey: u32,
        len: u64,
        offset: u64,
    },
}

/// READ responses a responder still owes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReadResponse {
    /// PSN of its first response packet.
    pub first: Psn,
    pub va: u64,
    pub rkey: u32,
    pub len: u64,
    /// Response packets sent.
    pub sent: u32,
}

impl ReadResponse {
    pub fn npkts(&self, mtu: u32) -> u32 {
        packets(self.len, mtu)
    }
}

/// The later of two PSNs.
pub fn later(a: Psn, b: Psn) -> Psn {
    if a.diff(b) >= 0 {
        a
    } else {
        b
    }
}

/// Packets a message of `len` bytes takes at `mtu` (one for an empty one).
pub fn packets(len: u64, mtu: u32) -> u32 {
    let mtu = u64::from(mtu.max(256));
    u32::try_from(len.div_ceil(mtu).max(1)).unwrap_or(u32::MAX)
}

/// The transport state of a QP connected to another host.
#[derive(Debug)]
pub struct RemoteQp {
    pub conn: Connection,
    // Requester.
    /// The next PSN a new message takes.
    pub next_psn: Psn,
    /// The last PSN the responder acknowledged.
    pub acked: Psn,
    /// One past the highest PSN ever sent (what an acknowledgement may
    /// name; below it, a packet sent again is a retransmission).
    pub high: Psn,
    /// Messages on the wire, oldest first.
    pub inflight: VecDeque<Issued>,
    /// Every message of `inflight` before this index has nothing left to
    /// send (all sent, answered or failed): where sending looks first, so
    /// that a full window is not walked from its oldest message at every
    /// packet. Moved back by a rewind, down by a retirement.
    pub send_from: usize,
    /// Spare WQE copies, reused: one is made when the window first grows
    /// past what it had (at most [`WINDOW_MESSAGES`] a QP, so the datapath
    /// allocates only while a QP's window first deepens). Made all at once
    /// at connection, they cost every connection across hosts 64 KiB of
    /// fresh pages to fault in and zero in hostd's control thread — a
    /// tenth of its time in a burst of connection setups.
    pub pool: Vec<Box<SendWork>>,
    /// Retries of each kind left since the last progress.
    pub retry_left: u8,
    pub rnr_left: u8,
    /// When the oldest unacknowledged packet times out.
    pub due: Option<Instant>,
    /// An RNR NAK holds transmission until then.
    pub rnr_until: Option<Instant>,
    /// A PSN whose acknowledgement is timed, and when it was sent.
    pub probe: Option<(Psn, Instant)>,
    /// Packets it may have unacknowledged now: [`WINDOW_PACKETS`], cut to
    /// [`ACK_EVERY`] by a timeout and doubled back by each acknowledged
    /// step (a slow peer must not get the whole window again at every
    /// timeout, which would keep it slow).
    pub window: u32,
    // Responder.
    /// The PSN it expects next.
    pub epsn: Psn,
    /// Messages it completed (the AETH's MSN).
    pub msn: u32,
    pub receiving: Receiving,
    /// READ responses owed, in PSN order.
    pub reads: VecDeque<ReadResponse>,
    /// Atomic results by request PSN, a ring of [`ATOMIC_REPLAY`].
    pub atomics: [Option<(Psn, u64)>; ATOMIC_REPLAY],
    pub atomics_next: usize,
    /// An acknowledgement is owed (sent once at the end of a batch).
    pub ack_due: bool,
    /// A PSN sequence error NAK was sent and nothing in sequence came since
    /// (one NAK per gap).
    pub nak_sent: bool,
    /// UC: a packet of the message being received was lost; the rest of
    /// it is dropped until a message's first packet comes.
    pub dropping: bool,
}

impl RemoteQp {
    /// The state of a QP that just connected with `conn`.
    pub fn new(conn: Connection) -> Self {
        RemoteQp {
            next_psn: Psn::new(conn.sq_psn),
            acked: Psn::new(conn.sq_psn).sub(1),
            high: Psn::new(conn.sq_psn),
            inflight: VecDeque::with_capacity(WINDOW_MESSAGES),
            send_from: 0,
            pool: Vec::new(),
            retry_left: conn.retry_cnt,
            rnr_left: conn.rnr_retry,
            due: None,
            rnr_until: None,
            probe: None,
            window: WINDOW_PACKETS,
            epsn: Psn::new(conn.rq_psn),
            msn: 0,
            receiving: Receiving::Nothing,
            reads: VecDeque::new(),
            atomics: [None; ATOMIC_REPLAY],
            atomics_next: 0,
            ack_due: false,
            nak_sent: false,
            dropping: false,
            conn,
        }
    }

    /// Takes a new connection (RTS after RTR: the send PSN and the
    /// requester's timers are set now), keeping what is on the wire.
    pub fn reconnect(&mut self, conn: Connection) {
        if self.inflight.is_empty() {
            self.next_psn = Psn::new(conn.sq_psn);
            self.acked = self.next_psn.sub(1);
            self.high = self.next_psn;
        }
        self.retry_left = conn.retry_cnt;
        self.rnr_left = conn.rnr_retry;
        self.conn = conn;
    }

    /// READs and atomics on the wire and not completed — answered ones
    /// waiting behind an older message count too: the responder must still
    /// be able to replay the oldest one, and keeps [`ATOMIC_REPLAY`]
    /// results (IBA's `max_rd_atomic` counts until completion).
    pub fn reads_out(&self) -> usize {
        self.inflight.iter().filter(|m| m.reads()).count()
    }

    /// Whether a new message of any kind may go on the wire now.
    pub fn has_room_any(&self) -> bool {
        self.inflight.len() < WINDOW_MESSAGES
    }

    /// Whether a new message of `opcode` may go on the wire now.
    pub fn has_room(&self, opcode: SendOpcode) -> bool {
        if self.inflight.len() >= WINDOW_MESSAGES {
            return false;
        }
        !answered_with_data(opcode)
            || self.reads_out() < usize::from(self.conn.max_rd_atomic.max(1))
    }

    /// Puts the WQE in `head` into the window (a spare copy takes its place
    /// in `head`), on the next `npkts` PSNs; `failed`: it completes with
    /// that status, in order after those before it. False with the window
    /// full.
    pub fn take_on(
        &mut self,
        head: &mut Box<SendWork>,
        npkts: u32,
        failed: Option<WcStatus>,
    ) -> bool {
        if !self.has_room_any() {
            return false;
        }
        let mut work = self.pool.pop().unwrap_or_default();
        std::mem::swap(&mut work, head);
        let first = self.next_psn;
        self.next_psn = first.add(npkts);
        self.inflight.push_back(Issued {
            work,
            first,
            npkts,
            sent: 0,
            got: 0,
            ahead: 0,
            asked: None,
            answered: false,
            failed,
        });
        true
    }

    /// The PSN after the last one sent in this pass.
    pub fn sent_end(&self) -> Psn {
        let Some(front) = self.inflight.front() else {
            return self.next_psn;
        };
        self.inflight
            .iter()
            .rev()
            .find(|m| m.sent > 0)
            .map_or(front.first, |m| m.first.add(m.sent.min(m.npkts)))
    }

    /// Packets sent and not acknowledged.
    pub fn unacked_packets(&self) -> u32 {
        let from = later(
            self.acked.add(1),
            self.inflight.front().map_or(self.next_psn, |m| m.first),
        );
        u32::try_from(self.sent_end().diff(from).max(0)).unwrap_or(0)
    }

    /// The responder moved on: retries count afresh and the timeout
    /// restarts.
    pub fn progress(&mut self, now: Instant) {
        self.window = self.window.saturating_mul(2).min(WINDOW_PACKETS);
        self.retry_left = self.conn.retry_cnt;
        self.rnr_left = self.conn.rnr_retry;
        self.due = if self.inflight.is_empty() || self.conn.unacknowledged {
            None
        } else {
            ack_timeout(self.conn.timeout).map(|t| now + t)
        };
    }

    /// Whether some message has packets not sent in this pass.
    pub fn has_unsent(&self) -> bool {
        (self.inflight.iter().skip(self.send_from)).any(Issued::to_send)
    }

    /// Moves [`RemoteQp::send_from`] past the messages with nothing to
    /// send at the front of what is left; returns it.
    pub fn skip_sent(&mut self) -> usize {
        while self
            .inflight
            .get(self.send_from)
            .is_some_and(|m| !m.to_send())
        {
            self.send_from += 1;
        }
        self.send_from
    }

    /// Remembers the result of the atomic at `psn`.
    pub fn remember_atomic(&mut self, psn: Psn, orig: u64) {
        self.atomics[self.atomics_next] = Some((psn, orig));
        self.atomics_next = (self.atomics_next + 1) % ATOMIC_REPLAY;
    }

    /// The result of the atomic at `psn`, if still remembered.
    pub fn atomic_result(&self, psn: Psn) -> Option<u64> {
        self.atomics
            .iter()
            .flatten()
            .find(|(p, _)| *p == psn)
            .map(|&(_, orig)| orig)
    }

    /// Rewinds transmission to `psn` (go-back-N): every packet from it on
    /// is sent again.
    pub fn rewind(&mut self, psn: Psn) {
        self.send_from = 0;
        for m in self.inflight.iter_mut().filter(|m| !m.answered) {
            let d = psn.diff(m.first);
            if d <= 0 {
                m.sent = 0;
            } else if (d as u32) < m.npkts {
                // A READ is asked again for what has not come back (from
                // its first gap: what came ahead of it is asked again too).
                m.sent = if m.reads() { 0 } else { d as u32 };
                if m.reads() {
                    m.ahead = 0;
                }
            }
        }
        self.probe = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ack_timeouts_follow_the_iba_formula() {
        assert_eq!(ack_timeout(0), None);
        assert_eq!(ack_timeout(1), Some(Duration::from_nanos(8192)));
        assert_eq!(ack_timeout(14), Some(Duration::from_nanos(4096 << 14)));
        assert_eq!(ack_timeout(40), ack_timeout(31));
    }

    #[test]
    fn a_message_takes_one_psn_per_mtu_and_at_least_one() {
        assert_eq!(packets(0, 1024), 1);
        assert_eq!(packets(1024, 1024), 1);
        assert_eq!(packets(1025, 1024), 2);
        assert_eq!(packets(65536, 4096), 16);
    }
}
