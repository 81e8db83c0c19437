//! The connection manager (rdma_cm) of the device: its control commands
//! (opcodes `CM_*`, §5.6 of docs/device-spec.md) and the event records it
//! writes into the buffers the driver posts on the CM event queue
//! (virtqueue `2 + num_comp_vectors`, advertised in
//! [`crate::config::DeviceAttr::cm_queue`]).
//!
//! A CM **channel** is an `rdma_event_channel`: it owns CM IDs, and the
//! events of its IDs carry its number. A channel belongs to the context
//! (frontend connection) that opened it; its events go to that context's
//! CM event queue. Every command on an ID names the channel and the ID.
//! Addresses are IPv4 with a port ([`CmAddr`]).

use zerocopy::little_endian::{I32, U16, U32};

use crate::control::{AhAttr, QpAttr};
use crate::wire_struct;

/// Most private data a command carries or an event reports
/// (`RDMA_MAX_PRIVATE_DATA`).
pub const CM_MAX_PRIVATE_DATA: usize = 256;

/// Size of one CM event record: each buffer the driver posts on the CM
/// event queue holds at least this many device-writable bytes.
pub const CM_EVENT_SIZE: usize = core::mem::size_of::<CmEventRecord>();

/// `rdma_port_space` values (`<rdma/rdma_cma.h>`).
pub mod port_space {
    pub const IPOIB: u32 = 0x0002;
    pub const TCP: u32 = 0x0106;
    pub const UDP: u32 = 0x0111;
    pub const IB: u32 = 0x013f;
}

/// `enum rdma_cm_event_type` (`<rdma/rdma_cma.h>`): the `kind` of a
/// [`CmEventRecord`].
pub mod event_kind {
    pub const ADDR_RESOLVED: u32 = 0;
    pub const ADDR_ERROR: u32 = 1;
    pub const ROUTE_RESOLVED: u32 = 2;
    pub const ROUTE_ERROR: u32 = 3;
    pub const CONNECT_REQUEST: u32 = 4;
    pub const CONNECT_RESPONSE: u32 = 5;
    pub const CONNECT_ERROR: u32 = 6;
    pub const UNREACHABLE: u32 = 7;
    pub const REJECTED: u32 = 8;
    pub const ESTABLISHED: u32 = 9;
    pub const DISCONNECTED: u32 = 10;
    pub const DEVICE_REMOVAL: u32 = 11;
    pub const TIMEWAIT_EXIT: u32 = 15;
}

/// Flags of [`CmConnReq::flags`] and [`CmResolveAddrReq::flags`].
pub mod cm_flags {
    /// CmConnReq: `starting_psn` is given (otherwise the ID's own).
    pub const PSN_VALID: u32 = 0x1;
    /// CmConnReq of CM_CONNECT: bits 8–15 of `flags` are the traffic
    /// class of the connection's path (`rdma_set_option(RDMA_OPTION_ID_TOS)`;
    /// otherwise the route's, 0).
    pub const TRAFFIC_CLASS_VALID: u32 = 0x2;
    /// Where the traffic class sits in CmConnReq's `flags`.
    pub const TRAFFIC_CLASS_SHIFT: u32 = 8;
    /// CmResolveAddrReq: `src` is given (otherwise the device's address).
    pub const SRC_VALID: u32 = 0x1;
}

/// CM ID states as QUERY_ID reports them.
pub mod id_state {
    pub const IDLE: u8 = 0;
    pub const ADDR_BOUND: u8 = 1;
    pub const ADDR_RESOLVED: u8 = 2;
    pub const ROUTE_RESOLVED: u8 = 3;
    pub const LISTEN: u8 = 4;
    pub const CONNECT: u8 = 5;
    pub const ESTABLISHED: u8 = 6;
    pub const DISCONNECT: u8 = 7;
}

