//! The driver side of a virtio 1.x split virtqueue, in DMA memory.
//!
//! Layout (virtio 1.x, 2.7): a descriptor table (16 bytes per entry, 16-byte
//! aligned), the available ring (`flags, idx, ring[size], used_event`,
//! 2-byte aligned) and the used ring (`flags, idx, ring[size] of {id, len},
//! avail_event`, 4-byte aligned). All three live in one page-aligned DMA
//! allocation; the used ring starts on its own cache line because only the
//! device writes it.
//!
//! Ordering rules the device relies on: descriptors and the avail ring entry
//! are written first, then `avail.idx` is stored with release ordering. The
//! notify decision issues a full fence before reading the device's
//! `avail_event` (or `used.flags`), so a device that is about to sleep either
//! sees the new index or we see its request for a kick. `used.idx` is loaded
//! with acquire ordering before the used element is read.
//!
//! The driver keeps its own shadow of each chain's links, so freeing a chain
//! never trusts descriptor memory the device could have scribbled on.

use std::num::Wrapping;
use std::sync::atomic::{fence, Ordering};
use std::sync::Arc;

use crate::dma::{DmaArena, DmaBuf, DmaError, PAGE_SIZE};

const DESC_SIZE: usize = 16;
const VRING_DESC_F_NEXT: u16 = 1;
const VRING_DESC_F_WRITE: u16 = 2;
/// Driver → device: don't interrupt me (only without EVENT_IDX).
const VRING_AVAIL_F_NO_INTERRUPT: u16 = 1;
/// Device → driver: don't notify me (only without EVENT_IDX).
const VRING_USED_F_NO_NOTIFY: u16 = 1;

/// Errors of a virtqueue.
#[derive(Debug, thiserror::Error)]
pub enum QueueError {
    #[error("Queue size {0} is not a power of two between 1 and 32768")]
    BadSize(u16),
    #[error("Cannot allocate queue memory")]
    Memory(#[source] DmaError),
    #[error("A descriptor chain needs at least one buffer")]
    EmptyChain,
    #[error("Chain of {needed} descriptors does not fit in {free} free ones")]
    Full { needed: usize, free: usize },
    #[error("Device returned used id {0}, which is not an outstanding chain")]
    BadUsedId(u32),
}

/// The standard `vring_need_event`: whether moving the index from `old` to
/// `new` crosses `event` (the other side asked to be told once it passes it).
pub fn vring_need_event(event: u16, new: u16, old: u16) -> bool {
    new.wrapping_sub(event).wrapping_sub(1) < new.wrapping_sub(old)
}

/// Driver side of one split virtqueue.
#[derive(Debug)]
pub struct SplitQueue {
    mem: DmaBuf,
    size: u16,
    avail_off: usize,
    used_off: usize,
    event_idx: bool,
    /// Free descriptor indices (a stack).
    free: Vec<u16>,
    /// Shadow of `next` for each descriptor.
    next: Vec<u16>,
    /// Descriptors in the chain headed by each index; 0 when not a live head.
    chain_len: Vec<u16>,
    /// Next avail index to publish.
    avail_idx: Wrapping<u16>,
    /// avail index at the previous notify decision (`old` of vring_need_event).
    notified_idx: Wrapping<u16>,
    /// Next used index to consume.
    last_used: Wrapping<u16>,
}

impl SplitQueue {
    /// Allocates a queue of `size` entries (a power of two) in `arena`.
    /// `event_idx`: VIRTIO_RING_F_EVENT_IDX was negotiated.
    pub fn new(arena: &Arc<DmaArena>, size: u16, event_idx: bool) -> Result<Self, QueueError> {
        if size == 0 || !size.is_power_of_two() || size > 32768 {
            return Err(QueueError::BadSize(size));
        }
        let n = usize::from(size);
        let avail_off = DESC_SIZE * n;
        let used_off = (avail_off + 6 + 2 * n).next_multiple_of(64);
        let total = used_off + 6 + 8 * n;
        let mem = arena
            .alloc_zeroed(total, PAGE_SIZE)
            .map_err(QueueError::Memory)?;
        Ok(Self {
            mem,
            size,
            avail_off,
            used_off,
            event_idx,
            free: (0..size).rev().collect(),
            next: vec![0; n],
            chain_len: vec![0; n],
            avail_idx: Wrapping(0),
            notified_idx: Wrapping(0),
            last_used: Wrapping(0),
        })
    }

