//! Queue pairs: creation with ring geometry and a doorbell index, the RC
//! state machine with attribute validation, query and destroy — each
//! mirrored to hostd, whose datapath runs the QP.

use vrdma_hostd_protocol::messages::{PortLinkLayer, QpConnection, QpModify, QpSetup, WorkRing};
use vrdma_spec::control::{
    AhAttr, CreateQpReq, CreateQpResp, ModifyQpReq, QpAttr, QpCap, QueryQpResp, NO_SRQ,
};
use vrdma_spec::limits::{CapLimits, Caps, QpGrant, MAX_QPS};
use vrdma_spec::qp_state::{check_mask, mask};
use vrdma_spec::ring::{WorkRingGeometry, QKEY_CONTROLLED};
use vrdma_spec::verbs::{access, lid, Mtu, QpState, QpType};

use vrdma_tenant_policy::Limits;

use super::share::Counted;
use super::{RdmaDevice, VerbError, VerbResult, PORT_MTU};

/// QP numbers are 24 bits; 0 and 1 are the IB special QPs (SMI, GSI).
pub(super) const QPN_MASK: u32 = 0x00ff_ffff;
/// Largest PSN (24 bits).
const MAX_PSN: u32 = 0x00ff_ffff;
/// Largest IB timer exponent / RNR timer code.
const MAX_TIMER: u8 = 31;
/// Largest retry count (3 bits).
const MAX_RETRY: u8 = 7;
/// Largest GRH flow label (20 bits).
const MAX_FLOW_LABEL: u32 = 0x000f_ffff;
/// `IBV_MIG_MIGRATED`: automatic path migration is not supported, so the
/// only path-migration state is "migrated".
const MIG_MIGRATED: u8 = 0;

/// A queue pair.
#[derive(Debug)]
pub struct QueuePair {
    pub qpn: u32,
    pub qp_type: QpType,
    pub pdn: u32,
    pub send_cqn: u32,
    pub recv_cqn: u32,
    pub sq_sig_all: bool,
    pub cap: QpCap,
    pub sq: (u64, WorkRingGeometry),
    pub rq: (u64, WorkRingGeometry),
    /// The QP's bit in the doorbell page.
    pub db_index: u32,
    /// The SRQ it takes its receives from (its own receive ring is unused).
    pub srqn: Option<u32>,
    pub state: QpState,
    /// Attributes as last set by modify_qp (returned by query_qp).
    pub attr: QpAttr,
}

impl RdmaDevice {
    pub(super) fn create_qp(&mut self, req: &CreateQpReq) -> VerbResult<CreateQpResp> {
        if self.doorbell.is_none() {
            return Err(VerbError::Invalid(
                "no doorbell page yet (SET_DOORBELL comes before the first CREATE_QP)".into(),
            ));
        }
        let pdn = req.pdn.get();
        self.pd_mut(pdn)?;
        let qp_type = QpType::try_from(req.qp_type)
            .map_err(|other| VerbError::Invalid(format!("QP type {other}")))?;
        let srqn = (req.srqn.get() != NO_SRQ).then(|| req.srqn.get());
        if let Some(srqn) = srqn {
            if !self.srqs.contains_key(&srqn) {
                return Err(VerbError::NoObject {
                    kind: "SRQ",
                    handle: srqn,
                });
            }
        }
        let (send_cqn, recv_cqn) = (req.send_cqn.get(), req.recv_cqn.get());
        for cqn in [send_cqn, recv_cqn] {
            if !self.cqs.contains_key(&cqn) {
                return Err(VerbError::NoObject {
                    kind: "CQ",
                    handle: cqn,
                });
            }
        }
        let taken = self.share.take(Counted::Qp, self.limits.max_qp)?;
        let grant = self.grant(&req.cap)?;
        let (sq, rq) = (grant.sq, grant.rq);
        let (sq_addr, rq_addr) = (req.sq_ring_addr.get(), req.rq_ring_addr.get());
        let overlap = sq_addr < rq_addr.saturating_add(rq.ring_bytes())
            && rq_addr < sq_addr.saturating_add(sq.ring_bytes());
        if overlap {
            return Err(VerbError::Invalid("send and receive rings overlap".into()));
        }
        // Both rings are checked before either is written, so a refused
        // CREATE_QP leaves guest memory as it was.
        self.check_ring(sq_addr, sq.ring_bytes())?;
        self.check_ring(rq_addr, rq.ring_bytes())?;
        // max_qp is at most MAX_QPS, so an index is free; a device built
        // with larger limits still never hands out a bit beyond the page.
        let db_index = self.db_indexes.alloc().ok_or(VerbError::Limit {
            limit: "max_qp",
            current: self.qps.len() as u64,
            max: MAX_QPS.into(),
        })?;
        // Unique among all the device's contexts' QPs.
        let qpn = self.share.new_qpn();
        let mut caps = grant.caps;
        if srqn.is_some() {
            // Its receives are the SRQ's: it has no receive queue of its
            // own to post on (as rdma-core reports such a QP).
            caps.max_recv_wr = 0;
            caps.max_recv_sge = 0;
        }
        let granted = wire_caps(caps);
        let qp = QueuePair {
            qpn,
            qp_type,
            pdn,
            send_cqn,
            recv_cqn,
            sq_sig_all: req.sq_sig_all != 0,
            cap: granted,
            sq: (sq_addr, sq),
            rq: (rq_addr, rq),
            db_index,
            srqn,
            state: QpState::Reset,
            attr: reset_attr(granted),
        };
        if let Err(e) = self.mirror_new_qp(&qp) {
            self.db_indexes.free(db_index);
            self.share.free_qpn(qpn);
            return Err(e);
        }
        taken.keep();
        if let Some(srq) = srqn.and_then(|n| self.srqs.get_mut(&n)) {
            srq.users += 1;
        }
        self.qps.insert(qpn, qp);
        self.pd_mut(pdn)?.qps += 1;
        for cqn in [send_cqn, recv_cqn] {
            if let Some(cq) = self.cqs.get_mut(&cqn) {
                cq.users += 1;
            }
        }
        Ok(CreateQpResp {
            qpn: qpn.into(),
            db_index: db_index.into(),
            cap: granted,
            reserved2: 0.into(),
        })
    }

