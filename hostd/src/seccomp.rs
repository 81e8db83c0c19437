//! hostd's seccomp rule tables: one allow-list per thread role.
//!
//! hostd runs these threads, each under its own role's filter
//! (`vrdma_isolation::seccomp` compiles and installs them; see
//! docs/security.md for what per-thread filters enforce and what not):
//!
//! - [`Role::Main`] — the main thread: creates the datapath, starts the
//!   other threads through the launcher, then accepts vdevs on the socket
//!   bound before the sandbox, one connection thread each.
//! - [`Role::Connection`] — one thread per vdev: requests and responses
//!   with descriptors (`SCM_RIGHTS`), `SO_PEERCRED`, tenant memory mapped
//!   (never executable) if sealed, the notification `socketpair`, the
//!   drivers' eventfds taken in.
//! - [`Role::Datapath`] — the polling threads: epoll on their own
//!   duplicates of the doorbell eventfds, a monotonic timerfd,
//!   `sched_yield` (every role's); they read and write the tenants' mapped memory (rings,
//!   buffers) and the eventfds, and send and receive RoCEv2 packets
//!   (`sendmmsg`, `recvmmsg`, never waiting) on the sockets of
//!   `net::io::UdpIo`, opened before the sandbox.
//! - [`Role::Admin`] — the admin socket's listener and its clients
//!   (`vrdmactl`: stats, metrics, reload; a new hostd taking over).
//! - [`Role::Sighup`] — reload on SIGHUP, read from a signalfd.
//! - [`Role::Directory`] — the etcd directory's threads (`vrdma-directory`:
//!   lease keepalive and writes; `vrdma-dir-watch`: the watch), only with
//!   `[fabric] directory = "etcd"`: TCP connections to etcd.
//!
//! Each role's function lists its calls with the reason beside each;
//! [`common_rules`] holds what every thread of a Rust program on glibc
//! needs. No role but [`Role::Directory`] has `socket` or `connect` (and
//! it only `AF_INET` stream sockets, to etcd); none has `bind` or `listen`
//! (hostd's sockets are bound before the sandbox), nor
//! `execve`, `fork`, `ptrace`, `kill`, `ioctl`, `unlink`, `chmod`, `bpf`,
//! `memfd_create` or `seccomp`.

use std::fmt;

use vrdma_isolation::seccomp::{common_rules, Op, Rules, SeccompError, ThreadRole};

/// The thread roles of hostd.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Role {
    /// The main thread: set-up, then the vdev accept loop.
    Main,
    /// One thread per vdev connection.
    Connection,
    /// The datapath polling threads.
    Datapath,
    /// The admin socket's threads.
    Admin,
    /// Policy reload on SIGHUP.
    Sighup,
    /// The etcd directory's threads: keepalive, writes, watch.
    Directory,
    /// The Prometheus metrics endpoint's thread (`metrics_listen`).
    Metrics,
}

impl Role {
    /// The roles of the threads hostd starts after its main thread has
    /// installed [`Role::Main`]'s filter.
    pub const SPAWNED: [Role; 6] = [
        Role::Connection,
        Role::Datapath,
        Role::Admin,
        Role::Sighup,
        Role::Directory,
        Role::Metrics,
    ];
}

impl ThreadRole for Role {
    fn rules(self) -> Result<Rules, SeccompError> {
        let own = match self {
            Role::Main => main_rules(),
            Role::Connection => connection_rules()?,
            Role::Datapath => datapath_rules()?,
            Role::Admin => admin_rules()?,
            Role::Sighup => sighup_rules()?,
            Role::Directory => directory_rules()?,
            Role::Metrics => metrics_rules(),
        };
        Ok(common_rules()?.merge(own))
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Role::Main => "main",
            Role::Connection => "connection",
            Role::Datapath => "datapath",
            Role::Admin => "admin",
            Role::Sighup => "sighup",
            Role::Directory => "directory",
            Role::Metrics => "metrics",
        })
    }
}

/// hostd's threads, each started under its role's filter.
pub type Threads = vrdma_isolation::seccomp::Threads<Role>;

