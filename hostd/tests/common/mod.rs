//! A test vdev and driver of one device, speaking hostd's protocol directly
//! to a real `hostd` process — the well-behaved vdev and, when a test
//! wants, the compromised one — and a handle on that process.
//!
//! [`Client`] is the vdev (Hello, memory, doorbell, event ring, CQ, MR,
//! QPs) and, once set up, the driver of its device: its guest memory is a
//! sealed memfd laid out as `vrdma_hostd::engine::testing` says, and it
//! posts through [`Driver`] (which writes the rings and sets the doorbell
//! bits) and kicks the doorbell eventfd when the page asks for it, as a
//! real driver does.

// Each test binary uses its part of this module.
#![allow(dead_code, unused_imports)]

use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};
use vrdma_hostd::engine::guest::SharedMapping;
use vrdma_hostd::engine::testing::{
    data_region_in, qp_setup, CAPS, CQ, CQ_DEPTH, DOORBELL, EQ, EQ_DEPTH, STRIDE,
};
pub use vrdma_hostd::engine::testing::{
    remote, send, sge, Driver, ALL, CQN, DATA, DATA_LEN, DEPTH, IOVA, MEM,
};
use vrdma_hostd_protocol::channel::Channel;
use vrdma_hostd_protocol::messages::{
    MrRegistration, MrSegment, Notification, QpConnection, QpModify, QpSetup, Request, Response,
    TenantPolicy, PROTOCOL_VERSION,
};
use vrdma_hostd_protocol::shm::sealed_memfd;
use vrdma_spec::ring::{doorbell, Cqe, SendWqe, Sge};
use vrdma_spec::verbs::{access, QpState, SendOpcode, WcStatus};

/// The loopback pair [`Client::loopback_works`] uses.
pub const PROBE_QPS: (u32, u32) = (10, 11);

