//! Several hosts of RoCEv2 for the multi-host tests: three hostds in three
//! network namespaces of a [`Cluster`] (a kernel bridge or the hostile
//! relay between them), each serving tenants whose GIDs are addresses of
//! its namespace's interface.
//!
//! The cluster: h1 serves alpha (10.200.1.1) and gamma (10.200.1.3), h2
//! alpha (10.200.2.1) and gamma (10.200.2.3), h3 alpha (10.200.3.1) and
//! beta (10.200.3.2). alpha and gamma share network "blue"; beta is alone
//! in "red". Two tenants of one host (h1's alpha and gamma) and two hosts
//! (h1's alpha and h2's alpha) are the two places programs run between.

use std::net::Ipv4Addr;
use std::path::Path;
use std::process::{Child, Command, Output};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use vrdma_tools::supervisor;

use crate::daemon::{must, wait_output, Hostd, IbverbsShim, TempDir, Vdev};
use crate::netns::Cluster;

/// The tenants: alpha and gamma in network "blue", beta alone in "red".
pub const POLICY: &str = r#"
[[tenant]]
name = "alpha"
network = "blue"

[[tenant]]
name = "gamma"
network = "blue"

[[tenant]]
name = "beta"
network = "red"
"#;

/// The tenants' GIDs, by host (1-based) and tenant.
pub const GIDS: [(usize, &str, &str); 6] = [
    (1, "alpha", "10.200.1.1"),
    (1, "gamma", "10.200.1.3"),
    (2, "alpha", "10.200.2.1"),
    (2, "gamma", "10.200.2.3"),
    (3, "alpha", "10.200.3.1"),
    (3, "beta", "10.200.3.2"),
];

fn cluster_file() -> String {
    let mut text = String::new();
    for i in 1..=3 {
        text.push_str(&format!(
            "[[host]]\nname = \"h{i}\"\naddress = \"10.200.0.{i}\"\n\n"
        ));
    }
    for (host, tenant, gid) in GIDS {
        text.push_str(&format!(
            "[[gid]]\naddress = \"{gid}\"\nhost = \"h{host}\"\ntenant = \"{tenant}\"\n\n"
        ));
    }
    text
}

/// Where the hostds learn where GIDs live.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Directory {
    /// The cluster file is the whole directory.
    File,
    /// A real etcd (Debian's etcd-server) in h1's namespace; each hostd
    /// publishes its devices' GIDs under a 2-second lease.
    Etcd,
}

/// etcd's client port in h1's namespace (10.200.0.1).
pub const ETCD_PORT: u16 = 23790;

/// Three hosts, a hostd on each, and a vdev per tenant GID.
pub struct Fabric {
    // Dropped in order: vdevs, hostds, etcd, then the namespaces.
    /// (host, tenant, its vdev); a test may stop one by removing it.
    pub vdevs: Vec<(usize, String, Vdev)>,
    /// By host - 1; `None` once a test stopped that hostd.
    pub hostds: Vec<Option<Hostd>>,
    etcd: Option<Child>,
    _files: TempDir,
    pub cluster: Cluster,
}

impl Drop for Fabric {
    fn drop(&mut self) {
        self.vdevs.clear();
        self.hostds.clear();
        if let Some(mut etcd) = self.etcd.take() {
            let _ = etcd.kill();
            let _ = etcd.wait();
        }
    }
}

/// Starts etcd in host 1's namespace on 10.200.0.1 and waits for it.
fn start_etcd(cluster: &Cluster, data: &Path) -> Child {
    let etcd = crate::need::program("etcd", "etcd-server");
    let client = format!("http://10.200.0.1:{ETCD_PORT}");
    let peer = format!("http://127.0.0.1:{}", ETCD_PORT + 1);
    let child = (cluster.host(1).command(etcd))
        .args(["--name", "roce", "--data-dir"])
        .arg(data)
        .args(["--listen-client-urls", &client])
        .args(["--advertise-client-urls", &client])
        .args(["--listen-peer-urls", &peer])
        .args(["--initial-advertise-peer-urls", &peer])
        .args(["--initial-cluster", &format!("roce={peer}")])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("start etcd");
    let deadline = Instant::now() + Duration::from_secs(20);
    let up = || {
        cluster
            .host(1)
            .run(|| std::net::TcpStream::connect(("10.200.0.1", ETCD_PORT)).is_ok())
    };
    while !up() {
        assert!(Instant::now() < deadline, "etcd did not come up in 20 s");
        std::thread::sleep(Duration::from_millis(100));
    }
    // Its gateway answers once the member is elected.
    std::thread::sleep(Duration::from_millis(500));
    child
}

/// The packet queues every hostd of a [`Fabric`] carries RoCEv2 through
/// (`[fabric] packet_io`, set explicitly: a hostd that cannot set AF_XDP
/// up fails to start rather than fall back unseen).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    /// AF_XDP sockets on the host's interface (the default where it works).
    AfXdp,
    /// The kernel's UDP stack.
    Udp,
}

