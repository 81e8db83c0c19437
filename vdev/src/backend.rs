//! The vhost-user backend: what the VMM (or a process-mode driver) talks to.
//!
//! [`VrdmaBackend`] implements [`VhostUserBackend`]: it offers the virtio
//! features and vhost-user protocol features of the device, serves the config
//! space, takes memory-table updates (revoking shadows whose memory went
//! away), and drains the control queue into the [`RdmaDevice`]. It serves
//! the control queue and, on a device with a connection manager, the CM
//! event queue (`verbs/cm.rs` fills its buffers); the doorbell and event
//! queues are notification lines between the driver and hostd
//! ([`crate::vrings`]).

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, IntoRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use vhost::vhost_user::message::{VhostUserProtocolFeatures, VhostUserVirtioFeatures};
use vhost_user_backend::{VhostUserBackend, VhostUserDaemon, VringEpollHandler, VringT};
use virtio_bindings::virtio_config::VIRTIO_F_VERSION_1;
use virtio_bindings::virtio_ring::{VIRTIO_RING_F_EVENT_IDX, VIRTIO_RING_F_INDIRECT_DESC};
use virtio_queue::{QueueOwnedT, QueueT};
use vm_memory::{GuestAddressSpace, GuestMemoryAtomic, GuestMemoryBackend, GuestMemoryMmap};
use vmm_sys_util::epoll::EventSet;
use vmm_sys_util::event::{
    new_event_consumer_and_notifier, EventConsumer, EventFlag, EventNotifier,
};
use vrdma_hostd_protocol::messages::ContextKey;
use vrdma_spec::zerocopy::IntoBytes;
use vrdma_spec::CONTROL_QUEUE;
use vrdma_tenant_policy::Limits;

use crate::control;
use crate::fabric::Fabric;
use crate::seccomp::Threads;
use crate::verbs::cm::{cm_queue_index, CmEventWatch, CmSlot};
use crate::verbs::{DeviceIdentity, DeviceShare, RdmaDevice};
use crate::vrings::{self, DeviceVring, VringTable};

/// The worker's event number of the CM event queue's kicks (its second
/// queue: vhost-user-backend numbers a worker's events within its mask).
const CM_QUEUE_EVENT: u16 = 1;

/// How long the control queue's worker looks for the driver's next
/// command after answering a burst, before it sleeps on the queue's kick:
/// a connection's setup is ~15 commands on each side, each waiting for
/// the last one's answer, and each wake-up of this thread costs tens of
/// µs on an idle vCPU (docs/performance.md, "Connection setup"). Short:
/// an idle device spins not at all, a busy one at most this long after
/// its last command, on the tenant's own vdev process.
const CONTROL_SPIN: Duration = Duration::from_micros(50);

/// Why handling a queue event failed.
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    #[error("Event {0} does not belong to any queue this backend serves")]
    UnknownEvent(u16),
}

impl From<BackendError> for io::Error {
    fn from(e: BackendError) -> Self {
        io::Error::other(e)
    }
}

/// Why the device's vhost-user daemon cannot be built.
#[derive(Debug, thiserror::Error)]
pub enum DaemonSetupError {
    #[error("Cannot create the vhost-user daemon")]
    Daemon(#[source] crate::DaemonError),
    #[error("vhost-user-backend created {got} vrings for the {want} queues of the device")]
    Vrings { got: usize, want: usize },
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
    mem: Mutex<Option<GuestMemoryAtomic<GuestMemoryMmap>>>,
    event_idx: AtomicBool,
    /// Notifiers of the exit events handed to the daemon's worker threads.
    exit_notifiers: Mutex<Vec<EventNotifier>>,
    /// The exit events' consumer ends, owned here (see `exit_event`).
    exit_consumers: Mutex<Vec<OwnedFd>>,
    /// Every vring of the device, whose eventfds hostd is lent.
    vrings: Arc<VringTable>,
    /// Control-queue entries skipped because they named no descriptor.
    bad_heads: AtomicU64,
    /// The CM event queue's index, if the device has a connection manager.
    cm_queue: Option<u16>,
    /// The driver's control queue ran since the last reset: its key and
    /// starting position were looked at (a driver that came back takes its
    /// context over).
    control_started: AtomicBool,
}

/// The worker's epoll set, where the context's CM channels' eventfds are
/// watched (under the event id [`VrdmaBackend::cm_event_id`]).
struct EpollWatch {
    handler: std::sync::Weak<VringEpollHandler<VrdmaBackend>>,
    data: u64,
}

impl std::fmt::Debug for EpollWatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EpollWatch")
            .field("data", &self.data)
            .finish_non_exhaustive()
    }
}

