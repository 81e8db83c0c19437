//! Control-queue commands: the verbs control path.
//!
//! A command is one descriptor chain on the control queue: device-readable
//! descriptors holding a [`RequestHeader`] followed by the command's request
//! payload, then device-writable descriptors with room for a
//! [`ResponseHeader`] followed by the response payload. The device reads the
//! request once into its own buffer, executes it and writes the response; the
//! used length is the number of response bytes written.
//!
//! `status` in the response is 0 on success or a positive Linux errno that a
//! verbs library returns to the application unchanged.

use zerocopy::little_endian::{U16, U32, U64};

use crate::cm;
use crate::verbs::wire_enum;
use crate::wire_struct;

wire_enum! {
    /// Control command codes.
    Opcode: u16 {
        QueryDevice = 1,
        QueryPort = 2,
        QueryGid = 3,
        AllocPd = 4,
        DeallocPd = 5,
        RegMr = 6,
        DeregMr = 7,
        CreateCq = 8,
        DestroyCq = 9,
        CreateQp = 10,
        ModifyQp = 11,
        QueryQp = 12,
        DestroyQp = 13,
        RegMrSg = 14,
        SetDoorbell = 15,
        CreateEq = 16,
        CreateSrq = 17,
        ModifySrq = 18,
        QuerySrq = 19,
        DestroySrq = 20,
        CreateAh = 21,
        DestroyAh = 22,
        /// The connection manager's commands (§5.6, [`crate::cm`]).
        CmOpenChannel = 23,
        CmCloseChannel = 24,
        CmCreateId = 25,
        CmBindAddr = 26,
        CmListen = 27,
        CmResolveAddr = 28,
        CmResolveRoute = 29,
        CmConnect = 30,
        CmAccept = 31,
        CmReject = 32,
        CmEstablish = 33,
        CmDisconnect = 34,
        CmDestroyId = 35,
        CmInitQpAttr = 36,
        CmQueryId = 37,
        /// CM_INIT_QP_ATTR and MODIFY_QP for each state up to one, in one
        /// command ([`cm::CmMoveQpReq`]).
        CmMoveQp = 38,
    }
}

/// Most segments a `REG_MR_SG` list may have. The list is at most
/// `MAX_MR_SEGMENTS * 16` = 4 KiB of guest memory, which the device copies
/// once; and the shadow it becomes (one piece per segment and memory slot it
/// crosses, at most [`MAX_MR_PIECES`]) fits in one registration message to
/// the host datapath.
pub const MAX_MR_SEGMENTS: u32 = 256;

/// Most pieces of guest memory one memory region may be made of (segments
/// split at memory-slot boundaries).
pub const MAX_MR_PIECES: usize = 512;

impl Opcode {
    /// Exact length of the request payload of this command.
    pub fn request_len(self) -> usize {
        use core::mem::size_of;
        match self {
            Opcode::QueryDevice | Opcode::AllocPd => 0,
            Opcode::QueryPort => size_of::<QueryPortReq>(),
            Opcode::QueryGid => size_of::<QueryGidReq>(),
            Opcode::DeallocPd => size_of::<PdHandle>(),
            Opcode::RegMr => size_of::<RegMrReq>(),
            Opcode::RegMrSg => size_of::<RegMrSgReq>(),
            Opcode::DeregMr => size_of::<MrHandle>(),
            Opcode::CreateCq => size_of::<CreateCqReq>(),
            Opcode::DestroyCq => size_of::<CqHandle>(),
            Opcode::CreateQp => size_of::<CreateQpReq>(),
            Opcode::ModifyQp => size_of::<ModifyQpReq>(),
            Opcode::QueryQp => size_of::<QueryQpReq>(),
            Opcode::DestroyQp => size_of::<QpHandle>(),
            Opcode::SetDoorbell => size_of::<SetDoorbellReq>(),
            Opcode::CreateEq => size_of::<CreateEqReq>(),
            Opcode::CreateSrq => size_of::<CreateSrqReq>(),
            Opcode::ModifySrq => size_of::<ModifySrqReq>(),
            Opcode::QuerySrq | Opcode::DestroySrq => size_of::<SrqHandle>(),
            Opcode::CreateAh => size_of::<CreateAhReq>(),
            Opcode::DestroyAh => size_of::<AhHandle>(),
            Opcode::CmOpenChannel => 0,
            Opcode::CmCloseChannel => size_of::<cm::CmChannelHandle>(),
            Opcode::CmCreateId => size_of::<cm::CmCreateIdReq>(),
            Opcode::CmBindAddr => size_of::<cm::CmBindReq>(),
            Opcode::CmListen => size_of::<cm::CmListenReq>(),
            Opcode::CmResolveAddr => size_of::<cm::CmResolveAddrReq>(),
            Opcode::CmConnect | Opcode::CmAccept => size_of::<cm::CmConnReq>(),
            Opcode::CmReject => size_of::<cm::CmRejectReq>(),
            Opcode::CmInitQpAttr => size_of::<cm::CmInitQpAttrReq>(),
            Opcode::CmMoveQp => size_of::<cm::CmMoveQpReq>(),
            Opcode::CmResolveRoute
            | Opcode::CmEstablish
            | Opcode::CmDisconnect
            | Opcode::CmDestroyId
            | Opcode::CmQueryId => size_of::<cm::CmIdReq>(),
        }
    }

