//! Reliable connected QPs: their state, and the service between two QPs
//! of this host. The requester executes its head WQE against its
//! responder, as a NIC's requester, responder and completer together
//! would (rxe splits them into `rxe_req.c`, `rxe_resp.c`, `rxe_comp.c`;
//! here the responder is local, so one step does all three).
//!
//! Semantics this fixes where verbs leave room (docs/architecture.md has
//! the table):
//! - every key, range and access is checked when the step runs, so a
//!   deregistration or removal that returned is never followed by an
//!   access through what it removed;
//! - a responder that does not exist, is not ready or is not connected back
//!   to exactly this requester is a lost packet: retried every
//!   [`RETRY_STEP`], `retry_cnt` times, then RETRY_EXC_ERR;
//! - no receive posted is an RNR NAK: retried after the responder's
//!   `min_rnr_timer`, `rnr_retry` times (7: for ever), then
//!   RNR_RETRY_EXC_ERR — cut short when the responder posts a receive;
//! - remote access errors leave the responder alone (a peer's bad rkey
//!   cannot knock a victim's QP into ERR); a receive that is too short or
//!   whose buffers fail their checks moves the responder to ERR, and the
//!   requester gets REM_INV_REQ_ERR or REM_OP_ERR;
//! - a long WRITE, READ or SEND moves [`SEGMENT`] bytes per step while a
//!   higher class is busy, [`STEP`] otherwise; a SEND keeps its receive at
//!   the head of the responder's queue until its last segment and starts
//!   again from its first byte if the responder was reset in between.
//!
//! A virtual QP ([`Qp`]) as the datapath keeps it: its rings in guest
//! memory, its state, and the one WQE of each ring it holds a copy of.
//! Work on a QP runs in posting order: the send WQE at `sq_done` is read
//! once into `head` and stays there until it completes — across the
//! segments of a long message, an RNR wait or a transport retry — and only
//! then does `device.index` of the send ring move (the slot is free for
//! the driver). The receive ring is read when a message arrives: the
//! receive at `rq_done` is copied into `rq_head` and completed with the
//! message's last byte.

use std::time::{Duration, Instant};

use vrdma_hostd_protocol::messages::QpConnection;
use vrdma_spec::ring::{wc_flags, Cqe};
use vrdma_spec::verbs::{access, QpState, QpType, SendOpcode, WcOpcode, WcStatus};

use super::guest::{GuestRing, PREFETCH_ENTRIES};
use super::keys::{self, SgeList};
use super::wqe::{self, Local, Malformed, RecvLimits, RecvWork, SendLimits, SendWork};
use super::{DeviceId, Engine, RETRY_STEP, SEGMENT, STEP};
use crate::gids::Gid;

/// How long an RNR NAK makes the requester wait: the IBA's RNR timer
/// table (`min_rnr_timer` codes 0..=31), in units of 10 µs.
const RNR_TIMER_10US: [u32; 32] = [
    65536, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536,
    2048, 3072, 4096, 6144, 8192, 12288, 16384, 24576, 32768, 49152,
];

/// The RNR timer of code `code` (the IBA table; codes above 31 as 31).
pub fn rnr_timer(code: u8) -> Duration {
    let units = RNR_TIMER_10US[usize::from(code.min(31))];
    Duration::from_micros(u64::from(units) * 10)
}

/// How long a send waits for room in a full packet queue (the kernel
/// drains it in microseconds).
pub const QUEUE_WAIT: Duration = Duration::from_micros(20);

/// A QP's index in the engine's slab.
pub type QpRef = usize;

/// Why a send WQE waits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WaitKind {
    /// The responder had no receive (RNR NAK): retried after its timer.
    Rnr,
    /// The packet was lost (no responder, or not ready): retried.
    Retry,
    /// The packet queue towards the network was full: run again shortly,
    /// unchanged (a datagram waits for room; it is not dropped).
    Queue,
}

/// A send WQE waiting to be retried.
#[derive(Debug, Clone, Copy)]
pub struct Wait {
    pub kind: WaitKind,
    pub due: Instant,
    /// Retries left (RNR with `rnr_retry` 7: never decremented).
    pub left: u8,
}

