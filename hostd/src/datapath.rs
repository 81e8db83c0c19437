//! The datapath threads: they run the [`Engine`] over the devices they
//! serve, polling while there is work and sleeping when there is none.
//!
//! `datapath_threads` threads (one by default: on a host with few cores,
//! every spinning thread takes a core from the tenants) share one engine
//! behind a mutex; thread `i` takes the doorbells of the devices with
//! `id % threads == i`, and any thread runs whatever the scheduler picks.
//! Control requests take the same lock between rounds.
//!
//! With `datapath_cpus`, thread `i` runs only on CPU `datapath_cpus[i %
//! n]`: the operator has dedicated those cores to the datapath, as to a
//! NIC's packet cores, and the tenants' threads run elsewhere.
//!
//! Polling is adaptive: after its last work a thread keeps polling for
//! `spin_us`, yielding its core every turn (the work it waits for is
//! produced by a thread that may need this core) — every
//! [`YIELD_EVERY`] turns on a dedicated core, where a yield finds nobody
//! to run and only delays the next look. Then it asks its
//! devices' drivers to kick (NEED_KICK in each doorbell page), looks once
//! more — a driver that rang before it saw the flag is found here — and
//! sleeps in epoll on the drivers' doorbell eventfds, its wake eventfd
//! (devices came or went, a control request made work), a timerfd for
//! the earliest RNR or retry timer, rate limit or port slot, and (thread
//! 0, in a cluster) the network's receive queue.

use std::io;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::eventfd::{EventFd, EFD_CLOEXEC, EFD_NONBLOCK};
use vmm_sys_util::timerfd::TimerFd;

use crate::engine::guest::SummaryHint;
use crate::engine::{DeviceId, Engine};
use crate::seccomp::{Role, Threads};

/// epoll tokens that are not device ids (device ids start at 1).
const WAKE_TOKEN: u64 = u64::MAX;
const TIMER_TOKEN: u64 = u64::MAX - 1;
const PACKETS_TOKEN: u64 = u64::MAX - 2;
/// Busy turns between two yields of a thread that has work: often enough
/// that tenants' threads sharing its core get it, rarely enough to cost
/// nothing.
const YIELD_EVERY: u32 = 64;

/// The datapath: the engine and its threads' wake-up eventfds.
pub struct Datapath {
    engine: Mutex<Engine>,
    wakers: Vec<EventFd>,
    /// The dedicated CPUs (empty: none).
    cpus: Vec<usize>,
    spin: Duration,
    stop: AtomicBool,
}

impl Datapath {
    /// A datapath over `engine` with `threads` threads, on `cpus` if any,
    /// spinning `spin` after their last work.
    pub fn new(
        engine: Engine,
        threads: u32,
        cpus: Vec<usize>,
        spin: Duration,
    ) -> io::Result<Arc<Self>> {
        let wakers = (0..threads.max(1))
            .map(|_| EventFd::new(EFD_NONBLOCK | EFD_CLOEXEC))
            .collect::<io::Result<Vec<_>>>()?;
        Ok(Arc::new(Datapath {
            engine: Mutex::new(engine),
            wakers,
            cpus,
            spin,
            stop: AtomicBool::new(false),
        }))
    }

