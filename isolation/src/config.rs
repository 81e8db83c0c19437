//! The sandbox settings, the same in every vrdma daemon: the flags
//! ([`SandboxArgs`], flattened into each daemon's command line), the
//! `[sandbox]` table of its config file ([`SandboxFile`]), and the
//! validated result ([`SandboxConfig`]): flags over the file over the
//! defaults, users and groups resolved to numbers before the sandbox hides
//! the user database.
//!
//! One definition, so that `--seccomp`, `--landlock`, `--allow-no-landlock`,
//! `--sandbox`, `--uid`, `--gid` and `--rlimit-nofile` have the same names,
//! meaning and validation in vdev and hostd. What differs per daemon is a
//! default ([`SandboxConfig::resolve`] takes the open-file limit) and what
//! the walls are made of (see [`crate::sandbox`]).

use std::fmt;
use std::str::FromStr;

use serde::Deserialize;

use crate::namespaces::{NamespaceError, SandboxMode};
use crate::seccomp::{SeccompError, SeccompMode};

/// Smallest open-file limit accepted: a daemon needs its sockets, log and
/// a few eventfds.
pub const MIN_NOFILE: u64 = 64;
/// Largest open-file limit accepted (the kernel's default `nr_open`).
pub const MAX_NOFILE: u64 = 1 << 20;

/// Why the sandbox settings are refused.
#[derive(Debug, thiserror::Error)]
pub enum SandboxConfigError {
    #[error("Invalid sandbox mode")]
    Mode(#[source] NamespaceError),
    #[error("Invalid seccomp mode")]
    Seccomp(#[source] SeccompError),
    #[error("Unknown user {0:?}")]
    User(String),
    #[error("Unknown group {0:?}")]
    Group(String),
    #[error("Cannot look up {what} {name:?}")]
    Lookup {
        what: &'static str,
        name: String,
        #[source]
        source: std::io::Error,
    },
    #[error("Open-file limit {0} must be between {MIN_NOFILE} and {MAX_NOFILE}")]
    Nofile(u64),
}

/// The sandbox flags of every vrdma daemon.
#[derive(Debug, Clone, Default, PartialEq, Eq, clap::Args)]
pub struct SandboxArgs {
    /// What a system call outside the thread's seccomp allow-list does:
    /// `kill` the process (default), `trap` (the call fails with EPERM and
    /// is reported on stderr), `log` (allowed, logged by the kernel's
    /// audit), or `off` (no filter at all — never do this in production).
    #[arg(long, value_name = "kill|trap|log|off")]
    pub seccomp: Option<SeccompMode>,
    /// The landlock file-system wall: `on` (default) or `off`.
    #[arg(long, value_name = "on|off")]
    pub landlock: Option<OnOff>,
    /// Start even if the kernel cannot enforce landlock (default: refuse).
    #[arg(long)]
    pub allow_no_landlock: bool,
    /// Namespaces: `none` (default) or `namespace` (private mount, network
    /// and IPC namespaces with an empty root; see docs/security.md).
    #[arg(long, value_name = "none|namespace")]
    pub sandbox: Option<SandboxMode>,
    /// User to run as when started as root (name or number; default
    /// `nobody`, 65534).
    #[arg(long)]
    pub uid: Option<String>,
    /// Group to run as when started as root (name or number; default the
    /// user's primary group, `nogroup` (65534) for nobody).
    #[arg(long)]
    pub gid: Option<String>,
    /// Most open descriptors (RLIMIT_NOFILE, soft = hard; the default
    /// depends on the daemon).
    #[arg(long)]
    pub rlimit_nofile: Option<u64>,
}

/// `on` or `off`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OnOff(pub bool);

impl FromStr for OnOff {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "on" => Ok(OnOff(true)),
            "off" => Ok(OnOff(false)),
            other => Err(format!("expected on or off, not {other:?}")),
        }
    }
}

impl fmt::Display for OnOff {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(if self.0 { "on" } else { "off" })
    }
}

/// A user or group: a number or a name.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(untagged)]
pub enum IdSpec {
    Number(u32),
    Name(String),
}

impl From<String> for IdSpec {
    fn from(s: String) -> Self {
        match s.parse() {
            Ok(n) => IdSpec::Number(n),
            Err(_) => IdSpec::Name(s),
        }
    }
}

/// The `[sandbox]` table of a daemon's config file: the same keys as the
/// flags. Unknown keys are errors.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SandboxFile {
    mode: Option<String>,
    seccomp: Option<String>,
    landlock: Option<bool>,
    allow_no_landlock: Option<bool>,
    uid: Option<IdSpec>,
    gid: Option<IdSpec>,
    rlimit_nofile: Option<u64>,
}

/// The walls a daemon puts up around itself, validated (docs/security.md).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SandboxConfig {
    /// Namespaces.
    pub mode: SandboxMode,
    pub seccomp: SeccompMode,
    /// The landlock file-system wall.
    pub landlock: bool,
    /// Start on a kernel without landlock.
    pub allow_no_landlock: bool,
    /// uid/gid to run as when started as root (`None`: nobody/nogroup).
    pub uid: Option<u32>,
    pub gid: Option<u32>,
    pub rlimit_nofile: u64,
}

