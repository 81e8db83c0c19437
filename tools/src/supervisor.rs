//! Running vrdma's daemons as separate processes: `hostd` and one `vdev`
//! per tenant, each on a unix socket in a scratch directory, each with its
//! stderr in a log file there.
//!
//! [`Launch`] describes a daemon (binary, socket, log, arguments) and
//! starts it; [`Daemon`] is the running process: it waits until its socket
//! listens, reads its log, signals, stops or restarts it, reports how it
//! exited, and kills it on drop. [`Scratch`] is the directory the daemons
//! live in. Every failure is an [`Error`]; nothing here panics, so the
//! demo can print what went wrong and the tests can `expect` it.
//!
//! A daemon may be started inside a network namespace ([`Launch::netns`],
//! [`enter_netns`]): a multi-host test runs one hostd per namespace, its
//! vdevs and tenants beside it. Unix sockets live in the file system and
//! are reached across namespaces as before.

use std::ffi::{OsStr, OsString};
use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

/// How long a daemon may take to listen, or to exit once asked to.
pub const TIMEOUT: Duration = Duration::from_secs(10);
/// Lines of a daemon's log an error that it did not start shows.
const LOG_TAIL: usize = 20;
/// How often a wait looks again.
const POLL: Duration = Duration::from_millis(5);

/// What went wrong while starting, watching or stopping a daemon.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("Cannot find the directory of this executable")]
    CurrentExe(#[source] io::Error),
    #[error(
        "{name} binary {} not found: build it (`cargo build -p {package}`, with the \
         same profile as this program)",
        path.display()
    )]
    MissingBinary {
        name: String,
        path: PathBuf,
        package: String,
    },
    #[error("Cannot create the directory {}", path.display())]
    CreateDir {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("Cannot write {}", path.display())]
    Write {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("Cannot open network namespace {}", path.display())]
    Netns {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("Cannot start {name} ({})", binary.display())]
    Spawn {
        name: String,
        binary: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("{name} exited with {status} before it listened on {}; {log}", socket.display())]
    ExitedEarly {
        name: String,
        status: ExitStatus,
        socket: PathBuf,
        /// The end of its log ([`Daemon::log_tail`]).
        log: String,
    },
    #[error("{name} did not listen on {} within {timeout:?}; {log}", socket.display())]
    NotListening {
        name: String,
        socket: PathBuf,
        timeout: Duration,
        /// The end of its log ([`Daemon::log_tail`]).
        log: String,
    },
    #[error("{name} did not exit within {timeout:?}")]
    StillRunning { name: String, timeout: Duration },
    #[error("{name} had already exited, with {status}")]
    AlreadyExited { name: String, status: ExitStatus },
    #[error("Cannot check on {name}")]
    Wait {
        name: String,
        #[source]
        source: io::Error,
    },
    #[error("Cannot send signal {signal} to {name}")]
    Signal {
        name: String,
        signal: i32,
        #[source]
        source: io::Error,
    },
    #[error("{name}'s log did not say {needle:?} {count} time(s) within {timeout:?}")]
    NotLogged {
        name: String,
        needle: String,
        count: usize,
        timeout: Duration,
    },
}

/// The directory holding the workspace's binaries: `VRDMA_BIN_DIR` when
/// set, else the directory of the running executable (`target/<profile>`
/// for a program, the same for a test, which runs from `deps/` below it).
pub fn bin_dir() -> Result<PathBuf, Error> {
    if let Some(dir) = std::env::var_os("VRDMA_BIN_DIR") {
        return Ok(dir.into());
    }
    let exe = std::env::current_exe().map_err(Error::CurrentExe)?;
    let mut dir = exe
        .parent()
        .ok_or_else(|| Error::CurrentExe(io::Error::other("it has no parent directory")))?
        .to_path_buf();
    if dir.ends_with("deps") {
        dir.pop();
    }
    Ok(dir)
}

/// Workspace binary `name` (of cargo package `package`) in [`bin_dir`],
/// which must exist.
pub fn find_binary(name: &str, package: &str) -> Result<PathBuf, Error> {
    let path = bin_dir()?.join(name);
    check_binary(name, path, package)
}

/// The binary `name` of `package`: `given` (a program's `--hostd PATH`,
/// say) or else the workspace's ([`find_binary`]); it must exist.
pub fn binary_or(given: Option<&Path>, name: &str, package: &str) -> Result<PathBuf, Error> {
    match given {
        Some(path) => check_binary(name, path.to_owned(), package),
        None => find_binary(name, package),
    }
}

