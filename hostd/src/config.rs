//! hostd configuration: command line and TOML file, validated into [`Config`].
//!
//! The file (or, without `--config`, the embedded `default.toml`) holds every
//! key; flags override the scalar ones. Whatever arrives is validated into a
//! [`Config`] deriving `PartialEq`, so tests compare what a command line
//! means with what they expect, and every error names the offending key.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use clap::Parser;
use serde::Deserialize;
use vrdma_hostd_protocol::channel::MAX_FDS;

/// The configuration used when no `--config` is given.
pub const DEFAULT_CONFIG: &str = include_str!("default.toml");

/// Largest ring depth (entries) of a physical queue.
pub const MAX_DEPTH: u32 = 1 << 16;
/// Largest number of physical QPs the modelled NIC has.
pub const MAX_PHYSICAL_QPS: u32 = 1 << 16;
/// A Welcome carries one fd per queue plus two eventfds in one message.
pub const MAX_QUEUES_PER_DEVICE: u32 = (MAX_FDS - 2) as u32;
/// Datapath threads beyond this only burn cores.
pub const MAX_DATAPATH_THREADS: u32 = 64;
/// Busy-poll time above one second is a misconfiguration.
pub const MAX_SPIN_US: u64 = 1_000_000;

/// Why a configuration is refused.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("Cannot read config file {path}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("Invalid config file {path}")]
    Parse {
        path: PathBuf,
        #[source]
        source: Box<toml::de::Error>,
    },
    #[error("No socket given (--socket or `socket` in the config file)")]
    NoSocket,
    #[error("Invalid `{key}` ({value}): {reason}")]
    Invalid {
        key: &'static str,
        value: String,
        reason: &'static str,
    },
    #[error("No `[[tenant]]` configured")]
    NoTenants,
    #[error("Duplicate `tenant.name` {0:?}")]
    DuplicateTenant(String),
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
    /// TOML config file (default: the embedded two-tenant demo config).
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Physical QPs of the NIC (shared by all vdevs).
    #[arg(long)]
    pub physical_qps: Option<u32>,
    /// Physical QPs granted to each vdev.
    #[arg(long)]
    pub queues_per_device: Option<u32>,
    /// Entries of each submission ring (power of two).
    #[arg(long)]
    pub sq_depth: Option<u32>,
    /// Entries of each completion ring (power of two).
    #[arg(long)]
    pub cq_depth: Option<u32>,
    /// Polling threads of the datapath.
    #[arg(long)]
    pub datapath_threads: Option<u32>,
    /// Microseconds of busy polling after the last work before sleeping.
    #[arg(long)]
    pub spin_us: Option<u64>,
}

/// The config file. Unknown keys are errors.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileConfig {
    socket: Option<PathBuf>,
    physical_qps: Option<u32>,
    queues_per_device: Option<u32>,
    sq_depth: Option<u32>,
    cq_depth: Option<u32>,
    datapath_threads: Option<u32>,
    spin_us: Option<u64>,
    #[serde(default)]
    tenant: Vec<FileTenant>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileTenant {
    name: String,
    network: Option<String>,
    uid: Option<u32>,
    #[serde(default)]
    reachable: Vec<String>,
}

/// One tenant hostd serves.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tenant {
    pub name: String,
    /// Tenants of one network reach each other.
    pub network: String,
    /// If set, a vdev of this tenant must run as this uid (SO_PEERCRED).
    pub uid: Option<u32>,
    /// Other networks this tenant's QPs may connect to.
    pub reachable: BTreeSet<String>,
}

impl Tenant {
    /// Whether this tenant may connect a QP to a tenant of `network`.
    pub fn reaches(&self, network: &str) -> bool {
        self.network == network || self.reachable.contains(network)
    }
}

/// A validated hostd configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    pub socket: PathBuf,
    pub physical_qps: u32,
    pub queues_per_device: u32,
    pub sq_depth: u32,
    pub cq_depth: u32,
    pub datapath_threads: u32,
    pub spin_us: u64,
    pub tenants: Vec<Tenant>,
}

pub const DEFAULT_PHYSICAL_QPS: u32 = 64;
pub const DEFAULT_QUEUES_PER_DEVICE: u32 = 2;
pub const DEFAULT_SQ_DEPTH: u32 = 1024;
pub const DEFAULT_CQ_DEPTH: u32 = 4096;
pub const DEFAULT_DATAPATH_THREADS: u32 = 1;
pub const DEFAULT_SPIN_US: u64 = 200;

impl TryFrom<Args> for Config {
    type Error = ConfigError;

