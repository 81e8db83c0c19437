//! Process mode: the application is the vhost-user frontend (virtio-user).
//!
//! The driver talks to vdev over its unix socket with the `vhost` crate's
//! [`Frontend`], the way a VMM would: it hands over memfd-backed memory with
//! `guest_phys_addr == userspace_addr` (so guest-physical addresses are this
//! process's virtual addresses), sets the virtqueues up at those addresses,
//! and kicks/receives interrupts through eventfds.
//!
//! Every request is sent with NEED_REPLY (REPLY_ACK is required), so a
//! request the backend rejects fails here rather than later.
//!
//! Each queue has a kick and a call eventfd, whether or not it carries
//! descriptors: the doorbell queue's kick is what wakes the device's ring
//! poller (`notify`), and an event queue's call is its vector's interrupt
//! (`wait`, `interrupt_fd`), which the device signals after writing the
//! vector's event ring. Reading a call eventfd clears it, so `acknowledge`
//! comes before the waiter looks at its queue again.

use std::os::fd::{AsRawFd, BorrowedFd, RawFd};
use std::path::Path;
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use vhost::vhost_user::message::{
    VhostUserConfigFlags, VhostUserHeaderFlag, VhostUserProtocolFeatures, VhostUserVirtioFeatures,
};
use vhost::vhost_user::{Frontend, VhostUserFrontend};
use vhost::{VhostBackend, VhostUserMemoryRegionInfo, VringConfigData};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use super::{QueueSetup, Transport, TransportError};
use crate::dma::DmaRegion;

/// Protocol features the driver cannot work without: config space, the
/// queue count, acknowledged requests, and adding memory after start-up.
const REQUIRED_PROTOCOL_FEATURES: VhostUserProtocolFeatures = VhostUserProtocolFeatures::CONFIG
    .union(VhostUserProtocolFeatures::MQ)
    .union(VhostUserProtocolFeatures::REPLY_ACK)
    .union(VhostUserProtocolFeatures::CONFIGURE_MEM_SLOTS);

/// The vhost-user protocol allows at most this many queues.
const MAX_QUEUES: u64 = 256;

struct State {
    frontend: Frontend,
    /// SET_MEM_TABLE goes first; later regions use ADD_MEM_REG.
    mem_table_sent: bool,
}

impl std::fmt::Debug for State {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("State")
            .field("frontend", &self.frontend.as_raw_fd())
            .field("mem_table_sent", &self.mem_table_sent)
            .finish()
    }
}

/// A vrdma device reached over a vhost-user socket.
#[derive(Debug)]
pub struct VhostUserTransport {
    state: Mutex<State>,
    /// Per queue: the eventfd we write to kick the device.
    kicks: Vec<EventFd>,
    /// Per queue: the eventfd the device writes to interrupt us.
    calls: Vec<EventFd>,
    /// The vhost-user socket (owned by the frontend in `state`), watched
    /// while waiting so that a vdev that died is noticed at once instead
    /// of after a timeout.
    socket: RawFd,
}

fn request(request: &'static str) -> impl FnOnce(vhost::Error) -> TransportError {
    move |source| TransportError::VhostUser { request, source }
}

// The struct gains Xen fields when another crate enables vhost's `xen`
// feature; the update keeps this compiling then.
#[allow(clippy::needless_update)]
fn region_info(region: &DmaRegion<'_>) -> VhostUserMemoryRegionInfo {
    VhostUserMemoryRegionInfo {
        guest_phys_addr: region.device_addr,
        memory_size: region.size,
        userspace_addr: region.host_addr,
        mmap_offset: 0,
        mmap_handle: region.fd.as_raw_fd(),
        ..Default::default()
    }
}

/// How long [`VhostUserTransport::connect`] waits for vdev to take the
/// connection. vdev serves up to 64 frontends at once (contexts of the
/// device); one more waits in its backlog until one has gone, but not for
/// ever.
pub const DEFAULT_BUSY_TIMEOUT: Duration = Duration::from_secs(10);

/// Waits until the peer has read everything sent on the stream socket `fd`
/// (the kernel's count of unread bytes, `SIOCOUTQ`, is 0): Ok(true); or
/// `timeout` passed first: Ok(false). A peer that closes is an error.
fn wait_until_read(fd: RawFd, timeout: Duration) -> Result<bool, TransportError> {
    let deadline = Instant::now() + timeout;
    let mut nap_ms = 1;
    loop {
        let mut unread: libc::c_int = 0;
        // SAFETY: TIOCOUTQ (SIOCOUTQ) writes one c_int through the pointer,
        // which points at `unread`; `fd` is the frontend's open socket.
        if unsafe { libc::ioctl(fd, libc::TIOCOUTQ, &mut unread) } != 0 {
            return Err(TransportError::Watch(std::io::Error::last_os_error()));
        }
        if unread == 0 {
            return Ok(true);
        }
        let now = Instant::now();
        if now >= deadline {
            return Ok(false);
        }
        // The nap doubles as a hang-up check: poll reports POLLHUP and
        // POLLERR without being asked.
        let mut pfd = libc::pollfd {
            fd,
            events: 0,
            revents: 0,
        };
        let nap = (deadline - now).as_millis().min(nap_ms) as libc::c_int;
        // SAFETY: one valid pollfd for the duration of the call.
        unsafe { libc::poll(&mut pfd, 1, nap) };
        if pfd.revents & (libc::POLLHUP | libc::POLLERR) != 0 {
            return Err(TransportError::Disconnected);
        }
        nap_ms = (nap_ms * 2).min(50);
    }
}

