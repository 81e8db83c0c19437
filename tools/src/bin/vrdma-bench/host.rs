//! The system under measurement: hostd and one vdev per tenant as separate
//! processes on unix sockets in a scratch directory, each tenant's device
//! opened by a vhost-user frontend in this process, and connected QP pairs
//! with a buffer on each side.

use std::path::{Path, PathBuf};

use vrdma_guest_driver::{
    CompletionQueue, MemoryRegion, QpCapabilities, QueuePair, WorkCompletion,
};
use vrdma_spec::verbs::Mtu;
use vrdma_spec::verbs::{access, WcStatus};
use vrdma_tools::supervisor::{find_binary, Daemon, Launch, Scratch};
use vrdma_tools::verbs::{bring_up_at, Connection, Opened};

use crate::{cores, verbs, BenchError, Result};

/// Access of every buffer: the peer may write and read it.
const RW: u32 = access::LOCAL_WRITE | access::REMOTE_WRITE | access::REMOTE_READ;
/// Completion queue entries of each tenant's one CQ.
pub const CQ_DEPTH: u32 = 4096;

/// Arguments every hostd of this run gets (`--hostd-arg`), after the
/// test's own.
static EXTRA_HOSTD_ARGS: std::sync::OnceLock<Vec<String>> = std::sync::OnceLock::new();

/// Sets the arguments every hostd of this run gets; once, before the first.
pub fn set_extra_hostd_args(args: Vec<String>) {
    let _ = EXTRA_HOSTD_ARGS.set(args);
}

/// hostd and the vdevs of one measurement. Fields drop in order: hostd
/// before its directory.
pub struct Host {
    /// Behind a lock so that another thread may restart it while traffic
    /// runs.
    hostd: std::sync::Mutex<Daemon>,
    hostd_socket: PathBuf,
    vdev: PathBuf,
    dir: Scratch,
    vdevs: std::sync::atomic::AtomicU32,
}

impl Host {
    /// hostd with `args`, on `policy` (or its embedded default one).
    pub fn start(policy: Option<&str>, args: &[&str]) -> Result<Self> {
        let dir = Scratch::new("bench")?;
        let hostd = find_binary("hostd", "vrdma-hostd")?;
        let extra = EXTRA_HOSTD_ARGS
            .get()
            .map(Vec::as_slice)
            .unwrap_or_default();
        let mut launch = Launch::hostd(&hostd, dir.path())
            .args(args)
            .args(cores::hostd_args())
            .args(extra);
        if let Some(policy) = policy {
            launch = launch
                .arg("--policy")
                .arg(dir.write("policy.toml", policy)?);
        }
        // hostd may run anywhere; it pins its own datapath threads.
        let hostd = cores::on_every_cpu(|| launch.start()).map_err(BenchError::Cores)??;
        Ok(Self {
            hostd_socket: hostd.socket().to_owned(),
            hostd: std::sync::Mutex::new(hostd),
            vdev: find_binary("vdev", "vrdma-vdev")?,
            dir,
            vdevs: std::sync::atomic::AtomicU32::new(0),
        })
    }

    /// hostd inside network namespace `netns`, in a cluster: its config
    /// file `[fabric] host = "<host>"` on the static cluster file
    /// `cluster`, its packets through `packet_io`; the whole process on the datapath CPU if one is
    /// dedicated (two hostds share it), else anywhere.
    pub fn start_in_cluster(
        netns: &Path,
        host: &str,
        cluster: &str,
        packet_io: crate::cross::PacketIo,
    ) -> Result<Self> {
        let dir = Scratch::new(&format!("bench-{host}"))?;
        let hostd = find_binary("hostd", "vrdma-hostd")?;
        dir.write("cluster.toml", cluster)?;
        let policy = dir.write("policy.toml", BENCH_POLICY)?;
        let config = format!(
            "[fabric]\nhost = \"{host}\"\ncluster = \"cluster.toml\"\ndirectory = \"static\"\nip_mtu = 9000\npacket_io = \"{}\"\n",
            packet_io.name()
        );
        let config = dir.write("hostd.toml", &config)?;
        let extra = EXTRA_HOSTD_ARGS
            .get()
            .map(Vec::as_slice)
            .unwrap_or_default();
        let launch = Launch::hostd(&hostd, dir.path())
            .arg("--config")
            .arg(config)
            .arg("--policy")
            .arg(policy)
            .args(extra)
            .netns(netns);
        let hostd = cores::on_datapath_cpu(|| launch.start()).map_err(BenchError::Cores)??;
        Ok(Self {
            hostd_socket: hostd.socket().to_owned(),
            hostd: std::sync::Mutex::new(hostd),
            vdev: find_binary("vdev", "vrdma-vdev")?,
            dir,
            vdevs: std::sync::atomic::AtomicU32::new(0),
        })
    }

    /// hostd's admin socket (its default: next to its vdev socket).
    pub fn admin_socket(&self) -> PathBuf {
        let mut name = self.hostd_socket.as_os_str().to_owned();
        name.push(".admin");
        name.into()
    }

