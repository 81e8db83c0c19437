//! privileges: resource limits, another identity, no capabilities.
//!
//! Started as root, the daemon takes another uid and gid (default
//! `nobody`/`nogroup`, 65534) with no supplementary groups; started as any
//! other user it keeps its identity (asking for another one is an error:
//! it could not be done). Either way it ends with:
//!
//! - no capabilities: effective, permitted and inheritable sets empty
//!   (`capset`), the ambient set cleared, and the bounding set emptied
//!   where the process may (`CAP_SETPCAP`; root may, others keep their
//!   bounding set, which `no_new_privs` makes meaningless: it only limits
//!   what `execve` of a file with capabilities could grant);
//! - `no_new_privs` (no set-uid or file-capability gain through `execve`,
//!   which seccomp forbids anyway);
//! - not dumpable: another process of the same uid (another tenant's vdev
//!   running as `nobody` too) cannot `ptrace` it or read its memory through
//!   `/proc`, and it leaves no core;
//! - resource limits, soft and hard (so they cannot be raised again):
//!   open files (`RLIMIT_NOFILE`), locked memory sized to the tenant's
//!   memory quota (`RLIMIT_MEMLOCK`), no core files (`RLIMIT_CORE` 0), and
//!   `RLIMIT_NICE` 0: no thread may raise its scheduling priority.
//!
//! `RLIMIT_NPROC` is deliberately not set: it counts every process and
//! thread of the *uid*, so with many vdevs sharing `nobody` one tenant's
//! threads would count against another's. New processes are stopped by
//! seccomp instead (`clone` only with `CLONE_THREAD`; no `fork`, no
//! `execve`).

use std::os::unix::fs::MetadataExt;
use std::path::Path;

/// A uid and gid to run as.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Identity {
    pub uid: u32,
    pub gid: u32,
}

/// `nobody`/`nogroup` on Debian and most distributions.
pub const NOBODY: Identity = Identity {
    uid: 65534,
    gid: 65534,
};

/// Why the privilege step failed.
#[derive(Debug, thiserror::Error)]
pub enum PrivilegeError {
    #[error("Cannot switch to uid {uid} gid {gid}: only a process started as root can")]
    NotRoot { uid: u32, gid: u32 },
    #[error("Cannot set {name} to {value}")]
    Limit {
        name: &'static str,
        value: u64,
        #[source]
        source: std::io::Error,
    },
    #[error("{step} failed")]
    Call {
        step: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("After dropping privileges, {0}")]
    Verify(String),
}

fn call(step: &'static str, rc: libc::c_int) -> Result<(), PrivilegeError> {
    if rc == 0 {
        Ok(())
    } else {
        Err(PrivilegeError::Call {
            step,
            source: crate::last_os_error(),
        })
    }
}

/// Whether the process runs with effective uid 0.
pub fn started_as_root() -> bool {
    // SAFETY: geteuid has no arguments and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

/// The identity to switch to: `requested` fields filled from [`NOBODY`]
/// when started as root; `None` (keep the current one) otherwise, where
/// asking for another identity is refused.
pub fn plan(
    started_as_root: bool,
    uid: Option<u32>,
    gid: Option<u32>,
) -> Result<Option<Identity>, PrivilegeError> {
    if started_as_root {
        return Ok(Some(Identity {
            uid: uid.unwrap_or(NOBODY.uid),
            gid: gid.unwrap_or(NOBODY.gid),
        }));
    }
    // SAFETY: getuid/getgid have no arguments and cannot fail.
    let (me_uid, me_gid) = unsafe { (libc::getuid(), libc::getgid()) };
    let want = Identity {
        uid: uid.unwrap_or(me_uid),
        gid: gid.unwrap_or(me_gid),
    };
    if want.uid != me_uid || want.gid != me_gid {
        return Err(PrivilegeError::NotRoot {
            uid: want.uid,
            gid: want.gid,
        });
    }
    Ok(None)
}

/// Resource limits to set (soft = hard).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ResourceLimits {
    /// Open descriptors.
    pub nofile: u64,
    /// Bytes of locked memory.
    pub memlock: u64,
}