impl CmEventWatch for EpollWatch {
    fn watch(&self, fd: std::os::fd::RawFd) -> io::Result<()> {
        let handler = self
            .handler
            .upgrade()
            .ok_or_else(|| io::Error::other("the worker is gone"))?;
        handler.register_listener(fd, EventSet::IN, self.data)
    }

    fn unwatch(&self, fd: std::os::fd::RawFd) {
        if let Some(handler) = self.handler.upgrade() {
            let _ = handler.unregister_listener(fd, EventSet::IN, self.data);
        }
    }
}

impl VrdmaBackend {
    /// A backend serving a fresh device, attached to hostd's fabric if
    /// `fabric` is given.
    pub fn new(identity: DeviceIdentity, limits: Limits, fabric: Option<Arc<Fabric>>) -> Self {
        Self::in_share(identity, limits, fabric, DeviceShare::default())
    }

    /// A backend for one context of a device whose contexts share `share`.
    pub fn in_share(
        identity: DeviceIdentity,
        limits: Limits,
        fabric: Option<Arc<Fabric>>,
        share: DeviceShare,
    ) -> Self {
        Self::in_share_with_cm(identity, limits, fabric, share, None)
    }

    /// [`VrdmaBackend::in_share`] for a device with a connection manager,
    /// found in `cm` while it runs: the device has one more queue, the CM
    /// event queue (`2 + num_comp_vectors`), served here.
    pub fn in_share_with_cm(
        identity: DeviceIdentity,
        limits: Limits,
        fabric: Option<Arc<Fabric>>,
        share: DeviceShare,
        cm: Option<CmSlot>,
    ) -> Self {
        let vrings = Arc::new(VringTable::default());
        let mut device = match fabric {
            Some(fabric) => {
                RdmaDevice::with_fabric(identity.clone(), limits, fabric, vrings.clone())
            }
            None => RdmaDevice::new(identity.clone(), limits),
        }
        .in_share(share);
        // A device whose CM queue would not fit the worker's queue mask
        // has no CM.
        let (cm_queue, cm) = match (cm, cm_queue_index(identity.comp_vectors)) {
            (Some(slot), Some(index)) => (Some(index), Some(slot)),
            _ => (None, None),
        };
        if let Some(slot) = cm {
            device = device.with_cm(slot);
        }
        VrdmaBackend {
            inner: Arc::new(Inner {
                identity,
                device: Arc::new(Mutex::new(device)),
                mem: Mutex::new(None),
                event_idx: AtomicBool::new(false),
                exit_notifiers: Mutex::new(Vec::new()),
                exit_consumers: Mutex::new(Vec::new()),
                vrings,
                bad_heads: AtomicU64::new(0),
                cm_queue,
                control_started: AtomicBool::new(false),
            }),
        }
    }

    /// The vhost-user daemon serving this backend. The device keeps every
    /// vring the daemon creates ([`crate::vrings`]), so that it can lend
    /// hostd the eventfds of the queues it does not serve.
    pub fn daemon(&self, name: String) -> Result<VhostUserDaemon<Self>, DaemonSetupError> {
        let (daemon, created) = vrings::collect(|| {
            VhostUserDaemon::new(
                name,
                self.clone(),
                GuestMemoryAtomic::new(GuestMemoryMmap::new()),
            )
        });
        let daemon = daemon.map_err(|e| DaemonSetupError::Daemon(crate::DaemonError(e)))?;
        let want = self.num_queues();
        if created.len() != want {
            return Err(DaemonSetupError::Vrings {
                got: created.len(),
                want,
            });
        }
        self.inner.vrings.set(created);
        if self.inner.cm_queue.is_some() {
            if let Some(handler) = daemon.get_epoll_handlers().first() {
                let watch = EpollWatch {
                    handler: Arc::downgrade(handler),
                    data: self.cm_event_id(),
                };
                self.device().cm_mut().set_watch(Arc::new(watch));
            }
        }
        Ok(daemon)
    }

