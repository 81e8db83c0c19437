//! The directory: which host serves which GID (with that GID's tenant and
//! tenant network), and the hosts of the cluster (name, underlay address).
//!
//! hostd asks it at `modify_qp(RTR)` whether a remote peer's network is
//! reachable, and on receive whether a packet's source GID is known. Two
//! implementations:
//!
//! - [`StaticDirectory`] (`directory = "static"`): the cluster file is the
//!   whole directory, re-read on SIGHUP and `vrdmactl reload`.
//! - [`EtcdDirectory`] (`directory = "etcd"`): the cluster file's entries of
//!   this host are its address pool; the GIDs its devices take are
//!   published in etcd under a lease kept alive, and the other hosts'
//!   entries are watched into a local view.
//!
//! Lookups never wait on the network: both keep their view in memory
//! behind a lock held only to copy an entry out.

pub mod cluster;
pub mod etcd;
pub mod file;
mod http;

use std::net::Ipv4Addr;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};
use vrdma_tenant_policy::Policy;

use crate::config::{DirectoryKind, FabricConfig};
use crate::seccomp::Threads;

pub use cluster::{Cluster, ClusterGid};
pub use etcd::{EtcdDirectory, EtcdError};
pub use file::StaticDirectory;

/// Where a GID lives: the host serving it, and its tenant and tenant
/// network (what reachability checks compare).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GidEntry {
    pub gid: Ipv4Addr,
    pub host: String,
    pub tenant: String,
    pub network: String,
}

/// A host of the cluster: its name and underlay address.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HostEntry {
    pub name: String,
    pub address: Ipv4Addr,
}

/// Why a directory operation failed.
#[derive(Debug, thiserror::Error)]
pub enum DirectoryError {
    #[error("Cannot read the cluster file {}", path.display())]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("Cannot parse the cluster file {}", path.display())]
    Parse {
        path: PathBuf,
        #[source]
        source: Box<toml::de::Error>,
    },
    #[error("Invalid cluster file {}: {entry}: {reason}", path.display())]
    Invalid {
        path: PathBuf,
        /// The offending entry, as `host[1]` or `gid[0] (10.200.1.1)`.
        entry: String,
        reason: String,
    },
    #[error("Host {host:?} is not in the cluster file {}", path.display())]
    UnknownHost { host: String, path: PathBuf },
    #[error("GID {gid} is not in host {host}'s pool in the cluster file{detail}")]
    NotInPool {
        gid: Ipv4Addr,
        host: String,
        /// Empty, or why the entry does not match the file's.
        detail: String,
    },
    #[error("GID {gid} is already published by host {owner}")]
    Taken { gid: Ipv4Addr, owner: String },
    #[error("The etcd directory failed")]
    Etcd(#[source] EtcdError),
    #[error("Cannot start the directory's thread")]
    Thread(#[source] std::io::Error),
}

/// Which host serves which GID, as this hostd knows it now.
pub trait Directory: Send + Sync {
    /// Where `gid` lives, as the directory knows now.
    fn lookup(&self, gid: Ipv4Addr) -> Option<GidEntry>;
    /// Like [`Directory::lookup`], but a miss asks the directory's source
    /// of truth before answering "unknown": a GID another host published a
    /// moment ago may not be in this view yet (etcd brings a lagging watch
    /// up to date only every 100 ms). For the control path (RTR, address
    /// handles): it may wait one round trip to the directory.
    fn lookup_fresh(&self, gid: Ipv4Addr) -> Option<GidEntry> {
        self.lookup(gid)
    }
    /// Every host it knows (for `vrdmactl peers`).
    fn hosts(&self) -> Vec<HostEntry>;
    /// Announces that this host serves `entry` (a device came).
    fn publish(&self, entry: &GidEntry) -> Result<(), DirectoryError>;
    /// Announces that this host no longer serves `gid` (its device went).
    fn withdraw(&self, gid: Ipv4Addr) -> Result<(), DirectoryError>;
    /// Bumped whenever the view changes (hostd re-checks connected QPs).
    fn generation(&self) -> u64;
    /// Re-reads the cluster file (SIGHUP, `vrdmactl reload`), resolving
    /// GIDs without a `network` through `policy` (the policy in force).
    /// A bad file keeps the view in force and returns why; otherwise the
    /// changes, one line each.
    fn reload(&self, policy: &Policy) -> Result<Vec<String>, DirectoryError>;
    /// Starts the background work, if any (etcd: lease keepalive and
    /// watch), through `threads` under the directory's seccomp role. hostd
    /// calls it once its sandbox is up; until then the view is the one
    /// read at open.
    fn start(&self, threads: &Threads) -> Result<(), DirectoryError>;
    /// The cluster file, for logs and the reload report.
    fn cluster_file(&self) -> PathBuf;
}

/// Opens the directory `fabric` configures, GIDs without a `network`
/// resolved through `policy`. For etcd: registers this host (lease,
/// host entry) and reads the current view; an unreachable etcd is an
/// error here (later outages are ridden out). Call before the sandbox;
/// then [`Directory::start`].
pub fn open_directory(
    fabric: &FabricConfig,
    policy: &Policy,
) -> Result<Box<dyn Directory>, DirectoryError> {
    match &fabric.directory {
        DirectoryKind::Static => Ok(Box::new(StaticDirectory::new(
            fabric.cluster_file.clone(),
            fabric.host.clone(),
            &fabric.cluster,
            policy,
        ))),
        DirectoryKind::Etcd {
            endpoints,
            lease_seconds,
        } => Ok(Box::new(EtcdDirectory::open(etcd::EtcdOptions {
            host: fabric.host.clone(),
            cluster_file: fabric.cluster_file.clone(),
            cluster: fabric.cluster.clone(),
            endpoints: endpoints.clone(),
            lease_seconds: *lease_seconds,
            networks: networks_of(policy),
        })?)),
    }
}

/// Tenant → network, from a policy (for GIDs whose cluster entry names no
/// network).
pub fn networks_of(policy: &Policy) -> std::collections::BTreeMap<String, String> {
    policy
        .tenants
        .iter()
        .map(|t| (t.name.clone(), t.network().to_owned()))
        .collect()
}

/// What changed between two views, one line each.
fn diff_views(
    old_hosts: &[HostEntry],
    new_hosts: &[HostEntry],
    old_gids: &[GidEntry],
    new_gids: &[GidEntry],
) -> Vec<String> {
    let mut changes = Vec::new();
    let describe = |g: &GidEntry| {
        format!(
            "(host {}, tenant {}, network {})",
            g.host, g.tenant, g.network
        )
    };
    for h in new_hosts {
        match old_hosts.iter().find(|o| o.name == h.name) {
            None => changes.push(format!("host {} added ({})", h.name, h.address)),
            Some(o) if o.address != h.address => changes.push(format!(
                "host {}: address {} -> {}",
                h.name, o.address, h.address
            )),
            Some(_) => {}
        }
    }
    for h in old_hosts {
        if !new_hosts.iter().any(|n| n.name == h.name) {
            changes.push(format!("host {} removed", h.name));
        }
    }
    for g in new_gids {
        match old_gids.iter().find(|o| o.gid == g.gid) {
            None => changes.push(format!("gid {} added {}", g.gid, describe(g))),
            Some(o) if o != g => {
                changes.push(format!("gid {}: {} -> {}", g.gid, describe(o), describe(g)))
            }
            Some(_) => {}
        }
    }
    for g in old_gids {
        if !new_gids.iter().any(|n| n.gid == g.gid) {
            changes.push(format!("gid {} removed", g.gid));
        }
    }
    changes
}
