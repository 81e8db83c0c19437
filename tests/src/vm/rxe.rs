//! A guest running Linux Soft-RoCE, for vrdma's interoperability tests.
//!
//! [`RxeGuest::boot`] starts a QEMU guest (Debian trixie's kernel, TCG)
//! whose only NIC is a tap device in a network namespace the test owns:
//! the host side of the tap is [`HOST_ADDR`], the guest's eth0
//! [`GUEST_ADDR`], and nothing the guest sends leaves that namespace. The
//! guest loads `rdma_rxe` (with `ib_uverbs` and `rdma_ucm`) and carries
//! Debian's unmodified RDMA userland from the prepared guest tree:
//! libibverbs with the rxe provider, ibverbs-utils, perftest, rdmacm-utils,
//! iproute2's `rdma` and netcat-openbsd ([`PROGRAMS`]).
//!
//! The test drives the guest through a small agent: the guest's shell
//! asks the test for its next command over HTTP on the tap
//! (`wget http://10.99.0.1:PORT/next`), runs it in the background in a
//! session of its own, and posts back its exit status, stdout and stderr.
//! [`RxeGuest::run`] runs a command to its end; [`RxeGuest::spawn`] starts
//! one (a server) to [`RxeGuest::wait`] for or [`RxeGuest::kill`] later.
//! [`RxeGuest::add_rxe`] creates `rxe0` on eth0 and finds its RoCEv2 GID.
//! [`RoceCapture`] reads the RoCEv2 packets that reach the namespace's
//! host side.
//!
//! docs/vm.md ("The Soft-RoCE guest") tells how to run it by hand.

use std::collections::{HashMap, VecDeque};
use std::io::{Read, Write};
use std::net::{Ipv4Addr, TcpListener, TcpStream};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::{netns_path, Guest, GuestConfig, Nic, VmError, VmImage};

/// The host side of the tap, in the test's network namespace.
pub const HOST_ADDR: Ipv4Addr = Ipv4Addr::new(10, 99, 0, 1);
/// The guest's eth0, on which `rxe0` runs.
pub const GUEST_ADDR: Ipv4Addr = Ipv4Addr::new(10, 99, 0, 2);
/// Prefix length of the tap's network.
pub const PREFIX_LEN: u8 = 24;
/// The tap device's name in the namespace.
pub const TAP: &str = "vrdma-rxe";
/// The rxe device [`RxeGuest::add_rxe`] creates.
pub const RXE_DEVICE: &str = "rxe0";
/// RoCEv2's UDP destination port.
pub const ROCE_V2_PORT: u16 = 4791;

/// Debian's programs (and the rxe provider) packed into the guest, from
/// the prepared guest tree, with every shared library they need.
pub const PROGRAMS: &[&str] = &[
    "/usr/bin/ibv_devinfo",
    "/usr/bin/ibv_devices",
    "/usr/bin/ibv_rc_pingpong",
    "/usr/bin/ibv_ud_pingpong",
    "/usr/bin/ibv_uc_pingpong",
    "/usr/bin/ib_write_bw",
    "/usr/bin/ib_read_bw",
    "/usr/bin/ib_send_bw",
    "/usr/bin/ib_atomic_bw",
    "/usr/bin/ib_write_lat",
    "/usr/bin/ib_read_lat",
    "/usr/bin/ib_send_lat",
    "/usr/bin/rping",
    "/usr/bin/ucmatose",
    "/usr/bin/rdma",
    "/usr/bin/nc.openbsd",
    // libibverbs dlopens its providers from here, as /etc/libibverbs.d says.
    "/usr/lib/x86_64-linux-gnu/libibverbs/librxe-rdmav34.so",
    // glibc dlopens it for pthread_exit's unwinding (rping's threads
    // exit that way): "libgcc_s.so.1 must be installed for pthread_exit
    // to work", then abort.
    "/usr/lib/x86_64-linux-gnu/libgcc_s.so.1",
];
/// Plain files from the guest tree: `driver rxe`, which makes libibverbs
/// load the rxe provider.
pub const FILES: &[&str] = &["/etc/libibverbs.d/rxe.driver"];
/// Kernel modules beyond the base ones (their dependencies follow from
/// modules.dep: ib_core, ib_uverbs, udp_tunnel, ip6_udp_tunnel, rdma_cm,
/// ...). crc32_generic is none of theirs: rxe asks the crypto API for the
/// "crc32" hash when a device registers (its ICRC), which would load the
/// module through modprobe, and the initramfs has none (`rdma link add`
/// then fails with ENOENT).
pub const MODULES: &[&str] = &["crc32_generic", "rdma_rxe", "rdma_ucm"];