    /// The engine. A panic elsewhere must not take every tenant down with
    /// it, so a poisoned lock is taken over as is.
    pub fn lock(&self) -> MutexGuard<'_, Engine> {
        self.engine.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Wakes every datapath thread (devices came or went, or a control
    /// request made work: a QP moved to RTS or ERR).
    pub fn wake(&self) {
        for w in &self.wakers {
            let _ = w.write(1);
        }
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
        let dedicated = !self.cpus.is_empty();
        if dedicated {
            let cpu = self.cpus[index % self.cpus.len()];
            vrdma_isolation::cpus::pin_current_thread(&[cpu])?;
            tracing::info!("Datapath thread {index} runs on CPU {cpu}");
        }
        let idle_yield_every = if dedicated { YIELD_EVERY } else { 1 };
        let waker = &self.wakers[index];
        let epoll = Epoll::new()?;
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
        // Thread 0 also sleeps on the network's receive queue (any thread's
        // round takes packets; one watcher is enough to be woken).
        if index == 0 {
            if let Some(fd) = self.lock().wire().map(|w| w.rx_fd()) {
                epoll.ctl(
                    ControlOperation::Add,
                    fd,
                    EpollEvent::new(EventSet::IN, PACKETS_TOKEN),
                )?;
            }
        }
        let mut mine = Mine::default();
        let mut last_work = Instant::now();
        let mut turns: u32 = 0;
        let mut events = vec![EpollEvent::default(); 64];
        while !self.stop.load(Ordering::Relaxed) {
            let now = Instant::now();
            let round = {
                let mut engine = self.lock();
                mine.sync(&engine, &epoll, index as u64, threads)?;
                mine.find_rung();
                engine.round(&mine.rung, now)
            };
            if round.worked || round.busy {
                last_work = now;
                turns = turns.wrapping_add(1);
                // Between the segments of a long message that higher-class
                // work waits for, at once: the threads producing that work
                // may be waiting for this core (not on a dedicated one).
                if (round.preempted && !dedicated) || turns.is_multiple_of(YIELD_EVERY) {
                    std::thread::yield_now();
                }
                continue;
            }
            if now.duration_since(last_work) < self.spin {
                turns = turns.wrapping_add(1);
                if turns.is_multiple_of(idle_yield_every) {
                    std::thread::yield_now();
                } else {
                    std::hint::spin_loop();
                }
                continue;
            }
            // Sleep: ask for kicks, then look once more, so that a driver
            // that rang before it could see the request is not missed.
            {
                let engine = self.lock();
                engine.set_need_kick(&mine.ids, true);
                if engine.has_pending(&mine.ids) {
                    engine.set_need_kick(&mine.ids, false);
                    continue;
                }
            }
            match round.next_due {
                // timerfd: a zero duration would disarm it.
                Some(due) => timer.reset(
                    due.saturating_duration_since(now)
                        .max(Duration::from_micros(1)),
                    None,
                )?,
                None => timer.clear()?,
            }
            let n = match epoll.wait(-1, &mut events) {
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => 0,
                Err(e) => return Err(e),
            };
            let engine = self.lock();
            for event in &events[..n] {
                match event.data() {
                    WAKE_TOKEN => {
                        let _ = waker.read();
                    }
                    TIMER_TOKEN => {
                        let _ = timer.clear();
                    }
                    // The next round reads them.
                    PACKETS_TOKEN => {}
                    id => mine.clear(id),
                }
            }
            engine.set_need_kick(&mine.ids, false);
            drop(engine);
            last_work = Instant::now();
        }
        Ok(())
    }
}

/// The devices a thread serves and the doorbell eventfds it sleeps on.
///
/// The thread sleeps on its own duplicates of the drivers' kick eventfds:
/// epoll watches an open file, not a descriptor number, so a registration
/// can only be removed through a descriptor of that file. With its own
/// duplicate the thread removes a departed doorbell's registration whenever
/// it notices, whatever the engine or the vdev closed meanwhile — a kick
/// eventfd still open elsewhere would otherwise stay registered and, never
/// read again, keep waking the thread.
#[derive(Default)]
struct Mine {
    generation: Option<u64>,
    ids: Vec<DeviceId>,
    /// A look at the doorbell summary of each device of `ids` that has a
    /// doorbell, in the same order (`None`: no doorbell, nothing to take;
    /// `Some(None)`: a doorbell without a summary to look at, the engine
    /// decides).
    hints: Vec<Option<Option<SummaryHint>>>,
    /// The devices whose doorbells the next round takes.
    rung: Vec<DeviceId>,
    /// (device, doorbell serial, our duplicate of its kick eventfd), each
    /// registered with the thread's epoll.
    kicks: Vec<(DeviceId, u64, EventFd)>,
}

impl Mine {
    /// Catches up with the devices the engine has now (when its
    /// generation moved): unregisters departed doorbells, registers new
    /// ones.
    fn sync(&mut self, engine: &Engine, epoll: &Epoll, index: u64, threads: u64) -> io::Result<()> {
        if self.generation == Some(engine.generation()) {
            return Ok(());
        }
        self.generation = Some(engine.generation());
        let now = engine.devices_of_thread(index, threads);
        let live = |id: DeviceId, serial: u64| {
            now.iter()
                .any(|&(d, bell)| d == id && bell.is_some_and(|(s, _)| s == serial))
        };
        let mut kept = Vec::with_capacity(self.kicks.len());
        for (id, serial, fd) in self.kicks.drain(..) {
            if live(id, serial) {
                kept.push((id, serial, fd));
            } else {
                let _ = epoll.ctl(
                    ControlOperation::Delete,
                    fd.as_raw_fd(),
                    EpollEvent::default(),
                );
            }
        }
        self.kicks = kept;
        for &(id, bell) in &now {
            let Some((serial, kick)) = bell else {
                continue;
            };
            if self.kicks.iter().any(|&(d, s, _)| d == id && s == serial) {
                continue;
            }
            let fd = kick.try_clone()?;
            epoll.ctl(
                ControlOperation::Add,
                fd.as_raw_fd(),
                EpollEvent::new(EventSet::IN, id),
            )?;
            self.kicks.push((id, serial, fd));
        }
        // A device without a doorbell (a context whose driver has not set
        // its page yet, one waiting for its frontend) has nothing to take:
        // rounds skip it, however many there are.
        self.hints = (now.iter())
            .map(|&(id, bell)| bell.map(|_| engine.doorbell_hint(id)))
            .collect();
        self.ids = now.into_iter().map(|(id, _)| id).collect();
        Ok(())
    }

    /// The devices a round should take doorbells of: those with a doorbell
    /// whose summary shows a bit, or that has no summary to look at.
    fn find_rung(&mut self) {
        self.rung.clear();
        let rung = (self.ids.iter().zip(&self.hints))
            .filter(|(_, hint)| {
                hint.as_ref()
                    .is_some_and(|page| page.as_ref().is_none_or(SummaryHint::rung))
            })
            .map(|(&id, _)| id);
        self.rung.extend(rung);
    }

    /// Takes the kick the thread woke for (on its own duplicate, which is
    /// the same eventfd).
    fn clear(&self, id: DeviceId) {
        for (_, _, fd) in self.kicks.iter().filter(|k| k.0 == id) {
            let _ = fd.read();
        }
    }
}
