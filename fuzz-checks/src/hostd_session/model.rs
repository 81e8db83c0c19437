//! What the fuzzed connection holds, as hostd's answers established it,
//! and what hostd must answer to the next request: the protocol's rules
//! (hostd-protocol/src/messages.rs) and hostd's checks, in hostd's order,
//! written from the protocol's side.

use std::collections::{BTreeMap, BTreeSet};

use vrdma_hostd_protocol::messages::{
    MrRegistration, MrSegment, QpModify, QpSetup, Request, WorkRing,
};
use vrdma_spec::control::MAX_MR_PIECES;
use vrdma_spec::gid::loopback_gid;
use vrdma_spec::limits::{MAX_CQ_DEPTH, MAX_QPS, MAX_RING_DEPTH, MAX_WQE_STRIDE};
use vrdma_spec::ring::{doorbell, CQE_SIZE, EVENT_SIZE, RING_ALIGN, RING_HEADER_SIZE};
use vrdma_spec::verbs::{access, QpState};
use vrdma_tenant_policy::Limits;

use super::{
    Fd, ALPHA, ALPHA_MAX_MR, ALPHA_MAX_MR_BYTES, ALPHA_MAX_TOTAL_MR_BYTES, ALPHA_QUEUES, BETA,
    BETA_DEVICE, DELTA, DELTA_DEVICE, GAMMA, MEMFD_SIZES,
};
use vrdma_hostd::stats::Usage;
use vrdma_hostd_protocol::messages::PROTOCOL_VERSION;

/// Memory slots a device of the session's tenant may have: hostd's
/// `slot_limit` of the policy's `max_mr` (6, `super::POLICY`).
fn max_slots() -> u32 {
    u32::try_from(vrdma_hostd::engine::guest::slot_limit(6)).unwrap_or(u32::MAX)
}
/// Completion vectors of a device (hostd's `MAX_VECTORS`).
const MAX_VECTORS: u32 = 256;
/// Smallest stride of a work ring.
const MIN_WQE_STRIDE: u32 = 64;

/// What a request's answer must be.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Expect {
    Welcome,
    Ok,
    /// `MrKeys`.
    Keys,
    /// `QpState` with this state, or ERR when `or_err` (a QP whose rings
    /// may have run work can enter ERR on its own).
    State {
        state: QpState,
        or_err: bool,
    },
    /// `Ok`, or `EINVAL` when the QP entered ERR on its own.
    OkOrErr,
    /// Refused with this errno.
    Refuse(i32),
    /// Either (a Hello the model does not decide).
    Either,
}

/// One memory slot: `[gpa, gpa + len)` is bytes `file_offset..` of the
/// input's sealed memfd `file`.
#[derive(Debug, Clone, Copy)]
pub(super) struct Slot {
    pub gpa: u64,
    pub len: u64,
    pub file: usize,
    pub file_offset: u64,
}

/// A place in one slot: the slot and the bytes' position in their memfd.
type Place = (u32, (usize, u64));

/// A virtual QP.
#[derive(Debug, Clone, Copy)]
pub(super) struct Qp {
    pub state: QpState,
    pub db_index: u32,
    pub send_cqn: u32,
    pub recv_cqn: u32,
    /// The slots of its send and receive rings.
    pub slots: [u32; 2],
    /// Where in their memfds its rings' headers are.
    pub heads: [(usize, u64); 2],
}

/// The connection as hostd must see it.
#[derive(Debug, Default)]
pub(super) struct Model {
    /// After a Welcome: the device's LID.
    pub greeted: Option<u16>,
    pub slots: BTreeMap<u32, Slot>,
    /// MRs: lkey → (rkey, bytes).
    pub mrs: BTreeMap<u32, (u32, u64)>,
    /// The doorbell page was set (and not reset since).
    pub doorbell: bool,
    /// Vectors with an event ring.
    pub eqs: BTreeSet<u32>,
    /// CQs: number → QPs using it (a QP counts twice if both its queues
    /// complete there).
    pub cqs: BTreeMap<u32, u32>,
    pub qps: BTreeMap<u32, Qp>,
    /// Where in the memfds a doorbell page was set during this input:
    /// hostd writes NEED_KICK (1) into its first word when its datapath
    /// goes to sleep.
    pub kick_words: BTreeSet<(usize, u64)>,
    /// A work ring's header lay on such a word: its producer index may read
    /// 1, and the QP may have run whatever its ring held — completions,
    /// events and data anywhere in its memory, so from then on any QP of
    /// the connection may enter ERR on its own. (The vdev writes no ring,
    /// so nothing else makes a QP run.)
    pub wild: bool,
}