/// Boot to the agent, under TCG on a loaded 2-core machine.
const BOOT: Duration = Duration::from_secs(120);
/// How long the agent holds a request for the next command open.
const HOLD: Duration = Duration::from_secs(5);

/// What a guest command did: its exit code (128 + N for signal N, as the
/// guest's shell reports it), stdout and stderr.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Output {
    pub code: i32,
    pub stdout: String,
    pub stderr: String,
}

impl Output {
    /// Exit code 0.
    pub fn success(&self) -> bool {
        self.code == 0
    }
}

impl std::fmt::Display for Output {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "exit code {}\n--- stdout ---\n{}--- stderr ---\n{}",
            self.code, self.stdout, self.stderr
        )
    }
}

/// A command started in the guest with [`RxeGuest::spawn`].
#[derive(Debug)]
pub struct GuestProcess {
    id: u64,
    command: String,
}

impl GuestProcess {
    /// The command line it runs.
    pub fn command(&self) -> &str {
        &self.command
    }
}

/// An rxe device in the guest.
#[derive(Debug, Clone)]
pub struct RxeDevice {
    /// Its name (`rxe0`).
    pub name: String,
    /// The index of its RoCEv2 GID `::ffff:10.99.0.2` (`ibv_rc_pingpong -g`,
    /// perftest `-x`).
    pub gid_index: u32,
    /// `ibv_devinfo -v -d NAME` once the port was active with that GID.
    pub devinfo: String,
}

/// The index of the RoCEv2 GID that is IPv4 address `addr` in the output
/// of `ibv_devinfo -v` (`GID[  3]:  ::ffff:10.99.0.2, RoCE v2`).
pub fn roce_v2_gid_index(devinfo: &str, addr: Ipv4Addr) -> Option<u32> {
    let wanted = format!("::ffff:{addr}, RoCE v2");
    devinfo.lines().find_map(|line| {
        let line = line.trim();
        let (index, gid) = line.strip_prefix("GID[")?.split_once("]:")?;
        (gid.trim() == wanted)
            .then(|| index.trim().parse().ok())
            .flatten()
    })
}

/// A Soft-RoCE guest on a tap in a network namespace; QEMU is killed and
/// the tap removed on drop (the namespace is the caller's).
pub struct RxeGuest {
    // Dropped in declaration order: QEMU, then the agent, then the tap.
    guest: Guest,
    agent: Agent,
    _tap: Tap,
    netns: String,
}

impl RxeGuest {
    /// Boots the guest with its NIC on a new tap [`TAP`] in network
    /// namespace `netns` (a name under /run/netns, e.g. from
    /// [`Netns::create`]), which gets [`HOST_ADDR`]/24; returns once the
    /// guest's agent asks for commands. Loads rdma_rxe but creates no rxe
    /// device ([`RxeGuest::add_rxe`]).
    pub fn boot(image: &VmImage, netns: &str) -> Result<Self, VmError> {
        let tap = Tap::create(netns)?;
        let listener =
            in_netns(netns, || TcpListener::bind((HOST_ADDR, 0)))?.map_err(|e| VmError::Netns {
                netns: netns.into(),
                what: format!("cannot listen on {HOST_ADDR}: {e}"),
            })?;
        let agent = Agent::start(listener)?;
        let mut initramfs = image
            .initramfs()
            .eth0(&format!("{GUEST_ADDR}/{PREFIX_LEN}"), None)
            .script(&agent_script(agent.port));
        for module in MODULES {
            initramfs = initramfs.module(module);
        }
        for program in PROGRAMS {
            initramfs = initramfs.guest_program(program);
        }
        for file in FILES {
            initramfs = initramfs.guest_file(file);
        }
        let config = GuestConfig {
            nic: Nic::Tap {
                netns: netns.into(),
                ifname: TAP.into(),
            },
            ..GuestConfig::default()
        };
        let mut guest = Guest::boot(image, initramfs, &config)?;
        guest.wait_for("VRDMA-AGENT up", BOOT)?;
        if !agent.wait_polled(BOOT) {
            return Err(guest.error("The guest's agent never asked for a command"));
        }
        Ok(RxeGuest {
            guest,
            agent,
            _tap: tap,
            netns: netns.into(),
        })
    }

