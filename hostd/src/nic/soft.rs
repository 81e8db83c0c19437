//! `SoftNic`: a software model of a BlueField-3-style RDMA NIC.
//!
//! It has what the hardware has — a key table, virtual QPs bound to physical
//! QPs, and a DMA engine — and executes RC work one WQE at a time (an RDMA
//! WRITE, READ or SEND of a lower service rank in [`SEGMENT`]s while a
//! device of a higher rank is busy, so that the higher rank's work gets in
//! between, as a NIC's arbiter lets it in between packets):
//! every SGE and every remote access is checked against the NIC's own
//! tables *at execution time* (owner device, PD, access, bounds), so a
//! deregistration, memory removal or QP destruction that has returned can
//! never be followed by an access through what it removed. The DMA engine
//! copies between tenants' mappings with `SharedMapping::read`/`write` in
//! bounded chunks and never holds a reference into shared memory.
//!
//! Semantics this model fixes where verbs leave room:
//! - Every WQE gets exactly one completion, on the physical QP it was posted
//!   to (receive WQEs on the pQP of their vQP). A successful unsignaled send
//!   WQE is completed with [`WC_UNSIGNALED`] set so vdev can free ring slots
//!   and drop it.
//! - A WQE naming a vQP that is not on the pQP it was posted to (or an
//!   unknown kind) completes with LOC_QP_OP_ERR and changes no QP.
//! - Any error completion of a send WQE moves its QP to ERR: the rest of its
//!   send queue and its receive queue are flushed with WR_FLUSH_ERR.
//! - RNR: the requester waits the responder's `min_rnr_timer` (IBA table)
//!   and retries, `rnr_retry` times (7 = forever), then RNR_RETRY_EXC_ERR.
//! - Lost packets (no such responder, responder not ready or not connected
//!   back to the requester): retried every [`RETRY_STEP`], `retry_cnt` times,
//!   then RETRY_EXC_ERR — a short modelled transport timeout.
//! - Remote access errors leave the responder QP alone, so a peer's bad
//!   rkey cannot knock a victim's QP into ERR; a receive that is too short
//!   (LOC_LEN_ERR) or whose buffers fail their checks (LOC_PROT_ERR) moves
//!   the responder to ERR, and the requester gets REM_INV_REQ_ERR or
//!   REM_OP_ERR respectively.
//! - A segmented SEND fills the receive at the head of the responder's
//!   queue and takes it with the last segment; if the responder is reset
//!   and reconnected in between (its receives discarded), the SEND starts
//!   again from its first byte in the new head, as a retransmission would.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use vrdma_hostd_protocol::entries::{kind, PhysCqe, PhysWqe, Sge};
use vrdma_hostd_protocol::messages::{MrRegistration, QpConnection};
use vrdma_hostd_protocol::shm::SharedMapping;
use vrdma_spec::ring::{send_flags, wc_flags};
use vrdma_spec::verbs::{access, SendOpcode, WcOpcode, WcStatus};

use super::{Completion, DeviceId, Nic, NicError, Progress, WC_UNSIGNALED};
use crate::ids::IdMap;

pub use vrdma_hostd_protocol::entries::cqe_marker::SOLICITED as WC_SOLICITED;
/// Interval between retries of a packet the fabric dropped.
pub const RETRY_STEP: Duration = Duration::from_micros(500);
/// Largest message (the port's max_msg_sz).
pub const MAX_MESSAGE: u64 = 1 << 31;
/// Memory slots one device may map (vhost-user allows 509).
const MAX_SLOTS: usize = 1024;
/// Memory regions of one device.
const MAX_MRS: usize = 1 << 16;
/// Virtual QPs of one device.
const MAX_QPS: usize = 1 << 16;
/// WQEs one vQP executes per turn before the next vQP gets one.
const QP_BATCH: usize = 16;
/// Bounce-buffer size of the DMA engine.
const COPY_CHUNK: usize = 64 * 1024;
/// Bytes of a long RDMA WRITE, READ or SEND the NIC moves before it looks
/// whether work of a higher service rank is waiting. A NIC cuts messages
/// into packets and its arbiter lets a higher class in between them: so
/// here a 1 MiB write of a normal tenant (~85 µs of copying on this
/// machine) delays a realtime READ by one segment, not by the message.
pub const SEGMENT: u64 = 16 * 1024;
/// How long after its last posted send a device counts as busy: long
/// messages of lower ranks yield between segments only while a device of a
/// higher rank is busy, so an idle realtime tenant costs the others
/// nothing.
pub const BUSY_FOR: Duration = Duration::from_millis(10);
/// The rank of a device nobody ranked: served after every ranked one.
pub const UNRANKED: u8 = u8::MAX;

/// The part of a `len`-byte message from byte `offset` that moves now (at
/// most `chunk` bytes), and whether it is the last.
fn segment(len: u64, offset: u64, chunk: u64) -> (u64, bool) {
    let n = len.saturating_sub(offset).min(chunk);
    (n, offset.saturating_add(n) >= len)
}

/// The IBA RNR NAK timer table, in units of 10 µs (code 0 = 655.36 ms).
const RNR_TIMER_10US: [u32; 32] = [
    65536, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536,
    2048, 3072, 4096, 6144, 8192, 12288, 16384, 24576, 32768, 49152,
];

/// The RNR delay an RNR timer code stands for.
pub fn rnr_timer(code: u8) -> Duration {
    let units = RNR_TIMER_10US[usize::from(code & 31)];
    Duration::from_micros(u64::from(units) * 10)
}

/// A run of bytes in one mapping, checked to lie inside it.
#[derive(Clone)]
struct Piece {
    mem: Arc<SharedMapping>,
    offset: usize,
    len: usize,
}

struct Device {
    lid: u16,
    pqps: Vec<u32>,
    slots: HashMap<u32, Arc<SharedMapping>>,
    mrs: usize,
    qps: usize,
    /// Queued WQEs per pQP: each will produce one completion there.
    outstanding: IdMap<u32, usize>,
    /// Send WQEs queued or executing (the datapath's credits).
    sends: usize,
    /// Service rank of its work (0 first), see [`SEGMENT`].
    rank: u8,
    /// NIC time ([`SoftNic::clock`]) of its last posted send WQE.
    last_send: Option<Instant>,
}

struct Mr {
    device: DeviceId,
    pd: u32,
    access: u32,
    iova: u64,
    len: u64,
    rkey: u32,
    segments: Vec<vrdma_hostd_protocol::messages::MrSegment>,
    /// A slot under it was removed: no access succeeds any more.
    revoked: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum QpState {
    /// Created or reset: not connected.
    Reset,
    /// Connected (RTR/RTS): sends and receives.
    Ready,
    /// ERR: everything is flushed.
    Error,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum WaitKind {
    Rnr,
    Retry,
}

#[derive(Debug, Clone, Copy)]
struct Wait {
    kind: WaitKind,
    due: Instant,
    /// Retries left (RNR with rnr_retry 7: never decremented).
    left: u8,
}

struct Qp {
    pqp: u32,
    pd: u32,
    state: QpState,
    conn: Option<QpConnection>,
    access: u32,
    sq: VecDeque<PhysWqe>,
    rq: VecDeque<PhysWqe>,
    /// The head of `sq` waits for an RNR or transport retry.
    wait: Option<Wait>,
    /// In `SoftNic::active`.
    active: bool,
    /// Bytes of the head of `sq` already moved (a long message moves a
    /// [`SEGMENT`] at a time).
    sent: u64,
    /// Receive WQEs ever taken off the head of `rq` (completed, flushed or
    /// discarded): the sequence number of the head.
    rq_taken: u64,
    /// For a SEND of `sent` > 0 bytes: the sequence number of the
    /// responder's receive it is filling.
    recv_seq: u64,
}

type QpKey = (DeviceId, u32);

/// What executing one send WQE came to.
enum Outcome {
    Complete {
        status: WcStatus,
        byte_len: u32,
        /// The responder QP to move to ERR after the requester completion.
        fail_responder: Option<QpKey>,
    },
    Rnr(Duration),
    Dropped,
    /// One segment moved; the message goes on from this byte.
    Segment(u64),
}

fn done(status: WcStatus) -> Outcome {
    Outcome::Complete {
        status,
        byte_len: 0,
        fail_responder: None,
    }
}

/// Where the requester's local data is.
enum Local {
    Inline(Vec<u8>),
    Pieces(Vec<Piece>),
}

/// The software NIC.
#[derive(Default)]
pub struct SoftNic {
    /// Keyed by ids hostd assigns (device ids, LIDs): fast hashing.
    devices: IdMap<DeviceId, Device>,
    lids: IdMap<u16, DeviceId>,
    /// Memory regions by lkey.
    mrs: HashMap<u32, Mr>,
    /// rkey → lkey.
    rkeys: HashMap<u32, u32>,
    qps: HashMap<QpKey, Qp>,
    /// vQPs with send work, round-robin.
    active: VecDeque<QpKey>,
    outbox: Vec<Completion>,
    /// Send WQEs of every device queued or executing.
    sends: usize,
    /// The `now` of the last progress call: the NIC's time.
    clock: Option<Instant>,
    /// A long message stopped between segments for work of a higher rank.
    preempted: bool,
    /// [`SoftNic::busy_rank`] at the start of the current progress call.
    busy_rank: Option<u8>,
}

impl std::fmt::Debug for SoftNic {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SoftNic")
            .field("devices", &self.devices.len())
            .field("mrs", &self.mrs.len())
            .field("qps", &self.qps.len())
            .finish()
    }
}

fn send_cqe(wqe: &PhysWqe, status: WcStatus, byte_len: u32) -> PhysCqe {
    let opcode = SendOpcode::try_from(wqe.opcode)
        .map(SendOpcode::completion_opcode)
        .unwrap_or(WcOpcode::Send);
    let unsignaled = wqe.flags & send_flags::SIGNALED == 0;
    PhysCqe {
        token: wqe.token,
        vqpn: wqe.vqpn,
        status: status.into(),
        opcode: opcode.into(),
        wc_flags: if unsignaled && status == WcStatus::Success {
            WC_UNSIGNALED
        } else {
            0
        },
        kind: kind::SEND,
        byte_len: byte_len.into(),
        ..PhysCqe::default()
    }
}

fn recv_cqe(wqe: &PhysWqe, status: WcStatus) -> PhysCqe {
    PhysCqe {
        token: wqe.token,
        vqpn: wqe.vqpn,
        status: status.into(),
        opcode: WcOpcode::Recv.into(),
        kind: kind::RECV,
        ..PhysCqe::default()
    }
}

/// A completion for a WQE hostd cannot attribute to a QP of that pQP.
fn orphan_cqe(wqe: &PhysWqe) -> PhysCqe {
    let mut cqe = if wqe.kind == kind::RECV {
        recv_cqe(wqe, WcStatus::LocQpOpErr)
    } else {
        send_cqe(wqe, WcStatus::LocQpOpErr, 0)
    };
    cqe.kind = wqe.kind;
    cqe
}

fn total_len(pieces: &[Piece]) -> u64 {
    pieces.iter().map(|p| p.len as u64).sum()
}

/// Where byte `offset` of a list of pieces is: (piece index, offset in it).
fn seek(pieces: &[Piece], offset: u64) -> (usize, usize) {
    let mut left = offset;
    for (i, piece) in pieces.iter().enumerate() {
        let len = piece.len as u64;
        if left < len {
            return (i, left as usize);
        }
        left -= len;
    }
    (pieces.len(), 0)
}

/// Copies `len` bytes from byte `start` of `src` pieces to byte `start` of
/// `dst` pieces, mapping to mapping in chunks of at most [`COPY_CHUNK`].
/// False if either side runs out (callers size them first).
fn copy_pieces(src: &[Piece], dst: &[Piece], start: u64, len: u64) -> bool {
    let mut left = len;
    let (mut si, mut so) = seek(src, start);
    let (mut di, mut doff) = seek(dst, start);
    while left > 0 {
        while si < src.len() && so == src[si].len {
            si += 1;
            so = 0;
        }
        while di < dst.len() && doff == dst[di].len {
            di += 1;
            doff = 0;
        }
        let (Some(s), Some(d)) = (src.get(si), dst.get(di)) else {
            return false;
        };
        let n = (s.len - so)
            .min(d.len - doff)
            .min(COPY_CHUNK)
            .min(usize::try_from(left).unwrap_or(usize::MAX));
        if !s.mem.copy_to(s.offset + so, &d.mem, d.offset + doff, n) {
            return false;
        }
        so += n;
        doff += n;
        left -= n as u64;
    }
    true
}

/// Writes `data` across `dst` pieces.
fn write_bytes(data: &[u8], dst: &[Piece]) -> bool {
    let mut rest = data;
    for piece in dst {
        if rest.is_empty() {
            break;
        }
        let n = piece.len.min(rest.len());
        if !piece.mem.write(piece.offset, &rest[..n]) {
            return false;
        }
        rest = &rest[n..];
    }
    rest.is_empty()
}

/// Reads `out.len()` bytes from `src` pieces.
fn read_bytes(src: &[Piece], out: &mut [u8]) -> bool {
    let mut at = 0;
    for piece in src {
        if at == out.len() {
            break;
        }
        let n = piece.len.min(out.len() - at);
        if !piece.mem.read(piece.offset, &mut out[at..at + n]) {
            return false;
        }
        at += n;
    }
    at == out.len()
}

impl SoftNic {
    /// A NIC with no devices.
    pub fn new() -> Self {
        SoftNic::default()
    }