wire_struct! {
    /// An IPv4 address and port.
    pub struct CmAddr {
        /// The address in network order (`a.b.c.d` is `[a, b, c, d]`).
        pub ip: [u8; 4],
        /// The port (a number, little-endian as every integer here).
        pub port: U16,
        pub reserved: [u8; 2],
    }
}

wire_struct! {
    /// A channel: CM_OPEN_CHANNEL's response, CM_CLOSE_CHANNEL's request.
    pub struct CmChannelHandle {
        pub channel: U32,
        pub reserved: [u8; 4],
    }
}

wire_struct! {
    /// The ID a command is about (RESOLVE_ROUTE, ESTABLISH, DISCONNECT,
    /// DESTROY_ID, QUERY_ID), and CM_CREATE_ID's response (`channel` =
    /// the channel it was created on).
    pub struct CmIdReq {
        pub channel: U32,
        pub id: U32,
    }
}

wire_struct! {
    /// CM_CREATE_ID.
    pub struct CmCreateIdReq {
        pub channel: U32,
        /// A [`port_space`] value.
        pub port_space: U32,
        /// 0: the port space's (TCP: RC, UDP: UD, IB: RC); else RC 2 or
        /// UD 4 (only with the IB port space, or equal to the port
        /// space's).
        pub qp_type: u8,
        pub reserved: [u8; 7],
    }
}

wire_struct! {
    /// CM_BIND_ADDR.
    pub struct CmBindReq {
        pub channel: U32,
        pub id: U32,
        /// 0.0.0.0 or the device's address; port 0: one is allocated.
        pub addr: CmAddr,
    }
}

wire_struct! {
    /// CM_LISTEN.
    pub struct CmListenReq {
        pub channel: U32,
        pub id: U32,
        pub backlog: U32,
        pub reserved: [u8; 4],
    }
}

wire_struct! {
    /// CM_RESOLVE_ADDR.
    pub struct CmResolveAddrReq {
        pub channel: U32,
        pub id: U32,
        /// Used with [`cm_flags::SRC_VALID`].
        pub src: CmAddr,
        pub dst: CmAddr,
        /// `rdma_resolve_addr`'s timeout (ms); resolution here is
        /// immediate, so it is not used.
        pub timeout_ms: U32,
        pub flags: U32,
    }
}

wire_struct! {
    no Default:
    /// CM_CONNECT and CM_ACCEPT (`struct rdma_conn_param`).
    pub struct CmConnReq {
        pub channel: U32,
        pub id: U32,
        /// The QP the connection is for (24 bits).
        pub qp_num: U32,
        /// Its receive PSN, with [`cm_flags::PSN_VALID`] (24 bits).
        pub starting_psn: U32,
        /// CM_ACCEPT of a UD ID: the QP's Q_Key (0: `RDMA_UDP_QKEY`).
        pub qkey: U32,
        pub responder_resources: u8,
        pub initiator_depth: u8,
        pub flow_control: u8,
        pub retry_count: u8,
        pub rnr_retry_count: u8,
        pub srq: u8,
        /// Bytes of `private_data` that are the message's.
        pub private_data_len: U16,
        pub flags: U32,
        pub private_data: [u8; CM_MAX_PRIVATE_DATA],
    }
}

wire_struct! {
    no Default:
    /// CM_REJECT.
    pub struct CmRejectReq {
        pub channel: U32,
        pub id: U32,
        pub private_data_len: U16,
        pub reserved: [u8; 6],
        pub private_data: [u8; CM_MAX_PRIVATE_DATA],
    }
}

wire_struct! {
    /// CM_INIT_QP_ATTR.
    pub struct CmInitQpAttrReq {
        pub channel: U32,
        pub id: U32,
        /// The state wanted: INIT 1, RTR 2 or RTS 3 (`QpState`).
        pub qp_state: U32,
        pub reserved: [u8; 4],
    }
}