    /// Number of entries.
    pub fn size(&self) -> u16 {
        self.size
    }

    /// Device address of the descriptor table.
    pub fn desc_addr(&self) -> u64 {
        self.mem.device_addr()
    }

    /// Device address of the available ring.
    pub fn avail_addr(&self) -> u64 {
        self.mem.device_addr() + self.avail_off as u64
    }

    /// Device address of the used ring.
    pub fn used_addr(&self) -> u64 {
        self.mem.device_addr() + self.used_off as u64
    }

    /// Free descriptors.
    pub fn num_free(&self) -> usize {
        self.free.len()
    }

    /// Adds and publishes a chain of device-readable then device-writable
    /// buffers (device `(addr, len)` pairs); returns its head index.
    pub fn add_chain(
        &mut self,
        readable: &[(u64, u32)],
        writable: &[(u64, u32)],
    ) -> Result<u16, QueueError> {
        let needed = readable.len() + writable.len();
        if needed == 0 {
            return Err(QueueError::EmptyChain);
        }
        if needed > self.free.len() {
            return Err(QueueError::Full {
                needed,
                free: self.free.len(),
            });
        }
        let split = self.free.len() - needed;
        let ids: Vec<u16> = self.free.drain(split..).rev().collect();
        let bufs = readable
            .iter()
            .map(|b| (b, 0))
            .chain(writable.iter().map(|b| (b, VRING_DESC_F_WRITE)));
        for (i, (&(addr, len), write)) in bufs.enumerate() {
            let id = ids[i];
            let (flags, next) = match ids.get(i + 1) {
                Some(&next) => (write | VRING_DESC_F_NEXT, next),
                None => (write, 0),
            };
            self.next[usize::from(id)] = next;
            let mut desc = [0u8; DESC_SIZE];
            desc[0..8].copy_from_slice(&addr.to_le_bytes());
            desc[8..12].copy_from_slice(&len.to_le_bytes());
            desc[12..14].copy_from_slice(&flags.to_le_bytes());
            desc[14..16].copy_from_slice(&next.to_le_bytes());
            self.mem.write_at(DESC_SIZE * usize::from(id), &desc);
        }
        let head = ids[0];
        // `needed` <= size <= 32768.
        self.chain_len[usize::from(head)] = needed as u16;

        let slot = usize::from(self.avail_idx.0 & (self.size - 1));
        self.mem
            .atomic_u16(self.avail_off + 4 + 2 * slot)
            .store(head.to_le(), Ordering::Relaxed);
        self.avail_idx += 1;
        // Release: the descriptors and the ring entry are visible before the index.
        fence(Ordering::Release);
        self.mem
            .atomic_u16(self.avail_off + 2)
            .store(self.avail_idx.0.to_le(), Ordering::Relaxed);
        Ok(head)
    }

    /// Whether the device wants a notification for what was published since
    /// the previous call (Linux's `virtqueue_kick_prepare`).
    pub fn should_notify(&mut self) -> bool {
        // Full fence: our avail.idx store is ordered before reading the
        // device's suppression state (it does the mirror image).
        fence(Ordering::SeqCst);
        let (new, old) = (self.avail_idx.0, self.notified_idx.0);
        self.notified_idx = self.avail_idx;
        if self.event_idx {
            let avail_event = u16::from_le(
                self.mem
                    .atomic_u16(self.used_off + 4 + 8 * usize::from(self.size))
                    .load(Ordering::Relaxed),
            );
            vring_need_event(avail_event, new, old)
        } else {
            let flags = u16::from_le(self.mem.atomic_u16(self.used_off).load(Ordering::Relaxed));
            flags & VRING_USED_F_NO_NOTIFY == 0
        }
    }

