//! hostd configuration: command line and TOML file, validated into [`Config`].
//!
//! The file (or, without `--config`, the embedded `default.toml`) holds every
//! key; flags override them. The tenants hostd serves are not here but in
//! the policy file (`policy` / `--policy`, see `vrdma-tenant-policy`), or
//! the built-in default policy without one. Whatever arrives is validated
//! into a [`Config`] deriving `PartialEq`, so tests compare what a command
//! line means with what they expect, and every error names the offending
//! key (for the policy: file, line and key).
//!
//! The optional `[fabric]` table puts hostd in a cluster (RoCEv2 across
//! hosts): this host's name, the cluster file (validated here, see
//! [`crate::net::directory::cluster`]) and the directory (`static` or
//! `etcd`). Without it hostd runs single-host.
//!
//! The `[port]` table says what the ports of the host's devices are:
//! `link_layer = "ethernet"` (RoCEv2, the default: devices are named by
//! GID) or `"infiniband"` (hostd is the subnet manager and the LIDs it
//! assigns are the ports' LIDs, so programs may address peers by LID; only
//! single-host, as the wire between hosts is RoCEv2).

use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};

use clap::Parser;
use serde::Deserialize;
use vrdma_hostd_protocol::messages::PortLinkLayer;
use vrdma_isolation::config::{SandboxArgs, SandboxConfig, SandboxConfigError, SandboxFile};
use vrdma_isolation::cpus::MAX_CPUS;
use vrdma_isolation::daemon::{parse_config, read_config_file, ConfigFileError};
use vrdma_isolation::namespaces::SandboxMode;
use vrdma_tenant_policy::{is_valid_name, Policy, PolicyError};

use crate::net::directory::{Cluster, DirectoryError};

/// The configuration used when no `--config` is given.
pub const DEFAULT_CONFIG: &str = include_str!("default.toml");

/// Largest number of physical QPs the modelled NIC has.
pub const MAX_PHYSICAL_QPS: u32 = 1 << 16;
pub use crate::policy::MAX_QUEUES_PER_DEVICE;
/// Datapath threads beyond this only burn cores.
pub const MAX_DATAPATH_THREADS: u32 = 64;
/// Busy-poll time above one second is a misconfiguration.
pub const MAX_SPIN_US: u64 = 1_000_000;

