//! vdev's sandbox: which walls, built from what, in the order `main.rs`
//! runs them (docs/security.md has the threat model).
//!
//! 1. [`Plan::new`] decides everything up front from the config and the
//!    process's situation (root or not, user namespaces, whether hostd's
//!    socket is reachable after the uid change), and refuses impossible
//!    combinations before anything is opened or changed.
//! 2. [`enter_namespaces`] — `--sandbox namespace` only.
//! 3. [`restrict_filesystem`] — landlock with no rules at all: after
//!    start-up vdev opens, creates and removes nothing by path.
//! 4. [`drop_privileges`] — limits, uid/gid, capabilities.
//! 5. [`install_seccomp`] — the main thread's filter on the main thread,
//!    and the launcher every other thread is started through, each under
//!    its role's filter ([`crate::seccomp`] has the rule tables).

use std::path::PathBuf;

use vrdma_isolation::landlock::{self, FsPolicy, LandlockError};
use vrdma_isolation::namespaces::{self, NamespaceError, NamespacePlan};
use vrdma_isolation::privileges::{self, Identity, PrivilegeError, ResourceLimits};
use vrdma_isolation::seccomp::SeccompError;

use crate::config::{Config, SandboxConfig};
use crate::seccomp::{Role, Threads};

/// Why vdev refused to start its sandbox.
#[derive(Debug, thiserror::Error)]
pub enum SandboxError {
    #[error("The sandbox must be entered before any thread starts, but vdev runs {0} threads")]
    Threads(usize),
    #[error("Cannot count vdev's threads")]
    ThreadCount(#[source] std::io::Error),
    #[error("Namespace sandbox")]
    Namespaces(#[source] NamespaceError),
    #[error("Landlock")]
    Landlock(#[source] LandlockError),
    #[error("Dropping privileges")]
    Privileges(#[source] PrivilegeError),
    #[error("seccomp")]
    Seccomp(#[source] SeccompError),
}

/// Everything the sandbox steps will do, decided before the first one.
#[derive(Debug)]
pub struct Plan {
    config: SandboxConfig,
    namespaces: Option<NamespacePlan>,
    /// Directories the namespace root keeps: hostd's socket directory.
    keep: Vec<PathBuf>,
    /// The uid/gid to switch to (`None`: not started as root, kept).
    identity: Option<Identity>,
    limits: ResourceLimits,
    /// Register the first device with hostd before the sandbox, because
    /// the uid vdev switches to cannot connect to hostd's socket (file
    /// permissions). Only the first frontend can then be served: the
    /// registration for the next one fails. Connecting as the final uid
    /// is what hostd's peer-credential check expects, so this is only a
    /// fallback for a hostd socket that is not connectable (hostd creates
    /// its vdev socket with mode 0666; a directory above it that the uid
    /// cannot search, or an older hostd, still needs this).
    pub register_early: bool,
}

impl Plan {
    /// Decides the sandbox of `config`; refuses impossible combinations.
    pub fn new(config: &Config) -> Result<Plan, SandboxError> {
        let sandbox = config.sandbox.clone();
        let root = privileges::started_as_root();
        let namespaces = sandbox
            .mode
            .plan(root, !root && namespaces::user_namespaces_available())
            .map_err(SandboxError::Namespaces)?;
        let identity =
            privileges::plan(root, sandbox.uid, sandbox.gid).map_err(SandboxError::Privileges)?;
        let keep = config
            .hostd
            .iter()
            .filter_map(|p| p.parent().map(PathBuf::from))
            .collect();
        let register_early = match (&config.hostd, identity) {
            // A socket that does not exist yet or cannot be inspected is
            // left to the connect itself, which reports it.
            (Some(path), Some(id)) => !id.may_connect(path).unwrap_or(true),
            _ => false,
        };
        if register_early {
            if let (Some(path), Some(id)) = (&config.hostd, identity) {
                tracing::warn!(
                    tenant = %config.tenant,
                    hostd = %path.display(),
                    uid = id.uid,
                    gid = id.gid,
                    "hostd's socket is not connectable by the uid vdev runs as: registering \
                     with hostd now, before dropping privileges. Only the first frontend can be \
                     served; let this uid connect to hostd's socket (its group or mode) to \
                     serve frontends one after another"
                );
            }
        }
        Ok(Plan {
            limits: ResourceLimits {
                nofile: sandbox.rlimit_nofile,
                memlock: config.limits.max_total_mr_bytes,
            },
            config: sandbox,
            namespaces,
            keep,
            identity,
            register_early,
        })
    }
}

/// Step 1 of the sandbox: checks that vdev is still single-threaded, then
/// enters the namespaces of `--sandbox namespace` (nothing for `none`).
pub fn enter_namespaces(plan: &Plan) -> Result<(), SandboxError> {
    let threads = vrdma_isolation::thread_count().map_err(SandboxError::ThreadCount)?;
    if threads != 1 {
        return Err(SandboxError::Threads(threads));
    }
    match &plan.namespaces {
        None => {
            tracing::debug!("Sandbox mode none: no namespaces");
            Ok(())
        }
        Some(ns) => {
            namespaces::enter(ns, &plan.keep).map_err(SandboxError::Namespaces)?;
            tracing::info!(
                user_namespace = ns.user,
                kept = ?plan.keep,
                "Entered mount, network and IPC namespaces; the root holds only the kept paths"
            );
            Ok(())
        }
    }
}

/// Step 2: landlock, with no rules: nothing may be opened, created or
/// removed by path any more. Refuses a kernel without landlock unless the
/// operator allowed it.
pub fn restrict_filesystem(plan: &Plan) -> Result<(), SandboxError> {
    if !plan.config.landlock {
        tracing::warn!(
            "LANDLOCK IS OFF (--landlock off): vdev can open any file its uid can reach"
        );
        return Ok(());
    }
    landlock::enter(
        &FsPolicy::default(),
        plan.config.allow_no_landlock,
        "vdev",
        "no file-system access at all",
    )
    .map_err(SandboxError::Landlock)
}

/// Step 3: resource limits, the uid/gid switch (when started as root) and
/// no capabilities, no_new_privs, not dumpable.
pub fn drop_privileges(plan: &Plan) -> Result<(), SandboxError> {
    privileges::apply(plan.limits, plan.identity).map_err(SandboxError::Privileges)
}

/// Step 4, last: the main role's filter on the calling (main) thread, and
/// the launcher that starts every later thread under its own role's
/// filter, with the operator's violation action — or, only when
/// explicitly asked, no filter at all. Every thread vdev starts from now
/// on is started through the returned [`Threads`].
pub fn install_seccomp(plan: &Plan) -> Result<Threads, SandboxError> {
    Threads::start(plan.config.seccomp, Role::Main, &Role::SPAWNED, "vdev")
        .map_err(SandboxError::Seccomp)
}
