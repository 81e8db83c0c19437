//! What a compiled filter does with a call, for the rule tables' tests
//! (cargo feature `testing`; the daemons turn it on in their
//! dev-dependencies).
//!
//! Two ways to ask, both without touching the test process's own filter:
//!
//! - [`run`]: a small interpreter of the classic-BPF instructions
//!   seccompiler emits, for any architecture's program and any arguments —
//!   fast, so a test can check every call a role needs.
//! - [`in_child`]: the kernel itself. A forked child installs the filter
//!   and makes the call; it exits normally if the call went through
//!   (whatever the call returned) and dies with `SIGSYS` if the filter
//!   refused it. Slower, and only for the machine's own architecture, but
//!   it is the real thing.
//!
//! On top of them, the checks every daemon's rule tables get (each role
//! compiles, allows what it needs, refuses what only other roles need and
//! what no role may have, and the kernel agrees): `assert_*`.

use seccompiler::{sock_filter, BpfProgram, TargetArch};

use super::{compile, native_arch, Rules, ThreadRole, ViolationAction};

/// `SECCOMP_RET_ALLOW`.
pub const ALLOW: u32 = libc::SECCOMP_RET_ALLOW;
/// `SECCOMP_RET_KILL_PROCESS`.
pub const KILL: u32 = libc::SECCOMP_RET_KILL_PROCESS;

/// `AUDIT_ARCH_X86_64`: [`run`] evaluates programs compiled for x86_64.
const AUDIT_ARCH_X86_64: u32 = 0xc000_003e;

/// What `program` (compiled for x86_64) returns for the call `nr(args)`.
///
/// # Panics
///
/// On an instruction seccompiler does not emit (a test helper: the test
/// fails with the instruction named).
pub fn run(program: &[sock_filter], nr: i64, args: [u64; 6]) -> u32 {
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
                let mut word = [0u8; 4];
                word.copy_from_slice(&data[k..k + 4]);
                acc = u32::from_le_bytes(word);
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

/// What the kernel did with a call made under a filter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// The call went through (it may still have failed, e.g. `EBADF`).
    Allowed,
    /// The filter refused it: the child died with `SIGSYS`.
    Refused,
}

/// How a forked child ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChildEnd {
    Exited(i32),
    Signaled(i32),
}

/// Forks a child that runs `f` and exits with what it returns; says how the
/// child ended. `f` runs in a copy of the test process with one thread:
/// it may install filters and start threads without touching the test
/// process, but must not wait for locks other test threads may have held
/// at the fork (no logging, no stdout).
///
/// # Panics
///
/// If the child cannot be forked or waited for (a test helper).
pub fn in_child_process(f: impl FnOnce() -> i32) -> ChildEnd {
    // SAFETY: the child runs `f` (whose caller keeps to what is safe after
    // a fork, see above) and ends with _exit; the parent only waits.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork: {}", std::io::Error::last_os_error());
    if pid == 0 {
        let code = f();
        // SAFETY: _exit ends the child without running anything else.
        unsafe { libc::_exit(code) };
    }
    let mut status = 0;
    // SAFETY: waits for our own child; `status` is a valid out-pointer.
    let waited = unsafe { libc::waitpid(pid, &mut status, 0) };
    assert_eq!(waited, pid, "waitpid: {}", std::io::Error::last_os_error());
    if libc::WIFSIGNALED(status) {
        ChildEnd::Signaled(libc::WTERMSIG(status))
    } else {
        ChildEnd::Exited(libc::WEXITSTATUS(status))
    }
}

/// Makes the raw system call `nr(args)`; its return value.
pub fn syscall(nr: i64, args: [u64; 6]) -> i64 {
    // SAFETY: a raw system call with integer arguments; the callers pass
    // pointers only as null or as addresses the kernel checks.
    unsafe { libc::syscall(nr, args[0], args[1], args[2], args[3], args[4], args[5]) }
}

/// Forks a child that installs `program` (compiled for this machine, with
/// [`ViolationAction::Kill`](super::ViolationAction::Kill)) on itself and
/// makes the call `nr(args)`; says what happened. Give arguments that make
/// an allowed call return at once (bad descriptors, null pointers).
///
/// # Panics
///
/// If the child ends any other way (a test helper).
pub fn in_child(program: &BpfProgram, nr: i64, args: [u64; 6]) -> Verdict {
    let end = in_child_process(|| {
        if seccompiler::apply_filter(program).is_err() {
            return 2;
        }
        syscall(nr, args);
        0
    });
    match end {
        ChildEnd::Exited(0) => Verdict::Allowed,
        ChildEnd::Signaled(libc::SIGSYS) => Verdict::Refused,
        other => panic!("the child for system call {nr} ended with {other:?}"),
    }
}