/// Why a configuration is refused.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error(transparent)]
    File(#[from] ConfigFileError),
    #[error("No socket given (--socket or `socket` in the config file)")]
    NoSocket,
    #[error("Invalid `{key}` ({value}): {reason}")]
    Invalid {
        key: &'static str,
        value: String,
        reason: &'static str,
    },
    #[error("Invalid policy")]
    Policy(#[source] PolicyError),
    #[error("Invalid sandbox settings")]
    Sandbox(#[source] SandboxConfigError),
    #[error("Invalid [fabric] cluster file")]
    Cluster(#[source] DirectoryError),
    #[error("Invalid path {}", path.display())]
    Path {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// Command line of `hostd`.
#[derive(Debug, Parser)]
#[command(
    version,
    about = "vrdma hostd: the host datapath that plays the RDMA NIC for every tenant's vdev"
)]
pub struct Args {
    /// Path of the unix seqpacket socket vdevs connect to.
    #[arg(long)]
    pub socket: Option<PathBuf>,
    /// Path of the admin socket vrdmactl connects to (default: <socket>.admin).
    #[arg(long)]
    pub admin_socket: Option<PathBuf>,
    /// TOML config file (default: the embedded config).
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Tenant policy file (default: the built-in two-tenant demo policy).
    #[arg(long)]
    pub policy: Option<PathBuf>,
    /// Physical QPs of the NIC (shared by all vdevs).
    #[arg(long)]
    pub physical_qps: Option<u32>,
    /// Polling threads of the datapath.
    #[arg(long)]
    pub datapath_threads: Option<u32>,
    /// CPUs the datapath threads run on, thread `i` on the `i % n`th
    /// (comma-separated; default: wherever the scheduler puts them).
    #[arg(long, value_delimiter = ',')]
    pub datapath_cpus: Option<Vec<usize>>,
    /// Microseconds of busy polling after the last work before sleeping.
    #[arg(long)]
    pub spin_us: Option<u64>,
    /// Line rate of the NIC's port in Mbit/s (the modelled link).
    #[arg(long)]
    pub line_rate_mbps: Option<u32>,
    /// Serve Prometheus metrics over HTTP at this address (`GET /metrics`),
    /// e.g. 127.0.0.1:9464 (default: not served).
    #[arg(long)]
    pub metrics_listen: Option<std::net::SocketAddr>,
    /// Link layer of the devices' ports: ethernet (RoCEv2) or infiniband
    /// (LIDs; single-host only).
    #[arg(long, value_parser = parse_link_layer)]
    pub link_layer: Option<PortLinkLayer>,
    /// How long a context whose vdev died (crashed, killed, restarted for
    /// an upgrade) is kept, running, for the next vdev of its device to
    /// take over; 0: released at once.
    #[arg(long)]
    pub orphan_grace_ms: Option<u64>,
    /// Take over from the hostd running on this configuration's admin
    /// socket (an upgrade): its sockets, and its contexts and their QPs,
    /// which carry on here; it exits once this hostd has them.
    #[arg(long)]
    pub take_over: bool,
    /// The sandbox: the same flags, meaning and checks as vdev's.
    #[command(flatten)]
    pub sandbox: SandboxArgs,
}

/// The config file. Unknown keys are errors.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileConfig {
    socket: Option<PathBuf>,
    admin_socket: Option<PathBuf>,
    policy: Option<PathBuf>,
    physical_qps: Option<u32>,
    datapath_threads: Option<u32>,
    datapath_cpus: Option<Vec<usize>>,
    spin_us: Option<u64>,
    line_rate_mbps: Option<u32>,
    metrics_listen: Option<std::net::SocketAddr>,
    orphan_grace_ms: Option<u64>,
    #[serde(default)]
    sandbox: SandboxFile,
    #[serde(default)]
    port: PortFile,
    fabric: Option<FabricFile>,
}

/// The `[port]` table of the config file.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct PortFile {
    link_layer: Option<PortLinkLayer>,
}

/// `--link-layer`: the names the config file takes.
fn parse_link_layer(name: &str) -> Result<PortLinkLayer, LinkLayerName> {
    match name {
        "ethernet" => Ok(PortLinkLayer::Ethernet),
        "infiniband" => Ok(PortLinkLayer::Infiniband),
        _ => Err(LinkLayerName),
    }
}

/// A `--link-layer` that names no link layer.
#[derive(Debug, thiserror::Error)]
#[error("must be `ethernet` or `infiniband`")]
pub struct LinkLayerName;

/// The `[fabric]` table of the config file.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct FabricFile {
    host: String,
    cluster: PathBuf,
    #[serde(default)]
    directory: DirectoryName,
    etcd_endpoints: Option<Vec<String>>,
    lease_seconds: Option<u64>,
    ip_mtu: Option<u32>,
    packet_io: Option<PacketIoName>,
    xdp_mode: Option<XdpModeName>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
enum PacketIoName {
    AfXdp,
    Udp,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
enum XdpModeName {
    Native,
    Generic,
}

/// Which packet queues carry RoCEv2 (`[fabric] packet_io`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PacketIoChoice {
    /// Not set: AF_XDP where it can be set up, the kernel's UDP path
    /// otherwise (hostd's log says which and why).
    Auto,
    /// `"af_xdp"`: AF_XDP or nothing (hostd does not start without it).
    AfXdp,
    /// `"udp"`: the kernel's UDP path.
    Udp,
}

#[derive(Debug, Default, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
enum DirectoryName {
    #[default]
    Static,
    Etcd,
}

/// Which directory says where GIDs live.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DirectoryKind {
    /// The cluster file is the whole directory.
    Static,
    /// etcd: this host's GIDs published under a lease, the others watched.
    Etcd {
        /// etcd's client URLs (`http://IPv4:port`), as addresses.
        endpoints: Vec<SocketAddr>,
        /// TTL of this host's lease: how long its entries outlive it.
        lease_seconds: u64,
    },
}

/// A validated `[fabric]`: hostd in a cluster.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FabricConfig {
    /// This host's name in the cluster file.
    pub host: String,
    /// The cluster file (absolute: reloads read it again).
    pub cluster_file: PathBuf,
    /// Its content as read at start.
    pub cluster: Cluster,
    pub directory: DirectoryKind,
    /// The IP MTU between the hosts (the interfaces' MTU, 1500 by default):
    /// it decides the ports' active MTU.
    pub ip_mtu: u32,
    /// The packet queues RoCEv2 goes through.
    pub packet_io: PacketIoChoice,
    /// Where the XDP program runs (`xdp_mode`); `None`: generic XDP on a
    /// virtual interface (faster there), native on a real one.
    pub xdp_mode: Option<crate::net::io::XdpMode>,
}

impl FabricConfig {
    /// The largest RoCE path MTU whose packets fit `ip_mtu`: IPv4 (20),
    /// UDP (8), BTH (12), the largest extension header a payload packet
    /// has (RETH 16 + ImmDt 4) and the ICRC (4) around the payload.
    pub fn active_mtu(&self) -> u32 {
        let room = self.ip_mtu.saturating_sub(20 + 8 + 12 + 16 + 4 + 4);
        vrdma_spec::verbs::Mtu::at_most(room).map_or(256, |m| m.bytes())
    }
}

/// Default, smallest and largest `ip_mtu`.
pub const DEFAULT_IP_MTU: u32 = 1500;
pub const MIN_IP_MTU: u32 = 576;
pub const MAX_IP_MTU: u32 = 9216;

pub const DEFAULT_LEASE_SECONDS: u64 = 5;
/// etcd's shortest lease: 1.5 election timeouts of its default 1 s, rounded up.
pub const MIN_LEASE_SECONDS: u64 = 2;
/// A lease longer than an hour keeps a dead host's GIDs for too long.
pub const MAX_LEASE_SECONDS: u64 = 3600;

