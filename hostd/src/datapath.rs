//! The datapath: polling threads that move work from vdevs' submission
//! rings into the NIC, run it, and move completions back.
//!
//! One [`Core`] behind a mutex holds the NIC, the connected devices, the
//! scheduler, the tenants' accounts and the completions waiting for room in
//! their rings; control requests take the same lock, which is what makes
//! "after the response, no WQE touches it" hold. Each of the
//! `datapath_threads` threads polls the rings of the devices with
//! `id % threads == its index`, runs the NIC's progress and flushes held
//! completions.
//!
//! Every round, a thread first *stages* the next WQE of each of its pQPs:
//! it pops the ring into a one-entry slot per pQP (held here, since the
//! ring has no peek), posting receive WQEs straight to the NIC as it meets
//! them. Then the [`Scheduler`] decides, WQE by WQE, which staged send WQE
//! enters the NIC (strict priority between classes, deficit round robin by
//! bytes inside one, token buckets, credits); after each, that pQP's slot
//! is refilled. A pQP whose staged WQE waits is not drained further, so
//! each vQP's work stays in posting order. When the scheduler waits for
//! tokens it says until when, and a sleeping thread arms its timer for it.
//!
//! The NIC learns each device's rank (its tenant's class) and stops a long
//! message of a lower rank between segments while a higher rank is busy;
//! the thread then yields its core at once (see the run loop).
//!
//! Polling is adaptive for a 2-core host: after the last work a thread spins
//! for `spin_us` (with `spin_loop` and an occasional `yield_now`), then
//! announces sleep on every submission ring it serves (`prepare_sleep`),
//! re-checks them, and blocks in epoll on the doorbell eventfds, its wake
//! eventfd (devices came or went) and a timerfd for the next RNR/transport
//! retry. Completion eventfds are written only when the vdev's side of a
//! completion ring said it sleeps.

use std::collections::{BTreeMap, VecDeque};
use std::io;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::eventfd::{EventFd, EFD_CLOEXEC, EFD_NONBLOCK};
use vmm_sys_util::timerfd::TimerFd;
use vrdma_hostd_protocol::channel::Channel;
use vrdma_hostd_protocol::entries::{kind, PhysCqe, PhysWqe, Sge};
use vrdma_hostd_protocol::shm::{QueueLayout, Ring, SharedMapping};
use vrdma_spec::ring::send_flags;
use vrdma_spec::verbs::SendOpcode;
use vrdma_tenant_policy::TenantPolicy;
use zerocopy::FromBytes;

use crate::ids::IdMap;
use crate::nic::{Completion, DeviceId, Nic};
use crate::scheduler::{CreditView, Head, OpKind, Pick, QueueId, Scheduler};
use crate::seccomp::{Role, Threads};
use crate::stats::Accounts;

/// Entries taken from one submission ring at a time while staging
/// (receives pass straight through; the first send WQE stops it).
pub const RING_BATCH: usize = 32;
/// WQEs the NIC executes per round.
pub const PROGRESS_BUDGET: usize = 256;
/// Send WQEs the scheduler lets into the NIC per round.
pub const SCHED_BUDGET: usize = 256;
/// Bytes (scheduling cost) the scheduler lets into the NIC per round. The
/// NIC executes about what one round admits, so its queues stay shallow
/// and the scheduler's order is the order work runs in: a realtime WQE
/// waits behind at most one round of other work, and weights decide who
/// gets the next round's bytes. At ~20 GB/s a round is ~25 µs of copying.
pub const ROUND_BYTES: u64 = 512 * 1024;
/// WQEs of one pQP queued inside the NIC before its ring is left alone.
/// Each costs ~350 bytes, so a pQP holds at most a few MiB of hostd memory.
pub const MAX_OUTSTANDING: usize = 16 * 1024;
/// How often a thread with completions waiting for ring room looks again
/// while it would otherwise sleep (vdev does not signal freed room).
const HELD_RECHECK: Duration = Duration::from_millis(1);
/// epoll tokens that are not device ids (device ids start at 1).
const WAKE_TOKEN: u64 = u64::MAX;
const TIMER_TOKEN: u64 = u64::MAX - 1;

