//! VM mode: the vrdma virtio-pci function driven from userspace inside a
//! Linux guest, the way DPDK's virtio PMD does it.
//!
//! Bring-up:
//! 1. Find the function in sysfs (vendor `0x1af4`, device `0x1040 + virtio
//!    id`; the id is 42 by the spec but configurable, because QEMU 11 cannot
//!    run id 42 and the device then runs with another id, e.g. 38), or take
//!    a given PCI address.
//! 2. Take it from the kernel: unbind it from its driver and bind
//!    `uio_pci_generic` through `driver_override`. (vfio-pci would be the
//!    choice in a guest with a vIOMMU or VFIO no-IOMMU mode; Debian's guest
//!    kernel has no-IOMMU off, so uio it is.) Bus mastering is switched on
//!    through the config file, as uio leaves it off.
//! 3. Parse the virtio vendor capabilities from the config space
//!    ([`parse_capabilities`], bounds-checked: a hostile or broken device
//!    gives an error, never a panic) and mmap the BARs they name through
//!    `resourceN` (`read()` on those files gives EIO; MMIO needs a mapping).
//! 4. Reset, ACKNOWLEDGE, DRIVER; then, through the [`Transport`] trait,
//!    features (VERSION_1 required) and FEATURES_OK, config reads (retried
//!    while `config_generation` moves), queue setup (`queue_msix_vector` =
//!    `NO_VECTOR`: uio gives INTx only) and finally DRIVER_OK in
//!    [`Transport::activate`].
//!
//! **Interrupts.** uio_pci_generic delivers the function's INTx on
//! `/dev/uioN`: a read returns the interrupt count (poll says readable
//! when it moved), reading the virtio ISR register acknowledges the
//! device's line. uio_pci_generic's handler masks INTx (the command
//! register's INTx-disable bit) at every interrupt and, having no
//! `irqcontrol`, cannot unmask it through the uio fd (a write there fails
//! with ENOSYS): the driver clears the bit in the config space itself, as
//! DPDK does. `wait` sleeps on that, and `interrupt_fd` hands it to an
//! event thread. One INTx line serves every queue, so a wake-up only
//! means "something happened": the core re-checks its queue and waits
//! again, as it does for any spurious wake-up. Each queue has its own open
//! file of `/dev/uioN`: uio keeps the count per open file, so every
//! queue's waiter sees every interrupt, and one waiter reading the count
//! cannot swallow the wake-up of another that was not yet asleep.
//! Sleeping on the interrupt rather than polling with backoff matters on a
//! TCG guest, where a polling thread would take the vCPU from the
//! application.
//!
//! All register accesses are volatile loads and stores on the BAR mapping.
//! Dropping the transport resets the device (status 0), which makes vdev
//! drop every object of this driver.

use std::fs::{File, OpenOptions};
use std::io::{self, Read};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use super::{MemoryModel, QueueSetup, Transport, TransportError, VIRTIO_F_VERSION_1};

/// PCI vendor of virtio devices.
pub const VIRTIO_PCI_VENDOR: u16 = 0x1af4;
/// Modern virtio PCI device ids are this plus the virtio device id.
pub const VIRTIO_PCI_DEVICE_BASE: u16 = 0x1040;
/// The virtio device id of vrdma (`VIRTIO_ID_RDMA`).
pub const VIRTIO_ID_RDMA: u16 = 42;
/// The driver the function is bound to.
const UIO_DRIVER: &str = "uio_pci_generic";
const SYSFS_PCI: &str = "/sys/bus/pci";

/// PCI config-space offsets.
const PCI_COMMAND: u64 = 0x04;
const PCI_STATUS: usize = 0x06;
const PCI_CAPABILITY_LIST: usize = 0x34;
const PCI_STATUS_CAP_LIST: u16 = 0x10;
const PCI_COMMAND_MEMORY: u16 = 0x2;
const PCI_COMMAND_MASTER: u16 = 0x4;
const PCI_COMMAND_INTX_DISABLE: u16 = 0x400;
/// Capabilities start after the standard header.
const PCI_CAP_MIN: usize = 0x40;
const PCI_CAP_ID_VNDR: u8 = 0x09;

/// `cfg_type` of the virtio vendor capabilities.
mod cfg_type {
    pub const COMMON: u8 = 1;
    pub const NOTIFY: u8 = 2;
    pub const ISR: u8 = 3;
    pub const DEVICE: u8 = 4;
}

/// Offsets in the common configuration structure (virtio 1.2, 4.1.4.3).
mod common {
    pub const DEVICE_FEATURE_SELECT: u32 = 0x00;
    pub const DEVICE_FEATURE: u32 = 0x04;
    pub const DRIVER_FEATURE_SELECT: u32 = 0x08;
    pub const DRIVER_FEATURE: u32 = 0x0c;
    pub const MSIX_CONFIG: u32 = 0x10;
    pub const NUM_QUEUES: u32 = 0x12;
    pub const DEVICE_STATUS: u32 = 0x14;
    pub const CONFIG_GENERATION: u32 = 0x15;
    pub const QUEUE_SELECT: u32 = 0x16;
    pub const QUEUE_SIZE: u32 = 0x18;
    pub const QUEUE_MSIX_VECTOR: u32 = 0x1a;
    pub const QUEUE_ENABLE: u32 = 0x1c;
    pub const QUEUE_NOTIFY_OFF: u32 = 0x1e;
    pub const QUEUE_DESC: u32 = 0x20;
    pub const QUEUE_DRIVER: u32 = 0x28;
    pub const QUEUE_DEVICE: u32 = 0x30;
    /// Bytes of the structure up to `queue_device` inclusive.
    pub const MIN_LEN: u32 = 0x38;
}

/// Device status bits.
mod status {
    pub const ACKNOWLEDGE: u8 = 1;
    pub const DRIVER: u8 = 2;
    pub const DRIVER_OK: u8 = 4;
    pub const FEATURES_OK: u8 = 8;
    pub const FAILED: u8 = 128;
}

