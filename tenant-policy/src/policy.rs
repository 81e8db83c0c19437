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

use crate::limits::{Limits, LimitsError};
use crate::locate::{KeyPath, Tree};

/// Priority classes, served strictly in this order by hostd's scheduler.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PriorityClass {
    Realtime,
    Priority,
    Normal,
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

/// Whether `name` is a valid tenant or network name: `[A-Za-z0-9_.-]{1,64}`.
pub fn is_valid_name(name: &str) -> bool {
    (1..=MAX_NAME_LEN).contains(&name.len())
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

    /// Every check serde cannot make; the first failure as `(key, message)`.
    fn validate(&self, tree: &Tree<'_>) -> Result<(), (KeyPath, String)> {
        for (i, tenant) in self.tenants.iter().enumerate() {
            let at = KeyPath::tenant(i);
            tenant.validate(&at)?;
            if let Some(first) = self.tenants[..i].iter().position(|t| t.name == tenant.name) {
                return Err((
                    at.key("name"),
                    format!(
                        "duplicate tenant {:?}: already defined at line {} (tenant[{first}])",
                        tenant.name,
                        tree.line(&KeyPath::tenant(first).key("name")),
                    ),
                ));
            }
        }
        for (i, tenant) in self.tenants.iter().enumerate() {
            for (j, network) in tenant.reachable.iter().enumerate() {
                if !self.tenants.iter().any(|t| t.network() == network) {
                    return Err((
                        KeyPath::tenant(i).key("reachable").index(j),
                        format!("network {network:?} is not the network of any tenant"),
                    ));
                }
            }
        }
        Ok(())
    }
}

impl TenantPolicy {
    /// Checks one tenant's values; `at` is its key path.
    fn validate(&self, at: &KeyPath) -> Result<(), (KeyPath, String)> {
        check_name(at.key("name"), &self.name)?;
        if let Some(network) = &self.network {
            check_name(at.key("network"), network)?;
        }
        for (j, network) in self.reachable.iter().enumerate() {
            check_name(at.key("reachable").index(j), network)?;
        }
        if self.uid == Some(u32::MAX) {
            return Err((
                at.key("uid"),
                format!(
                    "{} is not a uid (it is (uid_t)-1); must be below 4294967295",
                    u32::MAX
                ),
            ));
        }
        check_range(
            at.key("physical_queues"),
            self.physical_queues.into(),
            1,
            MAX_PHYSICAL_QUEUES.into(),
        )?;
        check_range(
            at.key("max_devices"),
            self.max_devices.into(),
            1,
            MAX_DEVICES.into(),
        )?;
        check_range(
            at.key("priority.weight"),
            self.priority.weight.into(),
            1,
            MAX_WEIGHT.into(),
        )?;
        self.quotas
            .validate()
            .map_err(|e| quota_error(&at.key("quotas"), &self.quotas, e))?;
        self.rate.send.validate(&at.key("rate.send"))?;
        self.rate.read.validate(&at.key("rate.read"))
    }
}

impl RateLimit {
    /// Checks rates and bursts; `at` is this limit's key path.
    fn validate(&self, at: &KeyPath) -> Result<(), (KeyPath, String)> {
        for (unit, rate, burst, max) in [
            ("ops", self.ops_per_sec, self.ops_burst, MAX_OPS_PER_SEC),
            (
                "bytes",
                self.bytes_per_sec,
                self.bytes_burst,
                MAX_BYTES_PER_SEC,
            ),
        ] {
            let rate_key = format!("{unit}_per_sec");
            let burst_key = format!("{unit}_burst");
            if let Some(rate) = rate {
                if rate == 0 {
                    return Err((
                        at.key(&rate_key),
                        "must be at least 1 (leave the key out for no limit)".into(),
                    ));
                }
                check_range(at.key(&rate_key), rate, 1, max)?;
            }
            if let Some(burst) = burst {
                if rate.is_none() {
                    return Err((
                        at.key(&burst_key),
                        format!("a burst needs its rate: `{rate_key}` is not set"),
                    ));
                }
                check_range(at.key(&burst_key), burst, 1, max)?;
            }
        }
        Ok(())
    }
}

fn check_name(key: KeyPath, name: &str) -> Result<(), (KeyPath, String)> {
    if is_valid_name(name) {
        Ok(())
    } else {
        Err((
            key,
            format!(
                "{name:?} is not a valid name: 1 to {MAX_NAME_LEN} characters of A-Z a-z 0-9 _ . -"
            ),
        ))
    }
}

