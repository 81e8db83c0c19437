//! DMA memory: memfd-backed arenas the device can reach, and an allocator.
//!
//! In process ("virtio-user") mode the driver's "guest memory" is whatever it
//! shares with vdev over vhost-user: each [`DmaArena`] is one memfd, mapped
//! `MAP_SHARED` into this process and handed to vdev as one memory region with
//! `guest_phys_addr == userspace_addr == ` the mapping's address. Rings,
//! virtqueues, control buffers and driver-allocated MR buffers all come from
//! arenas, so the device sees them without copies.
//!
//! The device address of a byte is kept apart from its virtual address
//! ([`DmaBuf::device_addr`]): equal in process mode, but in VM mode the
//! device sees guest-physical addresses. There an arena is made of 2 MiB
//! hugepages ([`DmaArena::hugepages`]): each hugepage is physically
//! contiguous and never swapped or moved, and an arena of several is only
//! accepted when they are physically adjacent, so every allocation (a ring,
//! a virtqueue) is one contiguous range of device addresses.
//!
//! The allocator is a first-fit free list with coalescing. Allocations are few
//! and long-lived (rings, MRs), so simplicity beats speed here.

use std::collections::BTreeMap;
use std::ffi::CStr;
use std::fs::File;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd};
use std::sync::atomic::{AtomicU16, AtomicU32, AtomicU64};
use std::sync::{Arc, Mutex, MutexGuard};

use vm_memory::VolatileSlice;

use crate::pagemap::{Pagemap, PagemapError};

/// Page size the arenas and user regions are built from.
pub const PAGE_SIZE: usize = 4096;
/// Size of the hugepages VM-mode arenas are made of.
pub const HUGE_PAGE_SIZE: usize = 2 << 20;
/// `MAP_HUGE_2MB`: log2(2 MiB) in the mmap flags' hugepage-size field.
const MAP_HUGE_2MB: libc::c_int = 21 << libc::MAP_HUGE_SHIFT;
const NR_HUGEPAGES: &str = "/proc/sys/vm/nr_hugepages";
/// Times an arena raises the hugepage pool and maps again before failing.
const HUGEPAGE_ATTEMPTS: u32 = 8;
/// Default size of an arena.
pub const DEFAULT_ARENA_SIZE: usize = 16 << 20;
/// Smallest allocation unit: a cache line, so two allocations never share one.
const MIN_ALLOC: usize = 64;

/// Errors of DMA memory.
#[derive(Debug, thiserror::Error)]
pub enum DmaError {
    #[error("Cannot create a memfd")]
    Memfd(#[source] io::Error),
    #[error("Cannot size a memfd to {size} bytes")]
    Truncate {
        size: usize,
        #[source]
        source: io::Error,
    },
    #[error("Cannot map {size} bytes of DMA memory")]
    Map {
        size: usize,
        #[source]
        source: io::Error,
    },
    #[error("Arena size {0} is zero or not a multiple of the page size")]
    BadSize(usize),
    #[error("No room for {len} bytes aligned to {align}")]
    OutOfMemory { len: usize, align: usize },
    #[error("Alignment {0} is not a power of two")]
    BadAlign(usize),
    #[error(
        "Cannot map {size} bytes of 2 MiB hugepages: reserve more with \
         `echo N > {NR_HUGEPAGES}` (the driver tried to raise it itself)"
    )]
    Hugepages {
        size: usize,
        #[source]
        source: io::Error,
    },
    #[error("Cannot learn the physical address of DMA memory")]
    Pagemap(#[source] PagemapError),
    #[error(
        "The {pages} hugepages of a {size}-byte arena are not physically adjacent; \
         allocations that large need contiguous memory (reserve hugepages early)"
    )]
    NotContiguous { size: usize, pages: usize },
}

/// The memory of a region the device is told about (transport-neutral form
/// of a vhost-user memory region).
#[derive(Debug, Clone, Copy)]
pub struct DmaRegion<'a> {
    /// File backing the region, mapped from offset 0.
    pub fd: BorrowedFd<'a>,
    /// Bytes in the region.
    pub size: u64,
    /// Address of the region in this process.
    pub host_addr: u64,
    /// Address of the region as the device sees it.
    pub device_addr: u64,
}

