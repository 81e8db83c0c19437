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
//!
//! vdev may die and be restarted on the same socket path, taking over the
//! device's state. The transport then reconnects by itself
//! ([`VhostUserTransport::reconnect`]): it remembers what it told the
//! backend (features, memory regions, queues) and tells the new one again,
//! each queue resuming at the used index the old backend last published.
//! Layers above see at most a spurious wake-up; the data path does not go
//! through vdev and is unaffected.

use std::fs::File;
use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::os::unix::fs::FileExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use vhost::vhost_user::message::{
    VhostUserConfigFlags, VhostUserHeaderFlag, VhostUserProtocolFeatures, VhostUserVirtioFeatures,
};
use vhost::vhost_user::{Frontend, VhostUserFrontend};
use vhost::{VhostBackend, VhostUserMemoryRegionInfo, VringConfigData};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};
use vrdma_errors::error_chain;

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

/// How long [`VhostUserTransport::reconnect`] waits for a restarted vdev
/// to listen on its socket again and take the connection.
pub const RECONNECT_PATIENCE: Duration = Duration::from_secs(10);

/// A memory region the backend was told about, kept to tell a new backend.
#[derive(Debug)]
struct Region {
    device_addr: u64,
    size: u64,
    host_addr: u64,
    /// Our own duplicate: the caller's fd is only borrowed, and a reconnect
    /// may come long after that borrow ended.
    fd: OwnedFd,
}

struct State {
    frontend: Frontend,
    /// SET_MEM_TABLE goes first; later regions use ADD_MEM_REG.
    mem_table_sent: bool,
    /// Bumped by each reconnect, so that of the threads that saw one
    /// connection end, only the first reconnects.
    generation: u64,
    /// A reconnect failed: the device is gone for good (logged once).
    broken: bool,
    /// What the backend was told, to tell a new one after a reconnect.
    acked_features: Option<u64>,
    regions: Vec<Region>,
    queues: Vec<QueueSetup>,
    /// How long a reconnect waits for vdev ([`RECONNECT_PATIENCE`] unless
    /// set); zero: a vdev that went away is not waited for.
    patience: Duration,
}

impl std::fmt::Debug for State {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("State")
            .field("frontend", &self.frontend.as_raw_fd())
            .field("mem_table_sent", &self.mem_table_sent)
            .field("generation", &self.generation)
            .field("broken", &self.broken)
            .field("acked_features", &self.acked_features)
            .field("regions", &self.regions)
            .field("queues", &self.queues)
            .finish()
    }
}

/// The socket `wait` watches for a hang-up, and which connection it is.
#[derive(Debug)]
struct Watched {
    generation: u64,
    /// A duplicate of the frontend's socket, shared with the waiters that
    /// poll it: a waiter never polls a closed fd whose number was reused.
    socket: Arc<OwnedFd>,
}

/// A vrdma device reached over a vhost-user socket.
///
/// The connection itself ([`Link`]) is shared with a thread that watches
/// the socket: when vdev goes away it reconnects at once, not only when
/// the application next needs vdev — a program that only polls its CQs
/// never would, and hostd keeps a dead vdev's context for a successor only
/// for a while (`orphan_grace_ms`).
#[derive(Debug)]
pub struct VhostUserTransport {
    link: Arc<Link>,
    /// Wakes the watcher to end it.
    stop: Arc<EventFd>,
    watcher: Option<std::thread::JoinHandle<()>>,
}

impl Drop for VhostUserTransport {
    fn drop(&mut self) {
        let _ = self.stop.write(1);
        if let Some(watcher) = self.watcher.take() {
            let _ = watcher.join();
        }
    }
}

impl std::ops::Deref for VhostUserTransport {
    type Target = Link;
    fn deref(&self) -> &Link {
        &self.link
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
        let link = Arc::new(Link::connect_within(path.as_ref(), busy_timeout)?);
        let stop = Arc::new(EventFd::new(EFD_NONBLOCK).map_err(TransportError::EventFd)?);
        let watcher = {
            let (link, stop) = (Arc::clone(&link), Arc::clone(&stop));
            std::thread::Builder::new()
                .name("vrdma-vhost-watch".into())
                .spawn(move || link.watch(&stop))
                .map_err(TransportError::Watch)?
        };
        Ok(VhostUserTransport {
            link,
            stop,
            watcher: Some(watcher),
        })
    }
}

