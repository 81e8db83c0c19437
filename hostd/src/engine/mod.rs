//! The engine: hostd's RDMA NIC in software. It reads every tenant's send
//! and receive rings in guest memory itself, as a NIC reads a VM's rings by
//! DMA, and executes RC work between QPs: keys checked in its key table,
//! bytes moved mapping to mapping, completions and events written into the
//! guest's rings.
//!
//! The path of one WQE through the engine (docs/architecture.md walks it
//! with the driver's side):
//!
//! 1. [`Engine::round`] takes the doorbells of the devices a datapath
//!    thread serves ([`guest::DoorbellPage::take`]); a QP whose bit was set
//!    joins the ring of its physical QP (pQP) — its device's virtual QPs
//!    are multiplexed onto a few pQPs (vQP `n` on pQP `n mod k`).
//! 2. Each pQP with work stages one head WQE: the next WQE of the first QP
//!    in its ring, read once from guest memory by [`wqe::read_send`] into
//!    the QP's own copy, and known to the [`Scheduler`] by its kind and
//!    length.
//! 3. The scheduler picks which pQP runs (class, weight, rate, port), and
//!    [`rc`] executes its head: keys through [`keys::KeyTable`], the copy
//!    by [`keys::copy`], the receive of a SEND read from the responder's
//!    ring, then the completions written by [`completion`].
//!
//! Everything here runs under one lock (the datapath's), held by a datapath
//! thread for one round and by the control path for one request, which is
//! what makes "once the response is sent, no WQE touches it" hold for
//! deregistration, memory removal and QP destruction.
//!
//! The hot path allocates nothing: WQE copies live in buffers each QP owns,
//! and the engine's work lists keep their capacity.

mod control;
pub mod gsi;
pub mod handover;
pub use control::Start;
pub mod guest;
pub mod keys;
mod rc;
mod srq;
#[cfg(any(test, feature = "test-support"))]
pub mod testing;
pub mod ud;
pub mod wire;
pub mod wqe;

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use vmm_sys_util::eventfd::EventFd;
use vrdma_spec::ring::{event_kind, Cqe, DEVICE_FLAG_ERROR};
use vrdma_spec::verbs::{QpState, WcOpcode, WcStatus};

use crate::gids::Gid;
use crate::ids::{IdMap, PickedMap, Slab};
use crate::scheduler::{Head, OpKind, Pick, QueueId, Scheduler};
use crate::stats::Accounts;
use guest::{Cq, EventRing};
use guest::{DoorbellPage, GuestMemory};
pub use rc::{CompletionCounts, KINDS};
use rc::{Qp, QpRef, WaitKind};
use wqe::{Malformed, SendWork};

/// hostd's handle of one connected vdev. Never reused while hostd runs, so a
/// stale handle can only miss.
pub type DeviceId = u64;

/// Most completion vectors (event rings) of one device.
pub const MAX_VECTORS: u32 = 256;
/// WQEs one round runs at most (then the thread looks at doorbells again).
pub const ROUND_OPS: usize = 256;
/// Bytes one round moves at most: at ~20 GB/s a round is ~25 µs of
/// copying, which bounds how long new work of a higher class waits for the
/// scheduler to see it.
pub const ROUND_BYTES: u64 = 512 * 1024;
/// Bytes of a long message moved per step while a higher class is busy
/// (a NIC's arbiter lets a higher class in between packets).
pub const SEGMENT: u64 = 16 * 1024;
/// Bytes of a long message moved per step otherwise: long enough that the
/// steps cost nothing, short enough that the thread looks at its doorbells
/// every few tens of microseconds.
pub const STEP: u64 = 256 * 1024;
/// WQEs a QP runs before the next QP of its pQP gets a turn.
pub const QP_TURN: u32 = 16;
/// WQEs of an errored QP flushed per round (the rest in the next rounds).
pub const FLUSH_BATCH: u32 = 256;

