//! Running a real guest: QEMU 11 (TCG) from the cached Debian trixie root
//! that `tests/vm/prepare.sh` builds, a Debian kernel, an initramfs built
//! here, and vrdma attached as `vhost-user-test-device-pci`.
//!
//! - [`VmImage`]: the prepared root (QEMU, guest kernel, modules, busybox).
//! - [`Initramfs`]: busybox, kernel modules, host binaries with their
//!   shared libraries, and the caller's init script, as a newc cpio.
//! - [`Guest`]: QEMU running in the root through chroot, with the serial
//!   console in a file, a QMP socket and user networking (the guest reaches
//!   the host as 10.0.2.2) or a tap device in a network namespace
//!   ([`Nic::Tap`]).
//! - [`rxe`]: a guest running Linux Soft-RoCE (`rdma_rxe`) on its NIC,
//!   a tap in a network namespace, with Debian's RDMA programs, driven by
//!   commands from the host.
//!
//! QEMU runs chrooted, so every path it is given — the vhost-user socket
//! above all — must lie inside the root: [`VmImage::temp_dir`] makes
//! scratch directories there (start vdev in one with
//! [`crate::daemon::Vdev::start_in`]), and [`VmImage::guest_view`] turns a
//! host path into the path QEMU sees.
//!
//! docs/vm.md describes the command line and the cache.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Component, Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use crate::daemon::TempDir;

/// The virtio device id the device runs with under QEMU. vrdma is virtio
/// device 42 (RDMA), but QEMU 11.1 asserts in `virtio_id_to_name` for any
/// id past the end of its name table, which stops at 41 (GPIO). 38 is in
/// that table and no Linux driver claims it, so the device stays unbound
/// until the guest driver, told this id, takes it. See docs/vm.md.
pub const QEMU_VIRTIO_ID: u16 = 38;

/// The PCI device id of a modern virtio device with `virtio_id`
/// (virtio 1.x, 4.1.2.1: 0x1040 + id), vendor 0x1af4.
pub const fn virtio_pci_device_id(virtio_id: u16) -> u16 {
    0x1040 + virtio_id
}

/// What the guest prints for a check that passed: `VRDMA-VERDICT <name> PASS`.
/// `FAIL` instead of `PASS` (followed by a reason) for one that failed.
pub const VERDICT: &str = "VRDMA-VERDICT";

