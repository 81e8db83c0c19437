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
//! against `libibverbs.map` and the symbols Debian's binaries need.

use crate::{control, device, events, misc, query, srq, unsupported};

/// Defines the trampolines and [`EXPORTS`] from `"NODE" { name => path, }`.
macro_rules! export {
    ($($version:literal { $($name:ident => $path:path,)* })*) => {
        $($(
            std::arch::global_asm!(
                concat!(".pushsection .text.vrdma_export.", stringify!($name), ",\"ax\",@progbits"),
                concat!(".globl ", stringify!($name)),
                concat!(".type ", stringify!($name), ",@function"),
                ".p2align 4",
                concat!(stringify!($name), ":"),
                "jmp {}",
                concat!(".size ", stringify!($name), ", . - ", stringify!($name)),
                ".popsection",
                sym $path,
            );
        )*)*

        /// (version node, symbol) of every export.
        #[cfg(test)]
        pub(crate) const EXPORTS: &[(&str, &str)] = &[$($(($version, stringify!($name)),)*)*];
    };
}

export! {
    "IBVERBS_1.0" {
        ibv_copy_path_rec_from_kern => unsupported::ibv_copy_path_rec_from_kern,
        ibv_copy_qp_attr_from_kern => unsupported::ibv_copy_qp_attr_from_kern,
        ibv_create_comp_channel => events::ibv_create_comp_channel,
        ibv_destroy_comp_channel => events::ibv_destroy_comp_channel,
        ibv_get_sysfs_path => misc::ibv_get_sysfs_path,
        ibv_rate_to_mult => misc::ibv_rate_to_mult,
        ibv_read_sysfs_file => misc::ibv_read_sysfs_file,
        mult_to_ibv_rate => misc::mult_to_ibv_rate,
    }
    "IBVERBS_1.1" {
        ibv_ack_async_event => events::ibv_ack_async_event,
        ibv_ack_cq_events => events::ibv_ack_cq_events,
        ibv_alloc_pd => control::ibv_alloc_pd,
        ibv_attach_mcast => unsupported::ibv_attach_mcast,
        ibv_close_device => device::ibv_close_device,
        ibv_copy_ah_attr_from_kern => unsupported::ibv_copy_ah_attr_from_kern,
        ibv_create_ah => control::ibv_create_ah,
        ibv_create_ah_from_wc => control::ibv_create_ah_from_wc,
        ibv_create_cq => control::ibv_create_cq,
        ibv_create_qp => control::ibv_create_qp,
        ibv_create_srq => srq::ibv_create_srq,
        ibv_dealloc_pd => control::ibv_dealloc_pd,
        ibv_dereg_mr => control::ibv_dereg_mr,
        ibv_destroy_ah => control::ibv_destroy_ah,
        ibv_destroy_cq => control::ibv_destroy_cq,
        ibv_destroy_qp => control::ibv_destroy_qp,
        ibv_destroy_srq => srq::ibv_destroy_srq,
        ibv_detach_mcast => unsupported::ibv_detach_mcast,
        ibv_dofork_range => misc::ibv_dofork_range,
        ibv_dontfork_range => misc::ibv_dontfork_range,
        ibv_event_type_str => misc::ibv_event_type_str,
        ibv_fork_init => misc::ibv_fork_init,
        ibv_free_device_list => device::ibv_free_device_list,
        ibv_get_async_event => events::ibv_get_async_event,
        ibv_get_cq_event => events::ibv_get_cq_event,
        ibv_get_device_guid => device::ibv_get_device_guid,
        ibv_get_device_list => device::ibv_get_device_list,
        ibv_get_device_name => device::ibv_get_device_name,
        ibv_init_ah_from_wc => control::ibv_init_ah_from_wc,
        ibv_modify_qp => control::ibv_modify_qp,
        ibv_modify_srq => srq::ibv_modify_srq,
        ibv_node_type_str => misc::ibv_node_type_str,
        ibv_open_device => device::ibv_open_device,
        ibv_port_state_str => misc::ibv_port_state_str,
        ibv_query_device => query::ibv_query_device,
        ibv_query_gid => query::ibv_query_gid,
        ibv_query_pkey => query::ibv_query_pkey,
        ibv_query_port => query::ibv_query_port,
        ibv_query_qp => control::ibv_query_qp,
        ibv_query_srq => srq::ibv_query_srq,
        ibv_rate_to_mbps => misc::ibv_rate_to_mbps,
        ibv_reg_mr => control::ibv_reg_mr,
        ibv_rereg_mr => control::ibv_rereg_mr,
        ibv_resize_cq => control::ibv_resize_cq,
        ibv_resolve_eth_l2_from_gid => unsupported::ibv_resolve_eth_l2_from_gid,
        ibv_wc_status_str => misc::ibv_wc_status_str,
        mbps_to_ibv_rate => misc::mbps_to_ibv_rate,
    }
    "IBVERBS_1.5" {
        ibv_get_pkey_index => query::ibv_get_pkey_index,
    }
    "IBVERBS_1.6" {
        ibv_qp_to_qp_ex => unsupported::ibv_qp_to_qp_ex,
    }
    "IBVERBS_1.8" {
        ibv_reg_mr_iova2 => control::ibv_reg_mr_iova2,
    }
    "IBVERBS_1.9" {
        ibv_get_device_index => device::ibv_get_device_index,
    }
    "IBVERBS_1.10" {
        ibv_query_ece => unsupported::ibv_query_ece,
        ibv_set_ece => unsupported::ibv_set_ece,
    }
    "IBVERBS_1.11" {
        _ibv_query_gid_ex => query::_ibv_query_gid_ex,
    }
    "IBVERBS_PRIVATE_34" {
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
        ibv_cmd_create_cq_ex => unsupported::ibv_cmd_create_cq_ex,
        ibv_cmd_create_flow => unsupported::ibv_cmd_create_flow,
        ibv_cmd_create_flow_action_esp => unsupported::ibv_cmd_create_flow_action_esp,
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
        ibv_cmd_rereg_mr => unsupported::ibv_cmd_rereg_mr,
        ibv_cmd_resize_cq => unsupported::ibv_cmd_resize_cq,
        ibv_query_gid_type => query::ibv_query_gid_type,
        verbs_allow_disassociate_destroy => unsupported::verbs_allow_disassociate_destroy,
        verbs_init_cq => unsupported::verbs_init_cq,
        verbs_open_device => unsupported::verbs_open_device,
        verbs_register_driver_34 => unsupported::verbs_register_driver_34,
        verbs_set_ops => unsupported::verbs_set_ops,
        verbs_uninit_context => unsupported::verbs_uninit_context,
    }
}

#[cfg(test)]
mod tests {
    use super::EXPORTS;
    use std::collections::BTreeSet;

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

    fn exports() -> BTreeSet<(String, String)> {
        EXPORTS
            .iter()
            .map(|&(v, s)| (v.to_owned(), s.to_owned()))
            .collect()
    }

    #[test]
    fn the_version_script_lists_exactly_the_exports() {
        let map = map_entries(include_str!("../libibverbs.map"));
        assert_eq!(map, exports());
        assert_eq!(EXPORTS.len(), map.len(), "no symbol exported twice");
    }

    /// What Debian 12's ibverbs-utils, perftest and the provider libraries
    /// they load import (measured; see `needed-symbols.txt`).
    #[test]
    fn every_symbol_debian_needs_is_exported_with_its_version() {
        let exports = exports();
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
