//! Control messages between vdev and hostd.
//!
//! Each request gets exactly one response, in order. Requests that carry
//! file descriptors say so; the descriptors travel as `SCM_RIGHTS` with the
//! message. Messages are JSON (serde), at most [`MAX_MESSAGE`] bytes: the
//! control path is not hot, and a self-describing format keeps the hostile
//! decoder in hostd simple and strict (unknown fields are refused).

use serde::{Deserialize, Serialize};
pub use vrdma_tenant_policy::TenantPolicy;

/// Largest message in bytes.
pub const MAX_MESSAGE: usize = 64 * 1024;
/// Version of this protocol; hostd refuses a vdev that speaks another.
/// Raised whenever a message changes shape, the tenant policy in the
/// Welcome included, so that a vdev and a hostd of different builds meet a
/// clear EPROTO instead of a decoding error. 3: hostd reads the guest's
/// rings itself (doorbell page, event rings, CQs and QPs by their rings).
/// 4: devices are addressed by GID (RoCEv2): the Welcome carries the
/// device's GID, a connection names its peer by GID and carries every
/// attribute of the connection. 5: shared receive queues, address
/// handles, UC and UD QPs. 6: a device has contexts
/// ([`Request::OpenContext`]). 7: a vdev brings a context's objects back
/// to a restarted hostd ([`Request::ResumeEq`], [`Request::ResumeCq`],
/// [`Request::ResumeQp`], [`Request::ResumeSrq`], [`Request::RestoreMr`]).
/// 8: the port's link layer (the Welcome's `link_layer`): on an
/// InfiniBand port an address vector without a GRH names its destination
/// by LID (`dlid` of [`QpConnection`] and [`AhSetup`]). 9: QP1 for the
/// device's connection manager ([`Request::GsiNotify`],
/// [`Request::SendMad`], [`Request::TakeMads`]). 10: address resolution
/// for the connection manager ([`Request::ResolveGid`]). 11: a context
/// outlives its vdev ([`Request::Journal`], [`Request::Release`],
/// [`Request::Adopt`], [`Request::TakeRecords`]). 12: hostd hands over to
/// a new hostd ([`Notification::Handover`], [`Request::ResumeHandover`]).
/// 13: a QP's transitions in one request ([`Request::ModifyQps`]). 14: a
/// context's [`Request::Journal`] may come on its notification channel
/// (hostd reads it there before the context's next request and when the
/// context ends: it wakes no thread of hostd's). 15: hostd pushes QP1's
/// MADs on a socket ([`Request::GsiPush`]).
pub const PROTOCOL_VERSION: u32 = 15;

/// Transitions one [`Request::ModifyQps`] carries at most.
pub const MAX_MODIFIES: usize = 4;

/// The LID of hostd itself on an InfiniBand port: it is the subnet
/// manager (`sm_lid` of every port); devices get LIDs from 2 on.
pub const SM_LID: u16 = 1;

/// The link layer of every port of a host (hostd's `[port] link_layer`).
/// The LIDs hostd assigns are the ports' LIDs only on InfiniBand: a RoCE
/// (Ethernet) port has none.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PortLinkLayer {
    /// RoCEv2: peers are named by GID, every address vector has a GRH.
    #[default]
    Ethernet,
    /// InfiniBand: hostd is the subnet manager, a port's LID names it, and
    /// an address vector needs a GRH only to name a peer by GID.
    Infiniband,
}

impl From<PortLinkLayer> for vrdma_spec::verbs::LinkLayer {
    fn from(l: PortLinkLayer) -> Self {
        match l {
            PortLinkLayer::Ethernet => vrdma_spec::verbs::LinkLayer::Ethernet,
            PortLinkLayer::Infiniband => vrdma_spec::verbs::LinkLayer::Infiniband,
        }
    }
}

