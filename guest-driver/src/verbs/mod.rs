//! The verbs-shaped API: context, protection domains, memory regions,
//! completion queues and queue pairs.
//!
//! Objects hold their parents alive (an MR its PD, a QP its PD and CQs), the
//! way the verbs objects they mirror must be destroyed children first. Each
//! is destroyed on drop; an explicit `destroy` (or `dereg`) returns the
//! device's errno instead and hands the object back when it fails (a PD that
//! still has MRs answers `EBUSY`). Memory the device may still use is never
//! freed: when the device refuses to destroy an object, its rings and
//! buffers are kept until the device goes away.

use std::os::fd::BorrowedFd;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use vm_memory::VolatileSlice;
use vrdma_spec::config::{DeviceAttr, DeviceConfig, PortAttr};
use vrdma_spec::control::{
    CqHandle, CreateCqReq, MrHandle, MrSgSegment, Opcode, PdHandle, QueryGidReq, QueryGidResp,
    QueryPortReq, RegMrReq, RegMrResp, RegMrSgReq, MAX_MR_SEGMENTS,
};
use vrdma_spec::ring::cq_depth;
use zerocopy::{Immutable, IntoBytes};

use crate::device::{Device, DeviceEvent, DeviceOptions};
use crate::dma::{DmaBuf, PAGE_SIZE};
use crate::error::{DestroyError, Error, Result};
use crate::memory::{Hold, Placement};
use crate::ring::{CqRing, RingIndices, Sge, WorkCompletion};
use crate::transport::{
    virtio_pci::PciError, PciDevice, Transport, TransportError, VhostUserTransport,
    VirtioPciTransport,
};

mod ah;
mod qp;
mod srq;

pub use ah::AddressHandle;
pub use qp::{QpCapabilities, QpInitAttr, QueuePair, RecvBatch, SendBatch};
pub use srq::SharedReceiveQueue;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Ring state is consistent between operations: recover from poisoning.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// An open vrdma device (`struct ibv_context`).
#[derive(Debug, Clone)]
pub struct Context {
    dev: Arc<Device>,
}

impl Context {
    /// Opens the device behind `transport`.
    pub fn open(transport: Box<dyn Transport>, options: DeviceOptions) -> Result<Self> {
        Ok(Self {
            dev: Device::open(transport, options)?,
        })
    }

    /// Connects to vdev's vhost-user socket at `path` (process mode) and
    /// opens the device with default options.
    pub fn open_vhost_user(path: impl AsRef<Path>) -> Result<Self> {
        Self::open_vhost_user_with(path, DeviceOptions::default())
    }

    /// [`Context::open_vhost_user`] with `options`.
    pub fn open_vhost_user_with(path: impl AsRef<Path>, options: DeviceOptions) -> Result<Self> {
        let transport = VhostUserTransport::connect(path)?;
        Self::open(Box::new(transport), options)
    }

    /// Opens a context of a VM's vrdma device (VM mode): the device is the
    /// PCI functions at `functions` (addresses), or every function with
    /// `virtio_id` when empty; each function is one context slot
    /// (docs/architecture.md, "Contexts"), and this takes the first that
    /// no other process drives, from the kernel, with default options.
    /// EBUSY when all are taken. Needs root: sysfs binding, BAR mapping,
    /// hugepages and pagemap.
    pub fn open_pci(functions: &[String], virtio_id: u16) -> Result<Self> {
        let candidates = if functions.is_empty() {
            PciDevice::find_all(virtio_id).map_err(TransportError::from)?
        } else {
            functions
                .iter()
                .map(|bdf| PciDevice::at(bdf))
                .collect::<Result<Vec<_>, _>>()
                .map_err(TransportError::from)?
        };
        let count = candidates.len();
        for device in &candidates {
            match VirtioPciTransport::open(device, virtio_id) {
                Ok(transport) => return Self::open(Box::new(transport), DeviceOptions::default()),
                Err(PciError::Busy(_)) => continue,
                Err(e) => return Err(TransportError::from(e).into()),
            }
        }
        Err(TransportError::from(PciError::AllBusy { count, virtio_id }).into())
    }

    /// The device's config space, read at open.
    pub fn config(&self) -> &DeviceConfig {
        self.dev.config()
    }

