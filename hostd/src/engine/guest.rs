//! hostd's window on a tenant's guest memory: the memory slots its vdev
//! passed (sealed memfds, mapped here) and the rings placed in them.
//!
//! Everything behind these mappings is shared with a hostile guest and may
//! change at any moment. So: a ring's place is validated once, when it is
//! created (aligned, inside one slot); indices are read with one atomic
//! load and bounded by the caller before use; entries are copied out once
//! (`read_entry`) and only the copy is decoded. Nothing here hands out a
//! reference into guest memory except the ring-header atomics.
//!
//! The device's writes go here too: a CQE is written into its slot, then
//! the producer index is published with release ordering, then — after a
//! full fence — the driver's arm word is read: an arm whose sequence number
//! was not answered yet gets one completion event (the spec's arming rule,
//! `vrdma_spec::ring`). An event goes into the event ring of its vector,
//! and the vector's interrupt eventfd is written. A CQ or event ring the
//! driver lets fill up loses what does not fit, as on a NIC: a CQ overrun
//! is reported once with a CQ_ERROR event, an overflowed event ring by its
//! ERROR flag.

use std::sync::atomic::{fence, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;

use vmm_sys_util::eventfd::EventFd;
use vrdma_hostd_protocol::shm::SharedMapping;
use vrdma_spec::ring::{
    event_kind, Cqe, Event, CQE_SIZE, CQ_ARM_NEXT, CQ_ARM_SOLICITED, DEVICE_FLAGS_OFFSET,
    DEVICE_FLAG_ERROR, DEVICE_INDEX_OFFSET, DEVICE_NOTIFIED_SN_OFFSET, DRIVER_ARM_OFFSET,
    DRIVER_INDEX_OFFSET, EVENT_SIZE, RING_ALIGN, RING_HEADER_SIZE,
};
use vrdma_spec::verbs::WcStatus;
use zerocopy::IntoBytes;

use super::EngineError;

/// Memory slots one device may have (vhost-user allows 509).
pub const MAX_SLOTS: usize = 1024;

/// One guest memory slot: guest-physical `[gpa, gpa + len)` is `map`.
#[derive(Debug)]
struct Slot {
    gpa: u64,
    map: Arc<SharedMapping>,
}

/// The guest memory slots of one device, by slot number.
#[derive(Debug, Default)]
pub struct GuestMemory {
    slots: Vec<Option<Slot>>,
}

impl GuestMemory {
    /// Slot `slot` is guest-physical `[gpa, gpa + map.len())`.
    pub fn add(&mut self, slot: u32, gpa: u64, map: SharedMapping) -> Result<(), EngineError> {
        let index = slot as usize;
        if index >= MAX_SLOTS {
            return Err(EngineError::Limit("memory slots"));
        }
        if gpa.checked_add(map.len() as u64).is_none() {
            return Err(EngineError::Invalid("memory slot wraps the address space"));
        }
        if self.slots.len() <= index {
            self.slots.resize_with(index + 1, || None);
        }
        if self.slots[index].is_some() {
            return Err(EngineError::SlotExists(slot));
        }
        self.slots[index] = Some(Slot {
            gpa,
            map: Arc::new(map),
        });
        Ok(())
    }

    /// Forgets slot `slot`. Its mapping lives on only in what still holds
    /// it (the caller revokes those).
    pub fn remove(&mut self, slot: u32) -> Result<(), EngineError> {
        self.slots
            .get_mut(slot as usize)
            .and_then(Option::take)
            .map(|_| ())
            .ok_or(EngineError::UnknownSlot(slot))
    }

    /// The mapping of slot `slot`.
    pub fn slot(&self, slot: u32) -> Option<&Arc<SharedMapping>> {
        self.slots
            .get(slot as usize)
            .and_then(Option::as_ref)
            .map(|s| &s.map)
    }

    /// `[gpa, gpa + len)` as a place in one slot, if it lies inside one and
    /// `gpa` is a multiple of `align`.
    pub fn place(&self, gpa: u64, len: u64, align: u64) -> Option<Place> {
        if len == 0 || !gpa.is_multiple_of(align) {
            return None;
        }
        let end = gpa.checked_add(len)?;
        self.slots.iter().enumerate().find_map(|(number, slot)| {
            let slot = slot.as_ref()?;
            let slot_end = slot.gpa.checked_add(slot.map.len() as u64)?;
            if gpa < slot.gpa || end > slot_end {
                return None;
            }
            Some(Place {
                slot: number as u32,
                map: Arc::clone(&slot.map),
                offset: usize::try_from(gpa - slot.gpa).ok()?,
                len: usize::try_from(len).ok()?,
            })
        })
    }
}

/// A validated range of one slot's mapping: the home of a ring or page.
#[derive(Debug, Clone)]
pub struct Place {
    /// The slot it lies in (removing the slot loses what lives here).
    pub slot: u32,
    map: Arc<SharedMapping>,
    offset: usize,
    len: usize,
}

impl Place {
    fn u32_at(&self, at: u64) -> Option<&AtomicU32> {
        (at as usize + 4 <= self.len).then(|| self.map.atomic_u32(self.offset + at as usize))?
    }

    fn u64_at(&self, at: u64) -> Option<&AtomicU64> {
        (at as usize + 8 <= self.len).then(|| self.map.atomic_u64(self.offset + at as usize))?
    }
}

/// A ring in guest memory: a [`vrdma_spec::ring::RingHeader`] and `depth`
/// entries of `stride` bytes, checked to lie in one slot.
#[derive(Debug, Clone)]
pub struct GuestRing {
    place: Place,
    depth: u32,
    stride: u32,
}

impl GuestRing {
    /// The ring at `gpa`, if it is [`RING_ALIGN`]-aligned, `depth` and
    /// `stride` are powers of two (`depth` at most `max_depth`), and all of
    /// it lies in one slot of `mem`.
    pub fn new(
        mem: &GuestMemory,
        gpa: u64,
        depth: u32,
        stride: u32,
        max_depth: u32,
    ) -> Result<Self, EngineError> {
        if !depth.is_power_of_two() || depth > max_depth || !stride.is_power_of_two() {
            return Err(EngineError::Invalid("ring depth or stride"));
        }
        let bytes = RING_HEADER_SIZE as u64 + u64::from(depth) * u64::from(stride);
        let place = mem
            .place(gpa, bytes, RING_ALIGN)
            .ok_or(EngineError::Invalid(
                "ring is not aligned inside one memory slot",
            ))?;
        Ok(GuestRing {
            place,
            depth,
            stride,
        })
    }

    /// The slot the ring lies in.
    pub fn slot(&self) -> u32 {
        self.place.slot
    }

    pub fn depth(&self) -> u32 {
        self.depth
    }

    pub fn stride(&self) -> u32 {
        self.stride
    }

    /// The driver's index (producer of a work ring, consumer of a
    /// completion or event ring). `None` only if the ring's memory is
    /// unusable, which its creation ruled out.
    pub fn driver_index(&self) -> Option<u32> {
        self.place
            .u32_at(DRIVER_INDEX_OFFSET)
            .map(|a| u32::from_le(a.load(Ordering::Acquire)))
    }

    /// The driver's CQ arm word.
    pub fn driver_arm(&self) -> Option<u32> {
        self.place
            .u32_at(DRIVER_ARM_OFFSET)
            .map(|a| u32::from_le(a.load(Ordering::Acquire)))
    }

    /// Publishes the device's index (consumer of a work ring, producer of a
    /// completion or event ring), after the entries it covers.
    pub fn set_device_index(&self, index: u32) {
        if let Some(a) = self.place.u32_at(DEVICE_INDEX_OFFSET) {
            a.store(index.to_le(), Ordering::Release);
        }
    }

    /// Sets `flag` in the device's flags.
    pub fn set_device_flag(&self, flag: u32) {
        if let Some(a) = self.place.u32_at(DEVICE_FLAGS_OFFSET) {
            a.fetch_or(flag.to_le(), Ordering::Release);
        }
    }

    /// Resets the device's half of the header to `index` with no flags
    /// (a QP back in RESET: everything posted so far was discarded).
    pub fn restart_device_line(&self, index: u32) {
        if let Some(a) = self.place.u32_at(DEVICE_FLAGS_OFFSET) {
            a.store(0, Ordering::Release);
        }
        self.set_device_index(index);
    }

    /// Clears the device's half of the header: index, flags, notified_sn.
    pub fn reset_device_line(&self) {
        for offset in [
            DEVICE_INDEX_OFFSET,
            DEVICE_FLAGS_OFFSET,
            DEVICE_NOTIFIED_SN_OFFSET,
        ] {
            if let Some(a) = self.place.u32_at(offset) {
                a.store(0, Ordering::Release);
            }
        }
    }

    /// Stores the CQ arm sequence number last answered.
    pub fn set_notified_sn(&self, sn: u32) {
        if let Some(a) = self.place.u32_at(DEVICE_NOTIFIED_SN_OFFSET) {
            a.store(sn.to_le(), Ordering::Release);
        }
    }

    fn entry_offset(&self, index: u32, at: usize, len: usize) -> Option<usize> {
        if at.checked_add(len)? > self.stride as usize {
            return None;
        }
        let slot = (index & (self.depth - 1)) as usize;
        Some(self.place.offset + RING_HEADER_SIZE + slot * self.stride as usize + at)
    }

    /// Copies bytes `[at, at + out.len())` of entry `index` out of the
    /// ring, once; false if that is not inside one entry.
    pub fn read_entry(&self, index: u32, at: usize, out: &mut [u8]) -> bool {
        self.entry_offset(index, at, out.len())
            .is_some_and(|offset| self.place.map.read(offset, out))
    }

    /// Writes `data` at the start of entry `index`; false if it does not
    /// fit one entry.
    pub fn write_entry(&self, index: u32, data: &[u8]) -> bool {
        self.entry_offset(index, 0, data.len())
            .is_some_and(|offset| self.place.map.write(offset, data))
    }
}

/// A device's doorbell page ([`vrdma_spec::ring::doorbell`]).
#[derive(Debug, Clone)]
pub struct DoorbellPage {
    place: Place,
}

impl DoorbellPage {
    /// The page at `gpa`, if it is page-aligned inside one slot.
    pub fn new(mem: &GuestMemory, gpa: u64) -> Result<Self, EngineError> {
        use vrdma_spec::ring::doorbell::PAGE_SIZE;
        let place = mem
            .place(gpa, PAGE_SIZE, PAGE_SIZE)
            .ok_or(EngineError::Invalid(
                "doorbell page is not aligned inside one memory slot",
            ))?;
        Ok(DoorbellPage { place })
    }

    /// The slot the page lies in.
    pub fn slot(&self) -> u32 {
        self.place.slot
    }

    /// Takes the doorbells rung since the last call: clears the summary
    /// words, then the bitmap words they name, and calls `ring` with the
    /// index of every bit that was set. Returns how many bits it found.
    pub fn take(&self, mut ring: impl FnMut(u32)) -> usize {
        use vrdma_spec::ring::doorbell::{
            BITMAP_OFFSET, BITMAP_WORDS, SUMMARY_OFFSET, SUMMARY_WORDS,
        };
        let mut found = 0;
        for s in 0..SUMMARY_WORDS {
            let Some(summary) = self.place.u64_at(SUMMARY_OFFSET + 8 * s as u64) else {
                continue;
            };
            // A load first: the common case is an idle device, and a swap
            // would take the line from the driver for nothing.
            if summary.load(Ordering::Relaxed) == 0 {
                continue;
            }
            let mut words = u64::from_le(summary.swap(0, Ordering::AcqRel));
            while words != 0 {
                let w = s * 64 + words.trailing_zeros() as usize;
                words &= words - 1;
                if w >= BITMAP_WORDS {
                    continue;
                }
                let Some(word) = self.place.u64_at(BITMAP_OFFSET + 8 * w as u64) else {
                    continue;
                };
                let mut bits = u64::from_le(word.swap(0, Ordering::AcqRel));
                while bits != 0 {
                    ring((w * 64) as u32 + bits.trailing_zeros());
                    bits &= bits - 1;
                    found += 1;
                }
            }
        }
        found
    }

    /// Whether any summary bit is set (work was announced since the last
    /// [`DoorbellPage::take`]).
    pub fn pending(&self) -> bool {
        use vrdma_spec::ring::doorbell::{SUMMARY_OFFSET, SUMMARY_WORDS};
        (0..SUMMARY_WORDS).any(|s| {
            self.place
                .u64_at(SUMMARY_OFFSET + 8 * s as u64)
                .is_some_and(|w| w.load(Ordering::SeqCst) != 0)
        })
    }

    /// Asks the driver to notify the doorbell queue after it rings (the
    /// device is about to sleep), or stops asking.
    pub fn set_need_kick(&self, need: bool) {
        use vrdma_spec::ring::doorbell::{FLAGS_OFFSET, NEED_KICK};
        if let Some(flags) = self.place.u32_at(FLAGS_OFFSET) {
            let value = if need { NEED_KICK } else { 0 };
            flags.store(value.to_le(), Ordering::SeqCst);
        }
    }
}

// Completions and events: what the device writes for the driver.

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
    use vrdma_hostd_protocol::shm::sealed_memfd;
    use vrdma_spec::ring::doorbell;

    const GPA: u64 = 0x10_0000;

    fn memory(bytes: u64) -> (GuestMemory, Arc<SharedMapping>) {
        let file = sealed_memfd("guest-test", bytes).expect("memfd");
        let view = SharedMapping::map(file.try_clone().expect("dup"), 0, bytes).expect("map");
        let mut mem = GuestMemory::default();
        mem.add(3, GPA, SharedMapping::map(file, 0, bytes).expect("map"))
            .expect("slot");
        (mem, Arc::new(view))
    }

    #[test]
    fn places_lie_in_one_slot_and_are_aligned() {
        let (mem, _) = memory(64 * 1024);
        assert!(mem.place(GPA, 64 * 1024, 4096).is_some());
        assert!(mem.place(GPA + 1, 16, 4096).is_none(), "misaligned");
        assert!(
            mem.place(GPA + 60 * 1024, 8 * 1024, 4096).is_none(),
            "past the end"
        );
        assert!(
            mem.place(GPA - 4096, 8192, 4096).is_none(),
            "before the slot"
        );
        assert!(mem.place(u64::MAX - 4095, 8192, 4096).is_none(), "wraps");
        assert!(GuestRing::new(&mem, GPA, 3, 64, 1 << 16).is_err(), "depth");
        assert!(
            GuestRing::new(&mem, GPA, 1024, 128, 1 << 16).is_err(),
            "too big"
        );
        assert!(
            GuestRing::new(&mem, GPA, 1 << 17, 16, 1 << 16).is_err(),
            "max depth"
        );
        let ring = GuestRing::new(&mem, GPA + 4096, 16, 64, 1 << 16).expect("fits");
        assert_eq!(ring.slot(), 3);
    }

    #[test]
    fn ring_entries_and_header_go_where_the_spec_says() {
        let (mem, view) = memory(64 * 1024);
        let ring = GuestRing::new(&mem, GPA, 4, 64, 1 << 16).expect("fits");
        assert!(view.write(DRIVER_INDEX_OFFSET as usize, &7u32.to_le_bytes()));
        assert_eq!(ring.driver_index(), Some(7));
        ring.set_device_index(5);
        let mut word = [0u8; 4];
        assert!(view.read(DEVICE_INDEX_OFFSET as usize, &mut word));
        assert_eq!(u32::from_le_bytes(word), 5);
        // Entry 6 wraps to slot 2.
        assert!(ring.write_entry(6, b"hello"));
        let mut out = [0u8; 5];
        assert!(view.read(RING_HEADER_SIZE + 2 * 64, &mut out));
        assert_eq!(&out, b"hello");
        assert!(ring.read_entry(2, 1, &mut out[..4]));
        assert_eq!(&out[..4], b"ello");
        assert!(
            !ring.read_entry(0, 60, &mut out),
            "crosses into the next entry"
        );
        assert!(!ring.write_entry(0, &[0u8; 65]));
    }

    #[test]
    fn doorbells_are_taken_once_and_in_full() {
        let (mem, view) = memory(8192);
        let page = DoorbellPage::new(&mem, GPA).expect("page");
        let ring = |db: u32| {
            let bit = doorbell::bit(db).expect("in range");
            let word = view.atomic_u64(bit.word_offset as usize).expect("word");
            word.fetch_or(bit.mask.to_le(), Ordering::SeqCst);
            let summary = view
                .atomic_u64(bit.summary_offset as usize)
                .expect("summary");
            summary.fetch_or(bit.summary_mask.to_le(), Ordering::SeqCst);
        };
        assert!(!page.pending());
        for db in [0, 63, 64, 4097, 16383] {
            ring(db);
        }
        assert!(page.pending());
        let mut seen = Vec::new();
        assert_eq!(page.take(|db| seen.push(db)), 5);
        seen.sort_unstable();
        assert_eq!(seen, vec![0, 63, 64, 4097, 16383]);
        assert!(!page.pending());
        assert_eq!(page.take(|_| panic!("nothing rang")), 0);
        page.set_need_kick(true);
        let flags = view.atomic_u32(0).expect("flags").load(Ordering::SeqCst);
        assert_eq!(u32::from_le(flags), doorbell::NEED_KICK);
    }
}

#[cfg(test)]
mod completion_tests {
    use super::*;
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
