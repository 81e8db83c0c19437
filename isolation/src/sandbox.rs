//! A daemon's sandbox, step by step, the same way in every vrdma daemon.
//!
//! The daemon says what its walls are made of ([`Walls`]: the paths it
//! still needs, its locked-memory limit, whether a user namespace would
//! break it); the operator's [`SandboxConfig`] says which walls are up.
//! [`Plan::new`] decides everything before anything changes and refuses
//! impossible requests; [`Plan::enter`], called by the daemon's `main.rs`
//! once it has opened what it needs, then runs the steps in their fixed
//! order:
//!
//! 1. namespaces — checks that the daemon is still single-threaded, then
//!    `--sandbox namespace` only: private mount, network and IPC
//!    namespaces whose root holds only [`Walls::keep`].
//! 2. landlock — [`Walls::fs`] and nothing else.
//! 3. privileges — limits, uid/gid, capabilities.
//! 4. seccomp — [`crate::seccomp::Threads::start`], last, as it forbids
//!    what the steps above do.

use std::path::PathBuf;

use crate::config::SandboxConfig;
use crate::landlock::{self, FsPolicy, LandlockError};
use crate::namespaces::{self, NamespaceError, NamespacePlan, SandboxMode};
use crate::privileges::{self, Identity, PrivilegeError, ResourceLimits};
use crate::seccomp::{SeccompError, ThreadRole, Threads};