    /// Starts the thread that applies hostd's policy reloads to the device
    /// (through `threads`, under its role's filter), if the device is on a
    /// fabric; it ends when the registration does, calling `lost` if hostd
    /// went away (see [`crate::fabric::listen_for_policy`]). Started again
    /// after each re-registration ([`crate::fabric::Fabric::reconnect`]).
    pub fn listen_for_policy(
        &self,
        threads: &Threads,
        lost: Box<dyn FnOnce() + Send>,
    ) -> io::Result<()> {
        let Some(fabric) = self.device().fabric().cloned() else {
            return Ok(());
        };
        match fabric.take_notifications() {
            Some(channel) => crate::fabric::listen_for_policy(
                self.inner.identity.tenant.clone(),
                channel,
                Arc::downgrade(&self.inner.device),
                Arc::downgrade(&fabric),
                lost,
                threads,
            ),
            None => Ok(()),
        }
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

    /// Control-queue entries skipped so far because they named a
    /// descriptor beyond the queue.
    pub fn skipped_entries(&self) -> u64 {
        self.inner.bad_heads.load(Ordering::Relaxed)
    }

    fn tenant(&self) -> &str {
        &self.inner.identity.tenant
    }

    /// The worker's event id of the CM channels' eventfds: past the queues
    /// and the exit event (vhost-user-backend reserves `0..=num_queues`).
    fn cm_event_id(&self) -> u64 {
        self.num_queues() as u64 + 1
    }

    /// Moves the context's waiting CM events into the buffers the driver
    /// posted on the CM event queue, and interrupts the driver. Runs when
    /// a channel's eventfd fires and when the driver kicks the queue (it
    /// posted buffers). Events stay queued while no buffer is posted.
    fn deliver_cm_events(&self) {
        let Some(index) = self.inner.cm_queue else {
            return;
        };
        let tenant = self.tenant();
        let Some(vring) = self.inner.vrings.get(index) else {
            self.device().cm_mut().clear_signals();
            return;
        };
        let atomic = self
            .inner
            .mem
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let Some(atomic) = atomic else {
            self.device().cm_mut().clear_signals();
            return;
        };
        let mem = atomic.memory();
        let event_idx = self.inner.event_idx.load(Ordering::Relaxed);
        let mut device = self.device();
        // Whatever follows, the channels' eventfds are quiet again (events
        // wait in their channels until a buffer is posted).
        device.cm_mut().clear_signals();
        loop {
            let delivered = {
                let mut state = vring.get_mut();
                let queue = state.get_queue_mut();
                if !queue.ready() {
                    // The driver did not set the CM queue up: events wait.
                    return;
                }
                device.cm_mut().deliver(&mem, queue)
            };
            if delivered.events + delivered.bad_buffers > 0 {
                match vring.needs_notification() {
                    Ok(true) => {
                        if let Err(e) = vring.signal_used_queue() {
                            tracing::warn!(tenant, error = %e, "CM event queue: cannot signal the driver");
                        }
                    }
                    Ok(false) => {}
                    Err(e) => {
                        tracing::warn!(tenant, error = %e, "CM event queue: cannot decide whether to signal")
                    }
                }
            }
            if !event_idx {
                return;
            }
            // Ask for the driver's next kick; buffers it posted meanwhile
            // are taken now.
            match vring.enable_notification() {
                Ok(true) if delivered.events > 0 => continue,
                Ok(_) => return,
                Err(e) => {
                    tracing::warn!(tenant, error = %e, "CM event queue: cannot enable notifications");
                    return;
                }
            }
        }
    }

    /// Drains the control queue, answering every chain, with the EVENT_IDX
    /// loop: disable notifications, drain, re-enable, drain again if the
    /// driver added chains meanwhile.
    ///
    /// Nothing the driver (or the frontend) puts in the queue stops it:
    /// problems are logged and the queue goes on. An error returned from
    /// here would end vhost-user-backend's worker thread, and with it the
    /// control queue for good.
    /// Whether the driver makes a control command available within
    /// `spin` (polled, its notifications still disabled).
    fn next_command_within(
        &self,
        vring: &DeviceVring,
        mem: &GuestMemoryMmap,
        spin: Duration,
    ) -> bool {
        let start = Instant::now();
        loop {
            let pending = {
                let state = vring.get_ref();
                let queue = state.get_queue();
                queue
                    .avail_idx(mem, Ordering::Acquire)
                    .is_ok_and(|avail| avail.0 != queue.next_avail())
            };
            if pending {
                return true;
            }
            if start.elapsed() >= spin {
                return false;
            }
            // Yield, not only spin: the tenant thread that will send the
            // next command may be waiting for this very CPU (a process
            // tenant, or a vCPU thread, on the vdev's core); with nothing
            // else to run the call returns at once.
            std::thread::yield_now();
        }
    }

    fn process_control_queue(&self, vring: &DeviceVring) {
        let tenant = self.tenant();
        let atomic = self
            .inner
            .mem
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let Some(atomic) = atomic else {
            tracing::warn!(
                tenant,
                "Control queue notified before the frontend sent guest memory; ignored"
            );
            return;
        };
        let mem = atomic.memory();
        if !self.inner.control_started.swap(true, Ordering::AcqRel) {
            let (desc, position) = {
                let state = vring.get_ref();
                let queue = state.get_queue();
                (queue.desc_table(), queue.next_avail())
            };
            match control_queue_key(&mem, desc) {
                Some(key) => {
                    if !self.device().control_queue_started(key, position) {
                        // Not yet: at the driver's next notification.
                        self.inner.control_started.store(false, Ordering::Release);
                        return;
                    }
                }
                None => tracing::debug!(
                    tenant,
                    "Control queue not in file-backed memory: the context cannot outlive vdev"
                ),
            }
        }
        let event_idx = self.inner.event_idx.load(Ordering::Relaxed);
        let warn = |what: &str, e: &dyn std::error::Error| {
            tracing::warn!(tenant, error = %vrdma_errors::error_chain(e), "Control queue: cannot {what}");
        };
        loop {
            if event_idx {
                if let Err(e) = vring.disable_notification() {
                    warn("disable notifications", &e);
                }
            }
            loop {
                let next = {
                    let mut state = vring.get_mut();
                    let queue = state.get_queue_mut();
                    let size = queue.size();
                    // The avail position of the chain popped next: a
                    // command's identity on the queue across a restart.
                    let position = queue.next_avail();
                    queue
                        .iter(&*mem)
                        .map(|mut chains| (chains.next(), size, position))
                };
                let (chain, size, position) = match next {
                    Ok(next) => next,
                    Err(e) => {
                        // The avail index runs more than the queue ahead:
                        // nothing can be popped, yet re-enabling
                        // notifications would report work for ever. Wait
                        // for the driver's next notification instead.
                        warn(
                            "take the driver's chains (waiting for its next notification)",
                            &e,
                        );
                        if event_idx {
                            let _ = vring.enable_notification();
                        }
                        return;
                    }
                };
                let Some(chain) = chain else { break };
                let head = chain.head_index();
                if head >= size {
                    // No used entry can name it: skip it, answer the rest.
                    let skipped = self.inner.bad_heads.fetch_add(1, Ordering::Relaxed) + 1;
                    tracing::warn!(
                        tenant,
                        head,
                        queue_size = size,
                        skipped,
                        "Control queue entry names a descriptor beyond the queue; skipped"
                    );
                    continue;
                }
                let used = control::process_chain(
                    &mut control::Locked(&self.inner.device),
                    &mem,
                    chain,
                    position,
                );
                if let Err(e) = vring.add_used(head, used) {
                    warn("return a chain", &e);
                }
            }
            match vring.needs_notification() {
                Ok(true) => {
                    if let Err(e) = vring.signal_used_queue() {
                        warn("signal the driver", &e);
                    }
                }
                Ok(false) => {}
                Err(e) => warn("decide whether to signal", &e),
            }
            if !event_idx {
                return;
            }
            // A driver sends commands in bursts (a QP's creation and its
            // transitions, a connection's setup): look for the next one
            // for a moment before sleeping, so that it does not pay this
            // thread's wake-up (tens of µs on an idle vCPU).
            if self.next_command_within(vring, &mem, CONTROL_SPIN) {
                continue;
            }
            match vring.enable_notification() {
                Ok(true) => continue,
                Ok(false) => return,
                Err(e) => {
                    warn("enable notifications", &e);
                    return;
                }
            }
        }
    }
}

/// The key of a context whose control queue's descriptor table is at
/// `desc` (device address): the table's backing file and offset. `None`
/// when the table is not in file-backed memory (nothing to find it by
/// after a restart).
fn control_queue_key(mem: &GuestMemoryMmap, desc: u64) -> Option<ContextKey> {
    use std::os::unix::fs::MetadataExt;
    use vm_memory::GuestMemoryRegion;
    let region = mem.find_region(vm_memory::GuestAddress(desc))?;
    let file = region.file_offset()?;
    let meta = file.file().metadata().ok()?;
    let offset = file.start().checked_add(desc - region.start_addr().0)?;
    Some(ContextKey {
        dev: meta.dev(),
        ino: meta.ino(),
        offset,
    })
}

impl VhostUserBackend for VrdmaBackend {
    type Bitmap = ();
    type Vring = DeviceVring;

