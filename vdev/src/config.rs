//! vdev configuration: command line and file, validated into [`Config`].
//!
//! The command line (clap) names a config file and may override its most
//! used keys; the file (TOML, serde) holds the rest. Both are untrusted: the
//! result is validated into a [`Config`] that derives `PartialEq`, so tests
//! compare what a command line means with what they expect.

use std::path::{Path, PathBuf};

use clap::Parser;
use serde::Deserialize;
use vrdma_isolation::namespaces::SandboxMode;
use vrdma_isolation::seccomp::SeccompMode;
use vrdma_tenant_policy::{Limits, LimitsError};

/// Largest virtqueue size vdev accepts (the split-ring maximum).
const MAX_QUEUE_SIZE: u16 = 32768;
/// Largest number of completion vectors (event queues).
const MAX_COMP_VECTORS: u16 = 64;

/// Why a configuration is refused.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("Cannot read config file {path}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("Invalid config file {path}")]
    Parse {
        path: PathBuf,
        #[source]
        source: Box<toml::de::Error>,
    },
    #[error("Invalid path {}", path.display())]
    Path {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("No vhost-user socket given (--socket or `socket` in the config file)")]
    NoSocket,
    #[error("Tenant name {0:?} must be 1-64 characters of [A-Za-z0-9_.-]")]
    TenantName(String),
    #[error("Queue size {0} must be a power of two between 2 and {MAX_QUEUE_SIZE}")]
    QueueSize(u16),
    #[error("Completion vectors {0} must be between 1 and {MAX_COMP_VECTORS}")]
    CompVectors(u16),
    #[error("Port LID {0:#x} must be a unicast LID (0x1-0xbfff)")]
    Lid(u16),
    #[error("Invalid limits")]
    Limits(#[source] LimitsError),
    #[error("Invalid sandbox mode")]
    Sandbox(#[source] vrdma_isolation::namespaces::NamespaceError),
    #[error("Invalid seccomp mode")]
    Seccomp(#[source] vrdma_isolation::seccomp::SeccompError),
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

/// Command line of `vdev`.
#[derive(Debug, Parser)]
#[command(
    version,
    about = "vrdma vdev: the vhost-user backend of one tenant's virtual RDMA device"
)]
pub struct Args {
    /// Path of the vhost-user unix socket to listen on.
    #[arg(long)]
    pub socket: Option<PathBuf>,
    /// TOML config file (see docs/operations.md); flags override its keys.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Tenant this device belongs to (appears on every log line).
    #[arg(long)]
    pub tenant: Option<String>,
    /// The port's LID (unique per device on a host).
    #[arg(long)]
    pub lid: Option<u16>,
    /// Number of completion vectors (event queues).
    #[arg(long)]
    pub comp_vectors: Option<u16>,
    /// hostd's socket: attach the device to the host's fabric (without it
    /// the device has a control path but no peer to reach).
    #[arg(long)]
    pub hostd: Option<PathBuf>,
    /// Serve one frontend connection, then exit (default: serve again after
    /// each disconnect, as a VM reboot or a restarted application needs).
    #[arg(long)]
    pub once: bool,
    /// What a system call outside vdev's seccomp allow-list does: `kill`
    /// the process (default), `trap` (the call fails with EPERM and is
    /// reported), `log` (allowed, logged by the kernel's audit), or `off`
    /// (no filter at all — never do this in production).
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
    /// user's primary group, `nogroup` for nobody).
    #[arg(long)]
    pub gid: Option<String>,
    /// Most open descriptors (RLIMIT_NOFILE; default 1024).
    #[arg(long)]
    pub rlimit_nofile: Option<u64>,
}

/// `on` or `off`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OnOff(pub bool);

impl std::str::FromStr for OnOff {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "on" => Ok(OnOff(true)),
            "off" => Ok(OnOff(false)),
            other => Err(format!("expected on or off, not {other:?}")),
        }
    }
}

/// A user or group: a number or a name.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(untagged)]
enum IdSpec {
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

/// The `[sandbox]` table of the config file (the flags override it).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileSandbox {
    /// `none` or `namespace`.
    mode: Option<String>,
    /// `kill`, `trap`, `log` or `off`.
    seccomp: Option<String>,
    landlock: Option<bool>,
    allow_no_landlock: Option<bool>,
    uid: Option<IdSpec>,
    gid: Option<IdSpec>,
    rlimit_nofile: Option<u64>,
}

