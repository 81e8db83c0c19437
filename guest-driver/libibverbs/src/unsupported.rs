//! What vrdma refuses, and the provider interface it does not have.
//!
//! Verbs vrdma does not implement fail the way a provider without the
//! feature fails: NULL with `errno = EOPNOTSUPP`, or `EOPNOTSUPP` returned.
//! Nothing here succeeds silently.
//!
//! `IBVERBS_PRIVATE_34` is the interface between rdma-core and its
//! provider libraries (`libmlx5`, `libefa`, ...). perftest links those
//! libraries, so their imports must resolve and their constructors call
//! `verbs_register_driver_34`; this library loads no provider, so the
//! registration is ignored and every other entry point refuses.

use std::ffi::{c_int, c_void};

use crate::abi::{
    ibv_alloc_dm_attr, ibv_context, ibv_counters, ibv_counters_init_attr, ibv_dm, ibv_ece,
    ibv_flow, ibv_flow_attr, ibv_gid, ibv_mr, ibv_mw, ibv_mw_bind, ibv_mw_type,
    ibv_parent_domain_init_attr, ibv_pd, ibv_qp, ibv_qp_open_attr, ibv_rwq_ind_table,
    ibv_rwq_ind_table_init_attr, ibv_srq, ibv_srq_init_attr_ex, ibv_td, ibv_td_init_attr, ibv_wq,
    ibv_wq_init_attr, ibv_xrcd, ibv_xrcd_init_attr,
};
use crate::ffi::{int_verb, ptr_verb, set_errno, unsupported};

/// Defines context-op refusals that return NULL with `errno = EOPNOTSUPP`.
macro_rules! refuse_ptr {
    ($($vis:vis $name:ident($($arg:ident: $ty:ty),*) -> $ret:ty, $what:literal;)+) => {$(
        #[doc = concat!("Refuses ", $what, ": NULL, `errno = EOPNOTSUPP`.")]
        ///
        /// # Safety
        ///
        /// Any arguments: none is dereferenced.
        $vis unsafe extern "C" fn $name($(_: $ty),*) -> *mut $ret {
            ptr_verb($what, || Err(unsupported($what)))
        }
    )+};
}

