//! vdev's seccomp rule tables: one allow-list per thread role.
//!
//! vdev runs these threads, each under its own role's filter
//! (`vrdma_isolation::seccomp` compiles and installs them; see
//! docs/security.md for what per-thread filters enforce and what not):
//!
//! - [`Role::Main`] — the main thread: registers with hostd for each
//!   frontend (a new `AF_UNIX` seqpacket connection), starts the other
//!   threads through the launcher, joins them, and releases the device
//!   when the frontend leaves; when hostd restarted, registers every
//!   context again and hands hostd its objects back (guest memory slots,
//!   duplicates of the doorbell and interrupt eventfds: `crate::link`);
//!   starts the device's connection manager (its eventfds are made here).
//! - [`Role::VhostUser`] — the thread that runs vhost-user-backend's daemon
//!   for one frontend (accepts it on the listener, waits for it to leave)
//!   and the threads that library starts from it: the request thread
//!   (vhost-user messages with descriptors, guest memory mapped) and the
//!   epoll worker threads (the control queue and its verbs, which talk to
//!   hostd and lend it duplicates of the doorbell and interrupt eventfds).
//!   vdev does not start those two itself; they inherit this role's
//!   filter from the thread that starts the daemon.
//! - [`Role::PolicyListener`] — hostd's policy notifications, received and
//!   applied to the device's quotas.
//! - [`Role::Cm`] — the device's connection manager (`crate::cm`): sleeps
//!   in `ppoll` on QP1's eventfd and its wake-up eventfd with the agent's
//!   next deadline as timeout, takes and sends CM MADs over the hostd
//!   channel, signals owners' event eventfds.
//!
//! vdev has no datapath thread: hostd reads the tenants' rings itself.
//!
//! Each role's function lists its calls with the reason beside each;
//! [`common_rules`] holds what every thread of a Rust program on glibc
//! needs. No role has `execve`, `fork`, `ptrace`, `kill`, `ioctl`, `bind`,
//! `listen`, `mount`, `bpf`, `memfd_create` or `seccomp`; only the main
//! thread creates sockets (`AF_UNIX` seqpacket) and connects.

use std::fmt;

use vrdma_isolation::seccomp::{common_rules, Rules, SeccompError, ThreadRole};

/// The thread roles of vdev.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Role {
    /// The main thread: hostd registrations, threads, teardown.
    Main,
    /// vhost-user-backend's daemon and the threads it starts.
    VhostUser,
    /// hostd's policy notifications.
    PolicyListener,
    /// The connection manager's thread.
    Cm,
}

impl Role {
    /// The roles of the threads vdev starts after its main thread has
    /// installed [`Role::Main`]'s filter.
    pub const SPAWNED: [Role; 3] = [Role::VhostUser, Role::PolicyListener, Role::Cm];
}

impl ThreadRole for Role {
    fn rules(self) -> Result<Rules, SeccompError> {
        let own = match self {
            Role::Main => main_rules()?,
            Role::VhostUser => vhost_user_rules()?,
            Role::PolicyListener => policy_listener_rules()?,
            Role::Cm => cm_rules(),
        };
        Ok(common_rules()?.merge(own))
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Role::Main => "main",
            Role::VhostUser => "vhost-user",
            Role::PolicyListener => "policy-listener",
            Role::Cm => "cm",
        })
    }
}

/// vdev's threads, each started under its role's filter.
pub type Threads = vrdma_isolation::seccomp::Threads<Role>;

