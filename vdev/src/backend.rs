//! The vhost-user backend: what the VMM (or a process-mode driver) talks to.
//!
//! [`VrdmaBackend`] implements [`VhostUserBackend`]: it offers the virtio
//! features and vhost-user protocol features of the device, serves the config
//! space, takes memory-table updates (revoking shadows whose memory went
//! away), and drains the control queue into the [`RdmaDevice`].

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, IntoRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Duration;

use vmm_sys_util::eventfd::EventFd;

use vhost::vhost_user::message::{VhostUserProtocolFeatures, VhostUserVirtioFeatures};
use vhost_user_backend::{VhostUserBackend, VringRwLock, VringT};
use virtio_bindings::virtio_config::VIRTIO_F_VERSION_1;
use virtio_bindings::virtio_ring::{VIRTIO_RING_F_EVENT_IDX, VIRTIO_RING_F_INDIRECT_DESC};
use virtio_queue::QueueT;
use vm_memory::{GuestAddressSpace, GuestMemoryAtomic, GuestMemoryBackend, GuestMemoryMmap};
use vmm_sys_util::epoll::EventSet;
use vmm_sys_util::event::{
    new_event_consumer_and_notifier, EventConsumer, EventFlag, EventNotifier,
};
use vrdma_spec::zerocopy::IntoBytes;
use vrdma_spec::{CONTROL_QUEUE, DOORBELL_QUEUE, FIRST_EVENT_QUEUE};
use vrdma_tenant_policy::Limits;

use crate::control;
use crate::datapath::{self, DatapathContext, SharedVrings};
use crate::fabric::Fabric;
use crate::seccomp::{Role, Threads};
use crate::verbs::{DeviceIdentity, RdmaDevice};

/// Why handling a queue event failed.
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    #[error("Event {0} does not belong to any queue of this device")]
    UnknownEvent(u16),
    #[error("Event on queue {0} arrived before guest memory")]
    NoMemory(u16),
    #[error("Virtqueue {queue} failed")]
    Queue {
        queue: u16,
        #[source]
        source: virtio_queue::Error,
    },
    #[error("Cannot signal the driver on queue {queue}")]
    Signal {
        queue: u16,
        #[source]
        source: io::Error,
    },
}

impl From<BackendError> for io::Error {
    fn from(e: BackendError) -> Self {
        io::Error::other(e)
    }
}

/// The vhost-user backend of one tenant's device. Cheap to clone (the
/// daemon wants `Clone`); all clones share one device.
#[derive(Debug, Clone)]
pub struct VrdmaBackend {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    identity: DeviceIdentity,
    device: Arc<Mutex<RdmaDevice>>,
    mem: Arc<Mutex<Option<GuestMemoryAtomic<GuestMemoryMmap>>>>,
    event_idx: AtomicBool,
    /// Notifiers of the exit events handed to the daemon's worker threads.
    exit_notifiers: Mutex<Vec<EventNotifier>>,
    /// The exit events' consumer ends, owned here (see `exit_event`).
    exit_consumers: Mutex<Vec<OwnedFd>>,
    /// The vrings, for the datapath's events.
    vrings: Arc<SharedVrings>,
    /// Wakes the datapath (doorbells, new event buffers, shutdown).
    wake: Arc<EventFd>,
    stop: Arc<AtomicBool>,
}

impl VrdmaBackend {
    /// A backend serving a fresh device, attached to hostd's fabric if
    /// `fabric` is given.
    pub fn new(
        identity: DeviceIdentity,
        limits: Limits,
        fabric: Option<Arc<Fabric>>,
    ) -> io::Result<Self> {
        let device = match fabric {
            Some(fabric) => RdmaDevice::with_fabric(identity.clone(), limits, fabric),
            None => RdmaDevice::new(identity.clone(), limits),
        };
        Ok(VrdmaBackend {
            inner: Arc::new(Inner {
                identity,
                device: Arc::new(Mutex::new(device)),
                mem: Arc::new(Mutex::new(None)),
                event_idx: AtomicBool::new(false),
                exit_notifiers: Mutex::new(Vec::new()),
                exit_consumers: Mutex::new(Vec::new()),
                vrings: Arc::new(SharedVrings::default()),
                wake: Arc::new(EventFd::new(libc::EFD_NONBLOCK)?),
                stop: Arc::new(AtomicBool::new(false)),
            }),
        })
    }

