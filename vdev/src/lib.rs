//! vdev: the vhost-user backend of one tenant's vrdma virtual RDMA device.
//!
//! One vdev process serves one tenant VM (or process-mode application). It
//! parses untrusted guest input, so it holds only that tenant's state.
//!
//! - [`config`]: command line and config file, validated into [`Config`].
//! - [`backend`]: the `VhostUserBackend` implementation (features, config
//!   space, memory table, the control queue's events).
//! - [`vrings`]: every virtqueue of the device, and the eventfds of the
//!   doorbell and event queues lent to hostd.
//! - [`control`]: control-queue chains in, responses out; hostile-input
//!   framing checks.
//! - [`verbs`]: the tenant's verbs objects (PD, MR, CQ, QP, doorbell page,
//!   event rings) and the control verbs on them, with limits and the RC
//!   state machine.
//! - [`fabric`]: the registration with hostd, which runs the datapath: it
//!   reads the rings vdev set up, and vdev never touches them again.
//! - [`link`]: the registrations across hostd's restarts: the port down
//!   while hostd is away, every context registered again when it is back.
//! - [`shadow`]: shadow memory regions — guest ranges resolved into guest
//!   memory slots, with bounds, access and revocation.
//! - [`sandbox`]: the walls vdev puts up around itself before it serves
//!   (namespaces, landlock, privileges, seccomp; `vrdma-isolation` builds
//!   them), in the order `main.rs` runs them.
//! - [`seccomp`]: vdev's thread roles and the system calls each may make.
//! - [`cm`]: the device's connection manager (rdma_cm's semantics over
//!   vrdma-cm's agent, on QP1 through hostd), one thread per device; the
//!   guest reaches it through `verbs::cm` (the `CM_*` commands, a context's
//!   CM channels, and the CM event queue).
//!
//! Start-up is split so that everything needing the file system or
//! privileges happens before the sandbox: [`open`] binds the listener, then
//! [`run`] registers with hostd (as the unprivileged uid hostd checks) and
//! serves inside the sandbox.

pub mod backend;
pub mod cm;
pub mod config;
pub mod control;
pub mod fabric;
pub mod link;
pub mod sandbox;
pub mod seccomp;
pub mod shadow;
pub mod verbs;
pub mod vrings;

use std::sync::Arc;
use std::time::Duration;

use fabric::Fabric;
use vrdma_hostd_protocol::channel::bind_published;

use vhost::vhost_user::Listener;

pub use backend::VrdmaBackend;
pub use config::Config;
use seccomp::{Role, Threads};
use verbs::DeviceIdentity;

