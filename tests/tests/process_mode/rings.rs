//! The data-path rings with no device-side consumer (vdev runs without
//! hostd): the WQEs posting writes, the CQEs polling reads, and the depth
//! posting stops at; the test plays the device's side.

use vm_memory::{Bytes, GuestAddress};
use vrdma_guest_driver::{Context, Error, RecvWr, SendPayload, SendWr, WorkCompletion};
use vrdma_spec::control::{CreateCqReq, CreateQpReq, Opcode, SetDoorbellReq};
use vrdma_spec::ring::{
    self, doorbell, send_flags, wc_flags, Cqe, RecvWqe, SendWqe, CQE_SIZE, CQ_ARM_NEXT,
    CQ_ARM_SOLICITED, DEVICE_FLAGS_OFFSET, DEVICE_FLAG_ERROR, DEVICE_INDEX_OFFSET,
    DRIVER_ARM_OFFSET, DRIVER_INDEX_OFFSET, RING_HEADER_SIZE, SGE_SIZE,
};
use vrdma_spec::verbs::{SendOpcode, WcOpcode, WcStatus};
use vrdma_spec::zerocopy::IntoBytes;
use vrdma_spec::DOORBELL_QUEUE;
use vrdma_tests::daemon::Vdev;
use vrdma_tests::tenant::rc_qp;

use crate::device_view::*;
use crate::*;

#[test]
fn posting_writes_wqes_into_the_rings_the_device_was_given() {
    let vdev = Vdev::start("pm-post", &[]);
    let (view, ctx) = DeviceView::open(&vdev.socket);
    let pd = ctx.alloc_pd().expect("alloc_pd");
    let mr = pd.alloc_mr(PAGE, RW).expect("alloc_mr");
    let cq = ctx.create_cq(16, 0).expect("create_cq");
    let qp = rc_qp(&pd, &cq, caps(8, 4, 2, 48)).expect("create_qp");
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
        (8, 5, 80)
    );
    assert_eq!((granted.max_recv_wr, granted.max_recv_sge), (4, 3));
    let mem = view.memory();
    let slot = |ring: u64, stride: u64, index: u64| ring + RING_HEADER_SIZE as u64 + index * stride;
    // Where SGEs and inline data start in a send slot.
    let fixed = std::mem::size_of::<SendWqe>() as u64;
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
        let wire: ring::Sge = read_at(&mem, slot(sq, sq_stride, 0) + fixed + (i * SGE_SIZE) as u64);
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
        read_vec(&mem, slot(sq, sq_stride, 1) + fixed, 19),
        b"hello, inline world"
    );
    assert!(
        !view.take_notified().contains(&DOORBELL_QUEUE),
        "no doorbell while the device polls"
    );
    // The post set the QP's bit in the device's doorbell page (the page
    // SET_DOORBELL gave it; the first QP has db_index 0): bit 0 of bitmap
    // word 0, and that word's bit 0 in summary word 0.
    let page = view
        .first_request::<SetDoorbellReq>(Opcode::SetDoorbell)
        .addr
        .get();
    let bit = doorbell::bit(0).expect("db_index 0");
    let word = |offset| read_vec(&mem, page + offset, 8);
    assert_eq!(word(bit.word_offset), bit.mask.to_le_bytes(), "bitmap");
    assert_eq!(
        word(bit.summary_offset),
        bit.summary_mask.to_le_bytes(),
        "summary"
    );

    let inline = |id| SendWr::new(id, SendOpcode::Send, SendPayload::Inline(b"x"));
    // The device goes to sleep (NEED_KICK, offset 0 of its doorbell page):
    // the next post rings the doorbell queue.
    write_u32(&mem, page + doorbell::FLAGS_OFFSET, doorbell::NEED_KICK);
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
    write_u32(&mem, page + doorbell::FLAGS_OFFSET, 0);
    qp.post_send(&[inline(9)]).expect("post_send");
    assert!(
        !view.take_notified().contains(&DOORBELL_QUEUE),
        "no doorbell once the device polls again"
    );

    // Past the granted max_send_wr: ENOMEM at the first WR that does not fit;
    // those before it are posted and published.
    let batch: Vec<_> = (10..15).map(inline).collect();
    let (bad_wr, errno, full) = post_failure(qp.post_send(&batch));
    assert_eq!((bad_wr, errno, full), (4, ENOMEM, true));
    assert_eq!(read_u32(&mem, sq + DRIVER_INDEX_OFFSET), 8);
    assert_eq!(post_failure(qp.post_send(&[inline(99)])), (0, ENOMEM, true));
    assert_eq!(read_u32(&mem, sq + DRIVER_INDEX_OFFSET), 8);
    // Three complete (device.index counts completed WQEs since spec 2.0):
    // three slots free up, the ring wraps.
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
    // One more than granted (5 SGEs, 80 inline bytes).
    let six = [mr.sge(0, 1); 6];
    let too_many = SendWr::new(1, SendOpcode::Send, SendPayload::Sges(&six));
    assert_eq!(post_failure(qp.post_send(&[too_many])), (0, EINVAL, false));
    let long = [0u8; 81];
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
            slid: 0,
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

#[test]
fn posting_stops_at_the_granted_depth_not_the_ring_depth() {
    let vdev = Vdev::start_with_config("granted", "[limits]\nmax_qp_depth = 100\n", &[]);
    let ctx = Context::open_vhost_user(&vdev.socket).expect("open");
    let pd = ctx.alloc_pd().expect("pd");
    let cq = ctx.create_cq(16, 0).expect("cq");
    let qp = rc_qp(&pd, &cq, caps(100, 1, 1, 0)).expect("qp");
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