/// A virtual QP.
#[derive(Debug)]
pub struct Qp {
    pub device: DeviceId,
    /// Its device's index in the engine's device slab.
    pub dev: usize,
    /// Its device's GID (the source of what it sends).
    pub gid: Gid,
    pub vqpn: u32,
    pub qp_type: QpType,
    /// A UD QP's Q_Key (what arriving messages must name).
    pub qkey: u32,
    /// Unique over the engine's life: a reference cached elsewhere checks
    /// it to know the slab slot still holds this QP.
    pub serial: u64,
    pub pd: u32,
    /// Index of its physical QP in its device's list.
    pub pqp: usize,
    pub state: QpState,
    /// Its memory was removed: its rings are never touched again.
    pub lost: bool,
    pub sq: GuestRing,
    pub rq: GuestRing,
    pub send_limits: SendLimits,
    pub recv_limits: RecvLimits,
    /// Its CQs' indices in its device's CQ slab.
    pub send_cq: usize,
    pub recv_cq: usize,
    pub conn: Option<QpConnection>,
    /// Remote access it grants its peer.
    pub access: u32,
    /// Send WQEs completed (the send ring's `device.index`).
    pub sq_done: u32,
    /// The driver's producer index as last read: the WQEs before it are
    /// posted, so the next ones are read without reading the index again
    /// (a line the driver's core writes) until `sq_done` reaches it
    /// ([`Qp::sq_posted`]).
    pub sq_seen: u32,
    /// The send WQE at `sq_done`, when `has_head`.
    pub head: Box<SendWork>,
    pub has_head: bool,
    /// Bytes of `head` already moved.
    pub sent: u64,
    /// For a SEND of `sent` > 0 bytes: the sequence number of the
    /// responder's receive it is filling.
    pub recv_seq: u64,
    /// The retries of its head so far (kept across them, so they run out).
    pub wait: Option<Wait>,
    /// Parked until `wait.due` (on the engine's timer list).
    pub waiting: bool,
    /// In its physical QP's ring of QPs with work.
    pub queued: bool,
    /// WQEs left in its current turn on its physical QP.
    pub turn_left: u32,
    /// Receives completed (the receive ring's `device.index`).
    pub rq_done: u32,
    /// The driver's producer index of the receive ring as last read:
    /// while it is ahead of `rq_done` a receive is known to be there and
    /// the index (a line the driver's core writes at every post) is not
    /// read again.
    pub rq_seen: u32,
    /// The receive at `rq_done`, when `has_rq_head`.
    pub rq_head: Box<RecvWork>,
    pub has_rq_head: bool,
    /// Receives ever taken off the head (a sequence number of the head).
    pub rq_taken: u64,
    /// Its SRQ's index in its device's SRQ slab: its receives come from
    /// there, its own receive ring is never read.
    pub srq: Option<usize>,
    /// The peer QP, as last resolved (its ref and serial).
    pub peer: Option<(QpRef, u64)>,
    /// Send WQEs on the wire and not completed (a remote QP's window):
    /// the next WQE to read is at `sq_done + issued`.
    pub issued: u32,
    /// The transport state, when the peer is on another host.
    pub remote: Option<Box<super::wire::state::RemoteQp>>,
    /// A UD QP's next send PSN on the wire (receivers do not check it,
    /// as in IBA 9.7.6.1.1 and rxe; it counts datagrams for a capture).
    pub ud_psn: u32,
}

impl Qp {
    /// Whether its send queue runs.
    pub fn sends(&self) -> bool {
        !self.lost && matches!(self.state, QpState::Rts)
    }

    /// Whether it accepts incoming messages as a responder.
    pub fn receives(&self) -> bool {
        !self.lost && matches!(self.state, QpState::Rtr | QpState::Rts | QpState::Sqd)
    }

    /// Whether it is in the error state (what is posted is flushed).
    pub fn failed(&self) -> bool {
        self.state == QpState::Err
    }

    /// Send WQEs posted and not completed, if the producer index is sane.
    pub fn sq_pending(&self) -> Option<u32> {
        pending(&self.sq, self.sq_done)
    }