    /// `vrdmactl <command> --json` of this hostd, parsed ([`vrdmactl_json`]).
    pub fn ctl_json(&self, command: &str) -> Option<serde_json::Value> {
        vrdmactl_json(&self.admin_socket(), command)
    }

    /// A vdev for `tenant` attached to hostd.
    pub fn vdev(&self, tenant: &str) -> Result<Daemon> {
        let n = self
            .vdevs
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        // vdev's own limits cap the policy's quotas: raised alike.
        let limits = self.dir.write("vdev-limits.toml", VDEV_LIMITS)?;
        let launch = Launch::vdev(
            &self.vdev,
            self.dir.path(),
            tenant,
            Some(&self.hostd_socket),
        )
        .arg("--config")
        .arg(&limits);
        // vdev is the host's control plane, not the tenant's application:
        // anywhere, as hostd's other threads (connection setup is its
        // work, none of the datapath's).
        let vdev = cores::on_every_cpu(|| launch.file(&format!("{tenant}-{n}")).start())
            .map_err(BenchError::Cores)??;
        Ok(vdev)
    }

    /// A vdev for `tenant` and its device, opened, with a CQ of
    /// [`CQ_DEPTH`].
    pub fn tenant(&self, tenant: &str) -> Result<Tenant> {
        self.tenant_with_cq(tenant, CQ_DEPTH)
    }

    /// A vdev for `tenant` and its device, opened, with a CQ of `cq_depth`.
    pub fn tenant_with_cq(&self, tenant: &str, cq_depth: u32) -> Result<Tenant> {
        let vdev = self.vdev(tenant)?;
        let dev = Opened::open(vdev.socket(), cq_depth).map_err(|source| BenchError::Open {
            tenant: tenant.into(),
            source,
        })?;
        Ok(Tenant {
            dev,
            socket: vdev.socket().to_owned(),
            vdev: std::sync::Mutex::new(vdev),
        })
    }

    fn hostd(&self) -> std::sync::MutexGuard<'_, Daemon> {
        self.hostd.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// SIGKILLs hostd and starts it again on the same socket, as a service
    /// manager restarts a crashed daemon; returns when the new one listens.
    pub fn restart_hostd(&self) -> Result<()> {
        // As at its start: anywhere (it pins its own datapath threads),
        // not on the calling thread's CPUs.
        cores::on_every_cpu(|| self.hostd().restart()).map_err(BenchError::Cores)??;
        Ok(())
    }

    /// Upgrades hostd by handover: a new hostd takes the running one's
    /// sockets and state (`--take-over`); returns once the previous one
    /// exited, with how long that took.
    pub fn hand_over_hostd(&self) -> Result<std::time::Duration> {
        let started = std::time::Instant::now();
        let status =
            cores::on_every_cpu(|| self.hostd().hand_over()).map_err(BenchError::Cores)??;
        if !status.success() {
            return Err(BenchError::Setup {
                what: "hand hostd over".into(),
                detail: format!("the previous hostd exited with {status}"),
            });
        }
        Ok(started.elapsed())
    }

    /// The daemon process of hostd.
    pub fn hostd_pid(&self) -> u32 {
        self.hostd().pid()
    }
}

/// A tenant's device, opened, and the vdev serving it (fields drop in
/// order: the device first).
pub struct Tenant {
    dev: Opened,
    socket: PathBuf,
    /// Behind a lock so that another thread may restart it while this
    /// tenant's traffic runs.
    vdev: std::sync::Mutex<Daemon>,
}

impl Tenant {
    /// The vdev's socket (another process may open the device there too).
    pub fn socket(&self) -> &Path {
        &self.socket
    }

    fn vdev(&self) -> std::sync::MutexGuard<'_, Daemon> {
        self.vdev.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// SIGKILLs the vdev and starts it again on the same socket (as a
    /// service manager restarts a crashed daemon); returns when the new
    /// one listens.
    pub fn restart_vdev(&self) -> Result<()> {
        // Anywhere, as at its start (`Host::vdev`).
        cores::on_every_cpu(|| self.vdev().restart()).map_err(BenchError::Cores)??;
        Ok(())
    }

    /// The device's IPv4 address (its IPv4-mapped GID).
    pub fn ip(&self) -> std::net::Ipv4Addr {
        let g = self.gid;
        std::net::Ipv4Addr::new(g[12], g[13], g[14], g[15])
    }

    /// The vdev's process.
    pub fn vdev_pid(&self) -> u32 {
        self.vdev().pid()
    }

    /// An RC QP on the tenant's one CQ with `send_wr` send slots.
    pub fn qp(&self, send_wr: u32) -> Result<QueuePair> {
        let caps = QpCapabilities {
            max_send_wr: send_wr,
            max_recv_wr: send_wr,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: 64,
        };
        self.rc_qp(caps).map_err(verbs("create a QP"))
    }

    /// A registered buffer of `len` bytes.
    pub fn buffer(&self, len: usize) -> Result<Buffer> {
        let mr = self
            .pd
            .alloc_mr(len, RW)
            .map_err(verbs("register a buffer"))?;
        Ok(Buffer(mr))
    }
}

impl std::ops::Deref for Tenant {
    type Target = Opened;
    fn deref(&self) -> &Opened {
        &self.dev
    }
}