    fn num_queues(&self) -> usize {
        let queues = usize::from(vrdma_spec::num_queues(self.inner.identity.comp_vectors));
        queues + usize::from(self.inner.cm_queue.is_some())
    }

    fn max_queue_size(&self) -> usize {
        usize::from(self.inner.identity.max_queue_size)
    }

    /// One worker thread, which serves the control queue and, on a device
    /// with a CM, the CM event queue (whose kicks say buffers were
    /// posted): a queue in no thread's mask never has its kick eventfd
    /// polled, so the doorbell queue's kicks are left for hostd, which
    /// sleeps on them, and the event queues' for nobody (the driver posts
    /// nothing there).
    fn queues_per_thread(&self) -> Vec<u64> {
        let cm = self
            .inner
            .cm_queue
            .and_then(|q| 1u64.checked_shl(u32::from(q)))
            .unwrap_or(0);
        vec![(1 << CONTROL_QUEUE) | cm]
    }

    fn features(&self) -> u64 {
        (1 << VIRTIO_F_VERSION_1)
            | (1 << VIRTIO_RING_F_EVENT_IDX)
            | (1 << VIRTIO_RING_F_INDIRECT_DESC)
            | vrdma_spec::VRDMA_F_RECONNECT
            | VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits()
    }

    fn acked_features(&self, features: u64) {
        tracing::info!(
            tenant = self.tenant(),
            features = format_args!("{features:#x}"),
            "Features acknowledged"
        );
        self.device()
            .set_frontend_reconnects(features & vrdma_spec::VRDMA_F_RECONNECT != 0);
    }