/// One vhost-user connection to vdev, and what it told vdev (to tell a
/// restarted vdev again).
#[derive(Debug)]
pub struct Link {
    path: PathBuf,
    state: Mutex<State>,
    /// Per queue: the eventfd we write to kick the device.
    kicks: Vec<EventFd>,
    /// Per queue: the eventfd the device writes to interrupt us.
    calls: Vec<EventFd>,
    /// The vhost-user socket, watched while waiting so that a vdev that
    /// died is noticed at once instead of after a timeout. Its own lock,
    /// never held across I/O: waiters must not queue behind a request.
    watched: Mutex<Watched>,
}

fn request(request: &'static str) -> impl FnOnce(vhost::Error) -> TransportError {
    move |source| TransportError::VhostUser { request, source }
}

/// Whether a request failed because the backend is gone (rather than
/// because it refused it): worth a reconnect.
fn peer_gone(e: &TransportError) -> bool {
    use vhost::vhost_user::Error as E;
    match e {
        TransportError::Disconnected => true,
        TransportError::VhostUser {
            source: vhost::Error::VhostUserProtocol(e),
            ..
        } => match e {
            E::Disconnected | E::SocketBroken(_) | E::PartialMessage => true,
            E::SocketError(io) => matches!(
                io.raw_os_error(),
                Some(libc::EPIPE | libc::ECONNRESET | libc::ENOTCONN)
            ),
            _ => false,
        },
        _ => false,
    }
}

impl Region {
    fn new(region: &DmaRegion<'_>) -> Result<Self, TransportError> {
        Ok(Self {
            device_addr: region.device_addr,
            size: region.size,
            host_addr: region.host_addr,
            fd: region
                .fd
                .try_clone_to_owned()
                .map_err(TransportError::RegionFd)?,
        })
    }

    // The struct gains Xen fields when another crate enables vhost's `xen`
    // feature; the update keeps this compiling then.
    #[allow(clippy::needless_update)]
    fn info(&self) -> VhostUserMemoryRegionInfo {
        VhostUserMemoryRegionInfo {
            guest_phys_addr: self.device_addr,
            memory_size: self.size,
            userspace_addr: self.host_addr,
            mmap_offset: 0,
            mmap_handle: self.fd.as_raw_fd(),
            ..Default::default()
        }
    }
}

/// The used index the device last published in queue `q`'s used ring: the
/// queue resumes there after a reconnect. Entries published as used are
/// done; what was made available after them is offered again.
///
/// Read through the region's file (at the ring's offset in it) rather than
/// through our mapping: it needs no unsafe code and does not depend on the
/// mapping still being there. The region is a memfd mapped shared from
/// offset 0, so the file's bytes are the ring's bytes. No one writes the
/// index meanwhile: its writer is the backend that went away.
fn published_used_index(regions: &[Region], q: &QueueSetup) -> Result<u16, TransportError> {
    let outside = TransportError::RingOutsideMemory(q.index);
    // `struct vring_used { le16 flags; le16 idx; ... }`.
    let idx_addr = q.used_addr.checked_add(2).ok_or(outside)?;
    let region = regions
        .iter()
        .find(|r| {
            idx_addr >= r.device_addr
                && idx_addr
                    .checked_add(2)
                    .is_some_and(|end| end <= r.device_addr.saturating_add(r.size))
        })
        .ok_or(TransportError::RingOutsideMemory(q.index))?;
    let file = File::from(
        region
            .fd
            .try_clone()
            .map_err(|source| TransportError::UsedIndex {
                queue: q.index,
                source,
            })?,
    );
    let mut idx = [0u8; 2];
    file.read_exact_at(&mut idx, idx_addr - region.device_addr)
        .map_err(|source| TransportError::UsedIndex {
            queue: q.index,
            source,
        })?;
    Ok(u16::from_le_bytes(idx))
}

/// A shared duplicate of `frontend`'s socket, for waiters to poll.
fn watch_socket(frontend: &Frontend) -> Result<Arc<OwnedFd>, TransportError> {
    // SAFETY: the frontend owns the socket and keeps it open for the
    // duration of this borrow, which only duplicates it.
    let socket = unsafe { BorrowedFd::borrow_raw(frontend.as_raw_fd()) };
    Ok(Arc::new(
        socket.try_clone_to_owned().map_err(TransportError::Watch)?,
    ))
}

