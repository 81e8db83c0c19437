//! Event channels (`struct rdma_event_channel`), and the routing of the
//! devices' CM events to them.
//!
//! Each device has one device CM channel for the whole process; the
//! library routes each of its events to the channel of the ID it concerns
//! (`rdma_migrate_id` only changes that ID's channel). A channel's `fd` is
//! an epoll descriptor over the channel's own eventfd (readable while
//! routed events wait) and every device channel's descriptor (readable
//! while a device may have new events): readable whenever
//! `rdma_get_cm_event` may find something, sometimes when the event turns
//! out to be another channel's (a non-blocking caller then gets EAGAIN, as
//! with any spurious wake-up).

use std::collections::{BTreeMap, VecDeque};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::{Mutex, MutexGuard};

use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};
use vrdma_guest_driver::cm::{event_kind, CmEvent};

use super::devices;
use super::id::Id;
use crate::abi::rdma_event_channel;
use crate::ffi::{ptr_verb, VResult};

/// An event routed to a channel, not yet taken by `rdma_get_cm_event`.
pub(crate) struct Pending {
    /// The ID it concerns (for CONNECT_REQUEST: the new ID).
    pub(crate) id: *mut Id,
    /// CONNECT_REQUEST: the listener.
    pub(crate) listener: *mut Id,
    pub(crate) event: CmEvent,
}

// SAFETY: the IDs are heap objects of this library, shared between
// threads under their own locks.
unsafe impl Send for Pending {}

/// An event channel: the application's `struct rdma_event_channel` first.
#[repr(C)]
pub(crate) struct Channel {
    pub(crate) ch: rdma_event_channel,
    queue: Mutex<VecDeque<Pending>>,
    notify: EventFd,
    epoll: OwnedFd,
}

pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Channel {
    /// A new channel (boxed, leaked: the application holds it).
    pub(crate) fn create() -> VResult<*mut Channel> {
        let notify =
            EventFd::new(EFD_NONBLOCK).map_err(|e| e.raw_os_error().unwrap_or(libc::EIO))?;
        // SAFETY: plain syscall; the result is checked.
        let fd = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
        if fd < 0 {
            return Err(errno());
        }
        // SAFETY: a descriptor just created, owned here.
        let epoll = unsafe { OwnedFd::from_raw_fd(fd) };
        let fds = std::iter::once(notify.as_raw_fd()).chain(
            devices::all()
                .iter()
                .filter_map(|d| d.cm.as_ref().map(|cm| cm.event_fd().as_raw_fd())),
        );
        for watched in fds {
            let mut ev = libc::epoll_event {
                events: libc::EPOLLIN as u32,
                u64: 0,
            };
            // SAFETY: live descriptors and a valid event structure.
            if unsafe { libc::epoll_ctl(fd, libc::EPOLL_CTL_ADD, watched, &mut ev) } != 0 {
                return Err(errno());
            }
        }
        Ok(Box::into_raw(Box::new(Channel {
            ch: rdma_event_channel { fd },
            queue: Mutex::new(VecDeque::new()),
            notify,
            epoll,
        })))
    }

    /// # Safety
    ///
    /// `p` is a channel [`Channel::create`] made and not yet destroyed.
    pub(crate) unsafe fn from_raw<'a>(p: *mut rdma_event_channel) -> VResult<&'a Channel> {
        crate::ffi::non_null(p)?;
        // SAFETY: the caller's promise; `ch` is the first field.
        Ok(unsafe { &*p.cast::<Channel>() })
    }

    pub(crate) fn push(&self, p: Pending) {
        let mut q = lock(&self.queue);
        q.push_back(p);
        let _ = self.notify.write(1);
    }

    pub(crate) fn pop(&self) -> Option<Pending> {
        let mut q = lock(&self.queue);
        let p = q.pop_front();
        if q.is_empty() {
            let _ = self.notify.read();
        }
        p
    }

    /// Takes out the waiting events of `id` (destroyed or migrating).
    pub(crate) fn take_events_of(&self, id: *mut Id) -> Vec<Pending> {
        let mut q = lock(&self.queue);
        let (theirs, rest): (Vec<Pending>, Vec<Pending>) =
            q.drain(..).partition(|p| p.id == id || p.listener == id);
        *q = rest.into();
        if q.is_empty() {
            let _ = self.notify.read();
        }
        theirs
    }

    /// Whether the application made the descriptor non-blocking.
    pub(crate) fn nonblocking(&self) -> bool {
        // SAFETY: plain fcntl on our own descriptor.
        let flags = unsafe { libc::fcntl(self.epoll.as_raw_fd(), libc::F_GETFL) };
        flags >= 0 && flags & libc::O_NONBLOCK != 0
    }

    /// Waits until the descriptor is readable.
    pub(crate) fn wait(&self) -> VResult<()> {
        let mut ev = libc::epoll_event { events: 0, u64: 0 };
        loop {
            // SAFETY: our epoll descriptor and one writable event.
            let n = unsafe { libc::epoll_wait(self.epoll.as_raw_fd(), &mut ev, 1, -1) };
            if n >= 0 {
                return Ok(());
            }
            let e = errno();
            if e != libc::EINTR {
                return Err(e);
            }
        }
    }
}