    /// The QEMU guest (console, QMP, command line).
    pub fn guest(&self) -> &Guest {
        &self.guest
    }

    /// The network namespace of the tap.
    pub fn netns(&self) -> &str {
        &self.netns
    }

    /// Adds `address`/24 to the host side of the tap, next to
    /// [`HOST_ADDR`]: a local address the guest reaches directly (e.g. the
    /// GID of a vrdma device whose hostd runs in the namespace). It goes
    /// with the tap.
    pub fn add_host_address(&self, address: Ipv4Addr) -> Result<(), VmError> {
        let cidr = format!("{address}/{PREFIX_LEN}");
        ip(
            &self.netns,
            &["-n", &self.netns, "addr", "add", &cidr, "dev", TAP],
        )
    }

    /// Starts shell command `command` in the guest (`sh` runs it, with
    /// stdin from /dev/null, in a session of its own).
    pub fn spawn(&self, command: &str) -> GuestProcess {
        GuestProcess {
            id: self.agent.submit(command),
            command: command.into(),
        }
    }

    /// What `process` did, if it has ended.
    pub fn finished(&self, process: &GuestProcess) -> Option<Output> {
        self.agent.lock().done.get(&process.id).cloned()
    }

    /// Waits up to `timeout` for `process` to end.
    pub fn wait(&self, process: &GuestProcess, timeout: Duration) -> Result<Output, VmError> {
        self.agent.wait(process.id, timeout).ok_or_else(|| {
            self.guest.error(format!(
                "`{}` did not end in the guest within {timeout:?}",
                process.command
            ))
        })
    }

    /// Kills `process` and everything it started (SIGKILL to its session);
    /// [`RxeGuest::wait`] then gives exit code 137.
    pub fn kill(&self, process: &GuestProcess) -> Result<(), VmError> {
        let id = process.id;
        self.run(
            &format!("kill -9 -$(cat /tmp/jobs/{id}.pid)"),
            Duration::from_secs(30),
        )
        .map(drop)
    }

    /// Runs `command` in the guest to its end (at most `timeout`, after
    /// which it is killed and this fails).
    pub fn run(&self, command: &str, timeout: Duration) -> Result<Output, VmError> {
        let process = self.spawn(command);
        let result = self.wait(&process, timeout);
        if result.is_err() {
            let id = process.id;
            let _ = self
                .agent
                .submit(&format!("kill -9 -$(cat /tmp/jobs/{id}.pid)"));
        }
        result
    }

    /// Like [`RxeGuest::run`], failing unless the command exits 0.
    pub fn run_ok(&self, command: &str, timeout: Duration) -> Result<Output, VmError> {
        let out = self.run(command, timeout)?;
        if out.success() {
            Ok(out)
        } else {
            Err(self
                .guest
                .error(format!("`{command}` failed in the guest: {out}")))
        }
    }

    /// Waits until something in the guest listens on TCP or UDP `port` (a
    /// server started with [`RxeGuest::spawn`]), up to `timeout`.
    pub fn wait_listening(&self, port: u16, timeout: Duration) -> Result<(), VmError> {
        let secs = timeout.as_secs().max(1) * 10;
        self.run_ok(
            &format!(
                "i=0; until netstat -ltun | grep -q ':{port} '; do \
                 i=$((i+1)); [ $i -gt {secs} ] && exit 1; sleep 0.1; done"
            ),
            timeout + Duration::from_secs(30),
        )
        .map(drop)
    }

