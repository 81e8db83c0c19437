//! `vrdma-demo`: see vrdma work without RDMA hardware or a VM.
//!
//! The demo starts `hostd` (the host's NIC, on its embedded default
//! configuration: tenants `alpha` and `beta` in network `demo`) and one
//! `vdev` per tenant, each a separate process on a unix socket in a scratch
//! directory, the vdevs configured from the demo's built-in file
//! (`tests/src/demo.toml`). This process then plays both tenants'
//! applications: it opens each device through the guest driver in process
//! mode, as vdev's vhost-user frontend.
//!
//! On alpha's device it walks the control path one step at a time: device,
//! limits, port and GID; a protection domain; application memory
//! registered in place; a CQ and a QP taken RESET → INIT → RTR → RTS towards
//! beta's QP, each state read back from the device; one operation the
//! device refuses. Then RDMA between the tenants, every result checked byte
//! for byte on the other side: an RDMA WRITE into beta's memory, an RDMA
//! READ back, a SEND with immediate data into a receive beta posted, an
//! atomic fetch-and-add, and a write with a made-up rkey that fails and
//! leaves beta's memory alone. Last, teardown and the daemons' exit. It ends
//! with "vrdma demo: OK" and exit status 0; any failure prints the error
//! chain and the end of the daemons' logs, and exits with status 1.

use std::error::Error as StdError;
use std::ffi::OsString;
use std::fmt::{self, Display};
use std::fs::File;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitCode, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use clap::Parser;
use vrdma_guest_driver::vrdma_spec::config::{DeviceAttr, PortAttr};
use vrdma_guest_driver::vrdma_spec::control::QpAttr;
use vrdma_guest_driver::vrdma_spec::qp_state::mask;
use vrdma_guest_driver::vrdma_spec::ring::send_flags::SIGNALED;
use vrdma_guest_driver::vrdma_spec::verbs::{
    access, LinkLayer, Mtu, PortState, QpState, QpType, SendOpcode, WcOpcode, WcStatus,
};
use vrdma_guest_driver::{
    CompletionQueue, Context, MemoryRegion, ProtectionDomain, QpCapabilities, QpInitAttr,
    QueuePair, RecvWr, SendPayload, SendWr, Sge, WorkCompletion,
};
use vrdma_tenant_policy::Limits;

/// The vdev configuration the demo runs with unless `--config` names another.
const DEFAULT_CONFIG: &str = include_str!("../demo.toml");
/// The two tenants of hostd's embedded default configuration.
const ALPHA: &str = "alpha";
const BETA: &str = "beta";
/// Bytes of application memory alpha registers, and writes into beta's MR.
const BUFFER_LEN: usize = 2 * 4096;
/// What the application memory is filled with.
const PATTERN: &[u8] = b"vrdma-demo ";
/// How long a daemon may take to listen, and a vdev to exit once the demo
/// closed its device.
const DAEMON_TIMEOUT: Duration = Duration::from_secs(10);
/// How long the demo polls a CQ for a completion.
const CQ_TIMEOUT: Duration = Duration::from_secs(5);
/// How many lines of each daemon's log a failure shows.
const LOG_TAIL: usize = 12;

/// Layout of beta's MR: the RDMA WRITE lands at 0, then a receive buffer,
/// then an 8-byte counter for the atomic.
const BETA_MR_LEN: usize = BUFFER_LEN + 4096;
const RECV_OFFSET: usize = BUFFER_LEN;
const RECV_LEN: u32 = 256;
const COUNTER_OFFSET: usize = BUFFER_LEN + 1024;
/// Layout of alpha's second MR: the RDMA READ lands at 0, then the message
/// alpha sends, the value the atomic fetches, and the bytes of the write
/// with a made-up rkey.
const LANDING_LEN: usize = BUFFER_LEN + 4096;
const MESSAGE_OFFSET: usize = BUFFER_LEN;
const FETCHED_OFFSET: usize = BUFFER_LEN + 1024;
const INTRUDER_OFFSET: usize = BUFFER_LEN + 2048;
const INTRUDER_LEN: usize = 64;

/// What alpha sends, with which immediate data.
const MESSAGE: &[u8] = b"hello beta, this is alpha";
const IMM: u32 = 0x1234_abcd;
/// Beta's counter before alpha's fetch-and-add, and what alpha adds.
const COUNTER_START: u64 = 41;
const COUNTER_ADD: u64 = 1;

/// Work request ids.
const WR_WRITE: u64 = 1;
const WR_READ: u64 = 2;
const WR_SEND: u64 = 3;
const WR_FETCH_ADD: u64 = 4;
const WR_BAD_RKEY: u64 = 5;
const WR_RECV: u64 = 100;

/// Remote access both QPs grant their peer.
const QP_ACCESS: u32 = access::REMOTE_WRITE | access::REMOTE_READ | access::REMOTE_ATOMIC;

/// Command line of `vrdma-demo`.
#[derive(Debug, Parser)]
#[command(
    version,
    about = "Starts hostd and a vdev for tenants alpha and beta, opens both virtual \
             RDMA devices through the guest driver (process mode), walks through the \
             verbs control path and runs RDMA between the two tenants"
)]
struct Args {
    /// Keep the scratch directory (configuration, sockets and daemons' logs)
    /// and print where it is. It is always kept when the demo fails once a
    /// daemon ran.
    #[arg(long)]
    keep: bool,
    /// The hostd binary to run (default: `hostd` next to this executable).
    #[arg(long, value_name = "PATH")]
    hostd: Option<PathBuf>,
    /// The vdev binary to run (default: `vdev` next to this executable).
    #[arg(long, value_name = "PATH")]
    vdev: Option<PathBuf>,
    /// A vdev config file to use instead of the built-in one (the demo
    /// passes --socket, --tenant and --hostd, which override its keys).
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
}

fn main() -> ExitCode {
    let args = Args::parse();
    match run(&args) {
        Ok(()) => {
            println!("vrdma demo: OK");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("vrdma demo: FAILED: {}", vrdma_errors::error_chain(&e));
            if let Some(logs) = &e.daemon_logs {
                eprintln!("{logs}");
            }
            ExitCode::FAILURE
        }
    }
}

// ---------------------------------------------------------------------------
// Errors: what the demo was doing, and why it failed.
// ---------------------------------------------------------------------------

/// A failure with what the demo was doing when it happened.
#[derive(Debug)]
struct Failure {
    what: String,
    source: Option<Box<dyn StdError + Send + Sync + 'static>>,
    /// The end of the daemons' logs, when daemons were running.
    daemon_logs: Option<String>,
}

impl Failure {
    fn new(what: impl Into<String>) -> Self {
        Self {
            what: what.into(),
            source: None,
            daemon_logs: None,
        }
    }

    fn caused_by(what: impl Into<String>, source: impl StdError + Send + Sync + 'static) -> Self {
        Self {
            source: Some(Box::new(source)),
            ..Self::new(what)
        }
    }
}

impl Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.what)
    }
}