/// A validated hostd configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    pub socket: PathBuf,
    /// The admin socket (`vrdmactl`), mode 0600.
    pub admin_socket: PathBuf,
    /// The policy file, re-read on SIGHUP and `vrdmactl reload`; `None`:
    /// the built-in default policy (which cannot be reloaded).
    pub policy_file: Option<PathBuf>,
    /// The policy in force at start.
    pub policy: Policy,
    pub physical_qps: u32,
    pub datapath_threads: u32,
    /// CPUs dedicated to the datapath threads (thread `i` on
    /// `datapath_cpus[i % len]`); empty: not pinned.
    pub datapath_cpus: Vec<usize>,
    pub spin_us: u64,
    /// Line rate of the NIC's port, Mbit/s.
    pub line_rate_mbps: u32,
    /// Where Prometheus metrics are served over HTTP; `None`: nowhere.
    pub metrics_listen: Option<std::net::SocketAddr>,
    /// The walls hostd puts up around itself.
    pub sandbox: SandboxConfig,
    /// The link layer of every device's port.
    pub link_layer: PortLinkLayer,
    /// The cluster this hostd is part of; `None`: single host.
    pub fabric: Option<FabricConfig>,
    /// How long a context whose vdev died is kept for the next vdev
    /// (`orphan_grace_ms`); zero: released at once.
    pub orphan_grace: std::time::Duration,
    /// Take over from the running hostd (`--take-over`).
    pub take_over: bool,
}

pub const DEFAULT_PHYSICAL_QPS: u32 = 64;
pub const DEFAULT_DATAPATH_THREADS: u32 = 1;
pub const DEFAULT_SPIN_US: u64 = 200;
/// A BlueField-3 port: 400 Gbit/s.
pub const DEFAULT_LINE_RATE_MBPS: u32 = 400_000;
/// A dead vdev's contexts wait this long for its successor: time enough
/// for systemd's restart (`RestartSec`) and a slow start.
pub const DEFAULT_ORPHAN_GRACE_MS: u64 = 30_000;
/// Longer than this, a dead tenant's memory would stay mapped for no one.
const MAX_ORPHAN_GRACE_MS: u64 = 600_000;
/// Fastest port accepted (1.6 Tbit/s).
const MAX_LINE_RATE_MBPS: u32 = 1_600_000;

/// Default `RLIMIT_NOFILE`: every vdev holds open in hostd its connection,
/// hostd's end of its notification channel, one memfd per memory slot, its
/// doorbell's kick eventfd and a datapath thread's duplicate of it, and one
/// interrupt eventfd per completion vector.
pub const DEFAULT_RLIMIT_NOFILE: u64 = 65536;

/// The admin socket next to `socket`: `<socket>.admin`.
pub fn default_admin_socket(socket: &Path) -> PathBuf {
    let mut name = socket.as_os_str().to_owned();
    name.push(".admin");
    PathBuf::from(name)
}

impl TryFrom<Args> for Config {
    type Error = ConfigError;

    fn try_from(args: Args) -> Result<Self, ConfigError> {
        let file: FileConfig = match &args.config {
            Some(path) => read_config_file(path)?,
            None => parse_config(DEFAULT_CONFIG, Path::new("<embedded default.toml>"))?,
        };
        // A relative `policy` in a config file is relative to that file.
        let file_policy =
            file.policy
                .map(|p| match args.config.as_deref().and_then(Path::parent) {
                    Some(dir) if p.is_relative() => dir.join(p),
                    _ => p,
                });
        let fabric = file
            .fabric
            .map(|f| fabric(f, args.config.as_deref()))
            .transpose()?;
        let socket = args.socket.or(file.socket).ok_or(ConfigError::NoSocket)?;
        let physical_qps = args
            .physical_qps
            .or(file.physical_qps)
            .unwrap_or(DEFAULT_PHYSICAL_QPS);
        // Absolute: the namespace sandbox changes the working directory,
        // and reloads read the file again.
        let policy_file = args
            .policy
            .or(file_policy)
            .map(|p| {
                std::path::absolute(&p).map_err(|source| ConfigError::Path { path: p, source })
            })
            .transpose()?;
        let sandbox = SandboxConfig::resolve(&args.sandbox, file.sandbox, DEFAULT_RLIMIT_NOFILE)
            .map_err(ConfigError::Sandbox)?;
        let mut config = Config {
            admin_socket: args
                .admin_socket
                .or(file.admin_socket)
                .unwrap_or_else(|| default_admin_socket(&socket)),
            socket,
            policy_file,
            policy: Policy::default(),
            physical_qps,
            datapath_threads: args
                .datapath_threads
                .or(file.datapath_threads)
                .unwrap_or(DEFAULT_DATAPATH_THREADS),
            datapath_cpus: args
                .datapath_cpus
                .or(file.datapath_cpus)
                .unwrap_or_default(),
            spin_us: args.spin_us.or(file.spin_us).unwrap_or(DEFAULT_SPIN_US),
            line_rate_mbps: args
                .line_rate_mbps
                .or(file.line_rate_mbps)
                .unwrap_or(DEFAULT_LINE_RATE_MBPS),
            metrics_listen: args.metrics_listen.or(file.metrics_listen),
            sandbox,
            link_layer: args.link_layer.or(file.port.link_layer).unwrap_or_default(),
            fabric,
            orphan_grace: std::time::Duration::from_millis(
                args.orphan_grace_ms
                    .or(file.orphan_grace_ms)
                    .unwrap_or(DEFAULT_ORPHAN_GRACE_MS),
            ),
            take_over: args.take_over,
        };
        config.validate()?;
        config.policy = match &config.policy_file {
            Some(path) => crate::policy::load(path, config.physical_qps),
            None => crate::policy::builtin(config.physical_qps),
        }
        .map_err(ConfigError::Policy)?;
        Ok(config)
    }
}

