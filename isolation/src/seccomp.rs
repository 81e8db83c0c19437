//! seccomp: the system calls vdev's threads may make, and nothing else.
//!
//! vdev runs three kinds of thread, each a [`Role`] with its own rule
//! function merged with [`common_rules`]:
//!
//! - [`Role::Control`] — the main thread: accepts frontends on the
//!   vhost-user listener, registers with hostd (a new `AF_UNIX` seqpacket
//!   connection per frontend), maps the physical queues hostd grants,
//!   starts and joins the other threads.
//! - [`Role::VhostUser`] — the vhost-user daemon's request thread and its
//!   epoll worker threads: vhost-user messages with descriptors, guest
//!   memory mapped and unmapped, kick/call eventfds, the control queue.
//! - [`Role::Datapath`] — the polling thread and hostd's policy listener:
//!   eventfds, `epoll_wait`, `sched_yield`, requests to hostd.
//!
//! hostd runs two more ([`Role::HOSTD`]):
//!
//! - [`Role::HostdControl`] — the vdev and admin listeners, one thread per
//!   vdev connection and the SIGHUP thread: descriptors in and out
//!   (`SCM_RIGHTS`), `SO_PEERCRED`, tenant memory mapped (never
//!   executable), sealed queue memfds created (`memfd_create`,
//!   `ftruncate`, `F_ADD_SEALS`), notification `socketpair`s, eventfds,
//!   and the policy file re-read on reload. No `socket`, `connect`,
//!   `bind` or `listen`: its sockets are bound before the filter.
//! - [`Role::HostdDatapath`] — the polling threads: epoll, a monotonic
//!   timerfd, `sched_yield`.
//!
//! All threads of a process share one filter if it is installed with
//! TSYNC before they start, so vdev installs the **union** of the roles it
//! runs ([`install`]); the per-role functions keep that union explicit and
//! are unit-tested one by one (a syscall a role needs and lacks fails
//! `cargo test`, not a production run).
//!
//! Arguments are restricted wherever the kernel lets a filter see them:
//! `mmap`/`mprotect` never with `PROT_EXEC`; `socket` only `AF_UNIX`
//! seqpacket; `clone` only threads (`clone3`, whose flags sit behind a
//! pointer, fails with `ENOSYS` so that glibc falls back to `clone`);
//! `openat` only read-only (landlock then refuses the path); `prctl` only
//! `PR_SET_NAME`; `fcntl` and `madvise` only the commands vdev uses;
//! `tgkill` only `SIGABRT` to vdev itself. No `ioctl` at all: the only one
//! vdev makes (`TCGETS`, "is stderr a terminal?") happens before the
//! filter exists.
//!
//! A call outside the list is handled as the operator chose
//! ([`ViolationAction`]): the process is killed (`SIGSYS`, the default),
//! the call fails with `EPERM` and is reported on stderr (`trap`), or it
//! is allowed and logged by the kernel's audit (`log`, for finding what is
//! missing). `off` installs nothing and is only ever chosen explicitly.

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;

use seccompiler::{
    BackendError, BpfProgram, SeccompAction, SeccompCmpArgLen as ArgLen, SeccompCmpOp as Op,
    SeccompCondition as Cond, SeccompFilter, SeccompRule, TargetArch,
};

/// The thread roles of vdev and of hostd.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Role {
    /// The main thread: listener, hostd registration, thread management.
    Control,
    /// vhost-user request handling and the epoll worker threads.
    VhostUser,
    /// The datapath poller and hostd's policy listener.
    Datapath,
    /// hostd's control threads: the vdev and admin listeners, one thread
    /// per vdev connection, policy reload on SIGHUP.
    HostdControl,
    /// hostd's datapath polling threads.
    HostdDatapath,
}

impl Role {
    /// Every role vdev runs.
    pub const ALL: [Role; 3] = [Role::Control, Role::VhostUser, Role::Datapath];
    /// Every role hostd runs.
    pub const HOSTD: [Role; 2] = [Role::HostdControl, Role::HostdDatapath];

    /// The rules of this role merged with the rules every thread needs.
    pub fn rules(self) -> Result<Rules, SeccompError> {
        let own = match self {
            Role::Control => control_rules()?,
            Role::VhostUser => vhost_user_rules()?,
            Role::Datapath => datapath_rules()?,
            Role::HostdControl => hostd_control_rules()?,
            Role::HostdDatapath => hostd_datapath_rules()?,
        };
        Ok(merge(common_rules()?, own))
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Role::Control => "control",
            Role::VhostUser => "vhost-user",
            Role::Datapath => "datapath",
            Role::HostdControl => "hostd-control",
            Role::HostdDatapath => "hostd-datapath",
        })
    }
}

/// What happens when a thread makes a system call outside the allow-list.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ViolationAction {
    /// The whole process dies with `SIGSYS` (`SECCOMP_RET_KILL_PROCESS`).
    #[default]
    Kill,
    /// The call does not happen; a `SIGSYS` handler reports it on stderr
    /// and makes it return `EPERM`, and the process goes on.
    Trap,
    /// The call happens, and the kernel logs it (audit, `dmesg`). Never a
    /// default: it enforces nothing.
    Log,
}

/// The operator's choice: enforce with an action, or no filter at all.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SeccompMode {
    Enforce(ViolationAction),
    /// No filter. Only ever chosen explicitly (`--seccomp off`).
    Off,
}

impl Default for SeccompMode {
    fn default() -> Self {
        SeccompMode::Enforce(ViolationAction::Kill)
    }
}

impl FromStr for SeccompMode {
    type Err = SeccompError;

    fn from_str(s: &str) -> Result<Self, SeccompError> {
        match s {
            "kill" => Ok(SeccompMode::Enforce(ViolationAction::Kill)),
            "trap" => Ok(SeccompMode::Enforce(ViolationAction::Trap)),
            "log" => Ok(SeccompMode::Enforce(ViolationAction::Log)),
            "off" => Ok(SeccompMode::Off),
            other => Err(SeccompError::Mode(other.to_owned())),
        }
    }
}

impl fmt::Display for SeccompMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            SeccompMode::Enforce(ViolationAction::Kill) => "kill",
            SeccompMode::Enforce(ViolationAction::Trap) => "trap",
            SeccompMode::Enforce(ViolationAction::Log) => "log",
            SeccompMode::Off => "off",
        })
    }
}

