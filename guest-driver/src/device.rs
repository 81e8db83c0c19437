//! The driver core: bringing a vrdma device up and talking to it.
//!
//! [`Device::open`] negotiates features, checks the config space, gives the
//! device its first DMA arena and sets up the virtqueues: the control queue,
//! the doorbell queue (notifications only) and one event queue per
//! completion vector, pre-filled with 16-byte buffers for
//! [`vrdma_spec::ring::Event`]s. It then serves the verbs layer: control
//! commands ([`Device::command`]), DMA allocations that grow the device's
//! memory on demand, doorbells, events, and application memory sharing.

use std::any::Any;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use vrdma_spec::config::{DeviceConfig, CONFIG_MAGIC, CONFIG_SIZE};
use vrdma_spec::control::{Opcode, RequestHeader, ResponseHeader};
use vrdma_spec::ring::{event_kind, Event};
use vrdma_spec::{
    CONTROL_QUEUE, DOORBELL_QUEUE, FIRST_EVENT_QUEUE, MAX_CONTROL_MSG, SPEC_VERSION_MAJOR,
};
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout};

use crate::dma::{DmaArena, DmaBuf, DEFAULT_ARENA_SIZE, PAGE_SIZE};
use crate::error::{Error, Result};
use crate::memory::DeviceMemory;
use crate::transport::{QueueSetup, Transport, VIRTIO_F_VERSION_1, VIRTIO_RING_F_EVENT_IDX};
use crate::virtqueue::SplitQueue;

/// Size of one event buffer: one [`Event`].
const EVENT_SIZE: usize = core::mem::size_of::<Event>();

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
    /// Entries of each event queue.
    pub event_queue_size: u16,
}

impl Default for DeviceOptions {
    fn default() -> Self {
        Self {
            arena_size: DEFAULT_ARENA_SIZE,
            control_timeout: Duration::from_secs(10),
            spin: Duration::from_micros(20),
            event_queue_size: 64,
        }
    }
}

/// An asynchronous event the device reported on an event queue.
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
            kind => Self::Unknown { kind, object },
        }
    }
}

/// The control queue with its request and response buffers.
#[derive(Debug)]
struct Control {
    vq: SplitQueue,
    request: DmaBuf,
    response: DmaBuf,
    /// Set when a command's buffers may still be in the device's hands.
    broken: bool,
}

/// One event queue and the buffers posted on it.
#[derive(Debug)]
struct EventQueue {
    index: u16,
    vq: SplitQueue,
    buffers: DmaBuf,
    /// Buffer (event slot) each outstanding head refers to.
    slot_of_head: Vec<Option<usize>>,
}

impl EventQueue {
    fn post(&mut self, slot: usize) -> Result<()> {
        let addr = self.buffers.device_addr() + (slot * EVENT_SIZE) as u64;
        let head = self.vq.add_chain(&[], &[(addr, EVENT_SIZE as u32)])?;
        self.slot_of_head[usize::from(head)] = Some(slot);
        Ok(())
    }
}

