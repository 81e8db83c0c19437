//! The QP attributes a connection's REQ and REP imply for each side, as
//! Linux's `cm_init_qp_rtr_attr`/`cm_init_qp_rts_attr` hand them out (notes
//! §2.8). The agent never touches a QP: the caller moves its QP to RTR and
//! RTS with these values (the passive side before its REP goes out, the
//! active side before its RTU).

use crate::gid::Gid;
use crate::messages::{Rep, Req};
use crate::timing::cm_ack_timeout;

/// What one side programs into its RC/UC QP for a connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct QpAttrs {
    /// RTR: the peer's QPN.
    pub dest_qpn: u32,
    /// RTR: this side's receive PSN (the Starting PSN this side advertised).
    pub rq_psn: u32,
    /// RTS: this side's send PSN (the Starting PSN the peer advertised).
    pub sq_psn: u32,
    /// RTR: the REQ's MTU, on both sides (Linux's passive side does not
    /// clamp it).
    pub path_mtu: u8,
    /// RTR: RDMA READ/atomic requests this side accepts at once.
    pub max_dest_rd_atomic: u8,
    /// RTS: RDMA READ/atomic requests this side may have outstanding.
    pub max_rd_atomic: u8,
    /// RTS.
    pub retry_count: u8,
    /// RTS.
    pub rnr_retry: u8,
    /// RTS: the ACK timeout (also the length of this side's timewait).
    pub timeout: u8,
    /// RTR address vector: this side's GID and the peer's.
    pub local_gid: Gid,
    pub remote_gid: Gid,
    pub flow_label: u32,
    pub traffic_class: u8,
    pub hop_limit: u8,
    pub sl: u8,
}

/// The passive side's attributes for the REQ it received and the REP it
/// sends. Resources are swapped into this side's view; retries come from
/// the REQ; the ACK timeout is the REQ's Primary Local ACK Timeout.
pub fn passive_qp_attrs(req: &Req, rep: &Rep) -> QpAttrs {
    QpAttrs {
        dest_qpn: req.local_qpn,
        rq_psn: rep.starting_psn,
        sq_psn: req.starting_psn,
        path_mtu: req.path_mtu,
        max_dest_rd_atomic: rep.responder_resources,
        max_rd_atomic: rep.initiator_depth,
        retry_count: req.retry_count,
        rnr_retry: req.rnr_retry_count,
        timeout: req.primary.local_ack_timeout,
        local_gid: req.primary.remote_gid,
        remote_gid: req.primary.local_gid,
        flow_label: req.primary.flow_label,
        traffic_class: req.primary.traffic_class,
        hop_limit: req.primary.hop_limit,
        sl: req.primary.sl,
    }
}

/// The active side's attributes for the REQ it sent and the REP it
/// received: the REP's resources swapped into this side's view, its own
/// retry count but the REP's RNR retry, and an ACK timeout from the REP's
/// Target ACK Delay and the path's packet lifetime.
pub fn active_qp_attrs(req: &Req, rep: &Rep, packet_life_time: u8) -> QpAttrs {
    QpAttrs {
        dest_qpn: rep.local_qpn,
        rq_psn: req.starting_psn,
        sq_psn: rep.starting_psn,
        path_mtu: req.path_mtu,
        max_dest_rd_atomic: rep.initiator_depth,
        max_rd_atomic: rep.responder_resources,
        retry_count: req.retry_count,
        rnr_retry: rep.rnr_retry_count,
        timeout: cm_ack_timeout(rep.target_ack_delay, packet_life_time),
        local_gid: req.primary.local_gid,
        remote_gid: req.primary.remote_gid,
        flow_label: req.primary.flow_label,
        traffic_class: req.primary.traffic_class,
        hop_limit: req.primary.hop_limit,
        sl: req.primary.sl,
    }
}