/// Maps `size` bytes of `fd` from offset 0, shared and read-write, at an
/// address the kernel picks. The caller unmaps it.
pub(crate) fn map_shared(fd: BorrowedFd<'_>, size: usize) -> io::Result<*mut u8> {
    // SAFETY: a fresh mapping at a kernel-chosen address: no existing
    // memory is affected; the kernel checks the descriptor and the size.
    let ptr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            size,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            fd.as_raw_fd(),
            0,
        )
    };
    if ptr == libc::MAP_FAILED {
        return Err(io::Error::last_os_error());
    }
    Ok(ptr.cast())
}

/// Creates a sealed-size memfd of `size` bytes.
///
/// Sealing against shrinking matters: a memfd is shared with vdev, and a
/// peer that truncated it would make our accesses fault with SIGBUS.
pub(crate) fn sealed_memfd(name: &CStr, size: usize) -> Result<File, DmaError> {
    // SAFETY: `name` is a valid NUL-terminated string; the flags are valid.
    let fd =
        unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
    if fd < 0 {
        return Err(DmaError::Memfd(io::Error::last_os_error()));
    }
    // SAFETY: `fd` was just returned by memfd_create and is owned by nobody else.
    let file = unsafe { File::from_raw_fd(fd) };
    file.set_len(size as u64)
        .map_err(|source| DmaError::Truncate { size, source })?;
    let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
    // SAFETY: fcntl on an fd we own with a valid command and argument.
    if unsafe { libc::fcntl(file.as_raw_fd(), libc::F_ADD_SEALS, seals) } < 0 {
        // Not fatal: sealing is a defence, not a requirement for correctness.
        tracing::warn!(error = %io::Error::last_os_error(), "Cannot seal a DMA memfd");
    }
    Ok(file)
}

/// One `MAP_SHARED` mapping that the device can reach: a memfd shared
/// with vdev (process mode) or hugepages at known physical addresses (VM
/// mode).
#[derive(Debug)]
pub struct DmaArena {
    /// The memfd in process mode; none for hugepages (the device reaches
    /// them by physical address, nothing is handed over).
    file: Option<File>,
    /// Address of the mapping; kept as an integer so the arena is Send + Sync
    /// (all accesses go through [`DmaBuf`]'s volatile/atomic helpers).
    base: usize,
    size: usize,
    device_base: u64,
    free: Mutex<FreeList>,
}

impl DmaArena {
    /// Creates and maps an arena of `size` bytes (a multiple of the page size).
    /// The device address equals the virtual address (process mode).
    pub fn new(size: usize) -> Result<Arc<Self>, DmaError> {
        if size == 0 || size & (PAGE_SIZE - 1) != 0 {
            return Err(DmaError::BadSize(size));
        }
        let file = sealed_memfd(c"vrdma-dma", size)?;
        let base = map_shared(file.as_fd(), size)
            .map_err(|source| DmaError::Map { size, source })? as usize;
        tracing::debug!(base = format_args!("{base:#x}"), size, "Mapped DMA arena");
        Ok(Arc::new(Self {
            file: Some(file),
            base,
            size,
            device_base: base as u64,
            free: Mutex::new(FreeList::new(size)),
        }))
    }

