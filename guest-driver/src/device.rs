//! The driver core: bringing a vrdma device up and talking to it.
//!
//! [`Device::open`] negotiates features, checks the config space, gives the
//! device its first DMA arena and sets up the virtqueues: the control
//! queue, the doorbell queue and one event queue per completion vector.
//! Only the control queue carries descriptors; the others are notification
//! lines (a kick on the doorbell queue wakes the device, an interrupt of an
//! event queue says its vector's event ring has news). After `DRIVER_OK` it
//! gives the device its doorbell page (`SET_DOORBELL`) and one event ring
//! per completion vector (`CREATE_EQ`). It then serves the verbs layer:
//! control commands ([`Device::command`]), DMA allocations that grow the
//! device's memory on demand, doorbells, events, and application memory
//! sharing.

use std::any::Any;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use vrdma_spec::config::{DeviceConfig, CONFIG_MAGIC, CONFIG_SIZE};
use vrdma_spec::control::{CreateEqReq, Opcode, SetDoorbellReq};
use vrdma_spec::ring::{event_kind, Event};
use vrdma_spec::{CONTROL_QUEUE, DOORBELL_QUEUE, FIRST_EVENT_QUEUE, SPEC_VERSION_MAJOR};
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout};

use crate::cm::{CmQueue, CM_QUEUE_SIZE};
use crate::control::ControlQueue;
use crate::dma::{DmaArena, DmaBuf, DEFAULT_ARENA_SIZE, PAGE_SIZE};
use crate::error::{Error, Result};
use crate::event_ring::EventRing;
use crate::memory::DeviceMemory;
use crate::ring::DoorbellPage;
use crate::transport::{QueueSetup, Transport, VIRTIO_F_VERSION_1, VIRTIO_RING_F_EVENT_IDX};
use crate::virtqueue::SplitQueue;

/// Size of the virtqueues that carry no descriptors (the doorbell and
/// event queues): only their interrupts and notifications are used, but a
/// device only watches a queue that is fully set up.
const LINE_QUEUE_SIZE: u16 = 2;

/// Tunables of [`Device::open`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceOptions {
    /// Bytes of each DMA arena (a multiple of 4096). More arenas are added
    /// when one is full.
    pub arena_size: usize,
    /// How long a control command may take before the driver gives up on
    /// the control queue.
    pub control_timeout: Duration,
    /// How long to spin on a queue before sleeping on its interrupt: on a
    /// 2-core host a long spin steals the device's core.
    pub spin: Duration,
    /// Events each completion vector's event ring holds (a power of two up
    /// to `MAX_RING_DEPTH`). The device drops events that find it full.
    pub event_ring_depth: u32,
    /// How long a device whose backend went away (a restarted vdev) is
    /// waited for before its verbs fail with EIO; zero: not at all.
    pub reconnect_patience: Duration,
}

impl Default for DeviceOptions {
    fn default() -> Self {
        Self {
            arena_size: DEFAULT_ARENA_SIZE,
            control_timeout: Duration::from_secs(10),
            spin: Duration::from_micros(20),
            event_ring_depth: 1024,
            reconnect_patience: crate::transport::vhost_user::RECONNECT_PATIENCE,
        }
    }
}

/// An asynchronous event the device reported on an event ring.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceEvent {
    /// An armed CQ got a completion.
    Completion { cqn: u32 },
    /// A CQ overran.
    CqError { cqn: u32 },
    /// A QP went to the error state on its own.
    QpFatal { qpn: u32 },
    /// The port became active.
    PortActive,
    /// The port went down (the host's datapath went away).
    PortError,
    /// An SRQ's armed limit was crossed.
    SrqLimit { srqn: u32 },
    /// A QP attached to an SRQ entered the error state.
    LastWqeReached { qpn: u32 },
    /// A kind this driver does not know.
    Unknown { kind: u16, object: u32 },
}