    /// Creates [`RXE_DEVICE`] on eth0 (`rdma link add rxe0 type rxe netdev
    /// eth0`) and waits until its port is active with the RoCEv2 GID of
    /// [`GUEST_ADDR`].
    pub fn add_rxe(&self) -> Result<RxeDevice, VmError> {
        let step = Duration::from_secs(60);
        self.run_ok(
            &format!("rdma link add {RXE_DEVICE} type rxe netdev eth0"),
            step,
        )?;
        let deadline = Instant::now() + step;
        loop {
            let out = self.run_ok(&format!("ibv_devinfo -v -d {RXE_DEVICE}"), step)?;
            let active = out.stdout.contains("PORT_ACTIVE");
            if let (true, Some(gid_index)) = (active, roce_v2_gid_index(&out.stdout, GUEST_ADDR)) {
                return Ok(RxeDevice {
                    name: RXE_DEVICE.into(),
                    gid_index,
                    devinfo: out.stdout,
                });
            }
            if Instant::now() >= deadline {
                return Err(self.guest.error(format!(
                    "{RXE_DEVICE} has no active port with GID ::ffff:{GUEST_ADDR} (RoCE v2) \
                     after {step:?}:\n{out}"
                )));
            }
            std::thread::sleep(Duration::from_millis(500));
        }
    }
}

/// The guest's side of the agent: fetch a command, run it in the
/// background, post its result; again.
fn agent_script(port: u16) -> String {
    format!(
        r#"AGENT=http://{HOST_ADDR}:{port}
mkdir -p /tmp/jobs
# Runs job $1 (/tmp/jobs/$1.sh) in a session of its own (its pid, which
# is its process group, in $1.pid for kill -9 -PID) and posts
# "CODE STDOUT_LEN STDERR_LEN\n" STDOUT STDERR to the host.
vrdma_job() {{
    j=/tmp/jobs/$1
    setsid sh -c 'echo $$ > "$0.pid"; exec sh "$0.sh"' "$j" </dev/null >"$j.out" 2>"$j.err"
    rc=$?
    echo "VRDMA-AGENT job $1 exit $rc"
    {{ echo "$rc $(wc -c < "$j.out") $(wc -c < "$j.err")"; cat "$j.out" "$j.err"; }} > "$j.result"
    until wget -q -T 60 -O /dev/null --post-file "$j.result" "$AGENT/done/$1"; do sleep 1; done
}}
echo "VRDMA-AGENT up"
while :; do
    if wget -q -T 60 -O /tmp/jobs/next "$AGENT/next"; then
        if [ -s /tmp/jobs/next ]; then
            id=$(head -n 1 /tmp/jobs/next)
            tail -n +2 /tmp/jobs/next > /tmp/jobs/$id.sh
            echo "VRDMA-AGENT job $id: $(head -n 1 /tmp/jobs/$id.sh)"
            vrdma_job "$id" &
        fi
    else
        sleep 1
    fi
done
"#
    )
}

/// The host's side of the agent: an HTTP server on the tap (one thread
/// per request), a queue of commands and the results posted back.
struct Agent {
    shared: Arc<Shared>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
    port: u16,
}

#[derive(Default)]
struct Shared {
    state: Mutex<State>,
    changed: Condvar,
}

#[derive(Default)]
struct State {
    next_id: u64,
    queue: VecDeque<(u64, String)>,
    done: HashMap<u64, Output>,
    /// Requests for commands so far: the guest's agent is up once one came.
    polls: u64,
    stopping: bool,
}