/// "No MSI-X vector": interrupts go to INTx.
const NO_VECTOR: u16 = 0xffff;
/// A BAR index must be 0–5.
const MAX_BAR: u8 = 5;
/// Longest capability walk: the config space holds fewer capabilities.
const MAX_CAPS: usize = 48;

/// Errors of the virtio-pci transport.
#[derive(Debug, thiserror::Error)]
pub enum PciError {
    #[error(
        "No virtio PCI function with device id {device:#06x} (virtio id {virtio_id}) in {dir}"
    )]
    NotFound {
        device: u16,
        virtio_id: u16,
        dir: String,
    },
    #[error("{0:?} is not a PCI address (domain:bus:device.function, e.g. 0000:00:04.0)")]
    BadAddress(String),
    #[error("Virtio id {0} is outside 1–191 (PCI device ids 0x1041–0x10ff)")]
    BadVirtioId(u16),
    #[error("PCI function {bdf} is {vendor:04x}:{device:04x}, not a virtio device {VIRTIO_PCI_VENDOR:04x}:{expected:04x}")]
    WrongDevice {
        bdf: String,
        vendor: u16,
        device: u16,
        expected: u16,
    },
    #[error("Cannot {what} ({path})")]
    Sysfs {
        what: &'static str,
        path: String,
        #[source]
        source: io::Error,
    },
    #[error("The {UIO_DRIVER} kernel driver is not loaded (modprobe {UIO_DRIVER}, or insmod uio.ko and uio_pci_generic.ko)")]
    NoUioDriver,
    #[error("PCI function {0} did not get a /dev/uio device after binding {UIO_DRIVER}")]
    NoUioDevice(String),
    #[error("Config space of {len} bytes is too short for a PCI header")]
    ShortConfig { len: usize },
    #[error("Function has no capability list")]
    NoCapabilities,
    #[error("Capability at {at:#x} lies outside the config space ({len} bytes)")]
    CapOutside { at: usize, len: usize },
    #[error("Capability list loops or is longer than {MAX_CAPS} entries")]
    CapLoop,
    #[error("Virtio capability at {at:#x} is {cap_len} bytes, too short for its type")]
    CapTooShort { at: usize, cap_len: u8 },
    #[error("Virtio capability at {at:#x}: offset {offset:#x} + length {length:#x} overflows")]
    CapOverflow { at: usize, offset: u32, length: u32 },
    #[error("Device has no usable virtio {0} capability")]
    MissingCap(&'static str),
    #[error(
        "Virtio {what} structure ({offset:#x} + {length:#x}) lies outside BAR {bar} ({size} bytes)"
    )]
    OutsideBar {
        what: &'static str,
        bar: u8,
        offset: u32,
        length: u32,
        size: u64,
    },
    #[error("Cannot map BAR {bar} of {bdf}")]
    MapBar {
        bar: u8,
        bdf: String,
        #[source]
        source: io::Error,
    },
    #[error("Device did not finish its reset within {0:?}")]
    ResetTimeout(Duration),
    #[error("Device refused the features {0:#x} (FEATURES_OK not kept)")]
    FeaturesRefused(u64),
    #[error("Device config keeps changing while read")]
    ConfigUnstable,
    #[error("Config read of {len} bytes at {offset} exceeds the device config ({size} bytes)")]
    ConfigRange { offset: u32, len: usize, size: u32 },
    #[error("Queue {queue}: device allows at most {max} entries, {size} wanted")]
    QueueSize { queue: u16, max: u16, size: u16 },
    #[error("Queue {queue}: notify address offset {offset:#x} is outside the notify structure")]
    NotifyOutside { queue: u16, offset: u64 },
}

fn sysfs(what: &'static str, path: &Path) -> impl FnOnce(io::Error) -> PciError {
    let path = path.display().to_string();
    move |source| PciError::Sysfs { what, path, source }
}

/// Where one virtio structure is: `length` bytes at `offset` in BAR `bar`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CapLocation {
    pub bar: u8,
    pub offset: u32,
    pub length: u32,
}

/// The virtio structures a function's capabilities point at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VirtioCaps {
    pub common: CapLocation,
    pub notify: CapLocation,
    pub notify_off_multiplier: u32,
    pub isr: CapLocation,
    pub device: Option<CapLocation>,
}

fn le16(b: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_le_bytes(b.get(at..at + 2)?.try_into().ok()?))
}

fn le32(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_le_bytes(b.get(at..at + 4)?.try_into().ok()?))
}

