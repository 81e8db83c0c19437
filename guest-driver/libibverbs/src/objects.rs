//! The verbs objects the application holds pointers to.
//!
//! Each is a `#[repr(C)]` box whose first field is the libibverbs structure
//! the application sees (`struct ibv_pd`, `ibv_cq`, ...), followed by the
//! guest-driver object behind it. A pointer the application passes back is
//! therefore a pointer to the box. The guest-driver object is an `Option`
//! only so that `destroy` can move it out, and put it back when the device
//! refuses (e.g. `EBUSY`).

use std::ffi::c_int;
use std::sync::{Condvar, Mutex, MutexGuard};

use vrdma_guest_driver::{CompletionQueue, MemoryRegion, ProtectionDomain, QueuePair};

use crate::abi::{ibv_ah, ibv_ah_attr, ibv_comp_channel, ibv_cq, ibv_mr, ibv_pd, ibv_qp};
use crate::events::ChannelState;
use crate::ffi::VResult;

pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Every guarded state here is consistent between operations.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// `struct ibv_pd` and its protection domain.
#[repr(C)]
pub(crate) struct Pd {
    pub(crate) ibv: ibv_pd,
    pub(crate) inner: Option<ProtectionDomain>,
}

/// `struct ibv_mr` and its memory region.
#[repr(C)]
pub(crate) struct Mr {
    pub(crate) ibv: ibv_mr,
    pub(crate) inner: Option<MemoryRegion>,
}

/// Completion events handed to the application and acknowledged by it
/// (`ibv_destroy_cq` waits until they match).
#[derive(Default)]
pub(crate) struct EventCount {
    counts: Mutex<(u64, u64)>,
    acked: Condvar,
}

impl EventCount {
    pub(crate) fn delivered(&self) {
        lock(&self.counts).0 += 1;
    }

    /// Adds `n` acknowledgements; returns the total acknowledged.
    pub(crate) fn ack(&self, n: u64) -> u64 {
        let mut c = lock(&self.counts);
        c.1 = c.1.saturating_add(n);
        self.acked.notify_all();
        c.1
    }

    /// Waits until every delivered event has been acknowledged.
    pub(crate) fn wait_all_acked(&self) {
        let mut c = lock(&self.counts);
        while c.1 < c.0 {
            c = self.acked.wait(c).unwrap_or_else(|e| e.into_inner());
        }
    }
}

/// `struct ibv_cq` and its completion queue.
#[repr(C)]
pub(crate) struct Cq {
    pub(crate) ibv: ibv_cq,
    pub(crate) inner: Option<CompletionQueue>,
    pub(crate) channel: Option<std::sync::Arc<ChannelState>>,
    pub(crate) events: EventCount,
    /// Polls in a row that found nothing (see `datapath::poll_cq`).
    pub(crate) empty_polls: std::sync::atomic::AtomicU32,
}

/// `struct ibv_qp` and its queue pair.
#[repr(C)]
pub(crate) struct Qp {
    pub(crate) ibv: ibv_qp,
    pub(crate) inner: Option<QueuePair>,
}

/// `struct ibv_ah`: an address handle is a local record of its attributes.
#[repr(C)]
pub(crate) struct Ah {
    pub(crate) ibv: ibv_ah,
    pub(crate) attr: ibv_ah_attr,
}

/// `struct ibv_comp_channel` and its event queue.
#[repr(C)]
pub(crate) struct Channel {
    pub(crate) ibv: ibv_comp_channel,
    pub(crate) state: std::sync::Arc<ChannelState>,
}

/// A libibverbs structure that heads one of the boxes above.
///
/// # Safety
///
/// `Self::Ibv` must be the first field of `Self`, which must be `#[repr(C)]`.
pub(crate) unsafe trait Wrapper: Sized {
    type Ibv;

    /// The box behind an application pointer, or `EINVAL` for NULL.
    ///
    /// # Safety
    ///
    /// A non-null `p` must come from [`Wrapper::into_raw`] of this type and
    /// not have been destroyed.
    unsafe fn from_raw<'a>(p: *mut Self::Ibv) -> VResult<&'a Self> {
        if p.is_null() {
            return Err(libc::EINVAL);
        }
        // SAFETY: by the trait contract the libibverbs structure is the
        // first field of a repr(C) `Self`, so the pointers coincide; the
        // caller promises `p` is a live box of this type.
        Ok(unsafe { &*p.cast::<Self>() })
    }

    /// Like [`Wrapper::from_raw`], mutably (destroy paths only).
    ///
    /// # Safety
    ///
    /// As for [`Wrapper::from_raw`], and no other reference to the box may
    /// be in use (the verbs contract for destroying an object).
    unsafe fn from_raw_mut<'a>(p: *mut Self::Ibv) -> VResult<&'a mut Self> {
        if p.is_null() {
            return Err(libc::EINVAL);
        }
        // SAFETY: as in `from_raw`; exclusivity is the caller's promise.
        Ok(unsafe { &mut *p.cast::<Self>() })
    }

    /// Leaks `self` to the application.
    fn into_raw(self: Box<Self>) -> *mut Self::Ibv {
        Box::into_raw(self).cast()
    }

    /// Frees a box given back by the application.
    ///
    /// # Safety
    ///
    /// `p` must come from [`Wrapper::into_raw`] of this type and no
    /// reference to it may remain.
    unsafe fn free(p: *mut Self::Ibv) {
        // SAFETY: the caller's promise: a box of this type, not aliased.
        drop(unsafe { Box::from_raw(p.cast::<Self>()) });
    }
}

// SAFETY: each type is repr(C) with its libibverbs structure first.
unsafe impl Wrapper for Pd {
    type Ibv = ibv_pd;
}
// SAFETY: as above.
unsafe impl Wrapper for Mr {
    type Ibv = ibv_mr;
}
// SAFETY: as above.
unsafe impl Wrapper for Cq {
    type Ibv = ibv_cq;
}
// SAFETY: as above.
unsafe impl Wrapper for Qp {
    type Ibv = ibv_qp;
}
// SAFETY: as above.
unsafe impl Wrapper for Ah {
    type Ibv = ibv_ah;
}
// SAFETY: as above.
unsafe impl Wrapper for Channel {
    type Ibv = ibv_comp_channel;
}

/// A C `int` from a count that is known to be small.
pub(crate) fn c_int_of(v: u32) -> c_int {
    c_int::try_from(v).unwrap_or(c_int::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wrappers_start_with_their_libibverbs_structure() {
        assert_eq!(std::mem::offset_of!(Pd, ibv), 0);
        assert_eq!(std::mem::offset_of!(Mr, ibv), 0);
        assert_eq!(std::mem::offset_of!(Cq, ibv), 0);
        assert_eq!(std::mem::offset_of!(Qp, ibv), 0);
        assert_eq!(std::mem::offset_of!(Ah, ibv), 0);
        assert_eq!(std::mem::offset_of!(Channel, ibv), 0);
    }

    #[test]
    fn event_counts_wait_for_acks() {
        let c = std::sync::Arc::new(EventCount::default());
        c.wait_all_acked();
        c.delivered();
        c.delivered();
        let c2 = std::sync::Arc::clone(&c);
        let t = std::thread::spawn(move || c2.wait_all_acked());
        assert_eq!(c.ack(1), 1);
        assert_eq!(c.ack(1), 2);
        t.join().unwrap();
        // SAFETY: NULL is refused before any dereference.
        let r = unsafe { Pd::from_raw(std::ptr::null_mut()) };
        assert_eq!(r.err(), Some(libc::EINVAL));
    }
}