    fn emit(&mut self, device: DeviceId, pqp: u32, cqe: PhysCqe) {
        self.outbox.push(Completion { device, pqp, cqe });
    }

    fn count(&mut self, device: DeviceId, pqp: u32, delta: isize) {
        if let Some(dev) = self.devices.get_mut(&device) {
            let n = dev.outstanding.entry(pqp).or_insert(0);
            *n = n.saturating_add_signed(delta);
        }
    }

    /// Send WQEs of `device` entered (`delta` > 0) or left the NIC.
    fn count_sends(&mut self, device: DeviceId, delta: isize) {
        if let Some(dev) = self.devices.get_mut(&device) {
            dev.sends = dev.sends.saturating_add_signed(delta);
            self.sends = self.sends.saturating_add_signed(delta);
        }
    }

    /// Resolves `[addr, addr + len)` of the MR `lkey_or_rkey` names into
    /// pieces of its device's memory, if `device`, `pd` and `need` match.
    fn resolve(
        &self,
        mr: &Mr,
        device: DeviceId,
        pd: u32,
        need: u32,
        addr: u64,
        len: u64,
    ) -> Option<Vec<Piece>> {
        if mr.device != device || mr.pd != pd || mr.revoked || mr.access & need != need {
            return None;
        }
        let end = addr.checked_add(len)?;
        if addr < mr.iova || end > mr.iova.checked_add(mr.len)? {
            return None;
        }
        let slots = &self.devices.get(&device)?.slots;
        let mut skip = addr - mr.iova;
        let mut left = len;
        let mut pieces = Vec::new();
        for seg in &mr.segments {
            if left == 0 {
                break;
            }
            if skip >= seg.len {
                skip -= seg.len;
                continue;
            }
            let take = (seg.len - skip).min(left);
            let mem = slots.get(&seg.slot)?;
            let offset = usize::try_from(seg.offset.checked_add(skip)?).ok()?;
            let n = usize::try_from(take).ok()?;
            // Registration checked this; a re-added slot of the same number
            // could be smaller, so check again against the mapping itself.
            if offset.checked_add(n)? > mem.len() {
                return None;
            }
            pieces.push(Piece {
                mem: Arc::clone(mem),
                offset,
                len: n,
            });
            left -= take;
            skip = 0;
        }
        (left == 0).then_some(pieces)
    }

    fn resolve_local(&self, device: DeviceId, pd: u32, sge: &Sge, need: u32) -> Option<Vec<Piece>> {
        let mr = self.mrs.get(&sge.lkey.get())?;
        self.resolve(
            mr,
            device,
            pd,
            need,
            sge.addr.get(),
            u64::from(sge.length.get()),
        )
    }

    fn resolve_sges(
        &self,
        device: DeviceId,
        pd: u32,
        sges: &[Sge],
        need: u32,
    ) -> Option<Vec<Piece>> {
        let mut all = Vec::new();
        for sge in sges {
            all.extend(self.resolve_local(device, pd, sge, need)?);
        }
        Some(all)
    }

    fn resolve_remote(
        &self,
        device: DeviceId,
        pd: u32,
        rkey: u32,
        addr: u64,
        len: u64,
        need: u32,
    ) -> Option<Vec<Piece>> {
        let lkey = self.rkeys.get(&rkey)?;
        let mr = self.mrs.get(lkey)?;
        self.resolve(mr, device, pd, need, addr, len)
    }

    /// Moves a QP to ERR and flushes everything it holds.
    fn fail_qp(&mut self, key: QpKey) {
        let Some(qp) = self.qps.get_mut(&key) else {
            return;
        };
        qp.state = QpState::Error;
        qp.wait = None;
        qp.sent = 0;
        let pqp = qp.pqp;
        let sq: Vec<_> = qp.sq.drain(..).collect();
        let rq: Vec<_> = qp.rq.drain(..).collect();
        qp.rq_taken += rq.len() as u64;
        let n = (sq.len() + rq.len()) as isize;
        self.count_sends(key.0, -(sq.len() as isize));
        for wqe in &sq {
            self.emit(key.0, pqp, send_cqe(wqe, WcStatus::WrFlushErr, 0));
        }
        for wqe in &rq {
            self.emit(key.0, pqp, recv_cqe(wqe, WcStatus::WrFlushErr));
        }
        self.count(key.0, pqp, -n);
    }

    /// Drops a QP's queued work without completions (reset, destroy).
    fn discard_work(&mut self, key: QpKey) {
        let Some(qp) = self.qps.get_mut(&key) else {
            return;
        };
        let n = (qp.sq.len() + qp.rq.len()) as isize;
        let sends = qp.sq.len() as isize;
        qp.sq.clear();
        qp.rq_taken += qp.rq.len() as u64;
        qp.rq.clear();
        qp.wait = None;
        qp.sent = 0;
        qp.active = false;
        let pqp = qp.pqp;
        self.count(key.0, pqp, -n);
        self.count_sends(key.0, -sends);
        self.active.retain(|k| *k != key);
    }

    fn qp_mut(&mut self, device: DeviceId, vqpn: u32) -> Result<&mut Qp, NicError> {
        self.qps
            .get_mut(&(device, vqpn))
            .ok_or(NicError::UnknownQp(vqpn))
    }

    /// Executes the send WQE `wqe` of QP `key` (already taken off its
    /// queue), or, for an RDMA WRITE, READ or SEND, at most `chunk` bytes
    /// of it from byte `offset`. Every segment runs every check again, so a
    /// deregistration, memory removal or destruction between two segments
    /// stops the message.
    fn execute(&mut self, key: QpKey, wqe: &PhysWqe, offset: u64, chunk: u64) -> Outcome {
        let (device, vqpn) = key;
        let Some(qp) = self.qps.get(&key) else {
            return done(WcStatus::LocQpOpErr);
        };
        let (Some(conn), QpState::Ready) = (qp.conn, qp.state) else {
            return done(WcStatus::LocQpOpErr);
        };
        let pd = qp.pd;
        let Ok(opcode) = SendOpcode::try_from(wqe.opcode) else {
            return done(WcStatus::LocQpOpErr);
        };
        use SendOpcode as Op;
        if matches!(opcode, Op::LocalInv | Op::BindMw | Op::SendWithInv) {
            return done(WcStatus::LocQpOpErr);
        }
        let writes_local = matches!(
            opcode,
            Op::RdmaRead | Op::AtomicCmpAndSwp | Op::AtomicFetchAndAdd
        );
        // The requester's local side: inline bytes or checked SGEs.
        let local = if wqe.flags & send_flags::INLINE != 0 {
            if writes_local {
                return done(WcStatus::LocQpOpErr);
            }
            let Some(data) = usize::try_from(wqe.inline_len.get())
                .ok()
                .and_then(|n| wqe.payload.get(..n))
            else {
                return done(WcStatus::LocLenErr);
            };
            Local::Inline(data.to_vec())
        } else {
            let Some(sges) = wqe.sges() else {
                return done(WcStatus::LocQpOpErr);
            };
            if matches!(opcode, Op::AtomicCmpAndSwp | Op::AtomicFetchAndAdd)
                && (sges.len() != 1 || sges[0].length.get() != 8)
            {
                return done(WcStatus::LocLenErr);
            }
            let need = if writes_local { access::LOCAL_WRITE } else { 0 };
            match self.resolve_sges(device, pd, &sges, need) {
                Some(pieces) => Local::Pieces(pieces),
                None => return done(WcStatus::LocProtErr),
            }
        };
        let len = match &local {
            Local::Inline(data) => data.len() as u64,
            Local::Pieces(pieces) => total_len(pieces),
        };
        if len > MAX_MESSAGE {
            return done(WcStatus::LocLenErr);
        }
        // The fabric: the responder must exist, be ready and be connected
        // back to exactly this requester, or the packets are lost.
        let Some(my_lid) = self.devices.get(&device).map(|d| d.lid) else {
            return Outcome::Dropped;
        };
        let Some(&rdev) = self.lids.get(&conn.dest_lid) else {
            return Outcome::Dropped;
        };
        let rkey_qp = (rdev, conn.dest_qpn);
        let Some(rqp) = self.qps.get(&rkey_qp) else {
            return Outcome::Dropped;
        };
        let back = rqp
            .conn
            .is_some_and(|c| c.dest_lid == my_lid && c.dest_qpn == vqpn);
        if rqp.state != QpState::Ready || !back {
            return Outcome::Dropped;
        }
        let (rpd, raccess, rpqp) = (rqp.pd, rqp.access, rqp.pqp);
        let rnr = rnr_timer(rqp.conn.map_or(0, |c| c.min_rnr_timer));
        let has_recv = !rqp.rq.is_empty();
        let byte_len = len as u32;
        let ok = Outcome::Complete {
            status: WcStatus::Success,
            byte_len,
            fail_responder: None,
        };
        let remote = |nic: &Self, need: u32, len: u64| -> Option<Vec<Piece>> {
            if raccess & need != need {
                return None;
            }
            // A zero-length RDMA carries no rkey check (as on IB).
            if len == 0 {
                return Some(Vec::new());
            }
            nic.resolve_remote(rdev, rpd, wqe.rkey.get(), wqe.remote_addr.get(), len, need)
        };
        match opcode {
            Op::Send | Op::SendWithImm => {
                // The receive stays at the head of the responder's queue
                // until the last segment. Only this requester can take it
                // (the responder is connected back to it alone), but a
                // reset and reconnection of the responder between two
                // segments replaces it: then the message starts again from
                // its first byte, as a retransmission would.
                let Some(recv) = rqp.rq.front().copied() else {
                    return Outcome::Rnr(rnr);
                };
                let seq = rqp.rq_taken;
                if offset > 0 && self.qps.get(&key).map(|q| q.recv_seq) != Some(seq) {
                    return Outcome::Segment(0);
                }
                let dst = recv
                    .sges()
                    .and_then(|sges| self.resolve_sges(rdev, rpd, &sges, access::LOCAL_WRITE));
                let Some(dst) = dst else {
                    return self.refuse_recv(rkey_qp, rpqp, WcStatus::LocProtErr);
                };
                if total_len(&dst) < len {
                    return self.refuse_recv(rkey_qp, rpqp, WcStatus::LocLenErr);
                }
                let (n, last) = segment(len, offset, chunk);
                let copied = match &local {
                    // Inline data is far shorter than a segment.
                    Local::Inline(data) => write_bytes(data, &dst),
                    Local::Pieces(src) => copy_pieces(src, &dst, offset, n),
                };
                if !copied {
                    return self.refuse_recv(rkey_qp, rpqp, WcStatus::LocProtErr);
                }
                if !last {
                    if let Some(qp) = self.qps.get_mut(&key) {
                        qp.recv_seq = seq;
                    }
                    return Outcome::Segment(offset + n);
                }
                let _ = self.take_recv(rkey_qp);
                let mut cqe = recv_cqe(&recv, WcStatus::Success);
                cqe.byte_len = byte_len.into();
                cqe.src_qp = vqpn.into();
                cqe.slid = my_lid.into();
                if opcode == Op::SendWithImm {
                    cqe.imm_data = wqe.imm_data;
                    cqe.wc_flags |= wc_flags::WITH_IMM;
                }
                if wqe.flags & send_flags::SOLICITED != 0 {
                    cqe.wc_flags |= WC_SOLICITED;
                }
                self.emit(rdev, rpqp, cqe);
                ok
            }
            Op::RdmaWrite | Op::RdmaWriteWithImm => {
                let Some(dst) = remote(self, access::REMOTE_WRITE, len) else {
                    return done(WcStatus::RemAccessErr);
                };
                let with_imm = opcode == Op::RdmaWriteWithImm;
                let (n, last) = segment(len, offset, chunk);
                // The receive is consumed with the last segment; without
                // one the responder NAKs the first (and, if another sender
                // took it meanwhile, the last) segment.
                if with_imm && !has_recv && (offset == 0 || last) {
                    return Outcome::Rnr(rnr);
                }
                let copied = match &local {
                    Local::Inline(data) => write_bytes(data, &dst),
                    Local::Pieces(src) => copy_pieces(src, &dst, offset, n),
                };
                if !copied {
                    return done(WcStatus::RemAccessErr);
                }
                if !last {
                    return Outcome::Segment(offset + n);
                }
                if with_imm {
                    if let Some(recv) = self.take_recv(rkey_qp) {
                        let mut cqe = recv_cqe(&recv, WcStatus::Success);
                        cqe.opcode = WcOpcode::RecvRdmaWithImm.into();
                        cqe.byte_len = byte_len.into();
                        cqe.imm_data = wqe.imm_data;
                        cqe.wc_flags = wc_flags::WITH_IMM;
                        cqe.src_qp = vqpn.into();
                        cqe.slid = my_lid.into();
                        self.emit(rdev, rpqp, cqe);
                    }
                }
                ok
            }
            Op::RdmaRead => {
                let Some(src) = remote(self, access::REMOTE_READ, len) else {
                    return done(WcStatus::RemAccessErr);
                };
                let Local::Pieces(dst) = &local else {
                    return done(WcStatus::LocQpOpErr);
                };
                let (n, last) = segment(len, offset, chunk);
                if !copy_pieces(&src, dst, offset, n) {
                    return done(WcStatus::LocProtErr);
                }
                if !last {
                    return Outcome::Segment(offset + n);
                }
                ok
            }
            Op::AtomicCmpAndSwp | Op::AtomicFetchAndAdd => {
                if !wqe.remote_addr.get().is_multiple_of(8) {
                    return done(WcStatus::RemInvReqErr);
                }
                let Some(target) = remote(self, access::REMOTE_ATOMIC, 8) else {
                    return done(WcStatus::RemAccessErr);
                };
                let Local::Pieces(dst) = &local else {
                    return done(WcStatus::LocQpOpErr);
                };
                // All atomics execute here, under the caller's exclusive
                // borrow of the NIC, so they are serialized with each other.
                let mut old = [0u8; 8];
                if !read_bytes(&target, &mut old) {
                    return done(WcStatus::RemAccessErr);
                }
                let original = u64::from_le_bytes(old);
                let new = if opcode == Op::AtomicCmpAndSwp {
                    if original == wqe.compare_add.get() {
                        wqe.swap.get()
                    } else {
                        original
                    }
                } else {
                    original.wrapping_add(wqe.compare_add.get())
                };
                if !write_bytes(&new.to_le_bytes(), &target) || !write_bytes(&old, dst) {
                    return done(WcStatus::RemAccessErr);
                }
                ok
            }
            Op::LocalInv | Op::BindMw | Op::SendWithInv => done(WcStatus::LocQpOpErr),
        }
    }