/// The main thread: frontends come and go, hostd registrations, threads.
fn main_rules() -> Result<Rules, SeccompError> {
    let mut r = Rules::new();
    // A registration with hostd per frontend: an AF_UNIX seqpacket socket,
    // nothing else (no network sockets, no netlink, no stream sockets).
    r.allow_unix_seqpacket(libc::SYS_socket)?;
    // connect's address sits behind a pointer; which paths it reaches is
    // decided by file permissions and, with `--sandbox namespace`, by the
    // mount namespace that holds only hostd's socket directory.
    r.allow(libc::SYS_connect);
    // Registration (Hello, the welcome with the policy channel's
    // descriptor), and the request that releases the device's objects when
    // its frontend left.
    r.allow(libc::SYS_sendmsg);
    r.allow(libc::SYS_recvmsg);
    // The registration ends with the frontend: its connection is shut down.
    r.allow(libc::SYS_shutdown);
    // Registering a context again with a restarted hostd (crate::link):
    // its memory slots are identified by their descriptors' (device,
    // inode), and hostd is lent duplicates of the doorbell and interrupt
    // eventfds, as the vhost-user role does when they are first created.
    r.allow_stat_by_descriptor()?;
    r.allow_if_eq(libc::SYS_fcntl, 1, &[libc::F_DUPFD_CLOEXEC as u64])?;
    // A re-registration waits while hostd still tears the previous one of
    // the same device down (it answers EBUSY until then).
    r.allow(libc::SYS_clock_nanosleep);
    // The device's connection manager is started here, on a context's
    // registration: its two eventfds (QP1's wake-ups, its own wake-up),
    // the first lent to hostd with GsiNotify (sendmsg, above).
    r.allow(libc::SYS_eventfd2);
    // At exit the listener's socket file is removed; landlock (no rights)
    // or file permissions refuse it when sandboxed, which is harmless —
    // the next start replaces the file — but must not be a seccomp kill.
    r.allow(libc::SYS_unlink);
    r.allow(libc::SYS_unlinkat);
    Ok(r)
}

/// vhost-user-backend's daemon for one frontend and the threads it starts
/// (request thread, epoll workers).
fn vhost_user_rules() -> Result<Rules, SeccompError> {
    let mut r = Rules::new();
    // The frontend connects on the listener bound before the sandbox.
    r.allow(libc::SYS_accept4);
    // vhost-user messages, with the descriptors of guest memory regions and
    // kick/call eventfds attached (SCM_RIGHTS), and replies; the control
    // verbs' and the memory table's requests to hostd (a guest memory
    // memfd attached to AddMemory).
    r.allow(libc::SYS_recvmsg);
    r.allow(libc::SYS_sendmsg);
    // A memory slot's identity (device, inode) from its descriptor. Guest
    // memory is mapped shared, read/write (common rule: never executable),
    // and unmapped when the memory table changes.
    r.allow_stat_by_descriptor()?;
    // The worker threads' epoll set (created by the daemon, on this
    // thread), the kicks and exit events registered in it, and the wait.
    r.allow_epoll();
    // The workers' exit events and vring-enabled events; kick and call
    // eventfds are read and written (common read/write).
    r.allow(libc::SYS_eventfd2);
    // Descriptors duplicated (try_clone) and inspected before close.
    r.allow_if_eq(
        libc::SYS_fcntl,
        1,
        &[
            libc::F_DUPFD_CLOEXEC as u64,
            libc::F_GETFD as u64,
            libc::F_SETFD as u64,
        ],
    )?;
    // The frontend connection is shut down when it ends.
    r.allow(libc::SYS_shutdown);
    Ok(r)
}

/// hostd's policy notifications: received, and applied to the device in
/// memory; and, when hostd goes away, the port-down event posted to the
/// driver. Nothing else.
fn policy_listener_rules() -> Result<Rules, SeccompError> {
    let mut r = Rules::new();
    r.allow(libc::SYS_recvmsg);
    // The port-down event interrupts the driver through a duplicate of its
    // event queue's call eventfd (written with the common write).
    r.allow_if_eq(libc::SYS_fcntl, 1, &[libc::F_DUPFD_CLOEXEC as u64])?;
    Ok(r)
}

/// The connection manager: waits, talks to hostd over the registration's
/// channel, signals eventfds. Nothing else.
fn cm_rules() -> Rules {
    let mut r = Rules::new();
    // Sleeps on QP1's eventfd and its wake-up eventfd until the agent's
    // next deadline (eventfds are read and written with the common
    // read/write; the clock is the common clock_gettime).
    r.allow(libc::SYS_ppoll);
    // TakeMads and SendMad on the context's hostd channel, and answers.
    r.allow(libc::SYS_sendmsg);
    r.allow(libc::SYS_recvmsg);
    r
}

#[cfg(test)]
mod tests {
    use vrdma_isolation::seccomp::testing::{
        assert_each_role_allows, assert_every_role_compiles, assert_kernel_enforces,
        assert_no_role_allows, assert_only_owners_allow, fcntl, run, statx_by_descriptor,
        unix_seqpacket, x86_64_filter, Call, BAD_FD as BAD, KILL, RW,
    };

    use super::*;

    /// Every role, the main thread's first.
    const ROLES: [Role; 4] = [Role::Main, Role::VhostUser, Role::PolicyListener, Role::Cm];

