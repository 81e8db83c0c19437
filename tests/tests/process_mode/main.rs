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
//!
//! The tests by topic: [`device`] (queries, PDs, driver memory, CQs),
//! [`registration`] (application memory registered in place), [`queue_pairs`]
//! (creation, grants, the RC state machine), [`rings`] (what posting and
//! polling do to the rings), [`applications`] (config-file limits, one
//! application after another, two at once).

mod applications;
mod device;
mod device_view;
mod queue_pairs;
mod registration;
mod rings;

use std::fmt::Debug;

use vrdma_guest_driver::{Context, DestroyError, Error, PostError, QpCapabilities, QueuePair};
use vrdma_spec::config::DeviceAttr;
use vrdma_spec::control::QpAttr;
use vrdma_spec::verbs::{access, Mtu, QpState};
use vrdma_tenant_policy::Limits;
use vrdma_tests::daemon::Vdev;
use vrdma_tests::tenant::{mask_to, pattern};

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

/// Checks the device advertises the tenant limits `l` (`ibv_query_device`).
#[track_caller]
fn assert_advertises(dev: &DeviceAttr, l: &Limits) {
    assert_eq!(
        (
            dev.max_pd.get(),
            dev.max_qp.get(),
            dev.max_cq.get(),
            dev.max_mr.get()
        ),
        (l.max_pd, l.max_qp, l.max_cq, l.max_mr),
        "objects"
    );
    assert_eq!(
        (
            dev.max_cqe.get(),
            dev.max_qp_wr.get(),
            dev.max_sge.get(),
            dev.max_inline_data.get(),
            dev.max_qp_rd_atom.get(),
            dev.max_qp_init_rd_atom.get()
        ),
        (
            l.max_cq_depth,
            l.max_qp_depth,
            l.max_sge,
            l.max_inline_data,
            l.max_rd_atomic,
            l.max_rd_atomic
        ),
        "queues and work requests"
    );
    assert_eq!(
        (dev.max_mr_size.get(), dev.max_total_mr_bytes.get()),
        (l.max_mr_bytes, l.max_total_mr_bytes),
        "registered memory"
    );
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

fn state_of(qp: &QueuePair) -> QpState {
    let q = qp.query(0).expect("query_qp");
    assert_eq!(q.attr.cur_qp_state, q.attr.qp_state, "cur_qp_state follows");
    QpState::try_from(q.attr.qp_state).expect("a known QP state")
}

fn init_attr() -> QpAttr {
    QpAttr {
        qp_state: QpState::Init.into(),
        port_num: 1,
        pkey_index: 0.into(),
        qp_access_flags: (access::REMOTE_WRITE | access::REMOTE_READ).into(),
        ..QpAttr::default()
    }
}

/// INIT → RTR towards QP `dest_qpn` of the standalone vdev with LID
/// `peer_lid`, named by its GID as RoCE wants (a vdev without hostd has
/// GID `::ffff:127.100.x.y`, `x.y` its LID).
fn rtr_attr(dest_qpn: u32, peer_lid: u16) -> QpAttr {
    let mut attr = QpAttr {
        qp_state: QpState::Rtr.into(),
        path_mtu: Mtu::Mtu1024.into(),
        dest_qp_num: dest_qpn.into(),
        rq_psn: 0x1234.into(),
        max_dest_rd_atomic: 4,
        min_rnr_timer: 12,
        ..QpAttr::default()
    };
    attr.ah_attr.port_num = 1;
    attr.ah_attr.sl = 3;
    attr.ah_attr.is_global = 1;
    attr.ah_attr.dgid = vrdma_spec::gid::loopback_gid(peer_lid);
    attr.ah_attr.hop_limit = 64;
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

/// RESET → INIT → RTR → RTS towards `dest_qpn` of the vdev with LID
/// `peer_lid` (by its GID).
fn connect(qp: &QueuePair, dest_qpn: u32, peer_lid: u16) {
    qp.modify(&init_attr(), mask_to(QpState::Init))
        .expect("to INIT");
    qp.modify(&rtr_attr(dest_qpn, peer_lid), mask_to(QpState::Rtr))
        .expect("to RTR");
    qp.modify(&rts_attr(), mask_to(QpState::Rts))
        .expect("to RTS");
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
    /// `len` bytes holding `pattern(len, seed)`, and those bytes.
    fn patterned(len: usize, seed: u8) -> (Self, Vec<u8>) {
        let fill = pattern(len, seed);
        let mut p: *mut libc::c_void = std::ptr::null_mut();
        // SAFETY: `p` is a valid out-pointer; the alignment is a power of
        // two and a multiple of the pointer size.
        let rc = unsafe { libc::posix_memalign(&mut p, PAGE, len) };
        assert_eq!(rc, 0, "posix_memalign");
        let buf = Self { ptr: p.cast(), len };
        buf.write(0, &fill);
        (buf, fill)
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

/// A vdev without hostd (`--tenant name`, `args`) and its device, opened
/// by the driver in process mode.
fn device(name: &str, args: &[&str]) -> (Vdev, Context) {
    let vdev = Vdev::start(name, args);
    let ctx = Context::open_vhost_user(&vdev.socket).expect("open");
    (vdev, ctx)
}

fn assert_no_revocation(vdev: &Vdev) {
    let log = vdev.log();
    assert!(
        !log.contains("shadows are revoked"),
        "memory was removed under a live MR:\n{log}"
    );
}