    /// Send WQEs posted and not yet run, as far as the datapath needs to
    /// know: those announced by the producer index as last read
    /// (`sq_seen`), and only when they have all run (or a flush passed
    /// the stale index) the index read again and the newly announced
    /// slots prefetched together. `None` if the index is beyond the ring.
    pub fn sq_posted(&mut self) -> Option<u32> {
        let read = self.sq_read();
        let known = self.sq_seen.wrapping_sub(read);
        if known != 0 && known <= self.sq.depth() {
            return Some(known);
        }
        let pending = self.sq_pending()?.checked_sub(self.issued)?;
        if pending > 0 {
            self.sq_seen = read.wrapping_add(pending);
            self.sq.prefetch_entries(read, pending);
        }
        Some(pending)
    }

    /// The send WQE the datapath reads next: after those completed and
    /// those on the wire.
    pub fn sq_read(&self) -> u32 {
        self.sq_done.wrapping_add(self.issued)
    }

    /// Receive WQEs posted and not completed, if the producer index is sane.
    pub fn rq_pending(&self) -> Option<u32> {
        if self.srq.is_some() {
            // What is posted is the SRQ's, not this QP's.
            return Some(0);
        }
        pending(&self.rq, self.rq_done)
    }

    /// Whether it is connected back to QP `vqpn` of GID `gid`.
    pub fn connected_to(&self, gid: &Gid, vqpn: u32) -> bool {
        self.conn
            .is_some_and(|c| c.dgid == *gid && c.dest_qpn == vqpn)
    }
}

/// Entries between `done` and the driver's producer index; `None` when the
/// producer is more than a ring ahead (a broken or hostile driver).
pub(super) fn pending(ring: &GuestRing, done: u32) -> Option<u32> {
    let producer = ring.driver_index()?;
    let n = producer.wrapping_sub(done);
    (n <= ring.depth()).then_some(n)
}

/// Kinds of work counted, in the order of [`CompletionCounts::ops`].
pub const KINDS: [&str; 5] = ["send", "write", "read", "atomic", "recv"];

/// What one device's completions came to, counted as they are written, in
/// the device's own record (no lookup per completion); the stats fold it
/// into its tenant's totals.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CompletionCounts {
    /// Successful completions by [`KINDS`].
    pub ops: [u64; 5],
    /// Bytes of successful completions by [`KINDS`].
    pub bytes: [u64; 5],
    /// Error completions by status code (`ibv_wc_status`).
    pub errors: [u64; 32],
    /// UD and UC messages dropped on their way to this device's QPs.
    pub dropped: super::ud::DropCounts,
    /// What the device's QP1 carried for its connection manager.
    pub gsi: super::gsi::GsiCounts,
}

impl CompletionCounts {
    /// Counts one completion.
    pub fn count(&mut self, cqe: &Cqe) {
        if cqe.status != u8::from(WcStatus::Success) {
            if let Some(n) = self.errors.get_mut(usize::from(cqe.status)) {
                *n += 1;
            }
            return;
        }
        if let Some(k) = kind_index(cqe.opcode) {
            self.ops[k] += 1;
            self.bytes[k] += u64::from(cqe.byte_len.get());
        }
    }
}

/// The kind index of a successful completion.
fn kind_index(opcode: u8) -> Option<usize> {
    match WcOpcode::try_from(opcode).ok()? {
        WcOpcode::Send => Some(0),
        WcOpcode::RdmaWrite => Some(1),
        WcOpcode::RdmaRead => Some(2),
        WcOpcode::CompSwap | WcOpcode::FetchAdd => Some(3),
        WcOpcode::Recv | WcOpcode::RecvRdmaWithImm => Some(4),
        WcOpcode::BindMw | WcOpcode::LocalInv => None,
    }
}

/// What one step of a QP's head came to, for the datapath's accounting.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Outcome {
    /// The WQE completed (successfully or not).
    pub completed: bool,
    /// Bytes moved by this step.
    pub moved: u64,
    /// It stopped between segments because a higher class is busy.
    pub preempted: bool,
}

/// What executing (one segment of) a send WQE came to.
pub(super) enum Step {
    Complete {
        status: WcStatus,
        /// The responder QP to move to ERR after the requester completion.
        fail_responder: Option<QpRef>,
    },
    Rnr(Duration),
    Dropped,
    /// The packet queue is full: the WQE runs again after [`QUEUE_WAIT`],
    /// nothing of it done.
    Blocked,
    /// The message goes on from byte `next`; this step moved `moved`.
    Segment {
        next: u64,
        moved: u64,
    },
}