impl StdError for Failure {
    fn source(&self) -> Option<&(dyn StdError + 'static)> {
        self.source
            .as_deref()
            .map(|e| e as &(dyn StdError + 'static))
    }
}

/// Adds what the demo was doing to an error.
trait Doing<T> {
    fn doing(self, what: impl Into<String>) -> Result<T, Failure>;
}

impl<T, E: StdError + Send + Sync + 'static> Doing<T> for Result<T, E> {
    fn doing(self, what: impl Into<String>) -> Result<T, Failure> {
        self.map_err(|e| Failure::caused_by(what, e))
    }
}

/// The symbolic name of the errnos vrdma answers with.
fn errno_name(errno: i32) -> &'static str {
    match errno {
        libc::EINVAL => "EINVAL",
        libc::EBUSY => "EBUSY",
        libc::ENOMEM => "ENOMEM",
        libc::EFAULT => "EFAULT",
        libc::EACCES => "EACCES",
        libc::EOPNOTSUPP => "EOPNOTSUPP",
        libc::EMSGSIZE => "EMSGSIZE",
        libc::ETIMEDOUT => "ETIMEDOUT",
        _ => "errno",
    }
}

/// `EBUSY (16, Device or resource busy)`
fn describe_errno(errno: i32) -> String {
    let text = std::io::Error::from_raw_os_error(errno).to_string();
    let text = text.split(" (os error").next().unwrap_or_default();
    format!("{} ({errno}, {text})", errno_name(errno))
}

// ---------------------------------------------------------------------------
// Output.
// ---------------------------------------------------------------------------

fn heading(n: u32, title: &str) {
    println!("[{n}] {title}");
}

fn say(label: &str, text: impl Display) {
    println!("    {label:<10} {text}");
}

fn gid_text(gid: &[u8; 16]) -> String {
    gid.chunks(2)
        .map(|pair| format!("{:02x}{:02x}", pair[0], pair[1]))
        .collect::<Vec<_>>()
        .join(":")
}

fn bytes_text(n: u64) -> String {
    match n {
        n if n >= 1 << 30 && n % (1 << 30) == 0 => format!("{} GiB", n >> 30),
        n if n >= 1 << 20 && n % (1 << 20) == 0 => format!("{} MiB", n >> 20),
        n if n >= 1 << 10 && n % (1 << 10) == 0 => format!("{} KiB", n >> 10),
        n => format!("{n} B"),
    }
}

fn access_text(flags: u32) -> String {
    let names = [
        (access::LOCAL_WRITE, "LOCAL_WRITE"),
        (access::REMOTE_WRITE, "REMOTE_WRITE"),
        (access::REMOTE_READ, "REMOTE_READ"),
        (access::REMOTE_ATOMIC, "REMOTE_ATOMIC"),
    ];
    let set: Vec<&str> = names
        .iter()
        .filter(|(bit, _)| flags & bit != 0)
        .map(|(_, name)| *name)
        .collect();
    if set.is_empty() {
        "none".into()
    } else {
        set.join("|")
    }
}

fn state_name(raw: u8) -> String {
    QpState::try_from(raw)
        .map_or_else(|v| format!("unknown state {v}"), |s| format!("{s:?}"))
        .to_uppercase()
}

fn mtu_text(raw: u8) -> String {
    Mtu::try_from(raw).map_or_else(|v| format!("invalid MTU {v}"), |m| m.bytes().to_string())
}

/// A verbs enum the way libibverbs spells it: `RdmaWrite` → `RDMA_WRITE`.
fn verbs_name(value: impl fmt::Debug) -> String {
    let name = format!("{value:?}");
    let mut out = String::with_capacity(name.len() + 4);
    for (i, c) in name.chars().enumerate() {
        if i > 0 && c.is_ascii_uppercase() {
            out.push('_');
        }
        out.push(c.to_ascii_uppercase());
    }
    out
}

/// `RDMA_WRITE SUCCESS`
fn wc_text(wc: &WorkCompletion) -> String {
    match wc.opcode {
        Some(opcode) => format!("{} {}", verbs_name(opcode), verbs_name(wc.status)),
        None => verbs_name(wc.status),
    }
}

/// The start of `bytes` as text, for a line of output.
fn preview(bytes: &[u8]) -> String {
    const SHOWN: usize = 33;
    let text = String::from_utf8_lossy(&bytes[..bytes.len().min(SHOWN)]);
    if bytes.len() > SHOWN {
        format!("{text:?}...")
    } else {
        format!("{text:?}")
    }
}

// ---------------------------------------------------------------------------
// The configuration and the scratch directory.
// ---------------------------------------------------------------------------

/// The vdev configuration, as text and as the demo reads it.
#[derive(Debug)]
struct DemoConfig {
    text: String,
    origin: String,
    limits: Limits,
}

fn load_config(path: Option<&Path>) -> Result<DemoConfig, Failure> {
    let (text, origin) = match path {
        Some(path) => (
            std::fs::read_to_string(path)
                .doing(format!("reading the config file {}", path.display()))?,
            path.display().to_string(),
        ),
        None => (DEFAULT_CONFIG.to_owned(), "built-in configuration".into()),
    };
    let table: toml::Table = text
        .parse()
        .doing(format!("parsing the vdev configuration ({origin})"))?;
    let limits = match table.get("limits") {
        Some(value) => value.clone().try_into::<Limits>().doing(format!(
            "reading [limits] of the vdev configuration ({origin})"
        ))?,
        None => Limits::default(),
    };
    Ok(DemoConfig {
        limits,
        origin,
        text,
    })
}

/// The demo's directory for the configuration, sockets and logs; removed on
/// drop unless kept.
#[derive(Debug)]
struct Scratch {
    path: PathBuf,
    keep: bool,
}

