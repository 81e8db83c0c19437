//! The data path: the functions the inline `ibv_post_send`, `ibv_post_recv`,
//! `ibv_poll_cq` and `ibv_req_notify_cq` call through `context->ops`,
//! translating libibverbs' structures to the guest driver's work requests
//! and completions, and `ibv_post_srq_recv` on an SRQ's ring.
//!
//! - `ibv_send_wr`/`ibv_recv_wr` lists are posted in order; at the first
//!   work request that fails, `*bad_wr` names it and its errno is returned
//!   (those before it are posted, as with a hardware provider).
//! - A list is posted as one batch: its WQEs are published and the
//!   doorbell rung once, however many it holds.
//! - A QP posts receives from INIT on and sends from RTS on (IBA
//!   C10-97.2.1, as Linux rxe checks): before that the first work request
//!   fails with `EINVAL` (the state is the one `ibv_modify_qp` last set).
//! - `IBV_SEND_INLINE`: the SGEs name the application's own buffers (no
//!   lkey); their bytes are gathered and copied into the WQE.
//! - Nothing is allocated: SGE lists and inline data are translated in
//!   buffers on the stack, sized by the format's limits (`MAX_SGE`,
//!   `MAX_INLINE_DATA`); a longer list is `EINVAL`, as the device could
//!   not carry it.
//! - `wr.rdma` / `wr.atomic` are read according to the opcode; immediate
//!   data is already big-endian and passes through byte for byte.
//! - Completions fill every field of `ibv_wc`; `slid`/`sl` of a receive
//!   completion come from the QP's path (RC: the peer it is connected to),
//!   except a UD receive's `sl`, which says the packet's header type
//!   ([`UD_ROCE_V2_IPV4_SL`]).
//! - An application that busy-polls an empty CQ yields its core every
//!   `VRDMA_POLL_YIELD` empty polls (default 1; 0 never yields): the device
//!   (vdev, hostd) runs on the same cores, and on a small host a poller
//!   that never yields starves it for whole scheduler time slices.

use std::ffi::c_int;
use std::sync::atomic::Ordering;

use vrdma_guest_driver::vrdma_spec::limits::{MAX_INLINE_DATA, MAX_SGE};
use vrdma_guest_driver::vrdma_spec::ring::{send_flags, wc_flags};
use vrdma_guest_driver::vrdma_spec::verbs::{SendOpcode, WcOpcode};
use vrdma_guest_driver::{
    QueuePair, RecvBatch, RecvWr, SendBatch, SendPayload, SendWr, Sge, SharedReceiveQueue, UdDest,
    WorkCompletion,
};

use crate::abi::{
    ibv_cq, ibv_qp, ibv_qp_state, ibv_recv_wr, ibv_send_wr, ibv_sge, ibv_srq, ibv_wc,
    ibv_wc__bindgen_ty_1, IBV_QPS_INIT, IBV_QPS_RTS, IBV_QPT_UD, IBV_SEND_INLINE,
};
use crate::context::Ctx;
use crate::ffi::{errno_of, guard, VResult};
use crate::objects::{Ah, Cq, Qp, Srq, Wrapper};

/// Most SGEs of one work request: what the WQE format carries.
pub(crate) const MAX_SGES: usize = MAX_SGE as usize;
/// Most inline bytes of one send: what the WQE format carries.
pub(crate) const MAX_INLINE: usize = MAX_INLINE_DATA as usize;
/// Completions translated per guest-driver poll.
const POLL_BATCH: usize = 32;
/// The variable that sets how many empty polls in a row yield the core.
pub const POLL_YIELD_VAR: &str = "VRDMA_POLL_YIELD";

/// Empty polls in a row after which `poll_cq` yields (0: never).
fn yield_every() -> u32 {
    static EVERY: std::sync::OnceLock<u32> = std::sync::OnceLock::new();
    *EVERY.get_or_init(|| {
        std::env::var(POLL_YIELD_VAR)
            .ok()
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(1)
    })
}

