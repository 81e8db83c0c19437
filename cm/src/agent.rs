//! The sans-IO CM agent: one device's connections, listeners and timers,
//! following Linux's `cm.c` state machine (notes §2.8–2.9) so that a Linux
//! peer sees the CM it expects.
//!
//! The caller feeds in what happens — a MAD received on QP1
//! ([`Agent::handle_mad`]), a consumer's request ([`Agent::connect`],
//! [`Agent::accept`], [`Agent::reject`], [`Agent::disconnect`], …), the
//! passing of time ([`Agent::tick`]) — and drains what the agent wants done:
//! MADs to send ([`Agent::poll_transmit`]) and events for the consumer
//! ([`Agent::poll_event`]). It never reads a clock, draws randomness only
//! from its seed, and touches no QP, so the same inputs always give the
//! same outputs.
//!
//! Memory is bounded: connections (in every state, timewait included) and
//! listeners by the configuration, queued MADs and events by
//! `max_queued`. What does not fit is dropped and counted in [`Stats`]; a
//! MAD that cannot be acted on is dropped with a [`DropReason`].

use std::collections::hash_map::Entry;
use std::collections::{BTreeSet, HashMap, HashSet, VecDeque};
use std::time::{Duration, Instant};

use crate::gid::{Gid, MadPath};
use crate::mad::{CmMessage, EncodeError, Mad, MessageKind, PrivateData, MAD_SIZE};
use crate::messages::{
    Drep, Dreq, Mra, PathInfo, Rej, RejectReason, Rep, Req, Rtu, SidrRep, SidrReq, SidrStatus,
    TargetMessage, TransportType, ARI_SIZE, SIDR_REQ_PRIVATE_DATA_SIZE,
};
use crate::qp::{active_qp_attrs, passive_qp_attrs, QpAttrs};
use crate::timing::{cm_ack_timeout, cm_time};
use crate::DecodeError;

/// The P_Key a RoCE path must carry (Linux refuses others with REJ 12).
pub const DEFAULT_PKEY: u16 = 0xffff;
/// The service timeout of the MRA Linux's rdma_cm arms after delivering a
/// connect request or response (`CMA_CM_MRA_SETTING`, about 68.7 s).
pub const LINUX_MRA_SERVICE_TIMEOUT: u8 = 24;

/// Connection states (Linux `enum ib_cm_state`). `Idle` and `Listen` are
/// never a connection's: a connection that returns to idle is gone, and
/// listeners are kept apart by service ID.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CmState {
    Idle,
    Listen,
    ReqSent,
    ReqRcvd,
    MraReqSent,
    MraReqRcvd,
    RepSent,
    RepRcvd,
    MraRepSent,
    MraRepRcvd,
    Established,
    DreqSent,
    DreqRcvd,
    Timewait,
    SidrReqSent,
    SidrReqRcvd,
}

/// A connection (or SIDR request): its local communication ID, which is
/// also the low half of the TIDs this side originates for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ConnId(u32);

impl ConnId {
    pub fn comm_id(self) -> u32 {
        self.0
    }
}

/// What the agent tells its consumer (rdma_cm's events, one level down).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// A REQ for a listened service ID (passive side). The consumer
    /// accepts or rejects; the QP attributes come back from `accept`.
    ConnectRequest {
        conn: ConnId,
        path: MadPath,
        req: Box<Req>,
    },
    /// A REP answered this side's REQ (active side): move the QP to RTR
    /// and RTS with `qp`, then `establish` (which sends the RTU).
    ConnectResponse {
        conn: ConnId,
        rep: Box<Rep>,
        qp: QpAttrs,
    },
    /// The RTU arrived (passive side).
    Established { conn: ConnId },
    /// The peer refused or abandoned the connection. The connection is
    /// gone, or in timewait if a TIMEWAIT_EXIT follows.
    Rejected { conn: ConnId, rej: Box<Rej> },
    /// The REQ, REP or SIDR_REQ went unanswered through every retry; the
    /// connection is gone (rdma_cm: UNREACHABLE, −ETIMEDOUT).
    Unreachable { conn: ConnId },
    /// The connection is over: a DREQ arrived, a DREP answered ours, or ours
    /// went unanswered (`timed_out`). Sent once per connection.
    Disconnected { conn: ConnId, timed_out: bool },
    /// Timewait is over and the connection is gone; its QP may be reused.
    TimewaitExit { conn: ConnId },
    /// A SIDR_REQ for a listened service ID: answer with `sidr_accept` or
    /// `sidr_reject`.
    SidrRequest {
        conn: ConnId,
        path: MadPath,
        req: Box<SidrReq>,
    },
    /// The answer to this side's SIDR_REQ (status 0: `rep` names the UD QP
    /// and Q_Key); the request is gone.
    SidrResponse { conn: ConnId, rep: Box<SidrRep> },
}

/// Why a received MAD changed nothing and got no answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DropReason {
    /// Not a CM MAD the codec accepts.
    Malformed,
    /// LAP or APR, which Linux refuses on RoCE.
    Unsupported,
    /// No connection has the comm IDs it names.
    UnknownConnection,
    /// The connection is in a state where this message means nothing.
    UnexpectedState,
    /// A duplicate (retransmission) that needs no answer in this state.
    Duplicate,
    /// A DREQ naming a QPN other than the connection's (Linux ignores it).
    WrongQpn,
    /// The connection table is full.
    TableFull,
}

impl DropReason {
    pub const COUNT: usize = 7;

    pub fn index(self) -> usize {
        self as usize
    }

    /// A stable counter label.
    pub fn name(self) -> &'static str {
        match self {
            DropReason::Malformed => "malformed",
            DropReason::Unsupported => "unsupported",
            DropReason::UnknownConnection => "unknown_connection",
            DropReason::UnexpectedState => "unexpected_state",
            DropReason::Duplicate => "duplicate",
            DropReason::WrongQpn => "wrong_qpn",
            DropReason::TableFull => "table_full",
        }
    }
}

/// The agent's counters.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Stats {
    /// MADs decoded, by [`MessageKind::index`].
    pub received: [u64; MessageKind::COUNT],
    /// MADs queued for sending (retransmissions included).
    pub sent: [u64; MessageKind::COUNT],
    pub retransmits: u64,
    /// Duplicates recognised (answered or not), as Linux's `cm_rx_duplicates`.
    pub duplicates: u64,
    /// Received MADs dropped, by [`DropReason::index`].
    pub dropped: [u64; DropReason::COUNT],
    /// MADs the caller never got because the transmit queue was full.
    pub transmits_lost: u64,
    /// Events the consumer never got because the event queue was full.
    pub events_lost: u64,
    /// Messages of the agent's own making that did not encode: always 0
    /// unless the agent has a bug.
    pub encode_failures: u64,
}

impl Stats {
    pub fn received(&self, kind: MessageKind) -> u64 {
        self.received[kind.index()]
    }

    pub fn sent(&self, kind: MessageKind) -> u64 {
        self.sent[kind.index()]
    }

    pub fn dropped(&self, reason: DropReason) -> u64 {
        self.dropped[reason.index()]
    }
}

