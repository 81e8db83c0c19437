//! hostd: the per-host datapath of vrdma. It plays the RDMA NIC for every
//! tenant: it reads each tenant's send and receive rings in guest memory
//! itself, owns the physical QPs, the memory-key table and the DMA engine,
//! executes RDMA between tenants and writes completions into the guests'
//! rings. vdevs (the control plane) and guests are not trusted.
//!
//! - [`config`]: command line and TOML file, validated into [`Config`].
//! - [`policy`]: the tenant policy file as hostd loads it (checked against
//!   what this hostd can grant) and the changes a reload makes.
//! - [`server`]: the control socket: one thread per vdev, one response per
//!   request, tenant policy (credentials, networks, physical queues, memory
//!   quotas), teardown on disconnect, policy reload.
//! - [`datapath`]: the polling threads that run the engine, spinning
//!   briefly after work before sleeping in epoll on the drivers' doorbells.
//! - [`engine`]: the NIC in software — guest rings, the WQE reader, the key
//!   table and DMA engine, RC execution, completions and events.
//! - [`scheduler`]: strict priority between classes, weighted fair sharing
//!   inside one, token-bucket rate limits, the port's line rate.
//! - [`stats`]: per-tenant counters and usage, Prometheus rendering.
//! - [`admin`]: the admin socket (`vrdmactl`: stats, metrics, reload) and
//!   reload on SIGHUP.
//! - [`accept`]: the accept loop of both sockets, a thread per connection.
//! - [`ids`]: fast hash maps and slabs for identifiers hostd assigns, and
//!   the randomness of those that must not be guessed.
//! - [`lids`]: device LIDs, stable per device name and bounded per tenant.
//! - [`gids`]: device GIDs (what connections name a peer by) and what a
//!   destination GID resolves to.
//! - [`sandbox`]: the walls hostd puts up around itself before it serves,
//!   in the order `main.rs` runs them; [`seccomp`]: hostd's thread roles
//!   and the system calls each may make.

pub mod accept;
pub mod admin;
pub mod config;
pub mod cpu;
pub mod datapath;
pub mod engine;
pub mod gids;
pub mod handover;
pub mod ids;
pub mod lids;
pub mod metrics_http;
pub mod net;
pub mod policy;
pub mod sandbox;
pub mod scheduler;
pub mod seccomp;
pub mod server;
pub mod stats;
pub mod top;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use vrdma_hostd_protocol::channel::{ChannelError, Listener};

pub use config::Config;
use datapath::Datapath;
use engine::Engine;
use scheduler::{Link, Scheduler};
use seccomp::Threads;
use server::Server;