/// Why the engine refused a control request; each maps to an errno.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EngineError {
    #[error("Unknown device")]
    UnknownDevice,
    #[error("Memory slot {0} already exists")]
    SlotExists(u32),
    #[error("Unknown memory slot {0}")]
    UnknownSlot(u32),
    #[error("Unknown key {0:#x}")]
    UnknownKey(u32),
    #[error("Key {0:#x} names another region now")]
    KeyTaken(u32),
    #[error("Unknown QP {0}")]
    UnknownQp(u32),
    #[error("QP {0} already exists")]
    QpExists(u32),
    #[error("Unknown CQ {0}")]
    UnknownCq(u32),
    #[error("Unknown SRQ {0}")]
    UnknownSrq(u32),
    #[error("The {0} already exists")]
    Exists(&'static str),
    #[error("CQ {cqn} is used by {users} QPs")]
    CqBusy { cqn: u32, users: u32 },
    #[error("The {0} is used by {1} QPs")]
    Busy(&'static str, u32),
    #[error("Invalid argument: {0}")]
    Invalid(&'static str),
    #[error("Too many {0}")]
    Limit(&'static str),
    #[error(
        "Memory slot {slot} is past the device's {limit} (the tenant's max_mr and {} for \
         rings and guest RAM): too many memory regions over scattered memory",
        guest::SLOTS_BESIDE_MRS
    )]
    SlotLimit { slot: u32, limit: usize },
    #[error("Not supported: {0}")]
    Unsupported(&'static str),
    #[error("Not permitted: {0}")]
    Privileged(&'static str),
}

impl EngineError {
    /// The Linux errno vdev gets for this refusal.
    pub fn errno(&self) -> i32 {
        match self {
            EngineError::UnknownDevice
            | EngineError::UnknownSlot(_)
            | EngineError::UnknownKey(_)
            | EngineError::UnknownQp(_)
            | EngineError::UnknownCq(_)
            | EngineError::UnknownSrq(_) => libc::ENOENT,
            EngineError::SlotExists(_) | EngineError::QpExists(_) | EngineError::Exists(_) => {
                libc::EEXIST
            }
            EngineError::CqBusy { .. } | EngineError::Busy(..) | EngineError::KeyTaken(_) => {
                libc::EBUSY
            }
            EngineError::Invalid(_) => libc::EINVAL,
            EngineError::Limit(_) => libc::ENOSPC,
            // One memory region too many (policy.md: ENOMEM for the N+1th).
            EngineError::SlotLimit { .. } => libc::ENOMEM,
            EngineError::Unsupported(_) => libc::EOPNOTSUPP,
            EngineError::Privileged(_) => libc::EPERM,
        }
    }
}

/// A device's doorbell page and the eventfd its driver kicks.
#[derive(Debug)]
pub struct Doorbell {
    page: DoorbellPage,
    kick: EventFd,
    /// Unique over the engine's life: a datapath thread that sleeps on
    /// `kick` knows by it whether this is still the doorbell it watches.
    serial: u64,
    /// Its memory was removed.
    lost: bool,
}

/// A physical QP of a device: the virtual QPs on it that have work, and
/// the one whose head WQE is staged.
#[derive(Debug, Default)]
struct Pqp {
    number: u32,
    ring: VecDeque<QpRef>,
    staged: Option<QpRef>,
}

/// How a device's port is addressed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Address {
    /// Its GID: what connections towards it name.
    pub gid: Gid,
    /// Its port's LID on an InfiniBand port, 0 on an Ethernet port (which
    /// has none): what its UD receivers see as the sender's `slid`.
    pub lid: u16,
}

/// A connected device (one vdev, one tenant VM).
#[derive(Debug)]
pub struct Device {
    pub id: DeviceId,
    pub tenant: Arc<str>,
    /// Its GID: what connections towards it name.
    pub gid: Gid,
    /// Its port's LID (0 on Ethernet): [`Address::lid`].
    pub lid: u16,
    mem: GuestMemory,
    doorbell: Option<Doorbell>,
    eqs: Vec<Option<EventRing>>,
    cqs: Slab<Cq>,
    /// CQs by number (the vdev picks numbers: a randomly seeded hash).
    cq_by_num: PickedMap<u32, usize>,
    /// QPs by number (likewise).
    qps: PickedMap<u32, QpRef>,
    srqs: Slab<srq::Srq>,
    /// SRQs by number (likewise).
    srq_by_num: PickedMap<u32, usize>,
    /// Address handles by number (likewise).
    ahs: PickedMap<u32, ud::Ah>,
    /// QPs by doorbell index.
    qp_by_db: Vec<Option<QpRef>>,
    pqps: Vec<Pqp>,
    /// Its tenant's class (0 = realtime), for segmenting its long messages.
    rank: u8,
    /// Its tenant's policy as last put in force: which networks datagrams
    /// from another host may come from.
    policy: vrdma_tenant_policy::TenantPolicy,
    /// QP1: the CM MADs waiting for its control plane (kept in the first
    /// context of a device).
    gsi: gsi::Gsi,
    /// What its work did (folded into its tenant's account when asked or
    /// when it goes).
    counters: CompletionCounts,
}

/// The connected devices: by slab index on the datapath (QPs know their
/// device's index), by id on the control path.
#[derive(Debug, Default)]
pub struct Devices {
    slab: Slab<Device>,
    by_id: IdMap<DeviceId, usize>,
}

impl Devices {
    /// The slab index of device `id`.
    fn index(&self, id: &DeviceId) -> Option<usize> {
        self.by_id.get(id).copied()
    }

    fn get(&self, id: &DeviceId) -> Option<&Device> {
        self.slab.get(self.index(id)?)
    }

    fn get_mut(&mut self, id: &DeviceId) -> Option<&mut Device> {
        let i = self.index(id)?;
        self.slab.get_mut(i)
    }

    fn at(&self, i: usize) -> Option<&Device> {
        self.slab.get(i)
    }

    fn at_mut(&mut self, i: usize) -> Option<&mut Device> {
        self.slab.get_mut(i)
    }

    fn contains_key(&self, id: &DeviceId) -> bool {
        self.by_id.contains_key(id)
    }

    /// Adds a device; returns its slab index.
    fn insert(&mut self, dev: Device) -> usize {
        let id = dev.id;
        let i = self.slab.insert(dev);
        self.by_id.insert(id, i);
        i
    }

    fn remove(&mut self, id: &DeviceId) -> Option<Device> {
        let i = self.by_id.remove(id)?;
        self.slab.remove(i)
    }

    fn values(&self) -> impl Iterator<Item = &Device> {
        self.slab.iter().map(|(_, d)| d)
    }

    fn values_mut(&mut self) -> impl Iterator<Item = &mut Device> {
        self.slab.iter_mut().map(|(_, d)| d)
    }

    fn len(&self) -> usize {
        self.slab.len()
    }
}

/// What one round did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Round {
    /// Something ran, completed, failed or was flushed.
    pub worked: bool,
    /// Work is runnable right now (the round stopped at its budget).
    pub busy: bool,
    /// A long message stopped between segments for work of a higher class.
    pub preempted: bool,
    /// Earliest time waiting work (RNR, retry, rate limit, port) is due.
    pub next_due: Option<Instant>,
}

/// The engine. See the module documentation.
pub struct Engine {
    devices: Devices,
    /// Local devices by GID (hostd assigns GIDs; a vdev only looks them
    /// up): the contexts of one device share its GID, and a QP number is
    /// unique among them (their vdev allocates it), so a (GID, QPN) names
    /// one QP.
    gids: IdMap<Gid, Vec<DeviceId>>,
    keys: keys::KeyTable,
    qps: Slab<Qp>,
    sched: Scheduler,
    accounts: Accounts,
    /// QPs waiting for an RNR or retry timer: (due, QP, its serial).
    timers: Vec<(Instant, QpRef, u64)>,
    /// pQPs that may have work to stage: (device slab index, pQP index).
    dirty: Vec<(usize, usize)>,
    /// Errored QPs with WQEs still to flush.
    flushing: Vec<QpRef>,
    next_serial: u64,
    /// Bumped when a device or its doorbell comes or goes (the datapath
    /// threads then re-read which eventfds to sleep on).
    generation: u64,
    /// A spare WQE buffer, swapped with a QP's while its head executes
    /// (always there between steps).
    spare: Option<Box<SendWork>>,
    /// Doorbell indices taken in one round.
    rung: Vec<u32>,
    /// Inside a round: CQEs are written at once and shown to the driver
    /// at the round's end (`publish_completions`).
    batching: bool,
    /// CQs written in this round and not yet published: (device slab
    /// index, CQ index).
    unpublished: Vec<(usize, usize)>,
    /// The network, for QPs connected to other hosts.
    wire: Option<Box<wire::Wire>>,
    /// MADs for other hosts waiting for room in the wire's send queue.
    gsi_out: gsi::Outbox,
    /// Packets for QP1 received so far (see [`Engine::wire_receive`]).
    gsi_packets: u64,
    /// The port's active MTU in bytes: the largest UD message.
    port_mtu: u32,
    /// Until then contexts a previous hostd handed over are coming back:
    /// a local peer that is not there yet is waited for
    /// ([`Engine::set_resuming`]).
    resuming_until: Option<Instant>,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("devices", &self.devices.len())
            .field("qps", &self.qps.len())
            .finish_non_exhaustive()
    }
}