fn check_range(key: KeyPath, value: u64, min: u64, max: u64) -> Result<(), (KeyPath, String)> {
    if (min..=max).contains(&value) {
        Ok(())
    } else {
        Err((key, format!("{value} is outside {min}..={max}")))
    }
}

/// A [`LimitsError`] of tenant quotas `quotas` (at key path `at`).
fn quota_error(at: &KeyPath, quotas: &Limits, error: LimitsError) -> (KeyPath, String) {
    match error {
        LimitsError::Zero { key } => (at.key(key), "must be at least 1".into()),
        LimitsError::TooLarge { key, value, max } => (
            at.key(key),
            format!("{value} exceeds the device maximum {max}"),
        ),
        // Blame the key the operator wrote: max_mr_bytes unless only the
        // total was lowered below the default single-MR size.
        LimitsError::SingleAboveTotal { single, total }
            if quotas.max_mr_bytes == Limits::default().max_mr_bytes =>
        {
            (
                at.key("max_total_mr_bytes"),
                format!("{total} is below `max_mr_bytes` = {single}"),
            )
        }
        LimitsError::SingleAboveTotal { single, total } => (
            at.key("max_mr_bytes"),
            format!("{single} exceeds `max_total_mr_bytes` = {total}"),
        ),
    }
}

fn invalid(path: &Path, line: usize, key: &KeyPath, message: &str) -> PolicyError {
    let message = if key.is_empty() {
        message.to_owned()
    } else {
        format!("key `{key}`: {message}")
    };
    PolicyError::Invalid {
        path: path.to_owned(),
        line,
        key: key.to_string(),
        message,
    }
}

/// A TOML syntax or deserialization error, with the line and key path of
/// where it points.
fn toml_error(error: &toml::de::Error, tree: &Tree<'_>, path: &Path) -> PolicyError {
    let offset = error.span().map_or(0, |s| s.start);
    let line = tree.line_of(offset);
    let message = error
        .message()
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect::<Vec<_>>()
        .join("; ");
    let mut key = match error.span() {
        Some(_) => tree.path_at(offset),
        None => KeyPath::default(),
    };
    // serde names a missing field only in its message, and points at the
    // table that lacks it.
    if let Some(field) = message
        .strip_prefix("missing field `")
        .and_then(|m| m.strip_suffix('`'))
    {
        key = key.key(field);
    }
    invalid(path, line, &key, &message)
}

#[cfg(test)]
mod tests {
    use super::*;

    const FILE: &str = "/etc/vrdma/policy.toml";

    /// Two valid tenants (lines 1-8) the error cases are appended to.
    const BASE: &str = r#"[[tenant]]
name = "blue"
network = "net-1"

[[tenant]]
name = "green"
network = "net-2"

"#;

    fn parse(text: &str) -> Result<Policy, PolicyError> {
        Policy::parse(text, Path::new(FILE))
    }

    /// Asserts `text` is refused at `line` for `key`, naming the file, the
    /// line and the key, with a message containing `fragment`.
    #[track_caller]
    fn refused(text: &str, key: &str, line: usize, fragment: &str) {
        let err = parse(text).expect_err("must be refused");
        let shown = err.to_string();
        let prefix = format!("{FILE}:{line}: key `{key}`: ");
        assert!(
            shown.starts_with(&prefix),
            "{shown:?} should start with {prefix:?}"
        );
        assert!(
            shown.contains(fragment),
            "{shown:?} should contain {fragment:?}"
        );
        match err {
            PolicyError::Invalid {
                path,
                line: l,
                key: k,
                message,
            } => {
                assert_eq!(path, Path::new(FILE));
                assert_eq!(l, line);
                assert_eq!(k, key);
                assert!(message.starts_with(&format!("key `{key}`: ")));
            }
            PolicyError::Read { .. } => panic!("not a read error"),
        }
    }

    /// `BASE` with a third tenant (`[[tenant]]` at line 9) of these lines.
    fn third(lines: &str) -> String {
        format!("{BASE}[[tenant]]\nname = \"red\"\n{lines}")
    }

