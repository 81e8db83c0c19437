//! hostd's sandbox: what its walls are made of. The steps are
//! `vrdma_isolation::sandbox`'s, the same as vdev's, in their
//! order, step 1 and then steps 2 to 5 as one call, [`Sandbox::enter`], in
//! `main.rs` (docs/security.md has the threat model):
//!
//! 1. [`Sandbox::new`] decides everything up front from the config and the
//!    process's situation (root or not), and refuses impossible requests
//!    (`--uid` without root; `--sandbox namespace` without root, see
//!    [`NO_USER_NAMESPACE`]) before anything is opened or changed.
//! 2. namespaces — `--sandbox namespace` only; the new root keeps the
//!    policy file's directory (read-only), for reloads.
//! 3. landlock: reading the files of the policy file's directory, nothing
//!    else; the sockets are bound before.
//! 4. privileges — limits (no locked memory), uid/gid, capabilities.
//! 5. seccomp — the main thread's filter on the main thread, and the
//!    launcher every other thread is started through, each under its
//!    role's filter ([`crate::seccomp`] has the rule tables).

use std::path::{Path, PathBuf};

use vrdma_isolation::landlock::{FsAccess, FsPolicy};
use vrdma_isolation::sandbox::{Plan, SandboxError, Walls};

use crate::seccomp::{Role, Threads};
use crate::Config;

/// Why hostd's namespace mode needs root: a user namespace would break the
/// peer-credential check.
pub const NO_USER_NAMESPACE: &str = "hostd checks each vdev's uid (SO_PEERCRED) against the \
     policy, and inside a user namespace that maps only hostd's own uid every other uid reads \
     as the overflow uid 65534";

/// hostd's sandbox, decided before its first step.
#[derive(Debug)]
pub struct Sandbox {
    /// The steps, shared with vdev.
    pub plan: Plan,
}

impl Sandbox {
    /// Decides the sandbox of `config`; refuses impossible requests. Warns
    /// when the policy file will not be readable after the uid change.
    pub fn new(config: &Config) -> Result<Sandbox, SandboxError> {
        // The policy's directory, and the cluster file's (`[fabric]`).
        let mut readable: Vec<PathBuf> = config
            .policy_file
            .as_deref()
            .into_iter()
            .chain(config.fabric.as_ref().map(|f| f.cluster_file.as_path()))
            .map(policy_directory)
            .collect();
        readable.dedup();
        let summary = if readable.is_empty() {
            "nothing".to_owned()
        } else {
            let dirs: Vec<String> = readable.iter().map(|d| d.display().to_string()).collect();
            format!("files in {}", dirs.join(", "))
        };
        let walls = Walls {
            daemon: "hostd",
            keep: readable.clone(),
            fs: FsPolicy {
                paths: readable
                    .iter()
                    .map(|dir| (dir.clone(), FsAccess::ReadFile))
                    .collect(),
                // The directory thread keeps talking to etcd.
                tcp_connect: match config.fabric.as_ref().map(|f| &f.directory) {
                    Some(crate::config::DirectoryKind::Etcd { endpoints, .. }) => {
                        endpoints.iter().map(|e| e.port()).collect()
                    }
                    _ => Vec::new(),
                },
            },
            fs_summary: format!(
                "no file-system access but reading the {} (readable: {summary})",
                if config.fabric.is_some() {
                    "policy and cluster files"
                } else {
                    "policy file"
                }
            ),
            // hostd locks no memory.
            memlock: 0,
            no_user_namespace: Some(NO_USER_NAMESPACE),
        };
        let plan = Plan::new(&config.sandbox, walls)?;
        if let (Some(id), Some(file)) = (plan.identity(), &config.policy_file) {
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
        Ok(Sandbox { plan })
    }

    /// Every step of the sandbox, in its order, on the main thread (see
    /// `vrdma_isolation::sandbox`); every thread hostd starts from now on
    /// is started through the returned [`Threads`], under its role's
    /// filter.
    pub fn enter(&self) -> Result<Threads, SandboxError> {
        self.plan.enter(Role::Main, &Role::SPAWNED)
    }
}

/// What landlock lets hostd read for reloads (and what its namespace root
/// keeps): the files of the policy file's directory, not the file's inode,
/// so that a policy replaced by a rename (editors that save so,
/// configuration managers) reloads too. Keep the policy in a directory of
/// its own (docs/security.md).
fn policy_directory(file: &Path) -> PathBuf {
    match file.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir.to_path_buf(),
        _ => PathBuf::from("."),
    }
}
