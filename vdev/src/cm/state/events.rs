//! The agent's events as rdma_cm events: which CM ID each is about, the
//! event record it becomes, and what it changes in the ID; and connect
//! requests checked as Linux's cma checks them (service ID, CMA header,
//! destination address, QP type, backlog) before an owner sees them.

use std::net::SocketAddrV4;
use std::time::Instant;

use vrdma_cm::{
    split_service_id, CmaAddrs, CmaHeader, ConnId, Event, Gid, MadPath, RejectReason, SidrStatus,
    DEFAULT_PKEY,
};
use vrdma_spec::verbs::QpType;

use super::super::event::{AhAttr, CmEvent, CmEventKind};
use super::super::ids::{CmId, IdState, PathRecord};
use super::super::{IdNum, OwnerId};
use super::{State, UNREACHABLE_STATUS};

impl State {
    pub(super) fn on_agent_event(&mut self, now: Instant, event: Event) {
        match event {
            Event::ConnectRequest { conn, path, req } => {
                self.on_connect_request(now, conn, path, req)
            }
            Event::SidrRequest { conn, path, req } => self.on_sidr_request(conn, path, req),
            Event::ConnectResponse { conn, rep, qp } => {
                let Some((id, owner)) = self.linked(conn) else {
                    return;
                };
                if let Some(i) = self.ids.get_mut(&id) {
                    i.qp = Some(qp);
                    i.remote_qpn = rep.local_qpn;
                }
                let mut e = CmEvent::bare(id, CmEventKind::ConnectResponse, 0)
                    .with_private_data(rep.private_data.as_bytes());
                // The receiver's view, as ib_cm swaps them.
                e.responder_resources = rep.initiator_depth;
                e.initiator_depth = rep.responder_resources;
                e.flow_control = u8::from(rep.e2e_flow_control);
                e.rnr_retry_count = rep.rnr_retry_count;
                e.srq = u8::from(rep.srq);
                e.qp_num = rep.local_qpn;
                self.post(owner, e);
            }
            Event::Established { conn } => {
                let Some((id, owner)) = self.linked(conn) else {
                    return;
                };
                if let Some(i) = self.ids.get_mut(&id) {
                    i.state = IdState::Established;
                }
                self.post(owner, CmEvent::bare(id, CmEventKind::Established, 0));
            }
            Event::Rejected { conn, rej } => {
                let Some((id, owner)) = self.linked(conn) else {
                    return;
                };
                self.ended(id);
                let e = CmEvent::bare(id, CmEventKind::Rejected, i32::from(rej.reason.0))
                    .with_private_data(rej.private_data.as_bytes());
                self.post(owner, e);
            }
            Event::Unreachable { conn } => {
                let Some((id, owner)) = self.linked(conn) else {
                    return;
                };
                self.ended(id);
                self.post(
                    owner,
                    CmEvent::bare(id, CmEventKind::Unreachable, UNREACHABLE_STATUS),
                );
            }
            Event::Disconnected { conn, timed_out } => {
                let Some((id, owner)) = self.linked(conn) else {
                    return;
                };
                if let Some(i) = self.ids.get_mut(&id) {
                    i.state = IdState::Disconnect;
                }
                let status = if timed_out { UNREACHABLE_STATUS } else { 0 };
                self.post(owner, CmEvent::bare(id, CmEventKind::Disconnected, status));
            }
            Event::TimewaitExit { conn } => {
                let Some((id, owner)) = self.linked(conn) else {
                    return;
                };
                self.by_conn.remove(&conn);
                if let Some(i) = self.ids.get_mut(&id) {
                    i.conn = None;
                }
                self.post(owner, CmEvent::bare(id, CmEventKind::TimewaitExit, 0));
            }
            Event::SidrResponse { conn, rep } => {
                let Some((id, owner)) = self.linked(conn) else {
                    return;
                };
                self.by_conn.remove(&conn);
                let Some(i) = self.ids.get_mut(&id) else {
                    return;
                };
                i.conn = None;
                let e = if rep.status == SidrStatus::SUCCESS {
                    i.state = IdState::Established;
                    i.remote_qpn = rep.qpn;
                    i.remote_qkey = rep.qkey;
                    let mut e = CmEvent::bare(id, CmEventKind::Established, 0)
                        .with_private_data(rep.private_data.as_bytes());
                    e.qp_num = rep.qpn;
                    e.qkey = rep.qkey;
                    e.ah_attr = ah_of(i.route.as_ref());
                    e
                } else {
                    i.state = IdState::Disconnect;
                    CmEvent::bare(id, CmEventKind::Unreachable, i32::from(rep.status.0))
                        .with_private_data(rep.private_data.as_bytes())
                };
                self.post(owner, e);
            }
        }
    }

