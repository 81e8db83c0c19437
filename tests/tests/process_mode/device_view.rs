//! [`DeviceView`]: the real vhost-user transport, plus a record of what the
//! device was told (memory regions with their fds, queues, notifications),
//! so a test can read guest memory as vdev does and play the device's side
//! of a ring.

use std::fmt::Debug;
use std::fs::File;
use std::os::fd::BorrowedFd;
use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use vm_memory::{Bytes, FileOffset, GuestAddress, GuestMemoryMmap};
use vrdma_guest_driver::dma::DmaRegion;
use vrdma_guest_driver::transport::{QueueSetup, TransportError};
use vrdma_guest_driver::{Context, DeviceOptions, Transport, VhostUserTransport};
use vrdma_spec::control::{Opcode, RequestHeader};
use vrdma_spec::zerocopy::FromBytes;
use vrdma_spec::CONTROL_QUEUE;

#[derive(Debug)]
pub(crate) struct SharedRegion {
    pub(crate) addr: u64,
    pub(crate) size: u64,
    /// A duplicate of the fd vdev received.
    pub(crate) file: File,
}

#[derive(Debug, Default)]
pub(crate) struct Seen {
    pub(crate) live: Vec<SharedRegion>,
    pub(crate) added: Vec<(u64, u64)>,
    pub(crate) removed: Vec<(u64, u64)>,
    pub(crate) queues: Vec<QueueSetup>,
    pub(crate) notified: Vec<u16>,
    /// The control commands the driver notified the device of, as
    /// (opcode, payload), read when it notified: the request buffer is
    /// reused by the next command. (With EVENT_IDX a command the device
    /// did not ask to be told of goes unrecorded; the first one, the
    /// device's SET_DOORBELL, always is.)
    pub(crate) requests: Vec<(u16, Vec<u8>)>,
}

/// The process-mode vhost-user transport, recording every memory region
/// (with a duplicate of its fd) and queue it gives the device, so a test
/// can map guest memory exactly as vdev does.
#[derive(Debug)]
pub(crate) struct DeviceView {
    pub(crate) inner: VhostUserTransport,
    pub(crate) seen: Mutex<Seen>,
}

impl DeviceView {
    pub(crate) fn open(socket: &Path) -> (Arc<Self>, Context) {
        let view = Arc::new(Self {
            inner: VhostUserTransport::connect(socket).expect("connect to vdev"),
            seen: Mutex::default(),
        });
        let ctx = Context::open(Box::new(Arc::clone(&view)), DeviceOptions::default())
            .expect("open the device");
        (view, ctx)
    }

    pub(crate) fn seen(&self) -> MutexGuard<'_, Seen> {
        self.seen.lock().expect("not poisoned")
    }

    /// Guest memory as vdev maps it: every live region, by its fd.
    pub(crate) fn memory(&self) -> GuestMemoryMmap {
        let seen = self.seen();
        let mut ranges: Vec<_> = seen
            .live
            .iter()
            .map(|r| {
                let file = r.file.try_clone().expect("dup region fd");
                (
                    GuestAddress(r.addr),
                    r.size as usize,
                    Some(FileOffset::new(file, 0)),
                )
            })
            .collect();
        ranges.sort_by_key(|r| r.0);
        GuestMemoryMmap::from_ranges_with_files(ranges).expect("map the device's view")
    }

    /// Live regions overlapping `[addr, addr + len)`.
    pub(crate) fn regions_over(&self, addr: u64, len: u64) -> Vec<(u64, u64)> {
        self.seen()
            .live
            .iter()
            .filter(|r| r.addr < addr + len && addr < r.addr + r.size)
            .map(|r| (r.addr, r.size))
            .collect()
    }

    pub(crate) fn take_notified(&self) -> Vec<u16> {
        std::mem::take(&mut self.seen().notified)
    }

    /// The payload of the last control command the driver made available,
    /// which must be `opcode`'s.
    pub(crate) fn last_request<T: FromBytes>(&self, opcode: Opcode) -> T {
        let (op, payload) = self.newest_request();
        assert_eq!(op, u16::from(opcode), "last command");
        T::read_from_bytes(&payload).expect("payload of the opcode's size")
    }

    /// The payload of the first `opcode` command the driver notified the
    /// device of ([`Seen::requests`]).
    pub(crate) fn first_request<T: FromBytes>(&self, opcode: Opcode) -> T {
        let seen = self.seen();
        let (_, payload) = (seen.requests.iter())
            .find(|(op, _)| *op == u16::from(opcode))
            .unwrap_or_else(|| panic!("no {opcode:?} command was notified"));
        T::read_from_bytes(payload).expect("payload of the opcode's size")
    }

    /// The newest control command the driver made available, read from
    /// the control queue as the device reads it: the newest avail entry,
    /// its first (device-readable) descriptor, the request there; its
    /// opcode and payload.
    fn newest_request(&self) -> (u16, Vec<u8>) {
        let q = *self
            .seen()
            .queues
            .iter()
            .rev()
            .find(|q| q.index == CONTROL_QUEUE)
            .expect("control queue set up");
        let mem = self.memory();
        let avail_idx = u16::from_le(mem.read_obj(GuestAddress(q.avail_addr + 2)).expect("idx"));
        let slot = u64::from(avail_idx.wrapping_sub(1) % q.size);
        let head = u16::from_le(
            mem.read_obj(GuestAddress(q.avail_addr + 4 + 2 * slot))
                .expect("avail ring"),
        );
        let desc = q.desc_addr + 16 * u64::from(head);
        let addr = u64::from_le(mem.read_obj(GuestAddress(desc)).expect("desc addr"));
        let len = u32::from_le(mem.read_obj(GuestAddress(desc + 8)).expect("desc len"));
        let flags = u16::from_le(mem.read_obj(GuestAddress(desc + 12)).expect("desc flags"));
        assert_eq!(
            flags & 2,
            0,
            "the chain starts with the device-readable request"
        );
        let mut bytes = vec![0u8; len as usize];
        mem.read_slice(&mut bytes, GuestAddress(addr))
            .expect("request");
        let (header, payload) = RequestHeader::read_from_prefix(&bytes).expect("header");
        assert_eq!(header.payload_len.get() as usize, payload.len());
        (header.opcode.get(), payload.to_vec())
    }
}

