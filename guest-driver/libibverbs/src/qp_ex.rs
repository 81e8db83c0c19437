//! Extended QPs (`ibv_create_qp_ex`) and posting through `struct
//! ibv_qp_ex`: `ibv_wr_start`, one `ibv_wr_<opcode>` and its data
//! (`ibv_wr_set_sge`, `_sge_list`, `_inline_data`, `_inline_data_list`)
//! per work request, then `ibv_wr_complete` (or `ibv_wr_abort`).
//!
//! It is the same posting path as `ibv_post_send`: `ibv_wr_start` opens
//! the QP's [`SendBatch`] (which holds the send queue's lock, as mlx5
//! holds its QP lock from `wr_start` to `wr_complete`), each work request
//! is translated into the guest driver's `SendWr` and pushed into the
//! batch (the ring's one WQE writer) when its data is set, and
//! `ibv_wr_complete` ends the batch: published, doorbell rung once.
//! Nothing is allocated: SGE lists and inline bytes are translated in
//! buffers on the stack, as `ibv_post_send` does.
//!
//! Errors: the `ibv_wr_*` builders return nothing, so the first error of a
//! batch (a full queue `ENOMEM`, too many SGEs or inline bytes `EINVAL`,
//! an opcode not in the QP's `send_ops_flags` `EINVAL`, one vrdma cannot
//! do `EOPNOTSUPP`) is kept and returned by `ibv_wr_complete`, which then
//! posts none of the batch. A work request whose data is never set is
//! posted without data (a zero-length SEND or WRITE).

use std::cell::UnsafeCell;
use std::ffi::{c_int, c_void};
use std::sync::atomic::{AtomicUsize, Ordering};

use vrdma_guest_driver::vrdma_spec::verbs::SendOpcode;
use vrdma_guest_driver::{SendBatch, SendPayload, SendWr, Sge, UdDest};

use crate::abi::{
    __be32, ibv_ah, ibv_context, ibv_data_buf, ibv_mw, ibv_mw_bind_info, ibv_qp, ibv_qp_ex,
    ibv_qp_init_attr, ibv_qp_init_attr_ex, ibv_sge, ibv_wr_opcode, IBV_QPS_RTS,
    IBV_QP_EX_WITH_ATOMIC_CMP_AND_SWP, IBV_QP_EX_WITH_ATOMIC_FETCH_AND_ADD,
    IBV_QP_EX_WITH_RDMA_READ, IBV_QP_EX_WITH_RDMA_WRITE, IBV_QP_EX_WITH_RDMA_WRITE_WITH_IMM,
    IBV_QP_EX_WITH_SEND, IBV_QP_EX_WITH_SEND_WITH_IMM, IBV_QP_INIT_ATTR_CREATE_FLAGS,
    IBV_QP_INIT_ATTR_IND_TABLE, IBV_QP_INIT_ATTR_MAX_TSO_HEADER, IBV_QP_INIT_ATTR_PD,
    IBV_QP_INIT_ATTR_RX_HASH, IBV_QP_INIT_ATTR_SEND_OPS_FLAGS, IBV_QP_INIT_ATTR_XRCD,
};
use crate::control::create_qp;
use crate::datapath::{self, convert_sges, gather_inline, wire_send_flags, MAX_INLINE, MAX_SGES};
use crate::ffi::{guard, non_null, ptr_verb, unsupported, VResult};
use crate::objects::{Ah, Qp, Wrapper};

/// The `send_ops_flags` an RC QP of vrdma can post.
const SUPPORTED_SEND_OPS: u64 = (IBV_QP_EX_WITH_RDMA_WRITE
    | IBV_QP_EX_WITH_RDMA_WRITE_WITH_IMM
    | IBV_QP_EX_WITH_SEND
    | IBV_QP_EX_WITH_SEND_WITH_IMM
    | IBV_QP_EX_WITH_RDMA_READ
    | IBV_QP_EX_WITH_ATOMIC_CMP_AND_SWP
    | IBV_QP_EX_WITH_ATOMIC_FETCH_AND_ADD) as u64;

