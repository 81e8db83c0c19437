//! hostd's window on a tenant's guest memory: the memory slots its vdev
//! passed (sealed memfds, mapped here: [`SharedMapping`]), the rings placed
//! in them, and every access the engine makes to them — ring entries read,
//! doorbells taken, payloads copied (the DMA engine), completions and
//! events written.
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

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::sync::atomic::{fence, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;

use vmm_sys_util::eventfd::EventFd;
use vrdma_hostd_protocol::shm::{require_shrink_seal, ShmError};
use vrdma_spec::ring::{
    event_kind, Cqe, Event, CQE_SIZE, CQ_ARM_NEXT, CQ_ARM_SOLICITED, DEVICE_FLAGS_OFFSET,
    DEVICE_FLAG_ERROR, DEVICE_INDEX_OFFSET, DEVICE_NOTIFIED_SN_OFFSET, DRIVER_ARM_OFFSET,
    DRIVER_INDEX_OFFSET, EVENT_SIZE, RING_ALIGN, RING_HEADER_SIZE,
};
use vrdma_spec::verbs::WcStatus;
use zerocopy::IntoBytes;

use super::EngineError;

/// A `MAP_SHARED` read-write mapping of a file, unmapped on drop.
#[derive(Debug)]
pub struct SharedMapping {
    ptr: *mut u8,
    len: usize,
    _file: File,
}

// SAFETY: the mapping is plain shared memory; all access goes through
// atomics or volatile copies, which are sound from any thread.
unsafe impl Send for SharedMapping {}
// SAFETY: as above: no method hands out references to the memory itself.
unsafe impl Sync for SharedMapping {}

impl SharedMapping {
    /// Maps `len` bytes of `file` at `offset`. The file must be sealed
    /// against shrinking and hold the whole range, so no access through the
    /// mapping can ever fault, whatever the peer does later.
    pub fn map(file: File, offset: u64, len: u64) -> Result<Self, ShmError> {
        require_shrink_seal(&file)?;
        let size = file.metadata().map_err(ShmError::Map)?.len();
        let end = offset.checked_add(len).ok_or(ShmError::TooSmall {
            needed: u64::MAX,
            actual: size,
        })?;
        if end > size || len == 0 {
            return Err(ShmError::TooSmall {
                needed: end,
                actual: size,
            });
        }
        let len = usize::try_from(len).map_err(|_| ShmError::TooSmall {
            needed: end,
            actual: size,
        })?;
        let off = libc::off_t::try_from(offset).map_err(|_| ShmError::TooSmall {
            needed: end,
            actual: size,
        })?;
        // SAFETY: a fresh shared mapping of a file range checked to exist;
        // the kernel picks the address; the result is checked.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                off,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(ShmError::Map(io::Error::last_os_error()));
        }
        Ok(SharedMapping {
            ptr: ptr.cast(),
            len,
            _file: file,
        })
    }

    /// Start of the mapping.
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr
    }

    /// Length of the mapping.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the mapping is empty (never: `map` refuses that).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The address of `[offset, offset + len)` if it lies inside the
    /// mapping.
    fn range(&self, offset: usize, len: usize) -> Option<*mut u8> {
        let end = offset.checked_add(len)?;
        // SAFETY: offset <= end <= self.len: inside the mapping.
        (end <= self.len).then(|| unsafe { self.ptr.add(offset) })
    }

    /// Asks the CPU to bring the cache line at `offset` close (nothing if
    /// it is outside the mapping): a hint, which never faults and changes
    /// nothing a reader sees.
    pub fn prefetch(&self, offset: usize) {
        if let Some(at) = self.range(offset, 1) {
            crate::cpu::prefetch(at);
        }
    }

    /// Copies `out.len()` bytes at `offset` out of the mapping; false if the
    /// range is outside it.
    pub fn read(&self, offset: usize, out: &mut [u8]) -> bool {
        let Some(at) = self.range(offset, out.len()) else {
            return false;
        };
        // SAFETY: `at` starts `out.len()` bytes inside the mapping; `out` is
        // private memory of its length.
        unsafe { copy_shared(at, out.as_mut_ptr(), out.len(), Shared::Source) };
        true
    }

    /// Copies `data` into the mapping at `offset`; false if outside it.
    pub fn write(&self, offset: usize, data: &[u8]) -> bool {
        let Some(at) = self.range(offset, data.len()) else {
            return false;
        };
        // SAFETY: `at` starts `data.len()` bytes inside the mapping; `data`
        // is private memory of its length.
        unsafe { copy_shared(data.as_ptr(), at, data.len(), Shared::Destination) };
        true
    }

    /// Copies `len` bytes at `src_offset` of this mapping to `dst_offset` of
    /// `dst` (possibly this mapping); false if either range is outside its
    /// mapping.
    ///
    /// This is the DMA engine's bulk path (`dma_copy`), not the volatile
    /// copy used for everything hostd interprets: the payload is opaque —
    /// never decoded, never used for a decision — so a peer rewriting it
    /// mid-copy changes only which bytes arrive, exactly as with a hardware
    /// DMA engine.
    pub fn copy_to(
        &self,
        src_offset: usize,
        dst: &SharedMapping,
        dst_offset: usize,
        len: usize,
    ) -> bool {
        let (Some(from), Some(to)) = (self.range(src_offset, len), dst.range(dst_offset, len))
        else {
            return false;
        };
        // SAFETY: both ranges lie inside live mappings (checked above);
        // `dma_copy` allows them to overlap (the same mapping on both sides).
        unsafe { dma_copy(from, to, len) };
        true
    }

    /// The `u32` at `offset` as an atomic; `None` if it is not 4-aligned
    /// or not inside the mapping.
    pub fn atomic_u32(&self, offset: usize) -> Option<&AtomicU32> {
        let end = offset.checked_add(4)?;
        if !offset.is_multiple_of(4) || end > self.len {
            return None;
        }
        // SAFETY: in bounds and 4-aligned (mappings are page-aligned),
        // checked above; shared memory is valid for atomics for as long as
        // `self` keeps it mapped, which bounds the returned lifetime.
        Some(unsafe { &*self.ptr.add(offset).cast::<AtomicU32>() })
    }

    /// The `u64` at `offset` as an atomic; `None` if it is not 8-aligned
    /// or not inside the mapping.
    pub fn atomic_u64(&self, offset: usize) -> Option<&AtomicU64> {
        let end = offset.checked_add(8)?;
        if !offset.is_multiple_of(8) || end > self.len {
            return None;
        }
        // SAFETY: as in `atomic_u32`, with 8-byte alignment checked.
        Some(unsafe { &*self.ptr.add(offset).cast::<AtomicU64>() })
    }
}