impl Engine {
    /// An engine with no devices, scheduling with `sched`.
    pub fn new(sched: Scheduler) -> Self {
        Engine {
            devices: Devices::default(),
            gids: IdMap::default(),
            keys: keys::KeyTable::new(),
            qps: Slab::default(),
            sched,
            accounts: Accounts::default(),
            timers: Vec::new(),
            dirty: Vec::new(),
            flushing: Vec::new(),
            next_serial: 1,
            generation: 0,
            spare: Some(Box::default()),
            rung: Vec::new(),
            batching: false,
            unpublished: Vec::new(),
            wire: None,
            gsi_out: gsi::Outbox::default(),
            gsi_packets: 0,
            port_mtu: 4096,
            resuming_until: None,
        }
    }

    /// The tenants' counters and usage.
    /// Sets the port's active MTU (bytes): the largest UD message.
    pub fn set_port_mtu(&mut self, mtu: u32) {
        self.port_mtu = mtu;
    }

    pub fn accounts(&self) -> &Accounts {
        &self.accounts
    }

    /// Every tenant's counters and usage, the datapath's latest counts
    /// included.
    pub fn accounts_snapshot(
        &self,
    ) -> std::collections::BTreeMap<String, crate::stats::TenantAccount> {
        (self.accounts).snapshot_with(self.devices.values().map(|d| (d.id, &d.counters)))
    }

    /// What device `id`'s completions and arriving messages came to.
    pub fn device_counters(&self, id: DeviceId) -> Option<&CompletionCounts> {
        self.devices.get(&id).map(|d| &d.counters)
    }

    /// The tenants' counters and usage, for control requests.
    pub fn accounts_mut(&mut self) -> &mut Accounts {
        &mut self.accounts
    }

    /// The scheduler (classes, rates, throttled time).
    pub fn scheduler(&self) -> &Scheduler {
        &self.sched
    }

