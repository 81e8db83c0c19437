//! CM IDs: what rdma_cm keeps per `struct rdma_cm_id` — its port space and
//! QP type, state (`enum rdma_cm_state`, without the transient query
//! states: resolution here answers at once), addresses, route, and the
//! connection of the agent it drives.

use std::net::{Ipv4Addr, SocketAddrV4};

use vrdma_cm::{ConnId, PortSpace, QpAttrs, Req};
use vrdma_spec::verbs::QpType;

use super::{IdNum, OwnerId};

/// A CM ID's state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum IdState {
    /// Created, nothing bound.
    Idle,
    /// `rdma_bind_addr` done.
    AddrBound,
    /// `rdma_resolve_addr` succeeded (ADDR_RESOLVED queued).
    AddrResolved,
    /// `rdma_resolve_route` succeeded (ROUTE_RESOLVED queued).
    RouteResolved,
    /// Listening.
    Listen,
    /// Active: REQ or SIDR_REQ sent, or REP received; passive: a
    /// connect request delivered, or accepted and waiting for the RTU.
    Connect,
    Established,
    /// Disconnected, rejected or unreachable: only destroy is left (and
    /// disconnect, to answer a peer's DREQ).
    Disconnect,
}

/// The path `rdma_resolve_route` builds from the two addresses (RoCE:
/// no SA; `struct ibv_sa_path_rec`'s fields that matter).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PathRecord {
    pub sgid: [u8; 16],
    pub dgid: [u8; 16],
    pub pkey: u16,
    /// An `ibv_mtu` value.
    pub mtu: u8,
    pub traffic_class: u8,
    pub hop_limit: u8,
    pub flow_label: u32,
    pub sl: u8,
    pub packet_life_time: u8,
}

/// What a CM ID holds.
#[derive(Debug)]
pub(crate) struct CmId {
    pub owner: OwnerId,
    pub ps: PortSpace,
    pub qp_type: QpType,
    pub state: IdState,
    /// The port this ID holds in the device's port table.
    pub bound_port: Option<u16>,
    /// `src_addr`: the device's address (or 0.0.0.0 when bound to any)
    /// and port.
    pub src: SocketAddrV4,
    /// `dst_addr`.
    pub dst: SocketAddrV4,
    pub route: Option<PathRecord>,
    /// The agent's connection (or SIDR request) this ID drives.
    pub conn: Option<ConnId>,
    /// Listening: the backlog `rdma_listen` was given (not enforced:
    /// `CmConfig::max_pending` is) and the service ID.
    pub backlog: u32,
    pub service_id: u64,
    /// Listening: connect requests delivered and not yet answered.
    pub waiting: u32,
    /// Passive: the listener this ID came from.
    pub listener: Option<IdNum>,
    /// Passive: counted in its listener's `waiting`.
    pub pending: bool,
    /// The receive PSN it offers when the caller gives none.
    pub seq_num: u32,
    /// Connected QP attributes, once known (the passive side at accept,
    /// the active side at the connect response).
    pub qp: Option<QpAttrs>,
    /// Passive: the REQ received (attributes before accept).
    pub req: Option<Box<Req>>,
    /// UD: this side's Q_Key; after SIDR, the peer's QP and Q_Key.
    pub qkey: u32,
    pub remote_qpn: u32,
    pub remote_qkey: u32,
}

impl CmId {
    pub fn new(owner: OwnerId, ps: PortSpace, qp_type: QpType, seq_num: u32) -> CmId {
        let any = SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, 0);
        CmId {
            owner,
            ps,
            qp_type,
            state: IdState::Idle,
            bound_port: None,
            src: any,
            dst: any,
            route: None,
            conn: None,
            backlog: 0,
            service_id: 0,
            waiting: 0,
            listener: None,
            pending: false,
            seq_num,
            qp: None,
            req: None,
            qkey: super::qp_attr::RDMA_UDP_QKEY,
            remote_qpn: 0,
            remote_qkey: 0,
        }
    }

    pub fn info(&self, id: IdNum) -> IdInfo {
        IdInfo {
            id,
            ps: self.ps,
            qp_type: self.qp_type,
            state: self.state,
            src: self.src,
            dst: self.dst,
            route: self.route,
            listener: self.listener,
            remote_qpn: self.remote_qpn,
            remote_qkey: self.remote_qkey,
        }
    }
}

/// What `rdma_cm_id`'s fields say about an ID (its `route`, `ps`,
/// `qp_type`), for the library to fill in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IdInfo {
    pub id: IdNum,
    pub ps: PortSpace,
    pub qp_type: QpType,
    pub state: IdState,
    pub src: SocketAddrV4,
    pub dst: SocketAddrV4,
    pub route: Option<PathRecord>,
    pub listener: Option<IdNum>,
    pub remote_qpn: u32,
    pub remote_qkey: u32,
}

/// The QP type of a port space's IDs: TCP is RC, UDP is UD; IB takes the
/// caller's (RC or UD); others are refused.
pub fn qp_type_of(ps: PortSpace, requested: Option<QpType>) -> Option<QpType> {
    match (ps, requested) {
        (PortSpace::Tcp, None | Some(QpType::Rc)) => Some(QpType::Rc),
        (PortSpace::Udp, None | Some(QpType::Ud)) => Some(QpType::Ud),
        (PortSpace::Ib, Some(t @ (QpType::Rc | QpType::Ud))) => Some(t),
        (PortSpace::Ib, None) => Some(QpType::Rc),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn port_spaces_fix_or_take_the_qp_type() {
        assert_eq!(qp_type_of(PortSpace::Tcp, None), Some(QpType::Rc));
        assert_eq!(qp_type_of(PortSpace::Tcp, Some(QpType::Ud)), None);
        assert_eq!(qp_type_of(PortSpace::Udp, None), Some(QpType::Ud));
        assert_eq!(qp_type_of(PortSpace::Udp, Some(QpType::Rc)), None);
        assert_eq!(
            qp_type_of(PortSpace::Ib, Some(QpType::Ud)),
            Some(QpType::Ud)
        );
        assert_eq!(qp_type_of(PortSpace::Ib, Some(QpType::Uc)), None);
        assert_eq!(qp_type_of(PortSpace::Ipoib, None), None);
    }
}