impl From<&Event> for DeviceEvent {
    fn from(e: &Event) -> Self {
        let object = e.object.get();
        match e.kind.get() {
            event_kind::COMPLETION => Self::Completion { cqn: object },
            event_kind::CQ_ERROR => Self::CqError { cqn: object },
            event_kind::QP_FATAL => Self::QpFatal { qpn: object },
            event_kind::PORT_ACTIVE => Self::PortActive,
            event_kind::PORT_ERROR => Self::PortError,
            event_kind::SRQ_LIMIT => Self::SrqLimit { srqn: object },
            event_kind::QP_LAST_WQE_REACHED => Self::LastWqeReached { qpn: object },
            kind => Self::Unknown { kind, object },
        }
    }
}

/// The device's DMA arenas, grown on demand.
#[derive(Debug)]
struct Arenas {
    list: Mutex<Vec<Arc<DmaArena>>>,
    /// Bytes of an arena added when the others are full (at least).
    size: usize,
}

impl Arenas {
    /// Allocates DMA memory, adding an arena (and telling the device about
    /// it) when the existing ones are full.
    fn alloc(
        &self,
        memory: &DeviceMemory,
        transport: &dyn Transport,
        (len, align): (usize, usize),
        zeroed: bool,
    ) -> Result<DmaBuf> {
        let mut arenas = lock(&self.list);
        let try_alloc = |arena: &Arc<DmaArena>| {
            if zeroed {
                arena.alloc_zeroed(len, align)
            } else {
                arena.alloc(len, align)
            }
        };
        if let Some(buf) = arenas.iter().find_map(|a| try_alloc(a).ok()) {
            return Ok(buf);
        }
        let needed = len
            .checked_add(align.max(PAGE_SIZE))
            .and_then(|n| n.checked_next_multiple_of(PAGE_SIZE))
            .ok_or(Error::InvalidArgument("allocation too large"))?;
        let arena = memory.new_arena(transport, memory.arena_size(needed, self.size))?;
        let buf = try_alloc(&arena)?;
        arenas.push(arena);
        Ok(buf)
    }
}

