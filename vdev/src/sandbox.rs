//! vdev's sandbox: what its walls are made of, and the one decision that is
//! vdev's own (registering with hostd before the sandbox). The steps are
//! `vrdma_isolation::sandbox`'s, the same as hostd's, in their
//! order, step 1 and then steps 2 to 5 as one call, [`Sandbox::enter`], in
//! `main.rs` (docs/security.md has the threat model):
//!
//! 1. [`Sandbox::new`] decides everything up front from the config and the
//!    process's situation (root or not, user namespaces, whether hostd's
//!    socket is reachable after the uid change), and refuses impossible
//!    combinations before anything is opened or changed.
//! 2. namespaces — `--sandbox namespace` only; the new root keeps hostd's
//!    socket directory.
//! 3. landlock with no rules at all: after start-up vdev opens, creates
//!    and removes nothing by path.
//! 4. privileges — limits (locked memory: the tenant's memory quota),
//!    uid/gid, capabilities.
//! 5. seccomp — the main thread's filter on the main thread, and the
//!    launcher every other thread is started through, each under its
//!    role's filter ([`crate::seccomp`] has the rule tables).

use std::path::PathBuf;

use vrdma_isolation::landlock::FsPolicy;
use vrdma_isolation::sandbox::{Plan, SandboxError, Walls};

use crate::config::Config;
use crate::seccomp::{Role, Threads};

/// vdev's sandbox, decided before its first step.
#[derive(Debug)]
pub struct Sandbox {
    /// The steps, shared with hostd.
    pub plan: Plan,
}

impl Sandbox {
    /// Decides the sandbox of `config`; refuses impossible combinations.
    pub fn new(config: &Config) -> Result<Sandbox, SandboxError> {
        let walls = Walls {
            daemon: "vdev",
            // hostd's socket must stay reachable by path.
            keep: config
                .hostd
                .iter()
                .filter_map(|p| p.parent().map(PathBuf::from))
                .collect(),
            fs: FsPolicy::default(),
            fs_summary: "no file-system access at all".into(),
            // vdev locks no memory itself; the limit only bounds a
            // compromised vdev.
            memlock: config.limits.max_total_mr_bytes,
            no_user_namespace: None,
        };
        let plan = Plan::new(&config.sandbox, walls)?;
        // vdev registers with hostd from inside its sandbox, as the uid
        // hostd's peer check expects, for every context it serves; a
        // socket that uid cannot reach fails the first registration, at
        // start. Mode bits cannot see ACLs: this only explains that
        // failure beforehand, the connect decides.
        if let (Some(path), Some(id)) = (&config.hostd, plan.identity()) {
            if !id.may_connect(path).unwrap_or(true) {
                tracing::warn!(
                    tenant = %config.tenant,
                    hostd = %path.display(),
                    uid = id.uid,
                    gid = id.gid,
                    "hostd's socket looks out of reach of the uid vdev runs as (it needs search \
                     on every directory above the socket and write on the socket): registering \
                     with hostd will probably fail"
                );
            }
        }
        Ok(Sandbox { plan })
    }

    /// Every step of the sandbox, in its order, on the main thread (see
    /// `vrdma_isolation::sandbox`); every thread vdev starts from now on
    /// is started through the returned [`Threads`], under its role's
    /// filter.
    pub fn enter(&self) -> Result<Threads, SandboxError> {
        self.plan.enter(Role::Main, &Role::SPAWNED)
    }
}