/// The main thread: the datapath created, then vdevs accepted.
fn main_rules() -> Rules {
    let mut r = Rules::new();
    // vdevs connect on the listener bound before the sandbox.
    r.allow(libc::SYS_accept4);
    // The datapath threads' wake eventfds, created before they start.
    r.allow(libc::SYS_eventfd2);
    // A failed accept (EMFILE and friends) waits a little, not to spin.
    r.allow(libc::SYS_clock_nanosleep);
    r
}

/// One vdev's connection: its requests, its device's resources.
fn connection_rules() -> Result<Rules, SeccompError> {
    let mut r = Rules::new();
    // Requests and responses, with descriptors (SCM_RIGHTS): guest memory
    // memfds and the drivers' doorbell and interrupt eventfds in, the
    // notification channel out.
    r.allow(libc::SYS_recvmsg);
    r.allow(libc::SYS_sendmsg);
    // The vdev's uid, checked against the policy (SO_PEERCRED only).
    r.allow_if_all(
        libc::SYS_getsockopt,
        &[
            (1, Op::Eq, libc::SOL_SOCKET as u64),
            (2, Op::Eq, libc::SO_PEERCRED as u64),
        ],
    )?;
    // The notification channel of each registration: an AF_UNIX seqpacket
    // pair, nothing else. No socket() at all: hostd connects nowhere.
    r.allow_unix_seqpacket(libc::SYS_socketpair)?;
    // A guest memory memfd is mapped only if sealed against shrinking
    // (F_GET_SEALS), mapped shared, read/write (common rule: never
    // executable); the notification end is made non-blocking; descriptors
    // are duplicated (try_clone) and inspected.
    r.allow_if_eq(
        libc::SYS_fcntl,
        1,
        &[
            libc::F_GET_SEALS as u64,
            libc::F_GETFL as u64,
            libc::F_SETFL as u64,
            libc::F_DUPFD_CLOEXEC as u64,
            libc::F_GETFD as u64,
            libc::F_SETFD as u64,
        ],
    )?;
    // A guest memory memfd's size, and what an eventfd a vdev lends is
    // (hostd then writes 0 to it, a common write), from the descriptor.
    r.allow_stat_by_descriptor()?;
    Ok(r)
}

/// `SOL_XDP` and its `XDP_STATISTICS` option (`linux/if_xdp.h`).
const SOL_XDP: u64 = 283;
const XDP_STATISTICS: u64 = 7;

/// The datapath polling threads.
fn datapath_rules() -> Result<Rules, SeccompError> {
    let mut r = Rules::new();
    // Sleeping on doorbells, the wake eventfd and the retry timer; devices
    // come and go on the thread's own epoll set.
    r.allow_epoll();
    // The retry timer (RNR and retry timers, rate limits, the port): monotonic clock only.
    r.allow_if_eq(libc::SYS_timerfd_create, 0, &[libc::CLOCK_MONOTONIC as u64])?;
    r.allow(libc::SYS_timerfd_settime);
    // Adaptive polling yields the core every turn (`sched_yield`, which
    // every role has: std's channels yield too).
    // A thread on a dedicated core (`datapath_cpus`) pins itself, and only
    // itself (pid 0), at start.
    r.allow_if_eq(libc::SYS_sched_setaffinity, 0, &[0])?;
    // Each thread sleeps on its own duplicates of the drivers' doorbell
    // eventfds (so that it can always remove their registrations), and
    // closes them when a doorbell goes.
    r.allow_if_eq(
        libc::SYS_fcntl,
        1,
        &[libc::F_DUPFD_CLOEXEC as u64, libc::F_GETFD as u64],
    )?;
    // RoCEv2 packets (net::io::UdpIo) on the sockets opened before the
    // sandbox: batches sent and received, never waiting (MSG_DONTWAIT).
    let dontwait = libc::MSG_DONTWAIT as u64;
    r.allow_if_eq(libc::SYS_sendmmsg, 3, &[dontwait])?;
    r.allow_if_eq(libc::SYS_recvmmsg, 3, &[dontwait])?;
    // AF_XDP (net::io::XdpIo): a transmit kick is an empty `sendto` on
    // the XSK; a next hop's MAC is asked of the kernel on the rtnetlink
    // socket opened before the sandbox (`sendto`, then `recvfrom` of the
    // answer the kernel queued during it). Never waiting.
    r.allow_if_eq(libc::SYS_sendto, 3, &[dontwait])?;
    r.allow_if_eq(libc::SYS_recvfrom, 3, &[dontwait])?;
    // A MAD that came from the network goes to its device's connection
    // manager on the push socket hostd made (`Channel::try_send`): never
    // waiting, never raising SIGPIPE.
    r.allow_if_eq(
        libc::SYS_sendmsg,
        2,
        &[(libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL) as u64],
    )?;
    // The packet socket's drop counter (PACKET_STATISTICS) and the XSKs'
    // (XDP_STATISTICS), and nothing else.
    r.allow_if_any(
        libc::SYS_getsockopt,
        &[
            &[
                (1, Op::Eq, libc::SOL_PACKET as u64),
                (2, Op::Eq, libc::PACKET_STATISTICS as u64),
            ],
            &[(1, Op::Eq, SOL_XDP), (2, Op::Eq, XDP_STATISTICS)],
        ],
    )?;
    Ok(r)
}