/// Defines refusals that return `EOPNOTSUPP` (also in `errno`).
macro_rules! refuse_int {
    ($($(#[$attr:meta])* $vis:vis $name:ident($($arg:ident: $ty:ty),*), $what:literal;)+) => {$(
        #[doc = concat!("Refuses ", $what, ": `EOPNOTSUPP`.")]
        ///
        /// # Safety
        ///
        /// Any arguments: none is dereferenced.
        $(#[$attr])*
        $vis unsafe extern "C" fn $name($(_: $ty),*) -> c_int {
            int_verb($what, || Err(unsupported($what)))
        }
    )+};
}

refuse_ptr! {
    pub(crate) alloc_mw(pd: *mut ibv_pd, kind: ibv_mw_type) -> ibv_mw, "memory windows (ibv_alloc_mw)";
    pub(crate) open_xrcd(context: *mut ibv_context, attr: *mut ibv_xrcd_init_attr) -> ibv_xrcd, "XRC domains (ibv_open_xrcd)";
    pub(crate) create_srq_ex(context: *mut ibv_context, attr: *mut ibv_srq_init_attr_ex) -> ibv_srq, "XRC and tag-matching SRQs (ibv_create_srq_ex)";
    pub(crate) open_qp(context: *mut ibv_context, attr: *mut ibv_qp_open_attr) -> ibv_qp, "XRC target QPs (ibv_open_qp)";
    pub(crate) create_wq(context: *mut ibv_context, attr: *mut ibv_wq_init_attr) -> ibv_wq, "work queues (ibv_create_wq)";
    pub(crate) alloc_dm(context: *mut ibv_context, attr: *mut ibv_alloc_dm_attr) -> ibv_dm, "device memory (ibv_alloc_dm)";
    pub(crate) alloc_td(context: *mut ibv_context, attr: *mut ibv_td_init_attr) -> ibv_td, "thread domains (ibv_alloc_td)";
    pub(crate) alloc_parent_domain(context: *mut ibv_context, attr: *mut ibv_parent_domain_init_attr) -> ibv_pd, "parent domains (ibv_alloc_parent_domain)";
    pub(crate) create_counters(context: *mut ibv_context, attr: *mut ibv_counters_init_attr) -> ibv_counters, "counters (ibv_create_counters)";
    pub(crate) create_flow(qp: *mut ibv_qp, attr: *mut ibv_flow_attr) -> ibv_flow, "flow steering (ibv_create_flow)";
    pub(crate) create_rwq_ind_table(context: *mut ibv_context, attr: *mut ibv_rwq_ind_table_init_attr) -> ibv_rwq_ind_table, "RSS tables (ibv_create_rwq_ind_table)";
    pub(crate) alloc_null_mr(pd: *mut ibv_pd) -> ibv_mr, "null MRs (ibv_alloc_null_mr)";
    pub ibv_import_device(cmd_fd: c_int) -> ibv_context, "sharing contexts between processes (ibv_import_device)";
    pub ibv_import_pd(context: *mut ibv_context, pd_handle: u32) -> ibv_pd, "importing objects (ibv_import_pd)";
    pub ibv_import_mr(pd: *mut ibv_pd, mr_handle: u32) -> ibv_mr, "importing objects (ibv_import_mr)";
    pub ibv_import_dm(context: *mut ibv_context, dm_handle: u32) -> ibv_dm, "importing objects (ibv_import_dm)";
    pub ibv_reg_dmabuf_mr(pd: *mut ibv_pd, offset: u64, length: usize, iova: u64, fd: c_int, access: c_int) -> ibv_mr, "dma-buf memory regions (ibv_reg_dmabuf_mr)";
}

refuse_int! {
    pub(crate) bind_mw(qp: *mut ibv_qp, mw: *mut ibv_mw, bind: *mut ibv_mw_bind), "memory windows (ibv_bind_mw)";
    pub(crate) dealloc_mw(mw: *mut ibv_mw), "memory windows (ibv_dealloc_mw)";
    pub(crate) close_xrcd(xrcd: *mut ibv_xrcd), "XRC domains (ibv_close_xrcd)";
    pub ibv_attach_mcast(qp: *mut ibv_qp, gid: *const ibv_gid, lid: u16), "multicast (ibv_attach_mcast)";
    pub ibv_detach_mcast(qp: *mut ibv_qp, gid: *const ibv_gid, lid: u16), "multicast (ibv_detach_mcast)";
    pub ibv_query_ece(qp: *mut ibv_qp, ece: *mut ibv_ece), "ECE (ibv_query_ece)";
    pub ibv_set_ece(qp: *mut ibv_qp, ece: *mut ibv_ece), "ECE (ibv_set_ece)";
    pub ibv_resolve_eth_l2_from_gid(context: *mut ibv_context, attr: *mut c_void, mac: *mut u8, vid: *mut u16), "Ethernet L2 resolution (ibv_resolve_eth_l2_from_gid)";
}

/// Defines the `ibv_unimport_*` calls: nothing can have been imported
/// (every import is refused), so there is nothing to release, as
/// rdma-core's own answer for a provider without imports.
macro_rules! unimport {
    ($($name:ident($ty:ty)),+ $(,)?) => {$(
        #[doc = concat!("`", stringify!($name), "`: nothing was imported; does nothing.")]
        pub extern "C" fn $name(_: *mut $ty) {}
    )+};
}

unimport!(
    ibv_unimport_pd(ibv_pd),
    ibv_unimport_mr(ibv_mr),
    ibv_unimport_dm(ibv_dm)
);

fn provider_only(name: &'static str) -> c_int {
    tracing::warn!(
        name,
        "A provider interface was called; vrdma loads no providers"
    );
    set_errno(libc::EOPNOTSUPP);
    libc::EOPNOTSUPP
}

/// Defines `IBVERBS_PRIVATE_34` entry points returning `EOPNOTSUPP`.
/// Their C arguments are ignored (and never read), which the x86_64 C
/// calling convention allows.
macro_rules! provider_int {
    ($($name:ident),+ $(,)?) => {$(
        #[doc = concat!("`", stringify!($name), "` (IBVERBS_PRIVATE_34): a provider interface; `EOPNOTSUPP`.")]
        pub extern "C" fn $name() -> c_int {
            provider_only(stringify!($name))
        }
    )+};
}

provider_int!(
    __ioctl_final_num_attrs,
    execute_ioctl,
    ibv_cmd_advise_mr,
    ibv_cmd_alloc_dm,
    ibv_cmd_alloc_mw,
    ibv_cmd_alloc_pd,
    ibv_cmd_attach_mcast,
    ibv_cmd_close_xrcd,
    ibv_cmd_create_ah,
    ibv_cmd_create_counters,
    ibv_cmd_create_cq,
    ibv_cmd_create_cq_ex,
    ibv_cmd_create_flow,
    ibv_cmd_create_flow_action_esp,
    ibv_cmd_create_qp,
    ibv_cmd_create_qp_ex,
    ibv_cmd_create_qp_ex2,
    ibv_cmd_create_rwq_ind_table,
    ibv_cmd_create_srq,
    ibv_cmd_create_srq_ex,
    ibv_cmd_create_wq,
    ibv_cmd_dealloc_mw,
    ibv_cmd_dealloc_pd,
    ibv_cmd_dereg_mr,
    ibv_cmd_destroy_ah,
    ibv_cmd_destroy_counters,
    ibv_cmd_destroy_cq,
    ibv_cmd_destroy_flow,
    ibv_cmd_destroy_flow_action,
    ibv_cmd_destroy_qp,
    ibv_cmd_destroy_rwq_ind_table,
    ibv_cmd_destroy_srq,
    ibv_cmd_destroy_wq,
    ibv_cmd_detach_mcast,
    ibv_cmd_free_dm,
    ibv_cmd_get_context,
    ibv_cmd_modify_cq,
    ibv_cmd_modify_flow_action_esp,
    ibv_cmd_modify_qp,
    ibv_cmd_modify_qp_ex,
    ibv_cmd_modify_srq,
    ibv_cmd_modify_wq,
    ibv_cmd_open_qp,
    ibv_cmd_open_xrcd,
    ibv_cmd_poll_cq,
    ibv_cmd_post_recv,
    ibv_cmd_post_send,
    ibv_cmd_post_srq_recv,
    ibv_cmd_query_context,
    ibv_cmd_query_device_any,
    ibv_cmd_query_mr,
    ibv_cmd_query_port,
    ibv_cmd_query_qp,
    ibv_cmd_query_srq,
    ibv_cmd_read_counters,
    ibv_cmd_reg_dm_mr,
    ibv_cmd_reg_dmabuf_mr,
    ibv_cmd_reg_mr,
    ibv_cmd_req_notify_cq,
    ibv_cmd_rereg_mr,
    ibv_cmd_resize_cq,
);

/// `_verbs_init_and_alloc_context` (IBVERBS_PRIVATE_34): providers only;
/// NULL with `errno = EOPNOTSUPP`.
pub extern "C" fn _verbs_init_and_alloc_context() -> *mut c_void {
    provider_only("_verbs_init_and_alloc_context");
    std::ptr::null_mut()
}

/// `verbs_open_device` (IBVERBS_PRIVATE_34): providers only; NULL with
/// `errno = EOPNOTSUPP`.
pub extern "C" fn verbs_open_device() -> *mut c_void {
    provider_only("verbs_open_device");
    std::ptr::null_mut()
}

/// `verbs_register_driver_34` (IBVERBS_PRIVATE_34): provider libraries
/// call it from their constructors; vrdma uses no provider and ignores it.
pub extern "C" fn verbs_register_driver_34(_ops: *const c_void) {}

/// `verbs_init_cq` (IBVERBS_PRIVATE_34): providers only; does nothing.
pub extern "C" fn verbs_init_cq() {
    provider_only("verbs_init_cq");
}

/// `verbs_set_ops` (IBVERBS_PRIVATE_34): providers only; does nothing.
pub extern "C" fn verbs_set_ops() {
    provider_only("verbs_set_ops");
}

/// `verbs_uninit_context` (IBVERBS_PRIVATE_34): providers only; does nothing.
pub extern "C" fn verbs_uninit_context() {
    provider_only("verbs_uninit_context");
}

/// `__verbs_log` (IBVERBS_PRIVATE_34): providers' debug log; ignored.
pub extern "C" fn __verbs_log() {}

/// `ibv_read_ibdev_sysfs_file` (IBVERBS_PRIVATE_34): providers only (vrdma
/// has no sysfs device); -1 with `errno = EOPNOTSUPP`, as the function
/// reports errors.
pub extern "C" fn ibv_read_ibdev_sysfs_file() -> c_int {
    provider_only("ibv_read_ibdev_sysfs_file");
    -1
}

/// `ibv_register_driver@IBVERBS_1.1`: the provider registration of
/// libibverbs 1.1 providers; vrdma loads no provider and ignores it.
pub extern "C" fn ibv_register_driver(_name: *const c_void, _init: *const c_void) {}

/// Defines the historical kernel-structure copy helpers of IBVERBS_1.0/1.1,
/// private to rdma-core since: nothing of vrdma uses kernel structures.
macro_rules! kern_copy {
    ($($name:ident),+ $(,)?) => {$(
        #[doc = concat!("`", stringify!($name), "`: a historical rdma-core internal; does nothing.")]
        pub extern "C" fn $name() {
            provider_only(stringify!($name));
        }
    )+};
}

kern_copy!(
    ibv_copy_ah_attr_from_kern,
    ibv_copy_path_rec_from_kern,
    ibv_copy_path_rec_to_kern,
    ibv_copy_qp_attr_from_kern,
);