fn invalid(key: &'static str, value: impl ToString, reason: &'static str) -> ConfigError {
    ConfigError::Invalid {
        key,
        value: value.to_string(),
        reason,
    }
}

impl Config {
    /// The port's line rate in bytes per second.
    pub fn line_rate_bytes(&self) -> u64 {
        u64::from(self.line_rate_mbps) * 1_000_000 / 8
    }

    fn validate(&self) -> Result<(), ConfigError> {
        if !(1..=MAX_PHYSICAL_QPS).contains(&self.physical_qps) {
            return Err(invalid(
                "physical_qps",
                self.physical_qps,
                "must be between 1 and 65536",
            ));
        }
        if !(1..=MAX_DATAPATH_THREADS).contains(&self.datapath_threads) {
            return Err(invalid(
                "datapath_threads",
                self.datapath_threads,
                "must be between 1 and 64",
            ));
        }
        if self.orphan_grace.as_millis() > u128::from(MAX_ORPHAN_GRACE_MS) {
            return Err(invalid(
                "orphan_grace_ms",
                self.orphan_grace.as_millis(),
                "must be at most 600000 (10 minutes)",
            ));
        }
        if let Some(&cpu) = self.datapath_cpus.iter().find(|&&c| c >= MAX_CPUS) {
            return Err(invalid("datapath_cpus", cpu, "must be below 1024"));
        }
        if self.spin_us > MAX_SPIN_US {
            return Err(invalid("spin_us", self.spin_us, "must be at most 1000000"));
        }
        if !(1..=MAX_LINE_RATE_MBPS).contains(&self.line_rate_mbps) {
            return Err(invalid(
                "line_rate_mbps",
                self.line_rate_mbps,
                "must be between 1 and 1600000 (1.6 Tbit/s)",
            ));
        }
        if let Some(DirectoryKind::Etcd { .. }) = self.fabric.as_ref().map(|f| &f.directory) {
            if self.sandbox.mode == SandboxMode::Namespace {
                return Err(invalid(
                    "fabric.directory",
                    "etcd",
                    "cannot be used with sandbox mode `namespace`: hostd's own network \
                     namespace cannot reach etcd (use the process sandbox, or the static \
                     directory)",
                ));
            }
        }
        if self.link_layer == PortLinkLayer::Infiniband && self.fabric.is_some() {
            return Err(invalid(
                "port.link_layer",
                "infiniband",
                "cannot be used with [fabric]: the wire between hosts is RoCEv2, which \
                 needs an Ethernet link layer",
            ));
        }
        if self.admin_socket == self.socket {
            return Err(invalid(
                "admin_socket",
                self.admin_socket.display(),
                "must differ from socket",
            ));
        }
        Ok(())
    }
}

/// Validates `[fabric]` (`config`: the config file, which a relative
/// `cluster` path is relative to).
fn fabric(f: FabricFile, config: Option<&Path>) -> Result<FabricConfig, ConfigError> {
    if !is_valid_name(&f.host) {
        return Err(invalid(
            "fabric.host",
            &f.host,
            "must be 1 to 64 letters, digits, '_', '.' or '-'",
        ));
    }
    let cluster = match config.and_then(Path::parent) {
        Some(dir) if f.cluster.is_relative() => dir.join(&f.cluster),
        _ => f.cluster,
    };
    let cluster_file = std::path::absolute(&cluster).map_err(|source| ConfigError::Path {
        path: cluster.clone(),
        source,
    })?;
    let parsed = Cluster::load(&cluster_file).map_err(ConfigError::Cluster)?;
    if parsed.host(&f.host).is_none() {
        return Err(ConfigError::Cluster(DirectoryError::UnknownHost {
            host: f.host,
            path: cluster_file,
        }));
    }
    let directory = match f.directory {
        DirectoryName::Static => {
            if let Some(e) = &f.etcd_endpoints {
                return Err(invalid(
                    "fabric.etcd_endpoints",
                    format!("{e:?}"),
                    "only with directory = \"etcd\"",
                ));
            }
            if let Some(l) = f.lease_seconds {
                return Err(invalid(
                    "fabric.lease_seconds",
                    l,
                    "only with directory = \"etcd\"",
                ));
            }
            DirectoryKind::Static
        }
        DirectoryName::Etcd => {
            let urls = f.etcd_endpoints.unwrap_or_default();
            if urls.is_empty() {
                return Err(invalid(
                    "fabric.etcd_endpoints",
                    "[]",
                    "directory = \"etcd\" needs at least one endpoint",
                ));
            }
            let endpoints = urls
                .iter()
                .map(|u| {
                    endpoint(u).ok_or_else(|| {
                        invalid(
                            "fabric.etcd_endpoints",
                            u,
                            "must be http://IPv4:PORT (no TLS, no host names, no IPv6)",
                        )
                    })
                })
                .collect::<Result<Vec<_>, _>>()?;
            let lease_seconds = f.lease_seconds.unwrap_or(DEFAULT_LEASE_SECONDS);
            if !(MIN_LEASE_SECONDS..=MAX_LEASE_SECONDS).contains(&lease_seconds) {
                return Err(invalid(
                    "fabric.lease_seconds",
                    lease_seconds,
                    "must be between 2 and 3600",
                ));
            }
            DirectoryKind::Etcd {
                endpoints,
                lease_seconds,
            }
        }
    };
    let ip_mtu = f.ip_mtu.unwrap_or(DEFAULT_IP_MTU);
    if !(MIN_IP_MTU..=MAX_IP_MTU).contains(&ip_mtu) {
        return Err(invalid(
            "fabric.ip_mtu",
            ip_mtu,
            "must be between 576 and 9216",
        ));
    }
    let packet_io = match f.packet_io {
        None => PacketIoChoice::Auto,
        Some(PacketIoName::AfXdp) => PacketIoChoice::AfXdp,
        Some(PacketIoName::Udp) => PacketIoChoice::Udp,
    };
    let xdp_mode = match f.xdp_mode {
        Some(_) if packet_io == PacketIoChoice::Udp => {
            return Err(invalid(
                "fabric.xdp_mode",
                format!("{:?}", f.xdp_mode),
                "only with AF_XDP (packet_io = \"af_xdp\" or not set)",
            ));
        }
        None => None,
        Some(XdpModeName::Native) => Some(crate::net::io::XdpMode::Driver),
        Some(XdpModeName::Generic) => Some(crate::net::io::XdpMode::Generic),
    };
    Ok(FabricConfig {
        host: f.host,
        cluster_file,
        cluster: parsed,
        directory,
        ip_mtu,
        packet_io,
        xdp_mode,
    })
}

