//! landlock: what the daemon may still reach by path after start-up.
//!
//! The ruleset handles every file-system access right of landlock ABI 7
//! (read, write, execute, create, remove, rename/link across directories,
//! truncate, device ioctls), TCP bind/connect, and the ABI 6 scopes
//! (abstract unix sockets and signals outside the sandbox). Access is then
//! granted only beneath the paths of a [`FsPolicy`] — for vdev, none:
//! after its listener is bound it opens nothing by path.
//!
//! What landlock does **not** stop on this ABI: `connect()` to a pathname
//! unix socket (landlock ABI 9, `LANDLOCK_ACCESS_FS_RESOLVE_UNIX`, adds
//! that), `stat` of paths, and anything done through descriptors opened
//! before. File permissions, the `--sandbox namespace` mount view and the
//! seccomp filter cover those.
//!
//! A kernel without landlock (not built in, or not in the `lsm=` list)
//! leaves the ruleset unenforced; [`check`] turns that into a refusal
//! unless the operator explicitly allowed it.

use std::path::PathBuf;

use ::landlock::{
    Access, AccessFs, AccessNet, CompatLevel, Compatible, LandlockStatus, NetPort, PathBeneath,
    PathFd, Ruleset, RulesetAttr, RulesetCreatedAttr, RulesetError, RulesetStatus, Scope, ABI,
};

/// The landlock ABI whose rights vdev asks for: the newest one this code
/// has been tested on (Linux 6.15+). On older kernels the missing rights
/// are dropped (best effort) and [`Enforcement::Partial`] says so.
pub const TARGET_ABI: ABI = ABI::V7;

/// Access granted beneath a path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FsAccess {
    /// Read files and list directories.
    Read,
    /// Read regular files: the one the path names, or, for a directory,
    /// every file beneath it (no listing, no writing).
    ReadFile,
    /// Everything: read, write, create, remove.
    ReadWrite,
}

/// The paths a sandboxed process keeps, each with its access, and the TCP
/// ports it may still connect to (hostd's etcd endpoints; none for vdev).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FsPolicy {
    pub paths: Vec<(PathBuf, FsAccess)>,
    pub tcp_connect: Vec<u16>,
}

/// How much of the ruleset the running kernel enforces.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Enforcement {
    /// Every requested right is enforced.
    Full,
    /// The kernel has landlock, but an older ABI: some rights (named in
    /// the log) are not enforced.
    Partial,
    /// The kernel has no landlock: nothing is enforced.
    Absent,
}

/// Why the landlock step failed.
#[derive(Debug, thiserror::Error)]
pub enum LandlockError {
    #[error("Cannot build or apply the landlock ruleset")]
    Ruleset(#[source] RulesetError),
    #[error("Cannot open {} for a landlock rule", path.display())]
    Path {
        path: PathBuf,
        #[source]
        source: ::landlock::PathFdError,
    },
    #[error(
        "This kernel does not enforce landlock ({status}): the daemon would run without \
         its file-system wall; refusing to start (pass --allow-no-landlock to run anyway)"
    )]
    Unsupported { status: String },
}

/// Restricts the calling thread (and every thread it starts later) to
/// `policy`, and sets `no_new_privs`. Must run before other threads
/// exist: landlock ABI < 8 restricts the calling thread only.
pub fn restrict(policy: &FsPolicy) -> Result<(Enforcement, String), LandlockError> {
    let fs_all = AccessFs::from_all(TARGET_ABI);
    let mut ruleset = Ruleset::default()
        .set_compatibility(CompatLevel::BestEffort)
        .handle_access(fs_all)
        .and_then(|r| r.handle_access(AccessNet::from_all(TARGET_ABI)))
        .and_then(|r| r.scope(Scope::from_all(TARGET_ABI)))
        .and_then(|r| r.create())
        .map_err(LandlockError::Ruleset)?;
    for (path, access) in &policy.paths {
        let rights = match access {
            FsAccess::Read => AccessFs::from_read(TARGET_ABI),
            FsAccess::ReadFile => AccessFs::ReadFile.into(),
            FsAccess::ReadWrite => fs_all,
        };
        let fd = PathFd::new(path).map_err(|source| LandlockError::Path {
            path: path.clone(),
            source,
        })?;
        ruleset = ruleset
            .add_rule(PathBeneath::new(fd, rights))
            .map_err(LandlockError::Ruleset)?;
    }
    for &port in &policy.tcp_connect {
        ruleset = ruleset
            .add_rule(NetPort::new(port, AccessNet::ConnectTcp))
            .map_err(LandlockError::Ruleset)?;
    }
    let status = ruleset.restrict_self().map_err(LandlockError::Ruleset)?;
    let enforcement = match status.ruleset {
        RulesetStatus::FullyEnforced => Enforcement::Full,
        RulesetStatus::PartiallyEnforced => Enforcement::Partial,
        RulesetStatus::NotEnforced => Enforcement::Absent,
    };
    Ok((enforcement, describe(status.landlock)))
}

