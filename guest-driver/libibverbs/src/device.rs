//! The device list and opening devices: `ibv_get_device_list`,
//! `ibv_get_device_name`, `ibv_open_device`, `ibv_close_device`, ...
//!
//! The devices are read from the configuration ([`crate::config`]) once per
//! process. Listing them connects to nothing: the library connects to a
//! device's socket only when the application opens it (`ibv_open_device`:
//! each open is a context of the device, a connection of its own), and
//! says clearly on stderr when nothing is configured or a device cannot be
//! reached.

use std::ffi::{c_char, c_int};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

use vrdma_errors::error_chain;
use vrdma_guest_driver::Context;

use crate::abi::{__be64, ibv_context, ibv_device, IBV_NODE_CA, IBV_TRANSPORT_IB};
use crate::config::{self, DeviceSpec, Endpoint};
use crate::context::Ctx;
use crate::ffi::{guard, int_verb, ptr_verb, write_c_str};

/// Prefix of every message the library prints.
pub(crate) const PREFIX: &str = "libibverbs (vrdma)";

/// One configured device: the `struct ibv_device` the application sees,
/// then what the library knows about it.
#[repr(C)]
pub(crate) struct DeviceEntry {
    pub(crate) ibv: ibv_device,
    pub(crate) index: usize,
    pub(crate) spec: DeviceSpec,
    /// Node GUID in network byte order, once the device has been opened.
    pub(crate) guid: AtomicU64,
}

/// The `ibdev_path` of a vrdma device (served by [`crate::misc`]'s
/// `ibv_read_sysfs_file`, not by sysfs).
pub(crate) fn ibdev_path(name: &str) -> String {
    format!("/sys/class/infiniband/{name}")
}

impl DeviceEntry {
    fn new(index: usize, spec: DeviceSpec) -> Self {
        let mut ibv = ibv_device {
            node_type: IBV_NODE_CA,
            transport_type: IBV_TRANSPORT_IB,
            ..Default::default()
        };
        write_c_str(&mut ibv.name, &spec.name);
        write_c_str(&mut ibv.dev_name, &format!("vrdma-uverbs{index}"));
        // Where the device really is: vdev's socket.
        write_c_str(&mut ibv.dev_path, &spec.endpoint.display());
        write_c_str(&mut ibv.ibdev_path, &ibdev_path(&spec.name));
        Self {
            ibv,
            index,
            spec,
            guid: AtomicU64::new(0),
        }
    }
}

struct Registry {
    /// Never changed after it is built, so the entries never move.
    devices: Vec<DeviceEntry>,
}

static REGISTRY: OnceLock<Registry> = OnceLock::new();

/// The configured devices (read once; a configuration problem is printed
/// once and leaves the list empty).
fn registry() -> &'static Registry {
    REGISTRY.get_or_init(|| {
        crate::init_logging();
        let devices = match config::load() {
            Ok(specs) => specs
                .into_iter()
                .enumerate()
                .map(|(i, s)| DeviceEntry::new(i, s))
                .collect(),
            Err(e) => {
                eprintln!("{PREFIX}: {e}");
                Vec::new()
            }
        };
        Registry { devices }
    })
}

/// The entry behind an application's device pointer, if it is one of ours.
pub(crate) fn entry_of(dev: *const ibv_device) -> Option<&'static DeviceEntry> {
    registry()
        .devices
        .iter()
        .find(|d| std::ptr::eq(&d.ibv, dev))
}

/// All configured devices, in order.
pub(crate) fn entries() -> impl Iterator<Item = &'static DeviceEntry> {
    registry().devices.iter()
}

/// `ibv_get_device_list`: a NULL-terminated array of the configured
/// devices (empty when nothing is configured, with a message on stderr).
///
/// # Safety
///
/// `num_devices` is NULL or points to a writable `int`.
pub unsafe extern "C" fn ibv_get_device_list(num_devices: *mut c_int) -> *mut *mut ibv_device {
    ptr_verb("ibv_get_device_list", || {
        let mut list: Vec<*mut ibv_device> = entries()
            .map(|d| std::ptr::from_ref(&d.ibv).cast_mut())
            .collect();
        let n = c_int::try_from(list.len()).map_err(|_| libc::ENOMEM)?;
        list.push(std::ptr::null_mut());
        if !num_devices.is_null() {
            // SAFETY: the caller passes NULL or a writable int.
            unsafe { *num_devices = n };
        }
        Ok(Box::into_raw(list.into_boxed_slice()).cast::<*mut ibv_device>())
    })
}

