//! Holding every other thread's writes to a page range while its pages move.
//!
//! `reg_mr` on application memory copies the pages onto a memfd and maps
//! the memfd over them (`user_mem`). A write that another thread of the
//! application makes between the copy and the new mapping would land on
//! the old pages and be lost — silently: malloc's own bookkeeping in a
//! neighbouring chunk is such a writer (a `free` on another thread writes
//! a free-list pointer), and losing it corrupts the heap. A kernel pins
//! pages for `reg_mr` and never moves them, so no RDMA program expects
//! this.
//!
//! The freeze makes the move atomic for the other threads: the range is
//! registered with a userfaultfd in write-protect mode, so a write to it
//! blocks the writing thread in the kernel (reads go on) until the freeze
//! ends, and it then retries against whatever is mapped there — the
//! memfd, once moved. Nothing reads the userfaultfd: ending the freeze
//! lifts the protection (if the old pages are still there) and closing it
//! wakes every blocked thread.
//!
//! While frozen, the freezing thread must not allocate, log or take a lock
//! another thread may hold: that thread may be blocked on the range while
//! holding it (an allocator lock, for one). Nor may it call C library
//! functions a program may hook (UCX patches `mmap`, `mremap`, `madvise`):
//! it makes the system calls itself (`raw_mm`). Its own writes to the range would
//! block it for good, so a range near its stack is not frozen.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use crate::dma::PAGE_SIZE;
use crate::raw_mm;

/// `struct uffdio_api` of `<linux/userfaultfd.h>`.
#[repr(C)]
struct UffdioApi {
    api: u64,
    features: u64,
    ioctls: u64,
}

/// `struct uffdio_range`.
#[repr(C)]
#[derive(Clone, Copy)]
struct UffdioRange {
    start: u64,
    len: u64,
}

/// `struct uffdio_register`.
#[repr(C)]
struct UffdioRegister {
    range: UffdioRange,
    mode: u64,
    ioctls: u64,
}

/// `struct uffdio_writeprotect`.
#[repr(C)]
struct UffdioWriteprotect {
    range: UffdioRange,
    mode: u64,
}

const UFFD_API: u64 = 0xaa;
/// `userfaultfd()` flag: handle faults of user-mode accesses only (allowed
/// without privilege; a kernel write to a frozen page then gets EFAULT).
const UFFD_USER_MODE_ONLY: libc::c_int = 1;
/// Write protection of shared memory (memfds) too (Linux 5.19).
const UFFD_FEATURE_WP_HUGETLBFS_SHMEM: u64 = 1 << 12;
/// Unpopulated anonymous pages are write-protected too (Linux 6.4).
const UFFD_FEATURE_WP_UNPOPULATED: u64 = 1 << 13;
const UFFDIO_REGISTER_MODE_WP: u64 = 1 << 1;
const UFFDIO_WRITEPROTECT_MODE_WP: u64 = 1 << 0;
// _IOWR/_IOR(0xaa, nr, struct ...), as `<linux/userfaultfd.h>` computes them.
const UFFDIO_API: libc::c_ulong = 0xc018_aa3f;
const UFFDIO_REGISTER: libc::c_ulong = 0xc020_aa00;
const UFFDIO_WRITEPROTECT: libc::c_ulong = 0xc018_aa06;
const UFFDIO_WAKE: libc::c_ulong = 0x8010_aa02;

/// How far below the current stack pointer the freezing thread may still
/// write (its deeper calls, the C library's); a range within it or at the
/// current frame is not frozen.
const STACK_MARGIN: u64 = 256 * 1024;

/// Writes to a page range held (by every thread but this one) until
/// dropped.
#[derive(Debug)]
struct WriteFreeze {
    uffd: OwnedFd,
    start: u64,
    len: u64,
}

impl WriteFreeze {
    /// Freezes writes to `[start, start + len)` (page-aligned). Fails when
    /// userfaultfd cannot do it here: not permitted (a seccomp filter, no
    /// privilege for either mode), memory it cannot write-protect (a
    /// shared or file mapping on older kernels), or the range is near this
    /// thread's stack.
    ///
    /// # Safety
    ///
    /// `[start, start + len)` must be mapped memory of this process. Until
    /// the freeze is dropped, the calling thread must not write to the
    /// range, allocate, log, or take a lock another thread may hold while
    /// writing to the range; signals should be blocked (a handler writing
    /// there would block the thread for good).
    unsafe fn new(start: u64, len: u64) -> io::Result<Self> {
        let page = PAGE_SIZE as u64;
        if !start.is_multiple_of(page) || !len.is_multiple_of(page) || len == 0 {
            return Err(io::Error::from_raw_os_error(libc::EINVAL));
        }
        let end = start
            .checked_add(len)
            .ok_or_else(|| io::Error::from_raw_os_error(libc::EINVAL))?;
        let here = 0u8;
        let sp = std::ptr::from_ref(&here) as u64;
        if start < sp.saturating_add(page) && end > sp.saturating_sub(STACK_MARGIN) {
            return Err(io::Error::from_raw_os_error(libc::EDEADLK));
        }
        let (uffd, unpopulated_too) = open()?;
        // Without WP_UNPOPULATED, write protection applies to present pages
        // only: fault them in, as private writable pages, without changing
        // a byte (for a moment, as much memory again as the untouched pages).
        if !unpopulated_too {
            // SAFETY: the caller's mapped range.
            unsafe { raw_mm::populate_write(start as *mut u8, len as usize) }?;
        }
        let range = UffdioRange { start, len };
        let mut register = UffdioRegister {
            range,
            mode: UFFDIO_REGISTER_MODE_WP,
            ioctls: 0,
        };
        ioctl(
            &uffd,
            UFFDIO_REGISTER,
            std::ptr::from_mut(&mut register).cast(),
        )?;
        let freeze = Self { uffd, start, len };
        freeze.write_protect(UFFDIO_WRITEPROTECT_MODE_WP)?;
        Ok(freeze)
    }

