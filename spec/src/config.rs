//! The virtio config space: what the device is and what it can do.
//!
//! Cloud Hypervisor's generic vhost-user device drops device-specific feature
//! bits 0–23, so nothing essential is negotiated through them: every
//! capability and limit lives here, read by the driver before it uses the
//! device. The same [`DeviceAttr`] and [`PortAttr`] structures are the
//! payloads of the `QUERY_DEVICE` and `QUERY_PORT` control commands.

use zerocopy::little_endian::{U16, U32, U64};

use crate::wire_struct;

/// `"VRDM"` read as a little-endian u32: identifies a vrdma config space.
pub const CONFIG_MAGIC: u32 = u32::from_le_bytes(*b"VRDM");

wire_struct! {
    /// Device attributes (mirrors the fields of `struct ibv_device_attr`).
    pub struct DeviceAttr {
        pub fw_ver: U64,
        pub node_guid: U64,
        pub sys_image_guid: U64,
        /// Largest single memory region in bytes.
        pub max_mr_size: U64,
        /// Supported page sizes (bit n set: 2^n bytes).
        pub page_size_cap: U64,
        pub vendor_id: U32,
        pub vendor_part_id: U32,
        pub hw_ver: U32,
        pub max_qp: U32,
        pub max_qp_wr: U32,
        pub device_cap_flags: U32,
        pub max_sge: U32,
        pub max_cq: U32,
        pub max_cqe: U32,
        pub max_mr: U32,
        pub max_pd: U32,
        pub max_qp_rd_atom: U32,
        pub max_qp_init_rd_atom: U32,
        pub max_srq: U32,
        pub max_srq_wr: U32,
        pub max_srq_sge: U32,
        pub max_inline_data: U32,
        /// One of [`crate::verbs::atomic_cap`].
        pub atomic_cap: U32,
        /// Total bytes the tenant may register across all MRs.
        pub max_total_mr_bytes: U64,
        pub max_pkeys: U16,
        pub phys_port_cnt: u8,
        /// Address handles (in what was reserved before version 3.2: a
        /// device of an older minor version reports 0 here).
        pub max_ah: U32,
        /// The CM event queue's index (`2 + num_comp_vectors`) when the
        /// device has a connection manager, 0 when it has none (since 3.4;
        /// reserved and 0 before). See [`crate::cm`].
        pub cm_queue: u8,
    }
}

wire_struct! {
    /// Port attributes (mirrors the fields of `struct ibv_port_attr`).
    pub struct PortAttr {
        /// A [`crate::verbs::PortState`].
        pub state: u8,
        /// A [`crate::verbs::Mtu`].
        pub max_mtu: u8,
        /// A [`crate::verbs::Mtu`].
        pub active_mtu: u8,
        /// A [`crate::verbs::LinkLayer`].
        pub link_layer: u8,
        pub gid_tbl_len: U32,
        pub port_cap_flags: U32,
        pub max_msg_sz: U32,
        pub pkey_tbl_len: U16,
        /// 0: the port's link layer is Ethernet (RoCEv2), which has no
        /// LIDs; devices are addressed by their GID.
        pub lid: U16,
        pub sm_lid: U16,
        pub lmc: u8,
        pub max_vl_num: u8,
        pub sm_sl: u8,
        pub active_width: u8,
        pub active_speed: u8,
        pub phys_state: u8,
        pub reserved: [u8; 4],
    }
}

wire_struct! {
    /// The whole config space, at offset 0 of the virtio device config.
    pub struct DeviceConfig {
        /// [`CONFIG_MAGIC`].
        pub magic: U32,
        /// [`crate::SPEC_VERSION_MAJOR`].
        pub version_major: U16,
        /// [`crate::SPEC_VERSION_MINOR`].
        pub version_minor: U16,
        /// Number of event queues (= completion vectors).
        pub num_comp_vectors: U16,
        /// Largest virtqueue size the device accepts.
        pub max_queue_size: U16,
        /// Size of this structure, so a newer device can append fields.
        pub config_size: U32,
        pub device: DeviceAttr,
        /// Port 1, the only port.
        pub port: PortAttr,
        /// GID table entry 0 of port 1 (type RoCEv2, an IPv4-mapped
        /// address: [`crate::gid`]); the same GID QUERY_GID returns.
        pub gid: [u8; 16],
        /// NUL-padded device name the verbs library shows (`ibv_get_device_name`).
        pub name: [u8; 32],
    }
}

/// Size of [`DeviceConfig`] in bytes.
pub const CONFIG_SIZE: usize = core::mem::size_of::<DeviceConfig>();

impl DeviceConfig {
    /// The device name, up to the first NUL, if it is UTF-8.
    pub fn name(&self) -> Option<&str> {
        let end = self
            .name
            .iter()
            .position(|&b| b == 0)
            .unwrap_or(self.name.len());
        core::str::from_utf8(&self.name[..end]).ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_is_fixed() {
        assert_eq!(core::mem::size_of::<DeviceAttr>(), 128);
        assert_eq!(core::mem::size_of::<PortAttr>(), 32);
        assert_eq!(CONFIG_SIZE, 16 + 128 + 32 + 16 + 32);
        assert_eq!(core::mem::offset_of!(DeviceConfig, device), 16);
        assert_eq!(core::mem::offset_of!(DeviceConfig, port), 144);
        assert_eq!(core::mem::offset_of!(DeviceConfig, gid), 176);
        assert_eq!(core::mem::offset_of!(DeviceAttr, max_qp), 52);
        assert_eq!(core::mem::offset_of!(PortAttr, lid), 18);
    }

    #[test]
    fn magic_reads_as_ascii() {
        assert_eq!(&CONFIG_MAGIC.to_le_bytes(), b"VRDM");
    }
}