/// A system call with typical arguments, named for test messages.
pub type Call = (&'static str, i64, [u64; 6]);

/// A descriptor no process has: an allowed call on it returns `EBADF` at
/// once, for [`in_child`].
pub const BAD_FD: u64 = u64::MAX;
/// `PROT_READ | PROT_WRITE`.
pub const RW: u64 = (libc::PROT_READ | libc::PROT_WRITE) as u64;

/// `fcntl(9, cmd, 3)`.
pub fn fcntl(cmd: libc::c_int) -> Call {
    ("fcntl", libc::SYS_fcntl, [9, cmd as u64, 3, 0, 0, 0])
}

/// `statx(12, "", AT_EMPTY_PATH, STATX_ALL)`: the size of an open file.
pub fn statx_by_descriptor() -> Call {
    let empty_path = libc::AT_EMPTY_PATH as u64;
    ("statx", libc::SYS_statx, [12, 0, empty_path, 0xfff, 0, 0])
}

/// `nr(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC)`: `socket` or `socketpair`.
pub fn unix_seqpacket(name: &'static str, nr: i64) -> Call {
    let seqpacket = (libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC) as u64;
    (name, nr, [libc::AF_UNIX as u64, seqpacket, 0, 0, 0, 0])
}

/// Calls no thread of any vrdma daemon may make, whatever its role: new
/// programs and processes, other processes' memory and signals, device
/// control, listening sockets, mounts and namespaces, identities and
/// capabilities, kernel extension points, and new seccomp filters.
pub const DANGEROUS: [(&str, i64); 26] = [
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
    ("pkey_mprotect", libc::SYS_pkey_mprotect),
    ("open_by_handle_at", libc::SYS_open_by_handle_at),
    ("seccomp", libc::SYS_seccomp),
    ("pidfd_getfd", libc::SYS_pidfd_getfd),
];

/// The calls every thread makes, whatever its role, with the arguments it
/// makes them with (from `strace -f` of the daemons under the
/// integration tests): [`common_rules`](super::common_rules) must allow
/// them all.
pub fn common_calls() -> Vec<Call> {
    let rw = RW;
    let thread = (libc::CLONE_VM
        | libc::CLONE_FS
        | libc::CLONE_FILES
        | libc::CLONE_SIGHAND
        | libc::CLONE_THREAD
        | libc::CLONE_SYSVSEM
        | libc::CLONE_SETTLS
        | libc::CLONE_PARENT_SETTID
        | libc::CLONE_CHILD_CLEARTID) as u64;
    let ro = (libc::O_RDONLY | libc::O_CLOEXEC) as u64;
    vec![
        ("read", libc::SYS_read, [4, 0, 8, 0, 0, 0]),
        ("write", libc::SYS_write, [2, 0, 80, 0, 0, 0]),
        ("close", libc::SYS_close, [9, 0, 0, 0, 0, 0]),
        (
            "fcntl F_GETFD",
            libc::SYS_fcntl,
            [9, libc::F_GETFD as u64, 0, 0, 0, 0],
        ),
        ("futex", libc::SYS_futex, [0, 128, 1, 0, 0, 0]),
        ("mmap anon", libc::SYS_mmap, [0, 1 << 20, rw, 0x22, 0, 0]),
        ("mmap stack", libc::SYS_mmap, [0, 1 << 21, 0, 0x20022, 0, 0]),
        ("mmap shared", libc::SYS_mmap, [0, 1 << 24, rw, 1, 20, 0]),
        ("mprotect", libc::SYS_mprotect, [0x1000, 4096, rw, 0, 0, 0]),
        ("munmap", libc::SYS_munmap, [0x1000, 4096, 0, 0, 0, 0]),
        ("mremap", libc::SYS_mremap, [0x1000, 4096, 8192, 1, 0, 0]),
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
        ("rt_sigaction", libc::SYS_rt_sigaction, [31, 0, 0, 8, 0, 0]),
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
            "prctl PR_SET_NAME",
            libc::SYS_prctl,
            [libc::PR_SET_NAME as u64, 0, 0, 0, 0, 0],
        ),
        ("getrandom", libc::SYS_getrandom, [0, 16, 0, 0, 0, 0]),
        ("clock_gettime", libc::SYS_clock_gettime, [1, 0, 0, 0, 0, 0]),
        (
            "openat read-only",
            libc::SYS_openat,
            [libc::AT_FDCWD as u64, 0, ro, 0, 0, 0],
        ),
    ]
}

/// The names of the calls of `calls` that `program` (x86_64) does not
/// allow.
pub fn refused(program: &[sock_filter], calls: &[Call]) -> Vec<&'static str> {
    calls
        .iter()
        .filter(|(_, nr, args)| run(program, *nr, *args) != ALLOW)
        .map(|(name, _, _)| *name)
        .collect()
}

