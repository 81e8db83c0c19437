//! The verbs objects the application holds pointers to.
//!
//! Each is a `#[repr(C)]` box whose first field is the libibverbs structure
//! the application sees (`struct ibv_pd`, `ibv_cq`, ...), followed by the
//! guest-driver object behind it. A pointer the application passes back is
//! therefore a pointer to the box. The guest-driver object is an `Option`
//! only so that `destroy` can move it out, and put it back when the device
//! refuses (e.g. `EBUSY`).

use std::ffi::c_int;
use std::fmt::Debug;
use std::sync::{Condvar, Mutex, MutexGuard};

use vrdma_guest_driver::{
    AddressHandle, CompletionQueue, DestroyError, MemoryRegion, ProtectionDomain, QueuePair,
    SharedReceiveQueue,
};

use crate::abi::{
    ibv_ah, ibv_ah_attr, ibv_comp_channel, ibv_cq, ibv_cq_ex, ibv_mr, ibv_pd, ibv_qp, ibv_qp_ex,
    ibv_srq, ibv_wc,
};
use crate::events::ChannelState;
use crate::ffi::{non_null, VResult};
use crate::qp_ex::WrPosting;

pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Every guarded state here is consistent between operations.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The box of a PD, an MR or a QP: its libibverbs structure and the
/// guest-driver object behind it, and nothing else.
#[repr(C)]
pub(crate) struct Object<I, T> {
    pub(crate) ibv: I,
    pub(crate) inner: Option<T>,
}

impl<I, T: Debug> Object<I, T> {
    /// Destroys the guest-driver object of the box the application gives
    /// back at `p` with `destroy` (see [`destroy_inner`]), then frees the
    /// box.
    ///
    /// # Safety
    ///
    /// `p` is a live box of this type that no other thread uses (the verbs
    /// contract for destroying an object).
    pub(crate) unsafe fn destroy(
        p: *mut I,
        destroy: impl FnOnce(T) -> Destroyed<T>,
    ) -> VResult<()> {
        // SAFETY: the caller's promise.
        let this = unsafe { Self::from_raw_mut(p)? };
        destroy_inner(&mut this.inner, destroy)?;
        // SAFETY: the box is no longer referenced.
        unsafe { Self::free(p) };
        Ok(())
    }
}

/// What a guest-driver object's explicit destroy returns.
pub(crate) type Destroyed<T> = Result<(), DestroyError<T>>;

/// Takes the guest-driver object out of `slot` and destroys it with
/// `destroy`. When the device refuses (e.g. `EBUSY`), the object goes back
/// into `slot`, still usable, and the device's errno is returned; `EINVAL`
/// when `slot` is empty.
pub(crate) fn destroy_inner<T: Debug>(
    slot: &mut Option<T>,
    destroy: impl FnOnce(T) -> Destroyed<T>,
) -> VResult<()> {
    let inner = slot.take().ok_or(libc::EINVAL)?;
    destroy(inner).map_err(|e| {
        let errno = e.errno();
        *slot = Some(e.object);
        errno
    })
}

/// `struct ibv_pd` and its protection domain.
pub(crate) type Pd = Object<ibv_pd, ProtectionDomain>;

/// `struct ibv_mr` and its memory region.
pub(crate) type Mr = Object<ibv_mr, MemoryRegion>;

/// `struct ibv_qp` (inside the `struct ibv_qp_ex` that `ibv_qp_to_qp_ex`
/// returns, as rdma-core's `struct verbs_qp` holds both) and its queue
/// pair.
#[repr(C)]
pub(crate) struct Qp {
    pub(crate) ibv: ibv_qp_ex,
    pub(crate) inner: Option<QueuePair>,
    /// The `ibv_wr_*` interface, for a QP created with `send_ops_flags`
    /// (`ibv_qp_to_qp_ex` is NULL for the others).
    pub(crate) wr: Option<WrPosting>,
}

/// `struct ibv_srq` and its shared receive queue.
pub(crate) type Srq = Object<ibv_srq, SharedReceiveQueue>;

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

/// `struct ibv_cq` (inside the `struct ibv_cq_ex` that starts with the
/// same fields, so every CQ can be polled both ways) and its completion
/// queue.
#[repr(C)]
pub(crate) struct Cq {
    pub(crate) ibv: ibv_cq_ex,
    pub(crate) inner: Option<CompletionQueue>,
    pub(crate) channel: Option<std::sync::Arc<ChannelState>>,
    pub(crate) events: EventCount,
    /// Polls in a row that found nothing (see `datapath::poll_cq`).
    pub(crate) empty_polls: std::sync::atomic::AtomicU32,
    /// The completion `ibv_start_poll`/`ibv_next_poll` stepped onto, which
    /// the `ibv_wc_read_*` accessors read (the verbs contract: one thread
    /// polls a CQ between `ibv_start_poll` and `ibv_end_poll`).
    pub(crate) current: std::cell::Cell<ibv_wc>,
}

/// `struct ibv_ah`, its attributes and the device's address handle.
#[repr(C)]
pub(crate) struct Ah {
    pub(crate) ibv: ibv_ah,
    pub(crate) attr: ibv_ah_attr,
    pub(crate) inner: Option<AddressHandle>,
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
        non_null(p)?;
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
        non_null(p)?;
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
unsafe impl<I, T> Wrapper for Object<I, T> {
    type Ibv = I;
}
// SAFETY: as above (`struct ibv_cq` is the start of `struct ibv_cq_ex`:
// `cq_ex::tests` checks the offsets).
unsafe impl Wrapper for Cq {
    type Ibv = ibv_cq;
}
// SAFETY: as above (`struct ibv_qp` is the first field of `ibv_qp_ex`).
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