/// The driver's state for one device.
#[derive(Debug)]
pub struct Device {
    transport: Box<dyn Transport>,
    config: DeviceConfig,
    features: u64,
    options: DeviceOptions,
    arenas: Arenas,
    control: Mutex<ControlQueue>,
    /// The doorbell page, given to the device with `SET_DOORBELL`; each QP
    /// rings its bit in it.
    doorbell: Arc<DoorbellPage>,
    /// One event ring per completion vector. The lock also makes one
    /// waiter at a time sleep on the vector's interrupt, so two waiters
    /// never split one wake-up between them.
    events: Vec<Mutex<EventRing>>,
    /// The doorbell and event virtqueues: only their memory matters, they
    /// never carry descriptors.
    _lines: Vec<SplitQueue>,
    /// Arenas and application memory, in the transport's memory model.
    pub(crate) memory: DeviceMemory,
    /// Memory the device may still use because destroying its object
    /// failed: kept until the device goes away rather than reused.
    quarantine: Mutex<Vec<Box<dyn Any + Send>>>,
    /// The CM event queue, when the device advertises one.
    cm: Option<Mutex<CmQueue>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Every guarded state here is consistent between operations.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Largest power of two no greater than `n` (n > 0).
fn pow2_floor(n: u16) -> u16 {
    1 << (15 - n.leading_zeros())
}

/// The config space of the device behind `transport`, checked.
fn read_device_config(transport: &dyn Transport) -> Result<DeviceConfig> {
    let mut raw = [0u8; CONFIG_SIZE];
    transport.read_config(0, &mut raw)?;
    let config =
        DeviceConfig::read_from_bytes(&raw).map_err(|_| Error::Protocol("config space size"))?;
    if config.magic.get() != CONFIG_MAGIC {
        return Err(Error::BadDevice(format!(
            "config magic {:#x}",
            config.magic.get()
        )));
    }
    if config.version_major.get() != SPEC_VERSION_MAJOR {
        return Err(Error::BadDevice(format!(
            "spec version {}.{}, this driver speaks {SPEC_VERSION_MAJOR}.x",
            config.version_major.get(),
            config.version_minor.get()
        )));
    }
    if (config.config_size.get() as usize) < CONFIG_SIZE {
        return Err(Error::BadDevice(format!(
            "config size {} is below {CONFIG_SIZE}",
            config.config_size.get()
        )));
    }
    let vectors = config.num_comp_vectors.get();
    if transport.num_queues() < vrdma_spec::num_queues(vectors) {
        return Err(Error::BadDevice(format!(
            "{} queues for {vectors} completion vectors",
            transport.num_queues()
        )));
    }
    if config.max_queue_size.get() == 0 {
        return Err(Error::BadDevice("maximum queue size 0".into()));
    }
    Ok(config)
}

impl Device {
    /// Brings the device behind `transport` up.
    pub fn open(transport: Box<dyn Transport>, options: DeviceOptions) -> Result<Arc<Self>> {
        // Checked before the device is touched: a bad option is EINVAL.
        let event_ring_args = EventRing::alloc_args(options.event_ring_depth)?;
        transport.set_reconnect_patience(options.reconnect_patience);
        // A driver that comes back to a restarted vdev says so: only then
        // does its device outlive the vdev (device-spec §2).
        let reconnect = match transport.reconnects() {
            true => vrdma_spec::VRDMA_F_RECONNECT,
            false => 0,
        };
        let features = transport
            .negotiate_features(VIRTIO_F_VERSION_1 | VIRTIO_RING_F_EVENT_IDX | reconnect)?;
        if features & VIRTIO_F_VERSION_1 == 0 {
            return Err(Error::BadDevice(
                "it does not offer VIRTIO_F_VERSION_1".into(),
            ));
        }
        let event_idx = features & VIRTIO_RING_F_EVENT_IDX != 0;
        let config = read_device_config(transport.as_ref())?;
        let vectors = config.num_comp_vectors.get();
        let max_queue = config.max_queue_size.get();
        let queue_size = |wanted: u16| pow2_floor(wanted.min(max_queue).max(1));

        let memory = DeviceMemory::new(transport.memory_model())?;
        let arena = memory.new_arena(
            transport.as_ref(),
            memory.arena_size(PAGE_SIZE, options.arena_size),
        )?;

        let setup = |index: u16, vq: &SplitQueue| {
            transport.setup_queue(&QueueSetup {
                index,
                size: vq.size(),
                desc_addr: vq.desc_addr(),
                avail_addr: vq.avail_addr(),
                used_addr: vq.used_addr(),
            })
        };
        // Commands are serialized: 2 descriptors are in use at a time.
        let control_vq = SplitQueue::new(&arena, queue_size(8), event_idx)?;
        setup(CONTROL_QUEUE, &control_vq)?;
        let control = ControlQueue::new(control_vq, &arena)?;
        let mut lines = Vec::with_capacity(usize::from(vectors) + 1);
        for index in DOORBELL_QUEUE..FIRST_EVENT_QUEUE + vectors {
            let vq = SplitQueue::new(&arena, queue_size(LINE_QUEUE_SIZE), event_idx)?;
            setup(index, &vq)?;
            lines.push(vq);
        }

        // The CM event queue, when the device has a connection manager
        // (`cm_queue` right after the event queues); a device that
        // advertises another index, or fewer queues, is used without.
        let cm_index = u16::from(config.device.cm_queue);
        let cm = if cm_index != 0
            && cm_index == vrdma_spec::cm_queue(vectors)
            && transport.num_queues() > cm_index
        {
            let vq = SplitQueue::new(&arena, queue_size(CM_QUEUE_SIZE), event_idx)?;
            setup(cm_index, &vq)?;
            let bufs = (0..vq.size())
                .map(|_| arena.alloc_zeroed(vrdma_spec::cm::CM_EVENT_SIZE, 64))
                .collect::<std::result::Result<Vec<_>, _>>()?;
            let mut queue = CmQueue::new(cm_index, vq, bufs);
            queue.post_all()?;
            Some(Mutex::new(queue))
        } else {
            None
        };

        let arenas = Arenas {
            list: Mutex::new(vec![arena]),
            size: options.arena_size,
        };
        let alloc = |args| arenas.alloc(&memory, transport.as_ref(), args, true);
        let doorbell = Arc::new(DoorbellPage::new(alloc(DoorbellPage::ALLOC_ARGS)?));
        let events = (0..vectors)
            .map(|v| {
                let mem = alloc(event_ring_args)?;
                Ok(Mutex::new(EventRing::new(mem, options.event_ring_depth, v)))
            })
            .collect::<Result<Vec<_>>>()?;
        transport.activate()?;

        let dev = Self {
            transport,
            config,
            features,
            options,
            arenas,
            control: Mutex::new(control),
            doorbell,
            events,
            _lines: lines,
            memory,
            quarantine: Mutex::new(Vec::new()),
            cm,
        };
        dev.give_rings()?;
        tracing::info!(
            name = dev.config.name().unwrap_or("?"),
            vectors,
            event_idx,
            event_ring_depth = dev.options.event_ring_depth,
            "vrdma device is up"
        );
        Ok(Arc::new(dev))
    }

