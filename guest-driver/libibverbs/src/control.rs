//! Control verbs: protection domains, memory regions, completion queues,
//! queue pairs and address handles, on top of the guest driver's objects.

use std::ffi::{c_int, c_uint, c_void};

use vrdma_guest_driver::vrdma_spec::control::{AhAttr, QpAttr, QpCap, QueryQpResp};
use vrdma_guest_driver::vrdma_spec::qp_state::mask;
use vrdma_guest_driver::vrdma_spec::verbs::QpType;
use vrdma_guest_driver::{
    AddressHandle, CompletionQueue, MemoryRegion, ProtectionDomain, QpCapabilities, QpInitAttr,
    QueuePair,
};

use crate::abi::{
    ibv_ah, ibv_ah_attr, ibv_comp_channel, ibv_context, ibv_cq, ibv_cq_ex, ibv_gid,
    ibv_global_route, ibv_grh, ibv_mr, ibv_pd, ibv_qp, ibv_qp_attr, ibv_qp_cap, ibv_qp_ex,
    ibv_qp_init_attr, ibv_wc, IBV_ACCESS_LOCAL_WRITE, IBV_ACCESS_RELAXED_ORDERING, IBV_QPS_RESET,
    IBV_QPT_RC, IBV_QPT_UC, IBV_QPT_UD, IBV_WC_GRH,
};
use crate::context::{Ctx, QpRoute};
use crate::ffi::{errno_of, int_verb, non_null, ptr_verb, unsupported, VResult};
use crate::objects::{c_int_of, destroy_inner, Ah, Cq, EventCount, Mr, Pd, Qp, Srq, Wrapper};
use crate::qp_ex::{self, WrPosting};
use crate::{cq_ex, events};

/// `IBV_ACCESS_OPTIONAL_RANGE`: access bits a provider may ignore.
const ACCESS_OPTIONAL_RANGE: u32 = 0x3ff0_0000;

fn ctx_of<'a>(context: *mut ibv_context) -> VResult<&'a Ctx> {
    // SAFETY: callers pass the context pointer of a live object (or the
    // application's), which the verbs contract says is open.
    unsafe { Ctx::from_ibv(context) }
}

fn pd_of<'a>(pd: *mut ibv_pd) -> VResult<&'a Pd> {
    // SAFETY: the verbs contract: a PD pointer the application passes is
    // one this library allocated and has not freed.
    unsafe { Pd::from_raw(pd) }
}

/// `ibv_alloc_pd`.
///
/// # Safety
///
/// `context` is an open context.
pub unsafe extern "C" fn ibv_alloc_pd(context: *mut ibv_context) -> *mut ibv_pd {
    ptr_verb("ibv_alloc_pd", || {
        let ctx = ctx_of(context)?;
        let pd = ctx.shared.dev.alloc_pd().map_err(|e| errno_of(&e))?;
        Ok(Box::new(Pd {
            ibv: ibv_pd {
                context,
                handle: pd.pdn(),
            },
            inner: Some(pd),
        })
        .into_raw())
    })
}

/// `ibv_dealloc_pd`: `EBUSY` while MRs, QPs or AHs use it.
///
/// # Safety
///
/// `pd` is a live PD not used by another thread.
pub unsafe extern "C" fn ibv_dealloc_pd(pd: *mut ibv_pd) -> c_int {
    int_verb("ibv_dealloc_pd", || {
        // SAFETY: the caller passes a live PD it no longer uses elsewhere.
        unsafe { Pd::destroy(pd, ProtectionDomain::destroy) }
    })
}

/// `ibv_reg_mr@IBVERBS_1.1`.
///
/// # Safety
///
/// As for [`ibv_reg_mr_iova2`].
pub unsafe extern "C" fn ibv_reg_mr(
    pd: *mut ibv_pd,
    addr: *mut c_void,
    length: usize,
    access: c_int,
) -> *mut ibv_mr {
    // SAFETY: forwarded; the access bits are passed as they are.
    unsafe { ibv_reg_mr_iova2(pd, addr, length, addr as u64, access as c_uint) }
}