/// The config file. Every key is optional; unknown keys are errors.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileConfig {
    socket: Option<PathBuf>,
    tenant: Option<String>,
    lid: Option<u16>,
    comp_vectors: Option<u16>,
    queue_size: Option<u16>,
    hostd: Option<PathBuf>,
    #[serde(default)]
    limits: Limits,
    #[serde(default)]
    sandbox: FileSandbox,
}

/// A validated vdev configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    pub socket: PathBuf,
    pub tenant: String,
    pub lid: u16,
    pub comp_vectors: u16,
    pub queue_size: u16,
    pub limits: Limits,
    pub hostd: Option<PathBuf>,
    pub once: bool,
    pub sandbox: SandboxConfig,
}

/// The walls vdev puts up around itself (docs/security.md).
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

impl Default for SandboxConfig {
    fn default() -> Self {
        SandboxConfig {
            mode: SandboxMode::None,
            seccomp: SeccompMode::default(),
            landlock: true,
            allow_no_landlock: false,
            uid: None,
            gid: None,
            rlimit_nofile: DEFAULT_NOFILE,
        }
    }
}

/// Open descriptors: enough for every queue's kick and call eventfds (and
/// their copies lent to hostd) and the memory slots of the largest device.
pub const DEFAULT_NOFILE: u64 = 1024;
const MIN_NOFILE: u64 = 64;
const MAX_NOFILE: u64 = 1 << 20;

/// Defaults for what neither the file nor the flags say.
pub const DEFAULT_TENANT: &str = "default";
pub const DEFAULT_LID: u16 = 1;
pub const DEFAULT_COMP_VECTORS: u16 = 1;
pub const DEFAULT_QUEUE_SIZE: u16 = 256;

impl TryFrom<Args> for Config {
    type Error = ConfigError;

    fn try_from(args: Args) -> Result<Self, ConfigError> {
        let file = match &args.config {
            Some(path) => read_file(path)?,
            None => FileConfig::default(),
        };
        let sandbox = sandbox_config(&args, file.sandbox)?;
        let config = Config {
            socket: args.socket.or(file.socket).ok_or(ConfigError::NoSocket)?,
            tenant: args
                .tenant
                .or(file.tenant)
                .unwrap_or_else(|| DEFAULT_TENANT.into()),
            lid: args.lid.or(file.lid).unwrap_or(DEFAULT_LID),
            comp_vectors: args
                .comp_vectors
                .or(file.comp_vectors)
                .unwrap_or(DEFAULT_COMP_VECTORS),
            queue_size: file.queue_size.unwrap_or(DEFAULT_QUEUE_SIZE),
            limits: file.limits,
            // Absolute: the namespace sandbox changes the working directory.
            hostd: args
                .hostd
                .or(file.hostd)
                .map(|p| {
                    std::path::absolute(&p).map_err(|source| ConfigError::Path { path: p, source })
                })
                .transpose()?,
            once: args.once,
            sandbox,
        };
        config.validate()?;
        Ok(config)
    }
}

