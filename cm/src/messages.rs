//! The CM messages and their byte layouts (IBA 12.6, Linux
//! `ibta_vol1_c12.h`; the offsets below are body offsets, after the 24-byte
//! MAD header, as in `/work/shared/rdmacm-notes.md` §2.5).
//!
//! Each message is a plain struct holding every field of its layout at the
//! field's wire width (wider integer types are checked on encode). Bodies
//! are read with constant offsets from a fixed 256-byte buffer, so decoding
//! cannot go out of bounds; the only refusals are the reserved codes and
//! over-long length fields listed in [`DecodeError`].

use std::fmt;

use crate::gid::Gid;
use crate::mad::{at, fit, fit8, DecodeError, EncodeError, PrivateData, Reader, Writer};

/// Private data sizes Linux uses (`IB_CM_*_PRIVATE_DATA_SIZE`).
pub const REQ_PRIVATE_DATA_SIZE: usize = 92;
pub const MRA_PRIVATE_DATA_SIZE: usize = 222;
pub const REJ_PRIVATE_DATA_SIZE: usize = 148;
pub const REP_PRIVATE_DATA_SIZE: usize = 196;
pub const RTU_PRIVATE_DATA_SIZE: usize = 224;
pub const DREQ_PRIVATE_DATA_SIZE: usize = 220;
pub const DREP_PRIVATE_DATA_SIZE: usize = 224;
pub const SIDR_REQ_PRIVATE_DATA_SIZE: usize = 216;
pub const SIDR_REP_PRIVATE_DATA_SIZE: usize = 136;
/// REJ Additional Rejection Information and SIDR_REP Additional Information.
pub const ARI_SIZE: usize = 72;

/// REQ Transport Service Type (2 bits).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum TransportType {
    #[default]
    Rc = 0,
    Uc = 1,
    Rd = 2,
    /// XRC and future types: see the Extended Transport Type field.
    Extended = 3,
}

impl TransportType {
    fn from_bits(v: u8) -> TransportType {
        match v & 3 {
            0 => TransportType::Rc,
            1 => TransportType::Uc,
            2 => TransportType::Rd,
            _ => TransportType::Extended,
        }
    }
}

/// Which message an MRA or REJ answers ("Message MRAed", "Message
/// Rejected"); the fourth code is reserved.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum TargetMessage {
    #[default]
    Req = 0,
    Rep = 1,
    Other = 2,
}

impl TargetMessage {
    fn decode(field: &'static str, byte: u8) -> Result<TargetMessage, DecodeError> {
        match byte >> 6 {
            0 => Ok(TargetMessage::Req),
            1 => Ok(TargetMessage::Rep),
            2 => Ok(TargetMessage::Other),
            value => Err(DecodeError::ReservedValue { field, value }),
        }
    }
}

/// A REJ reason (IBA table 112, Linux `enum ib_cm_rej_reason`).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct RejectReason(pub u16);

impl RejectReason {
    pub const NO_QP: RejectReason = RejectReason(1);
    pub const NO_RESOURCES: RejectReason = RejectReason(3);
    /// The sender gave up waiting (or was destroyed while waiting); the
    /// ARI holds its 8-byte CA GUID.
    pub const TIMEOUT: RejectReason = RejectReason(4);
    /// No listener for the REQ's service ID ("no listener").
    pub const INVALID_SERVICE_ID: RejectReason = RejectReason(8);
    pub const STALE_CONNECTION: RejectReason = RejectReason(10);
    /// The path is unusable; the ARI holds the port's GID.
    pub const INVALID_GID: RejectReason = RejectReason(12);
    pub const INVALID_MTU: RejectReason = RejectReason(26);
    /// What `rdma_reject` sends.
    pub const CONSUMER_DEFINED: RejectReason = RejectReason(28);
    pub const VENDOR_OPTION_NOT_SUPPORTED: RejectReason = RejectReason(35);