/// Parses the virtio vendor capabilities from a function's config space.
///
/// Follows the virtio 1.2 rules (4.1.4): the first capability of each type
/// wins, capabilities naming a reserved BAR (above 5) are ignored, as are
/// types this driver does not use. Everything is bounds-checked against
/// `config`; the walk stops on a loop.
pub fn parse_capabilities(config: &[u8]) -> Result<VirtioCaps, PciError> {
    let len = config.len();
    let short = PciError::ShortConfig { len };
    let status = le16(config, PCI_STATUS).ok_or(short)?;
    if status & PCI_STATUS_CAP_LIST == 0 {
        return Err(PciError::NoCapabilities);
    }
    let mut at = usize::from(
        *config
            .get(PCI_CAPABILITY_LIST)
            .ok_or(PciError::ShortConfig { len })?
            & 0xfc,
    );
    let (mut common, mut notify, mut isr, mut device) = (None, None, None, None);
    let mut seen = 0;
    while at != 0 {
        seen += 1;
        if seen > MAX_CAPS {
            return Err(PciError::CapLoop);
        }
        if at < PCI_CAP_MIN || at + 2 > len {
            return Err(PciError::CapOutside { at, len });
        }
        let (id, next) = (config[at], usize::from(config[at + 1] & 0xfc));
        if id == PCI_CAP_ID_VNDR {
            if at + 16 > len {
                return Err(PciError::CapOutside { at, len });
            }
            let cap_len = config[at + 2];
            let (kind, bar) = (config[at + 3], config[at + 4]);
            let offset = le32(config, at + 8).ok_or(PciError::CapOutside { at, len })?;
            let length = le32(config, at + 12).ok_or(PciError::CapOutside { at, len })?;
            let needed = if kind == cfg_type::NOTIFY { 20 } else { 16 };
            if usize::from(cap_len) < needed {
                return Err(PciError::CapTooShort { at, cap_len });
            }
            if at + usize::from(cap_len) > len {
                return Err(PciError::CapOutside { at, len });
            }
            if offset.checked_add(length).is_none() {
                return Err(PciError::CapOverflow { at, offset, length });
            }
            let loc = CapLocation {
                bar,
                offset,
                length,
            };
            if bar <= MAX_BAR {
                match kind {
                    cfg_type::COMMON if common.is_none() => common = Some(loc),
                    cfg_type::NOTIFY if notify.is_none() => {
                        let mult = le32(config, at + 16).ok_or(PciError::CapOutside { at, len })?;
                        notify = Some((loc, mult));
                    }
                    cfg_type::ISR if isr.is_none() => isr = Some(loc),
                    cfg_type::DEVICE if device.is_none() => device = Some(loc),
                    _ => {}
                }
            }
        }
        at = next;
    }
    let common = common.ok_or(PciError::MissingCap("common configuration"))?;
    if common.length < common::MIN_LEN {
        return Err(PciError::MissingCap("common configuration (too short)"));
    }
    let (notify, notify_off_multiplier) = notify.ok_or(PciError::MissingCap("notification"))?;
    let isr = isr.ok_or(PciError::MissingCap("ISR status"))?;
    if isr.length == 0 {
        return Err(PciError::MissingCap("ISR status (empty)"));
    }
    Ok(VirtioCaps {
        common,
        notify,
        notify_off_multiplier,
        isr,
        device,
    })
}

/// A PCI function by its address, e.g. `0000:00:04.0`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PciDevice {
    bdf: String,
}

impl PciDevice {
    /// The function at `bdf` (`domain:bus:device.function`; a missing
    /// domain means `0000`).
    pub fn at(bdf: &str) -> Result<Self, PciError> {
        let bad = || PciError::BadAddress(bdf.to_owned());
        let full = if bdf.matches(':').count() == 1 {
            format!("0000:{bdf}")
        } else {
            bdf.to_owned()
        };
        let (dom_bus_dev, func) = full.split_once('.').ok_or_else(bad)?;
        let parts: Vec<&str> = dom_bus_dev.split(':').collect();
        let hex = |s: &str, n: usize| s.len() == n && s.bytes().all(|b| b.is_ascii_hexdigit());
        let valid = parts.len() == 3
            && hex(parts[0], 4)
            && hex(parts[1], 2)
            && hex(parts[2], 2)
            && u8::from_str_radix(parts[2], 16).is_ok_and(|d| d < 32)
            && func.len() == 1
            && func.bytes().all(|b| (b'0'..=b'7').contains(&b));
        if !valid {
            return Err(bad());
        }
        Ok(Self {
            bdf: full.to_ascii_lowercase(),
        })
    }

    /// The first (by address) virtio function with virtio id `virtio_id`.
    pub fn find(virtio_id: u16) -> Result<Self, PciError> {
        Self::find_in(&Path::new(SYSFS_PCI).join("devices"), virtio_id)
    }

    /// [`PciDevice::find`] in a given sysfs `devices` directory.
    pub fn find_in(dir: &Path, virtio_id: u16) -> Result<Self, PciError> {
        let device = device_id(virtio_id)?;
        let entries = std::fs::read_dir(dir).map_err(sysfs("list PCI devices", dir))?;
        let mut found: Vec<String> = entries
            .filter_map(|e| e.ok())
            .filter(|e| read_id(&e.path().join("vendor")) == Some(VIRTIO_PCI_VENDOR))
            .filter(|e| read_id(&e.path().join("device")) == Some(device))
            .filter_map(|e| e.file_name().into_string().ok())
            .collect();
        found.sort();
        let bdf = found.into_iter().next().ok_or_else(|| PciError::NotFound {
            device,
            virtio_id,
            dir: dir.display().to_string(),
        })?;
        Self::at(&bdf)
    }

    /// The address, `domain:bus:device.function`.
    pub fn address(&self) -> &str {
        &self.bdf
    }

    fn path(&self) -> PathBuf {
        Path::new(SYSFS_PCI).join("devices").join(&self.bdf)
    }
}

/// The modern PCI device id of virtio id `virtio_id`.
pub fn device_id(virtio_id: u16) -> Result<u16, PciError> {
    if virtio_id == 0 || virtio_id > 0xbf {
        return Err(PciError::BadVirtioId(virtio_id));
    }
    Ok(VIRTIO_PCI_DEVICE_BASE + virtio_id)
}

/// A sysfs id file (`0x1af4\n`).
fn read_id(path: &Path) -> Option<u16> {
    let text = std::fs::read_to_string(path).ok()?;
    u16::from_str_radix(text.trim().trim_start_matches("0x"), 16).ok()
}

/// One BAR mapped into this process.
#[derive(Debug)]
struct Bar {
    base: usize,
    size: usize,
}

impl Drop for Bar {
    fn drop(&mut self) {
        // SAFETY: unmapping exactly the mapping made in `map_bar`; the
        // transport (which owns every Bar) is the only user.
        unsafe { libc::munmap(self.base as *mut libc::c_void, self.size) };
    }
}

/// A register window: `len` bytes at `base` in a mapped BAR.
#[derive(Debug, Clone, Copy)]
struct Window {
    base: usize,
    len: u32,
}