/// Flags over the `[sandbox]` table over the defaults; users and groups
/// resolved to numbers (before the sandbox hides /etc).
fn sandbox_config(args: &Args, file: FileSandbox) -> Result<SandboxConfig, ConfigError> {
    let defaults = SandboxConfig::default();
    let mode = match (args.sandbox, file.mode) {
        (Some(mode), _) => mode,
        (None, Some(text)) => text.parse().map_err(ConfigError::Sandbox)?,
        (None, None) => defaults.mode,
    };
    let seccomp = match (args.seccomp, file.seccomp) {
        (Some(mode), _) => mode,
        (None, Some(text)) => text.parse().map_err(ConfigError::Seccomp)?,
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
        return Err(ConfigError::Nofile(rlimit_nofile));
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

/// A user's uid and, if it is in the user database, its primary gid.
fn resolve_user(spec: &IdSpec) -> Result<(u32, Option<u32>), ConfigError> {
    let lookup = |source, name: &str| ConfigError::Lookup {
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
                .map_err(|_| ConfigError::User(name.clone()))?;
            let entry = passwd_entry(|pwd, buf, result| {
                // SAFETY: as above; `c` is a valid NUL-terminated name.
                unsafe { libc::getpwnam_r(c.as_ptr(), pwd, buf.as_mut_ptr(), buf.len(), result) }
            })
            .map_err(|e| lookup(e, name))?;
            let (uid, gid) = entry.ok_or_else(|| ConfigError::User(name.clone()))?;
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

fn resolve_group(spec: &IdSpec) -> Result<u32, ConfigError> {
    let name = match spec {
        IdSpec::Number(gid) => return Ok(*gid),
        IdSpec::Name(name) => name,
    };
    let c = std::ffi::CString::new(name.as_str()).map_err(|_| ConfigError::Group(name.clone()))?;
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
        return Err(ConfigError::Lookup {
            what: "group",
            name: name.clone(),
            source: std::io::Error::from_raw_os_error(rc),
        });
    }
    if result.is_null() {
        return Err(ConfigError::Group(name.clone()));
    }
    Ok(grp.gr_gid)
}

fn read_file(path: &Path) -> Result<FileConfig, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
        path: path.to_owned(),
        source,
    })?;
    toml::from_str(&text).map_err(|source| ConfigError::Parse {
        path: path.to_owned(),
        source: Box::new(source),
    })
}

impl Config {
    fn validate(&self) -> Result<(), ConfigError> {
        let name_ok = (1..=64).contains(&self.tenant.len())
            && self
                .tenant
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"_.-".contains(&b));
        if !name_ok {
            return Err(ConfigError::TenantName(self.tenant.clone()));
        }
        if !self.queue_size.is_power_of_two() || !(2..=MAX_QUEUE_SIZE).contains(&self.queue_size) {
            return Err(ConfigError::QueueSize(self.queue_size));
        }
        if !(1..=MAX_COMP_VECTORS).contains(&self.comp_vectors) {
            return Err(ConfigError::CompVectors(self.comp_vectors));
        }
        if !(0x1..=0xbfff).contains(&self.lid) {
            return Err(ConfigError::Lid(self.lid));
        }
        self.limits.validate().map_err(ConfigError::Limits)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<Config, ConfigError> {
        Config::try_from(
            Args::try_parse_from(std::iter::once("vdev").chain(args.iter().copied()))
                .expect("clap accepts"),
        )
    }

    #[test]
    fn flags_alone_give_defaults() {
        let config = parse(&["--socket", "/tmp/a.sock"]).expect("valid");
        assert_eq!(
            config,
            Config {
                socket: "/tmp/a.sock".into(),
                tenant: DEFAULT_TENANT.into(),
                lid: DEFAULT_LID,
                comp_vectors: DEFAULT_COMP_VECTORS,
                queue_size: DEFAULT_QUEUE_SIZE,
                limits: Limits::default(),
                hostd: None,
                once: false,
                sandbox: SandboxConfig::default(),
            }
        );
        // The sandbox is on unless a flag says otherwise.
        let sandbox = SandboxConfig::default();
        assert_eq!(sandbox.seccomp, SeccompMode::default());
        assert!(sandbox.landlock && !sandbox.allow_no_landlock);
    }