    /// The rings and capacities of a QP asking for `cap`, within the
    /// tenant's limits: [`QpGrant`] is the one place that computes them,
    /// for the driver, vdev and hostd alike.
    fn grant(&self, cap: &QpCap) -> VerbResult<QpGrant> {
        QpGrant::compute(caps_of(cap), cap_limits(&self.limits))
            .map_err(|e| VerbError::Invalid(e.to_string()))
    }

    /// Resets the checked rings of a new QP and tells hostd about it.
    fn mirror_new_qp(&self, qp: &QueuePair) -> VerbResult<()> {
        self.reset_ring(qp.sq.0)?;
        self.reset_ring(qp.rq.0)?;
        let Some(fabric) = &self.fabric else {
            return Ok(());
        };
        fabric.create_qp(qp.setup()).map_err(VerbError::Fabric)
    }

    /// The port went down with the datapath that ran every QP: each QP
    /// past INIT (RTR, RTS, SQD, SQE) was connected through it, or sending,
    /// and is in ERR now (QUERY_QP says so), its rings carrying the ERROR
    /// flag, as the datapath would have set it. A QP in RESET or INIT had
    /// nothing running and stays as it is (its posted receives wait for
    /// the port to come back). Returns the QPs that went to ERR (already
    /// in ERR: not again), for their QP_FATAL events.
    pub(super) fn fail_qps(&mut self) -> Vec<u32> {
        let mut failed = Vec::new();
        for qp in self.qps.values_mut() {
            if matches!(qp.state, QpState::Reset | QpState::Init | QpState::Err) {
                continue;
            }
            qp.state = QpState::Err;
            qp.attr.qp_state = QpState::Err.into();
            qp.attr.cur_qp_state = QpState::Err.into();
            failed.push(qp.qpn);
        }
        failed.sort_unstable();
        for qpn in &failed {
            let Some(qp) = self.qps.get(qpn) else {
                continue;
            };
            for (addr, _) in [qp.sq, qp.rq] {
                if let Err(e) = self.flag_ring_error(addr) {
                    tracing::warn!(tenant = %self.tenant(), qpn, error = %e,
                        "Cannot flag the QP's ring in error");
                }
            }
        }
        failed
    }

    /// A QP can enter ERR on its own in hostd's datapath (a WQE failed, a
    /// ring was bad): QUERY_QP takes the datapath's ERR over before it
    /// answers, and so does a modify hostd refused. A modify does not ask
    /// first: hostd refuses every transition of a QP in ERR but to RESET
    /// and ERR, which any state may take — the answer a modify checked
    /// against ERR would have got (EINVAL), without a round trip to hostd
    /// on every modify (a connection's setup makes several). With the
    /// port down there is no datapath to ask: the QPs are in ERR already
    /// ([`Self::fail_qps`]).
    fn adopt_datapath_state(&mut self, qpn: u32) -> VerbResult<()> {
        if self.port_down() {
            return Ok(());
        }
        let (Some(fabric), Some(qp)) = (&self.fabric, self.qps.get(&qpn)) else {
            return Ok(());
        };
        let state = fabric.query_qp(qpn).map_err(VerbError::Fabric)?;
        if state == u8::from(QpState::Err) && qp.state != QpState::Err {
            self.adopt_err(qpn);
        }
        Ok(())
    }