/// The admin socket's listener and its clients.
fn admin_rules() -> Result<Rules, SeccompError> {
    let mut r = policy_reload_rules()?;
    // vrdmactl connects on the listener bound (mode 0600) before the
    // sandbox; a failed accept waits a little, not to spin.
    r.allow(libc::SYS_accept4);
    r.allow(libc::SYS_clock_nanosleep);
    // Admin requests and responses (no descriptors are accepted); a
    // handover sends the sockets (SCM_RIGHTS) to the new hostd.
    r.allow(libc::SYS_recvmsg);
    r.allow(libc::SYS_sendmsg);
    // A handover waits for the new hostd's word on a non-blocking socket
    // (with pauses: there is no poll), to give up after a while.
    r.allow_if_eq(
        libc::SYS_fcntl,
        1,
        &[libc::F_GETFL as u64, libc::F_SETFL as u64],
    )?;
    Ok(r)
}

/// The metrics endpoint: scrapes accepted on the listener bound before
/// the sandbox (a failed accept waits a little); requests and answers
/// through the common read and write, nothing else (no file, no other
/// socket call).
fn metrics_rules() -> Rules {
    let mut r = Rules::new();
    r.allow(libc::SYS_accept4);
    r.allow(libc::SYS_clock_nanosleep);
    r
}

/// Reload on SIGHUP: the signal is read from a signalfd opened before the
/// sandbox (common read); the rest is the reload itself.
fn sighup_rules() -> Result<Rules, SeccompError> {
    policy_reload_rules()
}

/// The etcd directory's threads (`net::directory::etcd`): plain HTTP to
/// etcd over TCP, each request on a fresh non-blocking connection
/// (`net::directory::http` makes it by hand so that no `ioctl(FIONBIO)` is
/// needed).
fn directory_rules() -> Result<Rules, SeccompError> {
    let mut r = Rules::new();
    // IPv4 TCP sockets only (no UDP, raw, netlink or unix sockets).
    r.allow_if_all(
        libc::SYS_socket,
        &[
            (0, Op::Eq, libc::AF_INET as u64),
            (1, Op::MaskedEq(SOCK_TYPE_MASK), libc::SOCK_STREAM as u64),
        ],
    )?;
    r.allow(libc::SYS_connect);
    // The outcome of a non-blocking connect, and nothing else.
    r.allow_if_all(
        libc::SYS_getsockopt,
        &[
            (1, Op::Eq, libc::SOL_SOCKET as u64),
            (2, Op::Eq, libc::SO_ERROR as u64),
        ],
    )?;
    // Every wait for etcd is a poll with a timeout (glibc's poll is poll
    // or ppoll, depending on its version).
    r.allow(libc::SYS_poll);
    r.allow(libc::SYS_ppoll);
    // std's TcpStream reads and writes with recv/send.
    r.allow(libc::SYS_recvfrom);
    r.allow(libc::SYS_sendto);
    // Backoff between attempts to reach etcd again.
    r.allow(libc::SYS_clock_nanosleep);
    Ok(r)
}

