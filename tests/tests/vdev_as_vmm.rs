//! vdev as a VMM meets it: a separate vdev process on a real unix socket,
//! driven through the `vhost` crate's frontend over memfd guest memory, with
//! control commands in hand-written descriptor chains — well-formed ones and
//! hostile ones. After every hostile chain the device must still answer.
//! vdev attached to hostd is tested in `vdev_on_hostd.rs`.

use vhost::vhost_user::VhostUserFrontend;
use vm_memory::{Bytes, GuestAddress};
use vrdma_spec::config::{DeviceAttr, PortAttr, CONFIG_MAGIC};
use vrdma_spec::control::*;
use vrdma_spec::qp_state::mask;
use vrdma_spec::ring::{self, RING_ALIGN};
use vrdma_spec::verbs::{access, QpState};
use vrdma_spec::zerocopy::IntoBytes;
use vrdma_tests::daemon::{TempDir, Vdev};
use vrdma_tests::vmm::{
    self, alloc_pd, cq_req, doorbell_req, eq_req, pd, qp_req, query_qp, reg, Desc, Vmm, FREE,
    GUEST_BASE, GUEST_SIZE, SCRATCH,
};
use vrdma_tools::verbs::{transitions, Connection};

const EINVAL: u32 = libc::EINVAL as u32;
const EBUSY: u32 = libc::EBUSY as u32;
const EEXIST: u32 = libc::EEXIST as u32;
const EFAULT: u32 = libc::EFAULT as u32;
const ENOMEM: u32 = libc::ENOMEM as u32;

/// A valid command still works: the device survived what came before.
fn assert_still_serving(vmm: &mut Vmm) {
    let attr: DeviceAttr = vmm.ok(Opcode::QueryDevice, &[]);
    assert_eq!(attr.phys_port_cnt, 1);
}

/// A PD can be made and removed: no object of what came before is in the
/// way.
fn assert_a_new_pd_comes_and_goes(vmm: &mut Vmm) {
    let pdn = alloc_pd(vmm);
    assert_eq!(vmm.errno(Opcode::DeallocPd, pd(pdn).as_bytes()), 0);
}

/// Where the tests' drivers keep their doorbell page and event rings.
const DOORBELL_PAGE: u64 = FREE + (4 << 20);
const EVENT_RING: u64 = FREE + (5 << 20);

#[test]
fn config_space_and_queries_describe_the_device() {
    let vdev = Vdev::start("cfg", &["--lid", "9", "--comp-vectors", "2"]);
    let mut vmm = Vmm::attach(&vdev.socket);
    assert_eq!(vmm.config.magic.get(), CONFIG_MAGIC);
    assert_eq!(
        vmm.config.version_major.get(),
        vrdma_spec::SPEC_VERSION_MAJOR
    );
    assert_eq!(vmm.config.num_comp_vectors.get(), 2);
    assert_eq!(vmm.config.port.lid.get(), 0, "RoCE: no LID");
    assert_eq!(vmm.config.gid, vrdma_spec::gid::loopback_gid(9));
    assert_eq!(vmm.config.name(), Some("vrdma_9"));
    assert_eq!(
        vmm.frontend.get_queue_num().expect("get_queue_num"),
        u64::from(vrdma_spec::num_queues(2))
    );

    let attr: DeviceAttr = vmm.ok(Opcode::QueryDevice, &[]);
    assert_eq!(
        attr, vmm.config.device,
        "QUERY_DEVICE agrees with config space"
    );
    assert!(
        attr.max_qp_rd_atom.get() > 0,
        "ib_read_bw needs max_qp_rd_atom > 0"
    );
    let port_req = |port_num| QueryPortReq {
        port_num,
        ..Default::default()
    };
    let port: PortAttr = vmm.ok(Opcode::QueryPort, port_req(1).as_bytes());
    assert_eq!(port, vmm.config.port);
    assert_eq!(port.state, 4, "port ACTIVE");
    let gid: QueryGidResp = vmm.ok(
        Opcode::QueryGid,
        QueryGidReq {
            port_num: 1,
            ..Default::default()
        }
        .as_bytes(),
    );
    assert_eq!(gid.gid, vmm.config.gid);
    assert_eq!(vmm.errno(Opcode::QueryPort, port_req(0).as_bytes()), EINVAL);
}