    fn try_from(args: Args) -> Result<Self, ConfigError> {
        let file = match &args.config {
            Some(path) => read_file(path)?,
            None => parse_text(DEFAULT_CONFIG, Path::new("<embedded default.toml>"))?,
        };
        let tenants = file
            .tenant
            .into_iter()
            .map(|t| Tenant {
                network: t.network.unwrap_or_else(|| t.name.clone()),
                name: t.name,
                uid: t.uid,
                reachable: t.reachable.into_iter().collect(),
            })
            .collect();
        let config = Config {
            socket: args.socket.or(file.socket).ok_or(ConfigError::NoSocket)?,
            physical_qps: args
                .physical_qps
                .or(file.physical_qps)
                .unwrap_or(DEFAULT_PHYSICAL_QPS),
            queues_per_device: args
                .queues_per_device
                .or(file.queues_per_device)
                .unwrap_or(DEFAULT_QUEUES_PER_DEVICE),
            sq_depth: args.sq_depth.or(file.sq_depth).unwrap_or(DEFAULT_SQ_DEPTH),
            cq_depth: args.cq_depth.or(file.cq_depth).unwrap_or(DEFAULT_CQ_DEPTH),
            datapath_threads: args
                .datapath_threads
                .or(file.datapath_threads)
                .unwrap_or(DEFAULT_DATAPATH_THREADS),
            spin_us: args.spin_us.or(file.spin_us).unwrap_or(DEFAULT_SPIN_US),
            tenants,
        };
        config.validate()?;
        Ok(config)
    }
}

fn read_file(path: &Path) -> Result<FileConfig, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
        path: path.to_owned(),
        source,
    })?;
    parse_text(&text, path)
}

fn parse_text(text: &str, path: &Path) -> Result<FileConfig, ConfigError> {
    toml::from_str(text).map_err(|source| ConfigError::Parse {
        path: path.to_owned(),
        source: Box::new(source),
    })
}

/// Tenant and network names: short, printable, safe in logs.
fn valid_name(name: &str) -> bool {
    (1..=64).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"_.-".contains(&b))
}

fn invalid(key: &'static str, value: impl ToString, reason: &'static str) -> ConfigError {
    ConfigError::Invalid {
        key,
        value: value.to_string(),
        reason,
    }
}

impl Config {
    /// The tenant called `name`.
    pub fn tenant(&self, name: &str) -> Option<&Tenant> {
        self.tenants.iter().find(|t| t.name == name)
    }

