//! The connection manager's state, under one lock: the agent, the CM IDs,
//! the port spaces and the owners' event queues. Every command of an
//! owner and every MAD from QP1 is applied here; afterwards
//! [`State::flush`] sends what the agent wants sent and turns its events
//! into rdma_cm events on the owners' queues.
//!
//! Nothing a peer sends can panic this code: MADs are decoded by the
//! agent (which drops what it cannot use), the CMA header is parsed with
//! checks, and a connection the agent reports that no ID drives is
//! ignored.

use std::collections::HashMap;
use std::net::{Ipv4Addr, SocketAddrV4};
use std::sync::Arc;
use std::time::Instant;

use vrdma_cm::cma::CMA_HEADER_LEN;
use vrdma_cm::messages::{
    REJ_PRIVATE_DATA_SIZE, REP_PRIVATE_DATA_SIZE, REQ_PRIVATE_DATA_SIZE,
    SIDR_REP_PRIVATE_DATA_SIZE, SIDR_REQ_PRIVATE_DATA_SIZE,
};
use vrdma_cm::{
    cm_ack_timeout, service_id, Agent, AgentConfig, CmState, CmaAddrs, CmaHeader, ConnId,
    ConnectParams, Gid, MadPath, PortSpace, RejectReason, Rep, SidrParams, SidrStatus, Transmit,
    TransportType, DEFAULT_PKEY,
};
use vrdma_hostd_protocol::messages::{MadIn, MadOut};
use vrdma_spec::verbs::{QpState, QpType};

use super::counters::{CmCounters, ServiceCounts};
use super::event::{CmEvent, CmEventKind, EventQueue};
use super::ids::{qp_type_of, CmId, IdInfo, IdState, PathRecord};
use super::ports::PortTable;
use super::qp_attr::{self, QpAttr, RDMA_UDP_QKEY};
use super::{CmError, ConnParam, IdNum, OwnerId};
use crate::fabric::{Fabric, FabricError};

mod events;

/// What the state needs of QP1 and of hostd: a [`Fabric`], or a test's
/// stand-in.
pub trait Qp1 {
    fn send_mad(&self, mad: MadOut) -> Result<(), FabricError>;
    fn resolve_gid(&self, gid: [u8; 16]) -> Result<(), FabricError>;
}

impl Qp1 for Fabric {
    fn send_mad(&self, mad: MadOut) -> Result<(), FabricError> {
        Fabric::post_mad(self, mad)
    }

    fn resolve_gid(&self, gid: [u8; 16]) -> Result<(), FabricError> {
        Fabric::resolve_gid(self, gid)
    }
}

/// How a device's connection manager behaves (the timing defaults are
/// Linux's over rxe, rdmacm-notes §2.7 and §2.9).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CmConfig {
    /// The device's port MTU (an `ibv_mtu` value): the path MTU routes get.
    pub path_mtu: u8,
    /// The path's packet lifetime (Linux: 18); with the response timeout
    /// it sets the REQ's retransmit interval and the ACK timeout.
    pub packet_life_time: u8,
    /// CM response timeout put in REQs (Linux: 20, about 4 s).
    pub cm_response_timeout: u8,
    /// Max CM retries put in REQs (Linux: 15).
    pub max_cm_retries: u8,
    /// SIDR_REQ retransmit interval, as a CM time (Linux: 20).
    pub sidr_timeout: u8,
    pub sidr_retries: u8,
    /// CM IDs, over all owners.
    pub max_ids: usize,
    /// Connect requests one listener holds unanswered at most, whatever
    /// backlog `rdma_listen` was given (Linux's CM on IB and RoCE ignores
    /// it, and programs pass small ones — cmtime 0, rping 3 — then take
    /// thousands of requests at once); a bound all the same, so that
    /// peers' requests cannot take every CM ID of the device.
    pub max_pending: u32,
    pub max_owners: usize,
    /// The agent's tables.
    pub agent_connections: usize,
    pub agent_listeners: usize,
}

impl Default for CmConfig {
    fn default() -> Self {
        CmConfig {
            path_mtu: 3,
            packet_life_time: 18,
            cm_response_timeout: 20,
            max_cm_retries: 15,
            sidr_timeout: 20,
            sidr_retries: 15,
            max_ids: 4096,
            max_pending: 2048,
            max_owners: 256,
            agent_connections: 4096,
            agent_listeners: 256,
        }
    }
}