#[test]
fn every_control_verb_and_its_failure_paths() {
    let vdev = Vdev::start("verbs", &[]);
    let mut vmm = Vmm::attach(&vdev.socket);

    // PD
    let pdn = alloc_pd(&mut vmm);
    let other_pdn = alloc_pd(&mut vmm);
    assert_ne!(pdn, other_pdn);

    // MR: success, then each failure.
    let rw = access::LOCAL_WRITE | access::REMOTE_WRITE | access::REMOTE_READ;
    let mr: RegMrResp = vmm.ok(Opcode::RegMr, reg(pdn, FREE, 1 << 20, rw).as_bytes());
    assert_ne!(mr.lkey.get(), 0);
    let end = GUEST_BASE + GUEST_SIZE as u64;
    for (req, errno, what) in [
        (
            reg(pdn, FREE, 4096, access::REMOTE_WRITE),
            EINVAL,
            "remote write needs local write",
        ),
        (reg(pdn + 1000, FREE, 4096, rw), EINVAL, "unknown PD"),
        (reg(pdn, FREE, 0, rw), EINVAL, "zero length"),
        (
            reg(pdn, end - 4096, 8192, rw),
            EFAULT,
            "MR spans unmapped memory",
        ),
        (
            reg(pdn, u64::MAX - 4095, 8192, rw),
            EFAULT,
            "MR wraps around",
        ),
        (reg(pdn, 0, 4096, rw), EFAULT, "MR below guest memory"),
    ] {
        assert_eq!(vmm.errno(Opcode::RegMr, req.as_bytes()), errno, "{what}");
    }

    // CQ
    let cq_ring = FREE + (2 << 20);
    let cq: CqHandle = vmm.ok(Opcode::CreateCq, cq_req(cq_ring, 64).as_bytes());
    for (req, what) in [
        (cq_req(cq_ring + 64, 64), "misaligned CQ ring"),
        (cq_req(end - RING_ALIGN, 4096), "CQ ring past guest memory"),
        (cq_req(cq_ring, 0), "zero depth"),
    ] {
        assert_eq!(
            vmm.errno(Opcode::CreateCq, req.as_bytes()),
            EINVAL,
            "{what}"
        );
    }

    // QP: not before the doorbell page.
    let (sq, rq) = (FREE + (3 << 20), FREE + (3 << 20) + 0x10000);
    assert_eq!(
        vmm.errno(
            Opcode::CreateQp,
            qp_req(pdn, cq.cqn.get(), sq, rq).as_bytes()
        ),
        EINVAL,
        "CREATE_QP before SET_DOORBELL"
    );
    for (addr, what) in [
        (DOORBELL_PAGE + 64, "misaligned doorbell page"),
        (end, "doorbell page outside guest memory"),
    ] {
        assert_eq!(
            vmm.errno(Opcode::SetDoorbell, doorbell_req(addr).as_bytes()),
            EINVAL,
            "{what}"
        );
    }
    assert_eq!(
        vmm.errno(Opcode::SetDoorbell, doorbell_req(DOORBELL_PAGE).as_bytes()),
        0
    );
    assert_eq!(
        vmm.errno(Opcode::SetDoorbell, doorbell_req(DOORBELL_PAGE).as_bytes()),
        EEXIST,
        "a second doorbell page"
    );

    // Event rings: one per completion vector (this device has one).
    for (req, what) in [
        (eq_req(1, 64, EVENT_RING), "vector beyond num_comp_vectors"),
        (eq_req(0, 48, EVENT_RING), "depth not a power of two"),
        (eq_req(0, 64, EVENT_RING + 64), "misaligned event ring"),
        (
            eq_req(0, 4096, end - RING_ALIGN),
            "event ring past guest memory",
        ),
    ] {
        assert_eq!(
            vmm.errno(Opcode::CreateEq, req.as_bytes()),
            EINVAL,
            "{what}"
        );
    }
    assert_eq!(
        vmm.errno(Opcode::CreateEq, eq_req(0, 64, EVENT_RING).as_bytes()),
        0
    );
    assert_eq!(
        vmm.errno(Opcode::CreateEq, eq_req(0, 64, EVENT_RING).as_bytes()),
        EEXIST,
        "a second event ring for vector 0"
    );

    let qp: CreateQpResp = vmm.ok(
        Opcode::CreateQp,
        qp_req(pdn, cq.cqn.get(), sq, rq).as_bytes(),
    );
    let qpn = qp.qpn.get();
    assert_eq!(qp.db_index.get(), 0, "the first QP's doorbell bit");
    assert!(qp.cap.max_send_wr.get() >= 16 && qp.cap.max_inline_data.get() >= 32);
    for (req, what) in [
        (qp_req(pdn, cq.cqn.get() + 77, sq, rq), "unknown CQ"),
        (qp_req(pdn, cq.cqn.get(), end, rq), "SQ ring outside memory"),
    ] {
        assert_eq!(
            vmm.errno(Opcode::CreateQp, req.as_bytes()),
            EINVAL,
            "{what}"
        );
    }

    // modify_qp through RTS, with a wrong attribute at each step first.
    let modify = |vmm: &mut Vmm, attr_mask: u32, attr: QpAttr| {
        vmm.errno(
            Opcode::ModifyQp,
            vmm::modify_req(qpn, attr_mask, attr).as_bytes(),
        )
    };
    // What the driver sends: to peer QP 0x42 at GID ::ffff:127.100.0.3,
    // one read or atomic in flight each way.
    let how = Connection {
        access: access::REMOTE_WRITE | access::REMOTE_READ,
        min_rnr_timer: 12,
        rd_atomic: 1,
        ..Connection::DEFAULT
    };
    let [(init, init_mask), (rtr, rtr_mask), (rts, rts_mask)] =
        transitions(0x42, vrdma_spec::gid::loopback_gid(3), how);
    assert_eq!(
        modify(&mut vmm, mask::STATE | mask::PORT, init),
        EINVAL,
        "missing pkey_index/access_flags"
    );
    assert_eq!(modify(&mut vmm, init_mask, init), 0);
    assert_eq!(
        modify(&mut vmm, rtr_mask & !mask::AV, rtr),
        EINVAL,
        "missing required AV"
    );
    assert_eq!(
        modify(&mut vmm, rtr_mask, QpAttr { path_mtu: 7, ..rtr }),
        EINVAL,
        "path MTU above the port's"
    );
    let mut no_grh = rtr;
    no_grh.ah_attr.is_global = 0;
    assert_eq!(
        modify(&mut vmm, rtr_mask, no_grh),
        EINVAL,
        "an address vector without a GRH on the RoCE port"
    );
    assert_eq!(modify(&mut vmm, rtr_mask, rtr), 0);
    assert_eq!(
        modify(&mut vmm, rts_mask | mask::DEST_QPN, rts),
        EINVAL,
        "dest_qp_num not allowed RTR->RTS"
    );
    assert_eq!(modify(&mut vmm, rts_mask, rts), 0);
    let q: QueryQpResp = vmm.ok(Opcode::QueryQp, query_qp(qpn).as_bytes());
    assert_eq!(q.attr.qp_state, u8::from(QpState::Rts));
    assert_eq!(q.attr.dest_qp_num.get(), 0x42);
    assert_eq!(q.attr.cap, qp.cap);
    assert_eq!(q.send_cqn.get(), cq.cqn.get());
    for state in [QpState::Sqd, QpState::Err] {
        let attr = QpAttr {
            qp_state: state.into(),
            ..QpAttr::default()
        };
        assert_eq!(modify(&mut vmm, mask::STATE, attr), 0, "to {state:?}");
    }
    assert_eq!(
        modify(&mut vmm, rts_mask, rts),
        EINVAL,
        "ERR->RTS is not a transition"
    );

    // Dependencies: busy objects cannot go; double destroy fails.
    assert_eq!(
        vmm.errno(Opcode::DeallocPd, pd(pdn).as_bytes()),
        EBUSY,
        "PD has an MR and a QP"
    );
    assert_eq!(
        vmm.errno(Opcode::DestroyCq, cq.as_bytes()),
        EBUSY,
        "CQ has a QP"
    );
    let qp_handle = vmm::qp(qpn);
    assert_eq!(vmm.errno(Opcode::DestroyQp, qp_handle.as_bytes()), 0);
    assert_eq!(
        vmm.errno(Opcode::DestroyQp, qp_handle.as_bytes()),
        EINVAL,
        "double destroy QP"
    );
    assert_eq!(vmm.errno(Opcode::QueryQp, query_qp(qpn).as_bytes()), EINVAL);
    assert_eq!(vmm.errno(Opcode::DestroyCq, cq.as_bytes()), 0);
    assert_eq!(
        vmm.errno(Opcode::DestroyCq, cq.as_bytes()),
        EINVAL,
        "double destroy CQ"
    );
    assert_eq!(
        vmm.errno(Opcode::DeallocPd, pd(pdn).as_bytes()),
        EBUSY,
        "PD still has an MR"
    );
    let mr_handle = vmm::mr(mr.handle.get());
    assert_eq!(vmm.errno(Opcode::DeregMr, mr_handle.as_bytes()), 0);
    assert_eq!(
        vmm.errno(Opcode::DeregMr, mr_handle.as_bytes()),
        EINVAL,
        "double dereg"
    );
    assert_eq!(vmm.errno(Opcode::DeallocPd, pd(pdn).as_bytes()), 0);
    assert_eq!(
        vmm.errno(Opcode::DeallocPd, pd(pdn).as_bytes()),
        EINVAL,
        "double dealloc"
    );
    assert_still_serving(&mut vmm);
}

