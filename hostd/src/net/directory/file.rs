//! The static directory: the cluster file is the whole directory.
//!
//! Every host of the file and every GID it lists are known at once, live
//! or not; nothing is announced anywhere. `publish` only checks that the
//! GID is this host's in the file (a device must not take an address the
//! operator gave another host), `withdraw` does nothing. The file is
//! re-read on SIGHUP and `vrdmactl reload`; a bad file keeps the view in
//! force.

use std::collections::BTreeMap;
use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use vrdma_tenant_policy::Policy;

use super::{diff_views, networks_of, Cluster, Directory, DirectoryError, GidEntry, HostEntry};
use crate::seccomp::Threads;

/// One consistent view of the file.
#[derive(Debug, Default)]
struct View {
    hosts: Vec<HostEntry>,
    gids: BTreeMap<Ipv4Addr, GidEntry>,
}

/// The directory `directory = "static"` configures.
#[derive(Debug)]
pub struct StaticDirectory {
    path: PathBuf,
    /// This host's name.
    host: String,
    view: RwLock<Arc<View>>,
    generation: AtomicU64,
    /// Reloads run one at a time.
    reloading: Mutex<()>,
}

impl StaticDirectory {
    /// The directory of `cluster` (read from `path`, re-read from there on
    /// reload) for host `host`, GIDs without a network resolved through
    /// `policy`.
    pub fn new(path: PathBuf, host: String, cluster: &Cluster, policy: &Policy) -> Self {
        StaticDirectory {
            path,
            host,
            view: RwLock::new(Arc::new(view_of(cluster, policy))),
            generation: AtomicU64::new(0),
            reloading: Mutex::new(()),
        }
    }

    fn view(&self) -> Arc<View> {
        Arc::clone(&self.view.read().unwrap_or_else(|e| e.into_inner()))
    }
}

fn view_of(cluster: &Cluster, policy: &Policy) -> View {
    View {
        hosts: cluster.hosts.clone(),
        gids: cluster
            .entries(&networks_of(policy))
            .into_iter()
            .map(|e| (e.gid, e))
            .collect(),
    }
}

impl Directory for StaticDirectory {
    fn lookup(&self, gid: Ipv4Addr) -> Option<GidEntry> {
        self.view().gids.get(&gid).cloned()
    }

    fn hosts(&self) -> Vec<HostEntry> {
        self.view().hosts.clone()
    }

    fn publish(&self, entry: &GidEntry) -> Result<(), DirectoryError> {
        let not_ours = |detail: String| DirectoryError::NotInPool {
            gid: entry.gid,
            host: self.host.clone(),
            detail,
        };
        if entry.host != self.host {
            return Err(not_ours(format!(
                " (the entry names host {}, this is {})",
                entry.host, self.host
            )));
        }
        match self.lookup(entry.gid) {
            Some(known) if known.host == self.host && known.tenant == entry.tenant => Ok(()),
            Some(known) if known.host == self.host => Err(not_ours(format!(
                " for tenant {} (the file gives it to tenant {})",
                entry.tenant, known.tenant
            ))),
            Some(known) => Err(not_ours(format!(
                " (the file gives it to host {})",
                known.host
            ))),
            None => Err(not_ours(String::new())),
        }
    }

    fn withdraw(&self, _gid: Ipv4Addr) -> Result<(), DirectoryError> {
        Ok(())
    }

    fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    fn reload(&self, policy: &Policy) -> Result<Vec<String>, DirectoryError> {
        let _one_at_a_time = self.reloading.lock().unwrap_or_else(|e| e.into_inner());
        let cluster = Cluster::load(&self.path)?;
        if cluster.host(&self.host).is_none() {
            return Err(DirectoryError::UnknownHost {
                host: self.host.clone(),
                path: self.path.clone(),
            });
        }
        let new = Arc::new(view_of(&cluster, policy));
        let old = self.view();
        let old_gids: Vec<GidEntry> = old.gids.values().cloned().collect();
        let new_gids: Vec<GidEntry> = new.gids.values().cloned().collect();
        let changes = diff_views(&old.hosts, &new.hosts, &old_gids, &new_gids);
        if !changes.is_empty() {
            *self.view.write().unwrap_or_else(|e| e.into_inner()) = new;
            self.generation.fetch_add(1, Ordering::AcqRel);
        }
        Ok(changes)
    }

    fn start(&self, _threads: &Threads) -> Result<(), DirectoryError> {
        Ok(())
    }