    /// Takes the head of responder `key`'s receive queue, which failed
    /// with `status` there (its buffers failed their checks or are too
    /// short); the responder goes to ERR after the requester's completion,
    /// which is REM_OP_ERR or REM_INV_REQ_ERR.
    fn refuse_recv(&mut self, key: QpKey, pqp: u32, status: WcStatus) -> Outcome {
        if let Some(recv) = self.take_recv(key) {
            self.emit(key.0, pqp, recv_cqe(&recv, status));
        }
        Outcome::Complete {
            status: if status == WcStatus::LocLenErr {
                WcStatus::RemInvReqErr
            } else {
                WcStatus::RemOpErr
            },
            byte_len: 0,
            fail_responder: Some(key),
        }
    }

    /// Takes the responder's next receive WQE.
    fn take_recv(&mut self, key: QpKey) -> Option<PhysWqe> {
        let qp = self.qps.get_mut(&key)?;
        let wqe = qp.rq.pop_front()?;
        qp.rq_taken += 1;
        let pqp = qp.pqp;
        self.count(key.0, pqp, -1);
        Some(wqe)
    }

    /// Runs up to `budget` WQEs of one QP; returns how many ran.
    fn run_qp(&mut self, key: QpKey, now: Instant, budget: usize) -> usize {
        let mut ran = 0;
        while ran < budget {
            let Some(qp) = self.qps.get_mut(&key) else {
                break;
            };
            if qp.wait.is_some_and(|w| w.due > now) {
                break;
            }
            let Some(wqe) = qp.sq.pop_front() else {
                break;
            };
            let (pqp, offset) = (qp.pqp, qp.sent);
            // Segments only while a higher rank is busy: otherwise the
            // message moves in one go, as before there were ranks.
            let chunk = if self.outranked(key.0) {
                SEGMENT
            } else {
                u64::MAX
            };
            let outcome = self.execute(key, &wqe, offset, chunk);
            if !matches!(outcome, Outcome::Segment(_)) {
                ran += 1;
            }
            let (status, byte_len, fail_responder) = match outcome {
                Outcome::Segment(next) => {
                    if let Some(qp) = self.qps.get_mut(&key) {
                        qp.sq.push_front(wqe);
                        qp.sent = next;
                        qp.wait = None;
                    }
                    self.preempted = true;
                    break;
                }
                Outcome::Complete {
                    status,
                    byte_len,
                    fail_responder,
                } => (status, byte_len, fail_responder),
                Outcome::Rnr(delay) => {
                    if self.wait_again(key, wqe, WaitKind::Rnr, now + delay) {
                        break;
                    }
                    (WcStatus::RnrRetryExcErr, 0, None)
                }
                Outcome::Dropped => {
                    if self.wait_again(key, wqe, WaitKind::Retry, now + RETRY_STEP) {
                        break;
                    }
                    (WcStatus::RetryExcErr, 0, None)
                }
            };
            if let Some(qp) = self.qps.get_mut(&key) {
                qp.wait = None;
                qp.sent = 0;
            }
            self.count(key.0, pqp, -1);
            self.count_sends(key.0, -1);
            self.emit(key.0, pqp, send_cqe(&wqe, status, byte_len));
            if status != WcStatus::Success {
                self.fail_qp(key);
            }
            if let Some(responder) = fail_responder {
                self.fail_qp(responder);
            }
        }
        ran
    }

    /// The rank of `device`'s work ([`UNRANKED`] if unknown).
    fn rank(&self, device: DeviceId) -> u8 {
        self.devices.get(&device).map_or(UNRANKED, |d| d.rank)
    }

    /// The highest rank (lowest number) of the devices that posted send
    /// work within [`BUSY_FOR`] of `now`, if any did.
    fn busy_rank(&self, now: Instant) -> Option<u8> {
        (self.devices.values())
            .filter(|d| {
                d.last_send
                    .is_some_and(|t| now.saturating_duration_since(t) < BUSY_FOR)
            })
            .map(|d| d.rank)
            .min()
    }

    /// Whether a device of a higher rank than `device`'s is busy
    /// ([`SoftNic::busy_rank`], taken once per progress call): then
    /// `device`'s long messages yield between segments.
    fn outranked(&self, device: DeviceId) -> bool {
        self.busy_rank.is_some_and(|busy| busy < self.rank(device))
    }

    /// Puts `wqe` back at the head to retry at `due`, if retries are left.
    fn wait_again(&mut self, key: QpKey, wqe: PhysWqe, kind: WaitKind, due: Instant) -> bool {
        let Some(qp) = self.qps.get_mut(&key) else {
            return false;
        };
        let limit = match (kind, qp.conn) {
            (WaitKind::Rnr, Some(c)) => c.rnr_retry,
            (WaitKind::Retry, Some(c)) => c.retry_cnt,
            (_, None) => 0,
        };
        let left = match qp.wait {
            Some(w) if w.kind == kind => w.left,
            _ => limit,
        };
        if left == 0 {
            return false;
        }
        let infinite = kind == WaitKind::Rnr && limit == 7;
        qp.wait = Some(Wait {
            kind,
            due,
            left: if infinite { left } else { left - 1 },
        });
        qp.sq.push_front(wqe);
        true
    }
}

impl Nic for SoftNic {
    fn attach_device(&mut self, device: DeviceId, lid: u16, pqps: &[u32]) -> Result<(), NicError> {
        if self.devices.contains_key(&device) || self.lids.contains_key(&lid) {
            return Err(NicError::Invalid("device or LID already attached"));
        }
        self.lids.insert(lid, device);
        self.devices.insert(
            device,
            Device {
                lid,
                pqps: pqps.to_vec(),
                slots: HashMap::new(),
                mrs: 0,
                qps: 0,
                outstanding: IdMap::default(),
                sends: 0,
                rank: UNRANKED,
                last_send: None,
            },
        );
        Ok(())
    }

    fn detach_device(&mut self, device: DeviceId) {
        let Some(dev) = self.devices.remove(&device) else {
            return;
        };
        self.lids.remove(&dev.lid);
        self.sends = self.sends.saturating_sub(dev.sends);
        self.qps.retain(|k, _| k.0 != device);
        self.active.retain(|k| k.0 != device);
        let mrs = &mut self.mrs;
        self.rkeys
            .retain(|_, lkey| mrs.get(lkey).is_some_and(|mr| mr.device != device));
        mrs.retain(|_, mr| mr.device != device);
        self.outbox.retain(|c| c.device != device);
    }

    fn add_memory(
        &mut self,
        device: DeviceId,
        slot: u32,
        mem: SharedMapping,
    ) -> Result<(), NicError> {
        let dev = self
            .devices
            .get_mut(&device)
            .ok_or(NicError::UnknownDevice)?;
        if dev.slots.contains_key(&slot) {
            return Err(NicError::SlotExists(slot));
        }
        if dev.slots.len() >= MAX_SLOTS {
            return Err(NicError::Limit("memory slots"));
        }
        dev.slots.insert(slot, Arc::new(mem));
        Ok(())
    }

    fn remove_memory(&mut self, device: DeviceId, slot: u32) -> Result<(), NicError> {
        let dev = self
            .devices
            .get_mut(&device)
            .ok_or(NicError::UnknownDevice)?;
        dev.slots.remove(&slot).ok_or(NicError::UnknownSlot(slot))?;
        for mr in self.mrs.values_mut() {
            if mr.device == device && mr.segments.iter().any(|s| s.slot == slot) {
                mr.revoked = true;
            }
        }
        Ok(())
    }