/// `http://a.b.c.d:port[/]` as an address. Host names would need DNS,
/// which hostd's sandbox does not reach.
fn endpoint(url: &str) -> Option<SocketAddr> {
    let rest = url.strip_prefix("http://")?;
    let rest = rest.strip_suffix('/').unwrap_or(rest);
    let (ip, port) = rest.rsplit_once(':')?;
    let ip: IpAddr = ip.parse().ok()?;
    let port: u16 = port.parse().ok().filter(|&p| p != 0)?;
    ip.is_ipv4().then_some(SocketAddr::new(ip, port))
}

#[cfg(test)]
mod tests {
    use super::*;
    use vrdma_errors::error_chain;
    use vrdma_isolation::daemon::testing::{arg, parse_command_line, ScratchDir};

    fn parse(args: &[&str]) -> Result<Config, ConfigError> {
        parse_command_line::<Args, _>("hostd", args)
    }

    /// The config of `--config <file>` and `extra`, the file `name` of
    /// `dir` holding `text`.
    fn with_file(
        dir: &ScratchDir,
        name: &str,
        text: &str,
        extra: &[&str],
    ) -> Result<Config, ConfigError> {
        let path = dir.write(name, text);
        parse(&[&["--config", arg(&path)][..], extra].concat())
    }

    #[test]
    fn socket_alone_gives_the_embedded_defaults() {
        let config = parse(&["--socket", "/tmp/h.sock"]).expect("valid");
        assert_eq!(
            config,
            Config {
                socket: "/tmp/h.sock".into(),
                admin_socket: "/tmp/h.sock.admin".into(),
                policy_file: None,
                policy: Policy::default_policy(),
                physical_qps: 64,
                datapath_threads: 1,
                datapath_cpus: vec![],
                spin_us: DEFAULT_SPIN_US,
                line_rate_mbps: 400_000,
                metrics_listen: None,
                sandbox: SandboxConfig::defaults(DEFAULT_RLIMIT_NOFILE),
                link_layer: PortLinkLayer::Ethernet,
                fabric: None,
                orphan_grace: std::time::Duration::from_millis(DEFAULT_ORPHAN_GRACE_MS),
                take_over: false,
            }
        );
        assert_eq!(config.line_rate_bytes(), 50_000_000_000);
        let names: Vec<_> = config
            .policy
            .tenants
            .iter()
            .map(|t| t.name.as_str())
            .collect();
        assert_eq!(names, ["alpha", "beta"]);
        assert!(config.policy.tenants.iter().all(|t| t.network() == "demo"));
    }