    /// Takes the next used chain: `(head, bytes written by the device)`.
    pub fn pop_used(&mut self) -> Result<Option<(u16, u32)>, QueueError> {
        let used_idx = u16::from_le(
            self.mem
                .atomic_u16(self.used_off + 2)
                .load(Ordering::Acquire),
        );
        if used_idx == self.last_used.0 {
            return Ok(None);
        }
        let slot = usize::from(self.last_used.0 & (self.size - 1));
        let elem = self.used_off + 4 + 8 * slot;
        let id = u32::from_le(self.mem.atomic_u32(elem).load(Ordering::Relaxed));
        let len = u32::from_le(self.mem.atomic_u32(elem + 4).load(Ordering::Relaxed));
        let head = u16::try_from(id)
            .ok()
            .filter(|&h| h < self.size && self.chain_len[usize::from(h)] != 0)
            .ok_or(QueueError::BadUsedId(id))?;
        let mut desc = head;
        for _ in 0..self.chain_len[usize::from(head)] {
            self.free.push(desc);
            desc = self.next[usize::from(desc)];
        }
        self.chain_len[usize::from(head)] = 0;
        self.last_used += 1;
        if self.event_idx {
            // Ask for an interrupt when the device passes the next entry.
            self.write_used_event();
        }
        Ok(Some((head, len)))
    }

    /// Asks the device for interrupts again; returns true when used entries
    /// are already pending (the caller should poll before sleeping).
    pub fn enable_interrupts(&mut self) -> bool {
        if self.event_idx {
            self.write_used_event();
        } else {
            let flags = self.mem.atomic_u16(self.avail_off);
            let v = u16::from_le(flags.load(Ordering::Relaxed)) & !VRING_AVAIL_F_NO_INTERRUPT;
            flags.store(v.to_le(), Ordering::Relaxed);
        }
        // Full fence: publish the request before re-reading used.idx, so an
        // entry added meanwhile is either seen here or interrupts us.
        fence(Ordering::SeqCst);
        let used_idx = u16::from_le(
            self.mem
                .atomic_u16(self.used_off + 2)
                .load(Ordering::Acquire),
        );
        used_idx != self.last_used.0
    }

    /// Asks the device not to interrupt (a hint; without EVENT_IDX only).
    pub fn disable_interrupts(&mut self) {
        if !self.event_idx {
            let flags = self.mem.atomic_u16(self.avail_off);
            let v = u16::from_le(flags.load(Ordering::Relaxed)) | VRING_AVAIL_F_NO_INTERRUPT;
            flags.store(v.to_le(), Ordering::Relaxed);
        }
    }