    /// Length of the response payload of this command when it succeeds (a
    /// failed command has none). The driver provides at least
    /// `size_of::<ResponseHeader>() + response_len()` writable bytes.
    pub fn response_len(self) -> usize {
        use core::mem::size_of;
        match self {
            Opcode::QueryDevice => size_of::<crate::config::DeviceAttr>(),
            Opcode::QueryPort => size_of::<crate::config::PortAttr>(),
            Opcode::QueryGid => size_of::<QueryGidResp>(),
            Opcode::AllocPd => size_of::<PdHandle>(),
            Opcode::RegMr | Opcode::RegMrSg => size_of::<RegMrResp>(),
            Opcode::CreateCq => size_of::<CqHandle>(),
            Opcode::CreateQp => size_of::<CreateQpResp>(),
            Opcode::QueryQp => size_of::<QueryQpResp>(),
            Opcode::CreateSrq | Opcode::QuerySrq => size_of::<SrqAttr>(),
            Opcode::CreateAh => size_of::<AhHandle>(),
            Opcode::CmOpenChannel => size_of::<cm::CmChannelHandle>(),
            Opcode::CmCreateId => size_of::<cm::CmIdReq>(),
            Opcode::CmBindAddr => size_of::<cm::CmAddr>(),
            Opcode::CmInitQpAttr | Opcode::CmMoveQp => size_of::<cm::CmQpAttrResp>(),
            Opcode::CmQueryId => size_of::<cm::CmIdInfo>(),
            Opcode::CmCloseChannel
            | Opcode::CmListen
            | Opcode::CmResolveAddr
            | Opcode::CmResolveRoute
            | Opcode::CmConnect
            | Opcode::CmAccept
            | Opcode::CmReject
            | Opcode::CmEstablish
            | Opcode::CmDisconnect
            | Opcode::CmDestroyId => 0,
            Opcode::DeallocPd
            | Opcode::DeregMr
            | Opcode::DestroyCq
            | Opcode::ModifyQp
            | Opcode::DestroyQp
            | Opcode::SetDoorbell
            | Opcode::CreateEq
            | Opcode::ModifySrq
            | Opcode::DestroySrq
            | Opcode::DestroyAh => 0,
        }
    }
}

wire_struct! {
    /// First bytes of every request.
    pub struct RequestHeader {
        /// An [`Opcode`].
        pub opcode: U16,
        /// Must be 0.
        pub flags: U16,
        /// Length of the request payload that follows the header.
        pub payload_len: U32,
    }
}

wire_struct! {
    /// First bytes of every response.
    pub struct ResponseHeader {
        /// 0, or a positive Linux errno.
        pub status: U32,
        /// Length of the response payload that follows the header.
        pub payload_len: U32,
    }
}

impl ResponseHeader {
    /// Splits a whole response (the used length the device reported) into
    /// its header and payload: `None` when it is shorter than a header, or
    /// when the header's `payload_len` is not the length of the rest, which
    /// a device never writes.
    pub fn split(response: &[u8]) -> Option<(ResponseHeader, &[u8])> {
        use zerocopy::FromBytes;
        let (header, payload) = ResponseHeader::read_from_prefix(response).ok()?;
        (header.payload_len.get() as usize == payload.len()).then_some((header, payload))
    }
}

wire_struct! {
    /// Request of `QUERY_PORT`; the response is a [`crate::config::PortAttr`].
    pub struct QueryPortReq {
        pub port_num: u8,
        pub reserved: [u8; 7],
    }
}

wire_struct! {
    /// Request of `QUERY_GID`.
    pub struct QueryGidReq {
        pub port_num: u8,
        pub reserved: [u8; 3],
        pub index: U32,
    }
}

/// GID types (`enum ibv_gid_type`).
pub mod gid_type {
    pub const IB: u32 = 0;
    pub const ROCE_V1: u32 = 1;
    pub const ROCE_V2: u32 = 2;
}