/// The shared memory of one granted physical QP.
#[derive(Debug)]
pub struct QueueMem {
    pub pqp: u32,
    pub mem: SharedMapping,
}

/// A connected vdev as the datapath sees it.
#[derive(Debug)]
pub struct DeviceQueues {
    pub id: DeviceId,
    /// The tenant it serves.
    pub tenant: String,
    pub layout: QueueLayout,
    pub queues: Vec<QueueMem>,
    /// vdev writes it after posting while our side sleeps.
    pub doorbell: EventFd,
    /// We write it after pushing completions while vdev's side sleeps.
    pub completion: EventFd,
    /// The control channel, shut down when the vdev corrupts a ring so that
    /// its connection thread tears it down.
    pub channel: Arc<Channel>,
    failed: AtomicBool,
}

impl DeviceQueues {
    pub fn new(
        id: DeviceId,
        tenant: &str,
        layout: QueueLayout,
        queues: Vec<QueueMem>,
        channel: Arc<Channel>,
    ) -> io::Result<Self> {
        Ok(DeviceQueues {
            id,
            tenant: tenant.to_owned(),
            layout,
            queues,
            doorbell: EventFd::new(EFD_NONBLOCK | EFD_CLOEXEC)?,
            completion: EventFd::new(EFD_NONBLOCK | EFD_CLOEXEC)?,
            channel,
            failed: AtomicBool::new(false),
        })
    }

    /// The vdev broke the ring protocol: stop serving it and make its
    /// connection thread tear it down.
    fn fail(&self, why: &str) {
        if !self.failed.swap(true, Ordering::SeqCst) {
            tracing::warn!(device = self.id, "{why}: disconnecting the vdev");
            self.channel.shutdown();
        }
    }

    fn queue(&self, pqp: u32) -> Option<&QueueMem> {
        self.queues.iter().find(|q| q.pqp == pqp)
    }
}

/// Everything the datapath and the control path share, under one lock.
pub struct Core {
    nic: Box<dyn Nic>,
    devices: BTreeMap<DeviceId, Arc<DeviceQueues>>,
    /// Completions waiting for room in their completion ring, per pQP.
    held: IdMap<(DeviceId, u32), VecDeque<PhysCqe>>,
    /// Bumped when devices come or go.
    generation: u64,
    scratch: Vec<Completion>,
    hold_limit: usize,
    /// The next send WQE of each pQP, popped from its ring, waiting for
    /// the scheduler.
    staged: IdMap<QueueId, PhysWqe>,
    sched: Scheduler,
    accounts: Accounts,
}

/// The NIC's send WQEs, as the scheduler's credits see them.
struct NicCredits<'a>(&'a dyn Nic);

impl CreditView for NicCredits<'_> {
    fn device(&self, device: DeviceId) -> usize {
        self.0.queued_sends(device)
    }
    fn total(&self) -> usize {
        self.0.total_queued_sends()
    }
}

/// What the scheduler needs to know of a send-side WQE: its rate-limit
/// kind and the bytes it moves (SGE lengths, or the inline length).
pub fn head_of(wqe: &PhysWqe) -> Head {
    let kind = match SendOpcode::try_from(wqe.opcode) {
        Ok(SendOpcode::RdmaRead | SendOpcode::AtomicCmpAndSwp | SendOpcode::AtomicFetchAndAdd) => {
            OpKind::Read
        }
        _ => OpKind::Send,
    };
    let bytes = if wqe.flags & send_flags::INLINE != 0 {
        u64::from(wqe.inline_len.get()).min(wqe.payload.len() as u64)
    } else {
        let n = usize::from(wqe.num_sge).min(wqe.payload.len() / std::mem::size_of::<Sge>());
        wqe.payload
            .get(..n * std::mem::size_of::<Sge>())
            .and_then(|b| <[Sge]>::ref_from_bytes(b).ok())
            .map_or(0, |sges| {
                sges.iter().map(|s| u64::from(s.length.get())).sum()
            })
    };
    Head { kind, bytes }
}

