//! The threads of a sandboxed daemon, each under its own role's filter.
//!
//! A seccomp filter belongs to a thread. A new thread starts with copies
//! of its parent's filters, a thread can add filters but never remove one,
//! and a call goes through only if every filter of the thread allows it.
//! So a thread ends up with exactly its own role's allow-list only if (a)
//! it installs that list itself, before it runs anything of its own, and
//! (b) every filter it inherited allows at least as much.
//!
//! [`Threads::start`], a daemon's seccomp step, arranges both:
//!
//! 1. It compiles the filter of every role: the main thread's and those of
//!    the threads the daemon will start.
//! 2. It starts the **launcher**, the one thread that starts threads from
//!    then on. The launcher installs the union of the roles it starts,
//!    plus the two calls a new thread needs to add its own filter
//!    (`prctl(PR_SET_NO_NEW_PRIVS)`, already set and only ever a
//!    restriction, and `seccomp(SECCOMP_SET_MODE_FILTER)` without flags:
//!    no TSYNC, no listener, so it can only narrow the calling thread).
//! 3. It installs the main role's filter on the calling thread, which from
//!    then on can do what the main role needs and nothing else.
//!
//! [`Threads::spawn`] hands the launcher a request; the new thread installs
//! its role's filter as its first act, so its calls are those of the
//! launcher's union *and* of its role: its role's. Only then does it run
//! its body, and `spawn` returns only once it has (a thread whose filter
//! cannot be installed never runs its body, and `spawn` fails).
//!
//! What this enforces, and what it does not:
//!
//! - Every thread the daemon runs — the main thread, the launcher, every
//!   thread it starts — is filtered from its first instruction of daemon
//!   code, and a thread taken over through a bug in the input it handles
//!   cannot *itself* make a call that only another role needs.
//! - The threads share one address space. Code running in one thread can
//!   write another thread's memory, the launcher's requests included, and
//!   so have a call made by a thread of another role, or by the launcher.
//!   Per-thread filters narrow what one exploited thread can do directly;
//!   what holds for the whole process is that the calls no role needs
//!   (`execve`, `fork`, `ptrace`, network sockets, `mount`, `bpf`...) are
//!   in no role, and so in no filter, the launcher's included.
//! - Threads that a library starts (vhost-user-backend starts its own)
//!   inherit the filters of the thread that calls into the library; the
//!   daemon makes that call from a thread of the role those threads play.
//! - The launcher runs nothing but the spawn requests the daemon's own
//!   code hands it: it reads no socket and no guest memory.

use std::collections::BTreeMap;
use std::fmt;
use std::io;
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;

use seccompiler::BpfProgram;

use super::{
    clone3_prelude, common_rules, compile, install_sigsys_handler, native_arch, Op, Rules,
    SeccompError, SeccompMode, ViolationAction,
};

/// The thread roles of one daemon: one enum per daemon, one allow-list per
/// role.
pub trait ThreadRole: Copy + Ord + fmt::Debug + fmt::Display + Send + Sync + 'static {
    /// The role's allow-list, [`common_rules`] included.
    fn rules(self) -> Result<Rules, SeccompError>;
}

/// A request to the launcher: start one thread.
type Job = Box<dyn FnOnce() + Send>;

/// Starts the daemon's threads, each under its role's filter. Cheap to
/// clone; every clone uses the same launcher.
pub struct Threads<R: ThreadRole> {
    inner: Arc<Inner<R>>,
}

struct Inner<R> {
    /// The compiled filter of each role a thread may be started with;
    /// empty without seccomp.
    filters: BTreeMap<R, Arc<BpfProgram>>,
    /// Requests to the launcher; `None` without seccomp (threads are then
    /// started directly).
    launcher: Option<mpsc::Sender<Job>>,
}

impl<R: ThreadRole> Clone for Threads<R> {
    fn clone(&self) -> Self {
        Threads {
            inner: Arc::clone(&self.inner),
        }
    }
}

impl<R: ThreadRole> fmt::Debug for Threads<R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Threads")
            .field("roles", &self.inner.filters.keys().collect::<Vec<_>>())
            .field("filtered", &self.is_filtered())
            .finish()
    }
}

impl<R: ThreadRole> Threads<R> {
    /// Threads without any filter: for `--seccomp off`, and for running a
    /// daemon's service without its sandbox (tests, embedding).
    pub fn unfiltered() -> Self {
        Threads {
            inner: Arc::new(Inner {
                filters: BTreeMap::new(),
                launcher: None,
            }),
        }
    }

