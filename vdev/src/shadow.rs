//! Shadow memory regions: the host-side record of a tenant's memory region.
//!
//! A tenant registers a range of guest-physical addresses. Its shadow is the
//! list of pieces of guest memory slots (as the VMM gave them to vdev) that
//! the range covers, built once at registration: `O(slots)`, not `O(pages)`,
//! so registering 1 GiB costs what registering 4 KiB does. Every later use
//! goes through [`ShadowRegion::translate`], which enforces bounds and access
//! and refuses a shadow whose memory the VMM has since removed.

use std::collections::HashSet;
use std::os::unix::fs::MetadataExt;

use vm_memory::{GuestAddress, GuestMemoryBackend, GuestMemoryMmap, GuestMemoryRegion};
use vrdma_spec::verbs::access;

/// Identity of one guest memory slot: the same guest-physical range backed
/// by the same file at the same offset. A VMM that re-sends its memory table
/// unchanged keeps every slot (and every shadow) alive; a slot that is
/// removed or changes its backing is gone for good.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SlotId {
    pub gpa: u64,
    len: u64,
    backing: Backing,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Backing {
    /// A file (memfd) mapping, as vhost-user gives: identified by inode.
    File { dev: u64, ino: u64, offset: u64 },
    /// Anonymous memory (unit tests): identified by its host mapping.
    Anonymous { host_addr: usize },
}

impl SlotId {
    /// The slot of `len` bytes at `gpa` backed by file `(dev, ino)` from
    /// `offset` (as a journal recorded it).
    pub fn of_file(gpa: u64, len: u64, dev: u64, ino: u64, offset: u64) -> Self {
        SlotId {
            gpa,
            len,
            backing: Backing::File { dev, ino, offset },
        }
    }

    /// Bytes of the slot.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether the slot is empty (never: a memory table has no empty
    /// region).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Its file's device, inode and offset; `None` for anonymous memory.
    pub fn file_backing(&self) -> Option<(u64, u64, u64)> {
        match self.backing {
            Backing::File { dev, ino, offset } => Some((dev, ino, offset)),
            Backing::Anonymous { .. } => None,
        }
    }

    /// The identity of `region`.
    pub fn of<R: GuestMemoryRegion>(region: &R) -> Self {
        let file = region
            .file_offset()
            .and_then(|fo| fo.file().metadata().ok().map(|m| (m, fo.start())));
        let backing = match file {
            Some((meta, offset)) => Backing::File {
                dev: meta.dev(),
                ino: meta.ino(),
                offset,
            },
            None => Backing::Anonymous {
                host_addr: region
                    .get_host_address(vm_memory::MemoryRegionAddress(0))
                    .map_or(0, |p| p as usize),
            },
        };
        SlotId {
            gpa: region.start_addr().0,
            len: region.len(),
            backing,
        }
    }
}

/// The set of slots in the current memory table.
#[derive(Debug, Default, Clone)]
pub struct MemorySlots(HashSet<SlotId>);

impl MemorySlots {
    /// The slots of `mem`.
    pub fn of(mem: &GuestMemoryMmap) -> Self {
        MemorySlots(mem.iter().map(SlotId::of).collect())
    }

    /// Whether `slot` is in the table.
    pub fn contains(&self, slot: &SlotId) -> bool {
        self.0.contains(slot)
    }

    /// Number of slots.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether there is no slot.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// A piece of a shadow: `len` bytes at `gpa`, inside `slot`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Segment {
    pub slot: SlotId,
    pub gpa: u64,
    pub len: u64,
}

/// Why a guest range cannot be shadowed.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ShadowError {
    #[error("Range of {len} bytes at {addr:#x} overflows the address space")]
    Overflow { addr: u64, len: u64 },
    #[error("Guest address {0:#x} is not in guest memory")]
    Unmapped(u64),
    #[error("Region needs more than {0} pieces of guest memory")]
    TooManyPieces(usize),
}