    #[test]
    fn sandbox_flags_and_file_keys() {
        use vrdma_isolation::seccomp::ViolationAction;
        let config = parse(&[
            "--socket",
            "/s",
            "--seccomp",
            "trap",
            "--landlock",
            "off",
            "--allow-no-landlock",
            "--sandbox",
            "namespace",
            "--uid",
            "nobody",
            "--rlimit-nofile",
            "4096",
        ])
        .expect("valid");
        assert_eq!(
            config.sandbox,
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
        let config =
            parse(&["--socket", "/s", "--seccomp", "off", "--uid", "1234"]).expect("valid");
        assert_eq!(config.sandbox.seccomp, SeccompMode::Off);
        assert_eq!((config.sandbox.uid, config.sandbox.gid), (Some(1234), None));
        assert!(Args::try_parse_from(["vdev", "--socket", "/s", "--seccomp", "allow"]).is_err());
        assert!(Args::try_parse_from(["vdev", "--socket", "/s", "--landlock", "maybe"]).is_err());
        assert!(matches!(
            parse(&["--socket", "/s", "--uid", "no-such-user-here"]),
            Err(ConfigError::User(_))
        ));
        assert!(matches!(
            parse(&["--socket", "/s", "--rlimit-nofile", "3"]),
            Err(ConfigError::Nofile(3))
        ));

        let dir = std::env::temp_dir().join(format!("vdev-sandbox-config-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let path = dir.join("vdev.toml");
        std::fs::write(
            &path,
            "socket = \"/s\"\n[sandbox]\nmode = \"namespace\"\nseccomp = \"log\"\nuid = 4000\ngid = \"nogroup\"\n",
        )
        .expect("write");
        let file = path.to_str().expect("utf8");
        let config = parse(&["--config", file]).expect("valid");
        assert_eq!(config.sandbox.mode, SandboxMode::Namespace);
        assert_eq!(
            config.sandbox.seccomp,
            SeccompMode::Enforce(ViolationAction::Log)
        );
        assert_eq!(
            (config.sandbox.uid, config.sandbox.gid),
            (Some(4000), Some(65534))
        );
        let config = parse(&["--config", file, "--seccomp", "kill"]).expect("valid");
        assert_eq!(config.sandbox.seccomp, SeccompMode::default());
        std::fs::write(&path, "socket = \"/s\"\n[sandbox]\nseccomp = \"nope\"\n").expect("write");
        assert!(matches!(
            parse(&["--config", file]),
            Err(ConfigError::Seccomp(_))
        ));
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn flags_override_the_file() {
        let dir = std::env::temp_dir().join(format!("vdev-config-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let path = dir.join("vdev.toml");
        std::fs::write(
            &path,
            "socket = \"/run/x.sock\"\ntenant = \"blue\"\nlid = 7\n[limits]\nmax_qp = 4\n",
        )
        .expect("write");
        let config =
            parse(&["--config", path.to_str().expect("utf8"), "--lid", "9"]).expect("valid");
        assert_eq!(config.socket, PathBuf::from("/run/x.sock"));
        assert_eq!(config.tenant, "blue");
        assert_eq!(config.lid, 9);
        assert_eq!(config.limits.max_qp, 4);
        std::fs::write(&path, "socket = \"/x\"\nlimitz = 1\n").expect("write");
        let err = parse(&["--config", path.to_str().expect("utf8")]).expect_err("unknown key");
        let chain = format!(
            "{err}: {}",
            std::error::Error::source(&err).expect("source")
        );
        assert!(
            chain.contains("limitz") && chain.contains("vdev.toml"),
            "{chain}"
        );
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn bad_values_are_refused() {
        assert!(matches!(parse(&[]), Err(ConfigError::NoSocket)));
        assert!(matches!(
            parse(&["--socket", "/s", "--tenant", "a b"]),
            Err(ConfigError::TenantName(_))
        ));
        assert!(matches!(
            parse(&["--socket", "/s", "--lid", "0"]),
            Err(ConfigError::Lid(0))
        ));
        assert!(matches!(
            parse(&["--socket", "/s", "--comp-vectors", "0"]),
            Err(ConfigError::CompVectors(0))
        ));
    }

    /// vdev has no datapath thread any more (hostd reads the rings), so
    /// its polling and CPU-priority settings are gone, and a file or
    /// command line still naming them is refused rather than ignored.
    #[test]
    fn datapath_settings_are_refused() {
        assert!(Args::try_parse_from(["vdev", "--socket", "/s", "--class-cpu-priority"]).is_err());
        let dir = std::env::temp_dir().join(format!("vdev-datapath-keys-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let path = dir.join("vdev.toml");
        for key in ["spin_us = 200", "class_cpu_priority = true"] {
            std::fs::write(&path, format!("socket = \"/s\"\n{key}\n")).expect("write");
            let err = parse(&["--config", path.to_str().expect("utf8")]).expect_err(key);
            assert!(matches!(err, ConfigError::Parse { .. }), "{key}: {err}");
        }
        std::fs::remove_dir_all(&dir).ok();
    }
}