/// The `comp_mask` bits of `struct ibv_qp_init_attr_ex` this library knows.
const KNOWN_INIT_MASK: u32 = IBV_QP_INIT_ATTR_PD
    | IBV_QP_INIT_ATTR_XRCD
    | IBV_QP_INIT_ATTR_CREATE_FLAGS
    | IBV_QP_INIT_ATTR_MAX_TSO_HEADER
    | IBV_QP_INIT_ATTR_IND_TABLE
    | IBV_QP_INIT_ATTR_RX_HASH
    | IBV_QP_INIT_ATTR_SEND_OPS_FLAGS;

/// What `ibv_create_qp_ex` asks for: the `send_ops_flags` (None without
/// `IBV_QP_INIT_ATTR_SEND_OPS_FLAGS`), or why it is refused.
fn check_init(a: &ibv_qp_init_attr_ex) -> VResult<Option<u64>> {
    if a.comp_mask & !KNOWN_INIT_MASK != 0 || a.comp_mask & IBV_QP_INIT_ATTR_PD == 0 {
        return Err(libc::EINVAL);
    }
    if a.comp_mask & (IBV_QP_INIT_ATTR_XRCD | IBV_QP_INIT_ATTR_IND_TABLE | IBV_QP_INIT_ATTR_RX_HASH)
        != 0
    {
        return Err(unsupported("XRC and RSS QPs (ibv_create_qp_ex)"));
    }
    if a.comp_mask & IBV_QP_INIT_ATTR_CREATE_FLAGS != 0 && a.create_flags != 0 {
        return Err(unsupported("QP create flags (ibv_create_qp_ex)"));
    }
    if a.comp_mask & IBV_QP_INIT_ATTR_MAX_TSO_HEADER != 0 && a.max_tso_header != 0 {
        return Err(unsupported("TSO (ibv_create_qp_ex)"));
    }
    if a.comp_mask & IBV_QP_INIT_ATTR_SEND_OPS_FLAGS == 0 {
        return Ok(None);
    }
    if a.send_ops_flags & !SUPPORTED_SEND_OPS != 0 {
        return Err(unsupported(
            "send opcodes other than SEND, WRITE, READ and atomics (send_ops_flags)",
        ));
    }
    Ok(Some(a.send_ops_flags))
}

/// `verbs_context.create_qp_ex`, called by the inline `ibv_create_qp_ex`
/// (which calls `ibv_create_qp` itself when only the PD is given).
///
/// # Safety
///
/// `context` is an open context; `attr` a valid, writable attribute
/// structure whose PD and CQs are live.
pub(crate) unsafe extern "C" fn create_qp_ex(
    context: *mut ibv_context,
    attr: *mut ibv_qp_init_attr_ex,
) -> *mut ibv_qp {
    ptr_verb("ibv_create_qp_ex", || {
        non_null(attr)?;
        // SAFETY: the caller passes a valid, writable attribute structure.
        let a = unsafe { &mut *attr };
        let send_ops = check_init(a)?;
        non_null(a.pd)?;
        // SAFETY: a non-null PD the caller passes is live.
        if unsafe { (*a.pd).context } != context {
            return Err(libc::EINVAL);
        }
        let mut init = ibv_qp_init_attr {
            qp_context: a.qp_context,
            send_cq: a.send_cq,
            recv_cq: a.recv_cq,
            srq: a.srq,
            cap: a.cap,
            qp_type: a.qp_type,
            sq_sig_all: a.sq_sig_all,
        };
        let qp = create_qp(a.pd, &mut init, send_ops)?;
        a.cap = init.cap;
        Ok(qp)
    })
}

/// `ibv_qp_to_qp_ex`: the `struct ibv_qp_ex` of a QP created with
/// `send_ops_flags`, NULL for the others (as rdma-core).
///
/// # Safety
///
/// `qp` is a live QP of this library.
pub unsafe extern "C" fn ibv_qp_to_qp_ex(qp: *mut ibv_qp) -> *mut ibv_qp_ex {
    // SAFETY: the caller's promise.
    match unsafe { Qp::from_raw(qp) } {
        Ok(q) if q.wr.is_some() => qp.cast(),
        _ => std::ptr::null_mut(),
    }
}