impl Backend {
    fn config(self) -> &'static str {
        match self {
            Backend::AfXdp => "packet_io = \"af_xdp\"\n",
            Backend::Udp => "packet_io = \"udp\"\n",
        }
    }
}

impl Fabric {
    /// Three bridged hosts on AF_XDP, the directory in the cluster file.
    pub fn start() -> Self {
        Fabric::start_over(Backend::AfXdp)
    }

    /// [`Fabric::start`] over `backend`.
    pub fn start_over(backend: Backend) -> Self {
        Fabric::on_with(Cluster::bridged(3), Directory::File, [backend; 3], &[])
    }

    /// [`Fabric::start`] with more arguments for every hostd.
    pub fn start_with_hostd_args(args: &[&str]) -> Self {
        Fabric::on_with(
            Cluster::bridged(3),
            Directory::File,
            [Backend::AfXdp; 3],
            args,
        )
    }

    /// The fabric on `cluster`'s three hosts.
    pub fn on(cluster: Cluster, directory: Directory) -> Self {
        Fabric::on_with(cluster, directory, [Backend::AfXdp; 3], &[])
    }

    /// [`Fabric::on`] over `backend`.
    pub fn on_over(cluster: Cluster, directory: Directory, backend: Backend) -> Self {
        Fabric::on_with(cluster, directory, [backend; 3], &[])
    }

    /// Three bridged hosts, host `i` on `backends[i - 1]`.
    pub fn start_mixed(backends: [Backend; 3]) -> Self {
        Fabric::on_with(Cluster::bridged(3), Directory::File, backends, &[])
    }

    fn on_with(
        cluster: Cluster,
        directory: Directory,
        backends: [Backend; 3],
        hostd_args: &[&str],
    ) -> Self {
        let files = TempDir::new("roce");
        let cluster_path = files.path().join("cluster.toml");
        std::fs::write(&cluster_path, cluster_file()).expect("cluster file");
        for (host, _, gid) in GIDS {
            cluster.add_address(host, gid.parse().expect("address"));
        }
        resolve_neighbours(&cluster);
        let etcd = (directory == Directory::Etcd)
            .then(|| start_etcd(&cluster, &files.path().join("etcd")));
        let table = match directory {
            Directory::File => "directory = \"static\"\n".to_owned(),
            Directory::Etcd => format!(
                "directory = \"etcd\"\netcd_endpoints = [\"http://10.200.0.1:{ETCD_PORT}\"]\n\
                 lease_seconds = 2\n"
            ),
        };
        let hostds: Vec<Option<Hostd>> = (1..=3)
            .map(|i| {
                let config = files.path().join(format!("h{i}.toml"));
                std::fs::write(
                    &config,
                    format!(
                        "[fabric]\nhost = \"h{i}\"\ncluster = \"{}\"\n{table}{}",
                        cluster_path.display(),
                        backends[i - 1].config()
                    ),
                )
                .expect("config");
                let config = config.to_str().expect("UTF-8").to_owned();
                let args: Vec<&str> = ["--config", config.as_str()]
                    .into_iter()
                    .chain(hostd_args.iter().copied())
                    .collect();
                Some(Hostd::start_in_netns(
                    Some(&cluster.host(i).netns_path()),
                    Some(POLICY),
                    &args,
                ))
            })
            .collect();
        let vdevs = GIDS
            .iter()
            .map(|&(host, tenant, _)| {
                let hostd = hostds[host - 1].as_ref().expect("hostd");
                (host, tenant.to_owned(), Vdev::on_hostd(hostd, tenant, &[]))
            })
            .collect();
        Fabric {
            vdevs,
            hostds,
            etcd,
            _files: files,
            cluster,
        }
    }

    /// The vdev socket of `tenant` on host `host`.
    pub fn device(&self, host: usize, tenant: &str) -> &Path {
        &self.vdev(host, tenant).socket
    }

    /// The vdev of `tenant` on host `host`.
    pub fn vdev(&self, host: usize, tenant: &str) -> &Vdev {
        let (_, _, vdev) = (self.vdevs.iter())
            .find(|(h, t, _)| *h == host && t == tenant)
            .expect("a device of the cluster");
        vdev
    }

    /// The IPv4 address (GID 0) of `tenant`'s device on host `host`.
    pub fn ip(host: usize, tenant: &str) -> Ipv4Addr {
        let (_, _, gid) = (GIDS.iter())
            .find(|&&(h, t, _)| h == host && t == tenant)
            .expect("a GID of the cluster");
        gid.parse().expect("an IPv4 address")
    }

