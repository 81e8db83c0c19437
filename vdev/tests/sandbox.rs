//! vdev's sandbox from the outside: the real `vdev` binary, started the
//! way an operator starts it, made to misbehave from inside its sandbox
//! through the `test-hooks` feature (`VRDMA_TEST_FORBIDDEN`), and driven
//! by a real frontend (the guest driver in process mode) to show that the
//! sandbox does not get in the way of serving.
//!
//! Needs the `test-hooks` feature (`required-features` in Cargo.toml);
//! `cargo test` enables it through vdev's dev-dependency on itself.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use vrdma_guest_driver::{Context, QpCapabilities, QpInitAttr};
use vrdma_isolation::daemon::testing::{
    attempt, attempt_in, failed, DaemonProcess, ScratchDir, NEVER_ALLOWED, SUCCEEDED,
};
use vrdma_isolation::privileges::started_as_root as root;
use vrdma_spec::verbs::{access, QpType};

const VDEV: &str = env!("CARGO_BIN_EXE_vdev");
/// What vdev logs once its seccomp filters are up.
const SECCOMP_UP: &str = "seccomp: a filter per thread role";

/// The socket in a sandboxed vdev's scratch directory.
const SOCKET: &str = "vdev.sock";

/// A vdev of the tenant named like its test `tag`, logging at `debug`.
fn start(tag: &str, args: &[&str], env: &[(&str, &str)]) -> DaemonProcess {
    let dir = DaemonProcess::scratch("vdev", tag);
    let mut command = Command::new(VDEV);
    command
        .arg("--socket")
        .arg(dir.path().join(SOCKET))
        .args(["--tenant", tag])
        .args(args)
        .envs(env.iter().copied())
        .env("VRDMA_LOG", "debug");
    DaemonProcess::start("vdev", command, dir)
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
            srq: None,
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

#[test]
fn the_sandboxed_vdev_serves_frontends_one_after_another() {
    let mut vdev = start("serve", &[], &[]);
    let log = vdev.wait_for_log(SECCOMP_UP);
    assert!(log.contains("Privileges dropped"), "{log}");
    vdev.assert_walls_up();
    if kernel_has_landlock() {
        assert!(
            log.contains("Landlock: no file-system access at all"),
            "{log}"
        );
    }
    // Two applications in turn: each gets a fresh device, inside the
    // sandbox (threads started after it, guest memory mapped, eventfds).
    serve_one_application(&vdev.path(SOCKET));
    serve_one_application(&vdev.path(SOCKET));
    assert!(vdev.is_running(), "vdev died:\n{}", vdev.log());

    // With --once, vdev ends normally inside its sandbox (the listener's
    // attempt to remove its socket file is refused, not a seccomp kill).
    let mut once = start("serve-once", &["--once"], &[]);
    once.wait_for_log(SECCOMP_UP);
    serve_one_application(&once.path(SOCKET));
    let status = once.wait_exit();
    assert_eq!(status.code(), Some(0), "{status}:\n{}", once.log());
}

#[test]
fn forbidden_system_calls_kill_vdev_with_sigsys() {
    for (op, _) in NEVER_ALLOWED {
        let mut vdev = start("kill", &[], &attempt(op));
        vdev.assert_killed_by_sigsys(op);
        assert!(!vdev.log().contains("test hook: "), "{op} returned");
    }
}

#[test]
fn trap_makes_a_forbidden_call_fail_with_eperm_and_vdev_goes_on() {
    for (op, nr) in NEVER_ALLOWED {
        let trap = ["--seccomp", "trap"];
        let mut vdev = start("trap", &trap, &attempt(op));
        vdev.expect_trapped(op, None, nr);
        serve_one_application(&vdev.path(SOCKET));
        assert!(vdev.is_running());
    }
}

/// Each thread has its own role's filter: the vhost-user thread (and the
/// threads vhost-user-backend starts from it) cannot create the socket
/// only the main thread needs, to register with hostd, which a thread
/// under the main thread's filter can.
#[test]
fn a_thread_cannot_make_a_call_only_another_role_needs() {
    let op = "unix-socket";
    let in_vhost_user = attempt_in(op, "vhost-user");
    let mut main = start("role-main", &["--seccomp", "trap"], &attempt(op));
    main.expect_hook(op, None, SUCCEEDED);
    drop(main);

    let mut vdev = start("role-vhost", &["--seccomp", "trap"], &in_vhost_user);
    vdev.expect_trapped(op, Some("vhost-user"), libc::SYS_socket);
    serve_one_application(&vdev.path(SOCKET));
    assert!(vdev.is_running());
    drop(vdev);

    // Enforced, it is the end of vdev.
    let mut killed = start("role-kill", &[], &in_vhost_user);
    killed.assert_killed_by_sigsys("a socket in the vhost-user thread");
}

#[test]
fn log_mode_enforces_nothing_but_the_other_walls_still_hold() {
    // An inet socket is let through (and audit-logged by the kernel).
    let mut vdev = start("log", &["--seccomp", "log"], &attempt("inet-socket"));
    vdev.expect_hook("inet-socket", None, SUCCEEDED);
    drop(vdev);
    // execve passes seccomp, but landlock refuses to execute anything.
    if kernel_has_landlock() {
        let mut vdev = start("log-exec", &["--seccomp", "log"], &attempt("execve"));
        vdev.expect_hook("execve", None, &failed(libc::EACCES));
        assert!(vdev.is_running());
    }
}

#[test]
fn landlock_refuses_to_open_files() {
    let mut vdev = start("landlock", &[], &attempt("open-passwd"));
    if kernel_has_landlock() {
        vdev.expect_hook("open-passwd", None, &failed(libc::EACCES));
        serve_one_application(&vdev.path(SOCKET));
        assert!(vdev.is_running());
        // Without landlock the same open succeeds (see
        // walls_turned_off_are_explicit_and_loud): landlock is the wall
        // that stopped it.
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
    let mut refused = start("no-landlock", &[], &absent);
    let status = refused.wait_exit();
    let log = refused.log();
    assert_eq!(status.code(), Some(1), "{log}");
    assert!(log.contains("does not enforce landlock"), "{log}");
    assert!(log.contains("--allow-no-landlock"), "{log}");

    let mut allowed = start("no-landlock-ok", &["--allow-no-landlock"], &absent);
    let log = allowed.wait_for_log(SECCOMP_UP);
    assert!(log.contains("LANDLOCK NOT ENFORCED"), "{log}");
    serve_one_application(&allowed.path(SOCKET));
    assert!(allowed.is_running());
}

/// A wall is only ever off when asked for, and loudly: what it stops then
/// goes through (nobody may read /etc/passwd), and the log says so.
#[test]
fn walls_turned_off_are_explicit_and_loud() {
    for (wall, op, warning) in [
        ("--landlock", "open-passwd", "LANDLOCK IS OFF"),
        ("--seccomp", "inet-socket", "SECCOMP IS OFF"),
    ] {
        let tag = format!("{}-off", wall.trim_start_matches('-'));
        let mut vdev = start(&tag, &[wall, "off"], &attempt(op));
        let log = vdev.expect_hook(op, None, SUCCEEDED);
        assert!(log.contains(warning), "{log}");
    }
}

#[test]
fn seccomp_off_installs_no_filter() {
    let mut vdev = start("no-filter", &["--seccomp", "off"], &[]);
    vdev.wait_for_log("SECCOMP IS OFF");
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
    let mut vdev = start("ns", &["--sandbox", "namespace"], &attempt("open-passwd"));
    // /etc is not in the new root at all.
    vdev.expect_hook("open-passwd", None, &failed(libc::ENOENT));
    assert!(vdev.has_own_network_namespace());
    serve_one_application(&vdev.path(SOCKET));
    assert!(vdev.is_running());
}

#[test]
fn impossible_sandbox_requests_are_refused_at_start() {
    let mut vdev = start("bad", &["--seccomp", "allow"], &[]);
    assert_eq!(vdev.wait_exit().code(), Some(2), "{}", vdev.log());
    if !root() {
        let mut vdev = start("bad-uid", &["--uid", "0"], &[]);
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
            Request::OpenContext { tenant, .. } => tenant,
            other => panic!("expected OpenContext, got {other:?}"),
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
fn hostd_registration_happens_as_the_unprivileged_uid() {
    use std::os::unix::fs::PermissionsExt;
    if !root() {
        eprintln!("skipped: vdev changes uid only when started as root");
        return;
    }
    let cases: [(u32, &[&str]); 2] = [
        (0o777, &[]),
        // Inside the namespace sandbox, hostd's socket directory is the
        // only thing of the host's file system that is still there.
        (0o777, &["--sandbox", "namespace"]),
    ];
    for (n, (mode, extra)) in cases.into_iter().enumerate() {
        let dir = ScratchDir::new(&format!("vdev-sandbox-hostd-{n}"));
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755))
            .expect("chmod");
        let path = dir.path().join("hostd.sock");
        let hostd = refusing_hostd(&path);
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).expect("chmod");
        let hostd_arg = path.to_str().expect("utf8").to_owned();
        let mut args = vec!["--hostd", hostd_arg.as_str()];
        args.extend_from_slice(extra);
        let mut vdev = start("registers", &args, &[]);
        let status = vdev.wait_exit();
        let log = vdev.log();
        let (uid, tenant) = hostd.join().expect("stand-in hostd");
        assert_eq!(tenant, "registers");
        // vdev registers from inside its sandbox, as uid 65534: what
        // hostd's peer check sees.
        assert_eq!(uid, 65534, "mode {mode:o} {extra:?}:\n{log}");
        // A refusal at start is vdev's end, with hostd's reason.
        assert_eq!(status.code(), Some(1), "{status}:\n{log}");
        assert!(log.contains("stand-in hostd refuses"), "{log}");
    }
}

/// A hostd socket the unprivileged uid cannot reach (a directory it cannot
/// search) is found at start, before any frontend is served — not after the
/// first program, as when vdev registered once before dropping privileges.
#[test]
fn a_hostd_socket_out_of_reach_fails_at_start_and_says_why() {
    use std::os::unix::fs::PermissionsExt;
    if !root() {
        eprintln!("skipped: vdev changes uid only when started as root");
        return;
    }
    let dir = ScratchDir::new("vdev-sandbox-hostd-0700");
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o700)).expect("chmod");
    let path = dir.path().join("hostd.sock");
    let listener = std::os::unix::net::UnixListener::bind(&path).expect("bind");
    listener.set_nonblocking(true).expect("nonblocking");
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o666)).expect("chmod");
    let hostd_arg = path.to_str().expect("utf8").to_owned();
    let mut vdev = start("out-of-reach", &["--hostd", hostd_arg.as_str()], &[]);
    let status = vdev.wait_exit();
    let log = vdev.log();
    assert_eq!(status.code(), Some(1), "{status}:\n{log}");
    assert!(
        log.contains("looks out of reach of the uid vdev runs as"),
        "{log}"
    );
    assert!(log.contains("Permission denied"), "{log}");
    assert!(!log.contains("Waiting for a frontend"), "{log}");
    // Nothing reached the socket.
    assert_eq!(
        listener.accept().map_err(|e| e.kind()).err(),
        Some(std::io::ErrorKind::WouldBlock)
    );
}