/// `path` if it is a file: the binary `name` of `package`.
pub fn check_binary(name: &str, path: PathBuf, package: &str) -> Result<PathBuf, Error> {
    if path.is_file() {
        Ok(path)
    } else {
        Err(Error::MissingBinary {
            name: name.into(),
            path,
            package: package.into(),
        })
    }
}

/// A scratch directory for sockets, configuration and logs, removed on
/// drop unless kept.
#[derive(Debug)]
pub struct Scratch {
    path: PathBuf,
    keep: bool,
}

impl Scratch {
    /// A new empty directory `vrdma-<tag>-<pid>-<n>` under the system's
    /// temporary directory.
    pub fn new(tag: &str) -> Result<Self, Error> {
        Self::new_in(&std::env::temp_dir(), tag)
    }

    /// Like [`Scratch::new`], under `parent` (created if missing).
    pub fn new_in(parent: &Path, tag: &str) -> Result<Self, Error> {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let path = parent.join(format!("vrdma-{tag}-{}-{n}", std::process::id()));
        // A directory of the same name is a left-over of a dead process
        // whose pid this one reuses.
        let _ = std::fs::remove_dir_all(&path);
        std::fs::create_dir_all(&path).map_err(|source| Error::CreateDir {
            path: path.clone(),
            source,
        })?;
        // Kept for a look at the daemons' logs after the run.
        let keep = std::env::var_os("VRDMA_KEEP_SCRATCH").is_some();
        Ok(Self { path, keep })
    }

    /// The directory.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Whether it stays after drop.
    pub fn set_keep(&mut self, keep: bool) {
        self.keep = keep;
    }

    /// Writes `contents` to file `name` in it; returns the file's path.
    pub fn write(&self, name: &str, contents: &str) -> Result<PathBuf, Error> {
        let path = self.path.join(name);
        std::fs::write(&path, contents).map_err(|source| Error::Write {
            path: path.clone(),
            source,
        })?;
        Ok(path)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        if !self.keep {
            let _ = std::fs::remove_dir_all(&self.path);
        }
    }
}

/// How to run one daemon: `binary --socket <socket> <args>`, its stderr
/// appended to `log`, `VRDMA_LOG` set to the log level.
#[derive(Debug, Clone)]
pub struct Launch {
    name: String,
    binary: PathBuf,
    socket: PathBuf,
    log: PathBuf,
    args: Vec<OsString>,
    log_level: String,
    netns: Option<PathBuf>,
}

impl Launch {
    /// Daemon `name` (as messages call it: `hostd`, `vdev alpha`) from
    /// `binary`, with `<dir>/<file>.sock` and `<dir>/<file>.log`.
    pub fn new(name: impl Into<String>, binary: &Path, dir: &Path, file: &str) -> Self {
        Self {
            name: name.into(),
            binary: binary.into(),
            socket: dir.join(format!("{file}.sock")),
            log: dir.join(format!("{file}.log")),
            args: Vec::new(),
            log_level: "info".into(),
            netns: None,
        }
    }

    /// hostd in `dir`, on its embedded default policy unless `--policy`
    /// is added.
    pub fn hostd(binary: &Path, dir: &Path) -> Self {
        Self::new("hostd", binary, dir, "hostd")
    }

    /// vdev for `tenant` in `dir`, attached to the hostd listening on
    /// `hostd` if given.
    pub fn vdev(binary: &Path, dir: &Path, tenant: &str, hostd: Option<&Path>) -> Self {
        let launch = Self::new(format!("vdev {tenant}"), binary, dir, tenant)
            .arg("--tenant")
            .arg(tenant);
        match hostd {
            Some(socket) => launch.arg("--hostd").arg(socket),
            None => launch,
        }
    }

    /// Names its socket and log `<file>.sock` and `<file>.log` instead, in
    /// the same directory (two daemons of one name in one directory).
    pub fn file(mut self, file: &str) -> Self {
        self.socket.set_file_name(format!("{file}.sock"));
        self.log.set_file_name(format!("{file}.log"));
        self
    }

    /// Adds a command-line argument.
    pub fn arg(mut self, arg: impl AsRef<OsStr>) -> Self {
        self.args.push(arg.as_ref().to_owned());
        self
    }

    /// Adds command-line arguments.
    pub fn args<I: IntoIterator<Item = S>, S: AsRef<OsStr>>(mut self, args: I) -> Self {
        self.args
            .extend(args.into_iter().map(|a| a.as_ref().to_owned()));
        self
    }