/// A request from vdev to hostd.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "snake_case")]
pub enum Request {
    /// First message: who this vdev serves. hostd checks the tenant against
    /// its policy and the peer's credentials, assigns the device's LID and
    /// GID and grants physical queues. The response carries one fd: the
    /// notification channel (a seqpacket socket on which hostd sends
    /// [`Notification`]s).
    Hello {
        version: u32,
        tenant: String,
        device: String,
    },
    /// Instead of `Hello`: opens a context of the device — the device's
    /// first (as `Hello` does) if it is not connected, else another one of
    /// it, which only the process that holds its other contexts may open
    /// (checked by the socket's credentials). Every context is answered
    /// with the device's one LID, GID and physical queues, and has its
    /// own memory, rings and objects; when its connection closes only
    /// they go, and the device with its last context.
    OpenContext {
        version: u32,
        tenant: String,
        device: String,
    },
    /// One fd: a guest memory slot (a sealed memfd) to map.
    AddMemory {
        slot: u32,
        gpa: u64,
        len: u64,
        file_offset: u64,
    },
    /// The slot is gone; keys over it are revoked, and rings in it are no
    /// longer touched (their QPs and CQs are lost).
    RemoveMemory { slot: u32 },
    /// Registers a memory region; hostd assigns its keys (like a NIC its
    /// memory keys: unique on the host by construction, and found by index
    /// on the datapath) and answers [`Response::MrKeys`].
    RegisterMr(MrRegistration),
    /// Revokes a memory region. When the response arrives no WQE touches
    /// the region any more.
    DeregisterMr { lkey: u32 },
    /// One fd: the eventfd the driver's doorbell notifications arrive on
    /// (the doorbell virtqueue's kick). `gpa` is the device's doorbell page
    /// ([`vrdma_spec::ring::doorbell`]), once per device.
    SetDoorbell { gpa: u64 },
    /// One fd: the eventfd that interrupts the driver for completion vector
    /// `vector` (its event virtqueue's call). `gpa` is the vector's event
    /// ring of `depth` events.
    CreateEq { vector: u32, gpa: u64, depth: u32 },
    /// A completion queue: its ring of `depth` CQEs at `gpa`, its events on
    /// `vector`.
    CreateCq {
        cqn: u32,
        gpa: u64,
        depth: u32,
        vector: u32,
    },
    /// The CQ is destroyed (no QP uses it: vdev checked).
    DestroyCq { cqn: u32 },
    /// A virtual QP in RESET, with its rings.
    CreateQp(QpSetup),
    /// A state transition of a virtual QP (vdev checked it against the RC
    /// state table); hostd applies it and answers `Ok`, or refuses it when
    /// the QP has meanwhile gone to ERR on its own (`EINVAL`).
    ModifyQp(QpModify),
    /// Transitions of one virtual QP in order (a connection manager's
    /// INIT, RTR, RTS), each as [`Request::ModifyQp`]; at most
    /// [`MAX_MODIFIES`]. hostd stops at the first it refuses and answers
    /// that refusal, the ones before applied (vdev asks [`Request::QueryQp`]
    /// where it stopped).
    ModifyQps(Vec<QpModify>),
    /// The QP's state as the datapath sees it (it may have entered ERR on
    /// its own); answered with [`Response::QpState`].
    QueryQp { vqpn: u32 },
    /// The virtual QP is destroyed. When the response arrives no WQE of it
    /// is executed any more and its rings are not touched.
    DestroyQp { vqpn: u32 },
    /// A shared receive queue: its ring, the SGEs its WQEs may carry and
    /// its armed limit (0: none).
    CreateSrq(SrqSetup),
    /// Arms the SRQ's limit event at `limit` (0 disarms it).
    ModifySrq { srqn: u32, limit: u32 },
    /// The SRQ's limit now (0 once the event fired); answered with
    /// [`Response::SrqLimit`].
    QuerySrq { srqn: u32 },
    /// The SRQ is destroyed (no QP uses it: vdev checked). When the
    /// response arrives its ring is not touched any more.
    DestroySrq { srqn: u32 },
    /// An address handle: UD sends naming `ahn` go to `dgid`. hostd checks
    /// the destination as it checks a connection at RTR (its tenant's
    /// network must be reachable: `EACCES`; unknown: `ENOENT`); a GID on
    /// another host makes its datagrams go on the wire.
    CreateAh(AhSetup),
    /// The AH is destroyed: sends naming it fail from now on.
    DestroyAh { ahn: u32 },
    /// The driver reset the device: every QP, CQ, event ring, MR and the
    /// doorbell go (memory slots stay). When the response arrives, nothing
    /// of the old driver's is touched any more.
    ResetDevice,
    /// vdev refused a verb because of the tenant's quota `quota` (a key of
    /// [`vrdma_tenant_policy::Limits`]); hostd counts it for the tenant.
    QuotaRejected { quota: String },
    /// As [`Request::CreateEq`] (one fd), for an event ring a previous
    /// datapath served (hostd restarted and the context re-registered): the
    /// ring continues from the `device.index` in its header instead of
    /// starting over, so the events the driver has not read stay.
    ResumeEq { vector: u32, gpa: u64, depth: u32 },
    /// As [`Request::CreateCq`], for a CQ a previous datapath wrote: the
    /// ring continues from its header's `device.index` and `notified_sn`.
    ResumeCq {
        cqn: u32,
        gpa: u64,
        depth: u32,
        vector: u32,
    },
    /// As [`Request::CreateQp`], for a QP a previous datapath ran: its
    /// rings continue from their headers' `device.index` (what was
    /// completed stays completed; what is posted after it is still to
    /// run, or to flush once the QP is moved to ERR).
    ResumeQp(QpSetup),
    /// As [`Request::CreateSrq`], for an SRQ a previous datapath took
    /// receives from: its ring continues from its header's `device.index`.
    ResumeSrq(SrqSetup),
    /// As [`Request::RegisterMr`], for a region a previous datapath had
    /// registered under these keys, which the driver and its peers still
    /// hold: registered under the same keys, answered `Ok`, or refused
    /// (`EBUSY`) when another region holds a key's table slot now.
    RestoreMr {
        lkey: u32,
        rkey: u32,
        mr: MrRegistration,
    },
    /// One fd: an eventfd hostd signals when connection-manager MADs
    /// arrive for the device's QP1 (then [`Request::TakeMads`]).
    GsiNotify,
    /// No fd: from now on hostd pushes each MAD that arrives for the
    /// device's QP1 while none waits to be taken, as a [`Response::Mads`]
    /// of one, on a socket of its own — answered [`Response::MadPush`]
    /// with the other end, which the connection manager reads without a
    /// request per MAD. What the socket has no room for waits to be taken
    /// ([`Request::TakeMads`], after the [`Request::GsiNotify`] eventfd),
    /// as do all MADs after it until none waits: whatever came on the
    /// socket is older than what waits. Asked again, the old socket is
    /// pushed to no more.
    GsiPush,
    /// Sends a connection-manager MAD from the device's QP1 to QP1 of
    /// `peer`: checked as a connection at RTR (`EACCES`, `ENOENT`); a MAD
    /// of another class or size is refused (`EINVAL`).
    SendMad(MadOut),
    /// Up to `max` MADs that arrived for the device's QP1, oldest first;
    /// answered with [`Response::Mads`].
    TakeMads { max: u32 },
    /// Whether the device may reach `gid` (rdma_cm's address resolution):
    /// `Ok`, or refused as a connection at RTR would be (`EACCES`: outside
    /// the networks the tenant may reach; `ENOENT`: no such device here or
    /// in the directory). vdev answers both refusals alike, so that a
    /// tenant cannot tell another network's addresses from unused ones.
    ResolveGid { gid: [u8; 16] },
    /// **Not answered.** vdev's journal of the context: the records of the
    /// objects its last control command (or memory update) touched, and
    /// the context's key once its control queue is known. hostd keeps them
    /// for the next vdev of the device should this one die
    /// ([`Request::Adopt`]), and interprets nothing in them: the next vdev
    /// decodes and checks them as it would guest input. A state-changing
    /// request not followed by a journal leaves the context unadoptable
    /// (vdev may have died half-way through a command).
    Journal(Journal),
    /// The context ends on purpose (its frontend left): when the
    /// connection closes, hostd releases it instead of keeping it for an
    /// adoption. Answered `Ok`.
    Release,
    /// Sent by a new context with nothing created yet: take over the
    /// orphaned context of this device whose key is `key` (left by a vdev
    /// that died); this registration then serves it, its objects live on.
    /// Answered [`Response::Adopted`] (then [`Request::TakeRecords`]), or
    /// refused `ENOENT` (no such orphan: the frontend gets a fresh device).
    Adopt { key: ContextKey },
    /// The adopted context's records from the `from`th on (in key order),
    /// as many as fit one message; answered [`Response::Records`].
    TakeRecords { from: u32 },
    /// The frontend of an adopted context came back with new eventfds (a
    /// VMM re-creates its notifiers when it reconnects): with `doorbell`,
    /// the first descriptor is the doorbell queue's new kick; then one
    /// interrupt eventfd per vector of `vectors`, each an event ring the
    /// context has. Answered `Ok`.
    RenewNotifiers { doorbell: bool, vectors: Vec<u32> },
    /// Sent by a context registering again after hostd handed over
    /// ([`Notification::Handover`]), before it gives its objects back:
    /// `token` names what the previous hostd handed over of this context
    /// (its QPs' transport state: PSNs, what a responder was in the middle
    /// of), which the new hostd gives each QP once vdev has brought it back
    /// to its state. Answered `Ok`, or refused: `ENOENT` (no such token:
    /// expired, or the handover failed) or `EACCES` (another device's).
    ResumeHandover { token: String },
}

