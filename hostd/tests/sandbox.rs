//! hostd's sandbox from the outside: the real `hostd` binary, started the
//! way an operator starts it, made to misbehave from inside its sandbox
//! through the `test-hooks` feature (`VRDMA_TEST_FORBIDDEN`), and driven
//! by protocol clients to show that the sandbox does not get in the way of
//! serving (registration, RDMA between two tenants, policy reload).
//!
//! Needs the `test-hooks` feature (`required-features` in Cargo.toml);
//! `cargo test` enables it through hostd's dev-dependency on itself.

mod common;

use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::ExitStatusExt;
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use common::{config, pair, policy, Client, IOVA};
use vrdma_spec::verbs::WcStatus;

const HOSTD: &str = env!("CARGO_BIN_EXE_hostd");

/// A hostd process in its own scratch directory, logging to a file;
/// killed on drop.
struct Sandboxed {
    child: Child,
    dir: PathBuf,
    socket: PathBuf,
    policy: PathBuf,
    log: PathBuf,
}

impl Sandboxed {
    fn start(tag: &str, args: &[&str], env: &[(&str, &str)]) -> Sandboxed {
        use std::sync::atomic::{AtomicU32, Ordering};
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let dir =
            std::env::temp_dir().join(format!("hostd-sandbox-{tag}-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("scratch dir");
        let socket = dir.join("hostd.sock");
        let policy_file = dir.join("policy.toml");
        std::fs::write(&policy_file, policy()).expect("policy");
        let config_file = dir.join("hostd.toml");
        std::fs::write(&config_file, config(16)).expect("config");
        let log = dir.join("hostd.log");
        let child = Command::new(HOSTD)
            .arg("--config")
            .arg(&config_file)
            .arg("--socket")
            .arg(&socket)
            .arg("--policy")
            .arg(&policy_file)
            .args(args)
            .envs(env.iter().copied())
            .env("VRDMA_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).expect("log file"))
            .spawn()
            .expect("spawn hostd");
        Sandboxed {
            child,
            dir,
            socket,
            policy: policy_file,
            log,
        }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Waits until the log contains `needle` (or hostd exits, or 10 s).
    fn wait_for_log(&mut self, needle: &str) -> String {
        self.wait_for_logged(needle, 1)
    }

    /// Waits until the log contains `needle` `times` times (or hostd
    /// exits, or 10 s).
    fn wait_for_logged(&mut self, needle: &str, times: usize) -> String {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let log = self.log();
            if log.matches(needle).count() >= times {
                return log;
            }
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!("hostd exited ({status}) before logging {needle:?}:\n{log}");
            }
            assert!(
                Instant::now() < deadline,
                "hostd did not log {needle:?} within 10 s:\n{log}"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    fn sighup(&self) {
        // SAFETY: kill with the pid of our child and a valid signal.
        let rc = unsafe { libc::kill(self.child.id() as libc::pid_t, libc::SIGHUP) };
        assert_eq!(rc, 0);
    }

    /// Waits for hostd to exit (at most 10 s).
    fn wait_exit(&mut self) -> ExitStatus {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                return status;
            }
            assert!(
                Instant::now() < deadline,
                "hostd still runs after 10 s:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// A line of `/proc/<hostd>/status`, e.g. `Seccomp`.
    fn status_field(&self, field: &str) -> String {
        let status =
            std::fs::read_to_string(format!("/proc/{}/status", self.child.id())).expect("status");
        status
            .lines()
            .find_map(|l| l.strip_prefix(&format!("{field}:")))
            .unwrap_or_else(|| panic!("no {field} in /proc status"))
            .trim()
            .to_owned()
    }
}

impl Drop for Sandboxed {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

const SERVING: &str = "hostd serving";

#[test]
fn forbidden_system_calls_kill_hostd_with_sigsys() {
    for op in ["execve", "inet-socket"] {
        let mut hostd = Sandboxed::start(op, &[], &[("VRDMA_TEST_FORBIDDEN", op)]);
        let status = hostd.wait_exit();
        assert_eq!(
            status.signal(),
            Some(libc::SIGSYS),
            "{op}: {status}\n{}",
            hostd.log()
        );
    }
}

#[test]
fn under_trap_forbidden_calls_fail_with_eperm_and_hostd_serves_on() {
    for op in ["execve", "inet-socket"] {
        let mut hostd = Sandboxed::start(
            &format!("trap-{op}"),
            &["--seccomp", "trap"],
            &[("VRDMA_TEST_FORBIDDEN", op)],
        );
        let log = hostd.wait_for_log(&format!("test hook: {op}: "));
        assert!(
            log.contains(&format!("test hook: {op}: failed: errno {}", libc::EPERM)),
            "{log}"
        );
        assert!(log.contains("seccomp (trap): blocked system call"), "{log}");
        hostd.wait_for_log(SERVING);
        Client::hello(&hostd.socket, "alpha", "vm0").expect("hostd still serves");
    }
}

#[test]
fn landlock_refuses_files_outside_the_policy_file() {
    let mut hostd = Sandboxed::start("passwd", &[], &[("VRDMA_TEST_FORBIDDEN", "open-passwd")]);
    let log = hostd.wait_for_log("test hook: open-passwd: ");
    assert!(
        log.contains(&format!(
            "test hook: open-passwd: failed: errno {}",
            libc::EACCES
        )),
        "{log}"
    );
    // The wall, not the file's permissions, refused it.
    let mut open = Sandboxed::start(
        "passwd-off",
        &["--landlock", "off"],
        &[("VRDMA_TEST_FORBIDDEN", "open-passwd")],
    );
    let log = open.wait_for_log("test hook: open-passwd: ");
    assert!(log.contains("test hook: open-passwd: succeeded"), "{log}");
}

#[test]
fn a_kernel_without_landlock_is_refused_unless_allowed() {
    let absent = [("VRDMA_TEST_LANDLOCK", "absent")];
    let mut refused = Sandboxed::start("no-landlock", &[], &absent);
    let status = refused.wait_exit();
    assert_eq!(status.code(), Some(1), "{}", refused.log());
    assert!(
        refused.log().contains("--allow-no-landlock"),
        "{}",
        refused.log()
    );
    let mut allowed = Sandboxed::start("no-landlock-ok", &["--allow-no-landlock"], &absent);
    let log = allowed.wait_for_log(SERVING);
    assert!(log.contains("LANDLOCK NOT ENFORCED"), "{log}");
}

#[test]
fn a_sandboxed_hostd_serves_rdma_and_reloads_its_policy() {
    let mut hostd = Sandboxed::start("serve", &[], &[]);
    let log = hostd.wait_for_log(SERVING);
    assert!(
        log.contains("seccomp filter installed on every thread"),
        "{log}"
    );
    assert!(log.contains("Landlock: no file-system access but reading the policy file"));
    // Every wall is up, as the kernel sees it.
    assert_eq!(hostd.status_field("Seccomp"), "2");
    assert_eq!(hostd.status_field("NoNewPrivs"), "1");
    assert_eq!(hostd.status_field("CapEff"), "0000000000000000");
    assert_eq!(hostd.status_field("CapBnd"), "0000000000000000");
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0 {
        let uids = hostd.status_field("Uid");
        assert!(
            uids.split_whitespace().all(|u| u == "65534"),
            "started as root, hostd runs as nobody: {uids}"
        );
    }
    // Any uid may connect to the vdev socket; only hostd's owner to the
    // admin socket.
    let mode = |p: &PathBuf| {
        std::fs::metadata(p)
            .expect("socket metadata")
            .permissions()
            .mode()
            & 0o777
    };
    assert_eq!(mode(&hostd.socket), 0o666);
    let mut admin = hostd.socket.clone().into_os_string();
    admin.push(".admin");
    assert_eq!(mode(&PathBuf::from(admin)), 0o600);

    // Two tenants set their devices up (a sealed memfd, the doorbell and
    // event ring's eventfds, rings, hostd-assigned keys) and alpha writes
    // into beta's memory through the datapath threads.
    let (mut alpha, beta) = pair(&hostd.socket);
    let rkey = beta.rkey();
    for i in 0..10u64 {
        let data = format!("sandboxed write {i}");
        alpha.driver().fill(0x40, data.as_bytes());
        alpha.write(0, i, 0x40, data.len() as u32, IOVA + 0x8000, rkey);
        assert_eq!(alpha.poll_one(), WcStatus::Success);
        assert_eq!(beta.driver().bytes(0x8000, data.len()), data.as_bytes());
        if i % 3 == 0 {
            // Let the datapath go to sleep in epoll and wake again.
            std::thread::sleep(Duration::from_millis(5));
        }
    }
    assert!(
        alpha.kicks > 0,
        "the sandboxed datapath slept and was kicked"
    );

    // Reload on SIGHUP reads the policy file through landlock's one rule:
    // rewritten in place, and replaced by a rename (a new inode), as
    // editors and configuration managers do.
    std::fs::write(&hostd.policy, policy()).expect("rewrite policy");
    hostd.sighup();
    let log = hostd.wait_for_logged("Policy reloaded", 1);
    assert!(!log.contains("Policy reload failed"), "{log}");
    let staged = hostd.dir.join(".policy.toml.new");
    std::fs::write(&staged, policy()).expect("stage policy");
    std::fs::rename(&staged, &hostd.policy).expect("replace policy");
    hostd.sighup();
    let log = hostd.wait_for_logged("Policy reloaded", 2);
    assert!(!log.contains("Policy reload failed"), "{log}");
}
