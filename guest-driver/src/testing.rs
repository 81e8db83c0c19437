//! A transport for unit tests that plays a minimal device: it records what
//! the driver asks of the transport, answers control commands through a
//! handler the test chooses (by default only `SET_DOORBELL` and
//! `CREATE_EQ`; everything else stays unanswered), maps the memory the
//! driver shares the way vdev does (memfds, by device address), and has a
//! real eventfd per queue as its interrupts.

use std::fs::File;
use std::os::fd::{AsRawFd, BorrowedFd};
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use virtio_queue::{Queue, QueueT};
use vm_memory::{Bytes, FileOffset, GuestAddress, GuestMemoryMmap};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};
use vrdma_spec::config::{DeviceConfig, CONFIG_MAGIC, CONFIG_SIZE};
use vrdma_spec::control::{Opcode, RequestHeader, ResponseHeader};
use vrdma_spec::ring::Event;
use vrdma_spec::CONTROL_QUEUE;
use zerocopy::{FromBytes, FromZeros, IntoBytes};

use crate::device::DeviceOptions;
use crate::dma::DmaRegion;
use crate::transport::{
    QueueSetup, Transport, TransportError, VIRTIO_F_VERSION_1, VIRTIO_RING_F_EVENT_IDX,
};

/// The test binary's allocator: the system's, counting the allocations of
/// each thread, so a test can show a path allocates nothing.
struct CountingAlloc;

thread_local! {
    static ALLOCATIONS: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

// SAFETY: every call is forwarded to the system allocator unchanged; the
// count is a const-initialized thread-local without a destructor, which
// neither allocates nor can be gone while this thread allocates.
unsafe impl std::alloc::GlobalAlloc for CountingAlloc {
    unsafe fn alloc(&self, layout: std::alloc::Layout) -> *mut u8 {
        let _ = ALLOCATIONS.try_with(|n| n.set(n.get() + 1));
        // SAFETY: forwarded with the caller's layout.
        unsafe { std::alloc::System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: std::alloc::Layout) {
        // SAFETY: `ptr` came from `alloc` above, i.e. from System.
        unsafe { std::alloc::System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: std::alloc::Layout, new: usize) -> *mut u8 {
        let _ = ALLOCATIONS.try_with(|n| n.set(n.get() + 1));
        // SAFETY: forwarded; `ptr` came from System.
        unsafe { std::alloc::System.realloc(ptr, layout, new) }
    }
}

#[global_allocator]
static ALLOCATOR: CountingAlloc = CountingAlloc;

/// How many heap allocations this thread made while running `f`.
pub(crate) fn allocations_in(f: impl FnOnce()) -> u64 {
    let before = ALLOCATIONS.with(std::cell::Cell::get);
    f();
    ALLOCATIONS.with(std::cell::Cell::get) - before
}

/// What the stub device answers to a command.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Reply {
    /// Success with this response payload.
    Ok(Vec<u8>),
    /// Failure with this errno.
    Errno(u32),
    /// No answer: the chain stays with the device.
    Silent,
}

impl Reply {
    /// Success with `payload`'s bytes.
    pub(crate) fn of<T: IntoBytes + zerocopy::Immutable>(payload: &T) -> Self {
        Reply::Ok(payload.as_bytes().to_vec())
    }
}

type Handler = Box<dyn FnMut(Opcode, &[u8]) -> Reply + Send>;

/// The commands a device needs to come up.
fn bring_up_only(opcode: Opcode, _: &[u8]) -> Reply {
    match opcode {
        Opcode::SetDoorbell | Opcode::CreateEq => Reply::Ok(Vec::new()),
        _ => Reply::Silent,
    }
}

pub(crate) struct StubTransport {
    pub(crate) features: u64,
    pub(crate) config: Vec<u8>,
    pub(crate) queues: u16,
    pub(crate) added: Mutex<Vec<(u64, u64)>>,
    pub(crate) removed: Mutex<Vec<(u64, u64)>>,
    pub(crate) setups: Mutex<Vec<QueueSetup>>,
    pub(crate) notified: Mutex<Vec<u16>>,
    /// Every command the device received: opcode and request payload.
    pub(crate) commands: Mutex<Vec<(Opcode, Vec<u8>)>>,
    /// Every command's chain: its device-readable and device-writable bytes.
    pub(crate) chains: Mutex<Vec<(usize, usize)>>,
    handler: Mutex<Handler>,
    /// The memory the driver shares: device address, size and memfd.
    regions: Mutex<Vec<(u64, u64, File)>>,
    /// The control queue as the device sees it.
    control: Mutex<Option<Queue>>,
    /// Per queue, its interrupt.
    calls: Vec<EventFd>,
}

impl std::fmt::Debug for StubTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StubTransport")
            .field("queues", &self.queues)
            .finish_non_exhaustive()
    }
}