/// Counts an empty poll of `cq` and yields the core every
/// [`yield_every`] of them in a row.
pub(crate) fn empty_poll(cq: &Cq) {
    let every = yield_every();
    if every == 0 {
        return;
    }
    let n = cq
        .empty_polls
        .fetch_add(1, Ordering::Relaxed)
        .wrapping_add(1);
    if n.is_multiple_of(every) {
        std::thread::yield_now();
    }
}

fn to_sge(s: &ibv_sge) -> Sge {
    Sge {
        addr: s.addr,
        length: s.length,
        lkey: s.lkey,
    }
}

/// The application's SGE array.
///
/// # Safety
///
/// `sg_list` points to `num_sge` SGEs when `num_sge > 0`.
unsafe fn sge_slice<'a>(sg_list: *const ibv_sge, num_sge: c_int) -> VResult<&'a [ibv_sge]> {
    let n = usize::try_from(num_sge).map_err(|_| libc::EINVAL)?;
    if n == 0 {
        return Ok(&[]);
    }
    if sg_list.is_null() {
        return Err(libc::EINVAL);
    }
    // SAFETY: the caller's promise (the verbs contract for sg_list).
    Ok(unsafe { std::slice::from_raw_parts(sg_list, n) })
}

/// Translates `list` into `out`; `EINVAL` beyond [`MAX_SGES`].
pub(crate) fn convert_sges<'a>(
    list: &[ibv_sge],
    out: &'a mut [Sge; MAX_SGES],
) -> VResult<&'a [Sge]> {
    let sges = out.get_mut(..list.len()).ok_or(libc::EINVAL)?;
    for (d, s) in sges.iter_mut().zip(list) {
        *d = to_sge(s);
    }
    Ok(sges)
}

/// Gathers the bytes of an inline send: `(address, length)` parts (an
/// `ibv_send_wr`'s SGEs, `ibv_wr_set_inline_data(_list)`'s buffers).
///
/// # Safety
///
/// Each part names `length` readable bytes at the virtual address
/// `address` (the verbs contract for inline data).
pub(crate) unsafe fn gather_inline(
    parts: impl IntoIterator<Item = (u64, usize)>,
    buf: &mut [u8; MAX_INLINE],
) -> VResult<&[u8]> {
    let mut n = 0usize;
    for (addr, len) in parts {
        let end = n
            .checked_add(len)
            .filter(|&e| e <= MAX_INLINE)
            .ok_or(libc::EINVAL)?;
        if len > 0 {
            if addr == 0 {
                return Err(libc::EINVAL);
            }
            // SAFETY: the caller's promise; the destination range is inside
            // `buf` (checked above) and cannot overlap the application's.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    addr as usize as *const u8,
                    buf[n..end].as_mut_ptr(),
                    len,
                );
            }
        }
        n = end;
    }
    Ok(&buf[..n])
}

/// Where the payload of one translated send work request lives: on the
/// stack of the posting call, reused for each request of its list.
struct SendStorage {
    sges: [Sge; MAX_SGES],
    inline: [u8; MAX_INLINE],
}

impl SendStorage {
    fn new() -> Self {
        Self {
            sges: [Sge::default(); MAX_SGES],
            inline: [0; MAX_INLINE],
        }
    }
}

/// The WQE flags of libibverbs' `send_flags` (`ibv_send_wr`, `ibv_qp_ex`'s
/// `wr_flags`): FENCE, SIGNALED and SOLICITED have the same bits on the
/// wire; INLINE is carried by the payload, IP_CSUM means nothing to RC.
pub(crate) fn wire_send_flags(send_flags: u32) -> u8 {
    let known = send_flags::FENCE | send_flags::SIGNALED | send_flags::SOLICITED;
    (send_flags & u32::from(known)) as u8
}

