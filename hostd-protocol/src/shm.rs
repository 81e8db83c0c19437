//! Shared memory: sealed memfds and their mappings. hostd maps every
//! guest memory slot a vdev passes it this way, and reads and writes the
//! guest's rings through these mappings.
//!
//! Nothing in shared memory is trusted: the peer may change it at any
//! moment. So everything hostd interprets is read once, with volatile
//! accesses or atomics, into its own copy, and only the copy is decoded;
//! and a mapping is only made of a file sealed against shrinking, so no
//! access through it can fault whatever the peer does later.

use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd};
use std::sync::atomic::{AtomicU32, AtomicU64};

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

    /// The address of `[offset, offset + len)` if it lies inside the
    /// mapping.
    fn range(&self, offset: usize, len: usize) -> Option<*mut u8> {
        let end = offset.checked_add(len)?;
        // SAFETY: offset <= end <= self.len: inside the mapping.
        (end <= self.len).then(|| unsafe { self.ptr.add(offset) })
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

fn require_shrink_seal(file: &File) -> Result<(), ShmError> {
    // SAFETY: F_GET_SEALS only reads the seals of an open descriptor.
    let seals = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_GET_SEALS) };
    if seals < 0 || seals & libc::F_SEAL_SHRINK == 0 {
        return Err(ShmError::NotSealed);
    }
    Ok(())
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::Ordering;

    fn mapping(bytes: usize) -> SharedMapping {
        let file = sealed_memfd("shm-test", bytes as u64).expect("memfd");
        SharedMapping::map(file, 0, bytes as u64).expect("map")
    }

    #[test]
    fn reads_writes_and_copies_stay_inside_the_mapping() {
        let mem = mapping(4096);
        assert!(mem.write(4090, b"abcdef"));
        assert!(!mem.write(4091, b"abcdef"), "one byte past the end");
        assert!(!mem.write(usize::MAX, b"a"), "offset overflow");
        let mut out = [0u8; 6];
        assert!(mem.read(4090, &mut out));
        assert_eq!(&out, b"abcdef");
        assert!(!mem.read(4091, &mut out));
        let other = mapping(8192);
        assert!(mem.copy_to(4090, &other, 8186, 6));
        assert!(!mem.copy_to(4090, &other, 8187, 6));
        assert!(other.read(8186, &mut out));
        assert_eq!(&out, b"abcdef");
    }

    /// Every length around the vector path's thresholds, at mutually
    /// misaligned offsets, and overlapping ranges both ways, copy exactly
    /// their bytes.
    #[test]
    fn dma_copies_are_exact_at_any_alignment_and_overlap() {
        let pattern: Vec<u8> = (0..70_000u32).map(|i| (i * 7 + i / 251) as u8).collect();
        for len in [0, 1, 127, 1023, 1024, 1025, 1151, 4096, 65_536, 65_537] {
            for (from, to) in [(0, 0), (8, 0), (1, 63), (64, 3)] {
                let mut dst = vec![0xeeu8; len + 128];
                // SAFETY: both ranges are inside their vectors.
                unsafe { dma_copy(pattern[from..].as_ptr(), dst[to..].as_mut_ptr(), len) };
                assert_eq!(
                    &dst[to..to + len],
                    &pattern[from..from + len],
                    "{len} {from}->{to}"
                );
                assert!(dst[..to].iter().all(|&b| b == 0xee), "before {len}");
                assert!(dst[to + len..].iter().all(|&b| b == 0xee), "after {len}");
            }
        }
        for shift in [-4096isize, -1, 1, 4096] {
            let mut buf = pattern[..20_000].to_vec();
            let (from, to) = if shift > 0 {
                (0, shift as usize)
            } else {
                (-shift as usize, 0)
            };
            let len = 12_000;
            let want = pattern[from..from + len].to_vec();
            // SAFETY: both ranges are inside `buf`; they overlap, which
            // `dma_copy` allows.
            unsafe { dma_copy(buf.as_ptr().add(from), buf.as_mut_ptr().add(to), len) };
            assert_eq!(&buf[to..to + len], &want[..], "shift {shift}");
        }
    }

    #[test]
    fn atomics_must_be_aligned_and_inside() {
        let mem = mapping(4096);
        let word = mem.atomic_u32(4092).expect("last word");
        word.store(7, Ordering::Release);
        assert_eq!(
            mem.atomic_u32(4092).map(|w| w.load(Ordering::Acquire)),
            Some(7)
        );
        assert!(mem.atomic_u32(4094).is_none(), "misaligned");
        assert!(mem.atomic_u32(4096).is_none(), "outside");
        assert!(mem.atomic_u64(4088).is_some());
        assert!(mem.atomic_u64(4092).is_none(), "misaligned");
        assert!(mem.atomic_u64(usize::MAX - 3).is_none());
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
}
