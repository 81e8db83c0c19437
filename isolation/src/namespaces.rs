//! namespaces: the optional `--sandbox namespace` mode.
//!
//! [`SandboxMode::None`] (the default) creates no namespace. The other
//! walls (landlock, privileges, seccomp) apply in both modes.
//!
//! [`SandboxMode::Namespace`] moves the process into new namespaces:
//!
//! - **mount**: a private mount tree whose root is an empty, read-only
//!   tmpfs holding only the directories the daemon must still reach by
//!   path, each bound read-only at its own path (vdev: hostd's socket
//!   directory; hostd: its policy file's directory, for reloads). Everything else on the host — other tenants' vhost-user
//!   sockets, `/run`, `/proc`, `/dev` — is not there. This is the wall for
//!   `connect()` to pathname unix sockets, which landlock before ABI 9 and
//!   seccomp cannot restrict.
//! - **network**: no interfaces but a down loopback, and a private
//!   abstract unix-socket namespace.
//! - **IPC**: private System V IPC and POSIX message queues.
//! - **user** (only when not started as root): the above need
//!   `CAP_SYS_ADMIN`; an unprivileged process gets it inside a new user
//!   namespace that maps its own uid and gid only.
//!
//! A PID namespace is not created: it applies to children only, so it
//! would need a fork (and a reaper) at start-up; seccomp already prevents
//! the daemons from signalling or tracing other processes (no `kill`, no
//! `ptrace`, `tgkill` only to itself), and landlock's signal scope too.
//!
//! The combination "namespace mode, not root, no user namespaces" is
//! refused by [`SandboxMode::plan`], before anything is changed.

use std::ffi::CString;
use std::fmt;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::str::FromStr;

/// The `--sandbox` choice.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SandboxMode {
    /// No namespaces.
    #[default]
    None,
    /// New mount, network and IPC namespaces (and a user namespace when
    /// not root) with an empty root that holds only what must be reached.
    Namespace,
}

impl FromStr for SandboxMode {
    type Err = NamespaceError;

    fn from_str(s: &str) -> Result<Self, NamespaceError> {
        match s {
            "none" => Ok(SandboxMode::None),
            "namespace" => Ok(SandboxMode::Namespace),
            other => Err(NamespaceError::Mode(other.to_owned())),
        }
    }
}

impl fmt::Display for SandboxMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            SandboxMode::None => "none",
            SandboxMode::Namespace => "namespace",
        })
    }
}

/// A namespace set-up that [`SandboxMode::plan`] found possible.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NamespacePlan {
    /// Create a user namespace first (not started as root).
    pub user: bool,
}

/// Why the namespace step failed or was refused.
#[derive(Debug, thiserror::Error)]
pub enum NamespaceError {
    #[error("Unknown sandbox mode {0:?} (expected none or namespace)")]
    Mode(String),
    #[error(
        "--sandbox namespace needs root or unprivileged user namespaces, and this \
         process has neither"
    )]
    NeedsPrivilege,
    #[error("{step} failed")]
    Call {
        step: String,
        #[source]
        source: std::io::Error,
    },
}

fn call(step: impl Into<String>, rc: libc::c_int) -> Result<(), NamespaceError> {
    if rc == 0 {
        Ok(())
    } else {
        Err(NamespaceError::Call {
            step: step.into(),
            source: crate::last_os_error(),
        })
    }
}

fn io_step(step: impl Into<String>) -> impl FnOnce(std::io::Error) -> NamespaceError {
    let step = step.into();
    move |source| NamespaceError::Call { step, source }
}

impl SandboxMode {
    /// What entering this mode takes, or why it cannot be done:
    /// `Ok(None)` for no namespaces.
    pub fn plan(
        self,
        started_as_root: bool,
        user_namespaces: bool,
    ) -> Result<Option<NamespacePlan>, NamespaceError> {
        match (self, started_as_root, user_namespaces) {
            (SandboxMode::None, _, _) => Ok(None),
            (SandboxMode::Namespace, true, _) => Ok(Some(NamespacePlan { user: false })),
            (SandboxMode::Namespace, false, true) => Ok(Some(NamespacePlan { user: true })),
            (SandboxMode::Namespace, false, false) => Err(NamespaceError::NeedsPrivilege),
        }
    }
}

/// Whether an unprivileged process may create user namespaces here.
pub fn user_namespaces_available() -> bool {
    let read = |p: &str| {
        std::fs::read_to_string(p)
            .ok()
            .and_then(|s| s.trim().parse::<u64>().ok())
    };
    let max_ok = read("/proc/sys/user/max_user_namespaces").is_some_and(|n| n > 0);
    // Debian's switch; absent on kernels without the patch.
    let debian_ok = read("/proc/sys/kernel/unprivileged_userns_clone").is_none_or(|n| n != 0);
    max_ok && debian_ok
}