/// Why a consumer's request was refused (nothing changed).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum AgentError {
    #[error("No connection {0:?}")]
    UnknownConnection(ConnId),
    #[error("Connection {conn:?} is in state {state:?}, where {op} is not allowed")]
    WrongState {
        conn: ConnId,
        state: CmState,
        op: &'static str,
    },
    #[error("The connection table is full ({0} entries)")]
    TooManyConnections(usize),
    #[error("The listener table is full ({0} entries)")]
    TooManyListeners(usize),
    #[error("Service ID {0:#018x} already has a listener")]
    AlreadyListening(u64),
    #[error("Message does not encode")]
    Encode(#[from] EncodeError),
}

/// How an agent is set up.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AgentConfig {
    /// This device's CA GUID: stable and unique (Linux tells connections
    /// apart by it, and by it finds stale ones).
    pub ca_guid: u64,
    /// Connections in any state, timewait included.
    pub max_connections: usize,
    pub max_listeners: usize,
    /// MADs waiting in the transmit queue, and events in the event queue.
    pub max_queued: usize,
    /// The service timeout of the MRA armed after a connect request or
    /// response is delivered, sent only if the peer retransmits before the
    /// consumer answers (Linux rdma_cm: 24). `None`: no MRA, duplicates
    /// are dropped.
    pub mra_service_timeout: Option<u8>,
    /// Seeds comm IDs and TIDs (Linux draws them at random).
    pub seed: u64,
}

impl AgentConfig {
    pub fn new(ca_guid: u64, seed: u64) -> AgentConfig {
        AgentConfig {
            ca_guid,
            max_connections: 4096,
            max_listeners: 256,
            max_queued: 4096,
            mra_service_timeout: Some(LINUX_MRA_SERVICE_TIMEOUT),
            seed,
        }
    }
}

/// A connection request to send: the REQ (whose comm ID and CA GUID the
/// agent fills in), where to send it, and the path's packet lifetime (which
/// with the REQ's timeouts sets the retransmit interval and ACK timeout).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConnectParams {
    pub path: MadPath,
    pub packet_life_time: u8,
    pub req: Req,
}

impl ConnectParams {
    /// An RC REQ shaped like Linux's over rxe (notes §2.7): P_Key 0xFFFF,
    /// permissive LIDs, GIDs from `path`, MTU 1024, CM response timeouts
    /// 20/20, 15 CM retries, retry and RNR retry 7, hop limit 64, packet
    /// lifetime 18 and ACK timeout 19.
    pub fn new(service_id: u64, path: MadPath, qpn: u32, starting_psn: u32) -> ConnectParams {
        const PLT: u8 = 18;
        ConnectParams {
            path,
            packet_life_time: PLT,
            req: Req {
                service_id,
                local_qpn: qpn,
                starting_psn,
                transport: TransportType::Rc,
                remote_cm_response_timeout: 20,
                local_cm_response_timeout: 20,
                retry_count: 7,
                rnr_retry_count: 7,
                max_cm_retries: 15,
                pkey: DEFAULT_PKEY,
                path_mtu: 3,
                primary: PathInfo {
                    local_lid: 0xffff,
                    remote_lid: 0xffff,
                    local_gid: path.local,
                    remote_gid: path.remote,
                    hop_limit: 64,
                    local_ack_timeout: cm_ack_timeout(15, PLT),
                    ..PathInfo::default()
                },
                ..Req::default()
            },
        }
    }
}

/// A SIDR request to send.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SidrParams {
    pub path: MadPath,
    pub service_id: u64,
    pub pkey: u16,
    pub private_data: PrivateData<SIDR_REQ_PRIVATE_DATA_SIZE>,
    /// Retransmit interval as a CM time (Linux: 20, 4096 ms).
    pub timeout: u8,
    /// Linux: 15.
    pub max_retries: u8,
}

impl SidrParams {
    pub fn new(service_id: u64, path: MadPath) -> SidrParams {
        SidrParams {
            path,
            service_id,
            pkey: DEFAULT_PKEY,
            private_data: PrivateData::default(),
            timeout: 20,
            max_retries: 15,
        }
    }
}

/// A MAD for the caller to send on QP1 (UD, Q_Key 0x80010000) to
/// `path.remote`, from `path.local`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Transmit {
    pub path: MadPath,
    pub mad: [u8; MAD_SIZE],
}

/// A message waiting for its answer, resent every `interval` while
/// retries last (the MAD layer's job in Linux).
#[derive(Debug)]
struct Pending {
    mad: Box<[u8; MAD_SIZE]>,
    interval: Duration,
    retries_left: u8,
}

#[derive(Debug)]
struct Conn {
    state: CmState,
    path: MadPath,
    /// The peer's comm ID once known (Linux's 0 means unknown).
    remote_id: Option<u32>,
    remote_ca_guid: u64,
    local_qpn: u32,
    remote_qpn: u32,
    service_id: u64,
    /// The TID replies use (the REQ's, later the DREQ's).
    tid: u64,
    /// Retransmit interval of REQ/REP/DREQ (Linux's `timeout_ms`).
    timeout: Duration,
    max_retries: u8,
    /// The connection's ACK timeout (Linux's `av.timeout`): timewait length.
    av_timeout: u8,
    /// Active side: the path's packet lifetime.
    packet_life_time: u8,
    /// The service timeout of the armed MRA.
    mra_timeout: u8,
    /// Private data of the last RTU/MRA/DREP sent, for answering duplicates.
    private_data: Vec<u8>,
    /// The REQ this connection was made with (sent or received).
    req: Option<Box<Req>>,
    pending: Option<Pending>,
    deadline: Option<Instant>,
    /// The consumer destroyed it: finish the protocol silently.
    detached: bool,
    disconnect_reported: bool,
    remote_key: Option<(u64, u32)>,
    qpn_key: Option<(u64, u32)>,
    sidr_key: Option<(Gid, u32)>,
}

impl Conn {
    fn new(state: CmState, path: MadPath, service_id: u64, tid: u64) -> Conn {
        Conn {
            state,
            path,
            remote_id: None,
            remote_ca_guid: 0,
            local_qpn: 0,
            remote_qpn: 0,
            service_id,
            tid,
            timeout: Duration::ZERO,
            max_retries: 0,
            av_timeout: 0,
            packet_life_time: 0,
            mra_timeout: 0,
            private_data: Vec::new(),
            req: None,
            pending: None,
            deadline: None,
            detached: false,
            disconnect_reported: false,
            remote_key: None,
            qpn_key: None,
            sidr_key: None,
        }
    }
}

/// A REJ carrying no private data, for a message with no connection
/// behind it; an ARI longer than the field is cut to it.
fn bare_rej(
    local_comm_id: u32,
    remote_comm_id: u32,
    message: TargetMessage,
    reason: RejectReason,
    ari: &[u8],
) -> Rej {
    let mut field = [0u8; ARI_SIZE];
    let len = ari.len().min(ARI_SIZE);
    if let (Some(dst), Some(src)) = (field.get_mut(..len), ari.get(..len)) {
        dst.copy_from_slice(src);
    }
    Rej {
        local_comm_id,
        remote_comm_id,
        message,
        ari_length: len as u8,
        reason,
        ari: field,
        private_data: PrivateData::default(),
    }
}