    /// Starts the datapath thread and hostd's policy listener (through
    /// `threads`, each under its role's filter) if the device is on a
    /// fabric; the datapath runs until [`VrdmaBackend::stop_datapath`].
    pub fn start_datapath(
        &self,
        spin: Duration,
        class_cpu_priority: bool,
        threads: &Threads,
    ) -> io::Result<Option<JoinHandle<()>>> {
        let Some(fabric) = self.device().fabric().cloned() else {
            return Ok(None);
        };
        if let Some(channel) = fabric.take_notifications() {
            crate::fabric::listen_for_policy(
                channel,
                Arc::downgrade(&self.inner.device),
                Arc::downgrade(&fabric),
                threads,
            )?;
        }
        let ctx = DatapathContext {
            device: self.inner.device.clone(),
            mem: self.inner.mem.clone(),
            vrings: self.inner.vrings.clone(),
            fabric,
            wake: self.inner.wake.clone(),
            stop: self.inner.stop.clone(),
            spin,
            class_cpu_priority,
        };
        let name = format!("datapath-{}", self.tenant());
        threads
            .spawn(Role::Datapath, name, move || datapath::run(ctx))
            .map(Some)
    }

    /// Stops the datapath thread and releases every object (telling hostd).
    pub fn stop_datapath(&self, thread: Option<JoinHandle<()>>) {
        self.inner.stop.store(true, Ordering::Release);
        let _ = self.inner.wake.write(1);
        if let Some(thread) = thread {
            let _ = thread.join();
        }
        self.device().release_all();
    }

    fn wake_datapath(&self) {
        let _ = self.inner.wake.write(1);
    }

    /// The device, even if a thread panicked while holding it: the device's
    /// tables are updated so that every step leaves them consistent.
    pub fn device(&self) -> MutexGuard<'_, RdmaDevice> {
        self.inner
            .device
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Tells the daemon's worker threads to exit (after the frontend left).
    pub fn stop_workers(&self) {
        for notifier in self
            .inner
            .exit_notifiers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
        {
            if let Err(e) = notifier.notify() {
                tracing::warn!(tenant = self.tenant(), error = %e, "Cannot stop a worker thread");
            }
        }
    }

    fn tenant(&self) -> &str {
        &self.inner.identity.tenant
    }

    /// Drains the control queue, answering every chain, with the EVENT_IDX
    /// loop: disable notifications, drain, re-enable, drain again if the
    /// driver added chains meanwhile.
    fn process_control_queue(&self, vring: &VringRwLock) -> Result<(), BackendError> {
        let queue = CONTROL_QUEUE;
        let atomic = self
            .inner
            .mem
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let atomic = atomic.ok_or(BackendError::NoMemory(queue))?;
        let mem = atomic.memory();
        let event_idx = self.inner.event_idx.load(Ordering::Relaxed);
        let qerr = |source| BackendError::Queue { queue, source };
        loop {
            if event_idx {
                vring.disable_notification().map_err(qerr)?;
            }
            loop {
                let chain = vring.get_mut().get_queue_mut().pop_descriptor_chain(&*mem);
                let Some(chain) = chain else { break };
                let head = chain.head_index();
                let used = control::process_chain(&mut self.device(), &mem, chain);
                vring.add_used(head, used).map_err(qerr)?;
            }
            if vring.needs_notification().map_err(qerr)? {
                vring
                    .signal_used_queue()
                    .map_err(|source| BackendError::Signal { queue, source })?;
            }
            if !event_idx || !vring.enable_notification().map_err(qerr)? {
                return Ok(());
            }
        }
    }
}

impl VhostUserBackend for VrdmaBackend {
    type Bitmap = ();
    type Vring = VringRwLock;

    fn num_queues(&self) -> usize {
        usize::from(vrdma_spec::num_queues(self.inner.identity.comp_vectors))
    }

    fn max_queue_size(&self) -> usize {
        usize::from(self.inner.identity.max_queue_size)
    }

    fn features(&self) -> u64 {
        (1 << VIRTIO_F_VERSION_1)
            | (1 << VIRTIO_RING_F_EVENT_IDX)
            | (1 << VIRTIO_RING_F_INDIRECT_DESC)
            | VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits()
    }

    fn acked_features(&self, features: u64) {
        tracing::info!(
            tenant = self.tenant(),
            features = format_args!("{features:#x}"),
            "Features acknowledged"
        );
    }

    fn protocol_features(&self) -> VhostUserProtocolFeatures {
        VhostUserProtocolFeatures::CONFIG
            | VhostUserProtocolFeatures::MQ
            | VhostUserProtocolFeatures::REPLY_ACK
            | VhostUserProtocolFeatures::CONFIGURE_MEM_SLOTS
            | VhostUserProtocolFeatures::RESET_DEVICE
    }