/// Sets the limits (and `RLIMIT_CORE` to 0). A limit above the current
/// hard limit is lowered to it when the process may not raise it.
/// Returns the values in force.
pub fn set_limits(limits: ResourceLimits) -> Result<ResourceLimits, PrivilegeError> {
    set_limit("RLIMIT_CORE", libc::RLIMIT_CORE, 0)?;
    // No daemon thread changes its priority (no seccomp role has
    // `setpriority`); should one get the call anyway, it cannot use it to
    // take CPU from other tenants' threads.
    set_limit("RLIMIT_NICE", libc::RLIMIT_NICE, 0)?;
    Ok(ResourceLimits {
        nofile: set_limit("RLIMIT_NOFILE", libc::RLIMIT_NOFILE, limits.nofile)?,
        memlock: set_limit("RLIMIT_MEMLOCK", libc::RLIMIT_MEMLOCK, limits.memlock)?,
    })
}

fn set_limit(
    name: &'static str,
    resource: libc::__rlimit_resource_t,
    value: u64,
) -> Result<u64, PrivilegeError> {
    let err = |source| PrivilegeError::Limit {
        name,
        value,
        source,
    };
    let mut current = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one rlimit into `current`.
    if unsafe { libc::getrlimit(resource, &mut current) } != 0 {
        return Err(err(crate::last_os_error()));
    }
    let mut value = value;
    let wanted = libc::rlimit {
        rlim_cur: value,
        rlim_max: value,
    };
    // SAFETY: setrlimit reads one valid rlimit.
    if unsafe { libc::setrlimit(resource, &wanted) } != 0 {
        let e = crate::last_os_error();
        if e.raw_os_error() != Some(libc::EPERM) || value <= current.rlim_max {
            return Err(err(e));
        }
        // Not allowed to raise the hard limit: take it as it is.
        value = current.rlim_max;
        let capped = libc::rlimit {
            rlim_cur: value,
            rlim_max: value,
        };
        // SAFETY: as above.
        if unsafe { libc::setrlimit(resource, &capped) } != 0 {
            return Err(err(crate::last_os_error()));
        }
        tracing::warn!(
            limit = name,
            wanted = wanted.rlim_max,
            value,
            "Limit capped at the inherited hard limit"
        );
    }
    Ok(value)
}

/// What [`drop_privileges`] left in force, for the start-up log.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Dropped {
    pub uid: u32,
    pub gid: u32,
    /// Capabilities still in the bounding set (0 when it could be emptied).
    pub bounding_left: u32,
}

/// A daemon's privilege step: resource limits, then the switch to
/// `target` and no capabilities, no_new_privs, not dumpable; logs the
/// result.
pub fn apply(limits: ResourceLimits, target: Option<Identity>) -> Result<(), PrivilegeError> {
    let limits = set_limits(limits)?;
    let dropped = drop_privileges(target)?;
    tracing::info!(
        uid = dropped.uid,
        gid = dropped.gid,
        bounding_set_left = dropped.bounding_left,
        nofile = limits.nofile,
        memlock = limits.memlock,
        "Privileges dropped: no capabilities, no_new_privs, not dumpable, no core files"
    );
    Ok(())
}