#[test]
fn limits_from_the_config_file_are_enforced() {
    let dir = TempDir::new("limits");
    let config = dir.path().join("vdev.toml");
    std::fs::write(
        &config,
        "[limits]\nmax_pd = 2\nmax_mr = 2\nmax_mr_bytes = 1048576\nmax_total_mr_bytes = 1572864\n",
    )
    .expect("config");
    let vdev = Vdev::start("limits", &["--config", config.to_str().expect("utf8")]);
    let mut vmm = Vmm::attach(&vdev.socket);
    assert_eq!(vmm.config.device.max_pd.get(), 2);
    let pdn = alloc_pd(&mut vmm);
    alloc_pd(&mut vmm);
    assert_eq!(vmm.errno(Opcode::AllocPd, &[]), ENOMEM, "third PD");
    assert_eq!(
        vmm.errno(Opcode::RegMr, reg(pdn, FREE, 2 << 20, 0).as_bytes()),
        ENOMEM,
        "above max_mr_bytes"
    );
    let a: RegMrResp = vmm.ok(Opcode::RegMr, reg(pdn, FREE, 1 << 20, 0).as_bytes());
    assert_eq!(
        vmm.errno(Opcode::RegMr, reg(pdn, FREE, 1 << 20, 0).as_bytes()),
        ENOMEM,
        "total bytes"
    );
    let _b: RegMrResp = vmm.ok(Opcode::RegMr, reg(pdn, FREE, 1 << 19, 0).as_bytes());
    assert_eq!(
        vmm.errno(Opcode::RegMr, reg(pdn, FREE, 4096, 0).as_bytes()),
        ENOMEM,
        "MR count"
    );
    let dereg = vmm::mr(a.handle.get());
    assert_eq!(vmm.errno(Opcode::DeregMr, dereg.as_bytes()), 0);
    let _c: RegMrResp = vmm.ok(Opcode::RegMr, reg(pdn, FREE, 4096, 0).as_bytes());
}