/// Status of ADDR_ERROR, for an unknown destination and for one the
/// tenant may not reach alike.
pub const ADDR_ERROR_STATUS: i32 = -libc::EHOSTUNREACH;
/// Status of UNREACHABLE after the retries of a REQ or SIDR_REQ.
pub const UNREACHABLE_STATUS: i32 = -libc::ETIMEDOUT;

/// The connection manager of one device.
#[derive(Debug)]
pub struct State {
    tenant: Arc<str>,
    config: CmConfig,
    agent: Agent,
    local_ip: Ipv4Addr,
    local_gid: Gid,
    ports: PortTable,
    ids: HashMap<IdNum, CmId>,
    by_conn: HashMap<ConnId, IdNum>,
    owners: HashMap<OwnerId, EventQueue>,
    next_id: u32,
    next_owner: u32,
    counts: ServiceCounts,
    /// Destination GIDs hostd last said this device may reach, and when
    /// (see [`State::reachable`]).
    reachable: HashMap<[u8; 16], Instant>,
}

/// How long a destination hostd said the device may reach resolves
/// without asking hostd again: a service connecting to the same peer
/// many times asks once per second, not once per connection (hostd's
/// answer is a round trip through its connection thread). Only an early
/// answer rides on it, as an ARP cache's: hostd checks the destination
/// again for each MAD the device sends and at each QP's RTR, so a peer the
/// policy stops allowing is refused there at once.
const REACHABLE_FOR: std::time::Duration = std::time::Duration::from_secs(1);

/// Destinations remembered at most (a guest resolving ever new addresses
/// makes the oldest be forgotten, not the memory grow).
const REACHABLE_MAX: usize = 1024;

impl State {
    /// The state of the device whose GID is `gid` (IPv4-mapped).
    pub fn new(tenant: Arc<str>, gid: [u8; 16], config: CmConfig) -> Result<State, CmError> {
        let ip = vrdma_spec::gid::ipv4_of(&gid).ok_or(CmError::NotIpv4)?;
        let local_ip = Ipv4Addr::from(ip);
        // A stable CA GUID per device address: a locally administered
        // EUI-64 around the IPv4 address.
        let [a, b, c, d] = ip;
        let ca_guid = u64::from_be_bytes([0x02, 0x76, 0x72, 0xff, a, b, c, d]);
        let mut agent_config = AgentConfig::new(ca_guid, rand::random());
        agent_config.max_connections = config.agent_connections;
        agent_config.max_listeners = config.agent_listeners;
        let start = rand::random::<u16>();
        Ok(State {
            tenant,
            agent: Agent::new(agent_config),
            local_ip,
            local_gid: Gid(gid),
            ports: PortTable::new(start),
            ids: HashMap::new(),
            by_conn: HashMap::new(),
            owners: HashMap::new(),
            next_id: 0,
            next_owner: 0,
            counts: ServiceCounts::default(),
            reachable: HashMap::new(),
            config,
        })
    }

    /// Whether the device may reach `gid`: hostd's answer, remembered for
    /// [`REACHABLE_FOR`] when it is yes (a no is asked again each time).
    fn reachable(&mut self, gid: [u8; 16], qp1: &dyn Qp1) -> Result<bool, CmError> {
        let now = Instant::now();
        if (self.reachable.get(&gid)).is_some_and(|&at| now.duration_since(at) < REACHABLE_FOR) {
            return Ok(true);
        }
        match qp1.resolve_gid(gid) {
            Ok(()) => {
                if self.reachable.len() >= REACHABLE_MAX {
                    self.reachable
                        .retain(|_, at| now.duration_since(*at) < REACHABLE_FOR);
                    if self.reachable.len() >= REACHABLE_MAX {
                        self.reachable.clear();
                    }
                }
                self.reachable.insert(gid, now);
                Ok(true)
            }
            Err(FabricError::Refused { errno, .. })
                if errno == libc::EACCES || errno == libc::ENOENT =>
            {
                self.reachable.remove(&gid);
                Ok(false)
            }
            Err(e) => Err(CmError::Fabric(e)),
        }
    }

    pub fn tenant(&self) -> &str {
        &self.tenant
    }