    /// The datapath moved QP `qpn` to ERR: so does the QP's state here.
    fn adopt_err(&mut self, qpn: u32) {
        let Some(qp) = self.qps.get_mut(&qpn) else {
            return;
        };
        if qp.state != QpState::Err {
            tracing::info!(tenant = %self.identity.tenant, qpn, was = ?qp.state, "The QP entered ERR in the datapath");
            qp.state = QpState::Err;
            qp.attr.qp_state = QpState::Err.into();
            qp.attr.cur_qp_state = QpState::Err.into();
        }
    }

    /// CM_MOVE_QP: each state of the way (INIT with `FROM_INIT`, RTR,
    /// RTS, up to `qp_state`) with the connection manager's attributes for
    /// it, as rdma_cm's library would with CM_INIT_QP_ATTR and MODIFY_QP,
    /// each step checked as a MODIFY_QP. A step refused leaves the QP in
    /// the state it reached (the caller moves it to ERR, as rdma_cm's).
    /// Answers the RTR step's attributes (its AV), else the last step's.
    pub(super) fn cm_move_qp(
        &mut self,
        req: &vrdma_spec::cm::CmMoveQpReq,
    ) -> VerbResult<vrdma_spec::cm::CmQpAttrResp> {
        use vrdma_spec::cm::{move_flags, MOVE_KEEP};
        let known = move_flags::FROM_INIT | move_flags::SQ_PSN_ZERO;
        if req.flags & !known != 0 {
            return Err(VerbError::Invalid(format!(
                "CM_MOVE_QP flags {:#x}",
                req.flags
            )));
        }
        let from_init = req.flags & move_flags::FROM_INIT != 0;
        let steps: &[QpState] = match (QpState::try_from(req.qp_state), from_init) {
            (Ok(QpState::Init), true) => &[QpState::Init],
            (Ok(QpState::Rtr), true) => &[QpState::Init, QpState::Rtr],
            (Ok(QpState::Rts), true) => &[QpState::Init, QpState::Rtr, QpState::Rts],
            (Ok(QpState::Rtr), false) => &[QpState::Rtr],
            (Ok(QpState::Rts), false) => &[QpState::Rtr, QpState::Rts],
            _ => {
                return Err(VerbError::Invalid(format!(
                    "CM_MOVE_QP to QP state {} (flags {:#x})",
                    req.qp_state, req.flags
                )))
            }
        };
        let (qpn, channel, id) = (req.qpn.get(), req.channel.get(), req.id.get());
        let qp = self.qps.get(&qpn).ok_or(VerbError::NoObject {
            kind: "QP",
            handle: qpn,
        })?;
        // Each step checked as a MODIFY_QP from where the last left the QP;
        // hostd is told them all in one request.
        let (mut from, mut now) = (qp.state, qp.attr);
        let mut planned: Vec<(QpState, QpAttr)> = Vec::with_capacity(steps.len());
        let mut modifies = Vec::with_capacity(steps.len());
        let mut answer = None;
        for &step in steps {
            let mut step_attr = self.cm.qp_attr(channel, id, step)?;
            let a = &mut step_attr.attr;
            let set = step_attr.attr_mask.get();
            match step {
                QpState::Rtr if req.max_dest_rd_atomic != MOVE_KEEP => {
                    a.max_dest_rd_atomic = req.max_dest_rd_atomic;
                }
                QpState::Rts => {
                    if req.max_rd_atomic != MOVE_KEEP {
                        a.max_rd_atomic = req.max_rd_atomic;
                    }
                    if req.timeout != MOVE_KEEP && set & mask::TIMEOUT != 0 {
                        a.timeout = req.timeout;
                    }
                    if req.flags & move_flags::SQ_PSN_ZERO != 0 {
                        a.sq_psn = 0.into();
                    }
                }
                _ => {}
            }
            // rdma_cm moves a QP in INIT to INIT again for what it learnt
            // since (an active side's responder resources, hence remote
            // READ access); where nothing changed, hostd is not asked.
            let unchanged =
                step == QpState::Init && from == QpState::Init && same_init_attr(&now, a, set);
            if !unchanged {
                let modify = ModifyQpReq {
                    qpn: req.qpn,
                    attr_mask: step_attr.attr_mask,
                    attr: step_attr.attr,
                };
                let (next, merged, transition) = self.plan_modify(qp, from, &now, &modify)?;
                modifies.push(transition);
                planned.push((next, merged));
                (from, now) = (next, merged);
            }
            if answer.is_none() || step == QpState::Rtr {
                answer = Some(step_attr);
            }
        }
        if let Some(fabric) = &self.fabric {
            let told = match modifies.len() {
                0 => Ok(()),
                1 => fabric.modify_qp(modifies.remove(0)),
                _ => fabric.modify_qps(modifies),
            };
            if let Err(e) = told {
                // Where hostd stopped: its state, as the steps left it.
                let reached = (fabric.query_qp(qpn).ok()).and_then(|s| QpState::try_from(s).ok());
                if let Some(&(next, merged)) =
                    (planned.iter()).rfind(|(next, _)| Some(*next) == reached)
                {
                    self.commit_modify(qpn, next, merged);
                } else if reached == Some(QpState::Err) {
                    self.adopt_err(qpn);
                }
                return Err(VerbError::Fabric(e));
            }
        }
        if !planned.is_empty() {
            self.commit_modify(qpn, from, now);
        }
        answer.ok_or(VerbError::Invalid("CM_MOVE_QP without a step".into()))
    }

