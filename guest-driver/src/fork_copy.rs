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
//! The moved ranges are `user_mem`'s process-wide regions. The
//! `pthread_atfork` prepare handler takes their lock, so no thread holds
//! it across the fork (nor is halfway through a move); the child, a single
//! thread, copies every region, then empties the list: its memory is
//! private again, and it holds no registration of its own. A context the
//! child opens starts from nothing, as one in a new process would.

use std::cell::RefCell;
use std::sync::{MutexGuard, Once};

use crate::raw_mm;
use crate::user_mem::{self, UserRegions};

/// One moved range: its address, length, and the memfd holding it.
#[derive(Clone, Copy)]
pub(crate) struct Moved {
    pub(crate) start: u64,
    pub(crate) len: u64,
    pub(crate) fd: libc::c_int,
}

thread_local! {
    /// The regions' lock, held by the forking thread from the prepare
    /// handler to the parent's or the child's.
    static HELD: RefCell<Option<MutexGuard<'static, UserRegions>>> = const { RefCell::new(None) };
}

/// Installs the fork handlers (once per process).
pub(crate) fn install() {
    static HANDLERS: Once = Once::new();
    HANDLERS.call_once(|| {
        // SAFETY: the handlers are functions of this library that take no
        // arguments; registering cannot fail but for lack of memory.
        let r = unsafe { libc::pthread_atfork(Some(prepare), Some(parent), Some(child)) };
        if r != 0 {
            tracing::error!(errno = r, "Cannot register the fork handlers");
        }
    });
}

extern "C" fn prepare() {
    let regions = user_mem::regions();
    HELD.with(|h| *h.borrow_mut() = Some(regions));
}

extern "C" fn parent() {
    HELD.with(|h| drop(h.borrow_mut().take()));
}

extern "C" fn child() {
    HELD.with(|h| {
        let Some(mut regions) = h.borrow_mut().take() else {
            return;
        };
        for m in regions.moved() {
            // A copy that cannot be made leaves the range shared, as
            // before.
            // SAFETY: `copy_private`'s contract: the range is the memfd's,
            // and this is the process's only thread.
            let _ = unsafe { copy_private(m) };
        }
        regions.forget_all();
    });
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