/// Connects to `path`, waiting until `deadline` while no one listens there
/// yet (a restarted vdev that has not yet bound its socket).
fn connect_patiently(path: &Path, deadline: Instant) -> Result<Frontend, TransportError> {
    let mut nap_ms = 1;
    loop {
        let error = match UnixStream::connect(path) {
            Ok(socket) => return Ok(Frontend::from_stream(socket, 1)),
            Err(e) => e,
        };
        let now = Instant::now();
        let missing = matches!(
            error.kind(),
            std::io::ErrorKind::NotFound | std::io::ErrorKind::ConnectionRefused
        );
        if !missing || now >= deadline {
            return Err(TransportError::Connect {
                path: path.to_owned(),
                source: vhost::Error::VhostUserProtocol(vhost::vhost_user::Error::SocketConnect(
                    error,
                )),
            });
        }
        std::thread::sleep((deadline - now).min(Duration::from_millis(nap_ms)));
        nap_ms = (nap_ms * 2).min(50);
    }
}

/// Negotiates the vhost-user protocol on a new connection (owner, protocol
/// features, NEED_REPLY) and returns the device's queue count; waits up to
/// `busy_timeout` while vdev serves another application.
fn handshake(
    frontend: &mut Frontend,
    path: &Path,
    busy_timeout: Duration,
) -> Result<u64, TransportError> {
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
    Ok(queues)
}