/// Translates one `ibv_send_wr` (its `next` is not followed).
///
/// # Safety
///
/// `w` follows the verbs contract: `sg_list` holds `num_sge` SGEs and, for
/// inline sends, they point to readable memory.
unsafe fn translate_send<'a>(
    w: &ibv_send_wr,
    storage: &'a mut SendStorage,
    ud: bool,
) -> VResult<SendWr<'a>> {
    let opcode = u8::try_from(w.opcode)
        .ok()
        .and_then(|o| SendOpcode::try_from(o).ok())
        .ok_or(libc::EINVAL)?;
    // SAFETY: the caller's promise about sg_list.
    let list = unsafe { sge_slice(w.sg_list, w.num_sge)? };
    let payload = if w.send_flags & IBV_SEND_INLINE != 0 {
        let parts = list.iter().map(|s| (s.addr, s.length as usize));
        // SAFETY: the caller's promise about inline buffers.
        let data = unsafe { gather_inline(parts, &mut storage.inline)? };
        SendPayload::Inline(data)
    } else {
        SendPayload::Sges(convert_sges(list, &mut storage.sges)?)
    };
    let mut wr = SendWr::new(w.wr_id, opcode, payload);
    wr.flags = wire_send_flags(w.send_flags);
    // SAFETY: every variant of these unions is plain integers, so reading
    // any of them is defined; the opcode says which one the application set.
    unsafe {
        wr.imm_data = w.__bindgen_anon_1.imm_data.to_ne_bytes();
        match opcode {
            SendOpcode::RdmaWrite | SendOpcode::RdmaWriteWithImm | SendOpcode::RdmaRead => {
                wr.remote_addr = w.wr.rdma.remote_addr;
                wr.rkey = w.wr.rdma.rkey;
            }
            SendOpcode::AtomicCmpAndSwp | SendOpcode::AtomicFetchAndAdd => {
                wr.remote_addr = w.wr.atomic.remote_addr;
                wr.rkey = w.wr.atomic.rkey;
                wr.compare_add = w.wr.atomic.compare_add;
                wr.swap = w.wr.atomic.swap;
            }
            _ => {}
        }
    }
    if ud {
        // SAFETY: `wr.ud` is plain data (a pointer and integers); on a UD
        // QP the application set it and its AH is live (the verbs
        // contract); NULL is refused.
        let (ah, remote_qpn, remote_qkey) = unsafe {
            (
                Ah::from_raw(w.wr.ud.ah)?,
                w.wr.ud.remote_qpn,
                w.wr.ud.remote_qkey,
            )
        };
        let dest = UdDest {
            ah: ah.inner.as_ref().ok_or(libc::EINVAL)?.ahn(),
            remote_qpn,
            remote_qkey,
        };
        return Ok(wr.to_ud(dest));
    }
    Ok(wr)
}

/// A work-request list element: `ibv_send_wr` or `ibv_recv_wr`.
trait WorkRequest {
    /// The next element, or NULL.
    fn next(&self) -> *mut Self;
}

impl WorkRequest for ibv_send_wr {
    fn next(&self) -> *mut Self {
        self.next
    }
}

impl WorkRequest for ibv_recv_wr {
    fn next(&self) -> *mut Self {
        self.next
    }
}

/// Posts the application's list `wr` on one of `qp`'s queues as one batch:
/// `open` starts the batch (published and rung once, when it goes out of
/// scope) and `push` translates one work request into it. At the first
/// work request that fails, `*bad_wr` names it and its errno is returned.
///
/// # Safety
///
/// `qp` is a live QP, `wr` a well-formed work request list and `bad_wr`
/// NULL or writable.
unsafe fn post_list<'q, W: WorkRequest, B>(
    verb: &'static str,
    qp: *mut ibv_qp,
    least: ibv_qp_state,
    wr: *mut W,
    bad_wr: *mut *mut W,
    open: impl FnOnce(&'q QueuePair) -> B,
    push: impl FnMut(&mut B, &W) -> VResult<()>,
) -> c_int {
    // SAFETY: the caller passes a live QP.
    let qp = unsafe { Qp::from_raw(qp) }
        .and_then(|q| q.inner.as_ref().ok_or(libc::EINVAL))
        // SAFETY: `from_raw` accepted `qp`: a live QP of this library.
        .and_then(|inner| ready(unsafe { &*qp }, least).map(|()| inner));
    // SAFETY: the caller's promise.
    unsafe { post_on(verb, qp, wr, bad_wr, open, push) }
}