    pub fn name(self) -> Option<&'static str> {
        Some(match self.0 {
            1 => "no QP",
            3 => "no resources",
            4 => "timeout",
            8 => "invalid service ID",
            10 => "stale connection",
            12 => "invalid GID",
            26 => "invalid MTU",
            28 => "consumer defined",
            35 => "vendor option not supported",
            _ => return None,
        })
    }
}

impl fmt::Debug for RejectReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.name() {
            Some(name) => write!(f, "RejectReason({} {name})", self.0),
            None => write!(f, "RejectReason({})", self.0),
        }
    }
}

/// A SIDR_REP status (IBA table 119, Linux `enum ib_cm_sidr_status`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct SidrStatus(pub u8);

impl SidrStatus {
    pub const SUCCESS: SidrStatus = SidrStatus(0);
    /// No listener for the service ID.
    pub const UNSUPPORTED: SidrStatus = SidrStatus(1);
    /// The consumer refused (what Linux sends when the id is destroyed).
    pub const REJECT: SidrStatus = SidrStatus(2);
    pub const NO_QP: SidrStatus = SidrStatus(3);
    pub const REDIRECT: SidrStatus = SidrStatus(4);
    pub const UNSUPPORTED_VERSION: SidrStatus = SidrStatus(5);
}

/// One path of a REQ (primary at body 52, alternate at body 96; 44 bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct PathInfo {
    /// 0xFFFF (permissive) on RoCE when the hop limit is above 1.
    pub local_lid: u16,
    pub remote_lid: u16,
    /// The sender's GID: on RoCEv2 the address it sends data packets from.
    pub local_gid: Gid,
    pub remote_gid: Gid,
    /// 20 bits.
    pub flow_label: u32,
    /// 6 bits.
    pub packet_rate: u8,
    pub traffic_class: u8,
    pub hop_limit: u8,
    /// 4 bits.
    pub sl: u8,
    pub subnet_local: bool,
    /// 5 bits, in 4.096 µs × 2^t.
    pub local_ack_timeout: u8,
}

impl PathInfo {
    /// Reads the path at body offset `p`.
    fn decode(r: &Reader, p: usize) -> PathInfo {
        let sl_byte = r.u8(at(p + 42));
        PathInfo {
            local_lid: r.u16(at(p)),
            remote_lid: r.u16(at(p + 2)),
            local_gid: Gid(r.bytes(at(p + 4))),
            remote_gid: Gid(r.bytes(at(p + 20))),
            flow_label: r.u32(at(p + 36)) >> 12,
            packet_rate: r.u8(at(p + 39)) & 0x3f,
            traffic_class: r.u8(at(p + 40)),
            hop_limit: r.u8(at(p + 41)),
            sl: sl_byte >> 4,
            subnet_local: sl_byte & 0x08 != 0,
            local_ack_timeout: r.u8(at(p + 43)) >> 3,
        }
    }

    fn encode(&self, w: &mut Writer, p: usize) -> Result<(), EncodeError> {
        w.u16(at(p), self.local_lid);
        w.u16(at(p + 2), self.remote_lid);
        w.bytes(at(p + 4), &self.local_gid.0);
        w.bytes(at(p + 20), &self.remote_gid.0);
        // The flow label is the top 20 bits of the word whose low 6 bits
        // are the packet rate.
        w.u32(at(p + 36), fit("flow label", self.flow_label, 20)? << 12);
        w.or_u8(at(p + 39), fit8("packet rate", self.packet_rate, 6)?);
        w.u8(at(p + 40), self.traffic_class);
        w.u8(at(p + 41), self.hop_limit);
        w.u8(
            at(p + 42),
            fit8("SL", self.sl, 4)? << 4 | u8::from(self.subnet_local) << 3,
        );
        w.u8(
            at(p + 43),
            fit8("local ACK timeout", self.local_ack_timeout, 5)? << 3,
        );
        Ok(())
    }
}