    #[test]
    fn flags_override_the_file_and_the_policy_is_loaded() {
        let dir = ScratchDir::new("hostd-config-override");
        let policy = dir.write(
            "override-policy.toml",
            "[[tenant]]\nname = \"red\"\nuid = 1000\nreachable = [\"blue\"]\n\
             [[tenant]]\nname = \"blue\"\nphysical_queues = 4\n",
        );
        let text = format!(
            "socket = \"/tmp/file.sock\"\nphysical_qps = 8\ndatapath_threads = 2\n\
             policy = {policy:?}\nadmin_socket = \"/tmp/admin\"\n"
        );
        let config = with_file(
            &dir,
            "override.toml",
            &text,
            &[
                "--physical-qps",
                "16",
                "--spin-us",
                "0",
                "--line-rate-mbps",
                "25",
                "--datapath-cpus",
                "1,0",
            ],
        )
        .expect("valid");
        assert_eq!(config.socket, PathBuf::from("/tmp/file.sock"));
        assert_eq!(config.admin_socket, PathBuf::from("/tmp/admin"));
        assert_eq!(config.policy_file, Some(policy));
        assert_eq!(
            (config.physical_qps, config.datapath_threads, config.spin_us),
            (16, 2, 0)
        );
        assert_eq!(config.line_rate_mbps, 25);
        assert_eq!(config.datapath_cpus, [1, 0]);
        assert_eq!(config.line_rate_bytes(), 3_125_000);
        let red = config.policy.tenant("red").expect("red");
        assert_eq!(red.network(), "red");
        assert_eq!(red.uid, Some(1000));
        assert!(red.may_reach("blue") && red.may_reach("red") && !red.may_reach("green"));
        assert_eq!(
            config.policy.tenant("blue").expect("blue").physical_queues,
            4
        );
        // --policy wins over the file; a relative `policy` is next to the file.
        let other = dir.write("other-policy.toml", "[[tenant]]\nname = \"solo\"\n");
        let config =
            with_file(&dir, "override.toml", &text, &["--policy", arg(&other)]).expect("valid");
        assert_eq!(config.policy.tenants.len(), 1);
        let config = with_file(
            &dir,
            "relative.toml",
            "socket = \"/tmp/s\"\npolicy = \"other-policy.toml\"\n",
            &[],
        )
        .expect("relative policy path");
        assert_eq!(config.policy.tenants[0].name, "solo");
    }

    #[test]
    fn errors_name_the_key() {
        let cases: &[(&str, &str)] = &[
            ("sq_depth = 1024", "sq_depth"),
            ("physical_qps = 0", "physical_qps"),
            ("datapath_threads = 0", "datapath_threads"),
            ("spin_us = 5000000", "spin_us"),
            ("datapath_cpus = [1, 4096]", "datapath_cpus"),
            ("device_credits = 256", "device_credits"),
            ("line_rate_mbps = 0", "line_rate_mbps"),
            ("line_rate_mbps = 2000000", "line_rate_mbps"),
            ("admin_socket = \"/tmp/s\"", "admin_socket"),
            ("bogus = 1", "bogus"),
            ("queues_per_device = 2", "queues_per_device"),
            ("[[tenant]]\nname = \"a\"", "tenant"),
            ("spin_us = \"big\"", "spin_us"),
            ("[port]\nlink_layer = \"token_ring\"", "link_layer"),
            ("[port]\nlid = 3", "lid"),
        ];
        let dir = ScratchDir::new("hostd-config-errors");
        for (i, (text, key)) in cases.iter().enumerate() {
            let err = with_file(&dir, &format!("bad{i}.toml"), text, &["--socket", "/tmp/s"])
                .expect_err(text);
            let chain = error_chain(&err);
            assert!(chain.contains(key), "{text:?} gave {chain:?}");
        }
    }

    #[test]
    fn bad_policies_name_file_line_and_key() {
        let dir = ScratchDir::new("hostd-config-bad-policies");
        let policy = dir.write(
            "bad-policy.toml",
            "[[tenant]]\nname = \"a\"\n\n[[tenant]]\nname = \"b\"\npriority = { weight = 0 }\n",
        );
        let err = parse(&["--socket", "/tmp/s", "--policy", arg(&policy)]).expect_err("weight 0");
        let chain = error_chain(&err);
        assert!(
            chain.contains("bad-policy.toml:6") && chain.contains("tenant[1].priority.weight"),
            "{chain}"
        );
        let queues = dir.write(
            "queues-policy.toml",
            "[[tenant]]\nname = \"a\"\nphysical_queues = 3\n",
        );
        let err = parse(&[
            "--socket",
            "/tmp/s",
            "--policy",
            arg(&queues),
            "--physical-qps",
            "2",
        ])
        .expect_err("3 queues of 2");
        assert!(error_chain(&err).contains("tenant[0].physical_queues"));
        assert!(matches!(
            parse(&["--socket", "/tmp/s", "--policy", "/nonexistent/p.toml"]),
            Err(ConfigError::Policy(PolicyError::Read { .. }))
        ));
    }

    /// The sandbox settings (parsed and checked by vrdma-isolation, the
    /// same for vdev) reach hostd's config from flags and from the
    /// `[sandbox]` table, flags first.
    #[test]
    fn sandbox_flags_and_file_keys() {
        use vrdma_isolation::namespaces::SandboxMode;
        use vrdma_isolation::seccomp::{SeccompMode, ViolationAction};
        let config =
            parse(&["--socket", "/tmp/s", "--seccomp", "trap", "--uid", "1234"]).expect("valid");
        assert_eq!(
            config.sandbox,
            SandboxConfig {
                seccomp: SeccompMode::Enforce(ViolationAction::Trap),
                uid: Some(1234),
                ..SandboxConfig::defaults(DEFAULT_RLIMIT_NOFILE)
            }
        );
        let dir = ScratchDir::new("hostd-config-sandbox");
        let text = "socket = \"/tmp/s\"\n[sandbox]\nmode = \"namespace\"\nlandlock = false\n";
        let config = with_file(&dir, "sandbox.toml", text, &[]).expect("valid");
        assert_eq!(config.sandbox.mode, SandboxMode::Namespace);
        assert!(!config.sandbox.landlock);
        let config = with_file(&dir, "sandbox.toml", text, &["--landlock", "on"]).expect("valid");
        assert!(config.sandbox.landlock);
        for (text, key) in [
            ("[sandbox]\nseccomp = \"nope\"", "seccomp"),
            ("[sandbox]\nrlimit_nofile = 3", "Open-file limit 3"),
            ("[sandbox]\nlandlok = true", "landlok"),
        ] {
            let err =
                with_file(&dir, "bad-sandbox.toml", text, &["--socket", "/tmp/s"]).expect_err(text);
            assert!(error_chain(&err).contains(key), "{text:?} gave {err}");
        }
    }

