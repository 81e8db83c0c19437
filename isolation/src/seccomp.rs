//! seccomp: the machinery that turns a daemon's allow-lists into filters
//! and puts the right one on each of its threads.
//!
//! The allow-lists themselves are not here: each daemon keeps its own
//! (`vdev/src/seccomp.rs`, `hostd/src/seccomp.rs`) as one enum of thread
//! roles ([`ThreadRole`]) and one function of rules per role, merged with
//! [`common_rules`], every system call with the reason it is there. This
//! module provides what those tables are written with and what runs them:
//!
//! - [`Rules`]: an allow-list, with argument conditions where the kernel
//!   lets a filter see the arguments ([`Rules::allow_if_eq`],
//!   [`Rules::allow_if_masked`], [`Rules::allow_if_all`] and the shapes
//!   both daemons use: [`Rules::allow_unix_seqpacket`],
//!   [`Rules::allow_stat_by_descriptor`], [`Rules::allow_epoll`]).
//! - [`common_rules`]: what every thread of a Rust program on glibc needs.
//! - [`compile`]: a role's rules as a BPF program, with the operator's
//!   [`ViolationAction`] for everything else.
//! - [`Threads`]: the daemon's seccomp step and the only way it starts
//!   threads afterwards; every thread applies its own role's filter before
//!   it runs anything of its own (see the `threads` module for how, given
//!   that filters are inherited and can only narrow).
//! - `testing` (cargo feature `testing`): what a compiled filter does with
//!   a call, asked of a small BPF interpreter or of the kernel, with the
//!   filter installed in a forked child.
//!
//! `clone3` passes its flags behind a pointer no filter can read, so a
//! one-rule filter ([`clone3_prelude`]) makes it fail with `ENOSYS` in
//! front of every allow-list; glibc then falls back to `clone`, whose
//! flags [`common_rules`] checks (threads only: no new process).
//!
//! A call outside the list is handled as the operator chose
//! ([`ViolationAction`]): the process is killed (`SIGSYS`, the default),
//! the call fails with `EPERM` and is reported on stderr (`trap`), or it
//! is allowed and logged by the kernel's audit (`log`, for finding what is
//! missing). `off` installs nothing and is only ever chosen explicitly.

mod threads;

#[cfg(any(test, feature = "testing"))]
pub mod testing;

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;

use seccompiler::{
    BackendError, SeccompAction, SeccompCmpArgLen as ArgLen, SeccompCondition as Cond,
    SeccompFilter, SeccompRule,
};

pub use seccompiler::{BpfProgram, SeccompCmpOp as Op, TargetArch};
pub use threads::{ThreadRole, Threads};

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
    #[error("Cannot install the seccomp filter of the {role} thread role")]
    Install {
        role: String,
        #[source]
        source: seccompiler::Error,
    },
    #[error("Cannot start the thread launcher")]
    Launcher(#[source] std::io::Error),
}

/// An allow-list: system call number → the argument conditions under which
/// it is allowed (any one rule may match; no rule at all allows the call
/// whatever its arguments).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Rules(BTreeMap<i64, Vec<SeccompRule>>);

/// One condition on argument `arg`, compared as 32 bits: every argument the
/// rule tables restrict is an `int` or flags that fit one.
fn cond(arg: u8, op: Op, value: u64) -> Result<Cond, SeccompError> {
    Cond::new(arg, ArgLen::Dword, op, value).map_err(SeccompError::Rule)
}

/// A rule of conditions that must all hold.
fn rule(conditions: Vec<Cond>) -> Result<SeccompRule, SeccompError> {
    SeccompRule::new(conditions).map_err(SeccompError::Rule)
}

impl Rules {
    pub fn new() -> Rules {
        Rules::default()
    }

    /// Allows `nr` whatever its arguments.
    pub fn allow(&mut self, nr: i64) {
        self.0.insert(nr, Vec::new());
    }

    /// Allows `nr` when argument `arg` equals one of `values`.
    pub fn allow_if_eq(&mut self, nr: i64, arg: u8, values: &[u64]) -> Result<(), SeccompError> {
        let rules = values
            .iter()
            .map(|&v| rule(vec![cond(arg, Op::Eq, v)?]))
            .collect::<Result<Vec<_>, _>>()?;
        self.0.insert(nr, rules);
        Ok(())
    }

