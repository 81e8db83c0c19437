//! Unit tests of the verbs model, on anonymous guest memory: objects and
//! their checks here, QPs in [`qp`], the doorbell page and event rings in
//! [`notify`], what hostd is told in [`hostd`].

mod hostd;
mod infiniband;
mod journal;
mod notify;
mod qp;
mod srq;
mod ud;

use std::sync::Arc;

use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};
use vrdma_spec::control::*;
use vrdma_spec::qp_state::mask;
use vrdma_spec::ring::{self, RING_ALIGN};
use vrdma_spec::verbs::{access, Mtu, QpState};
use vrdma_spec::zerocopy::little_endian::U32;
use vrdma_spec::zerocopy::{FromBytes, IntoBytes};
use vrdma_tools::vmm;

use super::*;

const MEM_BASE: u64 = 0x10_0000;
const MEM_SIZE: usize = 4 << 20;
/// Where the tests' devices keep their doorbell page.
const DOORBELL: u64 = MEM_BASE + 0x30_0000;

fn identity() -> DeviceIdentity {
    DeviceIdentity {
        tenant: Arc::from("t1"),
        lid: 5,
        link_layer: Default::default(),
        gid: vrdma_spec::gid::loopback_gid(5),
        comp_vectors: 2,
        max_queue_size: 256,
        active_mtu: vrdma_spec::verbs::Mtu::Mtu4096,
    }
}

fn guest_memory() -> Arc<GuestMemoryMmap> {
    Arc::new(GuestMemoryMmap::from_ranges(&[(GuestAddress(MEM_BASE), MEM_SIZE)]).expect("memory"))
}

/// A device with guest memory whose driver has not given a doorbell page.
fn device_without_doorbell(limits: Limits) -> RdmaDevice {
    let mut dev = RdmaDevice::new(identity(), limits);
    dev.update_memory(guest_memory());
    dev
}

/// A device as a driver leaves it after bring-up: memory and doorbell page.
fn device_with(limits: Limits) -> RdmaDevice {
    let mut dev = device_without_doorbell(limits);
    set_doorbell(&mut dev, DOORBELL).expect("doorbell page");
    dev
}

fn device() -> RdmaDevice {
    device_with(Limits::default())
}

fn set_doorbell(dev: &mut RdmaDevice, addr: u64) -> Result<(), i32> {
    run_unit(dev, Opcode::SetDoorbell, vmm::doorbell_req(addr).as_bytes())
}

fn create_eq(dev: &mut RdmaDevice, vector: u32, depth: u32, addr: u64) -> Result<(), i32> {
    let req = vmm::eq_req(vector, depth, addr);
    run_unit(dev, Opcode::CreateEq, req.as_bytes())
}

fn run<T: FromBytes>(dev: &mut RdmaDevice, op: Opcode, req: &[u8]) -> Result<T, i32> {
    dev.execute(op, req)
        .map(|bytes| T::read_from_bytes(&bytes).expect("response size"))
        .map_err(|e| e.errno())
}

fn run_unit(dev: &mut RdmaDevice, op: Opcode, req: &[u8]) -> Result<(), i32> {
    dev.execute(op, req)
        .map(|bytes| assert!(bytes.is_empty()))
        .map_err(|e| e.errno())
}

fn alloc_pd(dev: &mut RdmaDevice) -> u32 {
    run::<PdHandle>(dev, Opcode::AllocPd, &[])
        .expect("pd")
        .pdn
        .get()
}

/// DEALLOC_PD, DEREG_MR, DESTROY_CQ or DESTROY_QP (`op`) of the object
/// numbered `handle`: each request is the number and a reserved word
/// ([`PdHandle`], [`MrHandle`], [`CqHandle`], [`QpHandle`]).
fn release(dev: &mut RdmaDevice, op: Opcode, handle: u32) -> Result<(), i32> {
    let req: [U32; 2] = [handle.into(), 0.into()];
    run_unit(dev, op, req.as_bytes())
}

