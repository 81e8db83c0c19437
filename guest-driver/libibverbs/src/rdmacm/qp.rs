//! QPs, CQs and SRQs made through a CM ID (rdma-core's `rdma_create_qp`
//! family): CQs with completion channels when the caller gives none
//! (`cq_context` the ID, as `rdma_get_send_comp` expects), and the QP
//! moved to INIT (UD: on to RTS) with the device's attributes.

use vrdma_guest_driver::cm::{move_flags, MoveOverrides};
use vrdma_guest_driver::vrdma_spec::verbs::QpState;

use super::cm_call;
use super::id::Id;
use crate::abi::{
    ibv_comp_channel, ibv_cq, ibv_pd, ibv_qp_init_attr, ibv_qp_init_attr_ex, ibv_srq_init_attr,
    ibv_srq_init_attr_ex, rdma_cm_id, IBV_QPT_UD, IBV_QP_INIT_ATTR_PD, IBV_SRQT_BASIC,
    IBV_SRQ_INIT_ATTR_PD, IBV_SRQ_INIT_ATTR_TYPE,
};
use crate::ffi::{non_null, VResult};
use crate::{control, events, qp_ex, srq};

fn view(id: &Id) -> &mut rdma_cm_id {
    id.cm_mut()
}

/// A CQ of `size` with its own completion channel.
fn cq_with_channel(id: &Id, size: u32) -> VResult<(*mut ibv_comp_channel, *mut ibv_cq)> {
    let v = view(id);
    // SAFETY: the ID's open context.
    let ch = unsafe { events::ibv_create_comp_channel(v.verbs) };
    if ch.is_null() {
        return Err(super::channel::errno());
    }
    let size = i32::try_from(size.max(1)).unwrap_or(i32::MAX);
    // SAFETY: as above; the channel just made.
    let cq = unsafe { control::ibv_create_cq(v.verbs, size, std::ptr::from_mut(v).cast(), ch, 0) };
    if cq.is_null() {
        let e = super::channel::errno();
        // SAFETY: the channel just made, unused.
        unsafe { events::ibv_destroy_comp_channel(ch) };
        return Err(e);
    }
    Ok((ch, cq))
}

fn destroy_cqs(id: &Id) {
    let v = view(id);
    // SAFETY: CQs and channels this library made for the ID.
    unsafe {
        if !v.recv_cq.is_null() {
            control::ibv_destroy_cq(v.recv_cq);
            if !v.send_cq.is_null() && v.send_cq != v.recv_cq {
                control::ibv_destroy_cq(v.send_cq);
            }
        } else if !v.send_cq.is_null() {
            control::ibv_destroy_cq(v.send_cq);
        }
        if !v.recv_cq_channel.is_null() {
            events::ibv_destroy_comp_channel(v.recv_cq_channel);
            if !v.send_cq_channel.is_null() && v.send_cq_channel != v.recv_cq_channel {
                events::ibv_destroy_comp_channel(v.send_cq_channel);
            }
        } else if !v.send_cq_channel.is_null() {
            events::ibv_destroy_comp_channel(v.send_cq_channel);
        }
    }
    v.recv_cq = std::ptr::null_mut();
    v.send_cq = std::ptr::null_mut();
    v.recv_cq_channel = std::ptr::null_mut();
    v.send_cq_channel = std::ptr::null_mut();
}