    /// The daemon's `VRDMA_LOG` (default `info`).
    pub fn log_level(mut self, level: &str) -> Self {
        self.log_level = level.into();
        self
    }

    /// Runs it inside network namespace `netns`: a name (`ip netns`'s, a
    /// file in `/run/netns`) or the path of a namespace file
    /// (`/proc/PID/ns/net`). Without it, it runs in this process's.
    pub fn netns(mut self, netns: impl AsRef<Path>) -> Self {
        self.netns = Some(netns_path(netns.as_ref()));
        self
    }

    /// The network namespace it runs in, if not this process's.
    pub fn netns_file(&self) -> Option<&Path> {
        self.netns.as_deref()
    }

    /// The socket it will listen on.
    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// Starts the daemon and waits (up to [`TIMEOUT`]) until it listens.
    pub fn start(self) -> Result<Daemon, Error> {
        let child = self.spawn()?;
        let mut daemon = Daemon {
            launch: self,
            child,
        };
        daemon.wait_listening()?;
        Ok(daemon)
    }

    fn spawn(&self) -> Result<Child, Error> {
        let log = File::options()
            .create(true)
            .append(true)
            .open(&self.log)
            .map_err(|source| Error::Write {
                path: self.log.clone(),
                source,
            })?;
        let mut command = Command::new(&self.binary);
        if let Some(netns) = &self.netns {
            enter_netns(&mut command, netns)?;
        }
        command
            .arg("--socket")
            .arg(&self.socket)
            .args(&self.args)
            .env(
                "VRDMA_LOG",
                // A debugging run's level for every daemon.
                std::env::var_os("VRDMA_DAEMON_LOG")
                    .unwrap_or_else(|| self.log_level.clone().into()),
            )
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .map_err(|source| Error::Spawn {
                name: self.name.clone(),
                binary: self.binary.clone(),
                source,
            })
    }
}

/// A daemon running as a child process; killed on drop if still running.
#[derive(Debug)]
pub struct Daemon {
    launch: Launch,
    child: Child,
}

impl Daemon {
    /// What messages call it: `hostd`, `vdev alpha`.
    pub fn name(&self) -> &str {
        &self.launch.name
    }

    /// The unix socket it listens on.
    pub fn socket(&self) -> &Path {
        &self.launch.socket
    }

    /// Its log file.
    pub fn log_path(&self) -> &Path {
        &self.launch.log
    }