/// Each `(outcome, what)` of `cases` is a refusal with `errno`.
#[track_caller]
fn assert_refused<T: std::fmt::Debug>(
    errno: i32,
    cases: impl IntoIterator<Item = (Result<T, i32>, &'static str)>,
) {
    for (outcome, what) in cases {
        assert_eq!(outcome.map(|_| ()), Err(errno), "{what}");
    }
}

fn reg_mr(
    dev: &mut RdmaDevice,
    pdn: u32,
    addr: u64,
    len: u64,
    flags: u32,
) -> Result<RegMrResp, i32> {
    run(
        dev,
        Opcode::RegMr,
        vmm::reg(pdn, addr, len, flags).as_bytes(),
    )
}

fn create_cq(dev: &mut RdmaDevice, addr: u64) -> Result<u32, i32> {
    let req = vmm::cq_req(addr, 16);
    run::<CqHandle>(dev, Opcode::CreateCq, req.as_bytes()).map(|h| h.cqn.get())
}

/// CREATE_QP (RC, 10 WRs and 2 SGEs each way, 64 inline bytes) with its
/// rings at `sq` and `rq`.
fn create_qp(
    dev: &mut RdmaDevice,
    pdn: u32,
    cqn: u32,
    sq: u64,
    rq: u64,
) -> Result<CreateQpResp, i32> {
    create_qp_asking(dev, pdn, cqn, qp_cap(10, 2, 64), sq, rq)
}

/// Capacities of `wr` WRs and `sge` SGEs each way, `inline` inline bytes.
fn qp_cap(wr: u32, sge: u32, inline: u32) -> QpCap {
    QpCap {
        max_send_wr: wr.into(),
        max_recv_wr: wr.into(),
        max_send_sge: sge.into(),
        max_recv_sge: sge.into(),
        max_inline_data: inline.into(),
    }
}

fn create_qp_asking(
    dev: &mut RdmaDevice,
    pdn: u32,
    cqn: u32,
    cap: QpCap,
    sq: u64,
    rq: u64,
) -> Result<CreateQpResp, i32> {
    let req = CreateQpReq {
        cap,
        ..vmm::qp_req(pdn, cqn, sq, rq)
    };
    run(dev, Opcode::CreateQp, req.as_bytes())
}

fn modify(dev: &mut RdmaDevice, qpn: u32, attr_mask: u32, attr: QpAttr) -> Result<(), i32> {
    let req = vmm::modify_req(qpn, attr_mask, attr);
    run_unit(dev, Opcode::ModifyQp, req.as_bytes())
}

/// MODIFY_QP to `state` and nothing else.
fn to_state(dev: &mut RdmaDevice, qpn: u32, state: QpState) -> Result<(), i32> {
    let attr = QpAttr {
        qp_state: state.into(),
        ..QpAttr::default()
    };
    modify(dev, qpn, mask::STATE, attr)
}

fn query_qp(dev: &mut RdmaDevice, qpn: u32) -> Result<QueryQpResp, i32> {
    let req = QueryQpReq {
        qpn: qpn.into(),
        attr_mask: 0.into(),
    };
    run(dev, Opcode::QueryQp, req.as_bytes())
}

fn query_state(dev: &mut RdmaDevice, qpn: u32) -> QpState {
    let resp = query_qp(dev, qpn).expect("query");
    QpState::try_from(resp.attr.qp_state).expect("state")
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

/// The GID of the tests' peer device.
const PEER_GID: [u8; 16] = vrdma_spec::gid::ipv4_mapped([10, 200, 1, 7]);

/// RESET to INIT: port 1, remote writes allowed.
fn init_attr() -> QpAttr {
    QpAttr {
        qp_state: QpState::Init.into(),
        port_num: 1,
        qp_access_flags: access::REMOTE_WRITE.into(),
        ..QpAttr::default()
    }
}

fn rtr_attr() -> QpAttr {
    let mut a = QpAttr {
        qp_state: QpState::Rtr.into(),
        path_mtu: Mtu::Mtu1024.into(),
        ..QpAttr::default()
    };
    a.dest_qp_num = 0x1234.into();
    a.rq_psn = 0x42.into();
    a.ah_attr.port_num = 1;
    a.ah_attr.is_global = 1;
    a.ah_attr.dgid = PEER_GID;
    a.ah_attr.hop_limit = 64;
    a.ah_attr.traffic_class = 0x20;
    a.ah_attr.flow_label = 0x1_2345.into();
    a.max_dest_rd_atomic = 4;
    a.min_rnr_timer = 12;
    a
}

/// RTR to RTS: a 14 (67 ms) timeout, 7 retries of each kind, one read
/// or atomic in flight.
fn rts_attr() -> QpAttr {
    QpAttr {
        qp_state: QpState::Rts.into(),
        timeout: 14,
        retry_cnt: 7,
        rnr_retry: 7,
        max_rd_atomic: 1,
        ..QpAttr::default()
    }
}

/// A PD and a CQ with its ring at the start of guest memory: (pdn, cqn).
fn pd_and_cq(dev: &mut RdmaDevice) -> (u32, u32) {
    let pdn = alloc_pd(dev);
    (pdn, create_cq(dev, MEM_BASE).expect("cq"))
}

/// A QP in RESET with its CQ, on fresh rings; returns (pdn, cqn, qpn).
fn qp_fixture(dev: &mut RdmaDevice) -> (u32, u32, u32) {
    let (pdn, cqn) = pd_and_cq(dev);
    let qp = create_qp(dev, pdn, cqn, MEM_BASE + 0x10000, MEM_BASE + 0x20000).expect("qp");
    (pdn, cqn, qp.qpn.get())
}

/// GID 0 of port 1 (QUERY_GID).
fn query_gid0(dev: &mut RdmaDevice) -> QueryGidResp {
    let req = QueryGidReq {
        port_num: 1,
        ..Default::default()
    };
    run(dev, Opcode::QueryGid, req.as_bytes()).expect("gid")
}

#[test]
fn query_verbs_report_the_configured_device() {
    let mut dev = device();
    let attr: vrdma_spec::config::DeviceAttr =
        run(&mut dev, Opcode::QueryDevice, &[]).expect("query");
    assert_eq!(attr.max_qp.get(), Limits::default().max_qp);
    assert_eq!(attr.max_qp_rd_atom.get(), Limits::default().max_rd_atomic);
    let port_req = |port_num| QueryPortReq {
        port_num,
        ..Default::default()
    };
    let port: vrdma_spec::config::PortAttr =
        run(&mut dev, Opcode::QueryPort, port_req(1).as_bytes()).expect("port");
    assert_eq!(port.state, 4, "ACTIVE");
    assert_eq!(
        port.link_layer,
        u8::from(vrdma_spec::verbs::LinkLayer::Ethernet)
    );
    assert_eq!((port.lid.get(), port.sm_lid.get()), (0, 0), "RoCE: no LIDs");
    assert_eq!(port.gid_tbl_len.get(), 1);
    let gid = query_gid0(&mut dev);
    assert_eq!(
        gid.gid,
        vrdma_spec::gid::loopback_gid(5),
        "the identity's GID"
    );
    assert_eq!(gid.gid, dev.config().gid, "the config space's GID 0");
    assert_eq!(gid.gid_type.get(), vrdma_spec::control::gid_type::ROCE_V2);
    assert_eq!(
        run::<vrdma_spec::config::PortAttr>(&mut dev, Opcode::QueryPort, port_req(2).as_bytes()),
        Err(libc::EINVAL)
    );
    let bad_gid = QueryGidReq {
        port_num: 1,
        index: 1.into(),
        ..Default::default()
    };
    assert_eq!(
        run::<QueryGidResp>(&mut dev, Opcode::QueryGid, bad_gid.as_bytes()),
        Err(libc::EINVAL)
    );
}

#[test]
fn pd_limits_and_double_dealloc() {
    let mut dev = device_with(Limits {
        max_pd: 2,
        ..Limits::default()
    });
    let a = alloc_pd(&mut dev);
    let _b = alloc_pd(&mut dev);
    assert_eq!(
        run::<PdHandle>(&mut dev, Opcode::AllocPd, &[]).map(|_| ()),
        Err(libc::ENOMEM)
    );
    release(&mut dev, Opcode::DeallocPd, a).expect("dealloc");
    assert_eq!(
        release(&mut dev, Opcode::DeallocPd, a),
        Err(libc::EINVAL),
        "double dealloc"
    );
    assert!(alloc_pd(&mut dev) != a, "handles are not reused");
}

#[test]
fn mr_checks_and_accounting() {
    let mut dev = device_with(Limits {
        max_mr: 3,
        max_mr_bytes: 1 << 20,
        max_total_mr_bytes: 3 << 19,
        ..Limits::default()
    });
    let pdn = alloc_pd(&mut dev);
    let rw = access::LOCAL_WRITE | access::REMOTE_WRITE;
    let end = MEM_BASE + MEM_SIZE as u64;
    let mut reg = |pdn, addr, len, flags| reg_mr(&mut dev, pdn, addr, len, flags);
    assert_refused(
        libc::EINVAL,
        [
            (
                reg(pdn, MEM_BASE, 4096, access::REMOTE_WRITE),
                "remote write without local write",
            ),
            (reg(pdn, MEM_BASE, 0, rw), "zero length"),
            (reg(pdn + 100, MEM_BASE, 4096, rw), "unknown PD"),
            (reg(pdn, MEM_BASE, 4096, 1 << 9), "unknown access flag"),
        ],
    );
    assert_refused(
        libc::EFAULT,
        [
            (reg(pdn, end - 4096, 8192, rw), "runs past guest memory"),
            (reg(pdn, u64::MAX - 4095, 8192, rw), "wraps around"),
            (reg(pdn, 0, 4096, rw), "unmapped"),
        ],
    );
    assert_refused(
        libc::ENOMEM,
        [(reg(pdn, MEM_BASE, 2 << 20, rw), "above max_mr_bytes")],
    );

    let a = reg_mr(&mut dev, pdn, MEM_BASE, 1 << 20, rw).expect("first MiB");
    assert_ne!(a.lkey.get(), a.rkey.get());
    assert_eq!(dev.registered_bytes(), 1 << 20);
    let b = reg_mr(&mut dev, pdn, MEM_BASE, 1 << 19, rw).expect("half MiB");
    assert_eq!(
        reg_mr(&mut dev, pdn, MEM_BASE, 4096, rw).map(|_| ()),
        Err(libc::ENOMEM),
        "total bytes reached"
    );
    release(&mut dev, Opcode::DeregMr, b.handle.get()).expect("dereg");
    assert_eq!(dev.registered_bytes(), 1 << 20);
    assert_eq!(
        release(&mut dev, Opcode::DeregMr, b.handle.get()),
        Err(libc::EINVAL),
        "double dereg"
    );
    reg_mr(&mut dev, pdn, MEM_BASE, 4096, rw).expect("room again after dereg");

    // A PD with an MR cannot go.
    assert_eq!(release(&mut dev, Opcode::DeallocPd, pdn), Err(libc::EBUSY));
}

/// Writes `segs` as a segment list at `list` and registers them.
fn reg_mr_sg(
    dev: &mut RdmaDevice,
    pdn: u32,
    list: u64,
    segs: &[(u64, u64)],
    len: u64,
    iova: u64,
) -> Result<RegMrResp, i32> {
    dev.mem
        .write_slice(vmm::sg_list(segs).as_bytes(), GuestAddress(list))
        .expect("list in memory");
    let req = RegMrSgReq {
        pdn: pdn.into(),
        access: access::LOCAL_WRITE.into(),
        iova: iova.into(),
        length: len.into(),
        nsegs: (segs.len() as u32).into(),
        reserved: 0.into(),
        list_addr: list.into(),
    };
    run(dev, Opcode::RegMrSg, req.as_bytes())
}

#[test]
fn scattered_mr_translates_through_its_segments_in_order() {
    let mut dev = device();
    let pdn = alloc_pd(&mut dev);
    let list = MEM_BASE;
    let (a, b) = (MEM_BASE + 0x8000, MEM_BASE + 0x2000);
    let mr = reg_mr_sg(
        &mut dev,
        pdn,
        list,
        &[(a, 0x1000), (b, 0x800)],
        0x1800,
        0x7000,
    )
    .expect("scattered MR");
    assert_eq!(dev.registered_bytes(), 0x1800);
    let pieces = dev
        .translate_local(pdn, mr.lkey.get(), 0x7ff0, 0x20, access::LOCAL_WRITE)
        .expect("inside");
    assert_eq!(
        pieces,
        vec![(GuestAddress(a + 0xff0), 0x10), (GuestAddress(b), 0x10)]
    );
    // The list is read once: changing it afterwards changes nothing.
    dev.mem
        .write_slice(&[0xffu8; 32], GuestAddress(list))
        .expect("scribble");
    assert_eq!(
        dev.translate_local(pdn, mr.lkey.get(), 0x8000, 0x10, 0)
            .expect("inside"),
        vec![(GuestAddress(b), 0x10)]
    );
}

#[test]
fn scattered_mr_checks_list_segments_and_quota() {
    let mut dev = device_with(Limits {
        max_mr_bytes: 1 << 20,
        ..Limits::default()
    });
    let pdn = alloc_pd(&mut dev);
    let end = MEM_BASE + MEM_SIZE as u64;
    let seg = (MEM_BASE + 0x4000, 0x1000);
    let sg = |dev: &mut RdmaDevice, list: u64, segs: &[(u64, u64)], len: u64| {
        reg_mr_sg(dev, pdn, list, segs, len, 0x1000).map(|_| ())
    };
    let many = vec![(MEM_BASE + 0x4000, 1); MAX_MR_SEGMENTS as usize + 1];
    assert_refused(
        libc::EINVAL,
        [
            (sg(&mut dev, MEM_BASE, &[], 0x1000), "no segments"),
            (
                sg(&mut dev, MEM_BASE, &many, many.len() as u64),
                "too many segments",
            ),
            (
                sg(&mut dev, MEM_BASE, &[seg, seg], 0x1000),
                "total differs from length",
            ),
            (
                sg(&mut dev, MEM_BASE, &[seg, (MEM_BASE, 0)], 0x1000),
                "empty segment",
            ),
        ],
    );
    assert_refused(
        libc::EFAULT,
        [
            (
                sg(&mut dev, MEM_BASE, &[seg, (end - 0x800, 0x1000)], 0x2000),
                "segment past guest memory",
            ),
            (
                sg(
                    &mut dev,
                    MEM_BASE,
                    &[seg, (u64::MAX - 0xff, 0x1000)],
                    0x2000,
                ),
                "segment wraps around",
            ),
            (
                sg(&mut dev, MEM_BASE, &[seg, (MEM_BASE, u64::MAX)], 0x1000),
                "segment length overflows",
            ),
        ],
    );
    assert_refused(
        libc::ENOMEM,
        [(
            sg(&mut dev, MEM_BASE, &[(MEM_BASE, 2 << 20)], 2 << 20),
            "above max_mr_bytes",
        )],
    );
    assert_eq!(dev.registered_bytes(), 0, "no refusal registered anything");
    // A list that is not in guest memory: written in memory, pointed elsewhere.
    let req = RegMrSgReq {
        pdn: pdn.into(),
        access: 0.into(),
        iova: 0.into(),
        length: 0x1000.into(),
        nsegs: 1.into(),
        reserved: 0.into(),
        list_addr: (end - 8).into(),
    };
    let wrapped = RegMrSgReq {
        list_addr: (u64::MAX - 8).into(),
        ..req
    };
    let mut reg_sg = |req: RegMrSgReq| run::<RegMrResp>(&mut dev, Opcode::RegMrSg, req.as_bytes());
    assert_refused(
        libc::EFAULT,
        [
            (reg_sg(req), "list straddles the end of guest memory"),
            (reg_sg(wrapped), "list wraps around"),
        ],
    );
    sg(&mut dev, MEM_BASE, &[seg, seg], 0x2000).expect("a segment may repeat");
    assert_eq!(dev.registered_bytes(), 0x2000);
}

#[test]
fn keys_are_not_sequential() {
    let mut dev = device();
    let pdn = alloc_pd(&mut dev);
    let keys: Vec<u32> = (0..8)
        .map(|i| {
            reg_mr(&mut dev, pdn, MEM_BASE + i * 4096, 4096, 0)
                .expect("mr")
                .lkey
                .get()
        })
        .collect();
    let steps: std::collections::HashSet<u32> =
        keys.windows(2).map(|w| w[1].wrapping_sub(w[0])).collect();
    assert!(steps.len() > 1, "keys {keys:x?} advance by a constant step");
}

#[test]
fn local_translation_checks_pd_bounds_and_revocation() {
    let mut dev = device();
    let pd_a = alloc_pd(&mut dev);
    let pd_b = alloc_pd(&mut dev);
    let mr = reg_mr(
        &mut dev,
        pd_a,
        MEM_BASE + 0x3000,
        0x2000,
        access::LOCAL_WRITE,
    )
    .expect("mr");
    let lkey = mr.lkey.get();
    let pieces = dev
        .translate_local(pd_a, lkey, MEM_BASE + 0x3100, 0x100, access::LOCAL_WRITE)
        .expect("ok");
    assert_eq!(pieces, vec![(GuestAddress(MEM_BASE + 0x3100), 0x100)]);
    assert!(matches!(
        dev.translate_local(pd_b, lkey, MEM_BASE + 0x3100, 1, 0),
        Err(mr::KeyError::OtherPd { .. })
    ));
    assert!(matches!(
        dev.translate_local(pd_a, lkey ^ 1, MEM_BASE + 0x3100, 1, 0),
        Err(mr::KeyError::UnknownKey(_))
    ));
    // The VMM replaces guest memory with different memory at the same address.
    let other =
        GuestMemoryMmap::from_ranges(&[(GuestAddress(MEM_BASE), MEM_SIZE)]).expect("memory");
    assert_eq!(dev.update_memory(Arc::new(other)), 1);
    assert!(matches!(
        dev.translate_local(pd_a, lkey, MEM_BASE + 0x3100, 1, 0),
        Err(mr::KeyError::Translate(
            crate::shadow::TranslateError::Revoked
        ))
    ));
    // The revoked MR can still be deregistered.
    release(&mut dev, Opcode::DeregMr, mr.handle.get()).expect("dereg");
}

#[test]
fn cq_checks_and_busy_rules() {
    let mut dev = device();
    let cq_req = |depth: u32, comp_vector: u32, ring_addr: u64| CreateCqReq {
        depth: depth.into(),
        comp_vector: comp_vector.into(),
        ring_addr: ring_addr.into(),
    };
    let end = MEM_BASE + MEM_SIZE as u64;
    let too_deep = Limits::default().max_cq_depth + 1;
    let mut create = |req: CreateCqReq| run::<CqHandle>(&mut dev, Opcode::CreateCq, req.as_bytes());
    assert_refused(
        libc::EINVAL,
        [
            (create(cq_req(16, 0, MEM_BASE + 8)), "misaligned ring"),
            (
                create(cq_req(1024, 0, end - RING_ALIGN)),
                "ring past memory",
            ),
            (create(cq_req(too_deep, 0, MEM_BASE)), "too deep"),
            (create(cq_req(4, 2, MEM_BASE)), "no such vector"),
        ],
    );

    // create_cq resets the device half of the ring header.
    dev.mem
        .write_slice(&[0xffu8; 128], GuestAddress(MEM_BASE))
        .expect("dirty");
    let (pdn, cqn, qpn) = qp_fixture(&mut dev);
    let mut header = [0u8; 128];
    dev.mem
        .read_slice(&mut header, GuestAddress(MEM_BASE))
        .expect("read");
    assert!(header[64..].iter().all(|&b| b == 0), "device line zeroed");
    assert!(
        header[..64].iter().all(|&b| b == 0xff),
        "driver line untouched"
    );
    assert_eq!(dev.cq(cqn).map(|cq| cq.depth), Some(16));

    assert_eq!(release(&mut dev, Opcode::DestroyCq, cqn), Err(libc::EBUSY));
    assert_eq!(release(&mut dev, Opcode::DeallocPd, pdn), Err(libc::EBUSY));
    release(&mut dev, Opcode::DestroyQp, qpn).expect("destroy qp");
    assert_eq!(
        release(&mut dev, Opcode::DestroyQp, qpn),
        Err(libc::EINVAL),
        "double destroy"
    );
    release(&mut dev, Opcode::DestroyCq, cqn).expect("destroy cq");
    release(&mut dev, Opcode::DeallocPd, pdn).expect("dealloc pd");
    assert_eq!(dev.object_counts(), (0, 0, 0, 0));
}

#[test]
fn malformed_payloads_are_refused() {
    let mut dev = device();
    let alloc = run::<PdHandle>(&mut dev, Opcode::AllocPd, &[1]).map(|_| ());
    assert_refused(
        libc::EINVAL,
        [
            (alloc, "payload where none belongs"),
            (
                run_unit(&mut dev, Opcode::DeallocPd, &[1, 2, 3]),
                "truncated",
            ),
            (run_unit(&mut dev, Opcode::DeallocPd, &[0; 9]), "oversized"),
        ],
    );
}

#[test]
fn unsupported_features_say_eopnotsupp() {
    let mut dev = device();
    let pdn = alloc_pd(&mut dev);
    assert_eq!(
        reg_mr(&mut dev, pdn, MEM_BASE, 4096, access::MW_BIND).map(|_| ()),
        Err(libc::EOPNOTSUPP)
    );
    assert_eq!(
        reg_mr(&mut dev, pdn, MEM_BASE, 4096, access::ON_DEMAND).map(|_| ()),
        Err(libc::EOPNOTSUPP)
    );
    let (_, _, qpn) = qp_fixture(&mut dev);
    let attr = QpAttr {
        qp_state: QpState::Init.into(),
        port_num: 1,
        ..QpAttr::default()
    };
    assert_eq!(
        modify(&mut dev, qpn, INIT_MASK | mask::RATE_LIMIT, attr),
        Err(libc::EOPNOTSUPP)
    );
    assert_eq!(
        modify(&mut dev, qpn, INIT_MASK | (1 << 29), attr),
        Err(libc::EINVAL),
        "unknown bit"
    );
}