    fn protocol_features(&self) -> VhostUserProtocolFeatures {
        VhostUserProtocolFeatures::CONFIG
            | VhostUserProtocolFeatures::MQ
            | VhostUserProtocolFeatures::REPLY_ACK
            | VhostUserProtocolFeatures::CONFIGURE_MEM_SLOTS
            | VhostUserProtocolFeatures::RESET_DEVICE
    }

    fn reset_device(&self) {
        self.inner.control_started.store(false, Ordering::Release);
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
            self.inner.control_started.store(false, Ordering::Release);
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
        vrings: &[DeviceVring],
        _thread_id: usize,
    ) -> io::Result<()> {
        // The worker serves the control queue (its event 0, the first of
        // `vrings`) and, on a device with a CM, the CM event queue (event
        // 1) and the CM channels' eventfds.
        match (device_event, vrings.first()) {
            (CONTROL_QUEUE, Some(vring)) => {
                self.process_control_queue(vring);
                Ok(())
            }
            // The worker's events are numbered within its queue mask: the
            // CM event queue, after the control queue, is its event 1.
            (event, _)
                if self.inner.cm_queue.is_some()
                    && (event == CM_QUEUE_EVENT || u64::from(event) == self.cm_event_id()) =>
            {
                self.deliver_cm_events();
                Ok(())
            }
            _ => Err(BackendError::UnknownEvent(device_event).into()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use virtio_bindings::virtio_ring::{VRING_DESC_F_NEXT, VRING_DESC_F_WRITE};
    use virtio_queue::desc::split::Descriptor as SplitDescriptor;
    use virtio_queue::desc::RawDescriptor;
    use virtio_queue::mock::MockSplitQueue;
    use vm_memory::{Bytes, GuestAddress};
    use vrdma_spec::control::{Opcode, PdHandle, RequestHeader, ResponseHeader};
    use vrdma_spec::zerocopy::FromBytes;

    const QUEUE_SIZE: u16 = 16;
    const REQUEST: u64 = 0x1_0000;
    const RESPONSE: u64 = 0x2_0000;

    fn identity() -> DeviceIdentity {
        DeviceIdentity {
            tenant: Arc::from("t1"),
            lid: 1,
            link_layer: Default::default(),
            gid: vrdma_spec::gid::loopback_gid(1),
            comp_vectors: 1,
            max_queue_size: 256,
            active_mtu: vrdma_spec::verbs::Mtu::Mtu4096,
        }
    }

    /// A backend with guest memory and its control vring, laid out by
    /// virtio-queue's mock driver at address 0.
    fn control_queue() -> (
        VrdmaBackend,
        GuestMemoryAtomic<GuestMemoryMmap>,
        DeviceVring,
    ) {
        let backend = VrdmaBackend::new(identity(), Limits::default(), None);
        let mem = GuestMemoryAtomic::new(
            GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x10_0000)]).expect("memory"),
        );
        backend.update_memory(mem.clone()).expect("memory table");
        let guard = mem.memory();
        let mock = MockSplitQueue::new(&*guard, QUEUE_SIZE);
        let vring = DeviceVring::new(mem.clone(), QUEUE_SIZE).expect("vring");
        vring.set_queue_size(QUEUE_SIZE);
        vring
            .set_queue_info(
                mock.desc_table_addr().0,
                mock.avail_addr().0,
                mock.used_addr().0,
            )
            .expect("queue addresses");
        vring.set_queue_ready(true);
        vring.set_enabled(true);
        // Descriptors 0 and 1: an ALLOC_PD request and room for its answer.
        let descs = [
            SplitDescriptor::new(REQUEST, 8, VRING_DESC_F_NEXT as u16, 1),
            SplitDescriptor::new(RESPONSE, 64, VRING_DESC_F_WRITE as u16, 0),
        ];
        for (i, desc) in descs.into_iter().enumerate() {
            mock.desc_table()
                .store(i as u16, RawDescriptor::from(desc))
                .expect("descriptor");
        }
        let header = RequestHeader {
            opcode: u16::from(Opcode::AllocPd).into(),
            flags: 0.into(),
            payload_len: 0.into(),
        };
        guard
            .write_slice(header.as_bytes(), GuestAddress(REQUEST))
            .expect("request");
        drop(guard);
        (backend, mem, vring)
    }

