//! hostd's sandbox: which walls, built from what, in the order `main.rs`
//! runs them (docs/security.md has the threat model).
//!
//! 1. [`Plan::new`] decides everything up front from the flags and the
//!    process's situation (root or not), and refuses impossible requests
//!    (`--uid` without root) before anything is opened or changed.
//! 2. [`restrict_filesystem`] — landlock: read access to the policy file
//!    (for reload), nothing else; the sockets are bound before.
//! 3. [`drop_privileges`] — limits, uid/gid, capabilities.
//! 4. [`install_seccomp`] — the main thread's filter on the main thread,
//!    and the launcher every other thread is started through, each under
//!    its role's filter ([`crate::seccomp`] has the rule tables).

use std::path::{Path, PathBuf};

use vrdma_isolation::landlock::{self, FsAccess, FsPolicy, LandlockError};
use vrdma_isolation::privileges::{self, Identity, PrivilegeError, ResourceLimits};
use vrdma_isolation::seccomp::{SeccompError, SeccompMode};

use crate::seccomp::{Role, Threads};
use crate::Config;

/// Default `RLIMIT_NOFILE`: every vdev holds a connection, a notification
/// channel, two eventfds and its memfds open in hostd.
pub const DEFAULT_RLIMIT_NOFILE: u64 = 65536;

/// The sandbox flags of `hostd`.
#[derive(Debug, Clone, clap::Args)]
pub struct SandboxArgs {
    /// What a system call outside hostd's allow-list does: kill (SIGSYS),
    /// trap (fails with EPERM, reported on stderr), log (allowed, logged
    /// by the kernel) or off (no filter).
    #[arg(long, default_value = "kill", value_parser = parse_seccomp)]
    pub seccomp: SeccompMode,
    /// Landlock (file-system wall): on or off.
    #[arg(long, default_value = "on", value_parser = ["on", "off"])]
    pub landlock: String,
    /// Start even on a kernel that cannot enforce landlock.
    #[arg(long)]
    pub allow_no_landlock: bool,
    /// Numeric uid to switch to when started as root (default 65534, nobody).
    #[arg(long)]
    pub uid: Option<u32>,
    /// Numeric gid to switch to when started as root (default 65534, nogroup).
    #[arg(long)]
    pub gid: Option<u32>,
    /// RLIMIT_NOFILE (soft = hard).
    #[arg(long, default_value_t = DEFAULT_RLIMIT_NOFILE)]
    pub rlimit_nofile: u64,
}

fn parse_seccomp(text: &str) -> Result<SeccompMode, String> {
    text.parse().map_err(|e: SeccompError| e.to_string())
}

/// Why hostd refused to start its sandbox.
#[derive(Debug, thiserror::Error)]
pub enum SandboxError {
    #[error("The sandbox must be entered before any thread starts, but hostd runs {0} threads")]
    Threads(usize),
    #[error("Cannot count hostd's threads")]
    ThreadCount(#[source] std::io::Error),
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
    args: SandboxArgs,
    /// The policy file, readable after the sandbox (reload).
    policy_file: Option<PathBuf>,
    /// The uid/gid to switch to (`None`: not started as root, kept).
    identity: Option<Identity>,
    limits: ResourceLimits,
}

impl Plan {
    /// Decides the sandbox; refuses `--uid`/`--gid` without root.
    pub fn new(args: &SandboxArgs, config: &Config) -> Result<Plan, SandboxError> {
        let identity = privileges::plan(privileges::started_as_root(), args.uid, args.gid)
            .map_err(SandboxError::Privileges)?;
        if let (Some(id), Some(file)) = (identity, &config.policy_file) {
            // The file was just read (as the uid hostd started as); a
            // reload reads it again as `id`, without capabilities.
            if !id.may_read(file).unwrap_or(true) {
                tracing::warn!(
                    policy = %file.display(),
                    uid = id.uid,
                    gid = id.gid,
                    "The policy file is not readable by the uid hostd switches to: reloads \
                     (SIGHUP, vrdmactl reload) will fail. Make it (and its directories) \
                     readable by that uid or group, or keep uid 0 with --uid 0 --gid 0"
                );
            }
        }
        Ok(Plan {
            args: args.clone(),
            policy_file: config.policy_file.clone(),
            identity,
            // hostd locks no memory.
            limits: ResourceLimits {
                nofile: args.rlimit_nofile,
                memlock: 0,
            },
        })
    }
}

/// Step 1: checks that hostd is still single-threaded (landlock and the
/// credential changes apply to the calling thread only), then landlock:
/// reading the files in the policy file's directory, nothing else. Refuses
/// a kernel without landlock unless the operator allowed it.
pub fn restrict_filesystem(plan: &Plan) -> Result<(), SandboxError> {
    let threads = vrdma_isolation::thread_count().map_err(SandboxError::ThreadCount)?;
    if threads != 1 {
        return Err(SandboxError::Threads(threads));
    }
    if plan.args.landlock == "off" {
        tracing::warn!(
            "LANDLOCK IS OFF (--landlock off): hostd can open any file its uid can reach"
        );
        return Ok(());
    }
    let readable = plan.policy_file.as_deref().map(policy_directory);
    let policy = FsPolicy {
        paths: readable
            .iter()
            .map(|dir| (dir.clone(), FsAccess::ReadFile))
            .collect(),
    };
    let shown = readable.map_or_else(
        || "nothing".to_owned(),
        |dir| format!("files in {}", dir.display()),
    );
    let full = format!("no file-system access but reading the policy file (readable: {shown})");
    landlock::enter(&policy, plan.args.allow_no_landlock, "hostd", &full)
        .map_err(SandboxError::Landlock)
}

/// What landlock lets hostd read for reloads: the files of the policy
/// file's directory, not the file's inode, so that a policy replaced by a
/// rename (editors that save so, configuration managers) reloads too. Keep
/// the policy in a directory of its own (docs/security.md).
fn policy_directory(file: &Path) -> PathBuf {
    match file.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir.to_path_buf(),
        _ => PathBuf::from("."),
    }
}

/// Step 2: resource limits, the uid/gid switch (when started as root) and
/// no capabilities, no_new_privs, not dumpable.
pub fn drop_privileges(plan: &Plan) -> Result<(), SandboxError> {
    privileges::apply(plan.limits, plan.identity).map_err(SandboxError::Privileges)
}

/// Step 3, last: the main role's filter on the calling (main) thread, and
/// the launcher that starts every later thread under its own role's
/// filter, with the operator's violation action — or, only when
/// explicitly asked, no filter at all. Every thread hostd starts from now
/// on is started through the returned [`Threads`].
pub fn install_seccomp(plan: &Plan) -> Result<Threads, SandboxError> {
    Threads::start(plan.args.seccomp, Role::Main, &Role::SPAWNED, "hostd")
        .map_err(SandboxError::Seccomp)
}