/// Why preparing, building or running a guest failed.
#[derive(Debug, thiserror::Error)]
pub enum VmError {
    #[error("Cannot run {what}")]
    Spawn {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("tests/vm/prepare.sh failed ({status}):\n{stderr}")]
    Prepare { status: ExitStatus, stderr: String },
    #[error("The prepared root {0} lacks {1}")]
    Incomplete(PathBuf, &'static str),
    #[error("Kernel module {0} is not in modules.dep")]
    UnknownModule(String),
    #[error("{path} failed")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("ldd {binary} failed: {output}")]
    Ldd { binary: PathBuf, output: String },
    #[error("Guest tree file {path}: {reason}")]
    GuestTree { path: String, reason: String },
    #[error("Network namespace {netns}: {what}")]
    Netns { netns: String, what: String },
    #[error("{0} is outside the VM root, where the chrooted QEMU cannot see it")]
    OutsideRoot(PathBuf),
    #[error("QMP: {0}")]
    Qmp(String),
    #[error("{what}\n--- QEMU stderr ---\n{stderr}\n--- guest console ---\n{console}")]
    Guest {
        what: String,
        console: String,
        stderr: String,
    },
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> VmError + '_ {
    move |source| VmError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// The prepared root: QEMU in it, the guest's files under `guest/`.
#[derive(Debug, Clone)]
pub struct VmImage {
    root: PathBuf,
    guest: PathBuf,
    kernel: PathBuf,
    modules: PathBuf,
    busybox: PathBuf,
}

impl VmImage {
    /// Runs `tests/vm/prepare.sh` (near instant when its cache is warm)
    /// and checks what it made.
    pub fn prepare() -> Result<Self, VmError> {
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("vm/prepare.sh");
        let out = Command::new(&script)
            .stdin(Stdio::null())
            .output()
            .map_err(|source| VmError::Spawn {
                what: script.display().to_string(),
                source,
            })?;
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        if !out.status.success() {
            return Err(VmError::Prepare {
                status: out.status,
                stderr,
            });
        }
        let stdout = String::from_utf8_lossy(&out.stdout);
        let root = stdout.lines().last().unwrap_or_default().trim();
        Self::open(Path::new(root))
    }

    /// The image in an already prepared `root`.
    pub fn open(root: &Path) -> Result<Self, VmError> {
        let guest = root.join("guest");
        let kernel = first_entry(&guest.join("boot"), "vmlinuz-").ok_or_else(|| {
            VmError::Incomplete(root.into(), "a guest kernel (guest/boot/vmlinuz-*)")
        })?;
        let version = kernel
            .file_name()
            .and_then(|n| n.to_str())
            .and_then(|n| n.strip_prefix("vmlinuz-"))
            .unwrap_or_default()
            .to_owned();
        // Debian trixie ships modules under /usr/lib (merged /usr).
        let modules = ["usr/lib/modules", "lib/modules"]
            .iter()
            .map(|dir| guest.join(dir).join(&version))
            .find(|dir| dir.join("modules.dep").exists())
            .ok_or_else(|| VmError::Incomplete(root.into(), "the guest kernel's modules.dep"))?;
        let busybox = ["usr/bin/busybox", "bin/busybox"]
            .iter()
            .map(|p| guest.join(p))
            .find(|p| p.exists())
            .ok_or_else(|| VmError::Incomplete(root.into(), "a static busybox"))?;
        Ok(VmImage {
            root: root.into(),
            guest,
            kernel,
            modules,
            busybox,
        })
    }

    /// The root QEMU runs in.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The guest tree: the Debian packages unpacked for the guest
    /// (kernel, modules, busybox, the RDMA userland), a merged-/usr layout.
    pub fn guest_tree(&self) -> &Path {
        &self.guest
    }

    /// The guest kernel.
    pub fn kernel(&self) -> &Path {
        &self.kernel
    }

    /// A scratch directory inside the root (under its /tmp), removed on
    /// drop: sockets and files QEMU must reach go there.
    pub fn temp_dir(&self, tag: &str) -> TempDir {
        TempDir::new_in(&self.root.join("tmp"), tag)
    }

    /// The path under which the chrooted QEMU sees host path `path`.
    pub fn guest_view(&self, path: &Path) -> Result<PathBuf, VmError> {
        let inside = path
            .strip_prefix(&self.root)
            .map_err(|_| VmError::OutsideRoot(path.into()))?;
        if inside
            .components()
            .any(|c| matches!(c, Component::ParentDir))
        {
            return Err(VmError::OutsideRoot(path.into()));
        }
        Ok(Path::new("/").join(inside))
    }

    /// An initramfs builder with this image's busybox and modules.
    pub fn initramfs(&self) -> Initramfs {
        Initramfs::new(self)
    }
}

fn first_entry(dir: &Path, prefix: &str) -> Option<PathBuf> {
    let mut found: Vec<PathBuf> = std::fs::read_dir(dir)
        .ok()?
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with(prefix))
        })
        .collect();
    found.sort();
    found.pop()
}

mod elf;
mod initramfs;
pub mod rxe;

pub use initramfs::{Initramfs, GUEST_LIB_DIR};