    pub(super) fn modify_qp(&mut self, req: &ModifyQpReq) -> VerbResult<()> {
        let qpn = req.qpn.get();
        let qp = self.qps.get(&qpn).ok_or(VerbError::NoObject {
            kind: "QP",
            handle: qpn,
        })?;
        let (next, merged, modify) = self.plan_modify(qp, qp.state, &qp.attr, req)?;
        if let Some(fabric) = &self.fabric {
            if let Err(e) = fabric.modify_qp(modify) {
                // Refused: perhaps because the datapath failed the QP.
                if let Err(also) = self.adopt_datapath_state(qpn) {
                    tracing::warn!(tenant = %self.tenant(), qpn, error = %also,
                        "Cannot read the QP's state in hostd after a refused modify");
                }
                return Err(VerbError::Fabric(e));
            }
        }
        self.commit_modify(qpn, next, merged);
        Ok(())
    }

    /// MODIFY_QP `req` of `qp` checked as if the QP were in state `from`
    /// with attributes `now`: the state it goes to, its attributes after,
    /// and the transition hostd is told. Changes nothing.
    fn plan_modify(
        &self,
        qp: &QueuePair,
        from: QpState,
        now: &QpAttr,
        req: &ModifyQpReq,
    ) -> VerbResult<(QpState, QpAttr, QpModify)> {
        let attr_mask = req.attr_mask.get();
        let (port_mtu, link) = (self.config.port.active_mtu, self.identity.link_layer);
        let max_rd_atomic = self.limits.max_rd_atomic;
        let a = &req.attr;
        if attr_mask & mask::CUR_STATE != 0 && a.cur_qp_state != u8::from(from) {
            return Err(VerbError::Invalid(format!(
                "cur_qp_state {} is not the QP's state {from:?}",
                a.cur_qp_state
            )));
        }
        let next = if attr_mask & mask::STATE != 0 {
            QpState::try_from(a.qp_state)
                .map_err(|v| VerbError::Invalid(format!("qp_state {v}")))?
        } else {
            from
        };
        check_supported_mask(attr_mask)?;
        check_mask(qp.qp_type, from, next, attr_mask).map_err(VerbError::Transition)?;
        if attr_mask & mask::QKEY != 0 && a.qkey.get() & QKEY_CONTROLLED != 0 {
            // A controlled Q_Key (high bit) is the privileged QPs' (QP1's
            // 0x80010000): Linux refuses it to users without CAP_NET_RAW
            // with EPERM, and a tenant is never privileged.
            return Err(VerbError::Privileged(
                "a Q_Key with the high bit set is reserved to privileged QPs",
            ));
        }
        validate_attr(a, attr_mask, port_mtu, link, max_rd_atomic)?;
        let mut merged = *now;
        apply_attr(&mut merged, a, attr_mask);
        let modify = transition(qp, from, next, &merged, attr_mask);
        Ok((next, merged, modify))
    }

    /// The QP `qpn` is in state `next` with attributes `merged` (hostd
    /// took the transition).
    fn commit_modify(&mut self, qpn: u32, next: QpState, merged: QpAttr) {
        let Some(qp) = self.qps.get_mut(&qpn) else {
            return;
        };
        qp.attr = merged;
        qp.state = next;
        qp.attr.qp_state = next.into();
        qp.attr.cur_qp_state = next.into();
        if next == QpState::Reset {
            // RESET returns the QP to its state after creation.
            qp.attr = reset_attr(qp.cap);
        }
    }