    /// Makes `heads` available after the entries already there.
    fn offer(mem: &GuestMemoryAtomic<GuestMemoryMmap>, vring: &DeviceVring, heads: &[u16]) {
        let guard = mem.memory();
        let avail = vring.get_ref().get_queue().avail_ring();
        let idx: u16 = guard.read_obj(GuestAddress(avail + 2)).expect("avail idx");
        for (i, &head) in heads.iter().enumerate() {
            let slot = (idx as usize + i) % usize::from(QUEUE_SIZE);
            guard
                .write_obj(head, GuestAddress(avail + 4 + 2 * slot as u64))
                .expect("avail entry");
        }
        guard
            .write_obj(
                idx.wrapping_add(heads.len() as u16),
                GuestAddress(avail + 2),
            )
            .expect("avail idx");
    }

    /// The used entries so far: (head, length).
    fn used(mem: &GuestMemoryAtomic<GuestMemoryMmap>, vring: &DeviceVring) -> Vec<(u32, u32)> {
        let guard = mem.memory();
        let used = vring.get_ref().get_queue().used_ring();
        let idx: u16 = guard.read_obj(GuestAddress(used + 2)).expect("used idx");
        (0..u64::from(idx))
            .map(|i| {
                let elem = used + 4 + 8 * i;
                let head = guard.read_obj(GuestAddress(elem)).expect("id");
                let len = guard.read_obj(GuestAddress(elem + 4)).expect("len");
                (head, len)
            })
            .collect()
    }

    /// The control queue's kick, as vhost-user-backend's worker hands it
    /// to the backend.
    fn kick(backend: &VrdmaBackend, vring: &DeviceVring) -> std::io::Result<()> {
        backend.handle_event(CONTROL_QUEUE, EventSet::IN, std::slice::from_ref(vring), 0)
    }

    fn answer(mem: &GuestMemoryAtomic<GuestMemoryMmap>) -> (u32, PdHandle) {
        let mut bytes = [0u8; 16];
        mem.memory()
            .read_slice(&mut bytes, GuestAddress(RESPONSE))
            .expect("response");
        let (header, rest) = ResponseHeader::read_from_prefix(&bytes).expect("header");
        (
            header.status.get(),
            PdHandle::read_from_bytes(rest).expect("payload"),
        )
    }