    fn register_mr(&mut self, device: DeviceId, reg: &MrRegistration) -> Result<(), NicError> {
        let dev = self.devices.get(&device).ok_or(NicError::UnknownDevice)?;
        if reg.lkey == 0 || reg.rkey == 0 || reg.lkey == reg.rkey {
            return Err(NicError::Invalid("keys must be non-zero and distinct"));
        }
        if reg.access & !access::MR_KNOWN != 0 {
            return Err(NicError::Invalid("unknown access flags"));
        }
        if reg.access & (access::REMOTE_WRITE | access::REMOTE_ATOMIC) != 0
            && reg.access & access::LOCAL_WRITE == 0
        {
            return Err(NicError::Invalid(
                "remote write or atomic access needs local write",
            ));
        }
        if reg.iova.checked_add(reg.len).is_none() {
            return Err(NicError::Invalid("IOVA range overflows"));
        }
        let mut sum: u64 = 0;
        for seg in &reg.segments {
            let mem = dev
                .slots
                .get(&seg.slot)
                .ok_or(NicError::UnknownSlot(seg.slot))?;
            let end = seg.offset.checked_add(seg.len);
            if seg.len == 0 || end.is_none_or(|end| end > mem.len() as u64) {
                return Err(NicError::Invalid("segment outside its memory slot"));
            }
            sum = sum
                .checked_add(seg.len)
                .ok_or(NicError::Invalid("segment lengths overflow"))?;
        }
        if sum != reg.len {
            return Err(NicError::Invalid("segment lengths do not add up to len"));
        }
        for key in [reg.lkey, reg.rkey] {
            if self.mrs.contains_key(&key) || self.rkeys.contains_key(&key) {
                return Err(NicError::KeyInUse(key));
            }
        }
        if dev.mrs >= MAX_MRS {
            return Err(NicError::Limit("memory regions"));
        }
        self.mrs.insert(
            reg.lkey,
            Mr {
                device,
                pd: reg.pd,
                access: reg.access,
                iova: reg.iova,
                len: reg.len,
                rkey: reg.rkey,
                segments: reg.segments.clone(),
                revoked: false,
            },
        );
        self.rkeys.insert(reg.rkey, reg.lkey);
        if let Some(dev) = self.devices.get_mut(&device) {
            dev.mrs += 1;
        }
        Ok(())
    }

    fn deregister_mr(&mut self, device: DeviceId, lkey: u32) -> Result<(), NicError> {
        match self.mrs.get(&lkey) {
            Some(mr) if mr.device == device => {}
            _ => return Err(NicError::UnknownKey(lkey)),
        }
        if let Some(mr) = self.mrs.remove(&lkey) {
            self.rkeys.remove(&mr.rkey);
        }
        if let Some(dev) = self.devices.get_mut(&device) {
            dev.mrs = dev.mrs.saturating_sub(1);
        }
        Ok(())
    }

    fn create_qp(
        &mut self,
        device: DeviceId,
        vqpn: u32,
        pd: u32,
        pqp: u32,
    ) -> Result<(), NicError> {
        let dev = self
            .devices
            .get_mut(&device)
            .ok_or(NicError::UnknownDevice)?;
        if !dev.pqps.contains(&pqp) {
            return Err(NicError::ForeignPqp(pqp));
        }
        if self.qps.contains_key(&(device, vqpn)) {
            return Err(NicError::QpExists(vqpn));
        }
        if dev.qps >= MAX_QPS {
            return Err(NicError::Limit("virtual QPs"));
        }
        dev.qps += 1;
        self.qps.insert(
            (device, vqpn),
            Qp {
                pqp,
                pd,
                state: QpState::Reset,
                conn: None,
                access: 0,
                sq: VecDeque::new(),
                rq: VecDeque::new(),
                wait: None,
                active: false,
                sent: 0,
                rq_taken: 0,
                recv_seq: 0,
            },
        );
        Ok(())
    }

    fn connect_qp(&mut self, device: DeviceId, conn: &QpConnection) -> Result<(), NicError> {
        if !(1..=0xbfff).contains(&conn.dest_lid) {
            return Err(NicError::Invalid("destination LID is not unicast"));
        }
        if conn.dest_qpn > 0xff_ffff {
            return Err(NicError::Invalid("destination QP number exceeds 24 bits"));
        }
        if conn.access & !access::QP_SUPPORTED != 0 {
            return Err(NicError::Invalid("unknown QP access flags"));
        }
        if conn.rnr_retry > 7 || conn.retry_cnt > 7 || conn.min_rnr_timer > 31 {
            return Err(NicError::Invalid("retry counts or RNR timer out of range"));
        }
        let qp = self.qp_mut(device, conn.vqpn)?;
        if qp.state == QpState::Error {
            return Err(NicError::Invalid("QP is in the error state"));
        }
        qp.conn = Some(*conn);
        qp.access = conn.access;
        qp.state = QpState::Ready;
        Ok(())
    }

    fn set_qp_access(&mut self, device: DeviceId, vqpn: u32, flags: u32) -> Result<(), NicError> {
        if flags & !access::QP_SUPPORTED != 0 {
            return Err(NicError::Invalid("unknown QP access flags"));
        }
        self.qp_mut(device, vqpn)?.access = flags;
        Ok(())
    }

    fn error_qp(&mut self, device: DeviceId, vqpn: u32) -> Result<(), NicError> {
        self.qp_mut(device, vqpn)?;
        self.fail_qp((device, vqpn));
        Ok(())
    }

    fn reset_qp(&mut self, device: DeviceId, vqpn: u32) -> Result<(), NicError> {
        self.qp_mut(device, vqpn)?;
        self.discard_work((device, vqpn));
        let qp = self.qp_mut(device, vqpn)?;
        qp.state = QpState::Reset;
        qp.conn = None;
        qp.access = 0;
        Ok(())
    }

    fn destroy_qp(&mut self, device: DeviceId, vqpn: u32) -> Result<(), NicError> {
        self.qp_mut(device, vqpn)?;
        self.discard_work((device, vqpn));
        self.qps.remove(&(device, vqpn));
        if let Some(dev) = self.devices.get_mut(&device) {
            dev.qps = dev.qps.saturating_sub(1);
        }
        Ok(())
    }

    fn post(&mut self, device: DeviceId, pqp: u32, wqe: &PhysWqe) {
        if !self
            .devices
            .get(&device)
            .is_some_and(|d| d.pqps.contains(&pqp))
        {
            return;
        }
        let key = (device, wqe.vqpn.get());
        let Some(qp) = self.qps.get_mut(&key).filter(|qp| qp.pqp == pqp) else {
            self.emit(device, pqp, orphan_cqe(wqe));
            return;
        };
        let error = qp.state == QpState::Error;
        match wqe.kind {
            kind::RECV if error => self.emit(device, pqp, recv_cqe(wqe, WcStatus::WrFlushErr)),
            kind::RECV if wqe.sges().is_none() => self.emit(device, pqp, orphan_cqe(wqe)),
            kind::RECV => {
                qp.rq.push_back(*wqe);
                self.count(device, pqp, 1);
            }
            kind::SEND if error => {
                self.emit(device, pqp, send_cqe(wqe, WcStatus::WrFlushErr, 0));
            }
            kind::SEND => {
                qp.sq.push_back(*wqe);
                if !qp.active {
                    qp.active = true;
                    self.active.push_back(key);
                }
                let clock = self.clock;
                if let Some(dev) = self.devices.get_mut(&device) {
                    dev.last_send = clock;
                }
                self.count(device, pqp, 1);
                self.count_sends(device, 1);
            }
            _ => self.emit(device, pqp, orphan_cqe(wqe)),
        }
    }

    fn outstanding(&self, device: DeviceId, pqp: u32) -> usize {
        self.devices
            .get(&device)
            .and_then(|d| d.outstanding.get(&pqp).copied())
            .unwrap_or(0)
    }

    fn queued_sends(&self, device: DeviceId) -> usize {
        self.devices.get(&device).map_or(0, |d| d.sends)
    }

    fn total_queued_sends(&self) -> usize {
        self.sends
    }

    fn set_rank(&mut self, device: DeviceId, rank: u8) {
        if let Some(dev) = self.devices.get_mut(&device) {
            dev.rank = rank;
        }
    }

    fn progress(&mut self, now: Instant, budget: usize) -> Progress {
        self.clock = Some(now);
        // Nothing posts during a progress call: one look at the devices
        // serves every QP it runs.
        self.busy_rank = self.busy_rank(now);
        let mut progress = Progress::default();
        let mut spent = 0;
        // A long message that stopped between segments heads the queue:
        // the work of higher ranks it stopped for goes first.
        if let Some(&front) = self.active.front() {
            if self.qps.get(&front).is_some_and(|qp| qp.sent > 0) {
                let rank = self.rank(front.0);
                let higher: Vec<QpKey> = (self.active.iter())
                    .filter(|k| self.rank(k.0) < rank)
                    .copied()
                    .collect();
                for key in higher {
                    let ran = self.run_qp(key, now, QP_BATCH);
                    spent += ran;
                    progress.worked |= ran > 0;
                }
                // One of them may have stopped for a still higher rank; it
                // goes on at its turn.
                self.preempted = false;
            }
        }
        for _ in 0..self.active.len() {
            let Some(key) = self.active.pop_front() else {
                break;
            };
            let Some(qp) = self.qps.get_mut(&key) else {
                continue;
            };
            if qp.sq.is_empty() {
                qp.active = false;
                continue;
            }
            if spent < budget {
                let ran = self.run_qp(key, now, QP_BATCH.min(budget - spent));
                spent += ran;
                progress.worked |= ran > 0;
                if std::mem::take(&mut self.preempted) {
                    // Stopped between segments: it keeps the head, and the
                    // caller comes back at once with new work admitted.
                    self.active.push_front(key);
                    progress.worked = true;
                    progress.busy = true;
                    progress.preempted = true;
                    return progress;
                }
            }
            let Some(qp) = self.qps.get_mut(&key) else {
                continue;
            };
            if qp.sq.is_empty() {
                qp.active = false;
                continue;
            }
            match qp.wait {
                Some(w) if w.due > now => {
                    progress.next_due = Some(progress.next_due.map_or(w.due, |d| d.min(w.due)));
                }
                _ => progress.busy = true,
            }
            self.active.push_back(key);
        }
        progress
    }

