//! The port's link to the datapath: down when hostd goes away, up again
//! when a restarted hostd has the context back.
//!
//! hostd is the device's NIC; its going away is a link failure and its
//! return the link coming back. Down: QUERY_PORT says DOWN, the QPs that
//! were connected or sending go to ERR, and the driver gets PORT_ERROR and
//! a QP_FATAL for each of them ([`RdmaDevice::port_lost`]). Up: vdev
//! registers the context again and gives hostd everything of it that lives
//! on: memory, doorbell, event rings, CQs, MRs under their keys, SRQs,
//! AHs and QPs ([`RdmaDevice::restore`]); the QPs in ERR flush what they
//! hold, and the driver gets PORT_ACTIVE.

use vrdma_hostd_protocol::messages::Welcome;
use vrdma_spec::ring::event_kind;
use vrdma_spec::verbs::PortState;

use super::notify::PostError;
use super::RdmaDevice;
use crate::fabric::FabricError;
use crate::shadow::MemorySlots;

/// `phys_state` of a port whose link is off (Disabled), as ibv_devinfo
/// shows it.
const PHYS_DISABLED: u8 = 3;
/// `phys_state` of a port whose link is up (LinkUp).
pub(super) const PHYS_LINK_UP: u8 = 5;

/// What [`RdmaDevice::restore`] brought back, and what it could not.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Restored {
    /// Objects hostd has again (memory slots, doorbell, event rings, CQs,
    /// MRs, SRQs, AHs and QPs).
    pub objects: usize,
    /// Objects hostd refused (logged one by one): an MR whose key another
    /// region took meanwhile, a ring in memory that is gone.
    pub refused: usize,
    /// QPs in ERR whose posted work the new hostd flushes.
    pub flushed_qps: usize,
    /// The Welcome named another GID than the port had.
    pub gid_changed: bool,
    /// The context carries on after a handover (nothing was down).
    pub handed_over: bool,
}

impl RdmaDevice {
    /// Whether the port is down (hostd went away and the context is not
    /// registered again yet).
    pub fn port_down(&self) -> bool {
        self.config.port.state == u8::from(PortState::Down)
    }

    /// hostd went away: the port is down. `QUERY_PORT` says so from now on
    /// (a real NIC whose link dropped), the QPs that were past INIT go to
    /// ERR, and the driver gets one PORT_ERROR on event ring 0, then a
    /// QP_FATAL for each of those QPs. hostd's channel closing means it
    /// detached the device (or died): nobody else writes the ring any
    /// more, so vdev continues it from the index hostd published. Once
    /// only: a port already down stays silent.
    pub fn port_lost(&mut self) {
        if self.port_down() {
            return;
        }
        if self.is_handed_over() {
            // A handover, not a failure: the port stays up, the QPs as
            // they are; the new hostd gets them back in their states.
            tracing::info!(tenant = %self.tenant(),
                "hostd handed over: registering with the new hostd");
            return;
        }
        self.config.port.state = PortState::Down.into();
        self.config.port.phys_state = PHYS_DISABLED;
        let failed = self.fail_qps();
        tracing::warn!(tenant = %self.tenant(), failed_qps = failed.len(),
            "hostd went away: the port is down");
        let events = std::iter::once((event_kind::PORT_ERROR, 1))
            .chain(failed.iter().map(|&qpn| (event_kind::QP_FATAL, qpn)));
        for (kind, object) in events {
            if !self.post_port_event(kind, object) {
                break;
            }
        }
    }

    /// Whether the hostd serving this context handed over to a new one
    /// ([`Notification::Handover`], kept by the fabric) and the context is
    /// not on the new one yet: when its channel closes the port stays up
    /// ([`RdmaDevice::port_lost`]), and [`RdmaDevice::restore`] brings the
    /// context back onto the new hostd in its states.
    ///
    /// [`Notification::Handover`]: vrdma_hostd_protocol::messages::Notification::Handover
    pub fn is_handed_over(&self) -> bool {
        self.fabric.as_ref().is_some_and(|f| f.handover_pending())
    }