/// The driver's state for one device.
#[derive(Debug)]
pub struct Device {
    transport: Box<dyn Transport>,
    config: DeviceConfig,
    features: u64,
    options: DeviceOptions,
    arenas: Mutex<Vec<Arc<DmaArena>>>,
    control: Mutex<Control>,
    events: Vec<Mutex<EventQueue>>,
    /// The doorbell queue: only its memory matters, it is never used.
    _doorbell: SplitQueue,
    /// Arenas and application memory, in the transport's memory model.
    pub(crate) memory: DeviceMemory,
    /// Memory the device may still use because destroying its object
    /// failed: kept until the device goes away rather than reused.
    quarantine: Mutex<Vec<Box<dyn Any + Send>>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Every guarded state here is consistent between operations.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Largest power of two no greater than `n` (n > 0).
fn pow2_floor(n: u16) -> u16 {
    1 << (15 - n.leading_zeros())
}

impl Device {
    /// Brings the device behind `transport` up.
    pub fn open(transport: Box<dyn Transport>, options: DeviceOptions) -> Result<Arc<Self>> {
        let features =
            transport.negotiate_features(VIRTIO_F_VERSION_1 | VIRTIO_RING_F_EVENT_IDX)?;
        if features & VIRTIO_F_VERSION_1 == 0 {
            return Err(Error::BadDevice(
                "it does not offer VIRTIO_F_VERSION_1".into(),
            ));
        }
        let event_idx = features & VIRTIO_RING_F_EVENT_IDX != 0;

        let mut raw = [0u8; CONFIG_SIZE];
        transport.read_config(0, &mut raw)?;
        let config = DeviceConfig::read_from_bytes(&raw)
            .map_err(|_| Error::Protocol("config space size"))?;
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
        let needed = vrdma_spec::num_queues(vectors);
        if transport.num_queues() < needed {
            return Err(Error::BadDevice(format!(
                "{} queues for {vectors} completion vectors",
                transport.num_queues()
            )));
        }
        let max_queue = config.max_queue_size.get();
        if max_queue == 0 {
            return Err(Error::BadDevice("maximum queue size 0".into()));
        }
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
        let control = Control {
            vq: control_vq,
            request: arena.alloc_zeroed(MAX_CONTROL_MSG, 64)?,
            response: arena.alloc_zeroed(MAX_CONTROL_MSG, 64)?,
            broken: false,
        };
        // The doorbell queue never carries descriptors, but a backend only
        // starts watching a queue's kicks once it is fully set up.
        let doorbell = SplitQueue::new(&arena, queue_size(2), event_idx)?;
        setup(DOORBELL_QUEUE, &doorbell)?;

        let mut events = Vec::with_capacity(usize::from(vectors));
        for vector in 0..vectors {
            let index = FIRST_EVENT_QUEUE + vector;
            let vq = SplitQueue::new(&arena, queue_size(options.event_queue_size), event_idx)?;
            setup(index, &vq)?;
            let n = usize::from(vq.size());
            let mut eq = EventQueue {
                index,
                buffers: arena.alloc_zeroed(n * EVENT_SIZE, 64)?,
                slot_of_head: vec![None; n],
                vq,
            };
            for slot in 0..n {
                eq.post(slot)?;
            }
            events.push(Mutex::new(eq));
        }
        transport.activate()?;
        for eq in &mut events {
            let eq = eq.get_mut().unwrap_or_else(|e| e.into_inner());
            if eq.vq.should_notify() {
                transport.notify(eq.index)?;
            }
        }
        tracing::info!(
            name = config.name().unwrap_or("?"),
            vectors,
            event_idx,
            "vrdma device is up"
        );
        Ok(Arc::new(Self {
            transport,
            config,
            features,
            options,
            arenas: Mutex::new(vec![arena]),
            control: Mutex::new(control),
            events,
            _doorbell: doorbell,
            memory,
            quarantine: Mutex::new(Vec::new()),
        }))
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
        let mut arenas = lock(&self.arenas);
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
        let size = self.memory.arena_size(needed, self.options.arena_size);
        let arena = self.memory.new_arena(self.transport.as_ref(), size)?;
        let buf = try_alloc(&arena)?;
        arenas.push(arena);
        Ok(buf)
    }

    /// Whether `[addr, addr + len)` lies inside a driver arena, and whether
    /// it touches one without lying inside it.
    pub(crate) fn arena_of(&self, addr: u64, len: u64) -> (bool, bool) {
        let arenas = lock(&self.arenas);
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
        lock(&self.arenas)
            .iter()
            .find(|a| a.contains(va, 1))
            .map_or(va, |a| a.device_addr() + (va - a.host_addr()))
    }

    /// Keeps `object` alive until the device goes away.
    pub(crate) fn quarantine<T: Any + Send>(&self, object: T) {
        lock(&self.quarantine).push(Box::new(object));
    }