/// `Ok` when `qp`'s queue may be posted on: its state (the one
/// `ibv_modify_qp` last set) is `least` or beyond (SQD, SQE and ERR are
/// beyond RTS: work posted in ERR completes flushed). `EINVAL` otherwise.
pub(crate) fn ready(qp: &ibv_qp, least: ibv_qp_state) -> VResult<()> {
    if qp.state >= least {
        Ok(())
    } else {
        Err(libc::EINVAL)
    }
}

/// [`post_list`] on an object already resolved (a QP's queue or an SRQ),
/// or its errno.
///
/// # Safety
///
/// `wr` is a well-formed work request list and `bad_wr` NULL or writable.
unsafe fn post_on<'q, O, W: WorkRequest, B>(
    verb: &'static str,
    object: VResult<&'q O>,
    wr: *mut W,
    bad_wr: *mut *mut W,
    open: impl FnOnce(&'q O) -> B,
    mut push: impl FnMut(&mut B, &W) -> VResult<()>,
) -> c_int {
    guard(verb, libc::EIO, || {
        let object = match object {
            Ok(o) => o,
            Err(errno) => return fail_at(bad_wr, wr, errno),
        };
        let mut batch = open(object);
        let mut cur = wr;
        while !cur.is_null() {
            // SAFETY: a non-null element of the application's list.
            let w = unsafe { &*cur };
            if let Err(errno) = push(&mut batch, w) {
                return fail_at(bad_wr, cur, errno);
            }
            cur = w.next();
        }
        0
    })
}

/// Names `at` in the application's `*bad_wr` (when given) and returns
/// `errno`.
pub(crate) fn fail_at<T>(bad_wr: *mut *mut T, at: *mut T, errno: c_int) -> c_int {
    if !bad_wr.is_null() {
        // SAFETY: a non-null bad_wr is writable (the verbs contract).
        unsafe { *bad_wr = at };
    }
    errno
}

/// `ops.post_send`.
///
/// # Safety
///
/// Called by the inline `ibv_post_send` with a live QP, a well-formed work
/// request list and a writable `bad_wr`.
pub(crate) unsafe extern "C" fn post_send(
    qp: *mut ibv_qp,
    wr: *mut ibv_send_wr,
    bad_wr: *mut *mut ibv_send_wr,
) -> c_int {
    let mut storage = SendStorage::new();
    // SAFETY: the caller passes a live QP (NULL: not UD, and refused below).
    let ud = !qp.is_null() && unsafe { (*qp).qp_type } == IBV_QPT_UD;
    let push = |batch: &mut SendBatch<'_>, w: &ibv_send_wr| {
        // SAFETY: the verbs contract for the work request's buffers.
        let t = unsafe { translate_send(w, &mut storage, ud) }?;
        batch.push(&t).map_err(|e| e.errno())
    };
    // SAFETY: the caller's promise.
    unsafe {
        post_list(
            "ibv_post_send",
            qp,
            IBV_QPS_RTS,
            wr,
            bad_wr,
            QueuePair::send_batch,
            push,
        )
    }
}

/// `ops.post_recv`.
///
/// # Safety
///
/// Called by the inline `ibv_post_recv` with a live QP, a well-formed work
/// request list and a writable `bad_wr`.
pub(crate) unsafe extern "C" fn post_recv(
    qp: *mut ibv_qp,
    wr: *mut ibv_recv_wr,
    bad_wr: *mut *mut ibv_recv_wr,
) -> c_int {
    let mut sges = [Sge::default(); MAX_SGES];
    let push = |batch: &mut RecvBatch<'_>, w: &ibv_recv_wr| push_recv(batch, w, &mut sges);
    // SAFETY: the caller's promise.
    unsafe {
        post_list(
            "ibv_post_recv",
            qp,
            IBV_QPS_INIT,
            wr,
            bad_wr,
            QueuePair::recv_batch,
            push,
        )
    }
}

