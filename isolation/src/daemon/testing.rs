//! What the daemons' tests share (cargo feature `testing`; the daemons
//! turn it on in their dev-dependencies): a command line parsed as the
//! daemon parses its own, a scratch directory for the files a test writes,
//! and a daemon process started by a sandbox test ([`DaemonProcess`]).

use std::fs::File;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

/// Every sandbox flag at once, each away from its default (a daemon's
/// tests parse it as the daemon's own flags).
pub const EVERY_SANDBOX_FLAG: &[&str] = &[
    "--seccomp",
    "trap",
    "--landlock",
    "off",
    "--allow-no-landlock",
    "--sandbox",
    "namespace",
    "--uid",
    "nobody",
    "--rlimit-nofile",
    "4096",
];

/// `daemon`'s command line `args` (after the program's name), which clap
/// must accept (a test helper: it panics otherwise), validated into the
/// daemon's configuration `C`.
pub fn parse_command_line<A: clap::Parser, C: TryFrom<A>>(
    daemon: &str,
    args: &[&str],
) -> Result<C, C::Error> {
    let line = std::iter::once(daemon).chain(args.iter().copied());
    C::try_from(A::try_parse_from(line).expect("clap accepts"))
}

/// A directory of one test's own, removed with its files on drop.
#[derive(Debug)]
pub struct ScratchDir(PathBuf);

