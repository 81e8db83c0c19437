//! The exported symbols and their version nodes.
//!
//! rustc links a cdylib with its own anonymous version script listing every
//! `#[no_mangle]` symbol, and that assignment wins over `libibverbs.map`:
//! such symbols would carry no version, and Debian's binaries (which import
//! `ibv_open_device@IBVERBS_1.1` and so on) would not load. So no function
//! here is `#[no_mangle]`; each exported name is a one-instruction
//! trampoline (`jmp` to the Rust function, arguments untouched) defined in
//! assembly, which rustc's script does not know and `libibverbs.map`
//! versions. The table below is the one list of exports; a test checks it
//! against `libibverbs.map` and the symbols Debian's binaries need, and
//! `tests/tests/ibverbs_compat.rs` against Debian's own libibverbs.so.1.
//!
//! Like rdma-core, some names are exported twice: the current function as
//! the default version (`ibv_alloc_pd@@IBVERBS_1.1`) and a compat one under
//! an older node (`ibv_alloc_pd@IBVERBS_1.0`, which only binaries linked
//! before libibverbs 1.1 bind to). A compat trampoline has a private name
//! (`__vrdma_compat_<name>`) that `.symver` exports as `<name>@<node>`;
//! `libibverbs.map` only has to define the node.

use crate::{compat_1_0, control, device, events, misc, qp_ex, query, rdmacm, srq, unsupported};

/// One trampoline: `$label`, a `jmp` to `$path` in its own section (kept:
/// `R`, since no code refers to it), then `$extra` (a `.symver`).
macro_rules! trampoline {
    ($label:expr, $path:path $(, $extra:expr)?) => {
        std::arch::global_asm!(
            concat!(".pushsection .text.vrdma_export.", $label, ",\"axR\",@progbits"),
            concat!(".globl ", $label),
            concat!(".type ", $label, ",@function"),
            ".p2align 4",
            concat!($label, ":"),
            "jmp {}",
            concat!(".size ", $label, ", . - ", $label),
            $($extra,)?
            ".popsection",
            sym $path,
        );
    };
}

/// Defines the trampolines and [`EXPORTS`] from
/// - `default { "NODE" { name => path, } }`: names with one version,
///   exported as `name@@NODE` by `libibverbs.map`;
/// - `versioned { name => "NODE" path, "OLD" old_path; }`: names with a
///   default version and a compat one (`name@@NODE`, `name@OLD`), both
///   bound by `.symver` (LLD exports the default of such a name only so);
/// - `compat { "NODE" { name => path, } }`: a name with only a compat
///   version (`name@NODE`).
macro_rules! export {
    (
        default { $($version:literal { $($name:ident => $path:path,)* })* }
        versioned { $($vname:ident => $dversion:literal $dpath:path, $oversion:literal $opath:path;)* }
        compat { $($cversion:literal { $($cname:ident => $cpath:path,)* })* }
    ) => {
        $($(trampoline!(stringify!($name), $path);)*)*
        $(
            trampoline!(
                concat!("__vrdma_default_", stringify!($vname)),
                $dpath,
                concat!(".symver __vrdma_default_", stringify!($vname), ", ", stringify!($vname), "@@", $dversion)
            );
            trampoline!(
                concat!("__vrdma_compat_", stringify!($vname)),
                $opath,
                concat!(".symver __vrdma_compat_", stringify!($vname), ", ", stringify!($vname), "@", $oversion)
            );
        )*
        $($(
            trampoline!(
                concat!("__vrdma_compat_", stringify!($cname)),
                $cpath,
                concat!(".symver __vrdma_compat_", stringify!($cname), ", ", stringify!($cname), "@", $cversion)
            );
        )*)*

        /// (version node, symbol) of every default-version export.
        #[cfg(test)]
        pub(crate) const EXPORTS: &[(&str, &str)] = &[
            $($(($version, stringify!($name)),)*)*
            $(($dversion, stringify!($vname)),)*
        ];
        /// (version node, symbol) of every compat (non-default) export.
        #[cfg(test)]
        pub(crate) const COMPAT_EXPORTS: &[(&str, &str)] = &[
            $(($oversion, stringify!($vname)),)*
            $($(($cversion, stringify!($cname)),)*)*
        ];
    };
}

