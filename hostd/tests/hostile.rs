//! A compromised vdev (alpha) against hostd: every control request it can
//! bend is refused with the errno an RDMA program expects, keys it makes up
//! or takes from another tenant miss, a ring it corrupts fails only that
//! QP, and through all of it beta's memory is untouched and beta works.

mod common;

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::Ordering;

use common::*;
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};
use vrdma_hostd_protocol::messages::{
    MrRegistration, MrSegment, QpConnection, QpModify, QpSetup, Request,
};
use vrdma_hostd_protocol::shm::sealed_memfd;
use vrdma_spec::limits::MAX_QPS;
use vrdma_spec::ring::{event_kind, DRIVER_INDEX_OFFSET};
use vrdma_spec::verbs::{access, QpState, SendOpcode, WcStatus};

/// A key no region has: table index 0xffff is far past the few regions of
/// this test, and index 0 is never used.
const MADE_UP_KEYS: [u32; 2] = [0x00ff_ff5a, 0x0000_0042];

/// Registrations that do not describe alpha's memory.
fn registrations_are_checked(alpha: &Client) {
    let reg = |slot, offset, len| errno(alpha.register(ALL, IOVA, slot, offset, len));
    assert_eq!(reg(0, MEM - 8, 64), Err(libc::EINVAL), "past the slot");
    assert_eq!(reg(0, u64::MAX - 8, 64), Err(libc::EINVAL), "wraps");
    assert_eq!(reg(7, 0, 64), Err(libc::ENOENT), "no such slot");
    let lying = MrRegistration {
        pd: 1,
        access: ALL,
        iova: IOVA,
        len: 4096,
        segments: vec![MrSegment {
            slot: 0,
            offset: DATA,
            len: 64,
        }],
    };
    assert_eq!(errno(alpha.register_mr(lying)), Err(libc::EINVAL));
    let remote_only = access::REMOTE_WRITE;
    assert_eq!(
        errno(alpha.register(remote_only, IOVA, 0, DATA, 64)),
        Err(libc::EINVAL),
        "remote write without local write"
    );
}

/// Memory that is not a sealed memfd of the length claimed.
fn memory_is_checked(alpha: &Client) {
    let add_slot = |slot| Request::AddMemory {
        slot,
        gpa: 0x1000_0000,
        len: MEM,
        file_offset: 0,
    };
    let add = add_slot(5);
    let unsealed = unsealed_memfd(MEM);
    let short = sealed_memfd("short", 4096).expect("memfd");
    assert_eq!(
        errno(alpha.call_fds(&add, &[unsealed.as_raw_fd()])),
        Err(libc::EINVAL)
    );
    assert_eq!(
        errno(alpha.call_fds(&add, &[short.as_raw_fd()])),
        Err(libc::EINVAL)
    );
    assert_eq!(errno(alpha.call(&add)), Err(libc::EINVAL), "no fd");
    let again = add_slot(0);
    let file = sealed_memfd("again", MEM).expect("memfd");
    assert_eq!(
        errno(alpha.call_fds(&again, &[file.as_raw_fd()])),
        Err(libc::EEXIST),
        "slot 0 exists"
    );
}

/// QPs whose rings, CQs or doorbell bits are not alpha's to use.
fn qps_are_checked(alpha: &Client) {
    let fresh = alpha.next_qp(9);
    let create = |change: &dyn Fn(&mut QpSetup)| {
        let mut setup = fresh;
        change(&mut setup);
        errno(alpha.call(&Request::CreateQp(setup)))
    };
    assert_eq!(create(&|s| s.sq.gpa = MEM), Err(libc::EINVAL), "outside");
    assert_eq!(
        create(&|s| s.rq.gpa = MEM - 4096),
        Err(libc::EINVAL),
        "across the end"
    );
    assert_eq!(create(&|s| s.sq.gpa += 64), Err(libc::EINVAL), "misaligned");
    assert_eq!(
        create(&|s| s.send_cqn = 99),
        Err(libc::ENOENT),
        "unknown CQ"
    );
    assert_eq!(
        create(&|s| s.recv_cqn = 99),
        Err(libc::ENOENT),
        "unknown CQ"
    );
    assert_eq!(create(&|s| s.db_index = MAX_QPS), Err(libc::EINVAL));
    assert_eq!(create(&|s| s.db_index = 0), Err(libc::EINVAL), "QP 1's bit");
    assert_eq!(create(&|s| s.vqpn = QP_ALPHA), Err(libc::EEXIST));
    let cq = |cqn, gpa, depth, vector| {
        errno(alpha.call(&Request::CreateCq {
            cqn,
            gpa,
            depth,
            vector,
        }))
    };
    assert_eq!(cq(CQN, DATA, 64, 0), Err(libc::EEXIST), "CQ number taken");
    assert_eq!(cq(8, MEM - 64, 64, 0), Err(libc::EINVAL), "outside");
    assert_eq!(cq(8, DATA, 63, 0), Err(libc::EINVAL), "depth");
    assert_eq!(cq(8, DATA, 64, 256), Err(libc::EINVAL), "vector");
    // The untouched setup is fine: the refusals were for what they say.
    assert_eq!(create(&|_| {}), Ok(()));
    alpha
        .call(&Request::DestroyQp { vqpn: 9 })
        .expect("destroy");
}