    /// Number of completion vectors (event queues).
    pub fn num_comp_vectors(&self) -> u16 {
        // Bounded by the config's u16 field.
        self.dev.num_event_queues() as u16
    }

    /// `ibv_query_device`.
    pub fn query_device(&self) -> Result<DeviceAttr> {
        self.dev.command(Opcode::QueryDevice, &[])
    }

    /// `ibv_query_port`.
    pub fn query_port(&self, port_num: u8) -> Result<PortAttr> {
        let req = QueryPortReq {
            port_num,
            ..Default::default()
        };
        self.dev.command(Opcode::QueryPort, req.as_bytes())
    }

    /// `ibv_query_gid` (with the GID type).
    pub fn query_gid(&self, port_num: u8, index: u32) -> Result<QueryGidResp> {
        let req = QueryGidReq {
            port_num,
            index: index.into(),
            ..Default::default()
        };
        self.dev.command(Opcode::QueryGid, req.as_bytes())
    }

    /// `ibv_alloc_pd`.
    pub fn alloc_pd(&self) -> Result<ProtectionDomain> {
        let handle: PdHandle = self.dev.command(Opcode::AllocPd, &[])?;
        Ok(ProtectionDomain {
            inner: Arc::new(PdInner {
                dev: Arc::clone(&self.dev),
                handle: Handle::new(Opcode::DeallocPd, handle),
            }),
        })
    }

    /// `ibv_create_cq`: a CQ of at least `cqe` entries whose events go to
    /// completion vector `comp_vector`.
    pub fn create_cq(&self, cqe: u32, comp_vector: u16) -> Result<CompletionQueue> {
        let depth = cq_depth(cqe).ok_or(Error::InvalidArgument("too many CQEs"))?;
        let (len, align) = CqRing::alloc_args(depth)?;
        let ring = CqRing::new(self.dev.alloc(len, align, true)?, depth);
        let req = CreateCqReq {
            depth: depth.into(),
            comp_vector: u32::from(comp_vector).into(),
            ring_addr: ring.device_addr().into(),
        };
        let handle: CqHandle = self.dev.command(Opcode::CreateCq, req.as_bytes())?;
        Ok(CompletionQueue {
            inner: Arc::new(CqInner {
                dev: Arc::clone(&self.dev),
                handle: Handle::new(Opcode::DestroyCq, handle),
                comp_vector,
                depth,
                indices: ring.indices(),
                ring: Arc::new(Mutex::new(ring)),
            }),
        })
    }

    /// The next event of completion vector `comp_vector` (CQ completion
    /// events, CQ/QP errors, port changes), waiting up to `timeout`:
    /// `Some(Duration::ZERO)` only polls, `None` waits forever.
    pub fn get_event(
        &self,
        comp_vector: u16,
        timeout: Option<Duration>,
    ) -> Result<Option<DeviceEvent>> {
        self.dev.next_event(comp_vector, timeout)
    }

    /// A file descriptor that becomes readable when completion vector
    /// `comp_vector` may have an event (for poll/epoll loops); once it was,
    /// [`Context::acknowledge_event`] clears it before the events are read.
    pub fn event_fd(&self, comp_vector: u16) -> Option<BorrowedFd<'_>> {
        self.dev.event_fd(comp_vector)
    }

    /// Clears what made [`Context::event_fd`] of `comp_vector` readable.
    pub fn acknowledge_event(&self, comp_vector: u16) -> Result<()> {
        self.dev.acknowledge_event(comp_vector)
    }

    /// Opens a CM channel (`rdma_create_event_channel`) on the device's
    /// connection manager; ENODEV if the device has none.
    pub fn cm_channel(&self) -> Result<crate::cm::CmChannel> {
        crate::cm::CmChannel::open(Arc::clone(&self.dev))
    }

    /// Whether the device advertises a connection manager (and its CM
    /// event queue was set up).
    pub fn has_cm(&self) -> bool {
        self.dev.cm().is_some()
    }
}

/// A PD's or CQ's handle as the device gave it (`ALLOC_PD`'s and
/// `CREATE_CQ`'s response), which is also the request of the command that
/// destroys the object. The object is
/// destroyed once: by an explicit destroy or, failing that, when the last
/// reference to it drops.
#[derive(Debug)]
struct Handle<H> {
    /// `DEALLOC_PD` or `DESTROY_CQ`.
    opcode: Opcode,
    wire: H,
    /// The device still has the object.
    live: AtomicBool,
}