/// `ibv_reg_mr_iova@IBVERBS_1.7`: [`ibv_reg_mr_iova2`] with `int` access
/// bits.
///
/// # Safety
///
/// As for [`ibv_reg_mr_iova2`].
pub unsafe extern "C" fn ibv_reg_mr_iova(
    pd: *mut ibv_pd,
    addr: *mut c_void,
    length: usize,
    iova: u64,
    access: c_int,
) -> *mut ibv_mr {
    // SAFETY: forwarded; the access bits are passed as they are.
    unsafe { ibv_reg_mr_iova2(pd, addr, length, iova, access as c_uint) }
}

/// `ibv_reg_mr_iova2`: registers application memory. The guest driver moves
/// the pages covering the range onto shared memory in place (see the guest
/// driver's `ProtectionDomain::reg_mr`): page-aligned buffers are expected.
///
/// # Safety
///
/// `pd` is a live PD; `[addr, addr + length)` is memory the application
/// owns and keeps mapped while the MR exists (other threads may write to
/// its pages meanwhile: the move holds their writes).
pub unsafe extern "C" fn ibv_reg_mr_iova2(
    pd: *mut ibv_pd,
    addr: *mut c_void,
    length: usize,
    iova: u64,
    access: c_uint,
) -> *mut ibv_mr {
    ptr_verb("ibv_reg_mr", || {
        let our = pd_of(pd)?;
        let inner = our.inner.as_ref().ok_or(libc::EINVAL)?;
        // Optional access bits are hints a provider may drop; relaxed
        // ordering is honoured (the device orders everything).
        let access = access & !ACCESS_OPTIONAL_RANGE | access & IBV_ACCESS_RELAXED_ORDERING;
        // SAFETY: the caller's promise, which is the guest driver's contract.
        let mr = unsafe { inner.reg_mr_iova(addr.cast(), length, iova, access) }
            .map_err(|e| errno_of(&e))?;
        Ok(Box::new(Mr {
            ibv: ibv_mr {
                context: our.ibv.context,
                pd,
                addr,
                length,
                handle: mr.lkey(),
                lkey: mr.lkey(),
                rkey: mr.rkey(),
            },
            inner: Some(mr),
        })
        .into_raw())
    })
}

/// `ibv_dereg_mr`.
///
/// # Safety
///
/// `mr` is a live MR not used by another thread.
pub unsafe extern "C" fn ibv_dereg_mr(mr: *mut ibv_mr) -> c_int {
    int_verb("ibv_dereg_mr", || {
        // SAFETY: the caller passes a live MR it no longer uses elsewhere.
        unsafe { Mr::destroy(mr, MemoryRegion::dereg) }
    })
}

/// `ibv_rereg_mr`: not supported (deregister and register again).
///
/// # Safety
///
/// Any arguments.
pub unsafe extern "C" fn ibv_rereg_mr(
    _mr: *mut ibv_mr,
    _flags: c_int,
    _pd: *mut ibv_pd,
    _addr: *mut c_void,
    _length: usize,
    _access: c_int,
) -> c_int {
    int_verb("ibv_rereg_mr", || Err(unsupported("ibv_rereg_mr")))
}

/// `ibv_create_cq`.
///
/// # Safety
///
/// `context` is an open context; `channel` is NULL or a live channel.
pub unsafe extern "C" fn ibv_create_cq(
    context: *mut ibv_context,
    cqe: c_int,
    cq_context: *mut c_void,
    channel: *mut ibv_comp_channel,
    comp_vector: c_int,
) -> *mut ibv_cq {
    ptr_verb("ibv_create_cq", || {
        // SAFETY: the caller's promise.
        unsafe { create_cq(context, cqe, cq_context, channel, comp_vector) }
    })
}