impl Agent {
    fn start(listener: TcpListener) -> Result<Self, VmError> {
        let io = |e: std::io::Error| VmError::Netns {
            netns: String::new(),
            what: format!("agent listener: {e}"),
        };
        let port = listener.local_addr().map_err(io)?.port();
        listener.set_nonblocking(true).map_err(io)?;
        let shared = Arc::new(Shared::default());
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let (shared, stop) = (Arc::clone(&shared), Arc::clone(&stop));
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    match listener.accept() {
                        Ok((stream, _)) => {
                            let shared = Arc::clone(&shared);
                            std::thread::spawn(move || {
                                if let Err(e) = serve(stream, &shared) {
                                    eprintln!("rxe guest agent: {e}");
                                }
                            });
                        }
                        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                            std::thread::sleep(Duration::from_millis(20));
                        }
                        Err(e) => {
                            eprintln!("rxe guest agent: accept: {e}");
                            std::thread::sleep(Duration::from_millis(100));
                        }
                    }
                }
            })
        };
        Ok(Agent {
            shared,
            stop,
            thread: Some(thread),
            port,
        })
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.shared.lock()
    }

    fn submit(&self, command: &str) -> u64 {
        let mut state = self.lock();
        state.next_id += 1;
        let id = state.next_id;
        state.queue.push_back((id, command.into()));
        self.shared.changed.notify_all();
        id
    }

    fn wait(&self, id: u64, timeout: Duration) -> Option<Output> {
        let deadline = Instant::now() + timeout;
        let mut state = self.lock();
        loop {
            if let Some(out) = state.done.get(&id) {
                return Some(out.clone());
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return None;
            }
            state = self.shared.wait(state, left);
        }
    }

    fn wait_polled(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        let mut state = self.lock();
        while state.polls == 0 {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            state = self.shared.wait(state, left);
        }
        true
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        self.lock().stopping = true;
        self.shared.changed.notify_all();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn wait<'a>(&self, guard: MutexGuard<'a, State>, left: Duration) -> MutexGuard<'a, State> {
        match self.changed.wait_timeout(guard, left) {
            Ok((guard, _)) => guard,
            Err(e) => e.into_inner().0,
        }
    }
}

/// Answers one request of the guest's agent.
fn serve(mut stream: TcpStream, shared: &Shared) -> Result<(), String> {
    let io = |e: std::io::Error| e.to_string();
    stream.set_nonblocking(false).map_err(io)?;
    stream
        .set_read_timeout(Some(Duration::from_secs(30)))
        .map_err(io)?;
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        if stream.read(&mut byte).map_err(io)? == 0 {
            return Err("request cut short".into());
        }
        head.push(byte[0]);
        if head.len() > 64 << 10 {
            return Err("request head too long".into());
        }
    }
    let head = String::from_utf8_lossy(&head).into_owned();
    let mut words = head.split_whitespace();
    let (method, path) = (words.next().unwrap_or(""), words.next().unwrap_or(""));
    let length: usize = head
        .lines()
        .find_map(|l| {
            let (name, value) = l.split_once(':')?;
            name.eq_ignore_ascii_case("content-length")
                .then(|| value.trim().parse().ok())
                .flatten()
        })
        .unwrap_or(0);
    let mut body = vec![0u8; length];
    stream.read_exact(&mut body).map_err(io)?;
    let reply = match (method, path) {
        ("GET", "/next") => next_job(shared).map(|(id, command)| format!("{id}\n{command}\n")),
        ("POST", p) if p.starts_with("/done/") => {
            let id: u64 = p["/done/".len()..]
                .parse()
                .map_err(|_| format!("bad job id in {p}"))?;
            let out = parse_result(&body).ok_or_else(|| format!("bad result of job {id}"))?;
            let mut state = shared.lock();
            state.done.insert(id, out);
            shared.changed.notify_all();
            None
        }
        _ => return Err(format!("unexpected request {method} {path}")),
    }
    .unwrap_or_default();
    write!(
        stream,
        "HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{reply}",
        reply.len()
    )
    .map_err(io)
}