/// REQ (0x0010): the active side asks for a connection.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Req {
    pub local_comm_id: u32,
    /// ECE vendor ID (24 bits, body bytes 5–7); 0 without ECE.
    pub vendor_id: u32,
    pub service_id: u64,
    pub local_ca_guid: u64,
    pub local_qkey: u32,
    /// 24 bits.
    pub local_qpn: u32,
    pub responder_resources: u8,
    /// 24 bits.
    pub local_eecn: u32,
    pub initiator_depth: u8,
    /// 24 bits.
    pub remote_eecn: u32,
    /// 5 bits: how long the sender may take to answer the peer's REP.
    pub remote_cm_response_timeout: u8,
    pub transport: TransportType,
    pub e2e_flow_control: bool,
    /// 24 bits: the sender's receive PSN.
    pub starting_psn: u32,
    /// 5 bits: how long the receiver may take to answer this REQ; the
    /// receiver's REP retransmit interval.
    pub local_cm_response_timeout: u8,
    /// 3 bits.
    pub retry_count: u8,
    pub pkey: u16,
    /// 4 bits, IB MTU enum (1 = 256 … 5 = 4096).
    pub path_mtu: u8,
    pub rdc_exists: bool,
    /// 3 bits.
    pub rnr_retry_count: u8,
    /// 4 bits.
    pub max_cm_retries: u8,
    pub srq: bool,
    /// 3 bits.
    pub extended_transport: u8,
    pub primary: PathInfo,
    /// All zero on RoCE (no alternate path).
    pub alternate: PathInfo,
    /// Body byte 139, bit 2.
    pub sap_supported: bool,
    pub private_data: PrivateData<REQ_PRIVATE_DATA_SIZE>,
}

impl Req {
    pub(crate) fn decode(r: &Reader) -> Req {
        let b43 = r.u8(at(43));
        let b47 = r.u8(at(47));
        let b50 = r.u8(at(50));
        let b51 = r.u8(at(51));
        Req {
            local_comm_id: r.u32(at(0)),
            vendor_id: r.u32(at(4)) & 0x00ff_ffff,
            service_id: r.u64(at(8)),
            local_ca_guid: r.u64(at(16)),
            local_qkey: r.u32(at(28)),
            local_qpn: r.u24(at(32)),
            responder_resources: r.u8(at(35)),
            local_eecn: r.u24(at(36)),
            initiator_depth: r.u8(at(39)),
            remote_eecn: r.u24(at(40)),
            remote_cm_response_timeout: b43 >> 3,
            transport: TransportType::from_bits(b43 >> 1),
            e2e_flow_control: b43 & 1 != 0,
            starting_psn: r.u24(at(44)),
            local_cm_response_timeout: b47 >> 3,
            retry_count: b47 & 7,
            pkey: r.u16(at(48)),
            path_mtu: b50 >> 4,
            rdc_exists: b50 & 0x08 != 0,
            rnr_retry_count: b50 & 7,
            max_cm_retries: b51 >> 4,
            srq: b51 & 0x08 != 0,
            extended_transport: b51 & 7,
            primary: PathInfo::decode(r, 52),
            alternate: PathInfo::decode(r, 96),
            sap_supported: r.u8(at(139)) & 0x04 != 0,
            private_data: PrivateData::from_array(r.bytes(at(140))),
        }
    }