/// What one round did.
#[derive(Debug, Default, Clone, Copy)]
struct Round {
    worked: bool,
    busy: bool,
    /// The NIC stopped a long message for work of a higher rank.
    preempted: bool,
    held: bool,
    next_due: Option<Instant>,
}

impl Core {
    /// The NIC, for control requests.
    pub fn nic(&mut self) -> &mut dyn Nic {
        self.nic.as_mut()
    }

    /// The connected device `id`.
    pub fn device(&self, id: DeviceId) -> Option<Arc<DeviceQueues>> {
        self.devices.get(&id).cloned()
    }

    /// The tenants' counters and usage.
    pub fn accounts(&self) -> &Accounts {
        &self.accounts
    }

    /// The tenants' counters and usage, for control requests.
    pub fn accounts_mut(&mut self) -> &mut Accounts {
        &mut self.accounts
    }

    /// The scheduler (throttled time, credits).
    pub fn scheduler(&self) -> &Scheduler {
        &self.sched
    }

    /// Applies tenants' classes, weights and rates at once (policy reload).
    pub fn configure_tenants(&mut self, tenants: &[TenantPolicy], now: Instant) {
        for t in tenants {
            self.sched.configure(t, now);
        }
        let ids: Vec<DeviceId> = self.devices.keys().copied().collect();
        for id in ids {
            self.rank_device(id);
        }
    }

    /// Tells the NIC the device's rank, from its tenant's class.
    fn rank_device(&mut self, id: DeviceId) {
        if let Some(rank) = self.sched.rank(id) {
            self.nic.set_rank(id, rank);
        }
    }

    /// Back-pressure: WQEs of `pqp` the datapath may still take, so that
    /// neither the held completions nor the NIC's queues grow without bound.
    fn room(&self, id: DeviceId, pqp: u32) -> usize {
        let held = self.held.get(&(id, pqp)).map_or(0, VecDeque::len);
        self.hold_limit
            .saturating_sub(held)
            .min(MAX_OUTSTANDING.saturating_sub(self.nic.outstanding(id, pqp)))
    }

    /// Stages the next send WQE of `pqp` of `dev` if its slot is empty:
    /// pops its submission ring, posting receives to the NIC on the way.
    fn refill(&mut self, dev: &DeviceQueues, pqp: u32) -> bool {
        let queue = (dev.id, pqp);
        if self.staged.contains_key(&queue) || dev.failed.load(Ordering::Relaxed) {
            return false;
        }
        let Some(sq) = dev
            .queue(pqp)
            .and_then(|q| Ring::<PhysWqe>::new(&q.mem, dev.layout.sq))
        else {
            dev.fail("submission ring does not fit");
            return false;
        };
        let mut worked = false;
        for _ in 0..RING_BATCH {
            if self.room(dev.id, pqp) == 0 {
                break;
            }
            match sq.pop() {
                Ok(Some(wqe)) => {
                    worked = true;
                    if wqe.kind == kind::RECV {
                        self.nic.post(dev.id, pqp, &wqe);
                        continue;
                    }
                    self.sched.stage(queue, head_of(&wqe));
                    if self.sched.is_staged(queue) {
                        self.staged.insert(queue, wqe);
                    } else {
                        // Not a device the scheduler knows (cannot happen):
                        // never leave work behind.
                        self.nic.post(dev.id, pqp, &wqe);
                        continue;
                    }
                    break;
                }
                Ok(None) => break,
                Err(e) => {
                    dev.fail(&format!("submission ring of pQP {pqp}: {e}"));
                    break;
                }
            }
        }
        worked
    }