/// What identifies a context across vdev restarts: the backing of its
/// control queue's descriptor table (the memfd's device and inode, and the
/// table's offset in it). Only the frontend that holds that memory can
/// present it again, and each context's control queue is its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ContextKey {
    pub dev: u64,
    pub ino: u64,
    pub offset: u64,
}

/// One record of a context's journal: an object's state as vdev encodes
/// it (`data`), or its removal (`None`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Record {
    pub kind: u8,
    pub id: u32,
    pub data: Option<String>,
}

/// [`Request::Journal`]'s content.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Journal {
    /// The context's key, when vdev learned it (with its first command).
    pub key: Option<ContextKey>,
    pub records: Vec<Record>,
}

/// Bounds hostd puts on one context's journal; past them the context is
/// not kept for adoption (it is released when its vdev goes).
pub const MAX_RECORDS: usize = 1 << 16;
/// The most bytes of record data one context keeps.
pub const MAX_RECORD_BYTES: usize = 8 << 20;
/// The most bytes of record data all contexts of one device keep (a
/// compromised vdev's 64 contexts cannot make hostd hold 64 times the
/// above).
pub const MAX_DEVICE_RECORD_BYTES: usize = 32 << 20;

/// A MAD the device's control plane sends from QP1.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MadOut {
    pub peer: [u8; 16],
    /// The IP TOS of its packet (the path's traffic class).
    pub traffic_class: u8,
    /// The 256-byte MAD.
    pub mad: Vec<u8>,
}