    pub(crate) fn encode(&self, w: &mut Writer) -> Result<(), EncodeError> {
        w.u32(at(0), self.local_comm_id);
        w.u32(at(4), fit("vendor ID", self.vendor_id, 24)?);
        w.u64(at(8), self.service_id);
        w.u64(at(16), self.local_ca_guid);
        w.u32(at(28), self.local_qkey);
        w.u24(at(32), fit("local QPN", self.local_qpn, 24)?);
        w.u8(at(35), self.responder_resources);
        w.u24(at(36), fit("local EECN", self.local_eecn, 24)?);
        w.u8(at(39), self.initiator_depth);
        w.u24(at(40), fit("remote EECN", self.remote_eecn, 24)?);
        w.u8(
            at(43),
            fit8(
                "remote CM response timeout",
                self.remote_cm_response_timeout,
                5,
            )? << 3
                | (self.transport as u8) << 1
                | u8::from(self.e2e_flow_control),
        );
        w.u24(at(44), fit("starting PSN", self.starting_psn, 24)?);
        w.u8(
            at(47),
            fit8(
                "local CM response timeout",
                self.local_cm_response_timeout,
                5,
            )? << 3
                | fit8("retry count", self.retry_count, 3)?,
        );
        w.u16(at(48), self.pkey);
        w.u8(
            at(50),
            fit8("path MTU", self.path_mtu, 4)? << 4
                | u8::from(self.rdc_exists) << 3
                | fit8("RNR retry count", self.rnr_retry_count, 3)?,
        );
        w.u8(
            at(51),
            fit8("max CM retries", self.max_cm_retries, 4)? << 4
                | u8::from(self.srq) << 3
                | fit8("extended transport type", self.extended_transport, 3)?,
        );
        self.primary.encode(w, 52)?;
        self.alternate.encode(w, 96)?;
        w.or_u8(at(139), u8::from(self.sap_supported) << 2);
        w.bytes(at(140), self.private_data.as_bytes());
        Ok(())
    }
}

/// MRA (0x0011): "message received, answer later".
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Mra {
    pub local_comm_id: u32,
    pub remote_comm_id: u32,
    pub message: TargetMessage,
    /// 5 bits: how much longer the sender of the MRAed message should wait.
    pub service_timeout: u8,
    pub private_data: PrivateData<MRA_PRIVATE_DATA_SIZE>,
}

impl Mra {
    pub(crate) fn decode(r: &Reader) -> Result<Mra, DecodeError> {
        Ok(Mra {
            local_comm_id: r.u32(at(0)),
            remote_comm_id: r.u32(at(4)),
            message: TargetMessage::decode("MRA Message MRAed", r.u8(at(8)))?,
            service_timeout: r.u8(at(9)) >> 3,
            private_data: PrivateData::from_array(r.bytes(at(10))),
        })
    }

    pub(crate) fn encode(&self, w: &mut Writer) -> Result<(), EncodeError> {
        w.u32(at(0), self.local_comm_id);
        w.u32(at(4), self.remote_comm_id);
        w.u8(at(8), (self.message as u8) << 6);
        w.u8(
            at(9),
            fit8("service timeout", self.service_timeout, 5)? << 3,
        );
        w.bytes(at(10), self.private_data.as_bytes());
        Ok(())
    }
}

/// REJ (0x0012): a connection refused or abandoned.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rej {
    pub local_comm_id: u32,
    pub remote_comm_id: u32,
    pub message: TargetMessage,
    /// How many bytes of `ari` are meaningful (≤ 72).
    pub ari_length: u8,
    pub reason: RejectReason,
    /// Additional Rejection Information (a CA GUID for reason 4, a GID for
    /// 12, …).
    pub ari: [u8; ARI_SIZE],
    pub private_data: PrivateData<REJ_PRIVATE_DATA_SIZE>,
}

impl Default for Rej {
    fn default() -> Self {
        Rej {
            local_comm_id: 0,
            remote_comm_id: 0,
            message: TargetMessage::default(),
            ari_length: 0,
            reason: RejectReason::default(),
            ari: [0; ARI_SIZE],
            private_data: PrivateData::default(),
        }
    }
}

impl Rej {
    /// The meaningful bytes of the ARI.
    pub fn ari(&self) -> &[u8] {
        self.ari.get(..usize::from(self.ari_length)).unwrap_or(&[])
    }

