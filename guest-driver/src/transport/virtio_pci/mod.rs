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
//! device's line — for every queue at once. uio_pci_generic's handler
//! masks INTx (the command register's INTx-disable bit) at every interrupt
//! and, having no `irqcontrol`, cannot unmask it through the uio fd (a
//! write there fails with ENOSYS): the driver clears the bit in the config
//! space itself, as DPDK does. One line serves every queue, so it is
//! handled as a kernel handles a shared line ([`interrupts`]): one thread
//! owns `/dev/uioN`, takes each interrupt (count, ISR, unmask) and wakes
//! the waiter of every queue through the queue's own eventfd, which is
//! what `wait`, `interrupt_fd` and `acknowledge` work on. A waiter re-checks
//! its queue after each wake-up, so one meant for another queue only costs
//! a look. Sleeping on the interrupt rather than polling with backoff
//! matters on a TCG guest, where a polling thread would take the vCPU from
//! the application.
//!
//! All register accesses are volatile loads and stores on the BAR mapping.
//! Dropping the transport resets the device (status 0), which makes vdev
//! drop every object of this driver.

use std::fs::{File, OpenOptions};
use std::io::{self, Read};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::{MemoryModel, QueueSetup, Transport, TransportError, VIRTIO_F_VERSION_1};

mod caps;
mod interrupts;

use interrupts::{Interrupts, Line};

use caps::{le16, MAX_CAPS};
pub use caps::{parse_capabilities, CapLocation, VirtioCaps};

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
const PCI_COMMAND_MEMORY: u16 = 0x2;
const PCI_COMMAND_MASTER: u16 = 0x4;
const PCI_COMMAND_INTX_DISABLE: u16 = 0x400;

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
    #[error("PCI function {0} is driven by another process (its /dev/uio device is locked)")]
    Busy(String),
    #[error("All {count} PCI functions of the device (virtio id {virtio_id}) are driven by other processes: each function is one context of the device, give the VM more")]
    AllBusy { count: usize, virtio_id: u16 },
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
    #[error("Cannot start the interrupt thread")]
    Interrupts(#[source] io::Error),
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

    /// Every virtio function with virtio id `virtio_id`, by address: the
    /// context slots of the VM's vrdma device (docs/architecture.md,
    /// "Contexts"). Never empty.
    pub fn find_all(virtio_id: u16) -> Result<Vec<Self>, PciError> {
        Self::find_all_in(&Path::new(SYSFS_PCI).join("devices"), virtio_id)
    }

    /// [`PciDevice::find_all`] in a given sysfs `devices` directory.
    pub fn find_all_in(dir: &Path, virtio_id: u16) -> Result<Vec<Self>, PciError> {
        let device = device_id(virtio_id)?;
        let entries = std::fs::read_dir(dir).map_err(sysfs("list PCI devices", dir))?;
        let mut found: Vec<String> = entries
            .filter_map(|e| e.ok())
            .filter(|e| read_id(&e.path().join("vendor")) == Some(VIRTIO_PCI_VENDOR))
            .filter(|e| read_id(&e.path().join("device")) == Some(device))
            .filter_map(|e| e.file_name().into_string().ok())
            .collect();
        if found.is_empty() {
            return Err(PciError::NotFound {
                device,
                virtio_id,
                dir: dir.display().to_string(),
            });
        }
        found.sort();
        found.iter().map(|bdf| Self::at(bdf)).collect()
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
        // transport (its interrupt thread, the only other user of a
        // window, ends before the mapping); MMIO is accessed with
        // volatile loads only.
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
    /// Declared before the BARs: its thread reads the ISR in them, so it
    /// stops first (`Drop` stops it explicitly, too).
    interrupts: Interrupts,
    _bars: Vec<Bar>,
    common: Window,
    notify: Window,
    notify_off_multiplier: u32,
    device_cfg: Option<Window>,
    num_queues: u16,
    state: Mutex<State>,
    /// This process's claim on the function (see [`claim`]).
    _claim: File,
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
        // Claimed before the uio device is opened: closing a uio descriptor
        // switches the function's bus mastering off (uio_pci_generic's
        // release), which stops the device under its owner.
        let claim = claim(device)?;
        bind_uio(device)?;
        let uio = open_uio(device)?;
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

        reset(&common)?;
        let num_queues = common.read16(common::NUM_QUEUES);
        // Unmask INTx once: from here on the interrupt thread unmasks it
        // after each interrupt.
        if let Err(e) = unmask_intx(&config_file) {
            tracing::warn!(bdf = %device.bdf, error = %e, "Cannot unmask INTx");
        }
        let line = UioLine {
            uio,
            isr,
            config: config_file,
        };
        let interrupts = Interrupts::start(line, num_queues).map_err(PciError::Interrupts)?;
        let transport = Self {
            device: device.clone(),
            interrupts,
            _bars: bars,
            common,
            notify,
            notify_off_multiplier: caps.notify_off_multiplier,
            device_cfg,
            num_queues,
            _claim: claim,
            state: Mutex::new(State {
                notify_off: vec![None; usize::from(num_queues)],
            }),
        };
        transport.set_status(status::ACKNOWLEDGE);
        transport.set_status(status::ACKNOWLEDGE | status::DRIVER);
        tracing::info!(bdf = %device.bdf, num_queues, "Took the vrdma PCI function");
        Ok(transport)
    }

    fn set_status(&self, s: u8) {
        self.common.write8(common::DEVICE_STATUS, s);
    }

    fn status(&self) -> u8 {
        self.common.read8(common::DEVICE_STATUS)
    }

    fn check_queue(&self, queue: u16) -> Result<(), TransportError> {
        if queue < self.num_queues {
            Ok(())
        } else {
            Err(TransportError::NoQueue(queue))
        }
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
        // The interrupt thread reads the ISR in a BAR: it ends before the
        // BARs are unmapped (and a reset's interrupt needs no one).
        self.interrupts.stop();
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
        self.check_queue(queue)?;
        self.interrupts
            .wait(queue, timeout)
            .map_err(|source| TransportError::Wait { queue, source })
    }

    fn interrupt_fd(&self, queue: u16) -> Option<BorrowedFd<'_>> {
        self.interrupts.fd(queue)
    }

    fn acknowledge(&self, queue: u16) -> Result<(), TransportError> {
        self.check_queue(queue)?;
        self.interrupts
            .acknowledge(queue)
            .map_err(|source| TransportError::Wait { queue, source })
    }
}