    /// Sets (`UFFDIO_WRITEPROTECT_MODE_WP`) or lifts (0) the protection.
    fn write_protect(&self, mode: u64) -> io::Result<()> {
        let mut wp = UffdioWriteprotect {
            range: UffdioRange {
                start: self.start,
                len: self.len,
            },
            mode,
        };
        ioctl(
            &self.uffd,
            UFFDIO_WRITEPROTECT,
            std::ptr::from_mut(&mut wp).cast(),
        )
    }
}

impl Drop for WriteFreeze {
    fn drop(&mut self) {
        // If the old pages are still mapped (the move failed), lift the
        // protection (this wakes their writers); if they were replaced,
        // the range is no longer registered and this fails harmlessly.
        let _ = self.write_protect(0);
        let mut range = UffdioRange {
            start: self.start,
            len: self.len,
        };
        // Wake the writers blocked on pages that were replaced; closing
        // the descriptor (next) wakes any left as well.
        let _ = ioctl(
            &self.uffd,
            UFFDIO_WAKE,
            std::ptr::from_mut(&mut range).cast(),
        );
    }
}

/// A userfaultfd with the API handshake done: full mode where permitted
/// (kernel writes to frozen pages wait too), user-mode-only otherwise.
/// Asks for the newest write-protection features first, then fewer;
/// returns whether it has `UFFD_FEATURE_WP_UNPOPULATED`.
fn open() -> io::Result<(OwnedFd, bool)> {
    const SHMEM: u64 = UFFD_FEATURE_WP_HUGETLBFS_SHMEM;
    let mut last = io::Error::from_raw_os_error(libc::ENOSYS);
    for extra in [0, UFFD_USER_MODE_ONLY] {
        for features in [SHMEM | UFFD_FEATURE_WP_UNPOPULATED, SHMEM, 0] {
            match open_with(extra, features) {
                Ok(uffd) => return Ok((uffd, features & UFFD_FEATURE_WP_UNPOPULATED != 0)),
                Err(e) => last = e,
            }
        }
    }
    Err(last)
}

fn open_with(flags: libc::c_int, features: u64) -> io::Result<OwnedFd> {
    // SAFETY: userfaultfd takes flags only.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_userfaultfd,
            libc::O_CLOEXEC | libc::O_NONBLOCK | flags,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    let fd = libc::c_int::try_from(fd).map_err(|_| io::Error::from_raw_os_error(libc::EBADF))?;
    // SAFETY: a new descriptor this function owns.
    let uffd = unsafe { OwnedFd::from_raw_fd(fd) };
    let mut api = UffdioApi {
        api: UFFD_API,
        features,
        ioctls: 0,
    };
    ioctl(&uffd, UFFDIO_API, std::ptr::from_mut(&mut api).cast())?;
    Ok(uffd)
}

