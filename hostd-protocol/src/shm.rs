//! Shared memory between vdev and hostd: sealed memfds, their mappings, and
//! single-producer single-consumer rings of fixed-size entries.
//!
//! Each side trusts nothing the other writes: indices are bounded before
//! use (a producer index more than `depth` ahead of the consumer is
//! corruption, not work), and entries are copied out once with volatile
//! reads before they are decoded.

use std::fs::File;
use std::io;
use std::marker::PhantomData;
use std::os::fd::{AsRawFd, FromRawFd};
use std::sync::atomic::{fence, AtomicU32, Ordering};

use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout};

use crate::entries::{PhysCqe, PhysWqe};

/// Why shared memory cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum ShmError {
    #[error("Cannot create shared memory")]
    Create(#[source] io::Error),
    #[error("Cannot map shared memory")]
    Map(#[source] io::Error),
    #[error("Shared memory of {actual} bytes is smaller than the {needed} bytes it must hold")]
    TooSmall { needed: u64, actual: u64 },
    #[error("Shared memory is not sealed against shrinking (F_SEAL_SHRINK), so the peer could make accesses fault")]
    NotSealed,
    #[error("Ring indices are corrupt (producer {producer}, consumer {consumer}, depth {depth})")]
    Corrupt {
        producer: u32,
        consumer: u32,
        depth: u32,
    },
}

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

    /// Copies `out.len()` bytes at `offset` out of the mapping; false if the
    /// range is outside it.
    pub fn read(&self, offset: usize, out: &mut [u8]) -> bool {
        let Some(end) = offset.checked_add(out.len()) else {
            return false;
        };
        if end > self.len {
            return false;
        }
        // SAFETY: [offset, end) is inside the mapping, checked above.
        unsafe { volatile_copy(self.ptr.add(offset), out.as_mut_ptr(), out.len()) };
        true
    }

    /// Copies `data` into the mapping at `offset`; false if outside it.
    pub fn write(&self, offset: usize, data: &[u8]) -> bool {
        let Some(end) = offset.checked_add(data.len()) else {
            return false;
        };
        if end > self.len {
            return false;
        }
        // SAFETY: [offset, end) is inside the mapping, checked above.
        unsafe { volatile_copy(data.as_ptr(), self.ptr.add(offset), data.len()) };
        true
    }

    /// Copies `len` bytes at `src_offset` of this mapping to `dst_offset` of
    /// `dst` (possibly this mapping); false if either range is outside its
    /// mapping.
    ///
    /// This is the DMA engine's bulk path, so it is a plain `memmove`, not
    /// the volatile copy used for everything hostd interprets: the payload
    /// is opaque — never decoded, never used for a decision — so a peer
    /// rewriting it mid-copy changes only which bytes arrive, exactly as
    /// with a hardware DMA engine.
    pub fn copy_to(
        &self,
        src_offset: usize,
        dst: &SharedMapping,
        dst_offset: usize,
        len: usize,
    ) -> bool {
        let fits = |offset: usize, mapping: &SharedMapping| {
            offset
                .checked_add(len)
                .is_some_and(|end| end <= mapping.len)
        };
        if !fits(src_offset, self) || !fits(dst_offset, dst) {
            return false;
        }
        // SAFETY: both ranges lie inside live mappings (checked above), and
        // `ptr::copy` allows them to overlap (the same mapping on both sides).
        unsafe { std::ptr::copy(self.ptr.add(src_offset), dst.ptr.add(dst_offset), len) };
        true
    }

    /// The `u32` at `offset` as an atomic.
    fn atomic_u32(&self, offset: usize) -> &AtomicU32 {
        assert!(
            offset.is_multiple_of(4) && offset + 4 <= self.len,
            "ring header inside the mapping"
        );
        // SAFETY: in bounds and 4-aligned (mappings are page-aligned),
        // checked above; shared memory is valid for atomics for as long as
        // `self` keeps it mapped, which bounds the returned lifetime.
        unsafe { &*self.ptr.add(offset).cast::<AtomicU32>() }
    }
}