    /// Gives the device its doorbell page and its event rings (after
    /// `DRIVER_OK`, before any QP).
    fn give_rings(&self) -> Result<()> {
        let req = SetDoorbellReq {
            addr: self.doorbell.device_addr().into(),
        };
        self.command_no_reply(Opcode::SetDoorbell, req.as_bytes())?;
        for (vector, ring) in self.events.iter().enumerate() {
            let req = CreateEqReq {
                // Below num_comp_vectors, a u16.
                vector: (vector as u32).into(),
                depth: self.options.event_ring_depth.into(),
                ring_addr: lock(ring).device_addr().into(),
            };
            self.command_no_reply(Opcode::CreateEq, req.as_bytes())?;
        }
        Ok(())
    }

    /// The CM event queue, if the device has a connection manager.
    pub(crate) fn cm(&self) -> Option<&Mutex<CmQueue>> {
        self.cm.as_ref()
    }

    /// The config space read at open.
    pub fn config(&self) -> &DeviceConfig {
        &self.config
    }

    /// The negotiated virtio features.
    pub fn features(&self) -> u64 {
        self.features
    }

    pub(crate) fn transport(&self) -> &dyn Transport {
        self.transport.as_ref()
    }

    /// Allocates DMA memory, adding an arena (and telling the device about
    /// it) when the existing ones are full.
    pub(crate) fn alloc(&self, len: usize, align: usize, zeroed: bool) -> Result<DmaBuf> {
        self.arenas
            .alloc(&self.memory, self.transport.as_ref(), (len, align), zeroed)
    }

    /// Whether `[addr, addr + len)` lies inside a driver arena, and whether
    /// it touches one without lying inside it.
    pub(crate) fn arena_of(&self, addr: u64, len: u64) -> (bool, bool) {
        let arenas = lock(&self.arenas.list);
        let inside = arenas.iter().any(|a| a.contains(addr, len));
        let end = addr.saturating_add(len);
        let touches = arenas
            .iter()
            .any(|a| addr < a.host_addr() + a.size() as u64 && a.host_addr() < end);
        (inside, touches && !inside)
    }

    /// Device address of the driver-memory virtual address `va` (equal in
    /// process mode; translated through the arena so VM mode can differ).
    pub(crate) fn device_addr_of(&self, va: u64) -> u64 {
        lock(&self.arenas.list)
            .iter()
            .find(|a| a.contains(va, 1))
            .map_or(va, |a| a.device_addr() + (va - a.host_addr()))
    }

    /// Keeps `object` alive until the device goes away.
    pub(crate) fn quarantine<T: Any + Send>(&self, object: T) {
        lock(&self.quarantine).push(Box::new(object));
    }

    /// The doorbell page (a new QP rings its bit there).
    pub(crate) fn doorbell_page(&self) -> Arc<DoorbellPage> {
        Arc::clone(&self.doorbell)
    }

    /// Kicks the doorbell queue: a QP rang and the device asked to be
    /// woken (it was about to sleep).
    pub(crate) fn kick_doorbell(&self) {
        // The work is published either way: a failed kick only delays it
        // until the device polls again, so the post still succeeded.
        if let Err(e) = self.transport.notify(DOORBELL_QUEUE) {
            tracing::error!(error = %e, "Cannot kick the doorbell queue");
        }
    }

