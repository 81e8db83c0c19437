//! vrdma-isolation: the walls around the vrdma daemons that handle
//! untrusted input: vdev (the per-tenant vhost-user backend) and hostd (the
//! host datapath every vdev talks to).
//!
//! Each wall is one module, applied by the daemon in a fixed order after it
//! has opened what it needs (sockets, files) and before it starts threads:
//!
//! 1. [`namespaces`] (optional, `--sandbox namespace`): private mount,
//!    network and IPC namespaces, and a root directory that holds nothing
//!    but what the daemon must still reach by path.
//! 2. [`landlock`]: the file system rules — for vdev, nothing at all; for
//!    hostd, reading its policy file.
//! 3. [`privileges`]: resource limits, then another uid/gid, no
//!    capabilities (effective, permitted, inheritable, ambient, bounding),
//!    `no_new_privs`, not dumpable.
//! 4. [`seccomp`]: an allow-list of system calls per thread role. The
//!    daemon keeps the rule tables (one enum of roles, one function of
//!    rules per role); this crate compiles them, installs the main role's
//!    filter on the main thread, and starts every later thread through
//!    [`seccomp::Threads`], which installs the thread's own role's filter
//!    before it runs anything of its own.
//!
//! Both daemons take the same settings for these walls ([`config`]: the
//! `--seccomp`, `--landlock`, `--sandbox`, `--uid`... flags and the
//! `[sandbox]` table) and go through the same steps ([`sandbox::Plan`]);
//! what differs is what their walls are made of ([`sandbox::Walls`]) and
//! their seccomp rule tables.
//!
//! The order matters: mounts need `CAP_SYS_ADMIN` and are refused inside a
//! landlock domain; landlock paths are resolved in the final mount view;
//! changing uid needs the capabilities the last step drops; and the seccomp
//! filter forbids every call the earlier steps make.
//!
//! Around the walls, the daemons share their frame too ([`daemon`]): the
//! log, the config file, how `main` ends.
//!
//! `docs/security.md` describes the threat model and what each wall stops.

pub mod config;
pub mod cpus;
pub mod daemon;
pub mod landlock;
pub mod namespaces;
pub mod privileges;
pub mod sandbox;
pub mod seccomp;
#[cfg(feature = "test-hooks")]
pub mod test_hooks;

/// Number of threads of the calling process (from `/proc/self/status`).
///
/// Landlock and the credential changes apply to the calling thread only
/// (and to the threads it starts later), so the sandbox must be entered
/// while the process is still single-threaded; callers check it with this.
pub fn thread_count() -> std::io::Result<usize> {
    let status = std::fs::read_to_string("/proc/self/status")?;
    status
        .lines()
        .find_map(|line| line.strip_prefix("Threads:"))
        .and_then(|n| n.trim().parse().ok())
        .ok_or_else(|| std::io::Error::other("no Threads: line in /proc/self/status"))
}

/// `errno` of the last failed libc call, as an `io::Error`.
pub(crate) fn last_os_error() -> std::io::Error {
    std::io::Error::last_os_error()
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_test_process_has_threads() {
        assert!(super::thread_count().expect("thread count") >= 1);
    }
}