/// `ibv_query_qp_data_in_order`: 0 for every opcode, "not guaranteed".
/// hostd writes a message's payload packet by packet with ordinary memory
/// copies, which promise nothing about the order in which another core
/// sees the bytes land, so an application must wait for the completion
/// (which is always correct), not poll the data.
///
/// # Safety
///
/// `qp` is a live QP of this library.
pub unsafe extern "C" fn ibv_query_qp_data_in_order(
    qp: *mut ibv_qp,
    _op: ibv_wr_opcode,
    _flags: u32,
) -> c_int {
    guard("ibv_query_qp_data_in_order", 0, || {
        // SAFETY: the caller's promise.
        if let Err(errno) = unsafe { Qp::from_raw(qp) } {
            crate::ffi::set_errno(errno);
        }
        0
    })
}

/// An identifier of the calling thread (the address of a thread-local).
fn thread_id() -> usize {
    thread_local!(static ID: u8 = const { 0 });
    ID.with(|id| std::ptr::from_ref(id) as usize)
}

/// The `ibv_wr_*` state of an extended QP.
pub(crate) struct WrPosting {
    /// The opcodes the QP was created for (`send_ops_flags`).
    send_ops: u64,
    /// The thread between `ibv_wr_start` and `ibv_wr_complete`/`abort`
    /// (0: none). Only that thread touches `state`, and it holds the send
    /// queue's lock meanwhile (inside the batch).
    owner: AtomicUsize,
    state: UnsafeCell<WrState>,
}

#[derive(Default)]
struct WrState {
    /// The open batch. It borrows the QP's `QueuePair` (its ring and
    /// device, both behind `Arc`s the QueuePair keeps); see `wr_start`.
    batch: Option<SendBatch<'static>>,
    /// The work request whose opcode is set and whose data is not.
    pending: Option<SendWr<'static>>,
    /// The batch's first error (0: none).
    error: c_int,
}

impl WrPosting {
    pub(crate) fn new(send_ops: u64) -> Self {
        Self {
            send_ops,
            owner: AtomicUsize::new(0),
            state: UnsafeCell::default(),
        }
    }

    /// The state, if the calling thread opened the batch.
    #[allow(clippy::mut_from_ref)]
    fn owned(&self) -> Option<&mut WrState> {
        if self.owner.load(Ordering::Acquire) != thread_id() {
            tracing::warn!("ibv_wr_* called without ibv_wr_start on this thread; ignored");
            return None;
        }
        // SAFETY: only the owner thread gets here, and it is the only one
        // using the state until it clears `owner` (in complete/abort);
        // no reference outlives one builder call.
        Some(unsafe { &mut *self.state.get() })
    }

    /// Ends an open batch without posting it (the QP is being destroyed).
    pub(crate) fn abandon(&self) {
        if let Some(s) = self.owned_quietly() {
            s.pending = None;
            if let Some(b) = s.batch.take() {
                b.abort();
            }
            self.owner.store(0, Ordering::Release);
        }
    }

    #[allow(clippy::mut_from_ref)]
    fn owned_quietly(&self) -> Option<&mut WrState> {
        // SAFETY: as in `owned`.
        (self.owner.load(Ordering::Acquire) == thread_id())
            .then(|| unsafe { &mut *self.state.get() })
    }
}

impl WrState {
    fn fail(&mut self, errno: c_int) {
        if self.error == 0 {
            self.error = errno;
        }
    }

    /// Pushes `wr` into the batch (unless the batch already failed).
    fn push(&mut self, wr: &SendWr<'_>) {
        if self.error != 0 {
            return;
        }
        let r = match self.batch.as_mut() {
            Some(b) => b.push(wr).map_err(|e| e.errno()),
            None => Err(libc::EINVAL),
        };
        if let Err(errno) = r {
            self.fail(errno);
        }
    }

    /// Posts a pending work request that got no data (zero length).
    fn flush(&mut self) {
        if let Some(wr) = self.pending.take() {
            self.push(&wr);
        }
    }
}

/// The QP box and its `ibv_wr_*` state behind an application pointer.
///
/// # Safety
///
/// `qp` is a live extended QP of this library.
unsafe fn posting<'a>(qp: *mut ibv_qp_ex) -> Option<(&'a Qp, &'a WrPosting)> {
    // SAFETY: the caller's promise; ibv_qp_ex starts with ibv_qp.
    let q = unsafe { Qp::from_raw(qp.cast::<ibv_qp>()) }.ok()?;
    Some((q, q.wr.as_ref()?))
}