    /// Its process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Everything it logged so far (empty if the log cannot be read).
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.launch.log).unwrap_or_default()
    }

    /// Its name, log file and the last `lines` lines of its log, indented.
    pub fn log_tail(&self, lines: usize) -> String {
        let log = self.log();
        let all: Vec<&str> = log.lines().collect();
        let tail = if all.is_empty() {
            "(empty)".to_owned()
        } else {
            all[all.len().saturating_sub(lines)..].join("\n    ")
        };
        format!(
            "{} log ({}), last lines:\n    {tail}",
            self.name(),
            self.log_path().display()
        )
    }

    /// How it exited, if it did.
    pub fn exit_status(&mut self) -> Option<ExitStatus> {
        self.child.try_wait().ok().flatten()
    }

    /// Whether it still runs.
    pub fn is_running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    fn poll_exit(&mut self) -> Result<Option<ExitStatus>, Error> {
        self.child.try_wait().map_err(|source| Error::Wait {
            name: self.launch.name.clone(),
            source,
        })
    }

    /// Waits until its socket is listed as listening in `/proc/net/unix`
    /// (its file exists a moment before that).
    fn wait_listening(&mut self) -> Result<(), Error> {
        let deadline = Instant::now() + TIMEOUT;
        // A socket made in another network namespace is listed in that
        // namespace's table, which the daemon's /proc shows.
        let table = match self.launch.netns {
            Some(_) => PathBuf::from(format!("/proc/{}/net/unix", self.child.id())),
            None => PathBuf::from("/proc/net/unix"),
        };
        while !unix_listening_in(&self.launch.socket, &table) {
            if let Some(status) = self.poll_exit()? {
                return Err(Error::ExitedEarly {
                    name: self.launch.name.clone(),
                    status,
                    socket: self.launch.socket.clone(),
                    log: self.log_tail(LOG_TAIL),
                });
            }
            if Instant::now() >= deadline {
                return Err(Error::NotListening {
                    name: self.launch.name.clone(),
                    socket: self.launch.socket.clone(),
                    timeout: TIMEOUT,
                    log: self.log_tail(LOG_TAIL),
                });
            }
            std::thread::sleep(POLL);
        }
        Ok(())
    }

    /// Waits up to `timeout` for it to exit on its own.
    pub fn wait_exit(&mut self, timeout: Duration) -> Result<ExitStatus, Error> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.poll_exit()? {
                return Ok(status);
            }
            if Instant::now() >= deadline {
                return Err(Error::StillRunning {
                    name: self.launch.name.clone(),
                    timeout,
                });
            }
            std::thread::sleep(POLL);
        }
    }

    /// Sends `signal` (e.g. `libc::SIGHUP`); an error if it already exited.
    pub fn signal(&mut self, signal: i32) -> Result<(), Error> {
        if let Some(status) = self.poll_exit()? {
            return Err(Error::AlreadyExited {
                name: self.launch.name.clone(),
                status,
            });
        }
        let failed = |source| Error::Signal {
            name: self.launch.name.clone(),
            signal,
            source,
        };
        let pid = libc::pid_t::try_from(self.child.id())
            .map_err(|_| failed(io::Error::from_raw_os_error(libc::ESRCH)))?;
        // SAFETY: kill(2) touches no memory of this process. `pid` is our
        // child and not yet reaped (try_wait just saw it running), so no
        // other process can have its pid.
        if unsafe { libc::kill(pid, signal) } != 0 {
            return Err(failed(io::Error::last_os_error()));
        }
        Ok(())
    }

    /// Stops it as a service manager does, with SIGTERM, and waits up to
    /// [`TIMEOUT`] for it to exit.
    pub fn stop(&mut self) -> Result<ExitStatus, Error> {
        self.signal(libc::SIGTERM)?;
        self.wait_exit(TIMEOUT)
    }

    /// Kills it (SIGKILL), as a crash would, and reaps it.
    pub fn kill(&mut self) {
        // Fails only when it has exited already: nothing left to do.
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Kills it and starts it again with the same arguments on the same
    /// socket, as a supervisor does after a crash; the log goes on in the
    /// same file. Waits until the new process listens.
    pub fn restart(&mut self) -> Result<(), Error> {
        self.kill();
        // The dead process's socket file stays behind and vdev refuses to
        // bind over a file it did not make.
        let _ = std::fs::remove_file(&self.launch.socket);
        self.child = self.launch.spawn()?;
        self.wait_listening()
    }

    /// Upgrades it by handover (hostd only): starts a new process with the
    /// same arguments and `--take-over`, which takes the running one's
    /// sockets and state; waits (up to [`TIMEOUT`]) until the running one
    /// has exited, and returns how. The new process is this daemon from
    /// then on (its log goes on in the same file).
    pub fn hand_over(&mut self) -> Result<ExitStatus, Error> {
        let mut next = self.launch.clone().arg("--take-over").spawn()?;
        match self.wait_exit(TIMEOUT) {
            Ok(status) => {
                self.child = next;
                Ok(status)
            }
            Err(e) => {
                let _ = next.kill();
                let _ = next.wait();
                Err(e)
            }
        }
    }

    /// How many of its threads run under a seccomp filter, of how many
    /// (from `/proc`; none of none once it exited).
    pub fn seccomp_threads(&self) -> (usize, usize) {
        let tasks = std::fs::read_dir(format!("/proc/{}/task", self.pid()));
        let status = |t: std::fs::DirEntry| std::fs::read_to_string(t.path().join("status"));
        let all: Vec<String> = tasks
            .into_iter()
            .flatten()
            .flatten()
            .flat_map(status)
            .collect();
        let filtered = all.iter().filter(|s| s.contains("\nSeccomp:\t2\n")).count();
        (filtered, all.len())
    }

    /// Waits up to `timeout` until its log holds `needle` at least `count`
    /// times.
    pub fn wait_logged(&self, needle: &str, count: usize, timeout: Duration) -> Result<(), Error> {
        let deadline = Instant::now() + timeout;
        while self.log().matches(needle).count() < count {
            if Instant::now() >= deadline {
                return Err(Error::NotLogged {
                    name: self.launch.name.clone(),
                    needle: needle.into(),
                    count,
                    timeout,
                });
            }
            std::thread::sleep(POLL);
        }
        Ok(())
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Whether the unix socket at `path` listens. Its file exists from the
/// socket's bind on, and a daemon that binds and then listens (vdev) is
/// not listening for a moment after: `/proc/net/unix` tells (flag
/// `__SO_ACCEPTCON`). A socket it does not list by that path (hostd binds
/// a temporary name and renames it into place once it listens; a socket
/// made in another network namespace) listens once its file exists.
pub fn unix_listening(path: &Path) -> bool {
    unix_listening_in(path, Path::new("/proc/net/unix"))
}

/// [`unix_listening`], looking the socket up in `table` (the
/// `/proc/PID/net/unix` of a process in another network namespace).
pub fn unix_listening_in(path: &Path, table: &Path) -> bool {
    const ACCEPTING: u32 = 0x0001_0000;
    if !path.exists() {
        return false;
    }
    let table = std::fs::read_to_string(table).unwrap_or_default();
    // Num RefCount Protocol Flags Type St Inode Path
    let flags = table.lines().skip(1).find_map(|line| {
        let fields: Vec<&str> = line.split_whitespace().collect();
        let named = fields.get(7).is_some_and(|p| Path::new(p) == path);
        named.then(|| fields.get(3).and_then(|f| u32::from_str_radix(f, 16).ok()))
    });
    match flags {
        Some(flags) => flags.unwrap_or(0) & ACCEPTING != 0,
        None => true,
    }
}

/// The file of network namespace `netns`: `/run/netns/<netns>` for a bare
/// name (as `ip netns add` makes them), else `netns` itself.
pub fn netns_path(netns: &Path) -> PathBuf {
    if netns.components().count() == 1 && !netns.is_absolute() {
        Path::new("/run/netns").join(netns)
    } else {
        netns.to_owned()
    }
}

/// Makes `command` run inside network namespace `netns` (a name or a path,
/// as [`Launch::netns`]): the namespace file is opened now (an error if it
/// does not exist), and the child joins it with `setns(2)` between fork and
/// exec. Everything else about the child is unchanged.
pub fn enter_netns(command: &mut Command, netns: &Path) -> Result<(), Error> {
    let path = netns_path(netns);
    let file = File::open(&path).map_err(|source| Error::Netns {
        path: path.clone(),
        source,
    })?;
    // SAFETY: the hook runs in the child between fork and exec, where only
    // async-signal-safe calls are allowed: it makes one system call,
    // setns(2), on the fd of `file`, which the closure owns (the Command
    // keeps it, so the fd is open in the parent when it forks and thus in
    // the child; it is close-on-exec, so the program does not inherit it).
    // It allocates nothing, takes no lock and touches no memory but the
    // integer fd and errno. A failure makes spawn return the error.
    unsafe {
        command.pre_exec(move || {
            if libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) != 0 {
                return Err(io::Error::last_os_error());
            }
            Ok(())
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_listening_socket_is_seen_and_a_missing_one_is_not() {
        let dir = Scratch::new("supervisor-listen").expect("scratch");
        let path = dir.path().join("s.sock");
        assert!(!unix_listening(&path));
        let listener = std::os::unix::net::UnixListener::bind(&path).expect("bind");
        assert!(unix_listening(&path));
        drop(listener);
        let _ = std::fs::remove_file(&path);
        assert!(!unix_listening(&path));
    }

    #[test]
    fn a_network_namespace_is_a_name_in_run_netns_or_a_path() {
        assert_eq!(netns_path(Path::new("h1")), Path::new("/run/netns/h1"));
        let proc = Path::new("/proc/1/ns/net");
        assert_eq!(netns_path(proc), proc);
        assert_eq!(netns_path(Path::new("./h1")), Path::new("./h1"));
        let dir = Scratch::new("supervisor-netns").expect("scratch");
        let launch = Launch::new("true", Path::new("/bin/true"), dir.path(), "true")
            .netns(dir.path().join("no-such-namespace"));
        match launch.start() {
            Err(Error::Netns { path, .. }) => assert!(path.ends_with("no-such-namespace")),
            other => panic!("expected Netns, got {other:?}"),
        }
    }

    #[test]
    fn a_daemon_that_exits_before_listening_is_an_error_with_its_status() {
        let mut dir = Scratch::new("supervisor-exit").expect("scratch");
        let launch = Launch::new("false", Path::new("/bin/false"), dir.path(), "false");
        match launch.start() {
            Err(Error::ExitedEarly { name, status, .. }) => {
                assert_eq!((name.as_str(), status.code()), ("false", Some(1)));
            }
            other => panic!("expected ExitedEarly, got {other:?}"),
        }
        let missing = Launch::new("gone", &dir.path().join("gone"), dir.path(), "gone");
        assert!(matches!(missing.start(), Err(Error::Spawn { .. })));
        let kept = dir.path().to_owned();
        dir.set_keep(true);
        drop(dir);
        assert!(kept.exists(), "a kept scratch directory stays");
        std::fs::remove_dir_all(&kept).expect("clean up");
    }
}
