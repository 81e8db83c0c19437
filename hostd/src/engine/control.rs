//! The engine's control operations: what vdevs ask of the NIC through
//! hostd's control socket, each checked here against the engine's own
//! tables (a vdev is not trusted: it is a hostile guest with more reach).
//! The caller holds the datapath lock, so each one is atomic with respect
//! to the datapath: when it returns, the datapath sees all of it.

use std::sync::Arc;
use std::time::Instant;

use vmm_sys_util::eventfd::EventFd;
use vrdma_hostd_protocol::messages::{MrRegistration, QpModify, QpSetup};
use vrdma_spec::limits::{MAX_CQ_DEPTH, MAX_QPS, MAX_RING_DEPTH, MAX_WQE_STRIDE};
use vrdma_spec::ring::{CQE_SIZE, EVENT_SIZE, QKEY_CONTROLLED};
use vrdma_spec::verbs::{access, QpState, QpType};
use vrdma_tenant_policy::TenantPolicy;

use super::guest::{Cq, DoorbellPage, EventRing, GuestRing, SharedMapping};
use super::rc::{Qp, QpRef};
use super::wqe::{RecvLimits, SendLimits};
use super::{Address, Device, DeviceId, Doorbell, Engine, EngineError, Pqp, MAX_VECTORS};
use crate::ids::{PickedMap, Slab};

/// Smallest stride of a work ring (a cache line holds the fixed part).
const MIN_WQE_STRIDE: u32 = 64;

/// Where a new object's ring starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Start {
    /// A new object: the device's half of the header is cleared.
    Fresh,
    /// An object a previous datapath served (hostd restarted and its vdev
    /// brought the object back): the ring continues from the device's
    /// index (and a CQ's notified sequence number) in its header, which
    /// the previous datapath, or vdev while there was none, last wrote.
    Resumed,
}

impl Engine {
    /// A vdev connected: device `id` of `tenant` at `address`, its virtual
    /// QPs multiplexed onto physical QPs `pqps` (at least one). Another
    /// context of a device attaches as a device of its own with the same
    /// address.
    pub fn attach_device(
        &mut self,
        id: DeviceId,
        tenant: &str,
        address: Address,
        pqps: &[u32],
        policy: &TenantPolicy,
    ) -> Result<(), EngineError> {
        if self.devices.contains_key(&id) {
            return Err(EngineError::Invalid("device already attached"));
        }
        if pqps.is_empty() {
            return Err(EngineError::Invalid("a device needs a physical QP"));
        }
        if !self.sched.knows(tenant) {
            self.sched.configure(policy, Instant::now());
        }
        self.sched.add_device(id, tenant);
        let rank = self.sched.rank(id).unwrap_or(u8::MAX);
        let Address { gid, lid } = address;
        let contexts = self.gids.entry(gid).or_default();
        let first = contexts.is_empty();
        contexts.push(id);
        self.devices.insert(Device {
            id,
            tenant: Arc::from(tenant),
            gid,
            lid,
            mem: Default::default(),
            doorbell: None,
            eqs: Vec::new(),
            cqs: Slab::default(),
            cq_by_num: PickedMap::default(),
            qps: PickedMap::default(),
            srqs: Slab::default(),
            srq_by_num: PickedMap::default(),
            ahs: PickedMap::default(),
            qp_by_db: Vec::new(),
            pqps: (pqps.iter())
                .map(|&number| Pqp {
                    number,
                    ..Pqp::default()
                })
                .collect(),
            rank,
            policy: policy.clone(),
            gsi: Default::default(),
            counters: Default::default(),
        });
        if first {
            self.accounts.attach(id, tenant, pqps.len());
        } else {
            self.accounts.attach_context(id, tenant);
        }
        self.generation += 1;
        Ok(())
    }