impl<H: IntoBytes + Immutable> Handle<H> {
    fn new(opcode: Opcode, wire: H) -> Self {
        Self {
            opcode,
            wire,
            live: AtomicBool::new(true),
        }
    }

    /// Destroys the object on `dev` unless that was done already; it is
    /// gone once the device agrees.
    fn destroy(&self, dev: &Device) -> Result<()> {
        if self.live.load(Ordering::Acquire) {
            dev.command_no_reply(self.opcode, self.wire.as_bytes())?;
            self.live.store(false, Ordering::Release);
        }
        Ok(())
    }
}

#[derive(Debug)]
struct PdInner {
    dev: Arc<Device>,
    handle: Handle<PdHandle>,
}

impl Drop for PdInner {
    fn drop(&mut self) {
        if let Err(e) = self.handle.destroy(&self.dev) {
            let pdn = self.handle.wire.pdn.get();
            tracing::warn!(error = %e, pdn, "Cannot deallocate a PD");
        }
    }
}

/// A protection domain (`struct ibv_pd`).
#[derive(Debug)]
pub struct ProtectionDomain {
    inner: Arc<PdInner>,
}

impl ProtectionDomain {
    /// The device's PD number.
    pub fn pdn(&self) -> u32 {
        self.inner.handle.wire.pdn.get()
    }

    /// Allocates `len` bytes of zeroed, page-aligned DMA memory and registers
    /// them with `access` ([`vrdma_spec::verbs::access`] flags). The IOVA is
    /// the buffer's address.
    pub fn alloc_mr(&self, len: usize, access: u32) -> Result<MemoryRegion> {
        if len == 0 {
            return Err(Error::InvalidArgument("zero-length MR"));
        }
        let buf = self.inner.dev.alloc(len, PAGE_SIZE, true)?;
        let addr = buf.as_ptr() as u64;
        let placement = Placement::Contiguous(buf.device_addr());
        self.register(
            addr,
            len,
            placement,
            addr,
            access,
            Backing::Dma(Box::new([Arc::new(buf)])),
        )
    }

    /// Allocates one zeroed DMA buffer per entry of `lens`, apart from each
    /// other, and registers them as one MR whose bytes are the buffers'
    /// bytes in order (`REG_MR_SG`), known as `iova`. The MR is not
    /// contiguous in this process either: reach it with
    /// [`MemoryRegion::read`]/[`MemoryRegion::write`], not
    /// [`MemoryRegion::as_ptr`].
    pub fn alloc_mr_scattered(
        &self,
        lens: &[usize],
        iova: u64,
        access: u32,
    ) -> Result<MemoryRegion> {
        if lens.is_empty() || lens.contains(&0) {
            return Err(Error::InvalidArgument("empty segment list or segment"));
        }
        let dev = &self.inner.dev;
        let mut bufs = Vec::with_capacity(lens.len());
        for &len in lens {
            // A spacer keeps consecutive buffers from being adjacent, so the
            // device really gets separate segments.
            let _spacer = dev.alloc(PAGE_SIZE, PAGE_SIZE, false)?;
            bufs.push(Arc::new(dev.alloc(len, PAGE_SIZE, true)?));
        }
        let segments = bufs
            .iter()
            .map(|b| (b.device_addr(), b.len() as u64))
            .collect();
        let total = lens.iter().sum();
        self.register(
            bufs[0].as_ptr() as u64,
            total,
            Placement::Segments(segments),
            iova,
            access,
            Backing::Dma(bufs.into_boxed_slice()),
        )
    }

    /// `ibv_reg_mr`: registers `len` bytes the application owns at `addr`,
    /// known by their own address in work requests.
    ///
    /// Memory outside the driver's DMA arenas is moved onto shared memory in
    /// place (see the crate documentation): the whole pages covering the
    /// range are copied into a memfd mapped over the same addresses, then
    /// shared with the device. Prefer page-aligned buffers (posix_memalign,
    /// mmap): other data on those pages becomes shared too.
    ///
    /// # Safety
    ///
    /// - `[addr, addr + len)` must be mapped, readable memory of this process
    ///   that stays mapped while the MR exists.
    /// - Every page it touches may be replaced by a shared read-write mapping
    ///   with the same contents, and the pages must not be a mapping whose
    ///   identity matters (another memfd, a file, hugetlb). Other threads
    ///   may go on writing to those pages: their writes wait while the pages
    ///   move (userfaultfd write protection); only where userfaultfd is
    ///   unavailable (a seccomp filter refusing it) may such a write be
    ///   lost, and the library then says so once.
    pub unsafe fn reg_mr(&self, addr: *mut u8, len: usize, access: u32) -> Result<MemoryRegion> {
        // SAFETY: forwarded from the caller.
        unsafe { self.reg_mr_iova(addr, len, addr as u64, access) }
    }