impl Window {
    fn ptr(&self, off: u32, width: u32) -> usize {
        // Offsets are driver constants or checked by the callers; a bad one
        // is a driver bug, not device input.
        assert!(
            off + width <= self.len,
            "register {off:#x} outside its window"
        );
        self.base + off as usize
    }
    fn read8(&self, off: u32) -> u8 {
        // SAFETY: inside the BAR mapping, which lives as long as the
        // transport; MMIO is accessed with volatile loads only.
        unsafe { (self.ptr(off, 1) as *const u8).read_volatile() }
    }
    fn read16(&self, off: u32) -> u16 {
        // SAFETY: as in `read8`; virtio registers are naturally aligned.
        u16::from_le(unsafe { (self.ptr(off, 2) as *const u16).read_volatile() })
    }
    fn read32(&self, off: u32) -> u32 {
        // SAFETY: as in `read16`.
        u32::from_le(unsafe { (self.ptr(off, 4) as *const u32).read_volatile() })
    }
    fn write8(&self, off: u32, v: u8) {
        // SAFETY: as in `read8`, with a volatile store.
        unsafe { (self.ptr(off, 1) as *mut u8).write_volatile(v) }
    }
    fn write16(&self, off: u32, v: u16) {
        // SAFETY: as in `write8`, aligned.
        unsafe { (self.ptr(off, 2) as *mut u16).write_volatile(v.to_le()) }
    }
    fn write32(&self, off: u32, v: u32) {
        // SAFETY: as in `write8`, aligned.
        unsafe { (self.ptr(off, 4) as *mut u32).write_volatile(v.to_le()) }
    }
    /// A 64-bit register, written as two 32-bit halves, low first (4.1.3.1).
    fn write64(&self, off: u32, v: u64) {
        self.write32(off, v as u32);
        self.write32(off + 4, (v >> 32) as u32);
    }
}

struct State {
    /// Queues set up: their notify offsets (queue_notify_off).
    notify_off: Vec<Option<u16>>,
}

/// A vrdma device reached through virtio-pci from userspace.
pub struct VirtioPciTransport {
    device: PciDevice,
    _bars: Vec<Bar>,
    common: Window,
    notify: Window,
    notify_off_multiplier: u32,
    isr: Window,
    device_cfg: Option<Window>,
    num_queues: u16,
    /// `/dev/uioN` of the function.
    uio_path: PathBuf,
    /// An open file of `/dev/uioN` per queue, opened when the queue is
    /// first waited on (see the module comment).
    listeners: Vec<OnceLock<File>>,
    /// The function's config space (sysfs), to unmask INTx.
    config: File,
    state: Mutex<State>,
}

impl std::fmt::Debug for VirtioPciTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VirtioPciTransport")
            .field("device", &self.device)
            .field("num_queues", &self.num_queues)
            .finish_non_exhaustive()
    }
}

impl VirtioPciTransport {
    /// Takes `device` from the kernel, maps it and resets it, leaving it in
    /// ACKNOWLEDGE | DRIVER for [`Transport::negotiate_features`].
    pub fn open(device: &PciDevice, virtio_id: u16) -> Result<Self, PciError> {
        let path = device.path();
        let expected = device_id(virtio_id)?;
        let (vendor, dev_id) = (read_id(&path.join("vendor")), read_id(&path.join("device")));
        if vendor != Some(VIRTIO_PCI_VENDOR) || dev_id != Some(expected) {
            return Err(PciError::WrongDevice {
                bdf: device.bdf.clone(),
                vendor: vendor.unwrap_or(0),
                device: dev_id.unwrap_or(0),
                expected,
            });
        }
        bind_uio(device)?;
        let (uio_path, uio) = open_uio(device)?;
        let config_path = path.join("config");
        let config =
            std::fs::read(&config_path).map_err(sysfs("read the config space", &config_path))?;
        let caps = parse_capabilities(&config)?;
        let config_file = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_CLOEXEC)
            .open(&config_path)
            .map_err(sysfs("open the config space for writing", &config_path))?;
        enable_bus_master(&config_file, &config)
            .map_err(sysfs("enable bus mastering", &config_path))?;