wire_struct! {
    /// Response of `QUERY_GID`.
    pub struct QueryGidResp {
        pub gid: [u8; 16],
        /// One of [`gid_type`].
        pub gid_type: U32,
        pub reserved: U32,
    }
}

wire_struct! {
    /// Response of `ALLOC_PD`; request of `DEALLOC_PD`.
    pub struct PdHandle {
        pub pdn: U32,
        pub reserved: U32,
    }
}

wire_struct! {
    /// Request of `REG_MR`.
    pub struct RegMrReq {
        pub pdn: U32,
        /// [`crate::verbs::access`] flags.
        pub access: U32,
        /// Start of the region in guest-physical address space.
        pub addr: U64,
        pub length: U64,
        /// The address the region is known by in work requests (`iova` of
        /// `ibv_reg_mr_iova2`; equal to `addr` for `ibv_reg_mr`).
        pub iova: U64,
    }
}

wire_struct! {
    /// Request of `REG_MR_SG`: a memory region whose guest memory is a list
    /// of segments (an application buffer in a VM is virtually contiguous but
    /// physically scattered). The region's bytes are the segments' bytes in
    /// list order; `length` must equal their sum.
    pub struct RegMrSgReq {
        pub pdn: U32,
        /// [`crate::verbs::access`] flags.
        pub access: U32,
        /// The address the region is known by in work requests.
        pub iova: U64,
        pub length: U64,
        /// Number of [`MrSgSegment`]s at `list_addr`: 1 to [`MAX_MR_SEGMENTS`].
        pub nsegs: U32,
        pub reserved: U32,
        /// Guest address of the segment list (any alignment).
        pub list_addr: U64,
    }
}

wire_struct! {
    /// One entry of a `REG_MR_SG` segment list.
    pub struct MrSgSegment {
        /// Guest address of the segment's first byte.
        pub addr: U64,
        /// Bytes in the segment, at least 1.
        pub len: U64,
    }
}

wire_struct! {
    /// Response of `REG_MR` and `REG_MR_SG`.
    pub struct RegMrResp {
        /// Handle for `DEREG_MR`.
        pub handle: U32,
        pub lkey: U32,
        pub rkey: U32,
        pub reserved: U32,
    }
}

wire_struct! {
    /// Request of `DEREG_MR`.
    pub struct MrHandle {
        pub handle: U32,
        pub reserved: U32,
    }
}

wire_struct! {
    /// Request of `CREATE_CQ`. The ring is
    /// [`crate::ring::cq_ring_bytes`]`(depth)` bytes at `ring_addr`.
    pub struct CreateCqReq {
        /// Number of CQEs, a power of two (see [`crate::ring::cq_depth`]).
        pub depth: U32,
        /// Completion vector (event queue) the CQ's events go to.
        pub comp_vector: U32,
        /// Guest-physical address of the ring, [`crate::ring::RING_ALIGN`]-aligned.
        pub ring_addr: U64,
    }
}

wire_struct! {
    /// Response of `CREATE_CQ`; request of `DESTROY_CQ`.
    pub struct CqHandle {
        pub cqn: U32,
        pub reserved: U32,
    }
}

wire_struct! {
    /// Request of `SET_DOORBELL`: the device's doorbell page
    /// ([`crate::ring::doorbell`]). Given once, after `DRIVER_OK` and before
    /// the first `CREATE_QP`; a second one is refused with `EEXIST`.
    pub struct SetDoorbellReq {
        /// Guest-physical address of the page, [`crate::ring::RING_ALIGN`]-aligned.
        pub addr: U64,
    }
}

wire_struct! {
    /// Request of `CREATE_EQ`: the event ring of one completion vector,
    /// [`crate::ring::event_ring_bytes`]`(depth)` bytes at `ring_addr`. One
    /// per vector (`EEXIST` for a second); events of a vector without one
    /// are dropped.
    pub struct CreateEqReq {
        /// The completion vector, below `num_comp_vectors`.
        pub vector: U32,
        /// Number of events, a power of two.
        pub depth: U32,
        /// Guest-physical address of the ring, [`crate::ring::RING_ALIGN`]-aligned.
        pub ring_addr: U64,
    }
}

wire_struct! {
    /// Queue-pair capacities (`struct ibv_qp_cap`).
    pub struct QpCap {
        pub max_send_wr: U32,
        pub max_recv_wr: U32,
        pub max_send_sge: U32,
        pub max_recv_sge: U32,
        pub max_inline_data: U32,
    }
}