/// Switches to `target` (if any) and drops every capability; sets
/// `no_new_privs` and makes the process non-dumpable. Verifies the result.
pub fn drop_privileges(target: Option<Identity>) -> Result<Dropped, PrivilegeError> {
    // The bounding set first: emptying it needs CAP_SETPCAP, which the uid
    // change below takes away.
    let bounding_left = drop_bounding_set();
    // SAFETY: PR_CAP_AMBIENT_CLEAR_ALL takes no pointers.
    let rc = unsafe {
        libc::prctl(
            libc::PR_CAP_AMBIENT,
            libc::PR_CAP_AMBIENT_CLEAR_ALL as libc::c_ulong,
            0 as libc::c_ulong,
            0 as libc::c_ulong,
            0 as libc::c_ulong,
        )
    };
    call("Clearing the ambient capabilities", rc)?;
    if let Some(id) = target {
        // SAFETY: zero groups: the pointer is not read.
        call("setgroups", unsafe { libc::setgroups(0, std::ptr::null()) })?;
        // SAFETY: plain integer arguments.
        call("setresgid", unsafe {
            libc::setresgid(id.gid, id.gid, id.gid)
        })?;
        // SAFETY: plain integer arguments.
        call("setresuid", unsafe {
            libc::setresuid(id.uid, id.uid, id.uid)
        })?;
    }
    // A non-root uid lost its capabilities with the switch; uid 0 (kept,
    // or chosen with --uid 0) and a user namespace still hold them.
    capset_empty()?;
    // SAFETY: PR_SET_NO_NEW_PRIVS takes integer arguments only.
    let rc = unsafe {
        libc::prctl(
            libc::PR_SET_NO_NEW_PRIVS,
            1 as libc::c_ulong,
            0 as libc::c_ulong,
            0 as libc::c_ulong,
            0 as libc::c_ulong,
        )
    };
    call("Setting no_new_privs", rc)?;
    // SAFETY: PR_SET_DUMPABLE takes integer arguments only.
    let rc = unsafe {
        libc::prctl(
            libc::PR_SET_DUMPABLE,
            0 as libc::c_ulong,
            0 as libc::c_ulong,
            0 as libc::c_ulong,
            0 as libc::c_ulong,
        )
    };
    call("Making the process non-dumpable", rc)?;
    verify(target, bounding_left)
}

fn verify(target: Option<Identity>, bounding_left: u32) -> Result<Dropped, PrivilegeError> {
    let (mut ruid, mut euid, mut suid) = (0, 0, 0);
    let (mut rgid, mut egid, mut sgid) = (0, 0, 0);
    // SAFETY: each call writes three ids into the given locations.
    let ok = unsafe {
        libc::getresuid(&mut ruid, &mut euid, &mut suid) == 0
            && libc::getresgid(&mut rgid, &mut egid, &mut sgid) == 0
    };
    if !ok {
        return Err(PrivilegeError::Verify(format!(
            "cannot read the ids back: {}",
            crate::last_os_error()
        )));
    }
    if let Some(id) = target {
        if [ruid, euid, suid] != [id.uid; 3] || [rgid, egid, sgid] != [id.gid; 3] {
            return Err(PrivilegeError::Verify(format!(
                "uids {ruid}/{euid}/{suid} gids {rgid}/{egid}/{sgid}, not {}:{}",
                id.uid, id.gid
            )));
        }
    }
    let caps = capget()?;
    if caps
        .iter()
        .any(|c| c.effective | c.permitted | c.inheritable != 0)
    {
        return Err(PrivilegeError::Verify(format!(
            "capabilities remain: {caps:?}"
        )));
    }
    Ok(Dropped {
        uid: euid,
        gid: egid,
        bounding_left,
    })
}

/// Empties the bounding set as far as allowed; returns how many
/// capabilities remain in it.
fn drop_bounding_set() -> u32 {
    let mut left = 0;
    for cap in 0..64 {
        // SAFETY: PR_CAPBSET_READ takes an integer; -1/EINVAL past the last
        // capability the kernel knows.
        let present = unsafe { libc::prctl(libc::PR_CAPBSET_READ, cap as libc::c_ulong) };
        if present < 0 {
            break;
        }
        if present == 0 {
            continue;
        }
        // SAFETY: PR_CAPBSET_DROP takes an integer.
        let rc = unsafe { libc::prctl(libc::PR_CAPBSET_DROP, cap as libc::c_ulong) };
        if rc != 0 {
            left += 1;
        }
    }
    left
}

