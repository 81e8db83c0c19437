//! The workspace's daemons for the tests: hostd and vdev as separate
//! processes, each in its own scratch directory, started and stopped by
//! `vrdma_tools::supervisor`, which reports every failure as an error;
//! here a failure fails the test. [`Hostd`] and [`Vdev`] dereference to the
//! supervisor's [`Daemon`] (pid, log, kill, exit status).

use std::ops::{Deref, DerefMut};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use vrdma_errors::error_chain;
use vrdma_tools::supervisor::{self, Daemon, Launch, Scratch};

/// The value of a supervisor's result, or the test fails with its error chain.
#[track_caller]
pub fn must<T>(result: Result<T, supervisor::Error>) -> T {
    result.unwrap_or_else(|e| panic!("{}", error_chain(&e)))
}

/// Directory holding the workspace's binaries: the profile directory the
/// running test executable was built into (`target/<profile>/deps/..`).
/// `VRDMA_BIN_DIR` overrides it.
pub fn bin_dir() -> PathBuf {
    must(supervisor::bin_dir())
}

/// Path of workspace binary `name`, which must have been built
/// (`cargo test --workspace` builds them all).
#[track_caller]
pub fn binary(name: &str) -> PathBuf {
    let package = match name {
        "hostd" | "vrdmactl" => "vrdma-hostd",
        "vdev" => "vrdma-vdev",
        _ => "vrdma-tools",
    };
    must(supervisor::find_binary(name, package))
}

/// A scratch directory removed on drop.
#[derive(Debug)]
pub struct TempDir(Scratch);

impl TempDir {
    /// A new empty directory named after `tag`, this process and a counter.
    pub fn new(tag: &str) -> Self {
        TempDir(must(Scratch::new(tag)))
    }

    /// Like [`TempDir::new`], under `parent` (created if missing).
    pub fn new_in(parent: &Path, tag: &str) -> Self {
        TempDir(must(Scratch::new_in(parent, tag)))
    }

    pub fn path(&self) -> &Path {
        self.0.path()
    }
}

/// `$wrapper` dereferences to its `daemon` field, the supervisor's
/// [`Daemon`]: pid, log, kill, exit status.
macro_rules! deref_to_daemon {
    ($($wrapper:ty),*) => {$(
        impl Deref for $wrapper {
            type Target = Daemon;
            fn deref(&self) -> &Daemon {
                &self.daemon
            }
        }

        impl DerefMut for $wrapper {
            fn deref_mut(&mut self) -> &mut Daemon {
                &mut self.daemon
            }
        }
    )*};
}

deref_to_daemon!(Vdev, Hostd);

/// Starts `launch` with debug logs, or fails the test.
fn start(launch: Launch) -> Daemon {
    must(launch.log_level("debug").start())
}

/// A running vdev in its own directory; killed on drop.
#[derive(Debug)]
pub struct Vdev {
    // Dropped in order: the process before its directory.
    daemon: Daemon,
    pub socket: PathBuf,
    pub tenant: String,
    _dir: TempDir,
}

impl Vdev {
    /// How many rdma_cm listens on `port` this vdev has logged (its
    /// device's connection manager logs each: "Listening ... addr=<ip>:<port>").
    pub fn listens_on(&self, port: u16) -> usize {
        let needle = format!(":{port} ");
        (self.log().lines())
            .filter(|l| l.contains("Listening") && l.contains(&needle))
            .count()
    }

    /// Starts vdev for `tenant` with extra command-line `args`, and waits
    /// until its socket listens.
    pub fn start(tenant: &str, args: &[&str]) -> Self {
        Self::start_in(TempDir::new(&format!("vdev-{tenant}")), tenant, args)
    }

    /// Starts vdev for `tenant` attached to `hostd` (in hostd's network
    /// namespace, if it runs in one).
    pub fn on_hostd(hostd: &Hostd, tenant: &str, args: &[&str]) -> Self {
        let path = hostd.socket.to_str().expect("UTF-8 socket path").to_owned();
        let mut all = vec!["--hostd", path.as_str()];
        all.extend_from_slice(args);
        let dir = TempDir::new(&format!("vdev-{tenant}"));
        Self::launch(dir, tenant, &all, hostd.netns.as_deref())
    }