    /// Bumped whenever a device or its doorbell comes or goes.
    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// The devices whose id falls to datapath thread `index` of `threads`,
    /// with the eventfd each one's driver kicks and its serial (if it set
    /// its doorbell and its memory is still there).
    pub fn devices_of_thread(
        &self,
        index: u64,
        threads: u64,
    ) -> Vec<(DeviceId, Option<(u64, &EventFd)>)> {
        let mut out: Vec<_> = (self.devices.values())
            .filter(|d| d.id % threads.max(1) == index)
            .map(|d| {
                let bell = d.doorbell.as_ref().filter(|b| !b.lost);
                (d.id, bell.map(|b| (b.serial, &b.kick)))
            })
            .collect();
        out.sort_unstable_by_key(|(id, _)| *id);
        out
    }

    /// A look at device `id`'s doorbell summary that a datapath thread can
    /// take without the engine ([`guest::SummaryHint`]); `None` without a
    /// usable doorbell page.
    pub fn doorbell_hint(&self, id: DeviceId) -> Option<guest::SummaryHint> {
        let bell = self.devices.get(&id)?.doorbell.as_ref()?;
        (!bell.lost).then(|| bell.page.hint())?
    }

    /// Asks the drivers of `mine` to kick when they ring (the thread is
    /// about to sleep), or stops asking.
    pub fn set_need_kick(&self, mine: &[DeviceId], need: bool) {
        for id in mine {
            if let Some(b) = self.devices.get(id).and_then(|d| d.doorbell.as_ref()) {
                if !b.lost {
                    b.page.set_need_kick(need);
                }
            }
        }
    }

    /// Whether a round would find work: a doorbell of `mine` rang, or work
    /// waits to be staged or flushed. Staged work held back by a rate limit
    /// or the port does not count: its timer wakes the thread.
    pub fn has_pending(&self, mine: &[DeviceId]) -> bool {
        // Staged work the last round left is held back by a rate or the
        // port (a round stopped at its budget says `busy` instead).
        !self.dirty.is_empty()
            || !self.flushing.is_empty()
            || mine.iter().any(|id| {
                (self.devices.get(id))
                    .and_then(|d| d.doorbell.as_ref())
                    .is_some_and(|b| !b.lost && b.page.pending())
            })
    }

    /// Whether a control request left work only a datapath round does:
    /// a QP queued to run or to flush, packets or MADs waiting to go, a
    /// remote QP with its transport active. Without it a request need not
    /// wake the datapath (a wake-up sets it polling for a while: on this
    /// host's two CPUs, through a storm of connection setups, as much CPU
    /// as the setups themselves).
    pub fn wants_round(&self) -> bool {
        !self.dirty.is_empty()
            || !self.flushing.is_empty()
            || self.sched.has_work()
            || !self.gsi_out.is_empty()
            || (self.wire.as_ref()).is_some_and(|w| w.backlog() || w.has_active())
    }

    /// Tells the wire a datapath round runs (see `Wire::in_round`).
    fn set_in_round(&mut self, on: bool) {
        if let Some(w) = self.wire.as_mut() {
            w.in_round = on;
        }
    }

    /// One round of the datapath for the devices `mine`: takes their
    /// doorbells, wakes QPs whose timers are due, flushes errored QPs,
    /// stages the pQPs with work, and runs what the scheduler picks, up to
    /// [`ROUND_OPS`] WQEs and [`ROUND_BYTES`] bytes.
    pub fn round(&mut self, mine: &[DeviceId], now: Instant) -> Round {
        let mut round = Round::default();
        self.batching = true;
        self.set_in_round(true);
        round.worked |= self.wire_receive(now);
        for &id in mine {
            round.worked |= self.take_doorbells(id, now);
        }
        round.worked |= self.fire_timers(now);
        round.worked |= self.flush_pending();
        self.stage_dirty(now);
        let (mut ops, mut bytes) = (0usize, 0u64);
        while ops < ROUND_OPS && bytes < ROUND_BYTES {
            match self.sched.pick(now) {
                Pick::Run(queue) => {
                    let room = ROUND_BYTES.saturating_sub(bytes);
                    let (n, moved, preempted) = self.run_queue(queue, now, room);
                    ops += n.max(1);
                    bytes += moved;
                    round.worked = true;
                    if preempted {
                        round.preempted = true;
                        break;
                    }
                }
                Pick::Wait(at) => {
                    round.next_due = at;
                    break;
                }
                Pick::Idle => break,
            }
        }
        // Before the packets go: a ping-pong's completion is not held
        // behind the send system call.
        self.publish_completions();
        let (wire_due, wire_busy) = self.wire_send(now);
        self.publish_completions();
        self.batching = false;
        self.set_in_round(false);
        round.busy = round.preempted
            || ((ops >= ROUND_OPS || bytes >= ROUND_BYTES) && self.sched.has_work())
            || !self.flushing.is_empty()
            || wire_busy;
        if let Some(due) = wire_due {
            round.next_due = Some(round.next_due.map_or(due, |d| d.min(due)));
        }
        if let Some(due) = self.timers.iter().map(|t| t.0).min() {
            round.next_due = Some(round.next_due.map_or(due, |d| d.min(due)));
        }
        round
    }