/// The next queued command, waiting up to [`HOLD`] for one.
fn next_job(shared: &Shared) -> Option<(u64, String)> {
    let deadline = Instant::now() + HOLD;
    let mut state = shared.lock();
    state.polls += 1;
    shared.changed.notify_all();
    loop {
        if let Some(job) = state.queue.pop_front() {
            return Some(job);
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if state.stopping || left.is_zero() {
            return None;
        }
        state = shared.wait(state, left);
    }
}

/// `CODE OUT_LEN ERR_LEN\n` then the bytes of stdout and stderr.
fn parse_result(body: &[u8]) -> Option<Output> {
    let newline = body.iter().position(|&b| b == b'\n')?;
    let head = std::str::from_utf8(&body[..newline]).ok()?;
    let mut numbers = head.split_whitespace().map(|n| n.parse::<usize>().ok());
    let (code, out_len, err_len) = (numbers.next()??, numbers.next()??, numbers.next()??);
    let rest = &body[newline + 1..];
    let stdout = rest.get(..out_len)?;
    let stderr = rest.get(out_len..out_len + err_len)?;
    Some(Output {
        code: i32::try_from(code).ok()?,
        stdout: String::from_utf8_lossy(stdout).into_owned(),
        stderr: String::from_utf8_lossy(stderr).into_owned(),
    })
}

/// Runs `ip ARGS`, failing with its stderr.
fn ip(netns: &str, args: &[&str]) -> Result<(), VmError> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .map_err(|source| VmError::Spawn {
            what: "ip".into(),
            source,
        })?;
    if out.status.success() {
        Ok(())
    } else {
        Err(VmError::Netns {
            netns: netns.into(),
            what: format!(
                "ip {}: {}",
                args.join(" "),
                String::from_utf8_lossy(&out.stderr).trim()
            ),
        })
    }
}

/// The tap in the namespace, configured and up; removed on drop.
struct Tap {
    netns: String,
}

impl Tap {
    fn create(netns: &str) -> Result<Self, VmError> {
        if !netns_path(netns).exists() {
            return Err(VmError::Netns {
                netns: netns.into(),
                what: format!("{} does not exist", netns_path(netns).display()),
            });
        }
        ip(
            netns,
            &["-n", netns, "tuntap", "add", "dev", TAP, "mode", "tap"],
        )?;
        let tap = Tap {
            netns: netns.into(),
        };
        let address = format!("{HOST_ADDR}/{PREFIX_LEN}");
        ip(netns, &["-n", netns, "addr", "add", &address, "dev", TAP])?;
        ip(netns, &["-n", netns, "link", "set", TAP, "up"])?;
        ip(netns, &["-n", netns, "link", "set", "lo", "up"])?;
        Ok(tap)
    }
}

impl Drop for Tap {
    fn drop(&mut self) {
        let _ = ip(&self.netns, &["-n", &self.netns, "link", "del", TAP]);
    }
}

/// A network namespace made for a test (`ip netns add`, so it is
/// `/run/netns/NAME`), deleted on drop.
#[derive(Debug)]
pub struct Netns {
    name: String,
}

impl Netns {
    /// A new namespace named `vrdma-TAG-PID`.
    pub fn create(tag: &str) -> Result<Self, VmError> {
        let name = format!("vrdma-{tag}-{}", std::process::id());
        ip(&name, &["netns", "add", &name])?;
        Ok(Netns { name })
    }

    /// Its name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Runs `f` on a thread inside the namespace (sockets it makes stay
    /// there).
    pub fn run<T: Send>(&self, f: impl FnOnce() -> T + Send) -> Result<T, VmError> {
        in_netns(&self.name, f)
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = ip(&self.name, &["netns", "del", &self.name]);
    }
}

/// Runs `f` on a thread that entered network namespace `netns` (a name
/// under /run/netns): sockets it creates belong to that namespace, also
/// once used from other threads.
pub fn in_netns<T: Send>(netns: &str, f: impl FnOnce() -> T + Send) -> Result<T, VmError> {
    let path = netns_path(netns);
    let file = std::fs::File::open(&path).map_err(|e| VmError::Netns {
        netns: netns.into(),
        what: format!("cannot open {}: {e}", path.display()),
    })?;
    std::thread::scope(|scope| {
        scope
            .spawn(move || {
                // SAFETY: setns(2) on a descriptor we own; it changes only
                // this thread's network namespace, and the thread ends
                // when `f` returns.
                if unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
                    return Err(VmError::Netns {
                        netns: netns.into(),
                        what: format!("setns: {}", std::io::Error::last_os_error()),
                    });
                }
                Ok(f())
            })
            .join()
            .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
    })
}

/// Reads the RoCEv2 packets that reach a namespace's host side: a raw
/// IPv4/UDP socket (it gets a copy of every UDP datagram addressed to the
/// namespace, from its IPv4 header on), keeping those to port 4791.
pub struct RoceCapture {
    fd: OwnedFd,
}