impl Drop for SharedMapping {
    fn drop(&mut self) {
        // SAFETY: ptr/len are exactly what mmap returned.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

/// Which side of a copy is shared memory.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Shared {
    Source,
    Destination,
}

/// Copies `len` bytes between private memory and shared memory (the side
/// `shared` says): the shared side with volatile accesses (the compiler
/// reads or writes shared memory exactly once and never assumes it stays
/// unchanged), 8 bytes at a time where the shared side is aligned — only
/// its alignment matters, the private side is accessed unaligned.
///
/// # Safety
/// `src` must be valid for `len` bytes of reads and `dst` for `len` bytes of
/// writes; the ranges must not overlap.
#[inline(always)]
unsafe fn copy_shared(src: *const u8, dst: *mut u8, len: usize, shared: Shared) {
    let shared_addr = match shared {
        Shared::Source => src as usize,
        Shared::Destination => dst as usize,
    };
    let mut i = 0;
    if shared_addr.is_multiple_of(8) {
        while i + 8 <= len {
            // SAFETY: i + 8 <= len, inside both ranges; the shared side at
            // `+ i` is 8-aligned, the private side is accessed unaligned.
            unsafe {
                let (s, d) = (src.add(i).cast::<u64>(), dst.add(i).cast::<u64>());
                match shared {
                    Shared::Source => d.write_unaligned(s.read_volatile()),
                    Shared::Destination => d.write_volatile(s.read_unaligned()),
                }
            }
            i += 8;
        }
    }
    while i < len {
        // SAFETY: i < len, inside both ranges.
        unsafe {
            let (s, d) = (src.add(i), dst.add(i));
            match shared {
                Shared::Source => d.write(s.read_volatile()),
                Shared::Destination => d.write_volatile(s.read()),
            }
        }
        i += 1;
    }
}

/// Copies below this size go to `memmove` whatever the CPU.
const VECTOR_COPY_MIN: usize = 1024;

/// Copies `len` bytes from `src` to `dst` (the ranges may overlap): the
/// DMA engine's payload copy.
///
/// Large non-overlapping copies use 32-byte vector loads and stores where
/// the CPU has AVX2, not glibc's `memmove`: for these sizes `memmove` uses
/// `rep movsb`, which on some CPUs (AMD EPYC among them, measured on the
/// development host) slows to ~2.4 GB/s when source and destination are
/// not mutually aligned — and a tenant's buffers can be at any address —
/// where the vector loop keeps ~40 GB/s (docs/performance.md).
///
/// # Safety
/// `src` must be valid for reads and `dst` for writes of `len` bytes.
unsafe fn dma_copy(src: *const u8, dst: *mut u8, len: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        let (s, d) = (src as usize, dst as usize);
        let apart = s.abs_diff(d) >= len;
        if len >= VECTOR_COPY_MIN && apart && std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU has AVX2 (checked); the ranges are valid
            // (the caller's promise) and do not overlap (checked).
            unsafe { avx2_copy(src, dst, len) };
            return;
        }
    }
    // SAFETY: forwarded from the caller; `ptr::copy` allows overlap.
    unsafe { std::ptr::copy(src, dst, len) };
}