impl ScratchDir {
    /// `<tmp>/<name>-<pid>`, new and empty: `name` tells it apart from the
    /// directories of the other tests of the process, which run at the
    /// same time.
    pub fn new(name: &str) -> ScratchDir {
        let dir = std::env::temp_dir().join(format!("{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("scratch dir");
        ScratchDir(dir)
    }

    pub fn path(&self) -> &Path {
        &self.0
    }

    /// The file `name` in the directory, written with `contents`.
    pub fn write(&self, name: &str, contents: impl AsRef<[u8]>) -> PathBuf {
        let path = self.0.join(name);
        std::fs::write(&path, contents).expect("write scratch file");
        path
    }
}

impl Drop for ScratchDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A path as a command-line argument (the scratch directory's paths are
/// UTF-8).
pub fn arg(path: &Path) -> &str {
    path.to_str().expect("utf-8 path")
}

/// The environment that makes a daemon built with `test-hooks` attempt
/// `op` once its sandbox is up (see `vrdma_isolation::test_hooks`).
pub fn attempt(op: &str) -> [(&'static str, &str); 1] {
    [("VRDMA_TEST_FORBIDDEN", op)]
}

/// The same, in the first thread of `role` instead, right after it has
/// installed its role's filter.
pub fn attempt_in<'a>(op: &'a str, role: &'a str) -> [(&'static str, &'a str); 2] {
    [
        ("VRDMA_TEST_FORBIDDEN", op),
        ("VRDMA_TEST_FORBIDDEN_IN", role),
    ]
}

/// Test-hook operations that no thread of any daemon may make, with the
/// system call the filter stops each at.
pub const NEVER_ALLOWED: [(&str, i64); 2] = [
    ("execve", libc::SYS_execve),
    ("inet-socket", libc::SYS_socket),
];

/// What the test hooks log for an attempt that went through.
pub const SUCCEEDED: &str = "succeeded";

/// What the test hooks log for an attempt refused with `errno`.
pub fn failed(errno: i32) -> String {
    format!("failed: errno {errno}")
}

/// How long a daemon gets to log a line or to exit.
const PATIENCE: Duration = Duration::from_secs(10);

/// A daemon process a test started, in a scratch directory of its own
/// that also holds its log (stderr); killed on drop. The checks of the
/// daemons' sandbox tests, from the outside: what it logs (the test hooks'
/// outcomes among it), how it ends, what the kernel says of its walls.
#[derive(Debug)]
pub struct DaemonProcess {
    child: Child,
    /// The daemon's name, for failure messages.
    name: String,
    log: PathBuf,
    dir: ScratchDir,
}

impl DaemonProcess {
    /// A scratch directory for the daemon `name` in the test `tag`, a new
    /// one on every call (tests start several daemons, at the same time).
    pub fn scratch(name: &str, tag: &str) -> ScratchDir {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        ScratchDir::new(&format!("{name}-sandbox-{tag}-{n}"))
    }

    /// Starts `command`, the daemon `name` with its arguments and
    /// environment, its stderr in `<name>.log` of `dir`.
    pub fn start(name: &str, mut command: Command, dir: ScratchDir) -> DaemonProcess {
        let log = dir.path().join(format!("{name}.log"));
        let child = command
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(File::create(&log).expect("log file"))
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {name}: {e}"));
        DaemonProcess {
            child,
            name: name.to_owned(),
            log,
            dir,
        }
    }

    /// The daemon's scratch directory.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// The file `name` of the daemon's scratch directory (its socket, its
    /// config...).
    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// What the daemon has logged so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Waits until the log contains `needle` (or the daemon exits, or
    /// 10 s); the log.
    pub fn wait_for_log(&mut self, needle: &str) -> String {
        self.wait_for_logged(needle, 1)
    }

    /// Waits until the log contains `needle` `times` times (or the daemon
    /// exits, or 10 s); the log.
    pub fn wait_for_logged(&mut self, needle: &str, times: usize) -> String {
        let deadline = Instant::now() + PATIENCE;
        loop {
            let log = self.log();
            if log.matches(needle).count() >= times {
                return log;
            }
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!(
                    "{} exited ({status}) before logging {needle:?}:\n{log}",
                    self.name
                );
            }
            assert!(
                Instant::now() < deadline,
                "{} did not log {needle:?} within 10 s:\n{log}",
                self.name
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Waits for the test hook's attempt of `op` (`VRDMA_TEST_FORBIDDEN`),
    /// made in a thread of `role` (`VRDMA_TEST_FORBIDDEN_IN`) if given, and
    /// checks its outcome is `expected` ([`SUCCEEDED`] or [`failed`]); the
    /// log.
    pub fn expect_hook(&mut self, op: &str, role: Option<&str>, expected: &str) -> String {
        let attempt = match role {
            Some(role) => format!("test hook ({role}): {op}: "),
            None => format!("test hook: {op}: "),
        };
        let log = self.wait_for_log(&attempt);
        assert!(
            log.lines()
                .any(|line| line.ends_with(&format!("{attempt}{expected}"))),
            "{} logged no {attempt}{expected}:\n{log}",
            self.name
        );
        log
    }

    /// Under `--seccomp trap`: waits for the test hook's attempt of `op`
    /// (in a thread of `role` if given) and checks that the filter made
    /// the system call `nr` fail with `EPERM` and reported it; the log.
    pub fn expect_trapped(&mut self, op: &str, role: Option<&str>, nr: i64) -> String {
        let log = self.expect_hook(op, role, &failed(libc::EPERM));
        assert!(
            log.contains(&format!("seccomp (trap): blocked system call {nr}")),
            "{} reported no trapped call {nr}:\n{log}",
            self.name
        );
        log
    }

    /// Waits for the daemon to exit (10 s at most).
    pub fn wait_exit(&mut self) -> ExitStatus {
        let deadline = Instant::now() + PATIENCE;
        loop {
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                return status;
            }
            assert!(
                Instant::now() < deadline,
                "{} still runs after 10 s:\n{}",
                self.name,
                self.log()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Waits for the daemon's end by seccomp's `SIGSYS`: a call no filter
    /// of it allows (what `context` says, for the failure message).
    pub fn assert_killed_by_sigsys(&mut self, context: &str) {
        let status = self.wait_exit();
        assert_eq!(
            status.signal(),
            Some(libc::SIGSYS),
            "{context}: {status}:\n{}",
            self.log()
        );
    }

    pub fn is_running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// A field of `/proc/<pid>/status`, e.g. `Uid` or `Seccomp`.
    pub fn status_field(&self, field: &str) -> String {
        let status =
            std::fs::read_to_string(format!("/proc/{}/status", self.pid())).expect("proc status");
        status
            .lines()
            .find_map(|l| l.strip_prefix(&format!("{field}:")))
            .map(|v| v.trim().to_owned())
            .unwrap_or_else(|| panic!("no {field} in /proc status"))
    }

    /// Every wall up, as the kernel sees it: a seccomp filter,
    /// no_new_privs and no capabilities; started as root, also uid and gid
    /// nobody and an empty bounding set.
    pub fn assert_walls_up(&self) {
        assert_eq!(self.status_field("Seccomp"), "2", "filter mode");
        assert_eq!(self.status_field("NoNewPrivs"), "1");
        for caps in ["CapEff", "CapPrm", "CapAmb"] {
            assert_eq!(self.status_field(caps), "0000000000000000", "{caps}");
        }
        if crate::privileges::started_as_root() {
            for ids in ["Uid", "Gid"] {
                let ids = self.status_field(ids);
                assert!(
                    ids.split_whitespace().all(|id| id == "65534"),
                    "started as root, {} runs as nobody: {ids}",
                    self.name
                );
            }
            assert_eq!(self.status_field("CapBnd"), "0000000000000000");
        }
    }

    /// Whether the daemon runs in a network namespace other than the
    /// test's.
    pub fn has_own_network_namespace(&self) -> bool {
        let own = std::fs::read_link("/proc/self/ns/net").expect("own netns");
        let its = std::fs::read_link(format!("/proc/{}/ns/net", self.pid())).expect("netns");
        own != its
    }

    /// Sends the daemon `signal`.
    pub fn signal(&self, signal: libc::c_int) {
        // SAFETY: kill with the pid of our child and a valid signal.
        let rc = unsafe { libc::kill(self.pid() as libc::pid_t, signal) };
        assert_eq!(rc, 0, "kill: {}", std::io::Error::last_os_error());
    }
}

impl Drop for DaemonProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
