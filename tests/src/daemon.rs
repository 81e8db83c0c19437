//! Starting and stopping daemons built from this workspace.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// Directory holding the workspace's binaries: the profile directory the
/// running test executable was built into (`target/<profile>/deps/..`).
/// `VRDMA_BIN_DIR` overrides it.
pub fn bin_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("VRDMA_BIN_DIR") {
        return dir.into();
    }
    let exe = std::env::current_exe().expect("test executable path");
    let mut dir = exe.parent().expect("executable directory").to_path_buf();
    if dir.ends_with("deps") {
        dir.pop();
    }
    dir
}

/// Path of workspace binary `name`, which must have been built.
pub fn binary(name: &str) -> PathBuf {
    let path = bin_dir().join(name);
    assert!(
        path.exists(),
        "{} is missing: build the workspace binaries first (`cargo test --workspace` does)",
        path.display()
    );
    path
}

/// A scratch directory removed on drop.
#[derive(Debug)]
pub struct TempDir(PathBuf);

impl TempDir {
    /// A new empty directory named after `tag`, this process and a counter.
    pub fn new(tag: &str) -> Self {
        Self::new_in(&std::env::temp_dir(), tag)
    }

    /// Like [`TempDir::new`], under `parent` (created if missing).
    pub fn new_in(parent: &Path, tag: &str) -> Self {
        use std::sync::atomic::{AtomicU32, Ordering};
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let path = parent.join(format!("vrdma-{tag}-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&path);
        std::fs::create_dir_all(&path).expect("create temp dir");
        TempDir(path)
    }

    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Spawns binary `name` on `socket` with `args`, appending its stderr to `log`.
fn spawn(name: &str, socket: &Path, args: &[String], log: &Path) -> Child {
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)
        .expect("log file");
    Command::new(binary(name))
        .arg("--socket")
        .arg(socket)
        .args(args)
        .env("VRDMA_LOG", "debug")
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .unwrap_or_else(|e| panic!("spawn {name}: {e}"))
}

/// A workspace daemon running as a child process with its own scratch
/// directory, socket and log file; killed on drop.
#[derive(Debug)]
pub struct Daemon {
    name: &'static str,
    child: Child,
    args: Vec<String>,
    pub socket: PathBuf,
    log: PathBuf,
    dir: TempDir,
}

impl Daemon {
    /// Starts binary `name` with `--socket <dir>/<name>.sock` and `args`,
    /// logging to `<dir>/<name>.log`, and waits until the socket exists.
    pub fn start(name: &'static str, dir: TempDir, args: &[&str]) -> Self {
        let socket = dir.path().join(format!("{name}.sock"));
        let log = dir.path().join(format!("{name}.log"));
        let args: Vec<String> = args.iter().map(|&a| a.to_owned()).collect();
        let child = spawn(name, &socket, &args, &log);
        let mut daemon = Daemon {
            name,
            child,
            args,
            socket,
            log,
            dir,
        };
        daemon.wait_for_socket();
        daemon
    }

    /// Kills the process (SIGKILL) and starts it again with the same
    /// arguments on the same socket, as a supervisor would after a crash;
    /// the log continues in the same file. Waits until the new process
    /// listens.
    pub fn restart(&mut self) {
        self.kill();
        // The dead process's socket file stays behind: remove it, so that
        // waiting for the socket waits for the new process.
        let _ = std::fs::remove_file(&self.socket);
        self.child = spawn(self.name, &self.socket, &self.args, &self.log);
        self.wait_for_socket();
    }

    fn wait_for_socket(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !self.socket.exists() {
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!(
                    "{} exited with {status} before listening:\n{}",
                    self.name,
                    self.log()
                );
            }
            assert!(
                Instant::now() < deadline,
                "{} did not listen within 10 s:\n{}",
                self.name,
                self.log()
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// The daemon's scratch directory.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// Whether the process is still running.
    pub fn is_running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// Exit status, if it exited.
    pub fn exit_status(&mut self) -> Option<ExitStatus> {
        self.child.try_wait().ok().flatten()
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Kills the process (SIGKILL) and reaps it.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Everything the daemon logged so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A running vdev; killed on drop.
#[derive(Debug)]
pub struct Vdev {
    daemon: Daemon,
    pub socket: PathBuf,
    pub tenant: String,
}

impl Vdev {
    /// The process id.
    pub fn pid(&self) -> u32 {
        self.daemon.pid()
    }

    /// Niceness of the thread named `name` (`/proc/PID/task/*/comm`), if
    /// such a thread runs.
    pub fn thread_nice(&self, name: &str) -> Option<i32> {
        let tasks = std::fs::read_dir(format!("/proc/{}/task", self.pid())).ok()?;
        tasks.flatten().find_map(|task| {
            let comm = std::fs::read_to_string(task.path().join("comm")).ok()?;
            if comm.trim_end() != name {
                return None;
            }
            // Field 19 of stat; the name (field 2) may hold spaces, so
            // count from the closing parenthesis.
            let stat = std::fs::read_to_string(task.path().join("stat")).ok()?;
            let after = stat.rsplit_once(')')?.1;
            after.split_whitespace().nth(16)?.parse().ok()
        })
    }

    /// Starts vdev for `tenant` with extra command-line `args`, and waits
    /// until its socket exists.
    pub fn start(tenant: &str, args: &[&str]) -> Self {
        Self::start_in(TempDir::new(&format!("vdev-{tenant}")), tenant, args)
    }

    /// Starts vdev for `tenant` attached to `hostd`.
    pub fn on_hostd(hostd: &Hostd, tenant: &str, args: &[&str]) -> Self {
        let path = hostd.socket.to_str().expect("UTF-8 socket path").to_owned();
        let mut all = vec!["--hostd", path.as_str()];
        all.extend_from_slice(args);
        Self::start(tenant, &all)
    }

    /// Like [`Vdev::start`], with `config` (TOML) written to a config file
    /// in vdev's directory and passed as `--config` before `args`.
    pub fn start_with_config(tenant: &str, config: &str, args: &[&str]) -> Self {
        let dir = TempDir::new(&format!("vdev-{tenant}"));
        let path = dir.path().join("vdev.toml");
        std::fs::write(&path, config).expect("write vdev config file");
        let path = path.to_str().expect("UTF-8 temp path").to_owned();
        let mut all = vec!["--config", path.as_str()];
        all.extend_from_slice(args);
        Self::start_in(dir, tenant, &all)
    }

    /// Like [`Vdev::start`], with socket and log in `dir` (e.g. a
    /// directory a chrooted VMM can reach: [`crate::vm::VmImage::temp_dir`]).
    pub fn start_in(dir: TempDir, tenant: &str, args: &[&str]) -> Self {
        let mut all = vec!["--tenant", tenant];
        all.extend_from_slice(args);
        let daemon = Daemon::start("vdev", dir, &all);
        let socket = daemon.socket.clone();
        Vdev {
            daemon,
            socket,
            tenant: tenant.into(),
        }
    }

    /// Whether the process is still running.
    pub fn is_running(&mut self) -> bool {
        self.daemon.is_running()
    }

    /// Exit status, if it exited.
    pub fn exit_status(&mut self) -> Option<ExitStatus> {
        self.daemon.exit_status()
    }

    /// Kills vdev (SIGKILL), as a crash would.
    pub fn kill(&mut self) {
        self.daemon.kill();
    }

    /// Kills vdev (SIGKILL) and starts it again on the same socket.
    pub fn restart(&mut self) {
        self.daemon.restart();
    }

    /// Everything vdev logged so far.
    pub fn log(&self) -> String {
        self.daemon.log()
    }

    /// Waits (up to 10 s) until vdev has built its device for its
    /// `frontend`-th frontend (1 for the first) and waits for it to
    /// connect: registered with hostd, workers and datapath started, as
    /// its log says. Between frontends vdev tears one device down and
    /// builds the next, so this is the moment its resources are steady.
    pub fn wait_for_frontend(&self, frontend: usize) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while self.log().matches("Waiting for a frontend").count() < frontend {
            assert!(
                Instant::now() < deadline,
                "vdev does not wait for frontend {frontend}:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

/// A running hostd; killed on drop.
#[derive(Debug)]
pub struct Hostd {
    daemon: Daemon,
    pub socket: PathBuf,
}

impl Hostd {
    /// Starts hostd on its embedded default policy (tenants `alpha` and
    /// `beta` in network `demo`), or on `policy` (TOML) when given.
    pub fn start(policy: Option<&str>) -> Self {
        Hostd::start_with(policy, &[])
    }

    /// [`Hostd::start`] with more command-line arguments.
    pub fn start_with(policy: Option<&str>, extra: &[&str]) -> Self {
        let dir = TempDir::new("hostd");
        let path = dir.path().join("policy.toml");
        let path = path.to_str().expect("UTF-8 temp path").to_owned();
        let mut args: Vec<&str> = match policy {
            Some(text) => {
                std::fs::write(&path, text).expect("write the policy file");
                vec!["--policy", path.as_str()]
            }
            None => Vec::new(),
        };
        args.extend_from_slice(extra);
        let daemon = Daemon::start("hostd", dir, &args);
        let socket = daemon.socket.clone();
        Hostd { daemon, socket }
    }

    /// The policy file hostd was started with (written by [`Hostd::start`]).
    pub fn policy_path(&self) -> PathBuf {
        self.daemon.dir().join("policy.toml")
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
    pub fn sighup(&self) {
        // SAFETY: kill() with a pid we spawned and a valid signal number.
        let rc = unsafe { libc::kill(self.daemon.pid() as libc::pid_t, libc::SIGHUP) };
        assert_eq!(rc, 0, "SIGHUP: {}", std::io::Error::last_os_error());
    }

    /// Whether the process is still running.
    pub fn is_running(&mut self) -> bool {
        self.daemon.is_running()
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.daemon.pid()
    }

    /// The value of the sample `series` (name and labels exactly as
    /// hostd prints them, e.g. `vrdma_tenant_usage{tenant="alpha",resource="mrs"}`)
    /// in `vrdmactl metrics`, or `None` when hostd does not print it.
    pub fn metric(&self, series: &str) -> Option<f64> {
        let (code, text, err) = self.ctl(&["metrics"]);
        assert_eq!(code, 0, "vrdmactl metrics: {err}");
        metric_value(&text, series)
    }

    /// Everything hostd logged so far.
    pub fn log(&self) -> String {
        self.daemon.log()
    }
}

/// A directory holding `libibverbs.so.1` → the workspace's drop-in cdylib
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
        std::os::unix::fs::symlink(&lib, tmp.path().join("libibverbs.so.1"))
            .expect("symlink libibverbs.so.1");
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

/// Whether something listens on TCP `port` (read from /proc, so that a
/// server's single accept is not used up by a probe).
pub fn tcp_listening(port: u16) -> bool {
    ["/proc/net/tcp", "/proc/net/tcp6"].iter().any(|f| {
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