/// Where the new root's tmpfs is mounted before `pivot_root` (inside the
/// private mount namespace only: the host's `/tmp` is untouched).
const STAGING: &str = "/tmp";

/// Enters the namespaces of `plan`. The new root holds each directory of
/// `keep`, bound read-only at its own path. Must run single-threaded
/// (`unshare(CLONE_NEWUSER)` refuses otherwise) and before landlock
/// (mounting is refused inside a landlock domain).
pub fn enter(plan: &NamespacePlan, keep: &[PathBuf]) -> Result<(), NamespaceError> {
    if plan.user {
        enter_user_namespace()?;
    }
    // SAFETY: unshare takes flags only.
    let rc = unsafe { libc::unshare(libc::CLONE_NEWNS | libc::CLONE_NEWNET | libc::CLONE_NEWIPC) };
    call("unshare(mount, network, IPC)", rc)?;
    // Nothing done below propagates back to the host's mount tree.
    mount(None, "/", None, libc::MS_REC | libc::MS_PRIVATE, "")?;
    // Reach the kept directories through descriptors opened before the
    // staging tmpfs may hide them (they may live under /tmp).
    let kept: Vec<(PathBuf, OwnedFd)> = keep
        .iter()
        .map(|p| {
            let fd = open_path(p)?;
            Ok((p.clone(), fd))
        })
        .collect::<Result<_, NamespaceError>>()?;
    let nosuid = libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC;
    mount(
        Some("tmpfs"),
        STAGING,
        Some("tmpfs"),
        nosuid,
        "mode=0755,size=64k",
    )?;
    for (path, fd) in &kept {
        let relative = path.strip_prefix("/").unwrap_or(path);
        let target = Path::new(STAGING).join(relative);
        std::fs::create_dir_all(&target).map_err(io_step(format!(
            "Creating {} in the new root",
            target.display()
        )))?;
        let source = format!("/proc/self/fd/{}", fd.as_raw_fd());
        mount(
            Some(&source),
            &target.to_string_lossy(),
            None,
            libc::MS_BIND | libc::MS_REC,
            "",
        )?;
        mount(
            None,
            &target.to_string_lossy(),
            None,
            libc::MS_BIND | libc::MS_REMOUNT | libc::MS_RDONLY | nosuid,
            "",
        )?;
    }
    drop(kept);
    std::env::set_current_dir(STAGING).map_err(io_step("chdir to the new root"))?;
    // pivot_root(".", "."): the old root ends up on top of the new one and
    // is detached right away.
    let dot = c".";
    // SAFETY: both arguments are valid NUL-terminated paths.
    let rc = unsafe { libc::syscall(libc::SYS_pivot_root, dot.as_ptr(), dot.as_ptr()) };
    call("pivot_root", rc as libc::c_int)?;
    // SAFETY: a valid NUL-terminated path and integer flags.
    let rc = unsafe { libc::umount2(dot.as_ptr(), libc::MNT_DETACH) };
    call("Detaching the old root", rc)?;
    std::env::set_current_dir("/").map_err(io_step("chdir /"))?;
    mount(
        None,
        "/",
        None,
        libc::MS_BIND | libc::MS_REMOUNT | libc::MS_RDONLY | nosuid,
        "",
    )?;
    Ok(())
}

fn enter_user_namespace() -> Result<(), NamespaceError> {
    // SAFETY: getuid/getgid cannot fail.
    let (uid, gid) = unsafe { (libc::getuid(), libc::getgid()) };
    // SAFETY: unshare takes flags only.
    call("unshare(user)", unsafe {
        libc::unshare(libc::CLONE_NEWUSER)
    })?;
    std::fs::write("/proc/self/setgroups", "deny").map_err(io_step("Writing setgroups"))?;
    std::fs::write("/proc/self/uid_map", format!("{uid} {uid} 1"))
        .map_err(io_step("Writing uid_map"))?;
    std::fs::write("/proc/self/gid_map", format!("{gid} {gid} 1"))
        .map_err(io_step("Writing gid_map"))?;
    Ok(())
}