/// [`CmMoveQpReq::flags`].
pub mod move_flags {
    /// Start at INIT (the QP is in RESET or INIT); else at RTR.
    pub const FROM_INIT: u8 = 1 << 0;
    /// The RTS step's SQ PSN is 0 (a UD QP, as rdma_cm's `ucma_init_ud_qp`).
    pub const SQ_PSN_ZERO: u8 = 1 << 1;
}

/// [`CmMoveQpReq`]'s "keep the CM's value" for its attribute overrides.
pub const MOVE_KEEP: u8 = 0xff;

wire_struct! {
    /// CM_MOVE_QP: QP `qpn` moved through the states from INIT (with
    /// [`move_flags::FROM_INIT`]) or RTR up to `qp_state`, each step with
    /// the attributes CM_INIT_QP_ATTR gives for it: what rdma_cm's
    /// `rdma_accept`, the active side's CONNECT_RESPONSE handling and
    /// `rdma_create_qp` do in up to six commands, in one. An override
    /// other than [`MOVE_KEEP`] replaces the CM's value in its step.
    pub struct CmMoveQpReq {
        /// First: the journal names the QP a command touched by its
        /// request's first field.
        pub qpn: U32,
        pub channel: U32,
        pub id: U32,
        /// The last state: INIT 1, RTR 2 or RTS 3 (`QpState`).
        pub qp_state: u8,
        /// [`move_flags`].
        pub flags: u8,
        /// RTR's `max_dest_rd_atomic`.
        pub max_dest_rd_atomic: u8,
        /// RTS's `max_rd_atomic`.
        pub max_rd_atomic: u8,
        /// RTS's `timeout` (`RDMA_OPTION_ID_ACK_TIMEOUT`).
        pub timeout: u8,
        pub reserved: [u8; 7],
    }
}

wire_struct! {
    /// CM_INIT_QP_ATTR's response: what `ibv_modify_qp` (MODIFY_QP) is
    /// given, laid out as [`crate::control::ModifyQpReq`] with `qpn`
    /// left 0.
    pub struct CmQpAttrResp {
        pub reserved: U32,
        /// `ibv_qp_attr_mask` bits of the attributes set.
        pub attr_mask: U32,
        pub attr: QpAttr,
    }
}

wire_struct! {
    /// CM_QUERY_ID's response: what `rdma_cm_id`'s fields say.
    pub struct CmIdInfo {
        pub id: U32,
        pub port_space: U32,
        /// RC 2, UD 4.
        pub qp_type: u8,
        /// An [`id_state`] value.
        pub state: u8,
        /// 1: `sgid` … `flow_label` hold the resolved route.
        pub route_valid: u8,
        pub reserved: u8,
        /// The listener a passive ID came through (0: none).
        pub listen_id: U32,
        pub src: CmAddr,
        pub dst: CmAddr,
        pub remote_qpn: U32,
        pub remote_qkey: U32,
        pub sgid: [u8; 16],
        pub dgid: [u8; 16],
        pub pkey: U16,
        /// An `ibv_mtu` value.
        pub mtu: u8,
        pub traffic_class: u8,
        pub hop_limit: u8,
        pub sl: u8,
        pub packet_life_time: u8,
        pub reserved2: u8,
        pub flow_label: U32,
        pub reserved3: [u8; 12],
    }
}

