//! `rdma_init_qp_attr`: the attributes (and the `ibv_qp_attr_mask`) that
//! move a CM ID's QP to INIT, RTR or RTS, from what the connection's REQ
//! and REP said (vrdma-cm's [`QpAttrs`], as Linux's
//! `cm_init_qp_{init,rtr,rts}_attr` hand them out).

use vrdma_cm::QpAttrs;
use vrdma_spec::verbs::{QpState, QpType};

use super::event::AhAttr;

/// `enum ibv_qp_attr_mask` bits and `IBV_ACCESS_*` bits, as the device
/// contract defines them.
pub use vrdma_spec::qp_state::mask;
pub use vrdma_spec::verbs::access;

/// The Q_Key rdma_cm gives UD QPs of IP port spaces (`RDMA_UDP_QKEY`).
pub const RDMA_UDP_QKEY: u32 = 0x0123_4567;

/// What `ibv_modify_qp` is called with: the fields `mask` names are set.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpAttr {
    pub mask: u32,
    pub qp_state: QpState,
    pub qp_access_flags: u32,
    pub pkey_index: u16,
    pub port_num: u8,
    pub qkey: u32,
    /// An `ibv_mtu` value.
    pub path_mtu: u8,
    pub dest_qp_num: u32,
    pub rq_psn: u32,
    pub sq_psn: u32,
    pub ah_attr: AhAttr,
    pub max_rd_atomic: u8,
    pub max_dest_rd_atomic: u8,
    pub min_rnr_timer: u8,
    pub timeout: u8,
    pub retry_cnt: u8,
    pub rnr_retry: u8,
}

impl QpAttr {
    fn new(state: QpState) -> QpAttr {
        QpAttr {
            mask: mask::STATE,
            qp_state: state,
            qp_access_flags: 0,
            pkey_index: 0,
            port_num: 0,
            qkey: 0,
            path_mtu: 0,
            dest_qp_num: 0,
            rq_psn: 0,
            sq_psn: 0,
            ah_attr: AhAttr::default(),
            max_rd_atomic: 0,
            max_dest_rd_atomic: 0,
            min_rnr_timer: 0,
            timeout: 0,
            retry_cnt: 0,
            rnr_retry: 0,
        }
    }
}

/// The attributes for INIT: port 1, P_Key index 0 and, connected, the
/// remote access the connection allows (writes always; reads and atomics
/// if this side accepts any, as `cm_init_qp_init_attr`), or for UD the
/// Q_Key.
pub fn init_attr(qp_type: QpType, max_dest_rd_atomic: u8, qkey: u32) -> QpAttr {
    let mut a = QpAttr::new(QpState::Init);
    a.mask |= mask::PKEY_INDEX | mask::PORT;
    a.port_num = 1;
    match qp_type {
        QpType::Ud => {
            a.mask |= mask::QKEY;
            a.qkey = qkey;
        }
        QpType::Rc | QpType::Uc => {
            a.mask |= mask::ACCESS_FLAGS;
            a.qp_access_flags = access::REMOTE_WRITE;
            if max_dest_rd_atomic > 0 && qp_type == QpType::Rc {
                a.qp_access_flags |= access::REMOTE_READ | access::REMOTE_ATOMIC;
            }
        }
    }
    a
}

/// The attributes for RTR of a connected QP.
pub fn rtr_attr(qp: &QpAttrs) -> QpAttr {
    let mut a = QpAttr::new(QpState::Rtr);
    a.mask |= mask::AV
        | mask::PATH_MTU
        | mask::DEST_QPN
        | mask::RQ_PSN
        | mask::MAX_DEST_RD_ATOMIC
        | mask::MIN_RNR_TIMER;
    a.ah_attr = AhAttr {
        dgid: qp.remote_gid.0,
        flow_label: qp.flow_label,
        sgid_index: 0,
        hop_limit: qp.hop_limit,
        traffic_class: qp.traffic_class,
        sl: qp.sl,
        port_num: 1,
    };
    a.path_mtu = qp.path_mtu;
    a.dest_qp_num = qp.dest_qpn;
    a.rq_psn = qp.rq_psn;
    a.max_dest_rd_atomic = qp.max_dest_rd_atomic;
    a.min_rnr_timer = 0;
    a
}

/// The attributes for RTS of a connected QP.
pub fn rts_attr(qp: &QpAttrs) -> QpAttr {
    let mut a = QpAttr::new(QpState::Rts);
    a.mask |=
        mask::SQ_PSN | mask::TIMEOUT | mask::RETRY_CNT | mask::RNR_RETRY | mask::MAX_QP_RD_ATOMIC;
    a.sq_psn = qp.sq_psn;
    a.timeout = qp.timeout;
    a.retry_cnt = qp.retry_count;
    a.rnr_retry = qp.rnr_retry;
    a.max_rd_atomic = qp.max_rd_atomic;
    a
}

/// RTR and RTS of a UD QP: the state, and for RTS the send PSN (0).
pub fn ud_attr(state: QpState) -> QpAttr {
    let mut a = QpAttr::new(state);
    if state == QpState::Rts {
        a.mask |= mask::SQ_PSN;
    }
    a
}