    /// Like [`Vdev::start`], with `config` (TOML) written to a config file
    /// in vdev's directory and passed as `--config` before `args`.
    pub fn start_with_config(tenant: &str, config: &str, args: &[&str]) -> Self {
        let dir = TempDir::new(&format!("vdev-{tenant}"));
        let path = must(dir.0.write("vdev.toml", config));
        let path = path.to_str().expect("UTF-8 temp path").to_owned();
        let mut all = vec!["--config", path.as_str()];
        all.extend_from_slice(args);
        Self::start_in(dir, tenant, &all)
    }

    /// Like [`Vdev::start`], with socket and log in `dir` (e.g. a
    /// directory a chrooted VMM can reach: [`crate::vm::VmImage::temp_dir`]).
    pub fn start_in(dir: TempDir, tenant: &str, args: &[&str]) -> Self {
        Self::launch(dir, tenant, args, None)
    }

    fn launch(dir: TempDir, tenant: &str, args: &[&str], netns: Option<&Path>) -> Self {
        let mut launch = Launch::new(
            format!("vdev {tenant}"),
            &binary("vdev"),
            dir.path(),
            "vdev",
        );
        if let Some(netns) = netns {
            launch = launch.netns(netns);
        }
        let daemon = start(launch.args(["--tenant", tenant]).args(args));
        Vdev {
            socket: daemon.socket().to_owned(),
            daemon,
            tenant: tenant.into(),
            _dir: dir,
        }
    }

    /// Fails the test unless vdev's log so far holds each of `lines`.
    #[track_caller]
    pub fn assert_logged(&self, lines: &[&str]) {
        let log = self.log();
        let missing: Vec<_> = lines.iter().filter(|line| !log.contains(*line)).collect();
        assert!(
            missing.is_empty(),
            "vdev logged no {missing:?}:
{log}"
        );
    }

    /// Kills vdev (SIGKILL) and starts it again on the same socket.
    pub fn restart(&mut self) {
        must(self.daemon.restart());
    }

