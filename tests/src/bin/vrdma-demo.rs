//! `vrdma-demo`: see vrdma work without RDMA hardware or a VM.
//!
//! The demo writes its built-in vdev configuration (`tests/src/demo.toml`)
//! to a scratch directory, starts `vdev` there as a separate process on a
//! unix socket, and opens the device through the guest driver in process
//! mode — this process is vdev's vhost-user frontend, the way an RDMA
//! application is. It then walks the control path one step at a time:
//! device, limits, port and GID; a protection domain; application memory
//! registered in place; a CQ and a QP taken RESET → INIT → RTR → RTS, each
//! state read back from the device; one operation the device refuses; and
//! teardown. It ends with "vrdma demo: OK" and exit status 0; any failure
//! prints the error chain (and vdev's log) and exits with status 1.
//!
//! Each step is a small function, so RDMA between two tenants through hostd
//! can be added as further steps.

use std::error::Error as StdError;
use std::fmt::{self, Display};
use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitCode, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use clap::Parser;
use vrdma_guest_driver::vrdma_spec::config::{DeviceAttr, PortAttr};
use vrdma_guest_driver::vrdma_spec::control::QpAttr;
use vrdma_guest_driver::vrdma_spec::qp_state::mask;
use vrdma_guest_driver::vrdma_spec::verbs::{access, LinkLayer, Mtu, PortState, QpState, QpType};
use vrdma_guest_driver::{
    CompletionQueue, Context, MemoryRegion, ProtectionDomain, QpCapabilities, QpInitAttr, QueuePair,
};
use vrdma_tenant_policy::Limits;

/// The vdev configuration the demo runs with unless `--config` names another.
const DEFAULT_CONFIG: &str = include_str!("../demo.toml");
/// Bytes of application memory the demo registers.
const BUFFER_LEN: usize = 2 * 4096;
/// What the application memory is filled with.
const PATTERN: &[u8] = b"vrdma-demo ";
/// How long vdev may take to listen, and to exit once the demo disconnects.
const VDEV_TIMEOUT: Duration = Duration::from_secs(10);

