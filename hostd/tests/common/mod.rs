//! A test client that speaks hostd's protocol directly — the well-behaved
//! vdev and, when a test wants, the compromised one — and a handle on a real
//! `hostd` process.

#![allow(dead_code)]

use std::fs::File;
use std::io::Write;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use vrdma_hostd_protocol::channel::Channel;
use vrdma_hostd_protocol::entries::{kind, PhysCqe, PhysWqe, Sge};
use vrdma_hostd_protocol::messages::{
    MrRegistration, MrSegment, Notification, QpConnection, QueueGrant, Request, Response,
    TenantPolicy, PROTOCOL_VERSION,
};
use vrdma_hostd_protocol::shm::{sealed_memfd, QueueLayout, Ring, SharedMapping};
use vrdma_spec::ring::send_flags;
use vrdma_spec::verbs::{access, SendOpcode};

pub const ALL_ACCESS: u32 =
    access::LOCAL_WRITE | access::REMOTE_WRITE | access::REMOTE_READ | access::REMOTE_ATOMIC;

/// A running hostd on a private socket; killed on drop.
pub struct Hostd {
    child: Child,
    pub socket: PathBuf,
    /// The admin socket (`<socket>.admin`).
    pub admin: PathBuf,
    /// The policy file hostd was started with (rewrite it, then reload).
    pub policy: PathBuf,
    dir: PathBuf,
}

impl Hostd {
    /// Starts hostd with `config` (TOML without `socket` and `policy`,
    /// which are added) and the standard test tenants ([`policy`]).
    pub fn start(name: &str, config: &str) -> Self {
        Hostd::start_with(name, config, &policy())
    }