/// `ops.post_srq_recv` (and the context op the inline `ibv_post_srq_recv`
/// calls): like [`post_recv`], on the SRQ's ring.
///
/// # Safety
///
/// Called with a live SRQ, a well-formed work request list and a writable
/// `bad_wr`.
pub(crate) unsafe extern "C" fn post_srq_recv(
    srq: *mut ibv_srq,
    wr: *mut ibv_recv_wr,
    bad_wr: *mut *mut ibv_recv_wr,
) -> c_int {
    let mut sges = [Sge::default(); MAX_SGES];
    let push = |batch: &mut RecvBatch<'_>, w: &ibv_recv_wr| push_recv(batch, w, &mut sges);
    // SAFETY: the caller passes a live SRQ.
    let srq = unsafe { Srq::from_raw(srq) }.and_then(|s| s.inner.as_ref().ok_or(libc::EINVAL));
    let open = SharedReceiveQueue::recv_batch;
    // SAFETY: the caller's promise.
    unsafe { post_on("ibv_post_srq_recv", srq, wr, bad_wr, open, push) }
}

/// Translates one receive work request into `batch`.
fn push_recv(
    batch: &mut RecvBatch<'_>,
    w: &ibv_recv_wr,
    sges: &mut [Sge; MAX_SGES],
) -> VResult<()> {
    // SAFETY: the verbs contract for sg_list.
    let list = unsafe { sge_slice(w.sg_list, w.num_sge) }?;
    let r = RecvWr {
        wr_id: w.wr_id,
        sg_list: convert_sges(list, sges)?,
    };
    batch.push(&r).map_err(|e| e.errno())
}

/// The `sl` of a UD receive completion: on a RoCE port a datagram has no
/// service level of its own, and mlx5 reports the packet's network header
/// type there (its CQE's `roce_packet_type`: bit 3 a RoCEv2 frame, with
/// UDP; bits 2..0 the L3 header, 2 = IPv4). UCX's `ud_verbs` reads it to
/// find the destination address in the GRH (IPv4: its last 4 bytes) and
/// drops every datagram whose address it cannot match; vrdma's datagrams
/// are RoCEv2 over IPv4.
pub(crate) const UD_ROCE_V2_IPV4_SL: u8 = 0x8 | 0x2;

/// The (slid, sl) of a completion: a UD receive's on an InfiniBand port
/// is the sender's LID the device reported (`slid`, never 0 there: with
/// or without a GRH) and SL 0; a UD receive's on a RoCE port (it carries
/// a GRH, as only UD receives do there) is LID 0 and
/// [`UD_ROCE_V2_IPV4_SL`]; another receive's is its QP's path, which
/// `qp_path` looks up; a send's is zero.
pub(crate) fn completion_path(
    receive: bool,
    grh: bool,
    slid: u16,
    qp_path: impl FnOnce() -> Option<(u16, u8)>,
) -> (u16, u8) {
    match (receive, grh) {
        (true, _) if slid != 0 => (slid, 0),
        (true, true) => (0, UD_ROCE_V2_IPV4_SL),
        (true, false) => qp_path().unwrap_or((0, 0)),
        (false, _) => (0, 0),
    }
}

/// Fills an `ibv_wc` from a completion; `(slid, sl)` is its
/// [`completion_path`].
pub(crate) fn fill_wc(wc: &WorkCompletion, (slid, sl): (u16, u8)) -> ibv_wc {
    ibv_wc {
        wr_id: wc.wr_id,
        status: u32::from(u8::from(wc.status)),
        opcode: wc.opcode.map_or(0, |o| u32::from(u8::from(o))),
        vendor_err: wc.vendor_err,
        byte_len: wc.byte_len,
        __bindgen_anon_1: ibv_wc__bindgen_ty_1 {
            imm_data: wc.imm_data.map_or(0, u32::from_ne_bytes),
        },
        qp_num: wc.qp_num,
        src_qp: wc.src_qp,
        // GRH and WITH_IMM have libibverbs' bits on the wire.
        wc_flags: u32::from(wc.wc_flags),
        pkey_index: 0,
        slid,
        sl,
        dlid_path_bits: 0,
    }
}