    /// Takes device `id`'s doorbells and puts the QPs they name to work.
    fn take_doorbells(&mut self, id: DeviceId, now: Instant) -> bool {
        let Some(dev) = self.devices.get(&id) else {
            return false;
        };
        let Some(bell) = dev.doorbell.as_ref().filter(|b| !b.lost) else {
            return false;
        };
        let mut rung = std::mem::take(&mut self.rung);
        rung.clear();
        bell.page.take(|db| rung.push(db));
        let worked = !rung.is_empty();
        for &db in &rung {
            let qref = self
                .devices
                .get(&id)
                .and_then(|d| d.qp_by_db.get(db as usize).copied().flatten());
            if let Some(qref) = qref {
                self.activate(qref, now);
            }
        }
        self.rung = rung;
        worked
    }

    /// A QP's rings may have new work: queue it on its pQP, flush it if it
    /// is in error, or cut short the RNR wait of the requester that waits
    /// for one of its receives.
    fn activate(&mut self, qref: QpRef, now: Instant) {
        let Some(qp) = self.qps.get_mut(qref) else {
            return;
        };
        if qp.lost {
            return;
        }
        if qp.failed() {
            if !self.flushing.contains(&qref) {
                self.flushing.push(qref);
            }
            return;
        }
        // A receive posted: its requester (the QP it is connected to: RC
        // peers are each other's) need not sit out its RNR timer. (A QP
        // that waits has a timer: with none, the peer is not looked up.)
        if qp.conn.is_some() && !self.timers.is_empty() {
            if let Some(peer) = self.peer_of(qref) {
                if let Some(p) = self.qps.get_mut(peer).filter(|p| p.waiting) {
                    if let Some(w) = p.wait.as_mut().filter(|w| w.kind == WaitKind::Rnr) {
                        w.due = w.due.min(now);
                    }
                }
            }
        }
        let Some(qp) = self.qps.get_mut(qref) else {
            return;
        };
        // A producer index beyond the ring counts as work: the head's
        // load fails the QP.
        let has_work = qp.sends() && (qp.has_head || qp.sq_posted().is_none_or(|n| n > 0));
        if has_work && !qp.waiting && !qp.queued {
            qp.queued = true;
            qp.turn_left = QP_TURN;
            let (di, pqp) = (qp.dev, qp.pqp);
            if let Some(p) = self.pqp_mut(di, pqp) {
                p.ring.push_back(qref);
                self.dirty.push((di, pqp));
            }
        }
    }

    /// Puts QPs whose RNR or retry timer is due back to work.
    fn fire_timers(&mut self, now: Instant) -> bool {
        let mut fired = false;
        let mut i = 0;
        while i < self.timers.len() {
            let (due, qref, serial) = self.timers[i];
            let live = self
                .qps
                .get(qref)
                .filter(|q| q.serial == serial && q.waiting);
            let Some(due) = live.map(|q| q.wait.map_or(due, |w| w.due)) else {
                self.timers.swap_remove(i);
                continue;
            };
            if due > now {
                self.timers[i].0 = due;
                i += 1;
                continue;
            }
            self.timers.swap_remove(i);
            if let Some(qp) = self.qps.get_mut(qref) {
                // Its head is still its copy: it runs again first. Its
                // `wait` stays: the retries left count down across tries.
                qp.waiting = false;
                qp.queued = false;
                fired = true;
            }
            self.activate(qref, now);
        }
        fired
    }

    /// Flushes errored QPs, [`FLUSH_BATCH`] WQEs each per round.
    fn flush_pending(&mut self) -> bool {
        if self.flushing.is_empty() {
            return false;
        }
        let mut list = std::mem::take(&mut self.flushing);
        list.retain(|&qref| !self.flush_qp(qref, FLUSH_BATCH));
        let worked = true;
        // Any added meanwhile stay too.
        list.append(&mut self.flushing);
        self.flushing = list;
        worked
    }

    /// Stages the pQPs marked dirty.
    fn stage_dirty(&mut self, now: Instant) {
        while let Some((di, pqp)) = self.dirty.pop() {
            self.stage(di, pqp, now);
        }
    }

    /// Stages the next WQE of pQP `pos` of device `di` unless one is staged.
    fn stage(&mut self, di: usize, pos: usize, now: Instant) {
        if self.pqp_mut(di, pos).is_some_and(|p| p.staged.is_some()) {
            return;
        }
        if let Some((qref, head)) = self.next_head(di, pos) {
            let Some(device) = self.devices.at(di).map(|d| d.id) else {
                return;
            };
            if let Some(p) = self.pqp_mut(di, pos) {
                p.staged = Some(qref);
                let number = p.number;
                self.sched.stage((device, number), head, now);
            }
        }
    }

    /// The head WQE of the first QP in pQP `pos`'s ring that has one (QPs
    /// without work leave the ring).
    fn next_head(&mut self, di: usize, pos: usize) -> Option<(QpRef, Head)> {
        loop {
            let &qref = self.pqp_mut(di, pos)?.ring.front()?;
            if let Some(head) = self.load_head(qref) {
                return Some((qref, head));
            }
            if let Some(p) = self.pqp_mut(di, pos) {
                p.ring.pop_front();
            }
            if let Some(qp) = self.qps.get_mut(qref) {
                qp.queued = false;
            }
        }
    }