    fn cluster_file(&self) -> PathBuf {
        self.path.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;
    use vrdma_errors::error_chain;
    use vrdma_isolation::daemon::testing::ScratchDir;

    const H1: &str = "[[host]]\nname = \"h1\"\naddress = \"10.200.0.1\"\n";
    const H2: &str = "[[host]]\nname = \"h2\"\naddress = \"10.200.0.2\"\n";

    fn gid(addr: &str, host: &str, tenant: &str) -> String {
        format!("[[gid]]\naddress = \"{addr}\"\nhost = \"{host}\"\ntenant = \"{tenant}\"\n")
    }

    fn entry(addr: [u8; 4], host: &str, tenant: &str, network: &str) -> GidEntry {
        GidEntry {
            gid: Ipv4Addr::from(addr),
            host: host.into(),
            tenant: tenant.into(),
            network: network.into(),
        }
    }

    fn open(path: &Path) -> StaticDirectory {
        let cluster = Cluster::load(path).expect("valid cluster file");
        StaticDirectory::new(
            path.to_owned(),
            "h1".into(),
            &cluster,
            &Policy::default_policy(),
        )
    }

    #[test]
    fn lookup_hosts_and_publish_follow_the_file() {
        let dir = ScratchDir::new("hostd-static-directory");
        let text = format!(
            "{H1}{H2}{}{}network = \"blue\"\n{}",
            gid("10.200.1.1", "h1", "alpha"),
            gid("10.200.1.2", "h2", "beta"),
            gid("10.200.1.3", "h1", "gamma"),
        );
        let path = dir.write("cluster.toml", &text);
        let d = open(&path);
        // alpha: the default policy's network (demo); gamma is in no
        // policy: its own name.
        let a = entry([10, 200, 1, 1], "h1", "alpha", "demo");
        assert_eq!(d.lookup(a.gid), Some(a.clone()));
        assert_eq!(
            d.lookup(Ipv4Addr::new(10, 200, 1, 2)),
            Some(entry([10, 200, 1, 2], "h2", "beta", "blue"))
        );
        assert_eq!(
            d.lookup(Ipv4Addr::new(10, 200, 1, 3)).map(|e| e.network),
            Some("gamma".to_owned())
        );
        assert_eq!(d.lookup(Ipv4Addr::new(10, 200, 1, 9)), None);
        let names: Vec<String> = d.hosts().into_iter().map(|h| h.name).collect();
        assert_eq!(names, ["h1", "h2"]);
        assert_eq!(d.cluster_file(), path);
        d.publish(&a).expect("h1's own GID");
        d.withdraw(a.gid).expect("a no-op");
        assert_eq!(d.lookup(a.gid), Some(a), "withdraw changes nothing");
        for (bad, wanted) in [
            (
                entry([10, 200, 1, 2], "h1", "beta", "blue"),
                "GID 10.200.1.2 is not in host h1's pool in the cluster file (the file gives it to host h2)",
            ),
            (
                entry([10, 200, 1, 1], "h1", "beta", "demo"),
                "for tenant beta (the file gives it to tenant alpha)",
            ),
            (
                entry([10, 200, 1, 1], "h2", "alpha", "demo"),
                "(the entry names host h2, this is h1)",
            ),
            (
                entry([10, 200, 1, 9], "h1", "alpha", "demo"),
                "GID 10.200.1.9 is not in host h1's pool in the cluster file",
            ),
        ] {
            let err = d.publish(&bad).expect_err("not h1's");
            assert!(error_chain(&err).contains(wanted), "{err}");
        }
        assert_eq!(d.generation(), 0);
    }

    #[test]
    fn reload_applies_a_good_file_and_keeps_the_view_on_a_bad_one() {
        let dir = ScratchDir::new("hostd-static-directory-reload");
        let first = format!("{H1}{H2}{}", gid("10.200.1.1", "h1", "alpha"));
        let path = dir.write("cluster.toml", &first);
        let d = open(&path);
        let policy = Policy::default_policy();
        assert_eq!(d.reload(&policy).expect("same file"), Vec::<String>::new());
        assert_eq!(d.generation(), 0, "nothing changed");
        let second = format!(
            "{H1}[[host]]\nname = \"h3\"\naddress = \"10.200.0.3\"\n{}{}",
            gid("10.200.1.1", "h1", "beta"),
            gid("10.200.1.7", "h3", "alpha"),
        );
        std::fs::write(&path, second).expect("write");
        assert_eq!(
            d.reload(&policy).expect("valid"),
            [
                "host h3 added (10.200.0.3)",
                "host h2 removed",
                "gid 10.200.1.1: (host h1, tenant alpha, network demo) -> \
                 (host h1, tenant beta, network demo)",
                "gid 10.200.1.7 added (host h3, tenant alpha, network demo)",
            ]
        );
        assert_eq!(d.generation(), 1);
        assert_eq!(
            d.lookup(Ipv4Addr::new(10, 200, 1, 7)).map(|e| e.host),
            Some("h3".to_owned())
        );
        // A bad file: the error names file and entry; the view stays.
        let bad = format!("{H1}{}", gid("10.200.1.8", "h9", "alpha"));
        std::fs::write(&path, bad).expect("write");
        let err = d.reload(&policy).expect_err("h9 is no host");
        let chain = error_chain(&err);
        assert!(
            chain.contains("cluster.toml") && chain.contains("gid[0] (10.200.1.8)"),
            "{chain}"
        );
        // A file without this host.
        std::fs::write(&path, H2).expect("write");
        let err = d.reload(&policy).expect_err("h1 missing");
        assert!(matches!(err, DirectoryError::UnknownHost { .. }), "{err}");
        std::fs::remove_file(&path).expect("remove");
        assert!(matches!(
            d.reload(&policy),
            Err(DirectoryError::Read { .. })
        ));
        assert_eq!(d.generation(), 1);
        assert_eq!(d.hosts().len(), 2);
        assert_eq!(
            d.lookup(Ipv4Addr::new(10, 200, 1, 7)).map(|e| e.tenant),
            Some("alpha".to_owned())
        );
    }
}