    fn take_completions(&mut self, out: &mut Vec<Completion>) {
        out.append(&mut self.outbox);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vrdma_hostd_protocol::messages::MrSegment;
    use vrdma_hostd_protocol::shm::sealed_memfd;

    const A: DeviceId = 1;
    const B: DeviceId = 2;
    const LID_A: u16 = 10;
    const LID_B: u16 = 20;
    const PQP_A: u32 = 0;
    const PQP_B: u32 = 1;
    const QP_A: u32 = 100;
    const QP_B: u32 = 200;
    const MEM: u64 = 64 * 1024;
    const IOVA: u64 = 0x10_0000;
    // Keys: A's MR lkey 0xa1 / rkey 0xa2; B's 0xb1 / 0xb2.
    const ALL: u32 =
        access::LOCAL_WRITE | access::REMOTE_WRITE | access::REMOTE_READ | access::REMOTE_ATOMIC;

    /// Two devices on one NIC, each with one 64 KiB slot fully registered
    /// and one QP connected to the other's.
    struct Env {
        nic: SoftNic,
        mem_a: SharedMapping,
        mem_b: SharedMapping,
        now: Instant,
    }

    fn slot(name: &str) -> (SharedMapping, SharedMapping) {
        let file = sealed_memfd(name, MEM).expect("memfd");
        let twin = file.try_clone().expect("dup");
        (
            SharedMapping::map(file, 0, MEM).expect("map"),
            SharedMapping::map(twin, 0, MEM).expect("map"),
        )
    }

    fn reg(lkey: u32, rkey: u32, access: u32, iova: u64, len: u64, offset: u64) -> MrRegistration {
        MrRegistration {
            lkey,
            rkey,
            pd: 1,
            access,
            iova,
            len,
            segments: vec![MrSegment {
                slot: 0,
                offset,
                len,
            }],
        }
    }

    fn conn(vqpn: u32, dest_lid: u16, dest_qpn: u32) -> QpConnection {
        QpConnection {
            vqpn,
            dest_lid,
            dest_qpn,
            access: access::QP_SUPPORTED,
            rnr_retry: 7,
            retry_cnt: 3,
            min_rnr_timer: 1,
        }
    }

    impl Env {
        fn new() -> Self {
            let mut nic = SoftNic::new();
            let (mem_a, nic_a) = slot("a");
            let (mem_b, nic_b) = slot("b");
            nic.attach_device(A, LID_A, &[PQP_A]).expect("attach");
            nic.attach_device(B, LID_B, &[PQP_B]).expect("attach");
            nic.add_memory(A, 0, nic_a).expect("mem");
            nic.add_memory(B, 0, nic_b).expect("mem");
            nic.register_mr(A, &reg(0xa1, 0xa2, ALL, IOVA, MEM, 0))
                .expect("mr");
            nic.register_mr(B, &reg(0xb1, 0xb2, ALL, IOVA, MEM, 0))
                .expect("mr");
            nic.create_qp(A, QP_A, 1, PQP_A).expect("qp");
            nic.create_qp(B, QP_B, 1, PQP_B).expect("qp");
            nic.connect_qp(A, &conn(QP_A, LID_B, QP_B)).expect("conn");
            nic.connect_qp(B, &conn(QP_B, LID_A, QP_A)).expect("conn");
            Env {
                nic,
                mem_a,
                mem_b,
                now: Instant::now(),
            }
        }

        /// Runs until nothing is runnable now; returns the completions.
        fn run(&mut self) -> Vec<Completion> {
            for _ in 0..1000 {
                if !self.nic.progress(self.now, 64).busy {
                    break;
                }
            }
            let mut out = Vec::new();
            self.nic.take_completions(&mut out);
            out
        }

        /// Advances the modelled clock, then runs.
        fn advance(&mut self, by: Duration) -> Vec<Completion> {
            self.now += by;
            self.run()
        }
    }

    fn sge(addr: u64, length: u32, lkey: u32) -> Sge {
        Sge {
            addr: addr.into(),
            length: length.into(),
            lkey: lkey.into(),
        }
    }

    fn send(token: u64, vqpn: u32, op: SendOpcode, sges: &[Sge]) -> PhysWqe {
        let mut wqe = PhysWqe {
            token: token.into(),
            kind: kind::SEND,
            opcode: op.into(),
            flags: send_flags::SIGNALED,
            vqpn: vqpn.into(),
            ..PhysWqe::default()
        };
        assert!(wqe.set_sges(sges));
        wqe
    }

    fn remote(mut wqe: PhysWqe, addr: u64, rkey: u32) -> PhysWqe {
        wqe.remote_addr = addr.into();
        wqe.rkey = rkey.into();
        wqe
    }

    fn recv(token: u64, vqpn: u32, sges: &[Sge]) -> PhysWqe {
        let mut wqe = PhysWqe {
            token: token.into(),
            kind: kind::RECV,
            vqpn: vqpn.into(),
            ..PhysWqe::default()
        };
        assert!(wqe.set_sges(sges));
        wqe
    }

    fn fill(mem: &SharedMapping, offset: u64, data: &[u8]) {
        assert!(mem.write(offset as usize, data));
    }

    fn bytes(mem: &SharedMapping, offset: u64, len: usize) -> Vec<u8> {
        let mut out = vec![0; len];
        assert!(mem.read(offset as usize, &mut out));
        out
    }

    fn status(c: &Completion) -> WcStatus {
        WcStatus::try_from(c.cqe.status).expect("valid status")
    }

    /// (device, pqp, token, status) of each completion.
    fn summary(cs: &[Completion]) -> Vec<(DeviceId, u32, u64, WcStatus)> {
        cs.iter()
            .map(|c| (c.device, c.pqp, c.cqe.token.get(), status(c)))
            .collect()
    }

    #[test]
    fn rdma_write_moves_bytes_and_marks_unsignaled() {
        let mut env = Env::new();
        fill(&env.mem_a, 0x100, b"hello, tenant b");
        let wqe = remote(
            send(
                1,
                QP_A,
                SendOpcode::RdmaWrite,
                &[sge(IOVA + 0x100, 15, 0xa1)],
            ),
            IOVA + 0x2000,
            0xb2,
        );
        env.nic.post(A, PQP_A, &wqe);
        assert_eq!(env.nic.outstanding(A, PQP_A), 1);
        let cs = env.run();
        assert_eq!(summary(&cs), vec![(A, PQP_A, 1, WcStatus::Success)]);
        assert_eq!(cs[0].cqe.opcode, u8::from(WcOpcode::RdmaWrite));
        assert_eq!(cs[0].cqe.kind, kind::SEND);
        assert_eq!(cs[0].cqe.vqpn.get(), QP_A);
        assert_eq!(cs[0].cqe.wc_flags, 0);
        assert_eq!(bytes(&env.mem_b, 0x2000, 15), b"hello, tenant b");
        assert_eq!(env.nic.outstanding(A, PQP_A), 0);

        let mut unsignaled = wqe;
        unsignaled.flags = 0;
        unsignaled.token = 2.into();
        env.nic.post(A, PQP_A, &unsignaled);
        let cs = env.run();
        assert_eq!(summary(&cs), vec![(A, PQP_A, 2, WcStatus::Success)]);
        assert_eq!(cs[0].cqe.wc_flags, WC_UNSIGNALED);
    }

    #[test]
    fn send_gathers_and_scatters_with_receive_fields() {
        let mut env = Env::new();
        fill(&env.mem_a, 0, b"0123456789");
        fill(&env.mem_a, 0x1000, b"abcdef");
        env.nic.post(
            B,
            PQP_B,
            &recv(
                7,
                QP_B,
                &[sge(IOVA + 0x500, 4, 0xb1), sge(IOVA + 0x900, 64, 0xb1)],
            ),
        );
        let mut wqe = send(
            1,
            QP_A,
            SendOpcode::SendWithImm,
            &[sge(IOVA, 10, 0xa1), sge(IOVA + 0x1000, 6, 0xa1)],
        );
        wqe.imm_data = [1, 2, 3, 4];
        env.nic.post(A, PQP_A, &wqe);
        let cs = env.run();
        assert_eq!(
            summary(&cs),
            vec![
                (B, PQP_B, 7, WcStatus::Success),
                (A, PQP_A, 1, WcStatus::Success)
            ]
        );
        let rc = cs[0].cqe;
        assert_eq!(rc.kind, kind::RECV);
        assert_eq!(rc.opcode, u8::from(WcOpcode::Recv));
        assert_eq!(rc.byte_len.get(), 16);
        assert_eq!(rc.imm_data, [1, 2, 3, 4]);
        assert_eq!(rc.wc_flags, wc_flags::WITH_IMM);
        assert_eq!(rc.src_qp.get(), QP_A);
        assert_eq!(rc.slid.get(), LID_A);
        assert_eq!(rc.vqpn.get(), QP_B);
        assert_eq!(cs[1].cqe.opcode, u8::from(WcOpcode::Send));
        assert_eq!(bytes(&env.mem_b, 0x500, 4), b"0123");
        assert_eq!(bytes(&env.mem_b, 0x900, 12), b"456789abcdef");
    }

    #[test]
    fn inline_send_and_write_with_imm() {
        let mut env = Env::new();
        env.nic
            .post(B, PQP_B, &recv(1, QP_B, &[sge(IOVA, 32, 0xb1)]));
        env.nic.post(B, PQP_B, &recv(2, QP_B, &[]));
        let mut wqe = send(10, QP_A, SendOpcode::Send, &[]);
        wqe.flags |= send_flags::INLINE;
        wqe.inline_len = 5.into();
        wqe.payload[..5].copy_from_slice(b"inlin");
        env.nic.post(A, PQP_A, &wqe);
        fill(&env.mem_a, 0x40, b"imm-write");
        let mut wqe = remote(
            send(
                11,
                QP_A,
                SendOpcode::RdmaWriteWithImm,
                &[sge(IOVA + 0x40, 9, 0xa1)],
            ),
            IOVA + 0x3000,
            0xb2,
        );
        wqe.imm_data = [9, 9, 9, 9];
        env.nic.post(A, PQP_A, &wqe);
        let cs = env.run();
        assert_eq!(
            summary(&cs),
            vec![
                (B, PQP_B, 1, WcStatus::Success),
                (A, PQP_A, 10, WcStatus::Success),
                (B, PQP_B, 2, WcStatus::Success),
                (A, PQP_A, 11, WcStatus::Success),
            ]
        );
        assert_eq!(bytes(&env.mem_b, 0, 5), b"inlin");
        assert_eq!(cs[0].cqe.byte_len.get(), 5);
        assert_eq!(bytes(&env.mem_b, 0x3000, 9), b"imm-write");
        let rc = cs[2].cqe;
        assert_eq!(rc.opcode, u8::from(WcOpcode::RecvRdmaWithImm));
        assert_eq!(rc.byte_len.get(), 9);
        assert_eq!(rc.imm_data, [9, 9, 9, 9]);
        assert_eq!(rc.wc_flags, wc_flags::WITH_IMM);
        assert_eq!(cs[3].cqe.opcode, u8::from(WcOpcode::RdmaWrite));
    }

    #[test]
    fn rdma_read_and_atomics() {
        let mut env = Env::new();
        fill(&env.mem_b, 0x800, b"remote data!");
        env.nic.post(
            A,
            PQP_A,
            &remote(
                send(1, QP_A, SendOpcode::RdmaRead, &[sge(IOVA + 0x10, 12, 0xa1)]),
                IOVA + 0x800,
                0xb2,
            ),
        );
        fill(&env.mem_b, 0x1000, &40u64.to_le_bytes());
        let mut cas = remote(
            send(
                2,
                QP_A,
                SendOpcode::AtomicCmpAndSwp,
                &[sge(IOVA + 0x100, 8, 0xa1)],
            ),
            IOVA + 0x1000,
            0xb2,
        );
        cas.compare_add = 40.into();
        cas.swap = 77.into();
        env.nic.post(A, PQP_A, &cas);
        let mut cas_miss = cas;
        cas_miss.token = 3.into();
        cas_miss.swap = 99.into();
        cas_miss.set_sges(&[sge(IOVA + 0x108, 8, 0xa1)]);
        env.nic.post(A, PQP_A, &cas_miss);
        let mut faa = remote(
            send(
                4,
                QP_A,
                SendOpcode::AtomicFetchAndAdd,
                &[sge(IOVA + 0x110, 8, 0xa1)],
            ),
            IOVA + 0x1000,
            0xb2,
        );
        faa.compare_add = 3.into();
        env.nic.post(A, PQP_A, &faa);
        let cs = env.run();
        assert!(cs.iter().all(|c| status(c) == WcStatus::Success), "{cs:?}");
        assert_eq!(
            cs.iter().map(|c| c.cqe.opcode).collect::<Vec<_>>(),
            vec![
                u8::from(WcOpcode::RdmaRead),
                u8::from(WcOpcode::CompSwap),
                u8::from(WcOpcode::CompSwap),
                u8::from(WcOpcode::FetchAdd),
            ]
        );
        assert_eq!(cs[0].cqe.byte_len.get(), 12);
        assert_eq!(bytes(&env.mem_a, 0x10, 12), b"remote data!");
        let word = |mem: &SharedMapping, off| {
            u64::from_le_bytes(bytes(mem, off, 8).try_into().expect("8 bytes"))
        };
        assert_eq!(word(&env.mem_a, 0x100), 40, "CAS returns the original");
        assert_eq!(
            word(&env.mem_a, 0x108),
            77,
            "failed CAS returns the current"
        );
        assert_eq!(word(&env.mem_a, 0x110), 77, "FAA returns the original");
        assert_eq!(word(&env.mem_b, 0x1000), 80);
    }

    #[test]
    fn atomic_misaligned_or_wrong_local_length() {
        let mut env = Env::new();
        env.nic.post(
            A,
            PQP_A,
            &remote(
                send(
                    1,
                    QP_A,
                    SendOpcode::AtomicFetchAndAdd,
                    &[sge(IOVA, 8, 0xa1)],
                ),
                IOVA + 4,
                0xb2,
            ),
        );
        assert_eq!(
            summary(&env.run()),
            vec![(A, PQP_A, 1, WcStatus::RemInvReqErr)]
        );
        let mut env = Env::new();
        env.nic.post(
            A,
            PQP_A,
            &remote(
                send(
                    1,
                    QP_A,
                    SendOpcode::AtomicFetchAndAdd,
                    &[sge(IOVA, 4, 0xa1)],
                ),
                IOVA,
                0xb2,
            ),
        );
        assert_eq!(
            summary(&env.run()),
            vec![(A, PQP_A, 1, WcStatus::LocLenErr)]
        );
    }

    /// Posts one WRITE of 8 bytes into B at `addr` with `rkey` from local
    /// `lsge`; returns the requester status and whether B's bytes stayed.
    fn write_status(env: &mut Env, lsge: Sge, addr: u64, rkey: u32) -> WcStatus {
        fill(&env.mem_a, 0, b"AAAAAAAA");
        let before = bytes(&env.mem_b, 0, MEM as usize);
        env.nic.post(
            A,
            PQP_A,
            &remote(send(1, QP_A, SendOpcode::RdmaWrite, &[lsge]), addr, rkey),
        );
        let cs = env.run();
        assert_eq!(cs[0].device, A);
        let st = status(&cs[0]);
        if st != WcStatus::Success {
            assert_eq!(bytes(&env.mem_b, 0, MEM as usize), before, "B untouched");
        }
        st
    }

    #[test]
    fn local_protection_errors() {
        // Unknown lkey, a range past the MR, another device's lkey, READ
        // into an MR without LOCAL_WRITE.
        let cases = [
            sge(IOVA, 8, 0x77),
            sge(IOVA + MEM - 4, 8, 0xa1),
            sge(IOVA, 8, 0xb1),
            sge(u64::MAX - 2, 8, 0xa1),
        ];
        for lsge in cases {
            let mut env = Env::new();
            assert_eq!(
                write_status(&mut env, lsge, IOVA, 0xb2),
                WcStatus::LocProtErr,
                "{lsge:?}"
            );
        }
        let mut env = Env::new();
        env.nic
            .register_mr(A, &reg(0xa5, 0xa6, access::REMOTE_READ, 0, 64, 0))
            .expect("read-only mr");
        env.nic.post(
            A,
            PQP_A,
            &remote(
                send(1, QP_A, SendOpcode::RdmaRead, &[sge(0, 8, 0xa5)]),
                IOVA,
                0xb2,
            ),
        );
        assert_eq!(
            summary(&env.run()),
            vec![(A, PQP_A, 1, WcStatus::LocProtErr)]
        );
        // A PD mismatch is a protection error too.
        let mut env = Env::new();
        let mut other_pd = reg(0xa7, 0xa8, ALL, 0, 64, 0);
        other_pd.pd = 2;
        env.nic.register_mr(A, &other_pd).expect("mr");
        assert_eq!(
            write_status(&mut env, sge(0, 8, 0xa7), IOVA, 0xb2),
            WcStatus::LocProtErr
        );
    }

    #[test]
    fn remote_access_errors_leave_the_responder_working() {
        let lsge = sge(IOVA, 8, 0xa1);
        // Unknown rkey; A's own rkey aimed at B (foreign owner); past the
        // MR; overflowing address.
        for (addr, rkey) in [
            (IOVA, 0x99),
            (IOVA, 0xa2),
            (IOVA + MEM - 4, 0xb2),
            (u64::MAX - 3, 0xb2),
        ] {
            let mut env = Env::new();
            assert_eq!(
                write_status(&mut env, lsge, addr, rkey),
                WcStatus::RemAccessErr
            );
        }
        // MR without REMOTE_WRITE.
        let mut env = Env::new();
        env.nic
            .register_mr(B, &reg(0xb5, 0xb6, access::REMOTE_READ, 0, 64, 0))
            .expect("mr");
        assert_eq!(
            write_status(&mut env, lsge, 0, 0xb6),
            WcStatus::RemAccessErr
        );
        // The responder QP does not grant REMOTE_WRITE.
        let mut env = Env::new();
        env.nic
            .set_qp_access(B, QP_B, access::REMOTE_READ)
            .expect("access");
        assert_eq!(
            write_status(&mut env, lsge, IOVA, 0xb2),
            WcStatus::RemAccessErr
        );
        // B is unaffected: it still sends to A (A's QP is in ERR now, so
        // reconnect a fresh one).
        env.nic.reset_qp(A, QP_A).expect("reset");
        env.nic
            .connect_qp(A, &conn(QP_A, LID_B, QP_B))
            .expect("conn");
        fill(&env.mem_b, 0, b"still ok");
        env.nic.post(
            B,
            PQP_B,
            &remote(
                send(5, QP_B, SendOpcode::RdmaWrite, &[sge(IOVA, 8, 0xb1)]),
                IOVA + 64,
                0xa2,
            ),
        );
        assert_eq!(summary(&env.run()), vec![(B, PQP_B, 5, WcStatus::Success)]);
        assert_eq!(bytes(&env.mem_a, 64, 8), b"still ok");
    }

    #[test]
    fn short_receive_fails_both_sides() {
        let mut env = Env::new();
        env.nic
            .post(B, PQP_B, &recv(1, QP_B, &[sge(IOVA, 4, 0xb1)]));
        env.nic
            .post(B, PQP_B, &recv(2, QP_B, &[sge(IOVA, 64, 0xb1)]));
        env.nic.post(
            A,
            PQP_A,
            &send(3, QP_A, SendOpcode::Send, &[sge(IOVA, 8, 0xa1)]),
        );
        env.nic.post(
            A,
            PQP_A,
            &send(4, QP_A, SendOpcode::Send, &[sge(IOVA, 8, 0xa1)]),
        );
        let cs = env.run();
        assert_eq!(
            summary(&cs),
            vec![
                (B, PQP_B, 1, WcStatus::LocLenErr),
                (A, PQP_A, 3, WcStatus::RemInvReqErr),
                (A, PQP_A, 4, WcStatus::WrFlushErr),
                (B, PQP_B, 2, WcStatus::WrFlushErr),
            ]
        );
        assert_eq!(cs[3].cqe.kind, kind::RECV);
    }

    #[test]
    fn unsupported_opcodes_are_local_qp_errors() {
        for op in [
            SendOpcode::LocalInv,
            SendOpcode::BindMw,
            SendOpcode::SendWithInv,
        ] {
            let mut env = Env::new();
            env.nic.post(A, PQP_A, &send(1, QP_A, op, &[]));
            assert_eq!(
                summary(&env.run()),
                vec![(A, PQP_A, 1, WcStatus::LocQpOpErr)]
            );
        }
        let mut env = Env::new();
        let mut bogus = send(1, QP_A, SendOpcode::Send, &[]);
        bogus.opcode = 200;
        env.nic.post(A, PQP_A, &bogus);
        assert_eq!(
            summary(&env.run()),
            vec![(A, PQP_A, 1, WcStatus::LocQpOpErr)]
        );
    }

    #[test]
    fn rnr_waits_for_a_receive_then_succeeds() {
        let mut env = Env::new();
        // B advertises code 14 = 1.28 ms.
        env.nic
            .connect_qp(
                B,
                &QpConnection {
                    min_rnr_timer: 14,
                    ..conn(QP_B, LID_A, QP_A)
                },
            )
            .expect("conn");
        fill(&env.mem_a, 0, b"late");
        env.nic.post(
            A,
            PQP_A,
            &send(1, QP_A, SendOpcode::Send, &[sge(IOVA, 4, 0xa1)]),
        );
        assert!(env.run().is_empty());
        let due = env.nic.progress(env.now, 64).next_due.expect("waiting");
        assert_eq!(due - env.now, Duration::from_micros(1280));
        env.nic
            .post(B, PQP_B, &recv(2, QP_B, &[sge(IOVA, 16, 0xb1)]));
        assert!(
            env.advance(Duration::from_micros(1000)).is_empty(),
            "not yet due"
        );
        let cs = env.advance(Duration::from_micros(300));
        assert_eq!(
            summary(&cs),
            vec![
                (B, PQP_B, 2, WcStatus::Success),
                (A, PQP_A, 1, WcStatus::Success)
            ]
        );
        assert_eq!(bytes(&env.mem_b, 0, 4), b"late");
    }

    #[test]
    fn queued_sends_count_what_the_nic_holds() {
        let mut env = Env::new();
        let send_a = |t| send(t, QP_A, SendOpcode::Send, &[sge(IOVA, 4, 0xa1)]);
        // Receives do not count; sends waiting for a receive (RNR) do.
        env.nic
            .post(A, PQP_A, &recv(9, QP_A, &[sge(IOVA, 16, 0xa1)]));
        for t in 1..=3 {
            env.nic.post(A, PQP_A, &send_a(t));
        }
        assert_eq!(
            (env.nic.queued_sends(A), env.nic.total_queued_sends()),
            (3, 3)
        );
        assert!(env.run().is_empty(), "B has no receive");
        assert_eq!(env.nic.queued_sends(A), 3);
        // One receive: one send completes.
        env.nic
            .post(B, PQP_B, &recv(20, QP_B, &[sge(IOVA, 16, 0xb1)]));
        env.advance(Duration::from_millis(1));
        assert_eq!(env.nic.queued_sends(A), 2);
        // ERR flushes the rest; reset and destroy discard without completions.
        env.nic.error_qp(A, QP_A).expect("error");
        assert_eq!(env.nic.queued_sends(A), 0);
        env.nic.reset_qp(A, QP_A).expect("reset");
        env.nic
            .connect_qp(A, &conn(QP_A, LID_B, QP_B))
            .expect("conn");
        env.nic.post(A, PQP_A, &send_a(4));
        env.nic.post(
            B,
            PQP_B,
            &send(5, QP_B, SendOpcode::Send, &[sge(IOVA, 4, 0xb1)]),
        );
        assert_eq!(env.nic.total_queued_sends(), 2);
        env.nic.destroy_qp(A, QP_A).expect("destroy");
        assert_eq!(
            (env.nic.queued_sends(A), env.nic.total_queued_sends()),
            (0, 1)
        );
        env.nic.detach_device(B);
        assert_eq!(env.nic.total_queued_sends(), 0);
    }

    #[test]
    fn rnr_retries_run_out() {
        let mut env = Env::new();
        env.nic
            .connect_qp(
                A,
                &QpConnection {
                    rnr_retry: 2,
                    ..conn(QP_A, LID_B, QP_B)
                },
            )
            .expect("conn");
        env.nic.post(
            A,
            PQP_A,
            &send(1, QP_A, SendOpcode::Send, &[sge(IOVA, 4, 0xa1)]),
        );
        assert!(env.run().is_empty());
        // Two retries: the first is NAKed again, the second NAK is final.
        assert!(env.advance(rnr_timer(1)).is_empty(), "retry 1");
        assert_eq!(
            summary(&env.advance(rnr_timer(1))),
            vec![(A, PQP_A, 1, WcStatus::RnrRetryExcErr)]
        );
        // rnr_retry 0: the first RNR NAK is final.
        let mut env = Env::new();
        env.nic
            .connect_qp(
                A,
                &QpConnection {
                    rnr_retry: 0,
                    ..conn(QP_A, LID_B, QP_B)
                },
            )
            .expect("conn");
        env.nic
            .post(A, PQP_A, &send(1, QP_A, SendOpcode::RdmaWriteWithImm, &[]));
        assert_eq!(
            summary(&env.run()),
            vec![(A, PQP_A, 1, WcStatus::RnrRetryExcErr)]
        );
    }

    #[test]
    fn rnr_timer_table() {
        assert_eq!(rnr_timer(0), Duration::from_micros(655_360));
        assert_eq!(rnr_timer(1), Duration::from_micros(10));
        assert_eq!(rnr_timer(5), Duration::from_micros(60));
        assert_eq!(rnr_timer(18), Duration::from_micros(5_120));
        assert_eq!(rnr_timer(31), Duration::from_micros(491_520));
    }

    /// Runs a signaled write from A and lets the modelled retries lapse.
    fn write_after_retries(env: &mut Env) -> Vec<Completion> {
        fill(&env.mem_a, 0, b"XXXXXXXX");
        env.nic.post(
            A,
            PQP_A,
            &remote(
                send(1, QP_A, SendOpcode::RdmaWrite, &[sge(IOVA, 8, 0xa1)]),
                IOVA,
                0xb2,
            ),
        );
        let mut cs = env.run();
        for _ in 0..8 {
            if !cs.is_empty() {
                break;
            }
            cs = env.advance(RETRY_STEP);
        }
        cs
    }

    #[test]
    fn unreachable_responders_give_retry_exceeded() {
        type Breaker = fn(&mut SoftNic);
        let breakers: [(&str, Breaker); 4] = [
            ("destroyed", |nic| nic.destroy_qp(B, QP_B).expect("destroy")),
            ("reset", |nic| nic.reset_qp(B, QP_B).expect("reset")),
            ("device gone", |nic| nic.detach_device(B)),
            ("connected elsewhere", |nic| {
                nic.reset_qp(B, QP_B).expect("reset");
                nic.connect_qp(B, &conn(QP_B, LID_A, QP_A + 1))
                    .expect("conn");
            }),
        ];
        for (what, brk) in breakers {
            let mut env = Env::new();
            brk(&mut env.nic);
            let before = bytes(&env.mem_b, 0, 8);
            let cs = write_after_retries(&mut env);
            assert_eq!(
                summary(&cs),
                vec![(A, PQP_A, 1, WcStatus::RetryExcErr)],
                "{what}"
            );
            assert_eq!(bytes(&env.mem_b, 0, 8), before, "{what}");
        }
    }

    #[test]
    fn dropped_packets_recover_when_the_responder_comes_back() {
        let mut env = Env::new();
        env.nic.reset_qp(B, QP_B).expect("reset");
        fill(&env.mem_a, 0, b"retried!");
        env.nic.post(
            A,
            PQP_A,
            &remote(
                send(1, QP_A, SendOpcode::RdmaWrite, &[sge(IOVA, 8, 0xa1)]),
                IOVA,
                0xb2,
            ),
        );
        assert!(env.run().is_empty());
        env.nic
            .connect_qp(B, &conn(QP_B, LID_A, QP_A))
            .expect("conn");
        let cs = env.advance(RETRY_STEP);
        assert_eq!(summary(&cs), vec![(A, PQP_A, 1, WcStatus::Success)]);
        assert_eq!(bytes(&env.mem_b, 0, 8), b"retried!");
    }

    #[test]
    fn revoked_keys_and_memory_are_never_touched() {
        let lsge = sge(IOVA, 8, 0xa1);
        // Deregistered rkey between post and execution.
        let mut env = Env::new();
        fill(&env.mem_a, 0, b"AAAAAAAA");
        env.nic.post(
            A,
            PQP_A,
            &remote(send(1, QP_A, SendOpcode::RdmaWrite, &[lsge]), IOVA, 0xb2),
        );
        env.nic.deregister_mr(B, 0xb1).expect("dereg");
        assert_eq!(
            summary(&env.run()),
            vec![(A, PQP_A, 1, WcStatus::RemAccessErr)]
        );
        assert_eq!(bytes(&env.mem_b, 0, 8), [0; 8]);
        // Removed memory slot under the target MR.
        let mut env = Env::new();
        fill(&env.mem_a, 0, b"AAAAAAAA");
        env.nic.post(
            A,
            PQP_A,
            &remote(send(1, QP_A, SendOpcode::RdmaWrite, &[lsge]), IOVA, 0xb2),
        );
        env.nic.remove_memory(B, 0).expect("remove");
        assert_eq!(
            summary(&env.run()),
            vec![(A, PQP_A, 1, WcStatus::RemAccessErr)]
        );
        assert_eq!(bytes(&env.mem_b, 0, 8), [0; 8]);
        // Re-adding a slot does not bring the revoked MR back.
        let (_, again) = slot("again");
        env.nic.add_memory(B, 0, again).expect("re-add");
        env.nic.reset_qp(A, QP_A).expect("reset");
        env.nic
            .connect_qp(A, &conn(QP_A, LID_B, QP_B))
            .expect("conn");
        env.nic.post(
            A,
            PQP_A,
            &remote(send(2, QP_A, SendOpcode::RdmaWrite, &[lsge]), IOVA, 0xb2),
        );
        assert_eq!(
            summary(&env.run()),
            vec![(A, PQP_A, 2, WcStatus::RemAccessErr)]
        );
        // A receive posted then its lkey deregistered: the SEND fails on
        // the responder, which writes nothing.
        let mut env = Env::new();
        fill(&env.mem_a, 0, b"AAAAAAAA");
        env.nic
            .post(B, PQP_B, &recv(9, QP_B, &[sge(IOVA, 64, 0xb1)]));
        env.nic.deregister_mr(B, 0xb1).expect("dereg");
        env.nic
            .post(A, PQP_A, &send(1, QP_A, SendOpcode::Send, &[lsge]));
        assert_eq!(
            summary(&env.run()),
            vec![
                (B, PQP_B, 9, WcStatus::LocProtErr),
                (A, PQP_A, 1, WcStatus::RemOpErr)
            ]
        );
        assert_eq!(bytes(&env.mem_b, 0, 8), [0; 8]);
        // A destroyed requester QP executes nothing and completes nothing.
        let mut env = Env::new();
        fill(&env.mem_a, 0, b"AAAAAAAA");
        env.nic.post(
            A,
            PQP_A,
            &remote(send(1, QP_A, SendOpcode::RdmaWrite, &[lsge]), IOVA, 0xb2),
        );
        env.nic.destroy_qp(A, QP_A).expect("destroy");
        assert!(env.run().is_empty());
        assert_eq!(bytes(&env.mem_b, 0, 8), [0; 8]);
        assert_eq!(env.nic.outstanding(A, PQP_A), 0);
    }

    #[test]
    fn error_flushes_everything_in_order() {
        let mut env = Env::new();
        env.nic
            .post(A, PQP_A, &recv(50, QP_A, &[sge(IOVA, 8, 0xa1)]));
        env.nic.post(
            A,
            PQP_A,
            &send(1, QP_A, SendOpcode::RdmaWrite, &[sge(IOVA, 8, 0x55)]),
        );
        let mut unsignaled = send(2, QP_A, SendOpcode::Send, &[]);
        unsignaled.flags = 0;
        env.nic.post(A, PQP_A, &unsignaled);
        env.nic
            .post(A, PQP_A, &send(3, QP_A, SendOpcode::RdmaRead, &[]));
        let cs = env.run();
        assert_eq!(
            summary(&cs),
            vec![
                (A, PQP_A, 1, WcStatus::LocProtErr),
                (A, PQP_A, 2, WcStatus::WrFlushErr),
                (A, PQP_A, 3, WcStatus::WrFlushErr),
                (A, PQP_A, 50, WcStatus::WrFlushErr),
            ]
        );
        assert!(cs.iter().all(|c| c.cqe.wc_flags & WC_UNSIGNALED == 0));
        assert_eq!(cs[2].cqe.opcode, u8::from(WcOpcode::RdmaRead));
        // Work posted to a QP in ERR is flushed at once.
        env.nic
            .post(A, PQP_A, &send(4, QP_A, SendOpcode::Send, &[]));
        env.nic.post(A, PQP_A, &recv(51, QP_A, &[]));
        assert_eq!(
            summary(&env.run()),
            vec![
                (A, PQP_A, 4, WcStatus::WrFlushErr),
                (A, PQP_A, 51, WcStatus::WrFlushErr)
            ]
        );
        assert_eq!(env.nic.outstanding(A, PQP_A), 0);
        // ErrorQp on request flushes posted receives.
        env.nic.post(B, PQP_B, &recv(60, QP_B, &[]));
        env.nic.post(B, PQP_B, &recv(61, QP_B, &[]));
        env.nic.error_qp(B, QP_B).expect("error");
        assert_eq!(
            summary(&env.run()),
            vec![
                (B, PQP_B, 60, WcStatus::WrFlushErr),
                (B, PQP_B, 61, WcStatus::WrFlushErr)
            ]
        );
    }

    #[test]
    fn rnr_blocks_its_own_qp_only() {
        let mut env = Env::new();
        // A second pair of QPs on the same pQPs.
        env.nic.create_qp(A, QP_A + 1, 1, PQP_A).expect("qp");
        env.nic.create_qp(B, QP_B + 1, 1, PQP_B).expect("qp");
        env.nic
            .connect_qp(A, &conn(QP_A + 1, LID_B, QP_B + 1))
            .expect("conn");
        env.nic
            .connect_qp(B, &conn(QP_B + 1, LID_A, QP_A + 1))
            .expect("conn");
        // QP_A: SEND (no receive: RNR) then a WRITE that must wait behind it.
        env.nic
            .post(A, PQP_A, &send(1, QP_A, SendOpcode::Send, &[]));
        env.nic.post(
            A,
            PQP_A,
            &remote(send(2, QP_A, SendOpcode::RdmaWrite, &[]), IOVA, 0xb2),
        );
        // The other QP proceeds meanwhile.
        env.nic.post(
            A,
            PQP_A,
            &remote(send(3, QP_A + 1, SendOpcode::RdmaWrite, &[]), IOVA, 0xb2),
        );
        assert_eq!(summary(&env.run()), vec![(A, PQP_A, 3, WcStatus::Success)]);
        env.nic.post(B, PQP_B, &recv(9, QP_B, &[]));
        assert_eq!(
            summary(&env.advance(rnr_timer(1))),
            vec![
                (B, PQP_B, 9, WcStatus::Success),
                (A, PQP_A, 1, WcStatus::Success),
                (A, PQP_A, 2, WcStatus::Success)
            ]
        );
    }

    /// B's 8-byte RDMA READ of A's memory, at 0xf000 on both sides.
    fn b_reads(env: &mut Env, token: u64) {
        let read = send(
            token,
            QP_B,
            SendOpcode::RdmaRead,
            &[sge(IOVA + 0xf000, 8, 0xb1)],
        );
        env.nic.post(B, PQP_B, &remote(read, IOVA + 0xf000, 0xa2));
    }

    /// A normal (rank 2), B realtime (rank 0) and busy: it just read.
    fn busy_realtime_b() -> Env {
        let mut env = Env::new();
        env.nic.set_rank(A, 2);
        env.nic.set_rank(B, 0);
        // The first progress call starts the NIC's clock.
        env.nic.progress(env.now, 64);
        b_reads(&mut env, 9);
        assert_eq!(summary(&env.run()), vec![(B, PQP_B, 9, WcStatus::Success)]);
        env
    }

    /// [`busy_realtime_b`] with A's RDMA WRITE or READ (token 1) of `len`
    /// bytes between the starts of A's and B's memory posted; the source
    /// side holds the returned pattern.
    fn long_op_beside_a_busy_realtime_device(op: SendOpcode, len: usize) -> (Env, Vec<u8>) {
        let mut env = busy_realtime_b();
        let data: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
        let source = if op == SendOpcode::RdmaRead {
            &env.mem_b
        } else {
            &env.mem_a
        };
        fill(source, 0, &data);
        let wqe = send(1, QP_A, op, &[sge(IOVA, len as u32, 0xa1)]);
        env.nic.post(A, PQP_A, &remote(wqe, IOVA, 0xb2));
        (env, data)
    }

    fn long_write_beside_a_busy_realtime_device() -> (Env, Vec<u8>) {
        long_op_beside_a_busy_realtime_device(SendOpcode::RdmaWrite, 3 * SEGMENT as usize)
    }

    /// Of A's message of `data` to the start of B's memory, the first
    /// segment has landed there and nothing after it.
    fn only_the_first_segment_landed(env: &Env, data: &[u8]) {
        let seg = SEGMENT as usize;
        assert_eq!(bytes(&env.mem_b, 0, seg), data[..seg], "the first segment");
        assert_eq!(
            bytes(&env.mem_b, SEGMENT, data.len() - seg),
            vec![0; data.len() - seg],
            "nothing after the first segment"
        );
    }

    /// One call of the NIC moves one segment of A's message and stops.
    fn one_segment_moves(env: &mut Env, data: &[u8]) {
        let p = env.nic.progress(env.now, 64);
        assert!(p.preempted && p.busy);
        only_the_first_segment_landed(env, data);
    }

    #[test]
    fn a_long_write_lets_a_busy_higher_rank_in_between_its_segments() {
        let (mut env, data) = long_write_beside_a_busy_realtime_device();
        one_segment_moves(&mut env, &data);
        // B's next READ overtakes the rest of the write.
        b_reads(&mut env, 10);
        let cs = env.run();
        assert_eq!(
            summary(&cs),
            vec![
                (B, PQP_B, 10, WcStatus::Success),
                (A, PQP_A, 1, WcStatus::Success)
            ]
        );
        assert_eq!(
            cs[1].cqe.byte_len.get() as usize,
            data.len(),
            "one completion, whole length"
        );
        assert_eq!(bytes(&env.mem_b, 0, data.len()), data);
        // Once B has been quiet for BUSY_FOR, a long write runs in one go.
        env.now += BUSY_FOR;
        fill(&env.mem_b, 0, &vec![0; data.len()]);
        let write = send(
            2,
            QP_A,
            SendOpcode::RdmaWrite,
            &[sge(IOVA, data.len() as u32, 0xa1)],
        );
        env.nic.post(A, PQP_A, &remote(write, IOVA, 0xb2));
        let p = env.nic.progress(env.now, 64);
        assert!(!p.preempted);
        let mut cs = Vec::new();
        env.nic.take_completions(&mut cs);
        assert_eq!(summary(&cs), vec![(A, PQP_A, 2, WcStatus::Success)]);
        assert_eq!(bytes(&env.mem_b, 0, data.len()), data);
    }

    #[test]
    fn a_deregistration_between_segments_stops_the_message() {
        let (mut env, data) = long_write_beside_a_busy_realtime_device();
        one_segment_moves(&mut env, &data);
        env.nic.deregister_mr(B, 0xb1).expect("dereg");
        let cs = env.run();
        assert_eq!(summary(&cs), vec![(A, PQP_A, 1, WcStatus::RemAccessErr)]);
        only_the_first_segment_landed(&env, &data);
    }

    #[test]
    fn a_long_read_moves_in_segments_and_completes_once() {
        let len = 2 * SEGMENT as usize + 100;
        let (mut env, data) = long_op_beside_a_busy_realtime_device(SendOpcode::RdmaRead, len);
        let mut calls = 1;
        while env.nic.progress(env.now, 64).busy {
            calls += 1;
        }
        assert_eq!(calls, 3, "three segments, a call each");
        let mut cs = Vec::new();
        env.nic.take_completions(&mut cs);
        assert_eq!(summary(&cs), vec![(A, PQP_A, 1, WcStatus::Success)]);
        assert_eq!(cs[0].cqe.byte_len.get() as usize, len);
        assert_eq!(bytes(&env.mem_a, 0, len), data);
    }

    /// [`busy_realtime_b`] with B's receive (token 5) of `len` bytes at
    /// `at` in its memory and A's SEND (token 1) of `len` bytes from the
    /// start of its memory posted; A's memory holds the returned pattern.
    fn long_send_beside_a_busy_realtime_device(len: usize, at: u64) -> (Env, Vec<u8>) {
        let mut env = busy_realtime_b();
        let data: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
        fill(&env.mem_a, 0, &data);
        env.nic.post(
            B,
            PQP_B,
            &recv(5, QP_B, &[sge(IOVA + at, len as u32, 0xb1)]),
        );
        let wqe = send(1, QP_A, SendOpcode::Send, &[sge(IOVA, len as u32, 0xa1)]);
        env.nic.post(A, PQP_A, &wqe);
        (env, data)
    }

    #[test]
    fn a_long_send_lets_a_busy_higher_rank_in_between_its_segments() {
        let (mut env, data) = long_send_beside_a_busy_realtime_device(3 * SEGMENT as usize, 0);
        one_segment_moves(&mut env, &data);
        // B's next READ overtakes the rest of the SEND; the receive
        // completes once, with the whole message.
        b_reads(&mut env, 10);
        let cs = env.run();
        assert_eq!(
            summary(&cs),
            vec![
                (B, PQP_B, 10, WcStatus::Success),
                (B, PQP_B, 5, WcStatus::Success),
                (A, PQP_A, 1, WcStatus::Success)
            ]
        );
        assert_eq!(cs[1].cqe.byte_len.get() as usize, data.len());
        assert_eq!(bytes(&env.mem_b, 0, data.len()), data);
    }

    #[test]
    fn a_responder_reset_between_segments_starts_the_send_again() {
        let len = SEGMENT as usize + 4096;
        let (mut env, data) = long_send_beside_a_busy_realtime_device(len, 0);
        assert!(env.nic.progress(env.now, 64).preempted);
        // B resets and reconnects its QP (its receive is discarded) and
        // posts another receive elsewhere.
        env.nic.reset_qp(B, QP_B).expect("reset");
        env.nic
            .connect_qp(B, &conn(QP_B, LID_A, QP_A))
            .expect("conn");
        env.nic.post(
            B,
            PQP_B,
            &recv(6, QP_B, &[sge(IOVA + 0x6000, len as u32, 0xb1)]),
        );
        let cs = env.run();
        assert_eq!(
            summary(&cs),
            vec![
                (B, PQP_B, 6, WcStatus::Success),
                (A, PQP_A, 1, WcStatus::Success)
            ]
        );
        assert_eq!(
            bytes(&env.mem_b, 0x6000, len),
            data,
            "the new receive holds the whole message, from its first byte"
        );
    }

    #[test]
    fn a_receive_buffer_deregistered_between_segments_stops_the_send() {
        let (mut env, data) = long_send_beside_a_busy_realtime_device(3 * SEGMENT as usize, 0);
        one_segment_moves(&mut env, &data);
        env.nic.deregister_mr(B, 0xb1).expect("dereg");
        let cs = env.run();
        assert_eq!(
            summary(&cs),
            vec![
                (B, PQP_B, 5, WcStatus::LocProtErr),
                (A, PQP_A, 1, WcStatus::RemOpErr)
            ]
        );
        only_the_first_segment_landed(&env, &data);
    }

    #[test]
    fn misdirected_work_completes_without_touching_qps() {
        let mut env = Env::new();
        // A vQP that is not on this pQP, and an unknown one.
        env.nic.attach_device(3, 30, &[5, 6]).expect("attach");
        env.nic.create_qp(3, 1, 1, 5).expect("qp");
        env.nic.post(3, 6, &send(1, 1, SendOpcode::Send, &[]));
        env.nic.post(3, 6, &recv(2, 999, &[]));
        let cs = env.run();
        assert_eq!(
            summary(&cs),
            vec![
                (3, 6, 1, WcStatus::LocQpOpErr),
                (3, 6, 2, WcStatus::LocQpOpErr)
            ]
        );
        assert_eq!(cs[1].cqe.kind, kind::RECV);
        // Posting to a pQP the device does not own does nothing.
        env.nic
            .post(3, PQP_A, &send(1, QP_A, SendOpcode::Send, &[]));
        assert!(env.run().is_empty());
    }

    #[test]
    fn registration_is_validated() {
        let mut env = Env::new();
        let nic = &mut env.nic;
        assert_eq!(
            nic.register_mr(A, &reg(0xb1, 0x5, ALL, 0, 8, 0)),
            Err(NicError::KeyInUse(0xb1))
        );
        assert_eq!(
            nic.register_mr(A, &reg(0x5, 0xa2, ALL, 0, 8, 0)),
            Err(NicError::KeyInUse(0xa2))
        );
        assert_eq!(
            nic.register_mr(A, &reg(0, 0x5, ALL, 0, 8, 0))
                .map_err(|e| e.errno()),
            Err(libc::EINVAL)
        );
        assert_eq!(
            nic.register_mr(A, &reg(5, 5, ALL, 0, 8, 0))
                .map_err(|e| e.errno()),
            Err(libc::EINVAL)
        );
        assert_eq!(
            nic.register_mr(A, &reg(5, 6, ALL, 0, 8, MEM - 4))
                .map_err(|e| e.errno()),
            Err(libc::EINVAL)
        );
        assert_eq!(
            nic.register_mr(A, &reg(5, 6, ALL, 0, 8, u64::MAX - 2))
                .map_err(|e| e.errno()),
            Err(libc::EINVAL)
        );
        let mut bad_sum = reg(5, 6, ALL, 0, 8, 0);
        bad_sum.len = 16;
        assert_eq!(
            nic.register_mr(A, &bad_sum).map_err(|e| e.errno()),
            Err(libc::EINVAL)
        );
        let mut bad_slot = reg(5, 6, ALL, 0, 8, 0);
        bad_slot.segments[0].slot = 9;
        assert_eq!(nic.register_mr(A, &bad_slot), Err(NicError::UnknownSlot(9)));
        assert_eq!(
            nic.register_mr(A, &reg(5, 6, access::REMOTE_WRITE, 0, 8, 0))
                .map_err(|e| e.errno()),
            Err(libc::EINVAL)
        );
        assert_eq!(
            nic.deregister_mr(A, 0xb1),
            Err(NicError::UnknownKey(0xb1)),
            "not A's"
        );
        assert_eq!(
            nic.create_qp(A, 7, 1, PQP_B),
            Err(NicError::ForeignPqp(PQP_B))
        );
        assert_eq!(
            nic.create_qp(A, QP_A, 1, PQP_A),
            Err(NicError::QpExists(QP_A))
        );
        // Two segments over two slots.
        let (_, second) = slot("second");
        nic.add_memory(A, 1, second).expect("slot 1");
        let mut two = reg(5, 6, ALL, 0, 8, MEM - 4);
        two.segments[0].len = 4;
        two.segments.push(MrSegment {
            slot: 1,
            offset: 0,
            len: 4,
        });
        nic.register_mr(A, &two).expect("two segments");
        assert_eq!(
            nic.add_memory(A, 1, slot("dup").1),
            Err(NicError::SlotExists(1))
        );
    }
}
