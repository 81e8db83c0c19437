//! The operator's tenant policy file (TOML).
//!
//! ```toml
//! [[tenant]]
//! name = "blue"
//! network = "net-1"            # default: the tenant's name
//! reachable = ["net-2"]        # networks besides its own its QPs may reach
//! uid = 1001                   # optional: the uid its vdevs run as
//! physical_queues = 2          # physical QPs each of its devices may hold
//! max_devices = 4              # devices (vdevs) it may have on hostd at once
//! priority = { class = "realtime", weight = 1 }
//! quotas = { max_qp = 64, max_total_mr_bytes = 1073741824 }
//! rate.send = { ops_per_sec = 100000, ops_burst = 1000 }
//! rate.read = { bytes_per_sec = 1000000000, bytes_burst = 1048576 }
//! ```
//!
//! Every key but `name` is optional. Unknown keys, values out of range,
//! duplicate tenants and networks nobody has are refused, with the file,
//! line and key in the error:
//!
//! ```text
//! /etc/vrdma/policy.toml:14: key `tenant[2].quotas.max_qp`: must be at least 1
//! ```
//!
//! Tenants are counted from 0 in file order. The line is where the key is
//! written (inside an inline table, a dotted key or a `[tenant.quotas]`
//! section alike), or, for a value left at its default that conflicts
//! (`max_mr_bytes` above a lowered `max_total_mr_bytes`), where the key that
//! was written is. The full reference is `docs/policy.md`;
//! `docs/policy.example.toml` uses every key.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::limits::Limits;
use crate::locate::Tree;

mod validate;

use validate::{invalid, toml_error};

/// Priority classes, served strictly in this order by hostd's scheduler.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PriorityClass {
    Realtime,
    Priority,
    Normal,
}

impl PriorityClass {
    /// Every class, highest first.
    pub const ALL: [PriorityClass; 3] = [
        PriorityClass::Realtime,
        PriorityClass::Priority,
        PriorityClass::Normal,
    ];

    /// The class's name in policy files (`class = "realtime"`).
    pub fn name(self) -> &'static str {
        match self {
            PriorityClass::Realtime => "realtime",
            PriorityClass::Priority => "priority",
            PriorityClass::Normal => "normal",
        }
    }
}

/// A tenant's class, and its weight among the tenants of that class.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Priority {
    pub class: PriorityClass,
    /// Share of the class's capacity relative to the other tenants in it (1–1000).
    pub weight: u32,
}

impl Default for Priority {
    fn default() -> Self {
        Priority {
            class: PriorityClass::Normal,
            weight: 1,
        }
    }
}

/// Token-bucket limits of one kind of traffic. `None` means unlimited.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RateLimit {
    /// Sustained operations per second.
    pub ops_per_sec: Option<u64>,
    /// Operations that may be spent at once (bucket size); default: one
    /// tenth of a second's worth, at least 1.
    pub ops_burst: Option<u64>,
    /// Sustained bytes per second.
    pub bytes_per_sec: Option<u64>,
    /// Bytes that may be spent at once; default: one tenth of a second's
    /// worth, at least 64 KiB.
    pub bytes_burst: Option<u64>,
}

/// The token buckets of a [`RateLimit`], defaults filled in: `(rate per
/// second, bucket size)` for operations and for bytes; `None` is unlimited.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EffectiveRate {
    /// `(ops_per_sec, ops_burst)`.
    pub ops: Option<(u64, u64)>,
    /// `(bytes_per_sec, bytes_burst)`.
    pub bytes: Option<(u64, u64)>,
}

/// Smallest default byte burst: 64 KiB, so that one large message is not
/// throttled into pieces by a small rate.
pub const MIN_DEFAULT_BYTES_BURST: u64 = 64 * 1024;

impl RateLimit {
    /// The buckets hostd builds: each rate with its burst, a missing burst
    /// defaulting to a tenth of a second's worth (at least 1 operation, at
    /// least [`MIN_DEFAULT_BYTES_BURST`] bytes). A burst without its rate
    /// (refused by validation) is ignored.
    pub fn effective(&self) -> EffectiveRate {
        EffectiveRate {
            ops: self
                .ops_per_sec
                .map(|rate| (rate, self.ops_burst.unwrap_or((rate / 10).max(1)))),
            bytes: self.bytes_per_sec.map(|rate| {
                (
                    rate,
                    self.bytes_burst
                        .unwrap_or((rate / 10).max(MIN_DEFAULT_BYTES_BURST)),
                )
            }),
        }
    }
}

/// Rate limits, separately for sends (SEND, RDMA WRITE) and for reads
/// (RDMA READ, atomics), which load the NIC differently.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Rates {
    pub send: RateLimit,
    pub read: RateLimit,
}