    /// Creates an arena of 2 MiB hugepages (`size` rounded up to whole
    /// hugepages) whose device addresses are its physical addresses, read
    /// from `pagemap`. When too few hugepages are free the pool is raised
    /// through `/proc/sys/vm/nr_hugepages` (root only) before giving up.
    pub fn hugepages(size: usize, pagemap: &Pagemap) -> Result<Arc<Self>, DmaError> {
        let size = size
            .max(1)
            .checked_next_multiple_of(HUGE_PAGE_SIZE)
            .ok_or(DmaError::BadSize(size))?;
        let pages = size / HUGE_PAGE_SIZE;
        // Processes opening devices at once race for the pool: one's
        // reservation may be taken by another's mapping (or two raise it
        // to the same count), so raising and mapping are retried a few
        // times before giving up.
        let mut attempt = 0;
        let base = loop {
            match map_hugepages(size) {
                Ok(base) => break base,
                Err(source) if attempt == HUGEPAGE_ATTEMPTS => {
                    return Err(DmaError::Hugepages { size, source })
                }
                Err(_) => {
                    attempt += 1;
                    if let Err(e) = reserve_hugepages(pages) {
                        tracing::warn!(error = %e, pages, "Cannot reserve hugepages");
                    }
                }
            }
        };
        // From here on the mapping is owned by `arena` and unmapped on drop.
        let mut arena = Self {
            file: None,
            base,
            size,
            device_base: 0,
            free: Mutex::new(FreeList::new(size)),
        };
        for i in 0..pages {
            // Fault every hugepage in for writing now: a page must be
            // present, and stay the same page, before it is translated.
            // SAFETY: inside the fresh mapping, which nothing else uses yet.
            unsafe { ((base + i * HUGE_PAGE_SIZE) as *mut u8).write_volatile(0) };
        }
        let first = pagemap.phys_addr(base as u64).map_err(DmaError::Pagemap)?;
        for i in 1..pages {
            let pa = pagemap
                .phys_addr((base + i * HUGE_PAGE_SIZE) as u64)
                .map_err(DmaError::Pagemap)?;
            if pa != first + (i * HUGE_PAGE_SIZE) as u64 {
                return Err(DmaError::NotContiguous { size, pages });
            }
        }
        arena.device_base = first;
        tracing::debug!(
            base = format_args!("{base:#x}"),
            phys = format_args!("{first:#x}"),
            size,
            "Mapped hugepage DMA arena"
        );
        Ok(Arc::new(arena))
    }

    /// Bytes in the arena.
    pub fn size(&self) -> usize {
        self.size
    }

    /// Virtual address of the arena's first byte.
    pub fn host_addr(&self) -> u64 {
        self.base as u64
    }

    /// Device address of the arena's first byte.
    pub fn device_addr(&self) -> u64 {
        self.device_base
    }

    /// The memfd backing the arena (process mode only).
    pub fn file(&self) -> Option<&File> {
        self.file.as_ref()
    }

    /// The arena as a region to announce to the device; none for a
    /// hugepage arena, which the device reaches without being told.
    pub fn region(&self) -> Option<DmaRegion<'_>> {
        self.file.as_ref().map(|file| DmaRegion {
            fd: file.as_fd(),
            size: self.size as u64,
            host_addr: self.base as u64,
            device_addr: self.device_base,
        })
    }

    /// Whether `[addr, addr + len)` (virtual addresses) lies inside the arena.
    pub fn contains(&self, addr: u64, len: u64) -> bool {
        let start = self.base as u64;
        addr >= start
            && addr
                .checked_add(len)
                .is_some_and(|end| end <= start + self.size as u64)
    }

    /// Allocates `len` bytes aligned to `align` (a power of two). The bytes
    /// are not zeroed; see [`DmaArena::alloc_zeroed`].
    pub fn alloc(self: &Arc<Self>, len: usize, align: usize) -> Result<DmaBuf, DmaError> {
        if !align.is_power_of_two() {
            return Err(DmaError::BadAlign(align));
        }
        let rounded = len
            .max(1)
            .checked_next_multiple_of(MIN_ALLOC)
            .ok_or(DmaError::OutOfMemory { len, align })?;
        let offset = self
            .free_list()
            .alloc(rounded, align.max(MIN_ALLOC))
            .ok_or(DmaError::OutOfMemory { len, align })?;
        Ok(DmaBuf {
            arena: Arc::clone(self),
            offset,
            len,
            reserved: rounded,
        })
    }

    /// Like [`DmaArena::alloc`], with the bytes zeroed.
    pub fn alloc_zeroed(self: &Arc<Self>, len: usize, align: usize) -> Result<DmaBuf, DmaError> {
        let buf = self.alloc(len, align)?;
        buf.zero();
        Ok(buf)
    }

    /// Bytes currently free (for tests and diagnostics).
    pub fn free_bytes(&self) -> usize {
        self.free_list().free.values().sum()
    }

    fn free_list(&self) -> MutexGuard<'_, FreeList> {
        // The list is always consistent between calls: recover from poisoning.
        self.free.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Drop for DmaArena {
    fn drop(&mut self) {
        // SAFETY: `base`/`size` are the mapping made in `new`; every DmaBuf
        // holds an Arc to the arena, so none can outlive this.
        if unsafe { libc::munmap(self.base as *mut libc::c_void, self.size) } != 0 {
            tracing::warn!(error = %io::Error::last_os_error(), "Cannot unmap a DMA arena");
        }
    }
}