    #[test]
    fn the_port_link_layer_from_file_and_flag() {
        let dir = ScratchDir::new("hostd-config-port");
        let ib = "socket = \"/tmp/s\"\n[port]\nlink_layer = \"infiniband\"\n";
        let config = with_file(&dir, "ib.toml", ib, &[]).expect("valid");
        assert_eq!(config.link_layer, PortLinkLayer::Infiniband);
        let eth = "socket = \"/tmp/s\"\n[port]\nlink_layer = \"ethernet\"\n";
        let config = with_file(&dir, "eth.toml", eth, &[]).expect("valid");
        assert_eq!(config.link_layer, PortLinkLayer::Ethernet);
        // The flag wins over the file.
        let config = with_file(&dir, "ib.toml", ib, &["--link-layer", "ethernet"]).expect("valid");
        assert_eq!(config.link_layer, PortLinkLayer::Ethernet);
        let config = parse(&["--socket", "/tmp/s", "--link-layer", "infiniband"]).expect("valid");
        assert_eq!(config.link_layer, PortLinkLayer::Infiniband);
        let refused = Args::try_parse_from(["hostd", "--socket", "/tmp/s", "--link-layer", "ib"])
            .expect_err("not a link layer");
        assert!(refused.to_string().contains("ethernet"), "{refused}");
    }

    #[test]
    fn infiniband_is_single_host() {
        let dir = ScratchDir::new("hostd-config-ib-fabric");
        dir.write("cluster.toml", CLUSTER);
        let text = "socket = \"/tmp/s\"\n[port]\nlink_layer = \"infiniband\"\n\
                    [fabric]\nhost = \"h1\"\ncluster = \"cluster.toml\"\n";
        let err = with_file(&dir, "ib-fabric.toml", text, &[]).expect_err("IB with a fabric");
        let chain = error_chain(&err);
        assert!(
            chain.contains("port.link_layer") && chain.contains("RoCEv2"),
            "{chain}"
        );
        // The same cluster with Ethernet ports is fine.
        let text = text.replace("infiniband", "ethernet");
        with_file(&dir, "eth-fabric.toml", &text, &[]).expect("valid");
    }

    const CLUSTER: &str = "[[host]]\nname = \"h1\"\naddress = \"10.200.0.1\"\n\
        [[host]]\nname = \"h2\"\naddress = \"10.200.0.2\"\n\
        [[gid]]\naddress = \"10.200.1.1\"\nhost = \"h1\"\ntenant = \"alpha\"\n";

