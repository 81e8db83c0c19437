//! The device context: `struct verbs_context` laid out exactly as
//! rdma-core's headers do, with the ops table the inline data-path
//! functions of `<infiniband/verbs.h>` call through.
//!
//! `ibv_post_send`, `ibv_post_recv`, `ibv_poll_cq`, `ibv_req_notify_cq` and
//! `ibv_post_srq_recv` are inline functions in the application: they read
//! `obj->context->ops` and call the function found there. Extended verbs
//! (`ibv_query_port`'s current form, `ibv_query_device_ex`, `ibv_open_xrcd`,
//! ...) go through `verbs_get_ctx_op`, which requires `abi_compat ==
//! UINTPTR_MAX` and `sz` covering the op; vrdma sets `sz` to the full size.

use std::collections::HashMap;
use std::ffi::{c_int, c_void};
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::{Arc, Mutex, RwLock};
use std::thread::JoinHandle;

use vrdma_guest_driver::Context;

use crate::abi::{ibv_context, verbs_context};
use crate::device::DeviceEntry;
use crate::events::{self, AsyncQueue, ChannelState};
use crate::ffi::{non_null, VResult};
use crate::{cq_ex, datapath, qp_ex, query, unsupported};

/// `__VERBS_ABI_IS_EXTENDED`: `abi_compat` of an extended context.
const ABI_IS_EXTENDED: usize = usize::MAX;

/// Where a completion event of a CQ goes.
pub(crate) struct CqRoute {
    /// The application's `struct ibv_cq *`.
    pub(crate) cq: usize,
    pub(crate) channel: Option<Arc<ChannelState>>,
}

/// What the library remembers of a QP outside the QP itself: its pointer
/// (for asynchronous events) and its path (the `slid`/`sl` of receive
/// completions, which CQEs do not carry).
#[derive(Clone, Copy)]
pub(crate) struct QpRoute {
    /// The application's `struct ibv_qp *`.
    pub(crate) qp: usize,
    pub(crate) dlid: u16,
    pub(crate) sl: u8,
}

/// The state of an open device that the event thread shares.
pub(crate) struct Shared {
    pub(crate) dev: Context,
    /// CQs by CQN.
    pub(crate) cqs: Mutex<HashMap<u32, CqRoute>>,
    /// QPs by QPN.
    pub(crate) qps: RwLock<HashMap<u32, QpRoute>>,
    /// SRQs (the application's `struct ibv_srq *`) by SRQN.
    pub(crate) srqs: Mutex<HashMap<u32, usize>>,
    pub(crate) async_events: AsyncQueue,
    /// Written to stop the event thread.
    pub(crate) stop: OwnedFd,
}

/// An open device: the `struct verbs_context` the application sees (its
/// `struct ibv_context` is the last field), then the library's state.
#[repr(C)]
pub(crate) struct Ctx {
    pub(crate) vctx: verbs_context,
    pub(crate) shared: Arc<Shared>,
    events_thread: Option<JoinHandle<()>>,
    /// The context's `cmd_fd`. A real device's is its uverbs descriptor,
    /// and programs use it as one: rdma-core's tests `dup()` it to try
    /// `ibv_import_device` (refused, `EOPNOTSUPP`), which `-1` would turn
    /// into `EBADF`. vrdma's commands travel on the vdev connection, which
    /// must not outlive `ibv_close_device` in a duplicate, so this is an
    /// eventfd nothing reads or writes: a descriptor of the context's own.
    cmd_fd: OwnedFd,
}

impl Ctx {
    /// Wraps an opened device into a context and starts its event thread.
    pub(crate) fn new(dev: Context, device: &'static DeviceEntry) -> std::io::Result<Box<Self>> {
        let shared = Arc::new(Shared {
            dev,
            cqs: Mutex::default(),
            qps: RwLock::default(),
            srqs: Mutex::default(),
            async_events: AsyncQueue::new()?,
            stop: events::eventfd(0)?,
        });
        let mut ctx = Box::new(Ctx {
            vctx: verbs_context::default(),
            shared: Arc::clone(&shared),
            events_thread: None,
            cmd_fd: events::eventfd(0)?,
        });
        fill(&mut ctx.vctx, &shared);
        ctx.vctx.context.cmd_fd = ctx.cmd_fd.as_raw_fd();
        ctx.vctx.context.device = std::ptr::from_ref(&device.ibv).cast_mut();
        let thread = std::thread::Builder::new()
            .name("vrdma-events".into())
            .spawn(move || events::dispatch(&shared))?;
        ctx.events_thread = Some(thread);
        Ok(ctx)
    }

    /// The context behind an application's `struct ibv_context *`.
    ///
    /// # Safety
    ///
    /// A non-null `p` must be a context this library opened and not closed.
    pub(crate) unsafe fn from_ibv<'a>(p: *mut ibv_context) -> VResult<&'a Ctx> {
        // SAFETY: forwarded; the box is alive for the caller's use.
        Ok(unsafe { &*Self::raw_from_ibv(p)? })
    }