#[test]
fn hostile_chains_get_an_error_and_vdev_keeps_serving() {
    let vdev = Vdev::start("hostile", &[]);
    let mut vmm = Vmm::attach(&vdev.socket);
    let header = |op: u16, len: u32| RequestHeader {
        opcode: op.into(),
        flags: 0.into(),
        payload_len: len.into(),
    };

    // Unknown command code.
    let (status, _) = vmm.raw_command(header(99, 0).as_bytes(), 64);
    assert_eq!(status, libc::EOPNOTSUPP as u32);
    // Truncated: DEALLOC_PD announces 8 payload bytes and carries 3.
    let mut truncated = header(Opcode::DeallocPd.into(), 8).as_bytes().to_vec();
    truncated.extend_from_slice(&[1, 0, 0]);
    assert_eq!(vmm.raw_command(&truncated, 64).0, EINVAL);
    // Header shorter than a header.
    assert_eq!(vmm.raw_command(&[4, 0, 0], 64).0, EINVAL);
    // payload_len disagreeing with the bytes present.
    let mut lying = header(Opcode::AllocPd.into(), 100).as_bytes().to_vec();
    lying.extend_from_slice(&[0; 8]);
    assert_eq!(vmm.raw_command(&lying, 64).0, EINVAL);
    // Non-zero flags.
    let flagged = RequestHeader {
        opcode: u16::from(Opcode::AllocPd).into(),
        flags: 1.into(),
        payload_len: 0.into(),
    };
    assert_eq!(vmm.raw_command(flagged.as_bytes(), 64).0, EINVAL);
    // Oversized: 8 KiB of request.
    let mut huge = header(Opcode::QueryDevice.into(), 8192 - 8)
        .as_bytes()
        .to_vec();
    huge.resize(8192, 0);
    assert_eq!(vmm.raw_command(&huge, 64).0, libc::EMSGSIZE as u32);
    // Response room too small for the answer: refused without executing.
    assert_eq!(
        vmm.raw_command(header(Opcode::AllocPd.into(), 0).as_bytes(), 8)
            .0,
        EINVAL
    );

    let end = GUEST_BASE + GUEST_SIZE as u64;
    let resp = SCRATCH + 0x8000;
    let chains: Vec<(&str, Vec<Desc>)> = vec![
        (
            "request outside guest memory",
            Desc::command(end + 4096, 8, resp, 64),
        ),
        (
            "request wrapping the address space",
            Desc::command(u64::MAX - 3, 8, resp, 64),
        ),
        (
            "request longer than guest memory",
            Desc::command(SCRATCH, u32::MAX, resp, 64),
        ),
        (
            "response outside guest memory",
            Desc::command(SCRATCH, 8, end - 8, 64),
        ),
        ("no writable descriptor", vec![Desc::read(SCRATCH, 8, None)]),
        (
            "next index beyond the table",
            vec![Desc::read(SCRATCH, 8, Some(vmm::QUEUE_SIZE + 5))],
        ),
    ];
    vmm.mem
        .write_slice(
            header(Opcode::AllocPd.into(), 0).as_bytes(),
            GuestAddress(SCRATCH),
        )
        .expect("request");
    for (what, chain) in chains {
        let used = vmm.submit_chain(&chain);
        assert_eq!(used, 0, "{what}: nothing written");
        assert_still_serving(&mut vmm);
    }

    // Zero-length request descriptor: answered with EINVAL.
    let used = vmm.submit_chain(&Desc::command(SCRATCH, 0, resp, 64));
    assert_eq!(used, 8);
    let status: u32 = vmm.mem.read_obj(GuestAddress(resp)).expect("status");
    assert_eq!(status, EINVAL);

    // A descriptor loop: the chain ends after a queue's worth of descriptors.
    let used = vmm.submit_chain(&[Desc::read(SCRATCH, 8, Some(0))]);
    assert_eq!(used, 0, "a loop has no writable descriptor");
    assert_still_serving(&mut vmm);

    // None of the hostile chains allocated anything: the first PD handle a
    // valid ALLOC_PD now gets works, and vdev is still running.
    assert_a_new_pd_comes_and_goes(&mut vmm);
    let mut vdev = vdev;
    assert!(vdev.is_running(), "vdev died:\n{}", vdev.log());
}