/// Why a filter cannot be built or installed.
#[derive(Debug, thiserror::Error)]
pub enum SeccompError {
    #[error("Unknown seccomp mode {0:?} (expected kill, trap, log or off)")]
    Mode(String),
    #[error("Invalid seccomp rule")]
    Rule(#[source] BackendError),
    #[error("Architecture {0} has no seccomp support in seccompiler")]
    Arch(&'static str),
    #[error("Cannot install the SIGSYS handler")]
    Handler(#[source] std::io::Error),
    #[error("Cannot install the seccomp filter")]
    Install(#[source] seccompiler::Error),
}

/// Allowed system calls: number → conditions (any rule may match; an
/// empty list allows the call whatever its arguments).
pub type Rules = BTreeMap<i64, Vec<SeccompRule>>;

/// One condition on argument `arg` (32-bit compare: every restricted
/// argument is an `int` or flags that fit one).
fn cond(arg: u8, op: Op, value: u64) -> Result<Cond, SeccompError> {
    Cond::new(arg, ArgLen::Dword, op, value).map_err(SeccompError::Rule)
}

/// A rule of conditions that must all hold.
fn rule(conditions: Vec<Cond>) -> Result<SeccompRule, SeccompError> {
    SeccompRule::new(conditions).map_err(SeccompError::Rule)
}

/// Allowed whatever its arguments.
fn any(rules: &mut Rules, nr: i64) {
    rules.insert(nr, Vec::new());
}

/// Allowed when argument `arg` equals one of `values`.
fn one_of(rules: &mut Rules, nr: i64, arg: u8, values: &[u64]) -> Result<(), SeccompError> {
    let list = values
        .iter()
        .map(|&v| rule(vec![cond(arg, Op::Eq, v)?]))
        .collect::<Result<Vec<_>, _>>()?;
    rules.insert(nr, list);
    Ok(())
}

/// Allowed when `arg & mask == value`.
fn masked(rules: &mut Rules, nr: i64, arg: u8, mask: u64, value: u64) -> Result<(), SeccompError> {
    rules.insert(nr, vec![rule(vec![cond(arg, Op::MaskedEq(mask), value)?])?]);
    Ok(())
}

/// Merges two rule sets: a call is allowed if either allows it.
pub fn merge(mut a: Rules, b: Rules) -> Rules {
    for (nr, rules) in b {
        match a.get_mut(&nr) {
            // Unconditional on either side: unconditional.
            Some(existing) if existing.is_empty() => {}
            Some(existing) if rules.is_empty() => existing.clear(),
            Some(existing) => {
                for r in rules {
                    if !existing.contains(&r) {
                        existing.push(r);
                    }
                }
            }
            None => {
                a.insert(nr, rules);
            }
        }
    }
    a
}

/// `openat` flags vdev never uses: anything but read-only, creating,
/// truncating, `O_PATH` descriptors and anonymous temporary files.
const OPEN_FORBIDDEN_FLAGS: u64 = (libc::O_ACCMODE
    | libc::O_CREAT
    | libc::O_TRUNC
    | libc::O_APPEND
    | libc::O_PATH
    | libc::O_TMPFILE) as u64;

/// What every thread of a Rust program on glibc needs.
pub fn common_rules() -> Result<Rules, SeccompError> {
    let mut r = Rules::new();
    // Eventfds (kick, call, wake-ups), sockets, and log lines on stderr.
    any(&mut r, libc::SYS_read);
    any(&mut r, libc::SYS_write);
    any(&mut r, libc::SYS_close);
    // Mutexes, condition variables, thread join.
    any(&mut r, libc::SYS_futex);
    // Heap: the main arena grows with brk, large blocks are mapped, and
    // realloc of a mapped block moves it with mremap (which cannot add
    // PROT_EXEC).
    any(&mut r, libc::SYS_brk);
    any(&mut r, libc::SYS_mremap);
    any(&mut r, libc::SYS_munmap);
    // Anonymous memory, thread stacks, guest memory and hostd's queues —
    // never executable: a guest that wins a memory bug cannot map code.
    masked(&mut r, libc::SYS_mmap, 2, libc::PROT_EXEC as u64, 0)?;
    masked(&mut r, libc::SYS_mprotect, 2, libc::PROT_EXEC as u64, 0)?;
    // glibc returns the stack of an exited thread and trims malloc arenas.
    one_of(&mut r, libc::SYS_madvise, 2, &[libc::MADV_DONTNEED as u64])?;
    // Signal masks around thread creation, glibc's lazily installed
    // internal handlers, Rust's per-thread alternate signal stack, and
    // the return from any handler (the `trap` SIGSYS handler too).
    any(&mut r, libc::SYS_rt_sigprocmask);
    any(&mut r, libc::SYS_rt_sigaction);
    any(&mut r, libc::SYS_rt_sigreturn);
    any(&mut r, libc::SYS_sigaltstack);
    // Thread start-up in glibc: restartable sequences, the robust futex
    // list, the thread id (also in Rust's thread handles), and malloc's
    // arena sizing from the CPU affinity mask.
    any(&mut r, libc::SYS_rseq);
    any(&mut r, libc::SYS_set_robust_list);
    any(&mut r, libc::SYS_gettid);
    any(&mut r, libc::SYS_sched_getaffinity);
    // Time for polling deadlines and log lines (normally the vDSO; the
    // system call is its fallback).
    any(&mut r, libc::SYS_clock_gettime);
    // New threads only: CLONE_THREAD set, so no new process can appear.
    masked(
        &mut r,
        libc::SYS_clone,
        0,
        libc::CLONE_THREAD as u64,
        libc::CLONE_THREAD as u64,
    )?;
    // clone3 passes its flags behind a pointer no filter can read. It is
    // allowed here only because [`install`] stacks a filter in front that
    // makes it fail with ENOSYS (a higher-precedence result than allow),
    // and glibc then falls back to clone, checked above.
    any(&mut r, libc::SYS_clone3);
    // A thread ends; the process ends.
    any(&mut r, libc::SYS_exit);
    any(&mut r, libc::SYS_exit_group);
    // Thread names (Rust's thread builder, the vhost-user daemon).
    one_of(&mut r, libc::SYS_prctl, 0, &[libc::PR_SET_NAME as u64])?;
    // abort() (a double panic) raises SIGABRT at this process: getpid,
    // then tgkill aimed at ourselves only.
    any(&mut r, libc::SYS_getpid);
    r.insert(
        libc::SYS_tgkill,
        vec![rule(vec![
            cond(0, Op::Eq, u64::from(std::process::id()))?,
            cond(2, Op::Eq, libc::SIGABRT as u64)?,
        ])?],
    );
    // Random keys (lkey/rkey) and std's hash seeds.
    any(&mut r, libc::SYS_getrandom);
    // Read-only opens only, and landlock is the wall for paths: a stray
    // read by a library fails with EACCES rather than killing vdev, and
    // nothing can be created, written or truncated whatever landlock says.
    masked(&mut r, libc::SYS_openat, 2, OPEN_FORBIDDEN_FLAGS, 0)?;
    Ok(r)
}

/// The vhost-user daemon's request thread and its epoll worker threads.
pub fn vhost_user_rules() -> Result<Rules, SeccompError> {
    let mut r = Rules::new();
    // vhost-user messages, with the descriptors of guest memory regions and
    // kick/call eventfds attached (SCM_RIGHTS), and replies.
    any(&mut r, libc::SYS_recvmsg);
    any(&mut r, libc::SYS_sendmsg);
    // Guest memory regions mapped (read/write, shared, never executable)
    // and unmapped when the memory table changes.
    masked(&mut r, libc::SYS_mmap, 2, libc::PROT_EXEC as u64, 0)?;
    any(&mut r, libc::SYS_munmap);
    // A memory slot's identity (device, inode) from its descriptor: only
    // in the AT_EMPTY_PATH form vdev uses. (A path passed along would still
    // be looked up: stat reveals metadata only, landlock does not govern
    // it, and `--sandbox namespace` leaves nothing of the host to look up.)
    masked(
        &mut r,
        libc::SYS_statx,
        2,
        libc::AT_EMPTY_PATH as u64,
        libc::AT_EMPTY_PATH as u64,
    )?;
    masked(
        &mut r,
        libc::SYS_newfstatat,
        3,
        libc::AT_EMPTY_PATH as u64,
        libc::AT_EMPTY_PATH as u64,
    )?;
    any(&mut r, libc::SYS_fstat);
    // The worker threads wait for kicks and exit events.
    any(&mut r, libc::SYS_epoll_wait);
    any(&mut r, libc::SYS_epoll_pwait);
    any(&mut r, libc::SYS_epoll_ctl);
    // Kick/call/exit eventfds are read and written (common read/write);
    // the daemon creates the exit events.
    any(&mut r, libc::SYS_eventfd2);
    // Descriptors are duplicated (try_clone) and inspected before close.
    one_of(
        &mut r,
        libc::SYS_fcntl,
        1,
        &[
            libc::F_DUPFD_CLOEXEC as u64,
            libc::F_GETFD as u64,
            libc::F_SETFD as u64,
        ],
    )?;
    // The frontend connection is shut down when it ends.
    any(&mut r, libc::SYS_shutdown);
    Ok(r)
}

/// The datapath poller and hostd's policy listener.
pub fn datapath_rules() -> Result<Rules, SeccompError> {
    let mut r = Rules::new();
    // Sleeping on the wake and completion eventfds.
    any(&mut r, libc::SYS_epoll_create1);
    any(&mut r, libc::SYS_epoll_ctl);
    any(&mut r, libc::SYS_epoll_wait);
    any(&mut r, libc::SYS_epoll_pwait);
    // Adaptive polling yields the core every turn.
    any(&mut r, libc::SYS_sched_yield);
    // The poller sets its own niceness from the tenant's priority class:
    // PRIO_PROCESS of thread 0 (itself) only.
    r.insert(
        libc::SYS_setpriority,
        vec![rule(vec![
            cond(0, Op::Eq, libc::PRIO_PROCESS as u64)?,
            cond(1, Op::Eq, 0)?,
        ])?],
    );
    // Requests to hostd (revocations, QP errors) and its notifications.
    any(&mut r, libc::SYS_sendmsg);
    any(&mut r, libc::SYS_recvmsg);
    Ok(r)
}

/// The main thread: frontends, hostd registrations, threads.
pub fn control_rules() -> Result<Rules, SeccompError> {
    let mut r = Rules::new();
    // A frontend connects on the listener bound before the sandbox.
    any(&mut r, libc::SYS_accept4);
    // A registration with hostd per frontend: an AF_UNIX seqpacket socket,
    // nothing else (no network sockets, no netlink, no stream sockets).
    r.insert(
        libc::SYS_socket,
        vec![rule(vec![
            cond(0, Op::Eq, libc::AF_UNIX as u64)?,
            cond(1, Op::MaskedEq(SOCK_TYPE_MASK), libc::SOCK_SEQPACKET as u64)?,
        ])?],
    );
    // connect's address sits behind a pointer; which paths it reaches is
    // decided by file permissions and, with `--sandbox namespace`, by the
    // mount namespace that holds only hostd's socket directory.
    any(&mut r, libc::SYS_connect);
    // Registration: send Hello, receive the grant with its descriptors.
    any(&mut r, libc::SYS_sendmsg);
    any(&mut r, libc::SYS_recvmsg);
    // Physical queues hostd grants are mapped shared, read/write.
    masked(&mut r, libc::SYS_mmap, 2, libc::PROT_EXEC as u64, 0)?;
    any(&mut r, libc::SYS_munmap);
    // The vhost-user daemon of each frontend: its epoll and exit events.
    any(&mut r, libc::SYS_epoll_create1);
    any(&mut r, libc::SYS_epoll_ctl);
    any(&mut r, libc::SYS_eventfd2);
    // Descriptors duplicated and inspected as in the vhost-user role, and
    // the seals of each queue's memory checked before it is mapped (only
    // memory sealed against shrinking is mapped, so no peer can make vdev
    // fault by truncating it).
    one_of(
        &mut r,
        libc::SYS_fcntl,
        1,
        &[
            libc::F_DUPFD_CLOEXEC as u64,
            libc::F_GETFD as u64,
            libc::F_SETFD as u64,
            libc::F_GET_SEALS as u64,
        ],
    )?;
    any(&mut r, libc::SYS_shutdown);
    // A re-registration waits while hostd still tears the previous one of
    // the same device down (it answers EBUSY until then).
    any(&mut r, libc::SYS_clock_nanosleep);
    // At exit the listener removes its socket file; landlock (no rights)
    // or file permissions refuse it when sandboxed, which is harmless —
    // the next start replaces the file — but must not be a seccomp kill.
    any(&mut r, libc::SYS_unlink);
    any(&mut r, libc::SYS_unlinkat);
    Ok(r)
}

/// hostd's control threads: the main thread accepting vdevs, one thread
/// per vdev connection, the admin socket's thread and the SIGHUP thread.
pub fn hostd_control_rules() -> Result<Rules, SeccompError> {
    let mut r = Rules::new();
    // vdevs and vrdmactl connect on listeners bound before the sandbox.
    any(&mut r, libc::SYS_accept4);
    // Requests and responses, with descriptors (SCM_RIGHTS): guest memory
    // memfds in, queue memfds and notification channels out.
    any(&mut r, libc::SYS_recvmsg);
    any(&mut r, libc::SYS_sendmsg);
    any(&mut r, libc::SYS_shutdown);
    // The vdev's uid, checked against the policy (SO_PEERCRED only).
    r.insert(
        libc::SYS_getsockopt,
        vec![rule(vec![
            cond(1, Op::Eq, libc::SOL_SOCKET as u64)?,
            cond(2, Op::Eq, libc::SO_PEERCRED as u64)?,
        ])?],
    );
    // The notification channel of each registration: an AF_UNIX seqpacket
    // pair, nothing else. No socket() at all: hostd connects nowhere.
    r.insert(
        libc::SYS_socketpair,
        vec![rule(vec![
            cond(0, Op::Eq, libc::AF_UNIX as u64)?,
            cond(1, Op::MaskedEq(SOCK_TYPE_MASK), libc::SOCK_SEQPACKET as u64)?,
        ])?],
    );
    // The physical queues hostd grants: a sealable memfd, sized, sealed.
    one_of(
        &mut r,
        libc::SYS_memfd_create,
        1,
        &[(libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) as u64],
    )?;
    any(&mut r, libc::SYS_ftruncate);
    // Seals added (own queues) and checked (a vdev's guest memory is mapped
    // only if sealed against shrinking); non-blocking notification ends;
    // descriptors duplicated (try_clone) and inspected.
    one_of(
        &mut r,
        libc::SYS_fcntl,
        1,
        &[
            libc::F_ADD_SEALS as u64,
            libc::F_GET_SEALS as u64,
            libc::F_GETFL as u64,
            libc::F_SETFL as u64,
            libc::F_DUPFD_CLOEXEC as u64,
            libc::F_GETFD as u64,
            libc::F_SETFD as u64,
        ],
    )?;
    // Tenant memory and queues mapped shared, read/write, never
    // executable (common rule), and unmapped on teardown.
    any(&mut r, libc::SYS_munmap);
    // Each device's doorbell and completion eventfds.
    any(&mut r, libc::SYS_eventfd2);
    // Policy reload: the file is opened read-only (common openat rule;
    // landlock allows exactly that file) and sized by its descriptor
    // (statx, or newfstatat where statx is missing; AT_EMPTY_PATH only).
    masked(
        &mut r,
        libc::SYS_statx,
        2,
        libc::AT_EMPTY_PATH as u64,
        libc::AT_EMPTY_PATH as u64,
    )?;
    masked(
        &mut r,
        libc::SYS_newfstatat,
        3,
        libc::AT_EMPTY_PATH as u64,
        libc::AT_EMPTY_PATH as u64,
    )?;
    // A re-registration waits while the previous one is torn down.
    any(&mut r, libc::SYS_clock_nanosleep);
    // Devices come and go on the datapath's epoll set.
    any(&mut r, libc::SYS_epoll_ctl);
    Ok(r)
}

/// hostd's datapath polling threads.
pub fn hostd_datapath_rules() -> Result<Rules, SeccompError> {
    let mut r = Rules::new();
    // Sleeping on doorbells, the wake eventfd and the retry timer.
    any(&mut r, libc::SYS_epoll_create1);
    any(&mut r, libc::SYS_epoll_ctl);
    any(&mut r, libc::SYS_epoll_wait);
    any(&mut r, libc::SYS_epoll_pwait);
    one_of(
        &mut r,
        libc::SYS_timerfd_create,
        0,
        &[libc::CLOCK_MONOTONIC as u64],
    )?;
    any(&mut r, libc::SYS_timerfd_settime);
    // Adaptive polling yields the core every turn.
    any(&mut r, libc::SYS_sched_yield);
    Ok(r)
}

/// `SOCK_TYPE_MASK` of `<linux/net.h>`: the type bits of socket()'s second
/// argument, without SOCK_CLOEXEC/SOCK_NONBLOCK.
const SOCK_TYPE_MASK: u64 = 0xf;

/// The union of the rules of `roles`.
pub fn union(roles: &[Role]) -> Result<Rules, SeccompError> {
    roles
        .iter()
        .try_fold(Rules::new(), |acc, role| Ok(merge(acc, role.rules()?)))
}

/// The architecture vdev runs on, as seccompiler names it.
pub fn native_arch() -> Result<TargetArch, SeccompError> {
    TargetArch::try_from(std::env::consts::ARCH)
        .map_err(|_| SeccompError::Arch(std::env::consts::ARCH))
}

/// Compiles the allow-list of `roles` for `arch`, with `action` for
/// everything else.
pub fn compile(
    roles: &[Role],
    action: ViolationAction,
    arch: TargetArch,
) -> Result<BpfProgram, SeccompError> {
    let mismatch = match action {
        ViolationAction::Kill => SeccompAction::KillProcess,
        ViolationAction::Trap => SeccompAction::Trap,
        ViolationAction::Log => SeccompAction::Log,
    };
    let filter = SeccompFilter::new(union(roles)?, mismatch, SeccompAction::Allow, arch)
        .map_err(SeccompError::Rule)?;
    BpfProgram::try_from(filter).map_err(SeccompError::Rule)
}

/// The filter stacked in front of the allow-list: `clone3` fails with
/// `ENOSYS` (glibc then uses `clone`, whose flags the allow-list checks);
/// everything else goes on to the allow-list.
pub fn clone3_prelude(arch: TargetArch) -> Result<BpfProgram, SeccompError> {
    let mut rules = Rules::new();
    any(&mut rules, libc::SYS_clone3);
    let filter = SeccompFilter::new(
        rules,
        SeccompAction::Allow,
        SeccompAction::Errno(libc::ENOSYS as u32),
        arch,
    )
    .map_err(SeccompError::Rule)?;
    BpfProgram::try_from(filter).map_err(SeccompError::Rule)
}

/// Installs the allow-list of `roles` on every thread of the process
/// (TSYNC), after the `clone3` prelude; with [`ViolationAction::Trap`] the
/// SIGSYS handler first. Also sets `no_new_privs` (seccomp requires it).
///
/// Returns the number of system calls allowed.
pub fn install(roles: &[Role], action: ViolationAction) -> Result<usize, SeccompError> {
    let arch = native_arch()?;
    let prelude = clone3_prelude(arch)?;
    let program = compile(roles, action, arch)?;
    let allowed = union(roles)?.len();
    if action == ViolationAction::Trap {
        install_sigsys_handler()?;
    }
    seccompiler::apply_filter_all_threads(&prelude).map_err(SeccompError::Install)?;
    seccompiler::apply_filter_all_threads(&program).map_err(SeccompError::Install)?;
    Ok(allowed)
}

/// A daemon's seccomp step: installs the allow-list of `roles` with the
/// operator's violation action, or — only when explicitly asked — nothing,
/// loudly; logs what it did, naming `daemon`.
pub fn install_mode(mode: SeccompMode, roles: &[Role], daemon: &str) -> Result<(), SeccompError> {
    match mode {
        SeccompMode::Off => {
            tracing::warn!(
                "SECCOMP IS OFF (--seccomp off): {daemon} may make any system call; a compromised \
                 {daemon} is limited only by the other walls"
            );
            Ok(())
        }
        SeccompMode::Enforce(action) => {
            let allowed = install(roles, action)?;
            tracing::info!(mode = %mode, ?roles, allowed, "seccomp filter installed on every thread");
            Ok(())
        }
    }
}

/// Layout of the `SIGSYS` part of `siginfo_t` on 64-bit Linux
/// (`<asm-generic/siginfo.h>`: `_sigsys { _call_addr, _syscall, _arch }`
/// after the three `int` header fields and their padding).
#[repr(C)]
struct SigsysInfo {
    signo: libc::c_int,
    errno: libc::c_int,
    code: libc::c_int,
    _pad: libc::c_int,
    call_addr: *mut libc::c_void,
    syscall: libc::c_int,
    arch: libc::c_uint,
}

/// `si_code` of a seccomp `SIGSYS` (`SYS_SECCOMP` in `<asm-generic/siginfo.h>`).
const SYS_SECCOMP: libc::c_int = 1;

/// Handles a seccomp `SIGSYS`: reports the call on stderr and makes it
/// return `-EPERM`. Async-signal-safe: it formats into a stack buffer and
/// calls only `write`.
extern "C" fn sigsys_handler(
    _signal: libc::c_int,
    info: *mut libc::siginfo_t,
    context: *mut libc::c_void,
) {
    if info.is_null() {
        return;
    }
    // SAFETY: the kernel passes a valid siginfo_t (128 bytes) to an
    // SA_SIGINFO handler; SigsysInfo is a prefix of its SIGSYS layout.
    let sys = unsafe { &*(info as *const SigsysInfo) };
    if sys.code != SYS_SECCOMP {
        return;
    }
    let mut buf = [0u8; 96];
    let mut len = 0;
    for part in [
        &b"seccomp (trap): blocked system call "[..],
        &format_decimal(sys.syscall)[..],
        &b", it fails with EPERM\n"[..],
    ] {
        for &byte in part.iter().take_while(|&&b| b != 0) {
            if len < buf.len() {
                buf[len] = byte;
                len += 1;
            }
        }
    }
    // SAFETY: writes `len` initialised bytes of `buf` to stderr.
    unsafe { libc::write(libc::STDERR_FILENO, buf.as_ptr().cast(), len) };
    #[cfg(target_arch = "x86_64")]
    if !context.is_null() {
        // SAFETY: for an SA_SIGINFO handler the third argument is the
        // interrupted thread's ucontext_t; the kernel restores RAX from it
        // on sigreturn, which becomes the blocked call's return value.
        unsafe {
            let uc = &mut *(context as *mut libc::ucontext_t);
            uc.uc_mcontext.gregs[libc::REG_RAX as usize] = -(libc::EPERM as i64);
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = context;
}

/// `n` in decimal, NUL-padded (no allocation: used in a signal handler).
fn format_decimal(n: libc::c_int) -> [u8; 12] {
    let mut out = [0u8; 12];
    let mut digits = [0u8; 11];
    let negative = n < 0;
    let mut v = i64::from(n).unsigned_abs();
    let mut count = 0;
    loop {
        digits[count] = b'0' + (v % 10) as u8;
        count += 1;
        v /= 10;
        if v == 0 || count == digits.len() {
            break;
        }
    }
    let mut pos = 0;
    if negative {
        out[0] = b'-';
        pos = 1;
    }
    for i in (0..count).rev() {
        out[pos] = digits[i];
        pos += 1;
    }
    out
}

fn install_sigsys_handler() -> Result<(), SeccompError> {
    // SAFETY: sigaction is plain data; all-zero is a valid value (empty
    // mask, no flags) that is filled in below.
    let mut action: libc::sigaction = unsafe { std::mem::zeroed() };
    action.sa_sigaction = sigsys_handler
        as extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void)
        as usize;
    action.sa_flags = libc::SA_SIGINFO;
    // SAFETY: installs a handler that only touches its arguments and calls
    // write(2); `action` is a valid sigaction.
    let rc = unsafe { libc::sigaction(libc::SIGSYS, &action, std::ptr::null_mut()) };
    if rc != 0 {
        return Err(SeccompError::Handler(crate::last_os_error()));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use seccompiler::sock_filter;

    // ---- A small classic-BPF interpreter for the instructions seccompiler
    // emits, so that tests can ask a compiled filter what it does with a
    // given call and arguments without installing it.

    const AUDIT_ARCH_X86_64: u32 = 0xc000_003e;

    /// What the filter returns for `nr(args)` on x86_64.
    fn run(program: &[sock_filter], nr: i64, args: [u64; 6]) -> u32 {
        let mut data = [0u8; 64];
        data[0..4].copy_from_slice(&(nr as u32).to_le_bytes());
        data[4..8].copy_from_slice(&AUDIT_ARCH_X86_64.to_le_bytes());
        for (i, a) in args.iter().enumerate() {
            data[16 + 8 * i..24 + 8 * i].copy_from_slice(&a.to_le_bytes());
        }
        let (mut acc, mut pc) = (0u32, 0usize);
        loop {
            let ins = &program[pc];
            pc += 1;
            match ins.code {
                // BPF_LD | BPF_W | BPF_ABS
                0x20 => {
                    let k = ins.k as usize;
                    acc = u32::from_le_bytes(data[k..k + 4].try_into().expect("4 bytes"));
                }
                // BPF_ALU | BPF_AND | BPF_K
                0x54 => acc &= ins.k,
                // BPF_JMP | BPF_JA
                0x05 => pc += ins.k as usize,
                // BPF_JMP | BPF_JEQ / BPF_JGT / BPF_JGE | BPF_K
                0x15 | 0x25 | 0x35 => {
                    let taken = match ins.code {
                        0x15 => acc == ins.k,
                        0x25 => acc > ins.k,
                        _ => acc >= ins.k,
                    };
                    pc += usize::from(if taken { ins.jt } else { ins.jf });
                }
                // BPF_RET | BPF_K
                0x06 => return ins.k,
                other => panic!("instruction {other:#x} not interpreted"),
            }
        }
    }

    fn kill_filter() -> BpfProgram {
        compile(&Role::ALL, ViolationAction::Kill, TargetArch::x86_64).expect("compiles")
    }

    const ALLOW: u32 = libc::SECCOMP_RET_ALLOW;
    const KILL: u32 = libc::SECCOMP_RET_KILL_PROCESS;

    /// Calls each role makes at run time, with typical arguments (from
    /// `strace -f` of vdev under the integration tests, including with a
    /// real hostd, and from the code paths of each role).
    fn needed(role: Role) -> Vec<(&'static str, i64, [u64; 6])> {
        let rw = (libc::PROT_READ | libc::PROT_WRITE) as u64;
        let thread = (libc::CLONE_VM
            | libc::CLONE_FS
            | libc::CLONE_FILES
            | libc::CLONE_SIGHAND
            | libc::CLONE_THREAD
            | libc::CLONE_SYSVSEM
            | libc::CLONE_SETTLS
            | libc::CLONE_PARENT_SETTID
            | libc::CLONE_CHILD_CLEARTID) as u64;
        let empty_path = libc::AT_EMPTY_PATH as u64;
        let cloexec = libc::EPOLL_CLOEXEC as u64;
        let nonblock = libc::EFD_NONBLOCK as u64;
        let fcntl = |cmd: libc::c_int| ("fcntl", libc::SYS_fcntl, [9, cmd as u64, 3, 0, 0, 0]);
        let common = vec![
            ("read", libc::SYS_read, [4, 0, 8, 0, 0, 0]),
            ("write", libc::SYS_write, [2, 0, 80, 0, 0, 0]),
            ("close", libc::SYS_close, [9, 0, 0, 0, 0, 0]),
            ("futex", libc::SYS_futex, [0, 128, 1, 0, 0, 0]),
            ("mmap anon", libc::SYS_mmap, [0, 1 << 20, rw, 0x22, 0, 0]),
            ("mmap stack", libc::SYS_mmap, [0, 1 << 21, 0, 0x20022, 0, 0]),
            ("mprotect", libc::SYS_mprotect, [0x1000, 4096, rw, 0, 0, 0]),
            ("munmap", libc::SYS_munmap, [0x1000, 4096, 0, 0, 0, 0]),
            (
                "madvise",
                libc::SYS_madvise,
                [0x1000, 4096, libc::MADV_DONTNEED as u64, 0, 0, 0],
            ),
            ("brk", libc::SYS_brk, [0; 6]),
            (
                "rt_sigprocmask",
                libc::SYS_rt_sigprocmask,
                [2, 0, 0, 8, 0, 0],
            ),
            ("sigaltstack", libc::SYS_sigaltstack, [0; 6]),
            ("rseq", libc::SYS_rseq, [0, 32, 0, 0x5305_3053, 0, 0]),
            (
                "set_robust_list",
                libc::SYS_set_robust_list,
                [0, 24, 0, 0, 0, 0],
            ),
            ("clone (thread)", libc::SYS_clone, [thread, 0, 0, 0, 0, 0]),
            ("clone3", libc::SYS_clone3, [0, 88, 0, 0, 0, 0]),
            ("exit", libc::SYS_exit, [0; 6]),
            ("exit_group", libc::SYS_exit_group, [0; 6]),
            ("gettid", libc::SYS_gettid, [0; 6]),
            (
                "sched_getaffinity",
                libc::SYS_sched_getaffinity,
                [0, 32, 0, 0, 0, 0],
            ),
            (
                "prctl",
                libc::SYS_prctl,
                [libc::PR_SET_NAME as u64, 0, 0, 0, 0, 0],
            ),
            ("getrandom", libc::SYS_getrandom, [0, 16, 0, 0, 0, 0]),
            ("clock_gettime", libc::SYS_clock_gettime, [1, 0, 0, 0, 0, 0]),
        ];
        let own = match role {
            Role::VhostUser => vec![
                ("recvmsg", libc::SYS_recvmsg, [18, 0, 0, 0, 0, 0]),
                ("sendmsg", libc::SYS_sendmsg, [18, 0, 0x4000, 0, 0, 0]),
                (
                    "mmap guest memory",
                    libc::SYS_mmap,
                    [0, 1 << 24, rw, 0x4001, 20, 0],
                ),
                (
                    "epoll_wait",
                    libc::SYS_epoll_wait,
                    [12, 0, 100, u64::MAX, 0, 0],
                ),
                ("epoll_ctl", libc::SYS_epoll_ctl, [12, 1, 22, 0, 0, 0]),
                ("eventfd2", libc::SYS_eventfd2, [0, nonblock, 0, 0, 0, 0]),
                ("statx", libc::SYS_statx, [20, 0, empty_path, 0xfff, 0, 0]),
                fcntl(libc::F_DUPFD_CLOEXEC),
                fcntl(libc::F_GETFD),
                ("shutdown", libc::SYS_shutdown, [19, 2, 0, 0, 0, 0]),
            ],
            Role::Datapath => vec![
                (
                    "epoll_create1",
                    libc::SYS_epoll_create1,
                    [cloexec, 0, 0, 0, 0, 0],
                ),
                ("epoll_ctl", libc::SYS_epoll_ctl, [12, 1, 4, 0, 0, 0]),
                ("epoll_wait", libc::SYS_epoll_wait, [12, 0, 4, 100, 0, 0]),
                ("sched_yield", libc::SYS_sched_yield, [0; 6]),
                (
                    "setpriority self",
                    libc::SYS_setpriority,
                    [libc::PRIO_PROCESS as u64, 0, 10, 0, 0, 0],
                ),
                ("sendmsg", libc::SYS_sendmsg, [7, 0, 0, 0, 0, 0]),
                ("recvmsg", libc::SYS_recvmsg, [7, 0, 0, 0, 0, 0]),
            ],
            Role::Control => vec![
                ("accept4", libc::SYS_accept4, [3, 0, 0, 0o2000000, 0, 0]),
                (
                    "clock_nanosleep",
                    libc::SYS_clock_nanosleep,
                    [1, 0, 0, 0, 0, 0],
                ),
                (
                    "socket",
                    libc::SYS_socket,
                    [
                        libc::AF_UNIX as u64,
                        (libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC) as u64,
                        0,
                        0,
                        0,
                        0,
                    ],
                ),
                ("connect", libc::SYS_connect, [5, 0, 110, 0, 0, 0]),
                ("sendmsg", libc::SYS_sendmsg, [5, 0, 0, 0, 0, 0]),
                ("recvmsg", libc::SYS_recvmsg, [5, 0, 0, 0, 0, 0]),
                ("mmap queue", libc::SYS_mmap, [0, 1 << 16, rw, 1, 6, 0]),
                (
                    "epoll_create1",
                    libc::SYS_epoll_create1,
                    [cloexec, 0, 0, 0, 0, 0],
                ),
                ("eventfd2", libc::SYS_eventfd2, [0, nonblock, 0, 0, 0, 0]),
                fcntl(libc::F_DUPFD_CLOEXEC),
                fcntl(libc::F_GET_SEALS),
                ("shutdown", libc::SYS_shutdown, [19, 2, 0, 0, 0, 0]),
                ("unlink", libc::SYS_unlink, [0; 6]),
            ],
            // From `strace -f` of hostd under the workspace integration
            // tests (rdma, policy reload) after its filter is installed.
            Role::HostdControl => vec![
                ("accept4", libc::SYS_accept4, [3, 0, 0, 0o2000000, 0, 0]),
                ("recvmsg", libc::SYS_recvmsg, [9, 0, 0x40000000, 0, 0, 0]),
                ("sendmsg", libc::SYS_sendmsg, [9, 0, 0x4000, 0, 0, 0]),
                (
                    "getsockopt SO_PEERCRED",
                    libc::SYS_getsockopt,
                    [
                        9,
                        libc::SOL_SOCKET as u64,
                        libc::SO_PEERCRED as u64,
                        0,
                        0,
                        0,
                    ],
                ),
                (
                    "socketpair",
                    libc::SYS_socketpair,
                    [
                        libc::AF_UNIX as u64,
                        (libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC) as u64,
                        0,
                        0,
                        0,
                        0,
                    ],
                ),
                (
                    "memfd_create",
                    libc::SYS_memfd_create,
                    [
                        0,
                        (libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) as u64,
                        0,
                        0,
                        0,
                        0,
                    ],
                ),
                ("ftruncate", libc::SYS_ftruncate, [10, 1 << 20, 0, 0, 0, 0]),
                fcntl(libc::F_ADD_SEALS),
                fcntl(libc::F_GET_SEALS),
                fcntl(libc::F_GETFL),
                fcntl(libc::F_SETFL),
                fcntl(libc::F_DUPFD_CLOEXEC),
                fcntl(libc::F_GETFD),
                (
                    "mmap tenant memory",
                    libc::SYS_mmap,
                    [0, 1 << 24, rw, libc::MAP_SHARED as u64, 11, 0],
                ),
                ("eventfd2", libc::SYS_eventfd2, [0, nonblock, 0, 0, 0, 0]),
                (
                    "openat policy file",
                    libc::SYS_openat,
                    [
                        libc::AT_FDCWD as u64,
                        0,
                        (libc::O_RDONLY | libc::O_CLOEXEC) as u64,
                        0,
                        0,
                        0,
                    ],
                ),
                ("statx", libc::SYS_statx, [12, 0, empty_path, 0xfff, 0, 0]),
                (
                    "clock_nanosleep",
                    libc::SYS_clock_nanosleep,
                    [1, 0, 0, 0, 0, 0],
                ),
                ("shutdown", libc::SYS_shutdown, [9, 2, 0, 0, 0, 0]),
            ],
            Role::HostdDatapath => vec![
                (
                    "epoll_create1",
                    libc::SYS_epoll_create1,
                    [cloexec, 0, 0, 0, 0, 0],
                ),
                ("epoll_ctl", libc::SYS_epoll_ctl, [7, 1, 9, 0, 0, 0]),
                ("epoll_wait", libc::SYS_epoll_wait, [7, 0, 64, 1, 0, 0]),
                (
                    "timerfd_create",
                    libc::SYS_timerfd_create,
                    [
                        libc::CLOCK_MONOTONIC as u64,
                        libc::TFD_CLOEXEC as u64,
                        0,
                        0,
                        0,
                        0,
                    ],
                ),
                (
                    "timerfd_settime",
                    libc::SYS_timerfd_settime,
                    [8, 0, 0, 0, 0, 0],
                ),
                ("sched_yield", libc::SYS_sched_yield, [0; 6]),
            ],
        };
        common.into_iter().chain(own).collect()
    }

    /// Every role of every daemon.
    fn every_role() -> impl Iterator<Item = Role> {
        Role::ALL.into_iter().chain(Role::HOSTD)
    }

    #[test]
    fn each_role_compiles_for_x86_64() {
        for role in every_role() {
            for action in [
                ViolationAction::Kill,
                ViolationAction::Trap,
                ViolationAction::Log,
            ] {
                let program = compile(&[role], action, TargetArch::x86_64)
                    .unwrap_or_else(|e| panic!("{role}: {e}"));
                assert!(!program.is_empty());
            }
        }
        compile(&Role::ALL, ViolationAction::Kill, TargetArch::x86_64).expect("union");
        compile(&Role::HOSTD, ViolationAction::Kill, TargetArch::x86_64).expect("hostd union");
        clone3_prelude(TargetArch::x86_64).expect("prelude");
    }

    /// Each role's own filter (not only the union) lets through every call
    /// the role makes, with the arguments it makes it with.
    #[test]
    fn each_role_allows_what_it_needs_at_run_time() {
        for role in every_role() {
            let program =
                compile(&[role], ViolationAction::Kill, TargetArch::x86_64).expect("compiles");
            let refused: Vec<_> = needed(role)
                .into_iter()
                .filter(|(_, nr, args)| run(&program, *nr, *args) != ALLOW)
                .map(|(name, _, _)| name)
                .collect();
            assert!(refused.is_empty(), "the {role} role refuses {refused:?}");
        }
    }

    #[test]
    fn roles_are_not_all_the_same() {
        let control = Role::Control.rules().expect("rules");
        let datapath = Role::Datapath.rules().expect("rules");
        assert!(control.contains_key(&libc::SYS_accept4));
        assert!(control.contains_key(&libc::SYS_socket));
        assert!(!datapath.contains_key(&libc::SYS_accept4));
        assert!(!datapath.contains_key(&libc::SYS_socket));
        assert!(!datapath.contains_key(&libc::SYS_connect));
    }

    #[test]
    fn dangerous_calls_are_in_no_role() {
        let all = union(&Role::ALL).expect("union");
        for (name, nr) in [
            ("execve", libc::SYS_execve),
            ("execveat", libc::SYS_execveat),
            ("fork", libc::SYS_fork),
            ("vfork", libc::SYS_vfork),
            ("ptrace", libc::SYS_ptrace),
            ("process_vm_readv", libc::SYS_process_vm_readv),
            ("process_vm_writev", libc::SYS_process_vm_writev),
            ("kill", libc::SYS_kill),
            ("ioctl", libc::SYS_ioctl),
            ("bind", libc::SYS_bind),
            ("listen", libc::SYS_listen),
            ("mount", libc::SYS_mount),
            ("unshare", libc::SYS_unshare),
            ("setns", libc::SYS_setns),
            ("setuid", libc::SYS_setuid),
            ("setresuid", libc::SYS_setresuid),
            ("capset", libc::SYS_capset),
            ("bpf", libc::SYS_bpf),
            ("perf_event_open", libc::SYS_perf_event_open),
            ("io_uring_setup", libc::SYS_io_uring_setup),
            ("keyctl", libc::SYS_keyctl),
            ("userfaultfd", libc::SYS_userfaultfd),
            ("memfd_create", libc::SYS_memfd_create),
            ("pkey_mprotect", libc::SYS_pkey_mprotect),
            ("open_by_handle_at", libc::SYS_open_by_handle_at),
            ("seccomp", libc::SYS_seccomp),
        ] {
            assert!(!all.contains_key(&nr), "{name} must not be allowed");
        }
    }

    #[test]
    fn the_filter_checks_arguments() {
        let f = kill_filter();
        let (af_unix, af_inet) = (libc::AF_UNIX as u64, libc::AF_INET as u64);
        let seq = (libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC) as u64;
        let stream = (libc::SOCK_STREAM | libc::SOCK_CLOEXEC) as u64;
        assert_eq!(run(&f, libc::SYS_socket, [af_unix, seq, 0, 0, 0, 0]), ALLOW);
        assert_eq!(run(&f, libc::SYS_socket, [af_inet, seq, 0, 0, 0, 0]), KILL);
        assert_eq!(
            run(&f, libc::SYS_socket, [af_unix, stream, 0, 0, 0, 0]),
            KILL
        );
        assert_eq!(
            run(
                &f,
                libc::SYS_socket,
                [libc::AF_NETLINK as u64, 3, 0, 0, 0, 0]
            ),
            KILL
        );

        let rw = (libc::PROT_READ | libc::PROT_WRITE) as u64;
        let rx = (libc::PROT_READ | libc::PROT_EXEC) as u64;
        let shared = libc::MAP_SHARED as u64;
        assert_eq!(run(&f, libc::SYS_mmap, [0, 4096, rw, shared, 5, 0]), ALLOW);
        assert_eq!(run(&f, libc::SYS_mmap, [0, 4096, rx, shared, 5, 0]), KILL);
        assert_eq!(
            run(&f, libc::SYS_mprotect, [0x1000, 4096, rw, 0, 0, 0]),
            ALLOW
        );
        assert_eq!(
            run(&f, libc::SYS_mprotect, [0x1000, 4096, rx, 0, 0, 0]),
            KILL
        );
        assert_eq!(
            run(
                &f,
                libc::SYS_mprotect,
                [0x1000, 4096, libc::PROT_EXEC as u64, 0, 0, 0]
            ),
            KILL
        );

        // Its own niceness only: not another thread's, process group's or
        // user's (another tenant's vdev runs as the same uid).
        let process = libc::PRIO_PROCESS as u64;
        assert_eq!(
            run(&f, libc::SYS_setpriority, [process, 0, 10, 0, 0, 0]),
            ALLOW
        );
        for (which, who) in [(process, 4242), (libc::PRIO_USER as u64, 0), (1, 0)] {
            assert_eq!(
                run(&f, libc::SYS_setpriority, [which, who, 19, 0, 0, 0]),
                KILL
            );
        }

        let name = libc::PR_SET_NAME as u64;
        assert_eq!(run(&f, libc::SYS_prctl, [name, 0, 0, 0, 0, 0]), ALLOW);
        for forbidden in [
            libc::PR_SET_DUMPABLE,
            libc::PR_SET_SECCOMP,
            libc::PR_CAP_AMBIENT,
            libc::PR_SET_PTRACER,
        ] {
            assert_eq!(
                run(&f, libc::SYS_prctl, [forbidden as u64, 1, 0, 0, 0, 0]),
                KILL
            );
        }

        let thread = (libc::CLONE_VM | libc::CLONE_THREAD | libc::CLONE_SIGHAND) as u64;
        assert_eq!(run(&f, libc::SYS_clone, [thread, 0, 0, 0, 0, 0]), ALLOW);
        assert_eq!(
            run(&f, libc::SYS_clone, [libc::SIGCHLD as u64, 0, 0, 0, 0, 0]),
            KILL
        );

        let ro = (libc::O_RDONLY | libc::O_CLOEXEC) as u64;
        for flags in [
            libc::O_WRONLY,
            libc::O_RDWR,
            libc::O_CREAT | libc::O_WRONLY,
            libc::O_TRUNC,
            libc::O_PATH,
            libc::O_TMPFILE | libc::O_RDWR,
        ] {
            assert_eq!(
                run(&f, libc::SYS_openat, [0, 0, flags as u64, 0, 0, 0]),
                KILL,
                "openat flags {flags:#o}"
            );
        }
        assert_eq!(run(&f, libc::SYS_openat, [0, 0, ro, 0, 0, 0]), ALLOW);

        let me = u64::from(std::process::id());
        let abrt = libc::SIGABRT as u64;
        assert_eq!(run(&f, libc::SYS_tgkill, [me, 7, abrt, 0, 0, 0]), ALLOW);
        assert_eq!(run(&f, libc::SYS_tgkill, [me + 1, 7, abrt, 0, 0, 0]), KILL);
        assert_eq!(
            run(&f, libc::SYS_tgkill, [me, 7, libc::SIGKILL as u64, 0, 0, 0]),
            KILL
        );

        let dupfd = libc::F_DUPFD_CLOEXEC as u64;
        assert_eq!(run(&f, libc::SYS_fcntl, [3, dupfd, 3, 0, 0, 0]), ALLOW);
        let seals = libc::F_GET_SEALS as u64;
        assert_eq!(run(&f, libc::SYS_fcntl, [3, seals, 0, 0, 0, 0]), ALLOW);
        assert_eq!(
            run(
                &f,
                libc::SYS_fcntl,
                [3, libc::F_ADD_SEALS as u64, 1, 0, 0, 0]
            ),
            KILL
        );
        assert_eq!(
            run(&f, libc::SYS_fcntl, [3, libc::F_SETOWN as u64, 1, 0, 0, 0]),
            KILL
        );
        assert_eq!(
            run(
                &f,
                libc::SYS_madvise,
                [0, 4096, libc::MADV_DONTNEED as u64, 0, 0, 0]
            ),
            ALLOW
        );
        assert_eq!(
            run(
                &f,
                libc::SYS_madvise,
                [0, 4096, libc::MADV_DONTFORK as u64, 0, 0, 0]
            ),
            KILL
        );

        assert_eq!(run(&f, libc::SYS_execve, [0; 6]), KILL);
        assert_eq!(run(&f, libc::SYS_ioctl, [0, 0x5401, 0, 0, 0, 0]), KILL);
    }

    #[test]
    fn hostd_roles_are_not_all_the_same() {
        let control = Role::HostdControl.rules().expect("rules");
        let datapath = Role::HostdDatapath.rules().expect("rules");
        for nr in [
            libc::SYS_accept4,
            libc::SYS_memfd_create,
            libc::SYS_socketpair,
        ] {
            assert!(control.contains_key(&nr));
            assert!(!datapath.contains_key(&nr));
        }
        assert!(datapath.contains_key(&libc::SYS_timerfd_create));
        assert!(!control.contains_key(&libc::SYS_timerfd_create));
    }

    #[test]
    fn dangerous_calls_are_in_no_hostd_role() {
        let all = union(&Role::HOSTD).expect("union");
        for (name, nr) in [
            ("execve", libc::SYS_execve),
            ("execveat", libc::SYS_execveat),
            ("fork", libc::SYS_fork),
            ("vfork", libc::SYS_vfork),
            ("ptrace", libc::SYS_ptrace),
            ("process_vm_readv", libc::SYS_process_vm_readv),
            ("process_vm_writev", libc::SYS_process_vm_writev),
            ("kill", libc::SYS_kill),
            ("ioctl", libc::SYS_ioctl),
            // hostd's sockets are bound before the sandbox; it connects
            // nowhere and creates no socket but a socketpair.
            ("socket", libc::SYS_socket),
            ("connect", libc::SYS_connect),
            ("bind", libc::SYS_bind),
            ("listen", libc::SYS_listen),
            ("mount", libc::SYS_mount),
            ("unshare", libc::SYS_unshare),
            ("setns", libc::SYS_setns),
            ("setuid", libc::SYS_setuid),
            ("setresuid", libc::SYS_setresuid),
            ("capset", libc::SYS_capset),
            ("bpf", libc::SYS_bpf),
            ("perf_event_open", libc::SYS_perf_event_open),
            ("io_uring_setup", libc::SYS_io_uring_setup),
            ("keyctl", libc::SYS_keyctl),
            ("userfaultfd", libc::SYS_userfaultfd),
            ("pkey_mprotect", libc::SYS_pkey_mprotect),
            ("open_by_handle_at", libc::SYS_open_by_handle_at),
            ("seccomp", libc::SYS_seccomp),
            ("unlink", libc::SYS_unlink),
            ("unlinkat", libc::SYS_unlinkat),
            ("chmod", libc::SYS_chmod),
            ("signalfd4", libc::SYS_signalfd4),
        ] {
            assert!(
                !all.contains_key(&nr),
                "{name} must not be allowed in hostd"
            );
        }
    }

    #[test]
    fn the_hostd_filter_checks_arguments() {
        let f = compile(&Role::HOSTD, ViolationAction::Kill, TargetArch::x86_64).expect("compiles");
        let seq = (libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC) as u64;
        let stream = (libc::SOCK_STREAM | libc::SOCK_CLOEXEC) as u64;
        let unix = libc::AF_UNIX as u64;
        assert_eq!(
            run(&f, libc::SYS_socketpair, [unix, seq, 0, 0, 0, 0]),
            ALLOW
        );
        assert_eq!(
            run(&f, libc::SYS_socketpair, [unix, stream, 0, 0, 0, 0]),
            KILL
        );
        assert_eq!(
            run(
                &f,
                libc::SYS_socketpair,
                [libc::AF_INET as u64, seq, 0, 0, 0, 0]
            ),
            KILL
        );
        assert_eq!(run(&f, libc::SYS_socket, [unix, seq, 0, 0, 0, 0]), KILL);

        let sol = libc::SOL_SOCKET as u64;
        let peercred = libc::SO_PEERCRED as u64;
        assert_eq!(
            run(&f, libc::SYS_getsockopt, [3, sol, peercred, 0, 0, 0]),
            ALLOW
        );
        assert_eq!(
            run(
                &f,
                libc::SYS_getsockopt,
                [3, sol, libc::SO_RCVBUF as u64, 0, 0, 0]
            ),
            KILL
        );
        assert_eq!(
            run(&f, libc::SYS_setsockopt, [3, sol, peercred, 0, 0, 0]),
            KILL
        );

        let sealing = (libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) as u64;
        assert_eq!(
            run(&f, libc::SYS_memfd_create, [0, sealing, 0, 0, 0, 0]),
            ALLOW
        );
        for flags in [
            libc::MFD_CLOEXEC,
            libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING | libc::MFD_HUGETLB,
        ] {
            assert_eq!(
                run(&f, libc::SYS_memfd_create, [0, flags as u64, 0, 0, 0, 0]),
                KILL,
                "memfd_create flags {flags:#x}"
            );
        }

        let rw = (libc::PROT_READ | libc::PROT_WRITE) as u64;
        let rwx = rw | libc::PROT_EXEC as u64;
        let shared = libc::MAP_SHARED as u64;
        assert_eq!(run(&f, libc::SYS_mmap, [0, 4096, rw, shared, 5, 0]), ALLOW);
        assert_eq!(run(&f, libc::SYS_mmap, [0, 4096, rwx, shared, 5, 0]), KILL);
        assert_eq!(run(&f, libc::SYS_mprotect, [0, 4096, rwx, 0, 0, 0]), KILL);

        let seals = libc::F_ADD_SEALS as u64;
        assert_eq!(run(&f, libc::SYS_fcntl, [3, seals, 15, 0, 0, 0]), ALLOW);
        assert_eq!(
            run(&f, libc::SYS_fcntl, [3, libc::F_SETOWN as u64, 1, 0, 0, 0]),
            KILL
        );
        let wronly = libc::O_WRONLY as u64;
        assert_eq!(run(&f, libc::SYS_openat, [0, 0, wronly, 0, 0, 0]), KILL);
        assert_eq!(
            run(
                &f,
                libc::SYS_statx,
                [libc::AT_FDCWD as u64, 0, 0, 0xfff, 0, 0]
            ),
            KILL
        );
        assert_eq!(
            run(
                &f,
                libc::SYS_timerfd_create,
                [libc::CLOCK_REALTIME as u64, 0, 0, 0, 0, 0]
            ),
            KILL
        );
        assert_eq!(run(&f, libc::SYS_execve, [0; 6]), KILL);
    }

    #[test]
    fn the_action_is_what_the_operator_chose() {
        for (action, expected) in [
            (ViolationAction::Kill, libc::SECCOMP_RET_KILL_PROCESS),
            (ViolationAction::Trap, libc::SECCOMP_RET_TRAP),
            (ViolationAction::Log, libc::SECCOMP_RET_LOG),
        ] {
            let f = compile(&Role::ALL, action, TargetArch::x86_64).expect("compiles");
            assert_eq!(run(&f, libc::SYS_execve, [0; 6]), expected);
            assert_eq!(run(&f, libc::SYS_read, [0; 6]), ALLOW);
        }
    }

    #[test]
    fn clone3_fails_with_enosys_and_nothing_else_is_touched() {
        let prelude = clone3_prelude(TargetArch::x86_64).expect("prelude");
        assert_eq!(
            run(&prelude, libc::SYS_clone3, [0; 6]),
            libc::SECCOMP_RET_ERRNO | libc::ENOSYS as u32
        );
        assert_eq!(run(&prelude, libc::SYS_execve, [0; 6]), ALLOW);
    }

    #[test]
    fn merging_keeps_the_widest_rule() {
        let mut a = Rules::new();
        masked(&mut a, libc::SYS_mmap, 2, 4, 0).expect("rule");
        let mut b = Rules::new();
        any(&mut b, libc::SYS_mmap);
        assert!(merge(a.clone(), b.clone())[&libc::SYS_mmap].is_empty());
        assert!(merge(b, a.clone())[&libc::SYS_mmap].is_empty());
        assert_eq!(merge(a.clone(), a.clone())[&libc::SYS_mmap].len(), 1);
    }

    #[test]
    fn modes_parse_and_print() {
        for text in ["kill", "trap", "log", "off"] {
            let mode: SeccompMode = text.parse().expect("parses");
            assert_eq!(mode.to_string(), text);
        }
        assert_eq!(
            SeccompMode::default(),
            SeccompMode::Enforce(ViolationAction::Kill)
        );
        assert!("allow".parse::<SeccompMode>().is_err());
    }

    #[test]
    fn decimal_formatting_for_the_signal_handler() {
        let s = |n| {
            let raw = format_decimal(n);
            String::from_utf8(raw.iter().copied().take_while(|&b| b != 0).collect()).expect("ascii")
        };
        assert_eq!(s(0), "0");
        assert_eq!(s(59), "59");
        assert_eq!(s(-1), "-1");
        assert_eq!(s(i32::MAX), "2147483647");
        assert_eq!(s(i32::MIN), "-2147483648");
    }
}