/// The vrdma device as QEMU's `vhost-user-test-device-pci` describes it.
#[derive(Debug, Clone)]
pub struct VrdmaDevice {
    /// vdev's vhost-user socket (a host path inside the VM root).
    pub socket: PathBuf,
    /// Virtqueues: control, doorbell and one event queue per completion
    /// vector (`vrdma_spec::num_queues`).
    pub num_queues: u16,
    /// Size of every virtqueue (vdev's `queue_size`).
    pub queue_size: u16,
    /// Bytes of device config space.
    pub config_size: usize,
    /// PCI functions QEMU attaches to the socket: the device's context
    /// slots, one per process (or `ibv_open_device`) that uses it at once
    /// in the guest (docs/architecture.md, "Contexts").
    pub functions: u16,
    /// The PCI slot of the first function (the others follow), so the
    /// guest can tell devices apart by address; QEMU picks when `None`.
    pub slot: Option<u8>,
}

impl VrdmaDevice {
    /// The device a vdev with its default configuration serves on `socket`.
    pub fn for_vdev(socket: &Path) -> Self {
        VrdmaDevice {
            socket: socket.into(),
            num_queues: vrdma_spec::num_queues(vrdma_vdev::config::DEFAULT_COMP_VECTORS),
            queue_size: vrdma_vdev::config::DEFAULT_QUEUE_SIZE,
            config_size: vrdma_spec::config::CONFIG_SIZE,
            functions: 1,
            slot: None,
        }
    }

    /// The same device with `functions` context slots.
    pub fn with_functions(self, functions: u16) -> Self {
        VrdmaDevice { functions, ..self }
    }

    /// The same device with its functions at PCI slots `slot`, `slot + 1`, ...
    pub fn at_slot(self, slot: u8) -> Self {
        VrdmaDevice {
            slot: Some(slot),
            ..self
        }
    }

    /// The guest's PCI addresses of the functions (with [`VrdmaDevice::at_slot`]),
    /// joined as the library's `pci:` endpoint lists them.
    pub fn guest_addresses(&self) -> Option<String> {
        let slot = self.slot?;
        let all: Vec<String> = (0..self.functions.max(1))
            .map(|f| format!("0000:00:{:02x}.0", u16::from(slot) + f))
            .collect();
        Some(all.join("+"))
    }
}

/// The guest's network interface (a virtio-net-pci function, eth0).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum Nic {
    /// QEMU's user networking: the guest reaches the host's loopback as
    /// 10.0.2.2, and nothing else reaches the guest.
    #[default]
    User,
    /// Tap device `ifname`, which must exist in network namespace `netns`
    /// (a name under /run/netns, as `ip netns add` makes): QEMU runs in
    /// that namespace, so the guest's frames never leave it.
    Tap { netns: String, ifname: String },
}

/// How to run a guest.
#[derive(Debug, Clone)]
pub struct GuestConfig {
    /// The guest's NIC.
    pub nic: Nic,
    /// Guest RAM, MiB (a shared memfd, so vdev can map it).
    pub memory_mib: u32,
    /// The vrdma devices (usually one, or none).
    pub devices: Vec<VrdmaDevice>,
    /// Whether a reset (QMP `system_reset`, or the guest rebooting)
    /// restarts the guest; otherwise QEMU exits on it (`-no-reboot`).
    pub allow_reboot: bool,
    /// Extra kernel command-line words.
    pub append: String,
    /// Extra QEMU arguments, last on its command line. [`GuestConfig::default`]
    /// takes them from `VRDMA_VM_QEMU_ARGS` (split at whitespace), e.g.
    /// `-trace vhost_*` to watch QEMU's side of vhost-user.
    pub extra_args: Vec<String>,
}

impl Default for GuestConfig {
    fn default() -> Self {
        GuestConfig {
            nic: Nic::User,
            memory_mib: 512,
            devices: Vec::new(),
            allow_reboot: false,
            append: String::new(),
            extra_args: std::env::var("VRDMA_VM_QEMU_ARGS")
                .map(|a| a.split_whitespace().map(str::to_owned).collect())
                .unwrap_or_default(),
        }
    }
}

/// A QEMU guest running in the VM root; killed on drop.
#[derive(Debug)]
pub struct Guest {
    child: Child,
    console: PathBuf,
    stderr: PathBuf,
    qmp: PathBuf,
    command_line: Vec<String>,
    dir: TempDir,
}