    /// Starts hostd with `config` and the policy file `policy_text`.
    pub fn start_with(name: &str, config: &str, policy_text: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("hostd-it-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("temp dir");
        let socket = dir.join("hostd.sock");
        let admin = dir.join("hostd.sock.admin");
        let policy = dir.join("policy.toml");
        std::fs::write(&policy, policy_text).expect("policy");
        let path = dir.join("hostd.toml");
        std::fs::write(
            &path,
            format!(
                "socket = {:?}\npolicy = \"policy.toml\"\n{config}",
                socket.to_str().expect("utf-8")
            ),
        )
        .expect("config");
        let child = Command::new(env!("CARGO_BIN_EXE_hostd"))
            .arg("--config")
            .arg(&path)
            .env("VRDMA_LOG", "warn")
            .stdin(Stdio::null())
            .spawn()
            .expect("spawn hostd");
        let hostd = Hostd {
            child,
            socket,
            admin,
            policy,
            dir,
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        while Channel::connect(&hostd.socket).is_err() {
            assert!(Instant::now() < deadline, "hostd did not come up");
            std::thread::sleep(Duration::from_millis(10));
        }
        hostd
    }

    /// CPU time the process used so far, in clock ticks (utime + stime).
    pub fn cpu_ticks(&self) -> u64 {
        let stat =
            std::fs::read_to_string(format!("/proc/{}/stat", self.child.id())).expect("stat");
        // Fields after the parenthesised command name; utime and stime are
        // fields 14 and 15 of the whole line.
        let rest = &stat[stat.rfind(')').expect("comm") + 2..];
        let fields: Vec<&str> = rest.split_whitespace().collect();
        let n = |i: usize| fields[i - 3].parse::<u64>().expect("number");
        n(14) + n(15)
    }

    /// Whether the process is still running.
    pub fn alive(&mut self) -> bool {
        self.child.try_wait().expect("try_wait").is_none()
    }

    /// Runs `vrdmactl --admin-socket <ours> ARGS`.
    pub fn vrdmactl(&self, args: &[&str]) -> Output {
        Command::new(env!("CARGO_BIN_EXE_vrdmactl"))
            .arg("--admin-socket")
            .arg(&self.admin)
            .args(args)
            .stdin(Stdio::null())
            .output()
            .expect("run vrdmactl")
    }

    /// `vrdmactl ARGS` that must succeed: its stdout.
    pub fn vrdmactl_ok(&self, args: &[&str]) -> String {
        let out = self.vrdmactl(args);
        assert!(
            out.status.success(),
            "vrdmactl {args:?} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).expect("utf-8")
    }

    /// Sends SIGHUP.
    pub fn hangup(&self) {
        // SAFETY: kill has no memory-safety preconditions.
        let rc = unsafe { libc::kill(self.child.id() as i32, libc::SIGHUP) };
        assert_eq!(rc, 0, "kill");
    }
}

impl Drop for Hostd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// hostd's test configuration: small rings, short polling.
pub fn config(physical_qps: u32) -> String {
    format!(
        r#"
physical_qps = {physical_qps}
sq_depth = 64
cq_depth = 128
spin_us = 20
"#
    )
}

/// The standard test tenants (2 physical queues each): alpha and beta in
/// "demo", gamma in "other", delta in "edge" reaching "demo", and "locked"
/// bound to a uid not ours.
pub fn policy() -> String {
    // SAFETY: getuid has no preconditions.
    let other_uid = unsafe { libc::getuid() } + 1;
    format!(
        r#"
[[tenant]]
name = "alpha"
network = "demo"
[[tenant]]
name = "beta"
network = "demo"
[[tenant]]
name = "gamma"
network = "other"
[[tenant]]
name = "delta"
network = "edge"
reachable = ["demo"]
[[tenant]]
name = "locked"
network = "demo"
uid = {other_uid}
"#
    )
}

/// A client of hostd.
pub struct Client {
    pub chan: Channel,
    pub lid: u16,
    pub grants: Vec<QueueGrant>,
    pub queues: Vec<SharedMapping>,
    pub layout: QueueLayout,
    pub doorbell: File,
    pub completion: File,
    /// The notification channel (hostd → vdev).
    pub notify: Channel,
    /// The tenant's policy from the Welcome.
    pub policy: TenantPolicy,
}

/// A refusal as (errno, reason).
pub type Refused = (i32, String);

pub fn hello_request(tenant: &str, device: &str) -> Request {
    Request::Hello {
        version: PROTOCOL_VERSION,
        tenant: tenant.into(),
        device: device.into(),
    }
}

impl Client {
    /// Connects and greets; the refusal if hostd says no.
    pub fn hello(socket: &Path, tenant: &str, device: &str) -> Result<Client, Refused> {
        let chan = Channel::connect(socket).expect("connect");
        Client::greet(chan, hello_request(tenant, device))
    }

    /// Sends `hello` on `chan` and takes the Welcome apart.
    pub fn greet(chan: Channel, hello: Request) -> Result<Client, Refused> {
        let (resp, mut files): (Response, Vec<File>) = chan.call(&hello, &[]).expect("hello");
        let welcome = match resp {
            Response::Welcome(w) => *w,
            Response::Refused { errno, reason } => return Err((errno, reason)),
            other => panic!("unexpected {other:?}"),
        };
        assert_eq!(files.len(), welcome.queues.len() + 3, "fds per Welcome");
        let notify = Channel::from(OwnedFd::from(files.pop().expect("notification channel")));
        let completion = files.pop().expect("completion eventfd");
        let doorbell = files.pop().expect("doorbell eventfd");
        let grant = welcome.queues[0];
        let layout = QueueLayout::new(grant.sq_depth, grant.cq_depth);
        let queues = files
            .into_iter()
            .map(|f| SharedMapping::map(f, 0, layout.bytes() as u64).expect("map queue"))
            .collect();
        Ok(Client {
            chan,
            lid: welcome.lid,
            grants: welcome.queues,
            queues,
            layout,
            doorbell,
            completion,
            notify,
            policy: welcome.policy,
        })
    }

    /// The next notification within `timeout`, if any.
    pub fn notification(&self, timeout: Duration) -> Option<Notification> {
        let mut pfd = libc::pollfd {
            fd: self.notify.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: pfd is one valid pollfd.
        let n = unsafe { libc::poll(&mut pfd, 1, timeout.as_millis() as i32) };
        if n <= 0 {
            return None;
        }
        let (note, _): (Notification, _) = self.notify.recv().expect("notification");
        Some(note)
    }

    pub fn pqp(&self, q: usize) -> u32 {
        self.grants[q].pqp
    }

    /// Sends a request; Ok or the refusal.
    pub fn call(&self, req: &Request) -> Result<(), Refused> {
        self.call_fds(req, &[])
    }

    pub fn call_fds(&self, req: &Request, fds: &[i32]) -> Result<(), Refused> {
        let (resp, _): (Response, Vec<File>) = self.chan.call(req, fds).expect("call");
        match resp {
            Response::Ok => Ok(()),
            Response::Refused { errno, reason } => Err((errno, reason)),
            other => panic!("unexpected {other:?}"),
        }
    }

    /// Adds a sealed memfd of `size` bytes as `slot`; returns our own
    /// mapping of it to check bytes.
    pub fn add_memory(&self, slot: u32, size: u64) -> SharedMapping {
        let file = sealed_memfd("client-mem", size).expect("memfd");
        self.call_fds(
            &Request::AddMemory {
                slot,
                gpa: 0x1_0000_0000 * u64::from(slot + 1),
                len: size,
                file_offset: 0,
            },
            &[file.as_raw_fd()],
        )
        .expect("add memory");
        SharedMapping::map(file, 0, size).expect("map own memory")
    }

    /// Registers `[iova, iova + len)` over slot `slot` at `offset`.
    #[allow(clippy::too_many_arguments)]
    pub fn register(
        &self,
        lkey: u32,
        rkey: u32,
        access: u32,
        iova: u64,
        slot: u32,
        offset: u64,
        len: u64,
    ) -> Result<(), Refused> {
        self.call(&Request::RegisterMr(MrRegistration {
            lkey,
            rkey,
            pd: 1,
            access,
            iova,
            len,
            segments: vec![MrSegment { slot, offset, len }],
        }))
    }

    pub fn create_qp(&self, vqpn: u32, q: usize) {
        self.call(&Request::CreateQp {
            vqpn,
            pd: 1,
            pqp: self.pqp(q),
        })
        .expect("create qp");
    }

    pub fn connect_qp(&self, vqpn: u32, dest_lid: u16, dest_qpn: u32) -> Result<(), Refused> {
        self.call(&Request::ConnectQp(QpConnection {
            vqpn,
            dest_lid,
            dest_qpn,
            access: access::QP_SUPPORTED,
            rnr_retry: 7,
            retry_cnt: 2,
            min_rnr_timer: 1,
        }))
    }

    /// Posts on queue `q` and rings the doorbell if hostd sleeps.
    pub fn post(&self, q: usize, wqe: &PhysWqe) {
        let sq: Ring<'_, PhysWqe> = Ring::new(&self.queues[q], self.layout.sq).expect("sq");
        let deadline = Instant::now() + Duration::from_secs(10);
        while !sq.push(wqe).expect("push") {
            assert!(Instant::now() < deadline, "submission ring stays full");
            std::thread::sleep(Duration::from_micros(100));
        }
        if sq.consumer_sleeping() {
            (&self.doorbell)
                .write_all(&1u64.to_ne_bytes())
                .expect("doorbell");
        }
    }

    /// Posts on queue `q` unless its submission ring is full.
    pub fn try_post(&self, q: usize, wqe: &PhysWqe) -> bool {
        let sq: Ring<'_, PhysWqe> = Ring::new(&self.queues[q], self.layout.sq).expect("sq");
        let pushed = sq.push(wqe).expect("push");
        if pushed && sq.consumer_sleeping() {
            (&self.doorbell)
                .write_all(&1u64.to_ne_bytes())
                .expect("doorbell");
        }
        pushed
    }

    /// Waits for `n` completions on queue `q`.
    pub fn poll(&self, q: usize, n: usize) -> Vec<PhysCqe> {
        let cq: Ring<'_, PhysCqe> = Ring::new(&self.queues[q], self.layout.cq).expect("cq");
        let mut out = Vec::new();
        let deadline = Instant::now() + Duration::from_secs(10);
        while out.len() < n {
            match cq.pop().expect("cq") {
                Some(cqe) => out.push(cqe),
                None => {
                    assert!(
                        Instant::now() < deadline,
                        "only {} of {n} completions: {out:?}",
                        out.len()
                    );
                    std::thread::sleep(Duration::from_micros(200));
                }
            }
        }
        out
    }

    /// Asserts nothing more arrives on queue `q` for a little while.
    pub fn quiet(&self, q: usize) {
        std::thread::sleep(Duration::from_millis(50));
        let cq: Ring<'_, PhysCqe> = Ring::new(&self.queues[q], self.layout.cq).expect("cq");
        assert_eq!(cq.pop().expect("cq"), None);
    }
}

pub fn sge(addr: u64, length: u32, lkey: u32) -> Sge {
    Sge {
        addr: addr.into(),
        length: length.into(),
        lkey: lkey.into(),
    }
}

pub fn send_wqe(token: u64, vqpn: u32, op: SendOpcode, sges: &[Sge]) -> PhysWqe {
    let mut wqe = PhysWqe {
        token: token.into(),
        kind: kind::SEND,
        opcode: op.into(),
        flags: send_flags::SIGNALED,
        vqpn: vqpn.into(),
        ..PhysWqe::default()
    };
    assert!(wqe.set_sges(sges));
    wqe
}

pub fn write_wqe(token: u64, vqpn: u32, local: Sge, addr: u64, rkey: u32) -> PhysWqe {
    let mut wqe = send_wqe(token, vqpn, SendOpcode::RdmaWrite, &[local]);
    wqe.remote_addr = addr.into();
    wqe.rkey = rkey.into();
    wqe
}

pub fn recv_wqe(token: u64, vqpn: u32, sges: &[Sge]) -> PhysWqe {
    let mut wqe = PhysWqe {
        token: token.into(),
        kind: kind::RECV,
        vqpn: vqpn.into(),
        ..PhysWqe::default()
    };
    assert!(wqe.set_sges(sges));
    wqe
}

pub fn read(mem: &SharedMapping, offset: usize, len: usize) -> Vec<u8> {
    let mut out = vec![0; len];
    assert!(mem.read(offset, &mut out));
    out
}

/// An unsealed memfd (which hostd must refuse to map).
pub fn unsealed_memfd(size: u64) -> File {
    let name = std::ffi::CString::new("unsealed").expect("name");
    // SAFETY: valid NUL-terminated name; the result is checked.
    let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
    assert!(fd >= 0);
    // SAFETY: a fresh descriptor we own.
    let file = unsafe { File::from_raw_fd(fd) };
    file.set_len(size).expect("size");
    file
}
