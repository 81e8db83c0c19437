//! What a forked child gets of the application memory moved onto memfds:
//! its own private copy, as it gets of the rest of its memory.
//!
//! A moved range is a `MAP_SHARED` mapping, which `fork()` would leave
//! shared between parent and child: the child's writes — malloc's own, in
//! a heap page — would land in the parent's memory, and the parent's in
//! the child's. So the child, before `fork()` returns in it, replaces each
//! moved range with a private anonymous copy of its contents (read from
//! the memfd, so a range the application unmapped against the rules
//! cannot fault). The parent keeps its mapping and its registrations. A
//! kernel does the same for DMA-pinned pages: it copies them into the
//! child at fork.
//!
//! The ranges live in one process-wide list under a pthread mutex that the
//! `pthread_atfork` prepare handler takes, so no thread holds it across
//! the fork and the child (a single thread) may read the list.

use std::cell::UnsafeCell;
use std::sync::Once;

use crate::raw_mm;

/// One moved range: its address, length, and the memfd holding it.
#[derive(Clone, Copy)]
struct Moved {
    start: u64,
    len: u64,
    fd: libc::c_int,
}

struct Registry {
    lock: UnsafeCell<libc::pthread_mutex_t>,
    ranges: UnsafeCell<Vec<Moved>>,
}

// SAFETY: `ranges` is only touched with `lock` held (`with_ranges`), or in
// a forked child, whose only thread runs the child handler while the
// parent's forking thread held `lock` through the fork.
unsafe impl Sync for Registry {}

static REGISTRY: Registry = Registry {
    lock: UnsafeCell::new(libc::PTHREAD_MUTEX_INITIALIZER),
    ranges: UnsafeCell::new(Vec::new()),
};

fn with_ranges<R>(f: impl FnOnce(&mut Vec<Moved>) -> R) -> R {
    // SAFETY: a statically initialized mutex, locked and unlocked by this
    // thread; the list is ours while it is held.
    unsafe {
        libc::pthread_mutex_lock(REGISTRY.lock.get());
        let r = f(&mut *REGISTRY.ranges.get());
        libc::pthread_mutex_unlock(REGISTRY.lock.get());
        r
    }
}

/// Records `[start, start + len)`, now a shared mapping of `fd`, for the
/// children of later forks. `fd` must stay open until [`forget`].
pub(crate) fn remember(start: u64, len: u64, fd: libc::c_int) {
    static HANDLERS: Once = Once::new();
    HANDLERS.call_once(|| {
        // SAFETY: the handlers are functions of this library that take no
        // arguments; registering cannot fail but for lack of memory.
        let r = unsafe { libc::pthread_atfork(Some(prepare), Some(parent), Some(child)) };
        if r != 0 {
            tracing::error!(errno = r, "Cannot register the fork handlers");
        }
    });
    with_ranges(|ranges| ranges.push(Moved { start, len, fd }));
}

/// Forgets the range starting at `start` (before its memfd is closed).
pub(crate) fn forget(start: u64) {
    with_ranges(|ranges| ranges.retain(|m| m.start != start));
}

extern "C" fn prepare() {
    // SAFETY: see `with_ranges`; released by `parent` or `child`.
    unsafe { libc::pthread_mutex_lock(REGISTRY.lock.get()) };
}

extern "C" fn parent() {
    // SAFETY: taken by `prepare` on this thread.
    unsafe { libc::pthread_mutex_unlock(REGISTRY.lock.get()) };
}

extern "C" fn child() {
    // SAFETY: this process's only thread; the parent's forking thread held
    // the lock, so the list is whole. Nothing here allocates.
    let ranges = unsafe { &*REGISTRY.ranges.get() };
    for m in ranges {
        // A copy that cannot be made leaves the range shared, as before.
        // SAFETY: `copy_private`'s contract: the range is the memfd's.
        let _ = unsafe { copy_private(*m) };
    }
    // SAFETY: the lock is this thread's (copied from the forking thread).
    unsafe { libc::pthread_mutex_unlock(REGISTRY.lock.get()) };
}

/// Replaces the shared mapping of `m` by a private anonymous copy of the
/// memfd's contents.
///
/// # Safety
///
/// `m.fd` is the memfd mapped at `m.start` (or nothing is mapped there);
/// the caller is the only thread (no one else uses the range meanwhile).
unsafe fn copy_private(m: Moved) -> Result<(), ()> {
    let len = usize::try_from(m.len).map_err(|_| ())?;
    // The system calls themselves (`raw_mm`): a hooked `mmap` may take a
    // lock that another thread of the parent held at the fork, which no
    // one in the child will release.
    let tmp = raw_mm::map_anonymous(len).map_err(|_| ())?;
    let mut done = 0usize;
    while done < len {
        // SAFETY: reads into the rest of the fresh `len`-byte mapping.
        let n = unsafe { libc::pread(m.fd, tmp.add(done).cast(), len - done, done as libc::off_t) };
        if n <= 0 {
            // SAFETY: unmapping the mapping made above.
            unsafe { raw_mm::unmap(tmp, len) };
            return Err(());
        }
        done += n.unsigned_abs();
    }
    // SAFETY: moves the copy over the range (its shared mapping goes),
    // which the caller's contract allows.
    if unsafe { raw_mm::move_over(tmp, len, m.start) }.is_err() {
        // SAFETY: as above.
        unsafe { raw_mm::unmap(tmp, len) };
        return Err(());
    }
    Ok(())
}
