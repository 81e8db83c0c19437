//! vdev as an application meets it: a separate vdev process on a real unix
//! socket, driven through the guest driver in process mode
//! (`Context::open_vhost_user`), the way an RDMA application would.
//!
//! Every control verb goes through the driver, with its failure paths and
//! their exact errnos. vdev runs without `--hostd`, so nothing consumes the
//! data-path rings on the device side; their tests open the device through
//! [`DeviceView`] instead: the real vhost-user transport plus a record of
//! what the device was told (memory regions, queue addresses), which lets a
//! test read guest memory the way vdev does — the WQEs the driver wrote, the
//! application memory `reg_mr` shared — and play the device's side of a
//! ring (consumer index, CQEs, NEED_KICK, ERROR).

use std::fmt::Debug;
use std::fs::File;
use std::os::fd::BorrowedFd;
use std::path::Path;
use std::process::Command;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use vm_memory::{Bytes, FileOffset, GuestAddress, GuestMemoryMmap};
use vrdma_guest_driver::dma::DmaRegion;
use vrdma_guest_driver::transport::{QueueSetup, TransportError};
use vrdma_guest_driver::{
    CompletionQueue, Context, DestroyError, DeviceOptions, Error, MemoryRegion, PostError,
    ProtectionDomain, QpCapabilities, QpInitAttr, QueuePair, RecvWr, SendPayload, SendWr, Sge,
    Transport, VhostUserTransport, WorkCompletion,
};
use vrdma_spec::config::DeviceConfig;
use vrdma_spec::control::{CreateCqReq, CreateQpReq, Opcode, QpAttr, RequestHeader, NO_SRQ};
use vrdma_spec::qp_state::mask;
use vrdma_spec::ring::{
    self, send_flags, wc_flags, Cqe, RecvWqe, SendWqe, CQE_SIZE, CQ_ARM_NEXT, CQ_ARM_SOLICITED,
    DEVICE_FLAGS_OFFSET, DEVICE_FLAG_ERROR, DEVICE_FLAG_NEED_KICK, DEVICE_INDEX_OFFSET,
    DRIVER_ARM_OFFSET, DRIVER_INDEX_OFFSET, RING_HEADER_SIZE, SGE_SIZE,
};
use vrdma_spec::verbs::{
    access, atomic_cap, device_cap, LinkLayer, Mtu, PortState, QpState, QpType, SendOpcode,
    WcOpcode, WcStatus,
};
use vrdma_spec::zerocopy::{FromBytes, IntoBytes};
use vrdma_spec::{CONTROL_QUEUE, DOORBELL_QUEUE};
use vrdma_tenant_policy::Limits;
use vrdma_tests::daemon::Vdev;

const EINVAL: i32 = libc::EINVAL;
const EBUSY: i32 = libc::EBUSY;
const ENOMEM: i32 = libc::ENOMEM;
const EOPNOTSUPP: i32 = libc::EOPNOTSUPP;
const PAGE: usize = 4096;
const RW: u32 = access::LOCAL_WRITE | access::REMOTE_WRITE | access::REMOTE_READ;

// ---------------------------------------------------------------------------
// Assertion helpers: which errno, and who refused.
// ---------------------------------------------------------------------------

/// The errno of a refusal that came from the device (vdev) itself.
#[track_caller]
fn device_errno<T: Debug>(result: Result<T, Error>) -> i32 {
    match result {
        Err(Error::Device(errno)) => errno,
        Err(other) => panic!("expected the device to refuse, the driver failed: {other:?}"),
        Ok(v) => panic!("expected the device to refuse, got {v:?}"),
    }
}

/// The errno of an argument the driver refused before asking the device.
#[track_caller]
fn driver_errno<T: Debug>(result: Result<T, Error>) -> i32 {
    match result {
        Err(e @ Error::InvalidArgument(_)) => e.errno(),
        Err(other) => panic!("expected the driver to refuse the argument, got {other:?}"),
        Ok(v) => panic!("expected the driver to refuse the argument, got {v:?}"),
    }
}

/// A destroy the device refused: the object handed back and the errno.
#[track_caller]
fn refused_destroy<T: Debug>(result: Result<(), DestroyError<T>>) -> (T, i32) {
    match result {
        Err(DestroyError {
            object,
            error: Error::Device(errno),
        }) => (object, errno),
        Err(other) => panic!("expected the device to refuse, got {other:?}"),
        Ok(()) => panic!("expected the device to refuse the destroy"),
    }
}

#[track_caller]
fn destroyed<T: Debug>(result: Result<(), DestroyError<T>>) {
    if let Err(e) = result {
        panic!("destroy failed with errno {}: {e:?}", e.errno());
    }
}

/// A post that failed: `(bad_wr, errno, queue full?)`.
#[track_caller]
fn post_failure(result: Result<(), PostError>) -> (usize, i32, bool) {
    match result {
        Err(e) => (e.bad_wr, e.errno(), matches!(e.error, Error::QueueFull)),
        Ok(()) => panic!("expected the post to fail"),
    }
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) ^ (i >> 8) as u8)
        .collect()
}

// ---------------------------------------------------------------------------
// QP helpers: what an application sends for each transition.
// ---------------------------------------------------------------------------

fn caps(send: u32, recv: u32, sge: u32, inline: u32) -> QpCapabilities {
    QpCapabilities {
        max_send_wr: send,
        max_recv_wr: recv,
        max_send_sge: sge,
        max_recv_sge: sge,
        max_inline_data: inline,
    }
}

fn create_qp(
    pd: &ProtectionDomain,
    cq: &CompletionQueue,
    cap: QpCapabilities,
) -> Result<QueuePair, Error> {
    pd.create_qp(&QpInitAttr {
        send_cq: cq,
        recv_cq: cq,
        cap,
        qp_type: QpType::Rc,
        sq_sig_all: false,
    })
}

fn state_of(qp: &QueuePair) -> QpState {
    let q = qp.query(0).expect("query_qp");
    assert_eq!(q.attr.cur_qp_state, q.attr.qp_state, "cur_qp_state follows");
    QpState::try_from(q.attr.qp_state).expect("a known QP state")
}

const INIT_MASK: u32 = mask::STATE | mask::PKEY_INDEX | mask::PORT | mask::ACCESS_FLAGS;
const RTR_MASK: u32 = mask::STATE
    | mask::AV
    | mask::PATH_MTU
    | mask::DEST_QPN
    | mask::RQ_PSN
    | mask::MAX_DEST_RD_ATOMIC
    | mask::MIN_RNR_TIMER;
const RTS_MASK: u32 = mask::STATE
    | mask::SQ_PSN
    | mask::TIMEOUT
    | mask::RETRY_CNT
    | mask::RNR_RETRY
    | mask::MAX_QP_RD_ATOMIC;

fn init_attr() -> QpAttr {
    QpAttr {
        qp_state: QpState::Init.into(),
        port_num: 1,
        pkey_index: 0.into(),
        qp_access_flags: (access::REMOTE_WRITE | access::REMOTE_READ).into(),
        ..QpAttr::default()
    }
}

fn rtr_attr(dest_qpn: u32, dlid: u16) -> QpAttr {
    let mut attr = QpAttr {
        qp_state: QpState::Rtr.into(),
        path_mtu: Mtu::Mtu1024.into(),
        dest_qp_num: dest_qpn.into(),
        rq_psn: 0x1234.into(),
        max_dest_rd_atomic: 4,
        min_rnr_timer: 12,
        ..QpAttr::default()
    };
    attr.ah_attr.dlid = dlid.into();
    attr.ah_attr.port_num = 1;
    attr.ah_attr.sl = 3;
    attr
}

fn rts_attr() -> QpAttr {
    QpAttr {
        qp_state: QpState::Rts.into(),
        sq_psn: 0x5678.into(),
        timeout: 14,
        retry_cnt: 7,
        rnr_retry: 6,
        max_rd_atomic: 2,
        ..QpAttr::default()
    }
}

fn to_state(state: QpState) -> QpAttr {
    QpAttr {
        qp_state: state.into(),
        ..QpAttr::default()
    }
}

/// RESET → INIT → RTR → RTS towards `dest_qpn` behind LID `dlid`.
fn connect(qp: &QueuePair, dest_qpn: u32, dlid: u16) {
    qp.modify(&init_attr(), INIT_MASK).expect("to INIT");
    qp.modify(&rtr_attr(dest_qpn, dlid), RTR_MASK)
        .expect("to RTR");
    qp.modify(&rts_attr(), RTS_MASK).expect("to RTS");
    assert_eq!(state_of(qp), QpState::Rts);
}

// ---------------------------------------------------------------------------
// Application memory.
// ---------------------------------------------------------------------------

/// Page-aligned application memory from `posix_memalign`, freed on drop.
///
/// Sizes here are large (≥ 1 MiB) so that glibc serves them with a private
/// mmap: the pages `reg_mr` moves onto a memfd then hold nothing but this
/// buffer, and `free` unmaps them instead of recycling them into a heap.
#[derive(Debug)]
struct AlignedBuf {
    ptr: *mut u8,
    len: usize,
}

impl AlignedBuf {
    fn new(len: usize, fill: &[u8]) -> Self {
        assert_eq!(fill.len(), len);
        let mut p: *mut libc::c_void = std::ptr::null_mut();
        // SAFETY: `p` is a valid out-pointer; the alignment is a power of
        // two and a multiple of the pointer size.
        let rc = unsafe { libc::posix_memalign(&mut p, PAGE, len) };
        assert_eq!(rc, 0, "posix_memalign");
        let buf = Self { ptr: p.cast(), len };
        buf.write(0, fill);
        buf
    }

    fn read(&self, offset: usize, len: usize) -> Vec<u8> {
        read_app(self.ptr, self.len, offset, len)
    }

    fn write(&self, offset: usize, data: &[u8]) {
        write_app(self.ptr, self.len, offset, data);
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: allocated by posix_memalign in `new`, freed exactly once;
        // every MR over it was deregistered before (the tests drop MRs first).
        unsafe { libc::free(self.ptr.cast()) };
    }
}

