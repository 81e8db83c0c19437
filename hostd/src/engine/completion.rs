//! Completion and event rings: where hostd writes CQEs and events into
//! guest memory, and when it interrupts the driver.
//!
//! A CQE is written into its slot, then the producer index is published
//! with release ordering, then — after a full fence — the driver's arm
//! word is read: an arm whose sequence number was not answered yet gets
//! one completion event (the spec's arming rule, `vrdma_spec::ring`). An
//! event goes into the event ring of its vector, and the vector's
//! interrupt eventfd is written. A CQ or event ring the driver lets fill up
//! loses what does not fit, as on a NIC: a CQ overrun is reported once
//! with a CQ_ERROR event, an overflowed event ring by its ERROR flag.

use std::sync::atomic::{fence, Ordering};

use vmm_sys_util::eventfd::EventFd;
use vrdma_spec::ring::{
    event_kind, Cqe, Event, CQE_SIZE, CQ_ARM_NEXT, CQ_ARM_SOLICITED, DEVICE_FLAG_ERROR, EVENT_SIZE,
};
use vrdma_spec::verbs::WcStatus;
use zerocopy::IntoBytes;

use super::guest::GuestRing;

/// A completion queue: its ring and the device's side of its indices.
#[derive(Debug)]
pub struct Cq {
    pub cqn: u32,
    ring: GuestRing,
    /// Completion vector of its events.
    pub vector: u32,
    producer: u32,
    /// Arm sequence number last answered with an event.
    notified_sn: u32,
    /// It overran once; its CQ_ERROR event was sent.
    overrun: bool,
    /// QPs completing here (it may not be destroyed while any does).
    pub users: u32,
    /// Its memory was removed: nothing is written any more.
    pub lost: bool,
}

/// Why a CQE was not written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CqFull {
    /// The driver has not consumed enough: the completion is lost.
    Overrun,
    /// The CQ's memory is gone.
    Lost,
}

impl Cq {
    /// A CQ over `ring` (its device line is cleared: a fresh CQ).
    pub fn new(cqn: u32, ring: GuestRing, vector: u32) -> Self {
        ring.reset_device_line();
        Cq {
            cqn,
            ring,
            vector,
            producer: 0,
            notified_sn: 0,
            overrun: false,
            users: 0,
            lost: false,
        }
    }

    /// The slot its ring lies in.
    pub fn slot(&self) -> u32 {
        self.ring.slot()
    }

    /// Writes `cqe`; returns whether an event is due (the CQ is armed for
    /// it), or why it could not be written. `solicited`: the completion
    /// wakes a CQ armed for solicited events (a solicited message, or an
    /// error).
    pub fn post(&mut self, cqe: &Cqe, solicited: bool) -> Result<Option<u32>, CqFull> {
        if self.lost {
            return Err(CqFull::Lost);
        }
        let consumer = self.ring.driver_index().unwrap_or(self.producer);
        if self.producer.wrapping_sub(consumer) >= self.ring.depth() {
            return Err(CqFull::Overrun);
        }
        if !self
            .ring
            .write_entry(self.producer, &cqe.as_bytes()[..CQE_SIZE])
        {
            return Err(CqFull::Lost);
        }
        self.producer = self.producer.wrapping_add(1);
        self.ring.set_device_index(self.producer);
        // The CQE is visible before the arm word is read: a driver that
        // arms and then polls finds it, or we see its arm.
        fence(Ordering::SeqCst);
        let arm = self.ring.driver_arm().unwrap_or(0);
        let (sn, kind) = (arm >> 8, arm & 0xff);
        let fire = match kind {
            CQ_ARM_NEXT => true,
            CQ_ARM_SOLICITED => solicited,
            _ => false,
        };
        if !fire || sn == self.notified_sn {
            return Ok(None);
        }
        self.notified_sn = sn;
        self.ring.set_notified_sn(sn);
        Ok(Some(self.cqn))
    }

