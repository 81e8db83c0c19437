//! The connection manager's thread and its handles.
//!
//! [`CmService::start`] asks hostd to signal an eventfd when MADs arrive
//! for the device's QP1 and starts one thread (seccomp role
//! [`Role::Cm`]) that sleeps on it — and on a wake-up eventfd — with the
//! agent's next deadline as timeout, drains the MADs (`TakeMads`) into the
//! agent, runs its timers, and sends what it wants sent (`SendMad`).
//! Commands run on the caller's thread ([`CmOwner`]), under the same
//! lock, and wake the thread when they bring a deadline forward.

use std::net::SocketAddrV4;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};
use vrdma_hostd_protocol::channel::{Channel, ChannelError};
use vrdma_hostd_protocol::messages::{MadIn, Response};
use vrdma_spec::verbs::{QpState, QpType};

use super::state::{CmConfig, State};
use super::{CmCounters, CmError, CmEvent, ConnParam, IdInfo, IdNum, OwnerId, PortSpace, QpAttr};
use crate::fabric::Fabric;
use crate::seccomp::{Role, Threads};

/// MADs taken from hostd per `TakeMads`.
const TAKE_BATCH: u32 = 64;
/// How soon the thread tries again after `TakeMads` failed.
const TAKE_RETRY: Duration = Duration::from_millis(100);

