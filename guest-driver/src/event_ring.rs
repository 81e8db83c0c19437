//! The event ring of one completion vector ([`vrdma_spec::ring`], `CREATE_EQ`):
//! the device writes [`Event`]s into it and then raises the vector's
//! interrupt; the driver reads them here.

use vrdma_spec::ring::{event_ring_bytes, valid_depth, Event, DEVICE_FLAG_ERROR, EVENT_SIZE};

use crate::dma::DmaBuf;
use crate::error::Error;
use crate::ring::ConsumerRing;

/// An event ring the driver consumes.
#[derive(Debug)]
pub(crate) struct EventRing {
    ring: ConsumerRing,
    vector: u16,
    /// The overflow was reported already (the device's flag is sticky).
    overflow_reported: bool,
}

impl EventRing {
    /// Length and alignment of the memory a ring of `depth` events needs,
    /// or why `depth` is not a valid one.
    pub(crate) fn alloc_args(depth: u32) -> Result<(usize, usize), Error> {
        if !valid_depth(depth) {
            return Err(Error::InvalidArgument(
                "event ring depth must be a power of two up to MAX_RING_DEPTH",
            ));
        }
        ConsumerRing::alloc_args(event_ring_bytes(depth))
    }

    /// The ring of completion vector `vector`: `depth` events in `mem`
    /// (zeroed, allocated with [`EventRing::alloc_args`]).
    pub(crate) fn new(mem: DmaBuf, depth: u32, vector: u16) -> Self {
        Self {
            ring: ConsumerRing::new(mem, depth, EVENT_SIZE),
            vector,
            overflow_reported: false,
        }
    }

    pub(crate) fn device_addr(&self) -> u64 {
        self.ring.device_addr()
    }

    /// The next event, if the device wrote one: read once, and its slot
    /// handed back at once.
    pub(crate) fn pop(&mut self) -> Result<Option<Event>, Error> {
        self.check_overflow();
        let mut one = [Event::default()];
        let n = self.ring.consume(&mut one, |raw: &[u8; EVENT_SIZE]| {
            zerocopy::transmute!(*raw)
        })?;
        Ok((n == 1).then_some(one[0]))
    }

    /// Whether the device reported that the ring overflowed.
    pub(crate) fn overflowed(&self) -> bool {
        self.ring.device_flags() & DEVICE_FLAG_ERROR != 0
    }

    /// Warns once when the device flags the ring as overflowed: events were
    /// lost, so a waiter on a completion channel may wait for one that
    /// never comes. The driver cannot recover them; the warning says why.
    fn check_overflow(&mut self) {
        if !self.overflow_reported && self.overflowed() {
            self.overflow_reported = true;
            tracing::warn!(
                vector = self.vector,
                "Event ring overflowed: the device dropped events (completion \
                 events of armed CQs may be missing); use a deeper event ring"
            );
        }
    }

    #[cfg(test)]
    pub(crate) fn mem(&self) -> &DmaBuf {
        self.ring.mem()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dma::DmaArena;
    use crate::testing::event;
    use std::sync::atomic::Ordering;
    use vrdma_spec::ring::{
        event_kind, DEVICE_FLAGS_OFFSET, DEVICE_INDEX_OFFSET, DRIVER_INDEX_OFFSET, RING_HEADER_SIZE,
    };
    use zerocopy::IntoBytes;

    /// Writes `events` into `mem` (an event ring of `depth`) the way the
    /// device does: slots first, then its producer index with release.
    fn device_writes(mem: &DmaBuf, depth: u32, producer: &mut u32, events: &[Event]) {
        for e in events {
            let slot = (*producer & (depth - 1)) as usize;
            mem.write_at(RING_HEADER_SIZE + slot * EVENT_SIZE, e.as_bytes());
            *producer = producer.wrapping_add(1);
        }
        mem.atomic_u32(DEVICE_INDEX_OFFSET as usize)
            .store(producer.to_le(), Ordering::Release);
    }

    fn ring(depth: u32) -> EventRing {
        let (len, align) = EventRing::alloc_args(depth).unwrap();
        let arena = DmaArena::new(1 << 20).unwrap();
        EventRing::new(arena.alloc_zeroed(len, align).unwrap(), depth, 0)
    }

    fn driver_index(r: &EventRing) -> u32 {
        u32::from_le(
            r.mem()
                .atomic_u32(DRIVER_INDEX_OFFSET as usize)
                .load(Ordering::Acquire),
        )
    }

    #[test]
    fn events_are_consumed_in_order_across_wraps() {
        let depth = 4;
        let mut r = ring(depth);
        let mut producer = 0;
        assert_eq!(r.pop().unwrap(), None);
        for round in 0..10u32 {
            let batch: Vec<_> = (0..3)
                .map(|i| event(event_kind::COMPLETION, 10 * round + i))
                .collect();
            device_writes(r.mem(), depth, &mut producer, &batch);
            for (i, expected) in batch.iter().enumerate() {
                assert_eq!(r.pop().unwrap(), Some(*expected), "round {round} event {i}");
                // Each slot goes back to the device as soon as it was read.
                assert_eq!(driver_index(&r), 3 * round + i as u32 + 1);
            }
            assert_eq!(r.pop().unwrap(), None);
        }
        // A full ring (depth events unread) is fine; one more is a device bug.
        let full: Vec<_> = (0..depth).map(|i| event(event_kind::QP_FATAL, i)).collect();
        device_writes(r.mem(), depth, &mut producer, &full);
        assert_eq!(r.pop().unwrap(), Some(full[0]));
        producer = producer.wrapping_add(2);
        device_writes(r.mem(), depth, &mut producer, &[]);
        assert_eq!(r.pop().unwrap_err().errno(), libc::EPROTO);
    }

    #[test]
    fn an_overflowed_ring_is_reported_and_still_read() {
        let depth = 2;
        let mut r = ring(depth);
        assert!(!r.overflowed());
        let mut producer = 0;
        device_writes(
            r.mem(),
            depth,
            &mut producer,
            &[event(event_kind::CQ_ERROR, 5)],
        );
        r.mem()
            .atomic_u32(DEVICE_FLAGS_OFFSET as usize)
            .store(DEVICE_FLAG_ERROR.to_le(), Ordering::Release);
        assert!(r.overflowed());
        assert_eq!(r.pop().unwrap(), Some(event(event_kind::CQ_ERROR, 5)));
        assert!(r.overflow_reported);
        assert_eq!(r.pop().unwrap(), None);
    }

    #[test]
    fn depths_are_checked() {
        assert!(EventRing::alloc_args(0).is_err());
        assert!(EventRing::alloc_args(1000).is_err());
        assert!(EventRing::alloc_args(vrdma_spec::limits::MAX_RING_DEPTH * 2).is_err());
        let (len, align) = EventRing::alloc_args(1024).unwrap();
        assert_eq!((len, align), (128 + 1024 * 16, 4096));
    }
}