    const FULL: &str = r#"
[[tenant]]
name = "blue"
network = "net-1"
reachable = ["net-2"]
uid = 1001
physical_queues = 4
max_devices = 2
priority = { class = "realtime", weight = 10 }
quotas = { max_qp = 64, max_total_mr_bytes = 1073741824, max_mr_bytes = 1048576, max_srq = 0 }
rate.send = { ops_per_sec = 100000, ops_burst = 1000 }
rate.read = { bytes_per_sec = 1000000000, bytes_burst = 1048576 }

[[tenant]]
name = "green"
network = "net-2"
priority.class = "priority"
priority.weight = 1000

[tenant.quotas]
max_cq = 8
max_srq = 16

[tenant.rate.send]
bytes_per_sec = 500

[[tenant]]
name = "gray"
"#;

    fn full_expected() -> Policy {
        Policy {
            tenants: vec![
                TenantPolicy {
                    name: "blue".into(),
                    network: Some("net-1".into()),
                    reachable: vec!["net-2".into()],
                    uid: Some(1001),
                    physical_queues: 4,
                    max_devices: 2,
                    priority: Priority {
                        class: PriorityClass::Realtime,
                        weight: 10,
                    },
                    quotas: Limits {
                        max_qp: 64,
                        max_total_mr_bytes: 1 << 30,
                        max_mr_bytes: 1 << 20,
                        max_srq: 0,
                        ..Limits::default()
                    },
                    rate: Rates {
                        send: RateLimit {
                            ops_per_sec: Some(100_000),
                            ops_burst: Some(1000),
                            ..RateLimit::default()
                        },
                        read: RateLimit {
                            bytes_per_sec: Some(1_000_000_000),
                            bytes_burst: Some(1 << 20),
                            ..RateLimit::default()
                        },
                    },
                },
                TenantPolicy {
                    name: "green".into(),
                    network: Some("net-2".into()),
                    reachable: vec![],
                    uid: None,
                    physical_queues: 2,
                    max_devices: 4,
                    priority: Priority {
                        class: PriorityClass::Priority,
                        weight: 1000,
                    },
                    quotas: Limits {
                        max_cq: 8,
                        max_srq: 16,
                        ..Limits::default()
                    },
                    rate: Rates {
                        send: RateLimit {
                            bytes_per_sec: Some(500),
                            ..RateLimit::default()
                        },
                        read: RateLimit::default(),
                    },
                },
                TenantPolicy {
                    name: "gray".into(),
                    network: None,
                    reachable: vec![],
                    uid: None,
                    physical_queues: 2,
                    max_devices: 4,
                    priority: Priority::default(),
                    quotas: Limits::default(),
                    rate: Rates::default(),
                },
            ],
        }
    }

    #[test]
    fn full_example_parses_into_the_expected_policy() {
        let policy = parse(FULL).expect("valid");
        assert_eq!(policy, full_expected());
        // And back: serialized and parsed again, it is the same policy.
        let text = toml::to_string(&policy).expect("serializes");
        assert_eq!(parse(&text).expect("re-parses"), policy);

        let gray = policy.tenant("gray").expect("gray");
        assert_eq!(gray.network(), "gray");
        assert!(gray.may_reach("gray") && !gray.may_reach("net-1"));
        let blue = policy.tenant("blue").expect("blue");
        assert!(blue.may_reach("net-1") && blue.may_reach("net-2") && !blue.may_reach("gray"));
        assert!(policy.tenant("nobody").is_none());
    }

    #[test]
    fn effective_rates_fill_in_bursts() {
        let policy = parse(FULL).expect("valid");
        let blue = &policy.tenants[0].rate;
        assert_eq!(
            blue.send.effective(),
            EffectiveRate {
                ops: Some((100_000, 1000)),
                bytes: None
            }
        );
        assert_eq!(
            blue.read.effective(),
            EffectiveRate {
                ops: None,
                bytes: Some((1_000_000_000, 1 << 20))
            }
        );
        // Bytes burst: a tenth of a second, at least 64 KiB.
        assert_eq!(
            policy.tenants[1].rate.send.effective().bytes,
            Some((500, MIN_DEFAULT_BYTES_BURST))
        );
        let r = RateLimit {
            ops_per_sec: Some(5),
            bytes_per_sec: Some(10_000_000),
            ..RateLimit::default()
        };
        // Ops burst: a tenth of a second, at least 1.
        assert_eq!(
            r.effective(),
            EffectiveRate {
                ops: Some((5, 1)),
                bytes: Some((10_000_000, 1_000_000))
            }
        );
        let r = RateLimit {
            ops_per_sec: Some(1_000_000),
            ..RateLimit::default()
        };
        assert_eq!(r.effective().ops, Some((1_000_000, 100_000)));
        assert_eq!(RateLimit::default().effective(), EffectiveRate::default());
    }