    /// Runs one control command: `request` is the request payload (exactly
    /// the request structure, or nothing); the response payload is returned
    /// as a `Resp`.
    pub(crate) fn command<Resp>(&self, opcode: Opcode, request: &[u8]) -> Result<Resp>
    where
        Resp: FromBytes + IntoBytes + Immutable + KnownLayout,
    {
        let mut out = Resp::new_zeroed();
        self.command_raw(opcode, request, out.as_mut_bytes())?;
        Ok(out)
    }

    /// A command whose response has no payload.
    pub(crate) fn command_no_reply(&self, opcode: Opcode, request: &[u8]) -> Result<()> {
        self.command_raw(opcode, request, &mut [])
    }

    fn command_raw(&self, opcode: Opcode, request: &[u8], response: &mut [u8]) -> Result<()> {
        lock(&self.control).run(
            self.transport.as_ref(),
            &self.options,
            opcode,
            request,
            response,
        )
    }

    /// Number of event rings (completion vectors).
    pub(crate) fn num_event_queues(&self) -> usize {
        self.events.len()
    }

    /// Next event of completion vector `vector`, waiting up to `timeout`
    /// (`Some(ZERO)`: just poll; `None`: forever).
    pub(crate) fn next_event(
        &self,
        vector: u16,
        timeout: Option<Duration>,
    ) -> Result<Option<DeviceEvent>> {
        let ring = self
            .events
            .get(usize::from(vector))
            .ok_or(Error::InvalidArgument("no such completion vector"))?;
        let mut ring = lock(ring);
        let deadline = timeout.map(|t| Instant::now() + t);
        loop {
            if let Some(event) = ring.pop()? {
                return Ok(Some(DeviceEvent::from(&event)));
            }
            let left = match deadline {
                Some(d) => {
                    let left = d.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return Ok(None);
                    }
                    Some(left)
                }
                None => None,
            };
            // `wait` clears the interrupt before it returns and the ring is
            // read again after it: an event written after that read raises
            // a new interrupt, which the next wait sees. A wake-up with
            // nothing new (one INTx line serves every queue) only loops.
            self.transport.wait(FIRST_EVENT_QUEUE + vector, left)?;
        }
    }

