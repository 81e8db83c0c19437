//! The etcd directory against a real etcd (Debian's `etcd-server`, etcd
//! 3.4), started on free loopback ports with a temporary data directory
//! and killed at the end: two hosts see each other's GIDs, a withdrawal
//! and a dead host's lease expiry reach the other, a GID of another host
//! is refused, a lost lease is re-granted and republished, and the view
//! survives an etcd restart.

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use vrdma_hostd::net::directory::etcd::EtcdOptions;
use vrdma_hostd::net::directory::{Cluster, Directory, DirectoryError, EtcdDirectory, GidEntry};
use vrdma_hostd::seccomp::Threads;

const LEASE: u64 = 2;

/// `etcd` on `PATH`, or the test fails saying what to install.
fn etcd_binary() -> PathBuf {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .map(|d| d.join("etcd"))
        .find(|p| p.is_file())
        .unwrap_or_else(|| {
            panic!(
                "etcd is not installed: apt-get install etcd-server (`scripts/test` run as \
                 root installs everything the tests need)"
            )
        })
}

fn free_port() -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind");
    l.local_addr().expect("addr").port()
}

/// An etcd process, killed when dropped.
struct Etcd {
    child: Option<Child>,
    client: SocketAddr,
    peer: u16,
    data: PathBuf,
}

impl Etcd {
    fn start(data: &Path) -> Etcd {
        let mut etcd = Etcd {
            child: None,
            client: SocketAddr::from(([127, 0, 0, 1], free_port())),
            peer: free_port(),
            data: data.to_owned(),
        };
        etcd.spawn();
        etcd
    }