    #[test]
    fn default_policy_parses() {
        let policy = Policy::default_policy();
        assert_eq!(policy.tenants.len(), 2);
        for (tenant, name) in policy.tenants.iter().zip(["alpha", "beta"]) {
            assert_eq!(
                *tenant,
                TenantPolicy {
                    name: name.into(),
                    network: Some("demo".into()),
                    reachable: vec![],
                    uid: None,
                    physical_queues: 2,
                    max_devices: 4,
                    priority: Priority::default(),
                    quotas: Limits::default(),
                    rate: Rates::default(),
                }
            );
        }
        let alpha = policy.tenant("alpha").expect("alpha");
        assert!(alpha.may_reach(policy.tenant("beta").expect("beta").network()));
    }

    #[test]
    fn documented_example_parses() {
        let text = include_str!("../../docs/policy.example.toml");
        let policy = Policy::parse(text, Path::new("docs/policy.example.toml"))
            .unwrap_or_else(|e| panic!("{e}"));
        let names: Vec<_> = policy.tenants.iter().map(|t| t.name.as_str()).collect();
        assert_eq!(names, ["blue", "green", "gray"]);
    }

    #[test]
    fn empty_policy_is_valid() {
        assert_eq!(parse("# nobody yet\n").expect("valid"), Policy::default());
    }

    #[test]
    fn missing_file_is_a_read_error() {
        let path = Path::new("/nonexistent/vrdma/policy.toml");
        let err = Policy::load(path).expect_err("missing");
        assert!(
            matches!(&err, PolicyError::Read { path: p, source } if p == path && source.kind() == std::io::ErrorKind::NotFound),
            "{err:?}"
        );
        assert!(err.to_string().contains("/nonexistent/vrdma/policy.toml"));
    }