/// `qp->wr_start`.
///
/// # Safety
///
/// `qp` is a live extended QP.
unsafe extern "C" fn wr_start(qp: *mut ibv_qp_ex) {
    guard("ibv_wr_start", (), || {
        // SAFETY: the caller's promise.
        let Some((q, wr)) = (unsafe { posting(qp) }) else {
            return;
        };
        if let Some(s) = wr.owned_quietly() {
            // A second wr_start before complete/abort on this thread:
            // the batch stays open and fails at completion.
            s.fail(libc::EINVAL);
            return;
        }
        let Some(inner) = q.inner.as_ref() else {
            return;
        };
        // Blocks while another thread has a batch (or ibv_post_send) open.
        let batch = inner.send_batch();
        // SAFETY: the batch borrows the send ring and device through the
        // QueuePair's `Arc`s, which live as long as the QueuePair in this
        // QP's box; the batch ends in wr_complete/wr_abort, or in
        // ibv_destroy_qp (`abandon`) before the QueuePair is destroyed.
        let batch = unsafe { std::mem::transmute::<SendBatch<'_>, SendBatch<'static>>(batch) };
        wr.owner.store(thread_id(), Ordering::Release);
        if let Some(s) = wr.owned() {
            // Before RTS the batch fails at completion, as ibv_post_send.
            let ready = datapath::ready(&q.ibv.qp_base, IBV_QPS_RTS);
            *s = WrState {
                batch: Some(batch),
                pending: None,
                error: ready.err().unwrap_or(0),
            };
        }
    });
}

/// `qp->wr_complete`: posts the batch (0), or nothing and its first error.
///
/// # Safety
///
/// `qp` is a live extended QP.
unsafe extern "C" fn wr_complete(qp: *mut ibv_qp_ex) -> c_int {
    guard("ibv_wr_complete", libc::EIO, || {
        // SAFETY: the caller's promise.
        let Some((_, wr)) = (unsafe { posting(qp) }) else {
            return libc::EINVAL;
        };
        let Some(s) = wr.owned() else {
            return libc::EINVAL;
        };
        s.flush();
        let error = std::mem::take(&mut s.error);
        let batch = s.batch.take();
        wr.owner.store(0, Ordering::Release);
        match batch {
            Some(b) if error != 0 => {
                b.abort();
                error
            }
            // Dropping the batch publishes it and rings the doorbell.
            Some(b) => {
                drop(b);
                0
            }
            None => libc::EINVAL,
        }
    })
}

/// `qp->wr_abort`: posts nothing of the batch.
///
/// # Safety
///
/// `qp` is a live extended QP.
unsafe extern "C" fn wr_abort(qp: *mut ibv_qp_ex) {
    guard("ibv_wr_abort", (), || {
        // SAFETY: the caller's promise.
        if let Some((_, wr)) = unsafe { posting(qp) } {
            wr.abandon();
        }
    });
}