    pub(crate) fn decode(r: &Reader) -> Result<Rej, DecodeError> {
        // Fields are checked in wire order.
        let message = TargetMessage::decode("REJ Message Rejected", r.u8(at(8)))?;
        let ari_length = r.u8(at(9)) >> 1;
        if usize::from(ari_length) > ARI_SIZE {
            return Err(DecodeError::LengthTooLong {
                field: "REJ Reject Info Length",
                len: ari_length,
            });
        }
        Ok(Rej {
            local_comm_id: r.u32(at(0)),
            remote_comm_id: r.u32(at(4)),
            message,
            ari_length,
            reason: RejectReason(r.u16(at(10))),
            ari: r.bytes(at(12)),
            private_data: PrivateData::from_array(r.bytes(at(84))),
        })
    }

    pub(crate) fn encode(&self, w: &mut Writer) -> Result<(), EncodeError> {
        if usize::from(self.ari_length) > ARI_SIZE {
            return Err(EncodeError::TooLong {
                field: "ARI",
                len: self.ari_length.into(),
                max: ARI_SIZE,
            });
        }
        w.u32(at(0), self.local_comm_id);
        w.u32(at(4), self.remote_comm_id);
        w.u8(at(8), (self.message as u8) << 6);
        w.u8(at(9), self.ari_length << 1);
        w.u16(at(10), self.reason.0);
        w.bytes(at(12), &self.ari);
        w.bytes(at(84), self.private_data.as_bytes());
        Ok(())
    }
}

/// REP (0x0013): the passive side accepts.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Rep {
    pub local_comm_id: u32,
    pub remote_comm_id: u32,
    pub local_qkey: u32,
    /// 24 bits.
    pub local_qpn: u32,
    /// ECE vendor ID, 24 bits spread over body bytes 15, 19 and 23.
    pub vendor_id: u32,
    /// 24 bits.
    pub local_eecn: u32,
    /// 24 bits: the sender's receive PSN.
    pub starting_psn: u32,
    pub responder_resources: u8,
    pub initiator_depth: u8,
    /// 5 bits: the sender's CA ACK delay (rxe: 15).
    pub target_ack_delay: u8,
    /// 2 bits: 0 accepted, 1 not supported, 2 rejected.
    pub failover_accepted: u8,
    pub e2e_flow_control: bool,
    /// 3 bits.
    pub rnr_retry_count: u8,
    pub srq: bool,
    pub local_ca_guid: u64,
    pub private_data: PrivateData<REP_PRIVATE_DATA_SIZE>,
}

impl Rep {
    /// A REP accepting with `qpn` and `starting_psn` (this side's receive
    /// PSN), the other fields as Linux over rxe sends them: Target ACK Delay
    /// 15 (rxe's CA ACK delay), failover accepted 0, RNR retry 7, no
    /// RDMA READ resources. The agent fills in the comm IDs and CA GUID.
    pub fn accepting(qpn: u32, starting_psn: u32) -> Rep {
        Rep {
            local_qpn: qpn,
            starting_psn,
            target_ack_delay: 15,
            rnr_retry_count: 7,
            ..Rep::default()
        }
    }

    pub(crate) fn decode(r: &Reader) -> Rep {
        let b26 = r.u8(at(26));
        let b27 = r.u8(at(27));
        Rep {
            local_comm_id: r.u32(at(0)),
            remote_comm_id: r.u32(at(4)),
            local_qkey: r.u32(at(8)),
            local_qpn: r.u24(at(12)),
            vendor_id: u32::from(r.u8(at(15))) << 16
                | u32::from(r.u8(at(19))) << 8
                | u32::from(r.u8(at(23))),
            local_eecn: r.u24(at(16)),
            starting_psn: r.u24(at(20)),
            responder_resources: r.u8(at(24)),
            initiator_depth: r.u8(at(25)),
            target_ack_delay: b26 >> 3,
            failover_accepted: (b26 >> 1) & 3,
            e2e_flow_control: b26 & 1 != 0,
            rnr_retry_count: b27 >> 5,
            srq: b27 & 0x10 != 0,
            local_ca_guid: r.u64(at(28)),
            private_data: PrivateData::from_array(r.bytes(at(36))),
        }
    }