/// The doorbell and event ring take one real eventfd, once.
fn notifications_are_checked(alpha: &Client) {
    let eventfd = EventFd::new(EFD_NONBLOCK).expect("eventfd");
    let memfd = sealed_memfd("not-an-eventfd", 4096).expect("memfd");
    let mut ends = [0; 2];
    // SAFETY: `ends` has room for the two descriptors pipe writes.
    assert_eq!(unsafe { libc::pipe(ends.as_mut_ptr()) }, 0);
    // SAFETY: pipe gave us these two descriptors; each is owned once.
    let pipe = ends.map(|fd| unsafe { OwnedFd::from_raw_fd(fd) });
    // SAFETY: epoll_create1 has no preconditions; the result is checked.
    let epoll = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
    assert!(epoll >= 0);
    // SAFETY: a fresh descriptor we own.
    let epoll = unsafe { OwnedFd::from_raw_fd(epoll) };
    let doorbell = Request::SetDoorbell { gpa: DATA };
    let eq = Request::CreateEq {
        vector: 1,
        gpa: DATA,
        depth: 64,
    };
    for req in [&doorbell, &eq] {
        for (fd, what) in [
            (memfd.as_raw_fd(), "a memfd"),
            (pipe[0].as_raw_fd(), "a pipe's read end"),
            (pipe[1].as_raw_fd(), "a pipe's write end"),
            (epoll.as_raw_fd(), "an epoll fd (an anonymous inode too)"),
        ] {
            let refused = errno(alpha.call_fds(req, &[fd]));
            assert_eq!(refused, Err(libc::EINVAL), "{req:?} with {what}");
        }
        assert_eq!(errno(alpha.call(req)), Err(libc::EINVAL), "no fd");
    }
    let second = errno(alpha.call_fds(&doorbell, &[eventfd.as_raw_fd()]));
    assert_eq!(second, Err(libc::EEXIST), "a second doorbell page");
    let vector0 = Request::CreateEq {
        vector: 0,
        gpa: DATA,
        depth: 64,
    };
    let second = errno(alpha.call_fds(&vector0, &[eventfd.as_raw_fd()]));
    assert_eq!(
        second,
        Err(libc::EEXIST),
        "a second event ring for vector 0"
    );
    assert_eq!(
        eventfd.read().ok(),
        None,
        "hostd never wrote the refused one"
    );
}

/// State changes out of range, for a QP alpha has.
fn modifies_are_checked(alpha: &Client, beta_gid: [u8; 16]) {
    let rtr = |change: &dyn Fn(&mut QpConnection)| {
        let mut conn = connection(beta_gid, QP_BETA);
        change(&mut conn);
        errno(alpha.modify(QP_ALPHA, QpState::Rtr, Some(conn)))
    };
    assert_eq!(rtr(&|c| c.rnr_retry = 8), Err(libc::EINVAL));
    assert_eq!(rtr(&|c| c.retry_cnt = 8), Err(libc::EINVAL));
    assert_eq!(rtr(&|c| c.min_rnr_timer = 32), Err(libc::EINVAL));
    assert_eq!(rtr(&|c| c.access = 1 << 30), Err(libc::EINVAL));
    assert_eq!(rtr(&|c| c.dest_qpn = 1 << 24), Err(libc::EINVAL));
    assert_eq!(rtr(&|c| c.timeout = 32), Err(libc::EINVAL));
    assert_eq!(rtr(&|c| c.sq_psn = 1 << 24), Err(libc::EINVAL));
    assert_eq!(rtr(&|c| c.rq_psn = 1 << 24), Err(libc::EINVAL));
    assert_eq!(rtr(&|c| c.path_mtu = 1000), Err(libc::EINVAL));
    assert_eq!(rtr(&|c| c.flow_label = 1 << 20), Err(libc::EINVAL));
    assert_eq!(rtr(&|c| c.dgid = [0; 16]), Err(libc::ENOENT), "no device");
    let state = Request::ModifyQp(QpModify {
        vqpn: QP_ALPHA,
        state: 99,
        connection: None,
        access: None,
        qkey: None,
    });
    assert_eq!(errno(alpha.call(&state)), Err(libc::EINVAL));
    assert_eq!(alpha.query_qp(QP_ALPHA), Ok(QpState::Rts), "unchanged");
}