    /// [`Ctx::from_ibv`] as a raw pointer (for `ibv_close_device`).
    ///
    /// # Safety
    ///
    /// As for [`Ctx::from_ibv`].
    pub(crate) unsafe fn raw_from_ibv(p: *mut ibv_context) -> VResult<*mut Ctx> {
        non_null(p)?;
        let offset = std::mem::offset_of!(verbs_context, context);
        // SAFETY: a context this library opened is the `context` field of
        // the `verbs_context` that starts a repr(C) `Ctx`, alive by the
        // caller's promise. `abi_compat` is checked first, as a sanity
        // check against contexts of another library.
        unsafe {
            if (*p).abi_compat as usize != ABI_IS_EXTENDED {
                return Err(libc::EINVAL);
            }
            Ok(p.cast::<u8>().sub(offset).cast::<Ctx>())
        }
    }

    /// Stops the event thread (before the context is freed).
    pub(crate) fn stop_events(&mut self) {
        events::signal(&self.shared.stop);
        if let Some(t) = self.events_thread.take() {
            if t.join().is_err() {
                tracing::error!("The event thread panicked");
            }
        }
    }
}

impl Drop for Ctx {
    fn drop(&mut self) {
        self.stop_events();
    }
}

/// Fills the context fields and ops tables.
fn fill(vctx: &mut verbs_context, shared: &Shared) {
    let ctx = &mut vctx.context;
    ctx.async_fd = shared.async_events.fd().as_raw_fd();
    ctx.num_comp_vectors = c_int::from(shared.dev.num_comp_vectors());
    ctx.abi_compat = ABI_IS_EXTENDED as *mut c_void;

    let ops = &mut ctx.ops;
    // The inline data path.
    ops.post_send = Some(datapath::post_send);
    ops.post_recv = Some(datapath::post_recv);
    ops.poll_cq = Some(datapath::poll_cq);
    ops.req_notify_cq = Some(datapath::req_notify_cq);
    ops.post_srq_recv = Some(datapath::post_srq_recv);
    // Memory windows: refused explicitly (the inlines call these).
    ops.alloc_mw = Some(unsupported::alloc_mw);
    ops.bind_mw = Some(unsupported::bind_mw);
    ops.dealloc_mw = Some(unsupported::dealloc_mw);

    // Extended ops reached through verbs_get_ctx_op.
    vctx.sz = std::mem::size_of::<verbs_context>();
    vctx.query_port = Some(query::query_port_ex);
    vctx.query_device_ex = Some(query::query_device_ex);
    vctx.open_xrcd = Some(unsupported::open_xrcd);
    vctx.close_xrcd = Some(unsupported::close_xrcd);
    vctx.create_srq_ex = Some(unsupported::create_srq_ex);
    vctx.create_qp_ex = Some(qp_ex::create_qp_ex);
    vctx.open_qp = Some(unsupported::open_qp);
    vctx.create_cq_ex = Some(cq_ex::create_cq_ex);
    vctx.create_wq = Some(unsupported::create_wq);
    vctx.alloc_dm = Some(unsupported::alloc_dm);
    vctx.alloc_td = Some(unsupported::alloc_td);
    vctx.alloc_parent_domain = Some(unsupported::alloc_parent_domain);
    vctx.create_counters = Some(unsupported::create_counters);
    vctx.ibv_create_flow = Some(unsupported::create_flow);
    vctx.create_rwq_ind_table = Some(unsupported::create_rwq_ind_table);
    vctx.alloc_null_mr = Some(unsupported::alloc_null_mr);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::abi::ibv_context_ops;
    use std::mem::{offset_of, size_of};

    /// The measured facts of `ibverbs-abi.md` (x86_64, rdma-core 44).
    #[test]
    fn context_layout_matches_rdma_core() {
        assert_eq!(size_of::<ibv_context>(), 328);
        let ops = offset_of!(ibv_context, ops);
        assert_eq!(ops, 8);
        assert_eq!(size_of::<ibv_context_ops>(), 256);
        assert_eq!(ops + offset_of!(ibv_context_ops, poll_cq), 96);
        assert_eq!(ops + offset_of!(ibv_context_ops, req_notify_cq), 104);
        assert_eq!(ops + offset_of!(ibv_context_ops, post_srq_recv), 168);
        assert_eq!(ops + offset_of!(ibv_context_ops, post_send), 208);
        assert_eq!(ops + offset_of!(ibv_context_ops, post_recv), 216);
        assert_eq!(offset_of!(ibv_context, cmd_fd), 264);
        assert_eq!(offset_of!(ibv_context, async_fd), 268);
        assert_eq!(offset_of!(ibv_context, num_comp_vectors), 272);
        assert_eq!(offset_of!(ibv_context, abi_compat), 320);
        assert_eq!(size_of::<verbs_context>(), 648);
        assert_eq!(offset_of!(verbs_context, sz), 312);
        assert_eq!(offset_of!(verbs_context, context), 320);
        assert_eq!(offset_of!(Ctx, vctx), 0);
    }
}
