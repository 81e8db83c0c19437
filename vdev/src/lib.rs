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
//! - [`shadow`]: shadow memory regions — guest ranges resolved into guest
//!   memory slots, with bounds, access and revocation.
//! - [`sandbox`]: the walls vdev puts up around itself before it serves
//!   (namespaces, landlock, privileges, seccomp; `vrdma-isolation` builds
//!   them), in the order `main.rs` runs them.
//! - [`seccomp`]: vdev's thread roles and the system calls each may make.
//!
//! Start-up is split so that everything needing the file system or
//! privileges happens before the sandbox: [`open`] binds the listener (and,
//! when hostd's socket is out of reach of vdev's unprivileged uid, makes the
//! first hostd registration), then [`run`] serves inside the sandbox.

pub mod backend;
pub mod config;
pub mod control;
pub mod fabric;
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
    #[error("The vhost-user thread panicked; the listener is lost")]
    VhostUserPanicked,
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
    /// A registration with hostd made before the sandbox, used for the
    /// first frontend (see [`sandbox::Sandbox::register_early`]).
    early_fabric: Option<Fabric>,
}

impl std::fmt::Debug for Opened {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Opened")
            .field("early_fabric", &self.early_fabric)
            .finish_non_exhaustive()
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

/// Binds the vhost-user socket and, with `register_early`, registers the
/// device with hostd now (for the first frontend). Runs before the sandbox.
pub fn open(config: &Config, register_early: bool) -> Result<Opened, Error> {
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
    let early_fabric = match (&config.hostd, register_early) {
        (Some(path), true) => Some(
            Fabric::connect(path, &config.tenant, &device_name(&config.socket))
                .map_err(Error::Fabric)?,
        ),
        _ => None,
    };
    Ok(Opened {
        listener,
        socket_file,
        early_fabric,
    })
}

/// Serves the device on the listener [`open`] bound: one frontend
/// connection at a time, each with a fresh device, until `config.once`
/// says to stop after the first. The listening socket is created once, so
/// a frontend that connects while another is being served waits in its
/// backlog instead of meeting a closed socket. Every thread is started
/// through `threads`, under its role's seccomp filter.
pub fn run(config: &Config, opened: Opened, threads: &Threads) -> Result<(), Error> {
    let Opened {
        mut listener,
        socket_file: _socket_file,
        mut early_fabric,
    } = opened;
    let identity = DeviceIdentity {
        tenant: Arc::from(config.tenant.as_str()),
        lid: config.lid,
        // Without hostd the device is alone: its GID only names it.
        gid: vrdma_spec::gid::loopback_gid(config.lid),
        comp_vectors: config.comp_vectors,
        max_queue_size: config.queue_size,
        active_mtu: verbs::PORT_MTU,
    };
    let device_name = device_name(&config.socket);
    loop {
        // A fresh registration with hostd per frontend: when the frontend
        // goes, closing it makes hostd drop everything this device had.
        let fabric = match (early_fabric.take(), &config.hostd) {
            (Some(fabric), _) => Some(Arc::new(fabric)),
            (None, Some(path)) => Some(Arc::new(
                register(path, &config.tenant, &device_name).map_err(Error::Fabric)?,
            )),
            (None, None) => None,
        };
        if let Some(fabric) = &fabric {
            tracing::info!(tenant = %config.tenant, lid = fabric.lid,
                gid = %std::net::Ipv6Addr::from(fabric.gid),
                physical_queues = fabric.physical_queues, "Registered with hostd");
        }
        let backend = VrdmaBackend::new(identity.clone(), config.limits, fabric);
        backend.listen_for_policy(threads).map_err(Error::Setup)?;
        let (returned, result) = serve_frontend(config, listener, backend.clone(), threads)?;
        listener = returned;
        // Whatever the driver left, hostd drops it (one ResetDevice).
        backend.device().release_all();
        // The registration ends with the frontend, so that the next one
        // can register this device again.
        if let Some(fabric) = backend.device().fabric() {
            fabric.close();
        }
        match result {
            Ok(()) => {
                tracing::info!(tenant = %config.tenant, "Frontend disconnected; device state released")
            }
            Err(e) => tracing::warn!(tenant = %config.tenant, error = %e,
                "Frontend connection ended with an error; device state released"),
        }
        if config.once {
            return Ok(());
        }
    }
}

/// Serves one frontend on a thread of the vhost-user role: it creates
/// vhost-user-backend's daemon (whose worker threads start there), accepts
/// the frontend (whose request thread starts there too), and waits for
/// it to leave. The library's threads are started by the library, not
/// through `threads`, so they inherit that thread's filter: this is why
/// the daemon is never created on the main thread. Hands the listener back
/// with the connection's outcome; fails if the daemon cannot be set up or
/// the frontend accepted.
fn serve_frontend(
    config: &Config,
    mut listener: Listener,
    backend: VrdmaBackend,
    threads: &Threads,
) -> Result<(Listener, Result<(), vhost_user_backend::Error>), Error> {
    let tenant = config.tenant.clone();
    let socket = config.socket.display().to_string();
    let thread = threads
        .spawn(Role::VhostUser, "vhost-user", move || {
            let served = (|| {
                let mut daemon = backend
                    .daemon(format!("vdev-{tenant}"))
                    .map_err(Error::Daemon)?;
                tracing::info!(tenant, socket, "Waiting for a frontend");
                daemon.start(&mut listener).map_err(|source| Error::Serve {
                    socket: socket.clone(),
                    source: DaemonError(source),
                })?;
                tracing::info!(tenant, "Frontend connected");
                let result = daemon.wait();
                backend.stop_workers();
                Ok(result)
            })();
            (listener, served)
        })
        .map_err(|e| Error::Thread("vhost-user", e))?;
    let (listener, served) = thread.join().map_err(|_| Error::VhostUserPanicked)?;
    Ok((listener, served?))
}

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

/// Registers with hostd. hostd tears the previous registration of this
/// device down when it sees that connection close, which can be a moment
/// after vdev, whose frontend just left, asks again: while hostd still
/// answers EBUSY for this device, wait a little and retry.
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