/// A MAD that arrived on the device's QP1.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MadIn {
    /// Its source GID and QP number.
    pub peer: [u8; 16],
    pub peer_qpn: u32,
    pub traffic_class: u8,
    pub mad: Vec<u8>,
}

/// A message hostd sends on its own, on the notification channel (the
/// descriptor of `Welcome`); vdev does not answer it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "snake_case")]
pub enum Notification {
    /// The operator reloaded the policy; this is the tenant's new one.
    /// Raised quotas apply at once, lowered ones to new objects only.
    Policy(Box<TenantPolicy>),
    /// A new hostd takes over from this one, which closes the channel next
    /// (by exiting): the port is not down. vdev registers the context with
    /// the new hostd at once, presents `token`
    /// ([`Request::ResumeHandover`]) and gives its objects back in their
    /// states — connected QPs stay connected; nothing is flushed and no
    /// event is written.
    Handover { token: String },
}

/// A work ring (send or receive) in guest memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorkRing {
    pub gpa: u64,
    /// Slots (a power of two).
    pub depth: u32,
    /// Bytes of one slot (a power of two).
    pub stride: u32,
}

/// A shared receive queue as hostd's datapath needs it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SrqSetup {
    pub srqn: u32,
    pub pd: u32,
    pub ring: WorkRing,
    pub max_sge: u32,
    /// The limit armed at creation (0: not armed).
    pub limit: u32,
}