    /// hostd is back and this context registered again (`welcome` is its
    /// answer): hostd is given everything of the context that lives on, in
    /// the order it needs them, and the port is ACTIVE again.
    ///
    /// - memory slots, then the doorbell page;
    /// - PORT_ACTIVE on event ring 0, written by vdev before hostd takes
    ///   the ring back (then nobody else writes it);
    /// - the event rings and CQs, which continue from their headers;
    /// - the MRs under their keys, which the driver and its peers hold;
    /// - SRQs (continuing), AHs, and the QPs (continuing): RESET and INIT
    ///   as they were, the others in ERR, where hostd flushes what they
    ///   hold with WR_FLUSH_ERR completions.
    ///
    /// An object hostd refuses is logged and counted; the rest is restored
    /// all the same. Nothing is sent once the new channel fails (hostd
    /// went again: the listener then takes the port down again).
    pub fn restore(&mut self, welcome: &Welcome) -> Restored {
        let mut restored = Restored::default();
        let Some(fabric) = self.fabric.clone() else {
            return restored;
        };
        // After a handover the context carries on where it was, if the new
        // hostd has what the previous one handed over of it; else it comes
        // back as after a restart (the port went down meanwhile).
        let handed_over = match fabric.take_handover() {
            None => false,
            Some(token) => match fabric.resume_handover(token) {
                Ok(()) => true,
                Err(e) => {
                    tracing::warn!(tenant = %self.tenant(),
                        "The new hostd has nothing of this context: it comes back as after a \
                         restart: {}", vrdma_errors::error_chain(&e));
                    self.port_lost();
                    false
                }
            },
        };
        restored.handed_over = handed_over;
        if welcome.gid != self.identity.gid {
            tracing::warn!(tenant = %self.tenant(),
                old = %std::net::Ipv6Addr::from(self.identity.gid),
                new = %std::net::Ipv6Addr::from(welcome.gid),
                "hostd gave the device another GID: peers must use the new one");
            self.identity.gid = welcome.gid;
            self.config.gid = welcome.gid;
            restored.gid_changed = true;
        }
        // hostd may have come back with another `[fabric] ip_mtu`: the port
        // says the MTU it has now (QPs modified from now on check their
        // path MTU against it).
        let mtu = fabric.active_mtu();
        if mtu != self.identity.active_mtu {
            tracing::info!(tenant = %self.tenant(), old = self.identity.active_mtu.bytes(),
                new = mtu.bytes(), "hostd gave the port another active MTU");
            self.identity.active_mtu = mtu;
            self.config.port.active_mtu = mtu.into();
        }
        // Memory: every slot again, numbered afresh.
        self.slots.clear();
        let mem = self.mem.clone();
        self.mirror_slots(&mem, &MemorySlots::of(&mem));
        restored.objects += self.slots.len();
        let tenant = self.identity.tenant.clone();
        let mut tally = Tally {
            tenant: &tenant,
            restored,
        };
        if let Some(addr) = self.doorbell {
            let sent = self
                .lend_fd("SET_DOORBELL", |fds| fds.doorbell_kick())
                .map_err(|e| refused_locally(&e))
                .and_then(|kick| fabric.set_doorbell(addr, std::os::fd::AsFd::as_fd(&kick)));
            if !tally.record("doorbell", 0, sent) {
                return tally.restored;
            }
        }
        if !handed_over {
            self.config.port.state = PortState::Active.into();
            self.config.port.phys_state = PHYS_LINK_UP;
            self.post_port_event(event_kind::PORT_ACTIVE, 1);
        }
        for (&vector, eq) in &self.eqs {
            let sent = self
                .lend_fd("CREATE_EQ", |fds| fds.vector_call(vector))
                .map_err(|e| refused_locally(&e))
                .and_then(|call| {
                    let call = std::os::fd::AsFd::as_fd(&call);
                    fabric.create_eq(vector, (eq.ring_addr, eq.depth), call, true)
                });
            if !tally.record("event ring", vector, sent) {
                return tally.restored;
            }
        }
        for (&cqn, cq) in &self.cqs {
            let sent = fabric.create_cq(cqn, (cq.ring_addr, cq.depth), cq.comp_vector, true);
            if !tally.record("CQ", cqn, sent) {
                return tally.restored;
            }
        }
        for (&handle, mr) in &self.mrs {
            if mr.shadow.is_revoked() {
                continue;
            }
            let sent = self
                .mr_registration(mr.pdn, &mr.shadow)
                .map_err(|e| refused_locally(&e))
                .and_then(|reg| fabric.restore_mr(mr.lkey, mr.rkey, reg));
            if !tally.record("MR", handle, sent) {
                return tally.restored;
            }
        }
        for (&srqn, srq) in &self.srqs {
            if !tally.record("SRQ", srqn, fabric.resume_srq(srq.setup(srqn))) {
                return tally.restored;
            }
        }
        for (&ahn, ah) in &self.ahs {
            if !tally.record("AH", ahn, fabric.create_ah(ah.setup(ahn))) {
                return tally.restored;
            }
        }
        let mut qpns: Vec<u32> = self.qps.keys().copied().collect();
        qpns.sort_unstable();
        for qpn in qpns {
            let Some(qp) = self.qps.get(&qpn) else {
                continue;
            };
            if !tally.record("QP", qpn, fabric.resume_qp(qp.setup())) {
                return tally.restored;
            }
            let steps = if handed_over {
                qp.replaying()
            } else {
                qp.restoring().into_iter().collect()
            };
            for modify in steps {
                let flushing = modify.state == u8::from(vrdma_spec::verbs::QpState::Err);
                let going_on = match fabric.modify_qp(modify) {
                    Ok(()) => {
                        tally.restored.flushed_qps += usize::from(flushing);
                        true
                    }
                    Err(e) => tally.failed("QP state", qpn, e),
                };
                if !going_on {
                    return tally.restored;
                }
            }
        }
        let restored = tally.restored;
        self.journal_everything();
        restored
    }