export! {
    default {
        "IBVERBS_1.0" {
            ibv_copy_path_rec_from_kern => unsupported::ibv_copy_path_rec_from_kern,
            ibv_copy_path_rec_to_kern => unsupported::ibv_copy_path_rec_to_kern,
            ibv_copy_qp_attr_from_kern => unsupported::ibv_copy_qp_attr_from_kern,
            ibv_create_comp_channel => events::ibv_create_comp_channel,
            ibv_destroy_comp_channel => events::ibv_destroy_comp_channel,
            ibv_get_sysfs_path => misc::ibv_get_sysfs_path,
            ibv_rate_to_mult => misc::ibv_rate_to_mult,
            ibv_read_sysfs_file => misc::ibv_read_sysfs_file,
            mult_to_ibv_rate => misc::mult_to_ibv_rate,
        }
        "IBVERBS_1.1" {
            ibv_copy_ah_attr_from_kern => unsupported::ibv_copy_ah_attr_from_kern,
            ibv_create_ah_from_wc => control::ibv_create_ah_from_wc,
            ibv_dofork_range => misc::ibv_dofork_range,
            ibv_dontfork_range => misc::ibv_dontfork_range,
            ibv_event_type_str => misc::ibv_event_type_str,
            ibv_fork_init => misc::ibv_fork_init,
            ibv_init_ah_from_wc => control::ibv_init_ah_from_wc,
            ibv_node_type_str => misc::ibv_node_type_str,
            ibv_port_state_str => misc::ibv_port_state_str,
            ibv_rate_to_mbps => misc::ibv_rate_to_mbps,
            ibv_rereg_mr => control::ibv_rereg_mr,
            ibv_resolve_eth_l2_from_gid => unsupported::ibv_resolve_eth_l2_from_gid,
            ibv_wc_status_str => misc::ibv_wc_status_str,
            mbps_to_ibv_rate => misc::mbps_to_ibv_rate,
        }
        "IBVERBS_1.5" {
            ibv_get_pkey_index => query::ibv_get_pkey_index,
        }
        "IBVERBS_1.6" {
            ibv_qp_to_qp_ex => qp_ex::ibv_qp_to_qp_ex,
        }
        "IBVERBS_1.7" {
            ibv_reg_mr_iova => control::ibv_reg_mr_iova,
        }
        "IBVERBS_1.8" {
            ibv_reg_mr_iova2 => control::ibv_reg_mr_iova2,
        }
        "IBVERBS_1.9" {
            ibv_get_device_index => device::ibv_get_device_index,
        }
        "IBVERBS_1.10" {
            ibv_import_device => unsupported::ibv_import_device,
            ibv_import_mr => unsupported::ibv_import_mr,
            ibv_import_pd => unsupported::ibv_import_pd,
            ibv_query_ece => unsupported::ibv_query_ece,
            ibv_set_ece => unsupported::ibv_set_ece,
            ibv_unimport_mr => unsupported::ibv_unimport_mr,
            ibv_unimport_pd => unsupported::ibv_unimport_pd,
        }
        "IBVERBS_1.11" {
            _ibv_query_gid_ex => query::_ibv_query_gid_ex,
            _ibv_query_gid_table => query::_ibv_query_gid_table,
        }
        "IBVERBS_1.12" {
            ibv_reg_dmabuf_mr => unsupported::ibv_reg_dmabuf_mr,
        }
        "IBVERBS_1.13" {
            ibv_import_dm => unsupported::ibv_import_dm,
            ibv_is_fork_initialized => misc::ibv_is_fork_initialized,
            ibv_unimport_dm => unsupported::ibv_unimport_dm,
        }
        "IBVERBS_1.14" {
            ibv_query_qp_data_in_order => qp_ex::ibv_query_qp_data_in_order,
        }
        "IBVERBS_PRIVATE_34" {
            __ioctl_final_num_attrs => unsupported::__ioctl_final_num_attrs,
            __verbs_log => unsupported::__verbs_log,
            _verbs_init_and_alloc_context => unsupported::_verbs_init_and_alloc_context,
            execute_ioctl => unsupported::execute_ioctl,
            ibv_cmd_advise_mr => unsupported::ibv_cmd_advise_mr,
            ibv_cmd_alloc_dm => unsupported::ibv_cmd_alloc_dm,
            ibv_cmd_alloc_mw => unsupported::ibv_cmd_alloc_mw,
            ibv_cmd_alloc_pd => unsupported::ibv_cmd_alloc_pd,
            ibv_cmd_attach_mcast => unsupported::ibv_cmd_attach_mcast,
            ibv_cmd_close_xrcd => unsupported::ibv_cmd_close_xrcd,
            ibv_cmd_create_ah => unsupported::ibv_cmd_create_ah,
            ibv_cmd_create_counters => unsupported::ibv_cmd_create_counters,
            ibv_cmd_create_cq => unsupported::ibv_cmd_create_cq,
            ibv_cmd_create_cq_ex => unsupported::ibv_cmd_create_cq_ex,
            ibv_cmd_create_flow => unsupported::ibv_cmd_create_flow,
            ibv_cmd_create_flow_action_esp => unsupported::ibv_cmd_create_flow_action_esp,
            ibv_cmd_create_qp => unsupported::ibv_cmd_create_qp,
            ibv_cmd_create_qp_ex => unsupported::ibv_cmd_create_qp_ex,
            ibv_cmd_create_qp_ex2 => unsupported::ibv_cmd_create_qp_ex2,
            ibv_cmd_create_rwq_ind_table => unsupported::ibv_cmd_create_rwq_ind_table,
            ibv_cmd_create_srq => unsupported::ibv_cmd_create_srq,
            ibv_cmd_create_srq_ex => unsupported::ibv_cmd_create_srq_ex,
            ibv_cmd_create_wq => unsupported::ibv_cmd_create_wq,
            ibv_cmd_dealloc_mw => unsupported::ibv_cmd_dealloc_mw,
            ibv_cmd_dealloc_pd => unsupported::ibv_cmd_dealloc_pd,
            ibv_cmd_dereg_mr => unsupported::ibv_cmd_dereg_mr,
            ibv_cmd_destroy_ah => unsupported::ibv_cmd_destroy_ah,
            ibv_cmd_destroy_counters => unsupported::ibv_cmd_destroy_counters,
            ibv_cmd_destroy_cq => unsupported::ibv_cmd_destroy_cq,
            ibv_cmd_destroy_flow => unsupported::ibv_cmd_destroy_flow,
            ibv_cmd_destroy_flow_action => unsupported::ibv_cmd_destroy_flow_action,
            ibv_cmd_destroy_qp => unsupported::ibv_cmd_destroy_qp,
            ibv_cmd_destroy_rwq_ind_table => unsupported::ibv_cmd_destroy_rwq_ind_table,
            ibv_cmd_destroy_srq => unsupported::ibv_cmd_destroy_srq,
            ibv_cmd_destroy_wq => unsupported::ibv_cmd_destroy_wq,
            ibv_cmd_detach_mcast => unsupported::ibv_cmd_detach_mcast,
            ibv_cmd_free_dm => unsupported::ibv_cmd_free_dm,
            ibv_cmd_get_context => unsupported::ibv_cmd_get_context,
            ibv_cmd_modify_cq => unsupported::ibv_cmd_modify_cq,
            ibv_cmd_modify_flow_action_esp => unsupported::ibv_cmd_modify_flow_action_esp,
            ibv_cmd_modify_qp => unsupported::ibv_cmd_modify_qp,
            ibv_cmd_modify_qp_ex => unsupported::ibv_cmd_modify_qp_ex,
            ibv_cmd_modify_srq => unsupported::ibv_cmd_modify_srq,
            ibv_cmd_modify_wq => unsupported::ibv_cmd_modify_wq,
            ibv_cmd_open_qp => unsupported::ibv_cmd_open_qp,
            ibv_cmd_open_xrcd => unsupported::ibv_cmd_open_xrcd,
            ibv_cmd_poll_cq => unsupported::ibv_cmd_poll_cq,
            ibv_cmd_post_recv => unsupported::ibv_cmd_post_recv,
            ibv_cmd_post_send => unsupported::ibv_cmd_post_send,
            ibv_cmd_post_srq_recv => unsupported::ibv_cmd_post_srq_recv,
            ibv_cmd_query_context => unsupported::ibv_cmd_query_context,
            ibv_cmd_query_device_any => unsupported::ibv_cmd_query_device_any,
            ibv_cmd_query_mr => unsupported::ibv_cmd_query_mr,
            ibv_cmd_query_port => unsupported::ibv_cmd_query_port,
            ibv_cmd_query_qp => unsupported::ibv_cmd_query_qp,
            ibv_cmd_query_srq => unsupported::ibv_cmd_query_srq,
            ibv_cmd_read_counters => unsupported::ibv_cmd_read_counters,
            ibv_cmd_reg_dm_mr => unsupported::ibv_cmd_reg_dm_mr,
            ibv_cmd_reg_dmabuf_mr => unsupported::ibv_cmd_reg_dmabuf_mr,
            ibv_cmd_reg_mr => unsupported::ibv_cmd_reg_mr,
            ibv_cmd_req_notify_cq => unsupported::ibv_cmd_req_notify_cq,
            ibv_cmd_rereg_mr => unsupported::ibv_cmd_rereg_mr,
            ibv_cmd_resize_cq => unsupported::ibv_cmd_resize_cq,
            ibv_query_gid_type => query::ibv_query_gid_type,
            ibv_read_ibdev_sysfs_file => unsupported::ibv_read_ibdev_sysfs_file,
            verbs_init_cq => unsupported::verbs_init_cq,
            verbs_open_device => unsupported::verbs_open_device,
            verbs_register_driver_34 => unsupported::verbs_register_driver_34,
            verbs_set_ops => unsupported::verbs_set_ops,
            verbs_uninit_context => unsupported::verbs_uninit_context,
        }
        "RDMACM_1.0" {
            raccept => rdmacm::refused::raccept,
            rbind => rdmacm::refused::rbind,
            rclose => rdmacm::refused::rclose,
            rconnect => rdmacm::refused::rconnect,
            rdma_accept => rdmacm::id::rdma_accept,
            rdma_ack_cm_event => rdmacm::event::rdma_ack_cm_event,
            rdma_bind_addr => rdmacm::id::rdma_bind_addr,
            rdma_connect => rdmacm::id::rdma_connect,
            rdma_create_ep => rdmacm::addrinfo::rdma_create_ep,
            rdma_create_event_channel => rdmacm::channel::rdma_create_event_channel,
            rdma_create_id => rdmacm::id::rdma_create_id,
            rdma_create_qp => rdmacm::qp::rdma_create_qp,
            rdma_create_qp_ex => rdmacm::qp::rdma_create_qp_ex,
            rdma_create_srq => rdmacm::qp::rdma_create_srq,
            rdma_create_srq_ex => rdmacm::qp::rdma_create_srq_ex,
            rdma_destroy_ep => rdmacm::addrinfo::rdma_destroy_ep,
            rdma_destroy_event_channel => rdmacm::channel::rdma_destroy_event_channel,
            rdma_destroy_id => rdmacm::id::rdma_destroy_id,
            rdma_destroy_qp => rdmacm::qp::rdma_destroy_qp,
            rdma_destroy_srq => rdmacm::qp::rdma_destroy_srq,
            rdma_disconnect => rdmacm::id::rdma_disconnect,
            rdma_event_str => rdmacm::event::rdma_event_str,
            rdma_free_devices => rdmacm::devices::rdma_free_devices,
            rdma_freeaddrinfo => rdmacm::addrinfo::rdma_freeaddrinfo,
            rdma_get_cm_event => rdmacm::event::rdma_get_cm_event,
            rdma_get_devices => rdmacm::devices::rdma_get_devices,
            rdma_get_dst_port => rdmacm::id::rdma_get_dst_port,
            rdma_get_request => rdmacm::id::rdma_get_request,
            rdma_get_src_port => rdmacm::id::rdma_get_src_port,
            rdma_getaddrinfo => rdmacm::addrinfo::rdma_getaddrinfo,
            rdma_join_multicast => rdmacm::refused::rdma_join_multicast,
            rdma_leave_multicast => rdmacm::refused::rdma_leave_multicast,
            rdma_listen => rdmacm::id::rdma_listen,
            rdma_migrate_id => rdmacm::id::rdma_migrate_id,
            rdma_notify => rdmacm::id::rdma_notify,
            rdma_reject => rdmacm::id::rdma_reject,
            rdma_resolve_addr => rdmacm::id::rdma_resolve_addr,
            rdma_resolve_route => rdmacm::id::rdma_resolve_route,
            rdma_set_option => rdmacm::id::rdma_set_option,
            rfcntl => rdmacm::refused::rfcntl,
            rgetpeername => rdmacm::refused::rgetpeername,
            rgetsockname => rdmacm::refused::rgetsockname,
            rgetsockopt => rdmacm::refused::rgetsockopt,
            riomap => rdmacm::refused::riomap,
            riounmap => rdmacm::refused::riounmap,
            riowrite => rdmacm::refused::riowrite,
            rlisten => rdmacm::refused::rlisten,
            rpoll => rdmacm::refused::rpoll,
            rread => rdmacm::refused::rread,
            rreadv => rdmacm::refused::rreadv,
            rrecv => rdmacm::refused::rrecv,
            rrecvfrom => rdmacm::refused::rrecvfrom,
            rrecvmsg => rdmacm::refused::rrecvmsg,
            rselect => rdmacm::refused::rselect,
            rsend => rdmacm::refused::rsend,
            rsendmsg => rdmacm::refused::rsendmsg,
            rsendto => rdmacm::refused::rsendto,
            rsetsockopt => rdmacm::refused::rsetsockopt,
            rshutdown => rdmacm::refused::rshutdown,
            rsocket => rdmacm::refused::rsocket,
            rwrite => rdmacm::refused::rwrite,
            rwritev => rdmacm::refused::rwritev,
        }
        "RDMACM_1.1" {
            rdma_join_multicast_ex => rdmacm::refused::rdma_join_multicast_ex,
        }
        "RDMACM_1.2" {
            rdma_establish => rdmacm::id::rdma_establish,
            rdma_init_qp_attr => rdmacm::id::rdma_init_qp_attr,
        }
        "RDMACM_1.3" {
            rdma_get_remote_ece => rdmacm::refused::rdma_get_remote_ece,
            rdma_reject_ece => rdmacm::id::rdma_reject_ece,
            rdma_set_local_ece => rdmacm::refused::rdma_set_local_ece,
        }
    }
    versioned {
        ibv_ack_async_event => "IBVERBS_1.1" events::ibv_ack_async_event, "IBVERBS_1.0" compat_1_0::ibv_ack_async_event;
        ibv_ack_cq_events => "IBVERBS_1.1" events::ibv_ack_cq_events, "IBVERBS_1.0" compat_1_0::ibv_ack_cq_events;
        ibv_alloc_pd => "IBVERBS_1.1" control::ibv_alloc_pd, "IBVERBS_1.0" compat_1_0::ibv_alloc_pd;
        ibv_attach_mcast => "IBVERBS_1.1" unsupported::ibv_attach_mcast, "IBVERBS_1.0" compat_1_0::ibv_attach_mcast;
        ibv_close_device => "IBVERBS_1.1" device::ibv_close_device, "IBVERBS_1.0" compat_1_0::ibv_close_device;
        ibv_create_ah => "IBVERBS_1.1" control::ibv_create_ah, "IBVERBS_1.0" compat_1_0::ibv_create_ah;
        ibv_create_cq => "IBVERBS_1.1" control::ibv_create_cq, "IBVERBS_1.0" compat_1_0::ibv_create_cq;
        ibv_create_qp => "IBVERBS_1.1" control::ibv_create_qp, "IBVERBS_1.0" compat_1_0::ibv_create_qp;
        ibv_create_srq => "IBVERBS_1.1" srq::ibv_create_srq, "IBVERBS_1.0" compat_1_0::ibv_create_srq;
        ibv_dealloc_pd => "IBVERBS_1.1" control::ibv_dealloc_pd, "IBVERBS_1.0" compat_1_0::ibv_dealloc_pd;
        ibv_dereg_mr => "IBVERBS_1.1" control::ibv_dereg_mr, "IBVERBS_1.0" compat_1_0::ibv_dereg_mr;
        ibv_destroy_ah => "IBVERBS_1.1" control::ibv_destroy_ah, "IBVERBS_1.0" compat_1_0::ibv_destroy_ah;
        ibv_destroy_cq => "IBVERBS_1.1" control::ibv_destroy_cq, "IBVERBS_1.0" compat_1_0::ibv_destroy_cq;
        ibv_destroy_qp => "IBVERBS_1.1" control::ibv_destroy_qp, "IBVERBS_1.0" compat_1_0::ibv_destroy_qp;
        ibv_destroy_srq => "IBVERBS_1.1" srq::ibv_destroy_srq, "IBVERBS_1.0" compat_1_0::ibv_destroy_srq;
        ibv_detach_mcast => "IBVERBS_1.1" unsupported::ibv_detach_mcast, "IBVERBS_1.0" compat_1_0::ibv_detach_mcast;
        ibv_free_device_list => "IBVERBS_1.1" device::ibv_free_device_list, "IBVERBS_1.0" compat_1_0::ibv_free_device_list;
        ibv_get_async_event => "IBVERBS_1.1" events::ibv_get_async_event, "IBVERBS_1.0" compat_1_0::ibv_get_async_event;
        ibv_get_cq_event => "IBVERBS_1.1" events::ibv_get_cq_event, "IBVERBS_1.0" compat_1_0::ibv_get_cq_event;
        ibv_get_device_guid => "IBVERBS_1.1" device::ibv_get_device_guid, "IBVERBS_1.0" compat_1_0::ibv_get_device_guid;
        ibv_get_device_list => "IBVERBS_1.1" device::ibv_get_device_list, "IBVERBS_1.0" compat_1_0::ibv_get_device_list;
        ibv_get_device_name => "IBVERBS_1.1" device::ibv_get_device_name, "IBVERBS_1.0" compat_1_0::ibv_get_device_name;
        ibv_modify_qp => "IBVERBS_1.1" control::ibv_modify_qp, "IBVERBS_1.0" compat_1_0::ibv_modify_qp;
        ibv_modify_srq => "IBVERBS_1.1" srq::ibv_modify_srq, "IBVERBS_1.0" compat_1_0::ibv_modify_srq;
        ibv_open_device => "IBVERBS_1.1" device::ibv_open_device, "IBVERBS_1.0" compat_1_0::ibv_open_device;
        ibv_query_device => "IBVERBS_1.1" query::ibv_query_device, "IBVERBS_1.0" compat_1_0::ibv_query_device;
        ibv_query_gid => "IBVERBS_1.1" query::ibv_query_gid, "IBVERBS_1.0" compat_1_0::ibv_query_gid;
        ibv_query_pkey => "IBVERBS_1.1" query::ibv_query_pkey, "IBVERBS_1.0" compat_1_0::ibv_query_pkey;
        ibv_query_port => "IBVERBS_1.1" query::ibv_query_port, "IBVERBS_1.0" compat_1_0::ibv_query_port;
        ibv_query_qp => "IBVERBS_1.1" control::ibv_query_qp, "IBVERBS_1.0" compat_1_0::ibv_query_qp;
        ibv_query_srq => "IBVERBS_1.1" srq::ibv_query_srq, "IBVERBS_1.0" compat_1_0::ibv_query_srq;
        ibv_reg_mr => "IBVERBS_1.1" control::ibv_reg_mr, "IBVERBS_1.0" compat_1_0::ibv_reg_mr;
        ibv_resize_cq => "IBVERBS_1.1" control::ibv_resize_cq, "IBVERBS_1.0" compat_1_0::ibv_resize_cq;
    }
    compat {
        "IBVERBS_1.1" {
            ibv_register_driver => unsupported::ibv_register_driver,
        }
    }
}