    /// The ID driving `conn`, and its owner.
    fn linked(&self, conn: ConnId) -> Option<(IdNum, OwnerId)> {
        let id = *self.by_conn.get(&conn)?;
        let owner = self.ids.get(&id)?.owner;
        Some((id, owner))
    }

    /// The ID's connection was refused or abandoned: only destroy is left.
    fn ended(&mut self, id: IdNum) {
        if let Some(i) = self.ids.get_mut(&id) {
            i.state = IdState::Disconnect;
            if let Some(conn) = i.conn {
                if self.agent.state(conn).is_none() {
                    i.conn = None;
                    self.by_conn.remove(&conn);
                }
            }
        }
        self.release_backlog(id);
    }

    /// Forgets the link between `conn` and its ID once the agent has
    /// dropped the connection.
    pub(super) fn unlink(&mut self, conn: ConnId) {
        if self.agent.state(conn).is_some() {
            return;
        }
        if let Some(id) = self.by_conn.remove(&conn) {
            if let Some(i) = self.ids.get_mut(&id) {
                i.conn = None;
            }
        }
    }

    /// A passive ID answered (or gone): its listener's backlog has room.
    pub(super) fn release_backlog(&mut self, id: IdNum) {
        let Some(i) = self.ids.get_mut(&id) else {
            return;
        };
        // Only once per passive ID: the flag is the listener link's
        // pending mark.
        if !std::mem::take(&mut i.pending) {
            return;
        }
        if let Some(l) = i.listener.and_then(|l| self.ids.get_mut(&l)) {
            l.waiting = l.waiting.saturating_sub(1);
        }
    }

    fn on_connect_request(
        &mut self,
        now: Instant,
        conn: ConnId,
        path: MadPath,
        req: Box<vrdma_cm::Req>,
    ) {
        match self.accept_request(
            conn,
            path,
            req.service_id,
            req.private_data.as_bytes(),
            true,
        ) {
            Ok((listener, owner, id, user)) => {
                if let Some(i) = self.ids.get_mut(&id) {
                    i.remote_qpn = req.local_qpn;
                    i.req = Some(req.clone());
                }
                let mut e =
                    CmEvent::bare(id, CmEventKind::ConnectRequest, 0).with_private_data(user);
                e.listen_id = listener;
                e.responder_resources = req.initiator_depth;
                e.initiator_depth = req.responder_resources;
                e.flow_control = u8::from(req.e2e_flow_control);
                e.retry_count = req.retry_count;
                e.rnr_retry_count = req.rnr_retry_count;
                e.srq = u8::from(req.srq);
                e.qp_num = req.local_qpn;
                if !self.post(owner, e) {
                    // Nobody will answer it: refuse it now (REJ 28).
                    self.destroy_quietly(now, id);
                }
            }
            Err(why) => {
                // Linux's cma refuses such a REQ with REJ 28 and no data.
                self.counts.requests_refused += 1;
                tracing::debug!(tenant = %self.tenant, peer = %path.remote, why,
                    "Connect request refused");
                let _ = self
                    .agent
                    .reject(now, conn, RejectReason::CONSUMER_DEFINED, &[], &[]);
            }
        }
    }