fn open_path(path: &Path) -> Result<OwnedFd, NamespaceError> {
    let c = CString::new(path.as_os_str().as_bytes()).map_err(|_| NamespaceError::Call {
        step: format!("Opening {}", path.display()),
        source: std::io::Error::from(std::io::ErrorKind::InvalidInput),
    })?;
    // SAFETY: a valid NUL-terminated path; the result is checked.
    let fd = unsafe {
        libc::open(
            c.as_ptr(),
            libc::O_PATH | libc::O_DIRECTORY | libc::O_CLOEXEC,
        )
    };
    if fd < 0 {
        return Err(NamespaceError::Call {
            step: format!("Opening {}", path.display()),
            source: crate::last_os_error(),
        });
    }
    // SAFETY: a fresh descriptor owned by nobody else.
    Ok(unsafe { std::os::fd::FromRawFd::from_raw_fd(fd) })
}

fn mount(
    source: Option<&str>,
    target: &str,
    fstype: Option<&str>,
    flags: libc::c_ulong,
    data: &str,
) -> Result<(), NamespaceError> {
    let step = || format!("mount {} on {target}", source.unwrap_or("(remount)"));
    let cstr = |s: &str| {
        CString::new(s).map_err(|_| NamespaceError::Call {
            step: step(),
            source: std::io::Error::from(std::io::ErrorKind::InvalidInput),
        })
    };
    let source_c = source.map(cstr).transpose()?;
    let fstype_c = fstype.map(cstr).transpose()?;
    let target_c = cstr(target)?;
    let data_c = cstr(data)?;
    let ptr = |c: &Option<CString>| c.as_ref().map_or(std::ptr::null(), |c| c.as_ptr());
    // SAFETY: every pointer is null or a valid NUL-terminated string that
    // outlives the call.
    let rc = unsafe {
        libc::mount(
            ptr(&source_c),
            target_c.as_ptr(),
            ptr(&fstype_c),
            flags,
            if data.is_empty() {
                std::ptr::null()
            } else {
                data_c.as_ptr().cast()
            },
        )
    };
    call(step(), rc)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::daemon::testing::ScratchDir;

    #[test]
    fn invalid_combinations_are_refused_before_anything_changes() {
        assert_eq!(SandboxMode::None.plan(false, false).expect("ok"), None);
        assert_eq!(
            SandboxMode::Namespace.plan(true, false).expect("root"),
            Some(NamespacePlan { user: false })
        );
        assert_eq!(
            SandboxMode::Namespace.plan(false, true).expect("userns"),
            Some(NamespacePlan { user: true })
        );
        assert!(matches!(
            SandboxMode::Namespace.plan(false, false),
            Err(NamespaceError::NeedsPrivilege)
        ));
    }

    #[test]
    fn modes_parse_and_print() {
        for text in ["none", "namespace"] {
            let mode: SandboxMode = text.parse().expect("parses");
            assert_eq!(mode.to_string(), text);
        }
        assert!("chroot".parse::<SandboxMode>().is_err());
        assert_eq!(SandboxMode::default(), SandboxMode::None);
    }

    /// The whole mode, in a child process (it cannot be undone): only the
    /// kept directory is visible, read-only, and the network is empty.
    #[test]
    fn a_namespaced_child_sees_only_what_it_keeps() {
        let root = crate::privileges::started_as_root();
        let Ok(Some(plan)) = SandboxMode::Namespace.plan(root, user_namespaces_available()) else {
            eprintln!("skipped: neither root nor user namespaces");
            return;
        };
        let scratch = ScratchDir::new("isolation-ns");
        let dir = scratch.path();
        let kept_file = scratch.write("kept.txt", b"kept");
        let keep = vec![dir.to_path_buf()];
        let hostname_probe = c"/etc/passwd";
        // SAFETY: the child makes system calls and small allocations (glibc
        // resets malloc's locks in the child) and leaves with _exit.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0);
        if pid == 0 {
            let code = (|| {
                if enter(&plan, &keep).is_err() {
                    return 2;
                }
                if std::fs::read(&kept_file).ok().as_deref() != Some(&b"kept"[..]) {
                    return 3;
                }
                if std::fs::write(dir.join("new.txt"), b"x").is_ok() {
                    return 4;
                }
                // SAFETY: a valid path; the result is checked.
                let fd = unsafe { libc::open(hostname_probe.as_ptr(), libc::O_RDONLY) };
                if fd >= 0 {
                    return 5;
                }
                // No network: connecting anywhere over IPv4 fails at once.
                if std::net::TcpStream::connect("127.0.0.1:9").is_ok() {
                    return 6;
                }
                0
            })();
            // SAFETY: ends the child without the harness's atexit handlers.
            unsafe { libc::_exit(code) };
        }
        let mut status = 0;
        // SAFETY: waits for our own child.
        assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
        assert!(libc::WIFEXITED(status), "status {status:#x}");
        assert_eq!(libc::WEXITSTATUS(status), 0, "child step failed");
    }
}