        let mut bars: Vec<(u8, Bar)> = Vec::new();
        let mut window = |what: &'static str, loc: CapLocation| -> Result<Window, PciError> {
            if !bars.iter().any(|(i, _)| *i == loc.bar) {
                bars.push((loc.bar, map_bar(device, loc.bar)?));
            }
            let bar = bars
                .iter()
                .find(|(i, _)| *i == loc.bar)
                .map(|(_, b)| b)
                .ok_or(PciError::MissingCap(what))?;
            let end = u64::from(loc.offset) + u64::from(loc.length);
            if end > bar.size as u64 {
                return Err(PciError::OutsideBar {
                    what,
                    bar: loc.bar,
                    offset: loc.offset,
                    length: loc.length,
                    size: bar.size as u64,
                });
            }
            Ok(Window {
                base: bar.base + loc.offset as usize,
                len: loc.length,
            })
        };
        let common = window("common configuration", caps.common)?;
        let notify = window("notification", caps.notify)?;
        let isr = window("ISR status", caps.isr)?;
        let device_cfg = caps
            .device
            .map(|d| window("device configuration", d))
            .transpose()?;
        let bars = bars.into_iter().map(|(_, b)| b).collect();

        let mut transport = Self {
            device: device.clone(),
            _bars: bars,
            common,
            notify,
            notify_off_multiplier: caps.notify_off_multiplier,
            isr,
            device_cfg,
            num_queues: 0,
            uio_path,
            listeners: Vec::new(),
            config: config_file,
            state: Mutex::new(State {
                notify_off: Vec::new(),
            }),
        };
        transport.reset()?;
        let num_queues = transport.common.read16(common::NUM_QUEUES);
        transport.num_queues = num_queues;
        transport.state = Mutex::new(State {
            notify_off: vec![None; usize::from(num_queues)],
        });
        transport.listeners = (0..num_queues).map(|_| OnceLock::new()).collect();
        if let Some(first) = transport.listeners.first() {
            let _ = first.set(uio);
        }
        transport.set_status(status::ACKNOWLEDGE);
        transport.set_status(status::ACKNOWLEDGE | status::DRIVER);
        // Unmask INTx once: from here on `wait` unmasks after each interrupt.
        transport.unmask();
        tracing::info!(bdf = %device.bdf, num_queues, "Took the vrdma PCI function");
        Ok(transport)
    }

    fn set_status(&self, s: u8) {
        self.common.write8(common::DEVICE_STATUS, s);
    }

    fn status(&self) -> u8 {
        self.common.read8(common::DEVICE_STATUS)
    }

    /// Writes 0 to the status and waits until the device reads back 0
    /// (4.1.4.3.2: the reset is complete then).
    fn reset(&self) -> Result<(), PciError> {
        const TIMEOUT: Duration = Duration::from_secs(5);
        self.set_status(0);
        let start = Instant::now();
        while self.status() != 0 {
            if start.elapsed() > TIMEOUT {
                return Err(PciError::ResetTimeout(TIMEOUT));
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        Ok(())
    }

    fn unmask(&self) {
        if let Err(e) = unmask_intx(&self.config) {
            tracing::warn!(bdf = %self.device.bdf, error = %e, "Cannot unmask INTx");
        }
    }

    /// `queue`'s open file of `/dev/uioN`, opened on first use.
    fn listener(&self, queue: u16) -> Result<&File, TransportError> {
        let slot = self
            .listeners
            .get(usize::from(queue))
            .ok_or(TransportError::NoQueue(queue))?;
        if let Some(file) = slot.get() {
            return Ok(file);
        }
        let file = open_listener(&self.uio_path)
            .map_err(|source| TransportError::Wait { queue, source })?;
        // A racing thread may have set it first; its file is as good.
        let _ = slot.set(file);
        // A new file counts from now: an interrupt that came before, and
        // that nobody acknowledged yet, left INTx masked with the line
        // still up. Unmasking makes the level-triggered line fire again,
        // so this queue's waiter sees it too.
        self.unmask();
        slot.get().ok_or(TransportError::NoQueue(queue))
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Reads device config bytes once, in 4-byte accesses where aligned.
    fn read_config_once(&self, cfg: &Window, offset: u32, buf: &mut [u8]) {
        let mut i = 0usize;
        while i < buf.len() {
            let off = offset + i as u32;
            if off.is_multiple_of(4) && buf.len() - i >= 4 {
                buf[i..i + 4].copy_from_slice(&cfg.read32(off).to_le_bytes());
                i += 4;
            } else {
                buf[i] = cfg.read8(off);
                i += 1;
            }
        }
    }
}

impl Drop for VirtioPciTransport {
    fn drop(&mut self) {
        // The device forgets this driver: vdev drops every object of it.
        self.set_status(0);
        tracing::debug!(bdf = %self.device.bdf, "Reset the vrdma PCI function");
    }
}

impl Transport for VirtioPciTransport {
    fn memory_model(&self) -> MemoryModel {
        MemoryModel::GuestPhysical
    }

    fn negotiate_features(&self, wanted: u64) -> Result<u64, TransportError> {
        let c = &self.common;
        let mut offered = 0u64;
        for half in 0..2u32 {
            c.write32(common::DEVICE_FEATURE_SELECT, half);
            offered |= u64::from(c.read32(common::DEVICE_FEATURE)) << (32 * half);
        }
        if offered & VIRTIO_F_VERSION_1 == 0 {
            self.set_status(self.status() | status::FAILED);
            return Err(TransportError::MissingFeature("VIRTIO_F_VERSION_1"));
        }
        let acked = (wanted | VIRTIO_F_VERSION_1) & offered;
        for half in 0..2u32 {
            c.write32(common::DRIVER_FEATURE_SELECT, half);
            c.write32(common::DRIVER_FEATURE, (acked >> (32 * half)) as u32);
        }
        self.set_status(self.status() | status::FEATURES_OK);
        if self.status() & status::FEATURES_OK == 0 {
            self.set_status(self.status() | status::FAILED);
            return Err(PciError::FeaturesRefused(acked).into());
        }
        Ok(acked)
    }

    fn num_queues(&self) -> u16 {
        self.num_queues
    }

    fn read_config(&self, offset: u32, buf: &mut [u8]) -> Result<(), TransportError> {
        let cfg = self
            .device_cfg
            .ok_or(PciError::MissingCap("device configuration"))?;
        let end = u64::from(offset) + buf.len() as u64;
        if end > u64::from(cfg.len) {
            return Err(PciError::ConfigRange {
                offset,
                len: buf.len(),
                size: cfg.len,
            }
            .into());
        }
        for _ in 0..16 {
            let before = self.common.read8(common::CONFIG_GENERATION);
            self.read_config_once(&cfg, offset, buf);
            if self.common.read8(common::CONFIG_GENERATION) == before {
                return Ok(());
            }
        }
        Err(PciError::ConfigUnstable.into())
    }

    fn add_memory(&self, _region: &crate::dma::DmaRegion<'_>) -> Result<(), TransportError> {
        // The device reaches all guest memory: there is nothing to hand over.
        Ok(())
    }

    fn remove_memory(&self, _region: &crate::dma::DmaRegion<'_>) -> Result<(), TransportError> {
        Ok(())
    }

    fn setup_queue(&self, q: &QueueSetup) -> Result<(), TransportError> {
        if q.index >= self.num_queues {
            return Err(TransportError::NoQueue(q.index));
        }
        let c = &self.common;
        let mut state = self.state();
        c.write16(common::QUEUE_SELECT, q.index);
        let max = c.read16(common::QUEUE_SIZE);
        if max == 0 || q.size > max {
            return Err(PciError::QueueSize {
                queue: q.index,
                max,
                size: q.size,
            }
            .into());
        }
        c.write16(common::QUEUE_SIZE, q.size);
        c.write64(common::QUEUE_DESC, q.desc_addr);
        c.write64(common::QUEUE_DRIVER, q.avail_addr);
        c.write64(common::QUEUE_DEVICE, q.used_addr);
        c.write16(common::QUEUE_MSIX_VECTOR, NO_VECTOR);
        let notify_off = c.read16(common::QUEUE_NOTIFY_OFF);
        let offset = u64::from(notify_off) * u64::from(self.notify_off_multiplier);
        if offset + 2 > u64::from(self.notify.len) {
            return Err(PciError::NotifyOutside {
                queue: q.index,
                offset,
            }
            .into());
        }
        c.write16(common::QUEUE_ENABLE, 1);
        state.notify_off[usize::from(q.index)] = Some(notify_off);
        Ok(())
    }

    fn activate(&self) -> Result<(), TransportError> {
        self.common.write16(common::MSIX_CONFIG, NO_VECTOR);
        self.set_status(self.status() | status::DRIVER_OK);
        Ok(())
    }

    fn notify(&self, queue: u16) -> Result<(), TransportError> {
        let off = self
            .state()
            .notify_off
            .get(usize::from(queue))
            .copied()
            .flatten()
            .ok_or(TransportError::NoQueue(queue))?;
        // Checked against the notify window in `setup_queue`.
        let at = u32::from(off) * self.notify_off_multiplier;
        self.notify.write16(at, queue);
        Ok(())
    }

    fn wait(&self, queue: u16, timeout: Option<Duration>) -> Result<bool, TransportError> {
        let timeout_ms = timeout.map_or(-1, |t| i32::try_from(t.as_millis()).unwrap_or(i32::MAX));
        let mut pfd = libc::pollfd {
            fd: self.listener(queue)?.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd for the duration of the call; the uio fd
        // stays open while `self` lives.
        let n = unsafe { libc::poll(&mut pfd, 1, timeout_ms) };
        if n < 0 {
            let source = io::Error::last_os_error();
            if source.kind() == io::ErrorKind::Interrupted {
                return Ok(false);
            }
            return Err(TransportError::Wait { queue, source });
        }
        if n == 0 {
            return Ok(false);
        }
        self.acknowledge(queue)?;
        Ok(true)
    }

    fn interrupt_fd(&self, queue: u16) -> Option<BorrowedFd<'_>> {
        self.listener(queue).ok().map(|f| f.as_fd())
    }

    fn acknowledge(&self, queue: u16) -> Result<(), TransportError> {
        let mut count = [0u8; 4];
        match self.listener(queue)?.read_exact(&mut count) {
            Ok(_) => {}
            // Another thread read this queue's count: the interrupt
            // still happened, and that thread acknowledges it.
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(()),
            Err(source) => return Err(TransportError::Wait { queue, source }),
        }
        // Reading the ISR acknowledges the device's line; only then may INTx
        // be unmasked, or the level-triggered line fires again at once.
        // Waiters of other queues may do the same for the same interrupt:
        // the ISR then reads 0 and INTx is unmasked already.
        let _ = self.isr.read8(0);
        self.unmask();
        Ok(())
    }
}

/// Binds `device` to uio_pci_generic unless it already is.
fn bind_uio(device: &PciDevice) -> Result<(), PciError> {
    let path = device.path();
    let driver = std::fs::read_link(path.join("driver"))
        .ok()
        .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()));
    if driver.as_deref() == Some(UIO_DRIVER) {
        return Ok(());
    }
    let uio_dir = Path::new(SYSFS_PCI).join("drivers").join(UIO_DRIVER);
    if !uio_dir.exists() {
        return Err(PciError::NoUioDriver);
    }
    if let Some(name) = &driver {
        let unbind = path.join("driver/unbind");
        std::fs::write(&unbind, &device.bdf).map_err(sysfs("unbind the kernel driver", &unbind))?;
        tracing::info!(bdf = %device.bdf, driver = %name, "Unbound the kernel driver");
    }
    // driver_override binds this function only (new_id would bind every
    // function with the same ids).
    let over = path.join("driver_override");
    std::fs::write(&over, UIO_DRIVER).map_err(sysfs("set driver_override", &over))?;
    let bind = uio_dir.join("bind");
    std::fs::write(&bind, &device.bdf).map_err(sysfs("bind uio_pci_generic", &bind))?;
    Ok(())
}