impl VhostUserTransport {
    /// Connects to vdev's socket and negotiates the vhost-user protocol
    /// (owner, protocol features, queue count), waiting up to
    /// [`DEFAULT_BUSY_TIMEOUT`] while vdev serves another application.
    /// Virtio features are negotiated later by
    /// [`Transport::negotiate_features`].
    pub fn connect(path: impl AsRef<Path>) -> Result<Self, TransportError> {
        Self::connect_within(path, DEFAULT_BUSY_TIMEOUT)
    }

    /// [`VhostUserTransport::connect`], waiting up to `busy_timeout` for
    /// vdev to take the connection; then [`TransportError::Busy`].
    pub fn connect_within(
        path: impl AsRef<Path>,
        busy_timeout: Duration,
    ) -> Result<Self, TransportError> {
        let path = path.as_ref();
        let mut frontend =
            Frontend::connect(path, 1).map_err(|source| TransportError::Connect {
                path: path.to_owned(),
                source,
            })?;
        frontend.set_owner().map_err(request("SET_OWNER"))?;
        // SET_OWNER has no reply: the connection is served once vdev has
        // read it. Until then it waits in vdev's backlog, where a request
        // with a reply would wait for ever.
        if !wait_until_read(frontend.as_raw_fd(), busy_timeout)? {
            return Err(TransportError::Busy {
                path: path.to_owned(),
                waited: busy_timeout,
            });
        }
        let features = frontend.get_features().map_err(request("GET_FEATURES"))?;
        if features & VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits() == 0 {
            return Err(TransportError::MissingFeature(
                "VHOST_USER_F_PROTOCOL_FEATURES",
            ));
        }
        let protocol = frontend
            .get_protocol_features()
            .map_err(request("GET_PROTOCOL_FEATURES"))?;
        if !protocol.contains(REQUIRED_PROTOCOL_FEATURES) {
            let missing = REQUIRED_PROTOCOL_FEATURES - protocol;
            tracing::error!(?missing, "vhost-user backend lacks protocol features");
            return Err(TransportError::MissingFeature(
                "protocol features CONFIG, MQ, REPLY_ACK and CONFIGURE_MEM_SLOTS",
            ));
        }
        frontend
            .set_protocol_features(REQUIRED_PROTOCOL_FEATURES)
            .map_err(request("SET_PROTOCOL_FEATURES"))?;
        frontend.set_hdr_flags(VhostUserHeaderFlag::NEED_REPLY);
        let queues = frontend.get_queue_num().map_err(request("GET_QUEUE_NUM"))?;
        if queues > MAX_QUEUES {
            return Err(TransportError::TooManyQueues(queues));
        }
        let eventfds = || {
            (0..queues)
                .map(|_| EventFd::new(EFD_NONBLOCK).map_err(TransportError::EventFd))
                .collect::<Result<Vec<_>, _>>()
        };
        tracing::debug!(path = %path.display(), queues, "Connected to vhost-user backend");
        Ok(Self {
            kicks: eventfds()?,
            calls: eventfds()?,
            socket: frontend.as_raw_fd(),
            state: Mutex::new(State {
                frontend,
                mem_table_sent: false,
            }),
        })
    }

    fn state(&self) -> MutexGuard<'_, State> {
        // The state is consistent between requests: recover from poisoning.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn queue_fds(&self, queue: u16) -> Result<(&EventFd, &EventFd), TransportError> {
        let i = usize::from(queue);
        match (self.kicks.get(i), self.calls.get(i)) {
            (Some(kick), Some(call)) => Ok((kick, call)),
            _ => Err(TransportError::NoQueue(queue)),
        }
    }
}

impl Transport for VhostUserTransport {
    fn negotiate_features(&self, wanted: u64) -> Result<u64, TransportError> {
        let state = self.state();
        let offered = state
            .frontend
            .get_features()
            .map_err(request("GET_FEATURES"))?;
        let acked = (wanted & offered) | VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits();
        state
            .frontend
            .set_features(acked)
            .map_err(request("SET_FEATURES"))?;
        Ok(acked)
    }

    fn num_queues(&self) -> u16 {
        // At most MAX_QUEUES, checked in `connect`.
        self.kicks.len() as u16
    }