/// An address handle as hostd's datapath needs it (the GRH of
/// `struct ibv_ah_attr`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AhSetup {
    pub ahn: u32,
    pub pd: u32,
    /// The destination's GID (zeros when `dlid` names it).
    pub dgid: [u8; 16],
    /// Set when the address vector has no GRH (an InfiniBand port): the
    /// destination is the device with this LID, which hostd resolves to
    /// its GID; its datagrams then arrive without a GRH.
    #[serde(default)]
    pub dlid: Option<u16>,
    pub flow_label: u32,
    pub hop_limit: u8,
    pub traffic_class: u8,
}

/// A virtual QP as hostd's datapath needs it: its rings, its CQs and what
/// its WQEs may carry (the capacities vdev granted,
/// [`vrdma_spec::limits::QpGrant`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct QpSetup {
    pub vqpn: u32,
    /// A [`vrdma_spec::verbs::QpType`]: RC 2, UC 3, UD 4.
    pub qp_type: u8,
    pub pd: u32,
    /// Its bit in the doorbell page.
    pub db_index: u32,
    pub send_cqn: u32,
    pub recv_cqn: u32,
    /// Every send WQE completes with a CQE.
    pub sq_sig_all: bool,
    pub sq: WorkRing,
    pub rq: WorkRing,
    pub max_send_sge: u32,
    pub max_recv_sge: u32,
    pub max_inline_data: u32,
    /// The SRQ its receives come from (its own receive ring is unused).
    #[serde(default)]
    pub srqn: Option<u32>,
}

/// A state transition of a virtual QP.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct QpModify {
    pub vqpn: u32,
    /// The new state, a [`vrdma_spec::verbs::QpState`].
    pub state: u8,
    /// At RTR, and again at RTS: the peer and how the QP behaves as
    /// requester and responder (at RTS complete: the requester's
    /// attributes are known). hostd checks the peer is reachable for this
    /// tenant.
    pub connection: Option<QpConnection>,
    /// The QP's remote access flags, when they changed
    /// ([`vrdma_spec::verbs::access`]).
    pub access: Option<u32>,
    /// A UD QP's new Q_Key (when the transition sets one).
    #[serde(default)]
    pub qkey: Option<u32>,
}

/// Where a virtual QP sends, and how it behaves as RC requester/responder:
/// the whole connection, as the application gave it across `modify_qp`
/// calls (vdev keeps the attributes of earlier calls, so the connection
/// sent at RTS holds what RTR set).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct QpConnection {
    /// The peer's GID (an IPv4-mapped address, [`vrdma_spec::gid`]; zeros
    /// when `dlid` names the peer).
    pub dgid: [u8; 16],
    /// Set when the address vector has no GRH (an InfiniBand port): the
    /// peer is the device with this LID, which hostd resolves to its GID.
    #[serde(default)]
    pub dlid: Option<u16>,
    /// The peer's QP number (24 bits).
    pub dest_qpn: u32,
    /// GRH flow label (20 bits).
    pub flow_label: u32,
    /// GRH hop limit (the IP TTL).
    pub hop_limit: u8,
    /// GRH traffic class (the IP TOS).
    pub traffic_class: u8,
    /// Remote access this QP grants its peer ([`vrdma_spec::verbs::access`]).
    pub access: u32,
    /// RNR retries of this QP as requester (7 = infinite).
    pub rnr_retry: u8,
    /// Transport retries of this QP as requester.
    pub retry_cnt: u8,
    /// RNR timer code this QP advertises as responder (IBA table).
    pub min_rnr_timer: u8,
    /// Local ACK timeout exponent (4.096 µs × 2^timeout; 0 = infinite).
    pub timeout: u8,
    /// Path MTU in bytes (256, 512, 1024, 2048 or 4096).
    pub path_mtu: u32,
    /// First PSN this QP sends (24 bits).
    pub sq_psn: u32,
    /// First PSN this QP expects (24 bits).
    pub rq_psn: u32,
    /// READs and atomics this QP may have outstanding as requester.
    pub max_rd_atomic: u8,
    /// READs and atomics it accepts outstanding as responder.
    pub max_dest_rd_atomic: u8,
}

/// One piece of a memory region: `len` bytes at `offset` in memory slot `slot`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MrSegment {
    pub slot: u32,
    pub offset: u64,
    pub len: u64,
}

/// A memory region as hostd records it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MrRegistration {
    pub pd: u32,
    /// [`vrdma_spec::verbs::access`] flags.
    pub access: u32,
    pub iova: u64,
    pub len: u64,
    pub segments: Vec<MrSegment>,
}