#[test]
fn removed_guest_memory_revokes_shadows_and_is_not_reused() {
    let vdev = Vdev::start("memtable", &[]);
    let mut vmm = Vmm::attach(&vdev.socket);
    // Hot-add a second region, register an MR in it, then remove the region.
    let extra_gpa = 0x4000_0000;
    let extra = vmm::memfd_memory("hotplug", extra_gpa, 2 << 20);
    let info = vmm::region_infos(&extra)[0];
    vmm.frontend.add_mem_region(&info).expect("add_mem_region");
    let pdn = alloc_pd(&mut vmm);
    let mr: RegMrResp = vmm.ok(
        Opcode::RegMr,
        reg(pdn, extra_gpa, 1 << 20, access::LOCAL_WRITE).as_bytes(),
    );
    let cq_in_extra = cq_req(extra_gpa + (1 << 20), 16);
    let _cq: CqHandle = vmm.ok(Opcode::CreateCq, cq_in_extra.as_bytes());
    vmm.frontend
        .remove_mem_region(&info)
        .expect("remove_mem_region");
    // The range is gone: new registrations and rings there fail cleanly.
    assert_eq!(
        vmm.errno(Opcode::RegMr, reg(pdn, extra_gpa, 4096, 0).as_bytes()),
        EFAULT
    );
    assert_eq!(vmm.errno(Opcode::CreateCq, cq_in_extra.as_bytes()), EINVAL);
    // The revoked MR can still be deregistered, and vdev said what it did.
    let dereg = vmm::mr(mr.handle.get());
    assert_eq!(vmm.errno(Opcode::DeregMr, dereg.as_bytes()), 0);
    assert_still_serving(&mut vmm);
    vdev.assert_logged(&["shadows are revoked", "revoked=1"]);
}