    #[test]
    fn load_reads_and_validates() {
        let dir = std::env::temp_dir().join(format!("vrdma-policy-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let good = dir.join("good.toml");
        std::fs::write(&good, FULL).expect("write");
        assert_eq!(Policy::load(&good).expect("valid"), full_expected());
        let bad = dir.join("bad.toml");
        std::fs::write(&bad, third("weight = 3\n")).expect("write");
        let err = Policy::load(&bad).expect_err("invalid");
        assert!(
            err.to_string().starts_with(&format!(
                "{}:11: key `tenant[2].weight`: unknown field",
                bad.display()
            )),
            "{err}"
        );
        std::fs::remove_dir_all(&dir).expect("cleanup");
    }

    #[test]
    fn syntax_errors() {
        refused(
            &third("quotas = { max_qp = }\n"),
            "tenant[2].quotas.max_qp",
            11,
            "invalid string",
        );
        refused(
            &third("max_qp 5\n"),
            "tenant[2].max_qp",
            11,
            "expected `.`, `=`",
        );
        refused(
            &third("name = \"red2\"\n"),
            "tenant[2].name",
            11,
            "duplicate key `name`",
        );
        refused(
            &format!("{BASE}[[tenant]\n"),
            "tenant",
            9,
            "invalid table header",
        );
        refused(
            &format!("{BASE}[[tenant]]\nname = \"red\n"),
            "tenant[2].name",
            10,
            "invalid basic string",
        );
    }

    #[test]
    fn unknown_keys() {
        refused(
            &third("networks = [\"a\"]\n"),
            "tenant[2].networks",
            11,
            "unknown field `networks`",
        );
        refused(
            &third("quotas = { max_qps = 1 }\n"),
            "tenant[2].quotas.max_qps",
            11,
            "unknown field `max_qps`",
        );
        refused(
            &third("[tenant.rate.write]\nops_per_sec = 5\n"),
            "tenant[2].rate.write",
            11,
            "unknown field `write`",
        );
        refused(
            &third("\n[tenant.rate.send]\nops_per_second = 5\n"),
            "tenant[2].rate.send.ops_per_second",
            13,
            "unknown field `ops_per_second`",
        );
        refused(
            &third("priority = { class = \"normal\", wieght = 2 }\n"),
            "tenant[2].priority.wieght",
            11,
            "unknown field `wieght`",
        );
        refused(
            &format!("tenants = []\n{BASE}"),
            "tenants",
            1,
            "unknown field `tenants`",
        );
        // A date-time (which nothing accepts) in an unknown key.
        refused(
            &third("since = 1979-05-27\n"),
            "tenant[2].since",
            11,
            "unknown field `since`",
        );
    }

    #[test]
    fn wrong_types_and_negative_numbers() {
        refused(
            &third("uid = \"root\"\n"),
            "tenant[2].uid",
            11,
            "invalid type: string",
        );
        refused(
            &third("physical_queues = -1\n"),
            "tenant[2].physical_queues",
            11,
            "-1",
        );
        refused(
            &third("[tenant.quotas]\nmax_cq = 8\nmax_qp = -4\n"),
            "tenant[2].quotas.max_qp",
            13,
            "invalid value: integer `-4`, expected u32",
        );
        refused(
            &third("rate.read.bytes_per_sec = -5\n"),
            "tenant[2].rate.read.bytes_per_sec",
            11,
            "expected u64",
        );
        refused(
            &third("reachable = [\"net-1\", 7]\n"),
            "tenant[2].reachable[1]",
            11,
            "expected a string",
        );
        refused(
            &third("reachable = \"net-1\"\n"),
            "tenant[2].reachable",
            11,
            "expected a sequence",
        );
        refused(
            &third("priority = { class = \"urgent\" }\n"),
            "tenant[2].priority.class",
            11,
            "unknown variant `urgent`",
        );
        refused(
            &third("quotas.max_mr = 1.5\n"),
            "tenant[2].quotas.max_mr",
            11,
            "floating point",
        );
        refused(
            &third("uid = 4294967296\n"),
            "tenant[2].uid",
            11,
            "expected u32",
        );
        refused(
            &format!("{BASE}[[tenant]]\nnetwork = \"net-3\"\n"),
            "tenant[2].name",
            9,
            "missing field `name`",
        );
    }

    #[test]
    fn uid_minus_one_is_refused() {
        refused(
            &third("uid = 4294967295\n"),
            "tenant[2].uid",
            11,
            "4294967295",
        );
        parse(&third("uid = 4294967294\n")).expect("largest uid is valid");
        parse(&third("uid = 0\n")).expect("root is a uid");
    }

    #[test]
    fn absurd_quotas() {
        refused(
            &third("quotas = { max_qp = 0 }\n"),
            "tenant[2].quotas.max_qp",
            11,
            "must be at least 1",
        );
        refused(
            &third("[tenant.quotas]\nmax_sge = 65\n"),
            "tenant[2].quotas.max_sge",
            12,
            "65 exceeds the device maximum 64",
        );
        refused(
            &third("quotas.max_srq = 1048577\n"),
            "tenant[2].quotas.max_srq",
            11,
            "exceeds the device maximum 1048576",
        );
        refused(
            &third("quotas = { max_mr_bytes = 2048, max_total_mr_bytes = 1024 }\n"),
            "tenant[2].quotas.max_mr_bytes",
            11,
            "2048 exceeds `max_total_mr_bytes` = 1024",
        );
        refused(
            &third("[tenant.quotas]\nmax_qp = 1\nmax_total_mr_bytes = 1024\n"),
            "tenant[2].quotas.max_total_mr_bytes",
            13,
            "1024 is below `max_mr_bytes` = 4294967296",
        );
        parse(&third("quotas.max_srq = 0\n")).expect("no SRQs is valid");
    }

    #[test]
    fn absurd_weights_and_queues() {
        refused(
            &third("priority.weight = 0\n"),
            "tenant[2].priority.weight",
            11,
            "0 is outside 1..=1000",
        );
        refused(
            &third("priority = { weight = 1001 }\n"),
            "tenant[2].priority.weight",
            11,
            "1001 is outside 1..=1000",
        );
        refused(
            &third("physical_queues = 0\n"),
            "tenant[2].physical_queues",
            11,
            "outside 1..=64",
        );
        refused(
            &third("physical_queues = 65\n"),
            "tenant[2].physical_queues",
            11,
            "65 is outside 1..=64",
        );
        refused(
            &third("max_devices = 0\n"),
            "tenant[2].max_devices",
            11,
            "0 is outside 1..=64",
        );
        refused(
            &third("max_devices = -3\n"),
            "tenant[2].max_devices",
            11,
            "-3",
        );
        parse(&third(
            "physical_queues = 64\nmax_devices = 64\npriority.weight = 1000\n",
        ))
        .expect("limits are inclusive");
    }

    #[test]
    fn absurd_rates() {
        refused(
            &third("rate.send = { ops_per_sec = 0 }\n"),
            "tenant[2].rate.send.ops_per_sec",
            11,
            "must be at least 1",
        );
        refused(
            &third("[tenant.rate.read]\nbytes_per_sec = 0\n"),
            "tenant[2].rate.read.bytes_per_sec",
            12,
            "must be at least 1",
        );
        refused(
            &third("rate.send.ops_per_sec = 1000000000001\n"),
            "tenant[2].rate.send.ops_per_sec",
            11,
            "1000000000001 is outside 1..=1000000000000",
        );
        refused(
            &third("rate.read = { bytes_per_sec = 10000000000001 }\n"),
            "tenant[2].rate.read.bytes_per_sec",
            11,
            "outside 1..=10000000000000",
        );
        refused(
            &third("rate.send = { ops_per_sec = 10, ops_burst = 0 }\n"),
            "tenant[2].rate.send.ops_burst",
            11,
            "0 is outside 1..",
        );
        refused(
            &third("rate.read = { bytes_per_sec = 10, bytes_burst = 0 }\n"),
            "tenant[2].rate.read.bytes_burst",
            11,
            "0 is outside 1..",
        );
        parse(&third(
            "rate.send = { ops_per_sec = 1000000000000, bytes_per_sec = 10000000000000 }\n",
        ))
        .expect("ceilings are inclusive");
    }

    #[test]
    fn bursts_need_their_rate() {
        refused(
            &third("rate.send = { ops_burst = 10 }\n"),
            "tenant[2].rate.send.ops_burst",
            11,
            "a burst needs its rate: `ops_per_sec` is not set",
        );
        refused(
            &third("[tenant.rate.read]\nops_per_sec = 5\n\nbytes_burst = 65536\n"),
            "tenant[2].rate.read.bytes_burst",
            14,
            "`bytes_per_sec` is not set",
        );
    }

    #[test]
    fn bad_names() {
        refused(
            &format!("{BASE}[[tenant]]\nname = \"red team\"\n"),
            "tenant[2].name",
            10,
            "\"red team\" is not a valid name",
        );
        refused(
            &format!("{BASE}[[tenant]]\nname = \"\"\n"),
            "tenant[2].name",
            10,
            "not a valid name",
        );
        let long = "x".repeat(65);
        refused(
            &format!("{BASE}[[tenant]]\nname = \"{long}\"\n"),
            "tenant[2].name",
            10,
            "not a valid name",
        );
        parse(&format!(
            "{BASE}[[tenant]]\nname = \"{}\"\n",
            "x".repeat(64)
        ))
        .expect("64 is fine");
        refused(
            &third("network = \"net/1\"\n"),
            "tenant[2].network",
            11,
            "\"net/1\" is not a valid name",
        );
        refused(
            &third("reachable = [\n  \"net-1\",\n  \"net 2\",\n]\n"),
            "tenant[2].reachable[1]",
            13,
            "\"net 2\" is not a valid name",
        );
    }

    #[test]
    fn duplicate_tenants() {
        refused(
            &format!("{BASE}[[tenant]]\nnetwork = \"net-1\"\nname = \"blue\"\n"),
            "tenant[2].name",
            11,
            "duplicate tenant \"blue\": already defined at line 2 (tenant[0])",
        );
    }

    #[test]
    fn dangling_references() {
        refused(
            &third("reachable = [\"net-2\", \"net-9\"]\n"),
            "tenant[2].reachable[1]",
            11,
            "network \"net-9\" is not the network of any tenant",
        );
        // A tenant without `network` is in the network of its name.
        parse(&third("reachable = [\"red\", \"blue\", \"net-1\"]\n"))
            .expect_err("blue is in net-1");
        parse(&third("reachable = [\"red\", \"net-1\"]\n")).expect("both exist");
        // A reference may point forwards.
        parse("[[tenant]]\nname = \"a\"\nreachable = [\"later\"]\n[[tenant]]\nname = \"b\"\nnetwork = \"later\"\n")
        .expect("forward reference");
    }
}