/// hostd's answer to a request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "snake_case")]
pub enum Response {
    /// Answer to `Hello`.
    Welcome(Box<Welcome>),
    /// The request was carried out.
    Ok,
    /// Answer to `QueryQp`: a [`vrdma_spec::verbs::QpState`].
    QpState { state: u8 },
    /// Answer to [`Request::QuerySrq`].
    SrqLimit { limit: u32 },
    /// Answer to `RegisterMr`: the region's keys (distinct, never 0).
    MrKeys { lkey: u32, rkey: u32 },
    /// Answer to [`Request::TakeMads`]; on the socket of
    /// [`Request::GsiPush`], one MAD pushed.
    Mads(Vec<MadIn>),
    /// Answer to [`Request::GsiPush`], with one fd: the socket's end MADs
    /// are pushed to.
    MadPush,
    /// Answer to [`Request::Adopt`]: the context's records number `records`.
    Adopted { records: u32 },
    /// Answer to [`Request::TakeRecords`]: the next records, and whether
    /// more follow.
    Records { records: Vec<Record>, more: bool },
    /// The request was refused: a positive errno and why.
    Refused { errno: i32, reason: String },
}

/// What hostd grants a vdev.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Welcome {
    /// The device's LID on this host: it names the device, and on an
    /// InfiniBand port it is the port's LID (an Ethernet port has none).
    pub lid: u16,
    /// The link layer of the device's port.
    pub link_layer: PortLinkLayer,
    /// The device's GID: what its peers' connections name it by, and
    /// entry 0 of its port's GID table (an IPv4-mapped address).
    pub gid: [u8; 16],
    /// Physical QPs of hostd's NIC the device's virtual QPs are
    /// multiplexed onto.
    pub physical_queues: u32,
    /// The tenant's policy in force: vdev enforces its quotas.
    pub policy: TenantPolicy,
    /// The port's active MTU in bytes (256-4096): what fits the packets of
    /// hostd's network (a RoCE port's MTU follows its netdev's).
    pub active_mtu: u32,
}