/// Creates a CQ (`ibv_create_cq`, `ibv_create_cq_ex`): every CQ can also
/// be polled through `struct ibv_cq_ex` (see `cq_ex`).
///
/// # Safety
///
/// As for [`ibv_create_cq`].
pub(crate) unsafe fn create_cq(
    context: *mut ibv_context,
    cqe: c_int,
    cq_context: *mut c_void,
    channel: *mut ibv_comp_channel,
    comp_vector: c_int,
) -> VResult<*mut ibv_cq> {
    let ctx = ctx_of(context)?;
    let cqe = u32::try_from(cqe)
        .ok()
        .filter(|&n| n > 0)
        .ok_or(libc::EINVAL)?;
    let vector = u16::try_from(comp_vector)
        .ok()
        .filter(|&v| v < ctx.shared.dev.num_comp_vectors())
        .ok_or(libc::EINVAL)?;
    // SAFETY: the caller passes NULL or a live channel.
    let state = unsafe { events::channel_state(channel)? };
    let cq = ctx
        .shared
        .dev
        .create_cq(cqe, vector)
        .map_err(|e| errno_of(&e))?;
    let cqn = cq.cqn();
    let boxed = Box::new(Cq {
        ibv: cq_ex::with_poll_ops(ibv_cq_ex {
            context,
            channel,
            cq_context,
            handle: cqn,
            cqe: c_int_of(cq.depth()),
            ..Default::default()
        }),
        inner: Some(cq),
        channel: state.clone(),
        events: EventCount::default(),
        empty_polls: Default::default(),
        current: Default::default(),
    });
    let raw = boxed.into_raw();
    if !channel.is_null() {
        // SAFETY: a live channel (checked by channel_state); its
        // refcnt field mirrors the CQs using it.
        unsafe { (*channel).refcnt += 1 };
    }
    events::add_cq(&ctx.shared, cqn, raw, state);
    Ok(raw)
}

/// `ibv_resize_cq`: not supported.
///
/// # Safety
///
/// Any arguments.
pub unsafe extern "C" fn ibv_resize_cq(_cq: *mut ibv_cq, _cqe: c_int) -> c_int {
    int_verb("ibv_resize_cq", || Err(unsupported("ibv_resize_cq")))
}

/// `ibv_destroy_cq`: `EBUSY` while QPs use it; waits until the completion
/// events the application got are acknowledged (as rdma-core does).
///
/// # Safety
///
/// `cq` is a live CQ not used by another thread.
pub unsafe extern "C" fn ibv_destroy_cq(cq: *mut ibv_cq) -> c_int {
    int_verb("ibv_destroy_cq", || {
        // SAFETY: the caller passes a live CQ it no longer uses elsewhere.
        let this = unsafe { Cq::from_raw_mut(cq)? };
        let ctx = ctx_of(this.ibv.context)?;
        let cqn = this.inner.as_ref().ok_or(libc::EINVAL)?.cqn();
        destroy_inner(&mut this.inner, CompletionQueue::destroy)?;
        events::remove_cq(&ctx.shared, cqn, cq);
        this.events.wait_all_acked();
        if !this.ibv.channel.is_null() {
            // SAFETY: the channel outlives its CQs (destroying it is EBUSY
            // while they hold its state).
            unsafe { (*this.ibv.channel).refcnt -= 1 };
        }
        // SAFETY: the CQ box is no longer referenced (its routes are gone).
        unsafe { Cq::free(cq) };
        Ok(())
    })
}

/// The GRH's flow label field: 20 bits.
const FLOW_LABEL_MASK: u32 = 0x000f_ffff;

/// The wire form of `struct ibv_ah_attr`. The flow label keeps its 20
/// bits, as a provider writes it into the address vector (mlx5's
/// `flow_label & 0xfffff`; the kernel passes any `u32`): UCX leaves
/// `0xffffffff` ("no preference") there, and the device takes only a
/// 20-bit label.
pub(crate) fn ah_to_wire(a: &ibv_ah_attr) -> AhAttr {
    // SAFETY: both members of `union ibv_gid` are plain bytes/integers.
    let dgid = unsafe { a.grh.dgid.raw };
    AhAttr {
        dgid,
        flow_label: (a.grh.flow_label & FLOW_LABEL_MASK).into(),
        dlid: a.dlid.into(),
        sgid_index: a.grh.sgid_index,
        hop_limit: a.grh.hop_limit,
        traffic_class: a.grh.traffic_class,
        is_global: a.is_global,
        sl: a.sl,
        src_path_bits: a.src_path_bits,
        static_rate: a.static_rate,
        port_num: a.port_num,
        reserved: [0; 10],
    }
}

pub(crate) fn ah_from_wire(a: &AhAttr) -> ibv_ah_attr {
    ibv_ah_attr {
        grh: ibv_global_route {
            dgid: ibv_gid { raw: a.dgid },
            flow_label: a.flow_label.get(),
            sgid_index: a.sgid_index,
            hop_limit: a.hop_limit,
            traffic_class: a.traffic_class,
        },
        dlid: a.dlid.get(),
        sl: a.sl,
        src_path_bits: a.src_path_bits,
        static_rate: a.static_rate,
        is_global: a.is_global,
        port_num: a.port_num,
    }
}