    /// A daemon's seccomp step, on its main thread, before any other thread
    /// of the daemon exists: compiles the filters of `main` and of the
    /// roles in `spawned`, starts the launcher under the union of
    /// `spawned`, installs `main`'s filter on the calling thread, and logs
    /// what it did, naming `daemon`. With [`SeccompMode::Off`] (only ever
    /// chosen explicitly) it installs nothing, loudly.
    pub fn start(
        mode: SeccompMode,
        main: R,
        spawned: &[R],
        daemon: &str,
    ) -> Result<Self, SeccompError> {
        let action = match mode {
            SeccompMode::Off => {
                tracing::warn!(
                    "SECCOMP IS OFF (--seccomp off): {daemon} may make any system call; a \
                     compromised {daemon} is limited only by the other walls"
                );
                return Ok(Self::unfiltered());
            }
            SeccompMode::Enforce(action) => action,
        };
        let arch = native_arch()?;
        let prelude = clone3_prelude(arch)?;
        let mut filters = BTreeMap::new();
        let mut union = Rules::new();
        let mut allowed = Vec::new();
        for &role in spawned {
            let rules = role.rules()?;
            allowed.push(format!("{role} {}", rules.len()));
            union = union.merge(rules.clone());
            filters.insert(role, Arc::new(compile(rules, action, arch)?));
        }
        let launcher_program = compile(union.merge(launcher_rules()?), action, arch)?;
        let main_rules = main.rules()?;
        allowed.push(format!("{main} (main) {}", main_rules.len()));
        let main_program = compile(main_rules, action, arch)?;
        if action == ViolationAction::Trap {
            install_sigsys_handler()?;
        }
        let launcher = start_launcher(prelude.clone(), launcher_program)?;
        install(&"main", &prelude)?;
        install(&main, &main_program)?;
        tracing::info!(
            mode = %mode,
            "seccomp: a filter per thread role (system calls allowed: {})",
            allowed.join(", ")
        );
        Ok(Threads {
            inner: Arc::new(Inner {
                filters,
                launcher: Some(launcher),
            }),
        })
    }

    /// Whether threads get filters (seccomp is on).
    pub fn is_filtered(&self) -> bool {
        self.inner.launcher.is_some()
    }

    /// Starts a thread named `name` that installs `role`'s filter, then
    /// runs `body`. Returns once the filter is in place. Fails if `role`
    /// was not among the roles given to [`Threads::start`], if the thread
    /// cannot be created, or if its filter cannot be installed (its body
    /// then never runs).
    pub fn spawn<F, T>(
        &self,
        role: R,
        name: impl Into<String>,
        body: F,
    ) -> io::Result<JoinHandle<T>>
    where
        F: FnOnce() -> T + Send + 'static,
        T: Send + 'static,
    {
        let name = name.into();
        let Some(launcher) = &self.inner.launcher else {
            return std::thread::Builder::new().name(name).spawn(move || {
                after_filter(role);
                body()
            });
        };
        let program = self.inner.filters.get(&role).cloned().ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "No seccomp filter for the thread role {role}: not given to Threads::start"
                ),
            )
        })?;
        let (reply_tx, reply_rx) = mpsc::sync_channel(1);
        let job: Job = Box::new(move || {
            let _ = reply_tx.send(spawn_filtered(role, name, program, body));
        });
        let stopped = || io::Error::other("The thread launcher has stopped");
        launcher.send(job).map_err(|_| stopped())?;
        reply_rx.recv().map_err(|_| stopped())?
    }
}

/// Runs on the launcher: starts the thread, which installs `program`
/// before anything else, and waits until it has.
fn spawn_filtered<R, F, T>(
    role: R,
    name: String,
    program: Arc<BpfProgram>,
    body: F,
) -> io::Result<JoinHandle<T>>
where
    R: ThreadRole,
    F: FnOnce() -> T + Send + 'static,
    T: Send + 'static,
{
    let (ready_tx, ready_rx) = mpsc::sync_channel(1);
    let handle = std::thread::Builder::new().name(name).spawn(move || {
        let installed = install(&role, &program);
        let ok = installed.is_ok();
        let _ = ready_tx.send(installed);
        if !ok {
            // Never run the body without its filter (spawn has returned
            // the error); this thread just waits for the process to end.
            loop {
                std::thread::park();
            }
        }
        after_filter(role);
        body()
    })?;
    match ready_rx.recv() {
        Ok(Ok(())) => Ok(handle),
        Ok(Err(e)) => Err(io::Error::other(e)),
        Err(_) => Err(io::Error::other(
            "A new thread ended before installing its seccomp filter",
        )),
    }
}