fn is_receive(wc: &WorkCompletion) -> bool {
    matches!(wc.opcode, Some(WcOpcode::Recv | WcOpcode::RecvRdmaWithImm))
}

/// `ops.poll_cq`: the number of completions written, or a negative errno.
///
/// # Safety
///
/// Called by the inline `ibv_poll_cq` with a live CQ and room for
/// `num_entries` completions at `wc`.
pub(crate) unsafe extern "C" fn poll_cq(
    cq: *mut ibv_cq,
    num_entries: c_int,
    wc: *mut ibv_wc,
) -> c_int {
    guard("ibv_poll_cq", -libc::EIO, || {
        // SAFETY: the caller passes a live CQ.
        let (cq_box, our) = match unsafe { Cq::from_raw(cq) }
            .and_then(|c| Ok((c, c.inner.as_ref().ok_or(libc::EINVAL)?)))
        {
            Ok(c) => c,
            Err(errno) => return -errno,
        };
        let Ok(want) = usize::try_from(num_entries) else {
            return -libc::EINVAL;
        };
        if want == 0 {
            return 0;
        }
        if wc.is_null() {
            return -libc::EINVAL;
        }
        // SAFETY: the caller provides room for `num_entries` completions.
        let out = unsafe { std::slice::from_raw_parts_mut(wc, want) };
        let mut buf = [WorkCompletion::default(); POLL_BATCH];
        let mut total = 0;
        while total < want {
            let n = (want - total).min(POLL_BATCH);
            let got = match our.poll(&mut buf[..n]) {
                Ok(got) => got,
                Err(e) if total == 0 => return -errno_of(&e),
                Err(_) => break,
            };
            for (dst, src) in out[total..].iter_mut().zip(&buf[..got]) {
                let grh = src.wc_flags & wc_flags::GRH != 0;
                // SAFETY: a live CQ's context is open.
                let path = completion_path(is_receive(src), grh, src.slid, || unsafe {
                    qp_path(cq, src.qp_num)
                });
                *dst = fill_wc(src, path);
            }
            total += got;
            if got < n {
                break;
            }
        }
        if total == 0 {
            empty_poll(cq_box);
        } else {
            cq_box.empty_polls.store(0, Ordering::Relaxed);
        }
        c_int::try_from(total).unwrap_or(c_int::MAX)
    })
}

/// The (dlid, sl) of a local QP, for a receive completion's slid/sl.
///
/// # Safety
///
/// `cq` is a live CQ.
pub(crate) unsafe fn qp_path(cq: *mut ibv_cq, qpn: u32) -> Option<(u16, u8)> {
    // SAFETY: a live CQ's context is an open context of this library.
    let ctx = unsafe { Ctx::from_ibv((*cq).context) }.ok()?;
    let qps = ctx.shared.qps.read().unwrap_or_else(|e| e.into_inner());
    qps.get(&qpn).map(|r| (r.dlid, r.sl))
}