/// Why a daemon refused to start its sandbox.
#[derive(Debug, thiserror::Error)]
pub enum SandboxError {
    #[error(
        "The sandbox must be entered before any thread starts, but {daemon} runs {threads} threads"
    )]
    Threads {
        daemon: &'static str,
        threads: usize,
    },
    #[error("Cannot count the daemon's threads")]
    ThreadCount(#[source] std::io::Error),
    #[error(
        "--sandbox namespace without root needs a user namespace, and {daemon} cannot run in \
         one: {why}"
    )]
    NoUserNamespace {
        daemon: &'static str,
        why: &'static str,
    },
    #[error("Namespace sandbox")]
    Namespaces(#[source] NamespaceError),
    #[error("Landlock")]
    Landlock(#[source] LandlockError),
    #[error("Dropping privileges")]
    Privileges(#[source] PrivilegeError),
    #[error("seccomp")]
    Seccomp(#[source] SeccompError),
}

/// What one daemon's walls are made of.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Walls {
    /// The daemon's name, for logs and errors.
    pub daemon: &'static str,
    /// Directories the namespace root keeps, each bound read-only at its
    /// own path (absolute paths).
    pub keep: Vec<PathBuf>,
    /// What landlock leaves reachable by path.
    pub fs: FsPolicy,
    /// What a fully enforced landlock leaves the daemon, for the log.
    pub fs_summary: String,
    /// `RLIMIT_MEMLOCK`, bytes.
    pub memlock: u64,
    /// Why the daemon cannot run in a user namespace, if it cannot: then
    /// `--sandbox namespace` needs root.
    pub no_user_namespace: Option<&'static str>,
}

/// Everything the sandbox steps will do, decided before the first one.
#[derive(Debug)]
pub struct Plan {
    config: SandboxConfig,
    walls: Walls,
    namespaces: Option<NamespacePlan>,
    /// The uid/gid to switch to (`None`: not started as root, kept).
    identity: Option<Identity>,
}

impl Plan {
    /// Decides the sandbox of `config` for a daemon with `walls`, from the
    /// process's situation (root or not, user namespaces); refuses
    /// impossible combinations (`--uid` without root, `--sandbox namespace`
    /// without root or a usable user namespace) before anything changes.
    pub fn new(config: &SandboxConfig, walls: Walls) -> Result<Plan, SandboxError> {
        let root = privileges::started_as_root();
        if let (SandboxMode::Namespace, false, Some(why)) =
            (config.mode, root, walls.no_user_namespace)
        {
            return Err(SandboxError::NoUserNamespace {
                daemon: walls.daemon,
                why,
            });
        }
        let namespaces = config
            .mode
            .plan(root, !root && namespaces::user_namespaces_available())
            .map_err(SandboxError::Namespaces)?;
        let identity =
            privileges::plan(root, config.uid, config.gid).map_err(SandboxError::Privileges)?;
        Ok(Plan {
            config: config.clone(),
            walls,
            namespaces,
            identity,
        })
    }

    /// The uid/gid the daemon will run as, if it changes (started as root).
    pub fn identity(&self) -> Option<Identity> {
        self.identity
    }

    /// The sandbox, every step in its order (namespaces, landlock,
    /// privileges, seccomp), on the daemon's still single-threaded main
    /// thread. The last step installs `main`'s filter on the calling thread
    /// and returns the launcher that starts every later thread under its
    /// own role's filter (one of `spawned`), with the operator's violation
    /// action — or, only when explicitly asked, no filter at all.
    pub fn enter<R: ThreadRole>(&self, main: R, spawned: &[R]) -> Result<Threads<R>, SandboxError> {
        self.enter_namespaces()?;
        self.restrict_filesystem()?;
        self.drop_privileges()?;
        Threads::start(self.config.seccomp, main, spawned, self.walls.daemon)
            .map_err(SandboxError::Seccomp)
    }

    /// Step 1: checks that the daemon is still single-threaded (namespaces,
    /// landlock and the credential changes apply to the calling thread
    /// only), then enters the namespaces of `--sandbox namespace` (nothing
    /// for `none`).
    fn enter_namespaces(&self) -> Result<(), SandboxError> {
        let threads = crate::thread_count().map_err(SandboxError::ThreadCount)?;
        if threads != 1 {
            return Err(SandboxError::Threads {
                daemon: self.walls.daemon,
                threads,
            });
        }
        match &self.namespaces {
            None => {
                tracing::debug!("Sandbox mode none: no namespaces");
                Ok(())
            }
            Some(ns) => {
                namespaces::enter(ns, &self.walls.keep).map_err(SandboxError::Namespaces)?;
                tracing::info!(
                    user_namespace = ns.user,
                    kept = ?self.walls.keep,
                    "Entered mount, network and IPC namespaces; the root holds only the kept paths"
                );
                Ok(())
            }
        }
    }

    /// Step 2: landlock, with the daemon's paths and nothing else; refuses
    /// a kernel without landlock unless the operator allowed it.
    fn restrict_filesystem(&self) -> Result<(), SandboxError> {
        let daemon = self.walls.daemon;
        if !self.config.landlock {
            tracing::warn!(
                "LANDLOCK IS OFF (--landlock off): {daemon} can open any file its uid can reach"
            );
            return Ok(());
        }
        landlock::enter(
            &self.walls.fs,
            self.config.allow_no_landlock,
            daemon,
            &self.walls.fs_summary,
        )
        .map_err(SandboxError::Landlock)
    }

    /// Step 3: resource limits, the uid/gid switch (when started as root)
    /// and no capabilities, no_new_privs, not dumpable.
    fn drop_privileges(&self) -> Result<(), SandboxError> {
        let limits = ResourceLimits {
            nofile: self.config.rlimit_nofile,
            memlock: self.walls.memlock,
        };
        privileges::apply(limits, self.identity).map_err(SandboxError::Privileges)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::seccomp::SeccompMode;

    fn walls(no_user_namespace: Option<&'static str>) -> Walls {
        Walls {
            daemon: "test",
            keep: Vec::new(),
            fs: FsPolicy::default(),
            fs_summary: "nothing".into(),
            memlock: 0,
            no_user_namespace,
        }
    }

    #[test]
    fn a_daemon_that_cannot_run_in_a_user_namespace_needs_root_for_namespaces() {
        let mut config = SandboxConfig::defaults(1024);
        config.mode = SandboxMode::Namespace;
        let refused = Plan::new(&config, walls(Some("its peers' uids would be unmapped")));
        if privileges::started_as_root() {
            let plan = refused.expect("root needs no user namespace");
            assert_eq!(plan.namespaces, Some(NamespacePlan { user: false }));
        } else {
            let err = refused.expect_err("refused without root");
            assert!(matches!(err, SandboxError::NoUserNamespace { .. }), "{err}");
            assert!(err.to_string().contains("unmapped"), "{err}");
        }
        // Without namespaces there is nothing to refuse.
        config.mode = SandboxMode::None;
        let plan = Plan::new(&config, walls(Some("never"))).expect("no namespaces");
        assert_eq!(plan.namespaces, None);
        assert_eq!(plan.config.seccomp, SeccompMode::default());
    }
}