    fn validate(&self) -> Result<(), ConfigError> {
        if !(1..=MAX_PHYSICAL_QPS).contains(&self.physical_qps) {
            return Err(invalid(
                "physical_qps",
                self.physical_qps,
                "must be between 1 and 65536",
            ));
        }
        if !(1..=MAX_QUEUES_PER_DEVICE).contains(&self.queues_per_device) {
            return Err(invalid(
                "queues_per_device",
                self.queues_per_device,
                "must be between 1 and 30 (one fd per queue in the Welcome)",
            ));
        }
        if self.queues_per_device > self.physical_qps {
            return Err(invalid(
                "queues_per_device",
                self.queues_per_device,
                "must not exceed physical_qps",
            ));
        }
        for (key, depth) in [("sq_depth", self.sq_depth), ("cq_depth", self.cq_depth)] {
            if !depth.is_power_of_two() || !(2..=MAX_DEPTH).contains(&depth) {
                return Err(invalid(
                    key,
                    depth,
                    "must be a power of two between 2 and 65536",
                ));
            }
        }
        if !(1..=MAX_DATAPATH_THREADS).contains(&self.datapath_threads) {
            return Err(invalid(
                "datapath_threads",
                self.datapath_threads,
                "must be between 1 and 64",
            ));
        }
        if self.spin_us > MAX_SPIN_US {
            return Err(invalid("spin_us", self.spin_us, "must be at most 1000000"));
        }
        if self.tenants.is_empty() {
            return Err(ConfigError::NoTenants);
        }
        let mut names = BTreeSet::new();
        for tenant in &self.tenants {
            if !valid_name(&tenant.name) {
                return Err(invalid(
                    "tenant.name",
                    format!("{:?}", tenant.name),
                    "must be 1-64 characters of [A-Za-z0-9_.-]",
                ));
            }
            if !names.insert(tenant.name.as_str()) {
                return Err(ConfigError::DuplicateTenant(tenant.name.clone()));
            }
            if !valid_name(&tenant.network) {
                return Err(invalid(
                    "tenant.network",
                    format!("{:?}", tenant.network),
                    "must be 1-64 characters of [A-Za-z0-9_.-]",
                ));
            }
            if let Some(bad) = tenant.reachable.iter().find(|n| !valid_name(n)) {
                return Err(invalid(
                    "tenant.reachable",
                    format!("{bad:?}"),
                    "must be 1-64 characters of [A-Za-z0-9_.-]",
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<Config, ConfigError> {
        Config::try_from(
            Args::try_parse_from(std::iter::once("hostd").chain(args.iter().copied()))
                .expect("clap accepts"),
        )
    }

    fn with_file(name: &str, text: &str, extra: &[&str]) -> Result<Config, ConfigError> {
        let dir = std::env::temp_dir().join(format!("hostd-config-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let path = dir.join(name);
        std::fs::write(&path, text).expect("write config");
        let path = path.to_str().expect("utf-8 path").to_owned();
        let mut args = vec!["--config", path.as_str()];
        args.extend_from_slice(extra);
        parse(&args)
    }

    fn full_chain(e: &dyn std::error::Error) -> String {
        crate::error_chain(e)
    }

    #[test]
    fn socket_alone_gives_the_embedded_defaults() {
        let config = parse(&["--socket", "/tmp/h.sock"]).expect("valid");
        let demo = |name: &str| Tenant {
            name: name.into(),
            network: "demo".into(),
            uid: None,
            reachable: BTreeSet::new(),
        };
        assert_eq!(
            config,
            Config {
                socket: "/tmp/h.sock".into(),
                physical_qps: 64,
                queues_per_device: 2,
                sq_depth: 1024,
                cq_depth: 4096,
                datapath_threads: 1,
                spin_us: DEFAULT_SPIN_US,
                tenants: vec![demo("alpha"), demo("beta")],
            }
        );
    }

    #[test]
    fn flags_override_the_file_and_network_defaults_to_name() {
        let text = r#"
            socket = "/tmp/file.sock"
            physical_qps = 8
            sq_depth = 64
            [[tenant]]
            name = "red"
            uid = 1000
            reachable = ["blue"]
            [[tenant]]
            name = "blue"
        "#;
        let config = with_file(
            "override.toml",
            text,
            &["--physical-qps", "16", "--spin-us", "0"],
        )
        .expect("valid");
        assert_eq!(config.socket, PathBuf::from("/tmp/file.sock"));
        assert_eq!(config.physical_qps, 16);
        assert_eq!(config.sq_depth, 64);
        assert_eq!(config.spin_us, 0);
        let red = config.tenant("red").expect("red");
        assert_eq!(red.network, "red");
        assert_eq!(red.uid, Some(1000));
        assert!(red.reaches("blue") && red.reaches("red") && !red.reaches("green"));
        assert!(!config.tenant("blue").expect("blue").reaches("red"));
    }

    #[test]
    fn errors_name_the_key() {
        let cases: &[(&str, &str)] = &[
            ("sq_depth = 1000\n[[tenant]]\nname = \"a\"", "sq_depth"),
            ("cq_depth = 0\n[[tenant]]\nname = \"a\"", "cq_depth"),
            ("physical_qps = 0\n[[tenant]]\nname = \"a\"", "physical_qps"),
            (
                "physical_qps = 2\nqueues_per_device = 3\n[[tenant]]\nname = \"a\"",
                "queues_per_device",
            ),
            (
                "datapath_threads = 0\n[[tenant]]\nname = \"a\"",
                "datapath_threads",
            ),
            ("spin_us = 5000000\n[[tenant]]\nname = \"a\"", "spin_us"),
            ("[[tenant]]\nname = \"a b\"", "tenant.name"),
            ("[[tenant]]\nname = \"a\"\nnetwork = \"\"", "tenant.network"),
            (
                "[[tenant]]\nname = \"a\"\nreachable = [\"x/y\"]",
                "tenant.reachable",
            ),
            ("bogus = 1\n[[tenant]]\nname = \"a\"", "bogus"),
            ("[[tenant]]\nname = \"a\"\ncolour = \"red\"", "colour"),
            ("sq_depth = \"big\"\n[[tenant]]\nname = \"a\"", "sq_depth"),
        ];
        for (i, (text, key)) in cases.iter().enumerate() {
            let err =
                with_file(&format!("bad{i}.toml"), text, &["--socket", "/tmp/s"]).expect_err(text);
            let chain = full_chain(&err);
            assert!(chain.contains(key), "{text:?} gave {chain:?}");
        }
    }

    #[test]
    fn duplicate_tenants_missing_tenants_and_socket_are_refused() {
        let err = with_file(
            "dup.toml",
            "[[tenant]]\nname = \"a\"\n[[tenant]]\nname = \"a\"",
            &["--socket", "/tmp/s"],
        )
        .expect_err("duplicate");
        assert!(matches!(err, ConfigError::DuplicateTenant(ref n) if n == "a"));
        let err =
            with_file("none.toml", "spin_us = 1", &["--socket", "/tmp/s"]).expect_err("no tenants");
        assert!(matches!(err, ConfigError::NoTenants));
        assert!(matches!(parse(&[]), Err(ConfigError::NoSocket)));
        assert!(matches!(
            parse(&["--socket", "/tmp/s", "--config", "/nonexistent/hostd.toml"]),
            Err(ConfigError::Read { .. })
        ));
    }
}