/// Appends the pieces of guest memory slots that `[addr, addr + len)` covers.
fn push_pieces(
    mem: &GuestMemoryMmap,
    addr: u64,
    len: u64,
    segments: &mut Vec<Segment>,
) -> Result<(), ShadowError> {
    let end = addr
        .checked_add(len)
        .ok_or(ShadowError::Overflow { addr, len })?;
    let mut cursor = addr;
    while cursor < end {
        let region = mem
            .find_region(GuestAddress(cursor))
            .ok_or(ShadowError::Unmapped(cursor))?;
        let region_end = region.start_addr().0.saturating_add(region.len());
        let piece = region_end.min(end) - cursor;
        segments.push(Segment {
            slot: SlotId::of(region),
            gpa: cursor,
            len: piece,
        });
        cursor += piece;
    }
    Ok(())
}

/// Why a work request's access through a shadow is refused. Each maps onto
/// the work-completion status an RC NIC reports.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum TranslateError {
    #[error("Memory region was revoked: its guest memory was removed")]
    Revoked,
    #[error("Access {want:#x} not granted by the region's flags {have:#x}")]
    Access { want: u32, have: u32 },
    #[error("Range [{iova:#x}, +{len}) is outside the region")]
    Bounds { iova: u64, len: u64 },
}

/// The shadow of one memory region.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShadowRegion {
    /// Address the region is known by in work requests.
    pub iova: u64,
    pub len: u64,
    /// [`access`] flags granted at registration.
    pub access: u32,
    segments: Vec<Segment>,
    revoked: bool,
}

impl ShadowRegion {
    /// Shadows `len` bytes of guest memory at `addr`, known as `iova`.
    pub fn build(
        mem: &GuestMemoryMmap,
        addr: u64,
        len: u64,
        iova: u64,
        access: u32,
    ) -> Result<Self, ShadowError> {
        if iova.checked_add(len).is_none() {
            return Err(ShadowError::Overflow { addr, len });
        }
        let mut segments = Vec::new();
        push_pieces(mem, addr, len, &mut segments)?;
        Ok(ShadowRegion::of_pieces(iova, len, access, segments))
    }

    /// Shadows a region made of `ranges` (guest `(addr, len)` pairs, each
    /// non-empty) concatenated in order, known as `iova`: the pieces of each
    /// range follow one another, so a physically scattered buffer becomes
    /// one region. At most `max_pieces` pieces (ranges split at memory-slot
    /// boundaries) are accepted.
    pub fn build_scattered(
        mem: &GuestMemoryMmap,
        ranges: &[(u64, u64)],
        iova: u64,
        access: u32,
        max_pieces: usize,
    ) -> Result<Self, ShadowError> {
        let mut segments = Vec::new();
        let mut len = 0u64;
        for &(addr, seg_len) in ranges {
            len = len
                .checked_add(seg_len)
                .ok_or(ShadowError::Overflow { addr, len: seg_len })?;
            push_pieces(mem, addr, seg_len, &mut segments)?;
            if segments.len() > max_pieces {
                return Err(ShadowError::TooManyPieces(max_pieces));
            }
        }
        if iova.checked_add(len).is_none() {
            return Err(ShadowError::Overflow { addr: iova, len });
        }
        Ok(ShadowRegion::of_pieces(iova, len, access, segments))
    }

    /// A region as a journal recorded it (its segments checked against
    /// their slots by the caller).
    pub fn restored(
        iova: u64,
        len: u64,
        access: u32,
        segments: Vec<Segment>,
        revoked: bool,
    ) -> Self {
        ShadowRegion {
            iova,
            len,
            access,
            segments,
            revoked,
        }
    }

    /// A live region of `len` bytes made of `segments`, known as `iova`.
    fn of_pieces(iova: u64, len: u64, access: u32, segments: Vec<Segment>) -> Self {
        ShadowRegion {
            iova,
            len,
            access,
            segments,
            revoked: false,
        }
    }

    /// The pieces of guest memory this region covers.
    pub fn segments(&self) -> &[Segment] {
        &self.segments
    }

    /// Whether the VMM removed memory under this region.
    pub fn is_revoked(&self) -> bool {
        self.revoked
    }

    /// Revokes the shadow if any of its slots is no longer in `slots`.
    /// Returns true when this call revoked it.
    pub fn revalidate(&mut self, slots: &MemorySlots) -> bool {
        if self.revoked || self.segments.iter().all(|s| slots.0.contains(&s.slot)) {
            return false;
        }
        self.revoked = true;
        true
    }