/// The features the test device offers.
pub(crate) const FEATURES: u64 = VIRTIO_F_VERSION_1 | VIRTIO_RING_F_EVENT_IDX;

/// Options for opening a test device: a small arena, and a short control
/// timeout for tests of unanswered commands.
pub(crate) fn options() -> DeviceOptions {
    DeviceOptions {
        arena_size: 1 << 20,
        control_timeout: Duration::from_millis(30),
        ..Default::default()
    }
}

/// An event of `kind` naming `object`.
pub(crate) fn event(kind: u16, object: u32) -> Event {
    Event {
        kind: kind.into(),
        object: object.into(),
        ..Default::default()
    }
}

/// Whether `fd` is readable right now.
pub(crate) fn readable(fd: BorrowedFd<'_>) -> bool {
    let mut pfd = libc::pollfd {
        fd: fd.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd for the duration of the call.
    unsafe { libc::poll(&mut pfd, 1, 0) == 1 }
}

/// A valid config space with `vectors` completion vectors.
pub(crate) fn config(vectors: u16, max_queue_size: u16) -> DeviceConfig {
    let mut c = DeviceConfig::new_zeroed();
    c.magic = CONFIG_MAGIC.into();
    c.version_major = vrdma_spec::SPEC_VERSION_MAJOR.into();
    c.num_comp_vectors = vectors.into();
    c.max_queue_size = max_queue_size.into();
    c.config_size = (CONFIG_SIZE as u32).into();
    c.name[..5].copy_from_slice(b"vrdma");
    c
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap()
}

impl Default for StubTransport {
    /// A transport with no queues, for tests of memory sharing only.
    fn default() -> Self {
        let mut stub = Self::with_config(&config(0, 1), 0);
        stub.queues = 0;
        stub
    }
}

impl StubTransport {
    pub(crate) fn with_config(config: &DeviceConfig, features: u64) -> Self {
        let queues = vrdma_spec::num_queues(config.num_comp_vectors.get());
        Self {
            features,
            config: config.as_bytes().to_vec(),
            queues,
            added: Mutex::default(),
            removed: Mutex::default(),
            setups: Mutex::default(),
            notified: Mutex::default(),
            commands: Mutex::default(),
            chains: Mutex::default(),
            handler: Mutex::new(Box::new(bring_up_only)),
            regions: Mutex::default(),
            control: Mutex::default(),
            calls: (0..queues)
                .map(|_| EventFd::new(EFD_NONBLOCK).unwrap())
                .collect(),
        }
    }

    /// Answers commands with `handler` (which sees the request payload);
    /// `SET_DOORBELL` and `CREATE_EQ` are answered before it is asked.
    pub(crate) fn answering(
        self,
        mut handler: impl FnMut(Opcode, &[u8]) -> Reply + Send + 'static,
    ) -> Self {
        self.answering_all(move |opcode, request| match opcode {
            Opcode::SetDoorbell | Opcode::CreateEq => bring_up_only(opcode, request),
            _ => handler(opcode, request),
        })
    }

    /// Answers every command, bring-up included, with `handler`.
    pub(crate) fn answering_all(
        self,
        handler: impl FnMut(Opcode, &[u8]) -> Reply + Send + 'static,
    ) -> Self {
        *lock(&self.handler) = Box::new(handler);
        self
    }

    /// The request payloads of every `opcode` command received so far.
    pub(crate) fn requests<T: FromBytes>(&self, opcode: Opcode) -> Vec<T> {
        lock(&self.commands)
            .iter()
            .filter(|(op, _)| *op == opcode)
            .map(|(_, bytes)| T::read_from_bytes(bytes).unwrap())
            .collect()
    }

    /// The driver's shared memory as the device maps it.
    pub(crate) fn memory(&self) -> GuestMemoryMmap {
        let mut ranges: Vec<_> = lock(&self.regions)
            .iter()
            .map(|(addr, size, file)| {
                let file = file.try_clone().unwrap();
                (
                    GuestAddress(*addr),
                    *size as usize,
                    Some(FileOffset::new(file, 0)),
                )
            })
            .collect();
        ranges.sort_by_key(|r| r.0);
        GuestMemoryMmap::from_ranges_with_files(ranges).unwrap()
    }

    /// Stores `value` at device address `addr` the way a device publishes
    /// an index (release).
    pub(crate) fn store_u32(&self, addr: u64, value: u32) {
        self.memory()
            .store(
                value.to_le(),
                GuestAddress(addr),
                std::sync::atomic::Ordering::Release,
            )
            .unwrap();
    }

    /// Writes `bytes` at device address `addr`.
    pub(crate) fn write(&self, addr: u64, bytes: &[u8]) {
        self.memory()
            .write_slice(bytes, GuestAddress(addr))
            .unwrap();
    }

    /// Reads `out.len()` bytes at device address `addr`.
    pub(crate) fn read(&self, addr: u64, out: &mut [u8]) {
        self.memory().read_slice(out, GuestAddress(addr)).unwrap();
    }

    /// Raises `queue`'s interrupt.
    pub(crate) fn interrupt(&self, queue: u16) {
        self.calls[usize::from(queue)].write(1).unwrap();
    }

    /// Answers every command waiting on the control queue, then asks to
    /// be notified of the next (EVENT_IDX's `avail_event`), as a backend
    /// does, and drains again if one came meanwhile.
    fn serve_control(&self) {
        let mem = self.memory();
        let mut control = lock(&self.control);
        let queue = control.as_mut().expect("control queue set up");
        loop {
            self.drain_control(queue, &mem);
            if !queue.enable_notification(&mem).unwrap() {
                break;
            }
        }
    }

    fn drain_control(&self, queue: &mut Queue, mem: &GuestMemoryMmap) {
        while let Some(chain) = queue.pop_descriptor_chain(mem) {
            let head = chain.head_index();
            let descriptors: Vec<_> = chain.collect();
            let mut request = Vec::new();
            for d in descriptors.iter().filter(|d| !d.is_write_only()) {
                let mut bytes = vec![0; d.len() as usize];
                mem.read_slice(&mut bytes, d.addr()).unwrap();
                request.extend(bytes);
            }
            let room = descriptors
                .iter()
                .filter(|d| d.is_write_only())
                .map(|d| d.len() as usize)
                .sum();
            lock(&self.chains).push((request.len(), room));
            let (header, payload) = RequestHeader::read_from_prefix(&request).unwrap();
            let opcode = Opcode::try_from(header.opcode.get()).unwrap();
            assert_eq!(header.payload_len.get() as usize, payload.len());
            lock(&self.commands).push((opcode, payload.to_vec()));
            let reply = (lock(&self.handler))(opcode, payload);
            let (status, body) = match reply {
                Reply::Silent => continue,
                Reply::Ok(body) => (0, body),
                Reply::Errno(errno) => (errno, Vec::new()),
            };
            let mut response = ResponseHeader {
                status: status.into(),
                payload_len: (body.len() as u32).into(),
            }
            .as_bytes()
            .to_vec();
            response.extend(body);
            let mut written = 0;
            for d in descriptors.iter().filter(|d| d.is_write_only()) {
                let n = (d.len() as usize).min(response.len() - written);
                mem.write_slice(&response[written..written + n], d.addr())
                    .unwrap();
                written += n;
            }
            assert_eq!(written, response.len(), "response room");
            queue.add_used(mem, head, written as u32).unwrap();
            self.interrupt(CONTROL_QUEUE);
        }
    }
}

impl Transport for StubTransport {
    fn negotiate_features(&self, wanted: u64) -> Result<u64, TransportError> {
        Ok(wanted & self.features)
    }
    fn num_queues(&self) -> u16 {
        self.queues
    }
    fn read_config(&self, offset: u32, buf: &mut [u8]) -> Result<(), TransportError> {
        let start = offset as usize;
        buf.copy_from_slice(&self.config[start..start + buf.len()]);
        Ok(())
    }
    fn add_memory(&self, r: &DmaRegion<'_>) -> Result<(), TransportError> {
        assert_eq!(r.host_addr, r.device_addr, "process mode");
        lock(&self.added).push((r.device_addr, r.size));
        let file = File::from(r.fd.try_clone_to_owned().unwrap());
        lock(&self.regions).push((r.device_addr, r.size, file));
        Ok(())
    }
    fn remove_memory(&self, r: &DmaRegion<'_>) -> Result<(), TransportError> {
        lock(&self.removed).push((r.device_addr, r.size));
        lock(&self.regions).retain(|(addr, _, _)| *addr != r.device_addr);
        Ok(())
    }
    fn setup_queue(&self, q: &QueueSetup) -> Result<(), TransportError> {
        lock(&self.setups).push(*q);
        if q.index == CONTROL_QUEUE {
            let mut queue = Queue::new(q.size).unwrap();
            queue.try_set_size(q.size).unwrap();
            queue
                .try_set_desc_table_address(GuestAddress(q.desc_addr))
                .unwrap();
            queue
                .try_set_avail_ring_address(GuestAddress(q.avail_addr))
                .unwrap();
            queue
                .try_set_used_ring_address(GuestAddress(q.used_addr))
                .unwrap();
            queue.set_event_idx(self.features & VIRTIO_RING_F_EVENT_IDX != 0);
            queue.set_ready(true);
            *lock(&self.control) = Some(queue);
        }
        Ok(())
    }
    fn notify(&self, queue: u16) -> Result<(), TransportError> {
        lock(&self.notified).push(queue);
        if queue == CONTROL_QUEUE {
            self.serve_control();
        }
        Ok(())
    }
    fn wait(&self, queue: u16, timeout: Option<Duration>) -> Result<bool, TransportError> {
        let call = self
            .calls
            .get(usize::from(queue))
            .ok_or(TransportError::NoQueue(queue))?;
        let mut pfd = libc::pollfd {
            fd: call.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        let ms = timeout.map_or(-1, |t| t.as_millis().min(i32::MAX as u128) as i32);
        // SAFETY: one valid pollfd for the duration of the call.
        let n = unsafe { libc::poll(&mut pfd, 1, ms) };
        if n <= 0 {
            return Ok(false);
        }
        self.acknowledge(queue)?;
        Ok(true)
    }
    fn interrupt_fd(&self, queue: u16) -> Option<BorrowedFd<'_>> {
        let call = self.calls.get(usize::from(queue))?;
        // SAFETY: the eventfd lives as long as `self`, which the borrow is tied to.
        Some(unsafe { BorrowedFd::borrow_raw(call.as_raw_fd()) })
    }
    fn acknowledge(&self, queue: u16) -> Result<(), TransportError> {
        let call = self
            .calls
            .get(usize::from(queue))
            .ok_or(TransportError::NoQueue(queue))?;
        let _ = call.read();
        Ok(())
    }
}