pub(super) fn done(status: WcStatus) -> Step {
    Step::Complete {
        status,
        fail_responder: None,
    }
}

/// What a UC requester makes of a step: it completes when the message is
/// sent, whatever the responder did, since nothing is acknowledged —
/// a responder that is missing, has no receive or refuses the message
/// drops it silently (nothing retried, no responder failed). Local
/// errors stay errors.
fn unacknowledged(step: Step) -> Step {
    match step {
        Step::Rnr(_) | Step::Dropped => done(WcStatus::Success),
        Step::Complete {
            status: WcStatus::RemAccessErr | WcStatus::RemInvReqErr | WcStatus::RemOpErr,
            ..
        } => done(WcStatus::Success),
        other => other,
    }
}

/// The part of a `len`-byte message from byte `offset` that moves now (at
/// most `chunk` bytes), and whether it is the last.
fn segment(len: u64, offset: u64, chunk: u64) -> (u64, bool) {
    let n = len.saturating_sub(offset).min(chunk);
    (n, offset.saturating_add(n) >= len)
}

/// What the requester side of a step needs to know about its responder.
#[derive(Clone, Copy)]
struct Responder {
    qp: QpRef,
    device: super::DeviceId,
    pd: u32,
    access: u32,
    rnr: Duration,
}

impl Engine {
    /// Executes (a step of) the head WQE of QP `qref` and completes it,
    /// fails it, or lets it wait.
    pub(super) fn execute(&mut self, qref: QpRef, now: Instant) -> Outcome {
        let Some(qp) = self.qps.get_mut(qref) else {
            return Outcome::default();
        };
        if !qp.has_head || !qp.sends() {
            return Outcome::default();
        }
        if qp.remote.is_some() {
            return self.issue_remote(qref, now);
        }
        let ud = qp.qp_type == QpType::Ud;
        // The head is swapped out (not copied: no allocation) so that the
        // step may borrow the engine freely.
        let Some(mut work) = self.spare.take() else {
            return Outcome::default();
        };
        std::mem::swap(&mut work, &mut qp.head);
        let offset = qp.sent;
        let rank = self.devices.at(qp.dev).map_or(u8::MAX, |d| d.rank);
        let segmented = self.sched.outranked(rank, now);
        let chunk = if segmented { SEGMENT } else { STEP };
        let step = if ud {
            self.ud_send(qref, &work, now)
        } else {
            self.transfer(qref, &work, offset, chunk)
        };
        let outcome = self.finish(qref, &work, step, now, segmented);
        if let Some(qp) = self.qps.get_mut(qref) {
            std::mem::swap(&mut work, &mut qp.head);
        }
        self.spare = Some(work);
        outcome
    }

    /// Applies what a step came to.
    fn finish(
        &mut self,
        qref: QpRef,
        work: &SendWork,
        step: Step,
        now: Instant,
        segmented: bool,
    ) -> Outcome {
        let uc = self.qps.get(qref).is_some_and(|q| q.qp_type == QpType::Uc);
        let step = if uc {
            self.count_unacknowledged(qref, &step);
            unacknowledged(step)
        } else {
            step
        };
        let (status, fail_responder) = match step {
            Step::Segment { next, moved } => {
                if let Some(qp) = self.qps.get_mut(qref) {
                    qp.sent = next;
                }
                return Outcome {
                    completed: false,
                    moved,
                    preempted: segmented,
                };
            }
            Step::Complete {
                status,
                fail_responder,
            } => (status, fail_responder),
            Step::Rnr(delay) => {
                if self.wait_again(qref, WaitKind::Rnr, now + delay) {
                    return Outcome::default();
                }
                (WcStatus::RnrRetryExcErr, None)
            }
            Step::Dropped => {
                if self.wait_again(qref, WaitKind::Retry, now + RETRY_STEP) {
                    return Outcome::default();
                }
                (WcStatus::RetryExcErr, None)
            }
            Step::Blocked => {
                if let Some(qp) = self.qps.get_mut(qref) {
                    qp.wait = Some(Wait {
                        kind: WaitKind::Queue,
                        due: now + QUEUE_WAIT,
                        left: 0,
                    });
                    qp.waiting = true;
                }
                return Outcome::default();
            }
        };
        let moved = if status == WcStatus::Success {
            work.length
        } else {
            0
        };
        if let Some(qp) = self.qps.get_mut(qref) {
            qp.has_head = false;
            qp.sent = 0;
            qp.wait = None;
            qp.waiting = false;
        }
        let byte_len = u32::try_from(work.length).unwrap_or(u32::MAX);
        self.complete_send(
            qref,
            work.wr_id,
            work.wc_opcode(),
            status,
            byte_len,
            work.signaled(),
        );
        if status != WcStatus::Success {
            self.fail_qp(qref, false, "work completed in error");
        }
        if let Some(responder) = fail_responder {
            self.fail_qp(responder, false, "a message it received failed");
        }
        Outcome {
            completed: true,
            moved,
            preempted: false,
        }
    }

