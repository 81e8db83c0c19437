//! Shared receive queues: `ibv_create_srq`, `ibv_modify_srq` (the limit
//! event; resizing is refused, as mlx5 refuses it), `ibv_query_srq` and
//! `ibv_destroy_srq`. Posting is `datapath::post_srq_recv`; the limit
//! event reaches `ibv_get_async_event` through `events`.

use std::ffi::c_int;

use vrdma_guest_driver::SharedReceiveQueue;

use crate::abi::{ibv_pd, ibv_srq, ibv_srq_attr, ibv_srq_init_attr};
use crate::context::Ctx;
use crate::events;
use crate::ffi::{errno_of, int_verb, non_null, ptr_verb};
use crate::objects::{destroy_inner, Pd, Srq, Wrapper};

/// `ibv_create_srq`: the granted `max_wr` and `max_sge` are written back
/// into `srq_init_attr->attr`, as rdma-core's providers do.
///
/// # Safety
///
/// `pd` is a live PD; `srq_init_attr` is a valid, writable init structure.
pub unsafe extern "C" fn ibv_create_srq(
    pd: *mut ibv_pd,
    srq_init_attr: *mut ibv_srq_init_attr,
) -> *mut ibv_srq {
    ptr_verb("ibv_create_srq", || {
        non_null(srq_init_attr)?;
        // SAFETY: the caller passes a valid init structure and a live PD.
        let (init, our) = unsafe { (&mut *srq_init_attr, Pd::from_raw(pd)?) };
        // SAFETY: a live PD's context is open.
        let ctx = unsafe { Ctx::from_ibv(our.ibv.context)? };
        let a = init.attr;
        let srq = our
            .inner
            .as_ref()
            .ok_or(libc::EINVAL)?
            .create_srq(a.max_wr, a.max_sge, a.srq_limit)
            .map_err(|e| errno_of(&e))?;
        let (max_wr, max_sge) = srq.caps();
        init.attr.max_wr = max_wr;
        init.attr.max_sge = max_sge;
        let srqn = srq.srqn();
        let raw = Box::new(Srq {
            ibv: ibv_srq {
                context: our.ibv.context,
                srq_context: init.srq_context,
                pd,
                handle: srqn,
                ..Default::default()
            },
            inner: Some(srq),
        })
        .into_raw();
        events::add_srq(&ctx.shared, srqn, raw);
        Ok(raw)
    })
}

/// `ibv_modify_srq`: `IBV_SRQ_LIMIT` arms the limit event; `IBV_SRQ_MAX_WR`
/// (resizing) is `EINVAL`.
///
/// # Safety
///
/// `srq` is a live SRQ; `srq_attr` is a valid attribute structure.
pub unsafe extern "C" fn ibv_modify_srq(
    srq: *mut ibv_srq,
    srq_attr: *mut ibv_srq_attr,
    srq_attr_mask: c_int,
) -> c_int {
    int_verb("ibv_modify_srq", || {
        non_null(srq_attr)?;
        // SAFETY: the caller passes a live SRQ and a valid attribute structure.
        let (our, a) = unsafe { (Srq::from_raw(srq)?, &*srq_attr) };
        let mask = u32::try_from(srq_attr_mask).map_err(|_| libc::EINVAL)?;
        our.inner
            .as_ref()
            .ok_or(libc::EINVAL)?
            .modify(mask, a.max_wr, a.srq_limit)
            .map_err(|e| errno_of(&e))
    })
}

/// `ibv_query_srq`: capacities and the limit now (0 once the event fired).
///
/// # Safety
///
/// `srq` is a live SRQ; `srq_attr` is writable.
pub unsafe extern "C" fn ibv_query_srq(srq: *mut ibv_srq, srq_attr: *mut ibv_srq_attr) -> c_int {
    int_verb("ibv_query_srq", || {
        non_null(srq_attr)?;
        // SAFETY: the caller passes a live SRQ.
        let our = unsafe { Srq::from_raw(srq)? };
        let got = our
            .inner
            .as_ref()
            .ok_or(libc::EINVAL)?
            .query()
            .map_err(|e| errno_of(&e))?;
        // SAFETY: the caller passes a writable attribute structure.
        unsafe {
            *srq_attr = ibv_srq_attr {
                max_wr: got.max_wr.get(),
                max_sge: got.max_sge.get(),
                srq_limit: got.srq_limit.get(),
            };
        }
        Ok(())
    })
}

/// `ibv_destroy_srq`: `EBUSY` while QPs take receives from it.
///
/// # Safety
///
/// `srq` is a live SRQ not used by another thread.
pub unsafe extern "C" fn ibv_destroy_srq(srq: *mut ibv_srq) -> c_int {
    int_verb("ibv_destroy_srq", || {
        // SAFETY: the caller passes a live SRQ it no longer uses elsewhere.
        let this = unsafe { Srq::from_raw_mut(srq)? };
        // SAFETY: a live SRQ's context is open.
        let ctx = unsafe { Ctx::from_ibv(this.ibv.context)? };
        destroy_inner(&mut this.inner, SharedReceiveQueue::destroy)?;
        events::remove_srq(&ctx.shared, this.ibv.handle, srq);
        // SAFETY: the SRQ box is no longer referenced.
        unsafe { Srq::free(srq) };
        Ok(())
    })
}