    /// The vdev is gone: its QPs, CQs, keys and memory go, and nothing of
    /// it is touched any more. Nothing is completed.
    pub fn detach_device(&mut self, id: DeviceId) {
        self.reset_device(id);
        let di = self.devices.index(&id);
        if let Some(mut dev) = self.devices.remove(&id) {
            if let Some(contexts) = self.gids.get_mut(&dev.gid) {
                let held_qp1 = contexts.first() == Some(&id);
                contexts.retain(|&d| d != id);
                match contexts.first() {
                    Some(&other) => {
                        self.accounts.hand_over(id, other);
                        if held_qp1 {
                            let gsi = std::mem::take(&mut dev.gsi);
                            self.gsi_hand_over(gsi, other);
                        }
                    }
                    None => {
                        self.gids.remove(&dev.gid);
                    }
                }
            }
            self.accounts.add_device_counters(id, &dev.counters);
        }
        self.sched.remove_device(id);
        self.accounts.detach(id);
        self.dirty.retain(|d| Some(d.0) != di);
        self.generation += 1;
    }

    /// The driver reset the device: its QPs, CQs, event rings, doorbell and
    /// memory regions go; its memory slots stay.
    pub fn reset_device(&mut self, id: DeviceId) {
        let qpns: Vec<u32> = (self.devices.get(&id))
            .map(|d| d.qps.keys().copied().collect())
            .unwrap_or_default();
        for vqpn in qpns {
            let _ = self.destroy_qp(id, vqpn);
        }
        for lkey in self.keys.remove_device(id) {
            self.accounts.mr_deregistered(id, lkey);
        }
        if let Some(dev) = self.devices.get_mut(&id) {
            dev.cqs = Slab::default();
            dev.cq_by_num.clear();
            dev.srqs = Slab::default();
            dev.srq_by_num.clear();
            dev.ahs.clear();
            dev.eqs.clear();
            if dev.doorbell.take().is_some() {
                self.generation += 1;
            }
        }
    }

    pub(super) fn device_mut(&mut self, id: DeviceId) -> Result<&mut Device, EngineError> {
        self.devices.get_mut(&id).ok_or(EngineError::UnknownDevice)
    }

    /// Memory slot `slot` of device `id` is guest-physical `gpa..` in `map`;
    /// the device has at most `limit` slots ([`super::guest::slot_limit`]).
    pub fn add_memory(
        &mut self,
        id: DeviceId,
        slot: u32,
        gpa: u64,
        map: SharedMapping,
        limit: usize,
    ) -> Result<(), EngineError> {
        self.device_mut(id)?.mem.add(slot, gpa, map, limit)
    }

    /// Slot `slot` is gone: keys over it are revoked, and every ring in it
    /// is lost — its QP goes to ERR without a completion (there is nowhere
    /// to write one), its CQ or event ring takes no more entries, and a
    /// doorbell page in it is no longer read.
    pub fn remove_memory(&mut self, id: DeviceId, slot: u32) -> Result<(), EngineError> {
        let dev = self.device_mut(id)?;
        dev.mem.remove(slot)?;
        for (_, cq) in dev.cqs.iter_mut() {
            cq.lost |= cq.slot() == slot;
        }
        for (_, srq) in dev.srqs.iter_mut() {
            srq.lost |= srq.ring.slot() == slot;
        }
        for eq in dev.eqs.iter_mut().flatten() {
            eq.lost |= eq.slot() == slot;
        }
        let mut bell_lost = false;
        if let Some(bell) = dev.doorbell.as_mut() {
            if bell.page.slot() == slot && !bell.lost {
                bell.lost = true;
                bell_lost = true;
            }
        }
        let qps: Vec<QpRef> = dev.qps.values().copied().collect();
        if bell_lost {
            // The datapath threads stop sleeping on its kick.
            self.generation += 1;
        }
        self.keys.revoke_slot(id, slot);
        for qref in qps {
            let Some(qp) = self.qps.get_mut(qref) else {
                continue;
            };
            if qp.sq.slot() == slot || qp.rq.slot() == slot {
                qp.lost = true;
                self.fail_qp(qref, false, "its ring's memory was removed");
            }
        }
        Ok(())
    }