fn refuse(errno: i32) -> Expect {
    Expect::Refuse(errno)
}

fn known_state(state: u8) -> Option<QpState> {
    QpState::try_from(state).ok()
}

impl Model {
    pub fn mr_bytes(&self) -> u64 {
        self.mrs.values().map(|&(_, len)| len).sum()
    }

    /// Every key of the connection's MRs.
    pub fn keys(&self) -> impl Iterator<Item = u32> + '_ {
        self.mrs.iter().flat_map(|(&l, &(r, _))| [l, r])
    }

    /// Whether `seg` lies inside memory this connection added.
    pub fn inside(&self, seg: &MrSegment) -> bool {
        self.slots.get(&seg.slot).is_some_and(|s| {
            seg.len > 0 && seg.offset.checked_add(seg.len).is_some_and(|e| e <= s.len)
        })
    }

    /// alpha's usage as hostd must report it.
    pub fn usage(&self) -> Usage {
        let greeted = u64::from(self.greeted.is_some());
        Usage {
            devices: greeted,
            physical_queues: greeted * ALPHA_QUEUES as u64,
            mr_bytes: self.mr_bytes(),
            mrs: self.mrs.len() as u64,
            qps: self.qps.len() as u64,
        }
    }

    /// `[gpa, gpa + len)` in one slot, `gpa` a multiple of `align`: the
    /// first slot by number that holds it, as hostd searches.
    fn place(&self, gpa: u64, len: u64, align: u64) -> Option<Place> {
        if len == 0 || !gpa.is_multiple_of(align) {
            return None;
        }
        let end = gpa.checked_add(len)?;
        self.slots.iter().find_map(|(&n, s)| {
            let inside = gpa >= s.gpa && end <= s.gpa + s.len;
            inside.then(|| (n, (s.file, s.file_offset + (gpa - s.gpa))))
        })
    }

    /// A ring of `depth` entries (at most `max`) of `stride` bytes at `gpa`.
    fn ring(&self, gpa: u64, depth: u32, stride: u32, max: u32) -> Option<Place> {
        if !depth.is_power_of_two() || depth > max || !stride.is_power_of_two() {
            return None;
        }
        let bytes = RING_HEADER_SIZE as u64 + u64::from(depth) * u64::from(stride);
        self.place(gpa, bytes, RING_ALIGN)
    }

    fn work_ring(&self, r: &WorkRing) -> Option<Place> {
        if !(MIN_WQE_STRIDE..=MAX_WQE_STRIDE).contains(&r.stride) {
            return None;
        }
        self.ring(r.gpa, r.depth, r.stride, MAX_RING_DEPTH)
    }

    /// hostd's answer to `request` carrying `fds`, given `beta_lid` and
    /// `delta_lid` (the other connected devices) and `page` (the page size).
    pub fn predict(&self, request: &Request, fds: &[Fd], lids: (u16, u16), page: u64) -> Expect {
        let takes_fd = matches!(
            request,
            Request::AddMemory { .. } | Request::SetDoorbell { .. } | Request::CreateEq { .. }
        );
        if !takes_fd && !fds.is_empty() {
            return refuse(libc::EINVAL);
        }
        // The generator greets with Hello only: a second context of a
        // device is hostd's tests' (hostd/tests/hostd.rs).
        if let Request::Hello {
            version,
            tenant,
            device,
        }
        | Request::OpenContext {
            version,
            tenant,
            device,
        } = request
        {
            return self.predict_hello(*version, tenant, device);
        }
        let Some(lid) = self.greeted else {
            return refuse(libc::EPROTO);
        };
        let one_eventfd = matches!(fds, [Fd::Eventfd]);
        match request {
            // Never generated: a journal is not answered, and adoption
            // needs an orphan, which one session never leaves.
            Request::Hello { .. }
            | Request::OpenContext { .. }
            | Request::Journal(_)
            | Request::Release
            | Request::Adopt { .. }
            | Request::RenewNotifiers { .. }
            | Request::TakeRecords { .. } => Expect::Either,
            // Nor a push socket: its answer carries a descriptor, and what
            // comes on it has its own tests (hostd's engine, the GSI test).
            Request::GsiPush => Expect::Either,
            // This hostd took nothing over: no token is known.
            Request::ResumeHandover { .. } => refuse(libc::ENOENT),
            &Request::AddMemory {
                slot,
                gpa,
                len,
                file_offset,
            } => self.predict_memory(slot, gpa, len, file_offset, fds, page),
            Request::RemoveMemory { slot } => self.exists(self.slots.contains_key(slot)),
            Request::RegisterMr(mr) => self.predict_mr(mr),
            Request::DeregisterMr { lkey } => self.exists(self.mrs.contains_key(lkey)),
            Request::SetDoorbell { gpa } => {
                if !one_eventfd {
                    refuse(libc::EINVAL)
                } else if self.doorbell {
                    refuse(libc::EEXIST)
                } else if self
                    .place(*gpa, doorbell::PAGE_SIZE, doorbell::PAGE_SIZE)
                    .is_none()
                {
                    refuse(libc::EINVAL)
                } else {
                    Expect::Ok
                }
            }
            Request::CreateEq { vector, gpa, depth } => {
                let valid = one_eventfd && *vector < MAX_VECTORS;
                let exists = self.eqs.contains(vector);
                self.predict_ring(valid, exists, *gpa, (*depth, MAX_RING_DEPTH), EVENT_SIZE)
            }
            &Request::CreateCq {
                cqn,
                gpa,
                depth,
                vector,
            } => {
                let exists = self.cqs.contains_key(&cqn);
                self.predict_ring(
                    vector < MAX_VECTORS,
                    exists,
                    gpa,
                    (depth, MAX_CQ_DEPTH),
                    CQE_SIZE,
                )
            }
            Request::DestroyCq { cqn } => match self.cqs.get(cqn) {
                None => refuse(libc::ENOENT),
                Some(&users) if users > 0 => refuse(libc::EBUSY),
                Some(_) => Expect::Ok,
            },
            Request::CreateQp(setup) => self.predict_qp(setup),
            Request::ModifyQp(m) => self.predict_modify(m, lid, lids),
            Request::QueryQp { vqpn } => match self.qps.get(vqpn) {
                None => refuse(libc::ENOENT),
                Some(qp) => Expect::State {
                    state: qp.state,
                    or_err: self.may_fail(qp),
                },
            },
            Request::DestroyQp { vqpn } => self.exists(self.qps.contains_key(vqpn)),
            // The generator makes no SRQ or AH requests (nor QPs on an SRQ,
            // nor UC or UD QPs); the engine's rules for them have their own
            // tests (hostd engine tests).
            Request::CreateSrq(_)
            | Request::ModifySrq { .. }
            | Request::QuerySrq { .. }
            | Request::DestroySrq { .. }
            | Request::CreateAh(_)
            | Request::DestroyAh { .. } => Expect::Either,
            // Nor requests that bring objects back to a restarted hostd
            // (hostd's engine tests and vdev's reconnect tests have them).
            Request::ResumeEq { .. }
            | Request::ResumeCq { .. }
            | Request::ResumeQp(_)
            | Request::ResumeSrq(_)
            | Request::RestoreMr { .. } => Expect::Either,
            // Nor a QP's transitions in one request (each is a ModifyQp,
            // which it makes).
            Request::ModifyQps(_) => Expect::Either,
            Request::ResetDevice => Expect::Ok,
            Request::GsiNotify if one_eventfd => Expect::Ok,
            Request::GsiNotify => refuse(libc::EINVAL),
            // Whether a MAD goes depends on the GIDs the host knows; what
            // QP1 carries has its own tests (hostd's engine and chaos).
            Request::SendMad(_) | Request::TakeMads { .. } => Expect::Either,
            // Reachability depends on the GIDs and directory the host has.
            Request::ResolveGid { .. } => Expect::Either,
            Request::QuotaRejected { quota } => {
                let limits = serde_json::to_value(Limits::default()).ok();
                let known = limits
                    .as_ref()
                    .and_then(|v| v.as_object())
                    .is_some_and(|keys| keys.contains_key(quota));
                if known {
                    Expect::Ok
                } else {
                    refuse(libc::EINVAL)
                }
            }
        }
    }

    /// A memory slot: the memfd's range (`EINVAL`), the slot number
    /// (`ENOMEM`), the guest range (`EINVAL`), then whether the slot is
    /// taken (`EEXIST`).
    fn predict_memory(
        &self,
        slot: u32,
        gpa: u64,
        len: u64,
        file_offset: u64,
        fds: &[Fd],
        page: u64,
    ) -> Expect {
        let [Fd::Sealed(i)] = fds else {
            return refuse(libc::EINVAL);
        };
        let maps = len > 0
            && file_offset.is_multiple_of(page)
            && file_offset
                .checked_add(len)
                .is_some_and(|end| end <= MEMFD_SIZES[*i]);
        if !maps {
            refuse(libc::EINVAL)
        } else if slot >= max_slots() {
            refuse(libc::ENOMEM)
        } else if gpa.checked_add(len).is_none() {
            refuse(libc::EINVAL)
        } else if self.slots.contains_key(&slot) {
            refuse(libc::EEXIST)
        } else {
            Expect::Ok
        }
    }

    /// An event ring or CQ: its arguments (`EINVAL`), then whether it
    /// exists (`EEXIST`), then its ring of `depth` entries (at most `max`)
    /// of `entry` bytes at `gpa` (`EINVAL`).
    fn predict_ring(
        &self,
        valid: bool,
        exists: bool,
        gpa: u64,
        (depth, max): (u32, u32),
        entry: usize,
    ) -> Expect {
        if !valid {
            refuse(libc::EINVAL)
        } else if exists {
            refuse(libc::EEXIST)
        } else if self.ring(gpa, depth, entry as u32, max).is_none() {
            refuse(libc::EINVAL)
        } else {
            Expect::Ok
        }
    }

    fn exists(&self, found: bool) -> Expect {
        if found {
            Expect::Ok
        } else {
            refuse(libc::ENOENT)
        }
    }

    fn predict_hello(&self, version: u32, tenant: &str, device: &str) -> Expect {
        let device_ok = (1..=64).contains(&device.len())
            && device
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"_.-".contains(&b));
        if self.greeted.is_some() || version != PROTOCOL_VERSION {
            return refuse(libc::EPROTO);
        }
        if !device_ok {
            return refuse(libc::EINVAL);
        }
        match tenant {
            ALPHA => Expect::Welcome,
            GAMMA => refuse(libc::EPERM),
            BETA if device == BETA_DEVICE => refuse(libc::EBUSY),
            DELTA if device == DELTA_DEVICE => refuse(libc::EBUSY),
            BETA | DELTA => Expect::Either,
            _ => refuse(libc::EACCES),
        }
    }

    /// The quota check first (`ENOMEM`), then the key table's checks.
    fn predict_mr(&self, mr: &MrRegistration) -> Expect {
        let quota = mr.len <= ALPHA_MAX_MR_BYTES
            && self.mrs.len() < ALPHA_MAX_MR
            && self.mr_bytes().saturating_add(mr.len) <= ALPHA_MAX_TOTAL_MR_BYTES;
        if !quota {
            return refuse(libc::ENOMEM);
        }
        let remote = access::REMOTE_WRITE | access::REMOTE_ATOMIC;
        if mr.access & !access::MR_KNOWN != 0
            || (mr.access & remote != 0 && mr.access & access::LOCAL_WRITE == 0)
            || mr.iova.checked_add(mr.len).is_none()
            || mr.segments.len() > MAX_MR_PIECES
        {
            return refuse(libc::EINVAL);
        }
        let mut sum = 0u64;
        for seg in &mr.segments {
            if !self.slots.contains_key(&seg.slot) {
                return refuse(libc::ENOENT);
            }
            if !self.inside(seg) {
                return refuse(libc::EINVAL);
            }
            sum += seg.len;
        }
        if sum != mr.len {
            return refuse(libc::EINVAL);
        }
        Expect::Keys
    }

    fn predict_qp(&self, s: &QpSetup) -> Expect {
        let db_taken = self.qps.values().any(|q| q.db_index == s.db_index);
        if s.vqpn > 0x00ff_ffff {
            refuse(libc::EINVAL)
        } else if self.qps.contains_key(&s.vqpn) {
            refuse(libc::EEXIST)
        } else if s.db_index >= MAX_QPS || db_taken {
            refuse(libc::EINVAL)
        } else if !self.cqs.contains_key(&s.send_cqn) || !self.cqs.contains_key(&s.recv_cqn) {
            refuse(libc::ENOENT)
        } else if self.work_ring(&s.sq).is_none() || self.work_ring(&s.rq).is_none() {
            refuse(libc::EINVAL)
        } else {
            Expect::Ok
        }
    }

    /// Reachability (the server), then the engine's checks.
    fn predict_modify(&self, m: &QpModify, lid: u16, (beta, delta): (u16, u16)) -> Expect {
        if let Some(c) = &m.connection {
            // The ports are Ethernet: a peer named by LID is no peer.
            if c.dlid.is_some() {
                return refuse(libc::EINVAL);
            }
            // Without a fabric a device's GID is derived from its LID.
            if c.dgid == loopback_gid(delta) {
                return refuse(libc::EACCES);
            }
            if c.dgid != loopback_gid(lid) && c.dgid != loopback_gid(beta) {
                return refuse(libc::ENOENT);
            }
        }
        let Some(qp) = self.qps.get(&m.vqpn) else {
            return refuse(libc::ENOENT);
        };
        let Some(to) = known_state(m.state) else {
            return refuse(libc::EINVAL);
        };
        if let Some(c) = &m.connection {
            let valid = c.dest_qpn <= 0x00ff_ffff
                && c.access & !access::QP_SUPPORTED == 0
                && c.rnr_retry <= 7
                && c.retry_cnt <= 7
                && c.min_rnr_timer <= 31
                && c.timeout <= 31
                && c.sq_psn <= 0x00ff_ffff
                && c.rq_psn <= 0x00ff_ffff
                && [256, 512, 1024, 2048, 4096].contains(&c.path_mtu)
                && c.flow_label <= 0x000f_ffff;
            if !valid {
                return refuse(libc::EINVAL);
            }
        }
        if m.access.is_some_and(|a| a & !access::QP_SUPPORTED != 0) {
            return refuse(libc::EINVAL);
        }
        let leaves_err = !matches!(to, QpState::Reset | QpState::Err);
        if qp.state == QpState::Err && leaves_err {
            refuse(libc::EINVAL)
        } else if leaves_err && self.may_fail(qp) {
            Expect::OkOrErr
        } else {
            Expect::Ok
        }
    }

    /// Whether `qp` may have entered ERR on its own.
    fn may_fail(&self, qp: &Qp) -> bool {
        self.wild && !matches!(qp.state, QpState::Reset | QpState::Err)
    }

    /// Applies an accepted request.
    pub fn apply(&mut self, request: &Request, fds: &[Fd], keys: Option<(u32, u32)>) {
        match request {
            Request::Hello { .. }
            | Request::OpenContext { .. }
            | Request::ResumeHandover { .. }
            | Request::QuotaRejected { .. }
            | Request::QueryQp { .. }
            | Request::ModifyQps(_)
            | Request::ResumeEq { .. }
            | Request::ResumeCq { .. }
            | Request::ResumeQp(_)
            | Request::ResumeSrq(_)
            | Request::RestoreMr { .. }
            | Request::CreateSrq(_)
            | Request::ModifySrq { .. }
            | Request::QuerySrq { .. }
            | Request::DestroySrq { .. }
            | Request::CreateAh(_)
            | Request::DestroyAh { .. }
            | Request::GsiNotify
            | Request::GsiPush
            | Request::SendMad(_)
            | Request::TakeMads { .. }
            | Request::Journal(_)
            | Request::Release
            | Request::Adopt { .. }
            | Request::RenewNotifiers { .. }
            | Request::TakeRecords { .. }
            | Request::ResolveGid { .. } => {}
            &Request::AddMemory {
                slot,
                gpa,
                len,
                file_offset,
            } => {
                if let [Fd::Sealed(file)] = *fds {
                    let s = Slot {
                        gpa,
                        len,
                        file,
                        file_offset,
                    };
                    self.slots.insert(slot, s);
                }
            }
            Request::RemoveMemory { slot } => {
                // Its MRs stay registered (revoked) until deregistered; QPs
                // with a ring there are lost (ERR); CQs, event rings and the
                // doorbell page there take nothing more but stay.
                self.slots.remove(slot);
                for qp in self.qps.values_mut() {
                    if qp.slots.contains(slot) {
                        qp.state = QpState::Err;
                    }
                }
            }
            Request::RegisterMr(mr) => {
                if let Some((lkey, rkey)) = keys {
                    self.mrs.insert(lkey, (rkey, mr.len));
                }
            }
            Request::DeregisterMr { lkey } => {
                self.mrs.remove(lkey);
            }
            Request::SetDoorbell { gpa } => {
                self.doorbell = true;
                if let Some((_, at)) = self.place(*gpa, doorbell::PAGE_SIZE, doorbell::PAGE_SIZE) {
                    self.kick_words.insert(at);
                    self.wild |= self.qps.values().any(|q| q.heads.contains(&at));
                }
            }
            Request::CreateEq { vector, .. } => {
                self.eqs.insert(*vector);
            }
            Request::CreateCq { cqn, .. } => {
                self.cqs.insert(*cqn, 0);
            }
            Request::DestroyCq { cqn } => {
                self.cqs.remove(cqn);
            }
            Request::CreateQp(s) => {
                let (Some(sq), Some(rq)) = (self.work_ring(&s.sq), self.work_ring(&s.rq)) else {
                    return;
                };
                let qp = Qp {
                    state: QpState::Reset,
                    db_index: s.db_index,
                    send_cqn: s.send_cqn,
                    recv_cqn: s.recv_cqn,
                    slots: [sq.0, rq.0],
                    heads: [sq.1, rq.1],
                };
                self.wild |= qp.heads.iter().any(|h| self.kick_words.contains(h));
                for cqn in [s.send_cqn, s.recv_cqn] {
                    *self.cqs.entry(cqn).or_insert(0) += 1;
                }
                self.qps.insert(s.vqpn, qp);
            }
            Request::ModifyQp(m) => {
                if let (Some(qp), Some(to)) = (self.qps.get_mut(&m.vqpn), known_state(m.state)) {
                    qp.state = to;
                }
            }
            Request::DestroyQp { vqpn } => {
                if let Some(qp) = self.qps.remove(vqpn) {
                    for cqn in [qp.send_cqn, qp.recv_cqn] {
                        if let Some(users) = self.cqs.get_mut(&cqn) {
                            *users -= 1;
                        }
                    }
                }
            }
            Request::ResetDevice => {
                self.mrs.clear();
                self.qps.clear();
                self.cqs.clear();
                self.eqs.clear();
                self.doorbell = false;
            }
        }
    }

    /// hostd refused a transition of `vqpn` as a QP that entered ERR on its
    /// own (an [`Expect::OkOrErr`] refused), or reported it in ERR.
    pub fn failed(&mut self, vqpn: u32) {
        if let Some(qp) = self.qps.get_mut(&vqpn) {
            qp.state = QpState::Err;
        }
    }
}