    /// Notes an overrun; true the first time (its CQ_ERROR event is due).
    pub fn overran(&mut self) -> bool {
        !std::mem::replace(&mut self.overrun, true)
    }
}

/// An event ring and the interrupt of its vector.
#[derive(Debug)]
pub struct EventRing {
    ring: GuestRing,
    irq: EventFd,
    producer: u32,
    /// Events lost to a full ring.
    pub lost_events: u64,
    /// Its memory was removed.
    pub lost: bool,
}

impl EventRing {
    /// An event ring over `ring` interrupting through `irq`.
    pub fn new(ring: GuestRing, irq: EventFd) -> Self {
        ring.reset_device_line();
        EventRing {
            ring,
            irq,
            producer: 0,
            lost_events: 0,
            lost: false,
        }
    }

    /// The slot its ring lies in.
    pub fn slot(&self) -> u32 {
        self.ring.slot()
    }

    /// Writes an event and interrupts the driver.
    pub fn post(&mut self, kind: u16, object: u32) {
        if self.lost {
            return;
        }
        let consumer = self.ring.driver_index().unwrap_or(self.producer);
        if self.producer.wrapping_sub(consumer) >= self.ring.depth() {
            self.lost_events += 1;
            self.ring.set_device_flag(DEVICE_FLAG_ERROR);
        } else {
            let event = Event {
                kind: kind.into(),
                object: object.into(),
                ..Event::default()
            };
            if self
                .ring
                .write_entry(self.producer, &event.as_bytes()[..EVENT_SIZE])
            {
                self.producer = self.producer.wrapping_add(1);
                self.ring.set_device_index(self.producer);
            }
        }
        // A lost event still wakes the driver, which then finds the flag.
        let _ = self.irq.write(1);
    }
}

/// Posts `cqe` on `cq`, and the event it is due on its vector's ring;
/// returns whether the completion was written.
pub fn complete(cq: &mut Cq, eqs: &mut [Option<EventRing>], cqe: &Cqe, solicited: bool) -> bool {
    match cq.post(cqe, solicited) {
        Ok(fired) => {
            if let Some(cqn) = fired {
                post_event(eqs, cq.vector, event_kind::COMPLETION, cqn);
            }
            true
        }
        Err(CqFull::Overrun) => {
            if cq.overran() {
                post_event(eqs, cq.vector, event_kind::CQ_ERROR, cq.cqn);
            }
            false
        }
        Err(CqFull::Lost) => false,
    }
}

/// Posts an event on vector `vector`'s ring, if it has one.
pub fn post_event(eqs: &mut [Option<EventRing>], vector: u32, kind: u16, object: u32) {
    if let Some(Some(eq)) = eqs.get_mut(vector as usize) {
        eq.post(kind, object);
    }
}