    pub(super) fn query_qp(&mut self, qpn: u32) -> VerbResult<QueryQpResp> {
        self.adopt_datapath_state(qpn)?;
        let qp = self.qps.get(&qpn).ok_or(VerbError::NoObject {
            kind: "QP",
            handle: qpn,
        })?;
        Ok(QueryQpResp {
            attr: qp.attr,
            send_cqn: qp.send_cqn.into(),
            recv_cqn: qp.recv_cqn.into(),
            srqn: qp.srqn.unwrap_or(NO_SRQ).into(),
            qp_type: qp.qp_type.into(),
            sq_sig_all: qp.sq_sig_all.into(),
            reserved: [0; 2],
        })
    }

    pub(super) fn destroy_qp(&mut self, qpn: u32) -> VerbResult<()> {
        if !self.qps.contains_key(&qpn) {
            return Err(VerbError::NoObject {
                kind: "QP",
                handle: qpn,
            });
        }
        if let Some(fabric) = &self.fabric {
            // hostd answers once no work of the QP can run any more.
            if let Err(e) = fabric.destroy_qp(qpn) {
                tracing::warn!(tenant = %self.tenant(), qpn, error = %e, "hostd did not destroy the QP");
            }
        }
        let qp = self.qps.remove(&qpn).ok_or(VerbError::NoObject {
            kind: "QP",
            handle: qpn,
        })?;
        self.db_indexes.free(qp.db_index);
        self.share.free_qpn(qpn);
        self.share.give_back(Counted::Qp, 1);
        if let Some(srq) = qp.srqn.and_then(|n| self.srqs.get_mut(&n)) {
            srq.users -= 1;
        }
        if let Some(pd) = self.pds.get_mut(&qp.pdn) {
            pd.qps -= 1;
        }
        for cqn in [qp.send_cqn, qp.recv_cqn] {
            if let Some(cq) = self.cqs.get_mut(&cqn) {
                cq.users -= 1;
            }
        }
        Ok(())
    }

    /// The QP numbered `qpn`.
    pub fn qp(&self, qpn: u32) -> Option<&QueuePair> {
        self.qps.get(&qpn)
    }
}

/// Whether INIT attributes `a` (those `mask` sets) are what `now` holds.
fn same_init_attr(now: &QpAttr, a: &QpAttr, mask: u32) -> bool {
    let same = |bit: u32, eq: bool| mask & bit == 0 || eq;
    let known = mask::STATE | mask::PKEY_INDEX | mask::PORT | mask::ACCESS_FLAGS | mask::QKEY;
    mask & !known == 0
        && same(mask::PKEY_INDEX, now.pkey_index == a.pkey_index)
        && same(mask::PORT, now.port_num == a.port_num)
        && same(mask::ACCESS_FLAGS, now.qp_access_flags == a.qp_access_flags)
        && same(mask::QKEY, now.qkey == a.qkey)
}

impl QueuePair {
    /// The QP as hostd's datapath needs it.
    pub(super) fn setup(&self) -> QpSetup {
        let ring = |(gpa, g): (u64, WorkRingGeometry)| WorkRing {
            gpa,
            depth: g.depth,
            stride: g.stride,
        };
        QpSetup {
            vqpn: self.qpn,
            qp_type: self.qp_type.into(),
            pd: self.pdn,
            db_index: self.db_index,
            send_cqn: self.send_cqn,
            recv_cqn: self.recv_cqn,
            sq_sig_all: self.sq_sig_all,
            sq: ring(self.sq),
            rq: ring(self.rq),
            max_send_sge: self.cap.max_send_sge.get(),
            max_recv_sge: self.cap.max_recv_sge.get(),
            max_inline_data: self.cap.max_inline_data.get(),
            srqn: self.srqn,
        }
    }

    /// What hostd is told to bring this QP, resumed on a restarted hostd in
    /// RESET, back to its state: INIT with its access flags (and a UD QP's
    /// Q_Key), or ERR, flushing what it holds; nothing for RESET.
    pub(super) fn restoring(&self) -> Option<QpModify> {
        let to = match self.state {
            QpState::Reset => return None,
            QpState::Init => QpState::Init,
            _ => QpState::Err,
        };
        Some(QpModify {
            vqpn: self.qpn,
            state: to.into(),
            connection: None,
            access: (to == QpState::Init).then(|| self.attr.qp_access_flags.get()),
            qkey: (to == QpState::Init && self.qp_type == QpType::Ud).then(|| self.attr.qkey.get()),
        })
    }
}

