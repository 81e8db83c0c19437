//! vdev configuration: command line and file, validated into [`Config`].
//!
//! The command line (clap) names a config file and may override its most
//! used keys; the file (TOML, serde) holds the rest. Both are untrusted: the
//! result is validated into a [`Config`] that derives `PartialEq`, so tests
//! compare what a command line means with what they expect.

use std::path::PathBuf;

use clap::Parser;
use serde::Deserialize;
use vrdma_isolation::config::{SandboxArgs, SandboxConfig, SandboxConfigError, SandboxFile};
use vrdma_isolation::daemon::{read_config_file, ConfigFileError};
use vrdma_tenant_policy::{Limits, LimitsError};

/// Largest virtqueue size vdev accepts (the split-ring maximum).
const MAX_QUEUE_SIZE: u16 = 32768;
/// Largest number of completion vectors (event queues).
const MAX_COMP_VECTORS: u16 = 64;

/// Why a configuration is refused.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error(transparent)]
    File(#[from] ConfigFileError),
    #[error("Invalid path {}", path.display())]
    Path {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("No vhost-user socket given (--socket or `socket` in the config file)")]
    NoSocket,
    #[error("Tenant name {0:?} must be 1-64 characters of [A-Za-z0-9_.-], the first not . or -")]
    TenantName(String),
    #[error("Queue size {0} must be a power of two between 2 and {MAX_QUEUE_SIZE}")]
    QueueSize(u16),
    #[error("Completion vectors {0} must be between 1 and {MAX_COMP_VECTORS}")]
    CompVectors(u16),
    #[error("Port LID {0:#x} must be a unicast LID (0x1-0xbfff)")]
    Lid(u16),
    #[error("Invalid limits")]
    Limits(#[source] LimitsError),
    #[error("Invalid sandbox settings")]
    Sandbox(#[source] SandboxConfigError),
}

/// Command line of `vdev`.
#[derive(Debug, Parser)]
#[command(
    version,
    about = "vrdma vdev: the vhost-user backend of one tenant's virtual RDMA device"
)]
pub struct Args {
    /// Path of the vhost-user unix socket to listen on.
    #[arg(long)]
    pub socket: Option<PathBuf>,
    /// TOML config file (see docs/operations.md); flags override its keys.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Tenant this device belongs to (appears on every log line).
    #[arg(long)]
    pub tenant: Option<String>,
    /// The port's LID without hostd (with `--hostd`, hostd assigns it).
    #[arg(long)]
    pub lid: Option<u16>,
    /// Number of completion vectors (event queues).
    #[arg(long)]
    pub comp_vectors: Option<u16>,
    /// hostd's socket: attach the device to the host's fabric (without it
    /// the device has a control path but no peer to reach).
    #[arg(long)]
    pub hostd: Option<PathBuf>,
    /// Serve one frontend connection, then exit (default: serve again after
    /// each disconnect, as a VM reboot or a restarted application needs).
    #[arg(long)]
    pub once: bool,
    /// The sandbox: the same flags, meaning and checks as hostd's.
    #[command(flatten)]
    pub sandbox: SandboxArgs,
}

/// The config file. Every key is optional; unknown keys are errors.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileConfig {
    socket: Option<PathBuf>,
    tenant: Option<String>,
    lid: Option<u16>,
    comp_vectors: Option<u16>,
    queue_size: Option<u16>,
    hostd: Option<PathBuf>,
    #[serde(default)]
    limits: Limits,
    #[serde(default)]
    sandbox: SandboxFile,
}

/// A validated vdev configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    pub socket: PathBuf,
    pub tenant: String,
    pub lid: u16,
    pub comp_vectors: u16,
    pub queue_size: u16,
    pub limits: Limits,
    pub hostd: Option<PathBuf>,
    pub once: bool,
    pub sandbox: SandboxConfig,
}

/// Open descriptors: for each of up to 64 contexts (`MAX_CONTEXTS`) its
/// connection, every queue's kick and call eventfds (and their copies lent
/// to hostd), its hostd channels and its memory slots — in process mode a
/// memfd per registered region, hundreds for an MPI rank.
pub const DEFAULT_NOFILE: u64 = 65536;