/// The kernel's landlock support in words, for logs and errors.
pub fn describe(status: LandlockStatus) -> String {
    match status {
        LandlockStatus::NotEnabled => {
            "landlock is built in but not enabled (add it to the lsm= boot parameter)".into()
        }
        LandlockStatus::NotImplemented => "the kernel is built without landlock".into(),
        LandlockStatus::Available {
            effective_abi,
            kernel_abi,
        } => match kernel_abi {
            Some(kernel) => format!("landlock ABI {kernel}, used as {effective_abi:?}"),
            None => format!("landlock {effective_abi:?}"),
        },
    }
}

/// The start-up decision: a kernel that does not enforce landlock is a
/// refusal unless the operator passed `--allow-no-landlock`.
pub fn check(
    enforcement: Enforcement,
    status: &str,
    allow_absent: bool,
) -> Result<(), LandlockError> {
    match enforcement {
        Enforcement::Absent if !allow_absent => Err(LandlockError::Unsupported {
            status: status.to_owned(),
        }),
        _ => Ok(()),
    }
}

/// A daemon's landlock step: restricts the process to `policy` (or, under
/// the test hook `VRDMA_TEST_LANDLOCK=absent`, acts as on a kernel without
/// landlock), refuses a kernel without it unless `allow_absent`, and logs
/// the outcome naming `daemon`; `full` describes what a full enforcement
/// leaves the daemon.
pub fn enter(
    policy: &FsPolicy,
    allow_absent: bool,
    daemon: &str,
    full: &str,
) -> Result<(), LandlockError> {
    let (enforcement, status) = if simulate_absent() {
        (
            Enforcement::Absent,
            "no landlock (simulated by VRDMA_TEST_LANDLOCK=absent)".to_owned(),
        )
    } else {
        restrict(policy)?
    };
    check(enforcement, &status, allow_absent)?;
    match enforcement {
        Enforcement::Full => tracing::info!(%status, "Landlock: {full}"),
        Enforcement::Partial => tracing::warn!(
            %status,
            "Landlock enforced only in part: this kernel's ABI lacks some of the rights {daemon} \
             asks for (see docs/security.md)"
        ),
        Enforcement::Absent => tracing::warn!(
            %status,
            "LANDLOCK NOT ENFORCED: this kernel has no landlock and --allow-no-landlock was \
             given; {daemon} runs without its file-system wall"
        ),
    }
    Ok(())
}

#[cfg(feature = "test-hooks")]
fn simulate_absent() -> bool {
    crate::test_hooks::landlock_absent()
}