/// A forward copy 128 bytes at a time with unaligned AVX2 loads and
/// stores, the tail with `memcpy`.
///
/// # Safety
/// The CPU must have AVX2; `src` valid for reads and `dst` for writes of
/// `len` bytes; the ranges must not overlap.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn avx2_copy(src: *const u8, dst: *mut u8, len: usize) {
    use std::arch::x86_64::{__m256i, _mm256_loadu_si256, _mm256_storeu_si256};
    let mut i = 0;
    while i + 128 <= len {
        // SAFETY: i + 128 <= len, inside both ranges; unaligned loads and
        // stores have no alignment requirement.
        unsafe {
            let s = src.add(i).cast::<__m256i>();
            let d = dst.add(i).cast::<__m256i>();
            let (a, b) = (_mm256_loadu_si256(s), _mm256_loadu_si256(s.add(1)));
            let (c, e) = (_mm256_loadu_si256(s.add(2)), _mm256_loadu_si256(s.add(3)));
            _mm256_storeu_si256(d, a);
            _mm256_storeu_si256(d.add(1), b);
            _mm256_storeu_si256(d.add(2), c);
            _mm256_storeu_si256(d.add(3), e);
        }
        i += 128;
    }
    // SAFETY: the tail [i, len) is inside both ranges, which do not overlap.
    unsafe { std::ptr::copy_nonoverlapping(src.add(i), dst.add(i), len - i) };
}

/// Most entries [`GuestRing::prefetch_entries`] fetches ahead: about the
/// misses a core keeps in flight.
pub const PREFETCH_ENTRIES: u32 = 8;

/// Memory slots beside one per memory region that a device may have: the
/// guest's RAM (a VM), the driver's ring arenas and doorbell page (process
/// mode). In process mode each region registered over scattered
/// application memory is a slot of its own, so a device's slots are capped
/// at the tenant's `max_mr` plus these ([`slot_limit`]): `max_mr` is the
/// limit a program meets.
pub const SLOTS_BESIDE_MRS: usize = 256;

/// Hard ceiling on a device's slot numbers, whatever the policy says.
pub const MAX_SLOTS: usize = vrdma_tenant_policy::CEILING.max_mr as usize + SLOTS_BESIDE_MRS;