    fn write_used_event(&self) {
        self.mem
            .atomic_u16(self.avail_off + 4 + 2 * usize::from(self.size))
            .store(self.last_used.0.to_le(), Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use virtio_queue::{Queue, QueueT};
    use vm_memory::{Bytes, FileOffset, GuestAddress, GuestMemoryMmap};

    /// The device's view: a second mapping of the arena's memfd, at
    /// guest-physical addresses equal to the driver's virtual addresses.
    fn device_memory(arena: &DmaArena) -> GuestMemoryMmap {
        let file = arena.file().expect("memfd arena").try_clone().unwrap();
        GuestMemoryMmap::from_ranges_with_files(&[(
            GuestAddress(arena.device_addr()),
            arena.size(),
            Some(FileOffset::new(file, 0)),
        )])
        .unwrap()
    }

    fn device_queue(vq: &SplitQueue, mem: &GuestMemoryMmap, event_idx: bool) -> Queue {
        let mut q = Queue::new(vq.size()).unwrap();
        q.set_size(vq.size());
        let split = |a: u64| (Some(a as u32), Some((a >> 32) as u32));
        let (lo, hi) = split(vq.desc_addr());
        q.set_desc_table_address(lo, hi);
        let (lo, hi) = split(vq.avail_addr());
        q.set_avail_ring_address(lo, hi);
        let (lo, hi) = split(vq.used_addr());
        q.set_used_ring_address(lo, hi);
        q.set_event_idx(event_idx);
        q.set_ready(true);
        assert!(q.is_valid(mem));
        q
    }

    /// A fresh arena (kept alive by the caller) with a driver queue of
    /// `size` entries in it, the device's view of the arena and its side of
    /// the queue.
    fn queues(size: u16, event_idx: bool) -> (Arc<DmaArena>, GuestMemoryMmap, SplitQueue, Queue) {
        let arena = DmaArena::new(1 << 20).unwrap();
        let mem = device_memory(&arena);
        let vq = SplitQueue::new(&arena, size, event_idx).unwrap();
        let dq = device_queue(&vq, &mem, event_idx);
        (arena, mem, vq, dq)
    }

    #[test]
    fn need_event_formula() {
        assert!(vring_need_event(0, 1, 0));
        assert!(!vring_need_event(1, 1, 0));
        assert!(vring_need_event(5, 10, 0));
        assert!(!vring_need_event(10, 10, 0));
        // Across the u16 wrap.
        assert!(vring_need_event(65535, 2, 65534));
        assert!(!vring_need_event(3, 2, 65534));
    }

    #[test]
    fn chain_round_trip_with_rust_vmm_device() {
        let (arena, mem, mut vq, mut dq) = queues(8, true);

        let req = arena.alloc(12, 64).unwrap();
        req.write_at(0, b"hello device");
        let resp = arena.alloc(16, 64).unwrap();
        let head = vq
            .add_chain(&[(req.device_addr(), 12)], &[(resp.device_addr(), 16)])
            .unwrap();
        assert_eq!(vq.num_free(), 6);

        let chain = dq.pop_descriptor_chain(&mem).expect("a chain");
        assert_eq!(chain.head_index(), head);
        let descs: Vec<_> = chain.clone().collect();
        assert_eq!(descs.len(), 2);
        assert!(!descs[0].is_write_only());
        assert_eq!(descs[0].addr().0, req.device_addr());
        assert_eq!(descs[0].len(), 12);
        let mut got = [0u8; 12];
        mem.read_slice(&mut got, descs[0].addr()).unwrap();
        assert_eq!(&got, b"hello device");
        assert!(descs[1].is_write_only());
        assert_eq!(descs[1].len(), 16);
        mem.write_slice(b"hello driver", descs[1].addr()).unwrap();

        assert_eq!(vq.pop_used().unwrap(), None);
        dq.add_used(&mem, head, 12).unwrap();
        assert_eq!(vq.pop_used().unwrap(), Some((head, 12)));
        let mut out = [0u8; 12];
        resp.read_at(0, &mut out);
        assert_eq!(&out, b"hello driver");
        assert_eq!(vq.num_free(), 8);
        assert_eq!(vq.pop_used().unwrap(), None);
    }

    #[test]
    fn wraps_around_many_times() {
        let (arena, mem, mut vq, mut dq) = queues(4, true);
        let buf = arena.alloc(4096, 64).unwrap();
        // 70000 chains: the u16 indices wrap past 65535, the rings many times.
        for round in 0u32..70_000 {
            let n = (round % 3) as usize + 1;
            let bufs: Vec<(u64, u32)> = (0..n)
                .map(|i| (buf.device_addr() + 8 * i as u64, round))
                .collect();
            let (r, w) = bufs.split_at(n / 2);
            let head = vq.add_chain(r, w).unwrap();
            let chain = dq.pop_descriptor_chain(&mem).expect("a chain");
            assert_eq!(chain.head_index(), head);
            let descs: Vec<_> = chain.collect();
            assert_eq!(descs.len(), n);
            assert!(descs.iter().all(|d| d.len() == round));
            assert_eq!(descs.iter().filter(|d| d.is_write_only()).count(), w.len());
            dq.add_used(&mem, head, round ^ 0x55).unwrap();
            assert_eq!(vq.pop_used().unwrap(), Some((head, round ^ 0x55)));
        }
        assert_eq!(vq.num_free(), 4);
        assert!(dq.pop_descriptor_chain(&mem).is_none());
    }

    #[test]
    fn full_queue_and_batches_out_of_order() {
        let (_arena, mem, mut vq, mut dq) = queues(4, false);
        let a = vq.add_chain(&[(0x1000, 1)], &[(0x2000, 2)]).unwrap();
        let b = vq.add_chain(&[], &[(0x3000, 3), (0x4000, 4)]).unwrap();
        assert!(matches!(
            vq.add_chain(&[(0x5000, 5)], &[]),
            Err(QueueError::Full { needed: 1, free: 0 })
        ));
        assert!(matches!(
            vq.add_chain(&[], &[]),
            Err(QueueError::EmptyChain)
        ));
        let ca = dq.pop_descriptor_chain(&mem).unwrap();
        let cb = dq.pop_descriptor_chain(&mem).unwrap();
        assert_eq!((ca.head_index(), cb.head_index()), (a, b));
        // Completed out of order.
        dq.add_used(&mem, b, 7).unwrap();
        dq.add_used(&mem, a, 3).unwrap();
        assert_eq!(vq.pop_used().unwrap(), Some((b, 7)));
        assert_eq!(vq.num_free(), 2);
        assert_eq!(vq.pop_used().unwrap(), Some((a, 3)));
        assert_eq!(vq.num_free(), 4);
    }

    #[test]
    fn bogus_used_id_is_rejected() {
        let (_arena, mem, mut vq, mut dq) = queues(4, true);
        let head = vq.add_chain(&[(0x1000, 1)], &[]).unwrap();
        let _ = dq.pop_descriptor_chain(&mem).unwrap();
        // A head that was never handed out.
        dq.add_used(&mem, (head + 1) % 4, 0).unwrap();
        assert!(matches!(vq.pop_used(), Err(QueueError::BadUsedId(_))));
    }

    #[test]
    fn event_idx_notifications_both_ways() {
        let (_arena, mem, mut vq, mut dq) = queues(8, true);

        // Driver → device. The device asks to be kicked at avail index 0
        // (enable_notification writes avail_event = next_avail).
        assert!(
            !dq.enable_notification(&mem).unwrap(),
            "nothing pending yet"
        );
        let h0 = vq.add_chain(&[(0x1000, 1)], &[]).unwrap();
        assert!(vq.should_notify(), "device asked for avail_event 0");
        // Device keeps polling: it has not moved avail_event, so no kick.
        let h1 = vq.add_chain(&[(0x1000, 1)], &[]).unwrap();
        assert!(!vq.should_notify());
        // Device drains and sleeps again: avail_event = 2.
        let c0 = dq.pop_descriptor_chain(&mem).unwrap();
        let c1 = dq.pop_descriptor_chain(&mem).unwrap();
        assert!(!dq.enable_notification(&mem).unwrap());
        let h2 = vq.add_chain(&[(0x1000, 1)], &[]).unwrap();
        let h3 = vq.add_chain(&[(0x1000, 1)], &[]).unwrap();
        assert!(vq.should_notify(), "batch of 2 crossed avail_event 2");

        // Device → driver. Fresh queue: used_event is 0, the first used
        // entry interrupts.
        dq.add_used(&mem, c0.head_index(), 0).unwrap();
        assert!(dq.needs_notification(&mem).unwrap());
        assert_eq!(vq.pop_used().unwrap(), Some((h0, 0)));
        // The driver is busy polling: it moves used_event only as it pops,
        // so an entry the driver has already asked for still interrupts...
        dq.add_used(&mem, c1.head_index(), 0).unwrap();
        assert!(dq.needs_notification(&mem).unwrap());
        // ...but the next one (used_event still 1) does not.
        let c2 = dq.pop_descriptor_chain(&mem).unwrap();
        dq.add_used(&mem, c2.head_index(), 0).unwrap();
        assert!(!dq.needs_notification(&mem).unwrap());
        assert_eq!(vq.pop_used().unwrap(), Some((h1, 0)));
        assert_eq!(vq.pop_used().unwrap(), Some((h2, 0)));
        // Re-arming with nothing pending says so; then the next entry interrupts.
        assert!(!vq.enable_interrupts());
        let c3 = dq.pop_descriptor_chain(&mem).unwrap();
        dq.add_used(&mem, c3.head_index(), 9).unwrap();
        assert!(dq.needs_notification(&mem).unwrap());
        assert!(vq.enable_interrupts(), "an entry is pending");
        assert_eq!(vq.pop_used().unwrap(), Some((h3, 9)));
    }

    #[test]
    fn no_event_idx_uses_flags() {
        let (_arena, mem, mut vq, mut dq) = queues(4, false);
        vq.add_chain(&[(0x1000, 1)], &[]).unwrap();
        assert!(vq.should_notify());
        dq.disable_notification(&mem).unwrap();
        vq.add_chain(&[(0x1000, 1)], &[]).unwrap();
        assert!(!vq.should_notify(), "device set VRING_USED_F_NO_NOTIFY");
        // Driver-side suppression: the avail flags the device reads
        // (virtio-queue itself ignores them, so check the bytes).
        let avail = GuestAddress(vq.avail_addr());
        let flags = |mem: &GuestMemoryMmap| mem.read_obj::<u16>(avail).unwrap();
        vq.disable_interrupts();
        assert_eq!(flags(&mem), VRING_AVAIL_F_NO_INTERRUPT);
        let c = dq.pop_descriptor_chain(&mem).unwrap();
        dq.add_used(&mem, c.head_index(), 0).unwrap();
        assert!(vq.enable_interrupts(), "an entry is pending");
        assert_eq!(flags(&mem), 0);
        assert!(vq.pop_used().unwrap().is_some());
    }
}