    /// Allows `nr` when `arg & mask == value`.
    pub fn allow_if_masked(
        &mut self,
        nr: i64,
        arg: u8,
        mask: u64,
        value: u64,
    ) -> Result<(), SeccompError> {
        self.0
            .insert(nr, vec![rule(vec![cond(arg, Op::MaskedEq(mask), value)?])?]);
        Ok(())
    }

    /// Allows `nr` when every `(arg, op, value)` condition holds.
    pub fn allow_if_all(
        &mut self,
        nr: i64,
        conditions: &[(u8, Op, u64)],
    ) -> Result<(), SeccompError> {
        self.allow_if_any(nr, &[conditions])
    }

    /// Allows `nr` when all the conditions of any one of `alternatives`
    /// hold (e.g. a `getsockopt` of either of two options).
    pub fn allow_if_any(
        &mut self,
        nr: i64,
        alternatives: &[&[(u8, Op, u64)]],
    ) -> Result<(), SeccompError> {
        let rules = alternatives
            .iter()
            .map(|conditions| {
                let conditions = conditions
                    .iter()
                    .map(|(arg, op, value)| cond(*arg, op.clone(), *value))
                    .collect::<Result<Vec<_>, _>>()?;
                rule(conditions)
            })
            .collect::<Result<Vec<_>, _>>()?;
        self.0.insert(nr, rules);
        Ok(())
    }

    /// Allows `nr` (`socket` or `socketpair`) for `AF_UNIX` seqpacket
    /// sockets only: no network, netlink or stream sockets.
    pub fn allow_unix_seqpacket(&mut self, nr: i64) -> Result<(), SeccompError> {
        self.allow_if_all(
            nr,
            &[
                (0, Op::Eq, libc::AF_UNIX as u64),
                (1, Op::MaskedEq(SOCK_TYPE_MASK), libc::SOCK_SEQPACKET as u64),
            ],
        )
    }

    /// Allows waiting in epoll: a set created, descriptors added and
    /// removed, and the wait itself.
    pub fn allow_epoll(&mut self) {
        self.allow(libc::SYS_epoll_create1);
        self.allow(libc::SYS_epoll_ctl);
        self.allow(libc::SYS_epoll_wait);
        self.allow(libc::SYS_epoll_pwait);
    }

    /// Allows `stat` of a descriptor — `fstat`, and `statx`/`newfstatat` in
    /// their `AT_EMPTY_PATH` form only. (A path passed along with the flag
    /// would still be looked up: stat reveals metadata only, landlock does
    /// not govern it, and the namespace sandbox leaves nothing of the host
    /// to look up.)
    pub fn allow_stat_by_descriptor(&mut self) -> Result<(), SeccompError> {
        let empty_path = libc::AT_EMPTY_PATH as u64;
        self.allow(libc::SYS_fstat);
        self.allow_if_masked(libc::SYS_statx, 2, empty_path, empty_path)?;
        self.allow_if_masked(libc::SYS_newfstatat, 3, empty_path, empty_path)
    }

    /// Whether `nr` is allowed with at least some arguments.
    pub fn allows(&self, nr: i64) -> bool {
        self.0.contains_key(&nr)
    }

    /// Whether `nr` is allowed whatever its arguments.
    pub fn allows_any_arguments(&self, nr: i64) -> bool {
        self.0.get(&nr).is_some_and(Vec::is_empty)
    }

    /// The allowed system call numbers.
    pub fn syscalls(&self) -> impl Iterator<Item = i64> + '_ {
        self.0.keys().copied()
    }

    /// Number of system calls allowed.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// These rules and `other`'s: a call is allowed if either allows it.
    pub fn merge(mut self, other: Rules) -> Rules {
        for (nr, rules) in other.0 {
            match self.0.get_mut(&nr) {
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
                    self.0.insert(nr, rules);
                }
            }
        }
        self
    }
}

/// `SOCK_TYPE_MASK` of `<linux/net.h>`: the type bits of socket()'s second
/// argument, without SOCK_CLOEXEC/SOCK_NONBLOCK.
const SOCK_TYPE_MASK: u64 = 0xf;

/// `openat` flags no vrdma daemon uses after start-up: anything but
/// read-only, creating, truncating, `O_PATH` descriptors and anonymous
/// temporary files.
const OPEN_FORBIDDEN_FLAGS: u64 = (libc::O_ACCMODE
    | libc::O_CREAT
    | libc::O_TRUNC
    | libc::O_APPEND
    | libc::O_PATH
    | libc::O_TMPFILE) as u64;

