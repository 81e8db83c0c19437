//! The memory-mapping system calls, made directly.
//!
//! Programs hook the C library's `mmap`, `munmap`, `mremap` and `madvise`
//! (UCX's memory hooks patch them to invalidate its caches); a hook allocates,
//! takes locks and writes memory. Where the library must not do any of
//! that — while other threads' writes are held (`write_freeze`), or in a
//! forked child, where a lock another thread of the parent held stays
//! locked for good (`fork_copy`) — it calls the kernel itself.

use std::io;

fn check(r: libc::c_long) -> io::Result<libc::c_long> {
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r)
    }
}

/// A fresh private anonymous read-write mapping of `len` bytes.
pub(crate) fn map_anonymous(len: usize) -> io::Result<*mut u8> {
    // SAFETY: a new mapping at a kernel-chosen address affects no existing
    // memory.
    let r = unsafe {
        libc::syscall(
            libc::SYS_mmap,
            std::ptr::null_mut::<libc::c_void>(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    check(r).map(|addr| addr as *mut u8)
}

/// Moves the `len`-byte mapping at `from` to `to`, replacing what was
/// mapped there.
///
/// # Safety
///
/// `from` is a mapping of `len` bytes the caller owns; `[to, to + len)` is
/// memory the caller may replace.
pub(crate) unsafe fn move_over(from: *mut u8, len: usize, to: u64) -> io::Result<()> {
    // SAFETY: forwarded from the caller.
    let r = unsafe {
        libc::syscall(
            libc::SYS_mremap,
            from,
            len,
            len,
            libc::MREMAP_MAYMOVE | libc::MREMAP_FIXED,
            to,
        )
    };
    check(r).map(|_| ())
}

/// Faults in the pages of `[addr, addr + len)` as private writable pages
/// (`MADV_POPULATE_WRITE`, Linux 5.14), without changing a byte.
///
/// # Safety
///
/// The range is mapped memory of this process.
pub(crate) unsafe fn populate_write(addr: *mut u8, len: usize) -> io::Result<()> {
    // SAFETY: forwarded from the caller; the advice only faults pages in.
    let r = unsafe { libc::syscall(libc::SYS_madvise, addr, len, libc::MADV_POPULATE_WRITE) };
    check(r).map(|_| ())
}

/// Unmaps `len` bytes at `addr`.
///
/// # Safety
///
/// The range is a mapping the caller owns and no longer uses.
pub(crate) unsafe fn unmap(addr: *mut u8, len: usize) {
    // SAFETY: forwarded from the caller.
    unsafe { libc::syscall(libc::SYS_munmap, addr, len) };
}