impl Scratch {
    fn create(keep: bool) -> Result<Self, Failure> {
        let path = std::env::temp_dir().join(format!("vrdma-demo-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&path);
        std::fs::create_dir_all(&path)
            .doing(format!("creating the scratch directory {}", path.display()))?;
        Ok(Self { path, keep })
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        if !self.keep {
            let _ = std::fs::remove_dir_all(&self.path);
        }
    }
}

// ---------------------------------------------------------------------------
// The daemons: separate processes.
// ---------------------------------------------------------------------------

/// `name` next to this executable (`target/<profile>/vdev` for
/// `target/<profile>/vrdma-demo`).
fn next_to_this_executable(name: &str) -> Result<PathBuf, Failure> {
    let exe = std::env::current_exe().doing("finding this executable")?;
    let dir = exe
        .parent()
        .ok_or_else(|| Failure::new("this executable has no directory"))?;
    Ok(dir.join(name))
}

/// The binary `--flag` names, or `name` next to this executable; it must
/// exist before anything is started.
fn find_binary(given: Option<&Path>, name: &str, package: &str) -> Result<PathBuf, Failure> {
    let binary = match given {
        Some(path) => path.to_owned(),
        None => next_to_this_executable(name)?,
    };
    if binary.is_file() {
        return Ok(binary);
    }
    Err(Failure::new(format!(
        "{name} binary {} not found: build it (`cargo build -p {package} --bin {name}`, \
         with the same profile as vrdma-demo) or pass --{name} PATH",
        binary.display()
    )))
}

/// A running daemon; killed on drop if it is still running.
#[derive(Debug)]
struct Daemon {
    /// `hostd`, `vdev alpha`, ...
    name: String,
    child: Child,
    socket: PathBuf,
    log: PathBuf,
}

impl Daemon {
    /// Starts `binary --socket <socket> <args>`, logging to `log`; does not
    /// wait for it to listen.
    fn spawn(
        name: &str,
        binary: &Path,
        socket: PathBuf,
        log: PathBuf,
        args: &[OsString],
    ) -> Result<Self, Failure> {
        let log_file = File::create(&log).doing(format!("creating {}", log.display()))?;
        let child = Command::new(binary)
            .arg("--socket")
            .arg(&socket)
            .args(args)
            .env("VRDMA_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log_file)
            .spawn()
            .doing(format!("starting {name} ({})", binary.display()))?;
        Ok(Self {
            name: name.to_owned(),
            child,
            socket,
            log,
        })
    }

    fn wait_for_socket(&mut self) -> Result<(), Failure> {
        let deadline = Instant::now() + DAEMON_TIMEOUT;
        while !self.socket.exists() {
            if let Some(status) = self.child.try_wait().doing("checking on a daemon")? {
                return Err(Failure::new(format!(
                    "{} exited with {status} before listening",
                    self.name
                )));
            }
            if Instant::now() >= deadline {
                return Err(Failure::new(format!(
                    "{} did not listen on {} within {DAEMON_TIMEOUT:?}",
                    self.name,
                    self.socket.display()
                )));
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        Ok(())
    }

    /// Waits for the daemon to exit on its own (a vdev runs with `--once`).
    fn wait_for_exit(&mut self) -> Result<ExitStatus, Failure> {
        let deadline = Instant::now() + DAEMON_TIMEOUT;
        loop {
            if let Some(status) = self.child.try_wait().doing("checking on a daemon")? {
                return Ok(status);
            }
            if Instant::now() >= deadline {
                return Err(Failure::new(format!(
                    "{} did not exit within {DAEMON_TIMEOUT:?}",
                    self.name
                )));
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Stops a daemon that serves until it is stopped (hostd) with SIGTERM.
    fn terminate(&mut self) -> Result<ExitStatus, Failure> {
        if let Some(status) = self.child.try_wait().doing("checking on a daemon")? {
            return Err(Failure::new(format!(
                "{} had already exited, with {status}",
                self.name
            )));
        }
        let pid = libc::pid_t::try_from(self.child.id()).doing("the daemon's pid")?;
        // SAFETY: kill(2) touches no memory of this process. `pid` is our
        // child, not yet reaped (try_wait just saw it running), so the pid
        // cannot have been reused by another process.
        if unsafe { libc::kill(pid, libc::SIGTERM) } != 0 {
            return Err(Failure::caused_by(
                format!("sending SIGTERM to {}", self.name),
                std::io::Error::last_os_error(),
            ));
        }
        self.wait_for_exit()
    }

    /// The last lines of the daemon's log.
    fn log_tail(&self) -> String {
        let log = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = log.lines().collect();
        let tail = if lines.is_empty() {
            "(empty)".to_owned()
        } else {
            lines[lines.len().saturating_sub(LOG_TAIL)..].join("\n    ")
        };
        format!(
            "{} log ({}), last lines:\n    {tail}",
            self.name,
            self.log.display()
        )
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
        }
        let _ = self.child.wait();
    }
}

/// `status 0`, `signal 15 (SIGTERM)`
fn exit_text(status: ExitStatus) -> String {
    match (status.code(), status.signal()) {
        (Some(code), _) => format!("status {code}"),
        (None, Some(libc::SIGTERM)) => "signal 15 (SIGTERM)".to_owned(),
        _ => status.to_string(),
    }
}

/// hostd and the vdevs the demo started; the vdevs are killed before hostd
/// on drop (a failure), if they still run.
#[derive(Debug, Default)]
struct Daemons {
    hostd: Option<Daemon>,
    vdevs: Vec<Daemon>,
}

impl Daemons {
    /// Starts hostd on its embedded default configuration.
    fn start_hostd(&mut self, binary: &Path, dir: &Path) -> Result<&Daemon, Failure> {
        let hostd = Daemon::spawn(
            "hostd",
            binary,
            dir.join("hostd.sock"),
            dir.join("hostd.log"),
            &[],
        )?;
        let hostd = self.hostd.insert(hostd);
        if let Err(e) = hostd.wait_for_socket() {
            return Err(self.with_logs(e));
        }
        self.hostd
            .as_ref()
            .ok_or_else(|| Failure::new("hostd vanished"))
    }

    /// Starts a vdev for `tenant` attached to hostd, with the demo's config
    /// file; it exits once the application closes its device (`--once`).
    fn start_vdev(
        &mut self,
        binary: &Path,
        dir: &Path,
        tenant: &str,
        config: &Path,
    ) -> Result<&Daemon, Failure> {
        let hostd_socket = self
            .hostd
            .as_ref()
            .map(|h| h.socket.clone())
            .ok_or_else(|| Failure::new("hostd is not running"))?;
        let args: Vec<OsString> = vec![
            "--tenant".into(),
            tenant.into(),
            "--hostd".into(),
            hostd_socket.into(),
            "--config".into(),
            config.into(),
            "--once".into(),
        ];
        let vdev = Daemon::spawn(
            &format!("vdev {tenant}"),
            binary,
            dir.join(format!("{tenant}.sock")),
            dir.join(format!("{tenant}.log")),
            &args,
        )?;
        self.vdevs.push(vdev);
        let index = self.vdevs.len() - 1;
        if let Err(e) = self.vdevs[index].wait_for_socket() {
            return Err(self.with_logs(e));
        }
        Ok(&self.vdevs[index])
    }

    /// `failure`, with the end of every daemon's log attached.
    fn with_logs(&self, failure: Failure) -> Failure {
        if failure.daemon_logs.is_some() {
            return failure;
        }
        let logs: Vec<String> = self
            .hostd
            .iter()
            .chain(&self.vdevs)
            .map(Daemon::log_tail)
            .collect();
        Failure {
            daemon_logs: (!logs.is_empty()).then(|| logs.join("\n")),
            ..failure
        }
    }

    /// The last step: each vdev exits once its application closed the
    /// device (`--once`); hostd serves until it is stopped, with SIGTERM.
    fn stop(&mut self, step: u32) -> Result<(), Failure> {
        heading(step, "Stop the daemons");
        for index in 0..self.vdevs.len() {
            let status = match self.vdevs[index].wait_for_exit() {
                Ok(status) => status,
                Err(e) => return Err(self.with_logs(e)),
            };
            let vdev = &self.vdevs[index];
            if !status.success() {
                return Err(
                    self.with_logs(Failure::new(format!("{} exited with {status}", vdev.name)))
                );
            }
            say(
                "vdev",
                format!(
                    "{}: pid {} exited with {} once its application closed the device (--once)",
                    vdev.name.trim_start_matches("vdev "),
                    vdev.child.id(),
                    exit_text(status)
                ),
            );
        }
        let Some(hostd) = self.hostd.as_mut() else {
            return Ok(());
        };
        let status = match hostd.terminate() {
            Ok(status) => status,
            Err(e) => return Err(self.with_logs(e)),
        };
        if !status.success() && status.signal() != Some(libc::SIGTERM) {
            return Err(self.with_logs(Failure::new(format!(
                "hostd exited with {status} on SIGTERM"
            ))));
        }
        let pid = self.hostd.as_ref().map_or(0, |h| h.child.id());
        say(
            "hostd",
            format!(
                "pid {pid} exited with {}, which the demo sent: hostd serves until stopped",
                exit_text(status)
            ),
        );
        Ok(())
    }
}

// ---------------------------------------------------------------------------
// The demo, step by step.
// ---------------------------------------------------------------------------

fn run(args: &Args) -> Result<(), Failure> {
    let config = load_config(args.config.as_deref())?;
    let hostd = find_binary(args.hostd.as_deref(), "hostd", "vrdma-hostd")?;
    let vdev = find_binary(args.vdev.as_deref(), "vdev", "vrdma-vdev")?;
    println!(
        "vrdma demo: RDMA between two tenants, {ALPHA} and {BETA}, each with its own virtual \
         RDMA device"
    );
    println!(
        "    hostd plays the host's NIC, one vdev per tenant serves its device, and this \
         process is"
    );
    println!(
        "    both tenants' application, through the guest driver in process mode. No RDMA \
         hardware, no VM."
    );
    let mut scratch = Scratch::create(args.keep)?;
    let mut daemons = Daemons::default();
    let result = with_daemons(&mut daemons, &hostd, &vdev, &config, &scratch.path);
    // Whatever still runs is killed here, vdevs first.
    drop(daemons);
    if result.is_err() {
        scratch.keep = true;
    }
    if scratch.keep {
        println!("    (scratch directory kept: {})", scratch.path.display());
    }
    result
}

/// Step 1 and the last: the daemons' lives around the applications'.
fn with_daemons(
    daemons: &mut Daemons,
    hostd_binary: &Path,
    vdev_binary: &Path,
    config: &DemoConfig,
    dir: &Path,
) -> Result<(), Failure> {
    heading(1, "Start hostd, then a vdev for each tenant");
    let config_path = dir.join("demo.toml");
    std::fs::write(&config_path, &config.text)
        .doing(format!("writing {}", config_path.display()))?;
    let hostd = daemons.start_hostd(hostd_binary, dir)?;
    say(
        "hostd",
        format!(
            "pid {} on {}; embedded config: tenants {ALPHA}, {BETA} in network \"demo\"",
            hostd.child.id(),
            hostd.socket.display()
        ),
    );
    say(
        "config",
        format!(
            "vdev's {} written to {}; --tenant and --hostd given as flags",
            config.origin,
            config_path.display()
        ),
    );
    let mut sockets = Vec::new();
    for tenant in [ALPHA, BETA] {
        let vdev = daemons.start_vdev(vdev_binary, dir, tenant, &config_path)?;
        say(
            "vdev",
            format!(
                "{tenant}: pid {} on {}, attached to hostd",
                vdev.child.id(),
                vdev.socket.display()
            ),
        );
        sockets.push(vdev.socket.clone());
    }

    applications(&sockets[0], &sockets[1], config).map_err(|e| daemons.with_logs(e))?;

    daemons.stop(15)
}

/// What the two tenants' RDMA applications do, from opening the devices to
/// closing them.
fn applications(alpha: &Path, beta: &Path, config: &DemoConfig) -> Result<(), Failure> {
    let ctx = open_device(alpha, config)?;
    let pd = alloc_pd(&ctx)?;
    let (buffer, mr) = register_memory(&pd)?;
    let (cq, qp) = create_queues(&ctx, &pd)?;
    let peer = open_beta(beta)?;
    connect(&ctx, &qp, &peer)?;
    let pd = refused_operation(pd)?;

    let alpha = Requester { qp: &qp, cq: &cq };
    rdma_write(&alpha, &buffer, &mr, &peer)?;
    let landing = rdma_read(&alpha, &pd, &buffer, &peer)?;
    send_with_immediate(&alpha, &landing, &peer)?;
    fetch_and_add(&alpha, &landing, &peer)?;
    made_up_rkey(&alpha, [&mr, &landing], &peer)?;

    teardown(ctx, pd, buffer, mr, landing, cq, qp, peer)
}

/// Step 2: open alpha's device; show what it is and what it allows.
fn open_device(socket: &Path, config: &DemoConfig) -> Result<Context, Failure> {
    heading(
        2,
        "Open alpha's device (this process is vdev's vhost-user frontend)",
    );
    let ctx = Context::open_vhost_user(socket)
        .doing(format!("opening alpha's device at {}", socket.display()))?;
    let name = ctx.config().name().unwrap_or("?").to_owned();
    say(
        "device",
        format!("{name}, {} completion vector(s)", ctx.num_comp_vectors()),
    );
    let dev = ctx.query_device().doing("query_device")?;
    show_device(&dev, &config.limits)?;
    let port = ctx.query_port(1).doing("query_port")?;
    show_port(&port)?;
    let gid = ctx.query_gid(1, 0).doing("query_gid")?;
    say("GID 0", gid_text(&gid.gid));
    Ok(ctx)
}

fn show_device(dev: &DeviceAttr, limits: &Limits) -> Result<(), Failure> {
    let fw = dev.fw_ver.get();
    say(
        "identity",
        format!(
            "firmware {}.{}, vendor {:#06x} part {:#06x}, node GUID {:#018x}",
            fw >> 32,
            fw & 0xffff_ffff,
            dev.vendor_id.get(),
            dev.vendor_part_id.get(),
            dev.node_guid.get()
        ),
    );
    say(
        "limits",
        format!(
            "{} PDs, {} QPs of {} WRs x {} SGEs ({} inline bytes), {} CQs of {} CQEs",
            dev.max_pd.get(),
            dev.max_qp.get(),
            dev.max_qp_wr.get(),
            dev.max_sge.get(),
            dev.max_inline_data.get(),
            dev.max_cq.get(),
            dev.max_cqe.get()
        ),
    );
    say(
        "",
        format!(
            "{} MRs of up to {} ({} in all), {} RDMA reads/atomics in flight per QP",
            dev.max_mr.get(),
            bytes_text(dev.max_mr_size.get()),
            bytes_text(dev.max_total_mr_bytes.get()),
            dev.max_qp_rd_atom.get()
        ),
    );
    let advertised = [
        (
            "max_pd",
            u64::from(dev.max_pd.get()),
            u64::from(limits.max_pd),
        ),
        ("max_qp", dev.max_qp.get().into(), limits.max_qp.into()),
        ("max_cq", dev.max_cq.get().into(), limits.max_cq.into()),
        ("max_mr", dev.max_mr.get().into(), limits.max_mr.into()),
        (
            "max_cq_depth",
            dev.max_cqe.get().into(),
            limits.max_cq_depth.into(),
        ),
        (
            "max_qp_depth",
            dev.max_qp_wr.get().into(),
            limits.max_qp_depth.into(),
        ),
        ("max_sge", dev.max_sge.get().into(), limits.max_sge.into()),
        (
            "max_inline_data",
            dev.max_inline_data.get().into(),
            limits.max_inline_data.into(),
        ),
        (
            "max_rd_atomic",
            dev.max_qp_rd_atom.get().into(),
            limits.max_rd_atomic.into(),
        ),
        ("max_mr_bytes", dev.max_mr_size.get(), limits.max_mr_bytes),
        (
            "max_total_mr_bytes",
            dev.max_total_mr_bytes.get(),
            limits.max_total_mr_bytes,
        ),
    ];
    for (key, device, configured) in advertised {
        if device != configured {
            return Err(Failure::new(format!(
                "the device advertises {key} = {device}, the configuration says {configured}"
            )));
        }
    }
    say("", "(exactly the [limits] of the tenant's configuration)");
    Ok(())
}

fn port_state_text(port: &PortAttr) -> String {
    PortState::try_from(port.state).map_or_else(
        |v| format!("state {v}"),
        |s| format!("{s:?}").to_uppercase(),
    )
}

fn show_port(port: &PortAttr) -> Result<(), Failure> {
    let state = port_state_text(port);
    let link = match LinkLayer::try_from(port.link_layer) {
        Ok(LinkLayer::Infiniband) => "InfiniBand".to_owned(),
        Ok(other) => format!("{other:?}"),
        Err(v) => format!("link layer {v}"),
    };
    say(
        "port 1",
        format!(
            "{state}, LID {} (assigned by hostd), MTU {} (max {}), {link}",
            port.lid.get(),
            mtu_text(port.active_mtu),
            mtu_text(port.max_mtu)
        ),
    );
    if port.state != u8::from(PortState::Active) {
        return Err(Failure::new(format!("port 1 is {state}, not ACTIVE")));
    }
    Ok(())
}

/// Step 3: a protection domain.
fn alloc_pd(ctx: &Context) -> Result<ProtectionDomain, Failure> {
    heading(3, "Allocate a protection domain");
    let pd = ctx.alloc_pd().doing("alloc_pd")?;
    say("PD", format!("pdn {}", pd.pdn()));
    Ok(pd)
}

/// Page-aligned application memory from `posix_memalign`, freed on drop.
#[derive(Debug)]
struct AppBuffer {
    ptr: *mut u8,
    len: usize,
}

impl AppBuffer {
    fn new(len: usize) -> Result<Self, Failure> {
        let mut p: *mut libc::c_void = std::ptr::null_mut();
        // SAFETY: `p` is a valid out-pointer; 4096 is a power of two and a
        // multiple of the pointer size.
        let rc = unsafe { libc::posix_memalign(&mut p, 4096, len) };
        if rc != 0 {
            return Err(Failure::caused_by(
                format!("posix_memalign of {len} bytes"),
                std::io::Error::from_raw_os_error(rc),
            ));
        }
        Ok(Self { ptr: p.cast(), len })
    }

    fn fill(&self, pattern: &[u8]) {
        for i in 0..self.len {
            // SAFETY: `i` is inside the allocation; only this thread uses it.
            unsafe { self.ptr.add(i).write(pattern[i % pattern.len()]) };
        }
    }

    fn read(&self, len: usize) -> Vec<u8> {
        let len = len.min(self.len);
        let mut out = vec![0u8; len];
        // SAFETY: `[ptr, ptr + len)` is inside the allocation and nothing
        // writes it concurrently (the device only reads it: no peer is
        // given its rkey).
        unsafe { std::ptr::copy_nonoverlapping(self.ptr, out.as_mut_ptr(), len) };
        out
    }
}

impl Drop for AppBuffer {
    fn drop(&mut self) {
        // SAFETY: allocated by posix_memalign in `new`, freed exactly once,
        // after the MR over it was deregistered (see `teardown`).
        unsafe { libc::free(self.ptr.cast()) };
    }
}

/// Step 4: register application memory in place.
fn register_memory(pd: &ProtectionDomain) -> Result<(AppBuffer, MemoryRegion), Failure> {
    heading(4, "Register application memory");
    let buffer = AppBuffer::new(BUFFER_LEN)?;
    buffer.fill(PATTERN);
    say(
        "buffer",
        format!(
            "{} at {:p}, page-aligned (posix_memalign), filled with {:?}",
            bytes_text(BUFFER_LEN as u64),
            buffer.ptr,
            String::from_utf8_lossy(PATTERN)
        ),
    );
    let flags = access::LOCAL_WRITE | access::REMOTE_WRITE | access::REMOTE_READ;
    // SAFETY: the buffer is this process's mapped memory, used by this
    // thread only, and outlives the MR (deregistered first in `teardown`).
    let mr = unsafe { pd.reg_mr(buffer.ptr, buffer.len, flags) }.doing("reg_mr")?;
    say(
        "MR",
        format!(
            "lkey {:#010x}, rkey {:#010x}, iova {:#x}, access {}",
            mr.lkey(),
            mr.rkey(),
            mr.iova(),
            access_text(flags)
        ),
    );
    // The pages now live on shared memory vdev maps; the pointer still works.
    let seen = buffer.read(3 * PATTERN.len());
    let through_mr = mr_bytes(&mr, 0, seen.len())?;
    if seen != PATTERN.repeat(3) || through_mr != seen {
        return Err(Failure::new(format!(
            "registered memory changed: the application reads {:?}, the MR {:?}",
            String::from_utf8_lossy(&seen),
            String::from_utf8_lossy(&through_mr)
        )));
    }
    say(
        "in place",
        format!(
            "the application's pointer still reads {:?}; its pages are now shared with vdev",
            String::from_utf8_lossy(&seen)
        ),
    );
    Ok((buffer, mr))
}

/// An RC QP on `pd` with `cq` for both queues.
fn create_rc_qp(pd: &ProtectionDomain, cq: &CompletionQueue) -> Result<QueuePair, Failure> {
    pd.create_qp(&QpInitAttr {
        send_cq: cq,
        recv_cq: cq,
        cap: QpCapabilities {
            max_send_wr: 16,
            max_recv_wr: 16,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: 64,
        },
        qp_type: QpType::Rc,
        sq_sig_all: false,
    })
    .doing("create_qp")
}

/// Step 5: a completion queue and an RC queue pair.
fn create_queues(
    ctx: &Context,
    pd: &ProtectionDomain,
) -> Result<(CompletionQueue, QueuePair), Failure> {
    heading(5, "Create a completion queue and a queue pair");
    let cq = ctx.create_cq(64, 0).doing("create_cq")?;
    say(
        "CQ",
        format!(
            "cqn {}, {} entries, completion vector {}",
            cq.cqn(),
            cq.depth(),
            cq.comp_vector()
        ),
    );
    let qp = create_rc_qp(pd, &cq)?;
    let cap = qp.cap();
    say(
        "QP",
        format!(
            "qpn {:#08x} (RC); granted: send {} WRs x {} SGEs, recv {} WRs x {} SGEs, {} inline bytes",
            qp.qp_num(),
            cap.max_send_wr,
            cap.max_send_sge,
            cap.max_recv_wr,
            cap.max_recv_sge,
            cap.max_inline_data
        ),
    );
    Ok((cq, qp))
}

/// Beta's application: its device, and the objects alpha works with. Fields
/// drop in order, the QP first and the device last.
#[derive(Debug)]
struct Peer {
    qp: QueuePair,
    cq: CompletionQueue,
    mr: MemoryRegion,
    pd: ProtectionDomain,
    ctx: Context,
    /// The port's LID, from beta's query_port.
    lid: u16,
}

/// Step 6: beta opens its device and creates what alpha will use: an MR
/// alpha may write, read and update atomically, a CQ and a QP.
fn open_beta(socket: &Path) -> Result<Peer, Failure> {
    heading(
        6,
        "Open beta's device, with a PD, an MR for alpha to use, a CQ and a QP",
    );
    let ctx = Context::open_vhost_user(socket)
        .doing(format!("opening beta's device at {}", socket.display()))?;
    let port = ctx.query_port(1).doing("beta's query_port")?;
    let state = port_state_text(&port);
    if port.state != u8::from(PortState::Active) {
        return Err(Failure::new(format!(
            "beta's port 1 is {state}, not ACTIVE"
        )));
    }
    let lid = port.lid.get();
    say(
        "device",
        format!(
            "{}, port 1 {state}, LID {lid} (from beta's query_port)",
            ctx.config().name().unwrap_or("?")
        ),
    );
    let pd = ctx.alloc_pd().doing("beta's alloc_pd")?;
    let flags =
        access::LOCAL_WRITE | access::REMOTE_WRITE | access::REMOTE_READ | access::REMOTE_ATOMIC;
    let mr = pd.alloc_mr(BETA_MR_LEN, flags).doing("beta's alloc_mr")?;
    say(
        "MR",
        format!(
            "{} (alloc_mr), rkey {:#010x}, iova {:#x}, access {}",
            bytes_text(BETA_MR_LEN as u64),
            mr.rkey(),
            mr.iova(),
            access_text(flags)
        ),
    );
    let cq = ctx.create_cq(64, 0).doing("beta's create_cq")?;
    let qp = create_rc_qp(&pd, &cq).map_err(|e| Failure {
        what: format!("beta's {}", e.what),
        ..e
    })?;
    say(
        "QP",
        format!(
            "qpn {:#08x} (RC), on PD {} and CQ {}",
            qp.qp_num(),
            pd.pdn(),
            cq.cqn()
        ),
    );
    Ok(Peer {
        qp,
        cq,
        mr,
        pd,
        ctx,
        lid,
    })
}

const INIT_MASK: u32 = mask::STATE | mask::PKEY_INDEX | mask::PORT | mask::ACCESS_FLAGS;
const RTR_MASK: u32 = mask::STATE
    | mask::AV
    | mask::PATH_MTU
    | mask::DEST_QPN
    | mask::RQ_PSN
    | mask::MAX_DEST_RD_ATOMIC
    | mask::MIN_RNR_TIMER;
const RTS_MASK: u32 = mask::STATE
    | mask::SQ_PSN
    | mask::TIMEOUT
    | mask::RETRY_CNT
    | mask::RNR_RETRY
    | mask::MAX_QP_RD_ATOMIC;

fn init_attr() -> QpAttr {
    QpAttr {
        qp_state: QpState::Init.into(),
        port_num: 1,
        qp_access_flags: QP_ACCESS.into(),
        ..QpAttr::default()
    }
}

fn rtr_attr(dest_qpn: u32, dlid: u16) -> QpAttr {
    let mut rtr = QpAttr {
        qp_state: QpState::Rtr.into(),
        path_mtu: Mtu::Mtu4096.into(),
        dest_qp_num: dest_qpn.into(),
        rq_psn: 0.into(),
        max_dest_rd_atomic: 1,
        min_rnr_timer: 12,
        ..QpAttr::default()
    };
    rtr.ah_attr.dlid = dlid.into();
    rtr.ah_attr.port_num = 1;
    rtr
}

fn rts_attr() -> QpAttr {
    QpAttr {
        qp_state: QpState::Rts.into(),
        sq_psn: 0.into(),
        timeout: 14,
        retry_cnt: 7,
        rnr_retry: 7,
        max_rd_atomic: 1,
        ..QpAttr::default()
    }
}

/// The QP's state, as the device reports it.
fn qp_state(qp: &QueuePair, whose: &str) -> Result<u8, Failure> {
    Ok(qp
        .query(0)
        .doing(format!("{whose}'s query_qp"))?
        .attr
        .qp_state)
}

/// Applies one transition and prints the state the device reports back.
fn transition(qp: &QueuePair, attr: &QpAttr, attr_mask: u32, detail: &str) -> Result<(), Failure> {
    let wanted = state_name(attr.qp_state);
    qp.modify(attr, attr_mask)
        .doing(format!("modify_qp to {wanted}"))?;
    let now = qp_state(qp, ALPHA)?;
    if now != attr.qp_state {
        return Err(Failure::new(format!(
            "the QP went to {wanted} but the device reports {}",
            state_name(now)
        )));
    }
    say(&state_name(now), detail);
    Ok(())
}

/// Step 7: alpha's QP RESET → INIT → RTR → RTS towards beta's QP, then
/// beta's towards alpha's the same way.
fn connect(ctx: &Context, qp: &QueuePair, peer: &Peer) -> Result<(), Failure> {
    heading(
        7,
        "Connect alpha's QP to beta's: RESET -> INIT -> RTR -> RTS (as queried back from vdev)",
    );
    let created = qp_state(qp, ALPHA)?;
    say(&state_name(created), "as created");
    transition(
        qp,
        &init_attr(),
        INIT_MASK,
        &format!(
            "port 1, P_Key index 0, remote access {}",
            access_text(QP_ACCESS)
        ),
    )?;
    transition(
        qp,
        &rtr_attr(peer.qp.qp_num(), peer.lid),
        RTR_MASK,
        &format!(
            "remote QP {:#08x} (beta's) at LID {} (beta's port), path MTU 4096",
            peer.qp.qp_num(),
            peer.lid
        ),
    )?;
    transition(
        qp,
        &rts_attr(),
        RTS_MASK,
        "ready to send: timeout 14, retry 7, RNR retry 7",
    )?;

    let alpha_lid = ctx.query_port(1).doing("alpha's query_port")?.lid.get();
    let steps = [
        (init_attr(), INIT_MASK),
        (rtr_attr(qp.qp_num(), alpha_lid), RTR_MASK),
        (rts_attr(), RTS_MASK),
    ];
    for (attr, attr_mask) in steps {
        peer.qp
            .modify(&attr, attr_mask)
            .doing(format!("beta's modify_qp to {}", state_name(attr.qp_state)))?;
    }
    let state = qp_state(&peer.qp, BETA)?;
    if state != u8::from(QpState::Rts) {
        return Err(Failure::new(format!(
            "beta's QP went to RTS but the device reports {}",
            state_name(state)
        )));
    }
    say(
        "beta",
        format!(
            "its QP {:#08x} went the same way to {} (queried), towards alpha's QP {:#08x} at LID {alpha_lid}",
            peer.qp.qp_num(),
            state_name(state),
            qp.qp_num()
        ),
    );
    Ok(())
}

/// Step 8: the device refuses to destroy a PD that still has an MR and a
/// QP; the driver hands the PD back.
fn refused_operation(pd: ProtectionDomain) -> Result<ProtectionDomain, Failure> {
    heading(8, "An operation the device refuses");
    let pdn = pd.pdn();
    match pd.destroy() {
        Ok(()) => Err(Failure::new(format!(
            "the device destroyed PD {pdn} although its MR and QP exist"
        ))),
        Err(refusal) if refusal.errno() == libc::EBUSY => {
            say(
                "refused",
                format!(
                    "dealloc_pd of PD {pdn} while its MR and QP exist -> {}, as it should; \
                     the PD is handed back",
                    describe_errno(refusal.errno())
                ),
            );
            Ok(refusal.object)
        }
        Err(refusal) => Err(Failure::caused_by(
            format!(
                "dealloc_pd of a busy PD gave {}, not EBUSY",
                describe_errno(refusal.errno())
            ),
            refusal.error,
        )),
    }
}

// ---------------------------------------------------------------------------
// RDMA between the tenants.
// ---------------------------------------------------------------------------

/// Alpha's side of the connection: where it posts and polls.
#[derive(Debug, Clone, Copy)]
struct Requester<'a> {
    qp: &'a QueuePair,
    cq: &'a CompletionQueue,
}

/// `len` bytes of `mr` at `offset`.
fn mr_bytes(mr: &MemoryRegion, offset: usize, len: usize) -> Result<Vec<u8>, Failure> {
    let mut out = vec![0u8; len];
    mr.read(offset, &mut out)
        .doing(format!("reading {len} bytes of an MR at offset {offset}"))?;
    Ok(out)
}

/// Fails unless `got` is `want`, byte for byte.
fn same_bytes(what: &str, got: &[u8], want: &[u8]) -> Result<(), Failure> {
    if got == want {
        return Ok(());
    }
    let differ =
        got.iter().zip(want).filter(|(g, w)| g != w).count() + got.len().abs_diff(want.len());
    let first = got
        .iter()
        .zip(want)
        .position(|(g, w)| g != w)
        .unwrap_or(got.len().min(want.len()));
    Err(Failure::new(format!(
        "{what}: {differ} of {} bytes differ, the first at offset {first}: got {}, expected {}",
        want.len(),
        preview(&got[first.min(got.len())..]),
        preview(&want[first.min(want.len())..])
    )))
}

/// A signaled RDMA or atomic work request.
fn remote_wr(
    wr_id: u64,
    opcode: SendOpcode,
    sges: &[Sge],
    remote_addr: u64,
    rkey: u32,
) -> SendWr<'_> {
    let mut wr = SendWr::new(wr_id, opcode, SendPayload::Sges(sges));
    wr.flags |= SIGNALED;
    wr.remote_addr = remote_addr;
    wr.rkey = rkey;
    wr
}

/// Polls `cq` for one completion, for at most [`CQ_TIMEOUT`].
fn wait_completion(cq: &CompletionQueue, whose: &str) -> Result<WorkCompletion, Failure> {
    let deadline = Instant::now() + CQ_TIMEOUT;
    let mut wc = [WorkCompletion::default()];
    loop {
        if cq.poll(&mut wc).doing(format!("polling {whose}'s CQ"))? == 1 {
            return Ok(wc[0]);
        }
        if Instant::now() >= deadline {
            return Err(Failure::new(format!(
                "no completion on {whose}'s CQ within {CQ_TIMEOUT:?}"
            )));
        }
        std::thread::yield_now();
    }
}

/// Fails unless `wc` is work request `wr_id` with `status` (and `opcode`,
/// when given).
fn check_completion(
    wc: &WorkCompletion,
    whose: &str,
    wr_id: u64,
    status: WcStatus,
    opcode: Option<WcOpcode>,
) -> Result<(), Failure> {
    if wc.wr_id == wr_id && wc.status == status && (opcode.is_none() || wc.opcode == opcode) {
        return Ok(());
    }
    let expected = opcode.map_or_else(String::new, |o| format!("{} ", verbs_name(o)));
    Err(Failure::new(format!(
        "{whose}'s completion was wr {}: {}, expected wr {wr_id}: {expected}{}",
        wc.wr_id,
        wc_text(wc),
        verbs_name(status)
    )))
}

/// Posts one signaled work request on alpha's QP and waits for its
/// completion, which must have `status`.
fn post_and_wait(
    alpha: &Requester<'_>,
    wr: &SendWr<'_>,
    status: WcStatus,
) -> Result<WorkCompletion, Failure> {
    alpha
        .qp
        .post_send(std::slice::from_ref(wr))
        .doing(format!("alpha's post_send of {}", verbs_name(wr.opcode)))?;
    let wc = wait_completion(alpha.cq, ALPHA)?;
    let opcode = (status == WcStatus::Success).then(|| wr.opcode.completion_opcode());
    check_completion(&wc, ALPHA, wr.wr_id, status, opcode)?;
    Ok(wc)
}

/// Step 9: alpha writes its registered application buffer into beta's MR.
fn rdma_write(
    alpha: &Requester<'_>,
    buffer: &AppBuffer,
    mr: &MemoryRegion,
    peer: &Peer,
) -> Result<(), Failure> {
    heading(9, "RDMA WRITE: alpha's application buffer -> beta's MR");
    let sge = [mr.sge(0, BUFFER_LEN as u32)];
    let wr = remote_wr(
        WR_WRITE,
        SendOpcode::RdmaWrite,
        &sge,
        peer.mr.iova(),
        peer.mr.rkey(),
    );
    let wc = post_and_wait(alpha, &wr, WcStatus::Success)?;
    say(
        "alpha",
        format!(
            "{} from its buffer to beta's MR (iova {:#x}, rkey {:#010x}) -> {}",
            bytes_text(BUFFER_LEN as u64),
            peer.mr.iova(),
            peer.mr.rkey(),
            wc_text(&wc)
        ),
    );
    let written = buffer.read(BUFFER_LEN);
    let landed = mr_bytes(&peer.mr, 0, BUFFER_LEN)?;
    same_bytes("beta's MR after the RDMA WRITE", &landed, &written)?;
    say(
        "verified",
        format!(
            "beta's MR holds the {BUFFER_LEN} bytes, byte for byte: {}",
            preview(&landed)
        ),
    );
    Ok(())
}

/// Step 10: alpha reads beta's MR back into a second MR of its own.
fn rdma_read(
    alpha: &Requester<'_>,
    pd: &ProtectionDomain,
    buffer: &AppBuffer,
    peer: &Peer,
) -> Result<MemoryRegion, Failure> {
    heading(10, "RDMA READ: beta's MR -> another alpha MR");
    let landing = pd
        .alloc_mr(LANDING_LEN, access::LOCAL_WRITE)
        .doing("alpha's alloc_mr")?;
    let sge = [landing.sge(0, BUFFER_LEN as u32)];
    let wr = remote_wr(
        WR_READ,
        SendOpcode::RdmaRead,
        &sge,
        peer.mr.iova(),
        peer.mr.rkey(),
    );
    let wc = post_and_wait(alpha, &wr, WcStatus::Success)?;
    say(
        "alpha",
        format!(
            "{} of beta's MR into a new MR (alloc_mr, lkey {:#010x}) -> {}, byte_len {}",
            bytes_text(BUFFER_LEN as u64),
            landing.lkey(),
            wc_text(&wc),
            wc.byte_len
        ),
    );
    let read = mr_bytes(&landing, 0, BUFFER_LEN)?;
    same_bytes(
        "alpha's MR after the RDMA READ",
        &read,
        &buffer.read(BUFFER_LEN),
    )?;
    say(
        "verified",
        format!("the {BUFFER_LEN} bytes read back equal alpha's buffer, byte for byte"),
    );
    Ok(landing)
}

/// Step 11: beta posts a receive; alpha sends a message with immediate
/// data into it.
fn send_with_immediate(
    alpha: &Requester<'_>,
    landing: &MemoryRegion,
    peer: &Peer,
) -> Result<(), Failure> {
    heading(
        11,
        "SEND with immediate data: alpha -> a receive beta posted",
    );
    let recv_sge = [peer.mr.sge(RECV_OFFSET as u64, RECV_LEN)];
    peer.qp
        .post_recv(&[RecvWr {
            wr_id: WR_RECV,
            sg_list: &recv_sge,
        }])
        .doing("beta's post_recv")?;
    landing
        .write(MESSAGE_OFFSET, MESSAGE)
        .doing("writing alpha's message")?;
    let sge = [landing.sge(MESSAGE_OFFSET as u64, MESSAGE.len() as u32)];
    let mut wr = SendWr::new(WR_SEND, SendOpcode::SendWithImm, SendPayload::Sges(&sge));
    wr.flags |= SIGNALED;
    wr.imm_data = IMM.to_be_bytes();
    let wc = post_and_wait(alpha, &wr, WcStatus::Success)?;
    say(
        "alpha",
        format!(
            "SEND_WITH_IMM of {}, imm {IMM:#010x} -> {}",
            preview(MESSAGE),
            wc_text(&wc)
        ),
    );

    let wc = wait_completion(&peer.cq, BETA)?;
    check_completion(&wc, BETA, WR_RECV, WcStatus::Success, Some(WcOpcode::Recv))?;
    let imm = wc.imm_data.map(u32::from_be_bytes);
    if wc.byte_len as usize != MESSAGE.len() || imm != Some(IMM) || wc.src_qp != alpha.qp.qp_num() {
        return Err(Failure::new(format!(
            "beta's receive completion {wc:?} does not match alpha's SEND ({} bytes, imm \
             {IMM:#010x}, from QP {:#08x})",
            MESSAGE.len(),
            alpha.qp.qp_num()
        )));
    }
    let received = mr_bytes(&peer.mr, RECV_OFFSET, MESSAGE.len())?;
    same_bytes("beta's receive buffer", &received, MESSAGE)?;
    say(
        "beta",
        format!(
            "{}, byte_len {}, imm {:#010x}, src_qp {:#08x} (alpha's); buffer: {}",
            wc_text(&wc),
            wc.byte_len,
            imm.unwrap_or_default(),
            wc.src_qp,
            preview(&received)
        ),
    );
    Ok(())
}

fn u64_at(mr: &MemoryRegion, offset: usize) -> Result<u64, Failure> {
    let mut bytes = [0u8; 8];
    mr.read(offset, &mut bytes)
        .doing(format!("reading 8 bytes of an MR at offset {offset}"))?;
    Ok(u64::from_le_bytes(bytes))
}

/// Step 12: alpha adds to a counter in beta's memory and gets the old value.
fn fetch_and_add(
    alpha: &Requester<'_>,
    landing: &MemoryRegion,
    peer: &Peer,
) -> Result<(), Failure> {
    heading(
        12,
        "Atomic fetch-and-add: alpha adds to a counter in beta's MR",
    );
    peer.mr
        .write(COUNTER_OFFSET, &COUNTER_START.to_le_bytes())
        .doing("writing beta's counter")?;
    let sge = [landing.sge(FETCHED_OFFSET as u64, 8)];
    let mut wr = remote_wr(
        WR_FETCH_ADD,
        SendOpcode::AtomicFetchAndAdd,
        &sge,
        peer.mr.iova() + COUNTER_OFFSET as u64,
        peer.mr.rkey(),
    );
    wr.compare_add = COUNTER_ADD;
    let wc = post_and_wait(alpha, &wr, WcStatus::Success)?;
    let fetched = u64_at(landing, FETCHED_OFFSET)?;
    let counter = u64_at(&peer.mr, COUNTER_OFFSET)?;
    if fetched != COUNTER_START || counter != COUNTER_START + COUNTER_ADD {
        return Err(Failure::new(format!(
            "fetch-and-add of {COUNTER_ADD} on {COUNTER_START} returned {fetched} and left \
             {counter} in beta's MR"
        )));
    }
    say(
        "alpha",
        format!(
            "ATOMIC_FETCH_AND_ADD +{COUNTER_ADD} at beta's iova {:#x} -> {}, fetched {fetched}",
            peer.mr.iova() + COUNTER_OFFSET as u64,
            wc_text(&wc)
        ),
    );
    say(
        "verified",
        format!("beta's counter went from {COUNTER_START} to {counter}; alpha got the old value"),
    );
    Ok(())
}

/// Step 13: alpha writes with an rkey it made up: the write fails with a
/// remote access error, beta's memory is untouched, and alpha's QP goes to
/// ERR while beta's stays RTS.
fn made_up_rkey(
    alpha: &Requester<'_>,
    alpha_mrs: [&MemoryRegion; 2],
    peer: &Peer,
) -> Result<(), Failure> {
    heading(13, "Isolation: an RDMA WRITE with a made-up rkey");
    let keys: Vec<u32> = alpha_mrs
        .iter()
        .chain([&&peer.mr])
        .flat_map(|mr| [mr.lkey(), mr.rkey()])
        .collect();
    let mut rkey: u32 = 0x0bad_c0de;
    while keys.contains(&rkey) {
        rkey = rkey.wrapping_add(1);
    }
    let [_, landing] = alpha_mrs;
    landing
        .write(INTRUDER_OFFSET, &b"not yours ".repeat(7)[..INTRUDER_LEN])
        .doing("writing what alpha tries to write")?;
    let before = mr_bytes(&peer.mr, 0, BETA_MR_LEN)?;
    let sge = [landing.sge(INTRUDER_OFFSET as u64, INTRUDER_LEN as u32)];
    let wr = remote_wr(
        WR_BAD_RKEY,
        SendOpcode::RdmaWrite,
        &sge,
        peer.mr.iova(),
        rkey,
    );
    let wc = post_and_wait(alpha, &wr, WcStatus::RemAccessErr)?;
    say(
        "alpha",
        format!(
            "RDMA_WRITE of {INTRUDER_LEN} bytes to beta's MR with rkey {rkey:#010x} (no MR has \
             it) -> {} (remote access error)",
            verbs_name(wc.status)
        ),
    );
    let after = mr_bytes(&peer.mr, 0, BETA_MR_LEN)?;
    same_bytes(
        "beta's MR after the write with a made-up rkey",
        &after,
        &before,
    )?;
    let alpha_state = qp_state(alpha.qp, ALPHA)?;
    let beta_state = qp_state(&peer.qp, BETA)?;
    if alpha_state != u8::from(QpState::Err) || beta_state != u8::from(QpState::Rts) {
        return Err(Failure::new(format!(
            "after the remote access error alpha's QP is {} (expected ERR) and beta's {} \
             (expected RTS)",
            state_name(alpha_state),
            state_name(beta_state)
        )));
    }
    say(
        "verified",
        format!(
            "beta's MR is unchanged, all {BETA_MR_LEN} bytes; query_qp: alpha's QP is now {}, \
             beta's still {}",
            state_name(alpha_state),
            state_name(beta_state)
        ),
    );
    Ok(())
}

/// Step 14: destroy everything, children first, then close the devices.
#[allow(clippy::too_many_arguments)]
fn teardown(
    ctx: Context,
    pd: ProtectionDomain,
    buffer: AppBuffer,
    mr: MemoryRegion,
    landing: MemoryRegion,
    cq: CompletionQueue,
    qp: QueuePair,
    peer: Peer,
) -> Result<(), Failure> {
    heading(14, "Tear down, children first");
    let qpn = qp.qp_num();
    qp.destroy().map_err(|e| e.error).doing("destroy_qp")?;
    say("QP", format!("{qpn:#08x} destroyed"));
    let cqn = cq.cqn();
    cq.destroy().map_err(|e| e.error).doing("destroy_cq")?;
    say("CQ", format!("{cqn} destroyed"));
    let lkey = landing.lkey();
    landing.dereg().map_err(|e| e.error).doing("dereg_mr")?;
    say(
        "MR",
        format!("lkey {lkey:#010x} (the READ's, driver memory) deregistered"),
    );
    let lkey = mr.lkey();
    mr.dereg().map_err(|e| e.error).doing("dereg_mr")?;
    let still = buffer.read(PATTERN.len());
    say(
        "MR",
        format!(
            "lkey {lkey:#010x} deregistered; the buffer is the application's again (reads {:?})",
            String::from_utf8_lossy(&still)
        ),
    );
    drop(buffer);
    let pdn = pd.pdn();
    pd.destroy().map_err(|e| e.error).doing("dealloc_pd")?;
    say("PD", format!("{pdn} deallocated"));
    drop(ctx);
    say(
        "device",
        "alpha's closed: the vhost-user connection is gone",
    );

    let Peer {
        qp,
        cq,
        mr,
        pd,
        ctx,
        ..
    } = peer;
    qp.destroy()
        .map_err(|e| e.error)
        .doing("beta's destroy_qp")?;
    cq.destroy()
        .map_err(|e| e.error)
        .doing("beta's destroy_cq")?;
    mr.dereg().map_err(|e| e.error).doing("beta's dereg_mr")?;
    pd.destroy()
        .map_err(|e| e.error)
        .doing("beta's dealloc_pd")?;
    drop(ctx);
    say(
        "beta",
        "QP, CQ, MR and PD destroyed the same way; device closed",
    );
    Ok(())
}