    /// One pass: stage the given devices' submission rings, let the
    /// scheduler post staged work into the NIC, run the NIC, flush
    /// completions into every device's completion rings.
    fn round(&mut self, mine: &[Arc<DeviceQueues>], now: Instant) -> Round {
        let mut round = Round::default();
        for dev in mine {
            if dev.failed.load(Ordering::Relaxed) {
                continue;
            }
            for q in &dev.queues {
                round.worked |= self.refill(dev, q.pqp);
            }
        }
        let mut dispatched = 0;
        let mut admitted: u64 = 0;
        let mut wait = None;
        while dispatched < SCHED_BUDGET && admitted < ROUND_BYTES {
            match self.sched.pick(now, &NicCredits(self.nic.as_ref())) {
                Pick::Run(queue) => {
                    dispatched += 1;
                    if let Some(wqe) = self.staged.remove(&queue) {
                        admitted += head_of(&wqe).cost();
                        self.nic.post(queue.0, queue.1, &wqe);
                    }
                    if let Some(dev) = self.devices.get(&queue.0).cloned() {
                        self.refill(&dev, queue.1);
                    }
                }
                Pick::Wait(until) => {
                    wait = until;
                    break;
                }
                Pick::Idle => break,
            }
        }
        round.worked |= dispatched > 0;
        // Stopped by a budget, not for want of work: come back at once.
        round.busy = dispatched == SCHED_BUDGET || admitted >= ROUND_BYTES;
        let progress = self.nic.progress(now, PROGRESS_BUDGET);
        round.worked |= progress.worked;
        round.busy |= progress.busy;
        round.preempted = progress.preempted;
        round.next_due = match (progress.next_due, wait) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        self.nic.take_completions(&mut self.scratch);
        for c in self.scratch.drain(..) {
            self.accounts.completion(c.device, &c.cqe);
            self.held
                .entry((c.device, c.pqp))
                .or_default()
                .push_back(c.cqe);
        }
        round.worked |= self.flush();
        round.held = self.held.values().any(|q| !q.is_empty());
        round
    }

    /// Moves held completions into their rings while there is room; never
    /// drops or overwrites one.
    fn flush(&mut self) -> bool {
        let mut worked = false;
        for (&(id, pqp), held) in self.held.iter_mut() {
            if held.is_empty() {
                continue;
            }
            let Some(dev) = self.devices.get(&id) else {
                held.clear();
                continue;
            };
            let Some(cq) = dev
                .queue(pqp)
                .and_then(|q| Ring::<PhysCqe>::new(&q.mem, dev.layout.cq))
            else {
                held.clear();
                continue;
            };
            let mut pushed = false;
            while let Some(cqe) = held.front() {
                match cq.push(cqe) {
                    Ok(true) => {
                        held.pop_front();
                        pushed = true;
                    }
                    Ok(false) => break,
                    Err(e) => {
                        dev.fail(&format!("completion ring of pQP {pqp}: {e}"));
                        held.clear();
                        break;
                    }
                }
            }
            if pushed {
                worked = true;
                if cq.consumer_sleeping() {
                    let _ = dev.completion.write(1);
                }
            }
        }
        worked
    }
}

/// The datapath: its shared core and its threads' wake-up eventfds.
pub struct Datapath {
    core: Mutex<Core>,
    wakers: Vec<EventFd>,
    spin: Duration,
    stop: AtomicBool,
}

impl Datapath {
    /// A datapath over `nic` with `threads` threads; completion rings hold
    /// `hold_limit` completions' worth of back-pressure per pQP.
    pub fn new(
        nic: Box<dyn Nic>,
        threads: u32,
        spin: Duration,
        hold_limit: usize,
        sched: Scheduler,
    ) -> io::Result<Arc<Self>> {
        let wakers = (0..threads.max(1))
            .map(|_| EventFd::new(EFD_NONBLOCK | EFD_CLOEXEC))
            .collect::<io::Result<Vec<_>>>()?;
        Ok(Arc::new(Datapath {
            core: Mutex::new(Core {
                nic,
                devices: BTreeMap::new(),
                held: IdMap::default(),
                generation: 0,
                scratch: Vec::new(),
                hold_limit,
                staged: IdMap::default(),
                sched,
                accounts: Accounts::default(),
            }),
            wakers,
            spin,
            stop: AtomicBool::new(false),
        }))
    }