wire_struct! {
    no Default:
    /// One CM event, as the device writes it into a buffer of the CM event
    /// queue (`struct rdma_cm_event` flattened: `param.conn` and
    /// `param.ud` side by side; the other kind's fields are 0).
    pub struct CmEventRecord {
        /// An [`event_kind`] value.
        pub kind: U32,
        /// 0, a REJ reason (REJECTED), or a negative errno (UNREACHABLE
        /// −ETIMEDOUT, ADDR_ERROR −EHOSTUNREACH), as librdmacm reports.
        pub status: I32,
        /// The channel of the ID.
        pub channel: U32,
        /// The ID (a new one for CONNECT_REQUEST).
        pub id: U32,
        /// CONNECT_REQUEST: the listening ID; else 0.
        pub listen_id: U32,
        /// The peer's QP (`param.conn.qp_num` / `param.ud.qp_num`).
        pub qp_num: U32,
        /// `param.ud.qkey`.
        pub qkey: U32,
        pub responder_resources: u8,
        pub initiator_depth: u8,
        pub flow_control: u8,
        pub retry_count: u8,
        pub rnr_retry_count: u8,
        pub srq: u8,
        /// Bytes of `private_data` reported (the message's whole field, as
        /// Linux reports it: 56, 196, 148, 180, 136; 0 without any).
        pub private_data_len: U16,
        pub reserved: [u8; 4],
        /// `param.ud.ah_attr` (UD events).
        pub ah_attr: AhAttr,
        pub reserved2: [u8; 48],
        pub private_data: [u8; CM_MAX_PRIVATE_DATA],
    }
}

impl CmEventRecord {
    /// The private data the event reports (`private_data_len` bounded by
    /// the field).
    pub fn private_data(&self) -> &[u8] {
        let n = usize::from(self.private_data_len.get()).min(CM_MAX_PRIVATE_DATA);
        &self.private_data[..n]
    }
}

/// What `rdma_connect` and `rdma_accept` are given (`struct
/// rdma_conn_param`), plus the PSN and, for UD, the Q_Key.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ConnParam {
    /// At most 56 bytes in a REQ, 196 in a REP, 180 in a SIDR_REQ, 136 in
    /// a SIDR_REP.
    pub private_data: Vec<u8>,
    pub responder_resources: u8,
    pub initiator_depth: u8,
    pub flow_control: bool,
    /// At most 7 (more is cut to 7, as rdma_cm does).
    pub retry_count: u8,
    pub rnr_retry_count: u8,
    pub srq: bool,
    /// The caller's QP (24 bits).
    pub qp_num: u32,
    /// The QP's receive PSN; `None`: the ID's own (drawn at random when
    /// it was created, as rdma_cm's `seq_num`).
    pub starting_psn: Option<u32>,
    /// UD accept: the Q_Key of the QP; 0 means rdma_cm's
    /// `RDMA_UDP_QKEY` (0x01234567).
    pub qkey: u32,
    /// Connect: the traffic class of the connection's path (the IPv4 TOS
    /// byte of its packets) instead of the route's; both sides' QPs get
    /// it (the REQ carries it).
    pub traffic_class: Option<u8>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use core::mem::{offset_of, size_of};

    #[test]
    fn layouts_are_fixed() {
        assert_eq!(size_of::<CmAddr>(), 8);
        assert_eq!(size_of::<CmChannelHandle>(), 8);
        assert_eq!(size_of::<CmIdReq>(), 8);
        assert_eq!(size_of::<CmCreateIdReq>(), 16);
        assert_eq!(size_of::<CmBindReq>(), 16);
        assert_eq!(size_of::<CmListenReq>(), 16);
        assert_eq!(size_of::<CmResolveAddrReq>(), 32);
        assert_eq!(size_of::<CmConnReq>(), 288);
        assert_eq!(offset_of!(CmConnReq, private_data), 32);
        assert_eq!(size_of::<CmRejectReq>(), 272);
        assert_eq!(size_of::<CmInitQpAttrReq>(), 16);
        assert_eq!(size_of::<CmMoveQpReq>(), 24);
        assert_eq!(size_of::<CmQpAttrResp>(), 112);
        assert_eq!(size_of::<CmIdInfo>(), 96);
        assert_eq!(offset_of!(CmIdInfo, flow_label), 80);
        assert_eq!(CM_EVENT_SIZE, 384);
        assert_eq!(offset_of!(CmEventRecord, ah_attr), 40);
        assert_eq!(offset_of!(CmEventRecord, private_data), 128);
    }
}