/// Why hostd could not serve.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("Cannot listen on {}", path.display())]
    Listen {
        path: PathBuf,
        #[source]
        source: ChannelError,
    },
    #[error("Cannot start the datapath")]
    Datapath(#[source] std::io::Error),
    #[error("Cannot set up reload on SIGHUP")]
    Signals(#[source] std::io::Error),
    #[error("Cannot start the admin socket's thread")]
    Admin(#[source] std::io::Error),
    #[error("Cannot open the directory of the cluster")]
    Directory(#[source] net::directory::DirectoryError),
    #[error("Cannot serve metrics over HTTP")]
    Metrics(#[source] metrics_http::MetricsError),
    #[error("Cannot start the metrics thread")]
    MetricsThread(#[source] std::io::Error),
    #[error("Cannot take over from the running hostd")]
    TakeOver(#[source] handover::HandoverError),
    #[error("Cannot tell the previous hostd to go")]
    Commit(#[source] std::io::Error),
    #[error("Cannot keep the sockets to hand over")]
    Keep(#[source] std::io::Error),
    #[error("Cannot set up AF_XDP (packet_io = \"af_xdp\" in [fabric])")]
    AfXdp(#[source] std::io::Error),
    #[error("Cannot open the RoCEv2 packet queues (UDP port {port})")]
    PacketIo {
        port: u16,
        #[source]
        source: std::io::Error,
    },
}

/// What hostd opens before entering its sandbox: the SIGHUP signalfd and
/// both listeners (the only steps that need the file system by path,
/// besides reading the policy and cluster files on reload), and the
/// directory of the cluster (`[fabric]`; etcd registered and read).
pub struct Opened {
    sighup: std::os::fd::OwnedFd,
    admin_listener: Listener,
    listener: Listener,
    directory: Option<Arc<dyn net::directory::Directory>>,
    /// The packet queues RoCEv2 goes through (with a directory).
    packet_io: Option<Box<dyn net::io::PacketIo>>,
    /// The metrics endpoint's listener (`metrics_listen`).
    metrics: Option<metrics_http::Endpoint>,
    /// The sockets above once more, for a new hostd this one may hand
    /// over to.
    sockets: server::handover::HandoverSockets,
    /// What was taken over from a previous hostd (`--take-over`), and the
    /// word that lets it go.
    taken: Option<(handover::Handover, handover::Commit)>,
}

impl std::fmt::Debug for Opened {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Opened")
            .field("sighup", &self.sighup)
            .field("admin_listener", &self.admin_listener)
            .field("listener", &self.listener)
            .field(
                "directory",
                &self.directory.as_ref().map(|d| d.cluster_file()),
            )
            .finish()
    }
}

/// Mode of the vdev socket: every uid may connect. hostd authenticates
/// each vdev by `SO_PEERCRED` against the tenant policy's `uid`, not by
/// file permissions, so vdevs running as `nobody` (or per-tenant uids)
/// register from inside their sandbox.
pub const VDEV_SOCKET_MODE: u32 = 0o666;

/// Blocks SIGHUP (read through a signalfd) and binds the admin socket
/// (mode 0600) and the vdev socket (mode [`VDEV_SOCKET_MODE`]). Call it
/// before starting any thread: both steps are process-wide.
pub fn open(config: &Config) -> Result<Opened, Error> {
    let sighup = admin::block_sighup().map_err(Error::Signals)?;
    let taken = config
        .take_over
        .then(|| handover::take(&config.admin_socket))
        .transpose()
        .map_err(Error::TakeOver)?;
    let (admin_listener, listener, udp, handed_metrics, taken) = match taken {
        Some(t) => (
            t.admin_listener,
            t.listener,
            t.udp,
            t.metrics,
            Some((t.handover, t.commit)),
        ),
        None => (
            bind_admin(config)?,
            bind_vdev_socket(config)?,
            None,
            None,
            None,
        ),
    };
    let directory = config
        .fabric
        .as_ref()
        .map(|fabric| net::directory::open_directory(fabric, &config.policy))
        .transpose()
        .map_err(Error::Directory)?
        .map(Arc::from);
    let packet_io = match (&directory, &config.fabric) {
        (Some(_), Some(fabric)) => Some(open_packet_io(fabric, udp, config.take_over)?),
        _ => None,
    };
    let metrics = match (config.metrics_listen, handed_metrics) {
        (Some(_), Some(l)) => Some(metrics_http::adopt(l)),
        (Some(addr), None) => Some(metrics_http::bind(addr)),
        (None, _) => None,
    }
    .transpose()
    .map_err(Error::Metrics)?;
    let sockets = server::handover::HandoverSockets {
        listener: listener.try_clone_fd().map_err(Error::Keep)?,
        admin: admin_listener.try_clone_fd().map_err(Error::Keep)?,
        udp: packet_io
            .as_ref()
            .map(|(_, send_socket)| send_socket.try_clone())
            .transpose()
            .map_err(Error::Keep)?,
        metrics: metrics
            .as_ref()
            .map(metrics_http::Endpoint::listener_fd)
            .transpose()
            .map_err(Error::Keep)?,
    };
    Ok(Opened {
        sighup,
        admin_listener,
        listener,
        directory,
        packet_io: packet_io.map(|(io, _)| io),
        metrics,
        sockets,
        taken,
    })
}

/// The packet queues `fabric` asks for, and their kernel send socket (a
/// handover passes it on): AF_XDP on the interface of this host's
/// address, the kernel's UDP path beside it (or instead: `packet_io =
/// "udp"`, a failure to set AF_XDP up when `packet_io` is not set, a
/// handover — the AF_XDP sockets cannot be passed on; the next restart
/// takes them up again). `udp`: the send socket handed over.
fn open_packet_io(
    fabric: &config::FabricConfig,
    udp: Option<std::os::fd::OwnedFd>,
    take_over: bool,
) -> Result<(Box<dyn net::io::PacketIo>, std::os::fd::OwnedFd), Error> {
    use config::PacketIoChoice;
    let port = net::io::ROCE_V2_PORT;
    let packet_error = |source| Error::PacketIo { port, source };
    let kernel = match udp {
        Some(udp) => net::io::UdpIo::adopt(udp, port),
        None => net::io::UdpIo::open(std::net::Ipv4Addr::UNSPECIFIED, port),
    }
    .map_err(packet_error)?;
    let send_socket = kernel.send_socket().map_err(Error::Keep)?;
    let why_not = match (fabric.packet_io, take_over) {
        (PacketIoChoice::Udp, _) => "packet_io = \"udp\" in [fabric]".to_owned(),
        (_, true) => {
            "taken over from another hostd: AF_XDP comes back at the next restart".to_owned()
        }
        (choice, false) => {
            let host = fabric.cluster.host(&fabric.host).map(|h| h.address);
            let opened = match host {
                Some(a) => net::io::XdpIo::open(a, fabric.xdp_mode, kernel),
                None => Err(std::io::Error::new(
                    std::io::ErrorKind::NotFound,
                    "this host has no address in the cluster file",
                )),
            };
            match opened {
                Ok(io) => {
                    tracing::info!(queues = %io.describe(), "RoCEv2 packets through AF_XDP");
                    return Ok((Box::new(io), send_socket));
                }
                Err(e) if choice == PacketIoChoice::AfXdp => {
                    return Err(Error::AfXdp(e));
                }
                Err(e) => {
                    // `kernel` went into the failed attempt: open it again.
                    let why = format!("AF_XDP could not be set up: {e}");
                    let kernel =
                        net::io::UdpIo::adopt(send_socket.try_clone().map_err(Error::Keep)?, port)
                            .map_err(packet_error)?;
                    tracing::info!(reason = %why, "RoCEv2 packets through the kernel's UDP path");
                    return Ok((Box::new(kernel), send_socket));
                }
            }
        }
    };
    tracing::info!(reason = %why_not, "RoCEv2 packets through the kernel's UDP path");
    Ok((Box::new(kernel), send_socket))
}

/// Binds the admin socket (mode 0600).
fn bind_admin(config: &Config) -> Result<Listener, Error> {
    admin::bind(&config.admin_socket).map_err(|source| Error::Listen {
        path: config.admin_socket.clone(),
        source,
    })
}

/// Binds the vdev socket (mode [`VDEV_SOCKET_MODE`]).
fn bind_vdev_socket(config: &Config) -> Result<Listener, Error> {
    use std::os::unix::fs::PermissionsExt;
    let listener = Listener::bind(&config.socket).map_err(|source| Error::Listen {
        path: config.socket.clone(),
        source,
    })?;
    std::fs::set_permissions(
        &config.socket,
        std::fs::Permissions::from_mode(VDEV_SOCKET_MODE),
    )
    .map_err(|source| Error::Listen {
        path: config.socket.clone(),
        source: source.into(),
    })?;
    Ok(listener)
}

/// Serves vdevs on the configured socket, and the admin socket, until the
/// process is stopped: [`open`], then [`serve`] (without a sandbox; the
/// `hostd` command puts one up between the two).
pub fn run(config: &Config) -> Result<(), Error> {
    serve(config, open(config)?, &Threads::unfiltered())
}

/// Starts the datapath, admin and SIGHUP threads and serves vdevs on what
/// [`open`] bound, until the process is stopped. Every thread is started
/// through `threads`, under its role's seccomp filter.
pub fn serve(config: &Config, opened: Opened, threads: &Threads) -> Result<(), Error> {
    let Opened {
        sighup,
        admin_listener,
        listener,
        directory,
        packet_io,
        metrics,
        sockets,
        taken,
    } = opened;
    let datapath = datapath(config).map_err(Error::Datapath)?;
    if let (Some(io), Some(directory)) = (packet_io, &directory) {
        let wire = engine::wire::Wire::new(io, Arc::clone(directory));
        datapath.lock().attach_wire(wire);
    }
    datapath.start(threads).map_err(Error::Datapath)?;
    let server = Server::new(config.clone(), datapath);
    server.set_handover_sockets(sockets);
    if let Some(directory) = directory {
        directory.start(threads).map_err(Error::Directory)?;
        server.set_directory(directory);
    }
    admin::spawn(Arc::clone(&server), admin_listener, threads).map_err(Error::Admin)?;
    admin::spawn_sighup(Arc::clone(&server), sighup, threads).map_err(Error::Admin)?;
    if let Some(endpoint) = metrics {
        let addr = endpoint.addr;
        metrics_http::spawn(Arc::clone(&server), endpoint, threads)
            .map_err(Error::MetricsThread)?;
        tracing::info!(%addr, "Serving Prometheus metrics over HTTP (GET /metrics)");
    }
    tracing::info!(
        socket = %config.socket.display(),
        admin_socket = %config.admin_socket.display(),
        policy = %policy::source_name(config.policy_file.as_ref()),
        physical_qps = config.physical_qps,
        tenants = config.policy.tenants.len(),
        "hostd serving"
    );
    log_fabric(config);
    if let Some((handover, commit)) = taken {
        server.set_handed(handover);
        // The previous hostd exits now; its vdevs come back here.
        commit.commit().map_err(Error::Commit)?;
    }
    server.serve(&listener, threads);
    Ok(())
}

/// Says what `[fabric]` hostd took (or that it has none): the first thing
/// an operator checks when hosts do not reach each other.
fn log_fabric(config: &Config) {
    let Some(fabric) = &config.fabric else {
        tracing::info!("No [fabric]: this host's devices reach only each other");
        return;
    };
    let address = fabric.cluster.host(&fabric.host).map(|h| h.address);
    let directory = match &fabric.directory {
        config::DirectoryKind::Static => "the cluster file".to_owned(),
        config::DirectoryKind::Etcd { endpoints, .. } => format!("etcd at {endpoints:?}"),
    };
    tracing::info!(
        host = %fabric.host,
        address = %address.map_or_else(|| "(not in the cluster file)".to_owned(), |a| a.to_string()),
        udp_port = net::io::ROCE_V2_PORT,
        ip_mtu = fabric.ip_mtu,
        active_mtu = fabric.active_mtu(),
        cluster_file = %fabric.cluster_file.display(),
        hosts = fabric.cluster.hosts.len(),
        directory = %directory,
        "RoCEv2 fabric"
    );
}

/// The datapath `config` asks for, not started yet ([`Datapath::start`]).
pub fn datapath(config: &Config) -> std::io::Result<Arc<Datapath>> {
    let sched = Scheduler::new(Some(Link::new(config.line_rate_bytes())));
    if !config.datapath_cpus.is_empty() {
        let allowed = vrdma_isolation::cpus::allowed()?;
        if let Some(cpu) = config.datapath_cpus.iter().find(|c| !allowed.contains(c)) {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!("datapath_cpus: CPU {cpu} is not among those hostd may run on {allowed:?}"),
            ));
        }
    }
    let mut engine = Engine::new(sched);
    engine.set_port_mtu(config.fabric.as_ref().map_or(4096, |f| f.active_mtu()));
    Datapath::new(
        engine,
        config.datapath_threads,
        config.datapath_cpus.clone(),
        Duration::from_micros(config.spin_us),
    )
}