/// `_LINUX_CAPABILITY_VERSION_3` of `<linux/capability.h>`: two 32-bit
/// data words per set.
const CAPABILITY_VERSION_3: u32 = 0x2008_0522;

/// `struct __user_cap_header_struct`.
#[repr(C)]
struct CapHeader {
    version: u32,
    pid: libc::c_int,
}

/// `struct __user_cap_data_struct`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct CapData {
    pub effective: u32,
    pub permitted: u32,
    pub inheritable: u32,
}

fn capset_empty() -> Result<(), PrivilegeError> {
    let mut header = CapHeader {
        version: CAPABILITY_VERSION_3,
        pid: 0,
    };
    let data = [CapData::default(); 2];
    // SAFETY: capset reads a v3 header and two data structs; pid 0 is the
    // calling thread.
    let rc = unsafe { libc::syscall(libc::SYS_capset, &mut header, data.as_ptr()) };
    call("capset", rc as libc::c_int)
}

/// The calling thread's capability sets.
pub fn capget() -> Result<[CapData; 2], PrivilegeError> {
    let mut header = CapHeader {
        version: CAPABILITY_VERSION_3,
        pid: 0,
    };
    let mut data = [CapData::default(); 2];
    // SAFETY: capget writes two data structs for a v3 header.
    let rc = unsafe { libc::syscall(libc::SYS_capget, &mut header, data.as_mut_ptr()) };
    call("capget", rc as libc::c_int)?;
    Ok(data)
}

impl Identity {
    /// Whether this identity (without capabilities and supplementary
    /// groups) passes the file-permission checks of `connect()` to the unix
    /// socket at `path`: search on every directory above it, write on the
    /// socket. Mode bits only (no ACLs): a hint for a clear start-up
    /// message, the connect itself is the real test.
    pub fn may_connect(&self, path: &Path) -> std::io::Result<bool> {
        self.may_reach(path, 0o2)
    }

    /// Whether this identity passes the file-permission checks of opening
    /// `path` read-only (hostd's policy file on reload): search on every
    /// directory above it, read on the file. Mode bits only, as above.
    pub fn may_read(&self, path: &Path) -> std::io::Result<bool> {
        self.may_reach(path, 0o4)
    }