    /// The shared core. A panic elsewhere must not take every tenant down
    /// with it, so a poisoned lock is taken over as is.
    pub fn lock(&self) -> MutexGuard<'_, Core> {
        self.core.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Wakes every datapath thread.
    pub fn wake(&self) {
        for w in &self.wakers {
            let _ = w.write(1);
        }
    }

    /// Starts serving a device's rings. `policy` is its tenant's, for the
    /// scheduler if it does not know the tenant yet (a reload keeps it
    /// current afterwards).
    pub fn add_device(&self, dev: Arc<DeviceQueues>, policy: &TenantPolicy) {
        {
            let mut core = self.lock();
            if !core.sched.knows(&dev.tenant) {
                core.sched.configure(policy, Instant::now());
            }
            core.sched.add_device(dev.id, &dev.tenant);
            core.rank_device(dev.id);
            core.accounts.attach(dev.id, &dev.tenant, dev.queues.len());
            core.devices.insert(dev.id, dev);
            core.generation += 1;
        }
        self.wake();
    }

    /// Stops serving a device and removes everything it had from the NIC.
    pub fn remove_device(&self, id: DeviceId) {
        {
            let mut core = self.lock();
            core.devices.remove(&id);
            core.nic.detach_device(id);
            core.held.retain(|(dev, _), _| *dev != id);
            core.staged.retain(|(dev, _), _| *dev != id);
            core.sched.remove_device(id);
            core.accounts.detach(id);
            core.generation += 1;
        }
        self.wake();
    }

    /// Starts the polling threads, each under the datapath's seccomp
    /// filter.
    pub fn start(self: &Arc<Self>, threads: &Threads) -> io::Result<Vec<JoinHandle<()>>> {
        (0..self.wakers.len())
            .map(|index| {
                let dp = Arc::clone(self);
                threads.spawn(Role::Datapath, format!("datapath-{index}"), move || {
                    if let Err(e) = dp.run_thread(index) {
                        tracing::error!("Datapath thread {index} failed: {e}");
                    }
                })
            })
            .collect()
    }

    /// Asks the threads to stop (tests, shutdown).
    pub fn stop(&self) {
        self.stop.store(true, Ordering::SeqCst);
        self.wake();
    }