/// Beta's objects are not alpha's; alpha's CQ in use stays.
fn objects_are_the_owners(alpha: &Client, beta: &Client) {
    let lkey = beta.lkey();
    assert_eq!(
        errno(alpha.call(&Request::DeregisterMr { lkey })),
        Err(libc::ENOENT)
    );
    assert_eq!(
        errno(alpha.call(&Request::DestroyQp { vqpn: QP_BETA })),
        Err(libc::ENOENT)
    );
    assert_eq!(
        errno(alpha.call(&Request::DestroyCq { cqn: 99 })),
        Err(libc::ENOENT)
    );
    assert_eq!(
        errno(alpha.call(&Request::DestroyCq { cqn: CQN })),
        Err(libc::EBUSY),
        "its QPs complete there"
    );
}

/// Alpha's WRITE on QP `qp` (index) from `(addr, lkey)` to `(raddr,
/// rkey)`: its status. A failed QP is moved back to RTS towards
/// `(gid, dest)` for the next try.
fn attempt(
    alpha: &mut Client,
    (qp, local, remote): (usize, (u64, u32), (u64, u32)),
    (gid, dest): ([u8; 16], u32),
) -> WcStatus {
    let wqe = common::remote(send(0xbad, SendOpcode::RdmaWrite), remote.0, remote.1);
    alpha.post_sges(qp, &wqe, &[sge(local.0, 8, local.1)]);
    let result = alpha.poll_one();
    let vqpn = alpha.driver().qps[qp].vqpn;
    if result != WcStatus::Success {
        assert_eq!(alpha.query_qp(vqpn), Ok(QpState::Err));
        alpha.reconnect(vqpn, gid, dest);
    }
    result
}