/// Defaults for what neither the file nor the flags say.
pub const DEFAULT_TENANT: &str = "default";
pub const DEFAULT_LID: u16 = 1;
pub const DEFAULT_COMP_VECTORS: u16 = 1;
pub const DEFAULT_QUEUE_SIZE: u16 = 256;

impl TryFrom<Args> for Config {
    type Error = ConfigError;

    fn try_from(args: Args) -> Result<Self, ConfigError> {
        let file = match &args.config {
            Some(path) => read_config_file(path)?,
            None => FileConfig::default(),
        };
        let sandbox = SandboxConfig::resolve(&args.sandbox, file.sandbox, DEFAULT_NOFILE)
            .map_err(ConfigError::Sandbox)?;
        let config = Config {
            socket: args.socket.or(file.socket).ok_or(ConfigError::NoSocket)?,
            tenant: args
                .tenant
                .or(file.tenant)
                .unwrap_or_else(|| DEFAULT_TENANT.into()),
            lid: args.lid.or(file.lid).unwrap_or(DEFAULT_LID),
            comp_vectors: args
                .comp_vectors
                .or(file.comp_vectors)
                .unwrap_or(DEFAULT_COMP_VECTORS),
            queue_size: file.queue_size.unwrap_or(DEFAULT_QUEUE_SIZE),
            limits: file.limits,
            // Absolute: the namespace sandbox changes the working directory.
            hostd: args
                .hostd
                .or(file.hostd)
                .map(|p| {
                    std::path::absolute(&p).map_err(|source| ConfigError::Path { path: p, source })
                })
                .transpose()?,
            once: args.once,
            sandbox,
        };
        config.validate()?;
        Ok(config)
    }
}