    const SEQPACKET: u64 = (libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC) as u64;
    const UNIX: u64 = libc::AF_UNIX as u64;

    fn unix_socket() -> Call {
        unix_seqpacket("socket", libc::SYS_socket)
    }

    /// The calls each role makes at run time besides the common ones, with
    /// typical arguments: from `strace -f` of vdev (one trace file per
    /// thread, after the thread's filter) under the demo and the
    /// integration tests, and from the code paths of each role.
    fn needed(role: Role) -> Vec<Call> {
        let cloexec = libc::EPOLL_CLOEXEC as u64;
        // std's channels, on every thread (in `common_rules`).
        let sched_yield = ("sched_yield", libc::SYS_sched_yield, [0; 6]);
        let mut calls = match role {
            Role::Main => vec![
                unix_socket(),
                ("connect", libc::SYS_connect, [4, 0, 35, 0, 0, 0]),
                ("sendmsg", libc::SYS_sendmsg, [4, 0, 0x4000, 0, 0, 0]),
                ("recvmsg", libc::SYS_recvmsg, [4, 0, 0, 0, 0, 0]),
                ("shutdown", libc::SYS_shutdown, [4, 2, 0, 0, 0, 0]),
                ("nanosleep", libc::SYS_clock_nanosleep, [1, 0, 0, 0, 0, 0]),
                ("unlink", libc::SYS_unlink, [0; 6]),
                statx_by_descriptor(),
                fcntl(libc::F_DUPFD_CLOEXEC),
                ("eventfd2", libc::SYS_eventfd2, [0, 0o4000, 0, 0, 0, 0]),
            ],
            Role::VhostUser => vec![
                ("accept4", libc::SYS_accept4, [3, 0, 0, 0o2000000, 0, 0]),
                ("recvmsg", libc::SYS_recvmsg, [18, 0, 0x40000000, 0, 0, 0]),
                ("sendmsg", libc::SYS_sendmsg, [18, 0, 0x4000, 0, 0, 0]),
                (
                    "mmap guest",
                    libc::SYS_mmap,
                    [0, 1 << 24, RW, 0x4001, 20, 0],
                ),
                statx_by_descriptor(),
                (
                    "epoll_create1",
                    libc::SYS_epoll_create1,
                    [cloexec, 0, 0, 0, 0, 0],
                ),
                ("epoll_ctl", libc::SYS_epoll_ctl, [12, 1, 22, 0, 0, 0]),
                ("epoll_wait", libc::SYS_epoll_wait, [12, 0, 100, BAD, 0, 0]),
                ("eventfd2", libc::SYS_eventfd2, [0, 0o4000, 0, 0, 0, 0]),
                fcntl(libc::F_DUPFD_CLOEXEC),
                ("shutdown", libc::SYS_shutdown, [19, 2, 0, 0, 0, 0]),
            ],
            Role::PolicyListener => vec![
                ("recvmsg", libc::SYS_recvmsg, [7, 0, 0, 0, 0, 0]),
                fcntl(libc::F_DUPFD_CLOEXEC),
            ],
            Role::Cm => vec![
                ("ppoll", libc::SYS_ppoll, [0, 2, 0, 0, 8, 0]),
                ("recvmsg", libc::SYS_recvmsg, [7, 0, 0, 0, 0, 0]),
                ("sendmsg", libc::SYS_sendmsg, [7, 0, 0x4000, 0, 0, 0]),
                ("read eventfd", libc::SYS_read, [9, 0, 8, 0, 0, 0]),
                ("write eventfd", libc::SYS_write, [10, 0, 8, 0, 0, 0]),
                ("futex", libc::SYS_futex, [0, 128, 2, 0, 0, 0]),
                ("clock_gettime", libc::SYS_clock_gettime, [1, 0, 0, 0, 0, 0]),
            ],
        };
        calls.push(sched_yield);
        calls
    }

    #[test]
    fn each_role_compiles_and_allows_what_it_needs() {
        assert_every_role_compiles(&ROLES);
        assert_each_role_allows(&ROLES, needed);
        // The main thread's role is not among the roles vdev starts.
        assert!(!Role::SPAWNED.contains(&Role::Main));
        assert_eq!(Role::SPAWNED.len() + 1, ROLES.len());
    }