fn ioctl(fd: &OwnedFd, request: libc::c_ulong, arg: *mut libc::c_void) -> io::Result<()> {
    // SAFETY: every caller passes the userfaultfd request's own structure,
    // alive for the call.
    if unsafe { libc::ioctl(fd.as_raw_fd(), request, arg) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Replaces the pages of `[start, start + len)` by `with`, a mapping of
/// `len` bytes made for the purpose: copies the range's contents into it
/// and moves it over the range, holding the other threads' writes to the
/// range from the copy until the move is done. Returns why the writes
/// could not be held, if they could not (the move is made all the same).
///
/// # Safety
///
/// `[start, start + len)` (page-aligned) must be mapped, readable memory of
/// this process that may be replaced by `with` with the same contents;
/// `with` must be a distinct mapping of `len` bytes, which this call
/// consumes (moved over the range, or unmapped when it fails).
pub(crate) unsafe fn replace_pages(
    start: u64,
    len: u64,
    with: *mut u8,
) -> io::Result<Option<io::Error>> {
    let size = len as usize;
    // From the copy until the move, nothing here allocates, logs or takes a
    // lock: a thread held on the range may hold any of those.
    let signals = SignalsBlocked::new();
    // SAFETY: the range is mapped (caller's contract); this thread only
    // reads it, and makes system calls, until the freeze is dropped.
    let freeze = unsafe { WriteFreeze::new(start, len) };
    // SAFETY: the range is readable and `with` is a distinct `len`-byte
    // mapping (caller's contract): they do not overlap.
    unsafe { std::ptr::copy_nonoverlapping(start as *const u8, with, size) };
    // SAFETY: moves the caller's mapping over the caller's range, which
    // their contract lets this call replace (the system call itself: see
    // the module documentation).
    let moved = unsafe { raw_mm::move_over(with, size, start) };
    // Ends the freeze: the held writers retry, on the new pages.
    let unfrozen = freeze.err();
    drop(signals);
    if let Err(e) = moved {
        // SAFETY: `with` was not moved: unmapping the caller's mapping.
        unsafe { raw_mm::unmap(with, size) };
        return Err(e);
    }
    Ok(unfrozen)
}

/// Blocks every signal on this thread until dropped (a handler must not
/// run, and perhaps write to a frozen range, on the freezing thread).
struct SignalsBlocked {
    old: libc::sigset_t,
}

impl SignalsBlocked {
    fn new() -> Self {
        // SAFETY: sigset_t is plain data; sigfillset and pthread_sigmask
        // write only to the sets passed.
        unsafe {
            let mut all: libc::sigset_t = std::mem::zeroed();
            let mut old: libc::sigset_t = std::mem::zeroed();
            libc::sigfillset(&mut all);
            libc::pthread_sigmask(libc::SIG_BLOCK, &all, &mut old);
            Self { old }
        }
    }
}

impl Drop for SignalsBlocked {
    fn drop(&mut self) {
        // SAFETY: restores the mask saved by `new`.
        unsafe { libc::pthread_sigmask(libc::SIG_SETMASK, &self.old, std::ptr::null_mut()) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::Arc;
    use std::time::Duration;

    fn anon(pages: usize) -> u64 {
        crate::raw_mm::map_anonymous(pages * PAGE_SIZE).expect("an anonymous mapping") as u64
    }

    /// A shared mapping of a memfd, as a registered range is.
    fn memfd_pages(pages: usize) -> u64 {
        let file = crate::dma::sealed_memfd(c"freeze-test", pages * PAGE_SIZE).unwrap();
        let p = crate::dma::map_shared(std::os::fd::AsFd::as_fd(&file), pages * PAGE_SIZE).unwrap();
        p as u64
    }

    /// A writer blocks while frozen, reads go on, and the write lands
    /// once the freeze ends: on private memory (a move onto a memfd) and
    /// on a memfd's (a move back).
    #[test]
    fn a_write_waits_for_the_end_of_the_freeze() {
        a_write_waits_on(anon(2));
        a_write_waits_on(memfd_pages(2));
    }

    fn a_write_waits_on(p: u64) {
        let page = PAGE_SIZE as u64;
        // SAFETY: the test's own mapping; this thread does not write to it.
        let freeze = match unsafe { WriteFreeze::new(p, 2 * page) } {
            Ok(f) => f,
            Err(e) => panic!("userfaultfd write protection is unavailable here: {e}"),
        };
        let done = Arc::new(AtomicU64::new(0));
        let d = Arc::clone(&done);
        let writer = std::thread::spawn(move || {
            // SAFETY: inside the mapping.
            unsafe { ((p + page + 8) as *mut u64).write_volatile(7) };
            d.store(1, Ordering::SeqCst);
        });
        std::thread::sleep(Duration::from_millis(100));
        assert_eq!(
            done.load(Ordering::SeqCst),
            0,
            "the write went through a freeze"
        );
        // SAFETY: reading is allowed while frozen.
        assert_eq!(unsafe { ((p + page + 8) as *const u64).read_volatile() }, 0);
        drop(freeze);
        writer.join().unwrap();
        assert_eq!(done.load(Ordering::SeqCst), 1);
        // SAFETY: inside the mapping.
        assert_eq!(unsafe { ((p + page + 8) as *const u64).read_volatile() }, 7);
    }

    #[test]
    fn misaligned_and_stack_ranges_are_not_frozen() {
        let p = anon(1);
        // SAFETY: the test's own mapping.
        let e = unsafe { WriteFreeze::new(p + 8, PAGE_SIZE as u64) }.unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EINVAL));
        let here = 0u8;
        let sp = std::ptr::from_ref(&here) as u64 & !(PAGE_SIZE as u64 - 1);
        // SAFETY: refused before anything is touched.
        let e = unsafe { WriteFreeze::new(sp, PAGE_SIZE as u64) }.unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EDEADLK));
    }
}