/// `$ty` (`struct ibv_qp_cap` or [`QpCapabilities`]) with the capacities
/// of `$c`, the other one: the two have the same `u32` fields.
macro_rules! qp_cap {
    ($ty:ident, $c:expr) => {{
        let c = $c;
        $ty {
            max_send_wr: c.max_send_wr,
            max_recv_wr: c.max_recv_wr,
            max_send_sge: c.max_send_sge,
            max_recv_sge: c.max_recv_sge,
            max_inline_data: c.max_inline_data,
        }
    }};
}

fn u8_of(v: u32) -> VResult<u8> {
    u8::try_from(v).map_err(|_| libc::EINVAL)
}

/// `$ty` (`struct ibv_qp_attr` or [`QpAttr`]) with the fields given and
/// the attributes both hold as the same `u8` copied from `$a`, the other
/// one; the rest default (reserved bytes zero).
macro_rules! qp_attr {
    ($ty:ident from $a:ident { $($field:ident: $value:expr,)* }) => {
        $ty {
            $($field: $value,)*
            en_sqd_async_notify: $a.en_sqd_async_notify,
            sq_draining: $a.sq_draining,
            max_rd_atomic: $a.max_rd_atomic,
            max_dest_rd_atomic: $a.max_dest_rd_atomic,
            min_rnr_timer: $a.min_rnr_timer,
            port_num: $a.port_num,
            timeout: $a.timeout,
            retry_cnt: $a.retry_cnt,
            rnr_retry: $a.rnr_retry,
            ..Default::default()
        }
    };
}

/// The wire form of `struct ibv_qp_attr` (every field; the mask says which
/// ones the device applies).
pub(crate) fn qp_attr_to_wire(a: &ibv_qp_attr) -> VResult<QpAttr> {
    Ok(qp_attr!(QpAttr from a {
        qp_state: u8_of(a.qp_state)?,
        cur_qp_state: u8_of(a.cur_qp_state)?,
        path_mtu: u8_of(a.path_mtu)?,
        path_mig_state: u8_of(a.path_mig_state)?,
        qkey: a.qkey.into(),
        rq_psn: a.rq_psn.into(),
        sq_psn: a.sq_psn.into(),
        dest_qp_num: a.dest_qp_num.into(),
        // LOCAL_WRITE means nothing on a QP; programs pass it and every
        // provider ignores it (the device accepts only the REMOTE_* bits).
        qp_access_flags: (a.qp_access_flags & !IBV_ACCESS_LOCAL_WRITE).into(),
        cap: QpCap::from(qp_cap!(QpCapabilities, a.cap)),
        ah_attr: ah_to_wire(&a.ah_attr),
        pkey_index: a.pkey_index.into(),
    }))
}

/// `struct ibv_qp_attr` from the device's stored attributes.
pub(crate) fn qp_attr_from_wire(a: &QpAttr) -> ibv_qp_attr {
    qp_attr!(ibv_qp_attr from a {
        qp_state: u32::from(a.qp_state),
        cur_qp_state: u32::from(a.cur_qp_state),
        path_mtu: u32::from(a.path_mtu),
        path_mig_state: u32::from(a.path_mig_state),
        qkey: a.qkey.get(),
        rq_psn: a.rq_psn.get(),
        sq_psn: a.sq_psn.get(),
        dest_qp_num: a.dest_qp_num.get(),
        qp_access_flags: a.qp_access_flags.get(),
        cap: qp_cap!(ibv_qp_cap, QpCapabilities::from(a.cap)),
        ah_attr: ah_from_wire(&a.ah_attr),
        pkey_index: a.pkey_index.get(),
    })
}

/// `ibv_create_qp`: RC only (UC/UD are refused by the device with
/// `EOPNOTSUPP`, other types here), with its own receive queue or an SRQ. The granted capacities are
/// written back into `qp_init_attr->cap`.
///
/// # Safety
///
/// `pd` is a live PD; `qp_init_attr` is a valid, writable init structure
/// whose CQs are live.
pub unsafe extern "C" fn ibv_create_qp(
    pd: *mut ibv_pd,
    qp_init_attr: *mut ibv_qp_init_attr,
) -> *mut ibv_qp {
    ptr_verb("ibv_create_qp", || {
        non_null(qp_init_attr)?;
        // SAFETY: the caller passes a valid init structure.
        let init = unsafe { &mut *qp_init_attr };
        create_qp(pd, init, None)
    })
}