    /// The interrupt fd of completion vector `vector`.
    pub(crate) fn event_fd(&self, vector: u16) -> Option<std::os::fd::BorrowedFd<'_>> {
        (usize::from(vector) < self.events.len())
            .then(|| self.transport.interrupt_fd(FIRST_EVENT_QUEUE + vector))
            .flatten()
    }

    /// Clears the interrupt [`Device::event_fd`] of `vector` reported; read
    /// the events after this, so that none written before is missed.
    pub(crate) fn acknowledge_event(&self, vector: u16) -> Result<(), Error> {
        if usize::from(vector) >= self.events.len() {
            return Err(Error::InvalidArgument("no such completion vector"));
        }
        Ok(self.transport.acknowledge(FIRST_EVENT_QUEUE + vector)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{config, event, options, readable, Reply, StubTransport, FEATURES};
    use vrdma_spec::ring::{
        DEVICE_FLAGS_OFFSET, DEVICE_FLAG_ERROR, DEVICE_INDEX_OFFSET, DRIVER_INDEX_OFFSET,
        EVENT_SIZE, RING_HEADER_SIZE,
    };

    fn open_err(config: &DeviceConfig, features: u64) -> Error {
        let stub = StubTransport::with_config(config, features);
        Device::open(Box::new(stub), options()).unwrap_err()
    }

    #[test]
    fn open_refuses_devices_it_does_not_know() {
        let good = config(1, 64);
        let mut bad_magic = good;
        bad_magic.magic = 0x1234.into();
        assert!(
            matches!(open_err(&bad_magic, FEATURES), Error::BadDevice(m) if m.contains("magic"))
        );
        let mut newer = good;
        newer.version_major = (SPEC_VERSION_MAJOR + 1).into();
        let err = open_err(&newer, FEATURES);
        assert!(
            matches!(&err, Error::BadDevice(m) if m.contains("version")),
            "{err}"
        );
        assert_eq!(err.errno(), libc::ENODEV);
        let mut short = good;
        short.config_size = 16.into();
        assert!(matches!(open_err(&short, FEATURES), Error::BadDevice(_)));
        let mut no_queues = good;
        no_queues.max_queue_size = 0.into();
        assert!(matches!(
            open_err(&no_queues, FEATURES),
            Error::BadDevice(_)
        ));
        assert!(matches!(
            open_err(&good, VIRTIO_RING_F_EVENT_IDX),
            Error::BadDevice(_)
        ));
        let mut stub = StubTransport::with_config(&good, FEATURES);
        stub.queues = 2;
        let err = Device::open(Box::new(stub), options()).unwrap_err();
        assert!(matches!(err, Error::BadDevice(m) if m.contains("queues")));
    }

    #[test]
    fn open_sets_up_every_queue_in_the_first_arena() {
        let stub = Arc::new(StubTransport::with_config(&config(2, 32), FEATURES));
        let dev = Device::open(Box::new(Arc::clone(&stub)), options()).unwrap();
        assert_eq!(dev.features(), FEATURES);
        assert_eq!(dev.config().name(), Some("vrdma"));
        let added = stub.added.lock().unwrap().clone();
        assert_eq!(added.len(), 1);
        let (base, size) = added[0];
        assert_eq!(size, 1 << 20);
        let setups = stub.setups.lock().unwrap().clone();
        let shape: Vec<(u16, u16)> = setups.iter().map(|q| (q.index, q.size)).collect();
        // Only the control queue carries descriptors.
        assert_eq!(shape, vec![(0, 8), (1, 2), (2, 2), (3, 2)]);
        for q in &setups {
            for addr in [q.desc_addr, q.avail_addr, q.used_addr] {
                assert!(
                    addr >= base && addr < base + size,
                    "{q:?} outside the arena"
                );
            }
            assert_eq!(q.desc_addr % 16, 0);
            assert_eq!(q.used_addr % 4, 0);
        }
        // Only commands were notified: no buffers on the event queues.
        assert!(stub
            .notified
            .lock()
            .unwrap()
            .iter()
            .all(|&q| q == CONTROL_QUEUE));
        assert_eq!(dev.num_event_queues(), 2);
        // Nothing arrives from a device that wrote nothing.
        assert_eq!(dev.next_event(1, Some(Duration::ZERO)).unwrap(), None);
        assert!(dev.next_event(2, Some(Duration::ZERO)).is_err());
    }

    #[test]
    fn open_gives_the_device_its_doorbell_page_and_one_event_ring_per_vector() {
        let stub = Arc::new(StubTransport::with_config(&config(3, 32), FEATURES));
        let mut opts = options();
        opts.event_ring_depth = 64;
        let _dev = Device::open(Box::new(Arc::clone(&stub)), opts).unwrap();
        let commands: Vec<Opcode> = stub.commands.lock().unwrap().iter().map(|c| c.0).collect();
        assert_eq!(
            commands,
            [
                Opcode::SetDoorbell,
                Opcode::CreateEq,
                Opcode::CreateEq,
                Opcode::CreateEq
            ]
        );
        let (base, size) = stub.added.lock().unwrap()[0];
        let page = stub.requests::<SetDoorbellReq>(Opcode::SetDoorbell)[0]
            .addr
            .get();
        assert_eq!(page % 4096, 0);
        assert!(page >= base && page + 4096 <= base + size);
        let mut zeroes = vec![1u8; 4096];
        stub.read(page, &mut zeroes);
        assert!(zeroes.iter().all(|&b| b == 0), "a zeroed page");
        let eqs = stub.requests::<CreateEqReq>(Opcode::CreateEq);
        let bytes = vrdma_spec::ring::event_ring_bytes(64);
        let mut ranges = vec![(page, page + 4096)];
        for (v, eq) in eqs.iter().enumerate() {
            assert_eq!(eq.vector.get(), v as u32);
            assert_eq!(eq.depth.get(), 64);
            let addr = eq.ring_addr.get();
            assert_eq!(addr % 4096, 0);
            assert!(addr >= base && addr + bytes <= base + size);
            ranges.push((addr, addr + bytes));
        }
        ranges.sort();
        assert!(
            ranges.windows(2).all(|w| w[0].1 <= w[1].0),
            "disjoint: {ranges:?}"
        );
    }

    #[test]
    fn open_fails_with_the_device_errno_or_on_a_bad_depth() {
        let refusing =
            StubTransport::with_config(&config(1, 32), FEATURES).answering_all(|op, _| match op {
                Opcode::SetDoorbell => Reply::Errno(libc::EEXIST as u32),
                _ => Reply::Ok(Vec::new()),
            });
        let err = Device::open(Box::new(refusing), options()).unwrap_err();
        assert_eq!(err.errno(), libc::EEXIST);
        let refusing = StubTransport::with_config(&config(2, 32), FEATURES).answering_all(
            |op, req| match op {
                Opcode::CreateEq
                    if CreateEqReq::read_from_bytes(req).unwrap().vector.get() == 1 =>
                {
                    Reply::Errno(libc::ENOMEM as u32)
                }
                _ => Reply::Ok(Vec::new()),
            },
        );
        let err = Device::open(Box::new(refusing), options()).unwrap_err();
        assert_eq!(err.errno(), libc::ENOMEM);
        let mut opts = options();
        opts.event_ring_depth = 1000;
        let stub = Arc::new(StubTransport::with_config(&config(1, 32), FEATURES));
        let err = Device::open(Box::new(Arc::clone(&stub)), opts).unwrap_err();
        assert_eq!(err.errno(), libc::EINVAL);
        assert!(
            stub.setups.lock().unwrap().is_empty(),
            "refused before touching the device"
        );
    }

    #[test]
    fn allocations_grow_the_device_memory() {
        let stub = Arc::new(StubTransport::with_config(&config(1, 64), FEATURES));
        let dev = Device::open(Box::new(Arc::clone(&stub)), options()).unwrap();
        let big = dev.alloc(3 << 20, PAGE_SIZE, true).unwrap();
        let added = stub.added.lock().unwrap().clone();
        assert_eq!(added.len(), 2);
        assert!(added[1].1 >= 3 << 20);
        assert!(big.device_addr() >= added[1].0);
        assert_eq!(dev.device_addr_of(big.as_ptr() as u64), big.device_addr());
        let (inside, straddles) = dev.arena_of(big.as_ptr() as u64, 3 << 20);
        assert!(inside && !straddles);
    }

    /// The device side of completion vector 1's event ring, at `ring` (of
    /// `depth`): writes events as the device does, through its own mapping
    /// of guest memory.
    struct EventRingDevice {
        stub: Arc<StubTransport>,
        ring: u64,
        depth: u32,
        producer: u32,
    }

    impl EventRingDevice {
        fn write(&mut self, events: &[Event]) {
            for e in events {
                let slot = u64::from(self.producer & (self.depth - 1));
                self.stub.write(
                    self.ring + RING_HEADER_SIZE as u64 + slot * EVENT_SIZE as u64,
                    e.as_bytes(),
                );
                self.producer = self.producer.wrapping_add(1);
            }
            self.stub
                .store_u32(self.ring + DEVICE_INDEX_OFFSET, self.producer);
        }

        /// Writes `e` and raises the vector's interrupt.
        fn signal(&mut self, e: Event) {
            self.write(&[e]);
            self.stub.interrupt(FIRST_EVENT_QUEUE + 1);
        }
    }

    #[test]
    fn events_come_from_the_vector_ring_and_its_interrupt() {
        let stub = Arc::new(StubTransport::with_config(&config(2, 32), FEATURES));
        let depth = 4;
        let mut opts = options();
        opts.event_ring_depth = depth;
        let dev = Device::open(Box::new(Arc::clone(&stub)), opts).unwrap();
        let ring = stub.requests::<CreateEqReq>(Opcode::CreateEq)[1]
            .ring_addr
            .get();
        let mut device = EventRingDevice {
            stub: Arc::clone(&stub),
            ring,
            depth,
            producer: 0,
        };

        // Read in order, and only from their own vector; across wraps.
        for round in 0..3 {
            let batch = [
                event(event_kind::COMPLETION, 7 + round),
                event(event_kind::QP_FATAL, 9),
                event(event_kind::CQ_ERROR, 7),
            ];
            device.write(&batch);
            assert_eq!(dev.next_event(0, Some(Duration::ZERO)).unwrap(), None);
            let got: Vec<_> = (0..3)
                .map(|_| dev.next_event(1, Some(Duration::ZERO)).unwrap())
                .collect();
            assert_eq!(
                got,
                [
                    Some(DeviceEvent::Completion { cqn: 7 + round }),
                    Some(DeviceEvent::QpFatal { qpn: 9 }),
                    Some(DeviceEvent::CqError { cqn: 7 })
                ]
            );
            assert_eq!(dev.next_event(1, Some(Duration::ZERO)).unwrap(), None);
        }
        let mut index = [0u8; 4];
        stub.read(ring + DRIVER_INDEX_OFFSET, &mut index);
        assert_eq!(u32::from_le_bytes(index), 9, "every slot handed back");

        // A waiter sleeps on the interrupt and wakes for an event written
        // while it slept.
        let writer = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            device.signal(event(event_kind::PORT_ACTIVE, 0));
            device
        });
        let start = Instant::now();
        let got = dev.next_event(1, Some(Duration::from_secs(10))).unwrap();
        assert_eq!(got, Some(DeviceEvent::PortActive));
        assert!(start.elapsed() < Duration::from_secs(5));
        let mut device = writer.join().unwrap();

        // An interrupt without an event (another queue's, on a shared
        // line) only makes the waiter look again.
        stub.interrupt(FIRST_EVENT_QUEUE + 1);
        let start = Instant::now();
        assert_eq!(
            dev.next_event(1, Some(Duration::from_millis(40))).unwrap(),
            None
        );
        assert!(start.elapsed() >= Duration::from_millis(40));

        // The interrupt fd for poll loops: readable after an interrupt,
        // cleared by acknowledge_event.
        let fd = dev.event_fd(1).unwrap();
        assert!(!readable(fd));
        device.signal(event(event_kind::COMPLETION, 1));
        assert!(readable(fd));
        dev.acknowledge_event(1).unwrap();
        assert!(!readable(fd));
        assert_eq!(
            dev.next_event(1, Some(Duration::ZERO)).unwrap(),
            Some(DeviceEvent::Completion { cqn: 1 })
        );

        // An overflowed ring is reported (a warning) and still read.
        stub.store_u32(ring + DEVICE_FLAGS_OFFSET, DEVICE_FLAG_ERROR);
        device.write(&[event(event_kind::COMPLETION, 2)]);
        assert_eq!(
            dev.next_event(1, Some(Duration::ZERO)).unwrap(),
            Some(DeviceEvent::Completion { cqn: 2 })
        );
        assert!(lock(&dev.events[1]).overflowed());
        assert!(!lock(&dev.events[0]).overflowed());
    }

    #[test]
    fn pow2_floor_rounds_down() {
        for (n, floor) in [(1, 1), (3, 2), (64, 64), (100, 64), (u16::MAX, 32768)] {
            assert_eq!(pow2_floor(n), floor, "pow2_floor({n})");
        }
    }

    #[test]
    fn events_decode() {
        let e = |kind: u16, object: u32| Event {
            kind: kind.into(),
            object: object.into(),
            ..Default::default()
        };
        assert_eq!(
            DeviceEvent::from(&e(event_kind::COMPLETION, 7)),
            DeviceEvent::Completion { cqn: 7 }
        );
        assert_eq!(
            DeviceEvent::from(&e(event_kind::QP_FATAL, 3)),
            DeviceEvent::QpFatal { qpn: 3 }
        );
        assert_eq!(
            DeviceEvent::from(&e(event_kind::PORT_ACTIVE, 0)),
            DeviceEvent::PortActive
        );
        assert_eq!(
            DeviceEvent::from(&e(event_kind::PORT_ERROR, 1)),
            DeviceEvent::PortError
        );
        assert_eq!(
            DeviceEvent::from(&e(event_kind::SRQ_LIMIT, 4)),
            DeviceEvent::SrqLimit { srqn: 4 }
        );
        assert_eq!(
            DeviceEvent::from(&e(event_kind::QP_LAST_WQE_REACHED, 5)),
            DeviceEvent::LastWqeReached { qpn: 5 }
        );
        assert_eq!(
            DeviceEvent::from(&e(99, 1)),
            DeviceEvent::Unknown {
                kind: 99,
                object: 1
            }
        );
    }
}