    /// Device `id`'s frontend came back with new eventfds (a VMM that
    /// reconnected to a restarted vdev): the doorbell's kick (if given)
    /// and the event rings' interrupts are these from now on. Each new
    /// interrupt fires once: an event that came while the old one was
    /// unwatched is not missed.
    pub fn renew_notifiers(
        &mut self,
        id: DeviceId,
        kick: Option<EventFd>,
        irqs: Vec<(u32, EventFd)>,
    ) -> Result<(), EngineError> {
        let serial = self.next_serial;
        let dev = self.device_mut(id)?;
        for (vector, _) in &irqs {
            if !dev.eqs.get(*vector as usize).is_some_and(Option::is_some) {
                return Err(EngineError::Invalid("no event ring on that vector"));
            }
        }
        let mut renewed_bell = false;
        if let Some(kick) = kick {
            let bell = dev
                .doorbell
                .as_mut()
                .ok_or(EngineError::Invalid("no doorbell page"))?;
            // A new serial: the datapath threads watch the new kick.
            bell.kick = kick;
            bell.serial = serial;
            renewed_bell = true;
        }
        for (vector, irq) in irqs {
            if let Some(Some(eq)) = dev.eqs.get_mut(vector as usize) {
                let _ = irq.write(1);
                eq.set_irq(irq);
            }
        }
        if renewed_bell {
            self.next_serial += 1;
        }
        self.generation += 1;
        Ok(())
    }

    /// Registers a memory region of device `id`; returns its (lkey, rkey).
    pub fn register_mr(
        &mut self,
        id: DeviceId,
        reg: &MrRegistration,
    ) -> Result<(u32, u32), EngineError> {
        let dev = self.devices.get(&id).ok_or(EngineError::UnknownDevice)?;
        let keys = self.keys.register(id, reg, &dev.mem)?;
        self.accounts.mr_registered(id, keys.0, reg.len);
        Ok(keys)
    }

    /// Registers a region of device `id` that a previous hostd had
    /// registered, under its keys (`lkey`, `rkey`).
    pub fn restore_mr(
        &mut self,
        id: DeviceId,
        reg: &MrRegistration,
        keys: (u32, u32),
    ) -> Result<(), EngineError> {
        let dev = self.devices.get(&id).ok_or(EngineError::UnknownDevice)?;
        let keys = self.keys.restore(id, reg, &dev.mem, keys)?;
        self.accounts.mr_registered(id, keys.0, reg.len);
        Ok(())
    }

    /// Revokes the region `lkey` of device `id`.
    pub fn deregister_mr(&mut self, id: DeviceId, lkey: u32) -> Result<(), EngineError> {
        self.keys.deregister(id, lkey)?;
        self.accounts.mr_deregistered(id, lkey);
        Ok(())
    }

    /// The device's doorbell page at `gpa`, and the eventfd its driver
    /// kicks when the datapath asked to be woken.
    pub fn set_doorbell(
        &mut self,
        id: DeviceId,
        gpa: u64,
        kick: EventFd,
    ) -> Result<(), EngineError> {
        let serial = self.next_serial;
        let dev = self.device_mut(id)?;
        if dev.doorbell.is_some() {
            return Err(EngineError::Exists("doorbell page"));
        }
        let page = DoorbellPage::new(&dev.mem, gpa)?;
        dev.doorbell = Some(Doorbell {
            page,
            kick,
            serial,
            lost: false,
        });
        self.next_serial += 1;
        self.generation += 1;
        Ok(())
    }

    /// Device `id` and a ring in its memory of `depth` entries (at most
    /// `max`) of `entry` bytes at `gpa`, for a new object of completion
    /// vector `vector`; refused with `Exists` when `taken` names the object
    /// the device already has in its place (checked before the ring).
    fn vector_ring(
        &mut self,
        id: DeviceId,
        vector: u32,
        (gpa, depth, entry, max): (u64, u32, usize, u32),
        taken: impl FnOnce(&Device) -> Option<&'static str>,
    ) -> Result<(&mut Device, GuestRing), EngineError> {
        if vector >= MAX_VECTORS {
            return Err(EngineError::Invalid("completion vector"));
        }
        let dev = self.device_mut(id)?;
        if let Some(what) = taken(dev) {
            return Err(EngineError::Exists(what));
        }
        let ring = GuestRing::new(&dev.mem, gpa, depth, entry as u32, max)?;
        Ok((dev, ring))
    }