/// `SOCK_TYPE_MASK` of `<linux/net.h>`: the type bits of socket()'s second
/// argument, without SOCK_CLOEXEC/SOCK_NONBLOCK.
const SOCK_TYPE_MASK: u64 = 0xf;

/// A policy reload, from the admin socket or SIGHUP: the policy file and
/// the cluster file (`[fabric]`) opened read-only (common rule; landlock
/// allows the files of their directories only) and sized from their
/// descriptors (an etcd directory's writes are handed to its own thread), and the new policy sent
/// to each connected vdev whose tenant's policy changed.
fn policy_reload_rules() -> Result<Rules, SeccompError> {
    let mut r = Rules::new();
    r.allow_stat_by_descriptor()?;
    r.allow(libc::SYS_sendmsg);
    Ok(r)
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
    const ROLES: [Role; 7] = [
        Role::Main,
        Role::Connection,
        Role::Datapath,
        Role::Admin,
        Role::Sighup,
        Role::Directory,
        Role::Metrics,
    ];

    /// `socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0)`:
    /// a connection to etcd.
    fn tcp_socket() -> Call {
        let flags = libc::SOCK_STREAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC;
        let args = [libc::AF_INET as u64, flags as u64, 0, 0, 0, 0];
        ("socket(AF_INET, SOCK_STREAM)", libc::SYS_socket, args)
    }

    const SEQPACKET: u64 = (libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC) as u64;
    const UNIX: u64 = libc::AF_UNIX as u64;

    fn peercred() -> Call {
        let (sol, peercred) = (libc::SOL_SOCKET as u64, libc::SO_PEERCRED as u64);
        (
            "getsockopt",
            libc::SYS_getsockopt,
            [9, sol, peercred, 0, 0, 0],
        )
    }

    fn socketpair() -> Call {
        unix_seqpacket("socketpair", libc::SYS_socketpair)
    }

    fn monotonic_timer() -> Call {
        let args = [
            libc::CLOCK_MONOTONIC as u64,
            libc::TFD_CLOEXEC as u64,
            0,
            0,
            0,
            0,
        ];
        ("timerfd_create", libc::SYS_timerfd_create, args)
    }

    /// The calls each role makes at run time besides the common ones, with
    /// typical arguments: from `strace -f` of hostd (one trace file per
    /// thread, after the thread's filter) under the demo and the
    /// integration tests (RDMA, policy reload by SIGHUP and by vrdmactl).
    fn needed(role: Role) -> Vec<Call> {
        let cloexec = libc::EPOLL_CLOEXEC as u64;
        let nanosleep = ("nanosleep", libc::SYS_clock_nanosleep, [1, 0, 0, 0, 0, 0]);
        match role {
            Role::Main => vec![
                ("accept4", libc::SYS_accept4, [3, 0, 0, 0o2000000, 0, 0]),
                ("eventfd2", libc::SYS_eventfd2, [0, 0o2004000, 0, 0, 0, 0]),
                nanosleep,
            ],
            Role::Connection => vec![
                ("recvmsg", libc::SYS_recvmsg, [9, 0, 0x40000000, 0, 0, 0]),
                ("sendmsg", libc::SYS_sendmsg, [9, 0, 0x4000, 0, 0, 0]),
                peercred(),
                socketpair(),
                fcntl(libc::F_GET_SEALS),
                fcntl(libc::F_GETFL),
                fcntl(libc::F_SETFL),
                fcntl(libc::F_DUPFD_CLOEXEC),
                statx_by_descriptor(),
                (
                    "mmap tenant memory",
                    libc::SYS_mmap,
                    [0, 1 << 24, RW, 1, 11, 0],
                ),
            ],
            Role::Datapath => vec![
                (
                    "epoll_create1",
                    libc::SYS_epoll_create1,
                    [cloexec, 0, 0, 0, 0, 0],
                ),
                ("epoll_ctl", libc::SYS_epoll_ctl, [7, 1, 9, 0, 0, 0]),
                ("epoll_wait", libc::SYS_epoll_wait, [7, 0, 64, 1, 0, 0]),
                monotonic_timer(),
                (
                    "timerfd_settime",
                    libc::SYS_timerfd_settime,
                    [8, 0, 0, 0, 0, 0],
                ),
                ("sched_yield", libc::SYS_sched_yield, [0; 6]),
                ("XSK kick", libc::SYS_sendto, [9, 0, 0, 0x40, 0, 0]),
                (
                    "XSK statistics",
                    libc::SYS_getsockopt,
                    [9, SOL_XDP, XDP_STATISTICS, 0, 0, 0],
                ),
                (
                    "rtnetlink question",
                    libc::SYS_sendto,
                    [10, 0, 40, 0x40, 0, 0],
                ),
                (
                    "rtnetlink answer",
                    libc::SYS_recvfrom,
                    [10, 0, 8192, 0x40, 0, 0],
                ),
                (
                    "sched_setaffinity itself",
                    libc::SYS_sched_setaffinity,
                    [0, 128, 0, 0, 0, 0],
                ),
                fcntl(libc::F_DUPFD_CLOEXEC),
                ("sendmmsg", libc::SYS_sendmmsg, [9, 0, 64, 0x40, 0, 0]),
                ("recvmmsg", libc::SYS_recvmmsg, [10, 0, 64, 0x40, 0, 0]),
                ("push a MAD", libc::SYS_sendmsg, [11, 0, 0x4040, 0, 0, 0]),
            ],
            Role::Admin => vec![
                ("accept4", libc::SYS_accept4, [4, 0, 0, 0o2000000, 0, 0]),
                ("recvmsg", libc::SYS_recvmsg, [9, 0, 0, 0, 0, 0]),
                ("sendmsg", libc::SYS_sendmsg, [9, 0, 0x4000, 0, 0, 0]),
                statx_by_descriptor(),
                nanosleep,
            ],
            Role::Sighup => vec![
                statx_by_descriptor(),
                ("sendmsg", libc::SYS_sendmsg, [9, 0, 0x4040, 0, 0, 0]),
            ],
            Role::Directory => vec![
                tcp_socket(),
                ("connect", libc::SYS_connect, [9, 0, 16, 0, 0, 0]),
                (
                    "getsockopt SO_ERROR",
                    libc::SYS_getsockopt,
                    [9, libc::SOL_SOCKET as u64, libc::SO_ERROR as u64, 0, 0, 0],
                ),
                ("poll", libc::SYS_poll, [0, 1, 500, 0, 0, 0]),
                ("ppoll", libc::SYS_ppoll, [0, 1, 0, 0, 8, 0]),
                ("sendto", libc::SYS_sendto, [9, 0, 200, 0x4000, 0, 0]),
                ("recvfrom", libc::SYS_recvfrom, [9, 0, 16384, 0, 0, 0]),
                nanosleep,
            ],
            Role::Metrics => vec![
                ("accept4", libc::SYS_accept4, [6, 0, 0, 0o2000000, 0, 0]),
                ("read request", libc::SYS_read, [7, 0, 1024, 0, 0, 0]),
                ("write answer", libc::SYS_write, [7, 0, 4096, 0, 0, 0]),
                nanosleep,
            ],
        }
    }

    #[test]
    fn each_role_compiles_and_allows_what_it_needs() {
        assert_every_role_compiles(&ROLES);
        assert_each_role_allows(&ROLES, needed);
        // The main thread's role is not among the roles hostd starts.
        assert!(!Role::SPAWNED.contains(&Role::Main));
        assert_eq!(Role::SPAWNED.len() + 1, ROLES.len());
    }

    #[test]
    fn no_role_can_make_a_call_only_other_roles_need() {
        use Role::*;
        let any = |name, nr| (name, nr, [9, 0, 0, 0, 0, 0]);
        assert_only_owners_allow(
            &ROLES,
            &[
                (any("accept4", libc::SYS_accept4), &[Main, Admin, Metrics]),
                (
                    any("nanosleep", libc::SYS_clock_nanosleep),
                    &[Main, Admin, Directory, Metrics],
                ),
                (tcp_socket(), &[Directory]),
                (any("connect", libc::SYS_connect), &[Directory]),
                (any("recvfrom", libc::SYS_recvfrom), &[Directory]),
                (any("sendto", libc::SYS_sendto), &[Directory]),
                (any("eventfd2", libc::SYS_eventfd2), &[Main]),
                (any("recvmsg", libc::SYS_recvmsg), &[Connection, Admin]),
                (
                    any("sendmsg", libc::SYS_sendmsg),
                    &[Connection, Admin, Sighup],
                ),
                (statx_by_descriptor(), &[Connection, Admin, Sighup]),
                (peercred(), &[Connection]),
                (socketpair(), &[Connection]),
                (fcntl(libc::F_GET_SEALS), &[Connection]),
                (fcntl(libc::F_DUPFD_CLOEXEC), &[Connection, Datapath]),
                (any("epoll_wait", libc::SYS_epoll_wait), &[Datapath]),
                (monotonic_timer(), &[Datapath]),
                (
                    ("sendmmsg", libc::SYS_sendmmsg, [9, 0, 64, 0x40, 0, 0]),
                    &[Datapath],
                ),
                (
                    ("recvmmsg", libc::SYS_recvmmsg, [9, 0, 64, 0x40, 0, 0]),
                    &[Datapath],
                ),
            ],
        );
    }

    #[test]
    fn dangerous_calls_are_in_no_role() {
        // Besides the calls no daemon may make: hostd's sockets are bound
        // before the sandbox; it connects nowhere but to etcd (the
        // directory's role), creates no socket but a socketpair otherwise,
        // removes no file and changes no mode or priority.
        let not_directory: Vec<Role> = ROLES
            .into_iter()
            .filter(|&r| r != Role::Directory)
            .collect();
        assert_no_role_allows(
            &not_directory,
            &[("socket", libc::SYS_socket), ("connect", libc::SYS_connect)],
        );
        assert_no_role_allows(
            &ROLES,
            &[
                ("unlink", libc::SYS_unlink),
                ("unlinkat", libc::SYS_unlinkat),
                ("chmod", libc::SYS_chmod),
                ("memfd_create", libc::SYS_memfd_create),
                ("ftruncate", libc::SYS_ftruncate),
                ("shutdown", libc::SYS_shutdown),
                ("signalfd4", libc::SYS_signalfd4),
                ("setpriority", libc::SYS_setpriority),
            ],
        );
    }

    #[test]
    fn the_arguments_are_checked() {
        let conn = x86_64_filter(Role::Connection);
        let stream = (libc::SOCK_STREAM | libc::SOCK_CLOEXEC) as u64;
        let inet = libc::AF_INET as u64;
        let sol = libc::SOL_SOCKET as u64;
        let (rcvbuf, peercred) = (libc::SO_RCVBUF as u64, libc::SO_PEERCRED as u64);
        let cwd = libc::AT_FDCWD as u64;
        for (nr, args) in [
            (libc::SYS_socketpair, [UNIX, stream, 0, 0, 0, 0]),
            (libc::SYS_socketpair, [inet, SEQPACKET, 0, 0, 0, 0]),
            (libc::SYS_getsockopt, [3, sol, rcvbuf, 0, 0, 0]),
            (libc::SYS_setsockopt, [3, sol, peercred, 0, 0, 0]),
            (libc::SYS_fcntl, [3, libc::F_ADD_SEALS as u64, 1, 0, 0, 0]),
            (libc::SYS_statx, [cwd, 0, 0, 0xfff, 0, 0]),
        ] {
            assert_eq!(run(&conn, nr, args), KILL, "{nr} {args:?}");
        }
        // The directory: IPv4 TCP sockets only, SO_ERROR only.
        let dir = x86_64_filter(Role::Directory);
        let dgram = libc::SOCK_DGRAM as u64;
        let raw = libc::SOCK_RAW as u64;
        for (nr, args) in [
            (libc::SYS_socket, [inet, dgram, 0, 0, 0, 0]),
            (libc::SYS_socket, [inet, raw, 17, 0, 0, 0]),
            (libc::SYS_socket, [UNIX, stream, 0, 0, 0, 0]),
            (
                libc::SYS_socket,
                [libc::AF_INET6 as u64, stream, 0, 0, 0, 0],
            ),
            (libc::SYS_socket, [libc::AF_NETLINK as u64, raw, 0, 0, 0, 0]),
            (libc::SYS_getsockopt, [3, sol, peercred, 0, 0, 0]),
            (libc::SYS_setsockopt, [3, sol, rcvbuf, 0, 0, 0]),
            (libc::SYS_bind, [3, 0, 16, 0, 0, 0]),
            (libc::SYS_ioctl, [3, libc::FIONBIO, 0, 0, 0, 0]),
        ] {
            assert_eq!(run(&dir, nr, args), KILL, "directory: {nr} {args:?}");
        }
        let realtime = libc::CLOCK_REALTIME as u64;
        let datapath = x86_64_filter(Role::Datapath);
        let args = [realtime, 0, 0, 0, 0, 0];
        assert_eq!(run(&datapath, libc::SYS_timerfd_create, args), KILL);
        // Pinning another thread or process.
        let other = [1234, 128, 0, 0, 0, 0];
        assert_eq!(run(&datapath, libc::SYS_sched_setaffinity, other), KILL);
        // Packets never wait: a blocking send or receive is refused.
        for nr in [
            libc::SYS_sendmmsg,
            libc::SYS_recvmmsg,
            libc::SYS_sendto,
            libc::SYS_recvfrom,
        ] {
            assert_eq!(run(&datapath, nr, [9, 0, 64, 0, 0, 0]), KILL, "{nr}");
        }
        // The packet socket's and the XSKs' statistics, and no other
        // socket option.
        let getsockopt =
            |level, name| run(&datapath, libc::SYS_getsockopt, [3, level, name, 0, 0, 0]);
        assert_ne!(getsockopt(SOL_XDP, XDP_STATISTICS), KILL);
        assert_eq!(getsockopt(SOL_XDP, 1 /* XDP_MMAP_OFFSETS */), KILL);
        let (packet, stats) = (libc::SOL_PACKET as u64, libc::PACKET_STATISTICS as u64);
        let getsockopt =
            |level, name| run(&datapath, libc::SYS_getsockopt, [3, level, name, 0, 0, 0]);
        assert_ne!(getsockopt(packet, stats), KILL);
        assert_eq!(getsockopt(sol, peercred), KILL);
        assert_eq!(getsockopt(packet, libc::PACKET_VNET_HDR as u64), KILL);
        for role in ROLES {
            let f = x86_64_filter(role);
            let rwx = RW | libc::PROT_EXEC as u64;
            assert_eq!(
                run(&f, libc::SYS_mmap, [0, 4096, rwx, 1, 5, 0]),
                KILL,
                "{role}"
            );
            assert_eq!(run(&f, libc::SYS_mprotect, [0, 4096, rwx, 0, 0, 0]), KILL);
            let setown = libc::F_SETOWN as u64;
            assert_eq!(run(&f, libc::SYS_fcntl, [3, setown, 1, 0, 0, 0]), KILL);
            let wronly = libc::O_WRONLY as u64;
            assert_eq!(run(&f, libc::SYS_openat, [0, 0, wronly, 0, 0, 0]), KILL);
        }
    }

    /// The same filters asked of the kernel: each installed in a forked
    /// child that makes one call.
    #[test]
    fn the_kernel_enforces_each_role() {
        let accept = ("accept4", libc::SYS_accept4, [BAD, 0, 0, 0, 0, 0]);
        let sched_yield = ("sched_yield", libc::SYS_sched_yield, [0; 6]);
        assert_kernel_enforces(&[
            (Role::Main, accept, socketpair()),
            (Role::Connection, socketpair(), accept),
            (Role::Datapath, sched_yield, socketpair()),
            (Role::Admin, accept, socketpair()),
            (
                Role::Sighup,
                ("sendmsg", libc::SYS_sendmsg, [BAD, 0, 0, 0, 0, 0]),
                ("recvmsg", libc::SYS_recvmsg, [BAD, 0, 0, 0, 0, 0]),
            ),
        ]);
    }
}