    /// The device's IPv4 address.
    pub fn local_ip(&self) -> Ipv4Addr {
        self.local_ip
    }

    /// When the agent next needs [`State::tick`].
    pub fn next_deadline(&self) -> Option<Instant> {
        self.agent.next_deadline()
    }

    pub fn counters(&self) -> CmCounters {
        let mut c = CmCounters::new(self.agent.stats(), self.counts);
        let count = |f: &dyn Fn(&CmId) -> bool| self.ids.values().filter(|i| f(i)).count() as u64;
        c.connections_live = count(&|i| i.state == IdState::Established && i.conn.is_some());
        c.ids = self.ids.len() as u64;
        c.listeners = count(&|i| i.state == IdState::Listen);
        c.owners = self.owners.len() as u64;
        c.agent_connections = self.agent.connection_count() as u64;
        c
    }

    // ----- Owners --------------------------------------------------------

    /// A new owner with an empty event queue.
    pub fn create_owner(&mut self) -> Result<OwnerId, CmError> {
        if self.owners.len() >= self.config.max_owners {
            return Err(CmError::TooMany("owners"));
        }
        let queue = EventQueue::new().map_err(CmError::Io)?;
        self.next_owner = self.next_owner.wrapping_add(1).max(1);
        let owner = OwnerId(self.next_owner);
        self.owners.insert(owner, queue);
        Ok(owner)
    }

    /// A duplicate of the owner's eventfd (signalled when an event is
    /// queued).
    pub fn owner_eventfd(&self, owner: OwnerId) -> Result<vmm_sys_util::eventfd::EventFd, CmError> {
        let q = self
            .owners
            .get(&owner)
            .ok_or(CmError::UnknownOwner(owner))?;
        q.notify().try_clone().map_err(CmError::Io)
    }

    /// The owner is gone (its context closed): its IDs are destroyed —
    /// established connections get a DREQ, pending ones a REJ — and its
    /// queue dropped.
    pub fn close_owner(&mut self, now: Instant, owner: OwnerId, qp1: &dyn Qp1) {
        let mine: Vec<IdNum> = (self.ids.iter())
            .filter(|(_, i)| i.owner == owner)
            .map(|(&id, _)| id)
            .collect();
        for id in mine {
            self.destroy_quietly(now, id);
        }
        self.owners.remove(&owner);
        self.flush(now, qp1);
    }

    /// The owner's next event.
    pub fn get_event(&mut self, owner: OwnerId) -> Result<Option<CmEvent>, CmError> {
        let q = (self.owners.get_mut(&owner)).ok_or(CmError::UnknownOwner(owner))?;
        Ok(q.pop())
    }

    // ----- IDs -----------------------------------------------------------

    /// `rdma_create_id`: a CM ID of port space `ps` (its QP type: TCP RC,
    /// UDP UD, IB the caller's RC or UD).
    pub fn create_id(
        &mut self,
        owner: OwnerId,
        ps: PortSpace,
        qp_type: Option<QpType>,
    ) -> Result<IdNum, CmError> {
        if !self.owners.contains_key(&owner) {
            return Err(CmError::UnknownOwner(owner));
        }
        let qp_type = qp_type_of(ps, qp_type).ok_or(CmError::Unsupported(ps))?;
        let id = self.new_id()?;
        let seq = rand::random::<u32>() & 0x00ff_ffff;
        self.ids.insert(id, CmId::new(owner, ps, qp_type, seq));
        Ok(id)
    }

    fn new_id(&mut self) -> Result<IdNum, CmError> {
        if self.ids.len() >= self.config.max_ids {
            return Err(CmError::TooMany("CM IDs"));
        }
        loop {
            self.next_id = self.next_id.wrapping_add(1);
            let id = IdNum(self.next_id);
            if id.0 != 0 && !self.ids.contains_key(&id) {
                return Ok(id);
            }
        }
    }

    fn id_of(&self, owner: OwnerId, id: IdNum) -> Result<&CmId, CmError> {
        (self.ids.get(&id))
            .filter(|i| i.owner == owner)
            .ok_or(CmError::UnknownId(id))
    }

    fn id_mut(&mut self, owner: OwnerId, id: IdNum) -> Result<&mut CmId, CmError> {
        (self.ids.get_mut(&id))
            .filter(|i| i.owner == owner)
            .ok_or(CmError::UnknownId(id))
    }