/// What every thread of a Rust program on glibc needs, whatever its role.
pub fn common_rules() -> Result<Rules, SeccompError> {
    let mut r = Rules::new();
    // Eventfds, sockets already open, and log lines on stderr.
    r.allow(libc::SYS_read);
    r.allow(libc::SYS_write);
    r.allow(libc::SYS_close);
    // Rust's standard library checks that a descriptor is still open
    // before it closes it (debug builds), on whichever thread drops it.
    r.allow_if_eq(libc::SYS_fcntl, 1, &[libc::F_GETFD as u64])?;
    // Mutexes, condition variables, channels, thread join.
    r.allow(libc::SYS_futex);
    // std's channels: a receiver that finds a slot whose sender was
    // preempted halfway through writing it (or a sender that finds the
    // next block being installed) spins briefly, then yields until the
    // other thread is done. Every thread may meet a channel; vdev was once
    // killed by its own filter there (rdma-core's test suite opening and
    // closing contexts quickly on a 2-core host).
    r.allow(libc::SYS_sched_yield);
    // Heap: the main arena grows with brk, large blocks are mapped, and
    // realloc of a mapped block moves it with mremap (which cannot add
    // PROT_EXEC). Dropping the last reference to shared memory (guest
    // memory, queues) unmaps it, on whichever thread that happens.
    r.allow(libc::SYS_brk);
    r.allow(libc::SYS_mremap);
    r.allow(libc::SYS_munmap);
    // Anonymous memory, thread stacks, guest memory and queues — never
    // executable: a thread taken over cannot map code.
    r.allow_if_masked(libc::SYS_mmap, 2, libc::PROT_EXEC as u64, 0)?;
    r.allow_if_masked(libc::SYS_mprotect, 2, libc::PROT_EXEC as u64, 0)?;
    // glibc returns the stack of an exited thread and trims malloc arenas.
    r.allow_if_eq(libc::SYS_madvise, 2, &[libc::MADV_DONTNEED as u64])?;
    // Signal masks around thread creation, glibc's lazily installed
    // internal handlers, Rust's per-thread alternate signal stack, and
    // the return from any handler (the `trap` SIGSYS handler too).
    r.allow(libc::SYS_rt_sigprocmask);
    r.allow(libc::SYS_rt_sigaction);
    r.allow(libc::SYS_rt_sigreturn);
    r.allow(libc::SYS_sigaltstack);
    // Thread start-up in glibc: restartable sequences, the robust futex
    // list, the thread id (also in Rust's thread handles), and malloc's
    // arena sizing from the CPU affinity mask.
    r.allow(libc::SYS_rseq);
    r.allow(libc::SYS_set_robust_list);
    r.allow(libc::SYS_gettid);
    r.allow(libc::SYS_sched_getaffinity);
    // Time for polling deadlines and log lines (normally the vDSO; the
    // system call is its fallback).
    r.allow(libc::SYS_clock_gettime);
    // New threads only: CLONE_THREAD set, so no new process can appear. A
    // thread started this way inherits its parent's filters, so this
    // grants no system call any role lacks.
    r.allow_if_masked(
        libc::SYS_clone,
        0,
        libc::CLONE_THREAD as u64,
        libc::CLONE_THREAD as u64,
    )?;
    // clone3 passes its flags behind a pointer no filter can read. It is
    // allowed here only because [`clone3_prelude`], stacked in front of
    // every allow-list, makes it fail with ENOSYS (a result of higher
    // precedence than allow), and glibc then falls back to clone, above.
    r.allow(libc::SYS_clone3);
    // A thread ends; the process ends.
    r.allow(libc::SYS_exit);
    r.allow(libc::SYS_exit_group);
    // Thread names (Rust's thread builder, vhost-user-backend).
    r.allow_if_eq(libc::SYS_prctl, 0, &[libc::PR_SET_NAME as u64])?;
    // abort() (a double panic) raises SIGABRT at this process: getpid,
    // then tgkill aimed at ourselves only.
    r.allow(libc::SYS_getpid);
    r.allow_if_all(
        libc::SYS_tgkill,
        &[
            (0, Op::Eq, u64::from(std::process::id())),
            (2, Op::Eq, libc::SIGABRT as u64),
        ],
    )?;
    // Random keys and std's hash seeds.
    r.allow(libc::SYS_getrandom);
    // Read-only opens only, and landlock is the wall for paths: a stray
    // read by a library fails with EACCES rather than killing the daemon,
    // and nothing can be created, written or truncated whatever landlock
    // says.
    r.allow_if_masked(libc::SYS_openat, 2, OPEN_FORBIDDEN_FLAGS, 0)?;
    Ok(r)
}