    fn pqp_mut(&mut self, di: usize, pos: usize) -> Option<&mut Pqp> {
        self.devices.at_mut(di)?.pqps.get_mut(pos)
    }

    /// Makes sure QP `qref` holds its next send WQE and returns what the
    /// scheduler needs of it; `None` if it has nothing to run (or failed:
    /// a malformed WQE completes in error and the QP goes to ERR).
    fn load_head(&mut self, qref: QpRef) -> Option<Head> {
        let qp = self.qps.get_mut(qref)?;
        if !qp.sends() || qp.waiting {
            return None;
        }
        if !qp.has_head && qp.remote.as_ref().is_some_and(|r| !r.has_room_any()) {
            // Its window is full: an answer from the peer activates it.
            return None;
        }
        if !qp.has_head {
            let Some(pending) = qp.sq_posted() else {
                self.fail_qp(qref, true, "send ring producer index beyond the ring");
                return None;
            };
            if pending == 0 {
                return None;
            }
            match wqe::read_send(&qp.sq, qp.sq_read(), &qp.send_limits, &mut qp.head) {
                Ok(()) => {
                    qp.has_head = true;
                    qp.sent = 0;
                }
                Err(Malformed::Entry {
                    wr_id,
                    opcode,
                    status,
                }) => {
                    let opcode = WcOpcode::try_from(opcode).unwrap_or(WcOpcode::Send);
                    self.complete_send(qref, wr_id, opcode, status, 0, true);
                    self.fail_qp(qref, false, "malformed send WQE");
                    return None;
                }
                Err(Malformed::Unreadable) => {
                    self.fail_qp(qref, true, "send ring unreadable");
                    return None;
                }
            }
        }
        let qp = self.qps.get(qref)?;
        if qp
            .remote
            .as_ref()
            .is_some_and(|r| !r.has_room(qp.head.opcode))
        {
            // A READ or atomic beyond `max_rd_atomic` waits for an answer.
            return None;
        }
        let kind = match qp.head.opcode {
            vrdma_spec::verbs::SendOpcode::RdmaRead
            | vrdma_spec::verbs::SendOpcode::AtomicCmpAndSwp
            | vrdma_spec::verbs::SendOpcode::AtomicFetchAndAdd => OpKind::Read,
            _ => OpKind::Send,
        };
        // A message is charged (fair share, rate limits, the port's wire
        // time) in full when it first runs; the rest of a message moved in
        // segments is already paid for.
        let bytes = if qp.sent == 0 { qp.head.length } else { 0 };
        Some(Head { kind, bytes })
    }

    /// Runs the staged head of `queue`, then its next ones as long as the
    /// scheduler lets the same tenant go on ([`Scheduler::budget`]);
    /// stages what is left; after the first WQE, `room` bytes at most.
    /// Returns WQEs completed, bytes moved and whether a long message was
    /// preempted.
    fn run_queue(&mut self, queue: QueueId, now: Instant, room: u64) -> (usize, u64, bool) {
        let (device, number) = queue;
        let Some(di) = self.devices.index(&device) else {
            return (0, 0, false);
        };
        let Some(pos) =
            (self.devices.at(di)).and_then(|d| d.pqps.iter().position(|p| p.number == number))
        else {
            return (0, 0, false);
        };
        let (mut ops, mut bytes) = (0usize, 0u64);
        let Some(mut qref) = self.pqp_mut(di, pos).and_then(|p| p.staged.take()) else {
            return (0, 0, false);
        };
        let mut budget = self.sched.budget(queue, now, room);
        let preempted = loop {
            let outcome = self.execute(qref, now);
            bytes += outcome.moved;
            ops += usize::from(outcome.completed);
            self.after_step(di, pos, qref, &outcome);
            let Some((next, head)) = self.next_head(di, pos) else {
                break outcome.preempted;
            };
            if outcome.preempted || !budget.admit(&head, now) {
                if let Some(p) = self.pqp_mut(di, pos) {
                    p.staged = Some(next);
                }
                self.sched.stage(queue, head, now);
                break outcome.preempted;
            }
            qref = next;
        };
        self.sched.spend(&budget, now);
        (ops, bytes, preempted)
    }

    /// After a step of `qref`'s head: a QP that is done, waits or failed
    /// leaves its pQP's ring; one that used its turn goes to the back.
    fn after_step(&mut self, di: usize, pos: usize, qref: QpRef, outcome: &rc::Outcome) {
        let Some(qp) = self.qps.get_mut(qref) else {
            if let Some(p) = self.pqp_mut(di, pos) {
                p.ring.retain(|&q| q != qref);
            }
            return;
        };
        if let (true, Some(w)) = (qp.waiting, qp.wait) {
            self.timers.push((w.due, qref, qp.serial));
        }
        let leaves = qp.waiting || !qp.sends();
        let rotate = outcome.completed && {
            qp.turn_left = qp.turn_left.saturating_sub(1);
            qp.turn_left == 0
        };
        if leaves {
            qp.queued = false;
        }
        if rotate {
            qp.turn_left = QP_TURN;
        }
        let Some(p) = self.pqp_mut(di, pos) else {
            return;
        };
        if leaves {
            p.ring.retain(|&q| q != qref);
        } else if rotate && p.ring.front() == Some(&qref) {
            p.ring.rotate_left(1);
        }
    }