impl QueuePair {
    /// What a new hostd that took over (a handover), with this QP resumed
    /// in RESET, is told to bring it back to its state through the states
    /// before: INIT with its access flags (and a UD QP's Q_Key), RTR and
    /// RTS with the whole connection, then SQD or SQE; ERR directly. The
    /// new hostd gives it the transport the previous one handed over when
    /// it reaches its state.
    pub(super) fn replaying(&self) -> Vec<QpModify> {
        let connected = self.qp_type != QpType::Ud;
        let step = |to: QpState| QpModify {
            vqpn: self.qpn,
            state: to.into(),
            connection: (connected && matches!(to, QpState::Rtr | QpState::Rts))
                .then(|| connection_of(&self.attr)),
            access: (to == QpState::Init).then(|| self.attr.qp_access_flags.get()),
            qkey: (to == QpState::Init && !connected).then(|| self.attr.qkey.get()),
        };
        let path: &[QpState] = match self.state {
            QpState::Reset => &[],
            QpState::Init => &[QpState::Init],
            QpState::Rtr => &[QpState::Init, QpState::Rtr],
            QpState::Rts => &[QpState::Init, QpState::Rtr, QpState::Rts],
            QpState::Sqd => &[QpState::Init, QpState::Rtr, QpState::Rts, QpState::Sqd],
            QpState::Sqe => &[QpState::Init, QpState::Rtr, QpState::Rts, QpState::Sqe],
            QpState::Err => &[QpState::Err],
        };
        path.iter().map(|&to| step(to)).collect()
    }
}

/// Capacities in their wire form as numbers.
pub(super) fn caps_of(cap: &QpCap) -> Caps {
    Caps {
        max_send_wr: cap.max_send_wr.get(),
        max_recv_wr: cap.max_recv_wr.get(),
        max_send_sge: cap.max_send_sge.get(),
        max_recv_sge: cap.max_recv_sge.get(),
        max_inline_data: cap.max_inline_data.get(),
    }
}

/// Capacities as numbers in their wire form.
pub(super) fn wire_caps(caps: Caps) -> QpCap {
    QpCap {
        max_send_wr: caps.max_send_wr.into(),
        max_recv_wr: caps.max_recv_wr.into(),
        max_send_sge: caps.max_send_sge.into(),
        max_recv_sge: caps.max_recv_sge.into(),
        max_inline_data: caps.max_inline_data.into(),
    }
}

/// The ceilings a tenant's limits put on one QP.
pub(super) fn cap_limits(limits: &Limits) -> CapLimits {
    CapLimits {
        max_wr: limits.max_qp_depth,
        max_sge: limits.max_sge,
        max_inline_data: limits.max_inline_data,
    }
}

/// A QP's stored attributes after creation and after RESET.
fn reset_attr(cap: QpCap) -> QpAttr {
    QpAttr {
        qp_state: QpState::Reset.into(),
        cap,
        path_mtu: PORT_MTU.into(),
        port_num: 1,
        ..QpAttr::default()
    }
}

/// What hostd is told of QP `qp`'s transition to `to` with the QP's
/// attributes `attr` (the request applied to what earlier calls set): the
/// new state; for RC and UC the whole connection when the QP connects
/// (INIT → RTR) and again when it becomes a requester (RTR → RTS),
/// complete then, since the requester's attributes (retries, timeout, send
/// PSN, outstanding READs) come with RTS; its access flags when the mask
/// changes them; a UD QP's Q_Key when the mask sets it.
fn transition(
    qp: &QueuePair,
    from: QpState,
    to: QpState,
    attr: &QpAttr,
    attr_mask: u32,
) -> QpModify {
    let connects = matches!(
        (from, to),
        (QpState::Init, QpState::Rtr) | (QpState::Rtr, QpState::Rts)
    );
    let connection = (connects && qp.qp_type != QpType::Ud).then(|| connection_of(attr));
    QpModify {
        vqpn: qp.qpn,
        state: to.into(),
        connection,
        access: (attr_mask & mask::ACCESS_FLAGS != 0).then(|| attr.qp_access_flags.get()),
        qkey: (attr_mask & mask::QKEY != 0).then(|| attr.qkey.get()),
    }
}

/// The connection the QP's stored attributes describe (the peer named by
/// the address vector: [`destination`]).
fn connection_of(attr: &QpAttr) -> QpConnection {
    let av = &attr.ah_attr;
    let (dgid, dlid) = destination(av);
    // The stored path MTU is always valid (checked when set, 4096 at
    // creation and RESET).
    let path_mtu = Mtu::try_from(attr.path_mtu).unwrap_or(PORT_MTU);
    QpConnection {
        dgid,
        dlid,
        dest_qpn: attr.dest_qp_num.get(),
        flow_label: av.flow_label.get(),
        hop_limit: av.hop_limit,
        traffic_class: av.traffic_class,
        access: attr.qp_access_flags.get(),
        rnr_retry: attr.rnr_retry,
        retry_cnt: attr.retry_cnt,
        min_rnr_timer: attr.min_rnr_timer,
        timeout: attr.timeout,
        path_mtu: path_mtu.bytes(),
        sq_psn: attr.sq_psn.get(),
        rq_psn: attr.rq_psn.get(),
        max_rd_atomic: attr.max_rd_atomic,
        max_dest_rd_atomic: attr.max_dest_rd_atomic,
    }
}