/// Writes 0 to the status in `common` and waits until the device reads
/// back 0 (4.1.4.3.2: the reset is complete then).
fn reset(common: &Window) -> Result<(), PciError> {
    const TIMEOUT: Duration = Duration::from_secs(5);
    common.write8(common::DEVICE_STATUS, 0);
    let start = Instant::now();
    while common.read8(common::DEVICE_STATUS) != 0 {
        if start.elapsed() > TIMEOUT {
            return Err(PciError::ResetTimeout(TIMEOUT));
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    Ok(())
}

/// The function's INTx line through uio_pci_generic (see the module
/// comment).
struct UioLine {
    /// `/dev/uioN`, non-blocking.
    uio: File,
    /// The ISR status register, in a BAR the transport keeps mapped until
    /// the interrupt thread has ended.
    isr: Window,
    /// The function's config space (sysfs), to unmask INTx.
    config: File,
}

impl Line for UioLine {
    fn fd(&self) -> BorrowedFd<'_> {
        self.uio.as_fd()
    }

    fn service(&mut self) -> io::Result<()> {
        let mut count = [0u8; 4];
        match self.uio.read_exact(&mut count) {
            // Readable but no new count: nothing to take this time.
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(()),
            other => other?,
        }
        // Reading the ISR acknowledges the device's line (for every queue);
        // only then may INTx be unmasked, or the level-triggered line
        // fires again at once.
        let _ = self.isr.read8(0);
        unmask_intx(&self.config)?;
        Ok(())
    }
}

/// The name of the kernel driver bound to `device`, if any.
fn bound_driver(device: &PciDevice) -> Option<String> {
    std::fs::read_link(device.path().join("driver"))
        .ok()
        .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
}

/// Binds `device` to uio_pci_generic unless it already is. Processes
/// opening the device at once may race to bind the same function: a
/// failed step is fine if the function ends up bound to uio anyway.
fn bind_uio(device: &PciDevice) -> Result<(), PciError> {
    match try_bind_uio(device) {
        Err(_) if bound_driver(device).as_deref() == Some(UIO_DRIVER) => Ok(()),
        result => result,
    }
}

fn try_bind_uio(device: &PciDevice) -> Result<(), PciError> {
    let path = device.path();
    let driver = bound_driver(device);
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

/// Makes this process the function's one driver: an exclusive, non-blocking
/// `flock` on the function's sysfs config-space file, held as long as the
/// returned descriptor is open (a process that dies lets go of it).
/// Without it a second process would reset the function under the first
/// one's queues.
fn claim(device: &PciDevice) -> Result<File, PciError> {
    let path = device.path().join("config");
    let file = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_CLOEXEC)
        .open(&path)
        .map_err(sysfs("open the config space to claim the function", &path))?;
    // SAFETY: flock on a descriptor this function owns; no memory is
    // passed.
    let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
    if rc == 0 {
        return Ok(file);
    }
    let err = io::Error::last_os_error();
    if err.raw_os_error() == Some(libc::EWOULDBLOCK) {
        return Err(PciError::Busy(device.bdf.clone()));
    }
    Err(sysfs("lock the config space", &path)(err))
}

/// Opens the function's `/dev/uioN` (non-blocking: the interrupt thread
/// polls it).
fn open_uio(device: &PciDevice) -> Result<File, PciError> {
    let dir = device.path().join("uio");
    let name = std::fs::read_dir(&dir)
        .ok()
        .and_then(|mut d| d.find_map(|e| e.ok()))
        .map(|e| e.file_name())
        .ok_or_else(|| PciError::NoUioDevice(device.bdf.clone()))?;
    let dev = Path::new("/dev").join(name);
    OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(&dev)
        .map_err(sysfs("open the uio device", &dev))
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
    fn find_all_lists_the_functions_with_the_ids_by_address() {
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
        let found = PciDevice::find_all_in(&dir, 38).unwrap();
        let addresses: Vec<&str> = found.iter().map(PciDevice::address).collect();
        assert_eq!(addresses, ["0000:00:04.0", "0000:00:05.0"]);
        assert!(matches!(
            PciDevice::find_all_in(&dir, 42),
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