    /// Counts a UC message the responder dropped: on the responder's
    /// device when there is one (no receive), else on the sender's.
    fn count_unacknowledged(&mut self, qref: QpRef, step: &Step) {
        let why = match step {
            Step::Rnr(_) => super::ud::Drop::NoReceive,
            Step::Dropped => super::ud::Drop::NoQp,
            _ => return,
        };
        let at = match why {
            super::ud::Drop::NoReceive => self.peer_of(qref),
            _ => Some(qref),
        };
        if let Some(di) = at.and_then(|q| self.qps.get(q)).map(|q| q.dev) {
            self.count_drop(di, why);
        }
    }

    /// Keeps the head to retry at `due` if retries of `kind` are left.
    fn wait_again(&mut self, qref: QpRef, kind: WaitKind, due: Instant) -> bool {
        let Some(qp) = self.qps.get_mut(qref) else {
            return false;
        };
        let limit = match (kind, qp.conn) {
            (WaitKind::Rnr, Some(c)) => c.rnr_retry,
            (WaitKind::Retry, Some(c)) => c.retry_cnt,
            (WaitKind::Queue, _) | (_, None) => 0,
        };
        let left = match qp.wait {
            Some(w) if w.kind == kind => w.left,
            _ => limit,
        };
        if left == 0 {
            return false;
        }
        // While a new hostd takes contexts over, a local peer that is not
        // back yet is waited for without using up the QP's retries.
        let infinite = (kind == WaitKind::Rnr && limit == 7)
            || (kind == WaitKind::Retry && self.resuming_until.is_some_and(|t| due < t));
        qp.wait = Some(Wait {
            kind,
            due,
            left: if infinite { left } else { left - 1 },
        });
        qp.waiting = true;
        true
    }

    /// The responder of `qref`, if it is there, ready and connected back.
    fn responder(&mut self, qref: QpRef) -> Option<Responder> {
        let (my_gid, vqpn, my_type) = {
            let qp = self.qps.get(qref)?;
            (qp.gid, qp.vqpn, qp.qp_type)
        };
        let peer = self.peer_of(qref)?;
        let p = self.qps.get(peer)?;
        if !p.receives() || !p.connected_to(&my_gid, vqpn) || p.qp_type != my_type {
            return None;
        }
        Some(Responder {
            qp: peer,
            device: p.device,
            pd: p.pd,
            access: p.access,
            rnr: rnr_timer(p.conn.map_or(0, |c| c.min_rnr_timer)),
        })
    }

