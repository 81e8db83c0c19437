//! All of the device's virtqueues, including those vdev never serves: the
//! doorbell queue and the event queues are notification lines only, and
//! hostd, not vdev, waits on the first and signals the others. vdev lends
//! hostd their eventfds ([`VringTable`] is the device's [`NotifyFds`]).
//!
//! vhost-user-backend creates the vrings itself, inside
//! `VhostUserDaemon::new`, and gives a worker thread only the vrings of its
//! queue mask — vdev's one worker serves the control queue alone, so that
//! the doorbell queue's kicks are left for hostd to read. To still reach
//! the other vrings, vdev's vring type is [`DeviceVring`], a
//! `VringRwLock` that joins the [`collect`]ion open on the creating thread;
//! [`crate::VrdmaBackend::daemon`] opens one around `VhostUserDaemon::new`
//! and keeps the vrings, in creation order, which is queue order.

use std::cell::RefCell;
use std::fs::File;
use std::io;
use std::os::fd::{FromRawFd, IntoRawFd, OwnedFd};
use std::sync::{Mutex, RwLockReadGuard, RwLockWriteGuard};

use vhost_user_backend::{VringRwLock, VringState, VringStateGuard, VringStateMutGuard, VringT};
use virtio_queue::Error as QueueError;
use vm_memory::{GuestMemoryAtomic, GuestMemoryMmap};
use vrdma_spec::{DOORBELL_QUEUE, FIRST_EVENT_QUEUE};

use crate::verbs::{FdError, NotifyFds};

/// The guest memory a vring works on.
pub type Mem = GuestMemoryAtomic<GuestMemoryMmap>;

/// A vring of the device: vhost-user-backend's `VringRwLock`, which also
/// joins the collection open on its creating thread.
#[derive(Clone)]
pub struct DeviceVring {
    ring: VringRwLock<Mem>,
    /// The control queue (the first vring of a collection).
    control: bool,
}

thread_local! {
    /// The vrings created on this thread since [`collect`] began.
    static COLLECTED: RefCell<Option<Vec<DeviceVring>>> = const { RefCell::new(None) };
}

/// Runs `create` and returns its result with every [`DeviceVring`] it
/// created on this thread, in creation order.
pub fn collect<T>(create: impl FnOnce() -> T) -> (T, Vec<DeviceVring>) {
    /// Ends the collection even if `create` unwinds.
    struct Collection;
    impl Drop for Collection {
        fn drop(&mut self) {
            COLLECTED.with(|c| c.borrow_mut().take());
        }
    }
    COLLECTED.with(|c| *c.borrow_mut() = Some(Vec::new()));
    let collection = Collection;
    let result = create();
    let vrings = COLLECTED
        .with(|c| c.borrow_mut().take())
        .unwrap_or_default();
    drop(collection);
    (result, vrings)
}

impl<'a> VringStateGuard<'a, Mem> for DeviceVring {
    type G = RwLockReadGuard<'a, VringState<Mem>>;
}

impl<'a> VringStateMutGuard<'a, Mem> for DeviceVring {
    type G = RwLockWriteGuard<'a, VringState<Mem>>;
}

impl VringT<Mem> for DeviceVring {
    fn new(mem: Mem, max_queue_size: u16) -> Result<Self, QueueError> {
        let index = COLLECTED.with(|c| c.borrow().as_ref().map(Vec::len));
        let vring = DeviceVring {
            ring: VringRwLock::new(mem, max_queue_size)?,
            control: index == Some(usize::from(vrdma_spec::CONTROL_QUEUE)),
        };
        COLLECTED.with(|c| {
            if let Some(vrings) = c.borrow_mut().as_mut() {
                vrings.push(vring.clone());
            }
        });
        Ok(vring)
    }