/// Whether a completion of `status` wakes a CQ armed for solicited events
/// on its own (errors do).
pub fn solicits(status: WcStatus) -> bool {
    status != WcStatus::Success
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::guest::GuestMemory;
    use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};
    use vrdma_hostd_protocol::shm::{sealed_memfd, SharedMapping};
    use vrdma_spec::ring::{
        DEVICE_INDEX_OFFSET, DRIVER_ARM_OFFSET, DRIVER_INDEX_OFFSET, RING_HEADER_SIZE,
    };

    fn rings() -> (GuestMemory, SharedMapping) {
        let file = sealed_memfd("completion-test", 1 << 16).expect("memfd");
        let view = SharedMapping::map(file.try_clone().expect("dup"), 0, 1 << 16).expect("map");
        let mut mem = GuestMemory::default();
        mem.add(0, 0, SharedMapping::map(file, 0, 1 << 16).expect("map"))
            .expect("slot");
        (mem, view)
    }

    fn word(view: &SharedMapping, at: u64) -> u32 {
        let mut b = [0u8; 4];
        assert!(view.read(at as usize, &mut b));
        u32::from_le_bytes(b)
    }

    fn put(view: &SharedMapping, at: u64, v: u32) {
        assert!(view.write(at as usize, &v.to_le_bytes()));
    }

    #[test]
    fn cqes_fill_the_ring_then_overrun_once() {
        let (mem, view) = rings();
        let ring = GuestRing::new(&mem, 0, 2, CQE_SIZE as u32, 1 << 16).expect("ring");
        let mut cq = Cq::new(5, ring, 0);
        let eq_ring = GuestRing::new(&mem, 8192, 4, EVENT_SIZE as u32, 1 << 16).expect("eq");
        let irq = EventFd::new(EFD_NONBLOCK).expect("eventfd");
        let mut eqs = vec![Some(EventRing::new(eq_ring, irq.try_clone().expect("dup")))];
        let cqe = |id: u64| Cqe {
            wr_id: id.into(),
            ..Cqe::default()
        };
        assert!(complete(&mut cq, &mut eqs, &cqe(1), false));
        assert!(complete(&mut cq, &mut eqs, &cqe(2), false));
        assert_eq!(word(&view, DEVICE_INDEX_OFFSET), 2);
        assert!(!complete(&mut cq, &mut eqs, &cqe(3), false), "full");
        assert!(!complete(&mut cq, &mut eqs, &cqe(4), false), "still full");
        // One CQ_ERROR event for the overrun.
        assert_eq!(word(&view, 8192 + DEVICE_INDEX_OFFSET), 1);
        let mut event = [0u8; 4];
        assert!(view.read(8192 + RING_HEADER_SIZE, &mut event));
        assert_eq!(
            u16::from_le_bytes([event[0], event[1]]),
            event_kind::CQ_ERROR
        );
        assert_eq!(irq.read().expect("interrupted"), 1);
        // The driver consumes one: the next fits, in slot 0.
        put(&view, DRIVER_INDEX_OFFSET, 1);
        assert!(complete(&mut cq, &mut eqs, &cqe(5), false));
        let mut id = [0u8; 8];
        assert!(view.read(RING_HEADER_SIZE, &mut id));
        assert_eq!(u64::from_le_bytes(id), 5);
    }

    #[test]
    fn an_armed_cq_fires_once_per_arm() {
        let (mem, view) = rings();
        let ring = GuestRing::new(&mem, 0, 8, CQE_SIZE as u32, 1 << 16).expect("ring");
        let mut cq = Cq::new(9, ring, 0);
        let ok = Cqe::default();
        assert_eq!(cq.post(&ok, false), Ok(None), "not armed");
        put(&view, DRIVER_ARM_OFFSET, (1 << 8) | CQ_ARM_SOLICITED);
        assert_eq!(cq.post(&ok, false), Ok(None), "not solicited");
        assert_eq!(cq.post(&ok, true), Ok(Some(9)));
        assert_eq!(cq.post(&ok, true), Ok(None), "this arm was answered");
        put(&view, DRIVER_ARM_OFFSET, (2 << 8) | CQ_ARM_NEXT);
        assert_eq!(cq.post(&ok, false), Ok(Some(9)));
    }

    #[test]
    fn a_full_event_ring_flags_its_loss() {
        let (mem, view) = rings();
        let ring = GuestRing::new(&mem, 0, 2, EVENT_SIZE as u32, 1 << 16).expect("ring");
        let irq = EventFd::new(EFD_NONBLOCK).expect("eventfd");
        let mut eq = EventRing::new(ring, irq.try_clone().expect("dup"));
        for cq in 0..3 {
            eq.post(event_kind::COMPLETION, cq);
        }
        assert_eq!(eq.lost_events, 1);
        assert_eq!(
            word(&view, vrdma_spec::ring::DEVICE_FLAGS_OFFSET),
            DEVICE_FLAG_ERROR
        );
        assert_eq!(irq.read().expect("interrupted"), 3);
    }
}