/// `ops.req_notify_cq`.
///
/// # Safety
///
/// Called by the inline `ibv_req_notify_cq` with a live CQ.
pub(crate) unsafe extern "C" fn req_notify_cq(cq: *mut ibv_cq, solicited_only: c_int) -> c_int {
    guard("ibv_req_notify_cq", libc::EIO, || {
        // SAFETY: the caller passes a live CQ.
        match unsafe { Cq::from_raw(cq) }.and_then(|c| c.inner.as_ref().ok_or(libc::EINVAL)) {
            Ok(c) => {
                c.req_notify(solicited_only != 0);
                0
            }
            Err(errno) => errno,
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::abi::{
        ibv_send_wr__bindgen_ty_2__bindgen_ty_1, ibv_send_wr__bindgen_ty_2__bindgen_ty_2,
        IBV_SEND_SIGNALED, IBV_SEND_SOLICITED, IBV_WC_GRH, IBV_WC_RECV, IBV_WC_WITH_IMM,
        IBV_WR_ATOMIC_CMP_AND_SWP, IBV_WR_RDMA_WRITE_WITH_IMM, IBV_WR_SEND,
    };
    use vrdma_guest_driver::vrdma_spec::verbs::WcStatus;

    fn storage() -> SendStorage {
        SendStorage::new()
    }

    #[test]
    fn send_wr_translation() {
        let mut sges = [
            ibv_sge {
                addr: 0x1000,
                length: 64,
                lkey: 7,
            },
            ibv_sge {
                addr: 0x2000,
                length: 8,
                lkey: 9,
            },
        ];
        let mut w = ibv_send_wr {
            wr_id: 42,
            sg_list: sges.as_mut_ptr(),
            num_sge: 2,
            opcode: IBV_WR_RDMA_WRITE_WITH_IMM,
            send_flags: IBV_SEND_SIGNALED | IBV_SEND_SOLICITED,
            ..Default::default()
        };
        w.__bindgen_anon_1.imm_data = u32::from_ne_bytes([1, 2, 3, 4]);
        w.wr.rdma = ibv_send_wr__bindgen_ty_2__bindgen_ty_1 {
            remote_addr: 0xdead_0000,
            rkey: 0x55,
        };
        let mut st = storage();
        // SAFETY: sg_list holds num_sge SGEs.
        let t = unsafe { translate_send(&w, &mut st, false) }.unwrap();
        assert_eq!(t.wr_id, 42);
        assert_eq!(t.opcode, SendOpcode::RdmaWriteWithImm);
        assert_eq!(t.flags, send_flags::SIGNALED | send_flags::SOLICITED);
        assert_eq!(t.imm_data, [1, 2, 3, 4], "big-endian bytes pass through");
        assert_eq!((t.remote_addr, t.rkey), (0xdead_0000, 0x55));
        match t.payload {
            SendPayload::Sges(s) => assert_eq!(
                s,
                [
                    Sge {
                        addr: 0x1000,
                        length: 64,
                        lkey: 7
                    },
                    Sge {
                        addr: 0x2000,
                        length: 8,
                        lkey: 9
                    }
                ]
            ),
            SendPayload::Inline(_) => panic!("not inline"),
        }

        let mut w = ibv_send_wr {
            opcode: IBV_WR_ATOMIC_CMP_AND_SWP,
            ..Default::default()
        };
        w.wr.atomic = ibv_send_wr__bindgen_ty_2__bindgen_ty_2 {
            remote_addr: 0x40,
            compare_add: 1,
            swap: 2,
            rkey: 3,
        };
        // SAFETY: no SGEs.
        let t = unsafe { translate_send(&w, &mut st, false) }.unwrap();
        assert_eq!(
            (t.remote_addr, t.rkey, t.compare_add, t.swap),
            (0x40, 3, 1, 2)
        );

        w.opcode = 99;
        // SAFETY: no SGEs.
        let r = unsafe { translate_send(&w, &mut st, false) };
        assert_eq!(r.err(), Some(libc::EINVAL));
        w.opcode = IBV_WR_SEND;
        w.num_sge = -1;
        // SAFETY: a negative count is refused before any read.
        let r = unsafe { translate_send(&w, &mut st, false) };
        assert_eq!(r.err(), Some(libc::EINVAL));
    }

    #[test]
    fn inline_sends_gather_application_bytes() {
        let a = *b"hello ";
        let b = *b"world";
        let mut sges = [
            ibv_sge {
                addr: a.as_ptr() as u64,
                length: 6,
                lkey: 0,
            },
            ibv_sge {
                addr: b.as_ptr() as u64,
                length: 5,
                lkey: 0,
            },
        ];
        let w = ibv_send_wr {
            sg_list: sges.as_mut_ptr(),
            num_sge: 2,
            opcode: IBV_WR_SEND,
            send_flags: IBV_SEND_INLINE | IBV_SEND_SIGNALED,
            ..Default::default()
        };
        let mut st = storage();
        // SAFETY: the SGEs point to the arrays above.
        let t = unsafe { translate_send(&w, &mut st, false) }.unwrap();
        assert_eq!(t.flags, send_flags::SIGNALED);
        match t.payload {
            SendPayload::Inline(d) => assert_eq!(d, b"hello world"),
            SendPayload::Sges(_) => panic!("inline"),
        }
        let mut long = [sges[0], sges[1]];
        long[1].length = MAX_INLINE as u32;
        let w = ibv_send_wr {
            sg_list: long.as_mut_ptr(),
            ..w
        };
        // SAFETY: too long is refused before reading past the arrays.
        let r = unsafe { translate_send(&w, &mut st, false) };
        assert_eq!(r.err(), Some(libc::EINVAL));
    }

    #[test]
    fn sge_lists_up_to_the_format_limit_are_translated() {
        let list: Vec<_> = (0..MAX_SGES as u64 + 1)
            .map(|i| ibv_sge {
                addr: i,
                length: 2,
                lkey: 3,
            })
            .collect();
        let mut out = [Sge::default(); MAX_SGES];
        let s = convert_sges(&list[..MAX_SGES], &mut out).unwrap();
        assert_eq!(s.len(), 64);
        assert_eq!(
            s[63],
            Sge {
                addr: 63,
                length: 2,
                lkey: 3
            }
        );
        assert_eq!(convert_sges(&list, &mut out).err(), Some(libc::EINVAL));
        assert_eq!(convert_sges(&[], &mut out).unwrap(), &[]);
        assert_eq!(MAX_INLINE, 1024, "the format's inline limit");
    }

    #[test]
    fn completions_fill_every_field() {
        let wc = WorkCompletion {
            wr_id: 5,
            status: WcStatus::Success,
            opcode: Some(WcOpcode::Recv),
            vendor_err: 0,
            byte_len: 4096,
            imm_data: Some([0, 0, 0, 9]),
            qp_num: 0x1234,
            src_qp: 0x5678,
            wc_flags: (IBV_WC_WITH_IMM | IBV_WC_GRH) as u8,
            slid: 0,
        };
        let out = fill_wc(&wc, (17, 3));
        assert_eq!(out.wr_id, 5);
        assert_eq!(out.status, 0);
        assert_eq!(out.opcode, IBV_WC_RECV);
        assert_eq!(out.byte_len, 4096);
        // SAFETY: reading the imm_data member of a plain-integer union.
        let imm = unsafe { out.__bindgen_anon_1.imm_data };
        assert_eq!(imm.to_ne_bytes(), [0, 0, 0, 9]);
        assert_eq!((out.qp_num, out.src_qp), (0x1234, 0x5678));
        assert_eq!(out.wc_flags, IBV_WC_WITH_IMM | IBV_WC_GRH);
        assert_eq!(
            (out.slid, out.sl, out.pkey_index, out.dlid_path_bits),
            (17, 3, 0, 0)
        );
        let err = WorkCompletion {
            status: WcStatus::RemAccessErr,
            opcode: None,
            ..wc
        };
        let out = fill_wc(&err, (0, 0));
        assert_eq!(out.status, 10);
        assert_eq!(out.opcode, 0);
    }

    #[test]
    fn a_ud_receive_says_roce_v2_over_ipv4_in_sl_as_mlx5_does() {
        let path = || Some((17, 3));
        // A UD receive (it has a GRH): mlx5's RoCE packet type, whose low
        // 3 bits UCX compares with 2 (IPv4).
        assert_eq!(completion_path(true, true, 0, path), (0, 0xa));
        assert_eq!(UD_ROCE_V2_IPV4_SL & 0x7, 2);
        // An RC/UC receive: its QP's path; a QP the library does not know: 0.
        assert_eq!(completion_path(true, false, 0, path), (17, 3));
        assert_eq!(completion_path(true, false, 0, || None), (0, 0));
        // A send completion has no path.
        assert_eq!(completion_path(false, false, 0, path), (0, 0));
    }

    #[test]
    fn a_ud_receive_on_an_infiniband_port_names_its_sender_by_lid() {
        let path = || Some((17, 3));
        // With or without a GRH: the LID the device reported, SL 0.
        assert_eq!(completion_path(true, false, 5, path), (5, 0));
        assert_eq!(completion_path(true, true, 5, path), (5, 0));
        assert_eq!(completion_path(false, false, 5, path), (0, 0));
    }
}