// `verbs_allow_disassociate_destroy` (IBVERBS_PRIVATE_34) is a `bool`
// variable providers read, not a function: false (vrdma never
// disassociates a device from its contexts).
std::arch::global_asm!(
    ".pushsection .rodata.vrdma_export.verbs_allow_disassociate_destroy,\"a\",@progbits",
    ".globl verbs_allow_disassociate_destroy",
    ".type verbs_allow_disassociate_destroy,@object",
    ".size verbs_allow_disassociate_destroy, 1",
    "verbs_allow_disassociate_destroy:",
    ".byte 0",
    ".popsection",
);
#[cfg(test)]
mod tests {
    use super::{COMPAT_EXPORTS, EXPORTS};
    use std::collections::BTreeSet;

    /// The exported variable (not a trampoline).
    const DATA_EXPORTS: &[(&str, &str)] =
        &[("IBVERBS_PRIVATE_34", "verbs_allow_disassociate_destroy")];

    /// (version, symbol) pairs of a version script.
    fn map_entries(map: &str) -> BTreeSet<(String, String)> {
        let mut out = BTreeSet::new();
        let mut node = None;
        for line in map.lines().map(str::trim) {
            if let Some(name) = line.strip_suffix(" {") {
                node = Some(name.to_owned());
            } else if line.starts_with('}') {
                node = None;
            } else if let (Some(n), Some(sym)) = (&node, line.strip_suffix(';')) {
                if !sym.contains(':') && !sym.contains('*') {
                    out.insert((n.clone(), sym.to_owned()));
                }
            }
        }
        out
    }