/// Refuses mask bits that name nothing, and attributes of features vrdma
/// does not have (so the application learns `EOPNOTSUPP`, not `EINVAL`).
fn check_supported_mask(attr_mask: u32) -> VerbResult<()> {
    if attr_mask & !known_mask() != 0 {
        return Err(VerbError::Invalid(format!(
            "unknown attribute mask bits {:#x}",
            attr_mask & !known_mask()
        )));
    }
    if attr_mask & mask::ALT_PATH != 0 {
        return Err(VerbError::Unsupported(
            "alternate paths (automatic path migration)",
        ));
    }
    if attr_mask & mask::RATE_LIMIT != 0 {
        return Err(VerbError::Unsupported("per-QP rate limits"));
    }
    Ok(())
}

/// Checks an address vector (a QP's path, an address handle) for a port
/// of link layer `link`: port 1, and either a GRH naming GID index 0 as
/// the source and an IPv4-mapped destination GID with a 20-bit flow label,
/// or — only on an InfiniBand port, where the GRH is optional — a unicast
/// `dlid` (not 0, not the permissive LID, not multicast: vrdma has no
/// multicast).
pub(super) fn validate_av(av: &AhAttr, link: PortLinkLayer) -> VerbResult<()> {
    let bad = |what: String| Err(VerbError::Invalid(what));
    if av.port_num != 1 {
        return bad(format!("ah_attr.port_num {}", av.port_num));
    }
    if av.is_global == 0 {
        return match link {
            // RoCE: the peer is named by its GID in the GRH (the LID is
            // ignored), as on rxe.
            PortLinkLayer::Ethernet => bad(
                "ah_attr.is_global 0: the port's link layer is Ethernet (RoCEv2), so the \
                 address vector needs a GRH with the peer's GID (rc_pingpong -g 0, \
                 perftest -x 0)"
                    .into(),
            ),
            PortLinkLayer::Infiniband if !lid::is_unicast(av.dlid.get()) => bad(format!(
                "ah_attr.dlid {:#x} without a GRH: a destination LID must be unicast \
                 (0x1-0xbfff; multicast is not supported)",
                av.dlid
            )),
            PortLinkLayer::Infiniband => Ok(()),
        };
    }
    if av.sgid_index != 0 {
        return bad(format!(
            "ah_attr.grh.sgid_index {} (the GID table has 1 entry)",
            av.sgid_index
        ));
    }
    if vrdma_spec::gid::ipv4_of(&av.dgid).is_none() {
        return bad(format!(
            "ah_attr.grh.dgid {} is not an IPv4-mapped GID (IPv6 GIDs are not supported)",
            std::net::Ipv6Addr::from(av.dgid)
        ));
    }
    if av.flow_label.get() > MAX_FLOW_LABEL {
        return bad(format!(
            "ah_attr.grh.flow_label {:#x} is not 20 bits",
            av.flow_label
        ));
    }
    Ok(())
}

/// Who a valid address vector names, as hostd is told: the GRH's
/// destination GID, or without a GRH (an InfiniBand port) the
/// destination LID, which hostd resolves.
pub(super) fn destination(av: &AhAttr) -> ([u8; 16], Option<u16>) {
    if av.is_global == 0 {
        ([0; 16], Some(av.dlid.get()))
    } else {
        (av.dgid, None)
    }
}