impl Transport for DeviceView {
    fn negotiate_features(&self, wanted: u64) -> Result<u64, TransportError> {
        self.inner.negotiate_features(wanted)
    }
    fn num_queues(&self) -> u16 {
        self.inner.num_queues()
    }
    fn read_config(&self, offset: u32, buf: &mut [u8]) -> Result<(), TransportError> {
        self.inner.read_config(offset, buf)
    }
    fn add_memory(&self, region: &DmaRegion<'_>) -> Result<(), TransportError> {
        self.inner.add_memory(region)?;
        assert_eq!(region.host_addr, region.device_addr, "process mode");
        let file = File::from(region.fd.try_clone_to_owned().expect("dup"));
        let mut seen = self.seen();
        seen.added.push((region.device_addr, region.size));
        seen.live.push(SharedRegion {
            addr: region.device_addr,
            size: region.size,
            file,
        });
        Ok(())
    }
    fn remove_memory(&self, region: &DmaRegion<'_>) -> Result<(), TransportError> {
        self.inner.remove_memory(region)?;
        let mut seen = self.seen();
        seen.removed.push((region.device_addr, region.size));
        seen.live.retain(|r| r.addr != region.device_addr);
        Ok(())
    }
    fn setup_queue(&self, queue: &QueueSetup) -> Result<(), TransportError> {
        self.inner.setup_queue(queue)?;
        self.seen().queues.push(*queue);
        Ok(())
    }
    fn notify(&self, queue: u16) -> Result<(), TransportError> {
        if queue == CONTROL_QUEUE {
            let request = self.newest_request();
            self.seen().requests.push(request);
        }
        self.seen().notified.push(queue);
        self.inner.notify(queue)
    }
    fn wait(&self, queue: u16, timeout: Option<Duration>) -> Result<bool, TransportError> {
        self.inner.wait(queue, timeout)
    }
    fn interrupt_fd(&self, queue: u16) -> Option<BorrowedFd<'_>> {
        self.inner.interrupt_fd(queue)
    }
}

pub(crate) fn read_u32(mem: &GuestMemoryMmap, addr: u64) -> u32 {
    u32::from_le(mem.read_obj(GuestAddress(addr)).expect("read u32"))
}

pub(crate) fn write_u32(mem: &GuestMemoryMmap, addr: u64, value: u32) {
    mem.write_obj(value.to_le(), GuestAddress(addr))
        .expect("write u32");
}

pub(crate) fn read_at<T: FromBytes>(mem: &GuestMemoryMmap, addr: u64) -> T {
    let mut bytes = vec![0u8; std::mem::size_of::<T>()];
    mem.read_slice(&mut bytes, GuestAddress(addr))
        .expect("read");
    T::read_from_bytes(&bytes).expect("size")
}

pub(crate) fn read_vec(mem: &GuestMemoryMmap, addr: u64, len: usize) -> Vec<u8> {
    let mut bytes = vec![0u8; len];
    mem.read_slice(&mut bytes, GuestAddress(addr))
        .expect("read");
    bytes
}