    /// Moves (a segment of) `work` from QP `qref` to its responder.
    fn transfer(&mut self, qref: QpRef, work: &SendWork, offset: u64, chunk: u64) -> Step {
        let Some((device, pd)) = self.qps.get(qref).map(|q| (q.device, q.pd)) else {
            return done(WcStatus::LocQpOpErr);
        };
        let Some(r) = self.responder(qref) else {
            return Step::Dropped;
        };
        use SendOpcode as Op;
        let writes_local = matches!(
            work.opcode,
            Op::RdmaRead | Op::AtomicCmpAndSwp | Op::AtomicFetchAndAdd
        );
        let need = if writes_local { access::LOCAL_WRITE } else { 0 };
        if !self.keys.check_sges(device, pd, work.sges(), need) {
            return done(WcStatus::LocProtErr);
        }
        let len = work.length;
        let (n, last) = segment(len, offset, chunk);
        match work.opcode {
            Op::Send | Op::SendWithImm => self.send(qref, work, r, offset, chunk),
            Op::RdmaWrite | Op::RdmaWriteWithImm => {
                if r.access & access::REMOTE_WRITE == 0 {
                    return done(WcStatus::RemAccessErr);
                }
                let with_imm = work.opcode == Op::RdmaWriteWithImm;
                // The receive is consumed with the last segment; without
                // one the responder NAKs the first (and, should another
                // sender take it meanwhile, the last) segment.
                if with_imm && (offset == 0 || last) && !self.has_receive(r.qp) {
                    return Step::Rnr(r.rnr);
                }
                let dst = if len == 0 {
                    None
                } else {
                    match self.keys.remote(
                        r.device,
                        r.pd,
                        work.rkey,
                        work.remote_addr,
                        len,
                        access::REMOTE_WRITE,
                    ) {
                        Some(dst) => Some(dst),
                        None => return done(WcStatus::RemAccessErr),
                    }
                };
                let local = self.sge_list(device, pd, work, need);
                let copied = match (&dst, work.local) {
                    (None, _) => true,
                    (Some(dst), Local::Inline(_)) => keys::write_bytes(work.inline(), dst),
                    (Some(dst), _) => keys::copy(&local, dst, offset, n),
                };
                if !copied {
                    return done(WcStatus::RemAccessErr);
                }
                if !last {
                    return Step::Segment {
                        next: offset + n,
                        moved: n,
                    };
                }
                if with_imm {
                    return self.write_imm_received(qref, work, r);
                }
                done(WcStatus::Success)
            }
            Op::RdmaRead => {
                if r.access & access::REMOTE_READ == 0 {
                    return done(WcStatus::RemAccessErr);
                }
                if len > 0 {
                    let Some(src) = self.keys.remote(
                        r.device,
                        r.pd,
                        work.rkey,
                        work.remote_addr,
                        len,
                        access::REMOTE_READ,
                    ) else {
                        return done(WcStatus::RemAccessErr);
                    };
                    let local = self.sge_list(device, pd, work, need);
                    if !keys::copy(&src, &local, offset, n) {
                        return done(WcStatus::LocProtErr);
                    }
                }
                if !last {
                    return Step::Segment {
                        next: offset + n,
                        moved: n,
                    };
                }
                done(WcStatus::Success)
            }
            Op::AtomicCmpAndSwp | Op::AtomicFetchAndAdd => {
                if !work.remote_addr.is_multiple_of(8) {
                    return done(WcStatus::RemInvReqErr);
                }
                if r.access & access::REMOTE_ATOMIC == 0 {
                    return done(WcStatus::RemAccessErr);
                }
                let Some(target) = self.keys.remote(
                    r.device,
                    r.pd,
                    work.rkey,
                    work.remote_addr,
                    8,
                    access::REMOTE_ATOMIC,
                ) else {
                    return done(WcStatus::RemAccessErr);
                };
                // All RDMA atomics run under the engine's lock: serialized
                // with each other, and real atomics on guest memory where
                // the target is aligned in its mapping.
                let swap = (work.opcode == Op::AtomicCmpAndSwp).then_some(work.swap);
                let Some(old) = keys::atomic(&target, work.compare_add, swap) else {
                    return done(WcStatus::RemAccessErr);
                };
                if !keys::write_bytes(&old.to_le_bytes(), &self.sge_list(device, pd, work, need)) {
                    return done(WcStatus::LocProtErr);
                }
                done(WcStatus::Success)
            }
            // The WQE reader refuses these; a NIC would too.
            Op::LocalInv | Op::BindMw | Op::SendWithInv => done(WcStatus::LocQpOpErr),
        }
    }