/// Checks the value of every attribute the mask names.
fn validate_attr(
    a: &QpAttr,
    attr_mask: u32,
    port_mtu: u8,
    link: PortLinkLayer,
    max_rd_atomic: u32,
) -> VerbResult<()> {
    let has = |bit| attr_mask & bit != 0;
    let bad = |what: String| Err(VerbError::Invalid(what));
    if has(mask::PORT) && a.port_num != 1 {
        return bad(format!("port_num {} (the device has port 1)", a.port_num));
    }
    if has(mask::PKEY_INDEX) && a.pkey_index.get() != 0 {
        return bad(format!(
            "pkey_index {} (the P_Key table has 1 entry)",
            a.pkey_index
        ));
    }
    if has(mask::ACCESS_FLAGS) && a.qp_access_flags.get() & !access::QP_SUPPORTED != 0 {
        return bad(format!("qp_access_flags {:#x}", a.qp_access_flags));
    }
    if has(mask::PATH_MTU) {
        let mtu =
            Mtu::try_from(a.path_mtu).map_err(|v| VerbError::Invalid(format!("path_mtu {v}")))?;
        if u8::from(mtu) > port_mtu {
            return bad(format!("path_mtu {mtu:?} is above the port's active MTU"));
        }
    }
    if has(mask::AV) {
        validate_av(&a.ah_attr, link)?;
    }
    if has(mask::DEST_QPN) && a.dest_qp_num.get() > QPN_MASK {
        return bad(format!(
            "dest_qp_num {:#x} is not a 24-bit QPN",
            a.dest_qp_num
        ));
    }
    if has(mask::RQ_PSN) && a.rq_psn.get() > MAX_PSN {
        return bad(format!("rq_psn {:#x} is not a 24-bit PSN", a.rq_psn));
    }
    if has(mask::SQ_PSN) && a.sq_psn.get() > MAX_PSN {
        return bad(format!("sq_psn {:#x} is not a 24-bit PSN", a.sq_psn));
    }
    if has(mask::MAX_DEST_RD_ATOMIC) && u32::from(a.max_dest_rd_atomic) > max_rd_atomic {
        return bad(format!(
            "max_dest_rd_atomic {} exceeds {max_rd_atomic}",
            a.max_dest_rd_atomic
        ));
    }
    if has(mask::MAX_QP_RD_ATOMIC) && u32::from(a.max_rd_atomic) > max_rd_atomic {
        return bad(format!(
            "max_rd_atomic {} exceeds {max_rd_atomic}",
            a.max_rd_atomic
        ));
    }
    if has(mask::MIN_RNR_TIMER) && a.min_rnr_timer > MAX_TIMER {
        return bad(format!("min_rnr_timer {}", a.min_rnr_timer));
    }
    if has(mask::TIMEOUT) && a.timeout > MAX_TIMER {
        return bad(format!("timeout {}", a.timeout));
    }
    if has(mask::RETRY_CNT) && a.retry_cnt > MAX_RETRY {
        return bad(format!("retry_cnt {}", a.retry_cnt));
    }
    if has(mask::RNR_RETRY) && a.rnr_retry > MAX_RETRY {
        return bad(format!("rnr_retry {}", a.rnr_retry));
    }
    if has(mask::PATH_MIG_STATE) && a.path_mig_state != MIG_MIGRATED {
        return bad(format!(
            "path_mig_state {} (automatic path migration is not supported)",
            a.path_mig_state
        ));
    }
    Ok(())
}

fn known_mask() -> u32 {
    mask::NAMES.iter().fold(0, |acc, (bit, _)| acc | bit)
}

/// Copies the attributes the mask names into the QP's stored attributes.
fn apply_attr(dst: &mut QpAttr, a: &QpAttr, attr_mask: u32) {
    let has = |bit| attr_mask & bit != 0;
    if has(mask::EN_SQD_ASYNC_NOTIFY) {
        dst.en_sqd_async_notify = a.en_sqd_async_notify;
    }
    if has(mask::ACCESS_FLAGS) {
        dst.qp_access_flags = a.qp_access_flags;
    }
    if has(mask::QKEY) {
        dst.qkey = a.qkey;
    }
    if has(mask::PKEY_INDEX) {
        dst.pkey_index = a.pkey_index;
    }
    if has(mask::PORT) {
        dst.port_num = a.port_num;
    }
    if has(mask::AV) {
        dst.ah_attr = a.ah_attr;
    }
    if has(mask::PATH_MTU) {
        dst.path_mtu = a.path_mtu;
    }
    if has(mask::TIMEOUT) {
        dst.timeout = a.timeout;
    }
    if has(mask::RETRY_CNT) {
        dst.retry_cnt = a.retry_cnt;
    }
    if has(mask::RNR_RETRY) {
        dst.rnr_retry = a.rnr_retry;
    }
    if has(mask::RQ_PSN) {
        dst.rq_psn = a.rq_psn;
    }
    if has(mask::SQ_PSN) {
        dst.sq_psn = a.sq_psn;
    }
    if has(mask::MAX_QP_RD_ATOMIC) {
        dst.max_rd_atomic = a.max_rd_atomic;
    }
    if has(mask::MAX_DEST_RD_ATOMIC) {
        dst.max_dest_rd_atomic = a.max_dest_rd_atomic;
    }
    if has(mask::MIN_RNR_TIMER) {
        dst.min_rnr_timer = a.min_rnr_timer;
    }
    if has(mask::PATH_MIG_STATE) {
        dst.path_mig_state = a.path_mig_state;
    }
    if has(mask::DEST_QPN) {
        dst.dest_qp_num = a.dest_qp_num;
    }
}