    /// The event ring of completion vector `vector`, interrupting through
    /// `irq`.
    pub fn create_eq(
        &mut self,
        id: DeviceId,
        vector: u32,
        gpa: u64,
        depth: u32,
        irq: EventFd,
    ) -> Result<(), EngineError> {
        self.open_eq(id, vector, (gpa, depth), irq, Start::Fresh)
    }

    /// [`Engine::create_eq`], or for a ring a previous datapath wrote
    /// ([`Start::Resumed`]: it continues from its header).
    pub fn open_eq(
        &mut self,
        id: DeviceId,
        vector: u32,
        (gpa, depth): (u64, u32),
        irq: EventFd,
        start: Start,
    ) -> Result<(), EngineError> {
        let index = vector as usize;
        let taken = |dev: &Device| {
            let has = dev.eqs.get(index).is_some_and(Option::is_some);
            has.then_some("event ring of that vector")
        };
        let (dev, ring) =
            self.vector_ring(id, vector, (gpa, depth, EVENT_SIZE, MAX_RING_DEPTH), taken)?;
        if dev.eqs.len() <= index {
            dev.eqs.resize_with(index + 1, || None);
        }
        dev.eqs[index] = Some(match start {
            Start::Fresh => EventRing::new(ring, irq),
            Start::Resumed => EventRing::resume(ring, irq),
        });
        Ok(())
    }

    /// A completion queue numbered `cqn`: `depth` CQEs at `gpa`.
    pub fn create_cq(
        &mut self,
        id: DeviceId,
        cqn: u32,
        gpa: u64,
        depth: u32,
        vector: u32,
    ) -> Result<(), EngineError> {
        self.open_cq(id, cqn, (gpa, depth), vector, Start::Fresh)
    }

    /// [`Engine::create_cq`], or for a CQ a previous datapath wrote
    /// ([`Start::Resumed`]: it continues from its ring's header).
    pub fn open_cq(
        &mut self,
        id: DeviceId,
        cqn: u32,
        (gpa, depth): (u64, u32),
        vector: u32,
        start: Start,
    ) -> Result<(), EngineError> {
        let taken = |dev: &Device| dev.cq_by_num.contains_key(&cqn).then_some("CQ");
        let (dev, ring) =
            self.vector_ring(id, vector, (gpa, depth, CQE_SIZE, MAX_CQ_DEPTH), taken)?;
        let cq = match start {
            Start::Fresh => Cq::new(cqn, ring, vector),
            Start::Resumed => Cq::resume(cqn, ring, vector),
        };
        let index = dev.cqs.insert(cq);
        dev.cq_by_num.insert(cqn, index);
        Ok(())
    }

    /// Destroys CQ `cqn` (refused while a QP completes to it).
    pub fn destroy_cq(&mut self, id: DeviceId, cqn: u32) -> Result<(), EngineError> {
        let dev = self.device_mut(id)?;
        let &index = dev.cq_by_num.get(&cqn).ok_or(EngineError::UnknownCq(cqn))?;
        let users = dev.cqs.get(index).map_or(0, |cq| cq.users);
        if users > 0 {
            return Err(EngineError::CqBusy { cqn, users });
        }
        dev.cq_by_num.remove(&cqn);
        dev.cqs.remove(index);
        Ok(())
    }

    /// A virtual QP in RESET with its rings.
    pub fn create_qp(&mut self, id: DeviceId, s: &QpSetup) -> Result<(), EngineError> {
        self.open_qp(id, s, Start::Fresh)
    }

