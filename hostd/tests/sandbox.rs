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
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use common::{config, pair, policy, Client, IOVA};
use vrdma_isolation::daemon::testing::{
    attempt, attempt_in, failed, DaemonProcess, NEVER_ALLOWED, SUCCEEDED,
};
use vrdma_spec::verbs::WcStatus;

const HOSTD: &str = env!("CARGO_BIN_EXE_hostd");

/// The files of a sandboxed hostd's scratch directory.
const SOCKET: &str = "hostd.sock";
const POLICY: &str = "policy.toml";

/// A hostd with a config and a policy file of its own, logging at `info`.
fn start(tag: &str, args: &[&str], env: &[(&str, &str)]) -> DaemonProcess {
    let dir = DaemonProcess::scratch("hostd", tag);
    let policy_file = dir.write(POLICY, policy());
    let config_file = dir.write("hostd.toml", config(16));
    let mut command = Command::new(HOSTD);
    command
        .arg("--config")
        .arg(&config_file)
        .arg("--socket")
        .arg(dir.path().join(SOCKET))
        .arg("--policy")
        .arg(&policy_file)
        .args(args)
        .envs(env.iter().copied())
        .env("VRDMA_LOG", "info");
    DaemonProcess::start("hostd", command, dir)
}

const SERVING: &str = "hostd serving";

#[test]
fn forbidden_system_calls_kill_hostd_with_sigsys() {
    for (op, _) in NEVER_ALLOWED {
        let mut hostd = start(op, &[], &attempt(op));
        hostd.assert_killed_by_sigsys(op);
    }
}

#[test]
fn under_trap_forbidden_calls_fail_with_eperm_and_hostd_serves_on() {
    for (op, nr) in NEVER_ALLOWED {
        let trap = ["--seccomp", "trap"];
        let mut hostd = start(&format!("trap-{op}"), &trap, &attempt(op));
        hostd.expect_trapped(op, None, nr);
        hostd.wait_for_log(SERVING);
        Client::hello(&hostd.path(SOCKET), "alpha", "vm0").expect("hostd still serves");
    }
}

/// Each thread has its own role's filter: a connection thread may create
/// the socketpair of a registration's policy channel, a datapath thread
/// may not.
#[test]
fn a_thread_cannot_make_a_call_only_another_role_needs() {
    let op = "unix-socketpair";
    let trap = ["--seccomp", "trap"];
    let mut hostd = start("role-conn", &trap, &attempt_in(op, "connection"));
    hostd.wait_for_log(SERVING);
    // A vdev connects: a connection thread starts and makes the call.
    Client::hello(&hostd.path(SOCKET), "alpha", "vm0").expect("hello");
    hostd.expect_hook(op, Some("connection"), SUCCEEDED);
    drop(hostd);

    let in_datapath = attempt_in(op, "datapath");
    let mut hostd = start("role-datapath", &trap, &in_datapath);
    hostd.expect_trapped(op, Some("datapath"), libc::SYS_socketpair);
    hostd.wait_for_log(SERVING);
    Client::hello(&hostd.path(SOCKET), "alpha", "vm0").expect("hostd still serves");
    drop(hostd);

    // Enforced, it is the end of hostd.
    let mut killed = start("role-datapath-kill", &[], &in_datapath);
    killed.assert_killed_by_sigsys("socketpair in a datapath thread");
}

#[test]
fn landlock_refuses_files_outside_the_policy_file() {
    let mut hostd = start("passwd", &[], &attempt("open-passwd"));
    hostd.expect_hook("open-passwd", None, &failed(libc::EACCES));
    // The wall, not the file's permissions, refused it.
    let mut open = start(
        "passwd-off",
        &["--landlock", "off"],
        &attempt("open-passwd"),
    );
    open.expect_hook("open-passwd", None, SUCCEEDED);
}

/// `--sandbox namespace`, the same mode as vdev's. Started as root, hostd
/// runs in mount and network namespaces of its own whose root holds only
/// the policy file's directory (read-only), serves, and still reloads its
/// policy. Started as another user it is refused with the reason: in a
/// user namespace, every vdev's uid would read as the overflow uid.
#[test]
fn namespace_mode_keeps_only_the_policy_directory() {
    let mut hostd = start("ns", &["--sandbox", "namespace"], &attempt("open-passwd"));
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        let status = hostd.wait_exit();
        assert_eq!(status.code(), Some(1), "{}", hostd.log());
        assert!(hostd.log().contains("overflow uid"), "{}", hostd.log());
        return;
    }
    // /etc is not in the new root at all.
    hostd.expect_hook("open-passwd", None, &failed(libc::ENOENT));
    assert!(hostd.has_own_network_namespace());
    hostd.wait_for_log(SERVING);
    Client::hello(&hostd.path(SOCKET), "alpha", "vm0").expect("hostd serves");
    std::fs::write(hostd.path(POLICY), policy()).expect("rewrite policy");
    hostd.signal(libc::SIGHUP);
    let log = hostd.wait_for_logged("Policy reloaded", 1);
    assert!(!log.contains("Policy reload failed"), "{log}");
}

#[test]
fn a_kernel_without_landlock_is_refused_unless_allowed() {
    let absent = [("VRDMA_TEST_LANDLOCK", "absent")];
    let mut refused = start("no-landlock", &[], &absent);
    let status = refused.wait_exit();
    assert_eq!(status.code(), Some(1), "{}", refused.log());
    assert!(
        refused.log().contains("--allow-no-landlock"),
        "{}",
        refused.log()
    );
    let mut allowed = start("no-landlock-ok", &["--allow-no-landlock"], &absent);
    let log = allowed.wait_for_log(SERVING);
    assert!(log.contains("LANDLOCK NOT ENFORCED"), "{log}");
}

#[test]
fn a_sandboxed_hostd_serves_rdma_and_reloads_its_policy() {
    let mut hostd = start("serve", &[], &[]);
    let log = hostd.wait_for_log(SERVING);
    assert!(log.contains("seccomp: a filter per thread role"), "{log}");
    assert!(log.contains("Landlock: no file-system access but reading the policy file"));
    hostd.assert_walls_up();
    // Any uid may connect to the vdev socket; only hostd's owner to the
    // admin socket.
    let mode = |p: &Path| {
        std::fs::metadata(p)
            .expect("socket metadata")
            .permissions()
            .mode()
            & 0o777
    };
    assert_eq!(mode(&hostd.path(SOCKET)), 0o666);
    assert_eq!(mode(&hostd.path("hostd.sock.admin")), 0o600);

    // Two tenants set their devices up (a sealed memfd, the doorbell and
    // event ring's eventfds, rings, hostd-assigned keys) and alpha writes
    // into beta's memory through the datapath threads.
    let (mut alpha, beta) = pair(&hostd.path(SOCKET));
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
    std::fs::write(hostd.path(POLICY), policy()).expect("rewrite policy");
    hostd.signal(libc::SIGHUP);
    let log = hostd.wait_for_logged("Policy reloaded", 1);
    assert!(!log.contains("Policy reload failed"), "{log}");
    let staged = hostd.dir().join(".policy.toml.new");
    std::fs::write(&staged, policy()).expect("stage policy");
    std::fs::rename(&staged, hostd.path(POLICY)).expect("replace policy");
    hostd.signal(libc::SIGHUP);
    let log = hostd.wait_for_logged("Policy reloaded", 2);
    assert!(!log.contains("Policy reload failed"), "{log}");
}