#[test]
fn a_new_frontend_gets_a_fresh_device() {
    let vdev = Vdev::start("reconnect", &[]);
    let first_pd = {
        let mut vmm = Vmm::attach(&vdev.socket);
        let pdn = alloc_pd(&mut vmm);
        let _: RegMrResp = vmm.ok(Opcode::RegMr, reg(pdn, FREE, 4096, 0).as_bytes());
        pdn
    };
    // The first frontend is gone (dropped); its objects went with it.
    let mut vmm = Vmm::attach(&vdev.socket);
    assert_eq!(
        vmm.errno(Opcode::DeallocPd, pd(first_pd).as_bytes()),
        EINVAL,
        "old PD does not exist"
    );
    assert_a_new_pd_comes_and_goes(&mut vmm);
    let depth = ring::cq_depth(100).expect("depth");
    let _: CqHandle = vmm.ok(Opcode::CreateCq, cq_req(FREE, depth).as_bytes());
}

#[test]
fn a_device_reset_releases_every_object() {
    let vdev = Vdev::start("reset", &[]);
    let mut vmm = Vmm::attach(&vdev.socket);
    let pdn = alloc_pd(&mut vmm);
    let _: RegMrResp = vmm.ok(Opcode::RegMr, reg(pdn, FREE, 4096, 0).as_bytes());
    // The guest resets the virtio device (e.g. it rebooted); the VMM tells vdev.
    vmm.frontend.reset_device().expect("RESET_DEVICE");
    // As after a reboot, the VMM negotiates features and sets up the queue again.
    vmm.bring_up_again();
    assert_eq!(
        vmm.errno(Opcode::DeallocPd, pd(pdn).as_bytes()),
        EINVAL,
        "PD went with the reset"
    );
    assert_a_new_pd_comes_and_goes(&mut vmm);
    vdev.assert_logged(&["Device reset: all verbs objects released"]);
}