    fn in_state(
        &self,
        owner: OwnerId,
        id: IdNum,
        op: &'static str,
        states: &[IdState],
    ) -> Result<&CmId, CmError> {
        let i = self.id_of(owner, id)?;
        if !states.contains(&i.state) {
            return Err(CmError::WrongState {
                id,
                state: i.state,
                op,
            });
        }
        Ok(i)
    }

    /// What the ID's `rdma_cm_id` fields say.
    pub fn query(&self, owner: OwnerId, id: IdNum) -> Result<IdInfo, CmError> {
        Ok(self.id_of(owner, id)?.info(id))
    }

    /// `rdma_bind_addr`: the device's address or any (0.0.0.0), and a
    /// port (0: a free one). Returns the bound address.
    pub fn bind_addr(
        &mut self,
        owner: OwnerId,
        id: IdNum,
        addr: SocketAddrV4,
    ) -> Result<SocketAddrV4, CmError> {
        let i = self.in_state(owner, id, "bind", &[IdState::Idle])?;
        let ip = *addr.ip();
        if !ip.is_unspecified() && ip != self.local_ip {
            return Err(CmError::AddressNotAvailable(ip));
        }
        let ps = i.ps;
        let port = self
            .ports
            .bind(ps, addr.port(), id)
            .map_err(CmError::Port)?;
        let i = self.id_mut(owner, id)?;
        i.bound_port = Some(port);
        i.src = SocketAddrV4::new(ip, port);
        i.state = IdState::AddrBound;
        Ok(i.src)
    }