    /// Waits (10 s at most) until vdev has settled with `open` frontends
    /// connected: every frontend that left is released and the next
    /// context waits for its frontend (its log: "Frontend connected" k
    /// times, "state released" k - `open` times, "Waiting for a frontend"
    /// k + 1 times). Contexts come and go on their own threads: a count of
    /// vdev's descriptors or memory means something only then.
    pub fn wait_settled(&self, open: usize) {
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        loop {
            let log = self.log();
            let connected = log.matches("Frontend connected").count();
            let released = log.matches("state released").count();
            let waiting = log.matches("Waiting for a frontend").count();
            if waiting == connected + 1 && released + open == connected {
                return;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "vdev did not settle ({connected} connected, {released} released, \
                 {waiting} waiting, {open} open):\n{log}"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Waits (up to 10 s) until vdev has built its context for its
    /// `frontend`-th frontend (1 for the first) and waits for it to
    /// connect: registered with hostd and its control-queue worker
    /// started, as its log says.
    pub fn wait_for_frontend(&self, frontend: usize) {
        let waiting = "Waiting for a frontend";
        let logged = self.wait_logged(waiting, frontend, Duration::from_secs(10));
        logged.unwrap_or_else(|e| panic!("{}:\n{}", error_chain(&e), self.log()));
    }
}

/// A running hostd in its own directory; killed on drop.
#[derive(Debug)]
pub struct Hostd {
    // Dropped in order: the process before its directory.
    daemon: Daemon,
    pub socket: PathBuf,
    /// The network namespace it runs in, if not the test's (its vdevs
    /// run there too).
    pub netns: Option<PathBuf>,
    dir: TempDir,
}

impl Hostd {
    /// Starts hostd on its embedded default policy (tenants `alpha` and
    /// `beta` in network `demo`), or on `policy` (TOML) when given.
    pub fn start(policy: Option<&str>) -> Self {
        Hostd::start_with(policy, &[])
    }

    /// [`Hostd::start`] with more command-line arguments.
    pub fn start_with(policy: Option<&str>, extra: &[&str]) -> Self {
        Hostd::start_in_netns(None, policy, extra)
    }

    /// [`Hostd::start_with`] inside network namespace `netns` (a name or
    /// path: `vrdma_tools::supervisor::Launch::netns`), e.g. a host of a
    /// `crate::netns::Cluster`; [`Vdev::on_hostd`] starts its vdevs there.
    pub fn start_in_netns(netns: Option<&Path>, policy: Option<&str>, extra: &[&str]) -> Self {
        let dir = TempDir::new("hostd");
        let mut launch = Launch::hostd(&binary("hostd"), dir.path());
        if let Some(netns) = netns {
            launch = launch.netns(netns);
        }
        if let Some(text) = policy {
            launch = launch
                .arg("--policy")
                .arg(must(dir.0.write("policy.toml", text)));
        }
        // The harness's vdevs die by SIGKILL when dropped, often before
        // they released their contexts: a test's hostd keeps nothing for
        // a successor unless the test asks (`--orphan-grace-ms`).
        if !extra.iter().any(|a| a.starts_with("--orphan-grace-ms")) {
            launch = launch.args(["--orphan-grace-ms", "0"]);
        }
        let daemon = start(launch.args(extra));
        Hostd {
            socket: daemon.socket().to_owned(),
            netns: netns.map(supervisor::netns_path),
            daemon,
            dir,
        }
    }

    /// Upgrades hostd by handover (`--take-over`): returns once the
    /// previous process exited (asserting it exited 0, having handed
    /// over) and the new one serves.
    pub fn hand_over(&mut self) {
        let status = must(self.daemon.hand_over());
        assert!(
            status.success(),
            "the previous hostd exited with {status}:\n{}",
            self.log()
        );
    }

    /// The address hostd logged it serves Prometheus metrics on
    /// (`--metrics-listen`, port 0: any), waiting up to 10 s for the line.
    pub fn metrics_addr(&self) -> std::net::SocketAddr {
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        loop {
            let log = self.log();
            let addr = log
                .lines()
                .filter(|l| l.contains("Serving Prometheus metrics over HTTP"))
                .find_map(|l| {
                    l.split("addr=")
                        .nth(1)?
                        .split_whitespace()
                        .next()?
                        .parse()
                        .ok()
                });
            if let Some(addr) = addr {
                return addr;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "no metrics address logged:\n{log}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The policy file hostd was started with (written by [`Hostd::start`]).
    pub fn policy_path(&self) -> PathBuf {
        self.dir.path().join("policy.toml")
    }

    /// hostd's admin socket (the default: next to its vdev socket).
    pub fn admin_socket(&self) -> PathBuf {
        let mut name = self.socket.clone().into_os_string();
        name.push(".admin");
        name.into()
    }

    /// Runs `vrdmactl <args>` against this hostd: (exit code, stdout, stderr).
    pub fn ctl(&self, args: &[&str]) -> (i32, String, String) {
        let out = Command::new(binary("vrdmactl"))
            .arg("--admin-socket")
            .arg(self.admin_socket())
            .args(args)
            .output()
            .expect("run vrdmactl");
        (
            out.status.code().unwrap_or(-1),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    }

    /// What `tenant` holds in hostd now (`vrdmactl stats --json`, its
    /// `usage` object: devices, physical_queues, qps, mrs, mr_bytes).
    pub fn usage(&self, tenant: &str) -> serde_json::Value {
        self.tenant_stats(tenant)["usage"].clone()
    }

    /// Everything hostd reports about `tenant` (`vrdmactl stats --json`:
    /// its `ops`, `bytes`, `errors`, `usage` ... objects).
    pub fn tenant_stats(&self, tenant: &str) -> serde_json::Value {
        let (code, out, err) = self.ctl(&["stats", "--json"]);
        assert_eq!(code, 0, "vrdmactl stats: {err}");
        let stats: serde_json::Value = serde_json::from_str(&out).expect("stats JSON");
        stats["tenants"]
            .as_array()
            .and_then(|t| t.iter().find(|t| t["tenant"] == tenant))
            .cloned()
            .unwrap_or_else(|| panic!("no tenant {tenant} in hostd's stats:\n{out}"))
    }

    /// Successful work requests of `tenant` so far, all kinds together.
    pub fn ops(&self, tenant: &str) -> u64 {
        let stats = self.tenant_stats(tenant);
        stats["ops"]
            .as_object()
            .map(|ops| ops.values().filter_map(serde_json::Value::as_u64).sum())
            .unwrap_or(0)
    }

    /// Sends SIGHUP (reload the policy).
    pub fn sighup(&mut self) {
        must(self.daemon.signal(libc::SIGHUP));
    }

    /// The value of the sample `series` (name and labels exactly as
    /// hostd prints them, e.g. `vrdma_tenant_usage{tenant="alpha",resource="mrs"}`)
    /// in `vrdmactl metrics`, or `None` when hostd does not print it.
    pub fn metric(&self, series: &str) -> Option<f64> {
        let (code, text, err) = self.ctl(&["metrics"]);
        assert_eq!(code, 0, "vrdmactl metrics: {err}");
        metric_value(&text, series)
    }
}

/// A directory holding `libibverbs.so.1` and `librdmacm.so.1` → the workspace's drop-in cdylib
/// (vrdma-libibverbs), to put first on a library path; removed on drop.
#[derive(Debug)]
pub struct IbverbsShim(TempDir);

impl IbverbsShim {
    /// Links the cdylib of the profile this test was built into (not
    /// `VRDMA_BIN_DIR`, which may name other daemons).
    pub fn new() -> Self {
        let exe = std::env::current_exe().expect("test executable path");
        let dir = exe
            .parent()
            .and_then(Path::parent)
            .expect("target/<profile>/deps/<test>");
        // `cargo test --workspace` leaves the cdylib in deps/ (built for the
        // doctests); `cargo build` also copies it up. Take the newest.
        let lib = [dir.join("libibverbs.so"), dir.join("deps/libibverbs.so")]
            .into_iter()
            .filter_map(|p| Some((p.metadata().ok()?.modified().ok()?, p)))
            .max()
            .map(|(_, p)| p)
            .unwrap_or_else(|| {
                panic!(
                    "libibverbs.so is missing in {}: build the workspace first \
                     (`cargo test --workspace` builds vrdma-libibverbs)",
                    dir.display()
                )
            });
        let tmp = TempDir::new("ibverbs-shim");
        // librdmacm.so.1 is a second name of the same file (the loader
        // maps it once: see guest-driver/libibverbs/src/rdmacm).
        for name in ["libibverbs.so.1", "librdmacm.so.1"] {
            std::os::unix::fs::symlink(&lib, tmp.path().join(name))
                .unwrap_or_else(|e| panic!("symlink {name}: {e}"));
        }
        IbverbsShim(tmp)
    }

    /// The directory.
    pub fn path(&self) -> &Path {
        self.0.path()
    }

    /// `program` with the shim first on the library path and `device` (a
    /// vdev socket) as its only vrdma device; output piped.
    pub fn command(&self, program: &str, device: &Path) -> Command {
        let mut cmd = Command::new(program);
        cmd.env("LD_LIBRARY_PATH", self.path())
            .env("VRDMA_DEVICES", device)
            .env_remove("VRDMA_CONFIG")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        cmd
    }
}

thread_local! {
    /// Programs this thread started ([`track`]) and has not collected yet
    /// ([`wait_output`]).
    static STARTED: std::cell::RefCell<Vec<u32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Has the program `child` killed should the calling test panic before
/// [`wait_output`] collects it. A test that failed between starting a
/// client/server pair and waiting for it left both running — spinning
/// pingpongs that loaded the machine for every test and benchmark after
/// (`Child` does not kill on drop).
pub fn track(child: &std::process::Child) {
    static HOOK: std::sync::Once = std::sync::Once::new();
    HOOK.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            previous(info);
            // The panicking thread's programs only (a test's own thread;
            // other tests run on theirs).
            let pids = STARTED.try_with(|s| std::mem::take(&mut *s.borrow_mut()));
            for pid in pids.unwrap_or_default() {
                if let Ok(pid) = libc::pid_t::try_from(pid) {
                    // SAFETY: kill(2) on a child of this process not yet
                    // reaped (wait_output forgets it before reaping): the
                    // pid cannot have been reused.
                    unsafe { libc::kill(pid, libc::SIGKILL) };
                }
            }
        }));
    });
    STARTED.with(|s| s.borrow_mut().push(child.id()));
}

/// Waits for `child` up to `timeout`, killing it if it takes longer;
/// returns its output and whether it was killed.
pub fn wait_output(
    mut child: std::process::Child,
    timeout: Duration,
) -> (std::process::Output, bool) {
    let deadline = std::time::Instant::now() + timeout;
    let late = loop {
        match child.try_wait() {
            // Reaped: forgotten before a panic could kill another process
            // under its pid.
            Ok(Some(_)) => {
                forget(child.id());
                break false;
            }
            Ok(None) if std::time::Instant::now() >= deadline => {
                let _ = child.kill();
                break true;
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(20)),
            Err(e) => panic!("wait: {e}"),
        }
    };
    forget(child.id());
    (child.wait_with_output().expect("collect output"), late)
}

/// `pid` is collected: no longer this thread's to kill.
fn forget(pid: u32) {
    let _ = STARTED.try_with(|s| s.borrow_mut().retain(|&p| p != pid));
}

/// Whether something listens on TCP `port` (read from /proc, so that a
/// server's single accept is not used up by a probe), in the calling
/// thread's network namespace (a thread may have joined a test host's:
/// `netns::Host::run`).
pub fn tcp_listening(port: u16) -> bool {
    tcp_listening_in(
        &["/proc/thread-self/net/tcp", "/proc/thread-self/net/tcp6"],
        port,
    )
}

/// Whether one of the TCP tables `tables` (files like `/proc/net/tcp`)
/// has a socket listening on `port`.
pub fn tcp_listening_in(tables: &[&str], port: u16) -> bool {
    tables.iter().any(|f| {
        std::fs::read_to_string(f).is_ok_and(|table| {
            table.lines().skip(1).any(|line| {
                let fields: Vec<&str> = line.split_whitespace().collect();
                let local_port = fields
                    .get(1)
                    .and_then(|a| a.rsplit(':').next())
                    .and_then(|p| u16::from_str_radix(p, 16).ok());
                // State 0A is LISTEN.
                local_port == Some(port) && fields.get(3) == Some(&"0A")
            })
        })
    })
}

impl Default for IbverbsShim {
    fn default() -> Self {
        Self::new()
    }
}

/// The value of the sample `series` (name and labels, exactly as printed)
/// in the Prometheus text `metrics`.
pub fn metric_value(metrics: &str, series: &str) -> Option<f64> {
    metrics
        .lines()
        .filter_map(|line| line.strip_prefix(series)?.strip_prefix(' '))
        .find_map(|value| value.trim().parse().ok())
}

#[cfg(test)]
mod tests {
    use std::os::unix::process::ExitStatusExt;
    use std::process::{Command, Stdio};
    use std::time::Duration;

    use super::{track, wait_output};

    #[test]
    fn a_test_that_panics_takes_the_programs_it_started_with_it() {
        let spawn = || {
            Command::new("sleep")
                .arg("60")
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .expect("spawn sleep")
        };
        // Collected before the panic: not killed (its pid is forgotten).
        let done = Command::new("true").spawn().expect("spawn true");
        track(&done);
        let (out, late) = wait_output(done, Duration::from_secs(10));
        assert!(out.status.success() && !late);
        let mut left = spawn();
        track(&left);
        let pid = left.id();
        let panicked = std::thread::scope(|s| {
            s.spawn(|| {
                // Another thread's programs are its own.
                let mut theirs = spawn();
                track(&theirs);
                let outcome = std::panic::catch_unwind(|| panic!("a failing test"));
                assert!(outcome.is_err());
                let status = theirs.wait().expect("wait");
                assert_eq!(status.signal(), Some(libc::SIGKILL), "killed by the panic");
            })
            .join()
        });
        assert!(panicked.is_ok(), "the helper's own checks");
        // This thread did not panic: its program runs on.
        assert!(
            left.try_wait().expect("try_wait").is_none(),
            "pid {pid} killed"
        );
        let _ = left.kill();
        let _ = left.wait();
    }
}