    /// The local SGEs of `work`, resolved as the copy walks them.
    fn sge_list<'a>(
        &'a self,
        device: super::DeviceId,
        pd: u32,
        work: &'a SendWork,
        need: u32,
    ) -> SgeList<'a> {
        SgeList::new(&self.keys, device, pd, work.sges(), need)
    }

    /// Whether responder `peer` has a receive for the next message (reading
    /// its ring's producer index; a broken ring fails it).
    pub(super) fn has_receive(&mut self, peer: QpRef) -> bool {
        let Some(p) = self.qps.get(peer) else {
            return false;
        };
        if p.has_rq_head {
            return true;
        }
        if let Some(srq) = p.srq {
            return self.srq_has_receive(peer, srq);
        }
        let known = p.rq_seen.wrapping_sub(p.rq_done);
        if known > 0 && known <= p.rq.depth() {
            return true;
        }
        match pending(&p.rq, p.rq_done) {
            Some(n) => {
                let producer = p.rq_done.wrapping_add(n);
                // The receives just announced are fetched together (the
                // tenant's core wrote them), as the send ring's are.
                p.rq.prefetch_entries(p.rq_done, n);
                if let Some(p) = self.qps.get_mut(peer) {
                    p.rq_seen = producer;
                }
                n > 0
            }
            None => {
                self.fail_qp(peer, true, "receive ring producer index beyond the ring");
                false
            }
        }
    }

    /// Makes sure responder `peer` holds the receive at the head of its
    /// ring, read once. `Err` carries the step the requester gets when it
    /// cannot: RNR without one, the receive's own failure otherwise.
    pub(super) fn head_receive(&mut self, peer: QpRef, rnr: Duration) -> Result<(), Step> {
        if !self.has_receive(peer) {
            return Err(Step::Rnr(rnr));
        }
        let Some(p) = self.qps.get_mut(peer) else {
            return Err(Step::Dropped);
        };
        if p.has_rq_head {
            return Ok(());
        }
        let read = match p.srq {
            Some(srq) => self.take_srq_receive(peer, srq),
            None => {
                // Keep the receives a few ahead of this one on their way
                // from the tenant's core (the first few were prefetched
                // when announced).
                let ahead = p.rq_done.wrapping_add(PREFETCH_ENTRIES);
                let known = p.rq_seen.wrapping_sub(p.rq_done);
                if known > PREFETCH_ENTRIES && known <= p.rq.depth() {
                    p.rq.prefetch_entries(ahead, 1);
                }
                wqe::read_recv(&p.rq, p.rq_done, &p.recv_limits, &mut p.rq_head)
            }
        };
        match read {
            Ok(()) => {
                if let Some(p) = self.qps.get_mut(peer) {
                    p.has_rq_head = true;
                }
                Ok(())
            }
            Err(Malformed::Entry { wr_id, status, .. }) => {
                Err(self.refuse_receive(peer, wr_id, status))
            }
            Err(Malformed::Unreadable) => {
                self.fail_qp(peer, true, "receive ring unreadable");
                Err(Step::Dropped)
            }
        }
    }

    /// The responder's head receive failed with `status` (its buffers are
    /// too short, fail their checks, or it is malformed): it completes so
    /// there, the responder goes to ERR after the requester completes, and
    /// the requester gets REM_INV_REQ_ERR (length) or REM_OP_ERR.
    pub(super) fn refuse_receive(&mut self, peer: QpRef, wr_id: u64, status: WcStatus) -> Step {
        let Some(vqpn) = self.qps.get(peer).map(|p| p.vqpn) else {
            return Step::Dropped;
        };
        let cqe = Cqe {
            wr_id: wr_id.into(),
            status: status.into(),
            opcode: WcOpcode::Recv.into(),
            qp_num: vqpn.into(),
            ..Cqe::default()
        };
        self.complete_recv(peer, &cqe, false);
        Step::Complete {
            status: if status == WcStatus::LocLenErr {
                WcStatus::RemInvReqErr
            } else {
                WcStatus::RemOpErr
            },
            fail_responder: Some(peer),
        }
    }

    /// The message for the responder's head receive failed its checks
    /// (`status`): an RC responder completes the receive so and fails
    /// ([`Engine::refuse_receive`]); a UC one drops the message and keeps
    /// the receive posted (rxe's class D error), and counts the drop.
    fn receive_failed(&mut self, peer: QpRef, wr_id: u64, status: WcStatus) -> Step {
        match self.qps.get(peer).map(|p| (p.qp_type, p.dev)) {
            Some((QpType::Rc, _)) => self.refuse_receive(peer, wr_id, status),
            Some((_, di)) => {
                self.count_drop(di, super::ud::Drop::Invalid);
                Step::Dropped
            }
            None => Step::Dropped,
        }
    }

    /// A SEND: fills the responder's head receive, segment by segment.
    fn send(
        &mut self,
        qref: QpRef,
        work: &SendWork,
        r: Responder,
        offset: u64,
        chunk: u64,
    ) -> Step {
        if let Err(step) = self.head_receive(r.qp, r.rnr) {
            return step;
        }
        let (Some(qp), Some(p)) = (self.qps.get(qref), self.qps.get(r.qp)) else {
            return Step::Dropped;
        };
        // A reset and reconnection of the responder between two segments
        // replaced the receive: start again from the first byte, as a
        // retransmission would.
        if offset > 0 && qp.recv_seq != p.rq_taken {
            return Step::Segment { next: 0, moved: 0 };
        }
        let (device, pd, vqpn) = (qp.device, qp.pd, qp.vqpn);
        let recv_id = p.rq_head.wr_id;
        let fits = p.rq_head.length >= work.length;
        let recv_ok = self
            .keys
            .check_sges(r.device, r.pd, p.rq_head.sges(), access::LOCAL_WRITE);
        if !recv_ok {
            return self.receive_failed(r.qp, recv_id, WcStatus::LocProtErr);
        }
        if !fits {
            return self.receive_failed(r.qp, recv_id, WcStatus::LocLenErr);
        }
        let dst = SgeList::new(
            &self.keys,
            r.device,
            r.pd,
            p.rq_head.sges(),
            access::LOCAL_WRITE,
        );
        let (n, last) = segment(work.length, offset, chunk);
        let copied = match work.local {
            // Inline data is far shorter than a segment.
            Local::Inline(_) => keys::write_bytes(work.inline(), &dst),
            _ => keys::copy(&self.sge_list(device, pd, work, 0), &dst, offset, n),
        };
        if !copied {
            return self.receive_failed(r.qp, recv_id, WcStatus::LocProtErr);
        }
        if !last {
            let seq = p.rq_taken;
            if let Some(qp) = self.qps.get_mut(qref) {
                qp.recv_seq = seq;
            }
            return Step::Segment {
                next: offset + n,
                moved: n,
            };
        }
        let with_imm = work.opcode == SendOpcode::SendWithImm;
        let mut cqe = Cqe {
            wr_id: recv_id.into(),
            status: WcStatus::Success.into(),
            opcode: WcOpcode::Recv.into(),
            byte_len: u32::try_from(work.length).unwrap_or(u32::MAX).into(),
            qp_num: p.vqpn.into(),
            src_qp: vqpn.into(),
            ..Cqe::default()
        };
        if with_imm {
            cqe.imm_data = work.imm_data;
            cqe.wc_flags = wc_flags::WITH_IMM;
        }
        let solicited = work.flags & vrdma_spec::ring::send_flags::SOLICITED != 0;
        self.complete_recv(r.qp, &cqe, solicited);
        done(WcStatus::Success)
    }

    /// The last segment of a WRITE_WITH_IMM landed: the responder's receive
    /// completes with the immediate data (its buffers are not used).
    fn write_imm_received(&mut self, qref: QpRef, work: &SendWork, r: Responder) -> Step {
        if let Err(step) = self.head_receive(r.qp, r.rnr) {
            return step;
        }
        let (Some(qp), Some(p)) = (self.qps.get(qref), self.qps.get(r.qp)) else {
            return Step::Dropped;
        };
        let cqe = Cqe {
            wr_id: p.rq_head.wr_id.into(),
            status: WcStatus::Success.into(),
            opcode: WcOpcode::RecvRdmaWithImm.into(),
            wc_flags: wc_flags::WITH_IMM,
            byte_len: u32::try_from(work.length).unwrap_or(u32::MAX).into(),
            imm_data: work.imm_data,
            qp_num: p.vqpn.into(),
            src_qp: qp.vqpn.into(),
            ..Cqe::default()
        };
        let solicited = work.flags & vrdma_spec::ring::send_flags::SOLICITED != 0;
        self.complete_recv(r.qp, &cqe, solicited);
        done(WcStatus::Success)
    }
}