/// splitmix64: small, seedable, good enough for IDs that must only be
/// hard to guess across reboots, as Linux's are.
fn splitmix(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// One device's Communication Manager.
#[derive(Debug)]
pub struct Agent {
    config: AgentConfig,
    /// Comm IDs are a counter XOR a random operand, as Linux's
    /// `cm_alloc_id_priv`: unique for 2^32 allocations, not guessable.
    next_id: u32,
    id_operand: u32,
    /// The high half of the TIDs this agent originates.
    hi_tid: u32,
    conns: HashMap<u32, Conn>,
    /// (peer CA GUID, peer comm ID) → local ID: duplicate REQ/REP detection
    /// and REJ(timeout) lookup. Linux's `remote_id_table`.
    by_remote: HashMap<(u64, u32), u32>,
    /// (peer CA GUID, peer QPN) → local ID: stale connection detection.
    /// Linux's `remote_qp_table`.
    by_qpn: HashMap<(u64, u32), u32>,
    /// (peer GID, request ID) → local ID: duplicate SIDR_REQ detection.
    by_sidr: HashMap<(Gid, u32), u32>,
    listeners: HashSet<u64>,
    timers: BTreeSet<(Instant, u32)>,
    transmits: VecDeque<Transmit>,
    events: VecDeque<Event>,
    stats: Stats,
}

impl Agent {
    pub fn new(config: AgentConfig) -> Agent {
        let mut rng = config.seed;
        let next_id = splitmix(&mut rng) as u32;
        let id_operand = splitmix(&mut rng) as u32;
        let hi_tid = splitmix(&mut rng) as u32;
        Agent {
            config,
            next_id,
            id_operand,
            hi_tid,
            conns: HashMap::new(),
            by_remote: HashMap::new(),
            by_qpn: HashMap::new(),
            by_sidr: HashMap::new(),
            listeners: HashSet::new(),
            timers: BTreeSet::new(),
            transmits: VecDeque::new(),
            events: VecDeque::new(),
            stats: Stats::default(),
        }
    }

    pub fn config(&self) -> &AgentConfig {
        &self.config
    }

    pub fn stats(&self) -> &Stats {
        &self.stats
    }

    /// A connection's state; `None` once it is gone.
    pub fn state(&self, conn: ConnId) -> Option<CmState> {
        self.conns.get(&conn.0).map(|c| c.state)
    }

    /// Connections in the table, timewait and detached ones included.
    pub fn connection_count(&self) -> usize {
        self.conns.len()
    }

    pub fn listener_count(&self) -> usize {
        self.listeners.len()
    }

    /// The next MAD to send, in order.
    pub fn poll_transmit(&mut self) -> Option<Transmit> {
        self.transmits.pop_front()
    }

    /// The next event for the consumer, in order.
    pub fn poll_event(&mut self) -> Option<Event> {
        self.events.pop_front()
    }

    /// When [`Agent::tick`] next has something to do.
    pub fn next_deadline(&self) -> Option<Instant> {
        self.timers.first().map(|&(at, _)| at)
    }

    // ----- Consumer requests ---------------------------------------------

    /// Starts answering REQs and SIDR_REQs for `service_id`.
    pub fn listen(&mut self, service_id: u64) -> Result<(), AgentError> {
        if self.listeners.contains(&service_id) {
            return Err(AgentError::AlreadyListening(service_id));
        }
        if self.listeners.len() >= self.config.max_listeners {
            return Err(AgentError::TooManyListeners(self.config.max_listeners));
        }
        self.listeners.insert(service_id);
        Ok(())
    }

    /// Stops listening; whether there was a listener. Connections already
    /// made from it are not affected.
    pub fn unlisten(&mut self, service_id: u64) -> bool {
        self.listeners.remove(&service_id)
    }

    /// Sends a REQ; the connection retransmits it every
    /// 2·ms(PLT) + ms(Remote CM Response Timeout) up to Max CM Retries
    /// times, then reports [`Event::Unreachable`].
    pub fn connect(&mut self, now: Instant, params: &ConnectParams) -> Result<ConnId, AgentError> {
        let id = self.alloc_id()?;
        let mut req = params.req.clone();
        req.local_comm_id = id;
        req.local_ca_guid = self.config.ca_guid;
        let tid = self.own_tid(id);
        let mad = Mad::new(tid, CmMessage::Req(req.clone())).encode()?;
        let plt = params.packet_life_time;
        let mut conn = Conn::new(CmState::ReqSent, params.path, req.service_id, tid);
        conn.local_qpn = req.local_qpn;
        conn.timeout = cm_time(plt) * 2 + cm_time(req.remote_cm_response_timeout);
        conn.max_retries = req.max_cm_retries;
        // Until the REP gives the peer's ACK delay, Linux's av.timeout is
        // the path's (cm_init_av_by_path: packet lifetime + 1).
        conn.av_timeout = plt.saturating_add(1).min(31);
        conn.packet_life_time = plt;
        conn.req = Some(Box::new(req));
        self.conns.insert(id, conn);
        self.push_mad(params.path, MessageKind::Req, mad);
        self.start_pending(now, id, mad);
        Ok(ConnId(id))
    }

    /// Accepts a connect request with `rep` (whose comm IDs and CA GUID the
    /// agent fills in) and returns the QP attributes for this side. The
    /// REP is retransmitted every ms(REQ's Local CM Response Timeout) until
    /// the RTU arrives.
    pub fn accept(&mut self, now: Instant, conn: ConnId, rep: &Rep) -> Result<QpAttrs, AgentError> {
        let c = self.conn(conn, "accept", &[CmState::ReqRcvd, CmState::MraReqSent])?;
        let mut rep = rep.clone();
        rep.local_comm_id = conn.0;
        rep.remote_comm_id = c.remote_id.unwrap_or(0);
        rep.local_ca_guid = self.config.ca_guid;
        let (path, tid) = (c.path, c.tid);
        let req = c.req.as_deref().cloned().unwrap_or_default();
        let mad = Mad::new(tid, CmMessage::Rep(rep.clone())).encode()?;
        if let Some(c) = self.conns.get_mut(&conn.0) {
            c.state = CmState::RepSent;
            c.local_qpn = rep.local_qpn;
        }
        self.push_mad(path, MessageKind::Rep, mad);
        self.start_pending(now, conn.0, mad);
        Ok(passive_qp_attrs(&req, &rep))
    }

    /// Sends the RTU after a connect response (rdma_cm's `rdma_establish`,
    /// or what it does itself when the consumer has a QP). No event follows:
    /// the consumer knows.
    pub fn establish(&mut self, conn: ConnId, private_data: &[u8]) -> Result<(), AgentError> {
        let c = self.conn(conn, "establish", &[CmState::RepRcvd, CmState::MraRepSent])?;
        let rtu = Rtu {
            local_comm_id: conn.0,
            remote_comm_id: c.remote_id.unwrap_or(0),
            private_data: PrivateData::new(private_data)?,
        };
        let (path, tid) = (c.path, c.tid);
        let mad = Mad::new(tid, CmMessage::Rtu(rtu)).encode()?;
        if let Some(c) = self.conns.get_mut(&conn.0) {
            c.state = CmState::Established;
            c.private_data = private_data.to_vec();
        }
        self.push_mad(path, MessageKind::Rtu, mad);
        Ok(())
    }

    /// Refuses a connection (rdma_cm's `rdma_reject` sends reason 28,
    /// [`RejectReason::CONSUMER_DEFINED`]): a REQ or REP received, or one's
    /// own REQ or REP still unanswered. The connection is gone, or (for a
    /// REP sent) in timewait.
    pub fn reject(
        &mut self,
        now: Instant,
        conn: ConnId,
        reason: RejectReason,
        ari: &[u8],
        private_data: &[u8],
    ) -> Result<(), AgentError> {
        use CmState::*;
        let c = self.conn(
            conn,
            "reject",
            &[
                ReqSent, MraReqRcvd, ReqRcvd, MraReqSent, RepRcvd, MraRepSent, RepSent, MraRepRcvd,
            ],
        )?;
        let state = c.state;
        let rej = self.format_rej(conn.0, c, reason, ari, private_data)?;
        self.send_rej_locked(now, conn.0, state, rej);
        Ok(())
    }

    /// Disconnects: sends a DREQ from ESTABLISHED (retransmitted like the
    /// REQ/REP; [`Event::Disconnected`] follows with the DREP or when it
    /// times out), or answers the peer's DREQ with a DREP from DREQ_RCVD
    /// and enters timewait. Linux sends its DREP only this way, when its
    /// application disconnects.
    pub fn disconnect(
        &mut self,
        now: Instant,
        conn: ConnId,
        private_data: &[u8],
    ) -> Result<(), AgentError> {
        let c = self.conn(
            conn,
            "disconnect",
            &[CmState::Established, CmState::DreqRcvd],
        )?;
        if c.state == CmState::Established {
            let mad = self.dreq_mad(conn.0, c, private_data)?;
            let path = c.path;
            if let Some(c) = self.conns.get_mut(&conn.0) {
                c.state = CmState::DreqSent;
            }
            self.push_mad(path, MessageKind::Dreq, mad);
            self.start_pending(now, conn.0, mad);
        } else {
            let drep = Drep {
                local_comm_id: conn.0,
                remote_comm_id: c.remote_id.unwrap_or(0),
                private_data: PrivateData::new(private_data)?,
            };
            let (path, tid) = (c.path, c.tid);
            let mad = Mad::new(tid, CmMessage::Drep(drep)).encode()?;
            if let Some(c) = self.conns.get_mut(&conn.0) {
                c.private_data = private_data.to_vec();
            }
            self.enter_timewait(now, conn.0);
            self.push_mad(path, MessageKind::Drep, mad);
        }
        Ok(())
    }

    /// The consumer is done with a connection, in whatever state (Linux's
    /// `cm_destroy_id`): a pending REQ is withdrawn with REJ(timeout), an
    /// unanswered REQ/REP refused with REJ 28, an established connection
    /// sent one DREQ, a received DREQ answered, a SIDR_REQ refused. What
    /// must still run (timewait) runs without events, then the connection
    /// is gone.
    pub fn destroy(&mut self, now: Instant, conn: ConnId) -> Result<(), AgentError> {
        use CmState::*;
        let c = self
            .conns
            .get(&conn.0)
            .ok_or(AgentError::UnknownConnection(conn))?;
        let state = c.state;
        match state {
            ReqSent | MraReqRcvd => {
                let guid = self.config.ca_guid.to_be_bytes();
                let rej = self.format_rej(conn.0, c, RejectReason::TIMEOUT, &guid, &[])?;
                self.send_rej_locked(now, conn.0, state, rej);
            }
            ReqRcvd | MraReqSent | RepRcvd | MraRepSent | RepSent | MraRepRcvd => {
                let rej = self.format_rej(conn.0, c, RejectReason::CONSUMER_DEFINED, &[], &[])?;
                self.send_rej_locked(now, conn.0, state, rej);
            }
            Established => {
                // One DREQ, no retries: the connection goes straight to
                // timewait (Linux sends the DREQ, then cancels it).
                let mad = self.dreq_mad(conn.0, c, &[])?;
                let path = c.path;
                self.push_mad(path, MessageKind::Dreq, mad);
                self.enter_timewait(now, conn.0);
            }
            DreqSent => self.enter_timewait(now, conn.0),
            DreqRcvd => self.disconnect(now, conn, &[])?,
            SidrReqRcvd => self.sidr_reply(conn, SidrStatus::REJECT, 0, 0, &[])?,
            Timewait | SidrReqSent | Idle | Listen => {}
        }
        match self.conns.get_mut(&conn.0) {
            Some(c) if c.state == Timewait => c.detached = true,
            Some(_) => {
                self.remove(conn.0);
            }
            None => {}
        }
        Ok(())
    }

    /// Sends a SIDR_REQ (retransmitted every ms(`timeout`) up to
    /// `max_retries` times, then [`Event::Unreachable`]).
    pub fn sidr_request(
        &mut self,
        now: Instant,
        params: &SidrParams,
    ) -> Result<ConnId, AgentError> {
        let id = self.alloc_id()?;
        let tid = self.own_tid(id);
        let req = SidrReq {
            request_id: id,
            pkey: params.pkey,
            service_id: params.service_id,
            private_data: params.private_data,
        };
        let mad = Mad::new(tid, CmMessage::SidrReq(req)).encode()?;
        let mut conn = Conn::new(CmState::SidrReqSent, params.path, params.service_id, tid);
        conn.timeout = cm_time(params.timeout);
        conn.max_retries = params.max_retries;
        self.conns.insert(id, conn);
        self.push_mad(params.path, MessageKind::SidrReq, mad);
        self.start_pending(now, id, mad);
        Ok(ConnId(id))
    }

    /// Answers a SIDR request with this side's UD QP and Q_Key (rdma_cm uses
    /// Q_Key 0x01234567); the request is then gone.
    pub fn sidr_accept(
        &mut self,
        conn: ConnId,
        qpn: u32,
        qkey: u32,
        private_data: &[u8],
    ) -> Result<(), AgentError> {
        self.sidr_reply(conn, SidrStatus::SUCCESS, qpn, qkey, private_data)
    }

    /// Refuses a SIDR request with `status` (Linux: 2, reject).
    pub fn sidr_reject(
        &mut self,
        conn: ConnId,
        status: SidrStatus,
        private_data: &[u8],
    ) -> Result<(), AgentError> {
        self.sidr_reply(conn, status, 0, 0, private_data)
    }

    // ----- Time ----------------------------------------------------------

    /// Runs every timer due at `now`: retransmissions, their exhaustion,
    /// timewait exits.
    pub fn tick(&mut self, now: Instant) {
        while let Some(&(at, id)) = self.timers.first() {
            if at > now {
                break;
            }
            self.timers.remove(&(at, id));
            if let Some(c) = self.conns.get_mut(&id) {
                c.deadline = None;
            }
            self.on_timer(now, id);
        }
    }

    fn on_timer(&mut self, now: Instant, id: u32) {
        use CmState::*;
        let Some(c) = self.conns.get_mut(&id) else {
            return;
        };
        let (state, path, detached) = (c.state, c.path, c.detached);
        if state == Timewait {
            self.remove(id);
            self.emit(detached, Event::TimewaitExit { conn: ConnId(id) });
            return;
        }
        let Some(p) = c.pending.as_mut() else {
            return;
        };
        if p.retries_left > 0 {
            p.retries_left -= 1;
            let (mad, interval) = (*p.mad, p.interval);
            let kind = match state {
                ReqSent | MraReqRcvd => MessageKind::Req,
                RepSent | MraRepRcvd => MessageKind::Rep,
                DreqSent => MessageKind::Dreq,
                _ => MessageKind::SidrReq,
            };
            self.stats.retransmits += 1;
            self.push_mad(path, kind, mad);
            self.set_deadline(id, Some(now + interval));
            return;
        }
        // Retries exhausted (Linux's cm_process_send_error).
        match state {
            DreqSent => {
                self.enter_timewait(now, id);
                self.report_disconnect(id, true);
            }
            _ => {
                self.remove(id);
                self.emit(detached, Event::Unreachable { conn: ConnId(id) });
            }
        }
    }

    // ----- Received MADs -------------------------------------------------

    /// Acts on a MAD received on QP1 from `path.remote` at `path.local`.
    /// `Err` says why it was dropped without effect (also counted).
    pub fn handle_mad(
        &mut self,
        now: Instant,
        path: MadPath,
        bytes: &[u8],
    ) -> Result<(), DropReason> {
        let result = match Mad::decode(bytes) {
            Ok(mad) => {
                self.stats.received[mad.msg.kind().index()] += 1;
                let tid = mad.header.tid;
                match mad.msg {
                    CmMessage::Req(m) => self.on_req(now, path, tid, m),
                    CmMessage::Mra(m) => self.on_mra(now, m),
                    CmMessage::Rej(m) => self.on_rej(now, m),
                    CmMessage::Rep(m) => self.on_rep(now, path, tid, m),
                    CmMessage::Rtu(m) => self.on_rtu(m),
                    CmMessage::Dreq(m) => self.on_dreq(path, tid, m),
                    CmMessage::Drep(m) => self.on_drep(now, m),
                    CmMessage::SidrReq(m) => self.on_sidr_req(path, tid, m),
                    CmMessage::SidrRep(m) => self.on_sidr_rep(m),
                }
            }
            Err(DecodeError::UnsupportedAttribute(_)) => Err(DropReason::Unsupported),
            Err(_) => Err(DropReason::Malformed),
        };
        if let Err(reason) = result {
            self.stats.dropped[reason.index()] += 1;
        }
        result
    }

    fn on_req(
        &mut self,
        now: Instant,
        path: MadPath,
        tid: u64,
        req: Req,
    ) -> Result<(), DropReason> {
        // A retransmission of a REQ already taken (cm_match_req).
        if let Some(&id) = self.by_remote.get(&(req.local_ca_guid, req.local_comm_id)) {
            self.stats.duplicates += 1;
            let c = self.conns.get(&id).ok_or(DropReason::UnknownConnection)?;
            if c.state != CmState::MraReqSent {
                return Err(DropReason::Duplicate);
            }
            let mra = Mra {
                local_comm_id: id,
                remote_comm_id: req.local_comm_id,
                message: TargetMessage::Req,
                service_timeout: c.mra_timeout,
                private_data: PrivateData::new(&c.private_data).unwrap_or_default(),
            };
            let tid = c.tid;
            self.send(path, tid, CmMessage::Mra(mra));
            return Ok(());
        }
        // The peer reuses a QPN a live connection still has: refuse, and
        // tell the old connection to go.
        if let Some(&old) = self.by_qpn.get(&(req.local_ca_guid, req.local_qpn)) {
            self.issue_rej(
                path,
                tid,
                bare_rej(
                    0,
                    req.local_comm_id,
                    TargetMessage::Req,
                    RejectReason::STALE_CONNECTION,
                    &[],
                ),
            );
            self.dreq_stale(now, old);
            return Ok(());
        }
        if !self.listeners.contains(&req.service_id) {
            self.issue_rej(
                path,
                tid,
                bare_rej(
                    0,
                    req.local_comm_id,
                    TargetMessage::Req,
                    RejectReason::INVALID_SERVICE_ID,
                    &[],
                ),
            );
            return Ok(());
        }
        if req.pkey != DEFAULT_PKEY {
            self.issue_rej(
                path,
                tid,
                bare_rej(
                    0,
                    req.local_comm_id,
                    TargetMessage::Req,
                    RejectReason::INVALID_GID,
                    &path.local.0,
                ),
            );
            return Ok(());
        }
        let id = self.alloc_id().map_err(|_| DropReason::TableFull)?;
        let mut c = Conn::new(CmState::ReqRcvd, path, req.service_id, tid);
        c.remote_id = Some(req.local_comm_id);
        c.remote_ca_guid = req.local_ca_guid;
        c.remote_qpn = req.local_qpn;
        c.timeout = cm_time(req.local_cm_response_timeout);
        c.max_retries = req.max_cm_retries;
        c.av_timeout = req.primary.local_ack_timeout;
        if let Some(t) = self.config.mra_service_timeout {
            // rdma_cm arms a delayed MRA once the request is delivered.
            c.state = CmState::MraReqSent;
            c.mra_timeout = t;
        }
        c.req = Some(Box::new(req.clone()));
        self.conns.insert(id, c);
        self.index_remote(id);
        self.emit(
            false,
            Event::ConnectRequest {
                conn: ConnId(id),
                path,
                req: Box::new(req),
            },
        );
        Ok(())
    }

    fn on_rep(
        &mut self,
        now: Instant,
        path: MadPath,
        tid: u64,
        rep: Rep,
    ) -> Result<(), DropReason> {
        let id = rep.remote_comm_id;
        match self.conns.get(&id) {
            Some(c) if c.remote_id.is_none() => {
                if !matches!(c.state, CmState::ReqSent | CmState::MraReqRcvd) {
                    return Err(DropReason::UnexpectedState);
                }
            }
            _ => return self.dup_rep(path, &rep),
        }
        if self
            .by_remote
            .contains_key(&(rep.local_ca_guid, rep.local_comm_id))
        {
            return Err(DropReason::Duplicate);
        }
        if let Some(&old) = self.by_qpn.get(&(rep.local_ca_guid, rep.local_qpn)) {
            self.issue_rej(
                path,
                tid,
                bare_rej(
                    id,
                    rep.local_comm_id,
                    TargetMessage::Rep,
                    RejectReason::STALE_CONNECTION,
                    &[],
                ),
            );
            self.dreq_stale(now, old);
            return Ok(());
        }
        let mra = self.config.mra_service_timeout;
        let Some(c) = self.conns.get_mut(&id) else {
            return Err(DropReason::UnknownConnection);
        };
        c.remote_id = Some(rep.local_comm_id);
        c.remote_ca_guid = rep.local_ca_guid;
        c.remote_qpn = rep.local_qpn;
        c.av_timeout = cm_ack_timeout(rep.target_ack_delay, c.packet_life_time);
        c.pending = None;
        c.state = CmState::RepRcvd;
        if let Some(t) = mra {
            c.state = CmState::MraRepSent;
            c.mra_timeout = t;
        }
        let qp = active_qp_attrs(
            c.req.as_deref().unwrap_or(&Req::default()),
            &rep,
            c.packet_life_time,
        );
        let detached = c.detached;
        self.set_deadline(id, None);
        self.index_remote(id);
        self.emit(
            detached,
            Event::ConnectResponse {
                conn: ConnId(id),
                rep: Box::new(rep),
                qp,
            },
        );
        Ok(())
    }

    /// A REP for a connection that already has its peer: answered with the
    /// RTU again once established, or the armed MRA (cm_dup_rep_handler).
    fn dup_rep(&mut self, path: MadPath, rep: &Rep) -> Result<(), DropReason> {
        let id = rep.remote_comm_id;
        let c = self
            .conns
            .get(&id)
            .filter(|c| c.remote_id == Some(rep.local_comm_id))
            .ok_or(DropReason::UnknownConnection)?;
        self.stats.duplicates += 1;
        let msg = match c.state {
            CmState::Established => CmMessage::Rtu(Rtu {
                local_comm_id: id,
                remote_comm_id: rep.local_comm_id,
                private_data: PrivateData::new(&c.private_data).unwrap_or_default(),
            }),
            CmState::MraRepSent => CmMessage::Mra(Mra {
                local_comm_id: id,
                remote_comm_id: rep.local_comm_id,
                message: TargetMessage::Rep,
                service_timeout: c.mra_timeout,
                private_data: PrivateData::new(&c.private_data).unwrap_or_default(),
            }),
            _ => return Err(DropReason::Duplicate),
        };
        let tid = c.tid;
        self.send(path, tid, msg);
        Ok(())
    }

    fn on_rtu(&mut self, rtu: Rtu) -> Result<(), DropReason> {
        let id = self.matched(rtu.remote_comm_id, rtu.local_comm_id)?;
        let c = self
            .conns
            .get_mut(&id)
            .ok_or(DropReason::UnknownConnection)?;
        if !matches!(c.state, CmState::RepSent | CmState::MraRepRcvd) {
            self.stats.duplicates += 1;
            return Err(DropReason::Duplicate);
        }
        c.state = CmState::Established;
        c.pending = None;
        let detached = c.detached;
        self.set_deadline(id, None);
        self.emit(detached, Event::Established { conn: ConnId(id) });
        Ok(())
    }

    fn on_dreq(&mut self, path: MadPath, tid: u64, dreq: Dreq) -> Result<(), DropReason> {
        use CmState::*;
        let Ok(id) = self.matched(dreq.remote_comm_id, dreq.local_comm_id) else {
            // Answered anyway, so that a peer whose DREP was lost can finish
            // (cm_issue_drep).
            self.stats.duplicates += 1;
            let drep = Drep {
                local_comm_id: dreq.remote_comm_id,
                remote_comm_id: dreq.local_comm_id,
                private_data: PrivateData::default(),
            };
            self.send(path, tid, CmMessage::Drep(drep));
            return Ok(());
        };
        let c = self
            .conns
            .get_mut(&id)
            .ok_or(DropReason::UnknownConnection)?;
        if c.local_qpn != dreq.remote_qpn {
            return Err(DropReason::WrongQpn);
        }
        match c.state {
            RepSent | DreqSent | MraRepRcvd | Established => {}
            Timewait => {
                self.stats.duplicates += 1;
                let drep = Drep {
                    local_comm_id: id,
                    remote_comm_id: dreq.local_comm_id,
                    private_data: PrivateData::new(&c.private_data).unwrap_or_default(),
                };
                let tid = c.tid;
                self.send(path, tid, CmMessage::Drep(drep));
                return Ok(());
            }
            DreqRcvd => {
                self.stats.duplicates += 1;
                return Err(DropReason::Duplicate);
            }
            _ => return Err(DropReason::UnexpectedState),
        }
        c.state = DreqRcvd;
        c.tid = tid;
        c.pending = None;
        self.set_deadline(id, None);
        self.report_disconnect(id, false);
        Ok(())
    }

    fn on_drep(&mut self, now: Instant, drep: Drep) -> Result<(), DropReason> {
        let id = self.matched(drep.remote_comm_id, drep.local_comm_id)?;
        let c = self.conns.get(&id).ok_or(DropReason::UnknownConnection)?;
        if !matches!(c.state, CmState::DreqSent | CmState::DreqRcvd) {
            return Err(DropReason::UnexpectedState);
        }
        self.enter_timewait(now, id);
        self.report_disconnect(id, false);
        Ok(())
    }

    fn on_mra(&mut self, now: Instant, mra: Mra) -> Result<(), DropReason> {
        use CmState::*;
        let id = match mra.message {
            TargetMessage::Req => self.unmatched(mra.remote_comm_id)?,
            TargetMessage::Rep | TargetMessage::Other => {
                self.matched(mra.remote_comm_id, mra.local_comm_id)?
            }
        };
        let c = self
            .conns
            .get_mut(&id)
            .ok_or(DropReason::UnknownConnection)?;
        let next = match (c.state, mra.message) {
            (ReqSent, TargetMessage::Req) => MraReqRcvd,
            (RepSent, TargetMessage::Rep) => MraRepRcvd,
            (MraReqRcvd | MraRepRcvd, _) => {
                self.stats.duplicates += 1;
                return Err(DropReason::Duplicate);
            }
            _ => return Err(DropReason::UnexpectedState),
        };
        // The peer needs its service timeout on top of a round trip: wait
        // that long before the next retransmission (ib_modify_mad).
        let interval = cm_time(mra.service_timeout) + cm_time(c.av_timeout);
        c.state = next;
        if let Some(p) = c.pending.as_mut() {
            p.interval = interval;
        }
        self.set_deadline(id, Some(now + interval));
        Ok(())
    }

    fn on_rej(&mut self, now: Instant, rej: Rej) -> Result<(), DropReason> {
        use CmState::*;
        let id = if rej.reason == RejectReason::TIMEOUT {
            // The rejecter names itself by CA GUID and comm ID.
            let mut guid = [0u8; 8];
            guid.copy_from_slice(&rej.ari[..8]);
            *self
                .by_remote
                .get(&(u64::from_be_bytes(guid), rej.local_comm_id))
                .ok_or(DropReason::UnknownConnection)?
        } else if rej.message == TargetMessage::Req {
            self.unmatched(rej.remote_comm_id)?
        } else {
            self.matched(rej.remote_comm_id, rej.local_comm_id)?
        };
        let c = self.conns.get(&id).ok_or(DropReason::UnknownConnection)?;
        let detached = c.detached;
        match c.state {
            ReqSent | MraReqRcvd | RepSent | MraRepRcvd | ReqRcvd | MraReqSent => {
                if rej.reason == RejectReason::STALE_CONNECTION {
                    self.enter_timewait(now, id);
                } else {
                    self.remove(id);
                }
            }
            DreqSent | RepRcvd | MraRepSent | Established => self.enter_timewait(now, id),
            _ => return Err(DropReason::UnexpectedState),
        }
        self.emit(
            detached,
            Event::Rejected {
                conn: ConnId(id),
                rej: Box::new(rej),
            },
        );
        Ok(())
    }

    fn on_sidr_req(&mut self, path: MadPath, tid: u64, req: SidrReq) -> Result<(), DropReason> {
        let key = (path.remote, req.request_id);
        if self.by_sidr.contains_key(&key) {
            self.stats.duplicates += 1;
            return Err(DropReason::Duplicate);
        }
        if !self.listeners.contains(&req.service_id) {
            let rep = SidrRep {
                request_id: req.request_id,
                status: SidrStatus::UNSUPPORTED,
                service_id: req.service_id,
                ..SidrRep::default()
            };
            self.send(path, tid, CmMessage::SidrRep(rep));
            return Ok(());
        }
        let id = self.alloc_id().map_err(|_| DropReason::TableFull)?;
        let mut c = Conn::new(CmState::SidrReqRcvd, path, req.service_id, tid);
        c.remote_id = Some(req.request_id);
        c.sidr_key = Some(key);
        self.conns.insert(id, c);
        self.by_sidr.insert(key, id);
        self.emit(
            false,
            Event::SidrRequest {
                conn: ConnId(id),
                path,
                req: Box::new(req),
            },
        );
        Ok(())
    }

    fn on_sidr_rep(&mut self, rep: SidrRep) -> Result<(), DropReason> {
        let id = self.unmatched(rep.request_id)?;
        let c = self.conns.get(&id).ok_or(DropReason::UnknownConnection)?;
        if c.state != CmState::SidrReqSent {
            return Err(DropReason::UnexpectedState);
        }
        let detached = c.detached;
        self.remove(id);
        self.emit(
            detached,
            Event::SidrResponse {
                conn: ConnId(id),
                rep: Box::new(rep),
            },
        );
        Ok(())
    }

    // ----- Helpers -------------------------------------------------------

    /// The connection `local` whose peer is `remote` (Linux's
    /// `cm_acquire_id(local, remote)`).
    fn matched(&self, local: u32, remote: u32) -> Result<u32, DropReason> {
        match self.conns.get(&local) {
            Some(c) if c.remote_id == Some(remote) => Ok(local),
            _ => Err(DropReason::UnknownConnection),
        }
    }

    /// The connection `local` whose peer is not known yet (Linux's
    /// `cm_acquire_id(local, 0)`).
    fn unmatched(&self, local: u32) -> Result<u32, DropReason> {
        match self.conns.get(&local) {
            Some(c) if c.remote_id.is_none() => Ok(local),
            _ => Err(DropReason::UnknownConnection),
        }
    }

    /// A connection the consumer names, in one of `states`.
    fn conn(
        &self,
        conn: ConnId,
        op: &'static str,
        states: &[CmState],
    ) -> Result<&Conn, AgentError> {
        let c = self
            .conns
            .get(&conn.0)
            .ok_or(AgentError::UnknownConnection(conn))?;
        if c.detached || !states.contains(&c.state) {
            return Err(AgentError::WrongState {
                conn,
                state: c.state,
                op,
            });
        }
        Ok(c)
    }

    fn alloc_id(&mut self) -> Result<u32, AgentError> {
        let max = self.config.max_connections;
        if self.conns.len() >= max {
            return Err(AgentError::TooManyConnections(max));
        }
        // Fewer live IDs than tries, and the counter never repeats within
        // 2^32 steps, so this finds one.
        for _ in 0..=self.conns.len() {
            self.next_id = self.next_id.wrapping_add(1);
            let id = self.next_id ^ self.id_operand;
            if id != 0 && !self.conns.contains_key(&id) {
                return Ok(id);
            }
        }
        Err(AgentError::TooManyConnections(max))
    }

    fn own_tid(&self, id: u32) -> u64 {
        u64::from(self.hi_tid) << 32 | u64::from(id)
    }

    /// The REJ a consumer's reject or destroy sends in `c`'s state
    /// (Linux's `cm_format_rej`: a REQ not yet MRAed is refused with local
    /// comm ID 0).
    fn format_rej(
        &self,
        id: u32,
        c: &Conn,
        reason: RejectReason,
        ari: &[u8],
        private_data: &[u8],
    ) -> Result<Rej, AgentError> {
        use CmState::*;
        let mut field = [0u8; ARI_SIZE];
        field
            .get_mut(..ari.len())
            .ok_or(EncodeError::TooLong {
                field: "ARI",
                len: ari.len(),
                max: ARI_SIZE,
            })?
            .copy_from_slice(ari);
        let (local_comm_id, message) = match c.state {
            ReqRcvd => (0, TargetMessage::Req),
            MraReqSent => (id, TargetMessage::Req),
            RepRcvd | MraRepSent => (id, TargetMessage::Rep),
            _ => (id, TargetMessage::Other),
        };
        Ok(Rej {
            local_comm_id,
            remote_comm_id: c.remote_id.unwrap_or(0),
            message,
            ari_length: ari.len() as u8,
            reason,
            ari: field,
            private_data: PrivateData::new(private_data)?,
        })
    }

    /// Sends a REJ for connection `id` from `state`: then gone, or in
    /// timewait when its own REP was out (Linux's `cm_send_rej_locked`).
    fn send_rej_locked(&mut self, now: Instant, id: u32, state: CmState, rej: Rej) {
        let Some(c) = self.conns.get(&id) else {
            return;
        };
        let (path, tid) = (c.path, c.tid);
        self.send(path, tid, CmMessage::Rej(rej));
        if matches!(state, CmState::RepSent | CmState::MraRepRcvd) {
            self.enter_timewait(now, id);
        } else {
            self.remove(id);
        }
    }

    /// Sends a REJ with no connection behind it (Linux's `cm_issue_rej`).
    fn issue_rej(&mut self, path: MadPath, tid: u64, rej: Rej) {
        self.send(path, tid, CmMessage::Rej(rej));
    }

    fn dreq_mad(
        &self,
        id: u32,
        c: &Conn,
        private_data: &[u8],
    ) -> Result<[u8; MAD_SIZE], AgentError> {
        let dreq = Dreq {
            local_comm_id: id,
            remote_comm_id: c.remote_id.unwrap_or(0),
            remote_qpn: c.remote_qpn,
            private_data: PrivateData::new(private_data)?,
        };
        Ok(Mad::new(self.own_tid(id), CmMessage::Dreq(dreq)).encode()?)
    }

    /// A new REQ/REP reuses the QPN of live connection `old`: Linux sends
    /// it a DREQ (only an established one can).
    fn dreq_stale(&mut self, now: Instant, old: u32) {
        if self.state(ConnId(old)) != Some(CmState::Established) {
            return;
        }
        let Some(c) = self.conns.get(&old) else {
            return;
        };
        match self.dreq_mad(old, c, &[]) {
            Ok(mad) => {
                let path = c.path;
                if let Some(c) = self.conns.get_mut(&old) {
                    c.state = CmState::DreqSent;
                }
                self.push_mad(path, MessageKind::Dreq, mad);
                self.start_pending(now, old, mad);
            }
            Err(_) => self.stats.encode_failures += 1,
        }
    }

    fn sidr_reply(
        &mut self,
        conn: ConnId,
        status: SidrStatus,
        qpn: u32,
        qkey: u32,
        private_data: &[u8],
    ) -> Result<(), AgentError> {
        let c = self.conn(conn, "SIDR reply", &[CmState::SidrReqRcvd])?;
        let rep = SidrRep {
            request_id: c.remote_id.unwrap_or(0),
            status,
            qpn,
            service_id: c.service_id,
            qkey,
            private_data: PrivateData::new(private_data)?,
            ..SidrRep::default()
        };
        let (path, tid) = (c.path, c.tid);
        let mad = Mad::new(tid, CmMessage::SidrRep(rep)).encode()?;
        self.remove(conn.0);
        self.push_mad(path, MessageKind::SidrRep, mad);
        Ok(())
    }

    fn index_remote(&mut self, id: u32) {
        let Some(c) = self.conns.get_mut(&id) else {
            return;
        };
        let Some(remote_id) = c.remote_id else {
            return;
        };
        let remote_key = (c.remote_ca_guid, remote_id);
        let qpn_key = (c.remote_ca_guid, c.remote_qpn);
        if let Entry::Vacant(e) = self.by_remote.entry(remote_key) {
            e.insert(id);
            c.remote_key = Some(remote_key);
        }
        if let Entry::Vacant(e) = self.by_qpn.entry(qpn_key) {
            e.insert(id);
            c.qpn_key = Some(qpn_key);
        }
    }

    /// Leaves the duplicate/stale tables, as Linux's `cm_remove_remote`
    /// does on entering timewait or idle.
    fn unindex_remote(&mut self, id: u32) {
        let Some(c) = self.conns.get_mut(&id) else {
            return;
        };
        if let Some(key) = c.remote_key.take() {
            self.by_remote.remove(&key);
        }
        if let Some(key) = c.qpn_key.take() {
            self.by_qpn.remove(&key);
        }
    }

    fn remove(&mut self, id: u32) {
        self.unindex_remote(id);
        self.set_deadline(id, None);
        if let Some(c) = self.conns.remove(&id) {
            if let Some(key) = c.sidr_key {
                self.by_sidr.remove(&key);
            }
        }
    }

    fn enter_timewait(&mut self, now: Instant, id: u32) {
        self.unindex_remote(id);
        let Some(c) = self.conns.get_mut(&id) else {
            return;
        };
        c.state = CmState::Timewait;
        c.pending = None;
        let wait = cm_time(c.av_timeout);
        self.set_deadline(id, Some(now + wait));
    }

    fn report_disconnect(&mut self, id: u32, timed_out: bool) {
        let Some(c) = self.conns.get_mut(&id) else {
            return;
        };
        if c.disconnect_reported {
            return;
        }
        c.disconnect_reported = true;
        let detached = c.detached;
        self.emit(
            detached,
            Event::Disconnected {
                conn: ConnId(id),
                timed_out,
            },
        );
    }

    fn set_deadline(&mut self, id: u32, at: Option<Instant>) {
        let Some(c) = self.conns.get_mut(&id) else {
            return;
        };
        if let Some(old) = c.deadline.take() {
            self.timers.remove(&(old, id));
        }
        if let Some(at) = at {
            c.deadline = Some(at);
            self.timers.insert((at, id));
        }
    }

    /// Arms the retransmission of `mad`, just sent for connection `id`,
    /// with the connection's interval and retries.
    fn start_pending(&mut self, now: Instant, id: u32, mad: [u8; MAD_SIZE]) {
        let Some(c) = self.conns.get_mut(&id) else {
            return;
        };
        let interval = c.timeout;
        c.pending = Some(Pending {
            mad: Box::new(mad),
            interval,
            retries_left: c.max_retries,
        });
        self.set_deadline(id, Some(now + interval));
    }

    /// Encodes and queues a message of the agent's own making.
    fn send(&mut self, path: MadPath, tid: u64, msg: CmMessage) {
        let kind = msg.kind();
        match Mad::new(tid, msg).encode() {
            Ok(mad) => self.push_mad(path, kind, mad),
            Err(_) => self.stats.encode_failures += 1,
        }
    }

    fn push_mad(&mut self, path: MadPath, kind: MessageKind, mad: [u8; MAD_SIZE]) {
        if self.transmits.len() >= self.config.max_queued {
            self.stats.transmits_lost += 1;
            return;
        }
        self.stats.sent[kind.index()] += 1;
        self.transmits.push_back(Transmit { path, mad });
    }

    fn emit(&mut self, detached: bool, event: Event) {
        if detached {
            return;
        }
        if self.events.len() >= self.config.max_queued {
            self.stats.events_lost += 1;
            return;
        }
        self.events.push_back(event);
    }

    /// Checks the agent's tables agree with each other (for tests and fuzz
    /// checks): every index entry names a live connection holding that
    /// key, every timer a connection with that deadline, and the bounds
    /// hold.
    pub fn check_consistency(&self) -> Result<(), &'static str> {
        if self.conns.len() > self.config.max_connections {
            return Err("more connections than max_connections");
        }
        if self.listeners.len() > self.config.max_listeners {
            return Err("more listeners than max_listeners");
        }
        if self.transmits.len() > self.config.max_queued
            || self.events.len() > self.config.max_queued
        {
            return Err("a queue is longer than max_queued");
        }
        for (key, id) in &self.by_remote {
            if self.conns.get(id).and_then(|c| c.remote_key) != Some(*key) {
                return Err("remote-ID index names a connection without that key");
            }
        }
        for (key, id) in &self.by_qpn {
            if self.conns.get(id).and_then(|c| c.qpn_key) != Some(*key) {
                return Err("remote-QPN index names a connection without that key");
            }
        }
        for (key, id) in &self.by_sidr {
            if self.conns.get(id).and_then(|c| c.sidr_key) != Some(*key) {
                return Err("SIDR index names a connection without that key");
            }
        }
        for &(at, id) in &self.timers {
            if self.conns.get(&id).and_then(|c| c.deadline) != Some(at) {
                return Err("a timer names a connection without that deadline");
            }
        }
        for (id, c) in &self.conns {
            if let Some(at) = c.deadline {
                if !self.timers.contains(&(at, *id)) {
                    return Err("a connection's deadline has no timer");
                }
            }
            if c.remote_key
                .is_some_and(|k| self.by_remote.get(&k) != Some(id))
                || c.qpn_key.is_some_and(|k| self.by_qpn.get(&k) != Some(id))
            {
                return Err("a connection's key is not indexed to it");
            }
            let waits = matches!(
                c.state,
                CmState::ReqSent
                    | CmState::MraReqRcvd
                    | CmState::RepSent
                    | CmState::MraRepRcvd
                    | CmState::DreqSent
                    | CmState::SidrReqSent
            );
            if waits != c.pending.is_some() {
                return Err("a retransmission is pending exactly while an answer is awaited");
            }
            if (waits || c.state == CmState::Timewait) != c.deadline.is_some() {
                return Err("a connection waiting for an answer or in timewait has no deadline");
            }
            if c.state == CmState::Timewait && (c.remote_key.is_some() || c.qpn_key.is_some()) {
                return Err("a connection in timewait is still indexed");
            }
        }
        Ok(())
    }
}