    fn read_config(&self, offset: u32, buf: &mut [u8]) -> Result<(), TransportError> {
        let size = u32::try_from(buf.len()).map_err(|_| TransportError::ConfigSize {
            expected: buf.len(),
            got: 0,
        })?;
        let zeroes = vec![0u8; buf.len()];
        let mut state = self.state();
        let (_, payload) = state
            .frontend
            .get_config(offset, size, VhostUserConfigFlags::empty(), &zeroes)
            .map_err(request("GET_CONFIG"))?;
        if payload.len() != buf.len() {
            return Err(TransportError::ConfigSize {
                expected: buf.len(),
                got: payload.len(),
            });
        }
        buf.copy_from_slice(&payload);
        Ok(())
    }

    fn add_memory(&self, region: &DmaRegion<'_>) -> Result<(), TransportError> {
        let info = region_info(region);
        let mut state = self.state();
        if state.mem_table_sent {
            state
                .frontend
                .add_mem_region(&info)
                .map_err(request("ADD_MEM_REG"))?;
        } else {
            state
                .frontend
                .set_mem_table(&[info])
                .map_err(request("SET_MEM_TABLE"))?;
            state.mem_table_sent = true;
        }
        Ok(())
    }

    fn remove_memory(&self, region: &DmaRegion<'_>) -> Result<(), TransportError> {
        let info = region_info(region);
        self.state()
            .frontend
            .remove_mem_region(&info)
            .map_err(request("REM_MEM_REG"))
    }

    fn setup_queue(&self, q: &QueueSetup) -> Result<(), TransportError> {
        let (kick, call) = self.queue_fds(q.index)?;
        let i = usize::from(q.index);
        let mut state = self.state();
        let frontend = &mut state.frontend;
        frontend
            .set_vring_num(i, q.size)
            .map_err(request("SET_VRING_NUM"))?;
        let config = VringConfigData {
            queue_max_size: q.size,
            queue_size: q.size,
            flags: 0,
            // Process mode: frontend virtual addresses are the device addresses.
            desc_table_addr: q.desc_addr,
            used_ring_addr: q.used_addr,
            avail_ring_addr: q.avail_addr,
            log_addr: None,
        };
        frontend
            .set_vring_addr(i, &config)
            .map_err(request("SET_VRING_ADDR"))?;
        frontend
            .set_vring_base(i, 0)
            .map_err(request("SET_VRING_BASE"))?;
        frontend
            .set_vring_call(i, call)
            .map_err(request("SET_VRING_CALL"))?;
        frontend
            .set_vring_kick(i, kick)
            .map_err(request("SET_VRING_KICK"))?;
        frontend
            .set_vring_enable(i, true)
            .map_err(request("SET_VRING_ENABLE"))?;
        Ok(())
    }

    fn notify(&self, queue: u16) -> Result<(), TransportError> {
        let (kick, _) = self.queue_fds(queue)?;
        kick.write(1)
            .map_err(|source| TransportError::Notify { queue, source })
    }

    fn wait(&self, queue: u16, timeout: Option<Duration>) -> Result<bool, TransportError> {
        let (_, call) = self.queue_fds(queue)?;
        let timeout_ms = timeout.map_or(-1, |t| i32::try_from(t.as_millis()).unwrap_or(i32::MAX));
        let mut pfds = [
            libc::pollfd {
                fd: call.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
            // No events asked: poll reports hang-up and errors regardless.
            libc::pollfd {
                fd: self.socket,
                events: 0,
                revents: 0,
            },
        ];
        // SAFETY: `pfds` is a valid array of two pollfds for the duration
        // of the call; the socket stays open while `self` lives.
        let n = unsafe { libc::poll(pfds.as_mut_ptr(), 2, timeout_ms) };
        let pfd = pfds[0];
        if pfds[1].revents & (libc::POLLHUP | libc::POLLERR) != 0 && pfd.revents & libc::POLLIN == 0
        {
            return Err(TransportError::Disconnected);
        }
        if n < 0 {
            let source = std::io::Error::last_os_error();
            if source.kind() == std::io::ErrorKind::Interrupted {
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

    fn acknowledge(&self, queue: u16) -> Result<(), TransportError> {
        let (_, call) = self.queue_fds(queue)?;
        // Reset the counter. Another waiter may have taken it already
        // (EAGAIN on a non-blocking eventfd): the interrupt still happened.
        match call.read() {
            Ok(_) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => Ok(()),
            Err(source) => Err(TransportError::Wait { queue, source }),
        }
    }

    fn interrupt_fd(&self, queue: u16) -> Option<BorrowedFd<'_>> {
        let call = self.calls.get(usize::from(queue))?;
        // SAFETY: the eventfd is owned by `self` and stays open as long as
        // the returned borrow, which is tied to `&self`.
        Some(unsafe { BorrowedFd::borrow_raw(call.as_raw_fd()) })
    }
}