/// Opens the function's `/dev/uioN`; returns its path and the open file.
fn open_uio(device: &PciDevice) -> Result<(PathBuf, File), PciError> {
    let dir = device.path().join("uio");
    let name = std::fs::read_dir(&dir)
        .ok()
        .and_then(|mut d| d.find_map(|e| e.ok()))
        .map(|e| e.file_name())
        .ok_or_else(|| PciError::NoUioDevice(device.bdf.clone()))?;
    let dev = Path::new("/dev").join(name);
    let file = open_listener(&dev).map_err(sysfs("open the uio device", &dev))?;
    Ok((dev, file))
}

/// One open file of a uio device: its own interrupt count (non-blocking:
/// a count another thread read is not waited for).
fn open_listener(dev: &Path) -> io::Result<File> {
    OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(dev)
}

/// Sets memory-space and bus-master enable in the command register of
/// `config` (the config-space file; `image` its bytes as read before): the
/// device may then reach guest memory (QEMU checks bus mastering).
fn enable_bus_master(config: &File, image: &[u8]) -> io::Result<()> {
    let cmd = le16(image, PCI_COMMAND as usize)
        .ok_or_else(|| io::Error::from(io::ErrorKind::UnexpectedEof))?;
    let wanted = cmd | PCI_COMMAND_MEMORY | PCI_COMMAND_MASTER;
    if wanted == cmd {
        return Ok(());
    }
    config.write_all_at(&wanted.to_le_bytes(), PCI_COMMAND)
}

/// Clears the INTx-disable bit of the command register in `config` (the
/// config-space file), leaving the other bits — bus mastering above all —
/// as they are. Returns whether the bit was set.
fn unmask_intx(config: &File) -> io::Result<bool> {
    let mut raw = [0u8; 2];
    config.read_exact_at(&mut raw, PCI_COMMAND)?;
    let cmd = u16::from_le_bytes(raw);
    if cmd & PCI_COMMAND_INTX_DISABLE == 0 {
        return Ok(false);
    }
    config.write_all_at(
        &(cmd & !PCI_COMMAND_INTX_DISABLE).to_le_bytes(),
        PCI_COMMAND,
    )?;
    Ok(true)
}

