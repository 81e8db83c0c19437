//! The cluster file: the hosts of the cluster and which GIDs each may
//! serve, validated into a [`Cluster`].
//!
//! ```toml
//! [[host]]
//! name = "h1"
//! address = "10.200.0.1"
//! [[gid]]
//! address = "10.200.1.1"
//! host = "h1"
//! tenant = "alpha"
//! network = "blue"   # optional: the tenant's network in the policy
//! ```
//!
//! With the static directory the file is the whole directory; with etcd
//! the entries of this host are the pool its devices' GIDs are taken from.
//! Host names and addresses are unique, every GID names a host of the
//! file, no GID appears twice, and only IPv4 is accepted (IPv6 GIDs are
//! not supported yet). Every error names the file and the entry.

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, Ipv4Addr};
use std::path::Path;

use serde::Deserialize;
use vrdma_tenant_policy::is_valid_name;

use super::{DirectoryError, GidEntry, HostEntry};

/// A `[[gid]]` of the cluster file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClusterGid {
    pub gid: Ipv4Addr,
    pub host: String,
    pub tenant: String,
    /// `None`: the tenant's network in the policy.
    pub network: Option<String>,
}

/// A validated cluster file.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Cluster {
    /// In file order.
    pub hosts: Vec<HostEntry>,
    /// In file order.
    pub gids: Vec<ClusterGid>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileHost {
    name: String,
    address: IpAddr,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileGid {
    address: IpAddr,
    host: String,
    tenant: String,
    network: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    #[serde(default)]
    host: Vec<FileHost>,
    #[serde(default)]
    gid: Vec<FileGid>,
}

/// Why an IPv6 address is refused.
const NO_IPV6: &str = "IPv6 is not supported yet: GIDs and host addresses are IPv4";

impl Cluster {
    /// Reads and validates the cluster file at `path`.
    pub fn load(path: &Path) -> Result<Cluster, DirectoryError> {
        let text = std::fs::read_to_string(path).map_err(|source| DirectoryError::Read {
            path: path.to_owned(),
            source,
        })?;
        Cluster::parse(&text, path)
    }

    /// Validates `text`, the cluster file at `path` (named in errors).
    pub fn parse(text: &str, path: &Path) -> Result<Cluster, DirectoryError> {
        let file: File = toml::from_str(text).map_err(|source| DirectoryError::Parse {
            path: path.to_owned(),
            source: Box::new(source),
        })?;
        let invalid = |entry: String, reason: String| DirectoryError::Invalid {
            path: path.to_owned(),
            entry,
            reason,
        };
        let mut hosts = Vec::with_capacity(file.host.len());
        let mut names = BTreeSet::new();
        let mut addresses = BTreeMap::new();
        for (i, h) in file.host.into_iter().enumerate() {
            let entry = format!("host[{i}] ({})", h.name);
            if !is_valid_name(&h.name) {
                return Err(invalid(entry, name_reason("name")));
            }
            let IpAddr::V4(address) = h.address else {
                return Err(invalid(entry, format!("address {}: {NO_IPV6}", h.address)));
            };
            if let Some(problem) = unusable(address) {
                return Err(invalid(entry, format!("address {address}: {problem}")));
            }
            if !names.insert(h.name.clone()) {
                return Err(invalid(entry, "host name given twice".to_owned()));
            }
            if let Some(other) = addresses.insert(address, h.name.clone()) {
                return Err(invalid(
                    entry,
                    format!("address {address} is also host {other}'s"),
                ));
            }
            hosts.push(HostEntry {
                name: h.name,
                address,
            });
        }
        let mut gids: Vec<ClusterGid> = Vec::with_capacity(file.gid.len());
        let mut seen = BTreeMap::new();
        for (i, g) in file.gid.into_iter().enumerate() {
            let entry = format!("gid[{i}] ({})", g.address);
            let IpAddr::V4(gid) = g.address else {
                return Err(invalid(entry, NO_IPV6.to_owned()));
            };
            if let Some(problem) = unusable(gid) {
                return Err(invalid(entry, problem.to_owned()));
            }
            if !names.contains(&g.host) {
                return Err(invalid(
                    entry,
                    format!("host {:?} is not a [[host]] of the file", g.host),
                ));
            }
            if !is_valid_name(&g.tenant) {
                return Err(invalid(entry, name_reason("tenant")));
            }
            if let Some(network) = &g.network {
                if !is_valid_name(network) {
                    return Err(invalid(entry, name_reason("network")));
                }
            }
            if let Some(first) = seen.insert(gid, i) {
                return Err(invalid(entry, format!("the same GID as gid[{first}]")));
            }
            gids.push(ClusterGid {
                gid,
                host: g.host,
                tenant: g.tenant,
                network: g.network,
            });
        }
        Ok(Cluster { hosts, gids })
    }

    /// The host named `name`.
    pub fn host(&self, name: &str) -> Option<&HostEntry> {
        self.hosts.iter().find(|h| h.name == name)
    }

    /// Every GID as a directory entry, a missing network resolved through
    /// `networks` (tenant → network, from the policy), else the tenant's
    /// own name (the policy's default network).
    pub fn entries(&self, networks: &BTreeMap<String, String>) -> Vec<GidEntry> {
        self.gids.iter().map(|g| g.entry(networks)).collect()
    }

    /// The GIDs of host `host` (its pool), as [`Cluster::entries`].
    pub fn pool(&self, host: &str, networks: &BTreeMap<String, String>) -> Vec<GidEntry> {
        self.gids
            .iter()
            .filter(|g| g.host == host)
            .map(|g| g.entry(networks))
            .collect()
    }
}

impl ClusterGid {
    fn entry(&self, networks: &BTreeMap<String, String>) -> GidEntry {
        let network = self
            .network
            .clone()
            .or_else(|| networks.get(&self.tenant).cloned())
            .unwrap_or_else(|| self.tenant.clone());
        GidEntry {
            gid: self.gid,
            host: self.host.clone(),
            tenant: self.tenant.clone(),
            network,
        }
    }
}

fn name_reason(what: &str) -> String {
    format!(
        "the {what} must be 1 to {} characters of letters, digits, '_', '.' or '-'",
        vrdma_tenant_policy::policy::MAX_NAME_LEN
    )
}

/// Why `a` cannot be a host's or a GID's address, if it cannot.
pub(crate) fn unusable(a: Ipv4Addr) -> Option<&'static str> {
    if a.is_unspecified() {
        Some("the unspecified address 0.0.0.0 names no host")
    } else if a.is_multicast() || a.is_broadcast() {
        Some("a multicast or broadcast address names no single host")
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vrdma_errors::error_chain;

    const VALID: &str = r#"
[[host]]
name = "h1"
address = "10.200.0.1"
[[host]]
name = "h2"
address = "10.200.0.2"
[[gid]]
address = "10.200.1.1"
host = "h1"
tenant = "alpha"
network = "blue"
[[gid]]
address = "10.200.1.2"
host = "h2"
tenant = "beta"
"#;

    fn parse(text: &str) -> Result<Cluster, DirectoryError> {
        Cluster::parse(text, Path::new("/etc/vrdma/cluster.toml"))
    }

    #[test]
    fn a_valid_file_gives_its_hosts_and_gids() {
        let cluster = parse(VALID).expect("valid");
        assert_eq!(
            cluster,
            Cluster {
                hosts: vec![
                    HostEntry {
                        name: "h1".into(),
                        address: Ipv4Addr::new(10, 200, 0, 1)
                    },
                    HostEntry {
                        name: "h2".into(),
                        address: Ipv4Addr::new(10, 200, 0, 2)
                    },
                ],
                gids: vec![
                    ClusterGid {
                        gid: Ipv4Addr::new(10, 200, 1, 1),
                        host: "h1".into(),
                        tenant: "alpha".into(),
                        network: Some("blue".into()),
                    },
                    ClusterGid {
                        gid: Ipv4Addr::new(10, 200, 1, 2),
                        host: "h2".into(),
                        tenant: "beta".into(),
                        network: None,
                    },
                ],
            }
        );
        // beta's network: the policy's, else its own name.
        let networks = BTreeMap::from([("beta".to_owned(), "demo".to_owned())]);
        let entries = cluster.entries(&networks);
        assert_eq!(entries[0].network, "blue");
        assert_eq!(entries[1].network, "demo");
        assert_eq!(cluster.entries(&BTreeMap::new())[1].network, "beta");
        let pool = cluster.pool("h2", &networks);
        assert_eq!(pool.len(), 1);
        assert_eq!(pool[0].gid, Ipv4Addr::new(10, 200, 1, 2));
        assert_eq!(cluster.host("h2").map(|h| h.address.octets()[3]), Some(2));
        assert_eq!(parse("").expect("empty"), Cluster::default());
    }

    #[test]
    fn each_invalid_file_names_file_entry_and_reason() {
        let h1 = "[[host]]\nname = \"h1\"\naddress = \"10.0.0.1\"\n";
        let gid = |addr: &str, host: &str, tenant: &str| {
            format!("[[gid]]\naddress = \"{addr}\"\nhost = \"{host}\"\ntenant = \"{tenant}\"\n")
        };
        let cases: Vec<(String, &str)> = vec![
            (
                format!("{h1}[[host]]\nname = \"h1\"\naddress = \"10.0.0.2\"\n"),
                "host[1] (h1): host name given twice",
            ),
            (
                format!("{h1}[[host]]\nname = \"h2\"\naddress = \"10.0.0.1\"\n"),
                "host[1] (h2): address 10.0.0.1 is also host h1's",
            ),
            (
                "[[host]]\nname = \"h1\"\naddress = \"fd00::1\"\n".to_owned(),
                "host[0] (h1): address fd00::1: IPv6 is not supported yet",
            ),
            (
                "[[host]]\nname = \"h 1\"\naddress = \"10.0.0.1\"\n".to_owned(),
                "host[0] (h 1): the name must be",
            ),
            (
                format!("{h1}{}", gid("10.1.0.1", "h9", "alpha")),
                "gid[0] (10.1.0.1): host \"h9\" is not a [[host]] of the file",
            ),
            (
                format!(
                    "{h1}{}{}",
                    gid("10.1.0.1", "h1", "alpha"),
                    gid("10.1.0.1", "h1", "beta")
                ),
                "gid[1] (10.1.0.1): the same GID as gid[0]",
            ),
            (
                format!("{h1}{}", gid("fd00::5", "h1", "alpha")),
                "gid[0] (fd00::5): IPv6 is not supported yet",
            ),
            (
                format!("{h1}{}", gid("10.1.0.1", "h1", "al/pha")),
                "gid[0] (10.1.0.1): the tenant must be",
            ),
            (
                format!("{h1}{}network = \"\"\n", gid("10.1.0.1", "h1", "alpha")),
                "gid[0] (10.1.0.1): the network must be",
            ),
            (
                format!("{h1}{}", gid("224.0.0.1", "h1", "alpha")),
                "gid[0] (224.0.0.1): a multicast",
            ),
        ];
        for (text, wanted) in &cases {
            let err = parse(text).expect_err(text);
            let chain = error_chain(&err);
            assert!(
                matches!(err, DirectoryError::Invalid { .. }),
                "{text:?}: {chain}"
            );
            assert!(
                chain.starts_with("Invalid cluster file /etc/vrdma/cluster.toml: ")
                    && chain.contains(wanted),
                "{text:?} gave {chain:?}, wanted {wanted:?}"
            );
        }
        for (text, key) in [
            (format!("{h1}bogus = 1\n"), "bogus"),
            ("[[peer]]\nname = \"x\"\n".to_owned(), "peer"),
            ("[[host]]\nname = \"h1\"\n".to_owned(), "address"),
            (
                "[[host]]\nname = \"h1\"\naddress = \"10.0.0\"\n".to_owned(),
                "address",
            ),
        ] {
            let err = parse(&text).expect_err(&text);
            let chain = error_chain(&err);
            assert!(matches!(err, DirectoryError::Parse { .. }), "{chain}");
            assert!(
                chain.contains("cluster.toml") && chain.contains(key),
                "{text:?} gave {chain}"
            );
        }
        let err = Cluster::load(Path::new("/nonexistent/cluster.toml")).expect_err("missing");
        assert!(matches!(err, DirectoryError::Read { .. }));
        assert!(error_chain(&err).contains("/nonexistent/cluster.toml"));
    }
}