/// Maps `size` bytes of shared anonymous 2 MiB hugepages. Shared, so that a
/// `fork` of the application never turns them copy-on-write (which would
/// move the parent's pages away from the addresses the device knows).
fn map_hugepages(size: usize) -> io::Result<usize> {
    // SAFETY: a fresh mapping at an address the kernel picks.
    let ptr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            size,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED | libc::MAP_ANONYMOUS | libc::MAP_HUGETLB | MAP_HUGE_2MB,
            -1,
            0,
        )
    };
    if ptr == libc::MAP_FAILED {
        return Err(io::Error::last_os_error());
    }
    Ok(ptr as usize)
}

/// 2 MiB hugepages free for a new mapping, from /proc/meminfo (the default
/// hugepage size is 2 MiB on x86-64): free and not reserved by another
/// process's mapping that has not touched them yet.
fn free_hugepages() -> io::Result<usize> {
    let meminfo = std::fs::read_to_string("/proc/meminfo")?;
    let field = |name: &str| -> io::Result<usize> {
        meminfo
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.trim().parse().ok())
            .ok_or_else(|| {
                io::Error::new(io::ErrorKind::InvalidData, format!("no {name} in meminfo"))
            })
    };
    Ok(field("HugePages_Free:")?.saturating_sub(field("HugePages_Rsvd:")?))
}

/// Raises the hugepage pool so that `pages` more are free.
fn reserve_hugepages(pages: usize) -> io::Result<()> {
    let free = free_hugepages()?;
    if free >= pages {
        return Ok(());
    }
    let current: usize = std::fs::read_to_string(NR_HUGEPAGES)?
        .trim()
        .parse()
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
    let wanted = current + (pages - free);
    tracing::info!(current, wanted, "Raising the hugepage pool");
    std::fs::write(NR_HUGEPAGES, wanted.to_string())
}

/// First-fit free list of `offset -> length` ranges, coalesced on free.
#[derive(Debug)]
struct FreeList {
    free: BTreeMap<usize, usize>,
}

impl FreeList {
    fn new(size: usize) -> Self {
        Self {
            free: BTreeMap::from([(0, size)]),
        }
    }

    fn alloc(&mut self, len: usize, align: usize) -> Option<usize> {
        let (start, flen, at) = self.free.iter().find_map(|(&start, &flen)| {
            let at = start.checked_next_multiple_of(align)?;
            (at.checked_add(len)? <= start + flen).then_some((start, flen, at))
        })?;
        self.free.remove(&start);
        if at > start {
            self.free.insert(start, at - start);
        }
        let end = at + len;
        if end < start + flen {
            self.free.insert(end, start + flen - end);
        }
        Some(at)
    }

    fn release(&mut self, offset: usize, len: usize) {
        let (mut start, mut end) = (offset, offset + len);
        if let Some((&prev, &plen)) = self.free.range(..offset).next_back() {
            if prev + plen == offset {
                self.free.remove(&prev);
                start = prev;
            }
        }
        if let Some(&nlen) = self.free.get(&end) {
            self.free.remove(&end);
            end += nlen;
        }
        self.free.insert(start, end - start);
    }
}

/// An allocation in a [`DmaArena`]; freed on drop.
///
/// The device may read or write these bytes at any time, so they are only
/// reached through volatile copies and atomics, never through references.
#[derive(Debug)]
pub struct DmaBuf {
    arena: Arc<DmaArena>,
    offset: usize,
    len: usize,
    reserved: usize,
}

impl DmaBuf {
    /// Bytes requested.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Pointer to the first byte in this process.
    pub fn as_ptr(&self) -> *mut u8 {
        (self.arena.base + self.offset) as *mut u8
    }