    /// Writes the completion of a send WQE of `qref` (errors always, a
    /// success only if `signaled`) and counts it.
    fn complete_send(
        &mut self,
        qref: QpRef,
        wr_id: u64,
        opcode: WcOpcode,
        status: WcStatus,
        byte_len: u32,
        signaled: bool,
    ) {
        let Some(qp) = self.qps.get_mut(qref) else {
            return;
        };
        let cqe = Cqe {
            wr_id: wr_id.into(),
            status: status.into(),
            opcode: opcode.into(),
            byte_len: byte_len.into(),
            qp_num: qp.vqpn.into(),
            ..Cqe::default()
        };
        qp.sq_done = qp.sq_done.wrapping_add(1);
        if !qp.lost {
            qp.sq.set_device_index(qp.sq_done);
        }
        let (di, cq, lost) = (qp.dev, qp.send_cq, qp.lost);
        let Some(dev) = self.devices.at_mut(di) else {
            return;
        };
        dev.counters.count(&cqe);
        if lost || (status == WcStatus::Success && !signaled) {
            return;
        }
        // Shown at once: a sender's window waits on it.
        self.post_cqe(di, cq, &cqe, guest::solicits(status), false);
    }

    /// Writes a receive completion of `qref` and counts it.
    fn complete_recv(&mut self, qref: QpRef, cqe: &Cqe, solicited: bool) {
        let Some(qp) = self.qps.get_mut(qref) else {
            return;
        };
        qp.rq_taken += 1;
        qp.has_rq_head = false;
        // A receive of an SRQ freed its slot when it was taken.
        if qp.srq.is_none() {
            qp.rq_done = qp.rq_done.wrapping_add(1);
            if !qp.lost {
                qp.rq.set_device_index(qp.rq_done);
            }
        }
        let (di, cq, lost) = (qp.dev, qp.recv_cq, qp.lost);
        let Some(dev) = self.devices.at_mut(di) else {
            return;
        };
        dev.counters.count(cqe);
        if !lost {
            let status = WcStatus::try_from(cqe.status).unwrap_or(WcStatus::GeneralErr);
            self.post_cqe(di, cq, cqe, solicited || guest::solicits(status), true);
        }
    }

    /// Writes `cqe` into CQ `cq` of device `di`: shown to the driver at
    /// once, or (`later`, inside a round) at the round's end, with its
    /// event if due.
    fn post_cqe(&mut self, di: usize, cq: usize, cqe: &Cqe, solicited: bool, later: bool) {
        let batching = self.batching && later;
        let Some(dev) = self.devices.at_mut(di) else {
            return;
        };
        let Device {
            cqs, eqs, tenant, ..
        } = dev;
        let Some(c) = cqs.get_mut(cq) else {
            return;
        };
        let written = if batching {
            guest::complete_later(c, eqs, cqe, solicited)
        } else {
            guest::complete(c, eqs, cqe, solicited)
        };
        if !written && !c.lost {
            tracing::debug!(tenant = %tenant, cqn = c.cqn, "CQ overrun: completion lost");
        }
        if written && batching && !c.publish_queued {
            c.publish_queued = true;
            self.unpublished.push((di, cq));
        }
    }

    /// Shows the driver every CQE written in this round, and posts the
    /// events they are due.
    fn publish_completions(&mut self) {
        let mut list = std::mem::take(&mut self.unpublished);
        for (di, cq) in list.drain(..) {
            if let Some(dev) = self.devices.at_mut(di) {
                let Device { cqs, eqs, .. } = dev;
                if let Some(c) = cqs.get_mut(cq) {
                    guest::publish(c, eqs);
                }
            }
        }
        self.unpublished = list;
    }

    /// Moves QP `qref` to ERR: flags its rings, takes it off its pQP and
    /// flushes what it holds and what is posted. `fatal`: no completion
    /// reports why (its ring broke), so the driver gets a QP_FATAL event.
    fn fail_qp(&mut self, qref: QpRef, fatal: bool, why: &str) {
        let Some(qp) = self.qps.get_mut(qref) else {
            return;
        };
        let first = qp.state != QpState::Err;
        qp.state = QpState::Err;
        qp.wait = None;
        qp.waiting = false;
        qp.queued = false;
        let (di, pos, vqpn, lost, on_srq) = (qp.dev, qp.pqp, qp.vqpn, qp.lost, qp.srq.is_some());
        if !lost {
            qp.sq.set_device_flag(DEVICE_FLAG_ERROR);
            qp.rq.set_device_flag(DEVICE_FLAG_ERROR);
        }
        let mut unstage = None;
        if let Some(dev) = self.devices.at_mut(di) {
            let device = dev.id;
            if first {
                tracing::info!(tenant = %dev.tenant, qpn = vqpn, fatal, "QP moved to ERR: {why}");
            }
            if let Some(p) = dev.pqps.get_mut(pos) {
                p.ring.retain(|&q| q != qref);
                if p.staged == Some(qref) {
                    p.staged = None;
                    unstage = Some((device, p.number));
                    self.dirty.push((di, pos));
                }
            }
            if fatal && first && !lost {
                guest::post_event(&mut dev.eqs, 0, event_kind::QP_FATAL, vqpn);
            }
            // In ERR it takes no more receives from its SRQ: the one it
            // holds, if any, is flushed next (as the IBA has it, the event
            // tells the driver the QP may be destroyed without losing any).
            if on_srq && first && !lost {
                guest::post_event(&mut dev.eqs, 0, event_kind::QP_LAST_WQE_REACHED, vqpn);
            }
        }
        if let Some(queue) = unstage {
            self.sched.unstage(queue);
        }
        if !lost && !self.flushing.contains(&qref) {
            self.flushing.push(qref);
        }
    }