fn create_qp_ex_on(id: &Id, attr: &mut ibv_qp_init_attr_ex) -> VResult<()> {
    let v = view(id);
    if !v.qp.is_null() || v.verbs.is_null() {
        return Err(libc::EINVAL);
    }
    if attr.comp_mask & IBV_QP_INIT_ATTR_PD == 0 || attr.pd.is_null() {
        attr.comp_mask |= IBV_QP_INIT_ATTR_PD;
        attr.pd = v.pd;
    } else {
        // SAFETY: the caller's live PD.
        if unsafe { (*attr.pd).context } != v.verbs {
            return Err(libc::EINVAL);
        }
    }
    if (!v.recv_cq.is_null() && !attr.recv_cq.is_null() && v.recv_cq != attr.recv_cq)
        || (!v.send_cq.is_null() && !attr.send_cq.is_null() && v.send_cq != attr.send_cq)
    {
        return Err(libc::EINVAL);
    }
    if attr.recv_cq.is_null() && v.recv_cq.is_null() {
        let (ch, cq) = cq_with_channel(id, attr.cap.max_recv_wr)?;
        v.recv_cq_channel = ch;
        v.recv_cq = cq;
    }
    if attr.send_cq.is_null() && v.send_cq.is_null() {
        match cq_with_channel(id, attr.cap.max_send_wr) {
            Ok((ch, cq)) => {
                v.send_cq_channel = ch;
                v.send_cq = cq;
            }
            Err(e) => {
                destroy_cqs(id);
                return Err(e);
            }
        }
    }
    if attr.send_cq.is_null() {
        attr.send_cq = v.send_cq;
    }
    if attr.recv_cq.is_null() {
        attr.recv_cq = v.recv_cq;
    }
    if !v.srq.is_null() && attr.srq.is_null() {
        attr.srq = v.srq;
    }
    // SAFETY: the ID's open context and a valid attribute structure.
    let qp = unsafe { qp_ex::create_qp_ex(v.verbs, attr) };
    if qp.is_null() {
        let e = super::channel::errno();
        destroy_cqs(id);
        return Err(e);
    }
    v.qp = qp;
    let (state, flags) = match v.qp_type == IBV_QPT_UD {
        // A UD QP is ready at once, from SQ PSN 0 (rdma-core's
        // `ucma_init_ud_qp`).
        true => (
            QpState::Rts,
            move_flags::FROM_INIT | move_flags::SQ_PSN_ZERO,
        ),
        false => (QpState::Init, move_flags::FROM_INIT),
    };
    let moved = id.move_qp_through(state, flags, MoveOverrides::default());
    if let Err(e) = moved {
        // SAFETY: the QP just made.
        unsafe { control::ibv_destroy_qp(qp) };
        v.qp = std::ptr::null_mut();
        destroy_cqs(id);
        return Err(e);
    }
    // SAFETY: as above.
    v.pd = unsafe { (*qp).pd };
    Ok(())
}

/// `rdma_create_qp` on `id` with `pd` (NULL: the ID's).
pub(crate) fn create_qp(
    id: *mut rdma_cm_id,
    pd: *mut ibv_pd,
    init: &mut ibv_qp_init_attr,
) -> VResult<()> {
    // SAFETY: the caller passes a live ID.
    let our = unsafe { Id::from_raw(id)? };
    let mut ex = ibv_qp_init_attr_ex {
        qp_context: init.qp_context,
        send_cq: init.send_cq,
        recv_cq: init.recv_cq,
        srq: init.srq,
        cap: init.cap,
        qp_type: init.qp_type,
        sq_sig_all: init.sq_sig_all,
        comp_mask: IBV_QP_INIT_ATTR_PD,
        pd: if pd.is_null() { our.cm().pd } else { pd },
        ..Default::default()
    };
    let r = create_qp_ex_on(our, &mut ex);
    init.send_cq = ex.send_cq;
    init.recv_cq = ex.recv_cq;
    init.srq = ex.srq;
    init.cap = ex.cap;
    r
}

/// `rdma_create_qp`.
///
/// # Safety
///
/// `id` is live; `qp_init_attr` valid and writable; `pd` NULL or live.
pub unsafe extern "C" fn rdma_create_qp(
    id: *mut rdma_cm_id,
    pd: *mut ibv_pd,
    qp_init_attr: *mut ibv_qp_init_attr,
) -> i32 {
    cm_call("rdma_create_qp", || {
        non_null(qp_init_attr)?;
        // SAFETY: the caller's structure.
        create_qp(id, pd, unsafe { &mut *qp_init_attr })
    })
}