    fn run_thread(&self, index: usize) -> io::Result<()> {
        let threads = self.wakers.len() as u64;
        let epoll = Epoll::new()?;
        let waker = &self.wakers[index];
        epoll.ctl(
            ControlOperation::Add,
            waker.as_raw_fd(),
            EpollEvent::new(EventSet::IN, WAKE_TOKEN),
        )?;
        let mut timer = TimerFd::new()?;
        epoll.ctl(
            ControlOperation::Add,
            timer.as_raw_fd(),
            EpollEvent::new(EventSet::IN, TIMER_TOKEN),
        )?;
        let mut mine: Vec<Arc<DeviceQueues>> = Vec::new();
        let mut seen = u64::MAX;
        let mut last_work = Instant::now();
        let mut spins: u32 = 0;
        let mut events = vec![EpollEvent::default(); 64];
        while !self.stop.load(Ordering::Relaxed) {
            let now = Instant::now();
            let round = {
                let mut core = self.lock();
                if core.generation != seen {
                    seen = core.generation;
                    let now_mine: Vec<_> = core
                        .devices
                        .values()
                        .filter(|d| d.id % threads == index as u64)
                        .cloned()
                        .collect();
                    // Unregister doorbells of departed devices before their
                    // fds close (vdev holds a duplicate, which would keep a
                    // stale registration alive).
                    for old in &mine {
                        if !now_mine.iter().any(|d| d.id == old.id) {
                            let _ = epoll.ctl(
                                ControlOperation::Delete,
                                old.doorbell.as_raw_fd(),
                                EpollEvent::default(),
                            );
                        }
                    }
                    for new in &now_mine {
                        if !mine.iter().any(|d| d.id == new.id) {
                            epoll.ctl(
                                ControlOperation::Add,
                                new.doorbell.as_raw_fd(),
                                EpollEvent::new(EventSet::IN, new.id),
                            )?;
                        }
                    }
                    mine = now_mine;
                }
                core.round(&mine, now)
            };
            if round.worked || round.busy {
                last_work = now;
                spins = spins.wrapping_add(1);
                // Share the core with vdevs on a 2-core host; between the
                // segments of a long message that higher-rank work is
                // waiting for, at once: the threads that produce that work
                // (its application, its vdev) may be waiting for this core,
                // which the copying would otherwise hold for the whole
                // message (a real NIC copies without the host's cores).
                if round.preempted || spins.is_multiple_of(64) {
                    std::thread::yield_now();
                }
                continue;
            }
            if now.duration_since(last_work) < self.spin {
                // Idle polling yields every turn: on a host with fewer cores
                // than polling threads, the work we wait for is produced by
                // a thread that needs this core.
                std::thread::yield_now();
                continue;
            }
            // Sleep: announce it on every ring, then look once more so a
            // vdev that published before seeing the flag is not missed.
            self.set_sleeping(&mine, true);
            if self.has_pending(&mine) {
                self.set_sleeping(&mine, false);
                continue;
            }
            let mut wait = round.next_due.map(|due| due.saturating_duration_since(now));
            if round.held {
                wait = Some(wait.map_or(HELD_RECHECK, |w| w.min(HELD_RECHECK)));
            }
            match wait {
                // timerfd: a zero duration would disarm it.
                Some(w) => timer.reset(w.max(Duration::from_micros(1)), None)?,
                None => timer.clear()?,
            }
            let n = match epoll.wait(-1, &mut events) {
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => 0,
                Err(e) => return Err(e),
            };
            for event in &events[..n] {
                match event.data() {
                    WAKE_TOKEN => {
                        let _ = waker.read();
                    }
                    TIMER_TOKEN => {
                        let _ = timer.clear();
                    }
                    id => {
                        if let Some(dev) = mine.iter().find(|d| d.id == id) {
                            let _ = dev.doorbell.read();
                        }
                    }
                }
            }
            self.set_sleeping(&mine, false);
            last_work = Instant::now();
        }
        Ok(())
    }

    fn set_sleeping(&self, mine: &[Arc<DeviceQueues>], sleeping: bool) {
        for dev in mine {
            for q in &dev.queues {
                if let Some(sq) = Ring::<PhysWqe>::new(&q.mem, dev.layout.sq) {
                    sq.prepare_sleep(sleeping);
                }
            }
        }
    }

    /// Whether any served submission ring has work the next round would
    /// take (a corrupt one counts: the next round deals with it). A ring
    /// held back by back-pressure, or whose staged WQE waits for the
    /// scheduler, does not count, or a tenant that never drains its
    /// completions or is rate limited would keep this thread spinning.
    fn has_pending(&self, mine: &[Arc<DeviceQueues>]) -> bool {
        let core = self.lock();
        mine.iter()
            .filter(|d| !d.failed.load(Ordering::Relaxed))
            .any(|dev| {
                dev.queues.iter().any(|q| {
                    !core.staged.contains_key(&(dev.id, q.pqp))
                        && core.room(dev.id, q.pqp) > 0
                        && Ring::<PhysWqe>::new(&q.mem, dev.layout.sq)
                            .is_some_and(|sq| sq.pending().map_or(true, |n| n > 0))
                })
            })
    }
}