    /// Device address of the first byte.
    pub fn device_addr(&self) -> u64 {
        self.arena.device_base + self.offset as u64
    }

    /// The arena this buffer is in.
    pub fn arena(&self) -> &Arc<DmaArena> {
        &self.arena
    }

    /// The buffer as a volatile slice.
    pub fn volatile_slice(&self) -> VolatileSlice<'_> {
        // SAFETY: the range is inside the arena's mapping, which lives as long
        // as `self` (we hold an Arc to the arena) and is never unmapped before.
        unsafe { VolatileSlice::new(self.as_ptr(), self.len) }
    }

    /// Copies `data` to `offset`. Panics if it does not fit (a driver bug).
    pub fn write_at(&self, offset: usize, data: &[u8]) {
        let slice = self.subslice(offset, data.len());
        slice.copy_from(data);
    }

    /// Copies bytes at `offset` into `out`. Panics if out of bounds.
    pub fn read_at(&self, offset: usize, out: &mut [u8]) {
        let slice = self.subslice(offset, out.len());
        slice.copy_to(out);
    }

    /// Zeroes the buffer.
    pub fn zero(&self) {
        // SAFETY: the range is inside the arena's mapping, which outlives
        // `self`; the bytes are plain memory with no Rust references to them.
        unsafe { std::ptr::write_bytes(self.as_ptr(), 0, self.len) };
    }

    fn subslice(&self, offset: usize, len: usize) -> VolatileSlice<'_> {
        match self.volatile_slice().subslice(offset, len) {
            Ok(slice) => slice,
            Err(e) => panic!("DMA access out of bounds: {e}"),
        }
    }

    /// The `u32` at `offset` (4-byte aligned) as an atomic shared with the device.
    pub(crate) fn atomic_u32(&self, offset: usize) -> &AtomicU32 {
        assert!(
            offset & 3 == 0 && offset + 4 <= self.len,
            "bad atomic offset"
        );
        // SAFETY: in bounds and aligned (allocations are at least 64-byte
        // aligned); the memory lives as long as `self`; AtomicU32 has the
        // layout of u32 and atomics are the right way to share it with the
        // device.
        unsafe { &*(self.as_ptr().add(offset) as *const AtomicU32) }
    }

    /// The `u64` at `offset` (8-byte aligned) as an atomic shared with the device.
    pub(crate) fn atomic_u64(&self, offset: usize) -> &AtomicU64 {
        assert!(
            offset & 7 == 0 && offset + 8 <= self.len,
            "bad atomic offset"
        );
        // SAFETY: as in `atomic_u32`, for an 8-byte aligned u64 (allocations
        // are at least 64-byte aligned).
        unsafe { &*(self.as_ptr().add(offset) as *const AtomicU64) }
    }

    /// The `u16` at `offset` (2-byte aligned) as an atomic shared with the device.
    pub(crate) fn atomic_u16(&self, offset: usize) -> &AtomicU16 {
        assert!(
            offset & 1 == 0 && offset + 2 <= self.len,
            "bad atomic offset"
        );
        // SAFETY: as in `atomic_u32`, for a 2-byte aligned u16.
        unsafe { &*(self.as_ptr().add(offset) as *const AtomicU16) }
    }
}

