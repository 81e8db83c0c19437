//! A virtual QP as the datapath keeps it: its rings in guest memory, its
//! state, and the one WQE of each ring it holds a copy of.
//!
//! Work on a QP runs in posting order: the send WQE at `sq_done` is read
//! once into `head` and stays there until it completes — across the
//! segments of a long message, an RNR wait or a transport retry — and only
//! then does `device.index` of the send ring move (the slot is free for
//! the driver). The receive ring is read when a message arrives: the
//! receive at `rq_done` is copied into `rq_head` and completed with the
//! message's last byte.

use std::time::Instant;

use vrdma_hostd_protocol::messages::QpConnection;
use vrdma_spec::verbs::QpState;

use super::guest::GuestRing;
use super::wqe::{RecvLimits, RecvWork, SendLimits, SendWork};
use super::DeviceId;

/// A QP's index in the engine's slab.
pub type QpRef = usize;

/// Why a send WQE waits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WaitKind {
    /// The responder had no receive (RNR NAK): retried after its timer.
    Rnr,
    /// The packet was lost (no responder, or not ready): retried.
    Retry,
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
    /// Its device's LID (the source of what it sends).
    pub lid: u16,
    pub vqpn: u32,
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
    /// The receive at `rq_done`, when `has_rq_head`.
    pub rq_head: Box<RecvWork>,
    pub has_rq_head: bool,
    /// Receives ever taken off the head (a sequence number of the head).
    pub rq_taken: u64,
    /// The peer QP, as last resolved (its ref and serial).
    pub peer: Option<(QpRef, u64)>,
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

    /// Receive WQEs posted and not completed, if the producer index is sane.
    pub fn rq_pending(&self) -> Option<u32> {
        pending(&self.rq, self.rq_done)
    }

    /// Whether it is connected back to QP `vqpn` of LID `lid`.
    pub fn connected_to(&self, lid: u16, vqpn: u32) -> bool {
        self.conn
            .is_some_and(|c| c.dest_lid == lid && c.dest_qpn == vqpn)
    }
}

/// Entries between `done` and the driver's producer index; `None` when the
/// producer is more than a ring ahead (a broken or hostile driver).
fn pending(ring: &GuestRing, done: u32) -> Option<u32> {
    let producer = ring.driver_index()?;
    let n = producer.wrapping_sub(done);
    (n <= ring.depth()).then_some(n)
}