/// Creates a QP (`ibv_create_qp`, `ibv_create_qp_ex`); `send_ops` (the
/// `send_ops_flags` of `ibv_create_qp_ex`, already checked) gives it the
/// `ibv_wr_*` interface (see `qp_ex`).
pub(crate) fn create_qp(
    pd: *mut ibv_pd,
    init: &mut ibv_qp_init_attr,
    send_ops: Option<u64>,
) -> VResult<*mut ibv_qp> {
    let our = pd_of(pd)?;
    let ctx = ctx_of(our.ibv.context)?;
    let srq = if init.srq.is_null() {
        None
    } else {
        // SAFETY: a non-null SRQ of the init structure is live.
        let s = unsafe { Srq::from_raw(init.srq)? };
        Some(s.inner.as_ref().ok_or(libc::EINVAL)?)
    };
    let qp_type = match init.qp_type {
        IBV_QPT_RC => QpType::Rc,
        IBV_QPT_UC => QpType::Uc,
        IBV_QPT_UD => QpType::Ud,
        _ => return Err(unsupported("QP types other than RC")),
    };
    let cq_of = |cq: *mut ibv_cq| {
        // SAFETY: the caller's CQs are live.
        unsafe { Cq::from_raw(cq) }.and_then(|c| c.inner.as_ref().ok_or(libc::EINVAL))
    };
    let qp = our
        .inner
        .as_ref()
        .ok_or(libc::EINVAL)?
        .create_qp(&QpInitAttr {
            send_cq: cq_of(init.send_cq)?,
            recv_cq: cq_of(init.recv_cq)?,
            cap: qp_cap!(QpCapabilities, init.cap),
            qp_type,
            sq_sig_all: init.sq_sig_all != 0,
            srq,
        })
        .map_err(|e| errno_of(&e))?;
    init.cap = qp_cap!(ibv_qp_cap, qp.cap());
    let qpn = qp.qp_num();
    let ibv = ibv_qp_ex {
        qp_base: ibv_qp {
            context: our.ibv.context,
            qp_context: init.qp_context,
            pd,
            send_cq: init.send_cq,
            recv_cq: init.recv_cq,
            srq: init.srq,
            handle: qpn,
            qp_num: qpn,
            state: IBV_QPS_RESET,
            qp_type: init.qp_type,
            ..Default::default()
        },
        ..Default::default()
    };
    let (ibv, wr) = match send_ops {
        Some(ops) => (qp_ex::with_wr_ops(ibv), Some(WrPosting::new(ops))),
        None => (ibv, None),
    };
    let raw = Box::new(Qp {
        ibv,
        inner: Some(qp),
        wr,
    })
    .into_raw();
    ctx.shared
        .qps
        .write()
        .unwrap_or_else(|e| e.into_inner())
        .insert(
            qpn,
            QpRoute {
                qp: raw as usize,
                dlid: 0,
                sl: 0,
            },
        );
    Ok(raw)
}

/// `ibv_modify_qp`.
///
/// # Safety
///
/// `qp` is a live QP; `attr` is a valid attribute structure.
pub unsafe extern "C" fn ibv_modify_qp(
    qp: *mut ibv_qp,
    attr: *mut ibv_qp_attr,
    attr_mask: c_int,
) -> c_int {
    int_verb("ibv_modify_qp", || {
        non_null(attr)?;
        // SAFETY: the caller passes a live QP and a valid attribute structure.
        let (our, attr) = unsafe { (Qp::from_raw(qp)?, &*attr) };
        let mask = attr_mask as u32;
        let wire = qp_attr_to_wire(attr)?;
        our.inner
            .as_ref()
            .ok_or(libc::EINVAL)?
            .modify(&wire, mask)
            .map_err(|e| errno_of(&e))?;
        let state = (mask & mask::STATE != 0).then_some(attr.qp_state);
        let av = (mask & mask::AV != 0).then_some(&attr.ah_attr);
        // SAFETY: the caller's live QP.
        unsafe { note_modified(qp, state, av) }
    })
}