    /// [`Engine::create_qp`], or for a QP a previous datapath ran
    /// ([`Start::Resumed`]: its rings continue from their headers; it is
    /// in RESET until vdev moves it on — to ERR, flushing what is posted,
    /// or back to INIT).
    pub fn open_qp(&mut self, id: DeviceId, s: &QpSetup, start: Start) -> Result<(), EngineError> {
        let serial = self.next_serial;
        let di = self.devices.index(&id).ok_or(EngineError::UnknownDevice)?;
        let dev = self.device_mut(id)?;
        let gid = dev.gid;
        if s.vqpn > 0x00ff_ffff {
            return Err(EngineError::Invalid("QP number exceeds 24 bits"));
        }
        let qp_type = QpType::try_from(s.qp_type).map_err(|_| EngineError::Invalid("QP type"))?;
        if dev.qps.contains_key(&s.vqpn) {
            return Err(EngineError::QpExists(s.vqpn));
        }
        // A (GID, QPN) names one QP: not one of another context of the
        // device either.
        if self.qp_at(&gid, s.vqpn).is_some() {
            return Err(EngineError::QpExists(s.vqpn));
        }
        let dev = self.device_mut(id)?;
        let db = s.db_index as usize;
        if s.db_index >= MAX_QPS || dev.qp_by_db.get(db).is_some_and(Option::is_some) {
            return Err(EngineError::Invalid("doorbell index taken or out of range"));
        }
        let cq = |num: u32| {
            dev.cq_by_num
                .get(&num)
                .copied()
                .ok_or(EngineError::UnknownCq(num))
        };
        let (send_cq, recv_cq) = (cq(s.send_cqn)?, cq(s.recv_cqn)?);
        let srq = match s.srqn {
            Some(n) => Some(
                dev.srq_by_num
                    .get(&n)
                    .copied()
                    .ok_or(EngineError::UnknownSrq(n))?,
            ),
            None => None,
        };
        let ring = |r: &vrdma_hostd_protocol::messages::WorkRing| {
            if !(MIN_WQE_STRIDE..=MAX_WQE_STRIDE).contains(&r.stride) {
                return Err(EngineError::Invalid("work ring stride"));
            }
            GuestRing::new(&dev.mem, r.gpa, r.depth, r.stride, MAX_RING_DEPTH)
        };
        let (sq, rq) = (ring(&s.sq)?, ring(&s.rq)?);
        let (sq_done, rq_done) = match start {
            Start::Fresh => {
                sq.reset_device_line();
                rq.reset_device_line();
                (0, 0)
            }
            // A header the guest scribbled on only misplaces its own
            // QP's work: every index is taken modulo the ring's depth.
            Start::Resumed => (
                sq.device_index().unwrap_or(0),
                rq.device_index().unwrap_or(0),
            ),
        };
        let pqp = s.vqpn as usize % dev.pqps.len().max(1);
        let qp = Qp {
            device: id,
            dev: di,
            gid,
            vqpn: s.vqpn,
            qp_type,
            qkey: 0,
            serial,
            pd: s.pd,
            pqp,
            state: QpState::Reset,
            lost: false,
            sq,
            rq,
            send_limits: SendLimits {
                max_sge: s.max_send_sge,
                max_inline: s.max_inline_data,
                sig_all: s.sq_sig_all,
            },
            recv_limits: RecvLimits {
                max_sge: s.max_recv_sge,
            },
            send_cq,
            recv_cq,
            conn: None,
            access: 0,
            sq_done,
            sq_seen: sq_done,
            head: Box::default(),
            has_head: false,
            sent: 0,
            recv_seq: 0,
            wait: None,
            waiting: false,
            queued: false,
            turn_left: 0,
            rq_done,
            rq_seen: rq_done,
            rq_head: Box::default(),
            has_rq_head: false,
            rq_taken: 0,
            srq,
            peer: None,
            issued: 0,
            remote: None,
            ud_psn: 0,
        };
        for index in [send_cq, recv_cq] {
            if let Some(cq) = dev.cqs.get_mut(index) {
                cq.users += 1;
            }
        }
        if let Some(s) = srq.and_then(|i| dev.srqs.get_mut(i)) {
            s.users += 1;
        }
        let qref = self.qps.insert(qp);
        let dev = self.device_mut(id)?;
        dev.qps.insert(s.vqpn, qref);
        if dev.qp_by_db.len() <= db {
            dev.qp_by_db.resize(db + 1, None);
        }
        dev.qp_by_db[db] = Some(qref);
        self.next_serial += 1;
        self.accounts.qp(id, s.vqpn, true);
        Ok(())
    }