/// `ibv_free_device_list`.
///
/// # Safety
///
/// `list` is NULL or an array returned by [`ibv_get_device_list`], not yet
/// freed.
pub unsafe extern "C" fn ibv_free_device_list(list: *mut *mut ibv_device) {
    guard("ibv_free_device_list", (), || {
        if list.is_null() {
            return;
        }
        let mut n = 0;
        // SAFETY: the array is NULL-terminated (made by ibv_get_device_list).
        while !unsafe { *list.add(n) }.is_null() {
            n += 1;
        }
        let slice = std::ptr::slice_from_raw_parts_mut(list, n + 1);
        // SAFETY: this is exactly the boxed slice ibv_get_device_list leaked.
        drop(unsafe { Box::from_raw(slice) });
    });
}

/// `ibv_get_device_name`.
///
/// # Safety
///
/// `device` is NULL or an entry of a device list.
pub unsafe extern "C" fn ibv_get_device_name(device: *mut ibv_device) -> *const c_char {
    guard("ibv_get_device_name", std::ptr::null(), || {
        match entry_of(device) {
            Some(d) => d.ibv.name.as_ptr(),
            None => {
                crate::ffi::set_errno(libc::EINVAL);
                std::ptr::null()
            }
        }
    })
}

/// `ibv_get_device_guid`: the node GUID (network byte order), known once
/// the device has been opened in this process; 0 before that.
///
/// # Safety
///
/// `device` is NULL or an entry of a device list.
pub unsafe extern "C" fn ibv_get_device_guid(device: *mut ibv_device) -> __be64 {
    guard("ibv_get_device_guid", 0, || {
        entry_of(device).map_or(0, |d| d.guid.load(Ordering::Relaxed))
    })
}

/// `ibv_get_device_index`: the device's position in the list, or -1.
///
/// # Safety
///
/// `device` is NULL or an entry of a device list.
pub unsafe extern "C" fn ibv_get_device_index(device: *mut ibv_device) -> c_int {
    guard("ibv_get_device_index", -1, || {
        entry_of(device)
            .and_then(|d| c_int::try_from(d.index).ok())
            .unwrap_or(-1)
    })
}

/// `ibv_open_device`: connects to the device's vdev socket (process mode)
/// or takes its virtio-pci function (VM mode) and brings the device up.
///
/// # Safety
///
/// `device` is NULL or an entry of a device list.
pub unsafe extern "C" fn ibv_open_device(device: *mut ibv_device) -> *mut ibv_context {
    ptr_verb("ibv_open_device", || {
        let entry = entry_of(device).ok_or(libc::EINVAL)?;
        let endpoint = &entry.spec.endpoint;
        let opened = match endpoint {
            Endpoint::Socket(socket) => Context::open_vhost_user(socket),
            Endpoint::Pci {
                functions,
                virtio_id,
            } => Context::open_pci(functions, *virtio_id),
        };
        let dev = opened.map_err(|e| {
            let what = match endpoint {
                Endpoint::Socket(_) => "vdev socket",
                Endpoint::Pci { .. } => "virtio-pci function",
            };
            eprintln!(
                "{PREFIX}: cannot open device {} ({what} {}): {}",
                entry.spec.name,
                endpoint.display(),
                error_chain(&e)
            );
            match e.errno() {
                libc::EIO => libc::ENODEV,
                errno => errno,
            }
        })?;
        let guid = dev.config().device.node_guid.get();
        entry.guid.store(guid.to_be(), Ordering::Relaxed);
        let ctx = Ctx::new(dev, entry).map_err(|e| {
            eprintln!("{PREFIX}: cannot open device {}: {e}", entry.spec.name);
            e.raw_os_error().unwrap_or(libc::ENOMEM)
        })?;
        tracing::info!(device = entry.spec.name, endpoint = %endpoint.display(), "Opened");
        let raw = Box::into_raw(ctx);
        // SAFETY: `raw` is the live box just leaked; only a field address
        // is taken.
        Ok(unsafe { std::ptr::addr_of_mut!((*raw).vctx.context) })
    })
}

/// `ibv_close_device`. Objects still alive keep the connection open until
/// they are destroyed.
///
/// # Safety
///
/// `context` is a context from [`ibv_open_device`], not yet closed, and no
/// other thread uses it.
pub unsafe extern "C" fn ibv_close_device(context: *mut ibv_context) -> c_int {
    int_verb("ibv_close_device", || {
        // SAFETY: the caller passes an open context.
        let ptr = unsafe { Ctx::raw_from_ibv(context)? };
        // SAFETY: contexts are leaked boxes (ibv_open_device); closing
        // hands it back for good.
        let mut boxed = unsafe { Box::from_raw(ptr) };
        boxed.stop_events();
        drop(boxed);
        Ok(())
    })
}