/// What the library keeps of a QP after the device moved it (by
/// MODIFY_QP, or CM_MOVE_QP for rdma_cm): its `state` field (rdma-core
/// keeps it current) and, with a new AV, the route its LID-addressed
/// sends take.
///
/// # Safety
///
/// `qp` is a live QP of this library.
pub(crate) unsafe fn note_modified(
    qp: *mut ibv_qp,
    state: Option<u32>,
    av: Option<&crate::abi::ibv_ah_attr>,
) -> VResult<()> {
    // SAFETY: the caller's live QP.
    let our = unsafe { Qp::from_raw(qp)? };
    if let Some(state) = state {
        // SAFETY: a field of the live QP.
        unsafe { (*qp).state = state };
    }
    if let Some(av) = av {
        let ctx = ctx_of(our.ibv.qp_base.context)?;
        let mut qps = ctx.shared.qps.write().unwrap_or_else(|e| e.into_inner());
        if let Some(route) = qps.get_mut(&our.ibv.qp_base.qp_num) {
            route.dlid = av.dlid;
            route.sl = av.sl;
        }
    }
    Ok(())
}

/// `ibv_query_qp`: every attribute (whatever the mask) and the creation
/// attributes.
///
/// # Safety
///
/// `qp` is a live QP; `attr` and `init_attr` are writable.
pub unsafe extern "C" fn ibv_query_qp(
    qp: *mut ibv_qp,
    attr: *mut ibv_qp_attr,
    attr_mask: c_int,
    init_attr: *mut ibv_qp_init_attr,
) -> c_int {
    int_verb("ibv_query_qp", || {
        non_null(attr)?;
        non_null(init_attr)?;
        // SAFETY: the caller passes a live QP.
        let our = unsafe { Qp::from_raw(qp)? };
        let resp: QueryQpResp = our
            .inner
            .as_ref()
            .ok_or(libc::EINVAL)?
            .query(attr_mask as u32)
            .map_err(|e| errno_of(&e))?;
        let out = qp_attr_from_wire(&resp.attr);
        let init = ibv_qp_init_attr {
            qp_context: our.ibv.qp_base.qp_context,
            send_cq: our.ibv.qp_base.send_cq,
            recv_cq: our.ibv.qp_base.recv_cq,
            srq: our.ibv.qp_base.srq,
            cap: out.cap,
            qp_type: u32::from(resp.qp_type),
            sq_sig_all: c_int::from(resp.sq_sig_all),
        };
        // SAFETY: the caller passes writable structures; `state` is a field
        // of the live QP.
        unsafe {
            *attr = out;
            *init_attr = init;
            (*qp).state = out.qp_state;
        }
        Ok(())
    })
}

/// `ibv_destroy_qp`.
///
/// # Safety
///
/// `qp` is a live QP not used by another thread.
pub unsafe extern "C" fn ibv_destroy_qp(qp: *mut ibv_qp) -> c_int {
    int_verb("ibv_destroy_qp", || {
        // SAFETY: the caller passes a live QP it no longer uses elsewhere.
        let this = unsafe { Qp::from_raw_mut(qp)? };
        let ctx = ctx_of(this.ibv.qp_base.context)?;
        // A batch of ibv_wr_* left open borrows the queue pair: dropped
        // unposted first.
        if let Some(wr) = &this.wr {
            wr.abandon();
        }
        destroy_inner(&mut this.inner, QueuePair::destroy)?;
        // Its route is kept under the number `ibv_qp` shows (as
        // `ibv_modify_qp` finds it).
        ctx.shared
            .qps
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&this.ibv.qp_base.qp_num);
        events::remove_qp(&ctx.shared, qp);
        // SAFETY: the QP box is no longer referenced.
        unsafe { Qp::free(qp) };
        Ok(())
    })
}

/// `ibv_create_ah`: a device object (the device checks the path as
/// `modify_qp` checks one — the port is RoCE, so it needs a GRH naming GID
/// index 0 as its source: `EINVAL` otherwise, as the kernel answers for a
/// RoCE port — and hostd checks the tenant may reach the destination:
/// `EACCES`, or `ENOENT` for an unknown GID), within the tenant's
/// `max_ah` (`ENOMEM`).
///
/// # Safety
///
/// `pd` is a live PD; `attr` is a valid attribute structure.
pub unsafe extern "C" fn ibv_create_ah(pd: *mut ibv_pd, attr: *mut ibv_ah_attr) -> *mut ibv_ah {
    ptr_verb("ibv_create_ah", || {
        non_null(attr)?;
        let our = pd_of(pd)?;
        // SAFETY: the caller passes a valid attribute structure.
        let attr = unsafe { *attr };
        let ah = our
            .inner
            .as_ref()
            .ok_or(libc::EINVAL)?
            .create_ah(&ah_to_wire(&attr))
            .map_err(|e| errno_of(&e))?;
        Ok(Box::new(Ah {
            ibv: ibv_ah {
                context: our.ibv.context,
                pd,
                handle: ah.ahn(),
            },
            attr,
            inner: Some(ah),
        })
        .into_raw())
    })
}