impl Config {
    fn validate(&self) -> Result<(), ConfigError> {
        if !vrdma_tenant_policy::is_valid_name(&self.tenant) {
            return Err(ConfigError::TenantName(self.tenant.clone()));
        }
        if !self.queue_size.is_power_of_two() || !(2..=MAX_QUEUE_SIZE).contains(&self.queue_size) {
            return Err(ConfigError::QueueSize(self.queue_size));
        }
        if !(1..=MAX_COMP_VECTORS).contains(&self.comp_vectors) {
            return Err(ConfigError::CompVectors(self.comp_vectors));
        }
        if !(0x1..=0xbfff).contains(&self.lid) {
            return Err(ConfigError::Lid(self.lid));
        }
        self.limits.validate().map_err(ConfigError::Limits)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vrdma_isolation::daemon::testing::{arg, parse_command_line, ScratchDir};

    fn parse(args: &[&str]) -> Result<Config, ConfigError> {
        parse_command_line::<Args, _>("vdev", args)
    }

    #[test]
    fn flags_alone_give_defaults() {
        let config = parse(&["--socket", "/tmp/a.sock"]).expect("valid");
        assert_eq!(
            config,
            Config {
                socket: "/tmp/a.sock".into(),
                tenant: DEFAULT_TENANT.into(),
                lid: DEFAULT_LID,
                comp_vectors: DEFAULT_COMP_VECTORS,
                queue_size: DEFAULT_QUEUE_SIZE,
                limits: Limits::default(),
                hostd: None,
                once: false,
                sandbox: SandboxConfig::defaults(DEFAULT_NOFILE),
            }
        );
    }

    /// The sandbox settings (parsed and checked by vrdma-isolation, the
    /// same for hostd) reach vdev's config from flags and from the
    /// `[sandbox]` table, flags first.
    #[test]
    fn sandbox_flags_and_file_keys() {
        use vrdma_isolation::namespaces::SandboxMode;
        use vrdma_isolation::seccomp::{SeccompMode, ViolationAction};
        let config = parse(&[
            "--socket",
            "/s",
            "--seccomp",
            "trap",
            "--sandbox",
            "namespace",
        ])
        .expect("valid");
        assert_eq!(
            config.sandbox,
            SandboxConfig {
                mode: SandboxMode::Namespace,
                seccomp: SeccompMode::Enforce(ViolationAction::Trap),
                ..SandboxConfig::defaults(DEFAULT_NOFILE)
            }
        );
        assert!(matches!(
            parse(&["--socket", "/s", "--rlimit-nofile", "3"]),
            Err(ConfigError::Sandbox(_))
        ));

        let dir = ScratchDir::new("vdev-config-sandbox");
        let text = "socket = \"/s\"\n[sandbox]\nseccomp = \"log\"\nuid = 4000\n";
        let file = dir.write("vdev.toml", text);
        let config = parse(&["--config", arg(&file)]).expect("valid");
        assert_eq!(
            config.sandbox.seccomp,
            SeccompMode::Enforce(ViolationAction::Log)
        );
        assert_eq!(config.sandbox.uid, Some(4000));
        let config = parse(&["--config", arg(&file), "--seccomp", "kill"]).expect("valid");
        assert_eq!(config.sandbox.seccomp, SeccompMode::default());
        let bad = dir.write(
            "bad.toml",
            "socket = \"/s\"\n[sandbox]\nseccomp = \"nope\"\n",
        );
        assert!(matches!(
            parse(&["--config", arg(&bad)]),
            Err(ConfigError::Sandbox(_))
        ));
    }

    #[test]
    fn flags_override_the_file() {
        let dir = ScratchDir::new("vdev-config-override");
        let file = dir.write(
            "vdev.toml",
            "socket = \"/run/x.sock\"\ntenant = \"blue\"\nlid = 7\n[limits]\nmax_qp = 4\n",
        );
        let config = parse(&["--config", arg(&file), "--lid", "9"]).expect("valid");
        assert_eq!(config.socket, PathBuf::from("/run/x.sock"));
        assert_eq!(config.tenant, "blue");
        assert_eq!(config.lid, 9);
        assert_eq!(config.limits.max_qp, 4);
        let file = dir.write("vdev.toml", "socket = \"/x\"\nlimitz = 1\n");
        let err = parse(&["--config", arg(&file)]).expect_err("unknown key");
        let chain = format!(
            "{err}: {}",
            std::error::Error::source(&err).expect("source")
        );
        assert!(
            chain.contains("limitz") && chain.contains("vdev.toml"),
            "{chain}"
        );
    }

    #[test]
    fn bad_values_are_refused() {
        assert!(matches!(parse(&[]), Err(ConfigError::NoSocket)));
        assert!(matches!(
            parse(&["--socket", "/s", "--tenant", "a b"]),
            Err(ConfigError::TenantName(_))
        ));
        for name in ["..", ".", ".hidden", "-x"] {
            let tenant = format!("--tenant={name}");
            assert!(
                matches!(
                    parse(&["--socket", "/s", &tenant]),
                    Err(ConfigError::TenantName(_))
                ),
                "{name}"
            );
        }
        assert!(matches!(
            parse(&["--socket", "/s", "--lid", "0"]),
            Err(ConfigError::Lid(0))
        ));
        assert!(matches!(
            parse(&["--socket", "/s", "--comp-vectors", "0"]),
            Err(ConfigError::CompVectors(0))
        ));
    }

    /// vdev has no datapath thread any more (hostd reads the rings), so
    /// its polling and CPU-priority settings are gone, and a file or
    /// command line still naming them is refused rather than ignored.
    #[test]
    fn datapath_settings_are_refused() {
        assert!(Args::try_parse_from(["vdev", "--socket", "/s", "--class-cpu-priority"]).is_err());
        let dir = ScratchDir::new("vdev-config-datapath-keys");
        for key in ["spin_us = 200", "class_cpu_priority = true"] {
            let file = dir.write("vdev.toml", format!("socket = \"/s\"\n{key}\n"));
            let err = parse(&["--config", arg(&file)]).expect_err(key);
            assert!(
                matches!(err, ConfigError::File(ConfigFileError::Parse { .. })),
                "{key}: {err}"
            );
        }
    }
}