pub(crate) fn errno() -> i32 {
    std::io::Error::last_os_error()
        .raw_os_error()
        .unwrap_or(libc::EIO)
}

/// The IDs events are routed to: (device index, the device's CM ID number)
/// → the library's ID.
pub(crate) struct Routes(pub(crate) BTreeMap<(usize, u32), *mut Id>);

// SAFETY: see `Pending`.
unsafe impl Send for Routes {}

pub(crate) static ROUTES: Mutex<Routes> = Mutex::new(Routes(BTreeMap::new()));
/// Serialises the taking of device events, so that they are routed in the
/// order the device gave them.
static PUMP: Mutex<()> = Mutex::new(());

/// Takes every event the devices have and routes each to its channel.
pub(crate) fn pump() {
    let _order = lock(&PUMP);
    for (dev, d) in devices::all().iter().enumerate() {
        let Some(cm) = &d.cm else { continue };
        loop {
            match cm.get_event() {
                Ok(Some(e)) => route(dev, e),
                Ok(None) => break,
                Err(e) => {
                    tracing::warn!(error = %e, "cannot read the device's CM events");
                    break;
                }
            }
        }
    }
}

fn route(dev: usize, event: CmEvent) {
    let mut routes = lock(&ROUTES);
    if event.kind == event_kind::CONNECT_REQUEST {
        let Some(&listener) = event.listen_id.and_then(|l| routes.0.get(&(dev, l.0))) else {
            tracing::debug!(
                id = event.id.0,
                "connect request for no listener of this process"
            );
            return;
        };
        // SAFETY: routed IDs are live (destroy removes them first).
        let child = match unsafe { Id::child_of(listener, dev, event.id) } {
            Ok(c) => c,
            Err(errno) => {
                tracing::warn!(errno, "no ID for a connect request: it is rejected");
                if let Some(cm) = &devices::all()[dev].cm {
                    let _ = cm.reject(event.id, &[]);
                }
                return;
            }
        };
        routes.0.insert((dev, event.id.0), child);
        // SAFETY: as above.
        let ch = unsafe { (*listener).cm().channel };
        // SAFETY: an ID's channel is live while the ID is.
        if let Ok(ch) = unsafe { Channel::from_raw(ch) } {
            ch.push(Pending {
                id: child,
                listener,
                event,
            });
        }
        return;
    }
    let Some(&id) = routes.0.get(&(dev, event.id.0)) else {
        tracing::debug!(
            id = event.id.0,
            kind = event.kind,
            "event for a destroyed ID dropped"
        );
        return;
    };
    // SAFETY: as above.
    let ch = unsafe { (*id).cm().channel };
    // SAFETY: as above.
    if let Ok(ch) = unsafe { Channel::from_raw(ch) } {
        ch.push(Pending {
            id,
            listener: std::ptr::null_mut(),
            event,
        });
    }
}

/// `rdma_create_event_channel`.
pub extern "C" fn rdma_create_event_channel() -> *mut rdma_event_channel {
    ptr_verb("rdma_create_event_channel", || {
        if devices::default_index().is_err() {
            // No device with a connection manager: as rdma-core without
            // the kernel's rdma_cm.
            return Err(libc::ENODEV);
        }
        Channel::create().map(|c| c.cast())
    })
}

/// `rdma_destroy_event_channel`.
///
/// # Safety
///
/// `channel` is a live channel with no IDs left on it.
pub unsafe extern "C" fn rdma_destroy_event_channel(channel: *mut rdma_event_channel) {
    crate::ffi::guard("rdma_destroy_event_channel", (), || {
        if channel.is_null() {
            return;
        }
        // SAFETY: the caller's promise; made by Box::into_raw.
        drop(unsafe { Box::from_raw(channel.cast::<Channel>()) });
    });
}