    /// `rdma_listen`: REQs (or SIDR_REQs) for the bound port are
    /// delivered as CONNECT_REQUEST with a new ID, at most
    /// [`CmConfig::max_pending`] waiting for an answer: `backlog` is kept
    /// (and logged) but, as by Linux's CM on RoCE, not enforced. An
    /// unbound ID is bound to a free port first.
    pub fn listen(&mut self, owner: OwnerId, id: IdNum, backlog: u32) -> Result<(), CmError> {
        let i = self.in_state(owner, id, "listen", &[IdState::Idle, IdState::AddrBound])?;
        if i.state == IdState::Idle {
            self.bind_addr(owner, id, SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, 0))?;
        }
        let i = self.id_of(owner, id)?;
        let sid = service_id(i.ps, i.src.port());
        self.agent.listen(sid).map_err(CmError::Agent)?;
        let i = self.id_mut(owner, id)?;
        i.service_id = sid;
        i.backlog = backlog;
        i.state = IdState::Listen;
        // Rare and useful to operators (which services a tenant offers);
        // the tests wait for it before starting a client.
        let (src, backlog) = (i.src, i.backlog);
        tracing::info!(tenant = %self.tenant, id = id.0, addr = %src, backlog, "Listening");
        Ok(())
    }

    /// `rdma_resolve_addr`: `dst`'s GID is its IPv4-mapped address;
    /// hostd says whether the device may reach it. ADDR_RESOLVED or
    /// ADDR_ERROR follows (the same status for an unknown destination and
    /// one the tenant may not reach). An unbound ID is bound to `src`
    /// (default: the device's address) and a free port.
    pub fn resolve_addr(
        &mut self,
        owner: OwnerId,
        id: IdNum,
        src: Option<SocketAddrV4>,
        dst: SocketAddrV4,
        qp1: &dyn Qp1,
    ) -> Result<(), CmError> {
        let i = self.in_state(
            owner,
            id,
            "resolve_addr",
            &[IdState::Idle, IdState::AddrBound],
        )?;
        if i.state == IdState::Idle {
            let src = src.unwrap_or(SocketAddrV4::new(self.local_ip, 0));
            self.bind_addr(owner, id, src)?;
        }
        let gid = vrdma_spec::gid::ipv4_mapped(dst.ip().octets());
        let reachable = self.reachable(gid, qp1)?;
        let local_ip = self.local_ip;
        let i = self.id_mut(owner, id)?;
        i.dst = dst;
        if i.src.ip().is_unspecified() {
            i.src = SocketAddrV4::new(local_ip, i.src.port());
        }
        let event = if reachable {
            i.state = IdState::AddrResolved;
            CmEvent::bare(id, CmEventKind::AddrResolved, 0)
        } else {
            self.counts.addr_errors += 1;
            tracing::debug!(tenant = %self.tenant, %id, %dst, "Address resolution failed");
            CmEvent::bare(id, CmEventKind::AddrError, ADDR_ERROR_STATUS)
        };
        self.post(owner, event);
        Ok(())
    }

    /// Routes resolved from now on get `path_mtu` (an `ibv_mtu` value):
    /// the port's active MTU changed with a restarted hostd.
    pub fn set_path_mtu(&mut self, path_mtu: u8) {
        self.config.path_mtu = path_mtu;
    }

    /// `rdma_resolve_route`: the path from the two GIDs (RoCE: no SA);
    /// ROUTE_RESOLVED follows.
    pub fn resolve_route(&mut self, owner: OwnerId, id: IdNum) -> Result<(), CmError> {
        self.in_state(owner, id, "resolve_route", &[IdState::AddrResolved])?;
        let (mtu, plt, local_gid) = (
            self.config.path_mtu,
            self.config.packet_life_time,
            self.local_gid,
        );
        let i = self.id_mut(owner, id)?;
        let dgid = vrdma_spec::gid::ipv4_mapped(i.dst.ip().octets());
        // RoCEv2's flow label from the ports (Linux's
        // cma_get_roce_udp_flow_label).
        let flow_label = (u32::from(i.src.port()) * 31 + u32::from(i.dst.port())) & 0x000f_ffff;
        i.route = Some(PathRecord {
            sgid: local_gid.0,
            dgid,
            pkey: DEFAULT_PKEY,
            mtu,
            traffic_class: 0,
            hop_limit: 64,
            flow_label,
            sl: 0,
            packet_life_time: plt,
        });
        i.state = IdState::RouteResolved;
        self.post(owner, CmEvent::bare(id, CmEventKind::RouteResolved, 0));
        Ok(())
    }

    /// `rdma_connect`: a REQ (RC) or SIDR_REQ (UD) to the resolved
    /// destination, its private data the CMA header and `param`'s.
    pub fn connect(
        &mut self,
        now: Instant,
        owner: OwnerId,
        id: IdNum,
        param: &ConnParam,
        qp1: &dyn Qp1,
    ) -> Result<(), CmError> {
        let i = self.in_state(owner, id, "connect", &[IdState::RouteResolved])?;
        let mut route = i.route.ok_or(CmError::WrongState {
            id,
            state: i.state,
            op: "connect",
        })?;
        // RDMA_OPTION_ID_TOS: the path's traffic class, in the REQ (both
        // sides' QPs take it from there) and in the ID's route.
        if let Some(tc) = param.traffic_class {
            route.traffic_class = tc;
        }
        let header = CmaHeader {
            src_port: i.src.port(),
            addrs: CmaAddrs::V4 {
                src: *i.src.ip(),
                dst: *i.dst.ip(),
            },
        };
        let path = MadPath {
            local: Gid(route.sgid),
            remote: Gid(route.dgid),
        };
        let sid = service_id(i.ps, i.dst.port());
        let conn = if i.qp_type == QpType::Ud {
            let max = SIDR_REQ_PRIVATE_DATA_SIZE - CMA_HEADER_LEN;
            let private_data = header
                .private_data(&param.private_data)
                .map_err(|_| too_long(param.private_data.len(), max))?;
            let mut p = SidrParams::new(sid, path);
            p.private_data = private_data;
            p.timeout = self.config.sidr_timeout;
            p.max_retries = self.config.sidr_retries;
            self.agent.sidr_request(now, &p).map_err(CmError::Agent)?
        } else {
            let max = REQ_PRIVATE_DATA_SIZE - CMA_HEADER_LEN;
            let private_data = header
                .private_data(&param.private_data)
                .map_err(|_| too_long(param.private_data.len(), max))?;
            let psn = param.starting_psn.unwrap_or(i.seq_num) & 0x00ff_ffff;
            let plt = self.config.packet_life_time;
            let mut p = ConnectParams::new(sid, path, param.qp_num & 0x00ff_ffff, psn);
            p.packet_life_time = plt;
            let r = &mut p.req;
            r.private_data = private_data;
            r.responder_resources = param.responder_resources;
            r.initiator_depth = param.initiator_depth;
            r.e2e_flow_control = param.flow_control;
            r.retry_count = param.retry_count.min(7);
            r.rnr_retry_count = param.rnr_retry_count.min(7);
            r.srq = param.srq;
            r.path_mtu = route.mtu;
            r.remote_cm_response_timeout = self.config.cm_response_timeout;
            r.local_cm_response_timeout = self.config.cm_response_timeout;
            r.max_cm_retries = self.config.max_cm_retries;
            r.transport = TransportType::Rc;
            r.primary.flow_label = route.flow_label;
            r.primary.traffic_class = route.traffic_class;
            r.primary.hop_limit = route.hop_limit;
            r.primary.local_ack_timeout = cm_ack_timeout(15, plt);
            self.agent.connect(now, &p).map_err(CmError::Agent)?
        };
        self.by_conn.insert(conn, id);
        let i = self.id_mut(owner, id)?;
        i.conn = Some(conn);
        i.route = Some(route);
        i.state = IdState::Connect;
        self.flush(now, qp1);
        Ok(())
    }

    /// `rdma_accept` of a CONNECT_REQUEST's ID: a REP (RC; ESTABLISHED
    /// follows with the RTU) or a SIDR_REP with the caller's QP and
    /// Q_Key (UD; the ID is then established, with no event).
    pub fn accept(
        &mut self,
        now: Instant,
        owner: OwnerId,
        id: IdNum,
        param: &ConnParam,
        qp1: &dyn Qp1,
    ) -> Result<(), CmError> {
        let i = self.in_state(owner, id, "accept", &[IdState::Connect])?;
        let wrong = CmError::WrongState {
            id,
            state: i.state,
            op: "accept",
        };
        let (Some(conn), Some(_)) = (i.conn, i.listener) else {
            return Err(wrong);
        };
        if i.qp_type == QpType::Ud {
            if param.private_data.len() > SIDR_REP_PRIVATE_DATA_SIZE {
                return Err(too_long(
                    param.private_data.len(),
                    SIDR_REP_PRIVATE_DATA_SIZE,
                ));
            }
            let qkey = if param.qkey == 0 {
                RDMA_UDP_QKEY
            } else {
                param.qkey
            };
            let qpn = param.qp_num & 0x00ff_ffff;
            self.agent
                .sidr_accept(conn, qpn, qkey, &param.private_data)
                .map_err(CmError::Agent)?;
            self.by_conn.remove(&conn);
            let i = self.id_mut(owner, id)?;
            i.conn = None;
            i.qkey = qkey;
            i.state = IdState::Established;
        } else {
            if param.private_data.len() > REP_PRIVATE_DATA_SIZE {
                return Err(too_long(param.private_data.len(), REP_PRIVATE_DATA_SIZE));
            }
            let psn = param.starting_psn.unwrap_or(i.seq_num) & 0x00ff_ffff;
            let mut rep = Rep::accepting(param.qp_num & 0x00ff_ffff, psn);
            rep.responder_resources = param.responder_resources;
            rep.initiator_depth = param.initiator_depth;
            rep.e2e_flow_control = param.flow_control;
            rep.rnr_retry_count = param.rnr_retry_count.min(7);
            rep.srq = param.srq;
            rep.private_data = vrdma_cm::PrivateData::new(&param.private_data)
                .map_err(|_| too_long(param.private_data.len(), REP_PRIVATE_DATA_SIZE))?;
            let qp = self.agent.accept(now, conn, &rep).map_err(CmError::Agent)?;
            let i = self.id_mut(owner, id)?;
            i.qp = Some(qp);
        }
        self.release_backlog(id);
        self.flush(now, qp1);
        Ok(())
    }

    /// `rdma_reject`: a connect request refused with REJ 28 and the
    /// private data (UD: SIDR_REP status 2), or a connect response
    /// refused the same way.
    pub fn reject(
        &mut self,
        now: Instant,
        owner: OwnerId,
        id: IdNum,
        private_data: &[u8],
        qp1: &dyn Qp1,
    ) -> Result<(), CmError> {
        let i = self.in_state(owner, id, "reject", &[IdState::Connect])?;
        let Some(conn) = i.conn else {
            return Err(CmError::WrongState {
                id,
                state: i.state,
                op: "reject",
            });
        };
        if i.qp_type == QpType::Ud {
            if private_data.len() > SIDR_REP_PRIVATE_DATA_SIZE {
                return Err(too_long(private_data.len(), SIDR_REP_PRIVATE_DATA_SIZE));
            }
            self.agent
                .sidr_reject(conn, SidrStatus::REJECT, private_data)
                .map_err(CmError::Agent)?;
        } else {
            if private_data.len() > REJ_PRIVATE_DATA_SIZE {
                return Err(too_long(private_data.len(), REJ_PRIVATE_DATA_SIZE));
            }
            self.agent
                .reject(now, conn, RejectReason::CONSUMER_DEFINED, &[], private_data)
                .map_err(CmError::Agent)?;
        }
        self.unlink(conn);
        if let Ok(i) = self.id_mut(owner, id) {
            i.state = IdState::Disconnect;
        }
        self.release_backlog(id);
        self.flush(now, qp1);
        Ok(())
    }

    /// After CONNECT_RESPONSE (and the QP moved to RTR and RTS with
    /// [`State::init_qp_attr`]): the RTU; ESTABLISHED is queued for the
    /// ID, as rdma_cm reports a connect response of an ID with a QP.
    pub fn establish(
        &mut self,
        now: Instant,
        owner: OwnerId,
        id: IdNum,
        qp1: &dyn Qp1,
    ) -> Result<(), CmError> {
        let i = self.in_state(owner, id, "establish", &[IdState::Connect])?;
        let (Some(conn), None, Some(_)) = (i.conn, i.listener, i.qp) else {
            return Err(CmError::WrongState {
                id,
                state: i.state,
                op: "establish",
            });
        };
        self.agent.establish(conn, &[]).map_err(CmError::Agent)?;
        if let Ok(i) = self.id_mut(owner, id) {
            i.state = IdState::Established;
        }
        self.post(owner, CmEvent::bare(id, CmEventKind::Established, 0));
        self.flush(now, qp1);
        Ok(())
    }

    /// `rdma_disconnect`: a DREQ from an established connection
    /// (DISCONNECTED follows with the DREP, or when it times out), or the
    /// DREP answering the peer's DREQ after its DISCONNECTED.
    pub fn disconnect(
        &mut self,
        now: Instant,
        owner: OwnerId,
        id: IdNum,
        qp1: &dyn Qp1,
    ) -> Result<(), CmError> {
        let i = self.in_state(
            owner,
            id,
            "disconnect",
            &[IdState::Established, IdState::Disconnect, IdState::Connect],
        )?;
        let state = i.state;
        let wrong = CmError::WrongState {
            id,
            state,
            op: "disconnect",
        };
        let Some(conn) = i.conn else {
            // A UD "connection" has nothing to tear down.
            return match (state, i.qp_type) {
                (IdState::Established, QpType::Ud) => {
                    if let Ok(i) = self.id_mut(owner, id) {
                        i.state = IdState::Disconnect;
                    }
                    Ok(())
                }
                _ => Err(wrong),
            };
        };
        self.agent
            .disconnect(now, conn, &[])
            .map_err(CmError::Agent)?;
        if let Ok(i) = self.id_mut(owner, id) {
            i.state = IdState::Disconnect;
        }
        self.flush(now, qp1);
        Ok(())
    }

    /// `rdma_destroy_id`: its connection ends as Linux ends it (DREQ when
    /// established, REJ when pending, DREP for a DREQ received), its port
    /// is released, a listener stops, and its waiting events go.
    pub fn destroy_id(
        &mut self,
        now: Instant,
        owner: OwnerId,
        id: IdNum,
        qp1: &dyn Qp1,
    ) -> Result<(), CmError> {
        self.id_of(owner, id)?;
        self.destroy_quietly(now, id);
        if let Some(q) = self.owners.get_mut(&owner) {
            q.forget(id);
        }
        self.flush(now, qp1);
        Ok(())
    }

    fn destroy_quietly(&mut self, now: Instant, id: IdNum) {
        // A request not answered yet leaves its listener's backlog.
        self.release_backlog(id);
        let Some(i) = self.ids.remove(&id) else {
            return;
        };
        if let Some(conn) = i.conn {
            self.by_conn.remove(&conn);
            // Gone already, or in a state that needs nothing: fine.
            let _ = self.agent.destroy(now, conn);
        }
        if i.state == IdState::Listen {
            self.agent.unlisten(i.service_id);
        }
        if let Some(port) = i.bound_port {
            self.ports.release(i.ps, port, id);
        }
    }

    /// `rdma_init_qp_attr`: the attributes that move the ID's QP to
    /// `state` (INIT, RTR or RTS).
    pub fn init_qp_attr(
        &self,
        owner: OwnerId,
        id: IdNum,
        state: QpState,
    ) -> Result<QpAttr, CmError> {
        let i = self.id_of(owner, id)?;
        let wrong = CmError::WrongState {
            id,
            state: i.state,
            op: "init_qp_attr",
        };
        // Before accept, the passive side's attributes follow from the REQ
        // and the PSN it will offer (its seq_num, as Linux forces).
        let qp = i.qp.or_else(|| {
            i.req.as_deref().map(|req| {
                let mut rep = Rep::accepting(0, i.seq_num);
                rep.responder_resources = req.initiator_depth;
                rep.initiator_depth = req.responder_resources;
                vrdma_cm::passive_qp_attrs(req, &rep)
            })
        });
        match (state, i.qp_type) {
            (QpState::Init, t) => {
                let rd = qp.map_or(0, |q| q.max_dest_rd_atomic);
                Ok(qp_attr::init_attr(t, rd, i.qkey))
            }
            (QpState::Rtr | QpState::Rts, QpType::Ud) => Ok(qp_attr::ud_attr(state)),
            (QpState::Rtr, _) => qp.map(|q| qp_attr::rtr_attr(&q)).ok_or(wrong),
            (QpState::Rts, _) => qp.map(|q| qp_attr::rts_attr(&q)).ok_or(wrong),
            _ => Err(wrong),
        }
    }

    // ----- QP1 and time --------------------------------------------------

    /// A MAD that arrived on QP1.
    pub fn handle_mad(&mut self, now: Instant, mad: &MadIn) {
        let path = MadPath {
            local: self.local_gid,
            remote: Gid(mad.peer),
        };
        if let Err(reason) = self.agent.handle_mad(now, path, &mad.mad) {
            tracing::trace!(tenant = %self.tenant, peer = %Gid(mad.peer), reason = reason.name(),
                "CM MAD dropped");
        }
    }

    pub fn tick(&mut self, now: Instant) {
        self.agent.tick(now);
    }

    pub fn note_take_failed(&mut self) {
        self.counts.take_failed += 1;
    }

    /// Sends what the agent queued and delivers its events.
    pub fn flush(&mut self, now: Instant, qp1: &dyn Qp1) {
        // Events may make the agent send (a refused request's REJ), and
        // sends never make events: events first, then sends.
        while let Some(event) = self.agent.poll_event() {
            self.on_agent_event(now, event);
        }
        while let Some(t) = self.agent.poll_transmit() {
            self.transmit(qp1, &t);
        }
    }

    fn transmit(&mut self, qp1: &dyn Qp1, t: &Transmit) {
        let out = MadOut {
            peer: t.path.remote.0,
            traffic_class: 0,
            mad: t.mad.to_vec(),
        };
        if let Err(e) = qp1.send_mad(out) {
            self.counts.send_failed += 1;
            tracing::debug!(tenant = %self.tenant, peer = %t.path.remote,
                "hostd refused a CM MAD: {}", vrdma_errors::error_chain(&e));
        }
    }

    /// Queues `event` for `owner`; false (counted, logged) if its queue
    /// is full or gone.
    fn post(&mut self, owner: OwnerId, event: CmEvent) -> bool {
        let pushed = self.owners.get_mut(&owner).is_some_and(|q| q.push(event));
        if !pushed {
            self.counts.events_dropped += 1;
            tracing::warn!(tenant = %self.tenant, owner = owner.0, id = %event.id,
                kind = ?event.kind, "CM event dropped: the owner's queue is full or gone");
        }
        pushed
    }

    /// The agent's view of an ID's connection (for tests and reports).
    pub fn conn_state(&self, owner: OwnerId, id: IdNum) -> Option<CmState> {
        let conn = self.id_of(owner, id).ok()?.conn?;
        self.agent.state(conn)
    }
}

fn too_long(len: usize, max: usize) -> CmError {
    CmError::PrivateDataTooLong { len, max }
}