    fn on_sidr_request(&mut self, conn: ConnId, path: MadPath, req: Box<vrdma_cm::SidrReq>) {
        match self.accept_request(
            conn,
            path,
            req.service_id,
            req.private_data.as_bytes(),
            false,
        ) {
            Ok((listener, owner, id, user)) => {
                let mut e =
                    CmEvent::bare(id, CmEventKind::ConnectRequest, 0).with_private_data(user);
                e.listen_id = listener;
                e.ah_attr = AhAttr {
                    dgid: path.remote.0,
                    hop_limit: 64,
                    port_num: 1,
                    ..AhAttr::default()
                };
                if !self.post(owner, e) {
                    // Nobody will answer it: refuse it now.
                    let _ = self.agent.sidr_reject(conn, SidrStatus::REJECT, &[]);
                    self.by_conn.remove(&conn);
                    self.ids.remove(&id);
                    if let Some(l) = self.ids.get_mut(&listener) {
                        l.waiting = l.waiting.saturating_sub(1);
                    }
                }
            }
            Err(why) => {
                self.counts.requests_refused += 1;
                tracing::debug!(tenant = %self.tenant, peer = %path.remote, why,
                    "SIDR request refused");
                let _ = self.agent.sidr_reject(conn, SidrStatus::REJECT, &[]);
            }
        }
    }

    /// Checks a connect request (REQ when `connected`, else SIDR_REQ) for
    /// a listener as Linux's cma does (CMA header, destination address,
    /// QP type) and against the listener's backlog, and makes its new
    /// ID: (listener, owner, new ID, the user's private data).
    fn accept_request<'a>(
        &mut self,
        conn: ConnId,
        path: MadPath,
        sid: u64,
        data: &'a [u8],
        connected: bool,
    ) -> Result<(IdNum, OwnerId, IdNum, &'a [u8]), &'static str> {
        let (ps, port) = split_service_id(sid).ok_or("not an rdma_cm service ID")?;
        let listener = self.ports.holder(ps, port).ok_or("no listener")?;
        let l = self.ids.get(&listener).ok_or("no listener")?;
        if l.state != IdState::Listen {
            return Err("the port's ID does not listen");
        }
        if (l.qp_type == QpType::Ud) == connected {
            return Err("the listener's QP type differs");
        }
        if l.waiting >= self.config.max_pending {
            return Err("the listener holds the most unanswered requests it may");
        }
        let (header, user) = CmaHeader::split(data).map_err(|_| "bad CMA header")?;
        let CmaAddrs::V4 { src, dst } = header.addrs else {
            return Err("not IPv4");
        };
        let bound = *l.src.ip();
        if dst != self.local_ip || !(bound.is_unspecified() || bound == dst) {
            return Err("destination address is not the listener's");
        }
        if Gid::from(src) != path.remote {
            return Err("source address is not the sender's GID");
        }
        let (owner, ps, qp_type, lsrc) = (l.owner, l.ps, l.qp_type, l.src);
        let id = self.new_id().map_err(|_| "too many CM IDs")?;
        let mut i = CmId::new(owner, ps, qp_type, rand::random::<u32>() & 0x00ff_ffff);
        i.state = IdState::Connect;
        i.src = SocketAddrV4::new(dst, lsrc.port());
        i.dst = SocketAddrV4::new(src, header.src_port);
        i.conn = Some(conn);
        i.listener = Some(listener);
        i.pending = true;
        i.route = Some(PathRecord {
            sgid: path.local.0,
            dgid: path.remote.0,
            pkey: DEFAULT_PKEY,
            mtu: self.config.path_mtu,
            traffic_class: 0,
            hop_limit: 64,
            flow_label: 0,
            sl: 0,
            packet_life_time: self.config.packet_life_time,
        });
        self.ids.insert(id, i);
        self.by_conn.insert(conn, id);
        if let Some(l) = self.ids.get_mut(&listener) {
            l.waiting += 1;
        }
        Ok((listener, owner, id, user))
    }
}

/// The address vector of a route.
fn ah_of(route: Option<&PathRecord>) -> AhAttr {
    route.map_or(AhAttr::default(), |r| AhAttr {
        dgid: r.dgid,
        flow_label: r.flow_label,
        sgid_index: 0,
        hop_limit: r.hop_limit,
        traffic_class: r.traffic_class,
        sl: r.sl,
        port_num: 1,
    })
}