    pub(crate) fn encode(&self, w: &mut Writer) -> Result<(), EncodeError> {
        let [_, vh, vm, vl] = fit("vendor ID", self.vendor_id, 24)?.to_be_bytes();
        w.u32(at(0), self.local_comm_id);
        w.u32(at(4), self.remote_comm_id);
        w.u32(at(8), self.local_qkey);
        w.u24(at(12), fit("local QPN", self.local_qpn, 24)?);
        w.u8(at(15), vh);
        w.u24(at(16), fit("local EECN", self.local_eecn, 24)?);
        w.u8(at(19), vm);
        w.u24(at(20), fit("starting PSN", self.starting_psn, 24)?);
        w.u8(at(23), vl);
        w.u8(at(24), self.responder_resources);
        w.u8(at(25), self.initiator_depth);
        w.u8(
            at(26),
            fit8("target ACK delay", self.target_ack_delay, 5)? << 3
                | fit8("failover accepted", self.failover_accepted, 2)? << 1
                | u8::from(self.e2e_flow_control),
        );
        w.u8(
            at(27),
            fit8("RNR retry count", self.rnr_retry_count, 3)? << 5 | u8::from(self.srq) << 4,
        );
        w.u64(at(28), self.local_ca_guid);
        w.bytes(at(36), self.private_data.as_bytes());
        Ok(())
    }
}

/// RTU (0x0014): the active side is ready to use the connection.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Rtu {
    pub local_comm_id: u32,
    pub remote_comm_id: u32,
    pub private_data: PrivateData<RTU_PRIVATE_DATA_SIZE>,
}

impl Rtu {
    pub(crate) fn decode(r: &Reader) -> Rtu {
        Rtu {
            local_comm_id: r.u32(at(0)),
            remote_comm_id: r.u32(at(4)),
            private_data: PrivateData::from_array(r.bytes(at(8))),
        }
    }

    pub(crate) fn encode(&self, w: &mut Writer) {
        w.u32(at(0), self.local_comm_id);
        w.u32(at(4), self.remote_comm_id);
        w.bytes(at(8), self.private_data.as_bytes());
    }
}

/// DREQ (0x0015): disconnect.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Dreq {
    pub local_comm_id: u32,
    pub remote_comm_id: u32,
    /// 24 bits: the receiver's QPN (Linux ignores a DREQ naming another).
    pub remote_qpn: u32,
    pub private_data: PrivateData<DREQ_PRIVATE_DATA_SIZE>,
}

impl Dreq {
    pub(crate) fn decode(r: &Reader) -> Dreq {
        Dreq {
            local_comm_id: r.u32(at(0)),
            remote_comm_id: r.u32(at(4)),
            remote_qpn: r.u24(at(8)),
            private_data: PrivateData::from_array(r.bytes(at(12))),
        }
    }

    pub(crate) fn encode(&self, w: &mut Writer) -> Result<(), EncodeError> {
        w.u32(at(0), self.local_comm_id);
        w.u32(at(4), self.remote_comm_id);
        w.u24(at(8), fit("remote QPN", self.remote_qpn, 24)?);
        w.bytes(at(12), self.private_data.as_bytes());
        Ok(())
    }
}

/// DREP (0x0016): disconnect acknowledged.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Drep {
    pub local_comm_id: u32,
    pub remote_comm_id: u32,
    pub private_data: PrivateData<DREP_PRIVATE_DATA_SIZE>,
}

impl Drep {
    pub(crate) fn decode(r: &Reader) -> Drep {
        Drep {
            local_comm_id: r.u32(at(0)),
            remote_comm_id: r.u32(at(4)),
            private_data: PrivateData::from_array(r.bytes(at(8))),
        }
    }

    pub(crate) fn encode(&self, w: &mut Writer) {
        w.u32(at(0), self.local_comm_id);
        w.u32(at(4), self.remote_comm_id);
        w.bytes(at(8), self.private_data.as_bytes());
    }
}