    fn qp_ref(&self, id: DeviceId, vqpn: u32) -> Result<QpRef, EngineError> {
        self.qp_of(id, vqpn).ok_or(EngineError::UnknownQp(vqpn))
    }

    /// Applies a state transition vdev checked against the RC state table.
    /// Refused when the QP entered ERR on its own meanwhile (only RESET and
    /// ERR lead out of it).
    pub fn modify_qp(&mut self, id: DeviceId, m: &QpModify) -> Result<(), EngineError> {
        let qref = self.qp_ref(id, m.vqpn)?;
        let to = QpState::try_from(m.state).map_err(|_| EngineError::Invalid("QP state"))?;
        if let Some(c) = &m.connection {
            if c.dest_qpn > 0x00ff_ffff {
                return Err(EngineError::Invalid(
                    "destination QP number exceeds 24 bits",
                ));
            }
            if c.access & !access::QP_SUPPORTED != 0 {
                return Err(EngineError::Invalid("unknown QP access flags"));
            }
            if c.rnr_retry > 7 || c.retry_cnt > 7 || c.min_rnr_timer > 31 || c.timeout > 31 {
                return Err(EngineError::Invalid(
                    "retry counts, RNR timer or timeout out of range",
                ));
            }
            if c.sq_psn > 0x00ff_ffff || c.rq_psn > 0x00ff_ffff {
                return Err(EngineError::Invalid("PSN exceeds 24 bits"));
            }
            if !matches!(c.path_mtu, 256 | 512 | 1024 | 2048 | 4096) {
                return Err(EngineError::Invalid("path MTU is not 256-4096 bytes"));
            }
            if c.flow_label > 0x000f_ffff {
                return Err(EngineError::Invalid("flow label exceeds 20 bits"));
            }
        }
        if m.qkey.is_some_and(|k| k & QKEY_CONTROLLED != 0) {
            // vdev refuses it first; a compromised one gets the same.
            return Err(EngineError::Privileged(
                "a Q_Key with the high bit set is reserved to privileged QPs",
            ));
        }
        if m.access.is_some_and(|a| a & !access::QP_SUPPORTED != 0) {
            return Err(EngineError::Invalid("unknown QP access flags"));
        }
        let qp = self
            .qps
            .get_mut(qref)
            .ok_or(EngineError::UnknownQp(m.vqpn))?;
        if qp.state == QpState::Err && !matches!(to, QpState::Reset | QpState::Err) {
            return Err(EngineError::Invalid("the QP is in the error state"));
        }
        if qp.qp_type == QpType::Ud && m.connection.is_some() {
            return Err(EngineError::Invalid("a UD QP has no connection"));
        }
        let Some(qp) = self.qps.get_mut(qref) else {
            return Err(EngineError::UnknownQp(m.vqpn));
        };
        if let Some(qkey) = m.qkey {
            qp.qkey = qkey;
        }
        if let Some(c) = m.connection {
            qp.conn = Some(c);
            qp.access = c.access;
            qp.peer = None;
            // A peer on another host is served by the RC transport over
            // the wire; one of this host by the local path.
            let remote = self.wire_connection(qref, &c);
            self.connect_remote(qref, remote);
        }
        let Some(qp) = self.qps.get_mut(qref) else {
            return Err(EngineError::UnknownQp(m.vqpn));
        };
        if let Some(a) = m.access {
            qp.access = a;
        }
        match to {
            QpState::Reset => self.reset_qp(qref),
            QpState::Err => self.fail_qp(qref, false, "moved to ERR by its driver"),
            _ => {
                if let Some(qp) = self.qps.get_mut(qref) {
                    qp.state = to;
                }
                // Work may have been posted before the QP could send.
                self.activate(qref, Instant::now());
            }
        }
        Ok(())
    }