    fn set(list: &[&[(&str, &str)]]) -> BTreeSet<(String, String)> {
        list.iter()
            .flat_map(|l| l.iter())
            .map(|&(v, s)| (v.to_owned(), s.to_owned()))
            .collect()
    }

    /// Every default export is in the script under its node, and so is
    /// every compat one (LLD exports `name@NODE` only if the script names
    /// it under `NODE`, as rdma-core's own script does), and nothing else.
    #[test]
    fn the_version_script_lists_exactly_the_exports() {
        let map = map_entries(include_str!("../libibverbs.map"));
        assert_eq!(map, set(&[EXPORTS, COMPAT_EXPORTS, DATA_EXPORTS]));
        let defaults = set(&[EXPORTS, DATA_EXPORTS]);
        assert_eq!(
            EXPORTS.len() + DATA_EXPORTS.len(),
            defaults.len(),
            "no symbol exported twice"
        );
        let names: BTreeSet<_> = defaults.iter().map(|(_, s)| s).collect();
        assert_eq!(names.len(), defaults.len(), "one default version per name");
    }

    /// What Debian 12's ibverbs-utils, perftest and the provider libraries
    /// they load import (measured; see `needed-symbols.txt`).
    #[test]
    fn every_symbol_debian_needs_is_exported_with_its_version() {
        let exports = set(&[EXPORTS, DATA_EXPORTS]);
        let needed: Vec<(String, String)> = include_str!("../needed-symbols.txt")
            .lines()
            .filter(|l| !l.trim().is_empty() && !l.starts_with('#'))
            .map(|l| {
                let (v, s) = l.split_once(' ').expect("VERSION symbol");
                (v.to_owned(), s.trim().to_owned())
            })
            .collect();
        assert_eq!(needed.len(), 109);
        let missing: Vec<_> = needed.iter().filter(|n| !exports.contains(n)).collect();
        assert!(missing.is_empty(), "not exported: {missing:?}");
    }
}