/// Copies `len` bytes at `offset` out of application memory `[base, base + cap)`.
fn read_app(base: *const u8, cap: usize, offset: usize, len: usize) -> Vec<u8> {
    assert!(offset + len <= cap);
    let mut out = vec![0u8; len];
    // SAFETY: the range is inside the live allocation `[base, base + cap)`;
    // nothing writes it concurrently (the tests are single-threaded per device).
    unsafe { std::ptr::copy_nonoverlapping(base.add(offset), out.as_mut_ptr(), len) };
    out
}

/// Copies `data` into application memory `[base, base + cap)` at `offset`.
fn write_app(base: *mut u8, cap: usize, offset: usize, data: &[u8]) {
    assert!(offset + data.len() <= cap);
    // SAFETY: the range is inside the live allocation `[base, base + cap)`,
    // and the source is a distinct Rust slice.
    unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), base.add(offset), data.len()) };
}

fn mr_bytes(mr: &MemoryRegion, offset: usize, len: usize) -> Vec<u8> {
    let mut out = vec![0u8; len];
    mr.read(offset, &mut out).expect("MemoryRegion::read");
    out
}

// ---------------------------------------------------------------------------
// DeviceView: the real transport, plus what the device was told.
// ---------------------------------------------------------------------------

#[derive(Debug)]
struct SharedRegion {
    addr: u64,
    size: u64,
    /// A duplicate of the fd vdev received.
    file: File,
}

#[derive(Debug, Default)]
struct Seen {
    live: Vec<SharedRegion>,
    added: Vec<(u64, u64)>,
    removed: Vec<(u64, u64)>,
    queues: Vec<QueueSetup>,
    notified: Vec<u16>,
}

/// The process-mode vhost-user transport, recording every memory region
/// (with a duplicate of its fd) and queue it gives the device, so a test
/// can map guest memory exactly as vdev does.
#[derive(Debug)]
struct DeviceView {
    inner: VhostUserTransport,
    seen: Mutex<Seen>,
}

impl DeviceView {
    fn open(socket: &Path) -> (Arc<Self>, Context) {
        let view = Arc::new(Self {
            inner: VhostUserTransport::connect(socket).expect("connect to vdev"),
            seen: Mutex::default(),
        });
        let ctx = Context::open(Box::new(Arc::clone(&view)), DeviceOptions::default())
            .expect("open the device");
        (view, ctx)
    }