    /// Back to RESET: whatever was posted is discarded (no completions),
    /// and the rings start over at the driver's producer indices.
    fn reset_qp(&mut self, qref: QpRef) {
        self.unqueue(qref);
        let Some(qp) = self.qps.get_mut(qref) else {
            return;
        };
        qp.state = QpState::Reset;
        qp.conn = None;
        qp.access = 0;
        qp.peer = None;
        qp.wait = None;
        qp.waiting = false;
        qp.has_head = false;
        qp.sent = 0;
        // What was on the wire is forgotten with the connection: the
        // slots it held are the driver's again (the rings restart below).
        qp.issued = 0;
        qp.remote = None;
        if qp.has_rq_head {
            qp.has_rq_head = false;
        }
        // The receive a segmented SEND was filling is gone.
        qp.rq_taken += 1;
        if !qp.lost {
            qp.sq_done = qp.sq.driver_index().unwrap_or(qp.sq_done);
            qp.rq_done = qp.rq.driver_index().unwrap_or(qp.rq_done);
            qp.sq_seen = qp.sq_done;
            qp.rq_seen = qp.rq_done;
            qp.sq.restart_device_line(qp.sq_done);
            qp.rq.restart_device_line(qp.rq_done);
        }
        self.flushing.retain(|&q| q != qref);
    }

    /// Takes QP `qref` off its pQP (ring and staged slot).
    fn unqueue(&mut self, qref: QpRef) {
        let Some(qp) = self.qps.get_mut(qref) else {
            return;
        };
        qp.queued = false;
        let (device, di, pos) = (qp.device, qp.dev, qp.pqp);
        let Some(p) = self.pqp_mut(di, pos) else {
            return;
        };
        p.ring.retain(|&q| q != qref);
        if p.staged == Some(qref) {
            p.staged = None;
            let number = p.number;
            self.sched.unstage((device, number));
            self.dirty.push((di, pos));
        }
    }

    /// The state of QP `vqpn` as the datapath sees it.
    pub fn query_qp(&self, id: DeviceId, vqpn: u32) -> Result<QpState, EngineError> {
        let qref = self.qp_ref(id, vqpn)?;
        self.qps
            .get(qref)
            .map(|qp| qp.state)
            .ok_or(EngineError::UnknownQp(vqpn))
    }

    /// Destroys QP `vqpn`: nothing of it runs or is touched afterwards.
    pub fn destroy_qp(&mut self, id: DeviceId, vqpn: u32) -> Result<(), EngineError> {
        let qref = self.qp_ref(id, vqpn)?;
        self.unqueue(qref);
        self.flushing.retain(|&q| q != qref);
        self.remember_closed(qref, vqpn);
        let Some(qp) = self.qps.remove(qref) else {
            return Err(EngineError::UnknownQp(vqpn));
        };
        if let Some(dev) = self.devices.get_mut(&id) {
            dev.qps.remove(&vqpn);
            for slot in dev.qp_by_db.iter_mut() {
                if *slot == Some(qref) {
                    *slot = None;
                }
            }
            for index in [qp.send_cq, qp.recv_cq] {
                if let Some(cq) = dev.cqs.get_mut(index) {
                    cq.users = cq.users.saturating_sub(1);
                }
            }
            if let Some(s) = qp.srq.and_then(|i| dev.srqs.get_mut(i)) {
                s.users = s.users.saturating_sub(1);
            }
        }
        self.accounts.qp(id, vqpn, false);
        Ok(())
    }

    /// Applies tenants' classes, weights and rates at once (policy reload).
    pub fn configure_tenants(&mut self, tenants: &[TenantPolicy], now: Instant) {
        for t in tenants {
            self.sched.configure(t, now);
        }
        for dev in self.devices.values_mut() {
            dev.rank = self.sched.rank(dev.id).unwrap_or(u8::MAX);
            if let Some(t) = tenants.iter().find(|t| *t.name == *dev.tenant) {
                dev.policy = t.clone();
            }
        }
    }

    /// The tenant a device serves.
    pub fn tenant_of(&self, id: DeviceId) -> Option<&str> {
        self.devices.get(&id).map(|d| &*d.tenant)
    }

    /// Whether a device is connected.
    pub fn has_device(&self, id: DeviceId) -> bool {
        self.devices.contains_key(&id)
    }
}