/// What the thread and the handles share.
struct Shared {
    state: Mutex<State>,
    /// The registration QP1 is reached through (a context's; replaced by
    /// [`CmService::rebind`] when that context ends).
    fabric: Mutex<Arc<Fabric>>,
    /// Signalled by hostd when MADs arrive and wait to be taken.
    gsi: EventFd,
    /// Where hostd pushes MADs while none waits ([`Fabric::gsi_push`]):
    /// replaced when QP1 is asked for again (a restarted hostd, another
    /// context); the thread reads the old one out before the new.
    push: Mutex<Option<Arc<Channel>>>,
    /// Signalled by commands that bring a deadline forward, and by stop.
    wake: EventFd,
    stop: AtomicBool,
    tenant: Arc<str>,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn push(&self) -> Option<Arc<Channel>> {
        self.push.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Push socket `p` is closed: no longer the one in use (unless it was
    /// replaced meanwhile).
    fn forget_push(&self, p: &Arc<Channel>) {
        let mut push = self.push.lock().unwrap_or_else(|p| p.into_inner());
        if push.as_ref().is_some_and(|q| Arc::ptr_eq(p, q)) {
            *push = None;
        }
    }

    /// Asks `fabric`'s hostd for QP1's wake-ups and pushed MADs.
    fn attach(&self, fabric: &Fabric) -> Result<(), CmError> {
        fabric.gsi_notify(&self.gsi).map_err(CmError::Fabric)?;
        let push = match fabric.gsi_push() {
            Ok(push) => Some(Arc::new(push)),
            Err(e) => {
                // MADs are all taken then: slower, as correct.
                tracing::warn!(tenant = %self.tenant,
                    "hostd pushes no CM MADs; each is taken: {}", vrdma_errors::error_chain(&e));
                None
            }
        };
        *self.push.lock().unwrap_or_else(|p| p.into_inner()) = push;
        Ok(())
    }

    fn fabric(&self) -> Arc<Fabric> {
        self.fabric
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Runs `f` on the state; wakes the thread if the agent's next
    /// deadline moved earlier.
    fn command<T>(&self, f: impl FnOnce(&mut State, Instant, &Fabric) -> T) -> T {
        let fabric = self.fabric();
        let mut st = self.lock();
        let before = st.next_deadline();
        let out = f(&mut st, Instant::now(), &fabric);
        let after = st.next_deadline();
        drop(st);
        let earlier = match (before, after) {
            (_, None) => false,
            (None, Some(_)) => true,
            (Some(b), Some(a)) => a < b,
        };
        if earlier {
            let _ = self.wake.write(1);
        }
        out
    }
}

/// One device's connection manager: its thread, and the owners that
/// issue commands to it.
pub struct CmService {
    shared: Arc<Shared>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl std::fmt::Debug for CmService {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CmService")
            .field("tenant", &self.shared.tenant)
            .finish_non_exhaustive()
    }
}

impl CmService {
    /// Starts the connection manager of the device `fabric` registered,
    /// for `tenant`, on a thread of role [`Role::Cm`].
    pub fn start(
        fabric: Arc<Fabric>,
        tenant: &str,
        config: CmConfig,
        threads: &Threads,
    ) -> Result<CmService, CmError> {
        let tenant: Arc<str> = Arc::from(tenant);
        let state = State::new(tenant.clone(), fabric.gid, config)?;
        let gsi = EventFd::new(EFD_NONBLOCK).map_err(CmError::Io)?;
        let wake = EventFd::new(EFD_NONBLOCK).map_err(CmError::Io)?;
        let shared = Arc::new(Shared {
            state: Mutex::new(state),
            fabric: Mutex::new(fabric.clone()),
            gsi,
            push: Mutex::new(None),
            wake,
            stop: AtomicBool::new(false),
            tenant,
        });
        shared.attach(&fabric)?;
        let for_thread = shared.clone();
        let thread = threads
            .spawn(Role::Cm, "cm", move || serve(&for_thread))
            .map_err(CmError::Thread)?;
        tracing::info!(tenant = %shared.tenant, ip = %shared.lock().local_ip(),
            "Connection manager started");
        Ok(CmService {
            shared,
            thread: Mutex::new(Some(thread)),
        })
    }

    /// A new owner of CM IDs (`rdma_create_event_channel`).
    pub fn open_owner(&self) -> Result<CmOwner, CmError> {
        let mut st = self.shared.lock();
        let owner = st.create_owner()?;
        let events = st.owner_eventfd(owner)?;
        Ok(CmOwner {
            shared: self.shared.clone(),
            owner,
            events,
        })
    }

    /// The device was registered again with a restarted hostd
    /// ([`Fabric::reconnect`]): asks the new hostd for QP1's wake-ups and
    /// takes what already waits. Connections of the old hostd's time run
    /// on (their peers may still answer); none is torn down here.
    pub fn hostd_restarted(&self) -> Result<(), CmError> {
        let fabric = self.shared.fabric();
        self.shared.attach(&fabric)?;
        // The new hostd's network may have another MTU: routes resolved
        // from now on get it.
        self.shared.lock().set_path_mtu(fabric.active_mtu().into());
        let _ = self.shared.wake.write(1);
        tracing::info!(tenant = %self.shared.tenant,
            "Connection manager attached to the restarted hostd");
        Ok(())
    }

    /// QP1 is reached through `fabric` from now on (another context's
    /// registration, when the one in use ends): hostd is asked for QP1's
    /// wake-ups on it, and the thread carries on with it. The device's IDs
    /// and connections stay as they are.
    pub fn rebind(&self, fabric: Arc<Fabric>) -> Result<(), CmError> {
        self.shared.attach(&fabric)?;
        *self.shared.fabric.lock().unwrap_or_else(|p| p.into_inner()) = fabric;
        let _ = self.shared.wake.write(1);
        Ok(())
    }

    /// The counters now.
    pub fn counters(&self) -> CmCounters {
        let mut counters = self.shared.lock().counters();
        // Sent without waiting: hostd's refusals come later, to the
        // registration (those of the one in use).
        counters.send_failed += self.shared.fabric().mads_refused();
        counters
    }

    /// Stops the thread (owners' commands fail from then on only where
    /// they need hostd; MADs are no longer taken). Idempotent.
    pub fn stop(&self) {
        self.shared.stop.store(true, Ordering::Release);
        let _ = self.shared.wake.write(1);
        let thread = self.thread.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(t) = thread {
            if t.join().is_err() {
                tracing::error!(tenant = %self.shared.tenant, "The connection manager's thread panicked");
            }
        }
    }
}

impl Drop for CmService {
    fn drop(&mut self) {
        self.stop();
    }
}

/// The thread: wait for MADs or the next deadline, read the MADs hostd
/// pushed, take those that wait in hostd when it signals, run the timers,
/// send; until stopped or the registration ends.
fn serve(shared: &Shared) {
    let (mut retry_take, mut failing) = (false, false);
    let mut push = shared.push();
    loop {
        if shared.stop.load(Ordering::Acquire) {
            break;
        }
        let now = Instant::now();
        let deadline = shared.lock().next_deadline();
        let mut timeout = deadline.map(|d| d.saturating_duration_since(now));
        if retry_take {
            timeout = Some(timeout.map_or(TAKE_RETRY, |t| t.min(TAKE_RETRY)));
        }
        let mut fds = vec![shared.gsi.as_raw_fd(), shared.wake.as_raw_fd()];
        fds.extend(push.as_ref().map(|p| p.as_raw_fd()));
        if let Err(e) = wait_readable(&fds, timeout) {
            tracing::error!(tenant = %shared.tenant, error = %e,
                "The connection manager cannot wait; it stops");
            break;
        }
        // Non-blocking: a counter already read is fine.
        let signalled = shared.gsi.read().is_ok();
        let _ = shared.wake.read();
        if shared.stop.load(Ordering::Acquire) {
            break;
        }
        // Pushed MADs: a replaced socket's first (they are older), then
        // the one in use now. (A MAD hostd pushed on the old one between
        // its last read here and its replacement is lost, as a datagram on
        // QP1 may be: the CM's retries cover it.)
        let mut pushed = Vec::new();
        push = push.and_then(|p| drain_pushed(shared, p, &mut pushed));
        let latest = shared.push();
        if push.as_ref().map(Arc::as_ptr) != latest.as_ref().map(Arc::as_ptr) {
            push = latest.and_then(|p| drain_pushed(shared, p, &mut pushed));
        }
        let fabric = shared.fabric();
        if !pushed.is_empty() {
            handle_mads(shared, &fabric, &pushed);
        }
        let take = std::mem::take(&mut retry_take) || signalled || failing;
        if fabric.closed() {
            // Its context ended: nothing to take until the service is
            // rebound (which wakes it); timers still run.
            let now = Instant::now();
            let mut st = shared.lock();
            st.tick(now);
            st.flush(now, &*fabric);
            continue;
        }
        // MADs wait in hostd only after it signalled (one found the push
        // socket full, or there is none); taken until a batch comes short.
        if take {
            loop {
                match fabric.take_mads(TAKE_BATCH) {
                    Ok(mads) => {
                        if std::mem::take(&mut failing) {
                            // hostd may be a new one (the registration was made
                            // again): ask it for QP1's wake-ups again.
                            match shared.attach(&fabric) {
                                Ok(()) => tracing::info!(tenant = %shared.tenant,
                                    "CM MADs are taken again"),
                                Err(e) => tracing::warn!(tenant = %shared.tenant,
                                    "CM MADs are taken again, but without wake-ups: {}",
                                    vrdma_errors::error_chain(&e)),
                            }
                        }
                        handle_mads(shared, &fabric, &mads);
                        if mads.len() < TAKE_BATCH as usize {
                            break;
                        }
                    }
                    Err(e) => {
                        if fabric.closed() {
                            tracing::debug!(tenant = %shared.tenant,
                                "The registration in use ended; waiting to be rebound");
                            break;
                        }
                        shared.lock().note_take_failed();
                        // Once per outage (hostd away: retried every 100 ms).
                        if !failing {
                            tracing::warn!(tenant = %shared.tenant,
                                "Cannot take CM MADs from hostd: {}", vrdma_errors::error_chain(&e));
                        }
                        failing = true;
                        retry_take = true;
                        break;
                    }
                }
            }
        }
        let now = Instant::now();
        let mut st = shared.lock();
        st.tick(now);
        st.flush(now, &*fabric);
    }
    tracing::debug!(tenant = %shared.tenant, "Connection manager stopped");
}

/// Gives the agent `mads` and sends what it wants sent.
fn handle_mads(shared: &Shared, fabric: &Fabric, mads: &[MadIn]) {
    let now = Instant::now();
    let mut st = shared.lock();
    for mad in mads {
        st.handle_mad(now, mad);
    }
    st.flush(now, fabric);
}

/// Reads every MAD waiting on push socket `p` into `out`; `p` again while
/// it is open, `None` once it is closed or broken (hostd gone: forgotten,
/// not to be polled again).
fn drain_pushed(shared: &Shared, p: Arc<Channel>, out: &mut Vec<MadIn>) -> Option<Arc<Channel>> {
    loop {
        match p.try_recv::<Response>() {
            Ok(Some(Response::Mads(mads))) => out.extend(mads),
            Ok(Some(other)) => {
                tracing::warn!(tenant = %shared.tenant, ?other,
                    "Not a MAD on QP1's push socket: ignored");
            }
            Ok(None) => return Some(p),
            Err(ChannelError::Message(e)) => {
                tracing::warn!(tenant = %shared.tenant,
                    "Undecodable message on QP1's push socket: {}", vrdma_errors::error_chain(&e));
            }
            Err(_) => {
                shared.forget_push(&p);
                return None;
            }
        }
    }
}

/// Waits until one of `fds` (eventfds the caller keeps open) is readable or `timeout` passes (`None`:
/// no timeout); EINTR counts as a wake-up.
fn wait_readable(fds: &[RawFd], timeout: Option<Duration>) -> std::io::Result<()> {
    let mut pollfds: Vec<libc::pollfd> = fds
        .iter()
        .map(|fd| libc::pollfd {
            fd: *fd,
            events: libc::POLLIN,
            revents: 0,
        })
        .collect();
    let ts = timeout.map(|t| libc::timespec {
        tv_sec: libc::time_t::try_from(t.as_secs()).unwrap_or(libc::time_t::MAX),
        // Below 10^9.
        tv_nsec: t.subsec_nanos() as libc::c_long,
    });
    let ts_ptr = ts
        .as_ref()
        .map_or(std::ptr::null(), |t| t as *const libc::timespec);
    // SAFETY: `pollfds` is a valid, writable array of `pollfds.len()`
    // entries that outlives the call (ppoll only reads and writes those
    // entries; a closed descriptor in it would only be reported POLLNVAL), `ts_ptr` is null or points at a timespec that
    // lives until the call returns, and the signal mask pointer is null
    // (the thread's mask is kept).
    let rc = unsafe {
        libc::ppoll(
            pollfds.as_mut_ptr(),
            pollfds.len() as libc::nfds_t,
            ts_ptr,
            std::ptr::null(),
        )
    };
    if rc < 0 {
        let e = std::io::Error::last_os_error();
        if e.kind() != std::io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
    Ok(())
}

/// One owner of CM IDs (an event channel of a context): every rdma_cm
/// call on its IDs, and its events. Dropping it destroys its IDs (DREQ for
/// established connections, REJ for pending ones).
pub struct CmOwner {
    shared: Arc<Shared>,
    owner: OwnerId,
    events: EventFd,
}

impl std::fmt::Debug for CmOwner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CmOwner")
            .field("tenant", &self.shared.tenant)
            .field("owner", &self.owner)
            .finish_non_exhaustive()
    }
}

impl CmOwner {
    pub fn id(&self) -> OwnerId {
        self.owner
    }

    /// The eventfd signalled when an event is queued for this owner
    /// (`rdma_event_channel.fd`); read it, then take events until none.
    pub fn event_fd(&self) -> RawFd {
        self.events.as_raw_fd()
    }

    /// `rdma_create_id` (`qp_type` only matters for [`PortSpace::Ib`]).
    pub fn create_id(&self, ps: PortSpace, qp_type: Option<QpType>) -> Result<IdNum, CmError> {
        self.shared
            .command(|st, _, _| st.create_id(self.owner, ps, qp_type))
    }

    /// `rdma_bind_addr`.
    pub fn bind_addr(&self, id: IdNum, addr: SocketAddrV4) -> Result<SocketAddrV4, CmError> {
        self.shared
            .command(|st, _, _| st.bind_addr(self.owner, id, addr))
    }

    /// `rdma_listen`.
    pub fn listen(&self, id: IdNum, backlog: u32) -> Result<(), CmError> {
        self.shared
            .command(|st, _, _| st.listen(self.owner, id, backlog))
    }

    /// `rdma_resolve_addr` (ADDR_RESOLVED or ADDR_ERROR follows).
    pub fn resolve_addr(
        &self,
        id: IdNum,
        src: Option<SocketAddrV4>,
        dst: SocketAddrV4,
    ) -> Result<(), CmError> {
        self.shared
            .command(|st, _, f| st.resolve_addr(self.owner, id, src, dst, f))
    }

    /// `rdma_resolve_route` (ROUTE_RESOLVED follows).
    pub fn resolve_route(&self, id: IdNum) -> Result<(), CmError> {
        self.shared
            .command(|st, _, _| st.resolve_route(self.owner, id))
    }

    /// `rdma_connect`.
    pub fn connect(&self, id: IdNum, param: &ConnParam) -> Result<(), CmError> {
        self.shared
            .command(|st, now, f| st.connect(now, self.owner, id, param, f))
    }

    /// `rdma_accept`.
    pub fn accept(&self, id: IdNum, param: &ConnParam) -> Result<(), CmError> {
        self.shared
            .command(|st, now, f| st.accept(now, self.owner, id, param, f))
    }

    /// `rdma_reject`.
    pub fn reject(&self, id: IdNum, private_data: &[u8]) -> Result<(), CmError> {
        self.shared
            .command(|st, now, f| st.reject(now, self.owner, id, private_data, f))
    }

    /// `rdma_establish` (or what librdmacm does after moving an ID's QP
    /// on CONNECT_RESPONSE): the RTU, and ESTABLISHED for the ID.
    pub fn establish(&self, id: IdNum) -> Result<(), CmError> {
        self.shared
            .command(|st, now, f| st.establish(now, self.owner, id, f))
    }

    /// `rdma_disconnect`.
    pub fn disconnect(&self, id: IdNum) -> Result<(), CmError> {
        self.shared
            .command(|st, now, f| st.disconnect(now, self.owner, id, f))
    }

    /// `rdma_destroy_id`.
    pub fn destroy_id(&self, id: IdNum) -> Result<(), CmError> {
        self.shared
            .command(|st, now, f| st.destroy_id(now, self.owner, id, f))
    }

    /// `rdma_init_qp_attr`.
    pub fn init_qp_attr(&self, id: IdNum, state: QpState) -> Result<QpAttr, CmError> {
        self.shared.lock().init_qp_attr(self.owner, id, state)
    }

    /// The ID's addresses, route and state (`rdma_cm_id`'s fields).
    pub fn query(&self, id: IdNum) -> Result<IdInfo, CmError> {
        self.shared.lock().query(self.owner, id)
    }

    /// `rdma_get_cm_event` without blocking.
    pub fn get_event(&self) -> Result<Option<CmEvent>, CmError> {
        self.shared.lock().get_event(self.owner)
    }

    /// `rdma_get_cm_event`, waiting at most `timeout` for an event.
    pub fn wait_event(&self, timeout: Duration) -> Result<Option<CmEvent>, CmError> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(e) = self.get_event()? {
                return Ok(Some(e));
            }
            let now = Instant::now();
            if now >= deadline {
                return Ok(None);
            }
            wait_readable(&[self.events.as_raw_fd()], Some(deadline - now)).map_err(CmError::Io)?;
            let _ = self.events.read();
        }
    }

    /// Closes the owner: its IDs are destroyed, its events dropped.
    pub fn close(self) {
        drop(self);
    }
}

impl Drop for CmOwner {
    fn drop(&mut self) {
        let owner = self.owner;
        self.shared
            .command(|st, now, f| st.close_owner(now, owner, f));
    }
}