/// `ibv_destroy_ah`.
///
/// # Safety
///
/// `ah` is a live address handle not used by another thread.
pub unsafe extern "C" fn ibv_destroy_ah(ah: *mut ibv_ah) -> c_int {
    int_verb("ibv_destroy_ah", || {
        // SAFETY: the caller passes a live AH it no longer uses elsewhere.
        let this = unsafe { Ah::from_raw_mut(ah)? };
        destroy_inner(&mut this.inner, AddressHandle::destroy)?;
        // SAFETY: the AH box is no longer referenced.
        unsafe { Ah::free(ah) };
        Ok(())
    })
}

/// `ibv_init_ah_from_wc`: the path back to a completion's sender. With
/// `IBV_WC_GRH` the GRH at the start of the receive buffer names it: on
/// RoCEv2 over IPv4 (what vrdma writes, as rxe does) the IPv4 header in its
/// last 20 bytes, whose source address is the sender's IPv4-mapped GID; a
/// GRH of IB/RoCEv2-IPv6 form names it by its SGID. Hop limit 0xff, as
/// rdma-core sets it. Without a GRH the path has only the sender's LID.
///
/// # Safety
///
/// `wc` is a valid completion; `grh` points to 40 readable bytes when the
/// completion has `IBV_WC_GRH`; `ah_attr` is writable.
pub unsafe extern "C" fn ibv_init_ah_from_wc(
    context: *mut ibv_context,
    port_num: u8,
    wc: *mut ibv_wc,
    grh: *mut ibv_grh,
    ah_attr: *mut ibv_ah_attr,
) -> c_int {
    crate::ffi::minus_one_verb("ibv_init_ah_from_wc", || {
        ctx_of(context)?;
        non_null(wc)?;
        non_null(ah_attr)?;
        // SAFETY: the caller passes a valid completion.
        let wc = unsafe { &*wc };
        let mut out = ibv_ah_attr {
            dlid: wc.slid,
            sl: wc.sl,
            src_path_bits: wc.dlid_path_bits,
            port_num,
            ..Default::default()
        };
        if wc.wc_flags & IBV_WC_GRH != 0 {
            non_null(grh)?;
            // SAFETY: the caller's promise: 40 readable bytes.
            let raw: [u8; 40] = unsafe { std::ptr::read_unaligned(grh.cast()) };
            out.is_global = 1;
            out.grh = ibv_global_route {
                dgid: ibv_gid {
                    raw: sender_gid(&raw),
                },
                flow_label: 0,
                sgid_index: 0,
                hop_limit: 0xff,
                traffic_class: 0,
            };
        }
        // SAFETY: the caller passes a writable attribute structure.
        unsafe { *ah_attr = out };
        Ok(())
    })
}

/// The sender's GID in a received GRH: the IPv4-mapped source address of
/// a RoCEv2-IPv4 header (bytes 20–39: version 4, IHL 5), else the GRH's
/// SGID (bytes 8–23).
fn sender_gid(grh: &[u8; 40]) -> [u8; 16] {
    if grh[20] == 0x45 {
        let mut ip = [0u8; 4];
        ip.copy_from_slice(&grh[32..36]);
        return vrdma_guest_driver::vrdma_spec::gid::ipv4_mapped(ip);
    }
    let mut gid = [0u8; 16];
    gid.copy_from_slice(&grh[8..24]);
    gid
}