/// `role`'s filter for x86_64 with [`ViolationAction::Kill`], for [`run`].
///
/// # Panics
///
/// If the role's rules cannot be built or compiled (a test failure).
pub fn x86_64_filter<R: ThreadRole>(role: R) -> BpfProgram {
    compile(role_rules(role), ViolationAction::Kill, TargetArch::x86_64)
        .unwrap_or_else(|e| panic!("{role}: {e}"))
}

/// `role`'s filter for this machine with [`ViolationAction::Kill`], for
/// [`in_child`].
///
/// # Panics
///
/// If the role's rules cannot be built or compiled (a test failure).
pub fn native_filter<R: ThreadRole>(role: R) -> BpfProgram {
    let arch = native_arch().unwrap_or_else(|e| panic!("{e}"));
    compile(role_rules(role), ViolationAction::Kill, arch).unwrap_or_else(|e| panic!("{role}: {e}"))
}

fn role_rules<R: ThreadRole>(role: R) -> Rules {
    role.rules().unwrap_or_else(|e| panic!("{role}: {e}"))
}

/// Checks that every role's filter compiles, for x86_64 with every
/// violation action and for this machine.
///
/// # Panics
///
/// On the first role that does not (a test failure).
pub fn assert_every_role_compiles<R: ThreadRole>(roles: &[R]) {
    for &role in roles {
        for action in [
            ViolationAction::Kill,
            ViolationAction::Trap,
            ViolationAction::Log,
        ] {
            let program = compile(role_rules(role), action, TargetArch::x86_64)
                .unwrap_or_else(|e| panic!("{role}: {e}"));
            assert!(!program.is_empty(), "{role}");
        }
        native_filter(role);
    }
}

/// Checks that each role's own filter lets through every call `needed`
/// says the role makes — the common calls included — with the arguments
/// it makes it with.
///
/// # Panics
///
/// Naming the role and the calls it refuses (a test failure).
pub fn assert_each_role_allows<R: ThreadRole>(roles: &[R], needed: impl Fn(R) -> Vec<Call>) {
    for &role in roles {
        let calls: Vec<Call> = common_calls().into_iter().chain(needed(role)).collect();
        let missing = refused(&x86_64_filter(role), &calls);
        assert!(missing.is_empty(), "the {role} role refuses {missing:?}");
    }
}

/// Checks calls that some roles need and the others must not have: each
/// call is allowed by the roles listed with it and refused by every other
/// role of `roles`.
///
/// # Panics
///
/// Naming the role and the call (a test failure).
pub fn assert_only_owners_allow<R: ThreadRole>(roles: &[R], calls: &[(Call, &[R])]) {
    for &role in roles {
        let filter = x86_64_filter(role);
        for ((name, nr, args), owners) in calls {
            let verdict = run(&filter, *nr, *args);
            if owners.contains(&role) {
                assert_eq!(verdict, ALLOW, "{role} needs {name}");
            } else {
                assert_eq!(verdict, KILL, "{role} must not have {name}");
            }
        }
    }
}

/// Checks that no role allows a call of [`DANGEROUS`] or of `also`.
///
/// # Panics
///
/// Naming the role and the call (a test failure).
pub fn assert_no_role_allows<R: ThreadRole>(roles: &[R], also: &[(&str, i64)]) {
    for &role in roles {
        let rules = role_rules(role);
        for (name, nr) in DANGEROUS.iter().chain(also) {
            assert!(!rules.allows(*nr), "{role} must not allow {name}");
        }
    }
}

/// Asks the kernel, in forked children, for each `(role, own, other)`:
/// the role's filter lets `own` through and refuses `other`, `execve`, an
/// `AF_INET` socket and executable memory.
///
/// # Panics
///
/// Naming the role and the call (a test failure).
pub fn assert_kernel_enforces<R: ThreadRole>(cases: &[(R, Call, Call)]) {
    let bad = BAD_FD;
    let exec = (libc::PROT_READ | libc::PROT_EXEC) as u64;
    let anon = (libc::MAP_PRIVATE | libc::MAP_ANONYMOUS) as u64;
    let inet = [libc::AF_INET as u64, libc::SOCK_STREAM as u64, 0, 0, 0, 0];
    let forbidden: [Call; 3] = [
        ("execve", libc::SYS_execve, [0; 6]),
        ("socket(AF_INET)", libc::SYS_socket, inet),
        (
            "mmap PROT_EXEC",
            libc::SYS_mmap,
            [0, 4096, exec, anon, bad, 0],
        ),
    ];
    for &(role, (own, own_nr, own_args), other) in cases {
        let filter = native_filter(role);
        assert_eq!(
            in_child(&filter, own_nr, own_args),
            Verdict::Allowed,
            "{role}: {own}"
        );
        for (name, nr, args) in std::iter::once(other).chain(forbidden) {
            assert_eq!(
                in_child(&filter, nr, args),
                Verdict::Refused,
                "{role}: {name}"
            );
        }
    }
}