    fn seen(&self) -> MutexGuard<'_, Seen> {
        self.seen.lock().expect("not poisoned")
    }

    /// Guest memory as vdev maps it: every live region, by its fd.
    fn memory(&self) -> GuestMemoryMmap {
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
    fn regions_over(&self, addr: u64, len: u64) -> Vec<(u64, u64)> {
        self.seen()
            .live
            .iter()
            .filter(|r| r.addr < addr + len && addr < r.addr + r.size)
            .map(|r| (r.addr, r.size))
            .collect()
    }

    fn take_notified(&self) -> Vec<u16> {
        std::mem::take(&mut self.seen().notified)
    }

    /// The payload of the last control command the driver made available,
    /// read from the control queue as the device reads it: the newest avail
    /// entry, its first (device-readable) descriptor, the request there.
    fn last_request<T: FromBytes>(&self, opcode: Opcode) -> T {
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
        assert_eq!(header.opcode.get(), u16::from(opcode), "last command");
        assert_eq!(header.payload_len.get() as usize, payload.len());
        T::read_from_bytes(payload).expect("payload of the opcode's size")
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

fn read_u32(mem: &GuestMemoryMmap, addr: u64) -> u32 {
    u32::from_le(mem.read_obj(GuestAddress(addr)).expect("read u32"))
}

fn write_u32(mem: &GuestMemoryMmap, addr: u64, value: u32) {
    mem.write_obj(value.to_le(), GuestAddress(addr))
        .expect("write u32");
}

fn read_at<T: FromBytes>(mem: &GuestMemoryMmap, addr: u64) -> T {
    let mut bytes = vec![0u8; std::mem::size_of::<T>()];
    mem.read_slice(&mut bytes, GuestAddress(addr))
        .expect("read");
    T::read_from_bytes(&bytes).expect("size")
}

fn read_vec(mem: &GuestMemoryMmap, addr: u64, len: usize) -> Vec<u8> {
    let mut bytes = vec![0u8; len];
    mem.read_slice(&mut bytes, GuestAddress(addr))
        .expect("read");
    bytes
}

fn assert_no_revocation(vdev: &Vdev) {
    let log = vdev.log();
    assert!(
        !log.contains("shadows are revoked"),
        "memory was removed under a live MR:\n{log}"
    );
}

// ---------------------------------------------------------------------------
// Device, port and GID.
// ---------------------------------------------------------------------------

#[test]
fn queries_match_the_config_space() {
    let vdev = Vdev::start("pm-query", &["--lid", "9", "--comp-vectors", "2"]);
    let ctx = Context::open_vhost_user(&vdev.socket).expect("open");
    let config: DeviceConfig = *ctx.config();
    assert_eq!(config.name(), Some("vrdma_9"));
    assert_eq!(ctx.num_comp_vectors(), 2);
    assert_eq!(config.num_comp_vectors.get(), 2);

    let dev = ctx.query_device().expect("query_device");
    assert_eq!(dev, config.device, "QUERY_DEVICE is the config space's");
    let guid = 0x7672_0000_0000_0000 | 9;
    assert_eq!(dev.node_guid.get(), guid);
    assert_eq!(dev.sys_image_guid.get(), guid);
    assert_eq!(dev.fw_ver.get(), 1 << 32);
    assert_eq!(
        (dev.vendor_id.get(), dev.vendor_part_id.get()),
        (0x1af4, 0x106a)
    );
    assert_eq!(dev.hw_ver.get(), 1);
    assert_eq!(dev.page_size_cap.get(), 0xffff_f000);
    assert_eq!(
        dev.device_cap_flags.get(),
        device_cap::CURR_QP_STATE_MOD
            | device_cap::PORT_ACTIVE_EVENT
            | device_cap::SYS_IMAGE_GUID
            | device_cap::RC_RNR_NAK_GEN
    );
    assert_eq!(dev.atomic_cap.get(), atomic_cap::HCA);
    assert_eq!(
        (
            dev.max_srq.get(),
            dev.max_srq_wr.get(),
            dev.max_srq_sge.get()
        ),
        (0, 0, 0)
    );
    assert_eq!((dev.max_pkeys.get(), dev.phys_port_cnt), (1, 1));
    // No config file: the default tenant limits.
    let l = Limits::default();
    assert_eq!(dev.max_qp.get(), l.max_qp);
    assert_eq!(dev.max_qp_wr.get(), l.max_qp_depth);
    assert_eq!(dev.max_sge.get(), l.max_sge);
    assert_eq!(dev.max_cq.get(), l.max_cq);
    assert_eq!(dev.max_cqe.get(), l.max_cq_depth);
    assert_eq!(dev.max_mr.get(), l.max_mr);
    assert_eq!(dev.max_pd.get(), l.max_pd);
    assert_eq!(dev.max_qp_rd_atom.get(), l.max_rd_atomic);
    assert_eq!(dev.max_qp_init_rd_atom.get(), l.max_rd_atomic);
    assert_eq!(dev.max_inline_data.get(), l.max_inline_data);
    assert_eq!(dev.max_mr_size.get(), l.max_mr_bytes);
    assert_eq!(dev.max_total_mr_bytes.get(), l.max_total_mr_bytes);

    let port = ctx.query_port(1).expect("query_port");
    assert_eq!(port, config.port);
    assert_eq!(port.state, u8::from(PortState::Active));
    assert_eq!(port.lid.get(), 9);
    assert_eq!(port.max_mtu, u8::from(Mtu::Mtu4096));
    assert_eq!(port.active_mtu, u8::from(Mtu::Mtu4096));
    assert_eq!(port.link_layer, u8::from(LinkLayer::Infiniband));
    assert_eq!(port.gid_tbl_len.get(), 1);
    assert_eq!(port.pkey_tbl_len.get(), 1);
    assert_eq!(port.max_msg_sz.get(), 1 << 31);
    assert_eq!(port.phys_state, 5, "LinkUp");

    let gid = ctx.query_gid(1, 0).expect("query_gid");
    assert_eq!(gid.gid, config.gid);
    assert_eq!(gid.gid[..8], [0xfe, 0x80, 0, 0, 0, 0, 0, 0]);
    assert_eq!(gid.gid[8..], guid.to_be_bytes());
    assert_eq!(gid.gid_type.get(), 0, "IB");

    for bad_port in [0, 2, 255] {
        assert_eq!(
            device_errno(ctx.query_port(bad_port)),
            EINVAL,
            "port {bad_port}"
        );
        assert_eq!(device_errno(ctx.query_gid(bad_port, 0)), EINVAL);
    }
    assert_eq!(device_errno(ctx.query_gid(1, 1)), EINVAL, "GID index 1");
    // Refusals leave the device serving.
    assert_eq!(ctx.query_port(1).expect("still serving"), port);
}

// ---------------------------------------------------------------------------
// Protection domains.
// ---------------------------------------------------------------------------

#[test]
fn protection_domains_and_what_keeps_them_busy() {
    let vdev = Vdev::start("pm-pd", &[]);
    let ctx = Context::open_vhost_user(&vdev.socket).expect("open");
    let a = ctx.alloc_pd().expect("alloc_pd");
    let b = ctx.alloc_pd().expect("alloc_pd");
    assert_ne!(a.pdn(), 0);
    assert_ne!(a.pdn(), b.pdn());
    destroyed(b.destroy());

    // A PD with an MR is busy; the refused PD is handed back, still usable.
    let mr = a.alloc_mr(PAGE, RW).expect("alloc_mr");
    let (a, errno) = refused_destroy(a.destroy());
    assert_eq!(errno, EBUSY, "PD with an MR");
    let mr2 = a.alloc_mr(PAGE, 0).expect("the handed-back PD still works");
    destroyed(mr2.dereg());
    destroyed(mr.dereg());

    // A PD with a QP (and no MR) is busy too.
    let cq = ctx.create_cq(16, 0).expect("create_cq");
    let qp = create_qp(&a, &cq, caps(4, 4, 1, 0)).expect("create_qp");
    let (a, errno) = refused_destroy(a.destroy());
    assert_eq!(errno, EBUSY, "PD with a QP");
    destroyed(qp.destroy());
    destroyed(a.destroy());
    destroyed(cq.destroy());
    // Double dealloc cannot be expressed: `destroy` consumes the PD. The
    // device's EINVAL for an unknown PD is covered in vdev_as_vmm.rs.
}

// ---------------------------------------------------------------------------
// Memory regions.
// ---------------------------------------------------------------------------

#[test]
fn driver_memory_regions_and_their_access_rules() {
    let vdev = Vdev::start("pm-mr", &[]);
    let ctx = Context::open_vhost_user(&vdev.socket).expect("open");
    let pd = ctx.alloc_pd().expect("alloc_pd");

    let mr = pd.alloc_mr(3 * PAGE, RW).expect("alloc_mr");
    assert_eq!(mr.len(), 3 * PAGE);
    assert_eq!(mr.as_ptr() as usize % PAGE, 0, "page-aligned");
    assert_eq!(mr.iova(), mr.as_ptr() as u64);
    assert_ne!(mr.lkey(), 0);
    assert_ne!(mr.rkey(), 0);
    assert_ne!(mr.lkey(), mr.rkey());
    assert_eq!(mr_bytes(&mr, 0, 64), vec![0; 64], "zeroed");
    let data = pattern(5000, 7);
    mr.write(1000, &data).expect("write");
    assert_eq!(mr_bytes(&mr, 1000, data.len()), data);
    assert_eq!(
        mr.sge(16, 100),
        Sge {
            addr: mr.iova() + 16,
            length: 100,
            lkey: mr.lkey()
        }
    );
    assert_eq!(driver_errno(mr.read(3 * PAGE - 1, &mut [0; 2])), EINVAL);
    assert_eq!(driver_errno(mr.write(3 * PAGE, &[1])), EINVAL);
    assert_eq!(driver_errno(pd.alloc_mr(0, RW)), EINVAL);

    // Access flags the device refuses.
    let refused = [
        (
            access::REMOTE_WRITE,
            EINVAL,
            "REMOTE_WRITE without LOCAL_WRITE",
        ),
        (
            access::REMOTE_ATOMIC | access::REMOTE_READ,
            EINVAL,
            "REMOTE_ATOMIC without LOCAL_WRITE",
        ),
        (1 << 9, EINVAL, "unknown access bit"),
        (access::LOCAL_WRITE | access::MW_BIND, EOPNOTSUPP, "MW_BIND"),
        (access::ZERO_BASED, EOPNOTSUPP, "ZERO_BASED"),
        (access::ON_DEMAND, EOPNOTSUPP, "ON_DEMAND"),
    ];
    for (flags, errno, what) in refused {
        assert_eq!(device_errno(pd.alloc_mr(PAGE, flags)), errno, "{what}");
    }
    // Accepted: every supported flag, and the hints.
    let all = access::LOCAL_WRITE
        | access::REMOTE_WRITE
        | access::REMOTE_READ
        | access::REMOTE_ATOMIC
        | access::HUGETLB
        | access::RELAXED_ORDERING;
    let mut mrs = vec![pd.alloc_mr(PAGE, all).expect("all supported flags")];
    for flags in [0, access::LOCAL_WRITE, access::REMOTE_READ] {
        mrs.push(pd.alloc_mr(PAGE, flags).expect("alloc_mr"));
    }
    mrs.push(mr);
    // Every key of the device is distinct.
    let mut keys: Vec<u32> = mrs.iter().flat_map(|m| [m.lkey(), m.rkey()]).collect();
    keys.sort_unstable();
    keys.dedup();
    assert_eq!(keys.len(), 2 * mrs.len(), "keys are unique");
    for mr in mrs {
        destroyed(mr.dereg());
    }
    destroyed(pd.destroy());
}

#[test]
fn reg_mr_shares_page_aligned_application_memory_in_place() {
    let vdev = Vdev::start("pm-regmr", &[]);
    let (view, ctx) = DeviceView::open(&vdev.socket);
    let pd = ctx.alloc_pd().expect("alloc_pd");
    let len = 1 << 20;
    let data = pattern(len, 1);
    let buf = AlignedBuf::new(len, &data);
    assert_eq!(buf.ptr as usize % PAGE, 0);
    let addr = buf.ptr as u64;
    assert!(view.regions_over(addr, len as u64).is_empty());

    // SAFETY: `buf` is this test's mapped allocation; no other thread uses
    // it; the MR is deregistered before `buf` is freed.
    let mr = unsafe { pd.reg_mr(buf.ptr, len, RW) }.expect("reg_mr");
    assert_eq!((mr.as_ptr(), mr.len(), mr.iova()), (buf.ptr, len, addr));
    assert_ne!(mr.lkey(), mr.rkey());
    // Exactly the buffer's pages were handed to the device.
    assert_eq!(
        view.regions_over(addr, len as u64),
        vec![(addr, len as u64)]
    );
    // The application's pointer still reads what it had ...
    assert_eq!(buf.read(0, len), data);
    assert_eq!(mr_bytes(&mr, 0, len), data);
    // ... and so does the device, through the fd it was given.
    let mem = view.memory();
    assert_eq!(read_vec(&mem, addr, len), data);
    // Application writes reach MemoryRegion::read and the device ...
    buf.write(4095, b"written by the application");
    assert_eq!(mr_bytes(&mr, 4095, 26), b"written by the application");
    assert_eq!(
        read_vec(&mem, addr + 4095, 26),
        b"written by the application"
    );
    // ... and device writes (what an RDMA WRITE will do) reach the application.
    mem.write_slice(
        b"written by the device",
        GuestAddress(addr + len as u64 - 21),
    )
    .expect("device write");
    assert_eq!(buf.read(len - 21, 21), b"written by the device");

    destroyed(mr.dereg());
    assert_eq!(view.seen().removed, vec![(addr, len as u64)]);
    assert!(view.regions_over(addr, len as u64).is_empty());
    // The memory stays the application's, contents and all.
    assert_eq!(buf.read(4095, 26), b"written by the application");
    buf.write(0, b"still writable");
    assert_eq!(buf.read(0, 14), b"still writable");
    drop(buf);
    destroyed(pd.destroy());
    assert_no_revocation(&vdev);
}

#[test]
fn reg_mr_shares_an_unaligned_vec_in_place() {
    let vdev = Vdev::start("pm-regvec", &[]);
    let (view, ctx) = DeviceView::open(&vdev.socket);
    let pd = ctx.alloc_pd().expect("alloc_pd");
    let mut vec = pattern((1 << 20) + 333, 2);
    let expected = vec.clone();
    // glibc puts a 16-byte header before an mmap-served allocation.
    let skip = if vec.as_ptr() as usize & (PAGE - 1) == 0 {
        100
    } else {
        0
    };
    let ptr = vec[skip..].as_mut_ptr();
    let len = vec.len() - skip;
    let addr = ptr as u64;
    assert_ne!(
        addr as usize % PAGE,
        0,
        "the buffer must not be page-aligned"
    );

    // SAFETY: `vec` is this test's live allocation, not used by any other
    // thread; the MR is deregistered before `vec` is dropped.
    let mr = unsafe { pd.reg_mr(ptr, len, RW) }.expect("reg_mr of a Vec");
    assert_eq!((mr.as_ptr(), mr.len(), mr.iova()), (ptr, len, addr));
    // The whole pages covering the range are shared.
    let first = addr & !(PAGE as u64 - 1);
    let end = (addr + len as u64).next_multiple_of(PAGE as u64);
    assert_eq!(
        view.regions_over(addr, len as u64),
        vec![(first, end - first)]
    );
    assert_eq!(read_app(vec.as_ptr(), vec.len(), 0, vec.len()), expected);
    assert_eq!(mr_bytes(&mr, 0, len), expected[skip..]);
    let mem = view.memory();
    assert_eq!(read_vec(&mem, addr, len), expected[skip..]);

    write_app(ptr, len, 10, b"vec write");
    assert_eq!(mr_bytes(&mr, 10, 9), b"vec write");
    assert_eq!(read_vec(&mem, addr + 10, 9), b"vec write");
    mem.write_slice(b"device", GuestAddress(addr + 500))
        .expect("device write");
    assert_eq!(read_app(ptr, len, 500, 6), b"device");

    destroyed(mr.dereg());
    assert!(view.regions_over(addr, len as u64).is_empty());
    // The Vec is intact and still the application's.
    let now = read_app(vec.as_ptr(), vec.len(), 0, vec.len());
    assert_eq!(now[skip + 10..skip + 19], *b"vec write");
    assert_eq!(now[skip + 500..skip + 506], *b"device");
    assert_eq!(now[skip + 506..], expected[skip + 506..]);
    vec[skip + 1] = 0xee;
    assert_eq!(vec[skip + 1], 0xee);
    drop(vec);
    destroyed(pd.destroy());
    assert_no_revocation(&vdev);
}

#[test]
fn overlapping_registrations_share_memory_until_the_last_goes() {
    let vdev = Vdev::start("pm-overlap", &[]);
    let (view, ctx) = DeviceView::open(&vdev.socket);
    let pd = ctx.alloc_pd().expect("alloc_pd");
    let len = 1 << 20;
    let data = pattern(len, 3);
    let buf = AlignedBuf::new(len, &data);
    let addr = buf.ptr as u64;
    let page = PAGE as u64;

    // SAFETY: inside `buf`, which outlives the MRs and which no other
    // thread touches (the same holds for the two registrations below).
    let middle = unsafe { pd.reg_mr(buf.ptr.add(PAGE), 2 * PAGE, RW) }.expect("middle");
    // SAFETY: as above.
    let whole = unsafe { pd.reg_mr(buf.ptr, len, access::LOCAL_WRITE) }.expect("whole");
    // SAFETY: as above.
    let again = unsafe { pd.reg_mr(buf.ptr.add(PAGE + 7), 100, 0) }.expect("same pages");
    let keys: std::collections::HashSet<u32> = [&middle, &whole, &again]
        .iter()
        .flat_map(|m| [m.lkey(), m.rkey()])
        .collect();
    assert_eq!(keys.len(), 6);
    // The whole buffer is covered by: the first page, the shared middle,
    // and the rest — one region each, no page twice.
    let mut regions = view.regions_over(addr, len as u64);
    regions.sort_unstable();
    assert_eq!(
        regions,
        vec![
            (addr, page),
            (addr + page, 2 * page),
            (addr + 3 * page, len as u64 - 3 * page)
        ]
    );
    assert_eq!(buf.read(0, len), data);

    destroyed(middle.dereg());
    destroyed(again.dereg());
    assert!(
        view.seen().removed.is_empty(),
        "the middle pages still belong to `whole`"
    );
    buf.write(PAGE + 1, b"shared");
    assert_eq!(mr_bytes(&whole, PAGE + 1, 6), b"shared");
    assert_eq!(read_vec(&view.memory(), addr + page + 1, 6), b"shared");

    destroyed(whole.dereg());
    assert_eq!(view.seen().removed.len(), 3);
    assert!(view.regions_over(addr, len as u64).is_empty());

    // Registering driver memory again (another access mode) adds no region.
    let dma = pd.alloc_mr(2 * PAGE, RW).expect("alloc_mr");
    let added = view.seen().added.len();
    // SAFETY: the range is the live MR `dma`'s driver memory.
    let alias = unsafe { pd.reg_mr(dma.as_ptr(), 2 * PAGE, access::REMOTE_READ | RW) }
        .expect("reg_mr of driver memory");
    assert_eq!(view.seen().added.len(), added);
    dma.write(0, b"alias").expect("write");
    assert_eq!(mr_bytes(&alias, 0, 5), b"alias");
    destroyed(alias.dereg());
    destroyed(dma.dereg());
    drop(buf);
    destroyed(pd.destroy());
    assert_no_revocation(&vdev);
}

#[test]
fn refused_registrations_leave_application_memory_alone() {
    let vdev = Vdev::start("pm-regmr-bad", &[]);
    let (view, ctx) = DeviceView::open(&vdev.socket);
    let pd = ctx.alloc_pd().expect("alloc_pd");
    let len = 1 << 20;
    let data = pattern(len, 4);
    let buf = AlignedBuf::new(len, &data);
    let refused = [
        (
            access::REMOTE_WRITE,
            EINVAL,
            "REMOTE_WRITE without LOCAL_WRITE",
        ),
        (access::LOCAL_WRITE | access::MW_BIND, EOPNOTSUPP, "MW_BIND"),
    ];
    for (flags, errno, what) in refused {
        // SAFETY: `buf` is this test's allocation and outlives the call.
        let result = unsafe { pd.reg_mr(buf.ptr, len, flags) };
        assert_eq!(device_errno(result), errno, "{what}");
        // What was shared for the attempt was taken back.
        assert!(view.regions_over(buf.ptr as u64, len as u64).is_empty());
        assert_eq!(buf.read(0, len), data, "{what}: contents intact");
    }
    let (added, removed) = {
        let seen = view.seen();
        (seen.added.len(), seen.removed.len())
    };
    // SAFETY: zero length and null pointers are refused before any access.
    let zero = unsafe { pd.reg_mr(buf.ptr, 0, RW) };
    assert_eq!(driver_errno(zero), EINVAL);
    // SAFETY: as above.
    let null = unsafe { pd.reg_mr(std::ptr::null_mut(), PAGE, RW) };
    assert_eq!(driver_errno(null), EINVAL);
    let seen = view.seen();
    assert_eq!((seen.added.len(), seen.removed.len()), (added, removed));
    drop(seen);
    buf.write(0, b"ok");
    assert_eq!(buf.read(0, 2), b"ok");
    destroyed(pd.destroy());
}

// ---------------------------------------------------------------------------
// Completion queues.
// ---------------------------------------------------------------------------

#[test]
fn completion_queues_and_what_keeps_them_busy() {
    let vdev = Vdev::start("pm-cq", &[]);
    let ctx = Context::open_vhost_user(&vdev.socket).expect("open");
    let cq = ctx.create_cq(100, 0).expect("create_cq");
    assert_eq!(cq.depth(), 128, "rounded up to a power of two");
    assert_eq!(cq.comp_vector(), 0);
    assert_ne!(cq.cqn(), 0);
    let mut wc = [WorkCompletion::default(); 8];
    assert_eq!(cq.poll(&mut wc).expect("poll"), 0, "empty CQ");
    cq.req_notify(false);
    assert_eq!(cq.poll(&mut wc).expect("poll"), 0);
    assert_eq!(
        ctx.get_event(0, Some(Duration::from_millis(20)))
            .expect("get_event"),
        None
    );
    assert_eq!(driver_errno(ctx.get_event(1, Some(Duration::ZERO))), EINVAL);

    assert_eq!(
        device_errno(ctx.create_cq(4097, 0)),
        EINVAL,
        "above max_cqe"
    );
    assert_eq!(device_errno(ctx.create_cq(16, 1)), EINVAL, "no vector 1");
    assert_eq!(driver_errno(ctx.create_cq(u32::MAX, 0)), EINVAL);
    let big = ctx.create_cq(4096, 0).expect("max_cqe itself");
    assert_eq!(big.depth(), 4096);
    destroyed(big.destroy());

    // A CQ a QP uses, as send or receive CQ, is busy.
    let pd = ctx.alloc_pd().expect("alloc_pd");
    let other = ctx.create_cq(16, 0).expect("create_cq");
    let qp = pd
        .create_qp(&QpInitAttr {
            send_cq: &cq,
            recv_cq: &other,
            cap: caps(4, 4, 1, 0),
            qp_type: QpType::Rc,
            sq_sig_all: true,
        })
        .expect("create_qp");
    assert_eq!(qp.cq_nums(), (cq.cqn(), other.cqn()));
    let (cq, errno) = refused_destroy(cq.destroy());
    assert_eq!(errno, EBUSY, "send CQ in use");
    let (other, errno) = refused_destroy(other.destroy());
    assert_eq!(errno, EBUSY, "receive CQ in use");
    assert_eq!(cq.poll(&mut wc).expect("handed back, still polls"), 0);
    destroyed(qp.destroy());
    destroyed(cq.destroy());
    destroyed(other.destroy());
    destroyed(pd.destroy());
}

// ---------------------------------------------------------------------------
// Queue pairs.
// ---------------------------------------------------------------------------

#[test]
fn queue_pair_creation_grants_and_refusals() {
    let vdev = Vdev::start("pm-qp-create", &[]);
    let ctx = Context::open_vhost_user(&vdev.socket).expect("open");
    let pd = ctx.alloc_pd().expect("alloc_pd");
    let cq = ctx.create_cq(64, 0).expect("create_cq");

    let qp = create_qp(&pd, &cq, caps(100, 10, 3, 40)).expect("create_qp");
    let qpn = qp.qp_num();
    assert!(
        qpn > 1 && qpn <= 0xff_ffff,
        "24-bit QPN, not 0 or 1: {qpn:#x}"
    );
    // The grant is what the rings the spec computes hold.
    let sq = ring::sq_geometry(100, 3, 40).expect("geometry");
    let rq = ring::rq_geometry(10, 3).expect("geometry");
    let granted = qp.cap();
    assert_eq!(granted.max_send_wr, sq.depth);
    assert_eq!(granted.max_recv_wr, rq.depth);
    assert_eq!(granted.max_send_sge, (sq.stride - 64) / 16);
    assert_eq!(granted.max_recv_sge, (rq.stride - 16) / 16);
    assert_eq!(granted.max_inline_data, sq.stride - 64);
    assert_eq!(
        (
            granted.max_send_wr,
            granted.max_recv_wr,
            granted.max_send_sge
        ),
        (128, 16, 4)
    );

    // A new QP: RESET, creation attributes, defaults.
    let q = qp.query(0).expect("query_qp");
    assert_eq!(q.attr.qp_state, u8::from(QpState::Reset));
    assert_eq!(q.attr.path_mtu, u8::from(Mtu::Mtu4096));
    assert_eq!(q.attr.port_num, 1);
    assert_eq!(QpCapabilities::from(q.attr.cap), granted);
    assert_eq!((q.send_cqn.get(), q.recv_cqn.get()), (cq.cqn(), cq.cqn()));
    assert_eq!(q.srqn.get(), NO_SRQ);
    assert_eq!(q.qp_type, u8::from(QpType::Rc));
    assert_eq!(q.sq_sig_all, 0);
    assert_eq!(q.attr.dest_qp_num.get(), 0);

    let second = pd
        .create_qp(&QpInitAttr {
            send_cq: &cq,
            recv_cq: &cq,
            cap: caps(1, 0, 1, 0),
            qp_type: QpType::Rc,
            sq_sig_all: true,
        })
        .expect("a QP without receive WRs");
    assert_ne!(second.qp_num(), qpn);
    assert_eq!(second.query(0).expect("query").sq_sig_all, 1);
    assert_eq!(second.cap().max_recv_wr, 1, "a receive ring always exists");

    let with = |qp_type, cap| {
        pd.create_qp(&QpInitAttr {
            send_cq: &cq,
            recv_cq: &cq,
            cap,
            qp_type,
            sq_sig_all: false,
        })
    };
    let ok = caps(4, 4, 1, 0);
    assert_eq!(device_errno(with(QpType::Uc, ok)), EOPNOTSUPP, "UC");
    assert_eq!(device_errno(with(QpType::Ud, ok)), EOPNOTSUPP, "UD");
    assert_eq!(
        device_errno(with(QpType::Rc, caps(0, 0, 1, 0))),
        EINVAL,
        "no queue"
    );
    assert_eq!(
        device_errno(with(QpType::Rc, caps(4097, 4, 1, 0))),
        EINVAL,
        "depth"
    );
    assert_eq!(
        device_errno(with(QpType::Rc, caps(4, 4, 17, 0))),
        EINVAL,
        "max_sge"
    );
    assert_eq!(
        device_errno(with(QpType::Rc, caps(4, 4, 1, 257))),
        EINVAL,
        "inline"
    );
    assert_eq!(
        driver_errno(with(QpType::Rc, caps(u32::MAX, 4, 1, 0))),
        EINVAL
    );

    destroyed(second.destroy());
    destroyed(qp.destroy());
    destroyed(cq.destroy());
    destroyed(pd.destroy());
}

#[test]
fn queue_pair_walks_the_rc_state_machine() {
    let vdev = Vdev::start("pm-qp-states", &["--lid", "5"]);
    let ctx = Context::open_vhost_user(&vdev.socket).expect("open");
    let pd = ctx.alloc_pd().expect("alloc_pd");
    let cq = ctx.create_cq(16, 0).expect("create_cq");
    let qp = create_qp(&pd, &cq, caps(16, 16, 1, 32)).expect("create_qp");
    let granted = qp.cap();
    let refuse = |attr: &QpAttr, mask: u32| device_errno(qp.modify(attr, mask));

    // RESET: no transition to RTR; a refused modify changes nothing.
    assert_eq!(state_of(&qp), QpState::Reset);
    assert_eq!(refuse(&rtr_attr(0x42, 7), RTR_MASK), EINVAL, "RESET->RTR");
    assert_eq!(
        refuse(&init_attr(), mask::STATE | mask::PORT),
        EINVAL,
        "missing attrs"
    );
    assert_eq!(state_of(&qp), QpState::Reset);

    // RESET -> INIT, with value checks first.
    let bad_port = QpAttr {
        port_num: 2,
        ..init_attr()
    };
    assert_eq!(refuse(&bad_port, INIT_MASK), EINVAL, "port 2");
    let bad_access = QpAttr {
        qp_access_flags: access::LOCAL_WRITE.into(),
        ..init_attr()
    };
    assert_eq!(
        refuse(&bad_access, INIT_MASK),
        EINVAL,
        "LOCAL_WRITE is no QP access"
    );
    let bad_pkey = QpAttr {
        pkey_index: 1.into(),
        ..init_attr()
    };
    assert_eq!(refuse(&bad_pkey, INIT_MASK), EINVAL, "pkey_index 1");
    assert_eq!(state_of(&qp), QpState::Reset);
    qp.modify(&init_attr(), INIT_MASK).expect("RESET->INIT");
    let q = qp.query(0).expect("query");
    assert_eq!(q.attr.qp_state, u8::from(QpState::Init));
    assert_eq!(
        q.attr.qp_access_flags.get(),
        access::REMOTE_WRITE | access::REMOTE_READ
    );
    // INIT -> INIT changes an optional attribute.
    let remote_read = QpAttr {
        qp_access_flags: access::REMOTE_READ.into(),
        ..QpAttr::default()
    };
    qp.modify(&remote_read, mask::ACCESS_FLAGS)
        .expect("INIT->INIT");
    assert_eq!(
        qp.query(0).expect("query").attr.qp_access_flags.get(),
        access::REMOTE_READ
    );

    // INIT -> RTR: a bad attribute is refused and leaves INIT as it was.
    let before = qp.query(0).expect("query");
    let peer = 0xab_cdef;
    for (attr, what) in [
        (
            QpAttr {
                path_mtu: 6,
                ..rtr_attr(peer, 7)
            },
            "path_mtu above the port's",
        ),
        (
            QpAttr {
                path_mtu: 0,
                ..rtr_attr(peer, 7)
            },
            "path_mtu 0",
        ),
        (rtr_attr(0x100_0000, 7), "dest_qp_num wider than 24 bits"),
        (rtr_attr(peer, 0xc000), "multicast dlid"),
        (rtr_attr(peer, 0), "dlid 0"),
        (
            QpAttr {
                rq_psn: 0x100_0000.into(),
                ..rtr_attr(peer, 7)
            },
            "rq_psn wider than 24 bits",
        ),
        (
            QpAttr {
                min_rnr_timer: 32,
                ..rtr_attr(peer, 7)
            },
            "min_rnr_timer 32",
        ),
        (
            QpAttr {
                max_dest_rd_atomic: 17,
                ..rtr_attr(peer, 7)
            },
            "max_dest_rd_atomic above max_qp_rd_atom",
        ),
    ] {
        assert_eq!(refuse(&attr, RTR_MASK), EINVAL, "{what}");
        assert_eq!(
            qp.query(0).expect("query"),
            before,
            "{what}: nothing changed"
        );
    }
    assert_eq!(
        refuse(&rtr_attr(peer, 7), RTR_MASK | mask::ALT_PATH),
        EOPNOTSUPP,
        "alternate paths"
    );
    assert_eq!(
        refuse(&rtr_attr(peer, 7), RTR_MASK | mask::QKEY),
        EINVAL,
        "QKEY is not an RC attribute"
    );
    let wrong_cur = QpAttr {
        cur_qp_state: QpState::Rts.into(),
        ..rtr_attr(peer, 7)
    };
    assert_eq!(
        refuse(&wrong_cur, RTR_MASK | mask::CUR_STATE),
        EINVAL,
        "cur_qp_state"
    );
    assert_eq!(
        refuse(&to_state(QpState::Rts), mask::STATE),
        EINVAL,
        "INIT->RTS"
    );
    assert_eq!(state_of(&qp), QpState::Init);
    qp.modify(&rtr_attr(peer, 7), RTR_MASK).expect("INIT->RTR");
    let q = qp.query(0).expect("query");
    assert_eq!(q.attr.qp_state, u8::from(QpState::Rtr));
    assert_eq!(q.attr.dest_qp_num.get(), peer);
    assert_eq!(q.attr.rq_psn.get(), 0x1234);
    assert_eq!(q.attr.path_mtu, u8::from(Mtu::Mtu1024));
    assert_eq!(q.attr.ah_attr, rtr_attr(peer, 7).ah_attr);
    assert_eq!(q.attr.max_dest_rd_atomic, 4);
    assert_eq!(q.attr.min_rnr_timer, 12);
    assert_eq!(refuse(&rtr_attr(peer, 7), RTR_MASK), EINVAL, "RTR->RTR");

    // RTR -> RTS.
    let bad_retry = QpAttr {
        retry_cnt: 8,
        ..rts_attr()
    };
    assert_eq!(refuse(&bad_retry, RTS_MASK), EINVAL, "retry_cnt 8");
    assert_eq!(refuse(&rts_attr(), RTS_MASK | mask::DEST_QPN), EINVAL);
    assert_eq!(state_of(&qp), QpState::Rtr);
    qp.modify(&rts_attr(), RTS_MASK).expect("RTR->RTS");
    let q = qp.query(0).expect("query");
    assert_eq!(q.attr.qp_state, u8::from(QpState::Rts));
    assert_eq!(q.attr.sq_psn.get(), 0x5678);
    assert_eq!(
        (q.attr.timeout, q.attr.retry_cnt, q.attr.rnr_retry),
        (14, 7, 6)
    );
    assert_eq!(q.attr.max_rd_atomic, 2);
    assert_eq!(q.attr.dest_qp_num.get(), peer, "RTR attributes kept");
    // RTS -> RTS with an optional attribute, guarded by the current state.
    let rnr = QpAttr {
        min_rnr_timer: 20,
        cur_qp_state: QpState::Rts.into(),
        ..QpAttr::default()
    };
    qp.modify(&rnr, mask::MIN_RNR_TIMER | mask::CUR_STATE)
        .expect("RTS->RTS");
    assert_eq!(qp.query(0).expect("query").attr.min_rnr_timer, 20);

    // RTS -> SQD -> RTS -> ERR.
    qp.modify(&to_state(QpState::Sqd), mask::STATE)
        .expect("RTS->SQD");
    assert_eq!(state_of(&qp), QpState::Sqd);
    qp.modify(&to_state(QpState::Rts), mask::STATE)
        .expect("SQD->RTS");
    assert_eq!(state_of(&qp), QpState::Rts);
    assert_eq!(
        refuse(&to_state(QpState::Sqe), mask::STATE),
        EINVAL,
        "to SQE"
    );
    assert_eq!(
        refuse(
            &QpAttr {
                qp_state: 7,
                ..QpAttr::default()
            },
            mask::STATE
        ),
        EINVAL,
        "no state 7"
    );
    qp.modify(&to_state(QpState::Err), mask::STATE)
        .expect("RTS->ERR");
    assert_eq!(state_of(&qp), QpState::Err);
    assert_eq!(refuse(&rts_attr(), RTS_MASK), EINVAL, "ERR->RTS");
    assert_eq!(state_of(&qp), QpState::Err);

    // ERR -> RESET forgets every attribute.
    qp.modify(&to_state(QpState::Reset), mask::STATE)
        .expect("ERR->RESET");
    let q = qp.query(0).expect("query");
    assert_eq!(q.attr.qp_state, u8::from(QpState::Reset));
    assert_eq!(
        q.attr,
        QpAttr {
            qp_state: QpState::Reset.into(),
            cur_qp_state: QpState::Reset.into(),
            path_mtu: Mtu::Mtu4096.into(),
            port_num: 1,
            cap: granted.into(),
            ..QpAttr::default()
        },
        "a RESET QP looks new"
    );
    // And it can be connected again.
    connect(&qp, peer, 7);
    destroyed(qp.destroy());
    destroyed(cq.destroy());
    destroyed(pd.destroy());
}

// ---------------------------------------------------------------------------
// Data-path rings (no device-side consumer yet).
// ---------------------------------------------------------------------------

#[test]
fn posting_writes_wqes_into_the_rings_the_device_was_given() {
    let vdev = Vdev::start("pm-post", &[]);
    let (view, ctx) = DeviceView::open(&vdev.socket);
    let pd = ctx.alloc_pd().expect("alloc_pd");
    let mr = pd.alloc_mr(PAGE, RW).expect("alloc_mr");
    let cq = ctx.create_cq(16, 0).expect("create_cq");
    let qp = create_qp(&pd, &cq, caps(8, 4, 2, 48)).expect("create_qp");
    // The rings are where CREATE_QP told the device they are.
    let req: CreateQpReq = view.last_request(Opcode::CreateQp);
    assert_eq!(req.pdn.get(), pd.pdn());
    assert_eq!(
        (req.send_cqn.get(), req.recv_cqn.get()),
        (cq.cqn(), cq.cqn())
    );
    assert_eq!(req.cap.max_send_wr.get(), 8);
    let (sq, rq) = (req.sq_ring_addr.get(), req.rq_ring_addr.get());
    let sq_stride = ring::sq_geometry(8, 2, 48).expect("geometry").stride as u64;
    let rq_stride = ring::rq_geometry(4, 2).expect("geometry").stride as u64;
    let granted = qp.cap();
    assert_eq!(
        (
            granted.max_send_wr,
            granted.max_send_sge,
            granted.max_inline_data
        ),
        (8, 4, 64)
    );
    assert_eq!((granted.max_recv_wr, granted.max_recv_sge), (4, 3));
    let mem = view.memory();
    let slot = |ring: u64, stride: u64, index: u64| ring + RING_HEADER_SIZE as u64 + index * stride;
    assert_eq!(read_u32(&mem, sq + DRIVER_INDEX_OFFSET), 0);
    assert_eq!(read_vec(&mem, sq + DEVICE_INDEX_OFFSET, 64), vec![0; 64]);
    view.take_notified();

    // One SGE send and one inline RDMA WRITE.
    let sges = [mr.sge(0, 100), mr.sge(256, 8)];
    let mut send = SendWr::new(0x1111, SendOpcode::Send, SendPayload::Sges(&sges));
    send.flags = send_flags::SIGNALED;
    let mut write = SendWr::new(
        0x2222,
        SendOpcode::RdmaWriteWithImm,
        SendPayload::Inline(b"hello, inline world"),
    );
    write.remote_addr = 0xdead_0000;
    write.rkey = 0x1234_5678;
    write.imm_data = [9, 8, 7, 6];
    qp.post_send(&[send, write]).expect("post_send");
    assert_eq!(
        read_u32(&mem, sq + DRIVER_INDEX_OFFSET),
        2,
        "producer published"
    );
    let wqe: SendWqe = read_at(&mem, slot(sq, sq_stride, 0));
    assert_eq!(wqe.wr_id.get(), 0x1111);
    assert_eq!(wqe.opcode, u8::from(SendOpcode::Send));
    assert_eq!(wqe.flags, send_flags::SIGNALED);
    assert_eq!((wqe.num_sge, wqe.inline_len.get()), (2, 0));
    for (i, sge) in sges.iter().enumerate() {
        let wire: ring::Sge = read_at(&mem, slot(sq, sq_stride, 0) + 64 + (i * SGE_SIZE) as u64);
        assert_eq!(
            (wire.addr.get(), wire.length.get(), wire.lkey.get()),
            (sge.addr, sge.length, mr.lkey())
        );
    }
    let wqe: SendWqe = read_at(&mem, slot(sq, sq_stride, 1));
    assert_eq!(wqe.wr_id.get(), 0x2222);
    assert_eq!(wqe.opcode, u8::from(SendOpcode::RdmaWriteWithImm));
    assert_eq!(wqe.flags, send_flags::INLINE);
    assert_eq!((wqe.num_sge, wqe.inline_len.get()), (0, 19));
    assert_eq!(
        (wqe.remote_addr.get(), wqe.rkey.get()),
        (0xdead_0000, 0x1234_5678)
    );
    assert_eq!(wqe.imm_data, [9, 8, 7, 6]);
    assert_eq!(
        read_vec(&mem, slot(sq, sq_stride, 1) + 64, 19),
        b"hello, inline world"
    );
    assert!(
        !view.take_notified().contains(&DOORBELL_QUEUE),
        "no doorbell while the device polls"
    );

    // The device goes to sleep (NEED_KICK): the next post rings the doorbell.
    write_u32(&mem, sq + DEVICE_FLAGS_OFFSET, DEVICE_FLAG_NEED_KICK);
    let atomic = SendWr {
        remote_addr: 0x1000,
        rkey: 5,
        compare_add: 1,
        swap: 2,
        ..SendWr::new(
            0x3333,
            SendOpcode::AtomicCmpAndSwp,
            SendPayload::Sges(&sges[..1]),
        )
    };
    qp.post_send(&[atomic]).expect("post_send");
    assert_eq!(view.take_notified(), vec![DOORBELL_QUEUE]);
    let wqe: SendWqe = read_at(&mem, slot(sq, sq_stride, 2));
    assert_eq!((wqe.compare_add.get(), wqe.swap.get()), (1, 2));
    write_u32(&mem, sq + DEVICE_FLAGS_OFFSET, 0);

    // Past the granted max_send_wr: ENOMEM at the first WR that does not fit;
    // those before it are posted and published.
    let inline = |id| SendWr::new(id, SendOpcode::Send, SendPayload::Inline(b"x"));
    let batch: Vec<_> = (10..16).map(inline).collect();
    let (bad_wr, errno, full) = post_failure(qp.post_send(&batch));
    assert_eq!((bad_wr, errno, full), (5, ENOMEM, true));
    assert_eq!(read_u32(&mem, sq + DRIVER_INDEX_OFFSET), 8);
    assert_eq!(post_failure(qp.post_send(&[inline(99)])), (0, ENOMEM, true));
    assert_eq!(read_u32(&mem, sq + DRIVER_INDEX_OFFSET), 8);
    // The device consumes three: three slots free up, the ring wraps.
    write_u32(&mem, sq + DEVICE_INDEX_OFFSET, 3);
    let batch: Vec<_> = (20..24).map(inline).collect();
    assert_eq!(post_failure(qp.post_send(&batch)), (3, ENOMEM, true));
    assert_eq!(read_u32(&mem, sq + DRIVER_INDEX_OFFSET), 11);
    let wrapped: SendWqe = read_at(&mem, slot(sq, sq_stride, 0));
    assert_eq!(wrapped.wr_id.get(), 20, "index 8 is slot 0 again");
    let wrapped: SendWqe = read_at(&mem, slot(sq, sq_stride, 2));
    assert_eq!(wrapped.wr_id.get(), 22);

    // Work requests the driver refuses (EINVAL) with the ring not full.
    write_u32(&mem, sq + DEVICE_INDEX_OFFSET, 11);
    let five = [mr.sge(0, 1); 5];
    let too_many = SendWr::new(1, SendOpcode::Send, SendPayload::Sges(&five));
    assert_eq!(post_failure(qp.post_send(&[too_many])), (0, EINVAL, false));
    let long = [0u8; 65];
    let too_long = SendWr::new(2, SendOpcode::Send, SendPayload::Inline(&long));
    assert_eq!(post_failure(qp.post_send(&[too_long])), (0, EINVAL, false));
    let read_inline = SendWr::new(3, SendOpcode::RdmaRead, SendPayload::Inline(b"no"));
    assert_eq!(
        post_failure(qp.post_send(&[read_inline])),
        (0, EINVAL, false)
    );
    assert_eq!(
        read_u32(&mem, sq + DRIVER_INDEX_OFFSET),
        11,
        "nothing posted"
    );
    assert_eq!(
        post_failure(qp.post_send(&[inline(30), too_many, inline(31)])),
        (1, EINVAL, false)
    );
    assert_eq!(
        read_u32(&mem, sq + DRIVER_INDEX_OFFSET),
        12,
        "the first was"
    );
    qp.post_send(&[]).expect("posting nothing");
    assert_eq!(read_u32(&mem, sq + DRIVER_INDEX_OFFSET), 12);

    // The receive ring.
    let rsges = [mr.sge(512, 64), mr.sge(1024, 32)];
    qp.post_recv(&[RecvWr {
        wr_id: 0x4444,
        sg_list: &rsges,
    }])
    .expect("post_recv");
    assert_eq!(read_u32(&mem, rq + DRIVER_INDEX_OFFSET), 1);
    let rwqe: RecvWqe = read_at(&mem, slot(rq, rq_stride, 0));
    assert_eq!((rwqe.wr_id.get(), rwqe.num_sge), (0x4444, 2));
    let wire: ring::Sge = read_at(&mem, slot(rq, rq_stride, 0) + 16 + SGE_SIZE as u64);
    assert_eq!(
        (wire.addr.get(), wire.length.get(), wire.lkey.get()),
        (mr.iova() + 1024, 32, mr.lkey())
    );
    let recv = |wr_id| RecvWr {
        wr_id,
        sg_list: &rsges[..1],
    };
    assert_eq!(
        post_failure(qp.post_recv(&[recv(1), recv(2), recv(3), recv(4)])),
        (3, ENOMEM, true)
    );
    assert_eq!(read_u32(&mem, rq + DRIVER_INDEX_OFFSET), 4);
    write_u32(&mem, rq + DEVICE_INDEX_OFFSET, 4);
    let four = [mr.sge(0, 1); 4];
    let wide = RecvWr {
        wr_id: 5,
        sg_list: &four,
    };
    assert_eq!(post_failure(qp.post_recv(&[wide])), (0, EINVAL, false));

    // The device flags a ring in error.
    assert!(!qp.rings_in_error());
    write_u32(&mem, rq + DEVICE_FLAGS_OFFSET, DEVICE_FLAG_ERROR);
    assert!(qp.rings_in_error());
    write_u32(&mem, rq + DEVICE_FLAGS_OFFSET, 0);
    assert!(!qp.rings_in_error());

    destroyed(qp.destroy());
    destroyed(cq.destroy());
    destroyed(mr.dereg());
    destroyed(pd.destroy());
}

#[test]
fn polling_reads_the_cqes_the_device_writes() {
    let vdev = Vdev::start("pm-poll", &[]);
    let (view, ctx) = DeviceView::open(&vdev.socket);
    let cq = ctx.create_cq(4, 0).expect("create_cq");
    let req: CreateCqReq = view.last_request(Opcode::CreateCq);
    assert_eq!((req.depth.get(), req.comp_vector.get()), (4, 0));
    let ring_addr = req.ring_addr.get();
    let mem = view.memory();
    let mut wc = [WorkCompletion::default(); 8];
    assert_eq!(cq.poll(&mut wc).expect("poll"), 0, "empty CQ");

    // Play the device: three CQEs, then the producer index.
    let put = |index: u64, cqe: Cqe| {
        let addr = ring_addr + RING_HEADER_SIZE as u64 + (index % 4) * CQE_SIZE as u64;
        mem.write_slice(cqe.as_bytes(), GuestAddress(addr))
            .expect("write CQE");
    };
    put(
        0,
        Cqe {
            wr_id: 0x77.into(),
            status: WcStatus::Success.into(),
            opcode: WcOpcode::RecvRdmaWithImm.into(),
            wc_flags: wc_flags::WITH_IMM,
            byte_len: 42.into(),
            imm_data: [1, 2, 3, 4],
            qp_num: 0x123.into(),
            src_qp: 0x456.into(),
            ..Cqe::default()
        },
    );
    put(
        1,
        Cqe {
            wr_id: 0x78.into(),
            status: WcStatus::WrFlushErr.into(),
            opcode: 0xee,
            vendor_err: 0x99.into(),
            imm_data: [5, 5, 5, 5],
            ..Cqe::default()
        },
    );
    put(
        2,
        Cqe {
            wr_id: 0x79.into(),
            status: 200,
            opcode: WcOpcode::Send.into(),
            ..Cqe::default()
        },
    );
    write_u32(&mem, ring_addr + DEVICE_INDEX_OFFSET, 3);

    assert_eq!(cq.poll(&mut wc[..1]).expect("poll"), 1);
    assert_eq!(
        wc[0],
        WorkCompletion {
            wr_id: 0x77,
            status: WcStatus::Success,
            opcode: Some(WcOpcode::RecvRdmaWithImm),
            vendor_err: 0,
            byte_len: 42,
            imm_data: Some([1, 2, 3, 4]),
            qp_num: 0x123,
            src_qp: 0x456,
            wc_flags: wc_flags::WITH_IMM,
        }
    );
    assert_eq!(
        read_u32(&mem, ring_addr + DRIVER_INDEX_OFFSET),
        1,
        "consumer"
    );
    assert_eq!(cq.poll(&mut wc).expect("poll"), 2);
    assert_eq!((wc[0].wr_id, wc[0].status), (0x78, WcStatus::WrFlushErr));
    assert_eq!((wc[0].opcode, wc[0].vendor_err), (None, 0x99));
    assert_eq!(wc[0].imm_data, None, "no WITH_IMM flag, no immediate");
    assert_eq!((wc[1].wr_id, wc[1].status), (0x79, WcStatus::GeneralErr));
    assert_eq!(read_u32(&mem, ring_addr + DRIVER_INDEX_OFFSET), 3);
    assert_eq!(cq.poll(&mut wc).expect("poll"), 0);

    // Four more: the ring wraps.
    for i in 3..7 {
        put(
            i,
            Cqe {
                wr_id: (0x100 + i).into(),
                opcode: WcOpcode::RdmaWrite.into(),
                ..Cqe::default()
            },
        );
    }
    write_u32(&mem, ring_addr + DEVICE_INDEX_OFFSET, 7);
    assert_eq!(cq.poll(&mut wc).expect("poll"), 4);
    let ids: Vec<u64> = wc[..4].iter().map(|w| w.wr_id).collect();
    assert_eq!(ids, vec![0x103, 0x104, 0x105, 0x106]);

    // Arming writes (sn << 8) | kind on the driver line.
    cq.req_notify(false);
    let arm = read_u32(&mem, ring_addr + DRIVER_ARM_OFFSET);
    assert_eq!(arm & 0xff, CQ_ARM_NEXT);
    let sn = arm >> 8;
    assert_ne!(sn, 0);
    cq.req_notify(true);
    let arm = read_u32(&mem, ring_addr + DRIVER_ARM_OFFSET);
    assert_eq!((arm & 0xff, arm >> 8), (CQ_ARM_SOLICITED, sn + 1));

    // A producer more than a ring ahead is a device bug the driver reports.
    write_u32(&mem, ring_addr + DEVICE_INDEX_OFFSET, 7 + 5);
    let err = cq.poll(&mut wc).expect_err("producer too far ahead");
    assert!(matches!(err, Error::Protocol(_)), "{err:?}");
    assert_eq!(err.errno(), libc::EPROTO);
    destroyed(cq.destroy());
}

// ---------------------------------------------------------------------------
// Limits from a vdev config file.
// ---------------------------------------------------------------------------

const LIMITS_TOML: &str = "\
lid = 7
comp_vectors = 2

[limits]
max_pd = 2
max_qp = 2
max_cq = 3
max_mr = 3
max_cq_depth = 256
max_qp_depth = 64
max_sge = 4
max_inline_data = 128
max_rd_atomic = 4
max_mr_bytes = 65536
max_total_mr_bytes = 131072
";

#[test]
fn limits_from_the_config_file_are_advertised_and_enforced() {
    let vdev = Vdev::start_with_config("pm-limits", LIMITS_TOML, &[]);
    let ctx = Context::open_vhost_user(&vdev.socket).expect("open");
    assert_eq!(ctx.config().name(), Some("vrdma_7"), "lid from the file");
    assert_eq!(ctx.num_comp_vectors(), 2);
    let dev = ctx.query_device().expect("query_device");
    assert_eq!(
        (
            dev.max_pd.get(),
            dev.max_qp.get(),
            dev.max_cq.get(),
            dev.max_mr.get()
        ),
        (2, 2, 3, 3)
    );
    assert_eq!((dev.max_cqe.get(), dev.max_qp_wr.get()), (256, 64));
    assert_eq!((dev.max_sge.get(), dev.max_inline_data.get()), (4, 128));
    assert_eq!(
        (dev.max_qp_rd_atom.get(), dev.max_qp_init_rd_atom.get()),
        (4, 4)
    );
    assert_eq!(
        (dev.max_mr_size.get(), dev.max_total_mr_bytes.get()),
        (65536, 131072)
    );

    // QPs: the third fails with ENOMEM; freeing one makes room.
    let pd = ctx.alloc_pd().expect("alloc_pd");
    let cq = ctx.create_cq(256, 1).expect("max_cqe on vector 1");
    let a = create_qp(&pd, &cq, caps(64, 64, 4, 128)).expect("QP 1 at every limit");
    let b = create_qp(&pd, &cq, caps(4, 4, 1, 0)).expect("QP 2");
    assert_eq!(
        device_errno(create_qp(&pd, &cq, caps(4, 4, 1, 0))),
        ENOMEM,
        "QP 3"
    );
    destroyed(a.destroy());
    let c = create_qp(&pd, &cq, caps(4, 4, 1, 0)).expect("room again");
    assert_ne!(c.qp_num(), b.qp_num());
    assert_eq!(device_errno(create_qp(&pd, &cq, caps(4, 4, 1, 0))), ENOMEM);
    destroyed(b.destroy());
    // Per-QP limits.
    for (cap, what) in [
        (caps(65, 4, 1, 0), "max_send_wr above max_qp_depth"),
        (caps(4, 65, 1, 0), "max_recv_wr above max_qp_depth"),
        (caps(4, 4, 5, 0), "max_sge"),
        (caps(4, 4, 1, 129), "max_inline_data"),
    ] {
        assert_eq!(device_errno(create_qp(&pd, &cq, cap)), EINVAL, "{what}");
    }
    let rd_atomic = QpAttr {
        max_dest_rd_atomic: 5,
        ..rtr_attr(0x42, 1)
    };
    c.modify(&init_attr(), INIT_MASK).expect("INIT");
    assert_eq!(
        device_errno(c.modify(&rd_atomic, RTR_MASK)),
        EINVAL,
        "max_rd_atomic"
    );
    let at_limit = QpAttr {
        max_dest_rd_atomic: 4,
        ..rtr_attr(0x42, 1)
    };
    c.modify(&at_limit, RTR_MASK).expect("at max_rd_atomic");
    destroyed(c.destroy());

    // CQs: 3 at most, 256 entries at most, vectors 0 and 1.
    assert_eq!(device_errno(ctx.create_cq(257, 0)), EINVAL, "max_cqe");
    assert_eq!(device_errno(ctx.create_cq(16, 2)), EINVAL, "vector 2");
    let cq2 = ctx.create_cq(16, 0).expect("CQ 2");
    let cq3 = ctx.create_cq(16, 0).expect("CQ 3");
    assert_eq!(device_errno(ctx.create_cq(16, 0)), ENOMEM, "CQ 4");
    destroyed(cq3.destroy());
    let cq3 = ctx.create_cq(16, 0).expect("room again");

    // MRs: bytes of one, bytes of all, and the count.
    assert_eq!(device_errno(pd.alloc_mr(65537, 0)), ENOMEM, "max_mr_bytes");
    let m1 = pd.alloc_mr(65536, RW).expect("max_mr_bytes itself");
    let m2 = pd.alloc_mr(65536, 0).expect("up to the total");
    assert_eq!(
        device_errno(pd.alloc_mr(PAGE, 0)),
        ENOMEM,
        "max_total_mr_bytes"
    );
    destroyed(m2.dereg());
    let m2 = pd.alloc_mr(PAGE, 0).expect("MR 2");
    let m3 = pd.alloc_mr(PAGE, 0).expect("MR 3");
    assert_eq!(device_errno(pd.alloc_mr(PAGE, 0)), ENOMEM, "MR 4");
    destroyed(m1.dereg());
    let m1 = pd.alloc_mr(PAGE, 0).expect("room again");

    // PDs: a PD dropped while its MRs live is deallocated with the last one.
    let pd2 = ctx.alloc_pd().expect("PD 2");
    assert_eq!(device_errno(ctx.alloc_pd()), ENOMEM, "PD 3");
    drop(pd);
    assert_eq!(
        device_errno(ctx.alloc_pd()),
        ENOMEM,
        "the dropped PD waits for its MRs"
    );
    drop((m1, m2));
    assert_eq!(device_errno(ctx.alloc_pd()), ENOMEM);
    drop(m3);
    let pd3 = ctx.alloc_pd().expect("the last MR took the PD with it");
    destroyed(pd3.destroy());
    destroyed(pd2.destroy());
    for cq in [cq, cq2, cq3] {
        destroyed(cq.destroy());
    }
}

// ---------------------------------------------------------------------------
// Applications and devices.
// ---------------------------------------------------------------------------

const ONE_OF_EACH: &str = "[limits]\nmax_pd = 1\nmax_qp = 1\nmax_cq = 1\nmax_mr = 1\n";

/// What an application makes: one PD, MR, CQ and connected QP. Returns the
/// handles, in creation order.
fn one_of_each(ctx: &Context) -> (ProtectionDomain, MemoryRegion, CompletionQueue, QueuePair) {
    let pd = ctx.alloc_pd().expect("alloc_pd");
    let mr = pd.alloc_mr(PAGE, RW).expect("alloc_mr");
    let cq = ctx.create_cq(16, 0).expect("create_cq");
    let qp = create_qp(&pd, &cq, caps(4, 4, 1, 0)).expect("create_qp");
    connect(&qp, 0x42, 1);
    (pd, mr, cq, qp)
}

#[test]
fn applications_one_after_another_each_get_a_fresh_device() {
    let vdev = Vdev::start_with_config("pm-sequential", ONE_OF_EACH, &[]);
    let first = {
        let ctx = Context::open_vhost_user(&vdev.socket).expect("first application");
        let (pd, mr, cq, qp) = one_of_each(&ctx);
        let handles = (pd.pdn(), cq.cqn());
        assert_eq!(device_errno(ctx.alloc_pd()), ENOMEM, "max_pd = 1");
        drop((qp, mr, cq, pd));
        handles
    };
    // Handles come from a per-device counter starting at 1: a new device
    // numbers its objects like the old one did, and has room for them.
    let ctx = Context::open_vhost_user(&vdev.socket).expect("second application");
    let (pd, mr, cq, qp) = one_of_each(&ctx);
    assert_eq!((pd.pdn(), cq.cqn()), first);
    assert_eq!(state_of(&qp), QpState::Rts);
    drop((qp, mr, cq, pd));
    let mut vdev = vdev;
    assert!(vdev.is_running(), "vdev serves again:\n{}", vdev.log());
}

/// vdev serves one application at a time: the next one waits (up to
/// `DEFAULT_BUSY_TIMEOUT`) until the one before has closed the device, and
/// one that waits no longer gets EBUSY.
#[test]
fn a_second_application_waits_until_the_first_closes_the_device() {
    let vdev = Vdev::start_with_config("pm-queued", ONE_OF_EACH, &[]);
    let first = Context::open_vhost_user(&vdev.socket).expect("first application");
    let objects = one_of_each(&first);
    let started = std::time::Instant::now();
    let impatient = VhostUserTransport::connect_within(&vdev.socket, Duration::from_millis(300))
        .map(|_| ())
        .map_err(Error::from);
    let waited = started.elapsed();
    match impatient {
        Err(e) => assert_eq!(e.errno(), libc::EBUSY, "{e}"),
        Ok(()) => panic!("a second application got the device while the first holds it"),
    }
    assert!(
        (Duration::from_millis(300)..Duration::from_secs(5)).contains(&waited),
        "gave up after {waited:?}"
    );
    let (tx, rx) = std::sync::mpsc::channel();
    let socket = vdev.socket.clone();
    let second = std::thread::spawn(move || {
        let ctx = Context::open_vhost_user(&socket).expect("second application");
        tx.send(()).expect("report");
        let (pd, mr, cq, qp) = one_of_each(&ctx);
        let pdn = pd.pdn();
        drop((qp, mr, cq, pd));
        pdn
    });
    // vdev serves one frontend at a time: the second waits in the backlog.
    assert!(
        rx.recv_timeout(Duration::from_millis(300)).is_err(),
        "the second application got the device while the first holds it"
    );
    assert_eq!(
        state_of(&objects.3),
        QpState::Rts,
        "the first is undisturbed"
    );
    drop(objects);
    drop(first);
    rx.recv_timeout(Duration::from_secs(10))
        .expect("the second application opens the device once the first is gone");
    assert_eq!(
        second.join().expect("second application"),
        1,
        "a fresh device"
    );
}

const CHILD_SOCKET: &str = "VRDMA_TEST_CHILD_SOCKET";

/// Run as a separate process by
/// `an_application_that_exits_without_cleaning_up_leaves_nothing_behind`:
/// makes objects and exits without destroying any.
#[test]
#[ignore = "helper process of another test"]
fn child_application_exits_without_cleaning_up() {
    // Run on its own (`--ignored`), it has no device to open: a failure,
    // not a pass, since it ran nothing.
    let socket = std::env::var_os(CHILD_SOCKET).expect(
        "VRDMA_TEST_CHILD_SOCKET: this helper runs only as the child of \
         an_application_that_exits_without_cleaning_up_leaves_nothing_behind",
    );
    let ctx = Context::open_vhost_user(&socket).expect("child: open");
    let objects = one_of_each(&ctx);
    println!(
        "child made pd={} qpn={}",
        objects.0.pdn(),
        objects.3.qp_num()
    );
    // Like a crash: no destructor runs, the socket closes with the process.
    std::process::exit(0);
}

#[test]
fn an_application_that_exits_without_cleaning_up_leaves_nothing_behind() {
    let vdev = Vdev::start_with_config("pm-crash", ONE_OF_EACH, &[]);
    let out = Command::new(std::env::current_exe().expect("test binary"))
        .args([
            "--exact",
            "child_application_exits_without_cleaning_up",
            "--ignored",
            "--nocapture",
        ])
        .env(CHILD_SOCKET, &vdev.socket)
        .output()
        .expect("run the child application");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "child failed: {stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("child made pd=1"), "{stdout}");
    // Every limit is 1, and the child left one of each behind: only a fresh
    // device lets this application make its own.
    let ctx = Context::open_vhost_user(&vdev.socket).expect("next application");
    let (pd, mr, cq, qp) = one_of_each(&ctx);
    assert_eq!(pd.pdn(), 1);
    drop((qp, mr, cq, pd));
    // vdev said what the child left behind when it released it.
    let log = vdev.log();
    assert!(
        log.contains("Released all verbs objects") && log.contains("pds=1 mrs=1 cqs=1 qps=1"),
        "{log}"
    );
}

#[test]
fn two_applications_on_two_devices_at_once() {
    let vdev_a = Vdev::start_with_config("pm-two-a", "[limits]\nmax_pd = 1\n", &["--lid", "3"]);
    let vdev_b = Vdev::start("pm-two-b", &["--lid", "4", "--comp-vectors", "2"]);
    let a = Context::open_vhost_user(&vdev_a.socket).expect("open A");
    let b = Context::open_vhost_user(&vdev_b.socket).expect("open B");
    assert_eq!(a.config().name(), Some("vrdma_3"));
    assert_eq!(b.config().name(), Some("vrdma_4"));
    assert_eq!((a.num_comp_vectors(), b.num_comp_vectors()), (1, 2));
    let (gid_a, gid_b) = (
        a.query_gid(1, 0).expect("gid A").gid,
        b.query_gid(1, 0).expect("gid B").gid,
    );
    assert_ne!(gid_a, gid_b);
    assert_eq!(a.query_port(1).expect("port A").lid.get(), 3);
    assert_eq!(b.query_port(1).expect("port B").lid.get(), 4);

    // Each device has its own objects and limits.
    let pd_a = a.alloc_pd().expect("PD on A");
    let pd_b = b.alloc_pd().expect("PD on B");
    assert_eq!((pd_a.pdn(), pd_b.pdn()), (1, 1), "separate handle spaces");
    assert_eq!(device_errno(a.alloc_pd()), ENOMEM, "A's max_pd = 1");
    let pd_b2 = b.alloc_pd().expect("B has room");
    let cq_a = a.create_cq(16, 0).expect("CQ on A");
    let cq_b = b.create_cq(16, 1).expect("CQ on B, vector 1");
    assert_eq!(device_errno(a.create_cq(16, 1)), EINVAL, "A has one vector");
    let qp_a = create_qp(&pd_a, &cq_a, caps(8, 8, 1, 16)).expect("QP on A");
    let qp_b = create_qp(&pd_b, &cq_b, caps(8, 8, 1, 16)).expect("QP on B");
    // Connected to each other, as two applications exchanging QPN and LID.
    connect(&qp_a, qp_b.qp_num(), 4);
    connect(&qp_b, qp_a.qp_num(), 3);
    let qa = qp_a.query(0).expect("query A");
    let qb = qp_b.query(0).expect("query B");
    assert_eq!(
        (qa.attr.dest_qp_num.get(), qa.attr.ah_attr.dlid.get()),
        (qp_b.qp_num(), 4)
    );
    assert_eq!(
        (qb.attr.dest_qp_num.get(), qb.attr.ah_attr.dlid.get()),
        (qp_a.qp_num(), 3)
    );

    // Both devices serve concurrently.
    std::thread::scope(|s| {
        for (ctx, lid) in [(&a, 3u16), (&b, 4u16)] {
            s.spawn(move || {
                for _ in 0..50 {
                    assert_eq!(ctx.query_port(1).expect("query_port").lid.get(), lid);
                    let cq = ctx.create_cq(8, 0).expect("create_cq");
                    destroyed(cq.destroy());
                }
            });
        }
    });

    // Closing A leaves B untouched.
    drop((qp_a, cq_a, pd_a, a));
    assert_eq!(state_of(&qp_b), QpState::Rts);
    destroyed(pd_b2.destroy());
    destroyed(qp_b.destroy());
    destroyed(cq_b.destroy());
    destroyed(pd_b.destroy());
}

#[test]
fn posting_stops_at_the_granted_depth_not_the_ring_depth() {
    let vdev = Vdev::start_with_config("granted", "[limits]\nmax_qp_depth = 100\n", &[]);
    let ctx = Context::open_vhost_user(&vdev.socket).expect("open");
    let pd = ctx.alloc_pd().expect("pd");
    let cq = ctx.create_cq(16, 0).expect("cq");
    let qp = create_qp(&pd, &cq, caps(100, 1, 1, 0)).expect("qp");
    assert_eq!(
        qp.cap().max_send_wr,
        100,
        "grant capped by the tenant limit"
    );
    let inline = [0u8; 0];
    let wrs: Vec<SendWr<'_>> = (0..101)
        .map(|i| SendWr::new(i, SendOpcode::Send, SendPayload::Inline(&inline)))
        .collect();
    // No datapath consumes the ring (no hostd): 100 fit, the 101st does not,
    // although the ring itself has 128 slots.
    let (bad_wr, errno, _) = post_failure(qp.post_send(&wrs));
    assert_eq!((bad_wr, errno), (100, libc::ENOMEM));
}

#[test]
fn a_queue_pair_cannot_use_another_devices_cq() {
    let vdev_a = Vdev::start("cq-owner-a", &[]);
    let vdev_b = Vdev::start("cq-owner-b", &[]);
    let ctx_a = Context::open_vhost_user(&vdev_a.socket).expect("open a");
    let ctx_b = Context::open_vhost_user(&vdev_b.socket).expect("open b");
    let pd_a = ctx_a.alloc_pd().expect("pd");
    let cq_b = ctx_b.create_cq(16, 0).expect("cq on b");
    let _cq_a = ctx_a.create_cq(16, 0).expect("cq on a, same number as b's");
    assert_eq!(
        driver_errno(create_qp(&pd_a, &cq_b, caps(4, 4, 1, 0))),
        libc::EINVAL
    );
}