/// SIDR_REQ (0x0017): which UD QP serves this service ID?
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct SidrReq {
    pub request_id: u32,
    pub pkey: u16,
    pub service_id: u64,
    pub private_data: PrivateData<SIDR_REQ_PRIVATE_DATA_SIZE>,
}

impl SidrReq {
    pub(crate) fn decode(r: &Reader) -> SidrReq {
        SidrReq {
            request_id: r.u32(at(0)),
            pkey: r.u16(at(4)),
            service_id: r.u64(at(8)),
            private_data: PrivateData::from_array(r.bytes(at(16))),
        }
    }

    pub(crate) fn encode(&self, w: &mut Writer) {
        w.u32(at(0), self.request_id);
        w.u16(at(4), self.pkey);
        w.u64(at(8), self.service_id);
        w.bytes(at(16), self.private_data.as_bytes());
    }
}

/// SIDR_REP (0x0018): the answer to a SIDR_REQ.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SidrRep {
    pub request_id: u32,
    pub status: SidrStatus,
    /// How many bytes of `additional_info` are meaningful (≤ 72).
    pub additional_info_length: u8,
    /// ECE vendor ID, 24 bits (body 6–7 and 11).
    pub vendor_id: u32,
    /// 24 bits.
    pub qpn: u32,
    pub service_id: u64,
    pub qkey: u32,
    pub additional_info: [u8; ARI_SIZE],
    pub private_data: PrivateData<SIDR_REP_PRIVATE_DATA_SIZE>,
}

impl Default for SidrRep {
    fn default() -> Self {
        SidrRep {
            request_id: 0,
            status: SidrStatus::default(),
            additional_info_length: 0,
            vendor_id: 0,
            qpn: 0,
            service_id: 0,
            qkey: 0,
            additional_info: [0; ARI_SIZE],
            private_data: PrivateData::default(),
        }
    }
}

impl SidrRep {
    /// The meaningful bytes of the additional information.
    pub fn additional_info(&self) -> &[u8] {
        self.additional_info
            .get(..usize::from(self.additional_info_length))
            .unwrap_or(&[])
    }

    pub(crate) fn decode(r: &Reader) -> Result<SidrRep, DecodeError> {
        let additional_info_length = r.u8(at(5));
        if usize::from(additional_info_length) > ARI_SIZE {
            return Err(DecodeError::LengthTooLong {
                field: "SIDR_REP Additional Information Length",
                len: additional_info_length,
            });
        }
        Ok(SidrRep {
            request_id: r.u32(at(0)),
            status: SidrStatus(r.u8(at(4))),
            additional_info_length,
            vendor_id: u32::from(r.u16(at(6))) << 8 | u32::from(r.u8(at(11))),
            qpn: r.u24(at(8)),
            service_id: r.u64(at(12)),
            qkey: r.u32(at(20)),
            additional_info: r.bytes(at(24)),
            private_data: PrivateData::from_array(r.bytes(at(96))),
        })
    }

    pub(crate) fn encode(&self, w: &mut Writer) -> Result<(), EncodeError> {
        if usize::from(self.additional_info_length) > ARI_SIZE {
            return Err(EncodeError::TooLong {
                field: "additional information",
                len: self.additional_info_length.into(),
                max: ARI_SIZE,
            });
        }
        let vendor = fit("vendor ID", self.vendor_id, 24)?;
        w.u32(at(0), self.request_id);
        w.u8(at(4), self.status.0);
        w.u8(at(5), self.additional_info_length);
        w.u16(at(6), (vendor >> 8) as u16);
        w.u24(at(8), fit("QPN", self.qpn, 24)?);
        w.u8(at(11), vendor as u8);
        w.u64(at(12), self.service_id);
        w.u32(at(20), self.qkey);
        w.bytes(at(24), &self.additional_info);
        w.bytes(at(96), self.private_data.as_bytes());
        Ok(())
    }
}