    /// `ibv_reg_mr_iova2`: like [`ProtectionDomain::reg_mr`], with the
    /// region known as `iova` in work requests.
    ///
    /// # Safety
    ///
    /// As for [`ProtectionDomain::reg_mr`].
    pub unsafe fn reg_mr_iova(
        &self,
        addr: *mut u8,
        len: usize,
        iova: u64,
        access: u32,
    ) -> Result<MemoryRegion> {
        if len == 0 || addr.is_null() {
            return Err(Error::InvalidArgument("empty or null MR range"));
        }
        let va = addr as u64;
        let (inside, straddles) = self.inner.dev.arena_of(va, len as u64);
        if straddles {
            return Err(Error::InvalidArgument("range straddles driver DMA memory"));
        }
        if inside {
            // Driver memory: already reachable, device address by translation.
            let device_addr = self.inner.dev.device_addr_of(va);
            let placement = Placement::Contiguous(device_addr);
            return self.register(va, len, placement, iova, access, Backing::Arena);
        }
        let dev = &self.inner.dev;
        // SAFETY: the caller's contract covers every page of the range.
        let (placement, hold) = unsafe { dev.memory.acquire(dev.transport(), va, len as u64)? };
        self.register(
            va,
            len,
            placement,
            iova,
            access,
            Backing::App(Box::new(hold)),
        )
    }

    /// Registers `len` bytes the device reaches at `placement`; they start
    /// at `addr` in this process (or are the buffers of a scattered
    /// backing). On failure the backing is released.
    fn register(
        &self,
        addr: u64,
        len: usize,
        placement: Placement,
        iova: u64,
        access: u32,
        backing: Backing,
    ) -> Result<MemoryRegion> {
        let mut mr = MemoryRegion {
            pd: Arc::clone(&self.inner),
            handle: 0,
            lkey: 0,
            rkey: 0,
            addr,
            len,
            iova,
            backing,
            live: false,
        };
        // On failure `mr` drops with `live == false`: only its backing is released.
        let dev = &self.inner.dev;
        let resp: RegMrResp = match placement {
            Placement::Contiguous(device_addr) => {
                let req = RegMrReq {
                    pdn: self.inner.handle.wire.pdn,
                    access: access.into(),
                    addr: device_addr.into(),
                    length: (len as u64).into(),
                    iova: iova.into(),
                };
                dev.command(Opcode::RegMr, req.as_bytes())?
            }
            Placement::Segments(segments) => {
                if segments.len() > MAX_MR_SEGMENTS as usize {
                    return Err(Error::InvalidArgument(
                        "memory is scattered over more segments than REG_MR_SG takes \
                         (register less at once, or use hugepage-backed buffers)",
                    ));
                }
                let list: Vec<MrSgSegment> = segments
                    .iter()
                    .map(|&(addr, len)| MrSgSegment {
                        addr: addr.into(),
                        len: len.into(),
                    })
                    .collect();
                let list_buf = dev.alloc(list.as_bytes().len(), 64, false)?;
                list_buf.write_at(0, list.as_bytes());
                let req = RegMrSgReq {
                    pdn: self.inner.handle.wire.pdn,
                    access: access.into(),
                    iova: iova.into(),
                    length: (len as u64).into(),
                    // At most MAX_MR_SEGMENTS, checked above.
                    nsegs: (list.len() as u32).into(),
                    reserved: 0.into(),
                    list_addr: list_buf.device_addr().into(),
                };
                // The device reads the list once, while executing: the
                // buffer is free again when the command is answered.
                dev.command(Opcode::RegMrSg, req.as_bytes())?
            }
        };
        mr.handle = resp.handle.get();
        mr.lkey = resp.lkey.get();
        mr.rkey = resp.rkey.get();
        mr.live = true;
        Ok(mr)
    }