    /// Rings the doorbell queue.
    pub(crate) fn ring_doorbell(&self) {
        if let Err(e) = self.transport.notify(DOORBELL_QUEUE) {
            tracing::error!(error = %e, "Cannot ring the doorbell");
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
        let req_len = core::mem::size_of::<RequestHeader>() + request.len();
        let resp_len = core::mem::size_of::<ResponseHeader>() + response.len();
        if req_len > MAX_CONTROL_MSG || resp_len > MAX_CONTROL_MSG {
            return Err(Error::InvalidArgument("control message too large"));
        }
        let mut control = lock(&self.control);
        if control.broken {
            return Err(Error::ControlBroken);
        }
        let header = RequestHeader {
            opcode: u16::from(opcode).into(),
            flags: 0.into(),
            // Bounded by MAX_CONTROL_MSG above.
            payload_len: (request.len() as u32).into(),
        };
        control.request.write_at(0, header.as_bytes());
        control.request.write_at(header.as_bytes().len(), request);
        // A stale header must not pass for this command's answer.
        control
            .response
            .write_at(0, ResponseHeader::default().as_bytes());
        let chain = (
            (control.request.device_addr(), req_len as u32),
            (control.response.device_addr(), resp_len as u32),
        );
        let head = control.vq.add_chain(&[chain.0], &[chain.1])?;
        let notify = control.vq.should_notify();
        let result = if notify {
            self.transport.notify(CONTROL_QUEUE).map_err(Error::from)
        } else {
            Ok(())
        }
        .and_then(|()| self.wait_used(&mut control.vq, CONTROL_QUEUE));
        let (used_head, used_len) = match result {
            Ok(used) => used,
            Err(e) => {
                // The device may still write the buffers: never reuse them.
                control.broken = true;
                return Err(e);
            }
        };
        if used_head != head {
            control.broken = true;
            return Err(Error::Protocol("control queue returned another chain"));
        }
        let header_len = core::mem::size_of::<ResponseHeader>();
        if (used_len as usize) < header_len {
            return Err(Error::Protocol("control response shorter than its header"));
        }
        let mut raw = [0u8; core::mem::size_of::<ResponseHeader>()];
        control.response.read_at(0, &mut raw);
        let header = ResponseHeader::read_from_bytes(&raw)
            .map_err(|_| Error::Protocol("control response header"))?;
        let status = header.status.get();
        if status != 0 {
            tracing::debug!(?opcode, status, "Device refused a control command");
            return Err(match i32::try_from(status) {
                Ok(errno) if errno < 4096 => Error::Device(errno),
                _ => Error::Protocol("control status is not an errno"),
            });
        }
        if (header.payload_len.get() as usize) < response.len()
            || (used_len as usize) < header_len + response.len()
        {
            return Err(Error::Protocol("control response payload too short"));
        }
        control.response.read_at(header_len, response);
        Ok(())
    }

    /// Waits for the next used entry of `vq`: spin briefly, then sleep on the
    /// queue's interrupt (up to the control timeout).
    fn wait_used(&self, vq: &mut SplitQueue, queue: u16) -> Result<(u16, u32)> {
        let start = Instant::now();
        loop {
            if let Some(used) = vq.pop_used()? {
                return Ok(used);
            }
            if start.elapsed() >= self.options.spin {
                break;
            }
            std::hint::spin_loop();
        }
        let deadline = start + self.options.control_timeout;
        loop {
            if !vq.enable_interrupts() {
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Err(Error::Timeout(self.options.control_timeout));
                }
                self.transport.wait(queue, Some(left))?;
            }
            if let Some(used) = vq.pop_used()? {
                return Ok(used);
            }
        }
    }

    /// Number of event queues (completion vectors).
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
        let eq = self
            .events
            .get(usize::from(vector))
            .ok_or(Error::InvalidArgument("no such completion vector"))?;
        let mut eq = lock(eq);
        let deadline = timeout.map(|t| Instant::now() + t);
        loop {
            if let Some((head, len)) = eq.vq.pop_used()? {
                let slot = eq.slot_of_head[usize::from(head)]
                    .take()
                    .ok_or(Error::Protocol("event queue returned an unknown buffer"))?;
                let mut raw = [0u8; EVENT_SIZE];
                eq.buffers.read_at(slot * EVENT_SIZE, &mut raw);
                eq.post(slot)?;
                if eq.vq.should_notify() {
                    self.transport.notify(eq.index)?;
                }
                if len as usize != EVENT_SIZE {
                    tracing::warn!(len, "Event of unexpected length dropped");
                    continue;
                }
                let event =
                    Event::read_from_bytes(&raw).map_err(|_| Error::Protocol("event size"))?;
                return Ok(Some(DeviceEvent::from(&event)));
            }
            if eq.vq.enable_interrupts() {
                continue;
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
            self.transport.wait(eq.index, left)?;
        }
    }

    /// The interrupt fd of completion vector `vector`'s event queue.
    pub(crate) fn event_fd(&self, vector: u16) -> Option<std::os::fd::BorrowedFd<'_>> {
        (usize::from(vector) < self.events.len())
            .then(|| self.transport.interrupt_fd(FIRST_EVENT_QUEUE + vector))
            .flatten()
    }