/// Command line of `vrdma-demo`.
#[derive(Debug, Parser)]
#[command(
    version,
    about = "Starts vdev, opens its virtual RDMA device through the guest driver \
             (process mode) and walks through the verbs control path"
)]
struct Args {
    /// Keep the scratch directory (vdev's config, socket and log) and print
    /// where it is. It is always kept when the demo fails once vdev ran.
    #[arg(long)]
    keep: bool,
    /// The vdev binary to run (default: `vdev` next to this executable).
    #[arg(long, value_name = "PATH")]
    vdev: Option<PathBuf>,
    /// A vdev config file to use instead of the built-in one.
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
            eprintln!("vrdma demo: FAILED: {}", error_chain(&e));
            if let Some(log) = &e.vdev_log {
                eprintln!("{log}");
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
    /// The end of vdev's log, when vdev was running.
    vdev_log: Option<String>,
}

impl Failure {
    fn new(what: impl Into<String>) -> Self {
        Self {
            what: what.into(),
            source: None,
            vdev_log: None,
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

/// `error: cause: cause ...`
fn error_chain(e: &dyn StdError) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

/// The symbolic name of the errnos vrdma answers with.
fn errno_name(errno: i32) -> &'static str {
    match errno {
        libc::EINVAL => "EINVAL",
        libc::EBUSY => "EBUSY",
        libc::ENOMEM => "ENOMEM",
        libc::EFAULT => "EFAULT",
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

// ---------------------------------------------------------------------------
// The configuration and the scratch directory.
// ---------------------------------------------------------------------------

/// The vdev configuration, as text and as the demo reads it.
#[derive(Debug)]
struct DemoConfig {
    text: String,
    origin: String,
    tenant: String,
    lid: Option<i64>,
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
        tenant: table
            .get("tenant")
            .and_then(|v| v.as_str())
            .unwrap_or("default")
            .to_owned(),
        lid: table.get("lid").and_then(|v| v.as_integer()),
        limits,
        origin,
        text,
    })
}

/// The demo's directory for vdev's config, socket and log; removed on drop
/// unless kept.
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
// vdev, the separate process.
// ---------------------------------------------------------------------------

/// A running vdev; killed on drop if it is still running.
#[derive(Debug)]
struct VdevProcess {
    child: Child,
    socket: PathBuf,
    log: PathBuf,
}

/// `vdev` next to this executable (`target/<profile>/vdev` for
/// `target/<profile>/vrdma-demo`).
fn default_vdev() -> Result<PathBuf, Failure> {
    let exe = std::env::current_exe().doing("finding this executable")?;
    let dir = exe
        .parent()
        .ok_or_else(|| Failure::new("this executable has no directory"))?;
    Ok(dir.join("vdev"))
}

/// Checks there is a vdev binary at `binary` before anything is created.
fn check_vdev(binary: &Path) -> Result<(), Failure> {
    if binary.is_file() {
        return Ok(());
    }
    Err(Failure::new(format!(
        "vdev binary {} not found: build it (`cargo build -p vrdma-vdev --bin vdev`, \
         with the same profile as vrdma-demo) or pass --vdev PATH",
        binary.display()
    )))
}

fn start_vdev(binary: &Path, dir: &Path, config: &Path) -> Result<VdevProcess, Failure> {
    let socket = dir.join("vdev.sock");
    let log = dir.join("vdev.log");
    let log_file = File::create(&log).doing(format!("creating {}", log.display()))?;
    let child = Command::new(binary)
        .arg("--socket")
        .arg(&socket)
        .arg("--config")
        .arg(config)
        // Exit once this application disconnects.
        .arg("--once")
        .env("VRDMA_LOG", "info")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(log_file)
        .spawn()
        .doing(format!("starting {}", binary.display()))?;
    let mut vdev = VdevProcess { child, socket, log };
    vdev.wait_for_socket()?;
    Ok(vdev)
}

impl VdevProcess {
    fn wait_for_socket(&mut self) -> Result<(), Failure> {
        let deadline = Instant::now() + VDEV_TIMEOUT;
        while !self.socket.exists() {
            if let Some(status) = self.child.try_wait().doing("checking on vdev")? {
                return Err(self.with_log(Failure::new(format!(
                    "vdev exited with {status} before listening"
                ))));
            }
            if Instant::now() >= deadline {
                return Err(self.with_log(Failure::new(format!(
                    "vdev did not listen on {} within {VDEV_TIMEOUT:?}",
                    self.socket.display()
                ))));
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        Ok(())
    }

    /// Waits for vdev to exit on its own (it runs with `--once`).
    fn wait_for_exit(&mut self) -> Result<ExitStatus, Failure> {
        let deadline = Instant::now() + VDEV_TIMEOUT;
        loop {
            if let Some(status) = self.child.try_wait().doing("checking on vdev")? {
                return Ok(status);
            }
            if Instant::now() >= deadline {
                return Err(self.with_log(Failure::new(format!(
                    "vdev did not exit within {VDEV_TIMEOUT:?} of the application closing the device"
                ))));
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// `failure`, with the end of vdev's log attached.
    fn with_log(&self, failure: Failure) -> Failure {
        let log = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = log.lines().collect();
        let tail = lines[lines.len().saturating_sub(15)..].join("\n    ");
        Failure {
            vdev_log: Some(format!(
                "vdev log ({}), last lines:\n    {tail}",
                self.log.display()
            )),
            ..failure
        }
    }
}

impl Drop for VdevProcess {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
        }
        let _ = self.child.wait();
    }
}

// ---------------------------------------------------------------------------
// The demo, step by step.
// ---------------------------------------------------------------------------

fn run(args: &Args) -> Result<(), Failure> {
    let config = load_config(args.config.as_deref())?;
    let vdev_binary = match &args.vdev {
        Some(path) => path.clone(),
        None => default_vdev()?,
    };
    check_vdev(&vdev_binary)?;
    println!(
        "vrdma demo: one tenant's virtual RDMA device, served by vdev in a separate \
         process and used through the guest driver in process mode"
    );
    let mut scratch = Scratch::create(args.keep)?;
    let result = with_vdev(&vdev_binary, &config, &scratch.path);
    if result.is_err() {
        scratch.keep = true;
    }
    if scratch.keep {
        println!("    (scratch directory kept: {})", scratch.path.display());
    }
    result
}

/// Step 1 and the last: vdev's life around the application's.
fn with_vdev(binary: &Path, config: &DemoConfig, dir: &Path) -> Result<(), Failure> {
    heading(1, "Start vdev");
    let config_path = dir.join("vdev.toml");
    std::fs::write(&config_path, &config.text)
        .doing(format!("writing {}", config_path.display()))?;
    let lid = config
        .lid
        .map_or_else(|| "default".to_owned(), |l| l.to_string());
    say(
        "config",
        format!(
            "tenant {:?}, LID {lid}: {} written to {}",
            config.tenant,
            config.origin,
            config_path.display()
        ),
    );
    let mut vdev = start_vdev(binary, dir, &config_path)?;
    say(
        "vdev",
        format!(
            "{} running as pid {}, listening on {}",
            binary.display(),
            vdev.child.id(),
            vdev.socket.display()
        ),
    );

    application(&vdev.socket, config).map_err(|e| vdev.with_log(e))?;

    let status = vdev.wait_for_exit()?;
    if !status.success() {
        return Err(vdev.with_log(Failure::new(format!("vdev exited with {status}"))));
    }
    let code = status
        .code()
        .map_or_else(|| status.to_string(), |c| c.to_string());
    say(
        "vdev",
        format!("exited with status {code} once the application disconnected (--once)"),
    );
    Ok(())
}

/// What an RDMA application does, from opening the device to closing it.
fn application(socket: &Path, config: &DemoConfig) -> Result<(), Failure> {
    let ctx = open_device(socket, config)?;
    let pd = alloc_pd(&ctx)?;
    let (buffer, mr) = register_memory(&pd)?;
    let (cq, qp) = create_queues(&ctx, &pd)?;
    walk_qp(&ctx, &qp)?;
    let pd = refused_operation(pd)?;
    teardown(ctx, pd, buffer, mr, cq, qp)
}

/// Step 2: open the device; show what it is and what it allows.
fn open_device(socket: &Path, config: &DemoConfig) -> Result<Context, Failure> {
    heading(
        2,
        "Open the device (this process is vdev's vhost-user frontend)",
    );
    let ctx = Context::open_vhost_user(socket)
        .doing(format!("opening the device at {}", socket.display()))?;
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

fn show_port(port: &PortAttr) -> Result<(), Failure> {
    let state = PortState::try_from(port.state).map_or_else(
        |v| format!("state {v}"),
        |s| format!("{s:?}").to_uppercase(),
    );
    let link = match LinkLayer::try_from(port.link_layer) {
        Ok(LinkLayer::Infiniband) => "InfiniBand".to_owned(),
        Ok(other) => format!("{other:?}"),
        Err(v) => format!("link layer {v}"),
    };
    say(
        "port 1",
        format!(
            "{state}, LID {}, MTU {} (max {}), {link}",
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
        // writes it concurrently.
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
    let mut through_mr = vec![0u8; seen.len()];
    mr.read(0, &mut through_mr).doing("reading the MR")?;
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
    let qp = pd
        .create_qp(&QpInitAttr {
            send_cq: &cq,
            recv_cq: &cq,
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
        .doing("create_qp")?;
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

/// Applies one transition and prints the state the device reports back.
fn transition(qp: &QueuePair, attr: &QpAttr, attr_mask: u32, detail: &str) -> Result<(), Failure> {
    let wanted = state_name(attr.qp_state);
    qp.modify(attr, attr_mask)
        .doing(format!("modify_qp to {wanted}"))?;
    let now = qp
        .query(0)
        .doing(format!("query_qp after {wanted}"))?
        .attr
        .qp_state;
    if now != attr.qp_state {
        return Err(Failure::new(format!(
            "the QP went to {wanted} but the device reports {}",
            state_name(now)
        )));
    }
    say(&state_name(now), detail);
    Ok(())
}

/// Step 6: RESET → INIT → RTR → RTS. With no peer yet, the QP is connected
/// to itself (loopback) through its own port's LID.
fn walk_qp(ctx: &Context, qp: &QueuePair) -> Result<(), Failure> {
    heading(
        6,
        "Take the QP through RESET -> INIT -> RTR -> RTS (as queried back from vdev)",
    );
    let created = qp.query(0).doing("query_qp")?;
    say(&state_name(created.attr.qp_state), "as created");
    let lid = ctx.query_port(1).doing("query_port")?.lid.get();

    let qp_access = access::REMOTE_WRITE | access::REMOTE_READ;
    let init = QpAttr {
        qp_state: QpState::Init.into(),
        port_num: 1,
        qp_access_flags: qp_access.into(),
        ..QpAttr::default()
    };
    transition(
        qp,
        &init,
        mask::STATE | mask::PKEY_INDEX | mask::PORT | mask::ACCESS_FLAGS,
        &format!(
            "port 1, P_Key index 0, remote access {}",
            access_text(qp_access)
        ),
    )?;

    let mut rtr = QpAttr {
        qp_state: QpState::Rtr.into(),
        path_mtu: Mtu::Mtu4096.into(),
        dest_qp_num: qp.qp_num().into(),
        rq_psn: 0.into(),
        max_dest_rd_atomic: 1,
        min_rnr_timer: 12,
        ..QpAttr::default()
    };
    rtr.ah_attr.dlid = lid.into();
    rtr.ah_attr.port_num = 1;
    transition(
        qp,
        &rtr,
        mask::STATE
            | mask::AV
            | mask::PATH_MTU
            | mask::DEST_QPN
            | mask::RQ_PSN
            | mask::MAX_DEST_RD_ATOMIC
            | mask::MIN_RNR_TIMER,
        &format!(
            "remote QP {:#08x} at LID {lid} (itself: loopback), path MTU 4096",
            qp.qp_num()
        ),
    )?;

    let rts = QpAttr {
        qp_state: QpState::Rts.into(),
        sq_psn: 0.into(),
        timeout: 14,
        retry_cnt: 7,
        rnr_retry: 7,
        max_rd_atomic: 1,
        ..QpAttr::default()
    };
    transition(
        qp,
        &rts,
        mask::STATE
            | mask::SQ_PSN
            | mask::TIMEOUT
            | mask::RETRY_CNT
            | mask::RNR_RETRY
            | mask::MAX_QP_RD_ATOMIC,
        "ready to send: timeout 14, retry 7, RNR retry 7",
    )
}

/// Step 7: the device refuses to destroy a PD that still has an MR and a
/// QP; the driver hands the PD back.
fn refused_operation(pd: ProtectionDomain) -> Result<ProtectionDomain, Failure> {
    heading(7, "An operation the device refuses");
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

/// Step 8: destroy everything, children first, then close the device.
fn teardown(
    ctx: Context,
    pd: ProtectionDomain,
    buffer: AppBuffer,
    mr: MemoryRegion,
    cq: CompletionQueue,
    qp: QueuePair,
) -> Result<(), Failure> {
    heading(8, "Tear down");
    let qpn = qp.qp_num();
    qp.destroy().map_err(|e| e.error).doing("destroy_qp")?;
    say("QP", format!("{qpn:#08x} destroyed"));
    let cqn = cq.cqn();
    cq.destroy().map_err(|e| e.error).doing("destroy_cq")?;
    say("CQ", format!("{cqn} destroyed"));
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
    say("device", "closed: the vhost-user connection is gone");
    Ok(())
}