    fn get_ref(&self) -> RwLockReadGuard<'_, VringState<Mem>> {
        self.ring.get_ref()
    }

    fn get_mut(&self) -> RwLockWriteGuard<'_, VringState<Mem>> {
        self.ring.get_mut()
    }

    fn add_used(&self, desc_index: u16, len: u32) -> Result<(), QueueError> {
        self.ring.add_used(desc_index, len)
    }

    fn signal_used_queue(&self) -> io::Result<()> {
        self.ring.signal_used_queue()
    }

    fn enable_notification(&self) -> Result<bool, QueueError> {
        self.ring.enable_notification()
    }

    fn disable_notification(&self) -> Result<(), QueueError> {
        self.ring.disable_notification()
    }

    fn needs_notification(&self) -> Result<bool, QueueError> {
        self.ring.needs_notification()
    }

    fn set_enabled(&self, enabled: bool) {
        self.ring.set_enabled(enabled)
    }

    fn set_queue_info(&self, desc: u64, avail: u64, used: u64) -> Result<(), QueueError> {
        self.ring.set_queue_info(desc, avail, used)
    }

    fn queue_next_avail(&self) -> u16 {
        self.ring.queue_next_avail()
    }

    fn set_queue_next_avail(&self, base: u16) {
        self.ring.set_queue_next_avail(base)
    }

    fn set_queue_next_used(&self, idx: u16) {
        self.ring.set_queue_next_used(idx)
    }

    fn queue_used_idx(&self) -> Result<u16, QueueError> {
        self.ring.queue_used_idx()
    }

    fn set_queue_size(&self, num: u16) {
        self.ring.set_queue_size(num)
    }

    fn set_queue_event_idx(&self, enabled: bool) {
        self.ring.set_queue_event_idx(enabled)
    }

    fn set_queue_ready(&self, ready: bool) {
        self.ring.set_queue_ready(ready)
    }

    fn set_kick(&self, file: Option<File>) {
        // A control command the driver sent while no backend listened
        // (vdev restarting; a VMM gives a new eventfd when it reconnects)
        // would wait for ever: look at the queue once as if notified — a
        // queue that ran before only (its base past 0). A queue starting
        // afresh is looked at on the driver's first notification, as a
        // device does: its rings may still hold what a previous boot left
        // until the driver writes them (a machine reset).
        let resumed = self.ring.queue_next_avail() != 0;
        if let Some(file) = file.as_ref().filter(|_| self.control && resumed) {
            use std::io::Write;
            let _ = (&*file).write_all(&1u64.to_ne_bytes());
        }
        self.ring.set_kick(file)
    }

    fn read_kick(&self) -> io::Result<bool> {
        self.ring.read_kick()
    }

    fn set_call(&self, file: Option<File>) {
        self.ring.set_call(file)
    }

    fn set_err(&self, file: Option<File>) {
        self.ring.set_err(file)
    }
}

/// Every vring of one device, by queue index, once its daemon exists.
#[derive(Default)]
pub struct VringTable {
    vrings: Mutex<Vec<DeviceVring>>,
}

impl std::fmt::Debug for VringTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let count = self.vrings.lock().map_or(0, |v| v.len());
        f.debug_struct("VringTable")
            .field("vrings", &count)
            .finish()
    }
}

impl VringTable {
    /// Takes the vrings of the device's daemon, in queue order.
    pub fn set(&self, vrings: Vec<DeviceVring>) {
        *self.vrings.lock().unwrap_or_else(|p| p.into_inner()) = vrings;
    }

    /// Number of vrings held.
    pub fn len(&self) -> usize {
        self.vrings.lock().unwrap_or_else(|p| p.into_inner()).len()
    }

    /// Whether the table holds no vrings (no daemon yet).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The vring of queue `queue`, if the daemon made one.
    pub fn get(&self, queue: u16) -> Option<DeviceVring> {
        self.vrings
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(usize::from(queue))
            .cloned()
    }

    /// A new descriptor of queue `queue`'s kick (`call` false) or call
    /// (`call` true) eventfd. Duplicated with `fcntl(F_DUPFD_CLOEXEC)`
    /// (what `File::try_clone` does), which vdev's seccomp filter allows.
    fn lend(&self, queue: u32, call: bool) -> Result<OwnedFd, FdError> {
        let kind = if call { "call" } else { "kick" };
        let missing = FdError::Missing { kind, queue };
        let vrings = self.vrings.lock().unwrap_or_else(|p| p.into_inner());
        let vring = vrings.get(queue as usize).ok_or(missing)?;
        let state = vring.get_ref();
        let dup = |source| FdError::Dup {
            kind,
            queue,
            source,
        };
        let raw = if call {
            let notifier = state
                .get_call()
                .as_ref()
                .ok_or(FdError::Missing { kind, queue })?;
            notifier.try_clone().map_err(dup)?.into_raw_fd()
        } else {
            let consumer = state
                .get_kick()
                .as_ref()
                .ok_or(FdError::Missing { kind, queue })?;
            consumer.try_clone().map_err(dup)?.into_raw_fd()
        };
        // SAFETY: `raw` is the fresh duplicate `try_clone` made, released by
        // `into_raw_fd`; nothing else owns it.
        Ok(unsafe { OwnedFd::from_raw_fd(raw) })
    }
}