/// Everything the policy says about one tenant.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TenantPolicy {
    pub name: String,
    /// The tenant's network; default: its name.
    #[serde(default)]
    pub network: Option<String>,
    /// Further networks its QPs may connect to.
    #[serde(default)]
    pub reachable: Vec<String>,
    /// If set, the uid its vdevs must run as.
    #[serde(default)]
    pub uid: Option<u32>,
    /// Physical QPs each of its devices may hold on hostd.
    #[serde(default = "default_physical_queues")]
    pub physical_queues: u32,
    /// Devices (vdev registrations) it may have on hostd at once: with
    /// `physical_queues`, the most of the NIC's physical QPs it can take.
    #[serde(default = "default_max_devices")]
    pub max_devices: u32,
    #[serde(default)]
    pub priority: Priority,
    /// Object and memory quotas of each of its devices.
    #[serde(default)]
    pub quotas: Limits,
    #[serde(default)]
    pub rate: Rates,
}

fn default_physical_queues() -> u32 {
    2
}

fn default_max_devices() -> u32 {
    4
}

/// Largest `priority.weight`.
pub const MAX_WEIGHT: u32 = 1000;
/// Largest `physical_queues`.
pub const MAX_PHYSICAL_QUEUES: u32 = 64;
/// Largest `max_devices`.
pub const MAX_DEVICES: u32 = 64;
/// Largest `ops_per_sec` and `ops_burst` (10^12).
pub const MAX_OPS_PER_SEC: u64 = 1_000_000_000_000;
/// Largest `bytes_per_sec` and `bytes_burst` (10^13, 80 Tbit/s).
pub const MAX_BYTES_PER_SEC: u64 = 10_000_000_000_000;
/// Longest tenant or network name.
pub const MAX_NAME_LEN: usize = 64;

/// Whether `name` is a valid tenant or network name: `[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}`.
pub fn is_valid_name(name: &str) -> bool {
    // A name becomes part of paths (sockets, directories), log labels and
    // metric labels: it starts with a letter, digit or `_`, so `.`, `..`,
    // a hidden file or something read as an option (`-x`) never passes.
    let starts_plain = name
        .bytes()
        .next()
        .is_some_and(|b| b.is_ascii_alphanumeric() || b == b'_');
    starts_plain
        && name.len() <= MAX_NAME_LEN
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'))
}

impl TenantPolicy {
    /// The tenant's own network.
    pub fn network(&self) -> &str {
        self.network.as_deref().unwrap_or(&self.name)
    }

    /// Whether this tenant's QPs may connect to a QP in `network`.
    pub fn may_reach(&self, network: &str) -> bool {
        network == self.network() || self.reachable.iter().any(|n| n == network)
    }
}

/// A validated policy: every tenant the host serves.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Policy {
    #[serde(default, rename = "tenant")]
    pub tenants: Vec<TenantPolicy>,
}

/// Why a policy file is refused.
#[derive(Debug, thiserror::Error)]
pub enum PolicyError {
    #[error("Cannot read policy file {path}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}:{line}: {message}")]
    Invalid {
        path: PathBuf,
        line: usize,
        key: String,
        message: String,
    },
}

/// The built-in policy hostd uses when no policy file is configured.
pub const DEFAULT_POLICY_TOML: &str = include_str!("default-policy.toml");

impl Policy {
    /// Reads and validates a policy file.
    pub fn load(path: &Path) -> Result<Policy, PolicyError> {
        let text = std::fs::read_to_string(path).map_err(|source| PolicyError::Read {
            path: path.to_owned(),
            source,
        })?;
        Policy::parse(&text, path)
    }

    /// Parses and validates policy text; `path` names it in errors.
    ///
    /// Every refusal is a [`PolicyError::Invalid`] whose message starts with
    /// the dotted key path (tenants counted from 0, in file order):
    ///
    /// ```text
    /// FILE:LINE: key `tenant[2].quotas.max_qp`: must be at least 1
    /// ```
    pub fn parse(text: &str, path: &Path) -> Result<Policy, PolicyError> {
        let tree = Tree::new(text);
        let policy: Policy = toml::from_str(text).map_err(|e| toml_error(&e, &tree, path))?;
        policy
            .validate(&tree)
            .map_err(|(key, message)| invalid(path, tree.line(&key), &key, &message))?;
        Ok(policy)
    }

    /// The built-in policy ([`DEFAULT_POLICY_TOML`]): tenants `alpha` and
    /// `beta` in network `demo`, every other key at its default.
    pub fn default_policy() -> Policy {
        Policy::parse(DEFAULT_POLICY_TOML, Path::new("<built-in default policy>"))
            .expect("the built-in default policy is valid (unit-tested)")
    }

    /// The policy of tenant `name`.
    pub fn tenant(&self, name: &str) -> Option<&TenantPolicy> {
        self.tenants.iter().find(|t| t.name == name)
    }
}

#[cfg(test)]
mod tests;