/// Sets queue `q` up on the backend, starting at ring index `base`, and
/// enables it if `enable` (a reconnect enables the queues only once all
/// are set up, as QEMU does: the backend may start on the first enabled
/// one, and must then find every queue's eventfds there).
fn program_queue(
    frontend: &mut Frontend,
    q: &QueueSetup,
    base: u16,
    (kick, call): (&EventFd, &EventFd),
    enable: bool,
) -> Result<(), TransportError> {
    let i = usize::from(q.index);
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
        .set_vring_base(i, base)
        .map_err(request("SET_VRING_BASE"))?;
    frontend
        .set_vring_call(i, call)
        .map_err(request("SET_VRING_CALL"))?;
    frontend
        .set_vring_kick(i, kick)
        .map_err(request("SET_VRING_KICK"))?;
    if enable {
        frontend
            .set_vring_enable(i, true)
            .map_err(request("SET_VRING_ENABLE"))?;
    }
    Ok(())
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

impl Link {
    fn connect_within(path: &Path, busy_timeout: Duration) -> Result<Self, TransportError> {
        let mut frontend =
            Frontend::connect(path, 1).map_err(|source| TransportError::Connect {
                path: path.to_owned(),
                source,
            })?;
        let queues = handshake(&mut frontend, path, busy_timeout)?;
        let eventfds = || {
            (0..queues)
                .map(|_| EventFd::new(EFD_NONBLOCK).map_err(TransportError::EventFd))
                .collect::<Result<Vec<_>, _>>()
        };
        tracing::debug!(path = %path.display(), queues, "Connected to vhost-user backend");
        Ok(Self {
            path: path.to_owned(),
            kicks: eventfds()?,
            calls: eventfds()?,
            watched: Mutex::new(Watched {
                generation: 0,
                socket: watch_socket(&frontend)?,
            }),
            state: Mutex::new(State {
                frontend,
                mem_table_sent: false,
                generation: 0,
                broken: false,
                acked_features: None,
                regions: Vec::new(),
                queues: Vec::new(),
                patience: RECONNECT_PATIENCE,
            }),
        })
    }

    /// Connects to the device's socket again (vdev was restarted there) and
    /// tells the new backend everything the old one was told: features,
    /// memory, and each queue, resuming at the used index the old backend
    /// last published. Waits up to [`RECONNECT_PATIENCE`] for vdev to
    /// listen again. The queues' eventfds stay the same, and each set-up
    /// queue is kicked afterwards so the backend looks at it at once.
    pub fn reconnect(&self) -> Result<(), TransportError> {
        self.reconnect_locked(&mut self.state())
    }

    fn reconnect_locked(&self, state: &mut State) -> Result<(), TransportError> {
        if state.patience.is_zero() {
            return Err(TransportError::Disconnected);
        }
        tracing::info!(path = %self.path.display(), "vdev went away; reconnecting");
        let started = Instant::now();
        let deadline = started + state.patience;
        // Hang the old connection up first: a backend still alive behind it
        // sees the end, and waiters still polling it wake up.
        // SAFETY: shutdown on the frontend's own open socket; it closes
        // nothing, so no fd is invalidated.
        unsafe { libc::shutdown(state.frontend.as_raw_fd(), libc::SHUT_RDWR) };
        // A connection can reach the dying vdev's listener, still open for
        // a moment after its connections closed, and then hang up in the
        // handshake: that is vdev not being back yet, not a refusal.
        let (mut frontend, queues) = loop {
            let mut frontend = connect_patiently(&self.path, deadline)?;
            let left = deadline.saturating_duration_since(Instant::now());
            match handshake(&mut frontend, &self.path, left) {
                Ok(queues) => break (frontend, queues),
                Err(e) if peer_gone(&e) && Instant::now() < deadline => {
                    tracing::debug!("A connection hung up in the handshake; trying again");
                    std::thread::sleep(Duration::from_millis(5));
                }
                Err(e) => return Err(e),
            }
        };
        if queues != self.kicks.len() as u64 {
            return Err(TransportError::QueueCountChanged {
                was: self.num_queues(),
                now: queues,
            });
        }
        if let Some(acked) = state.acked_features {
            frontend
                .set_features(acked)
                .map_err(request("SET_FEATURES"))?;
        }
        if let Some((first, rest)) = state.regions.split_first() {
            frontend
                .set_mem_table(&[first.info()])
                .map_err(request("SET_MEM_TABLE"))?;
            for region in rest {
                frontend
                    .add_mem_region(&region.info())
                    .map_err(request("ADD_MEM_REG"))?;
            }
        }
        let mut bases = Vec::with_capacity(state.queues.len());
        for q in &state.queues {
            let base = published_used_index(&state.regions, q)?;
            let (kick, call) = self.queue_fds(q.index)?;
            program_queue(&mut frontend, q, base, (kick, call), false)?;
            bases.push((q.index, base));
        }
        for q in &state.queues {
            frontend
                .set_vring_enable(usize::from(q.index), true)
                .map_err(request("SET_VRING_ENABLE"))?;
        }
        let socket = watch_socket(&frontend)?;
        // The old frontend (and its fd) goes only now that the new one
        // replaced it.
        drop(std::mem::replace(&mut state.frontend, frontend));
        state.generation += 1;
        state.broken = false;
        state.mem_table_sent = !state.regions.is_empty();
        *self.watched() = Watched {
            generation: state.generation,
            socket,
        };
        for q in &state.queues {
            self.notify(q.index)?;
        }
        tracing::info!(elapsed = ?started.elapsed(), generation = state.generation, "Reconnected to vdev");
        tracing::debug!(?bases, "Queues resumed at these used indexes (queue, base)");
        Ok(())
    }

    /// Reconnects after connection `seen` ended, unless another thread
    /// already did. A failure is final: logged once, then
    /// [`TransportError::Disconnected`] for everyone.
    /// Watches the socket until `stop`: when vdev hangs up, reconnects
    /// (once per connection: a waiter that saw the same hang-up finds the
    /// generation moved). Ends when a reconnect fails for good.
    fn watch(&self, stop: &EventFd) {
        loop {
            let (generation, socket) = {
                let watched = self.watched();
                (watched.generation, Arc::clone(&watched.socket))
            };
            let mut pfds = [
                // No events asked: poll reports hang-up and errors
                // regardless (replies to requests are not this thread's).
                libc::pollfd {
                    fd: socket.as_raw_fd(),
                    events: 0,
                    revents: 0,
                },
                libc::pollfd {
                    fd: stop.as_raw_fd(),
                    events: libc::POLLIN,
                    revents: 0,
                },
            ];
            // SAFETY: two valid pollfds for the duration of the call; the
            // socket's duplicate and `stop` stay open meanwhile.
            let n = unsafe { libc::poll(pfds.as_mut_ptr(), 2, -1) };
            if n < 0 {
                if std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted {
                    continue;
                }
                return;
            }
            if pfds[1].revents != 0 {
                return;
            }
            if pfds[0].revents & (libc::POLLHUP | libc::POLLERR) != 0
                && self.recover(generation).is_err()
            {
                return;
            }
        }
    }

    fn recover(&self, seen: u64) -> Result<(), TransportError> {
        let mut state = self.state();
        if state.generation != seen {
            return Ok(());
        }
        if state.broken {
            return Err(TransportError::Disconnected);
        }
        self.reconnect_locked(&mut state).map_err(|e| {
            tracing::warn!(error = %error_chain(&e), "Cannot reconnect to vdev; the device is gone");
            state.broken = true;
            TransportError::Disconnected
        })
    }

    /// Runs a request over the socket; if it failed because the backend is
    /// gone, reconnects and runs it once more. `op` records what it told
    /// the backend in the state (under the same lock, so that a concurrent
    /// reconnect either replays it or precedes it).
    fn with_reconnect<T>(
        &self,
        mut op: impl FnMut(&mut State) -> Result<T, TransportError>,
    ) -> Result<T, TransportError> {
        let seen = {
            let mut state = self.state();
            match op(&mut state) {
                Err(e) if peer_gone(&e) => {
                    tracing::debug!(error = %error_chain(&e), "vhost-user request found vdev gone");
                    state.generation
                }
                done => return done,
            }
        };
        self.recover(seen)?;
        op(&mut self.state())
    }

    fn watched(&self) -> MutexGuard<'_, Watched> {
        // Replaced whole: never inconsistent, recover from poisoning.
        self.watched.lock().unwrap_or_else(|e| e.into_inner())
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

/// Every call goes to the connection (`Link`'s own methods: `self.link`
/// is an `Arc`, which is a transport too).
impl Transport for VhostUserTransport {
    fn set_reconnect_patience(&self, patience: Duration) {
        self.link.as_ref().set_reconnect_patience(patience)
    }

    fn reconnects(&self) -> bool {
        self.link.as_ref().reconnects()
    }

    fn negotiate_features(&self, wanted: u64) -> Result<u64, TransportError> {
        self.link.as_ref().negotiate_features(wanted)
    }

    fn num_queues(&self) -> u16 {
        self.link.as_ref().num_queues()
    }

    fn read_config(&self, offset: u32, buf: &mut [u8]) -> Result<(), TransportError> {
        self.link.as_ref().read_config(offset, buf)
    }

    fn add_memory(&self, region: &DmaRegion<'_>) -> Result<(), TransportError> {
        self.link.as_ref().add_memory(region)
    }

    fn remove_memory(&self, region: &DmaRegion<'_>) -> Result<(), TransportError> {
        self.link.as_ref().remove_memory(region)
    }

    fn setup_queue(&self, q: &QueueSetup) -> Result<(), TransportError> {
        self.link.as_ref().setup_queue(q)
    }

    fn notify(&self, queue: u16) -> Result<(), TransportError> {
        self.link.as_ref().notify(queue)
    }

    fn wait(&self, queue: u16, timeout: Option<Duration>) -> Result<bool, TransportError> {
        self.link.as_ref().wait(queue, timeout)
    }

    fn acknowledge(&self, queue: u16) -> Result<(), TransportError> {
        self.link.as_ref().acknowledge(queue)
    }

    fn interrupt_fd(&self, queue: u16) -> Option<BorrowedFd<'_>> {
        self.link.as_ref().interrupt_fd(queue)
    }
}

impl Transport for Link {
    fn reconnects(&self) -> bool {
        !self.state().patience.is_zero()
    }

    fn set_reconnect_patience(&self, patience: Duration) {
        self.state().patience = patience;
    }

    fn negotiate_features(&self, wanted: u64) -> Result<u64, TransportError> {
        let mut state = self.state();
        let offered = state
            .frontend
            .get_features()
            .map_err(request("GET_FEATURES"))?;
        let acked = (wanted & offered) | VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits();
        state
            .frontend
            .set_features(acked)
            .map_err(request("SET_FEATURES"))?;
        state.acked_features = Some(acked);
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
        let (_, payload) = self.with_reconnect(|state| {
            state
                .frontend
                .get_config(offset, size, VhostUserConfigFlags::empty(), &zeroes)
                .map_err(request("GET_CONFIG"))
        })?;
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
        let mut pending = Some(Region::new(region)?);
        self.with_reconnect(|state| {
            let Some(region) = pending.as_ref() else {
                return Ok(());
            };
            let info = region.info();
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
            state.regions.extend(pending.take());
            Ok(())
        })
    }

    fn remove_memory(&self, region: &DmaRegion<'_>) -> Result<(), TransportError> {
        let (addr, size) = (region.device_addr, region.size);
        self.with_reconnect(|state| {
            let Some(i) = state
                .regions
                .iter()
                .position(|r| r.device_addr == addr && r.size == size)
            else {
                // Never added: let the backend say what it makes of it.
                let region = Region::new(region)?;
                return state
                    .frontend
                    .remove_mem_region(&region.info())
                    .map_err(request("REM_MEM_REG"));
            };
            state
                .frontend
                .remove_mem_region(&state.regions[i].info())
                .map_err(request("REM_MEM_REG"))?;
            state.regions.swap_remove(i);
            Ok(())
        })
    }

    fn setup_queue(&self, q: &QueueSetup) -> Result<(), TransportError> {
        let (kick, call) = self.queue_fds(q.index)?;
        let mut state = self.state();
        program_queue(&mut state.frontend, q, 0, (kick, call), true)?;
        state.queues.retain(|old| old.index != q.index);
        state.queues.push(*q);
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
        let (generation, socket) = {
            let watched = self.watched();
            (watched.generation, Arc::clone(&watched.socket))
        };
        let mut pfds = [
            libc::pollfd {
                fd: call.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
            // No events asked: poll reports hang-up and errors regardless.
            libc::pollfd {
                fd: socket.as_raw_fd(),
                events: 0,
                revents: 0,
            },
        ];
        // SAFETY: `pfds` is a valid array of two pollfds for the duration
        // of the call; `socket` keeps its fd open until after it.
        let n = unsafe { libc::poll(pfds.as_mut_ptr(), 2, timeout_ms) };
        let pfd = pfds[0];
        if pfds[1].revents & (libc::POLLHUP | libc::POLLERR) != 0 && pfd.revents & libc::POLLIN == 0
        {
            // vdev went away: once reconnected (by us or by another
            // waiter), a spurious wake-up makes the caller look again.
            drop(socket);
            self.recover(generation)?;
            return Ok(false);
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

#[cfg(test)]
mod tests {
    use std::fs::File;
    use std::io::Read;
    use std::os::unix::fs::{FileExt, MetadataExt};
    use std::os::unix::net::{UnixListener, UnixStream};
    use std::path::{Path, PathBuf};
    use std::sync::{Arc, Mutex};
    use std::thread::JoinHandle;
    use std::time::Duration;

    use vhost::vhost_user::message::*;
    use vhost::vhost_user::{
        Backend, BackendReqHandler, Error, GpuBackend, Result, VhostUserBackendReqHandlerMut,
    };
    use vhost::VhostUserMemoryRegionBase;

    use super::{VhostUserTransport, REQUIRED_PROTOCOL_FEATURES};
    use crate::dma::DmaArena;
    use crate::transport::{QueueSetup, Transport, TransportError, VIRTIO_F_VERSION_1};

    /// What a stand-in backend was told.
    #[derive(Debug, Default)]
    struct Recorder {
        acked_features: Option<u64>,
        /// (index, base) of each SET_VRING_BASE.
        bases: Vec<(u32, u32)>,
        /// (guest address, inode of the fd) of each region received.
        regions: Vec<(u64, u64)>,
        kicks: Vec<(u8, File)>,
    }

    fn nope<T>() -> Result<T> {
        Err(Error::InvalidOperation("not in this test"))
    }

    fn inode(file: &File) -> u64 {
        file.metadata().map_or(0, |m| m.ino())
    }

    impl VhostUserBackendReqHandlerMut for Recorder {
        fn set_owner(&mut self) -> Result<()> {
            Ok(())
        }
        fn reset_owner(&mut self) -> Result<()> {
            nope()
        }
        fn reset_device(&mut self) -> Result<()> {
            nope()
        }
        fn get_features(&mut self) -> Result<u64> {
            Ok(VIRTIO_F_VERSION_1 | VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits())
        }
        fn set_features(&mut self, features: u64) -> Result<()> {
            self.acked_features = Some(features);
            Ok(())
        }
        fn set_mem_table(
            &mut self,
            ctx: &[VhostUserMemoryRegion],
            files: Vec<File>,
            _: Option<bool>,
        ) -> Result<Option<Vec<VhostUserMemoryRegionBase>>> {
            let received = ctx.iter().zip(&files);
            self.regions = received
                .map(|(r, f)| (r.guest_phys_addr, inode(f)))
                .collect();
            Ok(None)
        }
        fn set_vring_num(&mut self, _: u32, _: u32) -> Result<()> {
            Ok(())
        }
        fn set_vring_addr(
            &mut self,
            _: u32,
            _: VhostUserVringAddrFlags,
            _: u64,
            _: u64,
            _: u64,
            _: u64,
        ) -> Result<()> {
            Ok(())
        }
        fn set_vring_base(&mut self, index: u32, base: u32) -> Result<()> {
            self.bases.push((index, base));
            Ok(())
        }
        fn get_vring_base(&mut self, _: u32) -> Result<VhostUserVringState> {
            nope()
        }
        fn set_vring_kick(&mut self, index: u8, fd: Option<File>) -> Result<()> {
            self.kicks.extend(fd.map(|f| (index, f)));
            Ok(())
        }
        fn set_vring_call(&mut self, _: u8, _: Option<File>) -> Result<()> {
            Ok(())
        }
        fn set_vring_err(&mut self, _: u8, _: Option<File>) -> Result<()> {
            nope()
        }
        fn get_protocol_features(&mut self) -> Result<VhostUserProtocolFeatures> {
            Ok(REQUIRED_PROTOCOL_FEATURES)
        }
        fn set_protocol_features(&mut self, _: u64) -> Result<()> {
            Ok(())
        }
        fn get_queue_num(&mut self) -> Result<u64> {
            Ok(2)
        }
        fn set_vring_enable(&mut self, _: u32, _: bool) -> Result<()> {
            Ok(())
        }
        fn get_config(&mut self, _: u32, size: u32, _: VhostUserConfigFlags) -> Result<Vec<u8>> {
            Ok(vec![0xab; size as usize])
        }
        fn set_config(&mut self, _: u32, _: &[u8], _: VhostUserConfigFlags) -> Result<()> {
            nope()
        }
        fn set_backend_req_fd(&mut self, _: Backend) {}
        fn set_gpu_socket(&mut self, _: GpuBackend) -> Result<()> {
            nope()
        }
        fn get_shared_object(&mut self, _: VhostUserSharedMsg) -> Result<File> {
            nope()
        }
        fn get_inflight_fd(&mut self, _: &VhostUserInflight) -> Result<(VhostUserInflight, File)> {
            nope()
        }
        fn set_inflight_fd(&mut self, _: &VhostUserInflight, _: File) -> Result<()> {
            nope()
        }
        fn get_max_mem_slots(&mut self) -> Result<u64> {
            Ok(8)
        }
        fn add_mem_region(
            &mut self,
            region: &VhostUserSingleMemoryRegion,
            fd: File,
            _: Option<bool>,
        ) -> Result<Option<VhostUserMemoryRegionBase>> {
            self.regions.push((region.guest_phys_addr, inode(&fd)));
            Ok(None)
        }
        fn remove_mem_region(&mut self, _: &VhostUserSingleMemoryRegion) -> Result<()> {
            Ok(())
        }
        fn set_device_state_fd(
            &mut self,
            _: VhostTransferStateDirection,
            _: VhostTransferStatePhase,
            _: File,
        ) -> Result<Option<File>> {
            nope()
        }
        fn check_device_state(&mut self) -> Result<()> {
            nope()
        }
        fn get_shmem_config(&mut self) -> Result<VhostUserShMemConfig> {
            nope()
        }
        fn set_log_base(&mut self, _: &VhostUserLog, _: File) -> Result<()> {
            nope()
        }
    }

    /// A stand-in vdev listening on `path`, serving one frontend.
    struct FakeVdev {
        path: PathBuf,
        recorder: Arc<Mutex<Recorder>>,
        /// The served connection, once accepted, to hang it up.
        conn: Arc<Mutex<Option<UnixStream>>>,
        thread: Option<JoinHandle<()>>,
    }

    impl FakeVdev {
        fn start(path: &Path) -> Self {
            let listener = UnixListener::bind(path).expect("bind the test socket");
            let recorder = Arc::new(Mutex::new(Recorder::default()));
            let conn = Arc::new(Mutex::new(None));
            let (r, c) = (Arc::clone(&recorder), Arc::clone(&conn));
            let thread = std::thread::spawn(move || {
                let Ok((stream, _)) = listener.accept() else {
                    return;
                };
                *c.lock().expect("lock") = stream.try_clone().ok();
                let mut handler = BackendReqHandler::from_stream(stream, r);
                while handler.handle_request().is_ok() {}
            });
            Self {
                path: path.to_owned(),
                recorder,
                conn,
                thread: Some(thread),
            }
        }

        /// Dies like a SIGKILLed vdev: the connection closes and the socket
        /// path is gone until a new one binds it.
        fn kill(mut self) -> Recorder {
            if let Some(conn) = self.conn.lock().expect("lock").take() {
                let _ = conn.shutdown(std::net::Shutdown::Both);
            }
            if let Some(thread) = self.thread.take() {
                thread.join().expect("backend thread");
            }
            let _ = std::fs::remove_file(&self.path);
            std::mem::take(&mut *self.recorder.lock().expect("lock"))
        }
    }

    /// The counter of a kick eventfd the backend received (0: not kicked).
    fn kicked(recorder: &Recorder, queue: u8) -> u64 {
        let Some((_, file)) = recorder.kicks.iter().find(|(i, _)| *i == queue) else {
            return 0;
        };
        let mut count = [0u8; 8];
        (&*file)
            .read_exact(&mut count)
            .map_or(0, |()| u64::from_ne_bytes(count))
    }

    #[test]
    fn survives_a_vdev_restart() {
        let path =
            std::env::temp_dir().join(format!("vrdma-reconnect-{}.sock", std::process::id()));
        let _ = std::fs::remove_file(&path);
        let vdev = FakeVdev::start(&path);
        let transport = Arc::new(VhostUserTransport::connect(&path).expect("connect"));
        let acked = transport
            .negotiate_features(VIRTIO_F_VERSION_1)
            .expect("features");
        let arena = DmaArena::new(16 * 4096).expect("arena");
        let memfd = arena.file().expect("a memfd arena");
        transport
            .add_memory(&arena.region().expect("a region"))
            .expect("add memory");
        let base = arena.device_addr();
        let queue = QueueSetup {
            index: 0,
            size: 16,
            desc_addr: base,
            avail_addr: base + 4096,
            used_addr: base + 8192,
        };
        transport.setup_queue(&queue).expect("setup queue");
        // The device published 3 used entries before it died.
        let set_used = |idx: u16| {
            memfd
                .write_all_at(&idx.to_le_bytes(), 8192 + 2)
                .expect("ring")
        };
        set_used(3);

        let waiter = {
            let transport = Arc::clone(&transport);
            std::thread::spawn(move || transport.wait(0, Some(Duration::from_secs(30))))
        };
        // Let the waiter poll before the socket hangs up.
        std::thread::sleep(Duration::from_millis(100));
        let old = vdev.kill();
        assert_eq!(old.bases, [(0, 0)]);
        // vdev takes a while to come back: the socket is missing meanwhile.
        std::thread::sleep(Duration::from_millis(100));
        let vdev = FakeVdev::start(&path);
        let woke = waiter.join().expect("waiter");
        assert!(matches!(woke, Ok(false)), "wait returned {woke:?}");

        let memfd_inode = inode(memfd);
        let check = |new: &Recorder, used: u32| {
            assert_eq!(new.bases, [(0, used)], "queue 0 resumes at the used index");
            assert_eq!(new.regions, [(base, memfd_inode)], "the same memory");
            assert_eq!(new.acked_features, Some(acked));
            assert_eq!(kicked(new, 0), 1, "queue 0 kicked after the handshake");
        };
        let new = std::mem::take(&mut *vdev.recorder.lock().expect("lock"));
        check(&new, 3);

        // A request that finds vdev gone reconnects and is answered.
        set_used(5);
        drop(vdev.kill());
        let vdev = FakeVdev::start(&path);
        let mut config = [0u8; 4];
        transport
            .read_config(0, &mut config)
            .expect("config after restart");
        assert_eq!(config, [0xab; 4]);
        let new = std::mem::take(&mut *vdev.recorder.lock().expect("lock"));
        check(&new, 5);

        // Nobody waits and nothing is asked (a program that only polls its
        // CQs): the watcher reconnects on its own.
        set_used(6);
        drop(vdev.kill());
        let vdev = FakeVdev::start(&path);
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        loop {
            let reconnected = !vdev.recorder.lock().expect("lock").bases.is_empty();
            if reconnected {
                // The kicks come last, once every queue is set up.
                std::thread::sleep(Duration::from_millis(200));
                break;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "the watcher did not reconnect"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        let new = std::mem::take(&mut *vdev.recorder.lock().expect("lock"));
        check(&new, 6);

        // A vdev that hangs up on every new connection: the reconnect
        // fails once its patience is spent, and the device is gone for
        // every later waiter too.
        transport.set_reconnect_patience(Duration::from_millis(500));
        drop(vdev.kill());
        let listener = UnixListener::bind(&path).expect("bind");
        let refuser = std::thread::spawn(move || drop(listener.accept()));
        let gone = transport.wait(0, Some(Duration::from_secs(30)));
        assert!(
            matches!(gone, Err(TransportError::Disconnected)),
            "{gone:?}"
        );
        refuser.join().expect("refuser");
        let again = transport.wait(0, Some(Duration::from_secs(30)));
        assert!(
            matches!(again, Err(TransportError::Disconnected)),
            "{again:?}"
        );
        let _ = std::fs::remove_file(&path);
    }
}