    /// Guest-physical pieces of `[iova, iova + len)`, if the region grants
    /// `want` (a set of [`access`] flags) and covers the whole range.
    pub fn translate(
        &self,
        iova: u64,
        len: u64,
        want: u32,
    ) -> Result<Vec<(GuestAddress, u64)>, TranslateError> {
        if self.revoked {
            return Err(TranslateError::Revoked);
        }
        if want & !self.access != 0 {
            return Err(TranslateError::Access {
                want,
                have: self.access,
            });
        }
        let bounds = TranslateError::Bounds { iova, len };
        let offset = iova.checked_sub(self.iova).ok_or_else(|| bounds.clone())?;
        let end = offset
            .checked_add(len)
            .filter(|&e| e <= self.len)
            .ok_or(bounds)?;
        let mut pieces = Vec::new();
        let mut seg_start = 0u64;
        for seg in &self.segments {
            let seg_end = seg_start + seg.len;
            let lo = offset.max(seg_start);
            let hi = end.min(seg_end);
            if lo < hi {
                pieces.push((GuestAddress(seg.gpa + (lo - seg_start)), hi - lo));
            }
            seg_start = seg_end;
        }
        Ok(pieces)
    }
}

/// Checks the IB rule on MR access flags: remote write or remote atomic
/// access requires local write access.
pub fn access_flags_consistent(flags: u32) -> bool {
    flags & (access::REMOTE_WRITE | access::REMOTE_ATOMIC) == 0 || flags & access::LOCAL_WRITE != 0
}

#[cfg(test)]
mod tests {
    use super::*;

    const PAGE: u64 = 4096;

    /// Two slots with a hole between them: [0x10000, +4 pages) and [0x20000, +4 pages),
    /// and a third adjacent to the second: [0x24000, +4 pages).
    fn memory() -> GuestMemoryMmap {
        GuestMemoryMmap::from_ranges(&[
            (GuestAddress(0x10000), 4 * PAGE as usize),
            (GuestAddress(0x20000), 4 * PAGE as usize),
            (GuestAddress(0x24000), 4 * PAGE as usize),
        ])
        .expect("anonymous guest memory")
    }

    #[test]
    fn a_range_across_adjacent_slots_has_one_segment_per_slot() {
        let mem = memory();
        let mr = ShadowRegion::build(&mem, 0x23000, 2 * PAGE, 0x23000, access::LOCAL_WRITE)
            .expect("mapped");
        let pieces: Vec<_> = mr.segments().iter().map(|s| (s.gpa, s.len)).collect();
        assert_eq!(pieces, vec![(0x23000, PAGE), (0x24000, PAGE)]);
        let t = mr
            .translate(0x23800, PAGE, access::LOCAL_WRITE)
            .expect("inside");
        assert_eq!(
            t,
            vec![
                (GuestAddress(0x23800), PAGE / 2),
                (GuestAddress(0x24000), PAGE / 2)
            ]
        );
    }

    #[test]
    fn holes_and_overflow_are_refused() {
        let mem = memory();
        assert_eq!(
            ShadowRegion::build(&mem, 0x13000, 2 * PAGE, 0, 0),
            Err(ShadowError::Unmapped(0x14000))
        );
        assert_eq!(
            ShadowRegion::build(&mem, u64::MAX - 10, 20, 0, 0),
            Err(ShadowError::Overflow {
                addr: u64::MAX - 10,
                len: 20
            })
        );
        assert!(
            ShadowRegion::build(&mem, 0x10000, 10, u64::MAX, 0).is_err(),
            "iova overflow"
        );
    }

    #[test]
    fn translate_enforces_bounds_access_and_iova() {
        let mem = memory();
        let mr = ShadowRegion::build(&mem, 0x10000, PAGE, 0x7000_0000, access::REMOTE_READ)
            .expect("mapped");
        assert_eq!(
            mr.translate(0x7000_0010, 16, access::REMOTE_READ)
                .expect("ok"),
            vec![(GuestAddress(0x10010), 16)]
        );
        assert!(matches!(
            mr.translate(0x7000_0000, 8, access::REMOTE_WRITE),
            Err(TranslateError::Access { .. })
        ));
        assert!(matches!(
            mr.translate(0x7000_0ff9, 8, access::REMOTE_READ),
            Err(TranslateError::Bounds { .. })
        ));
        assert!(matches!(
            mr.translate(0x6fff_ffff, 1, access::REMOTE_READ),
            Err(TranslateError::Bounds { .. })
        ));
        assert!(matches!(
            mr.translate(0x7000_0000, u64::MAX, access::REMOTE_READ),
            Err(TranslateError::Bounds { .. })
        ));
    }