/// Polls `cq` into `wcs`: how many completed, every one successfully.
pub fn poll_ok(cq: &CompletionQueue, wcs: &mut [WorkCompletion]) -> Result<usize> {
    let n = cq.poll(wcs).map_err(verbs("poll a CQ"))?;
    match wcs[..n].iter().find(|wc| wc.status != WcStatus::Success) {
        Some(wc) => Err(BenchError::Completion(wc.status)),
        None => Ok(n),
    }
}

/// `a`'s `qa` and `b`'s `qb`, connected to each other, path MTU 4096 (the
/// cross-host hosts' jumbo link fits it; between devices of one host it
/// does not matter).
pub fn connect(a: &Tenant, qa: &QueuePair, b: &Tenant, qb: &QueuePair) -> Result<()> {
    let how = Connection::default();
    bring_up_at(qa, qb.qp_num(), b.gid, how, Mtu::Mtu4096).map_err(verbs("connect a QP"))?;
    bring_up_at(qb, qa.qp_num(), a.gid, how, Mtu::Mtu4096).map_err(verbs("connect a QP"))
}

/// A registered buffer from the driver's DMA memory: one contiguous piece,
/// so its bytes can be watched in place, as perftest watches its buffer.
pub struct Buffer(MemoryRegion);

impl Buffer {
    /// The byte at `offset`, read once from memory the device writes.
    ///
    /// # Panics
    /// If `offset` is outside the buffer (a bench bug).
    pub fn byte(&self, offset: usize) -> u8 {
        assert!(offset < self.0.len(), "offset {offset} outside the buffer");
        // SAFETY: `alloc_mr` memory is one mapped piece of `len()` bytes
        // that lives as long as the MR, and `offset` is inside it; the
        // device writes it concurrently, hence the volatile read.
        unsafe { self.0.as_ptr().add(offset).read_volatile() }
    }

    /// Stores `value` at `offset`.
    ///
    /// # Panics
    /// If `offset` is outside the buffer (a bench bug).
    pub fn set_byte(&self, offset: usize, value: u8) {
        assert!(offset < self.0.len(), "offset {offset} outside the buffer");
        // SAFETY: as in `byte`.
        unsafe { self.0.as_ptr().add(offset).write_volatile(value) }
    }
}

impl std::ops::Deref for Buffer {
    type Target = MemoryRegion;
    fn deref(&self) -> &MemoryRegion {
        &self.0
    }
}

/// A connected QP pair between two tenants with a buffer on each side.
pub struct Link<'t> {
    pub qa: QueuePair,
    pub qb: QueuePair,
    pub ma: Buffer,
    pub mb: Buffer,
    pub a: &'t Tenant,
    pub b: &'t Tenant,
}

impl<'t> Link<'t> {
    /// A QP pair with `send_wr` slots on each side and buffers of twice
    /// `size` bytes (at least a page).
    pub fn new(a: &'t Tenant, b: &'t Tenant, size: usize, send_wr: u32) -> Result<Self> {
        let (qa, qb) = (a.qp(send_wr)?, b.qp(send_wr)?);
        connect(a, &qa, b, &qb)?;
        let len = (2 * size).max(4096);
        Ok(Link {
            qa,
            qb,
            ma: a.buffer(len)?,
            mb: b.buffer(len)?,
            a,
            b,
        })
    }
}

/// The embedded default policy's tenants (alpha and beta in network
/// `demo`) with room for the connection-rate test: each holds
/// [`crate::conn_rate::CONNECTIONS`] QPs at once, beyond the default
/// quota of 256.
pub const BENCH_POLICY: &str = "\
[[tenant]]
name = \"alpha\"
network = \"demo\"
quotas = { max_qp = 2048 }

[[tenant]]
name = \"beta\"
network = \"demo\"
quotas = { max_qp = 2048 }
";

/// The `[limits]` of every vdev the bench starts: [`BENCH_POLICY`]'s
/// QPs (the stricter of a vdev's limits and its tenant's quotas applies).
pub const VDEV_LIMITS: &str = "[limits]\nmax_qp = 2048\n";

/// A policy of tenants in one network with the given classes and weights.
pub fn policy<'a>(tenants: impl IntoIterator<Item = (&'a str, &'a str, u32)>) -> String {
    tenants
        .into_iter()
        .map(|(name, class, weight)| {
            format!("[[tenant]]\nname = \"{name}\"\nnetwork = \"bench\"\npriority = {{ class = \"{class}\", weight = {weight} }}\n\n")
        })
        .collect()
}

/// `vrdmactl <command> --json` of the hostd whose admin socket is `admin`,
/// parsed; `None` if it could not be had.
pub fn vrdmactl_json(admin: &Path, command: &str) -> Option<serde_json::Value> {
    let vrdmactl = find_binary("vrdmactl", "vrdma-hostd").ok()?;
    let out = std::process::Command::new(&vrdmactl)
        .arg("--admin-socket")
        .arg(admin)
        .args([command, "--json"])
        .output()
        .ok()?;
    serde_json::from_slice(&out.stdout).ok()
}