impl Drop for DmaBuf {
    fn drop(&mut self) {
        self.arena.free_list().release(self.offset, self.reserved);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocations_are_aligned_disjoint_and_freed() {
        let arena = DmaArena::new(64 * 1024).unwrap();
        assert_eq!(arena.free_bytes(), 64 * 1024);
        let a = arena.alloc(100, 64).unwrap();
        let b = arena.alloc(10, 4096).unwrap();
        let c = arena.alloc(5000, 8).unwrap();
        assert_eq!(b.device_addr() % 4096, 0);
        assert_eq!(a.device_addr() % 64, 0);
        assert_eq!(
            a.device_addr(),
            a.as_ptr() as u64,
            "process mode: dev == va"
        );
        let ranges = [
            (a.device_addr(), 128u64),
            (b.device_addr(), 64),
            (c.device_addr(), 5056),
        ];
        for (i, x) in ranges.iter().enumerate() {
            for y in &ranges[i + 1..] {
                assert!(x.0 + x.1 <= y.0 || y.0 + y.1 <= x.0, "{x:?} overlaps {y:?}");
            }
        }
        drop((a, b, c));
        assert_eq!(arena.free_bytes(), 64 * 1024);
        // Coalesced back into one range: the whole arena fits again.
        let all = arena.alloc(64 * 1024, 4096).unwrap();
        assert_eq!(all.device_addr(), arena.device_addr());
    }

    #[test]
    fn out_of_memory_and_bad_arguments() {
        let arena = DmaArena::new(8192).unwrap();
        let _a = arena.alloc(4096, 4096).unwrap();
        assert!(matches!(
            arena.alloc(8192, 64),
            Err(DmaError::OutOfMemory { len: 8192, .. })
        ));
        assert!(matches!(arena.alloc(8, 3), Err(DmaError::BadAlign(3))));
        assert!(matches!(DmaArena::new(100), Err(DmaError::BadSize(100))));
    }

    #[test]
    fn reads_writes_and_zeroing_go_through_the_shared_file() {
        use std::io::Read;
        use std::os::unix::fs::FileExt;
        let arena = DmaArena::new(4096).unwrap();
        let buf = arena.alloc(32, 64).unwrap();
        buf.write_at(4, b"vrdma");
        let mut out = [0u8; 5];
        buf.read_at(4, &mut out);
        assert_eq!(&out, b"vrdma");
        // The device sees the bytes through the memfd.
        let mut file_bytes = [0u8; 5];
        let off = buf.device_addr() - arena.device_addr() + 4;
        let file = arena.file().expect("a memfd arena");
        file.read_exact_at(&mut file_bytes, off).unwrap();
        assert_eq!(&file_bytes, b"vrdma");
        buf.zero();
        buf.read_at(4, &mut out);
        assert_eq!(out, [0; 5]);
        let mut f = file.try_clone().unwrap();
        let mut whole = Vec::new();
        f.read_to_end(&mut whole).unwrap();
        assert_eq!(whole.len(), 4096);
        buf.atomic_u32(8)
            .store(0x1234_5678, std::sync::atomic::Ordering::Release);
        buf.read_at(8, &mut out[..4]);
        assert_eq!(&out[..4], &0x1234_5678u32.to_ne_bytes());
    }

    /// Sets `/proc/sys/vm/nr_hugepages` back to what it was when dropped.
    struct RestoreHugepages(Option<String>);

    impl Drop for RestoreHugepages {
        fn drop(&mut self) {
            if let Some(v) = &self.0 {
                let _ = std::fs::write(NR_HUGEPAGES, v);
            }
        }
    }

    #[test]
    fn hugepage_arenas_are_physically_contiguous_and_translated() {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            eprintln!("skipped: hugepage reservation and pagemap need root");
            return;
        }
        let _restore = RestoreHugepages(std::fs::read_to_string(NR_HUGEPAGES).ok());
        let pagemap = Pagemap::open().expect("pagemap");
        let arena = DmaArena::hugepages(1, &pagemap).expect("one hugepage");
        assert_eq!(arena.size(), HUGE_PAGE_SIZE);
        assert!(arena.region().is_none(), "nothing to announce");
        assert!(arena.file().is_none());
        assert_eq!(arena.device_addr() % HUGE_PAGE_SIZE as u64, 0);
        assert_ne!(arena.device_addr(), arena.host_addr());
        let buf = arena.alloc_zeroed(3 * PAGE_SIZE, PAGE_SIZE).unwrap();
        buf.write_at(PAGE_SIZE + 5, b"phys");
        // Every page of the allocation is where its device address says.
        for page in 0..3 {
            let va = buf.as_ptr() as u64 + (page * PAGE_SIZE) as u64;
            assert_eq!(
                pagemap.phys_addr(va).expect("present"),
                buf.device_addr() + (page * PAGE_SIZE) as u64
            );
        }
        let mut out = [0u8; 4];
        buf.read_at(PAGE_SIZE + 5, &mut out);
        assert_eq!(&out, b"phys");
    }
}