/// `rdma_create_qp_ex`.
///
/// # Safety
///
/// `id` is live; `attr` valid and writable.
pub unsafe extern "C" fn rdma_create_qp_ex(
    id: *mut rdma_cm_id,
    attr: *mut ibv_qp_init_attr_ex,
) -> i32 {
    cm_call("rdma_create_qp_ex", || {
        non_null(attr)?;
        // SAFETY: the caller's live ID and structure.
        let (our, attr) = unsafe { (Id::from_raw(id)?, &mut *attr) };
        create_qp_ex_on(our, attr)
    })
}

/// `rdma_destroy_qp`: the QP, and the CQs and channels made for it.
///
/// # Safety
///
/// `id` is live.
pub unsafe extern "C" fn rdma_destroy_qp(id: *mut rdma_cm_id) {
    crate::ffi::guard("rdma_destroy_qp", (), || {
        // SAFETY: the caller's live ID.
        let Ok(our) = (unsafe { Id::from_raw(id) }) else {
            return;
        };
        let v = view(our);
        if !v.qp.is_null() {
            // SAFETY: the ID's QP.
            unsafe { control::ibv_destroy_qp(v.qp) };
            v.qp = std::ptr::null_mut();
        }
        destroy_cqs(our);
    });
}

/// Creates an SRQ on `pd` and makes it the ID's (`id->srq`).
fn srq_on(id: &Id, pd: *mut ibv_pd, attr: &mut ibv_srq_init_attr) -> VResult<()> {
    // SAFETY: a live PD and a valid structure.
    let s = unsafe { srq::ibv_create_srq(pd, attr) };
    if s.is_null() {
        return Err(super::channel::errno());
    }
    view(id).srq = s;
    Ok(())
}

/// `rdma_create_srq_ex`: a basic SRQ on the ID (with a receive CQ and
/// channel if it has none); XRC SRQs are EOPNOTSUPP, as the device has no
/// XRC.
///
/// # Safety
///
/// `id` is live; `attr` valid and writable.
pub unsafe extern "C" fn rdma_create_srq_ex(
    id: *mut rdma_cm_id,
    attr: *mut ibv_srq_init_attr_ex,
) -> i32 {
    cm_call("rdma_create_srq_ex", || {
        non_null(attr)?;
        // SAFETY: the caller's live ID and structure.
        let (our, a) = unsafe { (Id::from_raw(id)?, &mut *attr) };
        if a.comp_mask & IBV_SRQ_INIT_ATTR_TYPE != 0 && a.srq_type != IBV_SRQT_BASIC {
            return Err(libc::EOPNOTSUPP);
        }
        let pd = if a.comp_mask & IBV_SRQ_INIT_ATTR_PD != 0 && !a.pd.is_null() {
            a.pd
        } else {
            our.cm().pd
        };
        let mut basic = ibv_srq_init_attr {
            srq_context: a.srq_context,
            attr: a.attr,
        };
        srq_on(our, pd, &mut basic)?;
        a.attr = basic.attr;
        Ok(())
    })
}

/// `rdma_create_srq`.
///
/// # Safety
///
/// `id` is live; `attr` valid and writable; `pd` NULL or live.
pub unsafe extern "C" fn rdma_create_srq(
    id: *mut rdma_cm_id,
    pd: *mut ibv_pd,
    attr: *mut ibv_srq_init_attr,
) -> i32 {
    cm_call("rdma_create_srq", || {
        non_null(attr)?;
        // SAFETY: the caller's live ID and structure.
        let (our, a) = unsafe { (Id::from_raw(id)?, &mut *attr) };
        let pd = if pd.is_null() { our.cm().pd } else { pd };
        srq_on(our, pd, a)
    })
}

/// `rdma_destroy_srq`.
///
/// # Safety
///
/// `id` is live.
pub unsafe extern "C" fn rdma_destroy_srq(id: *mut rdma_cm_id) {
    crate::ffi::guard("rdma_destroy_srq", (), || {
        // SAFETY: the caller's live ID.
        let Ok(our) = (unsafe { Id::from_raw(id) }) else {
            return;
        };
        let v = view(our);
        if !v.srq.is_null() {
            // SAFETY: the ID's SRQ.
            unsafe { srq::ibv_destroy_srq(v.srq) };
            v.srq = std::ptr::null_mut();
        }
    });
}