    /// Clears the interrupt [`Device::event_fd`] of `vector` reported.
    pub(crate) fn acknowledge_event(&self, vector: u16) -> Result<(), Error> {
        if usize::from(vector) >= self.events.len() {
            return Err(Error::Protocol("no such completion vector"));
        }
        Ok(self.transport.acknowledge(FIRST_EVENT_QUEUE + vector)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{config, StubTransport};

    const FEATURES: u64 = VIRTIO_F_VERSION_1 | VIRTIO_RING_F_EVENT_IDX;

    fn options() -> DeviceOptions {
        DeviceOptions {
            arena_size: 1 << 20,
            control_timeout: Duration::from_millis(30),
            ..Default::default()
        }
    }

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
        assert_eq!(shape, vec![(0, 8), (1, 2), (2, 32), (3, 32)]);
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
        // Event queues were filled and kicked.
        assert_eq!(*stub.notified.lock().unwrap(), vec![2, 3]);
        assert_eq!(dev.num_event_queues(), 2);
        // Nothing arrives from a device that does not answer.
        assert_eq!(dev.next_event(1, Some(Duration::ZERO)).unwrap(), None);
        assert!(dev.next_event(2, Some(Duration::ZERO)).is_err());
    }

    #[test]
    fn unanswered_command_times_out_and_breaks_the_control_queue() {
        let stub = Arc::new(StubTransport::with_config(&config(1, 64), FEATURES));
        let dev = Device::open(Box::new(Arc::clone(&stub)), options()).unwrap();
        let err = dev.command_no_reply(Opcode::AllocPd, &[]).unwrap_err();
        assert!(matches!(err, Error::Timeout(_)), "{err}");
        assert_eq!(err.errno(), libc::ETIMEDOUT);
        assert!(stub.notified.lock().unwrap().contains(&CONTROL_QUEUE));
        // The buffers may still be the device's: no further command is sent.
        let err = dev.command_no_reply(Opcode::AllocPd, &[]).unwrap_err();
        assert!(matches!(err, Error::ControlBroken));
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

    #[test]
    fn command_chain_carries_header_request_and_response_room() {
        use virtio_queue::{Queue, QueueT};
        use vm_memory::{Bytes, FileOffset, GuestAddress, GuestMemoryMmap};
        use vrdma_spec::config::PortAttr;
        use vrdma_spec::control::QueryPortReq;

        let stub = Arc::new(StubTransport::with_config(&config(1, 64), FEATURES));
        let dev = Device::open(Box::new(Arc::clone(&stub)), options()).unwrap();
        let req = QueryPortReq {
            port_num: 1,
            ..Default::default()
        };
        let err = dev
            .command::<PortAttr>(Opcode::QueryPort, req.as_bytes())
            .unwrap_err();
        assert!(matches!(err, Error::Timeout(_)));

        // Inspect (not answer) the chain the way the device will read it.
        let arena = Arc::clone(&lock(&dev.arenas)[0]);
        let mem = GuestMemoryMmap::<()>::from_ranges_with_files(&[(
            GuestAddress(arena.device_addr()),
            arena.size(),
            Some(FileOffset::new(
                arena.file().expect("memfd arena").try_clone().unwrap(),
                0,
            )),
        )])
        .unwrap();
        let setup = stub.setups.lock().unwrap()[0];
        let mut q = Queue::new(setup.size).unwrap();
        q.set_size(setup.size);
        q.set_desc_table_address(
            Some(setup.desc_addr as u32),
            Some((setup.desc_addr >> 32) as u32),
        );
        q.set_avail_ring_address(
            Some(setup.avail_addr as u32),
            Some((setup.avail_addr >> 32) as u32),
        );
        q.set_used_ring_address(
            Some(setup.used_addr as u32),
            Some((setup.used_addr >> 32) as u32),
        );
        q.set_event_idx(true);
        q.set_ready(true);
        let chain = q.pop_descriptor_chain(&mem).expect("the command");
        let descs: Vec<_> = chain.collect();
        assert_eq!(descs.len(), 2);
        assert!(!descs[0].is_write_only());
        assert_eq!(descs[0].len(), 8 + 8);
        let mut bytes = [0u8; 16];
        mem.read_slice(&mut bytes, descs[0].addr()).unwrap();
        let header = RequestHeader::read_from_bytes(&bytes[..8]).unwrap();
        assert_eq!(header.opcode.get(), u16::from(Opcode::QueryPort));
        assert_eq!(header.flags.get(), 0);
        assert_eq!(header.payload_len.get(), 8);
        assert_eq!(&bytes[8..], req.as_bytes());
        assert!(descs[1].is_write_only());
        assert_eq!(
            descs[1].len() as usize,
            8 + core::mem::size_of::<PortAttr>()
        );
    }

    #[test]
    fn pow2_floor_rounds_down() {
        assert_eq!(pow2_floor(1), 1);
        assert_eq!(pow2_floor(3), 2);
        assert_eq!(pow2_floor(64), 64);
        assert_eq!(pow2_floor(100), 64);
        assert_eq!(pow2_floor(u16::MAX), 32768);
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
            DeviceEvent::from(&e(99, 1)),
            DeviceEvent::Unknown {
                kind: 99,
                object: 1
            }
        );
    }
}