impl RoceCapture {
    /// Opens the capture in network namespace `netns`.
    pub fn open(netns: &str) -> Result<Self, VmError> {
        let fd = in_netns(netns, || {
            // SAFETY: socket(2) with constant arguments; the result is
            // checked before use.
            let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_RAW, libc::IPPROTO_UDP) };
            if fd < 0 {
                Err(std::io::Error::last_os_error())
            } else {
                // SAFETY: `fd` is a new descriptor nobody else owns.
                Ok(unsafe { OwnedFd::from_raw_fd(fd) })
            }
        })?
        .map_err(|e| VmError::Netns {
            netns: netns.into(),
            what: format!("raw UDP socket: {e}"),
        })?;
        Ok(RoceCapture { fd })
    }

    /// The next IPv4 packet carrying UDP to port 4791 (whole, from the
    /// IPv4 header), waiting up to `timeout`; `None` if none came.
    pub fn next(&self, timeout: Duration) -> std::io::Result<Option<Vec<u8>>> {
        let deadline = Instant::now() + timeout;
        let mut buf = vec![0u8; 65536];
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let mut pfd = libc::pollfd {
                fd: self.fd.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            let ms = libc::c_int::try_from(left.as_millis()).unwrap_or(libc::c_int::MAX);
            // SAFETY: one valid pollfd, for the duration of the call.
            let ready = unsafe { libc::poll(&mut pfd, 1, ms) };
            if ready < 0 {
                let e = std::io::Error::last_os_error();
                if e.kind() == std::io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(e);
            }
            if ready == 0 {
                return Ok(None);
            }
            // SAFETY: `buf` is writable for its whole length.
            let n = unsafe {
                libc::recv(
                    self.fd.as_raw_fd(),
                    buf.as_mut_ptr().cast(),
                    buf.len(),
                    libc::MSG_DONTWAIT,
                )
            };
            if n < 0 {
                let e = std::io::Error::last_os_error();
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::Interrupted
                ) {
                    continue;
                }
                return Err(e);
            }
            let packet = &buf[..n.unsigned_abs()];
            if udp_dst_port(packet) == Some(ROCE_V2_PORT) {
                return Ok(Some(packet.to_vec()));
            }
        }
    }
}

/// The UDP destination port of IPv4 packet `packet`, if it is UDP.
fn udp_dst_port(packet: &[u8]) -> Option<u16> {
    let ihl = usize::from(packet.first()? & 0x0f) * 4;
    if packet.first()? >> 4 != 4 || *packet.get(9)? != 17 {
        return None;
    }
    let port = packet.get(ihl + 2..ihl + 4)?;
    Some(u16::from_be_bytes([port[0], port[1]]))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_the_roce_v2_gid_of_an_address() {
        let devinfo = "\t\t\tGID[  0]:\t\tfe80:0000:0000:0000:5054:00ff:fe12:3456, RoCE v1\n\
                       \t\t\tGID[  1]:\t\tfe80::5054:ff:fe12:3456, RoCE v2\n\
                       \t\t\tGID[  2]:\t\t0000:0000:0000:0000:0000:ffff:0a63:0002, RoCE v1\n\
                       \t\t\tGID[  3]:\t\t::ffff:10.99.0.2, RoCE v2\n";
        assert_eq!(roce_v2_gid_index(devinfo, GUEST_ADDR), Some(3));
        assert_eq!(roce_v2_gid_index(devinfo, HOST_ADDR), None);
    }

    #[test]
    fn parses_a_posted_result() {
        let out = parse_result(b"3 6 4\nhello\noops").expect("parses");
        assert_eq!(
            out,
            Output {
                code: 3,
                stdout: "hello\n".into(),
                stderr: "oops".into()
            }
        );
        assert_eq!(parse_result(b"0 10 0\nshort"), None);
        assert_eq!(parse_result(b"garbage"), None);
    }

    #[test]
    fn reads_the_udp_destination_port() {
        let mut packet = vec![0u8; 28];
        packet[0] = 0x45;
        packet[9] = 17;
        packet[22..24].copy_from_slice(&4791u16.to_be_bytes());
        assert_eq!(udp_dst_port(&packet), Some(4791));
        packet[9] = 6;
        assert_eq!(udp_dst_port(&packet), None);
    }
}