/// Why vdev stopped.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("Cannot register with hostd")]
    Fabric(#[source] fabric::FabricError),
    #[error("Cannot set the device up")]
    Setup(#[source] std::io::Error),
    #[error("Cannot set the vhost-user daemon up")]
    Daemon(#[source] backend::DaemonSetupError),
    #[error("Serving {socket} failed")]
    Serve {
        socket: String,
        #[source]
        source: DaemonError,
    },
    #[error("Cannot start the {0} thread")]
    Thread(&'static str, #[source] std::io::Error),
}

/// vhost-user-backend's error, which implements only `Display`, made a
/// `std::error::Error` so it can sit in a source chain.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct DaemonError(vhost_user_backend::Error);

/// What vdev opens before entering its sandbox.
pub struct Opened {
    /// The vhost-user listening socket, bound once for the daemon's life.
    listener: Listener,
    /// Its path, removed when vdev stops.
    socket_file: SocketFile,
}

impl std::fmt::Debug for Opened {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Opened").finish_non_exhaustive()
    }
}

/// A socket path removed on drop (vhost's `Listener` removes only the
/// paths it bound itself).
struct SocketFile(std::path::PathBuf);

impl Drop for SocketFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// Binds the vhost-user socket. Runs before the sandbox.
pub fn open(config: &Config) -> Result<Opened, Error> {
    // The socket file appears only once it listens, so a frontend that
    // waits for it never meets ECONNREFUSED.
    let listener = bind_published(&config.socket, |path| {
        std::os::unix::net::UnixListener::bind(path)
    })
    .map(Listener::from)
    .map_err(|e| Error::Serve {
        socket: config.socket.display().to_string(),
        source: DaemonError(vhost_user_backend::Error::CreateVhostUserListener(
            vhost::vhost_user::Error::SocketError(e),
        )),
    })?;
    let socket_file = SocketFile(config.socket.clone());
    Ok(Opened {
        listener,
        socket_file,
    })
}

/// Frontends served at once: each is a context of the device (hostd's
/// `MAX_CONTEXTS_PER_DEVICE`). One more waits in the listener's backlog
/// until a context closes.
pub const MAX_CONTEXTS: usize = 64;

/// What a frontend's thread tells the main thread.
enum Event {
    /// Context `id`'s frontend connected: the listener, for the next one.
    Accepted(u64, Listener),
    /// Context `id`'s frontend left (or its connection failed).
    Ended(u64, Result<(), vhost_user_backend::Error>),
    /// Context `id` could not accept a frontend at all; the listener back.
    Failed(u64, Error, Listener),
    /// Context `id`'s registration with hostd ended without vdev ending
    /// it: hostd went away, and the context's port is down.
    HostdLost(u64),
}

/// A context being served, as the main thread keeps it.
struct Context {
    backend: VrdmaBackend,
    thread: std::thread::JoinHandle<()>,
}

/// Serves the device on the listener [`open`] bound: every frontend that
/// connects is a context of the device, served at once beside the others
/// (at most [`MAX_CONTEXTS`]), with its own objects and its own
/// registration with hostd (`OpenContext`: the device's one LID and GID);
/// quotas and QP numbers are the device's, over all contexts
/// ([`verbs::DeviceShare`]). A context's end releases its objects only.
/// With `config.once`, vdev stops after its first frontend left. The
/// listening socket is created once, so a frontend that connects while
/// the next context is being set up waits in its backlog. Every thread is
/// started through `threads`, under its role's seccomp filter.
pub fn run(config: &Config, opened: Opened, threads: &Threads) -> Result<(), Error> {
    let Opened {
        listener,
        socket_file: _socket_file,
    } = opened;
    let identity = DeviceIdentity {
        tenant: Arc::from(config.tenant.as_str()),
        lid: config.lid,
        // Without hostd the device is alone, on a RoCE port: its GID only
        // names it.
        link_layer: Default::default(),
        gid: vrdma_spec::gid::loopback_gid(config.lid),
        comp_vectors: config.comp_vectors,
        max_queue_size: config.queue_size,
        active_mtu: verbs::PORT_MTU,
    };
    let device_name = device_name(&config.socket);
    let share = verbs::DeviceShare::default();
    // On hostd the device has a connection manager: its contexts find it
    // here while it runs, and advertise the CM event queue.
    let cm_fits = verbs::cm::cm_queue_index(config.comp_vectors).is_some();
    if config.hostd.is_some() && !cm_fits {
        tracing::warn!(tenant = %config.tenant, vectors = config.comp_vectors,
            "No connection manager for the guest: its event queue would be past queue 63");
    }
    let cm_slot = (config.hostd.is_some() && cm_fits).then(verbs::cm::CmSlot::default);
    let (events, happened) = std::sync::mpsc::channel();
    let mut listener = Some(listener);
    let mut contexts: std::collections::HashMap<u64, Context> = Default::default();
    let (mut next_id, mut accepting) = (0u64, false);
    // A registration failed after start (hostd restarting, or full): no
    // further context until a retry works; the contexts open carry on and
    // a frontend waits in the listener's backlog meanwhile.
    let mut held_back = false;
    let mut hold = link::Backoff::new(HOLD_BACK_FIRST_PAUSE);
    let mut link = link::Link::new(&config.tenant);
    // The device's connection manager, on one context's registration.
    let mut cm: Option<DeviceCm> = None;
    // What a context's listener calls when hostd goes away.
    let lost = |id: u64| -> Box<dyn FnOnce() + Send> {
        let events = events.clone();
        Box::new(move || {
            let _ = events.send(Event::HostdLost(id));
        })
    };
    loop {
        let room = contexts.len() < MAX_CONTEXTS && !(config.once && next_id > 0);
        // The listener is taken only to be handed to the next context: a
        // listener dropped here would close the device's socket for good.
        let next = !accepting && !held_back && room;
        if let Some(l) = listener.take_if(|_| next) {
            // A registration with hostd per context: when its frontend
            // goes, closing it makes hostd drop what that context had.
            let fabric = match &config.hostd {
                Some(path) => match register(path, &config.tenant, &device_name) {
                    Ok(fabric) => {
                        hold = link::Backoff::new(HOLD_BACK_FIRST_PAUSE);
                        Some(Arc::new(fabric))
                    }
                    // At start, before any frontend is served: a problem
                    // of configuration (hostd's socket out of this uid's
                    // reach, an unknown tenant), reported once, now. A
                    // hostd that is not listening yet (both started at
                    // once) is waited for a while.
                    Err(e) if next_id == 0 => {
                        match wait_for_hostd(path, &config.tenant, &device_name, e) {
                            Ok(fabric) => Some(Arc::new(fabric)),
                            Err(e) => return Err(Error::Fabric(e)),
                        }
                    }
                    // Later (hostd restarting, the device's contexts all
                    // taken): never the end of vdev nor of the contexts
                    // open; the next frontend waits for a retry.
                    Err(e) => {
                        hold.retry_later();
                        tracing::warn!(tenant = %config.tenant, open = contexts.len(),
                            retry_ms = hold.wait().unwrap_or_default().as_millis() as u64,
                            "No further context until hostd takes a registration again: {}",
                            vrdma_errors::error_chain(&e));
                        listener = Some(l);
                        held_back = true;
                        continue;
                    }
                },
                None => None,
            };
            if let Some(fabric) = &fabric {
                tracing::info!(tenant = %config.tenant, context = next_id, lid = fabric.lid,
                    gid = %std::net::Ipv6Addr::from(fabric.gid),
                    physical_queues = fabric.physical_queues, "Registered with hostd");
            }
            if let (Some(fabric), Some(slot)) = (&fabric, &cm_slot) {
                match &mut cm {
                    None => cm = DeviceCm::start(config, next_id, fabric, slot, threads),
                    // Parked since its context ended: this one's now.
                    Some(c) if c.context.is_none() => c.rebind(config, next_id, fabric),
                    Some(_) => {}
                }
            }
            let backend = VrdmaBackend::in_share_with_cm(
                identity.clone(),
                config.limits,
                fabric,
                share.clone(),
                cm_slot.clone(),
            );
            backend
                .listen_for_policy(threads, lost(next_id))
                .map_err(Error::Setup)?;
            let thread =
                serve_context(config, next_id, l, backend.clone(), threads, events.clone())?;
            contexts.insert(next_id, Context { backend, thread });
            next_id += 1;
            accepting = true;
        }
        if contexts.is_empty() && !held_back {
            return Ok(());
        }
        // The senders live in the context threads and here: never closed.
        // While hostd is away, or a registration is held back, the wait
        // ends for the next try.
        let retry = held_back.then(|| hold.wait()).flatten();
        let event = match link.wait().into_iter().chain(retry).min() {
            None => happened.recv().ok(),
            Some(pause) => match happened.recv_timeout(pause) {
                Ok(event) => Some(event),
                Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                    if held_back && hold.wait().is_some_and(|w| w.is_zero()) {
                        // The held-back registration's turn: try again.
                        held_back = false;
                    }
                    if !link.wait().is_some_and(|w| w.is_zero()) {
                        continue;
                    }
                    let backend_of = |id| contexts.get(&id).map(|c| c.backend.clone());
                    if link.retry(backend_of, threads, lost) {
                        // Registrations work again: further contexts too.
                        held_back = false;
                        match (&mut cm, &cm_slot) {
                            (Some(c), _) if c.context.is_some() => {
                                c.hostd_restarted(&config.tenant)
                            }
                            (Some(c), _) => c.rebind_any(config, &contexts),
                            (None, Some(slot)) => {
                                cm = DeviceCm::on_any(config, &contexts, slot, threads)
                            }
                            (None, None) => {}
                        }
                    }
                    continue;
                }
                Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => None,
            },
        };
        let Some(event) = event else {
            return Ok(());
        };
        match event {
            Event::HostdLost(id) => {
                if let Some(c) = contexts.get(&id) {
                    let handed_over = c.backend.device().is_handed_over();
                    link.lost(id, handed_over);
                }
            }
            Event::Accepted(id, l) => {
                tracing::info!(tenant = %config.tenant, context = id, open = contexts.len(), "Frontend connected");
                listener = Some(l);
                accepting = false;
            }
            Event::Ended(id, result) => {
                let Some(Context { backend, thread }) = contexts.remove(&id) else {
                    continue;
                };
                link.forget(id);
                // The CM stops before the registration it uses ends, and
                // starts again on another context's.
                // The CM moves to another context's registration before
                // this one's ends (its thread and state carry on).
                if let Some(c) = cm.as_mut().filter(|c| c.context == Some(id)) {
                    c.rebind_any(config, &contexts);
                }
                held_back = false;
                let _ = thread.join();
                // Whatever the driver left, hostd drops it (one
                // ResetDevice for this context's objects).
                backend.device().release_all();
                // The registration ends with the frontend.
                if let Some(fabric) = backend.device().fabric() {
                    fabric.close();
                }
                // Its descriptors close now, before it is reported gone.
                drop(backend);
                match result {
                    Ok(()) => tracing::info!(tenant = %config.tenant, context = id,
                        "Frontend disconnected; its context's state released"),
                    Err(e) => tracing::warn!(tenant = %config.tenant, context = id, error = %e,
                        "Frontend connection ended with an error; its context's state released"),
                }
            }
            Event::Failed(id, error, l) => {
                link.forget(id);
                if let Some(Context { backend, thread }) = contexts.remove(&id) {
                    let _ = thread.join();
                    if let Some(fabric) = backend.device().fabric() {
                        fabric.close();
                    }
                }
                if let Some(c) = cm.as_mut().filter(|c| c.context == Some(id)) {
                    c.rebind_any(config, &contexts);
                }
                if contexts.is_empty() {
                    return Err(error);
                }
                // The other contexts are served on; another try after a
                // pause, or when one of them ends.
                tracing::warn!(tenant = %config.tenant, context = id, open = contexts.len(),
                    "No further context for a moment: {}", vrdma_errors::error_chain(&error));
                listener = Some(l);
                accepting = false;
                held_back = true;
                hold.retry_later();
            }
        }
    }
}

/// The device's connection manager ([`cm::CmService`]) and the context
/// whose registration with hostd it uses (`None`: that context ended and
/// no other has one; the next registration takes it). One thread for the
/// device's life: it moves between registrations, it is not restarted.
/// The contexts reach it through the device's [`verbs::cm::CmSlot`] (the
/// `CM_*` commands), where it is published from its start to vdev's end;
/// a context's channels stay valid while it moves between registrations.
struct DeviceCm {
    service: Arc<cm::CmService>,
    slot: verbs::cm::CmSlot,
    context: Option<u64>,
}

impl Drop for DeviceCm {
    fn drop(&mut self) {
        self.slot.set(None);
        self.service.stop();
    }
}

impl DeviceCm {
    /// Starts the CM on context `context`'s registration; `None` (logged)
    /// if it cannot start: the device works on without one.
    fn start(
        config: &Config,
        context: u64,
        fabric: &Arc<Fabric>,
        slot: &verbs::cm::CmSlot,
        threads: &Threads,
    ) -> Option<DeviceCm> {
        // Routes get the port's active MTU, as hostd's network allows it
        // (again after hostd restarts: `CmService::hostd_restarted`).
        let cm_config = cm::CmConfig {
            path_mtu: fabric.active_mtu().into(),
            ..cm::CmConfig::default()
        };
        let started = cm::CmService::start(fabric.clone(), &config.tenant, cm_config, threads);
        match started {
            Ok(service) => {
                let service = Arc::new(service);
                slot.set(Some(service.clone()));
                Some(DeviceCm {
                    service,
                    slot: slot.clone(),
                    context: Some(context),
                })
            }
            Err(e) => {
                tracing::warn!(tenant = %config.tenant, context,
                    "No connection manager: {}", vrdma_errors::error_chain(&e));
                None
            }
        }
    }

    /// Starts the CM on the registration of any context of `contexts`
    /// that has one.
    fn on_any(
        config: &Config,
        contexts: &std::collections::HashMap<u64, Context>,
        slot: &verbs::cm::CmSlot,
        threads: &Threads,
    ) -> Option<DeviceCm> {
        let (id, fabric) = any_registration(contexts)?;
        DeviceCm::start(config, id, &fabric, slot, threads)
    }

    /// Moves the CM to context `context`'s registration.
    fn rebind(&mut self, config: &Config, context: u64, fabric: &Arc<Fabric>) {
        match self.service.rebind(fabric.clone()) {
            Ok(()) => self.context = Some(context),
            Err(e) => {
                self.context = None;
                tracing::warn!(tenant = %config.tenant, context,
                    "The connection manager cannot use this context's registration: {}",
                    vrdma_errors::error_chain(&e));
            }
        }
    }

    /// Moves the CM to any registration of `contexts`, or parks it.
    fn rebind_any(&mut self, config: &Config, contexts: &std::collections::HashMap<u64, Context>) {
        match any_registration(contexts) {
            Some((id, fabric)) => self.rebind(config, id, &fabric),
            None => self.context = None,
        }
    }

    /// hostd came back and the contexts registered again.
    fn hostd_restarted(&self, tenant: &str) {
        if let Err(e) = self.service.hostd_restarted() {
            tracing::warn!(
                tenant,
                "The connection manager cannot reach the restarted hostd: {}",
                vrdma_errors::error_chain(&e)
            );
        }
    }
}

/// A context of `contexts` with a live registration, and that registration.
fn any_registration(
    contexts: &std::collections::HashMap<u64, Context>,
) -> Option<(u64, Arc<Fabric>)> {
    contexts.iter().find_map(|(&id, c)| {
        let fabric = c.backend.device().fabric()?.clone();
        (!fabric.closed()).then_some((id, fabric))
    })
}

/// Serves context `id` on a thread of the vhost-user role: it creates
/// vhost-user-backend's daemon (whose worker threads start there), accepts
/// the frontend (whose request thread starts there too), hands the
/// listener back ([`Event::Accepted`]) and waits for the frontend to leave
/// ([`Event::Ended`]). The library's threads are started by the library,
/// not through `threads`, so they inherit that thread's filter: this is
/// why the daemon is never created on the main thread.
fn serve_context(
    config: &Config,
    id: u64,
    mut listener: Listener,
    backend: VrdmaBackend,
    threads: &Threads,
    events: std::sync::mpsc::Sender<Event>,
) -> Result<std::thread::JoinHandle<()>, Error> {
    let tenant = config.tenant.clone();
    let socket = config.socket.display().to_string();
    threads
        .spawn(Role::VhostUser, "vhost-user", move || {
            let daemon = backend
                .daemon(format!("vdev-{tenant}"))
                .map_err(Error::Daemon)
                .and_then(|mut daemon| {
                    tracing::info!(tenant, socket, context = id, "Waiting for a frontend");
                    daemon.start(&mut listener).map_err(|source| Error::Serve {
                        socket: socket.clone(),
                        source: DaemonError(source),
                    })?;
                    Ok(daemon)
                });
            let mut daemon = match daemon {
                Ok(daemon) => daemon,
                Err(e) => {
                    let _ = events.send(Event::Failed(id, e, listener));
                    return;
                }
            };
            let _ = events.send(Event::Accepted(id, listener));
            // A frontend that closes its socket (a program exiting, a VM
            // shutting down) ends the connection with `Disconnected` or a
            // partial message: a normal end, as the library's own `serve`
            // treats it, not an error worth a warning.
            let result = match daemon.wait() {
                Err(vhost_user_backend::Error::HandleRequest(
                    vhost::vhost_user::Error::Disconnected
                    | vhost::vhost_user::Error::PartialMessage,
                )) => Ok(()),
                other => other,
            };
            backend.stop_workers();
            let _ = events.send(Event::Ended(id, result));
        })
        .map_err(|e| Error::Thread("vhost-user", e))
}

/// How long vdev waits at start for a hostd that is not listening yet.
const HOSTD_START_PATIENCE: Duration = Duration::from_secs(30);

/// The first registration failed with `first`: while that is because
/// nothing listens on hostd's socket yet (no socket file, or a refused
/// connection), tries again for [`HOSTD_START_PATIENCE`]; any other
/// failure is returned at once.
fn wait_for_hostd(
    path: &std::path::Path,
    tenant: &str,
    device: &str,
    first: fabric::FabricError,
) -> Result<Fabric, fabric::FabricError> {
    let not_listening = |e: &fabric::FabricError| {
        let mut source: Option<&(dyn std::error::Error + 'static)> = Some(e);
        while let Some(s) = source {
            if let Some(io) = s.downcast_ref::<std::io::Error>() {
                return matches!(
                    io.kind(),
                    std::io::ErrorKind::NotFound | std::io::ErrorKind::ConnectionRefused
                );
            }
            source = s.source();
        }
        false
    };
    if !not_listening(&first) {
        return Err(first);
    }
    tracing::info!(tenant, hostd = %path.display(), "Waiting for hostd to listen ({})",
        vrdma_errors::error_chain(&first));
    let deadline = std::time::Instant::now() + HOSTD_START_PATIENCE;
    loop {
        std::thread::sleep(Duration::from_millis(100));
        match register(path, tenant, device) {
            Err(e) if not_listening(&e) && std::time::Instant::now() < deadline => {}
            result => return result,
        }
    }
}

/// The first pause before a held-back registration is tried again (then
/// doubling to [`link::LONGEST_PAUSE`] while it keeps failing).
const HOLD_BACK_FIRST_PAUSE: Duration = Duration::from_millis(10);

/// The name this device registers under with hostd: derived from its socket
/// path, so it is stable across restarts of this vdev (hostd then gives it
/// the same LID) and unique on the host.
fn device_name(socket: &std::path::Path) -> String {
    use std::os::unix::ffi::OsStrExt;
    // FNV-1a: stable across runs and Rust versions, unlike DefaultHasher.
    let hash = socket
        .as_os_str()
        .as_bytes()
        .iter()
        .fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
            (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
        });
    format!("vdev-{hash:016x}")
}

/// Registers a context with hostd. hostd tears a closed registration down
/// when it sees its connection close, which can be a moment after vdev,
/// whose frontend just left, asks again (a restarted vdev's old device, or
/// the device's last free context slot): while hostd answers EBUSY, wait a
/// little and retry.
fn register(
    path: &std::path::Path,
    tenant: &str,
    device: &str,
) -> Result<Fabric, fabric::FabricError> {
    const PATIENCE: Duration = Duration::from_secs(5);
    let deadline = std::time::Instant::now() + PATIENCE;
    let mut pause = Duration::from_millis(1);
    loop {
        match Fabric::connect(path, tenant, device) {
            Err(e) if e.errno() == libc::EBUSY && std::time::Instant::now() < deadline => {
                tracing::debug!(
                    tenant,
                    device,
                    "hostd still has the previous registration; retrying"
                );
                std::thread::sleep(pause);
                pause = (pause * 2).min(Duration::from_millis(100));
            }
            result => return result,
        }
    }
}