impl Drop for SharedMapping {
    fn drop(&mut self) {
        // SAFETY: ptr/len are exactly what mmap returned.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

/// Copies `len` bytes with volatile accesses, 8 at a time where aligned, so
/// that the compiler reads shared memory exactly once and never assumes it
/// stays unchanged.
///
/// # Safety
/// `src` must be valid for `len` bytes of reads and `dst` for `len` bytes of
/// writes; the ranges must not overlap.
unsafe fn volatile_copy(src: *const u8, dst: *mut u8, len: usize) {
    let mut i = 0;
    if (src as usize).is_multiple_of(8) && (dst as usize).is_multiple_of(8) {
        while i + 8 <= len {
            // SAFETY: i + 8 <= len and both pointers are 8-aligned here.
            unsafe {
                dst.add(i)
                    .cast::<u64>()
                    .write_volatile(src.add(i).cast::<u64>().read_volatile())
            };
            i += 8;
        }
    }
    while i < len {
        // SAFETY: i < len.
        unsafe { dst.add(i).write_volatile(src.add(i).read_volatile()) };
        i += 1;
    }
}

fn require_shrink_seal(file: &File) -> Result<(), ShmError> {
    // SAFETY: F_GET_SEALS only reads the seals of an open descriptor.
    let seals = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_GET_SEALS) };
    if seals < 0 || seals & libc::F_SEAL_SHRINK == 0 {
        return Err(ShmError::NotSealed);
    }
    Ok(())
}

/// A new memfd of `size` bytes, sealed so that it can never shrink or grow
/// (which makes it safe for a peer to map).
pub fn sealed_memfd(name: &str, size: u64) -> Result<File, ShmError> {
    let cname = std::ffi::CString::new(name).map_err(|e| ShmError::Create(io::Error::other(e)))?;
    // SAFETY: valid NUL-terminated name; the result is checked.
    let fd =
        unsafe { libc::memfd_create(cname.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
    if fd < 0 {
        return Err(ShmError::Create(io::Error::last_os_error()));
    }
    // SAFETY: fd is a fresh descriptor owned by nobody else.
    let file = unsafe { File::from_raw_fd(fd) };
    file.set_len(size).map_err(ShmError::Create)?;
    seal(&file)?;
    Ok(file)
}

/// Seals a memfd against shrinking and growing.
pub fn seal(file: &File) -> Result<(), ShmError> {
    // SAFETY: F_ADD_SEALS on an open descriptor; the result is checked.
    let rc = unsafe {
        libc::fcntl(
            file.as_raw_fd(),
            libc::F_ADD_SEALS,
            libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL,
        )
    };
    if rc != 0 {
        return Err(ShmError::Create(io::Error::last_os_error()));
    }
    Ok(())
}

/// Bytes of a ring header: producer line, consumer line, sleeping line.
pub const RING_HEADER: usize = 192;
const PRODUCER: usize = 0;
const CONSUMER: usize = 64;
const SLEEPING: usize = 128;

/// Where a ring lives in a mapping.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RingPlace {
    pub offset: usize,
    pub depth: u32,
}

impl RingPlace {
    /// Bytes of the ring with entries of type `T`.
    pub fn bytes<T>(&self) -> usize {
        RING_HEADER + self.depth as usize * core::mem::size_of::<T>()
    }
}

/// Layout of one physical QP's shared memory: its submission ring then its
/// completion ring.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QueueLayout {
    pub sq: RingPlace,
    pub cq: RingPlace,
}

impl QueueLayout {
    /// The layout for these depths (powers of two).
    pub fn new(sq_depth: u32, cq_depth: u32) -> Self {
        let sq = RingPlace {
            offset: 0,
            depth: sq_depth,
        };
        let cq_offset = (sq.bytes::<PhysWqe>() + 4095) & !4095;
        QueueLayout {
            sq,
            cq: RingPlace {
                offset: cq_offset,
                depth: cq_depth,
            },
        }
    }