/// How long a test waits for what must happen.
pub const DEADLINE: Duration = Duration::from_secs(10);

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
        let deadline = Instant::now() + DEADLINE;
        while Channel::connect(&hostd.socket).is_err() {
            assert!(Instant::now() < deadline, "hostd did not come up");
            std::thread::sleep(Duration::from_millis(10));
        }
        hostd
    }

    /// Starts a new hostd on the same configuration with `--take-over`
    /// and waits until the running one exited (0: it handed over); the new
    /// one is this hostd from then on.
    pub fn take_over(&mut self) -> std::process::ExitStatus {
        let next = Command::new(env!("CARGO_BIN_EXE_hostd"))
            .arg("--config")
            .arg(self.dir.join("hostd.toml"))
            .arg("--take-over")
            .env("VRDMA_LOG", "warn")
            .stdin(Stdio::null())
            .spawn()
            .expect("spawn the new hostd");
        let deadline = Instant::now() + DEADLINE;
        let status = loop {
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                break status;
            }
            assert!(
                Instant::now() < deadline,
                "the running hostd did not hand over"
            );
            std::thread::sleep(Duration::from_millis(5));
        };
        self.child = next;
        status
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
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

    /// CPU ticks hostd uses while `f` runs.
    pub fn ticks_during(&self, f: impl FnOnce()) -> u64 {
        let before = self.cpu_ticks();
        f();
        self.cpu_ticks() - before
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

/// hostd's test configuration: `physical_qps`, short polling (the datapath
/// sleeps 20 µs after its last work).
pub fn config(physical_qps: u32) -> String {
    format!("physical_qps = {physical_qps}\nspin_us = 20\n")
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

/// A refusal as (errno, reason).
pub type Refused = (i32, String);

/// The errno of a refusal.
pub fn errno<T>(r: Result<T, Refused>) -> Result<T, i32> {
    r.map_err(|e| e.0)
}

pub fn hello_request(tenant: &str, device: &str) -> Request {
    Request::Hello {
        version: PROTOCOL_VERSION,
        tenant: tenant.into(),
        device: device.into(),
    }
}

/// The device side a set-up client drives.
struct Device {
    driver: Driver,
    /// The doorbell queue's kick (hostd sleeps on it).
    kick: EventFd,
    /// Vector 0's interrupt (hostd signals it after writing an event).
    irq: EventFd,
    /// The data region's keys, once registered.
    keys: Option<(u32, u32)>,
}

/// A vdev connected to hostd and, once set up, the driver of its device.
pub struct Client {
    pub chan: Channel,
    pub lid: u16,
    /// The device's GID (what peers connect to).
    pub gid: [u8; 16],
    pub physical_queues: u32,
    /// The notification channel (hostd → vdev).
    pub notify: Channel,
    /// The tenant's policy from the Welcome.
    pub policy: TenantPolicy,
    device: Option<Device>,
    /// Doorbell kicks sent because the page asked for one.
    pub kicks: u64,
}

impl Client {
    /// Connects and greets; the refusal if hostd says no.
    pub fn hello(socket: &Path, tenant: &str, device: &str) -> Result<Client, Refused> {
        let chan = Channel::connect(socket).expect("connect");
        Client::greet(chan, hello_request(tenant, device))
    }

    /// Connects and opens a context of the device (`OpenContext`).
    pub fn context(socket: &Path, tenant: &str, device: &str) -> Result<Client, Refused> {
        let chan = Channel::connect(socket).expect("connect");
        let open = Request::OpenContext {
            version: PROTOCOL_VERSION,
            tenant: tenant.into(),
            device: device.into(),
        };
        Client::greet(chan, open)
    }

    /// Connects, greets and sets the device up ([`Client::setup`]).
    pub fn ready(socket: &Path, tenant: &str, device: &str) -> Client {
        let mut c = Client::hello(socket, tenant, device).expect("hello");
        c.setup();
        c
    }

    /// Sends `hello` on `chan` and takes the Welcome apart.
    pub fn greet(chan: Channel, hello: Request) -> Result<Client, Refused> {
        let (resp, mut files): (Response, Vec<File>) = chan.call(&hello, &[]).expect("hello");
        let welcome = match resp {
            Response::Welcome(w) => *w,
            Response::Refused { errno, reason } => return Err((errno, reason)),
            other => panic!("unexpected {other:?}"),
        };
        assert_eq!(files.len(), 1, "a Welcome carries the notification channel");
        let notify = Channel::from(OwnedFd::from(files.remove(0)));
        Ok(Client {
            chan,
            lid: welcome.lid,
            gid: welcome.gid,
            physical_queues: welcome.physical_queues,
            notify,
            policy: welcome.policy,
            device: None,
            kicks: 0,
        })
    }

    /// Sets the device up as a driver does: [`MEM`] bytes of guest memory
    /// ([`Client::attach_memory`]), its rings ([`Client::rings`]) and the
    /// data region registered.
    pub fn setup(&mut self) {
        self.setup_sized(MEM);
    }

    /// [`Client::setup`] with `mem` bytes of memory (a longer data region).
    pub fn setup_sized(&mut self, mem: u64) {
        self.attach_memory(mem);
        self.rings();
        self.register_data();
    }

    /// Registers the data region of the device's memory; its keys are
    /// [`Client::lkey`] and [`Client::rkey`] from now on.
    pub fn register_data(&mut self) {
        let mem = self.driver().mem.len() as u64;
        let keys = self.register_mr(data_region_in(mem)).expect("data region");
        self.device_mut().keys = Some(keys);
    }

    /// The driver resets the device (ResetDevice) and starts over: its
    /// memory stays, its rings, QPs and keys are gone (set it up again
    /// with [`Client::rings`] and [`Client::register_data`]).
    pub fn reset(&mut self) {
        self.call(&Request::ResetDevice).expect("reset");
        let old = self.device.take().expect("the device is set up");
        self.device = Some(Device {
            driver: Driver::new(old.driver.mem),
            keys: None,
            ..old
        });
    }

    /// Adds a sealed memfd of `mem` bytes as slot 0 at guest address 0:
    /// the device's guest memory, which its driver then uses.
    pub fn attach_memory(&mut self, mem: u64) {
        let map = self.add_memory(0, 0, mem);
        self.device = Some(Device {
            driver: Driver::new(map),
            kick: EventFd::new(EFD_NONBLOCK).expect("eventfd"),
            irq: EventFd::new(EFD_NONBLOCK).expect("eventfd"),
            keys: None,
        });
    }

    /// The doorbell page, the event ring of vector 0 and the CQ, where the
    /// layout puts them.
    pub fn rings(&mut self) {
        let (kick, irq) = {
            let d = self.device();
            (d.kick.as_raw_fd(), d.irq.as_raw_fd())
        };
        self.call_fds(&Request::SetDoorbell { gpa: DOORBELL }, &[kick])
            .expect("doorbell");
        let eq = Request::CreateEq {
            vector: 0,
            gpa: EQ,
            depth: EQ_DEPTH,
        };
        self.call_fds(&eq, &[irq]).expect("event ring");
        self.call(&Request::CreateCq {
            cqn: CQN,
            gpa: CQ,
            depth: CQ_DEPTH,
            vector: 0,
        })
        .expect("cq");
    }

    fn device(&self) -> &Device {
        self.device.as_ref().expect("the device is set up")
    }

    fn device_mut(&mut self) -> &mut Device {
        self.device.as_mut().expect("the device is set up")
    }

    /// The device's driver (its guest memory and rings).
    pub fn driver(&self) -> &Driver {
        &self.device().driver
    }

    pub fn driver_mut(&mut self) -> &mut Driver {
        &mut self.device_mut().driver
    }

    /// The data region's lkey.
    pub fn lkey(&self) -> u32 {
        self.device().keys.expect("data region registered").0
    }

    /// The data region's rkey.
    pub fn rkey(&self) -> u32 {
        self.device().keys.expect("data region registered").1
    }

    /// Vector 0's interrupt count since the last read (0 if none).
    pub fn interrupts(&self) -> u64 {
        self.device().irq.read().unwrap_or(0)
    }

    /// Takes every event of the event ring of vector 0: (kind, object).
    pub fn events(&mut self) -> Vec<(u16, u32)> {
        self.driver_mut().events()
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

    /// Sends a request with `fds`; hostd's response.
    pub fn request(&self, req: &Request, fds: &[i32]) -> Response {
        let (resp, files): (Response, Vec<File>) = self.chan.call(req, fds).expect("call");
        assert!(files.is_empty(), "only a Welcome carries fds");
        resp
    }

    /// Sends a request; Ok or the refusal.
    pub fn call(&self, req: &Request) -> Result<(), Refused> {
        self.call_fds(req, &[])
    }

    pub fn call_fds(&self, req: &Request, fds: &[i32]) -> Result<(), Refused> {
        match self.request(req, fds) {
            Response::Ok => Ok(()),
            Response::Refused { errno, reason } => Err((errno, reason)),
            other => panic!("unexpected {other:?}"),
        }
    }

    /// Adds a sealed memfd of `size` bytes as `slot` at guest address
    /// `gpa`; returns our own mapping of it.
    pub fn add_memory(&self, slot: u32, gpa: u64, size: u64) -> SharedMapping {
        let file = sealed_memfd("client-mem", size).expect("memfd");
        let add = Request::AddMemory {
            slot,
            gpa,
            len: size,
            file_offset: 0,
        };
        self.call_fds(&add, &[file.as_raw_fd()])
            .expect("add memory");
        SharedMapping::map(file, 0, size).expect("map own memory")
    }

    /// Registers a memory region; the keys hostd assigned or the refusal.
    pub fn register_mr(&self, reg: MrRegistration) -> Result<(u32, u32), Refused> {
        match self.request(&Request::RegisterMr(reg), &[]) {
            Response::MrKeys { lkey, rkey } => Ok((lkey, rkey)),
            Response::Refused { errno, reason } => Err((errno, reason)),
            other => panic!("unexpected {other:?}"),
        }
    }

    /// Registers `[iova, iova + len)` over slot `slot` at `offset`.
    pub fn register(
        &self,
        access: u32,
        iova: u64,
        slot: u32,
        offset: u64,
        len: u64,
    ) -> Result<(u32, u32), Refused> {
        self.register_mr(MrRegistration {
            pd: 1,
            access,
            iova,
            len,
            segments: vec![MrSegment { slot, offset, len }],
        })
    }

    /// The setup of this device's next QP, numbered `vqpn`.
    pub fn next_qp(&self, vqpn: u32) -> QpSetup {
        qp_setup(self.driver().qps.len(), vqpn, CAPS, DEPTH, STRIDE)
    }

    /// Creates QP `vqpn` with rings where the layout puts its next QP;
    /// returns its index for the driver.
    pub fn create_qp(&mut self, vqpn: u32) -> usize {
        let setup = self.next_qp(vqpn);
        self.call(&Request::CreateQp(setup)).expect("create qp");
        self.driver_mut().add_qp(&setup)
    }

    /// Moves QP `vqpn` to `state` (with `connection` at RTR and RTS).
    pub fn modify(
        &self,
        vqpn: u32,
        state: QpState,
        connection: Option<QpConnection>,
    ) -> Result<(), Refused> {
        self.call(&Request::ModifyQp(QpModify {
            vqpn,
            state: state.into(),
            connection,
            access: None,
            qkey: None,
        }))
    }

    /// INIT, RTR and RTS towards QP `dest_qpn` of GID `dest_gid`, with
    /// infinite RNR retries, 2 transport retries and a 10 µs RNR timer.
    pub fn connect_qp(&self, vqpn: u32, dest_gid: [u8; 16], dest_qpn: u32) -> Result<(), Refused> {
        self.connect_with(vqpn, connection(dest_gid, dest_qpn))
    }

    /// INIT, RTR and RTS with `conn`.
    pub fn connect_with(&self, vqpn: u32, conn: QpConnection) -> Result<(), Refused> {
        self.modify(vqpn, QpState::Init, None)?;
        self.modify(vqpn, QpState::Rtr, Some(conn))?;
        self.modify(vqpn, QpState::Rts, Some(conn))
    }

    /// RESET, then connected again as [`Client::connect_qp`] does.
    pub fn reconnect(&self, vqpn: u32, dest_gid: [u8; 16], dest_qpn: u32) {
        self.modify(vqpn, QpState::Reset, None).expect("reset");
        self.connect_qp(vqpn, dest_gid, dest_qpn)
            .expect("reconnect");
    }

    /// The state of QP `vqpn` as hostd's datapath sees it.
    pub fn query_qp(&self, vqpn: u32) -> Result<QpState, Refused> {
        match self.request(&Request::QueryQp { vqpn }, &[]) {
            Response::QpState { state } => Ok(QpState::try_from(state).expect("a QP state")),
            Response::Refused { errno, reason } => Err((errno, reason)),
            other => panic!("unexpected {other:?}"),
        }
    }

    /// Another descriptor of the doorbell queue's kick eventfd (as the VMM,
    /// which owns it, keeps one when a vdev goes).
    pub fn kick_fd(&self) -> EventFd {
        self.device().kick.try_clone().expect("dup")
    }

    /// Notifies the doorbell queue if the device asked for it (it sleeps),
    /// as a driver does after ringing; returns whether it did.
    pub fn kick_if_needed(&mut self) -> bool {
        if !self.driver().needs_kick() {
            return false;
        }
        self.device().kick.write(1).expect("kick");
        self.kicks += 1;
        true
    }

    /// Posts `wqe` gathering from `sges` on QP `qp` unless its send ring
    /// is full (a driver's post fails then); rings and kicks.
    pub fn try_post_sges(&mut self, qp: usize, wqe: &SendWqe, sges: &[Sge]) -> bool {
        if self.driver().sq_free(qp) == 0 {
            return false;
        }
        self.driver_mut().post_sges(qp, wqe, sges);
        self.kick_if_needed();
        true
    }

    /// Posts `wqe` gathering from `sges` on QP `qp`, waiting for a free
    /// slot of its send ring.
    pub fn post_sges(&mut self, qp: usize, wqe: &SendWqe, sges: &[Sge]) {
        let deadline = Instant::now() + DEADLINE;
        while !self.try_post_sges(qp, wqe, sges) {
            assert!(Instant::now() < deadline, "send ring of QP {qp} stays full");
            std::thread::sleep(Duration::from_micros(100));
        }
    }

    /// Posts `wqe` with inline `payload` on QP `qp` (the ring has room).
    pub fn post_inline(&mut self, qp: usize, wqe: &SendWqe, payload: &[u8]) {
        assert!(
            self.driver().sq_free(qp) > 0,
            "send ring of QP {qp} is full"
        );
        self.driver_mut().post_send(qp, wqe, payload);
        self.kick_if_needed();
    }

    /// Posts a receive of `sges` on QP `qp`.
    pub fn post_recv(&mut self, qp: usize, wr_id: u64, sges: &[Sge]) {
        self.driver_mut().post_recv(qp, wr_id, sges);
        self.kick_if_needed();
    }

    /// A WRITE on QP `qp` of `len` bytes at `local` of the data region to
    /// `remote_addr` under `rkey`.
    pub fn write(
        &mut self,
        qp: usize,
        wr_id: u64,
        local: u64,
        len: u32,
        remote_addr: u64,
        rkey: u32,
    ) {
        let lkey = self.lkey();
        let wqe = remote(send(wr_id, SendOpcode::RdmaWrite), remote_addr, rkey);
        self.post_sges(qp, &wqe, &[sge(IOVA + local, len, lkey)]);
    }

    /// `count` [`Client::write`]s of the same bytes, work requests 0 to
    /// `count - 1`, posted without waiting for any.
    pub fn write_many(
        &mut self,
        qp: usize,
        count: u64,
        local: u64,
        len: u32,
        remote_addr: u64,
        rkey: u32,
    ) {
        for wr_id in 0..count {
            self.write(qp, wr_id, local, len, remote_addr, rkey);
        }
    }

    /// Waits (at most [`DEADLINE`]) for `n` completions.
    pub fn poll(&mut self, n: usize) -> Vec<Cqe> {
        let mut out = Vec::new();
        let deadline = Instant::now() + DEADLINE;
        while out.len() < n {
            let before = out.len();
            self.driver_mut().poll_each(|c| out.push(c));
            if out.len() == before {
                assert!(
                    Instant::now() < deadline,
                    "only {} of {n} completions: {out:?}",
                    out.len()
                );
                std::thread::sleep(Duration::from_micros(200));
            }
        }
        assert_eq!(out.len(), n, "more completions than awaited: {out:?}");
        out
    }

    /// The status of the one completion that must arrive next.
    pub fn poll_one(&mut self) -> WcStatus {
        status(&self.poll(1)[0])
    }

    /// Asserts nothing more completes for a little while.
    pub fn quiet(&mut self) {
        std::thread::sleep(Duration::from_millis(50));
        let late = self.driver_mut().poll();
        assert!(late.is_empty(), "unexpected completions: {late:?}");
    }

    /// Creates QPs `a` and `b` connected to each other (a loopback pair);
    /// returns the index of `a`.
    pub fn loopback(&mut self, a: u32, b: u32) -> usize {
        let qa = self.create_qp(a);
        self.create_qp(b);
        self.connect_qp(a, self.gid, b).expect("connect loopback");
        self.connect_qp(b, self.gid, a).expect("connect loopback");
        qa
    }

    /// Writes `token` from byte `at` of the data region to byte `at + 8`
    /// through the loopback QP `qp`, and checks it landed.
    pub fn loopback_write_works(&mut self, qp: usize, at: u64, token: u64) {
        let data = token.to_le_bytes();
        self.driver().fill(at, &data);
        let rkey = self.rkey();
        self.write(qp, token, at, 8, IOVA + at + 8, rkey);
        let cqe = self.poll(1)[0];
        assert_eq!((cqe.wr_id.get(), status(&cqe)), (token, WcStatus::Success));
        assert_eq!(self.driver().bytes(at + 8, 8), data);
    }

    /// Proof that the device works: `token` written through a loopback
    /// pair (QPs [`PROBE_QPS`], created on first use).
    pub fn loopback_works(&mut self, token: u64) {
        let (a, b) = PROBE_QPS;
        let qp = match self.driver().qps.iter().position(|q| q.vqpn == a) {
            Some(qp) => qp,
            None => self.loopback(a, b),
        };
        self.loopback_write_works(qp, 0x100, token);
    }
}

/// All of `c`'s guest memory but the doorbell page, where hostd plays
/// the device's side of the doorbell protocol whatever else happens: it
/// raises and clears NEED_KICK as its datapath sleeps and wakes, and
/// clears the bits it takes (also of a QP that is gone).
pub fn memory_of(c: &Client) -> Vec<u8> {
    let mut all = vec![0; c.driver().mem.len()];
    assert!(c.driver().mem.read(0, &mut all));
    let page = DOORBELL as usize..(DOORBELL + doorbell::PAGE_SIZE) as usize;
    all[page].fill(0);
    all
}

/// The first offset at which `now` differs from `before`.
pub fn first_change(before: &[u8], now: &[u8]) -> Option<usize> {
    assert_eq!(before.len(), now.len());
    if before == now {
        return None;
    }
    before.iter().zip(now).position(|(a, b)| a != b)
}

/// The QPs of a [`pair`].
pub const QP_ALPHA: u32 = 1;
pub const QP_BETA: u32 = 2;

/// alpha and beta (in the standard [`policy`]), set up, each with one QP
/// (index 0: [`QP_ALPHA`], [`QP_BETA`]) connected to the other's.
pub fn pair(socket: &Path) -> (Client, Client) {
    pair_with(socket, MEM, connection([0; 16], 0).min_rnr_timer)
}

/// [`pair`] with `mem` bytes of memory each ([`Client::setup_sized`]) and
/// beta's QP advertising RNR timer code `beta_rnr_timer` as responder (how
/// long alpha's SENDs wait when beta has no receive).
pub fn pair_with(socket: &Path, mem: u64, beta_rnr_timer: u8) -> (Client, Client) {
    let ready = |tenant| {
        let mut c = Client::hello(socket, tenant, "vm0").expect("hello");
        c.setup_sized(mem);
        c
    };
    let (mut alpha, mut beta) = (ready("alpha"), ready("beta"));
    assert_ne!(alpha.gid, beta.gid);
    alpha.create_qp(QP_ALPHA);
    beta.create_qp(QP_BETA);
    (alpha.connect_qp(QP_ALPHA, beta.gid, QP_BETA)).expect("connect alpha");
    let responder = QpConnection {
        min_rnr_timer: beta_rnr_timer,
        ..connection(alpha.gid, QP_ALPHA)
    };
    (beta.connect_with(QP_BETA, responder)).expect("connect beta");
    (alpha, beta)
}

/// How the tests connect QPs: the engine tests' connection (infinite RNR
/// retries, a 10 µs RNR timer) with 2 transport retries.
pub fn connection(dest_gid: [u8; 16], dest_qpn: u32) -> QpConnection {
    QpConnection {
        retry_cnt: 2,
        ..vrdma_hostd::engine::testing::connection(dest_gid, dest_qpn)
    }
}

pub fn status(c: &Cqe) -> WcStatus {
    WcStatus::try_from(c.status).expect("valid status")
}

/// Retries `f` while it is refused (teardown of a predecessor is async).
pub fn retry<T>(mut f: impl FnMut() -> Result<T, Refused>) -> T {
    let deadline = Instant::now() + DEADLINE;
    loop {
        match f() {
            Ok(v) => return v,
            Err(e) => {
                assert!(Instant::now() < deadline, "still refused: {e:?}");
                std::thread::sleep(Duration::from_millis(10));
            }
        }
    }
}

/// Retries `f` until it holds (teardown and reload are asynchronous).
pub fn eventually(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + DEADLINE;
    while !f() {
        assert!(Instant::now() < deadline, "never: {what}");
        std::thread::sleep(Duration::from_millis(10));
    }
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