/// Maps BAR `bar` of `device` through its sysfs resource file.
fn map_bar(device: &PciDevice, bar: u8) -> Result<Bar, PciError> {
    let path = device.path().join(format!("resource{bar}"));
    let err = |source| PciError::MapBar {
        bar,
        bdf: device.bdf.clone(),
        source,
    };
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_SYNC | libc::O_CLOEXEC)
        .open(&path)
        .map_err(err)?;
    let size = file.metadata().map_err(err)?.len();
    let size =
        usize::try_from(size).map_err(|_| err(io::Error::from(io::ErrorKind::InvalidData)))?;
    if size == 0 {
        return Err(err(io::Error::from(io::ErrorKind::InvalidData)));
    }
    // Only ever accessed with volatile MMIO.
    let ptr = crate::dma::map_shared(file.as_fd(), size).map_err(err)?;
    Ok(Bar {
        base: ptr as usize,
        size,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Config space of a modern virtio PCI function laid out the way QEMU
    /// lays out its virtio-pci devices (built by hand from the virtio 1.2
    /// capability layout and QEMU's `virtio-pci` modern BAR: BAR 4 with
    /// common config at 0, ISR at 0x1000, device config at 0x2000, notify
    /// at 0x3000 with multiplier 4), behind an MSI-X capability and the
    /// PCI-config-access capability, for virtio id 38.
    fn qemu_like_config() -> Vec<u8> {
        let mut c = vec![0u8; 256];
        c[0..2].copy_from_slice(&VIRTIO_PCI_VENDOR.to_le_bytes());
        c[2..4].copy_from_slice(&0x1066u16.to_le_bytes());
        c[PCI_STATUS..PCI_STATUS + 2].copy_from_slice(&PCI_STATUS_CAP_LIST.to_le_bytes());
        c[PCI_CAPABILITY_LIST] = 0x98;
        // MSI-X (id 0x11), 12 bytes.
        c[0x98] = 0x11;
        c[0x99] = 0x84;
        let mut vndr = |at: usize, next: u8, len: u8, kind: u8, bar: u8, off: u32, length: u32| {
            c[at] = PCI_CAP_ID_VNDR;
            c[at + 1] = next;
            c[at + 2] = len;
            c[at + 3] = kind;
            c[at + 4] = bar;
            c[at + 8..at + 12].copy_from_slice(&off.to_le_bytes());
            c[at + 12..at + 16].copy_from_slice(&length.to_le_bytes());
        };
        vndr(0x84, 0x70, 20, 5, 0, 0, 0); // VIRTIO_PCI_CAP_PCI_CFG
        vndr(0x70, 0x60, 20, cfg_type::NOTIFY, 4, 0x3000, 0x1000);
        vndr(0x60, 0x50, 16, cfg_type::DEVICE, 4, 0x2000, 0x1000);
        vndr(0x50, 0x40, 16, cfg_type::ISR, 4, 0x1000, 0x1000);
        vndr(0x40, 0x00, 16, cfg_type::COMMON, 4, 0, 0x1000);
        c[0x70 + 16..0x70 + 20].copy_from_slice(&4u32.to_le_bytes());
        c
    }

    fn expected() -> VirtioCaps {
        let at = |offset| CapLocation {
            bar: 4,
            offset,
            length: 0x1000,
        };
        VirtioCaps {
            common: at(0),
            notify: at(0x3000),
            notify_off_multiplier: 4,
            isr: at(0x1000),
            device: Some(at(0x2000)),
        }
    }

    #[test]
    fn qemu_layout_parses() {
        assert_eq!(parse_capabilities(&qemu_like_config()).unwrap(), expected());
        // A 4 KiB (PCIe) config space with the same capabilities parses too.
        let mut big = qemu_like_config();
        big.resize(4096, 0);
        assert_eq!(parse_capabilities(&big).unwrap(), expected());
    }

    /// The real device's config space saved from QEMU by the VM test
    /// harness, when it is there.
    #[test]
    fn saved_qemu_config_spaces_parse() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/vm/fixtures");
        let Ok(entries) = std::fs::read_dir(&dir) else {
            eprintln!("no fixtures in {}", dir.display());
            return;
        };
        for e in entries.filter_map(|e| e.ok()) {
            let name = e.file_name().to_string_lossy().into_owned();
            if !name.contains("config") || name.ends_with(".md") {
                continue;
            }
            let bytes = std::fs::read(e.path()).expect("fixture");
            let caps = parse_capabilities(&bytes).unwrap_or_else(|err| panic!("{name}: {err}"));
            assert!(caps.device.is_some(), "{name}: no device config");
        }
    }

    #[test]
    fn first_capability_of_a_type_wins_and_reserved_bars_are_ignored() {
        let mut c = qemu_like_config();
        // A second common cap in front, naming BAR 6: ignored, the real one wins.
        c[PCI_CAPABILITY_LIST] = 0xb0;
        c[0xb0] = PCI_CAP_ID_VNDR;
        c[0xb1] = 0x98;
        c[0xb2] = 16;
        c[0xb3] = cfg_type::COMMON;
        c[0xb4] = 6;
        assert_eq!(parse_capabilities(&c).unwrap(), expected());
        // If the BAR-6 one is the only common cap, there is none.
        c[0x43] = 0x7f;
        assert!(matches!(
            parse_capabilities(&c),
            Err(PciError::MissingCap("common configuration"))
        ));
    }

    #[test]
    fn hostile_capability_lists_are_errors() {
        let base = qemu_like_config();
        let with = |f: &dyn Fn(&mut Vec<u8>)| {
            let mut c = base.clone();
            f(&mut c);
            parse_capabilities(&c)
        };
        // A loop: the last capability points back at the first.
        assert!(matches!(with(&|c| c[0x41] = 0x98), Err(PciError::CapLoop)));
        // A self-loop.
        assert!(matches!(with(&|c| c[0x51] = 0x50), Err(PciError::CapLoop)));
        // The list pointer past the config space (a 64-byte header only).
        assert!(matches!(
            with(&|c| c.truncate(0x90)),
            Err(PciError::CapOutside { at: 0x98, .. })
        ));
        // A capability in the standard header.
        assert!(matches!(
            with(&|c| c[PCI_CAPABILITY_LIST] = 0x20),
            Err(PciError::CapOutside { at: 0x20, .. })
        ));
        // A capability whose body runs past the end.
        assert!(matches!(
            with(&|c| {
                c[0x41] = 0xf8;
                c[0xf8] = PCI_CAP_ID_VNDR;
            }),
            Err(PciError::CapOutside { at: 0xf8, .. })
        ));
        // cap_len running past the end of the config space.
        assert!(matches!(
            with(&|c| {
                c[0x41] = 0xe8;
                c[0xe8] = PCI_CAP_ID_VNDR;
                c[0xea] = 0xff;
            }),
            Err(PciError::CapOutside { at: 0xe8, .. })
        ));
        // offset + length overflows.
        assert!(matches!(
            with(&|c| {
                c[0x40 + 8] = 0x10;
                c[0x40 + 12..0x40 + 16].copy_from_slice(&u32::MAX.to_le_bytes());
            }),
            Err(PciError::CapOverflow { at: 0x40, .. })
        ));
        // A notify capability without room for its multiplier.
        assert!(matches!(
            with(&|c| c[0x72] = 16),
            Err(PciError::CapTooShort {
                at: 0x70,
                cap_len: 16
            })
        ));
        // A common configuration too short for the registers.
        assert!(matches!(
            with(&|c| c[0x40 + 12..0x40 + 16].copy_from_slice(&0x10u32.to_le_bytes())),
            Err(PciError::MissingCap(_))
        ));
        // No capability list at all, or a config space with no header.
        assert!(matches!(
            with(&|c| c[PCI_STATUS] = 0),
            Err(PciError::NoCapabilities)
        ));
        assert!(matches!(
            parse_capabilities(&base[..4]),
            Err(PciError::ShortConfig { len: 4 })
        ));
        // Every prefix of the config space gives an answer, never a panic.
        for len in 0..base.len() {
            let _ = parse_capabilities(&base[..len]);
        }
    }

    #[test]
    fn addresses_and_ids() {
        assert_eq!(
            PciDevice::at("0000:00:04.0").unwrap().address(),
            "0000:00:04.0"
        );
        assert_eq!(PciDevice::at("00:1F.7").unwrap().address(), "0000:00:1f.7");
        for bad in [
            "",
            "00:04",
            "0000:00:04.8",
            "0000:00:20.0",
            "x000:00:04.0",
            "0:0:0:0.0",
        ] {
            assert!(PciDevice::at(bad).is_err(), "{bad:?}");
        }
        assert_eq!(device_id(42).unwrap(), 0x106a);
        assert_eq!(device_id(38).unwrap(), 0x1066);
        assert!(device_id(0).is_err());
        assert!(device_id(0xc0).is_err());
    }

    #[test]
    fn find_picks_the_first_function_with_the_ids() {
        let dir = std::env::temp_dir().join(format!("vrdma-sysfs-{}", std::process::id()));
        let fake = |bdf: &str, vendor: &str, device: &str| {
            let d = dir.join(bdf);
            std::fs::create_dir_all(&d).unwrap();
            std::fs::write(d.join("vendor"), format!("{vendor}\n")).unwrap();
            std::fs::write(d.join("device"), format!("{device}\n")).unwrap();
        };
        fake("0000:00:05.0", "0x1af4", "0x1066");
        fake("0000:00:03.0", "0x1af4", "0x1041"); // a virtio-net
        fake("0000:00:04.0", "0x1af4", "0x1066");
        fake("0000:00:02.0", "0x8086", "0x1066");
        assert_eq!(
            PciDevice::find_in(&dir, 38).unwrap().address(),
            "0000:00:04.0"
        );
        assert!(matches!(
            PciDevice::find_in(&dir, 42),
            Err(PciError::NotFound { device: 0x106a, .. })
        ));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A copy of the config-space fixture QEMU shows, as a file.
    fn config_file(command: u16) -> (PathBuf, File) {
        let fixture = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../tests/vm/fixtures/vrdma-pci-config.bin"
        );
        let mut image = std::fs::read(fixture).unwrap();
        image[4..6].copy_from_slice(&command.to_le_bytes());
        let path =
            std::env::temp_dir().join(format!("vrdma-config-{}-{command:x}", std::process::id()));
        std::fs::write(&path, &image).unwrap();
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .unwrap();
        (path, file)
    }

    fn command_of(path: &Path) -> u16 {
        let image = std::fs::read(path).unwrap();
        u16::from_le_bytes([image[4], image[5]])
    }

    #[test]
    fn unmasking_clears_only_the_intx_disable_bit() {
        // As uio_pci_generic's handler leaves it after an interrupt: memory,
        // bus mastering and INTx disabled.
        let masked = PCI_COMMAND_MEMORY | PCI_COMMAND_MASTER | PCI_COMMAND_INTX_DISABLE;
        let (path, file) = config_file(masked);
        assert!(unmask_intx(&file).unwrap());
        assert_eq!(command_of(&path), PCI_COMMAND_MEMORY | PCI_COMMAND_MASTER);
        // Unmasked already: nothing written.
        assert!(!unmask_intx(&file).unwrap());
        assert_eq!(command_of(&path), PCI_COMMAND_MEMORY | PCI_COMMAND_MASTER);
        // The rest of the config space is untouched.
        let image = std::fs::read(&path).unwrap();
        assert_eq!(parse_capabilities(&image).unwrap().notify_off_multiplier, 4);
        std::fs::remove_file(&path).unwrap();
    }

    #[test]
    fn bus_mastering_keeps_the_other_command_bits() {
        let (path, file) = config_file(PCI_COMMAND_INTX_DISABLE);
        let image = std::fs::read(&path).unwrap();
        enable_bus_master(&file, &image).unwrap();
        assert_eq!(
            command_of(&path),
            PCI_COMMAND_INTX_DISABLE | PCI_COMMAND_MEMORY | PCI_COMMAND_MASTER
        );
        std::fs::remove_file(&path).unwrap();
    }
}