#[cfg(not(feature = "test-hooks"))]
fn simulate_absent() -> bool {
    false
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::daemon::testing::ScratchDir;

    #[test]
    fn no_landlock_is_refused_unless_allowed() {
        let err = check(
            Enforcement::Absent,
            "the kernel is built without landlock",
            false,
        )
        .expect_err("refused");
        let text = err.to_string();
        assert!(text.contains("--allow-no-landlock"), "{text}");
        assert!(text.contains("built without landlock"), "{text}");
        check(Enforcement::Absent, "x", true).expect("explicitly allowed");
        check(Enforcement::Full, "x", false).expect("enforced");
        check(Enforcement::Partial, "x", false).expect("partly enforced");
    }

    #[test]
    fn statuses_read_well() {
        assert!(describe(LandlockStatus::NotEnabled).contains("lsm="));
        assert!(describe(LandlockStatus::NotImplemented).contains("without"));
    }

    /// Runs `f` on a fresh thread: landlock restricts only that thread, so
    /// the test process stays unrestricted.
    fn on_thread<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
        std::thread::spawn(f).join().expect("thread")
    }

    /// What a file-system call gave: its value, or its errno.
    type Outcome<T> = Result<T, Option<i32>>;

    /// What landlock answers an access it refuses.
    fn denied<T>() -> Outcome<T> {
        Err(Some(libc::EACCES))
    }

    fn read(path: &std::path::Path) -> Outcome<Vec<u8>> {
        std::fs::read(path).map_err(|e| e.raw_os_error())
    }

    fn write(path: &std::path::Path) -> Outcome<()> {
        std::fs::write(path, b"x").map_err(|e| e.raw_os_error())
    }

    fn list(dir: &std::path::Path) -> Outcome<()> {
        std::fs::read_dir(dir)
            .map(drop)
            .map_err(|e| e.raw_os_error())
    }

    #[test]
    fn a_restricted_thread_opens_only_what_the_policy_names() {
        let dir = ScratchDir::new("isolation-landlock");
        let allowed = dir.write("allowed.txt", b"ok");
        let policy = FsPolicy {
            paths: vec![(dir.path().to_path_buf(), FsAccess::Read)],
            tcp_connect: Vec::new(),
        };
        let (enforcement, status, passwd, ours, rewrite) = on_thread(move || {
            let (enforcement, status) = restrict(&policy).expect("restrict");
            let passwd = read("/etc/passwd".as_ref());
            (enforcement, status, passwd, read(&allowed), write(&allowed))
        });
        match enforcement {
            Enforcement::Absent => {
                // No landlock in this kernel: nothing was restricted, and
                // the start-up check refuses unless explicitly allowed.
                assert!(passwd.is_ok());
                assert!(check(enforcement, &status, false).is_err());
            }
            _ => {
                assert_eq!(passwd, denied(), "{status}");
                assert_eq!(ours, Ok(b"ok".to_vec()));
                assert_eq!(rewrite, denied());
            }
        }
    }

    #[test]
    fn a_restricted_thread_connects_over_tcp_only_to_the_ports_listed() {
        use std::net::{TcpListener, TcpStream};
        let allowed = TcpListener::bind("127.0.0.1:0").expect("listen");
        let other = TcpListener::bind("127.0.0.1:0").expect("listen");
        let (a, o) = (
            allowed.local_addr().expect("addr"),
            other.local_addr().expect("addr"),
        );
        let policy = FsPolicy {
            paths: Vec::new(),
            tcp_connect: vec![a.port()],
        };
        let (enforcement, to_allowed, to_other) = on_thread(move || {
            let (enforcement, _) = restrict(&policy).expect("restrict");
            let to_allowed = TcpStream::connect(a).map(|_| ());
            let to_other = TcpStream::connect(o).map_err(|e| e.raw_os_error());
            (enforcement, to_allowed.is_ok(), to_other)
        });
        if enforcement != Enforcement::Absent {
            assert!(to_allowed, "the listed port (etcd's) stays reachable");
            assert_eq!(to_other.err(), Some(Some(libc::EACCES)), "any other is not");
        }
    }

    #[test]
    fn a_read_file_rule_allows_that_file_only() {
        let dir = ScratchDir::new("isolation-readfile");
        let policy_file = dir.write("policy.toml", b"policy");
        let sibling = dir.write("other.toml", b"other");
        let policy = FsPolicy {
            paths: vec![(policy_file.clone(), FsAccess::ReadFile)],
            tcp_connect: Vec::new(),
        };
        let listed = dir.path().to_path_buf();
        let (enforcement, ours, refused) = on_thread(move || {
            let (enforcement, _) = restrict(&policy).expect("restrict");
            let ours = read(&policy_file);
            let refused = (read(&sibling), write(&policy_file), list(&listed));
            (enforcement, ours, refused)
        });
        if enforcement == Enforcement::Absent {
            return;
        }
        assert_eq!(enforcement, Enforcement::Full);
        assert_eq!(ours, Ok(b"policy".to_vec()));
        assert_eq!(refused, (denied(), denied(), denied()));
    }

    #[test]
    fn a_read_file_rule_on_a_directory_allows_its_files_even_replaced() {
        let base = ScratchDir::new("isolation-readdir");
        let dir = base.path().join("policy");
        std::fs::create_dir_all(&dir).expect("dir");
        let policy_file = dir.join("policy.toml");
        std::fs::write(&policy_file, b"first").expect("write");
        let outside = base.write("outside.toml", b"outside");
        let policy = FsPolicy {
            paths: vec![(dir.clone(), FsAccess::ReadFile)],
            tcp_connect: Vec::new(),
        };
        // The restricted thread reads, then this (unrestricted) one
        // replaces the file by a rename (a new inode), then it reads again.
        let (read_once, replace) = std::sync::mpsc::channel();
        let (replaced_tx, replaced_rx) = std::sync::mpsc::channel();
        let (file, staged) = (policy_file.clone(), dir.join(".new"));
        let restricted = std::thread::spawn(move || {
            let (enforcement, _) = restrict(&policy).expect("restrict");
            let first = read(&policy_file);
            read_once.send(()).expect("signal");
            replaced_rx.recv().expect("replaced");
            let replaced = read(&policy_file);
            let refused = (write(&policy_file), list(&dir), read(&outside));
            (enforcement, first, replaced, refused)
        });
        replace.recv().expect("first read");
        std::fs::write(&staged, b"second").expect("stage");
        std::fs::rename(&staged, &file).expect("rename");
        replaced_tx.send(()).expect("signal");
        let (enforcement, first, replaced, refused) = restricted.join().expect("thread");
        if enforcement == Enforcement::Absent {
            return;
        }
        assert_eq!(enforcement, Enforcement::Full);
        assert_eq!(first, Ok(b"first".to_vec()));
        assert_eq!(replaced, Ok(b"second".to_vec()));
        assert_eq!(refused, (denied(), denied(), denied()));
    }
}