/// Starts a work request of `opcode` (`bit` of `send_ops_flags`) with
/// `qp->wr_id` and `qp->wr_flags`, `set` filling its opcode's fields.
///
/// # Safety
///
/// `qp` is a live extended QP.
unsafe fn begin(
    qp: *mut ibv_qp_ex,
    bit: u32,
    opcode: SendOpcode,
    set: impl FnOnce(&mut SendWr<'static>),
) {
    // SAFETY: the caller's promise.
    let Some((_, wr)) = (unsafe { posting(qp) }) else {
        return;
    };
    let Some(s) = wr.owned() else {
        return;
    };
    s.flush();
    if wr.send_ops & u64::from(bit) == 0 {
        s.fail(libc::EINVAL);
        return;
    }
    // SAFETY: the application's live ibv_qp_ex; wr_id/wr_flags are its
    // inputs for the next work request.
    let (wr_id, flags) = unsafe { ((*qp).wr_id, (*qp).wr_flags) };
    let mut w = SendWr::new(wr_id, opcode, SendPayload::Sges(&[]));
    w.flags = wire_send_flags(flags);
    set(&mut w);
    s.pending = Some(w);
}

/// Records `EOPNOTSUPP` for an opcode or setter vrdma cannot post.
///
/// # Safety
///
/// `qp` is a live extended QP.
unsafe fn refuse(qp: *mut ibv_qp_ex, what: &'static str) {
    // SAFETY: the caller's promise.
    if let Some((_, wr)) = unsafe { posting(qp) } {
        if let Some(s) = wr.owned() {
            s.pending = None;
            s.fail(unsupported(what));
        }
    }
}

/// Sets the pending work request's data and pushes it.
///
/// # Safety
///
/// `qp` is a live extended QP.
unsafe fn finish(qp: *mut ibv_qp_ex, payload: VResult<SendPayload<'_>>) {
    // SAFETY: the caller's promise.
    let Some((_, wr)) = (unsafe { posting(qp) }) else {
        return;
    };
    let Some(s) = wr.owned() else {
        return;
    };
    match (s.pending.take(), payload) {
        (Some(pending), Ok(payload)) => s.push(&SendWr { payload, ..pending }),
        (None, _) => s.fail(libc::EINVAL),
        (_, Err(errno)) => s.fail(errno),
    }
}

/// Defines the opcode builders: `name(args) => bit, opcode, |wr| fill`.
macro_rules! builders {
    ($($name:ident($($arg:ident: $ty:ty),*) => $bit:expr, $op:ident, |$w:ident| $fill:expr;)+) => {$(
        #[doc = concat!("`qp->", stringify!($name), "`.")]
        ///
        /// # Safety
        ///
        /// `qp` is a live extended QP between `wr_start` and `wr_complete`.
        unsafe extern "C" fn $name(qp: *mut ibv_qp_ex $(, $arg: $ty)*) {
            guard(stringify!($name), (), || {
                // SAFETY: the caller's promise.
                unsafe { begin(qp, $bit, SendOpcode::$op, |$w| $fill) }
            });
        }
    )+};
}

builders! {
    wr_send() => IBV_QP_EX_WITH_SEND, Send, |_w| ();
    wr_send_imm(imm: __be32) => IBV_QP_EX_WITH_SEND_WITH_IMM, SendWithImm, |w| {
        w.imm_data = imm.to_ne_bytes();
    };
    wr_rdma_write(rkey: u32, remote_addr: u64) => IBV_QP_EX_WITH_RDMA_WRITE, RdmaWrite, |w| {
        (w.rkey, w.remote_addr) = (rkey, remote_addr);
    };
    wr_rdma_write_imm(rkey: u32, remote_addr: u64, imm: __be32) =>
        IBV_QP_EX_WITH_RDMA_WRITE_WITH_IMM, RdmaWriteWithImm, |w| {
        (w.rkey, w.remote_addr) = (rkey, remote_addr);
        w.imm_data = imm.to_ne_bytes();
    };
    wr_rdma_read(rkey: u32, remote_addr: u64) => IBV_QP_EX_WITH_RDMA_READ, RdmaRead, |w| {
        (w.rkey, w.remote_addr) = (rkey, remote_addr);
    };
    wr_atomic_cmp_swp(rkey: u32, remote_addr: u64, compare: u64, swap: u64) =>
        IBV_QP_EX_WITH_ATOMIC_CMP_AND_SWP, AtomicCmpAndSwp, |w| {
        (w.rkey, w.remote_addr, w.compare_add, w.swap) = (rkey, remote_addr, compare, swap);
    };
    wr_atomic_fetch_add(rkey: u32, remote_addr: u64, add: u64) =>
        IBV_QP_EX_WITH_ATOMIC_FETCH_AND_ADD, AtomicFetchAndAdd, |w| {
        (w.rkey, w.remote_addr, w.compare_add) = (rkey, remote_addr, add);
    };
}

/// Defines the builders vrdma refuses (recorded as `EOPNOTSUPP`).
macro_rules! refused {
    ($($name:ident($($arg:ident: $ty:ty),*), $what:literal;)+) => {$(
        #[doc = concat!("`qp->", stringify!($name), "`: ", $what, " are refused.")]
        ///
        /// # Safety
        ///
        /// `qp` is a live extended QP.
        unsafe extern "C" fn $name(qp: *mut ibv_qp_ex $(, _: $ty)*) {
            // SAFETY: the caller's promise.
            guard(stringify!($name), (), || unsafe { refuse(qp, $what) });
        }
    )+};
}

refused! {
    wr_bind_mw(mw: *mut ibv_mw, rkey: u32, info: *const ibv_mw_bind_info), "memory windows";
    wr_local_inv(rkey: u32), "local invalidations";
    wr_send_inv(rkey: u32), "sends with invalidate";
    wr_send_tso(hdr: *mut c_void, hdr_sz: u16, mss: u16), "TSO sends";
    wr_set_xrc_srqn(srqn: u32), "XRC sends";
    wr_atomic_write(rkey: u32, addr: u64, data: *const c_void), "atomic writes";
}

/// `qp->wr_set_ud_addr`: the pending work request's UD destination (its
/// AH, remote QPN and Q_Key), as `wr.ud` of `ibv_post_send`.
///
/// # Safety
///
/// `qp` is a live extended QP between `wr_start` and `wr_complete`; `ah`
/// is NULL or a live address handle.
unsafe extern "C" fn wr_set_ud_addr(
    qp: *mut ibv_qp_ex,
    ah: *mut ibv_ah,
    remote_qpn: u32,
    remote_qkey: u32,
) {
    // SAFETY: the caller's promise.
    let Some((_, wr)) = (unsafe { posting(qp) }) else {
        return;
    };
    let Some(s) = wr.owned() else {
        return;
    };
    // SAFETY: the application's AH is live (the verbs contract); NULL is
    // refused.
    let dest = unsafe { Ah::from_raw(ah) }
        .and_then(|a| a.inner.as_ref().ok_or(libc::EINVAL))
        .map(|a| UdDest {
            ah: a.ahn(),
            remote_qpn,
            remote_qkey,
        });
    match (s.pending.take(), dest) {
        (Some(pending), Ok(dest)) => s.pending = Some(pending.to_ud(dest)),
        (None, _) => s.fail(libc::EINVAL),
        (_, Err(errno)) => s.fail(errno),
    }
}

/// `qp->wr_set_sge`.
///
/// # Safety
///
/// `qp` is a live extended QP between `wr_start` and `wr_complete`.
unsafe extern "C" fn wr_set_sge(qp: *mut ibv_qp_ex, lkey: u32, addr: u64, length: u32) {
    guard("ibv_wr_set_sge", (), || {
        let sge = [Sge { addr, length, lkey }];
        // SAFETY: the caller's promise.
        unsafe { finish(qp, Ok(SendPayload::Sges(&sge))) };
    });
}

/// `qp->wr_set_sge_list`.
///
/// # Safety
///
/// As for [`wr_set_sge`]; `sg_list` holds `num_sge` SGEs.
unsafe extern "C" fn wr_set_sge_list(qp: *mut ibv_qp_ex, num_sge: usize, sg_list: *const ibv_sge) {
    guard("ibv_wr_set_sge_list", (), || {
        let mut out = [Sge::default(); MAX_SGES];
        let payload = if num_sge == 0 {
            Ok(SendPayload::Sges(&[]))
        } else if sg_list.is_null() || num_sge > MAX_SGES {
            Err(libc::EINVAL)
        } else {
            // SAFETY: the caller's promise about sg_list.
            let list = unsafe { std::slice::from_raw_parts(sg_list, num_sge) };
            convert_sges(list, &mut out).map(SendPayload::Sges)
        };
        // SAFETY: the caller's promise.
        unsafe { finish(qp, payload) };
    });
}

/// `qp->wr_set_inline_data`: the bytes are copied now.
///
/// # Safety
///
/// As for [`wr_set_sge`]; `addr` holds `length` readable bytes.
unsafe extern "C" fn wr_set_inline_data(qp: *mut ibv_qp_ex, addr: *mut c_void, length: usize) {
    guard("ibv_wr_set_inline_data", (), || {
        let mut buf = [0u8; MAX_INLINE];
        // SAFETY: the caller's promise about the buffer.
        let data = unsafe { gather_inline([(addr as u64, length)], &mut buf) };
        // SAFETY: the caller's promise.
        unsafe { finish(qp, data.map(SendPayload::Inline)) };
    });
}

/// `qp->wr_set_inline_data_list`: the bytes are copied now.
///
/// # Safety
///
/// As for [`wr_set_sge`]; `buf_list` holds `num_buf` readable buffers.
unsafe extern "C" fn wr_set_inline_data_list(
    qp: *mut ibv_qp_ex,
    num_buf: usize,
    buf_list: *const ibv_data_buf,
) {
    guard("ibv_wr_set_inline_data_list", (), || {
        let mut buf = [0u8; MAX_INLINE];
        let data = if num_buf == 0 {
            Ok(&buf[..0])
        } else if buf_list.is_null() {
            Err(libc::EINVAL)
        } else {
            // SAFETY: the caller's promise about buf_list.
            let list = unsafe { std::slice::from_raw_parts(buf_list, num_buf) };
            let parts = list.iter().map(|b| (b.addr as u64, b.length));
            // SAFETY: the caller's promise about the buffers.
            unsafe { gather_inline(parts, &mut buf) }
        };
        // SAFETY: the caller's promise.
        unsafe { finish(qp, data.map(SendPayload::Inline)) };
    });
}

/// `ibv_qp_ex` with the `ibv_wr_*` functions of this module.
pub(crate) fn with_wr_ops(qp: ibv_qp_ex) -> ibv_qp_ex {
    ibv_qp_ex {
        wr_atomic_cmp_swp: Some(wr_atomic_cmp_swp),
        wr_atomic_fetch_add: Some(wr_atomic_fetch_add),
        wr_bind_mw: Some(wr_bind_mw),
        wr_local_inv: Some(wr_local_inv),
        wr_rdma_read: Some(wr_rdma_read),
        wr_rdma_write: Some(wr_rdma_write),
        wr_rdma_write_imm: Some(wr_rdma_write_imm),
        wr_send: Some(wr_send),
        wr_send_imm: Some(wr_send_imm),
        wr_send_inv: Some(wr_send_inv),
        wr_send_tso: Some(wr_send_tso),
        wr_set_ud_addr: Some(wr_set_ud_addr),
        wr_set_xrc_srqn: Some(wr_set_xrc_srqn),
        wr_set_inline_data: Some(wr_set_inline_data),
        wr_set_inline_data_list: Some(wr_set_inline_data_list),
        wr_set_sge: Some(wr_set_sge),
        wr_set_sge_list: Some(wr_set_sge_list),
        wr_start: Some(wr_start),
        wr_complete: Some(wr_complete),
        wr_abort: Some(wr_abort),
        wr_atomic_write: Some(wr_atomic_write),
        ..qp
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::abi::{IBV_QPT_RC, IBV_QP_EX_WITH_BIND_MW};

    fn attr(mask: u32, ops: u64) -> ibv_qp_init_attr_ex {
        ibv_qp_init_attr_ex {
            qp_type: IBV_QPT_RC,
            comp_mask: mask,
            send_ops_flags: ops,
            ..Default::default()
        }
    }

    #[test]
    fn creation_attributes_are_checked_like_a_provider() {
        let pd = IBV_QP_INIT_ATTR_PD;
        let ops = IBV_QP_INIT_ATTR_SEND_OPS_FLAGS;
        assert_eq!(check_init(&attr(pd, 0)), Ok(None));
        assert_eq!(
            check_init(&attr(pd | ops, SUPPORTED_SEND_OPS)),
            Ok(Some(SUPPORTED_SEND_OPS))
        );
        let mw = u64::from(IBV_QP_EX_WITH_BIND_MW);
        assert_eq!(check_init(&attr(pd | ops, mw)), Err(libc::EOPNOTSUPP));
        assert_eq!(check_init(&attr(ops, 1)), Err(libc::EINVAL), "no PD");
        assert_eq!(check_init(&attr(pd | 1 << 20, 0)), Err(libc::EINVAL));
        assert_eq!(
            check_init(&attr(pd | IBV_QP_INIT_ATTR_XRCD, 0)),
            Err(libc::EOPNOTSUPP)
        );
        let mut a = attr(pd | IBV_QP_INIT_ATTR_CREATE_FLAGS, 0);
        assert_eq!(check_init(&a), Ok(None), "no flags asked");
        a.create_flags = 1;
        assert_eq!(check_init(&a), Err(libc::EOPNOTSUPP));
    }

    #[test]
    fn an_extended_qp_starts_with_a_qp() {
        assert_eq!(std::mem::offset_of!(ibv_qp_ex, qp_base), 0);
        assert_eq!(std::mem::offset_of!(Qp, ibv), 0);
    }
}