/// Slots a device of a tenant with `max_mr` may have.
pub fn slot_limit(max_mr: u32) -> usize {
    (max_mr as usize)
        .saturating_add(SLOTS_BESIDE_MRS)
        .min(MAX_SLOTS)
}

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
    /// Slot `slot` is guest-physical `[gpa, gpa + map.len())`; slot numbers
    /// are below `limit` (vdev reuses the lowest free number, so the
    /// number bounds the count too).
    pub fn add(
        &mut self,
        slot: u32,
        gpa: u64,
        map: SharedMapping,
        limit: usize,
    ) -> Result<(), EngineError> {
        let index = slot as usize;
        if index >= limit.min(MAX_SLOTS) {
            return Err(EngineError::SlotLimit { slot, limit });
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

    /// The device's index as its header holds it (what a previous
    /// datapath last published), to continue the ring from.
    pub fn device_index(&self) -> Option<u32> {
        self.place
            .u32_at(DEVICE_INDEX_OFFSET)
            .map(|a| u32::from_le(a.load(Ordering::Acquire)))
    }

    /// The CQ arm sequence number last answered, as the header holds it.
    pub fn notified_sn(&self) -> Option<u32> {
        self.place
            .u32_at(DEVICE_NOTIFIED_SN_OFFSET)
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

    /// Prefetches the first line of `count` entries from `index` on (at
    /// most [`PREFETCH_ENTRIES`] and the ring's depth): posted WQEs are
    /// fetched together, as a NIC fetches a burst of descriptors, instead
    /// of one cache miss after the other as they run.
    pub fn prefetch_entries(&self, index: u32, count: u32) {
        for i in 0..count.min(PREFETCH_ENTRIES).min(self.depth) {
            if let Some(offset) = self.entry_offset(index.wrapping_add(i), 0, 1) {
                self.place.map.prefetch(offset);
            }
        }
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

/// A datapath thread's direct view of one doorbell page's summary words:
/// whether the device was rung is one load from the page, with no lookup
/// through the engine's tables (which, with many devices, cost cache
/// misses per device per round for devices nobody rang).
#[derive(Debug)]
pub struct SummaryHint {
    /// Keeps the mapping that `words` points into alive.
    _map: Arc<SharedMapping>,
    /// The page's [`SUMMARY_WORDS`](vrdma_spec::ring::doorbell::SUMMARY_WORDS)
    /// summary words.
    words: *const AtomicU64,
}

impl SummaryHint {
    /// Whether any summary bit is set. Only a hint: the bits are taken
    /// (and the rings read) under the engine's lock.
    pub fn rung(&self) -> bool {
        use vrdma_spec::ring::doorbell::SUMMARY_WORDS;
        (0..SUMMARY_WORDS).any(|s| {
            // SAFETY: `words` points at the summary words of a doorbell
            // page checked to lie inside `_map` (DoorbellPage::new), which
            // this hint keeps mapped; the words are 8-aligned shared memory.
            let word = unsafe { &*self.words.add(s) };
            word.load(Ordering::Relaxed) != 0
        })
    }
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

    /// A [`SummaryHint`] on this page.
    pub fn hint(&self) -> Option<SummaryHint> {
        use vrdma_spec::ring::doorbell::SUMMARY_OFFSET;
        let first = self.place.u64_at(SUMMARY_OFFSET)?;
        Some(SummaryHint {
            _map: Arc::clone(&self.place.map),
            words: std::ptr::from_ref(first),
        })
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
    /// The producer index the driver was last shown (`device.index`):
    /// inside a datapath round CQEs are written at once and published
    /// together at its end ([`Cq::publish`]), one index store, fence and
    /// arm check per CQ and round instead of per CQE.
    published: u32,
    /// A CQE written since the last publication wakes a solicited arm.
    solicited_pending: bool,
    /// It is on the engine's list of CQs to publish.
    pub publish_queued: bool,
    /// The driver's consumer index as last read: while it leaves room the
    /// index (a line the driver's core writes) is not read again (it only
    /// moves forward, so a stale value under-estimates the room).
    seen_consumer: u32,
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
        Cq::fresh(cqn, ring, vector)
    }

    /// A CQ over `ring` that a previous datapath wrote: it continues from
    /// the producer index and notified sequence number in its header.
    pub fn resume(cqn: u32, ring: GuestRing, vector: u32) -> Self {
        let (producer, notified_sn) = (ring.device_index(), ring.notified_sn());
        let producer = producer.unwrap_or(0);
        Cq {
            producer,
            published: producer,
            // Unknown: read at the first completion.
            seen_consumer: producer.wrapping_sub(ring.depth()),
            notified_sn: notified_sn.unwrap_or(0),
            ..Cq::fresh(cqn, ring, vector)
        }
    }

    fn fresh(cqn: u32, ring: GuestRing, vector: u32) -> Self {
        Cq {
            cqn,
            ring,
            vector,
            producer: 0,
            published: 0,
            solicited_pending: false,
            publish_queued: false,
            seen_consumer: 0,
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
        self.write(cqe, solicited)?;
        Ok(self.publish())
    }

    /// Writes `cqe` into the ring without showing it to the driver yet
    /// ([`Cq::publish`] does), or says why it could not.
    pub fn write(&mut self, cqe: &Cqe, solicited: bool) -> Result<(), CqFull> {
        if self.lost {
            return Err(CqFull::Lost);
        }
        if self.producer.wrapping_sub(self.seen_consumer) >= self.ring.depth() {
            self.seen_consumer = self.ring.driver_index().unwrap_or(self.producer);
            if self.producer.wrapping_sub(self.seen_consumer) >= self.ring.depth() {
                return Err(CqFull::Overrun);
            }
        }
        if !self
            .ring
            .write_entry(self.producer, &cqe.as_bytes()[..CQE_SIZE])
        {
            return Err(CqFull::Lost);
        }
        self.producer = self.producer.wrapping_add(1);
        self.solicited_pending |= solicited;
        Ok(())
    }

    /// Shows the driver every CQE written so far (`device.index`, release);
    /// returns the CQN if an event is due (the CQ is armed for one of
    /// them).
    pub fn publish(&mut self) -> Option<u32> {
        if self.producer == self.published || self.lost {
            return None;
        }
        self.published = self.producer;
        let solicited = std::mem::take(&mut self.solicited_pending);
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
            return None;
        }
        self.notified_sn = sn;
        self.ring.set_notified_sn(sn);
        Some(self.cqn)
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
    /// Interrupts go through `irq` from now on.
    pub fn set_irq(&mut self, irq: EventFd) {
        self.irq = irq;
    }

    /// An event ring over `ring` interrupting through `irq`.
    pub fn new(ring: GuestRing, irq: EventFd) -> Self {
        ring.reset_device_line();
        EventRing::resume(ring, irq)
    }

    /// An event ring a previous datapath (or vdev, while there was none)
    /// wrote: it continues from the producer index in its header.
    pub fn resume(ring: GuestRing, irq: EventFd) -> Self {
        EventRing {
            producer: ring.device_index().unwrap_or(0),
            ring,
            irq,
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
        Err(full) => failed(cq, eqs, full),
    }
}

/// Writes `cqe` on `cq` for a later [`publish`]; returns whether it was
/// written.
pub fn complete_later(
    cq: &mut Cq,
    eqs: &mut [Option<EventRing>],
    cqe: &Cqe,
    solicited: bool,
) -> bool {
    match cq.write(cqe, solicited) {
        Ok(()) => true,
        Err(full) => failed(cq, eqs, full),
    }
}

/// Shows the driver what `cq` completed, and posts its event if due.
pub fn publish(cq: &mut Cq, eqs: &mut [Option<EventRing>]) {
    cq.publish_queued = false;
    if let Some(cqn) = cq.publish() {
        post_event(eqs, cq.vector, event_kind::COMPLETION, cqn);
    }
}

/// A CQE that `cq` could not take: its CQ_ERROR event the first time it
/// overran. Always false (nothing written).
fn failed(cq: &mut Cq, eqs: &mut [Option<EventRing>], full: CqFull) -> bool {
    match full {
        CqFull::Overrun => {
            if cq.overran() {
                post_event(eqs, cq.vector, event_kind::CQ_ERROR, cq.cqn);
            }
            false
        }
        CqFull::Lost => false,
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
mod tests;