    fn reset_device(&self) {
        tracing::info!(
            tenant = self.tenant(),
            "Device reset: all verbs objects released"
        );
        self.device().release_all();
    }

    /// GET_VRING_BASE: the frontend stops a ring. QEMU sends no
    /// RESET_DEVICE (nor SET_STATUS, which this backend does not offer)
    /// when the guest resets the device or the machine reboots: it stops
    /// every started ring, and later starts them again from index 0 for
    /// the new driver (docs/vm.md has the recorded sequences). So a
    /// stopped control queue is the device reset: the driver that made the
    /// objects is gone, and nothing of it may outlive it — least of all
    /// QPs that a peer could still write into memory the rebooted guest
    /// reuses. A VM pause (QMP stop) stops the rings the same way, so it
    /// resets the device too.
    fn stop_vring(&self, queue_index: u32) -> io::Result<()> {
        if queue_index == u32::from(CONTROL_QUEUE) {
            tracing::info!(
                tenant = self.tenant(),
                "Control queue stopped (device reset): all verbs objects released"
            );
            self.device().release_all();
        }
        Ok(())
    }

    fn set_event_idx(&self, enabled: bool) {
        self.inner.event_idx.store(enabled, Ordering::Relaxed);
    }

    fn get_config(&self, offset: u32, size: u32) -> Vec<u8> {
        let device = self.device();
        let bytes = device.config().as_bytes();
        let start = (offset as usize).min(bytes.len());
        let end = start.saturating_add(size as usize).min(bytes.len());
        bytes[start..end].to_vec()
    }

    fn set_config(&self, offset: u32, _buf: &[u8]) -> io::Result<()> {
        tracing::warn!(
            tenant = self.tenant(),
            offset,
            "Refused a write to the read-only config space"
        );
        Err(io::Error::from(io::ErrorKind::PermissionDenied))
    }

    fn update_memory(&self, mem: GuestMemoryAtomic<GuestMemoryMmap>) -> io::Result<()> {
        let snapshot = mem.memory().into_inner();
        tracing::info!(
            tenant = self.tenant(),
            regions = snapshot.num_regions(),
            "Guest memory table updated"
        );
        self.device().update_memory(snapshot);
        *self.inner.mem.lock().unwrap_or_else(|p| p.into_inner()) = Some(mem);
        Ok(())
    }

    fn exit_event(&self, _thread_index: usize) -> Option<(EventConsumer, EventNotifier)> {
        let (consumer, notifier) = new_event_consumer_and_notifier(EventFlag::NONBLOCK).ok()?;
        let kept = notifier.try_clone().ok()?;
        // vhost-user-backend 0.24 adds the consumer to its epoll set with
        // `into_raw_fd()` and never closes it (`VringEpollHandler::new`):
        // an eventfd leaked per frontend connection. vdev owns it instead,
        // closed when this backend (the daemon's and its workers' last
        // user) goes, and lends the daemon its number.
        // SAFETY: `consumer` is a fresh eventfd we own.
        let owned = unsafe { OwnedFd::from_raw_fd(consumer.into_raw_fd()) };
        // SAFETY: the daemon's only use of the lent consumer is
        // `into_raw_fd()` (never closed on its side), and the descriptor
        // stays open while the daemon's worker threads use it: they are
        // joined when the daemon drops, before the backend's last clone.
        let consumer = unsafe { EventConsumer::from_raw_fd(owned.as_raw_fd()) };
        self.inner
            .exit_consumers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(owned);
        self.inner
            .exit_notifiers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(kept);
        Some((consumer, notifier))
    }

    fn handle_event(
        &self,
        device_event: u16,
        _evset: EventSet,
        vrings: &[VringRwLock],
        _thread_id: usize,
    ) -> io::Result<()> {
        let vring = vrings
            .get(usize::from(device_event))
            .ok_or(BackendError::UnknownEvent(device_event))?;
        self.inner.vrings.capture(vrings);
        match device_event {
            CONTROL_QUEUE => {
                self.process_control_queue(vring)?;
                // A new or newly connected QP has rings the sleeping
                // datapath has not asked to be kicked for yet: let it look.
                self.wake_datapath();
            }
            // The driver published work while the datapath slept.
            DOORBELL_QUEUE => self.wake_datapath(),
            // New event buffers: an event held for lack of one can go now.
            q if q >= FIRST_EVENT_QUEUE => self.wake_datapath(),
            _ => return Err(BackendError::UnknownEvent(device_event).into()),
        }
        Ok(())
    }
}