/// What the launcher needs beyond the roles it starts: each new thread
/// installs its own filter while it still carries the launcher's.
/// seccompiler sets `no_new_privs` first (already set: a no-op, and only
/// ever a restriction) and then calls `seccomp` without flags.
fn launcher_rules() -> Result<Rules, SeccompError> {
    let mut r = Rules::new();
    r.allow_if_eq(libc::SYS_prctl, 0, &[libc::PR_SET_NO_NEW_PRIVS as u64])?;
    r.allow_if_all(
        libc::SYS_seccomp,
        &[
            (0, Op::Eq, u64::from(libc::SECCOMP_SET_MODE_FILTER)),
            (1, Op::Eq, 0),
        ],
    )?;
    Ok(common_rules()?.merge(r))
}

/// Starts the launcher: it installs the clone3 prelude and `program`, then
/// runs spawn requests until every [`Threads`] is dropped.
fn start_launcher(
    prelude: BpfProgram,
    program: BpfProgram,
) -> Result<mpsc::Sender<Job>, SeccompError> {
    let (jobs_tx, jobs_rx) = mpsc::channel::<Job>();
    let (ready_tx, ready_rx) = mpsc::sync_channel(1);
    std::thread::Builder::new()
        .name("launcher".into())
        .spawn(move || {
            let installed =
                install(&"launcher", &prelude).and_then(|()| install(&"launcher", &program));
            let ok = installed.is_ok();
            let _ = ready_tx.send(installed);
            if ok {
                for job in jobs_rx {
                    job();
                }
            }
        })
        .map_err(SeccompError::Launcher)?;
    ready_rx.recv().map_err(|_| {
        SeccompError::Launcher(io::Error::other(
            "The launcher ended before installing its filter",
        ))
    })??;
    Ok(jobs_tx)
}

/// Installs `program` on the calling thread only (no TSYNC).
fn install(role: &dyn fmt::Display, program: &BpfProgram) -> Result<(), SeccompError> {
    seccompiler::apply_filter(program).map_err(|source| SeccompError::Install {
        role: role.to_string(),
        source,
    })
}

/// Runs in every thread started by [`Threads::spawn`] once its filter is
/// in place: the test hook that makes a thread of a chosen role misbehave.
#[cfg(feature = "test-hooks")]
fn after_filter(role: impl ThreadRole) {
    crate::test_hooks::in_role(&role.to_string());
}

#[cfg(not(feature = "test-hooks"))]
fn after_filter(_role: impl ThreadRole) {}

#[cfg(test)]
mod tests {
    use seccompiler::TargetArch;

    use super::super::testing::{run, ALLOW, DANGEROUS, KILL};
    use super::*;

    /// The launcher's own additions: a new thread may add its filter, and
    /// that is all — no TSYNC (which would reach other threads), no
    /// listener, no strict mode, no other `prctl`.
    #[test]
    fn the_launcher_may_add_a_filter_to_a_new_thread_and_nothing_dangerous() {
        let rules = launcher_rules().expect("rules");
        for (name, nr) in DANGEROUS {
            if nr != libc::SYS_seccomp {
                assert!(!rules.allows(nr), "the launcher must not allow {name}");
            }
        }
        let f = compile(rules, ViolationAction::Kill, TargetArch::x86_64).expect("compiles");
        let filter = u64::from(libc::SECCOMP_SET_MODE_FILTER);
        let strict = u64::from(libc::SECCOMP_SET_MODE_STRICT);
        let tsync = libc::SECCOMP_FILTER_FLAG_TSYNC;
        let listener = libc::SECCOMP_FILTER_FLAG_NEW_LISTENER;
        assert_eq!(run(&f, libc::SYS_seccomp, [filter, 0, 0, 0, 0, 0]), ALLOW);
        for args in [
            [filter, tsync, 0, 0, 0, 0],
            [filter, listener, 0, 0, 0, 0],
            [strict, 0, 0, 0, 0, 0],
        ] {
            assert_eq!(run(&f, libc::SYS_seccomp, args), KILL, "{args:?}");
        }
        let nnp = libc::PR_SET_NO_NEW_PRIVS as u64;
        assert_eq!(run(&f, libc::SYS_prctl, [nnp, 1, 0, 0, 0, 0]), ALLOW);
        let dumpable = libc::PR_SET_DUMPABLE as u64;
        assert_eq!(run(&f, libc::SYS_prctl, [dumpable, 1, 0, 0, 0, 0]), KILL);
    }
}