impl SandboxConfig {
    /// Every wall up, `nobody` when started as root, and `rlimit_nofile`
    /// open descriptors: what neither flags nor file change.
    pub fn defaults(rlimit_nofile: u64) -> SandboxConfig {
        SandboxConfig {
            mode: SandboxMode::None,
            seccomp: SeccompMode::default(),
            landlock: true,
            allow_no_landlock: false,
            uid: None,
            gid: None,
            rlimit_nofile,
        }
    }

    /// Flags over the `[sandbox]` table over the defaults (`default_nofile`
    /// open descriptors); users and groups resolved to numbers (before the
    /// sandbox hides /etc); the limit checked.
    pub fn resolve(
        args: &SandboxArgs,
        file: SandboxFile,
        default_nofile: u64,
    ) -> Result<SandboxConfig, SandboxConfigError> {
        let defaults = SandboxConfig::defaults(default_nofile);
        let mode = match (args.sandbox, file.mode) {
            (Some(mode), _) => mode,
            (None, Some(text)) => text.parse().map_err(SandboxConfigError::Mode)?,
            (None, None) => defaults.mode,
        };
        let seccomp = match (args.seccomp, file.seccomp) {
            (Some(mode), _) => mode,
            (None, Some(text)) => text.parse().map_err(SandboxConfigError::Seccomp)?,
            (None, None) => defaults.seccomp,
        };
        let uid_spec = args.uid.clone().map(IdSpec::from).or(file.uid);
        let gid_spec = args.gid.clone().map(IdSpec::from).or(file.gid);
        let (uid, primary_gid) = match uid_spec {
            Some(spec) => {
                let (uid, gid) = resolve_user(&spec)?;
                (Some(uid), gid)
            }
            None => (None, None),
        };
        let gid = match gid_spec {
            Some(spec) => Some(resolve_group(&spec)?),
            None => primary_gid,
        };
        let rlimit_nofile = args
            .rlimit_nofile
            .or(file.rlimit_nofile)
            .unwrap_or(defaults.rlimit_nofile);
        if !(MIN_NOFILE..=MAX_NOFILE).contains(&rlimit_nofile) {
            return Err(SandboxConfigError::Nofile(rlimit_nofile));
        }
        Ok(SandboxConfig {
            mode,
            seccomp,
            landlock: args
                .landlock
                .map(|OnOff(on)| on)
                .or(file.landlock)
                .unwrap_or(defaults.landlock),
            allow_no_landlock: args.allow_no_landlock
                || file.allow_no_landlock.unwrap_or(defaults.allow_no_landlock),
            uid,
            gid,
            rlimit_nofile,
        })
    }
}

/// A user's uid and, if it is in the user database, its primary gid.
fn resolve_user(spec: &IdSpec) -> Result<(u32, Option<u32>), SandboxConfigError> {
    let lookup = |source, name: &str| SandboxConfigError::Lookup {
        what: "user",
        name: name.to_owned(),
        source,
    };
    match spec {
        IdSpec::Number(uid) => {
            let entry = passwd_entry(|pwd, buf, result| {
                // SAFETY: every pointer is valid for the call; buf's length
                // is passed with it.
                unsafe { libc::getpwuid_r(*uid, pwd, buf.as_mut_ptr(), buf.len(), result) }
            })
            .map_err(|e| lookup(e, &uid.to_string()))?;
            Ok((*uid, entry.map(|(_, gid)| gid)))
        }
        IdSpec::Name(name) => {
            let c = std::ffi::CString::new(name.as_str())
                .map_err(|_| SandboxConfigError::User(name.clone()))?;
            let entry = passwd_entry(|pwd, buf, result| {
                // SAFETY: as above; `c` is a valid NUL-terminated name.
                unsafe { libc::getpwnam_r(c.as_ptr(), pwd, buf.as_mut_ptr(), buf.len(), result) }
            })
            .map_err(|e| lookup(e, name))?;
            let (uid, gid) = entry.ok_or_else(|| SandboxConfigError::User(name.clone()))?;
            Ok((uid, Some(gid)))
        }
    }
}

/// Runs a `getpw*_r` call; `Some((uid, gid))` if the user exists.
fn passwd_entry(
    f: impl Fn(*mut libc::passwd, &mut [libc::c_char], *mut *mut libc::passwd) -> libc::c_int,
) -> Result<Option<(u32, u32)>, std::io::Error> {
    // SAFETY: passwd is plain data; all-zero is valid and is overwritten.
    let mut pwd: libc::passwd = unsafe { std::mem::zeroed() };
    let mut buf = vec![0 as libc::c_char; 16 * 1024];
    let mut result: *mut libc::passwd = std::ptr::null_mut();
    let rc = f(&mut pwd, &mut buf, &mut result);
    if rc != 0 {
        return Err(std::io::Error::from_raw_os_error(rc));
    }
    Ok((!result.is_null()).then_some((pwd.pw_uid, pwd.pw_gid)))
}

