//! The device's doorbell page ([`vrdma_spec::ring::doorbell`]): how the
//! driver tells the device which QPs have new work.
//!
//! One page per device, given to it with `SET_DOORBELL`. After publishing a
//! ring's producer index the driver sets the QP's bit in the bitmap, then
//! the bitmap word's bit in the summary, then reads the device's flags: a
//! polling device finds the bits by reading the summary; a device about to
//! sleep has set NEED_KICK first and is woken through the doorbell
//! virtqueue. Ringing is lock-free (two atomic ORs and a load), so QPs
//! posting on several threads never serialize on the page.

use std::sync::atomic::Ordering;

use vrdma_spec::ring::doorbell::{self, Bit};
use vrdma_spec::ring::RING_ALIGN;

use crate::dma::DmaBuf;

/// The doorbell page in DMA memory.
#[derive(Debug)]
pub(crate) struct DoorbellPage {
    mem: DmaBuf,
}

impl DoorbellPage {
    /// Length and alignment of the memory the page needs.
    pub(crate) const ALLOC_ARGS: (usize, usize) =
        (doorbell::PAGE_SIZE as usize, RING_ALIGN as usize);

    /// The page in `mem`: zeroed, allocated with [`DoorbellPage::ALLOC_ARGS`].
    pub(crate) fn new(mem: DmaBuf) -> Self {
        debug_assert!(mem.len() as u64 >= doorbell::PAGE_SIZE);
        debug_assert!(mem.device_addr() & (RING_ALIGN - 1) == 0);
        Self { mem }
    }

    pub(crate) fn device_addr(&self) -> u64 {
        self.mem.device_addr()
    }

    /// Marks the QP of `bit` as having new work; returns whether the device
    /// asked to be kicked. Call after the producer index is published.
    pub(crate) fn ring(&self, bit: &Bit) -> bool {
        // The words are little-endian; OR-ing a byte-swapped mask is the
        // same as byte-swapping the OR, so `to_le` suffices on any host.
        //
        // Bitmap word first: a device that saw the summary bit and cleared
        // it must then find the QP's bit. SeqCst RMWs also order the
        // producer store before them (release) for the device that takes
        // the bits with its swap (acquire).
        self.mem
            .atomic_u64(to_offset(bit.word_offset))
            .fetch_or(bit.mask.to_le(), Ordering::SeqCst);
        self.mem
            .atomic_u64(to_offset(bit.summary_offset))
            .fetch_or(bit.summary_mask.to_le(), Ordering::SeqCst);
        // The device sets NEED_KICK, fences and re-reads the summary before
        // it sleeps; we OR (a full fence) and then read the flag: either it
        // sees our bits or we see its flag.
        let flags = self
            .mem
            .atomic_u32(to_offset(doorbell::FLAGS_OFFSET))
            .load(Ordering::SeqCst);
        u32::from_le(flags) & doorbell::NEED_KICK != 0
    }
}

/// An offset inside the page (bounded by the spec's layout, checked by
/// [`vrdma_spec::ring::doorbell::bit`]).
fn to_offset(offset: u64) -> usize {
    usize::try_from(offset).unwrap_or(usize::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dma::DmaArena;
    use vrdma_spec::limits::MAX_QPS;

    fn page() -> DoorbellPage {
        let (len, align) = DoorbellPage::ALLOC_ARGS;
        let arena = DmaArena::new(1 << 16).unwrap();
        DoorbellPage::new(arena.alloc_zeroed(len, align).unwrap())
    }

    fn word(page: &DoorbellPage, offset: u64) -> u64 {
        let mut raw = [0u8; 8];
        page.mem.read_at(offset as usize, &mut raw);
        u64::from_le_bytes(raw)
    }

    /// The device's side of the handshake: take the summary, then the words.
    fn device_takes(page: &DoorbellPage) -> Vec<u32> {
        let mut found = Vec::new();
        for s in 0..doorbell::SUMMARY_WORDS {
            let summary_offset = doorbell::SUMMARY_OFFSET as usize + 8 * s;
            let mut summary = u64::from_le(
                page.mem
                    .atomic_u64(summary_offset)
                    .swap(0, Ordering::SeqCst),
            );
            while summary != 0 {
                let w = s * 64 + summary.trailing_zeros() as usize;
                summary &= summary - 1;
                let offset = doorbell::BITMAP_OFFSET as usize + 8 * w;
                let mut bits = u64::from_le(page.mem.atomic_u64(offset).swap(0, Ordering::SeqCst));
                while bits != 0 {
                    found.push((w * 64) as u32 + bits.trailing_zeros());
                    bits &= bits - 1;
                }
            }
        }
        found
    }

    #[test]
    fn ringing_sets_the_qp_bit_and_its_summary_bit() {
        let page = page();
        let qp = 64 * 65 + 3;
        let bit = doorbell::bit(qp).unwrap();
        assert!(!page.ring(&bit), "no kick while the device polls");
        // Bitmap word 65, bit 3; summary word 1 (words 64..127), bit 1.
        assert_eq!(word(&page, doorbell::BITMAP_OFFSET + 65 * 8), 1 << 3);
        assert_eq!(word(&page, doorbell::SUMMARY_OFFSET + 8), 1 << 1);
        assert_eq!(word(&page, doorbell::SUMMARY_OFFSET), 0);
        assert_eq!(word(&page, doorbell::BITMAP_OFFSET + 64 * 8), 0);
        // A second QP in the same word keeps the first one's bit.
        page.ring(&doorbell::bit(64 * 65 + 60).unwrap());
        assert_eq!(
            word(&page, doorbell::BITMAP_OFFSET + 65 * 8),
            (1 << 3) | (1 << 60)
        );
        page.ring(&doorbell::bit(0).unwrap());
        page.ring(&doorbell::bit(MAX_QPS - 1).unwrap());
        assert_eq!(word(&page, doorbell::SUMMARY_OFFSET), 1);
        assert_eq!(word(&page, doorbell::SUMMARY_OFFSET + 24), 1 << 63);
        assert_eq!(
            device_takes(&page),
            vec![0, 64 * 65 + 3, 64 * 65 + 60, MAX_QPS - 1]
        );
        // Taken: everything is clear, and ringing again sets it again.
        assert!(device_takes(&page).is_empty());
        page.ring(&bit);
        assert_eq!(device_takes(&page), vec![qp]);
        // The device line is never written by the driver.
        assert_eq!(word(&page, doorbell::FLAGS_OFFSET), 0);
    }

    #[test]
    fn kick_only_when_the_device_asked() {
        let page = page();
        let bit = doorbell::bit(7).unwrap();
        assert!(!page.ring(&bit));
        let flags = page.mem.atomic_u32(doorbell::FLAGS_OFFSET as usize);
        flags.store(doorbell::NEED_KICK.to_le(), Ordering::SeqCst);
        assert!(page.ring(&bit));
        // Other device flag bits do not ask for a kick.
        flags.store(0x8000_0000u32.to_le(), Ordering::SeqCst);
        assert!(!page.ring(&bit));
    }
}