/// `ibv_create_ah_from_wc`.
///
/// # Safety
///
/// As for [`ibv_init_ah_from_wc`] and [`ibv_create_ah`].
pub unsafe extern "C" fn ibv_create_ah_from_wc(
    pd: *mut ibv_pd,
    wc: *mut ibv_wc,
    grh: *mut ibv_grh,
    port_num: u8,
) -> *mut ibv_ah {
    ptr_verb("ibv_create_ah_from_wc", || {
        let our = pd_of(pd)?;
        let mut attr = ibv_ah_attr::default();
        // SAFETY: forwarded.
        if unsafe { ibv_init_ah_from_wc(our.ibv.context, port_num, wc, grh, &mut attr) } != 0 {
            // SAFETY: reading this thread's errno, set by the call above.
            return Err(unsafe { *libc::__errno_location() });
        }
        // SAFETY: forwarded, with a valid attribute structure.
        let ah = unsafe { ibv_create_ah(pd, &mut attr) };
        if ah.is_null() {
            // SAFETY: as above.
            return Err(unsafe { *libc::__errno_location() });
        }
        Ok(ah)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::abi::{IBV_MTU_4096, IBV_QPS_RTR};
    use std::mem::{offset_of, size_of};

    /// The measured facts of `ibverbs-abi.md` for the objects.
    #[test]
    fn object_layouts_match_rdma_core() {
        assert_eq!(offset_of!(ibv_cq, context), 0);
        assert_eq!(offset_of!(ibv_qp, context), 0);
        assert_eq!(offset_of!(crate::abi::ibv_srq, context), 0);
        assert_eq!(offset_of!(ibv_qp, qp_num), 52);
        assert_eq!(size_of::<ibv_mr>(), 48);
        assert_eq!(offset_of!(ibv_mr, lkey), 36);
        assert_eq!(offset_of!(ibv_mr, rkey), 40);
        assert_eq!(size_of::<ibv_wc>(), 48);
        assert_eq!(size_of::<crate::abi::ibv_send_wr>(), 128);
        assert_eq!(size_of::<crate::abi::ibv_recv_wr>(), 32);
        assert_eq!(size_of::<crate::abi::ibv_device>(), 664);
    }

    #[test]
    fn qp_attributes_round_trip() {
        let mut a = ibv_qp_attr {
            qp_state: IBV_QPS_RTR,
            path_mtu: IBV_MTU_4096,
            rq_psn: 0x12_3456,
            dest_qp_num: 0xab_cdef,
            qp_access_flags: 0xf,
            max_dest_rd_atomic: 16,
            min_rnr_timer: 12,
            port_num: 1,
            ..Default::default()
        };
        a.ah_attr.dlid = 17;
        a.ah_attr.sl = 2;
        a.ah_attr.port_num = 1;
        a.ah_attr.is_global = 1;
        a.ah_attr.grh.dgid = ibv_gid { raw: [7; 16] };
        a.ah_attr.grh.hop_limit = 64;
        a.cap.max_inline_data = 256;
        let wire = qp_attr_to_wire(&a).unwrap();
        assert_eq!(wire.qp_state, 2);
        assert_eq!(wire.path_mtu, 5);
        assert_eq!(wire.rq_psn.get(), 0x12_3456);
        assert_eq!(wire.qp_access_flags.get(), 0xe, "LOCAL_WRITE dropped");
        assert_eq!(wire.ah_attr.dlid.get(), 17);
        assert_eq!(wire.ah_attr.dgid, [7; 16]);
        assert_eq!(wire.cap.max_inline_data.get(), 256);
        let back = qp_attr_from_wire(&wire);
        assert_eq!(back.qp_state, IBV_QPS_RTR);
        assert_eq!((back.rq_psn, back.dest_qp_num), (0x12_3456, 0xab_cdef));
        assert_eq!((back.ah_attr.dlid, back.ah_attr.sl), (17, 2));
        // SAFETY: reading the bytes of a GID union.
        assert_eq!(unsafe { back.ah_attr.grh.dgid.raw }, [7; 16]);
        assert_eq!(back.ah_attr.grh.hop_limit, 64);
        assert_eq!((back.max_dest_rd_atomic, back.min_rnr_timer), (16, 12));
        a.qp_state = 300;
        assert_eq!(qp_attr_to_wire(&a).err(), Some(libc::EINVAL));
    }

    #[test]
    fn the_flow_label_keeps_its_20_bits_as_a_provider_writes_it() {
        let mut a = ibv_ah_attr::default();
        // UCX leaves all ones there; the GRH's field has 20 bits.
        a.grh.flow_label = u32::MAX;
        assert_eq!(ah_to_wire(&a).flow_label.get(), 0xf_ffff);
        a.grh.flow_label = 0x1_2345;
        assert_eq!(ah_to_wire(&a).flow_label.get(), 0x1_2345);
        a.grh.flow_label = 0x10_0001;
        assert_eq!(ah_to_wire(&a).flow_label.get(), 1);
    }
}