    /// `ibv_dealloc_pd`, returning the device's errno (`EBUSY` while MRs or
    /// QPs use the PD). On failure the PD is handed back.
    pub fn destroy(self) -> Result<(), DestroyError<Self>> {
        let result = self.inner.handle.destroy(&self.inner.dev);
        DestroyError::hand_back(self, result)
    }
}

/// What keeps an MR's memory reachable by the device.
#[derive(Debug)]
enum Backing {
    /// Driver buffers from `alloc_mr` / `alloc_mr_scattered`.
    Dma(Box<[Arc<DmaBuf>]>),
    /// Application memory inside a driver arena: nothing to release.
    Arena,
    /// Application memory made reachable in the transport's memory model.
    App(Box<Hold>),
}

/// A registered memory region (`struct ibv_mr`).
#[derive(Debug)]
pub struct MemoryRegion {
    pd: Arc<PdInner>,
    handle: u32,
    lkey: u32,
    rkey: u32,
    /// The region's first byte in this process (a scattered driver MR's
    /// bytes are its backing buffers).
    addr: u64,
    len: usize,
    iova: u64,
    backing: Backing,
    live: bool,
}

impl MemoryRegion {
    /// Local key, for SGEs.
    pub fn lkey(&self) -> u32 {
        self.lkey
    }

    /// Remote key, for peers' RDMA and atomics.
    pub fn rkey(&self) -> u32 {
        self.rkey
    }

    /// The region's first byte in this process (of its first buffer, for
    /// a scattered MR).
    pub fn as_ptr(&self) -> *mut u8 {
        self.addr as *mut u8
    }

    /// Bytes in the region.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the region is empty (never: registration refuses that).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The address the region is known by in work requests.
    pub fn iova(&self) -> u64 {
        self.iova
    }

    /// An SGE for `length` bytes at `offset` into the region.
    pub fn sge(&self, offset: u64, length: u32) -> Sge {
        Sge {
            addr: self.iova + offset,
            length,
            lkey: self.lkey,
        }
    }

    /// Copies `data` into the region at `offset`.
    pub fn write(&self, offset: usize, data: &[u8]) -> Result<()> {
        let mut done = 0;
        for slice in self.slices(offset, data.len())? {
            slice.copy_from(&data[done..done + slice.len()]);
            done += slice.len();
        }
        Ok(())
    }

    /// Copies bytes at `offset` out of the region.
    pub fn read(&self, offset: usize, out: &mut [u8]) -> Result<()> {
        let mut done = 0;
        for slice in self.slices(offset, out.len())? {
            let n = slice.len();
            slice.copy_to(&mut out[done..done + n]);
            done += n;
        }
        Ok(())
    }

    /// The region's bytes `[offset, offset + len)` as slices of its pieces.
    fn slices(&self, offset: usize, len: usize) -> Result<Vec<VolatileSlice<'_>>> {
        let end = offset
            .checked_add(len)
            .filter(|&end| end <= self.len)
            .ok_or(Error::InvalidArgument("access outside the MR"))?;
        let pieces: Vec<(u64, usize)> = match &self.backing {
            Backing::Dma(bufs) if bufs.len() > 1 => {
                bufs.iter().map(|b| (b.as_ptr() as u64, b.len())).collect()
            }
            _ => vec![(self.addr, self.len)],
        };
        let mut out = Vec::new();
        let mut piece_start = 0;
        for (va, piece_len) in pieces {
            let piece_end = piece_start + piece_len;
            let (lo, hi) = (offset.max(piece_start), end.min(piece_end));
            if lo < hi {
                // SAFETY: inside one piece of the MR, which is mapped while
                // the MR lives (driver memory we own, or the `reg_mr`
                // caller's promise); the device may write it concurrently,
                // hence a volatile slice.
                out.push(unsafe {
                    VolatileSlice::new((va as *mut u8).add(lo - piece_start), hi - lo)
                });
            }
            piece_start = piece_end;
        }
        Ok(out)
    }

    fn dereg_now(&mut self) -> Result<()> {
        let req = MrHandle {
            handle: self.handle.into(),
            ..Default::default()
        };
        self.pd
            .dev
            .command_no_reply(Opcode::DeregMr, req.as_bytes())?;
        self.live = false;
        Ok(())
    }

    /// `ibv_dereg_mr`, returning the device's errno; on failure the MR is
    /// handed back.
    pub fn dereg(mut self) -> Result<(), DestroyError<Self>> {
        let result = self.dereg_now();
        DestroyError::hand_back(self, result)
    }
}