#[test]
fn hostile_client_is_contained() {
    let mut hostd = Hostd::start("hostile", &config(64));
    let (mut alpha, mut beta) = pair(&hostd.socket);
    let before_b = memory_of(&beta);
    registrations_are_checked(&alpha);
    memory_is_checked(&alpha);
    qps_are_checked(&alpha);
    notifications_are_checked(&alpha);
    objects_are_the_owners(&alpha, &beta);
    modifies_are_checked(&alpha, beta.gid);

    // Keys alpha makes up or takes from beta miss: as local keys a local
    // protection error, as remote keys a remote access error.
    let (lkey_a, rkey_a, lkey_b, rkey_b) = (alpha.lkey(), alpha.rkey(), beta.lkey(), beta.rkey());
    let to_beta = (beta.gid, QP_BETA);
    let mine = (IOVA, lkey_a);
    for lkey in [lkey_b, rkey_b, rkey_a, MADE_UP_KEYS[0], MADE_UP_KEYS[1]] {
        let result = attempt(&mut alpha, (0, (IOVA, lkey), (IOVA, rkey_b)), to_beta);
        assert_eq!(result, WcStatus::LocProtErr, "lkey {lkey:#x}");
    }
    let past_the_end = IOVA + DATA_LEN - 4;
    for (raddr, rkey) in [
        (past_the_end, rkey_b),
        (IOVA - 8, rkey_b),
        (IOVA, lkey_b),
        (IOVA, rkey_a),
        (IOVA, lkey_a),
        (IOVA, MADE_UP_KEYS[0]),
        (IOVA, MADE_UP_KEYS[1]),
    ] {
        let result = attempt(&mut alpha, (0, mine, (raddr, rkey)), to_beta);
        assert_eq!(
            result,
            WcStatus::RemAccessErr,
            "rkey {rkey:#x} at {raddr:#x}"
        );
    }
    // Beta's rkey on a QP connected to another device (a second beta
    // device, in the same network): the key is not that device's.
    let mut other = Client::ready(&hostd.socket, "beta", "vm1");
    other.create_qp(30);
    let qp31 = alpha.create_qp(31);
    alpha.connect_qp(31, other.gid, 30).expect("connect");
    other.connect_qp(30, alpha.gid, 31).expect("connect");
    let to_other = (other.gid, 30);
    let result = attempt(&mut alpha, (qp31, mine, (IOVA, rkey_b)), to_other);
    assert_eq!(result, WcStatus::RemAccessErr);
    assert_eq!(memory_of(&beta), before_b, "beta's memory untouched");
    // The responders stayed up through all of it.
    assert_eq!(beta.query_qp(QP_BETA), Ok(QpState::Rts));
    assert_eq!(other.query_qp(30), Ok(QpState::Rts));
    beta.loopback_works(0x1111);

    // Alpha corrupts a send ring: its producer index far beyond the ring.
    // That QP goes to ERR and alpha hears why on event ring 0; alpha stays
    // connected, and its other QPs work.
    let bad = alpha.loopback(33, 34);
    assert!(alpha.events().is_empty());
    let producer = alpha.driver().qps[bad].sq_producer;
    (alpha.driver_mut()).publish_send(bad, producer.wrapping_add(100_000));
    alpha.kick_if_needed();
    eventually("QP 33 fails", || alpha.query_qp(33) == Ok(QpState::Err));
    let mut events = Vec::new();
    eventually("the QP_FATAL event", || {
        events.extend(alpha.events());
        !events.is_empty()
    });
    assert_eq!(events, vec![(event_kind::QP_FATAL, 33)]);
    assert!(alpha.interrupts() >= 1, "the event interrupted alpha");
    assert!(alpha.driver().sq_error(bad), "the ring says ERR");
    assert_eq!(alpha.query_qp(34), Ok(QpState::Rts), "its peer is fine");
    // Only RESET leads out of ERR; from there the QP works again.
    let rts = errno(alpha.modify(33, QpState::Rts, None));
    assert_eq!(rts, Err(libc::EINVAL), "an errored QP does not send");
    alpha.reconnect(33, alpha.gid, 34);
    alpha.loopback_write_works(bad, 0x200, 0x5555);
    // A receive ring's producer far beyond the ring fails its QP (34) when
    // a message arrives for it; the sender finds nobody ready.
    let rq = alpha.driver().qps[bad + 1].rq;
    let producer = (alpha.driver().mem)
        .atomic_u32((rq + DRIVER_INDEX_OFFSET) as usize)
        .expect("producer");
    producer.store(100_000u32.to_le(), Ordering::Release);
    alpha.driver().ring(bad + 1);
    alpha.kick_if_needed();
    alpha.post_inline(bad, &send(0x34, SendOpcode::Send), &[]);
    assert_eq!(alpha.poll_one(), WcStatus::RetryExcErr);
    assert_eq!(alpha.query_qp(34), Ok(QpState::Err));
    assert_eq!(alpha.events(), vec![(event_kind::QP_FATAL, 34)]);
    assert_eq!(alpha.query_qp(QP_ALPHA), Ok(QpState::Rts));
    assert_eq!(
        attempt(&mut alpha, (0, mine, (IOVA + 0x40, rkey_b)), to_beta),
        WcStatus::Success
    );
    let rkey_o = other.rkey();
    let result = attempt(&mut alpha, (qp31, mine, (IOVA + 0x40, rkey_o)), to_other);
    assert_eq!(result, WcStatus::Success);
    beta.loopback_works(0x2222);
    // Beta's QP aimed at alpha works, until alpha disconnects.
    beta.write(0, 5, 0, 8, IOVA + 0x80, rkey_a);
    assert_eq!(beta.poll_one(), WcStatus::Success);
    drop(alpha);
    // A fresh alpha device (same LID) can connect once the old one is torn
    // down; it has no QP for beta's to reach.
    let mut fresh = retry(|| Client::hello(&hostd.socket, "alpha", "vm0"));
    assert!(hostd.alive());
    beta.write(0, 6, 0, 8, IOVA, rkey_a);
    assert_eq!(beta.poll_one(), WcStatus::RetryExcErr);
    beta.loopback_works(0x3333);
    fresh.setup();
    fresh.loopback_works(0x4444);
}