/// The architecture the daemon runs on, as seccompiler names it.
pub fn native_arch() -> Result<TargetArch, SeccompError> {
    TargetArch::try_from(std::env::consts::ARCH)
        .map_err(|_| SeccompError::Arch(std::env::consts::ARCH))
}

/// Compiles the allow-list `rules` for `arch`, with `action` for every
/// other call.
pub fn compile(
    rules: Rules,
    action: ViolationAction,
    arch: TargetArch,
) -> Result<BpfProgram, SeccompError> {
    let mismatch = match action {
        ViolationAction::Kill => SeccompAction::KillProcess,
        ViolationAction::Trap => SeccompAction::Trap,
        ViolationAction::Log => SeccompAction::Log,
    };
    let filter = SeccompFilter::new(rules.0, mismatch, SeccompAction::Allow, arch)
        .map_err(SeccompError::Rule)?;
    BpfProgram::try_from(filter).map_err(SeccompError::Rule)
}

/// The filter stacked in front of every allow-list: `clone3` fails with
/// `ENOSYS` (glibc then uses `clone`, whose flags the allow-list checks);
/// everything else goes on to the allow-list.
pub fn clone3_prelude(arch: TargetArch) -> Result<BpfProgram, SeccompError> {
    let mut rules = Rules::new();
    rules.allow(libc::SYS_clone3);
    let filter = SeccompFilter::new(
        rules.0,
        SeccompAction::Allow,
        SeccompAction::Errno(libc::ENOSYS as u32),
        arch,
    )
    .map_err(SeccompError::Rule)?;
    BpfProgram::try_from(filter).map_err(SeccompError::Rule)
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

/// Installs the `trap` handler for `SIGSYS` (process-wide).
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
    use super::testing::{
        common_calls, in_child, in_child_process, refused, run, syscall, ChildEnd, Verdict, ALLOW,
        DANGEROUS, KILL,
    };
    use super::*;

    fn common_filter() -> BpfProgram {
        compile(
            common_rules().expect("rules"),
            ViolationAction::Kill,
            TargetArch::x86_64,
        )
        .expect("compiles")
    }

    #[test]
    fn the_common_rules_compile_for_every_action() {
        for action in [
            ViolationAction::Kill,
            ViolationAction::Trap,
            ViolationAction::Log,
        ] {
            let program = compile(common_rules().expect("rules"), action, TargetArch::x86_64)
                .expect("compiles");
            assert!(!program.is_empty());
        }
        compile(
            common_rules().expect("rules"),
            ViolationAction::Kill,
            native_arch().expect("arch"),
        )
        .expect("compiles for this machine");
    }

    #[test]
    fn the_common_rules_allow_what_every_thread_does() {
        let missing = refused(&common_filter(), &common_calls());
        assert!(missing.is_empty(), "the common rules refuse {missing:?}");
        let rules = common_rules().expect("rules");
        for (name, nr) in DANGEROUS {
            assert!(!rules.allows(nr), "the common rules must not allow {name}");
        }
    }

    #[test]
    fn the_common_rules_check_arguments() {
        let f = common_filter();
        let rw = (libc::PROT_READ | libc::PROT_WRITE) as u64;
        let rx = (libc::PROT_READ | libc::PROT_EXEC) as u64;
        let shared = libc::MAP_SHARED as u64;
        assert_eq!(run(&f, libc::SYS_mmap, [0, 4096, rw, shared, 5, 0]), ALLOW);
        assert_eq!(run(&f, libc::SYS_mmap, [0, 4096, rx, shared, 5, 0]), KILL);
        assert_eq!(run(&f, libc::SYS_mprotect, [0, 4096, rw, 0, 0, 0]), ALLOW);
        assert_eq!(run(&f, libc::SYS_mprotect, [0, 4096, rx, 0, 0, 0]), KILL);

        let name = libc::PR_SET_NAME as u64;
        assert_eq!(run(&f, libc::SYS_prctl, [name, 0, 0, 0, 0, 0]), ALLOW);
        for forbidden in [
            libc::PR_SET_DUMPABLE,
            libc::PR_SET_SECCOMP,
            libc::PR_CAP_AMBIENT,
            libc::PR_SET_PTRACER,
            libc::PR_SET_NO_NEW_PRIVS,
        ] {
            assert_eq!(
                run(&f, libc::SYS_prctl, [forbidden as u64, 1, 0, 0, 0, 0]),
                KILL
            );
        }

        let thread = (libc::CLONE_VM | libc::CLONE_THREAD | libc::CLONE_SIGHAND) as u64;
        assert_eq!(run(&f, libc::SYS_clone, [thread, 0, 0, 0, 0, 0]), ALLOW);
        let fork = libc::SIGCHLD as u64;
        assert_eq!(run(&f, libc::SYS_clone, [fork, 0, 0, 0, 0, 0]), KILL);

        let ro = (libc::O_RDONLY | libc::O_CLOEXEC) as u64;
        assert_eq!(run(&f, libc::SYS_openat, [0, 0, ro, 0, 0, 0]), ALLOW);
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

        let me = u64::from(std::process::id());
        let abrt = libc::SIGABRT as u64;
        assert_eq!(run(&f, libc::SYS_tgkill, [me, 7, abrt, 0, 0, 0]), ALLOW);
        assert_eq!(run(&f, libc::SYS_tgkill, [me + 1, 7, abrt, 0, 0, 0]), KILL);
        let kill = libc::SIGKILL as u64;
        assert_eq!(run(&f, libc::SYS_tgkill, [me, 7, kill, 0, 0, 0]), KILL);

        let dontneed = libc::MADV_DONTNEED as u64;
        assert_eq!(
            run(&f, libc::SYS_madvise, [0, 4096, dontneed, 0, 0, 0]),
            ALLOW
        );
        let dontfork = libc::MADV_DONTFORK as u64;
        assert_eq!(
            run(&f, libc::SYS_madvise, [0, 4096, dontfork, 0, 0, 0]),
            KILL
        );

        for nr in [
            libc::SYS_execve,
            libc::SYS_socket,
            libc::SYS_ioctl,
            libc::SYS_seccomp,
            libc::SYS_kill,
            libc::SYS_ptrace,
        ] {
            assert_eq!(run(&f, nr, [0; 6]), KILL, "system call {nr}");
        }
    }

    /// The same rules, asked of the kernel: installed in a forked child.
    #[test]
    fn the_kernel_enforces_the_common_rules() {
        let f = compile(
            common_rules().expect("rules"),
            ViolationAction::Kill,
            native_arch().expect("arch"),
        )
        .expect("compiles");
        assert_eq!(in_child(&f, libc::SYS_getpid, [0; 6]), Verdict::Allowed);
        // A bad descriptor: the call goes through and fails with EBADF.
        assert_eq!(
            in_child(&f, libc::SYS_read, [u64::MAX, 0, 0, 0, 0, 0]),
            Verdict::Allowed
        );
        assert_eq!(in_child(&f, libc::SYS_execve, [0; 6]), Verdict::Refused);
        let inet = [libc::AF_INET as u64, libc::SOCK_STREAM as u64, 0, 0, 0, 0];
        assert_eq!(in_child(&f, libc::SYS_socket, inet), Verdict::Refused);
        let exec = (libc::PROT_READ | libc::PROT_EXEC) as u64;
        let anon = (libc::MAP_PRIVATE | libc::MAP_ANONYMOUS) as u64;
        assert_eq!(
            in_child(&f, libc::SYS_mmap, [0, 4096, exec, anon, u64::MAX, 0]),
            Verdict::Refused
        );
    }

    #[test]
    fn the_helpers_restrict_what_they_say() {
        let mut r = Rules::new();
        r.allow_unix_seqpacket(libc::SYS_socket).expect("rule");
        r.allow_stat_by_descriptor().expect("rule");
        let f = compile(r, ViolationAction::Kill, TargetArch::x86_64).expect("compiles");
        let (unix, inet) = (libc::AF_UNIX as u64, libc::AF_INET as u64);
        let seq = (libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC) as u64;
        let stream = (libc::SOCK_STREAM | libc::SOCK_CLOEXEC) as u64;
        assert_eq!(run(&f, libc::SYS_socket, [unix, seq, 0, 0, 0, 0]), ALLOW);
        assert_eq!(run(&f, libc::SYS_socket, [inet, seq, 0, 0, 0, 0]), KILL);
        assert_eq!(run(&f, libc::SYS_socket, [unix, stream, 0, 0, 0, 0]), KILL);
        let netlink = libc::AF_NETLINK as u64;
        assert_eq!(run(&f, libc::SYS_socket, [netlink, 3, 0, 0, 0, 0]), KILL);
        let empty = libc::AT_EMPTY_PATH as u64;
        assert_eq!(run(&f, libc::SYS_statx, [9, 0, empty, 0xfff, 0, 0]), ALLOW);
        let cwd = libc::AT_FDCWD as u64;
        assert_eq!(run(&f, libc::SYS_statx, [cwd, 0, 0, 0xfff, 0, 0]), KILL);
        assert_eq!(run(&f, libc::SYS_newfstatat, [9, 0, 0, empty, 0, 0]), ALLOW);
        assert_eq!(run(&f, libc::SYS_newfstatat, [cwd, 0, 0, 0, 0, 0]), KILL);
        assert_eq!(run(&f, libc::SYS_fstat, [9, 0, 0, 0, 0, 0]), ALLOW);
    }

    #[test]
    fn the_action_is_what_the_operator_chose() {
        for (action, expected) in [
            (ViolationAction::Kill, libc::SECCOMP_RET_KILL_PROCESS),
            (ViolationAction::Trap, libc::SECCOMP_RET_TRAP),
            (ViolationAction::Log, libc::SECCOMP_RET_LOG),
        ] {
            let f = compile(common_rules().expect("rules"), action, TargetArch::x86_64)
                .expect("compiles");
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
        a.allow_if_masked(libc::SYS_mmap, 2, 4, 0).expect("rule");
        let mut b = Rules::new();
        b.allow(libc::SYS_mmap);
        assert!(a
            .clone()
            .merge(b.clone())
            .allows_any_arguments(libc::SYS_mmap));
        assert!(b.merge(a.clone()).allows_any_arguments(libc::SYS_mmap));
        let twice = a.clone().merge(a);
        assert!(twice.allows(libc::SYS_mmap) && !twice.allows_any_arguments(libc::SYS_mmap));
        assert_eq!(twice.0[&libc::SYS_mmap].len(), 1);
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

    /// Two roles for the tests of [`Threads`]: `A` may `getppid`, `B` may
    /// `getuid`; neither may do the other's.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
    enum TestRole {
        A,
        B,
    }

    impl fmt::Display for TestRole {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            fmt::Debug::fmt(self, f)
        }
    }

    impl ThreadRole for TestRole {
        fn rules(self) -> Result<Rules, SeccompError> {
            let mut own = Rules::new();
            own.allow(match self {
                TestRole::A => libc::SYS_getppid,
                TestRole::B => libc::SYS_getuid,
            });
            Ok(common_rules()?.merge(own))
        }
    }

    /// In a forked child: the main thread takes role A and starts a thread
    /// of role B, which makes `call`; then the main thread makes
    /// `main_call`. Exits 0 if everything went through.
    fn two_roles(call: i64, main_call: i64) -> ChildEnd {
        in_child_process(|| {
            let Ok(threads) = Threads::start(
                SeccompMode::Enforce(ViolationAction::Kill),
                TestRole::A,
                &[TestRole::B],
                "test",
            ) else {
                return 3;
            };
            let Ok(thread) = threads.spawn(TestRole::B, "b", move || syscall(call, [0; 6])) else {
                return 4;
            };
            if thread.join().is_err() {
                return 5;
            }
            // A role the launcher was not told about is refused.
            if threads.spawn(TestRole::A, "a", || ()).is_ok() {
                return 6;
            }
            syscall(main_call, [0; 6]);
            0
        })
    }

    #[test]
    fn each_thread_can_do_what_its_role_needs_and_not_what_another_needs() {
        // Each role's own call, in its own thread: allowed (the launcher,
        // the new thread's start-up and its filter all go through).
        assert_eq!(
            two_roles(libc::SYS_getuid, libc::SYS_getppid),
            ChildEnd::Exited(0)
        );
        // B's thread may not make A's call...
        assert_eq!(
            two_roles(libc::SYS_getppid, libc::SYS_getppid),
            ChildEnd::Signaled(libc::SIGSYS)
        );
        // ...nor the main thread (role A) B's call.
        assert_eq!(
            two_roles(libc::SYS_getuid, libc::SYS_getuid),
            ChildEnd::Signaled(libc::SIGSYS)
        );
        // Neither may install another filter of its own.
        assert_eq!(
            two_roles(libc::SYS_seccomp, libc::SYS_getppid),
            ChildEnd::Signaled(libc::SIGSYS)
        );
    }

    #[test]
    fn unfiltered_threads_run_their_body() {
        let threads = Threads::<TestRole>::unfiltered();
        assert!(!threads.is_filtered());
        let thread = threads.spawn(TestRole::B, "b", || 7).expect("spawn");
        assert_eq!(thread.join().expect("join"), 7);
    }
}