impl Guest {
    /// Builds `initramfs` and boots it with `config`.
    pub fn boot(
        image: &VmImage,
        initramfs: Initramfs,
        config: &GuestConfig,
    ) -> Result<Self, VmError> {
        let dir = image.temp_dir("guest");
        let initrd = dir.path().join("initramfs.cpio");
        initramfs.build(&initrd)?;
        let console = dir.path().join("console.log");
        let stderr = dir.path().join("qemu.log");
        let qmp = dir.path().join("qmp.sock");
        let args = qemu_args(image, config, &initrd, &console, &qmp)?;
        let log = std::fs::File::create(&stderr).map_err(io_err(&stderr))?;
        let mut command = Command::new("chroot");
        if let Nic::Tap { netns, .. } = &config.nic {
            enter_netns_on_exec(&mut command, netns)?;
        }
        let child = command
            .arg(image.root())
            .args(&args)
            .stdin(Stdio::null())
            .stdout(log.try_clone().map_err(io_err(&stderr))?)
            .stderr(log)
            .spawn()
            .map_err(|source| VmError::Spawn {
                what: "chroot qemu-system-x86_64".into(),
                source,
            })?;
        Ok(Guest {
            child,
            console,
            stderr,
            qmp,
            command_line: args,
            dir,
        })
    }

    /// QEMU's command line (as run inside the root).
    pub fn command_line(&self) -> &[String] {
        &self.command_line
    }

    /// The guest's serial console so far.
    pub fn console(&self) -> String {
        let bytes = std::fs::read(&self.console).unwrap_or_default();
        String::from_utf8_lossy(&bytes).replace('\r', "")
    }

    /// What QEMU wrote to its stdout and stderr so far.
    pub fn qemu_log(&self) -> String {
        std::fs::read_to_string(&self.stderr).unwrap_or_default()
    }

    /// The guest's scratch directory (inside the root).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// A failure carrying `what`, QEMU's output and the console.
    pub fn error(&self, what: impl Into<String>) -> VmError {
        VmError::Guest {
            what: what.into(),
            console: self.console(),
            stderr: self.qemu_log(),
        }
    }

    /// A mark for [`Guest::wait_for_after`]: the console's length now.
    pub fn console_mark(&self) -> usize {
        self.console().len()
    }

    /// Waits until a console line containing `needle` appears and returns it.
    pub fn wait_for(&mut self, needle: &str, timeout: Duration) -> Result<String, VmError> {
        self.wait_for_after(0, needle, timeout)
    }