    /// Posts a port event (or a QP_FATAL with it) on event ring 0; false
    /// when the ring cannot take events at all.
    fn post_port_event(&self, kind: u16, object: u32) -> bool {
        match self.post_event(0, kind, object) {
            Ok(()) => true,
            // A context whose driver has not started yet (vdev prepares
            // the next one ahead): it finds the port's state when it asks.
            Err(e @ PostError::NoRing(_)) => {
                tracing::debug!(tenant = %self.tenant(), kind, "No port event posted: {e}");
                false
            }
            Err(e) => {
                tracing::warn!(tenant = %self.tenant(), kind, error = %vrdma_errors::error_chain(&e),
                    "The driver cannot be told of its port");
                false
            }
        }
    }
}

/// The objects [`RdmaDevice::restore`] handed hostd so far.
struct Tally<'t> {
    tenant: &'t str,
    restored: Restored,
}

impl Tally<'_> {
    /// Counts hostd's answer for one object; false when hostd is gone
    /// again (nothing more is sent).
    fn record(&mut self, what: &str, handle: u32, result: Result<(), FabricError>) -> bool {
        match result {
            Ok(()) => {
                self.restored.objects += 1;
                true
            }
            Err(e) => self.failed(what, handle, e),
        }
    }

    /// Logs hostd's refusal of one object; false when hostd is gone again.
    fn failed(&mut self, what: &str, handle: u32, error: FabricError) -> bool {
        match error {
            FabricError::Refused { errno, reason } => {
                self.restored.refused += 1;
                tracing::warn!(
                    tenant = self.tenant,
                    what,
                    handle,
                    errno,
                    "hostd did not take the object back: {reason}"
                );
            }
            e => {
                tracing::warn!(
                    tenant = self.tenant,
                    what,
                    handle,
                    "hostd went away again: {}",
                    vrdma_errors::error_chain(&e)
                );
                return false;
            }
        }
        true
    }
}

/// An object vdev itself cannot hand hostd again (its eventfd is missing,
/// its memory is not hostd's any more), counted as hostd's refusal.
fn refused_locally(e: &dyn std::error::Error) -> FabricError {
    FabricError::Refused {
        errno: libc::EINVAL,
        reason: vrdma_errors::error_chain(e),
    }
}