impl NotifyFds for VringTable {
    fn doorbell_kick(&self) -> Result<OwnedFd, FdError> {
        self.lend(u32::from(DOORBELL_QUEUE), false)
    }

    fn vector_call(&self, vector: u32) -> Result<OwnedFd, FdError> {
        let queue = u32::from(FIRST_EVENT_QUEUE).saturating_add(vector);
        self.lend(queue, true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;
    use virtio_queue::QueueT;
    use vm_memory::GuestAddress;
    use vmm_sys_util::eventfd::EventFd;

    fn mem() -> Mem {
        GuestMemoryAtomic::new(
            GuestMemoryMmap::from_ranges(&[(GuestAddress(0x10_0000), 0x10000)]).expect("memory"),
        )
    }

    /// A new descriptor of `fd` as a `File`, the way the vhost-user
    /// handler passes a received eventfd to `set_kick`/`set_call`.
    fn file_of(fd: &EventFd) -> File {
        let dup = fd.try_clone().expect("dup");
        // SAFETY: `into_raw_fd` releases the duplicate's only owner.
        unsafe { File::from_raw_fd(dup.into_raw_fd()) }
    }

    fn read(fd: &OwnedFd) -> Option<u64> {
        let mut value = 0u64;
        // SAFETY: reads 8 bytes into `value` from an open (non-blocking) eventfd.
        let n = unsafe { libc::read(fd.as_raw_fd(), (&mut value as *mut u64).cast(), 8) };
        (n == 8).then_some(value)
    }

    #[test]
    fn collect_gathers_the_vrings_made_inside_it_in_order() {
        let outside = DeviceVring::new(mem(), 8).expect("vring");
        let (n, vrings) = collect(|| {
            for size in [16u16, 32, 64] {
                DeviceVring::new(mem(), size).expect("vring");
            }
            3
        });
        assert_eq!(n, 3);
        let sizes: Vec<u16> = vrings
            .iter()
            .map(|v| v.get_ref().get_queue().max_size())
            .collect();
        assert_eq!(sizes, [16, 32, 64], "only those made inside, in order");
        let (_, none) = collect(|| ());
        assert!(none.is_empty());
        drop(outside);
        let after = DeviceVring::new(mem(), 8);
        assert!(after.is_ok(), "no collection open: nothing kept");
    }

    #[test]
    fn the_table_lends_the_doorbell_kick_and_the_vector_calls() {
        let table = VringTable::default();
        assert!(matches!(
            table.doorbell_kick(),
            Err(FdError::Missing {
                kind: "kick",
                queue: 1
            })
        ));
        let (_, vrings) = collect(|| {
            for _ in 0..vrdma_spec::num_queues(2) {
                DeviceVring::new(mem(), 8).expect("vring");
            }
        });
        table.set(vrings.clone());
        assert_eq!(table.len(), 4);
        assert!(matches!(
            table.doorbell_kick(),
            Err(FdError::Missing {
                kind: "kick",
                queue: 1
            })
        ));
        let kick = EventFd::new(libc::EFD_NONBLOCK).expect("eventfd");
        vrings[1].set_kick(Some(file_of(&kick)));
        let call = EventFd::new(libc::EFD_NONBLOCK).expect("eventfd");
        vrings[3].set_call(Some(file_of(&call)));

        // What the driver writes to its kick, hostd reads from its loan.
        let lent = table.doorbell_kick().expect("kick set");
        kick.write(3).expect("kick");
        assert_eq!(read(&lent), Some(3));
        // What hostd writes to its loan interrupts the driver.
        let lent = table.vector_call(1).expect("call of vector 1");
        // SAFETY: writes the 8 bytes of a u64 to an open eventfd.
        let n = unsafe { libc::write(lent.as_raw_fd(), (&1u64 as *const u64).cast(), 8) };
        assert_eq!(n, 8);
        assert_eq!(call.read().expect("interrupt"), 1);
        assert!(matches!(
            table.vector_call(0),
            Err(FdError::Missing {
                kind: "call",
                queue: 2
            })
        ));
        assert!(matches!(
            table.vector_call(2),
            Err(FdError::Missing {
                kind: "call",
                queue: 4
            })
        ));
    }
}