    /// Total bytes.
    pub fn bytes(&self) -> usize {
        self.cq.offset + self.cq.bytes::<PhysCqe>()
    }
}

/// One side of a ring of `T` in a shared mapping.
#[derive(Debug)]
pub struct Ring<'m, T> {
    mem: &'m SharedMapping,
    place: RingPlace,
    _entry: PhantomData<T>,
}

impl<'m, T: FromBytes + IntoBytes + KnownLayout + Immutable> Ring<'m, T> {
    /// The ring at `place` in `mem`; `None` if it does not fit or its depth
    /// is not a power of two.
    pub fn new(mem: &'m SharedMapping, place: RingPlace) -> Option<Self> {
        let fits = place.offset.is_multiple_of(64)
            && place.depth.is_power_of_two()
            && place
                .offset
                .checked_add(place.bytes::<T>())
                .is_some_and(|end| end <= mem.len());
        fits.then_some(Ring {
            mem,
            place,
            _entry: PhantomData,
        })
    }

    fn index(&self, line: usize) -> &AtomicU32 {
        self.mem.atomic_u32(self.place.offset + line)
    }

    fn slot_offset(&self, index: u32) -> usize {
        let slot = (index & (self.place.depth - 1)) as usize;
        self.place.offset + RING_HEADER + slot * core::mem::size_of::<T>()
    }

    fn check(&self, producer: u32, consumer: u32) -> Result<u32, ShmError> {
        let used = producer.wrapping_sub(consumer);
        if used > self.place.depth {
            return Err(ShmError::Corrupt {
                producer,
                consumer,
                depth: self.place.depth,
            });
        }
        Ok(used)
    }

    /// Producer: appends `entry`; `Ok(false)` when the ring is full.
    pub fn push(&self, entry: &T) -> Result<bool, ShmError> {
        let producer = self.index(PRODUCER).load(Ordering::Relaxed);
        let consumer = self.index(CONSUMER).load(Ordering::Acquire);
        if self.check(producer, consumer)? == self.place.depth {
            return Ok(false);
        }
        self.mem.write(self.slot_offset(producer), entry.as_bytes());
        self.index(PRODUCER)
            .store(producer.wrapping_add(1), Ordering::Release);
        Ok(true)
    }

    /// Producer: whether the consumer asked to be woken (it is about to
    /// sleep). Call after `push`; the fence orders the producer-index store
    /// before the flag load, pairing with [`Ring::prepare_sleep`].
    pub fn consumer_sleeping(&self) -> bool {
        fence(Ordering::SeqCst);
        self.index(SLEEPING).load(Ordering::Relaxed) != 0
    }

    /// Consumer: takes the next entry, if any.
    pub fn pop(&self) -> Result<Option<T>, ShmError> {
        let consumer = self.index(CONSUMER).load(Ordering::Relaxed);
        let producer = self.index(PRODUCER).load(Ordering::Acquire);
        if self.check(producer, consumer)? == 0 {
            return Ok(None);
        }
        let mut entry = T::new_zeroed();
        self.mem
            .read(self.slot_offset(consumer), entry.as_mut_bytes());
        self.index(CONSUMER)
            .store(consumer.wrapping_add(1), Ordering::Release);
        Ok(Some(entry))
    }

    /// Consumer: number of entries waiting.
    pub fn pending(&self) -> Result<u32, ShmError> {
        let consumer = self.index(CONSUMER).load(Ordering::Relaxed);
        let producer = self.index(PRODUCER).load(Ordering::Acquire);
        self.check(producer, consumer)
    }

    /// Consumer: announces it is about to sleep (or is awake again). After
    /// announcing sleep, check [`Ring::pending`] once more before sleeping.
    pub fn prepare_sleep(&self, sleeping: bool) {
        self.index(SLEEPING)
            .store(u32::from(sleeping), Ordering::Relaxed);
        fence(Ordering::SeqCst);
    }