    #[test]
    fn removing_a_slot_revokes_shadows_in_it_only() {
        let mem = memory();
        let mut in_first = ShadowRegion::build(&mem, 0x10000, PAGE, 0x10000, 0).expect("mapped");
        let mut in_second = ShadowRegion::build(&mem, 0x20000, PAGE, 0x20000, 0).expect("mapped");
        let (after, _removed) = mem
            .remove_region(GuestAddress(0x10000), 4 * PAGE)
            .expect("removed");
        let slots = MemorySlots::of(&after);
        assert_eq!(slots.len(), 2);
        assert!(in_first.revalidate(&slots));
        assert!(!in_second.revalidate(&slots));
        assert_eq!(
            in_first.translate(0x10000, 1, 0),
            Err(TranslateError::Revoked)
        );
        assert!(in_second.translate(0x20000, 1, 0).is_ok());
        assert!(!in_first.revalidate(&slots), "revoked once, stays revoked");
    }

    #[test]
    fn scattered_ranges_concatenate_in_list_order() {
        let mem = memory();
        // Out of address order, one crossing the adjacent-slot boundary.
        let ranges = [(0x21000, PAGE), (0x10800, 100), (0x23800, PAGE)];
        let mr = ShadowRegion::build_scattered(&mem, &ranges, 0x9000, access::LOCAL_WRITE, 8)
            .expect("mapped");
        assert_eq!(mr.len, 2 * PAGE + 100);
        let pieces: Vec<_> = mr.segments().iter().map(|s| (s.gpa, s.len)).collect();
        assert_eq!(
            pieces,
            vec![
                (0x21000, PAGE),
                (0x10800, 100),
                (0x23800, PAGE / 2),
                (0x24000, PAGE / 2)
            ]
        );
        // A WQE range across the first two segments gets both pieces.
        let t = mr
            .translate(0x9000 + PAGE - 8, 16, access::LOCAL_WRITE)
            .expect("inside");
        assert_eq!(
            t,
            vec![
                (GuestAddress(0x21000 + PAGE - 8), 8),
                (GuestAddress(0x10800), 8)
            ]
        );
        assert!(mr
            .translate(0x9000 + 2 * PAGE + 100, 1, access::LOCAL_WRITE)
            .is_err());
    }

    #[test]
    fn scattered_ranges_are_checked() {
        let mem = memory();
        assert_eq!(
            ShadowRegion::build_scattered(&mem, &[(0x10000, PAGE), (0x14000, 1)], 0, 0, 8),
            Err(ShadowError::Unmapped(0x14000))
        );
        assert!(matches!(
            ShadowRegion::build_scattered(&mem, &[(u64::MAX, 2)], 0, 0, 8),
            Err(ShadowError::Overflow { .. })
        ));
        assert!(matches!(
            ShadowRegion::build_scattered(&mem, &[(0x10000, 16)], u64::MAX - 8, 0, 8),
            Err(ShadowError::Overflow { .. })
        ));
        let across = [(0x23000, 2 * PAGE); 3];
        assert_eq!(
            ShadowRegion::build_scattered(&mem, &across, 0, 0, 5),
            Err(ShadowError::TooManyPieces(5))
        );
        assert!(ShadowRegion::build_scattered(&mem, &across, 0, 0, 6).is_ok());
    }

    #[test]
    fn remote_write_needs_local_write() {
        assert!(access_flags_consistent(
            access::LOCAL_WRITE | access::REMOTE_WRITE
        ));
        assert!(access_flags_consistent(access::REMOTE_READ));
        assert!(!access_flags_consistent(access::REMOTE_WRITE));
        assert!(!access_flags_consistent(
            access::REMOTE_ATOMIC | access::REMOTE_READ
        ));
    }
}