    #[test]
    fn no_role_can_make_a_call_only_other_roles_need() {
        use Role::*;
        assert_only_owners_allow(
            &ROLES,
            &[
                (unix_socket(), &[Main]),
                (("connect", libc::SYS_connect, [4, 0, 35, 0, 0, 0]), &[Main]),
                (("unlink", libc::SYS_unlink, [0; 6]), &[Main]),
                (
                    ("nanosleep", libc::SYS_clock_nanosleep, [1, 0, 0, 0, 0, 0]),
                    &[Main],
                ),
                (statx_by_descriptor(), &[Main, VhostUser]),
                (("eventfd2", libc::SYS_eventfd2, [0; 6]), &[Main, VhostUser]),
                (
                    ("accept4", libc::SYS_accept4, [3, 0, 0, 0, 0, 0]),
                    &[VhostUser],
                ),
                (
                    fcntl(libc::F_DUPFD_CLOEXEC),
                    &[Main, VhostUser, PolicyListener],
                ),
                (
                    ("epoll_wait", libc::SYS_epoll_wait, [12, 0, 4, 100, 0, 0]),
                    &[VhostUser],
                ),
                (
                    ("sendmsg", libc::SYS_sendmsg, [7, 0, 0, 0, 0, 0]),
                    &[Main, VhostUser, Cm],
                ),
                (("ppoll", libc::SYS_ppoll, [0, 2, 0, 0, 8, 0]), &[Cm]),
            ],
        );
    }

    #[test]
    fn dangerous_calls_are_in_no_role() {
        assert_no_role_allows(
            &ROLES,
            &[
                ("memfd_create", libc::SYS_memfd_create),
                ("setpriority", libc::SYS_setpriority),
            ],
        );
    }

    #[test]
    fn the_arguments_are_checked() {
        let main = x86_64_filter(Role::Main);
        let (inet, stream) = (libc::AF_INET as u64, libc::SOCK_STREAM as u64);
        let netlink = libc::AF_NETLINK as u64;
        let cwd = libc::AT_FDCWD as u64;
        let add_seals = libc::F_ADD_SEALS as u64;
        for (nr, args) in [
            (libc::SYS_socket, [inet, SEQPACKET, 0, 0, 0, 0]),
            (libc::SYS_socket, [UNIX, stream, 0, 0, 0, 0]),
            (libc::SYS_socket, [netlink, 3, 0, 0, 0, 0]),
            (libc::SYS_statx, [cwd, 0, 0, 0xfff, 0, 0]),
            (libc::SYS_fcntl, [3, add_seals, 1, 0, 0, 0]),
        ] {
            assert_eq!(run(&main, nr, args), KILL, "{nr} {args:?}");
        }
        for role in ROLES {
            let f = x86_64_filter(role);
            let rx = (libc::PROT_READ | libc::PROT_EXEC) as u64;
            assert_eq!(
                run(&f, libc::SYS_mmap, [0, 4096, rx, 1, 5, 0]),
                KILL,
                "{role}"
            );
            assert_eq!(run(&f, libc::SYS_mprotect, [0, 4096, rx, 0, 0, 0]), KILL);
            let setown = libc::F_SETOWN as u64;
            assert_eq!(run(&f, libc::SYS_fcntl, [3, setown, 1, 0, 0, 0]), KILL);
            let fork = libc::SIGCHLD as u64;
            assert_eq!(run(&f, libc::SYS_clone, [fork, 0, 0, 0, 0, 0]), KILL);
        }
    }

    /// The same filters asked of the kernel: each installed in a forked
    /// child that makes one call.
    #[test]
    fn the_kernel_enforces_each_role() {
        let accept = ("accept4", libc::SYS_accept4, [BAD, 0, 0, 0, 0, 0]);
        // The main thread receives the context threads' channel messages
        // (`common_rules` lets every thread yield): the kernel must too.
        let sched_yield = ("sched_yield", libc::SYS_sched_yield, [0; 6]);
        assert_kernel_enforces(&[
            (Role::Main, unix_socket(), accept),
            (Role::Main, sched_yield, accept),
            (Role::VhostUser, accept, unix_socket()),
            (
                Role::PolicyListener,
                ("recvmsg", libc::SYS_recvmsg, [BAD, 0, 0, 0, 0, 0]),
                ("sendmsg", libc::SYS_sendmsg, [BAD, 0, 0, 0, 0, 0]),
            ),
            (
                Role::Cm,
                ("ppoll", libc::SYS_ppoll, [0, 0, 1, 0, 8, 0]),
                unix_socket(),
            ),
        ]);
    }
}