    /// Like [`Guest::wait_for`], looking only past console offset `mark`.
    pub fn wait_for_after(
        &mut self,
        mark: usize,
        needle: &str,
        timeout: Duration,
    ) -> Result<String, VmError> {
        let deadline = Instant::now() + timeout;
        loop {
            let console = self.console();
            let after = console.get(mark..).unwrap_or_default();
            // Only whole lines: the serial console arrives a few bytes at
            // a time, and a verdict read mid-line ("... PAS") is not one.
            let whole = after.rfind('\n').map_or("", |end| &after[..end]);
            if let Some(line) = whole.lines().find(|l| l.contains(needle)) {
                return Ok(line.to_owned());
            }
            if let Ok(Some(status)) = self.child.try_wait() {
                return Err(self.error(format!(
                    "QEMU exited ({status}) before the console showed {needle:?}"
                )));
            }
            if Instant::now() >= deadline {
                return Err(self.error(format!("No {needle:?} on the console within {timeout:?}")));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Waits for the guest's verdict on check `name` (`pass name` or
    /// `fail name reason` in its script); a FAIL is an error.
    pub fn verdict(&mut self, name: &str, timeout: Duration) -> Result<(), VmError> {
        self.verdict_after(0, name, timeout)
    }

    /// Like [`Guest::verdict`], looking only past console offset `mark`.
    pub fn verdict_after(
        &mut self,
        mark: usize,
        name: &str,
        timeout: Duration,
    ) -> Result<(), VmError> {
        let line = self.wait_for_after(mark, &format!("{VERDICT} {name} "), timeout)?;
        if line.contains(&format!("{VERDICT} {name} PASS")) {
            Ok(())
        } else {
            Err(self.error(format!("The guest failed {name}: {line}")))
        }
    }

    /// Runs QMP command `execute` with `arguments` (JSON, or empty) and
    /// returns QEMU's answer line.
    pub fn qmp(&self, execute: &str, arguments: &str) -> Result<String, VmError> {
        let qerr = |what: &str, e: std::io::Error| VmError::Qmp(format!("{what}: {e}"));
        let stream = UnixStream::connect(&self.qmp).map_err(|e| qerr("connect", e))?;
        stream
            .set_read_timeout(Some(Duration::from_secs(30)))
            .map_err(|e| qerr("timeout", e))?;
        let mut reader = BufReader::new(stream.try_clone().map_err(|e| qerr("clone", e))?);
        let mut writer = stream;
        let read_answer = |reader: &mut BufReader<UnixStream>| -> Result<String, VmError> {
            loop {
                let mut line = String::new();
                if reader.read_line(&mut line).map_err(|e| qerr("read", e))? == 0 {
                    return Err(VmError::Qmp("QEMU closed the QMP socket".into()));
                }
                // Events come in between; the answer has "return" or "error".
                if line.contains("\"return\"") {
                    return Ok(line);
                }
                if line.contains("\"error\"") {
                    return Err(VmError::Qmp(line));
                }
            }
        };
        let mut greeting = String::new();
        reader
            .read_line(&mut greeting)
            .map_err(|e| qerr("greeting", e))?;
        writer
            .write_all(b"{\"execute\":\"qmp_capabilities\"}\n")
            .map_err(|e| qerr("write", e))?;
        read_answer(&mut reader)?;
        let command = if arguments.is_empty() {
            format!("{{\"execute\":\"{execute}\"}}\n")
        } else {
            format!("{{\"execute\":\"{execute}\",\"arguments\":{arguments}}}\n")
        };
        writer
            .write_all(command.as_bytes())
            .map_err(|e| qerr("write", e))?;
        read_answer(&mut reader)
    }

    /// Resets the machine as a reset button would (QMP `system_reset`).
    pub fn system_reset(&self) -> Result<(), VmError> {
        self.qmp("system_reset", "").map(drop)
    }

    /// Waits for QEMU to exit (the guest powered off).
    pub fn wait_exit(&mut self, timeout: Duration) -> Result<ExitStatus, VmError> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Ok(status);
            }
            if Instant::now() >= deadline {
                return Err(self.error(format!("QEMU still runs after {timeout:?}")));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Asks QEMU to quit (QMP `quit`) and waits for it.
    pub fn quit(&mut self, timeout: Duration) -> Result<ExitStatus, VmError> {
        // QEMU may close the socket before answering: its exit is the answer.
        let _ = self.qmp("quit", "");
        self.wait_exit(timeout)
    }
}

impl Drop for Guest {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The path of network namespace `name` (as `ip netns add` mounts it).
pub fn netns_path(name: &str) -> PathBuf {
    Path::new("/run/netns").join(name)
}

/// Makes `command` enter network namespace `netns` before it runs.
fn enter_netns_on_exec(command: &mut Command, netns: &str) -> Result<(), VmError> {
    use std::os::fd::AsRawFd;
    use std::os::unix::process::CommandExt;
    let path = netns_path(netns);
    let file = std::fs::File::open(&path).map_err(|e| VmError::Netns {
        netns: netns.into(),
        what: format!("cannot open {}: {e}", path.display()),
    })?;
    // SAFETY: the closure runs in the forked child before exec and only
    // calls setns(2), which is async-signal-safe; `file` is moved into the
    // closure, so the descriptor stays open until the child has used it.
    unsafe {
        command.pre_exec(move || {
            if libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) == 0 {
                Ok(())
            } else {
                Err(std::io::Error::last_os_error())
            }
        });
    }
    Ok(())
}

/// QEMU's command line, with paths as the chrooted QEMU sees them.
fn qemu_args(
    image: &VmImage,
    config: &GuestConfig,
    initrd: &Path,
    console: &Path,
    qmp: &Path,
) -> Result<Vec<String>, VmError> {
    let view = |p: &Path| image.guest_view(p).map(|p| p.display().to_string());
    let mem = config.memory_mib;
    let mut append = String::from("console=ttyS0 quiet panic=-1");
    if !config.append.is_empty() {
        append.push(' ');
        append.push_str(&config.append);
    }
    let mut args: Vec<String> = [
        "qemu-system-x86_64",
        "-accel",
        "tcg",
        "-machine",
        "q35",
        "-nodefaults",
        "-nographic",
        "-smp",
        "1",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    args.extend([
        "-m".into(),
        format!("{mem}M"),
        // vhost-user needs guest RAM the backend can map: a shared memfd.
        "-object".into(),
        format!("memory-backend-memfd,id=mem,size={mem}M,share=on"),
        "-numa".into(),
        "node,memdev=mem".into(),
        "-kernel".into(),
        view(image.kernel())?,
        "-initrd".into(),
        view(initrd)?,
        "-append".into(),
        append,
        "-serial".into(),
        format!("file:{}", view(console)?),
        "-monitor".into(),
        "none".into(),
        "-qmp".into(),
        format!("unix:{},server=on,wait=off", view(qmp)?),
    ]);
    match &config.nic {
        // User networking: the guest reaches the host as 10.0.2.2.
        Nic::User => args.extend(["-netdev".into(), "user,id=net0".into()]),
        // QEMU runs in the tap's namespace (Guest::boot) and only attaches
        // to it: the test configures its host side.
        Nic::Tap { ifname, .. } => args.extend([
            "-netdev".into(),
            format!("tap,id=net0,ifname={ifname},script=no,downscript=no"),
        ]),
    }
    // No option ROM: the guest boots its kernel directly.
    args.extend([
        "-device".into(),
        "virtio-net-pci,netdev=net0,romfile=".into(),
    ]);
    if !config.allow_reboot {
        args.push("-no-reboot".into());
    }
    for (index, device) in config.devices.iter().enumerate() {
        // Each function is a vhost-user connection of its own to the same
        // vdev socket: vdev serves each as a context of the one device.
        let socket = view(&device.socket)?;
        for function in 0..device.functions.max(1) {
            let id = format!("vrdma{index}_{function}");
            let addr = device
                .slot
                .map(|slot| format!(",addr={:#x}", u16::from(slot) + function))
                .unwrap_or_default();
            args.extend([
                "-chardev".into(),
                format!("socket,id={id},path={socket}"),
                "-device".into(),
                format!(
                    "vhost-user-test-device-pci,chardev={id},virtio-id={QEMU_VIRTIO_ID},num_vqs={},vq_size={},config_size={}{addr}",
                    device.num_queues, device.queue_size, device.config_size
                ),
            ]);
        }
    }
    args.extend(config.extra_args.iter().cloned());
    Ok(args)
}

/// The image for a VM test, prepared (cached) if needed. The test fails,
/// saying what to install, without root or the programs the preparation
/// and the initramfs need.
#[track_caller]
pub fn image_for_test(test: &str) -> VmImage {
    crate::need::root(&format!("{test} (debootstrap and chroot)"));
    crate::need::program("debootstrap", "debootstrap");
    crate::need::program("xz", "xz-utils");
    crate::need::program("strip", "binutils");
    VmImage::prepare().unwrap_or_else(|e| panic!("{test}: cannot prepare the VM image: {e}"))
}
