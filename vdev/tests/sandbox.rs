//! vdev's sandbox from the outside: the real `vdev` binary, started the
//! way an operator starts it, made to misbehave from inside its sandbox
//! through the `test-hooks` feature (`VRDMA_TEST_FORBIDDEN`), and driven
//! by a real frontend (the guest driver in process mode) to show that the
//! sandbox does not get in the way of serving.
//!
//! Needs the `test-hooks` feature (`required-features` in Cargo.toml);
//! `cargo test` enables it through vdev's dev-dependency on itself.

use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use vrdma_guest_driver::{Context, QpCapabilities, QpInitAttr};
use vrdma_spec::verbs::{access, QpType};

const VDEV: &str = env!("CARGO_BIN_EXE_vdev");
/// What vdev logs once its seccomp filters are up.
const SECCOMP_UP: &str = "seccomp: a filter per thread role";

/// A vdev process in its own scratch directory; killed on drop.
struct Vdev {
    child: Child,
    dir: PathBuf,
    socket: PathBuf,
    log: PathBuf,
}

impl Vdev {
    fn start(tag: &str, args: &[&str], env: &[(&str, &str)]) -> Vdev {
        use std::sync::atomic::{AtomicU32, Ordering};
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let dir =
            std::env::temp_dir().join(format!("vrdma-sandbox-{tag}-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("scratch dir");
        let socket = dir.join("vdev.sock");
        let log = dir.join("vdev.log");
        let child = Command::new(VDEV)
            .arg("--socket")
            .arg(&socket)
            .args(["--tenant", tag])
            .args(args)
            .envs(env.iter().copied())
            .env("VRDMA_LOG", "debug")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).expect("log file"))
            .spawn()
            .expect("spawn vdev");
        Vdev {
            child,
            dir,
            socket,
            log,
        }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Waits until the log contains `needle` (or vdev exits, or 10 s).
    fn wait_for_log(&mut self, needle: &str) -> String {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let log = self.log();
            if log.contains(needle) {
                return log;
            }
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!("vdev exited ({status}) before logging {needle:?}:\n{log}");
            }
            assert!(
                Instant::now() < deadline,
                "vdev did not log {needle:?} within 10 s:\n{log}"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Waits for vdev to exit (10 s at most).
    fn wait_exit(&mut self) -> ExitStatus {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                return status;
            }
            assert!(
                Instant::now() < deadline,
                "vdev still runs after 10 s:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    fn is_running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// A line of /proc/<pid>/status, e.g. `Uid` or `Seccomp`.
    fn status_field(&self, field: &str) -> String {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id()))
            .expect("proc status");
        status
            .lines()
            .find_map(|l| l.strip_prefix(&format!("{field}:")))
            .map(|v| v.trim().to_owned())
            .unwrap_or_else(|| panic!("no {field} in status"))
    }
}

impl Drop for Vdev {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Opens the device as an application would and runs the control path:
/// queries, PD, a registered memory region (guest memory mapped by vdev),
/// CQ, QP — and tears it all down.
fn serve_one_application(socket: &Path) {
    let deadline = Instant::now() + Duration::from_secs(10);
    let ctx = loop {
        match Context::open_vhost_user(socket) {
            Ok(ctx) => break ctx,
            Err(e) => {
                assert!(Instant::now() < deadline, "cannot open the device: {e}");
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    };
    let attr = ctx.query_device().expect("query_device");
    assert_eq!(attr.phys_port_cnt, 1);
    let pd = ctx.alloc_pd().expect("alloc_pd");
    let mr = pd
        .alloc_mr(1 << 16, access::LOCAL_WRITE | access::REMOTE_WRITE)
        .expect("reg_mr");
    mr.write(0, b"sandboxed").expect("write");
    let cq = ctx.create_cq(64, 0).expect("create_cq");
    let qp = pd
        .create_qp(&QpInitAttr {
            send_cq: &cq,
            recv_cq: &cq,
            cap: QpCapabilities {
                max_send_wr: 16,
                max_recv_wr: 16,
                max_send_sge: 1,
                max_recv_sge: 1,
                max_inline_data: 0,
            },
            qp_type: QpType::Rc,
            sq_sig_all: false,
        })
        .expect("create_qp");
    qp.destroy().map_err(|e| e.error).expect("destroy qp");
    cq.destroy().map_err(|e| e.error).expect("destroy cq");
    mr.dereg().map_err(|e| e.error).expect("dereg mr");
    pd.destroy().map_err(|e| e.error).expect("dealloc pd");
}

/// Whether the running kernel has landlock (`landlock_create_ruleset` with
/// `LANDLOCK_CREATE_RULESET_VERSION` returns the ABI version).
fn kernel_has_landlock() -> bool {
    // SAFETY: a null attribute with size 0 and the VERSION flag only
    // queries the ABI version.
    let abi = unsafe {
        libc::syscall(
            libc::SYS_landlock_create_ruleset,
            std::ptr::null::<libc::c_void>(),
            0usize,
            1u32,
        )
    };
    abi >= 1
}

fn root() -> bool {
    // SAFETY: geteuid cannot fail.
    unsafe { libc::geteuid() == 0 }
}

#[test]
fn the_sandboxed_vdev_serves_frontends_one_after_another() {
    let mut vdev = Vdev::start("serve", &[], &[]);
    let log = vdev.wait_for_log(SECCOMP_UP);
    assert!(log.contains("Privileges dropped"), "{log}");
    // The walls are up, as the kernel sees them.
    assert_eq!(vdev.status_field("Seccomp"), "2", "filter mode");
    assert_eq!(vdev.status_field("NoNewPrivs"), "1");
    assert_eq!(vdev.status_field("CapEff"), "0000000000000000");
    assert_eq!(vdev.status_field("CapPrm"), "0000000000000000");
    assert_eq!(vdev.status_field("CapAmb"), "0000000000000000");
    if root() {
        assert_eq!(vdev.status_field("Uid"), "65534\t65534\t65534\t65534");
        assert_eq!(vdev.status_field("Gid"), "65534\t65534\t65534\t65534");
        assert_eq!(vdev.status_field("CapBnd"), "0000000000000000");
    }
    if kernel_has_landlock() {
        assert!(
            log.contains("Landlock: no file-system access at all"),
            "{log}"
        );
    }
    // Two applications in turn: each gets a fresh device, inside the
    // sandbox (threads started after it, guest memory mapped, eventfds).
    serve_one_application(&vdev.socket);
    serve_one_application(&vdev.socket);
    assert!(vdev.is_running(), "vdev died:\n{}", vdev.log());

    // With --once, vdev ends normally inside its sandbox (the listener's
    // attempt to remove its socket file is refused, not a seccomp kill).
    let mut once = Vdev::start("serve-once", &["--once"], &[]);
    once.wait_for_log(SECCOMP_UP);
    serve_one_application(&once.socket);
    let status = once.wait_exit();
    assert_eq!(status.code(), Some(0), "{status}:\n{}", once.log());
}

#[test]
fn forbidden_system_calls_kill_vdev_with_sigsys() {
    for op in ["execve", "inet-socket"] {
        let mut vdev = Vdev::start("kill", &[], &[("VRDMA_TEST_FORBIDDEN", op)]);
        let status = vdev.wait_exit();
        assert_eq!(
            status.signal(),
            Some(libc::SIGSYS),
            "{op}: {status}:\n{}",
            vdev.log()
        );
        assert!(!vdev.log().contains("test hook: "), "{op} returned");
    }
}

#[test]
fn trap_makes_a_forbidden_call_fail_with_eperm_and_vdev_goes_on() {
    for (op, nr) in [
        ("execve", libc::SYS_execve),
        ("inet-socket", libc::SYS_socket),
    ] {
        let mut vdev = Vdev::start(
            "trap",
            &["--seccomp", "trap"],
            &[("VRDMA_TEST_FORBIDDEN", op)],
        );
        let log = vdev.wait_for_log(&format!("test hook: {op}: "));
        assert!(
            log.contains(&format!("test hook: {op}: failed: errno {}", libc::EPERM)),
            "{log}"
        );
        assert!(
            log.contains(&format!("seccomp (trap): blocked system call {nr}")),
            "{log}"
        );
        serve_one_application(&vdev.socket);
        assert!(vdev.is_running());
    }
}

/// Each thread has its own role's filter: the vhost-user thread (and the
/// threads vhost-user-backend starts from it) cannot create the socket
/// only the main thread needs, to register with hostd, which a thread
/// under the main thread's filter can.
#[test]
fn a_thread_cannot_make_a_call_only_another_role_needs() {
    let op = ("VRDMA_TEST_FORBIDDEN", "unix-socket");
    let in_vhost_user = ("VRDMA_TEST_FORBIDDEN_IN", "vhost-user");
    let mut main = Vdev::start("role-main", &["--seccomp", "trap"], &[op]);
    let log = main.wait_for_log("test hook: unix-socket: ");
    assert!(log.contains("test hook: unix-socket: succeeded"), "{log}");
    drop(main);

    let mut vdev = Vdev::start("role-vhost", &["--seccomp", "trap"], &[op, in_vhost_user]);
    let log = vdev.wait_for_log("test hook (vhost-user): unix-socket: ");
    assert!(
        log.contains(&format!(
            "test hook (vhost-user): unix-socket: failed: errno {}",
            libc::EPERM
        )),
        "{log}"
    );
    assert!(
        log.contains(&format!(
            "seccomp (trap): blocked system call {}",
            libc::SYS_socket
        )),
        "{log}"
    );
    serve_one_application(&vdev.socket);
    assert!(vdev.is_running());
    drop(vdev);

    // Enforced, it is the end of vdev.
    let mut killed = Vdev::start("role-kill", &[], &[op, in_vhost_user]);
    let status = killed.wait_exit();
    assert_eq!(
        status.signal(),
        Some(libc::SIGSYS),
        "{status}:\n{}",
        killed.log()
    );
}

#[test]
fn log_mode_enforces_nothing_but_the_other_walls_still_hold() {
    // An inet socket is let through (and audit-logged by the kernel).
    let mut vdev = Vdev::start(
        "log",
        &["--seccomp", "log"],
        &[("VRDMA_TEST_FORBIDDEN", "inet-socket")],
    );
    let log = vdev.wait_for_log("test hook: inet-socket: ");
    assert!(log.contains("test hook: inet-socket: succeeded"), "{log}");
    drop(vdev);
    // execve passes seccomp, but landlock refuses to execute anything.
    if kernel_has_landlock() {
        let mut vdev = Vdev::start(
            "log-exec",
            &["--seccomp", "log"],
            &[("VRDMA_TEST_FORBIDDEN", "execve")],
        );
        let log = vdev.wait_for_log("test hook: execve: ");
        assert!(
            log.contains(&format!(
                "test hook: execve: failed: errno {}",
                libc::EACCES
            )),
            "{log}"
        );
        assert!(vdev.is_running());
    }
}

#[test]
fn landlock_refuses_to_open_files() {
    let mut vdev = Vdev::start("landlock", &[], &[("VRDMA_TEST_FORBIDDEN", "open-passwd")]);
    if kernel_has_landlock() {
        let log = vdev.wait_for_log("test hook: open-passwd: ");
        assert!(
            log.contains(&format!(
                "test hook: open-passwd: failed: errno {}",
                libc::EACCES
            )),
            "{log}"
        );
        serve_one_application(&vdev.socket);
        assert!(vdev.is_running());
        // Without landlock the same open succeeds (nobody may read
        // /etc/passwd): landlock is the wall that stopped it.
        let mut off = Vdev::start(
            "landlock-off",
            &["--landlock", "off"],
            &[("VRDMA_TEST_FORBIDDEN", "open-passwd")],
        );
        let log = off.wait_for_log("test hook: open-passwd: ");
        assert!(log.contains("test hook: open-passwd: succeeded"), "{log}");
        assert!(log.contains("LANDLOCK IS OFF"), "{log}");
    } else {
        // This kernel has no landlock: vdev refuses to start without it.
        let status = vdev.wait_exit();
        assert_eq!(status.code(), Some(1), "{}", vdev.log());
        assert!(vdev.log().contains("--allow-no-landlock"), "{}", vdev.log());
    }
}

#[test]
fn a_kernel_without_landlock_is_refused_unless_explicitly_allowed() {
    // Simulated (VRDMA_TEST_LANDLOCK=absent) where the kernel has landlock;
    // real where it has not.
    let absent = [("VRDMA_TEST_LANDLOCK", "absent")];
    let mut refused = Vdev::start("no-landlock", &[], &absent);
    let status = refused.wait_exit();
    let log = refused.log();
    assert_eq!(status.code(), Some(1), "{log}");
    assert!(log.contains("does not enforce landlock"), "{log}");
    assert!(log.contains("--allow-no-landlock"), "{log}");

    let mut allowed = Vdev::start("no-landlock-ok", &["--allow-no-landlock"], &absent);
    let log = allowed.wait_for_log(SECCOMP_UP);
    assert!(log.contains("LANDLOCK NOT ENFORCED"), "{log}");
    serve_one_application(&allowed.socket);
    assert!(allowed.is_running());
}

#[test]
fn seccomp_off_is_explicit_and_loud() {
    let mut vdev = Vdev::start(
        "seccomp-off",
        &["--seccomp", "off"],
        &[("VRDMA_TEST_FORBIDDEN", "inet-socket")],
    );
    let log = vdev.wait_for_log("test hook: inet-socket: ");
    assert!(log.contains("SECCOMP IS OFF"), "{log}");
    assert!(log.contains("test hook: inet-socket: succeeded"), "{log}");
    assert_eq!(vdev.status_field("Seccomp"), "0");
}

#[test]
fn namespace_mode_leaves_an_empty_root_and_still_serves() {
    if !root() {
        eprintln!(
            "skipped: --sandbox namespace as a non-root user is covered by isolation's tests"
        );
        return;
    }
    let mut vdev = Vdev::start(
        "ns",
        &["--sandbox", "namespace"],
        &[("VRDMA_TEST_FORBIDDEN", "open-passwd")],
    );
    let log = vdev.wait_for_log("test hook: open-passwd: ");
    // /etc is not in the new root at all.
    assert!(
        log.contains(&format!(
            "test hook: open-passwd: failed: errno {}",
            libc::ENOENT
        )),
        "{log}"
    );
    let own_ns = std::fs::read_link("/proc/self/ns/net").expect("own netns");
    let vdev_ns =
        std::fs::read_link(format!("/proc/{}/ns/net", vdev.child.id())).expect("vdev netns");
    assert_ne!(own_ns, vdev_ns, "vdev has its own network namespace");
    serve_one_application(&vdev.socket);
    assert!(vdev.is_running());
}

#[test]
fn impossible_sandbox_requests_are_refused_at_start() {
    let mut vdev = Vdev::start("bad", &["--seccomp", "allow"], &[]);
    assert_eq!(vdev.wait_exit().code(), Some(2), "{}", vdev.log());
    if !root() {
        let mut vdev = Vdev::start("bad-uid", &["--uid", "0"], &[]);
        assert_eq!(vdev.wait_exit().code(), Some(1), "{}", vdev.log());
    }
}

/// The hooks exist only with the feature: the `vdev` these tests run has
/// them, a default build of the same sources has none of their text.
#[test]
fn a_default_build_contains_no_test_hook() {
    let hooked = std::fs::read(VDEV).expect("read the test binary");
    let needle = b"VRDMA_TEST_FORBIDDEN";
    let contains = |bin: &[u8]| bin.windows(needle.len()).any(|w| w == needle);
    assert!(contains(&hooked), "the test-hooks build has its hooks");

    // A default build (`cargo build`: no dev-dependencies, so no feature),
    // in its own target directory so it neither waits for nor disturbs
    // the build running these tests.
    let target = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join("target")
        .join("hookless");
    let out = Command::new(env!("CARGO"))
        .args([
            "build",
            "--offline",
            "--locked",
            "-p",
            "vrdma-vdev",
            "--bin",
            "vdev",
        ])
        .arg("--target-dir")
        .arg(&target)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("run cargo");
    assert!(
        out.status.success(),
        "default build failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let plain = std::fs::read(target.join("debug").join("vdev")).expect("default vdev");
    assert!(!contains(&plain), "a default build contains the test hooks");
}

/// A stand-in for hostd that takes one registration, records the peer's
/// credentials and refuses it.
fn refusing_hostd(path: &Path) -> std::thread::JoinHandle<(u32, String)> {
    use vrdma_hostd_protocol::channel::Listener;
    use vrdma_hostd_protocol::messages::{Request, Response};
    let listener = Listener::bind(path).expect("bind the stand-in hostd");
    std::thread::spawn(move || {
        let channel = listener.accept().expect("accept");
        let uid = channel.peer_cred().expect("peer credentials").uid;
        let (hello, _fds): (Request, _) = channel.recv().expect("hello");
        let tenant = match hello {
            Request::Hello { tenant, .. } => tenant,
            other => panic!("expected Hello, got {other:?}"),
        };
        channel
            .send(
                &Response::Refused {
                    errno: libc::EACCES,
                    reason: "stand-in hostd refuses".into(),
                },
                &[],
            )
            .expect("refuse");
        (uid, tenant)
    })
}

#[test]
fn hostd_registration_happens_as_the_unprivileged_uid_when_it_can() {
    use std::os::unix::fs::PermissionsExt;
    if !root() {
        eprintln!("skipped: vdev changes uid only when started as root");
        return;
    }
    let cases: [(u32, &[&str], u32, bool); 3] = [
        (0o777, &[], 65534, false),
        // Inside the namespace sandbox, hostd's socket directory is the
        // only thing of the host's file system that is still there.
        (0o777, &["--sandbox", "namespace"], 65534, false),
        (0o755, &[], 0, true),
    ];
    for (n, (mode, extra, expected_uid, early)) in cases.into_iter().enumerate() {
        let dir =
            std::env::temp_dir().join(format!("vrdma-sandbox-hostd-{}-{n}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).expect("chmod");
        let path = dir.join("hostd.sock");
        let hostd = refusing_hostd(&path);
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).expect("chmod");
        let hostd_arg = path.to_str().expect("utf8").to_owned();
        let mut args = vec!["--hostd", hostd_arg.as_str()];
        args.extend_from_slice(extra);
        let mut vdev = Vdev::start("registers", &args, &[]);
        let status = vdev.wait_exit();
        let log = vdev.log();
        let (uid, tenant) = hostd.join().expect("stand-in hostd");
        std::fs::remove_dir_all(&dir).ok();
        assert_eq!(tenant, "registers");
        // A socket vdev's uid may connect to: vdev registers from inside
        // its sandbox, as uid 65534 (what hostd's peer check sees). One it
        // may not: the first registration is made before the sandbox, and
        // vdev says why.
        assert_eq!(uid, expected_uid, "mode {mode:o} {extra:?}:\n{log}");
        assert_eq!(log.contains("registering with hostd now"), early, "{log}");
        assert_eq!(status.code(), Some(1), "{status}:\n{log}");
        assert!(log.contains("stand-in hostd refuses"), "{log}");
    }
}