/// `srqn` value that means "no shared receive queue".
pub const NO_SRQ: u32 = u32::MAX;

wire_struct! {
    /// Request of `CREATE_QP`. The driver sizes its rings with
    /// [`crate::ring::sq_geometry`]/[`crate::ring::rq_geometry`] from `cap`;
    /// the device computes the same geometry ([`crate::limits::QpGrant`])
    /// and checks the rings lie in guest memory.
    pub struct CreateQpReq {
        pub pdn: U32,
        pub send_cqn: U32,
        pub recv_cqn: U32,
        /// [`NO_SRQ`] when the QP has its own receive queue.
        pub srqn: U32,
        /// A [`crate::verbs::QpType`].
        pub qp_type: u8,
        /// Non-zero: every send WQE completes with a CQE.
        pub sq_sig_all: u8,
        pub reserved: [u8; 6],
        pub cap: QpCap,
        pub reserved2: U32,
        pub sq_ring_addr: U64,
        pub rq_ring_addr: U64,
    }
}

wire_struct! {
    /// Response of `CREATE_QP`.
    pub struct CreateQpResp {
        pub qpn: U32,
        /// The QP's bit in the doorbell page ([`crate::ring::doorbell::bit`]).
        pub db_index: U32,
        /// The capacities granted (at least those asked for).
        pub cap: QpCap,
        pub reserved2: U32,
    }
}

wire_struct! {
    /// Request of `DESTROY_QP`.
    pub struct QpHandle {
        pub qpn: U32,
        pub reserved: U32,
    }
}

wire_struct! {
    /// Address vector (`struct ibv_ah_attr` with its `ibv_global_route`).
    pub struct AhAttr {
        pub dgid: [u8; 16],
        pub flow_label: U32,
        pub dlid: U16,
        pub sgid_index: u8,
        pub hop_limit: u8,
        pub traffic_class: u8,
        pub is_global: u8,
        pub sl: u8,
        pub src_path_bits: u8,
        pub static_rate: u8,
        pub port_num: u8,
        pub reserved: [u8; 10],
    }
}

wire_struct! {
    /// QP attributes (`struct ibv_qp_attr`); which fields matter is given by
    /// an attribute mask of [`crate::qp_state::mask`] bits.
    pub struct QpAttr {
        /// A [`crate::verbs::QpState`].
        pub qp_state: u8,
        pub cur_qp_state: u8,
        /// A [`crate::verbs::Mtu`].
        pub path_mtu: u8,
        pub path_mig_state: u8,
        pub qkey: U32,
        pub rq_psn: U32,
        pub sq_psn: U32,
        pub dest_qp_num: U32,
        pub qp_access_flags: U32,
        pub cap: QpCap,
        pub ah_attr: AhAttr,
        pub pkey_index: U16,
        pub en_sqd_async_notify: u8,
        pub sq_draining: u8,
        pub max_rd_atomic: u8,
        pub max_dest_rd_atomic: u8,
        pub min_rnr_timer: u8,
        pub port_num: u8,
        pub timeout: u8,
        pub retry_cnt: u8,
        pub rnr_retry: u8,
        pub reserved: [u8; 9],
    }
}

wire_struct! {
    /// Request of `MODIFY_QP`.
    pub struct ModifyQpReq {
        pub qpn: U32,
        /// [`crate::qp_state::mask`] bits saying which attributes to apply.
        pub attr_mask: U32,
        pub attr: QpAttr,
    }
}

wire_struct! {
    /// Request of `QUERY_QP`.
    pub struct QueryQpReq {
        pub qpn: U32,
        pub attr_mask: U32,
    }
}

wire_struct! {
    /// Response of `QUERY_QP`: all attributes, whatever the mask asked for,
    /// plus the creation attributes `ibv_query_qp` also returns.
    pub struct QueryQpResp {
        pub attr: QpAttr,
        pub send_cqn: U32,
        pub recv_cqn: U32,
        pub srqn: U32,
        pub qp_type: u8,
        pub sq_sig_all: u8,
        pub reserved: [u8; 2],
    }
}

wire_struct! {
    /// Request of `CREATE_SRQ`: a shared receive queue, a receive ring
    /// ([`crate::ring::rq_geometry`]`(max_wr, max_sge)`) at `ring_addr`
    /// that the QPs created with its `srqn` take their receives from.
    pub struct CreateSrqReq {
        pub pdn: U32,
        /// Receive WQEs wanted (at least 1).
        pub max_wr: U32,
        pub max_sge: U32,
        /// The limit armed at creation (0: not armed).
        pub srq_limit: U32,
        /// Guest-physical address of the ring, [`crate::ring::RING_ALIGN`]-aligned.
        pub ring_addr: U64,
    }
}