fn resolve_group(spec: &IdSpec) -> Result<u32, SandboxConfigError> {
    let name = match spec {
        IdSpec::Number(gid) => return Ok(*gid),
        IdSpec::Name(name) => name,
    };
    let c = std::ffi::CString::new(name.as_str())
        .map_err(|_| SandboxConfigError::Group(name.clone()))?;
    // SAFETY: group is plain data; all-zero is valid and is overwritten.
    let mut grp: libc::group = unsafe { std::mem::zeroed() };
    let mut buf = vec![0 as libc::c_char; 16 * 1024];
    let mut result: *mut libc::group = std::ptr::null_mut();
    // SAFETY: every pointer is valid for the call; buf's length is passed.
    let rc = unsafe {
        libc::getgrnam_r(
            c.as_ptr(),
            &mut grp,
            buf.as_mut_ptr(),
            buf.len(),
            &mut result,
        )
    };
    if rc != 0 {
        return Err(SandboxConfigError::Lookup {
            what: "group",
            name: name.clone(),
            source: std::io::Error::from_raw_os_error(rc),
        });
    }
    if result.is_null() {
        return Err(SandboxConfigError::Group(name.clone()));
    }
    Ok(grp.gr_gid)
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;
    use crate::daemon::testing::EVERY_SANDBOX_FLAG;
    use crate::seccomp::ViolationAction;

    /// A command line of nothing but the sandbox flags.
    #[derive(Debug, Parser)]
    struct Cli {
        #[command(flatten)]
        sandbox: SandboxArgs,
    }

    fn resolve(args: &[&str], file: &str) -> Result<SandboxConfig, SandboxConfigError> {
        let cli = Cli::try_parse_from(std::iter::once("daemon").chain(args.iter().copied()))
            .expect("clap accepts");
        let file: SandboxFile = toml::from_str(file).expect("valid table");
        SandboxConfig::resolve(&cli.sandbox, file, 1024)
    }

    #[test]
    fn nothing_given_is_every_wall_up() {
        let config = resolve(&[], "").expect("valid");
        assert_eq!(config, SandboxConfig::defaults(1024));
        assert_eq!(config.seccomp, SeccompMode::Enforce(ViolationAction::Kill));
        assert!(config.landlock && !config.allow_no_landlock);
        assert_eq!(config.mode, SandboxMode::None);
    }

    #[test]
    fn flags_and_file_keys() {
        let config = resolve(EVERY_SANDBOX_FLAG, "").expect("valid");
        assert_eq!(
            config,
            SandboxConfig {
                mode: SandboxMode::Namespace,
                seccomp: SeccompMode::Enforce(ViolationAction::Trap),
                landlock: false,
                allow_no_landlock: true,
                uid: Some(65534),
                gid: Some(65534),
                rlimit_nofile: 4096,
            }
        );
        let config = resolve(&["--seccomp", "off", "--uid", "1234"], "").expect("valid");
        assert_eq!(config.seccomp, SeccompMode::Off);
        assert_eq!((config.uid, config.gid), (Some(1234), None));

        let file = "mode = \"namespace\"\nseccomp = \"log\"\nuid = 4000\ngid = \"nogroup\"\n";
        let config = resolve(&[], file).expect("valid");
        assert_eq!(config.mode, SandboxMode::Namespace);
        assert_eq!(config.seccomp, SeccompMode::Enforce(ViolationAction::Log));
        assert_eq!((config.uid, config.gid), (Some(4000), Some(65534)));
        // Flags win over the file.
        let config = resolve(&["--seccomp", "kill", "--gid", "7"], file).expect("valid");
        assert_eq!(config.seccomp, SeccompMode::default());
        assert_eq!(config.gid, Some(7));
    }

    #[test]
    fn bad_values_are_refused() {
        for args in [
            &["--seccomp", "allow"][..],
            &["--landlock", "maybe"],
            &["--sandbox", "chroot"],
        ] {
            let parsed = Cli::try_parse_from(std::iter::once("daemon").chain(args.iter().copied()));
            assert!(parsed.is_err(), "{args:?}");
        }
        assert!(matches!(
            resolve(&["--uid", "no-such-user-here"], ""),
            Err(SandboxConfigError::User(_))
        ));
        assert!(matches!(
            resolve(&["--gid", "no-such-group-here"], ""),
            Err(SandboxConfigError::Group(_))
        ));
        assert!(matches!(
            resolve(&["--rlimit-nofile", "3"], ""),
            Err(SandboxConfigError::Nofile(3))
        ));
        assert!(matches!(
            resolve(&[], "seccomp = \"nope\"\n"),
            Err(SandboxConfigError::Seccomp(_))
        ));
        assert!(matches!(
            resolve(&[], "mode = \"chroot\"\n"),
            Err(SandboxConfigError::Mode(_))
        ));
        assert!(toml::from_str::<SandboxFile>("landlok = true\n").is_err());
    }
}