impl Drop for MemoryRegion {
    fn drop(&mut self) {
        if self.live {
            if let Err(e) = self.dereg_now() {
                tracing::warn!(error = %e, handle = self.handle, "Cannot deregister an MR");
                // The device may still reach the memory: keep it shared.
                if let Backing::Dma(bufs) = &self.backing {
                    self.pd.dev.quarantine(bufs.clone());
                }
                return;
            }
        }
        if let Backing::App(hold) = &self.backing {
            let dev = &self.pd.dev;
            dev.memory.release(dev.transport(), hold);
        }
    }
}

#[derive(Debug)]
struct CqInner {
    dev: Arc<Device>,
    handle: Handle<CqHandle>,
    comp_vector: u16,
    depth: u32,
    ring: Arc<Mutex<CqRing>>,
    /// The ring's indices, read without `ring`'s lock (see
    /// [`CompletionQueue::poll`]).
    indices: RingIndices,
}

impl CqInner {
    /// The device's CQ number.
    fn cqn(&self) -> u32 {
        self.handle.wire.cqn.get()
    }
}

impl Drop for CqInner {
    fn drop(&mut self) {
        if let Err(e) = self.handle.destroy(&self.dev) {
            tracing::warn!(error = %e, cqn = self.cqn(), "Cannot destroy a CQ");
            // The device may still write the ring.
            self.dev.quarantine(Arc::clone(&self.ring));
        }
    }
}

/// A completion queue (`struct ibv_cq`).
#[derive(Debug)]
pub struct CompletionQueue {
    inner: Arc<CqInner>,
}

impl CompletionQueue {
    /// The device's CQ number (what completion events name).
    pub fn cqn(&self) -> u32 {
        self.inner.cqn()
    }

    /// Number of CQEs the ring holds (the requested count rounded up to a
    /// power of two).
    pub fn depth(&self) -> u32 {
        self.inner.depth
    }

    /// The completion vector the CQ's events go to.
    pub fn comp_vector(&self) -> u16 {
        self.inner.comp_vector
    }

    /// `ibv_poll_cq`: moves up to `out.len()` completions into `out` and
    /// returns how many.
    pub fn poll(&self, out: &mut [WorkCompletion]) -> Result<usize> {
        // Most polls of a busy-polling application find nothing: they
        // answer from the two indices, without taking the lock (an atomic
        // read-modify-write each way) that consuming needs.
        if self.inner.indices.drained() {
            return Ok(0);
        }
        lock(&self.inner.ring).poll(out)
    }

    /// `ibv_req_notify_cq`: one event on the next completion (or the next
    /// solicited one). Poll once more after arming: a completion that came
    /// before the arm raises no event.
    pub fn req_notify(&self, solicited_only: bool) {
        lock(&self.inner.ring).arm(solicited_only);
    }

    /// `ibv_destroy_cq`, returning the device's errno (`EBUSY` while QPs use
    /// it); on failure the CQ is handed back.
    pub fn destroy(self) -> Result<(), DestroyError<Self>> {
        let result = self.inner.handle.destroy(&self.inner.dev);
        DestroyError::hand_back(self, result)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{config, options, StubTransport, FEATURES};

    #[test]
    fn context_checks_arguments_before_asking_the_device() {
        let stub = StubTransport::with_config(&config(2, 64), FEATURES);
        let ctx = Context::open(Box::new(stub), options()).unwrap();
        assert_eq!(ctx.num_comp_vectors(), 2);
        assert_eq!(ctx.config().name(), Some("vrdma"));
        let err = ctx.create_cq(u32::MAX, 0).unwrap_err();
        assert_eq!(err.errno(), libc::EINVAL);
        assert!(ctx.get_event(0, Some(Duration::ZERO)).unwrap().is_none());
        assert_eq!(
            ctx.get_event(5, Some(Duration::ZERO)).unwrap_err().errno(),
            libc::EINVAL
        );
        assert!(ctx.event_fd(1).is_some());
        assert!(ctx.event_fd(2).is_none(), "no such vector");
        assert_eq!(ctx.acknowledge_event(2).unwrap_err().errno(), libc::EINVAL);
    }
}