    /// Flushes up to `budget` WQEs of errored QP `qref` with WR_FLUSH_ERR;
    /// true when nothing is left.
    fn flush_qp(&mut self, qref: QpRef, mut budget: u32) -> bool {
        let Some(mut qp) = self.qps.get_mut(qref) else {
            return true;
        };
        if qp.lost || !qp.failed() {
            return true;
        }
        // What is on the wire is older than the head: it is flushed first.
        while budget > 0 {
            let Some(m) = qp.remote.as_mut().and_then(|r| r.inflight.pop_front()) else {
                break;
            };
            qp.issued = qp.issued.saturating_sub(1);
            let (wr_id, opcode) = (m.work.wr_id, m.work.wc_opcode());
            if let Some(r) = qp.remote.as_mut() {
                r.pool.push(m.work);
            }
            self.complete_send(qref, wr_id, opcode, WcStatus::WrFlushErr, 0, true);
            budget -= 1;
            let Some(again) = self.qps.get_mut(qref) else {
                return true;
            };
            qp = again;
        }
        if budget == 0 {
            return false;
        }
        if qp.has_head {
            qp.has_head = false;
            let (wr_id, opcode) = (qp.head.wr_id, qp.head.wc_opcode());
            self.complete_send(qref, wr_id, opcode, WcStatus::WrFlushErr, 0, true);
            budget -= 1;
        }
        while budget > 0 {
            let Some(qp) = self.qps.get(qref) else {
                return true;
            };
            // A producer more than a ring ahead: nothing sane to flush.
            let (sq, rq) = (qp.sq_pending().unwrap_or(0), qp.rq_pending().unwrap_or(0));
            if qp.has_rq_head || rq > 0 {
                let wr_id = if qp.has_rq_head {
                    qp.rq_head.wr_id
                } else {
                    wqe::read_wr_id(&qp.rq, qp.rq_done).unwrap_or(0)
                };
                let cqe = Cqe {
                    wr_id: wr_id.into(),
                    status: WcStatus::WrFlushErr.into(),
                    opcode: WcOpcode::Recv.into(),
                    qp_num: qp.vqpn.into(),
                    ..Cqe::default()
                };
                self.complete_recv(qref, &cqe, false);
            } else if sq > 0 {
                let wr_id = wqe::read_wr_id(&qp.sq, qp.sq_done).unwrap_or(0);
                let opcode = wqe::read_opcode(&qp.sq, qp.sq_done);
                self.complete_send(qref, wr_id, opcode, WcStatus::WrFlushErr, 0, true);
            } else {
                return true;
            }
            budget -= 1;
        }
        false
    }

    /// The QP of `device` numbered `vqpn`.
    fn qp_of(&self, device: DeviceId, vqpn: u32) -> Option<QpRef> {
        self.devices.get(&device)?.qps.get(&vqpn).copied()
    }

    /// QP `vqpn` of the local device (any of its contexts) with `gid`.
    fn qp_at(&self, gid: &Gid, vqpn: u32) -> Option<QpRef> {
        (self.gids.get(gid)?.iter()).find_map(|&device| self.qp_of(device, vqpn))
    }

    /// Allocation-free lookup of the responder of `qref`: its cached peer if
    /// that is still the same QP, else through the destination GID (a
    /// device of this host) and QP number.
    fn peer_of(&mut self, qref: QpRef) -> Option<QpRef> {
        let qp = self.qps.get(qref)?;
        if let Some((peer, serial)) = qp.peer {
            if self.qps.get(peer).is_some_and(|p| p.serial == serial) {
                return Some(peer);
            }
        }
        let conn = qp.conn?;
        let peer = self.qp_at(&conn.dgid, conn.dest_qpn)?;
        let serial = self.qps.get(peer)?.serial;
        if let Some(qp) = self.qps.get_mut(qref) {
            qp.peer = Some((peer, serial));
        }
        Some(peer)
    }
}

/// Interval between retries of a packet the fabric dropped.
pub const RETRY_STEP: Duration = Duration::from_micros(500);

pub use rc::rnr_timer;

#[cfg(test)]
mod tests;
#[cfg(test)]
mod tests_unreliable;
