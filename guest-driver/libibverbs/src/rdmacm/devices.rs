//! The devices the connection manager uses: every configured vrdma device,
//! opened once per process (as rdma-core's librdmacm opens each device
//! once), with a PD (`id->pd` of IDs on it) and, where the device has a
//! connection manager, one device CM channel that carries the events of
//! all the process's CM IDs on that device.

use std::net::Ipv4Addr;
use std::sync::OnceLock;

use vrdma_guest_driver::cm::CmChannel;
use vrdma_guest_driver::vrdma_spec::gid;

use crate::abi::{ibv_context, ibv_device_attr, ibv_gid, ibv_pd};
use crate::context::Ctx;
use crate::ffi::VResult;
use crate::{control, device, query};

/// One device as the CM sees it.
pub(crate) struct CmDevice {
    /// The context `rdma_get_devices` returns and IDs on it carry in
    /// `id->verbs`.
    pub(crate) verbs: *mut ibv_context,
    pub(crate) pd: *mut ibv_pd,
    /// `None`: the device has no connection manager.
    pub(crate) cm: Option<CmChannel>,
    /// Its IPv4 address (from the IPv4-mapped GID 0 of port 1).
    pub(crate) ip: Option<Ipv4Addr>,
    pub(crate) max_responder_resources: u8,
    pub(crate) max_initiator_depth: u8,
}

// SAFETY: the pointers are objects of this library, alive for the process
// (never closed), whose verbs are thread-safe.
unsafe impl Send for CmDevice {}
// SAFETY: as above.
unsafe impl Sync for CmDevice {}

static DEVICES: OnceLock<Vec<CmDevice>> = OnceLock::new();

/// Every device that opened (opening them on the first call).
pub(crate) fn all() -> &'static [CmDevice] {
    DEVICES.get_or_init(|| device::entries().filter_map(open).collect())
}

/// The device at `index` of [`all`].
pub(crate) fn get(index: usize) -> VResult<&'static CmDevice> {
    all().get(index).ok_or(libc::ENODEV)
}

/// The first device with a connection manager: where an ID goes that names
/// no address of a device (a wildcard bind or listen, a resolve without a
/// source).
pub(crate) fn default_index() -> VResult<usize> {
    all()
        .iter()
        .position(|d| d.cm.is_some())
        .ok_or(libc::ENODEV)
}

/// The device whose address is `ip`.
pub(crate) fn by_ip(ip: Ipv4Addr) -> VResult<usize> {
    all()
        .iter()
        .position(|d| d.cm.is_some() && d.ip == Some(ip))
        .ok_or(libc::EADDRNOTAVAIL)
}

fn open(entry: &'static device::DeviceEntry) -> Option<CmDevice> {
    let dev = std::ptr::addr_of!(entry.ibv).cast_mut();
    // SAFETY: an entry of the device list.
    let verbs = unsafe { device::ibv_open_device(dev) };
    if verbs.is_null() {
        return None;
    }
    // SAFETY: a context just opened.
    let pd = unsafe { control::ibv_alloc_pd(verbs) };
    let mut attr = ibv_device_attr::default();
    // SAFETY: as above; `attr` is writable.
    let queried = unsafe { query::ibv_query_device(verbs, &mut attr) } == 0;
    let mut gid = ibv_gid::default();
    // SAFETY: as above; `gid` is writable.
    let ip = (unsafe { query::ibv_query_gid(verbs, 1, 0, &mut gid) } == 0)
        .then(|| {
            // SAFETY: every bit pattern of the union is a valid byte array.
            let raw = unsafe { gid.raw };
            gid::ipv4_of(&raw).map(Ipv4Addr::from)
        })
        .flatten();
    // SAFETY: a context this library opened.
    let cm = unsafe { Ctx::from_ibv(verbs) }.ok().and_then(|ctx| {
        if !ctx.shared.dev.has_cm() {
            return None;
        }
        ctx.shared
            .dev
            .cm_channel()
            .map_err(|e| {
                tracing::warn!(device = %entry.spec.name, error = %e,
                    "the device's connection manager cannot be used");
            })
            .ok()
    });
    let clamp = |v: i32| u8::try_from(v.max(0)).unwrap_or(u8::MAX);
    Some(CmDevice {
        verbs,
        pd,
        cm,
        ip,
        max_responder_resources: if queried {
            clamp(attr.max_qp_rd_atom)
        } else {
            0
        },
        max_initiator_depth: if queried {
            clamp(attr.max_qp_init_rd_atom)
        } else {
            0
        },
    })
}

/// `rdma_get_devices`: a NULL-terminated array (malloc'd; freed by
/// `rdma_free_devices`) of the contexts the CM uses.
///
/// # Safety
///
/// `num_devices` is NULL or writable.
pub unsafe extern "C" fn rdma_get_devices(num_devices: *mut libc::c_int) -> *mut *mut ibv_context {
    crate::ffi::guard("rdma_get_devices", std::ptr::null_mut(), || {
        let devs = all();
        let bytes = (devs.len() + 1) * size_of::<*mut ibv_context>();
        // SAFETY: malloc of a non-zero size; the result is checked.
        let list = unsafe { libc::malloc(bytes) }.cast::<*mut ibv_context>();
        if list.is_null() {
            crate::ffi::set_errno(libc::ENOMEM);
            return std::ptr::null_mut();
        }
        for (i, d) in devs.iter().enumerate() {
            // SAFETY: within the allocation of len + 1 pointers.
            unsafe { list.add(i).write(d.verbs) };
        }
        // SAFETY: as above, the last slot.
        unsafe { list.add(devs.len()).write(std::ptr::null_mut()) };
        if !num_devices.is_null() {
            // SAFETY: the caller's writable int.
            unsafe { num_devices.write(i32::try_from(devs.len()).unwrap_or(i32::MAX)) };
        }
        list
    })
}

/// `rdma_free_devices`: the contexts stay open (the CM keeps using them).
///
/// # Safety
///
/// `list` is NULL or a list `rdma_get_devices` returned.
pub unsafe extern "C" fn rdma_free_devices(list: *mut *mut ibv_context) {
    // SAFETY: malloc'd by rdma_get_devices (or NULL).
    unsafe { libc::free(list.cast()) }
}