    /// Producer: free slots.
    pub fn free(&self) -> Result<u32, ShmError> {
        let producer = self.index(PRODUCER).load(Ordering::Relaxed);
        let consumer = self.index(CONSUMER).load(Ordering::Acquire);
        Ok(self.place.depth - self.check(producer, consumer)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mapping(bytes: usize) -> SharedMapping {
        let file = sealed_memfd("ring-test", bytes as u64).expect("memfd");
        SharedMapping::map(file, 0, bytes as u64).expect("map")
    }

    #[test]
    fn entries_flow_in_order_and_wrap() {
        let layout = QueueLayout::new(4, 8);
        let mem = mapping(layout.bytes());
        let producer: Ring<'_, PhysCqe> = Ring::new(&mem, layout.cq).expect("fits");
        let consumer: Ring<'_, PhysCqe> = Ring::new(&mem, layout.cq).expect("fits");
        for round in 0..5u64 {
            for i in 0..8u64 {
                let cqe = PhysCqe {
                    token: (round * 100 + i).into(),
                    ..PhysCqe::default()
                };
                assert!(producer.push(&cqe).expect("push"));
            }
            assert!(
                !producer.push(&PhysCqe::default()).expect("full"),
                "ring full"
            );
            for i in 0..8u64 {
                assert_eq!(
                    consumer.pop().expect("pop").expect("entry").token.get(),
                    round * 100 + i
                );
            }
            assert_eq!(consumer.pop().expect("pop"), None);
        }
    }

    #[test]
    fn corrupt_indices_are_detected() {
        let layout = QueueLayout::new(4, 8);
        let mem = mapping(layout.bytes());
        let ring: Ring<'_, PhysWqe> = Ring::new(&mem, layout.sq).expect("fits");
        // A hostile producer claims 1000 entries in a ring of 4.
        mem.write(layout.sq.offset + PRODUCER, &1000u32.to_ne_bytes());
        assert!(matches!(ring.pop(), Err(ShmError::Corrupt { .. })));
        assert!(matches!(
            ring.push(&PhysWqe::default()),
            Err(ShmError::Corrupt { .. })
        ));
    }

    #[test]
    fn unsealed_or_short_files_are_refused() {
        let name = std::ffi::CString::new("unsealed").expect("name");
        // SAFETY: valid name; result checked.
        let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
        assert!(fd >= 0);
        // SAFETY: fresh descriptor.
        let file = unsafe { File::from_raw_fd(fd) };
        file.set_len(8192).expect("size");
        assert!(matches!(
            SharedMapping::map(file, 0, 4096),
            Err(ShmError::NotSealed)
        ));
        let sealed = sealed_memfd("short", 4096).expect("memfd");
        assert!(matches!(
            SharedMapping::map(sealed, 0, 8192),
            Err(ShmError::TooSmall { .. })
        ));
        let sealed = sealed_memfd("offset", 4096).expect("memfd");
        assert!(matches!(
            SharedMapping::map(sealed, u64::MAX, 2),
            Err(ShmError::TooSmall { .. })
        ));
    }

    #[test]
    fn rings_must_fit_their_mapping() {
        let mem = mapping(4096);
        assert!(Ring::<PhysWqe>::new(
            &mem,
            RingPlace {
                offset: 0,
                depth: 64
            }
        )
        .is_none());
        assert!(Ring::<PhysCqe>::new(
            &mem,
            RingPlace {
                offset: 0,
                depth: 3
            }
        )
        .is_none());
        assert!(Ring::<PhysCqe>::new(
            &mem,
            RingPlace {
                offset: 8,
                depth: 2
            }
        )
        .is_none());
        assert!(Ring::<PhysCqe>::new(
            &mem,
            RingPlace {
                offset: 0,
                depth: 16
            }
        )
        .is_some());
    }
}