    #[test]
    fn control_commands_are_answered_in_place() {
        let (backend, mem, vring) = control_queue();
        offer(&mem, &vring, &[0]);
        kick(&backend, &vring).expect("served");
        assert_eq!(used(&mem, &vring), [(0, 16)], "header and PdHandle");
        let (status, pd) = answer(&mem);
        assert_eq!(status, 0);
        assert_eq!(backend.device().object_counts().0, 1);
        assert_ne!(pd.pdn.get(), 0);
    }

    #[test]
    fn only_the_control_queue_is_served() {
        let (backend, _mem, vring) = control_queue();
        assert_eq!(backend.queues_per_thread(), vec![1]);
        let err = backend
            .handle_event(vrdma_spec::DOORBELL_QUEUE, EventSet::IN, &[vring], 0)
            .expect_err("the doorbell queue is hostd's");
        assert!(err.to_string().contains("Event 1"), "{err}");
    }

    /// An avail entry naming a descriptor beyond the queue used to make
    /// `add_used` fail and `handle_event` return the error, which ends
    /// vhost-user-backend's worker: the control queue was never served
    /// again. It is skipped; the commands around it are answered.
    #[test]
    fn a_head_beyond_the_queue_is_skipped_and_the_queue_goes_on() {
        let (backend, mem, vring) = control_queue();
        offer(&mem, &vring, &[QUEUE_SIZE, 0]);
        kick(&backend, &vring).expect("a bad entry is no error");
        assert_eq!(used(&mem, &vring), [(0, 16)], "the valid command only");
        let (status, first) = answer(&mem);
        assert_eq!(status, 0);
        assert_eq!(backend.skipped_entries(), 1);

        offer(&mem, &vring, &[u16::MAX, 0]);
        kick(&backend, &vring).expect("still no error");
        assert_eq!(used(&mem, &vring), [(0, 16), (0, 16)]);
        let (status, second) = answer(&mem);
        assert_eq!(status, 0);
        assert_ne!(first.pdn, second.pdn, "a second PD: the command ran");
        assert_eq!(backend.skipped_entries(), 2);
        assert_eq!(backend.device().object_counts().0, 2);
    }

    /// An avail index that runs more than the queue ahead names entries the
    /// queue cannot hold: nothing can be popped, yet with EVENT_IDX
    /// re-enabling notifications always reports more work. The drain loop
    /// must give up until the next notification rather than spin.
    #[test]
    fn an_avail_index_beyond_the_queue_does_not_spin_the_worker() {
        let (backend, mem, vring) = control_queue();
        backend.set_event_idx(true);
        vring.set_queue_event_idx(true);
        let avail = vring.get_ref().get_queue().avail_ring();
        mem.memory()
            .write_obj(QUEUE_SIZE + 5, GuestAddress(avail + 2))
            .expect("avail idx");
        let (done, finished) = std::sync::mpsc::channel();
        let worker = backend.clone();
        let control = vring.clone();
        std::thread::spawn(move || {
            let result = worker.handle_event(CONTROL_QUEUE, EventSet::IN, &[control], 0);
            let _ = done.send(result.is_ok());
        });
        let returned = finished.recv_timeout(std::time::Duration::from_secs(5));
        assert_eq!(returned, Ok(true), "handle_event returned, without error");
        assert!(used(&mem, &vring).is_empty());

        // The driver repairs its index: the queue works again.
        mem.memory()
            .write_obj(0u16, GuestAddress(avail + 2))
            .expect("avail idx");
        offer(&mem, &vring, &[0]);
        kick(&backend, &vring).expect("served");
        assert_eq!(used(&mem, &vring), [(0, 16)]);
    }

    #[test]
    fn a_notification_before_guest_memory_is_no_error() {
        let backend = VrdmaBackend::new(identity(), Limits::default(), None);
        let mem = GuestMemoryAtomic::new(GuestMemoryMmap::new());
        let vring = DeviceVring::new(mem, QUEUE_SIZE).expect("vring");
        backend
            .handle_event(CONTROL_QUEUE, EventSet::IN, &[vring], 0)
            .expect("ignored, the worker lives on");
    }
}