wire_struct! {
    /// Response of `CREATE_SRQ` (the SRQ's number and granted capacities)
    /// and of `QUERY_SRQ` (its attributes now: `srq_limit` is 0 once the
    /// limit event fired).
    pub struct SrqAttr {
        pub srqn: U32,
        pub max_wr: U32,
        pub max_sge: U32,
        pub srq_limit: U32,
    }
}

wire_struct! {
    /// Request of `QUERY_SRQ` and `DESTROY_SRQ`.
    pub struct SrqHandle {
        pub srqn: U32,
        pub reserved: U32,
    }
}

/// `attr_mask` bits of `MODIFY_SRQ` (`enum ibv_srq_attr_mask`).
pub mod srq_mask {
    /// Resize (`max_wr`): refused, as mlx5 refuses it.
    pub const MAX_WR: u32 = 1;
    /// Arm the limit event at `srq_limit`.
    pub const LIMIT: u32 = 2;
}

wire_struct! {
    /// Request of `MODIFY_SRQ`.
    pub struct ModifySrqReq {
        pub srqn: U32,
        /// [`srq_mask`] bits.
        pub attr_mask: U32,
        pub max_wr: U32,
        pub srq_limit: U32,
    }
}

wire_struct! {
    /// Request of `CREATE_AH`: an address handle for UD sends, in `pdn`,
    /// towards the GID of `attr`'s GRH.
    pub struct CreateAhReq {
        pub pdn: U32,
        pub reserved: U32,
        pub attr: AhAttr,
    }
}

wire_struct! {
    /// Response of `CREATE_AH` (the number UD send WQEs name,
    /// [`crate::ring::UdDest`]); request of `DESTROY_AH`.
    pub struct AhHandle {
        pub ahn: U32,
        pub reserved: U32,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use core::mem::size_of;

    #[test]
    fn layouts_are_fixed() {
        assert_eq!(size_of::<RequestHeader>(), 8);
        assert_eq!(size_of::<ResponseHeader>(), 8);
        assert_eq!(size_of::<RegMrReq>(), 32);
        assert_eq!(size_of::<RegMrResp>(), 16);
        assert_eq!(size_of::<RegMrSgReq>(), 40);
        assert_eq!(size_of::<MrSgSegment>(), 16);
        assert_eq!(core::mem::offset_of!(RegMrSgReq, list_addr), 32);
        assert_eq!(size_of::<CreateCqReq>(), 16);
        assert_eq!(size_of::<SetDoorbellReq>(), 8);
        assert_eq!(size_of::<CreateEqReq>(), 16);
        assert_eq!(size_of::<QpCap>(), 20);
        assert_eq!(size_of::<CreateQpReq>(), 64);
        assert_eq!(size_of::<AhAttr>(), 40);
        assert_eq!(size_of::<QpAttr>(), 104);
        assert_eq!(size_of::<ModifyQpReq>(), 112);
        assert_eq!(core::mem::offset_of!(QpAttr, ah_attr), 44);
        assert_eq!(size_of::<CreateSrqReq>(), 24);
        assert_eq!(size_of::<SrqAttr>(), 16);
        assert_eq!(size_of::<SrqHandle>(), 8);
        assert_eq!(size_of::<ModifySrqReq>(), 16);
        assert_eq!(size_of::<CreateAhReq>(), 48);
        assert_eq!(size_of::<AhHandle>(), 8);
    }

    #[test]
    fn a_response_splits_where_its_header_says() {
        use zerocopy::IntoBytes;
        let header = ResponseHeader {
            status: 0.into(),
            payload_len: 3.into(),
        };
        let mut bytes = header.as_bytes().to_vec();
        bytes.extend_from_slice(&[1, 2, 3]);
        assert_eq!(
            ResponseHeader::split(&bytes),
            Some((header, &[1u8, 2, 3][..]))
        );
        assert_eq!(ResponseHeader::split(&bytes[..10]), None, "payload cut");
        bytes.push(4);
        assert_eq!(ResponseHeader::split(&bytes), None, "payload longer");
        assert_eq!(ResponseHeader::split(&bytes[..7]), None, "no header");
    }

    #[test]
    fn opcodes_round_trip() {
        for code in 1..=38u16 {
            let op = Opcode::try_from(code).expect("defined opcode");
            assert_eq!(u16::from(op), code);
        }
        assert!(Opcode::try_from(0).is_err());
        assert!(Opcode::try_from(39).is_err());
    }
}