    fn spawn(&mut self) {
        let client = format!("http://{}", self.client);
        let peer = format!("http://127.0.0.1:{}", self.peer);
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.data.with_extension("log"))
            .expect("etcd log");
        let child = Command::new(etcd_binary())
            .args(["--name", "t", "--data-dir"])
            .arg(&self.data)
            .args(["--listen-client-urls", &client])
            .args(["--advertise-client-urls", &client])
            .args(["--listen-peer-urls", &peer])
            .args(["--initial-advertise-peer-urls", &peer])
            .args(["--initial-cluster", &format!("t={peer}")])
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("start etcd");
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(20);
        while post(self.client, "/v3/kv/range", r#"{"key":"AA=="}"#).is_none() {
            assert!(
                Instant::now() < deadline,
                "etcd did not come up in 20 s (log: {})",
                self.data.with_extension("log").display()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A POST to etcd's gateway; the body of a 200 answer.
fn post(addr: SocketAddr, path: &str, body: &str) -> Option<String> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(1)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    write!(
        s,
        "POST {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .ok()?;
    let mut answer = String::new();
    s.read_to_string(&mut answer).ok()?;
    answer
        .starts_with("HTTP/1.1 200")
        .then(|| answer.split_once("\r\n\r\n").map(|(_, b)| b.to_owned()))
        .flatten()
}

const CLUSTER: &str = r#"
[[host]]
name = "h1"
address = "10.200.0.1"
[[host]]
name = "h2"
address = "10.200.0.2"
[[host]]
name = "h3"
address = "10.200.0.3"
[[gid]]
address = "10.200.1.1"
host = "h1"
tenant = "alpha"
[[gid]]
address = "10.200.2.1"
host = "h2"
tenant = "beta"
network = "blue"
[[gid]]
address = "10.200.2.2"
host = "h2"
tenant = "beta"
network = "blue"
"#;

/// h3's own (different) view of the cluster: it claims h2's GID.
const CLUSTER_H3: &str = r#"
[[host]]
name = "h3"
address = "10.200.0.3"
[[gid]]
address = "10.200.2.1"
host = "h3"
tenant = "beta"
network = "blue"
"#;

fn open(host: &str, file: &Path, etcd: SocketAddr) -> EtcdDirectory {
    let cluster = Cluster::load(file).expect("cluster file");
    let d = EtcdDirectory::open(EtcdOptions {
        host: host.into(),
        cluster_file: file.to_owned(),
        cluster,
        endpoints: vec![etcd],
        lease_seconds: LEASE,
        networks: Default::default(),
    })
    .expect("etcd reachable");
    d.start(&Threads::unfiltered()).expect("threads");
    d
}

fn entry(gid: [u8; 4], host: &str, tenant: &str, network: &str) -> GidEntry {
    GidEntry {
        gid: Ipv4Addr::from(gid),
        host: host.into(),
        tenant: tenant.into(),
        network: network.into(),
    }
}

/// Waits up to `limit` for `cond`; returns how long it took.
#[track_caller]
fn within(limit: Duration, what: &str, cond: impl Fn() -> bool) -> Duration {
    let start = Instant::now();
    while !cond() {
        assert!(start.elapsed() < limit, "not within {limit:?}: {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
    start.elapsed()
}

#[test]
fn two_hosts_share_a_view_through_etcd() {
    let dir = std::env::temp_dir().join(format!("vrdma-directory-etcd-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("temp dir");
    let file = dir.join("cluster.toml");
    std::fs::write(&file, CLUSTER).expect("cluster");
    let file_h3 = dir.join("cluster-h3.toml");
    std::fs::write(&file_h3, CLUSTER_H3).expect("cluster h3");

    // etcd unreachable at start: an error.
    let nowhere = SocketAddr::from(([127, 0, 0, 1], free_port()));
    let err = EtcdDirectory::open(EtcdOptions {
        host: "h1".into(),
        cluster_file: file.clone(),
        cluster: Cluster::load(&file).expect("cluster"),
        endpoints: vec![nowhere],
        lease_seconds: LEASE,
        networks: Default::default(),
    })
    .expect_err("no etcd");
    assert!(
        vrdma_errors::error_chain(&err).contains("No etcd endpoint answered"),
        "{err}"
    );

    let mut etcd = Etcd::start(&dir.join("etcd-data"));
    let d1 = open("h1", &file, etcd.client);
    let d2 = open("h2", &file, etcd.client);
    let names = |d: &EtcdDirectory| {
        let mut n: Vec<String> = d.hosts().into_iter().map(|h| h.name).collect();
        n.sort();
        n
    };
    within(Duration::from_secs(1), "h1 sees h2", || {
        names(&d1) == ["h1", "h2"]
    });

    // Published GIDs reach the other host within a second.
    let a = entry([10, 200, 1, 1], "h1", "alpha", "alpha");
    let b = entry([10, 200, 2, 1], "h2", "beta", "blue");
    let g0 = d1.generation();
    d1.publish(&a).expect("h1's GID");
    d2.publish(&b).expect("h2's GID");
    let took = within(Duration::from_secs(1), "each sees the other's GID", || {
        d1.lookup(b.gid).as_ref() == Some(&b) && d2.lookup(a.gid).as_ref() == Some(&a)
    });
    eprintln!("published GIDs seen after {took:?}");
    assert!(d1.generation() > g0);
    d1.publish(&a).expect("publishing again is fine");

    // A GID of h2's pool, from h1: refused. And h3, whose cluster file
    // gives it h2's published GID: refused, naming h2.
    let err = d1
        .publish(&entry([10, 200, 2, 2], "h1", "beta", "blue"))
        .expect_err("h2's pool");
    assert!(matches!(err, DirectoryError::NotInPool { .. }), "{err}");
    let d3 = open("h3", &file_h3, etcd.client);
    within(Duration::from_secs(1), "h3 sees h2's GID", || {
        d3.lookup(b.gid).is_some()
    });
    let err = d3
        .publish(&entry([10, 200, 2, 1], "h3", "beta", "blue"))
        .expect_err("h2 holds it");
    assert!(
        matches!(&err, DirectoryError::Taken { owner, .. } if owner == "h2"),
        "{err}"
    );
    drop(d3);

    // A view that has not caught up misses a GID published after it was
    // read (h3 here runs no watch: its view is the one read at open); the
    // control path's lookup reads that key from etcd and finds it.
    let lagging = EtcdDirectory::open(EtcdOptions {
        host: "h3".into(),
        cluster_file: file_h3.clone(),
        cluster: Cluster::load(&file_h3).expect("cluster h3"),
        endpoints: vec![etcd.client],
        lease_seconds: LEASE,
        networks: Default::default(),
    })
    .expect("etcd reachable");
    let late = entry([10, 200, 2, 2], "h2", "beta", "blue");
    d2.publish(&late).expect("h2's second GID");
    assert_eq!(lagging.lookup(late.gid), None, "no watch: not in the view");
    assert_eq!(lagging.lookup_fresh(late.gid).as_ref(), Some(&late));
    assert_eq!(
        lagging.lookup(late.gid).as_ref(),
        Some(&late),
        "now in the view"
    );
    assert_eq!(
        lagging.lookup_fresh(Ipv4Addr::new(10, 200, 9, 9)),
        None,
        "a GID nobody published"
    );
    drop(lagging);
    d2.withdraw(late.gid).expect("withdraw h2's second GID");

    // Withdraw removes.
    d2.withdraw(b.gid).expect("withdraw");
    within(Duration::from_secs(1), "the withdrawal reaches h1", || {
        d1.lookup(b.gid).is_none()
    });
    d2.publish(&b).expect("again");
    within(Duration::from_secs(1), "h2's GID is back", || {
        d1.lookup(b.gid).is_some()
    });

    // A lost lease (revoked here) is granted anew and everything
    // republished by the keepalive.
    let leases = post(etcd.client, "/v3/lease/leases", "{}").expect("leases");
    let ids: Vec<String> = serde_json::from_str::<serde_json::Value>(&leases).expect("json")
        ["leases"]
        .as_array()
        .expect("leases")
        .iter()
        .filter_map(|l| l["ID"].as_str().map(str::to_owned))
        .collect();
    assert!(!ids.is_empty(), "{leases}");
    for id in ids {
        post(
            etcd.client,
            "/v3/lease/revoke",
            &format!(r#"{{"ID":"{id}"}}"#),
        )
        .expect("revoke");
    }
    let took = within(
        Duration::from_secs(LEASE + 2),
        "revoked leases re-granted, GIDs republished",
        || {
            d1.lookup(b.gid).is_some()
                && d2.lookup(a.gid).is_some()
                && post(
                    etcd.client,
                    "/v3/kv/range",
                    r#"{"key":"L3ZyZG1hL2dpZHMvMTAuMjAwLjEuMQ=="}"#,
                )
                .is_some_and(|body| body.contains("\"kvs\""))
        },
    );
    eprintln!("republished after {took:?}");

    // h2 stops keeping its lease alive: its entries vanish from h1's view
    // within the TTL and a second.
    drop(d2);
    let dropped = Instant::now();
    assert!(
        d1.lookup(b.gid).is_some(),
        "the lease, not a delete, removes it"
    );
    within(
        Duration::from_secs(LEASE + 1),
        "h2's entries expire with its lease",
        || d1.lookup(b.gid).is_none() && names(&d1) == ["h1"],
    );
    eprintln!("h2 gone after {:?}", dropped.elapsed());

    // etcd restarted: the last view stays meanwhile, and recovers after.
    etcd.kill();
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(d1.lookup(a.gid).as_ref(), Some(&a), "the last view stays");
    etcd.spawn();
    let d2 = open("h2", &file, etcd.client);
    let c = entry([10, 200, 2, 2], "h2", "beta", "blue");
    d2.publish(&c).expect("after the restart");
    let took = within(Duration::from_secs(5), "h1's view recovers", || {
        d1.lookup(c.gid).as_ref() == Some(&c) && names(&d1) == ["h1", "h2"]
    });
    eprintln!("view recovered {took:?} after h2 published");
    assert_eq!(d2.lookup(a.gid).as_ref(), Some(&a), "h1's GID survived");
    // And h1's lease is still kept alive: its GID outlives a TTL.
    std::thread::sleep(Duration::from_secs(LEASE + 1));
    assert_eq!(d2.lookup(a.gid).as_ref(), Some(&a));
    drop((d1, d2));
    etcd.kill();
    let _ = std::fs::remove_dir_all(&dir);
}