    #[test]
    fn fabric_table_is_validated() {
        use crate::net::directory::{ClusterGid, HostEntry};
        use std::net::Ipv4Addr;
        let dir = ScratchDir::new("hostd-config-fabric");
        let cluster_path = dir.write("cluster.toml", CLUSTER);
        // A relative cluster file is next to the config file.
        let config = with_file(
            &dir,
            "static.toml",
            "socket = \"/tmp/s\"\n[fabric]\nhost = \"h1\"\ncluster = \"cluster.toml\"\n",
            &[],
        )
        .expect("valid");
        let cluster = Cluster {
            hosts: vec![
                HostEntry {
                    name: "h1".into(),
                    address: Ipv4Addr::new(10, 200, 0, 1),
                },
                HostEntry {
                    name: "h2".into(),
                    address: Ipv4Addr::new(10, 200, 0, 2),
                },
            ],
            gids: vec![ClusterGid {
                gid: Ipv4Addr::new(10, 200, 1, 1),
                host: "h1".into(),
                tenant: "alpha".into(),
                network: None,
            }],
        };
        assert_eq!(
            config.fabric,
            Some(FabricConfig {
                host: "h1".into(),
                cluster_file: cluster_path.clone(),
                cluster: cluster.clone(),
                directory: DirectoryKind::Static,
                ip_mtu: DEFAULT_IP_MTU,
                packet_io: PacketIoChoice::Auto,
                xdp_mode: None,
            })
        );
        // The ports' MTU follows the network's: 1024 at 1500, 4096 jumbo.
        let fabric = config.fabric.clone().expect("fabric");
        assert_eq!(fabric.active_mtu(), 1024);
        assert_eq!(
            FabricConfig {
                ip_mtu: 9000,
                ..fabric.clone()
            }
            .active_mtu(),
            4096
        );
        assert_eq!(
            FabricConfig {
                ip_mtu: 2200,
                ..fabric
            }
            .active_mtu(),
            2048
        );
        let text = format!(
            "socket = \"/tmp/s\"\n[fabric]\nhost = \"h2\"\ncluster = {cluster_path:?}\n\
             directory = \"etcd\"\netcd_endpoints = [\"http://127.0.0.1:2379\", \
             \"http://10.0.0.9:23790/\"]\n"
        );
        let config = with_file(&dir, "etcd.toml", &text, &[]).expect("valid");
        assert_eq!(
            config.fabric,
            Some(FabricConfig {
                host: "h2".into(),
                cluster_file: cluster_path.clone(),
                cluster,
                directory: DirectoryKind::Etcd {
                    endpoints: vec![
                        "127.0.0.1:2379".parse().expect("addr"),
                        "10.0.0.9:23790".parse().expect("addr"),
                    ],
                    lease_seconds: DEFAULT_LEASE_SECONDS,
                },
                ip_mtu: DEFAULT_IP_MTU,
                packet_io: PacketIoChoice::Auto,
                xdp_mode: None,
            })
        );
        let config = with_file(
            &dir,
            "lease.toml",
            &format!("{text}lease_seconds = 2\n"),
            &[],
        )
        .expect("valid");
        assert!(matches!(
            config.fabric.map(|f| f.directory),
            Some(DirectoryKind::Etcd {
                lease_seconds: 2,
                ..
            })
        ));
        dir.write(
            "bad-cluster.toml",
            "[[host]]\nname = \"h1\"\naddress = \"fd00::1\"\n",
        );
        let table = |rest: &str| {
            format!(
                "socket = \"/tmp/s\"\n[fabric]\nhost = \"h1\"\ncluster = \"cluster.toml\"\n{rest}"
            )
        };
        let etcd = "directory = \"etcd\"\netcd_endpoints = [\"http://127.0.0.1:2379\"]\n";
        let cases: Vec<(String, &str)> =
            vec![
            (table("bogus = 1\n"), "bogus"),
            (table("directory = \"zk\"\n"), "zk"),
            (
                table("etcd_endpoints = [\"http://127.0.0.1:2379\"]\n"),
                "fabric.etcd_endpoints",
            ),
            (table("lease_seconds = 5\n"), "fabric.lease_seconds"),
            (table("packet_io = \"dpdk\"\n"), "dpdk"),
            (table("xdp_mode = \"offload\"\n"), "offload"),
            (
                table("packet_io = \"udp\"\nxdp_mode = \"native\"\n"),
                "fabric.xdp_mode",
            ),
            (table("directory = \"etcd\"\n"), "needs at least one endpoint"),
            (table(&format!("{etcd}lease_seconds = 1\n")), "fabric.lease_seconds"),
            (table(&format!("{etcd}lease_seconds = 7200\n")), "fabric.lease_seconds"),
            (
                table(&format!("{etcd}[sandbox]\nmode = \"namespace\"\n")),
                "fabric.directory",
            ),
            (
                "socket = \"/tmp/s\"\n[fabric]\nhost = \"h3\"\ncluster = \"cluster.toml\"\n"
                    .to_owned(),
                "Host \"h3\" is not in the cluster file",
            ),
            (
                "socket = \"/tmp/s\"\n[fabric]\nhost = \"h/1\"\ncluster = \"cluster.toml\"\n"
                    .to_owned(),
                "fabric.host",
            ),
            (
                "socket = \"/tmp/s\"\n[fabric]\nhost = \"h1\"\ncluster = \"bad-cluster.toml\"\n"
                    .to_owned(),
                "bad-cluster.toml: host[0] (h1): address fd00::1: IPv6",
            ),
            (
                "socket = \"/tmp/s\"\n[fabric]\nhost = \"h1\"\ncluster = \"none.toml\"\n"
                    .to_owned(),
                "none.toml",
            ),
            ("socket = \"/tmp/s\"\n[fabric]\nhost = \"h1\"\n".to_owned(), "cluster"),
        ];
        for (i, (text, wanted)) in cases.iter().enumerate() {
            let err = with_file(&dir, &format!("bad-fabric{i}.toml"), text, &[]).expect_err(text);
            let chain = error_chain(&err);
            assert!(chain.contains(wanted), "{text:?} gave {chain:?}");
        }
        for url in [
            "https://127.0.0.1:2379",
            "http://etcd.local:2379",
            "http://[::1]:2379",
            "http://127.0.0.1",
            "http://127.0.0.1:0",
            "127.0.0.1:2379",
        ] {
            let text = table(&format!(
                "directory = \"etcd\"\netcd_endpoints = [\"{url}\"]\n"
            ));
            let err = with_file(&dir, "bad-url.toml", &text, &[]).expect_err(url);
            let chain = error_chain(&err);
            assert!(
                chain.contains("fabric.etcd_endpoints") && chain.contains(url),
                "{url}: {chain}"
            );
        }
    }

    #[test]
    fn missing_socket_and_file_are_refused() {
        assert!(matches!(parse(&[]), Err(ConfigError::NoSocket)));
        assert!(matches!(
            parse(&["--socket", "/tmp/s", "--config", "/nonexistent/hostd.toml"]),
            Err(ConfigError::File(ConfigFileError::Read { .. }))
        ));
    }
}