/// A hostile `REG_MR_SG` case: what it is, the list written, the request,
/// the errno expected.
type HostileList = (&'static str, Vec<(u64, u64)>, RegMrSgReq, u32);

/// Writes a `REG_MR_SG` segment list into guest memory at `list`.
fn write_segments(vmm: &mut Vmm, list: u64, segs: &[(u64, u64)]) {
    vmm.mem
        .write_slice(vmm::sg_list(segs).as_bytes(), GuestAddress(list))
        .expect("segment list");
}

fn reg_sg(pdn: u32, list: u64, nsegs: u32, len: u64) -> RegMrSgReq {
    RegMrSgReq {
        pdn: pdn.into(),
        access: (access::LOCAL_WRITE | access::REMOTE_WRITE).into(),
        iova: 0x4000_0000.into(),
        length: len.into(),
        nsegs: nsegs.into(),
        reserved: 0.into(),
        list_addr: list.into(),
    }
}

#[test]
fn hostile_segment_lists_are_refused_and_vdev_keeps_serving() {
    let vdev = Vdev::start("sg-hostile", &[]);
    let mut vmm = Vmm::attach(&vdev.socket);
    let pdn = alloc_pd(&mut vmm);
    let end = GUEST_BASE + GUEST_SIZE as u64;
    let list = FREE + (3 << 20);
    let good = [(FREE, 0x1000), (FREE + 0x3000, 0x800)];
    let cases: [HostileList; 7] = [
        (
            "list outside guest memory",
            good.to_vec(),
            reg_sg(pdn, end - 16, 2, 0x1800),
            EFAULT,
        ),
        (
            "list wraps around",
            good.to_vec(),
            reg_sg(pdn, u64::MAX - 15, 2, 0x1800),
            EFAULT,
        ),
        (
            "too many segments",
            good.to_vec(),
            reg_sg(pdn, list, MAX_MR_SEGMENTS + 1, 0x1800),
            EINVAL,
        ),
        (
            "zero segments",
            good.to_vec(),
            reg_sg(pdn, list, 0, 0x1800),
            EINVAL,
        ),
        (
            "segment outside guest memory",
            vec![(FREE, 0x1000), (end - 0x400, 0x800)],
            reg_sg(pdn, list, 2, 0x1800),
            EFAULT,
        ),
        (
            "segment overflows",
            vec![(FREE, 0x1000), (u64::MAX - 0x3ff, 0x800)],
            reg_sg(pdn, list, 2, 0x1800),
            EFAULT,
        ),
        (
            "total differs from length",
            good.to_vec(),
            reg_sg(pdn, list, 2, 0x2000),
            EINVAL,
        ),
    ];
    for (what, segs, req, errno) in cases {
        write_segments(&mut vmm, list, &segs);
        assert_eq!(vmm.errno(Opcode::RegMrSg, req.as_bytes()), errno, "{what}");
        assert_still_serving(&mut vmm);
    }
    write_segments(&mut vmm, list, &good);
    let mr: RegMrResp = vmm.ok(Opcode::RegMrSg, reg_sg(pdn, list, 2, 0x1800).as_bytes());
    assert_ne!(mr.lkey.get(), 0);
    let dereg = vmm::mr(mr.handle.get());
    assert_eq!(vmm.errno(Opcode::DeregMr, dereg.as_bytes()), 0);
}

/// Defect 4: an avail-ring entry naming a descriptor head beyond the queue
/// made vdev's `add_used` fail and its `handle_event` return the error,
/// which ended vhost-user-backend's worker: the control queue was never
/// served again. The entry is skipped; the commands after it are answered.
#[test]
fn an_avail_entry_beyond_the_queue_does_not_stop_the_control_queue() {
    let vdev = Vdev::start("bad-head", &[]);
    let mut vmm = Vmm::attach(&vdev.socket);
    assert_still_serving(&mut vmm);
    for head in [vmm::QUEUE_SIZE, u16::MAX] {
        // An entry naming descriptor `head`, which the queue does not have.
        vmm.control.submit(&vmm.mem, head, &[]);
        assert_still_serving(&mut vmm);
    }
    assert_a_new_pd_comes_and_goes(&mut vmm);
    let log = vdev.log();
    assert_eq!(
        log.matches("names a descriptor beyond the queue").count(),
        2,
        "{log}"
    );
    let mut vdev = vdev;
    assert!(vdev.is_running(), "vdev died:\n{}", vdev.log());
}