    /// Search on every directory above `path`, `want` on `path` itself.
    fn may_reach(&self, path: &Path, want: u32) -> std::io::Result<bool> {
        if !self.allows(&std::fs::metadata(path)?, want) {
            return Ok(false);
        }
        let absolute = std::path::absolute(path)?;
        for dir in absolute.ancestors().skip(1) {
            if !self.allows(&std::fs::metadata(dir)?, 0o1) {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// Whether the `rwx` bits `want` (one of 4/2/1) of `meta` apply to us.
    fn allows(&self, meta: &std::fs::Metadata, want: u32) -> bool {
        let mode = meta.mode();
        let bits = if meta.uid() == self.uid {
            mode >> 6
        } else if meta.gid() == self.gid {
            mode >> 3
        } else {
            mode
        };
        bits & want != 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::daemon::testing::ScratchDir;

    #[test]
    fn root_switches_to_nobody_by_default_and_others_keep_their_identity() {
        assert_eq!(plan(true, None, None).expect("plan"), Some(NOBODY));
        assert_eq!(
            plan(true, Some(1000), None).expect("plan"),
            Some(Identity {
                uid: 1000,
                gid: 65534
            })
        );
        // SAFETY: getuid/getgid cannot fail.
        let (uid, gid) = unsafe { (libc::getuid(), libc::getgid()) };
        if uid != 0 {
            assert_eq!(plan(false, None, None).expect("plan"), None);
            assert_eq!(plan(false, Some(uid), Some(gid)).expect("plan"), None);
            assert!(matches!(
                plan(false, Some(uid.wrapping_add(1)), None),
                Err(PrivilegeError::NotRoot { .. })
            ));
        } else {
            // Pretending not to be root: asking for another uid is refused.
            assert!(matches!(
                plan(false, Some(12345), None),
                Err(PrivilegeError::NotRoot { .. })
            ));
            assert_eq!(plan(false, Some(0), Some(gid)).expect("plan"), None);
        }
    }

    fn chmod(path: &Path, mode: u32) {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).expect("chmod");
    }

    /// `may` (a check of [`Identity`]) on `path`, a socket or file in a
    /// test directory: its owner passes, and a stranger (another uid and
    /// gid) passes when `path` has mode `open` but not `closed`, nor once
    /// the directory above is closed to others.
    fn assert_mode_bits_decide(
        path: &Path,
        may: fn(&Identity, &Path) -> std::io::Result<bool>,
        closed: u32,
        open: u32,
    ) {
        let dir = path.parent().expect("test dir");
        chmod(dir, 0o755);
        let meta = std::fs::metadata(path).expect("stat");
        let owner = Identity {
            uid: meta.uid(),
            gid: meta.gid(),
        };
        let stranger = Identity {
            uid: meta.uid().wrapping_add(4242),
            gid: meta.gid().wrapping_add(4242),
        };
        chmod(path, closed);
        assert!(may(&owner, path).expect("check"));
        assert!(!may(&stranger, path).expect("check"));
        chmod(path, open);
        assert!(may(&stranger, path).expect("check"));
        chmod(dir, 0o700);
        assert!(!may(&stranger, path).expect("check"));
    }

    #[test]
    fn mode_bits_decide_who_may_connect() {
        let dir = ScratchDir::new("isolation-connect");
        let sock = dir.path().join("s.sock");
        let _listener = std::os::unix::net::UnixListener::bind(&sock).expect("bind");
        assert_mode_bits_decide(&sock, Identity::may_connect, 0o755, 0o777);
    }

    #[test]
    fn mode_bits_decide_who_may_read() {
        let dir = ScratchDir::new("isolation-read");
        let file = dir.write("policy.toml", b"");
        assert_mode_bits_decide(&file, Identity::may_read, 0o600, 0o644);
    }

    /// The whole drop, in a child process (it cannot be undone): as root,
    /// to nobody with nothing left; otherwise keeping the identity, with
    /// no capabilities.
    #[test]
    fn dropping_leaves_no_capabilities() {
        let root = started_as_root();
        let target = plan(root, None, None).expect("plan");
        // SAFETY: the child only makes system calls and leaves with _exit;
        // it allocates nothing (the plan is computed before the fork).
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork: {}", std::io::Error::last_os_error());
        if pid == 0 {
            let code = match drop_privileges(target) {
                Ok(d) if root && (d.uid, d.gid, d.bounding_left) != (65534, 65534, 0) => 3,
                Ok(_) => {
                    // SAFETY: integer arguments only.
                    let dumpable = unsafe { libc::prctl(libc::PR_GET_DUMPABLE, 0, 0, 0, 0) };
                    // SAFETY: integer arguments only.
                    let nnp = unsafe { libc::prctl(libc::PR_GET_NO_NEW_PRIVS, 0, 0, 0, 0) };
                    match (dumpable, nnp) {
                        (0, 1) => 0,
                        (0, _) => 4,
                        _ => 5,
                    }
                }
                Err(_) => 2,
            };
            // SAFETY: ends the child without running the test harness's
            // atexit handlers.
            unsafe { libc::_exit(code) };
        }
        let mut status = 0;
        // SAFETY: waits for our own child.
        let waited = unsafe { libc::waitpid(pid, &mut status, 0) };
        assert_eq!(waited, pid);
        assert!(libc::WIFEXITED(status), "child status {status:#x}");
        assert_eq!(libc::WEXITSTATUS(status), 0, "child failed");
    }
}