    /// `program` in host `host`'s network namespace, on `tenant`'s device
    /// there through the drop-in libraries of `shim`.
    pub fn command(&self, shim: &IbverbsShim, host: usize, tenant: &str, program: &str) -> Command {
        let mut cmd = shim.command(program, self.device(host, tenant));
        must(supervisor::enter_netns(
            &mut cmd,
            &self.cluster.host(host).netns_path(),
        ));
        cmd
    }

    pub fn hostd(&self, host: usize) -> &Hostd {
        self.hostds[host - 1].as_ref().expect("hostd running")
    }

    /// Every hostd's log and peers table, for a failure message.
    pub fn logs(&self) -> String {
        let mut out = String::new();
        for (i, h) in self.hostds.iter().enumerate() {
            if let Some(h) = h {
                let (_, peers, _) = h.ctl(&["peers"]);
                out.push_str(&format!(
                    "--- hostd h{} peers:\n{peers}\n--- log:\n{}\n",
                    i + 1,
                    tail(&h.log(), 60)
                ));
            }
        }
        for i in 1..=3 {
            let host = self.cluster.host(i);
            for args in [&["-s", "link", "show", "eth0"][..], &["neigh"][..]] {
                let o = host.command("ip").args(args).output().expect("ip");
                out.push_str(&format!(
                    "--- h{i} ip {args:?}:\n{}",
                    String::from_utf8_lossy(&o.stdout)
                ));
            }
            let o = host
                .command("cat")
                .arg("/proc/net/snmp")
                .output()
                .expect("snmp");
            let snmp = String::from_utf8_lossy(&o.stdout);
            out.push_str(&format!(
                "--- h{i} snmp:\n{}\n",
                snmp.lines()
                    .filter(|l| l.starts_with("Udp:") || l.starts_with("Ip:"))
                    .collect::<Vec<_>>()
                    .join("\n")
            ));
        }
        out
    }
}

/// Waits until every GID answers a UDP echo from every GID of the other
/// hosts: ARP resolved and the bridge forwarding (a fresh bridge port can
/// take a second, longer than rc_pingpong's whole retry budget; a RoCE
/// NIC likewise resolves a GID's MAC when its QP is connected).
pub fn resolve_neighbours(cluster: &Cluster) {
    use std::net::{Ipv4Addr, SocketAddrV4, UdpSocket};
    use std::sync::atomic::AtomicBool;
    use std::sync::Arc;
    const PORT: u16 = 9999;
    let stop = Arc::new(AtomicBool::new(false));
    let echoes: Vec<_> = GIDS
        .iter()
        .map(|&(host, _, gid)| {
            let stop = Arc::clone(&stop);
            let ip: Ipv4Addr = gid.parse().expect("address");
            let socket = cluster
                .host(host)
                .run(move || UdpSocket::bind(SocketAddrV4::new(ip, PORT)).expect("bind echo"));
            std::thread::spawn(move || {
                let _ = socket.set_read_timeout(Some(Duration::from_millis(50)));
                let mut buf = [0u8; 64];
                while !stop.load(Ordering::Relaxed) {
                    if let Ok((n, from)) = socket.recv_from(&mut buf) {
                        let _ = socket.send_to(&buf[..n], from);
                    }
                }
            })
        })
        .collect();
    for &(from, _, src) in &GIDS {
        for &(to, _, dst) in &GIDS {
            if to == from {
                continue;
            }
            let (src, dst): (Ipv4Addr, Ipv4Addr) =
                (src.parse().expect("ip"), dst.parse().expect("ip"));
            let answered = cluster.host(from).run(move || {
                let socket = UdpSocket::bind(SocketAddrV4::new(src, 0)).expect("bind probe");
                let _ = socket.set_read_timeout(Some(Duration::from_millis(100)));
                let mut buf = [0u8; 64];
                (0..100).any(|_| {
                    let _ = socket.send_to(b"probe", SocketAddrV4::new(dst, PORT));
                    socket.recv_from(&mut buf).is_ok()
                })
            });
            assert!(answered, "{src} (h{from}) cannot reach {dst} (h{to})");
        }
    }
    stop.store(true, Ordering::Relaxed);
    for e in echoes {
        let _ = e.join();
    }
}

/// Packets `hostd` has sent to peer host `host`.
pub fn packets_to(hostd: &Hostd, host: &str) -> u64 {
    let (_, json, _) = hostd.ctl(&["peers", "--json"]);
    let peers: serde_json::Value = serde_json::from_str(&json).unwrap_or_default();
    (peers.as_array().into_iter().flatten())
        .find(|p| p["host"] == host)
        .and_then(|p| p["tx_packets"].as_u64())
        .unwrap_or(0)
}

/// Waits for `child` up to `timeout` (killed then) and returns its output.
pub fn wait(child: Child, timeout: Duration) -> Output {
    wait_output(child, timeout).0
}

pub fn tail(text: &str, lines: usize) -> String {
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

pub fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}