/// Why a message cannot be decoded or encoded.
#[derive(Debug, thiserror::Error)]
pub enum MessageError {
    #[error("Message of {0} bytes exceeds {MAX_MESSAGE}")]
    TooLarge(usize),
    #[error("Malformed message")]
    Malformed(#[source] serde_json::Error),
}

/// Encodes a message.
pub fn encode<T: Serialize>(msg: &T) -> Result<Vec<u8>, MessageError> {
    let bytes = serde_json::to_vec(msg).map_err(MessageError::Malformed)?;
    if bytes.len() > MAX_MESSAGE {
        return Err(MessageError::TooLarge(bytes.len()));
    }
    Ok(bytes)
}

/// Decodes a message, refusing anything larger than [`MAX_MESSAGE`].
pub fn decode<'a, T: Deserialize<'a>>(bytes: &'a [u8]) -> Result<T, MessageError> {
    if bytes.len() > MAX_MESSAGE {
        return Err(MessageError::TooLarge(bytes.len()));
    }
    serde_json::from_slice(bytes).map_err(MessageError::Malformed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_round_trip() {
        let req = Request::RegisterMr(MrRegistration {
            pd: 3,
            access: 7,
            iova: 0x1000,
            len: 4096,
            segments: vec![MrSegment {
                slot: 0,
                offset: 0x1000,
                len: 4096,
            }],
        });
        let bytes = encode(&req).expect("encode");
        assert_eq!(decode::<Request>(&bytes).expect("decode"), req);
    }

    #[test]
    fn the_largest_mr_a_vdev_may_register_fits_one_message() {
        let segment = MrSegment {
            slot: u32::MAX,
            offset: u64::MAX,
            len: u64::MAX,
        };
        let req = Request::RegisterMr(MrRegistration {
            pd: u32::MAX,
            access: u32::MAX,
            iova: u64::MAX,
            len: u64::MAX,
            segments: vec![segment; vrdma_spec::control::MAX_MR_PIECES],
        });
        let bytes = encode(&req).expect("within MAX_MESSAGE");
        assert!(bytes.len() <= MAX_MESSAGE);
    }

    #[test]
    fn qp_messages_round_trip() {
        let ring = |gpa| WorkRing {
            gpa,
            depth: 64,
            stride: 128,
        };
        let req = Request::CreateQp(QpSetup {
            vqpn: 0xabcdef,
            pd: 1,
            db_index: 3,
            send_cqn: 4,
            recv_cqn: 5,
            sq_sig_all: true,
            sq: ring(0x10000),
            rq: ring(0x20000),
            max_send_sge: 4,
            max_recv_sge: 4,
            max_inline_data: 64,
            srqn: Some(7),
            qp_type: 2,
        });
        let bytes = encode(&req).expect("encode");
        assert_eq!(decode::<Request>(&bytes).expect("decode"), req);
        let req = Request::CreateSrq(SrqSetup {
            srqn: 7,
            pd: 1,
            ring: ring(0x30000),
            max_sge: 2,
            limit: 10,
        });
        let bytes = encode(&req).expect("encode");
        assert_eq!(decode::<Request>(&bytes).expect("decode"), req);
        let modify = Request::ModifyQp(QpModify {
            vqpn: 1,
            state: 2,
            connection: Some(QpConnection {
                dgid: vrdma_spec::gid::ipv4_mapped([10, 200, 1, 2]),
                dlid: Some(0x1234),
                dest_qpn: 9,
                flow_label: 0xfffff,
                hop_limit: 64,
                traffic_class: 0x20,
                access: 7,
                rnr_retry: 7,
                retry_cnt: 3,
                min_rnr_timer: 12,
                timeout: 14,
                path_mtu: 4096,
                sq_psn: 0xff_ffff,
                rq_psn: 1,
                max_rd_atomic: 16,
                max_dest_rd_atomic: 4,
            }),
            access: None,
            qkey: None,
        });
        let bytes = encode(&modify).expect("encode");
        assert_eq!(decode::<Request>(&bytes).expect("decode"), modify);
        let bytes = encode(&Response::QpState { state: 6 }).expect("encode");
        assert_eq!(
            decode::<Response>(&bytes).expect("decode"),
            Response::QpState { state: 6 }
        );
    }

    #[test]
    fn the_link_layer_and_lid_addressing_round_trip() {
        let welcome = Response::Welcome(Box::new(Welcome {
            lid: 2,
            link_layer: PortLinkLayer::Infiniband,
            gid: vrdma_spec::gid::loopback_gid(2),
            physical_queues: 1,
            policy: vrdma_tenant_policy::Policy::default_policy().tenants[0].clone(),
            active_mtu: 4096,
        }));
        let bytes = encode(&welcome).expect("encode");
        assert!(
            String::from_utf8_lossy(&bytes).contains(r#""link_layer":"infiniband""#),
            "the link layer travels by name"
        );
        assert_eq!(decode::<Response>(&bytes).expect("decode"), welcome);
        let ah = Request::CreateAh(AhSetup {
            ahn: 1,
            pd: 2,
            dgid: [0; 16],
            dlid: Some(3),
            flow_label: 0,
            hop_limit: 0,
            traffic_class: 0,
        });
        let bytes = encode(&ah).expect("encode");
        assert_eq!(decode::<Request>(&bytes).expect("decode"), ah);
        // A GRH-addressed AH may leave `dlid` out.
        let grh = br#"{"create_ah":{"ahn":1,"pd":2,"dgid":[0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0],
            "flow_label":0,"hop_limit":64,"traffic_class":0}}"#;
        match decode::<Request>(grh).expect("decode") {
            Request::CreateAh(s) => assert_eq!(s.dlid, None),
            other => panic!("{other:?}"),
        }
        assert!(decode::<PortLinkLayer>(br#""token_ring""#).is_err());
    }

    #[test]
    fn hostile_messages_are_refused() {
        assert!(decode::<Request>(br#"{"remove_memory":{"slot":1,"extra":2}}"#).is_err());
        assert!(decode::<Request>(br#"{"remove_memory":{"slot":-1}}"#).is_err());
        assert!(decode::<Request>(br#"{"nonsense":{}}"#).is_err());
        assert!(decode::<Request>(&vec![b' '; MAX_MESSAGE + 1]).is_err());
    }
}
