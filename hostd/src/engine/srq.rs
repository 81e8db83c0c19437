//! Shared receive queues: a receive ring several QPs take their receives
//! from, in posting order, and the limit event.
//!
//! A QP attached to an SRQ has no receive ring of its own (the driver's is
//! never read). When a message needs a receive, the SRQ's next WQE is read
//! once into the QP's own copy (`rq_head`) and the SRQ's `device.index`
//! moves at once: the slot is the driver's again, the WQE now belongs to
//! that QP and completes (or is flushed) there, as on rxe, whose responder
//! takes an SRQ's WQE into the QP when a message starts. The limit, when
//! armed (non-zero), fires once when a take leaves fewer WQEs posted than
//! it, then disarms (`rxe_resp.c`, `get_srq_wqe`).

use vrdma_hostd_protocol::messages::SrqSetup;
use vrdma_spec::limits::{MAX_RING_DEPTH, MAX_WQE_STRIDE};
use vrdma_spec::ring::event_kind;

use super::control::Start;
use super::guest::{self, GuestRing};
use super::rc::{pending, QpRef};
use super::wqe::{self, Malformed, RecvLimits};
use super::{DeviceId, Engine, EngineError};

/// A shared receive queue.
#[derive(Debug)]
pub struct Srq {
    pub srqn: u32,
    pub ring: GuestRing,
    pub limits: RecvLimits,
    /// WQEs taken by QPs (the ring's `device.index`).
    pub taken: u32,
    /// The armed limit; 0: not armed.
    pub limit: u32,
    /// QPs attached to it.
    pub users: u32,
    /// Its memory was removed: its ring is never touched again.
    pub lost: bool,
}

impl Srq {
    /// WQEs posted and not taken; `None` when the producer is more than a
    /// ring ahead (a broken or hostile driver) or the ring is lost.
    fn posted(&self) -> Option<u32> {
        if self.lost {
            return None;
        }
        pending(&self.ring, self.taken)
    }
}

impl Engine {
    /// A shared receive queue numbered `s.srqn`.
    pub fn create_srq(&mut self, id: DeviceId, s: &SrqSetup) -> Result<(), EngineError> {
        self.open_srq(id, s, Start::Fresh)
    }

    /// [`Engine::create_srq`], or for an SRQ a previous datapath took
    /// receives from ([`Start::Resumed`]: its ring continues from its
    /// header).
    pub fn open_srq(
        &mut self,
        id: DeviceId,
        s: &SrqSetup,
        start: Start,
    ) -> Result<(), EngineError> {
        let dev = self.device_mut(id)?;
        if dev.srq_by_num.contains_key(&s.srqn) {
            return Err(EngineError::Exists("SRQ"));
        }
        if !(64..=MAX_WQE_STRIDE).contains(&s.ring.stride) {
            return Err(EngineError::Invalid("work ring stride"));
        }
        if s.limit > s.ring.depth {
            return Err(EngineError::Invalid("SRQ limit above its depth"));
        }
        let ring = GuestRing::new(
            &dev.mem,
            s.ring.gpa,
            s.ring.depth,
            s.ring.stride,
            MAX_RING_DEPTH,
        )?;
        let taken = match start {
            Start::Fresh => {
                ring.reset_device_line();
                0
            }
            Start::Resumed => ring.device_index().unwrap_or(0),
        };
        let index = dev.srqs.insert(Srq {
            srqn: s.srqn,
            ring,
            limits: RecvLimits { max_sge: s.max_sge },
            taken,
            limit: s.limit,
            users: 0,
            lost: false,
        });
        dev.srq_by_num.insert(s.srqn, index);
        Ok(())
    }

    fn srq_mut(&mut self, id: DeviceId, srqn: u32) -> Result<&mut Srq, EngineError> {
        let dev = self.device_mut(id)?;
        let &index = dev
            .srq_by_num
            .get(&srqn)
            .ok_or(EngineError::UnknownSrq(srqn))?;
        dev.srqs.get_mut(index).ok_or(EngineError::UnknownSrq(srqn))
    }

    /// Arms (or, with 0, disarms) the SRQ's limit event.
    pub fn modify_srq(&mut self, id: DeviceId, srqn: u32, limit: u32) -> Result<(), EngineError> {
        let srq = self.srq_mut(id, srqn)?;
        if limit > srq.ring.depth() {
            return Err(EngineError::Invalid("SRQ limit above its depth"));
        }
        srq.limit = limit;
        Ok(())
    }

    /// The SRQ's armed limit (0 once the event fired).
    pub fn query_srq(&mut self, id: DeviceId, srqn: u32) -> Result<u32, EngineError> {
        Ok(self.srq_mut(id, srqn)?.limit)
    }

    /// Destroys SRQ `srqn` (refused while a QP takes receives from it).
    pub fn destroy_srq(&mut self, id: DeviceId, srqn: u32) -> Result<(), EngineError> {
        let users = self.srq_mut(id, srqn)?.users;
        if users > 0 {
            return Err(EngineError::Busy("SRQ", users));
        }
        let dev = self.device_mut(id)?;
        if let Some(index) = dev.srq_by_num.remove(&srqn) {
            dev.srqs.remove(index);
        }
        Ok(())
    }

    /// Whether SRQ `srq` of QP `qref`'s device has a receive posted.
    pub(super) fn srq_has_receive(&self, qref: QpRef, srq: usize) -> bool {
        let Some(qp) = self.qps.get(qref) else {
            return false;
        };
        (self.devices.at(qp.dev))
            .and_then(|d| d.srqs.get(srq))
            .and_then(Srq::posted)
            .is_some_and(|n| n > 0)
    }

    /// Takes the next WQE of SRQ `srq` into QP `qref`'s receive copy
    /// (`rq_head`), frees its slot, and fires the limit event if the take
    /// crossed it. A malformed WQE is taken too (it completes in error on
    /// the QP); an unreadable ring takes nothing.
    pub(super) fn take_srq_receive(&mut self, qref: QpRef, srq: usize) -> Result<(), Malformed> {
        let Some(qp) = self.qps.get_mut(qref) else {
            return Err(Malformed::Unreadable);
        };
        let Some(dev) = self.devices.at_mut(qp.dev) else {
            return Err(Malformed::Unreadable);
        };
        let Some(s) = dev.srqs.get_mut(srq) else {
            return Err(Malformed::Unreadable);
        };
        if s.lost {
            return Err(Malformed::Unreadable);
        }
        let read = wqe::read_recv(&s.ring, s.taken, &s.limits, &mut qp.rq_head);
        if matches!(read, Err(Malformed::Unreadable)) {
            return read;
        }
        s.taken = s.taken.wrapping_add(1);
        s.ring.set_device_index(s.taken);
        if s.limit > 0 && s.posted().is_some_and(|n| n < s.limit) {
            s.limit = 0;
            let srqn = s.srqn;
            guest::post_event(&mut dev.eqs, 0, event_kind::SRQ_LIMIT, srqn);
        }
        read
    }
}
